//! The GPU ring: ring attention (E11, E11a) over CUDA devices, run by the step driver of `attnproof-ring-driver`
//! (the same schedule the CPU reference ring runs), with the GPU's own transports and workers.
//!
//! - [`state`]: the chunk windows and the per-device online-softmax states (merge and finalize kernels) that every
//!   forward step updates;
//! - [`problem`]: the inputs ([`RingInputs`], [`BackwardStart`]), the errors ([`GpuRingError`]) and the chunk pair's
//!   dense shapes;
//! - [`block`]: the travelling KV block and which chunk pairs a device attends;
//! - [`link`]: [`StreamLink`], `G` simulated devices on one GPU, one stream each, hops as stream-ordered copies;
//! - [`nccl`]: [`NcclLink`], one GPU per device, hops as NCCL send/receive;
//! - [`forward`] and [`backward`]: the workers and the runs that turn their states into `O`, LSE and gradients;
//! - [`backward_steps`]: the ring backward's four launches (`D`, a chunk pair's gradient sums, the finishes);
//! - [`timing`]: the device-time measurements of a ring run and its compute and communication parts.
//!
//! The recipe of the GPU ring forward is the forward kernel's with `extra_merges = 2(P − 1)` for `P` key chunks per
//! sequence ([`gpu_ring_recipe_extra_merges`]). Supported: dense layouts (every batch item has the same positions);
//! masks `None`, `Causal`, `Window` and `And` of those. Varlen is a typed error.

pub mod backward;
pub mod backward_steps;
pub mod block;
mod devices;
pub mod forward;
pub mod link;
pub mod nccl;
pub mod problem;
pub mod state;
pub mod timing;

pub use backward::{GpuBackwardDevice, GpuRingGrads, gpu_ring_backward, prepare_backward_ring, run_backward_ring};
pub use backward_steps::{
    PairBackwardInputs, ring_backward_finish_dkv, ring_backward_finish_dq, ring_backward_pair,
    ring_backward_preprocess, ring_dkv_accumulator_len,
};
pub use block::{GpuKvBlock, KvChunk};
pub use devices::{Idle, RingSetups};
pub use forward::{GpuForwardDevice, GpuRingOutput, gpu_ring_forward, prepare_forward_ring, run_forward_ring};
pub use link::{StreamLink, stream_ring};
pub use nccl::{BlockLayout, NcclLink, nccl_ring_backward, nccl_ring_forward, time_nccl_backward, time_nccl_forward};
pub use problem::{BackwardStart, GpuRingError, RingInputs, dense_dims, gpu_ring_recipe_extra_merges, pair_spec};
pub use timing::{RingVariant, overlap, time_backward_on_streams, time_forward_on_streams, time_ring, time_variant};
