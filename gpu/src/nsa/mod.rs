//! Native Sparse Attention on the GPU (E18–E20, E31, E32), built piece by piece after the plan of `docs/nsa-gpu.md`:
//! each piece lands with its kernel, its rounding-error bound and its tests against the oracle (`oracle/src/nsa.rs`).
//!
//! Landed: [`compress`], the compression branch's first step (E18): the compressed keys and values of every complete
//! window (`l` tokens every `s`), by the mean or by caller-given position weights, rounded once to the storage type
//! for the compressed attention that follows. Still to come, in the plan's order: the compressed attention with its
//! strided causal mask, the fused block scoring and top-n selection, the selected attention over the union of a
//! token block's lists, the gates, and the backward.
//!
//! NSA's parameters are the oracle's [`attnproof_oracle::nsa::NsaConfig`], so that the kernels and the oracle read one
//! definition; a kernel checks that it implements the configuration it is given and refuses the rest with a typed
//! error before any launch.

pub mod compress;
