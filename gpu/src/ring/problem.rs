//! What every GPU ring run shares: its errors ([`GpuRingError`]), its inputs ([`RingInputs`], and for the backward
//! [`BackwardStart`]), the dense shapes of a chunk pair, the recipe's extra rescale steps, and the upload of a chunk's
//! rows.

use std::ops::Range;
use std::sync::Arc;

use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Layout};
use attnproof_ring_driver::{RingFault, RingSplit};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits};
use ndarray::{ArrayViewD, Axis, Slice};
use thiserror::Error;

use crate::error::GpuError;

/// Why a GPU ring run failed.
#[derive(Debug, Error)]
pub enum GpuRingError {
    /// The schedule went wrong (a misrouted block, a neighbour gone).
    #[error(transparent)]
    Ring(#[from] RingFault),
    /// A kernel wrapper refused or failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A driver call of the transport failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// The problem is outside what the GPU ring supports.
    #[error("the GPU ring does not support {0}")]
    Unsupported(&'static str),
}

impl From<DriverError> for GpuRingError {
    fn from(e: DriverError) -> Self {
        GpuRingError::Driver(e.to_string())
    }
}

impl From<cudarc::nccl::result::NcclError> for GpuRingError {
    fn from(e: cudarc::nccl::result::NcclError) -> Self {
        GpuRingError::Driver(format!("NCCL: {e:?}"))
    }
}

/// The inputs of a GPU ring run: the problem and its host tensors `Q, K, V` in the storage type, shaped as the spec
/// expects (dense `[B, H, L, D]`).
#[derive(Clone, Debug)]
pub struct RingInputs<'a, T> {
    /// The problem.
    pub spec: &'a AttentionSpec,
    /// Queries.
    pub q: ArrayViewD<'a, T>,
    /// Keys.
    pub k: ArrayViewD<'a, T>,
    /// Values.
    pub v: ArrayViewD<'a, T>,
}

/// The forward's outputs and the upstream gradient a backward starts from, host tensors shaped as the spec expects.
#[derive(Clone, Debug)]
pub struct BackwardStart<'a, T> {
    /// The forward's `O`.
    pub o: ArrayViewD<'a, T>,
    /// The forward's LSE.
    pub lse: ArrayViewD<'a, f32>,
    /// The upstream gradient.
    pub d_out: ArrayViewD<'a, T>,
}

/// (B, Lq, Lk) of a dense spec.
pub fn dense_dims(spec: &AttentionSpec) -> (usize, usize, usize) {
    let (q, k) = (spec.expected_shape(Operand::Q), spec.expected_shape(Operand::K));
    (q[0], q[2], k[2])
}

/// The dense spec of a chunk pair: the global batch, heads, head dims and scale, the chunks' lengths, no mask.
pub fn pair_spec(spec: &AttentionSpec, n_q: usize, n_k: usize) -> AttentionSpec {
    let (b, ..) = dense_dims(spec);
    AttentionSpec::dense(b, spec.n_heads_q, spec.n_heads_kv, n_q, n_k, spec.head_dim, spec.head_dim_v)
        .with_scale(spec.scale)
}

/// The `extra_merges` of the forward `FlashRecipe` that covers the GPU ring forward over `split`: `2(P − 1)` for `P`
/// key chunks per sequence ([`crate::ring::state`]'s docs).
pub fn gpu_ring_recipe_extra_merges(split: RingSplit) -> usize {
    2 * split.pieces().saturating_sub(1)
}

/// The rows `range` of a dense tensor's sequence axis (axis 2), on `stream`.
pub(crate) fn upload_rows<T: DeviceRepr + ValidAsZeroBits + Clone>(
    stream: &Arc<CudaStream>,
    t: &ArrayViewD<'_, T>,
    range: &Range<usize>,
) -> Result<CudaSlice<T>, GpuRingError> {
    let rows = t.slice_axis(Axis(2), Slice::from(range.clone())).as_standard_layout().to_owned();
    let data = rows.as_slice().expect("standard layout");
    Ok(if data.is_empty() { stream.alloc_zeros::<T>(1)? } else { stream.clone_htod(data)? })
}

/// Checks that `tensor` has the shape `spec` expects of `operand`.
pub(crate) fn check_shape<X>(
    spec: &AttentionSpec,
    argument: &'static str,
    operand: Operand,
    tensor: &ArrayViewD<'_, X>,
) -> Result<(), GpuRingError> {
    let expected = spec.expected_shape(operand);
    if tensor.shape() == expected.as_slice() {
        Ok(())
    } else {
        Err(GpuError::Shape { argument, expected, actual: tensor.shape().to_vec() }.into())
    }
}

/// Checks that the GPU ring supports `inputs` over `split` on `streams` (one per device); returns (Lq, Lk).
pub(crate) fn check_ring_problem<T>(
    inputs: &RingInputs<'_, T>,
    split: RingSplit,
    streams: &[Arc<CudaStream>],
) -> Result<(usize, usize), GpuRingError> {
    let spec = inputs.spec;
    spec.validate().map_err(GpuError::from)?;
    split.validate().map_err(|_| GpuRingError::Unsupported("a ring of zero devices"))?;
    if !matches!(spec.layout, Layout::Dense { .. }) {
        return Err(GpuRingError::Unsupported("varlen layouts"));
    }
    if streams.len() != split.n_devices {
        return Err(GpuRingError::Unsupported("a stream count other than the device count"));
    }
    check_shape(spec, "q", Operand::Q, &inputs.q)?;
    check_shape(spec, "k", Operand::K, &inputs.k)?;
    check_shape(spec, "v", Operand::V, &inputs.v)?;
    let (_, len_q, len_k) = dense_dims(spec);
    Ok((len_q, len_k))
}
