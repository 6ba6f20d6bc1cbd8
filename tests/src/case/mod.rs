//! Checking any kernel, not only ours: case files (safetensors with `q`, `k`, `v`, candidate
//! outputs and metadata, `docs/case-format.md`) are loaded defensively, recomputed by the oracle
//! and judged under the bound of the candidate's stated precision recipe, with a diagnosis of
//! the likely cause of a failure. `cargo xtask check` runs the `check` binary over them.

pub mod build;
pub mod candidate;
pub mod check;
pub mod error;
pub mod format;
pub mod recipe;
pub mod report;
pub mod safetensors;
pub mod sparsity;

pub use check::{CaseReport, OracleChoice, OutputReport, Region, Status, check};
pub use error::CaseError;
pub use format::{CaseFile, load};
