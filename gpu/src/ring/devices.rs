//! The GPU ring's device threads: one host thread per ring device, each running the driver
//! ([`attnproof_ring_driver::run_device`]) over the link it makes on its own thread, and the hand-out of per-device
//! values (links, staged blocks) to those threads.

use std::sync::Mutex;

use attnproof_ring_driver::{DeviceRun, RingPosition, RingTransport, RingWorker, run_device};

use super::block::GpuKvBlock;
use super::problem::GpuRingError;

/// Every ring device's worker and own block, as the driver starts them.
pub type RingSetups<W, T> = Vec<(W, GpuKvBlock<T>)>;

/// A device after the ring: its worker and what the driver left it.
pub(crate) type Finished<W> = (W, DeviceRun<<W as RingWorker>::Block>);

/// A worker whose attention can be switched off (the timing's communication-only runs).
pub trait Idle {
    /// Drops the worker's query chunks: it then sees no block and attends nothing.
    fn idle(&mut self);
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
