//! The FlashAttention forward kernel (`gpu/kernels/flash_fwd.cu`): typed launch wrappers for bf16 and f16, from
//! device buffers ([`flash_forward_device`]) or host `ndarray` tensors ([`flash_forward`]), with every shape, stride,
//! dtype and mask checked before the launch.
//!
//! # What the kernel implements
//!
//! Dense `[B, H, L, D]` and varlen `[T, H, D]` layouts, GQA/MQA (`Hq % Hkv == 0`), `Lq ≠ Lk`, any lengths (tail
//! tiles masked), head dims `d`, `dv` that are multiples of 8 up to 256, and the masks `None`, `Causal`,
//! `Window { left, right }` and `And` of those (bottom-right aligned; an `And` is the intersection, i.e. the smallest
//! left and right reach). A `Predicate` mask is [`GpuError::Unsupported`]. Tiles: [`ForwardTiling::rows`] query rows per
//! CTA ([`ForwardTiling::for_head_dims`] picks the tiling from the head dims), [`KV_TILE`] keys per KV tile; KV tiles
//! outside a CTA's visible key range are skipped, and only tiles that cross the key tail, the diagonal or a window
//! edge evaluate the mask.
//!
//! The tiling is a speed choice only: every query row sees the same sequence of operations (the same KV tiles in the
//! same order, the same roundings) whatever the CTA's shape, since tiles a row cannot see leave its state bitwise
//! unchanged (`p = 0`, rescale `2^0 = 1`). The tests check that all tilings agree bitwise.
//!
//! # The sm_90a kernel
//!
//! `gpu/kernels/flash_fwd_sm90.cu` ([`compile::FLASH_FWD_SM90`], [`is_wgmma`]) is the same forward on Hopper's
//! warpgroup MMA (`wgmma`, compute capability 9.0 only): 128-row CTAs of two warpgroups ([`ForwardTiling::WGMMA`]),
//! [`WGMMA_KV_TILE`]-key tiles, head dims up to [`WGMMA_MAX_HEAD_DIM`]. It shares the online-softmax step and the
//! output rows with `flash_fwd.cu` (`common.cuh`) and runs the recipe below unchanged, with at most half the rescale
//! steps the model charges; only the tensor cores' order of summation inside a product differs, as it does between
//! any two tilings of one instruction. The block-sparse wrappers run it for 128×128 blocks on 9.0
//! (`crate::block_sparse`), and the dense wrapper [`flash_forward_device`] runs its dense mode on 9.0 wherever it
//! loads K and V through tensor maps ([`production_forward`]: head dims multiples of 8 from 64 to 128); the property
//! suites `gpu_flash_wgmma_forward_{bf16,f16}` (the GPU tests' `property` module) verify that mode over the dense
//! features (masks, windows, strided diagonals, GQA, varlen, `Lq ≠ Lk`) beside `flash_fwd`'s suites.
//!
//! # Precision recipe and its rounding-error model
//!
//! The kernel's recipe (spelled out in the `.cu` header) differs from the CPU reference's (`attnproof-reference`'s
//! `flash` module) only in how `exp` is evaluated: `p = 2^(fma(s, L, −fl(m·L)))` with `L = fl32(log2 e)` and the PTX
//! instruction `ex2.approx.ftz.f32`, and the rescale factor `2^(fl(fl(m_old·L) − fl(m_new·L)))` (exactly 1 when the
//! max did not move). It therefore falls under `attnproof_proofs::flash_bound`'s model with three recipe parameters,
//! [`EXP_RELATIVE_ERROR`], [`SHIFT_ROUNDING`] and [`EXP_UNDERFLOW`]:
//!
//! - `exp_error = 5u` (`u = 2^-24`). The PTX ISA (9.x, "Floating Point Instructions: ex2") documents for
//!   `ex2.approx.f32`: "The maximum ulp error is 2 ulp from correctly rounded result across the full range of
//!   inputs". The correctly rounded result is within ½ ulp of `2^x`, so the result is within 2.5 ulp of it, and one
//!   ulp of a normal f32 `y` is at most `2^-23·|y| = 2u|y|`: relative error at most `5u`. The `.ftz` form has the
//!   same accuracy on normal results; it only flushes subnormal inputs and results.
//! - `exp_underflow = 2^-126`. A weight `p` below `2^-126` is flushed to `+0`: at most `2^-126` lost per key, which
//!   the model's underflow term `Lk (τ_T + τ_e) max|v|` charges with `τ_e = 2^-126`. A rescale factor that flushes
//!   is below `2^-126`, so every weight it would have scaled (each at most 1 before it) ends below `2^-126` too: the
//!   same term covers them. In `ℓ ≥ 1` these losses, at most `Lk·2^-126`, are far below the `exp_error` every row
//!   carries. The flush saves the three-instruction range fix-up of the gradual-underflow `ex2` per element. A
//!   rescale factor whose argument is 0 is set to exactly 1 (a select, not the `ex2`), and a warp whose rows all
//!   have factor 1 skips the multiplication of its accumulators by it: both exact, so the tilings still agree bit
//!   for bit.
//! - `shift_rounding = u`. Write `mL_t = fl(m_t·L) = m_t·L + ε_t`, `|ε_t| ≤ u|m_t|L`. A weight computed at tile `t`
//!   and rescaled at every later tile has the exponent `fl((s − m_t)L − ε_t) + Σ_t' fl(mL_t' − mL_t'+1)`; the `ε`
//!   telescope, leaving only `ε_T` of the final row max `m`: `u|m|` in natural-log units. The remaining roundings —
//!   the fma (`u|s − m_t|`), the subtractions (`u|m_t' − m_t'+1|`, which sum to at most `m − s`) and the rounding
//!   of `L` (`u|s − m|`, since it multiplies `s − m_t` exactly) — total at most `2u|s − m|`, the model's
//!   `2u|s_ij − m_i|` term. The `LSE = m + logf(ℓ)` uses the f32 `m` itself, so the same `ε_T` enters `LSE` through
//!   `ℓ`, which `Σ p η` covers.
//!
//! Everything else is the reference's recipe: `s = fl(dot·α̂)`, `α̂ = fl32(1/√d)`, `ℓ` summed in f32 (any order:
//! the `γ(n)` bound holds for every summation order), `P` rounded to the storage type before `PV`, `O = round_T(A/ℓ)`
//! with an IEEE division (`__fdiv_rn`, so one rounding, the model's `u|o|`), `LSE = m + ln ℓ` with CUDA's `logf`
//! (at most 1 ulp, the model's `2u|ln ℓ|`).
//!
//! One difference is not a recipe parameter: the dot products `q·k` and `Σ round_T(p)·v` are accumulated by the
//! tensor cores, whose f32 accumulation is not a sequence of round-to-nearest additions (products are exact; the
//! additions of a fused block align to the largest exponent and truncate). The model's `γ(d)` (scores) and
//! `γ(Lk + n_t)` (the `A` sum) assume round-to-nearest f32 additions; truncation doubles the per-addition unit
//! roundoff. See the crate report: the scores' term would read `γ'(d + ⌈d/16⌉)` with `u' = 2u` for a proof that
//! covers every tensor core; the tests run under the model as it stands, and their verdicts say how close they come.

use std::marker::PhantomData;
use std::sync::Arc;

use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Mask};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig};
use ndarray::{ArrayD, ArrayViewD, Dimension, IxDyn};

use crate::common::{GpuElement, check_len};
use crate::compile::{self, FLASH_FWD, FLASH_FWD_SM90};
use crate::error::GpuError;
use crate::launch::{self, FlashBuffers, ForwardOut, TensorTile};
use crate::params::{BlockListParams, FlashParams};
use crate::ring::state::{ChunkWindow, DeviceState};

/// Query rows per CTA of the smallest tiling (4 warps of one 16-row slice), the one used for head dims above 128.
pub const Q_TILE: usize = 64;
/// Keys per KV tile (the `kv_tile` of the kernel's `FlashRecipe`).
pub const KV_TILE: usize = 64;
/// Keys per KV tile of the sm_90a kernel (`compile::FLASH_FWD_SM90`): twice [`KV_TILE`], so a row takes at most the
/// rescale steps the recipe of [`KV_TILE`] charges.
pub const WGMMA_KV_TILE: usize = 128;
/// The largest head dims (`d` and `dv`) of the sm_90a kernel.
pub const WGMMA_MAX_HEAD_DIM: usize = 128;

/// Whether `kernel` is a text of the sm_90a forward (`gpu/kernels/flash_fwd_sm90.cu`, or a patched copy of it): its
/// launch plan differs from `flash_fwd`'s (threads, padding, shared memory), not its arguments.
pub fn is_wgmma(kernel: compile::KernelSource) -> bool {
    kernel.name == FLASH_FWD_SM90.name
}

/// How the forward kernel tiles query rows: `warps` warps per CTA, each owning `slices` consecutive 16-row slices
/// (so every K/V fragment a warp loads from shared memory feeds `slices` MMAs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ForwardTiling {
    /// Warps per CTA: 4 or 8.
    pub warps: u32,
    /// 16-row slices per warp: 1 or 2.
    pub slices: u32,
}

impl ForwardTiling {
    /// Every tiling the kernel compiles.
    pub const ALL: [ForwardTiling; 4] = [
        ForwardTiling { warps: 4, slices: 1 },
        ForwardTiling { warps: 4, slices: 2 },
        ForwardTiling { warps: 8, slices: 1 },
        ForwardTiling { warps: 8, slices: 2 },
    ];

    /// The tiling of the sm_90a kernel (`gpu/kernels/flash_fwd_sm90.cu`): two warpgroups of 64 rows, 8 warps of one
    /// 16-row slice each; the only tiling that kernel takes.
    pub const WGMMA: ForwardTiling = ForwardTiling { warps: 8, slices: 1 };

    /// Query rows per CTA.
    pub fn rows(self) -> usize {
        16 * self.warps as usize * self.slices as usize
    }

    /// The tiling the launch wrappers use for head dims `d`, `dv`, chosen by the H200 benchmark
    /// (`gpu/src/bin/bench.rs`). Above 128 the accumulators of two slices would not fit in registers.
    pub fn for_head_dims(d: usize, dv: usize) -> Self {
        if d.max(dv) <= 128 { ForwardTiling { warps: 4, slices: 2 } } else { ForwardTiling { warps: 4, slices: 1 } }
    }

    /// The tiling a text of `kernel` runs in unless told otherwise: [`ForwardTiling::WGMMA`] for the sm_90a forward
    /// ([`is_wgmma`]), [`ForwardTiling::for_head_dims`] for `flash_fwd`.
    pub fn of_kernel(kernel: compile::KernelSource, d: usize, dv: usize) -> Self {
        if is_wgmma(kernel) { ForwardTiling::WGMMA } else { ForwardTiling::for_head_dims(d, dv) }
    }

    /// Whether the tiling fits the kernel's register budget for these head dims (two slices of accumulators only up
    /// to `dv = 128`).
    pub fn supports(self, d: usize, dv: usize) -> bool {
        ForwardTiling::ALL.contains(&self) && (self.slices == 1 || d.max(dv) <= 128)
    }

    fn threads(self) -> u32 {
        32 * self.warps
    }
}
/// f32 unit roundoff.
const U32: f64 = f32::EPSILON as f64 / 2.0;
/// Relative error of `ex2.approx.f32` (2 ulp from the correctly rounded result, so 2.5 ulp ≤ `5u`; see module docs).
pub const EXP_RELATIVE_ERROR: f64 = 5.0 * U32;
/// Shift rounding of the exponent argument per unit of `|m|` (`u`; see module docs).
pub const SHIFT_ROUNDING: f64 = U32;
/// What the kernels' flush-to-zero `ex2` may lose to underflow (the forward recipe's `exp_underflow`; the crate-wide
/// constant, defined in [`crate::common`]).
pub use crate::common::EXP_UNDERFLOW;
/// The define of `flash_fwd.cu`'s ring mode, which writes a chunk pair's online-softmax state instead of `O` and LSE.
pub(crate) const STATE_OUT: &str = "STATE_OUT";
/// The define of `flash_fwd.cu`'s block-sparse mode (`crate::block_sparse`), which visits only the listed key blocks.
pub(crate) const BLOCK_SPARSE: &str = "BLOCK_SPARSE";
/// The define of the sm_90a forward's tensor-copy-engine loads of K and V (`gpu/kernels/flash_fwd_sm90.cu`).
pub(crate) const TMA_LOADS: &str = "TMA_LOADS";
/// The K and V stages of the sm_90a forward: three under [`TMA_LOADS`] (the copies may then run a whole iteration
/// ahead of the slower warpgroup), two with `cp.async`.
const WGMMA_STAGES_TMA: usize = 3;
const WGMMA_STAGES_CP_ASYNC: usize = 2;

/// Whether the sm_90a forward loads K and V through the tensor copy engine for head dims `d`, `dv`: each row of a
/// tensor map must be a whole number of 16-byte units, and a 64-column box must not be wider than the matrix.
pub fn wgmma_uses_tma(d: usize, dv: usize) -> bool {
    [d, dv].iter().all(|&n| n.is_multiple_of(8) && (64..=WGMMA_MAX_HEAD_DIM).contains(&n))
}

/// `n` rounded up to a multiple of `m`.
fn round_up(n: usize, m: usize) -> usize {
    n.div_ceil(m) * m
}
/// Everything the launch needs, derived from a validated spec.
struct Plan {
    params: FlashParams,
    grid: (u32, u32, u32),
    threads: u32,
    shared_bytes: u32,
    defines: Vec<String>,
    cu_q: Vec<i32>,
    cu_k: Vec<i32>,
    /// Whether the module loads K and V through tensor maps ([`TMA_LOADS`]).
    tma: bool,
}

/// The defines of the forward module of `kernel` a launch for `spec` in `tiling` compiles (after the checks of a
/// launch).
pub(crate) fn forward_defines<T: GpuElement>(
    spec: &AttentionSpec,
    tiling: ForwardTiling,
    kernel: compile::KernelSource,
) -> Result<Vec<String>, GpuError> {
    Ok(plan::<T>(spec, tiling, kernel)?.defines)
}

/// The module a plain (dense) forward of `kernel` for `spec` in `tiling` compiles with storage type `T` (what a
/// caller compiles ahead of the launch with [`compile::module`]).
pub fn forward_variant<T: GpuElement>(
    spec: &AttentionSpec,
    tiling: ForwardTiling,
    kernel: compile::KernelSource,
) -> Result<compile::ModuleVariant, GpuError> {
    Ok(compile::ModuleVariant { kernel, defines: forward_defines::<T>(spec, tiling, kernel)? })
}

/// Shared-memory bytes the sm_90a kernel adds to its tiles to align them to 1024 bytes itself.
const WGMMA_SMEM_ALIGN: usize = 1024;

/// Checks that `kernel` (`flash_fwd` or the sm_90a forward, [`is_wgmma`]) supports `spec` in `tiling` and derives
/// the launch plan.
fn plan<T: GpuElement>(
    spec: &AttentionSpec,
    tiling: ForwardTiling,
    kernel: compile::KernelSource,
) -> Result<Plan, GpuError> {
    let (params, cu_q, cu_k) = FlashParams::for_spec(spec)?;
    let (d, dv, hq) = (spec.head_dim, spec.head_dim_v, spec.n_heads_q);
    let (shared, defines) = if is_wgmma(kernel) {
        if tiling != ForwardTiling::WGMMA {
            return Err(GpuError::Unsupported {
                argument: "tiling",
                reason: format!("the sm_90a forward runs only {:?}, not {tiling:?}", ForwardTiling::WGMMA),
            });
        }
        if d.max(dv) > WGMMA_MAX_HEAD_DIM {
            return Err(GpuError::Unsupported {
                argument: "head_dim",
                reason: format!("the sm_90a forward takes d, dv up to {WGMMA_MAX_HEAD_DIM}, not {d}, {dv}"),
            });
        }
        // Padded to the 64 columns of a 128-byte swizzle chunk; padding columns are zero-filled.
        let (d_pad, dv_pad) = (round_up(d, 64), round_up(dv, 64));
        let tma = wgmma_uses_tma(d, dv);
        let stages = if tma { WGMMA_STAGES_TMA } else { WGMMA_STAGES_CP_ASYNC };
        // Q and the K and V stages, of 2-byte elements.
        let tiles = 2 * (tiling.rows() * d_pad + stages * WGMMA_KV_TILE * (d_pad + dv_pad));
        let mut defines =
            vec![T::DEFINE.to_owned(), format!("HEAD_DIM_PAD={d_pad}"), format!("HEAD_DIM_V_PAD={dv_pad}")];
        if tma {
            defines.push(TMA_LOADS.to_owned());
        }
        defines.extend(params.diagonal_define());
        (tiles + WGMMA_SMEM_ALIGN, defines)
    } else {
        if !tiling.supports(d, dv) {
            return Err(GpuError::Unsupported {
                argument: "tiling",
                reason: format!("{tiling:?} is not one of {:?} or does not fit d = {d}, dv = {dv}", ForwardTiling::ALL),
            });
        }
        // Both padded to the 16 of an mma k step / an ldmatrix.x4 pair of n tiles; padding columns are zero-filled.
        let d_pad = round_up(d, 16);
        let dv_pad = round_up(dv, 16);
        // Row strides of the shared-memory tiles carry 8 elements of padding (see the kernel).
        let shared = 2 * (tiling.rows() + KV_TILE) * (d_pad + 8) + 2 * KV_TILE * (dv_pad + 8);
        let mut defines = vec![
            T::DEFINE.to_owned(),
            format!("HEAD_DIM_PAD={d_pad}"),
            format!("HEAD_DIM_V_PAD={dv_pad}"),
            format!("NUM_WARPS={}", tiling.warps),
            format!("WARP_M={}", tiling.slices),
        ];
        defines.extend(params.diagonal_define());
        (shared, defines)
    };
    let q_tile = tiling.rows();
    let seqs = spec.sequences();
    let max_len_q = seqs.iter().map(|s| s.len_q).max().unwrap_or(0);
    let grid_x = u32::try_from(max_len_q.div_ceil(q_tile))
        .map_err(|_| GpuError::TooLarge { argument: "query tiles", value: max_len_q.div_ceil(q_tile) })?;
    let grid_y = u32::try_from(hq)
        .ok()
        .filter(|&y| y <= 65535)
        .ok_or(GpuError::TooLarge { argument: "n_heads_q", value: hq })?;
    let grid_z = u32::try_from(seqs.len())
        .ok()
        .filter(|&z| z <= 65535)
        .ok_or(GpuError::TooLarge { argument: "sequences", value: seqs.len() })?;
    Ok(Plan {
        params,
        grid: (grid_x, grid_y, grid_z),
        threads: tiling.threads(),
        shared_bytes: shared as u32,
        tma: defines.iter().any(|d| d == TMA_LOADS),
        defines,
        cu_q,
        cu_k,
    })
}

/// The compiled `flash_fwd` of `plan` and its launch configuration; `None` when the spec has no query rows (there is
/// no output to write).
fn load_forward(
    stream: &Arc<CudaStream>,
    kernel: compile::KernelSource,
    plan: &Plan,
) -> Result<Option<(CudaFunction, LaunchConfig)>, GpuError> {
    if plan.grid.0 == 0 || plan.grid.2 == 0 {
        return Ok(None);
    }
    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &plan.defines)?;
    let func = module.load_function("flash_fwd").map_err(|e| GpuError::driver("cuModuleGetFunction(flash_fwd)", e))?;
    compile::allow_shared_memory(ctx, &func, plan.shared_bytes as usize, "head_dim")?;
    let cfg =
        LaunchConfig { grid_dim: plan.grid, block_dim: (plan.threads, 1, 1), shared_mem_bytes: plan.shared_bytes };
    Ok(Some((func, cfg)))
}

/// One (query chunk, key chunk) pair's partial online-softmax state for the ring forward: `flash_fwd.cu` in its
/// `STATE_OUT` mode writes each query row's `m`, `ℓ`, `A` (f32, [`DeviceState`]'s layout) instead of `O` and LSE.
/// `spec` describes the pair as its own problem (the chunks' lengths, [`Mask::None`]); `window` is the global mask
/// seen from the pair's diagonal ([`ChunkWindow::for_pair`]). A row that sees no key of the chunk gets the empty
/// state. The launch is asynchronous on `stream`; the arithmetic is the forward's, tile for tile.
#[allow(clippy::too_many_arguments)]
pub fn flash_forward_state_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    window: ChunkWindow,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    state: &mut DeviceState,
) -> Result<(), GpuError> {
    if !matches!(spec.mask, Mask::None) {
        return Err(GpuError::Unsupported {
            argument: "mask",
            reason: "a chunk pair's visibility is its `ChunkWindow`; the pair's spec must have Mask::None".into(),
        });
    }
    let tiling = ForwardTiling::for_head_dims(spec.head_dim, spec.head_dim_v);
    let mut plan = plan::<T>(spec, tiling, FLASH_FWD)?;
    plan.defines.push(STATE_OUT.to_owned());
    (plan.params.win_left, plan.params.win_right) = window.kernel_values();
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_len("q", q, size(Operand::Q))?;
    check_len("k", k, size(Operand::K))?;
    check_len("v", v, size(Operand::V))?;
    state.check_fits(size(Operand::RowStat), spec.head_dim_v)?;
    let cu_q = stream.clone_htod(&plan.cu_q).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens_q)", e))?;
    let cu_k = stream.clone_htod(&plan.cu_k).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens_k)", e))?;
    let Some((func, cfg)) = load_forward(stream, FLASH_FWD, &plan)? else {
        return Ok(());
    };
    let DeviceState { a, m, l, .. } = state;
    let out = ForwardOut::State { a, m, l };
    launch::launch_flash_forward(
        stream,
        &func,
        cfg,
        FlashBuffers { q, k, v, out, cu_q: &cu_q, cu_k: &cu_k, lists: None, kv_maps: None },
        &plan.params,
    )
}

/// The forward kernel and tiling the dense wrappers run for `spec` on a device of compute capability `device`: the
/// sm_90a kernel ([`compile::FLASH_FWD_SM90`] in [`ForwardTiling::WGMMA`]) on 9.0 wherever it loads K and V through
/// tensor maps ([`wgmma_uses_tma`]: the path the benchmark measured, `gpu/src/bin/bench.rs`), `flash_fwd` in
/// [`ForwardTiling::for_head_dims`] otherwise. Both run the same recipe, so the choice moves only the tensor cores'
/// order of summation, never the bound.
pub fn production_forward(spec: &AttentionSpec, device: (i32, i32)) -> (compile::KernelSource, ForwardTiling) {
    let (d, dv) = (spec.head_dim, spec.head_dim_v);
    let kernel = if device == (9, 0) && wgmma_uses_tma(d, dv) { FLASH_FWD_SM90 } else { FLASH_FWD };
    (kernel, ForwardTiling::of_kernel(kernel, d, dv))
}

/// Runs the forward on device buffers: `q`, `k`, `v` hold the spec's `Q`, `K`, `V` in row-major order (dense
/// `[B, H, L, D]`, varlen `[T, H, D]`); the kernel writes `O` into the first elements of `o` and the natural-log LSE
/// (dense `[B, Hq, Lq]`, varlen `[Hq, Tq]`) into the first elements of `lse`. Buffers may be longer than their
/// tensors; the kernel touches nothing past them (the tests' guard bands check this). The launch is asynchronous on
/// `stream`. The kernel and tiling are [`production_forward`]'s for the stream's device.
pub fn flash_forward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    o: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    let (kernel, tiling) = production_forward(spec, compile::compute_capability(stream.context())?);
    flash_forward_device_with(stream, spec, kernel, tiling, q, k, v, o, lse)
}

/// [`flash_forward_device`] with an explicit kernel source and tiling: the benchmark compares tilings, and the
/// tests compile patched copies of `flash_fwd.cu` (mutants) through the same validation and launch path. `kernel`
/// must define `flash_fwd` with the parameters of `gpu/kernels/flash_fwd.cu`.
#[allow(clippy::too_many_arguments)]
pub fn flash_forward_device_with<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    kernel: compile::KernelSource,
    tiling: ForwardTiling,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    o: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    PreparedForward::<T>::new(stream, spec, kernel, tiling)?.launch(stream, q, k, v, o, lse)
}

/// A forward whose validation, compilation and `cu_seqlens` upload are done once, launched any number of times on
/// buffers of the spec's sizes (what a benchmark times, and what a training loop would hold).
pub struct PreparedForward<T> {
    /// The compiled function and its launch configuration; `None` when the spec has no query rows.
    launch: Option<(CudaFunction, LaunchConfig)>,
    params: FlashParams,
    cu_q: CudaSlice<i32>,
    cu_k: CudaSlice<i32>,
    /// Elements of Q, K, V, O, LSE.
    sizes: [usize; 5],
    /// The block lists on the device and their scalars (block-sparse mode, `crate::block_sparse`), or `None`.
    lists: Option<(CudaSlice<i32>, BlockListParams)>,
    /// Where the tensor maps of a module with [`TMA_LOADS`] point, or `None`.
    kv_maps: Option<KvMapLayout>,
    _element: PhantomData<T>,
}

/// The K and V matrices the sm_90a forward's tensor maps describe: one per (sequence, KV head), whose rows are the
/// sequence's keys (so that a tile reaching past them reads zeros, never the next sequence's keys). The maps hold
/// the buffers' addresses, so they are encoded at each launch from this layout.
struct KvMapLayout {
    /// Per (sequence, KV head), sequence-major: the element offsets of the first row of K and of V, and the keys.
    matrices: Vec<(u64, u64, u64)>,
    /// Columns of K and of V.
    d: u64,
    dv: u64,
    /// Row strides of K and V in bytes.
    k_row_bytes: u64,
    v_row_bytes: u64,
}

impl KvMapLayout {
    fn new<T>(spec: &AttentionSpec, params: &FlashParams, cu_k: &[i32]) -> Self {
        let as_u64 = |n: i64| n as u64;
        let mut matrices = Vec::new();
        for (seq, s) in spec.sequences().iter().enumerate() {
            // Varlen rows are packed (batch stride 0): the sequence starts at its offset; dense ones at the batch.
            let (k_seq, v_seq) = if params.varlen != 0 {
                (i64::from(cu_k[seq]) * params.k_row, i64::from(cu_k[seq]) * params.v_row)
            } else {
                (seq as i64 * params.k_batch, seq as i64 * params.v_batch)
            };
            for h in 0..spec.n_heads_kv as i64 {
                matrices.push((as_u64(k_seq + h * params.k_head), as_u64(v_seq + h * params.v_head), s.len_k as u64));
            }
        }
        let bytes = std::mem::size_of::<T>() as u64;
        KvMapLayout {
            matrices,
            d: spec.head_dim as u64,
            dv: spec.head_dim_v as u64,
            k_row_bytes: as_u64(params.k_row) * bytes,
            v_row_bytes: as_u64(params.v_row) * bytes,
        }
    }

    /// The maps (K, then V, per matrix) for K and V buffers at device addresses `k` and `v` of `T`.
    fn encode<T>(&self, k: u64, v: u64) -> Result<Vec<u64>, GpuError> {
        let bytes = std::mem::size_of::<T>() as u64;
        let box_rows = WGMMA_KV_TILE as u32;
        let mut words = Vec::with_capacity(32 * self.matrices.len());
        for &(k_off, v_off, rows) in &self.matrices {
            let k_tile = TensorTile {
                base: k + k_off * bytes,
                cols: self.d,
                rows,
                row_stride_bytes: self.k_row_bytes,
                box_cols: 64,
                box_rows,
            };
            let v_tile =
                TensorTile { base: v + v_off * bytes, cols: self.dv, row_stride_bytes: self.v_row_bytes, ..k_tile };
            words.extend(launch::encode_tensor_map(k_tile)?);
            words.extend(launch::encode_tensor_map(v_tile)?);
        }
        Ok(words)
    }
}

impl<T: GpuElement> PreparedForward<T> {
    /// Validates `spec` for `kernel` (normally [`compile::FLASH_FWD`]) and `tiling`, compiles (or fetches) the
    /// module and uploads the sequence offsets on `stream`.
    pub fn new(
        stream: &Arc<CudaStream>,
        spec: &AttentionSpec,
        kernel: compile::KernelSource,
        tiling: ForwardTiling,
    ) -> Result<Self, GpuError> {
        Self::prepare(stream, spec, kernel, tiling, None)
    }

    /// [`PreparedForward::new`], in the block-sparse mode when `lists` holds the validated entries (row-major) and
    /// their scalars: the module is compiled with [`BLOCK_SPARSE`] and the entries are uploaded once.
    pub(crate) fn prepare(
        stream: &Arc<CudaStream>,
        spec: &AttentionSpec,
        kernel: compile::KernelSource,
        tiling: ForwardTiling,
        lists: Option<(&[i32], BlockListParams)>,
    ) -> Result<Self, GpuError> {
        let mut plan = plan::<T>(spec, tiling, kernel)?;
        let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
        let sizes = [Operand::Q, Operand::K, Operand::V, Operand::O, Operand::RowStat].map(size);
        let cu_q = stream.clone_htod(&plan.cu_q).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens_q)", e))?;
        let cu_k = stream.clone_htod(&plan.cu_k).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens_k)", e))?;
        let lists = match lists {
            None => None,
            Some((entries, params)) => {
                plan.defines.push(BLOCK_SPARSE.to_owned());
                // cudarc cannot allocate 0 elements; lists of width 0 are never read.
                let device = if entries.is_empty() { stream.alloc_zeros::<i32>(1) } else { stream.clone_htod(entries) }
                    .map_err(|e| GpuError::driver("cuMemcpyHtoD(block lists)", e))?;
                Some((device, params))
            }
        };
        let launch = load_forward(stream, kernel, &plan)?;
        let kv_maps = plan.tma.then(|| KvMapLayout::new::<T>(spec, &plan.params, &plan.cu_k));
        Ok(PreparedForward { launch, params: plan.params, cu_q, cu_k, sizes, lists, kv_maps, _element: PhantomData })
    }

    /// Checks the buffers' lengths and launches asynchronously on `stream` (see [`flash_forward_device`] for the
    /// layouts).
    pub fn launch(
        &self,
        stream: &Arc<CudaStream>,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        o: &mut CudaSlice<T>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let [nq, nk, nv, no, nl] = self.sizes;
        check_len("q", q, nq)?;
        check_len("k", k, nk)?;
        check_len("v", v, nv)?;
        check_len("o", o, no)?;
        check_len("lse", lse, nl)?;
        let Some((func, cfg)) = &self.launch else {
            return Ok(());
        };
        let kv_maps = match &self.kv_maps {
            None => None,
            Some(layout) => {
                let words = layout.encode::<T>(k.device_ptr(stream).0, v.device_ptr(stream).0)?;
                Some(stream.clone_htod(&words).map_err(|e| GpuError::driver("cuMemcpyHtoD(tensor maps)", e))?)
            }
        };
        launch::launch_flash_forward(
            stream,
            func,
            *cfg,
            FlashBuffers {
                q,
                k,
                v,
                out: ForwardOut::Final { o, lse },
                cu_q: &self.cu_q,
                cu_k: &self.cu_k,
                lists: self.lists.as_ref().map(|(entries, params)| (entries, params)),
                kv_maps: kv_maps.as_ref(),
            },
            &self.params,
        )
    }
}

/// `O` (storage type) and `LSE` (f32, natural log) of a forward.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardOutput<T> {
    /// `O`, shaped like Q with `dv`.
    pub o: ArrayD<T>,
    /// LSE, dense `[B, Hq, Lq]`, varlen `[Hq, Tq]`.
    pub lse: ArrayD<f32>,
}

/// Checks a host tensor's shape, layout and values and returns it as a row-major slice.
pub(crate) fn host_input<'a, T: GpuElement>(
    spec: &AttentionSpec,
    argument: &'static str,
    operand: Operand,
    t: &'a ArrayViewD<'_, T>,
) -> Result<&'a [T], GpuError> {
    let expected = spec.expected_shape(operand);
    if t.shape() != expected.as_slice() {
        return Err(GpuError::Shape { argument, expected, actual: t.shape().to_vec() });
    }
    let data = t.as_slice().ok_or_else(|| GpuError::Stride { argument, strides: t.strides().to_vec() })?;
    if let Some(i) = data.iter().position(|x| !x.is_finite_value()) {
        let index =
            ndarray::indices(expected.as_slice()).into_iter().nth(i).map(|ix| ix.slice().to_vec()).unwrap_or_default();
        return Err(attnproof_oracle::OracleError::NonFinite { argument, index, value: f64::NAN }.into());
    }
    Ok(data)
}

/// Runs the forward from host tensors and returns host outputs (copies in, launch, copies out, synchronizes).
pub fn flash_forward<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    q: ArrayViewD<'_, T>,
    k: ArrayViewD<'_, T>,
    v: ArrayViewD<'_, T>,
) -> Result<ForwardOutput<T>, GpuError> {
    forward_from_host(stream, spec, [q, k, v], |[dq, dk, dv], o, lse| {
        flash_forward_device(stream, spec, dq, dk, dv, o, lse)
    })
}

/// The device buffers of Q, K, V.
pub(crate) type DeviceQkv<'a, T> = [&'a CudaSlice<T>; 3];

/// A forward from host tensors: checks and uploads `qkv` (Q, K, V), lets `run` launch on the device buffers into
/// zeroed `O` and LSE buffers, and downloads the outputs (synchronizing `stream`).
pub(crate) fn forward_from_host<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    [q, k, v]: [ArrayViewD<'_, T>; 3],
    run: impl FnOnce(DeviceQkv<'_, T>, &mut CudaSlice<T>, &mut CudaSlice<f32>) -> Result<(), GpuError>,
) -> Result<ForwardOutput<T>, GpuError> {
    spec.validate()?;
    let (hq, hk, hv) = (
        host_input(spec, "q", Operand::Q, &q)?,
        host_input(spec, "k", Operand::K, &k)?,
        host_input(spec, "v", Operand::V, &v)?,
    );
    let up = |data: &[T]| stream.clone_htod(data).map_err(|e| GpuError::driver("cuMemcpyHtoD", e));
    let (dq, dk, dv) = (up(hq)?, up(hk)?, up(hv)?);
    let o_shape = spec.expected_shape(Operand::O);
    let lse_shape = spec.expected_shape(Operand::RowStat);
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let mut o = stream.alloc_zeros::<T>(o_shape.iter().product::<usize>().max(1)).map_err(alloc_err)?;
    let mut lse = stream.alloc_zeros::<f32>(lse_shape.iter().product::<usize>().max(1)).map_err(alloc_err)?;
    run([&dq, &dk, &dv], &mut o, &mut lse)?;
    let down_err = |e| GpuError::driver("cuMemcpyDtoH", e);
    let mut o_host = stream.clone_dtoh(&o).map_err(down_err)?;
    let mut lse_host = stream.clone_dtoh(&lse).map_err(down_err)?;
    stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
    o_host.truncate(o_shape.iter().product());
    lse_host.truncate(lse_shape.iter().product());
    let o = ArrayD::from_shape_vec(IxDyn(&o_shape), o_host).expect("length matches the shape");
    let lse = ArrayD::from_shape_vec(IxDyn(&lse_shape), lse_host).expect("length matches the shape");
    Ok(ForwardOutput { o, lse })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::Layout;
    use half::{bf16, f16};

    const T64: ForwardTiling = ForwardTiling { warps: 4, slices: 1 };

    #[test]
    fn the_tensor_copies_take_head_dims_of_whole_16_byte_rows_from_64_to_128() {
        for (d, dv, tma) in [(64, 64, true), (128, 128, true), (72, 120, true), (128, 64, true), (56, 128, false)] {
            assert_eq!(wgmma_uses_tma(d, dv), tma, "{d}, {dv}");
        }
        for (d, dv) in [(68, 64), (64, 100), (136, 64), (8, 8)] {
            assert!(!wgmma_uses_tma(d, dv), "{d}, {dv}");
        }
        let defines =
            |d, dv| plan::<bf16>(&AttentionSpec::dense(1, 1, 1, 4, 4, d, dv), ForwardTiling::WGMMA, FLASH_FWD_SM90);
        let tma = defines(128, 96).unwrap();
        let cp_async = defines(40, 40).unwrap();
        assert!(tma.tma && tma.defines.contains(&TMA_LOADS.to_owned()));
        assert!(!cp_async.tma && !cp_async.defines.contains(&TMA_LOADS.to_owned()));
        // Three stages of 128 keys of K and V (2-byte elements), Q, and the alignment slack.
        assert_eq!(tma.shared_bytes as usize, 2 * (128 * 128 + 3 * 128 * (128 + 128)) + WGMMA_SMEM_ALIGN);
        assert_eq!(cp_async.shared_bytes as usize, 2 * (128 * 64 + 2 * 128 * (64 + 64)) + WGMMA_SMEM_ALIGN);
        assert!(!plan::<bf16>(&AttentionSpec::dense(1, 1, 1, 4, 4, 128, 64), T64, FLASH_FWD).unwrap().tma);
    }

    #[test]
    fn each_tensor_map_covers_one_sequence_and_kv_head() {
        // Dense [B, H, L, D]: a (sequence, head) matrix starts at (b·H + h)·L·D, and its rows are the L keys.
        let spec = AttentionSpec::dense(2, 6, 3, 5, 7, 64, 72);
        let (params, _, cu_k) = FlashParams::for_spec(&spec).unwrap();
        let layout = KvMapLayout::new::<bf16>(&spec, &params, &cu_k);
        let expected: Vec<(u64, u64, u64)> =
            (0..2u64).flat_map(|b| (0..3u64).map(move |h| ((b * 3 + h) * 7 * 64, (b * 3 + h) * 7 * 72, 7))).collect();
        assert_eq!(layout.matrices, expected);
        assert_eq!((layout.d, layout.dv, layout.k_row_bytes, layout.v_row_bytes), (64, 72, 128, 144));
        // Varlen [T, H, D]: a sequence's matrix starts at its first packed row, offset by the head, and has only its
        // own keys (an empty sequence too), so a tile past its end reads zeros instead of the next sequence.
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 5, 5, 70], cu_seqlens_k: vec![0, 0, 9, 20] },
            ..AttentionSpec::dense(1, 4, 2, 1, 1, 64, 64)
        };
        let (params, _, cu_k) = FlashParams::for_spec(&spec).unwrap();
        let layout = KvMapLayout::new::<f16>(&spec, &params, &cu_k);
        let row = 2 * 64;
        let expected: Vec<(u64, u64, u64)> = [(0, 0), (0, 9), (9, 11)]
            .iter()
            .flat_map(|&(start, len)| (0..2u64).map(move |h| (start * row + h * 64, start * row + h * 64, len)))
            .collect();
        assert_eq!(layout.matrices, expected);
        assert_eq!(layout.k_row_bytes, 2 * row);
    }

    #[test]
    fn a_misaligned_tensor_map_is_a_typed_error_before_the_driver() {
        let tile = TensorTile { base: 256, cols: 64, rows: 10, row_stride_bytes: 128, box_cols: 64, box_rows: 128 };
        for bad in [TensorTile { base: 264, ..tile }, TensorTile { row_stride_bytes: 136, ..tile }] {
            assert!(matches!(launch::encode_tensor_map(bad), Err(GpuError::Unsupported { .. })), "{bad:?}");
        }
    }

    #[test]
    fn tilings_rows_and_support() {
        assert_eq!(ForwardTiling::ALL.map(ForwardTiling::rows), [64, 128, 128, 256]);
        assert!(ForwardTiling::ALL.iter().all(|t| t.supports(128, 128)));
        assert!(!ForwardTiling { warps: 4, slices: 2 }.supports(256, 64));
        assert!(!ForwardTiling { warps: 2, slices: 1 }.supports(64, 64));
        for (d, dv) in [(8, 8), (64, 64), (128, 128), (256, 8), (200, 72)] {
            assert!(ForwardTiling::for_head_dims(d, dv).supports(d, dv));
        }
        let spec = AttentionSpec::dense(1, 1, 1, 300, 4, 64, 64);
        let p = plan::<bf16>(&spec, ForwardTiling { warps: 8, slices: 2 }, FLASH_FWD).unwrap();
        assert_eq!((p.grid.0, p.threads), (2, 256));
        assert!(p.defines.contains(&"NUM_WARPS=8".to_owned()) && p.defines.contains(&"WARP_M=2".to_owned()));
        let err = plan::<bf16>(
            &AttentionSpec::dense(1, 1, 1, 4, 4, 256, 256),
            ForwardTiling { warps: 8, slices: 2 },
            FLASH_FWD,
        );
        assert!(matches!(err, Err(GpuError::Unsupported { argument: "tiling", .. })));
    }

    /// The sm_90a kernel's plan: its one tiling, head dims up to 128 padded to 64, two warpgroups per 128 rows, and
    /// shared memory for Q, two K and two V stages plus the alignment slack.
    #[test]
    fn the_wgmma_plan_takes_its_tiling_and_head_dims_only() {
        let spec = AttentionSpec::dense(1, 2, 1, 300, 200, 72, 40).with_mask(Mask::Causal);
        let p = plan::<bf16>(&spec, ForwardTiling::WGMMA, FLASH_FWD_SM90).unwrap();
        assert_eq!((p.grid, p.threads), ((3, 2, 1), 256));
        assert_eq!(p.defines, ["ELEM_BF16", "HEAD_DIM_PAD=128", "HEAD_DIM_V_PAD=64"]);
        assert_eq!(p.shared_bytes as usize, 2 * (128 * 128 + 2 * 128 * (128 + 64)) + 1024);
        for tiling in ForwardTiling::ALL.into_iter().filter(|&t| t != ForwardTiling::WGMMA) {
            let err = plan::<bf16>(&spec, tiling, FLASH_FWD_SM90);
            assert!(matches!(err, Err(GpuError::Unsupported { argument: "tiling", .. })), "{tiling:?}");
        }
        for (d, dv) in [(136, 64), (64, 136), (256, 256)] {
            let err = plan::<bf16>(&AttentionSpec::dense(1, 1, 1, 4, 4, d, dv), ForwardTiling::WGMMA, FLASH_FWD_SM90);
            assert!(matches!(err, Err(GpuError::Unsupported { argument: "head_dim", .. })), "d = {d}, dv = {dv}");
        }
        assert!(
            plan::<f16>(&AttentionSpec::dense(1, 1, 1, 4, 4, 128, 8), ForwardTiling::WGMMA, FLASH_FWD_SM90).is_ok()
        );
        assert!(is_wgmma(FLASH_FWD_SM90) && !is_wgmma(FLASH_FWD));
    }

    /// The dense wrapper's choice: the sm_90a kernel on 9.0 exactly where it loads K and V through tensor maps (both
    /// head dims multiples of 8 in 64 ..= 128), whatever the mask; `flash_fwd` in its production tiling elsewhere, and
    /// on every other device. Every choice is a plan the kernel accepts.
    #[test]
    fn the_production_forward_is_the_wgmma_kernel_on_hopper_from_64_columns() {
        let masks = [Mask::None, Mask::Causal, Mask::Window { left: 5, right: 0 }];
        for d in (8..=256).step_by(8) {
            for dv in [8, 56, 64, 72, 128, 136, 256] {
                for mask in &masks {
                    let spec = AttentionSpec::dense(1, 2, 1, 70, 90, d, dv).with_mask(mask.clone());
                    let wide = (64..=128).contains(&d) && (64..=128).contains(&dv);
                    for device in [(9, 0), (8, 0), (10, 0), (12, 0)] {
                        let (kernel, tiling) = production_forward(&spec, device);
                        if device == (9, 0) && wide {
                            assert_eq!((kernel, tiling), (FLASH_FWD_SM90, ForwardTiling::WGMMA), "{d}, {dv}");
                        } else {
                            assert_eq!((kernel, tiling), (FLASH_FWD, ForwardTiling::for_head_dims(d, dv)), "{d}, {dv}");
                        }
                        assert!(plan::<bf16>(&spec, tiling, kernel).is_ok(), "{d}, {dv}, {device:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn positions_must_fit_the_kernels_32_bit_arithmetic() {
        let half = 1usize << 29;
        assert!(plan::<bf16>(&AttentionSpec::dense(1, 1, 1, half, half, 8, 8), T64, FLASH_FWD).is_ok());
        let err = plan::<bf16>(&AttentionSpec::dense(1, 1, 1, half, half + 1, 8, 8), T64, FLASH_FWD);
        assert!(matches!(err, Err(GpuError::TooLarge { argument: "len_q + len_k of one sequence", .. })));
    }

    #[test]
    fn head_dims_must_be_multiples_of_8_up_to_256() {
        for (d, dv, bad) in [(59, 64, "head_dim"), (64, 12, "head_dim_v"), (264, 64, "head_dim")] {
            let spec = AttentionSpec::dense(1, 1, 1, 4, 4, d, dv);
            match plan::<bf16>(&spec, T64, FLASH_FWD) {
                Err(GpuError::Unsupported { argument, .. }) => assert_eq!(argument, bad),
                Err(e) => panic!("unexpected error {e}"),
                Ok(_) => panic!("d={d} dv={dv} accepted"),
            }
        }
        assert!(plan::<f16>(&AttentionSpec::dense(1, 1, 1, 4, 4, 8, 256), T64, FLASH_FWD).is_ok());
    }

    #[test]
    fn bad_specs_are_oracle_errors() {
        let spec = AttentionSpec::dense(1, 3, 2, 4, 4, 8, 8);
        assert!(matches!(plan::<bf16>(&spec, T64, FLASH_FWD), Err(GpuError::Spec(_))));
    }

    #[test]
    fn only_the_strided_causal_mask_compiles_the_strided_diagonal() {
        // The kernels read diag_stride and diag_offset only under STRIDED_DIAGONAL: a strided spec planned without it
        // would run the bottom-right diagonal, and a plain one planned with it would pay a division per row.
        let strided = crate::params::STRIDED_DIAGONAL.to_owned();
        let spec = AttentionSpec::dense(1, 4, 2, 200, 11, 64, 64);
        for (mask, expected) in [
            (attnproof_oracle::Mask::StridedCausal { len: 32, stride: 16 }, true),
            (attnproof_oracle::Mask::Causal, false),
            (attnproof_oracle::Mask::None, false),
        ] {
            let spec = spec.clone().with_mask(mask);
            for tiling in [ForwardTiling::for_head_dims(64, 64), ForwardTiling::WGMMA] {
                let kernel = if tiling == ForwardTiling::WGMMA { FLASH_FWD_SM90 } else { FLASH_FWD };
                let defines = forward_defines::<bf16>(&spec, tiling, kernel).unwrap();
                assert_eq!(defines.contains(&strided), expected, "{:?} {kernel:?}", spec.mask);
            }
            for kernel in [compile::FLASH_BWD, compile::FLASH_BWD_SM90] {
                let defines =
                    crate::backward::backward_defines::<bf16>(&spec, crate::backward::BackwardTiling::DEFAULT, kernel)
                        .unwrap();
                assert_eq!(defines.contains(&strided), expected, "{:?} {kernel:?}", spec.mask);
            }
        }
    }

    #[test]
    fn plan_params_and_grid() {
        // The strides of each layout are checked in `params`; the plan must carry the spec's parameters unchanged.
        let spec = AttentionSpec::dense(2, 4, 2, 130, 70, 64, 32).with_mask(Mask::Causal);
        let p = plan::<bf16>(&spec, T64, FLASH_FWD).unwrap();
        assert_eq!(p.grid, (3, 4, 2));
        assert_eq!(p.params, FlashParams::for_spec(&spec).unwrap().0);
        assert_eq!(p.params.q_strides(), [4 * 130 * 64, 130 * 64, 64]);
        let varlen = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 5, 5, 70], cu_seqlens_k: vec![0, 0, 9, 20] },
            ..AttentionSpec::dense(1, 2, 1, 1, 1, 16, 8)
        };
        let p = plan::<f16>(&varlen, T64, FLASH_FWD).unwrap();
        assert_eq!(p.grid, (2, 2, 3));
        assert_eq!(p.params, FlashParams::for_spec(&varlen).unwrap().0);
        assert_eq!(p.cu_k, vec![0, 0, 9, 20]);
    }
}
