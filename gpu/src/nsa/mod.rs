//! Native Sparse Attention on the GPU (E18–E20, E31, E32), built piece by piece after the plan of `docs/nsa-gpu.md`:
//! each piece lands with its kernel, its rounding-error bound and its tests against the oracle (`oracle/src/nsa.rs`).
//!
//! Landed: [`compress`], the compression branch's first step (E18): the compressed keys and values of every complete
//! window (`l` tokens every `s`), by the mean or by caller-given position weights, rounded once to the storage type
//! for the compressed attention that follows; and [`gates`], the gated sum of the three branch outputs (E18, the
//! sigmoid applied inside, in f32) and its gradients; and [`window`], the sliding-window branch as the dense kernels
//! under a narrowed causal mask; and [`compressed`], the compressed attention as the dense kernels
//! over the compressed keys under NSA's strided causal mask; and [`select`], the block scores (recomputed from the
//! compressed attention's LSE, summed over the group and remapped onto blocks without writing per-head
//! probabilities) and the top-n lists with forced blocks; and [`selected`], the selected attention's forward over the
//! union of a token group's lists, each block's K/V tile shared by the group's heads; and [`selected_backward`], its
//! backward through the device-built block → token transpose (E20) with a KV owner per block tile; and [`layer`], one
//! layer's forward and backward chaining every piece on caller-owned device buffers, each stage's intermediates kept
//! for a stage-wise verifier, the three branches' gradients summed by one more kernel. The compression takes the
//! paper's learned `[l·d, d]` matrix as well, with its own gradient ([`compress::compress_map_gradient_device`]).
//!
//! NSA's parameters are the oracle's [`attnproof_oracle::nsa::NsaConfig`], so that the kernels and the oracle read one
//! definition; a kernel checks that it implements the configuration it is given and refuses the rest with a typed
//! error before any launch.

pub mod compress;
pub mod compressed;
pub mod gates;
pub mod layer;
pub mod select;
pub mod selected;
pub mod selected_backward;
pub mod window;

use attnproof_oracle::{AttentionSpec, Layout};

use crate::error::GpuError;

/// Rows of O for `spec`: `B · Hq · Lq` dense, `Tq · Hq` varlen (what the gates and the branch outputs hold).
pub(crate) fn o_rows(spec: &AttentionSpec) -> Result<i64, GpuError> {
    let rows = match &spec.layout {
        Layout::Dense { batch, len_q, .. } => batch * spec.n_heads_q * len_q,
        Layout::Varlen { cu_seqlens_q, .. } => {
            cu_seqlens_q.last().copied().unwrap_or(0).max(0) as usize * spec.n_heads_q
        }
    };
    i64::try_from(rows).map_err(|_| GpuError::TooLarge { argument: "rows of O", value: rows })
}

/// Checks that `spec` describes an NSA layer: valid, causal (`Mask::Causal`) self-attention, every sequence's query
/// and key lengths equal. The branches' specs ([`window::window_spec`], [`compressed::compressed_spec`]) start here.
pub(crate) fn check_layer(spec: &AttentionSpec) -> Result<(), GpuError> {
    crate::common::check_causal_self_attention(spec, "NSA")
}
