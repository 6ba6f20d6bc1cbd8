//! The ring backward pass (E11 with E6–E10): a [`RingWorker`] whose KV blocks carry f32 dK/dV
//! accumulators around the ring and home to their owners, while each device accumulates dQ of
//! its own rows; run by the CPU-threads backend.

use std::marker::PhantomData;
use std::ops::Range;

use attnproof_oracle::spec::{Operand, Sequence};
use attnproof_oracle::{AttentionSpec, OracleError};
use attnproof_ring_driver::{RingWorker, Travel};
use ndarray::{Array1, Array2, ArrayViewMutD, Ix2};

use super::blocks::{
    DeviceQueries, KvBlock, PerSeq, block_meets, device_queries, gather_f32, overlaps, own_block, tiles_of,
};
use super::config::{RingConfig, RingStats};
use super::cpu::run_on_threads;
use crate::backward::{BackwardInputs, BackwardOutputs};
use crate::element::Element;
use crate::error::ReferenceError;
use crate::flash::{check_input, check_output, scale_f32};
use crate::mask::{kv_head, visible};

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

/// One device of the backward ring: its query rows' state per sequence and query head.
struct BackwardDevice<'a, T> {
    spec: &'a AttentionSpec,
    kv_tile: usize,
    scale: f32,
    queries: Vec<DeviceQueries>,
    heads: Vec<Vec<HeadRows>>,
    /// Visible `(query head, query, key)` pairs evaluated so far.
    visible_pairs: u64,
    storage: PhantomData<T>,
}

impl<'a, T: Element> BackwardDevice<'a, T> {
    fn new(
        spec: &'a AttentionSpec,
        inputs: &BackwardInputs<'_, T>,
        seqs: &[Sequence],
        config: RingConfig,
        device: usize,
    ) -> Self {
        let d = spec.head_dim;
        let queries = device_queries(spec, seqs, &inputs.q, config, device);
        let heads = queries
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
        BackwardDevice {
            spec,
            kv_tile: config.tiles.kv_tile,
            scale: scale_f32(spec),
            queries,
            heads,
            visible_pairs: 0,
            storage: PhantomData,
        }
    }

    /// The block `device` owns, with zero f32 dK/dV accumulators per query head.
    fn own_block(
        spec: &AttentionSpec,
        inputs: &BackwardInputs<'_, T>,
        seqs: &[Sequence],
        config: RingConfig,
        device: usize,
    ) -> KvBlock<T> {
        let mut block = own_block(spec, seqs, &inputs.k, &inputs.v, config, device);
        for share in &mut block.seqs {
            let n = share.len();
            share.dk = (0..spec.n_heads_q).map(|_| Array2::zeros((n, spec.head_dim))).collect();
            share.dv = (0..spec.n_heads_q).map(|_| Array2::zeros((n, spec.head_dim_v))).collect();
        }
        block
    }

    /// Per sequence: the device's rows' positions and per query head `(dQ, D)` (dQ scaled, f32).
    fn finish(self) -> PerSeq<(Array2<f32>, Array1<f32>)> {
        let scale = self.scale;
        self.queries
            .into_iter()
            .zip(self.heads)
            .map(|(dq, seq_heads)| {
                let per_head = seq_heads.into_iter().map(|hr| (hr.dq.mapv(|x| x * scale), hr.delta)).collect();
                (dq.seq, dq.ranges, per_head)
            })
            .collect()
    }
}

/// Per sequence, the keys of the device's own block, home after `G` hops, with per-KV-head
/// `(dK, dV)` summed over the group (f32, to be rounded by the writer).
fn key_sums<T: Element>(spec: &AttentionSpec, block: KvBlock<T>) -> Vec<KeySums> {
    let (d, dv, scale) = (spec.head_dim, spec.head_dim_v, scale_f32(spec));
    block
        .seqs
        .into_iter()
        .map(|part| {
            let (n, group) = (part.len(), spec.n_heads_q / spec.n_heads_kv);
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
        .collect()
}

impl<T: Element> RingWorker for BackwardDevice<'_, T> {
    /// Owned and mutated: the hop moves the block, accumulators included, to the successor.
    type Block = KvBlock<T>;
    type Error = ReferenceError;
    const TRAVEL: Travel = Travel::Accumulating;

    fn owner(&self, block: &Self::Block) -> usize {
        block.owner
    }

    fn parts(&self) -> usize {
        self.queries.len()
    }

    fn sees(&self, part: usize, block: &Self::Block) -> bool {
        block_meets(&self.queries[part].q_tiles, &block.seqs[part].ranges)
    }

    fn attend(&mut self, part: usize, block: &mut Self::Block) -> Result<(), ReferenceError> {
        let (spec, scale) = (self.spec, self.scale);
        let (d, dv) = (spec.head_dim, spec.head_dim_v);
        let (dq, share) = (&self.queries[part], &mut block.seqs[part]);
        let seq = &dq.seq;
        let k_tiles = tiles_of(&share.ranges, self.kv_tile);
        let (k, v) = share.widened();
        for (h, hr) in self.heads[part].iter_mut().enumerate() {
            let kv = kv_head(h, spec.n_heads_q, spec.n_heads_kv);
            let (k, v) = (&k[kv], &v[kv]);
            let (dk, dvv) = (&mut share.dk[h], &mut share.dv[h]);
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
                            self.visible_pairs += 1;
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
        Ok(())
    }
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
    let devices = run_on_threads(config.n_devices, |device| {
        let worker = BackwardDevice::new(spec, inputs, &seqs, config, device);
        (worker, BackwardDevice::own_block(spec, inputs, &seqs, config, device))
    })?;
    let mut stats = RingStats::default();
    for (device, run) in devices {
        stats.skipped_blocks += run.skipped_parts;
        stats.visible_pairs.push(device.visible_pairs);
        let keys = key_sums(spec, run.held);
        let rows = device.finish();
        for (seq, ranges, per_head) in &rows {
            let positions: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
            for (h, (dq_rows, delta_rows)) in per_head.iter().enumerate() {
                scatter_rows(&mut dq, spec.head_slice(seq, h, false), ranges, dq_rows);
                let mut delta_head = delta.slice_mut(spec.row_stat_slice(seq, h));
                for (n, &i) in positions.iter().enumerate() {
                    delta_head[i] = delta_rows[n];
                }
            }
        }
        for ((seq, _, _), (ranges, sums)) in rows.iter().zip(&keys) {
            for (kv, (dk_sum, dv_sum)) in sums.iter().enumerate() {
                scatter_rows(&mut dk, spec.head_slice(seq, kv, true), ranges, dk_sum);
                scatter_rows(&mut dv, spec.head_slice(seq, kv, true), ranges, dv_sum);
            }
        }
    }
    Ok(stats)
}
