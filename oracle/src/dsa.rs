//! DSA (E16): the lightning indexer's scores, exact causal top-κ token selection, the teacher
//! distribution and the indexer's KL loss, and token-sparse attention over the selected tokens.
//!
//! Everything here is one sequence of `T` tokens. Positions are causal: query `t` may select key
//! `s` only when `s ≤ t`. Main attention is MQA-style, as in DSA's latent attention: all `H` query
//! heads of a token read one shared key/value sequence, and one selection per query token serves
//! every head. Selections follow the E14/E16 convention: `i32` rows of fixed width `κ`, the valid
//! prefix ascending without duplicates, padded with `−1`.

use ndarray::{Array1, Array2, Array3, ArrayView2, ArrayView3, Axis};

use crate::dense;
use crate::error::{OracleError, check_finite, check_shape};
use crate::online::SoftmaxState;
use crate::real::Real;
use crate::spec::Scale;
use crate::topk::{padded_rows, top_k, validate_index_row};
use crate::vector::{dot, log_sum_exp, softmax};

/// The lightning indexer's inputs for one sequence (E16).
#[derive(Debug)]
pub struct IndexerInputs<'a, S> {
    /// Indexer queries `q^I`, `[T, H_I, d_I]`: `H_I` indexer heads per token.
    pub q_index: ArrayView3<'a, S>,
    /// Per-token head weights `w`, `[T, H_I]`.
    pub weights: ArrayView2<'a, S>,
    /// Indexer keys `k^I`, `[T, d_I]`: one per token, shared by all indexer heads.
    pub k_index: ArrayView2<'a, S>,
}

// Views are `Copy` whatever the element type, so the derive's `S: Copy` bound is not wanted.
impl<S> Clone for IndexerInputs<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for IndexerInputs<'_, S> {}

/// How many tokens each query selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopKConfig {
    /// `κ`, the width of every selection row (positive).
    pub top_k: usize,
}

/// The indexer's loss, one KL divergence per query token and their sum.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerLoss<S> {
    /// `KL(τ_t ‖ softmax_s(I_t·))` for each query `t`, `[T]`.
    pub per_query: Array1<S>,
    /// `Σ_t KL(τ_t ‖ softmax_s(I_t·))`.
    pub total: S,
}

/// Inputs of token-sparse attention for one sequence.
#[derive(Debug)]
pub struct TokenSparseInputs<'a, S> {
    /// Main queries `[T, H, d]`.
    pub query: ArrayView3<'a, S>,
    /// The shared keys `[T, d]` (MQA: every head reads them).
    pub key: ArrayView2<'a, S>,
    /// The shared values `[T, dv]`.
    pub value: ArrayView2<'a, S>,
    /// Selected tokens `[T, κ]`: row `t` lists the keys query `t` attends to, for every head.
    pub selection: ArrayView2<'a, i32>,
}

impl<S> Clone for TokenSparseInputs<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for TokenSparseInputs<'_, S> {}

/// How token-sparse attention scales its scores.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TokenSparseConfig {
    /// The softmax scale `α` (default `1/√d`).
    pub scale: Scale,
}

/// Token-sparse attention results.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenSparseOutput<S> {
    /// Outputs `[T, H, dv]` (the varlen layout of a single sequence).
    pub o: Array3<S>,
    /// Natural-log LSE over each query's selected keys, `[H, T]` (the varlen LSE layout);
    /// `−∞` for a query that selected nothing (E1c).
    pub lse: Array2<S>,
}

/// Causal entries (`s ≤ t`) of a square `[T, T]` score matrix must be finite; the rest is ignored.
fn check_causal_scores<S: Real>(argument: &'static str, scores: ArrayView2<'_, S>) -> Result<usize, OracleError> {
    let seq_len = scores.nrows();
    check_shape(argument, scores.shape(), &[seq_len, seq_len])?;
    for ((t, s), x) in scores.indexed_iter() {
        if s <= t && !x.is_finite() {
            return Err(OracleError::NonFinite { argument, index: vec![t, s], value: x.to_f64() });
        }
    }
    Ok(seq_len)
}

/// A `[T, T]` distribution matrix (teacher rows): finite, non-negative, and zero on future keys.
fn check_causal_distribution<S: Real>(
    argument: &'static str,
    x: ArrayView2<'_, S>,
    ctx: S::Ctx,
) -> Result<(), OracleError> {
    check_finite(argument, &x)?;
    let zero = S::zero(ctx);
    for ((t, s), p) in x.indexed_iter() {
        if *p < zero {
            return Err(OracleError::InvalidParameter {
                argument,
                reason: format!("entry [{t}, {s}] = {} is negative", p.to_f64()),
            });
        }
        if s > t && *p != zero {
            return Err(OracleError::InvalidParameter {
                argument,
                reason: format!("entry [{t}, {s}] puts mass on a key after its query"),
            });
        }
    }
    Ok(())
}

/// The causal visibility of one sequence: key `s` is visible to query `t` iff `s ≤ t`.
fn causal_mask(seq_len: usize) -> Array2<bool> {
    Array2::from_shape_fn((seq_len, seq_len), |(t, s)| s <= t)
}

/// E16 indexer scores `I_ts = Σ_a w_ta · ReLU(q^I_ta · k^I_s)` for one sequence, `[T, T]`, with
/// `−∞` at future keys `s > t` so that they can never be selected nor receive probability.
///
/// Errors: zero `H_I` or `d_I`, mismatched shapes of `weights` / `k_index`, non-finite input.
pub fn indexer_scores<S: Real>(inputs: IndexerInputs<'_, S>, ctx: S::Ctx) -> Result<Array2<S>, OracleError> {
    let (seq_len, n_index_heads, index_dim) = inputs.q_index.dim();
    if n_index_heads == 0 {
        return Err(OracleError::ZeroDimension { argument: "n_index_heads" });
    }
    if index_dim == 0 {
        return Err(OracleError::ZeroDimension { argument: "index_dim" });
    }
    check_shape("weights", inputs.weights.shape(), &[seq_len, n_index_heads])?;
    check_shape("k_index", inputs.k_index.shape(), &[seq_len, index_dim])?;
    check_finite("q_index", &inputs.q_index)?;
    check_finite("weights", &inputs.weights)?;
    check_finite("k_index", &inputs.k_index)?;
    let zero = S::zero(ctx);
    Ok(Array2::from_shape_fn((seq_len, seq_len), |(t, s)| {
        if s > t {
            return S::neg_infinity(ctx);
        }
        (0..n_index_heads).fold(zero.clone(), |acc, a| {
            let logit = dot(inputs.q_index.index_axis(Axis(0), t).row(a), inputs.k_index.row(s), ctx);
            let relu = if logit > zero { logit } else { zero.clone() };
            acc + inputs.weights[[t, a]].clone() * relu
        })
    }))
}

/// E16 selection: for each query `t`, the `κ` best causal keys `s ≤ t` by score, ties to the
/// lower index, as an `i32` row sorted ascending and padded with `−1` (rows with fewer than `κ`
/// causal keys keep them all). Entries of `scores` after the diagonal are ignored.
///
/// Errors: `κ = 0`, non-square `scores`, a non-finite causal score, `T` beyond `i32`.
pub fn causal_top_k<S: Real>(scores: ArrayView2<'_, S>, config: TopKConfig) -> Result<Array2<i32>, OracleError> {
    if config.top_k == 0 {
        return Err(OracleError::ZeroDimension { argument: "top_k" });
    }
    let seq_len = check_causal_scores("scores", scores)?;
    if i32::try_from(seq_len).is_err() {
        return Err(OracleError::InvalidParameter {
            argument: "scores",
            reason: format!("{seq_len} positions do not fit an i32 index"),
        });
    }
    Ok(padded_rows(seq_len, config.top_k, |t| top_k(&scores.row(t).to_vec(), config.top_k, |s| s <= t, &[])))
}

/// Causal main-attention probabilities `P^{(h)}_{ts}`, `[H, T, T]`, from main queries
/// `[T, H, d]` and the shared keys `[T, d]` (E1 with the causal mask, E1a): the teacher's input.
///
/// Errors: zero `H` or `d`, mismatched key shape, non-finite input, a non-finite scale.
pub fn main_attention_probabilities<S: Real>(
    query: ArrayView3<'_, S>,
    key: ArrayView2<'_, S>,
    scale: Scale,
    ctx: S::Ctx,
) -> Result<Array3<S>, OracleError> {
    let (seq_len, n_heads, head_dim) = query.dim();
    if n_heads == 0 {
        return Err(OracleError::ZeroDimension { argument: "n_heads" });
    }
    if head_dim == 0 {
        return Err(OracleError::ZeroDimension { argument: "head_dim" });
    }
    check_shape("key", key.shape(), &[seq_len, head_dim])?;
    check_finite("query", &query)?;
    check_finite("key", &key)?;
    scale.check()?;
    let alpha = scale.value::<S>(head_dim, ctx);
    let visible = causal_mask(seq_len);
    let mut probs = Array3::from_elem((n_heads, seq_len, seq_len), S::zero(ctx));
    for h in 0..n_heads {
        let s = dense::scores(query.index_axis(Axis(1), h), key, &alpha, visible.view(), ctx);
        for t in 0..seq_len {
            let row = softmax(&s.row(t).to_vec(), ctx);
            probs.index_axis_mut(Axis(0), h).row_mut(t).assign(&Array1::from(row));
        }
    }
    Ok(probs)
}

/// E16 teacher `τ_t = Σ_h P^{(h)}_{t·} / Σ_s Σ_h P^{(h)}_{ts}` from main-attention probabilities
/// `[H, T, T]` (e.g. [`main_attention_probabilities`]), `[T, T]`.
///
/// Errors: zero `H`, non-square rows, non-finite or negative entries, mass on a future key, a row
/// without mass.
pub fn teacher_distribution<S: Real>(probs: ArrayView3<'_, S>, ctx: S::Ctx) -> Result<Array2<S>, OracleError> {
    let (n_heads, seq_len, _) = probs.dim();
    if n_heads == 0 {
        return Err(OracleError::ZeroDimension { argument: "n_heads" });
    }
    check_shape("probs", probs.shape(), &[n_heads, seq_len, seq_len])?;
    for h in 0..n_heads {
        check_causal_distribution("probs", probs.index_axis(Axis(0), h), ctx)?;
    }
    let summed = probs.fold_axis(Axis(0), S::zero(ctx), |acc, p| acc.clone() + p.clone());
    let mut teacher = summed.clone();
    for (t, mut row) in teacher.rows_mut().into_iter().enumerate() {
        let total = summed.row(t).iter().fold(S::zero(ctx), |acc, p| acc + p.clone());
        if total == S::zero(ctx) {
            return Err(OracleError::InvalidParameter { argument: "probs", reason: format!("row {t} has no mass") });
        }
        row.mapv_inplace(|p| p / total.clone());
    }
    Ok(teacher)
}

/// The indexer's distribution `softmax_s(I_t·)` over causal keys `s ≤ t`, 0 after the diagonal,
/// `[T, T]`.
///
/// Errors: non-square `index_scores`, a non-finite causal score.
pub fn indexer_distribution<S: Real>(index_scores: ArrayView2<'_, S>, ctx: S::Ctx) -> Result<Array2<S>, OracleError> {
    let seq_len = check_causal_scores("index_scores", index_scores)?;
    let mut out = Array2::from_elem((seq_len, seq_len), S::zero(ctx));
    for t in 0..seq_len {
        let causal: Vec<S> = index_scores.row(t).iter().take(t + 1).cloned().collect();
        for (s, p) in softmax(&causal, ctx).into_iter().enumerate() {
            out[[t, s]] = p;
        }
    }
    Ok(out)
}

/// E16 indexer loss `Σ_t KL(τ_t ‖ softmax_s(I_t·))` over causal keys, with `0 · log 0 = 0`.
///
/// The student's log-probabilities are formed as `I_ts − LSE_t` rather than as the log of
/// [`softmax`], whose small probabilities underflow to 0 in f64 and would make the loss infinite.
/// Hypothesis (not checked): the rows of `teacher` sum to 1, as [`teacher_distribution`]'s do;
/// only then is each term a KL divergence and non-negative.
///
/// Errors: shapes other than `[T, T]`, non-finite or negative teacher entries, teacher mass on a
/// future key, non-finite causal scores.
pub fn indexer_kl_loss<S: Real>(
    teacher: ArrayView2<'_, S>,
    index_scores: ArrayView2<'_, S>,
    ctx: S::Ctx,
) -> Result<IndexerLoss<S>, OracleError> {
    let seq_len = check_causal_scores("index_scores", index_scores)?;
    check_shape("teacher", teacher.shape(), &[seq_len, seq_len])?;
    check_causal_distribution("teacher", teacher, ctx)?;
    let zero = S::zero(ctx);
    let per_query = Array1::from_shape_fn(seq_len, |t| {
        let causal: Vec<S> = index_scores.row(t).iter().take(t + 1).cloned().collect();
        let lse = log_sum_exp(&causal, ctx);
        causal.iter().zip(teacher.row(t)).fold(zero.clone(), |acc, (score, tau)| {
            if *tau == zero { acc } else { acc + tau.clone() * (tau.ln() - (score.clone() - lse.clone())) }
        })
    });
    let total = per_query.iter().fold(zero.clone(), |acc, x| acc + x.clone());
    Ok(IndexerLoss { per_query, total })
}

/// The keys each row of the indexer loss runs over.
#[derive(Clone, Copy, Debug)]
pub enum LossSupport<'a> {
    /// Every causal key `s ≤ t` (the dense warm-up stage).
    Causal,
    /// The selected keys of each row, `[T, κ]` in the E16 list convention (the sparse training stage).
    Selected(ArrayView2<'a, i32>),
}

/// Gradients of the indexer loss with respect to the indexer's inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerLossGradients<S> {
    /// `∂L/∂q^I`, `[T, H_I, d_I]`.
    pub d_q_index: Array3<S>,
    /// `∂L/∂w`, `[T, H_I]`.
    pub d_weights: Array2<S>,
    /// `∂L/∂k^I`, `[T, d_I]`.
    pub d_k_index: Array2<S>,
}

/// E16's indexer loss on a support and its gradients with respect to `q^I`, `w` and `k^I`, the support held fixed.
///
/// Row `t` runs over its support `J_t` (every `s ≤ t`, or the listed keys): the teacher restricted to `J_t` and
/// renormalized, `τ'_ts = τ_ts / Σ_{s∈J_t} τ_ts`, against the indexer's softmax over `J_t`, `σ_ts = e^{I_ts} /
/// Σ_{s∈J_t} e^{I_ts}`: `KL_t = Σ_{s∈J_t, τ'_ts>0} τ'_ts (log τ'_ts − log σ_ts)`, and `L = Σ_t KL_t`. A row whose
/// teacher has no mass on its support contributes nothing (its KL is undefined; the sparse stage has no target
/// there). With the causal support and a teacher from [`teacher_distribution`] this is [`indexer_kl_loss`].
///
/// The gradient: `∂KL_t/∂I_ts = σ_ts − τ'_ts` on `J_t` (0 elsewhere), and through `I_ts = Σ_a w_ta ReLU(l_tas)`,
/// `l_tas = q^I_ta · k^I_s`: `∂I_ts/∂w_ta = ReLU(l_tas)`, `∂I_ts/∂q^I_ta = w_ta [l_tas > 0] k^I_s`,
/// `∂I_ts/∂k^I_s = Σ_a w_ta [l_tas > 0] q^I_ta` (the ReLU's derivative taken as 0 at 0).
///
/// Errors: those of [`indexer_scores`]; a teacher of another shape than `[T, T]`, non-finite or negative, or with
/// mass after the diagonal; a selection that is not `[T, κ]`, breaks the list convention or lists a key after its
/// query.
pub fn indexer_loss_and_gradients<S: Real>(
    inputs: IndexerInputs<'_, S>,
    teacher: ArrayView2<'_, S>,
    support: LossSupport<'_>,
    ctx: S::Ctx,
) -> Result<(IndexerLoss<S>, IndexerLossGradients<S>), OracleError> {
    let scores = indexer_scores(inputs, ctx)?;
    let (seq_len, n_heads, dim) = inputs.q_index.dim();
    check_shape("teacher", teacher.shape(), &[seq_len, seq_len])?;
    check_causal_distribution("teacher", teacher, ctx)?;
    let supports: Vec<Vec<usize>> = match support {
        LossSupport::Causal => (0..seq_len).map(|t| (0..=t).collect()).collect(),
        LossSupport::Selected(selection) => {
            check_shape("selection", selection.shape(), &[seq_len, selection.ncols()])?;
            let mut rows = Vec::with_capacity(seq_len);
            for (t, row) in selection.rows().into_iter().enumerate() {
                let keys = validate_index_row("selection", t, &row.to_vec(), seq_len)?;
                if let Some(&s) = keys.iter().find(|&&s| s > t) {
                    return Err(OracleError::IndexList {
                        argument: "selection",
                        position: vec![t],
                        reason: format!("key {s} is after its query"),
                    });
                }
                rows.push(keys);
            }
            rows
        }
    };
    let zero = S::zero(ctx);
    let mut per_query = Array1::from_elem(seq_len, zero.clone());
    // ∂L/∂I_ts, on the supports.
    let mut d_scores = Array2::from_elem((seq_len, seq_len), zero.clone());
    for (t, keys) in supports.iter().enumerate() {
        let mass = keys.iter().fold(zero.clone(), |acc, &s| acc + teacher[[t, s]].clone());
        if keys.is_empty() || mass == zero {
            continue;
        }
        let row: Vec<S> = keys.iter().map(|&s| scores[[t, s]].clone()).collect();
        let lse = log_sum_exp(&row, ctx);
        let student = softmax(&row, ctx);
        let mut kl = zero.clone();
        for ((&s, score), sigma) in keys.iter().zip(&row).zip(student) {
            let tau = teacher[[t, s]].clone() / mass.clone();
            if tau != zero {
                kl += tau.clone() * (tau.ln() - (score.clone() - lse.clone()));
            }
            d_scores[[t, s]] = sigma - tau;
        }
        per_query[t] = kl;
    }
    let total = per_query.iter().fold(zero.clone(), |acc, x| acc + x.clone());
    let mut d_q_index = Array3::from_elem((seq_len, n_heads, dim), zero.clone());
    let mut d_weights = Array2::from_elem((seq_len, n_heads), zero.clone());
    let mut d_k_index = Array2::from_elem((seq_len, dim), zero.clone());
    for (t, keys) in supports.iter().enumerate() {
        for &s in keys {
            let g = d_scores[[t, s]].clone();
            if g == zero {
                continue;
            }
            for a in 0..n_heads {
                let q = inputs.q_index.index_axis(Axis(0), t);
                let logit = dot(q.row(a), inputs.k_index.row(s), ctx);
                if logit > zero {
                    d_weights[[t, a]] = d_weights[[t, a]].clone() + g.clone() * logit;
                    let gw = g.clone() * inputs.weights[[t, a]].clone();
                    for c in 0..dim {
                        d_q_index[[t, a, c]] =
                            d_q_index[[t, a, c]].clone() + gw.clone() * inputs.k_index[[s, c]].clone();
                        d_k_index[[s, c]] = d_k_index[[s, c]].clone() + gw.clone() * q[[a, c]].clone();
                    }
                }
            }
        }
    }
    Ok((IndexerLoss { per_query, total }, IndexerLossGradients { d_q_index, d_weights, d_k_index }))
}

/// Token-sparse attention (E13 with `E_t` the selection, drop-and-renormalize as in DSA): each
/// head of query `t` applies ordinary softmax to its scores over the selected keys only,
/// `o_th = Σ_{s∈J_t} softmax(α q_th·k_s) v_s`, one E2 block per query, finalized by E5.
///
/// Errors: zero `H` or `d`, mismatched `key` / `value` / `selection` rows, non-finite input, a
/// non-finite scale, a selection row that breaks the index-list convention (range `0..T`,
/// ascending, no duplicates, `−1` pads last) or selects a key after its query.
pub fn token_sparse_attention<S: Real>(
    inputs: TokenSparseInputs<'_, S>,
    config: TokenSparseConfig,
    ctx: S::Ctx,
) -> Result<TokenSparseOutput<S>, OracleError> {
    let (seq_len, n_heads, head_dim) = inputs.query.dim();
    if n_heads == 0 {
        return Err(OracleError::ZeroDimension { argument: "n_heads" });
    }
    if head_dim == 0 {
        return Err(OracleError::ZeroDimension { argument: "head_dim" });
    }
    let head_dim_v = inputs.value.ncols();
    check_shape("key", inputs.key.shape(), &[seq_len, head_dim])?;
    check_shape("value", inputs.value.shape(), &[seq_len, head_dim_v])?;
    check_shape("selection", inputs.selection.shape(), &[seq_len, inputs.selection.ncols()])?;
    check_finite("query", &inputs.query)?;
    check_finite("key", &inputs.key)?;
    check_finite("value", &inputs.value)?;
    config.scale.check()?;
    let alpha = config.scale.value::<S>(head_dim, ctx);
    let mut o = Array3::from_elem((seq_len, n_heads, head_dim_v), S::zero(ctx));
    let mut lse = Array2::from_elem((n_heads, seq_len), S::zero(ctx));
    for t in 0..seq_len {
        let row = inputs.selection.row(t).to_vec();
        let selected = validate_index_row("selection", t, &row, seq_len)?;
        if let Some(slot) = selected.iter().position(|&s| s > t) {
            return Err(OracleError::IndexList {
                argument: "selection",
                position: vec![t, slot],
                reason: format!("key {} is after query {t}", selected[slot]),
            });
        }
        let keys = inputs.key.select(Axis(0), &selected);
        let values = inputs.value.select(Axis(0), &selected);
        // Every selected key is visible to every head; the causal check above already ran.
        let visible = Array2::from_elem((n_heads, selected.len()), true);
        let scores = dense::scores(inputs.query.index_axis(Axis(0), t), keys.view(), &alpha, visible.view(), ctx);
        let (o_t, lse_t) = SoftmaxState::of_block(scores.view(), visible.view(), values.view(), ctx).finalize();
        o.index_axis_mut(Axis(0), t).assign(&o_t);
        lse.column_mut(t).assign(&lse_t);
    }
    Ok(TokenSparseOutput { o, lse })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array, array};

    fn indexer_case() -> (Array3<f64>, Array2<f64>, Array2<f64>) {
        let q = Array::from_shape_vec((3, 2, 2), vec![1.0, 0.0, 0.0, 1.0, 1.0, -1.0, 0.5, 0.5, 2.0, 0.0, 0.0, -1.0])
            .expect("sizes agree");
        let w = array![[1.0, 2.0], [0.5, 1.0], [1.0, 1.0]];
        let k = array![[1.0, 1.0], [-1.0, 2.0], [0.5, 0.0]];
        (q, w, k)
    }

    #[test]
    fn indexer_scores_follow_e16_and_mask_the_future() {
        let (q, w, k) = indexer_case();
        let i = indexer_scores(IndexerInputs { q_index: q.view(), weights: w.view(), k_index: k.view() }, ())
            .expect("valid");
        // Row 1, key 1: head 0 gives ReLU(1·(−1) + (−1)·2) = 0, head 1 gives ReLU(0.5) = 0.5.
        assert_eq!(i[[1, 1]], 0.5 * 0.0 + 1.0 * 0.5);
        assert_eq!(i[[0, 0]], 1.0 * 1.0 + 2.0 * 1.0);
        assert_eq!(i[[0, 1]], f64::NEG_INFINITY);
        assert_eq!(i[[2, 2]], 1.0 * 1.0 + 1.0 * 0.0);
    }

    #[test]
    fn indexer_rejects_bad_input() {
        let (q, w, k) = indexer_case();
        let run = |q: &Array3<f64>, w: &Array2<f64>, k: &Array2<f64>| {
            indexer_scores(IndexerInputs { q_index: q.view(), weights: w.view(), k_index: k.view() }, ())
        };
        assert!(matches!(run(&q, &w.t().to_owned(), &k), Err(OracleError::ShapeMismatch { argument: "weights", .. })));
        assert!(matches!(
            run(&q, &w, &k.slice_axis(Axis(0), ndarray::Slice::from(0..2)).to_owned()),
            Err(OracleError::ShapeMismatch { argument: "k_index", .. })
        ));
        let mut bad = q.clone();
        bad[[2, 1, 0]] = f64::NAN;
        assert!(matches!(run(&bad, &w, &k), Err(OracleError::NonFinite { argument: "q_index", .. })));
        let mut bad = w.clone();
        bad[[0, 0]] = f64::INFINITY;
        assert!(matches!(run(&q, &bad, &k), Err(OracleError::NonFinite { argument: "weights", .. })));
        let empty_heads = Array3::<f64>::zeros((3, 0, 2));
        assert!(matches!(
            run(&empty_heads, &Array2::zeros((3, 0)), &k),
            Err(OracleError::ZeroDimension { argument: "n_index_heads" })
        ));
        assert!(matches!(
            run(&Array3::zeros((3, 2, 0)), &w, &Array2::zeros((3, 0))),
            Err(OracleError::ZeroDimension { argument: "index_dim" })
        ));
    }

    #[test]
    fn top_k_pads_breaks_ties_low_and_rejects_bad_input() {
        let scores = array![[1.0, 9.0, 9.0, 9.0], [2.0, 2.0, 9.0, 9.0], [1.0, 3.0, 3.0, 9.0], [0.0, 5.0, 5.0, 5.0]];
        let sel = causal_top_k(scores.view(), TopKConfig { top_k: 2 }).expect("valid");
        assert_eq!(sel, array![[0, -1], [0, 1], [1, 2], [1, 2]]);
        assert!(matches!(
            causal_top_k(scores.view(), TopKConfig { top_k: 0 }),
            Err(OracleError::ZeroDimension { argument: "top_k" })
        ));
        let wide = Array2::<f64>::zeros((2, 3));
        assert!(matches!(
            causal_top_k(wide.view(), TopKConfig { top_k: 1 }),
            Err(OracleError::ShapeMismatch { argument: "scores", .. })
        ));
        let mut nan = scores.clone();
        nan[[2, 1]] = f64::NAN;
        assert!(matches!(
            causal_top_k(nan.view(), TopKConfig { top_k: 1 }),
            Err(OracleError::NonFinite { argument: "scores", .. })
        ));
        // A non-finite entry after the diagonal is never looked at.
        let mut future = scores.clone();
        future[[0, 3]] = f64::NAN;
        assert!(causal_top_k(future.view(), TopKConfig { top_k: 1 }).is_ok());
    }

    #[test]
    fn teacher_and_loss_validate_their_input() {
        let probs = Array3::from_shape_fn(
            (2, 2, 2),
            |(h, t, s)| if s > t { 0.0 } else { 1.0 / (t + 1) as f64 + h as f64 * 0.0 },
        );
        let teacher = teacher_distribution(probs.view(), ()).expect("valid");
        assert_eq!(teacher, array![[1.0, 0.0], [0.5, 0.5]]);
        let mut future = probs.clone();
        future[[1, 0, 1]] = 0.25;
        assert!(matches!(
            teacher_distribution(future.view(), ()),
            Err(OracleError::InvalidParameter { argument: "probs", .. })
        ));
        let mut negative = probs.clone();
        negative[[0, 1, 0]] = -0.5;
        assert!(matches!(
            teacher_distribution(negative.view(), ()),
            Err(OracleError::InvalidParameter { argument: "probs", .. })
        ));
        assert!(matches!(
            teacher_distribution(Array3::<f64>::zeros((2, 2, 2)).view(), ()),
            Err(OracleError::InvalidParameter { argument: "probs", .. })
        ));
        assert!(matches!(
            teacher_distribution(Array3::<f64>::zeros((2, 2, 3)).view(), ()),
            Err(OracleError::ShapeMismatch { argument: "probs", .. })
        ));
        assert!(matches!(
            teacher_distribution(Array3::<f64>::zeros((0, 2, 2)).view(), ()),
            Err(OracleError::ZeroDimension { argument: "n_heads" })
        ));
        let scores = array![[0.0, f64::NEG_INFINITY], [1.0, 1.0]];
        let loss = indexer_kl_loss(teacher.view(), scores.view(), ()).expect("valid");
        // The student equals the teacher, so the loss vanishes up to f64 rounding of the logs.
        assert!(loss.total.abs() < 1e-15, "{}", loss.total);
        assert!(matches!(
            indexer_kl_loss(teacher.view(), Array2::zeros((3, 3)).view(), ()),
            Err(OracleError::ShapeMismatch { argument: "teacher", .. })
        ));
        assert!(matches!(
            indexer_kl_loss(future.index_axis(Axis(0), 1), scores.view(), ()),
            Err(OracleError::InvalidParameter { argument: "teacher", .. })
        ));
        let nan_scores = array![[f64::NAN, 0.0], [1.0, 1.0]];
        assert!(matches!(
            indexer_kl_loss(teacher.view(), nan_scores.view(), ()),
            Err(OracleError::NonFinite { argument: "index_scores", .. })
        ));
    }

    #[test]
    fn kl_loss_is_positive_when_the_student_differs() {
        let teacher = array![[1.0, 0.0], [0.25, 0.75]];
        let scores = array![[3.0, 0.0], [0.0, 0.0]];
        let loss = indexer_kl_loss(teacher.view(), scores.view(), ()).expect("valid");
        let expected = 0.25 * (0.25f64 / 0.5).ln() + 0.75 * (0.75f64 / 0.5).ln();
        assert!((loss.total - expected).abs() < 1e-15);
        let student = indexer_distribution(scores.view(), ()).expect("valid");
        assert_eq!(student, array![[1.0, 0.0], [0.5, 0.5]]);
    }

    /// A causal teacher for three tokens (rows sum to 1, nothing after the diagonal).
    fn loss_teacher() -> Array2<f64> {
        array![[1.0, 0.0, 0.0], [0.25, 0.75, 0.0], [0.5, 0.125, 0.375]]
    }

    #[test]
    fn the_loss_on_every_causal_key_is_the_kl_loss_and_a_full_selection_is_the_same() {
        let (q, w, k) = indexer_case();
        let inputs = IndexerInputs { q_index: q.view(), weights: w.view(), k_index: k.view() };
        let teacher = loss_teacher();
        let scores = indexer_scores(inputs, ()).unwrap();
        let kl = indexer_kl_loss(teacher.view(), scores.view(), ()).unwrap();
        let (causal, grads) = indexer_loss_and_gradients(inputs, teacher.view(), LossSupport::Causal, ()).unwrap();
        for t in 0..3 {
            assert!((causal.per_query[t] - kl.per_query[t]).abs() < 1e-14, "row {t}");
        }
        let every = array![[0, -1, -1], [0, 1, -1], [0, 1, 2]];
        let (selected, same) =
            indexer_loss_and_gradients(inputs, teacher.view(), LossSupport::Selected(every.view()), ()).unwrap();
        assert_eq!((selected, same), (causal, grads));
    }

    #[test]
    fn a_selected_support_renormalizes_the_teacher_and_skips_rows_without_mass() {
        let (q, w, k) = indexer_case();
        let inputs = IndexerInputs { q_index: q.view(), weights: w.view(), k_index: k.view() };
        let teacher = loss_teacher();
        let scores = indexer_scores(inputs, ()).unwrap();
        // Row 2 keeps keys 0 and 2: teacher 0.5 and 0.375 renormalized to 4/7 and 3/7.
        let selection = array![[0, -1], [1, -1], [0, 2]];
        let (loss, grads) =
            indexer_loss_and_gradients(inputs, teacher.view(), LossSupport::Selected(selection.view()), ()).unwrap();
        let (a, b) = (scores[[2, 0]], scores[[2, 2]]);
        let lse = a.max(b) + ((a - a.max(b)).exp() + (b - a.max(b)).exp()).ln();
        let expected = 4.0 / 7.0 * ((4.0f64 / 7.0).ln() - (a - lse)) + 3.0 / 7.0 * ((3.0f64 / 7.0).ln() - (b - lse));
        assert!((loss.per_query[2] - expected).abs() < 1e-14, "{} against {expected}", loss.per_query[2]);
        // Rows 0 and 1 keep one key each, with all the row's support mass: KL 0 and a zero gradient.
        assert_eq!((loss.per_query[0], loss.per_query[1]), (0.0, 0.0));
        assert!(grads.d_weights.row(1).iter().all(|&x| x == 0.0));
        // A row whose teacher puts no mass on its support contributes nothing.
        let massless = array![[0, -1], [0, -1], [1, -1]];
        let zero_mass = array![[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]];
        let (loss, _) =
            indexer_loss_and_gradients(inputs, zero_mass.view(), LossSupport::Selected(massless.view()), ()).unwrap();
        assert_eq!(loss.per_query.to_vec(), [0.0, 0.0, 0.0]);
        // Bad selections are errors.
        let future = array![[0, -1], [0, 2], [0, 1]];
        assert!(indexer_loss_and_gradients(inputs, teacher.view(), LossSupport::Selected(future.view()), ()).is_err());
        let short = array![[0, -1], [0, 1]];
        assert!(indexer_loss_and_gradients(inputs, teacher.view(), LossSupport::Selected(short.view()), ()).is_err());
    }

    #[test]
    fn the_loss_gradients_match_central_differences() {
        let (q, w, k) = indexer_case();
        // The case has logits at exactly 0 (a ReLU kink, where a central difference halves the slope): moved off.
        let q = q.mapv(|x| x + 0.03125);
        let teacher = loss_teacher();
        let selection = array![[0, -1], [0, 1], [1, 2]];
        let loss_at = |q: &Array3<f64>, w: &Array2<f64>, k: &Array2<f64>| {
            let inputs = IndexerInputs { q_index: q.view(), weights: w.view(), k_index: k.view() };
            indexer_loss_and_gradients(inputs, teacher.view(), LossSupport::Selected(selection.view()), ()).unwrap()
        };
        let (_, grads) = loss_at(&q, &w, &k);
        let h = 1e-6;
        let central = |f: &dyn Fn(f64) -> f64| (f(h) - f(-h)) / (2.0 * h);
        let close = |found: f64, numeric: f64, what: &str| {
            assert!((found - numeric).abs() < 1e-7 * (1.0 + numeric.abs()), "{what}: {found} against {numeric}");
        };
        for ((t, a, c), &found) in grads.d_q_index.indexed_iter() {
            let numeric = central(&|d| {
                let mut moved = q.clone();
                moved[[t, a, c]] += d;
                loss_at(&moved, &w, &k).0.total
            });
            close(found, numeric, &format!("dq[{t}, {a}, {c}]"));
        }
        for ((t, a), &found) in grads.d_weights.indexed_iter() {
            let numeric = central(&|d| {
                let mut moved = w.clone();
                moved[[t, a]] += d;
                loss_at(&q, &moved, &k).0.total
            });
            close(found, numeric, &format!("dw[{t}, {a}]"));
        }
        for ((s, c), &found) in grads.d_k_index.indexed_iter() {
            let numeric = central(&|d| {
                let mut moved = k.clone();
                moved[[s, c]] += d;
                loss_at(&q, &w, &moved).0.total
            });
            close(found, numeric, &format!("dk[{s}, {c}]"));
        }
        assert!(grads.d_k_index.iter().any(|&x| x.abs() > 1e-3), "the case moves the loss through the keys");
    }

    fn sparse_case() -> (Array3<f64>, Array2<f64>, Array2<f64>) {
        let q = Array::from_shape_fn((3, 2, 2), |(t, h, c)| (t + 2 * h + c) as f64 * 0.25 - 0.5);
        let k = array![[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]];
        let v = array![[1.0], [2.0], [4.0]];
        (q, k, v)
    }

    #[test]
    fn token_sparse_attention_reads_only_selected_keys() {
        let (q, k, v) = sparse_case();
        let selection = array![[0, -1], [1, -1], [-1, -1]];
        let out = token_sparse_attention(
            TokenSparseInputs { query: q.view(), key: k.view(), value: v.view(), selection: selection.view() },
            TokenSparseConfig::default(),
            (),
        )
        .expect("valid");
        // One selected key: the output is its value and the LSE its scaled score.
        assert_eq!(out.o[[1, 0, 0]], 2.0);
        assert_eq!(out.o[[0, 1, 0]], 1.0);
        assert!((out.lse[[1, 1]] - (q[[1, 1, 1]]) / 2f64.sqrt()).abs() < 1e-15);
        // An empty selection follows E1c.
        assert_eq!(out.o[[2, 0, 0]], 0.0);
        assert_eq!(out.lse[[0, 2]], f64::NEG_INFINITY);
    }

    #[test]
    fn token_sparse_attention_rejects_bad_selections_and_shapes() {
        let (q, k, v) = sparse_case();
        let run = |selection: Array2<i32>, value: &Array2<f64>, scale: Scale| {
            token_sparse_attention(
                TokenSparseInputs { query: q.view(), key: k.view(), value: value.view(), selection: selection.view() },
                TokenSparseConfig { scale },
                (),
            )
        };
        let default = Scale::default();
        let future = array![[0, 1], [0, -1], [0, -1]];
        assert!(matches!(
            run(future, &v, default),
            Err(OracleError::IndexList { argument: "selection", ref position, .. }) if position == &vec![0, 1]
        ));
        let duplicate = array![[0, -1], [1, 1], [0, -1]];
        assert!(matches!(run(duplicate, &v, default), Err(OracleError::IndexList { argument: "selection", .. })));
        let short = array![[0, -1], [1, -1]];
        assert!(matches!(run(short, &v, default), Err(OracleError::ShapeMismatch { argument: "selection", .. })));
        let ok = array![[0, -1], [0, 1], [0, 2]];
        assert!(matches!(
            run(ok.clone(), &array![[1.0], [2.0]], default),
            Err(OracleError::ShapeMismatch { argument: "value", .. })
        ));
        assert!(matches!(
            run(ok.clone(), &array![[1.0], [f64::NAN], [0.0]], default),
            Err(OracleError::NonFinite { argument: "value", .. })
        ));
        assert!(matches!(
            run(ok, &v, Scale::Value(f64::INFINITY)),
            Err(OracleError::NonFinite { argument: "scale", .. })
        ));
    }

    #[test]
    fn main_probabilities_are_causal_softmax_rows() {
        let (q, k, _) = sparse_case();
        let p = main_attention_probabilities(q.view(), k.view(), Scale::Value(1.0), ()).expect("valid");
        assert_eq!(p[[1, 0, 0]], 1.0);
        assert_eq!(p[[0, 1, 2]], 0.0);
        let row_total: f64 = p.index_axis(Axis(0), 1).row(2).sum();
        assert!((row_total - 1.0).abs() < 1e-15);
        assert!(matches!(
            main_attention_probabilities(q.view(), Array2::zeros((3, 3)).view(), Scale::default(), ()),
            Err(OracleError::ShapeMismatch { argument: "key", .. })
        ));
    }
}
