//! The ring driver (E11): one device's step schedule, written once, generic over how blocks move
//! between devices ([`RingTransport`]) and what a device does with a block ([`RingWorker`]), so
//! that the CPU reference's threads (`attnproof-reference`) and the GPU backends (`attnproof-gpu`'s
//! `ring` module: one GPU holding simulated devices, NCCL) run the same schedule: which block at
//! which step, the causal skip, the buffer swap, and in the backward pass the accumulators
//! travelling home.
//!
//! # Two buffers
//!
//! At every step a device holds one block (the one it attends) and, while it attends it, the
//! transport receives the next one into a second buffer: [`RingTransport::post`] starts the hop
//! (send the held block to the successor, receive the predecessor's), [`RingTransport::wait`]
//! completes it and hands over the received block, which becomes the held one. A read-only block
//! ([`Travel::ReadOnly`], forward K/V) is posted before it is attended, so the transfer overlaps
//! the attention; a block carrying accumulators ([`Travel::Accumulating`], backward dK/dV) can
//! only go on once the device has added to them, so it is posted after, and its read-only parts
//! (K, V) may leave before the attention through [`RingTransport::prefetch`].

use attnproof_oracle::online::ring_block_at;
use thiserror::Error;

/// A device's place in the ring: device `device` of `n_devices` (`G`). It sends to
/// `device + 1` and receives from `device − 1`, modulo `G`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingPosition {
    /// This device, in `0..n_devices`.
    pub device: usize,
    /// The number of devices `G` in the ring.
    pub n_devices: usize,
}

/// How a block travels relative to the work a device does on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Travel {
    /// The block is only read (forward K/V): it is posted before it is attended, so that the hop
    /// overlaps the attention, and makes `G − 1` hops; after the last step each device holds its
    /// successor's block, which it drops.
    ReadOnly,
    /// The block carries accumulators that every device adds to (backward dK/dV): it is posted
    /// after it is attended and makes `G` hops, the last one bringing it home to its owner.
    Accumulating,
}

/// The ring went wrong: a transport failed, or a block arrived where the schedule says it
/// cannot be.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum RingFault {
    /// A device holds a block other than the one E11 puts there: the transport handed back a
    /// stale or misrouted buffer (or, at the end of an accumulating run, a block is not home).
    #[error(
        "ring device {device}, step {step}: holds the block of device {received}, but E11 puts the block of device \
         {expected} there (stale or misrouted buffer)"
    )]
    Misrouted {
        /// The device holding the wrong block.
        device: usize,
        /// The step (`G` for the check after the last hop).
        step: usize,
        /// The owner of the block it should hold, `(device − step) mod G`.
        expected: usize,
        /// The owner of the block it holds.
        received: usize,
    },
    /// A neighbour left the ring (its end of the link is gone), so a hop cannot complete.
    #[error("ring device {device}: a neighbour left the ring before the hop completed")]
    Disconnected {
        /// The device whose hop failed.
        device: usize,
    },
}

/// Moves blocks one hop around the ring for one device: to its successor, from its predecessor.
///
/// The contract, which every backend (CPU channels, GPU stream-ordered copies, NCCL send/recv
/// with events) must keep, for a device driven by [`run_device`]:
///
/// - **Alternation.** The driver calls `post` and `wait` strictly alternately, starting with
///   `post`, the same number of times on every device of the ring. A backend may answer any
///   other order with an error.
/// - **Matching.** The `k`-th `wait` returns the block that the predecessor passed to its `k`-th
///   `post`, and nothing else: never an earlier block, never the block this device posted, never
///   a buffer whose receive has not completed (a *stale* buffer). Blocks are not merged, split or
///   reordered by a backend.
/// - **Post does not block on compute.** `post` only starts the hop (enqueues the send and the
///   receive) and returns, so that the driver can attend the held block meanwhile. It may block
///   for flow control, but must not wait for the successor to attend anything.
/// - **Outgoing buffer.** `post` borrows `outgoing` only for the call; a backend that sends
///   asynchronously from the same storage (a device buffer) must make the send complete before
///   that storage can change: the driver does not modify a posted block before the matching
///   `wait` returns (it only reads it, in [`Travel::ReadOnly`]), and drops it after.
/// - **What `wait` guarantees.** When `wait` returns, the received block is complete for every
///   later use by this device (on a GPU: "complete" may mean ordered before any work the worker
///   enqueues afterwards on its compute stream, through an event, rather than host-synchronous),
///   and this device's own send of the matching `post` has completed or is ordered before any
///   reuse of its storage.
/// - **Errors.** A failed hop is an `Err`, never a panic and never a made-up block; the driver
///   stops at the first error and returns it, and the transport is not used again. A neighbour
///   that stops (error or panic) must make this device's pending or next `wait` fail rather
///   than hang, where the backend can detect it.
pub trait RingTransport<B> {
    /// Why a hop failed.
    type Error;

    /// Starts one hop: sends `outgoing` to the successor and starts receiving the predecessor's
    /// block. Returns without waiting for the hop to complete.
    fn post(&mut self, outgoing: &B) -> Result<(), Self::Error>;

    /// Before the attention of an accumulating block that `post` will then send (see the trait
    /// docs): may start sending its read-only parts. The default sends everything at `post`.
    fn prefetch(&mut self, _held: &B) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Completes the hop started by the last `post` and hands over the block received from the
    /// predecessor (see the trait docs for what completion means).
    fn wait(&mut self) -> Result<B, Self::Error>;
}

/// What one device does with the blocks that pass through it: the compute side of the ring,
/// one implementation per pass (forward, backward) and per backend (CPU, GPU).
///
/// A device's work is cut into *parts* (on the CPU: one per sequence of a varlen batch), each
/// of which sees or skips each block on its own, so that the causal skip and its count live in
/// the driver.
pub trait RingWorker {
    /// The travelling block: KV (and in the backward pass its accumulators) of one owner.
    type Block;
    /// Why a step failed; a ring fault (or a transport error) converts into it.
    type Error: From<RingFault>;
    /// How the block travels, which decides when the driver posts it.
    const TRAVEL: Travel;

    /// The device that owns `block` (whose keys it holds), for the routing check.
    fn owner(&self, block: &Self::Block) -> usize;

    /// The number of parts of this device's work.
    fn parts(&self) -> usize;

    /// Whether some query of `part` on this device can see some key of `block` (if not, the
    /// driver skips the pair: the causal skip of blocks entirely in the future).
    fn sees(&self, part: usize, block: &Self::Block) -> bool;

    /// Attends `part`'s queries to `block`: one merge (E3/E4) into the device's running state,
    /// and, for an accumulating block, adds to its accumulators.
    fn attend(&mut self, part: usize, block: &mut Self::Block) -> Result<(), Self::Error>;
}

/// What [`run_device`] leaves behind.
#[derive(Debug)]
pub struct DeviceRun<B> {
    /// The block held after the last step: under [`Travel::Accumulating`] the device's own
    /// block, home with every device's contributions; under [`Travel::ReadOnly`] its
    /// successor's block, of no further use.
    pub held: B,
    /// `(part, step)` pairs skipped because no query of the part can see the block's keys.
    pub skipped_parts: usize,
}

/// Runs the ring schedule (E11) of one device, starting from the block it owns: at step
/// `t = 0..G` it holds the block of device `(device − t) mod G`, attends it with every part that
/// can see it, and passes it on through `transport` ([`Travel`] says when, and how many hops).
/// Every held block is checked against E11 by its owner, so a transport that hands back a stale
/// or misrouted buffer is a [`RingFault::Misrouted`], as is an accumulating block not home at
/// the end.
pub fn run_device<W, X>(
    position: RingPosition,
    worker: &mut W,
    transport: &mut X,
    own: W::Block,
) -> Result<DeviceRun<W::Block>, W::Error>
where
    W: RingWorker,
    X: RingTransport<W::Block>,
    W::Error: From<X::Error>,
{
    let n_devices = position.n_devices;
    let mut held = own;
    let mut skipped_parts = 0;
    for step in 0..n_devices {
        check_route(worker, &held, position, step)?;
        // A read-only block needs no hop after the last step; an accumulating one goes home.
        let hop = step + 1 < n_devices || W::TRAVEL == Travel::Accumulating;
        match W::TRAVEL {
            Travel::ReadOnly if hop => transport.post(&held)?,
            Travel::Accumulating if hop => transport.prefetch(&held)?,
            _ => {}
        }
        for part in 0..worker.parts() {
            if worker.sees(part, &held) {
                worker.attend(part, &mut held)?;
            } else {
                skipped_parts += 1;
            }
        }
        if hop && W::TRAVEL == Travel::Accumulating {
            transport.post(&held)?;
        }
        if hop {
            held = transport.wait()?;
        }
    }
    if W::TRAVEL == Travel::Accumulating {
        // After G hops E11 puts block (device − G) mod G = device here: its owner.
        check_route(worker, &held, position, n_devices)?;
    }
    Ok(DeviceRun { held, skipped_parts })
}

/// The routing check: at `step` a device holds the block of `(device − step) mod G`.
fn check_route<W: RingWorker>(
    worker: &W,
    held: &W::Block,
    position: RingPosition,
    step: usize,
) -> Result<(), RingFault> {
    let expected = ring_block_at(position.device, step, position.n_devices);
    let received = worker.owner(held);
    if received == expected {
        Ok(())
    } else {
        Err(RingFault::Misrouted { device: position.device, step, expected, received })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// What the driver did, in order, on one device; blocks are named by their owners.
    #[derive(Debug, PartialEq, Eq)]
    enum Call {
        Prefetch(usize),
        Post(usize),
        Wait,
        Attend(usize),
    }

    type Log = Rc<RefCell<Vec<Call>>>;

    /// Device 0 of a ring of two whose transport logs every call and hands over the block E11 puts
    /// there next.
    struct Recorder {
        log: Log,
        hops: usize,
    }

    impl RingTransport<usize> for Recorder {
        type Error = RingFault;

        fn post(&mut self, outgoing: &usize) -> Result<(), RingFault> {
            self.log.borrow_mut().push(Call::Post(*outgoing));
            Ok(())
        }

        fn prefetch(&mut self, held: &usize) -> Result<(), RingFault> {
            self.log.borrow_mut().push(Call::Prefetch(*held));
            Ok(())
        }

        fn wait(&mut self) -> Result<usize, RingFault> {
            self.log.borrow_mut().push(Call::Wait);
            self.hops += 1;
            Ok(ring_block_at(0, self.hops, 2))
        }
    }

    /// A worker of either travel whose attention is logged beside the transport's calls.
    struct Worker<const ACCUMULATING: bool> {
        log: Log,
    }

    impl<const ACCUMULATING: bool> RingWorker for Worker<ACCUMULATING> {
        type Block = usize;
        type Error = RingFault;
        const TRAVEL: Travel = if ACCUMULATING { Travel::Accumulating } else { Travel::ReadOnly };

        fn owner(&self, block: &usize) -> usize {
            *block
        }

        fn parts(&self) -> usize {
            1
        }

        fn sees(&self, _part: usize, _block: &usize) -> bool {
            true
        }

        fn attend(&mut self, _part: usize, block: &mut usize) -> Result<(), RingFault> {
            self.log.borrow_mut().push(Call::Attend(*block));
            Ok(())
        }
    }

    /// The calls of device 0 in a ring of two.
    fn calls<const ACCUMULATING: bool>() -> Vec<Call> {
        let log = Log::default();
        let mut transport = Recorder { log: log.clone(), hops: 0 };
        let mut worker = Worker::<ACCUMULATING> { log: log.clone() };
        let position = RingPosition { device: 0, n_devices: 2 };
        run_device(position, &mut worker, &mut transport, 0).expect("the recorder follows E11");
        log.take()
    }

    #[test]
    fn accumulating_blocks_prefetch_before_the_attention_and_post_after_it() {
        use Call::*;
        let expected = vec![Prefetch(0), Attend(0), Post(0), Wait, Prefetch(1), Attend(1), Post(1), Wait];
        assert_eq!(calls::<true>(), expected);
    }

    #[test]
    fn read_only_blocks_post_before_the_attention_and_never_prefetch() {
        use Call::*;
        assert_eq!(calls::<false>(), vec![Post(0), Attend(0), Wait, Attend(1)]);
    }
}
