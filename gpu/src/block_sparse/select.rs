//! Block selection on the GPU (BSA: E15 pooling feeding E14 lists): `gpu/kernels/bsa_select.cu` behind typed
//! wrappers, from device buffers ([`select_blocks_device`]) or host tensors ([`select_blocks`]).
//!
//! The rule is the oracle's (`attnproof_oracle::bsa`, whose [`BsaConfig`] this takes): mean-pooled keys per key
//! block, mean-pooled queries per query block, their scaled dot product summed over each KV head's GQA group, causal
//! (bottom-right) or no-mask eligibility, forced first and local blocks, top-k with ties to the lower index; the
//! lists are per KV head, `[B, Hkv, ⌈max Lq / q_block⌉, top_k]`, ascending and `−1`-padded, ready for
//! [`crate::block_sparse::block_sparse_forward`] as [`ListHeads::PerKvHead`] lists.
//!
//! # Precision and exactness
//!
//! Every score is an f64 evaluation in a fixed order (the kernel's header spells it out), so key blocks with bitwise
//! equal keys score bitwise equal and tie exactly, as in the oracle; scores of different blocks are within the bound
//! of `attnproof_proofs::bsa_bound` of their exact values (twice that of the oracle's f64 scores). The lists are
//! integers: `attnproof_harness::block_selection` compares them with the oracle's entry for entry wherever that
//! bound cannot move the top-k boundary.
//!
//! # Memory and kernels
//!
//! Lists up to [`STREAM_MAX_TOP_K`] wide (the common case: top-8, top-16) come from `bsa_select_stream`: one CTA per
//! 8 query blocks of a (KV head, sequence) reads each eligible pooled key block once into a shared-memory tile for all
//! 8 and keeps, per query block, a running list of its best candidates in a warp's registers; no score outlives its
//! tile. Wider lists come from `bsa_select`: one CTA per (query block, KV head, sequence) holds that query block's
//! scores in shared memory (8 bytes and a flag per key block, beside the group's summed pooled query) and never more:
//! at 256K keys and 128-key blocks that is 2048 scores. Both choose the same lists (the top-k of a total order), and
//! the property suites draw widths on both sides of the limit. The pooled keys and queries go to a caller-owned f64
//! workspace of [`workspace_len`] elements.
//!
//! # Schedule
//!
//! The query pooling reads all of Q once and is bound by memory bandwidth; the selection reads only pooled vectors
//! and is bound by the latency of its shared-memory loads. [`SelectSchedule::Chunks`] pools and selects the query
//! blocks in ranges, the last range first, each range's selection on a second stream of the highest priority behind
//! an event of that range's pooling, so that the two kinds of work could share the multiprocessors; the second stream
//! is joined back into the caller's before the call returns. A pooling launch with a CTA per (block, head, sequence)
//! fills every multiprocessor's registers, so in those schedules the query pooling runs a few CTAs per SM
//! ([`OVERLAP_POOL_CTAS_PER_SM`]) that stride over the items, leaving room for the selection's CTAs beside them. The
//! first measurement (docs/gpu-performance.md, "overlapped on two streams", before the cap) was slower than the serial
//! schedule, so the default, [`SelectSchedule::Serial`], runs every launch on the caller's stream in order. The lists
//! are the same bits under every schedule (each query block is computed by the same arithmetic), which the property
//! suites check by running each draw under its drawn schedule and under the serial one.

use std::sync::Arc;

use attnproof_oracle::bsa::BsaConfig;
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Mask, Scale};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use ndarray::{Array4, ArrayViewD};

use super::{BLOCK_SIZES, BlockLists, ListHeads};
use crate::common::{GpuElement, check_len, grid_3d, multiprocessors, to_i32};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::flash::host_input;
use crate::launch;
use crate::params::{BsaParams, FlashParams};

/// `gpu/kernels/bsa_select.cu` after the shared helpers.
pub const BSA_SELECT: KernelSource = KernelSource {
    name: "bsa_select",
    source: concat!(include_str!("../../kernels/common.cuh"), include_str!("../../kernels/bsa_select.cu")),
};

/// Threads per CTA of the pooling kernels and of `bsa_select` (the kernel's `POOL_THREADS`, `SEL_THREADS`).
pub(crate) const POOL_THREADS: u32 = 128;
const SELECT_THREADS: u32 = 256;

/// The widest list `bsa_select_stream` builds (its `STREAM_MAX_TOP_K`: one candidate per lane of a warp); wider lists
/// go to `bsa_select`, which holds a query block's scores.
pub const STREAM_MAX_TOP_K: usize = 32;
/// `bsa_select_stream`'s threads, query blocks per CTA, key blocks per tile and row padding (f64), as in the kernel.
const STREAM_THREADS: u32 = 256;
const STREAM_QUERIES: usize = 8;
const STREAM_KEYS: usize = 64;
const STREAM_PAD: usize = 2;

/// The selection kernel a plan launches: its entry, query blocks per CTA, the threads per CTA and the dynamic shared
/// memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SelectLaunch {
    pub(crate) entry: &'static str,
    pub(crate) queries_per_cta: usize,
    pub(crate) threads: u32,
    pub(crate) shared_bytes: usize,
}

impl SelectLaunch {
    /// `bsa_select_stream` for lists up to [`STREAM_MAX_TOP_K`] wide (the query and key tiles and one tile's scores in
    /// shared memory), else `bsa_select` (a query block's summed pooled query, its scores and a flag per key block).
    pub(crate) fn of(plan: &Plan, head_dim: usize, top_k: usize) -> SelectLaunch {
        if top_k <= STREAM_MAX_TOP_K {
            let row = head_dim + STREAM_PAD;
            SelectLaunch {
                entry: "bsa_select_stream",
                queries_per_cta: STREAM_QUERIES,
                threads: STREAM_THREADS,
                shared_bytes: 8 * ((STREAM_QUERIES + STREAM_KEYS) * row + STREAM_QUERIES * STREAM_KEYS),
            }
        } else {
            let bytes = (head_dim + plan.key_blocks) * 8 + plan.key_blocks;
            SelectLaunch {
                entry: "bsa_select",
                queries_per_cta: 1,
                threads: SELECT_THREADS,
                shared_bytes: bytes.div_ceil(16) * 16,
            }
        }
    }

    /// The grid's x extent for `query_blocks` query blocks.
    pub(crate) fn grid_x(&self, query_blocks: usize) -> usize {
        query_blocks.div_ceil(self.queries_per_cta)
    }
}

/// Everything a launch needs, derived from a validated spec and configuration (PISA's pyramid selector,
/// `crate::pisa::select`, builds on it: its leaves are these key blocks).
pub(crate) struct Plan {
    pub(crate) params: BsaParams,
    pub(crate) cu_q: Vec<i32>,
    pub(crate) cu_k: Vec<i32>,
    pub(crate) batch: usize,
    pub(crate) query_blocks: usize,
    pub(crate) key_blocks: usize,
}

/// The plan of BSA's own lists: [`plan`] and lists no wider than the longest sequence's key blocks.
pub(crate) fn plan_lists(spec: &AttentionSpec, config: &BsaConfig) -> Result<Plan, GpuError> {
    let plan = plan(spec, config)?;
    if config.top_k > plan.key_blocks {
        return Err(GpuError::Unsupported {
            argument: "top_k",
            reason: format!("{} is more than the {} key blocks of the longest sequence", config.top_k, plan.key_blocks),
        });
    }
    Ok(plan)
}

/// The blocks, the kernels' scalars and the `cu_seqlens` of `spec` under `config` (the width is not checked against
/// the key blocks here: the pyramid checks its own, the diagnostics have none).
pub(crate) fn plan(spec: &AttentionSpec, config: &BsaConfig) -> Result<Plan, GpuError> {
    config.validate()?;
    let (flash, cu_q, cu_k) = FlashParams::for_spec(spec)?;
    let causal = match spec.mask {
        Mask::None => false,
        Mask::Causal => true,
        _ => {
            return Err(GpuError::Unsupported {
                argument: "mask",
                reason: "block selection takes no mask or the causal mask".into(),
            });
        }
    };
    for (argument, size) in [("q_block", config.q_block), ("kv_block", config.kv_block)] {
        if !BLOCK_SIZES.contains(&size) {
            return Err(GpuError::Unsupported { argument, reason: format!("{size} is not one of {BLOCK_SIZES:?}") });
        }
    }
    let seqs = spec.sequences();
    let query_blocks = seqs.iter().map(|s| config.query_blocks(s)).max().unwrap_or(0);
    let key_blocks = seqs.iter().map(|s| config.key_blocks(s)).max().unwrap_or(0);
    let scale = match spec.scale {
        Scale::InverseSqrtHeadDim => 1.0 / (spec.head_dim as f64).sqrt(),
        Scale::Value(x) => x,
    };
    let params = BsaParams {
        flash,
        scale,
        q_block: to_i32("q_block", config.q_block)?,
        kv_block: to_i32("kv_block", config.kv_block)?,
        top_k: to_i32("top_k", config.top_k)?,
        force_first: i32::from(config.force_first),
        force_local: to_i32("force_local", config.force_local)?,
        causal: i32::from(causal),
        n_heads_kv: to_i32("n_heads_kv", spec.n_heads_kv)?,
        n_key_blocks: to_i32("key blocks", key_blocks)?,
        pooled_queries_at: i64::try_from(seqs.len() * spec.n_heads_kv * key_blocks * spec.head_dim)
            .map_err(|_| GpuError::TooLarge { argument: "pooled keys", value: key_blocks })?,
        n_query_blocks: to_i32("query blocks", query_blocks)?,
        first_query_block: 0,
    };
    Ok(Plan { params, cu_q, cu_k, batch: seqs.len(), query_blocks, key_blocks })
}

/// f64 elements of the workspace for `spec` and `config`: the pooled keys, `B · Hkv · (key blocks of the longest
/// sequence) · d`, then the pooled queries, `B · Hq · (query blocks of the longest sequence) · d`.
pub fn workspace_len(spec: &AttentionSpec, config: &BsaConfig) -> usize {
    // PISA's workspace starts with this one (`crate::pisa::select::workspace_len`).
    let seqs = spec.sequences();
    let key_blocks = seqs.iter().map(|s| config.key_blocks(s)).max().unwrap_or(0);
    let query_blocks = seqs.iter().map(|s| config.query_blocks(s)).max().unwrap_or(0);
    seqs.len() * spec.head_dim * (spec.n_heads_kv * key_blocks + spec.n_heads_q * query_blocks)
}

/// The lists' shape: `[B, Hkv, ⌈max Lq / q_block⌉, top_k]`.
pub fn lists_shape(spec: &AttentionSpec, config: &BsaConfig) -> [usize; 4] {
    let query_blocks = spec.sequences().iter().map(|s| config.query_blocks(s)).max().unwrap_or(0);
    [spec.sequences().len(), spec.n_heads_kv, query_blocks, config.top_k]
}

pub(crate) fn grid(x: usize, y: usize, z: usize) -> Result<(u32, u32, u32), GpuError> {
    grid_3d(("blocks", x), ("heads", y), ("sequences", z))
}

/// How [`select_blocks_device_scheduled`] orders its launches. The lists do not depend on it: every query block is
/// pooled and selected by the same arithmetic whichever launch covers it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SelectSchedule {
    /// Every launch on the caller's stream, in order (the same as one chunk).
    #[default]
    Serial,
    /// The query blocks in this many ranges of about equal size (in units of the streaming selector's 8 query blocks;
    /// fewer ranges when there are fewer units), the last range first. Each range's queries are pooled on the
    /// caller's stream and selected on a second stream of the highest priority, behind an event of that pooling, so
    /// that one range's selection runs while the next range's queries are pooled: the query pooling reads all of Q
    /// and is bound by memory bandwidth, the selection by the latency of its shared-memory loads, and the two share
    /// the multiprocessors. The last query blocks go first because under the causal mask they see the most key
    /// blocks. One chunk runs every launch on the caller's stream, in order (the pooling's grid still capped as
    /// below). Zero is a typed error. The query pooling's grid is capped at [`OVERLAP_POOL_CTAS_PER_SM`] CTAs per
    /// multiprocessor, each striding over the (block, head, sequence) items, so that the selection's CTAs find room.
    Chunks(usize),
    /// [`SelectSchedule::Chunks`]`(chunks)` with the query pooling's grid capped at `pool_ctas` CTAs in all: the
    /// property suites draw small grids, so that every pooling CTA takes several items. Zero of either is a typed
    /// error.
    ChunksPooledBy {
        /// The ranges, as in [`SelectSchedule::Chunks`].
        chunks: usize,
        /// The query pooling's CTAs in all, per launch.
        pool_ctas: usize,
    },
}

impl SelectSchedule {
    /// The query-block ranges of `plan` (at least 1, at most the 8-block units), the last first; zero chunks or zero
    /// pooling CTAs are a typed error (this is the schedule's one check, before any launch).
    fn ranges(self, plan: &Plan) -> Result<Vec<(usize, usize)>, GpuError> {
        let chunks = match self {
            SelectSchedule::Serial => 1,
            SelectSchedule::Chunks(n) | SelectSchedule::ChunksPooledBy { chunks: n, .. } => n,
        };
        let refuse = |reason: &str| Err(GpuError::Unsupported { argument: "schedule", reason: reason.into() });
        if chunks == 0 {
            return refuse("zero chunks");
        }
        if matches!(self, SelectSchedule::ChunksPooledBy { pool_ctas: 0, .. }) {
            return refuse("zero pooling CTAs");
        }
        Ok(query_ranges(plan.query_blocks, chunks))
    }

    /// The most CTAs of a query pooling launch on a device of `multiprocessors` SMs (`usize::MAX`: one per item).
    fn pool_ctas(self, multiprocessors: usize) -> usize {
        match self {
            SelectSchedule::Serial => usize::MAX,
            SelectSchedule::Chunks(_) => OVERLAP_POOL_CTAS_PER_SM * multiprocessors,
            SelectSchedule::ChunksPooledBy { pool_ctas, .. } => pool_ctas,
        }
    }
}

/// `query_blocks` split into at most `chunks` ranges `[from, to)` whose starts are multiples of the streaming
/// selector's 8 query blocks, the last range first; none when there are no query blocks.
fn query_ranges(query_blocks: usize, chunks: usize) -> Vec<(usize, usize)> {
    let units = query_blocks.div_ceil(STREAM_QUERIES);
    let n = chunks.clamp(1, units.max(1));
    (0..n)
        .rev()
        .map(|i| (i * units / n * STREAM_QUERIES, ((i + 1) * units / n * STREAM_QUERIES).min(query_blocks)))
        .filter(|(from, to)| from < to)
        .collect()
}

/// Selects the blocks of `spec` under `config` on device buffers: `q`, `k` hold Q and K in the spec's layout,
/// `pooled` at least [`workspace_len`] f64 (overwritten), and the lists go to the first [`lists_shape`] elements of
/// `lists`. Every check runs before the first launch; the launches are asynchronous on `stream`, in the serial
/// schedule.
#[allow(clippy::too_many_arguments)]
pub fn select_blocks_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &BsaConfig,
    kernel: KernelSource,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    pooled: &mut CudaSlice<f64>,
    lists: &mut CudaSlice<i32>,
) -> Result<(), GpuError> {
    select_blocks_device_scheduled(stream, spec, config, kernel, (q, k), pooled, lists, SelectSchedule::Serial)
}

/// [`select_blocks_device`] under `schedule`. When it overlaps, the work on `stream` after this call waits for all of
/// it (the second stream is joined back into `stream`).
#[allow(clippy::too_many_arguments)]
pub fn select_blocks_device_scheduled<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &BsaConfig,
    kernel: KernelSource,
    (q, k): (&CudaSlice<T>, &CudaSlice<T>),
    pooled: &mut CudaSlice<f64>,
    lists: &mut CudaSlice<i32>,
    schedule: SelectSchedule,
) -> Result<(), GpuError> {
    let plan = plan_lists(spec, config)?;
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_len("q", q, size(Operand::Q))?;
    check_len("k", k, size(Operand::K))?;
    check_len("pooled", pooled, workspace_len(spec, config))?;
    check_len("lists", lists, lists_shape(spec, config).iter().product())?;
    let ranges = schedule.ranges(&plan)?;
    if plan.query_blocks == 0 || plan.batch == 0 || spec.n_heads_kv == 0 {
        return Ok(());
    }
    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &[T::DEFINE.to_owned()])?;
    let load = |name: &'static str| {
        module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(bsa_select.cu)", e))
    };
    let selector = SelectLaunch::of(&plan, spec.head_dim, config.top_k);
    let (pool_keys, pool_queries, select) = (load("bsa_pool_keys")?, load("bsa_pool_queries")?, load(selector.entry)?);
    compile::allow_shared_memory(ctx, &select, selector.shared_bytes, "key blocks")?;
    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e));
    let (cu_q, cu_k) = (up(&plan.cu_q)?, up(&plan.cu_k)?);
    // The launches take the buffers' addresses, taken once here on `stream`: passed as slices, cudarc would order
    // their use across the two streams itself, and a range's pooling (which writes the workspace) would wait for the
    // previous range's selection (which reads it). The guards record the buffers' use on `stream` when they drop,
    // after the second stream has been joined into it.
    let (q_at, _q_use) = q.device_ptr(stream);
    let (k_at, _k_use) = k.device_ptr(stream);
    let (cu_q_at, _cu_q_use) = cu_q.device_ptr(stream);
    let (cu_k_at, _cu_k_use) = cu_k.device_ptr(stream);
    let (pooled_at, _pooled_use) = pooled.device_ptr_mut(stream);
    let (lists_at, _lists_use) = lists.device_ptr_mut(stream);
    let keys = Pooling { func: &pool_keys, x: k_at, cu: cu_k_at, heads: spec.n_heads_kv, max_ctas: usize::MAX };
    keys.launch(stream, &plan, pooled_at, (0, plan.key_blocks))?;
    let side = if ranges.len() > 1 { Some(selection_stream(stream)?) } else { None };
    // Overlapped, the query pooling keeps a few CTAs per multiprocessor that stride over its items, so that the
    // selection's CTAs of the previous range find room beside them (a CTA per item would fill every SM's registers).
    let max_ctas = schedule.pool_ctas(multiprocessors(ctx)?);
    let queries = Pooling { func: &pool_queries, x: q_at, cu: cu_q_at, heads: spec.n_heads_q, max_ctas };
    for (from, to) in ranges {
        queries.launch(stream, &plan, pooled_at, (from, to))?;
        let on = match &side {
            Some(side) => {
                let pooled = stream.record_event(None).map_err(|e| GpuError::driver("cuEventRecord", e))?;
                side.wait(&pooled).map_err(|e| GpuError::driver("cuStreamWaitEvent", e))?;
                side
            }
            None => stream,
        };
        let cfg = LaunchConfig {
            grid_dim: grid(selector.grid_x(to - from), spec.n_heads_kv, plan.batch)?,
            block_dim: (selector.threads, 1, 1),
            shared_mem_bytes: selector.shared_bytes as u32,
        };
        let params = BsaParams { first_query_block: to_i32("query block", from)?, ..plan.params };
        launch::launch_bsa_select(on, &select, cfg, (pooled_at, lists_at), (cu_q_at, cu_k_at), &params)?;
    }
    if let Some(side) = side {
        stream.join(&side).map_err(|e| GpuError::driver("cuStreamWaitEvent", e))?;
    }
    Ok(())
}

/// A second stream for the selection launches of an overlapped schedule, at the device's highest priority (so that a
/// range's selection CTAs are dispatched ahead of the pooling CTAs still queued), after the work already on `stream`.
fn selection_stream(stream: &Arc<CudaStream>) -> Result<Arc<CudaStream>, GpuError> {
    let ctx = stream.context();
    ctx.bind_to_thread().map_err(|e| GpuError::driver("cuCtxSetCurrent", e))?;
    let (_, greatest) = cudarc::driver::result::stream::get_priority_range()
        .map_err(|e| GpuError::driver("cuCtxGetStreamPriorityRange", e))?;
    let side = ctx.new_stream_with_priority(greatest).map_err(|e| GpuError::driver("cuStreamCreateWithPriority", e))?;
    side.join(stream).map_err(|e| GpuError::driver("cuStreamWaitEvent", e))?;
    Ok(side)
}

/// One of the two pooling launches: the kernel, the pooled tensor's address and its `cu_seqlens`, its heads, and the
/// most CTAs a launch may have (`usize::MAX`: one per (block, head, sequence)).
struct Pooling<'a> {
    func: &'a CudaFunction,
    x: u64,
    cu: u64,
    heads: usize,
    max_ctas: usize,
}

impl Pooling<'_> {
    /// Pools the blocks `[from, to)` (of the queries; the keys' pooling takes all of them) into the workspace at
    /// `pooled`; nothing for an empty range.
    fn launch(
        &self,
        stream: &CudaStream,
        plan: &Plan,
        pooled: u64,
        (from, to): (usize, usize),
    ) -> Result<(), GpuError> {
        let items = (to.saturating_sub(from)).saturating_mul(self.heads).saturating_mul(plan.batch);
        if items == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: grid(items.min(self.max_ctas), 1, 1)?,
            block_dim: (POOL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let params = BsaParams { first_query_block: to_i32("query block", from)?, ..plan.params };
        let counts = (to_i32("blocks", to - from)?, to_i32("heads", self.heads)?, to_i32("sequences", plan.batch)?);
        launch::launch_bsa_pool(stream, self.func, cfg, (self.x, pooled), self.cu, &params, counts)
    }
}

/// Pooling CTAs per multiprocessor in an overlapped schedule: with 44 registers a thread (48 as allocated) and 9 KB of
/// shared memory each, six take 36,864 registers and 54 KB, which leaves two `bsa_select_stream` CTAs (256 threads of
/// 40 registers, 79 KB at d = 128) room beside them on an SM of 65,536 registers and 228 KB; in the serial schedule
/// the pooling takes one CTA per item, as many as fit (ten, by registers).
pub const OVERLAP_POOL_CTAS_PER_SM: usize = 6;

/// Launches `bsa_pool_keys` and `bsa_pool_queries` of `plan` on `stream`: the key blocks' and the query blocks' mean
/// vectors into the start of `pooled` (at least [`workspace_len`] f64), as both selectors read them (each only where
/// there are such blocks: E24's spreads read the mean keys of problems without queries).
pub(crate) fn launch_pooling<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    plan: &Plan,
    (pool_keys, pool_queries): (&CudaFunction, &CudaFunction),
    (q, k): (&CudaSlice<T>, &CudaSlice<T>),
    pooled: &mut CudaSlice<f64>,
    (cu_q, cu_k): (&CudaSlice<i32>, &CudaSlice<i32>),
) -> Result<(), GpuError> {
    let (q_at, _q_use) = q.device_ptr(stream);
    let (k_at, _k_use) = k.device_ptr(stream);
    let (cu_q_at, _cu_q_use) = cu_q.device_ptr(stream);
    let (cu_k_at, _cu_k_use) = cu_k.device_ptr(stream);
    let (pooled_at, _pooled_use) = pooled.device_ptr_mut(stream);
    let keys = Pooling { func: pool_keys, x: k_at, cu: cu_k_at, heads: spec.n_heads_kv, max_ctas: usize::MAX };
    keys.launch(stream, plan, pooled_at, (0, plan.key_blocks))?;
    let queries = Pooling { func: pool_queries, x: q_at, cu: cu_q_at, heads: spec.n_heads_q, max_ctas: usize::MAX };
    queries.launch(stream, plan, pooled_at, (0, plan.query_blocks))
}

/// Q and K of `spec` from host tensors (checked against the spec's shapes) into new device buffers: the first step of
/// both selectors' host wrappers.
pub(crate) fn upload_queries_and_keys<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    q: ArrayViewD<'_, T>,
    k: ArrayViewD<'_, T>,
) -> Result<(CudaSlice<T>, CudaSlice<T>), GpuError> {
    let (hq, hk) = (host_input(spec, "q", Operand::Q, &q)?, host_input(spec, "k", Operand::K, &k)?);
    let up = |data: &[T]| stream.clone_htod(data).map_err(|e| GpuError::driver("cuMemcpyHtoD", e));
    Ok((up(hq)?, up(hk)?))
}

/// Selects the blocks from host tensors (copies in, launches, copies out, synchronizes) and returns them as lists per
/// KV head, ready for the block-sparse forward.
pub fn select_blocks<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &BsaConfig,
    q: ArrayViewD<'_, T>,
    k: ArrayViewD<'_, T>,
) -> Result<BlockLists, GpuError> {
    spec.validate()?;
    plan_lists(spec, config)?;
    let (dq, dk) = upload_queries_and_keys(stream, spec, q, k)?;
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let mut pooled = stream.alloc_zeros::<f64>(workspace_len(spec, config).max(1)).map_err(alloc_err)?;
    let shape = lists_shape(spec, config);
    let mut lists = stream.alloc_zeros::<i32>(shape.iter().product::<usize>().max(1)).map_err(alloc_err)?;
    select_blocks_device(stream, spec, config, BSA_SELECT, &dq, &dk, &mut pooled, &mut lists)?;
    let mut host = stream.clone_dtoh(&lists).map_err(|e| GpuError::driver("cuMemcpyDtoH", e))?;
    stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
    host.truncate(shape.iter().product());
    let lists = Array4::from_shape_vec(shape, host).expect("length matches the shape");
    Ok(BlockLists { q_block: config.q_block, kv_block: config.kv_block, heads: ListHeads::PerKvHead, lists })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::Layout;

    fn config(top_k: usize) -> BsaConfig {
        BsaConfig { q_block: 64, kv_block: 128, top_k, force_first: true, force_local: 1 }
    }

    #[test]
    fn plans_check_the_mask_block_sizes_and_width() {
        let spec = AttentionSpec::dense(2, 4, 2, 200, 300, 64, 64).with_mask(Mask::Causal);
        let p = plan(&spec, &config(3)).unwrap();
        assert_eq!((p.query_blocks, p.key_blocks, p.batch), (4, 3, 2));
        assert_eq!(p.params.causal, 1);
        assert_eq!(p.params.scale, 0.125);
        assert_eq!((p.params.n_heads_kv, p.params.n_key_blocks, p.params.top_k), (2, 3, 3));
        assert_eq!(p.params.n_query_blocks, 4);
        let stream = SelectLaunch::of(&p, 64, 3);
        assert_eq!((stream.entry, stream.grid_x(p.query_blocks), stream.threads), ("bsa_select_stream", 1, 256));
        assert_eq!(stream.shared_bytes, 8 * (72 * 66 + 8 * 64));
        let rounds = SelectLaunch::of(&p, 64, STREAM_MAX_TOP_K + 1);
        assert_eq!((rounds.entry, rounds.grid_x(p.query_blocks), rounds.threads), ("bsa_select", 4, 256));
        assert_eq!(rounds.shared_bytes, ((64 + 3) * 8 + 3usize).div_ceil(16) * 16);
        assert_eq!(lists_shape(&spec, &config(3)), [2, 2, 4, 3]);
        assert_eq!(workspace_len(&spec, &config(3)), 2 * 64 * (2 * 3 + 4 * 4));
        assert_eq!(p.params.pooled_queries_at, 2 * 2 * 3 * 64);
        assert!(matches!(plan_lists(&spec, &config(4)), Err(GpuError::Unsupported { argument: "top_k", .. })));
        assert!(plan(&spec, &config(4)).is_ok(), "the pyramid and the diagnostics check their own widths");
        let window = spec.clone().with_mask(Mask::Window { left: 3, right: 0 });
        assert!(matches!(plan(&window, &config(2)), Err(GpuError::Unsupported { argument: "mask", .. })));
        let odd = BsaConfig { kv_block: 32, ..config(2) };
        assert!(matches!(plan(&spec, &odd), Err(GpuError::Unsupported { argument: "kv_block", .. })));
        let crowded = BsaConfig { force_local: 3, ..config(3) };
        assert!(matches!(plan(&spec, &crowded), Err(GpuError::Spec(_))), "forced blocks beyond top_k");
        let none = spec.clone().with_mask(Mask::None);
        assert_eq!(plan(&none, &config(2)).unwrap().params.causal, 0);
    }

    #[test]
    fn query_ranges_cover_every_block_once_last_first_on_unit_boundaries() {
        for query_blocks in [0usize, 1, 7, 8, 9, 16, 17, 63, 64, 65, 200, 2048] {
            for chunks in 1..=10 {
                let ranges = query_ranges(query_blocks, chunks);
                let units = query_blocks.div_ceil(STREAM_QUERIES);
                assert_eq!(ranges.len(), chunks.min(units), "{query_blocks} blocks, {chunks} chunks");
                let mut covered = vec![0u8; query_blocks];
                for (i, &(from, to)) in ranges.iter().enumerate() {
                    assert!(from < to && to <= query_blocks && from % STREAM_QUERIES == 0);
                    if i > 0 {
                        assert_eq!(to, ranges[i - 1].0, "the last range first, contiguous");
                    }
                    covered[from..to].iter_mut().for_each(|c| *c += 1);
                }
                assert!(covered.iter().all(|&c| c == 1), "{query_blocks} blocks, {chunks} chunks: {ranges:?}");
                // About equal: the sizes in units differ by at most one.
                let sizes: Vec<usize> =
                    ranges.iter().map(|(f, t)| t.div_ceil(STREAM_QUERIES) - f / STREAM_QUERIES).collect();
                assert!(sizes.iter().max().unwrap_or(&0) - sizes.iter().min().unwrap_or(&0) <= 1, "{sizes:?}");
            }
        }
    }

    #[test]
    fn schedules_choose_their_ranges_and_refuse_zero_chunks() {
        let spec = AttentionSpec::dense(1, 16, 2, 262_144, 262_144, 128, 128).with_mask(Mask::Causal);
        let long = BsaConfig { q_block: 128, kv_block: 128, top_k: 8, force_first: false, force_local: 0 };
        let p = plan(&spec, &long).unwrap();
        assert_eq!(SelectSchedule::Serial.ranges(&p).unwrap(), vec![(0, 2048)]);
        assert_eq!(SelectSchedule::Chunks(1).ranges(&p).unwrap(), vec![(0, 2048)]);
        assert_eq!(SelectSchedule::Chunks(3).ranges(&p).unwrap(), vec![(1360, 2048), (680, 1360), (0, 680)]);
        assert!(matches!(
            SelectSchedule::Chunks(0).ranges(&p),
            Err(GpuError::Unsupported { argument: "schedule", .. })
        ));
        let pooled_by = |chunks, pool_ctas| SelectSchedule::ChunksPooledBy { chunks, pool_ctas };
        assert_eq!(pooled_by(2, 5).ranges(&p).unwrap(), vec![(1024, 2048), (0, 1024)]);
        assert!(matches!(pooled_by(0, 5).ranges(&p), Err(GpuError::Unsupported { argument: "schedule", .. })));
        assert!(matches!(pooled_by(2, 0).ranges(&p), Err(GpuError::Unsupported { argument: "schedule", .. })));
        assert_eq!(pooled_by(2, 5).pool_ctas(132), 5);
        assert_eq!(SelectSchedule::Chunks(1).pool_ctas(132), 132 * OVERLAP_POOL_CTAS_PER_SM);
        assert_eq!(SelectSchedule::Serial.pool_ctas(132), usize::MAX);
    }

    #[test]
    fn varlen_plans_take_the_longest_sequence() {
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 0, 300], cu_seqlens_k: vec![0, 130, 140] },
            ..AttentionSpec::dense(1, 3, 1, 1, 1, 32, 32)
        };
        let p = plan(&spec, &config(2)).unwrap();
        assert_eq!((p.query_blocks, p.key_blocks, p.batch), (5, 2, 2));
        assert_eq!(p.cu_k, vec![0, 130, 140]);
    }
}
