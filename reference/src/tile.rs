//! The tile sizes every tiled schedule of this crate takes ([`TileConfig`]), in a module of their own so that the
//! schedules (`flash`, `backward`, `sparse`, `ring`) share them without importing each other.

use crate::error::ReferenceError;

/// Tile sizes of a schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileConfig {
    /// Query rows per task.
    pub q_tile: usize,
    /// Keys per KV tile.
    pub kv_tile: usize,
}

impl Default for TileConfig {
    fn default() -> Self {
        TileConfig { q_tile: 64, kv_tile: 64 }
    }
}

impl TileConfig {
    /// Rejects zero tile sizes.
    pub fn validate(&self) -> Result<(), ReferenceError> {
        if self.q_tile == 0 {
            return Err(ReferenceError::ZeroTile { argument: "q_tile" });
        }
        if self.kv_tile == 0 {
            return Err(ReferenceError::ZeroTile { argument: "kv_tile" });
        }
        Ok(())
    }
}
