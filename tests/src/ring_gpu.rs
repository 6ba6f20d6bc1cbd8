//! The harness's side of the GPU ring (`attnproof_gpu::ring`): adapters from a verification [`Case`] and a CPU
//! [`RingConfig`] to the GPU ring's own inputs and split. The GPU ring itself (links, workers, NCCL, timing) lives in
//! the gpu crate; what the harness adds is the verification of its outputs, in the tests.

use attnproof_gpu::ring::{BackwardStart, RingInputs};
use attnproof_reference::RingConfig;
use ndarray::ArrayD;

use crate::Case;

/// The GPU ring's inputs for `case`: its spec and its `Q, K, V`.
pub fn ring_inputs<T>(case: &Case<T>) -> RingInputs<'_, T> {
    RingInputs { spec: &case.spec, q: case.q.view(), k: case.k.view(), v: case.v.view() }
}

/// The GPU ring backward's start from a forward's `O` and LSE and the upstream gradient `d_out`.
pub fn backward_start<'a, T>(o: &'a ArrayD<T>, lse: &'a ArrayD<f32>, d_out: &'a ArrayD<T>) -> BackwardStart<'a, T> {
    BackwardStart { o: o.view(), lse: lse.view(), d_out: d_out.view() }
}

/// The `extra_merges` of the forward `FlashRecipe` that covers the GPU ring forward over `config`'s devices and
/// layout: `2(P − 1)` for `P` key chunks per sequence (`attnproof_gpu::ring::gpu_ring_recipe_extra_merges`; the GPU
/// ring has no tiles of its own to take from `config`).
pub fn gpu_ring_recipe_extra_merges(config: RingConfig) -> usize {
    attnproof_gpu::ring::gpu_ring_recipe_extra_merges(config.split())
}
