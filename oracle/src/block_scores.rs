//! Block scores (E15): mean pooling against the exact block log-mass. For query `i` and block
//! `b`, `s̄_ib = q_i·k̄_b/√d` equals the mean logit of the block, and the exact log-mass
//! decomposes as `log Z_ib = s̄_ib + log|B_b| + log mean_j e^{ε_ij}` with `ε_ij = s_ij − s̄_ib`;
//! for small deviations `log mean e^{ε} ≈ Var_j(ε_ij)/2`.

use ndarray::{ArrayView1, ArrayView2};

use crate::real::Real;
use crate::vector::{dot, log_sum_exp, mean_row};

/// The E15 quantities of one (query, block) pair.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockScore<S> {
    /// Mean-pooled score `s̄ = α q·k̄` (the router's proxy).
    pub pooled: S,
    /// `log |B|`.
    pub log_count: S,
    /// `log mean_j e^{ε_j}`, the part mean pooling ignores (≥ 0 by Jensen).
    pub log_mean_exp_deviation: S,
    /// Exact block log-mass `log Σ_j e^{s_j}`.
    pub exact: S,
    /// Second-order approximation of `log mean e^{ε}`: `Var_j(ε_j)/2` (population variance).
    pub second_order: S,
}

/// E15 for query `q` `[d]` against the keys of one block `[n, d]` (`n ≥ 1`) with scale `α`.
pub fn block_score<S: Real>(q: ArrayView1<'_, S>, keys: ArrayView2<'_, S>, scale: &S, ctx: S::Ctx) -> BlockScore<S> {
    let n = keys.nrows();
    assert!(n > 0, "block_score: a block has at least one key");
    let count = S::from_f64(n as f64, ctx);
    let mean_key = mean_row(keys, ctx).expect("n > 0");
    let pooled = scale.clone() * dot(q, mean_key.view(), ctx);
    let logits: Vec<S> = keys.rows().into_iter().map(|k| scale.clone() * dot(q, k, ctx)).collect();
    let deviations: Vec<S> = logits.iter().map(|s| s.clone() - pooled.clone()).collect();
    let log_count = count.ln();
    let log_mean_exp_deviation = log_sum_exp(&deviations, ctx) - log_count.clone();
    let variance = deviations.iter().fold(S::zero(ctx), |acc, e| acc + e.clone() * e.clone()) / count;
    BlockScore {
        exact: log_sum_exp(&logits, ctx),
        pooled,
        log_count,
        log_mean_exp_deviation,
        second_order: variance / S::from_f64(2.0, ctx),
    }
}
