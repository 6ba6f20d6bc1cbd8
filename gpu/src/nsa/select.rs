//! NSA's block selection (E19, E32) on the GPU: `gpu/kernels/nsa_select.cu` behind typed wrappers, from device
//! buffers ([`select_device`]) or host tensors ([`select`]).
//!
//! For every token `t` and KV head, the selection ranks the blocks of `l'` tokens by the compressed branch's
//! probabilities, summed over the GQA group and remapped onto blocks (the oracle's `nsa::block_scores`): `S_j =
//! Σ_c (|window c ∩ block j| / s) Σ_h exp(α q_{t,h}·k̃_c − LSE_cmp[h, t])` over the windows the token sees, then keeps
//! the forced blocks (the first `n_forced_initial`, the `n_forced_local` most recent) and the best other eligible
//! blocks (`j·l' ≤ t`) up to `n_selected`, equal scores to the lower block, written ascending and `−1`-padded (the
//! oracle's `nsa::select_blocks`). The probabilities are recomputed from the queries, the compressed keys and the
//! compressed attention's LSE; no per-head probability tensor is written.
//!
//! # The contract, and how it is checked
//!
//! The inputs are the layer's queries, the compressed keys ([`super::compress`]) and the LSE of the compressed
//! attention ([`super::compressed`]) as the GPU produced them; the selection is exact for *those* inputs:
//!
//! - the f32 block scores, which [`select`] returns beside the lists (E32's third tensor, `[token rows, Hkv, M]`,
//!   `M` the longest sequence's blocks), lie within `attnproof_proofs::nsa_bound::block_score_bound` of the exact
//!   scores of the same inputs;
//! - the lists are the oracle's `select_blocks` run on exactly those f32 scores, entry for entry: two blocks whose f32
//!   scores are equal go to the lower index in both. Blocks whose windows are bitwise equal score bitwise equal (a
//!   block's windows are added in ascending order whichever tile of the kernel holds them), so the adversarial draws
//!   of the tests produce such ties on purpose;
//! - hence, where the lists differ from the oracle's lists on the exact scores, every swapped pair's exact scores lie within
//!   the two bounds of each other.
//!
//! # Memory
//!
//! The scores are written once per (token, KV head, block): `4 · T · Hkv · ⌈T/l'⌉` bytes, 1 GiB at `T` = 64K with 4
//! KV heads and 64-token blocks, `G · l'/s` times less than the per-head probabilities (64 times at `G = 16`). The
//! scoring kernel holds one tile of 64 windows of probabilities for its 64 (token, head) rows in shared memory.
//!
//! # Errors
//!
//! Before any launch: the configuration ([`NsaConfig::validate`]), the layer (causal self-attention, head dims
//! multiples of 8 up to 256), `n_selected` at most [`MAX_SELECTED`] (one lane of a warp per entry), a GQA group of
//! at most 64 (the rows of one CTA), the buffers' lengths, and sizes against the kernels' 32-bit arguments.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::nsa::{NsaConfig, selection_blocks};
use attnproof_oracle::spec::Operand;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::{Array3, ArrayViewD};

use super::compressed::compressed_spec;
use crate::backward::host_tensor;
use crate::common::{GpuElement, check_len, grid_3d, to_i32, token_rows};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::flash::host_input;
use crate::launch;
use crate::params::{FlashParams, NsaSelectParams};

/// `gpu/kernels/nsa_select.cu` after the shared helpers.
pub const NSA_SELECT: KernelSource = KernelSource {
    name: "nsa_select",
    source: concat!(include_str!("../../kernels/common.cuh"), include_str!("../../kernels/nsa_select.cu")),
};

/// The longest list the top-n kernel writes: one entry per lane of a warp (the kernel's `TOPN_MAX`).
pub const MAX_SELECTED: usize = 32;

/// The largest GQA group: one scoring CTA holds the 64 rows of at least one token's heads (the kernel's `SEL_ROWS`).
pub const MAX_GROUP: usize = 64;

/// Threads per CTA of both kernels; the top-n kernel runs one warp per token.
const THREADS: u32 = 128;
const TOPN_TOKENS_PER_CTA: usize = 4;
/// The scoring kernel's tiles: rows, windows per tile.
const ROWS: usize = 64;
const WINDOWS: usize = 64;

/// Everything a launch needs, derived from a validated layer spec and configuration.
struct Plan {
    /// The compressed attention's spec (Q, the compressed keys, LSE).
    compressed: AttentionSpec,
    params: NsaSelectParams,
    cu_q: Vec<i32>,
    cu_k: Vec<i32>,
    batch: usize,
    max_len: usize,
    shared_bytes: usize,
}

/// The selection blocks of the longest sequence, `max_b ⌈T_b / l'⌉`: the scores' last axis.
pub fn score_columns(spec: &AttentionSpec, config: &NsaConfig) -> Result<usize, GpuError> {
    let mut most = 0;
    for s in spec.sequences() {
        most = most.max(selection_blocks(s.len_q, config.select_block)?);
    }
    Ok(most)
}

/// The block scores' shape, `[token rows, Hkv, M]` (`M` = [`score_columns`]); a sequence's token `t` is row
/// `b·L + t` dense, `cu_seqlens_q[b] + t` varlen, and its blocks past its own `⌈T_b / l'⌉` stay 0.
pub fn scores_shape(spec: &AttentionSpec, config: &NsaConfig) -> Result<[usize; 3], GpuError> {
    Ok([token_rows(spec), spec.n_heads_kv, score_columns(spec, config)?])
}

/// The lists' shape, `[token rows, Hkv, n_selected]`, rows as in [`scores_shape`].
pub fn lists_shape(spec: &AttentionSpec, config: &NsaConfig) -> [usize; 3] {
    [token_rows(spec), spec.n_heads_kv, config.n_selected]
}

fn plan(spec: &AttentionSpec, config: &NsaConfig) -> Result<Plan, GpuError> {
    let compressed = compressed_spec(spec, config)?;
    if config.n_selected > MAX_SELECTED {
        return Err(GpuError::Unsupported {
            argument: "n_selected",
            reason: format!("{} entries per list; the selection writes at most {MAX_SELECTED}", config.n_selected),
        });
    }
    let group = spec.group_size();
    if group > MAX_GROUP {
        return Err(GpuError::Unsupported {
            argument: "n_heads_q / n_heads_kv",
            reason: format!("a GQA group of {group}; the scoring kernel's 64 rows hold at most {MAX_GROUP} heads"),
        });
    }
    let (flash, cu_q, cu_k) = FlashParams::for_spec(&compressed)?;
    let [rows, heads, columns] = scores_shape(spec, config)?;
    let elements = rows.checked_mul(heads).and_then(|n| n.checked_mul(columns.max(config.n_selected)));
    let fits = elements.and_then(|n| i64::try_from(n).ok()).is_some();
    if !fits {
        return Err(GpuError::TooLarge { argument: "block scores", value: elements.unwrap_or(usize::MAX) });
    }
    let d_pad = padded_head_dim(spec.head_dim);
    let params = NsaSelectParams {
        flash,
        token_rows: rows as i64,
        compress_len: to_i32("compress_len", config.compress_len)?,
        compress_stride: to_i32("compress_stride", config.compress_stride)?,
        select_block: to_i32("select_block", config.select_block)?,
        n_blocks: to_i32("selection blocks", columns)?,
        n_selected: to_i32("n_selected", config.n_selected)?,
        n_forced_initial: to_i32("n_forced_initial", config.n_forced_initial)?,
        n_forced_local: to_i32("n_forced_local", config.n_forced_local)?,
        n_heads_kv: to_i32("n_heads_kv", spec.n_heads_kv)?,
        tokens_per_cta: to_i32("tokens per CTA", ROWS / group.max(1))?,
        tile_blocks: to_i32("blocks per tile of windows", tile_blocks(config))?,
    };
    let stride = d_pad + 8;
    // Q and two K̃ tiles, the probabilities, the per-tile tables of each block's first and last window, and the
    // weight of every overlap 0 ..= min(l, l').
    let tables = 2 * tile_blocks(config) * 4 + (config.compress_len.min(config.select_block) + 1) * 4;
    let shared_bytes = (3 * ROWS * stride * 2 + ROWS * (WINDOWS + 4) * 4 + tables).div_ceil(16) * 16;
    let seqs = spec.sequences();
    let max_len = seqs.iter().map(|s| s.len_q).max().unwrap_or(0);
    Ok(Plan { compressed, params, cu_q, cu_k, batch: seqs.len(), max_len, shared_bytes })
}

/// The defines `nsa_select.cu` is compiled with for queries of `head_dim` columns: the storage type and
/// `NSA_D_PAD`, the head dim rounded up to a multiple of 64.
pub fn select_defines<T: GpuElement>(head_dim: usize) -> Vec<String> {
    vec![T::DEFINE.to_owned(), format!("NSA_D_PAD={}", padded_head_dim(head_dim))]
}

/// The most selection blocks one tile of 64 windows touches: its tokens span `63·s + l` positions, so at most
/// `⌊(63·s + l − 1)/l'⌋ + 2` blocks (a floor of a sum exceeds the sum of floors by at most one).
fn tile_blocks(config: &NsaConfig) -> usize {
    ((WINDOWS - 1) * config.compress_stride + config.compress_len - 1) / config.select_block + 2
}

/// `NSA_D_PAD`: the head dim rounded up to a multiple of 64 (the tiles' columns).
fn padded_head_dim(head_dim: usize) -> usize {
    head_dim.div_ceil(64).max(1) * 64
}

/// The selection of the layer `spec` (causal self-attention) under `config` on device buffers: `q` the layer's
/// queries, `k_cmp` the compressed keys ([`super::compress::compressed_shape`]), `lse` the compressed attention's
/// LSE (dense `[B, Hq, L]`, varlen `[Hq, T]`); the block scores go to the first [`scores_shape`] elements of
/// `scores` (zeroed first, then written) and the lists to the first [`lists_shape`] elements of `lists`. `kernel` is
/// [`NSA_SELECT`] or a patched copy of it (the tests launch mutants through this path). Every check runs before the
/// first launch; the work is asynchronous on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn select_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernel: KernelSource,
    q: &CudaSlice<T>,
    k_cmp: &CudaSlice<T>,
    lse: &CudaSlice<f32>,
    scores: &mut CudaSlice<f32>,
    lists: &mut CudaSlice<i32>,
) -> Result<(), GpuError> {
    let plan = plan(spec, config)?;
    let size = |op: Operand| plan.compressed.expected_shape(op).iter().product::<usize>();
    check_len("q", q, size(Operand::Q))?;
    check_len("k_cmp", k_cmp, size(Operand::K))?;
    check_len("lse", lse, size(Operand::RowStat))?;
    let n_scores: usize = scores_shape(spec, config)?.iter().product();
    check_len("scores", scores, n_scores)?;
    check_len("lists", lists, lists_shape(spec, config).iter().product())?;
    if plan.max_len == 0 || plan.batch == 0 || spec.n_heads_kv == 0 {
        return Ok(());
    }
    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &select_defines::<T>(spec.head_dim))?;
    let load = |name: &'static str| {
        module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(nsa_select.cu)", e))
    };
    let (score_fn, top_n_fn) = (load("nsa_block_scores")?, load("nsa_top_n")?);
    compile::allow_shared_memory(ctx, &score_fn, plan.shared_bytes, "head_dim, or blocks per tile of windows")?;
    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e));
    let (cu_q, cu_k) = (up(&plan.cu_q)?, up(&plan.cu_k)?);
    if n_scores > 0 {
        stream
            .memset_zeros(&mut scores.slice_mut(..n_scores))
            .map_err(|e| GpuError::driver("cuMemsetD8Async(scores)", e))?;
    }
    let tokens_per_cta = plan.params.tokens_per_cta as usize;
    let cfg = LaunchConfig {
        grid_dim: grid_3d(
            ("token groups", plan.max_len.div_ceil(tokens_per_cta)),
            ("n_heads_kv", spec.n_heads_kv),
            ("sequences", plan.batch),
        )?,
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: plan.shared_bytes as u32,
    };
    launch::launch_nsa_block_scores(stream, &score_fn, cfg, (q, k_cmp, lse), scores, (&cu_q, &cu_k), &plan.params)?;
    let cfg = LaunchConfig {
        grid_dim: grid_3d(
            ("token groups", plan.max_len.div_ceil(TOPN_TOKENS_PER_CTA)),
            ("n_heads_kv", spec.n_heads_kv),
            ("sequences", plan.batch),
        )?,
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch::launch_nsa_top_n(stream, &top_n_fn, cfg, scores, lists, (&cu_q, &cu_k), &plan.params)
}

/// The block scores and lists of a layer, host side.
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    /// `[token rows, Hkv, M]` f32 ([`scores_shape`]).
    pub scores: Array3<f32>,
    /// `[token rows, Hkv, n_selected]`, ascending, `−1`-padded ([`lists_shape`]).
    pub lists: Array3<i32>,
}

/// The selection from host tensors (copies in, launches, copies out, synchronizes): `q` the layer's queries,
/// `k_cmp` the compressed keys, `lse` the compressed attention's LSE, as in [`select_device`]. `kernel` as there.
pub fn select<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernel: KernelSource,
    q: ArrayViewD<'_, T>,
    k_cmp: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
) -> Result<Selection, GpuError> {
    let plan = plan(spec, config)?;
    let hq = host_input(spec, "q", Operand::Q, &q)?;
    let hk = host_input(&plan.compressed, "k_cmp", Operand::K, &k_cmp)?;
    // −∞ is the LSE of a token that sees no window.
    let hl =
        host_tensor(&plan.compressed, "lse", Operand::RowStat, &lse, |x: f32| x.is_finite() || x == f32::NEG_INFINITY)?;
    let up_err = |e| GpuError::driver("cuMemcpyHtoD", e);
    let up = |data: &[T]| if data.is_empty() { stream.alloc_zeros::<T>(1) } else { stream.clone_htod(data) };
    let (dq, dk) = (up(hq).map_err(up_err)?, up(hk).map_err(up_err)?);
    let dl = if hl.is_empty() { stream.alloc_zeros::<f32>(1) } else { stream.clone_htod(hl) }.map_err(up_err)?;
    let (s_shape, l_shape) = (scores_shape(spec, config)?, lists_shape(spec, config));
    let (n_scores, n_lists) = (s_shape.iter().product::<usize>(), l_shape.iter().product::<usize>());
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let mut scores = stream.alloc_zeros::<f32>(n_scores.max(1)).map_err(alloc_err)?;
    let mut lists = stream.alloc_zeros::<i32>(n_lists.max(1)).map_err(alloc_err)?;
    select_device(stream, spec, config, kernel, &dq, &dk, &dl, &mut scores, &mut lists)?;
    let down_err = |e| GpuError::driver("cuMemcpyDtoH", e);
    let mut host_scores = stream.clone_dtoh(&scores).map_err(down_err)?;
    let mut host_lists = stream.clone_dtoh(&lists).map_err(down_err)?;
    stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
    host_scores.truncate(n_scores);
    host_lists.truncate(n_lists);
    Ok(Selection {
        scores: Array3::from_shape_vec(s_shape, host_scores).expect("length matches the shape"),
        lists: Array3::from_shape_vec(l_shape, host_lists).expect("length matches the shape"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::{Layout, Mask};

    fn layer(batch: usize, hq: usize, hkv: usize, len: usize, d: usize) -> AttentionSpec {
        AttentionSpec::dense(batch, hq, hkv, len, len, d, d).with_mask(Mask::Causal)
    }

    #[test]
    fn plans_size_the_scores_lists_and_tiles() {
        let config = NsaConfig::default();
        let spec = layer(2, 12, 4, 200, 128);
        let p = plan(&spec, &config).unwrap();
        // ⌈200 / 64⌉ = 4 blocks; ⌊(200 − 32)/16⌋ + 1 = 11 windows; group 3: 21 tokens of 3 rows per CTA.
        assert_eq!(scores_shape(&spec, &config).unwrap(), [400, 4, 4]);
        assert_eq!(lists_shape(&spec, &config), [400, 4, 16]);
        assert_eq!((p.params.n_blocks, p.params.tokens_per_cta, p.params.token_rows), (4, 21, 400));
        assert_eq!(p.params.flash.dense_len_k, 11);
        // (63·16 + 31)/64 + 2 = 18 blocks per tile; overlaps 0 ..= 32.
        assert_eq!(p.params.tile_blocks, 18);
        assert_eq!(p.shared_bytes, (3 * 64 * 136 * 2 + 64 * 68 * 4 + 2 * 18 * 4 + 33 * 4usize).div_ceil(16) * 16);
        assert_eq!([padded_head_dim(72), padded_head_dim(8), padded_head_dim(192)], [128, 64, 192]);
        assert_eq!(select_defines::<half::bf16>(72)[1], "NSA_D_PAD=128");
        let varlen = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 0, 65, 90], cu_seqlens_k: vec![0, 0, 65, 90] },
            ..layer(1, 16, 1, 1, 64)
        };
        assert_eq!(scores_shape(&varlen, &config).unwrap(), [90, 1, 2]);
        let p = plan(&varlen, &config).unwrap();
        assert_eq!((p.max_len, p.batch, p.params.tokens_per_cta), (65, 3, 4));
        assert_eq!(p.cu_k, [0, 0, 3, 3]);
    }

    /// The kernel's per-tile tables hold every block a tile of 64 windows touches: for tiles starting at every window
    /// position, the blocks from the first window's first token to the last window's last token never outnumber
    /// `tile_blocks`, and some tile comes within one block of it (the bound wastes at most one table entry here).
    #[test]
    fn the_tile_tables_hold_every_block_a_tile_touches() {
        for (l, s, lb) in [(32, 16, 64), (64, 64, 64), (5, 3, 8), (8, 4, 16), (1, 1, 1), (100, 1, 7), (3, 50, 2)] {
            let config = NsaConfig { compress_len: l, compress_stride: s, select_block: lb, ..NsaConfig::default() };
            let bound = tile_blocks(&config);
            let mut most = 0;
            for w0 in (0..2000).step_by(64) {
                for nw in [1, 63, 64] {
                    let (first, last) = (w0 * s / lb, ((w0 + nw - 1) * s + l - 1) / lb);
                    most = most.max(last - first + 1);
                }
            }
            assert!(most <= bound, "l = {l}, s = {s}, l' = {lb}: {most} blocks, tables of {bound}");
            assert!(most + 1 >= bound, "l = {l}, s = {s}, l' = {lb}: {most} blocks, tables of {bound}");
        }
    }

    #[test]
    fn unsupported_configurations_are_typed_errors() {
        let spec = layer(1, 4, 2, 100, 64);
        let wide = NsaConfig { n_selected: 33, ..NsaConfig::default() };
        assert!(matches!(plan(&spec, &wide), Err(GpuError::Unsupported { argument: "n_selected", .. })));
        let crowded = NsaConfig { n_selected: 2, ..NsaConfig::default() };
        assert!(matches!(plan(&spec, &crowded), Err(GpuError::Spec(_))), "three forced blocks in two entries");
        let big_group = layer(1, 65, 1, 100, 64);
        assert!(matches!(
            plan(&big_group, &NsaConfig::default()),
            Err(GpuError::Unsupported { argument: "n_heads_q / n_heads_kv", .. })
        ));
        let open = spec.clone().with_mask(Mask::None);
        assert!(matches!(plan(&open, &NsaConfig::default()), Err(GpuError::Unsupported { argument: "mask", .. })));
        let odd = layer(1, 4, 2, 100, 12);
        assert!(matches!(plan(&odd, &NsaConfig::default()), Err(GpuError::Unsupported { argument: "head_dim", .. })));
    }
}
