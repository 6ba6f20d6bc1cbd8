//! Theorems of the online softmax (E2–E5) and of ring attention's row core (E11): ⊕ is a
//! commutative monoid with identity `(−∞, 0, 0)`, and any split of a row's keys into blocks,
//! absorbed in any order by update (E3) or merged (E4), finalizes (E5) to the definition.

use std::ops::Range;

use attnproof_oracle::{Mp, Precision, Real, SoftmaxState};
use ndarray::{Array1, Array2, ArrayView2, Axis, Slice};

use crate::definition;
use crate::residual::{Agreement, Bits, Violation, agree};

/// An implementation of the online-softmax algebra under test.
pub trait OnlineAlgebra {
    /// E2: the state of one block.
    fn of_block(
        &self,
        scores: ArrayView2<'_, Mp>,
        visible: ArrayView2<'_, bool>,
        v: ArrayView2<'_, Mp>,
        ctx: Precision,
    ) -> SoftmaxState<Mp>;
    /// E3: absorb a block.
    fn update(
        &self,
        state: &mut SoftmaxState<Mp>,
        scores: ArrayView2<'_, Mp>,
        visible: ArrayView2<'_, bool>,
        v: ArrayView2<'_, Mp>,
        ctx: Precision,
    );
    /// E4: merge two states of disjoint key sets.
    fn merge(&self, a: &SoftmaxState<Mp>, b: &SoftmaxState<Mp>) -> SoftmaxState<Mp>;
    /// E5: `(O, LSE)`.
    fn finalize(&self, state: &SoftmaxState<Mp>) -> (Array2<Mp>, Array1<Mp>);
}

/// The oracle's own algebra ([`SoftmaxState`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct OracleAlgebra;

impl OnlineAlgebra for OracleAlgebra {
    fn of_block(
        &self,
        scores: ArrayView2<'_, Mp>,
        visible: ArrayView2<'_, bool>,
        v: ArrayView2<'_, Mp>,
        ctx: Precision,
    ) -> SoftmaxState<Mp> {
        SoftmaxState::of_block(scores, visible, v, ctx)
    }
    fn update(
        &self,
        state: &mut SoftmaxState<Mp>,
        scores: ArrayView2<'_, Mp>,
        visible: ArrayView2<'_, bool>,
        v: ArrayView2<'_, Mp>,
        ctx: Precision,
    ) {
        state.update(scores, visible, v, ctx)
    }
    fn merge(&self, a: &SoftmaxState<Mp>, b: &SoftmaxState<Mp>) -> SoftmaxState<Mp> {
        a.merge(b)
    }
    fn finalize(&self, state: &SoftmaxState<Mp>) -> (Array2<Mp>, Array1<Mp>) {
        state.finalize()
    }
}

/// Scores, visibility and values of some query rows over one sequence of keys.
#[derive(Clone, Debug)]
pub struct RowProblem {
    /// Scores `[rows, keys]` (entries under a hidden mask position are ignored).
    pub scores: Array2<Mp>,
    /// Visibility `[rows, keys]`.
    pub visible: Array2<bool>,
    /// Values `[keys, dv]`.
    pub v: Array2<Mp>,
}

impl RowProblem {
    /// Precision of the problem's values.
    pub fn ctx(&self) -> Precision {
        self.v.first().or(self.scores.first()).map(|x| x.ctx()).unwrap_or_default()
    }

    /// The state of the keys in `range` under `algebra`.
    pub fn block_state(&self, algebra: &dyn OnlineAlgebra, range: Range<usize>) -> SoftmaxState<Mp> {
        algebra.of_block(
            self.scores.slice_axis(Axis(1), Slice::from(range.clone())),
            self.visible.slice_axis(Axis(1), Slice::from(range.clone())),
            self.v.slice_axis(Axis(0), Slice::from(range)),
            self.ctx(),
        )
    }

    /// `(O, LSE)` from the definition.
    pub fn definition(&self) -> (Array2<Mp>, Array1<Mp>) {
        let ctx = self.ctx();
        let p = definition::probabilities(self.scores.view(), self.visible.view(), ctx);
        let o = definition::product(p.view(), self.v.view(), ctx);
        let masked_scores = Array2::from_shape_fn(self.scores.dim(), |(i, j)| {
            if self.visible[[i, j]] { self.scores[[i, j]].clone() } else { Mp::neg_infinity(ctx) }
        });
        (o, definition::log_sum_exp(masked_scores.view(), self.visible.view(), ctx))
    }
}

fn states_agree(
    theorem: &'static str,
    a: &SoftmaxState<Mp>,
    b: &SoftmaxState<Mp>,
    required: Bits,
) -> Result<Agreement, Violation> {
    // `m` is a max of the same values in any correct algebra, hence equal; ℓ and A then agree
    // to rounding.
    Ok(agree(theorem, "m", &a.m, &b.m, required)?
        .and(agree(theorem, "l", &a.l, &b.l, required)?)
        .and(agree(theorem, "A", &a.a, &b.a, required)?))
}

/// **Theorem (E2, E4: identity).** For any state `x`, `x ⊕ (−∞, 0, 0) = (−∞, 0, 0) ⊕ x = x`.
/// Hypotheses: none. Checked to `required` bits.
pub fn merge_identity(
    algebra: &dyn OnlineAlgebra,
    x: &SoftmaxState<Mp>,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "merge_identity (E4)";
    let e = SoftmaxState::empty(x.rows(), x.a.ncols(), x.l.first().map(|v| v.ctx()).unwrap_or_default());
    Ok(states_agree(T, &algebra.merge(x, &e), x, required)?.and(states_agree(T, &algebra.merge(&e, x), x, required)?))
}

/// **Theorem (E4: commutativity).** `a ⊕ b = b ⊕ a` for states of disjoint key sets.
pub fn merge_commutative(
    algebra: &dyn OnlineAlgebra,
    a: &SoftmaxState<Mp>,
    b: &SoftmaxState<Mp>,
    required: Bits,
) -> Result<Agreement, Violation> {
    states_agree("merge_commutative (E4)", &algebra.merge(a, b), &algebra.merge(b, a), required)
}

/// **Theorem (E4: associativity).** `(a ⊕ b) ⊕ c = a ⊕ (b ⊕ c)`.
pub fn merge_associative(
    algebra: &dyn OnlineAlgebra,
    a: &SoftmaxState<Mp>,
    b: &SoftmaxState<Mp>,
    c: &SoftmaxState<Mp>,
    required: Bits,
) -> Result<Agreement, Violation> {
    let left = algebra.merge(&algebra.merge(a, b), c);
    let right = algebra.merge(a, &algebra.merge(b, c));
    states_agree("merge_associative (E4)", &left, &right, required)
}

/// How a theorem folds the blocks of a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fold {
    /// Start from the empty state and absorb each block with E3.
    Update,
    /// Form each block's state with E2 and merge them left to right with E4.
    Merge,
}

/// **Theorem (E2–E5, E11: block-split invariance).** Let the keys of a row be partitioned into
/// contiguous blocks `blocks` (any sizes, blocks may be entirely masked or empty), visited in the
/// order `order` (a permutation of the blocks, e.g. the ring arrival order of E11). Folding the
/// blocks with `fold` and finalizing gives `O = Σ_j P_ij v_j` and `LSE_i = log Σ_j e^{s_ij}` of
/// the definition; fully masked rows give `O = 0`, `LSE = −∞` (E1c).
/// Hypotheses: `blocks` partition `0..keys`; `order` is a permutation of `0..blocks.len()`.
pub fn block_split_invariance(
    algebra: &dyn OnlineAlgebra,
    problem: &RowProblem,
    blocks: &[Range<usize>],
    order: &[usize],
    fold: Fold,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "block_split_invariance (E2-E5, E11)";
    let keys = problem.scores.ncols();
    let mut covered = vec![false; keys];
    for b in blocks {
        for j in b.clone() {
            if j >= keys || std::mem::replace(&mut covered[j], true) {
                return Err(Violation::Hypothesis {
                    theorem: T,
                    reason: format!("blocks {blocks:?} do not partition 0..{keys}"),
                });
            }
        }
    }
    let mut sorted = order.to_vec();
    sorted.sort_unstable();
    if covered.contains(&false) || sorted != (0..blocks.len()).collect::<Vec<_>>() {
        return Err(Violation::Hypothesis {
            theorem: T,
            reason: format!("blocks {blocks:?} / order {order:?} are not a partition and permutation"),
        });
    }
    let ctx = problem.ctx();
    let mut state = SoftmaxState::empty(problem.scores.nrows(), problem.v.ncols(), ctx);
    for &b in order {
        let r = blocks[b].clone();
        match fold {
            Fold::Update => algebra.update(
                &mut state,
                problem.scores.slice_axis(Axis(1), Slice::from(r.clone())),
                problem.visible.slice_axis(Axis(1), Slice::from(r.clone())),
                problem.v.slice_axis(Axis(0), Slice::from(r)),
                ctx,
            ),
            Fold::Merge => state = algebra.merge(&state, &problem.block_state(algebra, r)),
        }
    }
    let (o, lse) = algebra.finalize(&state);
    let (o_def, lse_def) = problem.definition();
    Ok(agree(T, "O", &o, &o_def, required)?.and(agree(T, "LSE", &lse, &lse_def, required)?))
}
