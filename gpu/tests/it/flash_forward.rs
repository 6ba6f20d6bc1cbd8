//! The FlashAttention forward kernel verified on the device against the f64 oracle, under the rounding-error bound of
//! the kernel's recipe (`attnproof_gpu::flash` docs), in bf16 and f16.
//!
//! The kernel is the harness's `GpuCandidate`: every case runs with NaN-poisoned outputs followed by sentinel guard
//! bands (an element the kernel never writes fails the verdict; a write past an output trips the guard), checks the
//! device inputs unchanged after the launch, alternates inputs A, B, A (both A results bitwise equal: no state leaks
//! between launches) and requires the verdict to pass and the discriminability gate to be valid. The named cases are
//! the harness's adversarial table (`candidate_tests!`), which the reference schedule runs too. Without a device each test prints
//! `skipped: no CUDA device` and passes (`ATTNPROOF_REQUIRE_GPU=1` turns that into a failure).

use crate::common::*;
use crate::property::{run_production, suite};
use std::sync::Arc;

use attnproof_gpu::compile::{FLASH_FWD, FLASH_FWD_SM90, compute_capability};
use attnproof_gpu::flash::ForwardTiling;
use attnproof_gpu::{
    GpuError, flash_forward, flash_forward_device, production_forward, skip_unless_gpu, skip_unless_hopper,
};
use attnproof_harness::adversarial::{Direction, Repeat, Worst, forward_verdicts};
use attnproof_harness::candidate::GpuCandidate;
use attnproof_harness::candidate_tests;
use attnproof_harness::generate::make_case;
use attnproof_harness::{Case, verify_forward};
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Mask, Predicate};
use cudarc::driver::CudaStream;
use half::bf16;
use ndarray::ArrayD;

/// Output bits, for bitwise comparisons (NaN-safe).
type Bits = (Vec<u16>, Vec<u32>);

fn bits_of<T: Storage>(o: &ArrayD<T>, lse: &ArrayD<f32>) -> Bits {
    (o.iter().map(|x| x.bits()).collect(), lse.iter().map(|x| x.to_bits()).collect())
}

/// One launch of the production kernel and tiling, guarded (see [`crate::common::run_forward_guarded`]).
fn run_guarded<T: Storage>(stream: &Arc<CudaStream>, case: &Case<T>) -> Result<(ArrayD<T>, ArrayD<f32>), String> {
    let tiling = ForwardTiling::for_head_dims(case.spec.head_dim, case.spec.head_dim_v);
    run_forward_guarded(stream, case, FLASH_FWD, tiling)
}

/// The forward property suites (`crate::property`): every draw within bound with a valid gate, inputs A, B, A.
#[test]
fn kernel_forward_is_within_bound_bf16() {
    run_production(suite("gpu_flash_forward_bf16"));
}

#[test]
fn kernel_forward_is_within_bound_f16() {
    run_production(suite("gpu_flash_forward_f16"));
}

/// The dense `wgmma` forward's property suites (`SuiteKernel::WgmmaForward`): the same checks of `flash_fwd_sm90` in
/// its dense mode on compute capability 9.0 (skipped elsewhere), the suites the dense wrapper's choice of it rests on.
#[test]
fn wgmma_kernel_forward_is_within_bound_bf16() {
    run_production(suite("gpu_flash_wgmma_forward_bf16"));
}

#[test]
fn wgmma_kernel_forward_is_within_bound_f16() {
    run_production(suite("gpu_flash_wgmma_forward_f16"));
}

// The adversarial table (`attnproof_harness::adversarial`): one test per group, the dtype alternating from case to
// case, inputs A, B, A.
candidate_tests!(GpuCandidate::if_available, [forward]);

/// The few small shapes of [`crate::common::sanitizer_shapes`], which `run.sh sanitize` runs under compute-sanitizer.
#[test]
fn sanitizer_shapes() {
    run_sanitizer_shapes("flash_forward::sanitizer_shapes", Direction::Forward);
}

/// The verdict already demands exact `O = 0` and `LSE = −∞` on rows that see no key; this pins it without the
/// oracle too.
#[test]
fn fully_masked_rows_give_zero_and_minus_infinity() {
    let Some(stream) = device_stream("fully_masked_rows_give_zero_and_minus_infinity (direct)") else { return };
    // Bottom-right causal with Lq > Lk: the first Lq − Lk = 70 rows see no key.
    let case = make_case::<bf16>(&dense(1, 2, 2, 100, 30, 64, 64, Mask::Causal), gaussian(1.0), 5);
    let (o, lse) = run_guarded(&stream, &case).expect("launch");
    for i in 0..70 {
        assert_eq!(lse[[0, 1, i]], f32::NEG_INFINITY, "row {i}");
        assert!((0..64).all(|c| o[[0, 1, i, c]].to_f32() == 0.0), "row {i}");
    }
    assert!(lse[[0, 1, 70]].is_finite());
}

/// Benchmark-sized problems against the f64 oracle (the table's cases are small): the verdict within bound with a
/// valid gate, the input run twice with bitwise equal outputs, causal and not.
#[test]
fn large_shapes_are_within_bound() {
    let Some(candidate) = GpuCandidate::if_available("large_shapes_are_within_bound") else {
        return;
    };
    let mut worst = Worst::default();
    // Two query heads over one KV head keep the GQA path at benchmark length; the oracle's f64 verdict of a 4096²
    // head is what this test costs on the host, so one input per mask (run twice, bitwise equal).
    for mask in [Mask::None, Mask::Causal] {
        let spec = dense(1, 2, 1, 4096, 4096, 128, 128, mask.clone());
        let a = make_case::<bf16>(&spec, gaussian(1.0), 7);
        let verdicts =
            forward_verdicts(&candidate, &[&a], Repeat::FirstInput).unwrap_or_else(|e| panic!("{mask:?}: {e}"));
        verdicts.iter().for_each(|v| worst.record(v));
    }
    println!("large_shapes_are_within_bound: 2 shapes, worst error/bound {worst}");
}

/// Every tiling gives bitwise the same outputs (each row's operations do not depend on the CTA shape; see
/// `attnproof_gpu::flash`), so the oracle checks of the production tiling cover the others; the production tiling's
/// result is also verified here.
#[test]
fn all_tilings_agree_bitwise() {
    let Some(stream) = device_stream("all_tilings_agree_bitwise") else { return };
    let specs = [
        dense(1, 4, 2, 300, 200, 64, 64, Mask::Causal),
        dense(1, 2, 1, 200, 300, 128, 128, Mask::Causal),
        dense(2, 2, 2, 257, 257, 128, 64, Mask::None),
        dense(1, 2, 1, 190, 190, 32, 48, Mask::Window { left: 40, right: 9 }),
        varlen(&[0, 70, 70, 331], &[0, 65, 130, 400], 4, 2, 128, 128, Mask::Causal),
        dense(1, 2, 2, 200, 140, 256, 200, Mask::Causal),
    ];
    let mut compared = 0;
    for spec in &specs {
        let case = make_case::<bf16>(spec, gaussian(4.0), 21);
        let chosen = ForwardTiling::for_head_dims(spec.head_dim, spec.head_dim_v);
        let (o, lse) = run_guarded(&stream, &case).unwrap_or_else(|e| panic!("{spec:?}: {e}"));
        let v = verify_forward(&case, forward_recipe::<bf16>(), o.view(), lse.view()).expect("verify");
        assert!(v.passed() && v.valid(), "{spec:?}:\n{v}");
        let reference = bits_of(&o, &lse);
        for tiling in
            ForwardTiling::ALL.into_iter().filter(|t| *t != chosen && t.supports(spec.head_dim, spec.head_dim_v))
        {
            let (o2, lse2) = run_forward_guarded(&stream, &case, FLASH_FWD, tiling)
                .unwrap_or_else(|e| panic!("{tiling:?} {spec:?}: {e}"));
            assert!(bits_of(&o2, &lse2) == reference, "{tiling:?} differs from {chosen:?} on {spec:?}");
            compared += 1;
        }
    }
    println!("all_tilings_agree_bitwise: {} specs, {compared} tiling comparisons, all bitwise equal", specs.len());
}

#[test]
fn unsupported_and_bad_arguments_are_typed_errors() {
    let Some(stream) = device_stream("unsupported_and_bad_arguments_are_typed_errors") else { return };
    let case = make_case::<bf16>(&dense(1, 1, 1, 8, 8, 16, 16, Mask::None), gaussian(1.0), 1);
    let predicate = Mask::Predicate(Predicate { name: "even keys".into(), visible: Arc::new(|p| p.key % 2 == 0) });
    let err =
        flash_forward(&stream, &case.spec.clone().with_mask(predicate), case.q.view(), case.k.view(), case.v.view())
            .unwrap_err();
    assert!(matches!(err, GpuError::Unsupported { argument: "mask", .. }), "{err}");
    let odd = make_case::<bf16>(&dense(1, 1, 1, 8, 8, 59, 16, Mask::None), gaussian(1.0), 1);
    let err = flash_forward(&stream, &odd.spec, odd.q.view(), odd.k.view(), odd.v.view()).unwrap_err();
    assert!(matches!(err, GpuError::Unsupported { argument: "head_dim", .. }), "{err}");
    let err = flash_forward(
        &stream,
        &case.spec,
        case.k.view(),
        case.q.view().slice_move(ndarray::s![.., .., ..4, ..]).into_dyn(),
        case.v.view(),
    )
    .unwrap_err();
    assert!(matches!(err, GpuError::Shape { argument: "k", .. }), "{err}");
    let q = upload(&stream, &case.q).unwrap();
    let mut small = stream.alloc_zeros::<bf16>(10).unwrap();
    let mut lse = stream.alloc_zeros::<f32>(8).unwrap();
    let err = flash_forward_device(&stream, &case.spec, &q, &q, &q, &mut small, &mut lse).unwrap_err();
    assert!(matches!(err, GpuError::BufferTooSmall { argument: "o", needed: 128, actual: 10 }), "{err}");
    // The host path gives the same answer as the guarded device path of the production kernel and tiling.
    for spec in [case.spec.clone(), dense(1, 2, 1, 130, 200, 64, 128, Mask::Causal)] {
        let case = make_case::<bf16>(&spec, gaussian(1.0), 2);
        let host = flash_forward(&stream, &spec, case.q.view(), case.k.view(), case.v.view()).unwrap();
        let device = compute_capability(stream.context()).unwrap();
        let (kernel, tiling) = production_forward(&spec, device);
        let (o, lse) = run_forward_guarded(&stream, &case, kernel, tiling).unwrap();
        assert_eq!(bits_of(&host.o, &host.lse), bits_of(&o, &lse), "{spec:?}");
    }
}

/// On Hopper the dense wrapper runs the sm_90a kernel for head dims it loads through tensor maps: its bits are that
/// kernel's and differ from `flash_fwd`'s on the same problem (the tensor cores sum in another order), which the
/// comparison needs to mean anything; head dims it does not take keep `flash_fwd`.
#[test]
fn the_dense_wrapper_runs_the_wgmma_forward_on_hopper() {
    let Some(ctx) = skip_unless_hopper("the_dense_wrapper_runs_the_wgmma_forward_on_hopper") else { return };
    let stream = ctx.new_stream().expect("create a stream");
    let bits = |spec: &AttentionSpec, kernel, tiling| {
        let case = make_case::<bf16>(spec, gaussian(1.0), 3);
        let wrapper = flash_forward(&stream, spec, case.q.view(), case.k.view(), case.v.view()).expect("the wrapper");
        let run = run_forward_guarded(&stream, &case, kernel, tiling).expect("the kernel");
        (bits_of(&wrapper.o, &wrapper.lse), bits_of(&run.0, &run.1))
    };
    let wide = dense(1, 2, 2, 300, 300, 128, 128, Mask::Causal);
    let (wrapper, wgmma) = bits(&wide, FLASH_FWD_SM90, ForwardTiling::WGMMA);
    assert_eq!(wrapper, wgmma, "the dense wrapper is not the sm_90a kernel at d = 128");
    let (_, mma) = bits(&wide, FLASH_FWD, ForwardTiling::for_head_dims(128, 128));
    assert_ne!(wgmma, mma, "flash_fwd and the sm_90a kernel agree bit for bit");
    let narrow = dense(1, 2, 2, 300, 300, 40, 40, Mask::Causal);
    let (wrapper, mma) = bits(&narrow, FLASH_FWD, ForwardTiling::for_head_dims(40, 40));
    assert_eq!(wrapper, mma, "below 64 columns the dense wrapper is not flash_fwd");
}

/// Determinism at a benchmark shape: repeated launches give bitwise equal, finite outputs. Also prints the
/// throughput (median of timed launches with CUDA events), for orientation only: no figure is asserted, and the
/// figure is only meaningful when this test runs alone (`gpu/src/bin/bench.rs` is the benchmark) (`… flash_forward large_shapes`): beside the other tests it
/// shares the GPU and the CPU with them.
#[test]
fn large_shapes_are_deterministic() {
    let Some(ctx) = skip_unless_gpu("large_shapes_are_deterministic") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    for mask in [Mask::None, Mask::Causal] {
        let spec = dense(4, 16, 16, 4096, 4096, 128, 128, mask.clone());
        let case = make_case::<bf16>(&spec, gaussian(1.0), 7);
        let (q, k, v) =
            (upload(&stream, &case.q).unwrap(), upload(&stream, &case.k).unwrap(), upload(&stream, &case.v).unwrap());
        let n_o: usize = spec.expected_shape(Operand::O).iter().product();
        let n_lse: usize = spec.expected_shape(Operand::RowStat).iter().product();
        // Prepared outside the timed window: validation, the module cache's lock (other tests compile under it) and
        // the cu_seqlens upload would otherwise sit between the events.
        let tiling = ForwardTiling::for_head_dims(128, 128);
        let prepared = attnproof_gpu::PreparedForward::<bf16>::new(&stream, &spec, FLASH_FWD, tiling).unwrap();
        let mut runs: Vec<Bits> = vec![];
        let mut times = vec![];
        for rep in 0..7 {
            let mut o = stream.clone_htod(&vec![bf16::NAN; n_o]).unwrap();
            let mut lse = stream.clone_htod(&vec![f32::NAN; n_lse]).unwrap();
            let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let start = stream.record_event(flags).unwrap();
            prepared.launch(&stream, &q, &k, &v, &mut o, &mut lse).unwrap();
            let end = stream.record_event(flags).unwrap();
            let ms = start.elapsed_ms(&end).unwrap();
            if rep > 0 {
                times.push(ms); // the first launch compiles and warms up
            }
            if rep < 3 {
                let o_host = stream.clone_dtoh(&o).unwrap();
                let lse_host = stream.clone_dtoh(&lse).unwrap();
                stream.synchronize().unwrap();
                assert!(o_host.iter().all(|x| x.is_finite()) && lse_host.iter().all(|x| x.is_finite()), "{mask:?}");
                runs.push((
                    o_host.iter().map(|x| x.to_bits()).collect(),
                    lse_host.iter().map(|x| x.to_bits()).collect(),
                ));
            }
        }
        assert!(runs.windows(2).all(|w| w[0] == w[1]), "{mask:?}: repeated launches differ bitwise");
        times.sort_by(f32::total_cmp);
        let median = times[times.len() / 2] as f64;
        let flops = 4.0 * 4.0 * 16.0 * 4096.0 * 4096.0 * 128.0 * if matches!(mask, Mask::Causal) { 0.5 } else { 1.0 };
        println!("flash_fwd bf16 (4,16,4096,128) {mask:?}: median {median:.3} ms, {:.1} TFLOP/s", flops / median / 1e9);
    }
    // Resource use of every tiling at d = dv = 128, for whoever tunes it next (spills show as local memory).
    for t in ForwardTiling::ALL {
        let defines = [
            "ELEM_BF16".to_owned(),
            "HEAD_DIM_PAD=128".to_owned(),
            "HEAD_DIM_V_PAD=128".to_owned(),
            format!("NUM_WARPS={}", t.warps),
            format!("WARP_M={}", t.slices),
        ];
        let module = attnproof_gpu::compile::module(&ctx, FLASH_FWD, &defines).unwrap();
        let f = module.load_function("flash_fwd").unwrap();
        println!(
            "flash_fwd bf16 d=dv=128 {t:?}: {} registers/thread, {} bytes local memory/thread",
            f.num_regs().unwrap(),
            f.local_size_bytes().unwrap(),
        );
    }
}
