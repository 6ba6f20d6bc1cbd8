//! The attnproof oracle: every attention equation of `docs/equations.md`, generic over one scalar
//! trait ([`Real`]) and instantiated for `f64` (fast, faer products) and MPFR ([`Mp`], any
//! precision, 256 bits by default).
//!
//! Layers, from the inside out:
//! - [`real`]: the scalar trait and its two instances;
//! - [`online`]: the online-softmax state and its algebra (E2–E5), ring order (E11, E11a);
//! - [`dense`]: one head's scores, forward and backward (E1, E6–E10);
//! - [`attention`]: whole problems with batch, heads, GQA and varlen, validated;
//! - [`spec`]: shapes, masks, scale; [`error`]: typed errors; [`cost`]: the cost model (E1d, E31, E32);
//! - sparse attention: [`selection`] (E12, E13, E17), [`block_sparse`] (E14), [`block_scores`] (E15), [`dsa`] (E16),
//!   [`bsa`] (E15 block selection for E14 lists), [`nsa`] (E18–E20), [`nsa_backward`] (E18's layer gradients, the selection held
//!   fixed), [`hils`] (E21), [`pisa`] (E22–E24),
//!   [`pyramid`] (E25–E30);
//! - shared helpers: [`vector`] (dot, log-sum-exp, softmax, block means), [`topk`] (top-k with
//!   the tie and padding conventions, index-list validation), [`inputs`] (deterministic inputs).
//!
//! The oracle knows nothing of tiles: the only "blocks" it sees are the key sets of E2–E5.
#![deny(unsafe_code)]

pub mod attention;
pub mod block_scores;
pub mod block_sparse;
pub mod bsa;
pub mod cost;
pub mod dense;
pub mod dsa;
pub mod error;
pub mod hils;
pub mod inputs;
pub mod nsa;
pub mod nsa_backward;
pub mod online;
pub mod pisa;
pub mod pyramid;
pub mod real;
pub mod selection;
pub mod spec;
pub mod topk;
pub mod vector;
pub mod vexp;

pub use attention::{
    Forward, Gradients, Qkv, backward, backward_f64, backward_mpfr, forward, forward_f64, forward_mpfr, to_mpfr,
};
pub use dense::DenseConfig;
pub use error::OracleError;
pub use online::SoftmaxState;
pub use real::{DEFAULT_PRECISION_BITS, Mp, Precision, Real};
pub use spec::{AttentionSpec, Layout, Mask, Pair, Predicate, Scale, Sequence};
