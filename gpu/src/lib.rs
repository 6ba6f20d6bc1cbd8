//! CUDA side of attnproof: finding a device, NVRTC-compiled attention kernels (`gpu/kernels/*.cu`, embedded with
//! `include_str!`) and their typed launch wrappers.
//!
//! Modules: [`compile`] (pinned NVRTC options, per-process module cache, capability query, which device runs which
//! kernel), [`flash`] (the FlashAttention forward: validation and launch wrappers, and the kernel's rounding-error
//! recipe), [`backward`] (the backward kernels, likewise), [`block_sparse`] (block lists and the block-sparse
//! forward, the forward kernel's `BLOCK_SPARSE` mode), [`nsa`] (NSA's kernels, as they land), [`dsa`] (DSA's lightning
//! indexer with its exact top-k), [`pisa`] (PISA's pyramid selection, above `block_sparse`), [`ring`] (the ring's
//! GPU pieces), [`common`] (what every
//! kernel family shares: storage types, the kernel mask, limits and checks), [`error`] (typed errors). The private
//! `params` module holds the kernels' parameter structs, one per kernel family, mirrored by `gpu/kernels/common.cuh`.
//! Every `unsafe` block of the crate is in the private `launch` module, each with a `// SAFETY:` note.
//!
//! The modules import each other without a cycle (a test below checks it): `error` imports no module, `common`
//! only `error`, `params` `common`; `launch` and `compile` stand below the launch modules `flash`, `block_sparse`
//! (above `flash`), `backward`, `nsa`, `dsa`, `pisa` and `ring`, and the crate root only re-exports and imports.
//!
//! cudarc is built with `dynamic-loading`, so this crate compiles on every machine, with or without CUDA. The price is
//! that cudarc panics on the first driver call when `libcuda` cannot be loaded, so every use of the GPU goes through
//! [`cuda_device`], which asks whether the driver library is present before touching it and turns every way of not
//! having a device into a typed [`GpuUnavailable`] error. Tests use [`skip_unless_gpu`], which reports a skip in the
//! test's output instead of pretending to have run.

pub mod backward;
pub mod block_sparse;
pub mod common;
pub mod compile;
pub mod dsa;
pub mod error;
pub mod flash;
pub mod hils;
mod launch;
pub mod nsa;
mod params;
pub mod pisa;
pub mod ring;

pub use backward::{
    BackwardDeviceInputs, BackwardDeviceOutputs, BackwardOutput, BackwardTiling, GpuBackwardStrategy, backward_variant,
    flash_backward, flash_backward_device, flash_backward_device_with,
};
pub use block_sparse::{BlockLists, ListHeads, block_sparse_forward, block_sparse_forward_device};
pub use common::{GpuElement, KernelMask, kernel_scale};
pub use error::{BlockListFault, GpuError, GpuUnavailable};
pub use flash::{
    ForwardOutput, ForwardTiling, PreparedForward, flash_forward, flash_forward_device, flash_forward_device_with,
    forward_variant, production_forward,
};

use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use cudarc::driver::CudaContext;
use dsa::sparse::SparseProducts;

pub use crate::compile::ModuleVariant;

/// Every module the launches for `spec` compile with storage type `T` in the given tilings: the forward (plain, the
/// ring's `STATE_OUT` mode and the `BLOCK_SPARSE` mode), the block selector, the backward (plain, the ring's
/// `KV_ACCUM` mode and the `BLOCK_SPARSE` mode), the ring's merge and finalize kernels, and the sm_90a forward and
/// backward (plain and `BLOCK_SPARSE`) where the head dims (and, for the backward, `backward`) suit them. With [`compile::compile_for_arch`] this checks kernel texts on a
/// machine without a device.
pub fn module_variants<T: GpuElement>(
    spec: &AttentionSpec,
    forward: ForwardTiling,
    backward: BackwardTiling,
) -> Result<Vec<ModuleVariant>, GpuError> {
    let fwd = flash::forward_defines::<T>(spec, forward, compile::FLASH_FWD)?;
    let bwd = backward::backward_defines::<T>(spec, backward, compile::FLASH_BWD)?;
    // NSA's selected backward and DSA's token-sparse backward: flash_bwd.cu's helpers in their tiling (four warps).
    let nsa_bwd = backward::backward_defines::<T>(spec, nsa::selected_backward::TILING, compile::FLASH_BWD)?;
    let dsa_bwd = backward::backward_defines::<T>(spec, dsa::sparse_backward::TILING, compile::FLASH_BWD)?;
    let with = |defines: &[String], extra: &str| defines.iter().cloned().chain([extra.to_owned()]).collect();
    let variant = |kernel, defines| ModuleVariant { kernel, defines };
    let selected_rows = |rows_per_cta| nsa::selected::SelectedTiling { rows_per_cta };
    // DSA's indexer loss with the spec's head dim as the main attention's, for both index dims.
    let loss_shape = |index_dim| dsa::loss::LossShape {
        indexer: dsa::index::IndexerShape { seq_len: 1, n_index_heads: 1, index_dim, top_k: 1 },
        n_heads: 1,
        n_heads_kv: 1,
        head_dim: spec.head_dim,
        scale: 1.0,
    };
    // The sm_90a forward, where the spec's head dims suit it (its block-sparse mode is what the wrappers launch).
    let sm90 = flash::forward_defines::<T>(spec, ForwardTiling::WGMMA, compile::FLASH_FWD_SM90).ok();
    let sm90_bwd = backward::backward_defines::<T>(spec, backward, compile::FLASH_BWD_SM90).ok();
    let sm90_variants =
        sm90.iter().map(|d| (compile::FLASH_FWD_SM90, d)).chain(sm90_bwd.iter().map(|d| (compile::FLASH_BWD_SM90, d)));
    let sm90_variants = sm90_variants.flat_map(|(kernel, defines)| {
        [variant(kernel, with(defines, flash::BLOCK_SPARSE)), variant(kernel, defines.clone())]
    });
    // DSA's token-sparse forward on wgmma, where the spec's head dims suit it (any group: the path's CTA always
    // holds 64 heads).
    let dsa_sparse_wgmma = SparseProducts::wgmma_fits(spec)
        .then(|| variant(dsa::sparse::DSA_SPARSE, dsa::sparse::sparse_defines::<T>(spec, SparseProducts::Wgmma)));
    Ok([
        variant(compile::FLASH_FWD, with(&fwd, flash::STATE_OUT)),
        variant(compile::FLASH_FWD, with(&fwd, flash::BLOCK_SPARSE)),
        variant(compile::FLASH_FWD, fwd),
        variant(compile::FLASH_BWD, with(&bwd, backward::KV_ACCUM)),
        variant(compile::FLASH_BWD, with(&bwd, backward::BLOCK_SPARSE)),
        variant(compile::FLASH_BWD, bwd),
        variant(ring::state::RING_STATE, vec![T::DEFINE.to_owned()]),
        variant(block_sparse::select::BSA_SELECT, vec![T::DEFINE.to_owned()]),
        variant(pisa::select::PISA_SELECT, vec![T::DEFINE.to_owned()]),
        variant(pisa::tail::PISA_TAIL, pisa::tail::tail_defines::<T>(spec)),
        variant(pisa::tail_backward::PISA_TAIL_BWD, pisa::tail_backward::backward_defines::<T>(spec)),
        variant(pisa::covariance::PISA_COVARIANCE, pisa::covariance::covariance_defines::<T>()),
        variant(pisa::diagnostics::PISA_MASS, vec![T::DEFINE.to_owned()]),
        variant(hils::HILS, vec![T::DEFINE.to_owned()]),
        variant(nsa::compress::NSA_COMPRESS, vec![T::DEFINE.to_owned()]),
        variant(nsa::gates::NSA_GATES, vec![T::DEFINE.to_owned()]),
        variant(nsa::select::NSA_SELECT, nsa::select::select_defines::<T>(spec.head_dim)),
        // The default CTAs of 48 rows and the 64 rows of groups above 48.
        variant(nsa::selected::NSA_SELECTED, nsa::selected::selected_defines::<T>(spec, selected_rows(48))),
        variant(nsa::selected::NSA_SELECTED, nsa::selected::selected_defines::<T>(spec, selected_rows(64))),
        variant(nsa::selected_backward::NSA_SELECTED_BWD, nsa_bwd),
        variant(dsa::index::DSA_INDEX, dsa::index::index_defines::<T>(64)),
        variant(dsa::index::DSA_INDEX, dsa::index::index_defines::<T>(128)),
        variant(dsa::index::DSA_INDEX_MMA_SYNC, dsa::index::index_defines::<T>(64)),
        variant(dsa::index::DSA_INDEX_MMA_SYNC, dsa::index::index_defines::<T>(128)),
        variant(dsa::sparse::DSA_SPARSE, dsa::sparse::sparse_defines::<T>(spec, SparseProducts::MmaSync)),
        variant(dsa::sparse::DSA_SPARSE_MMA_SYNC, dsa::sparse::sparse_defines::<T>(spec, SparseProducts::MmaSync)),
        variant(dsa::sparse_backward::DSA_SPARSE_BWD, dsa_bwd),
        variant(dsa::loss::DSA_LOSS, dsa::loss::loss_defines::<T>(&loss_shape(64))),
        variant(dsa::loss::DSA_LOSS, dsa::loss::loss_defines::<T>(&loss_shape(128))),
    ]
    .into_iter()
    .chain(sm90_variants)
    .chain(dsa_sparse_wgmma)
    .collect())
}

/// Environment variable that turns a GPU skip into a test failure.
///
/// `cargo xtask verify` sets it when `nvidia-smi` lists a GPU, so that a broken driver setup on a GPU machine fails
/// loudly instead of letting every GPU test skip and pass.
pub const REQUIRE_GPU_ENV: &str = "ATTNPROOF_REQUIRE_GPU";

/// Opens the primary context of CUDA device 0, or says why there is none.
///
/// This never panics on a machine without CUDA: the driver library is probed first, and a panic from cudarc (its way of
/// reporting a library or symbol it cannot load) is caught and returned as [`GpuUnavailable::DriverPanicked`].
pub fn cuda_device() -> Result<Arc<CudaContext>, GpuUnavailable> {
    if !launch::driver_library_present() {
        return Err(GpuUnavailable::NoDriverLibrary);
    }
    // The probe above can succeed while later symbol lookups still fail (an older driver than the `cuda-13000` bindings
    // expect), and cudarc reports those by panicking, so the context creation is fenced as a second line of defence.
    // `AssertUnwindSafe` is sound here: on a panic nothing half-built escapes, the closure owns no state of ours.
    match panic::catch_unwind(AssertUnwindSafe(|| CudaContext::new(0))) {
        Ok(Ok(ctx)) => Ok(ctx),
        Ok(Err(err)) => Err(GpuUnavailable::NoDevice(err.to_string())),
        Err(payload) => Err(GpuUnavailable::DriverPanicked(panic_message(payload.as_ref()))),
    }
}

/// Returns the CUDA device for a GPU test, or prints `skipped: no CUDA device (<test_name>)` and returns `None`.
///
/// # Panics
///
/// Panics when there is no device but the environment variable [`REQUIRE_GPU_ENV`] is `1`, so that a verification run
/// on a GPU machine cannot pass by skipping.
pub fn skip_unless_gpu(test_name: &str) -> Option<Arc<CudaContext>> {
    match cuda_device() {
        Ok(ctx) => Some(ctx),
        Err(why) if gpu_required() => {
            panic!("{test_name}: a CUDA device is required ({REQUIRE_GPU_ENV}=1) but unavailable: {why}")
        }
        Err(why) => {
            // The reason goes on its own line so that the skip line itself stays greppable and identical everywhere.
            println!("skipped: no CUDA device ({test_name})");
            println!("  reason: {why}");
            None
        }
    }
}

/// Returns the CUDA device for a test of an sm_90a-only kernel when it is compute capability 9.0 (the only one that
/// runs `wgmma`), else prints why the test skips and returns `None`; no device at all is [`skip_unless_gpu`]'s case
/// (a panic under [`REQUIRE_GPU_ENV`]). Another device under [`REQUIRE_GPU_ENV`] skips too: the production wrappers
/// run the portable kernels there, and their tests run.
///
/// # Panics
///
/// Panics when the device's compute capability cannot be read.
pub fn skip_unless_hopper(test_name: &str) -> Option<Arc<CudaContext>> {
    let ctx = skip_unless_gpu(test_name)?;
    let cc = compile::compute_capability(&ctx).expect("the compute capability");
    if cc != (9, 0) {
        println!("{test_name}: skipped: sm_90a kernels need compute capability 9.0, the device has {cc:?}");
        return None;
    }
    Some(ctx)
}

/// Environment variable that turns a missing NVRTC into a failure of the compile-only tests: `cargo xtask test` and
/// `verify` set it when they have NVRTC to offer (NVIDIA's wheel, installed by xtask), so that CI cannot skip them.
pub const REQUIRE_NVRTC_ENV: &str = "ATTNPROOF_REQUIRE_NVRTC";

/// Whether a compile-only test (kernels compiled by NVRTC without a device) can run: `true` when NVRTC loads; else it
/// prints `skipped: no NVRTC (test)` and returns `false`, or panics when [`REQUIRE_NVRTC_ENV`] is `1`.
pub fn nvrtc_or_skip(test_name: &str) -> bool {
    if compile::nvrtc_present() {
        return true;
    }
    if std::env::var(REQUIRE_NVRTC_ENV).is_ok_and(|v| v.trim() == "1") {
        panic!("{test_name}: NVRTC is required ({REQUIRE_NVRTC_ENV}=1) but libnvrtc could not be loaded");
    }
    println!("skipped: no NVRTC ({test_name})");
    false
}

/// Whether the NCCL library can be loaded (its name as cudarc looks for it: `libnccl.so` or `libnccl.so.13`; the GPU
/// bundle's `run.sh` links pip's `libnccl.so.2` under that name). Multi-GPU code asks this before its first NCCL call,
/// which would otherwise panic inside cudarc.
pub fn nccl_present() -> bool {
    launch::nccl_library_present()
}

/// Whether the environment demands a real GPU run (see [`REQUIRE_GPU_ENV`]).
fn gpu_required() -> bool {
    std::env::var(REQUIRE_GPU_ENV).is_ok_and(|v| v.trim() == "1")
}

/// Extracts the text of a panic payload, which is a `&str` or a `String` for every `panic!` with a message.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_message_reads_both_payload_kinds() {
        let boxed: Box<dyn std::any::Any + Send> = Box::new("static text");
        assert_eq!(panic_message(boxed.as_ref()), "static text");
        let boxed: Box<dyn std::any::Any + Send> = Box::new(String::from("owned text"));
        assert_eq!(panic_message(boxed.as_ref()), "owned text");
        let boxed: Box<dyn std::any::Any + Send> = Box::new(42_u32);
        assert_eq!(panic_message(boxed.as_ref()), "a panic without a message");
    }

    #[test]
    fn every_kernel_a_launch_compiles_has_a_device_requirement() {
        let spec = AttentionSpec::dense(1, 2, 1, 64, 64, 64, 64);
        let variants =
            module_variants::<half::bf16>(&spec, ForwardTiling::for_head_dims(64, 64), BackwardTiling::DEFAULT)
                .unwrap();
        let mut kernels: Vec<&str> = variants.iter().map(|v| v.kernel.name).collect();
        // Each kernel once, where it first appears (a text's modes and paths are several variants).
        let mut seen = std::collections::HashSet::new();
        kernels.retain(|k| seen.insert(*k));
        assert_eq!(
            kernels,
            [
                "flash_fwd",
                "flash_bwd",
                "ring_state",
                "bsa_select",
                "pisa_select",
                "pisa_tail",
                "pisa_tail_bwd",
                "pisa_covariance",
                "pisa_mass",
                "hils",
                "nsa_compress",
                "nsa_gates",
                "nsa_select",
                "nsa_selected",
                "nsa_selected_bwd",
                "dsa_index",
                "dsa_index_mma_sync",
                "dsa_sparse",
                "dsa_sparse_mma_sync",
                "dsa_sparse_bwd",
                "dsa_loss",
                "flash_fwd_sm90",
                "flash_bwd_sm90"
            ]
        );
        for kernel in kernels {
            assert!(compile::DEVICE_REQUIREMENTS.iter().any(|r| r.kernel == kernel), "{kernel} is not listed");
        }
    }

    #[test]
    fn cuda_device_never_panics() {
        // Whatever this machine has, asking for a device must answer with a value, not unwind; a failure here means
        // the guards in `cuda_device` let a cudarc panic through.
        match cuda_device() {
            Ok(ctx) => println!("CUDA device 0 opened (ordinal {})", ctx.ordinal()),
            Err(why) => println!("skipped: no CUDA device (cuda_device_never_panics): {why}"),
        }
    }
}
