//! Verifying DSA's token-sparse attention forward (E16, `attnproof_gpu::dsa::sparse`) against the oracle: each (sequence,
//! KV head) of the output is the group case of [`crate::sparse::dsa_group_case`] (dense attention of the group's heads
//! under "key listed for the query", from the list that KV head reads), held to the dense forward's derived bound with
//! one rescale per gathered tile ([`token_sparse_recipe`]), and the gate's dropped-selected-token answer scored.
//!
//! [`token_sparse_draws`] draws the layers (dense and varlen with empty sequences, lengths around a tile ± 1, GQA groups
//! 1–16 and now and then 24 to 128, which take several CTAs per token above 64; E31's head dims and others; the
//! default scale or another; lists shared by every KV head, as DSA's indexer writes them, or one per KV head; widths
//! from 1 to 200 and 2048, which is wider than every drawn sequence) and [`token_lists`] the lists, mixing on purpose
//! what breaks a gather: empty lists, every visible token, the most recent tokens, lists shared by neighbouring tokens
//! as DSA's are, independent random lists, and the first token with the most recent ones (an attention sink).
//! [`token_sparse_guarded`] launches a kernel text with poisoned, guarded outputs.

use std::sync::Arc;

use attnproof_gpu::GpuBackwardStrategy;
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::dsa::sparse::{KV_TILE, ListSharing, TokenSelection, token_sparse_device, visited_tiles};
use attnproof_gpu::dsa::sparse_backward::{TILING, query_tile_rows, token_sparse_backward_device};
use attnproof_oracle::{AttentionSpec, Scale};
use attnproof_proofs::flash_bound::FlashRecipe;
use attnproof_reference::Element;
use cudarc::driver::CudaStream;
use ndarray::{Array2, Array3, ArrayD, ArrayView3, ArrayViewD, Axis};
use proptest::prelude::*;

use crate::backward::BackwardCandidate;
use crate::candidate::{
    BackwardProblem, ForwardRun, Gradients, LaunchError, Storage, backward_guarded_with_lists,
    forward_guarded_with_lists,
};
use crate::flash::Case;
use crate::generate::{ListStream, ValueProfile};
use crate::nsa::{causal_layer, self_attention_layout};
use crate::sparse::{SparseHarnessError, verify_dsa_token_sparse_backward, verify_dsa_token_sparse_forward};
use crate::verdict::Verdict;

/// The token-sparse forward's recipe for `T` with lists of `top_k` slots: the dense forward kernel's
/// (`recipes::gpu_forward`) with gathered tiles of at most `min(top_k, 64)` keys and at most [`visited_tiles`] of them
/// per row.
pub fn token_sparse_recipe<T: Element>(top_k: usize) -> FlashRecipe {
    FlashRecipe {
        kv_tile: KV_TILE.min(top_k).max(1),
        visited_tiles: Some(visited_tiles(top_k).max(1)),
        ..crate::recipes::gpu_forward::<T>()
    }
}

/// How a draw's lists are made (each token's list draws its own kind from the seed; this is the mix's emphasis).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenListMix {
    /// Every kind: empty, every visible token, the most recent, shared by neighbours, random, sink and recent.
    Mixed,
    /// Every list holds the first `min(t + 1, top_k)` tokens (with `top_k` at least the sequence: causal attention).
    AllVisible,
}

/// One drawn token-sparse attention problem.
#[derive(Clone, Debug)]
pub struct TokenSparseDraw {
    /// The layer: causal, `Lq = Lk` per sequence, under its scale.
    pub layer: AttentionSpec,
    /// The lists' width and sharing.
    pub selection: TokenSelection,
    /// How Q, K and V are made.
    pub profile: ValueProfile,
    /// Their seed, and the lists'.
    pub seed: u64,
    /// How the lists are made.
    pub lists: TokenListMix,
}

/// What one token's list holds (each token and list head draws its kind; [`token_lists_with_kinds`] says which).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum TokenListKind {
    /// No token.
    Empty,
    /// The first `min(t + 1, k)` tokens.
    Prefix,
    /// The `k` most recent tokens, the token itself included.
    Recent,
    /// `k − 1` tokens drawn once for the token's group of 16 neighbours among the tokens before the group, then the
    /// token itself: neighbouring tokens share all but their last entry, as the indexer's lists share most of theirs.
    SharedByNeighbours,
    /// Up to `k` visible tokens drawn independently.
    Random,
    /// The first token and the `k − 1` most recent (an attention sink).
    SinkAndRecent,
}

/// The seed of a draw's stream of list kinds and random lists: distinct draw seeds give distinct streams.
fn main_seed(seed: u64) -> u64 {
    seed ^ 0x746f_6b65
}

/// The seed of the picks that the tokens of group `group` (of 16) share for list head `head` of sequence `seq`:
/// distinct for distinct (sequence, head, group) below a million groups and 131 heads, so that no two groups share
/// their picks by accident.
fn neighbour_seed(seed: u64, seq: usize, head: usize, group: usize) -> u64 {
    seed ^ ((seq * 131 + head) * 1_000_003 + group) as u64
}

/// The lists of `draw`, `[token rows, list heads, top_k]` ([`TokenSelection::lists_shape`]): per token and list head,
/// a list of a [`TokenListKind`] (every visible token under [`TokenListMix::AllVisible`]). Every list follows the
/// convention (ascending, distinct, `≤ t`, `−1`-padded).
pub fn token_lists(draw: &TokenSparseDraw) -> Array3<i32> {
    token_lists_with_kinds(draw).0
}

/// [`token_lists`] with the kind of every list, `[token rows, list heads]`.
pub fn token_lists_with_kinds(draw: &TokenSparseDraw) -> (Array3<i32>, Array2<TokenListKind>) {
    let spec = &draw.layer;
    let k = draw.selection.top_k;
    let [rows, list_heads, width] = draw.selection.lists_shape(spec);
    let mut lists = Array3::from_elem((rows, list_heads, width), -1);
    let mut kinds = Array2::from_elem((rows, list_heads), TokenListKind::Prefix);
    let mut rng = ListStream::new(main_seed(draw.seed));
    let mut row0 = 0;
    for seq in spec.sequences() {
        for t in 0..seq.len_q {
            for head in 0..list_heads {
                let recent = |n: usize| (t + 1).saturating_sub(n)..t + 1;
                let kind = match (draw.lists, rng.below(10)) {
                    (TokenListMix::AllVisible, _) | (_, 1) => TokenListKind::Prefix,
                    (_, 0) => TokenListKind::Empty,
                    (_, 2) => TokenListKind::Recent,
                    (_, 3..=5) => TokenListKind::SharedByNeighbours,
                    (_, 6..=8) => TokenListKind::Random,
                    _ => TokenListKind::SinkAndRecent,
                };
                let chosen: Vec<usize> = match kind {
                    TokenListKind::Empty => vec![],
                    TokenListKind::Prefix => (0..=t).take(k).collect(),
                    TokenListKind::Recent => recent(k).collect(),
                    TokenListKind::SharedByNeighbours => {
                        let group_start = t / 16 * 16;
                        let mut shared = ListStream::new(neighbour_seed(draw.seed, seq.index, head, t / 16));
                        let mut c = shared.pick((0..group_start).collect(), k.saturating_sub(1));
                        if k > 0 {
                            c.push(t);
                        }
                        c
                    }
                    TokenListKind::Random => {
                        let n = rng.below(k + 1);
                        rng.pick((0..=t).collect(), n)
                    }
                    TokenListKind::SinkAndRecent => {
                        let mut c: Vec<usize> = std::iter::once(0).chain(recent(k.saturating_sub(1))).collect();
                        c.dedup();
                        c.truncate(k);
                        c
                    }
                };
                kinds[[row0 + t, head]] = kind;
                for (e, &s) in chosen.iter().enumerate() {
                    lists[[row0 + t, head, e]] = s as i32;
                }
            }
        }
        row0 += seq.len_q;
    }
    (lists, kinds)
}

/// Draws: lengths from none through a tile ± 1 to 700; widths of 1 to 4, around one and two tiles (63, 64, 65, 128,
/// 129), up to 200, and 2048 (wider than any drawn sequence: every list padded); GQA groups 1–16 over one or two KV
/// heads, and 24, 48, 49, 64, 65, 72, 96, 100 or 128 over one a fourth of the time (several CTAs per token above 64;
/// CTAs of 64 heads from 49 on, which Hopper runs on `wgmma` where `d, dv ≤ 128`); E31's head dims and
/// others up to 256; the scale `1/√d` or another; lists shared by every KV head twice in three, else per KV head;
/// every list kind, and now and then every visible token.
pub fn token_sparse_draws() -> impl Strategy<Value = TokenSparseDraw> {
    let width = prop_oneof![
        2 => 1usize..=4,
        3 => prop::sample::select(vec![63usize, 64, 65, 128, 129, 2048]),
        3 => 1usize..=200,
    ];
    let dims = prop_oneof![
        3 => prop::sample::select(vec![(64usize, 64usize), (128, 128), (192, 128), (256, 256)]),
        1 => ((1usize..=32).prop_map(|m| 8 * m), (1usize..=32).prop_map(|m| 8 * m)),
    ];
    let heads = prop_oneof![
        6 => (1usize..=16, 1usize..=2).prop_map(|(group, n_heads_kv)| (group * n_heads_kv, n_heads_kv)),
        2 => prop::sample::select(vec![(24usize, 1usize), (48, 1), (49, 1), (64, 1), (65, 1), (72, 1), (96, 1), (100, 1), (128, 1)]),
    ];
    let scale = prop_oneof![3 => Just(Scale::InverseSqrtHeadDim), 1 => Just(Scale::Value(0.3))];
    let sharing = prop_oneof![2 => Just(ListSharing::Shared), 1 => Just(ListSharing::PerKvHead)];
    let mix = prop_oneof![5 => Just(TokenListMix::Mixed), 1 => Just(TokenListMix::AllVisible)];
    let length = prop::sample::select(vec![0usize, 1, 2, 63, 64, 65, 127, 128, 129, 300, 700]);
    (width, dims, heads, scale, sharing, mix, self_attention_layout(length), crate::strategies::profile(), any::<u64>())
        .prop_map(|(top_k, dims, heads, scale, sharing, mix, layout, profile, seed)| {
            let layer = AttentionSpec { scale, ..causal_layer(layout, heads, dims) };
            TokenSparseDraw { layer, selection: TokenSelection { top_k, heads: sharing }, profile, seed, lists: mix }
        })
}

/// The case of `draw` from `seed`: Q, K, V from the draw's profile under the layer's spec.
pub fn token_sparse_case<T: Storage>(draw: &TokenSparseDraw, seed: u64) -> Case<T> {
    crate::generate::make_case::<T>(&draw.layer, draw.profile, seed)
}

/// One launch of the kernel text `kernel` on `case` with `lists`, outputs NaN-poisoned and guarded, inputs (lists
/// included) checked unchanged.
pub fn token_sparse_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    selection: TokenSelection,
    kernel: KernelSource,
    case: &Case<T>,
    lists: &Array3<i32>,
) -> Result<ForwardRun<T>, LaunchError> {
    forward_guarded_with_lists(stream, case, lists, |qkv, device_lists, o, lse| {
        token_sparse_device(stream, &case.spec, selection, kernel, qkv, device_lists, o, lse)
    })
}

/// Verifies a token-sparse run: one verdict per (sequence, KV head).
pub fn verify_token_sparse<T: Element>(
    case: &Case<T>,
    selection: TokenSelection,
    lists: &Array3<i32>,
    o: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
) -> Result<Vec<Verdict>, SparseHarnessError> {
    verify_dsa_token_sparse_forward(case, lists.view(), token_sparse_recipe::<T>(selection.top_k), o, lse)
}

/// The token-level transpose of the deterministic backward, as `attnproof_gpu::dsa::sparse_backward` builds it on the
/// device (`TokenTransposeDevice`): one row per (sequence, list head, tile of 64 keys of the longest sequence), in that
/// order, holding the tokens whose list names a key of the tile, ascending, each with the mask of the keys it names
/// (bit `i` for key `64·tile + i`). Integers: the device's must equal it entry for entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenTranspose {
    /// `[rows + 1]`, from 0.
    pub offsets: Vec<i32>,
    /// The rows' tokens (sequence-local), row after row.
    pub tokens: Vec<i32>,
    /// Each token's mask of the row's keys.
    pub masks: Vec<u64>,
}

/// The host's [`TokenTranspose`] of `lists` for `spec`, each list read as the device reads it: up to its first entry
/// that does not rise or lies after its token.
pub fn token_transpose(spec: &AttentionSpec, selection: TokenSelection, lists: ArrayView3<'_, i32>) -> TokenTranspose {
    let seqs = spec.sequences();
    let tiles = seqs.iter().map(|s| s.len_q).max().unwrap_or(0).div_ceil(KV_TILE);
    let mut transpose = TokenTranspose { offsets: vec![0], tokens: vec![], masks: vec![] };
    let mut row0 = 0;
    for seq in &seqs {
        for head in 0..selection.list_heads(spec) {
            // Per tile, the (token, mask) pairs in ascending token order.
            let mut rows: Vec<Vec<(i32, u64)>> = vec![vec![]; tiles];
            for t in 0..seq.len_q {
                let mut previous = -1i32;
                for &s in lists.index_axis(Axis(0), row0 + t).index_axis(Axis(0), head) {
                    if s <= previous || s as usize > t {
                        break;
                    }
                    let (tile, bit) = (s as usize / KV_TILE, s as usize % KV_TILE);
                    match rows[tile].last_mut() {
                        Some((token, mask)) if *token == t as i32 => *mask |= 1 << bit,
                        _ => rows[tile].push((t as i32, 1 << bit)),
                    }
                    previous = s;
                }
            }
            for row in rows {
                transpose.tokens.extend(row.iter().map(|&(t, _)| t));
                transpose.masks.extend(row.iter().map(|&(_, m)| m));
                transpose.offsets.push(transpose.tokens.len() as i32);
            }
        }
        row0 += seq.len_q;
    }
    transpose
}

/// The token-sparse backward's recipe for `T` with lists of `top_k` slots: the backward kernels'
/// (`recipes::gpu_backward` in the four-warp tiling) with gathered tiles of at most `min(top_k, 64)` keys (a row's dQ
/// partials), the forward's visited tiles (its LSE's merge count), and dK, dV summed by f32 reductions
/// (`atomic_kv_sums`: their flush counted once per partial).
pub fn token_sparse_backward_recipe<T: Element>(top_k: usize) -> FlashRecipe {
    FlashRecipe {
        kv_tile: KV_TILE.min(top_k).max(1),
        visited_tiles: Some(visited_tiles(top_k).max(1)),
        atomic_kv_sums: true,
        ..crate::recipes::gpu_backward::<T>(TILING).recipe
    }
}

/// One launch of the backward's kernel text `kernel` with `strategy` on `problem` with `lists`, outputs NaN-poisoned
/// and guarded, inputs (lists included) checked unchanged.
pub fn token_sparse_backward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    selection: TokenSelection,
    kernel: KernelSource,
    problem: BackwardProblem<'_, T>,
    lists: &Array3<i32>,
    strategy: GpuBackwardStrategy,
) -> Result<Gradients<T>, LaunchError> {
    let spec = &problem.case.spec;
    backward_guarded_with_lists(stream, problem, lists, |inputs, device_lists, outputs| {
        token_sparse_backward_device(stream, spec, selection, kernel, inputs, device_lists, outputs, strategy)
    })
}

/// Verifies a token-sparse backward candidate: one verdict per (sequence, KV head), the dense backward verdict of the
/// group's rows stacked as one head under "key listed for the token" ([`verify_dsa_token_sparse_backward`]), with
/// [`token_sparse_backward_recipe`] and query tiles of `query_tile_rows(G)` rows: a key's dK and dV gather one partial
/// per (listing token, head chunk), each the tensor cores' sum over the chunk's heads.
pub fn verify_token_sparse_backward<T: Element>(
    case: &Case<T>,
    selection: TokenSelection,
    lists: &Array3<i32>,
    d_out: &ArrayD<T>,
    candidate: BackwardCandidate<'_, T>,
) -> Result<Vec<Verdict>, SparseHarnessError> {
    let recipe = token_sparse_backward_recipe::<T>(selection.top_k);
    let q_tile = query_tile_rows(case.spec.group_size());
    verify_dsa_token_sparse_backward(case, lists.view(), d_out, candidate, (recipe, q_tile))
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::spec::{Layout, Sequence};
    use attnproof_oracle::{DenseConfig, Qkv};
    use half::bf16;
    use ndarray::{Array2, ArrayD, Axis};
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    fn draw(
        layout: Layout,
        heads: (usize, usize),
        top_k: usize,
        sharing: ListSharing,
        lists: TokenListMix,
    ) -> TokenSparseDraw {
        TokenSparseDraw {
            layer: causal_layer(layout, heads, (16, 8)),
            selection: TokenSelection { top_k, heads: sharing },
            profile: ValueProfile::GAUSSIAN,
            seed: 11,
            lists,
        }
    }

    /// The lists follow the convention for their sequences (the GPU wrapper's validation accepts them), rows of
    /// varlen sequences start at their offsets, every kind occurs, and "all visible" lists the first tokens.
    #[test]
    fn the_drawn_lists_follow_the_convention_and_mix_every_kind() {
        let cu = vec![0, 70, 70, 300];
        let layout = Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu };
        let d = draw(layout, (4, 2), 6, ListSharing::PerKvHead, TokenListMix::Mixed);
        let lists = token_lists(&d);
        assert_eq!(lists.dim(), (300, 2, 6));
        attnproof_gpu::dsa::sparse::validate_token_lists(&d.layer, d.selection, lists.view()).unwrap();
        let rows: Vec<Vec<i32>> =
            lists.outer_iter().flat_map(|r| r.outer_iter().map(|l| l.to_vec()).collect::<Vec<_>>()).collect();
        assert!(rows.iter().any(|l| l[0] == -1), "an empty list");
        assert!(rows.iter().any(|l| l.iter().all(|&s| s >= 0)), "a full list");
        // The most recent tokens: token t = r − 70 of the second sequence lists t − 5 ..= t.
        let recent = (80..300).any(|r| (0..2).any(|h| (0..6).all(|e| lists[[r, h, e]] == (r - 70 - 5 + e) as i32)));
        assert!(recent, "a list of the most recent tokens");
        let sink = (80..300).any(|r| {
            (0..2).any(|h| {
                lists[[r, h, 0]] == 0 && lists[[r, h, 5]] == (r - 70) as i32 && lists[[r, h, 1]] == (r - 70 - 4) as i32
            })
        });
        assert!(sink, "the first token and the most recent");
        let dense = Layout::Dense { batch: 1, len_q: 5, len_k: 5 };
        let all = token_lists(&draw(dense, (1, 1), 2048, ListSharing::Shared, TokenListMix::AllVisible));
        for t in 0..5 {
            let expected: Vec<i32> = (0..2048).map(|e| if e <= t { e as i32 } else { -1 }).collect();
            assert_eq!(all.index_axis(Axis(0), t).index_axis(Axis(0), 0).to_vec(), expected, "token {t}");
        }
    }

    /// Every list has its kind's contents: the prefix, the most recent, the sink and the most recent exactly; the
    /// lists shared by neighbours hold `k − 1` tokens before their group (all of them once the group starts past
    /// `k − 1`) and the token itself, and two tokens of one group and list head share those `k − 1`; random lists
    /// hold at most `k` visible tokens, and some hold `k`. Every kind occurs.
    #[test]
    fn every_list_has_its_kinds_contents_and_every_kind_occurs() {
        let cu = vec![0, 70, 70, 300];
        let layout = Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu };
        let d = draw(layout, (4, 2), 6, ListSharing::PerKvHead, TokenListMix::Mixed);
        let (lists, kinds) = token_lists_with_kinds(&d);
        let k = 6;
        let token_of = |row: usize| if row < 70 { row } else { row - 70 };
        let entries = |row: usize, head: usize| -> Vec<usize> {
            lists
                .index_axis(Axis(0), row)
                .index_axis(Axis(0), head)
                .iter()
                .filter(|&&s| s >= 0)
                .map(|&s| s as usize)
                .collect()
        };
        let mut seen = std::collections::BTreeSet::new();
        let (mut full_random, mut shared_pairs) = (false, 0);
        for row in 0..300 {
            let t = token_of(row);
            for head in 0..2 {
                let kind = kinds[[row, head]];
                seen.insert(kind);
                let list = entries(row, head);
                let recent = |n: usize| ((t + 1).saturating_sub(n)..=t).collect::<Vec<_>>();
                match kind {
                    TokenListKind::Empty => assert!(list.is_empty()),
                    TokenListKind::Prefix => assert_eq!(list, (0..=t).take(k).collect::<Vec<_>>()),
                    TokenListKind::Recent => assert_eq!(list, recent(k)),
                    TokenListKind::SinkAndRecent => {
                        let mut want: Vec<usize> = std::iter::once(0).chain(recent(k - 1)).collect();
                        want.dedup();
                        assert_eq!(list, want, "token {t}");
                    }
                    TokenListKind::SharedByNeighbours => {
                        let group_start = t / 16 * 16;
                        assert_eq!(list.last(), Some(&t));
                        assert!(list[..list.len() - 1].iter().all(|&s| s < group_start));
                        assert_eq!(list.len(), (group_start.min(k - 1)) + 1, "token {t}");
                        // Another token of the group with the same kind and head shares the picks.
                        let group_rows = (row - t % 16)..(row - t % 16 + 16).min(if row < 70 { 70 } else { 300 });
                        for other in group_rows.filter(|&r| r != row && kinds[[r, head]] == kind) {
                            let theirs = entries(other, head);
                            assert_eq!(theirs[..theirs.len() - 1], list[..list.len() - 1], "rows {row} and {other}");
                            shared_pairs += 1;
                        }
                    }
                    TokenListKind::Random => {
                        assert!(list.len() <= k && list.iter().all(|&s| s <= t));
                        full_random |= list.len() == k;
                    }
                }
            }
        }
        assert_eq!(seen.len(), 6, "kinds seen: {seen:?}");
        assert!(full_random, "no random list of k tokens");
        assert!(shared_pairs > 0, "no two neighbours share a list");
    }

    /// The list seeds are injective: distinct draw seeds give distinct streams (seeds differing inside and outside the
    /// mixing constant's bits included), and distinct (sequence, head, group) give distinct neighbour seeds for draw
    /// seeds with no bit, every bit and some bits set.
    #[test]
    fn list_seeds_are_injective() {
        for seed in [0u64, 1, 0x746f_6b65, u64::MAX, 1 << 40] {
            for other in [seed ^ 0x746f_6b65, seed ^ (1 << 40), seed ^ 1, seed.wrapping_add(12345)] {
                assert_ne!(main_seed(seed), main_seed(other), "{seed:#x} and {other:#x}");
            }
        }
        for seed in [0u64, u64::MAX, 0x1234_5678_9abc_def0] {
            let mut seen = std::collections::HashSet::new();
            for seq in 0..3 {
                for head in 0..4 {
                    for group in 0..50 {
                        assert!(seen.insert(neighbour_seed(seed, seq, head, group)), "{seed:#x} {seq} {head} {group}");
                    }
                }
            }
        }
    }

    /// The token-sparse recipes: gathered tiles of `min(k, 64)` keys (at least one), `⌈k/64⌉` of them (at least one),
    /// the dense forward kernel's recipe otherwise; the backward's likewise over the four-warp backward kernels', with
    /// the reductions' flush counted; lists of width 0 make no list at all.
    #[test]
    fn the_recipe_counts_the_gathered_tiles_and_zero_width_lists_are_empty() {
        let base = crate::recipes::gpu_forward::<bf16>();
        for (k, tile, tiles) in [(0, 1, 1), (1, 1, 1), (16, 16, 1), (64, 64, 1), (65, 64, 2), (2048, 64, 32)] {
            let r = token_sparse_recipe::<bf16>(k);
            assert_eq!((r.kv_tile, r.visited_tiles), (tile, Some(tiles)), "k = {k}");
            assert_eq!(FlashRecipe { kv_tile: base.kv_tile, visited_tiles: base.visited_tiles, ..r }, base);
            // The backward's: the same tiles, the f32 reductions' flush, the rest the four-warp backward kernels'.
            let backward = crate::recipes::gpu_backward::<bf16>(TILING).recipe;
            let b = token_sparse_backward_recipe::<bf16>(k);
            assert_eq!((b.kv_tile, b.visited_tiles, b.atomic_kv_sums), (tile, Some(tiles), true), "k = {k}");
            let rest = FlashRecipe { kv_tile: backward.kv_tile, visited_tiles: None, atomic_kv_sums: false, ..b };
            assert_eq!(rest, backward);
        }
        let layout = Layout::Dense { batch: 1, len_q: 20, len_k: 20 };
        let lists = token_lists(&draw(layout, (2, 1), 0, ListSharing::Shared, TokenListMix::Mixed));
        assert_eq!(lists.dim(), (20, 1, 0));
    }

    /// A replay of the strategy reaches groups above 64 (several CTAs per token), widths above every sequence,
    /// lists per KV head over several KV heads, the widest head dims and the non-default scale.
    #[test]
    fn the_draws_reach_chunked_groups_wide_lists_per_head_lists_and_other_scales() {
        let (mut chunked, mut wide, mut per_head, mut d256, mut scaled) = (false, false, false, false, false);
        let mut runner = TestRunner::deterministic();
        for _ in 0..400 {
            let d = token_sparse_draws().new_tree(&mut runner).unwrap().current();
            chunked |= d.layer.group_size() > 64;
            wide |= d.layer.sequences().iter().all(|s| s.len_q < d.selection.top_k);
            per_head |= d.selection.heads == ListSharing::PerKvHead && d.layer.n_heads_kv > 1;
            d256 |= d.layer.head_dim == 256;
            scaled |= d.layer.scale != Scale::InverseSqrtHeadDim;
        }
        assert!(chunked && wide && per_head && d256 && scaled);
    }

    /// The verifier accepts the oracle's output (per query head, under that head's list, not the verifier's group
    /// cases: an independent path to the same numbers) rounded to bf16, for a varlen layout with two KV heads and
    /// lists per KV head, and rejects it computed with a listed token dropped from one list, with the two KV heads'
    /// lists swapped, and under the default scale where the layer says 0.3.
    #[test]
    fn the_verifier_accepts_the_oracle_and_rejects_a_dropped_token_swapped_lists_or_another_scale() {
        let cu = vec![0, 50, 50, 130];
        let layout = Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu };
        let mut d = draw(layout, (6, 2), 24, ListSharing::PerKvHead, TokenListMix::Mixed);
        d.layer.scale = Scale::Value(0.3);
        let case = token_sparse_case::<bf16>(&d, 5);
        let lists = token_lists(&d);
        let [q, k, v] = case.widened();
        let offsets = [0, 50, 50];
        let run = |lists: &Array3<i32>, scale: Scale, swap: bool| {
            let spec = AttentionSpec { scale, ..case.spec.clone() };
            let visibility = |seq: &Sequence, h: usize| {
                let head = if swap { 1 - h / 3 } else { h / 3 };
                Array2::from_shape_fn((seq.len_q, seq.len_k), |(t, j)| {
                    let list = lists.index_axis(Axis(0), offsets[seq.index] + t);
                    list.index_axis(Axis(0), head).iter().any(|&s| s >= 0 && s as usize == j)
                })
            };
            let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
            let out = attnproof_oracle::attention::forward_with_visibility(
                &spec,
                qkv,
                &visibility,
                DenseConfig::default(),
                (),
            )
            .unwrap();
            (out.o.mapv(bf16::from_f64), out.lse.mapv(|x| x as f32))
        };
        let verdicts = |(o, lse): (ArrayD<bf16>, ArrayD<f32>)| {
            verify_token_sparse(&case, d.selection, &lists, o.view(), lse.view()).unwrap()
        };
        let good = verdicts(run(&lists, Scale::Value(0.3), false));
        assert_eq!(good.len(), 4, "two sequences with tokens (the empty one has nothing to verify), two KV heads");
        assert!(
            good.iter().all(|v| v.passed() && v.valid()),
            "{}",
            good.iter().map(|v| v.to_string()).collect::<String>()
        );
        let mut dropped = lists.clone();
        let (row, slot) = (60..130)
            .find_map(|r| (0..24).rev().find(|&e| lists[[r, 1, e]] >= 0).map(|e| (r, e)))
            .expect("a token lists a key");
        dropped[[row, 1, slot]] = -1;
        assert!(
            verdicts(run(&dropped, Scale::Value(0.3), false)).iter().any(|v| !v.passed()),
            "a dropped token passed"
        );
        assert!(verdicts(run(&lists, Scale::Value(0.3), true)).iter().any(|v| !v.passed()), "swapped lists passed");
        assert!(
            verdicts(run(&lists, Scale::InverseSqrtHeadDim, false)).iter().any(|v| !v.passed()),
            "the wrong scale passed"
        );
    }

    /// The host transpose of hand-made lists: tile rows in (sequence, list head, tile) order, tokens ascending with the
    /// masks of the keys they list, a list read only up to an entry after its token, rows of a shorter sequence's
    /// missing tiles empty; on drawn lists, as many entries as `transpose_entries` allows at most, every (token, key)
    /// pair of a valid list once.
    #[test]
    fn the_host_transpose_groups_tokens_by_tile_with_their_masks() {
        let cu = vec![0, 130, 132];
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu },
            ..causal_layer(Layout::Dense { batch: 1, len_q: 1, len_k: 1 }, (2, 1), (16, 8))
        };
        let selection = TokenSelection { top_k: 3, heads: ListSharing::Shared };
        let mut lists = Array3::from_elem((132, 1, 3), -1);
        for (row, entries) in
            [(0, [0, -1, -1]), (2, [1, 5, 2]), (65, [0, 64, 65]), (129, [1, 128, 129]), (131, [0, 1, -1])]
        {
            for (e, x) in entries.into_iter().enumerate() {
                lists[[row, 0, e]] = x;
            }
        }
        let got = token_transpose(&spec, selection, lists.view());
        // Sequence 0: tile 0 lists tokens 0 (key 0), 2 (key 1; key 5 is after it and ends the list), 65 (key 0) and
        // 129 (key 1); tile 1 token 65 (keys 64, 65); tile 2 token 129 (keys 128, 129). Sequence 1 (tokens 0, 1):
        // token 1 lists keys 0 and 1 in tile 0; its tiles 1 and 2 are empty.
        assert_eq!(got.offsets, [0, 4, 5, 6, 7, 7, 7]);
        assert_eq!(got.tokens, [0, 2, 65, 129, 65, 129, 1]);
        assert_eq!(got.masks, [1, 2, 1, 2, 3, 3, 3]);

        let cu = vec![0, 70, 70, 300];
        let layout = Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu };
        let d = draw(layout, (4, 2), 65, ListSharing::PerKvHead, TokenListMix::Mixed);
        let lists = token_lists(&d);
        let got = token_transpose(&d.layer, d.selection, lists.view());
        let bound = attnproof_gpu::dsa::sparse_backward::transpose_entries(&d.layer, 65) * 2;
        assert!(got.tokens.len() <= bound, "{} entries, at most {bound}", got.tokens.len());
        let pairs: u32 = got.masks.iter().map(|m| m.count_ones()).sum();
        assert_eq!(pairs as usize, lists.iter().filter(|&&s| s >= 0).count(), "each listed pair once");
        // Rows for every sequence (the empty one too), list head and tile of the longest (230 tokens: 4 tiles).
        assert_eq!(got.offsets.len(), 3 * 2 * 4 + 1);
    }

    /// The backward verifier accepts the oracle's gradients (per query head under its own visibility, not stacked: an
    /// independent path to the same numbers) rounded to bf16, for a group of 3 over two KV heads with per-KV-head lists
    /// in a varlen layout with an empty sequence, and rejects them computed with one listed token dropped, with the
    /// lists of the other KV head, and with dK of the group's first head only.
    #[test]
    fn the_backward_verifier_accepts_the_oracle_and_rejects_a_dropped_token_swapped_lists_or_one_heads_dk() {
        use attnproof_oracle::attention::backward_with_visibility;
        let cu = vec![0, 50, 50, 130];
        let layout = Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu };
        let d = draw(layout, (6, 2), 24, ListSharing::PerKvHead, TokenListMix::Mixed);
        let case = token_sparse_case::<bf16>(&d, 5);
        let lists = token_lists(&d);
        let d_out = crate::generate::make_d_out::<bf16>(&case.spec, 4);
        let [q, k, v] = case.widened();
        let g = d_out.mapv(|x| x.to_f32() as f64);
        let offsets = [0, 50, 50];
        // The oracle's gradients with `lists` (each KV head's or, with `swap`, the other's), dK from the heads
        // `h % 3 < dk_heads` of each group only.
        let grads = |lists: &Array3<i32>, swap: bool, dk_heads: usize| {
            let visibility = |seq: &Sequence, h: usize, heads: usize| {
                let head = if swap { 1 - h / 3 } else { h / 3 };
                Array2::from_shape_fn((seq.len_q, seq.len_k), |(t, j)| {
                    let list = lists.index_axis(Axis(0), offsets[seq.index] + t);
                    h % 3 < heads && list.index_axis(Axis(0), head).iter().any(|&s| s >= 0 && s as usize == j)
                })
            };
            let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
            let all = |seq: &Sequence, h: usize| visibility(seq, h, 3);
            let spec = &case.spec;
            let mut out =
                backward_with_visibility(spec, qkv.clone(), g.view(), &all, DenseConfig::default(), ()).unwrap();
            let some = |seq: &Sequence, h: usize| visibility(seq, h, dk_heads);
            out.dk = backward_with_visibility(spec, qkv, g.view(), &some, DenseConfig::default(), ()).unwrap().dk;
            let round = |a: &ArrayD<f64>| a.mapv(bf16::from_f64);
            (round(&out.dq), round(&out.dk), round(&out.dv), out.delta.mapv(|x| x as f32))
        };
        let verdicts = |(dq, dk, dv, delta): (ArrayD<bf16>, ArrayD<bf16>, ArrayD<bf16>, ArrayD<f32>)| {
            let candidate =
                crate::backward::BackwardCandidate { dq: dq.view(), dk: dk.view(), dv: dv.view(), delta: delta.view() };
            verify_token_sparse_backward(&case, d.selection, &lists, &d_out, candidate).unwrap()
        };
        let good = verdicts(grads(&lists, false, 3));
        assert_eq!(good.len(), 4, "two sequences with tokens, two KV heads");
        assert!(
            good.iter().all(|v| v.passed() && v.valid()),
            "{}",
            good.iter().map(|v| v.to_string()).collect::<String>()
        );
        let mut dropped = lists.clone();
        let (row, slot) = (60..130)
            .find_map(|r| (0..24).rev().find(|&e| lists[[r, 1, e]] >= 0).map(|e| (r, e)))
            .expect("a token lists a key");
        dropped[[row, 1, slot]] = -1;
        assert!(verdicts(grads(&dropped, false, 3)).iter().any(|v| !v.passed()), "a dropped token passed");
        assert!(verdicts(grads(&lists, true, 3)).iter().any(|v| !v.passed()), "swapped lists passed");
        assert!(verdicts(grads(&lists, false, 1)).iter().any(|v| !v.passed()), "dK of one head of the group passed");
    }

    /// The verifier reads one shared list for every KV head: the oracle under the shared list passes, and the same
    /// output checked against lists per KV head that differ for the second KV head fails.
    #[test]
    fn shared_lists_serve_every_kv_head() {
        let layout = Layout::Dense { batch: 2, len_q: 70, len_k: 70 };
        let d = draw(layout, (4, 2), 9, ListSharing::Shared, TokenListMix::Mixed);
        let case = token_sparse_case::<bf16>(&d, 8);
        let lists = token_lists(&d);
        let [q, k, v] = case.widened();
        let visibility = |seq: &Sequence, _h: usize| {
            Array2::from_shape_fn((seq.len_q, seq.len_k), |(t, j)| {
                lists.index_axis(Axis(0), seq.index * 70 + t).iter().any(|&s| s >= 0 && s as usize == j)
            })
        };
        let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
        let out = attnproof_oracle::attention::forward_with_visibility(
            &case.spec,
            qkv,
            &visibility,
            DenseConfig::default(),
            (),
        )
        .unwrap();
        let (o, lse) = (out.o.mapv(bf16::from_f64), out.lse.mapv(|x| x as f32));
        let good = verify_token_sparse(&case, d.selection, &lists, o.view(), lse.view()).unwrap();
        assert_eq!(good.len(), 4);
        assert!(good.iter().all(|v| v.passed()));
        let mut per_head = ndarray::concatenate(Axis(1), &[lists.view(), lists.view()]).unwrap();
        per_head.index_axis_mut(Axis(1), 1).mapv_inplace(|s| if s > 0 { s - 1 } else { s });
        let per_head = per_head.as_standard_layout().into_owned();
        let selection = TokenSelection { heads: ListSharing::PerKvHead, ..d.selection };
        let bad = verify_token_sparse(&case, selection, &per_head, o.view(), lse.view()).unwrap();
        assert!(bad.iter().any(|v| !v.passed()), "the second KV head's other lists passed");
    }
}
