//! Ring attention (E11) and its zigzag layout (E11a) as a CPU schedule: `G` simulated devices,
//! one thread each, KV blocks passed one hop per step through `std::sync::mpsc` channels, forward
//! and backward (dK/dV accumulators travel with their block and come home to its owner).
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
//! Forward: the block is sent on (an `Arc`, as it is read-only) before it is processed, as a real
//! ring overlaps the transfer with compute; after `G − 1` hops every block has met every device.
//! Backward: the block is processed, then sent on with its f32 dK/dV accumulators; `G` hops in
//! all, the last bringing every block (and its accumulators) back to its owner.
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

use std::ops::Range;
use std::sync::Arc;
use std::sync::mpsc;

use attnproof_oracle::online::{ring_block_at, zigzag_chunks};
use attnproof_oracle::spec::{Operand, Sequence};
use attnproof_oracle::{AttentionSpec, OracleError};
use ndarray::{Array1, Array2, ArrayView2, ArrayViewD, ArrayViewMutD, Axis, Ix2};

use crate::backward::{BackwardInputs, BackwardOutputs};
use crate::element::Element;
use crate::error::ReferenceError;
use crate::flash::{ForwardOutputs, Inputs, TileConfig, check_input, check_output, scale_f32};
use crate::mask::{kv_head, visible};

/// How a sequence is distributed over the devices (E11, E11a).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingLayout {
    /// `G` pieces; device `g` holds piece `g`.
    Contiguous,
    /// `2G` pieces; device `g` holds pieces `g` and `2G − 1 − g` (E11a).
    Zigzag,
}

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
    /// Rejects zero devices and zero tile sizes.
    pub fn validate(&self) -> Result<(), ReferenceError> {
        if self.n_devices == 0 {
            return Err(OracleError::ZeroDimension { argument: "n_devices" }.into());
        }
        self.tiles.validate()
    }

    /// Pieces a sequence is cut into: `G` (contiguous) or `2G` (zigzag).
    pub fn pieces(&self) -> usize {
        match self.layout {
            RingLayout::Contiguous => self.n_devices,
            RingLayout::Zigzag => 2 * self.n_devices,
        }
    }

    /// The `extra_merges` of the `FlashRecipe` that covers this schedule: `pieces − 1`, the most
    /// KV tiles a row can visit beyond `⌈Lk/kv_tile⌉` (module docs, precision recipe).
    pub fn extra_merges(&self) -> usize {
        self.pieces().saturating_sub(1)
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

/// What a ring run did, for tests of the schedule itself (not of its numbers).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RingStats {
    /// `(sequence, device, step)` triples whose KV block held no key visible to any of the
    /// device's queries, and which the device therefore skipped (causal skip).
    pub skipped_blocks: usize,
    /// Per device: visible `(query head, query, key)` pairs it evaluated (its load).
    pub visible_pairs: Vec<u64>,
}

/// A tile: its first local row (index into the device's or block's concatenated rows) and the
/// positions it covers within the sequence.
#[derive(Clone, Debug)]
struct Tile {
    local: usize,
    positions: Range<usize>,
}

/// Cuts the pieces `ranges` into tiles of `size`, each within one piece.
fn tiles_of(ranges: &[Range<usize>], size: usize) -> Vec<Tile> {
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
fn key_hull(spec: &AttentionSpec, seq: &Sequence, rows: Range<usize>) -> Range<usize> {
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
fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
}

/// A query tile and the hull of the keys its rows can see.
#[derive(Clone, Debug)]
struct QueryTile {
    tile: Tile,
    hull: Range<usize>,
}

fn query_tiles(spec: &AttentionSpec, seq: &Sequence, ranges: &[Range<usize>], q_tile: usize) -> Vec<QueryTile> {
    tiles_of(ranges, q_tile)
        .into_iter()
        .map(|tile| QueryTile { hull: key_hull(spec, seq, tile.positions.clone()), tile })
        .collect()
}

/// Whether any query tile can see any key of `key_ranges`: if not, the block is skipped.
fn block_meets(q_tiles: &[QueryTile], key_ranges: &[Range<usize>]) -> bool {
    q_tiles.iter().any(|qt| key_ranges.iter().any(|r| overlaps(&qt.hull, r)))
}

/// The rows at `ranges` of one head of `t`, widened to f32 (`[Σ len, D]`).
fn gather_f32<T: Element>(
    spec: &AttentionSpec,
    t: &ArrayViewD<'_, T>,
    seq: &Sequence,
    head: usize,
    keys: bool,
    ranges: &[Range<usize>],
) -> Array2<f32> {
    gather(spec, t, seq, head, keys, ranges).mapv(|x| x.to_f32())
}

fn gather<T: Clone>(
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
#[derive(Debug)]
struct SeqBlock<T> {
    ranges: Vec<Range<usize>>,
    k: Vec<Array2<T>>,
    v: Vec<Array2<T>>,
    dk: Vec<Array2<f32>>,
    dv: Vec<Array2<f32>>,
}

/// The KV block a device owns, travelling around the ring.
#[derive(Debug)]
struct KvBlock<T> {
    owner: usize,
    seqs: Vec<SeqBlock<T>>,
}

fn own_block<T: Element>(
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

/// A device's two ends of the ring: to its successor, from its predecessor.
type Link<M> = (mpsc::Sender<M>, mpsc::Receiver<M>);

/// Per sequence: the device's positions and one result per head.
type PerSeq<X> = Vec<(Sequence, Vec<Range<usize>>, Vec<X>)>;

/// The channels of a ring: device `g` sends to `g + 1` and receives from `g − 1` (mod `G`).
fn ring_channels<M>(n: usize) -> Vec<Link<M>> {
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::channel::<M>()).unzip();
    // Channel g carries messages into device g; device g sends on channel g + 1.
    let mut receivers: Vec<Option<mpsc::Receiver<M>>> = receivers.into_iter().map(Some).collect();
    (0..n).map(|g| (senders[(g + 1) % n].clone(), receivers[g].take().expect("each receiver taken once"))).collect()
}

/// Online-softmax state of a device's query rows for one (sequence, head).
struct RowStates {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Array2<f32>,
}

/// Absorbs KV tile `keys` (positions; local rows from `key_local`) into the state of query row
/// `r` (position `i`): one E3 update, the arithmetic of `flash`'s forward tile, operation for
/// operation (the G = 1 test holds the two to the same bits). Returns the visible pairs seen.
fn absorb_tile<T: Element>(
    spec: &AttentionSpec,
    seq: &Sequence,
    q: ArrayView2<'_, f32>,
    (r, i): (usize, usize),
    k: &Array2<f32>,
    v: &Array2<f32>,
    keys: &Tile,
    scale: f32,
    st: &mut RowStates,
) -> u64 {
    let local = |j: usize| keys.local + (j - keys.positions.start);
    let s: Vec<f32> = keys
        .positions
        .clone()
        .map(|j| {
            if visible(&spec.mask, i, j, seq.len_q, seq.len_k) {
                let dot = q.row(r).iter().zip(k.row(local(j))).fold(0f32, |a, (x, y)| a + x * y);
                dot * scale
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    let seen = s.iter().filter(|x| **x != f32::NEG_INFINITY).count() as u64;
    let m_new = s.iter().fold(st.m[r], |a, &b| a.max(b));
    if m_new == f32::NEG_INFINITY {
        return seen; // nothing visible yet: the state stays empty
    }
    let rescale = if st.m[r] == f32::NEG_INFINITY { 0.0 } else { (st.m[r] - m_new).exp() };
    let p: Vec<f32> = s.iter().map(|&x| if x == f32::NEG_INFINITY { 0.0 } else { (x - m_new).exp() }).collect();
    st.l[r] = rescale * st.l[r] + p.iter().sum::<f32>();
    for c in 0..v.ncols() {
        let pv = keys.positions.clone().zip(&p).fold(0f32, |a, (j, &pj)| a + T::round(pj) * v[[local(j), c]]);
        st.acc[[r, c]] = rescale * st.acc[[r, c]] + pv;
    }
    st.m[r] = m_new;
    seen
}

/// A device's queries of one sequence, per query head, and their tiles.
struct DeviceQueries {
    seq: Sequence,
    ranges: Vec<Range<usize>>,
    q_tiles: Vec<QueryTile>,
    q: Vec<Array2<f32>>,
}

fn device_queries<T: Element>(
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

/// One device's forward results: per sequence and query head, `O` (already rounded to `T`) and
/// `LSE` of its rows.
struct DeviceForward {
    rows: PerSeq<(Array2<f32>, Array1<f32>)>,
    skipped: usize,
    visible: u64,
}

fn device_forward<T: Element>(
    spec: &AttentionSpec,
    inputs: &Inputs<'_, T>,
    seqs: &[Sequence],
    config: RingConfig,
    device: usize,
    (tx, rx): Link<Arc<KvBlock<T>>>,
) -> DeviceForward {
    let g_count = config.n_devices;
    let scale = scale_f32(spec);
    let queries = device_queries(spec, seqs, &inputs.q, config, device);
    let dv = spec.head_dim_v;
    let mut states: Vec<Vec<RowStates>> = queries
        .iter()
        .map(|dq| {
            let n = dq.ranges.iter().map(|r| r.len()).sum();
            (0..spec.n_heads_q)
                .map(|_| RowStates { m: vec![f32::NEG_INFINITY; n], l: vec![0.0; n], acc: Array2::zeros((n, dv)) })
                .collect()
        })
        .collect();
    let (mut skipped, mut seen) = (0, 0);
    let mut block = Arc::new(own_block(spec, seqs, &inputs.k, &inputs.v, config, device));
    for step in 0..g_count {
        debug_assert_eq!(block.owner, ring_block_at(device, step, g_count));
        // Pass the block on before using it: the transfer overlaps the compute.
        if step + 1 < g_count {
            tx.send(Arc::clone(&block)).expect("ring neighbour alive");
        }
        for ((dq, part), seq_states) in queries.iter().zip(&block.seqs).zip(states.iter_mut()) {
            if !block_meets(&dq.q_tiles, &part.ranges) {
                skipped += 1;
                continue;
            }
            let seq = &dq.seq;
            let k_tiles = tiles_of(&part.ranges, config.tiles.kv_tile);
            let widen = |t: &Array2<T>| t.mapv(|x| x.to_f32());
            let (k, v): (Vec<_>, Vec<_>) = part.k.iter().zip(&part.v).map(|(k, v)| (widen(k), widen(v))).unzip();
            for (h, st) in seq_states.iter_mut().enumerate() {
                let kv = kv_head(h, spec.n_heads_q, spec.n_heads_kv);
                for qt in &dq.q_tiles {
                    for kt in k_tiles.iter().filter(|kt| overlaps(&qt.hull, &kt.positions)) {
                        for (n, i) in qt.tile.positions.clone().enumerate() {
                            let r = qt.tile.local + n;
                            seen += absorb_tile::<T>(spec, seq, dq.q[h].view(), (r, i), &k[kv], &v[kv], kt, scale, st);
                        }
                    }
                }
            }
        }
        if step + 1 < g_count {
            block = rx.recv().expect("ring neighbour alive");
        }
    }
    let rows = queries
        .into_iter()
        .zip(states)
        .map(|(dq, seq_states)| {
            let heads = seq_states
                .into_iter()
                .map(|st| {
                    let n = st.m.len();
                    let mut o = Array2::<f32>::zeros((n, dv));
                    let mut lse = Array1::from_elem(n, f32::NEG_INFINITY);
                    for r in 0..n {
                        // E5 finalize; ℓ = 0 (no visible key) leaves O = 0, LSE = −∞ (E1c).
                        if st.l[r] > 0.0 {
                            for c in 0..dv {
                                o[[r, c]] = T::round(st.acc[[r, c]] / st.l[r]);
                            }
                            lse[r] = st.m[r] + st.l[r].ln();
                        }
                    }
                    (o, lse)
                })
                .collect();
            (dq.seq, dq.ranges, heads)
        })
        .collect();
    DeviceForward { rows, skipped, visible: seen }
}

/// Ring attention forward (E11/E11a) of a whole problem into caller-owned outputs, over
/// `config.n_devices` device threads. Returns what the ring did (skips, per-device load).
pub fn ring_forward<T: Element>(
    spec: &AttentionSpec,
    inputs: &Inputs<'_, T>,
    config: RingConfig,
    out: ForwardOutputs<'_, T>,
) -> Result<RingStats, ReferenceError> {
    spec.validate()?;
    config.validate()?;
    check_input(spec, "q", Operand::Q, &inputs.q)?;
    check_input(spec, "k", Operand::K, &inputs.k)?;
    check_input(spec, "v", Operand::V, &inputs.v)?;
    let ForwardOutputs { mut o, mut lse } = out;
    check_output(spec, "o", Operand::O, &o)?;
    check_output(spec, "lse", Operand::RowStat, &lse)?;
    let seqs = spec.sequences();
    let channels = ring_channels::<Arc<KvBlock<T>>>(config.n_devices);
    let results: Vec<DeviceForward> = std::thread::scope(|s| {
        let handles: Vec<_> = channels
            .into_iter()
            .enumerate()
            .map(|(g, ch)| {
                let seqs = &seqs;
                s.spawn(move || device_forward(spec, inputs, seqs, config, g, ch))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("device thread")).collect()
    });
    let mut stats = RingStats::default();
    for r in results {
        stats.skipped_blocks += r.skipped;
        stats.visible_pairs.push(r.visible);
        for (seq, ranges, heads) in r.rows {
            let positions: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
            for (h, (o_rows, lse_rows)) in heads.into_iter().enumerate() {
                let mut o_head =
                    o.slice_mut(spec.head_slice(&seq, h, false)).into_dimensionality::<Ix2>().expect("2-D head");
                let mut lse_head = lse.slice_mut(spec.row_stat_slice(&seq, h));
                for (n, &i) in positions.iter().enumerate() {
                    for c in 0..spec.head_dim_v {
                        o_head[[i, c]] = T::from_f32(o_rows[[n, c]]);
                    }
                    lse_head[i] = lse_rows[n];
                }
            }
        }
    }
    Ok(stats)
}

/// A device's backward state of one (sequence, query head): its rows of `Q, O, dO` (f32),
/// `LSE`, `D`, and the f32 dQ accumulator.
struct HeadRows {
    q: Array2<f32>,
    d_out: Array2<f32>,
    lse: Array1<f32>,
    delta: Array1<f32>,
    dq: Array2<f32>,
}

/// A block's key positions and, per KV head, its group-summed f32 `(dK, dV)`.
type KeySums = (Vec<Range<usize>>, Vec<(Array2<f32>, Array2<f32>)>);

/// One device's backward results per sequence: its rows' positions, per query head `(dQ, D)`
/// (dQ scaled, f32), and its own block's keys with per-KV-head `(dK, dV)` summed over the group
/// (f32, to be rounded by the writer).
struct DeviceBackward {
    rows: PerSeq<(Array2<f32>, Array1<f32>)>,
    keys: Vec<KeySums>,
    skipped: usize,
    visible: u64,
}

fn device_backward<T: Element>(
    spec: &AttentionSpec,
    inputs: &BackwardInputs<'_, T>,
    seqs: &[Sequence],
    config: RingConfig,
    device: usize,
    (tx, rx): Link<KvBlock<T>>,
) -> DeviceBackward {
    let g_count = config.n_devices;
    let scale = scale_f32(spec);
    let (d, dv) = (spec.head_dim, spec.head_dim_v);
    let queries = device_queries(spec, seqs, &inputs.q, config, device);
    let mut heads: Vec<Vec<HeadRows>> = queries
        .iter()
        .map(|dq| {
            let seq = &dq.seq;
            (0..spec.n_heads_q)
                .map(|h| {
                    let o = gather_f32(spec, &inputs.o, seq, h, false, &dq.ranges);
                    let d_out = gather_f32(spec, &inputs.d_out, seq, h, false, &dq.ranges);
                    let lse_all = spec.head_row_stat(inputs.lse.view(), seq, h);
                    let lse: Array1<f32> = dq.ranges.iter().flat_map(|r| r.clone()).map(|i| lse_all[i]).collect();
                    // E7 preprocess: D_i = Σ_c dO_ic O_ic in f32, from the stored O.
                    let delta = Array1::from_shape_fn(o.nrows(), |r| {
                        d_out.row(r).iter().zip(o.row(r)).fold(0f32, |a, (x, y)| a + x * y)
                    });
                    let n = o.nrows();
                    HeadRows { q: dq.q[h].clone(), d_out, lse, delta, dq: Array2::zeros((n, d)) }
                })
                .collect()
        })
        .collect();
    let mut block = own_block(spec, seqs, &inputs.k, &inputs.v, config, device);
    for part in &mut block.seqs {
        let n = part.ranges.iter().map(|r| r.len()).sum();
        part.dk = (0..spec.n_heads_q).map(|_| Array2::zeros((n, d))).collect();
        part.dv = (0..spec.n_heads_q).map(|_| Array2::zeros((n, dv))).collect();
    }
    let (mut skipped, mut seen) = (0, 0u64);
    for step in 0..g_count {
        debug_assert_eq!(block.owner, ring_block_at(device, step, g_count));
        for ((dq, part), seq_heads) in queries.iter().zip(block.seqs.iter_mut()).zip(heads.iter_mut()) {
            if !block_meets(&dq.q_tiles, &part.ranges) {
                skipped += 1;
                continue;
            }
            let seq = &dq.seq;
            let k_tiles = tiles_of(&part.ranges, config.tiles.kv_tile);
            let widen = |t: &Array2<T>| t.mapv(|x| x.to_f32());
            let (k, v): (Vec<_>, Vec<_>) = part.k.iter().zip(&part.v).map(|(k, v)| (widen(k), widen(v))).unzip();
            for (h, hr) in seq_heads.iter_mut().enumerate() {
                let kv = kv_head(h, spec.n_heads_q, spec.n_heads_kv);
                let (k, v) = (&k[kv], &v[kv]);
                let (dk, dvv) = (&mut part.dk[h], &mut part.dv[h]);
                // KV tiles outer, query tiles inner: every dK/dV element sums its queries, and
                // every dQ element its keys, in ascending position within the block.
                for kt in &k_tiles {
                    for qt in dq.q_tiles.iter().filter(|qt| overlaps(&qt.hull, &kt.positions)) {
                        for (n, i) in qt.tile.positions.clone().enumerate() {
                            let r = qt.tile.local + n;
                            if hr.lse[r] == f32::NEG_INFINITY {
                                continue; // fully masked row: every gradient through it is 0 (E1c)
                            }
                            for (c, j) in kt.positions.clone().enumerate() {
                                if !visible(&spec.mask, i, j, seq.len_q, seq.len_k) {
                                    continue;
                                }
                                seen += 1;
                                let col = kt.local + c;
                                let s = hr.q.row(r).iter().zip(k.row(col)).fold(0f32, |a, (x, y)| a + x * y) * scale;
                                let p = (s - hr.lse[r]).exp();
                                let dp = hr.d_out.row(r).iter().zip(v.row(col)).fold(0f32, |a, (x, y)| a + x * y);
                                let ds = T::round(p * (dp - hr.delta[r]));
                                let pt = T::round(p);
                                for e in 0..dv {
                                    dvv[[col, e]] += pt * hr.d_out[[r, e]];
                                }
                                for e in 0..d {
                                    dk[[col, e]] += ds * hr.q[[r, e]];
                                    hr.dq[[r, e]] += ds * k[[col, e]];
                                }
                            }
                        }
                    }
                }
            }
        }
        // One hop on, accumulators included; after the G-th hop each block is home.
        tx.send(block).expect("ring neighbour alive");
        block = rx.recv().expect("ring neighbour alive");
    }
    debug_assert_eq!(block.owner, device);
    let keys = block
        .seqs
        .into_iter()
        .map(|part| {
            let (n, group) = (part.ranges.iter().map(|r| r.len()).sum(), spec.n_heads_q / spec.n_heads_kv);
            let sums = (0..spec.n_heads_kv)
                .map(|kv| {
                    let (mut dk_sum, mut dv_sum) = (Array2::<f32>::zeros((n, d)), Array2::<f32>::zeros((n, dv)));
                    // The group's query heads in ascending order, each dK scaled first.
                    for h in kv * group..(kv + 1) * group {
                        dk_sum += &part.dk[h].mapv(|x| x * scale);
                        dv_sum += &part.dv[h];
                    }
                    (dk_sum, dv_sum)
                })
                .collect();
            (part.ranges, sums)
        })
        .collect();
    let rows = queries
        .into_iter()
        .zip(heads)
        .map(|(dq, seq_heads)| {
            let per_head = seq_heads.into_iter().map(|hr| (hr.dq.mapv(|x| x * scale), hr.delta)).collect();
            (dq.seq, dq.ranges, per_head)
        })
        .collect();
    DeviceBackward { rows, keys, skipped, visible: seen }
}

/// Rounds `rows` (the rows at `ranges`, concatenated) to `T` into head slice `info` of `out`.
fn scatter_rows<T: Element>(
    out: &mut ArrayViewMutD<'_, T>,
    info: ndarray::SliceInfo<Vec<ndarray::SliceInfoElem>, ndarray::IxDyn, ndarray::IxDyn>,
    ranges: &[Range<usize>],
    rows: &Array2<f32>,
) {
    let mut view = out.slice_mut(info).into_dimensionality::<Ix2>().expect("2-D head");
    for (n, i) in ranges.iter().flat_map(|r| r.clone()).enumerate() {
        for c in 0..rows.ncols() {
            view[[i, c]] = T::from_f32(rows[[n, c]]);
        }
    }
}

/// Ring attention backward (E11 with E6–E10) of a whole problem into caller-owned outputs: the
/// KV blocks travel with their dK/dV accumulators and return to their owners. Returns what the
/// ring did (skips, per-device load).
pub fn ring_backward<T: Element>(
    spec: &AttentionSpec,
    inputs: &BackwardInputs<'_, T>,
    config: RingConfig,
    out: BackwardOutputs<'_, T>,
) -> Result<RingStats, ReferenceError> {
    spec.validate()?;
    config.validate()?;
    check_input(spec, "q", Operand::Q, &inputs.q)?;
    check_input(spec, "k", Operand::K, &inputs.k)?;
    check_input(spec, "v", Operand::V, &inputs.v)?;
    check_input(spec, "o", Operand::O, &inputs.o)?;
    check_input(spec, "d_out", Operand::O, &inputs.d_out)?;
    let lse_shape = spec.expected_shape(Operand::RowStat);
    if inputs.lse.shape() != lse_shape.as_slice() {
        return Err(OracleError::ShapeMismatch {
            argument: "lse",
            expected: lse_shape,
            actual: inputs.lse.shape().to_vec(),
        }
        .into());
    }
    let BackwardOutputs { mut dq, mut dk, mut dv, mut delta } = out;
    check_output(spec, "dq", Operand::Q, &dq)?;
    check_output(spec, "dk", Operand::K, &dk)?;
    check_output(spec, "dv", Operand::V, &dv)?;
    check_output(spec, "delta", Operand::RowStat, &delta)?;
    let seqs = spec.sequences();
    let channels = ring_channels::<KvBlock<T>>(config.n_devices);
    let results: Vec<DeviceBackward> = std::thread::scope(|s| {
        let handles: Vec<_> = channels
            .into_iter()
            .enumerate()
            .map(|(g, ch)| {
                let seqs = &seqs;
                s.spawn(move || device_backward(spec, inputs, seqs, config, g, ch))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("device thread")).collect()
    });
    let mut stats = RingStats::default();
    for r in results {
        stats.skipped_blocks += r.skipped;
        stats.visible_pairs.push(r.visible);
        for (seq, ranges, per_head) in &r.rows {
            let positions: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
            for (h, (dq_rows, delta_rows)) in per_head.iter().enumerate() {
                scatter_rows(&mut dq, spec.head_slice(seq, h, false), ranges, dq_rows);
                let mut delta_head = delta.slice_mut(spec.row_stat_slice(seq, h));
                for (n, &i) in positions.iter().enumerate() {
                    delta_head[i] = delta_rows[n];
                }
            }
        }
        for ((seq, _, _), (ranges, sums)) in r.rows.iter().zip(&r.keys) {
            for (kv, (dk_sum, dv_sum)) in sums.iter().enumerate() {
                scatter_rows(&mut dk, spec.head_slice(seq, kv, true), ranges, dk_sum);
                scatter_rows(&mut dv, spec.head_slice(seq, kv, true), ranges, dv_sum);
            }
        }
    }
    Ok(stats)
}
