//! The rounding-error bounds of DSA's indexer loss on the GPU (E16's KL on the selected tokens and its gradients,
//! `gpu/kernels/dsa_loss.cu`): how far each f32 output can lie from the exact value of the same inputs. The verifier
//! (`attnproof_harness::dsa_loss`) evaluates them in f64 from exact quantities and holds every output to them.
//!
//! # The recipe
//!
//! Token `t`'s list has `n` slots `s`. With `u = 2^-24`, `γ32(m) = mu/(1 − mu)` and the kernel's library functions
//! within their documented accuracy (`expf` 2 ulp, so a relative [`EXP_RELATIVE`] `= 4u` and, in the subnormal range,
//! an absolute [`UNDERFLOW`]; `logf` 1 ulp, an absolute `2u|log x|`):
//! 1. The student `Î_s`: the indexer's score recipe, within `E_s` = `dsa_bound::indexer_score_bound`.
//! 2. The teacher `τ̂_s = Σ_h expf(fma(ẑ_h, α, −lse_h))` over the `H` heads, `ẑ_h` a tensor-core logit within
//!    `e_h = γ_tc(d_pad) Σ_c |q_hc k_c|`. The exponent's error is `δx_h = |α| e_h + u(|x_h| + |α| e_h)`
//!    ([`teacher_exponent_error`]), each exponential is then within a relative `e^{δx_h}(1 + 4u) − 1` plus
//!    [`UNDERFLOW`], and the `H`-term sum (any tree) adds `γ32(H)`: [`teacher_entry_error`].
//! 3. The row ([`loss_row_bounds`]): the mass `M̂ = Σ τ̂_s` (n terms, any tree), `τ̂'_s = τ̂_s / M̂` (one rounding);
//!    `m̂ = max Î`, `Ẑ = Σ expf(Î_s − m̂)`, `lse = m̂ + logf(Ẑ)`; `KL = Σ_{τ̂'>0} τ̂'((logf τ̂' − Î) + lse)`; and
//!    (the gradient kernel) `σ̂_s = expf(Î_s − lse)`, `∂̂_s = σ̂_s − τ̂'_s`.
//! 4. The gradients ([`gated_sum_bound`], [`relu_sum_bound`]): `gate = fl(∂̂_s w_a)` where `l̂_as > 0`, then f32
//!    fused multiply-adds into one accumulator per output, `A` additions deep (the kernel's header: `n` for `∂q^I`
//!    and `∂w`, `H_I` plus the number of lists naming the key for `∂k^I`, whose atomics add per-token partials).
//!
//! # The bounds
//!
//! Each step's error is propagated through exact first-order-free expressions (exponentials of the argument errors,
//! quotients by `M − a_M`), evaluated in f64 from the exact values and the previous steps' bounds:
//! - mass: `a_M = Σ a_s + γ32(n) Σ (τ_s + a_s)`, with `a_s` the teacher entries' bounds; requires `a_M < M`;
//! - renormalized teacher: `b'_s = (a_s + τ'_s a_M + u(τ_s + a_s)) / (M − a_M) + UNDERFLOW` (the quotient's
//!   rounding, absolute in the subnormal range);
//! - student LSE: with `E = max E_s` and `g = max_s (m − I_s) + 2E` bounding every `|Î_s − m̂|`, the sum's relative
//!   error is `ρ_Z = e^{ug}(1 + 4u)(1 + γ32(n)) − 1 + n·UNDERFLOW` (`Z(Î) ≥ 1`: its largest term is `e^0`), so
//!   `|log Ẑ − log Z(Î)| ≤ λ = −log(1 − ρ_Z)`, `logf` adds `2u(log n + λ)`, `lse(Î)` is within `E` of the exact LSE
//!   `L` (the LSE is 1-Lipschitz in the max-norm), and the final addition `u(|L| + e)`: `e_lse`;
//! - `σ`: the argument `Î_s − lse` is within `δ = E_s + e_lse` of `I_s − L`, its subtraction adds `u(|I_s − L| + δ)`,
//!   so `|σ̂_s − σ_s| ≤ σ_s(e^{δσ}(1 + 4u) − 1) + UNDERFLOW`;
//! - `∂_s = σ_s − τ'_s`: `ε_s = b_σ + b'_s + u(|∂_s| + b_σ + b'_s)`;
//! - KL: per term `y_s = log τ'_s − I_s + L`, the computed `ŷ_s` is within `δy_s` (the `logf` of a value within
//!   `b'_s` of `τ'_s`, `E_s`, `e_lse`, and the two additions' roundings), the product adds `u`, and the `n`-term sum
//!   `γ32(n)` of the terms' magnitudes, plus `n · UNDERFLOW` for products rounded in the subnormal range. A slot whose teacher bound reaches half its value (an underflowing teacher)
//!   takes the crude bound `|τ̂' ŷ| + |τ' y|` with `|log τ̂'| ≤ 104` (`τ̂' ≥ 2^-149` when it is not 0);
//! - a gated term `∂_s w_a [l_as > 0] v` of `∂q^I` (`v = k^I_sc`) or `∂k^I` (`v = q^I_ac`): the kernel's gate tests
//!   its logit, within `e_l,as = γ_tc(d_I) Σ_c |q_ac k_sc|` of `l_as`, so the gate is certainly open when
//!   `l_as − e_l > 0` and certainly closed when `l_as + e_l ≤ 0` (a logit of exactly 0 with `e_l = 0`, every product
//!   0, is computed as 0 and closes the gate as the exact one does); a certain closed gate contributes nothing, a certain open
//!   one `(ε_s|w_a| + u(|∂_s| + ε_s)|w_a|)|v|`, an uncertain one its whole magnitude `(|∂_s| + ε_s)|w_a|(1 + u)|v|`;
//!   the sum adds `γ32(A)` of the magnitudes;
//! - a ReLU term `∂_s ReLU(l_as)` of `∂w_a`: `ε_s(R_as + e_l) + |∂_s| e_l` (the ReLU is 1-Lipschitz), and `γ32(A)`
//!   of `(|∂_s| + ε_s)(R_as + e_l)`.
//!
//! Hypotheses: every value the kernel forms lies in f32's range (no overflow; underflow only where [`UNDERFLOW`]
//! covers it), and `a_M < M` (a teacher far above its own rounding). The tests below emulate the row stage in f32
//! with every summation order drawn at random and the library functions at their worst accuracy, and check each
//! output against its bound; a kernel that skips the renormalization or the LSE's maximum breaks them.

use crate::flash_bound::{F32_UNIT_ROUNDOFF as U, gamma32};

/// Relative error of CUDA's `expf` (2 ulp: at most `2 · 2u` of the value).
pub const EXP_RELATIVE: f64 = 4.0 * U;
/// Absolute error of an `expf` result in the subnormal range (2 ulp of `2^-149`, with room).
pub const UNDERFLOW: f64 = 1.0 / (1u64 << 63) as f64 / (1u64 << 63) as f64 / (1u64 << 20) as f64;
/// Relative error of CUDA's `logf` result (1 ulp).
pub const LOG_RELATIVE: f64 = 2.0 * U;

/// `δx`: the error of the teacher's exponent `x = α z − lse`, computed as `fma(ẑ, α, −lse)` from a tensor-core logit
/// `ẑ` within `logit_error` of `z` (`α` and `lse` are the kernel's f32 inputs, exact).
pub fn teacher_exponent_error(scale: f64, logit: f64, lse: f64, logit_error: f64) -> f64 {
    let shifted = scale.abs() * logit_error;
    shifted + U * ((scale * logit - lse).abs() + shifted)
}

/// The bound on `|τ̂_s − τ_s|` for a teacher entry `τ_s = Σ_h e^{x_h}` of `n_heads` terms whose exponents' errors are
/// at most `max_exponent_error` ([`teacher_exponent_error`]).
pub fn teacher_entry_error(exact: f64, max_exponent_error: f64, n_heads: usize) -> f64 {
    let per_term = max_exponent_error.exp() * (1.0 + EXP_RELATIVE) - 1.0;
    let gamma = gamma32(n_heads);
    exact * ((1.0 + per_term) * (1.0 + gamma) - 1.0) + n_heads as f64 * UNDERFLOW * (1.0 + gamma)
}

/// One slot of a row, in exact values: the student score and its bound, the (unnormalized) teacher and its bound.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlotExact {
    /// `I_ts`.
    pub score: f64,
    /// `E_s`: the bound on `|Î_ts − I_ts|`.
    pub score_error: f64,
    /// `τ_ts = Σ_h e^{α z − lse}`.
    pub teacher: f64,
    /// `a_s`: the bound on `|τ̂_ts − τ_ts|` ([`teacher_entry_error`]).
    pub teacher_error: f64,
}

/// A row's exact derived values (what the bounds are about) and their bounds.
#[derive(Clone, Debug, PartialEq)]
pub struct RowBounds {
    /// `τ'_s` per slot, exact.
    pub teacher: Vec<f64>,
    /// The bound on `|τ̂'_s − τ'_s|`.
    pub teacher_error: Vec<f64>,
    /// `L = log Σ e^{I_s}`, exact.
    pub lse: f64,
    /// The bound on the kernel's student LSE.
    pub lse_error: f64,
    /// `KL_t`, exact.
    pub kl: f64,
    /// The bound on the kernel's `KL_t`.
    pub kl_error: f64,
    /// `∂_s = σ_s − τ'_s`, exact.
    pub d_score: Vec<f64>,
    /// `ε_s`: the bound on the kernel's `∂̂_s`.
    pub d_score_error: Vec<f64>,
}

/// The bounds of one row (module docs), or `None` for a row the kernel treats as without target: an empty list, or
/// no teacher mass. Returns `Some` with infinite bounds where the hypothesis `a_M < M` fails.
pub fn loss_row_bounds(slots: &[SlotExact]) -> Option<RowBounds> {
    let n = slots.len();
    let mass: f64 = slots.iter().map(|s| s.teacher).sum();
    if n == 0 || mass <= 0.0 {
        return None;
    }
    let gamma_n = gamma32(n);
    let mass_error = slots.iter().map(|s| s.teacher_error).sum::<f64>()
        + gamma_n * slots.iter().map(|s| s.teacher + s.teacher_error).sum::<f64>();
    let denominator = mass - mass_error;
    let teacher: Vec<f64> = slots.iter().map(|s| s.teacher / mass).collect();
    let teacher_error: Vec<f64> = slots
        .iter()
        .zip(&teacher)
        .map(|(s, tau)| {
            if denominator <= 0.0 {
                f64::INFINITY
            } else {
                // The quotient's rounding: relative, or absolute in the subnormal range.
                (s.teacher_error + tau * mass_error + U * (s.teacher + s.teacher_error)) / denominator + UNDERFLOW
            }
        })
        .collect();
    // The student's LSE.
    let top = slots.iter().map(|s| s.score).fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = slots.iter().map(|s| (s.score - top).exp()).sum();
    let lse = top + sum.ln();
    let worst_score = slots.iter().map(|s| s.score_error).fold(0.0, f64::max);
    let gap = slots.iter().map(|s| top - s.score).fold(0.0, f64::max) + 2.0 * worst_score;
    let rho_z = (U * gap).exp() * (1.0 + EXP_RELATIVE) * (1.0 + gamma_n) - 1.0 + n as f64 * UNDERFLOW;
    let lambda = -(1.0 - rho_z).ln();
    let before_add = worst_score + lambda + LOG_RELATIVE * ((n as f64).ln() + lambda);
    let lse_error = before_add + U * (lse.abs() + before_add);
    // σ and ∂ = σ − τ'.
    let mut d_score = Vec::with_capacity(n);
    let mut d_score_error = Vec::with_capacity(n);
    for ((s, tau), b_tau) in slots.iter().zip(&teacher).zip(&teacher_error) {
        let sigma = (s.score - lse).exp();
        let delta = s.score_error + lse_error;
        let delta_sigma = delta + U * ((s.score - lse).abs() + delta);
        let b_sigma = sigma * (delta_sigma.exp() * (1.0 + EXP_RELATIVE) - 1.0) + UNDERFLOW;
        let d = sigma - tau;
        d_score.push(d);
        d_score_error.push(b_sigma + b_tau + U * (d.abs() + b_sigma + b_tau));
    }
    // KL.
    let mut kl = 0.0;
    let mut kl_error = 0.0;
    let mut magnitudes = 0.0;
    for ((s, &tau), &b_tau) in slots.iter().zip(&teacher).zip(&teacher_error) {
        let y = if tau > 0.0 { tau.ln() - s.score + lse } else { 0.0 };
        if tau > 0.0 {
            kl += tau * y;
        }
        // An infinite bound (a failed hypothesis) takes this branch too.
        if b_tau.is_nan() || b_tau >= tau / 2.0 {
            // An underflowing teacher: the computed term and the exact one, each bounded on its own.
            let hi = tau + b_tau;
            let computed = hi * (104.0 + s.score.abs() + s.score_error + lse.abs() + lse_error) * (1.0 + 3.0 * U);
            let exact = if tau > 0.0 { (tau * y).abs() } else { 0.0 };
            kl_error += computed + exact;
            magnitudes += computed;
            continue;
        }
        let log_tau = tau.ln().abs();
        let lambda0 = -(1.0 - b_tau / tau).ln();
        let lambda = lambda0 + LOG_RELATIVE * (log_tau + lambda0);
        let first = lambda + s.score_error + U * (log_tau + s.score.abs() + lambda + s.score_error);
        let delta_y = first + lse_error + U * (y.abs() + first + lse_error);
        let term = b_tau * (y.abs() + delta_y) + tau * delta_y + U * (tau + b_tau) * (y.abs() + delta_y);
        kl_error += term;
        magnitudes += (tau + b_tau) * (y.abs() + delta_y) * (1.0 + U);
    }
    // Each product may round in the subnormal range, absolutely.
    kl_error += gamma_n * magnitudes + n as f64 * UNDERFLOW;
    Some(RowBounds { teacher, teacher_error, lse, lse_error, kl, kl_error, d_score, d_score_error })
}

/// One term `∂_s · w_a · [l > 0] · v` of a gated gradient sum, in exact values with the bounds of `∂_s` and `l`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GatedTerm {
    /// `∂_s = σ_s − τ'_s`.
    pub d_score: f64,
    /// `ε_s`.
    pub d_score_error: f64,
    /// `w_a`.
    pub weight: f64,
    /// The exact logit `l_as`.
    pub logit: f64,
    /// `e_l`: the bound on the kernel's logit.
    pub logit_error: f64,
    /// The multiplied input (`k^I_sc` or `q^I_ac`).
    pub value: f64,
}

/// The bound on a gated sum `Σ ∂_s w_a [l > 0] v` whose kernel accumulator is `additions` deep (module docs).
pub fn gated_sum_bound(terms: impl IntoIterator<Item = GatedTerm>, additions: usize) -> f64 {
    let mut error = 0.0;
    let mut magnitude = 0.0;
    for t in terms {
        if t.logit + t.logit_error <= 0.0 {
            continue;
        }
        let reach = (t.d_score.abs() + t.d_score_error) * t.weight.abs() * t.value.abs();
        magnitude += reach * (1.0 + U);
        error += if t.logit - t.logit_error <= 0.0 {
            reach * (1.0 + U)
        } else {
            (t.d_score_error + U * (t.d_score.abs() + t.d_score_error)) * t.weight.abs() * t.value.abs()
        };
    }
    error + gamma32(additions) * magnitude
}

/// The bound on `Σ_s ∂_s ReLU(l_s)` (`∂w_a`) from `(∂_s, ε_s, l_s, e_l)` terms with an accumulator `additions` deep.
pub fn relu_sum_bound(terms: impl IntoIterator<Item = (f64, f64, f64, f64)>, additions: usize) -> f64 {
    let mut error = 0.0;
    let mut magnitude = 0.0;
    for (d, eps, logit, logit_error) in terms {
        let relu = logit.max(0.0) + logit_error;
        if logit < -logit_error {
            continue;
        }
        error += eps * relu + d.abs() * logit_error;
        magnitude += (d.abs() + eps) * relu;
    }
    error + gamma32(additions) * magnitude
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::RngExt;
    use proptest::test_runner::{RngAlgorithm, TestRng};

    /// The f32 value `ulps` units in the last place away from `x` (the library functions at their worst).
    fn nudge(x: f32, ulps: i32) -> f32 {
        let mut y = x;
        for _ in 0..ulps.abs() {
            y = if ulps > 0 { y.next_up() } else { y.next_down() };
        }
        y
    }

    /// A sum of f32 terms in an order drawn at random (a random binary tree).
    fn random_tree_sum(rng: &mut TestRng, mut terms: Vec<f32>) -> f32 {
        if terms.is_empty() {
            return 0.0;
        }
        while terms.len() > 1 {
            let i = rng.random_range(0..terms.len());
            let a = terms.swap_remove(i);
            let j = rng.random_range(0..terms.len());
            terms[j] += a;
        }
        terms[0]
    }

    /// How the emulated kernel deviates from the recipe, to show that the bounds can fail.
    #[derive(Clone, Copy, PartialEq)]
    enum Emulation {
        Recipe,
        NoRenormalization,
        NoMaximum,
    }

    struct Emulated {
        teacher: Vec<f32>,
        lse: f32,
        kl: f32,
        d_score: Vec<f32>,
    }

    /// The row stage of `dsa_loss_rows` and the `∂` of `dsa_loss_grad` in f32, from perturbed inputs within their
    /// bounds, with random summation orders and `expf`/`logf` nudged by up to 2 and 1 ulp.
    fn emulate(rng: &mut TestRng, slots: &[SlotExact], how: Emulation) -> Emulated {
        // Each input at one end of its interval (the sign drawn): the errors the bounds must absorb at their largest.
        let mut perturb = |x: f64, e: f64| at_an_end(rng, x, e);
        let scores: Vec<f32> = slots.iter().map(|s| perturb(s.score, s.score_error)).collect();
        let raw: Vec<f32> = slots.iter().map(|s| perturb(s.teacher, s.teacher_error).max(0.0)).collect();
        let mass = random_tree_sum(rng, raw.clone());
        let teacher: Vec<f32> =
            raw.iter().map(|&t| if how == Emulation::NoRenormalization { t } else { t / mass }).collect();
        let top =
            if how == Emulation::NoMaximum { 0.0 } else { scores.iter().copied().fold(f32::NEG_INFINITY, f32::max) };
        let exps: Vec<f32> = scores.iter().map(|&s| nudge((s - top).exp(), rng.random_range(-2..=2))).collect();
        let z = random_tree_sum(rng, exps);
        let lse = top + nudge(z.ln(), rng.random_range(-1..=1));
        let terms: Vec<f32> = teacher
            .iter()
            .zip(&scores)
            .filter(|(t, _)| **t > 0.0)
            .map(|(&t, &s)| t * ((nudge(t.ln(), rng.random_range(-1..=1)) - s) + lse))
            .collect();
        let kl = random_tree_sum(rng, terms);
        let d_score =
            scores.iter().zip(&teacher).map(|(&s, &t)| nudge((s - lse).exp(), rng.random_range(-2..=2)) - t).collect();
        Emulated { teacher, lse, kl, d_score }
    }

    /// A row of `n` slots: scores of spread `spread`, teachers `e^{x}` with `x` spread by `teacher_spread` (the
    /// sparse stage's mass H, or a dense LSE's smaller one), bounds of the GPU's size on both.
    fn draw_row(rng: &mut TestRng, n: usize, spread: f64, teacher_spread: f64) -> Vec<SlotExact> {
        (0..n)
            .map(|_| {
                let score = spread * rng.random_range(-1.0..=1.0);
                let teacher = (teacher_spread * rng.random_range(-1.0..=0.0f64)).exp() * 8.0;
                let score_error = 3e-6 * (1.0 + score.abs());
                let teacher_error = teacher_entry_error(teacher, 2e-5, 64);
                SlotExact { score, score_error, teacher, teacher_error }
            })
            .collect()
    }

    /// The worst ratio error / bound of each output kind of one emulation: teacher, LSE, KL, `∂`.
    fn ratios(slots: &[SlotExact], bounds: &RowBounds, e: &Emulated) -> [f64; 4] {
        let mut worst = [0.0f64; 4];
        worst[1] = (e.lse as f64 - bounds.lse).abs() / bounds.lse_error;
        worst[2] = (e.kl as f64 - bounds.kl).abs() / bounds.kl_error;
        for s in 0..slots.len() {
            worst[0] = worst[0].max((e.teacher[s] as f64 - bounds.teacher[s]).abs() / bounds.teacher_error[s]);
            worst[3] = worst[3].max((e.d_score[s] as f64 - bounds.d_score[s]).abs() / bounds.d_score_error[s]);
        }
        worst
    }

    fn worst_ratio(slots: &[SlotExact], bounds: &RowBounds, e: &Emulated) -> f64 {
        ratios(slots, bounds, e).into_iter().fold(0.0, f64::max)
    }

    #[test]
    fn emulated_rows_stay_within_their_bounds() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[21; 32]);
        let mut largest = [0.0f64; 4];
        for case in 0..480 {
            let n = [1, 2, 63, 64, 65, 300, 2048][case % 7];
            let spread = [0.5, 8.0, 40.0][case % 3];
            // 120: teachers of e^-120 underflow f32 and take the KL's crude bound.
            let teacher_spread = [1.0, 20.0, 80.0, 120.0][(case / 3) % 4];
            let slots = draw_row(&mut rng, n, spread, teacher_spread);
            let bounds = loss_row_bounds(&slots).expect("a row with mass");
            let e = emulate(&mut rng, &slots, Emulation::Recipe);
            let ratio = ratios(&slots, &bounds, &e);
            for (kind, r) in ratio.iter().enumerate() {
                assert!(
                    *r <= 1.0,
                    "case {case} (n {n}, spread {spread}, teacher {teacher_spread}): output {kind} ratio {r}"
                );
                largest[kind] = largest[kind].max(*r);
            }
        }
        // The bounds are not vacuous: with every input at an end of its interval, each kind of output comes within a
        // factor of two of its bound (the teacher and the LSE within a few percent).
        assert!(largest.iter().all(|&r| r > 0.5), "largest ratios (teacher, LSE, KL, ∂) {largest:?}");
    }

    /// One f32 value at an end of `x ± e` (the sign drawn), stepped back inside where rounding took it outside.
    fn at_an_end(rng: &mut TestRng, x: f64, e: f64) -> f32 {
        let up = rng.random_bool(0.5);
        let y = (if up { x + e } else { x - e }) as f32;
        match (f64::from(y) - x).abs() > e {
            true if up => y.next_down(),
            true => y.next_up(),
            false => y,
        }
    }

    /// The teacher's entry as `dsa_loss_rows` forms it: each head's logit at an end of its bound, `fma(ẑ, α, −lse)` in
    /// f32, `expf` nudged by up to 2 ulp, the heads summed in a random tree.
    #[test]
    fn emulated_teacher_entries_stay_within_their_bounds() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[24; 32]);
        let mut largest: f64 = 0.0;
        for case in 0..300 {
            let n_heads = [1, 3, 16, 64, 128][case % 5];
            let scale = f64::from([0.125f32, 0.088, 1.0][case % 3]);
            let mut exact = 0.0;
            let mut worst_exponent: f64 = 0.0;
            let mut terms = Vec::with_capacity(n_heads);
            for _ in 0..n_heads {
                let logit = rng.random_range(-40.0..40.0);
                // The tensor core's bound for a head dim of 128 and products of magnitude 1.
                let logit_error = 128.0 * 2.0 * U * 136.0 / 128.0 * rng.random_range(1.0..64.0);
                let lse = f64::from(rng.random_range(-10.0f32..60.0));
                exact += (scale * logit - lse).exp();
                worst_exponent = worst_exponent.max(teacher_exponent_error(scale, logit, lse, logit_error));
                let z = at_an_end(&mut rng, logit, logit_error);
                let x = z.mul_add(scale as f32, -(lse as f32));
                terms.push(nudge(x.exp(), rng.random_range(-2..=2)));
            }
            let computed = random_tree_sum(&mut rng, terms);
            let bound = teacher_entry_error(exact, worst_exponent, n_heads);
            let ratio = (f64::from(computed) - exact).abs() / bound;
            assert!(ratio <= 1.0, "case {case} ({n_heads} heads, α {scale}): ratio {ratio}");
            largest = largest.max(ratio);
        }
        assert!(largest > 0.5, "largest ratio {largest}");
    }

    #[test]
    fn emulated_gradient_sums_stay_within_their_bounds() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[23; 32]);
        let mut largest = [0.0f64; 2];
        for case in 0..300 {
            let n = [1, 5, 64, 300][case % 4];
            let scale = [1e-3, 1.0][case % 2];
            let terms: Vec<GatedTerm> = (0..n)
                .map(|_| {
                    let d_score = scale * rng.random_range(-1.0..1.0);
                    let logit_error = 1e-3;
                    // A third of the logits lie within their bound of 0: gates the rounding may flip.
                    let logit =
                        if rng.random_bool(0.33) { rng.random_range(-1e-3..1e-3) } else { rng.random_range(-2.0..2.0) };
                    GatedTerm {
                        d_score,
                        d_score_error: d_score.abs() * 1e-3 + 1e-7 * scale,
                        weight: f64::from(rng.random_range(-2.0f32..2.0)),
                        logit,
                        logit_error,
                        value: f64::from(rng.random_range(-3.0f32..3.0)),
                    }
                })
                .collect();
            // The kernel: the gate from the computed logit, fl(∂̂ w), fused multiply-adds in some order.
            let mut order: Vec<usize> = (0..n).collect();
            for i in 0..n {
                let j = rng.random_range(i..n);
                order.swap(i, j);
            }
            let (mut gated, mut relu) = (0f32, 0f32);
            for &i in &order {
                let t = terms[i];
                let d = at_an_end(&mut rng, t.d_score, t.d_score_error);
                let l = at_an_end(&mut rng, t.logit, t.logit_error);
                if l > 0.0 {
                    gated = (d * t.weight as f32).mul_add(t.value as f32, gated);
                    relu = d.mul_add(l, relu);
                }
            }
            let exact_gated: f64 = terms.iter().filter(|t| t.logit > 0.0).map(|t| t.d_score * t.weight * t.value).sum();
            let exact_relu: f64 = terms.iter().map(|t| t.d_score * t.logit.max(0.0)).sum();
            let relu_terms = terms.iter().map(|t| (t.d_score, t.d_score_error, t.logit, t.logit_error));
            // A sum of closed gates only is exactly 0 with a bound of 0.
            let ratio_of = |error: f64, bound: f64| if error == 0.0 { 0.0 } else { error / bound };
            let ratio = [
                ratio_of((f64::from(gated) - exact_gated).abs(), gated_sum_bound(terms.iter().copied(), n)),
                ratio_of((f64::from(relu) - exact_relu).abs(), relu_sum_bound(relu_terms, n)),
            ];
            for (kind, r) in ratio.iter().enumerate() {
                assert!(*r <= 1.0, "case {case} (n {n}): sum {kind} ratio {r}");
                largest[kind] = largest[kind].max(*r);
            }
        }
        assert!(largest.iter().all(|&r| r > 0.5), "largest ratios (gated, ReLU) {largest:?}");
    }

    #[test]
    fn broken_row_stages_break_the_bounds() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[22; 32]);
        // Without the maximum, f32's exponential overflows once a score passes about 88.
        for (how, spread) in [(Emulation::NoRenormalization, 40.0), (Emulation::NoMaximum, 100.0)] {
            let slots = draw_row(&mut rng, 65, spread, 1.0);
            let bounds = loss_row_bounds(&slots).expect("a row with mass");
            let e = emulate(&mut rng, &slots, how);
            let ratio = worst_ratio(&slots, &bounds, &e);
            assert!(ratio > 1.0 || !ratio.is_finite(), "a broken stage stayed within the bounds: {ratio}");
        }
    }

    #[test]
    fn rows_without_target_have_no_bounds() {
        assert_eq!(loss_row_bounds(&[]), None);
        let empty = SlotExact { score: 1.0, score_error: 0.0, teacher: 0.0, teacher_error: 0.0 };
        assert_eq!(loss_row_bounds(&[empty, empty]), None);
    }

    /// The gated bound is the module docs' formula term by term: a certain open gate costs `(ε + u(|∂| + ε))|w||v|`,
    /// an uncertain one its reach `(|∂| + ε)|w|(1 + u)|v|`, and the sum adds `γ32(A)` of the reaches; its `u`-level
    /// terms sit far below what the f32 emulations can tell apart, so only an exact comparison pins them.
    #[test]
    fn the_gated_bound_is_the_derived_formula_term_by_term() {
        let term = |logit: f64| GatedTerm {
            d_score: 0.5,
            d_score_error: 1e-6,
            weight: -2.0,
            logit,
            logit_error: 1e-3,
            value: 3.0,
        };
        let reach = (0.5 + 1e-6) * 2.0 * 3.0 * (1.0 + U);
        let open = (1e-6 + U * (0.5 + 1e-6)) * 2.0 * 3.0;
        let close = |got: f64, want: f64| assert!((got / want - 1.0).abs() < 1e-14, "{got:e} against {want:e}");
        close(gated_sum_bound([term(1.0)], 5), open + gamma32(5) * reach);
        close(gated_sum_bound([term(0.0)], 5), reach + gamma32(5) * reach);
        close(gated_sum_bound([term(1.0), term(0.0), term(-1.0)], 7), open + reach + gamma32(7) * 2.0 * reach);
    }

    #[test]
    fn gates_cost_their_whole_term_only_when_uncertain() {
        let term = |logit: f64| GatedTerm {
            d_score: 0.5,
            d_score_error: 1e-6,
            weight: 2.0,
            logit,
            logit_error: 1e-3,
            value: 3.0,
        };
        let open = gated_sum_bound([term(1.0)], 1);
        let uncertain = gated_sum_bound([term(5e-4)], 1);
        let closed = gated_sum_bound([term(-1.0)], 1);
        assert_eq!(closed, 0.0);
        // A logit of exactly 0: uncertain while it has an error bound, certainly closed without one (every product
        // was 0, so the kernel computes 0 too); at the bound's ends the gate is closed or uncertain as the kernel's
        // test `l̂ > 0` decides.
        assert!(gated_sum_bound([term(0.0)], 1) > 2.9);
        assert_eq!(gated_sum_bound([GatedTerm { logit_error: 0.0, ..term(0.0) }], 1), 0.0);
        assert_eq!(gated_sum_bound([term(-1e-3)], 1), 0.0);
        assert!(gated_sum_bound([term(1e-3)], 1) > 2.9);
        assert!(uncertain > 2.9 && uncertain < 3.1, "the whole term: {uncertain}");
        assert!(open < 1e-4 && open > 0.0, "the rounding of one term: {open}");
        // An f32 sum of many terms adds γ32 of their magnitudes.
        assert!(gated_sum_bound(vec![term(1.0); 100], 100) > 100.0 * open);
        let relu = relu_sum_bound([(0.5, 1e-6, 1.0, 1e-3)], 1);
        assert!(relu > 0.5 * 1e-3 && relu < 1e-3, "{relu}");
        assert_eq!(relu_sum_bound([(0.5, 1e-6, -1.0, 1e-3)], 1), 0.0);
    }

    #[test]
    fn the_teacher_entry_bound_scales_with_its_exponent_errors() {
        let small = teacher_entry_error(1.0, 0.0, 64);
        assert!(small > EXP_RELATIVE && small < 1e-5, "{small}");
        assert!(teacher_entry_error(1.0, 1e-3, 64) > 1e-3);
        assert!(teacher_exponent_error(0.125, 10.0, 3.0, 1e-4) > 0.125e-4);
        // 2^-146: above the subnormal unit 2^-149, far below anything a normal value rounds by.
        assert_eq!(UNDERFLOW, 2f64.powi(-146));
    }
}
