//! The first link of the trust chain: a rounding-error model of the f64 oracle, and the theorem
//! that the f64 oracle stays within it of the MPFR oracle, output by output, element by element.
//!
//! # The model
//!
//! Standard floating-point model with unit roundoff `u = 2^-53`: each `+ − × ÷ √` rounds with
//! relative error at most `u`; `exp` (the oracle's own, `attnproof_oracle::vexp`, below 1 ulp: its test measures
//! it against MPFR) and `ln` (glibc, documented below 1 ulp) at most `2u`; a
//! sum or dot product of `n` terms, in any order and with or without FMA (faer's blocked
//! products included), errs by at most `γ_n Σ|terms|`, `γ_n = nu/(1 − nu)`. Subnormal results
//! err by at most `2^-1074` absolutely (`exp` of a very negative argument).
//!
//! Quantities without a hat are exact (MPFR); `α` is the exact scale. For query row `i` and a
//! visible key `j`, with `m_i = max_j s_ij`, `p_ij` the exact probabilities:
//!
//! - score error (E1): `σ_ij = (γ_d + 3u) |α| Σ_c |q_ic||k_jc|` — the dot product, the product
//!   with `α̂`, and `α̂ = fl(1/fl(√d))` itself (2 roundings);
//! - weight error: `ŵ_ij = w_ij (1 + η_ij)` with `η_ij = σ_ij + u|s_ij − m_i| + 2u` — the shift
//!   `m̂_i` cancels between numerator and denominator (and in `LSE = m + log ℓ`), so only each
//!   score's own error, the rounding of `s − m` and of `exp` remain;
//! - `O` (E2, E5): `b^O_ic = Σ_j p_ij η_ij |v_jc − o_ic| + γ_Lk Σ_j p_ij |v_jc| + (γ_Lk + u)|o_ic|
//!   + Lk·2^-1074 (max_j|v_jc| + |o_ic|)` — first-order softmax sensitivity `∂o/∂s_j = p_j(v_j − o)`,
//!   the sums `A` and `ℓ` (positive terms), the division, and underflow;
//! - `LSE` (E5): `b^L_i = Σ_j p_ij η_ij + γ_Lk + 2u|log ℓ_i| + u|LSE_i|` (`ℓ_i ≥ 1`);
//! - `P` recomputed from LSE (E10): relative error `π_ij = σ_ij + b^L_i + u|s_ij − LSE_i| + 2u`;
//! - `dV_jc` (E6): `Σ_i p_ij (π_ij + γ_Lq)|dO_ic| + Lq·2^-1074 max_i|dO_ic|`;
//! - `dP_ij` (E6): `ρ_ij = γ_dv Σ_c |dO_ic||v_jc|`; `D_i` (E7): `ν_i = γ_dv Σ_c |dO_ic||o_ic|
//!   + Σ_c |dO_ic| b^O_ic`;
//! - `dS_ij` (E8): `ζ_ij = (π_ij + 2u)|dS_ij| + p_ij(ρ_ij + ν_i) + 2^-1074 |dP_ij − D_i|`;
//! - `dQ_ic` (E9): `|α| Σ_j (ζ_ij + γ_Lk |dS_ij|)|k_jc| + 3u|dQ_ic|`; `dK_jc`:
//!   `|α| Σ_i (ζ_ij + γ_Lq |dS_ij|)|q_ic| + 3u|dK_jc|`;
//! - GQA: the `g` per-head dK (dV) of a KV head are summed: bounds add, plus `γ_g Σ_h |dK_h|`.
//!
//! Every term above is first order in the perturbations. Hypothesis: every first-order relative
//! perturbation (`η`, `π`, `γ_Lk`, `γ_Lq`) is at most `2^-20`; then the neglected products of two
//! perturbations and the remainders `e^x − 1 − x ≤ x²` are below `2^-19` times the first-order
//! terms, and the bounds are multiplied by [`SECOND_ORDER_FACTOR`] `= 1 + 2^-10` to cover them.
//! The bound is evaluated in f64 from exact quantities; its own rounding (relative `~50u`) is
//! also inside that factor.

use attnproof_oracle::dense::{self, HeadForward, HeadGradients};
use attnproof_oracle::{AttentionSpec, DenseConfig, Gradients, Mp, OracleError, Precision, Real, to_mpfr};
use ndarray::{Array1, Array2, ArrayD, ArrayViewD, Dimension, IxDyn, Zip};

use crate::backward::HeadCase;
use crate::residual::Violation;

/// Unit roundoff of f64.
pub const UNIT_ROUNDOFF: f64 = f64::EPSILON / 2.0;
/// Smallest positive subnormal f64: the absolute error of an underflowing result.
pub const SUBNORMAL_UNIT: f64 = f64::from_bits(1);
/// Factor covering second-order terms under the `2^-20` hypothesis (see the module docs).
pub const SECOND_ORDER_FACTOR: f64 = 1.0 + 1.0 / 1024.0;
/// Largest first-order relative perturbation the model accepts.
pub const FIRST_ORDER_LIMIT: f64 = 1.0 / 1_048_576.0;

/// `γ_n = nu / (1 − nu)`.
pub fn gamma(n: usize) -> f64 {
    let nu = n as f64 * UNIT_ROUNDOFF;
    nu / (1.0 - nu)
}

/// Allowed absolute errors of each output: `M` holds matrices (`O`, `dQ`, `dK`, `dV`), `R` row
/// statistics (`LSE`, `D`).
#[derive(Clone, Debug, PartialEq)]
pub struct Bounds<M, R> {
    /// Bound on `O`.
    pub o: M,
    /// Bound on `LSE` (0 for fully masked rows, which must match exactly).
    pub lse: R,
    /// Bound on `D`.
    pub delta: R,
    /// Bound on `dQ`.
    pub dq: M,
    /// Bound on `dK` (of one query head in [`HeadBounds`], GQA-summed in [`ProblemBounds`]).
    pub dk: M,
    /// Bound on `dV` (likewise).
    pub dv: M,
}

/// Bounds of one head, before the GQA sum.
pub type HeadBounds = Bounds<Array2<f64>, Array1<f64>>;
/// Bounds of a whole problem, laid out like its outputs.
pub type ProblemBounds = Bounds<ArrayD<f64>, ArrayD<f64>>;

fn f(x: &Mp) -> f64 {
    x.to_f64()
}

/// The model's bounds for one head, from its exact (MPFR) forward and backward.
pub fn head_bounds(case: &HeadCase, fwd: &HeadForward<Mp>, grads: &HeadGradients<Mp>) -> Result<HeadBounds, Violation> {
    const T: &str = "f64_oracle_within_bound";
    let ctx = case.ctx();
    let u = UNIT_ROUNDOFF;
    let (len_q, d) = case.q.dim();
    let (len_k, dv) = case.v.dim();
    let alpha = f(&case.scale).abs();
    let q = case.q.mapv(|x| f(&x));
    let k = case.k.mapv(|x| f(&x));
    let v = case.v.mapv(|x| f(&x));
    let d_out = case.d_out.mapv(|x| f(&x));
    let o = fwd.o.mapv(|x| f(&x));
    let lse = fwd.lse.mapv(|x| f(&x));
    let s_mp = dense::scores(case.q.view(), case.k.view(), &case.scale, case.visible.view(), ctx);
    let p_mp = dense::probabilities_from_lse(s_mp.view(), fwd.lse.view(), case.visible.view(), ctx);
    let dp_mp = Mp::matmul(case.d_out.view(), case.v.t(), ctx);
    let ds_mp = dense::score_gradient(p_mp.view(), dp_mp.view(), grads.delta.view());
    let s = s_mp.mapv(|x| f(&x));
    let p = p_mp.mapv(|x| f(&x));
    let dp = dp_mp.mapv(|x| f(&x));
    let ds = ds_mp.mapv(|x| f(&x));
    let delta = grads.delta.mapv(|x| f(&x));
    let vis = &case.visible;

    let abs_dot = |a: &Array2<f64>, i: usize, b: &Array2<f64>, j: usize| -> f64 {
        a.row(i).iter().zip(b.row(j)).map(|(x, y)| x.abs() * y.abs()).sum()
    };
    let sigma = Array2::from_shape_fn((len_q, len_k), |(i, j)| (gamma(d) + 3.0 * u) * alpha * abs_dot(&q, i, &k, j));
    let mut worst = gamma(len_k).max(gamma(len_q));
    let mut b = Bounds {
        o: Array2::zeros((len_q, dv)),
        lse: Array1::zeros(len_q),
        delta: Array1::zeros(len_q),
        dq: Array2::zeros((len_q, d)),
        dk: Array2::zeros((len_k, d)),
        dv: Array2::zeros((len_k, dv)),
    };
    let mut pi = Array2::<f64>::zeros((len_q, len_k));
    for i in 0..len_q {
        if lse[i] == f64::NEG_INFINITY {
            continue; // fully masked: O = 0 and LSE = −∞ exactly, gradients 0 exactly
        }
        let m = (0..len_k).filter(|&j| vis[[i, j]]).map(|j| s[[i, j]]).fold(f64::NEG_INFINITY, f64::max);
        let eta: Vec<f64> = (0..len_k)
            .map(|j| if vis[[i, j]] { sigma[[i, j]] + u * (s[[i, j]] - m).abs() + 2.0 * u } else { 0.0 })
            .collect();
        worst = worst.max(eta.iter().copied().fold(0.0, f64::max));
        for c in 0..dv {
            let vmax = (0..len_k).map(|j| v[[j, c]].abs()).fold(0.0, f64::max);
            let oc = o[[i, c]];
            b.o[[i, c]] = (0..len_k).map(|j| p[[i, j]] * eta[j] * (v[[j, c]] - oc).abs()).sum::<f64>()
                + gamma(len_k) * (0..len_k).map(|j| p[[i, j]] * v[[j, c]].abs()).sum::<f64>()
                + (gamma(len_k) + u) * oc.abs()
                + len_k as f64 * SUBNORMAL_UNIT * (vmax + oc.abs());
        }
        b.lse[i] = (0..len_k).map(|j| p[[i, j]] * eta[j]).sum::<f64>()
            + gamma(len_k)
            + 2.0 * u * (lse[i] - m).abs()
            + u * lse[i].abs();
        for j in 0..len_k {
            if vis[[i, j]] {
                pi[[i, j]] = sigma[[i, j]] + b.lse[i] + u * (s[[i, j]] - lse[i]).abs() + 2.0 * u;
                worst = worst.max(pi[[i, j]]);
            }
        }
    }
    if worst > FIRST_ORDER_LIMIT {
        return Err(Violation::Hypothesis {
            theorem: T,
            reason: format!("first-order perturbation {worst:e} exceeds 2^-20"),
        });
    }
    let rho = Array2::from_shape_fn((len_q, len_k), |(i, j)| gamma(dv) * abs_dot(&d_out, i, &v, j));
    let nu = Array1::from_shape_fn(len_q, |i| {
        gamma(dv) * abs_dot(&d_out, i, &o, i) + (0..dv).map(|c| d_out[[i, c]].abs() * b.o[[i, c]]).sum::<f64>()
    });
    let zeta = Array2::from_shape_fn((len_q, len_k), |(i, j)| {
        (pi[[i, j]] + 2.0 * u) * ds[[i, j]].abs()
            + p[[i, j]] * (rho[[i, j]] + nu[i])
            + SUBNORMAL_UNIT * (dp[[i, j]] - delta[i]).abs()
    });
    b.delta = nu;
    let dq = grads.dq.mapv(|x| f(&x));
    let dk = grads.dk.mapv(|x| f(&x));
    for i in 0..len_q {
        for c in 0..d {
            b.dq[[i, c]] = alpha
                * (0..len_k).map(|j| (zeta[[i, j]] + gamma(len_k) * ds[[i, j]].abs()) * k[[j, c]].abs()).sum::<f64>()
                + 3.0 * u * dq[[i, c]].abs();
        }
    }
    for j in 0..len_k {
        for c in 0..d {
            b.dk[[j, c]] = alpha
                * (0..len_q).map(|i| (zeta[[i, j]] + gamma(len_q) * ds[[i, j]].abs()) * q[[i, c]].abs()).sum::<f64>()
                + 3.0 * u * dk[[j, c]].abs();
        }
        for c in 0..dv {
            let gmax = (0..len_q).map(|i| d_out[[i, c]].abs()).fold(0.0, f64::max);
            b.dv[[j, c]] =
                (0..len_q).map(|i| p[[i, j]] * (pi[[i, j]] + gamma(len_q)) * d_out[[i, c]].abs()).sum::<f64>()
                    + len_q as f64 * SUBNORMAL_UNIT * gmax;
        }
    }
    for a in [&mut b.o, &mut b.dq, &mut b.dk, &mut b.dv] {
        a.mapv_inplace(|x| x * SECOND_ORDER_FACTOR);
    }
    for a in [&mut b.lse, &mut b.delta] {
        a.mapv_inplace(|x| x * SECOND_ORDER_FACTOR);
    }
    Ok(b)
}

/// The worst `error / bound` of one output.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputRatio {
    /// Output name (`O`, `LSE`, `D`, `dQ`, `dK`, `dV`).
    pub output: &'static str,
    /// `max(error / bound)` over elements (0 when every error is 0).
    pub max_ratio: f64,
    /// Index of the worst element.
    pub index: Vec<usize>,
}

/// What the theorem measured, output by output.
#[derive(Clone, Debug, PartialEq)]
pub struct BoundReport {
    /// One entry per output.
    pub outputs: Vec<OutputRatio>,
}

impl BoundReport {
    /// The largest ratio over all outputs.
    pub fn max_ratio(&self) -> f64 {
        self.outputs.iter().map(|o| o.max_ratio).fold(0.0, f64::max)
    }
}

/// An f64 attention implementation under test (the f64 oracle, or a broken variant).
pub type F64Candidate<'a> = &'a dyn Fn(
    &AttentionSpec,
    ArrayViewD<'_, f64>,
    ArrayViewD<'_, f64>,
    ArrayViewD<'_, f64>,
    ArrayViewD<'_, f64>,
) -> Result<Gradients<f64>, OracleError>;

/// The model's bounds for every output of a whole problem (inputs exact in f64).
pub fn problem_bounds(
    spec: &AttentionSpec,
    q: ArrayViewD<'_, f64>,
    k: ArrayViewD<'_, f64>,
    v: ArrayViewD<'_, f64>,
    d_out: ArrayViewD<'_, f64>,
    precision: Precision,
) -> Result<ProblemBounds, Violation> {
    use attnproof_oracle::spec::Operand;
    let hyp = |e: OracleError| Violation::Hypothesis { theorem: "f64_oracle_within_bound", reason: e.to_string() };
    // Validates everything (shapes, finiteness) once, through the oracle itself.
    attnproof_oracle::backward_mpfr(spec, q.view(), k.view(), v.view(), d_out.view(), precision).map_err(hyp)?;
    let zeros = |op: Operand| ArrayD::<f64>::zeros(IxDyn(&spec.expected_shape(op)));
    let mut out = ProblemBounds {
        o: zeros(Operand::O),
        lse: zeros(Operand::RowStat),
        delta: zeros(Operand::RowStat),
        dq: zeros(Operand::Q),
        dk: zeros(Operand::K),
        dv: zeros(Operand::V),
    };
    let (qm, km, vm, gm) =
        (to_mpfr(q, precision), to_mpfr(k, precision), to_mpfr(v, precision), to_mpfr(d_out, precision));
    let scale = spec.scale_value::<Mp>(precision);
    let mut dk_abs = zeros(Operand::K);
    let mut dv_abs = zeros(Operand::V);
    for seq in spec.sequences() {
        let visible = spec.mask.matrix(seq.len_q, seq.len_k);
        for h in 0..spec.n_heads_q {
            let kv = spec.kv_head(h);
            let case = HeadCase {
                q: spec.head_rows(qm.view(), &seq, h, false).to_owned(),
                k: spec.head_rows(km.view(), &seq, kv, true).to_owned(),
                v: spec.head_rows(vm.view(), &seq, kv, true).to_owned(),
                d_out: spec.head_rows(gm.view(), &seq, h, false).to_owned(),
                visible: visible.clone(),
                scale: scale.clone(),
            };
            let fwd = dense::head_forward(case.inputs(), &case.scale, DenseConfig::default(), precision);
            let grads = dense::head_backward(
                case.inputs(),
                case.d_out.view(),
                &fwd,
                &case.scale,
                DenseConfig::default(),
                precision,
            );
            let b = head_bounds(&case, &fwd, &grads)?;
            let qs = spec.head_slice(&seq, h, false);
            let ks = spec.head_slice(&seq, kv, true);
            let rs = spec.row_stat_slice(&seq, h);
            out.o.slice_mut(qs.clone()).assign(&b.o);
            out.dq.slice_mut(qs).assign(&b.dq);
            out.lse.slice_mut(rs.clone()).assign(&b.lse);
            out.delta.slice_mut(rs).assign(&b.delta);
            Zip::from(out.dk.slice_mut(ks.clone())).and(&b.dk.into_dyn()).for_each(|a, x| *a += x);
            Zip::from(out.dv.slice_mut(ks.clone())).and(&b.dv.into_dyn()).for_each(|a, x| *a += x);
            Zip::from(dk_abs.slice_mut(ks.clone())).and(&grads.dk.into_dyn()).for_each(|a, x| *a += f(x).abs());
            Zip::from(dv_abs.slice_mut(ks)).and(&grads.dv.into_dyn()).for_each(|a, x| *a += f(x).abs());
        }
    }
    let g = gamma(spec.group_size());
    Zip::from(&mut out.dk).and(&dk_abs).for_each(|b, a| *b += g * a * SECOND_ORDER_FACTOR);
    Zip::from(&mut out.dv).and(&dv_abs).for_each(|b, a| *b += g * a * SECOND_ORDER_FACTOR);
    Ok(out)
}

/// Compares one candidate output with the exact one under `bound`.
pub fn compare(
    output: &'static str,
    candidate: &ArrayD<f64>,
    exact: &ArrayD<Mp>,
    bound: &ArrayD<f64>,
) -> Result<OutputRatio, Violation> {
    const T: &str = "f64_oracle_within_bound";
    let mut worst = OutputRatio { output, max_ratio: 0.0, index: vec![] };
    for ((idx, c), (e, b)) in candidate.indexed_iter().zip(exact.iter().zip(bound.iter())) {
        let index = idx.slice().to_vec();
        if !c.is_finite() || !e.is_finite() {
            if *c != e.to_f64() || e.is_nan() {
                return Err(Violation::NonFinite {
                    theorem: T,
                    quantity: output,
                    found: c.to_string(),
                    expected: e.to_string(),
                    index,
                });
            }
            continue;
        }
        let err = (Mp::new(*c, e.ctx()) - e.clone()).abs().to_f64();
        let ratio = if err == 0.0 { 0.0 } else { err / b };
        if ratio > 1.0 {
            return Err(Violation::Bound { theorem: T, quantity: output, error: err, bound: *b, ratio, index });
        }
        if ratio > worst.max_ratio {
            worst = OutputRatio { output, max_ratio: ratio, index };
        }
    }
    Ok(worst)
}

/// **Theorem (first link of the trust chain).** For finite f64 inputs satisfying the model's
/// hypothesis, every output of the f64 oracle (`O`, `LSE`, `D`, `dQ`, `dK`, `dV`) differs from
/// the MPFR oracle's by at most the bound of the model in the module docs, element by element.
/// The MPFR oracle at `precision ≥ 256` bits is exact to far below these bounds (`2^-200`
/// relative, by the theorems of [`crate::online`] and [`crate::backward`]).
pub fn f64_oracle_within_bound(
    candidate: F64Candidate<'_>,
    spec: &AttentionSpec,
    q: ArrayViewD<'_, f64>,
    k: ArrayViewD<'_, f64>,
    v: ArrayViewD<'_, f64>,
    d_out: ArrayViewD<'_, f64>,
    precision: Precision,
) -> Result<BoundReport, Violation> {
    let hyp = |e: OracleError| Violation::Hypothesis { theorem: "f64_oracle_within_bound", reason: e.to_string() };
    let bounds = problem_bounds(spec, q.view(), k.view(), v.view(), d_out.view(), precision)?;
    let exact =
        attnproof_oracle::backward_mpfr(spec, q.view(), k.view(), v.view(), d_out.view(), precision).map_err(hyp)?;
    let got = candidate(spec, q, k, v, d_out).map_err(hyp)?;
    Ok(BoundReport {
        outputs: vec![
            compare("O", &got.forward.o, &exact.forward.o, &bounds.o)?,
            compare("LSE", &got.forward.lse, &exact.forward.lse, &bounds.lse)?,
            compare("D", &got.delta, &exact.delta, &bounds.delta)?,
            compare("dQ", &got.dq, &exact.dq, &bounds.dq)?,
            compare("dK", &got.dk, &exact.dk, &bounds.dk)?,
            compare("dV", &got.dv, &exact.dv, &bounds.dv)?,
        ],
    })
}
