//! FlashAttention backward (E6–E10) as tiled CPU schedules: the preprocess `D = rowsum(dO ∘ O)`
//! (E7), then either strategy A (E10a, Triton tutorial: one traversal owns KV tiles for dK/dV,
//! a second owns query tiles for dQ, recomputing `P` twice) or strategy B (FlashAttention-2: KV
//! tiles own dK/dV and emit per-KV-tile partial dQ, summed afterwards in ascending KV-tile order,
//! so the result is deterministic).
//!
//! # Precision recipe
//!
//! Inputs `Q, K, V, O, dO` in the storage type `T`, `LSE` in f32 (as the forward saved them).
//! `D_i = Σ_c dO_ic O_ic` in f32. For each tile pair: `s = α̂ (q·k)` in f32, `P = exp(s − LSE)`
//! in f32 (0 where masked or where `LSE = −∞`); `dV += round_T(P)ᵀ dO`; `dP = dO Vᵀ` in f32;
//! `dS = P ∘ (dP − D)` in f32, rounded to `T`; `dQ += dS K`, `dK += dSᵀ Q` in f32. At the end
//! `dQ, dK ← α̂·(…)`; under GQA the per-query-head f32 dK, dV of a KV head are summed in ascending
//! head order; every gradient is rounded to `T`.

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::{Operand, Sequence};
use ndarray::{Array1, Array2, ArrayViewD, ArrayViewMutD, Ix2};
use rayon::prelude::*;

use crate::element::Element;
use crate::error::ReferenceError;
use crate::flash::{check_input, check_output, head_f32, scale_f32};
use crate::mask::{kv_head, visible};
use crate::tile::TileConfig;

/// How dQ is owned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackwardStrategy {
    /// E10a strategy A: a second traversal over query tiles recomputes `P` and owns dQ.
    TwoTraversals,
    /// E10a strategy B: KV tiles own dK/dV and write partial dQ, summed in fixed order.
    KvOwnerPartialDq,
}

/// Inputs of the backward pass.
#[derive(Clone, Debug)]
pub struct BackwardInputs<'a, T> {
    /// Queries.
    pub q: ArrayViewD<'a, T>,
    /// Keys.
    pub k: ArrayViewD<'a, T>,
    /// Values.
    pub v: ArrayViewD<'a, T>,
    /// The forward output.
    pub o: ArrayViewD<'a, T>,
    /// The forward LSE (f32).
    pub lse: ArrayViewD<'a, f32>,
    /// Upstream gradient, shaped like `O`.
    pub d_out: ArrayViewD<'a, T>,
}

/// Caller-owned outputs of the backward pass.
#[derive(Debug)]
pub struct BackwardOutputs<'a, T> {
    /// Gradient of Q.
    pub dq: ArrayViewMutD<'a, T>,
    /// Gradient of K (summed over each KV head's query heads).
    pub dk: ArrayViewMutD<'a, T>,
    /// Gradient of V (likewise).
    pub dv: ArrayViewMutD<'a, T>,
    /// The preprocess `D` (f32), laid out like LSE.
    pub delta: ArrayViewMutD<'a, f32>,
}

/// One head's f32 gradients (dQ, dK scaled by `α̂`; dK, dV before the GQA sum).
pub(crate) struct HeadGrads {
    pub(crate) dq: Array2<f32>,
    pub(crate) dk: Array2<f32>,
    pub(crate) dv: Array2<f32>,
    pub(crate) delta: Array1<f32>,
}

/// The f32 tensors of one (sequence, query head).
pub(crate) struct Head {
    pub(crate) q: Array2<f32>,
    pub(crate) k: Array2<f32>,
    pub(crate) v: Array2<f32>,
    pub(crate) o: Array2<f32>,
    pub(crate) d_out: Array2<f32>,
    pub(crate) lse: Array1<f32>,
}

/// `P` and the rounded `dS` of one tile pair, `[rows, keys]` (0 where masked or `LSE = −∞`).
pub(crate) fn tile_p_ds<T: Element>(
    spec: &AttentionSpec,
    seq: &Sequence,
    head: &Head,
    delta: &Array1<f32>,
    rows: &std::ops::Range<usize>,
    keys: &std::ops::Range<usize>,
    scale: f32,
) -> (Array2<f32>, Array2<f32>) {
    let mut p = Array2::<f32>::zeros((rows.len(), keys.len()));
    let mut ds = Array2::<f32>::zeros((rows.len(), keys.len()));
    for (r, i) in rows.clone().enumerate() {
        if head.lse[i] == f32::NEG_INFINITY {
            continue;
        }
        for (c, j) in keys.clone().enumerate() {
            if !visible(&spec.mask, i, j, seq.len_q, seq.len_k) {
                continue;
            }
            let s = head.q.row(i).iter().zip(head.k.row(j)).fold(0f32, |a, (x, y)| a + x * y) * scale;
            let pij = (s - head.lse[i]).exp();
            let dp = head.d_out.row(i).iter().zip(head.v.row(j)).fold(0f32, |a, (x, y)| a + x * y);
            p[[r, c]] = pij;
            ds[[r, c]] = T::round(pij * (dp - delta[i]));
        }
    }
    (p, ds)
}

/// The KV tile's side of one tile pair: `dV += round_T(P)ᵀ dO` and `dK += dSᵀ Q` on the rows
/// `keys`, summing over `rows` in ascending order.
pub(crate) fn add_kv_tile<T: Element>(
    g: &mut HeadGrads,
    head: &Head,
    p: &Array2<f32>,
    ds: &Array2<f32>,
    rows: &std::ops::Range<usize>,
    keys: &std::ops::Range<usize>,
) {
    for (c, j) in keys.clone().enumerate() {
        for (r, i) in rows.clone().enumerate() {
            let (pt, dsij) = (T::round(p[[r, c]]), ds[[r, c]]);
            for e in 0..g.dv.ncols() {
                g.dv[[j, e]] += pt * head.d_out[[i, e]];
            }
            for e in 0..g.dk.ncols() {
                g.dk[[j, e]] += dsij * head.q[[i, e]];
            }
        }
    }
}

/// The query tile's side of one tile pair: `dQ += dS K` on the rows `rows` (of `dq`, the head's
/// dQ or one KV tile's partial), summing over `keys` in ascending order.
pub(crate) fn add_dq_tile(
    dq: &mut Array2<f32>,
    head: &Head,
    ds: &Array2<f32>,
    rows: &std::ops::Range<usize>,
    keys: &std::ops::Range<usize>,
) {
    for (r, i) in rows.clone().enumerate() {
        for (c, j) in keys.clone().enumerate() {
            for e in 0..dq.ncols() {
                dq[[i, e]] += ds[[r, c]] * head.k[[j, e]];
            }
        }
    }
}

fn head_backward<T: Element>(
    spec: &AttentionSpec,
    seq: &Sequence,
    head: &Head,
    tiles: TileConfig,
    strategy: BackwardStrategy,
    scale: f32,
) -> HeadGrads {
    let (len_q, d) = head.q.dim();
    let (len_k, dv) = head.v.dim();
    let delta =
        Array1::from_shape_fn(len_q, |i| head.d_out.row(i).iter().zip(head.o.row(i)).fold(0f32, |a, (x, y)| a + x * y));
    let q_tiles: Vec<_> =
        (0..len_q.div_ceil(tiles.q_tile)).map(|a| a * tiles.q_tile..((a + 1) * tiles.q_tile).min(len_q)).collect();
    let kv_tiles: Vec<_> =
        (0..len_k.div_ceil(tiles.kv_tile)).map(|b| b * tiles.kv_tile..((b + 1) * tiles.kv_tile).min(len_k)).collect();
    // A tile pair is visited only if some row of the query tile can see some key of the KV tile.
    let meets = |rows: &std::ops::Range<usize>, keys: &std::ops::Range<usize>| {
        rows.clone().any(|i| {
            let r = spec.mask.key_range(i, seq.len_q, seq.len_k);
            r.start < keys.end && keys.start < r.end
        })
    };
    let mut g = HeadGrads {
        dq: Array2::zeros((len_q, d)),
        dk: Array2::zeros((len_k, d)),
        dv: Array2::zeros((len_k, dv)),
        delta: delta.clone(),
    };
    let mut partial_dq: Vec<Array2<f32>> = Vec::new();
    // dK/dV: every strategy lets KV tiles own them.
    for keys in &kv_tiles {
        let mut dq_partial = Array2::<f32>::zeros((len_q, d));
        for rows in q_tiles.iter().filter(|rows| meets(rows, keys)) {
            let (p, ds) = tile_p_ds::<T>(spec, seq, head, &delta, rows, keys, scale);
            add_kv_tile::<T>(&mut g, head, &p, &ds, rows, keys);
            if strategy == BackwardStrategy::KvOwnerPartialDq {
                add_dq_tile(&mut dq_partial, head, &ds, rows, keys);
            }
        }
        if strategy == BackwardStrategy::KvOwnerPartialDq {
            partial_dq.push(dq_partial);
        }
    }
    match strategy {
        BackwardStrategy::KvOwnerPartialDq => {
            // Fixed order: ascending KV tile, so the sum does not depend on scheduling.
            for partial in &partial_dq {
                g.dq += partial;
            }
        }
        BackwardStrategy::TwoTraversals => {
            for rows in &q_tiles {
                for keys in kv_tiles.iter().filter(|keys| meets(rows, keys)) {
                    let (_, ds) = tile_p_ds::<T>(spec, seq, head, &delta, rows, keys, scale);
                    add_dq_tile(&mut g.dq, head, &ds, rows, keys);
                }
            }
        }
    }
    g.dq.mapv_inplace(|x| x * scale);
    g.dk.mapv_inplace(|x| x * scale);
    g
}

/// FlashAttention backward of a whole problem into caller-owned outputs, parallel over
/// (sequence, query head); GQA sums in ascending head order.
pub fn flash_backward<T: Element>(
    spec: &AttentionSpec,
    inputs: &BackwardInputs<'_, T>,
    tiles: TileConfig,
    strategy: BackwardStrategy,
    out: BackwardOutputs<'_, T>,
) -> Result<(), ReferenceError> {
    spec.validate()?;
    tiles.validate()?;
    let scale = scale_f32(spec);
    backward_heads(spec, inputs, out, &|seq, _, head| Ok(head_backward::<T>(spec, seq, head, tiles, strategy, scale)))
}

/// The part every backward schedule shares: validates inputs and outputs, runs `per_head` on
/// every (sequence, query head) in parallel, sums dK/dV per KV head in f32 in ascending query
/// head order, and rounds every gradient to `T` into the caller's outputs.
pub(crate) fn backward_heads<T: Element>(
    spec: &AttentionSpec,
    inputs: &BackwardInputs<'_, T>,
    out: BackwardOutputs<'_, T>,
    per_head: &(dyn Fn(&Sequence, usize, &Head) -> Result<HeadGrads, ReferenceError> + Sync),
) -> Result<(), ReferenceError> {
    check_input(spec, "q", Operand::Q, &inputs.q)?;
    check_input(spec, "k", Operand::K, &inputs.k)?;
    check_input(spec, "v", Operand::V, &inputs.v)?;
    check_input(spec, "o", Operand::O, &inputs.o)?;
    check_input(spec, "d_out", Operand::O, &inputs.d_out)?;
    let lse_shape = spec.expected_shape(Operand::RowStat);
    if inputs.lse.shape() != lse_shape.as_slice() {
        return Err(attnproof_oracle::OracleError::ShapeMismatch {
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
    let tasks: Vec<(Sequence, usize)> =
        spec.sequences().into_iter().flat_map(|s| (0..spec.n_heads_q).map(move |h| (s, h))).collect();
    let grads: Vec<HeadGrads> = tasks
        .par_iter()
        .map(|(seq, h)| {
            let kv = kv_head(*h, spec.n_heads_q, spec.n_heads_kv);
            let head = Head {
                q: head_f32(spec, &inputs.q, seq, *h, false),
                k: head_f32(spec, &inputs.k, seq, kv, true),
                v: head_f32(spec, &inputs.v, seq, kv, true),
                o: head_f32(spec, &inputs.o, seq, *h, false),
                d_out: head_f32(spec, &inputs.d_out, seq, *h, false),
                lse: spec.head_row_stat(inputs.lse.view(), seq, *h).to_owned(),
            };
            per_head(seq, *h, &head)
        })
        .collect::<Result<_, ReferenceError>>()?;
    // Sum dK/dV per KV head in f32, ascending query head, then round once.
    let mut dk_acc: std::collections::BTreeMap<(usize, usize), (Array2<f32>, Array2<f32>)> = Default::default();
    for ((seq, h), g) in tasks.iter().zip(&grads) {
        let kv = kv_head(*h, spec.n_heads_q, spec.n_heads_kv);
        let entry = dk_acc
            .entry((seq.index, kv))
            .or_insert_with(|| (Array2::zeros(g.dk.raw_dim()), Array2::zeros(g.dv.raw_dim())));
        entry.0 += &g.dk;
        entry.1 += &g.dv;
        write_rows(&mut dq, spec.head_slice(seq, *h, false), &g.dq);
        delta.slice_mut(spec.row_stat_slice(seq, *h)).assign(&g.delta);
    }
    for seq in spec.sequences() {
        for kv in 0..spec.n_heads_kv {
            if let Some((k_sum, v_sum)) = dk_acc.get(&(seq.index, kv)) {
                write_rows(&mut dk, spec.head_slice(&seq, kv, true), k_sum);
                write_rows(&mut dv, spec.head_slice(&seq, kv, true), v_sum);
            }
        }
    }
    Ok(())
}

/// Rounds `rows` to `T` into the slice `info` of `out`.
pub(crate) fn write_rows<T: Element>(
    out: &mut ArrayViewMutD<'_, T>,
    info: ndarray::SliceInfo<Vec<ndarray::SliceInfoElem>, ndarray::IxDyn, ndarray::IxDyn>,
    rows: &Array2<f32>,
) {
    let mut view = out.slice_mut(info).into_dimensionality::<Ix2>().expect("2-D head");
    view.zip_mut_with(rows, |o, x| *o = T::from_f32(*x));
}
