//! Typed errors for bad input. Numerical inaccuracy is never an error; it is data in a verdict.

use ndarray::{ArrayBase, Data, Dimension};
use thiserror::Error;

use crate::real::Real;

/// Why the oracle refused a problem. Every variant names the argument at fault.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum OracleError {
    /// A tensor does not have the shape the spec implies.
    #[error("`{argument}` has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The offending argument.
        argument: &'static str,
        /// The shape the spec implies.
        expected: Vec<usize>,
        /// The shape given.
        actual: Vec<usize>,
    },
    /// `n_heads_q` is not a positive multiple of `n_heads_kv`.
    #[error("`n_heads_q` = {n_heads_q} is not a positive multiple of `n_heads_kv` = {n_heads_kv}")]
    HeadRatio {
        /// Query heads.
        n_heads_q: usize,
        /// Key/value heads.
        n_heads_kv: usize,
    },
    /// A dimension that must be positive is zero.
    #[error("`{argument}` is zero")]
    ZeroDimension {
        /// The offending argument.
        argument: &'static str,
    },
    /// A `cu_seqlens` array is malformed.
    #[error("`{argument}` is invalid: {reason}")]
    CuSeqlens {
        /// `cu_seqlens_q` or `cu_seqlens_k`.
        argument: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A NaN or infinity where only finite values are allowed.
    #[error("`{argument}` holds a non-finite value {value} at index {index:?}")]
    NonFinite {
        /// The offending argument.
        argument: &'static str,
        /// Where the first such value sits.
        index: Vec<usize>,
        /// The value found.
        value: f64,
    },
    /// A parameter outside its domain (for example a negative or non-finite scale).
    #[error("`{argument}` is invalid: {reason}")]
    InvalidParameter {
        /// The offending argument.
        argument: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// An `i32` index list (block or token selection) breaks the convention: an index out of
    /// range, a duplicate, an unsorted valid prefix, or a `−1` pad followed by a valid index.
    #[error("`{argument}` is invalid at position {position:?}: {reason}")]
    IndexList {
        /// The offending argument.
        argument: &'static str,
        /// Where in the list (row, slot).
        position: Vec<usize>,
        /// What is wrong.
        reason: String,
    },
}

/// The first non-finite value of `x`, as a typed error naming `argument`.
pub fn check_finite<S: Real, A: Data<Elem = S>, D: Dimension>(
    argument: &'static str,
    x: &ArrayBase<A, D>,
) -> Result<(), OracleError> {
    let x = x.view().into_dyn();
    match x.indexed_iter().find(|(_, v)| !v.is_finite()) {
        Some((index, value)) => {
            Err(OracleError::NonFinite { argument, index: index.slice().to_vec(), value: value.to_f64() })
        }
        None => Ok(()),
    }
}

/// `actual` must equal `expected`, else a typed error naming `argument`.
pub fn check_shape(argument: &'static str, actual: &[usize], expected: &[usize]) -> Result<(), OracleError> {
    if actual == expected {
        Ok(())
    } else {
        Err(OracleError::ShapeMismatch { argument, expected: expected.to_vec(), actual: actual.to_vec() })
    }
}
