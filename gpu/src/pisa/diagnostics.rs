//! What a block selection loses (E30) on the GPU: the exact attention mass of every key block per query block
//! (`gpu/kernels/pisa_mass.cu`, [`block_masses_device`], [`block_masses`]), and from those masses Recall@K and the
//! attention-mass ratio of any lists ([`diagnose`]: BSA's, the pyramid's, a caller's).
//!
//! # The convention
//!
//! The selectors pick one list per query block, so the masses are the query block's: for every row of the block that
//! sees a key and every query head of the KV head's group, the dense softmax over the row's visible keys (bottom-right
//! causal, or every key of the sequence), summed per leaf (key block) and averaged over the rows and heads:
//! `mass_b = (1 / (R · G)) Σ_{r, h} Σ_{j ∈ b} P_{rh, j}`, so the masses of a block that sees a key sum to one. The
//! reference set is the oracle's (`attnproof_oracle::pyramid::diagnose_masses`): the forced leaves of the block's
//! last visible position (first, previous, current) and then the eligible leaves of largest mass, `K` in all, ties to
//! the lower leaf; Recall@K is the share of the reference set the list holds, the mass ratio the list's captured mass
//! over the reference set's. The oracle's per-query `diagnostics` averaged over a block's rows gives the same masses.
//!
//! # Precision
//!
//! The kernel widens the 16-bit inputs exactly and works in f64 in a fixed order (its header spells it out), so a run
//! is bitwise reproducible and every mass is within `attnproof_proofs::pyramid_bound::mass_relative_bound` of its
//! exact value, relatively; `attnproof_harness::pyramid_diagnostics` holds the masses to it around the oracle's. The
//! sets and ratios are then integer and f64 work on the host, by the oracle's own functions.
//!
//! # Cost
//!
//! Two passes over the visible keys per (row, head) pair on the CUDA cores in f64: `O(N² · Hq · d)`, a dense
//! attention's work without its tensor cores. It is a measuring instrument for a layer's worth of queries, not a
//! kernel for training.

use std::sync::Arc;

use attnproof_oracle::bsa::BsaConfig;
use attnproof_oracle::pyramid::{Diagnostics, diagnose_masses};
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, OracleError};
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::{Array4, ArrayViewD, s};

use super::block_position;
use crate::block_sparse::select as bsa;
use crate::block_sparse::{BlockLists, ListHeads};
use crate::common::{GpuElement, check_len};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::launch;

/// `gpu/kernels/pisa_mass.cu` after the shared helpers and the block selector (its `sequence_lengths`).
pub const PISA_MASS: KernelSource = KernelSource {
    name: "pisa_mass",
    source: concat!(
        include_str!("../../kernels/common.cuh"),
        include_str!("../../kernels/bsa_select.cu"),
        include_str!("../../kernels/pisa_mass.cu")
    ),
};

/// Threads per CTA of `pisa_block_mass` (the kernel's `MASS_THREADS`): the (row, head) pairs of one chunk.
const MASS_THREADS: usize = 128;
/// Keys per shared-memory tile (the kernel's `MASS_KEYS`).
const MASS_KEYS: usize = 32;

/// The blocks the masses are taken over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MassConfig {
    /// Query rows per query block (64 or 128), as the selector's.
    pub q_block: usize,
    /// Keys per leaf (key block: 64 or 128), as the lists'.
    pub leaf_size: usize,
}

impl MassConfig {
    /// The block selector's view of the same blocks (the width is unused: the masses have no list).
    fn blocks(&self) -> BsaConfig {
        BsaConfig { q_block: self.q_block, kv_block: self.leaf_size, top_k: 1, force_first: false, force_local: 0 }
    }
}

/// The masses' shape: `[B, Hkv, ⌈max Lq / q_block⌉, ⌈max Lk / leaf_size⌉]`.
pub fn masses_shape(spec: &AttentionSpec, config: &MassConfig) -> [usize; 4] {
    let blocks = config.blocks();
    let leaves = spec.sequences().iter().map(|s| blocks.key_blocks(s)).max().unwrap_or(0);
    let [b, heads, query_blocks, _] = bsa::lists_shape(spec, &blocks);
    [b, heads, query_blocks, leaves]
}

/// Dynamic shared memory of one CTA: the chunk's queries by column (padded) and one key tile, f32.
fn shared_bytes(head_dim: usize) -> usize {
    4 * head_dim * (MASS_THREADS + 1 + MASS_KEYS)
}

/// The block masses of `spec` under `config` on device buffers: `q`, `k` hold Q and K in the spec's layout, and the
/// masses go to the first [`masses_shape`] elements of `masses` (every one written). Every check runs before the
/// launch, which is asynchronous on `stream`.
pub fn block_masses_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &MassConfig,
    kernel: KernelSource,
    (q, k): (&CudaSlice<T>, &CudaSlice<T>),
    masses: &mut CudaSlice<f64>,
) -> Result<(), GpuError> {
    let plan = bsa::plan(spec, &config.blocks())?;
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_len("q", q, size(Operand::Q))?;
    check_len("k", k, size(Operand::K))?;
    let shape = masses_shape(spec, config);
    check_len("masses", masses, shape.iter().product())?;
    if shape.iter().product::<usize>() == 0 {
        return Ok(());
    }
    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &[T::DEFINE.to_owned()])?;
    let func = module
        .load_function("pisa_block_mass")
        .map_err(|e| GpuError::driver("cuModuleGetFunction(pisa_block_mass)", e))?;
    let shared = shared_bytes(spec.head_dim);
    compile::allow_shared_memory(ctx, &func, shared, "head_dim")?;
    let up = |v: &[i32]| stream.clone_htod(v).map_err(|e| GpuError::driver("cuMemcpyHtoD(cu_seqlens)", e));
    let (cu_q, cu_k) = (up(&plan.cu_q)?, up(&plan.cu_k)?);
    let cfg = LaunchConfig {
        grid_dim: bsa::grid(plan.query_blocks, spec.n_heads_kv, plan.batch)?,
        block_dim: (MASS_THREADS as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    launch::launch_pisa_block_mass(stream, &func, cfg, (q, k), masses, (&cu_q, &cu_k), &plan.params)
}

/// The block masses from host tensors (copies in, launches, copies out, synchronizes): `[B, Hkv, query blocks,
/// leaves]`.
pub fn block_masses<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &MassConfig,
    q: ArrayViewD<'_, T>,
    k: ArrayViewD<'_, T>,
) -> Result<Array4<f64>, GpuError> {
    spec.validate()?;
    bsa::plan(spec, &config.blocks())?;
    let (dq, dk) = bsa::upload_queries_and_keys(stream, spec, q, k)?;
    let shape = masses_shape(spec, config);
    let len = shape.iter().product::<usize>();
    let mut masses = stream.alloc_zeros::<f64>(len.max(1)).map_err(|e| GpuError::driver("cuMemAlloc", e))?;
    block_masses_device(stream, spec, config, PISA_MASS, (&dq, &dk), &mut masses)?;
    let mut host = stream.clone_dtoh(&masses).map_err(|e| GpuError::driver("cuMemcpyDtoH", e))?;
    stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
    host.truncate(len);
    Ok(Array4::from_shape_vec(shape, host).expect("length matches the shape"))
}

/// E30 of one query block's list.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockDiagnostics {
    /// Where: (sequence, KV head, query block).
    pub at: [usize; 3],
    /// The oracle's diagnostics of the list from the block's masses.
    pub diagnostics: Diagnostics<f64>,
}

/// E30 of `lists` from `masses` (of [`block_masses`] for the same spec, blocks of `lists`' sizes), per (sequence, KV
/// head, query block) that sees a key, in that order, with reference sets of `keep` leaves. Lists per query head are not diagnosed (the masses are per KV head).
pub fn diagnose(
    spec: &AttentionSpec,
    masses: &Array4<f64>,
    lists: &BlockLists,
    keep: usize,
) -> Result<Vec<BlockDiagnostics>, GpuError> {
    lists.validate(spec)?;
    if lists.heads != ListHeads::PerKvHead {
        return Err(GpuError::Unsupported {
            argument: "lists",
            reason: "the masses are per KV head: diagnose lists per KV head (the selectors' lists)".into(),
        });
    }
    let config = MassConfig { q_block: lists.q_block, leaf_size: lists.kv_block };
    let shape = masses_shape(spec, &config);
    if masses.shape() != shape {
        return Err(GpuError::Shape { argument: "masses", expected: shape.to_vec(), actual: masses.shape().to_vec() });
    }
    if keep == 0 {
        return Err(GpuError::Spec(OracleError::ZeroDimension { argument: "keep" }));
    }
    let mut out = vec![];
    for (seq_index, seq) in spec.sequences().iter().enumerate() {
        for kv in 0..shape[1] {
            for a in 0..shape[2] {
                let Some((_, position)) = block_position(spec, seq, config.q_block, a) else { continue };
                let selected: Vec<usize> = lists
                    .lists
                    .slice(s![seq_index, kv, a, ..])
                    .iter()
                    .filter(|&&b| b >= 0)
                    .map(|&b| b as usize)
                    .collect();
                let mass = masses.slice(s![seq_index, kv, a, ..]).to_vec();
                let diagnostics = diagnose_masses(mass, position, config.leaf_size, &selected, keep, ());
                out.push(BlockDiagnostics { at: [seq_index, kv, a], diagnostics });
            }
        }
    }
    Ok(out)
}

/// The means over query blocks of Recall@K and of the mass ratio, and the smallest mass ratio, of [`diagnose`]'s
/// rows; `None` when no query block sees a key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DiagnosticsSummary {
    /// Query blocks diagnosed.
    pub blocks: usize,
    /// Mean Recall@K.
    pub recall: f64,
    /// Mean attention-mass ratio.
    pub mass_ratio: f64,
    /// Smallest attention-mass ratio.
    pub worst_mass_ratio: f64,
}

/// Summarizes [`diagnose`]'s rows.
pub fn summarize(rows: &[BlockDiagnostics]) -> Option<DiagnosticsSummary> {
    if rows.is_empty() {
        return None;
    }
    let n = rows.len() as f64;
    Some(DiagnosticsSummary {
        blocks: rows.len(),
        recall: rows.iter().map(|r| r.diagnostics.recall).sum::<f64>() / n,
        mass_ratio: rows.iter().map(|r| r.diagnostics.mass_ratio).sum::<f64>() / n,
        worst_mass_ratio: rows.iter().map(|r| r.diagnostics.mass_ratio).fold(f64::INFINITY, f64::min),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::{Layout, Mask};

    #[test]
    fn shapes_and_shared_memory_follow_the_longest_sequence() {
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 0, 300], cu_seqlens_k: vec![0, 130, 400] },
            ..AttentionSpec::dense(1, 6, 2, 1, 1, 32, 32)
        }
        .with_mask(Mask::Causal);
        let config = MassConfig { q_block: 64, leaf_size: 128 };
        assert_eq!(masses_shape(&spec, &config), [2, 2, 5, 3]);
        // 256 columns: 128 + 1 padded query columns and a tile of 32 keys, f32, fit the opt-in shared memory.
        assert_eq!(shared_bytes(256), 4 * 256 * 161);
        assert!(shared_bytes(256) <= 227 * 1024);
    }

    #[test]
    fn diagnose_checks_its_inputs_and_applies_the_oracle() {
        // One sequence of 3 query blocks over 4 leaves of 64 keys, causal: block 2's position is 255 (leaf 3).
        let spec = AttentionSpec::dense(1, 2, 1, 192, 256, 8, 8).with_mask(Mask::Causal);
        let config = MassConfig { q_block: 64, leaf_size: 64 };
        let mut masses = Array4::zeros(masses_shape(&spec, &config));
        for a in 0..3 {
            for (b, m) in [0.1, 0.2, 0.3, 0.4].into_iter().enumerate() {
                masses[[0, 0, a, b]] = m;
            }
        }
        let mut lists = Array4::from_elem([1, 1, 3, 2], -1);
        lists[[0, 0, 2, 0]] = 1;
        lists[[0, 0, 2, 1]] = 3;
        let block_lists = BlockLists { q_block: 64, kv_block: 64, heads: ListHeads::PerKvHead, lists };
        let rows = diagnose(&spec, &masses, &block_lists, 3).unwrap();
        assert_eq!(rows.len(), 3, "every block sees a key (Lk > Lq shifts the diagonal right)");
        let BlockDiagnostics { at, diagnostics: last } = &rows[2];
        assert_eq!(*at, [0, 0, 2]);
        // Position 255: forced leaves 0, 2, 3; the list {1, 3} holds one of them.
        assert_eq!(last.reference, [0, 2, 3]);
        assert!((last.recall - 1.0 / 3.0).abs() < 1e-15);
        assert!((last.mass_ratio - 0.6 / 0.8).abs() < 1e-15);
        // Blocks 0 and 1 list nothing: recall and ratio 0; the means are over the three blocks.
        let summary = summarize(&rows).unwrap();
        assert_eq!(summary.blocks, 3);
        assert!((summary.recall - 1.0 / 9.0).abs() < 1e-15, "{summary:?}");
        assert!((summary.mass_ratio - 0.25).abs() < 1e-15, "{summary:?}");
        assert_eq!(summary.worst_mass_ratio, 0.0);
        assert!(summarize(&[]).is_none());
        // Masses of another shape, lists of another extent, a list entry past the leaves, K = 0: typed errors.
        let short = Array4::zeros([1, 1, 3, 3]);
        assert!(matches!(diagnose(&spec, &short, &block_lists, 3), Err(GpuError::Shape { argument: "masses", .. })));
        let narrow = BlockLists { lists: Array4::from_elem([1, 1, 2, 2], -1), ..block_lists.clone() };
        assert!(matches!(diagnose(&spec, &masses, &narrow, 3), Err(GpuError::Shape { argument: "lists", .. })));
        let mut past = block_lists.clone();
        past.lists[[0, 0, 1, 0]] = 4;
        assert!(matches!(diagnose(&spec, &masses, &past, 3), Err(GpuError::BlockList { position: [0, 0, 1, 0], .. })));
        let per_query_head = BlockLists {
            heads: ListHeads::PerQueryHead,
            lists: Array4::from_elem([1, 2, 3, 2], -1),
            ..block_lists.clone()
        };
        assert!(matches!(
            diagnose(&spec, &masses, &per_query_head, 3),
            Err(GpuError::Unsupported { argument: "lists", .. })
        ));
        assert!(matches!(diagnose(&spec, &masses, &block_lists, 0), Err(GpuError::Spec(_))));
    }
}
