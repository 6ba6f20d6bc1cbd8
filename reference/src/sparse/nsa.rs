//! NSA's compression (E18, [`compress_head`]: the GPU kernel's recipe, bit for bit) and its selection
//! branch (E18–E20) forward and backward, as the NSA kernel shares work across a
//! GQA group: for each (query `t`, KV head), each selected block of `select_block` tokens is
//! loaded once and all `G` query heads of the group are computed against it (a `[G, block]` score
//! tile), causal inside the current block (tokens `> t` are masked; a block wholly in the future
//! adds nothing). The backward transposes each KV head's selection into CSR (block → selecting
//! queries, E20, `attnproof_oracle::nsa::transpose_selection_heads`): each KV block owns its
//! dK/dV and visits the (query, head) pairs that selected it; dQ of (query, head) visits the
//! query's selected blocks.
//!
//! Layout of the oracle's `attnproof_oracle::nsa::selected_attention` (one sequence): queries
//! `[T, Hq, d]`, keys `[T, Hkv, d]`, values `[T, Hkv, dv]`, selection `[T, Hkv, n]` (E14
//! convention against `M = ⌈T/select_block⌉`), outputs `[T, Hq, dv]`, LSE and `D` `[Hq, T]`.
//!
//! Precision recipe: that of [`crate::sparse`]. A row's rescales are one per selected block
//! (`≤ ⌈T/select_block⌉`), its terms at most `T`, so the dense model with KV tile `select_block`
//! applies. The owner of a block keeps one f32 dK/dV accumulator per query head of the group,
//! summing over the selecting queries in ascending order, and adds the heads in ascending order at
//! the end, exactly as the dense backward's per-head accumulation and GQA sum (which the model
//! covers); a single accumulator interleaving heads would sum `G·T` terms and need a different
//! model.

use attnproof_oracle::nsa::{Compression, NsaConfig, complete_windows, transpose_selection_heads};
use attnproof_oracle::spec::Mask;
use attnproof_oracle::topk::validate_index_row;
use attnproof_oracle::{OracleError, Scale};
use ndarray::{Array2, ArrayView2, ArrayView3, ArrayViewMut2, ArrayViewMut3, Axis};
use rayon::prelude::*;

use crate::element::Element;
use crate::error::ReferenceError;
use crate::mask::visible;
use crate::sparse::{RowState, check_finite, check_shape, dot32, scale32};

/// Selection-branch parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectionConfig {
    /// Tokens per selection block `l'` (paper: 64).
    pub select_block: usize,
    /// Softmax scale `α`.
    pub scale: Scale,
}

impl Default for SelectionConfig {
    fn default() -> Self {
        SelectionConfig { select_block: 64, scale: Scale::InverseSqrtHeadDim }
    }
}

/// Inputs of the selection forward, in the storage type.
#[derive(Clone, Debug)]
pub struct SelectionInputs<'a, T> {
    /// Queries `[T, Hq, d]`.
    pub q: ArrayView3<'a, T>,
    /// Keys `[T, Hkv, d]`.
    pub k: ArrayView3<'a, T>,
    /// Values `[T, Hkv, dv]`.
    pub v: ArrayView3<'a, T>,
    /// Selected blocks `[T, Hkv, n]`.
    pub selection: ArrayView3<'a, i32>,
}

/// Caller-owned outputs of the selection forward.
#[derive(Debug)]
pub struct SelectionOutputs<'a, T> {
    /// `O` `[T, Hq, dv]`.
    pub o: ArrayViewMut3<'a, T>,
    /// LSE `[Hq, T]` (f32).
    pub lse: ArrayViewMut2<'a, f32>,
}

/// Inputs of the selection backward.
#[derive(Clone, Debug)]
pub struct SelectionBackwardInputs<'a, T> {
    /// The forward's inputs.
    pub forward: SelectionInputs<'a, T>,
    /// The forward's `O` `[T, Hq, dv]`.
    pub o: ArrayView3<'a, T>,
    /// The forward's LSE `[Hq, T]`.
    pub lse: ArrayView2<'a, f32>,
    /// Upstream gradient `[T, Hq, dv]`.
    pub d_out: ArrayView3<'a, T>,
}

/// Caller-owned gradients of the selection backward.
#[derive(Debug)]
pub struct SelectionGradients<'a, T> {
    /// `dQ` `[T, Hq, d]`.
    pub dq: ArrayViewMut3<'a, T>,
    /// `dK` `[T, Hkv, d]` (summed over each group's query heads).
    pub dk: ArrayViewMut3<'a, T>,
    /// `dV` `[T, Hkv, dv]` (likewise).
    pub dv: ArrayViewMut3<'a, T>,
    /// `D = rowsum(dO ∘ O)` `[Hq, T]` (f32).
    pub delta: ArrayViewMut2<'a, f32>,
}

/// The valid prefix of every selection row, `[t][kv]`.
type SelectedRows = Vec<Vec<Vec<usize>>>;

/// Sizes of a validated problem.
#[derive(Clone, Copy)]
struct Dims {
    len: usize,
    n_heads_q: usize,
    n_heads_kv: usize,
    group: usize,
    d: usize,
    dv: usize,
    n_blocks: usize,
}

/// Validates shapes, finiteness, the config and every selection row; returns the sizes and the
/// valid prefix of each `[t][kv]` selection row.
fn validate<T: Element>(
    inputs: &SelectionInputs<'_, T>,
    config: SelectionConfig,
) -> Result<(Dims, SelectedRows), ReferenceError> {
    if config.select_block == 0 {
        return Err(ReferenceError::ZeroTile { argument: "select_block" });
    }
    let (len, n_heads_q, d) = inputs.q.dim();
    let n_heads_kv = inputs.k.dim().1;
    let dv = inputs.v.dim().2;
    for (argument, x) in [("head_dim", d), ("head_dim_v", dv), ("n_heads_q", n_heads_q)] {
        if x == 0 {
            return Err(OracleError::ZeroDimension { argument }.into());
        }
    }
    if n_heads_kv == 0 || !n_heads_q.is_multiple_of(n_heads_kv) {
        return Err(OracleError::HeadRatio { n_heads_q, n_heads_kv }.into());
    }
    check_shape("k", inputs.k.shape(), &[len, n_heads_kv, d])?;
    check_shape("v", inputs.v.shape(), &[len, n_heads_kv, dv])?;
    let width = inputs.selection.dim().2;
    check_shape("selection", inputs.selection.shape(), &[len, n_heads_kv, width])?;
    check_finite("q", &inputs.q)?;
    check_finite("k", &inputs.k)?;
    check_finite("v", &inputs.v)?;
    scale32(config.scale, d)?;
    let n_blocks = len.div_ceil(config.select_block);
    let mut rows = Vec::with_capacity(len);
    for t in 0..len {
        let per_kv = (0..n_heads_kv)
            .map(|kv| {
                let row = inputs.selection.index_axis(Axis(0), t).row(kv).to_vec();
                validate_index_row("selection", t * n_heads_kv + kv, &row, n_blocks)
            })
            .collect::<Result<Vec<_>, _>>()?;
        rows.push(per_kv);
    }
    let dims = Dims { len, n_heads_q, n_heads_kv, group: n_heads_q / n_heads_kv, d, dv, n_blocks };
    Ok((dims, rows))
}

/// Tokens of block `b`.
fn block_keys(b: usize, block: usize, len: usize) -> std::ops::Range<usize> {
    b * block..((b + 1) * block).min(len)
}

/// The inputs widened to f32: `q [Hq][T, d]`, `k`, `v` `[Hkv][T, ·]`.
fn widen_heads<T: Element>(x: &ArrayView3<'_, T>) -> Vec<Array2<f32>> {
    x.axis_iter(Axis(1)).map(|h| h.mapv(|e| e.to_f32())).collect()
}

/// NSA selection-branch forward into caller-owned outputs, parallel over (query, KV head).
pub fn nsa_selection_forward<T: Element>(
    inputs: &SelectionInputs<'_, T>,
    config: SelectionConfig,
    out: SelectionOutputs<'_, T>,
) -> Result<(), ReferenceError> {
    let (dims, selected) = validate(inputs, config)?;
    let SelectionOutputs { mut o, mut lse } = out;
    check_shape("o", o.shape(), &[dims.len, dims.n_heads_q, dims.dv])?;
    check_shape("lse", lse.shape(), &[dims.n_heads_q, dims.len])?;
    let scale = scale32(config.scale, dims.d)?;
    let (q, k, v) = (widen_heads(&inputs.q), widen_heads(&inputs.k), widen_heads(&inputs.v));
    let tasks: Vec<(usize, usize)> = (0..dims.len).flat_map(|t| (0..dims.n_heads_kv).map(move |kv| (t, kv))).collect();
    let results: Vec<Vec<(Vec<f32>, f32)>> = tasks
        .par_iter()
        .map(|&(t, kv)| {
            let heads = kv * dims.group..(kv + 1) * dims.group;
            let mut states = vec![RowState::new(dims.dv); dims.group];
            for &b in &selected[t][kv] {
                // One block tile, loaded once, against all G heads of the group: a [G, block] tile.
                let keys = block_keys(b, config.select_block, dims.len);
                for (state, h) in states.iter_mut().zip(heads.clone()) {
                    let s: Vec<f32> = keys
                        .clone()
                        .map(|j| {
                            if visible(&Mask::Causal, t, j, dims.len, dims.len) {
                                dot32(q[h].row(t), k[kv].row(j)) * scale
                            } else {
                                f32::NEG_INFINITY
                            }
                        })
                        .collect();
                    state.update::<T>(&s, |jj, c| v[kv][[keys.start + jj, c]]);
                }
            }
            states.iter().map(|s| s.finish::<T>()).collect()
        })
        .collect();
    for (&(t, kv), rows) in tasks.iter().zip(results) {
        for (g, (o_row, l)) in rows.into_iter().enumerate() {
            let h = kv * dims.group + g;
            o.index_axis_mut(Axis(0), t).row_mut(h).iter_mut().zip(o_row).for_each(|(a, b)| *a = T::from_f32(b));
            lse[[h, t]] = l;
        }
    }
    Ok(())
}

/// `P_tj` and the rounded `dS_tj` of (query `t`, head `h`) against key `j` (0 where masked or
/// `LSE = −∞`): the dense backward's per-element arithmetic.
struct Grad<'a> {
    q: &'a [Array2<f32>],
    k: &'a [Array2<f32>],
    v: &'a [Array2<f32>],
    d_out: &'a [Array2<f32>],
    lse: ArrayView2<'a, f32>,
    delta: &'a Array2<f32>,
    len: usize,
    scale: f32,
}

impl Grad<'_> {
    fn p_ds<T: Element>(&self, t: usize, h: usize, kv: usize, j: usize) -> (f32, f32) {
        let lse = self.lse[[h, t]];
        if lse == f32::NEG_INFINITY || !visible(&Mask::Causal, t, j, self.len, self.len) {
            return (0.0, 0.0);
        }
        let s = dot32(self.q[h].row(t), self.k[kv].row(j)) * self.scale;
        let p = (s - lse).exp();
        let dp = dot32(self.d_out[h].row(t), self.v[kv].row(j));
        (p, T::round(p * (dp - self.delta[[h, t]])))
    }
}

/// NSA selection-branch backward through the CSR transpose of the selection (E20) into
/// caller-owned gradients: KV blocks own dK/dV (parallel over (KV head, block)), (query, head)
/// pairs own dQ (parallel over queries).
pub fn nsa_selection_backward<T: Element>(
    inputs: &SelectionBackwardInputs<'_, T>,
    config: SelectionConfig,
    out: SelectionGradients<'_, T>,
) -> Result<(), ReferenceError> {
    let (dims, selected) = validate(&inputs.forward, config)?;
    let (len, hq) = (dims.len, dims.n_heads_q);
    check_shape("o", inputs.o.shape(), &[len, hq, dims.dv])?;
    check_shape("d_out", inputs.d_out.shape(), &[len, hq, dims.dv])?;
    check_shape("lse", inputs.lse.shape(), &[hq, len])?;
    check_finite("o", &inputs.o)?;
    check_finite("d_out", &inputs.d_out)?;
    let SelectionGradients { mut dq, mut dk, mut dv, mut delta } = out;
    check_shape("dq", dq.shape(), &[len, hq, dims.d])?;
    check_shape("dk", dk.shape(), &[len, dims.n_heads_kv, dims.d])?;
    check_shape("dv", dv.shape(), &[len, dims.n_heads_kv, dims.dv])?;
    check_shape("delta", delta.shape(), &[hq, len])?;
    let scale = scale32(config.scale, dims.d)?;
    let f = &inputs.forward;
    let (q, k, v) = (widen_heads(&f.q), widen_heads(&f.k), widen_heads(&f.v));
    let (o, d_out) = (widen_heads(&inputs.o), widen_heads(&inputs.d_out));
    let delta32 = Array2::from_shape_fn((hq, len), |(h, t)| dot32(d_out[h].row(t), o[h].row(t)));
    let grad = Grad { q: &q, k: &k, v: &v, d_out: &d_out, lse: inputs.lse, delta: &delta32, len, scale };
    let csr = transpose_selection_heads(f.selection, dims.n_blocks)?;
    // dK/dV: block b of KV head kv owns its rows; it visits its selecting queries (ascending) and,
    // for each, the G heads of the group, one accumulator per head.
    let owners: Vec<(usize, usize)> =
        (0..dims.n_heads_kv).flat_map(|kv| (0..dims.n_blocks).map(move |b| (kv, b))).collect();
    let block_grads: Vec<(Array2<f32>, Array2<f32>)> = owners
        .par_iter()
        .map(|&(kv, b)| {
            let keys = block_keys(b, config.select_block, len);
            let mut dk_sum = Array2::<f32>::zeros((keys.len(), dims.d));
            let mut dv_sum = Array2::<f32>::zeros((keys.len(), dims.dv));
            for h in kv * dims.group..(kv + 1) * dims.group {
                let mut dk_h = Array2::<f32>::zeros((keys.len(), dims.d));
                let mut dv_h = Array2::<f32>::zeros((keys.len(), dims.dv));
                for &t in csr[kv].queries_of(b) {
                    let t = t as usize;
                    for (c, j) in keys.clone().enumerate() {
                        let (p, ds) = grad.p_ds::<T>(t, h, kv, j);
                        let pt = T::round(p);
                        for e in 0..dims.dv {
                            dv_h[[c, e]] += pt * d_out[h][[t, e]];
                        }
                        for e in 0..dims.d {
                            dk_h[[c, e]] += ds * q[h][[t, e]];
                        }
                    }
                }
                dk_h.mapv_inplace(|x| x * scale);
                // Ascending head order, as the dense schedule's GQA sum.
                dk_sum += &dk_h;
                dv_sum += &dv_h;
            }
            (dk_sum, dv_sum)
        })
        .collect();
    // dQ: (query t, head h) visits the blocks its KV head selected, in selection order.
    let dq_rows: Vec<Array2<f32>> = (0..len)
        .into_par_iter()
        .map(|t| {
            let mut rows = Array2::<f32>::zeros((hq, dims.d));
            for h in 0..hq {
                let kv = h / dims.group;
                for &b in &selected[t][kv] {
                    for j in block_keys(b, config.select_block, len) {
                        let (_, ds) = grad.p_ds::<T>(t, h, kv, j);
                        for e in 0..dims.d {
                            rows[[h, e]] += ds * k[kv][[j, e]];
                        }
                    }
                }
            }
            rows.mapv_inplace(|x| x * scale);
            rows
        })
        .collect();
    for (t, rows) in dq_rows.iter().enumerate() {
        dq.index_axis_mut(Axis(0), t).zip_mut_with(rows, |a, &b| *a = T::from_f32(b));
    }
    for (&(kv, b), (dk_b, dv_b)) in owners.iter().zip(&block_grads) {
        for (c, j) in block_keys(b, config.select_block, len).enumerate() {
            dk.index_axis_mut(Axis(0), j).row_mut(kv).zip_mut_with(&dk_b.row(c), |a, &x| *a = T::from_f32(x));
            dv.index_axis_mut(Axis(0), j).row_mut(kv).zip_mut_with(&dv_b.row(c), |a, &x| *a = T::from_f32(x));
        }
    }
    delta.assign(&delta32);
    Ok(())
}

/// E18 compression of one head's rows `x` `[T, d]` into `[W, d]`, one row per complete window
/// (`W = complete_windows(T, l, s)`), with the map `map` (φ_K or φ_V of `config`), by the recipe of
/// the GPU kernel `nsa_compress.cu`: each column's `l` values widened exactly to f64 and taken in
/// ascending window position from an accumulator of +0 — added, then divided once by `l`, for the mean; accumulated by one
/// fused multiply-add per position, `acc = fma(w_i, x_i, acc)`, for weights; for the learned matrix `W`
/// `[l·d, d]`, one fused multiply-add per stacked index `r = i·d + j` ascending, `acc = fma(W[r, col],
/// x_{c·s+i, j}, acc)` — then rounded to f32 and to `T`, both to nearest. The kernel performs these operations in this order, so its output
/// equals this one bit for bit; both are within `attnproof_proofs::nsa_bound::compression_bound`
/// of the exact value.
pub fn compress_head<T: Element>(
    x: ArrayView2<'_, T>,
    map: &Compression,
    config: &NsaConfig,
) -> Result<Array2<T>, ReferenceError> {
    config.validate()?;
    let cols = x.ncols();
    if let Compression::Linear(w) = map
        && w.dim() != (config.compress_len * cols, cols)
    {
        return Err(ReferenceError::Problem(attnproof_oracle::OracleError::ShapeMismatch {
            argument: "compression map",
            expected: vec![config.compress_len * cols, cols],
            actual: w.shape().to_vec(),
        }));
    }
    let windows = complete_windows(x.nrows(), config.compress_len, config.compress_stride)?;
    let mut out = Array2::from_elem((windows, cols), T::from_f32(0.0));
    for c in 0..windows {
        let rows = c * config.compress_stride..c * config.compress_stride + config.compress_len;
        for col in 0..cols {
            let values = rows.clone().map(|i| f64::from(x[[i, col]].to_f32()));
            let y = match map {
                // From +0, as the kernel's accumulator starts: `Sum for f64` starts from −0, which would keep a
                // window of negative zeros at −0 where the kernel gives +0.
                Compression::Mean => values.fold(0.0, |acc, v| acc + v) / config.compress_len as f64,
                Compression::Weighted(w) => values.zip(w).fold(0.0, |acc, (v, &w)| w.mul_add(v, acc)),
                // The window's rows stacked, `r = i·cols + j` ascending, one fused multiply-add each.
                Compression::Linear(w) => rows
                    .clone()
                    .enumerate()
                    .flat_map(|(i, t)| (0..cols).map(move |j| (i * cols + j, t, j)))
                    .fold(0.0, |acc, (r, t, j)| w[[r, col]].mul_add(f64::from(x[[t, j]].to_f32()), acc)),
            };
            out[[c, col]] = T::from_f32(y as f32);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// The recipe on values whose mean and weighted sums are exact in bf16: windows of `l = 4` every `s = 2` over
    /// 7 rows give 2 windows.
    #[test]
    fn compress_head_takes_the_windows_the_oracle_takes() {
        let config = NsaConfig { compress_len: 4, compress_stride: 2, n_selected: 3, ..NsaConfig::default() };
        let x = Array2::from_shape_fn((7, 2), |(i, c)| bf16::from_f32((i + 10 * c) as f32));
        let mean = compress_head(x.view(), &Compression::Mean, &config).unwrap();
        assert_eq!(mean.dim(), (2, 2));
        let got: Vec<f32> = mean.iter().map(|v| v.to_f32()).collect();
        // Window 0: rows 0..4 (mean 1.5, 11.5); window 1: rows 2..6 (mean 3.5, 13.5).
        assert_eq!(got, [1.5, 11.5, 3.5, 13.5]);
        let weighted = compress_head(x.view(), &Compression::Weighted(vec![1.0, 0.0, 0.0, -2.0]), &config).unwrap();
        let got: Vec<f32> = weighted.iter().map(|v| v.to_f32()).collect();
        // x_0 − 2 x_3 and x_2 − 2 x_5.
        assert_eq!(got, [-6.0, -16.0, -8.0, -18.0]);
        let none = compress_head(x.slice_axis(Axis(0), (..3).into()), &Compression::Mean, &config).unwrap();
        assert_eq!(none.dim(), (0, 2));
    }

    /// Regression (the GPU suites `gpu_nsa_compress_{bf16,f16}`, first run on the H200): windows of negative zeros.
    /// The kernel sums from +0, so the mean and the weighted sum of −0 are +0; the reference had summed with
    /// `Sum for f64`, which starts from −0, and kept −0, so the kernel's bits differed from the recipe's.
    #[test]
    fn windows_of_negative_zeros_compress_to_positive_zero() {
        let config = NsaConfig { compress_len: 2, compress_stride: 1, n_selected: 3, ..NsaConfig::default() };
        let x = Array2::from_elem((3, 1), bf16::NEG_ZERO);
        for map in [Compression::Mean, Compression::Weighted(vec![1.0, 2.0])] {
            let out = compress_head(x.view(), &map, &config).unwrap();
            assert!(out.iter().all(|v| v.to_bits() == 0), "{map:?}: {out:?}");
        }
    }

    /// The learned matrix stacks the window's rows (`r = i·d + j`): with `W` picking row 1's column 0 for output
    /// column 0 and twice row 0's column 1 for output column 1, each window gives `(x_{cs+1,0}, 2 x_{cs,1})`; a
    /// matrix of the wrong shape is refused.
    #[test]
    fn compress_head_stacks_the_window_for_a_learned_matrix() {
        let config = NsaConfig { compress_len: 2, compress_stride: 2, n_selected: 3, ..NsaConfig::default() };
        let x = Array2::from_shape_fn((5, 2), |(i, c)| bf16::from_f32((i + 10 * c) as f32));
        let mut w = Array2::zeros((4, 2));
        w[[2, 0]] = 1.0; // r = 1·2 + 0: row 1, column 0.
        w[[1, 1]] = 2.0; // r = 0·2 + 1: row 0, column 1.
        let out = compress_head(x.view(), &Compression::Linear(w), &config).unwrap();
        let got: Vec<f32> = out.iter().map(|v| v.to_f32()).collect();
        // Window 0: rows 0, 1 → (x_{1,0}, 2 x_{0,1}) = (1, 20); window 1: rows 2, 3 → (3, 24).
        assert_eq!(got, [1.0, 20.0, 3.0, 24.0]);
        let wrong = Compression::Linear(Array2::zeros((4, 3)));
        assert!(matches!(compress_head(x.view(), &wrong, &config), Err(ReferenceError::Problem(_))));
    }

    /// A window of bf16's largest values: the f64 sum does not overflow, so the mean is the value itself.
    #[test]
    fn compress_head_does_not_overflow_near_the_largest_value() {
        let config = NsaConfig::default();
        let x = Array2::from_elem((32, 1), bf16::MAX);
        let mean = compress_head(x.view(), &Compression::Mean, &config).unwrap();
        assert_eq!(mean[[0, 0]], bf16::MAX);
    }
}
