//! The rounding-error bound of a pyramid node score (PISA: E25–E28; the oracle's `pyramid` module, the GPU selector
//! `pisa_select.cu`): how far an f64 evaluation of a candidate's score, summed over a KV head's query heads, can lie
//! from the exact value. A verifier uses it to hold a kernel's traced scores to the oracle's: both lie within their
//! bound of the exact score, so they lie within the sum of the two bounds of each other.
//!
//! # The inputs and their errors
//!
//! With `u = 2^-53` and `γ(n) = nu/(1 − nu)` (Higham: a sum of `n` terms in any order is off by at most `γ(n − 1)`
//! times the sum of their magnitudes, and `(1 + γ(a))(1 + γ(b)) ≤ 1 + γ(a + b)`):
//! - the pooled query of a block of `m` rows, `q̂_c = fl(fl(Σ_i q_ic)/m)`, is within `γ(m) Q_c` of `q̄_c`, with
//!   `Q_c = mean_i |q_ic|` ([`crate::bsa_bound`] derives it);
//! - a node's mean key is within `γ(T) K_c` of the exact mean, `K_c = mean_j |k_jc|` over the node's keys, where `T`
//!   counts the roundings on the way ("mean terms"): a mean of `n` raw keys summed in any order and divided once has
//!   `T = n`; the GPU's level `ℓ` mean, `fl(Σ_c fl(n_c μ̂_c)) / n` over at most `β` children whose means have `T'`, has
//!   `T = T' + β + 1` (one product, the sum and the division, over magnitudes that are themselves `K` weighted by the
//!   counts), so `T = C + ℓ(β + 1)` from leaves of at most `C` keys ([`gpu_mean_terms`]); the oracle's f64 pyramid
//!   averages every node's raw keys directly, `T` = the node's key count ([`oracle_mean_terms`]);
//! - a raw key in f64 is exact (bf16 and f16 widen exactly), `T = 0`.
//!
//! # An item's score
//!
//! `x̂ = fl(α̂ · dot(q̂, μ̂))`, the dot product over `d` columns in any order with or without fused multiply-adds:
//! within `γ(m + T + d + 3) · α Σ_c Q_c K_c` of the exact `α q̄·μ` ([`item_score_bound`]; the `+ 3` are the scale
//! `α̂ = fl(1/fl(√d))`, rounded twice as the host and the oracle compute it, and its product). PISA-1 scores a node by
//! its own mean this way; LSE and PISA-2 pool their items' scores (the leaf's raw keys, weight 1 each, or the
//! children's means, weight `n_c` each) as below, with `e` the largest of the items' bounds, `X` the largest `|x̂_i|`,
//! `n` the items and `W = Σ w_i`.
//!
//! # LSE: `log(Σ_i w_i e^{x_i} / W)`
//!
//! The function is 1-Lipschitz in the max norm of `x`, so the items' errors cost at most `e`. Its evaluation from the
//! computed `x̂`, in either of the two forms used:
//! - the kernel's `m + log(fl(Σ_i w_i exp(x̂_i − m)) / W)`, `m = max x̂`: each shifted argument is rounded by at most
//!   `u·|x̂_i − m| ≤ 2uX`, which moves the result by at most that; `exp` at 1 ulp (`2u`), the product with `w_i`, the
//!   `n`-term sum of positive terms and the division leave the argument of `log` within a factor `1 + γ(n + 3)` (plus
//!   `n` subnormal units where a term underflows, against a sum of at least 1), so its logarithm moves by at most
//!   `2γ(n + 3)`; `log` at 1 ulp adds `2u·|log y| ≤ 2u(ln W + 1)` (`y ∈ [1/W, 1]`); the final addition `u·(X + ln W +
//!   1)`;
//! - the oracle's `LSE(x̂_i + ln w_i) − ln W`: `fl(ln w_i)` and the addition move each argument by at most
//!   `u(X + 3 ln W)`; the shifted exponentials, their sum and the `log` as above over `n` terms (`2γ(n + 2)`,
//!   `2u ln n` with `ln n ≤ ln W`); the addition of the maximum `u(X + 2 ln W)`, `fl(ln W)` and the subtraction
//!   `u(X + 4 ln W)`.
//!
//! Both are within `2γ(n + 4) + u(6X + 12 ln W + 6)` ([`lse_bound`]), which adds `e`.
//!
//! # PISA-2: `mean + var/2`, `mean = Σ w_i x_i / W`, `var = Σ w_i (x_i − mean)² / W`
//!
//! Item errors: the mean moves by at most `e`; each deviation by at most `2e`, so with `D = max_i |x_i − mean|`
//! each squared deviation by at most `4eD + 4e²`, and the score by at most `e(1 + 2D + 2e)`. Evaluation (both the
//! kernel and the oracle compute the two sums in this form): the weighted sum and the division are within
//! `γ(n + 1) M` of the mean from `x̂`, `M = Σ w_i |x̂_i| / W ≤ X`; using that computed mean instead of the exact one
//! raises the variance by its square (the variance is smallest at the true mean): at most `(γ(n + 1) X)²`; each
//! deviation's rounding (`u`), its square (`u`), the weight (`u`), the `n`-term sum and the division leave the
//! variance within `γ(n + 4)` of itself; halving is exact and the last addition rounds once. In all at most
//! `γ(n + 5)(X + V) + (γ(n + 1) X)²` with `V` the (computed) variance ([`pisa2_bound`]), which adds the items'
//! `e(1 + 2D + 2e)`.
//!
//! # The group
//!
//! The candidate's score is the sum of its `G` heads' scores, in ascending head order on the GPU and in the oracle:
//! the heads' bounds add, and the sum's own rounding is at most `γ(G − 1) Σ_h |ŝ_h|` ([`group_bound`]).
//!
//! PISA-1's score is linear in the query, and the GPU sums the group first: `fl(α̂ · dot(q̃, μ̂))` with `q̃_c` the sum
//! of the heads' pooled `q̂_hc` in ascending order. That sum rounds by at most `γ(G − 1) Σ_h |q̂_hc|`, and
//! `|q̂_hc| ≤ (1 + γ(m)) Q_hc`, so `q̃_c` is within `γ(m + G − 1) Q̃_c` of the exact `Σ_h q̄_hc`, `Q̃_c = Σ_h Q_hc`:
//! it is a pooled query of `m + G − 1` roundings and magnitudes `Q̃`, and the item bound applies with those
//! ([`presummed_score_bound`]).
//!
//! # E30's block masses (`pisa_mass.cu`, the oracle's `diagnostics`)
//!
//! A (row, head) pair with `n` visible keys, exact scores `x_j = α q·k_j` of magnitudes `S_j = α Σ_c |q_c k_jc|`,
//! and softmax `P_j`. Each computed score is within `e = max_j γ(d + 3) S_j` ([`item_score_bound`] with raw queries
//! and keys), so the softmax of the computed scores is within a factor `e^{±2e}` of `P`. The kernel's evaluation:
//! pass 1 takes the maximum and the sum online (`l ← l·exp(m − x) + 1` on a new maximum, else `l ← l + exp(x − m)`):
//! each subtraction rounds by at most `u` times the scores' range `R` (computed: the exact range plus `2e`), and the
//! rescalings a term passes through telescope to at most `uR` more; `exp` at 1 ulp (`2u`), the products and the sums
//! over at most `n` steps keep the sum within a factor `e^{2uR}(1 + γ(5n))`. Pass 2's `exp(x̂_j − m)/l` adds `uR`,
//! `2u` and the division. So every computed probability is within a factor `e^{±ρ}` of `P_j`,
//! `ρ = 2e + 3uR + 2γ(5n + 4)`. The oracle (max, shifted exponentials, their sum, a division, then a division by the
//! group) stays within the same `ρ`. A mass sums `T` such nonnegative terms in some order (at most rows · heads · `C`)
//! and divides once, so it is within `r = e^ρ (1 + γ(T + 1)) − 1` of the exact mass, relatively
//! ([`mass_relative_bound`]): two evaluations (the kernel's, the oracle's) are within `2r/(1 − r)` times either's
//! value of each other.
//!
//! Every bound takes a relative margin of `2^-10` for its own f64 evaluation (a few roundings each).

use crate::f64_oracle_bound::{UNIT_ROUNDOFF, gamma};

/// Relative slack for a bound's own f64 evaluation.
const MARGIN: f64 = 1.0 + 1.0 / 1024.0;

/// Mean terms `T` of the GPU's level-`level` means (leaves of at most `leaf_size` keys, `branching` children per
/// node): `C + ℓ(β + 1)` (see the module docs).
pub fn gpu_mean_terms(leaf_size: usize, branching: usize, level: usize) -> usize {
    leaf_size + level * (branching + 1)
}

/// Mean terms `T` of the oracle's f64 means: each node averages its `keys` raw keys directly.
pub fn oracle_mean_terms(keys: usize) -> usize {
    keys
}

/// The bound on `|x̂ − α q̄·μ|` for an item (a raw key with `mean_terms = 0`, or a node mean with its mean terms) of
/// magnitude `magnitude = α Σ_c Q_c K_c`, a query block of `query_rows` rows and head dim `head_dim`.
pub fn item_score_bound(magnitude: f64, query_rows: usize, mean_terms: usize, head_dim: usize) -> f64 {
    MARGIN * gamma(query_rows + mean_terms + head_dim + 3) * magnitude
}

/// The bound on PISA-1's score of a node computed from the group's summed query (see the module docs):
/// `magnitude_sum` is `α Σ_c Q̃_c K_c` (the heads' item magnitudes added), `group` the heads `G`.
pub fn presummed_score_bound(
    magnitude_sum: f64,
    query_rows: usize,
    group: usize,
    mean_terms: usize,
    head_dim: usize,
) -> f64 {
    item_score_bound(magnitude_sum, query_rows + group.saturating_sub(1), mean_terms, head_dim)
}

/// The bound on an LSE node score of one head: `item_error` the largest of its items' bounds, `items` their number,
/// `total_weight` `W ≥ 1`, `max_abs_item` `X` the largest `|x̂_i|` (see the module docs).
pub fn lse_bound(item_error: f64, items: usize, total_weight: f64, max_abs_item: f64) -> f64 {
    let log_w = total_weight.max(1.0).ln();
    item_error + MARGIN * (2.0 * gamma(items + 4) + UNIT_ROUNDOFF * (6.0 * max_abs_item + 12.0 * log_w + 6.0))
}

/// The bound on a PISA-2 node score of one head: `item_error` `e`, `items` `n`, `max_abs_item` `X`, `spread` `D` the
/// largest `|x̂_i − mean|` and `variance` `V` the computed variance (see the module docs; `D` and `V` from computed
/// values are within `2e` and `4eD + 4e²` of the exact ones, second-order terms the margin covers).
pub fn pisa2_bound(item_error: f64, items: usize, max_abs_item: f64, spread: f64, variance: f64) -> f64 {
    let e = item_error;
    let mean_shift = gamma(items + 1) * max_abs_item;
    MARGIN * (e * (1.0 + 2.0 * (spread + 2.0 * e) + 2.0 * e) + gamma(items + 5) * (max_abs_item + variance))
        + mean_shift * mean_shift
}

/// The bound on a candidate's score summed over its group: the heads' bounds `head_bounds` add, and the sum of the
/// `G` computed head scores, of absolute sum `abs_sum`, rounds by at most `γ(G − 1) · abs_sum`.
pub fn group_bound(head_bounds: &[f64], abs_sum: f64) -> f64 {
    let heads: f64 = head_bounds.iter().sum();
    MARGIN * (heads + gamma(head_bounds.len().saturating_sub(1)) * abs_sum)
}

/// The relative bound `r` on an E30 block mass (see the module docs): `item_error` `e` the largest score bound of the
/// pairs' visible keys, `range` `R` the largest range of a pair's computed scores, `keys` `n` the most keys a pair
/// sees, `terms` `T` the probabilities summed into one mass.
pub fn mass_relative_bound(item_error: f64, range: f64, keys: usize, terms: usize) -> f64 {
    let rho = 2.0 * item_error + 3.0 * UNIT_ROUNDOFF * range + 2.0 * gamma(5 * keys + 4);
    MARGIN * (rho.exp() * (1.0 + gamma(terms + 1)) - 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::pyramid::{Pyramid, PyramidConfig, Scoring, child_mean_lse};
    use attnproof_oracle::vexp;
    use ndarray::{Array1, Array2};
    use proptest::prelude::RngExt;
    use proptest::test_runner::{RngAlgorithm, TestRng};
    use rug::Float;
    use rug::float::Round;

    /// Bits of the reference values, far beyond f64's 53: sums of the tests' keys are exact in it, and its `exp` and
    /// `log` are correct far below anything the bounds measure.
    const PRECISION: u32 = 256;
    /// Lanes of a warp.
    const LANES: usize = 32;
    /// Items per lane in `pisa_head_score` (`PISA_ITEMS_PER_LANE`): up to 128 items a node.
    const ITEMS_PER_LANE: usize = 4;
    /// The xor-shuffle offsets of `pisa_warp_sum` and `pisa_warp_max`, in their order.
    const SHUFFLE_OFFSETS: [usize; 5] = [16, 8, 4, 2, 1];
    /// `pool_block`'s interleaved row groups for a head dim of at most 128 (`min(POOL_GROUPS, POOL_THREADS / (d / 8))`
    /// with 8 groups and 128 threads); a head dim of 256 has 4.
    const POOL_GROUPS: usize = 8;

    /// One value per lane of a warp.
    type Warp = [f64; LANES];

    fn mp(x: f64) -> Float {
        Float::with_val(PRECISION, x)
    }

    /// `|computed − exact|` rounded up to f64; infinite when the computation gave no finite value.
    fn error_of(computed: f64, exact: &Float) -> f64 {
        if computed.is_finite() { (mp(computed) - exact).abs().to_f64_round(Round::Up) } else { f64::INFINITY }
    }

    /// `|computed − exact| / bound`, 0 where the error is 0 (a node of items all 0 has the bound 0 and meets it).
    fn error_ratio(computed: f64, exact: &Float, bound: f64) -> f64 {
        let error = error_of(computed, exact);
        if error == 0.0 { 0.0 } else { error / bound }
    }

    /// A library function at its worst within one ulp (CUDA's double `exp` and `log` are accurate to 1 ulp): the exact
    /// value rounded to f64 up or down, the direction drawn, so the result is off by up to a whole ulp.
    fn within_one_ulp(rng: &mut TestRng, exact: Float) -> f64 {
        exact.to_f64_round(if rng.random_bool(0.5) { Round::Up } else { Round::Down })
    }

    /// How the emulated kernel evaluates `a · b + c`: NVRTC's `--fmad=true` lets it contract the two into one fused
    /// multiply-add, or it may round the product and the sum apart; the tests run both.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Contraction {
        Fused,
        Separate,
    }

    fn multiply_add(a: f64, b: f64, c: f64, contraction: Contraction) -> f64 {
        match contraction {
            Contraction::Fused => a.mul_add(b, c),
            Contraction::Separate => a * b + c,
        }
    }

    /// `pisa_warp_sum` and `pisa_warp_max`: for the offsets 16, 8, 4, 2, 1 in turn every lane combines its value with
    /// lane `lane ^ offset`'s, all lanes at once (each reads the values from before the step). Every lane ends with the
    /// same bits (`a + b = b + a` in IEEE arithmetic); the function checks that and returns lane 0's.
    fn butterfly(mut values: Warp, combine: impl Fn(f64, f64) -> f64) -> f64 {
        for offset in SHUFFLE_OFFSETS {
            let before = values;
            for lane in 0..LANES {
                values[lane] = combine(before[lane], before[lane ^ offset]);
            }
        }
        let same = |v: &f64| v.to_bits() == values[0].to_bits() || (v.is_nan() && values[0].is_nan());
        assert!(values.iter().all(same), "the lanes disagree: {values:?}");
        values[0]
    }

    fn warp_sum(values: Warp) -> f64 {
        butterfly(values, |a, b| a + b)
    }

    /// A node's values as `pisa_head_score` holds them, `[r][lane]`: lane `lane`'s `r`-th slot is item `lane + 32 r`;
    /// a slot past the last item holds 0 (score 0, weight 0).
    fn lane_slots(values: &[f64]) -> [Warp; ITEMS_PER_LANE] {
        assert!(values.len() <= LANES * ITEMS_PER_LANE, "{} items do not fit a warp", values.len());
        let mut slots = [[0.0; LANES]; ITEMS_PER_LANE];
        for (item, &value) in values.iter().enumerate() {
            slots[item / LANES][item % LANES] = value;
        }
        slots
    }

    /// A node's items: their computed scores `x̂_i` and their weights `w_i` (1 for a leaf's raw keys, the child's key
    /// count for an intermediate node's children).
    #[derive(Clone, Debug)]
    struct Node {
        scores: Vec<f64>,
        weights: Vec<f64>,
    }

    impl Node {
        fn items(&self) -> usize {
            self.scores.len()
        }
        /// `W`, exact: a sum of integers below `2^53`.
        fn total_weight(&self) -> f64 {
            self.weights.iter().sum()
        }
        /// `X`, the largest `|x̂_i|`.
        fn max_abs_item(&self) -> f64 {
            self.scores.iter().fold(0.0, |x, s| x.max(s.abs()))
        }
        fn exact_scores(&self) -> Vec<Float> {
            self.scores.iter().map(|&s| mp(s)).collect()
        }
        /// What a verifier computes in f64 for [`pisa2_bound`]: the spread `D` (the largest distance of an item from
        /// the f64 mean) and the f64 variance `V`, both in the oracle's order.
        fn spread_and_variance(&self) -> (f64, f64) {
            let total = self.total_weight();
            let pairs = || self.scores.iter().zip(&self.weights);
            let mean = pairs().fold(0.0, |acc, (&x, &w)| acc + w * x) / total;
            let spread = self.scores.iter().fold(0.0f64, |d, &x| d.max((x - mean).abs()));
            let variance = pairs().fold(0.0, |acc, (&x, &w)| acc + w * (x - mean) * (x - mean)) / total;
            (spread, variance)
        }
    }

    /// Item counts, centers and spreads of the adversarial nodes: [`draw_node`] takes every combination once over
    /// [`NODE_CASES`] cases.
    const ITEM_COUNTS: [usize; 11] = [1, 2, 3, 5, 16, 31, 32, 33, 64, 127, 128];
    const CENTERS: [f64; 8] = [0.0, 10.0, -10.0, 700.0, -1e3, 1e3, 1e6, -1e6];
    const SPREADS: [f64; 6] = [0.0, 1e-3, 1.0, 40.0, 300.0, 800.0];
    const NODE_CASES: usize = ITEM_COUNTS.len() * CENTERS.len() * SPREADS.len();

    /// The adversarial node of case `case`: its scores around a center of up to `10^6` in magnitude, spread over up to
    /// `±800` (the exponentials of the lowest underflow to 0: `e^-745` is below the smallest subnormal), in a third of
    /// the nodes most of them repeating an earlier one; weights all 1 (a leaf), equal child counts `2^k` up to `2^20`
    /// with a partial last child, or counts drawn up to `2^20`.
    fn draw_node(rng: &mut TestRng, case: usize) -> Node {
        let n = ITEM_COUNTS[case % ITEM_COUNTS.len()];
        let center = CENTERS[(case / ITEM_COUNTS.len()) % CENTERS.len()];
        let spread = SPREADS[(case / (ITEM_COUNTS.len() * CENTERS.len())) % SPREADS.len()];
        let repeats = rng.random_bool(1.0 / 3.0);
        let mut scores: Vec<f64> = Vec::with_capacity(n);
        for i in 0..n {
            let score = if repeats && i > 0 && rng.random_bool(0.7) {
                scores[rng.random_range(0..i)]
            } else {
                center + spread * rng.random_range(-1.0..=1.0)
            };
            scores.push(score);
        }
        let weights = match rng.random_range(0..3) {
            0 => vec![1.0; n],
            1 => {
                let span = 1u64 << rng.random_range(1..=20);
                let last = rng.random_range(1..=span);
                (0..n).map(|i| (if i + 1 == n { last } else { span }) as f64).collect()
            }
            _ => (0..n).map(|_| rng.random_range(1..=1u64 << 20) as f64).collect(),
        };
        Node { scores, weights }
    }

    /// How an emulated evaluation departs from the recipe, to show that the bounds can fail.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Evaluation {
        Recipe,
        /// The LSE's exponentials of the scores themselves, without subtracting their maximum.
        NoMaximum,
        /// Every item weighing 1: the LSE's sum and total, PISA-2's mean.
        Unweighted,
    }

    /// `pisa_head_score`'s LSE in f64: each lane's running maximum and total weight over its slots in ascending
    /// order, the warp's maximum and total by the butterfly, each lane's sum of `w · exp(x̂ − m)` in ascending slot
    /// order, the warp's sum by the butterfly, and `m + log(y / W)`; `exp` and `log` at their worst within one ulp.
    fn kernel_lse(rng: &mut TestRng, node: &Node, contraction: Contraction, evaluation: Evaluation) -> f64 {
        let weights = if evaluation == Evaluation::Unweighted { vec![1.0; node.items()] } else { node.weights.clone() };
        let (x, w) = (lane_slots(&node.scores), lane_slots(&weights));
        let mut lane_max = [f64::NEG_INFINITY; LANES];
        let mut lane_total = [0.0; LANES];
        for r in 0..ITEMS_PER_LANE {
            for lane in 0..LANES {
                if w[r][lane] > 0.0 {
                    lane_max[lane] = lane_max[lane].max(x[r][lane]);
                }
                lane_total[lane] += w[r][lane];
            }
        }
        let total = warp_sum(lane_total);
        let m = if evaluation == Evaluation::NoMaximum { 0.0 } else { butterfly(lane_max, f64::max) };
        let mut lane_sum = [0.0; LANES];
        for r in 0..ITEMS_PER_LANE {
            for lane in 0..LANES {
                if w[r][lane] > 0.0 {
                    let exponential = within_one_ulp(rng, mp(x[r][lane] - m).exp());
                    lane_sum[lane] = multiply_add(w[r][lane], exponential, lane_sum[lane], contraction);
                }
            }
        }
        m + within_one_ulp(rng, mp(warp_sum(lane_sum) / total).ln())
    }

    /// `pisa_head_score`'s PISA-2 in f64: each lane's sum of `w · x̂` in ascending slot order, the butterfly, `/ W`;
    /// each lane's sum of `w · (x̂ − mean)²`, the butterfly, `/ W`; `mean + 0.5 · variance`.
    fn kernel_pisa2(node: &Node, contraction: Contraction, evaluation: Evaluation) -> f64 {
        let (x, w) = (lane_slots(&node.scores), lane_slots(&node.weights));
        // The mean's weights: the broken evaluation's all 1.
        let mean_w = if evaluation == Evaluation::Unweighted { lane_slots(&vec![1.0; node.items()]) } else { w };
        let lane_sums = |slots: &[Warp; ITEMS_PER_LANE]| {
            let mut sums = [0.0; LANES];
            for r in 0..ITEMS_PER_LANE {
                for lane in 0..LANES {
                    sums[lane] += slots[r][lane];
                }
            }
            sums
        };
        let total = warp_sum(lane_sums(&w));
        let mean_total = warp_sum(lane_sums(&mean_w));
        let mut lane_t = [0.0; LANES];
        for r in 0..ITEMS_PER_LANE {
            for lane in 0..LANES {
                lane_t[lane] = multiply_add(mean_w[r][lane], x[r][lane], lane_t[lane], contraction);
            }
        }
        let mean = warp_sum(lane_t) / mean_total;
        let mut lane_v = [0.0; LANES];
        for r in 0..ITEMS_PER_LANE {
            for lane in 0..LANES {
                let dev = x[r][lane] - mean;
                lane_v[lane] = multiply_add(w[r][lane], dev * dev, lane_v[lane], contraction);
            }
        }
        multiply_add(0.5, warp_sum(lane_v) / total, mean, contraction)
    }

    /// The oracle's `weighted_log_mean_exp` in f64: `x̂_i + ln w_i`, their maximum, the sum of the shifted
    /// exponentials (the oracle's own `exp`) left to right, `m + ln(sum)`, then `− ln W`.
    fn oracle_lse(node: &Node) -> f64 {
        let shifted: Vec<f64> = node.scores.iter().zip(&node.weights).map(|(&x, &w)| x + w.ln()).collect();
        let m = shifted.iter().fold(f64::NEG_INFINITY, |m, &s| if s > m { s } else { m });
        let sum = shifted.iter().fold(0.0, |acc, &s| acc + vexp::exp(s - m));
        (m + sum.ln()) - node.total_weight().ln()
    }

    /// The oracle's `mean_plus_half_variance` in f64: both sums left to right, the variance's terms as `(w · dev) ·
    /// dev`.
    fn oracle_pisa2(node: &Node) -> f64 {
        let total = node.total_weight();
        let pairs = || node.scores.iter().zip(&node.weights);
        let mean = pairs().fold(0.0, |acc, (&x, &w)| acc + w * x) / total;
        let variance = pairs().fold(0.0, |acc, (&x, &w)| {
            let dev = x - mean;
            acc + w * dev * dev
        }) / total;
        mean + variance / 2.0
    }

    /// The exact `log(Σ_i w_i e^{x_i} / W)` in MPFR.
    fn exact_lse(scores: &[Float], weights: &[f64]) -> Float {
        let m = scores.iter().skip(1).fold(scores[0].clone(), |m, x| if *x > m { x.clone() } else { m });
        let sum =
            scores.iter().zip(weights).fold(mp(0.0), |acc, (x, &w)| acc + Float::with_val(PRECISION, x - &m).exp() * w);
        let total: f64 = weights.iter().sum();
        m + (sum / total).ln()
    }

    /// The exact `mean + var/2` in MPFR.
    fn exact_pisa2(scores: &[Float], weights: &[f64]) -> Float {
        let total: f64 = weights.iter().sum();
        let mean =
            scores.iter().zip(weights).fold(mp(0.0), |acc, (x, &w)| acc + Float::with_val(PRECISION, x * w)) / total;
        let variance = scores
            .iter()
            .zip(weights)
            .fold(mp(0.0), |acc, (x, &w)| acc + Float::with_val(PRECISION, x - &mean).square() * w)
            / total;
        mean + variance / 2.0
    }

    /// The contraction of case `case`: the two alternate.
    fn contraction_of(case: usize) -> Contraction {
        if case.is_multiple_of(2) { Contraction::Fused } else { Contraction::Separate }
    }

    /// The kernel's LSE, emulated on every adversarial node (spreads to 800 with underflowing exponentials, scores to
    /// `±10^6`, many equal items, 1 to 128 items, weights to `2^20`; `exp` and `log` off by up to an ulp, multiply-adds
    /// fused or not), stays within `lse_bound(0, ...)` of the exact LSE of the same items; and the bound is not loose
    /// where the scores are large: the worst error there is more than `10^-4` of it (the final `m + log` rounds by up
    /// to half an ulp of `X`, where the bound allows `6uX`).
    #[test]
    fn the_kernel_lse_stays_within_the_bound_of_the_exact_lse_of_its_items() {
        lse_form_stays_within_the_bound(31, |rng, node, case| {
            kernel_lse(rng, node, contraction_of(case), Evaluation::Recipe)
        });
    }

    /// The oracle's LSE (its own `child_mean_lse`, which the emulation matches bit for bit) stays within
    /// `lse_bound(0, ...)` of the exact LSE of the same items on every adversarial node, with the worst error where the
    /// scores are large more than `10^-4` of the bound.
    #[test]
    fn the_oracle_lse_stays_within_the_bound_of_the_exact_lse_of_its_items() {
        let query = Array1::from(vec![1.0]);
        lse_form_stays_within_the_bound(32, |_, node, case| {
            let computed = oracle_lse(node);
            // With d = 1 and the query 1 the oracle's item scores are the items themselves (α = 1, q·μ = μ).
            let means = Array2::from_shape_vec((node.items(), 1), node.scores.clone()).expect("a column");
            let counts: Vec<usize> = node.weights.iter().map(|&w| w as usize).collect();
            let oracle = child_mean_lse(query.view(), means.view(), &counts, ()).expect("a valid node");
            assert_eq!(computed.to_bits(), oracle.to_bits(), "case {case}: the emulation is not the oracle");
            computed
        });
    }

    /// Runs one LSE evaluation form over every adversarial node (drawn from `seed`): each result within
    /// `lse_bound(0, ...)` of the exact LSE of the same items, the worst ratio where the scores are large at least
    /// `10^-4` (the bound is not vacuous there).
    fn lse_form_stays_within_the_bound(seed: u8, mut evaluate: impl FnMut(&mut TestRng, &Node, usize) -> f64) {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]);
        let mut worst_large = 0.0f64;
        for case in 0..NODE_CASES {
            let node = draw_node(&mut rng, case);
            let computed = evaluate(&mut rng, &node, case);
            let exact = exact_lse(&node.exact_scores(), &node.weights);
            let bound = lse_bound(0.0, node.items(), node.total_weight(), node.max_abs_item());
            let ratio = error_ratio(computed, &exact, bound);
            assert!(ratio <= 1.0, "case {case} ({node:?}): ratio {ratio}");
            if node.max_abs_item() >= 1e3 {
                worst_large = worst_large.max(ratio);
            }
        }
        assert!(worst_large >= 1e-4, "worst ratio with large scores {worst_large:e}");
    }

    /// PISA-2 evaluated as the kernel does it (lane sums and the butterfly, multiply-adds fused or not) and as the
    /// oracle does it (left-to-right folds) stays within `pisa2_bound(0, ...)` of the exact PISA-2 of the same items,
    /// `X`, `D` and `V` taken from the items in f64 as a verifier would.
    #[test]
    fn pisa2_evaluations_stay_within_the_bound_of_the_exact_pisa2_of_their_items() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[33; 32]);
        let mut worst = [0.0f64; 2];
        for case in 0..NODE_CASES {
            let node = draw_node(&mut rng, case);
            let exact = exact_pisa2(&node.exact_scores(), &node.weights);
            let (spread, variance) = node.spread_and_variance();
            let bound = pisa2_bound(0.0, node.items(), node.max_abs_item(), spread, variance);
            let computed = [kernel_pisa2(&node, contraction_of(case), Evaluation::Recipe), oracle_pisa2(&node)];
            for (form, &value) in computed.iter().enumerate() {
                let ratio = error_ratio(value, &exact, bound);
                assert!(ratio <= 1.0, "case {case}, form {form} ({node:?}): ratio {ratio}");
                worst[form] = worst[form].max(ratio);
            }
        }
        assert!(worst.iter().all(|&r| r >= 1e-4), "worst ratios (kernel, oracle) {worst:?}");
    }

    /// With item errors: exact scores `x_i` (MPFR) and computed ones `x̂_i = x_i + δ_i`, `|δ_i| ≤ e` (all `+e`, all
    /// `−e`, `e · sign(1 + x̂_i − mean)` which moves PISA-2 the most, or drawn), the f64 LSE and PISA-2 of `x̂` in both
    /// forms stay within `lse_bound(e, ...)` and `pisa2_bound(e, ...)` of the exact values of `x`. Shifting every item
    /// by `e` shifts the LSE by exactly `e`, so there the bound is nearly reached.
    #[test]
    fn perturbed_items_stay_within_the_bounds_with_item_errors() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[34; 32]);
        let (mut worst_lse, mut worst_pisa2) = ([0.0f64; 2], [0.0f64; 2]);
        for case in (0..NODE_CASES).step_by(2) {
            let node = draw_node(&mut rng, case);
            let x_max = node.max_abs_item();
            let item_error = [1e-13, 1e-9, 1e-5][(case / 2) % 3] * (1.0 + x_max);
            let total = node.total_weight();
            let mean = node.scores.iter().zip(&node.weights).fold(0.0, |acc, (&x, &w)| acc + w * x) / total;
            let pattern = rng.random_range(0..4);
            let exact_scores: Vec<Float> = node
                .scores
                .iter()
                .map(|&x| {
                    let delta = match pattern {
                        0 => item_error,
                        1 => -item_error,
                        2 => item_error.copysign(1.0 + x - mean),
                        _ => item_error * rng.random_range(-1.0..=1.0),
                    };
                    mp(x) - delta
                })
                .collect();
            let lse_exact = exact_lse(&exact_scores, &node.weights);
            let lse_limit = lse_bound(item_error, node.items(), total, x_max);
            let lse_computed =
                [kernel_lse(&mut rng, &node, contraction_of(case), Evaluation::Recipe), oracle_lse(&node)];
            for (form, &value) in lse_computed.iter().enumerate() {
                let ratio = error_ratio(value, &lse_exact, lse_limit);
                assert!(ratio <= 1.0, "case {case}, LSE form {form}, e {item_error:e}: ratio {ratio}");
                worst_lse[form] = worst_lse[form].max(ratio);
            }
            let pisa2_exact = exact_pisa2(&exact_scores, &node.weights);
            let (spread, variance) = node.spread_and_variance();
            let pisa2_limit = pisa2_bound(item_error, node.items(), x_max, spread, variance);
            let pisa2_computed = [kernel_pisa2(&node, contraction_of(case), Evaluation::Recipe), oracle_pisa2(&node)];
            for (form, &value) in pisa2_computed.iter().enumerate() {
                let ratio = error_ratio(value, &pisa2_exact, pisa2_limit);
                assert!(ratio <= 1.0, "case {case}, PISA-2 form {form}, e {item_error:e}: ratio {ratio}");
                worst_pisa2[form] = worst_pisa2[form].max(ratio);
            }
        }
        assert!(worst_lse.iter().all(|&r| r > 0.9), "worst LSE ratios (kernel, oracle) {worst_lse:?}");
        assert!(worst_pisa2.iter().all(|&r| r > 0.25), "worst PISA-2 ratios (kernel, oracle) {worst_pisa2:?}");
    }

    /// How an emulated level mean departs from `pisa_pool_level`, to show that the bound can fail.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum LevelMean {
        Recipe,
        /// `Σ_c μ̂_c / β`: E25's mean of the child means, right for a full node only.
        DividedByBranching,
    }

    /// Keys under node `node` of a level whose nodes span `span` keys, of `n_keys` (`pisa_count`).
    fn key_count(node: usize, span: usize, n_keys: usize) -> usize {
        ((node + 1) * span).min(n_keys) - node * span
    }

    /// `pool_block`'s mean of one column of a block's rows: `groups` interleaved row groups (row `j` in group
    /// `j mod groups`), each summed from 0 in ascending row order, the group sums added from 0 in ascending group
    /// order, divided once by the row count.
    fn pool_block_mean(rows: &[f64], groups: usize) -> f64 {
        let mut group_sums = vec![0.0; groups];
        for (j, &x) in rows.iter().enumerate() {
            group_sums[j % groups] += x;
        }
        group_sums.iter().fold(0.0, |acc, &s| acc + s) / rows.len() as f64
    }

    /// One column of the GPU's pyramid of means, leaves first, up to the root: the leaves by `pool_block` (leaves of
    /// `leaf_size` keys, the last one partial), every coarser level by `pisa_pool_level`, `Σ_c n_c · μ̂_c` over the
    /// node's children in ascending order (a multiply-add each) divided once by the node's key count.
    fn gpu_means(
        keys: &[f64],
        leaf_size: usize,
        branching: usize,
        groups: usize,
        contraction: Contraction,
        how: LevelMean,
    ) -> Vec<Vec<f64>> {
        let n_keys = keys.len();
        let mut levels = vec![keys.chunks(leaf_size).map(|leaf| pool_block_mean(leaf, groups)).collect::<Vec<_>>()];
        let mut span_below = leaf_size;
        while levels[levels.len() - 1].len() > 1 {
            let span = span_below * branching;
            let means: Vec<f64> = levels[levels.len() - 1]
                .chunks(branching)
                .enumerate()
                .map(|(node, children)| match how {
                    LevelMean::Recipe => {
                        let sum = children.iter().enumerate().fold(0.0, |sum, (i, &mean)| {
                            let count = key_count(node * branching + i, span_below, n_keys) as f64;
                            multiply_add(count, mean, sum, contraction)
                        });
                        sum / key_count(node, span, n_keys) as f64
                    }
                    LevelMean::DividedByBranching => {
                        children.iter().fold(0.0, |sum, &mean| sum + mean) / branching as f64
                    }
                })
                .collect();
            levels.push(means);
            span_below = span;
        }
        levels
    }

    /// The exact sums of `values` (one column of keys or of their magnitudes) under every node of every level, leaves
    /// first, in MPFR: exact for the tests' f32 keys.
    fn exact_level_sums(values: &[f64], leaf_size: usize, branching: usize) -> Vec<Vec<Float>> {
        let leaves = values.chunks(leaf_size).map(|leaf| leaf.iter().fold(mp(0.0), |acc, &v| acc + v)).collect();
        let mut levels: Vec<Vec<Float>> = vec![leaves];
        while levels[levels.len() - 1].len() > 1 {
            let next = levels[levels.len() - 1]
                .chunks(branching)
                .map(|children| children.iter().fold(mp(0.0), |acc, c| acc + c))
                .collect();
            levels.push(next);
        }
        levels
    }

    /// The ratio of `|μ̂ − μ|` to `γ(T_ℓ) K` for every node of every level (`[level][node]`) of one column's means
    /// `means` of `keys`: `T_ℓ = gpu_mean_terms(C, β, ℓ)`, `K` the mean magnitude of the node's keys, `μ` their exact
    /// mean.
    fn mean_ratios(keys: &[f64], means: &[Vec<f64>], leaf_size: usize, branching: usize) -> Vec<Vec<f64>> {
        let sums = exact_level_sums(keys, leaf_size, branching);
        let magnitudes: Vec<f64> = keys.iter().map(|k| k.abs()).collect();
        let magnitude_sums = exact_level_sums(&magnitudes, leaf_size, branching);
        assert_eq!(sums.len(), means.len());
        let mut span = leaf_size;
        let mut ratios = Vec::new();
        for (level, level_means) in means.iter().enumerate() {
            let factor = gamma(gpu_mean_terms(leaf_size, branching, level));
            let level_ratios = level_means
                .iter()
                .enumerate()
                .map(|(node, &mean)| {
                    let count = key_count(node, span, keys.len()) as f64;
                    let exact = Float::with_val(PRECISION, &sums[level][node] / count);
                    let magnitude = Float::with_val(PRECISION, &magnitude_sums[level][node] / count).to_f64();
                    error_ratio(mean, &exact, factor * magnitude)
                })
                .collect();
            ratios.push(level_ratios);
            span *= branching;
        }
        ratios
    }

    /// How a column of test keys is drawn.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum KeyPattern {
        /// Magnitudes about the amplitude, signs alternating: the sums cancel to a mean far below the keys' magnitude
        /// (f64 sums of up to 128 such f32 keys are exact; the divisions and the levels round).
        Alternating,
        /// Magnitudes about the amplitude, all positive: the partial sums grow.
        OneSign,
        /// Magnitudes of the amplitude times `2^-40` to `2^40`, signs alternating: the leaves' sums round too.
        WideExponents,
    }

    /// One column of `len` f32 keys (bf16 and f16 keys widen to f32 exactly) of magnitude about `amplitude`.
    fn key_column(rng: &mut TestRng, len: usize, amplitude: f64, pattern: KeyPattern) -> Vec<f64> {
        (0..len)
            .map(|j| {
                let sign = if pattern != KeyPattern::OneSign && j % 2 == 1 { -1.0 } else { 1.0 };
                let binades = if pattern == KeyPattern::WideExponents { rng.random_range(-40..=40) } else { 0 };
                let key = sign * amplitude * 2f64.powi(binades) * rng.random_range(0.5..1.5);
                f64::from(key as f32)
            })
            .collect()
    }

    /// The GPU's recursive means (leaves of 64 or 128 keys by `pool_block`'s interleaved row groups, 8 or 4 of them,
    /// the last leaf partial; levels over 2 to 16 children, multiply-adds fused or not) stay at every level `ℓ` within
    /// `γ(gpu_mean_terms(C, β, ℓ)) · K` of the exact mean of the node's raw keys, on keys that cancel, keys of one
    /// sign and keys spread over 80 binades.
    #[test]
    fn gpu_level_means_stay_within_gamma_of_their_mean_terms() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[35; 32]);
        let mut worst_by_level: Vec<f64> = Vec::new();
        for case in 0..32 {
            let leaf_size = [64, 128][case % 2];
            let groups = [POOL_GROUPS, 4][(case / 2) % 2];
            let branching = rng.random_range(2..=16);
            let leaves = rng.random_range(2..=160);
            let n_keys = (leaves - 1) * leaf_size + rng.random_range(1..=leaf_size);
            let amplitude = [1.0, 1e3, 3e4][case % 3];
            let pattern = [KeyPattern::Alternating, KeyPattern::WideExponents, KeyPattern::OneSign][(case / 4) % 3];
            let keys = key_column(&mut rng, n_keys, amplitude, pattern);
            let means = gpu_means(&keys, leaf_size, branching, groups, contraction_of(case / 4), LevelMean::Recipe);
            for (level, ratios) in mean_ratios(&keys, &means, leaf_size, branching).iter().enumerate() {
                for (node, &ratio) in ratios.iter().enumerate() {
                    assert!(ratio <= 1.0, "case {case}, level {level}, node {node}: ratio {ratio}");
                }
                if worst_by_level.len() <= level {
                    worst_by_level.push(0.0);
                }
                worst_by_level[level] = ratios.iter().fold(worst_by_level[level], |w, &r| w.max(r));
            }
        }
        // Deep pyramids were drawn, and the leaves' rounding comes within a factor 1000 of its bound.
        assert!(worst_by_level.len() >= 4, "too few levels: {worst_by_level:?}");
        assert!(worst_by_level[0] > 1e-3, "worst ratios by level {worst_by_level:?}");
    }

    /// The mean of `values` computed left to right and divided once (the oracle's `mean_row`).
    fn sequential_mean(values: &[f64]) -> f64 {
        values.iter().fold(0.0, |acc, &v| acc + v) / values.len() as f64
    }

    fn exact_mean(values: &[f64]) -> Float {
        values.iter().fold(mp(0.0), |acc, &v| acc + v) / values.len() as f64
    }

    fn mean_magnitude(values: &[f64]) -> f64 {
        values.iter().map(|v| v.abs()).sum::<f64>() / values.len() as f64
    }

    /// `pisa_head_score`'s dot product of an item: the columns in ascending order, a fused multiply-add each.
    fn fused_dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).fold(0.0, |acc, (&x, &y)| x.mul_add(y, acc))
    }

    /// PISA-1's dot product: each lane's columns (`lane`, `lane + 32`, ...) by fused multiply-adds, then the butterfly.
    fn lane_dot(a: &[f64], b: &[f64]) -> f64 {
        let mut parts = [0.0; LANES];
        for c in 0..a.len() {
            parts[c % LANES] = a[c].mul_add(b[c], parts[c % LANES]);
        }
        warp_sum(parts)
    }

    /// The oracle's `dot`: left to right, a rounded product and a rounded sum each.
    fn oracle_dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).fold(0.0, |acc, (&x, &y)| acc + x * y)
    }

    /// An item's score, `α̂ · q̂·μ̂` with `α̂ = fl(1/fl(√d))` as the host and the oracle compute it, stays within
    /// `item_score_bound` of the exact `α q̄·μ` (exact means, exact `α`): for the GPU (the query block pooled by
    /// `pool_block`, the node's mean by the GPU's recursion with its mean terms, the dot product as an item's and as
    /// PISA-1's), for the oracle (left-to-right means with the node's key count as mean terms, its `dot`), and for raw
    /// keys (mean terms 0); on queries and keys whose signs alternate.
    #[test]
    fn item_scores_stay_within_the_item_bound() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[36; 32]);
        // GPU item, GPU PISA-1, oracle, raw keys.
        let mut worst = [0.0f64; 4];
        for case in 0..24 {
            let head_dim = [64, 128][case % 2];
            let rows = [1, 7, 64, 128][(case / 2) % 4];
            let leaf_size = [64, 128][(case / 8) % 2];
            let branching = rng.random_range(2..=16);
            let n_keys = rng.random_range(1..=600);
            let amplitude = [1.0, 30.0, 1e3][case % 3];
            // Columns `[d][rows]` and `[d][keys]`, each column's sign drawn so that the dot products cancel too.
            let mut queries = Vec::with_capacity(head_dim);
            let mut keys = Vec::with_capacity(head_dim);
            for _ in 0..head_dim {
                let sign = if rng.random_bool(0.5) { 1.0 } else { -1.0 };
                queries.push(key_column(&mut rng, rows, sign, KeyPattern::Alternating));
                keys.push(key_column(&mut rng, n_keys, amplitude, KeyPattern::Alternating));
            }
            let alpha = 1.0 / (head_dim as f64).sqrt();
            let exact_alpha = mp(head_dim as f64).sqrt().recip();
            let exact_query: Vec<Float> = queries.iter().map(|q| exact_mean(q)).collect();
            let exact_score = |item: &[Float]| {
                let dot =
                    exact_query.iter().zip(item).fold(mp(0.0), |acc, (q, k)| acc + Float::with_val(PRECISION, q * k));
                Float::with_val(PRECISION, &exact_alpha * dot)
            };
            let query_magnitude: Vec<f64> = queries.iter().map(|q| mean_magnitude(q)).collect();
            let magnitude_of = |item_magnitude: &[f64]| {
                alpha * query_magnitude.iter().zip(item_magnitude).map(|(q, k)| q * k).sum::<f64>()
            };
            let mut check = |form: usize, computed: f64, exact: &Float, bound: f64| {
                let ratio = error_ratio(computed, exact, bound);
                assert!(ratio <= 1.0, "case {case}, form {form}: ratio {ratio}");
                worst[form] = worst[form].max(ratio);
            };

            // The node's mean: the root of the keys' pyramid.
            let gpu_query: Vec<f64> = queries.iter().map(|q| pool_block_mean(q, POOL_GROUPS)).collect();
            let gpu_levels: Vec<Vec<Vec<f64>>> = keys
                .iter()
                .map(|k| gpu_means(k, leaf_size, branching, POOL_GROUPS, Contraction::Fused, LevelMean::Recipe))
                .collect();
            let top = gpu_levels[0].len() - 1;
            let gpu_mean: Vec<f64> = gpu_levels.iter().map(|levels| levels[top][0]).collect();
            let oracle_query: Vec<f64> = queries.iter().map(|q| sequential_mean(q)).collect();
            let oracle_mean: Vec<f64> = keys.iter().map(|k| sequential_mean(k)).collect();
            let exact = exact_score(&keys.iter().map(|k| exact_mean(k)).collect::<Vec<_>>());
            let magnitude = magnitude_of(&keys.iter().map(|k| mean_magnitude(k)).collect::<Vec<_>>());
            let gpu_bound = item_score_bound(magnitude, rows, gpu_mean_terms(leaf_size, branching, top), head_dim);
            check(0, alpha * fused_dot(&gpu_query, &gpu_mean), &exact, gpu_bound);
            check(1, alpha * lane_dot(&gpu_query, &gpu_mean), &exact, gpu_bound);
            let oracle_bound = item_score_bound(magnitude, rows, oracle_mean_terms(n_keys), head_dim);
            check(2, oracle_dot(&oracle_query, &oracle_mean) * alpha, &exact, oracle_bound);

            // Raw keys: the first and the last.
            for j in [0, n_keys - 1] {
                let key: Vec<f64> = keys.iter().map(|k| k[j]).collect();
                let exact = exact_score(&key.iter().map(|&k| mp(k)).collect::<Vec<_>>());
                let bound =
                    item_score_bound(magnitude_of(&key.iter().map(|k| k.abs()).collect::<Vec<_>>()), rows, 0, head_dim);
                check(3, alpha * fused_dot(&gpu_query, &key), &exact, bound);
                check(3, oracle_dot(&oracle_query, &key) * alpha, &exact, bound);
            }
        }
        // The bound counts every rounding at its worst (`m + T + d + 3` of them), so random inputs reach a small
        // fraction of it, but not a vanishing one.
        assert!(worst.iter().all(|&r| r > 1e-5), "worst ratios (GPU item, GPU PISA-1, oracle, raw keys) {worst:?}");
    }

    /// PISA-1 from the group's summed query (`pisa_select`'s `q̃`: the heads' pooled queries added in ascending order,
    /// then the lane dot product with the node's GPU mean) stays within `presummed_score_bound` of the exact
    /// `Σ_h α q̄_h·μ`, over 1 to 16 heads whose queries cancel across heads and columns; random inputs reach a small
    /// fraction of the bound, but not a vanishing one.
    #[test]
    fn presummed_pisa1_scores_stay_within_the_presummed_bound() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[41; 32]);
        let mut worst = 0.0f64;
        for case in 0..32 {
            let head_dim = [64, 128][case % 2];
            let rows = [1, 7, 64, 128][(case / 2) % 4];
            let group = [1, 2, 3, 7, 8, 16][case % 6];
            let (leaf_size, branching) = (64, rng.random_range(2..=16));
            let n_keys = rng.random_range(1..=600);
            let amplitude = [1.0, 30.0, 1e3][case % 3];
            let keys: Vec<Vec<f64>> =
                (0..head_dim).map(|_| key_column(&mut rng, n_keys, amplitude, KeyPattern::Alternating)).collect();
            // Per head, per column: the rows' queries; signs drawn per (head, column) so heads cancel too.
            let queries: Vec<Vec<Vec<f64>>> = (0..group)
                .map(|_| {
                    (0..head_dim)
                        .map(|_| {
                            let sign = if rng.random_bool(0.5) { 1.0 } else { -1.0 };
                            key_column(&mut rng, rows, sign, KeyPattern::Alternating)
                        })
                        .collect()
                })
                .collect();
            let alpha = 1.0 / (head_dim as f64).sqrt();
            let exact_alpha = mp(head_dim as f64).sqrt().recip();
            let exact_mean_key: Vec<Float> = keys.iter().map(|k| exact_mean(k)).collect();
            let exact = queries.iter().fold(mp(0.0), |acc, head| {
                let dot = head
                    .iter()
                    .zip(&exact_mean_key)
                    .fold(mp(0.0), |acc, (q, k)| acc + Float::with_val(PRECISION, &exact_mean(q) * k));
                acc + Float::with_val(PRECISION, &exact_alpha * dot)
            });
            let key_magnitude: Vec<f64> = keys.iter().map(|k| mean_magnitude(k)).collect();
            let magnitude_sum: f64 = queries
                .iter()
                .map(|head| alpha * head.iter().zip(&key_magnitude).map(|(q, k)| mean_magnitude(q) * k).sum::<f64>())
                .sum();
            let summed: Vec<f64> = (0..head_dim)
                .map(|c| queries.iter().fold(0.0, |acc, head| acc + pool_block_mean(&head[c], POOL_GROUPS)))
                .collect();
            let levels: Vec<Vec<Vec<f64>>> = keys
                .iter()
                .map(|k| gpu_means(k, leaf_size, branching, POOL_GROUPS, Contraction::Fused, LevelMean::Recipe))
                .collect();
            let top = levels[0].len() - 1;
            let mean: Vec<f64> = levels.iter().map(|l| l[top][0]).collect();
            let bound =
                presummed_score_bound(magnitude_sum, rows, group, gpu_mean_terms(leaf_size, branching, top), head_dim);
            let ratio = error_ratio(alpha * lane_dot(&summed, &mean), &exact, bound);
            assert!(ratio <= 1.0, "case {case}: ratio {ratio}");
            worst = worst.max(ratio);
        }
        assert!(worst > 1e-5, "worst ratio {worst}");
        // The summed query is a pooled query of `m + G − 1` roundings; one head adds none.
        assert_eq!(presummed_score_bound(2.0, 64, 8, 100, 128), item_score_bound(2.0, 71, 100, 128));
        assert_eq!(presummed_score_bound(2.0, 64, 1, 100, 128), item_score_bound(2.0, 64, 100, 128));
    }

    /// The f64 value at an end of `x ± e` (`up` picks the end), stepped back inside where rounding took it outside.
    fn at_an_end(x: f64, e: f64, up: bool) -> f64 {
        let y = if up { x + e } else { x - e };
        let outside = (mp(y) - x).abs() > e;
        match (outside, up) {
            (true, true) => y.next_down(),
            (true, false) => y.next_up(),
            (false, _) => y,
        }
    }

    /// A candidate's score summed over 1 to 16 heads in ascending order (the kernel's `total += score` and the
    /// oracle's fold), each head's computed score at an end of its bound around its exact score, and the heads' scores
    /// cancelling, stays within `group_bound` of the exact sum; with every head off the same way the heads' bounds add
    /// up and the bound is nearly reached.
    #[test]
    fn group_sums_stay_within_the_group_bound() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[37; 32]);
        let mut worst = 0.0f64;
        for case in 0..480 {
            let heads = case % 16 + 1;
            let scale = [1.0, 1e3, 1e6][(case / 16) % 3];
            let relative_error = [1e-15, 1e-12, 1e-8][(case / 48) % 3];
            let same_way = rng.random_bool(0.5);
            let up = rng.random_bool(0.5);
            let mut computed = Vec::with_capacity(heads);
            let mut head_bounds = Vec::with_capacity(heads);
            let mut exact = mp(0.0);
            for h in 0..heads {
                let sign = if h % 2 == 0 { 1.0 } else { -1.0 };
                let score: f64 = sign * scale * rng.random_range(0.5..1.5);
                let bound = relative_error * score.abs() * rng.random_range(0.5..2.0);
                computed.push(at_an_end(score, bound, if same_way { up } else { rng.random_bool(0.5) }));
                head_bounds.push(bound);
                exact += score;
            }
            let total = computed.iter().fold(0.0, |acc, &s| acc + s);
            let bound = group_bound(&head_bounds, computed.iter().map(|s| s.abs()).sum());
            let ratio = error_ratio(total, &exact, bound);
            assert!(ratio <= 1.0, "case {case} ({heads} heads): ratio {ratio}");
            worst = worst.max(ratio);
        }
        assert!(worst > 0.9, "worst ratio {worst}");
    }

    /// The bounds can fail: an LSE without the maximum (its exponentials overflow for scores near 800 and all
    /// underflow near −800), an LSE and a PISA-2 that ignore the weights, and level means that divide by `β` instead
    /// of the key count (right for full nodes, wrong for the partial last one) each break their bound, where the
    /// recipe on the same inputs keeps it.
    #[test]
    fn broken_evaluations_break_the_bounds() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[38; 32]);
        let within = |computed: f64, exact: &Float, bound: f64| error_of(computed, exact) <= bound;
        for center in [800.0, -800.0] {
            let node = Node { scores: (0..64).map(|i| center + f64::from(i) / 64.0).collect(), weights: vec![1.0; 64] };
            let exact = exact_lse(&node.exact_scores(), &node.weights);
            let bound = lse_bound(0.0, node.items(), node.total_weight(), node.max_abs_item());
            let recipe = kernel_lse(&mut rng, &node, Contraction::Fused, Evaluation::Recipe);
            assert!(within(recipe, &exact, bound), "center {center}: the recipe {recipe}");
            let broken = kernel_lse(&mut rng, &node, Contraction::Fused, Evaluation::NoMaximum);
            assert!(!within(broken, &exact, bound), "center {center}: no maximum {broken}, exact {exact}");
        }

        // A heavy child with a low score and a light child with a high one.
        let node = Node { scores: vec![0.0, 5.0], weights: vec![1048576.0, 1.0] };
        let exact = exact_lse(&node.exact_scores(), &node.weights);
        let bound = lse_bound(0.0, 2, node.total_weight(), node.max_abs_item());
        assert!(within(kernel_lse(&mut rng, &node, Contraction::Fused, Evaluation::Recipe), &exact, bound));
        let broken = kernel_lse(&mut rng, &node, Contraction::Fused, Evaluation::Unweighted);
        assert!(!within(broken, &exact, bound), "unweighted LSE {broken}, exact {exact}");
        let exact = exact_pisa2(&node.exact_scores(), &node.weights);
        let (spread, variance) = node.spread_and_variance();
        let bound = pisa2_bound(0.0, 2, node.max_abs_item(), spread, variance);
        assert!(within(kernel_pisa2(&node, Contraction::Fused, Evaluation::Recipe), &exact, bound));
        let broken = kernel_pisa2(&node, Contraction::Fused, Evaluation::Unweighted);
        assert!(!within(broken, &exact, bound), "unweighted PISA-2 {broken}, exact {exact}");

        // Six leaves of 64 keys, the last holding 10; four children a node: level 1 has a full node and a partial one.
        let (leaf_size, branching) = (64, 4);
        let keys = key_column(&mut rng, 5 * leaf_size + 10, 1.0, KeyPattern::OneSign);
        let recipe = gpu_means(&keys, leaf_size, branching, POOL_GROUPS, Contraction::Fused, LevelMean::Recipe);
        let ratios = mean_ratios(&keys, &recipe, leaf_size, branching);
        assert!(ratios.iter().flatten().all(|&r| r <= 1.0), "the recipe: {ratios:?}");
        let broken =
            gpu_means(&keys, leaf_size, branching, POOL_GROUPS, Contraction::Fused, LevelMean::DividedByBranching);
        let ratios = mean_ratios(&keys, &broken, leaf_size, branching);
        assert!(ratios[1][0] <= 1.0, "the full node: {ratios:?}");
        assert!(ratios[1][1] > 1.0, "the partial node: {ratios:?}");
    }

    /// The bounds are a few hundred units of roundoff for ordinary nodes, not more: an LSE of 64 unit-weight items of
    /// magnitude 10 is bounded below `10^-13`, their PISA-2 (spread 3, variance 4) below `2 · 10^-13`, an item score
    /// of a level-3 mean below `4 · 10^-14` of its magnitude; every bound grows with each of its counts and adds its
    /// item error.
    #[test]
    fn the_bounds_are_small_for_ordinary_nodes() {
        let lse = lse_bound(0.0, 64, 64.0, 10.0);
        assert!(lse < 1e-13 && lse > 2.0 * gamma(68), "{lse:e}");
        assert_eq!(lse_bound(1e-9, 64, 64.0, 10.0), 1e-9 + lse);
        assert!(lse_bound(0.0, 65, 64.0, 10.0) > lse && lse_bound(0.0, 64, 128.0, 10.0) > lse);
        assert!(lse_bound(0.0, 64, 64.0, 11.0) > lse);
        let pisa2 = pisa2_bound(0.0, 64, 10.0, 3.0, 4.0);
        assert!(pisa2 < 2e-13 && pisa2 > gamma(69) * 14.0, "{pisa2:e}");
        assert!(pisa2_bound(1e-9, 64, 10.0, 3.0, 4.0) > pisa2 + 7e-9);
        // The formulas of the module docs, term by term, at values where every term shows in the result.
        let u = UNIT_ROUNDOFF;
        let (x, w) = (1e3, 2f64.powi(30));
        let lse_terms = 2.0 * gamma(12) + u * (6.0 * x + 12.0 * w.ln() + 6.0);
        assert_eq!(lse_bound(0.0, 8, w, x), MARGIN * lse_terms);
        assert_eq!(lse_bound(0.5, 8, w, x), 0.5 + MARGIN * lse_terms);
        let (e, n, d, v) = (1e-3, 8, 7.0, 50.0);
        let shift = gamma(n + 1) * x;
        let pisa2_terms = e * (1.0 + 2.0 * (d + 2.0 * e) + 2.0 * e) + gamma(n + 5) * (x + v);
        assert_eq!(pisa2_bound(e, n, x, d, v), MARGIN * pisa2_terms + shift * shift);
        // Without item errors and with large scores, the computed mean's shift of the variance shows too.
        let x = 1e6;
        let shift = gamma(n + 1) * x;
        assert_eq!(pisa2_bound(0.0, n, x, d, v), MARGIN * gamma(n + 5) * (x + v) + shift * shift);
        assert_eq!(gpu_mean_terms(64, 8, 0), 64);
        assert_eq!(gpu_mean_terms(64, 8, 3), 64 + 3 * 9);
        assert_eq!(oracle_mean_terms(4096), 4096);
        let item = item_score_bound(1.0, 64, gpu_mean_terms(64, 8, 3), 128);
        assert_eq!(item, MARGIN * gamma(64 + 91 + 128 + 3));
        assert!(item < 4e-14, "{item:e}");
        // One head has no sum to round; more heads add their bounds and the sum's rounding.
        assert_eq!(group_bound(&[1e-14], 5.0), MARGIN * 1e-14);
        assert!(group_bound(&[1e-14; 8], 80.0) > 8e-14 + gamma(7) * 80.0);
        assert_eq!(group_bound(&[], 0.0), 0.0);
    }

    /// The emulated oracle forms are the oracle's own f64 scores bit for bit: on pyramids of one column (`d = 1`, the
    /// query 1, so every item's score is the item itself) the oracle's LSE and PISA-2 of every node, leaves (raw keys,
    /// weight 1) and coarser nodes (child means, weighted by count, the last partial), equal [`oracle_lse`] and
    /// [`oracle_pisa2`] of the same items.
    #[test]
    fn the_emulated_oracle_is_the_oracle_bit_for_bit() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[39; 32]);
        let query = Array1::from(vec![1.0]);
        for case in 0..12 {
            let leaf_size = rng.random_range(1..=128);
            let branching = rng.random_range(2..=16);
            let n_keys = rng.random_range(1..=2000);
            let values: Vec<f64> = (0..n_keys).map(|_| 300.0 * rng.random_range(-1.0..=1.0)).collect();
            let keys = Array2::from_shape_vec((n_keys, 1), values).expect("a column");
            let config = PyramidConfig { leaf_size, branching, keep: 1, scoring: Scoring::Lse };
            let pyramid = Pyramid::build(keys.view(), &config, ()).expect("a pyramid");
            for level in 0..pyramid.levels().len() {
                for index in 0..pyramid.width(level) {
                    let node = if level == 0 {
                        let scores: Vec<f64> = pyramid.key_range(0, index).map(|j| keys[[j, 0]]).collect();
                        Node { weights: vec![1.0; scores.len()], scores }
                    } else {
                        let below = &pyramid.levels()[level - 1];
                        let children = pyramid.children(level, index);
                        Node {
                            scores: children.clone().map(|c| below.means[[c, 0]]).collect(),
                            weights: children.map(|c| below.counts[c] as f64).collect(),
                        }
                    };
                    for (scoring, emulated) in
                        [(Scoring::Lse, oracle_lse(&node)), (Scoring::Pisa2, oracle_pisa2(&node))]
                    {
                        let oracle = pyramid.node_score(level, index, query.view(), scoring).expect("a node");
                        assert_eq!(oracle.to_bits(), emulated.to_bits(), "case {case}, level {level}, node {index}");
                    }
                }
            }
        }
    }

    /// The kernel's E30 recipe for one pair (`pisa_block_mass`: fused dot, `fl(dot · α̂)`, the online pass 1, pass 2
    /// per key), `keys` rows of `d` values: the probabilities it adds, in key order.
    fn kernel_probabilities(query: &[f64], keys: &[Vec<f64>], alpha: f64) -> Vec<f64> {
        let score = |k: &Vec<f64>| query.iter().zip(k).fold(0.0f64, |acc, (q, k)| q.mul_add(*k, acc)) * alpha;
        let (mut m, mut l) = (f64::NEG_INFINITY, 0.0f64);
        for k in keys {
            let x = score(k);
            if x > m {
                l = l * (m - x).exp() + 1.0;
                m = x;
            } else {
                l += (x - m).exp();
            }
        }
        keys.iter().map(|k| (score(k) - m).exp() / l).collect()
    }

    /// The kernel's recipe and the oracle's f64 `diagnostics` stay within `mass_relative_bound` of the 256-bit masses
    /// on pairs with large logits (scores over a range of about 200), a leaf's keys scattered over the range, and
    /// the bound stays below `1e-11`: far below what a wrong mass changes.
    #[test]
    fn block_masses_stay_within_the_mass_bound() {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[31; 32]);
        let (d, n, leaf, heads) = (16usize, 200usize, 64usize, 3usize);
        let alpha = 1.0 / (d as f64).sqrt();
        for case in 0..8 {
            let amplitude = [1.0, 8.0, 20.0][case % 3];
            let keys: Vec<Vec<f64>> = (0..n)
                .map(|_| {
                    (0..d).map(|_| (rng.random::<f64>() - 0.5) * amplitude).map(|x| (x * 64.0).round() / 64.0).collect()
                })
                .collect();
            let queries: Vec<Vec<f64>> = (0..heads)
                .map(|_| {
                    (0..d).map(|_| (rng.random::<f64>() - 0.5) * amplitude).map(|x| (x * 64.0).round() / 64.0).collect()
                })
                .collect();
            let leaves = n.div_ceil(leaf);
            let mut kernel = vec![0.0; leaves];
            let mut exact = vec![Float::with_val(PRECISION, 0); leaves];
            let (mut e, mut range) = (0.0f64, 0.0f64);
            for q in &queries {
                for (j, p) in kernel_probabilities(q, &keys, alpha).into_iter().enumerate() {
                    kernel[j / leaf] += p;
                }
                let exact_scores: Vec<Float> =
                    keys.iter()
                        .map(|k| {
                            let dot = q.iter().zip(k).fold(Float::with_val(PRECISION, 0), |acc, (a, b)| {
                                acc + Float::with_val(PRECISION, a * b)
                            });
                            dot / Float::with_val(PRECISION, d).sqrt()
                        })
                        .collect();
                let total = exact_scores.iter().fold(Float::with_val(PRECISION, 0), |acc, x| acc + x.clone().exp());
                for (j, x) in exact_scores.iter().enumerate() {
                    exact[j / leaf] += x.clone().exp() / &total;
                }
                let magnitudes = keys.iter().map(|k| alpha * q.iter().zip(k).map(|(a, b)| (a * b).abs()).sum::<f64>());
                e = e.max(magnitudes.fold(0.0, f64::max) * gamma(d + 3) * MARGIN);
                let xs: Vec<f64> = exact_scores.iter().map(|x| x.to_f64()).collect();
                let (lo, hi) =
                    xs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| (lo.min(x), hi.max(x)));
                range = range.max(hi - lo + 2.0 * e);
            }
            let r = mass_relative_bound(e, range, n, heads * leaf);
            assert!(r < 1e-11, "case {case}: r = {r:e} is not small");
            let key_rows = Array2::from_shape_fn((n, d), |(j, c)| keys[j][c]);
            let query_rows = Array2::from_shape_fn((heads, d), |(h, c)| queries[h][c]);
            let config = PyramidConfig { leaf_size: leaf, branching: 2, keep: 1, scoring: Scoring::Lse };
            let pyramid = Pyramid::build(key_rows.view(), &config, ()).unwrap();
            let query = attnproof_oracle::pyramid::PyramidQuery { heads: query_rows.view(), position: n - 1 };
            let oracle = attnproof_oracle::pyramid::diagnostics(&pyramid, &query, &[], 1).unwrap().block_mass;
            for b in 0..leaves {
                let truth = exact[b].to_f64() / heads as f64;
                for (name, mass) in [("kernel", kernel[b] / heads as f64), ("oracle", oracle[b])] {
                    let error = (mass - truth).abs();
                    assert!(error <= r * truth, "case {case} leaf {b}: {name} {mass:e} vs {truth:e}, error {error:e}");
                }
            }
        }
    }

    /// `mass_relative_bound` term by term, at inputs where one term dominates each time (the f64-against-MPFR test
    /// cannot see the `u`-level terms: real errors stay far below them).
    #[test]
    fn the_mass_bound_is_the_derived_formula_term_by_term() {
        let u = UNIT_ROUNDOFF;
        let expected = |e: f64, range: f64, keys: usize, terms: usize| {
            let rho = 2.0 * e + 3.0 * u * range + 2.0 * gamma(5 * keys + 4);
            MARGIN * (rho.exp() * (1.0 + gamma(terms + 1)) - 1.0)
        };
        for (e, range, keys, terms) in [
            (1e-6, 0.0, 0, 0),
            (0.0, 1e6, 0, 0),
            (0.0, 0.0, 1_000_000, 0),
            (0.0, 0.0, 0, 1_000_000_000),
            (0.0, 0.0, 0, 0),
        ] {
            let r = mass_relative_bound(e, range, keys, terms);
            let want = expected(e, range, keys, terms);
            assert!((r - want).abs() <= 1e-12 * want, "({e}, {range}, {keys}, {terms}): {r:e} vs {want:e}");
        }
        // The dominant term's size, from its definition: 2e, 3uR, 2·γ(5n + 4) ≈ 10nu, γ(T + 1) ≈ Tu.
        assert!((mass_relative_bound(1e-6, 0.0, 0, 0) / (MARGIN * 2e-6) - 1.0).abs() < 1e-5);
        assert!((mass_relative_bound(0.0, 1e6, 0, 0) / (MARGIN * 3e6 * u) - 1.0).abs() < 1e-2);
        assert!((mass_relative_bound(0.0, 0.0, 1_000_000, 0) / (MARGIN * 1e7 * u) - 1.0).abs() < 1e-2);
        assert!((mass_relative_bound(0.0, 0.0, 0, 1_000_000_000) / (MARGIN * 1e9 * u) - 1.0).abs() < 1e-2);
    }
}
