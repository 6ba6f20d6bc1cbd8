//! The GPU ring backward (E11, dK/dV travelling home): a [`RingWorker`] per device ([`GpuBackwardDevice`]) whose
//! every visible chunk pair adds its dQ to the query chunk's f32 accumulator and its dK, dV sums to the held block's
//! travelling f32 accumulators, and the run that turns the accumulators into dQ, dK and dV once every block is home.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Operand;
use attnproof_ring_driver::{RingSplit, RingTransport, RingWorker, Travel};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use ndarray::{ArrayD, Axis, IxDyn, Slice};

use super::backward_steps::{
    PairBackwardInputs, ring_backward_finish_dkv, ring_backward_finish_dq, ring_backward_pair,
    ring_backward_preprocess, ring_dkv_accumulator_len,
};
use super::block::{GpuKvBlock, KvChunk, block_visible, pair_window};
use super::devices::{Idle, RingSetups, once_per_device, run_threads};
use super::link::stream_ring;
use super::problem::{
    BackwardStart, GpuRingError, RingInputs, check_ring_problem, check_shape, pair_spec, upload_rows,
};
use super::state::ChunkWindow;
use crate::common::GpuElement;
use crate::error::GpuError;

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
/// ([`ring_backward_pair`]).
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
        pair_window(&self.spec, self.lens, q, c)
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
        block_visible(&self.spec, self.lens, self.chunks.iter().map(|q| (q.start, q.len)), block)
    }

    fn attend(&mut self, _part: usize, block: &mut GpuKvBlock<T>) -> Result<(), GpuRingError> {
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

/// Ring attention backward (E11, dK/dV travelling home) of `inputs` over `split.n_devices` simulated devices on
/// `ctx`'s GPU, blocks and their accumulators moved by [`super::link::StreamLink`].
pub fn gpu_ring_backward<T: GpuElement + Default>(
    ctx: &Arc<CudaContext>,
    inputs: &RingInputs<'_, T>,
    start: &BackwardStart<'_, T>,
    split: RingSplit,
) -> Result<GpuRingGrads<T>, GpuRingError> {
    let streams: Vec<Arc<CudaStream>> = (0..split.n_devices).map(|_| ctx.new_stream()).collect::<Result<_, _>>()?;
    let links = once_per_device(stream_ring::<T>(&streams)?);
    run_backward_ring(inputs, start, split, &streams, links)
}

/// Every backward device's worker (its query chunks with `D` computed, dQ accumulators zero) and own block (dK, dV
/// accumulators zero), uploaded on its stream.
pub fn prepare_backward_ring<T: GpuElement>(
    inputs: &RingInputs<'_, T>,
    start: &BackwardStart<'_, T>,
    split: RingSplit,
    streams: &[Arc<CudaStream>],
) -> Result<RingSetups<GpuBackwardDevice<T>, T>, GpuRingError> {
    let spec = inputs.spec;
    let (len_q, len_k) = check_ring_problem(inputs, split, streams)?;
    check_shape(spec, "o", Operand::O, &start.o)?;
    check_shape(spec, "lse", Operand::RowStat, &start.lse)?;
    check_shape(spec, "d_out", Operand::O, &start.d_out)?;
    let mut setups = Vec::with_capacity(split.n_devices);
    for (device, stream) in streams.iter().enumerate() {
        let mut chunks = vec![];
        for range in split.positions(device, len_q).into_iter().filter(|r| !r.is_empty()) {
            let rows_spec = pair_spec(spec, range.len(), 1);
            let (o, d_out) = (upload_rows(stream, &start.o, &range)?, upload_rows(stream, &start.d_out, &range)?);
            let rows = rows_spec.expected_shape(Operand::RowStat).iter().product::<usize>();
            let mut delta = stream.alloc_zeros::<f32>(rows.max(1))?;
            ring_backward_preprocess(stream, &rows_spec, &o, &d_out, &mut delta)?;
            let q = upload_rows(stream, &inputs.q, &range)?;
            let dq_acc = stream.alloc_zeros::<f32>(q.len())?;
            let lse = upload_rows(stream, &start.lse, &range)?;
            chunks.push(BackwardQueryChunk { start: range.start, len: range.len(), q, lse, d_out, delta, dq_acc });
        }
        let mut kv = vec![];
        for range in split.positions(device, len_k).into_iter().filter(|r| !r.is_empty()) {
            let (k, v) = (upload_rows(stream, &inputs.k, &range)?, upload_rows(stream, &inputs.v, &range)?);
            let acc = stream.alloc_zeros::<f32>(ring_dkv_accumulator_len(&pair_spec(spec, 1, range.len())).max(1))?;
            kv.push(KvChunk { start: range.start, len: range.len(), k, v, acc: Some(acc) });
        }
        let worker = GpuBackwardDevice { stream: stream.clone(), spec: spec.clone(), lens: (len_q, len_k), chunks };
        setups.push((worker, GpuKvBlock::new(device, kv)));
    }
    Ok(setups)
}

/// The ring backward of `inputs` with device `g` computing on `streams[g]` and moving blocks through `make_link(g)`.
pub fn run_backward_ring<T, L, F>(
    inputs: &RingInputs<'_, T>,
    start: &BackwardStart<'_, T>,
    split: RingSplit,
    streams: &[Arc<CudaStream>],
    make_link: F,
) -> Result<GpuRingGrads<T>, GpuRingError>
where
    T: GpuElement + Default,
    L: RingTransport<GpuKvBlock<T>, Error = GpuRingError>,
    F: Fn(usize) -> Result<L, GpuRingError> + Sync,
{
    let setups = prepare_backward_ring(inputs, start, split, streams)?;
    let results = run_threads(setups, &make_link);
    let spec = inputs.spec;
    // Every query row belongs to exactly one device's query chunk and every key to exactly one block, which comes
    // home to its owner, so each element below is overwritten.
    let mut grads = GpuRingGrads {
        dq: ArrayD::from_elem(spec.expected_shape(Operand::Q), T::default()),
        dk: ArrayD::from_elem(spec.expected_shape(Operand::K), T::default()),
        dv: ArrayD::from_elem(spec.expected_shape(Operand::V), T::default()),
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
