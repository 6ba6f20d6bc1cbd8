//! The FlashAttention backward kernels verified on the device against the f64 oracle, under the rounding-error bound
//! of the kernels' recipe (`attnproof_gpu::backward` docs), in bf16 and f16, for each dQ ownership strategy.
//!
//! The kernels are the harness's `GpuCandidate`; the named cases are the harness's adversarial table
//! (`candidate_tests!`), which the reference schedule runs too. Each case runs the GPU forward for `O` and `LSE`, then
//! each strategy with NaN-poisoned outputs followed by sentinel guard bands (an element no kernel writes fails the
//! verdict; a write past an output trips the guard), checks every device input unchanged afterwards, alternates
//! inputs A, B, A (the deterministic strategies give bitwise equal A results; the atomic one gives bitwise equal dK,
//! dV, D and a dQ within the bound both times), requires the verdict to pass and the discriminability gate to be
//! valid, and requires dK, dV and D bitwise equal across the strategies (they share one arithmetic). Without a device
//! each test prints `skipped: no CUDA device` and passes (`ATTNPROOF_REQUIRE_GPU=1` turns that into a failure).

use crate::common::*;
use crate::property::{run_production, suite};
use std::sync::Arc;

use attnproof_gpu::backward::BackwardTiling;
use attnproof_gpu::compile::FLASH_BWD;
use attnproof_gpu::{
    BackwardDeviceInputs, BackwardDeviceOutputs, GpuBackwardStrategy, GpuError, flash_backward, flash_backward_device,
};
use attnproof_harness::adversarial::{
    AdversarialCase, Direction, Directions, Group, Repeat, Worst, backward_verdicts, run_cases,
};
use attnproof_harness::candidate::GpuCandidate;
use attnproof_harness::candidate_tests;
use attnproof_harness::generate::{make_case, make_d_out};
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{Mask, Predicate};
use cudarc::driver::CudaStream;
use half::bf16;
use ndarray::ArrayD;

/// One backward of the production kernels in `tiling`, guarded (see [`crate::common::run_backward_guarded_tiled`]).
fn run_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    p: &Problem<T>,
    tiling: BackwardTiling,
    strategy: GpuBackwardStrategy,
) -> Result<Grads<T>, String> {
    run_backward_guarded_tiled(stream, p, FLASH_BWD, tiling, strategy)
}

/// The backward property suites (`crate::property`): every draw, in its drawn tiling and with every strategy, within
/// bound with a valid gate, inputs A, B, A.
#[test]
fn kernel_backward_is_within_bound_bf16() {
    run_production(suite("gpu_flash_backward_bf16"));
}

#[test]
fn kernel_backward_is_within_bound_f16() {
    run_production(suite("gpu_flash_backward_f16"));
}

/// The dense `wgmma` backward's property suites (`SuiteKernel::WgmmaBackward`): the same checks of the `flash_bwd_sm90`
/// KV owner in its dense mode, every strategy, on compute capability 9.0 (skipped elsewhere), where the dense wrapper
/// runs it for head dims up to 128 (`production_backward_kernel`).
#[test]
fn wgmma_kernel_backward_is_within_bound_bf16() {
    run_production(suite("gpu_flash_wgmma_backward_bf16"));
}

#[test]
fn wgmma_kernel_backward_is_within_bound_f16() {
    run_production(suite("gpu_flash_wgmma_backward_f16"));
}

// The adversarial table (`attnproof_harness::adversarial`) in the default tiling: one test per group, the dtype
// alternating from case to case, every strategy, inputs A, B, A.
candidate_tests!(GpuCandidate::if_available, [backward]);

/// The few small shapes of [`crate::common::sanitizer_shapes`], which `run.sh sanitize` runs under compute-sanitizer:
/// among them the largest head dims, whose `bwd_kv` runs the single-stage pipeline (`Q_STAGES = 1`); every strategy
/// runs, so strategy A's `bwd_dq` and the deterministic dQ sum run under the sanitizer too.
#[test]
fn sanitizer_shapes() {
    run_sanitizer_shapes("flash_backward::sanitizer_shapes", Direction::Backward);
}

/// The verdict already demands exact zeros on rows that see no key; this pins it without the oracle too.
#[test]
fn fully_masked_rows_get_zero_gradients() {
    let Some(stream) = device_stream("fully_masked_rows_get_zero_gradients (direct)") else { return };
    // Bottom-right causal with Lq > Lk: the first Lq − Lk = 70 rows see no key (LSE = −∞, dQ = 0).
    let p = problem::<bf16>(&stream, &dense(1, 2, 2, 100, 30, 64, 64, Mask::Causal), gaussian(1.0), 5);
    for strategy in GpuBackwardStrategy::ALL {
        let g = run_guarded(&stream, &p, BackwardTiling::DEFAULT, strategy).expect("launch");
        for i in 0..70 {
            assert!((0..64).all(|c| g.dq[[0, 1, i, c]].to_f32() == 0.0), "{strategy:?} row {i}");
        }
        // Row 70 sees one key (P = 1, so dS = dP − D = 0 exactly and dQ = 0); row 71 sees two.
        assert!((0..64).any(|c| g.dq[[0, 1, 71, c]].to_f32() != 0.0), "{strategy:?} row 71");
    }
}

/// The four-warp tiling (KV tiles of 64 keys) on the edges that depend on the KV tile: key tails of tile ± 1, the
/// diagonal crossing a tile, GQA's group sum, a varlen batch with empty sequences, and a wide head (one stage).
#[test]
fn four_warp_tiling() {
    let Some(candidate) = GpuCandidate::if_available("four_warp_tiling") else {
        return;
    };
    let candidate = candidate.with_backward_tiling(BackwardTiling { kv_warps: 4 });
    let specs = [
        dense(1, 2, 1, 70, 129, 64, 64, Mask::None),
        dense(1, 4, 2, 150, 63, 128, 128, Mask::Causal),
        dense(1, 2, 2, 130, 130, 64, 32, Mask::Window { left: 7, right: 3 }),
        varlen(&[0, 70, 70, 200], &[0, 65, 130, 259], 2, 1, 64, 64, Mask::Causal),
        dense(1, 1, 1, 65, 65, 256, 256, Mask::None),
    ];
    let profiles = [gaussian(1.0), gaussian(4.0), gaussian(1.0), gaussian(1.0), gaussian(1.0)];
    let cases: Vec<AdversarialCase> = specs
        .into_iter()
        .zip(profiles)
        .enumerate()
        .map(|(n, (spec, profile))| AdversarialCase {
            name: format!("four-warp #{n}: {spec:?}"),
            group: Group::TileEdges,
            spec,
            profile,
            directions: Directions::Both,
        })
        .collect();
    let (worst, count) = run_cases(&candidate, &cases, Direction::Backward);
    println!("four_warp_tiling: {count} cases x 2 dtypes x 3 strategies, worst error/bound {worst}");
}

/// Benchmark-sized problems against the f64 oracle (the table's cases are small): every strategy within bound with a
/// valid gate, inputs A, B, A repeatable as the strategy promises.
#[test]
fn larger_shapes_are_within_bound() {
    let Some(candidate) = GpuCandidate::if_available("larger_shapes_are_within_bound") else {
        return;
    };
    let spec = dense(1, 4, 2, 1024, 1024, 128, 128, Mask::Causal);
    let cases = [7, 8].map(|seed| make_case::<bf16>(&spec, gaussian(1.0), seed));
    let d_outs = [7, 8].map(|seed| make_d_out::<bf16>(&spec, seed));
    let problems = [(&cases[0], &d_outs[0]), (&cases[1], &d_outs[1])];
    let mut worst = Worst::default();
    let verdicts = backward_verdicts(&candidate, &problems, Repeat::FirstInput).unwrap_or_else(|e| panic!("{e}"));
    verdicts.iter().for_each(|v| worst.record(v));
    println!("larger_shapes_are_within_bound: {} verdicts, worst error/bound {worst}", verdicts.len());
}

#[test]
fn unsupported_and_bad_arguments_are_typed_errors() {
    let Some(stream) = device_stream("unsupported_and_bad_arguments_are_typed_errors (backward)") else { return };
    let p = problem::<bf16>(&stream, &dense(1, 1, 1, 8, 8, 16, 16, Mask::None), gaussian(1.0), 1);
    let (q, k, v, o, lse, g) =
        (p.case.q.view(), p.case.k.view(), p.case.v.view(), p.o.view(), p.lse.view(), p.d_out.view());
    let strategy = GpuBackwardStrategy::KvOwnerDeterministic;
    let predicate = Mask::Predicate(Predicate { name: "even keys".into(), visible: Arc::new(|p| p.key % 2 == 0) });
    let masked = p.case.spec.clone().with_mask(predicate);
    let err =
        flash_backward(&stream, &masked, q.clone(), k.clone(), v.clone(), o.clone(), lse.clone(), g.clone(), strategy)
            .unwrap_err();
    assert!(matches!(err, GpuError::Unsupported { argument: "mask", .. }), "{err}");
    let short_o = o.clone().slice_move(ndarray::s![.., .., ..4, ..]).into_dyn();
    let err = flash_backward(
        &stream,
        &p.case.spec,
        q.clone(),
        k.clone(),
        v.clone(),
        short_o,
        lse.clone(),
        g.clone(),
        strategy,
    )
    .unwrap_err();
    assert!(matches!(err, GpuError::Shape { argument: "o", .. }), "{err}");
    let short_lse = lse.clone().slice_move(ndarray::s![.., .., ..4]).into_dyn();
    let err = flash_backward(
        &stream,
        &p.case.spec,
        q.clone(),
        k.clone(),
        v.clone(),
        o.clone(),
        short_lse,
        g.clone(),
        strategy,
    )
    .unwrap_err();
    assert!(matches!(err, GpuError::Shape { argument: "lse", .. }), "{err}");
    let nan_lse = p.lse.mapv(|_| f32::NAN);
    let err = flash_backward(
        &stream,
        &p.case.spec,
        q.clone(),
        k.clone(),
        v.clone(),
        o.clone(),
        nan_lse.view(),
        g.clone(),
        strategy,
    )
    .unwrap_err();
    assert!(matches!(err, GpuError::Spec(_)), "{err}");
    let dev = upload(&stream, &p.case.q).unwrap();
    let dev_lse = upload(&stream, &p.lse).unwrap();
    let mut small = stream.alloc_zeros::<bf16>(10).unwrap();
    let (mut dk, mut dv) = (stream.alloc_zeros::<bf16>(128).unwrap(), stream.alloc_zeros::<bf16>(128).unwrap());
    let mut delta = stream.alloc_zeros::<f32>(8).unwrap();
    let err = flash_backward_device(
        &stream,
        &p.case.spec,
        BackwardDeviceInputs { q: &dev, k: &dev, v: &dev, o: &dev, lse: &dev_lse, d_out: &dev },
        BackwardDeviceOutputs { dq: &mut small, dk: &mut dk, dv: &mut dv, delta: &mut delta },
        strategy,
    )
    .unwrap_err();
    assert!(matches!(err, GpuError::BufferTooSmall { argument: "dq", needed: 128, actual: 10 }), "{err}");
    // The host path gives the same answer as the guarded device path, for every deterministic strategy.
    for strategy in GpuBackwardStrategy::ALL.into_iter().filter(|s| s.is_deterministic()) {
        let host = flash_backward(
            &stream,
            &p.case.spec,
            q.clone(),
            k.clone(),
            v.clone(),
            o.clone(),
            lse.clone(),
            g.clone(),
            strategy,
        )
        .unwrap();
        let guarded = run_guarded(&stream, &p, BackwardTiling::DEFAULT, strategy).unwrap();
        let host = Grads { dq: host.dq, dk: host.dk, dv: host.dv, delta: host.delta };
        assert!(host.same(&guarded), "{strategy:?}: host and device paths differ");
    }
}

/// Determinism at a larger shape: the deterministic strategies give bitwise equal, finite gradients over repeated
/// launches, and the atomic one equal dK, dV (dQ may differ in its last bits). Prints each strategy's time (CUDA
/// events, median of 3 after a warm-up), for orientation only: nothing is asserted about speed.
#[test]
fn larger_shapes_are_deterministic() {
    let Some(stream) = device_stream("larger_shapes_are_deterministic (backward)") else { return };
    let spec = dense(2, 8, 4, 1024, 1024, 128, 128, Mask::Causal);
    let p = problem::<bf16>(&stream, &spec, gaussian(1.0), 7);
    let up = |t: &ArrayD<bf16>| upload(&stream, t).unwrap();
    let (q, k, v, o, g) = (up(&p.case.q), up(&p.case.k), up(&p.case.v), up(&p.o), up(&p.d_out));
    let lse = upload(&stream, &p.lse).unwrap();
    let n = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    for strategy in GpuBackwardStrategy::ALL {
        let mut runs: Vec<Vec<Vec<u16>>> = vec![];
        let mut times = vec![];
        for rep in 0..4 {
            let mut dq = stream.alloc_zeros::<bf16>(n(Operand::Q)).unwrap();
            let mut dk = stream.alloc_zeros::<bf16>(n(Operand::K)).unwrap();
            let mut dv = stream.alloc_zeros::<bf16>(n(Operand::V)).unwrap();
            let mut delta = stream.alloc_zeros::<f32>(n(Operand::RowStat)).unwrap();
            let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let start = stream.record_event(flags).unwrap();
            flash_backward_device(
                &stream,
                &spec,
                BackwardDeviceInputs { q: &q, k: &k, v: &v, o: &o, lse: &lse, d_out: &g },
                BackwardDeviceOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv, delta: &mut delta },
                strategy,
            )
            .unwrap();
            let end = stream.record_event(flags).unwrap();
            let ms = start.elapsed_ms(&end).unwrap();
            if rep > 0 {
                times.push(ms);
            }
            if rep < 2 {
                let out: Vec<Vec<u16>> = [&dq, &dk, &dv]
                    .into_iter()
                    .map(|b| stream.clone_dtoh(b).unwrap().iter().map(|x| x.to_bits()).collect())
                    .collect();
                stream.synchronize().unwrap();
                assert!(out.iter().flatten().all(|&b| bf16::from_bits(b).is_finite()), "{strategy:?}: non-finite");
                runs.push(out);
            }
        }
        if strategy.is_deterministic() {
            assert!(runs[0] == runs[1], "{strategy:?}: repeated launches differ bitwise");
        } else {
            assert!(runs[0][1..] == runs[1][1..], "{strategy:?}: dK or dV differ between launches");
        }
        times.sort_by(f32::total_cmp);
        println!("flash_bwd bf16 (2,8/4,1024,128) causal {strategy:?}: median {:.3} ms", times[times.len() / 2]);
    }
}
