//! The rounding-error bound of a DSA lightning-indexer score (E16, `I_ts = Σ_{a=1}^{H_I} w_ta · ReLU(q^I_ta · k^I_s)`)
//! as the GPU indexer computes it: how far its f32 score can lie from the exact score of the same inputs. A verifier
//! uses it to tell a top-k boundary that rounding cannot move (the selections must then agree exactly) from a
//! near-tie.
//!
//! # The recipe
//!
//! The inputs are exact in their storage types: `q` (`[T, H_I, d_I]`) and `k` (`[T, d_I]`) in bf16 or f16, `w`
//! (`[T, H_I]`) in f32. For one query `t`, key `s` and index head `a`, the logit `l_a = q_a · k_s` is a tensor-core
//! dot product (`mma.sync.m16n8k16`, or `wgmma.m64n64k16` on Hopper): the products of two 16-bit floats are exact
//! in f32 (a bf16 significand has 8 bits and an f16 one 11, so a product has at most 16 or 22, within f32's 24), and
//! the tensor core adds them into an f32 accumulator 16 products per instruction (either instruction) over `d_I`
//! (padded with zeros to a multiple of 16). Then
//! `r̂_a = max(l̂_a, 0)`, exactly, and the score is an f32 sum over the `H_I` heads of `w_a · r̂_a`, each product
//! rounded to f32 or fused into a multiply-add, in a fixed but arbitrary tree order, plus one exact addition of
//! `+0.0`.
//!
//! # The bound
//!
//! With `u = 2^-24`, `γ32(n) = nu/(1 − nu)`, `γ_tc(n)` the tensor-core factor of
//! [`Accumulation::TensorCore`] with `k_step = 16` (`γ'(n + ⌈n/16⌉)` with `u' = 2u`: alignment and truncation
//! inside an instruction can double the per-addition error, and each instruction adds the accumulator as one more
//! term), `L_a = Σ_c |q_ac k_c|` and the magnitude `M = Σ_a |w_a| L_a` ([`indexer_score_magnitude`]):
//!
//! `|Î_ts − I_ts| ≤ F · (γ_tc(d_I) + γ32(H_I + 1)) · M`, with `F` = [`SECOND_ORDER_FACTOR`] `= 1 + 2^-3`.
//!
//! Derivation (Higham's lemmas, as in [`crate::flash_bound`]):
//! - the logit: the products are exact, so the only errors are the accumulation's, and
//!   `|l̂_a − l_a| ≤ γ_tc(d_I) L_a` whatever the order of the columns;
//! - the ReLU is 1-Lipschitz, `|max(x, 0) − max(y, 0)| ≤ |x − y|`, so `|r̂_a − r_a| ≤ γ_tc(d_I) L_a`; and
//!   `0 ≤ r̂_a ≤ |l̂_a| ≤ |l_a| + γ_tc(d_I) L_a ≤ (1 + γ_tc(d_I)) L_a`;
//! - the weighted sum: `w_a` and `r̂_a` are f32 values, so `S = Σ_a w_a r̂_a` is what the f32 sum approximates. Its
//!   summation tree has `H_I + 1` leaves (the `H_I` products and the `+0.0`), so a leaf passes through at most `H_I`
//!   additions, plus its product's rounding (with a fused multiply-add the product's rounding is the addition's, one
//!   fewer). Each term carries a relative perturbation of at most `γ32(H_I + 1)` in any tree order, and
//!   `|Î − S| ≤ γ32(H_I + 1) Σ_a |w_a| r̂_a ≤ γ32(H_I + 1)(1 + γ_tc(d_I)) M` (the `+0.0` itself is exact:
//!   `x + 0 = x`);
//! - `|S − I| = |Σ_a w_a (r̂_a − r_a)| ≤ γ_tc(d_I) M`.
//!
//! Together `|Î − I| ≤ (γ_tc + γ32 + γ_tc γ32) M`. The second-order term `γ_tc γ32 M` is at most `2^-5 γ32 M` when
//! `γ_tc(d_I) ≤ 2^-5` (the precondition [`FIRST_ORDER_LIMIT`], asserted in debug builds, as is `γ32(H_I + 1) ≤ 2^-5`),
//! so `F = 1 + 2^-3` covers it four times over. The range holds far beyond the kernel's: `γ_tc` reaches `2^-5`
//! only near `d_I = 2.4 · 10^5`; at `d_I = 256`, `H_I = 64` the factors are `γ_tc(256) ≈ 3.2 · 10^-5` and
//! `γ32(65) ≈ 3.9 · 10^-6`, and the second-order term is about `2^-18` of the first-order ones. The rest of the slack
//! (at least `3 · 2^-5` of the first-order bound, which is at least `γ_tc(16) M ≈ 2^-19 M`) covers the bound's own f64
//! evaluation (`M` has relative error at most `γ64(d_I + H_I)`: the products `q_ac k_c` are exact in f64, then come
//! `d_I − 1` additions, one product with `|w_a|` and `H_I − 1` additions) and the distance from an f64 evaluation of
//! `I_ts` (the oracle's) to the exact value, also at most `γ64(d_I + H_I + 1) M < 2^-44 M` in that range: the bound
//! therefore holds between the kernel's score and the f64 oracle's as well.
//!
//! Hypothesis: no product, partial sum or score leaves f32's normal range. f16 products lie within `[2^-48, 2^32]`
//! and cannot; a bf16 input below about `2^-63` in magnitude could underflow a product, and a tiny weight an f32
//! product, which would need an absolute term the bound does not have (activations of a trained indexer are far from
//! it). A kernel whose tensor cores keep fewer than 24 bits when aligning products breaks the
//! [`Accumulation::TensorCore`] model, not this derivation.

use ndarray::{ArrayView1, ArrayView2};

use crate::flash_bound::{Accumulation, FIRST_ORDER_LIMIT, SECOND_ORDER_FACTOR, gamma32};

/// The tensor-core accumulation of the indexer's logits (`m16n8k16` or `m64n64k16`: 16 products per instruction).
pub const INDEXER_ACCUMULATION: Accumulation = Accumulation::TensorCore { k_step: 16 };

/// `M = Σ_a |w_a| Σ_c |q_ac k_c|`: the magnitude the bound scales, for one query's index queries `q_index`
/// (`[H_I, d_I]`), its head weights `weights` (`[H_I]`) and one index key `k_index` (`[d_I]`).
///
/// # Panics
///
/// If the shapes disagree.
pub fn indexer_score_magnitude(
    q_index: ArrayView2<'_, f64>,
    weights: ArrayView1<'_, f64>,
    k_index: ArrayView1<'_, f64>,
) -> f64 {
    assert_eq!(q_index.nrows(), weights.len(), "q_index is [H_I, d_I] and weights [H_I]");
    assert_eq!(q_index.ncols(), k_index.len(), "q_index is [H_I, d_I] and k_index [d_I]");
    q_index
        .outer_iter()
        .zip(weights)
        .map(|(q_a, w_a)| w_a.abs() * q_a.iter().zip(k_index).map(|(q, k)| (q * k).abs()).sum::<f64>())
        .sum()
}

/// The bound on `|Î_ts − I_ts|` (module docs) for a score of magnitude `magnitude` ([`indexer_score_magnitude`])
/// with index dim `index_dim` (`d_I`) and `n_index_heads` (`H_I`) heads:
/// `F · (γ_tc(d_I) + γ32(H_I + 1)) · M`.
///
/// Precondition (asserted in debug builds): `γ_tc(d_I)` and `γ32(H_I + 1)` are at most [`FIRST_ORDER_LIMIT`], which
/// holds for every `d_I` below about `2.4 · 10^5` and `H_I` below about `5 · 10^5`; and `magnitude ≥ 0`.
pub fn indexer_score_bound(magnitude: f64, index_dim: usize, n_index_heads: usize) -> f64 {
    let logit = INDEXER_ACCUMULATION.gamma(index_dim);
    let score = gamma32(n_index_heads + 1);
    debug_assert!(
        (0.0..=FIRST_ORDER_LIMIT).contains(&logit) && (0.0..=FIRST_ORDER_LIMIT).contains(&score),
        "d_I = {index_dim}, H_I = {n_index_heads} outside the first-order range"
    );
    debug_assert!(magnitude >= 0.0, "the magnitude is a sum of absolute values: {magnitude}");
    SECOND_ORDER_FACTOR * (logit + score) * magnitude
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flash_bound::F32_UNIT_ROUNDOFF;
    use ndarray::{Array1, Array2, array};
    use proptest::prelude::RngExt;
    use proptest::test_runner::{RngAlgorithm, TestRng};
    use rug::Float;

    /// MPFR precision of the exact values: the test's inputs span fewer than 200 binary orders of magnitude, so the
    /// sums and products below are exact at this precision.
    const EXACT_BITS: u32 = 512;

    /// The bound is `F (γ_tc(d_I) + γ32(H_I + 1)) M`: zero for `M = 0`, linear in `M`, growing with `d_I` and `H_I`.
    #[test]
    fn the_bound_grows_with_every_count_and_scales_with_the_magnitude() {
        let b = indexer_score_bound(1.0, 128, 64);
        // γ_tc(128) = γ'(136) with u' = 2^-23; γ32(65).
        let nu = |n: f64, u: f64| n * u / (1.0 - n * u);
        let expected = SECOND_ORDER_FACTOR * (nu(136.0, 2.0 * F32_UNIT_ROUNDOFF) + nu(65.0, F32_UNIT_ROUNDOFF));
        assert!((b - expected).abs() <= 1e-15 * expected, "{b:e} vs {expected:e}");
        // 1.125 · (272 + 65) u = 379.125 u.
        assert!(b > 379.1 * F32_UNIT_ROUNDOFF && b < 379.2 * F32_UNIT_ROUNDOFF, "{b:e}");
        assert_eq!(indexer_score_bound(0.0, 128, 64), 0.0);
        assert_eq!(indexer_score_bound(3.0, 128, 64), 3.0 * b);
        assert_eq!(indexer_score_bound(0.5, 128, 64), 0.5 * b);
        assert!(indexer_score_bound(1.0, 129, 64) > b);
        assert!(indexer_score_bound(1.0, 128, 65) > b);
        // A new MMA instruction costs one more accumulator term.
        assert!(indexer_score_bound(1.0, 145, 64) - indexer_score_bound(1.0, 144, 64) > 3.0 * F32_UNIT_ROUNDOFF);
        // Both terms count: the logit's alone or the score sum's alone is smaller.
        assert!(SECOND_ORDER_FACTOR * INDEXER_ACCUMULATION.gamma(128) < b);
        assert!(SECOND_ORDER_FACTOR * gamma32(65) < b);
    }

    /// The factor `F` covers the second-order term and the f64 oracle's own error over the kernel's range
    /// `d_I ≤ 256`, `H_I ≤ 64` (the claim of the module docs, checked at every pair).
    #[test]
    fn the_second_order_term_fits_in_the_factor_over_the_kernels_range() {
        let gamma64 = |n: usize| n as f64 * f64::EPSILON / 2.0 / (1.0 - n as f64 * f64::EPSILON / 2.0);
        for d in 1..=256 {
            for h in 1..=64 {
                let (tc, s) = (INDEXER_ACCUMULATION.gamma(d), gamma32(h + 1));
                let needed = tc + s + tc * s + 2.0 * gamma64(d + h + 1);
                assert!(needed <= indexer_score_bound(1.0, d, h), "d_I = {d}, H_I = {h}");
                assert!(tc * s <= (tc + s) / 1024.0, "d_I = {d}, H_I = {h}");
            }
        }
    }

    /// Outside the first-order range (a count so large that `F` would not cover the second-order term) the bound
    /// refuses in debug builds, for either count alone; the kernel's largest sizes are accepted.
    #[test]
    #[cfg(debug_assertions)]
    fn the_bound_refuses_counts_outside_the_first_order_range() {
        for (index_dim, n_heads) in [(1 << 20, 64), (128, 1 << 20)] {
            let refused = std::panic::catch_unwind(|| indexer_score_bound(1.0, index_dim, n_heads)).is_err();
            assert!(refused, "d_I = {index_dim}, H_I = {n_heads} was accepted");
        }
        assert!(std::panic::catch_unwind(|| indexer_score_bound(1.0, 256, 64)).is_ok());
    }

    /// The magnitude is `Σ_a |w_a| Σ_c |q_ac k_c|` on a hand-made case with signs in every factor.
    #[test]
    fn the_magnitude_is_the_weighted_sum_of_absolute_products() {
        let q = array![[1.0, -2.0, 0.5], [-3.0, 0.0, 4.0]];
        let w = array![-0.5, 2.0];
        let k = array![2.0, 1.0, -1.0];
        // Head 0: |2| + |−2| + |−0.5| = 4.5, weighted 2.25; head 1: 6 + 0 + 4 = 10, weighted 20.
        assert_eq!(indexer_score_magnitude(q.view(), w.view(), k.view()), 22.25);
    }

    /// A value with `bits` significant bits (8: bf16, 11: f16), a random sign and a leading bit at `2^e` for `e` in
    /// `exponents`: exact in the storage type.
    fn storage_value(rng: &mut TestRng, bits: u32, exponents: std::ops::RangeInclusive<i32>) -> f32 {
        let significand = rng.random_range((1u32 << (bits - 1))..(1u32 << bits)) as f32;
        let exponent = rng.random_range(exponents) - (bits as i32 - 1);
        let sign = if rng.random_bool(0.5) { 1.0 } else { -1.0 };
        sign * significand * 2f32.powi(exponent)
    }

    /// Round toward zero from f64 to f32 (`x` in f32's normal range or zero).
    fn truncate_to_f32(x: f64) -> f32 {
        let nearest = x as f32;
        if f64::from(nearest).abs() > x.abs() { f32::from_bits(nearest.to_bits() - 1) } else { nearest }
    }

    /// One `m16n8k16` step of the tensor-core model (Fasi et al., "Numerical behavior of NVIDIA tensor cores", 2021)
    /// the bound's [`Accumulation::TensorCore`] assumes: the exact products and the accumulator are aligned to the
    /// largest exponent among them and truncated to 24 bits below that leading bit, added exactly, and the sum is
    /// normalised to f32 by truncation. Every truncation errs toward zero, the worst direction when the terms share
    /// a sign.
    fn mma_step(accumulator: f32, products: &[f32]) -> f32 {
        let terms = || std::iter::once(accumulator).chain(products.iter().copied());
        let largest = terms().map(f32::abs).fold(0.0, f32::max);
        if largest == 0.0 {
            return 0.0;
        }
        let leading = ((largest.to_bits() >> 23) & 0xff) as i32 - 127;
        let unit = 2f64.powi(leading - 23);
        // Each truncated term is an integer multiple of `unit` below 2^24 units: 17 of them add exactly in f64.
        truncate_to_f32(terms().map(|x| (f64::from(x) / unit).trunc() * unit).sum())
    }

    /// How the emulated kernel adds a logit's products.
    #[derive(Clone, Copy, Debug)]
    enum LogitSum {
        /// The tensor-core model, [`mma_step`] per 16 products.
        TensorCore,
        /// Sequential f32 additions rounded to nearest.
        Nearest,
    }

    /// The order in which the products reach the accumulator. An adversary that permutes the columns of `q` and
    /// `k` alike realises any order for the kernel's fixed one.
    #[derive(Clone, Copy, Debug)]
    enum Order {
        Natural,
        LargestFirst,
        SmallestFirst,
        /// Positive products largest first, then the negative ones: the partial sums peak before they cancel.
        PositivesFirst,
    }

    fn ordered(mut products: Vec<f32>, order: Order) -> Vec<f32> {
        match order {
            Order::Natural => {}
            Order::LargestFirst => products.sort_by(|a, b| b.abs().total_cmp(&a.abs())),
            Order::SmallestFirst => products.sort_by(|a, b| a.abs().total_cmp(&b.abs())),
            Order::PositivesFirst => products.sort_by(|a, b| b.total_cmp(a)),
        }
        products
    }

    /// The emulated logit `l̂ = q · k`: the products are exact in f32 (16-bit floats), then summed as `sum` says.
    fn logit(q: &[f32], k: &[f32], sum: LogitSum, order: Order) -> f32 {
        let products = ordered(q.iter().zip(k).map(|(q, k)| q * k).collect(), order);
        match sum {
            LogitSum::TensorCore => products.chunks(16).fold(0.0, mma_step),
            LogitSum::Nearest => products.iter().fold(0.0, |acc, p| acc + p),
        }
    }

    /// How the emulated kernel adds the weighted heads.
    #[derive(Clone, Copy, Debug)]
    enum ScoreSum {
        /// `acc + fl(w r)` in head order.
        Sequential,
        /// `fma(w, r, acc)` in head order.
        Fused,
        /// `fl(w r)` largest first, then a pairwise tree.
        PairwiseLargestFirst,
    }

    fn pairwise(terms: &[f32]) -> f32 {
        match terms.len() {
            0 => 0.0,
            1 => terms[0],
            n => pairwise(&terms[..n / 2]) + pairwise(&terms[n / 2..]),
        }
    }

    /// The emulated score `Σ_a w_a max(l̂_a, 0) + 0.0` in f32.
    fn score(weights: &[f32], relu: &[f32], sum: ScoreSum) -> f32 {
        let products = || weights.iter().zip(relu).map(|(w, r)| w * r);
        let total = match sum {
            ScoreSum::Sequential => products().fold(0.0, |acc, p| acc + p),
            ScoreSum::Fused => weights.iter().zip(relu).fold(0.0, |acc, (w, r)| w.mul_add(*r, acc)),
            ScoreSum::PairwiseLargestFirst => {
                let mut terms: Vec<f32> = products().collect();
                terms.sort_by(|a, b| b.abs().total_cmp(&a.abs()));
                pairwise(&terms)
            }
        };
        total + 0.0
    }

    /// The exact score in MPFR.
    fn exact_score(q: &Array2<f32>, weights: &[f32], k: &[f32]) -> Float {
        let mut total = Float::with_val(EXACT_BITS, 0);
        for (q_a, w_a) in q.outer_iter().zip(weights) {
            let mut l = Float::with_val(EXACT_BITS, 0);
            for (q_c, k_c) in q_a.iter().zip(k) {
                // Exact in f64: 22 bits at most.
                l += f64::from(*q_c) * f64::from(*k_c);
            }
            if l > 0 {
                total += l * f64::from(*w_a);
            }
        }
        total
    }

    /// The observed error of every emulated variant of the kernel on one query/key pair, as a fraction of the bound.
    fn error_ratios(q: &Array2<f32>, weights: &[f32], k: &[f32]) -> Vec<(f64, String)> {
        let (n_heads, index_dim) = q.dim();
        let exact = exact_score(q, weights, k);
        let widen = |x: &f32| f64::from(*x);
        let magnitude = indexer_score_magnitude(
            q.mapv(f64::from).view(),
            Array1::from_iter(weights.iter().map(widen)).view(),
            Array1::from_iter(k.iter().map(widen)).view(),
        );
        let bound = indexer_score_bound(magnitude, index_dim, n_heads);
        let mut ratios = Vec::new();
        for logit_sum in [LogitSum::TensorCore, LogitSum::Nearest] {
            for order in [Order::Natural, Order::LargestFirst, Order::SmallestFirst, Order::PositivesFirst] {
                let relu: Vec<f32> = q
                    .outer_iter()
                    .map(|q_a| logit(q_a.as_slice().expect("standard layout"), k, logit_sum, order).max(0.0))
                    .collect();
                for score_sum in [ScoreSum::Sequential, ScoreSum::Fused, ScoreSum::PairwiseLargestFirst] {
                    let computed = score(weights, &relu, score_sum);
                    let error = (Float::with_val(EXACT_BITS, computed) - &exact).abs().to_f64();
                    let label = format!("{logit_sum:?}/{order:?}/{score_sum:?}, d_I = {index_dim}, H_I = {n_heads}");
                    ratios.push((if bound > 0.0 { error / bound } else { error }, label));
                }
            }
        }
        ratios
    }

    /// Emulated kernels (the tensor-core model and plain f32 sums, in adversarial orders, with rounded or fused
    /// weighted products) on 300 random draws of bf16- and f16-exact inputs with cancelling signs: the error
    /// against the exact score (MPFR) stays within the bound on every draw and variant, and is not negligible on
    /// all of them. Observed: the largest error is about 2.6 % of the bound (random signs cancel, and rounding errors
    /// partly cancel); the test asks for 1/100, so a bound a hundred times too large (or zero) fails.
    #[test]
    fn emulated_indexer_scores_stay_within_the_bound_on_random_draws() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[16; 32]);
        let mut largest = (0.0f64, String::new());
        for draw in 0..300 {
            let bits = if rng.random_bool(0.5) { 8 } else { 11 };
            let index_dim = [16, 32, 48, 64, 100, 128, 192, 256][rng.random_range(0..8usize)];
            let n_heads = rng.random_range(1..=64usize);
            let q = Array2::from_shape_simple_fn((n_heads, index_dim), || storage_value(&mut rng, bits, -6..=3));
            let k: Vec<f32> = (0..index_dim).map(|_| storage_value(&mut rng, bits, -6..=3)).collect();
            let weights: Vec<f32> = (0..n_heads).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            for (ratio, label) in error_ratios(&q, &weights, &k) {
                assert!(ratio <= 1.0, "draw {draw}, {label}: error {ratio} of the bound");
                if ratio > largest.0 {
                    largest = (ratio, label);
                }
            }
        }
        assert!(largest.0 > 1e-2, "largest error {} of the bound ({})", largest.0, largest.1);
    }

    /// The bound is nearly tight: a logit of one large product followed by products just below the large one's
    /// last bit loses each of them to truncation in the tensor-core model (`2u` per product, the rate the bound
    /// charges), and products just above half that bit all round up under round-to-nearest (`u` per product).
    /// Observed: about 0.82 and 0.41 of the bound; the test asks for 0.6 and 0.3, so a bound with the logit term
    /// halved, or one using `u` for the tensor core (`Accumulation::RoundToNearest`), fails.
    #[test]
    fn an_adversarial_logit_reaches_most_of_the_bound() {
        let (index_dim, n_heads) = (256, 8);
        // q_0 = k_0 = 1; the rest: (1 − 2^-8) 2^-12 · 2^-11 = (1 − 2^-8) 2^-23, just below ulp(1) = 2^-23.
        let below_ulp =
            |c: usize| if c == 0 { (1.0, 1.0) } else { ((1.0 - 2f32.powi(-8)) * 2f32.powi(-12), 2f32.powi(-11)) };
        // The rest: (1 + 2^-7) 2^-12 · 2^-12, just above half of ulp(1).
        let above_half_ulp =
            |c: usize| if c == 0 { (1.0, 1.0) } else { ((1.0 + 2f32.powi(-7)) * 2f32.powi(-12), 2f32.powi(-12)) };
        let weights: Vec<f32> = (0..n_heads).map(|a| 0.5 + a as f32 / 16.0).collect();
        for (name, column, logit_sum, least) in [
            ("below ulp", &below_ulp as &dyn Fn(usize) -> (f32, f32), LogitSum::TensorCore, 0.6),
            ("above half ulp", &above_half_ulp, LogitSum::Nearest, 0.3),
        ] {
            let q = Array2::from_shape_fn((n_heads, index_dim), |(_, c)| column(c).0);
            let k: Vec<f32> = (0..index_dim).map(|c| column(c).1).collect();
            let relu: Vec<f32> = q
                .outer_iter()
                .map(|q_a| logit(q_a.as_slice().expect("row"), &k, logit_sum, Order::Natural).max(0.0))
                .collect();
            let exact = exact_score(&q, &weights, &k);
            let error = (Float::with_val(EXACT_BITS, score(&weights, &relu, ScoreSum::Sequential)) - &exact).abs();
            let magnitude = indexer_score_magnitude(
                q.mapv(f64::from).view(),
                Array1::from_iter(weights.iter().map(|w| f64::from(*w))).view(),
                Array1::from_iter(k.iter().map(|x| f64::from(*x))).view(),
            );
            let ratio = error.to_f64() / indexer_score_bound(magnitude, index_dim, n_heads);
            assert!(ratio <= 1.0 && ratio > least, "{name}: error {ratio} of the bound");
        }
    }
}
