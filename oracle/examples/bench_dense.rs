//! Benchmark of the fast f64 oracle path: one problem of `heads` heads, `Lq = Lk = len`, forward
//! and forward + backward, wall-clock seconds (best and median of `--reps`). Not a test: it
//! reports, it asserts nothing. Run with `cargo xtask bench-oracle` (release build).

use std::time::Instant;

use attnproof_oracle::inputs::uniform_tensor as tensor;
use attnproof_oracle::{AttentionSpec, Mask, backward_f64, forward_f64};

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().unwrap_or_else(|e| panic!("{name} {v}: {e}")))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let len = arg(&args, "--len", 16384);
    let d = arg(&args, "--head-dim", 128);
    let heads = arg(&args, "--heads", 1);
    let reps = arg(&args, "--reps", 1).max(1);
    let causal = args.iter().any(|a| a == "--causal");
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
    println!(
        "bench_dense: heads={heads} Lq=Lk={len} d=dv={d} causal={causal} threads={} reps={reps}",
        rayon::current_num_threads()
    );
    let time = |f: &dyn Fn()| {
        let mut t: Vec<f64> = (0..reps)
            .map(|_| {
                let start = Instant::now();
                f();
                start.elapsed().as_secs_f64()
            })
            .collect();
        t.sort_by(f64::total_cmp);
        (t[0], t[t.len() / 2])
    };
    let (best, median) = time(&|| {
        forward_f64(&spec, q.view(), k.view(), v.view()).expect("valid problem");
    });
    println!("forward:            best {best:.2} s, median {median:.2} s");
    let (best, median) = time(&|| {
        backward_f64(&spec, q.view(), k.view(), v.view(), g.view()).expect("valid problem");
    });
    println!("forward + backward: best {best:.2} s, median {median:.2} s");
}
