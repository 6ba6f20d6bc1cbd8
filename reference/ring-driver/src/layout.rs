//! How a ring cuts every sequence among its devices (E11, E11a): the device count, the layout, and the positions
//! each device holds. Both ring backends cut sequences this way, so the CPU reference and the GPU ring agree on which
//! queries and keys a device owns.

use std::ops::Range;

use attnproof_oracle::OracleError;
use attnproof_oracle::online::zigzag_chunks;

/// How a sequence is distributed over the devices (E11, E11a).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingLayout {
    /// `G` pieces; device `g` holds piece `g`.
    Contiguous,
    /// `2G` pieces; device `g` holds pieces `g` and `2G − 1 − g` (E11a).
    Zigzag,
}

/// A ring's split of every sequence: `G` devices and the layout that cuts each sequence (queries and keys on their
/// own) into pieces, piece `c` of a length `n` covering positions `⌊c·n/P⌋ .. ⌊(c+1)·n/P⌋` for `P` pieces (sizes
/// differ by at most one; pieces may be empty when `n < P`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingSplit {
    /// Number of devices `G`.
    pub n_devices: usize,
    /// How sequences are cut among them.
    pub layout: RingLayout,
}

impl RingSplit {
    /// Rejects a ring of zero devices.
    pub fn validate(&self) -> Result<(), OracleError> {
        if self.n_devices == 0 {
            return Err(OracleError::ZeroDimension { argument: "n_devices" });
        }
        Ok(())
    }

    /// Pieces a sequence is cut into: `G` (contiguous) or `2G` (zigzag).
    pub fn pieces(&self) -> usize {
        match self.layout {
            RingLayout::Contiguous => self.n_devices,
            RingLayout::Zigzag => 2 * self.n_devices,
        }
    }

    /// The positions (within a sequence of `len` queries or keys) that `device` holds, ascending.
    pub fn positions(&self, device: usize, len: usize) -> Vec<Range<usize>> {
        let p = self.pieces();
        let piece = |c: usize| c * len / p..(c + 1) * len / p;
        match self.layout {
            RingLayout::Contiguous => vec![piece(device)],
            RingLayout::Zigzag => zigzag_chunks(device, self.n_devices).iter().map(|&c| piece(c)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_partitions_a_sequence_among_the_devices() {
        for layout in [RingLayout::Contiguous, RingLayout::Zigzag] {
            for n_devices in 1..=5 {
                let split = RingSplit { n_devices, layout };
                for len in [0, 1, 7, 64, 101] {
                    let mut covered: Vec<usize> =
                        (0..n_devices).flat_map(|g| split.positions(g, len)).flatten().collect();
                    covered.sort_unstable();
                    assert_eq!(covered, (0..len).collect::<Vec<_>>(), "{layout:?} G={n_devices} len {len}");
                }
            }
        }
    }

    #[test]
    fn zigzag_device_zero_holds_the_first_and_the_last_piece() {
        let split = RingSplit { n_devices: 2, layout: RingLayout::Zigzag };
        assert_eq!(split.positions(0, 8), vec![0..2, 6..8]);
        assert_eq!(split.positions(1, 8), vec![2..4, 4..6]);
        assert_eq!(split.pieces(), 4);
    }

    #[test]
    fn a_ring_of_zero_devices_is_refused() {
        let split = RingSplit { n_devices: 0, layout: RingLayout::Contiguous };
        assert_eq!(split.validate(), Err(OracleError::ZeroDimension { argument: "n_devices" }));
        assert_eq!(RingSplit { n_devices: 1, ..split }.validate(), Ok(()));
    }
}
