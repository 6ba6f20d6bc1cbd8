//! Benchmark of the fast f64 oracle path: one problem of `heads` heads, `Lq = Lk = len`, forward and forward +
//! backward, wall-clock seconds (best and median of `--reps`, at least two so that the best is a warm run), GFLOP/s
//! and the fraction of the machine's f64 peak; beside it, when `python3` can import NumPy (and `--no-numpy` is not
//! given), the textbook NumPy code of `bench/numpy_attention.py` on the same inputs (one head), with the ratio. Not a
//! test: it reports, it asserts nothing. Run with `cargo xtask bench-oracle` (release build).
//!
//! Then the MPFR row (`--mpfr-len`, default 128, 0 to leave it out; `--mpfr-head-dim`, default 64; `--mpfr-bits`,
//! default 256): the oracle's MPFR forward on one head beside mpmath's (`bench/mpmath_attention.py`, when `python3`
//! can import mpmath and `--no-numpy` is not given), in multiply-adds per second.
//!
//! FLOPs are the textbook counts of the products, `4 L² d` for the forward (`Q Kᵀ`, `P V`) and `12 L² d` for forward +
//! backward (adding `Pᵀ dO`, `dO Vᵀ`, `dS K`, `dSᵀ Q`) per head, the same for both sides, whatever the mask (neither
//! skips masked work) and although the oracle's backward recomputes `Q Kᵀ`. The peak is `threads × GHz × 16`: two
//! 256-bit FMA units per core, 4 f64 lanes, 2 FLOPs per FMA (the clock from `/proc/cpuinfo`, or `--ghz`). A core with
//! two 512-bit FMA units peaks at twice that.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use attnproof_oracle::inputs::uniform_tensor as tensor;
use attnproof_oracle::{AttentionSpec, Mask, Precision, backward_f64, forward_f64, forward_mpfr};
use ndarray::ArrayD;

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T
where
    T::Err: std::fmt::Display,
{
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().unwrap_or_else(|e| panic!("{name} {v}: {e}")))
}

/// The clock in GHz from the first `cpu MHz` line of `/proc/cpuinfo`, if there is one.
fn cpuinfo_ghz() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("cpu MHz"))?;
    line.split(':').nth(1)?.trim().parse::<f64>().ok().map(|mhz| mhz / 1000.0)
}

/// Best and median of `reps` timed runs of `f`.
fn time(reps: usize, f: &dyn Fn()) -> (f64, f64) {
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    (t[0], t[t.len() / 2])
}

/// Writes `x` as little-endian f64 to `path` (the layout `numpy.fromfile` reads).
fn write_f64(path: &Path, x: &ArrayD<f64>) {
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Writes the first head of each input to a fresh folder, runs `python3 bench/SCRIPT FOLDER ARGS...` and returns its
/// standard output, or why it did not run (`python3` cannot import `module`, or the script failed).
fn python_peer(
    module: &str,
    script: &str,
    inputs: &[(&str, &ArrayD<f64>)],
    rows: usize,
    d: usize,
    args: &[String],
) -> Result<String, String> {
    let imports = Command::new("python3").args(["-c", &format!("import {module}")]).output();
    if !imports.is_ok_and(|o| o.status.success()) {
        return Err(format!("python3 cannot import {module}"));
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench").join(script);
    let folder = std::env::temp_dir().join(format!("attnproof-bench-oracle-{}-{module}", std::process::id()));
    std::fs::create_dir_all(&folder).map_err(|e| e.to_string())?;
    for (name, x) in inputs {
        // The first head: `[1, heads, len, d]` is head-major, so its rows come first.
        let head = ArrayD::from_shape_vec(vec![rows, d], x.iter().take(rows * d).copied().collect()).expect("one head");
        write_f64(&folder.join(format!("{name}.f64")), &head);
    }
    let out = Command::new("python3").arg(&script).arg(&folder).args(args).output().map_err(|e| e.to_string());
    let _ = std::fs::remove_dir_all(&folder);
    let out = out?;
    if !out.status.success() {
        return Err(format!("{} failed: {}", script.display(), String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The number after `label` on a line of `text`.
fn seconds(text: &str, label: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(label)).and_then(|v| v.trim().parse::<f64>().ok())
}

/// NumPy's best forward and forward + backward seconds on the first head of these inputs, or why there are none.
fn numpy_times(inputs: [&ArrayD<f64>; 4], len: usize, d: usize, reps: usize) -> Result<(f64, f64), String> {
    let named: Vec<(&str, &ArrayD<f64>)> = ["q", "k", "v", "do"].into_iter().zip(inputs).collect();
    let args = [len, d, reps].map(|n| n.to_string());
    let text = python_peer("numpy", "numpy_attention.py", &named, len, d, &args)?;
    match (seconds(&text, "numpy forward "), seconds(&text, "numpy forward+backward ")) {
        (Some(f), Some(fb)) => Ok((f, fb)),
        _ => Err(format!("unexpected output of numpy_attention.py: {text}")),
    }
}

/// The MPFR row: the oracle's forward at `bits` on one head of `len` rows and head dim `d`, beside mpmath's on the
/// same inputs (`bench/mpmath_attention.py`), in multiply-adds per second (`2 L² d`, the two products; the
/// exponentials and the softmax's sums are not counted, on either side).
fn mpfr_row(len: usize, d: usize, bits: u32, reps: usize, with_mpmath: bool) {
    let spec = AttentionSpec::dense(1, 1, 1, len, len, d, d);
    let (q, k, v) = (tensor(5, &[1, 1, len, d]), tensor(6, &[1, 1, len, d]), tensor(7, &[1, 1, len, d]));
    let (best, median) = time(reps, &|| {
        forward_mpfr(&spec, q.view(), k.view(), v.view(), Precision(bits)).expect("valid problem");
    });
    let macs = 2.0 * (len * len * d) as f64;
    println!(
        "MPFR {bits}-bit forward: L={len} d={d}, best {best:.3} s, median {median:.3} s, {:.2} M multiply-adds/s",
        macs / best / 1e6
    );
    if !with_mpmath {
        return;
    }
    let args = [len.to_string(), d.to_string(), bits.to_string(), reps.to_string()];
    let named = [("q", &q), ("k", &k), ("v", &v)];
    match python_peer("mpmath", "mpmath_attention.py", &named, len, d, &args) {
        Ok(text) => {
            let backend = text.lines().find_map(|l| l.strip_prefix("mpmath backend ")).unwrap_or("?");
            for label in ["textbook", "fdot"] {
                match seconds(&text, &format!("mpmath {label} ")) {
                    Some(t) => println!(
                        "mpmath {bits}-bit forward ({label}, {backend} backend): best {t:.3} s, {:.2} M multiply-adds/s; \
                         oracle / mpmath speed: {:.1}",
                        macs / t / 1e6,
                        t / best
                    ),
                    None => println!("mpmath {label}: unexpected output: {text}"),
                }
            }
        }
        Err(why) => println!("mpmath: not run ({why})"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let len = arg(&args, "--len", 16384usize);
    let d = arg(&args, "--head-dim", 128usize);
    let heads = arg(&args, "--heads", 1usize);
    let reps = arg(&args, "--reps", 2usize).max(1);
    let causal = args.iter().any(|a| a == "--causal");
    let threads = rayon::current_num_threads();
    let ghz = arg(&args, "--ghz", cpuinfo_ghz().unwrap_or(f64::NAN));
    let mut spec = AttentionSpec::dense(1, heads, heads, len, len, d, d);
    if causal {
        spec = spec.with_mask(Mask::Causal);
    }
    let (q, k, v, g) = (
        tensor(1, &[1, heads, len, d]),
        tensor(2, &[1, heads, len, d]),
        tensor(3, &[1, heads, len, d]),
        tensor(4, &[1, heads, len, d]),
    );
    let peak = threads as f64 * ghz * 16.0;
    println!("bench_dense: heads={heads} Lq=Lk={len} d=dv={d} causal={causal} threads={threads} reps={reps}");
    println!("f64 peak: {threads} threads x {ghz:.2} GHz x 16 FLOP/cycle = {peak:.1} GFLOP/s");
    let gflop = |units: f64| units * (len * len * d * heads) as f64 / 1e9;
    let row = |label: &str, best: f64, median: f64, flops: f64| {
        let rate = flops / best;
        println!(
            "{label:<20} best {best:.2} s, median {median:.2} s, {rate:.1} GFLOP/s, {:.0} % of peak",
            100.0 * rate / peak
        );
    };
    let forward = time(reps, &|| {
        forward_f64(&spec, q.view(), k.view(), v.view()).expect("valid problem");
    });
    row("forward:", forward.0, forward.1, gflop(4.0));
    let both = time(reps, &|| {
        backward_f64(&spec, q.view(), k.view(), v.view(), g.view()).expect("valid problem");
    });
    row("forward + backward:", both.0, both.1, gflop(12.0));
    let no_python = args.iter().any(|a| a == "--no-numpy");
    let mpfr_len = arg(&args, "--mpfr-len", 128usize);
    if mpfr_len > 0 {
        mpfr_row(mpfr_len, arg(&args, "--mpfr-head-dim", 64usize), arg(&args, "--mpfr-bits", 256u32), reps, !no_python);
    }
    if no_python || causal {
        return;
    }
    match numpy_times([&q, &k, &v, &g], len, d, reps) {
        Ok((f, fb)) => {
            // NumPy runs one head: compare per head.
            let per_head = |t: f64| t / heads as f64;
            println!(
                "numpy (one head):    forward {f:.2} s, forward + backward {fb:.2} s; oracle / numpy speed: forward \
                 {:.2}, forward + backward {:.2} (above 1: the oracle is faster)",
                f / per_head(forward.0),
                fb / per_head(both.0)
            );
        }
        Err(why) => println!("numpy: not run ({why})"),
    }
}
