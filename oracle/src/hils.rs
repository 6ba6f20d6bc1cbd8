//! HiLS (E21): each chunk's landmark distribution `p_b`, slope key `k'_b`, entropy intercept
//! `H(p_b)` and exact log-mass `f_b`; router scores `r_ib = q_i·k'_b/√d + H(p_b)` (the first-order
//! Taylor expansion of `f_b` at the landmark), top-K chunk routing, and the factorized output.
//!
//! Layout and conventions, for one head of one sequence of `n` tokens:
//! - chunk `b` holds keys `[b·C, min((b+1)·C, n))` (`C` the chunk size; the last chunk may be
//!   short) and has one landmark query `q'_b`; the score scale is `1/√d` throughout (E21);
//! - the local window of query `i` is exact: keys `[start_i, i]` with
//!   `start_i = C·⌊max(0, i+1−w)/C⌋`, i.e. the last `w` keys extended down to a chunk boundary,
//!   so that every causal key is either local or in exactly one complete earlier chunk;
//! - a query may retrieve only chunks that end at or before its window start ("eligible":
//!   `b < start_i / C`); they lie entirely in its past, so no mask is needed inside them.
//!
//! Surrogate masses `Ẑ_ib = e^{r_ib}` are never formed as such: a retrieved chunk enters the
//! output as a one-key online-softmax state `(m, ℓ, A) = (r_ib, 1, ō_ib)` (E2), merged with the
//! local window's state by E4 and finalized by E5. The merge only exponentiates differences to
//! the running max, so f64 stays finite for any scores, and the finalize's LSE is
//! `log(Z_local + Σ_b Ẑ_ib)`.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis, Slice};

use crate::dense;
use crate::error::{OracleError, check_finite, check_shape};
use crate::online::SoftmaxState;
use crate::real::Real;
use crate::topk::{padded_rows, top_k, validate_index_row};
use crate::vector::{dot, log_sum_exp, softmax};

/// Chunking, local window and routing width of HiLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HilsConfig {
    /// Keys per chunk `C` (positive).
    pub chunk_size: usize,
    /// Exact local keys `w` before and including each query (positive), extended down to a chunk
    /// boundary.
    pub local_window: usize,
    /// Chunks the router retrieves per query, `K` (the width of a routing row).
    pub retrieved_chunks: usize,
}

/// Which log-mass a retrieved chunk contributes to the factorized output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkMass {
    /// The router's surrogate `log Ẑ_ib = r_ib` (HiLS proper).
    Surrogate,
    /// The exact chunk log-mass `f_b(q_i)` (the factorized output then equals dense attention
    /// over the local window and the retrieved chunks).
    Exact,
}

/// What a landmark query learns about its chunk.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkSummary<S> {
    /// `p_bj = softmax_j(q'_b·k_j/√d)`, one weight per key of the chunk.
    pub landmark_probabilities: Array1<S>,
    /// The slope key `k'_b = Σ_j p_bj k_j`, `[d]`; `k'_b/√d = ∇f_b(q'_b)`.
    pub slope_key: Array1<S>,
    /// `H(p_b) = −Σ_j p_bj log p_bj` (with `0 log 0 = 0`), the Taylor intercept.
    pub entropy: S,
    /// `f_b(q'_b)`, the chunk's exact log-mass at its landmark.
    pub landmark_log_mass: S,
}

/// One head's HiLS inputs for one sequence.
#[derive(Debug)]
pub struct HilsInputs<'a, S> {
    /// Queries `[n, d]` (query `i` sits at position `i`).
    pub query: ArrayView2<'a, S>,
    /// Keys `[n, d]`.
    pub key: ArrayView2<'a, S>,
    /// Values `[n, dv]`.
    pub value: ArrayView2<'a, S>,
    /// Landmark queries `[⌈n/C⌉, d]`, one per chunk.
    pub landmarks: ArrayView2<'a, S>,
}

// Views are `Copy` whatever the element type, so the derive's `S: Copy` bound is not wanted.
impl<S> Clone for HilsInputs<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for HilsInputs<'_, S> {}

/// The factorized output of every query.
#[derive(Clone, Debug, PartialEq)]
pub struct HilsOutput<S> {
    /// `o_i`, `[n, dv]`.
    pub o: Array2<S>,
    /// `log(Z_i,local + Σ_{b∈R_i} Ẑ_ib)`, `[n]` (with exact masses: the LSE over the keys read).
    pub lse: Array1<S>,
}

/// `1/√d`.
fn inverse_sqrt<S: Real>(head_dim: usize, ctx: S::Ctx) -> S {
    S::one(ctx) / S::from_f64(head_dim as f64, ctx).sqrt()
}

/// `q·k_j/√d` for every row of `keys`.
fn scaled_scores<S: Real>(query: ArrayView1<'_, S>, keys: ArrayView2<'_, S>, ctx: S::Ctx) -> Vec<S> {
    let alpha = inverse_sqrt::<S>(keys.ncols(), ctx);
    keys.rows().into_iter().map(|k| dot(query, k, ctx) * alpha.clone()).collect()
}

/// Checks one query against a chunk's keys: non-empty, positive `d`, matching lengths, finite.
fn check_chunk<S: Real>(
    query_argument: &'static str,
    query: ArrayView1<'_, S>,
    keys: ArrayView2<'_, S>,
) -> Result<(), OracleError> {
    if keys.nrows() == 0 {
        return Err(OracleError::ZeroDimension { argument: "keys" });
    }
    if keys.ncols() == 0 {
        return Err(OracleError::ZeroDimension { argument: "head_dim" });
    }
    check_shape(query_argument, query.shape(), &[keys.ncols()])?;
    check_finite(query_argument, &query)?;
    check_finite("keys", &keys)
}

/// E21 exact chunk log-mass `f_b(q) = log Σ_{j∈B_b} e^{q·k_j/√d}` (max-shifted, never overflows).
///
/// Errors: an empty chunk, `d = 0`, `query` not of length `d`, non-finite input.
pub fn chunk_log_mass<S: Real>(
    query: ArrayView1<'_, S>,
    keys: ArrayView2<'_, S>,
    ctx: S::Ctx,
) -> Result<S, OracleError> {
    check_chunk("query", query, keys)?;
    Ok(log_sum_exp(&scaled_scores(query, keys, ctx), ctx))
}

/// E21 landmark summary of one chunk: `p_b`, `k'_b`, `H(p_b)` and `f_b(q'_b)`.
///
/// The entropy is computed from its definition `−Σ p log p`, not as `f_b(q'_b) − q'_b·k'_b/√d`,
/// so that the intercept identity stays a statement to check rather than a tautology.
///
/// Errors: an empty chunk, `d = 0`, `landmark` not of length `d`, non-finite input.
pub fn summarize_chunk<S: Real>(
    landmark: ArrayView1<'_, S>,
    keys: ArrayView2<'_, S>,
    ctx: S::Ctx,
) -> Result<ChunkSummary<S>, OracleError> {
    check_chunk("landmark", landmark, keys)?;
    let scores = scaled_scores(landmark, keys, ctx);
    let p = Array1::from(softmax(&scores, ctx));
    let slope_key = keys.map_axis(Axis(0), |column| dot(p.view(), column, ctx));
    let zero = S::zero(ctx);
    // A weight that underflowed to 0 (f64 only) contributes 0 · log 0 = 0.
    let entropy = p.iter().fold(zero.clone(), |acc, x| if *x == zero { acc } else { acc - x.clone() * x.ln() });
    Ok(ChunkSummary { landmark_probabilities: p, slope_key, entropy, landmark_log_mass: log_sum_exp(&scores, ctx) })
}

/// E21 router score `r_ib = q_i·k'_b/√d + H(p_b)`, the first-order Taylor value of `f_b(q_i)`.
///
/// Errors: `query` not of the slope key's length, non-finite `query`.
pub fn router_score<S: Real>(
    query: ArrayView1<'_, S>,
    summary: &ChunkSummary<S>,
    ctx: S::Ctx,
) -> Result<S, OracleError> {
    let head_dim = summary.slope_key.len();
    check_shape("query", query.shape(), &[head_dim])?;
    check_finite("query", &query)?;
    Ok(dot(query, summary.slope_key.view(), ctx) * inverse_sqrt::<S>(head_dim, ctx) + summary.entropy.clone())
}

/// `Ẑ_ib · e^{−shift} = e^{r_ib − shift}`: the surrogate mass relative to a reference log-mass.
/// In f64, `e^{r}` itself overflows beyond `r ≈ 709`; a shift of the row's largest log-mass (as
/// the online softmax uses) keeps the result in `[0, 1]`. In MPFR a shift of 0 is safe.
pub fn surrogate_mass<S: Real>(router_score: &S, shift: &S) -> S {
    (router_score.clone() - shift.clone()).exp()
}

/// Number of chunks of a sequence of `seq_len` keys: `⌈n/C⌉`.
pub fn chunk_count(seq_len: usize, config: HilsConfig) -> usize {
    seq_len.div_ceil(config.chunk_size.max(1))
}

/// The keys `[b·C, min((b+1)·C, n))` of chunk `b`.
pub fn chunk_keys(chunk: usize, seq_len: usize, config: HilsConfig) -> std::ops::Range<usize> {
    let size = config.chunk_size.max(1);
    (chunk * size).min(seq_len)..((chunk + 1) * size).min(seq_len)
}

/// The first key of query `position`'s local window: `C·⌊max(0, i+1−w)/C⌋`.
pub fn local_window_start(position: usize, config: HilsConfig) -> usize {
    let size = config.chunk_size.max(1);
    (position + 1).saturating_sub(config.local_window) / size * size
}

/// The chunks query `position` may retrieve: `0..start_i/C`, all complete and in its past.
pub fn eligible_chunks(position: usize, config: HilsConfig) -> std::ops::Range<usize> {
    0..local_window_start(position, config) / config.chunk_size.max(1)
}

/// Checks the config and the inputs' shapes and values; returns `(n, d, chunks)`.
fn check_inputs<S: Real>(inputs: HilsInputs<'_, S>, config: HilsConfig) -> Result<(usize, usize, usize), OracleError> {
    if config.chunk_size == 0 {
        return Err(OracleError::ZeroDimension { argument: "chunk_size" });
    }
    if config.local_window == 0 {
        return Err(OracleError::ZeroDimension { argument: "local_window" });
    }
    let (seq_len, head_dim) = inputs.query.dim();
    if head_dim == 0 {
        return Err(OracleError::ZeroDimension { argument: "head_dim" });
    }
    let chunks = chunk_count(seq_len, config);
    check_shape("key", inputs.key.shape(), &[seq_len, head_dim])?;
    check_shape("value", inputs.value.shape(), &[seq_len, inputs.value.ncols()])?;
    check_shape("landmarks", inputs.landmarks.shape(), &[chunks, head_dim])?;
    if i32::try_from(chunks).is_err() {
        return Err(OracleError::InvalidParameter {
            argument: "chunk_size",
            reason: format!("{chunks} chunks do not fit an i32 index"),
        });
    }
    check_finite("query", &inputs.query)?;
    check_finite("key", &inputs.key)?;
    check_finite("value", &inputs.value)?;
    check_finite("landmarks", &inputs.landmarks)?;
    Ok((seq_len, head_dim, chunks))
}

/// The summary of every chunk of the sequence, in order.
///
/// Errors: as [`route`].
pub fn summarize_chunks<S: Real>(
    inputs: HilsInputs<'_, S>,
    config: HilsConfig,
    ctx: S::Ctx,
) -> Result<Vec<ChunkSummary<S>>, OracleError> {
    let (seq_len, _, chunks) = check_inputs(inputs, config)?;
    (0..chunks)
        .map(|b| {
            let keys = inputs.key.slice_axis(Axis(0), Slice::from(chunk_keys(b, seq_len, config)));
            summarize_chunk(inputs.landmarks.row(b), keys, ctx)
        })
        .collect()
}

/// Router scores `r_ib` of every query and chunk, `[n, ⌈n/C⌉]`, with `−∞` for chunks the query
/// may not retrieve (not entirely before its local window).
///
/// Errors: as [`route`].
pub fn router_scores<S: Real>(
    inputs: HilsInputs<'_, S>,
    config: HilsConfig,
    ctx: S::Ctx,
) -> Result<Array2<S>, OracleError> {
    let summaries = summarize_chunks(inputs, config, ctx)?;
    let seq_len = inputs.query.nrows();
    let mut scores = Array2::from_elem((seq_len, summaries.len()), S::neg_infinity(ctx));
    for i in 0..seq_len {
        for b in eligible_chunks(i, config) {
            scores[[i, b]] = router_score(inputs.query.row(i), &summaries[b], ctx)?;
        }
    }
    Ok(scores)
}

/// The router: for each query, the top-`K` eligible chunks by `r_ib` (ties to the lower chunk),
/// `[n, K]` `i32` rows sorted ascending and padded with `−1`.
///
/// Errors: `C = 0`, `w = 0`, `d = 0`, shapes of `key`, `value`, `landmarks` that do not match
/// `query` and the chunking, non-finite input.
pub fn route<S: Real>(inputs: HilsInputs<'_, S>, config: HilsConfig, ctx: S::Ctx) -> Result<Array2<i32>, OracleError> {
    let scores = router_scores(inputs, config, ctx)?;
    Ok(padded_rows(scores.nrows(), config.retrieved_chunks, |i| {
        let eligible = eligible_chunks(i, config);
        top_k(&scores.row(i).to_vec(), config.retrieved_chunks, |b| eligible.contains(&b), &[])
    }))
}

/// E21 factorized output
/// `o_i = [Σ_{j∈local} e^{s_ij} v_j + Σ_{b∈R_i} Ẑ_ib ō_ib] / [Z_i,local + Σ_{b∈R_i} Ẑ_ib]`
/// with `R_i` the valid prefix of row `i` of `retrieved`, `ō_ib` the exact in-chunk softmax
/// average of `v` for query `i`, and `log Ẑ_ib` chosen by `mass` (the router score, or the exact
/// `f_b(q_i)`). Computed as a merge of online-softmax states (see the module docs), so no
/// positive number is ever exponentiated.
///
/// Errors: those of [`route`], and a `retrieved` row that breaks the index-list convention or
/// names a chunk that is not eligible for its query.
pub fn factorized_output<S: Real>(
    inputs: HilsInputs<'_, S>,
    retrieved: ArrayView2<'_, i32>,
    config: HilsConfig,
    mass: ChunkMass,
    ctx: S::Ctx,
) -> Result<HilsOutput<S>, OracleError> {
    let summaries = summarize_chunks(inputs, config, ctx)?;
    let (seq_len, head_dim) = inputs.query.dim();
    check_shape("retrieved", retrieved.shape(), &[seq_len, retrieved.ncols()])?;
    let alpha = inverse_sqrt::<S>(head_dim, ctx);
    let head_dim_v = inputs.value.ncols();
    let mut o = Array2::from_elem((seq_len, head_dim_v), S::zero(ctx));
    let mut lse = Array1::from_elem(seq_len, S::zero(ctx));
    for i in 0..seq_len {
        let chunks = validate_index_row("retrieved", i, &retrieved.row(i).to_vec(), summaries.len())?;
        let eligible = eligible_chunks(i, config);
        if let Some(slot) = chunks.iter().position(|b| !eligible.contains(b)) {
            return Err(OracleError::IndexList {
                argument: "retrieved",
                position: vec![i, slot],
                reason: format!("chunk {} is not entirely before the local window of query {i}", chunks[slot]),
            });
        }
        let query = inputs.query.slice_axis(Axis(0), Slice::from(i..i + 1));
        // The state of a set of whole keys, all visible to query i.
        let keys_state = |range: std::ops::Range<usize>| {
            let visible = Array2::from_elem((1, range.len()), true);
            let keys = inputs.key.slice_axis(Axis(0), Slice::from(range.clone()));
            let scores = dense::scores(query, keys, &alpha, visible.view(), ctx);
            SoftmaxState::of_block(
                scores.view(),
                visible.view(),
                inputs.value.slice_axis(Axis(0), Slice::from(range)),
                ctx,
            )
        };
        let mut state = keys_state(local_window_start(i, config)..i + 1);
        for b in chunks {
            // ō_ib and f_b(q_i) from the exact in-chunk state, then the chunk as one virtual key.
            let (chunk_average, chunk_log_mass) = keys_state(chunk_keys(b, seq_len, config)).finalize();
            let log_mass = match mass {
                ChunkMass::Surrogate => router_score(inputs.query.row(i), &summaries[b], ctx)?,
                ChunkMass::Exact => chunk_log_mass[0].clone(),
            };
            let chunk_state = SoftmaxState {
                m: Array1::from_elem(1, log_mass),
                l: Array1::from_elem(1, S::one(ctx)),
                a: chunk_average,
            };
            state = state.merge(&chunk_state);
        }
        let (o_i, lse_i) = state.finalize();
        o.row_mut(i).assign(&o_i.row(0));
        lse[i] = lse_i[0].clone();
    }
    Ok(HilsOutput { o, lse })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::array;

    const CONFIG: HilsConfig = HilsConfig { chunk_size: 2, local_window: 2, retrieved_chunks: 1 };

    fn sequence() -> (Array2<f64>, Array2<f64>, Array2<f64>, Array2<f64>) {
        let q = Array2::from_shape_fn((6, 2), |(i, c)| (i as f64 - 2.0) * 0.5 + c as f64 * 0.25);
        let k = Array2::from_shape_fn((6, 2), |(i, c)| if (i + c) % 2 == 0 { 1.0 } else { -0.5 * i as f64 });
        let v = Array2::from_shape_fn((6, 1), |(i, _)| i as f64);
        let landmarks = array![[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]];
        (q, k, v, landmarks)
    }

    fn inputs<'a>((q, k, v, l): &'a (Array2<f64>, Array2<f64>, Array2<f64>, Array2<f64>)) -> HilsInputs<'a, f64> {
        HilsInputs { query: q.view(), key: k.view(), value: v.view(), landmarks: l.view() }
    }

    #[test]
    fn windows_and_eligibility_follow_the_convention() {
        // w = 2, C = 2: query 4 reads keys 3, 4 extended down to key 2; chunk 0 is eligible.
        assert_eq!(local_window_start(4, CONFIG), 2);
        assert_eq!(eligible_chunks(4, CONFIG), 0..1);
        assert_eq!(local_window_start(5, CONFIG), 4);
        assert_eq!(eligible_chunks(5, CONFIG), 0..2);
        assert_eq!(local_window_start(0, CONFIG), 0);
        assert_eq!(chunk_keys(2, 5, CONFIG), 4..5);
    }

    #[test]
    fn summary_of_identical_keys_has_log_count_entropy() {
        let keys = array![[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]];
        let s = summarize_chunk(array![0.5, -1.0].view(), keys.view(), ()).expect("valid");
        assert!((s.entropy - 3f64.ln()).abs() < 1e-15);
        assert!((s.slope_key[1] - 2.0).abs() < 1e-15);
        let f = chunk_log_mass(array![0.5, -1.0].view(), keys.view(), ()).expect("valid");
        assert!((f - (3f64.ln() + (0.5 - 2.0) / 2f64.sqrt())).abs() < 1e-15);
        // Identical keys make f_b linear in q, so the router is exact.
        let q = array![3.0, 1.0];
        let r = router_score(q.view(), &s, ()).expect("valid");
        assert!((r - chunk_log_mass(q.view(), keys.view(), ()).expect("valid")).abs() < 1e-14);
    }

    #[test]
    fn router_picks_eligible_chunks_only() {
        let data = sequence();
        let routed = route(inputs(&data), CONFIG, ()).expect("valid");
        assert_eq!(routed.column(0).to_vec(), vec![-1, -1, -1, 0, 0, routed[[5, 0]]]);
        assert!((0..2).contains(&routed[[5, 0]]));
        let scores = router_scores(inputs(&data), CONFIG, ()).expect("valid");
        // Query 3's window is keys 2..=3, so chunk 0 is its only eligible chunk.
        assert_eq!(scores[[3, 1]], f64::NEG_INFINITY);
        assert_eq!(scores[[4, 1]], f64::NEG_INFINITY);
        assert!(scores[[5, 1]].is_finite());
    }

    #[test]
    fn surrogate_mass_never_overflows_with_a_shift() {
        assert_eq!(surrogate_mass(&1000.0, &1000.0), 1.0);
        assert!((surrogate_mass(&999.0, &1000.0) - (-1f64).exp()).abs() < 1e-16);
    }

    #[test]
    fn exact_masses_and_large_scores_stay_finite() {
        let (q, k, v, l) = sequence();
        let big = (q.mapv(|x| x * 400.0), k.mapv(|x| x * 4.0), v, l);
        let retrieved = array![[-1], [-1], [-1], [-1], [0], [1]];
        for mass in [ChunkMass::Surrogate, ChunkMass::Exact] {
            let out = factorized_output(inputs(&big), retrieved.view(), CONFIG, mass, ()).expect("valid");
            assert!(out.o.iter().chain(out.lse.iter()).all(|x| x.is_finite()), "{out:?}");
        }
        // Query 0 reads key 0 alone.
        let out = factorized_output(inputs(&big), retrieved.view(), CONFIG, ChunkMass::Exact, ()).expect("valid");
        assert_eq!(out.o[[0, 0]], 0.0);
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let data = sequence();
        let ok = array![[-1], [-1], [-1], [-1], [0], [1]];
        let run = |d: &(Array2<f64>, Array2<f64>, Array2<f64>, Array2<f64>), r: &Array2<i32>, c: HilsConfig| {
            factorized_output(inputs(d), r.view(), c, ChunkMass::Surrogate, ())
        };
        assert!(run(&data, &ok, CONFIG).is_ok());
        let not_eligible = array![[-1], [-1], [-1], [-1], [1], [1]];
        assert!(matches!(
            run(&data, &not_eligible, CONFIG),
            Err(OracleError::IndexList { argument: "retrieved", ref position, .. }) if position == &vec![4, 0]
        ));
        let out_of_range = array![[-1], [-1], [-1], [-1], [0], [3]];
        assert!(matches!(run(&data, &out_of_range, CONFIG), Err(OracleError::IndexList { argument: "retrieved", .. })));
        assert!(matches!(
            run(&data, &array![[-1]], CONFIG),
            Err(OracleError::ShapeMismatch { argument: "retrieved", .. })
        ));
        for (config, argument) in [
            (HilsConfig { chunk_size: 0, ..CONFIG }, "chunk_size"),
            (HilsConfig { local_window: 0, ..CONFIG }, "local_window"),
        ] {
            assert!(
                matches!(run(&data, &ok, config), Err(OracleError::ZeroDimension { argument: a }) if a == argument)
            );
        }
        let (q, k, v, l) = data.clone();
        let few_landmarks = (q.clone(), k.clone(), v.clone(), l.slice_axis(Axis(0), Slice::from(0..2)).to_owned());
        assert!(matches!(
            run(&few_landmarks, &ok, CONFIG),
            Err(OracleError::ShapeMismatch { argument: "landmarks", .. })
        ));
        let short_keys = (q.clone(), k.slice_axis(Axis(0), Slice::from(0..5)).to_owned(), v.clone(), l.clone());
        assert!(matches!(run(&short_keys, &ok, CONFIG), Err(OracleError::ShapeMismatch { argument: "key", .. })));
        let mut nan_v = v.clone();
        nan_v[[3, 0]] = f64::NAN;
        assert!(matches!(
            run(&(q.clone(), k.clone(), nan_v, l.clone()), &ok, CONFIG),
            Err(OracleError::NonFinite { argument: "value", .. })
        ));
        let mut inf_l = l.clone();
        inf_l[[1, 1]] = f64::INFINITY;
        assert!(matches!(
            route(inputs(&(q.clone(), k.clone(), v.clone(), inf_l)), CONFIG, ()),
            Err(OracleError::NonFinite { argument: "landmarks", .. })
        ));
        let no_dim = Array2::<f64>::zeros((6, 0));
        assert!(matches!(
            route(inputs(&(no_dim.clone(), no_dim.clone(), v, Array2::zeros((3, 0)))), CONFIG, ()),
            Err(OracleError::ZeroDimension { argument: "head_dim" })
        ));
        let keys = array![[1.0, 2.0]];
        assert!(matches!(
            summarize_chunk(array![1.0].view(), keys.view(), ()),
            Err(OracleError::ShapeMismatch { argument: "landmark", .. })
        ));
        assert!(matches!(
            chunk_log_mass(array![1.0, 0.0].view(), Array2::<f64>::zeros((0, 2)).view(), ()),
            Err(OracleError::ZeroDimension { argument: "keys" })
        ));
        let summary = summarize_chunk(array![1.0, 0.0].view(), keys.view(), ()).expect("valid");
        assert!(matches!(
            router_score(array![f64::NAN, 0.0].view(), &summary, ()),
            Err(OracleError::NonFinite { argument: "query", .. })
        ));
    }
}
