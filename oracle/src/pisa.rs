//! PISA tail (E22–E24): selected blocks exact, unselected blocks approximated to first order in
//! the same numerator and denominator. With `k_j = μ_b + δ_j` (`Σ_{j∈b} δ_j = 0`),
//! `α_ib = e^{α q_i·μ_b}` (`α` the softmax scale), a tail block contributes `α_ib |B_b|` to the
//! denominator (the first-order term vanishes) and `α_ib V^Σ_b + α_ib α q_iᵀ H_b` to the
//! numerator, `H_b = Σ_j δ_j v_jᵀ`; PISA replaces every `H_b` by `H̄ = mean_b H_b`.
//!
//! Every mass is carried relative to one shift, the output's largest term: the larger of the exact
//! part's largest logit and the tail blocks' largest log-mass `α q_i·μ_b` (the row's largest visible
//! logit when there is neither). Every term of the PISA output is then at most 1 and one is exactly
//! 1, so f64 neither forms `e^{s}` of a large logit nor lets the denominator underflow when the
//! row's largest logit sits in a tail block far above its block's mean. The dense mass, relative to
//! the same shift, may exceed f64's range in such a row (`+∞`: the tail's share of it is then 0).
//!
//! E24 comes in two forms: per query ([`covariance_aware_scores`], the spread `‖H_b − H̄‖₂` by power iteration to
//! stagnation) and per query block as the GPU selects ([`covariance_block_scores`]: BSA's pooled queries and GQA group
//! sum, and the spread by exactly [`E24_POWER_STEPS`] steps of power iteration, [`block_spreads`]).

use ndarray::{Array1, Array2, Array3, Array4, ArrayView1, ArrayView2, ArrayViewD, Axis, Slice};

use crate::bsa::{BsaConfig, bsa_scores, pooled};
use crate::error::OracleError;
use crate::online::{SoftmaxState, rescale_factor};
use crate::real::Real;
use crate::selection::key_blocks;
use crate::spec::{AttentionSpec, Operand};
use crate::topk::top_k;
use crate::vector::{PowerRun, PowerStop, block_means, dot, norm2, power_iteration, spectral_norm};

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
    let mut stats = tail_moments(k, v, block_size, ctx);
    stats.heterogeneity =
        stats.h.iter().map(|hb| spectral_norm((hb - &stats.h_bar).view(), SPECTRAL_ITERATIONS, ctx)).collect();
    stats
}

/// [`tail_statistics`] without `‖H_b − H̄‖₂` (`heterogeneity` is left empty): everything the output
/// ([`tail_output`]) and its backward ([`tail_backward`]) read, without the power iterations that only the error bound
/// and the covariance-aware scores need. Needs `n ≥ 1` keys.
pub fn tail_moments<S: Real>(
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
    TailStatistics {
        block_size,
        means,
        value_sums,
        counts: blocks.iter().map(|r| r.len()).collect(),
        h,
        h_bar,
        heterogeneity: vec![],
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
/// `Z_i`, both relative to the same shift (the output's largest term, see the module docs), for the
/// E23 bound.
#[derive(Clone, Debug, PartialEq)]
pub struct TailOutput<S> {
    /// The output `[dv]`.
    pub o: Array1<S>,
    /// `Σ_{b∈U} α_ib |B_b| · e^{−shift}`, `shift` the output's largest log-term.
    pub tail_mass: S,
    /// `Z_i · e^{−shift}`, the exact dense mass of the row.
    pub total_mass: S,
    /// The output's own denominator `· e^{−shift}` (`Z_E` plus the tail's approximate mass, or
    /// `Z_E` alone when dropping).
    pub denominator: S,
    /// The shift every mass above is relative to: the output's largest log-term (the row's largest
    /// visible logit when there is none); the output's log-sum-exp is `shift + ln(denominator)`.
    pub shift: S,
}

impl<S: Real> TailOutput<S> {
    /// E23 carried to the output's own denominator: `(Σ_U α_ib|B_b| / D_i) · max_U ‖H_b − H̄‖₂ · α‖q_i‖ / B`, which is
    /// `pisa_error_bound · Z_i / D_i` computed without `Z_i`. It bounds `‖o^PISA − o^first order‖` (the two outputs
    /// share `D_i`, and differ by `Σ_U α_ib α qᵀ(H̄ − H_b) / D_i` with `Σ_U α_ib ≤ Σ_U α_ib|B_b| / B`). `Z_i`, the dense
    /// mass relative to the output's shift, overflows f64 when a tail key's logit stands far above its block's mean;
    /// E23's relative form is then 0 while this one stays finite, so a check of `‖o^PISA − o‖` against it and
    /// `‖o^first order − o‖` needs no `0 · ∞`.
    pub fn gap_bound(&self, q: ArrayView1<'_, S>, classes: &BlockClasses, stats: &TailStatistics<S>, scale: &S) -> S {
        let ctx = scale.ctx();
        tail_share_times_spread(q, self, &self.denominator, classes, stats, scale, ctx)
    }
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
    let log_masses: Vec<S> = classes.tail.iter().map(|&b| scale.clone() * dot(q, stats.means.row(b), ctx)).collect();
    let largest = log_masses.iter().cloned().fold(exact.m[0].clone(), S::max);
    let shift = if largest.is_finite() { largest } else { dense.m[0].clone() };
    let weight = |log_mass: &S| rescale_factor(log_mass, &shift, ctx);
    let mut numerator = exact.a.row(0).mapv(|x| x * weight(&exact.m[0]));
    let mut denominator = exact.l[0].clone() * weight(&exact.m[0]);
    let mut tail_mass = S::zero(ctx);
    let mut tail_alpha = S::zero(ctx);
    for (&b, log_mass) in classes.tail.iter().zip(&log_masses) {
        let alpha = weight(log_mass);
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
    let total_mass = dense.l[0].clone() * weight(&dense.m[0]);
    TailOutput { o, tail_mass, total_mass, denominator, shift }
}

/// The gradients of one head's PISA outputs ([`tail_output`] with [`TailRule::Pisa`]) for the loss
/// `L = Σ_i dO_i · o_i`, with every row's block classes held fixed (a selection has no gradient).
#[derive(Clone, Debug, PartialEq)]
pub struct TailGradients<S> {
    /// `∂L/∂q` `[Lq, d]`.
    pub dq: Array2<S>,
    /// `∂L/∂k` `[Lk, d]`: through the exact logits, the tail blocks' means `μ_b` and `H̄`.
    pub dk: Array2<S>,
    /// `∂L/∂v` `[Lk, dv]`: through the exact rows, the tail blocks' value sums and `H̄`.
    pub dv: Array2<S>,
}

/// The backward of E22's PISA output for one head: queries `q` `[Lq, d]`, keys `k` `[Lk, d]`, values `v` `[Lk, dv]`,
/// row `i` seeing `visible[i]` with blocks `classes[i]`, statistics `stats` of `(k, v)` (its moments, as
/// [`tail_moments`] gives them), upstream gradient `d_o` `[Lq, dv]`.
///
/// With `D` the row's denominator, `o` its output and `δ = dO·o`, relative to the row's shift (every weight below is
/// a term over `D`, at most 1):
/// - an exact key `j` (`p_j = e^{s_j}/D`): `∂L/∂s_j = p_j (dO·v_j − δ)`, so `dq += α (∂L/∂s_j) k_j`,
///   `dk_j += α (∂L/∂s_j) q`, `dv_j += p_j dO`;
/// - a tail block `b` (`a_b = α_ib/D`, `h = α H̄ᵀq`): its log-weight `α q·μ_b` carries
///   `g_b = a_b (dO·(V^Σ_b + h) − δ |B_b|)`, so `dq += α g_b μ_b` and `dμ_b += α g_b q`; its value sum takes
///   `a_b dO`;
/// - the shared term `A α qᵀH̄` (`A = Σ_b a_b`): `dq += A α H̄ dO`, `G += A α q dOᵀ` (`∂L/∂H̄`, summed over the rows).
///
/// Then onto the keys and values: `μ_b = (1/|B_b|) Σ_{j∈b} k_j` gives `dk_j += dμ_b / |B_b|`; `V^Σ_b = Σ_{j∈b} v_j`
/// gives `dv_j += dV^Σ_b`; `H̄ = (1/n_b) Σ_b (Σ_{j∈b} k_j v_jᵀ − μ_b V^Σ_bᵀ)` gives `dk_j += (1/n_b) G (v_j − v̄_b)`
/// and `dv_j += (1/n_b) Gᵀ (k_j − μ_b)` for every key of the sequence (`v̄_b` the block's mean value). A row that sees
/// nothing contributes nothing. `proofs::pisa::tail_gradients_match_finite_differences` checks all of it.
#[allow(clippy::too_many_arguments)]
pub fn tail_backward<S: Real>(
    q: ArrayView2<'_, S>,
    k: ArrayView2<'_, S>,
    v: ArrayView2<'_, S>,
    visible: ArrayView2<'_, bool>,
    classes: &[BlockClasses],
    stats: &TailStatistics<S>,
    scale: &S,
    d_o: ArrayView2<'_, S>,
    ctx: S::Ctx,
) -> TailGradients<S> {
    let (d, dv, n_blocks, size) = (q.ncols(), v.ncols(), stats.counts.len(), stats.block_size);
    let zero = || S::zero(ctx);
    let mut dq = Array2::from_elem(q.raw_dim(), zero());
    let mut dk = Array2::from_elem(k.raw_dim(), zero());
    let mut dvv = Array2::from_elem(v.raw_dim(), zero());
    let mut d_means = Array2::from_elem((n_blocks, d), zero());
    let mut d_sums = Array2::from_elem((n_blocks, dv), zero());
    let mut d_h_bar = Array2::from_elem((d, dv), zero());
    for (i, classes) in classes.iter().enumerate() {
        let (qi, g_out) = (q.row(i), d_o.row(i));
        let out = tail_output(qi, k, v, visible.row(i), classes, stats, scale, TailRule::Pisa, ctx);
        if out.denominator == zero() {
            continue;
        }
        let delta = dot(g_out, out.o.view(), ctx);
        let weight = |log_term: S| rescale_factor(&log_term, &out.shift, ctx) / out.denominator.clone();
        for &b in &classes.exact {
            for j in (b * size..b * size + stats.counts[b]).filter(|&j| visible[[i, j]]) {
                let p = weight(scale.clone() * dot(qi, k.row(j), ctx));
                let ds = p.clone() * (dot(g_out, v.row(j), ctx) - delta.clone());
                let dsa = ds * scale.clone();
                dq.row_mut(i).zip_mut_with(&k.row(j), |x, y| *x += dsa.clone() * y.clone());
                dk.row_mut(j).zip_mut_with(&qi, |x, y| *x += dsa.clone() * y.clone());
                dvv.row_mut(j).zip_mut_with(&g_out, |x, y| *x += p.clone() * y.clone());
            }
        }
        let shared: Array1<S> = (0..dv).map(|e| scale.clone() * dot(qi, stats.h_bar.column(e), ctx)).collect();
        let mut total = zero();
        for &b in &classes.tail {
            let a = weight(scale.clone() * dot(qi, stats.means.row(b), ctx));
            total += a.clone();
            let carried = (0..dv)
                .fold(zero(), |acc, e| acc + g_out[e].clone() * (stats.value_sums[[b, e]].clone() + shared[e].clone()));
            let g = a.clone() * (carried - delta.clone() * S::from_f64(stats.counts[b] as f64, ctx));
            let ga = g * scale.clone();
            dq.row_mut(i).zip_mut_with(&stats.means.row(b), |x, y| *x += ga.clone() * y.clone());
            d_means.row_mut(b).zip_mut_with(&qi, |x, y| *x += ga.clone() * y.clone());
            d_sums.row_mut(b).zip_mut_with(&g_out, |x, y| *x += a.clone() * y.clone());
        }
        if classes.tail.is_empty() {
            continue;
        }
        let factor = total * scale.clone();
        for c in 0..d {
            let through = dot(stats.h_bar.row(c), g_out, ctx);
            dq[[i, c]] += factor.clone() * through;
            for e in 0..dv {
                d_h_bar[[c, e]] += factor.clone() * qi[c].clone() * g_out[e].clone();
            }
        }
    }
    let per_block = S::from_f64(n_blocks as f64, ctx);
    for (b, &count) in stats.counts.iter().enumerate() {
        let n = S::from_f64(count as f64, ctx);
        for j in b * size..b * size + count {
            for c in 0..d {
                let mean_value = |e: usize| stats.value_sums[[b, e]].clone() / n.clone();
                let via_h =
                    (0..dv).fold(zero(), |acc, e| acc + d_h_bar[[c, e]].clone() * (v[[j, e]].clone() - mean_value(e)));
                dk[[j, c]] += d_means[[b, c]].clone() / n.clone() + via_h / per_block.clone();
            }
            for e in 0..dv {
                let via_h = (0..d).fold(zero(), |acc, c| {
                    acc + d_h_bar[[c, e]].clone() * (k[[j, c]].clone() - stats.means[[b, c]].clone())
                });
                dvv[[j, e]] += d_sums[[b, e]].clone() + via_h / per_block.clone();
            }
        }
    }
    TailGradients { dq, dk, dv: dvv }
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
    tail_share_times_spread(q, out, &out.total_mass, classes, stats, scale, ctx)
}

/// `(Σ_U α_ib|B_b| / mass) · max_U ‖H_b − H̄‖₂ · α‖q_i‖ / B`; 0 without a tail or without mass.
fn tail_share_times_spread<S: Real>(
    q: ArrayView1<'_, S>,
    out: &TailOutput<S>,
    mass: &S,
    classes: &BlockClasses,
    stats: &TailStatistics<S>,
    scale: &S,
    ctx: S::Ctx,
) -> S {
    if classes.tail.is_empty() || *mass == S::zero(ctx) {
        return S::zero(ctx);
    }
    let worst = classes.tail.iter().map(|&b| stats.heterogeneity[b].clone()).fold(S::zero(ctx), S::max);
    let smallest = classes.tail.iter().map(|&b| stats.counts[b]).min().expect("tail is not empty");
    let block = S::from_f64(smallest as f64, ctx);
    out.tail_mass.clone() / mass.clone() * worst * scale.abs() * norm2(q, ctx) / block
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

/// Power-iteration steps of E24's block-level spread on the GPU's convention ([`block_spreads`]): exactly this many
/// steps from the all-ones start, no early stop.
pub const E24_POWER_STEPS: usize = 32;

/// E24's block selection as the GPU runs it ([`covariance_block_scores`]): BSA's blocks, pooling, eligibility, forced
/// blocks and top-k, with the covariance weight `γ`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CovarianceConfig {
    /// Blocks, list width and forced blocks, as for BSA; `kv_block` is also the block of the spreads' statistics.
    pub bsa: BsaConfig,
    /// The weight `γ ≥ 0` of the spread term; `γ = 0` ranks as BSA does (plus `G ln n_b`).
    pub gamma: f64,
}

impl CovarianceConfig {
    /// BSA's checks, and `γ` finite and non-negative.
    pub fn validate(&self) -> Result<(), OracleError> {
        self.bsa.validate()?;
        if !self.gamma.is_finite() || self.gamma < 0.0 {
            return Err(OracleError::InvalidParameter {
                argument: "gamma",
                reason: format!("the covariance weight must be finite and non-negative, not {}", self.gamma),
            });
        }
        Ok(())
    }
}

/// E24's block-level scores and the spreads they read.
#[derive(Clone, Debug, PartialEq)]
pub struct CovarianceScores<S> {
    /// `[B, Hkv, n_q_blocks, n_k_blocks]`, laid out as [`bsa_scores`]: `S_ab` for eligible blocks, `−∞` for
    /// ineligible ones and for blocks past a sequence's own.
    pub scores: Array4<S>,
    /// `[B, Hkv, n_k_blocks]`: the spread `s_b` of each key block, 0 where a sequence has no such block.
    pub spreads: Array3<S>,
}

/// The spread runs of one (sequence, KV head): per key block of `block_size` keys (the last may be partial),
/// [`power_iteration`] on `H_b − H̄` ([`tail_moments`]'s statistics, `[d, dv]`) for exactly [`E24_POWER_STEPS`] steps
/// ([`PowerStop::AllSteps`]). Each run's `estimate` is the spread `s_b`, an estimate of `‖H_b − H̄‖₂` from below; its
/// `norms` are what a bound on another evaluation of the same steps reads. Needs `n ≥ 1` keys.
///
/// The fixed step count is the GPU's convention: a fixed-step estimate is one deterministic function of the matrix,
/// computable in any precision with a derivable rounding bound, while the stagnation rule of [`spectral_norm`] stops at
/// a step that rounding itself decides.
pub fn block_spreads<S: Real>(
    k: ArrayView2<'_, S>,
    v: ArrayView2<'_, S>,
    block_size: usize,
    ctx: S::Ctx,
) -> Vec<PowerRun<S>> {
    block_spreads_of(&tail_moments(k, v, block_size, ctx), ctx)
}

/// [`block_spreads`] from statistics already formed (`stats.h` and `stats.h_bar` are read), for a caller that needs
/// them for more than the spreads.
pub fn block_spreads_of<S: Real>(stats: &TailStatistics<S>, ctx: S::Ctx) -> Vec<PowerRun<S>> {
    stats
        .h
        .iter()
        .map(|hb| power_iteration((hb - &stats.h_bar).view(), E24_POWER_STEPS, PowerStop::AllSteps, ctx))
        .collect()
}

/// E24 at the level of blocks, on BSA's per-query-block convention (the GPU's). For (sequence, KV head, query block
/// `a`, key block `b`):
///
/// `S_ab = Σ_{h∈group} [ α q̄_{a,h}·μ_b + ln(n_b + γ|α| ‖q̄_{a,h}‖₂ s_b) ]`
///
/// with `q̄_{a,h}` the mean of query head `h`'s rows in query block `a`, `μ_b` the mean key of key block `b` (the
/// dot part is [`bsa_scores`], group-summed), `n_b` the block's key count (the last block of a sequence may be
/// partial), and `s_b` the spread of [`block_spreads`] (blocks of `kv_block` keys, per sequence and KV head). This is
/// the per-query log-form score of [`covariance_aware_scores`] with the query replaced by its block's mean and summed
/// over the group, as BSA sums its pooled scores. Ineligible entries stay `−∞`; `γ = 0` gives BSA's scores plus
/// `G ln n_b`. The lists are [`bsa_select`](crate::bsa::bsa_select) of [`CovarianceScores::scores`] under
/// `config.bsa`. `q`, `k`, `v` are laid out by `spec`; only no mask or the causal mask is taken (BSA's rule).
pub fn covariance_block_scores<S: Real>(
    spec: &AttentionSpec,
    q: ArrayViewD<'_, S>,
    k: ArrayViewD<'_, S>,
    v: ArrayViewD<'_, S>,
    config: &CovarianceConfig,
    ctx: S::Ctx,
) -> Result<CovarianceScores<S>, OracleError> {
    spec.validate()?;
    config.validate()?;
    let expected = spec.expected_shape(Operand::V);
    if v.shape() != expected.as_slice() {
        return Err(OracleError::ShapeMismatch { argument: "v", expected, actual: v.shape().to_vec() });
    }
    crate::error::check_finite("v", &v)?;
    let mut scores = bsa_scores(spec, q.view(), k.view(), &config.bsa, ctx)?;
    let (batch, heads, _, n_k) = scores.dim();
    let mut spreads = Array3::from_elem((batch, heads, n_k), S::zero(ctx));
    let alpha = spec.scale_value::<S>(ctx);
    let weight = S::from_f64(config.gamma, ctx) * alpha.abs();
    let group = spec.group_size();
    let kv_block = config.bsa.kv_block;
    for seq in spec.sequences().iter().filter(|s| s.len_k > 0) {
        for kv in 0..heads {
            let keys = spec.head_rows(k.view(), seq, kv, true);
            let values = spec.head_rows(v.view(), seq, kv, true);
            for (b, run) in block_spreads(keys, values, kv_block, ctx).into_iter().enumerate() {
                spreads[[seq.index, kv, b]] = run.estimate;
            }
            // `c_{a,h} = γ|α| ‖q̄_{a,h}‖` per query head of the group, `[n_q_blocks]` each.
            let factors: Vec<Vec<S>> = (kv * group..(kv + 1) * group)
                .map(|h| {
                    let means = pooled(spec.head_rows(q.view(), seq, h, false), config.bsa.q_block, ctx);
                    means.rows().into_iter().map(|row| weight.clone() * norm2(row, ctx)).collect()
                })
                .collect();
            let counts: Vec<usize> = key_blocks(seq.len_k, kv_block).iter().map(|r| r.len()).collect();
            for a in 0..config.bsa.query_blocks(seq) {
                for (b, &count) in counts.iter().enumerate() {
                    let score = &mut scores[[seq.index, kv, a, b]];
                    // Ineligible: −∞ plus any finite term is −∞ anyway; skipping spares the logarithms.
                    if !score.is_finite() {
                        continue;
                    }
                    let n = S::from_f64(count as f64, ctx);
                    for factor in &factors {
                        *score += (n.clone() + factor[a].clone() * spreads[[seq.index, kv, b]].clone()).ln();
                    }
                }
            }
        }
    }
    Ok(CovarianceScores { scores, spreads })
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

    /// Statistics of three blocks over `d = 2` with the given means, sizes and `‖H_b − H̄‖₂`; the value sums and `H`
    /// matrices are zero (the scores and the bound do not read them).
    fn stats(means: [[f64; 2]; 3], counts: [usize; 3], heterogeneity: [f64; 3]) -> TailStatistics<f64> {
        TailStatistics {
            block_size: 4,
            means: Array2::from_shape_fn((3, 2), |(b, c)| means[b][c]),
            value_sums: Array2::zeros((3, 1)),
            counts: counts.to_vec(),
            h: vec![Array2::zeros((2, 1)); 3],
            h_bar: Array2::zeros((2, 1)),
            heterogeneity: heterogeneity.to_vec(),
        }
    }

    #[test]
    fn the_covariance_aware_score_is_relevance_plus_the_log_of_size_and_spread() {
        // q = (3, 4), ‖q‖ = 5, α = 0.5 (its sign is dropped in the spread), γ = 2: the spread term is 5 · ‖H_b − H̄‖₂.
        let q = ndarray::array![3.0, 4.0];
        let stats = stats([[1.0, 0.0], [0.0, 1.0], [-2.0, 1.0]], [4, 4, 2], [0.2, 0.0, 1.0]);
        // The relevance is exact here (small integers times 1/2); the spread's product with 0.2, the logarithm and
        // the sum each round once, by at most u = EPSILON/2 of their terms' magnitude, on either side: 3u + 2u.
        let close = |score: f64, relevance: f64, log_term: f64| {
            (score - (relevance + log_term)).abs() <= 2.5 * f64::EPSILON * (relevance.abs() + log_term.abs())
        };
        let scores = covariance_aware_scores(q.view(), &stats, &0.5, &2.0, ());
        assert_eq!(scores.len(), 3);
        for (score, (relevance, log_term)) in scores.iter().zip([(1.5, 5f64.ln()), (2.0, 4f64.ln()), (-1.0, 7f64.ln())])
        {
            assert!(close(*score, relevance, log_term), "{score} vs {relevance} + {log_term}");
        }
        // A negative scale flips the relevance, not the spread.
        let flipped = covariance_aware_scores(q.view(), &stats, &-0.5, &2.0, ());
        assert!(close(flipped[0], -1.5, 5f64.ln()), "{}", flipped[0]);
        // γ = 0 is pure relevance and size.
        let relevance = covariance_aware_scores(q.view(), &stats, &0.5, &0.0, ());
        assert!(close(relevance[2], -1.0, 2f64.ln()), "{}", relevance[2]);
    }

    #[test]
    fn covariance_aware_selection_keeps_the_best_eligible_blocks_ties_to_the_lower_index() {
        let scores = [1.0, 3.0, 3.0, 2.0, 0.5];
        assert_eq!(covariance_aware_selection(&scores, 2, |_| true), [1, 2]);
        assert_eq!(covariance_aware_selection(&scores, 3, |b| b != 1), [2, 3, 0]);
        assert_eq!(covariance_aware_selection(&scores, 9, |b| b >= 3), [3, 4]);
        assert!(covariance_aware_selection(&scores, 0, |_| true).is_empty());
        // Equal relevance and size: the spread decides once γ > 0, the lower index when γ = 0.
        let q = ndarray::array![1.0, 0.0];
        let stats = stats([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], [4, 4, 4], [0.0, 3.0, 0.0]);
        let spread = covariance_aware_scores(q.view(), &stats, &1.0, &1.0, ());
        assert_eq!(covariance_aware_selection(&spread, 1, |_| true), [1]);
        let flat = covariance_aware_scores(q.view(), &stats, &1.0, &0.0, ());
        assert_eq!(covariance_aware_selection(&flat, 1, |_| true), [0]);
    }

    fn output(tail_mass: f64, total_mass: f64) -> TailOutput<f64> {
        TailOutput { o: Array1::zeros(1), tail_mass, total_mass, denominator: total_mass, shift: 0.0 }
    }

    #[test]
    fn the_e23_bound_is_the_tail_share_times_the_worst_spread_over_the_smallest_block() {
        // Tail blocks 0 and 2: share 1/4, worst spread 1.0 (block 2), ‖q‖ = 5, |α| = 0.5, smallest tail block 2.
        let q = ndarray::array![3.0, 4.0];
        let stats = stats([[0.0; 2]; 3], [4, 4, 2], [0.2, 9.0, 1.0]);
        let tail = BlockClasses { exact: vec![1], tail: vec![0, 2] };
        assert_eq!(
            pisa_error_bound(q.view(), &output(1.0, 4.0), &tail, &stats, &-0.5, ()),
            0.25 * 1.0 * 0.5 * 5.0 / 2.0
        );
        // No tail, or no mass in the row: nothing is approximated, the bound is zero.
        let no_tail = BlockClasses { exact: vec![0, 1, 2], tail: vec![] };
        assert_eq!(pisa_error_bound(q.view(), &output(0.0, 4.0), &no_tail, &stats, &0.5, ()), 0.0);
        assert_eq!(pisa_error_bound(q.view(), &output(1.0, 0.0), &tail, &stats, &0.5, ()), 0.0);
        // Carried to the output's own denominator (2 here, against the dense mass 4): the share becomes 1/2.
        let own = TailOutput { denominator: 2.0, ..output(1.0, 4.0) };
        assert_eq!(own.gap_bound(q.view(), &tail, &stats, &-0.5), 0.5 * 1.0 * 0.5 * 5.0 / 2.0);
        assert_eq!(own.gap_bound(q.view(), &no_tail, &stats, &-0.5), 0.0);
        let massless = TailOutput { denominator: 0.0, ..output(1.0, 4.0) };
        assert_eq!(massless.gap_bound(q.view(), &tail, &stats, &-0.5), 0.0);
    }

    #[test]
    fn the_tail_output_carries_the_dense_mass_of_the_row() {
        // Six keys in blocks of 2, all visible, block 1 selected: the total mass is the row's dense softmax sum
        // relative to its largest logit, and the tail mass is each tail block's size times e^{mean logit − max}.
        let k = Array2::from_shape_fn((6, 1), |(j, _)| [0.5, 1.5, 3.0, -1.0, 2.0, 0.0][j]);
        let v = Array2::from_shape_fn((6, 1), |(j, _)| j as f64);
        let q = ndarray::array![1.0];
        let visible = Array1::from_elem(6, true);
        let stats = tail_statistics(k.view(), v.view(), 2, ());
        let classes = classify_blocks(visible.view(), 2, &[1]);
        let out = tail_output(q.view(), k.view(), v.view(), visible.view(), &classes, &stats, &1.0, TailRule::Pisa, ());
        // Both sides sum six positive rounded exponentials of exact differences; the oracle's online softmax also
        // rescales its running sum once per new maximum. At most 6 exponentials, 5 additions and 2 rescalings
        // (2 roundings each) per side, each within u = EPSILON/2 of the sum: 2 · 15u = 15 · EPSILON.
        let dense: f64 = k.iter().map(|x| (x - 3.0).exp()).sum();
        assert!((out.total_mass - dense).abs() <= 15.0 * f64::EPSILON * dense, "{} vs {dense}", out.total_mass);
        // Both tail blocks have the exact mean logit 1: one exponential and one addition per side.
        let tail = 2.0 * (1.0f64 - 3.0).exp() + 2.0 * (1.0f64 - 3.0).exp();
        assert!((out.tail_mass - tail).abs() <= 2.0 * f64::EPSILON * tail, "{} vs {tail}", out.tail_mass);
    }

    #[test]
    fn a_peak_far_above_its_blocks_mean_leaves_a_finite_output() {
        // One key of the tail block 0 has a logit 2000 above every other: relative to it every PISA term (the
        // exact block's keys, the tail block's mean) underflows f64, yet the output is a weighted mean of finite
        // terms. In MPFR nothing underflows; the f64 output must agree with it, and its denominator is at least 1.
        let k = Array2::from_shape_fn((4, 1), |(j, _)| [4000.0, 0.0, 1.0, 2.0][j]);
        let v = Array2::from_shape_fn((4, 1), |(j, _)| [1.0, -3.0, 5.0, 7.0][j]);
        let q = ndarray::array![1.0];
        let visible = Array1::from_elem(4, true);
        let stats = tail_statistics(k.view(), v.view(), 2, ());
        let classes = classify_blocks(visible.view(), 2, &[1]);
        let out = tail_output(q.view(), k.view(), v.view(), visible.view(), &classes, &stats, &1.0, TailRule::Pisa, ());
        assert!(out.denominator >= 1.0 && out.o[0].is_finite(), "{out:?}");
        let ctx = crate::real::Precision(256);
        let mp = |a: &Array2<f64>| a.mapv(|x| crate::real::Mp::new(x, ctx));
        let (km, vm, qm) = (mp(&k), mp(&v), q.mapv(|x| crate::real::Mp::new(x, ctx)));
        let stats_mp = tail_statistics(km.view(), vm.view(), 2, ctx);
        let exact = tail_output(
            qm.view(),
            km.view(),
            vm.view(),
            visible.view(),
            &classes,
            &stats_mp,
            &crate::real::Mp::new(1.0, ctx),
            TailRule::Pisa,
            ctx,
        );
        let reference = exact.o[0].to_f64();
        assert!((out.o[0] - reference).abs() <= 1e-12 * reference.abs(), "{} vs {reference}", out.o[0]);
        // The dense mass relative to the same shift overflows: the tail's share of it is 0, and so is E23's bound;
        // carried to the output's own denominator it is finite and positive (block 0's keys differ, so H_0 ≠ H̄).
        assert_eq!(out.total_mass, f64::INFINITY);
        assert_eq!(pisa_error_bound(q.view(), &out, &classes, &stats, &1.0, ()), 0.0);
        let gap = out.gap_bound(q.view(), &classes, &stats, &1.0);
        assert!(gap.is_finite() && gap > 0.0, "{gap}");
    }

    /// One sequence of 6 queries and 6 keys (`d = dv = 1`, `α = 1`), two query heads over one KV head, blocks of 2.
    /// Keys `1, 1 | 0.5, 1 | 1, 1` and values `0, 0 | −2, 2 | 0, 0`: the means are 1, 0.75, 1, the `H_b` are 0, 1, 0
    /// (only block 1 has deviations: `−0.25 · −2 + 0.25 · 2 = 1`), `H̄ = 1/3`, so the spreads (of `1 × 1` matrices,
    /// exact after one step) are 1/3, 2/3, 1/3.
    fn block_case() -> (AttentionSpec, ndarray::ArrayD<f64>, ndarray::ArrayD<f64>, ndarray::ArrayD<f64>) {
        use ndarray::{ArrayD, IxDyn};
        let spec = AttentionSpec::dense(1, 2, 1, 6, 6, 1, 1).with_mask(crate::spec::Mask::None);
        // Head 0 holds queries 1, head 1 queries 2.
        let q = ArrayD::from_shape_fn(IxDyn(&[1, 2, 6, 1]), |ix| (ix[1] + 1) as f64);
        let k = ArrayD::from_shape_vec(IxDyn(&[1, 1, 6, 1]), vec![1., 1., 0.5, 1., 1., 1.]).unwrap();
        let v = ArrayD::from_shape_vec(IxDyn(&[1, 1, 6, 1]), vec![0., 0., -2., 2., 0., 0.]).unwrap();
        (spec, q, k, v)
    }

    fn block_config(gamma: f64) -> CovarianceConfig {
        CovarianceConfig {
            bsa: BsaConfig { q_block: 6, kv_block: 2, top_k: 1, force_first: false, force_local: 0 },
            gamma,
        }
    }

    #[test]
    fn the_spread_term_changes_the_chosen_block() {
        let (spec, q, k, v) = block_case();
        // γ = 10: S_b = 3 μ_b + ln(2 + 10 s_b) + ln(2 + 20 s_b) (head 1's pooled query has norm 2). Block 0:
        // 3 + ln(16/3) + ln(26/3) ≈ 6.833; block 1: 2.25 + ln(26/3) + ln(46/3) ≈ 7.139; block 2 ties block 0.
        let wide = covariance_block_scores(&spec, q.view(), k.view(), v.view(), &block_config(10.0), ()).unwrap();
        let expected = [
            3.0 + (2.0 + 10.0 / 3.0f64).ln() + (2.0 + 20.0 / 3.0f64).ln(),
            2.25 + (2.0 + 20.0 / 3.0f64).ln() + (2.0 + 40.0 / 3.0f64).ln(),
        ];
        // The spreads are within a few u of 1/3, 2/3 (a difference, a product, a norm); the scores add four terms of
        // at most 8 with a logarithm each: 64 · EPSILON is far above either and far below the gap of 0.3.
        for (b, want) in [1.0 / 3.0, 2.0 / 3.0, 1.0 / 3.0].into_iter().enumerate() {
            assert!((wide.spreads[[0, 0, b]] - want).abs() <= 8.0 * f64::EPSILON, "{}", wide.spreads[[0, 0, b]]);
        }
        for (b, want) in expected.into_iter().chain([expected[0]]).enumerate() {
            let got = wide.scores[[0, 0, 0, b]];
            assert!((got - want).abs() <= 64.0 * f64::EPSILON, "block {b}: {got} vs {want}");
        }
        let lists = crate::bsa::bsa_select(&spec, wide.scores.view(), &block_config(10.0).bsa).unwrap();
        assert_eq!(lists[[0, 0, 0, 0]], 1, "the spread lifts block 1 over the more relevant blocks 0 and 2");
        // γ = 0: relevance and size only; blocks 0 and 2 tie, the lower index wins.
        let flat = covariance_block_scores(&spec, q.view(), k.view(), v.view(), &block_config(0.0), ()).unwrap();
        let lists = crate::bsa::bsa_select(&spec, flat.scores.view(), &block_config(0.0).bsa).unwrap();
        assert_eq!(lists[[0, 0, 0, 0]], 0);
    }

    /// With `γ = 0` the score is BSA's plus `Σ_h ln n_b`, added in the same order, so bit for bit; the causal mask's
    /// `−∞` entries stay; the partial last block (one key of 7, in blocks of 2) adds `ln 1 = 0`; a shorter sequence's
    /// missing blocks have spread 0.
    #[test]
    fn without_gamma_the_scores_are_bsas_plus_the_log_sizes() {
        use crate::inputs::uniform_tensor;
        use crate::spec::{Layout, Mask};
        let spec = AttentionSpec {
            // A third sequence with queries and no keys: nothing to pool, no spread, every score −∞.
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 7, 10, 12], cu_seqlens_k: vec![0, 7, 10, 10] },
            ..AttentionSpec::dense(1, 4, 2, 1, 1, 3, 2).with_mask(Mask::Causal)
        };
        let q = uniform_tensor(1, &spec.expected_shape(Operand::Q));
        let k = uniform_tensor(2, &spec.expected_shape(Operand::K));
        let v = uniform_tensor(3, &spec.expected_shape(Operand::V));
        let config = CovarianceConfig {
            bsa: BsaConfig { q_block: 2, kv_block: 2, top_k: 2, force_first: true, force_local: 0 },
            gamma: 0.0,
        };
        let got = covariance_block_scores(&spec, q.view(), k.view(), v.view(), &config, ()).unwrap();
        let bsa = bsa_scores(&spec, q.view(), k.view(), &config.bsa, ()).unwrap();
        let mut finite = 0;
        for ((s, kv, a, b), &x) in bsa.indexed_iter() {
            let n = if s == 0 { [2.0, 2.0, 2.0, 1.0][b] } else { [2.0, 1.0, 0.0, 0.0][b] };
            let want = if x.is_finite() { x + f64::ln(n) + f64::ln(n) } else { x };
            assert_eq!(got.scores[[s, kv, a, b]].to_bits(), want.to_bits(), "[{s}, {kv}, {a}, {b}]");
            finite += usize::from(x.is_finite());
        }
        assert!(finite > 0 && got.scores[[0, 0, 3, 3]] == bsa[[0, 0, 3, 3]], "the partial block adds 0");
        assert!(got.scores[[0, 0, 0, 1]] == f64::NEG_INFINITY, "causal: query block 0 sees key block 0 only");
        // The spreads are the fixed-step runs of each (sequence, KV head); sequence 1 has 2 key blocks of 4.
        let keys = spec.head_rows(k.view(), &spec.sequences()[1], 1, true);
        let values = spec.head_rows(v.view(), &spec.sequences()[1], 1, true);
        let runs = block_spreads(keys, values, 2, ());
        assert_eq!(runs.len(), 2);
        assert!(runs.iter().all(|r| r.norms.len() <= E24_POWER_STEPS));
        assert_eq!(got.spreads[[1, 1, 0]], runs[0].estimate);
        assert_eq!(got.spreads[[1, 1, 1]], runs[1].estimate);
        assert!(got.spreads[[1, 1, 1]] > 0.0 && got.spreads[[1, 1, 2]] == 0.0 && got.spreads[[1, 1, 3]] == 0.0);
        assert!(got.spreads.index_axis(Axis(0), 2).iter().all(|&x| x == 0.0));
    }

    /// The coefficient is `γ|α|‖q̄‖` with the spec's scale: at `α = 0.5` (the block case's `d = 1` would make it 1)
    /// the relevance halves and so does each spread's weight.
    #[test]
    fn the_spread_weight_takes_the_scale() {
        let (spec, q, k, v) = block_case();
        let spec = AttentionSpec { scale: crate::spec::Scale::Value(0.5), ..spec };
        let got = covariance_block_scores(&spec, q.view(), k.view(), v.view(), &block_config(10.0), ()).unwrap();
        let expected = [
            1.5 + (2.0 + 5.0 / 3.0f64).ln() + (2.0 + 10.0 / 3.0f64).ln(),
            1.125 + (2.0 + 10.0 / 3.0f64).ln() + (2.0 + 20.0 / 3.0f64).ln(),
        ];
        for (b, want) in expected.into_iter().enumerate() {
            let got = got.scores[[0, 0, 0, b]];
            assert!((got - want).abs() <= 64.0 * f64::EPSILON, "block {b}: {got} vs {want}");
        }
    }

    #[test]
    fn a_bad_gamma_or_value_tensor_is_a_typed_error() {
        let (spec, q, k, v) = block_case();
        for gamma in [-1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                covariance_block_scores(&spec, q.view(), k.view(), v.view(), &block_config(gamma), ()),
                Err(OracleError::InvalidParameter { argument: "gamma", .. })
            ));
        }
        let short = v.slice_axis(Axis(2), (0..5).into()).to_owned();
        assert!(matches!(
            covariance_block_scores(&spec, q.view(), k.view(), short.view(), &block_config(1.0), ()),
            Err(OracleError::ShapeMismatch { argument: "v", .. })
        ));
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
