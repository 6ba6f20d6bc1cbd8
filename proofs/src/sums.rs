//! Sums of absolute values that the bound models and the verifier's magnitudes take over whole heads, written so that
//! they vectorize and run in parallel while every sum adds its terms in the order the model's formula states
//! (ascending index): the same numbers, bit for bit, as the plain loops (`flash_bound`'s tests compare them).

use ndarray::{Array2, ArrayView1, ArrayView2};
use rayon::prelude::*;

/// `|a|ᵀ` as a standard-layout `[cols, rows]` array.
pub fn abs_transposed(a: ArrayView2<'_, f64>) -> Array2<f64> {
    a.t().mapv(f64::abs).as_standard_layout().into_owned()
}

/// `Σ_c |a_c| |b_jc|` for every row `j` of `b`, from `abs_bt = |b|ᵀ` (`[cols, rows]`): each sum adds its terms in
/// ascending `c`, as a sequential dot product does, while the loop runs across `j`.
pub fn abs_dots(a: ArrayView1<'_, f64>, abs_bt: &Array2<f64>) -> Vec<f64> {
    let mut out = vec![0.0; abs_bt.ncols()];
    let n = abs_bt.ncols();
    let abs_bt = abs_bt.as_slice().expect("standard layout");
    for (a, column) in a.iter().zip(abs_bt.chunks_exact(n.max(1))) {
        let a = a.abs();
        for (o, b) in out.iter_mut().zip(column) {
            *o += a * b;
        }
    }
    out
}

/// `out[j][c] = Σ_i weight(i, j) |rows_ic|` for `j < len_k`, every sum in ascending `i`; key blocks in parallel.
pub fn weighted_column_sums(
    len_k: usize,
    rows: ArrayView2<'_, f64>,
    weight: impl Fn(usize, usize) -> f64 + Sync,
) -> Array2<f64> {
    const KEYS_PER_TASK: usize = 64;
    let (len_q, width) = rows.dim();
    let abs_rows = rows.mapv(f64::abs).as_standard_layout().into_owned();
    let abs_rows = abs_rows.as_slice().expect("standard layout");
    let blocks: Vec<Array2<f64>> = (0..len_k.div_ceil(KEYS_PER_TASK))
        .into_par_iter()
        .map(|b| {
            let keys = b * KEYS_PER_TASK..((b + 1) * KEYS_PER_TASK).min(len_k);
            let mut acc = vec![0.0; keys.len() * width];
            for (i, row) in abs_rows.chunks_exact(width.max(1)).take(len_q).enumerate() {
                for (out, j) in acc.chunks_exact_mut(width.max(1)).zip(keys.clone()) {
                    let w = weight(i, j);
                    for (o, r) in out.iter_mut().zip(row) {
                        *o += w * r;
                    }
                }
            }
            Array2::from_shape_vec((keys.len(), width), acc).expect("one row per key")
        })
        .collect();
    let mut out = Array2::<f64>::zeros((len_k, width));
    for (b, block) in blocks.into_iter().enumerate() {
        let first = b * KEYS_PER_TASK;
        out.slice_axis_mut(ndarray::Axis(0), ndarray::Slice::from(first..first + block.nrows())).assign(&block);
    }
    out
}

/// `out[i][c] = Σ_j weight(i, j) |cols_jc|` for `i < len_q`, every sum in ascending `j`; rows in parallel.
pub fn weighted_row_sums(
    len_q: usize,
    cols: ArrayView2<'_, f64>,
    weight: impl Fn(usize, usize) -> f64 + Sync,
) -> Array2<f64> {
    let width = cols.ncols();
    let abs_cols = cols.mapv(f64::abs).as_standard_layout().into_owned();
    let abs_cols = abs_cols.as_slice().expect("standard layout");
    let rows: Vec<f64> = (0..len_q)
        .into_par_iter()
        .flat_map_iter(|i| {
            let mut sums = vec![0.0; width];
            for (j, col_row) in abs_cols.chunks_exact(width.max(1)).enumerate() {
                let w = weight(i, j);
                for (s, c) in sums.iter_mut().zip(col_row) {
                    *s += w * c;
                }
            }
            sums
        })
        .collect();
    Array2::from_shape_vec((len_q, width), rows).expect("len_q rows of width sums")
}
