//! Theorems of NSA (E18–E20): the complete-window count, the Eq. 9 remap of window
//! probabilities onto selection blocks (overlap form, brute-force token count, the paper's
//! re-indexed double sum), the forced and causal top-n selection shared by a GQA group, the
//! selection branch reducing to dense causal attention when every block is selected, the CSR
//! transpose of a selection, the gradients of the gated sum of the three branches, of the
//! compression map and of the whole layer (selection held fixed, its compression maps' own
//! parameters included, summed over the KV heads that share them) against finite differences, and
//! the position-wise maps as special cases of the learned matrix.
//!
//! Discrete statements (counts, index lists) are checked exactly: the integers found and required
//! are compared with [`agree`] at [`EXACT`], so a violation reports the first index where they
//! differ.

use attnproof_oracle::nsa::{
    BlockQueries, Compression, CompressionGradients, GateGradients, MapGradient, NsaConfig, NsaForward, NsaInputs,
    block_scores, compress, compress_backward, gate_combine, gate_combine_backward, nsa_forward, remap_to_blocks,
    select_blocks, selection_blocks,
};
use attnproof_oracle::nsa_backward::{NsaGradients, nsa_backward, nsa_forward_with_selection};
use attnproof_oracle::topk::validate_index_row;
use attnproof_oracle::{Mp, OracleError, Precision, Real};
use ndarray::{Array2, Array3, ArrayD, ArrayView2, ArrayView3, Axis, IxDyn};

use crate::definition;
use crate::residual::{Agreement, Bits, Violation, agree};

/// The threshold of an exact comparison: any difference is a violation.
pub const EXACT: Bits = Bits(f64::INFINITY);

/// Compares two integer arrays exactly (through [`agree`], so a violation names the index).
fn exact(
    theorem: &'static str,
    quantity: &'static str,
    found: &ArrayD<i64>,
    expected: &ArrayD<i64>,
) -> Result<Agreement, Violation> {
    if found.shape() != expected.shape() {
        return Err(Violation::Residual {
            theorem,
            quantity,
            found: Bits(f64::NEG_INFINITY),
            required: EXACT,
            index: found.shape().to_vec(),
        });
    }
    // 64 bits hold every i64 exactly.
    let to_mp = |x: &ArrayD<i64>| x.mapv(|v| Mp::new(v as f64, Precision(64)));
    agree(theorem, quantity, &to_mp(found), &to_mp(expected), EXACT)
}

/// A 1-D integer array as an [`ArrayD`].
fn ints(values: Vec<i64>) -> ArrayD<i64> {
    ArrayD::from_shape_vec(IxDyn(&[values.len()]), values).expect("length matches")
}

/// An implementation that refused input the theorem considers valid.
fn refused(theorem: &'static str, error: OracleError) -> Violation {
    Violation::Hypothesis { theorem, reason: format!("the implementation refused the input: {error}") }
}

fn check_config(theorem: &'static str, config: &NsaConfig) -> Result<(), Violation> {
    config.validate().map_err(|e| Violation::Hypothesis { theorem, reason: format!("invalid config: {e}") })
}

/// A complete-window count under test: `(position, l, s) ↦ number of complete windows`.
pub type WindowCountFn<'a> = &'a dyn Fn(usize, usize, usize) -> Result<usize, OracleError>;

/// **Theorem (E18: complete windows).** For every position `t ≤ max_position`, the count under
/// test equals the number of windows `c ≥ 0` with `c·s + l − 1 ≤ t`, counted one by one (the
/// closed form is `⌊(t+1−l)/s⌋ + 1` for `t + 1 ≥ l`, else 0). Hypotheses: `l, s > 0`. Exact.
pub fn complete_window_count(
    count: WindowCountFn<'_>,
    max_position: usize,
    compress_len: usize,
    compress_stride: usize,
) -> Result<Agreement, Violation> {
    const T: &str = "complete_window_count (E18)";
    if compress_len == 0 || compress_stride == 0 {
        return Err(Violation::Hypothesis { theorem: T, reason: "l and s must be positive".into() });
    }
    let mut found = Vec::new();
    let mut expected = Vec::new();
    for t in 0..=max_position {
        found.push(count(t, compress_len, compress_stride).map_err(|e| refused(T, e))? as i64);
        let mut windows = 0;
        while windows * compress_stride + compress_len - 1 <= t {
            windows += 1;
        }
        expected.push(windows as i64);
    }
    exact(T, "complete windows", &ints(found), &ints(expected))
}

/// A remap under test: `(p_cmp [rows, W], n_blocks, config) ↦ p_slc [rows, n_blocks]`.
pub type RemapFn<'a> = &'a dyn Fn(ArrayView2<'_, Mp>, usize, &NsaConfig) -> Result<Array2<Mp>, OracleError>;

/// The oracle's remap ([`remap_to_blocks`]).
pub fn oracle_remap(p_cmp: ArrayView2<'_, Mp>, n_blocks: usize, config: &NsaConfig) -> Result<Array2<Mp>, OracleError> {
    let ctx = p_cmp.first().map(|x| x.ctx()).unwrap_or_default();
    remap_to_blocks(p_cmp, n_blocks, config, ctx)
}

/// The remap by brute force over every (window, token) pair: each token `x` of window `c`
/// (`cs ≤ x < cs + l`) adds `p_cmp[c]/s` to the block `⌊x/l'⌋` that holds it (tokens of blocks
/// `≥ n_blocks` are dropped).
pub fn token_count_remap(p_cmp: ArrayView2<'_, Mp>, n_blocks: usize, config: &NsaConfig, ctx: Precision) -> Array2<Mp> {
    let stride = Mp::new(config.compress_stride as f64, ctx);
    let mut out = Array2::from_elem((p_cmp.nrows(), n_blocks), Mp::zero(ctx));
    for c in 0..p_cmp.ncols() {
        for token in c * config.compress_stride..c * config.compress_stride + config.compress_len {
            let block = token / config.select_block;
            if block < n_blocks {
                for r in 0..p_cmp.nrows() {
                    out[[r, block]] += p_cmp[[r, c]].clone() / stride.clone();
                }
            }
        }
    }
    out
}

/// **Theorem (E19 (a): overlap form = token count).** For any window probabilities `p_cmp`
/// `[rows, W]`, the remap under test equals [`token_count_remap`], i.e.
/// `p_slc[j] = Σ_c p_cmp[c]·|window c ∩ block j|/s` with the intersection counted token by
/// token. Hypotheses: a valid config. Checked to `required` bits.
pub fn remap_matches_token_count(
    remap: RemapFn<'_>,
    p_cmp: ArrayView2<'_, Mp>,
    n_blocks: usize,
    config: &NsaConfig,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "remap_matches_token_count (E19)";
    check_config(T, config)?;
    let ctx = p_cmp.first().map(|x| x.ctx()).unwrap_or_default();
    let found = remap(p_cmp, n_blocks, config).map_err(|e| refused(T, e))?;
    let expected = token_count_remap(p_cmp, n_blocks, config, ctx);
    if found.dim() != expected.dim() {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("remap shape {:?}", found.dim()) });
    }
    agree(T, "p_slc", &found, &expected, required)
}

/// The paper's double sum (Eq. 9) re-indexed by `+(l'/s − 1)`:
/// `p_slc[j] = Σ_{m<l'/s} Σ_{n<l/s} p_cmp[(l'/s)·j − m − n + (l'/s − 1)]`, out-of-range window
/// indices contributing 0. Requires `s | l` and `s | l'`.
pub fn reindexed_paper_sum(
    p_cmp: ArrayView2<'_, Mp>,
    n_blocks: usize,
    config: &NsaConfig,
    ctx: Precision,
) -> Array2<Mp> {
    let blocks_per = config.select_block / config.compress_stride;
    let windows_per = config.compress_len / config.compress_stride;
    let mut out = Array2::from_elem((p_cmp.nrows(), n_blocks), Mp::zero(ctx));
    for j in 0..n_blocks {
        for m in 0..blocks_per {
            for n in 0..windows_per {
                // Window (l'/s)·j + (l'/s − 1) − m − n, computed without going below zero.
                let Some(c) = (blocks_per * j + blocks_per - 1).checked_sub(m + n) else { continue };
                if c < p_cmp.ncols() {
                    for r in 0..p_cmp.nrows() {
                        out[[r, j]] += p_cmp[[r, c]].clone();
                    }
                }
            }
        }
    }
    out
}

/// **Theorem (E19 (b): the paper's double sum, re-indexed, is the overlap form).** For `s | l`
/// and `s | l'`, the remap under test equals [`reindexed_paper_sum`] for any `p_cmp`. The
/// un-shifted paper sum lands on windows `4j−4 … 4j` (for `l=32, s=16, l'=64`) and is
/// rejected. Hypotheses: a valid config with `s | l`, `s | l'`. Checked to `required` bits.
pub fn paper_double_sum_reindexed(
    remap: RemapFn<'_>,
    p_cmp: ArrayView2<'_, Mp>,
    n_blocks: usize,
    config: &NsaConfig,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "paper_double_sum_reindexed (E19)";
    check_config(T, config)?;
    if !config.compress_len.is_multiple_of(config.compress_stride)
        || !config.select_block.is_multiple_of(config.compress_stride)
    {
        return Err(Violation::Hypothesis { theorem: T, reason: "s must divide l and l'".into() });
    }
    let ctx = p_cmp.first().map(|x| x.ctx()).unwrap_or_default();
    let found = remap(p_cmp, n_blocks, config).map_err(|e| refused(T, e))?;
    let expected = reindexed_paper_sum(p_cmp, n_blocks, config, ctx);
    if found.dim() != expected.dim() {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("remap shape {:?}", found.dim()) });
    }
    agree(T, "p_slc", &found, &expected, required)
}

/// The weights `[W, n_blocks]` a remap gives each window: row `c` is the remap of the unit
/// vector `e_c`. For a linear remap, `p_slc = p_cmp · weights`.
pub fn measured_remap_weights(
    remap: RemapFn<'_>,
    n_windows: usize,
    n_blocks: usize,
    config: &NsaConfig,
    ctx: Precision,
) -> Result<Array2<Mp>, OracleError> {
    let identity =
        Array2::from_shape_fn((n_windows, n_windows), |(r, c)| if r == c { Mp::one(ctx) } else { Mp::zero(ctx) });
    remap(identity.view(), n_blocks, config)
}

/// **Theorem (E19 (c): remap weights are window overlaps).** The weight the remap under test
/// gives window `c` in block `j` (measured on unit vectors, [`measured_remap_weights`]) is the
/// number of tokens they share divided by `s`, counted token by token. With `l=32, s=16,
/// l'=64` this makes block `j` weigh windows `4j−1 … 4j+3` by `1, 2, 2, 2, 1` (the test derives
/// these from the count). Hypotheses: a valid config. Checked to `required` bits.
pub fn remap_weights_are_overlaps(
    remap: RemapFn<'_>,
    n_windows: usize,
    n_blocks: usize,
    config: &NsaConfig,
    ctx: Precision,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "remap_weights_are_overlaps (E19)";
    check_config(T, config)?;
    let found = measured_remap_weights(remap, n_windows, n_blocks, config, ctx).map_err(|e| refused(T, e))?;
    let identity =
        Array2::from_shape_fn((n_windows, n_windows), |(r, c)| if r == c { Mp::one(ctx) } else { Mp::zero(ctx) });
    let expected = token_count_remap(identity.view(), n_blocks, config, ctx);
    if found.dim() != expected.dim() {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("weights shape {:?}", found.dim()) });
    }
    agree(T, "weights", &found, &expected, required)
}

/// Per-head window probabilities and the grouping they are selected under.
#[derive(Clone, Debug)]
pub struct SelectionCase {
    /// `p_cmp` `[Hq, T, W]` (any non-negative values: the selection only ranks them).
    pub p_cmp: Array3<Mp>,
    /// KV heads `Hkv` (`Hq % Hkv == 0`).
    pub n_heads_kv: usize,
    /// The NSA parameters.
    pub config: NsaConfig,
}

/// A selector under test: the blocks each query head attends to, `[T, Hq, n]`.
pub type SelectorFn<'a> = &'a dyn Fn(&SelectionCase) -> Result<Array3<i32>, OracleError>;

/// The oracle's selector: [`block_scores`] then [`select_blocks`] per KV head, handed to each
/// query head of the group.
pub fn oracle_selector(case: &SelectionCase) -> Result<Array3<i32>, OracleError> {
    let (n_heads_q, len, _) = case.p_cmp.dim();
    let ctx = case.p_cmp.first().map(|x| x.ctx()).unwrap_or_default();
    let n_blocks = selection_blocks(len, case.config.select_block)?;
    let scores = block_scores(case.p_cmp.view(), case.n_heads_kv, n_blocks, &case.config, ctx)?;
    let per_kv = select_blocks(scores.view(), &case.config)?;
    let group = n_heads_q / case.n_heads_kv;
    Ok(Array3::from_shape_fn((len, n_heads_q, case.config.n_selected), |(t, h, slot)| per_kv[[t, h / group, slot]]))
}

/// **Theorem (E19: forced, causal, shared top-n).** For every query `t` and query head `h`, the
/// selection under test is a valid index row (ascending, distinct, in `0..M`, `−1` padded to
/// `n`); it contains every forced block (the first `n_forced_initial` and the `n_forced_local`
/// most recent eligible ones); it contains no block starting after `t`; it has
/// `min(n, #eligible)` entries; it is identical for the `G` heads of a KV head; and no
/// unselected eligible block outranks a selected non-forced one under the group-summed,
/// token-count-remapped scores (up to a relative `2^-200`, for rounding). Hypotheses: a valid
/// config, `Hq % Hkv == 0`. Exact.
pub fn selection_invariants(selector: SelectorFn<'_>, case: &SelectionCase) -> Result<Agreement, Violation> {
    const T: &str = "selection_invariants (E19)";
    let config = &case.config;
    check_config(T, config)?;
    let (n_heads_q, len, n_windows) = case.p_cmp.dim();
    if case.n_heads_kv == 0 || !n_heads_q.is_multiple_of(case.n_heads_kv) {
        return Err(Violation::Hypothesis { theorem: T, reason: "Hq must be a multiple of Hkv".into() });
    }
    let ctx = case.p_cmp.first().map(|x| x.ctx()).unwrap_or_default();
    let group = n_heads_q / case.n_heads_kv;
    let n_blocks = len.div_ceil(config.select_block);
    let selection = selector(case).map_err(|e| refused(T, e))?;
    let width = config.n_selected;
    if selection.dim() != (len, n_heads_q, width) {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("selection shape {:?}", selection.dim()) });
    }
    // Scores as the theorem computes them: group sum, then the token-count remap.
    let scores: Vec<Array2<Mp>> = (0..case.n_heads_kv)
        .map(|kv| {
            let summed = Array2::from_shape_fn((len, n_windows), |(t, c)| {
                (kv * group..(kv + 1) * group).fold(Mp::zero(ctx), |acc, h| acc + case.p_cmp[[h, t, c]].clone())
            });
            token_count_remap(summed.view(), n_blocks, config, ctx)
        })
        .collect();
    let tolerance = Mp::new(2f64.powi(-200), ctx);
    let shape = IxDyn(&[len, n_heads_q]);
    let mut found = [(); 6].map(|_| ArrayD::<i64>::zeros(shape.clone()));
    let mut expected = [(); 6].map(|_| ArrayD::<i64>::zeros(shape.clone()));
    for t in 0..len {
        let forced = config.forced_blocks(t);
        let eligible = (0..n_blocks).filter(|&j| config.block_eligible(j, t)).count();
        for h in 0..n_heads_q {
            let idx = IxDyn(&[t, h]);
            let row: Vec<i32> = selection.index_axis(Axis(0), t).row(h).to_vec();
            let leader: Vec<i32> = selection.index_axis(Axis(0), t).row(h / group * group).to_vec();
            let chosen = validate_index_row("selection", t, &row, n_blocks);
            found[0][&idx] = i64::from(chosen.is_ok());
            expected[0][&idx] = 1;
            let chosen = chosen.unwrap_or_default();
            found[1][&idx] = forced.iter().filter(|f| chosen.contains(f)).count() as i64;
            expected[1][&idx] = forced.len() as i64;
            found[2][&idx] = chosen.iter().filter(|&&j| !config.block_eligible(j, t)).count() as i64;
            found[3][&idx] = chosen.len() as i64;
            expected[3][&idx] = width.min(eligible) as i64;
            found[4][&idx] = row.iter().zip(&leader).filter(|(a, b)| a != b).count() as i64;
            let s = scores[h / group].row(t);
            let mut outranked = 0;
            for &b in chosen.iter().filter(|b| !forced.contains(b)) {
                for u in (0..n_blocks).filter(|u| config.block_eligible(*u, t) && !chosen.contains(u)) {
                    let margin = tolerance.clone() * s[b].clone().abs().max(Mp::one(ctx));
                    if s[u] > s[b].clone() + margin {
                        outranked += 1;
                    }
                }
            }
            found[5][&idx] = outranked;
        }
    }
    let names = [
        "valid index rows",
        "forced blocks kept",
        "future blocks selected",
        "selected count",
        "slots differing from the group's first head",
        "eligible blocks outranking a selected one",
    ];
    let mut agreement = Agreement::exact();
    for ((f, e), name) in found.iter().zip(&expected).zip(names) {
        agreement = agreement.and(exact(T, name, f, e)?);
    }
    Ok(agreement)
}

/// One NSA sequence in MPFR: queries `[T, Hq, d]`, keys `[T, Hkv, d]`, values `[T, Hkv, dv]`.
#[derive(Clone, Debug)]
pub struct NsaCase {
    /// Queries.
    pub q: Array3<Mp>,
    /// Keys.
    pub k: Array3<Mp>,
    /// Values.
    pub v: Array3<Mp>,
    /// The NSA parameters.
    pub config: NsaConfig,
}

impl NsaCase {
    /// Borrowed inputs.
    pub fn inputs(&self) -> NsaInputs<'_, Mp> {
        NsaInputs { q: self.q.view(), k: self.k.view(), v: self.v.view() }
    }
    /// The precision of the case.
    pub fn ctx(&self) -> Precision {
        self.q.first().map(|x| x.ctx()).unwrap_or_default()
    }
}

/// An NSA forward under test, given the case and gate logits `[T, Hq, 3]`.
pub type NsaForwardFn<'a> = &'a dyn Fn(&NsaCase, ArrayView3<'_, Mp>) -> Result<NsaForward<Mp>, OracleError>;

/// The oracle's forward ([`nsa_forward`]).
pub fn oracle_nsa_forward(case: &NsaCase, gate_logits: ArrayView3<'_, Mp>) -> Result<NsaForward<Mp>, OracleError> {
    nsa_forward(case.inputs(), gate_logits, &case.config, case.ctx())
}

/// **Theorem (E18: the selection branch alone, with every block selected, is dense causal
/// attention).** With `n ≥ M` every eligible block is selected; with gate logits `(−∞, +∞, −∞)`
/// (gates `0, 1, 0`) the output `o` and the branch `o_slc` of the forward under test equal,
/// per query head `h`, the definition's causal attention of `q_h` over the keys and values of
/// KV head `h/G`. Hypotheses: a valid config with `n_selected ≥ ⌈T/l'⌉`. Checked to `required`.
pub fn selection_alone_is_dense_when_all_selected(
    forward: NsaForwardFn<'_>,
    case: &NsaCase,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "selection_alone_is_dense_when_all_selected (E18)";
    check_config(T, &case.config)?;
    let (len, n_heads_q, head_dim) = case.q.dim();
    let n_heads_kv = case.k.dim().1;
    let n_blocks = len.div_ceil(case.config.select_block);
    if case.config.n_selected < n_blocks {
        return Err(Violation::Hypothesis {
            theorem: T,
            reason: format!("n = {} < M = {n_blocks}", case.config.n_selected),
        });
    }
    if n_heads_kv == 0 || !n_heads_q.is_multiple_of(n_heads_kv) {
        return Err(Violation::Hypothesis { theorem: T, reason: "Hq must be a multiple of Hkv".into() });
    }
    let ctx = case.ctx();
    let gates = Array3::from_shape_fn((len, n_heads_q, 3), |(_, _, b)| {
        Mp::new(if b == 1 { f64::INFINITY } else { f64::NEG_INFINITY }, ctx)
    });
    let out = forward(case, gates.view()).map_err(|e| refused(T, e))?;
    let scale = case.config.scale_value::<Mp>(head_dim, ctx);
    let causal = Array2::from_shape_fn((len, len), |(i, j)| j <= i);
    let group = n_heads_q / n_heads_kv;
    let mut expected = Array3::from_elem((len, n_heads_q, case.v.dim().2), Mp::zero(ctx));
    for h in 0..n_heads_q {
        let (o, _) = definition::forward(
            case.q.index_axis(Axis(1), h),
            case.k.index_axis(Axis(1), h / group),
            case.v.index_axis(Axis(1), h / group),
            &scale,
            causal.view(),
        );
        expected.index_axis_mut(Axis(1), h).assign(&o);
    }
    if out.o.dim() != expected.dim() || out.selected.dim() != expected.dim() {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("output shape {:?}", out.o.dim()) });
    }
    Ok(agree(T, "o", &out.o, &expected, required)?.and(agree(T, "o_slc", &out.selected, &expected, required)?))
}

/// A CSR transpose under test: `(selection [T, n], n_blocks) ↦ block → selecting queries`.
pub type TransposeFn<'a> = &'a dyn Fn(ArrayView2<'_, i32>, usize) -> Result<BlockQueries, OracleError>;

/// **Theorem (E20: the CSR transpose round-trips).** For a valid selection `[T, n]` over
/// `n_blocks` blocks, the transpose under test has `n_blocks + 1` offsets starting at 0, never
/// decreasing and ending at `nnz` (the number of valid entries) `= indices.len()`; the queries
/// of each block are ascending and in `0..T`; and reading the CSR back (block by block, each
/// query collecting the blocks that list it) gives the selection again. Hypotheses: every row
/// of `selection` obeys the E14 convention. Exact.
pub fn csr_round_trip(
    transpose: TransposeFn<'_>,
    selection: ArrayView2<'_, i32>,
    n_blocks: usize,
) -> Result<Agreement, Violation> {
    const T: &str = "csr_round_trip (E20)";
    let (len, width) = selection.dim();
    let mut nnz = 0;
    for (t, row) in selection.rows().into_iter().enumerate() {
        nnz += validate_index_row("selection", t, &row.to_vec(), n_blocks)
            .map_err(|e| Violation::Hypothesis { theorem: T, reason: e.to_string() })?
            .len();
    }
    let csr = transpose(selection, n_blocks).map_err(|e| refused(T, e))?;
    let o = &csr.offsets;
    let mut agreement = exact(T, "offsets length", &ints(vec![o.len() as i64]), &ints(vec![n_blocks as i64 + 1]))?;
    agreement = agreement.and(exact(T, "first offset", &ints(vec![i64::from(o[0])]), &ints(vec![0]))?);
    let decreases: Vec<i64> = o.windows(2).map(|w| i64::from(w[1] < w[0])).collect();
    agreement = agreement.and(exact(T, "offset decreases", &ints(decreases.clone()), &ints(vec![0; decreases.len()]))?);
    let ends = vec![i64::from(o[n_blocks]), csr.indices.len() as i64];
    agreement = agreement.and(exact(T, "last offset and indices length", &ints(ends), &ints(vec![nnz as i64; 2]))?);
    // The offsets are now a valid partition of the indices: read the CSR back.
    let mut rebuilt = Array2::from_elem((len, width), -1i32);
    let mut filled = vec![0usize; len];
    let mut misplaced = vec![0i64; n_blocks];
    for b in 0..n_blocks {
        let queries = &csr.indices[o[b] as usize..o[b + 1] as usize];
        for (i, &q) in queries.iter().enumerate() {
            let in_range = q >= 0 && (q as usize) < len;
            let ascending = i == 0 || queries[i - 1] < q;
            if !in_range || !ascending || filled[q as usize] == width {
                misplaced[b] += 1;
                continue;
            }
            rebuilt[[q as usize, filled[q as usize]]] = b as i32;
            filled[q as usize] += 1;
        }
    }
    agreement =
        agreement.and(exact(T, "queries out of range or order per block", &ints(misplaced), &ints(vec![0; n_blocks]))?);
    let as_i64 = |x: ArrayView2<'_, i32>| x.mapv(i64::from).into_dyn();
    Ok(agreement.and(exact(T, "selection read back", &as_i64(rebuilt.view()), &as_i64(selection))?))
}

/// A gated sum's backward under test: `(branch outputs, gate logits, dO) ↦` its gradients (E18).
pub type GateBackwardFn<'a> = &'a dyn Fn(
    [ArrayView3<'_, Mp>; 3],
    ArrayView3<'_, Mp>,
    ArrayView3<'_, Mp>,
    Precision,
) -> Result<GateGradients<Mp>, OracleError>;

/// The oracle's gated-sum backward ([`gate_combine_backward`]) as a [`GateBackwardFn`].
pub fn oracle_gate_backward(
    branches: [ArrayView3<'_, Mp>; 3],
    gate_logits: ArrayView3<'_, Mp>,
    d_out: ArrayView3<'_, Mp>,
    precision: Precision,
) -> Result<GateGradients<Mp>, OracleError> {
    gate_combine_backward(branches, gate_logits, d_out, precision)
}

/// The inputs of the gates' gradient theorem: branch outputs `[T, Hq, dv]` in [`attnproof_oracle::nsa::Branch`]
/// order, gate logits `[T, Hq, 3]`, the upstream gradient `dO` `[T, Hq, dv]`, at `precision`.
#[derive(Clone, Debug)]
pub struct GateCase {
    /// `o_cmp`, `o_slc`, `o_win`.
    pub branches: [Array3<Mp>; 3],
    /// `x`.
    pub gate_logits: Array3<Mp>,
    /// `dO`.
    pub d_out: Array3<Mp>,
    /// The precision of every value and evaluation.
    pub precision: Precision,
}

/// The three branch outputs as views.
fn branch_views(b: &[Array3<Mp>; 3]) -> [ArrayView3<'_, Mp>; 3] {
    [b[0].view(), b[1].view(), b[2].view()]
}

/// **Theorem (E18, the gates).** For the loss `L = Σ dO ∘ o` with `o = Σ_b σ(x_b) o_b` (the oracle's
/// [`gate_combine`]), the gradients of the backward under test, `dO_b` with respect to every branch element and
/// `∂L/∂x_b` with respect to every gate logit, equal the central differences `(L(v + h) − L(v − h)) / 2h` with
/// `h = 2^-step_bits`. Hypothesis: the precision exceeds `2·step_bits + required` bits, so that the `O(h²)`
/// truncation (σ's third derivative is below 1) and the `O(2^-prec / h)` cancellation stay below `2^-required`.
pub fn gate_gradients_match_finite_differences(
    backward: GateBackwardFn<'_>,
    case: &GateCase,
    step_bits: u32,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "gate_gradients_match_finite_differences (E18)";
    let prec = case.precision;
    if (prec.0 as f64) < 2.0 * step_bits as f64 + required.0 {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("precision {} too low", prec.0) });
    }
    let grads = backward(branch_views(&case.branches), case.gate_logits.view(), case.d_out.view(), prec)
        .map_err(|e| refused(T, e))?;
    let loss = |branches: &[Array3<Mp>; 3], logits: &Array3<Mp>| -> Result<Mp, Violation> {
        let (_, o) = gate_combine(branch_views(branches), logits.view(), prec).map_err(|e| refused(T, e))?;
        Ok(o.iter().zip(case.d_out.iter()).fold(Mp::zero(prec), |acc, (o, g)| acc + o.clone() * g.clone()))
    };
    let h = Mp(rug::Float::with_val(prec.0, rug::Float::i_exp(1, -(step_bits as i32))));
    let two_h = h.clone() + h.clone();
    let central = |eval: &dyn Fn(&Mp) -> Result<Mp, Violation>| -> Result<Mp, Violation> {
        Ok((eval(&h)? - eval(&-h.clone())?) / two_h.clone())
    };
    let mut numeric_logits = Array3::from_elem(case.gate_logits.raw_dim(), Mp::zero(prec));
    for (idx, x) in case.gate_logits.indexed_iter() {
        numeric_logits[idx] = central(&|delta| {
            let mut moved = case.gate_logits.clone();
            moved[idx] = x.clone() + delta.clone();
            loss(&case.branches, &moved)
        })?;
    }
    let mut agreement = agree(T, "dx", &grads.d_gate_logits, &numeric_logits, required)?;
    for (b, name) in [(0, "dO_cmp"), (1, "dO_slc"), (2, "dO_win")] {
        let mut numeric = Array3::from_elem(case.d_out.raw_dim(), Mp::zero(prec));
        for (idx, v) in case.branches[b].indexed_iter() {
            numeric[idx] = central(&|delta| {
                let mut moved = case.branches.clone();
                moved[b][idx] = v.clone() + delta.clone();
                loss(&moved, &case.gate_logits)
            })?;
        }
        agreement = agreement.and(agree(T, name, &grads.d_branches[b], &numeric, required)?);
    }
    Ok(agreement)
}

/// A compression backward under test: `(x [T, d], φ, dx̃ [W, d], config, precision) ↦ (dx, φ's gradient)`.
pub type CompressionBackwardFn<'a> = &'a dyn Fn(
    ArrayView2<'_, Mp>,
    &Compression,
    ArrayView2<'_, Mp>,
    &NsaConfig,
    Precision,
) -> Result<CompressionGradients<Mp>, OracleError>;

/// The oracle's compression backward ([`compress_backward`]) as a [`CompressionBackwardFn`].
pub fn oracle_compress_backward(
    x: ArrayView2<'_, Mp>,
    map: &Compression,
    d_compressed: ArrayView2<'_, Mp>,
    config: &NsaConfig,
    precision: Precision,
) -> Result<CompressionGradients<Mp>, OracleError> {
    compress_backward(x, map, d_compressed, config, precision)
}

/// The inputs of the compression's gradient theorem: one head's rows, the map, the upstream gradient of the
/// compressed rows, the configuration (its `compress_keys` is ignored: the map is `map`), the precision.
#[derive(Clone, Debug)]
pub struct CompressionCase {
    /// `x` `[T, d]`.
    pub x: Array2<Mp>,
    /// `φ`. Its weights must leave `w ± 2^-step_bits` exact in f64 (the theorem moves them there).
    pub map: Compression,
    /// `dx̃` `[W, d]`.
    pub d_compressed: Array2<Mp>,
    /// `l`, `s`.
    pub config: NsaConfig,
    /// The precision of every value and evaluation.
    pub precision: Precision,
}

/// **Theorem (E18, the compression's gradients).** For the loss `L = Σ dx̃ ∘ φ(x)` with the oracle's [`compress`],
/// the backward under test's `∂L/∂x` (every token, those of no complete window included) and its gradient of φ's
/// weights (none for the mean, `[l]` for position weights, `[l·d, d]` for the matrix) equal the central differences
/// `(L(v + h) − L(v − h)) / 2h`, `h = 2^-step_bits`. `L` is linear in `x` and in the weights, so the difference has no
/// truncation error; only the `O(2^-prec / h)` cancellation remains. Hypotheses: the precision exceeds
/// `step_bits + required + 16` bits, and every weight `w` has `w ± h` exact in f64 (the map stores f64).
pub fn compression_gradients_match_finite_differences(
    backward: CompressionBackwardFn<'_>,
    case: &CompressionCase,
    step_bits: u32,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "compression_gradients_match_finite_differences (E18)";
    let prec = case.precision;
    if (prec.0 as f64) < step_bits as f64 + required.0 + 16.0 {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("precision {} too low", prec.0) });
    }
    check_config(T, &case.config)?;
    let h64 = 2f64.powi(-(step_bits as i32));
    check_weight_steps(T, &case.map, &[h64])?;
    let grads =
        backward(case.x.view(), &case.map, case.d_compressed.view(), &case.config, prec).map_err(|e| refused(T, e))?;
    let loss = |x: &Array2<Mp>, map: &Compression| -> Result<Mp, Violation> {
        let y = compress(x.view(), map, &case.config, prec).map_err(|e| refused(T, e))?;
        Ok(y.iter().zip(case.d_compressed.iter()).fold(Mp::zero(prec), |acc, (y, g)| acc + y.clone() * g.clone()))
    };
    let h = Mp::new(h64, prec);
    let two_h = h.clone() + h.clone();
    let mut numeric_dx = Array2::from_elem(case.x.raw_dim(), Mp::zero(prec));
    for (idx, v) in case.x.indexed_iter() {
        let moved = |delta: &Mp| {
            let mut x = case.x.clone();
            x[idx] = v.clone() + delta.clone();
            loss(&x, &case.map)
        };
        numeric_dx[idx] = (moved(&h)? - moved(&-h.clone())?) / two_h.clone();
    }
    let mut agreement = agree(T, "dx", &grads.dx, &numeric_dx, required)?;
    // The weights' differences: each weight moved by ±h in its own f64 (exact by the hypothesis).
    let found_map = flat_map_gradient(T, "d_map", &grads.d_map, &case.map, required)?;
    let weight_difference = |k: usize| -> Result<Mp, Violation> {
        Ok((loss(&case.x, &moved_map(&case.map, k, h64))? - loss(&case.x, &moved_map(&case.map, k, -h64))?)
            / two_h.clone())
    };
    let numeric_map: Vec<Mp> = (0..found_map.len()).map(weight_difference).collect::<Result<_, _>>()?;
    if !numeric_map.is_empty() {
        agreement = agreement.and(agree(T, "d_map", &flat(found_map), &flat(numeric_map), required)?);
    }
    Ok(agreement)
}

/// The f64 weights of `map` in the order of its gradient's entries: `w_i` for position weights, `W` row-major
/// (`W[r, k]` at `r·d + k`) for the matrix, none for the mean.
fn map_weights(map: &Compression) -> Vec<f64> {
    match map {
        Compression::Mean => vec![],
        Compression::Weighted(w) => w.clone(),
        Compression::Linear(w) => w.iter().copied().collect(),
    }
}

/// `map` with its weight number `k` (in [`map_weights`] order) moved by `delta` in f64; the mean has no weight and
/// comes back as it is.
fn moved_map(map: &Compression, k: usize, delta: f64) -> Compression {
    let mut moved = map.clone();
    match &mut moved {
        Compression::Mean => {}
        Compression::Weighted(w) => w[k] += delta,
        Compression::Linear(w) => {
            let cols = w.ncols();
            w[[k / cols, k % cols]] += delta;
        }
    }
    moved
}

/// The hypothesis of a difference in a map's weights: the map stores f64, so every weight `w` must have `w ± h` exact
/// in f64 for each step `h`, or the difference would divide a rounded move by the unrounded step.
fn check_weight_steps(theorem: &'static str, map: &Compression, steps: &[f64]) -> Result<(), Violation> {
    for w in map_weights(map) {
        if let Some(h) = steps.iter().find(|&&h| !sum_is_exact(w, h) || !sum_is_exact(w, -h)) {
            return Err(Violation::Hypothesis {
                theorem,
                reason: format!("weight {w} ± 2^{} is not exact in f64", h.log2()),
            });
        }
    }
    Ok(())
}

/// Whether `a + b` is exact in f64: Knuth's TwoSum recovers the rounding error of the sum exactly (barring overflow).
/// Comparing `(a + b) − a` with `b` alone is not enough: for `|a|` far below `b`'s last bit the sum rounds to `b`, and
/// the difference gives `b` back although `a` was lost.
fn sum_is_exact(a: f64, b: f64) -> bool {
    let sum = a + b;
    let b_part = sum - a;
    sum.is_finite() && (a - (sum - b_part)) + (b - b_part) == 0.0
}

/// The map gradient under test in [`map_weights`] order. A gradient of another kind or shape than `map`'s
/// parameters is the implementation's fault, reported as a residual that no threshold accepts, at the found shape.
fn flat_map_gradient(
    theorem: &'static str,
    quantity: &'static str,
    found: &MapGradient<Mp>,
    map: &Compression,
    required: Bits,
) -> Result<Vec<Mp>, Violation> {
    match (found, map) {
        (MapGradient::Mean, Compression::Mean) => Ok(vec![]),
        (MapGradient::Weighted(d), Compression::Weighted(w)) if d.len() == w.len() => Ok(d.to_vec()),
        (MapGradient::Linear(d), Compression::Linear(w)) if d.dim() == w.dim() => Ok(d.iter().cloned().collect()),
        (found, _) => Err(Violation::Residual {
            theorem,
            quantity,
            found: Bits(f64::NEG_INFINITY),
            required,
            index: match found {
                MapGradient::Mean => vec![],
                MapGradient::Weighted(d) => d.shape().to_vec(),
                MapGradient::Linear(d) => d.shape().to_vec(),
            },
        }),
    }
}

/// A vector of values as a 1-D [`ArrayD`], the shape [`agree`] compares.
fn flat(values: Vec<Mp>) -> ArrayD<Mp> {
    ArrayD::from_shape_vec(IxDyn(&[values.len()]), values).expect("length matches")
}

/// **Theorem (E18, the learned map generalizes the position-wise ones).** With `W` the `l` blocks `w_i I_d` stacked,
/// [`Compression::Linear`]`(W)` compresses `x` as [`Compression::Weighted`]`(w)` does, and with the blocks `I_d / l`
/// as [`Compression::Mean`] does, to `required` bits. Hypothesis for the mean: `l` is a power of two, so that `1/l`
/// is exact in the f64 of the matrix.
pub fn position_maps_are_linear_maps(
    x: ArrayView2<'_, Mp>,
    weights: &[f64],
    config: &NsaConfig,
    precision: Precision,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "position_maps_are_linear_maps (E18)";
    check_config(T, config)?;
    let (l, d) = (config.compress_len, x.ncols());
    if weights.len() != l || !l.is_power_of_two() {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("{} weights for l = {l}", weights.len()) });
    }
    let stacked =
        |w: &dyn Fn(usize) -> f64| Array2::from_shape_fn((l * d, d), |(r, k)| if r % d == k { w(r / d) } else { 0.0 });
    let run = |map: &Compression| compress(x, map, config, precision).map_err(|e| refused(T, e));
    let weighted = run(&Compression::Weighted(weights.to_vec()))?;
    let as_linear = run(&Compression::Linear(stacked(&|i| weights[i])))?;
    let mean = run(&Compression::Mean)?;
    let mean_as_linear = run(&Compression::Linear(stacked(&|_| 1.0 / l as f64)))?;
    Ok(agree(T, "weighted", &weighted.into_dyn(), &as_linear.into_dyn(), required)?.and(agree(
        T,
        "mean",
        &mean.into_dyn(),
        &mean_as_linear.into_dyn(),
        required,
    )?))
}

/// A layer backward under test: `(Q, K, V, gate logits, selection, dO, config, precision) ↦` the gradients with
/// respect to Q, K, V and the gate logits.
pub type LayerBackwardFn<'a> = &'a dyn Fn(
    NsaInputs<'_, Mp>,
    ArrayView3<'_, Mp>,
    ArrayView3<'_, i32>,
    ArrayView3<'_, Mp>,
    &NsaConfig,
    Precision,
) -> Result<NsaGradients<Mp>, OracleError>;

/// The oracle's layer backward ([`nsa_backward`]) as a [`LayerBackwardFn`].
pub fn oracle_layer_backward(
    inputs: NsaInputs<'_, Mp>,
    gate_logits: ArrayView3<'_, Mp>,
    selection: ArrayView3<'_, i32>,
    d_out: ArrayView3<'_, Mp>,
    config: &NsaConfig,
    precision: Precision,
) -> Result<NsaGradients<Mp>, OracleError> {
    nsa_backward(inputs, gate_logits, selection, d_out, config, precision)
}

/// The inputs of the layer's gradient theorem: the layer's tensors, gate logits `[T, Hq, 3]`, the selection held
/// fixed `[T, Hkv, n]`, the upstream gradient `[T, Hq, dv]`.
#[derive(Clone, Debug)]
pub struct LayerCase {
    /// Q, K, V and the configuration (its precision is every value's).
    pub layer: NsaCase,
    /// `x`.
    pub gate_logits: Array3<Mp>,
    /// The lists the selected branch attends to.
    pub selection: Array3<i32>,
    /// `dO`.
    pub d_out: Array3<Mp>,
}

/// **Theorem (E18, the layer's gradients with the selection held fixed).** For the loss `L = Σ dO ∘ o` with `o` the
/// gated sum of the compressed, selected (over `selection`) and window branches
/// ([`nsa_forward_with_selection`]), the backward under test's `∂L/∂Q`, `∂L/∂K`, `∂L/∂V` and `∂L/∂x` equal the
/// central differences `(L(v + h) − L(v − h)) / 2h`, `h = 2^-step_bits`, for every element. Hypotheses: the precision
/// exceeds `2·step_bits + required` bits (the cancellation `2^-prec / h` stays below `2^-required`), and every input
/// has magnitude at most 4 with head dims at most 8 and the scale at most 1, so that each score is at most 128 in
/// magnitude and `L`'s third derivative along one element, a sum of products of softmax and sigmoid derivatives of
/// such scores, stays far below `2^(2·step_bits − required)`, the truncation `h²/6 · L'''` then below `2^-required`.
/// The gradients of the compression maps' own parameters are
/// [`layer_map_gradients_match_finite_differences`]'s (their f64 weights cannot be moved by so fine a step).
pub fn layer_gradients_match_finite_differences(
    backward: LayerBackwardFn<'_>,
    case: &LayerCase,
    step_bits: u32,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "layer_gradients_match_finite_differences (E18)";
    let prec = case.layer.ctx();
    let config = &case.layer.config;
    if (prec.0 as f64) < 2.0 * step_bits as f64 + required.0 {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("precision {} too low", prec.0) });
    }
    check_layer_bounds(T, case)?;
    let grads =
        backward(case.layer.inputs(), case.gate_logits.view(), case.selection.view(), case.d_out.view(), config, prec)
            .map_err(|e| refused(T, e))?;
    let loss = |q: &Array3<Mp>, k: &Array3<Mp>, v: &Array3<Mp>, x: &Array3<Mp>| {
        layer_loss(T, case, NsaInputs { q: q.view(), k: k.view(), v: v.view() }, x.view(), config)
    };
    let h = Mp(rug::Float::with_val(prec.0, rug::Float::i_exp(1, -(step_bits as i32))));
    let two_h = h.clone() + h.clone();
    let operands = [&case.layer.q, &case.layer.k, &case.layer.v, &case.gate_logits];
    let mut agreement = Agreement::exact();
    for (which, (name, analytic)) in
        [("dq", &grads.dq), ("dk", &grads.dk), ("dv", &grads.dv), ("dx", &grads.d_gate_logits)].into_iter().enumerate()
    {
        let mut numeric = Array3::from_elem(operands[which].raw_dim(), Mp::zero(prec));
        for (idx, value) in operands[which].indexed_iter() {
            let at = |delta: &Mp| {
                let mut moved = operands.map(|x| x.clone());
                moved[which][idx] = value.clone() + delta.clone();
                loss(&moved[0], &moved[1], &moved[2], &moved[3])
            };
            numeric[idx] = (at(&h)? - at(&-h.clone())?) / two_h.clone();
        }
        agreement = agreement.and(agree(T, name, analytic, &numeric, required)?);
    }
    Ok(agreement)
}

/// The layer theorems' hypothesis on magnitudes: Q, K, V and the gate logits at most 4, head dims at most 8 and the
/// scale at most 1, so that each score is at most 128 in magnitude.
fn check_layer_bounds(theorem: &'static str, case: &LayerCase) -> Result<(), Violation> {
    let prec = case.layer.ctx();
    let large = [&case.layer.q, &case.layer.k, &case.layer.v, &case.gate_logits]
        .iter()
        .any(|x| x.iter().any(|v| v.abs() > Mp::new(4.0, prec)));
    let scale = case.layer.config.scale_value::<Mp>(case.layer.q.dim().2, prec);
    if large || case.layer.q.dim().2 > 8 || case.layer.v.dim().2 > 8 || scale.abs() > Mp::one(prec) {
        return Err(Violation::Hypothesis {
            theorem,
            reason: "inputs above 4, head dims above 8 or a scale above 1".to_owned(),
        });
    }
    Ok(())
}

/// The layer theorems' loss `L = Σ dO ∘ o`, `o` the oracle's [`nsa_forward_with_selection`] of `inputs` and
/// `gate_logits` over the case's selection under `config` (the case's own, or one with a moved map weight).
fn layer_loss(
    theorem: &'static str,
    case: &LayerCase,
    inputs: NsaInputs<'_, Mp>,
    gate_logits: ArrayView3<'_, Mp>,
    config: &NsaConfig,
) -> Result<Mp, Violation> {
    let prec = case.layer.ctx();
    let o = nsa_forward_with_selection(inputs, gate_logits, case.selection.view(), config, prec)
        .map_err(|e| refused(theorem, e))?;
    Ok(o.iter().zip(case.d_out.iter()).fold(Mp::zero(prec), |acc, (o, g)| acc + o.clone() * g.clone()))
}

/// The hypothesis that a map keeps each compressed row within the bound of its input rows: position weights with
/// `Σ_i |w_i| ≤ 1`, a matrix whose every column has `Σ_r |W[r, k]| ≤ 1` (the mean has both).
fn check_map_contracts(theorem: &'static str, map: &Compression) -> Result<(), Violation> {
    let column_sums: Vec<f64> = match map {
        Compression::Mean => vec![],
        Compression::Weighted(w) => vec![w.iter().map(|x| x.abs()).sum()],
        Compression::Linear(w) => w.columns().into_iter().map(|c| c.iter().map(|x| x.abs()).sum()).collect(),
    };
    match column_sums.iter().find(|&&sum| sum > 1.0) {
        Some(sum) => Err(Violation::Hypothesis {
            theorem,
            reason: format!("a compression map's weights sum to {sum} in magnitude, above 1"),
        }),
        None => Ok(()),
    }
}

/// **Theorem (E18, the layer's gradients of the compression maps' own parameters, the selection held fixed).** For
/// the loss `L = Σ dO ∘ o` of [`layer_gradients_match_finite_differences`], the backward under test's `d_map_keys`
/// and `d_map_values` equal, for every weight `w` of φ_K (`config.compress_keys`) and of φ_V
/// (`config.compress_values`), the Richardson extrapolation `(4·D(h/2) − D(h)) / 3` of the central differences
/// `D(h) = (L(w + h) − L(w − h)) / 2h`, `h = 2^-step_bits`, each `L` a run of [`nsa_forward_with_selection`] with
/// that one weight moved in the config. Every KV head compresses with the one map, so each difference measures the
/// sum of the heads' gradients. A mean map has no weight, and its gradient must be [`MapGradient::Mean`]; a gradient
/// of another kind or shape than the map's weights is a violation.
///
/// Hypotheses: those of the layer theorem on magnitudes (Q, K, V and the gate logits at most 4, head dims at most
/// 8, the scale at most 1); each map keeps compressed rows within 4 as well (`Σ|w_i| ≤ 1`, or `Σ_r |W[r, k]| ≤ 1`
/// per column), so that scores stay at most 128 and moving one weight by `δ` moves each score by at most `16·δ`;
/// every weight `w` has `w ± h` and `w ± h/2` exact in f64 (the config stores f64, so the step cannot be as fine as
/// the layer theorem's); the precision exceeds `step_bits + required + 16` bits, so that the cancellation
/// `2^-prec / h` of the differences stays below `2^-required`; and `4·step_bits ≥ required + 64`. The extrapolation
/// cancels the `h²·L'''/6` term of `D`, leaving `h⁴·L⁽⁵⁾/480`; the fifth derivative along one weight, a sum over the
/// outputs of softmax derivatives whose score moves are at most 16, stays far below `2^64`, so the truncation is below
/// `2^-required`. The values' map enters `o` linearly, so its differences have no truncation at all.
pub fn layer_map_gradients_match_finite_differences(
    backward: LayerBackwardFn<'_>,
    case: &LayerCase,
    step_bits: u32,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "layer_map_gradients_match_finite_differences (E18)";
    let prec = case.layer.ctx();
    let config = &case.layer.config;
    if (prec.0 as f64) < step_bits as f64 + required.0 + 16.0 {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("precision {} too low", prec.0) });
    }
    if 4.0 * (step_bits as f64) < required.0 + 64.0 {
        return Err(Violation::Hypothesis { theorem: T, reason: format!("the step 2^-{step_bits} is too coarse") });
    }
    check_config(T, config)?;
    check_layer_bounds(T, case)?;
    let h64 = 2f64.powi(-(step_bits as i32));
    for map in [&config.compress_keys, &config.compress_values] {
        check_map_contracts(T, map)?;
        check_weight_steps(T, map, &[h64, h64 / 2.0])?;
    }
    let grads =
        backward(case.layer.inputs(), case.gate_logits.view(), case.selection.view(), case.d_out.view(), config, prec)
            .map_err(|e| refused(T, e))?;
    let with_keys = |map: Compression| NsaConfig { compress_keys: map, ..config.clone() };
    let with_values = |map: Compression| NsaConfig { compress_values: map, ..config.clone() };
    let mut agreement = Agreement::exact();
    for (name, found, map, with_map) in [
        ("d_map_keys", &grads.d_map_keys, &config.compress_keys, &with_keys as &dyn Fn(Compression) -> NsaConfig),
        ("d_map_values", &grads.d_map_values, &config.compress_values, &with_values),
    ] {
        let found = flat_map_gradient(T, name, found, map, required)?;
        let central = |k: usize, step: f64| -> Result<Mp, Violation> {
            let at = |delta: f64| {
                layer_loss(T, case, case.layer.inputs(), case.gate_logits.view(), &with_map(moved_map(map, k, delta)))
            };
            Ok((at(step)? - at(-step)?) / Mp::new(2.0 * step, prec))
        };
        let extrapolated = |k: usize| -> Result<Mp, Violation> {
            let (coarse, fine) = (central(k, h64)?, central(k, h64 / 2.0)?);
            Ok((Mp::new(4.0, prec) * fine - coarse) / Mp::new(3.0, prec))
        };
        let numeric: Vec<Mp> = (0..found.len()).map(extrapolated).collect::<Result<_, _>>()?;
        if !numeric.is_empty() {
            agreement = agreement.and(agree(T, name, &flat(found), &flat(numeric), required)?);
        }
    }
    Ok(agreement)
}
