//! The CPU ring schedule's parameters ([`RingConfig`]: the devices, the layout and the tiles each device uses) and
//! what a run reports about its schedule ([`RingStats`]).

use std::ops::Range;

use attnproof_ring_driver::{RingLayout, RingSplit};

use crate::error::ReferenceError;
use crate::tile::TileConfig;

/// A ring schedule: device count, layout and the tiles each device uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingConfig {
    /// Number of simulated devices `G` (threads).
    pub n_devices: usize,
    /// How sequences are cut among them.
    pub layout: RingLayout,
    /// Query and KV tile sizes inside a device.
    pub tiles: TileConfig,
}

impl RingConfig {
    /// How the schedule cuts sequences among its devices: its device count and layout, without the tiles.
    pub fn split(&self) -> RingSplit {
        RingSplit { n_devices: self.n_devices, layout: self.layout }
    }

    /// Rejects zero devices and zero tile sizes.
    pub fn validate(&self) -> Result<(), ReferenceError> {
        self.split().validate()?;
        self.tiles.validate()
    }

    /// Pieces a sequence is cut into: `G` (contiguous) or `2G` (zigzag).
    pub fn pieces(&self) -> usize {
        self.split().pieces()
    }

    /// The `extra_merges` of the `FlashRecipe` that covers this schedule: `pieces − 1`, the most
    /// KV tiles a row can visit beyond `⌈Lk/kv_tile⌉` (module docs, precision recipe).
    pub fn extra_merges(&self) -> usize {
        self.pieces().saturating_sub(1)
    }

    /// The positions (within a sequence of `len` queries or keys) that `device` holds, ascending.
    pub fn positions(&self, device: usize, len: usize) -> Vec<Range<usize>> {
        self.split().positions(device, len)
    }
}

/// What a ring run did, for tests of the schedule itself (not of its numbers).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RingStats {
    /// `(sequence, device, step)` triples whose KV block held no key visible to any of the
    /// device's queries, and which the device therefore skipped (causal skip).
    pub skipped_blocks: usize,
    /// Per device: visible `(query head, query, key)` pairs it evaluated (its load).
    pub visible_pairs: Vec<u64>,
}
