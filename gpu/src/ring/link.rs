//! The simulated devices' link ([`StreamLink`]): `G` ring devices on one GPU, one compute stream each, a hop being a
//! device-to-device copy on the sender's communication stream ordered by events.

use std::sync::{Arc, mpsc};

use attnproof_ring_driver::{RingFault, RingTransport};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};

use super::block::{GpuKvBlock, KvChunk};
use super::problem::GpuRingError;

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
    /// The K and V copies `prefetch` started (backward blocks): `post` adds the accumulators.
    prefetched: Option<Vec<KvPair<T>>>,
}

/// One chunk's K and V buffers.
type KvPair<T> = (CudaSlice<T>, CudaSlice<T>);

impl<T: DeviceRepr> StreamLink<T> {
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
        self.prefetched = Some(self.copy_kv(held)?);
        Ok(())
    }

    fn post(&mut self, outgoing: &GpuKvBlock<T>) -> Result<(), GpuRingError> {
        let kv = match self.prefetched.take() {
            Some(kv) => kv,
            None => self.copy_kv(outgoing)?,
        };
        // The accumulators (what the attention just wrote) leave after it: the join orders the copy after it.
        self.comm.join(&self.stream)?;
        let mut chunks = Vec::with_capacity(outgoing.chunks.len());
        for (c, (k, v)) in outgoing.chunks.iter().zip(kv) {
            let acc = c.acc.as_ref().map(|a| self.comm.clone_dtod(a)).transpose()?;
            chunks.push(KvChunk { start: c.start, len: c.len, k, v, acc });
        }
        let ready = Some(Arc::new(self.comm.record_event(None)?));
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
pub fn stream_ring<T>(streams: &[Arc<CudaStream>]) -> Result<Vec<StreamLink<T>>, GpuRingError> {
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
                prefetched: None,
            })
        })
        .collect()
}
