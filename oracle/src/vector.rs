//! Small generic numerics shared by the sparse equations: dot products, log-sum-exp, softmax
//! weights, block means and norms. One implementation each, over [`Real`].

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis};

use crate::real::Real;

/// `Σ_c a_c b_c`, left to right.
pub fn dot<S: Real>(a: ArrayView1<'_, S>, b: ArrayView1<'_, S>, ctx: S::Ctx) -> S {
    a.iter().zip(b).fold(S::zero(ctx), |acc, (x, y)| acc + x.clone() * y.clone())
}

/// `log Σ_j e^{x_j}` with the max subtracted first (never overflows); `−∞` for an empty input
/// or one of only `−∞`.
pub fn log_sum_exp<S: Real>(xs: &[S], ctx: S::Ctx) -> S {
    let m = xs.iter().fold(S::neg_infinity(ctx), |m, x| m.max(x.clone()));
    if !m.is_finite() {
        return m;
    }
    let sum = xs.iter().fold(S::zero(ctx), |acc, x| acc + (x.clone() - m.clone()).exp());
    m + sum.ln()
}

/// `softmax(x)_j = e^{x_j − LSE(x)}`; `−∞` entries get weight `e^{−∞} = 0` (IEEE and MPFR alike); an all-`−∞`
/// input, whose LSE is `−∞`, gives all 0.
pub fn softmax<S: Real>(xs: &[S], ctx: S::Ctx) -> Vec<S> {
    let lse = log_sum_exp(xs, ctx);
    if !lse.is_finite() {
        return vec![S::zero(ctx); xs.len()];
    }
    xs.iter().map(|x| (x.clone() - lse.clone()).exp()).collect()
}

/// Mean of the rows of `x` (`[n, d]` → `[d]`); `None` for `n = 0`.
pub fn mean_row<S: Real>(x: ArrayView2<'_, S>, ctx: S::Ctx) -> Option<Array1<S>> {
    let n = x.nrows();
    if n == 0 {
        return None;
    }
    let count = S::from_f64(n as f64, ctx);
    Some(x.map_axis(Axis(0), |col| col.iter().fold(S::zero(ctx), |a, b| a + b.clone()) / count.clone()))
}

/// Means of consecutive blocks of `block` rows (`[n, d]` → `[⌈n/block⌉, d]`); the last block may
/// be partial and is averaged over its own rows.
pub fn block_means<S: Real>(x: ArrayView2<'_, S>, block: usize, ctx: S::Ctx) -> Array2<S> {
    assert!(block > 0, "block_means: block size must be positive");
    let n_blocks = x.nrows().div_ceil(block);
    let mut out = Array2::from_elem((n_blocks, x.ncols()), S::zero(ctx));
    for b in 0..n_blocks {
        let rows = x.slice_axis(Axis(0), ndarray::Slice::from(b * block..((b + 1) * block).min(x.nrows())));
        out.row_mut(b).assign(&mean_row(rows, ctx).expect("a block has at least one row"));
    }
    out
}

/// Euclidean norm `‖x‖₂`.
pub fn norm2<S: Real>(x: ArrayView1<'_, S>, ctx: S::Ctx) -> S {
    dot(x, x, ctx).sqrt()
}

/// Spectral norm `‖A‖₂` (largest singular value) by power iteration on `AᵀA`, from the all-ones
/// start, until the estimate stops growing or after `max_iterations`. Power iteration approaches
/// `‖A‖₂` from below (the Frobenius norm would bound it from above). An empty matrix has norm 0:
/// with no columns the start vector has norm 0, with no rows the first product does.
pub fn spectral_norm<S: Real>(a: ArrayView2<'_, S>, max_iterations: usize, ctx: S::Ctx) -> S {
    let mut x = Array1::from_elem(a.ncols(), S::one(ctx));
    let mut estimate = S::zero(ctx);
    for _ in 0..max_iterations {
        let norm = norm2(x.view(), ctx);
        if norm == S::zero(ctx) {
            break;
        }
        x.mapv_inplace(|e| e / norm.clone());
        let ax = S::matmul(a, x.view().insert_axis(ndarray::Axis(1)), ctx);
        let next = norm2(ax.column(0), ctx);
        let atax = S::matmul(a.t(), ax.view(), ctx);
        x = atax.column(0).to_owned();
        if next <= estimate {
            break;
        }
        estimate = next;
    }
    estimate
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array2, array};

    #[test]
    fn the_spectral_norm_is_the_largest_singular_value_and_zero_when_empty() {
        // Power iteration shrinks the error by (σ₂/σ₁)² = 1/9 per step and stops once the estimate no longer grows,
        // that is once the convergence error is below the rounding of one step (a norm and two products of length 2:
        // a few u). 8 · EPSILON = 16u of the norm bounds both.
        let diagonal = array![[3.0, 0.0], [0.0, -1.0], [0.0, 0.0]];
        let estimate = spectral_norm(diagonal.view(), 500, ());
        assert!((estimate - 3.0).abs() <= 8.0 * f64::EPSILON * 3.0, "{estimate}");
        // A rank-one matrix u vᵀ has the single singular value ‖u‖ ‖v‖ = 5 · 2, reached in one step.
        let rank_one = Array2::from_shape_fn((2, 4), |(i, _)| [3.0, 4.0][i]);
        let estimate = spectral_norm(rank_one.view(), 500, ());
        assert!((estimate - 10.0).abs() <= 8.0 * f64::EPSILON * 10.0, "{estimate}");
        for shape in [(0, 3), (3, 0), (0, 0)] {
            assert_eq!(spectral_norm(Array2::<f64>::zeros(shape).view(), 500, ()), 0.0, "{shape:?}");
        }
    }
}
