//! The rounding-error bound of NSA's compressed keys and values (E18) as the GPU kernel `nsa_compress.cu` and the CPU
//! reference `attnproof_reference::sparse::nsa::compress_head` compute them: how far a stored compressed element can
//! lie from an f64 evaluation of the same window (the oracle's `nsa::compress` in f64), which is what a verifier
//! holds a kernel to.
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

#[cfg(test)]
mod tests {
    use super::*;

    const BF16: StorageRounding = StorageRounding { unit_roundoff: 1.0 / 256.0, subnormal: 9.183_549_615_799_121e-41 };

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

    /// The bound separates the recipe from a dropped row: the mean of 32 ones without one of them is off by 1/32,
    /// beyond the bound in both storage types.
    #[test]
    fn a_dropped_row_is_far_outside_the_bound() {
        let f16 = StorageRounding { unit_roundoff: 1.0 / 2048.0, subnormal: 5.960_464_477_539_063e-8 };
        assert!(compression_bound(1.0, 1.0, 32, f16) < 1.0 / 32.0);
        assert!(compression_bound(1.0, 1.0, 32, BF16) < 1.0 / 32.0);
    }
}
