//! DSA's lightning indexer fused with an exact causal top-k: `gpu/kernels/dsa_index.cu` behind typed wrappers, from
//! device buffers ([`indexer_top_k_device`]) or host tensors ([`indexer_top_k`]).
//!
//! # Inputs and output
//!
//! One sequence of `T` tokens: indexer queries `q^I [T, H_I, d_I]` and keys `k^I [T, d_I]` in bf16 or f16, head
//! weights `w [T, H_I]` in f32 (a bf16 weight is exact in f32, and f32 keeps what a weight projection computed). Any
//! `H_I` from 1 to [`MAX_INDEX_HEADS`], `d_I` in [`INDEX_DIMS`], `k ≥ 1`. The output is `lists [T, k]` `i32`: row
//! `t` holds the `k` tokens `s ≤ t` of the largest scores in ascending order, ties to the lower index; a row with
//! fewer than `k` visible tokens (`t + 1 < k`, so every row when `k > T`) holds all of them, then `−1`. This is the
//! convention of `attnproof_oracle::dsa::causal_top_k`.
//!
//! # Scores and exactness
//!
//! A score is `Σ_a w_a · ReLU(q_a · k_s)`: the logits on tensor cores (exact products of the 16-bit inputs, f32
//! accumulation), the weighted ReLU sum in f32 in an order fixed by the head alone (the kernel's header spells it
//! out), plus `+0.0` so that `−0` and `+0` are one value. Two tokens with equal key rows therefore score bitwise
//! equal and tie. The selection itself is exact: a radix select over the f32 scores' order-preserving bit patterns,
//! so the lists equal `causal_top_k` applied to the kernel's own scores, which [`Scores::Return`] hands back. Against
//! the exact scores, each f32 score is within `attnproof_proofs::dsa_bound::indexer_score_bound` of its true value;
//! a token can only trade places at the top-k boundary with one whose true score is within the two bounds.
//!
//! # Memory
//!
//! A persistent grid: each CTA takes groups of four consecutive tokens, writes their scores to four rows of an f32
//! workspace of `T` floats each ([`workspace_len`] for a number of CTAs, [`resident_ctas`] being [`CTAS_PER_SM`] per
//! multiprocessor, so that one CTA's selection overlaps another's scoring), selects from them, and moves on. Nothing
//! of size `T × T` exists unless the caller asks for the scores ([`ScoreRows::Full`], [`full_scores_len`]).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, LaunchConfig};
use ndarray::{Array2, ArrayView2, ArrayView3, Dimension};

use crate::common::{GpuElement, check_len, grid_dim, to_i32};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::launch;
use crate::params::DsaIndexParams;

/// `gpu/kernels/dsa_index.cu` after the shared helpers and the Hopper ones (`sm90.cuh`): its logits run on the
/// warpgroup MMA (`wgmma`) where the target is `sm_90a`, on `mma.sync` elsewhere.
pub const DSA_INDEX: KernelSource = KernelSource {
    name: "dsa_index",
    source: concat!(
        include_str!("../../kernels/common.cuh"),
        include_str!("../../kernels/sm90.cuh"),
        include_str!("../../kernels/dsa_index.cu")
    ),
};

/// [`DSA_INDEX`] with its logits on `mma.sync` on every target, `sm_90a` too (`IDX_MMA_SYNC`): the path every other
/// architecture runs, so that a Hopper device verifies it and the benchmark times it beside the `wgmma` one.
pub const DSA_INDEX_MMA_SYNC: KernelSource = KernelSource {
    name: "dsa_index_mma_sync",
    source: concat!(
        include_str!("../../kernels/common.cuh"),
        include_str!("../../kernels/sm90.cuh"),
        "#define IDX_MMA_SYNC 1\n",
        include_str!("../../kernels/dsa_index.cu")
    ),
};

/// The indexer head dims the kernel is compiled for (`INDEX_DIM`).
pub const INDEX_DIMS: [usize; 2] = [64, 128];
/// The most indexer heads per token (the kernel's 64 head rows per token).
pub const MAX_INDEX_HEADS: usize = 64;
/// Tokens per query group of a CTA (the kernel's `IDX_QUERIES`).
pub const GROUP_TOKENS: usize = 4;
/// Threads per CTA (`IDX_THREADS`).
const THREADS: u32 = 256;

/// The indexer problem: one sequence of `seq_len` tokens, `n_index_heads` heads of `index_dim` columns, `top_k`
/// tokens kept per query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexerShape {
    /// `T`: tokens of the sequence (queries and keys); 0 is allowed and does nothing.
    pub seq_len: usize,
    /// `H_I`: indexer heads per token, 1 to [`MAX_INDEX_HEADS`].
    pub n_index_heads: usize,
    /// `d_I`: one of [`INDEX_DIMS`].
    pub index_dim: usize,
    /// `k`: entries per selection row, at least 1 (more than `T` pads every row).
    pub top_k: usize,
}

impl IndexerShape {
    /// Checks what the kernel supports: a typed error names the first argument out of range.
    pub fn validate(&self) -> Result<(), GpuError> {
        if !INDEX_DIMS.contains(&self.index_dim) {
            return Err(GpuError::Unsupported {
                argument: "index_dim",
                reason: format!("{} is not one of {INDEX_DIMS:?}", self.index_dim),
            });
        }
        if self.n_index_heads == 0 || self.n_index_heads > MAX_INDEX_HEADS {
            return Err(GpuError::Unsupported {
                argument: "n_index_heads",
                reason: format!("{} is not in 1..={MAX_INDEX_HEADS}", self.n_index_heads),
            });
        }
        if self.top_k == 0 {
            return Err(GpuError::Unsupported {
                argument: "top_k",
                reason: "a selection keeps at least one token".into(),
            });
        }
        to_i32("top_k", self.top_k)?;
        to_i32("seq_len", self.seq_len)?;
        // Every element offset the kernel forms stays below 2^63; the list and query offsets must also fit the host's
        // sizes.
        self.seq_len
            .checked_mul(self.top_k)
            .and_then(|n| n.checked_mul(4))
            .ok_or(GpuError::TooLarge { argument: "seq_len · top_k", value: self.seq_len })?;
        self.seq_len
            .checked_mul(self.score_stride())
            .and_then(|n| n.checked_mul(4))
            .ok_or(GpuError::TooLarge { argument: "seq_len²", value: self.seq_len })?;
        Ok(())
    }

    /// Elements of `q^I`: `T · H_I · d_I`.
    pub fn q_len(&self) -> usize {
        self.seq_len * self.n_index_heads * self.index_dim
    }

    /// Elements of `k^I`: `T · d_I`.
    pub fn k_len(&self) -> usize {
        self.seq_len * self.index_dim
    }

    /// Elements of `w`: `T · H_I`.
    pub fn weights_len(&self) -> usize {
        self.seq_len * self.n_index_heads
    }

    /// Elements of the lists: `T · k`.
    pub fn lists_len(&self) -> usize {
        self.seq_len * self.top_k
    }

    /// f32 elements between two score rows: `T` rounded up to a multiple of 4 (at least 4).
    pub fn score_stride(&self) -> usize {
        self.seq_len.div_ceil(4).max(1) * 4
    }

    fn groups(&self) -> usize {
        self.seq_len.div_ceil(GROUP_TOKENS)
    }
}

/// f32 elements of the workspace that `ctas` CTAs need: four score rows each.
pub fn workspace_len(shape: &IndexerShape, ctas: usize) -> usize {
    ctas * GROUP_TOKENS * shape.score_stride()
}

/// f32 elements of the full score matrix, `[T, score_stride]` ([`ScoreRows::Full`]).
pub fn full_scores_len(shape: &IndexerShape) -> usize {
    shape.seq_len * shape.score_stride()
}

/// Bytes of dynamic shared memory of a CTA for head dim `index_dim`: the query tile (256 rows), two key tiles of 64
/// rows (rows padded by 8 elements on the `mma.sync` path), then 2048 words that hold the scoring's 256 weights and
/// 8 × 64 partial sums and, after them, the selection's histogram bins, and 12 integers. The `wgmma` path's unpadded
/// swizzled tiles take 16 bytes less per row, more than the up to 1024 bytes it skips to align them
/// (`wgmma_carve_bytes`, checked when the crate compiles). At `d_I = 128` two CTAs fit a multiprocessor.
pub const fn shared_bytes(index_dim: usize) -> usize {
    let stride = index_dim + 8;
    2 * (256 * stride + 2 * 64 * stride) + 4 * (PHASE_WORDS + 8 + 4)
}

/// What the `wgmma` path's carve takes at most: the alignment it may skip, the swizzled query and key tiles
/// (`sm90.cuh`: rows of `d_I` elements), the same words as the other path.
const fn wgmma_carve_bytes(index_dim: usize) -> usize {
    1024 + 2 * (256 * index_dim + 2 * 64 * index_dim) + 4 * (PHASE_WORDS + 8 + 4)
}
const _: () = assert!(
    wgmma_carve_bytes(64) <= shared_bytes(64) && wgmma_carve_bytes(128) <= shared_bytes(128),
    "the wgmma path's aligned carve fits the bytes the host asks for"
);

/// 4-byte words the scoring's 256 weights and 8 × 64 partial sums share with the selection's 2048 histogram bins.
const PHASE_WORDS: usize = 2048;
const _: () = assert!(256 + 8 * 64 <= PHASE_WORDS, "the scoring's words fit in the histogram's");

/// CTAs the kernel keeps resident per multiprocessor (its `IDX_CTAS_PER_SM`): one scores on the tensor cores while
/// the other selects.
pub const CTAS_PER_SM: usize = 2;

/// CTAs that run at once on the context's device ([`CTAS_PER_SM`] per multiprocessor): what [`workspace_len`] is
/// sized for.
pub fn resident_ctas(ctx: &Arc<CudaContext>) -> Result<usize, GpuError> {
    Ok(CTAS_PER_SM * crate::common::multiprocessors(ctx)?)
}

/// The defines of the kernel's module for storage type `T` and head dim `index_dim` (and the CTAs it keeps resident).
pub fn index_defines<T: GpuElement>(index_dim: usize) -> Vec<String> {
    vec![T::DEFINE.to_owned(), format!("INDEX_DIM={index_dim}"), format!("IDX_CTAS_PER_SM={CTAS_PER_SM}")]
}

/// Where the scores go.
#[derive(Debug)]
pub enum ScoreRows<'a> {
    /// A workspace of [`workspace_len`] for some number of CTAs (at least one): the launch runs that many CTAs (no
    /// more than there are groups of four tokens) and the scores are not kept.
    Workspace(&'a mut CudaSlice<f32>),
    /// The caller's `[T, score_stride]` matrix of [`full_scores_len`] elements: row `t` holds token `t`'s scores of
    /// the keys `0 ..= t` (the rest of the row is left as it was).
    Full(&'a mut CudaSlice<f32>),
}

/// Scores every token's earlier tokens and selects the top `k` on device buffers: `q`, `k`, `w` hold `q^I`, `k^I`,
/// `w` as [`IndexerShape`] lays them out, `lists` at least [`IndexerShape::lists_len`] elements. Every check runs
/// before the launch, which is asynchronous on `stream`. `kernel` is [`DSA_INDEX`] or a variant of its text.
#[allow(clippy::too_many_arguments)]
pub fn indexer_top_k_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    shape: &IndexerShape,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    w: &CudaSlice<f32>,
    lists: &mut CudaSlice<i32>,
    scores: ScoreRows<'_>,
) -> Result<(), GpuError> {
    shape.validate()?;
    check_len("q_index", q, shape.q_len())?;
    check_len("k_index", k, shape.k_len())?;
    check_len("weights", w, shape.weights_len())?;
    check_len("lists", lists, shape.lists_len())?;
    let groups = shape.groups();
    let stride = shape.score_stride();
    let ctx = stream.context();
    let (ctas, full, scratch) = match scores {
        ScoreRows::Workspace(buffer) => {
            let ctas = buffer.len() / (GROUP_TOKENS * stride);
            if ctas == 0 {
                return Err(GpuError::BufferTooSmall {
                    argument: "workspace",
                    needed: workspace_len(shape, 1),
                    actual: buffer.len(),
                });
            }
            (ctas.min(groups), false, buffer)
        }
        ScoreRows::Full(buffer) => {
            check_len("scores", buffer, full_scores_len(shape))?;
            (resident_ctas(ctx)?.min(groups), true, buffer)
        }
    };
    if groups == 0 {
        return Ok(());
    }
    let params = DsaIndexParams {
        scratch_stride: stride as i64,
        seq_len: to_i32("seq_len", shape.seq_len)?,
        n_heads: to_i32("n_index_heads", shape.n_index_heads)?,
        top_k: to_i32("top_k", shape.top_k)?,
        full_scores: i32::from(full),
        n_groups: to_i32("query groups", groups)?,
        reserved: 0,
    };
    let module = compile::module(ctx, kernel, &index_defines::<T>(shape.index_dim))?;
    let func = module
        .load_function("dsa_index_topk")
        .map_err(|e| GpuError::driver("cuModuleGetFunction(dsa_index_topk)", e))?;
    let shared = shared_bytes(shape.index_dim);
    compile::allow_shared_memory(ctx, &func, shared, "index_dim")?;
    let cfg = LaunchConfig {
        grid_dim: (grid_dim("CTAs", ctas, i32::MAX as usize)?, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    launch::launch_dsa_index(stream, &func, cfg, (q, k, w), (lists, scratch), &params)
}

/// Whether [`indexer_top_k`] hands back the scores beside the lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scores {
    /// Lists only (a workspace for the resident CTAs; nothing of size `T × T`).
    Discard,
    /// Lists and the `[T, T]` f32 scores (`−∞` after the diagonal).
    Return,
}

/// What [`indexer_top_k`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerOutput {
    /// `[T, k]` selections, ascending, `−1`-padded.
    pub lists: Array2<i32>,
    /// `[T, T]` scores with [`Scores::Return`]: row `t`'s keys `0 ..= t` as the kernel computed them, `−∞` after.
    pub scores: Option<Array2<f32>>,
}

/// The elements of a host tensor in row-major order, or [`GpuError::Stride`] when it is not laid out so.
pub(crate) fn contiguous<'a, X, D: ndarray::Dimension>(
    argument: &'static str,
    x: &'a ndarray::ArrayView<'_, X, D>,
) -> Result<&'a [X], GpuError> {
    x.as_slice().ok_or_else(|| GpuError::Stride { argument, strides: x.strides().to_vec() })
}

/// Runs the indexer and its top-k from host tensors (copies in, launches, copies out, synchronizes): `q [T, H_I,
/// d_I]`, `k [T, d_I]`, `w [T, H_I]`, all row-major and finite.
pub fn indexer_top_k<T: GpuElement>(
    stream: &Arc<CudaStream>,
    q: ArrayView3<'_, T>,
    k: ArrayView2<'_, T>,
    w: ArrayView2<'_, f32>,
    top_k: usize,
    scores: Scores,
) -> Result<IndexerOutput, GpuError> {
    let (seq_len, n_index_heads, index_dim) = q.dim();
    let shape = IndexerShape { seq_len, n_index_heads, index_dim, top_k };
    if k.dim() != (seq_len, index_dim) {
        return Err(GpuError::Shape {
            argument: "k_index",
            expected: vec![seq_len, index_dim],
            actual: k.shape().to_vec(),
        });
    }
    if w.dim() != (seq_len, n_index_heads) {
        return Err(GpuError::Shape {
            argument: "weights",
            expected: vec![seq_len, n_index_heads],
            actual: w.shape().to_vec(),
        });
    }
    shape.validate()?;
    let (hq, hk, hw) = (contiguous("q_index", &q)?, contiguous("k_index", &k)?, contiguous("weights", &w)?);
    let non_finite = |argument: &'static str, at: Option<usize>, dims: &[usize]| match at {
        Some(i) => {
            let index =
                ndarray::indices(dims.to_vec()).into_iter().nth(i).map(|ix| ix.slice().to_vec()).unwrap_or_default();
            Err(GpuError::from(attnproof_oracle::OracleError::NonFinite { argument, index, value: f64::NAN }))
        }
        None => Ok(()),
    };
    non_finite("q_index", hq.iter().position(|x| !x.is_finite_value()), q.shape())?;
    non_finite("k_index", hk.iter().position(|x| !x.is_finite_value()), k.shape())?;
    non_finite("weights", hw.iter().position(|x| !x.is_finite()), w.shape())?;
    let driver = |what: &'static str| move |e| GpuError::driver(what, e);
    let up_elems = |data: &[T]| {
        if data.is_empty() { stream.alloc_zeros::<T>(1) } else { stream.clone_htod(data) }
            .map_err(driver("cuMemcpyHtoD"))
    };
    let (dq, dk) = (up_elems(hq)?, up_elems(hk)?);
    let dw = if hw.is_empty() { stream.alloc_zeros::<f32>(1) } else { stream.clone_htod(hw) }
        .map_err(driver("cuMemcpyHtoD"))?;
    let mut lists = stream.alloc_zeros::<i32>(shape.lists_len().max(1)).map_err(driver("cuMemAlloc"))?;
    let stride = shape.score_stride();
    let kept = match scores {
        Scores::Discard => {
            let ctas = resident_ctas(stream.context())?.min(shape.groups().max(1));
            let mut workspace = stream.alloc_zeros::<f32>(workspace_len(&shape, ctas)).map_err(driver("cuMemAlloc"))?;
            indexer_top_k_device(
                stream,
                DSA_INDEX,
                &shape,
                &dq,
                &dk,
                &dw,
                &mut lists,
                ScoreRows::Workspace(&mut workspace),
            )?;
            None
        }
        Scores::Return => {
            let mut full = stream.alloc_zeros::<f32>(full_scores_len(&shape).max(1)).map_err(driver("cuMemAlloc"))?;
            indexer_top_k_device(stream, DSA_INDEX, &shape, &dq, &dk, &dw, &mut lists, ScoreRows::Full(&mut full))?;
            let host = stream.clone_dtoh(&full).map_err(driver("cuMemcpyDtoH"))?;
            Some(Array2::from_shape_fn((seq_len, seq_len), |(t, s)| {
                if s <= t { host[t * stride + s] } else { f32::NEG_INFINITY }
            }))
        }
    };
    let mut host_lists = stream.clone_dtoh(&lists).map_err(driver("cuMemcpyDtoH"))?;
    stream.synchronize().map_err(driver("cuStreamSynchronize"))?;
    host_lists.truncate(shape.lists_len());
    let lists = Array2::from_shape_vec((seq_len, top_k), host_lists).expect("length matches the shape");
    Ok(IndexerOutput { lists, scores: kept })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(seq_len: usize, n_index_heads: usize, index_dim: usize, top_k: usize) -> IndexerShape {
        IndexerShape { seq_len, n_index_heads, index_dim, top_k }
    }

    #[test]
    fn shapes_outside_the_kernel_are_typed_errors() {
        assert!(shape(100, 64, 128, 2048).validate().is_ok());
        assert!(shape(0, 1, 64, 1).validate().is_ok(), "an empty sequence is valid");
        assert!(shape(5, 3, 64, 9).validate().is_ok(), "k above T pads");
        let unsupported = |s: IndexerShape, arg: &str| {
            assert!(
                matches!(s.validate(), Err(GpuError::Unsupported { argument, .. }) if argument == arg),
                "{s:?}: {:?}",
                s.validate()
            );
        };
        unsupported(shape(10, 4, 96, 2), "index_dim");
        unsupported(shape(10, 4, 256, 2), "index_dim");
        unsupported(shape(10, 0, 64, 2), "n_index_heads");
        unsupported(shape(10, 65, 64, 2), "n_index_heads");
        unsupported(shape(10, 4, 64, 0), "top_k");
        let too_large = shape(10, 4, 64, 1 << 31);
        assert!(matches!(too_large.validate(), Err(GpuError::TooLarge { argument: "top_k", .. })));
        let too_long = shape(1 << 31, 4, 64, 8);
        assert!(matches!(too_long.validate(), Err(GpuError::TooLarge { argument: "seq_len", .. })));
    }

    #[test]
    fn sizes_follow_the_layout() {
        let s = shape(10, 3, 64, 4);
        assert_eq!((s.q_len(), s.k_len(), s.weights_len(), s.lists_len()), (10 * 3 * 64, 640, 30, 40));
        assert_eq!(s.score_stride(), 12);
        assert_eq!(shape(0, 3, 64, 4).score_stride(), 4);
        assert_eq!(shape(8, 3, 64, 4).score_stride(), 8);
        assert_eq!(workspace_len(&s, 3), 3 * 4 * 12);
        assert_eq!(full_scores_len(&s), 10 * 12);
        assert_eq!(s.groups(), 3);
        // The kernel's carve of shared memory, spelled out: q 256 rows, k 2 × 64 rows of d + 8 elements, then 4-byte
        // words (the weights and partial sums inside the histogram's).
        assert_eq!(shared_bytes(128), 2 * (384 * 136) + 4 * (2048 + 12));
        // Hopper: 228 KiB of shared memory per multiprocessor, 1 KiB of it reserved per resident CTA.
        assert!(CTAS_PER_SM * (shared_bytes(128) + 1024) <= 228 * 1024, "two CTAs fit a multiprocessor");
        assert_eq!(index_defines::<half::bf16>(64), ["ELEM_BF16", "INDEX_DIM=64", "IDX_CTAS_PER_SM=2"]);
    }
}
