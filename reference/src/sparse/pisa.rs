//! PISA's first-order tail (E22) as the tensor-core kernel runs it (`attnproof_gpu::pisa::tail`), on the CPU: the
//! exact part by the block-sparse forward over the caller's exact lists, then every row's tail (the whole key blocks
//! it sees that its query tile does not list) as one attention over the blocks' pooled keys, merged in f64.
//!
//! # Schedule and precision recipe
//!
//! - **Exact part**: [`block_sparse_forward`] over `exact` (the lists with the blocks the mask cuts and the partial
//!   last block added, which the caller forms: `attnproof_harness::pisa_tail::exact_layout`), the recipe of
//!   [`crate::sparse`].
//! - **Statistics**, per (sequence, KV head), in f64 from the inputs' exact values: each block's mean key and mean
//!   value (keys in ascending order, then one division), `H̄ = (1/n_b) Σ_b Σ_{j∈b} (k_j − μ_b) v_jᵀ` as the kernel
//!   forms it, `(1/n_b)(Σ_j k_j v_jᵀ − Σ_b n_b μ_b v̄_bᵀ)` by ranges of [`HBAR_SPLIT_KEYS`] keys: in each, the first
//!   sum by steps of [`HBAR_F32_KEYS`] keys, each an f32 sum of exact products (left to right; the tensor cores' order
//!   within a step is their own) added in f64, less the centring term by fused multiply-adds over the range's blocks
//!   in ascending order; the ranges' partial sums added in ascending order; their storage-type forms rounded once from f64 ([`Element::from_f64`]): the mean key split as
//!   `[μ_hi | μ_lo]` (`μ_hi = RN(μ)`, `μ_lo = RN(μ − μ_hi)`), the mean value `RN(v̄)`, `H̄` split like `μ` into `2d`
//!   rows. They are returned in the GPU workspace's layout ([`TailOutputs::pooled`]).
//! - **Tail**: per row, the online softmax of [`crate::sparse`] over its tail blocks in tiles of [`POOLED_TILE`]
//!   pooled keys: score `α̂ · dot32([q | q], [μ_hi | μ_lo])` (`−∞` outside the tail), values the rounded mean values,
//!   `O_T = A/ℓ` in f32 (not rounded: the kernel keeps it in registers) and `lse_T = m + ln ℓ`; the shared term
//!   `h = dot32([q | q], [H̄_hi ; H̄_lo]·e)` per column.
//! - **Merge** in f64: `T = O_T + α h / C`, `M = max(lse_E, lse_T + ln C)`, `o = (e^{lse_E − M} O_E + e^{lse_T + ln C
//!   − M} T) / (e^{lse_E − M} + e^{lse_T + ln C − M})` rounded once to the storage type, `lse = M + ln(…)` in f32. A
//!   row without tail blocks keeps the exact part's output.
//! - **Backward** ([`pisa_tail_backward`], as `attnproof_gpu::pisa::tail_backward` runs it): the block-sparse backward
//!   over the exact lists with the tail forward's `O` and LSE, then the tail part in f64 from the f64 statistics above
//!   and the exact part's `D`, added to each gradient's stored value and rounded once more.
//! - **Covariance-aware selection** (E24, [`pisa_covariance_select`], as `attnproof_gpu::pisa::covariance` runs it):
//!   the f64 statistics above, each block's spread `‖H_b − H̄‖₂` by a fixed number of power steps, and BSA's pooled
//!   scores plus the spread term.

use attnproof_oracle::block_sparse::BlockSparseLayout;
use attnproof_oracle::bsa::bsa_select;
use attnproof_oracle::pisa::{CovarianceConfig, E24_POWER_STEPS};
use attnproof_oracle::spec::{Operand, Sequence};
use attnproof_oracle::{AttentionSpec, Mask};
use ndarray::{Array2, Array3, Array4, ArrayD, Axis, IxDyn};

use crate::element::Element;
use crate::error::ReferenceError;
use crate::flash::{ForwardOutputs, Inputs, head_f32};
use crate::mask::{kv_head, visible};
use crate::sparse::{RowState, block_sparse_forward, dot32, scale32};

/// Pooled keys per tile of the tail's online softmax (the kernel's `TAIL_N`).
pub const POOLED_TILE: usize = 64;
/// Keys per f32 sum of `Σ_j k_j v_jᵀ` in `H̄` (the kernel's stage of two MMAs: its products summed in f32 from zero,
/// then added in f64).
pub const HBAR_F32_KEYS: usize = 32;
/// Keys per partial sum of `H̄` (the kernel's `HBAR_SPLIT_KEYS`: one CTA per range).
pub const HBAR_SPLIT_KEYS: usize = 4096;

/// What [`pisa_tail_forward`] returns: the outputs and the storage-type statistics it computed with.
#[derive(Clone, Debug)]
pub struct TailOutputs<T> {
    /// `O`, shaped like Q with `dv`.
    pub o: ArrayD<T>,
    /// Natural-log LSE.
    pub lse: ArrayD<f32>,
    /// The GPU workspace's layout: split mean keys `[B, Hkv, n_k, 2d]`, rounded mean values `[B, Hkv, n_k, dv]`,
    /// split `H̄` `[B, Hkv, 2d, dv]`, `n_k` the longest sequence's key blocks (zero where a sequence has none).
    pub pooled: Vec<T>,
}

/// One (sequence, KV head)'s statistics: f64 means and `H̄`, and their storage-type forms widened to f32.
struct HeadStatistics {
    /// `[n_k, d]`: `μ` in f64.
    means: Array2<f64>,
    /// `[n_k, dv]`: `v̄` in f64.
    value_means: Array2<f64>,
    /// `[d, dv]`: `H̄` in f64.
    h_bar64: Array2<f64>,
    /// `[n_k, 2d]`: `[μ_hi | μ_lo]`.
    keys: Array2<f32>,
    /// `[n_k, dv]`: `RN(v̄)`.
    values: Array2<f32>,
    /// `[2d, dv]`: `[H̄_hi ; H̄_lo]`.
    h_bar: Array2<f32>,
}

/// `(RN(x), RN(x − RN(x)))` in `T`, widened to f32 (the subtraction is exact in f64): the split of a statistic into two
/// storage numbers, as the kernel and this schedule form it.
pub fn split<T: Element>(x: f64) -> (f32, f32) {
    let hi = T::from_f64(x).to_f32();
    (hi, T::from_f64(x - f64::from(hi)).to_f32())
}

/// The f64 mean of each block of `block` rows of `x` (`[L, ·]`, the last block over the rows it has): rows in
/// ascending order, then one division, as the kernels' pooling is modelled.
fn block_means64(x: &Array2<f32>, block: usize) -> Array2<f64> {
    let (len, cols) = x.dim();
    Array2::from_shape_fn((len.div_ceil(block), cols), |(b, c)| {
        let rows = b * block..((b + 1) * block).min(len);
        let count = rows.len() as f64;
        rows.fold(0f64, |a, j| a + f64::from(x[[j, c]])) / count
    })
}

/// The statistics of keys `k` and values `v` (`[L, ·]`, the storage type's values) in blocks of `block` keys.
fn head_statistics<T: Element>(k: &Array2<f32>, v: &Array2<f32>, block: usize) -> HeadStatistics {
    let ((len, d), dv) = (k.dim(), v.ncols());
    let n_blocks = len.div_ceil(block);
    let means = block_means64(k, block);
    let value_means = block_means64(v, block);
    let mut keys = Array2::zeros((n_blocks, 2 * d));
    let mut values = Array2::zeros((n_blocks, dv));
    for b in 0..n_blocks {
        for c in 0..d {
            let (hi, lo) = split::<T>(means[[b, c]]);
            keys[[b, c]] = hi;
            keys[[b, d + c]] = lo;
        }
        for c in 0..dv {
            values[[b, c]] = T::from_f64(value_means[[b, c]]).to_f32();
        }
    }
    let mut h_bar = Array2::zeros((2 * d, dv));
    let mut h_bar64 = Array2::zeros((d, dv));
    for c in 0..d {
        for e in 0..dv {
            // Per range of HBAR_SPLIT_KEYS keys: Σ_j k_jc v_je by steps of HBAR_F32_KEYS keys, each an f32 sum of exact
            // products from zero added in f64 (the kernel's two MMAs from zero per stage), less the range's centring
            // term Σ_b n_b μ_bc v̄_be in f64; the ranges' partial sums added in ascending order.
            let partial = |j_begin: usize| {
                let j_end = (j_begin + HBAR_SPLIT_KEYS).min(len);
                let products = (j_begin..j_end).step_by(HBAR_F32_KEYS).fold(0f64, |a, j0| {
                    let step = (j0..(j0 + HBAR_F32_KEYS).min(j_end)).fold(0f32, |s, j| s + k[[j, c]] * v[[j, e]]);
                    a + f64::from(step)
                });
                let centre = (j_begin / block..j_end.div_ceil(block)).fold(0f64, |a, b| {
                    let count = (len - b * block).min(block) as f64;
                    (count * means[[b, c]]).mul_add(value_means[[b, e]], a)
                });
                products - centre
            };
            let total = (0..len).step_by(HBAR_SPLIT_KEYS).fold(0f64, |a, j_begin| a + partial(j_begin));
            h_bar64[[c, e]] = total / n_blocks as f64;
            let (hi, lo) = split::<T>(h_bar64[[c, e]]);
            h_bar[[c, e]] = hi;
            h_bar[[d + c, e]] = lo;
        }
    }
    HeadStatistics { means, value_means, h_bar64, keys, values, h_bar }
}

/// PISA's tail forward of `spec` on `inputs` over the exact lists `exact` (per query head; the listed blocks, the
/// blocks the mask cuts and the partial last block, see the module docs), the schedule of the tensor-core kernel.
/// Masks: none or the bottom-right causal mask (the visibility of [`crate::mask::visible`]); any other is
/// [`ReferenceError::UnsupportedMask`].
pub fn pisa_tail_forward<T: Element>(
    spec: &AttentionSpec,
    inputs: &Inputs<'_, T>,
    exact: &BlockSparseLayout,
) -> Result<TailOutputs<T>, ReferenceError> {
    check_mask(spec)?;
    let mut o = ArrayD::from_elem(IxDyn(&spec.expected_shape(Operand::O)), T::from_f32(0.0));
    let mut lse = ArrayD::zeros(IxDyn(&spec.expected_shape(Operand::RowStat)));
    block_sparse_forward(spec, inputs, exact, ForwardOutputs { o: o.view_mut(), lse: lse.view_mut() })?;
    let (d, dv, block) = (spec.head_dim, spec.head_dim_v, exact.kv_tile);
    let seqs = spec.sequences();
    let n_k = seqs.iter().map(|s| s.len_k.div_ceil(block)).max().unwrap_or(0);
    let heads = seqs.len() * spec.n_heads_kv;
    let (keys_len, values_len) = (heads * n_k * 2 * d, heads * n_k * dv);
    let mut pooled = vec![T::from_f32(0.0); keys_len + values_len + heads * 2 * d * dv];
    let scale = scale32(spec.scale, d)?;
    let scale64 = spec.scale_value::<f64>(());
    for seq in &seqs {
        if seq.len_k == 0 {
            continue;
        }
        for kv in 0..spec.n_heads_kv {
            let k = head_f32(spec, &inputs.k, seq, kv, true);
            let v = head_f32(spec, &inputs.v, seq, kv, true);
            let stats = head_statistics::<T>(&k, &v, block);
            let head = seq.index * spec.n_heads_kv + kv;
            let store = |pooled: &mut [T], at: usize, x: &Array2<f32>| {
                for (slot, &value) in pooled[at..at + x.len()].iter_mut().zip(x.iter()) {
                    *slot = T::from_f32(value);
                }
            };
            store(&mut pooled, head * n_k * 2 * d, &stats.keys);
            store(&mut pooled, keys_len + head * n_k * dv, &stats.values);
            store(&mut pooled, keys_len + values_len + head * 2 * d * dv, &stats.h_bar);
            for h in (0..spec.n_heads_q).filter(|&h| kv_head(h, spec.n_heads_q, spec.n_heads_kv) == kv) {
                let q = head_f32(spec, &inputs.q, seq, h, false);
                let mut o_head = o.slice_mut(spec.head_slice(seq, h, false));
                let mut lse_head = lse.slice_mut(spec.row_stat_slice(seq, h));
                for i in 0..seq.len_q {
                    let Some((tail, lse_tail)) = row_tail::<T>(spec, exact, seq, h, i, &q, &stats, scale, scale64)
                    else {
                        continue;
                    };
                    let lse_exact = f64::from(lse_head[[i]]);
                    let top = lse_exact.max(lse_tail);
                    let (we, wt) = ((lse_exact - top).exp(), (lse_tail - top).exp());
                    let denominator = we + wt;
                    let mut row = o_head.index_axis_mut(Axis(0), i);
                    for (c, out) in row.iter_mut().enumerate() {
                        let merged = (we * f64::from(out.to_f32()) + wt * tail[c]) / denominator;
                        *out = T::from_f64(merged);
                    }
                    lse_head[[i]] = (top + denominator.ln()) as f32;
                }
            }
        }
    }
    Ok(TailOutputs { o, lse, pooled })
}

/// The tail's masks: none or the bottom-right causal mask; any other is [`ReferenceError::UnsupportedMask`].
fn check_mask(spec: &AttentionSpec) -> Result<(), ReferenceError> {
    if matches!(spec.mask, Mask::None | Mask::Causal) {
        return Ok(());
    }
    let reason = "PISA's tail takes no mask or the bottom-right causal mask";
    Err(ReferenceError::UnsupportedMask { mask: format!("{:?}", spec.mask), reason })
}

/// Row `i`'s tail per whole key block of its sequence: the block is whole for the row (every key visible) and its
/// query tile does not list it.
fn tail_blocks(spec: &AttentionSpec, exact: &BlockSparseLayout, seq: &Sequence, h: usize, i: usize) -> Vec<bool> {
    let block = exact.kv_tile;
    let listed: Vec<usize> = exact
        .lists
        .index_axis(Axis(0), seq.index)
        .index_axis(Axis(0), h)
        .row(i / exact.q_tile)
        .iter()
        .take_while(|&&b| b >= 0)
        .map(|&b| b as usize)
        .collect();
    let sees_whole = |b: usize| (b * block..(b + 1) * block).all(|j| visible(&spec.mask, i, j, seq.len_q, seq.len_k));
    let whole = seq.len_k / block;
    (0..whole).map(|b| !listed.contains(&b) && sees_whole(b)).collect()
}

/// Row `i`'s tail average `T = O_T + α h / C` and log-mass `lse_T + ln C` (f64), or `None` when it has no tail block.
#[allow(clippy::too_many_arguments)]
fn row_tail<T: Element>(
    spec: &AttentionSpec,
    exact: &BlockSparseLayout,
    seq: &Sequence,
    h: usize,
    i: usize,
    q: &Array2<f32>,
    stats: &HeadStatistics,
    scale: f32,
    scale64: f64,
) -> Option<(Vec<f64>, f64)> {
    let block = exact.kv_tile;
    let whole = seq.len_k / block;
    let tail = tail_blocks(spec, exact, seq, h, i);
    if !tail.contains(&true) {
        return None;
    }
    let qq: Vec<f32> = q.row(i).iter().chain(q.row(i).iter()).copied().collect();
    let mut state = RowState::new(spec.head_dim_v);
    for b0 in (0..whole).step_by(POOLED_TILE) {
        let keys = b0..(b0 + POOLED_TILE).min(whole);
        let s: Vec<f32> = keys
            .clone()
            .map(|b| if tail[b] { scale * dot32(&qq, stats.keys.row(b)) } else { f32::NEG_INFINITY })
            .collect();
        state.update::<T>(&s, |j, c| stats.values[[b0 + j, c]]);
    }
    let shared = |e: usize| f64::from(dot32(&qq, stats.h_bar.column(e)));
    let o_tail: Vec<f64> =
        (0..spec.head_dim_v).map(|e| f64::from(state.acc[e] / state.l) + scale64 * shared(e) / block as f64).collect();
    Some((o_tail, f64::from(state.m + state.l.ln()) + (block as f64).ln()))
}

/// What [`pisa_tail_backward`] returns: the gradients, the exact part's `D`, and the f64 statistics it read in the GPU
/// f64 workspace's layout (means `[B, Hkv, n_k, d]`, mean values `[B, Hkv, n_k, dv]`, `H̄` `[B, Hkv, d, dv]`).
#[derive(Clone, Debug)]
pub struct TailGradients<T> {
    /// dQ.
    pub dq: ArrayD<T>,
    /// dK.
    pub dk: ArrayD<T>,
    /// dV.
    pub dv: ArrayD<T>,
    /// The exact part's `D = rowsum(dO ∘ O)` (f32), laid out like LSE.
    pub delta: ArrayD<f32>,
    /// The f64 statistics.
    pub moments: Vec<f64>,
}

/// PISA's tail backward of `spec` (`inputs.o`, `inputs.lse` the tail forward's over `exact`) as the GPU kernels run it
/// (`attnproof_gpu::pisa::tail_backward`): the exact part by [`crate::sparse::block::block_sparse_backward`] over
/// `exact` with PISA's `O` and LSE, then the tail part in f64 from the f64 statistics of [`pisa_tail_forward`]'s
/// recipe and the exact part's `D`: per row `W = H̄ dO`, `dO·h = α q·W`, per tail block `a = e^{α q·μ_b − lse}` and
/// `g = a (C (dO·v̄_b − D) + dO·h)`, `dq += α Σ_b g μ_b + A α W`; per block `dμ_b += α g q`, `dV^Σ_b += a dO`;
/// `G += A α q dOᵀ`; then `dk_j += dμ_b / |B_b| + G (v_j − v̄_b) / n_b`, `dv_j += dV^Σ_b + Gᵀ (k_j − μ_b) / n_b`. Each
/// gradient is rounded once more from the exact part's stored value plus the f64 tail part; an element whose tail part
/// is exactly 0 keeps the exact part's value. Masks as for [`pisa_tail_forward`].
pub fn pisa_tail_backward<T: Element>(
    spec: &AttentionSpec,
    inputs: &crate::backward::BackwardInputs<'_, T>,
    exact: &BlockSparseLayout,
) -> Result<TailGradients<T>, ReferenceError> {
    check_mask(spec)?;
    let zeros = |op: Operand| ArrayD::from_elem(IxDyn(&spec.expected_shape(op)), T::from_f32(0.0));
    let (mut dq, mut dk, mut dv) = (zeros(Operand::Q), zeros(Operand::K), zeros(Operand::V));
    let mut delta = ArrayD::zeros(IxDyn(&spec.expected_shape(Operand::RowStat)));
    let outputs = crate::backward::BackwardOutputs {
        dq: dq.view_mut(),
        dk: dk.view_mut(),
        dv: dv.view_mut(),
        delta: delta.view_mut(),
    };
    crate::sparse::block::block_sparse_backward(spec, inputs, exact, outputs)?;
    let (d, dv_dim, block) = (spec.head_dim, spec.head_dim_v, exact.kv_tile);
    let seqs = spec.sequences();
    let n_k = seqs.iter().map(|s| s.len_k.div_ceil(block)).max().unwrap_or(0);
    let heads = seqs.len() * spec.n_heads_kv;
    let mut moments = vec![0f64; heads * (n_k * (d + dv_dim) + d * dv_dim)];
    let alpha = spec.scale_value::<f64>(());
    let add = |x: &mut T, tail: f64| {
        if tail != 0.0 {
            *x = T::from_f64(f64::from(x.to_f32()) + tail);
        }
    };
    for seq in &seqs {
        if seq.len_k == 0 {
            continue;
        }
        for kv in 0..spec.n_heads_kv {
            let k = head_f32(spec, &inputs.k, seq, kv, true);
            let v = head_f32(spec, &inputs.v, seq, kv, true);
            let st = head_statistics::<T>(&k, &v, block);
            let head = seq.index * spec.n_heads_kv + kv;
            let n_blocks = seq.len_k.div_ceil(block);
            for (b, row) in st.means.outer_iter().enumerate() {
                moments[(head * n_k + b) * d..][..d].copy_from_slice(row.as_slice().expect("standard layout"));
            }
            for (b, row) in st.value_means.outer_iter().enumerate() {
                let at = heads * n_k * d + (head * n_k + b) * dv_dim;
                moments[at..at + dv_dim].copy_from_slice(row.as_slice().expect("standard layout"));
            }
            let at = heads * n_k * (d + dv_dim) + head * d * dv_dim;
            moments[at..at + d * dv_dim].copy_from_slice(st.h_bar64.as_slice().expect("standard layout"));
            let mut d_means = Array2::<f64>::zeros((n_blocks, d));
            let mut d_sums = Array2::<f64>::zeros((n_blocks, dv_dim));
            let mut g_bar = Array2::<f64>::zeros((d, dv_dim));
            for h in (0..spec.n_heads_q).filter(|&h| kv_head(h, spec.n_heads_q, spec.n_heads_kv) == kv) {
                let q = head_f32(spec, &inputs.q, seq, h, false);
                let g_out = head_f32(spec, &inputs.d_out, seq, h, false);
                let lse_head = inputs.lse.slice(spec.row_stat_slice(seq, h));
                let delta_head = delta.slice(spec.row_stat_slice(seq, h)).to_owned();
                let mut dq_head = dq.slice_mut(spec.head_slice(seq, h, false));
                for i in 0..seq.len_q {
                    let lse = f64::from(lse_head[[i]]);
                    let tail = tail_blocks(spec, exact, seq, h, i);
                    if lse == f64::NEG_INFINITY || !tail.contains(&true) {
                        continue;
                    }
                    let qi: Vec<f64> = q.row(i).iter().map(|&x| f64::from(x)).collect();
                    let gi: Vec<f64> = g_out.row(i).iter().map(|&x| f64::from(x)).collect();
                    let w: Vec<f64> = (0..d).map(|c| (0..dv_dim).map(|e| st.h_bar64[[c, e]] * gi[e]).sum()).collect();
                    let through = alpha * qi.iter().zip(&w).map(|(x, y)| x * y).sum::<f64>();
                    let row_delta = f64::from(delta_head[[i]]);
                    let (mut acc, mut mass) = (vec![0f64; d], 0f64);
                    for b in (0..tail.len()).filter(|&b| tail[b]) {
                        let score: f64 = (0..d).map(|c| qi[c] * st.means[[b, c]]).sum();
                        let dp: f64 = (0..dv_dim).map(|e| gi[e] * st.value_means[[b, e]]).sum();
                        let a = (alpha * score - lse).exp();
                        let g = a * (block as f64 * (dp - row_delta) + through);
                        mass += a;
                        for c in 0..d {
                            acc[c] += alpha * g * st.means[[b, c]];
                            d_means[[b, c]] += alpha * g * qi[c];
                        }
                        for e in 0..dv_dim {
                            d_sums[[b, e]] += a * gi[e];
                        }
                    }
                    for c in 0..d {
                        add(&mut dq_head[[i, c]], acc[c] + mass * alpha * w[c]);
                        for e in 0..dv_dim {
                            g_bar[[c, e]] += mass * alpha * qi[c] * gi[e];
                        }
                    }
                }
            }
            let mut dk_head = dk.slice_mut(spec.head_slice(seq, kv, true));
            let mut dv_head = dv.slice_mut(spec.head_slice(seq, kv, true));
            for j in 0..seq.len_k {
                let b = j / block;
                let count = (seq.len_k - b * block).min(block) as f64;
                let x: Vec<f64> = (0..dv_dim).map(|e| f64::from(v[[j, e]]) - st.value_means[[b, e]]).collect();
                let y: Vec<f64> = (0..d).map(|c| f64::from(k[[j, c]]) - st.means[[b, c]]).collect();
                for c in 0..d {
                    let via_g: f64 = (0..dv_dim).map(|e| g_bar[[c, e]] * x[e]).sum();
                    add(&mut dk_head[[j, c]], d_means[[b, c]] / count + via_g / n_blocks as f64);
                }
                for e in 0..dv_dim {
                    let via_g: f64 = (0..d).map(|c| g_bar[[c, e]] * y[c]).sum();
                    add(&mut dv_head[[j, e]], d_sums[[b, e]] + via_g / n_blocks as f64);
                }
            }
        }
    }
    Ok(TailGradients { dq, dk, dv, delta, moments })
}

/// Key blocks per partial sum of `H̄` in E24's spreads (`attnproof_gpu::pisa::covariance::RANGE_BLOCKS`).
pub const COVARIANCE_RANGE_BLOCKS: usize = 16;

/// What [`pisa_covariance_select`] returns: the lists and the spreads they were chosen with.
#[derive(Clone, Debug, PartialEq)]
pub struct CovarianceRun {
    /// `[B, Hkv, n_q, top_k]`, ascending and `−1`-padded (BSA's lists).
    pub lists: Array4<i32>,
    /// `s_b`, `[B, Hkv, n_k]`, 0 past a sequence's blocks.
    pub spreads: Array3<f64>,
}

/// The estimate of `‖M‖₂` by exactly `steps` steps of power iteration from the all-ones vector, in the kernel's
/// order (`pisa_covariance_spread`): `x ← x/‖x‖`, `a = M x`, `s = ‖a‖`, `x ← Mᵀ a`, each matvec entry a fused
/// multiply-add chain over its columns or rows in ascending order, each norm the square root of a sum of squares; a
/// zero `x` stops the steps.
fn power_estimate(m: &Array2<f64>, steps: usize) -> f64 {
    let (rows, cols) = m.dim();
    let norm = |x: &[f64]| x.iter().fold(0f64, |s, e| e.mul_add(*e, s)).sqrt();
    let mut x = vec![1f64; cols];
    let mut estimate = 0f64;
    for _ in 0..steps {
        let n = norm(&x);
        if n == 0.0 {
            break;
        }
        x.iter_mut().for_each(|e| *e /= n);
        let a: Vec<f64> = (0..rows).map(|r| (0..cols).fold(0f64, |s, c| m[[r, c]].mul_add(x[c], s))).collect();
        estimate = norm(&a);
        x = (0..cols).map(|c| (0..rows).fold(0f64, |s, r| m[[r, c]].mul_add(a[r], s))).collect();
    }
    estimate
}

/// PISA's covariance-aware selection (E24) as `attnproof_gpu::pisa::covariance` runs it, on the CPU: per (sequence,
/// KV head) the blocks' f64 mean keys ([`block_means64`]), `H̄` from the centred products `fl(k_j − μ_b) v_jᵀ` (fused multiply-add chains
/// over the keys of each range of [`COVARIANCE_RANGE_BLOCKS`] blocks in ascending order, the ranges added in order,
/// one division), each key block's `H_b − H̄` formed by the same chains over its keys and its spread by the oracle's
/// `E24_POWER_STEPS` power steps ([`power_estimate`]); then BSA's pooled queries
/// (f64 means of a query block's rows), the group's summed pooled query against each key block's mean key (one fused
/// multiply-add chain, then the scale), plus `Σ_h ln(n_b + γ|α| ‖q̄_{a,h}‖ s_b)` over the group's heads in ascending
/// order; the lists by the oracle's `bsa_select` from those scores. Masks: none or the bottom-right causal mask.
pub fn pisa_covariance_select<T: Element>(
    spec: &AttentionSpec,
    inputs: &Inputs<'_, T>,
    config: &CovarianceConfig,
) -> Result<CovarianceRun, ReferenceError> {
    check_mask(spec)?;
    config.validate()?;
    let bsa = &config.bsa;
    let seqs = spec.sequences();
    let n_q = seqs.iter().map(|s| bsa.query_blocks(s)).max().unwrap_or(0);
    let n_k = seqs.iter().map(|s| bsa.key_blocks(s)).max().unwrap_or(0);
    let (d, dv, group) = (spec.head_dim, spec.head_dim_v, spec.group_size());
    let alpha = spec.scale_value::<f64>(());
    let causal = matches!(spec.mask, Mask::Causal);
    let mut spreads = Array3::zeros((seqs.len(), spec.n_heads_kv, n_k));
    let mut scores = Array4::from_elem((seqs.len(), spec.n_heads_kv, n_q, n_k), f64::NEG_INFINITY);
    for seq in seqs.iter().filter(|s| s.len_k > 0) {
        for kv in 0..spec.n_heads_kv {
            let (k, v) = (head_f32(spec, &inputs.k, seq, kv, true), head_f32(spec, &inputs.v, seq, kv, true));
            // The spreads read the blocks' f64 mean keys only; H̄ is their own (below), not the tail's.
            let means = block_means64(&k, bsa.kv_block);
            let counts: Vec<usize> =
                (0..bsa.key_blocks(seq)).map(|b| bsa.kv_block.min(seq.len_k - b * bsa.kv_block)).collect();
            // `Σ_j fl(k_j − μ_{b(j)}) v_jᵀ` over keys `keys`, each entry one fused multiply-add chain, keys ascending.
            let centred = |keys: std::ops::Range<usize>| {
                Array2::from_shape_fn((d, dv), |(r, c)| {
                    keys.clone().fold(0f64, |s, j| {
                        (f64::from(k[[j, r]]) - means[[j / bsa.kv_block, r]]).mul_add(f64::from(v[[j, c]]), s)
                    })
                })
            };
            // H̄ as the kernel sums it: per range of COVARIANCE_RANGE_BLOCKS blocks, then the ranges in order.
            let range_keys = COVARIANCE_RANGE_BLOCKS * bsa.kv_block;
            let h_bar = (0..seq.len_k)
                .step_by(range_keys)
                .fold(Array2::<f64>::zeros((d, dv)), |total, j0| total + centred(j0..(j0 + range_keys).min(seq.len_k)))
                / counts.len() as f64;
            for (b, &count) in counts.iter().enumerate() {
                let m = centred(b * bsa.kv_block..b * bsa.kv_block + count) - &h_bar;
                spreads[[seq.index, kv, b]] = power_estimate(&m, E24_POWER_STEPS);
            }
            let pooled: Vec<Array2<f64>> = (kv * group..(kv + 1) * group)
                .map(|h| {
                    let q = head_f32(spec, &inputs.q, seq, h, false);
                    Array2::from_shape_fn((bsa.query_blocks(seq), d), |(a, c)| {
                        let rows = a * bsa.q_block..((a + 1) * bsa.q_block).min(seq.len_q);
                        let count = rows.len() as f64;
                        rows.fold(0f64, |s, i| s + f64::from(q[[i, c]])) / count
                    })
                })
                .collect();
            for a in 0..bsa.query_blocks(seq) {
                let summed: Vec<f64> = (0..d).map(|c| pooled.iter().fold(0f64, |s, p| s + p[[a, c]])).collect();
                let coefficients: Vec<f64> = pooled
                    .iter()
                    .map(|p| config.gamma * alpha.abs() * p.row(a).iter().fold(0f64, |s, x| x.mul_add(*x, s)).sqrt())
                    .collect();
                for b in 0..bsa.eligible_end(seq, a, causal) {
                    let dot = (0..d).fold(0f64, |s, c| summed[c].mul_add(means[[b, c]], s));
                    let spread = spreads[[seq.index, kv, b]];
                    let term = coefficients.iter().fold(0f64, |s, c| s + c.mul_add(spread, counts[b] as f64).ln());
                    scores[[seq.index, kv, a, b]] = alpha * dot + term;
                }
            }
        }
    }
    let lists = bsa_select(spec, scores.view(), bsa)?;
    Ok(CovarianceRun { lists, spreads })
}
