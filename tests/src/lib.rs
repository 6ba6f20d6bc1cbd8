//! The verifier (`attnproof-harness`): candidates (reference schedules, GPU kernels) compared
//! with the oracle under bounds derived from their precision recipes (`attnproof-proofs`),
//! verdicts with the worst element's coordinates, the discriminability gate, and the input
//! generators and proptest strategies that fuzz shapes and values.
#![forbid(unsafe_code)]

pub mod adversarial;
pub mod backward;
pub mod block_selection;
pub mod candidate;
pub mod case;
pub mod coverage;
pub mod dsa_index;
pub mod dsa_loss;
pub mod dsa_sparse;
pub mod flash;
pub mod gate;
pub mod generate;
pub mod hils_output;
pub mod hils_routing;
pub mod nsa;
pub mod nsa_layer;
pub mod nsa_select;
pub mod nsa_selected;
pub mod pisa_covariance;
pub mod pisa_tail;
pub mod pisa_tail_backward;
pub mod pyramid_diagnostics;
pub mod pyramid_selection;
pub mod recipes;
pub mod ring_gpu;
pub mod sparse;
pub mod strategies;
pub mod verdict;

pub use attnproof_proofs::f64_oracle_bound::{BoundReport, OutputRatio, f64_oracle_within_bound};
pub use flash::{Case, HarnessError, verify_forward};
pub use verdict::{OutputVerdict, Verdict};
