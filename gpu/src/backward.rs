//! The FlashAttention backward kernels (`gpu/kernels/flash_bwd.cu`): typed launch wrappers for bf16 and f16, from
//! device buffers ([`flash_backward_device`]) or host `ndarray` tensors ([`flash_backward`]), with the three dQ
//! ownership strategies of [`GpuBackwardStrategy`].
//!
//! # What runs
//!
//! 1. `bwd_preprocess`: `D = rowsum(dO ∘ O)` in f32 (E7), laid out like LSE.
//! 2. `bwd_kv`: one CTA of 8 warps per (KV tile of [`KV_TILE`] keys, query head × column chunk, sequence) owns dK
//!    and dV. It loops over the query tiles of [`Q_TILE`] rows that can see the tile (the others are skipped, not
//!    masked), recomputing `P` from the forward's LSE, with the next query tile's Q and dO loading (cp.async) while
//!    the current one computes. Under GQA each query head's f32 dK, dV sums go to a workspace, and
//!    `bwd_kv_group_sum` adds them in ascending head order (no atomics, bitwise reproducible).
//! 3. dQ, by strategy: [`GpuBackwardStrategy::TwoTraversals`] (E10a strategy A) launches `bwd_dq`, one CTA per query
//!    tile owning dQ, which recomputes `P` and `dS` a second time; [`GpuBackwardStrategy::KvOwnerAtomic`] lets
//!    `bwd_kv` `atomicAdd` each KV tile's dQ into an f32 accumulator, converted by `bwd_dq_finalize`;
//!    [`GpuBackwardStrategy::KvOwnerDeterministic`] lets `bwd_kv` write each KV tile's dQ as a partial (an f32
//!    workspace of `⌈max Lk / KV_TILE⌉` copies of Q's size; block-sparse, one per listed KV tile), summed by
//!    `bwd_dq_finalize` in ascending KV tile order.
//!    Strategy A and the deterministic mode are bitwise reproducible; the atomic mode's dQ depends on the order the
//!    atomics land in, and is within the same bound every time. dK, dV and D come from the same arithmetic in all
//!    three, so they agree bitwise across strategies.
//!
//! [`compile::FLASH_BWD_SM90`] is the same backward with `bwd_kv` on Hopper's warpgroup MMA (`gpu/kernels/
//! flash_bwd_sm90.cu`, compute capability 9.0 only, [`is_wgmma_backward`]): two warpgroups of 64 keys over the same
//! 128-key tiles and 64-row query tiles, Sᵀ, dPᵀ and dQ from shared-memory operands, dV and dK with `Pᵀ` and `dSᵀ` from
//! registers, dSᵀ through swizzled shared memory for dQ; the walk, `P`, `dS` and every store are `flash_bwd.cu`'s
//! helpers, and its other kernels run unchanged in the same module. It takes the default tiling and head dims up to
//! 128 ([`wgmma_backward_supports`]; they are padded to 64 or 128 columns of zeros). Every product still adds in f32
//! on the tensor cores in k-steps of 16 with no more instructions than the model counts, so its recipe is this
//! module's. The production wrappers run it on an H200 where it takes the spec ([`production_backward_kernel`], and
//! `BlockLists::backward_kernel` for block-sparse lists); the property suites `gpu_flash_wgmma_backward_{bf16,f16}`
//! (the GPU tests' `property` module) verify its dense mode beside `flash_bwd`'s suites.
//!
//! The block-sparse backward (`crate::block_sparse::backward`) compiles the same kernels with `BLOCK_SPARSE`: the KV
//! owner walks the CSR transpose of the lists, the dQ owner and the deterministic dQ sum the query block's list, and
//! masks still apply inside the visited tiles (`launch_backward` with the lists).
//!
//! The ring backward (E11 with dK/dV travelling home) uses the same kernels step by step, from
//! [`crate::ring::backward_steps`]: `ring_backward_preprocess` per query chunk, `ring_backward_pair` per visible chunk
//! pair (the `KV_ACCUM` module: dK/dV sums added in f32 to the KV chunk's travelling accumulator, dQ added to the
//! query chunk's f32 accumulator), and `ring_backward_finish_dq`, `ring_backward_finish_dkv` at the end, each one
//! launch of this module's `ring_launch`; the recipe then counts the pairs' extra f32 additions in `extra_merges` (dQ)
//! and `extra_query_partials` (dK, dV).
//!
//! Supported: what the forward supports (dense and varlen, GQA/MQA, `Lq ≠ Lk`, any length, masks `None`, `Causal`,
//! `Window`, `And` of those; head dims multiples of 8 up to 256). Output columns are processed in chunks of up to 128
//! (grid y): head dims up to 128 keep every accumulator in registers and compute `S` and `dP` once per tile pair;
//! wider ones recompute them per chunk. Operands come from shared memory through `ldmatrix` (`.trans` for the
//! products that reduce along a tile's rows).
//!
//! # Precision recipe and why each parameter covers the kernel
//!
//! The kernel follows the reference backward's recipe (`attnproof-reference`'s `backward` module, bounded by
//! `attnproof_proofs::flash_bound::backward_bounds`) except in how `P = exp(s − LSE)` is evaluated and in how the
//! tensor cores add. The verifier's `FlashRecipe` (`attnproof_proofs::flash_bound`) for this kernel is the
//! reference's for the storage type (`unit_roundoff = u_T`, `subnormal = τ_T`) with `kv_tile =` [`KV_TILE`],
//! `extra_merges = 0`, `exp_error =` [`EXP_RELATIVE_ERROR`], `shift_rounding =` [`BACKWARD_SHIFT_ROUNDING`],
//! `exp_underflow =` [`EXP_UNDERFLOW`] and `accumulation = TensorCore { k_step: 16 }`, verified with `q_tile = 64`
//! (`gpu/tests/it/flash_backward.rs`).
//!
//! `P` is FlashAttention's fused form: `p = ex2.approx.ftz(fma(dot, c_L, −b_L))`, with `dot` the unscaled tensor-core
//! dot product `q·k`, `c_L = fl32(α̂·log2 e)` per launch and `b_L = fl32(LSE·log2 e)` per row, each product formed in
//! f64 (`log2 e` to `2^-53`) and rounded once to f32. Write `s = α·q·k` (exact, with the oracle's `α`),
//! `α̂ = α(1 + δ₀)`, `c_L = α̂·log2 e·(1 + δ₁)`, `b_L = LSE·log2 e·(1 + δ₂)` (`LSE` the candidate's f32 value, whose own
//! error is the forward bound `b^L` the model adds), the fma's rounding `(1 + δ₃)`, every `|δ| ≤ u`. In natural-log
//! units the argument is `α·dot·(1 + δ₀)(1 + δ₁) − LSE(1 + δ₂)`, times `(1 + δ₃)`, so its error against `s − LSE` is,
//! to first order:
//!
//! - `α(dot − q·k)`, the tensor cores' dot-product error, and `(δ₀ + δ₁)α·dot`, at most `2u|α|Σ_c|q_c||k_c|`: both
//!   inside the model's score term `σ_ij = (g(d) + 3u)|α|Σ_c|q_c||k_c|` (the reference spends the same `2u` on `α̂`
//!   and the rounding of `fl(dot·α̂)`), with `u|α|Σ_c|q_c||k_c|` to spare;
//! - `δ₃(s − LSE)`: `u|s − LSE|`, the model's own `u|s_ij − LSE_i|` (the reference's rounding of `fl(s − LSE)`);
//! - `δ₂·LSE`: `u|LSE|`, the shift rounding. The f64 products and the f64 `log2 e` add relative errors of `2^-52`,
//!   `2^-29` of the `u` terms beside them. `shift_rounding = 2u` charges `u|LSE|` and covers those with room.
//!
//! The exponential:
//!
//! - `exp_error = 5u` (`u = 2^-24`): `ex2.approx.ftz.f32` is within 2 ulp of the correctly rounded result for a
//!   normal result (PTX ISA, "ex2"; the `.ftz` form only flushes subnormal inputs and results), so within 2.5 ulp of
//!   `2^x`, a relative error of at most `5u` (the forward's argument, `attnproof_gpu::flash`).
//! - `exp_underflow = 2^-126`: a result below `2^-126` is flushed to `+0`, a loss of at most `2^-126` beside the
//!   relative error: the model's terms `2^-126|dP − D|` in `dS` and `Lq(τ_T + 2^-126) max|dO|` in `dV` cover it. A
//!   subnormal argument is flushed to 0 and gives `2^0 = 1`, which is its correctly rounded result. (An earlier
//!   recipe kept subnormal results by shifting arguments below −64; the shift cost three instructions per element
//!   and the flush's loss is far below every other term of these bounds.)
//! - A masked element has `p = 0` exactly (a select), and a row that sees no key (`LSE = −∞`) has `b_L = +∞`, so its
//!   argument is `−∞` and `p = +0` for any finite score.
//! - `accumulation = TensorCore { k_step: 16 }`: every product is an `m16n8k16` MMA with f32 accumulation. The model
//!   charges a sum of `n` terms `γ'(n + ⌈n/16⌉)` with `u' = 2u` (alignment and truncation inside the MMA, one extra
//!   addition per instruction). The kernel's sums take at most that many instructions: k-steps of 16 rows that lie
//!   entirely past the valid length are skipped, so `S` (over `d`) and `dP` (over `dv`) take `⌈d/16⌉`, `⌈dv/16⌉`
//!   instructions, dK and dV `Σ_t ⌈rows_t/16⌉ ≤ ⌈Lq/16⌉ + n_q` over the visited query tiles, dQ (strategy A)
//!   `⌈Lk/16⌉ + n_k` (its own KV tiles of 64 keys: only the last is partial, so the count holds for any `n_k`); the
//!   KV-owner strategies add each tile's MMA partial (≤ 8 instructions over 128 keys) into dQ with f32
//!   round-to-nearest additions (atomic, or in ascending tile order), at most `n_k − 1` of them per term. `D` is an f32
//!   fma chain and a shuffle tree over `dv` terms: `γ(dv)` for any order, below the tensor-core `γ'`.
//! - `q_tile = 64`, `kv_tile = 128`: the tile counts `n_q`, `n_k` of the model's partial sums.
//! - Everything else is the reference's recipe: `α̂ = fl32(1/√d)` from the host;
//!   `dS = round_T(fl(p·fl(dP − D)))` (the model's `2u + u_T` and `τ_T`); `dV` from `round_T(p)`; dK and dQ scaled
//!   by one f32 multiplication by `α̂` and rounded once to `T` (`3u + u_T`); under GQA each query head's dK, dV is
//!   accumulated in its own f32 registers, stored in f32, and summed over the group in ascending head order by
//!   `bwd_kv_group_sum` (the model's per-head bounds plus `γ(group)Σ_h|g_h|`).
//!
//! The candidate's forward (`O`, `LSE`) enters through the model's forward bounds, evaluated with the same recipe;
//! the GPU forward (`attnproof_gpu::flash`) satisfies them, since its own `shift_rounding = u` is below `2u`.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Operand;
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig};
use ndarray::{ArrayD, ArrayViewD, Dimension, IxDyn};

use crate::common::{GpuElement, check_len, grid_dim, to_i32};
use crate::compile::{self, FLASH_BWD, ModuleVariant};
use crate::error::GpuError;
use crate::launch::{self, BackwardBuffers, BackwardKernel, SparseBuffers};
use crate::params::{BackwardParams, BlockListParams, FlashParams};
use crate::ring::state::ChunkWindow;

/// Query rows per tile (the `q_tile` the verifier's model counts partial sums with).
pub const Q_TILE: usize = 64;
/// Keys per KV tile of `bwd_kv` in the default tiling (the `kv_tile` of the kernel's `FlashRecipe`: the dQ partials of
/// the KV-owner strategies are sums over this many keys). Another tiling has its own, [`BackwardTiling::kv_tile`].
pub const KV_TILE: usize = BackwardTiling::DEFAULT.kv_tile();
/// Keys per KV tile of strategy A's `bwd_dq` (its dQ is one running sum over all keys, so only the instruction count
/// depends on it, and the model's count holds for any tile).
const DQ_KV_TILE: usize = 64;
/// Widest output-column chunk per CTA (grid y splits wider head dims): up to this width every accumulator stays in
/// registers and `S`, `dP` are computed once per tile pair.
const MAX_CHUNK: usize = 128;
/// Threads per CTA of the kernels other than `bwd_kv`.
const THREADS: u32 = 128;
/// Shared memory a CTA may opt in to on the H200 (and every sm_90 part): 227 KiB.
const SHARED_OPT_IN: usize = 227 * 1024;
/// f32 unit roundoff.
const U32: f64 = f32::EPSILON as f64 / 2.0;
/// Relative error of `ex2.approx.f32` on a normal result (see the module docs).
pub const EXP_RELATIVE_ERROR: f64 = 5.0 * U32;
/// Shift rounding of the backward's exponent argument per unit of `|LSE|` (see the module docs).
pub const BACKWARD_SHIFT_ROUNDING: f64 = 2.0 * U32;
/// What the backward's flush-to-zero `ex2` may lose to underflow (see the module docs): the forward's, the crate-wide
/// constant defined in [`crate::common`].
pub use crate::common::EXP_UNDERFLOW;

/// How `bwd_kv` tiles the keys: `kv_warps` warps per CTA, each owning 16 keys, so a KV tile of `16 · kv_warps` keys.
/// Eight warps (128 keys) load each query tile once per 128 keys; four (64 keys) need half the registers and shared
/// memory per CTA, so two CTAs share an SM and one's barriers overlap the other's work. The arithmetic of an element
/// is the same in both but for the KV tile size of the dQ partials, which the recipe's `kv_tile` states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackwardTiling {
    /// Warps per `bwd_kv` CTA: 4 or 8.
    pub kv_warps: u32,
}

impl BackwardTiling {
    /// Every tiling the kernel compiles.
    pub const ALL: [BackwardTiling; 2] = [BackwardTiling { kv_warps: 4 }, BackwardTiling { kv_warps: 8 }];
    /// The tiling of [`flash_backward_device`] (the faster one on the H200 benchmark at d = 128).
    pub const DEFAULT: BackwardTiling = BackwardTiling { kv_warps: 8 };

    /// Keys per KV tile.
    pub const fn kv_tile(self) -> usize {
        16 * self.kv_warps as usize
    }

    fn threads(self) -> u32 {
        32 * self.kv_warps
    }
}

/// Who owns dQ (E10a).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuBackwardStrategy {
    /// Strategy A: a second traversal over query tiles recomputes `P` and owns dQ (deterministic).
    TwoTraversals,
    /// Strategy B: KV tiles own dK/dV and `atomicAdd` their dQ into an f32 accumulator (not bitwise reproducible).
    KvOwnerAtomic,
    /// Strategy B, deterministic: per-KV-tile dQ partials summed in ascending KV tile order.
    KvOwnerDeterministic,
}

impl GpuBackwardStrategy {
    /// All strategies.
    pub const ALL: [GpuBackwardStrategy; 3] = [
        GpuBackwardStrategy::TwoTraversals,
        GpuBackwardStrategy::KvOwnerAtomic,
        GpuBackwardStrategy::KvOwnerDeterministic,
    ];

    /// Whether two runs on the same inputs give bitwise equal outputs.
    pub fn is_deterministic(self) -> bool {
        self != GpuBackwardStrategy::KvOwnerAtomic
    }
}

/// The device inputs of a backward: `Q`, `K`, `V`, the forward's `O` and natural-log `LSE`, and `dO` (shaped like
/// `O`), in the spec's row-major layouts (LSE dense `[B, Hq, Lq]`, varlen `[Hq, Tq]`).
#[derive(Clone, Copy, Debug)]
pub struct BackwardDeviceInputs<'a, T> {
    /// Queries.
    pub q: &'a CudaSlice<T>,
    /// Keys.
    pub k: &'a CudaSlice<T>,
    /// Values.
    pub v: &'a CudaSlice<T>,
    /// Forward output.
    pub o: &'a CudaSlice<T>,
    /// Forward LSE (f32, natural log; −∞ on rows that see no key).
    pub lse: &'a CudaSlice<f32>,
    /// Upstream gradient.
    pub d_out: &'a CudaSlice<T>,
}

/// The device outputs: gradients shaped like `Q`, `K`, `V`, and `D` shaped like LSE. Buffers may be longer; the
/// kernels write only the first elements.
#[derive(Debug)]
pub struct BackwardDeviceOutputs<'a, T> {
    /// Gradient of Q.
    pub dq: &'a mut CudaSlice<T>,
    /// Gradient of K (summed over the KV head's query heads).
    pub dk: &'a mut CudaSlice<T>,
    /// Gradient of V (likewise).
    pub dv: &'a mut CudaSlice<T>,
    /// `D = rowsum(dO ∘ O)` (f32).
    pub delta: &'a mut CudaSlice<f32>,
}

/// Host outputs of [`flash_backward`].
#[derive(Clone, Debug, PartialEq)]
pub struct BackwardOutput<T> {
    /// Gradient of Q.
    pub dq: ArrayD<T>,
    /// Gradient of K.
    pub dk: ArrayD<T>,
    /// Gradient of V.
    pub dv: ArrayD<T>,
    /// `D` (f32), laid out like LSE.
    pub delta: ArrayD<f32>,
}

/// Everything the launches need, derived from a validated spec.
#[derive(Debug)]
struct Plan {
    params: FlashParams,
    defines: Vec<String>,
    cu_q: Vec<i32>,
    cu_k: Vec<i32>,
    /// Query tiles and KV tiles of the longest sequence, sequences.
    q_tiles: u32,
    kv_tiles: u32,
    seqs: u32,
    /// Columns per chunk (`CHUNK`), and the column chunks of the KV owner (`max(d, dv)`) and of the dQ owner (`d`).
    chunk: usize,
    kv_chunks: u32,
    /// Rows of K over all sequences (the GQA workspace's row count).
    total_k: usize,
    q_chunks: u32,
    kv_shared: u32,
    dq_shared: u32,
    /// CTAs of 64 keys per sequence of `bwd_kv_group_sum`.
    group_sum_tiles: u32,
    /// Elements of Q (the stride between dQ partials).
    q_elements: usize,
}

/// The define of `flash_bwd.cu`'s ring mode, which adds a pair's f32 dK/dV sums to a travelling accumulator.
pub(crate) const KV_ACCUM: &str = "KV_ACCUM";

/// The defines of the backward module a launch of `kernel` (a text of `flash_bwd.cu` or of the `wgmma` backward,
/// [`is_wgmma_backward`]) for `spec` in `tiling` compiles (after the checks of a launch).
pub(crate) fn backward_defines<T: GpuElement>(
    spec: &AttentionSpec,
    tiling: BackwardTiling,
    kernel: compile::KernelSource,
) -> Result<Vec<String>, GpuError> {
    Ok(plan::<T>(spec, tiling, kernel)?.defines)
}

/// The module a plain (dense) backward of `kernel` (a text of `flash_bwd.cu` or of the `wgmma` backward) for `spec`
/// in `tiling` compiles with storage type `T` (what a caller compiles ahead of the launch with [`compile::module`]).
pub fn backward_variant<T: GpuElement>(
    spec: &AttentionSpec,
    tiling: BackwardTiling,
    kernel: compile::KernelSource,
) -> Result<ModuleVariant, GpuError> {
    Ok(ModuleVariant { kernel, defines: backward_defines::<T>(spec, tiling, kernel)? })
}

/// Whether `kernel` is a text of the backward with the `wgmma` KV owner ([`compile::FLASH_BWD_SM90`], or a patched copy
/// of it): its plan differs from `flash_bwd`'s (padding, shared memory, the [`compile::BWD_KV_SM90`] define), not its
/// arguments.
pub fn is_wgmma_backward(kernel: compile::KernelSource) -> bool {
    kernel.name == compile::FLASH_BWD_SM90.name
}

/// Whether the `wgmma` backward ([`compile::FLASH_BWD_SM90`]) takes `spec` in `tiling`: the default tiling (its KV
/// tiles of 128 keys, two warpgroups of 64) and head dims up to [`crate::flash::WGMMA_MAX_HEAD_DIM`].
pub fn wgmma_backward_supports(spec: &AttentionSpec, tiling: BackwardTiling) -> bool {
    tiling == BackwardTiling::DEFAULT && spec.head_dim.max(spec.head_dim_v) <= crate::flash::WGMMA_MAX_HEAD_DIM
}

/// The backward kernel the production wrappers run for `spec` in `tiling` on a device of compute capability `device`:
/// the `wgmma` KV owner ([`compile::FLASH_BWD_SM90`]) on 9.0 where it takes the spec ([`wgmma_backward_supports`]),
/// `flash_bwd` ([`compile::FLASH_BWD`]) otherwise. Both are verified by the same property suites under the same recipe.
pub fn production_backward_kernel(
    spec: &AttentionSpec,
    tiling: BackwardTiling,
    device: (i32, i32),
) -> compile::KernelSource {
    if device == (9, 0) && wgmma_backward_supports(spec, tiling) { compile::FLASH_BWD_SM90 } else { FLASH_BWD }
}

/// Checks that the kernels support `spec` and derives the launch plan.
fn plan<T: GpuElement>(
    spec: &AttentionSpec,
    tiling: BackwardTiling,
    kernel: compile::KernelSource,
) -> Result<Plan, GpuError> {
    if !BackwardTiling::ALL.contains(&tiling) {
        return Err(GpuError::Unsupported {
            argument: "tiling",
            reason: format!("{tiling:?} is not one of {:?}", BackwardTiling::ALL),
        });
    }
    let wgmma = is_wgmma_backward(kernel);
    if wgmma && !wgmma_backward_supports(spec, tiling) {
        return Err(GpuError::Unsupported {
            argument: if tiling == BackwardTiling::DEFAULT { "head_dim" } else { "tiling" },
            reason: format!(
                "the wgmma backward takes the tiling {:?} and head dims up to {}, not {tiling:?} and {}, {}",
                BackwardTiling::DEFAULT,
                crate::flash::WGMMA_MAX_HEAD_DIM,
                spec.head_dim,
                spec.head_dim_v
            ),
        });
    }
    let kv_tile = tiling.kv_tile();
    let (params, cu_q, cu_k) = FlashParams::for_spec(spec)?;
    let (d, dv, hq, hkv) = (spec.head_dim, spec.head_dim_v, spec.n_heads_q, spec.n_heads_kv);
    // dv is the reduction of dP = dO Vᵀ, so it is padded to the mma's k step of 16, like d; the wgmma backward pads
    // both to its swizzled chunks of 64 columns.
    let pad = if wgmma { 64 } else { 16 };
    let (d_pad, dv_pad) = (d.div_ceil(pad) * pad, dv.div_ceil(pad) * pad);
    // The chunk is a multiple of 32 (bwd_kv's dQ step splits it in two or four parts of whole 16-column pairs).
    let chunk = MAX_CHUNK.min(d_pad.max(dv_pad).next_multiple_of(32));
    // Shared memory of bwd_kv (2-byte elements, rows padded by 8): the K and V tiles of kv_tile rows, Q and dO tiles
    // of Q_TILE rows per stage, the dS tile [Q_TILE][kv_tile + 8], and two f32 row vectors per stage. Two stages
    // (Q and dO of the next query tile loading while this one computes) unless the head dims are too wide for them.
    // The wgmma KV owner's rows are unpadded (swizzled instead), it always takes two stages, and it aligns its window
    // to 1024 bytes itself, for which it asks 1024 more.
    let kv_shared = |stages: usize| {
        let rows = kv_tile + stages * Q_TILE;
        if wgmma {
            1024 + 2 * (rows * (d_pad + dv_pad) + Q_TILE * kv_tile) + 2 * stages * Q_TILE * 4
        } else {
            2 * (rows * (d_pad + 8) + rows * (dv_pad + 8) + Q_TILE * (kv_tile + 8)) + 2 * stages * Q_TILE * 4
        }
    };
    let q_stages = if kv_shared(2) <= SHARED_OPT_IN { 2 } else { 1 };
    let mut defines = vec![
        T::DEFINE.to_owned(),
        format!("HEAD_DIM_PAD={d_pad}"),
        format!("HEAD_DIM_V_PAD={dv_pad}"),
        format!("CHUNK={chunk}"),
        format!("Q_STAGES={q_stages}"),
        format!("KV_WARPS={}", tiling.kv_warps),
    ];
    if wgmma {
        defines.push(compile::BWD_KV_SM90.to_owned());
    }
    defines.extend(params.diagonal_define());
    // bwd_dq: Q, dO tiles of Q_TILE rows and K, V tiles of DQ_KV_TILE rows.
    let dq_shared = 2 * ((Q_TILE + DQ_KV_TILE) * (d_pad + 8) + (Q_TILE + DQ_KV_TILE) * (dv_pad + 8));
    let seqs = spec.sequences();
    let max_len_q = seqs.iter().map(|s| s.len_q).max().unwrap_or(0);
    let max_len_k = seqs.iter().map(|s| s.len_k).max().unwrap_or(0);
    let kv_chunks = d.max(dv).div_ceil(chunk);
    let q_chunks = d.div_ceil(chunk);
    let k_elements: usize = spec.expected_shape(Operand::K).iter().product();
    Ok(Plan {
        params,
        defines,
        cu_q,
        cu_k,
        q_tiles: grid_dim("query tiles", max_len_q.div_ceil(Q_TILE), u32::MAX as usize >> 1)?,
        kv_tiles: grid_dim("KV tiles", max_len_k.div_ceil(kv_tile), u32::MAX as usize >> 1)?,
        group_sum_tiles: grid_dim("KV tiles", max_len_k.div_ceil(64), u32::MAX as usize >> 1)?,
        seqs: grid_dim("sequences", seqs.len(), 65535)?,
        chunk,
        kv_chunks: grid_dim("n_heads_q x column chunks", kv_chunks, 65535 / hq.max(1))?,
        total_k: k_elements / (hkv * d).max(1),
        q_chunks: grid_dim("n_heads_q x column chunks", q_chunks, 65535 / hq.max(1))?,
        kv_shared: kv_shared(q_stages) as u32,
        dq_shared: dq_shared as u32,
        q_elements: spec.expected_shape(Operand::Q).iter().product(),
    })
}

/// What a KV owner built on `flash_bwd.cu`'s helpers in `tiling` needs for `spec` (NSA's selected backward compiles
/// them with its own KV owner, DSA's token-sparse backward its query owner): the defines, the dynamic shared memory of
/// `bwd_kv`'s layout, the columns per chunk (`CHUNK`) and the column chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KvOwnerShape {
    pub defines: Vec<String>,
    pub shared_bytes: u32,
    pub chunk: usize,
    pub chunks: u32,
}

/// [`KvOwnerShape`] of `flash_bwd.cu` for `spec` in `tiling` with storage type `T` (the checks of a launch first).
pub(crate) fn kv_owner_shape<T: GpuElement>(
    spec: &AttentionSpec,
    tiling: BackwardTiling,
) -> Result<KvOwnerShape, GpuError> {
    let plan = plan::<T>(spec, tiling, FLASH_BWD)?;
    Ok(KvOwnerShape { defines: plan.defines, shared_bytes: plan.kv_shared, chunk: plan.chunk, chunks: plan.kv_chunks })
}

/// Checks that every buffer of a backward on device buffers holds its tensor of `spec`: Q, K, V, O, LSE and dO among
/// the inputs, dQ, dK, dV and `D` among the outputs ([`GpuError::BufferTooSmall`] naming the first that does not).
pub(crate) fn check_backward_buffers<T>(
    spec: &AttentionSpec,
    inputs: &BackwardDeviceInputs<'_, T>,
    outputs: &BackwardDeviceOutputs<'_, T>,
) -> Result<(), GpuError> {
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_len("q", inputs.q, size(Operand::Q))?;
    check_len("k", inputs.k, size(Operand::K))?;
    check_len("v", inputs.v, size(Operand::V))?;
    check_len("o", inputs.o, size(Operand::O))?;
    check_len("lse", inputs.lse, size(Operand::RowStat))?;
    check_len("d_out", inputs.d_out, size(Operand::O))?;
    check_len("dq", outputs.dq, size(Operand::Q))?;
    check_len("dk", outputs.dk, size(Operand::K))?;
    check_len("dv", outputs.dv, size(Operand::V))?;
    check_len("delta", outputs.delta, size(Operand::RowStat))
}

/// Loads `kernel` from `module`, allowing it `shared` bytes of dynamic shared memory.
fn function(
    ctx: &Arc<CudaContext>,
    module: &Arc<CudaModule>,
    kernel: BackwardKernel,
    shared: u32,
) -> Result<CudaFunction, GpuError> {
    load_kernel(ctx, module, kernel.name(), shared)
}

/// Loads the kernel `name` from a backward module, allowing it `shared` bytes of dynamic shared memory and, above the
/// default 48 KiB, all of the SM's unified L1/shared storage as shared memory.
pub(crate) fn load_kernel(
    ctx: &Arc<CudaContext>,
    module: &Arc<CudaModule>,
    name: &str,
    shared: u32,
) -> Result<CudaFunction, GpuError> {
    let func = module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(flash_bwd)", e))?;
    if shared > 48 * 1024 {
        compile::allow_shared_memory(ctx, &func, shared as usize, "head_dim")?;
        // All of the SM's unified L1/shared storage as shared memory, so that two CTAs of the four-warp tiling fit.
        func.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
            .map_err(|e| GpuError::driver("cuFuncSetAttribute(shared memory carveout)", e))?;
    }
    Ok(func)
}

/// Runs the backward on device buffers (asynchronously on `stream`): writes dQ, dK, dV and `D` into the first
/// elements of `outputs`. Inputs are read only. The f32 workspaces of the KV-owner strategies are allocated here. The
/// kernel is [`production_backward_kernel`]'s choice for the device (the `wgmma` KV owner on an H200 for head dims up
/// to 128) in the default tiling.
pub fn flash_backward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    inputs: BackwardDeviceInputs<'_, T>,
    outputs: BackwardDeviceOutputs<'_, T>,
    strategy: GpuBackwardStrategy,
) -> Result<(), GpuError> {
    let tiling = BackwardTiling::DEFAULT;
    let kernel = production_backward_kernel(spec, tiling, compile::compute_capability(stream.context())?);
    flash_backward_device_with(stream, spec, kernel, tiling, inputs, outputs, strategy)
}

/// [`flash_backward_device`] with an explicit kernel source and tiling: the tests compile patched copies of
/// `flash_bwd.cu` (mutants) through the same validation and launch path, and the benchmark times every tiling.
/// `kernel` must define the kernels of `gpu/kernels/flash_bwd.cu` with its parameters.
pub fn flash_backward_device_with<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    kernel: compile::KernelSource,
    tiling: BackwardTiling,
    inputs: BackwardDeviceInputs<'_, T>,
    outputs: BackwardDeviceOutputs<'_, T>,
    strategy: GpuBackwardStrategy,
) -> Result<(), GpuError> {
    launch_backward(stream, spec, kernel, tiling, inputs, outputs, strategy, None)
}

/// The block-sparse mode's host inputs: the validated lists, row-major, and their scalars.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SparseLists<'a> {
    /// `[B, list heads, query blocks, width]` entries.
    pub entries: &'a [i32],
    /// Their scalars.
    pub params: BlockListParams,
}

impl SparseLists<'_> {
    /// Keys per key block.
    fn kv_block(&self) -> usize {
        self.params.tiles_per_block as usize * 64
    }

    /// CSR rows: one per (sequence, list head, key block).
    fn csr_rows(&self, seqs: usize) -> usize {
        seqs * self.params.list_heads as usize * self.params.kv_blocks as usize
    }

    /// The deterministic dQ mode's partials per query tile under `tiling`: one per KV tile of the longest list's
    /// valid prefix (each partial is stored at its tile's position in its list, `partial_slot` in `flash_bwd.cu`, and
    /// a position is always inside the valid prefix), instead of one per KV tile of the longest sequence. The
    /// entries were validated before: ascending valid prefixes, then `−1`.
    fn dq_partials(&self, tiling: BackwardTiling) -> usize {
        let width = (self.params.width as usize).max(1);
        let longest = self.entries.chunks(width).map(|list| list.iter().take_while(|&&b| b >= 0).count()).max();
        longest.unwrap_or(0) * (self.kv_block() / tiling.kv_tile())
    }
}

/// The define of `flash_bwd.cu`'s block-sparse mode.
pub(crate) const BLOCK_SPARSE: &str = crate::flash::BLOCK_SPARSE;

/// The CSR transpose of block lists on the device (`bwd_csr_count`, `bwd_csr_scan`, `bwd_csr_fill` of `module`,
/// compiled with [`BLOCK_SPARSE`]): the uploaded lists, the row offsets and the rows' query blocks.
pub(crate) struct DeviceCsr {
    /// The lists, as uploaded.
    pub lists: CudaSlice<i32>,
    /// `rows + 1` offsets.
    pub offsets: CudaSlice<i32>,
    /// The rows' query blocks (one element when there are none: cudarc holds no empty buffer).
    pub q_blocks: CudaSlice<i32>,
}

/// Uploads `sparse`'s lists for `seqs` sequences and builds their CSR transpose on `stream` with `module`'s kernels.
pub(crate) fn sparse_csr(
    stream: &Arc<CudaStream>,
    module: &Arc<CudaModule>,
    sparse: &SparseLists<'_>,
    seqs: usize,
) -> Result<DeviceCsr, GpuError> {
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let lists = if sparse.entries.is_empty() {
        stream.alloc_zeros::<i32>(1).map_err(alloc_err)?
    } else {
        stream.clone_htod(sparse.entries).map_err(|e| GpuError::driver("cuMemcpyHtoD(block lists)", e))?
    };
    let rows = sparse.csr_rows(seqs);
    // The transpose holds exactly the lists' valid entries.
    let nnz = sparse.entries.iter().filter(|&&x| x >= 0).count();
    let mut offsets = stream.alloc_zeros::<i32>(rows + 1).map_err(alloc_err)?;
    let mut q_blocks = stream.alloc_zeros::<i32>(nnz.max(1)).map_err(alloc_err)?;
    if rows > 0 {
        let load = |name: &str| {
            module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(flash_bwd csr)", e))
        };
        let p = &sparse.params;
        let grid = (
            grid_dim("key blocks", (p.kv_blocks as usize).div_ceil(4), u32::MAX as usize >> 1)?,
            grid_dim("list heads", p.list_heads as usize, 65535)?,
            grid_dim("sequences", seqs, 65535)?,
        );
        let rows_cfg = LaunchConfig { grid_dim: grid, block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        launch::launch_csr_rows(stream, &load("bwd_csr_count")?, rows_cfg, &lists, &mut offsets, None, p)?;
        let scan_cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        launch::launch_csr_scan(stream, &load("bwd_csr_scan")?, scan_cfg, &mut offsets, to_i32("CSR rows", rows)?)?;
        launch::launch_csr_rows(
            stream,
            &load("bwd_csr_fill")?,
            rows_cfg,
            &lists,
            &mut offsets,
            Some(&mut q_blocks),
            p,
        )?;
    }
    Ok(DeviceCsr { lists, offsets, q_blocks })
}

/// The backward on device buffers, dense or (with `sparse`) block-sparse: the checks, the workspaces and the launches.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_backward<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    kernel: compile::KernelSource,
    tiling: BackwardTiling,
    inputs: BackwardDeviceInputs<'_, T>,
    outputs: BackwardDeviceOutputs<'_, T>,
    strategy: GpuBackwardStrategy,
    sparse: Option<SparseLists<'_>>,
) -> Result<(), GpuError> {
    let mut plan = plan::<T>(spec, tiling, kernel)?;
    if let Some(sparse) = &sparse {
        // A KV tile of bwd_kv must lie in one key block, whose CSR row it walks.
        if !sparse.kv_block().is_multiple_of(tiling.kv_tile()) {
            return Err(GpuError::Unsupported {
                argument: "tiling",
                reason: format!("KV tiles of {} keys straddle key blocks of {}", tiling.kv_tile(), sparse.kv_block()),
            });
        }
        plan.defines.push(BLOCK_SPARSE.to_owned());
    }
    check_backward_buffers(spec, &inputs, &outputs)?;
    if plan.seqs == 0 {
        return Ok(());
    }
    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &plan.defines)?;
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let upload_err = |e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e);
    let cu_q = stream.clone_htod(&plan.cu_q).map_err(upload_err)?;
    let cu_k = stream.clone_htod(&plan.cu_k).map_err(upload_err)?;
    let csr = match &sparse {
        Some(sparse) => Some(sparse_csr(stream, &module, sparse, plan.seqs as usize)?),
        None => None,
    };
    let partials = match strategy {
        GpuBackwardStrategy::KvOwnerDeterministic => {
            // Dense: one partial per KV tile; block-sparse: one per listed KV tile.
            let copies = sparse.as_ref().map_or(plan.kv_tiles as usize, |sparse| sparse.dq_partials(tiling));
            plan.q_elements
                .checked_mul(copies)
                .ok_or(GpuError::TooLarge { argument: "dQ partials", value: usize::MAX })?
        }
        _ => 0,
    };
    let accumulator = if strategy == GpuBackwardStrategy::KvOwnerAtomic { plan.q_elements } else { 0 };
    let mut dq_acc = stream.alloc_zeros::<f32>(accumulator.max(1)).map_err(alloc_err)?;
    let mut dq_part = stream.alloc_zeros::<f32>(partials.max(1)).map_err(alloc_err)?;
    // GQA: every query head's f32 dK and dV sums, added in ascending head order by `bwd_kv_group_sum`.
    let group_sums =
        if spec.group_size() > 1 { spec.n_heads_q * plan.total_k * (spec.head_dim + spec.head_dim_v) } else { 0 };
    let mut dkv_part = stream.alloc_zeros::<f32>(group_sums.max(1)).map_err(alloc_err)?;
    let BackwardDeviceOutputs { dq, dk, dv, delta } = outputs;
    let mut buffers = BackwardBuffers {
        q: inputs.q,
        k: inputs.k,
        v: inputs.v,
        o: inputs.o,
        lse: inputs.lse,
        d_out: inputs.d_out,
        dq,
        dk,
        dv,
        delta,
        dq_acc: &mut dq_acc,
        dq_part: &mut dq_part,
        dkv_part: &mut dkv_part,
        cu_q: &cu_q,
        cu_k: &cu_k,
        sparse: match (&csr, &sparse) {
            (Some(csr), Some(sparse)) => Some(SparseBuffers {
                lists: &csr.lists,
                csr_offsets: &csr.offsets,
                csr_q_blocks: &csr.q_blocks,
                params: &sparse.params,
            }),
            _ => None,
        },
    };
    let cfg_with = |threads: u32, grid: (u32, u32, u32), shared: u32| LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared,
    };
    let cfg = |grid, shared| cfg_with(THREADS, grid, shared);
    let hq = spec.n_heads_q as u32;
    let hkv = spec.n_heads_kv as u32;
    // The scalars every kernel shares; each launch below sets the ones its kernel reads beside them.
    let base = BackwardParams {
        flash: plan.params,
        part_stride: plan.q_elements as i64,
        total_k: plan.total_k as i64,
        ..BackwardParams::default()
    };
    if plan.q_tiles > 0 {
        let which = BackwardKernel::Preprocess;
        let f = function(ctx, &module, which, 0)?;
        launch::launch_flash_backward(stream, &f, cfg((plan.q_tiles, hq, plan.seqs), 0), which, &mut buffers, &base)?;
    }
    if plan.kv_tiles > 0 {
        let dq_mode = match strategy {
            GpuBackwardStrategy::TwoTraversals => 0,
            GpuBackwardStrategy::KvOwnerAtomic => 1,
            GpuBackwardStrategy::KvOwnerDeterministic => 2,
        };
        let which = BackwardKernel::KvOwner;
        let f = function(ctx, &module, which, plan.kv_shared)?;
        launch::launch_flash_backward(
            stream,
            &f,
            cfg_with(tiling.threads(), (plan.kv_tiles, hq * plan.kv_chunks, plan.seqs), plan.kv_shared),
            which,
            &mut buffers,
            &BackwardParams { dq_mode, n_chunks: plan.kv_chunks as i32, ..base },
        )?;
        if spec.group_size() > 1 {
            let which = BackwardKernel::GroupSum;
            let f = function(ctx, &module, which, 0)?;
            launch::launch_flash_backward(
                stream,
                &f,
                cfg((plan.group_sum_tiles, hkv, plan.seqs), 0),
                which,
                &mut buffers,
                &BackwardParams { n_heads_q: hq as i32, ..base },
            )?;
        }
    }
    if plan.q_tiles > 0 {
        match strategy {
            GpuBackwardStrategy::TwoTraversals => {
                let which = BackwardKernel::DqOwner;
                let f = function(ctx, &module, which, plan.dq_shared)?;
                launch::launch_flash_backward(
                    stream,
                    &f,
                    cfg((plan.q_tiles, hq * plan.q_chunks, plan.seqs), plan.dq_shared),
                    which,
                    &mut buffers,
                    &BackwardParams { n_chunks: plan.q_chunks as i32, ..base },
                )?;
            }
            GpuBackwardStrategy::KvOwnerAtomic | GpuBackwardStrategy::KvOwnerDeterministic => {
                let finalize_mode = i32::from(strategy == GpuBackwardStrategy::KvOwnerDeterministic);
                let which = BackwardKernel::Finalize;
                let f = function(ctx, &module, which, 0)?;
                launch::launch_flash_backward(
                    stream,
                    &f,
                    cfg((plan.q_tiles, hq, plan.seqs), 0),
                    which,
                    &mut buffers,
                    &BackwardParams { finalize_mode, ..base },
                )?;
            }
        }
    }
    Ok(())
}

/// One ring-backward launch (the steps of `crate::ring::backward_steps`): the plan of `spec` with the `KV_ACCUM`
/// module, `window` (for a pair) in place of the mask, one-element placeholders for the buffers the launched kernel
/// does not touch, and the kernel run.
pub(crate) fn ring_launch<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    window: Option<ChunkWindow>,
    which: BackwardKernel,
    real: RingBuffers<'_, T>,
) -> Result<(), GpuError> {
    if window.is_some() && !matches!(spec.mask, attnproof_oracle::Mask::None) {
        return Err(GpuError::Unsupported {
            argument: "mask",
            reason: "a chunk pair's visibility is its `ChunkWindow`; the pair's spec must have Mask::None".into(),
        });
    }
    let tiling = BackwardTiling::DEFAULT;
    let mut plan = plan::<T>(spec, tiling, FLASH_BWD)?;
    plan.defines.push(KV_ACCUM.to_owned());
    if let Some(w) = window {
        (plan.params.win_left, plan.params.win_right) = w.kernel_values();
    }
    if plan.seqs == 0 {
        return Ok(());
    }
    let ctx = stream.context();
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let upload_err = |e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e);
    let cu_q = stream.clone_htod(&plan.cu_q).map_err(upload_err)?;
    let cu_k = stream.clone_htod(&plan.cu_k).map_err(upload_err)?;
    let t1 = || stream.alloc_zeros::<T>(1).map_err(alloc_err);
    let f1 = || stream.alloc_zeros::<f32>(1).map_err(alloc_err);
    let (ph_q, ph_k, ph_v, ph_o, ph_do, mut ph_dq, mut ph_dk, mut ph_dv) =
        (t1()?, t1()?, t1()?, t1()?, t1()?, t1()?, t1()?, t1()?);
    let (ph_lse, mut ph_delta, mut ph_acc, mut ph_part, mut ph_dkv) = (f1()?, f1()?, f1()?, f1()?, f1()?);
    let mut buffers = BackwardBuffers {
        q: real.q.unwrap_or(&ph_q),
        k: real.k.unwrap_or(&ph_k),
        v: real.v.unwrap_or(&ph_v),
        o: real.o.unwrap_or(&ph_o),
        lse: real.lse.unwrap_or(&ph_lse),
        d_out: real.d_out.unwrap_or(&ph_do),
        dq: real.dq.unwrap_or(&mut ph_dq),
        dk: real.dk.unwrap_or(&mut ph_dk),
        dv: real.dv.unwrap_or(&mut ph_dv),
        delta: real.delta.unwrap_or(&mut ph_delta),
        dq_acc: real.dq_acc.unwrap_or(&mut ph_acc),
        dq_part: &mut ph_part,
        dkv_part: real.dkv_acc.unwrap_or(&mut ph_dkv),
        cu_q: &cu_q,
        cu_k: &cu_k,
        sparse: None,
    };
    let module = compile::module(ctx, FLASH_BWD, &plan.defines)?;
    let (grid, threads, shared) = match which {
        BackwardKernel::Preprocess => ((plan.q_tiles, spec.n_heads_q as u32, plan.seqs), THREADS, 0),
        BackwardKernel::KvOwner => {
            ((plan.kv_tiles, spec.n_heads_q as u32 * plan.kv_chunks, plan.seqs), tiling.threads(), plan.kv_shared)
        }
        BackwardKernel::Finalize => ((plan.q_tiles, spec.n_heads_q as u32, plan.seqs), THREADS, 0),
        BackwardKernel::GroupSum => ((plan.group_sum_tiles, spec.n_heads_kv as u32, plan.seqs), THREADS, 0),
        BackwardKernel::DqOwner => {
            return Err(GpuError::Unsupported { argument: "kernel", reason: "bwd_dq is not a ring step".into() });
        }
    };
    if grid.0 == 0 {
        return Ok(());
    }
    // The ring's pair step adds its dQ to the query chunk's f32 accumulator (the atomic mode), and its finish step
    // reads that accumulator (finalize mode 0).
    let flash = plan.params;
    let params = match which {
        BackwardKernel::KvOwner => BackwardParams {
            flash,
            dq_mode: 1,
            n_chunks: plan.kv_chunks as i32,
            part_stride: plan.q_elements as i64,
            total_k: plan.total_k as i64,
            ..BackwardParams::default()
        },
        BackwardKernel::GroupSum => BackwardParams {
            flash,
            n_heads_q: spec.n_heads_q as i32,
            total_k: plan.total_k as i64,
            ..BackwardParams::default()
        },
        _ => BackwardParams { flash, finalize_mode: 0, ..BackwardParams::default() },
    };
    let f = function(ctx, &module, which, shared)?;
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: shared };
    launch::launch_flash_backward(stream, &f, cfg, which, &mut buffers, &params)
}

/// The buffers a ring-backward launch uses; the others are placeholders.
pub(crate) struct RingBuffers<'a, T> {
    pub(crate) q: Option<&'a CudaSlice<T>>,
    pub(crate) k: Option<&'a CudaSlice<T>>,
    pub(crate) v: Option<&'a CudaSlice<T>>,
    pub(crate) o: Option<&'a CudaSlice<T>>,
    pub(crate) lse: Option<&'a CudaSlice<f32>>,
    pub(crate) d_out: Option<&'a CudaSlice<T>>,
    pub(crate) dq: Option<&'a mut CudaSlice<T>>,
    pub(crate) dk: Option<&'a mut CudaSlice<T>>,
    pub(crate) dv: Option<&'a mut CudaSlice<T>>,
    pub(crate) delta: Option<&'a mut CudaSlice<f32>>,
    pub(crate) dq_acc: Option<&'a mut CudaSlice<f32>>,
    pub(crate) dkv_acc: Option<&'a mut CudaSlice<f32>>,
}

impl<T> Default for RingBuffers<'_, T> {
    fn default() -> Self {
        RingBuffers {
            q: None,
            k: None,
            v: None,
            o: None,
            lse: None,
            d_out: None,
            dq: None,
            dk: None,
            dv: None,
            delta: None,
            dq_acc: None,
            dkv_acc: None,
        }
    }
}

/// Checks a host tensor's shape and layout and returns it as a row-major slice; `finite` rejects non-finite values.
pub(crate) fn host_tensor<'a, X: Copy>(
    spec: &AttentionSpec,
    argument: &'static str,
    operand: Operand,
    t: &'a ArrayViewD<'_, X>,
    finite: impl Fn(X) -> bool,
) -> Result<&'a [X], GpuError> {
    let expected = spec.expected_shape(operand);
    if t.shape() != expected.as_slice() {
        return Err(GpuError::Shape { argument, expected, actual: t.shape().to_vec() });
    }
    let data = t.as_slice().ok_or_else(|| GpuError::Stride { argument, strides: t.strides().to_vec() })?;
    if let Some(i) = data.iter().position(|&x| !finite(x)) {
        let index =
            ndarray::indices(expected.as_slice()).into_iter().nth(i).map(|ix| ix.slice().to_vec()).unwrap_or_default();
        return Err(attnproof_oracle::OracleError::NonFinite { argument, index, value: f64::NAN }.into());
    }
    Ok(data)
}

/// Runs the backward from host tensors and returns host outputs (copies in, launches, copies out, synchronizes).
/// `lse` may hold −∞ (rows that see no key) but no NaN or +∞; the other inputs must be finite.
#[allow(clippy::too_many_arguments)]
pub fn flash_backward<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    q: ArrayViewD<'_, T>,
    k: ArrayViewD<'_, T>,
    v: ArrayViewD<'_, T>,
    o: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
    d_out: ArrayViewD<'_, T>,
    strategy: GpuBackwardStrategy,
) -> Result<BackwardOutput<T>, GpuError> {
    spec.validate()?;
    backward_from_host(stream, spec, [q, k, v, o, d_out], lse, |inputs, outputs| {
        flash_backward_device(stream, spec, inputs, outputs, strategy)
    })
}

/// Checks host inputs (`[q, k, v, o, d_out]` and `lse`) for a validated `spec`, uploads them, runs `launch` on
/// device outputs, and returns the host outputs (synchronizes).
pub(crate) fn backward_from_host<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    [q, k, v, o, d_out]: [ArrayViewD<'_, T>; 5],
    lse: ArrayViewD<'_, f32>,
    launch: impl FnOnce(BackwardDeviceInputs<'_, T>, BackwardDeviceOutputs<'_, T>) -> Result<(), GpuError>,
) -> Result<BackwardOutput<T>, GpuError> {
    let fin = |x: T| x.is_finite_value();
    let hq = host_tensor(spec, "q", Operand::Q, &q, fin)?;
    let hk = host_tensor(spec, "k", Operand::K, &k, fin)?;
    let hv = host_tensor(spec, "v", Operand::V, &v, fin)?;
    let ho = host_tensor(spec, "o", Operand::O, &o, fin)?;
    let hl = host_tensor(spec, "lse", Operand::RowStat, &lse, |x: f32| x.is_finite() || x == f32::NEG_INFINITY)?;
    let hg = host_tensor(spec, "d_out", Operand::O, &d_out, fin)?;
    let up_err = |e| GpuError::driver("cuMemcpyHtoD", e);
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    // cudarc cannot hold an empty buffer; an empty tensor travels as one zero the kernels never read.
    fn up<X: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        stream: &Arc<CudaStream>,
        data: &[X],
    ) -> Result<CudaSlice<X>, cudarc::driver::DriverError> {
        if data.is_empty() { stream.alloc_zeros::<X>(1) } else { stream.clone_htod(data) }
    }
    let (dq_in, dk_in, dv_in) =
        (up(stream, hq).map_err(up_err)?, up(stream, hk).map_err(up_err)?, up(stream, hv).map_err(up_err)?);
    let (o_in, lse_in, g_in) =
        (up(stream, ho).map_err(up_err)?, up(stream, hl).map_err(up_err)?, up(stream, hg).map_err(up_err)?);
    let shape = |op: Operand| spec.expected_shape(op);
    let n = |op: Operand| shape(op).iter().product::<usize>();
    let mut dq = stream.alloc_zeros::<T>(n(Operand::Q).max(1)).map_err(alloc_err)?;
    let mut dk = stream.alloc_zeros::<T>(n(Operand::K).max(1)).map_err(alloc_err)?;
    let mut dv = stream.alloc_zeros::<T>(n(Operand::V).max(1)).map_err(alloc_err)?;
    let mut delta = stream.alloc_zeros::<f32>(n(Operand::RowStat).max(1)).map_err(alloc_err)?;
    launch(
        BackwardDeviceInputs { q: &dq_in, k: &dk_in, v: &dv_in, o: &o_in, lse: &lse_in, d_out: &g_in },
        BackwardDeviceOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv, delta: &mut delta },
    )?;
    let down_err = |e| GpuError::driver("cuMemcpyDtoH", e);
    let mut dq_h = stream.clone_dtoh(&dq).map_err(down_err)?;
    let mut dk_h = stream.clone_dtoh(&dk).map_err(down_err)?;
    let mut dv_h = stream.clone_dtoh(&dv).map_err(down_err)?;
    let mut delta_h = stream.clone_dtoh(&delta).map_err(down_err)?;
    stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
    let shaped = |mut data: Vec<T>, op: Operand| {
        data.truncate(n(op));
        ArrayD::from_shape_vec(IxDyn(&shape(op)), data).expect("length matches the shape")
    };
    delta_h.truncate(n(Operand::RowStat));
    dq_h.truncate(n(Operand::Q));
    dk_h.truncate(n(Operand::K));
    dv_h.truncate(n(Operand::V));
    Ok(BackwardOutput {
        dq: shaped(dq_h, Operand::Q),
        dk: shaped(dk_h, Operand::K),
        dv: shaped(dv_h, Operand::V),
        delta: ArrayD::from_shape_vec(IxDyn(&shape(Operand::RowStat)), delta_h).expect("length matches the shape"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::NO_BOUND;
    use attnproof_oracle::{Mask, Predicate};
    use half::{bf16, f16};

    /// The deterministic block-sparse dQ workspace holds one partial per KV tile of the longest list's valid prefix,
    /// whatever the lists' padded width and the sequence's length.
    #[test]
    fn the_sparse_dq_workspace_counts_the_longest_list() {
        // Three lists of width 4: two entries, three entries, none.
        let entries = [0, 5, -1, -1, 1, 2, 7, -1, -1, -1, -1, -1];
        let params = BlockListParams { width: 4, tiles_per_block: 2, kv_blocks: 4096, ..Default::default() };
        let sparse = SparseLists { entries: &entries, params };
        assert_eq!(sparse.dq_partials(BackwardTiling::DEFAULT), 3, "128-key tiles in 128-key blocks");
        assert_eq!(sparse.dq_partials(BackwardTiling { kv_warps: 4 }), 6, "64-key tiles in 128-key blocks");
        let full = [3, 4, 5, 6];
        let sparse = SparseLists { entries: &full, params };
        assert_eq!(sparse.dq_partials(BackwardTiling::DEFAULT), 4, "a list without a pad");
        let sparse = SparseLists { entries: &[], params: BlockListParams { width: 0, ..params } };
        assert_eq!(sparse.dq_partials(BackwardTiling::DEFAULT), 0, "no lists");
    }

    #[test]
    fn predicate_masks_and_odd_dims_are_typed_errors() {
        let p = Mask::Predicate(Predicate { name: "even".into(), visible: Arc::new(|pair| pair.key % 2 == 0) });
        let spec = AttentionSpec::dense(1, 1, 1, 4, 4, 16, 16).with_mask(p);
        assert!(matches!(
            plan::<bf16>(&spec, BackwardTiling::DEFAULT, FLASH_BWD),
            Err(GpuError::Unsupported { argument: "mask", .. })
        ));
        for (d, dv, bad) in [(59, 64, "head_dim"), (64, 12, "head_dim_v"), (264, 64, "head_dim")] {
            match plan::<f16>(&AttentionSpec::dense(1, 1, 1, 4, 4, d, dv), BackwardTiling::DEFAULT, FLASH_BWD) {
                Err(GpuError::Unsupported { argument, .. }) => assert_eq!(argument, bad),
                other => panic!("d={d} dv={dv}: {other:?}"),
            }
        }
        assert!(matches!(
            plan::<bf16>(&AttentionSpec::dense(1, 3, 2, 4, 4, 8, 8), BackwardTiling::DEFAULT, FLASH_BWD),
            Err(GpuError::Spec(_))
        ));
    }

    #[test]
    fn plan_grids_chunks_and_shared_memory() {
        let spec = AttentionSpec::dense(2, 4, 2, 130, 70, 128, 200).with_mask(Mask::Causal);
        let p = plan::<bf16>(&spec, BackwardTiling::DEFAULT, FLASH_BWD).unwrap();
        assert_eq!((p.q_tiles, p.kv_tiles, p.group_sum_tiles, p.seqs), (3, 1, 2, 2));
        // Chunks of 128 columns: max(d, dv) = 200 takes two, d = 128 one.
        assert_eq!((p.kv_chunks, p.q_chunks), (2, 1));
        assert_eq!(
            p.defines,
            ["ELEM_BF16", "HEAD_DIM_PAD=128", "HEAD_DIM_V_PAD=208", "CHUNK=128", "Q_STAGES=2", "KV_WARPS=8"]
        );
        assert_eq!((p.params.win_left, p.params.win_right), (NO_BOUND as i32, 0));
        // bwd_kv: K, V tiles of 128 rows and two stages of Q, dO tiles of 64 rows, the dS tile, four f32 row vectors.
        let rows = 128 + 2 * 64;
        assert_eq!(p.kv_shared as usize, 2 * (rows * 136 + rows * 216 + 64 * 136) + 4 * 64 * 4);
        assert_eq!(p.dq_shared as usize, 2 * (128 * 136 + 128 * 216));
        assert_eq!(p.q_elements, 2 * 4 * 130 * 128);
        assert_eq!(p.total_k, 2 * 70);
        // Narrow heads take one chunk of 32 columns.
        let narrow =
            plan::<bf16>(&AttentionSpec::dense(1, 1, 1, 4, 4, 16, 8), BackwardTiling::DEFAULT, FLASH_BWD).unwrap();
        assert_eq!(narrow.defines[3..], ["CHUNK=32", "Q_STAGES=2", "KV_WARPS=8"]);
        // The largest head dims fit the H200's 227 KiB opt-in shared memory with one stage.
        let big =
            plan::<f16>(&AttentionSpec::dense(1, 2, 1, 4, 4, 256, 256), BackwardTiling::DEFAULT, FLASH_BWD).unwrap();
        assert_eq!(big.defines[3..], ["CHUNK=128", "Q_STAGES=1", "KV_WARPS=8"]);
        assert!(big.kv_shared as usize <= SHARED_OPT_IN, "{}", big.kv_shared);
    }

    #[test]
    fn four_warp_tiling_halves_the_kv_tile_and_fits_two_ctas_per_sm_at_d_128() {
        let four = BackwardTiling { kv_warps: 4 };
        assert_eq!(BackwardTiling::ALL.map(BackwardTiling::kv_tile), [64, 128]);
        let p = plan::<bf16>(&AttentionSpec::dense(1, 2, 2, 300, 300, 128, 128), four, FLASH_BWD).unwrap();
        assert_eq!(p.kv_tiles, 5);
        assert_eq!(p.defines[3..], ["CHUNK=128", "Q_STAGES=2", "KV_WARPS=4"]);
        // An SM has 228 KiB of shared memory and reserves 1 KiB per CTA.
        assert!(2 * (p.kv_shared as usize + 1024) <= 228 * 1024, "{}", p.kv_shared);
        let bad = plan::<bf16>(&AttentionSpec::dense(1, 1, 1, 4, 4, 64, 64), BackwardTiling { kv_warps: 6 }, FLASH_BWD);
        assert!(matches!(bad, Err(GpuError::Unsupported { argument: "tiling", .. })));
    }

    #[test]
    fn the_wgmma_plan_pads_to_whole_chunks_and_takes_head_dims_up_to_128() {
        use crate::compile::{BWD_KV_SM90, FLASH_BWD_SM90};
        assert!(is_wgmma_backward(FLASH_BWD_SM90) && !is_wgmma_backward(FLASH_BWD));
        let p =
            plan::<bf16>(&AttentionSpec::dense(1, 2, 1, 300, 300, 40, 128), BackwardTiling::DEFAULT, FLASH_BWD_SM90)
                .unwrap();
        for define in ["HEAD_DIM_PAD=64", "HEAD_DIM_V_PAD=128", "KV_WARPS=8", BWD_KV_SM90] {
            assert!(p.defines.iter().any(|d| d == define), "{define} missing from {:?}", p.defines);
        }
        // K and V of 128 keys, Q and dO of 64 rows in two stages, dSᵀ (128 × 64), the row statistics, the alignment.
        assert_eq!(p.kv_shared as usize, 1024 + 2 * (256 * (64 + 128) + 64 * 128) + 2 * 2 * 64 * 4);
        assert!(p.kv_shared as usize <= SHARED_OPT_IN);
        assert_eq!((p.kv_chunks, p.q_chunks), (1, 1));
        let mma = plan::<bf16>(&AttentionSpec::dense(1, 2, 1, 300, 300, 40, 128), BackwardTiling::DEFAULT, FLASH_BWD)
            .unwrap();
        assert!(mma.defines.iter().any(|d| d == "HEAD_DIM_PAD=48") && !mma.defines.iter().any(|d| d == BWD_KV_SM90));
        for (spec, tiling, argument) in [
            (AttentionSpec::dense(1, 1, 1, 4, 4, 136, 64), BackwardTiling::DEFAULT, "head_dim"),
            (AttentionSpec::dense(1, 1, 1, 4, 4, 64, 136), BackwardTiling::DEFAULT, "head_dim"),
            (AttentionSpec::dense(1, 1, 1, 4, 4, 64, 64), BackwardTiling { kv_warps: 4 }, "tiling"),
        ] {
            assert!(!wgmma_backward_supports(&spec, tiling));
            let err = plan::<bf16>(&spec, tiling, FLASH_BWD_SM90).unwrap_err();
            assert!(matches!(err, GpuError::Unsupported { argument: a, .. } if a == argument), "{err}");
        }
    }

    #[test]
    fn the_production_backward_is_the_wgmma_one_on_hopper_for_head_dims_up_to_128_in_the_default_tiling() {
        use crate::compile::FLASH_BWD_SM90;
        let spec = |d, dv| AttentionSpec::dense(1, 4, 2, 300, 200, d, dv);
        let default = BackwardTiling::DEFAULT;
        for (d, dv) in [(8, 8), (64, 64), (40, 128), (128, 128)] {
            assert_eq!(production_backward_kernel(&spec(d, dv), default, (9, 0)), FLASH_BWD_SM90, "{d}, {dv}");
            for device in [(8, 0), (8, 9), (10, 0), (12, 0)] {
                assert_eq!(production_backward_kernel(&spec(d, dv), default, device), FLASH_BWD, "{device:?}");
            }
            assert_eq!(production_backward_kernel(&spec(d, dv), BackwardTiling { kv_warps: 4 }, (9, 0)), FLASH_BWD);
        }
        for (d, dv) in [(136, 128), (128, 136), (256, 256)] {
            assert_eq!(production_backward_kernel(&spec(d, dv), default, (9, 0)), FLASH_BWD, "{d}, {dv}");
        }
    }

    #[test]
    fn strategies_say_which_are_deterministic() {
        assert!(GpuBackwardStrategy::TwoTraversals.is_deterministic());
        assert!(GpuBackwardStrategy::KvOwnerDeterministic.is_deterministic());
        assert!(!GpuBackwardStrategy::KvOwnerAtomic.is_deterministic());
    }
}
