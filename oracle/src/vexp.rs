//! The f64 oracle's `exp`: one formula for a single value and for whole slices, written without branches so that
//! the slice loop vectorizes (four lanes where the CPU has AVX2, eight with AVX-512, chosen at run time by `pulp`; two with the baseline SSE2), with
//! an error below one ulp, inside the `2u` that `attnproof_proofs::f64_oracle_bound` assumes for `exp`.
//!
//! # The method
//!
//! The classic reduction and rational approximation of fdlibm's `exp` (the formulas are public; this is our own
//! branch-free arrangement of them):
//!
//! - `k = round(x / ln 2)`, taken with the `1.5 · 2^52` shift (the rounded value appears in the low bits of
//!   `x / ln 2 + 1.5 · 2^52`, so no float-to-integer conversion is needed);
//! - `r = hi − lo` with `hi = x − k·ln2_hi` (exact: `ln2_hi` has 32 significant bits and `|k| ≤ 1075`) and
//!   `lo = k·ln2_lo`, so `|r| ≤ 0.35`;
//! - `e^r = 1 + hi − (lo − r·c/(2 − c))` with `c = r − r²(P1 + r²(P2 + r²(P3 + r²(P4 + r² P5))))`, fdlibm's minimax
//!   coefficients (error of the approximation below `2^-59`);
//! - `e^x = e^r · 2^k1 · 2^k2` with `k1 = round(k/2)`, `k2 = k − k1`: both factors are normal powers of two for every
//!   `k` in range, so a normal result is scaled exactly and a subnormal one rounds once (absolute error at most
//!   `2^-1075`, inside the model's `2^-1074`).
//!
//! Outside `[−745.2, 709.8]` the result is 0 or `+∞` (`e^x` underflows past the smallest subnormal or overflows);
//! NaN stays NaN. No operation is a fused multiply-add, so the result does not depend on which lanes the CPU offers:
//! every path gives the same bits. `the_exp_is_within_one_ulp_of_mpfr` measures the error against MPFR.

/// `1.5 · 2^52`: adding it rounds a value below `2^51` in magnitude to an integer held in the low mantissa bits.
const ROUND_SHIFT: f64 = 6_755_399_441_055_744.0;
const INV_LN2: f64 = std::f64::consts::LOG2_E;
/// `ln 2` split: `LN2_HI` has 32 significant bits, so `k · LN2_HI` is exact for `|k| < 2^21`.
const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
/// fdlibm's coefficients of `R(r²) ≈ r·(e^r + 1)/(e^r − 1) − 2` (its `P1`…`P5`).
const P1: f64 = f64::from_bits(0x3fc5_5555_5555_553e); // 0.16666666666666602
const P2: f64 = f64::from_bits(0xbf66_c16c_16be_bd93); // -0.0027777777777015593
const P3: f64 = f64::from_bits(0x3f11_566a_af25_de2c); // 6.613756321437934e-05
const P4: f64 = f64::from_bits(0xbebb_bd41_c5d2_6bf1); // -1.6533902205465252e-06
const P5: f64 = f64::from_bits(0x3e66_3769_72be_a4d0); // 4.1381367970572385e-08
/// Above this, `e^x` overflows to `+∞`; below [`UNDERFLOW`], it rounds to 0.
const OVERFLOW: f64 = f64::from_bits(0x4086_2e42_fefa_39ef); // 709.782712893384
const UNDERFLOW: f64 = f64::from_bits(0xc087_4910_d52d_3051); // -745.1332191019411

/// The integer `n` (|n| < 2^51) held by `n + ROUND_SHIFT`, read from the bits.
#[inline(always)]
fn shifted_integer(shifted: f64) -> i64 {
    shifted.to_bits() as i64 - ROUND_SHIFT.to_bits() as i64
}

/// `2^n` for `n` in `[−1022, 1023]`, built from its exponent bits.
#[inline(always)]
fn power_of_two(n: i64) -> f64 {
    f64::from_bits(((n + 1023) as u64) << 52)
}

/// `e^x` by the method of the module docs, branch-free but for the selects at the end.
#[inline(always)]
pub fn exp(x: f64) -> f64 {
    // Clamped so that k stays in [−1075, 1024] and the powers of two below stay normal; the selects restore the
    // out-of-range results.
    let xc = x.clamp(UNDERFLOW - 1.0, OVERFLOW + 1.0);
    let shifted = xc * INV_LN2 + ROUND_SHIFT;
    let kf = shifted - ROUND_SHIFT;
    let hi = xc - kf * LN2_HI;
    let lo = kf * LN2_LO;
    let r = hi - lo;
    let t = r * r;
    let c = r - t * (P1 + t * (P2 + t * (P3 + t * (P4 + t * P5))));
    let er = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi);
    let k1f = (kf * 0.5 + ROUND_SHIFT) - ROUND_SHIFT;
    let k1 = shifted_integer(k1f + ROUND_SHIFT);
    let k2 = shifted_integer(shifted) - k1;
    let y = er * power_of_two(k1) * power_of_two(k2);
    let y = if x > OVERFLOW { f64::INFINITY } else { y };
    let y = if x < UNDERFLOW { 0.0 } else { y };
    if x.is_nan() { x } else { y }
}

/// `xs[i] ← e^(xs[i] − shift)` for every element, with the same bits as [`exp`] of each difference. The loop runs
/// under `pulp`'s run-time dispatch, compiled for the widest lanes the CPU offers.
pub fn exp_shifted_in_place(xs: &mut [f64], shift: f64) {
    pulp::Arch::new().dispatch(|| exp_shifted_lanes(xs, shift));
}

/// The loop every dispatch path compiles: no branch in its body, so it vectorizes with whatever lanes are enabled.
#[inline(always)]
fn exp_shifted_lanes(xs: &mut [f64], shift: f64) {
    for x in xs.iter_mut() {
        *x = exp(*x - shift);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rug::Float;

    /// The error of `got` against the correctly rounded `e^x` at 256 bits, in ulps of the f64 result (for a
    /// subnormal or zero result, in units of the smallest subnormal, the model's absolute term).
    fn ulps(x: f64, got: f64) -> f64 {
        let exact = Float::with_val(256, x).exp();
        let want = exact.to_f64();
        if want.is_infinite() {
            return if got == want { 0.0 } else { f64::INFINITY };
        }
        let ulp = if want.abs() < f64::MIN_POSITIVE {
            f64::from_bits(1)
        } else {
            let e = want.abs().log2().floor();
            2f64.powf(e - 52.0)
        };
        // The ratio in MPFR: a subnormal difference would lose its digits as an f64.
        let ratio = (Float::with_val(256, got) - &exact) / Float::with_val(256, ulp);
        ratio.to_f64().abs()
    }

    /// A deterministic spread of arguments: every scale from 2^-60 to 745, both signs, plus the edges.
    fn arguments() -> Vec<f64> {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut xs = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            std::f64::consts::LN_2 / 2.0,
            -std::f64::consts::LN_2 / 2.0,
            OVERFLOW,
            OVERFLOW - 1e-9,
            -708.39,
            -709.0,
            -740.0,
            -745.0,
            UNDERFLOW + 1e-9,
            -1e-300,
            5e-324,
        ];
        for _ in 0..200_000 {
            let bits = next();
            let magnitude = 2f64.powf((bits % 700) as f64 / 700.0 * 70.0 - 60.0).min(745.0);
            let fraction = (next() >> 11) as f64 / (1u64 << 53) as f64;
            let x = magnitude * (0.5 + fraction);
            xs.push(if bits & (1 << 40) == 0 { x } else { -x.min(745.1) });
        }
        xs
    }

    #[test]
    fn the_exp_is_within_one_ulp_of_mpfr() {
        let xs = arguments();
        let mut worst = (0.0, 0.0);
        for &x in &xs {
            let e = ulps(x, exp(x));
            if e > worst.0 {
                worst = (e, x);
            }
        }
        println!("worst error {:.4} ulp at x = {:e}", worst.0, worst.1);
        assert!(worst.0 < 1.0, "exp errs by {} ulp at {:e}", worst.0, worst.1);
    }

    #[test]
    fn the_slice_path_gives_the_scalar_bits() {
        let xs = arguments();
        for shift in [0.0, 3.5, -2.0] {
            let mut slice = xs.clone();
            exp_shifted_in_place(&mut slice, shift);
            for (&x, &y) in xs.iter().zip(&slice) {
                assert_eq!(y.to_bits(), exp(x - shift).to_bits(), "x = {x:e}, shift {shift}");
            }
        }
    }

    #[test]
    fn edges_overflow_underflow_and_nan() {
        assert_eq!(exp(710.0), f64::INFINITY);
        assert_eq!(exp(f64::INFINITY), f64::INFINITY);
        assert_eq!(exp(-746.0), 0.0);
        assert_eq!(exp(f64::NEG_INFINITY), 0.0);
        assert!(exp(f64::NAN).is_nan());
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        // The smallest subnormal and the largest finite value are reached, not skipped.
        assert_eq!(exp(-745.0), f64::from_bits(1));
        assert!(exp(709.78).is_finite() && exp(709.78) > 1.7e308);
    }
}
