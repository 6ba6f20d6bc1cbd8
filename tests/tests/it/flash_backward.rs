//! The reference FlashAttention backward, both ownership strategies (E10a), verified against
//! the oracle on fuzzed shapes and values in bf16 and f16 and on the harness's adversarial table
//! (`candidate_tests!`, the same cases the GPU kernels run), with the forward it depends on
//! computed by the reference forward; dK, dV and D agree bit for bit between the strategies.

use attnproof_harness::adversarial::{Repeat, backward_verdicts};
use attnproof_harness::backward::{BackwardCandidate, BackwardExpectation, verify_backward};
use attnproof_harness::candidate::{Candidate, Gradients, ReferenceCandidate, Storage};
use attnproof_harness::generate::{make_case, make_d_out};
use attnproof_harness::recipes;
use attnproof_harness::strategies::{profile, spec, suite_config};
use attnproof_harness::{Case, HarnessError, candidate_tests};
use attnproof_reference::{BackwardStrategy, TileConfig};
use half::{bf16, f16};
use ndarray::ArrayD;
use proptest::prelude::*;

const TILE: usize = 16;
const REFERENCE: ReferenceCandidate = ReferenceCandidate { tiles: TileConfig { q_tile: TILE, kv_tile: TILE } };

/// Both strategies on one case, from the reference forward's `O` and LSE: verdicts pass, gates valid, dK, dV and D
/// bitwise equal between the strategies (KV tiles own them in both, with the same arithmetic).
fn check<T: Storage>(case: &Case<T>, d_out: &ArrayD<T>) -> Result<(), TestCaseError> {
    backward_verdicts(&REFERENCE, &[(case, d_out)], Repeat::Never).map_err(|e| e.into_test_case_error())?;
    Ok(())
}

/// One strategy's gradients on `case`, from the reference forward.
fn run<T: Storage>(case: &Case<T>, d_out: &ArrayD<T>, strategy: BackwardStrategy) -> Gradients<T> {
    let forward = REFERENCE.forward(case).expect("reference forward");
    REFERENCE.backward(strategy, case, &forward, d_out).expect("reference backward")
}

/// One expectation judges any number of candidates exactly as `verify_backward` judges each alone (same ratios,
/// same gate), and still rejects a candidate of the wrong shape.
#[test]
fn a_prepared_expectation_gives_the_verdicts_of_verify_backward() {
    let spec = attnproof_oracle::AttentionSpec::dense(1, 2, 1, 37, 45, 16, 8).with_mask(attnproof_oracle::Mask::Causal);
    use attnproof_harness::generate::{Distribution, ValueProfile};
    let profile = ValueProfile { distribution: Distribution::Gaussian, logit_scale: 1.0, value_mean: 0.0 };
    let case = make_case::<bf16>(&spec, profile, 5);
    let d_out = make_d_out(&spec, 5);
    let expect = BackwardExpectation::new(&case, &d_out, TILE, recipes::reference::<bf16>(TILE)).unwrap();
    let good = run(&case, &d_out, BackwardStrategy::TwoTraversals);
    // A wrong candidate too: dV off by one bf16 ulp of 1 everywhere fails, so the two paths must agree on failures.
    let mut bad = run(&case, &d_out, BackwardStrategy::KvOwnerPartialDq);
    bad.dv.mapv_inplace(|x| bf16::from_f32(x.to_f32() + 1.0 / 128.0));
    for g in [&good, &bad] {
        let alone = verify_backward(&case, &d_out, TILE, recipes::reference::<bf16>(TILE), g.candidate()).unwrap();
        let reused = expect.verify(g.candidate()).unwrap();
        assert_eq!(alone.gate, reused.gate);
        let ratios = |v: &attnproof_harness::Verdict| v.outputs.iter().map(|o| o.max_ratio).collect::<Vec<_>>();
        assert_eq!(ratios(&alone), ratios(&reused));
        assert_eq!(alone.passed(), reused.passed());
    }
    assert!(expect.verify(good.candidate()).unwrap().passed());
    assert!(!expect.verify(bad.candidate()).unwrap().passed());
    let short = ArrayD::<bf16>::zeros(ndarray::IxDyn(&[1]));
    let candidate = BackwardCandidate { dq: short.view(), ..good.candidate() };
    assert!(matches!(expect.verify(candidate), Err(HarnessError::CandidateShape { argument: "dq", .. })));
}

// The adversarial table in tiles of 64 (its lengths sit around 64 and 128): one test per group, the dtype alternating,
// both strategies.
candidate_tests!(ReferenceCandidate::for_tests, [backward]);

proptest! {
    #![proptest_config(suite_config("flash_backward", 32))]

    #[test]
    fn reference_backward_is_within_bound_bf16(spec in spec(TILE), profile in profile(), seed in any::<u64>()) {
        let case = make_case::<bf16>(&spec, profile, seed);
        check(&case, &make_d_out(&spec, seed))?;
    }

    #[test]
    fn reference_backward_is_within_bound_f16(spec in spec(TILE), profile in profile(), seed in any::<u64>()) {
        let case = make_case::<f16>(&spec, profile, seed);
        check(&case, &make_d_out(&spec, seed))?;
    }
}

/// Regression (proptest, flash_backward.txt): one query over two keys, d = 1, peaked, logit
/// scale 20. The exact dQ vanishes by cancellation, so "zeros" is not a wrong answer there; the
/// gate once declared the case invalid because it judged visibility against the noise-sized dQ.
#[test]
fn gate_treats_a_gradient_that_cancels_to_zero_as_indistinguishable() {
    use attnproof_harness::generate::{Distribution, ValueProfile};
    let spec = attnproof_oracle::AttentionSpec::dense(1, 1, 1, 1, 2, 1, 1);
    let profile = ValueProfile { distribution: Distribution::Peaked, logit_scale: 20.0, value_mean: 0.0 };
    let seed = 1189096944260537085;
    let case = make_case::<bf16>(&spec, profile, seed);
    check(&case, &make_d_out(&spec, seed)).expect("verdict passes and the gate is valid");
}

/// Regression (proptest, flash_backward.txt): GQA 3:1, d = 1, dv = 59, Gaussian, logit scale 4,
/// f16. dK is small against the terms it sums, and "zeros" was judged visible against dK itself.
#[test]
fn gate_judges_dk_against_the_magnitude_of_its_terms() {
    use attnproof_harness::generate::{Distribution, ValueProfile};
    let spec = attnproof_oracle::AttentionSpec::dense(1, 3, 1, 2, 2, 1, 59);
    let profile = ValueProfile { distribution: Distribution::Gaussian, logit_scale: 4.0, value_mean: 0.0 };
    let seed = 12786899506420958965;
    for case_seed in [seed, seed ^ 1] {
        let case = make_case::<f16>(&spec, profile, case_seed);
        check(&case, &make_d_out(&spec, case_seed)).expect("verdict passes and the gate is valid");
    }
}

/// `extra_query_partials` (the ring backward's extra f32 additions over query chunks) widens exactly the bounds of the
/// sums over queries, dK and dV, and leaves dQ's alone.
#[test]
fn extra_query_partials_widen_the_dk_and_dv_bounds_only() {
    use attnproof_harness::backward::problem_backward_bounds_with_visibility;
    use attnproof_harness::generate::{Distribution, ValueProfile};
    use attnproof_proofs::flash_bound::FlashRecipe;
    let spec =
        attnproof_oracle::AttentionSpec::dense(1, 2, 2, 40, 40, 16, 16).with_mask(attnproof_oracle::Mask::Causal);
    let profile = ValueProfile { distribution: Distribution::Gaussian, logit_scale: 1.0, value_mean: 0.0 };
    let case = make_case::<bf16>(&spec, profile, 3);
    let g = make_d_out::<bf16>(&spec, 3).mapv(|x| x.to_f32() as f64);
    let [q, k, v] = case.widened();
    let masks: Vec<_> = spec.sequences().iter().map(|s| spec.mask.matrix(s.len_q, s.len_k)).collect();
    let visibility = |s: &attnproof_oracle::spec::Sequence, _h: usize| masks[s.index].clone();
    let bounds = |extra: usize| {
        let recipe = FlashRecipe { extra_query_partials: extra, ..recipes::reference::<bf16>(TILE) };
        problem_backward_bounds_with_visibility(&spec, [&q, &k, &v, &g], &visibility, recipe, TILE).unwrap()
    };
    let (plain, wider) = (bounds(0), bounds(6));
    assert_eq!(plain.bound_dq, wider.bound_dq);
    let grew =
        |a: &ArrayD<f64>, b: &ArrayD<f64>| a.iter().zip(b).all(|(x, y)| y >= x) && a.iter().zip(b).any(|(x, y)| y > x);
    assert!(grew(&plain.bound_dk, &wider.bound_dk), "dK bounds did not grow");
    assert!(grew(&plain.bound_dv, &wider.bound_dv), "dV bounds did not grow");
}

/// `exp_underflow` (what an f32 `exp` may lose to underflow: a flushing `exp` loses up to 2^-126) enters the forward's
/// `O` bound as `Lk τ_e max_j |v_jc|` and the backward's `dV` bound as `Lq τ_e max_i |dO_ic|`, and `dQ`, `dK` through
/// `τ_e |dP − D|` and `D`'s bound (the first alone: `attnproof_proofs::flash_bound`'s unit test); the LSE bound does not
/// depend on it. A value of 1 (absurd, but visible in f64) shows each term.
#[test]
fn exp_underflow_enters_o_dv_dq_and_dk_as_derived() {
    use attnproof_harness::backward::problem_backward_bounds_with_visibility;
    use attnproof_harness::flash::problem_forward_bounds;
    use attnproof_harness::generate::{Distribution, ValueProfile};
    use attnproof_proofs::flash_bound::{F32_SUBNORMAL, FlashRecipe, SECOND_ORDER_FACTOR};
    use ndarray::{Axis, Ix4};
    let (lq, lk) = (24, 40);
    let spec = attnproof_oracle::AttentionSpec::dense(1, 2, 2, lq, lk, 16, 8);
    let profile = ValueProfile { distribution: Distribution::Gaussian, logit_scale: 1.0, value_mean: 0.0 };
    let case = make_case::<bf16>(&spec, profile, 5);
    let g = make_d_out::<bf16>(&spec, 5).mapv(|x| x.to_f32() as f64);
    let [q, k, v] = case.widened();
    let with = |exp_underflow: f64| FlashRecipe { exp_underflow, ..recipes::reference::<bf16>(TILE) };
    let (plain, wide) = (with(F32_SUBNORMAL), with(1.0));
    // Every element (b, h, row, c) of `wide − plain` is `n · max over rows of |source[b, h, ·, c]|` times the term's
    // factor: `n` = Lk for O (source V), Lq for dV (source dO).
    let added = (1.0 - F32_SUBNORMAL) * SECOND_ORDER_FACTOR;
    let grew_by_term = |name: &str, plain: &ArrayD<f64>, wide: &ArrayD<f64>, source: &ArrayD<f64>, n: usize| {
        let (plain, source) = (plain.view().into_dimensionality::<Ix4>().unwrap(), source.view());
        let source = source.into_dimensionality::<Ix4>().unwrap();
        for ((b, h, row, c), &w) in wide.view().into_dimensionality::<Ix4>().unwrap().indexed_iter() {
            let column = source.index_axis(Axis(0), b).index_axis(Axis(0), h).column(c).to_owned();
            let want = n as f64 * column.iter().fold(0.0f64, |m, x| m.max(x.abs())) * added;
            let got = w - plain[[b, h, row, c]];
            assert!((got - want).abs() <= 1e-9 * want, "{name}[{b},{h},{row},{c}] grew by {got:e}, not {want:e}");
        }
    };

    let forward = |recipe| problem_forward_bounds(&spec, &q, &k, &v, recipe).unwrap();
    let (fwd_plain, fwd_wide) = (forward(plain), forward(wide));
    assert_eq!(fwd_plain.bound_lse, fwd_wide.bound_lse);
    grew_by_term("O", &fwd_plain.bound_o, &fwd_wide.bound_o, &v, lk);

    let masks: Vec<_> = spec.sequences().iter().map(|s| spec.mask.matrix(s.len_q, s.len_k)).collect();
    let visibility = |s: &attnproof_oracle::spec::Sequence, _h: usize| masks[s.index].clone();
    let bounds =
        |recipe| problem_backward_bounds_with_visibility(&spec, [&q, &k, &v, &g], &visibility, recipe, TILE).unwrap();
    let (bwd_plain, bwd_wide) = (bounds(plain), bounds(wide));
    grew_by_term("dV", &bwd_plain.bound_dv, &bwd_wide.bound_dv, &g, lq);
    let grew = |a: &ArrayD<f64>, b: &ArrayD<f64>| a.iter().zip(b).all(|(x, y)| y > x);
    assert!(grew(&bwd_plain.bound_dq, &bwd_wide.bound_dq), "dQ bounds did not grow everywhere");
    assert!(grew(&bwd_plain.bound_dk, &bwd_wide.bound_dk), "dK bounds did not grow everywhere");
}

/// The dense reference backward refuses, with a typed error naming the argument, a non-finite upstream gradient, a
/// forward output of the wrong shape and a gradient buffer of the wrong shape; the unchanged problem runs.
#[test]
fn the_dense_reference_backward_refuses_bad_shapes_and_non_finite_inputs() {
    use attnproof_oracle::spec::Operand;
    use attnproof_oracle::{AttentionSpec, OracleError};
    use attnproof_reference::{BackwardInputs, BackwardOutputs, ReferenceError, flash_backward, flash_forward_owned};
    use ndarray::IxDyn;
    let spec = AttentionSpec::dense(1, 2, 1, 16, 20, 8, 8);
    let case = make_case::<bf16>(&spec, attnproof_harness::generate::ValueProfile::GAUSSIAN, 6);
    let tiles = TileConfig { q_tile: 8, kv_tile: 8 };
    let (o, lse) = flash_forward_owned(&spec, &case.inputs(), tiles).expect("forward");
    let d_out = make_d_out::<bf16>(&spec, 6);
    let inputs = case.backward_inputs(&o, &lse, &d_out);
    let run = |inputs: &BackwardInputs<'_, bf16>, dq_shape: &[usize]| {
        let mut dq = ArrayD::from_elem(IxDyn(dq_shape), bf16::ZERO);
        let mut dk = ArrayD::from_elem(spec.expected_shape(Operand::K), bf16::ZERO);
        let mut dv = ArrayD::from_elem(spec.expected_shape(Operand::V), bf16::ZERO);
        let mut delta = ArrayD::from_elem(spec.expected_shape(Operand::RowStat), 0f32);
        let out = BackwardOutputs { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut(), delta: delta.view_mut() };
        flash_backward(&spec, inputs, tiles, BackwardStrategy::TwoTraversals, out)
    };
    let q_shape = spec.expected_shape(Operand::Q);
    assert!(run(&inputs, &q_shape).is_ok(), "the unchanged problem runs");
    let mut nan_d_out = d_out.clone();
    nan_d_out[[0, 1, 3, 2]] = bf16::INFINITY;
    let r = run(&BackwardInputs { d_out: nan_d_out.view(), ..inputs.clone() }, &q_shape);
    assert!(
        matches!(&r, Err(ReferenceError::Problem(OracleError::NonFinite { argument: "d_out", .. }))),
        "an infinite upstream gradient accepted: {r:?}"
    );
    let short_o = o.slice_axis(ndarray::Axis(2), (0..15).into()).to_owned();
    let r = run(&BackwardInputs { o: short_o.view(), ..inputs.clone() }, &q_shape);
    assert!(
        matches!(&r, Err(ReferenceError::Problem(OracleError::ShapeMismatch { argument: "o", .. }))),
        "a forward output of 15 rows accepted for Lq = 16: {r:?}"
    );
    let mut narrow = q_shape.clone();
    narrow[3] -= 1;
    let r = run(&inputs, &narrow);
    assert!(
        matches!(&r, Err(ReferenceError::Problem(OracleError::ShapeMismatch { argument: "dq", .. }))),
        "a dQ buffer one column too narrow accepted: {r:?}"
    );
}
