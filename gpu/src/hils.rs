//! HiLS on the GPU (E21): `gpu/kernels/hils.cu`'s chunk summaries, router and factorized output behind typed
//! wrappers, from device buffers ([`hils_route_device`], [`hils_forward_device`]) or host tensors ([`hils_route`],
//! [`hils_forward`], which also takes lists of the caller's).
//!
//! # Inputs and outputs
//!
//! Causal self-attention (`Lq = Lk` per sequence, [`attnproof_oracle::Mask::Causal`]), dense or varlen, GQA: queries
//! and keys as for the forward, landmark queries `[B, Hq, n_c, d]` (one per chunk and query head, `n_c` the longest
//! sequence's chunks; a shorter sequence's extra rows are never read), storage type bf16 or f16. The config is the
//! oracle's [`HilsConfig`]: chunks of `C` keys (1 to [`MAX_CHUNK`]), the local window `w ≥ 1`, `K` chunks routed
//! per query (1 to [`MAX_ROUTED`]); `d ≤ 256`. Outputs: the summaries `[B, Hq, n_c, d + 1]` f64 (each chunk's slope
//! key `k'_b`, then its entropy `H(p_b)`), the lists `[B, Hq, max_len, K]` i32 (row `i`: the `K` eligible chunks of
//! the largest router score `r_ib = q_i·k'_b/√d + H(p_b)`, ties to the lower chunk, ascending, `−1`-padded; rows
//! past a sequence's length all `−1`), and on request every eligible router score `[B, Hq, max_len, n_c]` f64.
//! The forward adds V (`dv ≤ 256`) and writes O and the LSE as the dense forward lays them out: row `i`'s local window
//! `[start_i, i]` exactly, and each listed chunk as one key of value `ō_ib` (its exact in-chunk average) and log-mass
//! `r_ib` ([`ChunkMass::Surrogate`], HiLS proper) or `f_b(q_i)` ([`ChunkMass::Exact`], the control, which equals
//! dense attention over the window and the chunks).
//!
//! # Precision
//!
//! Everything in f64 from the inputs' exact values, in a fixed order (the kernel's header), so the outputs are
//! bitwise reproducible. The lists are exact given the scores: `attnproof_harness::hils_routing` ranks the kernel's
//! own scores with the oracle's top-k and demands equal lists, and holds every summary and score to the oracle's
//! within the f64 evaluation's bound. O is rounded once from f64 to the storage type and the LSE to f32:
//! `attnproof_harness::hils_output` holds them to the oracle's `factorized_output` over the same lists within that
//! rounding and the f64 evaluation's bound.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
pub use attnproof_oracle::hils::ChunkMass;
use attnproof_oracle::hils::{HilsConfig, eligible_chunks};
use attnproof_oracle::spec::Operand;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use ndarray::{Array4, ArrayView4, ArrayViewD};

use crate::block_sparse::check_block_list;
use crate::common::{GpuElement, check_causal_self_attention, check_len, grid_3d, to_i32};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::flash::{ForwardOutput, forward_from_host};
use crate::launch;
use crate::params::{FlashParams, HilsParams};

/// `gpu/kernels/hils.cu` after the shared helpers and the block selector, whose warp top-k it reuses.
pub const HILS: KernelSource = KernelSource {
    name: "hils",
    source: concat!(
        include_str!("../kernels/common.cuh"),
        include_str!("../kernels/bsa_select.cu"),
        include_str!("../kernels/hils.cu")
    ),
};

/// The most keys per chunk (the kernel's `HILS_MAX_CHUNK`: a landmark's scores live in shared memory).
pub const MAX_CHUNK: usize = 1024;
/// The most chunks routed per query (one warp's registers).
pub const MAX_ROUTED: usize = 32;
/// The largest head dim (the kernels' `POOL_MAX_D`).
pub const MAX_HEAD_DIM: usize = 256;
/// The largest value head dim of the forward (the kernel's `HILS_MAX_DV`: eight f64 accumulators per lane).
pub const MAX_HEAD_DIM_V: usize = 256;
/// Threads of `hils_summaries`, and queries (warps) per CTA of `hils_route`.
const THREADS: u32 = 128;
const ROUTE_WARPS: usize = 4;

/// The longest sequence and its chunks under `config`.
fn extents(spec: &AttentionSpec, config: HilsConfig) -> (usize, usize) {
    let max_len = spec.sequences().iter().map(|s| s.len_q).max().unwrap_or(0);
    (max_len, max_len.div_ceil(config.chunk_size.max(1)))
}

/// Elements of the summaries `[B, Hq, n_c, d + 1]`.
pub fn summaries_len(spec: &AttentionSpec, config: HilsConfig) -> usize {
    spec.sequences().len() * spec.n_heads_q * extents(spec, config).1 * (spec.head_dim + 1)
}

/// Elements of the landmarks `[B, Hq, n_c, d]`.
pub fn landmarks_len(spec: &AttentionSpec, config: HilsConfig) -> usize {
    spec.sequences().len() * spec.n_heads_q * extents(spec, config).1 * spec.head_dim
}

/// Elements of the lists `[B, Hq, max_len, K]`.
pub fn lists_len(spec: &AttentionSpec, config: HilsConfig) -> usize {
    spec.sequences().len() * spec.n_heads_q * extents(spec, config).0 * config.retrieved_chunks
}

/// Elements of the router scores `[B, Hq, max_len, n_c]`.
pub fn scores_len(spec: &AttentionSpec, config: HilsConfig) -> usize {
    let (max_len, chunks) = extents(spec, config);
    spec.sequences().len() * spec.n_heads_q * max_len * chunks
}

/// Checks `spec` and `config` and forms the kernels' scalars and the `cu_seqlens`.
fn plan(
    spec: &AttentionSpec,
    config: HilsConfig,
    write_scores: bool,
) -> Result<(HilsParams, Vec<i32>, Vec<i32>), GpuError> {
    check_causal_self_attention(spec, "HiLS")?;
    let unsupported = |argument, reason: String| Err(GpuError::Unsupported { argument, reason });
    if config.chunk_size == 0 || config.chunk_size > MAX_CHUNK {
        return unsupported("chunk_size", format!("{} keys per chunk; 1 to {MAX_CHUNK}", config.chunk_size));
    }
    if config.local_window == 0 {
        return unsupported("local_window", "the local window holds at least the query's own key".into());
    }
    if config.retrieved_chunks == 0 || config.retrieved_chunks > MAX_ROUTED {
        return unsupported("retrieved_chunks", format!("{} chunks; 1 to {MAX_ROUTED}", config.retrieved_chunks));
    }
    if spec.head_dim > MAX_HEAD_DIM {
        return unsupported("head_dim", format!("{}; at most {MAX_HEAD_DIM}", spec.head_dim));
    }
    let (flash, cu_q, cu_k) = FlashParams::for_spec(spec)?;
    let (max_len, chunks) = extents(spec, config);
    let params = HilsParams {
        flash,
        scale: 1.0 / (spec.head_dim as f64).sqrt(),
        chunk_size: to_i32("chunk_size", config.chunk_size)?,
        local_window: to_i32("local_window", config.local_window.min(i32::MAX as usize))?,
        top_k: to_i32("retrieved_chunks", config.retrieved_chunks)?,
        n_chunks: to_i32("chunks", chunks)?,
        max_len: to_i32("sequence length", max_len)?,
        write_scores: i32::from(write_scores),
        exact_mass: 0,
        reserved: 0,
    };
    Ok((params, cu_q, cu_k))
}

/// Checks everything the forward's wrappers check about `spec`, `config` and `mass` before a launch, without a
/// device: `Ok` exactly when [`hils_forward`] would accept the problem (given well-formed inputs and lists), else the
/// typed error it would return. The kernels read head dims that are multiples of 8 from 8 to 256.
pub fn check_forward(spec: &AttentionSpec, config: HilsConfig, mass: ChunkMass) -> Result<(), GpuError> {
    // The plan validates the spec itself (check_causal_self_attention, FlashParams::for_spec).
    plan_forward(spec, config, mass).map(|_| ())
}

/// [`plan`] for the forward: the value head dim checked and the chunks' log-mass set.
fn plan_forward(
    spec: &AttentionSpec,
    config: HilsConfig,
    mass: ChunkMass,
) -> Result<(HilsParams, Vec<i32>, Vec<i32>), GpuError> {
    let (mut params, cu_q, cu_k) = plan(spec, config, false)?;
    if spec.head_dim_v > MAX_HEAD_DIM_V {
        let reason = format!("{}; at most {MAX_HEAD_DIM_V}", spec.head_dim_v);
        return Err(GpuError::Unsupported { argument: "head_dim_v", reason });
    }
    params.exact_mass = i32::from(mass == ChunkMass::Exact);
    Ok((params, cu_q, cu_k))
}

/// The kernel `name` of `kernel` compiled for `T`.
fn function<T: GpuElement>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    name: &'static str,
) -> Result<CudaFunction, GpuError> {
    let module = compile::module(stream.context(), kernel, &[T::DEFINE.to_owned()])?;
    module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(hils.cu)", e))
}

/// Checks host landmarks against their layout `[B, Hq, n_c, d]` (the device entry points can only check a length).
fn check_landmarks_shape<T>(
    spec: &AttentionSpec,
    config: HilsConfig,
    landmarks: &ArrayViewD<'_, T>,
) -> Result<(), GpuError> {
    let expected = vec![spec.sequences().len(), spec.n_heads_q, extents(spec, config).1, spec.head_dim];
    if landmarks.shape() != expected.as_slice() {
        return Err(GpuError::Shape { argument: "landmarks", expected, actual: landmarks.shape().to_vec() });
    }
    Ok(())
}

/// The router's outputs on the device.
pub struct HilsRoutingDevice<'a> {
    /// `[B, Hq, n_c, d + 1]` f64: slope keys, then entropies (overwritten).
    pub summaries: &'a mut CudaSlice<f64>,
    /// `[B, Hq, max_len, K]` i32 (overwritten).
    pub lists: &'a mut CudaSlice<i32>,
    /// `[B, Hq, max_len, n_c]` f64, every eligible router score, or `None`.
    pub scores: Option<&'a mut CudaSlice<f64>>,
}

/// HiLS's summaries and routing on device buffers (Q and K as for the forward, `landmarks` `[B, Hq, n_c, d]`). Every
/// check runs before the first launch; the launches are asynchronous on `stream`.
pub fn hils_route_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: HilsConfig,
    (q, k, landmarks): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    out: HilsRoutingDevice<'_>,
) -> Result<(), GpuError> {
    hils_route_device_with(stream, spec, config, HILS, (q, k, landmarks), out)
}

/// [`hils_route_device`] with an explicit text of `hils.cu` (the tests launch patched copies through the same
/// checks).
pub fn hils_route_device_with<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: HilsConfig,
    kernel: KernelSource,
    (q, k, landmarks): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    out: HilsRoutingDevice<'_>,
) -> Result<(), GpuError> {
    let (params, cu_q, cu_k) = plan(spec, config, out.scores.is_some())?;
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_len("q", q, size(Operand::Q))?;
    check_len("k", k, size(Operand::K))?;
    check_len("landmarks", landmarks, landmarks_len(spec, config))?;
    check_len("summaries", out.summaries, summaries_len(spec, config))?;
    check_len("lists", out.lists, lists_len(spec, config))?;
    if let Some(scores) = &out.scores {
        check_len("scores", *scores, scores_len(spec, config))?;
    }
    let (summaries_fn, route_fn) =
        (function::<T>(stream, kernel, "hils_summaries")?, function::<T>(stream, kernel, "hils_route")?);
    let (batch, (max_len, chunks)) = (spec.sequences().len(), extents(spec, config));
    if batch == 0 || max_len == 0 || spec.n_heads_q == 0 {
        return Ok(());
    }
    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(hils)", e));
    let (cu_q, cu_k) = (up(&cu_q)?, up(&cu_k)?);
    let cfg = |grid: (u32, u32, u32)| LaunchConfig { grid_dim: grid, block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let chunks_grid = grid_3d(("chunks", chunks), ("heads", spec.n_heads_q), ("sequences", batch))?;
    launch::launch_hils_summaries(
        stream,
        &summaries_fn,
        cfg(chunks_grid),
        (k, landmarks),
        out.summaries,
        &cu_k,
        &params,
    )?;
    let rows_grid =
        grid_3d(("queries", max_len.div_ceil(ROUTE_WARPS)), ("heads", spec.n_heads_q), ("sequences", batch))?;
    // Without scores the kernel writes none; the lists stand in for the unread pointer.
    let mut unused = None;
    let scores: &mut CudaSlice<f64> = match out.scores {
        Some(s) => s,
        None => unused.insert(stream.alloc_zeros::<f64>(1).map_err(|e| GpuError::driver("cuMemAlloc", e))?),
    };
    launch::launch_hils_route(
        stream,
        &route_fn,
        cfg(rows_grid),
        (q, out.summaries),
        (out.lists, scores),
        &cu_q,
        &params,
    )
}

/// What [`hils_route`] returns.
#[derive(Clone, Debug)]
pub struct HilsRouting {
    /// `[B, Hq, n_c, d + 1]`: slope keys, then entropies.
    pub summaries: Array4<f64>,
    /// `[B, Hq, max_len, K]`.
    pub lists: Array4<i32>,
    /// `[B, Hq, max_len, n_c]`: every eligible router score (the rest `−∞`).
    pub scores: Array4<f64>,
}

/// HiLS's summaries, lists and router scores from host tensors (copies in, launches, copies out, synchronizes).
pub fn hils_route<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: HilsConfig,
    (q, k, landmarks): (ArrayViewD<'_, T>, ArrayViewD<'_, T>, ArrayViewD<'_, T>),
) -> Result<HilsRouting, GpuError> {
    plan(spec, config, true)?;
    check_landmarks_shape(spec, config, &landmarks)?;
    let err = |what: &'static str| move |e| GpuError::driver(what, e);
    let up = |x: ArrayViewD<'_, T>| {
        let v: Vec<T> = x.iter().copied().collect();
        stream.clone_htod(&v).map_err(err("cuMemcpyHtoD(hils)"))
    };
    let (dq, dk, dl) = (up(q)?, up(k)?, up(landmarks)?);
    let mut buffers = RoutingBuffers::alloc(stream, spec, config)?;
    hils_route_device(stream, spec, config, (&dq, &dk, &dl), buffers.device())?;
    buffers.download(stream, spec, config)
}

/// The router's outputs on the device for the host entry points: summaries, lists, and every router score (`−∞`
/// where a chunk is not eligible).
struct RoutingBuffers {
    summaries: CudaSlice<f64>,
    lists: CudaSlice<i32>,
    scores: CudaSlice<f64>,
}

impl RoutingBuffers {
    fn alloc(stream: &Arc<CudaStream>, spec: &AttentionSpec, config: HilsConfig) -> Result<RoutingBuffers, GpuError> {
        let err = |what: &'static str| move |e| GpuError::driver(what, e);
        Ok(RoutingBuffers {
            summaries: stream.alloc_zeros::<f64>(summaries_len(spec, config).max(1)).map_err(err("cuMemAlloc"))?,
            lists: stream.alloc_zeros::<i32>(lists_len(spec, config).max(1)).map_err(err("cuMemAlloc"))?,
            scores: stream
                .clone_htod(&vec![f64::NEG_INFINITY; scores_len(spec, config).max(1)])
                .map_err(err("cuMemcpyHtoD(hils)"))?,
        })
    }

    fn device(&mut self) -> HilsRoutingDevice<'_> {
        HilsRoutingDevice { summaries: &mut self.summaries, lists: &mut self.lists, scores: Some(&mut self.scores) }
    }

    fn download(
        &self,
        stream: &Arc<CudaStream>,
        spec: &AttentionSpec,
        config: HilsConfig,
    ) -> Result<HilsRouting, GpuError> {
        let err = |e| GpuError::driver("cuMemcpyDtoH(hils)", e);
        let (summaries, scores) =
            (stream.clone_dtoh(&self.summaries).map_err(err)?, stream.clone_dtoh(&self.scores).map_err(err)?);
        let lists = stream.clone_dtoh(&self.lists).map_err(err)?;
        Ok(HilsRouting::from_buffers(spec, config, &summaries, &lists, &scores))
    }
}

/// The forward's buffers on the device: the routing's, O and the LSE.
pub struct HilsForwardDevice<'a, T> {
    /// The summaries, lists and (optionally) router scores, as [`hils_route_device`] writes them.
    pub routing: HilsRoutingDevice<'a>,
    /// `O`, laid out like Q with `dv` columns (overwritten).
    pub o: &'a mut CudaSlice<T>,
    /// The LSE, dense `[B, Hq, L]`, varlen `[Hq, T]` (overwritten).
    pub lse: &'a mut CudaSlice<f32>,
}

/// HiLS's forward on device buffers: the summaries and the router ([`hils_route_device`]), then the factorized output
/// over the router's lists with the chunks weighed by `mass`. Every check runs before the first launch; the launches
/// are asynchronous on `stream`.
pub fn hils_forward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: HilsConfig,
    mass: ChunkMass,
    inputs: (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    out: HilsForwardDevice<'_, T>,
) -> Result<(), GpuError> {
    hils_forward_device_with(stream, spec, config, mass, HILS, inputs, out)
}

/// [`hils_forward_device`] with an explicit text of `hils.cu` (the tests launch patched copies through the same
/// checks).
pub fn hils_forward_device_with<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: HilsConfig,
    mass: ChunkMass,
    kernel: KernelSource,
    inputs: (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    out: HilsForwardDevice<'_, T>,
) -> Result<(), GpuError> {
    forward_on_device(stream, (spec, config, mass), kernel, inputs, out, None)
}

/// The forward on the device, over the router's lists or, with `given`, over lists the host validated and uploaded
/// (`[B, Hq, max_len, K]`, the router's layout).
fn forward_on_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    (spec, config, mass): (&AttentionSpec, HilsConfig, ChunkMass),
    kernel: KernelSource,
    (q, k, v, landmarks): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    out: HilsForwardDevice<'_, T>,
    given: Option<&CudaSlice<i32>>,
) -> Result<(), GpuError> {
    let (params, cu_q, cu_k) = plan_forward(spec, config, mass)?;
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_len("v", v, size(Operand::V))?;
    check_len("o", out.o, size(Operand::O))?;
    check_len("lse", out.lse, size(Operand::RowStat))?;
    if let Some(lists) = given {
        check_len("retrieved", lists, lists_len(spec, config))?;
    }
    let HilsForwardDevice { routing, o, lse } = out;
    let HilsRoutingDevice { summaries, lists, scores } = routing;
    let output_fn = function::<T>(stream, kernel, "hils_output")?;
    let routed = HilsRoutingDevice { summaries: &mut *summaries, lists: &mut *lists, scores };
    // The router checks Q, K, the landmarks and its own buffers before its first launch, and nothing has launched yet.
    hils_route_device_with(stream, spec, config, kernel, (q, k, landmarks), routed)?;
    let (batch, (max_len, _)) = (spec.sequences().len(), extents(spec, config));
    if batch == 0 || max_len == 0 || spec.n_heads_q == 0 {
        return Ok(());
    }
    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(hils)", e));
    let (cu_q, cu_k) = (up(&cu_q)?, up(&cu_k)?);
    let grid = grid_3d(("queries", max_len.div_ceil(ROUTE_WARPS)), ("heads", spec.n_heads_q), ("sequences", batch))?;
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let lists: &CudaSlice<i32> = given.unwrap_or(lists);
    launch::launch_hils_output(
        stream,
        &output_fn,
        cfg,
        (q, k, v),
        (summaries, lists),
        (o, lse),
        (&cu_q, &cu_k),
        &params,
    )
}

/// What [`hils_forward`] returns.
#[derive(Clone, Debug)]
pub struct HilsForward<T> {
    /// The summaries, the router's lists and every eligible router score.
    pub routing: HilsRouting,
    /// O and the LSE, over the lists the output used (the router's, or the caller's).
    pub output: ForwardOutput<T>,
}

/// HiLS's forward from host tensors: Q, K, V as for the dense forward, `landmarks` `[B, Hq, n_c, d]`; the output over
/// the router's lists, or over `retrieved` (`[B, Hq, max_len, K]`: each valid row ascending, distinct, `−1`-padded,
/// every chunk entirely before the row's local window; rows past a sequence's length all `−1`), checked before any
/// launch. Copies in, launches, copies out, synchronizes.
pub fn hils_forward<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: HilsConfig,
    mass: ChunkMass,
    (q, k, v, landmarks): (ArrayViewD<'_, T>, ArrayViewD<'_, T>, ArrayViewD<'_, T>, ArrayViewD<'_, T>),
    retrieved: Option<ArrayView4<'_, i32>>,
) -> Result<HilsForward<T>, GpuError> {
    check_forward(spec, config, mass)?;
    check_landmarks_shape(spec, config, &landmarks)?;
    if let Some(lists) = retrieved {
        check_retrieved(spec, config, lists)?;
    }
    let err = |what: &'static str| move |e| GpuError::driver(what, e);
    let landmarks: Vec<T> = landmarks.iter().copied().collect();
    let landmarks = stream.clone_htod(&landmarks).map_err(err("cuMemcpyHtoD(hils)"))?;
    let given = match retrieved {
        Some(lists) => {
            let flat: Vec<i32> = lists.iter().copied().collect();
            Some(stream.clone_htod(&flat).map_err(err("cuMemcpyHtoD(hils)"))?)
        }
        None => None,
    };
    let mut buffers = RoutingBuffers::alloc(stream, spec, config)?;
    let output = forward_from_host(stream, spec, [q, k, v], |[dq, dk, dv], o, lse| {
        let out = HilsForwardDevice { routing: buffers.device(), o, lse };
        forward_on_device(stream, (spec, config, mass), HILS, (dq, dk, dv, &landmarks), out, given.as_ref())
    })?;
    Ok(HilsForward { routing: buffers.download(stream, spec, config)?, output })
}

/// Checks lists a caller gives the forward: the router's shape, each valid row E14's convention with the row's
/// eligible chunks (`start_i / C`, the chunks entirely before its local window) as the bound, rows past a sequence's
/// length all `−1`. A fault's position is (sequence, query head, query row, slot).
fn check_retrieved(spec: &AttentionSpec, config: HilsConfig, lists: ArrayView4<'_, i32>) -> Result<(), GpuError> {
    let (max_len, _) = extents(spec, config);
    let expected = vec![spec.sequences().len(), spec.n_heads_q, max_len, config.retrieved_chunks];
    if lists.shape() != expected.as_slice() {
        return Err(GpuError::Shape { argument: "retrieved", expected, actual: lists.shape().to_vec() });
    }
    for seq in spec.sequences() {
        for h in 0..spec.n_heads_q {
            for i in 0..max_len {
                let eligible = if i < seq.len_q { eligible_chunks(i, config).end } else { 0 };
                let row = lists.slice(ndarray::s![seq.index, h, i, ..]);
                check_block_list(row.iter().copied(), eligible)
                    .map_err(|(slot, fault)| GpuError::BlockList { position: [seq.index, h, i, slot], fault })?;
            }
        }
    }
    Ok(())
}

impl HilsRouting {
    /// The outputs from host copies of the device buffers in their layouts (each at least as long as the layout
    /// needs; anything past it, such as a guard band, is left out).
    pub fn from_buffers(
        spec: &AttentionSpec,
        config: HilsConfig,
        summaries: &[f64],
        lists: &[i32],
        scores: &[f64],
    ) -> HilsRouting {
        let (max_len, chunks) = extents(spec, config);
        let (b, h) = (spec.sequences().len(), spec.n_heads_q);
        fn take<X: Copy>(x: &[X], shape: (usize, usize, usize, usize)) -> Array4<X> {
            let n = shape.0 * shape.1 * shape.2 * shape.3;
            Array4::from_shape_vec(shape, x[..n].to_vec()).expect("sized by the layout")
        }
        HilsRouting {
            summaries: take(summaries, (b, h, chunks, spec.head_dim + 1)),
            lists: take(lists, (b, h, max_len, config.retrieved_chunks)),
            scores: take(scores, (b, h, max_len, chunks)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::{Layout, Mask};

    fn config(chunk_size: usize, local_window: usize, retrieved_chunks: usize) -> HilsConfig {
        HilsConfig { chunk_size, local_window, retrieved_chunks }
    }

    #[test]
    fn the_buffers_are_spelled_out() {
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 10, 75], cu_seqlens_k: vec![0, 10, 75] },
            ..AttentionSpec::dense(1, 4, 2, 1, 1, 16, 8).with_mask(Mask::Causal)
        };
        // The longest sequence has 65 tokens: 3 chunks of 32.
        let c = config(32, 40, 5);
        assert_eq!(summaries_len(&spec, c), 2 * 4 * 3 * 17);
        assert_eq!(landmarks_len(&spec, c), 2 * 4 * 3 * 16);
        assert_eq!(lists_len(&spec, c), 2 * 4 * 65 * 5);
        assert_eq!(scores_len(&spec, c), 2 * 4 * 65 * 3);
        let (params, _, _) = plan(&spec, c, true).unwrap();
        assert_eq!((params.n_chunks, params.max_len, params.top_k, params.write_scores), (3, 65, 5, 1));
        assert_eq!(params.scale, 0.25);
    }

    /// The caller's lists are checked on the host: the router's shape, per valid row E14's convention with the
    /// row's eligible chunks as the bound, rows past a sequence's length all `−1`; each fault names its entry.
    #[test]
    fn given_lists_are_checked_before_any_launch() {
        use crate::error::BlockListFault;
        // Two sequences of 40 and 20 tokens; chunks of 8, a window of 8, two chunks per row: row i may retrieve the
        // chunks below ⌊(i + 1 − 8)/8⌋ (row 39: 4 chunks, row 15: 1, row 7: none).
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 40, 60], cu_seqlens_k: vec![0, 40, 60] },
            ..AttentionSpec::dense(1, 2, 1, 1, 1, 16, 8).with_mask(Mask::Causal)
        };
        let c = config(8, 8, 2);
        let mut lists = Array4::from_elem((2, 2, 40, 2), -1);
        lists[[0, 1, 39, 0]] = 0;
        lists[[0, 1, 39, 1]] = 3;
        lists[[1, 0, 19, 0]] = 0;
        assert!(check_retrieved(&spec, c, lists.view()).is_ok());
        let fault = |edit: &dyn Fn(&mut Array4<i32>)| {
            let mut bad = lists.clone();
            edit(&mut bad);
            match check_retrieved(&spec, c, bad.view()) {
                Err(GpuError::BlockList { position, fault }) => Some((position, fault)),
                other => panic!("{other:?}"),
            }
        };
        let out_of_range = BlockListFault::OutOfRange { index: 4, key_blocks: 4 };
        assert_eq!(fault(&|b| b[[0, 1, 39, 1]] = 4), Some(([0, 1, 39, 1], out_of_range)));
        let early = BlockListFault::OutOfRange { index: 1, key_blocks: 1 };
        assert_eq!(fault(&|b| b[[0, 0, 15, 0]] = 1), Some(([0, 0, 15, 0], early)));
        let none = BlockListFault::OutOfRange { index: 0, key_blocks: 0 };
        assert_eq!(fault(&|b| b[[0, 0, 7, 0]] = 0), Some(([0, 0, 7, 0], none.clone())));
        // Row 20 of the second sequence is past its 20 tokens.
        assert_eq!(fault(&|b| b[[1, 1, 20, 0]] = 0), Some(([1, 1, 20, 0], none)));
        assert_eq!(fault(&|b| b[[0, 1, 39, 1]] = 0), Some(([0, 1, 39, 1], BlockListFault::Duplicate { index: 0 })));
        let unsorted = BlockListFault::NotAscending { index: 0, previous: 3 };
        assert_eq!(
            fault(&|b| {
                b[[0, 1, 39, 0]] = 3;
                b[[0, 1, 39, 1]] = 0;
            }),
            Some(([0, 1, 39, 1], unsorted))
        );
        let after_pad = BlockListFault::AfterPad { index: 3 };
        assert_eq!(fault(&|b| b[[0, 1, 39, 0]] = -1), Some(([0, 1, 39, 1], after_pad)));
        let narrow = Array4::from_elem((2, 2, 40, 1), -1);
        let e = check_retrieved(&spec, c, narrow.view());
        assert!(matches!(e, Err(GpuError::Shape { argument: "retrieved", .. })), "{e:?}");
    }

    /// Host landmarks must have the layout `[B, Hq, n_c, d]`, not merely enough elements.
    #[test]
    fn host_landmarks_are_checked_by_shape() {
        let spec = AttentionSpec::dense(2, 3, 1, 40, 40, 16, 8).with_mask(Mask::Causal);
        let c = config(16, 8, 2);
        let good = ndarray::ArrayD::<f32>::zeros(ndarray::IxDyn(&[2, 3, 3, 16]));
        assert!(check_landmarks_shape(&spec, c, &good.view()).is_ok());
        let transposed = ndarray::ArrayD::<f32>::zeros(ndarray::IxDyn(&[3, 2, 3, 16]));
        let e = check_landmarks_shape(&spec, c, &transposed.view());
        assert!(
            matches!(&e, Err(GpuError::Shape { argument: "landmarks", expected, .. }) if expected == &[2, 3, 3, 16]),
            "{e:?}"
        );
    }

    #[test]
    fn bad_configs_and_specs_are_typed_errors() {
        let spec = AttentionSpec::dense(1, 2, 1, 64, 64, 16, 16).with_mask(Mask::Causal);
        let refused = |spec: &AttentionSpec, c: HilsConfig, argument: &str| matches!(plan(spec, c, false), Err(GpuError::Unsupported { argument: a, .. }) if a == argument);
        assert!(refused(&spec, config(0, 8, 2), "chunk_size"));
        assert!(refused(&spec, config(MAX_CHUNK + 1, 8, 2), "chunk_size"));
        assert!(refused(&spec, config(16, 0, 2), "local_window"));
        assert!(refused(&spec, config(16, 8, 0), "retrieved_chunks"));
        assert!(refused(&spec, config(16, 8, MAX_ROUTED + 1), "retrieved_chunks"));
        assert!(refused(&spec.clone().with_mask(Mask::None), config(16, 8, 2), "mask"));
        assert!(refused(
            &AttentionSpec::dense(1, 2, 1, 64, 65, 16, 16).with_mask(Mask::Causal),
            config(16, 8, 2),
            "layout"
        ));
        assert!(refused(
            &AttentionSpec::dense(1, 1, 1, 8, 8, 264, 8).with_mask(Mask::Causal),
            config(4, 4, 1),
            "head_dim"
        ));
        assert!(plan(&spec, config(MAX_CHUNK, 1, MAX_ROUTED), false).is_ok());
        // The forward: value head dims up to 256, and the chunks' mass reaches the kernel's flag.
        let wide_v = AttentionSpec::dense(1, 1, 1, 8, 8, 16, MAX_HEAD_DIM_V + 8).with_mask(Mask::Causal);
        let e = plan_forward(&wide_v, config(4, 4, 1), ChunkMass::Surrogate);
        assert!(matches!(e, Err(GpuError::Unsupported { argument: "head_dim_v", .. })), "{e:?}");
        let flag = |mass| plan_forward(&spec, config(16, 8, 2), mass).map(|(p, _, _)| p.exact_mass).unwrap();
        assert_eq!((flag(ChunkMass::Surrogate), flag(ChunkMass::Exact)), (0, 1));
        let at_limit = AttentionSpec::dense(1, 1, 1, 8, 8, 16, MAX_HEAD_DIM_V).with_mask(Mask::Causal);
        assert!(plan_forward(&at_limit, config(4, 4, 1), ChunkMass::Exact).is_ok());
        // A value head dim off the kernels' grid of 8 (the first device run's draws had one): refused before a
        // launch, by the same check a caller can run without a device.
        let narrow_v = AttentionSpec::dense(1, 1, 1, 70, 70, 16, 1).with_mask(Mask::Causal);
        let e = check_forward(&narrow_v, config(16, 1, 2), ChunkMass::Surrogate);
        assert!(matches!(e, Err(GpuError::Unsupported { argument: "head_dim_v", .. })), "{e:?}");
        assert!(check_forward(&at_limit, config(4, 4, 1), ChunkMass::Exact).is_ok());
    }
}
