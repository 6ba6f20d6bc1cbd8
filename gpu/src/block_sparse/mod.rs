//! Block-sparse attention on the GPU (E14): key-block lists checked against the list convention ([`BlockLists`])
//! and the forward over them (`gpu/kernels/flash_fwd.cu` compiled with `BLOCK_SPARSE`), from device buffers
//! ([`block_sparse_forward_device`]) or host tensors ([`block_sparse_forward`]); the backward ([`backward`]) and the
//! block selector ([`select`]).
//!
//! # Lists
//!
//! Queries are split into query blocks of `q_block` rows and keys into key blocks of `kv_block` keys (64 or 128 each,
//! [`BLOCK_SIZES`]). Each query block has one list of the key blocks it attends to: `i32`, ascending, no index twice,
//! every index inside the sequence's key blocks, then `−1` to the end of the list (the convention of the oracle's
//! `block_sparse` module). The lists are a `[B, list heads, ⌈max Lq / q_block⌉, width]` tensor, with one list head per
//! query head ([`ListHeads::PerQueryHead`]) or per KV head, shared by the query heads of its GQA group
//! ([`ListHeads::PerKvHead`]). Query blocks past a sequence's own (varlen) must be all `−1`, and the width may not
//! exceed the key blocks of the longest sequence. [`BlockLists::validate`] checks all of it before any launch and
//! names the first entry that breaks it ([`GpuError::BlockList`]); the kernel trusts validated lists.
//!
//! # What the kernel computes
//!
//! Drop-and-renormalize block-sparse attention: dense attention under the spec's mask and "the key's block is listed
//! for the query's block" (the oracle's `BlockSparseLayout::visibility`, which [`BlockLists::oracle_layout`] builds).
//! The kernel is the dense forward (`crate::flash`) with one change: a CTA visits the 64-key tiles of its listed
//! blocks, in ascending order, that fall inside its visible key range, instead of every tile of that range. The causal
//! mask, windows and the key tail still apply inside the visited tiles. The recipe, and so the rounding-error model,
//! is the dense forward's under that visibility: a row takes one rescale step per visited tile, at most the
//! `⌈Lk / 64⌉` steps the dense model charges. With every block listed, the kernel visits the dense kernel's tiles in
//! the dense order and computes the same bits (the tests check it). A query block that lists nothing gets `O = 0` and
//! `LSE = −∞`.
//!
//! The query block must hold whole CTAs: the launch takes the production tiling when its rows divide `q_block` and
//! the 64-row tiling otherwise ([`BlockLists::tiling`]); every tiling computes the same bits.
//!
//! On compute capability 9.0, lists of 128-row query blocks and 128-key blocks with head dims up to 128 (the shape
//! the benchmarks and the block selector use) run on the sm_90a forward instead (`gpu/kernels/flash_fwd_sm90.cu`,
//! [`BlockLists::forward_kernel`]): Hopper's warpgroup MMA (`wgmma`), 128-key tiles (one per listed block), the same
//! recipe and the same tile order. Its rows take at most half the rescale steps of `flash_fwd`'s 64-key tiles, so the
//! same rounding-error model covers it; its bits differ from `flash_fwd`'s (the tensor cores sum in another order),
//! and with every block listed it computes the bits of its own dense mode.
//!
//! # Choosing the blocks
//!
//! [`select`] is the block selector (BSA): mean-pooled queries and keys, their scores summed over each GQA group,
//! causal eligibility, forced blocks and top-k, on the GPU, giving lists per KV head for the forward.
//!
//! # Gradients
//!
//! [`backward`] runs the dense backward kernels over the same lists and their CSR transpose (key block → the query
//! blocks that list it), built on the device, with the three dQ strategies of the dense backward.

pub mod backward;
pub mod select;

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::block_sparse::BlockSparseLayout;
use cudarc::driver::{CudaSlice, CudaStream};
use ndarray::{Array4, ArrayViewD, Axis};

use crate::common::{GpuElement, to_i32};
use crate::compile::{self, FLASH_FWD, FLASH_FWD_SM90, ModuleVariant};
use crate::error::{BlockListFault, GpuError};
use crate::flash::{
    BLOCK_SPARSE, ForwardOutput, ForwardTiling, KV_TILE, PreparedForward, WGMMA_KV_TILE, WGMMA_MAX_HEAD_DIM,
    forward_defines, forward_from_host, is_wgmma,
};
use crate::params::BlockListParams;

/// The query and key block sizes the kernel supports.
pub const BLOCK_SIZES: [usize; 2] = [64, 128];

/// Which heads own the lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ListHeads {
    /// One list head per query head: `[B, Hq, ...]`.
    PerQueryHead,
    /// One list head per KV head, shared by the query heads of its group: `[B, Hkv, ...]`.
    PerKvHead,
}

/// The key-block lists of a block-sparse problem (see the module docs for the convention).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockLists {
    /// Query rows per query block (64 or 128).
    pub q_block: usize,
    /// Keys per key block (64 or 128).
    pub kv_block: usize,
    /// Which heads own the lists.
    pub heads: ListHeads,
    /// `[B, list heads, ⌈max Lq / q_block⌉, width]` key-block indices, ascending, `−1`-padded.
    pub lists: Array4<i32>,
}

impl BlockLists {
    /// List heads of `spec`: `Hq` or `Hkv`.
    pub fn list_heads(&self, spec: &AttentionSpec) -> usize {
        match self.heads {
            ListHeads::PerQueryHead => spec.n_heads_q,
            ListHeads::PerKvHead => spec.n_heads_kv,
        }
    }

    /// Query blocks of the longest query sequence of `spec`.
    pub fn query_blocks(&self, spec: &AttentionSpec) -> usize {
        spec.sequences().iter().map(|s| s.len_q.div_ceil(self.q_block)).max().unwrap_or(0)
    }

    /// Key blocks of the longest key sequence of `spec`.
    pub fn key_blocks(&self, spec: &AttentionSpec) -> usize {
        spec.sequences().iter().map(|s| s.len_k.div_ceil(self.kv_block)).max().unwrap_or(0)
    }

    /// Checks the block sizes, the lists' shape and width, and every list against the convention, for a valid
    /// `spec`. The first offending entry is named in [`GpuError::BlockList`].
    pub fn validate(&self, spec: &AttentionSpec) -> Result<(), GpuError> {
        spec.validate()?;
        for (argument, size) in [("q_block", self.q_block), ("kv_block", self.kv_block)] {
            if !BLOCK_SIZES.contains(&size) {
                return Err(GpuError::Unsupported {
                    argument,
                    reason: format!("{size} is not one of {BLOCK_SIZES:?}"),
                });
            }
        }
        let seqs = spec.sequences();
        let width = self.lists.dim().3;
        let expected = vec![seqs.len(), self.list_heads(spec), self.query_blocks(spec), width];
        if self.lists.shape() != expected.as_slice() {
            return Err(GpuError::Shape { argument: "lists", expected, actual: self.lists.shape().to_vec() });
        }
        let most_key_blocks = self.key_blocks(spec);
        if width > most_key_blocks {
            return Err(GpuError::BlockList {
                position: [0, 0, 0, width],
                fault: BlockListFault::TooWide { width, key_blocks: most_key_blocks },
            });
        }
        for seq in &seqs {
            let own_blocks = seq.len_q.div_ceil(self.q_block);
            let key_blocks = seq.len_k.div_ceil(self.kv_block);
            for (head, per_head) in self.lists.index_axis(Axis(0), seq.index).outer_iter().enumerate() {
                for (block, list) in per_head.outer_iter().enumerate() {
                    // Query blocks past the sequence's own may list nothing: no key block is in range there.
                    let bound = if block < own_blocks { key_blocks } else { 0 };
                    check_block_list(list.iter().copied(), bound).map_err(|(slot, fault)| GpuError::BlockList {
                        position: [seq.index, head, block, slot],
                        fault,
                    })?;
                }
            }
        }
        Ok(())
    }

    /// The oracle's layout of the same visibility: lists per query head (a KV head's lists repeated over its group).
    /// Call after [`BlockLists::validate`].
    pub fn oracle_layout(&self, spec: &AttentionSpec) -> BlockSparseLayout {
        let lists = match self.heads {
            ListHeads::PerQueryHead => self.lists.clone(),
            ListHeads::PerKvHead => {
                let heads: Vec<usize> = (0..spec.n_heads_q).map(|h| spec.kv_head(h)).collect();
                self.lists.select(Axis(1), &heads)
            }
        };
        BlockSparseLayout { q_tile: self.q_block, kv_tile: self.kv_block, lists }
    }

    /// Whether the sm_90a forward (`compile::FLASH_FWD_SM90`) serves these lists for `spec`: 128-row query blocks
    /// (its CTA's rows), 128-key blocks (its KV tile) and head dims up to [`WGMMA_MAX_HEAD_DIM`].
    pub fn suits_wgmma(&self, spec: &AttentionSpec) -> bool {
        self.q_block == ForwardTiling::WGMMA.rows()
            && self.kv_block == WGMMA_KV_TILE
            && spec.head_dim.max(spec.head_dim_v) <= WGMMA_MAX_HEAD_DIM
    }

    /// The forward kernel the production wrappers run for these lists on a device of compute capability `device`:
    /// the sm_90a kernel on 9.0 when the lists suit it ([`BlockLists::suits_wgmma`]), `flash_fwd` otherwise.
    pub fn forward_kernel(&self, spec: &AttentionSpec, device: (i32, i32)) -> compile::KernelSource {
        if device == (9, 0) && self.suits_wgmma(spec) { FLASH_FWD_SM90 } else { FLASH_FWD }
    }

    /// The forward tiling of a launch of `flash_fwd`: the production tiling of the head dims when its rows divide
    /// `q_block` (a CTA must read one list), else the 64-row tiling.
    pub fn tiling(&self, spec: &AttentionSpec) -> ForwardTiling {
        let production = ForwardTiling::for_head_dims(spec.head_dim, spec.head_dim_v);
        if self.q_block.is_multiple_of(production.rows()) { production } else { ForwardTiling { warps: 4, slices: 1 } }
    }

    /// The forward tiling a block-sparse launch of `kernel` over these lists runs in: [`BlockLists::tiling`] for
    /// `flash_fwd`, the `wgmma` tiling for the sm_90a forward, which takes only lists that
    /// [`BlockLists::suits_wgmma`].
    fn forward_tiling_of(
        &self,
        spec: &AttentionSpec,
        kernel: compile::KernelSource,
    ) -> Result<ForwardTiling, GpuError> {
        if !is_wgmma(kernel) {
            return Ok(self.tiling(spec));
        }
        if !self.suits_wgmma(spec) {
            return Err(GpuError::Unsupported {
                argument: "lists",
                reason: format!(
                    "the sm_90a forward takes {}-row query blocks, {WGMMA_KV_TILE}-key blocks and head dims up to \
                     {WGMMA_MAX_HEAD_DIM}, not {}, {} and {}, {}",
                    ForwardTiling::WGMMA.rows(),
                    self.q_block,
                    self.kv_block,
                    spec.head_dim,
                    spec.head_dim_v
                ),
            });
        }
        Ok(ForwardTiling::WGMMA)
    }

    /// The module a block-sparse forward of `kernel` over these lists compiles for `spec` with storage type `T`
    /// (what a caller compiles ahead of the launch with [`compile::module`]).
    pub fn forward_variant<T: GpuElement>(
        &self,
        spec: &AttentionSpec,
        kernel: compile::KernelSource,
    ) -> Result<ModuleVariant, GpuError> {
        let mut defines = forward_defines::<T>(spec, self.forward_tiling_of(spec, kernel)?, kernel)?;
        defines.push(BLOCK_SPARSE.to_owned());
        Ok(ModuleVariant { kernel, defines })
    }

    /// Validates the lists for `spec` and returns their entries (row-major, as the kernels read them) with the
    /// kernels' list scalars: what the forward and the backward upload.
    pub(crate) fn checked_entries(&self, spec: &AttentionSpec) -> Result<(Vec<i32>, BlockListParams), GpuError> {
        self.validate(spec)?;
        let params = self.params(spec)?;
        Ok((self.lists.as_standard_layout().iter().copied().collect(), params))
    }

    /// The kernel's list scalars, for validated lists.
    fn params(&self, spec: &AttentionSpec) -> Result<BlockListParams, GpuError> {
        let (_, heads, blocks, width) = self.lists.dim();
        let head_stride = blocks * width;
        to_i32("block list entries", self.lists.len())?;
        Ok(BlockListParams {
            seq_stride: (heads * head_stride) as i64,
            head_stride: head_stride as i64,
            width: to_i32("block list width", width)?,
            q_block: to_i32("q_block", self.q_block)?,
            tiles_per_block: to_i32("kv_block / 64", self.kv_block / KV_TILE)?,
            heads_per_list: match self.heads {
                ListHeads::PerQueryHead => 1,
                ListHeads::PerKvHead => to_i32("n_heads_q / n_heads_kv", spec.group_size())?,
            },
            list_heads: to_i32("list heads", heads)?,
            q_blocks: to_i32("query blocks", blocks)?,
            kv_blocks: to_i32("key blocks", self.key_blocks(spec))?,
            reserved: 0,
        })
    }
}

impl<T: GpuElement> PreparedForward<T> {
    /// A prepared block-sparse forward: validates `spec` and `lists` for `kernel` (a text of `flash_fwd`, run in
    /// [`BlockLists::tiling`], or of the sm_90a forward, which takes only lists that [`BlockLists::suits_wgmma`]),
    /// compiles (or fetches) its `BLOCK_SPARSE` module and uploads the sequence offsets and the lists on `stream`,
    /// once; [`PreparedForward::launch`] then runs it on any buffers of the spec's sizes.
    pub fn block_sparse(
        stream: &Arc<CudaStream>,
        spec: &AttentionSpec,
        lists: &BlockLists,
        kernel: compile::KernelSource,
    ) -> Result<Self, GpuError> {
        let (entries, mut params) = lists.checked_entries(spec)?;
        let tiling = lists.forward_tiling_of(spec, kernel)?;
        if is_wgmma(kernel) {
            params.tiles_per_block = 1;
        }
        PreparedForward::prepare(stream, spec, kernel, tiling, Some((&entries, params)))
    }
}

/// The block-sparse forward on device buffers (layouts as for [`crate::flash_forward_device`]): every `spec` and
/// list check runs before the launch, which is asynchronous on `stream`. The kernel is
/// [`BlockLists::forward_kernel`]'s: the sm_90a `wgmma` forward for 128×128 blocks and head dims up to 128 on compute
/// capability 9.0, `flash_fwd` otherwise.
#[allow(clippy::too_many_arguments)]
pub fn block_sparse_forward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    lists: &BlockLists,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    o: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    let kernel = lists.forward_kernel(spec, compile::compute_capability(stream.context())?);
    block_sparse_forward_device_with(stream, spec, lists, kernel, q, k, v, o, lse)
}

/// [`block_sparse_forward_device`] with an explicit kernel text, run as given: a text of `flash_fwd` or of the sm_90a
/// forward (the tests launch patched copies of both through the same checks).
#[allow(clippy::too_many_arguments)]
pub fn block_sparse_forward_device_with<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    lists: &BlockLists,
    kernel: compile::KernelSource,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    o: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    PreparedForward::<T>::block_sparse(stream, spec, lists, kernel)?.launch(stream, q, k, v, o, lse)
}

/// The block-sparse forward from host tensors, returning host outputs (copies in, launch, copies out, synchronizes).
pub fn block_sparse_forward<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    lists: &BlockLists,
    q: ArrayViewD<'_, T>,
    k: ArrayViewD<'_, T>,
    v: ArrayViewD<'_, T>,
) -> Result<ForwardOutput<T>, GpuError> {
    lists.validate(spec)?;
    forward_from_host(stream, spec, [q, k, v], |[dq, dk, dv], o, lse| {
        block_sparse_forward_device(stream, spec, lists, dq, dk, dv, o, lse)
    })
}

/// Checks one list against E14's convention: an ascending prefix of distinct indices in `0..bound`, then only `−1`
/// pads. The first offending entry comes back as its slot and fault. The block-sparse lists and NSA's selections
/// (one list per token) share it.
pub(crate) fn check_block_list(
    list: impl IntoIterator<Item = i32>,
    bound: usize,
) -> Result<(), (usize, BlockListFault)> {
    let mut previous: Option<i32> = None;
    let mut padded = false;
    for (slot, index) in list.into_iter().enumerate() {
        if index == -1 {
            padded = true;
            continue;
        }
        if padded {
            return Err((slot, BlockListFault::AfterPad { index }));
        }
        if index < 0 || index as usize >= bound {
            return Err((slot, BlockListFault::OutOfRange { index, key_blocks: bound }));
        }
        match previous {
            Some(p) if p == index => return Err((slot, BlockListFault::Duplicate { index })),
            Some(p) if p > index => return Err((slot, BlockListFault::NotAscending { index, previous: p })),
            _ => previous = Some(index),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::{Layout, Mask};

    fn lists_of(heads: ListHeads, shape: (usize, usize, usize, usize), fill: i32) -> BlockLists {
        BlockLists { q_block: 64, kv_block: 64, heads, lists: Array4::from_elem(shape, fill) }
    }

    /// `[1, 2, 3, 3]` lists for a dense 1×2 head problem of 150 queries (3 query blocks) and 150 keys (3 key
    /// blocks), every list `[0, 1, -1]`.
    fn valid() -> (AttentionSpec, BlockLists) {
        let spec = AttentionSpec::dense(1, 2, 1, 150, 150, 64, 64).with_mask(Mask::Causal);
        let mut lists = lists_of(ListHeads::PerQueryHead, (1, 2, 3, 3), -1);
        lists.lists.slice_axis_mut(Axis(3), (0..1).into()).fill(0);
        lists.lists.slice_axis_mut(Axis(3), (1..2).into()).fill(1);
        (spec, lists)
    }

    fn fault_of(spec: &AttentionSpec, lists: &BlockLists) -> ([usize; 4], BlockListFault) {
        match lists.validate(spec) {
            Err(GpuError::BlockList { position, fault }) => (position, fault),
            other => panic!("expected a block list error, got {other:?}"),
        }
    }

    #[test]
    fn valid_lists_pass_and_every_fault_is_named_with_its_entry() {
        let (spec, lists) = valid();
        assert_eq!(lists.validate(&spec), Ok(()));
        let with = |at: [usize; 4], x: i32| {
            let mut l = lists.clone();
            l.lists[at] = x;
            l
        };
        assert_eq!(
            fault_of(&spec, &with([0, 1, 2, 1], 3)),
            ([0, 1, 2, 1], BlockListFault::OutOfRange { index: 3, key_blocks: 3 })
        );
        assert_eq!(
            fault_of(&spec, &with([0, 0, 1, 0], -2)),
            ([0, 0, 1, 0], BlockListFault::OutOfRange { index: -2, key_blocks: 3 })
        );
        assert_eq!(fault_of(&spec, &with([0, 0, 0, 1], 0)), ([0, 0, 0, 1], BlockListFault::Duplicate { index: 0 }));
        let mut unsorted = lists.clone();
        unsorted.lists[[0, 1, 0, 0]] = 2;
        assert_eq!(fault_of(&spec, &unsorted), ([0, 1, 0, 1], BlockListFault::NotAscending { index: 1, previous: 2 }));
        let mut after_pad = lists.clone();
        after_pad.lists[[0, 0, 2, 0]] = -1;
        assert_eq!(fault_of(&spec, &after_pad), ([0, 0, 2, 1], BlockListFault::AfterPad { index: 1 }));
        let wide = lists_of(ListHeads::PerQueryHead, (1, 2, 3, 4), -1);
        assert_eq!(fault_of(&spec, &wide), ([0, 0, 0, 4], BlockListFault::TooWide { width: 4, key_blocks: 3 }));
        // The last slot of the last list is checked too.
        let mut full = lists.clone();
        full.lists[[0, 1, 2, 2]] = 2;
        assert_eq!(full.validate(&spec), Ok(()));
        full.lists[[0, 1, 2, 2]] = 1;
        assert_eq!(fault_of(&spec, &full), ([0, 1, 2, 2], BlockListFault::Duplicate { index: 1 }));
    }

    #[test]
    fn block_sizes_and_shapes_are_checked() {
        let (spec, lists) = valid();
        for (q_block, kv_block, bad) in [(32, 64, "q_block"), (64, 256, "kv_block"), (0, 64, "q_block")] {
            let l = BlockLists { q_block, kv_block, ..lists.clone() };
            assert!(matches!(l.validate(&spec), Err(GpuError::Unsupported { argument, .. }) if argument == bad));
        }
        // Lists per KV head have Hkv = 1 head; lists per query head given for them are the wrong shape.
        let per_kv = BlockLists { heads: ListHeads::PerKvHead, ..lists.clone() };
        assert!(matches!(per_kv.validate(&spec), Err(GpuError::Shape { argument: "lists", .. })));
        // A key block size that does not match the lists: 128-key blocks make 2 key blocks, so index 2 is out.
        let mut wider_blocks = BlockLists { kv_block: 128, ..lists.clone() };
        wider_blocks.lists = wider_blocks.lists.slice_axis(Axis(3), (0..2).into()).to_owned();
        assert_eq!(wider_blocks.validate(&spec), Ok(()));
        wider_blocks.lists[[0, 0, 0, 1]] = 2;
        assert!(matches!(fault_of(&spec, &wider_blocks).1, BlockListFault::OutOfRange { index: 2, key_blocks: 2 }));
        // 128-row query blocks: 2 query blocks, so 3 is the wrong shape.
        let q128 = BlockLists { q_block: 128, ..lists.clone() };
        assert!(matches!(q128.validate(&spec), Err(GpuError::Shape { argument: "lists", .. })));
        let bad_spec = AttentionSpec::dense(1, 3, 2, 4, 4, 8, 8);
        assert!(matches!(lists.validate(&bad_spec), Err(GpuError::Spec(_))));
    }

    #[test]
    fn query_blocks_past_a_sequence_list_nothing() {
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 130, 150], cu_seqlens_k: vec![0, 64, 200] },
            ..AttentionSpec::dense(1, 1, 1, 1, 1, 64, 64)
        };
        let mut lists = lists_of(ListHeads::PerKvHead, (2, 1, 3, 1), -1);
        lists.lists[[1, 0, 0, 0]] = 2;
        assert_eq!(lists.validate(&spec), Ok(()));
        // Sequence 1 has one query block: its second may list nothing, not even block 0.
        lists.lists[[1, 0, 1, 0]] = 0;
        assert_eq!(fault_of(&spec, &lists), ([1, 0, 1, 0], BlockListFault::OutOfRange { index: 0, key_blocks: 0 }));
    }

    #[test]
    fn kv_head_lists_expand_over_the_group_and_params_follow_the_shape() {
        let spec = AttentionSpec::dense(2, 6, 2, 130, 200, 64, 64);
        let mut lists = BlockLists {
            q_block: 128,
            kv_block: 128,
            heads: ListHeads::PerKvHead,
            lists: Array4::from_elem((2, 2, 2, 2), -1),
        };
        lists.lists[[1, 1, 0, 0]] = 1;
        assert_eq!(lists.validate(&spec), Ok(()));
        let layout = lists.oracle_layout(&spec);
        assert_eq!(layout.lists.dim(), (2, 6, 2, 2));
        for h in 0..6 {
            assert_eq!(layout.lists[[1, h, 0, 0]], if h >= 3 { 1 } else { -1 }, "head {h}");
        }
        assert_eq!(layout.validate(&spec), Ok(()));
        let p = lists.params(&spec).unwrap();
        assert_eq!(
            p,
            BlockListParams {
                seq_stride: 8,
                head_stride: 4,
                width: 2,
                q_block: 128,
                tiles_per_block: 2,
                heads_per_list: 3,
                list_heads: 2,
                q_blocks: 2,
                kv_blocks: 2,
                reserved: 0,
            }
        );
        let per_query = BlockLists { heads: ListHeads::PerQueryHead, lists: layout.lists, ..lists };
        assert_eq!(per_query.params(&spec).unwrap().heads_per_list, 1);
    }

    /// The wrappers run the sm_90a forward only on 9.0 and only for 128×128 blocks with head dims up to 128; every
    /// other device, block size or head dim takes `flash_fwd`.
    #[test]
    fn the_wgmma_forward_is_chosen_for_its_blocks_head_dims_and_device_only() {
        let spec = |d, dv| AttentionSpec::dense(1, 1, 1, 300, 300, d, dv);
        let lists =
            |q_block, kv_block| BlockLists { q_block, kv_block, ..lists_of(ListHeads::PerQueryHead, (1, 1, 3, 3), -1) };
        assert_eq!(lists(128, 128).forward_kernel(&spec(128, 128), (9, 0)), FLASH_FWD_SM90);
        assert_eq!(lists(128, 128).forward_kernel(&spec(8, 64), (9, 0)), FLASH_FWD_SM90);
        for device in [(8, 0), (8, 9), (10, 0), (12, 0)] {
            assert_eq!(lists(128, 128).forward_kernel(&spec(128, 128), device), FLASH_FWD, "{device:?}");
        }
        for (q_block, kv_block) in [(64, 128), (128, 64), (64, 64)] {
            assert!(!lists(q_block, kv_block).suits_wgmma(&spec(64, 64)), "{q_block}×{kv_block}");
            assert_eq!(lists(q_block, kv_block).forward_kernel(&spec(64, 64), (9, 0)), FLASH_FWD);
        }
        for (d, dv) in [(136, 128), (128, 136), (256, 256)] {
            assert!(!lists(128, 128).suits_wgmma(&spec(d, dv)), "d = {d}, dv = {dv}");
        }
    }

    #[test]
    fn the_tiling_keeps_a_cta_inside_one_query_block() {
        let spec = |d| AttentionSpec::dense(1, 1, 1, 4, 4, d, d);
        let lists = |q_block| BlockLists { q_block, ..lists_of(ListHeads::PerQueryHead, (1, 1, 1, 1), -1) };
        for (d, q_block) in [(64, 64), (64, 128), (256, 64), (256, 128), (128, 128)] {
            let tiling = lists(q_block).tiling(&spec(d));
            assert!(q_block.is_multiple_of(tiling.rows()) && tiling.supports(d, d), "d = {d}, q_block = {q_block}");
        }
        assert_eq!(lists(128).tiling(&spec(64)), ForwardTiling::for_head_dims(64, 64));
    }
}
