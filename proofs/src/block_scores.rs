//! Theorems of block scores (E15): the exact block log-mass decomposes into the pooled score,
//! the log-count and the log-mean-exp of the deviations; the pooled score is the mean logit; and
//! the second-order approximation `Var/2` becomes exact as the spread of the logits vanishes.

use attnproof_oracle::block_scores::BlockScore;
use attnproof_oracle::{Mp, Real};
use ndarray::{Array1, ArrayView1, ArrayView2};

use crate::residual::{Agreement, Bits, Violation, agree, bits_of};

/// A block-score function under test: `(q, keys, scale) ↦ BlockScore`.
pub type BlockScoreFn<'a> = &'a dyn Fn(ArrayView1<'_, Mp>, ArrayView2<'_, Mp>, &Mp) -> BlockScore<Mp>;

fn one(x: Mp) -> Array1<Mp> {
    Array1::from_elem(1, x)
}

/// **Theorem (E15, identity).** For a block of `n ≥ 1` keys: the pooled score equals the mean
/// logit `mean_j α q·k_j`; the exact score equals `log Σ_j e^{α q·k_j}`; and
/// `exact = pooled + log n + log mean_j e^{ε_j}`. Hypotheses: none.
pub fn block_score_identity(
    score_fn: BlockScoreFn<'_>,
    q: ArrayView1<'_, Mp>,
    keys: ArrayView2<'_, Mp>,
    scale: &Mp,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "block_score_identity (E15)";
    let ctx = scale.ctx();
    let logits: Vec<Mp> =
        keys.rows().into_iter().map(|k| scale.clone() * attnproof_oracle::vector::dot(q, k, ctx)).collect();
    let n = Mp::from_f64(logits.len() as f64, ctx);
    let mean = logits.iter().fold(Mp::zero(ctx), |a, x| a + x.clone()) / n.clone();
    let exact = logits.iter().fold(Mp::zero(ctx), |a, x| a + x.exp()).ln();
    let s = score_fn(q, keys, scale);
    let recomposed = s.pooled.clone() + s.log_count.clone() + s.log_mean_exp_deviation.clone();
    Ok(agree(T, "pooled = mean logit", &one(s.pooled.clone()), &one(mean), required)?
        .and(agree(T, "exact = log Σ e^s", &one(s.exact.clone()), &one(exact.clone()), required)?)
        .and(agree(T, "pooled + log n + log mean e^ε", &one(recomposed), &one(exact), required)?)
        .and(agree(T, "log n", &one(s.log_count), &one(n.ln()), required)?))
}

/// **Theorem (E15, second-order limit).** Let the keys of a block be `k_j = c + t·u_j` and
/// `r(t) = log mean e^{ε} / (Var(ε)/2)`. As `t → 0`, `r(t) → 1`: the cumulant expansion
/// `log mean e^{ε} = κ₂/2 + κ₃/6 + …` with `κ₂ = Var ∝ t²`, `κ₃ ∝ t³` gives
/// `|r(t) − 1| = O(t)`. Checked on the halving sequence `spreads` (decreasing): every halving must
/// shrink `|r − 1|` by a factor of at least `1.5` (2 asymptotically, 4 when `κ₃ = 0`) until it
/// falls below `2^-required`, and the last value must be below `2^-8`. Hypotheses: the deviations
/// `u_j` are not all equal (else `Var = 0` and `r` is undefined), the spreads halve.
pub fn second_order_limit(
    score_fn: BlockScoreFn<'_>,
    q: ArrayView1<'_, Mp>,
    center: ArrayView1<'_, Mp>,
    directions: ArrayView2<'_, Mp>,
    scale: &Mp,
    spreads: &[Mp],
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "second_order_limit (E15)";
    let ctx = scale.ctx();
    let mut gaps = Vec::with_capacity(spreads.len());
    for t in spreads {
        let keys = ndarray::Array2::from_shape_fn(directions.dim(), |(j, c)| {
            center[c].clone() + t.clone() * directions[[j, c]].clone()
        });
        let s = score_fn(q, keys.view(), scale);
        if s.second_order == Mp::zero(ctx) {
            return Err(Violation::Hypothesis { theorem: T, reason: "the logits have no spread".into() });
        }
        gaps.push((s.log_mean_exp_deviation / s.second_order - Mp::one(ctx)).abs());
    }
    for (k, w) in gaps.windows(2).enumerate() {
        let floor = Mp::from_f64(2f64.powf(-required.0), ctx);
        if w[0] > floor && w[1].clone() * Mp::from_f64(1.5, ctx) > w[0] {
            return Err(Violation::Residual {
                theorem: T,
                quantity: "|r − 1| after halving the spread",
                found: bits_of(&w[1]),
                required: bits_of(&(w[0].clone() / Mp::from_f64(1.5, ctx))),
                index: vec![k + 1],
            });
        }
    }
    let last = gaps.last().cloned().unwrap_or_else(|| Mp::zero(ctx));
    if bits_of(&last).0 < 8.0 {
        return Err(Violation::Residual {
            theorem: T,
            quantity: "|r − 1| at the smallest spread",
            found: bits_of(&last),
            required: Bits(8.0),
            index: vec![gaps.len() - 1],
        });
    }
    Ok(Agreement { bits: bits_of(&last) })
}
