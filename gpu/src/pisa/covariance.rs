//! PISA's covariance-aware block selection (E24) on the GPU: BSA's selector with each block's score raised by how far
//! its keys' spread around their mean moves the values, so that a block whose first-order tail would be poor is
//! preferred for exact attention. `gpu/kernels/pisa_covariance.cu` and the hooks it fills in `bsa_select.cu`,
//! behind typed wrappers, from device buffers ([`covariance_select_device`]) or host tensors ([`covariance_select`]).
//!
//! # The rule
//!
//! The oracle's `attnproof_oracle::pisa::covariance_block_scores`, whose [`CovarianceConfig`] this takes: BSA's
//! per-query-block convention (`crate::block_sparse::select`: mean-pooled queries `q̄_{a,h}` per query block and
//! query head, the key blocks' means `μ_b`, the GQA group sum, causal eligibility, forced blocks, top-k with ties to
//! the lower index) applied to E24's score in log form,
//! `S_ab = Σ_{h ∈ group} [α q̄_{a,h}·μ_b + ln(n_b + γ|α| ‖q̄_{a,h}‖ s_b)]`, with `n_b` the block's key count and `s_b`
//! its *spread*: `‖H_b − H̄‖₂` estimated by exactly `E24_POWER_STEPS` steps of power iteration from the all-ones
//! vector (a fixed number of steps is one function of the matrix, which the harness bounds in any precision; a
//! stopping rule is not). `γ = 0` ranks as BSA does, up to `G·ln n_b` on a short last block.
//!
//! # Kernels and memory
//!
//! BSA's pooling first (the key blocks' f64 means `μ_b` and the query blocks' pooled queries); then `H̄` in f64 from
//! the centred products `(k_j − μ_b) v_jᵀ` (`pisa_covariance_hbar`, a CTA per range of 16 key blocks, and
//! `pisa_covariance_hbar_sum`: f64 sums, not the tail's tensor-core `Σ_j k_j v_jᵀ`, so that the spreads' bound stays
//! a few f64 roundings); `pisa_covariance_spread` (a CTA per key block) forms `H_b − H̄` in shared memory as f64
//! (`d · (dv + 1)` of them, hence [`MAX_SPREAD_SHARED_BYTES`]) and runs the power steps there;
//! `pisa_covariance_coefficients` (`γ|α|‖q̄_{a,h}‖`) and the selector follow. Every buffer is caller-owned
//! ([`CovarianceWorkspace`]); the spreads stay in it for the caller (and the harness, which checks them against the
//! oracle's).

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::pisa::{CovarianceConfig, E24_POWER_STEPS};
use attnproof_oracle::spec::Operand;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::{Array3, Array4, ArrayViewD};

use crate::block_sparse::select::{self, Plan, SelectLaunch, grid, launch_pooling};
use crate::block_sparse::{BlockLists, ListHeads};
use crate::common::{GpuElement, check_len, grid_3d, to_i32};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::flash::host_input;
use crate::launch;

/// `gpu/kernels/pisa_covariance.cu` after the shared helpers and before the block selector, whose hooks it fills.
pub const PISA_COVARIANCE: KernelSource = KernelSource {
    name: "pisa_covariance",
    source: concat!(
        include_str!("../../kernels/common.cuh"),
        include_str!("../../kernels/pisa_covariance.cu"),
        include_str!("../../kernels/bsa_select.cu")
    ),
};

/// Threads of `pisa_covariance_spread` (its `SPREAD_THREADS`: each owns at most one row and one column of
/// `H_b − H̄`, so both head dims are at most this), its warps and its staged keys per step (`SPREAD_CHUNK`).
const SPREAD_THREADS: u32 = 256;
const SPREAD_WARPS: usize = 8;
const SPREAD_CHUNK: usize = 8;
/// Threads per CTA of `pisa_covariance_coefficients` and `pisa_covariance_hbar_sum` (its `COEFFICIENT_THREADS`), one
/// per entry.
const COEFFICIENT_THREADS: u32 = 128;
/// Key blocks per partial sum of `H̄` (the kernel's `RANGE_BLOCKS`).
pub const RANGE_BLOCKS: usize = 16;

/// The most dynamic shared memory `pisa_covariance_spread` may ask for: an H100's or H200's opt-in limit per CTA.
pub const MAX_SPREAD_SHARED_BYTES: usize = 227 * 1024;

/// Dynamic shared memory of `pisa_covariance_spread` and `pisa_covariance_hbar` for head dims `d`, `dv`: `H_b − H̄`
/// with rows padded by one f64, a chunk of deviations and values, the two vectors and the reduction's scratch, all
/// f64.
pub fn spread_shared_bytes(d: usize, dv: usize) -> usize {
    8 * (d * (dv + 1) + SPREAD_CHUNK * (d + dv) + d + dv + SPREAD_WARPS)
}

/// The defines of [`PISA_COVARIANCE`]: the storage type and the oracle's number of power steps.
pub fn covariance_defines<T: GpuElement>() -> Vec<String> {
    vec![T::DEFINE.to_owned(), format!("E24_POWER_STEPS={E24_POWER_STEPS}")]
}

/// Everything checked before any launch: BSA's plan of the lists (mask, block sizes, width), `γ`, and head dims the
/// spread kernel holds.
fn plan(spec: &AttentionSpec, config: &CovarianceConfig) -> Result<Plan, GpuError> {
    spec.validate()?;
    config.validate()?;
    let plan = select::plan_lists(spec, &config.bsa)?;
    let (d, dv) = (spec.head_dim, spec.head_dim_v);
    if d > SPREAD_THREADS as usize || dv > SPREAD_THREADS as usize {
        return Err(GpuError::Unsupported {
            argument: "head_dim",
            reason: format!("E24's spreads take head dims up to {SPREAD_THREADS}, not d = {d}, dv = {dv}"),
        });
    }
    if spread_shared_bytes(d, dv) > MAX_SPREAD_SHARED_BYTES {
        return Err(GpuError::Unsupported {
            argument: "head_dim",
            reason: format!(
                "E24's spreads hold H_b − H̄ in shared memory as f64: d = {d}, dv = {dv} need {} bytes, more than {}",
                spread_shared_bytes(d, dv),
                MAX_SPREAD_SHARED_BYTES
            ),
        });
    }
    Ok(plan)
}

/// Elements of the spreads `[B, Hkv, key blocks of the longest sequence]` and of the coefficients `[B, Hq, query
/// blocks of the longest sequence]`.
pub fn spreads_len(spec: &AttentionSpec, config: &CovarianceConfig) -> usize {
    let key_blocks = spec.sequences().iter().map(|s| config.bsa.key_blocks(s)).max().unwrap_or(0);
    spec.sequences().len() * spec.n_heads_kv * key_blocks
}

/// Ranges of [`RANGE_BLOCKS`] key blocks of the longest sequence: `H̄`'s partial sums per (sequence, KV head).
fn hbar_ranges(spec: &AttentionSpec, config: &CovarianceConfig) -> usize {
    spec.sequences().iter().map(|s| config.bsa.key_blocks(s)).max().unwrap_or(0).div_ceil(RANGE_BLOCKS)
}

/// Elements of `H̄`'s buffer: the partial sums `[ranges, B, Hkv, d, dv]`, then `H̄` `[B, Hkv, d, dv]`.
pub fn hbar_len(spec: &AttentionSpec, config: &CovarianceConfig) -> usize {
    (hbar_ranges(spec, config) + 1) * spec.sequences().len() * spec.n_heads_kv * spec.head_dim * spec.head_dim_v
}

/// Elements of the coefficients `γ|α|‖q̄_{a,h}‖`, `[B, Hq, query blocks of the longest sequence]`.
pub fn coefficients_len(spec: &AttentionSpec, config: &CovarianceConfig) -> usize {
    let query_blocks = spec.sequences().iter().map(|s| config.bsa.query_blocks(s)).max().unwrap_or(0);
    spec.sequences().len() * spec.n_heads_q * query_blocks
}

/// The caller-owned buffers of one selection, all f64: BSA's pooled keys and queries, `H̄` and its partial sums, the
/// spreads (read back by callers who want them) and the coefficients.
pub struct CovarianceWorkspace {
    /// BSA's pooled keys and queries (`crate::block_sparse::select::workspace_len`).
    pub pooled: CudaSlice<f64>,
    /// `H̄`'s partial sums and `H̄` ([`hbar_len`]).
    pub hbar: CudaSlice<f64>,
    /// `s_b`, `[B, Hkv, n_k]` ([`spreads_len`]); 0 past a sequence's blocks.
    pub spreads: CudaSlice<f64>,
    /// `γ|α|‖q̄_{a,h}‖`, `[B, Hq, n_q]` ([`coefficients_len`]).
    pub coefficients: CudaSlice<f64>,
}

impl CovarianceWorkspace {
    /// Zeroed buffers for `spec` under `config`.
    pub fn alloc(stream: &Arc<CudaStream>, spec: &AttentionSpec, config: &CovarianceConfig) -> Result<Self, GpuError> {
        let alloc = |n: usize| stream.alloc_zeros::<f64>(n.max(1)).map_err(|e| GpuError::driver("cuMemAlloc", e));
        Ok(CovarianceWorkspace {
            pooled: alloc(select::workspace_len(spec, &config.bsa))?,
            hbar: alloc(hbar_len(spec, config))?,
            spreads: alloc(spreads_len(spec, config))?,
            coefficients: alloc(coefficients_len(spec, config))?,
        })
    }
}

/// Selects the blocks of `spec` under `config` on device buffers (`q`, `k`, `v` in the spec's layout) with the text
/// `kernel` of [`PISA_COVARIANCE`]: the lists go to the first `crate::block_sparse::select::lists_shape` elements of
/// `lists`, the spreads to `work.spreads`. Every check runs before the first launch; the launches are asynchronous on
/// `stream`.
#[allow(clippy::too_many_arguments)]
pub fn covariance_select_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &CovarianceConfig,
    kernel: KernelSource,
    (q, k, v): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    work: &mut CovarianceWorkspace,
    lists: &mut CudaSlice<i32>,
) -> Result<(), GpuError> {
    let plan = plan(spec, config)?;
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_len("q", q, size(Operand::Q))?;
    check_len("k", k, size(Operand::K))?;
    check_len("v", v, size(Operand::V))?;
    check_len("work.pooled", &work.pooled, select::workspace_len(spec, &config.bsa))?;
    check_len("work.hbar", &work.hbar, hbar_len(spec, config))?;
    check_len("work.spreads", &work.spreads, spreads_len(spec, config))?;
    check_len("work.coefficients", &work.coefficients, coefficients_len(spec, config))?;
    check_len("lists", lists, select::lists_shape(spec, &config.bsa).iter().product())?;
    if plan.batch == 0 || spec.n_heads_kv == 0 || plan.key_blocks == 0 {
        return Ok(());
    }
    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &covariance_defines::<T>())?;
    let load = |name: &'static str| {
        module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(pisa_covariance.cu)", e))
    };
    let selector = SelectLaunch::of(&plan, spec.head_dim, config.bsa.top_k);
    let (hbar, hbar_sum, spread) =
        (load("pisa_covariance_hbar")?, load("pisa_covariance_hbar_sum")?, load("pisa_covariance_spread")?);
    let coefficients = load("pisa_covariance_coefficients")?;
    let (pool_keys, pool_queries, select) = (load("bsa_pool_keys")?, load("bsa_pool_queries")?, load(selector.entry)?);
    let spread_bytes = spread_shared_bytes(spec.head_dim, spec.head_dim_v);
    compile::allow_shared_memory(ctx, &hbar, spread_bytes, "head dims")?;
    compile::allow_shared_memory(ctx, &spread, spread_bytes, "head dims")?;
    compile::allow_shared_memory(ctx, &select, selector.shared_bytes, "key blocks")?;

    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e));
    let (cu_q, cu_k) = (up(&plan.cu_q)?, up(&plan.cu_k)?);
    // The means first (and the pooled queries: the lists' scores read both); the spreads are an output of their own,
    // written for every key block whether or not a query block reads them.
    launch_pooling(stream, spec, &plan, (&pool_keys, &pool_queries), (q, k), &mut work.pooled, (&cu_q, &cu_k))?;
    let ranges = hbar_ranges(spec, config);
    let counts = (to_i32("sequences", plan.batch)?, to_i32("H̄'s ranges", ranges)?);
    let heads_grid =
        |x: usize, name: &'static str| grid_3d((name, x), ("heads", spec.n_heads_kv), ("sequences", plan.batch));
    let cfg = |grid: (u32, u32, u32), threads: u32, shared: usize| LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let entries_hbar = (spec.head_dim * spec.head_dim_v).div_ceil(COEFFICIENT_THREADS as usize);
    for (func, launch) in [
        (&hbar, cfg(heads_grid(ranges, "H̄'s ranges")?, SPREAD_THREADS, spread_bytes)),
        (&hbar_sum, cfg(heads_grid(entries_hbar, "H̄'s entries")?, COEFFICIENT_THREADS, 0)),
        (&spread, cfg(heads_grid(plan.key_blocks, "key blocks")?, SPREAD_THREADS, spread_bytes)),
    ] {
        let buffers = (&work.pooled, &mut work.hbar, &mut work.spreads);
        launch::launch_covariance_statistics(stream, func, launch, (k, v), buffers, &cu_k, &plan.params, counts)?;
    }
    if plan.query_blocks == 0 {
        return Ok(());
    }
    let entries = coefficients_len(spec, config);
    let cfg = LaunchConfig {
        grid_dim: (to_i32("coefficients", entries.div_ceil(COEFFICIENT_THREADS as usize))? as u32, 1, 1),
        block_dim: (COEFFICIENT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let gamma_scale = config.gamma * plan.params.scale.abs();
    let batch = to_i32("sequences", plan.batch)?;
    let coefficient_args = (&work.pooled, &mut work.coefficients);
    launch::launch_covariance_coefficients(
        stream,
        &coefficients,
        cfg,
        coefficient_args,
        &plan.params,
        batch,
        gamma_scale,
    )?;
    let cfg = LaunchConfig {
        grid_dim: grid(selector.grid_x(plan.query_blocks), spec.n_heads_kv, plan.batch)?,
        block_dim: (selector.threads, 1, 1),
        shared_mem_bytes: selector.shared_bytes as u32,
    };
    let terms = (&work.spreads, &work.coefficients);
    launch::launch_covariance_select(stream, &select, cfg, (&work.pooled, lists), (&cu_q, &cu_k), &plan.params, terms)
}

/// What [`covariance_select`] returns: the lists, per KV head, and the spreads the scores used.
#[derive(Clone, Debug, PartialEq)]
pub struct CovarianceSelection {
    /// The lists, ready for the block-sparse forward.
    pub lists: BlockLists,
    /// `s_b`, `[B, Hkv, n_k]`.
    pub spreads: Array3<f64>,
}

/// Selects the blocks from host tensors (copies in, launches, copies out, synchronizes).
pub fn covariance_select<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &CovarianceConfig,
    q: ArrayViewD<'_, T>,
    k: ArrayViewD<'_, T>,
    v: ArrayViewD<'_, T>,
) -> Result<CovarianceSelection, GpuError> {
    plan(spec, config)?;
    let (dq, dk) = select::upload_queries_and_keys(stream, spec, q, k)?;
    let hv = host_input(spec, "v", Operand::V, &v)?;
    let dv = stream.clone_htod(hv).map_err(|e| GpuError::driver("cuMemcpyHtoD", e))?;
    let mut work = CovarianceWorkspace::alloc(stream, spec, config)?;
    let shape = select::lists_shape(spec, &config.bsa);
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let mut lists = stream.alloc_zeros::<i32>(shape.iter().product::<usize>().max(1)).map_err(alloc_err)?;
    covariance_select_device(stream, spec, config, PISA_COVARIANCE, (&dq, &dk, &dv), &mut work, &mut lists)?;
    let read = |e| GpuError::driver("cuMemcpyDtoH", e);
    let mut host_lists = stream.clone_dtoh(&lists).map_err(read)?;
    let mut spreads = stream.clone_dtoh(&work.spreads).map_err(read)?;
    stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
    host_lists.truncate(shape.iter().product());
    spreads.truncate(spreads_len(spec, config));
    let key_blocks = spec.sequences().iter().map(|s| config.bsa.key_blocks(s)).max().unwrap_or(0);
    Ok(CovarianceSelection {
        lists: BlockLists {
            q_block: config.bsa.q_block,
            kv_block: config.bsa.kv_block,
            heads: ListHeads::PerKvHead,
            lists: Array4::from_shape_vec(shape, host_lists).expect("length matches the shape"),
        },
        spreads: Array3::from_shape_vec((spec.sequences().len(), spec.n_heads_kv, key_blocks), spreads)
            .expect("length matches the shape"),
    })
}

/// The checks every launch makes, without a device: for tests that hold a shape to the wrappers' typed errors.
pub fn check_selection(spec: &AttentionSpec, config: &CovarianceConfig) -> Result<(), GpuError> {
    plan(spec, config).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::Mask;
    use attnproof_oracle::bsa::BsaConfig;

    fn config(gamma: f64) -> CovarianceConfig {
        CovarianceConfig {
            bsa: BsaConfig { q_block: 64, kv_block: 64, top_k: 3, force_first: true, force_local: 1 },
            gamma,
        }
    }

    #[test]
    fn plans_check_gamma_head_dims_and_bsa_rules() {
        let spec = AttentionSpec::dense(2, 6, 2, 300, 300, 128, 128).with_mask(Mask::Causal);
        assert!(check_selection(&spec, &config(0.5)).is_ok());
        assert_eq!(spreads_len(&spec, &config(0.5)), 2 * 2 * 5);
        assert_eq!(coefficients_len(&spec, &config(0.5)), 2 * 6 * 5);
        for gamma in [-1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(check_selection(&spec, &config(gamma)), Err(GpuError::Spec(_))), "{gamma}");
        }
        // 192 × 128 fits (the E31 shape); 256 × 256 does not, and is refused before any launch.
        let e31 = AttentionSpec::dense(1, 2, 1, 300, 300, 192, 128);
        assert!(spread_shared_bytes(192, 128) <= MAX_SPREAD_SHARED_BYTES);
        assert!(check_selection(&e31, &config(1.0)).is_ok());
        let wide = AttentionSpec::dense(1, 2, 1, 300, 300, 256, 256);
        assert!(matches!(
            check_selection(&wide, &config(1.0)),
            Err(GpuError::Unsupported { argument: "head_dim", .. })
        ));
        let window = spec.clone().with_mask(Mask::Window { left: 3, right: 0 });
        assert!(matches!(check_selection(&window, &config(1.0)), Err(GpuError::Unsupported { argument: "mask", .. })));
        let wide_list = CovarianceConfig { bsa: BsaConfig { top_k: 6, ..config(1.0).bsa }, gamma: 1.0 };
        assert!(matches!(check_selection(&spec, &wide_list), Err(GpuError::Unsupported { argument: "top_k", .. })));
    }

    #[test]
    fn the_spread_kernels_shared_memory_is_its_layout() {
        // d = dv = 128: M 128 × 129, 8 × 256 staged, the two vectors (128 + 128), 8 warps.
        assert_eq!(spread_shared_bytes(128, 128), 8 * (128 * 129 + 8 * 256 + 256 + 8));
    }
}
