//! NSA's selected-block attention forward (E18's selection branch, E31) on the GPU: `gpu/kernels/nsa_selected.cu`
//! behind typed wrappers, from device buffers ([`selected_device`]) or host tensors ([`selected`]).
//!
//! Every token `t` attends, for each query head of its KV head's group, to the tokens `≤ t` of the blocks of `l'`
//! tokens its list names (the lists of [`super::select`], `[token rows, Hkv, n]`, or the caller's), with one softmax
//! over all of them: the oracle's `nsa::selected_attention`, with the LSE beside the output. The scale is the
//! configuration's, as in every NSA branch.
//!
//! # Schedule, and why the dense bound holds
//!
//! One CTA per (`⌊R/G⌋` consecutive tokens, KV head, sequence); its `R` rows ([`SelectedTiling`]: 16, 32, 48 or 64;
//! 48 by default where they hold the group) are the (token, query head) pairs, so a block's K and V tiles are loaded
//! once for every head of the group and every token of the CTA (E31's shared `[G heads, l' tokens]` tile, for any
//! group size up to 64). The CTA walks the union of its tokens' lists in
//! ascending block order, each block in tiles of [`KV_TILE`] keys from the block's first token; a row whose token does
//! not list the block sees the tile fully masked, which leaves its online-softmax state bit for bit unchanged. So each
//! row performs exactly the dense forward's operations (`gpu/kernels/flash_fwd.cu`'s recipe) over the tiles of its own
//! blocks, in ascending order: the dense bound applies with one rescale per visited tile, at most
//! [`visited_tiles`] per row, and tiles of `min(l', 64)` keys.
//!
//! # Errors
//!
//! Before any launch: the configuration ([`NsaConfig::validate`]), the layer (causal self-attention, head dims
//! multiples of 8 up to 256), a GQA group of at most 64, the buffers' lengths and sizes against the kernel's 32-bit
//! arguments; from host tensors also every list against E14's convention ([`GpuError::BlockList`] names the entry
//! as (sequence, KV head, token, slot)). Lists on the device are not validated (that would cost a copy): the kernel
//! ends a list at its first entry that does not rise or lies outside its sequence's blocks, so no list can make it
//! read outside its sequence's keys.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::nsa::{NsaConfig, selection_blocks};
use attnproof_oracle::spec::Operand;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::{ArrayD, ArrayView3, Axis, IxDyn};

use super::check_layer;
use super::select::{MAX_GROUP, lists_shape};
use crate::block_sparse::check_block_list;
use crate::common::{GpuElement, check_len, grid_3d, to_i32};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::flash::{ForwardOutput, host_input};
use crate::launch;
use crate::params::{FlashParams, NsaSelectParams};

/// `gpu/kernels/nsa_selected.cu` after the shared helpers.
pub const NSA_SELECTED: KernelSource = KernelSource {
    name: "nsa_selected",
    source: concat!(include_str!("../../kernels/common.cuh"), include_str!("../../kernels/nsa_selected.cu")),
};

/// Keys per tile of the kernel (`SLC_KEYS`): a block is visited in `⌈l'/64⌉` tiles from its first token.
pub const KV_TILE: usize = 64;

/// How many (token, head) rows a CTA owns (`SLC_ROWS`; a warp per 16 rows): the CTA walks the union of its
/// `⌊R/G⌋` tokens' lists, sharing each K/V tile among them. More rows share more loads but leave more warps waiting
/// through blocks their rows did not list; `R = G` (a multiple of 16) walks one token's list alone. Every tiling
/// computes each row with the same operations in the same order (a row's arithmetic does not depend on its
/// neighbours), so all have the same bits and the same bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelectedTiling {
    /// Rows per CTA: 16, 32, 48 or 64, at least the group size.
    pub rows_per_cta: usize,
}

impl SelectedTiling {
    /// Every row count the kernel compiles for.
    pub const ROW_COUNTS: [usize; 4] = [16, 32, 48, 64];

    /// The default for a GQA group of `group` heads: 48 rows when they hold the group, else 64. Measured on the
    /// H200 (`bench --nsa`, bf16, top-16 of 64-token blocks, T = 64K): at G = 16, 24.8 / 20.7 / 20.2 / 22.2 ms with
    /// 16 / 32 / 48 / 64 rows, at G = 4 18.8 / 16.5 / 16.3 / 17.9 ms: one token per CTA loads every tile for 16 rows
    /// only, 64 rows wait through the widest unions.
    pub fn for_group(group: usize) -> Self {
        Self { rows_per_cta: if group <= 48 { 48 } else { 64 } }
    }

    /// The tilings that hold a group of `group` heads.
    pub fn for_group_all(group: usize) -> Vec<Self> {
        Self::ROW_COUNTS.iter().filter(|&&r| r >= group).map(|&rows_per_cta| Self { rows_per_cta }).collect()
    }

    fn check(self, group: usize) -> Result<(), GpuError> {
        if !Self::ROW_COUNTS.contains(&self.rows_per_cta) || self.rows_per_cta < group {
            return Err(GpuError::Unsupported {
                argument: "rows_per_cta",
                reason: format!(
                    "{} rows per CTA for a group of {group}: one of {:?}, at least the group",
                    self.rows_per_cta,
                    Self::ROW_COUNTS
                ),
            });
        }
        Ok(())
    }
}

/// The most tiles a row visits: `⌈l'/64⌉` per listed block, `n_selected` blocks.
pub fn visited_tiles(config: &NsaConfig) -> usize {
    config.n_selected * config.select_block.div_ceil(KV_TILE)
}

/// The keys of the longest tile: `min(l', 64)` (a block shorter than a tile is a tile of its own).
pub fn tile_keys(config: &NsaConfig) -> usize {
    config.select_block.min(KV_TILE)
}

/// The selection branch's attention problem: the layer's spec under the configuration's scale.
pub fn selected_spec(spec: &AttentionSpec, config: &NsaConfig) -> Result<AttentionSpec, GpuError> {
    config.validate()?;
    check_layer(spec)?;
    Ok(AttentionSpec { scale: config.scale, ..spec.clone() })
}

/// The defines `nsa_selected.cu` is compiled with: the storage type, the head dims rounded up to a multiple of 16
/// and the rows per CTA.
pub fn selected_defines<T: GpuElement>(spec: &AttentionSpec, tiling: SelectedTiling) -> Vec<String> {
    let pad = |d: usize| d.div_ceil(16).max(1) * 16;
    vec![
        T::DEFINE.to_owned(),
        format!("HEAD_DIM_PAD={}", pad(spec.head_dim)),
        format!("HEAD_DIM_V_PAD={}", pad(spec.head_dim_v)),
        format!("SLC_ROWS={}", tiling.rows_per_cta),
    ]
}

/// Everything a launch needs, derived from a validated layer spec and configuration.
pub(super) struct Plan {
    pub spec: AttentionSpec,
    pub params: NsaSelectParams,
    pub cu_q: Vec<i32>,
    pub cu_k: Vec<i32>,
    pub batch: usize,
    pub max_len: usize,
    shared_bytes: usize,
    tiling: SelectedTiling,
}

/// The checks of a selected-attention launch (forward or backward) and what it needs.
pub(super) fn plan(spec: &AttentionSpec, config: &NsaConfig, tiling: Option<SelectedTiling>) -> Result<Plan, GpuError> {
    let spec = selected_spec(spec, config)?;
    let group = spec.group_size();
    if group > MAX_GROUP {
        return Err(GpuError::Unsupported {
            argument: "n_heads_q / n_heads_kv",
            reason: format!("a GQA group of {group}; the kernel's 64 rows hold at most {MAX_GROUP} heads"),
        });
    }
    // Block starts and ends are 32-bit positions in the kernel: `block·l' + l'` stays below 2^31 for l' ≤ 2^30
    // (positions are below 2^30, FlashParams::for_spec).
    if config.select_block > 1 << 30 {
        return Err(GpuError::TooLarge { argument: "select_block", value: config.select_block });
    }
    // A block is one tile when l' ≤ 64 and whole 64-key tiles when l' is a multiple of 64: either way a row's tiles
    // are disjoint runs of at most `tile_keys` keys, at most ⌈L / tile_keys⌉ of them, which the bound's rescale count
    // assumes. Other lengths would split a block into a full tile and a short one.
    if config.select_block > KV_TILE && !config.select_block.is_multiple_of(KV_TILE) {
        return Err(GpuError::Unsupported {
            argument: "select_block",
            reason: format!("{} tokens: blocks above {KV_TILE} must be a multiple of {KV_TILE}", config.select_block),
        });
    }
    let (flash, cu_q, cu_k) = FlashParams::for_spec(&spec)?;
    let [rows, heads, width] = lists_shape(&spec, config);
    let elements = rows.checked_mul(heads).and_then(|n| n.checked_mul(width));
    if elements.and_then(|n| i64::try_from(n).ok()).is_none() {
        return Err(GpuError::TooLarge { argument: "lists", value: elements.unwrap_or(usize::MAX) });
    }
    let seqs = spec.sequences();
    let max_len = seqs.iter().map(|s| s.len_q).max().unwrap_or(0);
    let tiling = tiling.unwrap_or(SelectedTiling::for_group(group));
    tiling.check(group)?;
    let tokens_per_cta = tiling.rows_per_cta / group.max(1);
    let params = NsaSelectParams {
        flash,
        token_rows: rows as i64,
        compress_len: to_i32("compress_len", config.compress_len)?,
        compress_stride: to_i32("compress_stride", config.compress_stride)?,
        select_block: to_i32("select_block", config.select_block)?,
        n_blocks: to_i32("selection blocks", selection_blocks(max_len, config.select_block)?)?,
        n_selected: to_i32("n_selected", width)?,
        n_forced_initial: to_i32("n_forced_initial", config.n_forced_initial)?,
        n_forced_local: to_i32("n_forced_local", config.n_forced_local)?,
        n_heads_kv: to_i32("n_heads_kv", spec.n_heads_kv)?,
        tokens_per_cta: to_i32("tokens per CTA", tokens_per_cta)?,
        tile_blocks: 0,
    };
    let pad = |d: usize| d.div_ceil(16).max(1) * 16;
    // Q and K tiles, the V tile (2-byte elements, rows padded by 8), and each token's list with its end marker.
    let tiles = 2 * ((tiling.rows_per_cta + KV_TILE) * (pad(spec.head_dim) + 8) + KV_TILE * (pad(spec.head_dim_v) + 8));
    let lists = tokens_per_cta.checked_mul(width + 1).and_then(|n| n.checked_mul(4)).unwrap_or(usize::MAX);
    let shared_bytes = tiles.saturating_add(lists);
    Ok(Plan { params, cu_q, cu_k, batch: seqs.len(), max_len, shared_bytes, spec, tiling })
}

/// The selection branch of the layer `spec` (causal self-attention) under `config` on device buffers: `q`, `k`, `v`
/// the layer's, `lists` `[token rows, Hkv, n_selected]` ([`super::select::lists_shape`]; not validated, see the
/// module docs); `o` (O's layout) and `lse` (dense `[B, Hq, L]`, varlen `[Hq, T]`) are written in full. `kernel` is
/// [`NSA_SELECTED`] or a patched copy of it (the tests launch mutants through this path). Every check runs before
/// the launch; the work is asynchronous on `stream`. The CTAs take [`SelectedTiling::for_group`]'s rows.
#[allow(clippy::too_many_arguments)]
pub fn selected_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernel: KernelSource,
    qkv: (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    lists: &CudaSlice<i32>,
    o: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    selected_device_with(stream, spec, config, (kernel, None), qkv, lists, o, lse)
}

/// [`selected_device`] with an explicit tiling (`None`: the group's default); a tiling that does not hold the group
/// is [`GpuError::Unsupported`] before any launch.
#[allow(clippy::too_many_arguments)]
pub fn selected_device_with<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    (kernel, tiling): (KernelSource, Option<SelectedTiling>),
    (q, k, v): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    lists: &CudaSlice<i32>,
    o: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    let plan = plan(spec, config, tiling)?;
    let size = |op: Operand| plan.spec.expected_shape(op).iter().product::<usize>();
    check_len("q", q, size(Operand::Q))?;
    check_len("k", k, size(Operand::K))?;
    check_len("v", v, size(Operand::V))?;
    check_len("lists", lists, lists_shape(&plan.spec, config).iter().product())?;
    check_len("o", o, size(Operand::O))?;
    check_len("lse", lse, size(Operand::RowStat))?;
    if plan.max_len == 0 || plan.batch == 0 || spec.n_heads_kv == 0 {
        return Ok(());
    }
    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &selected_defines::<T>(&plan.spec, plan.tiling))?;
    let func = module
        .load_function("nsa_selected_fwd")
        .map_err(|e| GpuError::driver("cuModuleGetFunction(nsa_selected.cu)", e))?;
    compile::allow_shared_memory(ctx, &func, plan.shared_bytes, "head_dim, head_dim_v or n_selected")?;
    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e));
    let (cu_q, cu_k) = (up(&plan.cu_q)?, up(&plan.cu_k)?);
    let tokens_per_cta = plan.params.tokens_per_cta as usize;
    let cfg = LaunchConfig {
        grid_dim: grid_3d(
            ("token groups", plan.max_len.div_ceil(tokens_per_cta)),
            ("n_heads_kv", spec.n_heads_kv),
            ("sequences", plan.batch),
        )?,
        block_dim: (2 * plan.tiling.rows_per_cta as u32, 1, 1),
        shared_mem_bytes: plan.shared_bytes as u32,
    };
    launch::launch_nsa_selected_fwd(stream, &func, cfg, (q, k, v), (o, lse), lists, (&cu_q, &cu_k), &plan.params)
}

/// Checks host lists `[token rows, Hkv, n_selected]` against E14's convention for `spec`: per token, an ascending
/// prefix of distinct blocks of its sequence (`0 .. ⌈T_b/l'⌉`), then `−1`. Blocks after the token (`j·l' > t`) are
/// allowed: they add nothing, as in the oracle.
pub fn validate_lists(spec: &AttentionSpec, config: &NsaConfig, lists: ArrayView3<'_, i32>) -> Result<(), GpuError> {
    let expected = lists_shape(spec, config).to_vec();
    if lists.shape() != expected.as_slice() {
        return Err(GpuError::Shape { argument: "lists", expected, actual: lists.shape().to_vec() });
    }
    let mut row0 = 0;
    for seq in spec.sequences() {
        let bound = selection_blocks(seq.len_q, config.select_block)?;
        for t in 0..seq.len_q {
            for (kv, list) in lists.index_axis(Axis(0), row0 + t).outer_iter().enumerate() {
                check_block_list(list.iter().copied(), bound)
                    .map_err(|(slot, fault)| GpuError::BlockList { position: [seq.index, kv, t, slot], fault })?;
            }
        }
        row0 += seq.len_q;
    }
    Ok(())
}

/// The selection branch from host tensors (validates the lists, copies in, launches, copies out, synchronizes);
/// arguments as in [`selected_device`]. `O` and LSE come back in the layer's layouts.
#[allow(clippy::too_many_arguments)]
pub fn selected<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernel: KernelSource,
    q: ndarray::ArrayViewD<'_, T>,
    k: ndarray::ArrayViewD<'_, T>,
    v: ndarray::ArrayViewD<'_, T>,
    lists: ArrayView3<'_, i32>,
) -> Result<ForwardOutput<T>, GpuError> {
    let plan = plan(spec, config, None)?;
    let hq = host_input(&plan.spec, "q", Operand::Q, &q)?;
    let hk = host_input(&plan.spec, "k", Operand::K, &k)?;
    let hv = host_input(&plan.spec, "v", Operand::V, &v)?;
    validate_lists(&plan.spec, config, lists)?;
    let hl = lists.as_standard_layout();
    let hl = hl.as_slice().expect("standard layout");
    let up_err = |e| GpuError::driver("cuMemcpyHtoD", e);
    let up = |data: &[T]| if data.is_empty() { stream.alloc_zeros::<T>(1) } else { stream.clone_htod(data) };
    let (dq, dk, dv) = (up(hq).map_err(up_err)?, up(hk).map_err(up_err)?, up(hv).map_err(up_err)?);
    let dl = if hl.is_empty() { stream.alloc_zeros::<i32>(1) } else { stream.clone_htod(hl) }.map_err(up_err)?;
    let (o_shape, lse_shape) = (plan.spec.expected_shape(Operand::O), plan.spec.expected_shape(Operand::RowStat));
    let (n_o, n_lse) = (o_shape.iter().product::<usize>(), lse_shape.iter().product::<usize>());
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let mut o = stream.alloc_zeros::<T>(n_o.max(1)).map_err(alloc_err)?;
    let mut lse = stream.alloc_zeros::<f32>(n_lse.max(1)).map_err(alloc_err)?;
    selected_device(stream, spec, config, kernel, (&dq, &dk, &dv), &dl, &mut o, &mut lse)?;
    let down_err = |e| GpuError::driver("cuMemcpyDtoH", e);
    let mut host_o = stream.clone_dtoh(&o).map_err(down_err)?;
    let mut host_lse = stream.clone_dtoh(&lse).map_err(down_err)?;
    stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
    host_o.truncate(n_o);
    host_lse.truncate(n_lse);
    Ok(ForwardOutput {
        o: ArrayD::from_shape_vec(IxDyn(&o_shape), host_o).expect("length matches the shape"),
        lse: ArrayD::from_shape_vec(IxDyn(&lse_shape), host_lse).expect("length matches the shape"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::{Layout, Mask, Scale};

    fn layer(batch: usize, hq: usize, hkv: usize, len: usize, d: usize, dv: usize) -> AttentionSpec {
        AttentionSpec::dense(batch, hq, hkv, len, len, d, dv).with_mask(Mask::Causal)
    }

    #[test]
    fn the_plan_sizes_tiles_lists_and_grid() {
        let config = NsaConfig { n_selected: 5, scale: Scale::Value(0.5), ..NsaConfig::default() };
        let p = plan(&layer(2, 12, 4, 130, 192, 128), &config, Some(SelectedTiling { rows_per_cta: 64 })).unwrap();
        assert_eq!(p.spec.scale, Scale::Value(0.5));
        assert_eq!((p.params.tokens_per_cta, p.params.n_selected, p.params.n_blocks), (21, 5, 3));
        assert_eq!(p.params.token_rows, 260);
        // Q and K tiles of 64 rows of 192 + 8, V of 64 rows of 128 + 8, 21 lists of 6 entries.
        assert_eq!(p.shared_bytes, 2 * 64 * 200 * 2 + 64 * 136 * 2 + 21 * 6 * 4);
        assert_eq!(
            selected_defines::<half::f16>(&p.spec, p.tiling),
            ["ELEM_F16", "HEAD_DIM_PAD=192", "HEAD_DIM_V_PAD=128", "SLC_ROWS=64"]
        );
        assert_eq!(
            selected_defines::<half::bf16>(&layer(1, 1, 1, 1, 72, 8), SelectedTiling { rows_per_cta: 16 }),
            ["ELEM_BF16", "HEAD_DIM_PAD=80", "HEAD_DIM_V_PAD=16", "SLC_ROWS=16"]
        );
        assert_eq!(plan(&layer(2, 12, 4, 130, 192, 128), &config, None).unwrap().params.tokens_per_cta, 16);
        // A group of 16 takes three tokens per CTA of 48 rows by default, one token in a CTA of 16 rows on request.
        let p = plan(&layer(1, 16, 1, 130, 128, 128), &config, None).unwrap();
        assert_eq!((p.tiling.rows_per_cta, p.params.tokens_per_cta), (48, 3));
        let p = plan(&layer(1, 16, 1, 130, 128, 128), &config, Some(SelectedTiling { rows_per_cta: 16 })).unwrap();
        assert_eq!((p.tiling.rows_per_cta, p.params.tokens_per_cta), (16, 1));
        assert_eq!(p.shared_bytes, 2 * (16 + 64) * 136 + 2 * 64 * 136 + 6 * 4);
        let config = NsaConfig { select_block: 192, ..NsaConfig::default() };
        assert_eq!((visited_tiles(&config), tile_keys(&config)), (48, 64));
        let config = NsaConfig { select_block: 16, ..NsaConfig::default() };
        assert_eq!((visited_tiles(&config), tile_keys(&config)), (16, 16));
    }

    #[test]
    fn unsupported_layers_are_typed_errors() {
        let config = NsaConfig::default();
        let not_causal = AttentionSpec::dense(1, 2, 1, 64, 64, 64, 64);
        assert!(matches!(plan(&not_causal, &config, None), Err(GpuError::Unsupported { argument: "mask", .. })));
        let cross = AttentionSpec::dense(1, 2, 1, 64, 65, 64, 64).with_mask(Mask::Causal);
        assert!(matches!(plan(&cross, &config, None), Err(GpuError::Unsupported { argument: "layout", .. })));
        assert!(matches!(
            plan(&layer(1, 65, 1, 64, 64, 64), &config, None),
            Err(GpuError::Unsupported { argument: "n_heads_q / n_heads_kv", .. })
        ));
        assert!(matches!(
            plan(&layer(1, 2, 1, 64, 60, 64), &config, None),
            Err(GpuError::Unsupported { argument: "head_dim", .. })
        ));
        let huge = NsaConfig { select_block: (1 << 30) + 1, ..NsaConfig::default() };
        assert!(matches!(plan(&layer(1, 2, 1, 64, 64, 64), &huge, None), Err(GpuError::TooLarge { .. })));
        let split = NsaConfig { select_block: 100, ..NsaConfig::default() };
        assert!(matches!(
            plan(&layer(1, 2, 1, 64, 64, 64), &split, None),
            Err(GpuError::Unsupported { argument: "select_block", .. })
        ));
        for fine in [1, 48, 64, 128] {
            let config = NsaConfig { select_block: fine, ..NsaConfig::default() };
            assert!(plan(&layer(1, 2, 1, 64, 64, 64), &config, None).is_ok(), "select_block {fine}");
        }
        let bad = NsaConfig { n_selected: 2, ..NsaConfig::default() };
        assert!(matches!(plan(&layer(1, 2, 1, 64, 64, 64), &bad, None), Err(GpuError::Spec(_))));
        // A tiling must hold the group and be one the kernel compiles for.
        for rows_per_cta in [16, 20, 0, 128] {
            assert!(matches!(
                plan(&layer(1, 17, 1, 64, 64, 64), &config, Some(SelectedTiling { rows_per_cta })),
                Err(GpuError::Unsupported { argument: "rows_per_cta", .. })
            ));
        }
        assert_eq!(
            SelectedTiling::for_group_all(17),
            [
                SelectedTiling { rows_per_cta: 32 },
                SelectedTiling { rows_per_cta: 48 },
                SelectedTiling { rows_per_cta: 64 }
            ]
        );
        for (group, rows) in [(1, 48), (3, 48), (16, 48), (17, 48), (48, 48), (49, 64), (64, 64)] {
            assert_eq!(SelectedTiling::for_group(group).rows_per_cta, rows, "group {group}");
        }
    }

    /// Every way a list can break the convention is named with its (sequence, KV head, token, slot), per sequence of
    /// a varlen layout; blocks after the token and lists wider than the blocks are accepted.
    #[test]
    fn bad_lists_are_named_typed_errors() {
        use crate::error::BlockListFault as F;
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 130, 130, 200], cu_seqlens_k: vec![0, 130, 130, 200] },
            ..layer(1, 4, 2, 1, 64, 64)
        };
        let config = NsaConfig { n_selected: 4, n_forced_initial: 0, n_forced_local: 0, ..NsaConfig::default() };
        let good = ndarray::Array3::from_shape_fn((200, 2, 4), |(t, _, e)| {
            let blocks = if t < 130 { 3 } else { 2 };
            if e < blocks { e as i32 } else { -1 }
        });
        validate_lists(&spec, &config, good.view()).unwrap();
        let with = |row: usize, kv: usize, entries: [i32; 4]| {
            let mut l = good.clone();
            for (e, x) in entries.into_iter().enumerate() {
                l[[row, kv, e]] = x;
            }
            validate_lists(&spec, &config, l.view()).unwrap_err()
        };
        let named = |e: GpuError| match e {
            GpuError::BlockList { position, fault } => (position, fault),
            other => panic!("not a list error: {other}"),
        };
        assert_eq!(named(with(5, 1, [0, 3, -1, -1])), ([0, 1, 5, 1], F::OutOfRange { index: 3, key_blocks: 3 }));
        assert_eq!(named(with(131, 0, [0, 2, -1, -1])), ([2, 0, 1, 1], F::OutOfRange { index: 2, key_blocks: 2 }));
        assert_eq!(named(with(7, 0, [1, 1, -1, -1])), ([0, 0, 7, 1], F::Duplicate { index: 1 }));
        assert_eq!(named(with(7, 0, [2, 1, -1, -1])), ([0, 0, 7, 1], F::NotAscending { index: 1, previous: 2 }));
        assert_eq!(named(with(7, 0, [0, -1, 2, -1])), ([0, 0, 7, 2], F::AfterPad { index: 2 }));
        assert_eq!(named(with(7, 0, [-2, -1, -1, -1])), ([0, 0, 7, 0], F::OutOfRange { index: -2, key_blocks: 3 }));
        let narrow = ndarray::Array3::<i32>::zeros((200, 2, 3));
        assert!(matches!(validate_lists(&spec, &config, narrow.view()), Err(GpuError::Shape { .. })));
    }
}
