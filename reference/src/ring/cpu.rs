//! The CPU-threads ring backend, the reference the GPU backends are compared with: one thread per
//! simulated device, and a [`RingTransport`] over `std::sync::mpsc` channels, device `g` sending
//! into device `g + 1`'s channel and receiving from its own.

use std::sync::mpsc;

use attnproof_ring_driver::{DeviceRun, RingFault, RingPosition, RingTransport, RingWorker, run_device};

/// One device's two ends of a channel ring: the successor's inbox, and its own.
///
/// `post` clones the block into the successor's unbounded channel, which never blocks: the
/// successor takes it whenever it reaches its `wait`, so the hop overlaps whatever the sender
/// does next (for an `Arc`, the clone shares the read-only block; otherwise it is a copy, as an
/// interconnect makes one). `wait` blocks until the predecessor's block is there; channels
/// deliver in order, so the `k`-th `wait` gets the predecessor's `k`-th post. A neighbour that
/// has gone (its thread ended early) makes `post` or `wait` fail with
/// [`RingFault::Disconnected`] instead of hanging.
#[derive(Debug)]
pub struct ChannelLink<B> {
    device: usize,
    to_successor: mpsc::Sender<B>,
    from_predecessor: mpsc::Receiver<B>,
    /// Whether a hop of this device found a neighbour gone (so its error is a consequence of
    /// another device's failure, not a cause).
    neighbour_gone: bool,
}

impl<B> ChannelLink<B> {
    fn disconnected(&mut self) -> RingFault {
        self.neighbour_gone = true;
        RingFault::Disconnected { device: self.device }
    }
}

impl<B: Clone> RingTransport<B> for ChannelLink<B> {
    type Error = RingFault;

    fn post(&mut self, outgoing: &B) -> Result<(), RingFault> {
        self.to_successor.send(outgoing.clone()).map_err(|_| self.disconnected())
    }

    fn wait(&mut self) -> Result<B, RingFault> {
        self.from_predecessor.recv().map_err(|_| self.disconnected())
    }
}

/// The links of a ring of `n_devices` devices, indexed by device.
pub fn channel_ring<B>(n_devices: usize) -> Vec<ChannelLink<B>> {
    // Channel g is device g's inbox; device g holds the sending end of channel g + 1. The
    // original senders are dropped here, so a device whose thread ends closes its successor's
    // inbox for good.
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..n_devices).map(|_| mpsc::channel::<B>()).unzip();
    receivers
        .into_iter()
        .enumerate()
        .map(|(device, from_predecessor)| ChannelLink {
            device,
            to_successor: senders[(device + 1) % n_devices].clone(),
            from_predecessor,
            neighbour_gone: false,
        })
        .collect()
}

/// A device after its run: its worker (with whatever state it accumulated) and what the driver
/// left behind.
pub type FinishedDevice<W> = (W, DeviceRun<<W as RingWorker>::Block>);

/// Runs a ring of `n_devices` devices on as many scoped threads: `setup(g)` (called on device
/// `g`'s thread) gives its worker and the block it owns, and [`run_device`] drives it over a
/// [`ChannelLink`]. Returns each device's worker and run, by device.
///
/// Errors: when devices fail, the error of the lowest device whose own step failed is returned
/// in preference to those of devices that only saw a neighbour leave (the consequence). A panic
/// on a device thread is resumed on the caller's thread.
pub fn run_on_threads<W, F>(n_devices: usize, setup: F) -> Result<Vec<FinishedDevice<W>>, W::Error>
where
    W: RingWorker + Send,
    W::Block: Clone + Send,
    W::Error: Send,
    F: Fn(usize) -> (W, W::Block) + Sync,
{
    let links = channel_ring::<W::Block>(n_devices);
    let mut outcomes: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(device, mut link)| {
                let setup = &setup;
                s.spawn(move || {
                    let (mut worker, own) = setup(device);
                    let position = RingPosition { device, n_devices };
                    let run = run_device(position, &mut worker, &mut link, own).map(|run| (worker, run));
                    (run, link.neighbour_gone)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect()
    });
    // The cause first: `collect` then stops at it rather than at a device that only saw it leave.
    if let Some(cause) = outcomes.iter().position(|(run, neighbour_gone)| run.is_err() && !neighbour_gone) {
        outcomes.swap(0, cause);
    }
    outcomes.into_iter().map(|(run, _)| run).collect()
}
