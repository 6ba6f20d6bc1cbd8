//! What the GPU test binaries share: the kernels' recipes, guarded launches of the forward and backward (NaN-poisoned
//! outputs followed by sentinel guard bands, device inputs checked unchanged afterwards), and the case builders.
//!
//! Each test binary compiles this module on its own and uses part of it.
#![allow(dead_code)]

use std::sync::Arc;

use attnproof_gpu::backward::{BACKWARD_SHIFT_ROUNDING, BackwardTiling, EXP_UNDERFLOW, flash_backward_device_with};
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::flash::{
    EXP_RELATIVE_ERROR, EXP_UNDERFLOW as FORWARD_EXP_UNDERFLOW, ForwardTiling, KV_TILE, SHIFT_ROUNDING,
    flash_forward_device_with,
};
use attnproof_gpu::{BackwardDeviceInputs, BackwardDeviceOutputs, GpuBackwardStrategy, GpuElement, flash_forward};
use attnproof_harness::Case;
use attnproof_harness::flash::recipe;
use attnproof_harness::generate::{Distribution, ValueProfile, make_case, make_d_out};
use attnproof_harness::strategies::spec;
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Layout, Mask};
use attnproof_proofs::flash_bound::{Accumulation, FlashRecipe, ScoreReuse};
use attnproof_reference::Element;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};
use ndarray::{ArrayD, IxDyn};
use proptest::strategy::Strategy;

/// Elements of sentinel past each output.
pub const GUARD: usize = 256;
/// Bit patterns of the guard bands: NaN payloads no arithmetic produces.
pub const GUARD_BITS_16: u16 = 0x7fa5;
/// The f32 guard pattern (LSE, D).
pub const GUARD_BITS_32: u32 = 0x7fc0_a5a5;

/// A storage type both the kernels and the verifier know.
pub trait Storage: GpuElement + Element {
    /// The value's bits.
    fn bits(self) -> u16;
    /// The value with these bits.
    fn from_bits16(bits: u16) -> Self;
}

impl Storage for bf16 {
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits16(bits: u16) -> Self {
        bf16::from_bits(bits)
    }
}

impl Storage for f16 {
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits16(bits: u16) -> Self {
        f16::from_bits(bits)
    }
}

/// The forward kernel's recipe for `T`: the reference's storage type and tiling, with `ex2.approx`'s exp error, the
/// shift rounding of `fl(m·log2 e)` and the flush-to-zero `ex2`'s underflow (all justified in `attnproof_gpu::flash`).
pub fn forward_recipe<T: Element>() -> FlashRecipe {
    FlashRecipe {
        exp_error: EXP_RELATIVE_ERROR,
        shift_rounding: SHIFT_ROUNDING,
        exp_underflow: FORWARD_EXP_UNDERFLOW,
        // m16n8k16 MMAs: 16 products per instruction, aligned and truncated before the add.
        accumulation: Accumulation::TensorCore { k_step: 16 },
        ..recipe::<T>(KV_TILE)
    }
}

/// The backward kernels' recipe for `T` in the default tiling (each parameter justified in `attnproof_gpu::backward`).
pub fn backward_recipe<T: Element>() -> FlashRecipe {
    backward_recipe_for::<T>(BackwardTiling::DEFAULT)
}

/// The backward kernels' recipe for `T` in `tiling` (its KV tile is the size of the dQ partials).
pub fn backward_recipe_for<T: Element>(tiling: BackwardTiling) -> FlashRecipe {
    FlashRecipe {
        exp_error: attnproof_gpu::backward::EXP_RELATIVE_ERROR,
        shift_rounding: BACKWARD_SHIFT_ROUNDING,
        exp_underflow: EXP_UNDERFLOW,
        accumulation: Accumulation::TensorCore { k_step: 16 },
        // The backward forms Sᵀ = K Qᵀ with transposed MMAs: no bitwise reuse of the forward's scores.
        score_reuse: ScoreReuse::Recomputed,
        ..recipe::<T>(tiling.kv_tile())
    }
}

/// A host tensor on the device; an empty one gets a one-element buffer (cudarc cannot allocate 0 elements, and the
/// kernels read nothing of an empty tensor).
pub fn upload<X: DeviceRepr + ValidAsZeroBits + Copy>(
    stream: &Arc<CudaStream>,
    t: &ArrayD<X>,
) -> Result<CudaSlice<X>, String> {
    let data = t.as_slice().ok_or("input not in standard layout")?;
    if data.is_empty() {
        return stream.alloc_zeros::<X>(1).map_err(|e| e.to_string());
    }
    stream.clone_htod(data).map_err(|e| e.to_string())
}

/// An output buffer: `n` NaNs then the guard band.
pub fn poisoned<X: DeviceRepr + Copy>(
    stream: &Arc<CudaStream>,
    n: usize,
    nan: X,
    guard: X,
) -> Result<CudaSlice<X>, String> {
    let mut init = vec![nan; n];
    init.extend(std::iter::repeat_n(guard, GUARD));
    stream.clone_htod(&init).map_err(|e| e.to_string())
}

/// Splits a downloaded output at its length, checking the guard band after it.
pub fn unguard<X: Copy>(
    name: &str,
    back: Vec<X>,
    n: usize,
    shape: &[usize],
    intact: impl Fn(X) -> bool,
) -> Result<ArrayD<X>, String> {
    if let Some(i) = back[n..].iter().position(|&x| !intact(x)) {
        return Err(format!("{name} guard band element {i} past the output was overwritten"));
    }
    ArrayD::from_shape_vec(IxDyn(shape), back[..n].to_vec()).map_err(|e| e.to_string())
}

/// Fails unless every downloaded input equals its original bit for bit.
fn unchanged<T: Storage>(originals: &[(&str, &ArrayD<T>)], back: &[Vec<T>]) -> Result<(), String> {
    for ((name, original), back) in originals.iter().zip(back) {
        if !original.iter().zip(back.iter()).all(|(a, b)| a.bits() == b.bits()) {
            return Err(format!("device input `{name}` changed during the launch"));
        }
    }
    Ok(())
}

/// One forward launch of `kernel` with `tiling`, NaN-poisoned and guarded; checks the guards and that the device
/// inputs are unchanged. Returns `O` and `LSE`.
pub fn run_forward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    kernel: KernelSource,
    tiling: ForwardTiling,
) -> Result<(ArrayD<T>, ArrayD<f32>), String> {
    let spec = &case.spec;
    let (q, k, v) = (upload(stream, &case.q)?, upload(stream, &case.k)?, upload(stream, &case.v)?);
    let shape = |op: Operand| spec.expected_shape(op);
    let n = |op: Operand| shape(op).iter().product::<usize>();
    let nan = <T as Element>::from_f32(f32::NAN);
    let mut o = poisoned(stream, n(Operand::O), nan, T::from_bits16(GUARD_BITS_16))?;
    let mut lse = poisoned(stream, n(Operand::RowStat), f32::NAN, f32::from_bits(GUARD_BITS_32))?;
    flash_forward_device_with(stream, spec, kernel, tiling, &q, &k, &v, &mut o, &mut lse).map_err(|e| e.to_string())?;
    let down = |b: &CudaSlice<T>| stream.clone_dtoh(b).map_err(|e| e.to_string());
    let o_back = down(&o)?;
    let lse_back = stream.clone_dtoh(&lse).map_err(|e| e.to_string())?;
    let inputs_back = [down(&q)?, down(&k)?, down(&v)?];
    stream.synchronize().map_err(|e| e.to_string())?;
    unchanged(&[("q", &case.q), ("k", &case.k), ("v", &case.v)], &inputs_back)?;
    Ok((
        unguard("O", o_back, n(Operand::O), &shape(Operand::O), |x: T| x.bits() == GUARD_BITS_16)?,
        unguard("LSE", lse_back, n(Operand::RowStat), &shape(Operand::RowStat), |x: f32| x.to_bits() == GUARD_BITS_32)?,
    ))
}

/// Gradients of one backward run.
pub struct Grads<T> {
    /// dQ.
    pub dq: ArrayD<T>,
    /// dK.
    pub dk: ArrayD<T>,
    /// dV.
    pub dv: ArrayD<T>,
    /// `D = rowsum(dO ∘ O)`.
    pub delta: ArrayD<f32>,
}

impl<T: Storage> Grads<T> {
    fn bits(t: &ArrayD<T>) -> Vec<u16> {
        t.iter().map(|x| x.bits()).collect()
    }
    /// dK, dV and D bitwise equal.
    pub fn same_dk_dv_delta(&self, other: &Self) -> bool {
        Self::bits(&self.dk) == Self::bits(&other.dk)
            && Self::bits(&self.dv) == Self::bits(&other.dv)
            && self.delta.iter().map(|x| x.to_bits()).eq(other.delta.iter().map(|x| x.to_bits()))
    }
    /// Every gradient bitwise equal.
    pub fn same(&self, other: &Self) -> bool {
        self.same_dk_dv_delta(other) && Self::bits(&self.dq) == Self::bits(&other.dq)
    }
}

/// A backward case: inputs, upstream gradient and the (unpatched) GPU forward's outputs.
pub struct Problem<T> {
    /// Inputs.
    pub case: Case<T>,
    /// Upstream gradient.
    pub d_out: ArrayD<T>,
    /// The forward's output.
    pub o: ArrayD<T>,
    /// The forward's LSE.
    pub lse: ArrayD<f32>,
}

/// Draws the case and its upstream gradient and runs the production GPU forward for `O` and `LSE`.
pub fn problem<T: Storage>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    profile: ValueProfile,
    seed: u64,
) -> Problem<T> {
    let case = make_case::<T>(spec, profile, seed);
    let d_out = make_d_out::<T>(spec, seed);
    let fwd = flash_forward(stream, spec, case.q.view(), case.k.view(), case.v.view())
        .unwrap_or_else(|e| panic!("GPU forward of {spec:?}: {e}"));
    Problem { case, d_out, o: fwd.o, lse: fwd.lse }
}

/// One backward of `kernel` with `strategy` in the default tiling, NaN-poisoned and guarded; checks the guards and
/// that no device input changed.
pub fn run_backward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    p: &Problem<T>,
    kernel: KernelSource,
    strategy: GpuBackwardStrategy,
) -> Result<Grads<T>, String> {
    run_backward_guarded_tiled(stream, p, kernel, BackwardTiling::DEFAULT, strategy)
}

/// [`run_backward_guarded`] in `tiling`.
pub fn run_backward_guarded_tiled<T: Storage>(
    stream: &Arc<CudaStream>,
    p: &Problem<T>,
    kernel: KernelSource,
    tiling: BackwardTiling,
    strategy: GpuBackwardStrategy,
) -> Result<Grads<T>, String> {
    let spec = &p.case.spec;
    let (q, k, v) = (upload(stream, &p.case.q)?, upload(stream, &p.case.k)?, upload(stream, &p.case.v)?);
    let (o, lse, d_out) = (upload(stream, &p.o)?, upload(stream, &p.lse)?, upload(stream, &p.d_out)?);
    let shape = |op: Operand| spec.expected_shape(op);
    let n = |op: Operand| shape(op).iter().product::<usize>();
    let nan = <T as Element>::from_f32(f32::NAN);
    let guard = T::from_bits16(GUARD_BITS_16);
    let mut dq = poisoned(stream, n(Operand::Q), nan, guard)?;
    let mut dk = poisoned(stream, n(Operand::K), nan, guard)?;
    let mut dv = poisoned(stream, n(Operand::V), nan, guard)?;
    let mut delta = poisoned(stream, n(Operand::RowStat), f32::NAN, f32::from_bits(GUARD_BITS_32))?;
    flash_backward_device_with(
        stream,
        spec,
        kernel,
        tiling,
        BackwardDeviceInputs { q: &q, k: &k, v: &v, o: &o, lse: &lse, d_out: &d_out },
        BackwardDeviceOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv, delta: &mut delta },
        strategy,
    )
    .map_err(|e| e.to_string())?;
    let down = |b: &CudaSlice<T>| stream.clone_dtoh(b).map_err(|e| e.to_string());
    let (dq_b, dk_b, dv_b) = (down(&dq)?, down(&dk)?, down(&dv)?);
    let delta_b = stream.clone_dtoh(&delta).map_err(|e| e.to_string())?;
    let inputs_back = [down(&q)?, down(&k)?, down(&v)?, down(&o)?, down(&d_out)?];
    let lse_back = stream.clone_dtoh(&lse).map_err(|e| e.to_string())?;
    stream.synchronize().map_err(|e| e.to_string())?;
    let originals = [("q", &p.case.q), ("k", &p.case.k), ("v", &p.case.v), ("o", &p.o), ("d_out", &p.d_out)];
    unchanged(&originals, &inputs_back)?;
    if !p.lse.iter().zip(&lse_back).all(|(a, b)| a.to_bits() == b.to_bits()) {
        return Err("device input `lse` changed during the backward".into());
    }
    let g16 = |x: T| x.bits() == GUARD_BITS_16;
    Ok(Grads {
        dq: unguard("dQ", dq_b, n(Operand::Q), &shape(Operand::Q), g16)?,
        dk: unguard("dK", dk_b, n(Operand::K), &shape(Operand::K), g16)?,
        dv: unguard("dV", dv_b, n(Operand::V), &shape(Operand::V), g16)?,
        delta: unguard("D", delta_b, n(Operand::RowStat), &shape(Operand::RowStat), |x: f32| {
            x.to_bits() == GUARD_BITS_32
        })?,
    })
}

/// The harness's shapes (lengths around the kernels' 64-row tiles), head dims rounded up to the supported multiples
/// of 8 (the strategy's awkward 1, 59 and 111 included).
pub fn kernel_spec() -> impl Strategy<Value = AttentionSpec> {
    spec(KV_TILE).prop_map(|mut s| {
        s.head_dim = s.head_dim.div_ceil(8) * 8;
        s.head_dim_v = s.head_dim_v.div_ceil(8) * 8;
        s
    })
}

/// Gaussian inputs at a logit scale.
pub fn gaussian(logit_scale: f64) -> ValueProfile {
    ValueProfile { distribution: Distribution::Gaussian, logit_scale, value_mean: 0.0 }
}

/// A dense spec with a mask.
#[allow(clippy::too_many_arguments)]
pub fn dense(b: usize, hq: usize, hkv: usize, lq: usize, lk: usize, d: usize, dv: usize, mask: Mask) -> AttentionSpec {
    AttentionSpec::dense(b, hq, hkv, lq, lk, d, dv).with_mask(mask)
}

/// A varlen spec with a mask.
pub fn varlen(cu_q: &[i32], cu_k: &[i32], hq: usize, hkv: usize, d: usize, dv: usize, mask: Mask) -> AttentionSpec {
    AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: cu_q.to_vec(), cu_seqlens_k: cu_k.to_vec() },
        ..AttentionSpec::dense(1, hq, hkv, 1, 1, d, dv).with_mask(mask)
    }
}
