//! Online-softmax states on the device (E2–E5) and the window of a chunk pair: the GPU pieces of the ring forward
//! (E11/E11a), where each device attends its query chunks to key chunks that arrive one hop at a time.
//!
//! A ring step computes one (query chunk, key chunk) pair's *partial state* with the forward kernel in its
//! `STATE_OUT` mode ([`crate::flash::flash_forward_state_device`]), merges it into the query chunk's running state
//! ([`merge_states`], E4), and after the last step turns the running state into `O` and LSE ([`finalize_state`],
//! E5). Kernels: `gpu/kernels/ring_state.cu` (merge, finalize) and `flash_fwd.cu` (`STATE_OUT`).
//!
//! # Precision recipe
//!
//! Within a pair the arithmetic is the forward kernel's, tile for tile; a merge rescales each side once with the
//! forward's own shift (`ex2(fl(fl(mᵢ·L) − fl(m·L)))`, the same `L = fl32(log2 e)`), adds the two `ℓ` and the two `A`
//! in f32, and an empty side (`m = −∞`) contributes exactly zero, so merging into an empty state copies the partial
//! bit for bit. A query row's terms therefore pass through the rescales of the KV tiles of their own chunk and one
//! rescale and one addition per later merge: with `P` key chunks per sequence, at most `Σ_c ⌈n_c/kv_tile⌉ + P − 1 ≤
//! ⌈Lk/kv_tile⌉ + 2(P − 1)` rescale steps. The forward's `FlashRecipe` with `extra_merges = 2(P − 1)` covers the
//! ring forward (`attnproof_reference::ring::RingConfig::extra_merges` is `P − 1` for the CPU schedule, which
//! absorbs tiles into one state and has no separate merge step).

use std::sync::Arc;

use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Layout, Mask};
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};

use crate::common::{Diagonal, GpuElement, KernelMask, NO_BOUND, check_len};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::launch;
use crate::params::RingStateParams;

/// `gpu/kernels/ring_state.cu` after the shared helpers.
pub const RING_STATE: KernelSource = KernelSource {
    name: "ring_state",
    source: concat!(include_str!("../../kernels/common.cuh"), include_str!("../../kernels/ring_state.cu")),
};

/// Rows per CTA of the state kernels (one warp each).
const ROWS_PER_CTA: u32 = 4;

/// The keys a query row of one (query chunk, key chunk) pair can see, relative to the pair's own diagonal: the
/// kernel aligns row `i` of a chunk of `n_q` queries with key `i + n_k − n_q` of a chunk of `n_k` keys (bottom-right),
/// and row `i` sees key `j` iff `i + n_k − n_q − left ≤ j ≤ i + n_k − n_q + right`. Reaches may be negative (a
/// chunk pair far from the sequence's diagonal); `None` is unbounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkWindow {
    /// Reach to the left of the pair's diagonal.
    pub left: Option<i64>,
    /// Reach to the right of the pair's diagonal.
    pub right: Option<i64>,
}

impl ChunkWindow {
    /// The window of the chunk pair of query positions `q0 .. q0 + n_q` and key positions `k0 .. k0 + n_k` of one
    /// sequence of `len_q` queries and `len_k` keys under `mask` (bottom-right aligned: query `i` sees key `j` iff
    /// `i + len_k − len_q − left ≤ j ≤ i + len_k − len_q + right`). A predicate mask is unsupported.
    pub fn for_pair(
        mask: &Mask,
        (len_q, len_k): (usize, usize),
        (q0, n_q): (usize, usize),
        (k0, n_k): (usize, usize),
    ) -> Result<Self, GpuError> {
        if q0 + n_q > len_q || k0 + n_k > len_k {
            return Err(GpuError::Unsupported {
                argument: "chunk",
                reason: format!(
                    "queries {q0}..{} and keys {k0}..{} do not lie in a sequence of {len_q} queries and {len_k} keys",
                    q0 + n_q,
                    k0 + n_k
                ),
            });
        }
        let reach = KernelMask::from_mask(mask)?;
        if reach.diagonal != Diagonal::BottomRight {
            return Err(GpuError::Unsupported {
                argument: "mask",
                reason: format!("{mask:?}: the ring splits sequences by position, NSA's compressed keys are windows"),
            });
        }
        let as_i64 = |x: usize| i64::try_from(x).unwrap_or(i64::MAX / 4);
        // Global: j_g ≤ i_g + s0 + right with i_g = q0 + i, j_g = k0 + j; the chunk's own diagonal is i + (n_k − n_q),
        // so the pair's reach moves by δ = q0 − k0 + s0 − (n_k − n_q).
        let s0 = as_i64(len_k) - as_i64(len_q);
        let delta = as_i64(q0) - as_i64(k0) + s0 - (as_i64(n_k) - as_i64(n_q));
        Ok(ChunkWindow {
            left: reach.left.map(|x| as_i64(x).saturating_sub(delta)),
            right: reach.right.map(|x| as_i64(x).saturating_add(delta)),
        })
    }

    /// Whether row `i` sees key `j` of a pair of `n_q` queries and `n_k` keys.
    pub fn visible(&self, i: usize, j: usize, n_q: usize, n_k: usize) -> bool {
        if i >= n_q || j >= n_k {
            return false;
        }
        let diag = i as i64 + n_k as i64 - n_q as i64;
        let j = j as i64;
        self.right.is_none_or(|r| j <= diag.saturating_add(r)) && self.left.is_none_or(|l| j >= diag.saturating_sub(l))
    }

    /// Whether some query of the pair sees some key (otherwise the pair is skipped: the causal skip of a key chunk
    /// entirely in the queries' future, or outside a window).
    pub fn sees_any(&self, n_q: usize, n_k: usize) -> bool {
        if n_q == 0 || n_k == 0 {
            return false;
        }
        // Row i sees keys [i + sc − left, i + sc + right] ∩ [0, n_k): nonempty iff left + right ≥ 0 and
        // −sc − right ≤ i ≤ n_k − 1 − sc + left for some row i of [0, n_q).
        let big = 4 * NO_BOUND;
        let (left, right) = (self.left.unwrap_or(big), self.right.unwrap_or(big));
        let sc = n_k as i64 - n_q as i64;
        let lo = (-sc).saturating_sub(right).max(0);
        let hi = (n_k as i64 - 1 - sc).saturating_add(left).min(n_q as i64 - 1);
        left.saturating_add(right) >= 0 && lo <= hi
    }

    /// The kernel's `(win_left, win_right)`: `1 << 30` for an unbounded side, every reach clamped to ±2^30 (beyond
    /// that a side admits every key of the pair, or none: positions are below 2^30).
    pub(crate) fn kernel_values(&self) -> (i32, i32) {
        let clamp = |side: Option<i64>| side.map_or(NO_BOUND, |x| x.clamp(-NO_BOUND, NO_BOUND)) as i32;
        (clamp(self.left), clamp(self.right))
    }
}

/// The online-softmax state (E2) of a problem's query rows on the device, in f32: `m` (running max of the scaled
/// scores), `ℓ` and the unnormalized accumulator `A`, relative to `2^fl(m·log2 e)` as the forward kernel keeps them.
/// Rows are the spec's LSE rows (dense `[B, Hq, Lq]`, varlen `[Hq, Tq]`); `a` is `[row][dv]`.
#[derive(Debug)]
pub struct DeviceState {
    /// `A`, `rows · dv` values.
    pub a: CudaSlice<f32>,
    /// `m` per row (`−∞`: no key seen yet).
    pub m: CudaSlice<f32>,
    /// `ℓ` per row.
    pub l: CudaSlice<f32>,
    /// Rows.
    pub rows: usize,
    /// Columns of `A`.
    pub dv: usize,
}

impl DeviceState {
    /// The empty state of `rows` rows (`m = −∞`, `ℓ = 0`, `A = 0`): what a merge starts from.
    pub fn empty(stream: &Arc<CudaStream>, rows: usize, dv: usize) -> Result<Self, GpuError> {
        let alloc = |e| GpuError::driver("cuMemAlloc(state)", e);
        let n = rows.checked_mul(dv).ok_or(GpuError::TooLarge { argument: "state rows x dv", value: usize::MAX })?;
        let a = stream.alloc_zeros::<f32>(n.max(1)).map_err(alloc)?;
        let l = stream.alloc_zeros::<f32>(rows.max(1)).map_err(alloc)?;
        let m = stream
            .clone_htod(&vec![f32::NEG_INFINITY; rows.max(1)])
            .map_err(|e| GpuError::driver("cuMemcpyHtoD(state m)", e))?;
        Ok(DeviceState { a, m, l, rows, dv })
    }

    /// The empty state of `spec`'s query rows.
    pub fn for_spec(stream: &Arc<CudaStream>, spec: &AttentionSpec) -> Result<Self, GpuError> {
        spec.validate()?;
        DeviceState::empty(stream, spec.expected_shape(Operand::RowStat).iter().product(), spec.head_dim_v)
    }

    /// Checks that this state has `rows` rows of `dv` columns.
    pub(crate) fn check_fits(&self, rows: usize, dv: usize) -> Result<(), GpuError> {
        if self.rows != rows || self.dv != dv {
            return Err(GpuError::Shape {
                argument: "state",
                expected: vec![rows, dv],
                actual: vec![self.rows, self.dv],
            });
        }
        Ok(())
    }
}

/// One warp per row, `ROWS_PER_CTA` rows per CTA.
fn row_config(rows: usize) -> Result<LaunchConfig, GpuError> {
    let ctas = u32::try_from(rows.div_ceil(ROWS_PER_CTA as usize))
        .map_err(|_| GpuError::TooLarge { argument: "state rows", value: rows })?;
    Ok(LaunchConfig { grid_dim: (ctas, 1, 1), block_dim: (32 * ROWS_PER_CTA, 1, 1), shared_mem_bytes: 0 })
}

/// `run ← run ⊕ part` (E4) on `stream`: both states must have the same rows and columns.
pub fn merge_states(stream: &Arc<CudaStream>, run: &mut DeviceState, part: &DeviceState) -> Result<(), GpuError> {
    part.check_fits(run.rows, run.dv)?;
    if run.rows == 0 {
        return Ok(());
    }
    let dv = i32::try_from(run.dv).map_err(|_| GpuError::TooLarge { argument: "dv", value: run.dv })?;
    let rows = i64::try_from(run.rows).map_err(|_| GpuError::TooLarge { argument: "state rows", value: run.rows })?;
    // The merge does not depend on the storage type; the module is compiled with one (common.cuh needs it).
    let module = compile::module(stream.context(), RING_STATE, &["ELEM_BF16".to_owned()])?;
    let func =
        module.load_function("state_merge").map_err(|e| GpuError::driver("cuModuleGetFunction(state_merge)", e))?;
    launch::launch_state_merge(
        stream,
        &func,
        row_config(run.rows)?,
        (&mut run.a, &mut run.m, &mut run.l),
        (&part.a, &part.m, &part.l),
        &RingStateParams { rows, dv, ..RingStateParams::default() },
    )
}

/// E5 on `stream`: `O = round_T(A/ℓ)` into the first elements of `o` (the spec's `O` layout) and `LSE = m + ln ℓ`
/// into `lse`; rows that saw no key get `O = 0`, `LSE = −∞`.
pub fn finalize_state<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    state: &DeviceState,
    o: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    spec.validate()?;
    let rows: usize = spec.expected_shape(Operand::RowStat).iter().product();
    state.check_fits(rows, spec.head_dim_v)?;
    check_len("o", o, rows * spec.head_dim_v)?;
    check_len("lse", lse, rows)?;
    if rows == 0 {
        return Ok(());
    }
    let too_large = |argument: &'static str, value: usize| GpuError::TooLarge { argument, value };
    let (varlen, rows_per_head) = match spec.layout {
        Layout::Varlen { .. } => (1, rows / spec.n_heads_q.max(1)),
        _ => (0, rows),
    };
    let scalars = RingStateParams {
        rows: i64::try_from(rows).map_err(|_| too_large("state rows", rows))?,
        dv: i32::try_from(spec.head_dim_v).map_err(|_| too_large("dv", spec.head_dim_v))?,
        varlen,
        n_heads: i32::try_from(spec.n_heads_q).map_err(|_| too_large("n_heads_q", spec.n_heads_q))?,
        rows_per_head: i64::try_from(rows_per_head).map_err(|_| too_large("state rows", rows_per_head))?,
        reserved: 0,
    };
    let module = compile::module(stream.context(), RING_STATE, &[T::DEFINE.to_owned()])?;
    let func = module
        .load_function("state_finalize")
        .map_err(|e| GpuError::driver("cuModuleGetFunction(state_finalize)", e))?;
    launch::launch_state_finalize(stream, &func, row_config(rows)?, (&state.a, &state.m, &state.l), (o, lse), &scalars)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The global visibility of the spec mask, written out independently of `ChunkWindow`.
    fn global(mask: &Mask, len_q: usize, len_k: usize, i: usize, j: usize) -> bool {
        mask.matrix(len_q, len_k)[[i, j]]
    }

    #[test]
    fn a_chunk_pairs_window_sees_exactly_what_the_global_mask_shows() {
        let masks = [
            Mask::None,
            Mask::Causal,
            Mask::Window { left: 3, right: 0 },
            Mask::Window { left: 0, right: 2 },
            Mask::Window { left: 5, right: 4 },
            Mask::And(vec![Mask::Causal, Mask::Window { left: 2, right: 7 }]),
        ];
        let mut pairs_seen = 0;
        let mut pairs_skipped = 0;
        for mask in &masks {
            for (len_q, len_k) in [(13, 13), (9, 17), (17, 9), (1, 5), (6, 1)] {
                // Every split of both sides into chunks of 1 to 7 positions, starting anywhere.
                for q0 in 0..len_q {
                    for n_q in 1..=(len_q - q0).min(7) {
                        for k0 in 0..len_k {
                            for n_k in 1..=(len_k - k0).min(7) {
                                let w = ChunkWindow::for_pair(mask, (len_q, len_k), (q0, n_q), (k0, n_k)).unwrap();
                                let mut any = false;
                                for i in 0..n_q {
                                    for j in 0..n_k {
                                        let g = global(mask, len_q, len_k, q0 + i, k0 + j);
                                        assert_eq!(w.visible(i, j, n_q, n_k), g, "{mask:?} {q0}+{i} {k0}+{j}");
                                        any |= g;
                                    }
                                }
                                assert_eq!(w.sees_any(n_q, n_k), any, "{mask:?} q {q0}+{n_q} k {k0}+{n_k}: {w:?}");
                                if any {
                                    pairs_seen += 1;
                                } else {
                                    pairs_skipped += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        // Both outcomes occur, so neither answer is vacuous.
        assert!(pairs_seen > 1000 && pairs_skipped > 1000, "{pairs_seen} seen, {pairs_skipped} skipped");
    }

    #[test]
    fn kernel_values_clamp_and_mark_unbounded_sides() {
        let w = ChunkWindow { left: None, right: Some(-5) };
        assert_eq!(w.kernel_values(), (1 << 30, -5));
        let far = ChunkWindow { left: Some(-(1 << 40)), right: Some(1 << 40) };
        assert_eq!(far.kernel_values(), (-(1 << 30), 1 << 30));
    }

    #[test]
    fn chunks_outside_the_sequence_predicates_and_strided_masks_are_typed_errors() {
        let bad = ChunkWindow::for_pair(&Mask::None, (10, 10), (8, 3), (0, 1));
        assert!(matches!(bad, Err(GpuError::Unsupported { argument: "chunk", .. })));
        let p = Mask::Predicate(attnproof_oracle::Predicate {
            name: "even".into(),
            visible: Arc::new(|pair| pair.key % 2 == 0),
        });
        assert!(matches!(ChunkWindow::for_pair(&p, (4, 4), (0, 2), (0, 2)), Err(GpuError::Unsupported { .. })));
        let nsa = Mask::StridedCausal { len: 4, stride: 2 };
        let strided = ChunkWindow::for_pair(&nsa, (8, 3), (0, 4), (0, 2));
        assert!(matches!(strided, Err(GpuError::Unsupported { argument: "mask", .. })), "{strided:?}");
    }
}
