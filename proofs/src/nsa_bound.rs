//! The rounding-error bounds of NSA's GPU pieces (E18): the compressed keys and values as the GPU kernel
//! `nsa_compress.cu` and the CPU reference `attnproof_reference::sparse::nsa::compress_head` compute them (how far a
//! stored compressed element can lie from an f64 evaluation of the same window, the oracle's `nsa::compress` in f64,
//! which is what a verifier holds a kernel to), and the gated sum of the three branches and its gradients as
//! `nsa_gates.cu` computes them (section "The gates" below).
//!
//! # The recipe
//!
//! One element is `y = Σ_{i<l} w_i x_i` (weights) or `y = (Σ_{i<l} x_i) / l` (the mean) over one column of one
//! window's `l` rows, the `x_i` exact in the storage type `T`. The kernel widens them to f64, accumulates in ascending
//! position (one fused multiply-add per position for weights; additions, then one division for the mean), rounds
//! the f64 result `ŷ` to f32 and that to `T`, both to nearest: `out = fl_T(fl_32(ŷ))`.
//!
//! # The bound
//!
//! With `M` the magnitude (`Σ_i |w_i x_i|` for weights, `Σ_i |x_i| / l` for the mean), `u = 2^-53`,
//! `γ(n) = nu/(1 − nu)`, `u_T` and `τ_T` the storage type's unit roundoff and smallest positive subnormal, `u_32`
//! f32's and `τ_32` its smallest subnormal, and `y_ref` the oracle's f64 value:
//!
//! `|out − y_ref| ≤ r · (|y_ref| + 2e) + 2e + τ_T + τ_32`, with `r = u_T + u_32 + u_T u_32`, `e = γ(l) M + 2l·2^-1074`.
//!
//! Derivation (Higham's lemmas):
//! - the kernel's f64 value: `l` roundings (the fused multiply-adds, or `l − 1` additions and the division), each
//!   relative to a partial result bounded by `M`'s partial sums, so `|ŷ − y| ≤ γ(l) M`; a result below f64's normal
//!   range loses at most half a subnormal unit per operation, the `2l·2^-1074` term. The oracle's f64 value (products
//!   and a sum, or a sum and a division, in any order) obeys the same bound: `|y_ref − y| ≤ e`, so `|ŷ| ≤ |y_ref| + 2e`;
//! - rounding to f32 then to `T`: `|fl_32(ŷ) − ŷ| ≤ u_32 |ŷ| + τ_32/2` and `|fl_T(z) − z| ≤ u_T |z| + τ_T/2` with
//!   `|z| ≤ (1 + u_32)|ŷ| + τ_32/2`, so `|out − ŷ| ≤ r |ŷ| + τ_T + τ_32` (the subnormal halves rounded up);
//! - `|out − y_ref| ≤ |out − ŷ| + |ŷ − y| + |y − y_ref|`.
//!
//! The bound takes a relative margin of `2^-10` so that its own f64 evaluation cannot make it smaller than the truth.
//! The rounding to `T` dominates: at `l = 32` the f64 term is about `2^-48 M`. A kernel that drops a row (error
//! about `M/l`) is far outside the bound; one that accumulates in f32 (error about `2^-19 M`) is inside it, and only
//! the bitwise comparison with the CPU reference, which the GPU tests also make, tells it apart.
//!
//! # The gates
//!
//! `nsa_gates.cu` computes `σ̂(x) = fl(1 / fl(1 + ê))` with `ê = expf(−x)` (CUDA's `expf`: at most 2 ulp, so
//! `|ê − e| ≤ 4u_32 e` where `e` is normal). Then `fl(1 + ê) = (1 + e)(1 + θ)` with `|θ| ≤ γ_32(5)` (the `4u_32 e` is
//! below `4u_32 (1 + e)`, plus the addition's rounding), and the division adds one more rounding and the inverse
//! of `1 + θ`: `σ̂ = σ(1 + η)`, `|η| ≤ γ_32(7)` ([`SIGMOID_TERMS`]). Where `σ` falls below f32's normal range, or `expf`
//! overflows to infinity (`x < −88.7`, `σ < 2^-127`), the result is off by at most [`SIGMOID_ABSOLUTE`] = `2^-126`.
//!
//! - **Gated sum** `O = Σ_b σ_b o_b`: `acc = fl(σ̂_0 o_0)`, then `fmaf(σ̂_1, o_1, acc)`, `fmaf(σ̂_2, o_2, acc)`: three
//!   roundings, `γ_32(3)` of `Σ|σ̂_b o_b|`, with `σ̂`'s own `γ_32(7)` of `A = Σ_b σ_b |o_b|` and `2^-126` per branch
//!   magnitude: `err_32 = γ_32(10) A + 2·2^-126 Σ_b|o_b| + 4τ_32`. One rounding to `T` adds `u_T |acc| + τ_T`. The oracle's
//!   f64 value is within `γ(12) A` of the exact one. [`gate_combine_bound`].
//! - **Branch gradients** `dO_b = σ_b dO`: one f32 product of `σ̂_b` and `dO`, `γ_32(8)` relative plus
//!   `2^-126 |dO|`, then one rounding to `T`. [`gate_branch_gradient_bound`].
//! - **Logit gradients** `σ(x) σ(−x) ⟨dO, o_b⟩`, kept in f32: each factor `σ̂(±x)` within `γ_32(7)` (and `2^-126`), their
//!   product and the product with the dot product two roundings, the dot product of `dv` terms in any order
//!   `γ_32(dv)` of `D = Σ_e |dO_e o_{b,e}|`: `γ_32(dv + 16) σσ' D + 4·2^-126 D` and subnormal terms, plus the oracle's
//!   f64 error `γ(dv + 20) σσ' D`. Writing `σ'` as `σ(x) σ(−x)` keeps this relative: `1 − σ̂(x)` would lose every digit
//!   where the gate is near 1. [`gate_logit_gradient_bound`].

//!
//! # The block scores
//!
//! `nsa_select.cu` ranks each (token, KV head)'s selection blocks by `S_j = Σ_c w_cj Σ_h p_hc` (E19), with
//! `w_cj = |window c ∩ block j| / s` and `p_hc = exp(x_hc)`, `x_hc = α q_h·k̃_c − LSE_h`, from the layer's queries,
//! the compressed keys and the compressed attention's LSE as stored (the bound is for those inputs). The kernel:
//! `ŝ` = the dot product by tensor-core MMAs (`|ŝ − s| ≤ γ'(d) Σ_e |q_e k̃_e|`); `x̂ = fl(ŝ α̂)` with `α̂ = fl32(α)`;
//! the argument `fl(x̂ L̂ − fl(LSE · L̂))` with `L̂ = fl32(log2 e)`; `p̂ = ex2.approx.ftz` of it; `q̂_c` the f32 sum of the
//! group's `p̂` in ascending head order; `Ŝ` one `fmaf(q̂_c, fl(overlap / s), acc)` per window in ascending order.
//!
//! - In natural-log units the argument is `(x̂(1 + θ_3) − LSE(1 + θ_3)(1 + θ_4))(1 + θ_5)` with `|θ_i| ≤ u`, so with
//!   `m = |α| Σ_e |q_e k̃_e|` its distance from `x` is at most `ε = (γ'(d) + 5u) m + 3u|LSE| + 2u|x|` (the scale's
//!   and the product's roundings `2u m`, `L̂`'s `u|x̂|` and the shift's `2u|LSE|`, the difference's `u|x̂ − LSE|`,
//!   each second-order term rounded up into the next `u`).
//! - `ex2.approx` adds a relative error `e` (5u) and flushes results below `2^-126` (`τ_e`) to zero:
//!   `p̂ ∈ [p e^{−ε}(1 − e) − τ_e, p e^{ε}(1 + e)]`, so `|p̂ − p| ≤ p (e^{ε}(1 + e) − 1) + τ_e`.
//! - The group sum (`G − 1` additions), the weight's rounding (`u`) and the `n_c` fused multiply-adds of the block's
//!   windows act on sums of non-negative terms: a factor `(1 + γ_32(G − 1 + n_c))(1 + u)` on the sum of `ŵ p̂`.
//! - Hence `|Ŝ − S| ≤ Σ_{c,h} w_cj [p_hc ((e^{ε_hc}(1 + e))(1 + γ_32(G − 1 + n_c))(1 + u) − 1) + τ_e (…)]`, exact
//!   (no first-order truncation: the deviation below is smaller than the one above by convexity). The whole takes the
//!   margin `2^-10`, which also covers the f64 truth's own error: its exponent is off by at most `γ_64(d + 2)` times
//!   `m + |LSE|` and its sums by `γ_64(G + n_c)`, below `2^-20` of the terms `5u m + 3u|LSE|` and `e` the bound
//!   already charges per term.
//!
//! A kernel that drops a head of the group, a window of the remap or shifts a window by one block is off by a whole
//! term `w p`, far outside; the integer lists are compared exactly on the kernel's own scores (the harness), so the
//! bound only has to explain swaps against the lists of the exact scores.
//!
//! # The layer's gradient sum
//!
//! A layer's dQ, dK and dV are each the sum of its three branches' gradients (compressed, selected, window), each
//! branch's stored in the storage type `T`. `nsa_branch_sum` (in `nsa_gates.cu`) widens the three to f32, adds them in
//! that fixed order, `ŝ = fl32(fl32(a + b) + c)`, and rounds once to `T`. With `M = |a| + |b| + |c|`, `y = a + b + c`
//! exact and `y_ref` its f64 evaluation (the verifier's reference):
//!
//! - each f32 addition is exact where its result is subnormal (both operands are multiples of f32's smallest
//!   subnormal), so two additions give `|ŝ − y| ≤ u_32|a + b| + u_32(|fl(a + b)| + |c|) ≤ γ_32(2) M`;
//! - the f64 reference obeys the same with `u = 2^-53`: `|y_ref − y| ≤ γ(2) M`;
//! - rounding to `T`: `|out − ŝ| ≤ u_T|ŝ| + τ_T/2` with `|ŝ| ≤ |y_ref| + γ(2) M + γ_32(2) M`.
//!
//! Hence `|out − y_ref| ≤ u_T(|y_ref| + γ(2)M + γ_32(2)M) + γ_32(2)M + γ(2)M + τ_T`, with the file's margin
//! ([`branch_sum_bound`]). The standard model needs no overflow: the bound holds for every finite output (an f32
//! partial sum that overflowed leaves the output infinite or NaN). bf16's largest values lie so close to f32's that
//! two of them overflow the first f32 addition; an infinite output is right only where the exact sum itself rounds to
//! that infinity in `T`, which the verifier checks, so a cancelling sum of such values (never met by gradients) is
//! reported rather than hidden. A sum rounded to `T` between the two additions loses a term below half an ulp of the
//! partial sum, far outside the bound under cancellation (the unit test shows it).

use crate::f64_oracle_bound::{SUBNORMAL_UNIT, gamma};
use crate::flash_bound::{F32_SUBNORMAL, F32_UNIT_ROUNDOFF};

/// Relative slack for the bound's own f64 evaluation.
const MARGIN: f64 = 1.0 + 1.0 / 1024.0;

/// The storage type's rounding: unit roundoff `u_T` and smallest positive subnormal `τ_T`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StorageRounding {
    /// `u_T = 2^-p` (bf16: `2^-8`, f16: `2^-11`).
    pub unit_roundoff: f64,
    /// `τ_T` (bf16: `2^-133`, f16: `2^-24`).
    pub subnormal: f64,
}

/// The f64 evaluation error `e = γ(l) M + 2l·2^-1074` of one compressed element of magnitude `magnitude` over a
/// window of `compress_len` rows (module docs).
pub fn f64_evaluation_error(magnitude: f64, compress_len: usize) -> f64 {
    gamma(compress_len) * magnitude + 2.0 * compress_len as f64 * SUBNORMAL_UNIT
}

/// The bound on `|out − y_ref|` for a stored compressed element against the oracle's f64 value `reference`, of
/// magnitude `magnitude` (`Σ|w_i x_i|`, or `Σ|x_i| / l` for the mean) over `compress_len` rows, stored in a type of
/// rounding `storage` (module docs).
pub fn compression_bound(reference: f64, magnitude: f64, compress_len: usize, storage: StorageRounding) -> f64 {
    let u = storage.unit_roundoff;
    let r = u + F32_UNIT_ROUNDOFF + u * F32_UNIT_ROUNDOFF;
    let e = f64_evaluation_error(magnitude, compress_len);
    MARGIN * (r * (reference.abs() + 2.0 * e) + 2.0 * e + storage.subnormal + F32_SUBNORMAL)
}

/// Relative error of the kernels' f32 sigmoid `σ̂(x) = fl(1 / fl(1 + expf(−x)))` (module docs, "The gates"):
/// `|σ̂ − σ| ≤ γ_32(7) σ + 2^-126`.
pub const SIGMOID_TERMS: usize = 7;

/// Absolute part of the f32 sigmoid's error: a gate below f32's normal range (or an `expf` that overflowed to
/// infinity, `σ < 2^-127`) is off by at most `2^-126`.
pub const SIGMOID_ABSOLUTE: f64 = 1.0 / (1u128 << 126) as f64;

/// `γ(n)` of f32's unit roundoff.
fn gamma32(n: usize) -> f64 {
    let nu = n as f64 * F32_UNIT_ROUNDOFF;
    nu / (1.0 - nu)
}

/// The bound on `|O − O_ref|` for one element of the gated sum `O = Σ_b σ(x_b) o_b` against the oracle's f64 value
/// `reference`, with `magnitude = Σ_b σ(x_b) |o_b|` and `branch_sum = Σ_b |o_b|` (module docs, "The gates").
pub fn gate_combine_bound(reference: f64, magnitude: f64, branch_sum: f64, storage: StorageRounding) -> f64 {
    let u = storage.unit_roundoff;
    let e64 = gamma(12) * magnitude;
    let err32 = gamma32(SIGMOID_TERMS + 3) * magnitude + 2.0 * SIGMOID_ABSOLUTE * branch_sum + 4.0 * F32_SUBNORMAL;
    MARGIN * (u * (reference.abs() + e64 + err32) + err32 + e64 + storage.subnormal)
}

/// The bound on `|dO_b − dO_b,ref|` for one element of a branch's upstream gradient `σ(x_b) dO` against the oracle's
/// f64 value `reference`, with `d_out = |dO|` of that element (module docs, "The gates").
pub fn gate_branch_gradient_bound(reference: f64, d_out: f64, storage: StorageRounding) -> f64 {
    let u = storage.unit_roundoff;
    let e64 = gamma(8) * reference.abs();
    let err32 = gamma32(SIGMOID_TERMS + 1) * (reference.abs() + e64) + SIGMOID_ABSOLUTE * d_out + F32_SUBNORMAL;
    MARGIN * (u * (reference.abs() + e64 + err32) + err32 + e64 + storage.subnormal)
}

/// The bound on `|dx_b − dx_b,ref|` for one gate logit's gradient `σ(x) σ(−x) ⟨dO, o_b⟩` (kept in f32), with
/// `sigma_product = σ(x) σ(−x)` (at most 1/4), `dot_magnitude = Σ_e |dO_e o_{b,e}|` and `dv` terms in the dot product
/// (module docs, "The gates").
pub fn gate_logit_gradient_bound(sigma_product: f64, dot_magnitude: f64, dv: usize) -> f64 {
    let relative = gamma32(dv + 2 * SIGMOID_TERMS + 2) + gamma(dv + 20);
    MARGIN
        * (relative * sigma_product * dot_magnitude
            + 4.0 * SIGMOID_ABSOLUTE * dot_magnitude
            + (dv + 2) as f64 * F32_SUBNORMAL)
}

/// One window's share of a selection block score (module docs, "The block scores"), from exact (f64) values: the
/// window's weight in the block `|window ∩ block| / s`, and for one query head of the group the probability
/// `p = exp(x)` with exponent `x = α q·k̃ − LSE` (the LSE the kernel read), the score magnitude `|α| Σ_e |q_e k̃_e|`
/// and that LSE.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowTerm {
    /// `|window ∩ block| / s`.
    pub weight: f64,
    /// `p = exp(x)`.
    pub probability: f64,
    /// `x = α q·k̃ − LSE`.
    pub exponent: f64,
    /// `|α| Σ_e |q_e k̃_e|`.
    pub magnitude: f64,
    /// The LSE the kernel read (finite: a row whose LSE is `−∞` sees no window and contributes no term).
    pub lse: f64,
}

/// How the selection kernel's arithmetic rounds, as the bound needs it: the dot product's accumulation error factor
/// over `head_dim` terms (the tensor cores' `γ'`), the `exp`'s relative error and what its flush to zero loses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectionRecipe {
    /// `γ'(d)` of the score's dot product (`flash_bound::Accumulation::gamma` of the head dim).
    pub dot_gamma: f64,
    /// Relative error of the `exp` (`ex2.approx`: `5u`).
    pub exp_error: f64,
    /// Largest absolute loss of a flushed `exp` result (`2^-126` for `ex2.approx.ftz`).
    pub exp_underflow: f64,
}

/// The bound on `|Ŝ − S|` for one block score `S = Σ_terms w p` of a (token, KV head, block), whose `terms` are its
/// windows' shares for every head of the group (`group` heads summed per window) over `windows` windows, computed
/// by `recipe` (module docs, "The block scores").
pub fn block_score_bound(terms: &[WindowTerm], group: usize, windows: usize, recipe: SelectionRecipe) -> f64 {
    let u = F32_UNIT_ROUNDOFF;
    // The group sum, the weights' rounding and the fused multiply-adds, on sums of non-negative terms.
    let sums = (1.0 + gamma32(group.saturating_sub(1) + windows)) * (1.0 + u);
    let total: f64 = terms
        .iter()
        .map(|t| {
            let epsilon =
                (recipe.dot_gamma + 5.0 * u) * t.magnitude + 3.0 * u * t.lse.abs() + 2.0 * u * t.exponent.abs();
            let relative = epsilon.exp() * (1.0 + recipe.exp_error) * sums - 1.0;
            t.weight * (t.probability * relative + recipe.exp_underflow * sums)
        })
        .sum();
    MARGIN * total
}

/// The bound on `|out − y_ref|` for one element of the layer's gradient sum `out = fl_T(fl32(fl32(a + b) + c))` of the
/// branches' gradients `a` (compressed), `b` (selected), `c` (window) against the f64 sum `reference`, with
/// `magnitude = |a| + |b| + |c|` and the result stored in a type of rounding `storage` (module docs, "The layer's
/// gradient sum"). It holds for every finite output.
pub fn branch_sum_bound(reference: f64, magnitude: f64, storage: StorageRounding) -> f64 {
    let u = storage.unit_roundoff;
    let e64 = gamma(2) * magnitude;
    let err32 = gamma32(2) * magnitude;
    MARGIN * (u * (reference.abs() + e64 + err32) + err32 + e64 + storage.subnormal)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BF16: StorageRounding = StorageRounding { unit_roundoff: 1.0 / 256.0, subnormal: 9.183_549_615_799_121e-41 };

    #[test]
    fn block_score_bounds_grow_with_every_source_and_vanish_without_terms() {
        let recipe =
            SelectionRecipe { dot_gamma: 1e-6, exp_error: 5.0 * F32_UNIT_ROUNDOFF, exp_underflow: 2f64.powi(-126) };
        let term = WindowTerm { weight: 2.0, probability: 0.25, exponent: 0.25f64.ln(), magnitude: 3.0, lse: 4.0 };
        let base = block_score_bound(&[term], 4, 5, recipe);
        assert_eq!(block_score_bound(&[], 4, 5, recipe), 0.0);
        // To first order: w p (γ' m + 5u m + 3u|LSE| + 2u|x| + e + γ_32(G − 1 + n_c) + u).
        let u = F32_UNIT_ROUNDOFF;
        let first = 3e-6 + 5.0 * u * 3.0 + 3.0 * u * 4.0 + 2.0 * u * 0.25f64.ln().abs() + 5.0 * u + gamma32(8) + u;
        assert!(base > 0.5 * first && base < 0.5 * first * 1.01, "{base:e} against {:e}", 0.5 * first);
        for (name, bigger) in [
            ("magnitude", block_score_bound(&[WindowTerm { magnitude: 30.0, ..term }], 4, 5, recipe)),
            ("lse", block_score_bound(&[WindowTerm { lse: 4e3, ..term }], 4, 5, recipe)),
            ("exponent", block_score_bound(&[WindowTerm { exponent: -4e3, ..term }], 4, 5, recipe)),
            ("group", block_score_bound(&[term], 40, 5, recipe)),
            ("windows", block_score_bound(&[term], 4, 50, recipe)),
            ("two terms", block_score_bound(&[term, term], 4, 5, recipe)),
            ("weight", block_score_bound(&[WindowTerm { weight: 3.0, ..term }], 4, 5, recipe)),
        ] {
            assert!(bigger > base, "{name}: {bigger:e} ≤ {base:e}");
        }
        // A flushed probability still carries the underflow term.
        let flushed = block_score_bound(&[WindowTerm { probability: 0.0, ..term }], 1, 1, recipe);
        assert!(flushed >= 2.0 * 2f64.powi(-126), "{flushed:e}");
    }

    #[test]
    fn the_storage_rounding_dominates_and_every_term_counts() {
        let b = compression_bound(1.0, 1.0, 32, BF16);
        let r = BF16.unit_roundoff + F32_UNIT_ROUNDOFF + BF16.unit_roundoff * F32_UNIT_ROUNDOFF;
        assert!(b > r && b < r * (1.0 + 1e-3) + 1e-12, "{b:e}");
        // Larger references, magnitudes, windows and storage roundoffs give larger bounds.
        assert!(compression_bound(2.0, 1.0, 32, BF16) > b);
        assert!(compression_bound(1.0, 2.0, 32, BF16) > b);
        assert!(compression_bound(1.0, 1.0, 64, BF16) > b);
        let coarse = StorageRounding { unit_roundoff: 1.0 / 128.0, ..BF16 };
        assert!(compression_bound(1.0, 1.0, 32, coarse) > b);
        // A zero reference of zero magnitude leaves the absolute terms only.
        let zero = compression_bound(0.0, 0.0, 32, BF16);
        assert!(zero > BF16.subnormal && zero < 1e-38, "{zero:e}");
        assert_eq!(f64_evaluation_error(0.0, 3), 6.0 * SUBNORMAL_UNIT);
    }

    /// A finite f32 rounded to bf16 (nearest, ties to even), as f32.
    fn round_bf16(x: f32) -> f32 {
        let bits = x.to_bits();
        f32::from_bits((bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff_0000)
    }

    /// The gates' recipe in f32 (Rust's `f32::exp` standing in for CUDA's `expf`, both within 2 ulp) stays within the
    /// three bounds of the exact values (256-bit MPFR) over gate logits from −100 to 100, the underflowing and
    /// overflowing ends of `expf` included.
    #[test]
    fn the_gates_f32_recipe_stays_within_its_bounds() {
        use rug::Float;
        let exact_sigmoid = |x: f64| {
            let one = Float::with_val(256, 1);
            one.clone() / (one + Float::with_val(256, -x).exp())
        };
        let sigmoid32 = |x: f32| 1.0f32 / (1.0f32 + (-x).exp());
        let o = [1.5f32, -0.75, 3.25];
        let dy = 0.625f32;
        for i in -200..=200 {
            let x0 = i as f32 * 0.5;
            let xs = [x0, -x0 * 0.5, 1.0];
            let g: Vec<f32> = xs.iter().map(|&x| sigmoid32(x)).collect();
            let mut acc = g[0] * o[0];
            acc = g[1].mul_add(o[1], acc);
            acc = g[2].mul_add(o[2], acc);
            let out = f64::from(round_bf16(acc));
            let exact: Float =
                (0..3).fold(Float::with_val(256, 0), |a, b| a + exact_sigmoid(f64::from(xs[b])) * f64::from(o[b]));
            let magnitude: f64 = (0..3).map(|b| exact_sigmoid(f64::from(xs[b])).to_f64() * f64::from(o[b].abs())).sum();
            let branch_sum: f64 = o.iter().map(|v| f64::from(v.abs())).sum();
            let reference = exact.to_f64();
            let err = (Float::with_val(256, out) - exact.clone()).abs().to_f64();
            assert!(err <= gate_combine_bound(reference, magnitude, branch_sum, BF16), "x0 = {x0}: {err:e}");
            // The branch gradient and the logit gradient of branch 0.
            let d0 = f64::from(round_bf16(g[0] * dy));
            let exact_d0 = exact_sigmoid(f64::from(x0)) * f64::from(dy);
            let err = (Float::with_val(256, d0) - exact_d0.clone()).abs().to_f64();
            assert!(err <= gate_branch_gradient_bound(exact_d0.to_f64(), f64::from(dy), BF16), "x0 = {x0}: {err:e}");
            let dx = sigmoid32(x0) * sigmoid32(-x0) * (dy * o[0]);
            let p = exact_sigmoid(f64::from(x0)) * exact_sigmoid(-f64::from(x0));
            let exact_dx = p.clone() * (f64::from(dy) * f64::from(o[0]));
            let err = (Float::with_val(256, dx) - exact_dx).abs().to_f64();
            let bound = gate_logit_gradient_bound(p.to_f64(), f64::from((dy * o[0]).abs()), 1);
            assert!(err <= bound, "x0 = {x0}: {err:e} > {bound:e}");
        }
    }

    /// The bound separates the recipe from a dropped row: the mean of 32 ones without one of them is off by 1/32,
    /// beyond the bound in both storage types.
    #[test]
    fn a_dropped_row_is_far_outside_the_bound() {
        let f16 = StorageRounding { unit_roundoff: 1.0 / 2048.0, subnormal: 5.960_464_477_539_063e-8 };
        assert!(compression_bound(1.0, 1.0, 32, f16) < 1.0 / 32.0);
        assert!(compression_bound(1.0, 1.0, 32, BF16) < 1.0 / 32.0);
    }

    /// `x` rounded to nearest (ties to even) in a binary format of `precision` significand bits, smallest normal
    /// exponent `min_exponent` and largest finite value `largest`; beyond it, infinity.
    fn round_to(x: f64, precision: i32, min_exponent: i32, largest: f64) -> f64 {
        if x == 0.0 || !x.is_finite() {
            return x;
        }
        let exponent = x.abs().log2().floor() as i32;
        let quantum = 2f64.powi(exponent.max(min_exponent) - (precision - 1));
        let rounded = (x / quantum).round_ties_even() * quantum;
        if rounded.abs() > largest { f64::INFINITY.copysign(x) } else { rounded }
    }

    /// The branch sum's recipe, `fl_T(fl32(fl32(a + b) + c))` (Rust's f32 addition rounds to nearest, as `__fadd_rn`
    /// does), stays within `branch_sum_bound` of the exact sum (512-bit MPFR) in bf16 and f16 over adversarial
    /// triples: exact and near cancellation, values near the storage type's largest (sums that overflow it, which the
    /// recipe and the exact sum both round to infinity), subnormals of the storage type alone and beside normal
    /// values, and mixed scales; a recipe that rounds the partial sum to the storage type fails the bound, and the one
    /// way the f32 recipe itself leaves it, two of bf16's largest values cancelled by a third, overflows to infinity
    /// (an output the verifier rejects, module docs).
    #[test]
    fn the_branch_sum_recipe_stays_within_its_bound() {
        use rug::Float;
        /// A storage format: its name, significand bits, smallest normal exponent, largest finite value, rounding.
        struct Format {
            name: &'static str,
            precision: i32,
            min_exponent: i32,
            largest: f64,
            storage: StorageRounding,
        }
        let bf16_largest = f64::from(f32::from_bits(0x7f7f_0000));
        let f16_rounding = StorageRounding { unit_roundoff: 1.0 / 2048.0, subnormal: 2f64.powi(-24) };
        let formats = [
            Format { name: "bf16", precision: 8, min_exponent: -126, largest: bf16_largest, storage: BF16 },
            Format { name: "f16", precision: 11, min_exponent: -14, largest: 65504.0, storage: f16_rounding },
        ];
        for format in &formats {
            let Format { name, storage, largest, .. } = *format;
            let round = |x: f64| round_to(x, format.precision, format.min_exponent, format.largest);
            let tiny = storage.subnormal;
            let ulp1 = 2.0 * storage.unit_roundoff;
            let mut triples: Vec<[f64; 3]> = vec![
                [1.0, -1.0, ulp1],
                [1.0, ulp1 / 2.0, -1.0],
                [1.0 + ulp1, -1.0, -ulp1],
                [3.0, -3.0 + 2.0 * ulp1, 0.0],
                [largest, -largest, largest],
                [largest, largest / 2.0, 0.0],
                [largest, -largest / 2.0, largest / 4.0],
                [tiny, tiny, tiny],
                [tiny, -2.0 * tiny, 3.0 * tiny],
                [1.0, tiny, -1.0],
                [tiny, 1.0, -tiny],
                [2f64.powi(-10), -2f64.powi(-10), tiny],
                [0.0, 0.0, 0.0],
            ];
            if name == "f16" {
                // Cancellation of sums that only f32's range holds (bf16's would overflow it: the end of the test).
                triples.push([largest, largest / 2.0, -largest]);
            }
            for i in 0..200 {
                let x = |k: i32| round((f64::from(i * 37 + k * 11) * 0.7).sin() * 2f64.powi((i % 17 + k) - 8));
                triples.push([x(0), x(1), -x(0) + x(2)]);
                triples.push([x(1), -x(1) * (1.0 + ulp1), x(3)]);
            }
            for t in triples {
                let [a, b, c] = t.map(round);
                let partial = (a as f32) + (b as f32);
                let out = round(f64::from(partial + (c as f32)));
                let exact = Float::with_val(512, a) + Float::with_val(512, b) + Float::with_val(512, c);
                let reference = a + b + c;
                let magnitude = a.abs() + b.abs() + c.abs();
                let bound = branch_sum_bound(reference, magnitude, storage);
                if out.is_infinite() {
                    // Only where the exact sum rounds to that infinity in the storage type.
                    assert_eq!(round(exact.to_f64()), out, "{name} {t:?}");
                    continue;
                }
                let err = (Float::with_val(512, out) - exact.clone()).abs().to_f64();
                assert!(err <= bound, "{name} {t:?}: {err:e} > {bound:e}");
                // Cancelling sums: the partial sum rounded to the storage type loses the small term.
                if t == [1.0, ulp1 / 2.0, -1.0] {
                    let twice = round(round(a + b) + c);
                    assert!((twice - reference).abs() > bound, "{name}: a partial sum in the storage type passed");
                }
            }
        }
        // bf16's largest value twice overflows f32's first addition although the exact sum with a third cancelling it
        // is finite: the recipe's only escape from its bound, an infinity the verifier rejects.
        let partial = (bf16_largest as f32) + (bf16_largest as f32);
        assert!(partial.is_infinite() && (partial - bf16_largest as f32).is_infinite());
        assert!(round_to(bf16_largest + bf16_largest - bf16_largest, 8, -126, bf16_largest).is_finite());
    }
}
