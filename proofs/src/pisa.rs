//! Theorems of the PISA tail (E22, E23): the first-order denominator term vanishes, the
//! first-order tail error is second order in the deviations, the PISA output stays within
//! the E23 bound plus the block-wise truncation error, and the tail's backward is the gradient of
//! its output.

use attnproof_oracle::pisa::{
    BlockClasses, TailGradients, TailOutput, TailRule, TailStatistics, tail_backward, tail_moments, tail_output,
};
use attnproof_oracle::vector::dot;
use attnproof_oracle::{Mp, Precision, Real};
use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis, Slice};

use crate::residual::{Agreement, Bits, Violation, agree, bits_of};

/// A tail-statistics function under test: `(k, v, block_size) ↦ TailStatistics`.
pub type StatsFn<'a> = &'a dyn Fn(ArrayView2<'_, Mp>, ArrayView2<'_, Mp>, usize) -> TailStatistics<Mp>;

/// **Theorem (E22, vanishing denominator term).** For every block, with the means under test,
/// `Σ_{j∈b} q·δ_j = 0` for any query, i.e. `Σ_{j∈b} (k_j − μ_b) = 0`: the first-order correction
/// to `Z_ib` is zero. Hypotheses: none.
pub fn first_order_denominator_vanishes(
    stats_fn: StatsFn<'_>,
    k: ArrayView2<'_, Mp>,
    v: ArrayView2<'_, Mp>,
    block_size: usize,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "first_order_denominator_vanishes (E22)";
    let stats = stats_fn(k, v, block_size);
    let ctx = stats.h_bar.first().map(|x| x.ctx()).unwrap_or_default();
    let mut agreement = Agreement::exact();
    for (b, &count) in stats.counts.iter().enumerate() {
        let rows = k.slice_axis(Axis(0), Slice::from(b * block_size..b * block_size + count));
        let sum = Array1::from_shape_fn(k.ncols(), |c| {
            rows.column(c).iter().fold(Mp::zero(ctx), |a, x| a + x.clone() - stats.means[[b, c]].clone())
        });
        // Compare against the keys' own magnitude: Σδ is a sum of `count` terms of that size.
        let scale = rows.iter().fold(Mp::one(ctx), |m, x| m.max(x.abs()));
        let scaled = sum.mapv(|x| x / scale.clone());
        agreement =
            agreement.and(agree(T, "Σ_j δ_j", &scaled, &Array1::from_elem(k.ncols(), Mp::zero(ctx)), required)?);
    }
    Ok(agreement)
}

/// The exact dense output of query `q` over visible keys (definition, MPFR).
fn dense_output(
    q: ArrayView1<'_, Mp>,
    k: ArrayView2<'_, Mp>,
    v: ArrayView2<'_, Mp>,
    visible: ArrayView1<'_, bool>,
    scale: &Mp,
    ctx: Precision,
) -> Array1<Mp> {
    let mut z = Mp::zero(ctx);
    let mut n = Array1::from_elem(v.ncols(), Mp::zero(ctx));
    for j in (0..k.nrows()).filter(|&j| visible[j]) {
        let w = (scale.clone() * dot(q, k.row(j), ctx)).exp();
        z += w.clone();
        n.zip_mut_with(&v.row(j), |a, x| *a += w.clone() * x.clone());
    }
    n.mapv(|x| x / z.clone())
}

fn distance(a: &Array1<Mp>, b: &Array1<Mp>, ctx: Precision) -> Mp {
    a.iter().zip(b).fold(Mp::zero(ctx), |acc, (x, y)| acc + (x.clone() - y.clone()) * (x.clone() - y.clone())).sqrt()
}

/// A tail output under test: `(q, k, v, visible, classes, stats, scale) ↦ TailOutput`.
pub type TailFn<'a> = &'a dyn Fn(
    ArrayView1<'_, Mp>,
    ArrayView2<'_, Mp>,
    ArrayView2<'_, Mp>,
    ArrayView1<'_, bool>,
    &BlockClasses,
    &TailStatistics<Mp>,
    &Mp,
) -> TailOutput<Mp>;

/// The oracle's first-order expansion with each block's own `H_b`.
pub fn oracle_first_order(
    q: ArrayView1<'_, Mp>,
    k: ArrayView2<'_, Mp>,
    v: ArrayView2<'_, Mp>,
    visible: ArrayView1<'_, bool>,
    classes: &BlockClasses,
    stats: &TailStatistics<Mp>,
    scale: &Mp,
) -> TailOutput<Mp> {
    tail_output(q, k, v, visible, classes, stats, scale, TailRule::FirstOrderPerBlock, scale.ctx())
}

/// The oracle's PISA output (shared `H̄`).
pub fn oracle_pisa(
    q: ArrayView1<'_, Mp>,
    k: ArrayView2<'_, Mp>,
    v: ArrayView2<'_, Mp>,
    visible: ArrayView1<'_, bool>,
    classes: &BlockClasses,
    stats: &TailStatistics<Mp>,
    scale: &Mp,
) -> TailOutput<Mp> {
    tail_output(q, k, v, visible, classes, stats, scale, TailRule::Pisa, scale.ctx())
}

/// One block-structured test problem: keys `k_j = μ_b + t·u_j` for the block of `j`.
#[derive(Clone, Debug)]
pub struct SpreadProblem {
    /// The query `[d]`.
    pub q: Array1<Mp>,
    /// Block centers `[n_blocks, d]`.
    pub centers: Array2<Mp>,
    /// Deviations `[n, d]` (any; the statistics re-center them).
    pub directions: Array2<Mp>,
    /// Values `[n, dv]`.
    pub v: Array2<Mp>,
    /// Keys per block.
    pub block_size: usize,
    /// Blocks computed exactly.
    pub classes: BlockClasses,
    /// Softmax scale.
    pub scale: Mp,
}

impl SpreadProblem {
    /// The keys at spread `t`.
    pub fn keys(&self, t: &Mp) -> Array2<Mp> {
        Array2::from_shape_fn(self.directions.dim(), |(j, c)| {
            self.centers[[j / self.block_size, c]].clone() + t.clone() * self.directions[[j, c]].clone()
        })
    }
}

/// **Theorem (E22, second order).** With keys `μ_b + t·u_j`, the first-order tail of the output
/// under test (every tail block expanded to first order with its own `H_b`) differs from the
/// dense output by `O(t²)`: each halving of `t` divides the error by a factor in `[3, 5]`
/// (4 asymptotically) until the error falls below `2^-required`. Hypotheses: `spreads` halve and
/// are small enough for the asymptotic regime (the tests use `2^-8` and below with `|α q·u| ≤ 4`).
pub fn tail_error_is_second_order(
    tail_fn: TailFn<'_>,
    stats_fn: StatsFn<'_>,
    problem: &SpreadProblem,
    spreads: &[Mp],
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "tail_error_is_second_order (E22)";
    let ctx = problem.scale.ctx();
    let visible = Array1::from_elem(problem.directions.nrows(), true);
    let errors: Vec<Mp> = spreads
        .iter()
        .map(|t| {
            let k = problem.keys(t);
            let stats = stats_fn(k.view(), problem.v.view(), problem.block_size);
            let out = tail_fn(
                problem.q.view(),
                k.view(),
                problem.v.view(),
                visible.view(),
                &problem.classes,
                &stats,
                &problem.scale,
            );
            distance(
                &out.o,
                &dense_output(problem.q.view(), k.view(), problem.v.view(), visible.view(), &problem.scale, ctx),
                ctx,
            )
        })
        .collect();
    let floor = Mp::from_f64(2f64.powf(-required.0), ctx);
    for (i, w) in errors.windows(2).enumerate() {
        if w[0] <= floor {
            break;
        }
        let ratio = w[0].clone() / w[1].clone();
        if ratio < Mp::from_f64(3.0, ctx) || ratio > Mp::from_f64(5.0, ctx) {
            return Err(Violation::Residual {
                theorem: T,
                quantity: "error ratio per halving (expected ≈ 4)",
                found: bits_of(&w[1]),
                required: bits_of(&(w[0].clone() / Mp::from_f64(4.0, ctx))),
                index: vec![i + 1],
            });
        }
    }
    Ok(Agreement { bits: bits_of(errors.last().expect("at least one spread")) })
}

/// **Theorem (E23).** For the PISA output under test and the oracle's first-order output with
/// per-block `H_b` (same denominator `D`),
/// `‖o^PISA − o‖ ≤ bound_E23 · Z/D + ‖o^{first order} − o‖`:
/// the two outputs differ only in `α Σ_U α_ib qᵀ(H̄ − H_b) / D`, whose norm is at most the E23
/// bound with `Z` replaced by `D` (triangle inequality, `‖Mᵀq‖ ≤ ‖M‖₂‖q‖`, `α_ib ≤ α_ib|B_b|/B`),
/// and the remainder is the second-order truncation. `‖·‖₂` comes from power iteration, which
/// converges from below, so the check allows a relative slack of `2^-20` on the right-hand
/// side (which also absorbs MPFR rounding when both sides coincide, as when every `H_b = H̄`).
/// Hypotheses: the tail is not empty.
pub fn pisa_within_bound(
    pisa_fn: TailFn<'_>,
    stats_fn: StatsFn<'_>,
    problem: &SpreadProblem,
    t: &Mp,
) -> Result<Agreement, Violation> {
    const T: &str = "pisa_within_bound (E23)";
    let ctx = problem.scale.ctx();
    if problem.classes.tail.is_empty() {
        return Err(Violation::Hypothesis { theorem: T, reason: "no tail block".into() });
    }
    let k = problem.keys(t);
    let visible = Array1::from_elem(k.nrows(), true);
    let stats = stats_fn(k.view(), problem.v.view(), problem.block_size);
    let args = (problem.q.view(), k.view(), problem.v.view(), visible.view());
    let pisa = pisa_fn(args.0, args.1, args.2, args.3, &problem.classes, &stats, &problem.scale);
    let first = oracle_first_order(args.0, args.1, args.2, args.3, &problem.classes, &stats, &problem.scale);
    let dense = dense_output(args.0, args.1, args.2, args.3, &problem.scale, ctx);
    // E23 times Z/D, computed without the dense mass Z (which may overflow relative to the output's shift).
    let share = first.gap_bound(problem.q.view(), &problem.classes, &stats, &problem.scale);
    let allowed = (share + distance(&first.o, &dense, ctx)) * Mp::from_f64(1.0 + 2f64.powi(-20), ctx);
    let error = distance(&pisa.o, &dense, ctx);
    if error > allowed {
        return Err(Violation::Bound {
            theorem: T,
            quantity: "‖o^PISA − o‖",
            error: error.to_f64(),
            bound: allowed.to_f64(),
            ratio: (error / allowed.clone()).to_f64(),
            index: vec![],
        });
    }
    Ok(Agreement { bits: bits_of(&(allowed - error)) })
}

/// A tail backward under test: `(q [Lq, d], k [Lk, d], v [Lk, dv], visible [Lq, Lk], classes per row, the moments of
/// (k, v), scale, dO [Lq, dv]) ↦ gradients`.
pub type TailBackwardFn<'a> = &'a TailBackward;

/// The function type behind [`TailBackwardFn`].
pub type TailBackward = dyn Fn(
    ArrayView2<'_, Mp>,
    ArrayView2<'_, Mp>,
    ArrayView2<'_, Mp>,
    ArrayView2<'_, bool>,
    &[BlockClasses],
    &TailStatistics<Mp>,
    &Mp,
    ArrayView2<'_, Mp>,
) -> TailGradients<Mp>;

/// The oracle's [`tail_backward`] as a [`TailBackwardFn`].
#[allow(clippy::too_many_arguments)]
pub fn oracle_tail_backward(
    q: ArrayView2<'_, Mp>,
    k: ArrayView2<'_, Mp>,
    v: ArrayView2<'_, Mp>,
    visible: ArrayView2<'_, bool>,
    classes: &[BlockClasses],
    stats: &TailStatistics<Mp>,
    scale: &Mp,
    d_o: ArrayView2<'_, Mp>,
) -> TailGradients<Mp> {
    tail_backward(q, k, v, visible, classes, stats, scale, d_o, scale.ctx())
}

/// The tail's backward decomposed as the GPU plan runs it (`docs/pisa-gpu.md`, "The tail's backward"), in MPFR: the
/// exact keys by the dense backward with the PISA output and LSE (`P_j = e^{s_j − lse}`, `δ = dO·o`); the tail blocks
/// by the dense backward over the pooled problem, keys `μ_b`, values `v̄_b`, `P_b = e^{α q·μ_b + ln|B_b| − lse}` and
/// `δ'_b = δ − dO·h/|B_b|` (`h = α H̄ᵀq`: the shared term's row constant folded into `δ`), giving `dμ_b` and
/// `dv̄_b = Σ_i P_ib dO_i`; the shared term `dq += A α H̄ dO`, `G = Σ_i A_i α q_i dO_iᵀ` with `A = Σ_b P_b/|B_b|`; then the
/// scatter onto the keys and values, `dk_j += dμ_b/|B_b| + G (v_j − v̄_b)/n_b`, `dv_j += dv̄_b/|B_b| + Gᵀ(k_j − μ_b)/n_b`.
/// Passing [`tail_gradients_match_finite_differences`] is the plan's proof.
#[allow(clippy::too_many_arguments)]
pub fn decomposed_tail_backward(
    q: ArrayView2<'_, Mp>,
    k: ArrayView2<'_, Mp>,
    v: ArrayView2<'_, Mp>,
    visible: ArrayView2<'_, bool>,
    classes: &[BlockClasses],
    stats: &TailStatistics<Mp>,
    scale: &Mp,
    d_o: ArrayView2<'_, Mp>,
) -> TailGradients<Mp> {
    let ctx = scale.ctx();
    let (d, dv, n_blocks, size) = (q.ncols(), v.ncols(), stats.counts.len(), stats.block_size);
    let zeros = |r: usize, c: usize| Array2::from_elem((r, c), Mp::zero(ctx));
    let (mut dq, mut dk, mut dvv) = (zeros(q.nrows(), d), zeros(k.nrows(), d), zeros(v.nrows(), dv));
    let (mut d_means, mut d_values, mut g) = (zeros(n_blocks, d), zeros(n_blocks, dv), zeros(d, dv));
    let count = |b: usize| Mp::from_f64(stats.counts[b] as f64, ctx);
    let mean_value = |b: usize, e: usize| stats.value_sums[[b, e]].clone() / count(b);
    for (i, classes) in classes.iter().enumerate() {
        let (qi, g_out) = (q.row(i), d_o.row(i));
        let out = tail_output(qi, k, v, visible.row(i), classes, stats, scale, TailRule::Pisa, ctx);
        if out.denominator == Mp::zero(ctx) {
            continue;
        }
        let lse = out.shift.clone() + out.denominator.ln();
        let delta = dot(g_out, out.o.view(), ctx);
        // The exact part: the dense backward with the PISA row statistics.
        for &b in &classes.exact {
            for j in (b * size..b * size + stats.counts[b]).filter(|&j| visible[[i, j]]) {
                let p = (scale.clone() * dot(qi, k.row(j), ctx) - lse.clone()).exp();
                let ds = p.clone() * (dot(g_out, v.row(j), ctx) - delta.clone()) * scale.clone();
                for c in 0..d {
                    dq[[i, c]] += ds.clone() * k[[j, c]].clone();
                    dk[[j, c]] += ds.clone() * qi[c].clone();
                }
                for e in 0..dv {
                    dvv[[j, e]] += p.clone() * g_out[e].clone();
                }
            }
        }
        if classes.tail.is_empty() {
            continue;
        }
        // The pooled part: keys μ_b, values v̄_b, δ' per block.
        let h: Array1<Mp> = (0..dv).map(|e| scale.clone() * dot(qi, stats.h_bar.column(e), ctx)).collect();
        let through_h = dot(g_out, h.view(), ctx);
        let mut a_sum = Mp::zero(ctx);
        for &b in &classes.tail {
            let p = (scale.clone() * dot(qi, stats.means.row(b), ctx) + count(b).ln() - lse.clone()).exp();
            let delta_b = delta.clone() - through_h.clone() / count(b);
            let dp = (0..dv).fold(Mp::zero(ctx), |acc, e| acc + g_out[e].clone() * mean_value(b, e));
            let ds = p.clone() * (dp - delta_b) * scale.clone();
            for c in 0..d {
                dq[[i, c]] += ds.clone() * stats.means[[b, c]].clone();
                d_means[[b, c]] += ds.clone() * qi[c].clone();
            }
            for e in 0..dv {
                d_values[[b, e]] += p.clone() * g_out[e].clone();
            }
            a_sum += p / count(b);
        }
        let factor = a_sum * scale.clone();
        for c in 0..d {
            dq[[i, c]] += factor.clone() * dot(stats.h_bar.row(c), g_out, ctx);
            for e in 0..dv {
                g[[c, e]] += factor.clone() * qi[c].clone() * g_out[e].clone();
            }
        }
    }
    let blocks = Mp::from_f64(n_blocks as f64, ctx);
    for b in 0..n_blocks {
        for j in b * size..b * size + stats.counts[b] {
            for c in 0..d {
                let spread = (0..dv)
                    .fold(Mp::zero(ctx), |acc, e| acc + g[[c, e]].clone() * (v[[j, e]].clone() - mean_value(b, e)));
                dk[[j, c]] += d_means[[b, c]].clone() / count(b) + spread / blocks.clone();
            }
            for e in 0..dv {
                let spread = (0..d).fold(Mp::zero(ctx), |acc, c| {
                    acc + g[[c, e]].clone() * (k[[j, c]].clone() - stats.means[[b, c]].clone())
                });
                dvv[[j, e]] += d_values[[b, e]].clone() / count(b) + spread / blocks.clone();
            }
        }
    }
    TailGradients { dq, dk, dv: dvv }
}

/// The inputs of the tail's gradient theorem: one head's queries, keys and values, each row's visibility and block
/// classes (held fixed), blocks of `block_size` keys, the scale and the upstream gradient.
#[derive(Clone, Debug)]
pub struct TailGradientCase {
    /// `[Lq, d]`.
    pub q: Array2<Mp>,
    /// `[Lk, d]`.
    pub k: Array2<Mp>,
    /// `[Lk, dv]`.
    pub v: Array2<Mp>,
    /// `[Lq, Lk]`.
    pub visible: Array2<bool>,
    /// Per row.
    pub classes: Vec<BlockClasses>,
    /// Keys per block.
    pub block_size: usize,
    /// Softmax scale.
    pub scale: Mp,
    /// `dO` `[Lq, dv]`.
    pub d_o: Array2<Mp>,
}

/// **Theorem (E22, the tail's gradients).** For the loss `L = Σ_i dO_i · o_i` with the oracle's PISA output
/// ([`tail_output`], [`TailRule::Pisa`], statistics recomputed from the moved keys and values by [`tail_moments`]),
/// the backward under test's `∂L/∂q`, `∂L/∂k` and `∂L/∂v` equal the central differences `(L(x + h) − L(x − h)) / 2h`,
/// `h = 2^-step_bits`, at every element. `L` is smooth in every input once the classes are fixed (exponentials of
/// linear functions, the means and `H̄` polynomial), so the difference's truncation is `O(h²)` times the third
/// derivative, and its cancellation `O(2^-prec / h)`. Hypotheses: the precision exceeds `2·step_bits + required`
/// bits, and the inputs are of moderate size (the tests' scores stay within a few units), so that the third
/// derivative does not eat the margin.
pub fn tail_gradients_match_finite_differences(
    backward: TailBackwardFn<'_>,
    case: &TailGradientCase,
    step_bits: u32,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "tail_gradients_match_finite_differences (E22)";
    let prec = case.scale.ctx();
    if (prec.0 as f64) < 2.0 * step_bits as f64 + required.0 {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("precision {} too low", prec.0) });
    }
    let stats = tail_moments(case.k.view(), case.v.view(), case.block_size, prec);
    let found = backward(
        case.q.view(),
        case.k.view(),
        case.v.view(),
        case.visible.view(),
        &case.classes,
        &stats,
        &case.scale,
        case.d_o.view(),
    );
    let loss = |q: &Array2<Mp>, k: &Array2<Mp>, v: &Array2<Mp>| -> Mp {
        let stats = tail_moments(k.view(), v.view(), case.block_size, prec);
        let mut total = Mp::zero(prec);
        for (i, classes) in case.classes.iter().enumerate() {
            let out = tail_output(
                q.row(i),
                k.view(),
                v.view(),
                case.visible.row(i),
                classes,
                &stats,
                &case.scale,
                TailRule::Pisa,
                prec,
            );
            total += dot(case.d_o.row(i), out.o.view(), prec);
        }
        total
    };
    let h = Mp(rug::Float::with_val(prec.0, rug::Float::i_exp(1, -(step_bits as i32))));
    let two_h = h.clone() + h.clone();
    let numeric = |which: usize| -> Array2<Mp> {
        let inputs = [&case.q, &case.k, &case.v];
        Array2::from_shape_fn(inputs[which].dim(), |idx| {
            let moved = |delta: &Mp| {
                let mut xs = [case.q.clone(), case.k.clone(), case.v.clone()];
                xs[which][idx] = xs[which][idx].clone() + delta.clone();
                loss(&xs[0], &xs[1], &xs[2])
            };
            (moved(&h) - moved(&-h.clone())) / two_h.clone()
        })
    };
    let agreement = agree(T, "dq", &found.dq, &numeric(0), required)?;
    let agreement = agreement.and(agree(T, "dk", &found.dk, &numeric(1), required)?);
    Ok(agreement.and(agree(T, "dv", &found.dv, &numeric(2), required)?))
}
