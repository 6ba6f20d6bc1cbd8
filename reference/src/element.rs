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
}
