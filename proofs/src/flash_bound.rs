//! The rounding-error model of the FlashAttention reference forward (recipe in
//! `attnproof-reference`'s `flash` module: inputs in a storage type `T`, f32 scores and online
//! softmax, `P` rounded to `T` before `PV`, `O` rounded to `T`), and the bound the verifier uses.
//!
//! # The model
//!
//! `u = 2^-24` (f32), `u_T` the storage type's unit roundoff (`2^-8` bf16, `2^-11` f16),
//! `τ_T` its smallest subnormal (absolute rounding error of an underflowing value ≤ `τ_T`),
//! `g(n) = nu/(1 − nu)`, `n_t = ⌈Lk/kv_tile⌉` the KV tiles a row can visit. Inputs are exact in
//! `T`, hence in f64: the oracle and the candidate see the same numbers. For row `i`, visible key
//! `j`, with `p_ij`, `s_ij`, `m_i`, `o_i`, `LSE_i` exact:
//!
//! - scores: `σ_ij = (g(d) + 3u) |α| Σ_c |q_ic||k_jc|` (f32 dot product, `α̂ = fl32(1/√d)`, one
//!   product);
//! - weight of key `j` after every rescale: relative error
//!   `η_ij = σ_ij + 2u|s_ij − m_i| + 2u + 3u·n_t`: the rounding of `s − m'` (`|s − m'| ≤ |s − m|`),
//!   `exp` (≤ 2u), and the chain of later rescales `exp(m_t − m_{t+1})` (each 2u plus
//!   `u|m_t − m_{t+1}|`, and these differences sum to at most `m_i − s_ij`) and their products;
//! - `O_ic`: `Σ_j p_ij η_ij |v_jc − o_ic|` (softmax sensitivity `∂o/∂s_j = p_j(v_j − o)`, the shift
//!   cancels), `+ u_T Σ_j p_ij |v_jc|` (the numerator uses `round_T(p)`, the denominator the f32
//!   `p`), `+ g(Lk + n_t)(Σ_j p_ij |v_jc| + |o_ic|)` (the f32 sums `A` and `ℓ`, every term of which
//!   goes through at most `Lk + n_t` additions), `+ u|o_ic|` (division), `+ u_T|o_ic| + τ_T`
//!   (output rounding), `+ Lk (τ_T + 2^-149) max_j |v_jc|` (`p` underflowing in `T` or f32; `ℓ ≥ 1`);
//! - `LSE_i`: `Σ_j p_ij η_ij + g(Lk + n_t) + 2u|log ℓ_i| + u|LSE_i|` (`log ℓ_i = LSE_i − m_i`).
//!
//! All terms are first order. Hypothesis: every first-order relative perturbation (`η`, `u_T`,
//! `g(Lk + n_t)`) is at most `2^-5`; then the remainders `e^x − 1 − x ≤ 0.52 x²` and the
//! products of two perturbations are below `2^-4` of the first-order terms, and the bound is
//! multiplied by [`SECOND_ORDER_FACTOR`] `= 1 + 2^-3`, twice what they need. The
//! bound is evaluated from the f64 oracle's values (within `~2^-40` of exact) and compared with
//! the f64 oracle's output, whose own error (the same model with `u = 2^-53`) is below `2^-25` of
//! this bound; the factor covers both.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2};

use crate::residual::Violation;

/// f32 unit roundoff.
pub const F32_UNIT_ROUNDOFF: f64 = f32::EPSILON as f64 / 2.0;
/// Smallest positive f32 subnormal.
pub const F32_SUBNORMAL: f64 = 1.401_298_464_324_817e-45;
/// Factor covering second-order terms and the oracle's own error.
pub const SECOND_ORDER_FACTOR: f64 = 1.0 + 1.0 / 8.0;
/// Largest first-order relative perturbation the model accepts.
pub const FIRST_ORDER_LIMIT: f64 = 1.0 / 32.0;

/// `g(n) = nu/(1 − nu)` in f32.
pub fn gamma32(n: usize) -> f64 {
    let nu = n as f64 * F32_UNIT_ROUNDOFF;
    nu / (1.0 - nu)
}

/// The storage type and tiling of the recipe, as the model needs them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashRecipe {
    /// Unit roundoff of the storage type `T`.
    pub unit_roundoff: f64,
    /// Smallest positive subnormal of `T`.
    pub subnormal: f64,
    /// Keys per KV tile.
    pub kv_tile: usize,
}

/// One head's exact-enough quantities (from the f64 oracle) for evaluating the bound.
#[derive(Clone, Copy, Debug)]
pub struct HeadExact<'a> {
    /// Queries `[Lq, d]`.
    pub q: ArrayView2<'a, f64>,
    /// Keys `[Lk, d]`.
    pub k: ArrayView2<'a, f64>,
    /// Values `[Lk, dv]`.
    pub v: ArrayView2<'a, f64>,
    /// Scores `[Lq, Lk]`, `−∞` where masked.
    pub s: ArrayView2<'a, f64>,
    /// Probabilities `[Lq, Lk]`.
    pub p: ArrayView2<'a, f64>,
    /// Output `[Lq, dv]`.
    pub o: ArrayView2<'a, f64>,
    /// LSE `[Lq]`.
    pub lse: ArrayView1<'a, f64>,
    /// `|α|`.
    pub scale: f64,
}

/// Allowed absolute errors of one head's forward outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardBounds {
    /// Bound on `O` `[Lq, dv]`.
    pub o: Array2<f64>,
    /// Bound on `LSE` `[Lq]` (0 on fully masked rows, which must match exactly).
    pub lse: Array1<f64>,
}

/// The model's bounds for one head.
pub fn forward_bounds(x: HeadExact<'_>, recipe: FlashRecipe) -> Result<ForwardBounds, Violation> {
    const T: &str = "flash_forward_bound";
    let u = F32_UNIT_ROUNDOFF;
    let (ut, tiny) = (recipe.unit_roundoff, recipe.subnormal);
    let (len_q, d) = x.q.dim();
    let (len_k, dv) = x.v.dim();
    let n_t = len_k.div_ceil(recipe.kv_tile.max(1));
    let g = gamma32(len_k + n_t);
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
                (gamma32(d) + 3.0 * u) * x.scale * dot
                    + 2.0 * u * (x.s[[i, j]] - m).abs()
                    + 2.0 * u
                    + 3.0 * u * n_t as f64
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
                + len_k as f64 * (tiny + F32_SUBNORMAL) * vmax;
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
