//! PISA's first-order tail on the GPU (E22): the block-sparse forward over a query block's listed key blocks, and
//! every other key block the row sees whole in the same softmax, as its first-order summary. `gpu/kernels/pisa_tail.cu`
//! behind typed wrappers, from device buffers ([`pisa_tail_forward_device`]) or host tensors ([`pisa_tail_forward`]).
//!
//! # The rule
//!
//! The oracle's (`attnproof_oracle::pisa`: `tail_statistics`, `classify_blocks`, `tail_output` with `TailRule::Pisa`).
//! A row's key blocks are *exact* when its query block lists them, when the mask cuts them for some row of the query
//! block, or when the block is the sequence's partial last block and some row of the query block sees a key of it
//! ([`exact_lists`] adds those to the lists: E22 approximates whole blocks only, a block kernel computes a query
//! block's rows together, and with every tail block of `C` keys the tail is one attention over the pooled keys);
//! every other block the row sees whole is *tail*: it adds `α_ib |B_b|` to the
//! denominator and `α_ib V^Σ_b` to the numerator, `α_ib = e^{α q_i·μ_b}`, and the tail's blocks together add
//! `(Σ_b α_ib) α q_iᵀ H̄`, `H̄` the mean of `H_b = Σ_{j∈b} (k_j − μ_b) v_jᵀ` over every block of the sequence (the
//! partial last block too), per KV head. Tail blocks are the lists' key blocks (`kv_block` keys). Masks: none or the
//! bottom-right causal mask.
//!
//! # How it runs, and its precision
//!
//! The exact part is [`crate::block_sparse::block_sparse_forward_device`] over [`exact_lists`], with its own recipe
//! and bound. Then three launches: the blocks' mean keys and values in f64 (`pisa_tail_means`, the block selector's
//! pooling) with their storage-type forms, `H̄` (`pisa_tail_hbar`: `Σ_j k_j v_jᵀ` on the tensor cores, 32 keys per f32
//! sum added in f64, less the centring term `Σ_b n_b μ_b v̄_bᵀ` in f64) with its split form, and per 64 rows of a
//! query head the tail on the tensor cores and its merge into `O` and LSE in place (`pisa_tail_merge`). The tail is
//! the forward's recipe over the pooled problem: queries `[q | q]`, keys `[μ_hi | μ_lo]` (the mean key split into two
//! storage-type numbers, `μ_hi = RN(μ)`, `μ_lo = RN(μ − μ_hi)`, so that the scores carry the mean key to about
//! `u²` relative), values `RN(v̄_b)`, each row masked to its tail blocks; the shared term
//! `[q | q]·[H̄_hi ; H̄_lo]` on the tensor cores too. With the exact part's `(O_E, lse_E)` and the tail's average
//! `T = O_T + α h / C` and log-mass `lse_T + ln C`, the merge in f64 is
//! `o = (e^{lse_E − M} O_E + e^{lse_T + ln C − M} T) / (e^{lse_E − M} + e^{lse_T + ln C − M})`, `M` the larger log-mass.
//! A row without tail blocks keeps the forward's `O` and LSE bit for bit. The merged value is rounded once to the
//! storage type. `attnproof_harness::pisa_tail` holds the result to the forward's model over the pooled problem the
//! kernel actually ran (its storage-type statistics, read back) and the forward's bound of the exact part, carried
//! through the merge weights.
//!
//! # Memory
//!
//! Two caller-owned workspaces ([`TailWorkspace`]): f64 of [`workspace_len`] elements (mean keys `[B, Hkv, n_k, d]`,
//! mean values `[B, Hkv, n_k, dv]`, `H̄` `[B, Hkv, d, dv]`, `H̄`'s partial sums per range of [`HBAR_SPLIT_KEYS`] keys
//! `[ranges, B, Hkv, d, dv]`) and storage-type of [`pooled_len`] elements (split mean
//! keys `[B, Hkv, n_k, 2d]`, rounded mean values `[B, Hkv, n_k, dv]`, split `H̄` `[B, Hkv, 2d, dv]`). Nothing of size
//! `Lq × n_k` exists.

use std::sync::Arc;

use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Mask, Scale};
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::{Array4, ArrayViewD, Axis};

use crate::block_sparse::{BlockLists, ListHeads, block_sparse_forward_device};
use crate::common::{GpuElement, check_len, grid_3d, to_i32};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::flash::{ForwardOutput, forward_from_host};
use crate::launch;
use crate::params::{FlashParams, PisaTailParams};

/// `gpu/kernels/pisa_tail.cu` after the shared helpers and the block selector, whose block mean it reuses.
pub const PISA_TAIL: KernelSource = KernelSource {
    name: "pisa_tail",
    source: concat!(
        include_str!("../../kernels/common.cuh"),
        include_str!("../../kernels/bsa_select.cu"),
        include_str!("../../kernels/pisa_tail.cu")
    ),
};

/// Pooled keys (tail blocks) per tile of `pisa_tail_merge` (the kernel's `TAIL_N`): the KV tile of the tail's recipe.
pub const POOLED_KEYS_PER_TILE: usize = 64;
/// Rows per CTA and threads of `pisa_tail_merge` (the kernel's `TAIL_M`, `TAIL_THREADS`), and the tile edge and
/// threads of `pisa_tail_hbar`.
const TAIL_M: usize = 64;
const TAIL_THREADS: u32 = 128;
const TAIL_N: usize = POOLED_KEYS_PER_TILE;
const HBAR_TILE: usize = 64;
const HBAR_THREADS: u32 = 128;
/// Keys per partial sum of `H̄` (one CTA of `pisa_tail_hbar` per range of the sequence and tile; the kernel's
/// `HBAR_SPLIT_KEYS`), a multiple of both block sizes; and the threads of `pisa_tail_hbar_sum`.
pub const HBAR_SPLIT_KEYS: usize = 4096;
/// Keys per f32 sum of `pisa_tail_hbar`'s products (its pipeline stage, the kernel's `HBAR_KEYS`: two MMAs from zero,
/// then added in f64), which the verifier's tolerance for `H̄` takes.
pub const HBAR_F32_KEYS: usize = 32;
const HBAR_SUM_THREADS: usize = 128;
const MEANS_THREADS: u32 = 128;

/// A head dim rounded up to the tensor cores' k step of 16 (`HEAD_DIM_PAD`, `HEAD_DIM_V_PAD`): the layout of the
/// kernel's `[q | q]` and `[μ_hi | μ_lo]` halves, which the verifier's model follows.
pub fn head_dim_pad(d: usize) -> usize {
    d.div_ceil(16).max(1) * 16
}

/// The defines `pisa_tail.cu` is compiled with: the storage type and the padded head dims.
pub fn tail_defines<T: GpuElement>(spec: &AttentionSpec) -> Vec<String> {
    vec![
        T::DEFINE.to_owned(),
        format!("HEAD_DIM_PAD={}", head_dim_pad(spec.head_dim)),
        format!("HEAD_DIM_V_PAD={}", head_dim_pad(spec.head_dim_v)),
    ]
}

/// The exact part's lists: each list of `lists` with the key blocks the mask cuts for some row of its query block
/// added (bottom-right causal: the blocks holding a row's last visible key but not ending with it; none without a
/// mask) and the partial last block where a row of the query block sees a key of it, ascending and `−1`-padded, as
/// wide as the widest result needs. `lists` must be valid for `spec`.
pub fn exact_lists(spec: &AttentionSpec, lists: &BlockLists) -> Result<BlockLists, GpuError> {
    lists.validate(spec)?;
    let (batch, heads, query_blocks, width) = lists.lists.dim();
    let mut merged: Vec<Vec<i32>> = Vec::with_capacity(batch * heads * query_blocks);
    let seqs = spec.sequences();
    for seq in &seqs {
        for head in 0..heads {
            for a in 0..query_blocks {
                let mut entries: Vec<i32> = lists
                    .lists
                    .slice(ndarray::s![seq.index, head, a, ..])
                    .iter()
                    .copied()
                    .filter(|&b| b >= 0)
                    .collect();
                let rows = (a * lists.q_block)..((a + 1) * lists.q_block).min(seq.len_q);
                // The last key each row sees (none: no key), bottom-right causal or every key.
                let last_seen = |i: usize| match spec.mask {
                    Mask::Causal => (i + seq.len_k).checked_sub(seq.len_q),
                    _ => seq.len_k.checked_sub(1),
                };
                let partial = seq.len_k % lists.kv_block != 0;
                for i in rows {
                    let Some(last) = last_seen(i) else { continue };
                    let cut = last + 1 < seq.len_k && (last + 1) % lists.kv_block != 0;
                    let sees_partial = partial && last >= seq.len_k / lists.kv_block * lists.kv_block;
                    if cut || sees_partial {
                        entries.push(to_i32("key block", last / lists.kv_block)?);
                    }
                }
                entries.sort_unstable();
                entries.dedup();
                merged.push(entries);
            }
        }
    }
    let new_width = merged.iter().map(Vec::len).max().unwrap_or(0).max(width.min(1));
    let mut out = Array4::from_elem((batch, heads, query_blocks, new_width), -1i32);
    for (row, entries) in out.lanes_mut(Axis(3)).into_iter().zip(&merged) {
        let mut row = row;
        for (slot, &b) in entries.iter().enumerate() {
            row[slot] = b;
        }
    }
    Ok(BlockLists { q_block: lists.q_block, kv_block: lists.kv_block, heads: lists.heads, lists: out })
}

/// Key blocks of the longest sequence of `spec` in blocks of `kv_block` keys.
fn key_blocks(spec: &AttentionSpec, kv_block: usize) -> usize {
    spec.sequences().iter().map(|s| s.len_k.div_ceil(kv_block)).max().unwrap_or(0)
}

/// f64 elements of the workspace for `spec` with tail blocks of `kv_block` keys: mean keys and values per block of
/// the longest sequence, `H̄`, and `H̄`'s partial sums per range of [`HBAR_SPLIT_KEYS`] keys of the longest sequence,
/// per (sequence, KV head).
pub fn workspace_len(spec: &AttentionSpec, kv_block: usize) -> usize {
    let (d, dv) = (spec.head_dim, spec.head_dim_v);
    let per_head = key_blocks(spec, kv_block) * (d + dv) + (1 + hbar_splits(spec)) * d * dv;
    spec.sequences().len() * spec.n_heads_kv * per_head
}

/// Ranges of [`HBAR_SPLIT_KEYS`] keys of the longest sequence of `spec`: `H̄`'s partial sums per (sequence, KV head).
fn hbar_splits(spec: &AttentionSpec) -> usize {
    spec.sequences().iter().map(|s| s.len_k.div_ceil(HBAR_SPLIT_KEYS)).max().unwrap_or(0)
}

/// Storage-type elements of the pooled workspace for `spec` with tail blocks of `kv_block` keys: split mean keys
/// (`2d` each) and rounded mean values per block of the longest sequence, and the split `H̄` (`2d × dv`), per
/// (sequence, KV head).
pub fn pooled_len(spec: &AttentionSpec, kv_block: usize) -> usize {
    let (d, dv) = (spec.head_dim, spec.head_dim_v);
    let per_head = key_blocks(spec, kv_block) * (2 * d + dv) + 2 * d * dv;
    spec.sequences().len() * spec.n_heads_kv * per_head
}

/// The caller-owned workspaces of the tail: the f64 statistics ([`workspace_len`]) and their storage-type forms
/// ([`pooled_len`]), which the harness reads back to hold the tensor cores' work to the forward's model.
pub struct TailWorkspace<T> {
    /// Mean keys `[B, Hkv, n_k, d]`, mean values `[B, Hkv, n_k, dv]`, `H̄` `[B, Hkv, d, dv]` and its partial sums, f64.
    pub stats: CudaSlice<f64>,
    /// Split mean keys `[B, Hkv, n_k, 2d]` (`[μ_hi | μ_lo]`), rounded mean values `[B, Hkv, n_k, dv]`, split `H̄`
    /// `[B, Hkv, 2d, dv]` (`[H̄_hi ; H̄_lo]`).
    pub pooled: CudaSlice<T>,
}

impl<T: GpuElement> TailWorkspace<T> {
    /// Zeroed workspaces for `spec` with tail blocks of `kv_block` keys.
    pub fn alloc(stream: &Arc<CudaStream>, spec: &AttentionSpec, kv_block: usize) -> Result<Self, GpuError> {
        let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
        Ok(TailWorkspace {
            stats: stream.alloc_zeros::<f64>(workspace_len(spec, kv_block).max(1)).map_err(alloc_err)?,
            pooled: stream.alloc_zeros::<T>(pooled_len(spec, kv_block).max(1)).map_err(alloc_err)?,
        })
    }
}

/// Dynamic shared memory of `pisa_tail_merge`: the CTA's query rows (`HEAD_DIM_PAD + 8` elements, read twice as
/// `[q | q]`), a tile's `[μ_hi | μ_lo]` rows (`2·HEAD_DIM_PAD + 8`), a tile's mean values (`HEAD_DIM_V_PAD + 8`), and a
/// flag per key block.
fn merge_shared_bytes(head_dim: usize, head_dim_v: usize, key_blocks: usize) -> usize {
    let (d_pad, dv_pad) = (head_dim_pad(head_dim), head_dim_pad(head_dim_v));
    let bytes = 2 * (TAIL_M * (d_pad + 8) + TAIL_N * (2 * d_pad + 8) + TAIL_N * (dv_pad + 8)) + key_blocks;
    bytes.div_ceil(16) * 16
}

/// The kernels' scalars for `spec` and the exact part's `lists`, with the `cu_seqlens`.
fn plan(spec: &AttentionSpec, lists: &BlockLists) -> Result<(PisaTailParams, Vec<i32>, Vec<i32>), GpuError> {
    let causal = match spec.mask {
        Mask::None => 0,
        Mask::Causal => 1,
        _ => {
            return Err(GpuError::Unsupported {
                argument: "mask",
                reason: "PISA's tail takes no mask or the bottom-right causal mask".into(),
            });
        }
    };
    let (flash, cu_q, cu_k) = FlashParams::for_spec(spec)?;
    let seqs = spec.sequences();
    let key_blocks = lists.key_blocks(spec);
    let means = seqs.len() * spec.n_heads_kv * key_blocks;
    let too_large = |value| GpuError::TooLarge { argument: "workspace", value };
    let params = PisaTailParams {
        flash,
        scale: match spec.scale {
            Scale::InverseSqrtHeadDim => 1.0 / (spec.head_dim as f64).sqrt(),
            Scale::Value(x) => x,
        },
        value_means_at: i64::try_from(means * spec.head_dim).map_err(|_| too_large(means))?,
        hbar_at: i64::try_from(means * (spec.head_dim + spec.head_dim_v)).map_err(|_| too_large(means))?,
        hbar_partials_at: i64::try_from(
            means * (spec.head_dim + spec.head_dim_v) + seqs.len() * spec.n_heads_kv * spec.head_dim * spec.head_dim_v,
        )
        .map_err(|_| too_large(means))?,
        pooled_values_at: i64::try_from(means * 2 * spec.head_dim).map_err(|_| too_large(means))?,
        pooled_hbar_at: i64::try_from(means * (2 * spec.head_dim + spec.head_dim_v)).map_err(|_| too_large(means))?,
        // BlockLists::validate admits query blocks of 64 and 128 rows: whole CTAs of pisa_tail_merge's 64 rows.
        q_block: to_i32("q_block", lists.q_block)?,
        kv_block: to_i32("kv_block", lists.kv_block)?,
        causal,
        n_heads_kv: to_i32("n_heads_kv", spec.n_heads_kv)?,
        n_key_blocks: to_i32("key blocks", key_blocks)?,
        n_query_blocks: to_i32("query blocks", lists.query_blocks(spec))?,
        list_width: to_i32("list width", lists.lists.dim().3)?,
        lists_per_kv_head: i32::from(lists.heads == ListHeads::PerKvHead),
        hbar_splits: to_i32("H̄'s key ranges", hbar_splits(spec).max(1))?,
        reserved: 0,
    };
    Ok((params, cu_q, cu_k))
}

/// PISA's tail forward on device buffers (layouts as for [`crate::flash_forward_device`]): the block-sparse forward
/// over [`exact_lists`] of `lists` into `o` and `lse`, then the tail merged into them. `work` holds at least
/// [`workspace_len`] f64 and [`pooled_len`] storage-type elements (overwritten). Every check runs before the first
/// launch; the launches are asynchronous on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn pisa_tail_forward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    lists: &BlockLists,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    o: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
    work: &mut TailWorkspace<T>,
) -> Result<(), GpuError> {
    pisa_tail_forward_device_with(stream, spec, lists, PISA_TAIL, q, k, v, o, lse, work)
}

/// [`pisa_tail_forward_device`] with an explicit text of `pisa_tail.cu` (the tests launch patched copies through the
/// same checks).
#[allow(clippy::too_many_arguments)]
pub fn pisa_tail_forward_device_with<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    lists: &BlockLists,
    kernel: KernelSource,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    o: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
    work: &mut TailWorkspace<T>,
) -> Result<(), GpuError> {
    let plan = TailPlan::new(stream, spec, lists)?;
    pisa_tail_forward_planned(stream, &plan, kernel, q, k, v, o, lse, work)
}

/// What a tail forward needs from the lists, prepared once on the host and uploaded: the exact part's lists
/// ([`exact_lists`]), the kernels' scalars, and the device copies of the exact lists and the `cu_seqlens`. A caller
/// that runs the same lists again (a benchmark, a layer's heads over steps) passes it to
/// [`pisa_tail_forward_planned`] and pays the host work once.
pub struct TailPlan {
    pub(super) spec: AttentionSpec,
    pub(super) exact: BlockLists,
    pub(super) params: PisaTailParams,
    pub(super) device_lists: CudaSlice<i32>,
    pub(super) cu_q: CudaSlice<i32>,
    pub(super) cu_k: CudaSlice<i32>,
}

impl TailPlan {
    /// Validates `lists` for `spec`, forms the exact lists and uploads them.
    pub fn new(stream: &Arc<CudaStream>, spec: &AttentionSpec, lists: &BlockLists) -> Result<Self, GpuError> {
        let exact = exact_lists(spec, lists)?;
        let (params, cu_q, cu_k) = plan(spec, &exact)?;
        let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(pisa tail)", e));
        let device_lists = up(exact.lists.as_slice().expect("standard layout"))?;
        let (cu_q, cu_k) = (up(&cu_q)?, up(&cu_k)?);
        Ok(TailPlan { spec: spec.clone(), exact, params, device_lists, cu_q, cu_k })
    }

    /// The exact part's lists.
    pub fn exact_lists(&self) -> &BlockLists {
        &self.exact
    }
}

/// [`pisa_tail_forward_device_with`] over a prepared [`TailPlan`] (its spec and lists).
#[allow(clippy::too_many_arguments)]
pub fn pisa_tail_forward_planned<T: GpuElement>(
    stream: &Arc<CudaStream>,
    plan: &TailPlan,
    kernel: KernelSource,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    o: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
    work: &mut TailWorkspace<T>,
) -> Result<(), GpuError> {
    let (spec, exact, params) = (&plan.spec, &plan.exact, &plan.params);
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_len("work.stats", &work.stats, workspace_len(spec, exact.kv_block))?;
    check_len("work.pooled", &work.pooled, pooled_len(spec, exact.kv_block))?;
    for (name, buffer, op) in [("q", q, Operand::Q), ("k", k, Operand::K), ("v", v, Operand::V)] {
        check_len(name, buffer, size(op))?;
    }
    check_len("o", o, size(Operand::O))?;
    check_len("lse", lse, size(Operand::RowStat))?;
    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &tail_defines::<T>(spec))?;
    let merge = module
        .load_function("pisa_tail_merge")
        .map_err(|e| GpuError::driver("cuModuleGetFunction(pisa_tail.cu)", e))?;
    let shared = merge_shared_bytes(spec.head_dim, spec.head_dim_v, params.n_key_blocks as usize);
    compile::allow_shared_memory(ctx, &merge, shared, "head dims and key blocks")?;

    block_sparse_forward_device(stream, spec, exact, q, k, v, o, lse)?;
    launch_statistics(stream, plan, &module, k, v, work)?;
    let batch = spec.sequences().len();
    let query_rows = exact.query_blocks(spec) * exact.q_block;
    if batch == 0 || params.n_key_blocks == 0 {
        return Ok(());
    }
    let cfg = |grid: (u32, u32, u32), threads: u32, shared: usize| LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let (cu_q, cu_k) = (&plan.cu_q, &plan.cu_k);
    if query_rows == 0 {
        return Ok(());
    }
    let rows_grid = grid_3d(("rows", query_rows.div_ceil(TAIL_M)), ("heads", spec.n_heads_q), ("sequences", batch))?;
    launch::launch_pisa_tail_merge(
        stream,
        &merge,
        cfg(rows_grid, TAIL_THREADS, shared),
        (q, &work.pooled, &plan.device_lists),
        (o, lse),
        (cu_q, cu_k),
        params,
    )
}

/// The tail's statistics of `plan`'s problem into `work` (the f64 means, `H̄` and its partial sums, and their
/// storage-type forms), with the text `kernel` of `pisa_tail.cu`: what the forward's merge and the backward read. The
/// caller has checked the buffers' sizes. Nothing is launched without sequences or key blocks.
pub fn pisa_tail_statistics_planned<T: GpuElement>(
    stream: &Arc<CudaStream>,
    plan: &TailPlan,
    kernel: KernelSource,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    work: &mut TailWorkspace<T>,
) -> Result<(), GpuError> {
    let spec = &plan.spec;
    check_len("work.stats", &work.stats, workspace_len(spec, plan.exact.kv_block))?;
    check_len("work.pooled", &work.pooled, pooled_len(spec, plan.exact.kv_block))?;
    for (name, buffer, op) in [("k", k, Operand::K), ("v", v, Operand::V)] {
        check_len(name, buffer, spec.expected_shape(op).iter().product::<usize>())?;
    }
    let module = compile::module(stream.context(), kernel, &tail_defines::<T>(spec))?;
    launch_statistics(stream, plan, &module, k, v, work)
}

/// Launches `pisa_tail_means`, `pisa_tail_hbar` and `pisa_tail_hbar_sum` of `module` (the statistics are an output of
/// their own: the workspace holds them for every key block, queries or not).
fn launch_statistics<T: GpuElement>(
    stream: &Arc<CudaStream>,
    plan: &TailPlan,
    module: &Arc<cudarc::driver::CudaModule>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    work: &mut TailWorkspace<T>,
) -> Result<(), GpuError> {
    let (spec, params) = (&plan.spec, &plan.params);
    let batch = spec.sequences().len();
    let key_blocks = params.n_key_blocks as usize;
    if batch == 0 || key_blocks == 0 {
        return Ok(());
    }
    let load = |name: &'static str| {
        module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(pisa_tail.cu)", e))
    };
    let (means, hbar, hbar_sum) = (load("pisa_tail_means")?, load("pisa_tail_hbar")?, load("pisa_tail_hbar_sum")?);
    let cfg = |grid: (u32, u32, u32), threads: u32| LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let cu_k = &plan.cu_k;
    let blocks_grid = grid_3d(("key blocks", key_blocks), ("heads", spec.n_heads_kv), ("sequences", batch))?;
    let stats = (&mut work.stats, &mut work.pooled);
    launch::launch_pisa_tail_stats(stream, &means, cfg(blocks_grid, MEANS_THREADS), (k, v), stats, cu_k, params)?;
    let tiles = spec.head_dim.div_ceil(HBAR_TILE) * spec.head_dim_v.div_ceil(HBAR_TILE) * params.hbar_splits as usize;
    let tiles_grid = grid_3d(("tiles", tiles), ("heads", spec.n_heads_kv), ("sequences", batch))?;
    let stats = (&mut work.stats, &mut work.pooled);
    launch::launch_pisa_tail_stats(stream, &hbar, cfg(tiles_grid, HBAR_THREADS), (k, v), stats, cu_k, params)?;
    let elements = (spec.head_dim * spec.head_dim_v).div_ceil(HBAR_SUM_THREADS);
    let sum_grid = grid_3d(("elements", elements), ("heads", spec.n_heads_kv), ("sequences", batch))?;
    let stats = (&mut work.stats, &mut work.pooled);
    let sum_cfg = cfg(sum_grid, HBAR_SUM_THREADS as u32);
    launch::launch_pisa_tail_stats(stream, &hbar_sum, sum_cfg, (k, v), stats, cu_k, params)
}

/// PISA's tail forward from host tensors, returning host outputs (copies in, launches, copies out, synchronizes).
pub fn pisa_tail_forward<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    lists: &BlockLists,
    q: ArrayViewD<'_, T>,
    k: ArrayViewD<'_, T>,
    v: ArrayViewD<'_, T>,
) -> Result<ForwardOutput<T>, GpuError> {
    let exact = exact_lists(spec, lists)?;
    plan(spec, &exact)?;
    let mut work = TailWorkspace::alloc(stream, spec, lists.kv_block)?;
    forward_from_host(stream, spec, [q, k, v], |[dq, dk, dv], o, lse| {
        pisa_tail_forward_device(stream, spec, lists, dq, dk, dv, o, lse, &mut work)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::Layout;

    fn lists(spec: &AttentionSpec, q_block: usize, kv_block: usize, entries: &[&[i32]]) -> BlockLists {
        let width = entries.iter().map(|e| e.len()).max().unwrap_or(0);
        let mut a = Array4::from_elem((1, spec.n_heads_kv, entries.len(), width), -1);
        for (qb, e) in entries.iter().enumerate() {
            for (slot, &b) in e.iter().enumerate() {
                a[[0, 0, qb, slot]] = b;
            }
        }
        BlockLists { q_block, kv_block, heads: ListHeads::PerKvHead, lists: a }
    }

    #[test]
    fn exact_lists_add_the_blocks_the_mask_cuts() {
        // Lq = 128, Lk = 200: rows see keys up to row + 72; 64-key blocks end at 63, 127, 191, 199.
        let spec = AttentionSpec::dense(1, 1, 1, 128, 200, 8, 8).with_mask(Mask::Causal);
        let given = lists(&spec, 64, 64, &[&[0], &[]]);
        let exact = exact_lists(&spec, &given).unwrap();
        // Query block 0 (rows 0..63, last keys 72..135): cut blocks 1 (keys 64..127 for last 72..126) and 2 (128..135).
        // Query block 1 (rows 64..127, last keys 136..199): block 2 cut for 136..190; 3 (192..199, partial) cut for
        // 192..198 and seen whole by row 127.
        assert_eq!(
            exact
                .lists
                .index_axis(Axis(0), 0)
                .index_axis(Axis(0), 0)
                .outer_iter()
                .map(|l| l.to_vec())
                .collect::<Vec<_>>(),
            [vec![0, 1, 2], vec![2, 3, -1]]
        );
        // Without a mask nothing is cut, and every query block sees the partial last block 3 whole.
        let none = spec.clone().with_mask(Mask::None);
        let rows = |l: &BlockLists| -> Vec<Vec<i32>> {
            l.lists.index_axis(Axis(0), 0).index_axis(Axis(0), 0).outer_iter().map(|l| l.to_vec()).collect()
        };
        assert_eq!(rows(&exact_lists(&none, &given).unwrap()), [vec![0, 3], vec![3, -1]]);
        // Whole blocks only: the lists stand as given.
        let whole = AttentionSpec::dense(1, 1, 1, 128, 192, 8, 8);
        assert_eq!(exact_lists(&whole, &given).unwrap().lists, given.lists);
        // Causal, Lq > Lk: the first rows see no key and add nothing; a partial block the rows only cut is added once.
        let tall = AttentionSpec::dense(1, 1, 1, 128, 100, 8, 8).with_mask(Mask::Causal);
        let given = lists(&tall, 64, 64, &[&[], &[]]);
        // Rows 28..63 see keys up to 0..35 (block 0 cut); rows 64..127 see 36..99: block 0 cut to 63, block 1 (64..99,
        // partial) cut and then seen whole by row 127.
        assert_eq!(rows(&exact_lists(&tall, &given).unwrap()), [vec![0, -1], vec![0, 1]]);
    }

    /// The host's launch constants are the kernel text's: the H̄ tile, its threads, its key ranges and the merge's.
    #[test]
    fn the_launch_constants_are_the_kernels() {
        let define = |name: &str| crate::common::numeric_define(PISA_TAIL.source, name);
        assert_eq!(define("HBAR_TILE"), HBAR_TILE);
        assert_eq!(define("HBAR_THREADS"), HBAR_THREADS as usize);
        assert_eq!(define("HBAR_SPLIT_KEYS"), HBAR_SPLIT_KEYS);
        assert_eq!(define("HBAR_KEYS"), HBAR_F32_KEYS);
        assert_eq!(define("HBAR_SUM_THREADS"), HBAR_SUM_THREADS);
        assert_eq!(define("TAIL_N"), TAIL_N);
        assert!(HBAR_SPLIT_KEYS.is_multiple_of(128) && HBAR_SPLIT_KEYS.is_multiple_of(define("HBAR_KEYS")));
    }

    #[test]
    fn the_workspace_and_the_shared_memory_are_spelled_out() {
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 10, 30], cu_seqlens_k: vec![0, 130, 140] },
            ..AttentionSpec::dense(1, 4, 2, 1, 1, 64, 32)
        };
        // One range of H̄'s partial sums (140 keys), then three (8193 keys).
        assert_eq!(workspace_len(&spec, 64), 2 * 2 * (3 * (64 + 32) + 2 * 64 * 32));
        let long = AttentionSpec::dense(1, 4, 2, 1, 8193, 64, 32);
        assert_eq!(workspace_len(&long, 128), 2 * (65 * (64 + 32) + 4 * 64 * 32));
        assert_eq!(pooled_len(&spec, 64), 2 * 2 * (3 * (128 + 32) + 128 * 32));
        assert_eq!(merge_shared_bytes(64, 32, 3), (2 * (64 * 72 + 64 * 136 + 64 * 40) + 3usize).div_ceil(16) * 16);
        assert_eq!(merge_shared_bytes(72, 8, 1), (2 * (64 * 88 + 64 * 168 + 64 * 24) + 1usize).div_ceil(16) * 16);
        assert!(merge_shared_bytes(256, 256, 4096) <= 227 * 1024);
        assert_eq!(tail_defines::<half::bf16>(&spec), ["ELEM_BF16", "HEAD_DIM_PAD=64", "HEAD_DIM_V_PAD=32"]);
    }

    #[test]
    fn masks_other_than_causal_are_refused() {
        let spec = AttentionSpec::dense(1, 1, 1, 64, 64, 8, 8).with_mask(Mask::Window { left: 4, right: 0 });
        let given = lists(&spec, 64, 64, &[&[0]]);
        assert!(matches!(plan(&spec, &given), Err(GpuError::Unsupported { argument: "mask", .. })));
    }
}
