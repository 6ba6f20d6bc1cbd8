//! Pyramid Top-K block selection on the GPU (PISA: E25–E28): `gpu/kernels/pisa_select.cu` behind typed wrappers, from
//! device buffers ([`select_pyramid_device`]) or host tensors ([`select_pyramid`]).
//!
//! # The rule
//!
//! The oracle's (`attnproof_oracle::pyramid`: [`PyramidConfig`], `descend`) applied to one query block at a time:
//! the block's query is, per query head, the mean of its rows (the pooled query of BSA's selector,
//! [`crate::block_sparse::select`]), at the block's last visible position (bottom-right causal: row `min(Lq, (a + 1)
//! · q_block) − 1` sees keys up to `Lk − Lq` further; without a mask every key of the sequence). Leaves are the lists'
//! key blocks (`C` = 64 or 128 keys); every node's summary is the mean of the raw keys it covers; the descent scores
//! the sequence's root, keeps `K` (the forced first, previous and current leaves' ancestors first), expands their
//! children, and so on down to the leaves; scores are summed over each KV head's query heads; candidates that start
//! after the position are not scored; ties go to the lower node. The lists have `max(K, 3)` entries (the oracle's
//! `selection_width`). BSA's own scoring has no hierarchy: [`crate::block_sparse::select`] is its selector.
//!
//! # Precision and exactness
//!
//! Every score is an f64 evaluation in a fixed order (the kernel's header spells it out), so nodes with bitwise equal
//! contents score bitwise equal and tie exactly, as in the oracle. The optional trace ([`PyramidTrace`]) holds every
//! level's candidates and their scores: `attnproof_harness::pyramid_selection` replays the descent from the kernel's
//! own scores with the oracle's top-k and requires the lists to equal the replay's entry for entry, and holds each
//! score to the bound of `attnproof_proofs::pyramid_bound` around the oracle's.
//!
//! # Memory
//!
//! A caller-owned f64 workspace of [`workspace_len`] elements holds the leaves' and the query blocks' means (as BSA's
//! selector lays them out) and then every coarser level's means. One warp per (query block, KV head, sequence) holds
//! that block's group of pooled queries (`group · d` f64, at most [`MAX_GROUP_COLUMNS`]; PISA-1 sums the group first
//! and holds `d`) and one level's candidates.

use std::sync::Arc;

use attnproof_oracle::bsa::BsaConfig;
use attnproof_oracle::pyramid::{PyramidConfig, Scoring};
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Scale};
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::{Array4, Array5, ArrayViewD};

use crate::block_sparse::select::{self as bsa, POOL_THREADS};
use crate::block_sparse::{BlockLists, ListHeads};
use crate::common::{GpuElement, check_len, to_i32};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::launch::{self, PisaTrace};
use crate::params::PisaParams;

/// `gpu/kernels/pisa_select.cu` after the shared helpers and the block selector, whose pooling it reuses.
pub const PISA_SELECT: KernelSource = KernelSource {
    name: "pisa_select",
    source: concat!(
        include_str!("../../kernels/common.cuh"),
        include_str!("../../kernels/bsa_select.cu"),
        include_str!("../../kernels/pisa_select.cu")
    ),
};

/// The largest branching factor `β`: a lane of `pisa_select` scores at most 4 items of a node (`PISA_ITEMS_PER_LANE`).
pub const MAX_BRANCHING: usize = 16;
/// The largest `K`: a warp of `pisa_select` holds a level's `K · β` candidates in shared memory.
pub const MAX_KEEP: usize = 64;
/// The largest `group · d`: the pooled queries a warp holds in shared memory (128 KiB of f64).
pub const MAX_GROUP_COLUMNS: usize = 16384;

/// Warps per CTA of `pisa_select` at most (the kernel's `PISA_THREADS` / 32): one warp per query block.
const MAX_SELECT_WARPS: usize = 8;
/// The shared memory a CTA of `pisa_select` is sized to: as many warps' slices as fit (at most
/// [`MAX_SELECT_WARPS`]), or one warp's however large, so that several CTAs share an SM.
const SELECT_SHARED_TARGET: usize = 48 * 1024;

/// Bytes of shared memory one warp of `pisa_select` holds (the kernel's `pisa_warp_bytes`): its query columns (`d`
/// for PISA-1, whose group is summed first, else `group · d`) and a level's scores in f64, a level's candidates and
/// the kept nodes in i32, rounded up to 8 bytes.
fn warp_shared_bytes(spec: &AttentionSpec, pyramid: &PyramidConfig) -> usize {
    let q_cols = if pyramid.scoring == Scoring::Pisa1 { 1 } else { spec.group_size() } * spec.head_dim;
    let width = pyramid.selection_width();
    let candidates = width * pyramid.branching;
    (8 * (q_cols + candidates) + 4 * (candidates + width)).next_multiple_of(8)
}

/// Warps per CTA of `pisa_select` for slices of `per_warp` bytes and `query_blocks` query blocks.
fn select_warps(per_warp: usize, query_blocks: usize) -> usize {
    (SELECT_SHARED_TARGET / per_warp.max(1)).clamp(1, MAX_SELECT_WARPS).min(query_blocks.max(1))
}

/// What the pyramid selector is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyramidSelectConfig {
    /// Query rows per query block (64 or 128): the block's mean-pooled queries stand for its rows.
    pub q_block: usize,
    /// The pyramid: the leaf size `C` (the lists' key block, 64 or 128), the branching `β` (2 to [`MAX_BRANCHING`]),
    /// the nodes kept per level `K` (1 to [`MAX_KEEP`]) and the scoring (LSE, PISA-1 or PISA-2).
    pub pyramid: PyramidConfig,
}

impl PyramidSelectConfig {
    /// The block selector's view of the same lists: query blocks, key blocks of `C` keys, `max(K, 3)` entries.
    fn lists_config(&self) -> BsaConfig {
        BsaConfig {
            q_block: self.q_block,
            kv_block: self.pyramid.leaf_size,
            top_k: self.pyramid.selection_width(),
            force_first: false,
            force_local: 0,
        }
    }
}

/// The kernel's code of a scoring (`PISA_LSE`, `PISA_ONE`, `PISA_TWO`).
fn scoring_code(scoring: Scoring) -> Result<i32, GpuError> {
    match scoring {
        Scoring::Lse => Ok(0),
        Scoring::Pisa1 => Ok(1),
        Scoring::Pisa2 => Ok(2),
        Scoring::Bsa => Err(GpuError::Unsupported {
            argument: "scoring",
            reason: "BSA scores leaves only, without a pyramid: block_sparse::select is its selector".into(),
        }),
    }
}

/// Everything a launch needs, derived from a validated spec and configuration.
struct Plan {
    lists: bsa::Plan,
    params: PisaParams,
    /// Nodes per level of the longest sequence's pyramid, leaves first, root last.
    widths: Vec<usize>,
}

/// Nodes per level over `leaves` leaves with branching `branching`: `⌈leaves / β^ℓ⌉` until one remains.
fn level_widths(leaves: usize, branching: usize) -> Vec<usize> {
    let mut widths = vec![leaves];
    while let Some(&w) = widths.last().filter(|&&w| w > 1) {
        widths.push(w.div_ceil(branching));
    }
    widths
}

fn plan(spec: &AttentionSpec, config: &PyramidSelectConfig) -> Result<Plan, GpuError> {
    let pyramid = &config.pyramid;
    pyramid.validate()?;
    let scoring = scoring_code(pyramid.scoring)?;
    if pyramid.branching > MAX_BRANCHING {
        return Err(GpuError::Unsupported {
            argument: "branching",
            reason: format!("{} children per node; the kernel takes 2 to {MAX_BRANCHING}", pyramid.branching),
        });
    }
    if pyramid.keep > MAX_KEEP {
        return Err(GpuError::Unsupported {
            argument: "keep",
            reason: format!("{} nodes per level; the kernel keeps 1 to {MAX_KEEP}", pyramid.keep),
        });
    }
    if spec.scale != Scale::InverseSqrtHeadDim {
        return Err(GpuError::Unsupported {
            argument: "scale",
            reason: "the pyramid's scores are E26's, scaled by 1/√d; another softmax scale does not change them".into(),
        });
    }
    let lists_config = config.lists_config();
    let leaves = spec.sequences().iter().map(|s| lists_config.key_blocks(s)).max().unwrap_or(0);
    let width = pyramid.selection_width();
    if width > leaves {
        return Err(GpuError::Unsupported {
            argument: "keep",
            reason: format!(
                "lists of {width} entries (max(K, 3)) are wider than the {leaves} leaves of the longest sequence"
            ),
        });
    }
    if spec.group_size() * spec.head_dim > MAX_GROUP_COLUMNS {
        return Err(GpuError::Unsupported {
            argument: "group",
            reason: format!(
                "{} query heads per KV head of {} columns exceed the {MAX_GROUP_COLUMNS} pooled-query values a CTA holds",
                spec.group_size(),
                spec.head_dim
            ),
        });
    }
    let lists = bsa::plan(spec, &lists_config)?;
    let widths = level_widths(lists.key_blocks, pyramid.branching);
    let levels_at = bsa::workspace_len(spec, &lists_config);
    let params = PisaParams {
        bsa: lists.params,
        levels_at: i64::try_from(levels_at)
            .map_err(|_| GpuError::TooLarge { argument: "workspace", value: levels_at })?,
        batch: to_i32("sequences", lists.batch)?,
        branching: to_i32("branching", pyramid.branching)?,
        keep: to_i32("keep", pyramid.keep)?,
        scoring,
        n_levels: to_i32("levels", widths.len())?,
        max_candidates: to_i32("candidates", width * pyramid.branching)?,
    };
    Ok(Plan { lists, params, widths })
}

/// f64 elements of the workspace for `spec` and `config`: the block selector's (leaves' means `[B, Hkv, leaves, d]`,
/// then the query blocks' `[B, Hq, query blocks, d]`), then every coarser level's means `[B, Hkv, width, d]`, widths
/// those of the longest sequence. 0 where `config` does not fit `spec` (the wrappers say why).
pub fn workspace_len(spec: &AttentionSpec, config: &PyramidSelectConfig) -> usize {
    let lists_config = config.lists_config();
    let leaves = spec.sequences().iter().map(|s| lists_config.key_blocks(s)).max().unwrap_or(0);
    let coarser: usize = level_widths(leaves, config.pyramid.branching.max(2)).iter().skip(1).sum();
    bsa::workspace_len(spec, &lists_config) + spec.sequences().len() * spec.n_heads_kv * coarser * spec.head_dim
}

/// The lists' shape: `[B, Hkv, ⌈max Lq / q_block⌉, max(K, 3)]`.
pub fn lists_shape(spec: &AttentionSpec, config: &PyramidSelectConfig) -> [usize; 4] {
    bsa::lists_shape(spec, &config.lists_config())
}

/// The trace's shape: `[B, Hkv, query blocks, levels, max(K, 3) · β]`, levels of the longest sequence's pyramid
/// (leaves at 0) and each level's candidates at most.
pub fn trace_shape(spec: &AttentionSpec, config: &PyramidSelectConfig) -> [usize; 5] {
    let [b, heads, query_blocks, width] = lists_shape(spec, config);
    let leaves = spec.sequences().iter().map(|s| config.lists_config().key_blocks(s)).max().unwrap_or(0);
    let levels = level_widths(leaves, config.pyramid.branching.max(2)).len();
    [b, heads, query_blocks, levels, width * config.pyramid.branching]
}

/// Every level's candidates and their scores, per (sequence, KV head, query block): `nodes[.., level, i]` is the
/// `i`-th candidate of that level, ascending, then `−1`; `scores` its score summed over the group (NaN for a candidate
/// that starts after the query block's position, which is never scored, and for padding). Levels above a sequence's
/// own root, and rows that see no key, hold only padding.
#[derive(Clone, Debug, PartialEq)]
pub struct PyramidTrace {
    /// Candidate nodes, `[B, Hkv, query blocks, levels, candidates]`.
    pub nodes: Array5<i32>,
    /// Their scores, same shape.
    pub scores: Array5<f64>,
}

/// The lists and the trace of one selection from host tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct PyramidSelection {
    /// The lists, per KV head, for the block-sparse forward.
    pub lists: BlockLists,
    /// What the descent scored and kept at every level.
    pub trace: PyramidTrace,
}

/// Selects the blocks of `spec` under `config` on device buffers: `q`, `k` hold Q and K in the spec's layout,
/// `pooled` at least [`workspace_len`] f64 (overwritten), the lists go to the first [`lists_shape`] elements of
/// `lists`, and with `trace` (scores, nodes) every level's candidates to the first [`trace_shape`] elements of each.
/// Every check runs before the first launch; the launches are asynchronous on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn select_pyramid_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &PyramidSelectConfig,
    kernel: KernelSource,
    (q, k): (&CudaSlice<T>, &CudaSlice<T>),
    pooled: &mut CudaSlice<f64>,
    lists: &mut CudaSlice<i32>,
    trace: PisaTrace<'_>,
) -> Result<(), GpuError> {
    let plan = plan(spec, config)?;
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_len("q", q, size(Operand::Q))?;
    check_len("k", k, size(Operand::K))?;
    check_len("pooled", pooled, workspace_len(spec, config))?;
    check_len("lists", lists, lists_shape(spec, config).iter().product())?;
    if let Some((scores, nodes)) = &trace {
        let entries = trace_shape(spec, config).iter().product();
        check_len("trace scores", *scores, entries)?;
        check_len("trace nodes", *nodes, entries)?;
    }
    if plan.lists.query_blocks == 0 || plan.lists.batch == 0 || spec.n_heads_kv == 0 {
        return Ok(());
    }
    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &[T::DEFINE.to_owned()])?;
    let load = |name: &'static str| {
        module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(pisa_select.cu)", e))
    };
    let (pool_keys, pool_queries) = (load("bsa_pool_keys")?, load("bsa_pool_queries")?);
    // PISA-1's descent has its own entry point (its registers are not the pooled scorings' loop's).
    let entry = if config.pyramid.scoring == Scoring::Pisa1 { "pisa_select_mean" } else { "pisa_select" };
    let (pool_level, select) = (load("pisa_pool_level")?, load(entry)?);
    let per_warp = warp_shared_bytes(spec, &config.pyramid);
    let warps = select_warps(per_warp, plan.lists.query_blocks);
    let shared_bytes = warps * per_warp;
    compile::allow_shared_memory(ctx, &select, shared_bytes, "group")?;
    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e));
    let (cu_q, cu_k) = (up(&plan.lists.cu_q)?, up(&plan.lists.cu_k)?);
    bsa::launch_pooling(stream, spec, &plan.lists, (&pool_keys, &pool_queries), (q, k), pooled, (&cu_q, &cu_k))?;
    for (level, &width) in plan.widths.iter().enumerate().skip(1) {
        let cfg = LaunchConfig {
            grid_dim: bsa::grid(width, spec.n_heads_kv, plan.lists.batch)?,
            block_dim: (POOL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch::launch_pisa_pool_level(stream, &pool_level, cfg, pooled, &cu_k, &plan.params, to_i32("level", level)?)?;
    }
    let cfg = LaunchConfig {
        grid_dim: bsa::grid(plan.lists.query_blocks.div_ceil(warps), spec.n_heads_kv, plan.lists.batch)?,
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: shared_bytes as u32,
    };
    launch::launch_pisa_select(stream, &select, cfg, (k, pooled), lists, (&cu_q, &cu_k), trace, &plan.params)
}

/// Selects the blocks from host tensors (copies in, launches, copies out, synchronizes): the lists per KV head, ready
/// for the block-sparse forward, and the descent's trace.
pub fn select_pyramid<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &PyramidSelectConfig,
    q: ArrayViewD<'_, T>,
    k: ArrayViewD<'_, T>,
) -> Result<PyramidSelection, GpuError> {
    spec.validate()?;
    plan(spec, config)?;
    let (dq, dk) = bsa::upload_queries_and_keys(stream, spec, q, k)?;
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let mut pooled = stream.alloc_zeros::<f64>(workspace_len(spec, config).max(1)).map_err(alloc_err)?;
    let shape = lists_shape(spec, config);
    let mut lists = stream.alloc_zeros::<i32>(shape.iter().product::<usize>().max(1)).map_err(alloc_err)?;
    let tshape = trace_shape(spec, config);
    let entries: usize = tshape.iter().product();
    let mut scores = stream.alloc_zeros::<f64>(entries.max(1)).map_err(alloc_err)?;
    let mut nodes = stream.alloc_zeros::<i32>(entries.max(1)).map_err(alloc_err)?;
    select_pyramid_device(
        stream,
        spec,
        config,
        PISA_SELECT,
        (&dq, &dk),
        &mut pooled,
        &mut lists,
        Some((&mut scores, &mut nodes)),
    )?;
    let down = |e| GpuError::driver("cuMemcpyDtoH", e);
    let mut host_lists = stream.clone_dtoh(&lists).map_err(down)?;
    let mut host_scores = stream.clone_dtoh(&scores).map_err(down)?;
    let mut host_nodes = stream.clone_dtoh(&nodes).map_err(down)?;
    stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
    host_lists.truncate(shape.iter().product());
    host_scores.truncate(entries);
    host_nodes.truncate(entries);
    let lists = Array4::from_shape_vec(shape, host_lists).expect("length matches the shape");
    let trace = PyramidTrace {
        nodes: Array5::from_shape_vec(tshape, host_nodes).expect("length matches the shape"),
        scores: Array5::from_shape_vec(tshape, host_scores).expect("length matches the shape"),
    };
    Ok(PyramidSelection {
        lists: BlockLists {
            q_block: config.q_block,
            kv_block: config.pyramid.leaf_size,
            heads: ListHeads::PerKvHead,
            lists,
        },
        trace,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::{Layout, Mask};

    fn config(keep: usize, branching: usize, scoring: Scoring) -> PyramidSelectConfig {
        PyramidSelectConfig { q_block: 64, pyramid: PyramidConfig { leaf_size: 64, branching, keep, scoring } }
    }

    #[test]
    fn level_widths_shrink_to_one_root() {
        assert_eq!(level_widths(1, 2), [1]);
        assert_eq!(level_widths(6, 2), [6, 3, 2, 1]);
        assert_eq!(level_widths(17, 4), [17, 5, 2, 1]);
        assert_eq!(level_widths(16, 16), [16, 1]);
    }

    #[test]
    fn plans_check_the_pyramid_and_size_the_buffers() {
        // 1000 keys in leaves of 64: 16 leaves, β = 4: widths 16, 4, 1.
        let spec = AttentionSpec::dense(2, 6, 2, 900, 1000, 64, 64).with_mask(Mask::Causal);
        let p = plan(&spec, &config(4, 4, Scoring::Lse)).unwrap();
        assert_eq!(p.widths, [16, 4, 1]);
        assert_eq!((p.params.n_levels, p.params.max_candidates, p.params.keep, p.params.scoring), (3, 16, 4, 0));
        assert_eq!((p.params.bsa.top_k, p.params.bsa.kv_block, p.params.bsa.force_first), (4, 64, 0));
        let bsa_len = 2 * 64 * (2 * 16 + 6 * 15);
        assert_eq!(p.params.levels_at, bsa_len as i64);
        assert_eq!(workspace_len(&spec, &config(4, 4, Scoring::Lse)), bsa_len + 2 * 2 * (4 + 1) * 64);
        assert_eq!(lists_shape(&spec, &config(4, 4, Scoring::Lse)), [2, 2, 15, 4]);
        assert_eq!(trace_shape(&spec, &config(4, 4, Scoring::Lse)), [2, 2, 15, 3, 16]);
        // K below 3 still lists the three forced leaves.
        assert_eq!(lists_shape(&spec, &config(1, 4, Scoring::Pisa2))[3], 3);
        assert_eq!(plan(&spec, &config(1, 2, Scoring::Pisa1)).unwrap().params.scoring, 1);
        let unsupported = |c: PyramidSelectConfig, s: &AttentionSpec| match plan(s, &c) {
            Err(GpuError::Unsupported { argument, .. }) => argument,
            other => panic!("{:?}", other.map(|p| p.widths)),
        };
        assert_eq!(unsupported(config(4, 4, Scoring::Bsa), &spec), "scoring");
        assert_eq!(unsupported(config(4, 17, Scoring::Lse), &spec), "branching");
        assert_eq!(unsupported(config(65, 2, Scoring::Lse), &spec), "keep");
        assert_eq!(unsupported(config(17, 2, Scoring::Lse), &spec), "keep");
        let wide_group = AttentionSpec::dense(1, 65, 1, 900, 1000, 256, 256).with_mask(Mask::Causal);
        assert_eq!(unsupported(config(4, 4, Scoring::Lse), &wide_group), "group");
        let leaf_32 = PyramidSelectConfig {
            pyramid: PyramidConfig { leaf_size: 32, ..config(4, 4, Scoring::Lse).pyramid },
            ..config(4, 4, Scoring::Lse)
        };
        assert_eq!(unsupported(leaf_32, &spec), "kv_block");
        let window = spec.clone().with_mask(Mask::Window { left: 3, right: 0 });
        assert_eq!(unsupported(config(4, 4, Scoring::Lse), &window), "mask");
        let scaled = AttentionSpec { scale: Scale::Value(0.5), ..spec.clone() };
        assert_eq!(unsupported(config(4, 4, Scoring::Lse), &scaled), "scale");
        assert!(matches!(plan(&spec, &config(4, 1, Scoring::Lse)), Err(GpuError::Spec(_))), "branching 1");
    }

    /// A warp's slice is the kernel's `pisa_warp_bytes` (query columns and scores in f64, candidates and kept nodes
    /// in i32, rounded up to 8 bytes); CTAs take as many slices as fit 48 KiB, one at least, 8 at most, never more
    /// than the query blocks.
    #[test]
    fn shared_memory_slices_size_the_ctas() {
        let spec = AttentionSpec::dense(1, 16, 2, 4096, 4096, 128, 128);
        // K = 8, β = 4: 32 candidates, 8 kept. PISA-1 holds d columns, the others the group's 8 · d.
        assert_eq!(warp_shared_bytes(&spec, &config(8, 4, Scoring::Pisa1).pyramid), 8 * (128 + 32) + 4 * (32 + 8));
        assert_eq!(warp_shared_bytes(&spec, &config(8, 4, Scoring::Lse).pyramid), 8 * (1024 + 32) + 4 * (32 + 8));
        // K = 1 lists three leaves; 3 · 3 candidates and 3 kept: 12 i32 round up to 48 bytes.
        assert_eq!(warp_shared_bytes(&spec, &config(1, 3, Scoring::Pisa1).pyramid), 8 * (128 + 9) + 48);
        assert_eq!(select_warps(1408, 64), 8);
        assert_eq!(select_warps(8608, 64), 5);
        assert_eq!(select_warps(140_000, 64), 1);
        assert_eq!(select_warps(1408, 3), 3);
        assert_eq!(select_warps(1408, 0), 1);
    }

    #[test]
    fn varlen_plans_take_the_longest_sequence() {
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 0, 300], cu_seqlens_k: vec![0, 130, 400] },
            ..AttentionSpec::dense(1, 3, 1, 1, 1, 32, 32)
        };
        let p = plan(&spec, &config(3, 2, Scoring::Lse)).unwrap();
        assert_eq!(p.widths, [5, 3, 2, 1]);
        assert_eq!((p.lists.query_blocks, p.lists.batch), (5, 2));
        assert_eq!(trace_shape(&spec, &config(3, 2, Scoring::Lse)), [2, 1, 5, 4, 6]);
    }
}
