//! How theorems measure agreement: normwise residuals expressed in bits, and the violation a
//! theorem reports when a residual exceeds its threshold.

use std::fmt;

use attnproof_oracle::{Mp, Real};
use ndarray::{ArrayBase, Data, Dimension};
use thiserror::Error;

/// A number of agreeing bits: a residual `r` agrees to `b` bits when `r ≤ 2^-b`.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct Bits(pub f64);

impl fmt::Display for Bits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.1} bits", self.0)
    }
}

/// The outcome of a theorem check that held: the fewest bits of agreement seen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Agreement {
    /// Fewest agreeing bits over all compared quantities (`∞` when all were equal).
    pub bits: Bits,
}

impl Agreement {
    /// Agreement of the worse of two checks.
    pub fn and(self, other: Agreement) -> Agreement {
        Agreement { bits: Bits(self.bits.0.min(other.bits.0)) }
    }
    /// Exact agreement.
    pub fn exact() -> Agreement {
        Agreement { bits: Bits(f64::INFINITY) }
    }
}

/// A theorem's statement failed on the given inputs.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum Violation {
    /// Two quantities that the theorem says are equal differ by more than the threshold.
    #[error("{theorem}: `{quantity}` agrees to {found}, needs {required} (at index {index:?})")]
    Residual {
        /// The theorem.
        theorem: &'static str,
        /// The compared quantity.
        quantity: &'static str,
        /// Bits of agreement found.
        found: Bits,
        /// Bits required.
        required: Bits,
        /// The worst element.
        index: Vec<usize>,
    },
    /// One side has a non-finite value the other does not, or values are non-finite where the
    /// statement demands finite ones.
    #[error("{theorem}: `{quantity}` is {found} where {expected} was required (at index {index:?})")]
    NonFinite {
        /// The theorem.
        theorem: &'static str,
        /// The compared quantity.
        quantity: &'static str,
        /// The value found.
        found: String,
        /// The value required.
        expected: String,
        /// Where.
        index: Vec<usize>,
    },
    /// A discrete or structural property fails: a wrong index set, a broken ordering, a sign a
    /// statement requires.
    #[error("{theorem}: `{quantity}` is {found}, expected {expected} (at index {index:?})")]
    Mismatch {
        /// The theorem.
        theorem: &'static str,
        /// The property or quantity.
        quantity: &'static str,
        /// What was found.
        found: String,
        /// What the statement requires.
        expected: String,
        /// Where.
        index: Vec<usize>,
    },
    /// A bound of a rounding-error model was exceeded.
    #[error(
        "{theorem}: `{quantity}` error {error:e} exceeds its bound {bound:e} (ratio {ratio:.3}) at index {index:?}"
    )]
    Bound {
        /// The theorem.
        theorem: &'static str,
        /// The compared quantity.
        quantity: &'static str,
        /// Absolute error.
        error: f64,
        /// Allowed error.
        bound: f64,
        /// `error / bound`.
        ratio: f64,
        /// Where.
        index: Vec<usize>,
    },
    /// The hypotheses of the theorem do not hold for these inputs.
    #[error("{theorem}: hypothesis fails: {reason}")]
    Hypothesis {
        /// The theorem.
        theorem: &'static str,
        /// Which hypothesis and why.
        reason: String,
    },
}

/// `−log2(x)` for a non-negative MPFR value (`∞` for zero).
pub fn bits_of(x: &Mp) -> Bits {
    if x.0.is_zero() {
        return Bits(f64::INFINITY);
    }
    let l = x.0.clone().log2();
    Bits(-l.to_f64())
}

/// Checks `‖found − expected‖∞ ≤ 2^-required · max(‖expected‖∞, 1)` (a normwise relative
/// residual, floored at absolute for values below 1). Infinities must match exactly.
pub fn agree<D: Dimension, A: Data<Elem = Mp>, B: Data<Elem = Mp>>(
    theorem: &'static str,
    quantity: &'static str,
    found: &ArrayBase<A, D>,
    expected: &ArrayBase<B, D>,
    required: Bits,
) -> Result<Agreement, Violation> {
    assert_eq!(found.shape(), expected.shape(), "{theorem}: `{quantity}` compared across shapes");
    let (found, expected) = (found.view().into_dyn(), expected.view().into_dyn());
    let mut scale: Option<Mp> = None;
    for ((idx, f), e) in found.indexed_iter().zip(expected.iter()) {
        if !f.is_finite() || !e.is_finite() {
            if f != e {
                return Err(Violation::NonFinite {
                    theorem,
                    quantity,
                    found: f.to_string(),
                    expected: e.to_string(),
                    index: idx.slice().to_vec(),
                });
            }
            continue;
        }
        let a = e.abs();
        scale = Some(match scale {
            None => a.clone().max(Mp::one(a.ctx())),
            Some(s) => s.max(a),
        });
    }
    let Some(scale) = scale else { return Ok(Agreement::exact()) };
    let mut worst = (Bits(f64::INFINITY), Vec::new());
    for ((idx, f), e) in found.indexed_iter().zip(expected.iter()) {
        if !f.is_finite() {
            continue;
        }
        let b = bits_of(&((f.clone() - e.clone()).abs() / scale.clone()));
        if b.0 < worst.0.0 {
            worst = (b, idx.slice().to_vec());
        }
    }
    if worst.0.0 < required.0 {
        return Err(Violation::Residual { theorem, quantity, found: worst.0, required, index: worst.1 });
    }
    Ok(Agreement { bits: worst.0 })
}
