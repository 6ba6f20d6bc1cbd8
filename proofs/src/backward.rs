//! Theorems of the backward pass: `P = exp(S − LSE)` (E10), the two forms of `D` (E7), the
//! row sums and constant-row property of `dS` (E8), and agreement of dQ, dK, dV (E6–E9, GQA
//! sums included) with central finite differences of the forward pass in MPFR.

use attnproof_oracle::dense::{self, HeadForward, HeadGradients, HeadInputs};
use attnproof_oracle::{AttentionSpec, DenseConfig, Forward, Gradients, Mp, OracleError, Precision, Qkv, Real};
use ndarray::{Array1, Array2, ArrayD, ArrayView2, Zip};

use crate::definition;
use crate::residual::{Agreement, Bits, Violation, agree, bits_of};

/// One head's inputs and upstream gradient, in MPFR.
#[derive(Clone, Debug)]
pub struct HeadCase {
    /// Queries `[Lq, d]`.
    pub q: Array2<Mp>,
    /// Keys `[Lk, d]`.
    pub k: Array2<Mp>,
    /// Values `[Lk, dv]`.
    pub v: Array2<Mp>,
    /// Upstream gradient `[Lq, dv]`.
    pub d_out: Array2<Mp>,
    /// Visibility `[Lq, Lk]`.
    pub visible: Array2<bool>,
    /// Softmax scale.
    pub scale: Mp,
}

impl HeadCase {
    /// Borrowed head inputs.
    pub fn inputs(&self) -> HeadInputs<'_, Mp> {
        HeadInputs { q: self.q.view(), k: self.k.view(), v: self.v.view(), visible: self.visible.view() }
    }
    /// The precision of the case.
    pub fn ctx(&self) -> Precision {
        self.scale.ctx()
    }
    /// Scores from the definition (E1).
    pub fn scores(&self) -> Array2<Mp> {
        definition::scores(self.q.view(), self.k.view(), &self.scale, self.visible.view())
    }
    /// `P` from the definition.
    pub fn probabilities(&self) -> Array2<Mp> {
        definition::probabilities(self.scores().view(), self.visible.view(), self.ctx())
    }
    /// `dP = dO Vᵀ` from the definition (E6).
    pub fn d_probabilities(&self) -> Array2<Mp> {
        definition::product(self.d_out.view(), self.v.t(), self.ctx())
    }
}

/// A per-head forward under test.
pub type HeadForwardFn<'a> = &'a dyn Fn(&HeadCase) -> HeadForward<Mp>;
/// A per-head backward under test (given the forward it should use).
pub type HeadBackwardFn<'a> = &'a dyn Fn(&HeadCase, &HeadForward<Mp>) -> HeadGradients<Mp>;

/// The oracle's per-head forward.
pub fn oracle_head_forward(case: &HeadCase) -> HeadForward<Mp> {
    dense::head_forward(case.inputs(), &case.scale, DenseConfig::default(), case.ctx())
}

/// The oracle's per-head backward.
pub fn oracle_head_backward(case: &HeadCase, fwd: &HeadForward<Mp>) -> HeadGradients<Mp> {
    dense::head_backward(case.inputs(), case.d_out.view(), fwd, &case.scale, DenseConfig::default(), case.ctx())
}

/// **Theorem (E10).** With `LSE` from the forward under test, `exp(S_ij − LSE_i)` on visible
/// pairs (0 elsewhere) equals the softmax probability `P_ij` of the definition; fully masked
/// rows give 0, never NaN. Hypotheses: none.
pub fn probabilities_from_lse(
    forward: HeadForwardFn<'_>,
    case: &HeadCase,
    required: Bits,
) -> Result<Agreement, Violation> {
    let fwd = forward(case);
    let s = case.scores();
    let p = dense::probabilities_from_lse(s.view(), fwd.lse.view(), case.visible.view(), case.ctx());
    agree("probabilities_from_lse (E10)", "P", &p, &case.probabilities(), required)
}

/// **Theorem (E7).** The `D` returned by the backward under test, `D_i = dO_i·O_i`, equals
/// `Σ_j P_ij dP_ij` with `P` and `dP` from the definition. Hypotheses: none (fully masked rows
/// give 0 on both sides).
pub fn delta_two_forms(
    forward: HeadForwardFn<'_>,
    backward: HeadBackwardFn<'_>,
    case: &HeadCase,
    required: Bits,
) -> Result<Agreement, Violation> {
    let grads = backward(case, &forward(case));
    let expected =
        dense::delta_from_probabilities(case.probabilities().view(), case.d_probabilities().view(), case.ctx());
    agree("delta_two_forms (E7)", "D", &grads.delta, &expected, required)
}

/// A score-gradient rule under test: `(P, dP, D) ↦ dS`.
pub type ScoreGradientFn<'a> = &'a dyn Fn(ArrayView2<'_, Mp>, ArrayView2<'_, Mp>, &Array1<Mp>) -> Array2<Mp>;

/// **Theorem (E8, row sums).** For `P` with rows summing to 1 (or 0 for fully masked rows),
/// any `dP`, and `D_i = Σ_j P_ij dP_ij`, the rows of `dS` sum to 0.
/// Hypotheses: the rows of `p` sum to 1 or are all 0.
pub fn score_gradient_rows_sum_to_zero(
    rule: ScoreGradientFn<'_>,
    p: ArrayView2<'_, Mp>,
    dp: ArrayView2<'_, Mp>,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "score_gradient_rows_sum_to_zero (E8)";
    let ctx = p.first().map(|x| x.ctx()).unwrap_or_default();
    check_stochastic(T, p, required)?;
    let delta = dense::delta_from_probabilities(p, dp, ctx);
    let sums = dense::row_totals(rule(p, dp, &delta).view(), ctx);
    agree(T, "row sums of dS", &sums, &Array1::from_elem(sums.len(), Mp::zero(ctx)), required)
}

/// **Theorem (E8, constant rows).** If row `i` of `dP` is the constant `c_i`, then
/// `D_i = c_i` and `dS_i = 0`. Hypotheses: the rows of `p` sum to 1 or are all 0.
pub fn constant_dp_gives_zero_ds(
    rule: ScoreGradientFn<'_>,
    p: ArrayView2<'_, Mp>,
    c: &Array1<Mp>,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "constant_dp_gives_zero_ds (E8)";
    let ctx = p.first().map(|x| x.ctx()).unwrap_or_default();
    check_stochastic(T, p, required)?;
    let dp = Array2::from_shape_fn(p.dim(), |(i, _)| c[i].clone());
    let delta = dense::delta_from_probabilities(p, dp.view(), ctx);
    let ds = rule(p, dp.view(), &delta);
    agree(T, "dS", &ds, &Array2::from_elem(p.dim(), Mp::zero(ctx)), required)
}

fn check_stochastic(theorem: &'static str, p: ArrayView2<'_, Mp>, required: Bits) -> Result<(), Violation> {
    let ctx = p.first().map(|x| x.ctx()).unwrap_or_default();
    for (i, total) in dense::row_totals(p, ctx).iter().enumerate() {
        let off = (total.clone() - Mp::one(ctx)).abs().min_with(total.abs());
        if bits_of(&off).0 < required.0 {
            return Err(Violation::Hypothesis { theorem, reason: format!("row {i} of P sums to {total}, not 1 or 0") });
        }
    }
    Ok(())
}

trait MinWith {
    fn min_with(self, other: Self) -> Self;
}
impl MinWith for Mp {
    fn min_with(self, other: Mp) -> Mp {
        if other < self { other } else { self }
    }
}

/// A whole attention problem in MPFR with an upstream gradient.
#[derive(Clone, Debug)]
pub struct ProblemCase {
    /// The spec.
    pub spec: AttentionSpec,
    /// Queries.
    pub q: ArrayD<Mp>,
    /// Keys.
    pub k: ArrayD<Mp>,
    /// Values.
    pub v: ArrayD<Mp>,
    /// Upstream gradient (shape of O).
    pub d_out: ArrayD<Mp>,
    /// Precision.
    pub precision: Precision,
}

impl ProblemCase {
    /// Borrowed inputs.
    pub fn qkv(&self) -> Qkv<'_, Mp> {
        Qkv { q: self.q.view(), k: self.k.view(), v: self.v.view() }
    }
}

/// A whole-problem forward under test.
pub type ForwardFn<'a> = &'a dyn Fn(&AttentionSpec, Qkv<'_, Mp>, Precision) -> Result<Forward<Mp>, OracleError>;
/// A whole-problem backward under test.
pub type BackwardFn<'a> =
    &'a dyn Fn(&AttentionSpec, Qkv<'_, Mp>, &ArrayD<Mp>, Precision) -> Result<Gradients<Mp>, OracleError>;

/// The oracle's whole-problem forward.
pub fn oracle_forward(
    spec: &AttentionSpec,
    qkv: Qkv<'_, Mp>,
    precision: Precision,
) -> Result<Forward<Mp>, OracleError> {
    attnproof_oracle::forward(spec, qkv, DenseConfig::default(), precision)
}

/// The oracle's whole-problem backward.
pub fn oracle_backward(
    spec: &AttentionSpec,
    qkv: Qkv<'_, Mp>,
    d_out: &ArrayD<Mp>,
    precision: Precision,
) -> Result<Gradients<Mp>, OracleError> {
    attnproof_oracle::backward(spec, qkv, d_out.view(), DenseConfig::default(), precision)
}

/// Which input a finite difference perturbs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Input {
    Q,
    K,
    V,
}

/// **Theorem (E6–E9).** For the loss `L = Σ dO ∘ O(Q, K, V)`, the gradients dQ, dK, dV of the
/// backward under test (dK, dV summed over each KV head's query heads) equal the central
/// differences `(L(x + h) − L(x − h)) / 2h` of the forward under test, element by element, with
/// `h = 2^-step_bits`. Hypotheses: the precision exceeds `2·step_bits + required` bits, so that
/// the `O(h²)` truncation and the `O(2^-prec / h)` cancellation both stay below `2^-required`
/// (for logits of moderate size; the tests use `|α q·k| ≤ 100`, whose third derivatives are far
/// below `2^{2·step_bits − required}`).
pub fn backward_matches_finite_differences(
    forward: ForwardFn<'_>,
    backward: BackwardFn<'_>,
    case: &ProblemCase,
    step_bits: u32,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "backward_matches_finite_differences (E6-E9)";
    let prec = case.precision;
    if (prec.0 as f64) < 2.0 * step_bits as f64 + required.0 {
        return Err(Violation::Hypothesis {
            theorem: T,
            reason: format!("precision {} too low for step 2^-{step_bits}", prec.0),
        });
    }
    let oracle_err = |e: OracleError| Violation::Hypothesis { theorem: T, reason: e.to_string() };
    let grads = backward(&case.spec, case.qkv(), &case.d_out, prec).map_err(oracle_err)?;
    let loss = |q: &ArrayD<Mp>, k: &ArrayD<Mp>, v: &ArrayD<Mp>| -> Result<Mp, Violation> {
        let fwd = forward(&case.spec, Qkv { q: q.view(), k: k.view(), v: v.view() }, prec).map_err(oracle_err)?;
        Ok(Zip::from(&fwd.o).and(&case.d_out).fold(Mp::zero(prec), |acc, o, g| acc + o.clone() * g.clone()))
    };
    let h = Mp(rug::Float::with_val(prec.0, rug::Float::i_exp(1, -(step_bits as i32))));
    let two_h = h.clone() + h.clone();
    let mut agreement = Agreement::exact();
    for (which, name, analytic) in
        [(Input::Q, "dQ", &grads.dq), (Input::K, "dK", &grads.dk), (Input::V, "dV", &grads.dv)]
    {
        let base = match which {
            Input::Q => &case.q,
            Input::K => &case.k,
            Input::V => &case.v,
        };
        let mut numeric = ArrayD::from_elem(base.raw_dim(), Mp::zero(prec));
        for (idx, x) in base.indexed_iter() {
            let eval = |delta: &Mp| -> Result<Mp, Violation> {
                let mut moved = base.clone();
                moved[&idx] = x.clone() + delta.clone();
                match which {
                    Input::Q => loss(&moved, &case.k, &case.v),
                    Input::K => loss(&case.q, &moved, &case.v),
                    Input::V => loss(&case.q, &case.k, &moved),
                }
            };
            let up = eval(&h)?;
            let down = eval(&-h.clone())?;
            numeric[&idx] = (up - down) / two_h.clone();
        }
        agreement = agreement.and(agree(T, name, analytic, &numeric, required)?);
    }
    Ok(agreement)
}
