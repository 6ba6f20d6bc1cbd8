//! The candidate seam: what an implementation of attention offers the verifier (its name, its precision recipe for a
//! spec, a forward and a backward), implemented for the reference schedules and the GPU kernels; case files plug in
//! through `crate::case::candidate`. The runners of `crate::adversarial` judge any [`Candidate`] the same way.
//!
//! A candidate that cannot run a spec or a direction says so with [`CandidateError::Unsupported`] (a GPU kernel and
//! a head dimension it does not compile, a case file without the outputs asked for); the runners report it as a
//! failure naming the candidate and the case, never as a pass.
//!
//! # Plugging in the sparse candidates
//!
//! Block-sparse, NSA and DSA schedules compute attention under a visibility that is not the spec's mask (a `−1`-padded
//! block list, a selection). Their candidate is a struct holding that layout beside the tiles (as
//! [`ReferenceCandidate`] holds its [`TileConfig`]) and implements [`Candidate`] the same way: `forward` runs the
//! sparse schedule on the case and `forward_recipe` names its recipe from `crate::recipes`. The one addition is the
//! verifier's view of visibility: such a candidate is judged with `problem_forward_bounds_with_visibility` (and its
//! backward twin) rather than the spec's own mask, which a `visibility` method on the trait with a default returning
//! the spec's mask would carry without changing the dense candidates.

use std::sync::Arc;

use attnproof_gpu::backward::BackwardTiling;
use attnproof_gpu::backward::flash_backward_device_with;
use attnproof_gpu::block_sparse::backward::block_sparse_backward_device_with;
use attnproof_gpu::block_sparse::{BlockLists, block_sparse_forward_device_with};
use attnproof_gpu::compile::{FLASH_BWD, FLASH_FWD, KernelSource, ModuleVariant};
use attnproof_gpu::flash::ForwardTiling;
use attnproof_gpu::flash::flash_forward_device_with;
use attnproof_gpu::{
    BackwardDeviceInputs, BackwardDeviceOutputs, GpuBackwardStrategy, GpuElement, GpuError, backward_variant,
    forward_variant, skip_unless_gpu,
};
use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Operand;
use attnproof_proofs::flash_bound::FlashRecipe;
use attnproof_reference::{
    BackwardInputs, BackwardOutputs, BackwardStrategy, Element, ForwardOutputs, TileConfig, flash_backward,
    flash_forward,
};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};
use ndarray::{ArrayD, IxDyn};
use thiserror::Error;

use crate::backward::BackwardCandidate;
use crate::flash::Case;
use crate::recipes::{self, BackwardRecipe};

/// A storage type both the kernels and the verifier know (bf16, f16).
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

/// Why a candidate gave no outputs.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum CandidateError {
    /// The candidate does not implement this spec or direction (not a wrong answer, but not a pass either).
    #[error("{candidate} does not support {what}")]
    Unsupported {
        /// The candidate's name.
        candidate: String,
        /// What it does not support.
        what: String,
    },
    /// The candidate ran and failed: a launch error, a guard band overwritten, an input changed.
    #[error("{candidate} failed: {reason}")]
    Failed {
        /// The candidate's name.
        candidate: String,
        /// What went wrong.
        reason: String,
    },
}

/// A candidate's forward outputs.
#[derive(Clone, Debug)]
pub struct ForwardRun<T> {
    /// `O`.
    pub o: ArrayD<T>,
    /// Natural-log `LSE` (f32).
    pub lse: ArrayD<f32>,
}

impl<T: Storage> ForwardRun<T> {
    /// Both outputs bitwise equal (NaN-safe).
    pub fn same(&self, other: &Self) -> bool {
        bits(&self.o) == bits(&other.o)
            && self.lse.iter().map(|x| x.to_bits()).eq(other.lse.iter().map(|x| x.to_bits()))
    }
}

/// Gradients of one backward run.
#[derive(Clone, Debug)]
pub struct Gradients<T> {
    /// dQ.
    pub dq: ArrayD<T>,
    /// dK.
    pub dk: ArrayD<T>,
    /// dV.
    pub dv: ArrayD<T>,
    /// `D = rowsum(dO ∘ O)` (f32).
    pub delta: ArrayD<f32>,
}

fn bits<T: Storage>(t: &ArrayD<T>) -> Vec<u16> {
    t.iter().map(|x| x.bits()).collect()
}

impl<T: Storage> Gradients<T> {
    /// dK, dV and D bitwise equal.
    pub fn same_dk_dv_delta(&self, other: &Self) -> bool {
        bits(&self.dk) == bits(&other.dk)
            && bits(&self.dv) == bits(&other.dv)
            && self.delta.iter().map(|x| x.to_bits()).eq(other.delta.iter().map(|x| x.to_bits()))
    }
    /// Every gradient bitwise equal.
    pub fn same(&self, other: &Self) -> bool {
        self.same_dk_dv_delta(other) && bits(&self.dq) == bits(&other.dq)
    }
}

impl<T> Gradients<T> {
    /// The verifier's view of these gradients.
    pub fn candidate(&self) -> BackwardCandidate<'_, T> {
        BackwardCandidate { dq: self.dq.view(), dk: self.dk.view(), dv: self.dv.view(), delta: self.delta.view() }
    }
}

/// What an implementation of attention offers the verifier.
///
/// A candidate is one configuration (tiles, tiling, kernel texts); the ways it may distribute a backward's work
/// (dQ ownership) are its [`Candidate::Strategy`] values, all judged against one expectation and required to agree
/// bitwise on dK, dV and D, which every strategy computes with the same arithmetic.
pub trait Candidate {
    /// A backward strategy (who owns dQ).
    type Strategy: Copy + std::fmt::Debug;

    /// The candidate's name, for messages.
    fn name(&self) -> String;

    /// The recipe its forward follows on `spec` in storage type `T`.
    fn forward_recipe<T: Storage>(&self, spec: &AttentionSpec) -> Result<FlashRecipe, CandidateError>;

    /// The recipe its backward follows on `spec` in storage type `T`.
    fn backward_recipe<T: Storage>(&self, spec: &AttentionSpec) -> Result<BackwardRecipe, CandidateError>;

    /// Its backward strategies, each checked.
    fn strategies(&self) -> Vec<Self::Strategy>;

    /// Whether `strategy` gives bitwise equal outputs on equal inputs (else only dK, dV and D must repeat).
    fn is_deterministic(&self, strategy: Self::Strategy) -> bool;

    /// Whether the candidate may carry state from one run to the next (device buffers, module caches, streams): the
    /// adversarial table then runs inputs A, B, A and requires both A results bitwise equal. A candidate that is a
    /// pure function of its inputs (a CPU schedule, a file) runs input A once, which keeps the table cheap on CPUs.
    fn keeps_state(&self) -> bool;

    /// `(O, LSE)` of the case.
    fn forward<T: Storage>(&self, case: &Case<T>) -> Result<ForwardRun<T>, CandidateError>;

    /// `(dQ, dK, dV, D)` of the case with `strategy`, from its forward's outputs and the upstream gradient `d_out`.
    fn backward<T: Storage>(
        &self,
        strategy: Self::Strategy,
        case: &Case<T>,
        forward: &ForwardRun<T>,
        d_out: &ArrayD<T>,
    ) -> Result<Gradients<T>, CandidateError>;
}

/// An output array of `spec`'s shape for `op`, every element NaN, so that an element a candidate never writes fails
/// the verdict.
fn nan_output<X: Clone>(spec: &AttentionSpec, op: Operand, nan: X) -> ArrayD<X> {
    ArrayD::from_elem(IxDyn(&spec.expected_shape(op)), nan)
}

/// The reference schedules (`attnproof_reference`): the tiled forward and both backward strategies, in the tiles
/// given, under the reference recipe of those tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReferenceCandidate {
    /// Query and KV tiles.
    pub tiles: TileConfig,
}

impl ReferenceCandidate {
    /// The reference schedule with square tiles of the GPU kernels' 64 rows, for the adversarial table (whose lengths
    /// sit around 64 and 128); the test name is unused (the reference runs everywhere).
    pub fn for_tests(_test_name: &str) -> Option<Self> {
        Some(ReferenceCandidate { tiles: TileConfig { q_tile: 64, kv_tile: 64 } })
    }

    fn failed(&self, e: impl std::fmt::Display) -> CandidateError {
        CandidateError::Failed { candidate: self.name(), reason: e.to_string() }
    }
}

impl Candidate for ReferenceCandidate {
    type Strategy = BackwardStrategy;

    fn name(&self) -> String {
        format!("reference (tiles {}x{})", self.tiles.q_tile, self.tiles.kv_tile)
    }

    fn forward_recipe<T: Storage>(&self, _spec: &AttentionSpec) -> Result<FlashRecipe, CandidateError> {
        Ok(recipes::reference::<T>(self.tiles.kv_tile))
    }

    fn backward_recipe<T: Storage>(&self, _spec: &AttentionSpec) -> Result<BackwardRecipe, CandidateError> {
        Ok(BackwardRecipe { recipe: recipes::reference::<T>(self.tiles.kv_tile), q_tile: self.tiles.q_tile })
    }

    fn strategies(&self) -> Vec<BackwardStrategy> {
        vec![BackwardStrategy::TwoTraversals, BackwardStrategy::KvOwnerPartialDq]
    }

    fn is_deterministic(&self, _strategy: BackwardStrategy) -> bool {
        true
    }

    fn keeps_state(&self) -> bool {
        false
    }

    fn forward<T: Storage>(&self, case: &Case<T>) -> Result<ForwardRun<T>, CandidateError> {
        let spec = &case.spec;
        let mut o = nan_output(spec, Operand::O, T::from_f32(f32::NAN));
        let mut lse = nan_output(spec, Operand::RowStat, f32::NAN);
        let outputs = ForwardOutputs { o: o.view_mut(), lse: lse.view_mut() };
        flash_forward(spec, &case.inputs(), self.tiles, outputs).map_err(|e| self.failed(e))?;
        Ok(ForwardRun { o, lse })
    }

    fn backward<T: Storage>(
        &self,
        strategy: BackwardStrategy,
        case: &Case<T>,
        forward: &ForwardRun<T>,
        d_out: &ArrayD<T>,
    ) -> Result<Gradients<T>, CandidateError> {
        let spec = &case.spec;
        let nan = T::from_f32(f32::NAN);
        let mut g = Gradients {
            dq: nan_output(spec, Operand::Q, nan),
            dk: nan_output(spec, Operand::K, nan),
            dv: nan_output(spec, Operand::V, nan),
            delta: nan_output(spec, Operand::RowStat, f32::NAN),
        };
        let inputs = BackwardInputs {
            q: case.q.view(),
            k: case.k.view(),
            v: case.v.view(),
            o: forward.o.view(),
            lse: forward.lse.view(),
            d_out: d_out.view(),
        };
        let outputs = BackwardOutputs {
            dq: g.dq.view_mut(),
            dk: g.dk.view_mut(),
            dv: g.dv.view_mut(),
            delta: g.delta.view_mut(),
        };
        flash_backward(spec, &inputs, self.tiles, strategy, outputs).map_err(|e| self.failed(e))?;
        Ok(g)
    }
}

/// Elements of sentinel past each output of a guarded launch.
pub const GUARD: usize = 256;
/// Bit pattern of the 16-bit guard bands: a NaN payload no arithmetic produces.
pub const GUARD_BITS_16: u16 = 0x7fa5;
/// The f32 guard pattern (LSE, D).
pub const GUARD_BITS_32: u32 = 0x7fc0_a5a5;

/// Why a guarded launch gave no outputs.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum LaunchError {
    /// The GPU crate refused or failed the launch (`GpuError::Unsupported` for what the kernels do not implement).
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A driver call (allocation, copy, synchronization) failed.
    #[error("driver: {0}")]
    Driver(String),
    /// The kernel wrote past an output.
    #[error("{output} guard band element {index} past the output was overwritten")]
    Guard {
        /// Which output.
        output: &'static str,
        /// The first overwritten guard element.
        index: usize,
    },
    /// The kernel changed one of its inputs.
    #[error("device input `{input}` changed during the launch")]
    InputChanged {
        /// Which input.
        input: &'static str,
    },
}

fn driver(e: impl std::fmt::Display) -> LaunchError {
    LaunchError::Driver(e.to_string())
}

/// A host tensor on the device; an empty one gets a one-element buffer (cudarc cannot allocate 0 elements, and the
/// kernels read nothing of an empty tensor).
pub fn upload<X: DeviceRepr + ValidAsZeroBits + Copy>(
    stream: &Arc<CudaStream>,
    t: &ArrayD<X>,
) -> Result<CudaSlice<X>, LaunchError> {
    let standard = t.as_standard_layout();
    let data = standard.as_slice().ok_or_else(|| LaunchError::Driver("input not contiguous".into()))?;
    if data.is_empty() {
        return stream.alloc_zeros::<X>(1).map_err(driver);
    }
    stream.clone_htod(data).map_err(driver)
}

/// An output buffer: `n` NaNs then the guard band.
pub fn poisoned<X: DeviceRepr + Copy>(
    stream: &Arc<CudaStream>,
    n: usize,
    nan: X,
    guard: X,
) -> Result<CudaSlice<X>, LaunchError> {
    let mut init = vec![nan; n];
    init.extend(std::iter::repeat_n(guard, GUARD));
    stream.clone_htod(&init).map_err(driver)
}

/// Splits a downloaded output at its length, checking the guard band after it.
pub fn unguard<X: Copy>(
    output: &'static str,
    back: Vec<X>,
    n: usize,
    shape: &[usize],
    intact: impl Fn(X) -> bool,
) -> Result<ArrayD<X>, LaunchError> {
    if let Some(index) = back[n..].iter().position(|&x| !intact(x)) {
        return Err(LaunchError::Guard { output, index });
    }
    ArrayD::from_shape_vec(IxDyn(shape), back[..n].to_vec()).map_err(driver)
}

/// Fails unless every downloaded input equals its original bit for bit.
pub(crate) fn unchanged<T: Storage>(
    originals: &[(&'static str, &ArrayD<T>)],
    back: &[Vec<T>],
) -> Result<(), LaunchError> {
    for ((input, original), back) in originals.iter().zip(back) {
        if !original.iter().zip(back.iter()).all(|(a, b)| a.bits() == b.bits()) {
            return Err(LaunchError::InputChanged { input });
        }
    }
    Ok(())
}

/// One forward launch of `kernel` with `tiling`, NaN-poisoned and guarded; checks the guards and that the device
/// inputs are unchanged. Returns `O` and `LSE`.
pub fn forward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    kernel: KernelSource,
    tiling: ForwardTiling,
) -> Result<ForwardRun<T>, LaunchError> {
    forward_guarded_with(stream, case, |q, k, v, o, lse| {
        flash_forward_device_with(stream, &case.spec, kernel, tiling, q, k, v, o, lse)
    })
}

/// One block-sparse forward launch of `kernel` over `lists`, NaN-poisoned and guarded like [`forward_guarded`].
pub fn block_sparse_forward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    lists: &BlockLists,
    kernel: KernelSource,
) -> Result<ForwardRun<T>, LaunchError> {
    forward_guarded_with(stream, case, |q, k, v, o, lse| {
        block_sparse_forward_device_with(stream, &case.spec, lists, kernel, q, k, v, o, lse)
    })
}

/// [`forward_guarded_with`] for a kernel that also reads per-token index lists (NSA's selected attention, DSA's
/// token-sparse attention): uploads `lists`, gives `launch` their device copy, and checks that it comes back unchanged.
pub fn forward_guarded_with_lists<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    lists: &ndarray::Array3<i32>,
    launch: impl FnOnce(
        (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
        &CudaSlice<i32>,
        &mut CudaSlice<T>,
        &mut CudaSlice<f32>,
    ) -> Result<(), GpuError>,
) -> Result<ForwardRun<T>, LaunchError> {
    let device_lists = upload(stream, &lists.clone().into_dyn())?;
    let run = forward_guarded_with(stream, case, |q, k, v, o, lse| launch((q, k, v), &device_lists, o, lse))?;
    let back = stream.clone_dtoh(&device_lists).map_err(driver)?;
    stream.synchronize().map_err(driver)?;
    if lists.iter().zip(back.iter()).any(|(a, b)| a != b) {
        return Err(LaunchError::InputChanged { input: "lists" });
    }
    Ok(run)
}

/// [`backward_guarded_with`] for a kernel that also reads per-token index lists (NSA's selected backward, DSA's
/// token-sparse backward): uploads `lists`, gives `launch` their device copy, and checks that it comes back unchanged.
pub fn backward_guarded_with_lists<T: Storage>(
    stream: &Arc<CudaStream>,
    problem: BackwardProblem<'_, T>,
    lists: &ndarray::Array3<i32>,
    launch: impl FnOnce(BackwardDeviceInputs<'_, T>, &CudaSlice<i32>, BackwardDeviceOutputs<'_, T>) -> Result<(), GpuError>,
) -> Result<Gradients<T>, LaunchError> {
    let device_lists = upload(stream, &lists.clone().into_dyn())?;
    let grads = backward_guarded_with(stream, problem, |inputs, outputs| launch(inputs, &device_lists, outputs))?;
    let back = stream.clone_dtoh(&device_lists).map_err(driver)?;
    stream.synchronize().map_err(driver)?;
    if lists.iter().zip(back.iter()).any(|(a, b)| a != b) {
        return Err(LaunchError::InputChanged { input: "lists" });
    }
    Ok(grads)
}

/// Uploads the case, runs `launch` on NaN-poisoned, guarded outputs, checks the guards and that the device inputs
/// are unchanged, and returns `O` and `LSE`.
pub fn forward_guarded_with<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    launch: impl FnOnce(
        &CudaSlice<T>,
        &CudaSlice<T>,
        &CudaSlice<T>,
        &mut CudaSlice<T>,
        &mut CudaSlice<f32>,
    ) -> Result<(), GpuError>,
) -> Result<ForwardRun<T>, LaunchError> {
    let spec = &case.spec;
    let (q, k, v) = (upload(stream, &case.q)?, upload(stream, &case.k)?, upload(stream, &case.v)?);
    let shape = |op: Operand| spec.expected_shape(op);
    let n = |op: Operand| shape(op).iter().product::<usize>();
    let nan = <T as Element>::from_f32(f32::NAN);
    let mut o = poisoned(stream, n(Operand::O), nan, T::from_bits16(GUARD_BITS_16))?;
    let mut lse = poisoned(stream, n(Operand::RowStat), f32::NAN, f32::from_bits(GUARD_BITS_32))?;
    launch(&q, &k, &v, &mut o, &mut lse)?;
    let down = |b: &CudaSlice<T>| stream.clone_dtoh(b).map_err(driver);
    let o_back = down(&o)?;
    let lse_back = stream.clone_dtoh(&lse).map_err(driver)?;
    let inputs_back = [down(&q)?, down(&k)?, down(&v)?];
    stream.synchronize().map_err(driver)?;
    unchanged(&[("q", &case.q), ("k", &case.k), ("v", &case.v)], &inputs_back)?;
    Ok(ForwardRun {
        o: unguard("O", o_back, n(Operand::O), &shape(Operand::O), |x: T| x.bits() == GUARD_BITS_16)?,
        lse: unguard("LSE", lse_back, n(Operand::RowStat), &shape(Operand::RowStat), |x: f32| {
            x.to_bits() == GUARD_BITS_32
        })?,
    })
}

/// The inputs of a backward launch: the case, its forward's outputs and the upstream gradient.
#[derive(Clone, Copy, Debug)]
pub struct BackwardProblem<'a, T> {
    /// Q, K, V and the spec.
    pub case: &'a Case<T>,
    /// The forward's `O` and `LSE`.
    pub forward: &'a ForwardRun<T>,
    /// Upstream gradient `dO`.
    pub d_out: &'a ArrayD<T>,
}

/// One backward of `kernel` with `strategy` in `tiling`, NaN-poisoned and guarded; checks the guards and that no
/// device input changed.
pub fn backward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    problem: BackwardProblem<'_, T>,
    kernel: KernelSource,
    tiling: BackwardTiling,
    strategy: GpuBackwardStrategy,
) -> Result<Gradients<T>, LaunchError> {
    backward_guarded_with(stream, problem, |inputs, outputs| {
        flash_backward_device_with(stream, &problem.case.spec, kernel, tiling, inputs, outputs, strategy)
    })
}

/// One block-sparse backward of `kernel` over `lists` with `strategy` in `tiling`, guarded like [`backward_guarded`].
pub fn block_sparse_backward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    problem: BackwardProblem<'_, T>,
    lists: &BlockLists,
    kernel: KernelSource,
    tiling: BackwardTiling,
    strategy: GpuBackwardStrategy,
) -> Result<Gradients<T>, LaunchError> {
    backward_guarded_with(stream, problem, |inputs, outputs| {
        block_sparse_backward_device_with(stream, &problem.case.spec, lists, kernel, tiling, inputs, outputs, strategy)
    })
}

/// Uploads the problem, runs `launch` on NaN-poisoned, guarded outputs, checks the guards and that no device input
/// changed, and returns the gradients.
pub fn backward_guarded_with<T: Storage>(
    stream: &Arc<CudaStream>,
    problem: BackwardProblem<'_, T>,
    launch: impl FnOnce(BackwardDeviceInputs<'_, T>, BackwardDeviceOutputs<'_, T>) -> Result<(), GpuError>,
) -> Result<Gradients<T>, LaunchError> {
    let BackwardProblem { case, forward, d_out } = problem;
    let spec = &case.spec;
    let (q, k, v) = (upload(stream, &case.q)?, upload(stream, &case.k)?, upload(stream, &case.v)?);
    let (o, lse, g) = (upload(stream, &forward.o)?, upload(stream, &forward.lse)?, upload(stream, d_out)?);
    let shape = |op: Operand| spec.expected_shape(op);
    let n = |op: Operand| shape(op).iter().product::<usize>();
    let nan = <T as Element>::from_f32(f32::NAN);
    let guard = T::from_bits16(GUARD_BITS_16);
    let mut dq = poisoned(stream, n(Operand::Q), nan, guard)?;
    let mut dk = poisoned(stream, n(Operand::K), nan, guard)?;
    let mut dv = poisoned(stream, n(Operand::V), nan, guard)?;
    let mut delta = poisoned(stream, n(Operand::RowStat), f32::NAN, f32::from_bits(GUARD_BITS_32))?;
    launch(
        BackwardDeviceInputs { q: &q, k: &k, v: &v, o: &o, lse: &lse, d_out: &g },
        BackwardDeviceOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv, delta: &mut delta },
    )?;
    let down = |b: &CudaSlice<T>| stream.clone_dtoh(b).map_err(driver);
    let (dq_b, dk_b, dv_b) = (down(&dq)?, down(&dk)?, down(&dv)?);
    let delta_b = stream.clone_dtoh(&delta).map_err(driver)?;
    let inputs_back = [down(&q)?, down(&k)?, down(&v)?, down(&o)?, down(&g)?];
    let lse_back = stream.clone_dtoh(&lse).map_err(driver)?;
    stream.synchronize().map_err(driver)?;
    let originals = [("q", &case.q), ("k", &case.k), ("v", &case.v), ("o", &forward.o), ("d_out", d_out)];
    unchanged(&originals, &inputs_back)?;
    if !forward.lse.iter().zip(&lse_back).all(|(a, b)| a.to_bits() == b.to_bits()) {
        return Err(LaunchError::InputChanged { input: "lse" });
    }
    let g16 = |x: T| x.bits() == GUARD_BITS_16;
    Ok(Gradients {
        dq: unguard("dQ", dq_b, n(Operand::Q), &shape(Operand::Q), g16)?,
        dk: unguard("dK", dk_b, n(Operand::K), &shape(Operand::K), g16)?,
        dv: unguard("dV", dv_b, n(Operand::V), &shape(Operand::V), g16)?,
        delta: unguard("D", delta_b, n(Operand::RowStat), &shape(Operand::RowStat), |x: f32| {
            x.to_bits() == GUARD_BITS_32
        })?,
    })
}

/// The GPU kernels (`attnproof_gpu`): every launch guarded (NaN-poisoned outputs, guard bands, inputs checked
/// unchanged), the forward in a chosen or the production tiling, the backward in one tiling with every strategy.
#[derive(Clone, Debug)]
pub struct GpuCandidate {
    /// The stream every launch goes to.
    pub stream: Arc<CudaStream>,
    /// The forward kernel's text (the production one, or a mutant).
    pub forward_kernel: KernelSource,
    /// The backward kernels' text.
    pub backward_kernel: KernelSource,
    /// The forward tiling; `None`: the tiling the forward kernel's text runs in for the head dims
    /// (`ForwardTiling::of_kernel`).
    pub forward_tiling: Option<ForwardTiling>,
    /// The backward tiling.
    pub backward_tiling: BackwardTiling,
}

impl GpuCandidate {
    /// The production kernels and tilings on a new stream of `stream`'s device.
    pub fn production(stream: Arc<CudaStream>) -> Self {
        GpuCandidate {
            stream,
            forward_kernel: FLASH_FWD,
            backward_kernel: FLASH_BWD,
            forward_tiling: None,
            backward_tiling: BackwardTiling::DEFAULT,
        }
    }

    /// The production candidate when a device is present; `None` after `skip_unless_gpu` has reported the skip of
    /// `test_name` (it panics instead when a device is required).
    pub fn if_available(test_name: &str) -> Option<Self> {
        let ctx = skip_unless_gpu(test_name)?;
        Some(GpuCandidate::production(ctx.new_stream().expect("create a stream")))
    }

    /// The same kernels with the backward in `tiling`.
    pub fn with_backward_tiling(self, tiling: BackwardTiling) -> Self {
        GpuCandidate { backward_tiling: tiling, ..self }
    }

    /// The forward tiling of a launch for `spec`: the candidate's, or its kernel's own for the head dims.
    fn forward_tiling_for(&self, spec: &AttentionSpec) -> ForwardTiling {
        self.forward_tiling
            .unwrap_or_else(|| ForwardTiling::of_kernel(self.forward_kernel, spec.head_dim, spec.head_dim_v))
    }

    /// The module this candidate's forward launch for `spec` compiles with storage type `T` (what
    /// `attnproof_gpu::compile::module` compiles ahead of the launch); an error where the launch would refuse the spec.
    pub fn forward_variant<T: Storage>(&self, spec: &AttentionSpec) -> Result<ModuleVariant, GpuError> {
        forward_variant::<T>(spec, self.forward_tiling_for(spec), self.forward_kernel)
    }

    /// The module this candidate's backward launches for `spec` compile with storage type `T`.
    pub fn backward_variant<T: Storage>(&self, spec: &AttentionSpec) -> Result<ModuleVariant, GpuError> {
        backward_variant::<T>(spec, self.backward_tiling, self.backward_kernel)
    }

    fn error(&self, e: LaunchError) -> CandidateError {
        match e {
            LaunchError::Gpu(GpuError::Unsupported { argument, reason }) => {
                CandidateError::Unsupported { candidate: self.name(), what: format!("{argument}: {reason}") }
            }
            e => CandidateError::Failed { candidate: self.name(), reason: e.to_string() },
        }
    }
}

impl Candidate for GpuCandidate {
    type Strategy = GpuBackwardStrategy;

    fn name(&self) -> String {
        let fwd = self.forward_tiling.map_or_else(|| "production".to_owned(), |t| format!("{t:?}"));
        format!("gpu (forward {fwd}, backward {:?})", self.backward_tiling)
    }

    fn forward_recipe<T: Storage>(&self, _spec: &AttentionSpec) -> Result<FlashRecipe, CandidateError> {
        Ok(recipes::gpu_forward::<T>())
    }

    fn backward_recipe<T: Storage>(&self, _spec: &AttentionSpec) -> Result<BackwardRecipe, CandidateError> {
        Ok(recipes::gpu_backward::<T>(self.backward_tiling))
    }

    fn strategies(&self) -> Vec<GpuBackwardStrategy> {
        GpuBackwardStrategy::ALL.to_vec()
    }

    fn is_deterministic(&self, strategy: GpuBackwardStrategy) -> bool {
        strategy.is_deterministic()
    }

    fn keeps_state(&self) -> bool {
        true
    }

    fn forward<T: Storage>(&self, case: &Case<T>) -> Result<ForwardRun<T>, CandidateError> {
        let tiling = self.forward_tiling_for(&case.spec);
        forward_guarded(&self.stream, case, self.forward_kernel, tiling).map_err(|e| self.error(e))
    }

    fn backward<T: Storage>(
        &self,
        strategy: GpuBackwardStrategy,
        case: &Case<T>,
        forward: &ForwardRun<T>,
        d_out: &ArrayD<T>,
    ) -> Result<Gradients<T>, CandidateError> {
        let problem = BackwardProblem { case, forward, d_out };
        backward_guarded(&self.stream, problem, self.backward_kernel, self.backward_tiling, strategy)
            .map_err(|e| self.error(e))
    }
}
