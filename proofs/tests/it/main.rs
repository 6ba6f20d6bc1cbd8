//! The theorems' integration tests, gathered in one test binary so that GMP and MPFR are linked once rather than once
//! per test file; each module was a test file of its own before, and `common` holds what they share.

mod backward_theorems;
mod common;
mod dsa_theorems;
mod f64_bound;
mod f64_bound_terms;
mod flash_bound_terms;
mod flash_bound_textbook;
mod hils_theorems;
mod nsa_theorems;
mod online_theorems;
mod pyramid_theorems;
mod sparse_theorems;
