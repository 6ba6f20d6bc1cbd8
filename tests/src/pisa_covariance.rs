//! Verifying PISA's covariance-aware block selection (E24) as the GPU runs it against the oracle
//! (`attnproof_oracle::pisa::covariance_block_scores`): the kernel's lists `[B, Hkv, n_q, top_k]` and its spreads
//! `[B, Hkv, n_k]`.
//!
//! # The convention
//!
//! E24 scores a block by `σ_ib = α_ib (|B_b| + γ ‖q_i‖ ‖H_b − H̄‖₂ / √d)`. The GPU scores on BSA's per-query-block
//! convention (`attnproof_oracle::bsa`): for (sequence, KV head, query block `a`, key block `b`),
//! `S_ab = Σ_{h∈group} [α q̄_{a,h}·μ_b + ln(n_b + c_{a,h} s_b)]` with `q̄_{a,h}` the mean query of head `h` over the
//! query block, `μ_b` the mean key of the key block, `n_b` its key count (the last block may be partial),
//! `c_{a,h} = γ|α| ‖q̄_{a,h}‖₂`, and the spread `s_b`: the estimate of `‖H_b − H̄‖₂` by exactly `K = E24_POWER_STEPS`
//! steps of power iteration from the all-ones vector, without an early stop (`H_b`, `H̄` per sequence and KV head, in
//! blocks of `kv_block` keys). Eligibility, forced blocks and top-k with ties to the lower index are BSA's.
//!
//! # The spreads
//!
//! **What the kernel computes.** It reads the block selector's f64 mean keys `μ̂_b` (`bsa_pool_keys`, the tail's
//! pooling) and sums its own `Ĥ̄` in f64, each within `ρ` of the oracle's f64 statistic: `ρ_μ,r = 2γ_{n+2} mean_j
//! |k_jr|` for the mean key (`pisa_tail`'s `f64_sum_rho(n + 1, ·)`, `n` the block's keys) and `ρ_H,rc`
//! ([`centred_hbar_rho`]) for `H̄`: the kernel sums `fl(k_jr − μ̂_{b(j)r}) v_jc` over the sequence's `N` keys in ranges of
//! blocks, adds the ranges' sums and divides by the `n_B` blocks, the oracle sums each block's products, adds the
//! blocks' sums and divides, so `ρ_H,rc = (Σ_b ρ_μ,br |Σ_{j∈b} v_jc| + 2γ_{N+R+C+4} Σ_j (|k_jr − μ_{b(j)r}| +
//! ρ_μ,b(j)r)|v_jc|) / n_B + 2u |H̄_rc|` (`R` ranges, `C` keys per block; the means' distance moves each block's sum
//! by `(μ_br − μ̂_br) Σ_{j∈b} v_jc`, each evaluation's sums are within `γ_{N+R+C+4}` of their absolute terms, and each
//! division rounds once). It forms
//! `M̂_rc = fl(Σ_j fl(k_jr − μ̂_r) v_jc) − Ĥ̄_rc` in f64 (an fma chain over the block's keys, then one subtraction) and
//! runs the oracle's `K` steps in f64: `x ← x/‖x‖`, `a ← M̂ x`, `s ← ‖a‖`, `x ← M̂ᵀ a`, each matrix-vector entry a sum
//! of `dv` or `d` products, each norm the square root of a sum of squares.
//!
//! **The reference.** Let `M*` be the exact `Σ_j (k_j − μ_b) v_jᵀ − H̄` on the oracle's f64 statistics `μ_b`, `H̄`,
//! `A = M*ᵀ M*`, `x₀` the all-ones vector, and `s*` the exact `K`-step estimate on `M*`: `s* = ‖M* ŷ*‖` with `ŷ*` the
//! unit vector along `A^{K−1} x₀`. Both the kernel's `ŝ` and the oracle's f64 `s` are bounded against `s*`, and the
//! check allows the sum of the two bounds.
//!
//! **One evaluation as exact steps of perturbed matrices.** An evaluation (the kernel's or the oracle's) works with a
//! matrix `M_e = M* + F_e`, `|F_e| ≤ Φ_e` entrywise: for the oracle
//! `Φ_o,rc = γ_{n+2} (Σ_j |k_jr − μ_r||v_jc| + |H̄_rc|)` (one rounding of each deviation, a sum of `n` products in any
//! order, one subtraction); for the kernel
//! `Φ_g,rc = ρ_μ,r |Σ_j v_jc| + ρ_H,rc + γ_{n+2} (Σ_j (|k_jr − μ_r| + ρ_μ,r)|v_jc| + |H̄_rc| + ρ_H,rc)` (its means
//! move the sum by `(μ_r − μ̂_r) Σ_j v_jc`, its `H̄` by `ρ_H`, and its roundings act on its own, slightly larger
//! terms). A matrix-vector product in f64 in any order, fused or not, is an exact product with a matrix within
//! `γ_dv |M_e|` (for `M_e x`) or `γ_d |M_e|` (for `M_eᵀ a`) of `M_e`. So every product a step forms is an exact
//! product with a matrix within `δ_e = ‖Φ_e‖_F + γ_{max(d, dv)} (‖M*‖_F + ‖Φ_e‖_F)` of `M*` in the Frobenius norm, hence
//! in the spectral norm, with `‖M*‖_F ≤ ‖M_o‖_F + ‖Φ_o‖_F` (`M_o` the oracle's f64 matrix). The normalization
//! `x/‖x‖` rounds each entry once (or twice, through a rounded reciprocal): `x̂ = D x / n̂` with `|D − I| ≤ γ_2` and a
//! positive scalar `n̂`. Step `j` of the evaluation is thus `x_{j+1} = (A + E_j) x_j / n̂_j` with
//! `E_j = (M* + G₂)ᵀ(M* + G₁) D_j − A`, `‖G_i‖ ≤ δ_e`, and
//! `‖E_j‖ ≤ (σ̄ + δ_e)²(1 + γ_2) − σ̄² = ε_e λ̄`, `λ̄ = σ̄²`, `ε_e = (1 + δ_e/σ̄)²(1 + γ_2) − 1`, where
//! `σ̄ ≥ ‖M*‖₂`.
//!
//! **The iterate.** After `K − 1` steps the evaluation's iterate is `P_e x₀` over a positive scalar, with
//! `P_e = (A + E_{K−2})⋯(A + E_0)`. Telescoping, `P_e − A^{K−1} = Σ_{j=0}^{K−2} (A + E_{K−2})⋯(A + E_{j+1}) E_j A^j`, so
//! `‖(P_e − A^{K−1}) x₀‖ ≤ Σ_j ((1 + ε_e) λ̄)^{K−2−j} ε_e λ̄ ‖A^j x₀‖`: what step `j` adds grows at most by `λ̄` per
//! later step, while the exact iterate grows by its own norms. Those come from the oracle's run: its computed norms
//! `n̂_j = ‖x_j‖(1 + θ_j)`, `|θ_j| ≤ γ_{dv+1}`, give `‖P_o^{(j)} x₀‖ / ‖x₀‖ = Π_{i=1}^{j} n̂_i · (1 + θ_0)/(1 + θ_j)` for
//! its first `j` steps `P_o^{(j)}`, which lie within `((1 + ε_o)^j − 1) λ̄^j` of `A^j`. With `G_j = Π_{i=1}^{j} n̂_i/λ̄`
//! and `c_± = (1 ± γ_{dv+1})/(1 ∓ γ_{dv+1})`: `‖A^j x₀‖ / (λ̄^j ‖x₀‖) ≤ a_j = min(1, G_j c_+ + (1 + ε_o)^j − 1)`
//! (`a_0 = 1`), and for `j = K − 1` it is at least `R = G_{K−1} c_− − ((1 + ε_o)^{K−1} − 1)`. The evaluation's iterate
//! is then within a relative `η_e = (ε_e / R) Σ_{j=0}^{K−2} (1 + ε_e)^{K−2−j} a_j` of the exact one (at most
//! `((1 + ε_e)^{K−1} − 1)/R`, the bound with every `a_j = 1`), and the unit vectors along them within `2η_e`
//! (`‖a/‖a‖ − b/‖b‖‖ ≤ 2‖a − b‖/‖b‖`).
//!
//! **The estimate.** The last step forms `‖fl(M_e x̂)‖` with `x̂ = D ỹ / (1 + θ_{K−1})`, `ỹ` the unit vector along the
//! evaluation's iterate: `ŝ_e = ‖(M* + G₁) D ỹ‖ (1 + θ')/(1 + θ_{K−1})` with `|θ'| ≤ γ_{d+1}`, so
//! `|ŝ_e − s*| ≤ σ̄(γ_2 + 2η_e) + δ_e(1 + γ_2) + γ_{d+dv+4} (σ̄ + δ_e)(1 + γ_2)`. Whatever the iteration did, both
//! estimates lie in `[0, (σ̄ + δ_e)(1 + γ_2)(1 + γ_{d+dv+4})]`, which caps the bound (it is what remains when `R ≤ 0`,
//! when the oracle's run met a zero vector before its last step, or when `σ̄ = 0`). The check's bound is
//! `(1 + 2^-10) · min(dev_g + dev_o, max(cap_g, cap_o))`, the margin covering the bound's own f64 evaluation (a few
//! roundings in each of its terms, as in `attnproof_proofs::bsa_bound`).
//!
//! **The assumption.** `σ̄ = max(σ_o, √max_{j≥1} n̂_j) + ‖Φ_o‖_F`, with `σ_o` the oracle's spectral norm of `M_o` by
//! power iteration to stagnation (`tail_statistics`' heterogeneity) and `n̂_j` the oracle's `K`-step growths, is taken
//! to bound `‖M*‖₂`: the `‖Φ_o‖_F` covers `M* − M_o`, and the rest assumes that power iteration found `‖M_o‖₂` (it
//! approaches it from below, and misses it when the all-ones start is nearly orthogonal to the top right singular
//! vector). A `σ̄` below `‖M*‖₂` makes the bound smaller, never larger: `2η σ̄` depends on `σ̄` to first order only
//! through `Σ_j a_j / R ≈ Σ_j G_j / G_{K−1}`, which shrinks with `λ̄` (each `G_j` scales by `λ̄^{−j}`), and the cap
//! shrinks with `σ̄`. Where the assumption fails, the check can reject a correct kernel, not pass a wrong one.
//!
//! # The scores and the lists
//!
//! The lists are checked by BSA's logic (`crate::block_selection`): each of the oracle's f64 scores and the kernel's is
//! within `E` of the exact score (the exact pooled dot part plus `Σ_h ln(n_b + c_{a,h} s*)`); a row is decided when no
//! chosen, unforced block and eligible left-out block have scores within `2(E_x + E_y)`, except pairs that every
//! deterministic evaluation scores bitwise equal: here blocks of the same count with bitwise equal keys and values (then
//! their means, `H_b`, spreads and scores are equal, and the tie breaks to the lower index as in the oracle). Decided
//! rows must equal the oracle's; near-tied rows must be valid lists that no left-out block beats beyond the bounds.
//!
//! The bound of one score: `E = (1 + 2^-10) [E_dot + Σ_h E_ln,h + γ_{G+1} (|S_dot| + E_dot + Σ_h (|L_h| + E_ln,h))]`.
//! `E_dot` is BSA's `pooled_score_bound` of the group-summed dot part `S_dot` (the kernel's mean key is one f64
//! evaluation, as that model takes it); the last term is the sum of the `G + 1` parts in any order. `L_h` is the oracle's
//! `ln(n_b + c_{a,h} s_b)` and `E_ln,h` bounds one evaluation of it against the exact: both arguments are at least
//! `n_b`, where `ln` is `1/n_b`-Lipschitz, so the propagated part is `P = (Δc (s + Δs) + (c + Δc) Δs) / n_b`, with `Δs`
//! the spread's bound above (`s + Δs` bounds every evaluation's spread) and `Δc` the coefficient's: the f64 pooled query
//! is within `γ_{m+1} Q_c` of the exact one per component (`Q_c = mean_i |q_ic|` over the query block's `m` rows, BSA's
//! model), so its norm moves by at most `γ_{m+1} ‖Q‖₂`; the norm's own evaluation costs `γ_{d+2}` and `γ|α|` with `α`'s
//! rounding `γ_3`, so `Δc = γ|α| (γ_{m+1}‖Q‖₂ + γ_{d+5} (‖q̄‖(1 + γ_{d+2}) + 2γ_{m+1}‖Q‖₂))`. The argument's two roundings
//! (a product and a sum, or one fused) move the logarithm by at most `−ln(1 − γ_2) < 3u`, and the logarithm's own error
//! of at most one ulp (CUDA's `log`; Rust's `ln` is within it) adds `2u` of its value:
//! `E_ln,h = (1 + 4u) P + 3u (|L_h| + 1)`.

use attnproof_gpu::pisa::covariance::RANGE_BLOCKS;
use attnproof_oracle::AttentionSpec;
use attnproof_oracle::bsa::{bsa_scores, bsa_select};
use attnproof_oracle::pisa::{
    CovarianceConfig, E24_POWER_STEPS, TailStatistics, block_spreads_of, covariance_block_scores, tail_statistics,
};
use attnproof_oracle::vector::{PowerRun, mean_row, norm2};
use attnproof_proofs::f64_oracle_bound::{UNIT_ROUNDOFF, gamma};
use attnproof_reference::Element;
use ndarray::{Array1, Array2, Array3, Array4, ArrayView2, ArrayView3, ArrayView4, ArrayViewD, Axis, Slice};

use crate::block_selection::{
    SelectionTruth, SelectionVerdict, abs_means, check_lists, pooled_score_bounds, same_rows,
};
use crate::flash::{Case, HarnessError};
use crate::pisa_tail::f64_sum_rho;
use crate::verdict::WorstRatio;

/// Relative slack for the bounds' own f64 evaluation (module docs).
const MARGIN: f64 = 1.0 + 1.0 / 1024.0;

/// What [`verify_covariance_selection`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct CovarianceVerdict {
    /// The lists, checked by BSA's logic under E24's scores and bounds.
    pub selection: SelectionVerdict,
    /// The largest `|ŝ − s| / bound` over the spreads (0 when every spread is exact); a spread past a sequence's
    /// blocks must be exactly 0.
    pub spread_ratio: f64,
    /// The spread of [`CovarianceVerdict::spread_ratio`]: `"spread [seq, kv, b]: …"`.
    pub spread_worst: String,
}

impl CovarianceVerdict {
    /// Every list row passed and every spread lies within its bound.
    pub fn passed(&self) -> bool {
        self.selection.passed() && self.spread_ratio <= 1.0
    }
}

/// The spread bound's model of one key block (module docs): what the bound reads of the oracle's run and of the two
/// evaluations' perturbations.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct SpreadModel {
    /// `σ̄`, taken to bound `‖M*‖₂`.
    pub(crate) sigma_bar: f64,
    /// `R`'s first part, `G_{K−1} c_−`; 0 when the oracle's run ended early or `σ̄ = 0`.
    pub(crate) growth: f64,
    /// `a_j ≥ ‖A^j x₀‖ / (λ̄^j ‖x₀‖)` for `j = 0..K−1` (`a_0 = 1`).
    pub(crate) powers: Vec<f64>,
    /// `δ_o`: the oracle's evaluation's matrices lie within it of `M*`.
    pub(crate) delta_oracle: f64,
    /// `δ_g`: the kernel's.
    pub(crate) delta_device: f64,
    /// `M`'s rows (the key head dim).
    pub(crate) d: usize,
    /// `M`'s columns (the value head dim).
    pub(crate) dv: usize,
}

impl SpreadModel {
    /// The model of the oracle's f64 matrix `m_oracle` (`M_o`), its fixed-step `run`, its stagnation estimate
    /// `stagnation` (`σ_o`) and the entrywise bounds `phi_oracle`, `phi_device` on the two evaluations' matrices
    /// against `M*`.
    pub(crate) fn new(
        m_oracle: ArrayView2<'_, f64>,
        run: &PowerRun<f64>,
        stagnation: f64,
        phi_oracle: ArrayView2<'_, f64>,
        phi_device: ArrayView2<'_, f64>,
    ) -> Self {
        let frobenius = |x: ArrayView2<'_, f64>| x.iter().map(|y| y * y).sum::<f64>().sqrt();
        let (d, dv) = m_oracle.dim();
        let (phi_o, phi_g) = (frobenius(phi_oracle), frobenius(phi_device));
        let largest_growth = run.norms.iter().skip(1).fold(0f64, |m, &x| m.max(x));
        let sigma_bar = stagnation.max(largest_growth.sqrt()) + phi_o;
        let m_star = frobenius(m_oracle) + phi_o;
        let delta = |phi: f64| phi + gamma(d.max(dv)) * (m_star + phi);
        let mut model = SpreadModel {
            sigma_bar,
            growth: 0.0,
            powers: vec![1.0; E24_POWER_STEPS - 1],
            delta_oracle: delta(phi_o),
            delta_device: delta(phi_g),
            d,
            dv,
        };
        let lambda = sigma_bar * sigma_bar;
        if run.norms.len() < E24_POWER_STEPS || lambda == 0.0 {
            return model;
        }
        let g = gamma(dv + 1);
        let (above, below) = ((1.0 + g) / (1.0 - g), (1.0 - g) / (1.0 + g));
        // G_j = Π_{i=1}^{j} n̂_i / λ̄, for j = 1..K−1.
        let prefixes: Vec<f64> = run.norms[1..]
            .iter()
            .scan(1.0, |p, &n| {
                *p *= n / lambda;
                Some(*p)
            })
            .collect();
        let drifts: Vec<f64> = (0..E24_POWER_STEPS - 1).map(|j| model.drift(model.delta_oracle, j)).collect();
        for (j, power) in model.powers.iter_mut().enumerate().skip(1) {
            *power = (prefixes[j - 1] * above + drifts[j]).min(1.0);
        }
        model.growth = prefixes[E24_POWER_STEPS - 2] * below;
        model
    }

    /// `ε` of an evaluation within `delta` of `M*`: `‖E_j‖ ≤ ε λ̄`.
    fn epsilon(&self, delta: f64) -> f64 {
        (1.0 + delta / self.sigma_bar).powi(2) * (1.0 + gamma(2)) - 1.0
    }

    /// `(1 + ε)^steps − 1` for an evaluation within `delta` of `M*`: how far its first `steps` steps' product may lie
    /// from `A^steps`, relative to `λ̄^steps`.
    fn drift(&self, delta: f64, steps: usize) -> f64 {
        (steps as f64 * self.epsilon(delta).ln_1p()).exp_m1()
    }

    /// `η`: the relative distance of an evaluation's iterate (within `delta` of `M*`) from the exact one; `∞` where
    /// the model gives none (`R ≤ 0`, or `σ̄ = 0`).
    pub(crate) fn eta(&self, delta: f64) -> f64 {
        if self.sigma_bar == 0.0 {
            return f64::INFINITY;
        }
        let r = self.growth - self.drift(self.delta_oracle, E24_POWER_STEPS - 1);
        if r <= 0.0 {
            return f64::INFINITY;
        }
        let epsilon = self.epsilon(delta);
        let last = E24_POWER_STEPS - 2;
        let carried: f64 =
            self.powers.iter().enumerate().map(|(j, a)| (1.0 + epsilon).powi((last - j) as i32) * a).sum();
        epsilon * carried / r
    }

    /// The largest value an evaluation within `delta` of `M*` can return.
    fn cap(&self, delta: f64) -> f64 {
        (self.sigma_bar + delta) * (1.0 + gamma(2)) * (1.0 + gamma(self.d + self.dv + 4))
    }

    /// `|ŝ_e − s*|` for an evaluation within `delta` of `M*`, capped.
    pub(crate) fn deviation(&self, delta: f64) -> f64 {
        let eta = self.eta(delta);
        if !eta.is_finite() {
            return self.cap(delta);
        }
        let (g2, gn, s) = (gamma(2), gamma(self.d + self.dv + 4), self.sigma_bar);
        let free = s * (g2 + 2.0 * eta) + delta * (1.0 + g2) + gn * (s + delta) * (1.0 + g2);
        free.min(self.cap(delta))
    }

    /// The bound on `|ŝ − s|` between the kernel's spread and the oracle's.
    pub(crate) fn bound(&self) -> f64 {
        let (g, o) = (self.delta_device, self.delta_oracle);
        MARGIN * (self.deviation(g) + self.deviation(o)).min(self.cap(g).max(self.cap(o)))
    }
}

/// `ρ_H` (`[d, dv]`, module docs): how far the kernel's f64 `H̄`, summed from the centred products over ranges of
/// blocks with its own means, may lie from the oracle's, for one (sequence, KV head)'s keys `k` and values `v`
/// (`[N, d]`, `[N, dv]`) and the oracle's statistics `stats`.
pub(crate) fn centred_hbar_rho(
    stats: &TailStatistics<f64>,
    (k, v): (ArrayView2<'_, f64>, ArrayView2<'_, f64>),
) -> Array2<f64> {
    let (n, d, dv, size) = (k.nrows(), k.ncols(), v.ncols(), stats.block_size);
    let blocks = stats.counts.len();
    let ranges = blocks.div_ceil(RANGE_BLOCKS);
    let mut propagated = Array2::<f64>::zeros((d, dv));
    let mut centred = Array2::<f64>::zeros((d, dv));
    for (b, &count) in stats.counts.iter().enumerate() {
        let rows = b * size..b * size + count;
        let rho_mu: Vec<f64> = (0..d)
            .map(|r| f64_sum_rho(count + 1, rows.clone().map(|j| k[[j, r]].abs()).sum::<f64>() / count as f64))
            .collect();
        for (r, &rho) in rho_mu.iter().enumerate() {
            for c in 0..dv {
                let value_sum = rows.clone().map(|j| v[[j, c]]).sum::<f64>().abs();
                let terms: f64 =
                    rows.clone().map(|j| ((k[[j, r]] - stats.means[[b, r]]).abs() + rho) * v[[j, c]].abs()).sum();
                propagated[[r, c]] += rho * value_sum;
                centred[[r, c]] += terms;
            }
        }
    }
    let g = 2.0 * gamma(n + ranges + size + 4);
    Array2::from_shape_fn((d, dv), |(r, c)| {
        (propagated[[r, c]] + g * centred[[r, c]]) / blocks as f64 + 2.0 * UNIT_ROUNDOFF * stats.h_bar[[r, c]].abs()
    })
}

/// The entrywise bounds `Φ_o`, `Φ_g` (`[d, dv]`, module docs) on the oracle's and the kernel's `H_b − H̄` against
/// `M*` for the keys `k` and values `v` of one block (`[n, d]`, `[n, dv]`), its oracle mean `mu`, `H̄` `h_bar`, and
/// the kernel's statistics' distances `rho_h` (`[d, dv]`).
pub(crate) fn block_perturbations(
    (k, v): (ArrayView2<'_, f64>, ArrayView2<'_, f64>),
    mu: ndarray::ArrayView1<'_, f64>,
    h_bar: ArrayView2<'_, f64>,
    rho_h: ArrayView2<'_, f64>,
) -> (Array2<f64>, Array2<f64>) {
    let n = k.nrows();
    let deviations = Array2::from_shape_fn(k.dim(), |(j, r)| (k[[j, r]] - mu[r]).abs());
    let abs_v = v.mapv(f64::abs);
    let spread_terms = deviations.t().dot(&abs_v);
    let rho_mu: Array1<f64> = (0..k.ncols())
        .map(|r| f64_sum_rho(n + 1, k.column(r).iter().map(|x| x.abs()).sum::<f64>() / n as f64))
        .collect();
    let value_sums: Array1<f64> = v.axis_iter(Axis(1)).map(|c| c.sum().abs()).collect();
    let abs_value_sums: Array1<f64> = abs_v.sum_axis(Axis(0));
    let g = gamma(n + 2);
    let oracle = Array2::from_shape_fn(h_bar.dim(), |(r, c)| g * (spread_terms[[r, c]] + h_bar[[r, c]].abs()));
    let device = Array2::from_shape_fn(h_bar.dim(), |(r, c)| {
        rho_mu[r] * value_sums[c]
            + rho_h[[r, c]]
            + g * (spread_terms[[r, c]] + rho_mu[r] * abs_value_sums[c] + h_bar[[r, c]].abs() + rho_h[[r, c]])
    });
    (oracle, device)
}

/// The oracle's spreads and their bounds, `[B, Hkv, n_k]` each (0 past a sequence's blocks).
struct SpreadTruth {
    spreads: Array3<f64>,
    bounds: Array3<f64>,
}

fn spread_truth(
    spec: &AttentionSpec,
    (k, v): (ArrayViewD<'_, f64>, ArrayViewD<'_, f64>),
    kv_block: usize,
    n_k: usize,
) -> SpreadTruth {
    let shape = (spec.sequences().len(), spec.n_heads_kv, n_k);
    let mut t = SpreadTruth { spreads: Array3::zeros(shape), bounds: Array3::zeros(shape) };
    // The oracle's statistics take no empty key range: a sequence without keys has no blocks and no spreads.
    for seq in spec.sequences().iter().filter(|s| s.len_k > 0) {
        for kv in 0..spec.n_heads_kv {
            let (k2, v2) = (spec.head_rows(k.view(), seq, kv, true), spec.head_rows(v.view(), seq, kv, true));
            let stats = tail_statistics(k2, v2, kv_block, ());
            let rho_h = centred_hbar_rho(&stats, (k2, v2));
            for (b, run) in block_spreads_of(&stats, ()).iter().enumerate() {
                let rows = Slice::from(b * kv_block..b * kv_block + stats.counts[b]);
                let block = (k2.slice_axis(Axis(0), rows), v2.slice_axis(Axis(0), rows));
                let (phi_o, phi_g) = block_perturbations(block, stats.means.row(b), stats.h_bar.view(), rho_h.view());
                let m_oracle = &stats.h[b] - &stats.h_bar;
                let model = SpreadModel::new(m_oracle.view(), run, stats.heterogeneity[b], phi_o.view(), phi_g.view());
                t.spreads[[seq.index, kv, b]] = run.estimate;
                t.bounds[[seq.index, kv, b]] = model.bound();
            }
        }
    }
    t
}

/// The bound `E` of every E24 score (module docs), `[B, Hkv, n_q, n_k]`, given the oracle's `spreads` and their
/// `spread_bounds`.
fn score_bounds(
    spec: &AttentionSpec,
    (q, k): (ArrayViewD<'_, f64>, ArrayViewD<'_, f64>),
    config: &CovarianceConfig,
    (spreads, spread_bounds): (&Array3<f64>, &Array3<f64>),
) -> Result<Array4<f64>, HarnessError> {
    let bsa = &config.bsa;
    let dot = bsa_scores(spec, q.view(), k.view(), bsa, ())?;
    let dot_bounds = pooled_score_bounds(spec, q.view(), k.view(), bsa);
    let weight = config.gamma * spec.scale_value::<f64>(()).abs();
    let (group, d, u) = (spec.group_size(), spec.head_dim, UNIT_ROUNDOFF);
    let mut bounds = Array4::zeros(dot.raw_dim());
    for seq in spec.sequences() {
        for kv in 0..spec.n_heads_kv {
            for a in 0..bsa.query_blocks(&seq) {
                let rows = a * bsa.q_block..((a + 1) * bsa.q_block).min(seq.len_q);
                let gm = gamma(rows.len() + 1);
                // `(c, Δc)` per query head of the group.
                let coefficients: Vec<(f64, f64)> = (kv * group..(kv + 1) * group)
                    .map(|h| {
                        let head = spec.head_rows(q.view(), &seq, h, false);
                        let mean = mean_row(head.slice_axis(Axis(0), Slice::from(rows.clone())), ())
                            .expect("a query block has rows");
                        let norm = norm2(mean.view(), ());
                        let abs_norm = abs_means(head, rows.clone()).iter().map(|x| x * x).sum::<f64>().sqrt();
                        let dc = weight
                            * (gm * abs_norm + gamma(d + 5) * (norm * (1.0 + gamma(d + 2)) + 2.0 * gm * abs_norm));
                        (weight * norm, dc)
                    })
                    .collect();
                for b in 0..bsa.key_blocks(&seq) {
                    let s_dot = dot[[seq.index, kv, a, b]];
                    if !s_dot.is_finite() {
                        continue;
                    }
                    let n = (((b + 1) * bsa.kv_block).min(seq.len_k) - b * bsa.kv_block) as f64;
                    let (s, ds) = (spreads[[seq.index, kv, b]], spread_bounds[[seq.index, kv, b]]);
                    let e_dot = dot_bounds[[seq.index, kv, a, b]];
                    let (mut e_ln, mut magnitude) = (0.0, s_dot.abs() + e_dot);
                    for &(c, dc) in &coefficients {
                        let log = (n + c * s).ln();
                        let propagated = (dc * (s + ds) + (c + dc) * ds) / n;
                        let e = (1.0 + 4.0 * u) * propagated + 3.0 * u * (log.abs() + 1.0);
                        e_ln += e;
                        magnitude += log.abs() + e;
                    }
                    bounds[[seq.index, kv, a, b]] = MARGIN * (e_dot + e_ln + gamma(group + 1) * magnitude);
                }
            }
        }
    }
    Ok(bounds)
}

/// The oracle's side of a case: its scores, lists and score bounds, and its spreads with their bounds.
fn oracle_truth<T: Element>(
    case: &Case<T>,
    config: &CovarianceConfig,
) -> Result<(SelectionTruth, SpreadTruth), HarnessError> {
    let spec = &case.spec;
    let [q, k, v] = case.widened();
    let oracle = covariance_block_scores(spec, q.view(), k.view(), v.view(), config, ())?;
    let spreads = spread_truth(spec, (k.view(), v.view()), config.bsa.kv_block, oracle.spreads.dim().2);
    let bounds = score_bounds(spec, (q.view(), k.view()), config, (&spreads.spreads, &spreads.bounds))?;
    let lists = bsa_select(spec, oracle.scores.view(), &config.bsa)?;
    Ok((SelectionTruth { scores: oracle.scores, lists, bounds }, spreads))
}

/// Verifies a kernel's E24 selection of `case` under `config`: its `lists` (`[B, Hkv, n_q, top_k]`) and its spreads
/// `ŝ_b` (`[B, Hkv, n_k]`, 0 past a sequence's blocks). See the module docs for the bounds.
pub fn verify_covariance_selection<T: Element>(
    case: &Case<T>,
    config: &CovarianceConfig,
    lists: ArrayView4<'_, i32>,
    spreads: ArrayView3<'_, f64>,
) -> Result<CovarianceVerdict, HarnessError> {
    let spec = &case.spec;
    let (truth, truth_spreads) = oracle_truth(case, config)?;
    if spreads.shape() != truth_spreads.spreads.shape() {
        return Err(HarnessError::CandidateShape {
            argument: "spreads",
            expected: truth_spreads.spreads.shape().to_vec(),
            actual: spreads.shape().to_vec(),
        });
    }
    let mut worst = WorstRatio::default();
    for ((s, kv, b), &got) in spreads.indexed_iter() {
        let (want, bound) = (truth_spreads.spreads[[s, kv, b]], truth_spreads.bounds[[s, kv, b]]);
        worst
            .offer(got, want, bound, || format!("spread [{s}, {kv}, {b}]: {got:e} against {want:e} (bound {bound:e})"));
    }
    let [_, k, v] = case.widened();
    let (keys, values, kv_block) = (k.view(), v.view(), config.bsa.kv_block);
    let selection = check_lists(spec, &config.bsa, &truth, lists, |seq, kv, x, y| {
        same_rows(spec, &keys, seq, kv, kv_block, x, y) && same_rows(spec, &values, seq, kv, kv_block, x, y)
    })?;
    Ok(CovarianceVerdict { selection, spread_ratio: worst.ratio, spread_worst: worst.at })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_selection::near_tied;
    use crate::generate::{Distribution, ValueProfile, make_case};
    use attnproof_oracle::bsa::BsaConfig;
    use attnproof_oracle::pisa::block_spreads;
    use attnproof_oracle::real::{Mp, Precision, Real};
    use attnproof_oracle::vector::{PowerStop, power_iteration, spectral_norm};
    use attnproof_oracle::{Layout, Mask};
    use half::bf16;

    fn profile() -> ValueProfile {
        ValueProfile { distribution: Distribution::Gaussian, logit_scale: 1.0, value_mean: 0.0 }
    }

    fn config(gamma: f64) -> CovarianceConfig {
        CovarianceConfig {
            bsa: BsaConfig { q_block: 4, kv_block: 4, top_k: 3, force_first: true, force_local: 1 },
            gamma,
        }
    }

    /// The f32 stage factor of the GPU tail kernel's `H̄`, as a caller passes it.
    /// Two sequences, 4 query heads over 2 KV heads, 21 queries and 30 keys (the last key block of 4 is partial), causal.
    fn case(seed: u64) -> Case<bf16> {
        let spec = AttentionSpec::dense(2, 4, 2, 21, 30, 8, 8).with_mask(Mask::Causal);
        make_case::<bf16>(&spec, profile(), seed)
    }

    /// The oracle's own lists and spreads.
    fn oracle_answer(case: &Case<bf16>, config: &CovarianceConfig) -> (Array4<i32>, Array3<f64>) {
        let [q, k, v] = case.widened();
        let scores = covariance_block_scores(&case.spec, q.view(), k.view(), v.view(), config, ()).unwrap();
        (bsa_select(&case.spec, scores.scores.view(), &config.bsa).unwrap(), scores.spreads)
    }

    /// The oracle's lists and spreads pass, on a dense and a varlen case (with a sequence without keys and one without
    /// queries); most rows are decided and most spread bounds are the model's, not the cap; a spread past a sequence's
    /// blocks must be 0 exactly; wrong shapes are errors.
    #[test]
    fn the_oracles_lists_and_spreads_pass() {
        let c = case(7);
        let (lists, spreads) = oracle_answer(&c, &config(2.0));
        let v = verify_covariance_selection(&c, &config(2.0), lists.view(), spreads.view()).unwrap();
        assert!(v.passed() && v.spread_ratio == 0.0, "{v:?}");
        assert_eq!(v.selection.rows, 2 * 2 * 6);
        assert!(v.selection.decided > v.selection.rows / 2, "{v:?}");
        let (_, truth) = oracle_truth(&c, &config(2.0)).unwrap();
        let capped = truth
            .bounds
            .indexed_iter()
            .filter(|&((s, kv, b), &bound)| bound >= 0.5 * truth.spreads[[s, kv, b]].max(f64::MIN_POSITIVE))
            .count();
        assert!(truth.bounds.iter().all(|&x| x > 0.0) && capped < truth.bounds.len() / 4, "{:?}", truth.bounds);

        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 21, 30, 35, 35], cu_seqlens_k: vec![0, 30, 38, 38, 45] },
            ..AttentionSpec::dense(1, 2, 1, 1, 1, 8, 8).with_mask(Mask::None)
        };
        let c = make_case::<bf16>(&spec, profile(), 5);
        let (lists, spreads) = oracle_answer(&c, &config(1.0));
        let v = verify_covariance_selection(&c, &config(1.0), lists.view(), spreads.view()).unwrap();
        assert!(v.passed(), "{v:?}");
        let mut past = spreads.clone();
        past[[1, 0, 5]] = 1e-300;
        let v = verify_covariance_selection(&c, &config(1.0), lists.view(), past.view()).unwrap();
        assert!(v.spread_ratio == f64::INFINITY && v.spread_worst.starts_with("spread [1, 0, 5]"), "{v:?}");
        let narrow = spreads.slice_axis(Axis(2), (0..2).into()).to_owned();
        assert!(matches!(
            verify_covariance_selection(&c, &config(1.0), lists.view(), narrow.view()),
            Err(HarnessError::CandidateShape { argument: "spreads", .. })
        ));
    }

    /// A spread moved by four times its bound fails, named at its block; moved by half its bound it passes.
    #[test]
    fn a_spread_moved_beyond_its_bound_fails_at_that_block() {
        let c = case(8);
        let (lists, spreads) = oracle_answer(&c, &config(2.0));
        let (_, truth) = oracle_truth(&c, &config(2.0)).unwrap();
        let bound = truth.bounds[[1, 0, 3]];
        let moved = |factor: f64| {
            let mut s = spreads.clone();
            s[[1, 0, 3]] += factor * bound;
            verify_covariance_selection(&c, &config(2.0), lists.view(), s.view()).unwrap()
        };
        let far = moved(4.0);
        assert!(!far.passed() && far.spread_ratio > 3.9 && far.spread_worst.starts_with("spread [1, 0, 3]"), "{far:?}");
        let near = moved(0.5);
        assert!(near.spread_ratio <= 1.0 && near.spread_worst.starts_with("spread [1, 0, 3]"), "{near:?}");
    }

    /// In every decided row, swapping a chosen, unforced block for the best block left out fails as a decided row; a
    /// wrong list shape is an error.
    #[test]
    fn a_decided_entry_swapped_fails() {
        let c = case(9);
        let cfg = config(2.0);
        let (lists, spreads) = oracle_answer(&c, &cfg);
        let (truth, _) = oracle_truth(&c, &cfg).unwrap();
        let [_, k, v] = c.widened();
        let same = |seq: &attnproof_oracle::Sequence, kv, x, y| {
            same_rows(&c.spec, &k.view(), seq, kv, 4, x, y) && same_rows(&c.spec, &v.view(), seq, kv, 4, x, y)
        };
        let mut swapped_rows = 0;
        for seq in c.spec.sequences() {
            for kv in 0..2 {
                for a in 0..cfg.bsa.query_blocks(&seq) {
                    let end = cfg.bsa.eligible_end(&seq, a, true);
                    let forced = cfg.bsa.forced(end);
                    if near_tied(&truth, (&seq, kv, a), end, &forced, &same) {
                        continue;
                    }
                    let row: Vec<i32> = (0..3).map(|w| lists[[seq.index, kv, a, w]]).collect();
                    let score = |b: usize| truth.scores[[seq.index, kv, a, b]];
                    let Some(&x) = row.iter().find(|&&b| b >= 0 && !forced.contains(&(b as usize))) else { continue };
                    let Some(y) =
                        (0..end).filter(|&b| !row.contains(&(b as i32))).max_by(|&p, &q| score(p).total_cmp(&score(q)))
                    else {
                        continue;
                    };
                    let mut taken: Vec<i32> = row.iter().map(|&b| if b == x { y as i32 } else { b }).collect();
                    taken.sort_by_key(|&b| if b < 0 { i32::MAX } else { b });
                    let mut wrong = lists.clone();
                    for (w, &b) in taken.iter().enumerate() {
                        wrong[[seq.index, kv, a, w]] = b;
                    }
                    let verdict = verify_covariance_selection(&c, &cfg, wrong.view(), spreads.view()).unwrap();
                    let at = format!("sequence {}, KV head {kv}, query block {a}", seq.index);
                    assert!(
                        verdict.selection.failures.len() == 1
                            && verdict.selection.failures[0].starts_with(&at)
                            && verdict.selection.failures[0].ends_with("(decided boundary)"),
                        "{at}: {taken:?} for {row:?}: {verdict:?}"
                    );
                    swapped_rows += 1;
                }
            }
        }
        assert!(swapped_rows >= 4, "{swapped_rows}");
        let narrow = lists.slice_axis(Axis(3), (0..2).into()).to_owned();
        assert!(matches!(
            verify_covariance_selection(&c, &cfg, narrow.view(), spreads.view()),
            Err(HarnessError::CandidateShape { argument: "lists", .. })
        ));
    }

    /// Key blocks 1 and 2 with bitwise equal keys and values tie exactly and must break to the lower index; with the
    /// same keys but other values they do not tie, so a row whose two scores lie within their bounds is near-tied and
    /// either block passes (a tie rule keyed on the keys alone would demand the oracle's pick).
    #[test]
    fn blocks_equal_in_keys_and_values_tie_to_the_lower_index() {
        let spec = AttentionSpec::dense(1, 1, 1, 16, 16, 8, 8).with_mask(Mask::None);
        let mut c = make_case::<bf16>(&spec, profile(), 3);
        let original = c.k.clone();
        // Every query is the same vector w; key blocks 1 and 2 hold the keys w + noise (the same noise, so the same
        // keys), blocks 0 and 3 hold −w; the values of blocks 1 and 2 are equal row by row.
        for i in 0..16 {
            for col in 0..8 {
                let w = c.q[[0, 0, 0, col]];
                c.q[[0, 0, i, col]] = w;
                let noise = original[[0, 0, 4 + i % 4, col]].to_f32() / 8.0;
                let sign = if (4..12).contains(&i) { 1.0 } else { -1.0 };
                c.k[[0, 0, i, col]] = bf16::from_f32(sign * w.to_f32() + noise);
                if (8..12).contains(&i) {
                    c.v[[0, 0, i, col]] = c.v[[0, 0, i - 4, col]];
                }
            }
        }
        let cfg = CovarianceConfig {
            bsa: BsaConfig { q_block: 16, kv_block: 4, top_k: 1, force_first: false, force_local: 0 },
            gamma: 4.0,
        };
        let (lists, spreads) = oracle_answer(&c, &cfg);
        let (truth, _) = oracle_truth(&c, &cfg).unwrap();
        assert_eq!(truth.scores[[0, 0, 0, 1]], truth.scores[[0, 0, 0, 2]]);
        assert_eq!(lists[[0, 0, 0, 0]], 1);
        let v = verify_covariance_selection(&c, &cfg, lists.view(), spreads.view()).unwrap();
        assert!(v.passed() && v.selection.decided == 1, "{v:?}");
        let mut higher = lists.clone();
        higher[[0, 0, 0, 0]] = 2;
        assert!(!verify_covariance_selection(&c, &cfg, higher.view(), spreads.view()).unwrap().passed());
        // One value of block 2 one ulp away, under a small γ: the blocks no longer must tie (equal keys alone do not
        // make equal E24 scores), their scores differ by less than the bounds, so the row is near-tied and either
        // block passes.
        c.v[[0, 0, 8, 0]] = bf16::from_bits(c.v[[0, 0, 8, 0]].to_bits() + 1);
        let cfg = CovarianceConfig { gamma: 1e-8, ..cfg };
        let (truth, _) = oracle_truth(&c, &cfg).unwrap();
        assert_ne!(truth.scores[[0, 0, 0, 1]], truth.scores[[0, 0, 0, 2]]);
        let (lists, spreads) = oracle_answer(&c, &cfg);
        let mut other = lists.clone();
        other[[0, 0, 0, 0]] = 3 - lists[[0, 0, 0, 0]];
        let v = verify_covariance_selection(&c, &cfg, other.view(), spreads.view()).unwrap();
        assert!(v.passed() && v.selection.decided == 0, "{v:?}");
    }

    /// The model on `M = diag(2, 1)` (`A = diag(4, 1)`), with hand-set perturbations `Φ_o = 10⁻¹²`, `Φ_g = 10⁻⁹` in every
    /// entry: `A^j x₀ = (4^j, 1)`, so the growths multiply to `G_j = √((1 + 16^{−j})/2)` (times `(4/λ̄)^j`, within
    /// `10⁻¹⁰` of 1), `σ̄ = 2 + 2·10⁻¹²`, and to first order in `ε_g = 2δ_g/σ̄ + γ_2`,
    /// `η_g = ε_g (1 + Σ_{j=1}^{30} G_j) / G_31`; the exact estimate (MPFR) of the matrix moved by `Φ_g` lies within the
    /// evaluation's deviation, and the bound is the sum of the two deviations.
    #[test]
    fn the_spread_model_on_a_two_by_two_matrix() {
        let m = ndarray::arr2(&[[2.0, 0.0], [0.0, 1.0]]);
        let run = power_iteration(m.view(), E24_POWER_STEPS, PowerStop::AllSteps, ());
        let stagnation = spectral_norm(m.view(), 500, ());
        let (phi_o, phi_g) = (Array2::from_elem((2, 2), 1e-12), Array2::from_elem((2, 2), 1e-9));
        let model = SpreadModel::new(m.view(), &run, stagnation, phi_o.view(), phi_g.view());
        assert_eq!(model.sigma_bar, 2.0 + 2e-12);
        let g = |j: i32| ((1.0 + 16f64.powi(-j)) / 2.0).sqrt();
        assert!((model.growth - g(31)).abs() <= 1e-9, "{}", model.growth);
        assert!((model.powers[1] - g(1)).abs() <= 1e-9 && model.powers[0] == 1.0, "{:?}", model.powers);
        let delta_g = 2e-9 + gamma(2) * (5f64.sqrt() + 2e-12 + 2e-9);
        assert!((model.delta_device - delta_g).abs() <= 1e-15 * delta_g, "{}", model.delta_device);
        let epsilon_g = 2.0 * delta_g / 2.0 + gamma(2);
        let eta_g = epsilon_g * (1.0 + (1..=30).map(g).sum::<f64>()) / g(31);
        let eta = model.eta(model.delta_device);
        // Second-order terms: 30ε ≈ 6·10⁻⁸ relative, and the G_j's factors (4/λ̄)^j and the oracle's drift 10⁻¹⁰.
        assert!((eta - eta_g).abs() <= 1e-6 * eta_g, "{eta} vs {eta_g}");
        // Telescoping pays: with every a_j = 1 the bound would be ((1 + ε)^31 − 1)/R ≈ 31 ε √2.
        assert!(eta < 0.75 * 31.0 * epsilon_g * 2f64.sqrt(), "{eta}");
        let deviation = model.deviation(model.delta_device);
        let by_hand =
            2.0 * (gamma(2) + 2.0 * eta) + delta_g * (1.0 + gamma(2)) + gamma(8) * (2.0 + delta_g) * (1.0 + gamma(2));
        assert!((deviation - by_hand).abs() <= 1e-6 * by_hand, "{deviation} vs {by_hand}");
        assert_eq!(model.bound(), MARGIN * (deviation + model.deviation(model.delta_oracle)));
        // An evaluation on the moved matrix against the exact run on M.
        let moved = &m + &phi_g;
        let s_hat = power_iteration(moved.view(), E24_POWER_STEPS, PowerStop::AllSteps, ()).estimate;
        let exact = {
            let ctx = Precision(256);
            let mp = m.mapv(|x| Mp::new(x, ctx));
            power_iteration(mp.view(), E24_POWER_STEPS, PowerStop::AllSteps, ctx).estimate.to_f64()
        };
        assert!((s_hat - exact).abs() <= deviation, "{s_hat} vs {exact}: {deviation}");
        // Without growth (an oracle run that met a zero vector) the bound is the cap.
        let stopped = SpreadModel { growth: 0.0, ..model };
        assert!(stopped.eta(stopped.delta_device).is_infinite());
        assert!(stopped.bound() > 2.0 && stopped.bound() < 2.0 * (1.0 + 1e-3), "{}", stopped.bound());
    }

    /// The model's closed forms term by term (module docs), on a model built by hand where every term counts: `δ` a
    /// small fraction of `σ̄` (so that `γ₂` is visible against `ε`), an oracle drift that moves `R`, and head dims so
    /// large that `γ_{d+dv+4}` is about 10⁻³. Each form is evaluated here from the documented formula with its own
    /// `γ_n = n u / (1 − n u)`; they agree to 10⁻¹⁴ relative, far inside what a changed sign, operation, power or
    /// head dim moves them (cargo-mutants found the earlier test blind to all of these).
    #[test]
    fn the_spread_models_closed_forms_hold_term_by_term() {
        let (d, dv) = (1usize << 42, 3usize << 40);
        let powers: Vec<f64> = (0..E24_POWER_STEPS - 1).map(|j| 1.0 / (1.0 + j as f64)).collect();
        let (sigma, growth, delta_o, delta_g) = (2.0, 0.9, 1e-6, 1e-4);
        let model = SpreadModel {
            sigma_bar: sigma,
            growth,
            powers: powers.clone(),
            delta_oracle: delta_o,
            delta_device: delta_g,
            d,
            dv,
        };
        let gamma_n = |n: usize| n as f64 * UNIT_ROUNDOFF / (1.0 - n as f64 * UNIT_ROUNDOFF);
        let (g2, gn) = (gamma_n(2), gamma_n(d + dv + 4));
        assert!(gn > 5e-4 && gn < 2e-3, "{gn}");
        let close = |got: f64, want: f64, what: &str| {
            assert!((got - want).abs() <= 1e-14 * want.abs(), "{what}: {got:e} against {want:e}");
        };
        let epsilon = |delta: f64| (1.0 + delta / sigma).powi(2) * (1.0 + g2) - 1.0;
        // (1 + ε)^n − 1 without the cancellation of the subtraction.
        let drift = |delta: f64, steps: i32| (f64::from(steps) * epsilon(delta).ln_1p()).exp_m1();
        let steps = E24_POWER_STEPS as i32;
        close(model.epsilon(delta_g), epsilon(delta_g), "ε");
        close(model.drift(delta_o, E24_POWER_STEPS - 1), drift(delta_o, steps - 1), "drift");
        let r = growth - drift(delta_o, steps - 1);
        let eta = |delta: f64| {
            let e = epsilon(delta);
            let carried: f64 = powers.iter().enumerate().map(|(j, a)| (1.0 + e).powi(steps - 2 - j as i32) * a).sum();
            e * carried / r
        };
        close(model.eta(delta_g), eta(delta_g), "η");
        let cap = |delta: f64| (sigma + delta) * (1.0 + g2) * (1.0 + gn);
        close(model.cap(delta_g), cap(delta_g), "cap");
        // The cap and the deviations are upper limits: evaluated in the formula's order they must not come out even an
        // ulp below it (a factor divided or a `γ` subtracted moves them by ulps only, which `close` cannot see).
        assert!(model.cap(delta_g) >= cap(delta_g) && model.cap(delta_o) >= cap(delta_o), "the cap rounds down");
        let deviation = |delta: f64| {
            let free = sigma * (g2 + 2.0 * eta(delta)) + delta * (1.0 + g2) + gn * (sigma + delta) * (1.0 + g2);
            assert!(free < cap(delta), "the free form must be the smaller here, or it goes unchecked");
            free
        };
        close(model.deviation(delta_g), deviation(delta_g), "deviation (kernel)");
        close(model.deviation(delta_o), deviation(delta_o), "deviation (oracle)");
        let at_least = |delta: f64| model.deviation(delta) >= deviation(delta);
        assert!(at_least(delta_g) && at_least(delta_o), "a deviation rounds down");
        close(model.bound(), MARGIN * (deviation(delta_g) + deviation(delta_o)), "bound");
    }

    /// A simulated kernel (statistics moved by their full `ρ`, alternating in sign; `M̂` by fma chains over the keys
    /// ascending; the power steps in f64) and the oracle both lie within their deviations of the exact estimate (MPFR
    /// on `M*`) at every block, and the verifier passes the simulated spreads, which differ from the oracle's.
    #[test]
    fn a_simulated_kernel_and_the_oracle_lie_within_their_deviations() {
        let c = case(11);
        let cfg = config(2.0);
        let [_, k, v] = c.widened();
        let ctx = Precision(256);
        let mut simulated = Array3::zeros((2, 2, 8));
        let mut differ = 0;
        let truth = spread_truth(&c.spec, (k.view(), v.view()), 4, 8);
        for seq in c.spec.sequences() {
            for kv in 0..2 {
                let (k2, v2) = (c.spec.head_rows(k.view(), &seq, kv, true), c.spec.head_rows(v.view(), &seq, kv, true));
                let stats = tail_statistics(k2, v2, 4, ());
                let rho_h = centred_hbar_rho(&stats, (k2, v2));
                let sign = |i: usize| if i.is_multiple_of(2) { 1.0 } else { -1.0 };
                let h_bar = Array2::from_shape_fn(stats.h_bar.dim(), |(r, col)| {
                    stats.h_bar[[r, col]] + sign(r + col) * rho_h[[r, col]]
                });
                for (b, run) in block_spreads(k2, v2, 4, ()).iter().enumerate() {
                    let rows = b * 4..b * 4 + stats.counts[b];
                    let n = rows.len();
                    let mu: Vec<f64> = (0..8)
                        .map(|r| {
                            let mean_abs = rows.clone().map(|j| k2[[j, r]].abs()).sum::<f64>() / n as f64;
                            stats.means[[b, r]] - sign(r) * f64_sum_rho(n + 1, mean_abs)
                        })
                        .collect();
                    let m_hat = Array2::from_shape_fn((8, 8), |(r, col)| {
                        let sum = rows.clone().fold(0.0, |acc: f64, j| (k2[[j, r]] - mu[r]).mul_add(v2[[j, col]], acc));
                        sum - h_bar[[r, col]]
                    });
                    let s_hat = power_iteration(m_hat.view(), E24_POWER_STEPS, PowerStop::AllSteps, ()).estimate;
                    simulated[[seq.index, kv, b]] = s_hat;
                    differ += usize::from(s_hat != run.estimate);
                    // M* exactly: the oracle's μ and H̄, the keys' and values' sums at 256 bits.
                    let m_star = Array2::from_shape_fn((8, 8), |(r, col)| {
                        let mu_r = Mp::new(stats.means[[b, r]], ctx);
                        let sum = rows.clone().fold(Mp::new(0.0, ctx), |acc, j| {
                            acc + (Mp::new(k2[[j, r]], ctx) - mu_r.clone()) * Mp::new(v2[[j, col]], ctx)
                        });
                        sum - Mp::new(stats.h_bar[[r, col]], ctx)
                    });
                    let exact =
                        power_iteration(m_star.view(), E24_POWER_STEPS, PowerStop::AllSteps, ctx).estimate.to_f64();
                    let block =
                        (k2.slice_axis(Axis(0), Slice::from(rows.clone())), v2.slice_axis(Axis(0), Slice::from(rows)));
                    let (phi_o, phi_g) =
                        block_perturbations(block, stats.means.row(b), stats.h_bar.view(), rho_h.view());
                    let m_oracle = &stats.h[b] - &stats.h_bar;
                    let model =
                        SpreadModel::new(m_oracle.view(), run, stats.heterogeneity[b], phi_o.view(), phi_g.view());
                    let at = format!("[{}, {kv}, {b}]", seq.index);
                    assert!(model.eta(model.delta_device).is_finite(), "{at}: {model:?}");
                    // The verifier's truth holds this block's estimate and the bound of the model built here from the
                    // block's own rows, bit for bit.
                    let got = (truth.spreads[[seq.index, kv, b]], truth.bounds[[seq.index, kv, b]]);
                    assert_eq!(got, (run.estimate, model.bound()), "{at}: spread_truth");
                    assert!((run.estimate - exact).abs() <= model.deviation(model.delta_oracle), "{at}: oracle");
                    assert!((s_hat - exact).abs() <= model.deviation(model.delta_device), "{at}: kernel");
                }
            }
        }
        assert!(differ > 0);
        let (lists, _) = oracle_answer(&c, &cfg);
        let v = verify_covariance_selection(&c, &cfg, lists.view(), simulated.view()).unwrap();
        assert!(v.passed() && v.spread_ratio > 0.0, "{v:?}");
    }
}
