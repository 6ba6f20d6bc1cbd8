//! The reference FlashAttention backward, both ownership strategies (E10a), verified against
//! the oracle on fuzzed shapes and values in bf16 and f16, with the forward it depends on
//! computed by the reference forward; dK and dV agree bit for bit between the strategies.

use attnproof_harness::backward::{BackwardCandidate, verify_backward};
use attnproof_harness::flash::recipe;
use attnproof_harness::generate::{make_case, make_d_out};
use attnproof_harness::strategies::{profile, spec, suite_config};
use attnproof_harness::{Case, HarnessError};
use attnproof_oracle::spec::Operand;
use attnproof_reference::{
    BackwardInputs, BackwardOutputs, BackwardStrategy, Element, TileConfig, flash_backward, flash_forward_owned,
};
use half::{bf16, f16};
use ndarray::ArrayD;
use proptest::prelude::*;

const TILE: usize = 16;

/// NaN-poisoned gradients after one backward run.
struct Grads<T> {
    dq: ArrayD<T>,
    dk: ArrayD<T>,
    dv: ArrayD<T>,
    delta: ArrayD<f32>,
}

fn run<T: Element>(
    case: &Case<T>,
    d_out: &ArrayD<T>,
    tiles: TileConfig,
    strategy: BackwardStrategy,
) -> Result<Grads<T>, TestCaseError> {
    let fail = |e: attnproof_reference::ReferenceError| TestCaseError::fail(e.to_string());
    let (o, lse) = flash_forward_owned(&case.spec, &case.inputs(), tiles).map_err(fail)?;
    let nan = |op| ArrayD::from_elem(case.spec.expected_shape(op), T::from_f32(f32::NAN));
    let mut g = Grads {
        dq: nan(Operand::Q),
        dk: nan(Operand::K),
        dv: nan(Operand::V),
        delta: ArrayD::from_elem(case.spec.expected_shape(Operand::RowStat), f32::NAN),
    };
    let inputs = BackwardInputs {
        q: case.q.view(),
        k: case.k.view(),
        v: case.v.view(),
        o: o.view(),
        lse: lse.view(),
        d_out: d_out.view(),
    };
    let outputs =
        BackwardOutputs { dq: g.dq.view_mut(), dk: g.dk.view_mut(), dv: g.dv.view_mut(), delta: g.delta.view_mut() };
    flash_backward(&case.spec, &inputs, tiles, strategy, outputs).map_err(fail)?;
    Ok(g)
}

fn check<T: Element>(case: &Case<T>, d_out: &ArrayD<T>) -> Result<(), TestCaseError> {
    let tiles = TileConfig { q_tile: TILE, kv_tile: TILE };
    let a = run(case, d_out, tiles, BackwardStrategy::TwoTraversals)?;
    let b = run(case, d_out, tiles, BackwardStrategy::KvOwnerPartialDq)?;
    // KV tiles own dK/dV in both strategies, with the same arithmetic.
    let same = |x: &ArrayD<T>, y: &ArrayD<T>| {
        x.iter().zip(y.iter()).all(|(p, q)| p.to_f32().to_bits() == q.to_f32().to_bits())
    };
    prop_assert!(same(&a.dk, &b.dk) && same(&a.dv, &b.dv), "strategies disagree on dK/dV");
    for (name, g) in [("A", &a), ("B", &b)] {
        let candidate = BackwardCandidate { dq: g.dq.view(), dk: g.dk.view(), dv: g.dv.view(), delta: g.delta.view() };
        match verify_backward(case, d_out, TILE, recipe::<T>(TILE), candidate) {
            Ok(v) => {
                prop_assert!(v.passed(), "strategy {name}:\n{v}");
                prop_assert!(v.valid(), "strategy {name}:\n{v}");
            }
            Err(HarnessError::Model(m)) => return Err(TestCaseError::reject(m.to_string())),
            Err(e) => return Err(TestCaseError::fail(e.to_string())),
        }
    }
    Ok(())
}

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
