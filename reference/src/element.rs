//! Storage element types of the schedules' inputs and outputs (bf16, f16, and f32 for testing),
//! with their unit roundoff: the precision recipe's "input dtype".

use half::{bf16, f16};

/// A storage type: values live in memory in this format and are widened to f32 for arithmetic,
/// as a tensor-core kernel does.
pub trait Element: Copy + Send + Sync + std::fmt::Debug + 'static {
    /// Name for reports (`bf16`, `f16`, `f32`).
    const NAME: &'static str;
    /// Unit roundoff `u = 2^-p` of round-to-nearest into this format (`p` = significand bits).
    const UNIT_ROUNDOFF: f64;
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this format (nearest, ties to even).
    fn from_f32(x: f32) -> Self;
    /// Rounds an f64 to this format once (nearest, ties to even): not through f32, which would round twice.
    fn from_f64(x: f64) -> Self;
    /// Rounds an f32 through this format and back.
    fn round(x: f32) -> f32 {
        Self::from_f32(x).to_f32()
    }
}

impl Element for bf16 {
    const NAME: &'static str = "bf16";
    const UNIT_ROUNDOFF: f64 = 1.0 / 256.0;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn from_f64(x: f64) -> Self {
        bf16::from_f32(to_f32_round_to_odd(x))
    }
}

impl Element for f16 {
    const NAME: &'static str = "f16";
    const UNIT_ROUNDOFF: f64 = 1.0 / 2048.0;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn from_f64(x: f64) -> Self {
        f16::from_f32(to_f32_round_to_odd(x))
    }
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    const UNIT_ROUNDOFF: f64 = f32::EPSILON as f64 / 2.0;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}

/// `x` rounded to f32 to odd: truncated toward zero, with the last significand bit set when anything was cut off.
/// Rounding that to nearest into a format of at most 22 significand bits (bf16, f16) rounds `x` itself to nearest,
/// once (the `half` crate's `from_f64` goes through f32 to nearest, which rounds twice: 1 + 2^-8 + 2^-30 lands on
/// bf16's tie at 1 + 2^-8 and goes to 1).
fn to_f32_round_to_odd(x: f64) -> f32 {
    let nearest = x as f32;
    if !nearest.is_finite() || f64::from(nearest) == x {
        return nearest;
    }
    // Inexact: step back toward zero if nearest rounded away, then mark the cut-off part in the last bit.
    let truncated = if f64::from(nearest).abs() > x.abs() { f32::from_bits(nearest.to_bits() - 1) } else { nearest };
    f32::from_bits(truncated.to_bits() | 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `from_f64` rounds once: `1 + 2^-8 + 2^-30` lies just above the tie between bf16's `1` and `1 + 2^-7`, and just
    /// below f16's tie at `1 + 2^-11` plus the same; through f32 the `2^-30` is lost first and the tie goes to even.
    #[test]
    fn from_f64_rounds_once() {
        let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-30);
        assert_eq!(<bf16 as Element>::from_f64(x).to_f32(), 1.0 + 2f32.powi(-7));
        assert_eq!(<bf16 as Element>::from_f32(x as f32).to_f32(), 1.0);
        let y = 1.0 + 2f64.powi(-11) + 2f64.powi(-30);
        assert_eq!(<f16 as Element>::from_f64(y).to_f32(), 1.0 + 2f32.powi(-10));
        assert_eq!(<f16 as Element>::from_f32(y as f32).to_f32(), 1.0);
        assert_eq!(<f32 as Element>::from_f64(x), x as f32);
        // Signs, exact values, values just below a tie, and the subnormal ranges.
        for (x, bf, h) in [
            (-x, -(1.0 + 2f32.powi(-7)), -(1.0 + 2f32.powi(-8))),
            (1.5, 1.5, 1.5),
            (1.0 + 2f64.powi(-8) - 2f64.powi(-40), 1.0, 1.0 + 2f32.powi(-8)),
            (3.0 * 2f64.powi(-134), 2f32.powi(-132), 0.0),
            (3.0 * 2f64.powi(-26) + 2f64.powi(-60), 3.0 * 2f32.powi(-26), 2f32.powi(-24)),
            // An exact tie of bf16 stays a tie (no sticky bit on an exact value): to even.
            (1.0 + 2f64.powi(-8), 1.0, 1.0 + 2f32.powi(-8)),
            // Cut off below an f32 whose last bit is already 1: the sticky bit keeps it odd, above bf16's tie.
            (1.0 + 2f64.powi(-8) + 2f64.powi(-23) + 2f64.powi(-40), 1.0 + 2f32.powi(-7), 1.0 + 2f32.powi(-8)),
        ] {
            assert_eq!(<bf16 as Element>::from_f64(x).to_f32(), bf, "bf16 of {x:e}");
            assert_eq!(<f16 as Element>::from_f64(x).to_f32(), h, "f16 of {x:e}");
        }
    }
}
