//! What a device holds and what travels: the pieces of each sequence a device owns, cut into
//! query and KV tiles within pieces; its query rows; and the KV block it owns, which travels
//! around the ring.

use std::ops::Range;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Sequence;
use ndarray::{Array2, ArrayViewD, Axis};

use super::config::RingConfig;
use crate::element::Element;

/// A tile: its first local row (index into the device's or block's concatenated rows) and the
/// positions it covers within the sequence.
#[derive(Clone, Debug)]
pub(super) struct Tile {
    pub(super) local: usize,
    pub(super) positions: Range<usize>,
}

/// Cuts the pieces `ranges` into tiles of `size`, each within one piece.
pub(super) fn tiles_of(ranges: &[Range<usize>], size: usize) -> Vec<Tile> {
    let mut out = Vec::new();
    let mut local = 0;
    for r in ranges {
        let mut start = r.start;
        while start < r.end {
            let end = (start + size).min(r.end);
            out.push(Tile { local, positions: start..end });
            local += end - start;
            start = end;
        }
    }
    out
}

/// The hull of the keys visible to some row of `rows` (empty if none), as `flash` skips by.
pub(super) fn key_hull(spec: &AttentionSpec, seq: &Sequence, rows: Range<usize>) -> Range<usize> {
    let (mut lo, mut hi) = (usize::MAX, 0);
    for i in rows {
        let r = spec.mask.key_range(i, seq.len_q, seq.len_k);
        if !r.is_empty() {
            lo = lo.min(r.start);
            hi = hi.max(r.end);
        }
    }
    if lo >= hi { 0..0 } else { lo..hi }
}

/// Whether two ranges share a position (an empty range, such as an empty piece, shares none).
pub(super) fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
}

/// A query tile and the hull of the keys its rows can see.
#[derive(Clone, Debug)]
pub(super) struct QueryTile {
    pub(super) tile: Tile,
    pub(super) hull: Range<usize>,
}

pub(super) fn query_tiles(
    spec: &AttentionSpec,
    seq: &Sequence,
    ranges: &[Range<usize>],
    q_tile: usize,
) -> Vec<QueryTile> {
    tiles_of(ranges, q_tile)
        .into_iter()
        .map(|tile| QueryTile { hull: key_hull(spec, seq, tile.positions.clone()), tile })
        .collect()
}

/// Whether any query tile can see any key of `key_ranges`: if not, the block is skipped.
pub(super) fn block_meets(q_tiles: &[QueryTile], key_ranges: &[Range<usize>]) -> bool {
    q_tiles.iter().any(|qt| key_ranges.iter().any(|r| overlaps(&qt.hull, r)))
}

/// The rows at `ranges` of one head of `t`, widened to f32 (`[Σ len, D]`).
pub(super) fn gather_f32<T: Element>(
    spec: &AttentionSpec,
    t: &ArrayViewD<'_, T>,
    seq: &Sequence,
    head: usize,
    keys: bool,
    ranges: &[Range<usize>],
) -> Array2<f32> {
    gather(spec, t, seq, head, keys, ranges).mapv(|x| x.to_f32())
}

pub(super) fn gather<T: Clone>(
    spec: &AttentionSpec,
    t: &ArrayViewD<'_, T>,
    seq: &Sequence,
    head: usize,
    keys: bool,
    ranges: &[Range<usize>],
) -> Array2<T> {
    let rows: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
    spec.head_rows(t.view(), seq, head, keys).select(Axis(0), &rows)
}

/// One sequence's share of a travelling KV block: the key positions, K/V per KV head in the
/// storage type (as they would cross the interconnect), and, in the backward pass, the f32 dK/dV
/// accumulators per query head.
#[derive(Clone, Debug)]
pub(super) struct SeqBlock<T> {
    pub(super) ranges: Vec<Range<usize>>,
    pub(super) k: Vec<Array2<T>>,
    pub(super) v: Vec<Array2<T>>,
    pub(super) dk: Vec<Array2<f32>>,
    pub(super) dv: Vec<Array2<f32>>,
}

/// The KV block a device owns, travelling around the ring.
#[derive(Clone, Debug)]
pub(super) struct KvBlock<T> {
    pub(super) owner: usize,
    pub(super) seqs: Vec<SeqBlock<T>>,
}

pub(super) fn own_block<T: Element>(
    spec: &AttentionSpec,
    seqs: &[Sequence],
    k: &ArrayViewD<'_, T>,
    v: &ArrayViewD<'_, T>,
    config: RingConfig,
    device: usize,
) -> KvBlock<T> {
    let seqs = seqs
        .iter()
        .map(|seq| {
            let ranges = config.positions(device, seq.len_k);
            SeqBlock {
                k: (0..spec.n_heads_kv).map(|h| gather(spec, k, seq, h, true, &ranges)).collect(),
                v: (0..spec.n_heads_kv).map(|h| gather(spec, v, seq, h, true, &ranges)).collect(),
                dk: Vec::new(),
                dv: Vec::new(),
                ranges,
            }
        })
        .collect();
    KvBlock { owner: device, seqs }
}

/// Per sequence: the device's positions and one result per head.
pub(super) type PerSeq<X> = Vec<(Sequence, Vec<Range<usize>>, Vec<X>)>;

/// A device's queries of one sequence, per query head, and their tiles.
pub(super) struct DeviceQueries {
    pub(super) seq: Sequence,
    pub(super) ranges: Vec<Range<usize>>,
    pub(super) q_tiles: Vec<QueryTile>,
    pub(super) q: Vec<Array2<f32>>,
}

pub(super) fn device_queries<T: Element>(
    spec: &AttentionSpec,
    seqs: &[Sequence],
    q: &ArrayViewD<'_, T>,
    config: RingConfig,
    device: usize,
) -> Vec<DeviceQueries> {
    seqs.iter()
        .map(|seq| {
            let ranges = config.positions(device, seq.len_q);
            DeviceQueries {
                seq: *seq,
                q_tiles: query_tiles(spec, seq, &ranges, config.tiles.q_tile),
                q: (0..spec.n_heads_q).map(|h| gather_f32(spec, q, seq, h, false, &ranges)).collect(),
                ranges,
            }
        })
        .collect()
}

impl<T: Element> SeqBlock<T> {
    /// The number of keys in this share of the block.
    pub(super) fn len(&self) -> usize {
        self.ranges.iter().map(|r| r.len()).sum()
    }

    /// K and V per KV head, widened to f32 for the arithmetic of one step.
    pub(super) fn widened(&self) -> (Vec<Array2<f32>>, Vec<Array2<f32>>) {
        let widen = |t: &Array2<T>| t.mapv(|x| x.to_f32());
        self.k.iter().zip(&self.v).map(|(k, v)| (widen(k), widen(v))).unzip()
    }
}
