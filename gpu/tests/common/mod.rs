//! What the GPU test binaries share: the kernels' recipes and the guarded launches (NaN-poisoned outputs followed by
//! sentinel guard bands, device inputs checked unchanged afterwards), both at home in the harness
//! (`attnproof_harness::recipes`, `attnproof_harness::candidate`) and offered here with `String` errors for the
//! tests that launch patched kernel texts and ring steps by hand; and the backward problem builder.
//!
//! Each test binary compiles this module on its own and uses part of it.
#![allow(dead_code)]

use std::sync::Arc;

use attnproof_gpu::backward::BackwardTiling;
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::flash::{ForwardTiling, KV_TILE};
use attnproof_gpu::{GpuBackwardStrategy, flash_forward};
use attnproof_harness::Case;
use attnproof_harness::candidate::{BackwardProblem, ForwardRun, backward_guarded, forward_guarded};
use attnproof_harness::generate::{ValueProfile, make_case, make_d_out};
use attnproof_harness::recipes;
use attnproof_harness::strategies::spec;
use attnproof_oracle::AttentionSpec;
use attnproof_proofs::flash_bound::FlashRecipe;
use attnproof_reference::Element;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use ndarray::ArrayD;
use proptest::strategy::Strategy;

// Each test binary uses part of these (as of the whole module: `dead_code` above).
#[allow(unused_imports)]
pub use attnproof_harness::adversarial::{dense, gaussian, varlen};
#[allow(unused_imports)]
pub use attnproof_harness::candidate::{GUARD, GUARD_BITS_16, GUARD_BITS_32, Gradients as Grads, Storage};

/// The forward kernel's recipe for `T` (`attnproof_harness::recipes::gpu_forward`).
pub fn forward_recipe<T: Element>() -> FlashRecipe {
    recipes::gpu_forward::<T>()
}

/// The backward kernels' recipe for `T` in the default tiling (`attnproof_harness::recipes::gpu_backward`).
pub fn backward_recipe<T: Element>() -> FlashRecipe {
    backward_recipe_for::<T>(BackwardTiling::DEFAULT)
}

/// The backward kernels' recipe for `T` in `tiling`.
pub fn backward_recipe_for<T: Element>(tiling: BackwardTiling) -> FlashRecipe {
    recipes::gpu_backward::<T>(tiling).recipe
}

/// A host tensor on the device (`attnproof_harness::candidate::upload`).
pub fn upload<X: DeviceRepr + ValidAsZeroBits + Copy>(
    stream: &Arc<CudaStream>,
    t: &ArrayD<X>,
) -> Result<CudaSlice<X>, String> {
    attnproof_harness::candidate::upload(stream, t).map_err(|e| e.to_string())
}

/// One forward launch of `kernel` with `tiling`, guarded (`attnproof_harness::candidate::forward_guarded`). Returns
/// `O` and `LSE`.
pub fn run_forward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    kernel: KernelSource,
    tiling: ForwardTiling,
) -> Result<(ArrayD<T>, ArrayD<f32>), String> {
    let run = forward_guarded(stream, case, kernel, tiling).map_err(|e| e.to_string())?;
    Ok((run.o, run.lse))
}

/// A backward case: inputs, upstream gradient and the (unpatched) GPU forward's outputs.
pub struct Problem<T> {
    /// Inputs.
    pub case: Case<T>,
    /// Upstream gradient.
    pub d_out: ArrayD<T>,
    /// The forward's output.
    pub o: ArrayD<T>,
    /// The forward's LSE.
    pub lse: ArrayD<f32>,
}

/// Draws the case and its upstream gradient and runs the production GPU forward for `O` and `LSE`.
pub fn problem<T: Storage>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    profile: ValueProfile,
    seed: u64,
) -> Problem<T> {
    let case = make_case::<T>(spec, profile, seed);
    let d_out = make_d_out::<T>(spec, seed);
    let fwd = flash_forward(stream, spec, case.q.view(), case.k.view(), case.v.view())
        .unwrap_or_else(|e| panic!("GPU forward of {spec:?}: {e}"));
    Problem { case, d_out, o: fwd.o, lse: fwd.lse }
}

/// One backward of `kernel` with `strategy` in the default tiling, guarded.
pub fn run_backward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    p: &Problem<T>,
    kernel: KernelSource,
    strategy: GpuBackwardStrategy,
) -> Result<Grads<T>, String> {
    run_backward_guarded_tiled(stream, p, kernel, BackwardTiling::DEFAULT, strategy)
}

/// [`run_backward_guarded`] in `tiling` (`attnproof_harness::candidate::backward_guarded`).
pub fn run_backward_guarded_tiled<T: Storage>(
    stream: &Arc<CudaStream>,
    p: &Problem<T>,
    kernel: KernelSource,
    tiling: BackwardTiling,
    strategy: GpuBackwardStrategy,
) -> Result<Grads<T>, String> {
    // The forward's outputs travel by value in the harness's problem; one copy per launch is negligible beside it.
    let forward = ForwardRun { o: p.o.clone(), lse: p.lse.clone() };
    let problem = BackwardProblem { case: &p.case, forward: &forward, d_out: &p.d_out };
    backward_guarded(stream, problem, kernel, tiling, strategy).map_err(|e| e.to_string())
}

/// The harness's shapes (lengths around the kernels' 64-row tiles), head dims rounded up to the supported multiples
/// of 8 (the strategy's awkward 1, 59 and 111 included).
pub fn kernel_spec() -> impl Strategy<Value = AttentionSpec> {
    spec(KV_TILE).prop_map(|mut s| {
        s.head_dim = s.head_dim.div_ceil(8) * 8;
        s.head_dim_v = s.head_dim_v.div_ceil(8) * 8;
        s
    })
}
