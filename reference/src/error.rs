//! Typed errors of the reference schedules.

use attnproof_oracle::OracleError;
use attnproof_ring_driver::RingFault;
use thiserror::Error;

/// Why a schedule refused its arguments.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ReferenceError {
    /// The problem itself is invalid (shapes, heads, cu_seqlens, non-finite inputs, index lists).
    #[error(transparent)]
    Problem(#[from] OracleError),
    /// A tile size is zero.
    #[error("`{argument}` is zero")]
    ZeroTile {
        /// `q_tile` or `kv_tile`.
        argument: &'static str,
    },
    /// The schedule does not take this mask (PISA's tail: none or the bottom-right causal mask).
    #[error("the mask {mask} is not supported: {reason}")]
    UnsupportedMask {
        /// The mask, as `Debug` prints it.
        mask: String,
        /// What the schedule takes.
        reason: &'static str,
    },
    /// The ring schedule failed: a hop did not complete, or a block arrived out of turn.
    #[error(transparent)]
    Ring(#[from] RingFault),
}
