//! Theorems of HiLS (E21): the slope key is the gradient of the chunk log-mass at the landmark,
//! the Taylor intercept is the landmark entropy, the router's error shrinks quadratically near
//! the landmark, and the factorized output with exact chunk masses is dense attention over the
//! keys it reads.

use attnproof_oracle::hils::{
    ChunkMass, ChunkSummary, HilsConfig, HilsInputs, HilsOutput, chunk_keys, eligible_chunks, local_window_start,
};
use attnproof_oracle::{Mp, OracleError, Precision, Real};
use ndarray::{Array1, Array2, ArrayView1, ArrayView2};

use crate::definition;
use crate::residual::{Agreement, Bits, Violation, agree};

/// A chunk summarizer under test: `(landmark [d], keys [n, d])` ↦ summary.
pub type SummarizeFn<'a> = &'a dyn Fn(ArrayView1<'_, Mp>, ArrayView2<'_, Mp>) -> Result<ChunkSummary<Mp>, OracleError>;
/// A router score under test: `(query [d], summary)` ↦ `r`.
pub type RouterFn<'a> = &'a dyn Fn(ArrayView1<'_, Mp>, &ChunkSummary<Mp>) -> Result<Mp, OracleError>;
/// A factorized output under test.
pub type FactorizedFn<'a> =
    &'a dyn Fn(HilsInputs<'_, Mp>, ArrayView2<'_, i32>, HilsConfig, ChunkMass) -> Result<HilsOutput<Mp>, OracleError>;

fn ctx_of(x: &Array2<Mp>) -> Precision {
    x.first().map(|v| v.ctx()).unwrap_or_default()
}

/// The oracle's chunk summary.
pub fn oracle_summarize(
    landmark: ArrayView1<'_, Mp>,
    keys: ArrayView2<'_, Mp>,
) -> Result<ChunkSummary<Mp>, OracleError> {
    let ctx = keys.first().map(|v| v.ctx()).unwrap_or_default();
    attnproof_oracle::hils::summarize_chunk(landmark, keys, ctx)
}

/// The oracle's router score.
pub fn oracle_router(query: ArrayView1<'_, Mp>, summary: &ChunkSummary<Mp>) -> Result<Mp, OracleError> {
    attnproof_oracle::hils::router_score(query, summary, summary.entropy.ctx())
}

/// The oracle's factorized output.
pub fn oracle_factorized(
    inputs: HilsInputs<'_, Mp>,
    retrieved: ArrayView2<'_, i32>,
    config: HilsConfig,
    mass: ChunkMass,
) -> Result<HilsOutput<Mp>, OracleError> {
    let ctx = inputs.key.first().map(|v| v.ctx()).unwrap_or_default();
    attnproof_oracle::hils::factorized_output(inputs, retrieved, config, mass, ctx)
}

/// One chunk of keys and its landmark query, in MPFR.
#[derive(Clone, Debug)]
pub struct ChunkCase {
    /// Keys `[n, d]`.
    pub keys: Array2<Mp>,
    /// Landmark query `q'_b`, `[d]`.
    pub landmark: Array1<Mp>,
}

/// `f_b(q) = log Σ_j e^{q·k_j/√d}` straight from the definition (no max shift).
pub fn definition_log_mass(query: ArrayView1<'_, Mp>, keys: ArrayView2<'_, Mp>) -> Mp {
    let ctx = ctx_of(&keys.to_owned());
    let scale = Mp::one(ctx) / Mp::from_f64(keys.ncols() as f64, ctx).sqrt();
    let query = query.to_owned().insert_axis(ndarray::Axis(0));
    let visible = Array2::from_elem((1, keys.nrows()), true);
    let scores = definition::scores(query.view(), keys, &scale, visible.view());
    definition::log_sum_exp(scores.view(), visible.view(), ctx)[0].clone()
}

fn summary_of(
    theorem: &'static str,
    summarize: SummarizeFn<'_>,
    case: &ChunkCase,
) -> Result<ChunkSummary<Mp>, Violation> {
    summarize(case.landmark.view(), case.keys.view())
        .map_err(|e| Violation::Hypothesis { theorem, reason: e.to_string() })
}

/// **Theorem (E21, gradient identity).** `∇f_b(q'_b) = k'_b/√d`: each component of the slope key
/// under test, divided by `√d`, equals the central difference `(f_b(q'+h e_c) − f_b(q'−h e_c))/2h`
/// of the definition's `f_b`, with `h = 2^-step_bits`. Hypotheses: the precision exceeds
/// `2·step_bits + required` bits, so that the `O(h²)` truncation (the third derivatives of `f_b`
/// are bounded by `max‖k_j‖³/d^{3/2}`, small for the keys used) and the `2^-prec/h` cancellation
/// both stay below `2^-required`.
pub fn slope_key_is_gradient(
    summarize: SummarizeFn<'_>,
    case: &ChunkCase,
    step_bits: u32,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "slope_key_is_gradient (E21)";
    let ctx = ctx_of(&case.keys);
    if (ctx.0 as f64) < 2.0 * step_bits as f64 + required.0 {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("precision {} too low", ctx.0) });
    }
    let summary = summary_of(T, summarize, case)?;
    let head_dim = case.keys.ncols();
    if summary.slope_key.len() != head_dim {
        return Err(Violation::Hypothesis { theorem: T, reason: "slope key has the wrong length".into() });
    }
    let scale = Mp::one(ctx) / Mp::from_f64(head_dim as f64, ctx).sqrt();
    let gradient = summary.slope_key.mapv(|k| k * scale.clone());
    let h = Mp(rug::Float::with_val(ctx.0, rug::Float::i_exp(1, -(step_bits as i32))));
    let numeric = Array1::from_shape_fn(head_dim, |c| {
        let moved = |delta: &Mp| {
            let mut q = case.landmark.clone();
            q[c] = q[c].clone() + delta.clone();
            definition_log_mass(q.view(), case.keys.view())
        };
        (moved(&h) - moved(&-h.clone())) / (h.clone() + h.clone())
    });
    agree(T, "k'/√d", &gradient, &numeric, required)
}

/// **Theorem (E21, intercept identity).** `f_b(q'_b) − q'_b·k'_b/√d = H(p_b) = −Σ_j p_bj log p_bj`:
/// the entropy under test equals the intercept computed from the definition's `f_b` and the slope
/// key under test; the summary's `f_b(q'_b)` and `p_b` equal the definition's too. Exact in real
/// arithmetic, since `log p_bj = q'·k_j/√d − f_b(q')` and `Σ_j p_bj = 1`. Hypotheses: none.
pub fn intercept_is_entropy(
    summarize: SummarizeFn<'_>,
    case: &ChunkCase,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "intercept_is_entropy (E21)";
    let ctx = ctx_of(&case.keys);
    let summary = summary_of(T, summarize, case)?;
    let head_dim = case.keys.ncols();
    let scale = Mp::one(ctx) / Mp::from_f64(head_dim as f64, ctx).sqrt();
    let log_mass = definition_log_mass(case.landmark.view(), case.keys.view());
    let slope_term =
        case.landmark.iter().zip(&summary.slope_key).fold(Mp::zero(ctx), |acc, (q, k)| acc + q.clone() * k.clone());
    let intercept = log_mass.clone() - slope_term * scale.clone();
    let query = case.landmark.clone().insert_axis(ndarray::Axis(0));
    let visible = Array2::from_elem((1, case.keys.nrows()), true);
    let p = definition::probabilities(
        definition::scores(query.view(), case.keys.view(), &scale, visible.view()).view(),
        visible.view(),
        ctx,
    );
    let p = p.row(0).to_owned();
    Ok(agree(T, "H(p_b)", &ndarray::arr0(summary.entropy), &ndarray::arr0(intercept), required)?
        .and(agree(T, "f_b(q'_b)", &ndarray::arr0(summary.landmark_log_mass), &ndarray::arr0(log_mass), required)?)
        .and(agree(T, "p_b", &summary.landmark_probabilities, &p, required)?))
}

/// What the quadratic-error theorem measured.
#[derive(Clone, Debug, PartialEq)]
pub struct TaylorRatios {
    /// `log2 ε` of each step, the first `ε₀` and then halvings.
    pub step_exponents: Vec<i32>,
    /// `err(ε)/err(ε/2)` for consecutive steps.
    pub ratios: Vec<f64>,
}

/// **Theorem (E21, the router is a first-order Taylor expansion).** Along `q = q'_b + εu`, let
/// `g(ε) = f_b(q'_b + εu)`. Then `g'(0) = u·k'_b/√d` and `g''(0) = Var_{p_b}(u·k_j)/d`, so if the
/// router is exact to first order, `r(q) = g(0) + ε g'(0)` and
/// `err(ε) = |g(ε) − r(q)| = ε² g''(0)/2 + ε³ g'''(ξ)/6`. Consecutive halvings then give
/// `err(ε)/err(ε/2) = 4 (1 + ε g'''/(3g'')) / (1 + ε g'''/(6g'')) + O(ε²)`, which tends to 4. With
/// `R = (max_j u·k_j − min_j u·k_j)/√d`, `|g'''| ≤ R³` (a third central moment of a variable of
/// range `R`), so choosing `ε₀ ≤ g''(0)/(8R³)` bounds the two corrections by `1/24` and `1/48`,
/// which keeps every ratio in `[4·(23/24)/(49/48), 4·(25/24)/(47/48)] ≈ [3.76, 4.26]`, inside
/// `[3.5, 4.5]`. The theorem takes `ε₀` as the largest power of two below
/// `min(2^-10, g''/(8R³))`, measures `steps` halvings, and requires every ratio in `[3.5, 4.5]`.
/// A router missing the intercept has `err(ε) → H(p_b) ≠ 0` and ratios near 1.
/// Hypotheses: `g''(0) > 0` (not all keys project alike on `u`), `steps ≥ 2`, and
/// `ε₀² g''(0) ≥ 2^-100`, so that each error stands more than 100 bits above the 256-bit
/// rounding of `f_b`.
pub fn router_error_is_quadratic(
    summarize: SummarizeFn<'_>,
    router: RouterFn<'_>,
    case: &ChunkCase,
    direction: &Array1<Mp>,
    steps: usize,
) -> Result<TaylorRatios, Violation> {
    const T: &str = "router_error_is_quadratic (E21)";
    let ctx = ctx_of(&case.keys);
    let head_dim = case.keys.ncols();
    if direction.len() != head_dim || steps < 2 {
        return Err(Violation::Hypothesis { theorem: T, reason: "direction must have length d; steps ≥ 2".into() });
    }
    let summary = summary_of(T, summarize, case)?;
    let scale = Mp::one(ctx) / Mp::from_f64(head_dim as f64, ctx).sqrt();
    // g''(0) and R from the definition's p_b.
    let query = case.landmark.clone().insert_axis(ndarray::Axis(0));
    let visible = Array2::from_elem((1, case.keys.nrows()), true);
    let p = definition::probabilities(
        definition::scores(query.view(), case.keys.view(), &scale, visible.view()).view(),
        visible.view(),
        ctx,
    );
    let projections: Vec<Mp> = case
        .keys
        .rows()
        .into_iter()
        .map(|k| k.iter().zip(direction).fold(Mp::zero(ctx), |a, (x, u)| a + x.clone() * u.clone()) * scale.clone())
        .collect();
    let mean = projections.iter().zip(p.row(0)).fold(Mp::zero(ctx), |a, (x, w)| a + x.clone() * w.clone());
    let curvature = projections.iter().zip(p.row(0)).fold(Mp::zero(ctx), |a, (x, w)| {
        let centered = x.clone() - mean.clone();
        a + w.clone() * centered.clone() * centered
    });
    let range =
        projections.iter().fold(Mp::zero(ctx), |a, x| a.max((x.clone() - mean.clone()).abs())) * Mp::from_f64(2.0, ctx);
    let bound = curvature.clone() / (Mp::from_f64(8.0, ctx) * range.clone() * range.clone() * range);
    let first_exponent = bound.to_f64().log2().floor().min(-10.0);
    if !first_exponent.is_finite() || curvature.to_f64() * (2f64).powf(2.0 * first_exponent) < 2f64.powi(-100) {
        return Err(Violation::Hypothesis {
            theorem: T,
            reason: format!("curvature g''(0) = {} too small for a measurable second-order error", curvature.to_f64()),
        });
    }
    let first_exponent = first_exponent as i32;
    let step_exponents: Vec<i32> = (0..=steps as i32).map(|n| first_exponent - n).collect();
    let mut errors = Vec::with_capacity(step_exponents.len());
    for &e in &step_exponents {
        let epsilon = Mp(rug::Float::with_val(ctx.0, rug::Float::i_exp(1, e)));
        let q = Array1::from_shape_fn(head_dim, |c| case.landmark[c].clone() + epsilon.clone() * direction[c].clone());
        let r =
            router(q.view(), &summary).map_err(|err| Violation::Hypothesis { theorem: T, reason: err.to_string() })?;
        errors.push((definition_log_mass(q.view(), case.keys.view()) - r).abs());
    }
    let ratios: Vec<f64> = errors.windows(2).map(|w| (w[0].clone() / w[1].clone()).to_f64()).collect();
    if let Some(n) = ratios.iter().position(|ratio| !(3.5..=4.5).contains(ratio)) {
        return Err(Violation::Bound {
            theorem: T,
            quantity: "err(ε)/err(ε/2) − 4",
            error: (ratios[n] - 4.0).abs(),
            bound: 0.5,
            ratio: (ratios[n] - 4.0).abs() / 0.5,
            index: vec![n],
        });
    }
    Ok(TaylorRatios { step_exponents, ratios })
}

/// A sequence for the factorized output, with its chunk selection, in MPFR.
#[derive(Clone, Debug)]
pub struct HilsCase {
    /// Queries `[n, d]`.
    pub query: Array2<Mp>,
    /// Keys `[n, d]`.
    pub key: Array2<Mp>,
    /// Values `[n, dv]`.
    pub value: Array2<Mp>,
    /// Landmarks `[⌈n/C⌉, d]`.
    pub landmarks: Array2<Mp>,
    /// Retrieved chunks `[n, K]` (index-list convention, eligible chunks only).
    pub retrieved: Array2<i32>,
    /// Chunking and window.
    pub config: HilsConfig,
}

impl HilsCase {
    /// Borrowed inputs.
    pub fn inputs(&self) -> HilsInputs<'_, Mp> {
        HilsInputs {
            query: self.query.view(),
            key: self.key.view(),
            value: self.value.view(),
            landmarks: self.landmarks.view(),
        }
    }
}

/// **Theorem (E21 with E12, consistency of the factorized output).** If every retrieved chunk's
/// surrogate `Ẑ_ib` is replaced by its exact mass `Z_ib = e^{f_b(q_i)}`, then
/// `Ẑ_ib ō_ib = Σ_{j∈B_b} e^{s_ij} v_j` and the factorized output is dense attention (from the
/// definition, scale `1/√d`) over the keys of the local window and of the retrieved chunks,
/// which are disjoint (E12): `O` and `LSE` agree. Hypotheses: `retrieved` follows the index-list
/// convention and names only chunks eligible for their query (entirely before its window).
pub fn exact_masses_give_dense_attention(
    output: FactorizedFn<'_>,
    case: &HilsCase,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "exact_masses_give_dense_attention (E21, E12)";
    let (seq_len, head_dim) = case.query.dim();
    let ctx = ctx_of(&case.key);
    let mut visible = Array2::from_elem((seq_len, seq_len), false);
    for i in 0..seq_len {
        for j in local_window_start(i, case.config)..=i {
            visible[[i, j]] = true;
        }
        let row = case.retrieved.row(i).to_vec();
        for b in row.into_iter().filter(|&b| b != -1) {
            let b = usize::try_from(b).map_err(|e| Violation::Hypothesis { theorem: T, reason: e.to_string() })?;
            if !eligible_chunks(i, case.config).contains(&b) {
                return Err(Violation::Hypothesis { theorem: T, reason: format!("chunk {b} not eligible for {i}") });
            }
            for j in chunk_keys(b, seq_len, case.config) {
                visible[[i, j]] = true;
            }
        }
    }
    let found = output(case.inputs(), case.retrieved.view(), case.config, ChunkMass::Exact)
        .map_err(|e| Violation::Hypothesis { theorem: T, reason: e.to_string() })?;
    let scale = Mp::one(ctx) / Mp::from_f64(head_dim as f64, ctx).sqrt();
    let (o, lse) = definition::forward(case.query.view(), case.key.view(), case.value.view(), &scale, visible.view());
    Ok(agree(T, "O", &found.o, &o, required)?.and(agree(T, "LSE", &found.lse, &lse, required)?))
}
