//! FlashAttention forward (E2–E5) as a tiled CPU schedule: one task per (sequence, query head,
//! query tile), KV tiles visited in order with causal/window tile skipping, online softmax.
//!
//! # Precision recipe
//!
//! Inputs `Q, K, V` are stored as `T` (bf16 or f16) and widened to f32. Scores `s = α·(q·k)` are
//! accumulated in f32 (left to right over `d`, like one MMA chain), `α = fl32(1/√d)`. The running
//! max `m`, sum `ℓ` and accumulator `A` are f32. Each tile's `p = exp(s − m')` is computed in f32;
//! `ℓ` sums the f32 `p`, while `A` accumulates `round_T(p)·v` (the PV product takes `P` in the
//! input dtype, as the tensor-core GEMM does). Finalize: `O = round_T(A/ℓ)`, `LSE = m + ln ℓ`
//! in f32. A row with no visible key gives `O = 0`, `LSE = −∞` (E1c).

use attnproof_oracle::spec::{Operand, Sequence};
use attnproof_oracle::{AttentionSpec, OracleError};
use ndarray::{Array1, Array2, ArrayD, ArrayViewD, ArrayViewMutD, Dimension, Ix2};
use rayon::prelude::*;

use crate::element::Element;
use crate::error::ReferenceError;
use crate::mask::{kv_head, visible};
use crate::tile::TileConfig;

/// Caller-owned outputs of the forward pass.
#[derive(Debug)]
pub struct ForwardOutputs<'a, T> {
    /// `O`, shaped like Q with `dv`.
    pub o: ArrayViewMutD<'a, T>,
    /// Natural-log LSE, dense `[B, Hq, Lq]`, varlen `[Hq, Tq]`.
    pub lse: ArrayViewMutD<'a, f32>,
}

/// Inputs of a schedule, stored in the input dtype.
#[derive(Clone, Debug)]
pub struct Inputs<'a, T> {
    /// Queries.
    pub q: ArrayViewD<'a, T>,
    /// Keys.
    pub k: ArrayViewD<'a, T>,
    /// Values.
    pub v: ArrayViewD<'a, T>,
}

/// Checks a tensor's shape against the spec and that it is finite.
pub fn check_input<T: Element>(
    spec: &AttentionSpec,
    argument: &'static str,
    operand: Operand,
    t: &ArrayViewD<'_, T>,
) -> Result<(), ReferenceError> {
    let expected = spec.expected_shape(operand);
    if t.shape() != expected.as_slice() {
        return Err(OracleError::ShapeMismatch { argument, expected, actual: t.shape().to_vec() }.into());
    }
    if let Some((index, value)) = t.indexed_iter().find(|(_, x)| !x.to_f32().is_finite()) {
        return Err(
            OracleError::NonFinite { argument, index: index.slice().to_vec(), value: value.to_f32() as f64 }.into()
        );
    }
    Ok(())
}

/// Checks an output's shape.
pub fn check_output<T>(
    spec: &AttentionSpec,
    argument: &'static str,
    operand: Operand,
    t: &ArrayViewMutD<'_, T>,
) -> Result<(), ReferenceError> {
    let expected = spec.expected_shape(operand);
    if t.shape() != expected.as_slice() {
        return Err(OracleError::ShapeMismatch { argument, expected, actual: t.shape().to_vec() }.into());
    }
    Ok(())
}

/// `fl32(1/√d)` or the given scale, rounded to f32.
pub fn scale_f32(spec: &AttentionSpec) -> f32 {
    match spec.scale {
        attnproof_oracle::Scale::InverseSqrtHeadDim => 1.0 / (spec.head_dim as f32).sqrt(),
        attnproof_oracle::Scale::Value(x) => x as f32,
    }
}

/// Head rows of a tensor widened to f32, `[L, D]`.
pub fn head_f32<T: Element>(
    spec: &AttentionSpec,
    t: &ArrayViewD<'_, T>,
    seq: &Sequence,
    head: usize,
    keys: bool,
) -> Array2<f32> {
    spec.head_rows(t.view(), seq, head, keys).mapv(|x| x.to_f32())
}

/// The per-row result of one query tile.
struct TileResult {
    o: Array2<f32>,
    lse: Array1<f32>,
}

/// The range of KV tiles that can hold a key visible to some row of `rows`.
pub fn kv_tile_range(
    spec: &AttentionSpec,
    seq: &Sequence,
    rows: std::ops::Range<usize>,
    kv_tile: usize,
) -> std::ops::Range<usize> {
    let (mut lo, mut hi) = (usize::MAX, 0);
    for i in rows {
        let r = spec.mask.key_range(i, seq.len_q, seq.len_k);
        if !r.is_empty() {
            lo = lo.min(r.start);
            hi = hi.max(r.end);
        }
    }
    if lo >= hi { 0..0 } else { lo / kv_tile..hi.div_ceil(kv_tile) }
}

/// One query tile of one (sequence, head): the online softmax over its KV tiles.
fn forward_tile<T: Element>(
    spec: &AttentionSpec,
    seq: &Sequence,
    q: &Array2<f32>,
    k: &Array2<f32>,
    v: &Array2<f32>,
    rows: std::ops::Range<usize>,
    tiles: TileConfig,
    scale: f32,
) -> TileResult {
    let (n_rows, dv) = (rows.len(), v.ncols());
    let mut m = vec![f32::NEG_INFINITY; n_rows];
    let mut l = vec![0f32; n_rows];
    let mut acc = Array2::<f32>::zeros((n_rows, dv));
    for kv in kv_tile_range(spec, seq, rows.clone(), tiles.kv_tile) {
        let keys = kv * tiles.kv_tile..((kv + 1) * tiles.kv_tile).min(seq.len_k);
        for (r, i) in rows.clone().enumerate() {
            let s: Vec<f32> = keys
                .clone()
                .map(|j| {
                    if visible(&spec.mask, i, j, seq.len_q, seq.len_k) {
                        let dot = q.row(i).iter().zip(k.row(j)).fold(0f32, |a, (x, y)| a + x * y);
                        dot * scale
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let m_new = s.iter().fold(m[r], |a, &b| a.max(b));
            if m_new == f32::NEG_INFINITY {
                continue; // nothing visible yet: the state stays empty
            }
            let rescale = if m[r] == f32::NEG_INFINITY { 0.0 } else { (m[r] - m_new).exp() };
            let p: Vec<f32> = s.iter().map(|&x| if x == f32::NEG_INFINITY { 0.0 } else { (x - m_new).exp() }).collect();
            l[r] = rescale * l[r] + p.iter().sum::<f32>();
            for c in 0..dv {
                let pv = keys.clone().zip(&p).fold(0f32, |a, (j, &pj)| a + T::round(pj) * v[[j, c]]);
                acc[[r, c]] = rescale * acc[[r, c]] + pv;
            }
            m[r] = m_new;
        }
    }
    let mut o = Array2::<f32>::zeros((n_rows, dv));
    let mut lse = Array1::from_elem(n_rows, f32::NEG_INFINITY);
    for r in 0..n_rows {
        if l[r] > 0.0 {
            for c in 0..dv {
                o[[r, c]] = T::round(acc[[r, c]] / l[r]);
            }
            lse[r] = m[r] + l[r].ln();
        }
    }
    TileResult { o, lse }
}

/// FlashAttention forward of a whole problem into caller-owned outputs, parallel over
/// (sequence, head, query tile).
pub fn flash_forward<T: Element>(
    spec: &AttentionSpec,
    inputs: &Inputs<'_, T>,
    tiles: TileConfig,
    out: ForwardOutputs<'_, T>,
) -> Result<(), ReferenceError> {
    spec.validate()?;
    tiles.validate()?;
    check_input(spec, "q", Operand::Q, &inputs.q)?;
    check_input(spec, "k", Operand::K, &inputs.k)?;
    check_input(spec, "v", Operand::V, &inputs.v)?;
    let ForwardOutputs { mut o, mut lse } = out;
    check_output(spec, "o", Operand::O, &o)?;
    check_output(spec, "lse", Operand::RowStat, &lse)?;
    let scale = scale_f32(spec);
    let tasks: Vec<(Sequence, usize, usize)> = spec
        .sequences()
        .into_iter()
        .flat_map(|seq| {
            (0..spec.n_heads_q).flat_map(move |h| (0..seq.len_q.div_ceil(tiles.q_tile)).map(move |a| (seq, h, a)))
        })
        .collect();
    let results: Vec<TileResult> = tasks
        .par_iter()
        .map(|(seq, h, a)| {
            let kv = kv_head(*h, spec.n_heads_q, spec.n_heads_kv);
            let q = head_f32(spec, &inputs.q, seq, *h, false);
            let k = head_f32(spec, &inputs.k, seq, kv, true);
            let v = head_f32(spec, &inputs.v, seq, kv, true);
            let rows = a * tiles.q_tile..((a + 1) * tiles.q_tile).min(seq.len_q);
            forward_tile::<T>(spec, seq, &q, &k, &v, rows, tiles, scale)
        })
        .collect();
    for ((seq, h, a), r) in tasks.iter().zip(results) {
        let start = a * tiles.q_tile;
        let mut o_head = o.slice_mut(spec.head_slice(seq, *h, false)).into_dimensionality::<Ix2>().expect("2-D head");
        let mut lse_head = lse.slice_mut(spec.row_stat_slice(seq, *h));
        for (row, (o_row, l)) in r.o.rows().into_iter().zip(r.lse.iter()).enumerate() {
            for (c, x) in o_row.iter().enumerate() {
                o_head[[start + row, c]] = T::from_f32(*x);
            }
            lse_head[start + row] = *l;
        }
    }
    Ok(())
}

/// Allocates outputs and runs [`flash_forward`]: `(O, LSE)`.
pub fn flash_forward_owned<T: Element>(
    spec: &AttentionSpec,
    inputs: &Inputs<'_, T>,
    tiles: TileConfig,
) -> Result<(ArrayD<T>, ArrayD<f32>), ReferenceError> {
    spec.validate()?;
    let mut o = ArrayD::from_elem(spec.expected_shape(Operand::O), T::from_f32(0.0));
    let mut lse = ArrayD::from_elem(spec.expected_shape(Operand::RowStat), 0f32);
    flash_forward(spec, inputs, tiles, ForwardOutputs { o: o.view_mut(), lse: lse.view_mut() })?;
    Ok((o, lse))
}
