//! PISA (seed 003: Pyramid Top-K selection, E25–E28) on the GPU: the mean-pooled key hierarchy and the coarse-to-fine
//! descent that picks each query block's key blocks in `O(N log N)` instead of BSA's `O(N²/C)` ([`select`]).
//!
//! The lists it writes are those of [`crate::block_sparse`]: per KV head, ascending, `−1`-padded, ready for
//! [`crate::block_sparse::block_sparse_forward`] as [`crate::block_sparse::ListHeads::PerKvHead`] lists.

pub mod select;
