//! The ring backward's four GPU steps (E11 with dK/dV travelling home), each one launch of the backward kernels'
//! `KV_ACCUM` module (`crate::backward`'s `ring_launch`): `D` per query chunk ([`ring_backward_preprocess`]), every
//! visible (query chunk, key chunk) pair's dQ and dK, dV sums added to f32 accumulators ([`ring_backward_pair`]), and
//! the accumulators turned into dQ ([`ring_backward_finish_dq`]) and, once a KV chunk is home, dK and dV
//! ([`ring_backward_finish_dkv`]). The recipe counts the pairs' extra f32 additions in `extra_merges` (dQ) and
//! `extra_query_partials` (dK, dV).

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Operand;
use cudarc::driver::{CudaSlice, CudaStream};

use super::state::ChunkWindow;
use crate::backward::{RingBuffers, ring_launch};
use crate::common::{GpuElement, check_len};
use crate::error::GpuError;
use crate::launch::BackwardKernel;

/// The read-only inputs of one (query chunk, key chunk) pair of the ring backward: the pair's Q, K, V, the forward's
/// LSE of the query chunk's rows (the whole row's LSE, not the pair's), dO, and `D` from [`ring_backward_preprocess`].
#[derive(Clone, Copy, Debug)]
pub struct PairBackwardInputs<'a, T> {
    /// Queries of the chunk.
    pub q: &'a CudaSlice<T>,
    /// Keys of the chunk.
    pub k: &'a CudaSlice<T>,
    /// Values of the chunk.
    pub v: &'a CudaSlice<T>,
    /// The rows' LSE (f32, natural log).
    pub lse: &'a CudaSlice<f32>,
    /// The rows' upstream gradient.
    pub d_out: &'a CudaSlice<T>,
    /// The rows' `D`.
    pub delta: &'a CudaSlice<f32>,
}

/// The sizes of `spec`'s operands.
fn sizes(spec: &AttentionSpec) -> impl Fn(Operand) -> usize + '_ {
    |op| spec.expected_shape(op).iter().product::<usize>()
}

/// Ring backward, step 1 for a query chunk (`spec`: the chunk's rows as a problem): `D = rowsum(dO ∘ O)` (E7).
pub fn ring_backward_preprocess<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    o: &CudaSlice<T>,
    d_out: &CudaSlice<T>,
    delta: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    let size = sizes(spec);
    check_len("o", o, size(Operand::O))?;
    check_len("d_out", d_out, size(Operand::O))?;
    check_len("delta", delta, size(Operand::RowStat))?;
    let real = RingBuffers { o: Some(o), d_out: Some(d_out), delta: Some(delta), ..RingBuffers::default() };
    ring_launch(stream, spec, None, BackwardKernel::Preprocess, real)
}

/// The f32 workspace a KV chunk's dK, dV sums travel in: `n_heads_q · B · n_k · (d + dv)` values for `spec` (the KV
/// chunk's keys as a problem), zeroed before the first pair adds to it.
pub fn ring_dkv_accumulator_len(spec: &AttentionSpec) -> usize {
    let k_rows: usize = sizes(spec)(Operand::K) / (spec.n_heads_kv * spec.head_dim).max(1);
    spec.n_heads_q * k_rows * (spec.head_dim + spec.head_dim_v)
}

/// Ring backward, step 2 for each visible (query chunk, key chunk) pair (`spec`: the pair as a problem with
/// [`attnproof_oracle::Mask::None`], `window` its visibility): adds the pair's dQ (f32, KV-owner atomics) into
/// `dq_acc` (Q-shaped) and its per-query-head f32 dK, dV sums into `dkv_acc` (see [`ring_dkv_accumulator_len`]).
/// The arithmetic inside the pair is the backward kernel's; across pairs each sum gains one f32 addition per pair,
/// which the recipe's `extra_merges` (dQ) and `extra_query_partials` (dK, dV) count.
pub fn ring_backward_pair<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    window: ChunkWindow,
    inputs: PairBackwardInputs<'_, T>,
    dq_acc: &mut CudaSlice<f32>,
    dkv_acc: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    let size = sizes(spec);
    check_len("q", inputs.q, size(Operand::Q))?;
    check_len("k", inputs.k, size(Operand::K))?;
    check_len("v", inputs.v, size(Operand::V))?;
    check_len("lse", inputs.lse, size(Operand::RowStat))?;
    check_len("d_out", inputs.d_out, size(Operand::O))?;
    check_len("delta", inputs.delta, size(Operand::RowStat))?;
    check_len("dq_acc", dq_acc, size(Operand::Q))?;
    check_len("dkv_acc", dkv_acc, ring_dkv_accumulator_len(spec))?;
    // The kernel reads D through the buffer slot the preprocess writes; a copy keeps `inputs` read-only.
    let mut delta = stream.clone_dtod(inputs.delta).map_err(|e| GpuError::driver("cuMemcpyDtoD(delta)", e))?;
    let real = RingBuffers {
        q: Some(inputs.q),
        k: Some(inputs.k),
        v: Some(inputs.v),
        lse: Some(inputs.lse),
        d_out: Some(inputs.d_out),
        delta: Some(&mut delta),
        dq_acc: Some(dq_acc),
        dkv_acc: Some(dkv_acc),
        ..RingBuffers::default()
    };
    ring_launch(stream, spec, Some(window), BackwardKernel::KvOwner, real)
}

/// Ring backward, step 3 for a query chunk: `dQ = round_T(α̂ · dq_acc)`.
pub fn ring_backward_finish_dq<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    dq_acc: &CudaSlice<f32>,
    dq: &mut CudaSlice<T>,
) -> Result<(), GpuError> {
    check_len("dq_acc", dq_acc, sizes(spec)(Operand::Q))?;
    check_len("dq", dq, sizes(spec)(Operand::Q))?;
    // The finalize reads the accumulator through its read-only slot; a copy gives it the mutable one the launch
    // wrapper holds.
    let mut acc = stream.clone_dtod(dq_acc).map_err(|e| GpuError::driver("cuMemcpyDtoD(dq_acc)", e))?;
    let real = RingBuffers { dq: Some(dq), dq_acc: Some(&mut acc), ..RingBuffers::default() };
    ring_launch(stream, spec, None, BackwardKernel::Finalize, real)
}

/// Ring backward, step 4 for a KV chunk back home (`spec`: the chunk's keys as a problem): `dK = round_T(α̂ · Σ_h)`,
/// `dV = round_T(Σ_h)` over each KV head's query heads in ascending order, from `dkv_acc`.
pub fn ring_backward_finish_dkv<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    dkv_acc: &CudaSlice<f32>,
    dk: &mut CudaSlice<T>,
    dv: &mut CudaSlice<T>,
) -> Result<(), GpuError> {
    check_len("dkv_acc", dkv_acc, ring_dkv_accumulator_len(spec))?;
    check_len("dk", dk, sizes(spec)(Operand::K))?;
    check_len("dv", dv, sizes(spec)(Operand::V))?;
    let mut acc = stream.clone_dtod(dkv_acc).map_err(|e| GpuError::driver("cuMemcpyDtoD(dkv_acc)", e))?;
    let real = RingBuffers { dk: Some(dk), dv: Some(dv), dkv_acc: Some(&mut acc), ..RingBuffers::default() };
    ring_launch(stream, spec, None, BackwardKernel::GroupSum, real)
}
