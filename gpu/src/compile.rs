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
//!
//! # Which devices run which kernel
//!
//! Before NVRTC is called, [`check_device_supports`] compares the device's compute capability with what the kernel's
//! instructions need ([`DEVICE_REQUIREMENTS`]) and answers [`GpuError::UnsupportedDevice`] instead of a compile log:
//!
//! - `flash_fwd` needs 8.0: `cp.async` and the bf16/f16 `mma.sync.m16n8k16` exist from `sm_80` on (with `ldmatrix`,
//!   from `sm_75`). It runs on the A100 (8.0), the consumer Ampere and Ada parts (8.6, 8.9) and everything later.
//! - `flash_fwd_sm90` needs 9.0 and only 9.0: `wgmma.mma_async` exists in the architecture-specific `sm_90a` target
//!   alone, so no later device runs it; the launch wrappers pick it only on 9.0 and run `flash_fwd` elsewhere.
//! - `flash_bwd` needs 9.0: `bwd_kv` stores dS with `stmatrix` and adds dQ with the vector reduction
//!   `red.global.add.v2.f32`, both from `sm_90` on; 8.x devices cannot run the backward.
//! - `flash_bwd_sm90` (the backward with a `wgmma` KV owner) needs 9.0 and only 9.0, as `flash_fwd_sm90`.
//! - `bsa_select` (block selection) needs 8.0: its streaming selector copies the pooled key tiles with cp.async;
//!   otherwise f64 arithmetic, warp shuffles and ballots.
//! - `pisa_select` (PISA's pyramid selection), `pisa_tail` (PISA's first-order tail), `pisa_mass` (the block masses
//!   of E30's diagnostics) and `hils` (HiLS's chunk summaries and router) are compiled after `bsa_select.cu` (its
//!   pooling and helpers) and need 8.0 with it; `pisa_covariance` (E24's spreads and scores) is compiled with it too.
//! - `nsa_compress` (NSA's compressed keys and values) needs 7.5 like `ring_state`: f64 arithmetic and wide loads only.
//! - `nsa_gates` (NSA's gated sum and its gradients) needs 7.5 too: f32 arithmetic, `expf` and warp shuffles only.
//! - `nsa_select` (NSA's block scores and lists) needs 8.0 like `flash_fwd`: its scores are `mma.sync.m16n8k16`
//!   products of `cp.async`-loaded tiles.
//! - `nsa_selected` (NSA's selected attention) needs 8.0 like `flash_fwd`, whose products it shares; its union walk
//!   takes minima with `redux.sync`, also from `sm_80` on.
//! - `dsa_index` (DSA's lightning indexer and exact top-k) needs 8.0 like `flash_fwd`: its logits are
//!   `mma.sync.m16n8k16` products of `cp.async`-loaded tiles, except on `sm_90a`, where the same text takes
//!   `wgmma.mma_async` (under `__CUDA_ARCH_FEAT_SM90_ALL`, which only that target defines). `dsa_index_mma_sync`
//!   is that text on `mma.sync` everywhere, the path the other architectures run, verified on Hopper.
//! - `dsa_sparse` (DSA's token-sparse attention) needs 8.0 like `flash_fwd`, whose products it shares; on `sm_90a`
//!   its launches for groups of more than 48 heads and head dims up to 128 define `SPARSE_WGMMA`, and the text takes
//!   `wgmma.mma_async` where the target has it (a target without it compiles the `mma.sync` path even so).
//!   `dsa_sparse_mma_sync` is that text launched without `SPARSE_WGMMA` everywhere, verified on Hopper.
//! - `ring_state` needs 7.5, the oldest target the pinned CUDA 13 NVRTC compiles for: its merge and finalize use f32
//!   arithmetic, `ex2.approx` and warp shuffles only.
//!
//! The target on 9.0 is `sm_90a`, whose architecture-specific instructions (`wgmma`, `setmaxnreg`, ...) do not exist
//! in later architectures' plain targets. Only `flash_fwd_sm90` and `flash_bwd_sm90` use them unconditionally, and
//! `dsa_index` on that target alone; every instruction of the other kernels is in the plain `sm_100` and `sm_120`
//! targets, which [`arch_for`] picks on 10.0 and 12.0, so those devices run them.
//! `gpu/tests/it/compile_only.rs` compiles each kernel for 7.5, 8.0, 8.6, 8.9, 9.0, 10.0 and 12.0 and checks that NVRTC
//! accepts exactly the pairs this table admits.

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

/// One module a launch may compile: a kernel text and its defines.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ModuleVariant {
    /// The kernel text.
    pub kernel: KernelSource,
    /// The `-D` defines of the variant.
    pub defines: Vec<String>,
}

/// `gpu/kernels/flash_fwd.cu`.
pub const FLASH_FWD: KernelSource = KernelSource {
    name: "flash_fwd",
    source: concat!(include_str!("../kernels/common.cuh"), include_str!("../kernels/flash_fwd.cu")),
};

/// `gpu/kernels/flash_fwd_sm90.cu` after `gpu/kernels/sm90.cuh`: the forward on Hopper's `wgmma` (compute capability
/// 9.0 only), with `flash_fwd`'s arguments.
pub const FLASH_FWD_SM90: KernelSource = KernelSource {
    name: "flash_fwd_sm90",
    source: concat!(
        include_str!("../kernels/common.cuh"),
        include_str!("../kernels/sm90.cuh"),
        include_str!("../kernels/flash_fwd_sm90.cu")
    ),
};

/// `gpu/kernels/flash_bwd.cu`.
pub const FLASH_BWD: KernelSource = KernelSource {
    name: "flash_bwd",
    source: concat!(include_str!("../kernels/common.cuh"), include_str!("../kernels/flash_bwd.cu")),
};

/// `gpu/kernels/flash_bwd.cu` followed by `gpu/kernels/flash_bwd_sm90.cu`: the backward whose KV owner (`bwd_kv`) runs
/// on Hopper's `wgmma` (compute capability 9.0 only), compiled with [`BWD_KV_SM90`]; its other kernels are
/// `flash_bwd`'s, with the same arguments.
pub const FLASH_BWD_SM90: KernelSource = KernelSource {
    name: "flash_bwd_sm90",
    source: concat!(
        include_str!("../kernels/common.cuh"),
        include_str!("../kernels/sm90.cuh"),
        include_str!("../kernels/flash_bwd.cu"),
        include_str!("../kernels/flash_bwd_sm90.cu")
    ),
};

/// The define every module of [`FLASH_BWD_SM90`] is compiled with: `flash_bwd.cu` then leaves `bwd_kv` to
/// `flash_bwd_sm90.cu`.
pub const BWD_KV_SM90: &str = "BWD_KV_SM90";

/// What a kernel needs of the device: the lowest compute capability whose target has every instruction it uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRequirement {
    /// The kernel (its [`KernelSource::name`]).
    pub kernel: &'static str,
    /// The lowest compute capability (major, minor) that runs it.
    pub needs: (i32, i32),
    /// Whether only `needs` itself runs it: its instructions are architecture-specific (`sm_90a`'s `wgmma`), absent
    /// from every later architecture.
    pub only: bool,
    /// The instructions that set `needs`.
    pub instructions: &'static str,
}

/// The requirement of every kernel text of the crate (see the module docs); a kernel named otherwise gets
/// [`DEFAULT_REQUIREMENT`].
pub const DEVICE_REQUIREMENTS: [DeviceRequirement; 23] = [
    DeviceRequirement {
        kernel: "flash_fwd",
        needs: (8, 0),
        only: false,
        instructions: "cp.async and bf16/f16 mma.sync.m16n8k16, in every later target too",
    },
    DeviceRequirement {
        kernel: "flash_fwd_sm90",
        needs: (9, 0),
        only: true,
        instructions: "wgmma.mma_async, which only the sm_90a target has",
    },
    DeviceRequirement {
        kernel: "flash_bwd",
        needs: (9, 0),
        only: false,
        instructions: "stmatrix and red.global.add.v2.f32, beside the forward's cp.async and mma.sync",
    },
    DeviceRequirement {
        kernel: "flash_bwd_sm90",
        needs: (9, 0),
        only: true,
        instructions: "wgmma.mma_async, which only the sm_90a target has",
    },
    DeviceRequirement {
        kernel: "bsa_select",
        needs: (8, 0),
        only: false,
        instructions: "cp.async for the streaming selector's key tiles; f64 arithmetic, warp shuffles and ballots",
    },
    DeviceRequirement {
        kernel: "pisa_select",
        needs: (8, 0),
        only: false,
        instructions: "bsa_select.cu's pooling, compiled with its cp.async; f64 arithmetic, warp shuffles and ballots",
    },
    DeviceRequirement {
        kernel: "pisa_tail",
        needs: (8, 0),
        only: false,
        instructions: "bsa_select.cu's pooling, cp.async, ldmatrix and mma.sync m16n8k16 (bf16/f16); f64 arithmetic",
    },
    DeviceRequirement {
        kernel: "pisa_tail_bwd",
        needs: (8, 0),
        only: false,
        instructions: "pisa_tail.cu compiled with it (cp.async, ldmatrix, mma.sync m16n8k16); f64 arithmetic",
    },
    DeviceRequirement {
        kernel: "pisa_covariance",
        needs: (8, 0),
        only: false,
        instructions: "bsa_select.cu compiled with it (its streaming selector's cp.async); f64 arithmetic",
    },
    DeviceRequirement {
        kernel: "pisa_mass",
        needs: (8, 0),
        only: false,
        instructions: "bsa_select.cu's helpers, compiled with its cp.async; f64 arithmetic and warp shuffles",
    },
    DeviceRequirement {
        kernel: "hils",
        needs: (8, 0),
        only: false,
        instructions: "bsa_select.cu's helpers, compiled with its cp.async; f64 arithmetic, warp shuffles and ballots",
    },
    DeviceRequirement {
        kernel: "nsa_compress",
        needs: (7, 5),
        only: false,
        instructions: "the oldest target of the pinned CUDA 13 NVRTC; f64 arithmetic and 16-byte loads only",
    },
    DeviceRequirement {
        kernel: "nsa_gates",
        needs: (7, 5),
        only: false,
        instructions: "the oldest target of the pinned CUDA 13 NVRTC; f32 arithmetic, expf and warp shuffles only",
    },
    DeviceRequirement {
        kernel: "nsa_select",
        needs: (8, 0),
        only: false,
        instructions: "cp.async and bf16/f16 mma.sync.m16n8k16 for the recomputed scores, as flash_fwd",
    },
    DeviceRequirement {
        kernel: "nsa_selected",
        needs: (8, 0),
        only: false,
        instructions: "cp.async and bf16/f16 mma.sync.m16n8k16 as flash_fwd, and redux.sync for the union walk",
    },
    DeviceRequirement {
        kernel: "nsa_selected_bwd",
        needs: (9, 0),
        only: false,
        instructions: "stmatrix and red.global.add.v2.f32, beside the forward's cp.async and mma.sync",
    },
    DeviceRequirement {
        kernel: "dsa_index",
        needs: (8, 0),
        only: false,
        instructions: "cp.async and bf16/f16 mma.sync.m16n8k16 for the logits as flash_fwd (wgmma on sm_90a)",
    },
    DeviceRequirement {
        kernel: "dsa_index_mma_sync",
        needs: (8, 0),
        only: false,
        instructions: "cp.async and bf16/f16 mma.sync.m16n8k16 for the indexer's logits, as flash_fwd",
    },
    DeviceRequirement {
        kernel: "dsa_sparse",
        needs: (8, 0),
        only: false,
        instructions: "cp.async and bf16/f16 mma.sync.m16n8k16 as flash_fwd, whose products it shares (wgmma on sm_90a)",
    },
    DeviceRequirement {
        kernel: "dsa_sparse_mma_sync",
        needs: (8, 0),
        only: false,
        instructions: "cp.async and bf16/f16 mma.sync.m16n8k16 as flash_fwd, whose products it shares",
    },
    DeviceRequirement {
        kernel: "dsa_sparse_bwd",
        needs: (9, 0),
        only: false,
        instructions: "stmatrix and red.global.add.v2.f32 of flash_bwd.cu, whose tile step it shares",
    },
    DeviceRequirement {
        kernel: "dsa_loss",
        needs: (8, 0),
        only: false,
        instructions: "cp.async and bf16/f16 mma.sync.m16n8k16 for the logits, as dsa_index; f32 atomicAdd for dk^I",
    },
    DeviceRequirement {
        kernel: "ring_state",
        needs: (7, 5),
        only: false,
        instructions: "the oldest target of the pinned CUDA 13 NVRTC; no newer instruction",
    },
];

/// The requirement assumed for a kernel text the table does not name: the tensor-core floor of the crate's kernels.
pub const DEFAULT_REQUIREMENT: DeviceRequirement = DeviceRequirement {
    kernel: "(unlisted kernel)",
    needs: (8, 0),
    only: false,
    instructions: "the crate's tensor-core floor",
};

/// What `kernel` needs of the device ([`DEVICE_REQUIREMENTS`], else [`DEFAULT_REQUIREMENT`]).
pub fn device_requirement(kernel: &str) -> DeviceRequirement {
    DEVICE_REQUIREMENTS.into_iter().find(|r| r.kernel == kernel).unwrap_or(DEFAULT_REQUIREMENT)
}

/// Whether a device of compute capability `have` (major, minor) can run `kernel`: `Ok` or
/// [`GpuError::UnsupportedDevice`] saying what the kernel needs and why. Pure: every launch path asks it (through
/// [`module_from_source`]) before NVRTC is called, and tests ask it without a device.
pub fn check_device_supports(kernel: &'static str, have: (i32, i32)) -> Result<(), GpuError> {
    let requirement = device_requirement(kernel);
    if have < requirement.needs || (requirement.only && have != requirement.needs) {
        return Err(GpuError::UnsupportedDevice {
            kernel,
            needs: requirement.needs,
            instructions: requirement.instructions,
            have,
        });
    }
    Ok(())
}

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
/// One variant's place in the cache: empty until its first compile succeeds.
type Slot = Arc<Mutex<Option<Arc<CudaModule>>>>;

fn cache() -> &'static Mutex<HashMap<CacheKey, Slot>> {
    static CACHE: OnceLock<Mutex<HashMap<CacheKey, Slot>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The slot of `key`, made empty if there is none. The map's lock is held only for the lookup, so that threads
/// compiling different variants do not wait for each other.
fn slot(key: CacheKey) -> Slot {
    // A poisoned lock only means another thread panicked mid-insert; the map itself is still consistent.
    let mut map = cache().lock().unwrap_or_else(|p| p.into_inner());
    map.entry(key).or_default().clone()
}

/// The module of `kernel` compiled with `defines` for the context's device, from the cache or freshly compiled.
pub fn module(ctx: &Arc<CudaContext>, kernel: KernelSource, defines: &[String]) -> Result<Arc<CudaModule>, GpuError> {
    module_from_source(ctx, kernel.name, kernel.source, defines)
}

/// The cache key and NVRTC options of `kernel` with `defines` on the context's device, after the device check.
fn key_and_options(
    ctx: &Arc<CudaContext>,
    kernel: KernelSource,
    defines: &[String],
) -> Result<(CacheKey, Vec<String>), GpuError> {
    let (major, minor) = compute_capability(ctx)?;
    check_device_supports(kernel.name, (major, minor))?;
    let opts = options(&arch_for(major, minor), defines);
    Ok(((ctx.ordinal(), kernel.name, kernel.source, opts.clone()), opts))
}

/// The module of the CUDA C text `source` (NVRTC program `name`) compiled with the pinned options plus `defines`
/// for the context's device, from the cache or freshly compiled.
///
/// The variant's own slot is locked while compiling, so that two threads asking for the same variant compile it
/// once, while threads asking for different variants compile in parallel.
pub fn module_from_source(
    ctx: &Arc<CudaContext>,
    name: &'static str,
    source: &'static str,
    defines: &[String],
) -> Result<Arc<CudaModule>, GpuError> {
    let kernel = KernelSource { name, source };
    let (key, opts) = key_and_options(ctx, kernel, defines)?;
    let slot = slot(key);
    let mut module = slot.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(m) = module.as_ref() {
        return Ok(m.clone());
    }
    let cubin = compile_with_options(kernel, opts)?;
    let loaded = ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| GpuError::driver("cuModuleLoadData", e))?;
    *module = Some(loaded.clone());
    Ok(loaded)
}

/// Lets `func` use `bytes` of dynamic shared memory: when that and the function's static shared memory together pass
/// the default 48 KiB, it asks the device's opt-in limit and sets the function attribute, or answers
/// [`GpuError::Unsupported`] naming `argument` (what made the need grow) when the device allows less. (The static part
/// counts: a kernel with 17 KiB of static arrays fails to launch with 32 KiB of dynamic memory unless the attribute
/// is set, as the pyramid selector did with a GQA group of 16 at d = 256.)
pub(crate) fn allow_shared_memory(
    ctx: &Arc<CudaContext>,
    func: &cudarc::driver::CudaFunction,
    bytes: usize,
    argument: &'static str,
) -> Result<(), GpuError> {
    let fixed =
        func.shared_size_bytes().map_err(|e| GpuError::driver("cuFuncGetAttribute(static shared memory)", e))?.max(0)
            as usize;
    if bytes + fixed <= 48 * 1024 {
        return Ok(());
    }
    let limit = ctx
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(|e| GpuError::driver("cuDeviceGetAttribute(shared memory opt-in)", e))?;
    if (bytes + fixed) as i64 > limit as i64 {
        return Err(GpuError::Unsupported {
            argument,
            reason: format!(
                "needs {bytes} bytes of dynamic shared memory beside {fixed} static, the device allows {limit} in all"
            ),
        });
    }
    func.set_attribute(
        cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map_err(|e| GpuError::driver("cuFuncSetAttribute(max dynamic shared memory)", e))
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
    fn the_forward_runs_from_ampere_on_and_the_backward_from_hopper_on() {
        let supported = |kernel: &'static str, cc: (i32, i32)| check_device_supports(kernel, cc).is_ok();
        for cc in [(8, 0), (8, 6), (8, 9)] {
            assert!(supported("flash_fwd", cc), "{cc:?}");
            assert!(supported("ring_state", cc), "{cc:?}");
            match check_device_supports("flash_bwd", cc) {
                Err(GpuError::UnsupportedDevice { kernel: "flash_bwd", needs: (9, 0), have, instructions }) => {
                    assert_eq!(have, cc);
                    assert!(instructions.contains("stmatrix") && instructions.contains("red.global.add.v2.f32"));
                }
                other => panic!("flash_bwd on {cc:?}: {other:?}"),
            }
        }
        // Hopper, Blackwell and the consumer Blackwell parts run everything: no kernel needs an sm_90a-only
        // instruction, which their plain targets would lack.
        for cc in [(9, 0), (10, 0), (12, 0)] {
            for kernel in ["flash_fwd", "flash_bwd", "ring_state"] {
                assert!(supported(kernel, cc), "{kernel} on {cc:?}");
            }
        }
        // Turing: only the state kernels.
        assert!(!supported("flash_fwd", (7, 5)) && !supported("flash_bwd", (7, 5)) && supported("ring_state", (7, 5)));
        assert!(!supported("ring_state", (7, 0)));
        // The comparison is on (major, minor): a high minor version does not make up for a lower major one.
        assert!(!supported("flash_fwd", (7, 9)) && supported("flash_fwd", (8, 0)));
        let message = check_device_supports("flash_bwd", (8, 6)).unwrap_err().to_string();
        assert!(
            message.contains("`flash_bwd` needs compute capability 9.0") && message.ends_with("the device has 8.6")
        );
    }

    #[test]
    fn unlisted_kernels_get_the_tensor_core_floor() {
        assert_eq!(device_requirement("a_patched_copy"), DEFAULT_REQUIREMENT);
        assert!(check_device_supports("a_patched_copy", (7, 5)).is_err());
        assert!(check_device_supports("a_patched_copy", (8, 0)).is_ok());
        assert_eq!(device_requirement("flash_bwd").needs, (9, 0));
    }

    #[test]
    fn kernel_source_is_embedded() {
        assert!(FLASH_FWD.source.contains("extern \"C\" __global__"));
        assert!(FLASH_FWD.source.contains("flash_fwd("));
    }
}
