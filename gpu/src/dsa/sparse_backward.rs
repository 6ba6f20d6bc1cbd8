//! DSA's token-sparse attention backward (the gradients of E16's main attention over fixed lists) on the GPU:
//! `gpu/kernels/dsa_sparse_bwd.cu` behind typed wrappers, from device buffers ([`token_sparse_backward_device`]) or
//! host tensors ([`token_sparse_backward`]).
//!
//! The lists are held fixed (top-k has no gradient), so the backward is the dense backward of the visibility "key `s`
//! in token `t`'s list": dQ, dK, dV and `D` of the oracle's dense backward under that visibility, per query head.
//!
//! # Schedule, and why the dense bound holds
//!
//! `D = rowsum(dO ∘ O)` by `flash_bwd.cu`'s preprocess. Then one CTA per (token, chunk of up to 64 query heads of a KV
//! head's group, column chunk), the forward's rows, walks the token's list in gathered tiles of [`KV_TILE`] slots and
//! runs the dense KV owner's tile step on each with the slots in the keys' place: `Sᵀ = K Qᵀ`, `dPᵀ = V dOᵀ`, `P`,
//! `dS`, the tile's `dV = round_T(P)ᵀ dO` and `dK = dSᵀ Q` summed over the chunk's heads by the tensor cores and added to
//! f32 accumulators of the gathered rows with vector reductions, and `dQ = dS K` summed over the tiles. A token owns
//! its rows: dQ is written once (bitwise reproducible). dK and dV come in two modes ([`KvSums`]):
//! [`GpuBackwardStrategy::KvOwnerAtomic`], where a key collects one partial per (token, head chunk) listing it, in an
//! order the hardware picks, then a last pass scales and rounds them (not bitwise reproducible); and
//! [`GpuBackwardStrategy::KvOwnerDeterministic`], where the lists are transposed on the device (per tile of 64 keys, the
//! tokens that list one of its keys, ascending, each with the 64-bit mask of those keys: a count, the dense backward's
//! scan, a ballot fill) and a KV owner per tile walks its tokens in tiles of `⌊64/G⌋` tokens × `G` heads, masking the
//! keys a token does not list (bitwise reproducible; groups of at most 64 heads; its work grows with the number of
//! (tile, listing token) pairs, up to 64 times the atomic mode's for lists spread thinly over long sequences).
//!
//! The bound is the dense backward's for the group's rows stacked as one head (token-major), with query tiles of
//! [`query_tile_rows`] rows (a key's partials: one per head chunk of each listing token), KV tiles of `min(k, 64)` keys
//! (a row's dQ partials), the forward's visited tiles, and the reductions' subnormal flush counted once per partial:
//! the harness's `dsa_sparse::token_sparse_backward_recipe` and `verify_token_sparse_backward`. The deterministic mode's
//! chains (a key's rows in tiles of up to 64, at most one per listing token) are within the same count.
//!
//! # Errors
//!
//! Before any launch: the layer and the selection (as the forward, [`super::sparse`]), the strategy and the group
//! ([`kv_sums`]: [`GpuError::Unsupported`] for the two traversals, and for the deterministic mode above 64 heads), and
//! every buffer's length; from
//! host tensors also every list ([`validate_token_lists`]) and every value (finite inputs, an LSE finite or `−∞`).
//! Device lists are read with the forward's rule, so no list can make the kernel read or add outside its sequence.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Operand;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::{ArrayView3, ArrayViewD};

use super::sparse::{KV_TILE, Plan, TokenSelection, plan, validate_token_lists};
use crate::backward::{
    BackwardDeviceInputs, BackwardDeviceOutputs, BackwardOutput, BackwardTiling, GpuBackwardStrategy, Q_TILE,
    backward_from_host, check_backward_buffers, kv_owner_shape, load_kernel,
};
use crate::common::{GpuElement, check_len, grid_3d, to_i32};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::launch::{self, BackwardBuffers, BackwardKernel, DsaSparseBwdBuffers, DsaSparseBwdKvBuffers};
use crate::params::BackwardParams;

/// `gpu/kernels/dsa_sparse_bwd.cu` after the shared helpers and `flash_bwd.cu`, whose tile step and preprocess it
/// calls.
pub const DSA_SPARSE_BWD: KernelSource = KernelSource {
    name: "dsa_sparse_bwd",
    source: concat!(
        include_str!("../../kernels/common.cuh"),
        include_str!("../../kernels/flash_bwd.cu"),
        include_str!("../../kernels/dsa_sparse_bwd.cu")
    ),
};

/// The tile step's tiling: four warps over a gathered tile of 64 slots.
pub const TILING: BackwardTiling = BackwardTiling { kv_warps: 4 };

/// Query heads of one CTA at most: a group above it takes `⌈G/64⌉` CTAs per token, each gathering the rows again.
pub const MAX_HEADS_PER_CTA: usize = Q_TILE;

/// The rows one of a key's partial dK, dV sums covers, as the bound counts them: a group of `G` heads is split into
/// `⌈G/64⌉` chunks of at most `⌈G/⌈G/64⌉⌉` heads, so the `G·T` stacked rows of a KV head make at most
/// `⌈G/64⌉ · T` partials per key (`T` listing tokens), which is what query tiles of this many rows count.
pub fn query_tile_rows(group: usize) -> usize {
    let chunks = group.div_ceil(MAX_HEADS_PER_CTA).max(1);
    group.div_ceil(chunks).max(1)
}

/// Bytes of the kernel's shared memory for padded head dims `d_pad`, `dv_pad` and column chunks of `chunk`: the
/// gathered K and V tiles and the Q, dO tiles of the chunk's heads (2-byte elements, rows padded by 8), the dS tile
/// `[64][64 + 8]`, `b_L` and `D`, and the rows' f32 dQ sums (`chunk / 2` per thread of 128).
pub fn shared_bytes(d_pad: usize, dv_pad: usize, chunk: usize) -> usize {
    let rows = KV_TILE + Q_TILE;
    2 * (rows * (d_pad + 8) + rows * (dv_pad + 8) + Q_TILE * (KV_TILE + 8)) + 2 * Q_TILE * 4 + 4 * 128 * (chunk / 2)
}

/// How the backward forms dK and dV (dQ is owned per token in both).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvSums {
    /// Each token adds its gathered keys' partials to f32 accumulators with vector reductions
    /// ([`GpuBackwardStrategy::KvOwnerAtomic`]): not bitwise reproducible.
    Atomic,
    /// A KV owner per tile of 64 keys walks the token-level transpose of the lists in ascending token order
    /// ([`GpuBackwardStrategy::KvOwnerDeterministic`]): bitwise reproducible; groups of at most 64 heads.
    Transposed,
}

/// Which [`KvSums`] `strategy` runs for a GQA group of `group` heads: [`GpuBackwardStrategy::TwoTraversals`] has no
/// token-sparse form, and the transposed mode holds a group's heads in one tile of 64 rows
/// ([`GpuError::Unsupported`] for either).
pub fn kv_sums(strategy: GpuBackwardStrategy, group: usize) -> Result<KvSums, GpuError> {
    match strategy {
        GpuBackwardStrategy::KvOwnerAtomic => Ok(KvSums::Atomic),
        GpuBackwardStrategy::KvOwnerDeterministic if group <= MAX_HEADS_PER_CTA => Ok(KvSums::Transposed),
        GpuBackwardStrategy::KvOwnerDeterministic => Err(GpuError::Unsupported {
            argument: "strategy",
            reason: format!(
                "the deterministic token-sparse backward holds a KV head's group in one tile of \
                 {MAX_HEADS_PER_CTA} rows, not {group} heads (KvOwnerAtomic takes any group)"
            ),
        }),
        GpuBackwardStrategy::TwoTraversals => Err(GpuError::Unsupported {
            argument: "strategy",
            reason: "DSA's token-sparse backward owns dQ per token (KvOwnerAtomic or KvOwnerDeterministic)".to_owned(),
        }),
    }
}

/// Entries of the token-level transpose of one list head of `spec`'s sequences at most: a token's list names at most
/// `min(top_k, ⌊t/64⌋ + 1)` KV tiles.
pub fn transpose_entries(spec: &AttentionSpec, top_k: usize) -> usize {
    spec.sequences().iter().map(|s| (0..s.len_q).map(|t| top_k.min(t / KV_TILE + 1)).sum::<usize>()).sum()
}

/// The token-sparse backward on device buffers (asynchronously on `stream`): from the layer's Q, K, V, the forward's O
/// and LSE ([`super::sparse::token_sparse_device`]), the upstream gradient `dO` and the lists of `selection` (not
/// validated: see the module docs), writes dQ, dK, dV and `D` into the first elements of `outputs`. `kernel` is
/// [`DSA_SPARSE_BWD`] or a patched copy of it (the tests' mutants). The f32 accumulators are allocated here.
#[allow(clippy::too_many_arguments)]
pub fn token_sparse_backward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    selection: TokenSelection,
    kernel: KernelSource,
    inputs: BackwardDeviceInputs<'_, T>,
    lists: &CudaSlice<i32>,
    outputs: BackwardDeviceOutputs<'_, T>,
    strategy: GpuBackwardStrategy,
) -> Result<(), GpuError> {
    let mut plan = plan(spec, selection)?;
    let sums = kv_sums(strategy, spec.group_size())?;
    let shape = kv_owner_shape::<T>(spec, TILING)?;
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_backward_buffers(spec, &inputs, &outputs)?;
    check_len("lists", lists, selection.lists_shape(spec).iter().product())?;
    let (hq, hkv, group) = (spec.n_heads_q, spec.n_heads_kv, spec.group_size());
    plan.params.head_chunks = to_i32("head chunks", group.div_ceil(MAX_HEADS_PER_CTA))?;
    plan.params.column_chunks = to_i32("column chunks", shape.chunks as usize)?;
    let head_ctas = hkv * plan.params.head_chunks as usize * shape.chunks as usize;
    let grid = grid_3d(
        ("tokens", plan.max_len),
        ("n_heads_kv × head and column chunks", head_ctas),
        ("sequences", plan.batch),
    )?;
    let width = spec.head_dim.max(spec.head_dim_v).div_ceil(2);
    let finalize_grid = grid_3d(
        ("key column pairs", (plan.max_len * width).div_ceil(128)),
        ("n_heads_kv", hkv),
        ("sequences", plan.batch),
    )?;
    let preprocess_grid =
        grid_3d(("query tiles", plan.max_len.div_ceil(Q_TILE)), ("n_heads_q", hq), ("sequences", plan.batch))?;
    if plan.max_len == 0 || plan.batch == 0 || hkv == 0 {
        return Ok(());
    }
    let pad = |d: usize| d.div_ceil(16) * 16;
    let shared = shared_bytes(pad(spec.head_dim), pad(spec.head_dim_v), shape.chunk);

    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &shape.defines)?;
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e));
    let (cu_q, cu_k) = (up(&plan.cu_q)?, up(&plan.cu_k)?);
    let atomic = sums == KvSums::Atomic;
    let accumulator = |op: Operand| if atomic { size(op).max(1) } else { 1 };
    let mut dk_acc = stream.alloc_zeros::<f32>(accumulator(Operand::K)).map_err(alloc_err)?;
    let mut dv_acc = stream.alloc_zeros::<f32>(accumulator(Operand::V)).map_err(alloc_err)?;
    let cfg = |grid: (u32, u32, u32), shared: usize| LaunchConfig {
        grid_dim: grid,
        block_dim: (128, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let BackwardDeviceOutputs { dq, dk, dv, delta } = outputs;

    // D = rowsum(dO ∘ O): flash_bwd.cu's preprocess (its other buffers are placeholders it does not touch).
    let (mut unused_a, mut unused_b, mut unused_c) = (
        stream.alloc_zeros::<f32>(1).map_err(alloc_err)?,
        stream.alloc_zeros::<f32>(1).map_err(alloc_err)?,
        stream.alloc_zeros::<f32>(1).map_err(alloc_err)?,
    );
    let preprocess = load_kernel(ctx, &module, BackwardKernel::Preprocess.name(), 0)?;
    // The preprocess reads the problem only (BackwardParams' other scalars belong to flash_bwd.cu's other kernels).
    let params = BackwardParams { flash: plan.params.flash, ..BackwardParams::default() };
    let mut buffers = BackwardBuffers {
        q: inputs.q,
        k: inputs.k,
        v: inputs.v,
        o: inputs.o,
        lse: inputs.lse,
        d_out: inputs.d_out,
        dq: &mut *dq,
        dk: &mut *dk,
        dv: &mut *dv,
        delta: &mut *delta,
        dq_acc: &mut unused_a,
        dq_part: &mut unused_b,
        dkv_part: &mut unused_c,
        cu_q: &cu_q,
        cu_k: &cu_k,
        sparse: None,
    };
    let which = BackwardKernel::Preprocess;
    launch::launch_flash_backward(stream, &preprocess, cfg(preprocess_grid, 0), which, &mut buffers, &params)?;

    // Every token's dQ, and its keys' dK and dV partials.
    let owner = load_kernel(ctx, &module, "dsa_sparse_bwd", shared as u32)?;
    let buffers = DsaSparseBwdBuffers {
        q: inputs.q,
        k: inputs.k,
        v: inputs.v,
        d_out: inputs.d_out,
        lse: inputs.lse,
        delta: &*delta,
        dq: &mut *dq,
        dk_acc: &mut dk_acc,
        dv_acc: &mut dv_acc,
        lists,
        cu_q: &cu_q,
        cu_k: &cu_k,
    };
    launch::launch_dsa_sparse_bwd(stream, &owner, cfg(grid, shared), buffers, &plan.params, i32::from(atomic))?;

    if !atomic {
        // The token-level transpose, then a KV owner per tile of 64 keys.
        let kv_tiles_i32 = to_i32("KV tiles", plan.max_len.div_ceil(KV_TILE))?;
        let TokenTransposeDevice { offsets, tokens, masks } =
            build_token_transpose(stream, &module, (spec, &plan), selection, lists, (&cu_q, &cu_k))?;
        let kv_owner = load_kernel(ctx, &module, "dsa_sparse_bwd_kv", shared as u32)?;
        let kv_grid = grid_3d(
            ("KV tiles", plan.max_len.div_ceil(KV_TILE)),
            ("n_heads_kv × column chunks", hkv * shape.chunks as usize),
            ("sequences", plan.batch),
        )?;
        let buffers = DsaSparseBwdKvBuffers {
            q: inputs.q,
            k: inputs.k,
            v: inputs.v,
            d_out: inputs.d_out,
            lse: inputs.lse,
            delta: &*delta,
            dk: &mut *dk,
            dv: &mut *dv,
            csr_offsets: &offsets,
            csr_tokens: &tokens,
            csr_masks: &masks,
            cu_q: &cu_q,
            cu_k: &cu_k,
        };
        return launch::launch_dsa_sparse_bwd_kv(
            stream,
            &kv_owner,
            cfg(kv_grid, shared),
            buffers,
            &plan.params,
            kv_tiles_i32,
        );
    }

    // dK = round_T(α̂ · Σ), dV = round_T(Σ).
    let finalize = load_kernel(ctx, &module, "dsa_dkv_finalize", 0)?;
    launch::launch_dsa_dkv_finalize(
        stream,
        &finalize,
        cfg(finalize_grid, 0),
        (&dk_acc, &dv_acc),
        (&mut *dk, &mut *dv),
        (&cu_q, &cu_k),
        &plan.params,
    )
}

/// The deterministic mode's token-level transpose as the backward builds it on the device: one CSR row per (sequence,
/// list head, tile of 64 keys of the longest sequence), in that order (row `(seq·list_heads + head)·tiles + tile`),
/// holding the sequence's tokens whose list names a key of the tile, ascending (sequence-local positions), each with
/// the 64-bit mask of the tile's keys it names (bit `i` for key `64·tile + i`). `offsets` has one entry per row and
/// one more, from 0; `tokens` and `masks` hold at least `offsets[rows]` entries.
#[derive(Debug)]
pub struct TokenTransposeDevice {
    /// `[rows + 1]`, non-decreasing from 0.
    pub offsets: CudaSlice<i32>,
    /// The rows' tokens, row after row.
    pub tokens: CudaSlice<i32>,
    /// Each token's mask of the row's keys.
    pub masks: CudaSlice<u64>,
}

/// The transpose alone (what the deterministic KV owner walks), so that a test can hold it to a host transpose entry
/// for entry: the lists of `selection` on the device are read with the forward's rule. `kernel` is
/// [`DSA_SPARSE_BWD`] or a patched copy. Checks as in [`token_sparse_backward_device`] for the lists.
pub fn token_transpose_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    selection: TokenSelection,
    kernel: KernelSource,
    lists: &CudaSlice<i32>,
) -> Result<TokenTransposeDevice, GpuError> {
    let plan = plan(spec, selection)?;
    let shape = kv_owner_shape::<T>(spec, TILING)?;
    check_len("lists", lists, selection.lists_shape(spec).iter().product())?;
    let module = compile::module(stream.context(), kernel, &shape.defines)?;
    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e));
    build_token_transpose(stream, &module, (spec, &plan), selection, lists, (&up(&plan.cu_q)?, &up(&plan.cu_k)?))
}

/// Count, scan and fill of the token-level transpose of `lists` into fresh buffers ([`TokenTransposeDevice`]);
/// nothing is launched for a problem without tokens (the offsets stay 0).
fn build_token_transpose(
    stream: &Arc<CudaStream>,
    module: &Arc<cudarc::driver::CudaModule>,
    (spec, plan): (&AttentionSpec, &Plan),
    selection: TokenSelection,
    lists: &CudaSlice<i32>,
    seqlens: (&CudaSlice<i32>, &CudaSlice<i32>),
) -> Result<TokenTransposeDevice, GpuError> {
    let ctx = stream.context();
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let list_heads = plan.params.list_heads as usize;
    let kv_tiles = plan.max_len.div_ceil(KV_TILE);
    let kv_tiles_i32 = to_i32("KV tiles", kv_tiles)?;
    let csr_rows = plan.batch * list_heads * kv_tiles;
    let entries = transpose_entries(spec, selection.top_k) * list_heads;
    let mut offsets = stream.alloc_zeros::<i32>(csr_rows + 1).map_err(alloc_err)?;
    let mut tokens = stream.alloc_zeros::<i32>(entries.max(1)).map_err(alloc_err)?;
    let mut masks = stream.alloc_zeros::<u64>(entries.max(1)).map_err(alloc_err)?;
    if plan.max_len == 0 || plan.batch == 0 || list_heads == 0 {
        return Ok(TokenTransposeDevice { offsets, tokens, masks });
    }
    let mut lengths =
        stream.alloc_zeros::<i32>((plan.params.token_rows as usize * list_heads).max(1)).map_err(alloc_err)?;
    let cfg = |grid: (u32, u32, u32)| LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let heads_seqs = |x: usize, what| grid_3d((what, x), ("list heads", list_heads), ("sequences", plan.batch));
    let count = load_kernel(ctx, module, "dsa_csr_count", 0)?;
    let count_grid = heads_seqs(plan.max_len.div_ceil(128), "tokens")?;
    let csr = (&mut offsets, &mut lengths);
    launch::launch_dsa_csr(stream, &count, cfg(count_grid), lists, csr, None, seqlens, &plan.params, kv_tiles_i32)?;
    let scan = load_kernel(ctx, module, "bwd_csr_scan", 0)?;
    let scan_cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    launch::launch_csr_scan(stream, &scan, scan_cfg, &mut offsets, to_i32("CSR rows", csr_rows)?)?;
    let fill = load_kernel(ctx, module, "dsa_csr_fill", 0)?;
    let fill_grid = heads_seqs(kv_tiles.div_ceil(4), "KV tiles")?;
    let csr = (&mut offsets, &mut lengths);
    let written = Some((&mut tokens, &mut masks));
    launch::launch_dsa_csr(stream, &fill, cfg(fill_grid), lists, csr, written, seqlens, &plan.params, kv_tiles_i32)?;
    Ok(TokenTransposeDevice { offsets, tokens, masks })
}

/// The token-sparse backward from host tensors (validates the layer, the lists and the values, copies in, launches,
/// copies out, synchronizes); arguments as in [`token_sparse_backward_device`], `o` and `lse` the forward's, `d_out`
/// shaped like `o`.
#[allow(clippy::too_many_arguments)]
pub fn token_sparse_backward<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    selection: TokenSelection,
    kernel: KernelSource,
    (q, k, v): (ArrayViewD<'_, T>, ArrayViewD<'_, T>, ArrayViewD<'_, T>),
    (o, lse): (ArrayViewD<'_, T>, ArrayViewD<'_, f32>),
    d_out: ArrayViewD<'_, T>,
    lists: ArrayView3<'_, i32>,
    strategy: GpuBackwardStrategy,
) -> Result<BackwardOutput<T>, GpuError> {
    plan(spec, selection)?;
    validate_token_lists(spec, selection, lists)?;
    let host_lists = lists.as_standard_layout();
    let host_lists = host_lists.as_slice().expect("standard layout");
    let upload = if host_lists.is_empty() { stream.alloc_zeros::<i32>(1) } else { stream.clone_htod(host_lists) };
    let device_lists = upload.map_err(|e| GpuError::driver("cuMemcpyHtoD(lists)", e))?;
    backward_from_host(stream, spec, [q, k, v, o, d_out], lse, |inputs, outputs| {
        token_sparse_backward_device(stream, spec, selection, kernel, inputs, &device_lists, outputs, strategy)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dsa::sparse::ListSharing;
    use attnproof_oracle::Mask;

    #[test]
    fn query_tiles_count_a_keys_partials() {
        // Up to 64 heads one chunk of the whole group; above, ⌈G/64⌉ chunks of at most ⌈G/⌈G/64⌉⌉ heads.
        for (group, rows) in [(1, 1), (3, 3), (16, 16), (64, 64), (65, 33), (100, 50), (128, 64), (129, 43)] {
            assert_eq!(query_tile_rows(group), rows, "group {group}");
            let chunks = group.div_ceil(64);
            assert!(chunks * rows >= group && (chunks * 64 >= group), "group {group}");
            // The stacked rows of one token make at most as many tiles as the kernel makes partials.
            assert_eq!(group.div_ceil(rows), chunks, "group {group}");
        }
        // A Q and a K tile of 64 rows of 128 + 8 columns, the same for dO and V, dS [64][72], b_L and D.
        assert_eq!(shared_bytes(128, 128, 128), 2 * (128 * 136 + 128 * 136 + 64 * 72) + 512 + 128 * 64 * 4);
    }

    /// The atomic strategy takes every group, the deterministic one groups up to 64 heads, the two traversals none;
    /// the refusals are typed errors naming the argument.
    #[test]
    fn the_strategies_map_to_their_kv_sums() {
        use GpuBackwardStrategy::*;
        for group in [1, 3, 64, 65, 128] {
            assert_eq!(kv_sums(KvOwnerAtomic, group).unwrap(), KvSums::Atomic);
            let deterministic = kv_sums(KvOwnerDeterministic, group);
            if group <= 64 {
                assert_eq!(deterministic.unwrap(), KvSums::Transposed);
            } else {
                assert!(matches!(deterministic, Err(GpuError::Unsupported { argument: "strategy", .. })));
            }
            assert!(matches!(kv_sums(TwoTraversals, group), Err(GpuError::Unsupported { argument: "strategy", .. })));
        }
    }

    /// A token's list names at most one KV tile per slot and per 64 tokens it sees: 64 tokens of one tile each, then
    /// two, capped at `top_k`; over every sequence of a varlen layout.
    #[test]
    fn the_transpose_is_sized_by_tiles_per_token() {
        let dense = AttentionSpec::dense(2, 4, 2, 130, 130, 64, 64).with_mask(Mask::Causal);
        // Per sequence: tokens 0..63 one tile, 64..127 two, 128 and 129 three.
        assert_eq!(transpose_entries(&dense, 2048), 2 * (64 + 2 * 64 + 2 * 3));
        assert_eq!(transpose_entries(&dense, 2), 2 * (64 + 2 * 66));
        let varlen = AttentionSpec {
            layout: attnproof_oracle::Layout::Varlen { cu_seqlens_q: vec![0, 0, 65], cu_seqlens_k: vec![0, 0, 65] },
            ..dense
        };
        assert_eq!(transpose_entries(&varlen, 5), 64 + 2);
        assert_eq!(transpose_entries(&varlen, 0), 0);
    }

    /// The defines follow the dense backward's plan in the four-warp tiling: one column chunk up to 128 columns, two
    /// at 256.
    #[test]
    fn the_module_is_the_four_warp_backward_plan() {
        let spec = |d: usize| AttentionSpec::dense(1, 4, 2, 64, 64, d, d).with_mask(Mask::Causal);
        let narrow = kv_owner_shape::<half::bf16>(&spec(128), TILING).unwrap();
        assert!(narrow.defines.iter().any(|d| d == "KV_WARPS=4") && narrow.chunks == 1);
        assert_eq!(kv_owner_shape::<half::bf16>(&spec(256), TILING).unwrap().chunks, 2);
        let selection = TokenSelection { top_k: 16, heads: ListSharing::Shared };
        assert_eq!(plan(&spec(64), selection).unwrap().params.head_chunks, 1);
    }
}
