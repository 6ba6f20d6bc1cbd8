//! The rounding-error model of the FlashAttention reference forward (recipe in
//! `attnproof-reference`'s `flash` module: inputs in a storage type `T`, f32 scores and online
//! softmax, `P` rounded to `T` before `PV`, `O` rounded to `T`), and the bound the verifier uses.
//!
//! # The model
//!
//! `u = 2^-24` (f32), `u_T` the storage type's unit roundoff (`2^-8` bf16, `2^-11` f16),
//! `τ_T` its smallest subnormal (absolute rounding error of an underflowing value ≤ `τ_T`),
//! `g(n) = nu/(1 − nu)` (or the tensor-core variant of [`Accumulation`]), `n_t = ⌈Lk/kv_tile⌉ + extra_merges` the rescale steps a row can take
//! (one per KV tile, plus one per state merge of a split schedule such as ring attention; a schedule that visits
//! fewer tiles, such as a block-sparse forward, states how many: [`FlashRecipe::rescale_steps`]). Inputs are exact in
//! `T`, hence in f64: the oracle and the candidate see the same numbers. For row `i`, visible key
//! `j`, with `p_ij`, `s_ij`, `m_i`, `o_i`, `LSE_i` exact:
//!
//! - scores: `σ_ij = (g(d) + 3u + 3ε) |α| Σ_c |q_ic||k_jc|` (f32 dot product, `α̂ = fl32(1/√d)`,
//!   one product; `ε` = [`FlashRecipe::score_storage_rounding`], 0 unless the candidate rounds
//!   the scaled inputs and the score to storage);
//! - weight of key `j` after every rescale: relative error
//!   `η_ij = σ_ij + 2u|s_ij − m_i| + e + c|m_i| + (e + u)·n_t`: the rounding of `s − m'`
//!   (`|s − m'| ≤ |s − m|`), `exp` (relative error `e`, `2u` for libm), the argument's shift
//!   rounding `c|m|` (0 for `fl(s − m)`; see [`FlashRecipe::shift_rounding`]), and the chain of
//!   later rescales `exp(m_t − m_{t+1})` (each `e` plus `u|m_t − m_{t+1}|`, and these differences
//!   sum to at most `m_i − s_ij`) and their products;
//! - `O_ic`: `Σ_j p_ij η_ij |v_jc − o_ic|` (softmax sensitivity `∂o/∂s_j = p_j(v_j − o)`, the shift
//!   cancels), `+ u_T Σ_j p_ij |v_jc|` (the numerator uses `round_T(p)`, the denominator the f32
//!   `p`), `+ g(Lk + n_t)(Σ_j p_ij |v_jc| + |o_ic|)` (the f32 sums `A` and `ℓ`, every term of which
//!   goes through at most `Lk + n_t` additions), `+ u|o_ic|` (division), `+ u_T|o_ic| + τ_T`
//!   (output rounding), `+ Lk (τ_T + τ_e) max_j |v_jc|` (`p` underflowing in `T` or in the f32
//!   `exp`, by at most `τ_e =` [`FlashRecipe::exp_underflow`]: `2^-149` with gradual underflow,
//!   `2^-126` for an `exp` that flushes subnormal results; `ℓ ≥ 1`);
//! - `LSE_i`: `Σ_j p_ij η_ij + g(Lk + n_t) + 2u|log ℓ_i| + u|LSE_i|` (`log ℓ_i = LSE_i − m_i`).
//!
//! Extension E-score-storage (for PyTorch's math SDPA with reduced-precision reductions, which
//! computes `ŝ = round_T(Σ_c round_T(q_c·√α) round_T(k_c·√α))`): each product carries a relative
//! perturbation of at most `2ε` from the two input roundings and the final rounding adds
//! `ε|ŝ_ij|`, with `|ŝ_ij| ≤ (1 + 2^-5)|α|Σ_c|q_ic||k_jc|` under the hypothesis below; the
//! `3ε` term covers both to first order. Its test (`tests/tests/it/check_recipes.rs` in the
//! harness) simulates that recipe and fails without the term.
//!
//! All terms are first order. Hypothesis: every first-order relative perturbation (`η`, `u_T`,
//! `g(Lk + n_t)`) is at most `2^-5`; then the remainders `e^x − 1 − x ≤ 0.52 x²` and the
//! products of two perturbations are below `2^-4` of the first-order terms, and the bound is
//! multiplied by [`SECOND_ORDER_FACTOR`] `= 1 + 2^-3`, twice what they need. The
//! bound is evaluated from the f64 oracle's values (within `~2^-40` of exact) and compared with
//! the f64 oracle's output, whose own error (the same model with `u = 2^-53`) is below `2^-25` of
//! this bound; the factor covers both.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2};
use rayon::prelude::*;

use crate::sums::{abs_dots, abs_transposed, weighted_column_sums, weighted_row_sums};

use crate::residual::Violation;

/// f32 unit roundoff.
pub const F32_UNIT_ROUNDOFF: f64 = f32::EPSILON as f64 / 2.0;
/// Smallest positive f32 subnormal.
pub const F32_SUBNORMAL: f64 = 1.401_298_464_324_817e-45;
/// Smallest positive normal f32, `2^-126`: what an `exp` that flushes subnormal results to zero
/// can lose.
pub const F32_MIN_NORMAL: f64 = f32::MIN_POSITIVE as f64;
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
    /// Additional rescale steps beyond one per KV tile: the E4 merges of a schedule that splits a
    /// row's keys across workers (ring attention: one per device); 0 for a single-pass forward.
    /// The backward counts them as extra partial sums over keys (`n_k`).
    pub extra_merges: usize,
    /// The most KV tiles a row of the forward visits when the schedule skips whole tiles (a
    /// block-sparse forward visits only the tiles of its listed blocks), or `None` when it may
    /// visit every tile of its keys. The forward's rescale count is then
    /// `n_t = min(visited_tiles, ⌈Lk/kv_tile⌉) + extra_merges` (forward model only).
    pub visited_tiles: Option<usize>,
    /// Additional partial sums over queries beyond one per query tile (the backward's `n_q`): a
    /// schedule that splits a key's queries across workers and adds their f32 dK/dV sums (the ring
    /// backward on GPUs, one per query chunk and merge); 0 otherwise.
    pub extra_query_partials: usize,
    /// Relative error of the `exp` the candidate uses: `2u` for a libm `expf` (below 1 ulp); a
    /// kernel using `ex2.approx` states its own (and its proof).
    pub exp_error: f64,
    /// Extra absolute error of the exponent argument per unit of `|m|` (the row max or LSE): 0
    /// when the argument is `fl(s − m)`; `u` for an argument formed as `s·c − fl(m·c)` with
    /// `c = log2 e` (the rounding of `m·c` shifts every argument by up to `u|m|c`, i.e. `u|m|`
    /// in natural-log units).
    pub shift_rounding: f64,
    /// Largest absolute error of an f32 `exp` result from underflow, `τ_e`: [`F32_SUBNORMAL`]
    /// when subnormal results are kept (one rounding of gradual underflow, at most `2^-150`,
    /// rounded up); [`F32_MIN_NORMAL`] for an `exp` that flushes subnormal results to zero
    /// (`ex2.approx.ftz.f32`, CUDA's `--use_fast_math`).
    pub exp_underflow: f64,
    /// How the candidate's dot products and f32 accumulators add.
    pub accumulation: Accumulation,
    /// Whether the backward recomputes every score bit for bit as its forward did (backward
    /// model only).
    pub score_reuse: ScoreReuse,
    /// Unit roundoff `ε` of a storage rounding inside the score (0 for the fused recipes, whose
    /// scores stay f32): a candidate that rounds `q·√α` and `k·√α` to storage and then the score
    /// itself (PyTorch's math SDPA with reduced-precision reductions) perturbs each product by
    /// `2ε` and the score by `ε|ŝ_ij| ≤ ε(1 + 2^-5)|α| Σ_c |q_ic||k_jc|`; the model adds
    /// `3ε|α| Σ_c |q_ic||k_jc|` to `σ_ij` (extension E-score-storage, module docs).
    pub score_storage_rounding: f64,
    /// Whether dK's and dV's partial sums over query tiles are added by f32 atomics (`red.global.add.f32`, which
    /// flushes subnormal inputs and results to zero): each of a key's at most `n_q` adds may then lose a value below
    /// `2^-126`, and the backward model adds `n_q 2^-126` to dV and `|α| n_q 2^-126` to dK (DSA's token-sparse
    /// backward, whose tokens add their gathered keys' partials); `false` when one worker owns each key's sums.
    pub atomic_kv_sums: bool,
}

/// How a backward pass's recomputed scores relate to the forward's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreReuse {
    /// No relation assumed: the score error of `P = exp(s − LSE)` is bounded by `σ_ij` for `s`
    /// plus the forward's whole LSE bound.
    Recomputed,
    /// The backward forms each score with the same operations in the same order as the forward
    /// that produced `LSE`, so `ŝ` is identical on both sides and `P̂ = exp(ŝ_ij − LSE(ŝ))` is
    /// the softmax of the perturbed scores: its score-induced relative error is
    /// `|δ_ij − Σ_k p_ik δ_ik| ≤ (1 − p_ij) σ_ij + Σ_{k≠j} p_ik σ_ik`, which vanishes for a one-hot
    /// row instead of doubling.
    BitwiseAsForward,
}

/// How sums are rounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accumulation {
    /// Every addition rounds to nearest in f32: `γ_n` with `u = 2^-24`.
    RoundToNearest,
    /// Tensor-core MMA: each instruction adds `k_step` products into the f32 accumulator after
    /// aligning them to the largest exponent and truncating, which can double the per-addition
    /// error; a sum of `n` terms is bounded as `γ'_{n + ⌈n/k_step⌉}` with `u' = 2u` (one extra
    /// addition per instruction for the accumulator itself).
    TensorCore {
        /// Products per MMA instruction along the reduction (16 for `m16n8k16`).
        k_step: usize,
    },
}

impl Accumulation {
    /// The error factor of a sum of `n` terms under this accumulation.
    pub fn gamma(self, n: usize) -> f64 {
        match self {
            Accumulation::RoundToNearest => gamma32(n),
            Accumulation::TensorCore { k_step } => {
                let terms = n + n.div_ceil(k_step.max(1));
                let nu = terms as f64 * 2.0 * F32_UNIT_ROUNDOFF;
                nu / (1.0 - nu)
            }
        }
    }
}

impl FlashRecipe {
    /// The forward's rescale steps for a row over `len_k` keys: one per KV tile it may visit
    /// (all `⌈len_k/kv_tile⌉`, or [`FlashRecipe::visited_tiles`] when fewer), plus the extra merges.
    pub fn rescale_steps(&self, len_k: usize) -> usize {
        let tiles = len_k.div_ceil(self.kv_tile.max(1));
        self.visited_tiles.map_or(tiles, |visited| visited.min(tiles)) + self.extra_merges
    }

    /// The recipe of a schedule using libm `expf` on `fl(s − m)`: storage unit roundoff
    /// `unit_roundoff`, subnormal `subnormal`, KV tiles of `kv_tile` keys, no extra merges.
    pub fn libm(unit_roundoff: f64, subnormal: f64, kv_tile: usize) -> Self {
        FlashRecipe {
            unit_roundoff,
            subnormal,
            kv_tile,
            extra_merges: 0,
            visited_tiles: None,
            extra_query_partials: 0,
            exp_error: 2.0 * F32_UNIT_ROUNDOFF,
            shift_rounding: 0.0,
            exp_underflow: F32_SUBNORMAL,
            accumulation: Accumulation::RoundToNearest,
            score_reuse: ScoreReuse::BitwiseAsForward,
            score_storage_rounding: 0.0,
            atomic_kv_sums: false,
        }
    }
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
///
/// Rows run in parallel, and every sum adds its terms in the model's order (ascending key, or ascending column of a
/// dot product), so the bounds are the same numbers, bit for bit, as the textbook loops over the formulas give
/// (`tests::the_bounds_are_the_textbook_loops_bit_for_bit`); the dot products `Σ_c |q_ic||k_jc|` run across keys
/// from `|K|ᵀ` so that they vectorize.
pub fn forward_bounds(x: HeadExact<'_>, recipe: FlashRecipe) -> Result<ForwardBounds, Violation> {
    const T: &str = "flash_forward_bound";
    let u = F32_UNIT_ROUNDOFF;
    let (ut, tiny) = (recipe.unit_roundoff, recipe.subnormal);
    let (len_q, d) = x.q.dim();
    let (len_k, dv) = x.v.dim();
    let n_t = recipe.rescale_steps(len_k);
    let g = recipe.accumulation.gamma(len_k + n_t);
    let abs_kt = abs_transposed(x.k);
    let v = x.v.as_standard_layout();
    // max_j |v_jc| does not depend on the row.
    let vmax: Vec<f64> = (0..dv).map(|c| (0..len_k).map(|j| v[[j, c]].abs()).fold(0.0, f64::max)).collect();
    let score_factor = recipe.accumulation.gamma(d) + 3.0 * u + 3.0 * recipe.score_storage_rounding;
    let rows: Vec<(Vec<f64>, f64, f64)> = (0..len_q)
        .into_par_iter()
        .map(|i| {
            if x.lse[i] == f64::NEG_INFINITY {
                return (vec![0.0; dv], 0.0, 0.0);
            }
            let m = x.s.row(i).iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut eta = abs_dots(x.q.row(i), &abs_kt);
            for (j, e) in eta.iter_mut().enumerate() {
                *e = if x.p[[i, j]] == 0.0 && x.s[[i, j]] == f64::NEG_INFINITY {
                    0.0
                } else {
                    score_factor * x.scale * *e
                        + 2.0 * u * (x.s[[i, j]] - m).abs()
                        + recipe.exp_error
                        + recipe.shift_rounding * m.abs()
                        + (recipe.exp_error + u) * n_t as f64
                };
            }
            let worst = eta.iter().copied().fold(0.0, f64::max);
            let o_row = x.o.row(i).to_vec();
            let (mut spread, mut weighted_abs_v) = (vec![0.0; dv], vec![0.0; dv]);
            let v_rows = v.as_slice().expect("standard layout").chunks_exact(dv.max(1));
            for (j, v_row) in v_rows.enumerate().take(len_k) {
                let (p, w) = (x.p[[i, j]], x.p[[i, j]] * eta[j]);
                for (((s, a), &vc), &oc) in spread.iter_mut().zip(weighted_abs_v.iter_mut()).zip(v_row).zip(&o_row) {
                    *s += w * (vc - oc).abs();
                    *a += p * vc.abs();
                }
            }
            let o: Vec<f64> = (0..dv)
                .map(|c| {
                    let oc = o_row[c];
                    spread[c]
                        + ut * weighted_abs_v[c]
                        + g * (weighted_abs_v[c] + oc.abs())
                        + (u + ut) * oc.abs()
                        + tiny
                        + len_k as f64 * (tiny + recipe.exp_underflow) * vmax[c]
                })
                .collect();
            let log_l = (x.lse[i] - m).abs();
            let weighted_eta: f64 = x.p.row(i).iter().zip(&eta).map(|(p, e)| p * e).sum();
            (o, weighted_eta + g + 2.0 * u * log_l + u * x.lse[i].abs(), worst)
        })
        .collect();
    let worst = rows.iter().map(|r| r.2).fold(g.max(ut), f64::max);
    if worst > FIRST_ORDER_LIMIT {
        return Err(Violation::Hypothesis {
            theorem: T,
            reason: format!("first-order perturbation {worst:e} exceeds 2^-5"),
        });
    }
    let mut o = Array2::<f64>::zeros((len_q, dv));
    let mut lse = Array1::<f64>::zeros(len_q);
    for (i, (o_row, lse_i, _)) in rows.into_iter().enumerate() {
        o.row_mut(i).assign(&Array1::from(o_row));
        lse[i] = lse_i;
    }
    o.mapv_inplace(|b| b * SECOND_ORDER_FACTOR);
    lse.mapv_inplace(|b| b * SECOND_ORDER_FACTOR);
    Ok(ForwardBounds { o, lse })
}

/// One head's exact-enough backward quantities (from the f64 oracle).
#[derive(Clone, Copy, Debug)]
pub struct HeadBackwardExact<'a> {
    /// The forward quantities.
    pub forward: HeadExact<'a>,
    /// Upstream gradient `[Lq, dv]`.
    pub d_out: ArrayView2<'a, f64>,
    /// `dP = dO Vᵀ` `[Lq, Lk]`.
    pub dp: ArrayView2<'a, f64>,
    /// `dS = P ∘ (dP − D)` `[Lq, Lk]`.
    pub ds: ArrayView2<'a, f64>,
    /// `D` `[Lq]`.
    pub delta: ArrayView1<'a, f64>,
    /// `dQ` `[Lq, d]` of this head.
    pub dq: ArrayView2<'a, f64>,
    /// `dK` `[Lk, d]` of this head (before the GQA sum).
    pub dk: ArrayView2<'a, f64>,
    /// `dV` `[Lk, dv]` of this head (before the GQA sum).
    pub dv: ArrayView2<'a, f64>,
}

/// Allowed absolute errors of one head's backward outputs (dK, dV before the GQA sum, which
/// [`gqa_sum_term`] accounts for).
#[derive(Clone, Debug, PartialEq)]
pub struct BackwardBounds {
    /// Bound on `D` `[Lq]`.
    pub delta: Array1<f64>,
    /// Bound on `dQ` `[Lq, d]`.
    pub dq: Array2<f64>,
    /// Bound on `dK` `[Lk, d]`.
    pub dk: Array2<f64>,
    /// Bound on `dV` `[Lk, dv]`.
    pub dv: Array2<f64>,
}

/// The backward model's bounds for one head.
///
/// Recipe (`attnproof-reference`'s `backward` module): `D = rowsum(dO ∘ O)` in f32 from the
/// candidate forward's `O` (stored in `T`) and `dO` (in `T`); per tile pair `P = exp(s − LSE)`
/// in f32 from the candidate's f32 LSE; `dV += round_T(P)ᵀ dO`; `dP = dO Vᵀ`;
/// `dS = P ∘ (dP − D)` in f32, rounded to `T` for `dQ += dS K` and `dK += dSᵀ Q` (f32
/// accumulators; dQ may be summed from per-KV-tile partials); `dQ, dK ← α̂·(…)`; every gradient
/// rounded to `T`. With `forward` the bounds of the candidate's forward outputs, first order:
///
/// - `ν_i = g(dv) Σ_c |dO_ic||o_ic| + Σ_c |dO_ic| b^O_ic` (`D`);
/// - `π_ij = σ_ij + b^L_i + u|s_ij − LSE_i| + e + c|LSE_i|` (relative error of `P`); with
///   [`ScoreReuse::BitwiseAsForward`] the score terms `σ_ij` and `Σ_k p_ik σ_ik` (the score part
///   of `b^L_i`) become `(1 − p_ij)σ_ij + Σ_{k≠j} p_ik σ_ik`;
/// - `dV_jc`: `Σ_i p_ij (π_ij + u_T + g(Lq + n_q)) |dO_ic| + Lq (τ_T + τ_e) max_i |dO_ic|`
///   `+ u_T |dV_jc| + τ_T`;
/// - `ρ_ij = g(dv) Σ_c |dO_ic||v_jc|` (`dP`);
/// - `ζ_ij = (π_ij + 2u + u_T)|dS_ij| + p_ij(ρ_ij + ν_i) + τ_e|dP_ij − D_i| + τ_T` (`dS` after its
///   rounding to `T`);
/// - `dQ_ic`: `|α| (Σ_j (ζ_ij + g(Lk + n_k)|dS_ij|) |k_jc| + n_k 2^-126) + (3u + u_T)|dQ_ic| + τ_T`, where
///   `n_k 2^-126` covers dQ's per-KV-tile partials added by f32 atomics (`atom.add.f32` flushes subnormal inputs
///   and results to zero, so each of a row's at most `n_k` adds may lose a value below `2^-126`; a dQ of subnormal
///   f32 magnitude, from a `dO` near bf16's smallest values, then comes back as 0);
/// - `dK_jc`: `|α| Σ_i (ζ_ij + g(Lq + n_q)|dS_ij|) |q_ic| + (3u + u_T)|dK_jc| + τ_T`;
/// - with [`FlashRecipe::atomic_kv_sums`], dK's and dV's `n_q` partials are added by f32 atomics: `|α| n_q 2^-126`
///   more on dK and `n_q 2^-126` on dV (the flush of each add, as dQ's).
///
/// `n_q = ⌈Lq/q_tile⌉ + extra_query_partials`, `n_k = ⌈Lk/kv_tile⌉ + extra_merges` are the query
/// and KV tile counts (the extra additions of partial sums). The same
/// hypothesis and [`SECOND_ORDER_FACTOR`] as the forward model apply.
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
    let abs_kt = abs_transposed(f.k);
    let score_factor = acc.gamma(d) + 3.0 * u + 3.0 * recipe.score_storage_rounding;
    let pi_rows: Vec<(Vec<f64>, f64)> = (0..len_q)
        .into_par_iter()
        .map(|i| {
            let mut pi = vec![0.0; len_k];
            if f.lse[i] == f64::NEG_INFINITY {
                return (pi, 0.0);
            }
            let mut sigma = abs_dots(f.q.row(i), &abs_kt);
            for (j, s) in sigma.iter_mut().enumerate() {
                *s = if f.s[[i, j]] == f64::NEG_INFINITY { 0.0 } else { score_factor * f.scale * *s };
            }
            // The forward LSE bound's own share of score error, Σ_k p_ik σ_ik (scaled as that bound is).
            let weighted: f64 = (0..len_k).map(|k| f.p[[i, k]] * sigma[k]).sum();
            let mut worst: f64 = 0.0;
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
                pi[j] = score_part
                    + u * (f.s[[i, j]] - f.lse[i]).abs()
                    + recipe.exp_error
                    + recipe.shift_rounding * f.lse[i].abs();
                worst = worst.max(pi[j]);
            }
            (pi, worst)
        })
        .collect();
    let worst = pi_rows.iter().map(|r| r.1).fold(acc.gamma(len_q + n_q).max(acc.gamma(len_k + n_k)).max(ut), f64::max);
    if worst > FIRST_ORDER_LIMIT {
        return Err(Violation::Hypothesis {
            theorem: T,
            reason: format!("first-order perturbation {worst:e} exceeds 2^-5"),
        });
    }
    let pi = Array2::from_shape_vec((len_q, len_k), pi_rows.into_iter().flat_map(|r| r.0).collect())
        .expect("one row of Lk per query");
    let nu = Array1::from_shape_fn(len_q, |i| {
        let abs_dot: f64 = x.d_out.row(i).iter().zip(f.o.row(i)).map(|(a, b)| a.abs() * b.abs()).sum();
        acc.gamma(dv) * abs_dot + (0..dv).map(|c| x.d_out[[i, c]].abs() * forward.o[[i, c]]).sum::<f64>()
    });
    let abs_vt = abs_transposed(f.v);
    let zeta_rows: Vec<Vec<f64>> = (0..len_q)
        .into_par_iter()
        .map(|i| {
            let mut zeta = abs_dots(x.d_out.row(i), &abs_vt);
            for (j, z) in zeta.iter_mut().enumerate() {
                *z = if f.p[[i, j]] == 0.0 && x.ds[[i, j]] == 0.0 {
                    0.0
                } else {
                    let rho = acc.gamma(dv) * *z;
                    (pi[[i, j]] + 2.0 * u + ut) * x.ds[[i, j]].abs()
                        + f.p[[i, j]] * (rho + nu[i])
                        + recipe.exp_underflow * (x.dp[[i, j]] - x.delta[i]).abs()
                        + tiny
                };
            }
            zeta
        })
        .collect();
    let zeta = Array2::from_shape_vec((len_q, len_k), zeta_rows.into_iter().flatten().collect())
        .expect("one row of Lk per query");
    let (gq, gk) = (acc.gamma(len_q + n_q), acc.gamma(len_k + n_k));
    let dq_sums = weighted_row_sums(len_q, f.k, |i, j| zeta[[i, j]] + gk * x.ds[[i, j]].abs());
    let dk_sums = weighted_column_sums(len_k, f.q, |i, j| zeta[[i, j]] + gq * x.ds[[i, j]].abs());
    let dv_sums = weighted_column_sums(len_k, x.d_out, |i, j| f.p[[i, j]] * (pi[[i, j]] + ut + gq));
    // max_i |dO_ic| does not depend on the key.
    let gmax: Vec<f64> = (0..dv).map(|c| (0..len_q).map(|i| x.d_out[[i, c]].abs()).fold(0.0, f64::max)).collect();
    // Each f32 atomic add of a key's n_q partials may flush a value below 2^-126.
    let kv_flush = if recipe.atomic_kv_sums { n_q as f64 * F32_MIN_NORMAL } else { 0.0 };
    let mut b = BackwardBounds {
        delta: nu,
        dq: Array2::from_shape_fn((len_q, d), |(i, c)| {
            let atomic_flush = n_k as f64 * F32_MIN_NORMAL;
            f.scale * (dq_sums[[i, c]] + atomic_flush) + (3.0 * u + ut) * x.dq[[i, c]].abs() + tiny
        }),
        dk: Array2::from_shape_fn((len_k, d), |(j, c)| {
            f.scale * (dk_sums[[j, c]] + kv_flush) + (3.0 * u + ut) * x.dk[[j, c]].abs() + tiny
        }),
        dv: Array2::from_shape_fn((len_k, dv), |(j, c)| {
            dv_sums[[j, c]]
                + len_q as f64 * (tiny + recipe.exp_underflow) * gmax[c]
                + kv_flush
                + ut * x.dv[[j, c]].abs()
                + tiny
        }),
    };
    for a in [&mut b.dq, &mut b.dk, &mut b.dv] {
        a.mapv_inplace(|v| v * SECOND_ORDER_FACTOR);
    }
    b.delta.mapv_inplace(|v| v * SECOND_ORDER_FACTOR);
    Ok(b)
}

/// The extra error of summing `group` per-head f32 gradients of magnitudes `Σ_h |g_h|`:
/// `g(group) Σ_h |g_h|` (the per-head bounds add).
pub fn gqa_sum_term(group: usize, sum_of_abs: f64) -> f64 {
    gamma32(group) * sum_of_abs * SECOND_ORDER_FACTOR
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{arr1, arr2};

    #[test]
    fn exp_underflow_enters_ds_as_derived() {
        let e = 1f64.exp();
        let (q, k, v) = (arr2(&[[1.0]]), arr2(&[[1.0], [0.5]]), arr2(&[[1.0], [-1.0]]));
        let s = arr2(&[[1.0, 0.5]]);
        let lse = arr1(&[(e + e.sqrt()).ln()]);
        let p = s.mapv(|x| (x - lse[0]).exp());
        let o = arr2(&[[p[[0, 0]] - p[[0, 1]]]]);
        let d_out = arr2(&[[1.0]]);
        let dp = arr2(&[[1.0, -1.0]]);
        let delta = arr1(&[o[[0, 0]]]);
        let ds = Array2::from_shape_fn((1, 2), |(i, j)| p[[i, j]] * (dp[[i, j]] - delta[i]));
        let dq = arr2(&[[ds[[0, 0]] * k[[0, 0]] + ds[[0, 1]] * k[[1, 0]]]]);
        let dk = arr2(&[[ds[[0, 0]] * q[[0, 0]]], [ds[[0, 1]] * q[[0, 0]]]]);
        let dv = arr2(&[[p[[0, 0]]], [p[[0, 1]]]]);
        let forward = HeadExact {
            q: q.view(),
            k: k.view(),
            v: v.view(),
            s: s.view(),
            p: p.view(),
            o: o.view(),
            lse: lse.view(),
            scale: 1.0,
        };
        let x = HeadBackwardExact {
            forward,
            d_out: d_out.view(),
            dp: dp.view(),
            ds: ds.view(),
            delta: delta.view(),
            dq: dq.view(),
            dk: dk.view(),
            dv: dv.view(),
        };
        let plain = FlashRecipe::libm(2f64.powi(-8), 2f64.powi(-133), 1);
        let fixed_forward = forward_bounds(forward, plain).unwrap();
        let bounds =
            |exp_underflow| backward_bounds(x, &fixed_forward, FlashRecipe { exp_underflow, ..plain }, 1).unwrap();
        let (before, after) = (bounds(F32_SUBNORMAL), bounds(1.0));
        let added = (1.0 - F32_SUBNORMAL) * SECOND_ORDER_FACTOR;
        let gap = |j: usize| (dp[[0, j]] - delta[0]).abs();
        let want_dq = added * (gap(0) * k[[0, 0]].abs() + gap(1) * k[[1, 0]].abs());
        let got_dq = after.dq[[0, 0]] - before.dq[[0, 0]];
        assert!((got_dq - want_dq).abs() <= 1e-12 * want_dq, "dQ grew by {got_dq}, not {want_dq}");
        for j in 0..2 {
            let (want, got) = (added * gap(j) * q[[0, 0]].abs(), after.dk[[j, 0]] - before.dk[[j, 0]]);
            assert!((got - want).abs() <= 1e-12 * want, "dK[{j}] grew by {got}, not {want}");
        }
        assert_eq!(before.delta, after.delta, "D's bound does not involve the exp");
    }
}
