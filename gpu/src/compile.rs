//! NVRTC compilation with pinned options and a per-process module cache.
//!
//! Options are pinned so that a kernel's arithmetic is fixed by this file, not by a toolkit default: the target is
//! `sm_90a` on compute capability 9.0 (Hopper's architecture-specific target) and the device's own `sm_XY`
//! elsewhere; `--ftz=false` (subnormals kept: the bound's underflow terms assume gradual underflow),
//! `--prec-div=true` and `--prec-sqrt=true` (IEEE division and square root), `--fmad=true` (contraction can only
//! remove roundings), C++17, and the include path `$CUDA_HOME/include`, else `/usr/local/cuda/include`, for
//! `cuda_bf16.h`/`cuda_fp16.h`. Kernel variants (storage type, padded head dims) are `-D` defines, so each variant is
//! its own module, compiled once per process and cached under (device ordinal, kernel name, source text, options).
//! [`module_from_source`] is the one compile path: the embedded kernels go through it, and so can other texts of a
//! kernel (the tests compile patched copies of `flash_fwd.cu` as mutants), which the source text in the key keeps apart.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::Ptx;

use crate::error::GpuError;
use crate::launch;

/// A kernel source embedded in the binary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelSource {
    /// The source file's stem, also the NVRTC program name.
    pub name: &'static str,
    /// The CUDA C source.
    pub source: &'static str,
}

/// `gpu/kernels/flash_fwd.cu`.
pub const FLASH_FWD: KernelSource = KernelSource {
    name: "flash_fwd",
    source: concat!(include_str!("../kernels/common.cuh"), include_str!("../kernels/flash_fwd.cu")),
};

/// `gpu/kernels/flash_bwd.cu`.
pub const FLASH_BWD: KernelSource = KernelSource {
    name: "flash_bwd",
    source: concat!(include_str!("../kernels/common.cuh"), include_str!("../kernels/flash_bwd.cu")),
};

/// The compute capability of the context's device.
pub fn compute_capability(ctx: &Arc<CudaContext>) -> Result<(i32, i32), GpuError> {
    ctx.compute_capability().map_err(|e| GpuError::driver("cuDeviceGetAttribute(compute capability)", e))
}

/// The NVRTC target for a compute capability: `sm_90a` on 9.0, the device's own `sm_XY` elsewhere.
pub fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) { "sm_90a".to_owned() } else { format!("sm_{major}{minor}") }
}

/// The CUDA include directory: `$CUDA_HOME/include`, else `/usr/local/cuda/include`.
pub fn include_dir() -> String {
    match std::env::var("CUDA_HOME") {
        Ok(home) if !home.trim().is_empty() => format!("{}/include", home.trim_end_matches('/')),
        _ => "/usr/local/cuda/include".to_owned(),
    }
}

/// The full, pinned NVRTC option list for `arch` plus the variant's `-D` defines.
pub fn options(arch: &str, defines: &[String]) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        format!("--include-path={}", include_dir()),
        "-std=c++17".to_owned(),
        "--ftz=false".to_owned(),
        "--prec-div=true".to_owned(),
        "--prec-sqrt=true".to_owned(),
        "--fmad=true".to_owned(),
    ];
    opts.extend(defines.iter().map(|d| format!("-D{d}")));
    opts
}

type CacheKey = (usize, &'static str, &'static str, Vec<String>);

fn cache() -> &'static Mutex<HashMap<CacheKey, Arc<CudaModule>>> {
    static CACHE: OnceLock<Mutex<HashMap<CacheKey, Arc<CudaModule>>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The module of `kernel` compiled with `defines` for the context's device, from the cache or freshly compiled.
pub fn module(ctx: &Arc<CudaContext>, kernel: KernelSource, defines: &[String]) -> Result<Arc<CudaModule>, GpuError> {
    module_from_source(ctx, kernel.name, kernel.source, defines)
}

/// The module of the CUDA C text `source` (NVRTC program `name`) compiled with the pinned options plus `defines`
/// for the context's device, from the cache or freshly compiled.
///
/// The lock is held while compiling, so that two threads asking for the same variant compile it once.
pub fn module_from_source(
    ctx: &Arc<CudaContext>,
    name: &'static str,
    source: &'static str,
    defines: &[String],
) -> Result<Arc<CudaModule>, GpuError> {
    let kernel = KernelSource { name, source };
    let (major, minor) = compute_capability(ctx)?;
    if major < 8 {
        return Err(GpuError::UnsupportedDevice { major, minor });
    }
    let opts = options(&arch_for(major, minor), defines);
    let key = (ctx.ordinal(), kernel.name, kernel.source, opts.clone());
    // A poisoned lock only means another thread panicked mid-insert; the map itself is still consistent.
    let mut map = cache().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(m) = map.get(&key) {
        return Ok(m.clone());
    }
    let cubin = compile_with_options(kernel, opts)?;
    let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| GpuError::driver("cuModuleLoadData", e))?;
    map.insert(key, module.clone());
    Ok(module)
}

/// Whether NVRTC can be loaded here. It needs no device: kernels compile on any machine that has it.
pub fn nvrtc_present() -> bool {
    launch::nvrtc_library_present()
}

/// The CUBIN of `kernel` compiled for `arch` (e.g. `sm_90a`) with the pinned options plus `defines`, without a device
/// or the module cache: what a launch on such a device would load. For compile-only checks of kernel texts.
pub fn compile_for_arch(kernel: KernelSource, arch: &str, defines: &[String]) -> Result<Vec<u8>, GpuError> {
    compile_with_options(kernel, options(arch, defines))
}

/// The one NVRTC call of the crate's compile paths.
fn compile_with_options(kernel: KernelSource, opts: Vec<String>) -> Result<Vec<u8>, GpuError> {
    if !launch::nvrtc_library_present() {
        return Err(GpuError::NoNvrtc);
    }
    launch::compile_cubin(kernel.source, kernel.name, &opts).map_err(|f| GpuError::Compile {
        kernel: kernel.name,
        options: opts,
        status: f.status,
        log: f.log,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hopper_gets_the_architecture_specific_target() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(8, 6), "sm_86");
        assert_eq!(arch_for(12, 0), "sm_120");
    }

    #[test]
    fn options_are_pinned_and_defines_appended() {
        let o = options("sm_90a", &["ELEM_BF16".to_owned(), "HEAD_DIM_PAD=64".to_owned()]);
        assert_eq!(o[0], "--gpu-architecture=sm_90a");
        assert!(o[1].starts_with("--include-path=") && o[1].ends_with("/include"));
        for pinned in ["-std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=true"] {
            assert!(o.iter().any(|x| x == pinned), "{pinned} missing from {o:?}");
        }
        assert_eq!(&o[o.len() - 2..], ["-DELEM_BF16", "-DHEAD_DIM_PAD=64"]);
    }

    #[test]
    fn kernel_source_is_embedded() {
        assert!(FLASH_FWD.source.contains("extern \"C\" __global__"));
        assert!(FLASH_FWD.source.contains("flash_fwd("));
    }
}
