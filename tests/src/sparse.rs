//! Verifier glue for the sparse schedules: each sparse problem is re-expressed as dense attention
//! under a visibility predicate on a sub-problem whose every head shares that visibility, and then
//! verified with the dense verifier ([`verify_forward`], [`verify_backward`]) and the dense
//! rounding-error model (the sparse recipes are the dense ones; see `attnproof_reference::sparse`).
//!
//! A [`Mask::Predicate`] sees a (query, key) pair but neither the sequence nor the head, while
//! block-sparse lists are per (sequence, query head) and NSA selections per KV head. So:
//!
//! - block-sparse forward: one sub-problem per (sequence, query head), `Hq = Hkv = 1`, mask
//!   `spec.mask ∧ listed(tile(j) ∈ C_{tile(i)})`;
//! - block-sparse backward: the whole problem at once, under the layout's visibility of each
//!   (sequence, query head), which the backward verifier takes per head
//!   ([`BackwardExpectation::with_visibility`]): dK/dV sum over a GQA group whose heads may have
//!   different lists;
//! - NSA: one sub-problem per KV head, `Hq = G`, `Hkv = 1`, mask `causal ∧ selected(block(j))`;
//! - DSA: one sub-problem per (sequence, KV head), `Hq = G`, `Hkv = 1`, mask `selected(j)` from
//!   the list that KV head reads (the reference's MQA layout is the one-KV-head case).
//!
//! Sub-problems are single-sequence varlen specs (`[L, H, D]`, LSE `[H, L]`), so both dense and
//! varlen originals map onto them. The predicate encodings are themselves checked against the
//! oracle's sparse functions by the tests (`block_sparse_forward`, `token_sparse_attention`,
//! `selected_attention`).

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;

use attnproof_oracle::block_sparse::BlockSparseLayout;
use attnproof_oracle::spec::{Operand, Sequence};
use attnproof_oracle::{AttentionSpec, Layout, Mask, Pair, Predicate, Scale};
use attnproof_proofs::flash_bound::FlashRecipe;
use attnproof_reference::Element;
use ndarray::{Array3, ArrayD, ArrayView2, ArrayView3, ArrayViewD, Axis, IxDyn, Slice};
use thiserror::Error;

use crate::backward::{BackwardCandidate, BackwardExpectation};
use crate::flash::{Case, HarnessError, verify_forward};
use crate::verdict::Verdict;

/// Why a sparse case could not be verified.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SparseHarnessError {
    /// The dense verifier refused a sub-problem.
    #[error(transparent)]
    Harness(#[from] HarnessError),
}

/// A single-sequence varlen spec with `n_heads_q` query heads over one KV head.
fn sub_spec(spec: &AttentionSpec, len_q: usize, len_k: usize, n_heads_q: usize, mask: Mask) -> AttentionSpec {
    AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: vec![0, len_q as i32], cu_seqlens_k: vec![0, len_k as i32] },
        n_heads_q,
        n_heads_kv: 1,
        head_dim: spec.head_dim,
        head_dim_v: spec.head_dim_v,
        scale: spec.scale,
        mask,
    }
}

/// Heads `heads` of sequence `seq` of a tensor laid out by `spec`, stacked as `[L, |heads|, D]`.
pub fn stack_heads<T: Clone>(
    spec: &AttentionSpec,
    t: ArrayViewD<'_, T>,
    seq: &Sequence,
    heads: Range<usize>,
    keys: bool,
) -> ArrayD<T> {
    let views: Vec<_> = heads.map(|h| spec.head_rows(t.clone(), seq, h, keys)).collect();
    ndarray::stack(Axis(1), &views).expect("heads share a shape").into_dyn()
}

/// Row statistics (LSE, D) of heads `heads` of sequence `seq`, as `[|heads|, Lq]`.
pub fn stack_row_stats<T: Clone>(
    spec: &AttentionSpec,
    t: ArrayViewD<'_, T>,
    seq: &Sequence,
    heads: Range<usize>,
) -> ArrayD<T> {
    let views: Vec<_> = heads.map(|h| spec.head_row_stat(t.clone(), seq, h)).collect();
    ndarray::stack(Axis(0), &views).expect("heads share a length").into_dyn()
}

/// The sub-case of `case` holding query heads `heads` (all reading one KV head) of sequence
/// `seq`, under `mask`.
pub fn sub_case<T: Element>(case: &Case<T>, seq: &Sequence, heads: Range<usize>, mask: Mask) -> Case<T> {
    let spec = &case.spec;
    let kv = spec.kv_head(heads.start);
    assert_eq!(kv, spec.kv_head(heads.end - 1), "sub_case: heads {heads:?} span KV heads");
    Case {
        spec: sub_spec(spec, seq.len_q, seq.len_k, heads.len(), mask),
        q: stack_heads(spec, case.q.view(), seq, heads.clone(), false),
        k: stack_heads(spec, case.k.view(), seq, kv..kv + 1, true),
        v: stack_heads(spec, case.v.view(), seq, kv..kv + 1, true),
    }
}

/// `spec.mask ∧ (tile(key) listed for tile(query))` for (sequence `seq`, query head `head`).
pub fn listed_tiles_mask(spec: &AttentionSpec, layout: &BlockSparseLayout, seq: &Sequence, head: usize) -> Mask {
    tiles_mask(spec, layout, seq, head, Listing::All)
}

/// Which listed tiles a visibility keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Listing {
    /// Every listed tile: the block-sparse attention itself.
    All,
    /// Every listed tile but the last of each query tile's list (each query's last selected token
    /// or block, for DSA and NSA): the gate's "dropped selected block" wrong answer.
    DropLastPerQueryTile,
}

fn tiles_mask(spec: &AttentionSpec, layout: &BlockSparseLayout, seq: &Sequence, head: usize, listing: Listing) -> Mask {
    let n_tiles = layout.lists.dim().2;
    let listed: Vec<HashSet<usize>> = (0..n_tiles)
        .map(|a| {
            let mut tiles: Vec<usize> = (0..layout.lists.dim().3)
                .map(|w| layout.lists[[seq.index, head, a, w]])
                .filter(|&b| b >= 0)
                .map(|b| b as usize)
                .collect();
            if listing == Listing::DropLastPerQueryTile {
                tiles.pop();
            }
            tiles.into_iter().collect()
        })
        .collect();
    let (q_tile, kv_tile) = (layout.q_tile, layout.kv_tile);
    let predicate = Predicate {
        name: format!("listed tiles (sequence {}, head {head})", seq.index),
        visible: Arc::new(move |p: Pair| listed[p.query / q_tile].contains(&(p.key / kv_tile))),
    };
    Mask::And(vec![spec.mask.clone(), Mask::Predicate(predicate)])
}

/// The most KV tiles of `kv_tile` keys a row of (sequence `seq`, head `head`) visits when a kernel visits only the
/// tiles of its query block's listed key blocks (E14): the longest list among the sequence's own query blocks, times
/// the tiles one block touches. Blocks start at multiples of their size and tiles at multiples of theirs, so a block
/// touches `⌈block/tile⌉` tiles when one size divides the other and may straddle one more otherwise.
pub fn visited_tiles(layout: &BlockSparseLayout, seq: &Sequence, head: usize, kv_tile: usize) -> usize {
    let width = layout.lists.dim().3;
    let longest = (0..seq.len_q.div_ceil(layout.q_tile.max(1)))
        .map(|a| (0..width).filter(|&w| layout.lists[[seq.index, head, a, w]] >= 0).count())
        .max()
        .unwrap_or(0);
    let (block, tile) = (layout.kv_tile, kv_tile.max(1));
    let per_block = block.div_ceil(tile) + usize::from(block % tile != 0 && tile % block != 0);
    longest * per_block
}

/// Verifies a block-sparse forward candidate `(O, LSE)`: one verdict per (sequence, query head). The bound charges
/// each row the rescale steps of the tiles its query block lists ([`visited_tiles`], the recipe's `visited_tiles`),
/// not one per tile of all its keys: a block-sparse kernel that visits an unlisted tile is outside the recipe.
pub fn verify_block_sparse_forward<T: Element>(
    case: &Case<T>,
    layout: &BlockSparseLayout,
    recipe: FlashRecipe,
    o: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
) -> Result<Vec<Verdict>, SparseHarnessError> {
    let spec = &case.spec;
    check_candidate_shape(spec, "o", Operand::O, o.shape())?;
    check_candidate_shape(spec, "lse", Operand::RowStat, lse.shape())?;
    let mut verdicts = Vec::new();
    for seq in spec.sequences() {
        for h in 0..spec.n_heads_q {
            let visited = visited_tiles(layout, &seq, h, recipe.kv_tile);
            let recipe =
                FlashRecipe { visited_tiles: Some(recipe.visited_tiles.map_or(visited, |v| v.min(visited))), ..recipe };
            let sub = sub_case(case, &seq, h..h + 1, listed_tiles_mask(spec, layout, &seq, h));
            let o_sub = stack_heads(spec, o.view(), &seq, h..h + 1, false);
            let lse_sub = stack_row_stats(spec, lse.view(), &seq, h..h + 1);
            let mut verdict = verify_forward(&sub, recipe, o_sub.view(), lse_sub.view())?;
            score_dropped_block(
                &mut verdict,
                &sub,
                tiles_mask(spec, layout, &seq, h, Listing::DropLastPerQueryTile),
                recipe,
            )?;
            verdicts.push(verdict);
        }
    }
    Ok(verdicts)
}

/// Verifies a block-sparse backward candidate: one verdict over the whole problem, under the
/// layout's visibility of every (sequence, query head) — so the heads of a GQA group may have
/// different lists, whose dK/dV contributions the group sums. `q_tile` is the candidate's query
/// tile (the partial-sum count of the model's dK and dV), not necessarily the layout's query block.
pub fn verify_block_sparse_backward<T: Element>(
    case: &Case<T>,
    layout: &BlockSparseLayout,
    d_out: &ArrayD<T>,
    q_tile: usize,
    recipe: FlashRecipe,
    candidate: BackwardCandidate<'_, T>,
) -> Result<Vec<Verdict>, SparseHarnessError> {
    let spec = &case.spec;
    layout.validate(spec).map_err(HarnessError::from)?;
    let visibility = |seq: &Sequence, h: usize| layout.visibility(spec, seq, h);
    let expectation = BackwardExpectation::with_visibility(case, d_out, q_tile, recipe, &visibility)?;
    Ok(vec![expectation.verify(candidate)?])
}

/// Adds the gate's "dropped selected block" wrong answer to a sub-problem's forward verdict: the
/// oracle's output with the last listed tile of every query tile removed must fail the verdict
/// wherever it is visibly different.
fn score_dropped_block<T: Element>(
    verdict: &mut Verdict,
    sub: &Case<T>,
    dropped: Mask,
    recipe: FlashRecipe,
) -> Result<(), HarnessError> {
    let [q, k, v] = sub.widened();
    let truth = crate::flash::problem_forward_bounds(&sub.spec, &q, &k, &v, recipe)?;
    let wrong_spec = sub.spec.clone().with_mask(dropped);
    let qkv = attnproof_oracle::Qkv { q: q.view(), k: k.view(), v: v.view() };
    let wrong = attnproof_oracle::forward(&wrong_spec, qkv, attnproof_oracle::DenseConfig::default(), ())?;
    let scale = truth.o.iter().chain(v.iter()).fold(0f64, |m, x| m.max(x.abs()));
    verdict.gate.score(
        "dropped selected block",
        "O",
        wrong.o.view(),
        truth.o.view(),
        truth.bound_o.view(),
        recipe.unit_roundoff,
        scale,
    );
    Ok(())
}

fn check_candidate_shape(
    spec: &AttentionSpec,
    argument: &'static str,
    operand: Operand,
    actual: &[usize],
) -> Result<(), HarnessError> {
    let expected = spec.expected_shape(operand);
    if actual != expected.as_slice() {
        return Err(HarnessError::CandidateShape { argument, expected, actual: actual.to_vec() });
    }
    Ok(())
}

/// DSA as dense attention: a single-sequence varlen case with `Hq = H`, `Hkv = 1` (MQA) and the
/// mask "key `j` is in query `i`'s selection" (causality is part of a valid selection). Keys
/// `[T, d]`, values `[T, dv]` become `[T, 1, ·]`: [`dsa_group_case`] of the one KV head.
pub fn dsa_case<T: Element>(
    query: ArrayView3<'_, T>,
    key: ArrayView2<'_, T>,
    value: ArrayView2<'_, T>,
    selection: ArrayView2<'_, i32>,
) -> Case<T> {
    let (key, value) = (key.insert_axis(Axis(1)), value.insert_axis(Axis(1)));
    dsa_group_case(query, key, value, selection, 0, Scale::InverseSqrtHeadDim)
}

/// The DSA sub-case of KV head `kv`: query heads `kv·G .. (kv+1)·G` of `q [T, Hq, d]` over KV head
/// `kv` of `k`, `v` `[T, Hkv, ·]`, as a single-sequence varlen case with `Hkv = 1` under `scale`
/// and the mask "key `j` is in query `i`'s row of `selection [T, κ]`".
pub fn dsa_group_case<T: Element>(
    q: ArrayView3<'_, T>,
    k: ArrayView3<'_, T>,
    v: ArrayView3<'_, T>,
    selection: ArrayView2<'_, i32>,
    kv: usize,
    scale: Scale,
) -> Case<T> {
    group_case(q, k, v, kv, scale, dsa_mask(selection, Listing::All))
}

/// Query heads `kv·G .. (kv+1)·G` of `q [T, Hq, d]` over KV head `kv` of `k`, `v` `[T, Hkv, ·]`,
/// as a single-sequence varlen case with `Hkv = 1` under `scale` and `mask`.
fn group_case<T: Element>(
    q: ArrayView3<'_, T>,
    k: ArrayView3<'_, T>,
    v: ArrayView3<'_, T>,
    kv: usize,
    scale: Scale,
    mask: Mask,
) -> Case<T> {
    let (len, n_heads_q, head_dim) = q.dim();
    let group = n_heads_q / k.dim().1;
    let spec = AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: vec![0, len as i32], cu_seqlens_k: vec![0, len as i32] },
        n_heads_q: group,
        n_heads_kv: 1,
        head_dim,
        head_dim_v: v.dim().2,
        scale,
        mask,
    };
    let one = Slice::from(kv..kv + 1);
    Case {
        spec,
        q: q.slice_axis(Axis(1), Slice::from(kv * group..(kv + 1) * group)).to_owned().into_dyn(),
        k: k.slice_axis(Axis(1), one).to_owned().into_dyn(),
        v: v.slice_axis(Axis(1), one).to_owned().into_dyn(),
    }
}

/// "Key selected for this query" from a `[T, κ]` selection; with [`Listing::DropLastPerQueryTile`]
/// each query's last (largest) selected token is left out: the gate's dropped selected block.
fn dsa_mask(selection: ArrayView2<'_, i32>, listing: Listing) -> Mask {
    let selected: Vec<HashSet<usize>> = selection
        .rows()
        .into_iter()
        .map(|r| {
            let mut tokens: Vec<usize> = r.iter().filter(|&&s| s >= 0).map(|&s| s as usize).collect();
            if listing == Listing::DropLastPerQueryTile {
                tokens.pop();
            }
            tokens.into_iter().collect()
        })
        .collect();
    Mask::Predicate(Predicate {
        name: "DSA selection".into(),
        visible: Arc::new(move |p: Pair| selected[p.query].contains(&p.key)),
    })
}

/// Verifies a DSA token-gather forward `(O [T, H, dv], LSE [H, T])` as attention under the
/// selection, with the gate's dropped-selected-token wrong answer added.
pub fn verify_dsa_forward<T: Element>(
    query: ArrayView3<'_, T>,
    key: ArrayView2<'_, T>,
    value: ArrayView2<'_, T>,
    selection: ArrayView2<'_, i32>,
    recipe: FlashRecipe,
    o: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
) -> Result<Verdict, HarnessError> {
    verify_dsa_group_forward(&dsa_case(query, key, value, selection), selection, recipe, o, lse)
}

/// Verifies the DSA forward of one group case ([`dsa_group_case`]: `o`, `lse` of its query
/// heads), with the gate's dropped-selected-token wrong answer added.
pub fn verify_dsa_group_forward<T: Element>(
    case: &Case<T>,
    selection: ArrayView2<'_, i32>,
    recipe: FlashRecipe,
    o: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
) -> Result<Verdict, HarnessError> {
    let mut verdict = verify_forward(case, recipe, o, lse)?;
    score_dropped_block(&mut verdict, case, dsa_mask(selection, Listing::DropLastPerQueryTile), recipe)?;
    Ok(verdict)
}

/// Verifies a DSA token-sparse forward candidate `(O, LSE)` of any layout (dense `[B, H, L, ·]` or
/// varlen `[T, H, ·]`, as `case.spec` says: causal self-attention) with token lists
/// `[token rows, list heads, κ]` (row `b·L + t` dense, `cu_seqlens_q[b] + t` varlen; one list head
/// for every KV head, or one per KV head): one verdict per (sequence, KV head) from
/// [`verify_dsa_group_forward`] on the sequence's group case (an empty sequence has nothing to
/// verify).
pub fn verify_dsa_token_sparse_forward<T: Element>(
    case: &Case<T>,
    lists: ArrayView3<'_, i32>,
    recipe: FlashRecipe,
    o: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
) -> Result<Vec<Verdict>, SparseHarnessError> {
    let shared = lists.dim().1 == 1;
    verify_per_group(case, o, lse, |group, rows, kv, o_sub, lse_sub| {
        let selection = lists.slice_axis(Axis(0), rows).index_axis_move(Axis(1), if shared { 0 } else { kv });
        let sub = dsa_group_case(group.q.view(), group.k.view(), group.v.view(), selection, kv, case.spec.scale);
        verify_dsa_group_forward(&sub, selection, recipe, o_sub, lse_sub)
    })
}

/// One sequence's heads of a case, stacked `[L, H, ·]`: what the per-group verifiers cut their group cases from.
pub struct SequenceHeads<T> {
    /// Queries `[L, Hq, d]`.
    pub q: Array3<T>,
    /// Keys `[L, Hkv, d]`.
    pub k: Array3<T>,
    /// Values `[L, Hkv, dv]`.
    pub v: Array3<T>,
}

/// The per-(sequence, KV head) loop of the token-list verifiers (NSA's selected branch, DSA's token-sparse attention)
/// for a candidate `(O, LSE)` of any layout: checks the candidate's shapes, skips empty sequences, and calls
/// `verify(heads, token rows, kv, o, lse)` with the sequence's stacked heads, its rows of the per-token lists, and the
/// group's `O [L, G, dv]` and `LSE [G, L]`, collecting one verdict per (sequence, KV head) in that order.
fn verify_per_group<T: Element>(
    case: &Case<T>,
    o: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
    verify: impl Fn(
        &SequenceHeads<T>,
        Slice,
        usize,
        ArrayViewD<'_, T>,
        ArrayViewD<'_, f32>,
    ) -> Result<Verdict, HarnessError>,
) -> Result<Vec<Verdict>, SparseHarnessError> {
    let spec = &case.spec;
    check_candidate_shape(spec, "o", Operand::O, o.shape())?;
    check_candidate_shape(spec, "lse", Operand::RowStat, lse.shape())?;
    let (hq, hkv, group) = (spec.n_heads_q, spec.n_heads_kv, spec.group_size());
    let three = |a: ArrayD<T>| a.into_dimensionality::<ndarray::Ix3>().expect("[L, H, D]");
    let mut verdicts = Vec::new();
    let mut row0 = 0;
    for seq in spec.sequences() {
        let rows = Slice::from(row0..row0 + seq.len_q);
        row0 += seq.len_q;
        if seq.len_q == 0 {
            continue;
        }
        let heads = SequenceHeads {
            q: three(stack_heads(spec, case.q.view(), &seq, 0..hq, false)),
            k: three(stack_heads(spec, case.k.view(), &seq, 0..hkv, true)),
            v: three(stack_heads(spec, case.v.view(), &seq, 0..hkv, true)),
        };
        let o_seq = stack_heads(spec, o.view(), &seq, 0..hq, false);
        let lse_seq = stack_row_stats(spec, lse.view(), &seq, 0..hq);
        for kv in 0..hkv {
            let group_heads = kv * group..(kv + 1) * group;
            let o_sub = heads_of(o_seq.view(), 1, group_heads.clone());
            let lse_sub = heads_of(lse_seq.view(), 0, group_heads);
            verdicts.push(verify(&heads, rows, kv, o_sub.view(), lse_sub.view())?);
        }
    }
    Ok(verdicts)
}

/// `causal ∧ (block(key) selected for (query, KV head kv))` over a sequence of `T` tokens.
pub fn selected_blocks_mask(selection: ArrayView3<'_, i32>, kv: usize, select_block: usize) -> Mask {
    nsa_mask(selection, kv, select_block, Listing::All)
}

/// [`selected_blocks_mask`], optionally without each query's last selected block (the gate's
/// dropped selected block).
fn nsa_mask(selection: ArrayView3<'_, i32>, kv: usize, select_block: usize, listing: Listing) -> Mask {
    let selected: Vec<HashSet<usize>> = selection
        .index_axis(Axis(1), kv)
        .rows()
        .into_iter()
        .map(|r| {
            let mut blocks: Vec<usize> = r.iter().filter(|&&b| b >= 0).map(|&b| b as usize).collect();
            if listing == Listing::DropLastPerQueryTile {
                blocks.pop();
            }
            blocks.into_iter().collect()
        })
        .collect();
    let predicate = Predicate {
        name: format!("NSA selection (KV head {kv})"),
        visible: Arc::new(move |p: Pair| selected[p.query].contains(&(p.key / select_block))),
    };
    Mask::And(vec![Mask::Causal, Mask::Predicate(predicate)])
}

/// The NSA sub-case of KV head `kv`: query heads `kv·G .. (kv+1)·G` of `q [T, Hq, d]` over KV
/// head `kv` of `k`, `v`, as a single-sequence varlen case with `Hkv = 1`, under `scale`.
pub fn nsa_group_case<T: Element>(
    q: ArrayView3<'_, T>,
    k: ArrayView3<'_, T>,
    v: ArrayView3<'_, T>,
    selection: ArrayView3<'_, i32>,
    kv: usize,
    select_block: usize,
    scale: Scale,
) -> Case<T> {
    group_case(q, k, v, kv, scale, selected_blocks_mask(selection, kv, select_block))
}

/// Verifies the NSA selection forward of KV head `kv` (`o`, `lse` of its query heads) on its
/// group case, with the gate's dropped-selected-block wrong answer added.
pub fn verify_nsa_group_forward<T: Element>(
    case: &Case<T>,
    selection: ArrayView3<'_, i32>,
    kv: usize,
    select_block: usize,
    recipe: FlashRecipe,
    o: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
) -> Result<Verdict, HarnessError> {
    let mut verdict = verify_forward(case, recipe, o, lse)?;
    let dropped = nsa_mask(selection, kv, select_block, Listing::DropLastPerQueryTile);
    score_dropped_block(&mut verdict, case, dropped, recipe)?;
    Ok(verdict)
}

/// Verifies an NSA selection-branch forward candidate `(O, LSE)` of any layout (dense `[B, H, L, ·]` or varlen
/// `[T, H, ·]`, as `spec` says; `spec` is the branch's problem, causal self-attention under the branch's scale) with
/// token lists `[token rows, Hkv, n]` (row `b·L + t` dense, `cu_seqlens_q[b] + t` varlen): one verdict per
/// (sequence, KV head) from [`verify_nsa_group_forward`] on the sequence's group case.
pub fn verify_nsa_selected_forward<T: Element>(
    case: &Case<T>,
    lists: ArrayView3<'_, i32>,
    select_block: usize,
    recipe: FlashRecipe,
    o: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
) -> Result<Vec<Verdict>, SparseHarnessError> {
    verify_per_group(case, o, lse, |group, rows, kv, o_sub, lse_sub| {
        let selection = lists.slice_axis(Axis(0), rows);
        let (q, k, v) = (group.q.view(), group.k.view(), group.v.view());
        let sub = nsa_group_case(q, k, v, selection, kv, select_block, case.spec.scale);
        verify_nsa_group_forward(&sub, selection, kv, select_block, recipe, o_sub, lse_sub)
    })
}

/// A `[L, G, ·]` stack of one KV head's query heads as one head of `L·G` rows, token-major (row `t·G + h`): the order
/// in which the token-list backwards' tiles hold them.
fn as_one_head<T: Clone>(heads: ArrayD<T>) -> ArrayD<T> {
    let (len, group, width) = (heads.shape()[0], heads.shape()[1], heads.shape()[2]);
    heads.as_standard_layout().into_owned().into_shape_with_order(IxDyn(&[len * group, 1, width])).expect("sizes agree")
}

/// The backward verifier of the token-list schedules (NSA's selected branch, DSA's token-sparse attention), whose
/// kernels hold a KV head's whole group at once: one verdict per (sequence, KV head), each the dense backward verdict
/// of the group's rows stacked as one head of `L·G` rows token-major (row `t·G + h`) over the KV head's keys, under
/// `visible(token rows, L, kv)` (`[L, L]`, per token; row `t·G + h` sees what token `t` sees), with `recipe` and query
/// tiles of `q_tile` rows. A key's dK and dV then sum the group's terms in one chain, the dense model's chain for one
/// head of `L·G` query rows, so no GQA sum is added; `q_tile` counts the partials each chain gathers. Empty sequences
/// have nothing to verify.
pub fn verify_stacked_backward<T: Element>(
    case: &Case<T>,
    d_out: &ArrayD<T>,
    candidate: BackwardCandidate<'_, T>,
    (recipe, q_tile): (FlashRecipe, usize),
    visible: impl Fn(Range<usize>, usize, usize) -> ndarray::Array2<bool>,
) -> Result<Vec<Verdict>, SparseHarnessError> {
    let spec = &case.spec;
    let (group, hkv) = (spec.group_size(), spec.n_heads_kv);
    let mut verdicts = Vec::new();
    let mut row0 = 0;
    for seq in spec.sequences() {
        let len = seq.len_q;
        let rows = row0..row0 + len;
        row0 += len;
        if len == 0 {
            continue;
        }
        for kv in 0..hkv {
            let heads = kv * group..(kv + 1) * group;
            let stacked = |t: ArrayViewD<'_, T>, keys: bool| {
                let h = if keys { kv..kv + 1 } else { heads.clone() };
                as_one_head(stack_heads(spec, t, &seq, h, keys))
            };
            let sub_spec = AttentionSpec {
                layout: Layout::Varlen {
                    cu_seqlens_q: vec![0, (len * group) as i32],
                    cu_seqlens_k: vec![0, len as i32],
                },
                n_heads_q: 1,
                n_heads_kv: 1,
                mask: Mask::None,
                ..spec.clone()
            };
            let sub = Case {
                spec: sub_spec,
                q: stacked(case.q.view(), false),
                k: stacked(case.k.view(), true),
                v: stacked(case.v.view(), true),
            };
            let per_token = visible(rows.clone(), len, kv);
            let visible =
                ndarray::Array2::from_shape_fn((len * group, len), |(row, key)| per_token[[row / group, key]]);
            let sub_d_out = stacked(d_out.view(), false);
            let expectation =
                BackwardExpectation::with_visibility(&sub, &sub_d_out, q_tile, recipe, &|_, _| visible.clone())?;
            let delta = stack_row_stats(spec, candidate.delta.view(), &seq, heads.clone());
            // [G, L] → token-major [1, L·G].
            let delta = delta.view().reversed_axes().as_standard_layout().into_owned();
            let delta = delta.into_shape_with_order(IxDyn(&[1, len * group])).expect("sizes agree");
            let (dq, dk, dv) = (
                stacked(candidate.dq.view(), false),
                stacked(candidate.dk.view(), true),
                stacked(candidate.dv.view(), true),
            );
            let candidate = BackwardCandidate { dq: dq.view(), dk: dk.view(), dv: dv.view(), delta: delta.view() };
            verdicts.push(expectation.verify(candidate)?);
        }
    }
    Ok(verdicts)
}

/// Verifies a DSA token-sparse backward candidate (dQ, dK, dV and `D` of any layout, as `case.spec` says: causal
/// self-attention) with token lists `[token rows, list heads, κ]` (one list head for every KV head, or one per KV
/// head) under `recipe` with query tiles of `q_tile` rows: [`verify_stacked_backward`] under "key listed for the
/// token" from the list each KV head reads.
pub fn verify_dsa_token_sparse_backward<T: Element>(
    case: &Case<T>,
    lists: ArrayView3<'_, i32>,
    d_out: &ArrayD<T>,
    candidate: BackwardCandidate<'_, T>,
    (recipe, q_tile): (FlashRecipe, usize),
) -> Result<Vec<Verdict>, SparseHarnessError> {
    let shared = lists.dim().1 == 1;
    verify_stacked_backward(case, d_out, candidate, (recipe, q_tile), |rows, len, kv| {
        let selection =
            lists.slice_axis(Axis(0), Slice::from(rows)).index_axis_move(Axis(1), if shared { 0 } else { kv });
        dsa_mask(selection, Listing::All).matrix(len, len)
    })
}

/// Heads `heads` (axis 1) of a `[T, H, ·]` tensor, or of a `[H, T]` row statistic (axis 0).
pub fn heads_of<T: Clone>(t: ArrayViewD<'_, T>, axis: usize, heads: Range<usize>) -> ArrayD<T> {
    t.slice_axis(Axis(axis), Slice::from(heads)).to_owned()
}
