//! Verifying NSA's selected-block attention (E18's selection branch: `attnproof_gpu::nsa::selected`) against the
//! oracle: each (sequence, KV head) of the output is the group case of [`crate::sparse::nsa_group_case`] (dense
//! attention of the group's heads under `causal ∧ block(key) listed for the query`), held to the dense forward's
//! derived bound with one rescale per tile of the row's own blocks ([`selected_recipe`]), and the gate's
//! dropped-selected-block answer scored, as the CPU reference's selection branch is.
//!
//! [`selected_draws`] draws the layers (dense and varlen with empty sequences, lengths around a tile and a block,
//! GQA groups 1–16 and a few up to 64, E31's head dims and others, blocks of 8 to 192 tokens, lists of 1 to 32) and
//! [`selected_lists`] the lists, mixing on purpose what breaks a union walk: empty lists, lists of every eligible
//! block, lists shared by neighbouring tokens as NSA's are, independent random lists, and lists naming blocks after
//! the token (which add nothing). [`selected_guarded`] launches a kernel text with poisoned, guarded outputs.

use std::sync::Arc;

use attnproof_gpu::GpuBackwardStrategy;
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::nsa::select::lists_shape;
use attnproof_gpu::nsa::selected::{SelectedTiling, selected_device_with, selected_spec, tile_keys, visited_tiles};
use attnproof_gpu::nsa::selected_backward::{BackwardSegments, TILING, selected_backward_device_with};
use attnproof_oracle::nsa::{NsaConfig, selection_blocks};
use attnproof_oracle::{AttentionSpec, Scale};
use attnproof_proofs::flash_bound::FlashRecipe;
use attnproof_reference::Element;
use cudarc::driver::CudaStream;
use ndarray::{Array3, ArrayD, ArrayViewD, Axis};
use proptest::prelude::*;

use crate::backward::BackwardCandidate;
use crate::candidate::{
    BackwardProblem, ForwardRun, Gradients, LaunchError, Storage, backward_guarded_with_lists,
    forward_guarded_with_lists,
};
use crate::flash::Case;
use crate::generate::ListStream;
use crate::nsa::{causal_layer, self_attention_layout};
use crate::sparse::{SparseHarnessError, selected_blocks_mask, verify_nsa_selected_forward, verify_stacked_backward};
use crate::verdict::Verdict;

/// The selected attention's recipe for `T` under `config`: the dense forward kernel's (`recipes::gpu_forward`) with
/// tiles of `min(l', 64)` keys and at most [`visited_tiles`] of them per row.
pub fn selected_recipe<T: Element>(config: &NsaConfig) -> FlashRecipe {
    FlashRecipe {
        kv_tile: tile_keys(config),
        visited_tiles: Some(visited_tiles(config)),
        ..crate::recipes::gpu_forward::<T>()
    }
}

/// How a draw's lists are made (each token's list draws its own kind from the seed; this is the mix's emphasis).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListMix {
    /// Every kind: empty, every eligible block, shared by neighbours, random, with future blocks.
    Mixed,
    /// Every list holds all the sequence's blocks that fit (`n` at least the blocks: the dense causal attention).
    AllBlocks,
}

/// One drawn selected-attention problem.
#[derive(Clone, Debug)]
pub struct SelectedDraw {
    /// The layer: causal, `Lq = Lk` per sequence.
    pub layer: AttentionSpec,
    /// Block length, list width and the scale (the rest is unused by the attention).
    pub config: NsaConfig,
    /// How Q, K and V are made.
    pub profile: crate::generate::ValueProfile,
    /// Their seed, and the lists'.
    pub seed: u64,
    /// How the lists are made.
    pub lists: ListMix,
    /// The CTAs' rows (`None`: the group's default, [`SelectedTiling::for_group`]).
    pub tiling: Option<SelectedTiling>,
}

/// The lists of `draw` for `spec`'s layout, `[token rows, Hkv, n]` (`attnproof_gpu::nsa::select::lists_shape`):
/// per token and KV head, one of: no block; every eligible block (`j·l' ≤ t`, the first `n`); the current block and
/// blocks drawn for the token's group of 16 neighbours (neighbouring tokens share most of their lists, as NSA's do);
/// eligible blocks drawn independently; any blocks of the sequence, future ones included.
pub fn selected_lists(draw: &SelectedDraw) -> Array3<i32> {
    let spec = &draw.layer;
    let (lb, n) = (draw.config.select_block, draw.config.n_selected);
    let [rows, n_heads_kv, width] = lists_shape(spec, &draw.config);
    let mut lists = Array3::from_elem((rows, n_heads_kv, width), -1);
    let mut rng = ListStream::new(draw.seed ^ 0x6c69_7374);
    let mut row0 = 0;
    for seq in spec.sequences() {
        let blocks = selection_blocks(seq.len_q, lb).expect("validated block length");
        for t in 0..seq.len_q {
            let current = t / lb;
            for kv in 0..n_heads_kv {
                let eligible: Vec<usize> = (0..=current).collect();
                let chosen = match (draw.lists, rng.below(10)) {
                    (ListMix::AllBlocks, _) => (0..blocks.min(n)).collect(),
                    (_, 0) => vec![],
                    (_, 1 | 2) => eligible.into_iter().take(n).collect(),
                    (_, 3..=5) => {
                        let mut shared =
                            ListStream::new(draw.seed ^ ((seq.index * 131 + kv) * 1_000_003 + t / 16) as u64);
                        let mut c = shared.pick((0..current).collect(), n.saturating_sub(1));
                        c.push(current);
                        c
                    }
                    (_, 6..=8) => {
                        let k = rng.below(n + 1);
                        rng.pick(eligible, k)
                    }
                    _ => {
                        let k = rng.below(n + 1);
                        rng.pick((0..blocks).collect(), k)
                    }
                };
                for (e, &b) in chosen.iter().enumerate() {
                    lists[[row0 + t, kv, e]] = b as i32;
                }
            }
        }
        row0 += seq.len_q;
    }
    lists
}

/// Draws: blocks of 64 tokens half the time (the paper's), else 8, 16, 32, 48 (shorter than a tile), 128 or 192
/// (several tiles); lists of 1 to 32 (16 often, up to 4 now and then); lengths from none through a tile and a block ± 1
/// to 700 (more blocks than a list holds);
/// GQA groups 1–16 over one or two KV heads, and 24, 32 or 64 now and then (one token per CTA at 64); E31's head dims
/// and others; the configuration's scale `1/√d` or another; every list kind, and now and then every block listed;
/// the group's default tiling half the time, else any tiling that holds the group (unions of 1 to 64 tokens).
pub fn selected_draws() -> impl Strategy<Value = SelectedDraw> {
    let block = prop_oneof![4 => Just(64usize), 1 => prop::sample::select(vec![8usize, 16, 32, 48, 128, 192])];
    let width = prop_oneof![2 => Just(16usize), 1 => 1usize..=4, 3 => 1usize..=32];
    let dims = prop_oneof![
        3 => prop::sample::select(vec![(64usize, 64usize), (128, 128), (192, 128)]),
        1 => ((1usize..=32).prop_map(|m| 8 * m), (1usize..=16).prop_map(|m| 8 * m)),
    ];
    let heads = prop_oneof![
        6 => (1usize..=16, 1usize..=2).prop_map(|(group, n_heads_kv)| (group * n_heads_kv, n_heads_kv)),
        1 => prop::sample::select(vec![(24usize, 1usize), (32, 1), (64, 1)]),
    ];
    let scale = prop_oneof![3 => Just(Scale::InverseSqrtHeadDim), 1 => Just(Scale::Value(0.3))];
    let mix = prop_oneof![5 => Just(ListMix::Mixed), 1 => Just(ListMix::AllBlocks)];
    (block, width, dims, heads, scale, mix)
        .prop_flat_map(|(block, width, dims, heads, scale, mix)| {
            let length =
                prop::sample::select(vec![0, 1, 63, 64, 65, block - 1, block, block + 1, 2 * block + 1, 300, 700]);
            (
                Just((block, width, dims, heads, scale, mix)),
                self_attention_layout(length),
                crate::strategies::profile(),
                any::<u64>(),
                prop::option::weighted(0.5, any::<prop::sample::Index>()),
            )
        })
        .prop_map(|((block, width, dims, heads, scale, mix), layout, profile, seed, tiling)| {
            let layer = causal_layer(layout, heads, dims);
            // Every list names every block when the width covers the longest sequence's blocks.
            let most_blocks = layer.sequences().iter().map(|s| s.len_q.div_ceil(block)).max().unwrap_or(0);
            let n_selected = if mix == ListMix::AllBlocks { width.max(most_blocks).max(1) } else { width };
            let config = NsaConfig {
                select_block: block,
                n_selected,
                n_forced_initial: 0,
                n_forced_local: 0,
                scale,
                ..NsaConfig::default()
            };
            let tiling = tiling.map(|i| *i.get(&SelectedTiling::for_group_all(heads.0 / heads.1)));
            SelectedDraw { layer, config, profile, seed, lists: mix, tiling }
        })
}

/// The branch's case for `draw` from `seed`: Q, K, V from the draw's profile under the branch's spec (the
/// configuration's scale).
pub fn selected_case<T: Storage>(draw: &SelectedDraw, seed: u64) -> Case<T> {
    let spec = selected_spec(&draw.layer, &draw.config).expect("a drawn layer is an NSA layer");
    crate::generate::make_case::<T>(&spec, draw.profile, seed)
}

/// One launch of the selected attention's kernel text and tiling `launch` on `case` (its spec the branch's) with `lists`,
/// outputs NaN-poisoned and guarded, inputs (lists included) checked unchanged.
pub fn selected_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    config: &NsaConfig,
    launch: (KernelSource, Option<SelectedTiling>),
    case: &Case<T>,
    lists: &Array3<i32>,
) -> Result<ForwardRun<T>, LaunchError> {
    forward_guarded_with_lists(stream, case, lists, |qkv, device_lists, o, lse| {
        selected_device_with(stream, &case.spec, config, launch, qkv, device_lists, o, lse)
    })
}

/// Verifies a selected-attention run: one verdict per (sequence, KV head).
pub fn verify_selected<T: Element>(
    case: &Case<T>,
    config: &NsaConfig,
    lists: &Array3<i32>,
    o: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
) -> Result<Vec<Verdict>, SparseHarnessError> {
    verify_nsa_selected_forward(case, lists.view(), config.select_block, selected_recipe::<T>(config), o, lse)
}

/// The selected backward's recipe for `T` under `config`: the backward kernels' (`recipes::gpu_backward` in the NSA
/// KV owner's four-warp tiling) with KV tiles of `min(l', 64)` keys (the dQ partials a row collects) and the forward's
/// visited tiles (its LSE's merge count).
pub fn selected_backward_recipe<T: Element>(config: &NsaConfig) -> FlashRecipe {
    FlashRecipe {
        kv_tile: tile_keys(config),
        visited_tiles: Some(visited_tiles(config)),
        ..crate::recipes::gpu_backward::<T>(TILING).recipe
    }
}

/// One launch of the selected backward's kernel text and CSR split `kernel` with `strategy` on `problem` (its spec the branch's)
/// with `lists`, outputs NaN-poisoned and guarded, inputs (lists included) checked unchanged.
pub fn selected_backward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    config: &NsaConfig,
    kernel: (KernelSource, BackwardSegments),
    problem: BackwardProblem<'_, T>,
    lists: &Array3<i32>,
    strategy: GpuBackwardStrategy,
) -> Result<Gradients<T>, LaunchError> {
    let spec = &problem.case.spec;
    backward_guarded_with_lists(stream, problem, lists, |inputs, device_lists, outputs| {
        selected_backward_device_with(stream, spec, config, kernel, inputs, device_lists, outputs, strategy)
    })
}

/// Verifies a selected-backward candidate: one verdict per (sequence, KV head), each the dense backward verdict of the
/// group's rows stacked as one head ([`verify_stacked_backward`]) under the visibility `key ≤ token ∧ block(key)
/// listed for (token, KV head)`, with the recipe [`selected_backward_recipe`] and query tiles of `⌊64/G⌋·G` rows: the
/// KV owner adds a key's terms from every (token, head) row in that order, in tiles of that many rows, into one chain
/// per key (no per-head sums to add afterwards), which is the dense model's chain for one head, and each row's dQ
/// collects at most one partial per visited tile.
pub fn verify_selected_backward<T: Element>(
    case: &Case<T>,
    config: &NsaConfig,
    lists: &Array3<i32>,
    d_out: &ArrayD<T>,
    candidate: BackwardCandidate<'_, T>,
) -> Result<Vec<Verdict>, SparseHarnessError> {
    let group = case.spec.group_size();
    let q_tile = (64 / group).max(1) * group;
    let recipe = selected_backward_recipe::<T>(config);
    verify_stacked_backward(case, d_out, candidate, (recipe, q_tile), |rows, len, kv| {
        let selection = lists.slice_axis(Axis(0), ndarray::Slice::from(rows));
        selected_blocks_mask(selection, kv, config.select_block).matrix(len, len)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::spec::Layout;
    use half::bf16;
    use ndarray::Array2;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    fn draw(layout: Layout, heads: (usize, usize), block: usize, n: usize, lists: ListMix) -> SelectedDraw {
        SelectedDraw {
            layer: causal_layer(layout, heads, (16, 8)),
            config: NsaConfig {
                select_block: block,
                n_selected: n,
                n_forced_initial: 0,
                n_forced_local: 0,
                ..NsaConfig::default()
            },
            profile: crate::generate::ValueProfile::GAUSSIAN,
            seed: 11,
            lists,
            tiling: None,
        }
    }

    /// The lists follow E14's convention for their sequences (the GPU wrapper's validation accepts them), rows of
    /// varlen sequences start at their offsets, every kind occurs, and "all blocks" lists every block.
    #[test]
    fn the_drawn_lists_follow_the_convention_and_mix_every_kind() {
        let cu = vec![0, 70, 70, 300];
        let layout = Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu };
        let d = draw(layout, (4, 2), 16, 6, ListMix::Mixed);
        let lists = selected_lists(&d);
        assert_eq!(lists.dim(), (300, 2, 6));
        attnproof_gpu::nsa::selected::validate_lists(&d.layer, &d.config, lists.view()).unwrap();
        let rows: Vec<Vec<i32>> =
            lists.outer_iter().flat_map(|r| r.outer_iter().map(|l| l.to_vec()).collect::<Vec<_>>()).collect();
        assert!(rows.iter().any(|l| l[0] == -1), "an empty list");
        assert!(rows.iter().any(|l| l.iter().filter(|&&b| b >= 0).count() == 6), "a full list");
        // A block after the token: token t of the second sequence (offset 70) lists a block j with 16·j > t.
        let future = (70..300).any(|r| {
            (0..2).any(|kv| (0..6).any(|e| lists[[r, kv, e]] >= 0 && lists[[r, kv, e]] as usize * 16 > r - 70))
        });
        assert!(future, "a block after its token");
        let dense = Layout::Dense { batch: 1, len_q: 200, len_k: 200 };
        let all = draw(dense, (1, 1), 64, 4, ListMix::AllBlocks);
        assert!(selected_lists(&all).outer_iter().all(|r| r.iter().copied().eq([0, 1, 2, 3])));
    }

    /// The suites' draws cover the classes the GPU tests name (checked there per suite); here: a replay of the
    /// strategy reaches a group of 64, a block longer than a tile and the non-default scale.
    #[test]
    fn the_draws_reach_large_groups_long_blocks_and_other_scales() {
        let (mut group64, mut long, mut scaled) = (false, false, false);
        let mut runner = TestRunner::deterministic();
        for _ in 0..400 {
            let d = selected_draws().new_tree(&mut runner).unwrap().current();
            group64 |= d.layer.group_size() == 64;
            long |= d.config.select_block > 64;
            scaled |= d.config.scale != Scale::InverseSqrtHeadDim;
        }
        assert!(group64 && long && scaled);
    }

    /// The verifier accepts the CPU reference's selection branch (`attnproof_reference::sparse::nsa`) and rejects it
    /// run with a listed block dropped from one token (the output then misses that block's keys), and with the
    /// default scale where the configuration says 0.3.
    #[test]
    fn the_verifier_accepts_the_reference_and_rejects_a_dropped_block_or_another_scale() {
        use attnproof_reference::sparse::nsa::{
            SelectionConfig, SelectionInputs, SelectionOutputs, nsa_selection_forward,
        };
        let layout = Layout::Varlen { cu_seqlens_q: vec![0, 40], cu_seqlens_k: vec![0, 40] };
        let mut d = draw(layout, (3, 1), 8, 3, ListMix::Mixed);
        d.config.scale = Scale::Value(0.3);
        let case = selected_case::<bf16>(&d, 5);
        let lists = selected_lists(&d);
        fn three(a: &ndarray::ArrayD<bf16>) -> ndarray::ArrayView3<'_, bf16> {
            a.view().into_dimensionality().expect("[T, H, D]")
        }
        let run = |lists: &Array3<i32>, scale: Scale| {
            let mut o = ndarray::Array3::from_elem((40, 3, 8), bf16::NAN);
            let mut lse = ndarray::Array2::from_elem((3, 40), f32::NAN);
            let inputs =
                SelectionInputs { q: three(&case.q), k: three(&case.k), v: three(&case.v), selection: lists.view() };
            let config = SelectionConfig { select_block: 8, scale };
            nsa_selection_forward(&inputs, config, SelectionOutputs { o: o.view_mut(), lse: lse.view_mut() }).unwrap();
            (o.into_dyn(), lse.into_dyn())
        };
        let verdicts = |(o, lse): (ndarray::ArrayD<bf16>, ndarray::ArrayD<f32>)| {
            verify_selected(&case, &d.config, &lists, o.view(), lse.view()).unwrap()
        };
        assert!(verdicts(run(&lists, d.config.scale)).iter().all(|v| v.passed()));
        let mut dropped = lists.clone();
        let (t, slot) = (0..40)
            .find_map(|t| {
                (0..3).rev().find(|&e| lists[[t, 0, e]] >= 0 && lists[[t, 0, e]] as usize * 8 <= t).map(|e| (t, e))
            })
            .expect("a token lists a block it sees");
        dropped[[t, 0, slot]] = -1;
        assert!(verdicts(run(&dropped, d.config.scale)).iter().any(|v| !v.passed()), "a dropped block passed");
        assert!(verdicts(run(&lists, Scale::InverseSqrtHeadDim)).iter().any(|v| !v.passed()), "the wrong scale passed");
    }

    /// The backward verifier accepts the oracle's gradients of the layer (per query head, under the head's own
    /// visibility, not stacked: an independent path to the same numbers) rounded to bf16, for a group of 3 in a
    /// varlen layout, and rejects them computed with one listed block dropped from one token, and with dK of the
    /// group's first head only.
    #[test]
    fn the_backward_verifier_accepts_the_oracle_and_rejects_a_dropped_block() {
        use attnproof_oracle::attention::backward_with_visibility;
        use attnproof_oracle::spec::Sequence;
        use attnproof_oracle::{DenseConfig, Qkv};
        let cu = vec![0, 50, 50, 110];
        let layout = Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu };
        let mut d = draw(layout, (6, 2), 8, 3, ListMix::Mixed);
        d.layer.head_dim = 16;
        let case = selected_case::<bf16>(&d, 3);
        let lists = selected_lists(&d);
        let d_out = crate::generate::make_d_out::<bf16>(&case.spec, 4);
        let [q, k, v] = case.widened();
        let g = d_out.mapv(|x| x.to_f32() as f64);
        let spec = case.spec.clone();
        let offsets = [0, 50, 50];
        // The oracle's gradients with the lists `lists`, dK from the heads `h % 3 < dk_heads` of each group only.
        let grads = |lists: &Array3<i32>, dk_heads: usize| {
            let visibility = |seq: &Sequence, h: usize, heads: usize| {
                Array2::from_shape_fn((seq.len_q, seq.len_k), |(t, j)| {
                    let list = lists.index_axis(Axis(0), offsets[seq.index] + t);
                    let listed = list.index_axis(Axis(0), h / 3).iter().any(|&b| b >= 0 && b as usize == j / 8);
                    h % 3 < heads && j <= t && listed
                })
            };
            let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
            let all = |seq: &Sequence, h: usize| visibility(seq, h, 3);
            let mut out =
                backward_with_visibility(&spec, qkv.clone(), g.view(), &all, DenseConfig::default(), ()).unwrap();
            let some = |seq: &Sequence, h: usize| visibility(seq, h, dk_heads);
            out.dk = backward_with_visibility(&spec, qkv, g.view(), &some, DenseConfig::default(), ()).unwrap().dk;
            let round = |a: &ArrayD<f64>| a.mapv(bf16::from_f64);
            (round(&out.dq), round(&out.dk), round(&out.dv), out.delta.mapv(|x| x as f32))
        };
        let verdicts = |(dq, dk, dv, delta): (ArrayD<bf16>, ArrayD<bf16>, ArrayD<bf16>, ArrayD<f32>)| {
            let candidate = BackwardCandidate { dq: dq.view(), dk: dk.view(), dv: dv.view(), delta: delta.view() };
            verify_selected_backward(&case, &d.config, &lists, &d_out, candidate).unwrap()
        };
        let good = verdicts(grads(&lists, 3));
        assert_eq!(good.len(), 4, "two sequences with tokens, two KV heads");
        assert!(
            good.iter().all(|v| v.passed() && v.valid()),
            "{}",
            good.iter().map(|v| v.to_string()).collect::<String>()
        );
        let mut dropped = lists.clone();
        let (t, slot) = (50..110)
            .find_map(|t| {
                (0..3).rev().find(|&e| lists[[t, 1, e]] >= 0 && lists[[t, 1, e]] as usize * 8 + 50 <= t).map(|e| (t, e))
            })
            .expect("a token lists a block it sees");
        dropped[[t, 1, slot]] = -1;
        assert!(verdicts(grads(&dropped, 3)).iter().any(|v| !v.passed()), "a dropped block passed");
        assert!(verdicts(grads(&lists, 1)).iter().any(|v| !v.passed()), "dK of one head of the group passed");
    }
}
