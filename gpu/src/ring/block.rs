//! What travels around the GPU ring: a device's KV chunks ([`KvChunk`]) in one block ([`GpuKvBlock`]) with the event
//! that says when its buffers are ready, and which (query chunk, key chunk) pairs a device attends: the pair's
//! window under the problem's mask, and whether any pair of a block is visible at all (the causal skip).

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr};

use super::problem::GpuRingError;
use super::state::ChunkWindow;
use crate::error::GpuError;

/// One contiguous run of keys of a KV block: positions `start .. start + len` of every sequence, `[B, Hkv, len, D]`.
#[derive(Debug)]
pub struct KvChunk<T> {
    /// First key position.
    pub start: usize,
    /// Keys.
    pub len: usize,
    /// Keys, `[B, Hkv, len, d]`.
    pub k: CudaSlice<T>,
    /// Values, `[B, Hkv, len, dv]`.
    pub v: CudaSlice<T>,
    /// In the backward pass: the chunk's travelling f32 dK, dV sums, one per query head
    /// ([`super::backward_steps::ring_dkv_accumulator_len`]); `None` in the forward pass.
    pub acc: Option<CudaSlice<f32>>,
}

/// The travelling block: the KV chunks one device owns (one, or two under zigzag).
#[derive(Debug)]
pub struct GpuKvBlock<T> {
    /// The device that owns these keys.
    pub owner: usize,
    /// Its chunks.
    pub chunks: Vec<KvChunk<T>>,
    /// Recorded on the sender's stream after the copy that made this block; the receiver's stream waits on it.
    pub(crate) ready: Option<Arc<CudaEvent>>,
}

impl<T> GpuKvBlock<T> {
    /// A block of `owner`'s chunks, ready for any stream (its buffers were filled by work already ordered before).
    pub fn new(owner: usize, chunks: Vec<KvChunk<T>>) -> Self {
        GpuKvBlock { owner, chunks, ready: None }
    }
}

impl<T: DeviceRepr> GpuKvBlock<T> {
    /// A copy of the block (K, V and any accumulators) in fresh buffers, made on `stream`.
    pub(crate) fn copy_on(&self, stream: &Arc<CudaStream>) -> Result<Self, GpuRingError> {
        let chunks = self
            .chunks
            .iter()
            .map(|c| {
                let acc = c.acc.as_ref().map(|a| stream.clone_dtod(a)).transpose()?;
                Ok(KvChunk {
                    start: c.start,
                    len: c.len,
                    k: stream.clone_dtod(&c.k)?,
                    v: stream.clone_dtod(&c.v)?,
                    acc,
                })
            })
            .collect::<Result<_, GpuRingError>>()?;
        Ok(GpuKvBlock::new(self.owner, chunks))
    }
}

/// The window of the pair (query positions `q = (start, len)`, key chunk `c`) of a sequence of `lens` (queries,
/// keys) under `spec`'s mask.
pub(crate) fn pair_window<T>(
    spec: &AttentionSpec,
    lens: (usize, usize),
    q: (usize, usize),
    c: &KvChunk<T>,
) -> Result<ChunkWindow, GpuError> {
    ChunkWindow::for_pair(&spec.mask, lens, q, (c.start, c.len))
}

/// Whether some of the `queries` (positions, lengths) sees some key of `block`: else the driver skips the block.
pub(crate) fn block_visible<T>(
    spec: &AttentionSpec,
    lens: (usize, usize),
    mut queries: impl Iterator<Item = (usize, usize)>,
    block: &GpuKvBlock<T>,
) -> bool {
    queries.any(|q| block.chunks.iter().any(|c| pair_window(spec, lens, q, c).is_ok_and(|w| w.sees_any(q.1, c.len))))
}
