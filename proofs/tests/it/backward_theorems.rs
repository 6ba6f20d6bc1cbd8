//! The backward theorems (E6–E10) on proptest inputs against the oracle, and each against a
//! broken variant that it must reject.

use crate::common::{PREC, REQUIRED, fail, head_case, mp_matrix, problem_case, pseudo_random};
use attnproof_oracle::dense::{self, HeadForward, HeadGradients};
use attnproof_oracle::{AttentionSpec, Gradients, Layout, Mp, OracleError, Precision, Qkv, Real};
use attnproof_proofs::Bits;
use attnproof_proofs::backward::{
    HeadCase, ProblemCase, backward_matches_finite_differences, constant_dp_gives_zero_ds, delta_two_forms,
    oracle_backward, oracle_forward, oracle_head_backward, oracle_head_forward, probabilities_from_lse,
    score_gradient_rows_sum_to_zero,
};
use ndarray::{Array1, Array2, ArrayD, ArrayView2, IxDyn};
use proptest::prelude::*;

/// Finite differences with `h = 2^-64` at 256 bits agree to about 120 bits; 80 is the bar.
const FD_STEP_BITS: u32 = 64;
const FD_REQUIRED: Bits = Bits(80.0);

fn oracle_rule(p: ArrayView2<'_, Mp>, dp: ArrayView2<'_, Mp>, delta: &Array1<Mp>) -> Array2<Mp> {
    dense::score_gradient(p, dp, delta.view())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn probabilities_are_recovered_from_lse(case in head_case()) {
        probabilities_from_lse(&oracle_head_forward, &case, REQUIRED).map_err(fail)?;
    }

    #[test]
    fn both_forms_of_delta_agree(case in head_case()) {
        delta_two_forms(&oracle_head_forward, &oracle_head_backward, &case, REQUIRED).map_err(fail)?;
    }

    #[test]
    fn score_gradient_rows_sum_to_zero_and_vanish_for_constant_dp(case in head_case()) {
        let p = case.probabilities();
        score_gradient_rows_sum_to_zero(&oracle_rule, p.view(), case.d_probabilities().view(), REQUIRED).map_err(fail)?;
        let c = Array1::from_shape_fn(p.nrows(), |i| case.d_out[[i, 0]].clone());
        constant_dp_gives_zero_ds(&oracle_rule, p.view(), &c, REQUIRED).map_err(fail)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn backward_equals_finite_differences(case in problem_case()) {
        backward_matches_finite_differences(&oracle_forward, &oracle_backward, &case, FD_STEP_BITS, FD_REQUIRED).map_err(fail)?;
    }
}

/// A fixed head with logits up to ~20, one fully masked row.
fn fixed_case() -> HeadCase {
    let (lq, lk, d, dv) = (3, 4, 2, 2);
    let r = pseudo_random(11, lq * d + lk * d + lk * dv + lq * dv);
    let (q, rest) = r.split_at(lq * d);
    let (k, rest) = rest.split_at(lk * d);
    let (v, g) = rest.split_at(lk * dv);
    HeadCase {
        q: mp_matrix(lq, d, q),
        k: mp_matrix(lk, d, k),
        v: mp_matrix(lk, dv, v),
        d_out: mp_matrix(lq, dv, g),
        visible: Array2::from_shape_fn((lq, lk), |(i, j)| i != 1 && j <= i + 1),
        scale: Mp::new(10.0, PREC),
    }
}

#[test]
fn lse_theorem_rejects_a_base_2_lse() {
    let case = fixed_case();
    let base2 = |c: &HeadCase| {
        let f = oracle_head_forward(c);
        let ln2 = Mp::new(2.0, PREC).ln();
        HeadForward { lse: f.lse.mapv(|x| x / ln2.clone()), ..f }
    };
    assert!(probabilities_from_lse(&oracle_head_forward, &case, REQUIRED).is_ok());
    assert!(probabilities_from_lse(&base2, &case, REQUIRED).is_err());
}

/// The backward with `D` taken from the unnormalized accumulator `A = ℓ O` instead of `O`.
fn delta_from_unnormalized(case: &HeadCase, fwd: &HeadForward<Mp>) -> HeadGradients<Mp> {
    let ctx = case.ctx();
    let s = dense::scores(case.q.view(), case.k.view(), &case.scale, case.visible.view(), ctx);
    let state = attnproof_oracle::SoftmaxState::of_block(s.view(), case.visible.view(), case.v.view(), ctx);
    let mut g = oracle_head_backward(case, fwd);
    g.delta = dense::delta_from_output(case.d_out.view(), state.a.view(), ctx);
    g
}

#[test]
fn delta_theorem_rejects_delta_from_the_unnormalized_accumulator() {
    let case = fixed_case();
    assert!(delta_two_forms(&oracle_head_forward, &oracle_head_backward, &case, REQUIRED).is_ok());
    assert!(delta_two_forms(&oracle_head_forward, &delta_from_unnormalized, &case, REQUIRED).is_err());
}

#[test]
fn score_gradient_theorems_reject_a_rule_without_delta() {
    let case = fixed_case();
    let p = case.probabilities();
    let without_delta = |p: ArrayView2<'_, Mp>, dp: ArrayView2<'_, Mp>, _: &Array1<Mp>| {
        ndarray::Zip::from(p).and(dp).map_collect(|a, b| a.clone() * b.clone())
    };
    let c = Array1::from_elem(p.nrows(), Mp::new(0.75, PREC));
    assert!(score_gradient_rows_sum_to_zero(&oracle_rule, p.view(), case.d_probabilities().view(), REQUIRED).is_ok());
    assert!(
        score_gradient_rows_sum_to_zero(&without_delta, p.view(), case.d_probabilities().view(), REQUIRED).is_err()
    );
    assert!(constant_dp_gives_zero_ds(&oracle_rule, p.view(), &c, REQUIRED).is_ok());
    assert!(constant_dp_gives_zero_ds(&without_delta, p.view(), &c, REQUIRED).is_err());
}

/// A fixed GQA problem: 1 sequence, 2 query heads on 1 KV head, `Lq = 3`, `Lk = 4`, causal.
fn fixed_problem() -> ProblemCase {
    let spec = AttentionSpec::dense(1, 2, 1, 3, 4, 2, 2).with_mask(attnproof_oracle::Mask::Causal);
    let t = |seed: u64, shape: &[usize]| {
        let n = shape.iter().product();
        ArrayD::from_shape_vec(IxDyn(shape), pseudo_random(seed, n).into_iter().map(|x| Mp::new(x, PREC)).collect())
            .unwrap()
    };
    assert!(matches!(spec.layout, Layout::Dense { .. }));
    ProblemCase {
        q: t(1, &[1, 2, 3, 2]),
        k: t(2, &[1, 1, 4, 2]),
        v: t(3, &[1, 1, 4, 2]),
        d_out: t(4, &[1, 2, 3, 2]),
        spec,
        precision: PREC,
    }
}

type Tamper = fn(&AttentionSpec, &mut Gradients<Mp>);

#[test]
fn finite_differences_reject_broken_backward_passes() {
    let case = fixed_problem();
    assert!(
        backward_matches_finite_differences(&oracle_forward, &oracle_backward, &case, FD_STEP_BITS, FD_REQUIRED)
            .is_ok()
    );
    let tampers: [(&str, Tamper); 3] = [
        ("scale missing from dK", |spec, g| {
            let a = spec.scale_value::<Mp>(PREC);
            g.dk.mapv_inplace(|x| x / a.clone());
        }),
        ("dV of the first query head only", |_, g| g.dv.mapv_inplace(|x| x / Mp::new(2.0, PREC))),
        ("dQ rows shifted", |_, g| {
            let first = g.dq.index_axis(ndarray::Axis(2), 0).to_owned();
            g.dq.index_axis_mut(ndarray::Axis(2), 1).assign(&first);
        }),
    ];
    for (name, tamper) in tampers {
        let broken = move |spec: &AttentionSpec,
                           qkv: Qkv<'_, Mp>,
                           d_out: &ArrayD<Mp>,
                           p: Precision|
              -> Result<Gradients<Mp>, OracleError> {
            let mut g = oracle_backward(spec, qkv, d_out, p)?;
            tamper(spec, &mut g);
            Ok(g)
        };
        assert!(
            backward_matches_finite_differences(&oracle_forward, &broken, &case, FD_STEP_BITS, FD_REQUIRED).is_err(),
            "{name} was not rejected"
        );
    }
}
