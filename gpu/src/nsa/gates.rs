//! NSA's gates (E18) on the GPU: `gpu/kernels/nsa_gates.cu` behind typed wrappers. The forward
//! ([`gate_combine_device`], [`gate_combine`]) mixes the three branch outputs, `O = Σ_b σ(x_b) o_b`; the backward
//! ([`gate_backward_device`], [`gate_backward`]) gives each branch its upstream gradient `dO_b = σ(x_b) dO` (what the
//! branch's attention backward takes as its `dO`) and the gate logits theirs, `∂L/∂x_b = σ(x_b) σ(−x_b) ⟨dO, o_b⟩`.
//! The rule is the oracle's (`attnproof_oracle::nsa::gate_combine`, `gate_combine_backward`).
//!
//! # Layout and types
//!
//! The branch outputs, `O`, `dO` and the `dO_b` have O's layout for the spec (dense `[B, Hq, Lq, dv]`, varlen
//! `[Tq, Hq, dv]`) and its storage type. The gate logits `x` are given in the storage type, in O's layout with 3
//! columns ([`gate_logits_shape`]: dense `[B, Hq, Lq, 3]`, varlen `[Tq, Hq, 3]`), last axis in the oracle's
//! `Branch` order (compressed, selected, window); **the sigmoid is applied inside**, in f32. Their gradients come back
//! in f32, in the same shape.
//!
//! # Recipe and bounds
//!
//! `σ(x) = 1 / (1 + expf(−x))` in f32 with IEEE division; the sum `σ_0 o_0`, then one `fmaf` per further branch,
//! rounded once to the storage type; `dO_b = σ_b dO` rounded once; `σ'(x)` as `σ(x) σ(−x)` (each factor its own
//! `expf`, so a gate near 1 keeps its digits) times `⟨dO, o_b⟩` summed in f32. The bounds are
//! `attnproof_proofs::nsa_bound::{gate_combine_bound, gate_branch_gradient_bound, gate_logit_gradient_bound}`.
//!
//! # Errors
//!
//! Head dims must be multiples of 8 up to 256 (like every kernel here), buffers long enough, host tensors of the
//! right shape with finite values; each is a typed error before any launch.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Operand;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::{ArrayD, ArrayViewD, Dimension, IxDyn};

use crate::common::{GpuElement, check_len};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::flash::host_input;
use crate::launch;
use crate::params::{FlashParams, NsaParams};

/// `gpu/kernels/nsa_gates.cu` after the shared helpers.
pub const NSA_GATES: KernelSource = KernelSource {
    name: "nsa_gates",
    source: concat!(include_str!("../../kernels/common.cuh"), include_str!("../../kernels/nsa_gates.cu")),
};

/// Rows of O per CTA (the kernel's `GATE_WARPS`: one warp per row).
const ROWS_PER_CTA: usize = 4;

/// The gate logits' shape (and their gradients'): O's with 3 columns, dense `[B, Hq, Lq, 3]`, varlen `[Tq, Hq, 3]`.
pub fn gate_logits_shape(spec: &AttentionSpec) -> Vec<usize> {
    let mut shape = spec.expected_shape(Operand::O);
    if let Some(last) = shape.last_mut() {
        *last = 3;
    }
    shape
}

/// The three branch outputs on the device, in O's layout: compressed, selected, window.
#[derive(Clone, Copy, Debug)]
pub struct GateBranches<'a, T> {
    /// `o_cmp`.
    pub compressed: &'a CudaSlice<T>,
    /// `o_slc`.
    pub selected: &'a CudaSlice<T>,
    /// `o_win`.
    pub window: &'a CudaSlice<T>,
}

impl<'a, T> GateBranches<'a, T> {
    fn all(&self) -> [(&'static str, &'a CudaSlice<T>); 3] {
        [("o_cmp", self.compressed), ("o_slc", self.selected), ("o_win", self.window)]
    }
}

/// The backward's outputs on the device: each branch's `dO_b` (O's layout and type) and the gate logits' gradients
/// (f32, [`gate_logits_shape`]).
#[derive(Debug)]
pub struct GateGradientsDevice<'a, T> {
    /// `dO_cmp`.
    pub d_compressed: &'a mut CudaSlice<T>,
    /// `dO_slc`.
    pub d_selected: &'a mut CudaSlice<T>,
    /// `dO_win`.
    pub d_window: &'a mut CudaSlice<T>,
    /// `∂L/∂x`.
    pub d_gate_logits: &'a mut CudaSlice<f32>,
}

/// The launch's scalars and grid after every check of `spec` and the buffers' lengths.
fn plan<T>(
    spec: &AttentionSpec,
    branches: &GateBranches<'_, T>,
    logits: &CudaSlice<T>,
) -> Result<(NsaParams, LaunchConfig), GpuError> {
    let (flash, _, _) = FlashParams::for_spec(spec)?;
    let rows = super::o_rows(spec)?;
    let per_row = spec.head_dim_v;
    for (argument, buffer) in branches.all() {
        check_len(argument, buffer, rows as usize * per_row)?;
    }
    check_len("gate_logits", logits, rows as usize * 3)?;
    let blocks = (rows as usize).div_ceil(ROWS_PER_CTA);
    let grid_x = u32::try_from(blocks)
        .ok()
        .filter(|&b| b as usize <= i32::MAX as usize)
        .ok_or(GpuError::TooLarge { argument: "rows of O", value: rows as usize })?;
    let cfg =
        LaunchConfig { grid_dim: (grid_x, 1, 1), block_dim: (32 * ROWS_PER_CTA as u32, 1, 1), shared_mem_bytes: 0 };
    Ok((NsaParams { flash, rows, ..NsaParams::default() }, cfg))
}

/// `O = Σ_b σ(x_b) o_b` on device buffers (module docs), written to the first elements of `o`; `kernel` is
/// [`NSA_GATES`] or a patched copy. Checks run before the launch, which is asynchronous on `stream`.
pub fn gate_combine_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    kernel: KernelSource,
    branches: GateBranches<'_, T>,
    gate_logits: &CudaSlice<T>,
    o: &mut CudaSlice<T>,
) -> Result<(), GpuError> {
    let (params, cfg) = plan(spec, &branches, gate_logits)?;
    check_len("o", o, params.rows as usize * spec.head_dim_v)?;
    if params.rows == 0 {
        return Ok(());
    }
    let module = compile::module(stream.context(), kernel, &[T::DEFINE.to_owned()])?;
    let func = module
        .load_function("nsa_gate_combine")
        .map_err(|e| GpuError::driver("cuModuleGetFunction(nsa_gate_combine)", e))?;
    let [(_, c), (_, s), (_, w)] = branches.all();
    launch::launch_nsa_gate_combine(stream, &func, cfg, [c, s, w], gate_logits, o, &params)
}

/// The gradients of the gated sum on device buffers (module docs); `kernel` is [`NSA_GATES`] or a patched copy.
/// Checks run before the launch, which is asynchronous on `stream`.
pub fn gate_backward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    kernel: KernelSource,
    branches: GateBranches<'_, T>,
    gate_logits: &CudaSlice<T>,
    d_out: &CudaSlice<T>,
    grads: GateGradientsDevice<'_, T>,
) -> Result<(), GpuError> {
    let (params, cfg) = plan(spec, &branches, gate_logits)?;
    let per_head = params.rows as usize * spec.head_dim_v;
    check_len("d_out", d_out, per_head)?;
    check_len("d_compressed", grads.d_compressed, per_head)?;
    check_len("d_selected", grads.d_selected, per_head)?;
    check_len("d_window", grads.d_window, per_head)?;
    check_len("d_gate_logits", grads.d_gate_logits, params.rows as usize * 3)?;
    if params.rows == 0 {
        return Ok(());
    }
    let module = compile::module(stream.context(), kernel, &[T::DEFINE.to_owned()])?;
    let func = module
        .load_function("nsa_gate_backward")
        .map_err(|e| GpuError::driver("cuModuleGetFunction(nsa_gate_backward)", e))?;
    let [(_, c), (_, s), (_, w)] = branches.all();
    launch::launch_nsa_gate_backward(
        stream,
        &func,
        cfg,
        [c, s, w],
        (gate_logits, d_out),
        [grads.d_compressed, grads.d_selected, grads.d_window],
        grads.d_gate_logits,
        &params,
    )
}

/// Host tensors of the gates' operands: the branch outputs and the logits, checked and uploaded.
struct Uploaded<T> {
    branches: [CudaSlice<T>; 3],
    logits: CudaSlice<T>,
}

fn upload_operands<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    branches: [ArrayViewD<'_, T>; 3],
    gate_logits: ArrayViewD<'_, T>,
) -> Result<Uploaded<T>, GpuError> {
    FlashParams::for_spec(spec)?;
    let up = |data: &[T]| {
        if data.is_empty() { stream.alloc_zeros::<T>(1) } else { stream.clone_htod(data) }
            .map_err(|e| GpuError::driver("cuMemcpyHtoD", e))
    };
    let [c, s, w] = &branches;
    let names = ["o_cmp", "o_slc", "o_win"];
    let data = [(names[0], c), (names[1], s), (names[2], w)]
        .map(|(name, t)| host_input(spec, name, Operand::O, t).and_then(&up));
    let [c, s, w] = data;
    let shape = gate_logits_shape(spec);
    if gate_logits.shape() != shape.as_slice() {
        return Err(GpuError::Shape { argument: "gate_logits", expected: shape, actual: gate_logits.shape().to_vec() });
    }
    let logits = gate_logits
        .as_slice()
        .ok_or_else(|| GpuError::Stride { argument: "gate_logits", strides: gate_logits.strides().to_vec() })?;
    if let Some(i) = logits.iter().position(|x| !x.is_finite_value()) {
        let index = ndarray::indices(shape.as_slice()).into_iter().nth(i).map(|ix| ix.slice().to_vec());
        let index = index.unwrap_or_default();
        return Err(attnproof_oracle::OracleError::NonFinite { argument: "gate_logits", index, value: f64::NAN }.into());
    }
    Ok(Uploaded { branches: [c?, s?, w?], logits: up(logits)? })
}

fn download<X: cudarc::driver::DeviceRepr + Clone>(
    stream: &Arc<CudaStream>,
    buffer: &CudaSlice<X>,
    shape: &[usize],
) -> Result<ArrayD<X>, GpuError> {
    let mut back = stream.clone_dtoh(buffer).map_err(|e| GpuError::driver("cuMemcpyDtoH", e))?;
    back.truncate(shape.iter().product());
    Ok(ArrayD::from_shape_vec(IxDyn(shape), back).expect("length matches the shape"))
}

/// `O = Σ_b σ(x_b) o_b` from host tensors (copies in, launches, copies out, synchronizes); `branches` in O's shape in
/// the order compressed, selected, window, `gate_logits` in [`gate_logits_shape`].
pub fn gate_combine<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    branches: [ArrayViewD<'_, T>; 3],
    gate_logits: ArrayViewD<'_, T>,
) -> Result<ArrayD<T>, GpuError> {
    let up = upload_operands(stream, spec, branches, gate_logits)?;
    let shape = spec.expected_shape(Operand::O);
    let n = shape.iter().product::<usize>();
    let mut o = stream.alloc_zeros::<T>(n.max(1)).map_err(|e| GpuError::driver("cuMemAlloc", e))?;
    let [c, s, w] = &up.branches;
    let branches = GateBranches { compressed: c, selected: s, window: w };
    gate_combine_device(stream, spec, NSA_GATES, branches, &up.logits, &mut o)?;
    let out = download(stream, &o, &shape)?;
    stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
    Ok(out)
}

/// The gated sum's gradients, host side.
#[derive(Clone, Debug, PartialEq)]
pub struct GateGradientsHost<T> {
    /// `dO_b` in the order compressed, selected, window, each in O's shape.
    pub d_branches: [ArrayD<T>; 3],
    /// `∂L/∂x` in [`gate_logits_shape`], f32.
    pub d_gate_logits: ArrayD<f32>,
}

/// The gated sum's gradients from host tensors (copies in, launches, copies out, synchronizes); `d_out` in O's shape.
pub fn gate_backward<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    branches: [ArrayViewD<'_, T>; 3],
    gate_logits: ArrayViewD<'_, T>,
    d_out: ArrayViewD<'_, T>,
) -> Result<GateGradientsHost<T>, GpuError> {
    let up = upload_operands(stream, spec, branches, gate_logits)?;
    let d_out = host_input(spec, "d_out", Operand::O, &d_out)?;
    let alloc_err = |e| GpuError::driver("cuMemAlloc", e);
    let d_out = if d_out.is_empty() { stream.alloc_zeros::<T>(1) } else { stream.clone_htod(d_out) }
        .map_err(|e| GpuError::driver("cuMemcpyHtoD", e))?;
    let shape = spec.expected_shape(Operand::O);
    let n = shape.iter().product::<usize>().max(1);
    let alloc = || stream.alloc_zeros::<T>(n).map_err(alloc_err);
    let (mut dc, mut ds, mut dw) = (alloc()?, alloc()?, alloc()?);
    let logits_shape = gate_logits_shape(spec);
    let mut dx = stream.alloc_zeros::<f32>(logits_shape.iter().product::<usize>().max(1)).map_err(alloc_err)?;
    let [c, s, w] = &up.branches;
    let branches = GateBranches { compressed: c, selected: s, window: w };
    let grads =
        GateGradientsDevice { d_compressed: &mut dc, d_selected: &mut ds, d_window: &mut dw, d_gate_logits: &mut dx };
    gate_backward_device(stream, spec, NSA_GATES, branches, &up.logits, &d_out, grads)?;
    let d_branches = [download(stream, &dc, &shape)?, download(stream, &ds, &shape)?, download(stream, &dw, &shape)?];
    let d_gate_logits = download(stream, &dx, &logits_shape)?;
    stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
    Ok(GateGradientsHost { d_branches, d_gate_logits })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::Layout;

    #[test]
    fn gate_logits_take_o_shape_with_three_columns() {
        let spec = AttentionSpec::dense(2, 4, 2, 100, 70, 64, 32);
        assert_eq!(gate_logits_shape(&spec), [2, 4, 100, 3]);
        assert_eq!(super::super::o_rows(&spec).unwrap(), 800);
        let varlen = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 31, 31, 80], cu_seqlens_k: vec![0, 31, 31, 80] },
            ..AttentionSpec::dense(1, 3, 3, 1, 1, 16, 8)
        };
        assert_eq!(gate_logits_shape(&varlen), [80, 3, 3]);
        assert_eq!(super::super::o_rows(&varlen).unwrap(), 240);
    }
}
