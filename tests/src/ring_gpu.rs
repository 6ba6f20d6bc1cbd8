//! Ring attention forward (E11/E11a) on one GPU holding `G` simulated devices: the reference crate's ring driver
//! ([`run_device`]) over a stream-ordered transport ([`StreamLink`]) and a GPU worker ([`GpuForwardDevice`]), one host
//! thread and one CUDA stream per device. It lives in the harness because it joins the driver (reference crate) and
//! the kernels (gpu crate), which do not depend on each other.
//!
//! A device owns the query and KV chunks of its ring positions ([`RingConfig::positions`]); at each step it attends
//! its query chunks to the held KV block (each visible chunk pair's partial state from the forward kernel's
//! `STATE_OUT` mode, merged into its query chunk's running state, `attnproof_gpu::ring_state`), and finally turns
//! every running state into `O` and LSE. The recipe is the forward's with `extra_merges = 2(P − 1)` for `P` key
//! chunks per sequence ([`gpu_ring_recipe_extra_merges`]).
//!
//! Supported: dense layouts (every batch item has the same positions); masks `None`, `Causal`, `Window` and `And`
//! of those. Varlen is a typed error.

use std::ops::Range;
use std::sync::{Arc, Mutex, mpsc};

use attnproof_gpu::GpuElement;
use attnproof_gpu::GpuError;
use attnproof_gpu::flash::flash_forward_state_device;
use attnproof_gpu::ring_state::{ChunkWindow, DeviceState, finalize_state, merge_states};
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Layout};
use attnproof_reference::ring::{DeviceRun, RingFault, RingPosition, RingTransport, RingWorker, Travel, run_device};
use attnproof_reference::{Element, RingConfig};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits};
use ndarray::{ArrayD, Axis, IxDyn, Slice};
use thiserror::Error;

use crate::Case;
use crate::ring_timing::Idle;

/// Why a GPU ring run failed.
#[derive(Debug, Error)]
pub enum GpuRingError {
    /// The schedule went wrong (a misrouted block, a neighbour gone).
    #[error(transparent)]
    Ring(#[from] RingFault),
    /// A kernel wrapper refused or failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A driver call of the transport failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// The problem is outside what the GPU ring supports.
    #[error("the GPU ring does not support {0}")]
    Unsupported(&'static str),
}

impl From<DriverError> for GpuRingError {
    fn from(e: DriverError) -> Self {
        GpuRingError::Driver(e.to_string())
    }
}

/// A deliberate fault of the GPU ring, injected by the tests that show each one is caught (the ring mutants of the
/// issue: E11 and E11a gone wrong in the ways a real implementation goes wrong). `None` is the correct ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingMutant {
    /// The correct ring.
    None,
    /// A chunk pair on the diagonal (same first position) is attended without its mask's right reach: future keys
    /// leak into causal rows.
    DiagonalUnmasked,
    /// Every visible chunk pair's partial state is merged into the running state twice.
    MergedTwice,
    /// Under zigzag, each device's two key chunks carry each other's positions (chunks `g` and `2G − 1 − g` swapped).
    ZigzagSwapped,
    /// The transport keeps sending the first block it ever posted, relabelled with the current owner: the routing
    /// check sees the right owner, the contents are stale.
    StaleReceiveBuffer,
}

/// One contiguous run of keys of a KV block: positions `start .. start + len` of every sequence, `[B, Hkv, len, D]`.
#[derive(Debug)]
pub struct KvChunk<T> {
    /// First key position.
    pub start: usize,
    /// Keys.
    pub len: usize,
    /// Keys, `[B, Hkv, len, d]`.
    pub k: CudaSlice<T>,
    /// Values, `[B, Hkv, len, dv]`.
    pub v: CudaSlice<T>,
    /// In the backward pass: the chunk's travelling f32 dK, dV sums, one per query head
    /// (`attnproof_gpu::backward::ring_dkv_accumulator_len`); `None` in the forward pass.
    pub acc: Option<CudaSlice<f32>>,
}

/// The travelling block: the KV chunks one device owns (one, or two under zigzag).
#[derive(Debug)]
pub struct GpuKvBlock<T> {
    /// The device that owns these keys.
    pub owner: usize,
    /// Its chunks.
    pub chunks: Vec<KvChunk<T>>,
    /// Recorded on the sender's stream after the copy that made this block; the receiver's stream waits on it.
    pub(crate) ready: Option<Arc<CudaEvent>>,
}

impl<T> GpuKvBlock<T> {
    /// A block of `owner`'s chunks, ready for any stream (its buffers were filled by work already ordered before).
    pub fn new(owner: usize, chunks: Vec<KvChunk<T>>) -> Self {
        GpuKvBlock { owner, chunks, ready: None }
    }
}

impl<T: DeviceRepr> GpuKvBlock<T> {
    /// A copy of the block (K, V and any accumulators) in fresh buffers, made on `stream`.
    pub(crate) fn copy_on(&self, stream: &Arc<CudaStream>) -> Result<Self, GpuRingError> {
        let chunks = self
            .chunks
            .iter()
            .map(|c| {
                let acc = c.acc.as_ref().map(|a| stream.clone_dtod(a)).transpose()?;
                Ok(KvChunk {
                    start: c.start,
                    len: c.len,
                    k: stream.clone_dtod(&c.k)?,
                    v: stream.clone_dtod(&c.v)?,
                    acc,
                })
            })
            .collect::<Result<_, GpuRingError>>()?;
        Ok(GpuKvBlock::new(self.owner, chunks))
    }
}

/// Hands `items[g]` to device `g`, once: the per-device values (links, staged blocks) that each device thread takes
/// on its own thread.
pub(crate) fn once_per_device<X: Send>(items: Vec<X>) -> impl Fn(usize) -> Result<X, GpuRingError> + Sync {
    let slots: Vec<Mutex<Option<X>>> = items.into_iter().map(|x| Mutex::new(Some(x))).collect();
    move |device| {
        let mut slot = slots[device].lock().unwrap_or_else(|p| p.into_inner());
        slot.take().ok_or(GpuRingError::Unsupported("a second hand-out for one device"))
    }
}

/// A simulated device's link: the hop is a device-to-device copy into fresh buffers on the sender's communication
/// stream (its interconnect), which first waits for everything the sender's compute stream has enqueued (the held
/// block is complete), and an event recorded after the copy that the receiver's compute stream waits on before
/// anything it enqueues next; the block's handles travel through `mpsc` channels, in order, so the `k`-th `wait` gets
/// the predecessor's `k`-th post. `post` only enqueues the copy and returns: in the forward pass the driver posts
/// before it attends, so the copy runs beside the attention of the held block (E11's two buffers), which only reads
/// it meanwhile; in the backward pass `prefetch` copies K and V before the attention and `post` the dK, dV
/// accumulators after it.
#[derive(Debug)]
pub struct StreamLink<T> {
    device: usize,
    /// The device's compute stream: the copy waits for it, the receiver's compute stream waits for the copy.
    stream: Arc<CudaStream>,
    /// The device's communication stream, on which the copies run.
    comm: Arc<CudaStream>,
    to_successor: mpsc::Sender<GpuKvBlock<T>>,
    from_predecessor: mpsc::Receiver<GpuKvBlock<T>>,
    mutant: RingMutant,
    /// Under [`RingMutant::StaleReceiveBuffer`]: the first block posted, sent again at every hop.
    first_posted: Option<GpuKvBlock<T>>,
    /// The K and V copies `prefetch` started (backward blocks): `post` adds the accumulators.
    prefetched: Option<Vec<KvPair<T>>>,
}

/// One chunk's K and V buffers.
type KvPair<T> = (CudaSlice<T>, CudaSlice<T>);

/// Every ring device's worker and own block, as the driver starts them.
pub type RingSetups<W, T> = Vec<(W, GpuKvBlock<T>)>;

impl<T: DeviceRepr> StreamLink<T> {
    /// What a hop sends: `outgoing`, or under [`RingMutant::StaleReceiveBuffer`] the first block ever posted.
    fn source<'a>(&'a self, outgoing: &'a GpuKvBlock<T>) -> &'a GpuKvBlock<T> {
        match (&self.first_posted, self.mutant) {
            (Some(first), RingMutant::StaleReceiveBuffer) => first,
            _ => outgoing,
        }
    }

    /// Copies of the K and V of `block`'s chunks on the communication stream, once the compute stream's work so far
    /// is done.
    fn copy_kv(&self, block: &GpuKvBlock<T>) -> Result<Vec<KvPair<T>>, GpuRingError> {
        self.comm.join(&self.stream)?;
        block.chunks.iter().map(|c| Ok((self.comm.clone_dtod(&c.k)?, self.comm.clone_dtod(&c.v)?))).collect()
    }
}

impl<T: DeviceRepr> RingTransport<GpuKvBlock<T>> for StreamLink<T> {
    type Error = GpuRingError;

    fn prefetch(&mut self, held: &GpuKvBlock<T>) -> Result<(), GpuRingError> {
        self.prefetched = Some(self.copy_kv(self.source(held))?);
        Ok(())
    }

    fn post(&mut self, outgoing: &GpuKvBlock<T>) -> Result<(), GpuRingError> {
        let kv = match self.prefetched.take() {
            Some(kv) => kv,
            None => self.copy_kv(self.source(outgoing))?,
        };
        // The accumulators (what the attention just wrote) leave after it: the join orders the copy after it.
        self.comm.join(&self.stream)?;
        let source = self.source(outgoing);
        let mut chunks = Vec::with_capacity(source.chunks.len());
        for (c, (k, v)) in source.chunks.iter().zip(kv) {
            let acc = c.acc.as_ref().map(|a| self.comm.clone_dtod(a)).transpose()?;
            chunks.push(KvChunk { start: c.start, len: c.len, k, v, acc });
        }
        let ready = Some(Arc::new(self.comm.record_event(None)?));
        if self.mutant == RingMutant::StaleReceiveBuffer && self.first_posted.is_none() {
            self.first_posted = Some(outgoing.copy_on(&self.stream)?);
        }
        self.to_successor
            .send(GpuKvBlock { owner: outgoing.owner, chunks, ready })
            .map_err(|_| RingFault::Disconnected { device: self.device }.into())
    }

    fn wait(&mut self) -> Result<GpuKvBlock<T>, GpuRingError> {
        let block = self.from_predecessor.recv().map_err(|_| RingFault::Disconnected { device: self.device })?;
        if let Some(ready) = &block.ready {
            self.stream.wait(ready)?;
        }
        Ok(block)
    }
}

/// The links of a ring of `streams.len()` simulated devices, by device: device `g` sends into device `g + 1`'s inbox,
/// each link with a new communication stream beside its device's compute stream.
pub fn stream_ring<T>(streams: &[Arc<CudaStream>], mutant: RingMutant) -> Result<Vec<StreamLink<T>>, GpuRingError> {
    let n = streams.len();
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::channel::<GpuKvBlock<T>>()).unzip();
    receivers
        .into_iter()
        .enumerate()
        .map(|(device, from_predecessor)| {
            Ok(StreamLink {
                device,
                stream: streams[device].clone(),
                comm: streams[device].context().new_stream()?,
                to_successor: senders[(device + 1) % n].clone(),
                from_predecessor,
                mutant,
                first_posted: None,
                prefetched: None,
            })
        })
        .collect()
}

/// The window of the pair (query positions `q = (start, len)`, key chunk `c`) of a sequence of `lens` (queries,
/// keys) under `spec`'s mask; [`RingMutant::DiagonalUnmasked`] drops the right reach of diagonal pairs.
fn pair_window<T>(
    spec: &AttentionSpec,
    lens: (usize, usize),
    q: (usize, usize),
    c: &KvChunk<T>,
    mutant: RingMutant,
) -> Result<ChunkWindow, GpuError> {
    let w = ChunkWindow::for_pair(&spec.mask, lens, q, (c.start, c.len))?;
    Ok(if mutant == RingMutant::DiagonalUnmasked && q.0 == c.start { ChunkWindow { right: None, ..w } } else { w })
}

/// Whether some of the `queries` (positions, lengths) sees some key of `block`: else the driver skips the block.
fn block_visible<T>(
    spec: &AttentionSpec,
    lens: (usize, usize),
    mut queries: impl Iterator<Item = (usize, usize)>,
    block: &GpuKvBlock<T>,
    mutant: RingMutant,
) -> bool {
    queries.any(|q| {
        block.chunks.iter().any(|c| pair_window(spec, lens, q, c, mutant).is_ok_and(|w| w.sees_any(q.1, c.len)))
    })
}

/// A query chunk of a device: its positions, its queries on the device, and its running state.
struct QueryChunk<T> {
    start: usize,
    len: usize,
    q: CudaSlice<T>,
    state: DeviceState,
}

/// One simulated device of the forward ring.
pub struct GpuForwardDevice<T> {
    stream: Arc<CudaStream>,
    spec: AttentionSpec,
    lens: (usize, usize),
    chunks: Vec<QueryChunk<T>>,
    mutant: RingMutant,
}

/// (B, Lq, Lk) of a dense spec.
pub fn dense_dims(spec: &AttentionSpec) -> (usize, usize, usize) {
    let (q, k) = (spec.expected_shape(Operand::Q), spec.expected_shape(Operand::K));
    (q[0], q[2], k[2])
}

/// The dense spec of a chunk pair: the global batch, heads, head dims and scale, the chunks' lengths, no mask.
pub fn pair_spec(spec: &AttentionSpec, n_q: usize, n_k: usize) -> AttentionSpec {
    let (b, ..) = dense_dims(spec);
    AttentionSpec::dense(b, spec.n_heads_q, spec.n_heads_kv, n_q, n_k, spec.head_dim, spec.head_dim_v)
        .with_scale(spec.scale)
}

impl<T> Idle for GpuForwardDevice<T> {
    fn idle(&mut self) {
        self.chunks.clear();
    }
}

impl<T: GpuElement> GpuForwardDevice<T> {
    fn window(&self, q: &QueryChunk<T>, c: &KvChunk<T>) -> Result<ChunkWindow, GpuError> {
        pair_window(&self.spec, self.lens, (q.start, q.len), c, self.mutant)
    }
}

impl<T: GpuElement> RingWorker for GpuForwardDevice<T> {
    type Block = GpuKvBlock<T>;
    type Error = GpuRingError;
    const TRAVEL: Travel = Travel::ReadOnly;

    fn owner(&self, block: &GpuKvBlock<T>) -> usize {
        block.owner
    }

    fn parts(&self) -> usize {
        1
    }

    fn sees(&self, _part: usize, block: &GpuKvBlock<T>) -> bool {
        block_visible(&self.spec, self.lens, self.chunks.iter().map(|q| (q.start, q.len)), block, self.mutant)
    }

    fn attend(&mut self, _part: usize, block: &mut GpuKvBlock<T>) -> Result<(), GpuRingError> {
        for qi in 0..self.chunks.len() {
            for c in &block.chunks {
                let window = self.window(&self.chunks[qi], c)?;
                let q = &mut self.chunks[qi];
                if !window.sees_any(q.len, c.len) {
                    continue;
                }
                let pair = pair_spec(&self.spec, q.len, c.len);
                let mut part = DeviceState::for_spec(&self.stream, &pair)?;
                flash_forward_state_device(&self.stream, &pair, window, &q.q, &c.k, &c.v, &mut part)?;
                merge_states(&self.stream, &mut q.state, &part)?;
                if self.mutant == RingMutant::MergedTwice {
                    merge_states(&self.stream, &mut q.state, &part)?;
                }
            }
        }
        Ok(())
    }
}

/// The rows `range` of a dense tensor's sequence axis (axis 2), on `stream`.
fn upload_rows<T: DeviceRepr + ValidAsZeroBits + Clone>(
    stream: &Arc<CudaStream>,
    t: &ArrayD<T>,
    range: &Range<usize>,
) -> Result<CudaSlice<T>, GpuRingError> {
    let rows = t.slice_axis(Axis(2), Slice::from(range.clone())).as_standard_layout().to_owned();
    let data = rows.as_slice().expect("standard layout");
    Ok(if data.is_empty() { stream.alloc_zeros::<T>(1)? } else { stream.clone_htod(data)? })
}

/// `O`, LSE and the schedule's count of skipped (device, step) pairs of a GPU ring forward.
#[derive(Debug)]
pub struct GpuRingOutput<T> {
    /// `O`, shaped like the spec's.
    pub o: ArrayD<T>,
    /// LSE.
    pub lse: ArrayD<f32>,
    /// `(device, step)` pairs whose block no query of the device could see (the causal skip).
    pub skipped: usize,
}

/// The `extra_merges` of the forward `FlashRecipe` that covers the GPU ring forward over `config`: `2(P − 1)` for `P`
/// key chunks per sequence (`attnproof_gpu::ring_state`'s docs).
pub fn gpu_ring_recipe_extra_merges(config: RingConfig) -> usize {
    2 * config.pieces().saturating_sub(1)
}

/// A device after the ring: its worker and what the driver left it.
type Finished<W> = (W, DeviceRun<<W as RingWorker>::Block>);

/// Runs [`run_device`] for every `(worker, own block)` of `setups` on its own thread, device `g` over the link
/// `make_link(g)` made on that thread. A panic on a device thread is resumed on the caller's.
pub(crate) fn run_threads<W, L, F>(setups: Vec<(W, W::Block)>, make_link: &F) -> Vec<Result<Finished<W>, GpuRingError>>
where
    W: RingWorker<Error = GpuRingError> + Send,
    W::Block: Send,
    L: RingTransport<W::Block, Error = GpuRingError>,
    F: Fn(usize) -> Result<L, GpuRingError> + Sync,
{
    let n_devices = setups.len();
    std::thread::scope(|s| {
        let handles: Vec<_> = setups
            .into_iter()
            .enumerate()
            .map(|(device, (mut worker, own))| {
                s.spawn(move || {
                    let mut link = make_link(device)?;
                    let run = run_device(RingPosition { device, n_devices }, &mut worker, &mut link, own)?;
                    Ok((worker, run))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

/// Ring attention forward of `case` over `config.n_devices` simulated devices on `ctx`'s GPU: one stream per device,
/// blocks moved by [`StreamLink`].
pub fn gpu_ring_forward<T: GpuElement + Element>(
    ctx: &Arc<CudaContext>,
    case: &Case<T>,
    config: RingConfig,
) -> Result<GpuRingOutput<T>, GpuRingError> {
    gpu_ring_forward_mutated(ctx, case, config, RingMutant::None)
}

/// [`gpu_ring_forward`] with `mutant` injected (the tests' ring mutants).
pub fn gpu_ring_forward_mutated<T: GpuElement + Element>(
    ctx: &Arc<CudaContext>,
    case: &Case<T>,
    config: RingConfig,
    mutant: RingMutant,
) -> Result<GpuRingOutput<T>, GpuRingError> {
    let streams: Vec<Arc<CudaStream>> = (0..config.n_devices).map(|_| ctx.new_stream()).collect::<Result<_, _>>()?;
    run_forward_ring(case, config, mutant, &streams, once_per_device(stream_ring::<T>(&streams, mutant)?))
}

/// Checks that the GPU ring supports `case` over `config` on `streams`; returns (Lq, Lk).
fn check_ring_problem<T>(
    case: &Case<T>,
    config: RingConfig,
    streams: &[Arc<CudaStream>],
) -> Result<(usize, usize), GpuRingError> {
    let spec = &case.spec;
    spec.validate().map_err(GpuError::from)?;
    config.validate().map_err(|_| GpuRingError::Unsupported("a ring of zero devices or zero tiles"))?;
    if !matches!(spec.layout, Layout::Dense { .. }) {
        return Err(GpuRingError::Unsupported("varlen layouts"));
    }
    if streams.len() != config.n_devices {
        return Err(GpuRingError::Unsupported("a stream count other than the device count"));
    }
    let (_, len_q, len_k) = dense_dims(spec);
    Ok((len_q, len_k))
}

/// Every forward device's worker and own block, inputs uploaded on its stream (`streams[g]`), states at E2's start.
pub fn prepare_forward_ring<T: GpuElement + Element>(
    case: &Case<T>,
    config: RingConfig,
    mutant: RingMutant,
    streams: &[Arc<CudaStream>],
) -> Result<RingSetups<GpuForwardDevice<T>, T>, GpuRingError> {
    let spec = &case.spec;
    let (len_q, len_k) = check_ring_problem(case, config, streams)?;
    let mut setups = Vec::with_capacity(config.n_devices);
    for (device, stream) in streams.iter().enumerate() {
        let mut chunks = vec![];
        for range in config.positions(device, len_q).into_iter().filter(|r| !r.is_empty()) {
            let rows_spec = pair_spec(spec, range.len(), 1);
            chunks.push(QueryChunk {
                start: range.start,
                len: range.len(),
                q: upload_rows(stream, &case.q, &range)?,
                state: DeviceState::for_spec(stream, &rows_spec)?,
            });
        }
        let mut kv = vec![];
        for range in config.positions(device, len_k).into_iter().filter(|r| !r.is_empty()) {
            let (k, v) = (upload_rows(stream, &case.k, &range)?, upload_rows(stream, &case.v, &range)?);
            kv.push(KvChunk { start: range.start, len: range.len(), k, v, acc: None });
        }
        if mutant == RingMutant::ZigzagSwapped && kv.len() == 2 {
            // The data stays, the positions trade places (only chunks of equal length can swap without a shape error).
            if kv[0].len == kv[1].len {
                let (a, b) = (kv[0].start, kv[1].start);
                (kv[0].start, kv[1].start) = (b, a);
            }
        }
        let worker =
            GpuForwardDevice { stream: stream.clone(), spec: spec.clone(), lens: (len_q, len_k), chunks, mutant };
        setups.push((worker, GpuKvBlock::new(device, kv)));
    }
    Ok(setups)
}

/// The ring forward of `case` with device `g` computing on `streams[g]` and moving blocks through the link
/// `make_link(g)` makes on its own thread (an NCCL communicator must be created on the thread that uses it).
pub fn run_forward_ring<T, L, F>(
    case: &Case<T>,
    config: RingConfig,
    mutant: RingMutant,
    streams: &[Arc<CudaStream>],
    make_link: F,
) -> Result<GpuRingOutput<T>, GpuRingError>
where
    T: GpuElement + Element,
    L: RingTransport<GpuKvBlock<T>, Error = GpuRingError>,
    F: Fn(usize) -> Result<L, GpuRingError> + Sync,
{
    let setups = prepare_forward_ring(case, config, mutant, streams)?;
    let results = run_threads(setups, &make_link);
    let spec = &case.spec;
    let mut o = ArrayD::from_elem(spec.expected_shape(Operand::O), T::from_f32(0.0));
    let mut lse = ArrayD::from_elem(spec.expected_shape(Operand::RowStat), f32::NEG_INFINITY);
    let mut skipped = 0;
    for result in results {
        let (worker, run) = result?;
        skipped += run.skipped_parts;
        for q in &worker.chunks {
            let rows_spec = pair_spec(spec, q.len, 1);
            let (o_shape, lse_shape) =
                (rows_spec.expected_shape(Operand::O), rows_spec.expected_shape(Operand::RowStat));
            let n = |s: &[usize]| s.iter().product::<usize>();
            let mut o_dev = worker.stream.alloc_zeros::<T>(n(&o_shape).max(1))?;
            let mut lse_dev = worker.stream.alloc_zeros::<f32>(n(&lse_shape).max(1))?;
            finalize_state(&worker.stream, &rows_spec, &q.state, &mut o_dev, &mut lse_dev)?;
            let (o_host, lse_host) = (worker.stream.clone_dtoh(&o_dev)?, worker.stream.clone_dtoh(&lse_dev)?);
            let o_chunk = ArrayD::from_shape_vec(IxDyn(&o_shape), o_host[..n(&o_shape)].to_vec()).expect("O shape");
            let lse_chunk =
                ArrayD::from_shape_vec(IxDyn(&lse_shape), lse_host[..n(&lse_shape)].to_vec()).expect("LSE shape");
            let rows = Slice::from(q.start..q.start + q.len);
            o.slice_axis_mut(Axis(2), rows).assign(&o_chunk);
            lse.slice_axis_mut(Axis(2), rows).assign(&lse_chunk);
        }
    }
    Ok(GpuRingOutput { o, lse, skipped })
}

/// A query chunk of a device in the backward pass: its inputs, its `D`, and its f32 dQ accumulator.
struct BackwardQueryChunk<T> {
    start: usize,
    len: usize,
    q: CudaSlice<T>,
    lse: CudaSlice<f32>,
    d_out: CudaSlice<T>,
    delta: CudaSlice<f32>,
    dq_acc: CudaSlice<f32>,
}

/// One simulated device of the backward ring ([`Travel::Accumulating`]): every visible chunk pair adds its dQ to the
/// query chunk's accumulator and its dK, dV sums to the held block's travelling accumulators
/// (`attnproof_gpu::backward::ring_backward_pair`).
pub struct GpuBackwardDevice<T> {
    stream: Arc<CudaStream>,
    spec: AttentionSpec,
    lens: (usize, usize),
    chunks: Vec<BackwardQueryChunk<T>>,
}

impl<T> Idle for GpuBackwardDevice<T> {
    fn idle(&mut self) {
        self.chunks.clear();
    }
}

impl<T: GpuElement> GpuBackwardDevice<T> {
    fn window(&self, q: (usize, usize), c: &KvChunk<T>) -> Result<ChunkWindow, GpuError> {
        pair_window(&self.spec, self.lens, q, c, RingMutant::None)
    }
}

impl<T: GpuElement> RingWorker for GpuBackwardDevice<T> {
    type Block = GpuKvBlock<T>;
    type Error = GpuRingError;
    const TRAVEL: Travel = Travel::Accumulating;

    fn owner(&self, block: &GpuKvBlock<T>) -> usize {
        block.owner
    }

    fn parts(&self) -> usize {
        1
    }

    fn sees(&self, _part: usize, block: &GpuKvBlock<T>) -> bool {
        block_visible(&self.spec, self.lens, self.chunks.iter().map(|q| (q.start, q.len)), block, RingMutant::None)
    }

    fn attend(&mut self, _part: usize, block: &mut GpuKvBlock<T>) -> Result<(), GpuRingError> {
        use attnproof_gpu::backward::{PairBackwardInputs, ring_backward_pair};
        for qi in 0..self.chunks.len() {
            for c in block.chunks.iter_mut() {
                let (start, len) = (self.chunks[qi].start, self.chunks[qi].len);
                let window = self.window((start, len), c)?;
                if !window.sees_any(len, c.len) {
                    continue;
                }
                let pair = pair_spec(&self.spec, len, c.len);
                let acc = c.acc.as_mut().ok_or(GpuRingError::Unsupported("a backward block without accumulators"))?;
                let q = &mut self.chunks[qi];
                let inputs =
                    PairBackwardInputs { q: &q.q, k: &c.k, v: &c.v, lse: &q.lse, d_out: &q.d_out, delta: &q.delta };
                ring_backward_pair(&self.stream, &pair, window, inputs, &mut q.dq_acc, acc)?;
            }
        }
        Ok(())
    }
}

/// The gradients (and `D`) of a GPU ring backward, host arrays shaped like the spec's.
#[derive(Debug)]
pub struct GpuRingGrads<T> {
    /// Gradient of Q.
    pub dq: ArrayD<T>,
    /// Gradient of K.
    pub dk: ArrayD<T>,
    /// Gradient of V.
    pub dv: ArrayD<T>,
    /// `D = rowsum(dO ∘ O)`.
    pub delta: ArrayD<f32>,
}

/// The forward's outputs and the upstream gradient a backward starts from.
#[derive(Clone, Copy, Debug)]
pub struct BackwardStart<'a, T> {
    /// The forward's `O`.
    pub o: &'a ArrayD<T>,
    /// The forward's LSE.
    pub lse: &'a ArrayD<f32>,
    /// The upstream gradient.
    pub d_out: &'a ArrayD<T>,
}

/// Ring attention backward (E11, dK/dV travelling home) of `case` over `config.n_devices` simulated devices on
/// `ctx`'s GPU, blocks and their accumulators moved by [`StreamLink`].
pub fn gpu_ring_backward<T: GpuElement + Element>(
    ctx: &Arc<CudaContext>,
    case: &Case<T>,
    start: BackwardStart<'_, T>,
    config: RingConfig,
) -> Result<GpuRingGrads<T>, GpuRingError> {
    let streams: Vec<Arc<CudaStream>> = (0..config.n_devices).map(|_| ctx.new_stream()).collect::<Result<_, _>>()?;
    let links = once_per_device(stream_ring::<T>(&streams, RingMutant::None)?);
    run_backward_ring(case, start, config, &streams, links)
}

/// Every backward device's worker (its query chunks with `D` computed, dQ accumulators zero) and own block (dK, dV
/// accumulators zero), uploaded on its stream.
pub fn prepare_backward_ring<T: GpuElement + Element>(
    case: &Case<T>,
    start: BackwardStart<'_, T>,
    config: RingConfig,
    streams: &[Arc<CudaStream>],
) -> Result<RingSetups<GpuBackwardDevice<T>, T>, GpuRingError> {
    use attnproof_gpu::backward::{ring_backward_preprocess, ring_dkv_accumulator_len};
    let spec = &case.spec;
    let (len_q, len_k) = check_ring_problem(case, config, streams)?;
    let mut setups = Vec::with_capacity(config.n_devices);
    for (device, stream) in streams.iter().enumerate() {
        let mut chunks = vec![];
        for range in config.positions(device, len_q).into_iter().filter(|r| !r.is_empty()) {
            let rows_spec = pair_spec(spec, range.len(), 1);
            let (o, d_out) = (upload_rows(stream, start.o, &range)?, upload_rows(stream, start.d_out, &range)?);
            let rows = rows_spec.expected_shape(Operand::RowStat).iter().product::<usize>();
            let mut delta = stream.alloc_zeros::<f32>(rows.max(1))?;
            ring_backward_preprocess(stream, &rows_spec, &o, &d_out, &mut delta)?;
            let q = upload_rows(stream, &case.q, &range)?;
            let dq_acc = stream.alloc_zeros::<f32>(q.len())?;
            let lse = upload_rows(stream, start.lse, &range)?;
            chunks.push(BackwardQueryChunk { start: range.start, len: range.len(), q, lse, d_out, delta, dq_acc });
        }
        let mut kv = vec![];
        for range in config.positions(device, len_k).into_iter().filter(|r| !r.is_empty()) {
            let (k, v) = (upload_rows(stream, &case.k, &range)?, upload_rows(stream, &case.v, &range)?);
            let acc = stream.alloc_zeros::<f32>(ring_dkv_accumulator_len(&pair_spec(spec, 1, range.len())).max(1))?;
            kv.push(KvChunk { start: range.start, len: range.len(), k, v, acc: Some(acc) });
        }
        let worker = GpuBackwardDevice { stream: stream.clone(), spec: spec.clone(), lens: (len_q, len_k), chunks };
        setups.push((worker, GpuKvBlock::new(device, kv)));
    }
    Ok(setups)
}

/// The ring backward of `case` with device `g` computing on `streams[g]` and moving blocks through `make_link(g)`.
pub fn run_backward_ring<T, L, F>(
    case: &Case<T>,
    start: BackwardStart<'_, T>,
    config: RingConfig,
    streams: &[Arc<CudaStream>],
    make_link: F,
) -> Result<GpuRingGrads<T>, GpuRingError>
where
    T: GpuElement + Element,
    L: RingTransport<GpuKvBlock<T>, Error = GpuRingError>,
    F: Fn(usize) -> Result<L, GpuRingError> + Sync,
{
    use attnproof_gpu::backward::{ring_backward_finish_dkv, ring_backward_finish_dq};
    let setups = prepare_backward_ring(case, start, config, streams)?;
    let results = run_threads(setups, &make_link);
    let spec = &case.spec;
    let nan = T::from_f32(f32::NAN);
    let mut grads = GpuRingGrads {
        dq: ArrayD::from_elem(spec.expected_shape(Operand::Q), nan),
        dk: ArrayD::from_elem(spec.expected_shape(Operand::K), nan),
        dv: ArrayD::from_elem(spec.expected_shape(Operand::V), nan),
        delta: ArrayD::from_elem(spec.expected_shape(Operand::RowStat), f32::NAN),
    };
    let n = |s: &[usize]| s.iter().product::<usize>();
    for result in results {
        let (worker, run) = result?;
        let stream = &worker.stream;
        let download = |buf: &CudaSlice<T>, shape: &[usize]| -> Result<ArrayD<T>, GpuRingError> {
            let host = stream.clone_dtoh(buf)?;
            Ok(ArrayD::from_shape_vec(IxDyn(shape), host[..n(shape)].to_vec()).expect("shape"))
        };
        for q in &worker.chunks {
            let rows_spec = pair_spec(spec, q.len, 1);
            let mut dq = stream.alloc_zeros::<T>(q.q.len())?;
            ring_backward_finish_dq(stream, &rows_spec, &q.dq_acc, &mut dq)?;
            let rows = Slice::from(q.start..q.start + q.len);
            grads.dq.slice_axis_mut(Axis(2), rows).assign(&download(&dq, &rows_spec.expected_shape(Operand::Q))?);
            let lse_shape = rows_spec.expected_shape(Operand::RowStat);
            let delta = stream.clone_dtoh(&q.delta)?;
            let delta = ArrayD::from_shape_vec(IxDyn(&lse_shape), delta[..n(&lse_shape)].to_vec()).expect("shape");
            grads.delta.slice_axis_mut(Axis(2), rows).assign(&delta);
        }
        // The block back home carries every device's dK, dV sums for this device's keys.
        for c in &run.held.chunks {
            let k_spec = pair_spec(spec, 1, c.len);
            let acc = c.acc.as_ref().ok_or(GpuRingError::Unsupported("a backward block without accumulators"))?;
            let (mut dk, mut dv) = (stream.alloc_zeros::<T>(c.k.len())?, stream.alloc_zeros::<T>(c.v.len())?);
            ring_backward_finish_dkv(stream, &k_spec, acc, &mut dk, &mut dv)?;
            let rows = Slice::from(c.start..c.start + c.len);
            grads.dk.slice_axis_mut(Axis(2), rows).assign(&download(&dk, &k_spec.expected_shape(Operand::K))?);
            grads.dv.slice_axis_mut(Axis(2), rows).assign(&download(&dv, &k_spec.expected_shape(Operand::V))?);
        }
    }
    Ok(grads)
}
