//! The NCCL ring transport: one GPU per ring device, KV blocks sent to the successor and received from the
//! predecessor with NCCL point-to-point calls on a communication stream of each GPU, so that a hop overlaps the
//! attention the compute stream runs meanwhile (E11's two buffers: the held block and the one being received).
//!
//! Keep NVLink multicast off on shared hosts: set `NCCL_NVLS_ENABLE=0` in the environment before the communicators
//! are created (the GPU bundle's `run.sh` does).
//!
//! The receiver knows what arrives without asking: at hop `k` device `g` receives the block of
//! `(g − k − 1) mod G` (E11), whose chunks are that device's ring positions ([`RingSplit::positions`]), so every
//! receive buffer is allocated with its exact size before the hop.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::online::ring_block_at;
use attnproof_ring_driver::{RingFault, RingSplit, RingTransport};
use cudarc::driver::{CudaContext, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::safe::{Comm, Id, NcclType};

use super::backward::{GpuRingGrads, prepare_backward_ring, run_backward_ring};
use super::block::{GpuKvBlock, KvChunk};
use super::forward::{GpuRingOutput, prepare_forward_ring, run_forward_ring};
use super::problem::{BackwardStart, GpuRingError, RingInputs, dense_dims};
use super::timing::{RingVariant, time_variant};
use crate::common::GpuElement;

/// The shapes of the blocks of a ring: which key positions each device owns, and the elements of its K and V chunks.
#[derive(Clone, Copy, Debug)]
pub struct BlockLayout {
    /// How the ring cuts sequences among its devices.
    pub split: RingSplit,
    /// Keys per sequence.
    pub len_k: usize,
    /// Batch, KV heads, head dims: a chunk of `n` keys is `[batch, n_heads_kv, n, d]` (K) and `[…, dv]` (V).
    pub batch: usize,
    /// KV heads.
    pub n_heads_kv: usize,
    /// Head dim of K.
    pub d: usize,
    /// Head dim of V.
    pub dv: usize,
    /// `Some(n_heads_q)` when blocks carry the backward's f32 dK, dV accumulators (one per query head), `None` in
    /// the forward pass.
    pub accumulators: Option<usize>,
}

impl BlockLayout {
    /// `(first key, keys, K elements, V elements)` of each nonempty chunk `owner` holds.
    pub fn chunks(&self, owner: usize) -> Vec<(usize, usize, usize, usize)> {
        let per_key = self.batch * self.n_heads_kv;
        self.split
            .positions(owner, self.len_k)
            .into_iter()
            .filter(|r| !r.is_empty())
            .map(|r| (r.start, r.len(), per_key * r.len() * self.d, per_key * r.len() * self.dv))
            .collect()
    }

    /// f32 accumulator elements of a chunk of `len` keys (backward blocks only).
    pub fn accumulator_len(&self, len: usize) -> Option<usize> {
        self.accumulators.map(|hq| hq * self.batch * len * (self.d + self.dv))
    }
}

/// One device's NCCL link. `post` makes the communication stream wait for everything the compute stream has enqueued
/// (the held block is ready), allocates the receive buffers, and enqueues the send to the successor and the receive
/// from the predecessor in one NCCL group (so neither waits for the other); an event recorded after them is what
/// `wait` makes the compute stream wait on. In the backward pass `prefetch` exchanges K and V that way before the
/// attention, and `post` the dK, dV accumulators after it, in a second group. The sent buffers stay alive until the
/// send completes: cudarc records the send's read on them, and a buffer is freed only after its recorded uses.
#[derive(Debug)]
pub struct NcclLink<T> {
    device: usize,
    n_devices: usize,
    comm: Comm,
    compute: Arc<CudaStream>,
    layout: BlockLayout,
    hops: usize,
    /// The K and V receives `prefetch` started (backward blocks): `post` adds the accumulators.
    prefetched: Option<Vec<KvChunk<T>>>,
    pending: Option<GpuKvBlock<T>>,
}

impl<T> NcclLink<T> {
    /// Device `rank`'s link on the communicator `comm` (whose stream is the communication stream), with `compute` the
    /// stream its worker computes on (the same GPU).
    pub fn new(comm: Comm, compute: Arc<CudaStream>, layout: BlockLayout) -> Self {
        NcclLink {
            device: comm.rank(),
            n_devices: comm.world_size(),
            comm,
            compute,
            layout,
            hops: 0,
            prefetched: None,
            pending: None,
        }
    }
}

impl<T: DeviceRepr + ValidAsZeroBits + NcclType> NcclLink<T> {
    /// Enqueues, in one NCCL group on the communication stream (after the compute stream's work so far), the send of
    /// `outgoing`'s K and V to the successor and the receive of the predecessor's into fresh buffers for this hop's
    /// block: its chunks, without accumulators.
    fn exchange_kv(&mut self, outgoing: &GpuKvBlock<T>) -> Result<Vec<KvChunk<T>>, GpuRingError> {
        let comm_stream = self.comm.stream().clone();
        comm_stream.join(&self.compute)?;
        let owner = ring_block_at(self.device, self.hops + 1, self.n_devices);
        let mut incoming = Vec::new();
        for (start, len, k_elems, v_elems) in self.layout.chunks(owner) {
            let (k, v) = (comm_stream.alloc_zeros::<T>(k_elems)?, comm_stream.alloc_zeros::<T>(v_elems)?);
            incoming.push(KvChunk { start, len, k, v, acc: None });
        }
        let (next, prev) = self.neighbours();
        let mut group = self.comm.group();
        for c in &outgoing.chunks {
            group.send(c.k.as_view(), next)?;
            group.send(c.v.as_view(), next)?;
        }
        for c in &mut incoming {
            group.recv(c.k.as_view_mut(), prev)?;
            group.recv(c.v.as_view_mut(), prev)?;
        }
        drop(group); // the group ends here: NCCL enqueues the sends and receives on the communication stream
        Ok(incoming)
    }

    /// (successor, predecessor) ranks.
    fn neighbours(&self) -> (i32, i32) {
        let g = self.n_devices;
        (((self.device + 1) % g) as i32, ((self.device + g - 1) % g) as i32)
    }
}

impl<T: DeviceRepr + ValidAsZeroBits + NcclType> RingTransport<GpuKvBlock<T>> for NcclLink<T> {
    type Error = GpuRingError;

    fn prefetch(&mut self, held: &GpuKvBlock<T>) -> Result<(), GpuRingError> {
        if self.pending.is_some() || self.prefetched.is_some() {
            return Err(GpuRingError::Unsupported("a prefetch before the previous hop's wait"));
        }
        self.prefetched = Some(self.exchange_kv(held)?);
        Ok(())
    }

    fn post(&mut self, outgoing: &GpuKvBlock<T>) -> Result<(), GpuRingError> {
        if self.pending.is_some() {
            return Err(GpuRingError::Unsupported("a post before the previous hop's wait"));
        }
        let mut incoming = match self.prefetched.take() {
            Some(kv) => kv,
            None => self.exchange_kv(outgoing)?,
        };
        // The accumulators leave after the attention that wrote them: a second group, ordered after it.
        let comm_stream = self.comm.stream().clone();
        if outgoing.chunks.iter().any(|c| c.acc.is_some() != self.layout.accumulators.is_some()) {
            return Err(GpuRingError::Unsupported("a block whose accumulators do not match the ring's layout"));
        }
        if self.layout.accumulators.is_some() {
            comm_stream.join(&self.compute)?;
            for c in &mut incoming {
                c.acc = self.layout.accumulator_len(c.len).map(|n| comm_stream.alloc_zeros::<f32>(n)).transpose()?;
            }
            let (next, prev) = self.neighbours();
            let mut group = self.comm.group();
            for acc in outgoing.chunks.iter().filter_map(|c| c.acc.as_ref()) {
                group.send(acc.as_view(), next)?;
            }
            for acc in incoming.iter_mut().filter_map(|c| c.acc.as_mut()) {
                group.recv(acc.as_view_mut(), prev)?;
            }
        }
        let owner = ring_block_at(self.device, self.hops + 1, self.n_devices);
        let ready = Some(Arc::new(comm_stream.record_event(None)?));
        self.pending = Some(GpuKvBlock { owner, chunks: incoming, ready });
        self.hops += 1;
        Ok(())
    }

    fn wait(&mut self) -> Result<GpuKvBlock<T>, GpuRingError> {
        let block = self.pending.take().ok_or(RingFault::Disconnected { device: self.device })?;
        if let Some(ready) = &block.ready {
            self.compute.wait(ready)?;
        }
        Ok(block)
    }
}

/// What every NCCL ring run shares: a compute stream per GPU, the blocks' layout and the communicator id.
struct NcclRing {
    compute: Vec<Arc<CudaStream>>,
    layout: BlockLayout,
    id: Id,
}

impl NcclRing {
    /// The ring of `contexts` (one GPU per device) for `spec`; `accumulators` as in [`BlockLayout`].
    fn new(
        contexts: &[Arc<CudaContext>],
        spec: &AttentionSpec,
        split: RingSplit,
        accumulators: Option<usize>,
    ) -> Result<Self, GpuRingError> {
        if contexts.len() != split.n_devices {
            return Err(GpuRingError::Unsupported("a GPU count other than the ring's device count"));
        }
        let (batch, _, len_k) = dense_dims(spec);
        let layout = BlockLayout {
            split,
            len_k,
            batch,
            n_heads_kv: spec.n_heads_kv,
            d: spec.head_dim,
            dv: spec.head_dim_v,
            accumulators,
        };
        let compute = contexts.iter().map(|c| c.new_stream()).collect::<Result<_, _>>()?;
        Ok(NcclRing { compute, layout, id: Id::new()? })
    }

    /// Device `device`'s link, created on the calling thread (NCCL binds the communicator to the current device).
    fn link<T>(&self, contexts: &[Arc<CudaContext>], device: usize) -> Result<NcclLink<T>, GpuRingError> {
        let ctx = &contexts[device];
        ctx.bind_to_thread()?;
        let comm = Comm::from_rank(ctx.new_stream()?, device, contexts.len(), self.id)?;
        Ok(NcclLink::new(comm, self.compute[device].clone(), self.layout))
    }
}

/// Ring attention forward of `inputs` over `contexts.len()` GPUs (one per ring device, `split.n_devices` of them),
/// blocks moved by NCCL. Each device thread creates its communicator (`ncclCommInitRank` with a shared id).
pub fn nccl_ring_forward<T>(
    contexts: &[Arc<CudaContext>],
    inputs: &RingInputs<'_, T>,
    split: RingSplit,
) -> Result<GpuRingOutput<T>, GpuRingError>
where
    T: GpuElement + Default + NcclType,
{
    let ring = NcclRing::new(contexts, inputs.spec, split, None)?;
    run_forward_ring(inputs, split, &ring.compute, |device| ring.link(contexts, device))
}

/// Ring attention backward of `inputs` over `contexts.len()` GPUs, blocks and their dK, dV accumulators moved by
/// NCCL.
pub fn nccl_ring_backward<T>(
    contexts: &[Arc<CudaContext>],
    inputs: &RingInputs<'_, T>,
    start: &BackwardStart<'_, T>,
    split: RingSplit,
) -> Result<GpuRingGrads<T>, GpuRingError>
where
    T: GpuElement + Default + NcclType,
{
    let ring = NcclRing::new(contexts, inputs.spec, split, Some(inputs.spec.n_heads_q))?;
    run_backward_ring(inputs, start, split, &ring.compute, |device| ring.link(contexts, device))
}

/// Milliseconds of one forward ring of `inputs` over `contexts.len()` GPUs through NCCL, in `variant`
/// ([`super::timing`]; communicators are set up before each device's clock starts).
pub fn time_nccl_forward<T>(
    contexts: &[Arc<CudaContext>],
    inputs: &RingInputs<'_, T>,
    split: RingSplit,
    variant: RingVariant,
) -> Result<f64, GpuRingError>
where
    T: GpuElement + NcclType,
{
    let ring = NcclRing::new(contexts, inputs.spec, split, None)?;
    let setups = prepare_forward_ring(inputs, split, &ring.compute)?;
    time_variant(setups, &ring.compute, variant, |device| ring.link(contexts, device))
}

/// Milliseconds of one backward ring of `inputs` from `start` over `contexts.len()` GPUs through NCCL, in `variant`.
pub fn time_nccl_backward<T>(
    contexts: &[Arc<CudaContext>],
    inputs: &RingInputs<'_, T>,
    start: &BackwardStart<'_, T>,
    split: RingSplit,
    variant: RingVariant,
) -> Result<f64, GpuRingError>
where
    T: GpuElement + NcclType,
{
    let ring = NcclRing::new(contexts, inputs.spec, split, Some(inputs.spec.n_heads_q))?;
    let setups = prepare_backward_ring(inputs, start, split, &ring.compute)?;
    time_variant(setups, &ring.compute, variant, |device| ring.link(contexts, device))
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_ring_driver::RingLayout;

    #[test]
    fn a_receiver_expects_exactly_the_chunks_its_predecessor_holds_at_each_hop() {
        for layout in [RingLayout::Contiguous, RingLayout::Zigzag] {
            for g in 1..=8 {
                let split = RingSplit { n_devices: g, layout };
                let block = BlockLayout {
                    split,
                    len_k: 1000 + g,
                    batch: 2,
                    n_heads_kv: 3,
                    d: 16,
                    dv: 8,
                    accumulators: Some(6),
                };
                let total: usize = (0..g).map(|o| block.chunks(o).iter().map(|c| c.1).sum::<usize>()).sum();
                assert_eq!(total, 1000 + g, "{layout:?} G={g}: the blocks partition the keys");
                for device in 0..g {
                    for hop in 0..g {
                        // What device − 1 holds at step `hop` is what `device` receives by its hop `hop`.
                        let sent = ring_block_at((device + g - 1) % g, hop, g);
                        let expected = ring_block_at(device, hop + 1, g);
                        assert_eq!(sent, expected, "{layout:?} G={g} device {device} hop {hop}");
                        for (start, len, k, v) in block.chunks(expected) {
                            assert_eq!((k, v), (2 * 3 * len * 16, 2 * 3 * len * 8), "chunk at {start}");
                            assert_eq!(block.accumulator_len(len), Some(6 * 2 * len * 24));
                        }
                    }
                }
            }
        }
    }
}
