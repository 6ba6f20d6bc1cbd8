//! The ring forward pass (E11/E11a with E3): a [`RingWorker`] that absorbs each visiting KV
//! block into its query rows' online-softmax states, run by the CPU-threads backend.

use std::marker::PhantomData;
use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::{Operand, Sequence};
use attnproof_ring_driver::{RingWorker, Travel};
use ndarray::{Array1, Array2, ArrayView2, Ix2};

use super::blocks::{DeviceQueries, KvBlock, PerSeq, Tile, block_meets, device_queries, overlaps, own_block, tiles_of};
use super::config::{RingConfig, RingStats};
use super::cpu::run_on_threads;
use crate::element::Element;
use crate::error::ReferenceError;
use crate::flash::{ForwardOutputs, Inputs, check_input, check_output, scale_f32};
use crate::mask::{kv_head, visible};

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

/// One device of the forward ring: its query rows and their running states, per sequence and
/// query head.
struct ForwardDevice<'a, T> {
    spec: &'a AttentionSpec,
    kv_tile: usize,
    scale: f32,
    queries: Vec<DeviceQueries>,
    states: Vec<Vec<RowStates>>,
    /// Visible `(query head, query, key)` pairs evaluated so far.
    visible_pairs: u64,
    storage: PhantomData<T>,
}

impl<'a, T: Element> ForwardDevice<'a, T> {
    fn new(
        spec: &'a AttentionSpec,
        inputs: &Inputs<'_, T>,
        seqs: &[Sequence],
        config: RingConfig,
        device: usize,
    ) -> Self {
        let queries = device_queries(spec, seqs, &inputs.q, config, device);
        let dv = spec.head_dim_v;
        let states = queries
            .iter()
            .map(|dq| {
                let n = dq.ranges.iter().map(|r| r.len()).sum();
                (0..spec.n_heads_q)
                    .map(|_| RowStates { m: vec![f32::NEG_INFINITY; n], l: vec![0.0; n], acc: Array2::zeros((n, dv)) })
                    .collect()
            })
            .collect();
        ForwardDevice {
            spec,
            kv_tile: config.tiles.kv_tile,
            scale: scale_f32(spec),
            queries,
            states,
            visible_pairs: 0,
            storage: PhantomData,
        }
    }

    /// E5 finalize of every row: per sequence and query head, `O` (already rounded to `T`) and
    /// `LSE` of the device's rows.
    fn finish(self) -> PerSeq<(Array2<f32>, Array1<f32>)> {
        let dv = self.spec.head_dim_v;
        self.queries
            .into_iter()
            .zip(self.states)
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
            .collect()
    }
}

impl<T: Element> RingWorker for ForwardDevice<'_, T> {
    /// Read-only, so shared: the hop hands the successor the same block.
    type Block = Arc<KvBlock<T>>;
    type Error = ReferenceError;
    const TRAVEL: Travel = Travel::ReadOnly;

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
        let (dq, share) = (&self.queries[part], &block.seqs[part]);
        let seq = &dq.seq;
        let k_tiles = tiles_of(&share.ranges, self.kv_tile);
        let (k, v) = share.widened();
        for (h, st) in self.states[part].iter_mut().enumerate() {
            let kv = kv_head(h, spec.n_heads_q, spec.n_heads_kv);
            for qt in &dq.q_tiles {
                for kt in k_tiles.iter().filter(|kt| overlaps(&qt.hull, &kt.positions)) {
                    for (n, i) in qt.tile.positions.clone().enumerate() {
                        let r = qt.tile.local + n;
                        self.visible_pairs +=
                            absorb_tile::<T>(spec, seq, dq.q[h].view(), (r, i), &k[kv], &v[kv], kt, scale, st);
                    }
                }
            }
        }
        Ok(())
    }
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
    let devices = run_on_threads(config.n_devices, |device| {
        let worker = ForwardDevice::new(spec, inputs, &seqs, config, device);
        (worker, Arc::new(own_block(spec, &seqs, &inputs.k, &inputs.v, config, device)))
    })?;
    let mut stats = RingStats::default();
    for (device, run) in devices {
        stats.skipped_blocks += run.skipped_parts;
        stats.visible_pairs.push(device.visible_pairs);
        for (seq, ranges, heads) in device.finish() {
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
