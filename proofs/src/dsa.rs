//! Theorems of DSA (E16): Hadamard invariance of the lightning indexer, exactness of the causal
//! top-κ selection, token-sparse attention with everything selected equals dense causal
//! attention, the indexer's KL loss (non-negative, the definition, zero at the teacher), and its gradients with
//! respect to the indexer's inputs (central differences, the support held fixed).

use attnproof_oracle::dsa::{
    IndexerInputs, IndexerLoss, IndexerLossGradients, LossSupport, TokenSparseInputs, TokenSparseOutput, TopKConfig,
};
use attnproof_oracle::{AttentionSpec, DenseConfig, Layout, Mask, Mp, OracleError, Precision, Qkv, Real};
use ndarray::{Array2, Array3, ArrayView2, Axis};

use crate::definition;
use crate::residual::{Agreement, Bits, Violation, agree, bits_of};

/// An indexer under test: inputs ↦ scores `[T, T]`.
pub type IndexerFn<'a> = &'a dyn Fn(IndexerInputs<'_, Mp>) -> Result<Array2<Mp>, OracleError>;
/// A causal top-κ under test: scores `[T, T]` ↦ selection `[T, κ]`.
pub type TopKFn<'a> = &'a dyn Fn(ArrayView2<'_, Mp>, TopKConfig) -> Result<Array2<i32>, OracleError>;
/// Token-sparse attention under test (scale `1/√d`).
pub type TokenSparseFn<'a> = &'a dyn Fn(TokenSparseInputs<'_, Mp>) -> Result<TokenSparseOutput<Mp>, OracleError>;
/// An indexer loss under test: `(teacher [T, T], index scores [T, T])` ↦ loss.
pub type IndexerLossFn<'a> = &'a dyn Fn(ArrayView2<'_, Mp>, ArrayView2<'_, Mp>) -> Result<IndexerLoss<Mp>, OracleError>;

/// The oracle's indexer.
pub fn oracle_indexer(inputs: IndexerInputs<'_, Mp>) -> Result<Array2<Mp>, OracleError> {
    let ctx = inputs.q_index.first().map(|x| x.ctx()).unwrap_or_default();
    attnproof_oracle::dsa::indexer_scores(inputs, ctx)
}

/// The oracle's token-sparse attention with the default scale `1/√d`.
pub fn oracle_token_sparse(inputs: TokenSparseInputs<'_, Mp>) -> Result<TokenSparseOutput<Mp>, OracleError> {
    let ctx = inputs.query.first().map(|x| x.ctx()).unwrap_or_default();
    attnproof_oracle::dsa::token_sparse_attention(inputs, Default::default(), ctx)
}

/// The oracle's indexer loss.
pub fn oracle_indexer_loss(
    teacher: ArrayView2<'_, Mp>,
    scores: ArrayView2<'_, Mp>,
) -> Result<IndexerLoss<Mp>, OracleError> {
    let ctx = teacher.first().map(|x| x.ctx()).unwrap_or_default();
    attnproof_oracle::dsa::indexer_kl_loss(teacher, scores, ctx)
}

/// An indexer loss with its gradients under test: `(inputs, teacher [T, T], support)` ↦ loss and gradients.
pub type IndexerLossGradientsFn<'a> = &'a dyn Fn(
    IndexerInputs<'_, Mp>,
    ArrayView2<'_, Mp>,
    LossSupport<'_>,
) -> Result<(IndexerLoss<Mp>, IndexerLossGradients<Mp>), OracleError>;

/// The oracle's indexer loss with its gradients.
pub fn oracle_indexer_loss_and_gradients(
    inputs: IndexerInputs<'_, Mp>,
    teacher: ArrayView2<'_, Mp>,
    support: LossSupport<'_>,
) -> Result<(IndexerLoss<Mp>, IndexerLossGradients<Mp>), OracleError> {
    let ctx = teacher.first().map(|x| x.ctx()).unwrap_or_default();
    attnproof_oracle::dsa::indexer_loss_and_gradients(inputs, teacher, support, ctx)
}

/// The lightning indexer's tensors, owned, in MPFR.
#[derive(Clone, Debug)]
pub struct IndexerCase {
    /// `q^I`, `[T, H_I, d_I]`.
    pub q_index: Array3<Mp>,
    /// `w`, `[T, H_I]`.
    pub weights: Array2<Mp>,
    /// `k^I`, `[T, d_I]`.
    pub k_index: Array2<Mp>,
}

impl IndexerCase {
    /// Borrowed indexer inputs.
    pub fn inputs(&self) -> IndexerInputs<'_, Mp> {
        IndexerInputs { q_index: self.q_index.view(), weights: self.weights.view(), k_index: self.k_index.view() }
    }
}

/// The orthonormal Sylvester–Hadamard matrix of order `dim`: `H_1 = [1]`,
/// `H_{2m} = [[H_m, H_m], [H_m, −H_m]]`, scaled by `1/√dim` (in MPFR at `ctx`). `None` unless
/// `dim` is a power of two.
pub fn sylvester_hadamard(dim: usize, ctx: Precision) -> Option<Array2<Mp>> {
    if !dim.is_power_of_two() {
        return None;
    }
    let scale = Mp::one(ctx) / Mp::from_f64(dim as f64, ctx).sqrt();
    // Entry (i, j) of the unscaled Sylvester matrix is (−1)^{popcount(i & j)}.
    Some(Array2::from_shape_fn(
        (dim, dim),
        |(i, j)| {
            if (i & j).count_ones() % 2 == 0 { scale.clone() } else { -scale.clone() }
        },
    ))
}

/// **Theorem (E16, Hadamard invariance).** For an orthonormal `R ∈ R^{d_I×d_I}`, replacing every
/// indexer query `q^I_ta` by `R q^I_ta` and every indexer key `k^I_s` by `R k^I_s` leaves the
/// scores `I_ts` unchanged, since `(Rq)·(Rk) = qᵀRᵀRk = q·k` and ReLU and the weights act after
/// the dot product. Hypotheses: `rotation` is `d_I × d_I` (its orthonormality is the statement's
/// premise, not checked: a non-orthonormal `R` is what the theorem rejects).
pub fn hadamard_invariance(
    indexer: IndexerFn<'_>,
    case: &IndexerCase,
    rotation: &Array2<Mp>,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "hadamard_invariance (E16)";
    let index_dim = case.k_index.ncols();
    if rotation.dim() != (index_dim, index_dim) {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("rotation is not {index_dim}×{index_dim}") });
    }
    let ctx = rotation.first().map(|x| x.ctx()).unwrap_or_default();
    let oracle_err = |e: OracleError| Violation::Hypothesis { theorem: T, reason: e.to_string() };
    // Row vectors rotate as xᵀ ↦ xᵀRᵀ.
    let rotate = |x: ArrayView2<'_, Mp>| definition::product(x, rotation.t(), ctx);
    let (seq_len, n_heads, _) = case.q_index.dim();
    let flat_q = case
        .q_index
        .to_shape((seq_len * n_heads, index_dim))
        .map_err(|e| Violation::Hypothesis { theorem: T, reason: e.to_string() })?;
    let q_rotated = rotate(flat_q.view())
        .into_shape_with_order((seq_len, n_heads, index_dim))
        .map_err(|e| Violation::Hypothesis { theorem: T, reason: e.to_string() })?;
    let k_rotated = rotate(case.k_index.view());
    let original = indexer(case.inputs()).map_err(oracle_err)?;
    let rotated =
        indexer(IndexerInputs { q_index: q_rotated.view(), weights: case.weights.view(), k_index: k_rotated.view() })
            .map_err(oracle_err)?;
    agree(T, "I", &rotated, &original, required)
}

/// A structural failure of the selection, reported as a mismatch of `found` against `expected`.
fn selection_violation(quantity: &'static str, found: String, expected: String, index: Vec<usize>) -> Violation {
    Violation::Mismatch { theorem: "causal_top_k_is_exact (E16)", quantity, found, expected, index }
}

/// **Theorem (E16, exact causal top-κ).** For scores `I [T, T]` whose causal entries are finite,
/// the selection `J [T, κ]` satisfies, row by row: (1) the valid prefix is ascending without
/// duplicates and followed only by `−1` pads; (2) every selected `s` is causal, `s ≤ t`; (3) it
/// has exactly `min(κ, t+1)` valid entries; (4) it is optimal with ties to the lower index: for
/// every selected `s` and unselected causal `s'`, `I_ts > I_ts'`, or `I_ts = I_ts'` and `s < s'`.
/// Exact comparisons: the agreement is exact or the theorem fails. Hypotheses: `scores` square
/// with finite causal entries.
pub fn causal_top_k_is_exact(
    topk: TopKFn<'_>,
    scores: &Array2<Mp>,
    config: TopKConfig,
) -> Result<Agreement, Violation> {
    const T: &str = "causal_top_k_is_exact (E16)";
    let seq_len = scores.nrows();
    if scores.ncols() != seq_len || scores.indexed_iter().any(|((t, s), x)| s <= t && !x.is_finite()) {
        return Err(Violation::Hypothesis { theorem: T, reason: "scores must be square, finite on s ≤ t".into() });
    }
    let selection =
        topk(scores.view(), config).map_err(|e| Violation::Hypothesis { theorem: T, reason: e.to_string() })?;
    if selection.dim() != (seq_len, config.top_k) {
        return Err(selection_violation(
            "selection shape",
            format!("{:?}", selection.dim()),
            format!("{:?}", (seq_len, config.top_k)),
            vec![],
        ));
    }
    for (t, row) in selection.rows().into_iter().enumerate() {
        let valid = row.iter().take_while(|&&s| s != -1).count();
        if let Some(slot) = (valid..row.len()).find(|&slot| row[slot] != -1) {
            return Err(selection_violation("pad", row[slot].to_string(), "-1".into(), vec![t, slot]));
        }
        for slot in 0..valid {
            let s = row[slot];
            if s < 0 || s as usize > t {
                return Err(selection_violation("selected key", s.to_string(), format!("in 0..={t}"), vec![t, slot]));
            }
            if slot > 0 && s <= row[slot - 1] {
                return Err(selection_violation(
                    "selected key",
                    s.to_string(),
                    format!("> {} (ascending, no duplicates)", row[slot - 1]),
                    vec![t, slot],
                ));
            }
        }
        let wanted = config.top_k.min(t + 1);
        if valid != wanted {
            return Err(selection_violation("valid entries", valid.to_string(), wanted.to_string(), vec![t]));
        }
        let chosen: Vec<usize> = row.iter().take(valid).map(|&s| s as usize).collect();
        for &s in &chosen {
            for other in (0..=t).filter(|o| !chosen.contains(o)) {
                let (a, b) = (&scores[[t, s]], &scores[[t, other]]);
                if a < b || (a == b && s > other) {
                    return Err(selection_violation(
                        "selected key",
                        format!("{s} (score {a})"),
                        format!("to rank above unselected {other} (score {b})"),
                        vec![t],
                    ));
                }
            }
        }
    }
    Ok(Agreement::exact())
}

/// Main attention's tensors for token-sparse attention, owned, in MPFR.
#[derive(Clone, Debug)]
pub struct TokenSparseCase {
    /// Queries `[T, H, d]`.
    pub query: Array3<Mp>,
    /// Shared keys `[T, d]`.
    pub key: Array2<Mp>,
    /// Shared values `[T, dv]`.
    pub value: Array2<Mp>,
    /// Selection width `κ`.
    pub top_k: usize,
}

/// **Theorem (E16 with E13, full selection).** If every query selects all of its causal keys
/// (`J_t = {0..t}`, which needs `κ ≥ T`), token-sparse attention equals dense causal attention:
/// for each head, `O` and `LSE` agree with the oracle's forward (varlen layout, one KV head
/// shared by all `H` query heads, causal mask, scale `1/√d`). Hypotheses: `κ ≥ T`.
pub fn full_selection_is_dense(
    sparse: TokenSparseFn<'_>,
    case: &TokenSparseCase,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "full_selection_is_dense (E16, E13)";
    let (seq_len, n_heads, head_dim) = case.query.dim();
    if case.top_k < seq_len {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("κ = {} < T = {seq_len}", case.top_k) });
    }
    let ctx = case.key.first().map(|x| x.ctx()).unwrap_or_default();
    let oracle_err = |e: OracleError| Violation::Hypothesis { theorem: T, reason: e.to_string() };
    let selection = Array2::from_shape_fn((seq_len, case.top_k), |(t, slot)| if slot <= t { slot as i32 } else { -1 });
    let found = sparse(TokenSparseInputs {
        query: case.query.view(),
        key: case.key.view(),
        value: case.value.view(),
        selection: selection.view(),
    })
    .map_err(oracle_err)?;
    let spec = AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: vec![0, seq_len as i32], cu_seqlens_k: vec![0, seq_len as i32] },
        n_heads_q: n_heads,
        n_heads_kv: 1,
        head_dim,
        head_dim_v: case.value.ncols(),
        scale: Default::default(),
        mask: Mask::Causal,
    };
    let k = case.key.clone().insert_axis(Axis(1)).into_dyn();
    let v = case.value.clone().insert_axis(Axis(1)).into_dyn();
    let dense = attnproof_oracle::forward(
        &spec,
        Qkv { q: case.query.view().into_dyn(), k: k.view(), v: v.view() },
        DenseConfig::default(),
        ctx,
    )
    .map_err(oracle_err)?;
    Ok(agree(T, "O", &found.o.into_dyn(), &dense.o, required)?.and(agree(
        T,
        "LSE",
        &found.lse.into_dyn(),
        &dense.lse,
        required,
    )?))
}

/// Checks that each teacher row sums to 1 to `required` bits and is causal and non-negative.
fn check_teacher(theorem: &'static str, teacher: &Array2<Mp>, required: Bits) -> Result<(), Violation> {
    let ctx = teacher.first().map(|x| x.ctx()).unwrap_or_default();
    let seq_len = teacher.nrows();
    if teacher.ncols() != seq_len {
        return Err(Violation::Hypothesis { theorem, reason: "teacher is not square".into() });
    }
    for (t, row) in teacher.rows().into_iter().enumerate() {
        let total = row.iter().fold(Mp::zero(ctx), |acc, x| acc + x.clone());
        let bad_entry = row.iter().enumerate().any(|(s, x)| *x < Mp::zero(ctx) || (s > t && *x != Mp::zero(ctx)));
        if bad_entry || bits_of(&(total.clone() - Mp::one(ctx)).abs()).0 < required.0 {
            return Err(Violation::Hypothesis {
                theorem,
                reason: format!("teacher row {t} (sum {total}) is not a causal distribution"),
            });
        }
    }
    Ok(())
}

/// **Theorem (E16, indexer loss).** For a teacher whose rows are causal probability distributions
/// and any scores finite on `s ≤ t`, the loss under test equals the definition
/// `KL_t = Σ_{s≤t, τ_ts>0} τ_ts log(τ_ts / σ_ts)` with `σ_t = e^{I_t·} / Σ_{s≤t} e^{I_ts}` formed
/// directly (no max shift), per query and in total, and each `KL_t ≥ 0` (Gibbs' inequality).
/// Hypotheses: rows of `teacher` sum to 1 to `required` bits, are non-negative and vanish after
/// the diagonal; `scores` is square.
pub fn kl_loss_matches_definition(
    loss: IndexerLossFn<'_>,
    teacher: &Array2<Mp>,
    scores: &Array2<Mp>,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "kl_loss_matches_definition (E16)";
    check_teacher(T, teacher, required)?;
    let ctx = teacher.first().map(|x| x.ctx()).unwrap_or_default();
    let found =
        loss(teacher.view(), scores.view()).map_err(|e| Violation::Hypothesis { theorem: T, reason: e.to_string() })?;
    let visible = Array2::from_shape_fn(scores.dim(), |(t, s)| s <= t);
    let student = definition::probabilities(scores.view(), visible.view(), ctx);
    let expected = ndarray::Array1::from_shape_fn(teacher.nrows(), |t| {
        (0..=t).filter(|&s| teacher[[t, s]] != Mp::zero(ctx)).fold(Mp::zero(ctx), |acc, s| {
            let tau = teacher[[t, s]].clone();
            acc + tau.clone() * (tau / student[[t, s]].clone()).ln()
        })
    });
    // Gibbs' inequality holds exactly; allow the rounding of the definition's own sum.
    let floor = Mp(rug::Float::with_val(ctx.0, rug::Float::i_exp(1, -(required.0 as i32))));
    if let Some(t) = found.per_query.iter().position(|x| *x < -floor.clone()) {
        return Err(Violation::Mismatch {
            theorem: T,
            quantity: "KL per query",
            found: found.per_query[t].to_string(),
            expected: "≥ 0".into(),
            index: vec![t],
        });
    }
    let total = expected.iter().fold(Mp::zero(ctx), |acc, x| acc + x.clone());
    Ok(agree(T, "KL per query", &found.per_query, &expected, required)?.and(agree(
        T,
        "KL total",
        &ndarray::arr0(found.total),
        &ndarray::arr0(total),
        required,
    )?))
}

/// **Theorem (E16, loss vanishes at the teacher).** If the indexer's scores are `I_ts = log τ_ts +
/// c_t` on causal keys (any row offsets `c_t`; here `c_t = t`, to exercise the softmax's shift
/// invariance), then `softmax_s(I_t·) = τ_t` and the loss is 0 in every row. Hypotheses: `teacher`
/// rows are causal distributions (as in [`kl_loss_matches_definition`]) with every causal entry
/// positive, so that `log τ_ts` is finite.
pub fn kl_loss_vanishes_at_teacher(
    loss: IndexerLossFn<'_>,
    teacher: &Array2<Mp>,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "kl_loss_vanishes_at_teacher (E16)";
    check_teacher(T, teacher, required)?;
    let ctx = teacher.first().map(|x| x.ctx()).unwrap_or_default();
    if teacher.indexed_iter().any(|((t, s), x)| s <= t && *x == Mp::zero(ctx)) {
        return Err(Violation::Hypothesis { theorem: T, reason: "a causal teacher entry is 0".into() });
    }
    // Entries after the diagonal are ignored by the loss; fill them with 0 to keep them finite.
    let scores = Array2::from_shape_fn(teacher.dim(), |(t, s)| {
        if s <= t { teacher[[t, s]].ln() + Mp::from_f64(t as f64, ctx) } else { Mp::zero(ctx) }
    });
    let found =
        loss(teacher.view(), scores.view()).map_err(|e| Violation::Hypothesis { theorem: T, reason: e.to_string() })?;
    let zeros = ndarray::Array1::from_elem(teacher.nrows(), Mp::zero(ctx));
    Ok(agree(T, "KL per query", &found.per_query, &zeros, required)?.and(agree(
        T,
        "KL total",
        &ndarray::arr0(found.total),
        &ndarray::arr0(Mp::zero(ctx)),
        required,
    )?))
}

/// The restricted loss of E16 straight from its definition, sharing no code with the oracle: for each row, the
/// listed keys `J_t` (entries up to the first `−1`), `I_ts = Σ_a w_ta max(q_ta · k_s, 0)`, the teacher renormalized
/// on `J_t` and `Σ τ' (log τ' − I + log Σ_{J_t} e^I)`, rows without teacher mass on `J_t` left out.
fn restricted_loss(case: &IndexerCase, teacher: &Array2<Mp>, selection: ArrayView2<'_, i32>) -> Mp {
    let ctx = teacher.first().map(|x| x.ctx()).unwrap_or_default();
    let (seq_len, heads, dim) = case.q_index.dim();
    let mut total = Mp::zero(ctx);
    for t in 0..seq_len {
        let keys: Vec<usize> = selection.row(t).iter().take_while(|&&x| x >= 0).map(|&x| x as usize).collect();
        let mass = keys.iter().fold(Mp::zero(ctx), |acc, &s| acc + teacher[[t, s]].clone());
        if keys.is_empty() || mass == Mp::zero(ctx) {
            continue;
        }
        let score = |s: usize| {
            (0..heads).fold(Mp::zero(ctx), |acc, a| {
                let logit = (0..dim)
                    .fold(Mp::zero(ctx), |l, c| l + case.q_index[[t, a, c]].clone() * case.k_index[[s, c]].clone());
                let relu = if logit > Mp::zero(ctx) { logit } else { Mp::zero(ctx) };
                acc + case.weights[[t, a]].clone() * relu
            })
        };
        let scores: Vec<Mp> = keys.iter().map(|&s| score(s)).collect();
        let log_z = scores.iter().fold(Mp::zero(ctx), |acc, x| acc + x.exp()).ln();
        for (&s, i) in keys.iter().zip(&scores) {
            let tau = teacher[[t, s]].clone() / mass.clone();
            if tau != Mp::zero(ctx) {
                total += tau.clone() * (tau.ln() - i.clone() + log_z.clone());
            }
        }
    }
    total
}

/// **Theorem (E16, the indexer loss's gradients, the support held fixed).** For the loss restricted to a selection
/// (each row's teacher renormalized on its listed keys, the student's softmax over them), the gradients under test
/// with respect to `q^I`, `w` and `k^I` equal, coordinate by coordinate, the Richardson extrapolation
/// `(4·D(h/2) − D(h)) / 3` of the central differences `D(h) = (L(x + h) − L(x − h)) / 2h`, `h = 2^-step_bits`, of the
/// loss formed from its definition ([`restricted_loss`], no code shared with the oracle), and the loss under test
/// equals that definition.
///
/// Hypotheses: the inputs at most 4 in magnitude and the dims at most 8, so that every score moves by at most `32·δ`
/// when one input moves by `δ`; every logit of a listed pair at least `2^(8 − step_bits)` away from 0, so that no
/// step crosses the ReLU's kink (a step moves a logit by at most `4h`); the teacher's rows causal distributions; the
/// selection in the list convention with keys at or before their query; the precision above `step_bits + required +
/// 16` bits and `4·step_bits ≥ required + 64` (the extrapolation leaves `h⁴` times a fifth derivative of softmax terms
/// whose scores move at most 32 per unit step, far below `2^64`).
pub fn indexer_loss_gradients_match_finite_differences(
    under_test: IndexerLossGradientsFn<'_>,
    case: &IndexerCase,
    teacher: &Array2<Mp>,
    selection: ArrayView2<'_, i32>,
    step_bits: u32,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "indexer_loss_gradients_match_finite_differences (E16)";
    let ctx = teacher.first().map(|x| x.ctx()).unwrap_or_default();
    let hypothesis = |reason: String| Violation::Hypothesis { theorem: T, reason };
    if (ctx.0 as f64) < step_bits as f64 + required.0 + 16.0 {
        return Err(hypothesis(format!("precision {} too low", ctx.0)));
    }
    if 4.0 * (step_bits as f64) < required.0 + 64.0 {
        return Err(hypothesis(format!("the step 2^-{step_bits} is too coarse")));
    }
    check_teacher(T, teacher, required)?;
    let (seq_len, heads, dim) = case.q_index.dim();
    if heads > 8 || dim > 8 {
        return Err(hypothesis(format!("{heads} heads of dim {dim}: at most 8 each")));
    }
    let four = Mp::new(4.0, ctx);
    let too_large = case.q_index.iter().chain(case.weights.iter()).chain(case.k_index.iter()).any(|x| x.abs() > four);
    if too_large {
        return Err(hypothesis("an input above 4 in magnitude".into()));
    }
    let margin = Mp::new(2f64.powi(8 - step_bits as i32), ctx);
    for t in 0..seq_len {
        for &s in selection.row(t).iter().take_while(|&&x| x >= 0) {
            if s as usize > t {
                return Err(hypothesis(format!("row {t} lists key {s}, after its query")));
            }
            for a in 0..heads {
                let logit = (0..dim).fold(Mp::zero(ctx), |l, c| {
                    l + case.q_index[[t, a, c]].clone() * case.k_index[[s as usize, c]].clone()
                });
                if logit.abs() < margin {
                    return Err(hypothesis(format!("logit ({t}, {a}, {s}) = {logit} is at the ReLU's kink")));
                }
            }
        }
    }
    let (loss, grads) = under_test(case.inputs(), teacher.view(), LossSupport::Selected(selection))
        .map_err(|e| hypothesis(e.to_string()))?;
    let h = Mp::new(2f64.powi(-(step_bits as i32)), ctx);
    let extrapolated = |moved: &dyn Fn(&Mp) -> IndexerCase| {
        let central = |step: &Mp| {
            let minus = -step.clone();
            (restricted_loss(&moved(step), teacher, selection) - restricted_loss(&moved(&minus), teacher, selection))
                / (Mp::new(2.0, ctx) * step.clone())
        };
        let half = h.clone() / Mp::new(2.0, ctx);
        (Mp::new(4.0, ctx) * central(&half) - central(&h)) / Mp::new(3.0, ctx)
    };
    let numeric_q = Array3::from_shape_fn(case.q_index.dim(), |ix| {
        extrapolated(&|d| {
            let mut c = case.clone();
            c.q_index[ix] = c.q_index[ix].clone() + d.clone();
            c
        })
    });
    let numeric_w = Array2::from_shape_fn(case.weights.dim(), |ix| {
        extrapolated(&|d| {
            let mut c = case.clone();
            c.weights[ix] = c.weights[ix].clone() + d.clone();
            c
        })
    });
    let numeric_k = Array2::from_shape_fn(case.k_index.dim(), |ix| {
        extrapolated(&|d| {
            let mut c = case.clone();
            c.k_index[ix] = c.k_index[ix].clone() + d.clone();
            c
        })
    });
    let expected_loss = restricted_loss(case, teacher, selection);
    Ok(agree(T, "loss", &ndarray::arr0(loss.total), &ndarray::arr0(expected_loss), required)?
        .and(agree(T, "d_q_index", &grads.d_q_index, &numeric_q, required)?)
        .and(agree(T, "d_weights", &grads.d_weights, &numeric_w, required)?)
        .and(agree(T, "d_k_index", &grads.d_k_index, &numeric_k, required)?))
}
