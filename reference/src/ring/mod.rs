//! Ring attention (E11) and its zigzag layout (E11a) as a CPU schedule: `G` simulated devices,
//! one thread each, KV blocks passed one hop per step, forward and backward (dK/dV accumulators
//! travel with their block and come home to its owner).
//!
//! # Structure: one driver, several backends
//!
//! The step schedule is written once, in [`run_device`] of the `attnproof-ring-driver` crate, for
//! one device: it is generic over a [`RingTransport`] (how a block goes to the successor and comes from the predecessor:
//! a non-blocking [`RingTransport::post`], then [`RingTransport::wait`]) and a [`RingWorker`]
//! (what the device does with a block: `sees` for the causal skip, `attend`). This crate has one
//! transport, [`cpu::ChannelLink`] over `std::sync::mpsc`, run one thread per device by
//! [`cpu::run_on_threads`], and two workers, forward (`forward.rs`) and backward
//! (`backward.rs`), behind [`ring_forward`] and [`ring_backward`]. The GPU backends
//! (`attnproof-gpu`'s `ring` module: one GPU holding `G` simulated devices on separate streams,
//! and NCCL) implement the same two traits and are run by the same driver. `blocks.rs` holds what
//! a device owns: its pieces, tiles, query rows and travelling KV block; `config.rs` the schedule's
//! parameters ([`RingConfig`]) and its statistics ([`RingStats`]).
//!
//! # Layout
//!
//! Every sequence (dense or varlen: each sequence is cut on its own) is split into `P` pieces,
//! piece `c` of a length `n` covering positions `⌊c·n/P⌋ .. ⌊(c+1)·n/P⌋` (sizes differ by at most
//! one; pieces may be empty when `n < P`). Queries and keys are cut separately (`Lq ≠ Lk` is
//! allowed; masks use positions within the sequence, bottom-right aligned).
//! [`RingLayout::Contiguous`]: `P = G`, device `g` holds piece `g`. [`RingLayout::Zigzag`]:
//! `P = 2G`, device `g` holds pieces `g` and `2G−1−g` (`attnproof_oracle::online::zigzag_chunks`),
//! which balances causal work. Device `g` owns the queries, keys and values of its pieces.
//!
//! # Schedule
//!
//! At step `t = 0..G` device `g` holds KV block `(g − t) mod G` (E11), received from device
//! `g − 1`; the block carries its keys' positions, so masking needs no knowledge of who sent it.
//! For each sequence, a block holding no key visible to any of the device's queries is skipped
//! (under causality: a block entirely in the future; the count is [`RingStats::skipped_blocks`]).
//! Otherwise the block's KV tiles (`kv_tile` keys, cut within each piece from its start, so a tile
//! never straddles two pieces) are visited per query tile (`q_tile` rows, likewise within pieces),
//! skipping tiles outside the query tile's visible key hull (`Mask::key_range`, as `flash` does),
//! and the diagonal tiles are masked key by key with [`crate::mask::visible`]. Each device's
//! work is sequential; the `G` device threads are the parallelism.
//!
//! Forward ([`Travel::ReadOnly`]): the block is posted (an `Arc`, as it is read-only) before it
//! is processed, as a real ring overlaps the transfer with compute; after `G − 1` hops every
//! block has met every device. Backward ([`Travel::Accumulating`]): the block is processed, then
//! posted with its f32 dK/dV accumulators; `G` hops in all, the last bringing every block (and
//! its accumulators) back to its owner. The driver checks at every step that the held block is
//! the one E11 puts there ([`RingFault::Misrouted`] otherwise), so a transport that hands back
//! the wrong block (the one it sent, last step's, another device's) fails at once; stale
//! *contents* under the right owner show only in the numbers, which the tests compare with the
//! oracle.
//!
//! # Precision recipe
//!
//! Forward: exactly the recipe of [`crate::flash`] (inputs in `T` widened to f32, f32 scores
//! `fl(q·k)·α̂`, f32 online softmax `m, ℓ, A` per query row, `A` accumulating `round_T(p)·v`,
//! `O = round_T(A/ℓ)`, `LSE = m + ln ℓ` in f32). Every visited KV tile is one E3 update of the
//! row's single running state — the blocks are absorbed tile by tile into that state rather than
//! finalized per block and merged, so the only difference from the single-pass forward is which
//! tiles a row visits, in what order. The model of `attnproof_proofs::flash_bound` is order-free
//! (the rescale factors along a row telescope to `m_i − s_ij` in any order, and each `A`/`ℓ` term
//! goes through at most `Lk + n_t` additions), and needs only `n_t` ≥ the number of tiles a row
//! visits. With `P` pieces of lengths `n_c` summing to `Lk`, that number is at most
//! `Σ_c ⌈n_c/kv_tile⌉ ≤ ⌈Lk/kv_tile⌉ + P − 1` (each `⌈x_c⌉ < x_c + 1`, so the sum of `P` ceilings
//! is below `Lk/kv_tile + P`); hence [`RingConfig::extra_merges`] `= P − 1` (`G − 1`
//! contiguous, `2G − 1` zigzag), to be put in the `FlashRecipe` that judges this schedule.
//!
//! Backward: exactly the recipe of [`crate::backward`] (`D = Σ dO∘O` in f32 per row; per visible
//! pair `P = exp(fl(q·k)·α̂ − LSE)` in f32, `dV += round_T(P)·dO`, `dP = dO·v`, `dS =
//! round_T(P(dP − D))`, `dQ += dS·k`, `dK += dS·q` into f32 accumulators, element by element, so
//! each gradient element is one chain of at most `Lk` (dQ) or `Lq` (dK, dV) additions, in ring
//! arrival order; `dQ, dK ← α̂·(…)` at the end). Under GQA a block carries one f32 dK/dV
//! accumulator per query head; the owner sums a KV head's group in f32 in ascending head order
//! (after the `α̂` scaling of dK, as `backward` does) and rounds once to `T`.

mod backward;
mod blocks;
mod config;
pub mod cpu;
mod forward;

pub use attnproof_ring_driver::{
    DeviceRun, RingFault, RingLayout, RingPosition, RingSplit, RingTransport, RingWorker, Travel, run_device,
};
pub use backward::ring_backward;
pub use config::{RingConfig, RingStats};
pub use forward::ring_forward;
