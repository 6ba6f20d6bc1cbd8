//! The parallel, vectorized bound models (`attnproof_proofs::flash_bound`, `attnproof_proofs::sums`) against the
//! textbook loops over their formulas, kept here as the reference: the same numbers, bit for bit.

use attnproof_proofs::flash_bound::{
    Accumulation, F32_MIN_NORMAL, F32_UNIT_ROUNDOFF, FIRST_ORDER_LIMIT, FlashRecipe, ForwardBounds, HeadBackwardExact,
    HeadExact, SECOND_ORDER_FACTOR, ScoreReuse, backward_bounds, forward_bounds,
};
use attnproof_proofs::residual::Violation;
use ndarray::{Array1, Array2, ArrayView2};

/// The model's formulas as plain loops (the implementation before the bounds ran in parallel and vectorized):
/// the reference the fast bounds must equal bit for bit.
mod textbook {
    use super::*;
    use attnproof_proofs::flash_bound::BackwardBounds;

    /// The model's bounds for one head.
    pub fn forward_bounds(x: HeadExact<'_>, recipe: FlashRecipe) -> Result<ForwardBounds, Violation> {
        const T: &str = "flash_forward_bound";
        let u = F32_UNIT_ROUNDOFF;
        let (ut, tiny) = (recipe.unit_roundoff, recipe.subnormal);
        let (len_q, d) = x.q.dim();
        let (len_k, dv) = x.v.dim();
        let n_t = recipe.rescale_steps(len_k);
        let g = recipe.accumulation.gamma(len_k + n_t);
        let mut o = Array2::<f64>::zeros((len_q, dv));
        let mut lse = Array1::<f64>::zeros(len_q);
        let mut worst = g.max(ut);
        for i in 0..len_q {
            if x.lse[i] == f64::NEG_INFINITY {
                continue;
            }
            let m = x.s.row(i).iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let eta: Vec<f64> = (0..len_k)
                .map(|j| {
                    if x.p[[i, j]] == 0.0 && x.s[[i, j]] == f64::NEG_INFINITY {
                        return 0.0;
                    }
                    let dot: f64 = x.q.row(i).iter().zip(x.k.row(j)).map(|(a, b)| a.abs() * b.abs()).sum();
                    (recipe.accumulation.gamma(d) + 3.0 * u + 3.0 * recipe.score_storage_rounding) * x.scale * dot
                        + 2.0 * u * (x.s[[i, j]] - m).abs()
                        + recipe.exp_error
                        + recipe.shift_rounding * m.abs()
                        + (recipe.exp_error + u) * n_t as f64
                })
                .collect();
            worst = worst.max(eta.iter().copied().fold(0.0, f64::max));
            for c in 0..dv {
                let oc = x.o[[i, c]];
                let weighted_abs_v: f64 = (0..len_k).map(|j| x.p[[i, j]] * x.v[[j, c]].abs()).sum();
                let vmax = (0..len_k).map(|j| x.v[[j, c]].abs()).fold(0.0, f64::max);
                o[[i, c]] = (0..len_k).map(|j| x.p[[i, j]] * eta[j] * (x.v[[j, c]] - oc).abs()).sum::<f64>()
                    + ut * weighted_abs_v
                    + g * (weighted_abs_v + oc.abs())
                    + (u + ut) * oc.abs()
                    + tiny
                    + len_k as f64 * (tiny + recipe.exp_underflow) * vmax;
            }
            let log_l = (x.lse[i] - m).abs();
            lse[i] = (0..len_k).map(|j| x.p[[i, j]] * eta[j]).sum::<f64>() + g + 2.0 * u * log_l + u * x.lse[i].abs();
        }
        if worst > FIRST_ORDER_LIMIT {
            return Err(Violation::Hypothesis {
                theorem: T,
                reason: format!("first-order perturbation {worst:e} exceeds 2^-5"),
            });
        }
        o.mapv_inplace(|b| b * SECOND_ORDER_FACTOR);
        lse.mapv_inplace(|b| b * SECOND_ORDER_FACTOR);
        Ok(ForwardBounds { o, lse })
    }

    pub fn backward_bounds(
        x: HeadBackwardExact<'_>,
        forward: &ForwardBounds,
        recipe: FlashRecipe,
        q_tile: usize,
    ) -> Result<BackwardBounds, Violation> {
        const T: &str = "flash_backward_bound";
        let f = x.forward;
        let u = F32_UNIT_ROUNDOFF;
        let (ut, tiny) = (recipe.unit_roundoff, recipe.subnormal);
        let (len_q, d) = f.q.dim();
        let (len_k, dv) = f.v.dim();
        let n_k = len_k.div_ceil(recipe.kv_tile.max(1)) + recipe.extra_merges;
        let n_q = len_q.div_ceil(q_tile.max(1)) + recipe.extra_query_partials;
        let acc = recipe.accumulation;
        let mut worst: f64 = acc.gamma(len_q + n_q).max(acc.gamma(len_k + n_k)).max(ut);
        let mut pi = Array2::<f64>::zeros((len_q, len_k));
        for i in 0..len_q {
            if f.lse[i] == f64::NEG_INFINITY {
                continue;
            }
            let sigma: Vec<f64> = (0..len_k)
                .map(|j| {
                    if f.s[[i, j]] == f64::NEG_INFINITY {
                        return 0.0;
                    }
                    let dot: f64 = f.q.row(i).iter().zip(f.k.row(j)).map(|(a, b)| a.abs() * b.abs()).sum();
                    (acc.gamma(d) + 3.0 * u + 3.0 * recipe.score_storage_rounding) * f.scale * dot
                })
                .collect();
            // The forward LSE bound's own share of score error, Σ_k p_ik σ_ik (scaled as that bound is).
            let weighted: f64 = (0..len_k).map(|k| f.p[[i, k]] * sigma[k]).sum();
            for j in 0..len_k {
                if f.s[[i, j]] == f64::NEG_INFINITY {
                    continue;
                }
                let score_part = match recipe.score_reuse {
                    ScoreReuse::Recomputed => sigma[j] + forward.lse[i],
                    ScoreReuse::BitwiseAsForward => {
                        let relative = (1.0 - f.p[[i, j]]) * sigma[j] + (weighted - f.p[[i, j]] * sigma[j]);
                        relative + (forward.lse[i] - SECOND_ORDER_FACTOR * weighted).max(0.0)
                    }
                };
                pi[[i, j]] = score_part
                    + u * (f.s[[i, j]] - f.lse[i]).abs()
                    + recipe.exp_error
                    + recipe.shift_rounding * f.lse[i].abs();
                worst = worst.max(pi[[i, j]]);
            }
        }
        if worst > FIRST_ORDER_LIMIT {
            return Err(Violation::Hypothesis {
                theorem: T,
                reason: format!("first-order perturbation {worst:e} exceeds 2^-5"),
            });
        }
        let abs_dot = |a: ArrayView2<'_, f64>, i: usize, b: ArrayView2<'_, f64>, j: usize| -> f64 {
            a.row(i).iter().zip(b.row(j)).map(|(x, y)| x.abs() * y.abs()).sum()
        };
        let nu = Array1::from_shape_fn(len_q, |i| {
            acc.gamma(dv) * abs_dot(x.d_out, i, f.o, i)
                + (0..dv).map(|c| x.d_out[[i, c]].abs() * forward.o[[i, c]]).sum::<f64>()
        });
        let zeta = Array2::from_shape_fn((len_q, len_k), |(i, j)| {
            if f.p[[i, j]] == 0.0 && x.ds[[i, j]] == 0.0 {
                return 0.0;
            }
            let rho = acc.gamma(dv) * abs_dot(x.d_out, i, f.v, j);
            (pi[[i, j]] + 2.0 * u + ut) * x.ds[[i, j]].abs()
                + f.p[[i, j]] * (rho + nu[i])
                + recipe.exp_underflow * (x.dp[[i, j]] - x.delta[i]).abs()
                + tiny
        });
        let (gq, gk) = (acc.gamma(len_q + n_q), acc.gamma(len_k + n_k));
        let mut b = BackwardBounds {
            delta: nu.clone(),
            dq: Array2::zeros((len_q, d)),
            dk: Array2::zeros((len_k, d)),
            dv: Array2::zeros((len_k, dv)),
        };
        for i in 0..len_q {
            for c in 0..d {
                // The atomic adds of dQ's n_k partials may each flush a value below 2^-126.
                let sum: f64 = (0..len_k).map(|j| (zeta[[i, j]] + gk * x.ds[[i, j]].abs()) * f.k[[j, c]].abs()).sum();
                b.dq[[i, c]] =
                    f.scale * (sum + n_k as f64 * F32_MIN_NORMAL) + (3.0 * u + ut) * x.dq[[i, c]].abs() + tiny;
            }
        }
        // With atomic dK, dV sums, each of a key's n_q adds may flush a value below 2^-126.
        let kv_flush = if recipe.atomic_kv_sums { n_q as f64 * F32_MIN_NORMAL } else { 0.0 };
        for j in 0..len_k {
            for c in 0..d {
                let sum: f64 =
                    (0..len_q).map(|i| (zeta[[i, j]] + gq * x.ds[[i, j]].abs()) * f.q[[i, c]].abs()).sum::<f64>();
                b.dk[[j, c]] = f.scale * (sum + kv_flush) + (3.0 * u + ut) * x.dk[[j, c]].abs() + tiny;
            }
            for c in 0..dv {
                let gmax = (0..len_q).map(|i| x.d_out[[i, c]].abs()).fold(0.0, f64::max);
                b.dv[[j, c]] =
                    (0..len_q).map(|i| f.p[[i, j]] * (pi[[i, j]] + ut + gq) * x.d_out[[i, c]].abs()).sum::<f64>()
                        + len_q as f64 * (tiny + recipe.exp_underflow) * gmax
                        + kv_flush
                        + ut * x.dv[[j, c]].abs()
                        + tiny;
            }
        }
        for a in [&mut b.dq, &mut b.dk, &mut b.dv] {
            a.mapv_inplace(|v| v * SECOND_ORDER_FACTOR);
        }
        b.delta.mapv_inplace(|v| v * SECOND_ORDER_FACTOR);
        Ok(b)
    }
}

/// With the forward's bounds held fixed, `exp_underflow` reaches `dQ` and `dK` only through `dS`'s term
/// `τ_e |dP_ij − D_i|`: raising it from `τ₃₂` to 1 adds exactly `(9/8)|α| Σ_j |dP_ij − D_i| |k_jc|` to `dQ_ic` and
/// `(9/8)|α| Σ_i |dP_ij − D_i| |q_ic|` to `dK_jc` (one query, two keys, worked by hand).
/// The parallel, vectorized bounds are the textbook loops' numbers bit for bit: forward and backward, every
/// score reuse and accumulation, under no mask, causal with rows that see no key (Lq > Lk), and a narrow window;
/// a storage rounding in the score and extra merges and partials so that every term is non-zero.
#[test]
fn the_bounds_are_the_textbook_loops_bit_for_bit() {
    use attnproof_oracle::dense::{self, HeadInputs};
    use attnproof_oracle::inputs::uniform_tensor;
    use attnproof_oracle::{DenseConfig, Mask, Real};
    let two = |seed: u64, rows: usize, cols: usize| {
        uniform_tensor(seed, &[rows, cols]).into_dimensionality::<ndarray::Ix2>().expect("two axes")
    };
    let masks = [Mask::Causal, Mask::None, Mask::Window { left: 3, right: 1 }];
    for (shape, mask) in [(37, 29, 12, 9), (20, 70, 8, 16), (5, 5, 3, 2)].into_iter().zip(masks) {
        let (len_q, len_k, d, dv) = shape;
        let (q, k, v, g) = (two(1, len_q, d), two(2, len_k, d), two(3, len_k, dv), two(4, len_q, dv));
        let q = q.mapv(|x| 2.0 * x);
        let visible = mask.matrix(len_q, len_k);
        let inputs = HeadInputs { q: q.view(), k: k.view(), v: v.view(), visible: visible.view() };
        let scale = 0.3;
        let fwd = dense::head_forward(inputs, &scale, DenseConfig::default(), ());
        let grads = dense::head_backward(inputs, g.view(), &fwd, &scale, DenseConfig::default(), ());
        let s = dense::scores(q.view(), k.view(), &scale, visible.view(), ());
        let p = dense::probabilities_from_lse(s.view(), fwd.lse.view(), visible.view(), ());
        let dp = f64::matmul(g.view(), v.t(), ());
        let ds = dense::score_gradient(p.view(), dp.view(), grads.delta.view());
        let fx = HeadExact {
            q: q.view(),
            k: k.view(),
            v: v.view(),
            s: s.view(),
            p: p.view(),
            o: fwd.o.view(),
            lse: fwd.lse.view(),
            scale,
        };
        let bx = HeadBackwardExact {
            forward: fx,
            d_out: g.view(),
            dp: dp.view(),
            ds: ds.view(),
            delta: grads.delta.view(),
            dq: grads.dq.view(),
            dk: grads.dk.view(),
            dv: grads.dv.view(),
        };
        for (reuse, accumulation, atomic_kv_sums) in [
            (ScoreReuse::BitwiseAsForward, Accumulation::RoundToNearest, false),
            (ScoreReuse::Recomputed, Accumulation::TensorCore { k_step: 16 }, true),
        ] {
            let recipe = FlashRecipe {
                score_reuse: reuse,
                accumulation,
                atomic_kv_sums,
                extra_merges: 2,
                extra_query_partials: 1,
                shift_rounding: 1e-7,
                score_storage_rounding: 2f64.powi(-14),
                ..FlashRecipe::libm(2f64.powi(-8), 2f64.powi(-133), 16)
            };
            let bits = |a: &[f64]| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let fast = forward_bounds(fx, recipe).expect("within the hypothesis");
            let slow = textbook::forward_bounds(fx, recipe).expect("within the hypothesis");
            assert_eq!(bits(fast.o.as_slice().unwrap()), bits(slow.o.as_slice().unwrap()), "{mask:?} O");
            assert_eq!(bits(fast.lse.as_slice().unwrap()), bits(slow.lse.as_slice().unwrap()), "{mask:?} LSE");
            let fast_b = backward_bounds(bx, &fast, recipe, 8).expect("within the hypothesis");
            let slow_b = textbook::backward_bounds(bx, &slow, recipe, 8).expect("within the hypothesis");
            for (name, a, b) in [
                ("D", fast_b.delta.to_vec(), slow_b.delta.to_vec()),
                ("dQ", fast_b.dq.iter().copied().collect(), slow_b.dq.iter().copied().collect()),
                ("dK", fast_b.dk.iter().copied().collect(), slow_b.dk.iter().copied().collect()),
                ("dV", fast_b.dv.iter().copied().collect(), slow_b.dv.iter().copied().collect()),
            ] {
                assert_eq!(bits(&a), bits(&b), "{mask:?} {reuse:?} {name}");
            }
        }
        if matches!(mask, Mask::Causal) {
            assert!(fwd.lse.iter().any(|x| *x == f64::NEG_INFINITY), "rows that see no key are covered");
        }
    }
}
