//! The GPU crate's integration tests, gathered in one test binary (one link, one executable in the GPU bundle,
//! `attnproof-gpu-it`); each module was a test file of its own before and keeps its name, so a test reads
//! `flash_forward::…` and a module is selected by a libtest filter such as `ring_state::`. `common` holds what the
//! launching modules share.

mod block_selection;
mod block_sparse;
mod block_sparse_backward;
mod common;
mod compile_only;
mod device;
mod dsa_index;
mod dsa_loss;
mod dsa_sparse;
mod dsa_sparse_backward;
mod flash_backward;
mod flash_forward;
mod hils;
mod mutants;
mod nsa_compress;
mod nsa_compressed;
mod nsa_gates;
mod nsa_layer;
mod nsa_select;
mod nsa_selected;
mod nsa_selected_backward;
mod pisa_covariance;
mod pisa_tail;
mod pisa_tail_backward;
mod property;
mod pyramid_diagnostics;
mod pyramid_selection;
mod ring_state;
