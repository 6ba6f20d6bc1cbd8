//! DSA's token-sparse attention forward (E16's main attention over the indexer's selection) on the GPU:
//! `gpu/kernels/dsa_sparse.cu` behind typed wrappers, from device buffers ([`token_sparse_device`]) or host tensors
//! ([`token_sparse`]).
//!
//! Every token `t` attends, for each query head, to the tokens its list names, with one softmax over them (drop and
//! renormalize): `o_th = Σ_{s∈J_t} softmax_s(α q_th · k_s) v_s`, and the LSE beside it. This is dense attention under
//! the visibility `s ∈ J_t`, what the oracle's `dsa::token_sparse_attention` computes for one sequence with one KV
//! head; the layer here is any causal self-attention problem of the crate (batch or varlen, GQA of any group size,
//! MQA included, head dims multiples of 8 up to 256, bf16 or f16).
//!
//! # Lists
//!
//! `lists [token rows, list heads, top_k]` `i32` ([`TokenSelection::lists_shape`]): per token an ascending prefix of
//! distinct tokens of its own sequence, none after the token (`s ≤ t`), then `−1`: the rows `dsa::index` writes. One
//! list head shared by every KV head ([`ListSharing::Shared`], DSA's: one indexer per layer) or one per KV head
//! ([`ListSharing::PerKvHead`]). Host lists are validated ([`validate_token_lists`]); device lists are not (that would
//! cost a copy), and the kernel ends a list at its first entry that does not rise or lies after its token, so no list
//! can make it read outside its sequence's keys.
//!
//! # Schedule, and why the dense bound holds
//!
//! One CTA per (token, chunk of up to 64 query heads of a KV head's group, sequence) whose rows are the chunk's heads
//! ([`rows_per_cta`]), so each gathered K and V row is loaded once for all of them, as FlashMLA's sparse kernel does
//! for MQA. The CTA gathers its list's keys 64 slots at a time into one tile and runs the dense forward's step
//! (`gpu/kernels/flash_fwd.cu`'s recipe) on it, the last tile masked past the list's end. So each row performs the
//! dense forward's operations over at most [`visited_tiles`] tiles of [`KV_TILE`] keys: the dense forward's bound with
//! that many rescales.
//!
//! # Errors
//!
//! Before any launch: the layer (causal self-attention, head dims), the sizes against the kernel's 32-bit arguments
//! and the grid's extents, the buffers' lengths; from host tensors also every list against the convention above
//! ([`GpuError::BlockList`] names the entry as (sequence, list head, token, slot), its bound being the token's
//! visible keys `t + 1`).

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Operand;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::{ArrayView3, ArrayViewD, Axis};

use crate::block_sparse::check_block_list;
use crate::common::{GpuElement, check_causal_self_attention, check_len, grid_3d, to_i32, token_rows};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::flash::{ForwardOutput, forward_from_host};
use crate::launch;
use crate::params::{DsaSparseParams, FlashParams};

/// `gpu/kernels/dsa_sparse.cu` after the shared helpers (sm90.cuh's for its `wgmma` path): a launch takes the path
/// [`SparseProducts::choose`] names.
pub const DSA_SPARSE: KernelSource = KernelSource {
    name: "dsa_sparse",
    source: concat!(
        include_str!("../../kernels/common.cuh"),
        include_str!("../../kernels/sm90.cuh"),
        include_str!("../../kernels/dsa_sparse.cu")
    ),
};

/// The same text launched on `mma.sync` on every device, Hopper included: the path other devices, groups of fewer
/// than 49 heads and head dims above 128 take, so that tests and the benchmark run it on an H100 or H200 too.
pub const DSA_SPARSE_MMA_SYNC: KernelSource = KernelSource { name: "dsa_sparse_mma_sync", ..DSA_SPARSE };

/// How a launch of `dsa_sparse.cu` runs its products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SparseProducts {
    /// `mma.sync.m16n8k16` per warp, one stage of K and of V (any device from sm_80, any group and head dims).
    MmaSync,
    /// `wgmma` on one warpgroup of 64 heads, two stages of K and of V (`SPARSE_WGMMA`; sm_90a, head dims up to 128).
    Wgmma,
}

impl SparseProducts {
    /// `Wgmma` on a device of compute capability 9.0 for a group that fills CTAs of 64 heads ([`rows_per_cta`] = 64:
    /// more than 48 heads) with `d` and `dv` up to 128, unless `kernel` is [`DSA_SPARSE_MMA_SYNC`]; else `MmaSync`.
    pub fn choose(kernel: KernelSource, capability: (i32, i32), spec: &AttentionSpec) -> Self {
        let wgmma = capability == (9, 0)
            && kernel.name != DSA_SPARSE_MMA_SYNC.name
            && rows_per_cta(spec.group_size()) == MAX_ROWS_PER_CTA
            && Self::wgmma_fits(spec);
        if wgmma { Self::Wgmma } else { Self::MmaSync }
    }

    /// Whether the `wgmma` path takes the spec's head dims (each padded to 64 or 128).
    pub fn wgmma_fits(spec: &AttentionSpec) -> bool {
        spec.head_dim <= 128 && spec.head_dim_v <= 128
    }

    /// The query heads per CTA: the group's ([`rows_per_cta`]) on `mma.sync`, always 64 (one warpgroup) on `wgmma`.
    pub fn rows(self, spec: &AttentionSpec) -> usize {
        match self {
            Self::MmaSync => rows_per_cta(spec.group_size()),
            Self::Wgmma => MAX_ROWS_PER_CTA,
        }
    }

    /// A head dim as the path pads it: to a multiple of 16 (`mma.sync`'s k-step) or to 64 or 128 (whole 64-column
    /// chunks of the 128-byte swizzle).
    pub fn pad(self, d: usize) -> usize {
        match self {
            Self::MmaSync => d.div_ceil(16).max(1) * 16,
            Self::Wgmma => d.div_ceil(64).max(1) * 64,
        }
    }

    /// Dynamic shared memory of a launch: on `mma.sync` the Q tile of the CTA's rows and one gathered K tile (`d`
    /// columns) and V tile (`dv`), rows padded by 8 elements; on `wgmma` Q and two stages of K and of V in the
    /// swizzle, and 1024 bytes to align the window.
    pub fn shared_bytes(self, spec: &AttentionSpec) -> usize {
        let (d, dv) = (self.pad(spec.head_dim), self.pad(spec.head_dim_v));
        match self {
            Self::MmaSync => 2 * ((self.rows(spec) + KV_TILE) * (d + 8) + KV_TILE * (dv + 8)),
            Self::Wgmma => 1024 + 2 * (MAX_ROWS_PER_CTA * d + 2 * KV_TILE * d + 2 * KV_TILE * dv),
        }
    }
}

/// Gathered keys per tile (`SPARSE_KEYS`): a list is visited in `⌈n/64⌉` tiles of consecutive slots.
pub const KV_TILE: usize = 64;

/// The most query heads one CTA holds (`SPARSE_ROWS` at its largest); a larger group takes several CTAs per token.
pub const MAX_ROWS_PER_CTA: usize = 64;

/// Which KV heads a list serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListSharing {
    /// One list per token for every KV head (DSA's: one indexer selects for the whole layer).
    Shared,
    /// One list per (token, KV head).
    PerKvHead,
}

/// The selection the attention reads: `top_k` slots per list, shared or per KV head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenSelection {
    /// Entries per list (any width: a list wider than its token's visible keys is `−1`-padded).
    pub top_k: usize,
    /// Which KV heads a list serves.
    pub heads: ListSharing,
}

impl TokenSelection {
    /// List heads per token: 1 shared, `n_heads_kv` per KV head.
    pub fn list_heads(&self, spec: &AttentionSpec) -> usize {
        match self.heads {
            ListSharing::Shared => 1,
            ListSharing::PerKvHead => spec.n_heads_kv,
        }
    }

    /// The list head of query head `head`.
    pub fn list_head_of(&self, spec: &AttentionSpec, head: usize) -> usize {
        match self.heads {
            ListSharing::Shared => 0,
            ListSharing::PerKvHead => spec.kv_head(head),
        }
    }

    /// The lists' shape for `spec`: `[token rows, list heads, top_k]`, token rows `B · L` dense, the packed total
    /// varlen.
    pub fn lists_shape(&self, spec: &AttentionSpec) -> [usize; 3] {
        [token_rows(spec), self.list_heads(spec), self.top_k]
    }
}

/// Query heads per CTA for a GQA group of `group` heads: the group rounded up to a multiple of 16 (a warp's rows),
/// at most [`MAX_ROWS_PER_CTA`].
pub fn rows_per_cta(group: usize) -> usize {
    group.clamp(1, MAX_ROWS_PER_CTA).div_ceil(16) * 16
}

/// The most tiles a row visits: `⌈top_k / 64⌉`.
pub fn visited_tiles(top_k: usize) -> usize {
    top_k.div_ceil(KV_TILE)
}

/// The defines `dsa_sparse.cu` is compiled with on `products`: the storage type, the head dims as the path pads them,
/// the rows per CTA, and `SPARSE_WGMMA` for the `wgmma` path.
pub fn sparse_defines<T: GpuElement>(spec: &AttentionSpec, products: SparseProducts) -> Vec<String> {
    let mut defines = vec![
        T::DEFINE.to_owned(),
        format!("HEAD_DIM_PAD={}", products.pad(spec.head_dim)),
        format!("HEAD_DIM_V_PAD={}", products.pad(spec.head_dim_v)),
        format!("SPARSE_ROWS={}", products.rows(spec)),
    ];
    if products == SparseProducts::Wgmma {
        defines.push("SPARSE_WGMMA".to_owned());
    }
    defines
}

/// Everything a launch needs, derived from a validated layer spec and selection (the backward's too).
pub(super) struct Plan {
    pub(super) params: DsaSparseParams,
    pub(super) cu_q: Vec<i32>,
    pub(super) cu_k: Vec<i32>,
    pub(super) batch: usize,
    pub(super) max_len: usize,
    rows: usize,
}

pub(super) fn plan(spec: &AttentionSpec, selection: TokenSelection) -> Result<Plan, GpuError> {
    check_causal_self_attention(spec, "DSA")?;
    let (flash, cu_q, cu_k) = FlashParams::for_spec(spec)?;
    let shape = selection.lists_shape(spec);
    let elements = shape.iter().try_fold(1usize, |n, &x| n.checked_mul(x));
    if elements.and_then(|n| i64::try_from(n).ok()).is_none() {
        return Err(GpuError::TooLarge { argument: "lists", value: elements.unwrap_or(usize::MAX) });
    }
    let group = spec.group_size();
    let rows = rows_per_cta(group);
    let seqs = spec.sequences();
    let max_len = seqs.iter().map(|s| s.len_q).max().unwrap_or(0);
    let params = DsaSparseParams {
        flash,
        token_rows: shape[0] as i64,
        top_k: to_i32("top_k", selection.top_k)?,
        list_heads: to_i32("list heads", shape[1])?,
        head_chunks: to_i32("head chunks", group.div_ceil(rows))?,
        column_chunks: 1,
    };
    Ok(Plan { params, cu_q, cu_k, batch: seqs.len(), max_len, rows })
}

/// Token-sparse attention of the layer `spec` (causal self-attention) on device buffers: `q`, `k`, `v` the layer's,
/// `lists` of [`TokenSelection::lists_shape`] (not validated, see the module docs); `o` (O's layout) and `lse`
/// (dense `[B, Hq, L]`, varlen `[Hq, T]`) are written in full. `kernel` is [`DSA_SPARSE`] or a patched copy of it
/// (the tests launch mutants through this path). Every check runs before the launch; the work is asynchronous on
/// `stream`.
#[allow(clippy::too_many_arguments)]
pub fn token_sparse_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    selection: TokenSelection,
    kernel: KernelSource,
    (q, k, v): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    lists: &CudaSlice<i32>,
    o: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    let plan = plan(spec, selection)?;
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_len("q", q, size(Operand::Q))?;
    check_len("k", k, size(Operand::K))?;
    check_len("v", v, size(Operand::V))?;
    check_len("lists", lists, selection.lists_shape(spec).iter().product())?;
    check_len("o", o, size(Operand::O))?;
    check_len("lse", lse, size(Operand::RowStat))?;
    let grid = grid_3d(
        ("tokens", plan.max_len),
        ("n_heads_kv × head chunks", spec.n_heads_kv * plan.params.head_chunks as usize),
        ("sequences", plan.batch),
    )?;
    if plan.max_len == 0 || plan.batch == 0 || spec.n_heads_kv == 0 {
        return Ok(());
    }
    let ctx = stream.context();
    let products = SparseProducts::choose(kernel, compile::compute_capability(ctx)?, spec);
    // Both paths hold the same heads per CTA: `choose` takes `wgmma` only where the group's CTAs have 64 rows.
    debug_assert_eq!(products.rows(spec), plan.rows);
    let module = compile::module(ctx, kernel, &sparse_defines::<T>(spec, products))?;
    let func = module
        .load_function("dsa_sparse_fwd")
        .map_err(|e| GpuError::driver("cuModuleGetFunction(dsa_sparse.cu)", e))?;
    let shared_bytes = products.shared_bytes(spec);
    compile::allow_shared_memory(ctx, &func, shared_bytes, "head_dim or head_dim_v")?;
    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e));
    let (cu_q, cu_k) = (up(&plan.cu_q)?, up(&plan.cu_k)?);
    let cfg =
        LaunchConfig { grid_dim: grid, block_dim: (2 * plan.rows as u32, 1, 1), shared_mem_bytes: shared_bytes as u32 };
    launch::launch_dsa_sparse_fwd(stream, &func, cfg, (q, k, v), (o, lse), lists, (&cu_q, &cu_k), &plan.params)
}

/// Checks host lists against the convention for `spec`: the shape [`TokenSelection::lists_shape`], and per token an
/// ascending prefix of distinct tokens `0 ..= t` of its sequence, then `−1`.
pub fn validate_token_lists(
    spec: &AttentionSpec,
    selection: TokenSelection,
    lists: ArrayView3<'_, i32>,
) -> Result<(), GpuError> {
    let expected = selection.lists_shape(spec).to_vec();
    if lists.shape() != expected.as_slice() {
        return Err(GpuError::Shape { argument: "lists", expected, actual: lists.shape().to_vec() });
    }
    let mut row0 = 0;
    for seq in spec.sequences() {
        for t in 0..seq.len_q {
            for (head, list) in lists.index_axis(Axis(0), row0 + t).outer_iter().enumerate() {
                check_block_list(list.iter().copied(), t + 1)
                    .map_err(|(slot, fault)| GpuError::BlockList { position: [seq.index, head, t, slot], fault })?;
            }
        }
        row0 += seq.len_q;
    }
    Ok(())
}

/// Token-sparse attention from host tensors (validates the layer and the lists, copies in, launches, copies out,
/// synchronizes); arguments as in [`token_sparse_device`]. `O` and LSE come back in the layer's layouts.
#[allow(clippy::too_many_arguments)]
pub fn token_sparse<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    selection: TokenSelection,
    kernel: KernelSource,
    q: ArrayViewD<'_, T>,
    k: ArrayViewD<'_, T>,
    v: ArrayViewD<'_, T>,
    lists: ArrayView3<'_, i32>,
) -> Result<ForwardOutput<T>, GpuError> {
    plan(spec, selection)?;
    validate_token_lists(spec, selection, lists)?;
    let host_lists = lists.as_standard_layout();
    let host_lists = host_lists.as_slice().expect("standard layout");
    forward_from_host(stream, spec, [q, k, v], |[dq, dk, dv], o, lse| {
        let upload = if host_lists.is_empty() { stream.alloc_zeros::<i32>(1) } else { stream.clone_htod(host_lists) };
        let device_lists = upload.map_err(|e| GpuError::driver("cuMemcpyHtoD(lists)", e))?;
        token_sparse_device(stream, spec, selection, kernel, (dq, dk, dv), &device_lists, o, lse)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::{Layout, Mask};

    fn layer(batch: usize, hq: usize, hkv: usize, len: usize, d: usize, dv: usize) -> AttentionSpec {
        AttentionSpec::dense(batch, hq, hkv, len, len, d, dv).with_mask(Mask::Causal)
    }

    const SHARED: TokenSelection = TokenSelection { top_k: 2048, heads: ListSharing::Shared };

    #[test]
    fn the_plan_sizes_rows_chunks_tiles_and_lists() {
        for (group, rows, chunks) in [(1, 16, 1), (3, 16, 1), (16, 16, 1), (17, 32, 1), (48, 48, 1), (64, 64, 1)]
            .into_iter()
            .chain([(65, 64, 2), (100, 64, 2), (128, 64, 2), (129, 64, 3)])
        {
            let p = plan(&layer(1, group, 1, 100, 64, 64), SHARED).unwrap();
            assert_eq!((p.rows, p.params.head_chunks), (rows, chunks), "group {group}");
        }
        let spec = layer(2, 12, 4, 130, 192, 128);
        let p = plan(&spec, TokenSelection { top_k: 7, heads: ListSharing::PerKvHead }).unwrap();
        assert_eq!((p.params.token_rows, p.params.list_heads, p.params.top_k), (260, 4, 7));
        assert_eq!((p.batch, p.max_len), (2, 130));
        // A Q tile of 16 rows and a K tile of 64 rows of 192 + 8 columns, a V tile of 64 rows of 128 + 8.
        assert_eq!(SparseProducts::MmaSync.shared_bytes(&spec), 2 * ((16 + 64) * 200 + 64 * 136));
        assert_eq!(
            sparse_defines::<half::f16>(&spec, SparseProducts::MmaSync),
            ["ELEM_F16", "HEAD_DIM_PAD=192", "HEAD_DIM_V_PAD=128", "SPARSE_ROWS=16"]
        );
        assert_eq!(
            sparse_defines::<half::bf16>(&layer(1, 40, 1, 1, 72, 8), SparseProducts::MmaSync),
            ["ELEM_BF16", "HEAD_DIM_PAD=80", "HEAD_DIM_V_PAD=16", "SPARSE_ROWS=48"]
        );
        // On wgmma: 64 rows whatever the group, head dims in whole 64-column chunks; Q (64 × 128 columns) and two
        // stages of K (64 × 128) and of V (64 × 64), 2-byte elements, and the alignment's 1024 bytes.
        let wide = layer(1, 64, 1, 1, 72, 8);
        assert_eq!(
            sparse_defines::<half::bf16>(&wide, SparseProducts::Wgmma),
            ["ELEM_BF16", "HEAD_DIM_PAD=128", "HEAD_DIM_V_PAD=64", "SPARSE_ROWS=64", "SPARSE_WGMMA"]
        );
        assert_eq!(SparseProducts::Wgmma.shared_bytes(&wide), 1024 + 2 * (64 * 128 + 2 * 64 * 128 + 2 * 64 * 64));
        assert_eq!(SHARED.lists_shape(&spec), [260, 1, 2048]);
        assert_eq!((visited_tiles(2048), visited_tiles(65), visited_tiles(64), visited_tiles(0)), (32, 2, 1, 0));
        assert_eq!(
            (
                SHARED.list_head_of(&spec, 11),
                TokenSelection { heads: ListSharing::PerKvHead, ..SHARED }.list_head_of(&spec, 11)
            ),
            (0, 3)
        );
    }

    /// `wgmma` exactly on compute capability 9.0, for groups whose CTAs hold 64 heads, at head dims up to 128, and
    /// never for the `mma.sync` text.
    #[test]
    fn the_wgmma_path_is_chosen_where_it_applies() {
        use SparseProducts::{MmaSync, Wgmma};
        let hopper = (9, 0);
        for (group, d, dv, want) in [
            (64, 128, 128, Wgmma),
            (49, 64, 64, Wgmma),
            (128, 8, 128, Wgmma),
            (100, 72, 40, Wgmma),
            (48, 128, 128, MmaSync),
            (16, 64, 64, MmaSync),
            (64, 136, 128, MmaSync),
            (64, 128, 192, MmaSync),
        ] {
            let spec = layer(1, group, 1, 10, d, dv);
            assert_eq!(SparseProducts::choose(DSA_SPARSE, hopper, &spec), want, "group {group}, d {d}, dv {dv}");
            assert_eq!(SparseProducts::choose(DSA_SPARSE_MMA_SYNC, hopper, &spec), MmaSync);
            for other in [(8, 0), (8, 9), (10, 0), (12, 0)] {
                assert_eq!(SparseProducts::choose(DSA_SPARSE, other, &spec), MmaSync, "{other:?}");
            }
            // Both paths hold the group's rows per CTA wherever wgmma is chosen.
            if want == Wgmma {
                assert_eq!(Wgmma.rows(&spec), MmaSync.rows(&spec));
            }
        }
        // A grouped layer over several KV heads takes the group's size, not the query heads'.
        assert_eq!(SparseProducts::choose(DSA_SPARSE, hopper, &layer(1, 128, 4, 10, 64, 64)), MmaSync);
    }

    #[test]
    fn unsupported_layers_are_typed_errors() {
        let not_causal = AttentionSpec::dense(1, 2, 1, 64, 64, 64, 64);
        assert!(matches!(plan(&not_causal, SHARED), Err(GpuError::Unsupported { argument: "mask", .. })));
        let cross = AttentionSpec::dense(1, 2, 1, 64, 65, 64, 64).with_mask(Mask::Causal);
        assert!(matches!(plan(&cross, SHARED), Err(GpuError::Unsupported { argument: "layout", .. })));
        assert!(matches!(
            plan(&layer(1, 2, 1, 64, 60, 64), SHARED),
            Err(GpuError::Unsupported { argument: "head_dim", .. })
        ));
        assert!(matches!(
            plan(&layer(1, 2, 1, 64, 64, 264), SHARED),
            Err(GpuError::Unsupported { argument: "head_dim_v", .. })
        ));
        let wide = TokenSelection { top_k: 1 << 31, ..SHARED };
        assert!(matches!(plan(&layer(1, 2, 1, 64, 64, 64), wide), Err(GpuError::TooLarge { argument: "top_k", .. })));
        let bad = AttentionSpec { n_heads_q: 3, ..layer(1, 2, 2, 64, 64, 64) };
        assert!(matches!(plan(&bad, SHARED), Err(GpuError::Spec(_))));
    }

    /// Every way a list can break the convention is named with its (sequence, list head, token, slot), per sequence
    /// of a varlen layout; lists wider than the visible keys are accepted, keys after the token are not.
    #[test]
    fn bad_lists_are_named_typed_errors() {
        use crate::error::BlockListFault as F;
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 10, 10, 16], cu_seqlens_k: vec![0, 10, 10, 16] },
            ..layer(1, 4, 2, 1, 64, 64)
        };
        let selection = TokenSelection { top_k: 4, heads: ListSharing::PerKvHead };
        // Every token lists its first min(t + 1, 4) tokens.
        let good = ndarray::Array3::from_shape_fn((16, 2, 4), |(row, _, e)| {
            let t = if row < 10 { row } else { row - 10 };
            if e <= t { e as i32 } else { -1 }
        });
        validate_token_lists(&spec, selection, good.view()).unwrap();
        let with = |row: usize, head: usize, entries: [i32; 4]| {
            let mut l = good.clone();
            for (e, x) in entries.into_iter().enumerate() {
                l[[row, head, e]] = x;
            }
            validate_token_lists(&spec, selection, l.view()).unwrap_err()
        };
        let named = |e: GpuError| match e {
            GpuError::BlockList { position, fault } => (position, fault),
            other => panic!("not a list error: {other}"),
        };
        // Token 2 of the first sequence may list 0, 1, 2; token 1 of the third (row 11) 0 and 1.
        assert_eq!(named(with(2, 1, [0, 3, -1, -1])), ([0, 1, 2, 1], F::OutOfRange { index: 3, key_blocks: 3 }));
        assert_eq!(named(with(11, 0, [0, 2, -1, -1])), ([2, 0, 1, 1], F::OutOfRange { index: 2, key_blocks: 2 }));
        assert_eq!(named(with(7, 0, [1, 1, -1, -1])), ([0, 0, 7, 1], F::Duplicate { index: 1 }));
        assert_eq!(named(with(7, 0, [2, 1, -1, -1])), ([0, 0, 7, 1], F::NotAscending { index: 1, previous: 2 }));
        assert_eq!(named(with(7, 0, [0, -1, 2, -1])), ([0, 0, 7, 2], F::AfterPad { index: 2 }));
        assert_eq!(named(with(7, 0, [-2, -1, -1, -1])), ([0, 0, 7, 0], F::OutOfRange { index: -2, key_blocks: 8 }));
        let shared = TokenSelection { heads: ListSharing::Shared, ..selection };
        assert!(matches!(validate_token_lists(&spec, shared, good.view()), Err(GpuError::Shape { .. })));
        let narrow = ndarray::Array3::<i32>::zeros((16, 2, 3));
        assert!(matches!(validate_token_lists(&spec, selection, narrow.view()), Err(GpuError::Shape { .. })));
    }
}
