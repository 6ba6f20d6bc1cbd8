//! HiLS's factorized output (E21) as `hils_output` (`gpu/kernels/hils.cu`) runs it, on the CPU: every row in f64 from
//! the inputs' exact values, in the kernel's order, so that the verifier's f64 evaluation model is tried against an
//! order other than the oracle's without a device.
//!
//! # Schedule (the kernel's, lane for lane)
//!
//! Per (sequence, query head, query `i`), causal self-attention:
//! - **Online softmax over a key range**, 32 keys per group: key `j`'s score `s_j = α̂ · dot` with `dot` one fused
//!   multiply-add chain over the columns (ascending), `α̂ = fl64(1/√d)`; the group's maximum `m'` = max(m, max_j s_j);
//!   `carry = e^{m − m'}`; weights `w_j = e^{s_j − m'}`; `l ← l · carry + tree(w)`, the tree the warp's
//!   `__shfl_down_sync` sum (offsets 16, 8, 4, 2, 1, lane 0's total); `a_c ← a_c · carry`, then `a_c ← fma(w_j, v_jc,
//!   a_c)` for the group's keys in order.
//! - **The row**: that softmax over the local window `[start_i, i]`, `start_i = C ⌊max(0, i + 1 − w)/C⌋`; then per
//!   listed chunk `b` (ascending) the same softmax over its `C` keys from an empty state, `ō = a/l`, and the log-mass
//!   `m + ln l` ([`ChunkMass::Exact`]) or `α̂ · dot(q, k'_b) + H(p_b)` from the given summaries
//!   ([`ChunkMass::Surrogate`]); merged as one key: `M = max(m, log-mass)`, `l ← l e^{m − M} + e^{log-mass − M}`,
//!   `a_c ← a_c e^{m − M} + ō_c e^{log-mass − M}`.
//! - **Out**: `O = RN_T(a/l)` from f64 once ([`Element::from_f64`]), `LSE = fl32(m + ln l)`.

use attnproof_oracle::hils::{ChunkMass, HilsConfig, eligible_chunks, local_window_start};
use attnproof_oracle::spec::Operand;
use attnproof_oracle::topk::validate_index_row;
use attnproof_oracle::{AttentionSpec, Mask, OracleError};
use ndarray::{Array1, ArrayView1, ArrayView2, ArrayView4, Axis, IxDyn};

use crate::element::Element;
use crate::error::ReferenceError;
use crate::flash::{ForwardOutputs, Inputs};
use crate::mask::kv_head;

/// Keys per group of the online softmax (a warp's lanes).
pub const GROUP: usize = 32;

/// One query's online-softmax state in f64: running maximum, sum and numerator per value column.
#[derive(Clone, Debug)]
struct State {
    m: f64,
    l: f64,
    a: Array1<f64>,
}

impl State {
    fn empty(dv: usize) -> State {
        State { m: f64::NEG_INFINITY, l: 0.0, a: Array1::zeros(dv) }
    }

    /// Adds keys `keys` (rows of `k`, `v`) for query `q`, [`GROUP`] at a time (module docs).
    fn attend(&mut self, q: ArrayView1<'_, f64>, (k, v): (ArrayView2<'_, f64>, ArrayView2<'_, f64>), scale: f64) {
        for group in (0..k.nrows()).step_by(GROUP) {
            let rows = group..(group + GROUP).min(k.nrows());
            let scores: Vec<f64> = rows.clone().map(|j| scale * dot_fma(q, k.row(j))).collect();
            let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let m_new = self.m.max(top);
            let carry = (self.m - m_new).exp();
            let mut lanes = [0f64; GROUP];
            for (lane, s) in lanes.iter_mut().zip(&scores) {
                *lane = (s - m_new).exp();
            }
            self.l = self.l * carry + warp_tree_sum(lanes);
            self.a.mapv_inplace(|x| x * carry);
            for (r, j) in rows.enumerate() {
                for (a, &x) in self.a.iter_mut().zip(v.row(j)) {
                    *a = lanes[r].mul_add(x, *a);
                }
            }
            self.m = m_new;
        }
    }

    /// Merges one key of value `value` and log-weight `log_mass`.
    fn merge(&mut self, value: &Array1<f64>, log_mass: f64) {
        let m_new = self.m.max(log_mass);
        let (keep, enter) = ((self.m - m_new).exp(), (log_mass - m_new).exp());
        self.l = self.l * keep + enter;
        for (a, &x) in self.a.iter_mut().zip(value) {
            *a = *a * keep + x * enter;
        }
        self.m = m_new;
    }
}

/// `Σ_c q_c k_c` as one fused multiply-add chain over the columns, ascending.
fn dot_fma(q: ArrayView1<'_, f64>, k: ArrayView1<'_, f64>) -> f64 {
    q.iter().zip(k).fold(0.0, |acc, (&x, &y)| x.mul_add(y, acc))
}

/// The warp's fixed-tree sum: lane `l` adds lane `l + off` for `off` = 16, 8, 4, 2, 1; lane 0's total.
fn warp_tree_sum(mut lanes: [f64; GROUP]) -> f64 {
    let mut off = GROUP / 2;
    while off > 0 {
        for l in 0..off {
            lanes[l] += lanes[l + off];
        }
        off /= 2;
    }
    lanes[0]
}

/// HiLS's forward over the caller's `lists` `[B, Hq, max_len, K]` (each valid row ascending, distinct, `−1`-padded,
/// naming only chunks before its row's local window) with the chunks weighed by `mass`; `summaries`
/// `[B, Hq, n_c, d + 1]` (slope keys, then entropies: the router's) are read for [`ChunkMass::Surrogate`]. Writes `O`
/// and the LSE into `out`.
///
/// Errors: a mask other than causal or `Lq ≠ Lk` in a sequence, a zero chunk size or window, misshapen `lists` or
/// `summaries`, a list that breaks the convention.
pub fn hils_forward<T: Element>(
    spec: &AttentionSpec,
    inputs: &Inputs<'_, T>,
    (config, mass): (HilsConfig, ChunkMass),
    summaries: ArrayView4<'_, f64>,
    lists: ArrayView4<'_, i32>,
    out: ForwardOutputs<'_, T>,
) -> Result<(), ReferenceError> {
    spec.validate()?;
    if !matches!(spec.mask, Mask::Causal) || spec.sequences().iter().any(|s| s.len_q != s.len_k) {
        let mask = format!("{:?}", spec.mask);
        return Err(ReferenceError::UnsupportedMask { mask, reason: "HiLS takes causal self-attention (Lq = Lk)" });
    }
    if config.chunk_size == 0 || config.local_window == 0 {
        let reason = format!("{config:?}: the chunk size and the window are at least 1");
        return Err(OracleError::InvalidParameter { argument: "config", reason }.into());
    }
    let (d, dv) = (spec.head_dim, spec.head_dim_v);
    let max_len = spec.sequences().iter().map(|s| s.len_q).max().unwrap_or(0);
    let n_c = max_len.div_ceil(config.chunk_size);
    let shapes = [
        ("lists", lists.shape(), [spec.sequences().len(), spec.n_heads_q, max_len, config.retrieved_chunks]),
        ("summaries", summaries.shape(), [spec.sequences().len(), spec.n_heads_q, n_c, d + 1]),
    ];
    for (argument, actual, expected) in shapes {
        if actual != expected {
            let (expected, actual) = (expected.to_vec(), actual.to_vec());
            return Err(OracleError::ShapeMismatch { argument, expected, actual }.into());
        }
    }
    let scale = 1.0 / (d as f64).sqrt();
    let ForwardOutputs { mut o, mut lse } = out;
    let widen = |t: &ndarray::ArrayViewD<'_, T>| t.mapv(|x| f64::from(x.to_f32()));
    let (q, k, v) = (widen(&inputs.q), widen(&inputs.k), widen(&inputs.v));
    for seq in spec.sequences() {
        for h in 0..spec.n_heads_q {
            let kv = kv_head(h, spec.n_heads_q, spec.n_heads_kv);
            let (qh, kh, vh) = (
                spec.head_rows(q.view(), &seq, h, false),
                spec.head_rows(k.view(), &seq, kv, true),
                spec.head_rows(v.view(), &seq, kv, true),
            );
            let head_lists = lists.index_axis(Axis(0), seq.index).index_axis_move(Axis(0), h);
            let head_summaries = summaries.index_axis(Axis(0), seq.index).index_axis_move(Axis(0), h);
            for i in 0..seq.len_q {
                let row: Vec<i32> = head_lists.row(i).to_vec();
                let eligible = eligible_chunks(i, config).end;
                let chunks = validate_index_row("lists", i, &row, eligible)?;
                let start = local_window_start(i, config);
                let keys = |range: std::ops::Range<usize>| {
                    (kh.slice_axis(Axis(0), range.clone().into()), vh.slice_axis(Axis(0), range.into()))
                };
                let mut state = State::empty(dv);
                state.attend(qh.row(i), keys(start..i + 1), scale);
                for b in chunks {
                    let key0 = b * config.chunk_size;
                    let mut chunk = State::empty(dv);
                    chunk.attend(qh.row(i), keys(key0..key0 + config.chunk_size), scale);
                    let average = chunk.a.mapv(|x| x / chunk.l);
                    let log_mass = match mass {
                        ChunkMass::Exact => chunk.m + chunk.l.ln(),
                        ChunkMass::Surrogate => {
                            let summary = head_summaries.row(b);
                            scale * dot_fma(qh.row(i), summary.slice_axis(Axis(0), (0..d).into())) + summary[d]
                        }
                    };
                    state.merge(&average, log_mass);
                }
                let (o_at, lse_at) = match spec.layout {
                    attnproof_oracle::Layout::Dense { .. } => (vec![seq.index, h, i], vec![seq.index, h, i]),
                    attnproof_oracle::Layout::Varlen { .. } => (vec![seq.q_start + i, h], vec![h, seq.q_start + i]),
                };
                for c in 0..dv {
                    o[IxDyn(&[o_at.as_slice(), &[c]].concat())] = T::from_f64(state.a[c] / state.l);
                }
                lse[IxDyn(&lse_at)] = (state.m + state.l.ln()) as f32;
            }
        }
    }
    debug_assert_eq!(o.shape(), spec.expected_shape(Operand::O).as_slice());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tree adds lane `l + off` into lane `l`: with values that round differently by order, the result is the
    /// tree's, not the sequential sum's.
    #[test]
    fn the_tree_sum_is_the_warps() {
        // Lanes 8 and 24 meet first (2^-52, exact), then lane 0 takes their sum: 1 + 2^-52. Summed in lane order, each
        // 2^-53 is a tie that rounds back to 1.
        let mut lanes = [0f64; GROUP];
        lanes[0] = 1.0;
        lanes[8] = 2f64.powi(-53);
        lanes[24] = 2f64.powi(-53);
        assert_eq!(warp_tree_sum(lanes), 1.0 + 2f64.powi(-52));
        assert_eq!(lanes.iter().sum::<f64>(), 1.0);
    }

    /// One key per group and one merge: the state's output is the two-key softmax average, its LSE their log-sum-exp.
    #[test]
    fn a_state_is_an_online_softmax() {
        let q = ndarray::array![1.0, 0.0];
        let k = ndarray::array![[0.5, 3.0], [2.0, -1.0]];
        let v = ndarray::array![[1.0], [3.0]];
        let mut s = State::empty(1);
        s.attend(q.view(), (k.view(), v.view()), 1.0);
        let (e0, e1) = ((0.5f64 - 2.0).exp(), 1.0);
        assert!((s.a[0] / s.l - (e0 * 1.0 + e1 * 3.0) / (e0 + e1)).abs() < 1e-15);
        assert!((s.m + s.l.ln() - (0.5f64.exp() + 2f64.exp()).ln()).abs() < 1e-15);
        s.merge(&ndarray::array![-1.0], 5.0);
        let z = 0.5f64.exp() + 2f64.exp() + 5f64.exp();
        assert!((s.a[0] / s.l - (0.5f64.exp() + 3.0 * 2f64.exp() - 5f64.exp()) / z).abs() < 1e-14);
    }
}
