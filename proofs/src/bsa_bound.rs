//! The rounding-error bound of a pooled block score of BSA block selection (E15 pooling for E14 lists; the oracle's
//! `bsa` module, the GPU selector `bsa_select.cu`): how far an f64 evaluation of
//! `S_ab = Σ_{h ∈ group} α̂ · q̄_{a,h}·k̄_b` can lie from the exact value, in any summation order. A verifier uses it
//! to tell a top-k boundary that rounding cannot move (the lists must then agree exactly) from a near-tie.
//!
//! # The bound
//!
//! With `u = 2^-53`, `γ(n) = nu/(1 − nu)`, `m` the query block's rows, `n` the key block's keys, `d` the head dim, `G`
//! the group: `|Ŝ − S| ≤ γ(m + n + d + G + 3) · M`, where `M = α Σ_h Σ_c Q_hc K_c`, `Q_hc = mean_i |q_ic|` over the
//! query block (head `h`), `K_c = mean_j |k_jc|` over the key block.
//!
//! Derivation (Higham's lemmas: a sum of `n` terms in any order is off by at most `γ(n − 1)` times the sum of their
//! magnitudes, and `(1 + γ(a))(1 + γ(b)) ≤ 1 + γ(a + b)`):
//! - pooled key `k̂_c = fl(fl(Σ_j k_jc)/n)`: `|k̂_c − k̄_c| ≤ γ(n) K_c` (the sum, then one division); likewise
//!   `|q̂_c − q̄_c| ≤ γ(m) Q_c`, so `|q̂_c k̂_c − q̄_c k̄_c| ≤ γ(m + n) Q_c K_c`;
//! - the dot product over `d` columns, with or without fused multiply-adds, in any order: a further `γ(d)` of
//!   `Σ_c |q̂_c k̂_c| ≤ (1 + γ(m + n)) Σ_c Q_c K_c`, so `γ(m + n + d)` of `Σ_c Q_c K_c` in all;
//! - the scale: `α̂ = α(1 + δ)` and one product, two more factors `(1 + u)`;
//! - the group sum of `G` terms: `γ(G − 1)` of `Σ_h |ŝ_h|`. Summing the group's pooled queries first and taking one
//!   dot product (`α̂ · (Σ_h q̂_h)·k̂`, the GPU kernel's order) costs the same: `γ(G − 1)` of `Σ_h Q_hc` per column,
//!   then the products, the dot product and the scale as above.
//!
//! Together `γ(m + n + d + G + 1)`; the bound takes `+ 3` and a relative margin of `2^-10` so that the f64
//! evaluation of `M` and of `γ` themselves (a few roundings each) cannot make it smaller than the truth. Two
//! evaluations (the oracle's and a kernel's) are within twice the bound of each other.

use crate::f64_oracle_bound::gamma;

/// Relative slack for the bound's own f64 evaluation (`M`, `γ`).
const MARGIN: f64 = 1.0 + 1.0 / 1024.0;

/// The bound on `|Ŝ − S|` for a pooled score of magnitude `magnitude = α Σ_h Σ_c Q_hc K_c` (see the module docs)
/// over a query block of `rows` rows, a key block of `keys` keys, head dim `head_dim` and `group` query heads.
pub fn pooled_score_bound(magnitude: f64, rows: usize, keys: usize, head_dim: usize, group: usize) -> f64 {
    MARGIN * gamma(rows + keys + head_dim + group + 3) * magnitude
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f64_oracle_bound::UNIT_ROUNDOFF;

    /// The bound on a hand-made case where the error is known: `Σ_h q̄·k̄` with `m = n = d = G = 1` is one product and
    /// one scale, exact for these values, and the bound is `γ(7) · M` with margin; its terms grow with every count.
    #[test]
    fn the_bound_is_gamma_of_the_counts_times_the_magnitude() {
        let b = pooled_score_bound(2.0, 1, 1, 1, 1);
        let expected = MARGIN * gamma(7) * 2.0;
        assert_eq!(b, expected);
        assert!(b > 14.0 * UNIT_ROUNDOFF && b < 14.1 * UNIT_ROUNDOFF, "{b:e}");
        for (rows, keys, d, g) in [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)] {
            assert!(pooled_score_bound(2.0, rows, keys, d, g) > b, "({rows}, {keys}, {d}, {g})");
        }
        assert_eq!(pooled_score_bound(0.0, 64, 64, 128, 8), 0.0);
        assert_eq!(pooled_score_bound(4.0, 1, 1, 1, 1), 2.0 * b);
    }

    /// The bound holds on an f64 evaluation in the worst order against an exact (MPFR) value: a block of values that
    /// cancel, summed naively, for a range of sizes.
    #[test]
    fn an_f64_pooled_score_stays_within_the_bound_of_the_exact_one() {
        use rug::Float;
        for n in [1usize, 3, 17, 64, 128] {
            let keys: Vec<f64> = (0..n).map(|j| if j % 2 == 0 { 1.0 + j as f64 * 1e-3 } else { -1.0 / 3.0 }).collect();
            let q = 0.1f64;
            let alpha = 1.0 / 3f64.sqrt();
            let mean = keys.iter().sum::<f64>() / n as f64;
            let computed = alpha * (q * mean);
            let exact_sum = keys.iter().fold(Float::with_val(256, 0), |acc, &x| acc + x);
            let exact_alpha = Float::with_val(256, 3).sqrt().recip();
            let exact = exact_alpha * (Float::with_val(256, q) * (exact_sum / n as f64));
            let error = (Float::with_val(256, computed) - exact).abs().to_f64();
            let magnitude = alpha * q * keys.iter().map(|x| x.abs()).sum::<f64>() / n as f64;
            assert!(error <= pooled_score_bound(magnitude, 1, n, 1, 1), "n = {n}: {error:e}");
        }
    }
}
