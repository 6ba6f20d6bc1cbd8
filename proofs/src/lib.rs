//! Theorems about the oracle, each a documented function that checks one statement on given
//! inputs in MPFR and returns how many bits agree, or the violation it found; and the
//! rounding-error bounds the verifier uses.
//!
//! A theorem takes the implementation under test as an argument (an [`online::OnlineAlgebra`],
//! a backward closure, ...). The tests run each theorem on proptest-generated inputs against the
//! oracle, and once against a deliberately broken variant that it must reject (non-vacuity).
#![forbid(unsafe_code)]

pub mod backward;
pub mod block_scores;
pub mod bsa_bound;
pub mod definition;
pub mod dsa;
pub mod dsa_bound;
pub mod dsa_loss_bound;
pub mod f64_oracle_bound;
pub mod flash_bound;
pub mod hils;
pub mod nsa;
pub mod nsa_bound;
pub mod online;
pub mod pisa;
pub mod pyramid;
pub mod pyramid_bound;
pub mod residual;
pub mod selection;
pub mod sums;

pub use residual::{Agreement, Bits, Violation};
