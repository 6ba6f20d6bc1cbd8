//! Small generic numerics shared by the sparse equations: dot products, log-sum-exp, softmax
//! weights, block means, norms and power iteration. One implementation each, over [`Real`].

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

/// When a [`power_iteration`] stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PowerStop {
    /// At the first step whose estimate does not exceed the previous one (stagnation), or after the step budget: the
    /// rule of [`spectral_norm`], which runs until rounding stops the growth.
    NoGrowth,
    /// After exactly the step budget, whatever the estimates do: a fixed number of steps is one deterministic function
    /// of the matrix, which another evaluation (a GPU's, in another precision) can repeat and whose rounding can be
    /// bounded step by step; the stagnation rule's step count depends on the rounding itself.
    AllSteps,
}

/// What one [`power_iteration`] computed.
#[derive(Clone, Debug, PartialEq)]
pub struct PowerRun<S> {
    /// The estimate of `‖A‖₂`: the last accepted step's `‖A x̂‖`.
    pub estimate: S,
    /// `norms[j]` is `‖x‖` at the start of step `j`: `norms[0] = ‖x₀‖ = √n` for the all-ones start, then the growth
    /// `‖AᵀA x̂‖` of each step before it. One entry per step begun, so a run of `steps` steps that never meets a zero
    /// vector has `steps` entries; the product `Π_{j≥1} norms[j]` is `‖(AᵀA)^{steps−1} x₀‖ / ‖x₀‖`, which error bounds
    /// on the run read.
    pub norms: Vec<S>,
}

/// Power iteration on `AᵀA` from the all-ones start, at most `steps` steps. Each step normalizes `x`, forms `ax = A x̂`,
/// takes `next = ‖ax‖` and sets `x = Aᵀ ax`; under [`PowerStop::NoGrowth`] it stops (without accepting) once `next`
/// does not exceed the estimate, under [`PowerStop::AllSteps`] it accepts every step's `next`. A zero `x` (no columns,
/// or `AᵀA x̂ = 0`) ends the run at once. One loop serves both rules so that the fixed-step estimate of E24 and the
/// stagnation estimate of E23 cannot drift apart.
pub fn power_iteration<S: Real>(a: ArrayView2<'_, S>, steps: usize, stop: PowerStop, ctx: S::Ctx) -> PowerRun<S> {
    let mut x = Array1::from_elem(a.ncols(), S::one(ctx));
    let mut estimate = S::zero(ctx);
    let mut norms = Vec::with_capacity(steps);
    for _ in 0..steps {
        let norm = norm2(x.view(), ctx);
        norms.push(norm.clone());
        if norm == S::zero(ctx) {
            break;
        }
        x.mapv_inplace(|e| e / norm.clone());
        let ax = S::matmul(a, x.view().insert_axis(ndarray::Axis(1)), ctx);
        let next = norm2(ax.column(0), ctx);
        let atax = S::matmul(a.t(), ax.view(), ctx);
        x = atax.column(0).to_owned();
        if stop == PowerStop::NoGrowth && next <= estimate {
            break;
        }
        estimate = next;
    }
    PowerRun { estimate, norms }
}

/// Spectral norm `‖A‖₂` (largest singular value) by power iteration on `AᵀA`, from the all-ones
/// start, until the estimate stops growing or after `max_iterations` ([`power_iteration`] under
/// [`PowerStop::NoGrowth`]). Power iteration approaches `‖A‖₂` from below (the Frobenius norm would
/// bound it from above). An empty matrix has norm 0: with no columns the start vector has norm 0,
/// with no rows the first product does.
pub fn spectral_norm<S: Real>(a: ArrayView2<'_, S>, max_iterations: usize, ctx: S::Ctx) -> S {
    power_iteration(a, max_iterations, PowerStop::NoGrowth, ctx).estimate
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

    #[test]
    fn all_steps_runs_every_step_and_records_the_growth_of_each() {
        // diag(3, 1) from x₀ = (1, 1): (AᵀA)^k x₀ = (9^k, 1), so the product of the growths after the start is
        // ‖(9^k, 1)‖ / √2 and the estimate after step k is ‖A x̂_k‖ = √(9^{2k+1} + 1) / √(81^k + 1). Each step rounds a
        // norm, a division and two products of length 2 (a few u of what it carries); 8 steps of them stay below
        // 64 · EPSILON relative.
        let a = array![[3.0, 0.0], [0.0, 1.0]];
        let steps = 8;
        let run = power_iteration(a.view(), steps, PowerStop::AllSteps, ());
        assert_eq!(run.norms.len(), steps);
        assert_eq!(run.norms[0], 2f64.sqrt());
        let close = |x: f64, y: f64| (x - y).abs() <= 64.0 * f64::EPSILON * y.abs();
        let product: f64 = run.norms[1..].iter().product();
        let k = (steps - 1) as i32;
        assert!(close(product, (81f64.powi(k) + 1.0).sqrt() / 2f64.sqrt()), "{product}");
        let last = ((9f64.powi(2 * k + 1) + 1.0) / (81f64.powi(k) + 1.0)).sqrt();
        assert!(close(run.estimate, last), "{} vs {last}", run.estimate);
        // The growth of the first step is ‖(9, 1)‖ / √2 = √41.
        assert!(close(run.norms[1], 41f64.sqrt()), "{}", run.norms[1]);
    }

    #[test]
    fn the_stagnation_rule_stops_early_where_all_steps_does_not() {
        // A rank-one matrix is exact after one step: the second step's estimate does not grow, so NoGrowth stops
        // there (two steps begun) and keeps the first estimate; AllSteps runs all five and accepts each.
        let rank_one = Array2::from_shape_fn((2, 4), |(i, _)| [3.0, 4.0][i]);
        let stagnating = power_iteration(rank_one.view(), 5, PowerStop::NoGrowth, ());
        assert!(stagnating.norms.len() < 5, "{stagnating:?}");
        assert_eq!(stagnating.estimate, spectral_norm(rank_one.view(), 5, ()));
        let fixed = power_iteration(rank_one.view(), 5, PowerStop::AllSteps, ());
        assert_eq!(fixed.norms.len(), 5);
        assert!((fixed.estimate - 10.0).abs() <= 8.0 * f64::EPSILON * 10.0, "{}", fixed.estimate);
        // A zero matrix: the start has norm √3, the first growth is 0, and the run ends there with estimate 0.
        let zero = power_iteration(Array2::<f64>::zeros((2, 3)).view(), 32, PowerStop::AllSteps, ());
        assert_eq!(zero.norms, [3f64.sqrt(), 0.0]);
        assert_eq!(zero.estimate, 0.0);
        assert!(power_iteration(rank_one.view(), 0, PowerStop::AllSteps, ()).norms.is_empty());
    }
}
