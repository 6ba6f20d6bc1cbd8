//! The FlashAttention forward kernel verified on the device against the f64 oracle, under the rounding-error bound of
//! the kernel's recipe (`attnproof_gpu::flash` docs), in bf16 and f16.
//!
//! Every case runs with NaN-poisoned outputs followed by sentinel guard bands (an element the kernel never writes
//! fails the verdict; a write past an output trips the guard), checks the device inputs unchanged after the launch,
//! alternates inputs A, B, A (both A results bitwise equal: no state leaks between launches) and requires the
//! verdict to pass and the discriminability gate to be valid. Without a device each test prints
//! `skipped: no CUDA device` and passes (`ATTNPROOF_REQUIRE_GPU=1` turns that into a failure).

mod common;

use common::*;
use std::sync::Arc;

use attnproof_gpu::compile::FLASH_FWD;
use attnproof_gpu::flash::ForwardTiling;
use attnproof_gpu::{GpuElement, GpuError, flash_forward, flash_forward_device, skip_unless_gpu};
use attnproof_harness::generate::{Distribution, ValueProfile, make_case};
use attnproof_harness::strategies::{profile, suite_config};
use attnproof_harness::{Case, HarnessError, Verdict, verify_forward};
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Mask, Predicate};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::ArrayD;
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

/// Output bits, for bitwise comparisons (NaN-safe).
type Bits = (Vec<u16>, Vec<u32>);

fn bits_of<T: Storage>(o: &ArrayD<T>, lse: &ArrayD<f32>) -> Bits {
    (o.iter().map(|x| x.bits()).collect(), lse.iter().map(|x| x.to_bits()).collect())
}

/// One launch of the production kernel and tiling, guarded (see [`common::run_forward_guarded`]).
fn run_guarded<T: Storage>(stream: &Arc<CudaStream>, case: &Case<T>) -> Result<(ArrayD<T>, ArrayD<f32>), String> {
    let tiling = ForwardTiling::for_head_dims(case.spec.head_dim, case.spec.head_dim_v);
    run_forward_guarded(stream, case, FLASH_FWD, tiling)
}

/// Runs A, B, A; requires both A results bitwise equal; verifies A and B. Returns the verdicts.
fn check<T: Storage>(stream: &Arc<CudaStream>, a: &Case<T>, b: &Case<T>) -> Result<[Verdict; 2], TestCaseError> {
    let fail = |e: String| TestCaseError::fail(format!("{} {:?}: {e}", <T as GpuElement>::NAME, a.spec));
    let (o_a, lse_a) = run_guarded(stream, a).map_err(fail)?;
    let (o_b, lse_b) = run_guarded(stream, b).map_err(fail)?;
    let (o_a2, lse_a2) = run_guarded(stream, a).map_err(fail)?;
    if bits_of(&o_a, &lse_a) != bits_of(&o_a2, &lse_a2) {
        return Err(fail("A, B, A: the two runs of input A differ bitwise".into()));
    }
    let verify = |case: &Case<T>, o: &ArrayD<T>, lse: &ArrayD<f32>| match verify_forward(
        case,
        forward_recipe::<T>(),
        o.view(),
        lse.view(),
    ) {
        Ok(v) => Ok(v),
        // A case outside the model's hypothesis is not a failure of the kernel.
        Err(HarnessError::Model(m)) => Err(TestCaseError::reject(m.to_string())),
        Err(e) => Err(fail(e.to_string())),
    };
    Ok([verify(a, &o_a, &lse_a)?, verify(b, &o_b, &lse_b)?])
}

fn fuzz<T: Storage>(test_name: &str, cases: u32) {
    let Some(ctx) = skip_unless_gpu(test_name) else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let mut runner = TestRunner::new(suite_config(test_name, cases));
    let worst = std::cell::Cell::new(0f64);
    let result = runner.run(&(kernel_spec(), profile(), any::<u64>()), |(spec, profile, seed)| {
        let a = make_case::<T>(&spec, profile, seed);
        let b = make_case::<T>(&spec, profile, seed ^ 0x9e37_79b9_7f4a_7c15);
        for v in check(&stream, &a, &b)? {
            prop_assert!(v.passed(), "{v}");
            prop_assert!(v.valid(), "{v}");
            worst.set(worst.get().max(v.max_ratio()));
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{test_name}: {e}");
    }
    println!("{test_name}: {} cases, worst error/bound {:.3e}", runner.config().cases, worst.get());
}

#[test]
fn kernel_forward_is_within_bound_bf16() {
    fuzz::<bf16>("gpu_flash_forward_bf16", 64);
}

#[test]
fn kernel_forward_is_within_bound_f16() {
    fuzz::<f16>("gpu_flash_forward_f16", 64);
}

/// A named case: both dtypes, two seeds, verdict and gate; prints the worst ratio.
fn named(test_name: &str, cases: &[(AttentionSpec, ValueProfile)]) {
    let Some(ctx) = skip_unless_gpu(test_name) else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    fn one<T: Storage>(stream: &Arc<CudaStream>, spec: &AttentionSpec, profile: ValueProfile) -> f64 {
        let a = make_case::<T>(spec, profile, 11);
        let b = make_case::<T>(spec, profile, 12);
        let verdicts =
            check(stream, &a, &b).unwrap_or_else(|e| panic!("{} {spec:?} {profile:?}: {e}", <T as GpuElement>::NAME));
        for v in &verdicts {
            assert!(v.passed(), "{} {spec:?} {profile:?}:\n{v}", <T as GpuElement>::NAME);
            assert!(v.valid(), "{} {spec:?} {profile:?}:\n{v}", <T as GpuElement>::NAME);
        }
        verdicts.iter().map(Verdict::max_ratio).fold(0.0, f64::max)
    }
    let mut worst = 0f64;
    for (spec, profile) in cases {
        worst = worst.max(one::<bf16>(&stream, spec, *profile)).max(one::<f16>(&stream, spec, *profile));
    }
    println!("{test_name}: {} cases x 2 dtypes, worst error/bound {worst:.3e}", cases.len());
}

#[test]
fn lq_ne_lk_both_ways() {
    let mut cases = vec![];
    for mask in [Mask::None, Mask::Causal, Mask::Window { left: 7, right: 3 }] {
        for (lq, lk) in [(1, 130), (130, 1), (65, 200), (200, 65)] {
            cases.push((dense(1, 2, 1, lq, lk, 64, 64, mask.clone()), gaussian(1.0)));
        }
    }
    named("lq_ne_lk_both_ways", &cases);
}

#[test]
fn lengths_one_and_tile_edges() {
    let mut cases = vec![];
    for (lq, lk) in [(1, 1), (63, 63), (64, 64), (65, 65), (127, 129), (129, 127), (128, 64), (64, 129)] {
        for mask in [Mask::None, Mask::Causal] {
            cases.push((dense(2, 2, 2, lq, lk, 128, 128, mask), gaussian(4.0)));
        }
    }
    named("lengths_one_and_tile_edges", &cases);
}

#[test]
fn fully_masked_rows_give_zero_and_minus_infinity() {
    let cases = vec![
        // Bottom-right causal with Lq > Lk: the first Lq − Lk rows see no key.
        (dense(1, 2, 2, 100, 30, 64, 64, Mask::Causal), gaussian(1.0)),
        (dense(1, 1, 1, 70, 5, 32, 16, Mask::Window { left: 0, right: 0 }), gaussian(1.0)),
        (
            dense(1, 1, 1, 129, 129, 64, 64, Mask::And(vec![Mask::Causal, Mask::Window { left: 3, right: 0 }])),
            gaussian(1.0),
        ),
        // A sequence with queries and no keys.
        (varlen(&[0, 5, 70], &[0, 0, 64], 2, 1, 64, 64, Mask::None), gaussian(1.0)),
    ];
    named("fully_masked_rows_give_zero_and_minus_infinity", &cases);
    // The verdict already demands exact O = 0 and LSE = −∞ there; this pins it without the oracle too.
    if let Some(ctx) = skip_unless_gpu("fully_masked_rows_give_zero_and_minus_infinity (direct)") {
        let stream = ctx.new_stream().expect("create a stream");
        let case = make_case::<bf16>(&cases[0].0, gaussian(1.0), 5);
        let (o, lse) = run_guarded(&stream, &case).expect("launch");
        for i in 0..70 {
            assert_eq!(lse[[0, 1, i]], f32::NEG_INFINITY, "row {i}");
            assert!((0..64).all(|c| o[[0, 1, i, c]].to_f32() == 0.0), "row {i}");
        }
        assert!(lse[[0, 1, 70]].is_finite());
    }
}

#[test]
fn logit_scale_100() {
    let cases = vec![
        (dense(1, 2, 1, 129, 129, 64, 64, Mask::None), gaussian(100.0)),
        (dense(1, 2, 1, 129, 129, 64, 64, Mask::Causal), gaussian(100.0)),
        (
            dense(1, 1, 1, 65, 200, 128, 64, Mask::None),
            ValueProfile { distribution: Distribution::MaxInLastTile, logit_scale: 100.0, value_mean: 3.0 },
        ),
        (
            dense(1, 1, 1, 64, 64, 32, 32, Mask::None),
            ValueProfile { distribution: Distribution::Peaked, logit_scale: 100.0, value_mean: 0.0 },
        ),
    ];
    named("logit_scale_100", &cases);
}

#[test]
fn gqa_and_mqa() {
    let cases = vec![
        (dense(2, 6, 3, 70, 90, 128, 64, Mask::None), gaussian(1.0)),
        (dense(1, 4, 1, 129, 129, 64, 128, Mask::Causal), gaussian(4.0)),
        (dense(1, 8, 2, 33, 65, 16, 16, Mask::Window { left: 10, right: 2 }), gaussian(1.0)),
    ];
    named("gqa_and_mqa", &cases);
}

#[test]
fn varlen_with_empty_sequences() {
    let cases = vec![
        (varlen(&[0, 70, 70, 71, 200], &[0, 65, 130, 130, 259], 2, 1, 64, 64, Mask::None), gaussian(1.0)),
        (varlen(&[0, 70, 70, 71, 200], &[0, 65, 130, 130, 259], 4, 2, 64, 32, Mask::Causal), gaussian(4.0)),
        (varlen(&[0, 0, 129], &[0, 10, 10], 1, 1, 128, 128, Mask::Window { left: 5, right: 5 }), gaussian(1.0)),
    ];
    named("varlen_with_empty_sequences", &cases);
}

#[test]
fn head_dims_multiples_of_8_up_to_256() {
    let mut cases = vec![];
    for (d, dv) in [(8, 256), (256, 8), (256, 256), (128, 128), (64, 64), (24, 40), (200, 72)] {
        cases.push((dense(1, 2, 1, 65, 129, d, dv, Mask::Causal), gaussian(1.0)));
    }
    named("head_dims_multiples_of_8_up_to_256", &cases);
}

/// Every tiling gives bitwise the same outputs (each row's operations do not depend on the CTA shape; see
/// `attnproof_gpu::flash`), so the oracle checks of the production tiling cover the others; the production tiling's
/// result is also verified here.
#[test]
fn all_tilings_agree_bitwise() {
    let Some(ctx) = skip_unless_gpu("all_tilings_agree_bitwise") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
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
    let Some(ctx) = skip_unless_gpu("unsupported_and_bad_arguments_are_typed_errors") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
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
    // The host path gives the same answer as the guarded device path.
    let host = flash_forward(&stream, &case.spec, case.q.view(), case.k.view(), case.v.view()).unwrap();
    let (o, lse) = run_guarded(&stream, &case).unwrap();
    assert_eq!(bits_of(&host.o, &host.lse), bits_of(&o, &lse));
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
