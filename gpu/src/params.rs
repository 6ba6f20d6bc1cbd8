//! The kernels' parameter structs, one per kernel family, each passed by value as one kernel argument and mirrored
//! field for field by a struct of `gpu/kernels/common.cuh` (the model is FlashAttention's `Flash_fwd_params`):
//! [`FlashParams`] (the attention problem's scalars: layout, lengths, GQA group, head dims, strides, scale, window
//! reaches) for `flash_fwd` and, inside [`BackwardParams`], for every kernel of `flash_bwd.cu`; [`RingStateParams`]
//! for `ring_state.cu`'s merge and finalize; [`BlockListParams`] for the block lists of the block-sparse
//! modes of `flash_fwd` and `flash_bwd`; [`BsaParams`] for `bsa_select.cu`'s block selection; [`NsaParams`] for the NSA
//! compression and gates; [`NsaSelectParams`] for NSA's block selection; [`DsaIndexParams`] for DSA's lightning
//! indexer; [`DsaSparseParams`] for DSA's token-sparse attention; [`DsaLossParams`] for DSA's indexer loss;
//! [`PisaParams`] for PISA's pyramid selection; [`PisaTailParams`] for PISA's first-order tail; [`HilsParams`] for
//! HiLS's chunk summaries and router.
//!
//! The structs are `#[repr(C)]`, of `i64`, `i32` and `f32` fields only, ordered so that no field needs padding before
//! it, with an explicit `reserved` field where the size must round up to the 8-byte alignment: every byte the driver
//! copies is initialised. `common.cuh` pins the C layout with `static_assert`s (`PARAM_SIZE`, `PARAM_AT`), which NVRTC
//! checks at every compile; this module's tests read those lines and compare them with `size_of` and `offset_of!` of
//! the Rust structs, so neither side can drift alone. `gpu/src/launch.rs` declares them `DeviceRepr`.

use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Layout};

use crate::common::{KernelMask, MAX_HEAD_DIM, NO_BOUND, kernel_scale, to_i32};
use crate::error::GpuError;

/// The define the dense kernels (`flash_fwd`, `flash_bwd` and their sm_90a twins) are compiled with for NSA's strided
/// causal mask (`Diagonal` in `gpu/kernels/common.cuh`): a row's diagonal is then `⌊(i + diag_offset)/diag_stride⌋`.
/// The launch plans add it exactly when [`FlashParams::diag_stride`] is not 0 ([`FlashParams::diagonal_define`]).
pub(crate) const STRIDED_DIAGONAL: &str = "STRIDED_DIAGONAL";

/// The attention problem's scalars (`struct FlashParams` of `common.cuh`), read by `flash_fwd` and every backward
/// kernel. Strides are in elements; the dense layout is `[B, H, L, D]` (LSE `[B, Hq, Lq]`), the varlen layout
/// `[T, H, D]` with a batch stride of 0 and the rows of all sequences packed (LSE `[Hq, Tq]`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct FlashParams {
    /// Batch stride of Q.
    pub q_batch: i64,
    /// Head stride of Q.
    pub q_head: i64,
    /// Row stride of Q.
    pub q_row: i64,
    /// Batch stride of K.
    pub k_batch: i64,
    /// Head stride of K.
    pub k_head: i64,
    /// Row stride of K.
    pub k_row: i64,
    /// Batch stride of V.
    pub v_batch: i64,
    /// Head stride of V.
    pub v_head: i64,
    /// Row stride of V.
    pub v_row: i64,
    /// Batch stride of O (and dO).
    pub o_batch: i64,
    /// Head stride of O.
    pub o_head: i64,
    /// Row stride of O.
    pub o_row: i64,
    /// Batch stride of LSE (and `D`).
    pub lse_batch: i64,
    /// Head stride of LSE: `Lq` dense, the packed total `Tq` varlen.
    pub lse_head: i64,
    /// 1 for the varlen layout (sequences from `cu_seqlens`), 0 for dense.
    pub varlen: i32,
    /// `Lq` of every sequence of a dense problem (0 varlen).
    pub dense_len_q: i32,
    /// `Lk` of every sequence of a dense problem (0 varlen).
    pub dense_len_k: i32,
    /// Query heads per KV head.
    pub group: i32,
    /// Head dim of Q and K.
    pub d: i32,
    /// Head dim of V and O.
    pub dv: i32,
    /// The softmax scale the kernels multiply by ([`kernel_scale`]).
    pub scale: f32,
    /// Reach left of the row's diagonal ([`NO_BOUND`]: unbounded).
    pub win_left: i32,
    /// Reach right of the diagonal ([`NO_BOUND`]: unbounded; causal is 0).
    pub win_right: i32,
    /// 0: the diagonal of row `i` is bottom-right aligned, `i + Lk − Lq`; `s ≥ 1`: NSA's strided causal diagonal
    /// `⌊(i + diag_offset)/s⌋` ([`crate::common::Diagonal`]).
    pub diag_stride: i32,
    /// With `diag_stride ≥ 1`: `1 − l` for compression windows of `l` tokens; otherwise 0.
    pub diag_offset: i32,
    /// Explicit tail padding, always 0.
    pub reserved: i32,
}

/// The backward family's parameters (`struct BackwardParams` of `common.cuh`): the problem and the trailing scalars of
/// `flash_bwd.cu`'s kernels, of which each kernel reads its own (`bwd_kv`: `dq_mode`, `n_chunks`, `part_stride`,
/// `total_k`; `bwd_kv_group_sum`: `n_heads_q`, `total_k`; `bwd_dq`: `n_chunks`; `bwd_dq_finalize`: `finalize_mode`,
/// `part_stride`). Fields a kernel does not read are 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct BackwardParams {
    /// The problem.
    pub flash: FlashParams,
    /// Elements between two KV tiles' dQ partials (Q's element count).
    pub part_stride: i64,
    /// K rows over all sequences: the row count of the GQA and `KV_ACCUM` workspaces.
    pub total_k: i64,
    /// `bwd_kv`'s dQ: 0 none (strategy A), 1 atomic accumulator, 2 per-KV-tile partials.
    pub dq_mode: i32,
    /// Column chunks per query head (`bwd_kv`: of `max(d, dv)`; `bwd_dq`: of `d`).
    pub n_chunks: i32,
    /// Query heads (`bwd_kv_group_sum`).
    pub n_heads_q: i32,
    /// `bwd_dq_finalize`: 0 from the atomic accumulator, 1 from the partials in ascending KV tile order.
    pub finalize_mode: i32,
}

/// The block lists of block-sparse attention (`struct BlockListParams` of `common.cuh`), passed beside the family's
/// own parameters to `flash_fwd` and `flash_bwd` compiled with `BLOCK_SPARSE`. The lists are `[B, list heads, query blocks, width]`
/// `i32` in row-major order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BlockListParams {
    /// Elements between two sequences' lists.
    pub seq_stride: i64,
    /// Elements between two list heads' lists.
    pub head_stride: i64,
    /// Entries per list.
    pub width: i32,
    /// Query rows per query block (a multiple of the CTA's rows).
    pub q_block: i32,
    /// 64-key KV tiles per key block.
    pub tiles_per_block: i32,
    /// Query heads sharing one list head: 1, or the GQA group when the lists are per KV head.
    pub heads_per_list: i32,
    /// List heads per sequence.
    pub list_heads: i32,
    /// Query blocks per list head (of the longest query sequence).
    pub q_blocks: i32,
    /// Key blocks of the longest key sequence: the backward's CSR rows per (sequence, list head).
    pub kv_blocks: i32,
    /// Explicit tail padding, always 0.
    pub reserved: i32,
}

/// The block selector's scalars (`struct BsaParams` of `common.cuh`), read by `bsa_select.cu`'s `bsa_pool_keys` and
/// `bsa_select`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct BsaParams {
    /// The problem (Q and K layout, lengths, group, head dim).
    pub flash: FlashParams,
    /// The softmax scale in f64.
    pub scale: f64,
    /// Query rows per query block.
    pub q_block: i32,
    /// Keys per key block.
    pub kv_block: i32,
    /// Entries per list.
    pub top_k: i32,
    /// 1 when key block 0 is always kept.
    pub force_first: i32,
    /// How many of the last eligible blocks are always kept.
    pub force_local: i32,
    /// 1 for bottom-right causal eligibility.
    pub causal: i32,
    /// KV heads.
    pub n_heads_kv: i32,
    /// Key blocks of the longest sequence.
    pub n_key_blocks: i32,
    /// Element of the f64 workspace where the pooled queries start.
    pub pooled_queries_at: i64,
    /// Query blocks of the longest sequence: the lists' and the pooled queries' extent.
    pub n_query_blocks: i32,
    /// The first query block of a launch that covers a range of them (the selector's chunks); 0 for all of them.
    pub first_query_block: i32,
}

/// The pyramid selector's scalars (`struct PisaParams` of `common.cuh`), read by `pisa_select.cu`: the block selector's
/// (the leaves are its key blocks, the list width its `top_k`) and the pyramid's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct PisaParams {
    /// The problem, the scale, the query block, the leaf size (`kv_block`) and the list width (`top_k`).
    pub bsa: BsaParams,
    /// Element of the f64 workspace where level 1's means start.
    pub levels_at: i64,
    /// Sequences.
    pub batch: i32,
    /// Children per node `β`.
    pub branching: i32,
    /// Nodes kept per level `K`, forced ones included.
    pub keep: i32,
    /// 0 LSE, 1 PISA-1, 2 PISA-2.
    pub scoring: i32,
    /// Levels of the longest sequence's pyramid, leaves to root.
    pub n_levels: i32,
    /// `max(K, 3) · β`: candidates per level at most, the trace's entries per level.
    pub max_candidates: i32,
}

/// HiLS's scalars (`struct HilsParams` of `common.cuh`), read by `hils.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct HilsParams {
    /// The problem (Q and K layouts, lengths, group, head dim).
    pub flash: FlashParams,
    /// `1/√d` in f64.
    pub scale: f64,
    /// Keys per chunk `C`.
    pub chunk_size: i32,
    /// The local window `w`.
    pub local_window: i32,
    /// Chunks routed per query `K`.
    pub top_k: i32,
    /// Chunks of the longest sequence.
    pub n_chunks: i32,
    /// The longest sequence.
    pub max_len: i32,
    /// 1 when the router writes its scores.
    pub write_scores: i32,
    /// `hils_output`: 1 weighs a retrieved chunk by its exact log-mass, 0 by its router score.
    pub exact_mass: i32,
    /// Explicit tail padding, always 0.
    pub reserved: i32,
}

/// PISA's tail scalars (`struct PisaTailParams` of `common.cuh`), read by `pisa_tail.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct PisaTailParams {
    /// The problem (Q, K, V, O and LSE layouts, lengths, group, head dims).
    pub flash: FlashParams,
    /// The softmax scale in f64.
    pub scale: f64,
    /// Element of the f64 workspace where the blocks' mean values start.
    pub value_means_at: i64,
    /// Element of the f64 workspace where `H̄` starts.
    pub hbar_at: i64,
    /// Element of the f64 workspace where `H̄`'s partial sums `[splits, B, Hkv, d, dv]` start.
    pub hbar_partials_at: i64,
    /// Element of the storage-type workspace where the rounded mean values start (the split mean keys start at 0).
    pub pooled_values_at: i64,
    /// Element of the storage-type workspace where the split `H̄` starts.
    pub pooled_hbar_at: i64,
    /// Query rows per query block of the lists.
    pub q_block: i32,
    /// Keys per key block: the tail's block size.
    pub kv_block: i32,
    /// 1 for the bottom-right causal mask, 0 for none.
    pub causal: i32,
    /// KV heads.
    pub n_heads_kv: i32,
    /// Key blocks of the longest sequence.
    pub n_key_blocks: i32,
    /// Query blocks of the longest sequence.
    pub n_query_blocks: i32,
    /// Entries per list.
    pub list_width: i32,
    /// 1 when the lists are per KV head, 0 per query head.
    pub lists_per_kv_head: i32,
    /// Key ranges of `H̄`'s partial sums (`pisa::tail::HBAR_SPLIT_KEYS` keys each) of the longest sequence.
    pub hbar_splits: i32,
    /// Pads the struct to its 8-byte alignment.
    pub reserved: i32,
}

/// The lightning indexer's scalars (`struct DsaIndexParams` of `common.cuh`), read by `dsa_index.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct DsaIndexParams {
    /// f32 elements between two score rows of the scratch (a multiple of 4, at least `seq_len`).
    pub scratch_stride: i64,
    /// Tokens `T`.
    pub seq_len: i32,
    /// Indexer heads `H_I`.
    pub n_heads: i32,
    /// Entries per selection row.
    pub top_k: i32,
    /// 1: the scratch holds one row per token (the caller's score matrix); 0: rows per resident CTA.
    pub full_scores: i32,
    /// Query groups of four tokens, `⌈T / 4⌉`.
    pub n_groups: i32,
    /// Tail padding, always 0.
    pub reserved: i32,
}

/// The indexer loss's scalars (`struct DsaLossParams` of `common.cuh`), read by `dsa_loss.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct DsaLossParams {
    /// Tokens `T`.
    pub seq_len: i32,
    /// Entries per list.
    pub top_k: i32,
    /// Indexer heads `H_I`.
    pub index_heads: i32,
    /// The main attention's query heads `H`.
    pub n_heads: i32,
    /// Its KV heads.
    pub n_heads_kv: i32,
    /// Its query and key head dim `d`.
    pub head_dim: i32,
    /// Its softmax scale `α`.
    pub scale: f32,
    /// Tail padding, always 0.
    pub reserved: i32,
}

/// The scalars of DSA's token-sparse attention (`struct DsaSparseParams` of `common.cuh`), read by `dsa_sparse.cu` and
/// `dsa_sparse_bwd.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct DsaSparseParams {
    /// The layer's problem (causal self-attention, GQA, dense or varlen) under its scale.
    pub flash: FlashParams,
    /// Token rows of the lists (`B · L` dense, the packed total varlen).
    pub token_rows: i64,
    /// Entries per list.
    pub top_k: i32,
    /// 1: one list per token shared by every KV head; `n_heads_kv`: one list per KV head.
    pub list_heads: i32,
    /// CTAs per (token, KV head): `⌈G / SPARSE_ROWS⌉` (`⌈G / 64⌉` for groups above 64, as the backward splits them).
    pub head_chunks: i32,
    /// The backward's CTAs per (token, head chunk): one per `CHUNK` columns of the head dims; 1 in the forward.
    pub column_chunks: i32,
}

/// The NSA kernels' scalars (`struct NsaParams` of `common.cuh`), read by `nsa_compress.cu` and `nsa_gates.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct NsaParams {
    /// The problem (K and V layout, lengths, head dims; the gates read `dv`).
    pub flash: FlashParams,
    /// Rows of O (`B · Hq · Lq` dense, `Tq · Hq` varlen): the gates' rows.
    pub rows: i64,
    /// Tokens per compression window `l`.
    pub compress_len: i32,
    /// Tokens between two windows' first tokens `s`.
    pub compress_stride: i32,
    /// KV heads.
    pub n_heads_kv: i32,
    /// Complete windows of every sequence of a dense problem (0 when varlen).
    pub dense_windows: i32,
    /// φ_K's kind (`nsa_compress.cu`'s `MAP_*`): 0 the mean, 1 position weights, 2 the learned matrix; its weights
    /// come first in the weights buffer.
    pub weighted_keys: i32,
    /// φ_V's kind, as `weighted_keys`; its weights follow φ_K's (`l` of them, or `l·d²` for φ_K's matrix).
    pub weighted_values: i32,
}

/// The scalars of NSA's selection branch: `nsa_select.cu`'s block scoring and top-n and `nsa_selected.cu`'s
/// attention (`struct NsaSelectParams` of `common.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct NsaSelectParams {
    /// The scoring's and top-n's compressed attention problem (Q as the layer's, K the compressed keys, its LSE and
    /// scale), or the selected attention's layer problem (Q, K, V, O, LSE, the configuration's scale).
    pub flash: FlashParams,
    /// Token rows of the scores and lists (`B · L` dense, the packed total varlen).
    pub token_rows: i64,
    /// Tokens per compression window `l`.
    pub compress_len: i32,
    /// Tokens between two windows' first tokens `s`.
    pub compress_stride: i32,
    /// Tokens per selection block `l'`.
    pub select_block: i32,
    /// Selection blocks of the longest sequence: the scores' columns.
    pub n_blocks: i32,
    /// Entries per list `n`, forced blocks included.
    pub n_selected: i32,
    /// The first blocks every token keeps.
    pub n_forced_initial: i32,
    /// The most recent blocks every token keeps.
    pub n_forced_local: i32,
    /// KV heads.
    pub n_heads_kv: i32,
    /// Tokens per `nsa_block_scores` and `nsa_selected_fwd` CTA, `⌊64 / G⌋`.
    pub tokens_per_cta: i32,
    /// The most selection blocks one tile of 64 windows touches, `⌊(63·s + l − 1)/l'⌋ + 2`: the length of the
    /// kernel's per-tile tables of each block's windows (0 for `nsa_selected_fwd`, which has none).
    pub tile_blocks: i32,
}

/// The scalars of `ring_state.cu`'s `state_merge` (which reads `rows` and `dv`) and `state_finalize` (all of them):
/// `struct RingStateParams` of `common.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RingStateParams {
    /// State rows (the spec's LSE rows).
    pub rows: i64,
    /// Varlen: rows of one query head (`Tq`), which maps an LSE row to O's packed row.
    pub rows_per_head: i64,
    /// Columns of `A` and `O`.
    pub dv: i32,
    /// 1 when O is packed `[Tq, Hq, dv]`, 0 when dense `[B, Hq, Lq, dv]`.
    pub varlen: i32,
    /// Query heads (varlen).
    pub n_heads: i32,
    /// Explicit tail padding, always 0.
    pub reserved: i32,
}

impl FlashParams {
    /// The problem's scalars for a supported, validated spec, with the sequence offsets `cu_seqlens_q` and
    /// `cu_seqlens_k` (`[0, 0]` for a dense spec, whose kernels never read them): the head-dim and mask checks, the
    /// strides of each layout, and the 32-bit limits. The forward and backward launch plans both start from it.
    pub(crate) fn for_spec(spec: &AttentionSpec) -> Result<(FlashParams, Vec<i32>, Vec<i32>), GpuError> {
        spec.validate()?;
        for (argument, dim) in [("head_dim", spec.head_dim), ("head_dim_v", spec.head_dim_v)] {
            if !dim.is_multiple_of(8) || dim > MAX_HEAD_DIM {
                return Err(GpuError::Unsupported {
                    argument,
                    reason: format!("{dim} is not a multiple of 8 in 8..={MAX_HEAD_DIM}"),
                });
            }
        }
        let mask = KernelMask::from_mask(&spec.mask)?;
        let (d, dv, hq, hkv) = (spec.head_dim, spec.head_dim_v, spec.n_heads_q, spec.n_heads_kv);
        let (varlen, len_q, len_k, q, k, v, o, lse, cu_q, cu_k) = match &spec.layout {
            Layout::Dense { len_q, len_k, .. } => {
                let (lq, lk) = (*len_q as i64, *len_k as i64);
                let (dq, dk, dvv) = (d as i64, d as i64, dv as i64);
                (
                    0,
                    *len_q,
                    *len_k,
                    [hq as i64 * lq * dq, lq * dq, dq],
                    [hkv as i64 * lk * dk, lk * dk, dk],
                    [hkv as i64 * lk * dvv, lk * dvv, dvv],
                    [hq as i64 * lq * dvv, lq * dvv, dvv],
                    [hq as i64 * lq, lq],
                    vec![0, 0],
                    vec![0, 0],
                )
            }
            Layout::Varlen { cu_seqlens_q, cu_seqlens_k } => {
                let total_q = *cu_seqlens_q.last().expect("validated: non-empty") as i64;
                (
                    1,
                    0,
                    0,
                    [0, d as i64, (hq * d) as i64],
                    [0, d as i64, (hkv * d) as i64],
                    [0, dv as i64, (hkv * dv) as i64],
                    [0, dv as i64, (hq * dv) as i64],
                    [0, total_q],
                    cu_seqlens_q.clone(),
                    cu_seqlens_k.clone(),
                )
            }
        };
        // Every element offset the kernel forms must fit its 64-bit arithmetic, and lengths its 32-bit `int`s.
        for op in [Operand::Q, Operand::K, Operand::V, Operand::O] {
            let n: usize = spec.expected_shape(op).iter().product();
            to_i32("tensor elements / 8", n / 8)?;
        }
        // The kernels form key positions relative to the diagonal (`i + Lk − Lq ± reach`, reach ≤ 2^30) in 32-bit
        // ints.
        for seq in spec.sequences() {
            if seq.len_q + seq.len_k > NO_BOUND as usize {
                return Err(GpuError::TooLarge {
                    argument: "len_q + len_k of one sequence",
                    value: seq.len_q + seq.len_k,
                });
            }
        }
        let params = FlashParams {
            q_batch: q[0],
            q_head: q[1],
            q_row: q[2],
            k_batch: k[0],
            k_head: k[1],
            k_row: k[2],
            v_batch: v[0],
            v_head: v[1],
            v_row: v[2],
            o_batch: o[0],
            o_head: o[1],
            o_row: o[2],
            lse_batch: lse[0],
            lse_head: lse[1],
            varlen,
            dense_len_q: to_i32("len_q", len_q)?,
            dense_len_k: to_i32("len_k", len_k)?,
            group: to_i32("n_heads_q / n_heads_kv", spec.group_size())?,
            d: to_i32("head_dim", d)?,
            dv: to_i32("head_dim_v", dv)?,
            scale: kernel_scale(spec),
            win_left: KernelMask::kernel_value(mask.left),
            win_right: KernelMask::kernel_value(mask.right),
            diag_stride: mask.diagonal.kernel_stride()?,
            diag_offset: mask.diagonal.kernel_offset()?,
            reserved: 0,
        };
        Ok((params, cu_q, cu_k))
    }

    /// The define that compiles the dense kernels' strided diagonal ([`STRIDED_DIAGONAL`]), exactly when these
    /// parameters carry one: the kernels read `diag_stride` and `diag_offset` only under it.
    pub(crate) fn diagonal_define(&self) -> Option<String> {
        (self.diag_stride != 0).then(|| STRIDED_DIAGONAL.to_owned())
    }

    /// The (batch, head, row) strides of Q.
    #[cfg(test)]
    pub(crate) fn q_strides(&self) -> [i64; 3] {
        [self.q_batch, self.q_head, self.q_row]
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::mem::{offset_of, size_of, size_of_val};

    use super::*;

    /// The kernels' header, whose `static_assert`s NVRTC checks.
    const HEADER: &str = include_str!("../kernels/common.cuh");

    /// One struct's layout: its size, and (field, byte offset) in declaration order.
    type Layouts = BTreeMap<String, (usize, Vec<(String, usize)>)>;

    /// The arguments of `NAME(a, b, c);` lines of the header, for `NAME` = `PARAM_SIZE` or `PARAM_AT`.
    fn macro_lines<'a>(name: &'a str) -> impl Iterator<Item = Vec<String>> + 'a {
        HEADER.lines().filter_map(move |line| {
            let args = line.trim().strip_prefix(name)?.strip_prefix('(')?.strip_suffix(");")?;
            Some(args.split(',').map(|a| a.trim().to_owned()).collect())
        })
    }

    /// The layouts `common.cuh` asserts.
    fn header_layouts() -> Layouts {
        let mut out = Layouts::new();
        for args in macro_lines("PARAM_SIZE") {
            out.insert(args[0].clone(), (args[1].parse().expect("a byte count"), vec![]));
        }
        for args in macro_lines("PARAM_AT") {
            let entry = out.get_mut(&args[0]).expect("PARAM_SIZE precedes the struct's PARAM_AT lines");
            entry.1.push((args[1].clone(), args[2].parse().expect("a byte offset")));
        }
        out
    }

    /// The member names of `struct name { ... };` in the header, in declaration order (one member per line).
    fn header_members(name: &str) -> Vec<String> {
        let start = format!("struct {name} {{");
        let body = HEADER.split(start.as_str()).nth(1).expect("the struct is in common.cuh");
        let body = body.split("};").next().expect("the struct ends");
        body.lines()
            .map(|l| l.split("//").next().unwrap_or("").trim())
            .filter(|l| !l.is_empty())
            .map(|l| l.trim_end_matches(';').rsplit(' ').next().expect("a member name").to_owned())
            .collect()
    }

    /// A struct's Rust layout from `size_of` and `offset_of!`, and the sum of its listed fields' sizes.
    macro_rules! rust_layout {
        ($t:ident { $($f:ident),* $(,)? }) => {{
            let value = $t::default();
            let fields = vec![$((stringify!($f).to_owned(), offset_of!($t, $f))),*];
            let bytes: usize = 0 $(+ size_of_val(&value.$f))*;
            (stringify!($t).to_owned(), size_of::<$t>(), fields, bytes)
        }};
    }

    #[test]
    fn rust_and_cuda_structs_have_one_layout() {
        let rust = [
            rust_layout!(FlashParams {
                q_batch,
                q_head,
                q_row,
                k_batch,
                k_head,
                k_row,
                v_batch,
                v_head,
                v_row,
                o_batch,
                o_head,
                o_row,
                lse_batch,
                lse_head,
                varlen,
                dense_len_q,
                dense_len_k,
                group,
                d,
                dv,
                scale,
                win_left,
                win_right,
                diag_stride,
                diag_offset,
                reserved,
            }),
            rust_layout!(BackwardParams { flash, part_stride, total_k, dq_mode, n_chunks, n_heads_q, finalize_mode }),
            rust_layout!(RingStateParams { rows, rows_per_head, dv, varlen, n_heads, reserved }),
            rust_layout!(BlockListParams {
                seq_stride,
                head_stride,
                width,
                q_block,
                tiles_per_block,
                heads_per_list,
                list_heads,
                q_blocks,
                kv_blocks,
                reserved
            }),
            rust_layout!(NsaParams {
                flash,
                rows,
                compress_len,
                compress_stride,
                n_heads_kv,
                dense_windows,
                weighted_keys,
                weighted_values
            }),
            rust_layout!(NsaSelectParams {
                flash,
                token_rows,
                compress_len,
                compress_stride,
                select_block,
                n_blocks,
                n_selected,
                n_forced_initial,
                n_forced_local,
                n_heads_kv,
                tokens_per_cta,
                tile_blocks
            }),
            rust_layout!(DsaIndexParams { scratch_stride, seq_len, n_heads, top_k, full_scores, n_groups, reserved }),
            rust_layout!(DsaSparseParams { flash, token_rows, top_k, list_heads, head_chunks, column_chunks }),
            rust_layout!(DsaLossParams { seq_len, top_k, index_heads, n_heads, n_heads_kv, head_dim, scale, reserved }),
            rust_layout!(BsaParams {
                flash,
                scale,
                q_block,
                kv_block,
                top_k,
                force_first,
                force_local,
                causal,
                n_heads_kv,
                n_key_blocks,
                pooled_queries_at,
                n_query_blocks,
                first_query_block
            }),
            rust_layout!(PisaParams { bsa, levels_at, batch, branching, keep, scoring, n_levels, max_candidates }),
            rust_layout!(HilsParams {
                flash,
                scale,
                chunk_size,
                local_window,
                top_k,
                n_chunks,
                max_len,
                write_scores,
                exact_mass,
                reserved
            }),
            rust_layout!(PisaTailParams {
                flash,
                scale,
                value_means_at,
                hbar_at,
                hbar_partials_at,
                pooled_values_at,
                pooled_hbar_at,
                q_block,
                kv_block,
                causal,
                n_heads_kv,
                n_key_blocks,
                n_query_blocks,
                list_width,
                lists_per_kv_head,
                hbar_splits,
                reserved
            }),
        ];
        let header = header_layouts();
        assert_eq!(header.len(), rust.len(), "common.cuh asserts the layout of {:?}", header.keys());
        for (name, size, fields, bytes) in rust {
            // The listed fields cover every byte: no padding, and no Rust field left out of the comparison.
            assert_eq!(bytes, size, "{name}: fields of {bytes} bytes in a struct of {size}");
            let (c_size, c_fields) = header.get(&name).unwrap_or_else(|| panic!("common.cuh does not assert {name}"));
            assert_eq!(*c_size, size, "{name}: sizeof in common.cuh");
            assert_eq!(c_fields, &fields, "{name}: offsets in common.cuh");
            // Every C member is asserted, in declaration order.
            let members: Vec<String> = header_members(&name);
            let asserted: Vec<String> = c_fields.iter().map(|(f, _)| f.clone()).collect();
            assert_eq!(members, asserted, "{name}: members of the C struct against its PARAM_AT lines");
        }
    }

    #[test]
    fn the_parser_sees_the_header() {
        // A parser that found nothing would make the comparison above vacuous.
        let layouts = header_layouts();
        assert_eq!(layouts["FlashParams"].0, 160);
        assert_eq!(layouts["FlashParams"].1.len(), 26);
        assert_eq!(header_members("RingStateParams"), ["rows", "rows_per_head", "dv", "varlen", "n_heads", "reserved"]);
    }

    #[test]
    fn dense_and_varlen_strides() {
        let spec = AttentionSpec::dense(2, 4, 2, 130, 70, 64, 32).with_mask(attnproof_oracle::Mask::Causal);
        let (p, cu_q, _) = FlashParams::for_spec(&spec).unwrap();
        assert_eq!(p.q_strides(), [4 * 130 * 64, 130 * 64, 64]);
        assert_eq!([p.v_batch, p.v_head, p.v_row], [2 * 70 * 32, 70 * 32, 32]);
        assert_eq!([p.lse_batch, p.lse_head], [4 * 130, 130]);
        assert_eq!((p.win_left, p.win_right), (NO_BOUND as i32, 0));
        assert_eq!((p.group, p.varlen, p.dense_len_q, p.dense_len_k, p.reserved), (2, 0, 130, 70, 0));
        assert_eq!(cu_q, [0, 0]);
        let varlen = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 5, 5, 70], cu_seqlens_k: vec![0, 0, 9, 20] },
            ..AttentionSpec::dense(1, 2, 1, 1, 1, 16, 8)
        };
        let (p, _, cu_k) = FlashParams::for_spec(&varlen).unwrap();
        assert_eq!(p.q_strides(), [0, 16, 32]);
        assert_eq!([p.k_batch, p.k_head, p.k_row], [0, 16, 16]);
        assert_eq!([p.o_batch, p.o_head, p.o_row], [0, 8, 16]);
        assert_eq!([p.lse_batch, p.lse_head], [0, 70]);
        assert_eq!((p.varlen, p.dense_len_q, p.dense_len_k), (1, 0, 0));
        assert_eq!(cu_k, vec![0, 0, 9, 20]);
    }
}
