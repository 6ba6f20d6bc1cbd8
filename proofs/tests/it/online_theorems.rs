//! The online-softmax theorems (E2–E5, E11) on proptest inputs against the oracle, and each
//! against a broken algebra that it must reject.

use crate::common::{REQUIRED, fail, mp_matrix, pseudo_random, split_row_problem};
use attnproof_oracle::online::ring_arrival_order;
use attnproof_oracle::{Mp, Precision, Real, SoftmaxState};
use attnproof_proofs::online::{
    Fold, OnlineAlgebra, OracleAlgebra, RowProblem, block_split_invariance, merge_associative, merge_commutative,
    merge_identity,
};
use ndarray::{Array1, Array2, ArrayView2};
use proptest::prelude::*;

/// The states of the blocks of a split problem.
fn block_states(p: &RowProblem, blocks: &[std::ops::Range<usize>]) -> Vec<SoftmaxState<Mp>> {
    blocks.iter().map(|b| p.block_state(&OracleAlgebra, b.clone())).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn merge_is_a_commutative_monoid((p, blocks, _order) in split_row_problem()) {
        let states = block_states(&p, &blocks);
        for x in &states {
            merge_identity(&OracleAlgebra, x, REQUIRED).map_err(fail)?;
        }
        for w in states.windows(2) {
            merge_commutative(&OracleAlgebra, &w[0], &w[1], REQUIRED).map_err(fail)?;
        }
        for w in states.windows(3) {
            merge_associative(&OracleAlgebra, &w[0], &w[1], &w[2], REQUIRED).map_err(fail)?;
        }
    }

    #[test]
    fn any_split_in_any_order_gives_the_dense_result((p, blocks, order) in split_row_problem()) {
        for fold in [Fold::Update, Fold::Merge] {
            block_split_invariance(&OracleAlgebra, &p, &blocks, &order, fold, REQUIRED)
                .map_err(fail)?;
        }
    }

    #[test]
    fn ring_arrival_orders_give_the_dense_result((p, _blocks, _order) in split_row_problem(), devices in 1usize..=5) {
        // E11: device g sees the G key blocks in the order (g − t) mod G.
        let keys = p.scores.ncols();
        let blocks: Vec<_> = (0..devices).map(|b| b * keys / devices..(b + 1) * keys / devices).collect();
        for g in 0..devices {
            block_split_invariance(&OracleAlgebra, &p, &blocks, &ring_arrival_order(g, devices), Fold::Merge, REQUIRED)
                .map_err(fail)?;
        }
    }
}

/// Delegates to the oracle except where a variant overrides.
#[derive(Clone, Copy)]
enum Broken {
    /// Merge without the `e^{m−m'}` rescale.
    MergeWithoutRescale,
    /// Merge that always rescales the second operand by `e^{m_b − m_a}`, right only when `m_a ≥ m_b`.
    MergeAssumesFirstIsMax,
    /// Merge computing `e^{m_a − m}` without the `−∞ − (−∞)` convention.
    MergeWithoutEmptyConvention,
    /// Update without rescaling the old state.
    UpdateWithoutRescale,
    /// Finalize with `LSE = m + ℓ` (missing log).
    FinalizeWithoutLog,
}

impl OnlineAlgebra for Broken {
    fn of_block(
        &self,
        s: ArrayView2<'_, Mp>,
        vis: ArrayView2<'_, bool>,
        v: ArrayView2<'_, Mp>,
        ctx: Precision,
    ) -> SoftmaxState<Mp> {
        OracleAlgebra.of_block(s, vis, v, ctx)
    }
    fn update(
        &self,
        state: &mut SoftmaxState<Mp>,
        s: ArrayView2<'_, Mp>,
        vis: ArrayView2<'_, bool>,
        v: ArrayView2<'_, Mp>,
        ctx: Precision,
    ) {
        match self {
            Broken::UpdateWithoutRescale => {
                let block = SoftmaxState::of_block(s, vis, v, ctx);
                for i in 0..state.rows() {
                    let m = state.m[i].clone().max(block.m[i].clone());
                    let c = attnproof_oracle::online::rescale_factor(&block.m[i], &m, ctx);
                    state.l[i] = state.l[i].clone() + c.clone() * block.l[i].clone();
                    for (a, b) in state.a.row_mut(i).iter_mut().zip(block.a.row(i)) {
                        *a = a.clone() + c.clone() * b.clone();
                    }
                    state.m[i] = m;
                }
            }
            _ => OracleAlgebra.update(state, s, vis, v, ctx),
        }
    }
    fn merge(&self, a: &SoftmaxState<Mp>, b: &SoftmaxState<Mp>) -> SoftmaxState<Mp> {
        let factors = |i: usize, m: &Mp| -> (Mp, Mp) {
            let ctx = m.ctx();
            match self {
                Broken::MergeWithoutRescale => (Mp::one(ctx), Mp::one(ctx)),
                Broken::MergeAssumesFirstIsMax => (Mp::one(ctx), (b.m[i].clone() - a.m[i].clone()).exp()),
                _ => ((a.m[i].clone() - m.clone()).exp(), (b.m[i].clone() - m.clone()).exp()),
            }
        };
        match self {
            Broken::MergeWithoutRescale | Broken::MergeAssumesFirstIsMax | Broken::MergeWithoutEmptyConvention => {
                let mut out = a.clone();
                for i in 0..a.rows() {
                    let m = a.m[i].clone().max(b.m[i].clone());
                    let (ca, cb) = factors(i, &m);
                    out.l[i] = ca.clone() * a.l[i].clone() + cb.clone() * b.l[i].clone();
                    for (o, (x, y)) in out.a.row_mut(i).iter_mut().zip(a.a.row(i).iter().zip(b.a.row(i))) {
                        *o = ca.clone() * x.clone() + cb.clone() * y.clone();
                    }
                    out.m[i] = m;
                }
                out
            }
            _ => OracleAlgebra.merge(a, b),
        }
    }
    fn finalize(&self, state: &SoftmaxState<Mp>) -> (Array2<Mp>, Array1<Mp>) {
        let (o, lse) = OracleAlgebra.finalize(state);
        match self {
            Broken::FinalizeWithoutLog => {
                let lse = ndarray::Zip::from(&lse)
                    .and(&state.m)
                    .and(&state.l)
                    .map_collect(|x, m, l| if x.is_finite() { m.clone() + l.clone() } else { x.clone() });
                (o, lse)
            }
            _ => (o, lse),
        }
    }
}

/// A deterministic two-row problem over 6 keys whose block maxima increase left to right, the
/// second row fully masked.
fn fixed_problem() -> RowProblem {
    let r = pseudo_random(7, 12);
    let scores: Vec<f64> = (0..12).map(|j| 3.0 * (j % 6) as f64 + r[j]).collect();
    let visible = Array2::from_shape_fn((2, 6), |(i, _)| i == 0);
    RowProblem { scores: mp_matrix(2, 6, &scores), visible, v: mp_matrix(6, 2, &pseudo_random(8, 12)) }
}

fn fixed_states() -> Vec<SoftmaxState<Mp>> {
    let p = fixed_problem();
    [0..2, 2..4, 4..6].into_iter().map(|b| p.block_state(&OracleAlgebra, b)).collect()
}

#[test]
fn identity_rejects_a_merge_without_the_empty_convention() {
    let x = &fixed_states()[0];
    assert!(merge_identity(&OracleAlgebra, x, REQUIRED).is_ok());
    assert!(merge_identity(&Broken::MergeWithoutEmptyConvention, x, REQUIRED).is_err());
}

#[test]
fn commutativity_rejects_a_merge_that_assumes_the_first_max() {
    let s = fixed_states();
    assert!(merge_commutative(&OracleAlgebra, &s[0], &s[1], REQUIRED).is_ok());
    assert!(merge_commutative(&Broken::MergeAssumesFirstIsMax, &s[0], &s[1], REQUIRED).is_err());
}

#[test]
fn associativity_rejects_a_merge_that_assumes_the_first_max() {
    let s = fixed_states();
    assert!(merge_associative(&OracleAlgebra, &s[0], &s[1], &s[2], REQUIRED).is_ok());
    assert!(merge_associative(&Broken::MergeAssumesFirstIsMax, &s[0], &s[1], &s[2], REQUIRED).is_err());
}

#[test]
fn block_split_rejects_missing_rescales_and_a_missing_log() {
    let p = fixed_problem();
    let blocks = [0..2, 2..4, 4..6];
    let order = [2, 0, 1];
    for fold in [Fold::Update, Fold::Merge] {
        assert!(block_split_invariance(&OracleAlgebra, &p, &blocks, &order, fold, REQUIRED).is_ok());
        assert!(block_split_invariance(&Broken::FinalizeWithoutLog, &p, &blocks, &order, fold, REQUIRED).is_err());
    }
    assert!(block_split_invariance(&Broken::MergeWithoutRescale, &p, &blocks, &order, Fold::Merge, REQUIRED).is_err());
    // The old state needs rescaling only when a later block raises the max: visit in increasing order.
    assert!(
        block_split_invariance(&Broken::UpdateWithoutRescale, &p, &blocks, &[0, 1, 2], Fold::Update, REQUIRED).is_err()
    );
}

#[test]
fn block_split_rejects_a_non_partition() {
    let p = fixed_problem();
    let err = block_split_invariance(&OracleAlgebra, &p, &[0..3, 2..6], &[0, 1], Fold::Merge, REQUIRED).unwrap_err();
    assert!(matches!(err, attnproof_proofs::Violation::Hypothesis { .. }), "{err}");
}
