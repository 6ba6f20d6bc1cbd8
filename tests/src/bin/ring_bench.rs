//! Benchmark of ring attention (E11/E11a) on GPUs: per ring size `G`, the ring's time, its time per step, the share
//! of communication it hides behind compute, and its scaling efficiency against one GPU running the same whole
//! sequence with the dense kernel; printed as CSV (and `--csv PATH`) and as a Markdown table.
//!
//! Backends: without `--nccl`, `G` simulated devices on one GPU (a stream each, blocks copied between them): their
//! ideal time is the dense kernel's on the same GPU, so efficiency there measures what the ring adds (chunked
//! launches, E4 merges, copies competing for memory bandwidth). With `--nccl`, one GPU per ring device through NCCL
//! (rows for `G` above the GPU count are skipped, and say so): the ideal is the dense time divided by `G`.
//!
//! Method: bf16 Gaussian inputs (seeded), `--warmup` untimed runs, then the median of `--reps` runs; each run's time
//! is the longest of the devices' CUDA-event times on their compute streams (`attnproof_gpu::ring::timing`; input
//! upload, `D`, and the final conversions are outside the clock). Per ring size three runs: the ring, its compute
//! alone (blocks staged in advance), its communication alone (no attention); overlap = `(compute + comm − ring) /
//! comm`. The dense baseline is the forward kernel, or the backward with the KV-owner atomic strategy (its `D`
//! preprocess included), timed the same way. Causal rows use the bottom-right mask with both layouts (contiguous
//! shows E11's load imbalance, zigzag E11a's balance); non-causal rows the contiguous layout.
//!
//! Published reference for the last column: ring-flash-attention's zigzag ring reaches about 90% of the theoretical
//! forward + backward throughput on 8 H800 GPUs.
//!
//! Usage: `ring_bench [--shape B,H,L,D] [--devices 2,4,8] [--reps N] [--warmup N] [--backward] [--nccl]
//! [--mask none|causal] [--layout contiguous|zigzag] [--csv PATH]`.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use attnproof_gpu::backward::{
    BackwardDeviceInputs, BackwardDeviceOutputs, BackwardTiling, GpuBackwardStrategy, flash_backward_device_with,
};
use attnproof_gpu::compile::{FLASH_BWD, FLASH_FWD};
use attnproof_gpu::ring::{
    BackwardStart, GpuRingError, RingVariant, overlap, time_backward_on_streams, time_forward_on_streams,
    time_nccl_backward, time_nccl_forward,
};
use attnproof_gpu::{ForwardTiling, PreparedForward, cuda_device, nccl_present};
use attnproof_harness::Case;
use attnproof_harness::generate::{Distribution, ValueProfile, make_case, make_d_out};
use attnproof_harness::ring_gpu::{backward_start, ring_inputs};
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Mask};
use attnproof_reference::ring::{RingLayout, RingSplit};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaStream};
use half::bf16;
use ndarray::{ArrayD, IxDyn};

struct Options {
    shape: (usize, usize, usize, usize),
    devices: Vec<usize>,
    reps: usize,
    warmup: usize,
    backward: bool,
    nccl: bool,
    csv: Option<String>,
    /// `--mask none|causal`: only these rows (default both).
    causal: Option<bool>,
    /// `--layout contiguous|zigzag`: only this layout (default: contiguous without a mask, both with causal).
    layout: Option<RingLayout>,
}

fn parse() -> Result<Options, String> {
    let mut o = Options {
        shape: (1, 16, 16384, 128),
        devices: vec![2, 4, 8],
        reps: 20,
        warmup: 3,
        backward: false,
        nccl: false,
        csv: None,
        causal: None,
        layout: None,
    };
    let list = |text: &str, name: &str| -> Result<Vec<usize>, String> {
        text.split(',').map(str::parse).collect::<Result<_, _>>().map_err(|e| format!("{name}: {e}"))
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--shape" => {
                let text = value("--shape")?;
                o.shape = match list(&text, "--shape")?[..] {
                    [b, h, l, d] => (b, h, l, d),
                    _ => return Err(format!("--shape takes B,H,L,D, not `{text}`")),
                };
            }
            "--devices" => o.devices = list(&value("--devices")?, "--devices")?,
            "--reps" => o.reps = value("--reps")?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--warmup" => o.warmup = value("--warmup")?.parse().map_err(|e| format!("--warmup: {e}"))?,
            "--backward" => o.backward = true,
            "--nccl" => o.nccl = true,
            "--csv" => o.csv = Some(value("--csv")?),
            "--mask" => {
                o.causal = match value("--mask")?.as_str() {
                    "none" => Some(false),
                    "causal" => Some(true),
                    other => return Err(format!("--mask takes none or causal, not `{other}`")),
                }
            }
            "--layout" => {
                o.layout = match value("--layout")?.as_str() {
                    "contiguous" => Some(RingLayout::Contiguous),
                    "zigzag" => Some(RingLayout::Zigzag),
                    other => return Err(format!("--layout takes contiguous or zigzag, not `{other}`")),
                }
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if o.reps < 20 {
        return Err("--reps must be at least 20 (the median of fewer runs is too noisy to report)".into());
    }
    if o.devices.iter().any(|&g| g < 2) {
        return Err("--devices: a ring needs at least 2 devices".into());
    }
    let (_, _, l, d) = o.shape;
    if d % 8 != 0 || d > 256 || l == 0 {
        return Err(format!("--shape: D must be a multiple of 8 up to 256 and L positive, not L = {l}, D = {d}"));
    }
    Ok(o)
}

/// The median of `reps` results of `run` after `warmup` untimed ones.
fn median(opts: &Options, mut run: impl FnMut() -> Result<f64, String>) -> Result<f64, String> {
    for _ in 0..opts.warmup {
        run()?;
    }
    let mut ms = (0..opts.reps).map(|_| run()).collect::<Result<Vec<_>, _>>()?;
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

/// Milliseconds of `launch` on `stream` between two CUDA events.
fn event_ms(stream: &Arc<CudaStream>, launch: impl FnOnce() -> Result<(), String>) -> Result<f64, String> {
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(flags).map_err(|e| e.to_string())?;
    launch()?;
    let end = stream.record_event(flags).map_err(|e| e.to_string())?;
    end.synchronize().map_err(|e| e.to_string())?;
    start.elapsed_ms(&end).map(f64::from).map_err(|e| e.to_string())
}

/// A problem on the device: its inputs, the forward's outputs, and an upstream gradient.
struct Dense {
    q: cudarc::driver::CudaSlice<bf16>,
    k: cudarc::driver::CudaSlice<bf16>,
    v: cudarc::driver::CudaSlice<bf16>,
    o: cudarc::driver::CudaSlice<bf16>,
    lse: cudarc::driver::CudaSlice<f32>,
    d_out: cudarc::driver::CudaSlice<bf16>,
}

/// Uploads `case` and `d_out`, runs the dense forward once (untimed) for `O` and LSE.
fn dense_problem(stream: &Arc<CudaStream>, case: &Case<bf16>, d_out: &ArrayD<bf16>) -> Result<Dense, String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let up = |t: &ArrayD<bf16>| stream.clone_htod(t.as_slice().expect("standard layout")).map_err(|e| err(&e));
    let spec = &case.spec;
    let rows = spec.expected_shape(Operand::RowStat).iter().product::<usize>();
    let mut dense = Dense {
        q: up(&case.q)?,
        k: up(&case.k)?,
        v: up(&case.v)?,
        o: stream.alloc_zeros::<bf16>(d_out.len()).map_err(|e| err(&e))?,
        lse: stream.alloc_zeros::<f32>(rows).map_err(|e| err(&e))?,
        d_out: up(d_out)?,
    };
    let fwd = PreparedForward::<bf16>::new(
        stream,
        spec,
        FLASH_FWD,
        ForwardTiling::for_head_dims(spec.head_dim, spec.head_dim_v),
    )
    .map_err(|e| err(&e))?;
    fwd.launch(stream, &dense.q, &dense.k, &dense.v, &mut dense.o, &mut dense.lse).map_err(|e| err(&e))?;
    Ok(dense)
}

/// Median milliseconds of the dense forward (or backward) of `spec` on `stream`.
fn dense_ms(
    opts: &Options,
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    p: &mut Dense,
    backward: bool,
) -> Result<f64, String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    if !backward {
        let tiling = ForwardTiling::for_head_dims(spec.head_dim, spec.head_dim_v);
        let fwd = PreparedForward::<bf16>::new(stream, spec, FLASH_FWD, tiling).map_err(|e| err(&e))?;
        return median(opts, || {
            event_ms(stream, || fwd.launch(stream, &p.q, &p.k, &p.v, &mut p.o, &mut p.lse).map_err(|e| err(&e)))
        });
    }
    let n = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    let mut dq = stream.alloc_zeros::<bf16>(n(Operand::Q)).map_err(|e| err(&e))?;
    let mut dk = stream.alloc_zeros::<bf16>(n(Operand::K)).map_err(|e| err(&e))?;
    let mut dv = stream.alloc_zeros::<bf16>(n(Operand::V)).map_err(|e| err(&e))?;
    let mut delta = stream.alloc_zeros::<f32>(n(Operand::RowStat)).map_err(|e| err(&e))?;
    median(opts, || {
        event_ms(stream, || {
            let inputs = BackwardDeviceInputs { q: &p.q, k: &p.k, v: &p.v, o: &p.o, lse: &p.lse, d_out: &p.d_out };
            let outputs = BackwardDeviceOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv, delta: &mut delta };
            let strategy = GpuBackwardStrategy::KvOwnerAtomic;
            flash_backward_device_with(stream, spec, FLASH_BWD, BackwardTiling::DEFAULT, inputs, outputs, strategy)
                .map_err(|e| err(&e))
        })
    })
}

/// Where the ring runs: simulated devices on one GPU's streams, or one GPU each through NCCL.
enum Backend {
    Streams(Arc<CudaContext>),
    Nccl(Vec<Arc<CudaContext>>),
}

/// Milliseconds of one ring run of `case` in `variant` (backward when `start` is given).
fn ring_once(
    backend: &Backend,
    case: &Case<bf16>,
    start: Option<&BackwardStart<'_, bf16>>,
    split: RingSplit,
    variant: RingVariant,
) -> Result<f64, GpuRingError> {
    let inputs = ring_inputs(case);
    match backend {
        Backend::Streams(ctx) => {
            let streams: Vec<_> = (0..split.n_devices).map(|_| ctx.new_stream()).collect::<Result<_, _>>()?;
            match start {
                None => time_forward_on_streams(&inputs, split, &streams, variant),
                Some(s) => time_backward_on_streams(&inputs, s, split, &streams, variant),
            }
        }
        Backend::Nccl(contexts) => match start {
            None => time_nccl_forward(&contexts[..split.n_devices], &inputs, split, variant),
            Some(s) => time_nccl_backward(&contexts[..split.n_devices], &inputs, s, split, variant),
        },
    }
}

/// One row of the report.
struct Row {
    pass: &'static str,
    causal: bool,
    layout: RingLayout,
    n_devices: usize,
    gpus: usize,
    dense_ms: f64,
    ring_ms: f64,
    compute_ms: f64,
    comm_ms: f64,
}

impl Row {
    fn efficiency(&self) -> f64 {
        self.dense_ms / (self.gpus as f64 * self.ring_ms)
    }

    fn csv(&self) -> String {
        format!(
            "{},{},{:?},{},{},{:.4},{:.4},{:.4},{:.4},{:.4},{:.3},{:.3}\n",
            self.pass,
            self.causal,
            self.layout,
            self.n_devices,
            self.gpus,
            self.dense_ms,
            self.ring_ms,
            self.ring_ms / self.n_devices as f64,
            self.compute_ms,
            self.comm_ms,
            overlap(self.ring_ms, self.compute_ms, self.comm_ms),
            self.efficiency()
        )
    }
}

fn run(opts: &Options) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let ctx = cuda_device().map_err(|e| err(&e))?;
    let gpus_here = CudaContext::device_count().map_err(|e| err(&e))? as usize;
    let backend = if opts.nccl {
        if !nccl_present() {
            return Err("--nccl: the NCCL library cannot be loaded".into());
        }
        let n = opts.devices.iter().copied().filter(|&g| g <= gpus_here).max().unwrap_or(0);
        Backend::Nccl((0..n).map(|i| CudaContext::new(i).map_err(|e| err(&e))).collect::<Result<_, _>>()?)
    } else {
        Backend::Streams(ctx.clone())
    };
    let stream = ctx.new_stream().map_err(|e| err(&e))?;
    let (b, h, l, d) = opts.shape;
    let profile = ValueProfile { distribution: Distribution::Gaussian, logit_scale: 1.0, value_mean: 0.0 };
    let header = "pass,causal,layout,devices,gpus,dense_ms,ring_ms,step_ms,compute_ms,comm_ms,overlap,efficiency\n";
    let mut out = String::from(header);
    print!("{header}");
    let mut rows = vec![];
    let passes: &[bool] = if opts.backward { &[false, true] } else { &[false] };
    for causal in [false, true].into_iter().filter(|c| opts.causal.is_none_or(|only| only == *c)) {
        let spec = AttentionSpec::dense(b, h, h, l, l, d, d).with_mask(if causal { Mask::Causal } else { Mask::None });
        let case = make_case::<bf16>(&spec, profile, 7);
        let d_out = make_d_out::<bf16>(&spec, 8);
        let mut dense = dense_problem(&stream, &case, &d_out)?;
        let o_shape = spec.expected_shape(Operand::O);
        let o = ArrayD::from_shape_vec(IxDyn(&o_shape), stream.clone_dtoh(&dense.o).map_err(|e| err(&e))?)
            .map_err(|e| err(&e))?;
        let lse_shape = spec.expected_shape(Operand::RowStat);
        let lse = ArrayD::from_shape_vec(IxDyn(&lse_shape), stream.clone_dtoh(&dense.lse).map_err(|e| err(&e))?)
            .map_err(|e| err(&e))?;
        let layouts: Vec<RingLayout> = match (opts.layout, causal) {
            (Some(only), _) => vec![only],
            (None, true) => vec![RingLayout::Contiguous, RingLayout::Zigzag],
            (None, false) => vec![RingLayout::Contiguous],
        };
        for &backward in passes {
            let dense_time = dense_ms(opts, &stream, &spec, &mut dense, backward)?;
            let start = backward.then(|| backward_start(&o, &lse, &d_out));
            for &layout in &layouts {
                for &g in &opts.devices {
                    let gpus = match &backend {
                        Backend::Streams(_) => 1,
                        Backend::Nccl(contexts) if g <= contexts.len() => g,
                        Backend::Nccl(_) => {
                            println!("# skipped: G = {g} needs {g} GPUs, {gpus_here} here");
                            continue;
                        }
                    };
                    let split = RingSplit { n_devices: g, layout };
                    let time = |variant| {
                        median(opts, || ring_once(&backend, &case, start.as_ref(), split, variant).map_err(|e| err(&e)))
                    };
                    let row = Row {
                        pass: if backward { "bwd" } else { "fwd" },
                        causal,
                        layout,
                        n_devices: g,
                        gpus,
                        dense_ms: dense_time,
                        ring_ms: time(RingVariant::Full)?,
                        compute_ms: time(RingVariant::ComputeOnly)?,
                        comm_ms: time(RingVariant::CommOnly)?,
                    };
                    let line = row.csv();
                    print!("{line}");
                    std::io::stdout().flush().ok();
                    out.push_str(&line);
                    rows.push(row);
                }
            }
        }
    }
    println!("\n{}", table(opts, &rows));
    if let Some(path) = &opts.csv {
        std::fs::write(path, &out).map_err(|e| format!("write {path}: {e}"))?;
    }
    Ok(())
}

/// The Markdown report: one line per row, then forward + backward efficiency per ring where both passes ran.
fn table(opts: &Options, rows: &[Row]) -> String {
    let (b, h, l, d) = opts.shape;
    let mut t = format!(
        "ring attention, bf16, (B,H,L,D) = ({b},{h},{l},{d}) in total, medians of {} runs\n\n\
         | pass | mask | layout | G | GPUs | dense ms | ring ms | ms/step | compute ms | comm ms | overlap | efficiency |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        opts.reps
    );
    for r in rows {
        t += &format!(
            "| {} | {} | {:?} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.0}% | {:.0}% |\n",
            r.pass,
            if r.causal { "causal" } else { "none" },
            r.layout,
            r.n_devices,
            r.gpus,
            r.dense_ms,
            r.ring_ms,
            r.ring_ms / r.n_devices as f64,
            r.compute_ms,
            r.comm_ms,
            100.0 * overlap(r.ring_ms, r.compute_ms, r.comm_ms),
            100.0 * r.efficiency()
        );
    }
    let both: Vec<String> = rows
        .iter()
        .filter(|f| f.pass == "fwd")
        .filter_map(|f| {
            let bwd = rows
                .iter()
                .find(|r| r.pass == "bwd" && (r.causal, r.layout, r.n_devices) == (f.causal, f.layout, f.n_devices))?;
            let eff = (f.dense_ms + bwd.dense_ms) / (f.gpus as f64 * (f.ring_ms + bwd.ring_ms));
            let mask = if f.causal { "causal" } else { "none" };
            Some(format!("| {mask} | {:?} | {} | {} | {:.0}% |\n", f.layout, f.n_devices, f.gpus, 100.0 * eff))
        })
        .collect();
    if !both.is_empty() {
        t += "\nforward + backward efficiency (ring-flash-attention, published: zigzag about 90% on 8 H800)\n\n\
              | mask | layout | G | GPUs | fwd+bwd efficiency |\n| --- | --- | --- | --- | --- |\n";
        t += &both.concat();
    }
    t
}

fn main() -> ExitCode {
    let opts = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("ring_bench: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ring_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
