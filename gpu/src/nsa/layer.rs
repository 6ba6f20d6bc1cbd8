//! One NSA layer on the GPU (E18–E20): the landed pieces chained on device buffers, forward
//! ([`nsa_layer_forward_device`]) and backward with the selection held fixed ([`nsa_layer_backward_device`]), every
//! intermediate kept in caller-owned buffers so that a verifier can hold each stage to the oracle on the inputs that
//! stage actually had; and host conveniences ([`nsa_layer_forward`], [`nsa_layer_backward`]) that copy in, launch,
//! copy out and synchronize.
//!
//! # The forward's steps
//!
//! 1. **Compression** ([`super::compress::compress_kv_device`]): `k̃`, `ṽ` of every complete window, in
//!    [`super::compress::compressed_shape`]'s layout.
//! 2. **Compressed attention**: the dense forward (the production kernel for the device,
//!    [`crate::flash::production_forward`]: the sm_90a kernel on Hopper for head dims 64 to 128, `flash_fwd.cu`
//!    otherwise) of the layer's queries over `k̃`, `ṽ` under [`super::compressed::compressed_spec`] (the strided
//!    causal mask): `o_cmp`, `LSE_cmp`.
//! 3. **Selection** ([`super::select::select_device`]): the block scores recomputed from `q`, `k̃` and `LSE_cmp`, and
//!    the top-n lists with the forced blocks.
//! 4. **Selected attention** ([`super::selected::selected_device`]) over those lists: `o_slc`, `LSE_slc`.
//! 5. **Window attention**: the dense forward (as in step 2) under [`super::window::window_spec`]: `o_win`,
//!    `LSE_win`.
//! 6. **Gates** ([`super::gates::gate_combine_device`]): `O = Σ_b σ(x_b) o_b`.
//!
//! # The backward's steps
//!
//! 1. **Gates** ([`super::gates::gate_backward_device`]): each branch's `dO_b = σ(x_b) dO` and the logits' f32
//!    gradients.
//! 2. **Compressed attention**: the dense backward (the production kernel for the device, [`crate::backward`]) under
//!    the compressed spec from `q`, `k̃`, `ṽ`, `o_cmp`, `LSE_cmp` and `dO_cmp`: dQ, `dk̃`, `dṽ` (and `D`).
//! 3. **The pooling's transpose** ([`super::compress::compress_kv_backward_device`]): `dk̃`, `dṽ` onto the tokens;
//!    for a learned matrix also its own gradient `∂L/∂W` ([`super::compress::compress_map_gradient_device`], summed
//!    over sequences and KV heads).
//! 4. **Selected attention** ([`super::selected_backward::selected_backward_device`]) over the forward's lists.
//! 5. **Window attention**: the dense backward under the window spec.
//! 6. **The sum** (`nsa_branch_sum` in `nsa_gates.cu`): dQ, dK and dV each the sum of the three branches' gradients,
//!    added in f32 in the order compressed, selected, window and rounded once to the storage type (the bound is
//!    `attnproof_proofs::nsa_bound::branch_sum_bound`).
//!
//! The dQ strategy ([`GpuBackwardStrategy::KvOwnerAtomic`] or [`GpuBackwardStrategy::KvOwnerDeterministic`]) applies
//! to the three attention backwards alike; in the deterministic mode the whole backward is bitwise reproducible.
//!
//! # Layouts and ownership
//!
//! Every tensor has its piece's layout: Q, K, V, O, the gate logits and their gradients as the layer's spec says
//! (dense `[B, H, L, ·]`, varlen `[T, H, ·]`), LSE and `D` dense `[B, Hq, L]`, varlen `[Hq, T]`, the compressed
//! operands and their gradients [`super::compress::compressed_shape`]'s, the scores and lists
//! [`super::select::scores_shape`]'s and [`super::select::lists_shape`]'s. The caller owns every buffer: the inputs,
//! the forward's intermediates ([`NsaLayerForwardDevice`], which [`NsaLayerForwardDevice::alloc`] sizes) and the
//! backward's ([`NsaLayerBackwardDevice`]); buffers may be longer than their tensors (only the first elements are
//! written), and the work is asynchronous on the caller's stream. [`NsaLayerKernels`] names the kernel text of each
//! piece, so that a test can run the layer with one piece swapped for a mutant.
//!
//! # Errors
//!
//! Every check runs before the first launch, each a typed [`GpuError`]: the configuration (`NsaConfig::validate`; a
//! window of 0 is refused, the branch being disabled), the layer (causal self-attention, every sequence's query and
//! key lengths equal: `Unsupported` naming `mask` or `layout`), what each piece supports (head dims multiples of 8 up
//! to 256, a GQA group of at most 64, at most 32 selected blocks, selection blocks of at most 64 tokens or a multiple
//! of 64, sizes within the kernels' 32-bit arguments), the dQ strategy (two traversals are not implemented for the
//! selected branch), and every buffer's length (`BufferTooSmall`; the gate logits hold
//! [`super::gates::gate_logits_shape`]'s elements). The host conveniences also check every host tensor's shape
//! (`Shape`) and values.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::nsa::{Compression, NsaConfig};
use attnproof_oracle::spec::Operand;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, LaunchConfig, ValidAsZeroBits};
use ndarray::{Array2, Array3, ArrayD, ArrayViewD, IxDyn};

use super::compress::{
    NSA_COMPRESS, compress_kv_backward_device, compress_kv_device, compress_map_gradient_device, compressed_shape,
};
use super::compressed::compressed_spec;
use super::gates::{
    GateBranches, GateGradientsDevice, NSA_GATES, gate_backward_device, gate_combine_device, gate_logits_shape,
};
use super::select::{MAX_GROUP, MAX_SELECTED, NSA_SELECT, lists_shape, scores_shape, select_device};
use super::selected::{NSA_SELECTED, selected_device};
use super::selected_backward::{NSA_SELECTED_BWD, selected_backward_device};
use super::window::window_spec;
use crate::backward::{
    BackwardDeviceInputs, BackwardDeviceOutputs, BackwardTiling, GpuBackwardStrategy, backward_variant,
    flash_backward_device_with, production_backward_kernel,
};
use crate::common::{GpuElement, check_len, grid_dim};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::flash::{ForwardTiling, flash_forward_device_with, forward_variant, host_input, production_forward};
use crate::launch;

/// The kernel text of each piece of the layer. [`Default`] gives the embedded texts and the production dense
/// backward; a test swaps one field for a patched copy to run the layer with one piece broken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NsaLayerKernels {
    /// The compression and its transpose ([`NSA_COMPRESS`]).
    pub compress: KernelSource,
    /// The dense forward of the compressed and window branches (a text of `flash_fwd.cu` in the production tiling for
    /// the head dims, or of the sm_90a forward in its one tiling); `None`: the production kernel for the device
    /// ([`production_forward`]).
    pub dense_forward: Option<KernelSource>,
    /// The dense backward of the compressed and window branches (in the default tiling); `None`: the production
    /// kernel for the device ([`production_backward_kernel`]: the `wgmma` backward on an H200 where it takes the
    /// spec, `flash_bwd.cu` otherwise).
    pub dense_backward: Option<KernelSource>,
    /// The block scores and top-n ([`NSA_SELECT`]).
    pub select: KernelSource,
    /// The selected attention's forward ([`NSA_SELECTED`]).
    pub selected: KernelSource,
    /// The selected attention's backward ([`NSA_SELECTED_BWD`]).
    pub selected_backward: KernelSource,
    /// The gates, their gradients and the branch sum ([`NSA_GATES`]).
    pub gates: KernelSource,
}

impl Default for NsaLayerKernels {
    fn default() -> Self {
        NsaLayerKernels {
            compress: NSA_COMPRESS,
            dense_forward: None,
            dense_backward: None,
            select: NSA_SELECT,
            selected: NSA_SELECTED,
            selected_backward: NSA_SELECTED_BWD,
            gates: NSA_GATES,
        }
    }
}

/// The shape of every tensor of a layer of spec `spec` under `config` (module docs, "Layouts and ownership").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NsaLayerShapes {
    /// Q (and dQ and each branch's dQ).
    pub q: Vec<usize>,
    /// K (and dK, each branch's dK).
    pub k: Vec<usize>,
    /// V (and dV, each branch's dV).
    pub v: Vec<usize>,
    /// O: the output, each branch's output, `dO` and each branch's `dO_b`.
    pub o: Vec<usize>,
    /// LSE and `D` of each branch.
    pub row_stat: Vec<usize>,
    /// The gate logits and their gradients.
    pub gate_logits: Vec<usize>,
    /// `k̃` and `dk̃`.
    pub k_cmp: Vec<usize>,
    /// `ṽ` and `dṽ`.
    pub v_cmp: Vec<usize>,
    /// The block scores.
    pub scores: [usize; 3],
    /// The lists.
    pub lists: [usize; 3],
    /// The learned compression matrices' gradients `[l·cols, cols]`, keys then values: `None` for a map that is not
    /// a matrix (it has no parameters here).
    pub d_maps: [Option<[usize; 2]>; 2],
}

impl NsaLayerShapes {
    /// The shapes for `spec` under `config`, after the configuration's and the layer's checks.
    pub fn new(spec: &AttentionSpec, config: &NsaConfig) -> Result<Self, GpuError> {
        compressed_spec(spec, config)?;
        Ok(NsaLayerShapes {
            q: spec.expected_shape(Operand::Q),
            k: spec.expected_shape(Operand::K),
            v: spec.expected_shape(Operand::V),
            o: spec.expected_shape(Operand::O),
            row_stat: spec.expected_shape(Operand::RowStat),
            gate_logits: gate_logits_shape(spec),
            k_cmp: compressed_shape(spec, config, Operand::K)?,
            v_cmp: compressed_shape(spec, config, Operand::V)?,
            scores: scores_shape(spec, config)?,
            lists: lists_shape(spec, config),
            d_maps: [(&config.compress_keys, spec.head_dim), (&config.compress_values, spec.head_dim_v)]
                .map(|(map, cols)| matches!(map, Compression::Linear(_)).then_some([config.compress_len * cols, cols])),
        })
    }
}

/// Elements of a tensor of `shape`.
fn elements(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// The inputs of a layer on the device: Q, K, V and the gate logits (storage type, [`gate_logits_shape`], last axis
/// compressed, selected, window; the sigmoid is applied inside).
#[derive(Clone, Copy, Debug)]
pub struct NsaLayerInputs<'a, T> {
    /// Queries.
    pub q: &'a CudaSlice<T>,
    /// Keys.
    pub k: &'a CudaSlice<T>,
    /// Values.
    pub v: &'a CudaSlice<T>,
    /// Gate logits.
    pub gate_logits: &'a CudaSlice<T>,
}

/// The forward's intermediates and output on the device (caller-owned; [`NsaLayerForwardDevice::alloc`] sizes them
/// from [`NsaLayerShapes`], a caller may also build the struct from its own buffers of at least those lengths).
#[derive(Debug)]
pub struct NsaLayerForwardDevice<T> {
    /// `k̃`.
    pub k_cmp: CudaSlice<T>,
    /// `ṽ`.
    pub v_cmp: CudaSlice<T>,
    /// The compressed branch's output.
    pub o_cmp: CudaSlice<T>,
    /// Its LSE (`−∞` on a token that sees no complete window).
    pub lse_cmp: CudaSlice<f32>,
    /// The block scores (f32).
    pub scores: CudaSlice<f32>,
    /// The lists, ascending, `−1`-padded.
    pub lists: CudaSlice<i32>,
    /// The selected branch's output.
    pub o_slc: CudaSlice<T>,
    /// Its LSE.
    pub lse_slc: CudaSlice<f32>,
    /// The window branch's output.
    pub o_win: CudaSlice<T>,
    /// Its LSE.
    pub lse_win: CudaSlice<f32>,
    /// The layer's output.
    pub o: CudaSlice<T>,
}

/// A zeroed device buffer of `n` elements (at least one: cudarc cannot hold an empty buffer, and no kernel reads an
/// empty tensor).
fn zeroed<X: DeviceRepr + ValidAsZeroBits>(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<X>, GpuError> {
    stream.alloc_zeros::<X>(n.max(1)).map_err(|e| GpuError::driver("cuMemAlloc", e))
}

impl<T: GpuElement> NsaLayerForwardDevice<T> {
    /// Zeroed buffers of [`NsaLayerShapes`]'s sizes for `spec` under `config`.
    pub fn alloc(stream: &Arc<CudaStream>, spec: &AttentionSpec, config: &NsaConfig) -> Result<Self, GpuError> {
        let s = NsaLayerShapes::new(spec, config)?;
        Ok(NsaLayerForwardDevice {
            k_cmp: zeroed(stream, elements(&s.k_cmp))?,
            v_cmp: zeroed(stream, elements(&s.v_cmp))?,
            o_cmp: zeroed(stream, elements(&s.o))?,
            lse_cmp: zeroed(stream, elements(&s.row_stat))?,
            scores: zeroed(stream, elements(&s.scores))?,
            lists: zeroed(stream, elements(&s.lists))?,
            o_slc: zeroed(stream, elements(&s.o))?,
            lse_slc: zeroed(stream, elements(&s.row_stat))?,
            o_win: zeroed(stream, elements(&s.o))?,
            lse_win: zeroed(stream, elements(&s.row_stat))?,
            o: zeroed(stream, elements(&s.o))?,
        })
    }

    /// Checks that every buffer holds its tensor.
    fn check(&self, s: &NsaLayerShapes) -> Result<(), GpuError> {
        check_len("k_cmp", &self.k_cmp, elements(&s.k_cmp))?;
        check_len("v_cmp", &self.v_cmp, elements(&s.v_cmp))?;
        check_len("scores", &self.scores, elements(&s.scores))?;
        check_len("lists", &self.lists, elements(&s.lists))?;
        for (name, buffer) in [("o_cmp", &self.o_cmp), ("o_slc", &self.o_slc), ("o_win", &self.o_win), ("o", &self.o)] {
            check_len(name, buffer, elements(&s.o))?;
        }
        for (name, buffer) in [("lse_cmp", &self.lse_cmp), ("lse_slc", &self.lse_slc), ("lse_win", &self.lse_win)] {
            check_len(name, buffer, elements(&s.row_stat))?;
        }
        Ok(())
    }

    /// The forward's tensors, host side (copies out and synchronizes `stream`).
    pub fn download(
        &self,
        stream: &Arc<CudaStream>,
        spec: &AttentionSpec,
        config: &NsaConfig,
    ) -> Result<NsaLayerForward<T>, GpuError> {
        let s = NsaLayerShapes::new(spec, config)?;
        self.check(&s)?;
        let out = NsaLayerForward {
            k_cmp: download(stream, &self.k_cmp, &s.k_cmp)?,
            v_cmp: download(stream, &self.v_cmp, &s.v_cmp)?,
            o_cmp: download(stream, &self.o_cmp, &s.o)?,
            lse_cmp: download(stream, &self.lse_cmp, &s.row_stat)?,
            scores: rank3(download(stream, &self.scores, &s.scores)?),
            lists: rank3(download(stream, &self.lists, &s.lists)?),
            o_slc: download(stream, &self.o_slc, &s.o)?,
            lse_slc: download(stream, &self.lse_slc, &s.row_stat)?,
            o_win: download(stream, &self.o_win, &s.o)?,
            lse_win: download(stream, &self.lse_win, &s.row_stat)?,
            o: download(stream, &self.o, &s.o)?,
        };
        stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
        Ok(out)
    }

    /// The forward's tensors from host arrays (a backward from host tensors starts here), each checked against its
    /// shape; the LSEs may hold `−∞`, the lists anything (the kernels read device lists with their own rule).
    pub fn upload(
        stream: &Arc<CudaStream>,
        spec: &AttentionSpec,
        config: &NsaConfig,
        forward: &NsaLayerForward<T>,
    ) -> Result<Self, GpuError> {
        let s = NsaLayerShapes::new(spec, config)?;
        let scores = forward.scores.view().into_dyn();
        let lists = forward.lists.view().into_dyn();
        Ok(NsaLayerForwardDevice {
            k_cmp: upload(stream, "k_cmp", &forward.k_cmp.view(), &s.k_cmp)?,
            v_cmp: upload(stream, "v_cmp", &forward.v_cmp.view(), &s.v_cmp)?,
            o_cmp: upload(stream, "o_cmp", &forward.o_cmp.view(), &s.o)?,
            lse_cmp: upload(stream, "lse_cmp", &forward.lse_cmp.view(), &s.row_stat)?,
            scores: upload(stream, "scores", &scores, &s.scores)?,
            lists: upload(stream, "lists", &lists, &s.lists)?,
            o_slc: upload(stream, "o_slc", &forward.o_slc.view(), &s.o)?,
            lse_slc: upload(stream, "lse_slc", &forward.lse_slc.view(), &s.row_stat)?,
            o_win: upload(stream, "o_win", &forward.o_win.view(), &s.o)?,
            lse_win: upload(stream, "lse_win", &forward.lse_win.view(), &s.row_stat)?,
            o: upload(stream, "o", &forward.o.view(), &s.o)?,
        })
    }
}

/// A device buffer's first `shape` elements on the host (asynchronous copy; the caller synchronizes).
fn download<X: DeviceRepr + Clone>(
    stream: &Arc<CudaStream>,
    buffer: &CudaSlice<X>,
    shape: &[usize],
) -> Result<ArrayD<X>, GpuError> {
    let mut back = stream.clone_dtoh(buffer).map_err(|e| GpuError::driver("cuMemcpyDtoH", e))?;
    back.truncate(elements(shape));
    Ok(ArrayD::from_shape_vec(IxDyn(shape), back).expect("length matches the shape"))
}

/// A downloaded tensor of rank 2 (a matrix's gradient) as such.
fn rank2<X>(a: ArrayD<X>) -> Array2<X> {
    a.into_dimensionality().expect("rank 2")
}

/// A downloaded tensor of rank 3 (the scores, the lists) as such.
fn rank3<X>(a: ArrayD<X>) -> Array3<X> {
    a.into_dimensionality::<ndarray::Ix3>().expect("rank 3")
}

/// A host tensor of shape `shape` (checked, row-major) on the device.
fn upload<X: DeviceRepr + ValidAsZeroBits + Copy>(
    stream: &Arc<CudaStream>,
    argument: &'static str,
    t: &ArrayViewD<'_, X>,
    shape: &[usize],
) -> Result<CudaSlice<X>, GpuError> {
    if t.shape() != shape {
        return Err(GpuError::Shape { argument, expected: shape.to_vec(), actual: t.shape().to_vec() });
    }
    let data = t.as_slice().ok_or_else(|| GpuError::Stride { argument, strides: t.strides().to_vec() })?;
    if data.is_empty() { stream.alloc_zeros::<X>(1) } else { stream.clone_htod(data) }
        .map_err(|e| GpuError::driver("cuMemcpyHtoD", e))
}

/// The layer's branch specs, the dense forward of each, and the checks of every piece, made before the first launch.
struct LayerPlan {
    shapes: NsaLayerShapes,
    compressed: AttentionSpec,
    window: AttentionSpec,
    /// The dense forward's kernel and tiling for the compressed branch, then for the window branch.
    forwards: [(KernelSource, ForwardTiling); 2],
}

/// The dense forward kernel and tiling of a branch spec on a device of compute capability `device`: the caller's
/// text in its kernel's tiling, or the production choice.
fn dense_forward(spec: &AttentionSpec, kernels: &NsaLayerKernels, device: (i32, i32)) -> (KernelSource, ForwardTiling) {
    match kernels.dense_forward {
        Some(kernel) => (kernel, ForwardTiling::of_kernel(kernel, spec.head_dim, spec.head_dim_v)),
        None => production_forward(spec, device),
    }
}

/// Every check of the pieces' launches that the first launch would otherwise come before (module docs, "Errors").
fn plan<T: GpuElement>(
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernels: &NsaLayerKernels,
    device: (i32, i32),
) -> Result<LayerPlan, GpuError> {
    let shapes = NsaLayerShapes::new(spec, config)?;
    let compressed = compressed_spec(spec, config)?;
    let window = window_spec(spec, config)?;
    // The selection's own limits (its plan is private to `select`): one lane per list entry, the group in one CTA.
    if config.n_selected > MAX_SELECTED {
        return Err(GpuError::Unsupported {
            argument: "n_selected",
            reason: format!("{} entries per list; the selection writes at most {MAX_SELECTED}", config.n_selected),
        });
    }
    if spec.group_size() > MAX_GROUP {
        return Err(GpuError::Unsupported {
            argument: "n_heads_q / n_heads_kv",
            reason: format!("a GQA group of {}; the NSA kernels hold at most {MAX_GROUP} heads", spec.group_size()),
        });
    }
    // The selected attention's plan (forward and backward share it) and the KV owner's shape of its backward.
    super::selected::plan(spec, config, None)?;
    crate::backward::kv_owner_shape::<T>(spec, super::selected_backward::TILING)?;
    // The dense forwards' plans; the compressed spec's also checks the queries against the compressed keys.
    let forwards = [&compressed, &window].map(|branch| dense_forward(branch, kernels, device));
    for (branch, (kernel, tiling)) in [&compressed, &window].into_iter().zip(forwards) {
        forward_variant::<T>(branch, tiling, kernel)?;
    }
    Ok(LayerPlan { shapes, compressed, window, forwards })
}

/// Checks the inputs' lengths against the layer's shapes.
fn check_inputs<T>(inputs: &NsaLayerInputs<'_, T>, s: &NsaLayerShapes) -> Result<(), GpuError> {
    check_len("q", inputs.q, elements(&s.q))?;
    check_len("k", inputs.k, elements(&s.k))?;
    check_len("v", inputs.v, elements(&s.v))?;
    check_len("gate_logits", inputs.gate_logits, elements(&s.gate_logits))
}

/// The layer's forward on device buffers (module docs): from `inputs` writes every intermediate and the output into
/// `out`. Every check runs before the first launch; the work is asynchronous on `stream`.
pub fn nsa_layer_forward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernels: &NsaLayerKernels,
    inputs: NsaLayerInputs<'_, T>,
    out: &mut NsaLayerForwardDevice<T>,
) -> Result<(), GpuError> {
    let plan = plan::<T>(spec, config, kernels, compile::compute_capability(stream.context())?)?;
    check_inputs(&inputs, &plan.shapes)?;
    out.check(&plan.shapes)?;
    let NsaLayerInputs { q, k, v, gate_logits } = inputs;
    let f = out;
    compress_kv_device(stream, spec, config, kernels.compress, k, v, &mut f.k_cmp, &mut f.v_cmp)?;
    let (compressed, window) = (&plan.compressed, &plan.window);
    let [(cmp_kernel, cmp_tiling), (win_kernel, win_tiling)] = plan.forwards;
    let (k_cmp, v_cmp) = (&f.k_cmp, &f.v_cmp);
    flash_forward_device_with(
        stream,
        compressed,
        cmp_kernel,
        cmp_tiling,
        q,
        k_cmp,
        v_cmp,
        &mut f.o_cmp,
        &mut f.lse_cmp,
    )?;
    select_device(stream, spec, config, kernels.select, q, &f.k_cmp, &f.lse_cmp, &mut f.scores, &mut f.lists)?;
    selected_device(stream, spec, config, kernels.selected, (q, k, v), &f.lists, &mut f.o_slc, &mut f.lse_slc)?;
    flash_forward_device_with(stream, window, win_kernel, win_tiling, q, k, v, &mut f.o_win, &mut f.lse_win)?;
    let branches = GateBranches { compressed: &f.o_cmp, selected: &f.o_slc, window: &f.o_win };
    gate_combine_device(stream, spec, kernels.gates, branches, gate_logits, &mut f.o)
}

/// The inputs of a layer's backward on the device: the forward's inputs, its intermediates and the upstream gradient
/// `dO` (O's layout).
#[derive(Clone, Copy, Debug)]
pub struct NsaLayerBackwardInputs<'a, T> {
    /// Q, K, V and the gate logits, as the forward had them.
    pub layer: NsaLayerInputs<'a, T>,
    /// The forward's intermediates (its lists are the selection the backward holds fixed).
    pub forward: &'a NsaLayerForwardDevice<T>,
    /// `dO`.
    pub d_out: &'a CudaSlice<T>,
}

/// One attention backward's gradients on the device: dQ, dK, dV (storage type) and `D` (f32).
#[derive(Debug)]
pub struct BranchGradientsDevice<T> {
    /// dQ.
    pub dq: CudaSlice<T>,
    /// dK (for the compressed branch: `dk̃`).
    pub dk: CudaSlice<T>,
    /// dV (for the compressed branch: `dṽ`).
    pub dv: CudaSlice<T>,
    /// `D = rowsum(dO_b ∘ o_b)`.
    pub delta: CudaSlice<f32>,
}

impl<T: GpuElement> BranchGradientsDevice<T> {
    fn alloc(stream: &Arc<CudaStream>, [q, k, v, d]: [usize; 4]) -> Result<Self, GpuError> {
        Ok(BranchGradientsDevice {
            dq: zeroed(stream, q)?,
            dk: zeroed(stream, k)?,
            dv: zeroed(stream, v)?,
            delta: zeroed(stream, d)?,
        })
    }

    fn check(&self, prefix: [&'static str; 4], [q, k, v, d]: [usize; 4]) -> Result<(), GpuError> {
        check_len(prefix[0], &self.dq, q)?;
        check_len(prefix[1], &self.dk, k)?;
        check_len(prefix[2], &self.dv, v)?;
        check_len(prefix[3], &self.delta, d)
    }

    fn outputs(&mut self) -> BackwardDeviceOutputs<'_, T> {
        BackwardDeviceOutputs { dq: &mut self.dq, dk: &mut self.dk, dv: &mut self.dv, delta: &mut self.delta }
    }
}

/// The backward's gradients and the intermediates a stage-wise verifier needs, on the device (caller-owned;
/// [`NsaLayerBackwardDevice::alloc`] sizes them).
#[derive(Debug)]
pub struct NsaLayerBackwardDevice<T> {
    /// The layer's dQ: the three branches' summed.
    pub dq: CudaSlice<T>,
    /// The layer's dK: the pooling transpose's, the selected branch's and the window branch's summed.
    pub dk: CudaSlice<T>,
    /// The layer's dV, likewise.
    pub dv: CudaSlice<T>,
    /// The gate logits' gradients (f32).
    pub d_gate_logits: CudaSlice<f32>,
    /// `dO_cmp = σ(x_cmp) dO`.
    pub d_o_cmp: CudaSlice<T>,
    /// `dO_slc`.
    pub d_o_slc: CudaSlice<T>,
    /// `dO_win`.
    pub d_o_win: CudaSlice<T>,
    /// The compressed attention's dQ, `dk̃`, `dṽ` (compressed layout) and `D`.
    pub compressed: BranchGradientsDevice<T>,
    /// The pooling transpose's token dK.
    pub dk_pool: CudaSlice<T>,
    /// The pooling transpose's token dV.
    pub dv_pool: CudaSlice<T>,
    /// The selected branch's dQ, dK, dV and `D`.
    pub selected: BranchGradientsDevice<T>,
    /// The window branch's dQ, dK, dV and `D`.
    pub window: BranchGradientsDevice<T>,
    /// The learned compression matrices' gradients (f32, [`NsaLayerShapes::d_maps`]), keys then values: each summed
    /// over every sequence and KV head by [`super::compress::compress_map_gradient_device`] from the compressed
    /// branch's `dk̃`, `dṽ`; `None` for a map without parameters.
    pub d_maps: [Option<CudaSlice<f32>>; 2],
}

impl<T: GpuElement> NsaLayerBackwardDevice<T> {
    /// Zeroed buffers of [`NsaLayerShapes`]'s sizes for `spec` under `config`.
    pub fn alloc(stream: &Arc<CudaStream>, spec: &AttentionSpec, config: &NsaConfig) -> Result<Self, GpuError> {
        let s = NsaLayerShapes::new(spec, config)?;
        let (q, k, v, o, r) = (elements(&s.q), elements(&s.k), elements(&s.v), elements(&s.o), elements(&s.row_stat));
        Ok(NsaLayerBackwardDevice {
            dq: zeroed(stream, q)?,
            dk: zeroed(stream, k)?,
            dv: zeroed(stream, v)?,
            d_gate_logits: zeroed(stream, elements(&s.gate_logits))?,
            d_o_cmp: zeroed(stream, o)?,
            d_o_slc: zeroed(stream, o)?,
            d_o_win: zeroed(stream, o)?,
            compressed: BranchGradientsDevice::alloc(stream, [q, elements(&s.k_cmp), elements(&s.v_cmp), r])?,
            dk_pool: zeroed(stream, k)?,
            dv_pool: zeroed(stream, v)?,
            selected: BranchGradientsDevice::alloc(stream, [q, k, v, r])?,
            window: BranchGradientsDevice::alloc(stream, [q, k, v, r])?,
            d_maps: [
                s.d_maps[0].map(|m| zeroed(stream, elements(&m))).transpose()?,
                s.d_maps[1].map(|m| zeroed(stream, elements(&m))).transpose()?,
            ],
        })
    }

    fn check(&self, s: &NsaLayerShapes) -> Result<(), GpuError> {
        let (q, k, v, o, r) = (elements(&s.q), elements(&s.k), elements(&s.v), elements(&s.o), elements(&s.row_stat));
        for (name, buffer, n) in [("dq", &self.dq, q), ("dk", &self.dk, k), ("dv", &self.dv, v)] {
            check_len(name, buffer, n)?;
        }
        check_len("d_gate_logits", &self.d_gate_logits, elements(&s.gate_logits))?;
        for (name, buffer) in [("d_o_cmp", &self.d_o_cmp), ("d_o_slc", &self.d_o_slc), ("d_o_win", &self.d_o_win)] {
            check_len(name, buffer, o)?;
        }
        let compressed = [q, elements(&s.k_cmp), elements(&s.v_cmp), r];
        self.compressed.check(["dq_cmp", "dk_cmp", "dv_cmp", "delta_cmp"], compressed)?;
        check_len("dk_pool", &self.dk_pool, k)?;
        check_len("dv_pool", &self.dv_pool, v)?;
        self.selected.check(["dq_slc", "dk_slc", "dv_slc", "delta_slc"], [q, k, v, r])?;
        self.window.check(["dq_win", "dk_win", "dv_win", "delta_win"], [q, k, v, r])?;
        for (name, shape, buffer) in
            [("d_map_keys", s.d_maps[0], &self.d_maps[0]), ("d_map_values", s.d_maps[1], &self.d_maps[1])]
        {
            match (shape, buffer) {
                (Some(shape), Some(buffer)) => check_len(name, buffer, elements(&shape))?,
                (Some(shape), None) => {
                    return Err(GpuError::BufferTooSmall { argument: name, needed: elements(&shape), actual: 0 });
                }
                (None, _) => {}
            }
        }
        Ok(())
    }

    /// The backward's tensors, host side (copies out and synchronizes `stream`).
    pub fn download(
        &self,
        stream: &Arc<CudaStream>,
        spec: &AttentionSpec,
        config: &NsaConfig,
    ) -> Result<NsaLayerBackward<T>, GpuError> {
        let s = NsaLayerShapes::new(spec, config)?;
        self.check(&s)?;
        let branch = |g: &BranchGradientsDevice<T>, [k, v]: [&[usize]; 2]| -> Result<BranchGradients<T>, GpuError> {
            Ok(BranchGradients {
                dq: download(stream, &g.dq, &s.q)?,
                dk: download(stream, &g.dk, k)?,
                dv: download(stream, &g.dv, v)?,
                delta: download(stream, &g.delta, &s.row_stat)?,
            })
        };
        let map_gradient = |i: usize| match (s.d_maps[i], &self.d_maps[i]) {
            (Some(shape), Some(buffer)) => download(stream, buffer, &shape).map(|a| Some(rank2(a))),
            _ => Ok(None),
        };
        let out = NsaLayerBackward {
            dq: download(stream, &self.dq, &s.q)?,
            dk: download(stream, &self.dk, &s.k)?,
            dv: download(stream, &self.dv, &s.v)?,
            d_gate_logits: download(stream, &self.d_gate_logits, &s.gate_logits)?,
            d_o_cmp: download(stream, &self.d_o_cmp, &s.o)?,
            d_o_slc: download(stream, &self.d_o_slc, &s.o)?,
            d_o_win: download(stream, &self.d_o_win, &s.o)?,
            compressed: branch(&self.compressed, [&s.k_cmp, &s.v_cmp])?,
            dk_pool: download(stream, &self.dk_pool, &s.k)?,
            dv_pool: download(stream, &self.dv_pool, &s.v)?,
            selected: branch(&self.selected, [&s.k, &s.v])?,
            window: branch(&self.window, [&s.k, &s.v])?,
            d_maps: [map_gradient(0)?, map_gradient(1)?],
        };
        stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
        Ok(out)
    }
}

/// Rejects the dQ strategies the layer does not run: two traversals (the selected branch has a KV owner only).
fn check_strategy(strategy: GpuBackwardStrategy) -> Result<(), GpuError> {
    match strategy {
        GpuBackwardStrategy::KvOwnerAtomic | GpuBackwardStrategy::KvOwnerDeterministic => Ok(()),
        GpuBackwardStrategy::TwoTraversals => Err(GpuError::Unsupported {
            argument: "strategy",
            reason: "NSA's layer backward runs the KV-owner strategies (atomic or deterministic dQ): its selected \
                     branch has no dQ owner"
                .to_owned(),
        }),
    }
}

/// The dense backward kernel of a branch spec: the caller's, or the production one for the device.
fn dense_backward_kernel(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    kernels: &NsaLayerKernels,
) -> Result<KernelSource, GpuError> {
    match kernels.dense_backward {
        Some(kernel) => Ok(kernel),
        None => {
            let device = compile::compute_capability(stream.context())?;
            Ok(production_backward_kernel(spec, BackwardTiling::DEFAULT, device))
        }
    }
}

/// The layer's backward on device buffers with the forward's selection held fixed (module docs): from `inputs`
/// writes the layer's dQ, dK, dV, the gate logits' gradients and every branch's intermediates into `out`, with the dQ
/// strategy `strategy` in every attention backward. Every check runs before the first launch; the work is
/// asynchronous on `stream`.
pub fn nsa_layer_backward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernels: &NsaLayerKernels,
    inputs: NsaLayerBackwardInputs<'_, T>,
    strategy: GpuBackwardStrategy,
    out: &mut NsaLayerBackwardDevice<T>,
) -> Result<(), GpuError> {
    check_strategy(strategy)?;
    let plan = plan::<T>(spec, config, kernels, compile::compute_capability(stream.context())?)?;
    let s = &plan.shapes;
    let NsaLayerBackwardInputs { layer, forward: f, d_out } = inputs;
    check_inputs(&layer, s)?;
    f.check(s)?;
    check_len("d_out", d_out, elements(&s.o))?;
    out.check(s)?;
    let (compressed_kernel, window_kernel) = (
        dense_backward_kernel(stream, &plan.compressed, kernels)?,
        dense_backward_kernel(stream, &plan.window, kernels)?,
    );
    backward_variant::<T>(&plan.compressed, BackwardTiling::DEFAULT, compressed_kernel)?;
    backward_variant::<T>(&plan.window, BackwardTiling::DEFAULT, window_kernel)?;
    let NsaLayerInputs { q, k, v, gate_logits } = layer;
    let g = out;

    let branches = GateBranches { compressed: &f.o_cmp, selected: &f.o_slc, window: &f.o_win };
    let gate_grads = GateGradientsDevice {
        d_compressed: &mut g.d_o_cmp,
        d_selected: &mut g.d_o_slc,
        d_window: &mut g.d_o_win,
        d_gate_logits: &mut g.d_gate_logits,
    };
    gate_backward_device(stream, spec, kernels.gates, branches, gate_logits, d_out, gate_grads)?;

    let cmp_inputs =
        BackwardDeviceInputs { q, k: &f.k_cmp, v: &f.v_cmp, o: &f.o_cmp, lse: &f.lse_cmp, d_out: &g.d_o_cmp };
    let tiling = BackwardTiling::DEFAULT;
    let cmp_outputs = g.compressed.outputs();
    flash_backward_device_with(stream, &plan.compressed, compressed_kernel, tiling, cmp_inputs, cmp_outputs, strategy)?;
    let (dk_cmp, dv_cmp) = (&g.compressed.dk, &g.compressed.dv);
    compress_kv_backward_device(
        stream,
        spec,
        config,
        kernels.compress,
        dk_cmp,
        dv_cmp,
        &mut g.dk_pool,
        &mut g.dv_pool,
    )?;
    // The learned matrices' own gradients, from the same dk̃, dṽ.
    let [d_map_keys, d_map_values] = &mut g.d_maps;
    for (d_map, operand, x, d_cmp) in
        [(d_map_keys, Operand::K, k, &g.compressed.dk), (d_map_values, Operand::V, v, &g.compressed.dv)]
    {
        if let Some(d_map) = d_map {
            compress_map_gradient_device(stream, spec, config, kernels.compress, operand, x, d_cmp, d_map)?;
        }
    }

    let slc_inputs = BackwardDeviceInputs { q, k, v, o: &f.o_slc, lse: &f.lse_slc, d_out: &g.d_o_slc };
    let slc_outputs = g.selected.outputs();
    let selected_kernel = kernels.selected_backward;
    selected_backward_device(stream, spec, config, selected_kernel, slc_inputs, &f.lists, slc_outputs, strategy)?;

    let win_inputs = BackwardDeviceInputs { q, k, v, o: &f.o_win, lse: &f.lse_win, d_out: &g.d_o_win };
    let win_outputs = g.window.outputs();
    flash_backward_device_with(stream, &plan.window, window_kernel, tiling, win_inputs, win_outputs, strategy)?;

    let sums = [
        ([&g.compressed.dq, &g.selected.dq, &g.window.dq], &mut g.dq, elements(&s.q)),
        ([&g.dk_pool, &g.selected.dk, &g.window.dk], &mut g.dk, elements(&s.k)),
        ([&g.dv_pool, &g.selected.dv, &g.window.dv], &mut g.dv, elements(&s.v)),
    ];
    for (terms, sum, n) in sums {
        branch_sum_device(stream, kernels.gates, terms, sum, n)?;
    }
    Ok(())
}

/// Threads per CTA of `nsa_branch_sum` (the kernel's `BRANCH_SUM_THREADS`).
const BRANCH_SUM_THREADS: usize = 256;

/// CTAs of one branch-sum launch at most: the kernel's grid-stride loop covers any length, and 4096 CTAs of 256
/// threads fill an H200 many times over.
const BRANCH_SUM_MAX_CTAS: usize = 4096;

/// `out = fl_T(fl32(fl32(cmp + slc) + win))` elementwise over the first `n` elements (`nsa_branch_sum` of the gates'
/// module `kernel`), asynchronously on `stream`; buffer lengths are checked before the launch.
pub fn branch_sum_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    [cmp, slc, win]: [&CudaSlice<T>; 3],
    out: &mut CudaSlice<T>,
    n: usize,
) -> Result<(), GpuError> {
    for (name, buffer) in [("cmp", cmp), ("slc", slc), ("win", win)] {
        check_len(name, buffer, n)?;
    }
    check_len("sum", out, n)?;
    let n64 = i64::try_from(n).map_err(|_| GpuError::TooLarge { argument: "gradient elements", value: n })?;
    if n == 0 {
        return Ok(());
    }
    let ctas = grid_dim("branch sum CTAs", n.div_ceil(BRANCH_SUM_THREADS).min(BRANCH_SUM_MAX_CTAS), i32::MAX as usize)?;
    let module = compile::module(stream.context(), kernel, &[T::DEFINE.to_owned()])?;
    let func = module
        .load_function("nsa_branch_sum")
        .map_err(|e| GpuError::driver("cuModuleGetFunction(nsa_branch_sum)", e))?;
    let cfg =
        LaunchConfig { grid_dim: (ctas, 1, 1), block_dim: (BRANCH_SUM_THREADS as u32, 1, 1), shared_mem_bytes: 0 };
    launch::launch_nsa_branch_sum(stream, &func, cfg, [cmp, slc, win], out, n64)
}

/// The forward's tensors, host side, each in its piece's layout (module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct NsaLayerForward<T> {
    /// `k̃`.
    pub k_cmp: ArrayD<T>,
    /// `ṽ`.
    pub v_cmp: ArrayD<T>,
    /// The compressed branch's output.
    pub o_cmp: ArrayD<T>,
    /// Its LSE.
    pub lse_cmp: ArrayD<f32>,
    /// The block scores `[token rows, Hkv, M]`.
    pub scores: Array3<f32>,
    /// The lists `[token rows, Hkv, n]`.
    pub lists: Array3<i32>,
    /// The selected branch's output.
    pub o_slc: ArrayD<T>,
    /// Its LSE.
    pub lse_slc: ArrayD<f32>,
    /// The window branch's output.
    pub o_win: ArrayD<T>,
    /// Its LSE.
    pub lse_win: ArrayD<f32>,
    /// The layer's output.
    pub o: ArrayD<T>,
}

/// One attention backward's gradients, host side.
#[derive(Clone, Debug, PartialEq)]
pub struct BranchGradients<T> {
    /// dQ.
    pub dq: ArrayD<T>,
    /// dK (for the compressed branch: `dk̃`, compressed layout).
    pub dk: ArrayD<T>,
    /// dV (for the compressed branch: `dṽ`).
    pub dv: ArrayD<T>,
    /// `D` (f32), LSE's layout.
    pub delta: ArrayD<f32>,
}

/// The backward's tensors, host side (the fields of [`NsaLayerBackwardDevice`]).
#[derive(Clone, Debug, PartialEq)]
pub struct NsaLayerBackward<T> {
    /// The layer's dQ.
    pub dq: ArrayD<T>,
    /// The layer's dK.
    pub dk: ArrayD<T>,
    /// The layer's dV.
    pub dv: ArrayD<T>,
    /// The gate logits' gradients (f32).
    pub d_gate_logits: ArrayD<f32>,
    /// `dO_cmp`.
    pub d_o_cmp: ArrayD<T>,
    /// `dO_slc`.
    pub d_o_slc: ArrayD<T>,
    /// `dO_win`.
    pub d_o_win: ArrayD<T>,
    /// The compressed attention's gradients.
    pub compressed: BranchGradients<T>,
    /// The pooling transpose's token dK.
    pub dk_pool: ArrayD<T>,
    /// The pooling transpose's token dV.
    pub dv_pool: ArrayD<T>,
    /// The selected branch's gradients.
    pub selected: BranchGradients<T>,
    /// The window branch's gradients.
    pub window: BranchGradients<T>,
    /// The learned compression matrices' gradients, keys then values (`None` for a map that is not a matrix).
    pub d_maps: [Option<Array2<f32>>; 2],
}

/// The layer's host inputs: Q, K, V in the spec's layouts and the gate logits in [`gate_logits_shape`].
#[derive(Clone, Debug)]
pub struct NsaLayerHostInputs<'a, T> {
    /// Queries.
    pub q: ArrayViewD<'a, T>,
    /// Keys.
    pub k: ArrayViewD<'a, T>,
    /// Values.
    pub v: ArrayViewD<'a, T>,
    /// Gate logits.
    pub gate_logits: ArrayViewD<'a, T>,
}

/// The uploaded inputs of a host call.
struct DeviceInputs<T> {
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    gate_logits: CudaSlice<T>,
}

impl<T> DeviceInputs<T> {
    fn view(&self) -> NsaLayerInputs<'_, T> {
        NsaLayerInputs { q: &self.q, k: &self.k, v: &self.v, gate_logits: &self.gate_logits }
    }
}

/// Checks (shapes, layouts, finite values) and uploads the host inputs.
fn upload_inputs<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    inputs: &NsaLayerHostInputs<'_, T>,
) -> Result<DeviceInputs<T>, GpuError> {
    let q = host_input(spec, "q", Operand::Q, &inputs.q)?;
    let k = host_input(spec, "k", Operand::K, &inputs.k)?;
    let v = host_input(spec, "v", Operand::V, &inputs.v)?;
    let shape = gate_logits_shape(spec);
    let logits = &inputs.gate_logits;
    if logits.shape() != shape.as_slice() {
        return Err(GpuError::Shape { argument: "gate_logits", expected: shape, actual: logits.shape().to_vec() });
    }
    let x = logits
        .as_slice()
        .ok_or_else(|| GpuError::Stride { argument: "gate_logits", strides: logits.strides().to_vec() })?;
    if let Some(i) = x.iter().position(|x| !x.is_finite_value()) {
        let index =
            ndarray::indices(shape.as_slice()).into_iter().nth(i).map(|ix| ndarray::Dimension::slice(&ix).to_vec());
        let index = index.unwrap_or_default();
        return Err(attnproof_oracle::OracleError::NonFinite { argument: "gate_logits", index, value: f64::NAN }.into());
    }
    let up = |data: &[T]| {
        if data.is_empty() { stream.alloc_zeros::<T>(1) } else { stream.clone_htod(data) }
            .map_err(|e| GpuError::driver("cuMemcpyHtoD", e))
    };
    Ok(DeviceInputs { q: up(q)?, k: up(k)?, v: up(v)?, gate_logits: up(x)? })
}

/// The layer's forward from host tensors (checks, copies in, launches, copies out, synchronizes).
pub fn nsa_layer_forward<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernels: &NsaLayerKernels,
    inputs: &NsaLayerHostInputs<'_, T>,
) -> Result<NsaLayerForward<T>, GpuError> {
    plan::<T>(spec, config, kernels, compile::compute_capability(stream.context())?)?;
    let device = upload_inputs(stream, spec, inputs)?;
    let mut out = NsaLayerForwardDevice::alloc(stream, spec, config)?;
    nsa_layer_forward_device(stream, spec, config, kernels, device.view(), &mut out)?;
    out.download(stream, spec, config)
}

/// The layer's backward from host tensors with the selection of `forward` held fixed (checks, copies in, launches,
/// copies out, synchronizes); `forward` is the layer's forward on `inputs` ([`nsa_layer_forward`]), `d_out` in O's
/// shape.
#[allow(clippy::too_many_arguments)]
pub fn nsa_layer_backward<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernels: &NsaLayerKernels,
    inputs: &NsaLayerHostInputs<'_, T>,
    forward: &NsaLayerForward<T>,
    d_out: ArrayViewD<'_, T>,
    strategy: GpuBackwardStrategy,
) -> Result<NsaLayerBackward<T>, GpuError> {
    check_strategy(strategy)?;
    plan::<T>(spec, config, kernels, compile::compute_capability(stream.context())?)?;
    let device = upload_inputs(stream, spec, inputs)?;
    let forward = NsaLayerForwardDevice::upload(stream, spec, config, forward)?;
    let d_out = host_input(spec, "d_out", Operand::O, &d_out)?;
    let d_out = if d_out.is_empty() { stream.alloc_zeros::<T>(1) } else { stream.clone_htod(d_out) }
        .map_err(|e| GpuError::driver("cuMemcpyHtoD", e))?;
    let mut out = NsaLayerBackwardDevice::alloc(stream, spec, config)?;
    let backward_inputs = NsaLayerBackwardInputs { layer: device.view(), forward: &forward, d_out: &d_out };
    nsa_layer_backward_device(stream, spec, config, kernels, backward_inputs, strategy, &mut out)?;
    out.download(stream, spec, config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::{Layout, Mask};

    fn layer(hq: usize, hkv: usize, len: usize, d: usize, dv: usize) -> AttentionSpec {
        AttentionSpec::dense(1, hq, hkv, len, len, d, dv).with_mask(Mask::Causal)
    }

    fn small() -> NsaConfig {
        NsaConfig {
            compress_len: 8,
            compress_stride: 4,
            select_block: 16,
            n_selected: 4,
            n_forced_initial: 1,
            n_forced_local: 1,
            window: 32,
            ..NsaConfig::default()
        }
    }

    /// The shapes follow each piece's layout, dense and varlen (a sequence with no window and an empty one).
    #[test]
    fn the_shapes_are_each_pieces() {
        let s = NsaLayerShapes::new(&layer(6, 2, 100, 64, 32), &small()).unwrap();
        assert_eq!(
            (s.q.clone(), s.k.clone(), s.v.clone()),
            (vec![1, 6, 100, 64], vec![1, 2, 100, 64], vec![1, 2, 100, 32])
        );
        assert_eq!(
            (s.o.clone(), s.row_stat.clone(), s.gate_logits.clone()),
            (vec![1, 6, 100, 32], vec![1, 6, 100], vec![1, 6, 100, 3])
        );
        // ⌊(100 − 8)/4⌋ + 1 = 24 windows; ⌈100/16⌉ = 7 blocks.
        assert_eq!((s.k_cmp.clone(), s.v_cmp.clone()), (vec![1, 2, 24, 64], vec![1, 2, 24, 32]));
        assert_eq!((s.scores, s.lists), ([100, 2, 7], [100, 2, 4]));
        let cu = vec![0, 5, 5, 45];
        let varlen = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu },
            ..layer(3, 1, 1, 16, 16)
        };
        let s = NsaLayerShapes::new(&varlen, &small()).unwrap();
        // 5 tokens: no window; 40 tokens: 9 windows; the longest sequence has 3 blocks.
        assert_eq!((s.k_cmp, s.scores, s.lists, s.row_stat), (vec![9, 1, 16], [45, 1, 3], [45, 1, 4], vec![3, 45]));
    }

    /// What the layer does not run is a typed error from the checks that precede every launch (no device is needed
    /// to reach them): a mask that is not causal, queries and keys of different lengths, a window of 0, a list wider
    /// than a warp, a group above 64, blocks that split into a full and a short tile, a head dim off the multiples of
    /// 8, and two traversals for dQ.
    #[test]
    fn unsupported_layers_are_typed_errors_before_any_launch() {
        let kernels = NsaLayerKernels::default();
        let check = |spec: &AttentionSpec, config: &NsaConfig| {
            plan::<half::bf16>(spec, config, &kernels, (9, 0))?;
            plan::<half::bf16>(spec, config, &kernels, (8, 0)).map(|_| ())
        };
        check(&layer(4, 2, 100, 64, 64), &small()).unwrap();
        let unsupported = |r: Result<(), GpuError>| match r {
            Err(GpuError::Unsupported { argument, .. }) => argument,
            other => panic!("not an Unsupported error: {other:?}"),
        };
        let open = layer(4, 2, 100, 64, 64).with_mask(Mask::None);
        assert_eq!(unsupported(check(&open, &small())), "mask");
        let cross = AttentionSpec::dense(1, 4, 2, 100, 101, 64, 64).with_mask(Mask::Causal);
        assert_eq!(unsupported(check(&cross, &small())), "layout");
        assert_eq!(unsupported(check(&layer(4, 2, 100, 64, 64), &NsaConfig { window: 0, ..small() })), "window");
        assert_eq!(
            unsupported(check(&layer(4, 2, 100, 64, 64), &NsaConfig { n_selected: 33, ..small() })),
            "n_selected"
        );
        assert_eq!(unsupported(check(&layer(65, 1, 100, 64, 64), &small())), "n_heads_q / n_heads_kv");
        assert_eq!(
            unsupported(check(&layer(4, 2, 100, 64, 64), &NsaConfig { select_block: 96, ..small() })),
            "select_block"
        );
        assert_eq!(unsupported(check(&layer(4, 2, 100, 60, 64), &small())), "head_dim");
        assert!(matches!(
            check(&layer(4, 2, 100, 64, 64), &NsaConfig { n_selected: 1, ..small() }),
            Err(GpuError::Spec(_))
        ));
        assert_eq!(unsupported(check_strategy(GpuBackwardStrategy::TwoTraversals)), "strategy");
        check_strategy(GpuBackwardStrategy::KvOwnerAtomic).unwrap();
        check_strategy(GpuBackwardStrategy::KvOwnerDeterministic).unwrap();
    }

    #[test]
    fn the_default_kernels_are_the_embedded_texts() {
        let k = NsaLayerKernels::default();
        assert_eq!((k.compress, k.select, k.selected, k.gates), (NSA_COMPRESS, NSA_SELECT, NSA_SELECTED, NSA_GATES));
        assert_eq!((k.dense_forward, k.dense_backward, k.selected_backward), (None, None, NSA_SELECTED_BWD));
        assert!(NSA_GATES.source.contains("nsa_branch_sum"));
    }

    /// Both dense branches run the production forward for the device (the sm_90a kernel on 9.0 from 64 columns,
    /// `flash_fwd` elsewhere and below), and a caller's text in its own kernel's tiling.
    #[test]
    fn the_dense_branches_run_the_production_forward_or_the_callers() {
        use crate::compile::{FLASH_FWD, FLASH_FWD_SM90};
        let kernels = NsaLayerKernels::default();
        let forwards = |spec: &AttentionSpec, kernels: &NsaLayerKernels, device| {
            plan::<half::bf16>(spec, &small(), kernels, device).unwrap().forwards.map(|(kernel, _)| kernel)
        };
        let wide = layer(4, 2, 100, 128, 64);
        assert_eq!(forwards(&wide, &kernels, (9, 0)), [FLASH_FWD_SM90; 2]);
        assert_eq!(forwards(&wide, &kernels, (8, 0)), [FLASH_FWD; 2]);
        assert_eq!(forwards(&layer(4, 2, 100, 32, 64), &kernels, (9, 0)), [FLASH_FWD; 2]);
        let mma_sync = NsaLayerKernels { dense_forward: Some(FLASH_FWD), ..kernels };
        let chosen = plan::<half::bf16>(&wide, &small(), &mma_sync, (9, 0)).unwrap();
        assert_eq!(chosen.forwards, [(FLASH_FWD, ForwardTiling::for_head_dims(128, 64)); 2]);
        let wgmma = NsaLayerKernels { dense_forward: Some(FLASH_FWD_SM90), ..kernels };
        let chosen = plan::<half::bf16>(&wide, &small(), &wgmma, (8, 0)).unwrap();
        assert_eq!(chosen.forwards, [(FLASH_FWD_SM90, ForwardTiling::WGMMA); 2]);
    }
}
