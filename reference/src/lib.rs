//! Tiled CPU reference schedules that compute attention in the order the GPU kernels will
//! (tiles, f32 accumulation, bf16/f16 inputs), so that a kernel's deviation from the oracle can
//! be explained by its precision recipe and nothing else. Each schedule states its recipe in its
//! module docs; the verifier's bounds (in `attnproof-proofs`) are derived from those recipes.
//! Outputs are caller-owned; parallelism is rayon over independent tiles at the top level.
#![forbid(unsafe_code)]

pub mod backward;
pub mod element;
pub mod error;
pub mod flash;
pub mod mask;
pub mod ring;
pub mod sparse;
pub mod tile;

pub use backward::{BackwardInputs, BackwardOutputs, BackwardStrategy, flash_backward};
pub use element::Element;
pub use error::ReferenceError;
pub use flash::{ForwardOutputs, Inputs, flash_forward, flash_forward_owned};
pub use ring::{RingConfig, RingLayout, RingStats, ring_backward, ring_forward};
pub use sparse::{
    block_sparse_backward, block_sparse_forward, dsa_forward, nsa_selection_backward, nsa_selection_forward,
};
pub use tile::TileConfig;
