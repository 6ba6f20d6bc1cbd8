//! The backward of PISA's first-order tail on the GPU (E22's gradients): the block-sparse backward over the exact
//! lists with the PISA output and LSE, then `gpu/kernels/pisa_tail_bwd.cu`'s tail part added to its dQ, dK and dV.
//! Typed wrappers from device buffers ([`pisa_tail_backward_device`]) or host tensors ([`pisa_tail_backward`]).
//!
//! # The rule
//!
//! The oracle's `attnproof_oracle::pisa::tail_backward`: the gradients of `L = Σ_i dO_i · o_i` for PISA's output `o`
//! ([`crate::pisa::tail`]) with every row's classes held fixed. The exact keys take the dense backward's
//! `∂L/∂s_j = p_j (dO·v_j − D)` with the PISA row statistics (`p_j = e^{s_j − lse}`, `D = dO·o`). A tail block `b`
//! with weight `a_ib = e^{α q_i·μ_b − lse_i}` takes `g_ib = a_ib (|B_b| (dO_i·v̄_b − D_i) + dO_i·h_i)`,
//! `h_i = α H̄ᵀ q_i`, which reaches `q_i` through `μ_b` and the block's keys through `μ_b = mean k_j`; its value sum
//! takes `a_ib dO_i`; the shared term adds `A_i α H̄ dO_i` to `dq_i` (`A_i = Σ_b a_ib`) and
//! `G = Σ_i A_i α q_i dO_iᵀ` to `∂L/∂H̄`, which reaches every key and value of the sequence:
//! `dk_j += G (v_j − v̄_b) / n_b`, `dv_j += Gᵀ (k_j − μ_b) / n_b`. `proofs::pisa::decomposed_tail_backward` is this
//! decomposition, proved against finite differences in 256-bit arithmetic.
//!
//! # How it runs, and its precision
//!
//! [`crate::block_sparse::backward::block_sparse_backward_device`] over the forward's exact lists ([`TailPlan`]) with the
//! caller's `O` (PISA's) and LSE writes the exact part's gradients (rounded to the storage type) and `D` (f32). Then
//! five kernels in f64 from the storage-type inputs, the f64 statistics of the forward's workspace ([`TailWorkspace`]:
//! `μ_b`, `v̄_b`, `H̄`) and `D`: the rows' tail part of dQ (a warp per row, its tail blocks ascending), the blocks'
//! `dμ_b` and `dV^Σ_b` (a CTA per key block, over the group's rows that hold it), `G` (partial sums per range of
//! 4096 rows, added in order), and the scatter onto every key. Each gradient is rounded once more to the storage type
//! from the exact part's stored value plus the f64 tail part; an element whose tail part is exactly 0 keeps the exact
//! part's bits, so a problem without tail blocks returns the block-sparse backward's gradients. Every sum runs in a
//! fixed order: with a deterministic [`GpuBackwardStrategy`] the gradients are bitwise reproducible.
//! `attnproof_harness::pisa_tail_backward` holds them to the oracle under the block-sparse backward's model for the
//! exact part (with the tail forward's bounds on `O` and LSE) and a first-order model of the f64 tail part.
//!
//! # Memory
//!
//! The forward's [`TailWorkspace`] (read only), and a caller-owned [`TailBackwardWorkspace`] of f64: two values per
//! (query head, row) in LSE's layout, the blocks' gradients and `G` in the statistics' layout
//! ([`crate::pisa::tail::workspace_len`]), and `G`'s partial sums `[row ranges, B, Hq, d, dv]`
//! ([`partials_len`]).

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Operand;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::ArrayViewD;

use super::tail::{TailPlan, TailWorkspace, head_dim_pad, pisa_tail_statistics_planned, tail_defines, workspace_len};
use crate::backward::{
    BackwardDeviceInputs, BackwardDeviceOutputs, BackwardOutput, GpuBackwardStrategy, backward_from_host,
};
use crate::block_sparse::BlockLists;
use crate::block_sparse::backward::block_sparse_backward_device;
use crate::common::{GpuElement, check_len, grid_3d, to_i32};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::launch::{self, TailBackwardBuffers, TailBackwardFunctions, TailBackwardGrids};

/// `gpu/kernels/pisa_tail_bwd.cu` after the shared helpers, the block selector and the tail's forward, whose row
/// visibility, parameters and workspace layout it shares.
pub const PISA_TAIL_BWD: KernelSource = KernelSource {
    name: "pisa_tail_bwd",
    source: concat!(
        include_str!("../../kernels/common.cuh"),
        include_str!("../../kernels/bsa_select.cu"),
        include_str!("../../kernels/pisa_tail.cu"),
        include_str!("../../kernels/pisa_tail_bwd.cu")
    ),
};

/// Threads of the tiled kernels, rows and blocks (`TAILB_THREADS`, eight warps), and of the others (`G`, its sum, the
/// scatter: `TAILB_SMALL_THREADS`).
const THREADS: u32 = 256;
const SMALL_THREADS: u32 = 128;
/// The edge of `pisa_tail_bwd_g`'s tile of `G` (`TAILB_G_TILE`), its query rows per partial sum (`TAILB_G_ROWS`), and
/// the keys per CTA of `pisa_tail_bwd_scatter` (`TAILB_KEYS`).
const G_TILE: usize = 64;
/// Query rows per partial sum of `G` (`TAILB_G_ROWS`).
pub const G_SPLIT_ROWS: usize = 4096;
const SCATTER_KEYS: usize = 8;

/// Rows and key blocks per tile of `pisa_tail_bwd_rows` and `pisa_tail_bwd_blocks` (the define `TAILB_TILE`): 32, or 16
/// where a head dim passes 128, so that a tile pair's f64 operands fit in shared memory; a divisor of both query block
/// sizes, so that a row tile lies in one query block.
fn tile(spec: &AttentionSpec) -> usize {
    if head_dim_pad(spec.head_dim).max(head_dim_pad(spec.head_dim_v)) > 128 { 16 } else { 32 }
}

/// The defines `pisa_tail_bwd.cu` is compiled with: the tail forward's and the tile.
pub fn backward_defines<T: GpuElement>(spec: &AttentionSpec) -> Vec<String> {
    let mut defines = tail_defines::<T>(spec);
    defines.push(format!("TAILB_TILE={}", tile(spec)));
    defines
}

/// Dynamic shared memory of the tiled kernels (`tail_tile_shared`'s layout) plus `extra_bytes` of flags (the rows kernel's
/// listed flag per key block, the blocks kernel's per block of its tile): rows and blocks of `q`, `μ` and `W` padded to
/// `HEAD_DIM_PAD + 1` f64, of `dO` and `v̄` to `HEAD_DIM_V_PAD + 1`, the pair's two weight tiles padded to `tile + 1`,
/// three f64 per row, and a byte per (row, block) of the pair.
fn tiled_shared_bytes(spec: &AttentionSpec, extra_bytes: usize) -> usize {
    let (qs, vs, t) = (head_dim_pad(spec.head_dim) + 1, head_dim_pad(spec.head_dim_v) + 1, tile(spec));
    8 * (3 * t * qs + 2 * t * vs + 2 * t * (t + 1) + 3 * t) + t * t + extra_bytes
}

/// Ranges of [`G_SPLIT_ROWS`] rows of the longest sequence of `spec` (at least 1).
fn row_splits(spec: &AttentionSpec) -> usize {
    spec.sequences().iter().map(|s| s.len_q.div_ceil(G_SPLIT_ROWS)).max().unwrap_or(0).max(1)
}

/// f64 elements of `G`'s partial sums for `spec`: `[row ranges, B, Hq, d, dv]`.
pub fn partials_len(spec: &AttentionSpec) -> usize {
    row_splits(spec) * spec.sequences().len() * spec.n_heads_q * spec.head_dim * spec.head_dim_v
}

/// f64 elements of each row workspace: one per LSE element.
fn rows_len(spec: &AttentionSpec) -> usize {
    spec.expected_shape(Operand::RowStat).iter().product()
}

/// The caller-owned f64 workspace of the tail's backward.
pub struct TailBackwardWorkspace {
    /// `dO_i · h_i` per (query head, row), LSE's layout.
    pub through: CudaSlice<f64>,
    /// `A_i = Σ_b a_ib` per (query head, row), LSE's layout.
    pub mass: CudaSlice<f64>,
    /// `dμ_b` `[B, Hkv, n_k, d]`, `dV^Σ_b` `[B, Hkv, n_k, dv]` and `G` `[B, Hkv, d, dv]` at the offsets of the
    /// statistics' `μ`, `v̄` and `H̄` ([`workspace_len`] elements).
    pub grads: CudaSlice<f64>,
    /// `G`'s partial sums ([`partials_len`] elements).
    pub partials: CudaSlice<f64>,
}

impl TailBackwardWorkspace {
    /// Zeroed workspaces for `spec` with tail blocks of `kv_block` keys.
    pub fn alloc(stream: &Arc<CudaStream>, spec: &AttentionSpec, kv_block: usize) -> Result<Self, GpuError> {
        let alloc = |n: usize| stream.alloc_zeros::<f64>(n.max(1)).map_err(|e| GpuError::driver("cuMemAlloc", e));
        Ok(TailBackwardWorkspace {
            through: alloc(rows_len(spec))?,
            mass: alloc(rows_len(spec))?,
            grads: alloc(workspace_len(spec, kv_block))?,
            partials: alloc(partials_len(spec))?,
        })
    }
}

/// PISA's tail backward on device buffers (layouts as for [`crate::flash_backward_device`]): `inputs.o` and
/// `inputs.lse` are the tail forward's outputs over `plan`'s lists, `stats` the workspace that forward (or
/// [`pisa_tail_statistics_planned`]) filled from the same K and V. Every check runs before the first launch; the
/// launches are asynchronous on `stream`.
pub fn pisa_tail_backward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    plan: &TailPlan,
    inputs: BackwardDeviceInputs<'_, T>,
    outputs: BackwardDeviceOutputs<'_, T>,
    strategy: GpuBackwardStrategy,
    stats: &TailWorkspace<T>,
    work: &mut TailBackwardWorkspace,
) -> Result<(), GpuError> {
    pisa_tail_backward_device_with(stream, plan, PISA_TAIL_BWD, inputs, outputs, strategy, stats, work)
}

/// [`pisa_tail_backward_device`] with an explicit text of `pisa_tail_bwd.cu` (the tests launch patched copies through
/// the same checks).
#[allow(clippy::too_many_arguments)]
pub fn pisa_tail_backward_device_with<T: GpuElement>(
    stream: &Arc<CudaStream>,
    plan: &TailPlan,
    kernel: KernelSource,
    inputs: BackwardDeviceInputs<'_, T>,
    outputs: BackwardDeviceOutputs<'_, T>,
    strategy: GpuBackwardStrategy,
    stats: &TailWorkspace<T>,
    work: &mut TailBackwardWorkspace,
) -> Result<(), GpuError> {
    let (spec, exact, params) = (&plan.spec, &plan.exact, &plan.params);
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    for (name, buffer, op) in [("q", inputs.q, Operand::Q), ("k", inputs.k, Operand::K), ("v", inputs.v, Operand::V)] {
        check_len(name, buffer, size(op))?;
    }
    check_len("o", inputs.o, size(Operand::O))?;
    check_len("d_out", inputs.d_out, size(Operand::O))?;
    check_len("lse", inputs.lse, size(Operand::RowStat))?;
    check_len("dq", outputs.dq, size(Operand::Q))?;
    check_len("dk", outputs.dk, size(Operand::K))?;
    check_len("dv", outputs.dv, size(Operand::V))?;
    check_len("delta", outputs.delta, size(Operand::RowStat))?;
    check_len("stats.stats", &stats.stats, workspace_len(spec, exact.kv_block))?;
    check_len("work.through", &work.through, rows_len(spec))?;
    check_len("work.mass", &work.mass, rows_len(spec))?;
    check_len("work.grads", &work.grads, workspace_len(spec, exact.kv_block))?;
    check_len("work.partials", &work.partials, partials_len(spec))?;
    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &backward_defines::<T>(spec))?;
    let load = |name: &'static str| {
        module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(pisa_tail_bwd.cu)", e))
    };
    let functions = TailBackwardFunctions {
        rows: load("pisa_tail_bwd_rows")?,
        blocks: load("pisa_tail_bwd_blocks")?,
        g: load("pisa_tail_bwd_g")?,
        g_sum: load("pisa_tail_bwd_g_sum")?,
        scatter: load("pisa_tail_bwd_scatter")?,
    };
    let key_blocks = params.n_key_blocks as usize;
    let (rows_shared, blocks_shared) = (tiled_shared_bytes(spec, key_blocks), tiled_shared_bytes(spec, tile(spec)));
    compile::allow_shared_memory(ctx, &functions.rows, rows_shared, "head dims and key blocks")?;
    compile::allow_shared_memory(ctx, &functions.blocks, blocks_shared, "head dims")?;
    let batch = spec.sequences().len();
    let max_q = spec.sequences().iter().map(|s| s.len_q).max().unwrap_or(0);
    let max_k = spec.sequences().iter().map(|s| s.len_k).max().unwrap_or(0);
    let splits = row_splits(spec);
    let tiles = spec.head_dim.div_ceil(G_TILE) * spec.head_dim_v.div_ceil(G_TILE) * splits;
    let tiled = |grid: (u32, u32, u32), shared: usize| LaunchConfig {
        grid_dim: grid,
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let small =
        |grid: (u32, u32, u32)| LaunchConfig { grid_dim: grid, block_dim: (SMALL_THREADS, 1, 1), shared_mem_bytes: 0 };
    let (hq, hkv) = (("heads", spec.n_heads_q), ("heads", spec.n_heads_kv));
    let grids = |batch| -> Result<TailBackwardGrids, GpuError> {
        let seqs = ("sequences", batch);
        Ok(TailBackwardGrids {
            rows: tiled(grid_3d(("rows", max_q.div_ceil(tile(spec))), hq, seqs)?, rows_shared),
            blocks: tiled(grid_3d(("key blocks", key_blocks.div_ceil(tile(spec))), hkv, seqs)?, blocks_shared),
            g: small(grid_3d(("tiles", tiles), hq, seqs)?),
            g_sum: small(grid_3d(
                ("elements", (spec.head_dim * spec.head_dim_v).div_ceil(SMALL_THREADS as usize)),
                hkv,
                seqs,
            )?),
            scatter: small(grid_3d(("keys", max_k.div_ceil(SCATTER_KEYS)), hkv, seqs)?),
            row_splits: to_i32("row ranges", splits)?,
        })
    };
    let launch_grids = grids(batch.max(1))?;

    let exact_outputs = BackwardDeviceOutputs {
        dq: &mut *outputs.dq,
        dk: &mut *outputs.dk,
        dv: &mut *outputs.dv,
        delta: &mut *outputs.delta,
    };
    block_sparse_backward_device(stream, spec, exact, inputs, exact_outputs, strategy)?;
    if batch == 0 || max_q == 0 || max_k == 0 {
        return Ok(());
    }
    launch::launch_pisa_tail_backward(
        stream,
        &functions,
        launch_grids,
        TailBackwardBuffers {
            q: inputs.q,
            k: inputs.k,
            v: inputs.v,
            d_out: inputs.d_out,
            lists: &plan.device_lists,
            stats: &stats.stats,
            lse: inputs.lse,
            delta: &*outputs.delta,
            through: &mut work.through,
            mass: &mut work.mass,
            grads: &mut work.grads,
            partials: &mut work.partials,
            dq: outputs.dq,
            dk: outputs.dk,
            dv: outputs.dv,
            cu_q: &plan.cu_q,
            cu_k: &plan.cu_k,
        },
        params,
    )
}

/// PISA's tail backward from host tensors (`o`, `lse` the tail forward's over `lists`), returning host outputs: the
/// statistics (`pisa_tail.cu`), then the backward (copies in, launches, copies out, synchronizes).
#[allow(clippy::too_many_arguments)]
pub fn pisa_tail_backward<T: GpuElement>(
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
    let plan = TailPlan::new(stream, spec, lists)?;
    let mut stats = TailWorkspace::alloc(stream, spec, lists.kv_block)?;
    let mut work = TailBackwardWorkspace::alloc(stream, spec, lists.kv_block)?;
    backward_from_host(stream, spec, [q, k, v, o, d_out], lse, |inputs, outputs| {
        pisa_tail_statistics_planned(stream, &plan, super::tail::PISA_TAIL, inputs.k, inputs.v, &mut stats)?;
        pisa_tail_backward_device(stream, &plan, inputs, outputs, strategy, &stats, &mut work)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's launch constants are the kernel text's.
    #[test]
    fn the_launch_constants_are_the_kernels() {
        let define = |name: &str| crate::common::numeric_define(PISA_TAIL_BWD.source, name);
        assert_eq!(define("TAILB_WARPS") * 32, THREADS as usize);
        assert_eq!(define("TAILB_SMALL_THREADS"), SMALL_THREADS as usize);
        assert_eq!(define("TAILB_G_TILE"), G_TILE);
        assert_eq!(define("TAILB_G_ROWS"), G_SPLIT_ROWS);
        assert_eq!(define("TAILB_KEYS"), SCATTER_KEYS);
    }

    /// The tile and the shared memory of the tiled kernels: 32 up to head dims of 128, 16 past them, within the
    /// device's 227 KiB at 256 with 4096 key blocks.
    #[test]
    fn the_tiles_and_their_shared_memory_are_spelled_out() {
        let spec = |d, dv| AttentionSpec::dense(1, 1, 1, 1, 1, d, dv);
        assert_eq!((tile(&spec(128, 128)), tile(&spec(136, 8)), tile(&spec(8, 256))), (32, 16, 16));
        assert_eq!(tiled_shared_bytes(&spec(128, 128), 5), 8 * (3 * 32 * 129 + 2 * 32 * 129 + 2 * 32 * 33 + 96) + 1029);
        assert!(tiled_shared_bytes(&spec(256, 256), 4096) <= 227 * 1024);
        assert!(tiled_shared_bytes(&spec(128, 128), 4096) <= 227 * 1024);
        assert_eq!(
            backward_defines::<half::bf16>(&spec(64, 16)),
            ["ELEM_BF16", "HEAD_DIM_PAD=64", "HEAD_DIM_V_PAD=16", "TAILB_TILE=32"]
        );
    }

    #[test]
    fn the_workspaces_are_spelled_out() {
        let spec = AttentionSpec {
            layout: attnproof_oracle::Layout::Varlen { cu_seqlens_q: vec![0, 10, 4200], cu_seqlens_k: vec![0, 7, 9] },
            ..AttentionSpec::dense(1, 4, 2, 1, 1, 64, 32)
        };
        // The second sequence's 4190 rows are two ranges of 4096.
        assert_eq!(partials_len(&spec), 2 * 2 * 4 * 64 * 32);
        assert_eq!(rows_len(&spec), 4 * 4200);
        let empty = AttentionSpec::dense(1, 2, 1, 0, 5, 16, 16);
        assert_eq!(partials_len(&empty), 2 * 16 * 16);
    }
}
