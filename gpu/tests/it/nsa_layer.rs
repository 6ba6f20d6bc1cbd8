//! One NSA layer on the device (`attnproof_gpu::nsa::layer`), forward and backward, judged stage by stage by the
//! harness (`attnproof_harness::nsa_layer`): every stage against the oracle on the inputs it actually had, within the
//! bound derived for it. Each draw runs the forward twice (the same bits), then the backward with atomic dQ and twice
//! with deterministic dQ (the same bits for every gradient and intermediate), all into NaN-poisoned outputs followed by
//! guard bands, with the inputs and lists checked unchanged. Bad inputs (gate logits of the wrong shape or too short a
//! buffer, a mask that is not causal, queries and keys of different lengths, two traversals for dQ) are typed errors
//! that leave every output as it was: nothing was launched.
//!
//! The suites draw [`layer_draws`]: short compression windows and selection blocks, lengths around them, GQA groups
//! 1–16 over one or two KV heads, E31's head dims and small ones, dense and varlen with empty sequences, gate logits
//! up to ±100. Without a device each test prints `skipped: no CUDA device` and passes.

use std::sync::Arc;

use crate::common::*;
use crate::property::{SECOND_INPUT, assert_typed_suites_reach, run_typed_production};
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::nsa::gates::NSA_GATES;
use attnproof_gpu::nsa::layer::{
    BranchGradients, NsaLayerBackward, NsaLayerBackwardDevice, NsaLayerBackwardInputs, NsaLayerForward,
    NsaLayerForwardDevice, NsaLayerHostInputs, NsaLayerInputs, NsaLayerKernels, nsa_layer_backward_device,
    nsa_layer_forward, nsa_layer_forward_device,
};
use attnproof_gpu::{GpuBackwardStrategy, GpuError};
use attnproof_harness::Case;
use attnproof_harness::flash::HarnessError;
use attnproof_harness::generate::{ValueProfile, make_case, make_d_out};
use attnproof_harness::nsa::LogitRange;
use attnproof_harness::nsa_layer::{
    LayerDraw, gate_logits, is_varlen, layer_backward_guarded, layer_case, layer_draws, layer_forward_guarded,
    verify_layer_backward, verify_layer_forward,
};
use attnproof_oracle::nsa::{Compression, NsaConfig};
use attnproof_oracle::{AttentionSpec, Mask};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::ArrayD;
use proptest::test_runner::{Config, TestCaseError, TestError};

/// The two suites ("gpunsaly" in ASCII, plus the dtype).
pub const LAYER_SUITES: [TypedSuite; 2] = [
    TypedSuite { name: "gpu_nsa_layer_bf16", bf16: true, cases: 16, seed: 0x6770_756e_7361_6c79 },
    TypedSuite { name: "gpu_nsa_layer_f16", bf16: false, cases: 12, seed: 0x6770_756e_7361_6c7a },
];

/// A verifier's error as a test outcome: a draw whose values break the error model's first-order hypothesis is
/// rejected (as in the other suites), anything else fails.
fn judged<V>(what: &str, result: Result<V, HarnessError>) -> Result<V, TestCaseError> {
    match result {
        Ok(v) => Ok(v),
        Err(HarnessError::Model(m)) => Err(TestCaseError::reject(m.to_string())),
        Err(e) => Err(TestCaseError::fail(format!("{what}: {e}"))),
    }
}

/// One draw (module docs), the gates' text `gates` in place of the embedded one.
fn check_draw<T: Storage>(
    stream: &Arc<CudaStream>,
    gates: KernelSource,
    draw: &LayerDraw,
) -> Result<(), TestCaseError> {
    let fail = |what: &str, e: &dyn std::fmt::Display| TestCaseError::fail(format!("{what}: {e}"));
    let kernels = NsaLayerKernels { gates, ..NsaLayerKernels::default() };
    let config = &draw.config;
    let (case, logits) = layer_case::<T>(draw, draw.seed);
    let forward = layer_forward_guarded(stream, &case, config, &kernels, &logits).map_err(|e| fail("forward", &e))?;
    let again = layer_forward_guarded(stream, &case, config, &kernels, &logits).map_err(|e| fail("forward", &e))?;
    if !same_forward(&forward, &again) {
        return Err(TestCaseError::fail("two forwards of the same input differ bitwise"));
    }
    let verdict = judged("forward", verify_layer_forward(&case, config, &logits, &forward))?;
    if !(verdict.passed() && verdict.valid()) {
        return Err(TestCaseError::fail(format!("forward, stages {:?}:\n{verdict}", verdict.failed_stages())));
    }
    let d_out = make_d_out::<T>(&case.spec, draw.seed ^ SECOND_INPUT);
    let run = |strategy| {
        layer_backward_guarded(stream, &case, config, (&kernels, strategy), (&logits, &d_out), &forward)
            .map_err(|e| fail(&format!("backward {strategy:?}"), &e))
    };
    let atomic = run(GpuBackwardStrategy::KvOwnerAtomic)?;
    let deterministic =
        [run(GpuBackwardStrategy::KvOwnerDeterministic)?, run(GpuBackwardStrategy::KvOwnerDeterministic)?];
    if !same_backward(&deterministic[0], &deterministic[1]) {
        return Err(TestCaseError::fail("two deterministic backwards of the same input differ"));
    }
    for (name, grads) in [("atomic", &atomic), ("deterministic", &deterministic[0])] {
        let verdict = judged(name, verify_layer_backward(&case, config, (&logits, &d_out), &forward, grads))?;
        if !(verdict.passed() && verdict.valid()) {
            return Err(TestCaseError::fail(format!(
                "{name} backward, stages {:?}:\n{verdict}",
                verdict.failed_stages()
            )));
        }
    }
    Ok(())
}

/// Bitwise equality of storage-type tensors (NaN-safe, unlike `==` on values).
fn bitwise_equal<T: Storage>(a: &ArrayD<T>, b: &ArrayD<T>) -> bool {
    a.shape() == b.shape() && a.iter().zip(b).all(|(x, y)| x.bits() == y.bits())
}

/// Every tensor of two forwards bitwise equal.
fn same_forward<T: Storage>(a: &NsaLayerForward<T>, b: &NsaLayerForward<T>) -> bool {
    let f32_bits = |x: &ArrayD<f32>, y: &ArrayD<f32>| x.iter().map(|v| v.to_bits()).eq(y.iter().map(|v| v.to_bits()));
    [
        (&a.k_cmp, &b.k_cmp),
        (&a.v_cmp, &b.v_cmp),
        (&a.o_cmp, &b.o_cmp),
        (&a.o_slc, &b.o_slc),
        (&a.o_win, &b.o_win),
        (&a.o, &b.o),
    ]
    .iter()
    .all(|(x, y)| bitwise_equal(x, y))
        && f32_bits(&a.lse_cmp, &b.lse_cmp)
        && f32_bits(&a.lse_slc, &b.lse_slc)
        && f32_bits(&a.lse_win, &b.lse_win)
        && f32_bits(&a.scores.clone().into_dyn(), &b.scores.clone().into_dyn())
        && a.lists == b.lists
}

/// Every tensor of two backwards bitwise equal.
fn same_backward<T: Storage>(a: &NsaLayerBackward<T>, b: &NsaLayerBackward<T>) -> bool {
    let f32_bits = |x: &ArrayD<f32>, y: &ArrayD<f32>| x.iter().map(|v| v.to_bits()).eq(y.iter().map(|v| v.to_bits()));
    let branch = |x: &BranchGradients<T>, y: &BranchGradients<T>| {
        bitwise_equal(&x.dq, &y.dq)
            && bitwise_equal(&x.dk, &y.dk)
            && bitwise_equal(&x.dv, &y.dv)
            && f32_bits(&x.delta, &y.delta)
    };
    [(&a.dq, &b.dq), (&a.dk, &b.dk), (&a.dv, &b.dv), (&a.d_o_cmp, &b.d_o_cmp), (&a.d_o_slc, &b.d_o_slc)]
        .iter()
        .chain(&[(&a.d_o_win, &b.d_o_win), (&a.dk_pool, &b.dk_pool), (&a.dv_pool, &b.dv_pool)])
        .all(|(x, y)| bitwise_equal(x, y))
        && f32_bits(&a.d_gate_logits, &b.d_gate_logits)
        && branch(&a.compressed, &b.compressed)
        && branch(&a.selected, &b.selected)
        && branch(&a.window, &b.window)
        && a.d_maps.iter().zip(&b.d_maps).all(|(x, y)| match (x, y) {
            (Some(x), Some(y)) => x.iter().map(|v| v.to_bits()).eq(y.iter().map(|v| v.to_bits())),
            (x, y) => x.is_none() && y.is_none(),
        })
}

/// Runs a suite's draws under `config` with the gates' text `gates` on `stream`; a failing draw comes back described.
pub fn run_layer_suite(
    suite: &TypedSuite,
    config: Config,
    stream: &Arc<CudaStream>,
    gates: KernelSource,
) -> Result<(), Box<TestError<String>>> {
    let describe =
        |d: &LayerDraw| format!("{:?} {:?} {:?} {:?} seed {}", d.layer, d.config, d.profile, d.logits, d.seed);
    if suite.bf16 {
        run_described(config, layer_draws(), |d| check_draw::<bf16>(stream, gates, d), describe)
    } else {
        run_described(config, layer_draws(), |d| check_draw::<f16>(stream, gates, d), describe)
    }
}

#[test]
fn the_layer_is_within_bound_stage_by_stage_bf16() {
    run_typed_production(&LAYER_SUITES[0], NSA_GATES, run_layer_suite);
}

#[test]
fn the_layer_is_within_bound_stage_by_stage_f16() {
    run_typed_production(&LAYER_SUITES[1], NSA_GATES, run_layer_suite);
}

/// Regression (`gpu_nsa_layer_bf16`, its first run on the H200): gate logits of ±100 make the window branch's
/// `dO_win = σ(x_win) dO` bf16 subnormals, so a row's dQ partial is an f32 subnormal (about `1.1·10^-38`), which the
/// atomic dQ accumulation (`atom.add.f32`) flushes to zero: dQ came back 0 against the oracle's `1.9·10^-39`, outside
/// the dense backward's bound until that bound counted the flush (`|α| n_k 2^-126`, `proofs::flash_bound`). The draw,
/// replayed: one head of 31 tokens, d = 32, dv = 16, blocks of 16, two selected, a window of 64.
#[test]
fn subnormal_branch_gradients_through_atomic_dq() {
    let Some(stream) = device_stream("nsa_layer::subnormal_branch_gradients_through_atomic_dq") else { return };
    let draw = LayerDraw {
        layer: AttentionSpec::dense(1, 1, 1, 31, 31, 32, 16).with_mask(Mask::Causal),
        config: NsaConfig {
            select_block: 16,
            n_selected: 2,
            n_forced_initial: 0,
            n_forced_local: 0,
            window: 64,
            ..NsaConfig::default()
        },
        profile: ValueProfile::GAUSSIAN,
        logits: LogitRange::Extreme,
        seed: 3_836_102_932_399_822_190,
    };
    check_draw::<bf16>(&stream, NSA_GATES, &draw).expect("within every stage's bound");
}

/// Tiny layers for compute-sanitizer (`run.sh sanitize`): varlen with an empty sequence and a GQA group of 3, a
/// learned key matrix and weighted values, the window and the selection blocks shorter than the sequences; every piece
/// of the chain, the branch sums and the matrix gradient run under memcheck.
#[test]
fn sanitizer_shapes() {
    let Some(stream) = device_stream("nsa_layer::sanitizer_shapes") else { return };
    let (l, d) = (8, 16);
    let matrix = ndarray::Array2::from_shape_fn((l * d, d), |(r, c)| ((r * 5 + c * 3) % 7) as f64 / 8.0 - 0.375);
    let draw = LayerDraw {
        layer: varlen(&[0, 37, 37, 70], &[0, 37, 37, 70], 3, 1, d, 16, Mask::Causal),
        config: NsaConfig {
            compress_len: l,
            compress_stride: 4,
            select_block: 16,
            n_selected: 3,
            n_forced_initial: 1,
            n_forced_local: 1,
            window: 16,
            compress_keys: Compression::Linear(matrix),
            compress_values: Compression::Weighted((0..l).map(|i| 1.0 / (i as f64 + 2.0)).collect()),
            ..NsaConfig::default()
        },
        profile: ValueProfile::GAUSSIAN,
        logits: LogitRange::Unit,
        seed: 0x5a11,
    };
    check_draw::<bf16>(&stream, NSA_GATES, &draw).expect("within every stage's bound");
}

/// The classes a draw reaches.
fn classes(d: &LayerDraw) -> Vec<&'static str> {
    let group = d.layer.group_size();
    let lens: Vec<usize> = d.layer.sequences().iter().map(|s| s.len_q).collect();
    [
        ("varlen", is_varlen(&d.layer)),
        ("empty sequence", lens.contains(&0)),
        ("group > 8", group > 8),
        ("group not a power of two", !group.is_power_of_two()),
        ("d 192, dv 128", d.layer.head_dim == 192 && d.layer.head_dim_v == 128),
        ("small head dim", d.layer.head_dim <= 32),
        ("large gate logits", d.logits == LogitRange::Extreme || d.logits == LogitRange::Wide),
        ("no complete window", lens.iter().any(|&l| l > 0 && l < d.config.compress_len)),
        ("several blocks", lens.iter().any(|&l| l > 2 * d.config.select_block)),
        (
            "learned compression matrix",
            [&d.config.compress_keys, &d.config.compress_values].iter().any(|m| matches!(m, Compression::Linear(_))),
        ),
    ]
    .into_iter()
    .filter_map(|(class, reached)| reached.then_some(class))
    .collect()
}

const ALL_CLASSES: [&str; 10] = [
    "varlen",
    "empty sequence",
    "group > 8",
    "group not a power of two",
    "d 192, dv 128",
    "small head dim",
    "large gate logits",
    "no complete window",
    "several blocks",
    "learned compression matrix",
];

/// The suites' fixed seeds, replayed without a device, reach every class.
#[test]
fn the_layer_suites_draw_every_class() {
    assert_typed_suites_reach(&LAYER_SUITES, layer_draws, classes, &ALL_CLASSES);
}

/// Bad input is a typed error before any launch: every output buffer keeps its NaN poison. The host wrapper names
/// gate logits of the wrong shape; the device wrapper a gate-logit buffer too short, a mask that is not causal,
/// queries and keys of different lengths, and two traversals for dQ.
#[test]
fn bad_input_is_a_typed_error_and_launches_nothing() {
    let Some(stream) = device_stream("nsa_layer::bad_input_is_a_typed_error_and_launches_nothing") else { return };
    let kernels = NsaLayerKernels::default();
    let config = NsaConfig {
        compress_len: 8,
        compress_stride: 4,
        select_block: 16,
        n_selected: 3,
        window: 16,
        ..NsaConfig::default()
    };
    let spec = AttentionSpec::dense(1, 4, 2, 70, 70, 64, 64).with_mask(Mask::Causal);
    let case: Case<bf16> = make_case(&spec, ValueProfile::GAUSSIAN, 5);
    let logits = gate_logits::<bf16>(&spec, LogitRange::Unit, 5);

    let short_logits = logits.slice(ndarray::s![.., .., .., ..2]).to_owned().into_dyn();
    let host =
        NsaLayerHostInputs { q: case.q.view(), k: case.k.view(), v: case.v.view(), gate_logits: short_logits.view() };
    let err = nsa_layer_forward(&stream, &spec, &config, &kernels, &host).unwrap_err();
    assert!(matches!(err, GpuError::Shape { argument: "gate_logits", .. }), "{err}");

    let up = |t: &ArrayD<bf16>| upload(&stream, t).expect("upload");
    let (q, k, v, x) = (up(&case.q), up(&case.k), up(&case.v), up(&logits));
    let short = up(&short_logits);
    let poison = |n: usize| stream.clone_htod(&vec![bf16::NAN; n.max(1)]).expect("poison");
    let poison32 = |n: usize| stream.clone_htod(&vec![f32::NAN; n.max(1)]).expect("poison");
    let mut out = NsaLayerForwardDevice::<bf16>::alloc(&stream, &spec, &config).expect("alloc");
    out.o = poison(out.o.len());
    out.o_cmp = poison(out.o_cmp.len());
    out.lse_cmp = poison32(out.lse_cmp.len());
    let untouched = |out: &NsaLayerForwardDevice<bf16>| {
        let o = stream.clone_dtoh(&out.o).expect("download");
        let o_cmp = stream.clone_dtoh(&out.o_cmp).expect("download");
        let lse = stream.clone_dtoh(&out.lse_cmp).expect("download");
        stream.synchronize().expect("synchronize");
        o.iter().chain(&o_cmp).all(|x| x.is_nan()) && lse.iter().all(|x| x.is_nan())
    };
    let inputs = |gate_logits| NsaLayerInputs { q: &q, k: &k, v: &v, gate_logits };
    let err = nsa_layer_forward_device(&stream, &spec, &config, &kernels, inputs(&short), &mut out).unwrap_err();
    assert!(matches!(err, GpuError::BufferTooSmall { argument: "gate_logits", .. }), "{err}");
    let open = spec.clone().with_mask(Mask::None);
    let err = nsa_layer_forward_device(&stream, &open, &config, &kernels, inputs(&x), &mut out).unwrap_err();
    assert!(matches!(err, GpuError::Unsupported { argument: "mask", .. }), "{err}");
    let cross = AttentionSpec::dense(1, 4, 2, 70, 71, 64, 64).with_mask(Mask::Causal);
    let err = nsa_layer_forward_device(&stream, &cross, &config, &kernels, inputs(&x), &mut out).unwrap_err();
    assert!(matches!(err, GpuError::Unsupported { argument: "layout", .. }), "{err}");
    assert!(untouched(&out), "a refused forward wrote its outputs");

    let mut grads = NsaLayerBackwardDevice::<bf16>::alloc(&stream, &spec, &config).expect("alloc");
    grads.dq = poison(grads.dq.len());
    let d_out = up(&make_d_out::<bf16>(&spec, 6));
    let backward = NsaLayerBackwardInputs { layer: inputs(&x), forward: &out, d_out: &d_out };
    let two = GpuBackwardStrategy::TwoTraversals;
    let err = nsa_layer_backward_device(&stream, &spec, &config, &kernels, backward, two, &mut grads).unwrap_err();
    assert!(matches!(err, GpuError::Unsupported { argument: "strategy", .. }), "{err}");
    let backward = NsaLayerBackwardInputs { layer: inputs(&short), forward: &out, d_out: &d_out };
    let atomic = GpuBackwardStrategy::KvOwnerAtomic;
    let err = nsa_layer_backward_device(&stream, &spec, &config, &kernels, backward, atomic, &mut grads).unwrap_err();
    assert!(matches!(err, GpuError::BufferTooSmall { argument: "gate_logits", .. }), "{err}");
    let dq = stream.clone_dtoh(&grads.dq).expect("download");
    stream.synchronize().expect("synchronize");
    assert!(dq.iter().all(|x| x.is_nan()), "a refused backward wrote dQ");
    // The same buffers then run: the refusals left nothing behind.
    nsa_layer_forward_device(&stream, &spec, &config, &kernels, inputs(&x), &mut out).expect("a valid forward");
    let o = stream.clone_dtoh(&out.o).expect("download");
    stream.synchronize().expect("synchronize");
    assert!(o.iter().all(|x| x.is_finite()));
}
