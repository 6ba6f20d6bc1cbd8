//! The GPU ring forward (E11/E11a with E4, E5): a [`RingWorker`] per device ([`GpuForwardDevice`]) that attends its
//! query chunks to each visiting KV block, each visible chunk pair's partial state from the forward kernel's
//! `STATE_OUT` mode merged into its query chunk's running state, and the run that finalizes every running state
//! into `O` and LSE.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Operand;
use attnproof_ring_driver::{RingSplit, RingTransport, RingWorker, Travel};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use ndarray::{ArrayD, Axis, IxDyn, Slice};

use super::block::{GpuKvBlock, KvChunk, block_visible, pair_window};
use super::devices::{Idle, RingSetups, once_per_device, run_threads};
use super::link::stream_ring;
use super::problem::{GpuRingError, RingInputs, check_ring_problem, pair_spec, upload_rows};
use super::state::{ChunkWindow, DeviceState, finalize_state, merge_states};
use crate::common::GpuElement;
use crate::error::GpuError;
use crate::flash::flash_forward_state_device;

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
}

impl<T> Idle for GpuForwardDevice<T> {
    fn idle(&mut self) {
        self.chunks.clear();
    }
}

impl<T: GpuElement> GpuForwardDevice<T> {
    fn window(&self, q: &QueryChunk<T>, c: &KvChunk<T>) -> Result<ChunkWindow, GpuError> {
        pair_window(&self.spec, self.lens, (q.start, q.len), c)
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
        block_visible(&self.spec, self.lens, self.chunks.iter().map(|q| (q.start, q.len)), block)
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
            }
        }
        Ok(())
    }
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

/// Ring attention forward of `inputs` over `split.n_devices` simulated devices on `ctx`'s GPU: one stream per device,
/// blocks moved by [`super::link::StreamLink`].
pub fn gpu_ring_forward<T: GpuElement + Default>(
    ctx: &Arc<CudaContext>,
    inputs: &RingInputs<'_, T>,
    split: RingSplit,
) -> Result<GpuRingOutput<T>, GpuRingError> {
    let streams: Vec<Arc<CudaStream>> = (0..split.n_devices).map(|_| ctx.new_stream()).collect::<Result<_, _>>()?;
    run_forward_ring(inputs, split, &streams, once_per_device(stream_ring::<T>(&streams)?))
}

/// Every forward device's worker and own block, inputs uploaded on its stream (`streams[g]`), states at E2's start.
pub fn prepare_forward_ring<T: GpuElement>(
    inputs: &RingInputs<'_, T>,
    split: RingSplit,
    streams: &[Arc<CudaStream>],
) -> Result<RingSetups<GpuForwardDevice<T>, T>, GpuRingError> {
    let spec = inputs.spec;
    let (len_q, len_k) = check_ring_problem(inputs, split, streams)?;
    let mut setups = Vec::with_capacity(split.n_devices);
    for (device, stream) in streams.iter().enumerate() {
        let mut chunks = vec![];
        for range in split.positions(device, len_q).into_iter().filter(|r| !r.is_empty()) {
            let rows_spec = pair_spec(spec, range.len(), 1);
            chunks.push(QueryChunk {
                start: range.start,
                len: range.len(),
                q: upload_rows(stream, &inputs.q, &range)?,
                state: DeviceState::for_spec(stream, &rows_spec)?,
            });
        }
        let mut kv = vec![];
        for range in split.positions(device, len_k).into_iter().filter(|r| !r.is_empty()) {
            let (k, v) = (upload_rows(stream, &inputs.k, &range)?, upload_rows(stream, &inputs.v, &range)?);
            kv.push(KvChunk { start: range.start, len: range.len(), k, v, acc: None });
        }
        let worker = GpuForwardDevice { stream: stream.clone(), spec: spec.clone(), lens: (len_q, len_k), chunks };
        setups.push((worker, GpuKvBlock::new(device, kv)));
    }
    Ok(setups)
}

/// The ring forward of `inputs` with device `g` computing on `streams[g]` and moving blocks through the link
/// `make_link(g)` makes on its own thread (an NCCL communicator must be created on the thread that uses it).
pub fn run_forward_ring<T, L, F>(
    inputs: &RingInputs<'_, T>,
    split: RingSplit,
    streams: &[Arc<CudaStream>],
    make_link: F,
) -> Result<GpuRingOutput<T>, GpuRingError>
where
    T: GpuElement + Default,
    L: RingTransport<GpuKvBlock<T>, Error = GpuRingError>,
    F: Fn(usize) -> Result<L, GpuRingError> + Sync,
{
    let setups = prepare_forward_ring(inputs, split, streams)?;
    let results = run_threads(setups, &make_link);
    let spec = inputs.spec;
    // Every query row belongs to exactly one device's chunk, so each element below is overwritten.
    let mut o = ArrayD::from_elem(spec.expected_shape(Operand::O), T::default());
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
