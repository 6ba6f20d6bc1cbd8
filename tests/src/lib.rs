//! The verifier (`attnproof-harness`): it will compare candidates (reference schedules, GPU
//! kernels) with the oracle under derived bounds, run the discriminability gate, and hold the
//! proptest strategies and the mutation runner. Today it re-exports the first bound of the
//! trust chain, the f64 oracle's, which the proofs crate derives and checks.
#![forbid(unsafe_code)]

pub use attnproof_proofs::f64_oracle_bound::{BoundReport, OutputRatio, f64_oracle_within_bound};
