//! The oracle's integration tests, gathered in one test binary so that GMP and MPFR are linked once rather than once
//! per test file; each module was a test file of its own before.

mod block_sparse;
mod errors;
mod semantics;
