//! DSA's token-sparse attention backward (`attnproof_gpu::dsa::sparse_backward`, the gradients of E16's main attention
//! over fixed lists) on the device: every draw runs the production forward, then the backward on inputs A, B, A,
//! NaN-poisoned and guarded with the inputs and lists checked unchanged. Each (sequence, KV head) is held by the harness
//! (`attnproof_harness::dsa_sparse::verify_token_sparse_backward`) to the dense backward's derived bound for the
//! group's rows stacked token-major under "key listed for the token"; A's two runs give the same bits for dQ and `D`
//! (a token owns its rows), while dK and dV, added with f32 reductions in an order the hardware picks, need only meet
//! the bound. The deterministic mode (dK and dV from a KV owner over the device-built token-level transpose) runs on
//! A twice where the group has at most 64 heads: within the bound, the same bits twice, and the atomic mode's dQ and
//! `D`, with its device-built transpose equal to the host's entry for entry; above 64 heads it must be a typed error.
//!
//! The suites draw what the forward's draw ([`token_sparse_draws`]: lists of every kind and width, shared or per KV
//! head, lengths from none past a tile ± 1, dense and varlen with empty sequences, GQA groups 1–16 and 24 to 128,
//! head dims up to 256, two scales, large logits) and reach the same classes. Without a device each test prints
//! `skipped: no CUDA device` and passes.

use std::sync::Arc;

use crate::common::*;
use crate::dsa_sparse::{ALL_CLASSES, classes, killing_cases};
use crate::property::{SECOND_INPUT, assert_typed_suites_reach, run_typed_production};
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::dsa::sparse::{DSA_SPARSE, ListSharing, TokenSelection};
use attnproof_gpu::dsa::sparse_backward::{
    DSA_SPARSE_BWD, token_sparse_backward, token_sparse_backward_device, token_transpose_device,
};
use attnproof_gpu::{BackwardDeviceInputs, BackwardDeviceOutputs, GpuBackwardStrategy, GpuError};
use attnproof_harness::backward::BackwardCandidate;
use attnproof_harness::candidate::{BackwardProblem, Gradients, LaunchError};
use attnproof_harness::dsa_sparse::{
    TokenListMix, TokenSparseDraw, token_lists, token_sparse_backward_guarded, token_sparse_case, token_sparse_draws,
    token_sparse_guarded, token_transpose, verify_token_sparse_backward,
};
use attnproof_harness::flash::HarnessError;
use attnproof_harness::generate::{ValueProfile, make_d_out};
use attnproof_harness::sparse::SparseHarnessError;
use attnproof_oracle::{AttentionSpec, Layout, Mask};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::{Array3, ArrayD};
use proptest::test_runner::{Config, TestCaseError, TestError};

/// The two suites ("gpudsabw" in ASCII, plus the dtype).
pub const BACKWARD_SUITES: [TypedSuite; 2] = [
    TypedSuite { name: "gpu_dsa_sparse_backward_bf16", bf16: true, cases: 40, seed: 0x6770_7564_7361_6277 },
    TypedSuite { name: "gpu_dsa_sparse_backward_f16", bf16: false, cases: 32, seed: 0x6770_7564_7361_6279 },
];

/// One draw's backward through `kernel` (the forward is the production kernel): the checks of the module docs. Where
/// the error model does not cover the draw's values (its first-order hypothesis fails at logit scales like 100 over
/// long rows), the same shapes and lists run again on Gaussian values, so that no shape class is lost to the values'
/// profile; a draw the model covers in neither is rejected, as in the other suites.
fn check_backward<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    draw: &TokenSparseDraw,
) -> Result<(), TestCaseError> {
    match check_backward_values::<T>(stream, kernel, draw) {
        Err(TestCaseError::Reject(_)) if draw.profile != ValueProfile::GAUSSIAN => check_backward_values::<T>(
            stream,
            kernel,
            &TokenSparseDraw { profile: ValueProfile::GAUSSIAN, ..draw.clone() },
        ),
        other => other,
    }
}

/// [`check_backward`] on the draw's own values.
fn check_backward_values<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    draw: &TokenSparseDraw,
) -> Result<(), TestCaseError> {
    let fail = |e: String| TestCaseError::fail(e);
    let lists = token_lists(draw);
    let cases = [token_sparse_case::<T>(draw, draw.seed), token_sparse_case::<T>(draw, draw.seed ^ SECOND_INPUT)];
    let forwards = cases
        .iter()
        .map(|case| token_sparse_guarded(stream, draw.selection, DSA_SPARSE, case, &lists))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| fail(format!("forward: {e}")))?;
    let d_outs = [make_d_out::<T>(&cases[0].spec, draw.seed ^ 0x6430), make_d_out::<T>(&cases[1].spec, draw.seed)];
    let run = |i: usize, strategy| {
        let problem = BackwardProblem { case: &cases[i], forward: &forwards[i], d_out: &d_outs[i] };
        token_sparse_backward_guarded(stream, draw.selection, kernel, problem, &lists, strategy)
    };
    let atomic = |i: usize| run(i, GpuBackwardStrategy::KvOwnerAtomic).map_err(|e| fail(format!("input {i}: {e}")));
    let grads = [atomic(0)?, atomic(1)?];
    let again = atomic(0)?;
    // The deterministic mode on input A twice where the group fits its tile; a typed error above 64 heads.
    let mut checked = vec![(0, &grads[0]), (1, &grads[1])];
    let deterministic = if draw.layer.group_size() <= 64 {
        let mode = GpuBackwardStrategy::KvOwnerDeterministic;
        let twice = [run(0, mode), run(0, mode)];
        let [first, second] = twice.map(|r| r.map_err(|e| fail(format!("deterministic, input 0: {e}"))));
        Some((first?, second?))
    } else {
        match run(0, GpuBackwardStrategy::KvOwnerDeterministic) {
            Err(LaunchError::Gpu(GpuError::Unsupported { argument: "strategy", .. })) => None,
            other => return Err(fail(format!("deterministic with {} heads: {other:?}", draw.layer.group_size()))),
        }
    };
    if let Some((first, _)) = &deterministic {
        checked.push((0, first));
    }
    for (i, g) in checked {
        let candidate = BackwardCandidate { dq: g.dq.view(), dk: g.dk.view(), dv: g.dv.view(), delta: g.delta.view() };
        let verdicts = match verify_token_sparse_backward(&cases[i], draw.selection, &lists, &d_outs[i], candidate) {
            Ok(v) => v,
            Err(SparseHarnessError::Harness(HarnessError::Model(m))) => {
                return Err(TestCaseError::reject(m.to_string()));
            }
            Err(e) => return Err(fail(format!("input {i}: {e}"))),
        };
        for (n, v) in verdicts.iter().enumerate() {
            if !(v.passed() && v.valid()) {
                return Err(fail(format!("input {i}, verdict {n} (sequence, KV head in order):\n{v}")));
            }
        }
    }
    let bits = |a: &ArrayD<T>| a.iter().map(|x| x.bits()).collect::<Vec<_>>();
    let f32_bits = |a: &ArrayD<f32>| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if bits(&grads[0].dq) != bits(&again.dq) || f32_bits(&grads[0].delta) != f32_bits(&again.delta) {
        return Err(fail("dQ or D differ between two runs on the same input".into()));
    }
    if let Some((first, second)) = &deterministic {
        let same = |a: &Gradients<T>, b: &Gradients<T>| {
            bits(&a.dq) == bits(&b.dq)
                && bits(&a.dk) == bits(&b.dk)
                && bits(&a.dv) == bits(&b.dv)
                && f32_bits(&a.delta) == f32_bits(&b.delta)
        };
        if !same(first, second) {
            return Err(fail("the deterministic mode gave different bits on the same input".into()));
        }
        if bits(&first.dq) != bits(&grads[0].dq) || f32_bits(&first.delta) != f32_bits(&grads[0].delta) {
            return Err(fail("dQ or D differ between the two modes (both own dQ per token)".into()));
        }
        check_transpose::<T>(stream, kernel, &cases[0].spec, draw.selection, &lists).map_err(fail)?;
    }
    Ok(())
}

/// The deterministic mode's token-level transpose as the device builds it (`token_transpose_device`) equals the
/// host's (`attnproof_harness::dsa_sparse::token_transpose`) entry for entry: offsets, tokens and masks, integers
/// compared exactly.
fn check_transpose<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    spec: &AttentionSpec,
    selection: TokenSelection,
    lists: &Array3<i32>,
) -> Result<(), String> {
    let host = lists.as_standard_layout();
    let host = host.as_slice().expect("standard layout");
    let device_lists = if host.is_empty() { stream.alloc_zeros::<i32>(1) } else { stream.clone_htod(host) };
    let device_lists = device_lists.map_err(|e| e.to_string())?;
    let got = token_transpose_device::<T>(stream, spec, selection, kernel, &device_lists).map_err(|e| e.to_string())?;
    let offsets = stream.clone_dtoh(&got.offsets).map_err(|e| e.to_string())?;
    let tokens = stream.clone_dtoh(&got.tokens).map_err(|e| e.to_string())?;
    let masks = stream.clone_dtoh(&got.masks).map_err(|e| e.to_string())?;
    stream.synchronize().map_err(|e| e.to_string())?;
    let want = token_transpose(spec, selection, lists.view());
    let total = *want.offsets.last().expect("offsets from 0") as usize;
    if offsets != want.offsets {
        return Err(format!("the transpose's offsets {offsets:?}, the host's {:?}", want.offsets));
    }
    if tokens[..total] != want.tokens[..] || masks[..total] != want.masks[..] {
        let row = (1..want.offsets.len())
            .find(|&r| {
                let span = want.offsets[r - 1] as usize..want.offsets[r] as usize;
                tokens[span.clone()] != want.tokens[span.clone()] || masks[span.clone()] != want.masks[span]
            })
            .unwrap_or(0);
        return Err(format!("the transpose's row {row} (sequence, list head, tile in order) differs from the host's"));
    }
    Ok(())
}

/// Runs a suite's draws under `config` through the kernel text `kernel` on `stream`; a failing draw comes back
/// described.
pub fn run_backward_suite(
    suite: &TypedSuite,
    config: Config,
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
) -> Result<(), Box<TestError<String>>> {
    let describe =
        |d: &TokenSparseDraw| format!("{:?} {:?} {:?} seed {} {:?}", d.layer, d.selection, d.profile, d.seed, d.lists);
    if suite.bf16 {
        run_described(config, token_sparse_draws(), |d| check_backward::<bf16>(stream, kernel, d), describe)
    } else {
        run_described(config, token_sparse_draws(), |d| check_backward::<f16>(stream, kernel, d), describe)
    }
}

#[test]
fn token_sparse_backward_is_within_bound_bf16() {
    run_typed_production(&BACKWARD_SUITES[0], DSA_SPARSE_BWD, run_backward_suite);
}

#[test]
fn token_sparse_backward_is_within_bound_f16() {
    run_typed_production(&BACKWARD_SUITES[1], DSA_SPARSE_BWD, run_backward_suite);
}

/// The suites' fixed seeds, replayed without a device, reach every class the forward's suites reach.
#[test]
fn the_backward_suites_draw_every_class() {
    assert_typed_suites_reach(&BACKWARD_SUITES, token_sparse_draws, classes, &ALL_CLASSES);
}

/// Runs the backward's kernel text `kernel` on a killing case (the forward's, [`killing_cases`]); `Ok(())` when it
/// passes.
pub fn check_backward_case(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    case: &TokenSparseDraw,
) -> Result<(), String> {
    check_backward::<bf16>(stream, kernel, case).map_err(|e| e.to_string())
}

/// The killing cases of the backward: the forward's (a group of 3 over two KV heads with per-head lists of 65, MQA
/// over 100 heads in two CTAs per token, every visible token of a varlen layout).
pub fn backward_killing_cases() -> Vec<(&'static str, TokenSparseDraw)> {
    killing_cases()
}

/// Small draws under compute-sanitizer (`run.sh sanitize`): a group of 3 at 130 tokens with lists of 65, varlen with
/// an empty sequence and lists per KV head, a group of 100 at `d = 192` (two CTAs per token, two column chunks), and a
/// group of 64 at `d = 256` with lists wider than the sequence.
#[test]
fn sanitizer_shapes() {
    let Some(stream) = device_stream("dsa_sparse_backward::sanitizer_shapes") else { return };
    let layer = |layout, hq, hkv, d, dv| {
        AttentionSpec { layout, ..AttentionSpec::dense(1, hq, hkv, 1, 1, d, dv) }.with_mask(Mask::Causal)
    };
    let dense = |len| Layout::Dense { batch: 1, len_q: len, len_k: len };
    let cu = vec![0, 0, 90, 130];
    let varlen = Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu };
    for (spec, top_k, heads) in [
        (layer(dense(130), 3, 1, 64, 64), 65, ListSharing::Shared),
        (layer(varlen, 4, 2, 64, 64), 16, ListSharing::PerKvHead),
        (layer(dense(100), 100, 1, 192, 128), 70, ListSharing::Shared),
        (layer(dense(70), 64, 1, 256, 256), 2048, ListSharing::Shared),
    ] {
        let draw = TokenSparseDraw {
            layer: spec,
            selection: TokenSelection { top_k, heads },
            profile: gaussian(1.0),
            seed: 5,
            lists: TokenListMix::Mixed,
        };
        check_backward_case(&stream, DSA_SPARSE_BWD, &draw).unwrap_or_else(|e| panic!("{:?}: {e}", draw.layer));
    }
}

/// Bad input is a typed error before any launch: a bad list from host tensors, the two-traversal strategy (no
/// token-sparse form), a layer that is not causal, an output buffer too small, lists too short; garbage device lists
/// run guarded in both modes. The host wrapper gives the guarded device run's dQ and `D` bits, and the deterministic
/// mode the atomic one's dQ. (The deterministic mode's refusal of groups above 64 heads is checked on every draw.)
#[test]
fn bad_backward_input_is_a_typed_error_before_any_launch() {
    let Some(stream) = device_stream("dsa_sparse_backward::bad_backward_input_is_a_typed_error_before_any_launch")
    else {
        return;
    };
    let (_, draw) = killing_cases().swap_remove(0);
    let case = token_sparse_case::<bf16>(&draw, draw.seed);
    let lists = token_lists(&draw);
    let forward = token_sparse_guarded(&stream, draw.selection, DSA_SPARSE, &case, &lists).expect("forward");
    let d_out = make_d_out::<bf16>(&case.spec, 9);
    let host = |spec: &AttentionSpec, lists: &Array3<i32>, strategy| {
        token_sparse_backward(
            &stream,
            spec,
            draw.selection,
            DSA_SPARSE_BWD,
            (case.q.view(), case.k.view(), case.v.view()),
            (forward.o.view(), forward.lse.view()),
            d_out.view(),
            lists.view(),
            strategy,
        )
    };
    let good = host(&case.spec, &lists, GpuBackwardStrategy::KvOwnerAtomic).expect("host run");
    let problem = BackwardProblem { case: &case, forward: &forward, d_out: &d_out };
    let device = token_sparse_backward_guarded(
        &stream,
        draw.selection,
        DSA_SPARSE_BWD,
        problem,
        &lists,
        GpuBackwardStrategy::KvOwnerAtomic,
    )
    .expect("device run");
    assert!(good.dq.iter().zip(device.dq.iter()).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(good.delta.iter().zip(device.delta.iter()).all(|(a, b)| a.to_bits() == b.to_bits()));
    let mut bad = lists.clone();
    bad[[70, 0, 0]] = 71;
    let r = host(&case.spec, &bad, GpuBackwardStrategy::KvOwnerAtomic);
    assert!(matches!(r, Err(GpuError::BlockList { position: [0, 0, 70, 0], .. })), "{r:?}");
    let r = host(&case.spec, &lists, GpuBackwardStrategy::TwoTraversals);
    assert!(matches!(r, Err(GpuError::Unsupported { argument: "strategy", .. })), "{r:?}");
    let deterministic = host(&case.spec, &lists, GpuBackwardStrategy::KvOwnerDeterministic).expect("deterministic");
    assert!(good.dq.iter().zip(deterministic.dq.iter()).all(|(a, b)| a.to_bits() == b.to_bits()));
    let open = case.spec.clone().with_mask(Mask::None);
    let r = host(&open, &lists, GpuBackwardStrategy::KvOwnerAtomic);
    assert!(matches!(r, Err(GpuError::Unsupported { argument: "mask", .. })), "{r:?}");
    // Device buffers: dV one element short, then the lists one entry short.
    let up = |x: &ArrayD<bf16>| stream.clone_htod(x.as_slice().expect("contiguous")).expect("upload");
    let (q, k, v, o, g) = (up(&case.q), up(&case.k), up(&case.v), up(&forward.o), up(&d_out));
    let lse = stream.clone_htod(forward.lse.as_slice().expect("contiguous")).expect("upload");
    let mut dq = stream.alloc_zeros::<bf16>(case.q.len()).expect("alloc");
    let mut dk = stream.alloc_zeros::<bf16>(case.k.len()).expect("alloc");
    let mut delta = stream.alloc_zeros::<f32>(forward.lse.len()).expect("alloc");
    let all = lists.as_slice().expect("contiguous");
    for (dv_len, list_len, argument) in [(case.v.len() - 1, all.len(), "dv"), (case.v.len(), all.len() - 1, "lists")] {
        let dl = stream.clone_htod(&all[..list_len]).expect("upload");
        let mut dv = stream.alloc_zeros::<bf16>(dv_len).expect("alloc");
        let r = token_sparse_backward_device(
            &stream,
            &case.spec,
            draw.selection,
            DSA_SPARSE_BWD,
            BackwardDeviceInputs { q: &q, k: &k, v: &v, o: &o, lse: &lse, d_out: &g },
            &dl,
            BackwardDeviceOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv, delta: &mut delta },
            GpuBackwardStrategy::KvOwnerAtomic,
        );
        assert!(matches!(r, Err(GpuError::BufferTooSmall { argument: a, .. }) if a == argument), "{r:?}");
    }
    // Garbage device lists (large, negative, repeated and future entries) run to completion inside the guards.
    let garbage = Array3::from_shape_fn(lists.dim(), |(t, _, e)| [i32::MAX, -7, 1, 0, 299][(t + e) % 5]);
    let problem = BackwardProblem { case: &case, forward: &forward, d_out: &d_out };
    token_sparse_backward_guarded(
        &stream,
        draw.selection,
        DSA_SPARSE_BWD,
        problem,
        &garbage,
        GpuBackwardStrategy::KvOwnerAtomic,
    )
    .expect("garbage lists run guarded");
    let problem = BackwardProblem { case: &case, forward: &forward, d_out: &d_out };
    token_sparse_backward_guarded(
        &stream,
        draw.selection,
        DSA_SPARSE_BWD,
        problem,
        &garbage,
        GpuBackwardStrategy::KvOwnerDeterministic,
    )
    .expect("garbage lists run guarded in the deterministic mode");
}
