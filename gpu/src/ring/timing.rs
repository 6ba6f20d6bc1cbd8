//! Device-time measurements of the GPU ring (what `ring_bench` reports): one ring run timed by CUDA events on every
//! device's compute stream, and the two runs that split it into its parts, compute without communication
//! ([`RingVariant::ComputeOnly`]: every block staged in advance where E11 would deliver it) and communication without
//! compute ([`RingVariant::CommOnly`]: the same hops, no attention). Overlap is then how much of the communication
//! the full ring hides: `(compute + comm − ring) / comm`, clamped to `[0, 1]`.
//!
//! Inputs are uploaded and `D` computed before the clock starts; the forward's final E5 and the backward's dQ, dK, dV
//! conversions run after it stops (each is one pass over `O(L·D)` elements; the attention is `O(L²·D)`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use attnproof_oracle::online::ring_block_at;
use attnproof_ring_driver::{RingFault, RingSplit, RingTransport, RingWorker, Travel};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream, DeviceRepr};

use super::backward::prepare_backward_ring;
use super::block::GpuKvBlock;
use super::devices::{Idle, RingSetups, once_per_device, run_threads};
use super::forward::prepare_forward_ring;
use super::link::stream_ring;
use super::problem::{BackwardStart, GpuRingError, RingInputs};
use crate::common::GpuElement;

/// Which parts of a ring run are timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingVariant {
    /// The ring as it runs: attention and hops.
    Full,
    /// The attention of every step, with each block staged on its device before the clock starts.
    ComputeOnly,
    /// The hops of every step, with no attention (workers whose query chunks are gone).
    CommOnly,
}

/// A transport that moves nothing: each `wait` hands over the next block staged on the device before the run, in
/// E11's order; `post` does nothing. Results computed over it are not the ring's (accumulators stay where they were
/// staged): it exists for timing only.
struct PrestagedLink<T> {
    device: usize,
    blocks: VecDeque<GpuKvBlock<T>>,
}

impl<T> RingTransport<GpuKvBlock<T>> for PrestagedLink<T> {
    type Error = GpuRingError;

    fn post(&mut self, _outgoing: &GpuKvBlock<T>) -> Result<(), GpuRingError> {
        Ok(())
    }

    fn wait(&mut self) -> Result<GpuKvBlock<T>, GpuRingError> {
        self.blocks.pop_front().ok_or_else(|| RingFault::Disconnected { device: self.device }.into())
    }
}

/// Copies of the blocks device `device` receives at hops `1..=hops` (E11: the block of `(g − s) mod G` at step `s`),
/// made on `stream` from the own blocks of `setups`.
fn staged_blocks<W, T: DeviceRepr>(
    setups: &RingSetups<W, T>,
    device: usize,
    hops: usize,
    stream: &Arc<CudaStream>,
) -> Result<VecDeque<GpuKvBlock<T>>, GpuRingError> {
    (1..=hops).map(|step| setups[ring_block_at(device, step, setups.len())].1.copy_on(stream)).collect()
}

/// Milliseconds of one ring run of `setups` over the links `make_link(g)`: the longest of the devices' times, each
/// between CUDA events recorded on its compute stream (`streams[g]`) once its link exists (an NCCL communicator's
/// set-up is not timed) and after the driver returns.
pub fn time_ring<W, L, F>(
    setups: Vec<(W, W::Block)>,
    streams: &[Arc<CudaStream>],
    make_link: F,
) -> Result<f64, GpuRingError>
where
    W: RingWorker<Error = GpuRingError> + Send,
    W::Block: Send,
    L: RingTransport<W::Block, Error = GpuRingError>,
    F: Fn(usize) -> Result<L, GpuRingError> + Sync,
{
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    for s in streams {
        s.synchronize()?;
    }
    let starts: Vec<Mutex<Option<CudaEvent>>> = streams.iter().map(|_| Mutex::new(None)).collect();
    let results = run_threads(setups, &|device| {
        let link = make_link(device)?;
        let start = streams[device].record_event(flags)?;
        *starts[device].lock().unwrap_or_else(|p| p.into_inner()) = Some(start);
        Ok(link)
    });
    let ends = streams.iter().map(|s| s.record_event(flags)).collect::<Result<Vec<_>, _>>()?;
    for s in streams {
        s.synchronize()?;
    }
    // The finished workers and blocks are dropped only after the streams are idle.
    for r in results {
        r?;
    }
    let mut longest = 0.0f64;
    for (start, end) in starts.into_iter().zip(&ends) {
        let start = start.into_inner().unwrap_or_else(|p| p.into_inner());
        let start = start.ok_or(GpuRingError::Unsupported("a device whose link was never made"))?;
        longest = longest.max(f64::from(start.elapsed_ms(end)?));
    }
    Ok(longest)
}

/// [`time_ring`] of `setups` in `variant`; `make_link(g)` makes device `g`'s link for the variants that communicate.
pub fn time_variant<W, T, L, F>(
    mut setups: RingSetups<W, T>,
    streams: &[Arc<CudaStream>],
    variant: RingVariant,
    make_link: F,
) -> Result<f64, GpuRingError>
where
    W: RingWorker<Block = GpuKvBlock<T>, Error = GpuRingError> + Idle + Send,
    T: DeviceRepr + Send,
    L: RingTransport<GpuKvBlock<T>, Error = GpuRingError>,
    F: Fn(usize) -> Result<L, GpuRingError> + Sync,
{
    let n_devices = setups.len();
    match variant {
        RingVariant::ComputeOnly => {
            let hops = if W::TRAVEL == Travel::Accumulating { n_devices } else { n_devices - 1 };
            let staged =
                (0..n_devices).map(|g| staged_blocks(&setups, g, hops, &streams[g])).collect::<Result<_, _>>()?;
            let blocks = once_per_device(staged);
            time_ring(setups, streams, |device| Ok(PrestagedLink { device, blocks: blocks(device)? }))
        }
        RingVariant::Full | RingVariant::CommOnly => {
            if variant == RingVariant::CommOnly {
                setups.iter_mut().for_each(|(w, _)| w.idle());
            }
            time_ring(setups, streams, make_link)
        }
    }
}

/// Milliseconds of one forward ring of `inputs` over `split` in `variant`, simulated devices on `streams` (one GPU).
pub fn time_forward_on_streams<T: GpuElement>(
    inputs: &RingInputs<'_, T>,
    split: RingSplit,
    streams: &[Arc<CudaStream>],
    variant: RingVariant,
) -> Result<f64, GpuRingError> {
    let setups = prepare_forward_ring(inputs, split, streams)?;
    time_variant(setups, streams, variant, once_per_device(stream_ring::<T>(streams)?))
}

/// Milliseconds of one backward ring of `inputs` from `start` over `split` in `variant`, simulated devices on
/// `streams` (one GPU).
pub fn time_backward_on_streams<T: GpuElement>(
    inputs: &RingInputs<'_, T>,
    start: &BackwardStart<'_, T>,
    split: RingSplit,
    streams: &[Arc<CudaStream>],
    variant: RingVariant,
) -> Result<f64, GpuRingError> {
    let setups = prepare_backward_ring(inputs, start, split, streams)?;
    time_variant(setups, streams, variant, once_per_device(stream_ring::<T>(streams)?))
}

/// The share of the communication the full ring hides behind compute: `(compute + comm − ring) / comm` in `[0, 1]`
/// (0 when there is no communication to hide).
pub fn overlap(ring_ms: f64, compute_ms: f64, comm_ms: f64) -> f64 {
    if comm_ms <= 0.0 { 0.0 } else { ((compute_ms + comm_ms - ring_ms) / comm_ms).clamp(0.0, 1.0) }
}

#[cfg(test)]
mod tests {
    use super::overlap;

    #[test]
    fn overlap_is_the_hidden_share_of_the_communication() {
        // Fully serial: nothing hidden; fully hidden: the ring takes the compute time; half hidden between.
        assert_eq!(overlap(15.0, 10.0, 5.0), 0.0);
        assert_eq!(overlap(10.0, 10.0, 5.0), 1.0);
        assert!((overlap(12.5, 10.0, 5.0) - 0.5).abs() < 1e-12);
        // Noise can put the ring below compute or above the sum: the share stays in [0, 1].
        assert_eq!(overlap(9.0, 10.0, 5.0), 1.0);
        assert_eq!(overlap(16.0, 10.0, 5.0), 0.0);
        assert_eq!(overlap(10.0, 10.0, 0.0), 0.0);
    }
}
