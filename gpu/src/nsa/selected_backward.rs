//! NSA's selected-block attention backward (the gradients of E18's selection branch through E20's transpose, E31's
//! shared block tile) on the GPU: `gpu/kernels/nsa_selected_bwd.cu` behind typed wrappers, from device buffers
//! ([`selected_backward_device`]) or host tensors ([`selected_backward`]).
//!
//! The selection is held fixed (top-n has no gradient), so the branch's backward is the dense backward of the
//! visibility `causal ∧ block(key) listed for (token, KV head)`: dQ, dK, dV and `D` of the oracle's
//! `nsa_backward::nsa_backward` restricted to the selected branch.
//!
//! # Schedule, and why the dense bound holds
//!
//! The lists are transposed on the device (E20: per (sequence, KV head, block), the tokens that list the block and do
//! not precede it, ascending; a count, `flash_bwd.cu`'s scan and a ballot fill, no atomics in the result). A KV owner
//! per (segment of a block's tokens, 64-key tile of the block, KV head) walks the segment in tiles of `⌊64/G⌋` tokens ×
//! all `G` heads, so it holds every row of the segment that sees its keys and sums dK and dV over the group; a block of
//! one segment (most of them: [`SEGMENT_TILES`] tiles each) writes them at once, a longer one (NSA's forced first block)
//! adds its segments' f32 sums in ascending order afterwards (bitwise reproducible either way); each row's dQ of the tile is
//! added to an f32 accumulator ([`GpuBackwardStrategy::KvOwnerAtomic`]) or stored as the row's partial for this
//! (list slot, tile) and summed in list order ([`GpuBackwardStrategy::KvOwnerDeterministic`], bitwise reproducible).
//! Every element is formed as `flash_bwd.cu` forms it; the sums of dK and dV run over at most `⌈G·T/⌊64/G⌋G⌉` query
//! tiles of at most 64 rows — the dense model's chain for one head of `G·T` query rows in tiles of [`Q_TILE`] —
//! and a row's dQ over its visited 64-key tiles, so the bound is the dense backward's recipe with KV tiles of
//! `min(l', 64)` keys applied to the group's rows stacked as one head (the harness builds that case).
//!
//! # Errors
//!
//! Before any launch: the configuration, the layer and the group (as the forward, [`super::selected`]), the strategy
//! ([`GpuBackwardStrategy::TwoTraversals`] is not implemented for NSA: [`GpuError::Unsupported`]), and every buffer's
//! length; from host tensors also every list ([`super::selected::validate_lists`]). Lists on the device are read
//! with the forward's rule (a list ends at its first entry that does not rise or lies past its sequence's blocks), by
//! the count and the fill alike, so no list can make a kernel write outside the transpose it sized.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::nsa::NsaConfig;
use attnproof_oracle::spec::Operand;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::{ArrayView3, ArrayViewD};

use super::select::lists_shape;
use super::selected::{KV_TILE, plan, validate_lists};
use crate::backward::{
    BackwardDeviceInputs, BackwardDeviceOutputs, BackwardOutput, BackwardTiling, GpuBackwardStrategy, Q_TILE,
    backward_from_host, check_backward_buffers, kv_owner_shape, load_kernel,
};
use crate::common::{GpuElement, check_len, grid_3d, to_i32};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::launch::{self, BackwardBuffers, BackwardKernel, NsaSelectedBwdBuffers, NsaSelectedBwdScalars};
use crate::params::BackwardParams;

/// The f32 workspaces a kernel of `flash_bwd.cu` takes: the atomic dQ accumulator, the dQ partials and the GQA sums
/// (a placeholder here: the selected backward sums the group itself).
type FlashWorkspaces<'a> = (&'a mut CudaSlice<f32>, &'a mut CudaSlice<f32>, &'a mut CudaSlice<f32>);

/// `gpu/kernels/nsa_selected_bwd.cu` after the shared helpers and `flash_bwd.cu`, whose helpers, preprocess, scan and
/// atomic finalize it calls.
pub const NSA_SELECTED_BWD: KernelSource = KernelSource {
    name: "nsa_selected_bwd",
    source: concat!(
        include_str!("../../kernels/common.cuh"),
        include_str!("../../kernels/flash_bwd.cu"),
        include_str!("../../kernels/nsa_selected_bwd.cu")
    ),
};

/// The KV owner's tiling: four warps over 64 keys (a 64-token block is one tile).
pub const TILING: BackwardTiling = BackwardTiling { kv_warps: 4 };

/// The most row tiles one KV-owner CTA walks: a block's CSR row is split into segments of `512·⌊64/G⌋` tokens.
/// NSA's forced first block is listed by every token, so its row holds `T` tokens against about `n·l'` for the others:
/// walked by one CTA (per KV head), it alone took most of the backward's time at `T` = 64K.
pub const SEGMENT_TILES: usize = 512;

/// How many row tiles of a block's CSR row one KV-owner CTA walks ([`SEGMENT_TILES`] by default). Every split gives
/// the same dK and dV up to the order of the segments' sums (a summation tree no deeper than the one chain's, so the
/// bound is the same) and the same dQ; the tests draw short segments so that the split path runs at small sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackwardSegments {
    /// Row tiles per segment, at least 1.
    pub tiles: usize,
}

impl BackwardSegments {
    /// The production split.
    pub const DEFAULT: BackwardSegments = BackwardSegments { tiles: SEGMENT_TILES };

    /// Tokens per segment for a GQA group of `group`: `tiles · ⌊64/G⌋`.
    pub fn tokens(self, group: usize) -> usize {
        self.tiles * (64 / group.max(1)).max(1)
    }

    /// The most segments the CSR rows of one (sequence, KV head) can have: one per block at least, one more per
    /// [`BackwardSegments::tokens`] of the at most `len · n` listed (token, block) pairs.
    pub fn most(self, n_blocks: usize, max_len: usize, n_selected: usize, group: usize) -> usize {
        n_blocks + (max_len * n_selected).div_ceil(self.tokens(group))
    }
}

/// dQ partials per row in the deterministic mode: one per (list slot, 64-key tile of the block).
pub fn dq_slots(config: &NsaConfig) -> usize {
    config.n_selected * config.select_block.div_ceil(KV_TILE)
}

/// The selected branch's backward on device buffers (asynchronously on `stream`): from the layer's Q, K, V, the
/// branch forward's O and LSE ([`super::selected::selected_device`]), the upstream gradient `dO` of the branch and the
/// lists `[token rows, Hkv, n]` (not validated: see the module docs), writes dQ, dK, dV and `D` into the first
/// elements of `outputs`. `kernel` is [`NSA_SELECTED_BWD`] or a patched copy of it (the tests' mutants). The f32
/// workspaces and the transpose are allocated here.
#[allow(clippy::too_many_arguments)]
pub fn selected_backward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernel: KernelSource,
    inputs: BackwardDeviceInputs<'_, T>,
    lists: &CudaSlice<i32>,
    outputs: BackwardDeviceOutputs<'_, T>,
    strategy: GpuBackwardStrategy,
) -> Result<(), GpuError> {
    let segments = BackwardSegments::DEFAULT;
    selected_backward_device_with(stream, spec, config, (kernel, segments), inputs, lists, outputs, strategy)
}

/// [`selected_backward_device`] with an explicit split of the CSR rows; no segment is a typed error before any
/// launch.
#[allow(clippy::too_many_arguments)]
pub fn selected_backward_device_with<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    (kernel, segments): (KernelSource, BackwardSegments),
    inputs: BackwardDeviceInputs<'_, T>,
    lists: &CudaSlice<i32>,
    outputs: BackwardDeviceOutputs<'_, T>,
    strategy: GpuBackwardStrategy,
) -> Result<(), GpuError> {
    let plan = plan(spec, config, None)?;
    if segments.tiles == 0 {
        return Err(GpuError::Unsupported { argument: "segments", reason: "segments of no row tile".to_owned() });
    }
    let dq_mode = match strategy {
        GpuBackwardStrategy::KvOwnerAtomic => 1,
        GpuBackwardStrategy::KvOwnerDeterministic => 2,
        GpuBackwardStrategy::TwoTraversals => {
            return Err(GpuError::Unsupported {
                argument: "strategy",
                reason: "NSA's selected backward has a KV owner only (atomic or deterministic dQ)".to_owned(),
            });
        }
    };
    let shape = kv_owner_shape::<T>(&plan.spec, TILING)?;
    let size = |op: Operand| plan.spec.expected_shape(op).iter().product::<usize>();
    check_backward_buffers(&plan.spec, &inputs, &outputs)?;
    let list_entries: usize = lists_shape(&plan.spec, config).iter().product();
    check_len("lists", lists, list_entries)?;
    if plan.max_len == 0 || plan.batch == 0 || spec.n_heads_kv == 0 {
        return Ok(());
    }
    let (hq, hkv) = (spec.n_heads_q, spec.n_heads_kv);
    let q_elements = size(Operand::Q);
    let slots = if dq_mode == 2 { dq_slots(config) } else { 0 };
    let partials = q_elements.checked_mul(slots).ok_or(GpuError::TooLarge { argument: "dQ partials", value: slots })?;
    let n_blocks = plan.params.n_blocks as usize;
    let csr_rows = plan.batch * hkv * n_blocks;
    let tiles_per_block = config.select_block.div_ceil(KV_TILE);

    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &shape.defines)?;
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e));
    let (cu_q, cu_k) = (up(&plan.cu_q)?, up(&plan.cu_k)?);
    let accumulator = if dq_mode == 1 { q_elements } else { 0 };
    let mut dq_acc = stream.alloc_zeros::<f32>(accumulator.max(1)).map_err(alloc_err)?;
    let mut dq_part = stream.alloc_zeros::<f32>(partials.max(1)).map_err(alloc_err)?;
    let mut unused = stream.alloc_zeros::<f32>(1).map_err(alloc_err)?;
    let group = spec.group_size();
    let seg_tokens = segments.tokens(group);
    let work = segments.most(n_blocks, plan.max_len, config.n_selected, group);
    let dkv_slots = plan.batch * hkv * work * tiles_per_block;
    let dkv_len = dkv_slots.checked_mul(KV_TILE * (spec.head_dim + spec.head_dim_v));
    let dkv_len = dkv_len.ok_or(GpuError::TooLarge { argument: "dK/dV segment sums", value: dkv_slots })?;
    let mut dkv_part = stream.alloc_zeros::<f32>(dkv_len.max(1)).map_err(alloc_err)?;
    let mut seg_offsets = stream.alloc_zeros::<i32>(csr_rows + 1).map_err(alloc_err)?;
    let cfg = |grid: (u32, u32, u32), threads: u32, shared: u32| LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared,
    };
    let base = BackwardParams {
        flash: plan.params.flash,
        part_stride: q_elements as i64,
        n_heads_q: to_i32("n_heads_q", hq)?,
        ..BackwardParams::default()
    };
    let q_tiles =
        grid_3d(("query tiles", plan.max_len.div_ceil(Q_TILE)), ("n_heads_q", hq), ("sequences", plan.batch))?;
    let BackwardDeviceOutputs { dq, dk, dv, delta } = outputs;

    // D = rowsum(dO ∘ O): flash_bwd.cu's preprocess.
    let workspaces = (&mut dq_acc, &mut dq_part, &mut unused);
    let flash_kernel =
        |which: BackwardKernel, outputs: BackwardDeviceOutputs<'_, T>, workspaces: FlashWorkspaces<'_>| {
            let f = load_kernel(ctx, &module, which.name(), 0)?;
            let BackwardDeviceOutputs { dq, dk, dv, delta } = outputs;
            let (dq_acc, dq_part, dkv_part) = workspaces;
            let mut buffers = BackwardBuffers {
                q: inputs.q,
                k: inputs.k,
                v: inputs.v,
                o: inputs.o,
                lse: inputs.lse,
                d_out: inputs.d_out,
                dq,
                dk,
                dv,
                delta,
                dq_acc,
                dq_part,
                dkv_part,
                cu_q: &cu_q,
                cu_k: &cu_k,
                sparse: None,
            };
            launch::launch_flash_backward(stream, &f, cfg(q_tiles, 128, 0), which, &mut buffers, &base)
        };
    let outputs = BackwardDeviceOutputs { dq: &mut *dq, dk: &mut *dk, dv: &mut *dv, delta: &mut *delta };
    flash_kernel(BackwardKernel::Preprocess, outputs, (&mut *workspaces.0, &mut *workspaces.1, &mut *workspaces.2))?;

    // E20's transpose: count, scan, fill.
    let heads_seqs = |x: usize, what| grid_3d((what, x), ("n_heads_kv", hkv), ("sequences", plan.batch));
    let BlockTokensDevice { offsets, tokens } = build_transpose(stream, &module, &plan, (lists, list_entries), &cu_q)?;
    let scan = load_kernel(ctx, &module, "bwd_csr_scan", 0)?;

    // The rows' segments.
    let segments = load_kernel(ctx, &module, "nsa_csr_segments", 0)?;
    let seg_grid = heads_seqs(n_blocks.div_ceil(128), "selection blocks")?;
    let seg_tokens_i32 = to_i32("segment tokens", seg_tokens)?;
    let seg_bufs = (&offsets, &mut seg_offsets);
    launch::launch_nsa_csr_segments(
        stream,
        &segments,
        cfg(seg_grid, 128, 0),
        seg_bufs,
        &cu_q,
        &plan.params,
        seg_tokens_i32,
    )?;
    launch::launch_csr_scan(stream, &scan, cfg((1, 1, 1), 1024, 0), &mut seg_offsets, to_i32("CSR rows", csr_rows)?)?;

    // The KV owner.
    let kv_owner = load_kernel(ctx, &module, "nsa_selected_bwd_kv", shape.shared_bytes)?;
    let kv_grid = grid_3d(
        ("KV segments", work * tiles_per_block),
        ("n_heads_kv x column chunks", hkv * shape.chunks as usize),
        ("sequences", plan.batch),
    )?;
    launch::launch_nsa_selected_bwd_kv(
        stream,
        &kv_owner,
        cfg(kv_grid, TILING.kv_warps * 32, shape.shared_bytes),
        NsaSelectedBwdBuffers {
            q: inputs.q,
            k: inputs.k,
            v: inputs.v,
            d_out: inputs.d_out,
            lse: inputs.lse,
            delta: &*delta,
            dk: &mut *dk,
            dv: &mut *dv,
            dq_acc: &mut *workspaces.0,
            dq_part: &mut *workspaces.1,
            dkv_part: &mut dkv_part,
            lists,
            csr_offsets: &offsets,
            csr_tokens: &tokens,
            seg_offsets: &seg_offsets,
            cu_q: &cu_q,
            cu_k: &cu_k,
        },
        &plan.params,
        NsaSelectedBwdScalars {
            part_stride: q_elements as i64,
            dq_mode,
            n_chunks: shape.chunks as i32,
            seg_tokens: seg_tokens_i32,
            dkv_slots: dkv_slots as i64,
        },
    )?;
    let dkv_finalize = load_kernel(ctx, &module, "nsa_dkv_finalize", 0)?;
    let tiles_grid = heads_seqs(n_blocks * tiles_per_block, "KV tiles")?;
    launch::launch_nsa_dkv_finalize(
        stream,
        &dkv_finalize,
        cfg(tiles_grid, 128, 0),
        (&dkv_part, &mut *dk, &mut *dv),
        (&seg_offsets, &cu_q),
        &plan.params,
        dkv_slots as i64,
    )?;

    // dQ = round_T(α̂ · Σ).
    if dq_mode == 1 {
        let outputs = BackwardDeviceOutputs { dq: &mut *dq, dk: &mut *dk, dv: &mut *dv, delta: &mut *delta };
        flash_kernel(BackwardKernel::Finalize, outputs, workspaces)?;
    } else {
        let f = load_kernel(ctx, &module, "nsa_dq_finalize_partials", 0)?;
        let grid = grid_3d(
            ("dQ column pairs", (plan.max_len * spec.head_dim / 2).div_ceil(128)),
            ("n_heads_q", hq),
            ("sequences", plan.batch),
        )?;
        launch::launch_nsa_dq_finalize_partials(
            stream,
            &f,
            cfg(grid, 128, 0),
            (&*workspaces.1, &mut *dq),
            &cu_q,
            &plan.params,
            (q_elements as i64, to_i32("dQ slots", slots)?),
        )?;
    }
    Ok(())
}

/// E20's transpose of NSA lists as the backward builds it on the device: per CSR row (sequence, KV head, block of the
/// longest sequence, in that order: row `(seq·Hkv + kv)·n_blocks + block`), the sequence's tokens that list the block
/// and do not precede it, ascending (sequence-local positions). `offsets` has one entry per row and one more, from 0;
/// `tokens` holds at least `offsets[rows]` entries.
#[derive(Debug)]
pub struct BlockTokensDevice {
    /// `[rows + 1]`, non-decreasing from 0.
    pub offsets: CudaSlice<i32>,
    /// The rows' tokens, row after row.
    pub tokens: CudaSlice<i32>,
}

/// The transpose alone (what the backward's KV owner walks), so that a test can hold it to the oracle's
/// `transpose_selection` entry for entry: the lists `[token rows, Hkv, n]` on the device are read with the forward's
/// rule (module docs). `kernel` is [`NSA_SELECTED_BWD`] or a patched copy. Checks as in [`selected_backward_device`].
pub fn selected_transpose_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernel: KernelSource,
    lists: &CudaSlice<i32>,
) -> Result<BlockTokensDevice, GpuError> {
    let plan = plan(spec, config, None)?;
    let shape = kv_owner_shape::<T>(&plan.spec, TILING)?;
    let list_entries: usize = lists_shape(&plan.spec, config).iter().product();
    check_len("lists", lists, list_entries)?;
    let module = compile::module(stream.context(), kernel, &shape.defines)?;
    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e));
    build_transpose(stream, &module, &plan, (lists, list_entries), &up(&plan.cu_q)?)
}

/// Count, scan and fill of E20's transpose of `lists` (`list_entries` of them) into fresh buffers
/// ([`BlockTokensDevice`]); nothing is launched for a problem without tokens or KV heads (the offsets stay 0).
fn build_transpose(
    stream: &Arc<CudaStream>,
    module: &Arc<cudarc::driver::CudaModule>,
    plan: &super::selected::Plan,
    (lists, list_entries): (&CudaSlice<i32>, usize),
    cu_q: &CudaSlice<i32>,
) -> Result<BlockTokensDevice, GpuError> {
    let ctx = stream.context();
    let hkv = plan.spec.n_heads_kv;
    let n_blocks = plan.params.n_blocks as usize;
    let csr_rows = plan.batch * hkv * n_blocks;
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let mut offsets = stream.alloc_zeros::<i32>(csr_rows + 1).map_err(alloc_err)?;
    let mut tokens = stream.alloc_zeros::<i32>(list_entries.max(1)).map_err(alloc_err)?;
    if plan.max_len == 0 || plan.batch == 0 || hkv == 0 {
        return Ok(BlockTokensDevice { offsets, tokens });
    }
    let cfg = |grid: (u32, u32, u32)| LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let heads_seqs = |x: usize, what| grid_3d((what, x), ("n_heads_kv", hkv), ("sequences", plan.batch));
    let count = load_kernel(ctx, module, "nsa_csr_count", 0)?;
    let count_grid = heads_seqs(plan.max_len.div_ceil(128), "tokens")?;
    launch::launch_nsa_csr(stream, &count, cfg(count_grid), lists, &mut offsets, None, cu_q, &plan.params)?;
    let scan = load_kernel(ctx, module, "bwd_csr_scan", 0)?;
    let scan_cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    launch::launch_csr_scan(stream, &scan, scan_cfg, &mut offsets, to_i32("CSR rows", csr_rows)?)?;
    let fill = load_kernel(ctx, module, "nsa_csr_fill", 0)?;
    let fill_grid = heads_seqs(n_blocks.div_ceil(4), "selection blocks")?;
    let tokens_out = Some(&mut tokens);
    launch::launch_nsa_csr(stream, &fill, cfg(fill_grid), lists, &mut offsets, tokens_out, cu_q, &plan.params)?;
    Ok(BlockTokensDevice { offsets, tokens })
}

/// The selected branch's backward from host tensors (validates the lists, copies in, launches, copies out,
/// synchronizes); arguments as in [`selected_backward_device`], `o` and `lse` the branch forward's, `d_out` shaped
/// like `o`.
#[allow(clippy::too_many_arguments)]
pub fn selected_backward<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    (q, k, v): (ArrayViewD<'_, T>, ArrayViewD<'_, T>, ArrayViewD<'_, T>),
    (o, lse): (ArrayViewD<'_, T>, ArrayViewD<'_, f32>),
    d_out: ArrayViewD<'_, T>,
    lists: ArrayView3<'_, i32>,
    strategy: GpuBackwardStrategy,
) -> Result<BackwardOutput<T>, GpuError> {
    let branch = plan(spec, config, None)?.spec;
    validate_lists(&branch, config, lists)?;
    let lists = lists.as_standard_layout();
    let lists = lists.as_slice().expect("standard layout");
    let up_err = |e| GpuError::driver("cuMemcpyHtoD", e);
    let device_lists = if lists.is_empty() { stream.alloc_zeros::<i32>(1) } else { stream.clone_htod(lists) };
    let device_lists = device_lists.map_err(up_err)?;
    backward_from_host(stream, &branch, [q, k, v, o, d_out], lse, |inputs, outputs| {
        selected_backward_device(stream, spec, config, NSA_SELECTED_BWD, inputs, &device_lists, outputs, strategy)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::Mask;

    fn layer(hq: usize, hkv: usize, len: usize, d: usize, dv: usize) -> AttentionSpec {
        AttentionSpec::dense(1, hq, hkv, len, len, d, dv).with_mask(Mask::Causal)
    }

    /// The slots of the deterministic mode count every (list entry, 64-key tile) of a row.
    #[test]
    fn the_deterministic_mode_keeps_a_partial_per_slot_and_tile() {
        let config = |select_block, n_selected| NsaConfig { select_block, n_selected, ..NsaConfig::default() };
        assert_eq!(dq_slots(&config(64, 16)), 16);
        assert_eq!(dq_slots(&config(128, 16)), 32);
        assert_eq!(dq_slots(&config(32, 16)), 16);
    }

    /// Segments hold whole row tiles of the group's tokens, and their bound counts a block per row plus the listed
    /// pairs in whole segments: at T = 64K, G = 16, top-16, 1024 blocks and 512 segments of 2048 tokens.
    #[test]
    fn segments_hold_whole_tiles_and_bound_the_grid() {
        let s = BackwardSegments::DEFAULT;
        assert_eq!((s.tokens(16), s.tokens(3), s.tokens(1), s.tokens(64)), (2048, 512 * 21, 512 * 64, 512));
        assert_eq!(s.most(1024, 65536, 16, 16), 1024 + 512);
        assert_eq!(BackwardSegments { tiles: 1 }.most(3, 130, 4, 3), 3 + 25);
    }

    /// The KV owner's module is flash_bwd.cu's in the four-warp tiling: its defines and shared memory follow the
    /// dense plan (d = 192 needs two column chunks).
    #[test]
    fn the_kv_owner_follows_the_dense_plan() {
        let shape = kv_owner_shape::<half::bf16>(&layer(16, 1, 100, 192, 128), TILING).unwrap();
        assert!(shape.defines.contains(&"KV_WARPS=4".to_owned()) && shape.defines.contains(&"CHUNK=128".to_owned()));
        assert_eq!(shape.chunks, 2);
        assert_eq!(kv_owner_shape::<half::bf16>(&layer(4, 1, 100, 128, 128), TILING).unwrap().chunks, 1);
    }
}
