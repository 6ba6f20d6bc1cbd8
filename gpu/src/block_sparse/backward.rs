//! The block-sparse backward on the GPU (the gradients of E14): the dense backward kernels of `gpu/kernels/flash_bwd.cu`
//! compiled with `BLOCK_SPARSE`, over the forward's key-block lists and their CSR transpose, built on the device.
//!
//! # What runs
//!
//! 1. The transpose (`bwd_csr_count`, `bwd_csr_scan`, `bwd_csr_fill`): one CSR row per (sequence, list head, key
//!    block) holding the query blocks whose list names the key block, ascending — the layout of E20 (the oracle's
//!    `nsa::transpose_selection`, which the tests compare it with exactly) and of seed 001's CSR backward. A warp per
//!    row tests 32 query blocks at a time by binary search in their lists and keeps their order with a ballot: no
//!    atomics, so the transpose is the same every run. [`block_csr`] downloads it.
//! 2. `bwd_preprocess` as in the dense backward (`D` does not depend on the lists).
//! 3. `bwd_kv`, the KV owner (the design of cuDNN-frontend's and FlashAttention's block-sparse backward): one CTA per
//!    KV tile walks its key block's CSR row, as query tiles, instead of every query tile that can see it. The causal
//!    mask, windows and tails still apply inside the visited tiles, so every visited element's arithmetic is the
//!    dense kernel's, and an unvisited one contributes what the oracle gives it: nothing.
//! 4. dQ by [`GpuBackwardStrategy`]: `bwd_dq` (two traversals: one CTA per query tile walks its query block's list
//!    again, deterministic), the KV owner's atomic f32 accumulator, or its per-KV-tile partials summed in ascending KV
//!    tile order over the query block's listed tiles (bitwise deterministic). Each partial is stored at its KV tile's
//!    position in the query block's list, so the f32 workspace holds `kv_block / KV_TILE` copies of Q's size per
//!    entry of the longest list (9 for top-8 lists plus the diagonal at 128×128 blocks), not the dense mode's
//!    `⌈max Lk / KV_TILE⌉` (1024 at 128K keys).
//!
//! The rounding-error model is the dense backward's (`crate::backward`) under the lists' visibility: each visited
//! tile pair does the dense kernels' arithmetic, and a row's sums over visited tiles take no more instructions and
//! additions than over all tiles. Lists per query head work under GQA too: each query head's dK, dV sums use its own
//! lists before `bwd_kv_group_sum` adds the group in ascending head order.
//!
//! A KV tile must lie in one key block: 64-key blocks take the four-warp tiling (KV tiles of 64 keys), 128-key blocks
//! the default (128); [`BlockLists::backward_tiling`] chooses, and [`block_sparse_backward_device_with`] refuses a
//! tiling whose tiles straddle blocks with a typed error.
//!
//! On compute capability 9.0 the production wrapper runs the KV owner on Hopper's warpgroup MMA
//! ([`compile::FLASH_BWD_SM90`], `gpu/kernels/flash_bwd_sm90.cu`) where the lists and head dims suit it
//! ([`BlockLists::suits_wgmma_backward`]: key blocks of 128 keys, head dims up to 128): the same walk, masks, recipe
//! and outputs, its products on `wgmma`; the transpose, `D`, the GQA sum and the dQ kernels are `flash_bwd.cu`'s in
//! the same module. [`BlockLists::backward_kernel`] chooses.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use cudarc::driver::CudaStream;
use half::bf16;
use ndarray::ArrayViewD;

use super::BlockLists;
use crate::backward::{
    BackwardDeviceInputs, BackwardDeviceOutputs, BackwardOutput, BackwardTiling, GpuBackwardStrategy, SparseLists,
    backward_from_host, backward_variant, launch_backward, sparse_csr,
};
use crate::common::GpuElement;
use crate::compile::{self, FLASH_BWD, ModuleVariant};
use crate::error::GpuError;

impl BlockLists {
    /// The backward tiling of these lists: KV tiles as large as the key blocks allow (128 keys for 128-key blocks,
    /// 64 for 64-key blocks).
    pub fn backward_tiling(&self) -> BackwardTiling {
        if self.kv_block.is_multiple_of(BackwardTiling::DEFAULT.kv_tile()) {
            BackwardTiling::DEFAULT
        } else {
            BackwardTiling { kv_warps: 4 }
        }
    }

    /// Whether the backward with the `wgmma` KV owner ([`compile::FLASH_BWD_SM90`]) serves these lists for `spec`: key
    /// blocks of whole 128-key tiles (its KV tile) and head dims up to 128, in [`BlockLists::backward_tiling`].
    pub fn suits_wgmma_backward(&self, spec: &AttentionSpec) -> bool {
        crate::backward::wgmma_backward_supports(spec, self.backward_tiling())
    }

    /// The backward kernel the production wrappers run for these lists on a device of compute capability `device`:
    /// the `wgmma` KV owner on 9.0 when the lists suit it ([`BlockLists::suits_wgmma_backward`]), `flash_bwd`
    /// otherwise.
    pub fn backward_kernel(&self, spec: &AttentionSpec, device: (i32, i32)) -> compile::KernelSource {
        crate::backward::production_backward_kernel(spec, self.backward_tiling(), device)
    }

    /// The module of `kernel` (a text of `flash_bwd.cu`) whose transpose kernels build these lists' CSR for
    /// `spec`. They read no attention operand, so one variant (the bf16 one) serves both storage types.
    pub fn csr_variant(&self, spec: &AttentionSpec, kernel: compile::KernelSource) -> Result<ModuleVariant, GpuError> {
        self.backward_variant::<bf16>(spec, kernel)
    }

    /// The module a block-sparse backward of `kernel` (a text of `flash_bwd.cu`) over these lists compiles for
    /// `spec` with storage type `T`, in [`BlockLists::backward_tiling`] (what a caller compiles ahead of the launch with [`compile::module`]).
    pub fn backward_variant<T: GpuElement>(
        &self,
        spec: &AttentionSpec,
        kernel: compile::KernelSource,
    ) -> Result<ModuleVariant, GpuError> {
        let mut variant = backward_variant::<T>(spec, self.backward_tiling(), kernel)?;
        variant.defines.push(crate::backward::BLOCK_SPARSE.to_owned());
        Ok(variant)
    }
}

/// The block-sparse backward on device buffers (layouts as for [`crate::flash_backward_device`]), in the lists'
/// [`BlockLists::backward_tiling`] with [`BlockLists::backward_kernel`]'s kernel: every `spec` and list check runs
/// before the first launch, which is asynchronous on `stream`. `inputs.o` and `inputs.lse` are the block-sparse
/// forward's outputs over the same lists.
pub fn block_sparse_backward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    lists: &BlockLists,
    inputs: BackwardDeviceInputs<'_, T>,
    outputs: BackwardDeviceOutputs<'_, T>,
    strategy: GpuBackwardStrategy,
) -> Result<(), GpuError> {
    let kernel = lists.backward_kernel(spec, compile::compute_capability(stream.context())?);
    block_sparse_backward_device_with(stream, spec, lists, kernel, lists.backward_tiling(), inputs, outputs, strategy)
}

/// [`block_sparse_backward_device`] with an explicit kernel text, run as given (the tests launch patched copies of
/// `flash_bwd.cu` and of the `wgmma` backward) and tiling (whose KV tiles must not straddle key blocks).
#[allow(clippy::too_many_arguments)]
pub fn block_sparse_backward_device_with<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    lists: &BlockLists,
    kernel: compile::KernelSource,
    tiling: BackwardTiling,
    inputs: BackwardDeviceInputs<'_, T>,
    outputs: BackwardDeviceOutputs<'_, T>,
    strategy: GpuBackwardStrategy,
) -> Result<(), GpuError> {
    let (entries, params) = lists.checked_entries(spec)?;
    let sparse = SparseLists { entries: &entries, params };
    launch_backward(stream, spec, kernel, tiling, inputs, outputs, strategy, Some(sparse))
}

/// The block-sparse backward from host tensors, returning host outputs (copies in, launches, copies out,
/// synchronizes). `lse` may hold −∞ (rows that see no key, among them every row of a query block that lists
/// nothing) but no NaN or +∞; the other inputs must be finite.
#[allow(clippy::too_many_arguments)]
pub fn block_sparse_backward<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    lists: &BlockLists,
    q: ArrayViewD<'_, T>,
    k: ArrayViewD<'_, T>,
    v: ArrayViewD<'_, T>,
    o: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
    d_out: ArrayViewD<'_, T>,
    strategy: GpuBackwardStrategy,
) -> Result<BackwardOutput<T>, GpuError> {
    lists.validate(spec)?;
    backward_from_host(stream, spec, [q, k, v, o, d_out], lse, |inputs, outputs| {
        block_sparse_backward_device(stream, spec, lists, inputs, outputs, strategy)
    })
}

/// The CSR transpose the backward builds on the device, downloaded: row `r = (sequence · list heads + list head) ·
/// key blocks + key block` holds `q_blocks[offsets[r]..offsets[r + 1]]`, the query blocks that list the key block,
/// ascending ([`BlockLists::key_blocks`] rows per list head, for the longest sequence).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockCsr {
    /// `rows + 1` offsets, from 0 to `q_blocks.len()`.
    pub offsets: Vec<i32>,
    /// Every row's query blocks, row after row.
    pub q_blocks: Vec<i32>,
}

/// Builds the CSR transpose of `lists` for `spec` on the device, as the backward does, and downloads it.
pub fn block_csr(stream: &Arc<CudaStream>, spec: &AttentionSpec, lists: &BlockLists) -> Result<BlockCsr, GpuError> {
    block_csr_with(stream, spec, lists, FLASH_BWD)
}

/// [`block_csr`] with the transpose kernels of an explicit text of `flash_bwd.cu` (the tests check patched copies).
pub fn block_csr_with(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    lists: &BlockLists,
    kernel: compile::KernelSource,
) -> Result<BlockCsr, GpuError> {
    let (entries, params) = lists.checked_entries(spec)?;
    let sparse = SparseLists { entries: &entries, params };
    let variant = lists.csr_variant(spec, kernel)?;
    let module = compile::module(stream.context(), variant.kernel, &variant.defines)?;
    let csr = sparse_csr(stream, &module, &sparse, spec.sequences().len())?;
    let down_err = |e| GpuError::driver("cuMemcpyDtoH(block CSR)", e);
    let offsets = stream.clone_dtoh(&csr.offsets).map_err(down_err)?;
    let mut q_blocks = stream.clone_dtoh(&csr.q_blocks).map_err(down_err)?;
    stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
    q_blocks.truncate(*offsets.last().unwrap_or(&0) as usize);
    Ok(BlockCsr { offsets, q_blocks })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_sparse::ListHeads;
    use crate::compile::FLASH_BWD_SM90;
    use ndarray::Array4;

    #[test]
    fn kv_tiles_never_straddle_key_blocks() {
        let lists = |kv_block| BlockLists {
            q_block: 64,
            kv_block,
            heads: ListHeads::PerQueryHead,
            lists: Array4::from_elem((1, 1, 1, 1), -1),
        };
        for kv_block in crate::block_sparse::BLOCK_SIZES {
            let tiling = lists(kv_block).backward_tiling();
            assert!(kv_block.is_multiple_of(tiling.kv_tile()), "kv_block {kv_block}: {tiling:?}");
        }
        assert_eq!(lists(128).backward_tiling(), BackwardTiling::DEFAULT);
        assert_eq!(lists(64).backward_tiling(), BackwardTiling { kv_warps: 4 });
    }

    #[test]
    fn the_wgmma_backward_is_chosen_for_128_key_blocks_head_dims_up_to_128_and_hopper_only() {
        let lists = |q_block, kv_block| BlockLists {
            q_block,
            kv_block,
            heads: ListHeads::PerQueryHead,
            lists: Array4::from_elem((1, 1, 1, 1), -1),
        };
        let spec = |d, dv| AttentionSpec::dense(1, 1, 1, 256, 256, d, dv);
        for q_block in crate::block_sparse::BLOCK_SIZES {
            assert_eq!(lists(q_block, 128).backward_kernel(&spec(128, 128), (9, 0)), FLASH_BWD_SM90);
            assert_eq!(lists(q_block, 128).backward_kernel(&spec(8, 64), (9, 0)), FLASH_BWD_SM90);
            assert_eq!(lists(q_block, 64).backward_kernel(&spec(64, 64), (9, 0)), FLASH_BWD);
            assert_eq!(lists(q_block, 128).backward_kernel(&spec(136, 64), (9, 0)), FLASH_BWD);
            for device in [(8, 0), (10, 0), (12, 0)] {
                assert_eq!(lists(q_block, 128).backward_kernel(&spec(64, 64), device), FLASH_BWD);
            }
        }
    }
}
