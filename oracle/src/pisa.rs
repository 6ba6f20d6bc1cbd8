//! PISA tail (E22–E24): selected blocks exact, unselected blocks approximated to first order in
//! the same numerator and denominator. With `k_j = μ_b + δ_j` (`Σ_{j∈b} δ_j = 0`),
//! `α_ib = e^{α q_i·μ_b}` (`α` the softmax scale), a tail block contributes `α_ib |B_b|` to the
//! denominator (the first-order term vanishes) and `α_ib V^Σ_b + α_ib α q_iᵀ H_b` to the
//! numerator, `H_b = Σ_j δ_j v_jᵀ`; PISA replaces every `H_b` by `H̄ = mean_b H_b`.
//!
//! Every mass is carried relative to a common shift (the largest log-mass involved), so f64
//! never forms `e^{s}` of a large logit.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis, Slice};

use crate::online::{SoftmaxState, rescale_factor};
use crate::real::Real;
use crate::selection::key_blocks;
use crate::topk::top_k;
use crate::vector::{block_means, dot, norm2, spectral_norm};

/// Power-iteration steps for `‖H_b − H̄‖₂`.
const SPECTRAL_ITERATIONS: usize = 500;

/// E22 statistics of one head's keys and values, per block of `block_size` keys.
#[derive(Clone, Debug, PartialEq)]
pub struct TailStatistics<S> {
    /// Keys per block (the last block may be shorter).
    pub block_size: usize,
    /// Block means `μ_b`, `[n_blocks, d]`.
    pub means: Array2<S>,
    /// Value sums `V^Σ_b`, `[n_blocks, dv]`.
    pub value_sums: Array2<S>,
    /// Keys per block `|B_b|`.
    pub counts: Vec<usize>,
    /// `H_b = Σ_{j∈b} δ_j v_jᵀ`, each `[d, dv]`.
    pub h: Vec<Array2<S>>,
    /// `H̄ = mean_b H_b` over all blocks of the sequence (Convention of E22).
    pub h_bar: Array2<S>,
    /// `‖H_b − H̄‖₂` per block.
    pub heterogeneity: Vec<S>,
}

/// E22: block means, deviations, value sums, `H_b`, `H̄`, and `‖H_b − H̄‖₂`. Needs `n ≥ 1` keys.
pub fn tail_statistics<S: Real>(
    k: ArrayView2<'_, S>,
    v: ArrayView2<'_, S>,
    block_size: usize,
    ctx: S::Ctx,
) -> TailStatistics<S> {
    let blocks = key_blocks(k.nrows(), block_size);
    assert!(!blocks.is_empty(), "tail_statistics: at least one key");
    let means = block_means(k, block_size, ctx);
    let (d, dv) = (k.ncols(), v.ncols());
    let mut value_sums = Array2::from_elem((blocks.len(), dv), S::zero(ctx));
    let mut h = Vec::with_capacity(blocks.len());
    for (b, r) in blocks.iter().enumerate() {
        let vb = v.slice_axis(Axis(0), Slice::from(r.clone()));
        for c in 0..dv {
            value_sums[[b, c]] = vb.column(c).iter().fold(S::zero(ctx), |a, x| a + x.clone());
        }
        let deltas = Array2::from_shape_fn((r.len(), d), |(j, c)| k[[r.start + j, c]].clone() - means[[b, c]].clone());
        h.push(S::matmul(deltas.t(), vb, ctx));
    }
    let n_blocks = S::from_f64(blocks.len() as f64, ctx);
    let mut h_bar = Array2::from_elem((d, dv), S::zero(ctx));
    for hb in &h {
        h_bar.zip_mut_with(hb, |a, x| *a += x.clone());
    }
    h_bar.mapv_inplace(|x| x / n_blocks.clone());
    let heterogeneity = h.iter().map(|hb| spectral_norm((hb - &h_bar).view(), SPECTRAL_ITERATIONS, ctx)).collect();
    TailStatistics {
        block_size,
        means,
        value_sums,
        counts: blocks.iter().map(|r| r.len()).collect(),
        h,
        h_bar,
        heterogeneity,
    }
}

/// What happens to the omitted (tail) blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TailRule {
    /// Drop them and renormalize (E17's `o_E`).
    Drop,
    /// Zeroth order: `α_ib V^Σ_b` and `α_ib |B_b|`, no `H` term.
    ZerothOrder,
    /// First order with each block's own `H_b` (the expansion of E22 before sharing).
    FirstOrderPerBlock,
    /// PISA: first order with the shared `H̄` (E22's output).
    Pisa,
}

/// One query's blocks, classified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockClasses {
    /// Blocks computed exactly: the selected ones and any block the mask cuts (the approximation
    /// assumes whole blocks).
    pub exact: Vec<usize>,
    /// Fully visible, unselected blocks: the tail `U_i`.
    pub tail: Vec<usize>,
}

/// Splits the blocks of a row into exact and tail given the selected blocks.
pub fn classify_blocks(visible: ArrayView1<'_, bool>, block_size: usize, selected: &[usize]) -> BlockClasses {
    let mut classes = BlockClasses { exact: vec![], tail: vec![] };
    for (b, r) in key_blocks(visible.len(), block_size).into_iter().enumerate() {
        let seen = r.clone().filter(|&j| visible[j]).count();
        if seen == 0 {
            continue;
        }
        if selected.contains(&b) || seen < r.len() {
            classes.exact.push(b);
        } else {
            classes.tail.push(b);
        }
    }
    classes
}

/// One query's output under `rule`, with the tail mass `Σ_U α_ib|B_b|` and the exact total mass
/// `Z_i`, both relative to the same shift, for the E23 bound.
#[derive(Clone, Debug, PartialEq)]
pub struct TailOutput<S> {
    /// The output `[dv]`.
    pub o: Array1<S>,
    /// `Σ_{b∈U} α_ib |B_b| · e^{−shift}`.
    pub tail_mass: S,
    /// `Z_i · e^{−shift}`, the exact dense mass of the row.
    pub total_mass: S,
    /// The output's own denominator `· e^{−shift}` (`Z_E` plus the tail's approximate mass, or
    /// `Z_E` alone when dropping).
    pub denominator: S,
}

/// E22 for query `q`: exact blocks through the online softmax, tail blocks by `rule`.
pub fn tail_output<S: Real>(
    q: ArrayView1<'_, S>,
    k: ArrayView2<'_, S>,
    v: ArrayView2<'_, S>,
    visible: ArrayView1<'_, bool>,
    classes: &BlockClasses,
    stats: &TailStatistics<S>,
    scale: &S,
    rule: TailRule,
    ctx: S::Ctx,
) -> TailOutput<S> {
    let logits = Array2::from_shape_fn((1, k.nrows()), |(_, j)| scale.clone() * dot(q, k.row(j), ctx));
    let in_exact =
        Array2::from_shape_fn((1, k.nrows()), |(_, j)| visible[j] && classes.exact.contains(&(j / stats.block_size)));
    let exact = SoftmaxState::of_block(logits.view(), in_exact.view(), v, ctx);
    let dense = SoftmaxState::of_block(logits.view(), visible.insert_axis(Axis(0)), v, ctx);
    let log_alpha: Vec<S> = classes.tail.iter().map(|&b| scale.clone() * dot(q, stats.means.row(b), ctx)).collect();
    let shift = log_alpha.iter().fold(exact.m[0].clone().max(dense.m[0].clone()), |m, x| m.max(x.clone()));
    let weight = |log_mass: &S| rescale_factor(log_mass, &shift, ctx);
    let mut numerator = exact.a.row(0).mapv(|x| x * weight(&exact.m[0]));
    let mut denominator = exact.l[0].clone() * weight(&exact.m[0]);
    let mut tail_mass = S::zero(ctx);
    let mut tail_alpha = S::zero(ctx);
    for (&b, la) in classes.tail.iter().zip(&log_alpha) {
        let alpha = weight(la);
        let mass = alpha.clone() * S::from_f64(stats.counts[b] as f64, ctx);
        tail_mass += mass.clone();
        tail_alpha += alpha.clone();
        if rule == TailRule::Drop {
            continue;
        }
        denominator += mass;
        numerator.zip_mut_with(&stats.value_sums.row(b), |n, s| *n += alpha.clone() * s.clone());
        if rule == TailRule::FirstOrderPerBlock {
            add_first_order(&mut numerator, q, &stats.h[b], &(alpha * scale.clone()), ctx);
        }
    }
    if rule == TailRule::Pisa {
        add_first_order(&mut numerator, q, &stats.h_bar, &(tail_alpha * scale.clone()), ctx);
    }
    let o = if denominator == S::zero(ctx) {
        numerator.mapv(|_| S::zero(ctx))
    } else {
        numerator.mapv(|n| n / denominator.clone())
    };
    TailOutput { o, tail_mass, total_mass: dense.l[0].clone() * weight(&dense.m[0]), denominator }
}

/// `numerator += factor · qᵀ H`.
fn add_first_order<S: Real>(numerator: &mut Array1<S>, q: ArrayView1<'_, S>, h: &Array2<S>, factor: &S, ctx: S::Ctx) {
    for (c, n) in numerator.iter_mut().enumerate() {
        *n += factor.clone() * dot(q, h.column(c), ctx);
    }
}

/// E23: the first-order error bound of the PISA output,
/// `(Σ_U α_ib|B_b| / Z_i) · max_U ‖H_b − H̄‖₂ · α‖q_i‖ / B` (`α = 1/√d` in the seed's
/// notation). Valid up to second-order terms in `δ`. `B` is the smallest tail block's size (the
/// seed's block size when every tail block is whole), which keeps the bound valid when the last,
/// partial block is in the tail.
pub fn pisa_error_bound<S: Real>(
    q: ArrayView1<'_, S>,
    out: &TailOutput<S>,
    classes: &BlockClasses,
    stats: &TailStatistics<S>,
    scale: &S,
    ctx: S::Ctx,
) -> S {
    if classes.tail.is_empty() || out.total_mass == S::zero(ctx) {
        return S::zero(ctx);
    }
    let worst = classes.tail.iter().map(|&b| stats.heterogeneity[b].clone()).fold(S::zero(ctx), S::max);
    let smallest = classes.tail.iter().map(|&b| stats.counts[b]).min().expect("tail is not empty");
    let block = S::from_f64(smallest as f64, ctx);
    out.tail_mass.clone() / out.total_mass.clone() * worst * scale.abs() * norm2(q, ctx) / block
}

/// E24: the covariance-aware score `log σ_ib = α q_i·μ_b + log(|B_b| + γ α‖q_i‖ ‖H_b − H̄‖₂)` of
/// every block (in log form, so f64 does not overflow); `γ = 0` is pure relevance.
pub fn covariance_aware_scores<S: Real>(
    q: ArrayView1<'_, S>,
    stats: &TailStatistics<S>,
    scale: &S,
    gamma: &S,
    ctx: S::Ctx,
) -> Vec<S> {
    let qn = norm2(q, ctx);
    (0..stats.counts.len())
        .map(|b| {
            let relevance = scale.clone() * dot(q, stats.means.row(b), ctx);
            let spread = gamma.clone() * scale.abs() * qn.clone() * stats.heterogeneity[b].clone();
            relevance + (S::from_f64(stats.counts[b] as f64, ctx) + spread).ln()
        })
        .collect()
}

/// E24 selection: the `n_keep` eligible blocks with the largest covariance-aware score (ties to
/// the lower index), best first.
pub fn covariance_aware_selection<S: Real>(
    scores: &[S],
    n_keep: usize,
    eligible: impl Fn(usize) -> bool,
) -> Vec<usize> {
    top_k(scores, n_keep, eligible, &[])
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array1;

    fn classes(visible_keys: usize, selected: &[usize]) -> BlockClasses {
        // 10 keys in blocks of 4: 0..4, 4..8 and the short last block 8..10.
        let visible = Array1::from_shape_fn(10, |j| j < visible_keys);
        classify_blocks(visible.view(), 4, selected)
    }

    #[test]
    fn whole_visible_unselected_blocks_form_the_tail_and_a_cut_block_is_exact() {
        // Everything visible: every unselected block is in the tail, the short last block too (it is whole).
        assert_eq!(classes(10, &[]), BlockClasses { exact: vec![], tail: vec![0, 1, 2] });
        assert_eq!(classes(10, &[1]), BlockClasses { exact: vec![1], tail: vec![0, 2] });
        // Keys 0..=5 visible (a causal row): block 1 is cut by the mask, so it is computed exactly; block 2 is
        // invisible, so it is in neither list, selected or not.
        assert_eq!(classes(6, &[]), BlockClasses { exact: vec![1], tail: vec![0] });
        assert_eq!(classes(6, &[2]), BlockClasses { exact: vec![1], tail: vec![0] });
        assert_eq!(classes(6, &[0]), BlockClasses { exact: vec![0, 1], tail: vec![] });
        assert_eq!(classes(0, &[0]), BlockClasses { exact: vec![], tail: vec![] });
    }
}
