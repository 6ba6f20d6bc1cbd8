//! Verifying NSA's compressed keys and values (E18) against the oracle (`oracle::nsa::compress` in f64) within the
//! derived bound (`attnproof_proofs::nsa_bound::compression_bound`), and against the recipe's CPU reference
//! (`attnproof_reference::sparse::nsa::compress_head`) bit for bit: the recipe fixes every operation and its order, so
//! a kernel that follows it has no freedom left, and one that deviates (a sum in f32, another order) is caught even
//! where the bound, dominated by the storage rounding, would let it pass.
//!
//! The compressed layout is the verifier's own reading of E18 (the oracle's `complete_windows` per sequence): dense
//! `[B, Hkv, W, cols]`, varlen `[ΣW_b, Hkv, cols]` with sequence `b` from row `ΣW_{<b}` on. [`compress_guarded`]
//! launches a kernel text through the GPU wrapper with NaN-poisoned, guarded outputs.
//!
//! The gates (E18's sigmoid-gated sum of the three branch outputs, and its gradients) are verified against the
//! oracle's `gate_combine` and `gate_combine_backward` in f64 under the bounds of `attnproof_proofs::nsa_bound`
//! ([`verify_gate_combine`], [`verify_gate_backward`]); their kernel's `expf` is not the CPU's, so there is no
//! bitwise reference. [`gate_draws`] draws their problems, [`gates_guarded`] launches them.

use std::sync::Arc;

use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::nsa::compress::{compress_kv_backward_device, compress_kv_device, compress_map_gradient_device};
use attnproof_oracle::nsa::{Compression, MapGradient, NsaConfig, complete_windows, compress, compress_backward};
use attnproof_oracle::spec::{Layout, Operand};
use attnproof_proofs::flash_bound::{F32_SUBNORMAL, F32_UNIT_ROUNDOFF};
use attnproof_proofs::nsa_bound::{
    StorageRounding, compression_bound, f64_evaluation_error, gate_branch_gradient_bound, gate_combine_bound,
    gate_logit_gradient_bound,
};
use attnproof_reference::Element;
use attnproof_reference::sparse::nsa::compress_head;
use cudarc::driver::CudaStream;
use ndarray::{Array2, ArrayD, ArrayView2, ArrayViewD, Axis, Dimension, IxDyn, Slice};
use proptest::prelude::*;

use crate::candidate::{GUARD_BITS_16, GUARD_BITS_32, LaunchError, Storage, poisoned, unchanged, unguard, upload};
use crate::flash::{Case, HarnessError};
use crate::recipes::subnormal_of;

/// Failing elements described in a verdict, at most.
const REPORTED: usize = 8;

/// The outcome of one verification.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CompressionVerdict {
    /// Elements compared (keys and values).
    pub elements: usize,
    /// The largest `|out − y_ref| / bound` over them (NaN outputs excluded; they fail).
    pub worst_ratio: f64,
    /// Elements whose bits differ from the CPU reference's.
    pub reference_mismatches: usize,
    /// The first failing elements (outside the bound, not finite where the truth is, or off the reference's bits).
    pub failures: Vec<String>,
}

impl CompressionVerdict {
    /// Every element within the bound and equal to the reference's bits.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// Holds one stored element `value` to `compression_bound` of the exact `y` (magnitude `m`, `terms` f64 terms),
    /// recording its ratio and, outside the bound, a failure named by `where_`. An infinite `value` is right only where
    /// every value the exact result may have (the oracle's within its f64 evaluation error of it) rounds through f32
    /// to the same infinity.
    fn judge<T: Storage>(
        &mut self,
        value: T,
        exact: (f64, f64, usize),
        storage: StorageRounding,
        where_: impl Fn() -> String,
    ) {
        self.judge_rounded(value.to_f32(), |x| T::from_f32(x).to_f32(), exact, storage, where_);
    }

    /// [`Self::judge`] for a value already widened to f32, with `round` the storage type's rounding of an f32 (the
    /// identity for an f32 output).
    fn judge_rounded(
        &mut self,
        value: f32,
        round: impl Fn(f32) -> f32,
        (y, m, terms): (f64, f64, usize),
        storage: StorageRounding,
        where_: impl Fn() -> String,
    ) {
        let bound = compression_bound(y, m, terms, storage);
        let v = f64::from(value);
        let within = if v.is_infinite() {
            let least = (y.abs() - 2.0 * f64_evaluation_error(m, terms)).max(0.0).copysign(y);
            round(least as f32) == value
        } else {
            let ratio = (v - y).abs() / bound;
            if ratio.is_finite() {
                self.worst_ratio = self.worst_ratio.max(ratio);
            }
            ratio <= 1.0
        };
        if !within && self.failures.len() < REPORTED {
            self.failures.push(format!("{}: {v:e} against {y:e} (bound {bound:e})", where_()));
        }
    }
}

/// The compressed operands of a candidate, in the layout of the module docs.
#[derive(Clone, Debug)]
pub struct Compressed<T> {
    /// `k̃`.
    pub k: ArrayD<T>,
    /// `ṽ`.
    pub v: ArrayD<T>,
}

/// The windows of each sequence (the oracle's count) and the compressed shape of an operand with `cols` columns.
fn layout(case_spec: &attnproof_oracle::AttentionSpec, config: &NsaConfig, cols: usize) -> (Vec<usize>, Vec<usize>) {
    let windows: Vec<usize> = case_spec
        .sequences()
        .iter()
        .map(|s| complete_windows(s.len_k, config.compress_len, config.compress_stride).unwrap_or(0))
        .collect();
    let shape = match case_spec.layout {
        Layout::Dense { batch, .. } => vec![batch, case_spec.n_heads_kv, windows.first().copied().unwrap_or(0), cols],
        Layout::Varlen { .. } => vec![windows.iter().sum(), case_spec.n_heads_kv, cols],
    };
    (windows, shape)
}

/// Rows `[W_b, cols]` of sequence `index` (first window `first`), head `head` of a compressed operand.
fn compressed_rows<'a, X>(
    t: &'a ArrayViewD<'_, X>,
    dense: bool,
    index: usize,
    first: usize,
    windows: usize,
    head: usize,
) -> ArrayView2<'a, X> {
    let view = if dense {
        t.index_axis(Axis(0), index).index_axis_move(Axis(0), head)
    } else {
        t.slice_axis(Axis(0), Slice::from(first..first + windows)).index_axis_move(Axis(1), head)
    };
    view.into_dimensionality().expect("rank 2")
}

/// Verifies `candidate` as the compressed keys and values of `case` under `config`.
pub fn verify_compression<T: Storage>(
    case: &Case<T>,
    config: &NsaConfig,
    candidate: &Compressed<T>,
) -> Result<CompressionVerdict, HarnessError> {
    config.validate()?;
    let spec = &case.spec;
    let [_, k_wide, v_wide] = case.widened();
    // The inputs must be what a caller may give the kernel: finite values of the storage type.
    for (argument, wide) in [("k", &k_wide), ("v", &v_wide)] {
        if let Some((index, &value)) = wide.indexed_iter().find(|(_, x)| !x.is_finite()) {
            let index = index.slice().to_vec();
            return Err(attnproof_oracle::OracleError::NonFinite { argument, index, value }.into());
        }
    }
    let storage = StorageRounding { unit_roundoff: T::UNIT_ROUNDOFF, subnormal: f64::from(subnormal_of::<T>()) };
    let dense = matches!(spec.layout, Layout::Dense { .. });
    let mut verdict = CompressionVerdict::default();
    let operands = [
        ("k_cmp", &case.k, &k_wide, &candidate.k, &config.compress_keys, spec.head_dim),
        ("v_cmp", &case.v, &v_wide, &candidate.v, &config.compress_values, spec.head_dim_v),
    ];
    for (name, stored, wide, got, map, cols) in operands {
        let (windows, shape) = layout(spec, config, cols);
        if got.shape() != shape.as_slice() {
            return Err(HarnessError::CandidateShape { argument: name, expected: shape, actual: got.shape().to_vec() });
        }
        let got = got.view();
        let mut first = 0;
        for (seq, &w) in spec.sequences().iter().zip(&windows) {
            for head in 0..spec.n_heads_kv {
                let x = spec.head_rows(wide.view(), seq, head, true);
                let truth = compress(x, map, config, ())?;
                let reference = compress_head(spec.head_rows(stored.view(), seq, head, true), map, config)
                    .map_err(from_reference)?;
                let magnitudes = magnitudes(x, map, config, w);
                let out = compressed_rows(&got, dense, seq.index, first, w, head);
                for ((c, col), &value) in out.indexed_iter() {
                    verdict.elements += 1;
                    let (y, m) = (truth[[c, col]], magnitudes[[c, col]]);
                    let where_ = || format!("{name}[sequence {}, head {head}, window {c}, column {col}]", seq.index);
                    verdict.judge(value, (y, m, chain_terms(map, config.compress_len, cols)), storage, where_);
                    let want = reference[[c, col]];
                    if want.bits() != value.bits() {
                        verdict.reference_mismatches += 1;
                        if verdict.failures.len() < REPORTED {
                            verdict.failures.push(format!(
                                "{}: bits {:#06x}, the recipe's {:#06x} ({:e})",
                                where_(),
                                value.bits(),
                                want.bits(),
                                want.to_f32()
                            ));
                        }
                    }
                }
            }
            first += w;
        }
    }
    if verdict.reference_mismatches > 0 && verdict.failures.is_empty() {
        verdict.failures.push(format!("{} elements off the recipe's bits", verdict.reference_mismatches));
    }
    Ok(verdict)
}

/// The f64 terms of one element's chain: one per position (`l`) for the mean and weights, one per stacked index
/// (`l·cols`) for a matrix.
fn chain_terms(map: &Compression, positions: usize, cols: usize) -> usize {
    match map {
        Compression::Linear(_) => positions * cols,
        _ => positions,
    }
}

/// The bound's magnitude per element: `Σ|x_i| / l` for the mean, `Σ|w_i x_i|` for weights, `Σ_{i,j} |x_{i,j} W[i·d+j,
/// col]|` for a matrix.
pub fn magnitudes(x: ArrayView2<'_, f64>, map: &Compression, config: &NsaConfig, windows: usize) -> Array2<f64> {
    Array2::from_shape_fn((windows, x.ncols()), |(c, col)| {
        let rows = c * config.compress_stride..c * config.compress_stride + config.compress_len;
        match map {
            Compression::Mean => rows.map(|i| x[[i, col]].abs()).sum::<f64>() / config.compress_len as f64,
            Compression::Weighted(w) => rows.zip(w).map(|(i, w)| (w * x[[i, col]]).abs()).sum(),
            Compression::Linear(w) => rows
                .enumerate()
                .flat_map(|(p, i)| (0..x.ncols()).map(move |j| (p * x.ncols() + j, i, j)))
                .map(|(r, i, j)| (x[[i, j]] * w[[r, col]]).abs())
                .sum(),
        }
    })
}

/// A reference failure as the verifier reports it: the problem (the only way `compress_head` fails) goes to the
/// oracle's error.
fn from_reference(e: attnproof_reference::ReferenceError) -> HarnessError {
    match e {
        attnproof_reference::ReferenceError::Problem(p) => HarnessError::Oracle(p),
        other => HarnessError::Oracle(attnproof_oracle::OracleError::InvalidParameter {
            argument: "config",
            reason: other.to_string(),
        }),
    }
}

/// The CPU reference's compression of one operand `x` (K or V of `case`, `cols` columns) with `map`.
fn reference_operand<T: Storage>(
    case: &Case<T>,
    config: &NsaConfig,
    x: &ArrayD<T>,
    map: &Compression,
    cols: usize,
) -> Result<ArrayD<T>, HarnessError> {
    let spec = &case.spec;
    let dense = matches!(spec.layout, Layout::Dense { .. });
    let (windows, shape) = layout(spec, config, cols);
    let mut t = ArrayD::from_elem(IxDyn(&shape), T::from_f32(0.0));
    let mut first = 0;
    for (seq, &w) in spec.sequences().iter().zip(&windows) {
        for head in 0..spec.n_heads_kv {
            let rows = compress_head(spec.head_rows(x.view(), seq, head, true), map, config).map_err(from_reference)?;
            let view = t.view_mut();
            let mut target = if dense {
                view.index_axis_move(Axis(0), seq.index).index_axis_move(Axis(0), head)
            } else {
                view.slice_axis_move(Axis(0), Slice::from(first..first + w)).index_axis_move(Axis(1), head)
            };
            target.assign(&rows.into_dyn());
        }
        first += w;
    }
    Ok(t)
}

/// The CPU reference's compressed operands of `case` (the recipe, in the layout of the module docs).
pub fn reference_compression<T: Storage>(case: &Case<T>, config: &NsaConfig) -> Result<Compressed<T>, HarnessError> {
    let spec = &case.spec;
    Ok(Compressed {
        k: reference_operand(case, config, &case.k, &config.compress_keys, spec.head_dim)?,
        v: reference_operand(case, config, &case.v, &config.compress_values, spec.head_dim_v)?,
    })
}

/// One launch of the compression kernel text `kernel` for `case` under `config`, through the GPU wrapper, into
/// NaN-poisoned outputs followed by guard bands; checks the guards and that K and V are unchanged on the device.
pub fn compress_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    config: &NsaConfig,
    kernel: KernelSource,
) -> Result<Compressed<T>, LaunchError> {
    let spec = &case.spec;
    let shapes = [("k_cmp", layout(spec, config, spec.head_dim).1), ("v_cmp", layout(spec, config, spec.head_dim_v).1)];
    let [k, v] = guarded_pair(stream, [("k", &case.k), ("v", &case.v)], shapes, |[k, v], [k_cmp, v_cmp]| {
        compress_kv_device(stream, spec, config, kernel, k, v, k_cmp, v_cmp)
    })?;
    Ok(Compressed { k, v })
}

/// Uploads the two `inputs`, runs `launch` from them into two NaN-poisoned outputs of `shapes` followed by guard
/// bands, checks the guards and that the inputs are unchanged on the device, and returns the outputs.
fn guarded_pair<T: Storage>(
    stream: &Arc<CudaStream>,
    inputs: [(&'static str, &ArrayD<T>); 2],
    shapes: [(&'static str, Vec<usize>); 2],
    launch: impl FnOnce(
        [&cudarc::driver::CudaSlice<T>; 2],
        [&mut cudarc::driver::CudaSlice<T>; 2],
    ) -> Result<(), attnproof_gpu::GpuError>,
) -> Result<[ArrayD<T>; 2], LaunchError> {
    let (a, b) = (upload(stream, inputs[0].1)?, upload(stream, inputs[1].1)?);
    let lens = shapes.each_ref().map(|(_, shape)| shape.iter().product::<usize>());
    let (nan, guard) = (<T as Element>::from_f32(f32::NAN), T::from_bits16(GUARD_BITS_16));
    let mut out_a = poisoned(stream, lens[0], nan, guard)?;
    let mut out_b = poisoned(stream, lens[1], nan, guard)?;
    launch([&a, &b], [&mut out_a, &mut out_b])?;
    let driver = |e: cudarc::driver::DriverError| LaunchError::Driver(e.to_string());
    let backs = [stream.clone_dtoh(&out_a).map_err(driver)?, stream.clone_dtoh(&out_b).map_err(driver)?];
    let inputs_back = [stream.clone_dtoh(&a).map_err(driver)?, stream.clone_dtoh(&b).map_err(driver)?];
    stream.synchronize().map_err(driver)?;
    unchanged(&inputs, &inputs_back)?;
    let intact = |x: T| x.bits() == GUARD_BITS_16;
    let [back_a, back_b] = backs;
    Ok([
        unguard(shapes[0].0, back_a, lens[0], &shapes[0].1, intact)?,
        unguard(shapes[1].0, back_b, lens[1], &shapes[1].1, intact)?,
    ])
}

/// The compressed operands' gradients the pooling's transpose is checked with: the forward's own outputs (realistic
/// magnitudes, the storage type's whole range included), with every non-finite element (a large weight over values
/// near the largest one) set to zero, since an upstream gradient is finite.
pub fn upstream_of<T: Storage>(forward: &Compressed<T>) -> Compressed<T> {
    let finite = |t: &ArrayD<T>| t.mapv(|x| if x.to_f32().is_finite() { x } else { T::from_f32(0.0) });
    Compressed { k: finite(&forward.k), v: finite(&forward.v) }
}

/// The token-side gradients of the pooling's transpose: `∂L/∂K` and `∂L/∂V` in the spec's K and V layouts.
#[derive(Clone, Debug)]
pub struct TokenGradients<T> {
    /// `dK`.
    pub dk: ArrayD<T>,
    /// `dV`.
    pub dv: ArrayD<T>,
}

/// One launch of the pooling's transpose (`attnproof_gpu::nsa::compress::compress_kv_backward_device`) of the kernel
/// text `kernel` for `case`'s spec under `config`, from `upstream` (the compressed layout), into NaN-poisoned outputs
/// followed by guard bands; checks the guards and that the upstream gradients are unchanged on the device.
pub fn compress_backward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    config: &NsaConfig,
    kernel: KernelSource,
    upstream: &Compressed<T>,
) -> Result<TokenGradients<T>, LaunchError> {
    let spec = &case.spec;
    let shapes = [("dk", spec.expected_shape(Operand::K)), ("dv", spec.expected_shape(Operand::V))];
    let inputs = [("dk_cmp", &upstream.k), ("dv_cmp", &upstream.v)];
    let [dk, dv] = guarded_pair(stream, inputs, shapes, |[dk_cmp, dv_cmp], [dk, dv]| {
        compress_kv_backward_device(stream, spec, config, kernel, dk_cmp, dv_cmp, dk, dv)
    })?;
    Ok(TokenGradients { dk, dv })
}

/// Verifies `candidate` as the pooling's transpose of `upstream` (the compressed keys' and values' gradients of
/// `case`'s spec under `config`): every token element within `compression_bound` of the oracle's `compress_backward`
/// (its `∂L/∂x`), the magnitude `Σ_c |w_{t−c·s}| |dx̃_c|` over the windows that hold the token (`1/l` for the mean;
/// `Σ_c Σ_k |W[(t−c·s)·d + j, k]| |dx̃_{c,k}|` for a matrix), the f64 evaluation over at most `⌈l/s⌉` windows (times
/// `d` for a matrix) and the mean's division. No CPU reference: the bound alone.
pub fn verify_compression_backward<T: Storage>(
    case: &Case<T>,
    config: &NsaConfig,
    upstream: &Compressed<T>,
    candidate: &TokenGradients<T>,
) -> Result<CompressionVerdict, HarnessError> {
    config.validate()?;
    let spec = &case.spec;
    let storage = StorageRounding { unit_roundoff: T::UNIT_ROUNDOFF, subnormal: f64::from(subnormal_of::<T>()) };
    let dense = matches!(spec.layout, Layout::Dense { .. });
    let (l, s) = (config.compress_len, config.compress_stride);
    let mut verdict = CompressionVerdict::default();
    let [_, k_wide, v_wide] = case.widened();
    let operands = [
        ("dk", &k_wide, &upstream.k, &candidate.dk, &config.compress_keys, spec.head_dim, Operand::K),
        ("dv", &v_wide, &upstream.v, &candidate.dv, &config.compress_values, spec.head_dim_v, Operand::V),
    ];
    for (name, wide, up, got, map, cols, operand) in operands {
        let (windows, up_shape) = layout(spec, config, cols);
        if up.shape() != up_shape.as_slice() {
            return Err(HarnessError::CandidateShape {
                argument: "upstream",
                expected: up_shape,
                actual: up.shape().to_vec(),
            });
        }
        let expected = spec.expected_shape(operand);
        if got.shape() != expected.as_slice() {
            return Err(HarnessError::CandidateShape { argument: name, expected, actual: got.shape().to_vec() });
        }
        let up_wide = up.mapv(|x| f64::from(x.to_f32()));
        let up_view = up_wide.view();
        // At most ⌈l/s⌉ windows per token, each one term (`cols` terms for a matrix), and the mean's division.
        let terms = chain_terms(map, l.div_ceil(s), cols) + 1;
        let mut first = 0;
        for (seq, &w) in spec.sequences().iter().zip(&windows) {
            for head in 0..spec.n_heads_kv {
                let x = spec.head_rows(wide.view(), seq, head, true);
                let d_cmp = compressed_rows(&up_view, dense, seq.index, first, w, head);
                let truth = compress_backward(x, map, d_cmp, config, ())?.dx;
                let out = spec.head_rows(got.view(), seq, head, true);
                for ((t, col), &value) in out.indexed_iter() {
                    verdict.elements += 1;
                    let (lo, hi) = (if t >= l { (t - l + s) / s } else { 0 }, (t / s).min(w.saturating_sub(1)));
                    let m: f64 = if w == 0 {
                        0.0
                    } else {
                        (lo..=hi)
                            .map(|c| match map {
                                Compression::Weighted(ws) => ws[t - c * s].abs() * d_cmp[[c, col]].abs(),
                                Compression::Linear(wm) => {
                                    let r = (t - c * s) * cols + col;
                                    (0..cols).map(|k| (wm[[r, k]] * d_cmp[[c, k]]).abs()).sum()
                                }
                                Compression::Mean => d_cmp[[c, col]].abs() / l as f64,
                            })
                            .sum()
                    };
                    let y = truth[[t, col]];
                    let where_ = || format!("{name}[sequence {}, head {head}, token {t}, column {col}]", seq.index);
                    verdict.judge(value, (y, m, terms), storage, where_);
                }
            }
            first += w;
        }
    }
    Ok(verdict)
}

/// The learned matrices' own gradients, f32 `[l·cols, cols]` (`attnproof_gpu::nsa::compress::compress_map_gradient_device`):
/// `None` for an operand whose map is not a matrix.
#[derive(Clone, Debug, Default)]
pub struct MapGradients {
    /// `∂L/∂W_K`.
    pub keys: Option<Array2<f32>>,
    /// `∂L/∂W_V`.
    pub values: Option<Array2<f32>>,
}

/// The operands whose map is a learned matrix, with the matrix's shape `[l·cols, cols]`.
fn matrix_operands(spec: &attnproof_oracle::AttentionSpec, config: &NsaConfig) -> Vec<(Operand, [usize; 2])> {
    let l = config.compress_len;
    [(Operand::K, &config.compress_keys, spec.head_dim), (Operand::V, &config.compress_values, spec.head_dim_v)]
        .into_iter()
        .filter(|(_, map, _)| matches!(map, Compression::Linear(_)))
        .map(|(operand, _, cols)| (operand, [l * cols, cols]))
        .collect()
}

/// The learned matrices' gradients of `case` under `config` from `upstream` through the kernel text `kernel`: K, V
/// and the upstream gradients uploaded, each gradient NaN-poisoned with a guard band, guards and inputs checked after
/// the launch. An operand whose map is not a matrix is not launched (`None`).
pub fn map_gradients_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    config: &NsaConfig,
    kernel: KernelSource,
    upstream: &Compressed<T>,
) -> Result<MapGradients, LaunchError> {
    let driver = |e: cudarc::driver::DriverError| LaunchError::Driver(e.to_string());
    let mut out = MapGradients::default();
    for (operand, shape) in matrix_operands(&case.spec, config) {
        let (x, up) = if operand == Operand::K { (&case.k, &upstream.k) } else { (&case.v, &upstream.v) };
        let (dx, dup) = (upload(stream, x)?, upload(stream, up)?);
        let n = shape[0] * shape[1];
        let mut grad = poisoned(stream, n, f32::NAN, f32::from_bits(GUARD_BITS_32))?;
        compress_map_gradient_device(stream, &case.spec, config, kernel, operand, &dx, &dup, &mut grad)?;
        let back = stream.clone_dtoh(&grad).map_err(driver)?;
        let inputs_back = [stream.clone_dtoh(&dx).map_err(driver)?, stream.clone_dtoh(&dup).map_err(driver)?];
        stream.synchronize().map_err(driver)?;
        unchanged(&[("x", x), ("dx_cmp", up)], &inputs_back)?;
        let got = unguard("d_map", back, n, &shape, |v: f32| v.to_bits() == GUARD_BITS_32)?;
        let got = got.into_dimensionality().expect("rank 2");
        if operand == Operand::K {
            out.keys = Some(got);
        } else {
            out.values = Some(got);
        }
    }
    Ok(out)
}

/// Verifies `candidate` as the learned matrices' gradients of `case` under `config` for the compressed gradients
/// `upstream`: for each operand whose map is a matrix, every element within `compression_bound` (storage f32: the
/// kernel rounds its f64 chain once to f32) of the oracle's `compress_backward` `∂L/∂W` summed over every sequence and
/// KV head, with the magnitude `Σ |x_{c·s+i, j}| |dx̃_{c,k}|` over the same terms and one f64 term per (sequence, head,
/// window). A matrix without a candidate, or a candidate without a matrix, is a shape error.
pub fn verify_map_gradients<T: Storage>(
    case: &Case<T>,
    config: &NsaConfig,
    upstream: &Compressed<T>,
    candidate: &MapGradients,
) -> Result<CompressionVerdict, HarnessError> {
    config.validate()?;
    let spec = &case.spec;
    let f32_rounding = StorageRounding { unit_roundoff: F32_UNIT_ROUNDOFF, subnormal: F32_SUBNORMAL };
    let dense = matches!(spec.layout, Layout::Dense { .. });
    let (l, s) = (config.compress_len, config.compress_stride);
    let mut verdict = CompressionVerdict::default();
    let [_, k_wide, v_wide] = case.widened();
    let operands = [
        ("d_map_keys", &k_wide, &upstream.k, &candidate.keys, &config.compress_keys, spec.head_dim),
        ("d_map_values", &v_wide, &upstream.v, &candidate.values, &config.compress_values, spec.head_dim_v),
    ];
    for (name, wide, up, got, map, cols) in operands {
        let got = match (map, got) {
            (Compression::Linear(_), Some(got)) => got,
            (Compression::Linear(_), None) | (_, Some(_)) => {
                let expected = if matches!(map, Compression::Linear(_)) { vec![l * cols, cols] } else { vec![] };
                let actual = got.as_ref().map_or(vec![], |g| g.shape().to_vec());
                return Err(HarnessError::CandidateShape { argument: name, expected, actual });
            }
            (_, None) => continue,
        };
        if got.dim() != (l * cols, cols) {
            let expected = vec![l * cols, cols];
            return Err(HarnessError::CandidateShape { argument: name, expected, actual: got.shape().to_vec() });
        }
        let (windows, up_shape) = layout(spec, config, cols);
        if up.shape() != up_shape.as_slice() {
            return Err(HarnessError::CandidateShape {
                argument: "upstream",
                expected: up_shape,
                actual: up.shape().to_vec(),
            });
        }
        let up_wide = up.mapv(|x| f64::from(x.to_f32()));
        let up_view = up_wide.view();
        let mut truth = Array2::<f64>::zeros((l * cols, cols));
        let mut magnitude = Array2::<f64>::zeros((l * cols, cols));
        let mut first = 0;
        for (seq, &w) in spec.sequences().iter().zip(&windows) {
            for head in 0..spec.n_heads_kv {
                let x = spec.head_rows(wide.view(), seq, head, true);
                let d_cmp = compressed_rows(&up_view, dense, seq.index, first, w, head);
                if let MapGradient::Linear(dw) = compress_backward(x, map, d_cmp, config, ())?.d_map {
                    truth += &dw;
                }
                for c in 0..w {
                    for ((r, k), m) in magnitude.indexed_iter_mut() {
                        *m += (x[[c * s + r / cols, r % cols]] * d_cmp[[c, k]]).abs();
                    }
                }
            }
            first += w;
        }
        let terms = windows.iter().sum::<usize>() * spec.n_heads_kv;
        for ((r, k), &value) in got.indexed_iter() {
            verdict.elements += 1;
            let where_ = || format!("{name}[{r}, {k}]");
            let exact = (truth[[r, k]], magnitude[[r, k]], terms);
            verdict.judge_rounded(value, |x| x, exact, f32_rounding, where_);
        }
    }
    Ok(verdict)
}

/// How a drawn compression problem's keys and values are made: the storage type's whole range, since E18's sums
/// meet it (a window of values near the largest one, subnormal windows, rows that cancel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompressionValues {
    /// Standard normal.
    Gaussian,
    /// Normal times sixteen of the smallest subnormal: most values subnormal, many zero.
    Tiny,
    /// Normal clipped at ±4 times a quarter of the largest finite value: windows whose sums exceed it.
    NearLargest,
    /// Rows alternating between plus and minus an eighth of the largest value, plus a normal term: sums that
    /// cancel to small results.
    Cancelling,
}

/// How a drawn weighted map's weights are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightKind {
    /// Standard normal.
    Gaussian,
    /// Normal times 2^20 (with [`CompressionValues::NearLargest`], results beyond the largest finite value).
    Large,
    /// Normal times 2^-30.
    Small,
    /// Normal with every third weight zero and every other one negated.
    Mixed,
}

/// A drawn compression problem: a case (its queries play no part) and NSA's configuration.
#[derive(Clone, Debug)]
pub struct CompressionDraw<T> {
    /// Q, K, V and the spec (causal, `Lq = Lk` per sequence).
    pub case: Case<T>,
    /// The window, stride and maps; the other fields are the defaults.
    pub config: NsaConfig,
    /// How K and V were made.
    pub values: CompressionValues,
}

/// The largest finite value of `T`: the bits just below infinity's.
pub fn largest_finite<T: Storage>() -> f32 {
    T::from_bits16(<T as Element>::from_f32(f32::INFINITY).bits() - 1).to_f32()
}

/// `len` weights of `kind`.
fn weight_values(kind: WeightKind, len: usize, seed: u64) -> Vec<f64> {
    let normal = crate::generate::draw(seed, len, crate::generate::Distribution::Gaussian);
    normal
        .iter()
        .enumerate()
        .map(|(i, &x)| match kind {
            WeightKind::Gaussian => x,
            WeightKind::Large => x * 2f64.powi(20),
            WeightKind::Small => x * 2f64.powi(-30),
            WeightKind::Mixed if i % 3 == 0 => 0.0,
            WeightKind::Mixed => {
                if i % 2 == 0 {
                    -x
                } else {
                    x
                }
            }
        })
        .collect()
}

/// A drawn map's shape: E18's mean, position weights, or the learned matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapDraw {
    /// The mean.
    Mean,
    /// `l` position weights of a kind.
    Weights(WeightKind),
    /// A `[l·cols, cols]` matrix of a kind (weights instead where `l·cols²` exceeds [`LARGEST_DRAWN_MATRIX`]).
    Matrix(WeightKind),
}

/// The most entries a drawn matrix has: the paper's `l = 32` at `d = 128`. Larger ones would make the f64 oracle's
/// per-window products the suites' cost; they are drawn as position weights of the same kind instead.
pub const LARGEST_DRAWN_MATRIX: usize = 32 * 128 * 128;

/// The map `draw` for windows of `l` rows of `cols` columns.
pub(crate) fn map_of(draw: MapDraw, l: usize, cols: usize, seed: u64) -> Compression {
    match draw {
        MapDraw::Mean => Compression::Mean,
        MapDraw::Matrix(kind) if l * cols * cols <= LARGEST_DRAWN_MATRIX => {
            let values = weight_values(kind, l * cols * cols, seed);
            Compression::Linear(Array2::from_shape_vec((l * cols, cols), values).expect("l·cols² values"))
        }
        MapDraw::Weights(kind) | MapDraw::Matrix(kind) => Compression::Weighted(weight_values(kind, l, seed)),
    }
}

/// Compression problems: windows `l` of 1, 2, 3, 5, 8, 16, 32 (the paper's) and 64, strides from 1 to `l + 2`
/// (overlapping, adjacent and gapped windows), key lengths of no window, one window exactly, a window ± 1 and a
/// stride ± 1 past it, and a few windows; dense (batch 1–2) or varlen with empty sequences; the GQA heads of
/// [`crate::strategies::heads`]; head dims multiples of 8 up to 256 (small ones often); the mean, weights or a learned
/// matrix ([`MapDraw`]) of every [`WeightKind`] for each of K and V; values of every [`CompressionValues`] kind. Dependent sizes through
/// `prop_flat_map`.
pub fn compression_draws<T: Storage>() -> impl Strategy<Value = CompressionDraw<T>> {
    let dims =
        || prop_oneof![2 => prop::sample::select(vec![8usize, 16, 24, 64]), 1 => (1usize..=32).prop_map(|m| 8 * m)];
    (prop::sample::select(vec![1usize, 2, 3, 5, 8, 16, 32, 32, 64]), 0usize..=2)
        .prop_flat_map(|(l, extra)| (Just(l), 1..=l + extra))
        .prop_flat_map(move |(l, s)| {
            let length =
                prop::sample::select(vec![0, 1, l - 1, l, l + 1, l + s - 1, l + s, l + s + 1, l + 3 * s, 4 * l + 3]);
            let kind = || {
                prop::sample::select(vec![
                    WeightKind::Gaussian,
                    WeightKind::Large,
                    WeightKind::Small,
                    WeightKind::Mixed,
                ])
            };
            let map = prop_oneof![
                2 => Just(MapDraw::Mean),
                1 => kind().prop_map(MapDraw::Weights),
                1 => kind().prop_map(MapDraw::Matrix),
            ];
            let values = prop::sample::select(vec![
                CompressionValues::Gaussian,
                CompressionValues::Tiny,
                CompressionValues::NearLargest,
                CompressionValues::Cancelling,
            ]);
            (
                Just((l, s)),
                self_attention_layout(length),
                crate::strategies::heads(),
                (dims(), dims()),
                (map.clone(), map),
                values,
                any::<u64>(),
            )
        })
        .prop_map(
            |((l, s), layout, (n_heads_q, n_heads_kv), (head_dim, head_dim_v), (key_map, value_map), values, seed)| {
                let spec = causal_layer(layout, (n_heads_q, n_heads_kv), (head_dim, head_dim_v));
                let config = NsaConfig {
                    compress_len: l,
                    compress_stride: s,
                    compress_keys: map_of(key_map, l, head_dim, seed ^ 0x6b),
                    compress_values: map_of(value_map, l, head_dim_v, seed ^ 0x76),
                    ..NsaConfig::default()
                };
                let mut case = crate::generate::make_case::<T>(&spec, crate::generate::ValueProfile::GAUSSIAN, seed);
                shape_values(&mut case, values);
                CompressionDraw { case, config, values }
            },
        )
}

/// An NSA layer's spec: causal self-attention with the default scale.
pub(crate) fn causal_layer(
    layout: Layout,
    (n_heads_q, n_heads_kv): (usize, usize),
    (head_dim, head_dim_v): (usize, usize),
) -> attnproof_oracle::AttentionSpec {
    attnproof_oracle::AttentionSpec {
        layout,
        n_heads_q,
        n_heads_kv,
        head_dim,
        head_dim_v,
        scale: attnproof_oracle::Scale::InverseSqrtHeadDim,
        mask: attnproof_oracle::Mask::Causal,
    }
}

/// Self-attention layouts (`Lq = Lk` per sequence) with lengths from `length`: dense with batch 1–2 three times in
/// four, else varlen of 1–3 sequences, empty ones included.
pub(crate) fn self_attention_layout(length: impl Strategy<Value = usize> + Clone) -> impl Strategy<Value = Layout> {
    let dense = (1usize..=2, length.clone()).prop_map(|(batch, len)| Layout::Dense { batch, len_q: len, len_k: len });
    let varlen = prop::collection::vec(prop_oneof![Just(0usize), length], 1..=3).prop_map(|lens| {
        let mut cu = vec![0i32];
        for len in lens {
            cu.push(cu.last().copied().unwrap_or(0) + len as i32);
        }
        Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu }
    });
    prop_oneof![3 => dense, 1 => varlen]
}

/// Rewrites K and V of `case` (drawn standard normal) into the value kind `values`; [`CompressionValues::Cancelling`]
/// alternates the sign from one token to the next of every head (a token is a row of the dense layout's
/// `[B, Hkv, L, cols]`, a group of `Hkv` rows of the packed `[T, Hkv, cols]`).
fn shape_values<T: Storage>(case: &mut Case<T>, values: CompressionValues) {
    let largest = f64::from(largest_finite::<T>());
    let tiny = f64::from(subnormal_of::<T>()) * 16.0;
    let heads_per_token = if matches!(case.spec.layout, Layout::Dense { .. }) { 1 } else { case.spec.n_heads_kv };
    for (t, cols) in [(&mut case.k, case.spec.head_dim), (&mut case.v, case.spec.head_dim_v)] {
        let token_width = cols * heads_per_token;
        for (i, x) in t.iter_mut().enumerate() {
            let z = f64::from(x.to_f32());
            let y = match values {
                CompressionValues::Gaussian => z,
                CompressionValues::Tiny => z * tiny,
                CompressionValues::NearLargest => z.clamp(-4.0, 4.0) * largest / 4.0,
                CompressionValues::Cancelling => {
                    let sign = if (i / token_width) % 2 == 0 { 1.0 } else { -1.0 };
                    sign * largest / 8.0 + z
                }
            };
            *x = T::from_f32(y as f32);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// The gates (E18): the gated sum of the three branch outputs and its gradients.

/// A drawn gates problem: the spec (O's layout), the three branch outputs and the upstream gradient in O's shape, and
/// the gate logits in O's shape with 3 columns, all in the storage type.
#[derive(Clone, Debug)]
pub struct GateDraw<T> {
    /// The problem whose O layout the operands take (dense or varlen, any heads, `dv` a multiple of 8).
    pub spec: attnproof_oracle::AttentionSpec,
    /// `o_cmp`, `o_slc`, `o_win`.
    pub branches: [ArrayD<T>; 3],
    /// `x` (`[.., 3]`, last axis compressed, selected, window).
    pub gate_logits: ArrayD<T>,
    /// `dO`.
    pub d_out: ArrayD<T>,
}

/// The outcome of a gates verification: elements compared, the worst ratio to the bound, the first failures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GateVerdict {
    /// Elements compared.
    pub elements: usize,
    /// The largest `|got − reference| / bound`.
    pub worst_ratio: f64,
    /// The first failing elements.
    pub failures: Vec<String>,
}

impl GateVerdict {
    /// Every element within its bound.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    fn judge(&mut self, name: &str, index: usize, got: f64, reference: f64, bound: f64) {
        self.elements += 1;
        let ratio = (got - reference).abs() / bound;
        if ratio.is_finite() {
            self.worst_ratio = self.worst_ratio.max(ratio);
        }
        // NaN and infinities fail: the reference and the bound are finite for finite inputs.
        let within = ratio <= 1.0;
        if !within && self.failures.len() < REPORTED {
            self.failures.push(format!("{name}[{index}]: {got:e} against {reference:e} (bound {bound:e})"));
        }
    }
}

/// The rows view `[rows, 1, cols]` of a tensor in O's layout (the gates act row by row, so the oracle's one-sequence
/// functions take every row of every sequence at once).
fn as_rows(t: &ArrayD<f64>) -> ndarray::Array3<f64> {
    let cols = t.shape().last().copied().unwrap_or(0);
    let rows = t.len().checked_div(cols).unwrap_or(0);
    t.as_standard_layout().to_owned().into_shape_with_order((rows, 1, cols)).expect("rows of a standard layout")
}

fn widen<T: Storage>(t: &ArrayD<T>) -> ArrayD<f64> {
    t.mapv(|x| f64::from(x.to_f32()))
}

fn storage_of<T: Storage>() -> StorageRounding {
    StorageRounding { unit_roundoff: T::UNIT_ROUNDOFF, subnormal: f64::from(subnormal_of::<T>()) }
}

/// Verifies `o` as the gated sum of `draw`'s branches (the oracle's `gate_combine` in f64, the bound
/// `gate_combine_bound`).
pub fn verify_gate_combine<T: Storage>(draw: &GateDraw<T>, o: &ArrayD<T>) -> Result<GateVerdict, HarnessError> {
    let shape = draw.spec.expected_shape(Operand::O);
    if o.shape() != shape.as_slice() {
        return Err(HarnessError::CandidateShape { argument: "o", expected: shape, actual: o.shape().to_vec() });
    }
    let b = draw.branches.each_ref().map(|t| as_rows(&widen(t)));
    let x = as_rows(&widen(&draw.gate_logits));
    let (gates, truth) = attnproof_oracle::nsa::gate_combine([b[0].view(), b[1].view(), b[2].view()], x.view(), ())?;
    let got = as_rows(&widen(o));
    let mut verdict = GateVerdict::default();
    for ((r, _, e), &reference) in truth.indexed_iter() {
        let magnitude: f64 = (0..3).map(|k| gates[[r, 0, k]] * b[k][[r, 0, e]].abs()).sum();
        let branch_sum: f64 = (0..3).map(|k| b[k][[r, 0, e]].abs()).sum();
        let bound = gate_combine_bound(reference, magnitude, branch_sum, storage_of::<T>());
        verdict.judge("o", r * truth.dim().2 + e, got[[r, 0, e]], reference, bound);
    }
    Ok(verdict)
}

/// Verifies the gates' gradients (each branch's `dO_b` and the logits' f32 gradients) against the oracle's
/// `gate_combine_backward` in f64 under `gate_branch_gradient_bound` and `gate_logit_gradient_bound`.
pub fn verify_gate_backward<T: Storage>(
    draw: &GateDraw<T>,
    d_branches: &[ArrayD<T>; 3],
    d_gate_logits: &ArrayD<f32>,
) -> Result<GateVerdict, HarnessError> {
    let shape = draw.spec.expected_shape(Operand::O);
    for (argument, t) in
        [("d_compressed", &d_branches[0]), ("d_selected", &d_branches[1]), ("d_window", &d_branches[2])]
    {
        if t.shape() != shape.as_slice() {
            return Err(HarnessError::CandidateShape { argument, expected: shape, actual: t.shape().to_vec() });
        }
    }
    if d_gate_logits.shape() != draw.gate_logits.shape() {
        return Err(HarnessError::CandidateShape {
            argument: "d_gate_logits",
            expected: draw.gate_logits.shape().to_vec(),
            actual: d_gate_logits.shape().to_vec(),
        });
    }
    let b = draw.branches.each_ref().map(|t| as_rows(&widen(t)));
    let x = as_rows(&widen(&draw.gate_logits));
    let dy = as_rows(&widen(&draw.d_out));
    let truth =
        attnproof_oracle::nsa::gate_combine_backward([b[0].view(), b[1].view(), b[2].view()], x.view(), dy.view(), ())?;
    let mut verdict = GateVerdict::default();
    for (k, name) in ["d_compressed", "d_selected", "d_window"].into_iter().enumerate() {
        let got = as_rows(&widen(&d_branches[k]));
        for ((r, _, e), &reference) in truth.d_branches[k].indexed_iter() {
            let bound = gate_branch_gradient_bound(reference, dy[[r, 0, e]].abs(), storage_of::<T>());
            verdict.judge(name, r * dy.dim().2 + e, got[[r, 0, e]], reference, bound);
        }
    }
    let got = as_rows(&d_gate_logits.mapv(f64::from));
    let dv = dy.dim().2;
    for ((r, _, k), &reference) in truth.d_gate_logits.indexed_iter() {
        let sigma = |v: f64| 1.0 / (1.0 + (-v).exp());
        let xv = x[[r, 0, k]];
        let dot: f64 = (0..dv).map(|e| (dy[[r, 0, e]] * b[k][[r, 0, e]]).abs()).sum();
        let bound = gate_logit_gradient_bound(sigma(xv) * sigma(-xv), dot, dv);
        verdict.judge("d_gate_logits", r * 3 + k, got[[r, 0, k]], reference, bound);
    }
    Ok(verdict)
}

/// Gate logits of every range the recipe must survive: small, around ±15 (gates within 1e-7 of 0 and 1), around
/// ±88 (where `expf` overflows or underflows) and beyond, exact zeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRange {
    /// Standard normal.
    Unit,
    /// Normal times 15.
    Wide,
    /// Normal times 60, then clipped at ±100: `expf(±x)` over- and underflows.
    Extreme,
    /// Zeros (every gate 1/2).
    Zero,
}

/// Gates problems: the harness's layouts and heads (dense and varlen with empty sequences), `dv` a multiple of 8 up
/// to 256, branch outputs and `dO` standard normal times 1 or 1000, logits of every [`LogitRange`].
pub fn gate_draws<T: Storage>() -> impl Strategy<Value = GateDraw<T>> {
    let dv = prop_oneof![2 => prop::sample::select(vec![8usize, 16, 64, 128]), 1 => (1usize..=32).prop_map(|m| 8 * m)];
    let range = prop::sample::select(vec![LogitRange::Unit, LogitRange::Wide, LogitRange::Extreme, LogitRange::Zero]);
    (
        crate::strategies::layout(64),
        crate::strategies::heads(),
        dv,
        range,
        prop::sample::select(vec![1.0f64, 1000.0]),
        any::<u64>(),
    )
        .prop_map(|(layout, (n_heads_q, n_heads_kv), head_dim_v, range, scale, seed)| {
            let spec = attnproof_oracle::AttentionSpec {
                layout,
                n_heads_q,
                n_heads_kv,
                head_dim: 8,
                head_dim_v,
                scale: attnproof_oracle::Scale::InverseSqrtHeadDim,
                mask: attnproof_oracle::Mask::Causal,
            };
            let o_shape = spec.expected_shape(Operand::O);
            let mut x_shape = o_shape.clone();
            if let Some(last) = x_shape.last_mut() {
                *last = 3;
            }
            let tensor = |shape: &[usize], salt: u64, f: &dyn Fn(f64) -> f64| {
                let n = shape.iter().product();
                let values = crate::generate::draw(seed ^ salt, n, crate::generate::Distribution::Gaussian);
                ArrayD::from_shape_vec(IxDyn(shape), values.into_iter().map(|v| T::from_f32(f(v) as f32)).collect())
                    .expect("sizes agree")
            };
            let logit = move |v: f64| match range {
                LogitRange::Unit => v,
                LogitRange::Wide => 15.0 * v,
                LogitRange::Extreme => (60.0 * v).clamp(-100.0, 100.0),
                LogitRange::Zero => 0.0,
            };
            GateDraw {
                branches: [1u64, 2, 3].map(|salt| tensor(&o_shape, salt, &|v| v * scale)),
                gate_logits: tensor(&x_shape, 4, &logit),
                d_out: tensor(&o_shape, 5, &|v| v * scale),
                spec,
            }
        })
}

/// What one guarded run of the gates' kernels returns: `O`, each branch's `dO_b`, the logits' gradients.
pub type GateRun<T> = (ArrayD<T>, [ArrayD<T>; 3], ArrayD<f32>);

/// Launches of the gates' kernel text `kernel` on `draw` through the GPU wrappers, into NaN-poisoned outputs followed
/// by guard bands; checks the guards and that the inputs are unchanged on the device. Returns `O`, then the
/// gradients (`dO_b` and the logits').
pub fn gates_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    draw: &GateDraw<T>,
    kernel: KernelSource,
) -> Result<GateRun<T>, LaunchError> {
    use attnproof_gpu::nsa::gates::{GateBranches, GateGradientsDevice, gate_backward_device, gate_combine_device};
    let spec = &draw.spec;
    let [c, s, w] =
        [upload(stream, &draw.branches[0])?, upload(stream, &draw.branches[1])?, upload(stream, &draw.branches[2])?];
    let (x, dy) = (upload(stream, &draw.gate_logits)?, upload(stream, &draw.d_out)?);
    let o_shape = spec.expected_shape(Operand::O);
    let (n, nx) = (o_shape.iter().product::<usize>(), draw.gate_logits.len());
    let (nan, guard) = (<T as Element>::from_f32(f32::NAN), T::from_bits16(GUARD_BITS_16));
    let branches = GateBranches { compressed: &c, selected: &s, window: &w };
    let mut o = poisoned(stream, n, nan, guard)?;
    gate_combine_device(stream, spec, kernel, branches, &x, &mut o)?;
    let (mut dc, mut ds, mut dw) =
        (poisoned(stream, n, nan, guard)?, poisoned(stream, n, nan, guard)?, poisoned(stream, n, nan, guard)?);
    let guard32 = f32::from_bits(crate::candidate::GUARD_BITS_32);
    let mut dx = poisoned(stream, nx, f32::NAN, guard32)?;
    let grads =
        GateGradientsDevice { d_compressed: &mut dc, d_selected: &mut ds, d_window: &mut dw, d_gate_logits: &mut dx };
    gate_backward_device(stream, spec, kernel, branches, &x, &dy, grads)?;
    let driver = |e: cudarc::driver::DriverError| LaunchError::Driver(e.to_string());
    let down = |b: &cudarc::driver::CudaSlice<T>| stream.clone_dtoh(b).map_err(driver);
    let backs = [down(&o)?, down(&dc)?, down(&ds)?, down(&dw)?];
    let dx_back = stream.clone_dtoh(&dx).map_err(driver)?;
    let inputs_back = [down(&c)?, down(&s)?, down(&w)?, down(&x)?, down(&dy)?];
    stream.synchronize().map_err(driver)?;
    unchanged(
        &[
            ("o_cmp", &draw.branches[0]),
            ("o_slc", &draw.branches[1]),
            ("o_win", &draw.branches[2]),
            ("gate_logits", &draw.gate_logits),
            ("d_out", &draw.d_out),
        ],
        &inputs_back,
    )?;
    let intact = |v: T| v.bits() == GUARD_BITS_16;
    let [o_back, dc_back, ds_back, dw_back] = backs;
    let d_gate_logits = unguard("d_gate_logits", dx_back, nx, draw.gate_logits.shape(), |v: f32| {
        v.to_bits() == crate::candidate::GUARD_BITS_32
    })?;
    Ok((
        unguard("o", o_back, n, &o_shape, intact)?,
        [
            unguard("d_compressed", dc_back, n, &o_shape, intact)?,
            unguard("d_selected", ds_back, n, &o_shape, intact)?,
            unguard("d_window", dw_back, n, &o_shape, intact)?,
        ],
        d_gate_logits,
    ))
}

/// A drawn NSA layer for the compressed attention (E18): the layer's spec (causal self-attention), NSA's
/// configuration (window and stride; the mean for both maps), the value profile and seed of its Q, K and V.
#[derive(Clone, Debug)]
pub struct CompressedAttentionDraw {
    /// The layer: causal, `Lq = Lk` per sequence.
    pub layer: attnproof_oracle::AttentionSpec,
    /// The window `l` and stride `s`; the other fields are the defaults.
    pub config: NsaConfig,
    /// How Q, K and V are made.
    pub profile: crate::generate::ValueProfile,
    /// Their seed.
    pub seed: u64,
}

/// Layers for the compressed attention: the paper's windows (`l = 32, s = 16`), fla-core's non-overlapping 64-token
/// blocks, adjacent, gapped and overlapping short ones and stride 1; lengths with no complete window, exactly one, a
/// stride past it, around the kernels' 64-row tiles, a few hundred tokens, and enough for 66 windows; dense (batch
/// 1–2) or varlen with empty sequences; GQA groups 1–16, uniformly, over one or two KV heads; the head dims
/// (64, 128, and 192 with `dv = 128` as in E31) and any multiple of 8; every value profile, logit scales up to 100.
pub fn compressed_attention_draws() -> impl Strategy<Value = CompressedAttentionDraw> {
    let windows =
        prop::sample::select(vec![(32usize, 16usize), (32, 16), (64, 64), (16, 16), (8, 4), (5, 3), (3, 5), (4, 1)]);
    let dims = prop_oneof![
        3 => prop::sample::select(vec![(64usize, 64usize), (128, 128), (192, 128)]),
        1 => ((1usize..=32).prop_map(|m| 8 * m), (1usize..=32).prop_map(|m| 8 * m)),
    ];
    (windows, dims)
        .prop_flat_map(|((l, s), dims)| {
            // `65·s + l` tokens make 66 windows: compressed keys past one 64-key tile.
            let length = prop::sample::select(vec![0, 1, l - 1, l, l + s, 63, 64, 65, 129, 4 * l + 3, 300, 65 * s + l]);
            (
                Just(((l, s), dims)),
                self_attention_layout(length),
                // Every group size equally often: NSA's own is 16, and the kernels must take every other.
                (1usize..=16, 1usize..=2).prop_map(|(group, n_heads_kv)| (group * n_heads_kv, n_heads_kv)),
                crate::strategies::profile(),
                any::<u64>(),
            )
        })
        .prop_map(|(((l, s), (head_dim, head_dim_v)), layout, (n_heads_q, n_heads_kv), profile, seed)| {
            let layer = causal_layer(layout, (n_heads_q, n_heads_kv), (head_dim, head_dim_v));
            let config = NsaConfig { compress_len: l, compress_stride: s, ..NsaConfig::default() };
            CompressedAttentionDraw { layer, config, profile, seed }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::{AttentionSpec, Mask};
    use half::bf16;

    /// The transpose's verifier accepts the oracle's `∂L/∂x` rounded to bf16 (mean keys, weighted values, the paper's
    /// overlapping windows and a tail no window holds), and rejects it shifted by one token, with the mean divided by
    /// the stride instead of the window, and with a window's weight taken from the other end.
    #[test]
    fn the_transpose_verifier_accepts_the_oracle_and_rejects_shifted_scaled_or_mirrored_sums() {
        let spec = AttentionSpec::dense(1, 2, 2, 100, 100, 16, 8).with_mask(Mask::Causal);
        let case = crate::generate::make_case::<bf16>(&spec, crate::generate::ValueProfile::GAUSSIAN, 7);
        let weights: Vec<f64> = (0..32).map(|i| 0.25 + i as f64 / 7.0).collect();
        let config = NsaConfig { compress_values: Compression::Weighted(weights.clone()), ..NsaConfig::default() };
        let upstream = upstream_of(&reference_compression(&case, &config).unwrap());
        let up_k = upstream.k.mapv(|x| f64::from(x.to_f32()));
        let up_v = upstream.v.mapv(|x| f64::from(x.to_f32()));
        // The oracle's transpose of both operands with the maps `maps`, then `edit` on each token row, rounded.
        let candidate = |maps: [&Compression; 2], edit: &dyn Fn(usize, usize) -> usize, scale: f64| {
            let mut out = TokenGradients { dk: case.k.mapv(|_| bf16::ZERO), dv: case.v.mapv(|_| bf16::ZERO) };
            for (up, map, target) in [(&up_k, maps[0], &mut out.dk), (&up_v, maps[1], &mut out.dv)] {
                for head in 0..2 {
                    let d_cmp = up.index_axis(Axis(0), 0).index_axis_move(Axis(0), head);
                    let d_cmp = d_cmp.into_dimensionality::<ndarray::Ix2>().unwrap();
                    let x = Array2::<f64>::zeros((100, d_cmp.ncols()));
                    let dx = compress_backward(x.view(), map, d_cmp, &config, ()).unwrap().dx;
                    let mut rows = target.index_axis_mut(Axis(0), 0);
                    let mut rows = rows.index_axis_mut(Axis(0), head);
                    for t in 0..100 {
                        for c in 0..dx.ncols() {
                            rows[[t, c]] = bf16::from_f64(scale * dx[[edit(t, 100), c]]);
                        }
                    }
                }
            }
            verify_compression_backward(&case, &config, &upstream, &out).unwrap()
        };
        let maps = [&config.compress_keys, &config.compress_values];
        let exact = candidate(maps, &|t, _| t, 1.0);
        assert!(exact.passed() && exact.elements == 2 * 100 * (16 + 8), "{:?}", exact.failures);
        assert!(!candidate(maps, &|t, len| (t + 1).min(len - 1), 1.0).passed(), "shifted by a token");
        assert!(!candidate(maps, &|t, _| t, 2.0).passed(), "the mean over s = 16 instead of l = 32");
        let mirrored = Compression::Weighted(weights.iter().rev().copied().collect());
        assert!(!candidate([maps[0], &mirrored], &|t, _| t, 1.0).passed(), "weights from the window's other end");
    }

    /// The transpose's verifier applies exactly the documented bound where cancellation makes the magnitude term
    /// dominate. Two sequences of 8 tokens, `l = 4`, `s = 2` (three windows each); the upstream gradient of window `c`
    /// is `±A·2^j` in column `j` (`A = 2^100`), its sign alternating by window and flipped in the second sequence, so
    /// every token in two windows sums to 0 under each map drawn here: the mean, position weights `w_0 = w_2`,
    /// `w_1 = w_3`, and the stacked identity `[I; I; I; I]`. The bound at such a token is then all f64 evaluation
    /// error, `compression_bound(0, m, terms, bf16)` with `m = (w_0 + w_2)·8A` in column 3 and `terms = ⌈l/s⌉ + 1 = 3`
    /// (`⌈l/s⌉·d + 1 = 17` for the matrix, `d` products per window). An error of 0.98 of it passes and 1.02 of it
    /// fails, at token 2 (first window 0) and token 4 (first window `(t − l + s)/s = 1`) of both sequences: a verifier
    /// that counted other terms, took other windows, weighed them otherwise, read another row of the matrix or
    /// another sequence's windows would let the second pass or fail the first.
    #[test]
    fn the_transpose_verifier_holds_cancelling_sums_to_the_documented_bound() {
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 8, 16], cu_seqlens_k: vec![0, 8, 16] },
            ..AttentionSpec::dense(1, 1, 1, 1, 1, 8, 8).with_mask(Mask::Causal)
        };
        let case = crate::generate::make_case::<bf16>(&spec, crate::generate::ValueProfile::GAUSSIAN, 3);
        let a = f64::from(2f32.powi(100));
        // Packed windows [6, 1, 8]: rows 0..3 the first sequence's, 3..6 the second's.
        let sign = |c: usize| if (c % 3 == 1) != (c >= 3) { -1.0 } else { 1.0 };
        let k = ArrayD::from_shape_fn(IxDyn(&[6, 1, 8]), |i| bf16::from_f64(sign(i[0]) * a * 2f64.powi(i[2] as i32)));
        let upstream = Compressed { k, v: ArrayD::from_elem(IxDyn(&[6, 1, 8]), bf16::ZERO) };
        let up = upstream.k.mapv(|x| f64::from(x.to_f32()));
        let storage =
            StorageRounding { unit_roundoff: bf16::UNIT_ROUNDOFF, subnormal: f64::from(subnormal_of::<bf16>()) };
        let identity = Array2::from_shape_fn((4 * 8, 8), |(r, c)| if r % 8 == c { 1.0 } else { 0.0 });
        let maps = [
            (Compression::Mean, 0.25, 3),
            (Compression::Weighted(vec![0.5, 1.5, 0.5, 1.5]), 0.5, 3),
            (Compression::Linear(identity), 1.0, 2 * 8 + 1),
        ];
        for (map, w0, terms) in maps {
            let config = NsaConfig { compress_len: 4, compress_stride: 2, compress_keys: map, ..NsaConfig::default() };
            // The oracle's transpose of each sequence, rounded: exact but for the perturbed element.
            let mut truth = ArrayD::from_elem(IxDyn(&[16, 1, 8]), bf16::ZERO);
            for seq in 0..2 {
                let rows = up.slice_axis(Axis(0), Slice::from(3 * seq..3 * seq + 3)).index_axis_move(Axis(1), 0);
                let d_cmp = rows.into_dimensionality::<ndarray::Ix2>().unwrap();
                let x = Array2::<f64>::zeros((8, 8));
                let dx = compress_backward(x.view(), &config.compress_keys, d_cmp, &config, ()).unwrap().dx;
                for ((t, j), &v) in dx.indexed_iter() {
                    truth[[8 * seq + t, 0, j]] = bf16::from_f64(v);
                }
            }
            let bound = compression_bound(0.0, 2.0 * w0 * 8.0 * a, terms, storage);
            assert!(bound > 2f64.powi(40), "the f64 term dominates: {bound:e}");
            for (seq, token) in [(0, 2), (0, 4), (1, 2), (1, 4)] {
                let verify = |error: f64| {
                    let mut dk = truth.clone();
                    dk[[8 * seq + token, 0, 3]] = bf16::from_f64(error);
                    let candidate = TokenGradients { dk, dv: ArrayD::from_elem(IxDyn(&[16, 1, 8]), bf16::ZERO) };
                    verify_compression_backward(&case, &config, &upstream, &candidate).unwrap()
                };
                let what = format!("sequence {seq}, token {token}, {terms} terms");
                let within = verify(0.98 * bound);
                assert!(within.passed(), "{what}: {:?}", within.failures);
                assert!(within.worst_ratio > 0.97 && within.worst_ratio < 1.0, "{what}: {}", within.worst_ratio);
                assert!(within.elements == 2 * 16 * 8, "{what}: {} elements", within.elements);
                assert!(!verify(1.02 * bound).passed(), "{what}");
                assert!(!verify(-1.02 * bound).passed(), "{what}");
            }
        }
    }

    /// The matrix gradient's verifier applies exactly the documented bound where the gradient cancels: `l = 4`,
    /// `s = 2`, six tokens (two windows), keys `+A, +A, −A, −A, +A, +A` by token and upstream gradients `A` (`A = 2^40`),
    /// so `∂L/∂W[i·d + j, k] = x_{i,j} A + x_{2+i,j} A = 0` over a magnitude of `2A²` and two terms; an error of 0.98
    /// of `compression_bound(0, 2A², 2, f32)` passes and 1.02 of it fails.
    #[test]
    fn the_map_gradient_verifier_holds_cancelling_sums_to_the_documented_bound() {
        let spec = AttentionSpec::dense(1, 1, 1, 6, 6, 8, 8).with_mask(Mask::Causal);
        let mut case = crate::generate::make_case::<bf16>(&spec, crate::generate::ValueProfile::GAUSSIAN, 5);
        let a = 2f64.powi(40);
        case.k = ArrayD::from_shape_fn(IxDyn(&[1, 1, 6, 8]), |i| {
            bf16::from_f64(if (2..4).contains(&i[2]) { -a } else { a })
        });
        let matrix = Compression::Linear(Array2::from_elem((4 * 8, 8), 0.5));
        let config = NsaConfig { compress_len: 4, compress_stride: 2, compress_keys: matrix, ..NsaConfig::default() };
        let upstream = Compressed {
            k: ArrayD::from_elem(IxDyn(&[1, 1, 2, 8]), bf16::from_f64(a)),
            v: ArrayD::from_elem(IxDyn(&[1, 1, 2, 8]), bf16::ZERO),
        };
        let f32_rounding = StorageRounding { unit_roundoff: F32_UNIT_ROUNDOFF, subnormal: F32_SUBNORMAL };
        let bound = compression_bound(0.0, 2.0 * a * a, 2, f32_rounding);
        assert!(bound > 1.0 && bound < f64::from(f32::MAX), "the f64 term dominates, in f32's range: {bound:e}");
        let verify = |error: f64| {
            let mut keys = Array2::<f32>::zeros((32, 8));
            keys[[11, 5]] = error as f32;
            verify_map_gradients(&case, &config, &upstream, &MapGradients { keys: Some(keys), values: None }).unwrap()
        };
        let within = verify(0.98 * bound);
        assert!(within.passed() && within.elements == 32 * 8, "{:?}", within.failures);
        assert!(within.worst_ratio > 0.97 && within.worst_ratio < 1.0, "{}", within.worst_ratio);
        assert!(!verify(1.02 * bound).passed());
        assert!(!verify(-1.02 * bound).passed());
    }

    /// The matrix gradient's verifier accepts the oracle's `∂L/∂W` summed over sequences and heads, rounded to f32
    /// (varlen, two KV heads, matrices on both operands), and rejects the sum over the first head only, the last
    /// sequence dropped, a transposed matrix, a missing candidate and a candidate for the mean.
    #[test]
    fn the_map_gradient_verifier_accepts_the_oracle_and_rejects_partial_sums() {
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 13, 13, 30], cu_seqlens_k: vec![0, 13, 13, 30] },
            ..AttentionSpec::dense(1, 4, 2, 1, 1, 8, 8).with_mask(Mask::Causal)
        };
        let case = crate::generate::make_case::<bf16>(&spec, crate::generate::ValueProfile::GAUSSIAN, 11);
        let matrix = |seed| map_of(MapDraw::Matrix(WeightKind::Gaussian), 4, 8, seed);
        let config = NsaConfig {
            compress_len: 4,
            compress_stride: 2,
            compress_keys: matrix(1),
            compress_values: matrix(2),
            ..NsaConfig::default()
        };
        let upstream = upstream_of(&reference_compression(&case, &config).unwrap());
        let [_, k_wide, v_wide] = case.widened();
        let (up_k, up_v) = (upstream.k.mapv(|x| f64::from(x.to_f32())), upstream.v.mapv(|x| f64::from(x.to_f32())));
        // The oracle's gradient over the sequences in `seqs` and the heads in `heads`, as f32.
        let sum = |wide: &ArrayD<f64>, up: &ArrayD<f64>, map: &Compression, seqs: usize, heads: usize| {
            let mut total = Array2::<f64>::zeros((32, 8));
            let (windows, _) = layout(&spec, &config, 8);
            let (mut first, up) = (0, up.view());
            for (seq, &w) in spec.sequences().iter().zip(&windows).take(seqs) {
                for head in 0..heads {
                    let x = spec.head_rows(wide.view(), seq, head, true);
                    let d_cmp = compressed_rows(&up, false, seq.index, first, w, head);
                    if let MapGradient::Linear(dw) = compress_backward(x, map, d_cmp, &config, ()).unwrap().d_map {
                        total += &dw;
                    }
                }
                first += w;
            }
            total.mapv(|x| x as f32)
        };
        let of = |seqs, heads| MapGradients {
            keys: Some(sum(&k_wide, &up_k, &config.compress_keys, seqs, heads)),
            values: Some(sum(&v_wide, &up_v, &config.compress_values, seqs, heads)),
        };
        let verify = |candidate: &MapGradients| verify_map_gradients(&case, &config, &upstream, candidate);
        let exact = verify(&of(3, 2)).unwrap();
        assert!(exact.passed() && exact.elements == 2 * 32 * 8, "{:?}", exact.failures);
        assert!(!verify(&of(3, 1)).unwrap().passed(), "the first head only");
        assert!(!verify(&of(2, 2)).unwrap().passed(), "the last sequence dropped");
        let mut transposed = of(3, 2);
        let keys = transposed.keys.as_mut().unwrap();
        for r in 0..8 {
            for k in 0..r {
                let (a, b) = (keys[[r, k]], keys[[k, r]]);
                keys[[r, k]] = b;
                keys[[k, r]] = a;
            }
        }
        assert!(!verify(&transposed).unwrap().passed(), "the first 8 rows transposed");
        let missing = MapGradients { values: None, ..of(3, 2) };
        assert!(matches!(verify(&missing), Err(HarnessError::CandidateShape { argument: "d_map_values", .. })));
        let mean = NsaConfig { compress_keys: Compression::Mean, ..config.clone() };
        let err = verify_map_gradients(&case, &mean, &upstream, &of(3, 2));
        assert!(matches!(err, Err(HarnessError::CandidateShape { argument: "d_map_keys", .. })), "{err:?}");
    }

    /// `judge` holds a finite value to the bound as a ratio (an error of half the bound passes, of twice the bound
    /// fails, at magnitudes where the bound is far from 1; a storage rounding of 5 % makes the bound wider than
    /// bf16's spacing), reports at most `REPORTED` failures, and takes an infinity only where the exact value rounds
    /// to it.
    #[test]
    fn judge_compares_error_over_bound_caps_its_report_and_reads_infinities() {
        let storage = StorageRounding { unit_roundoff: 0.05, subnormal: 0.0 };
        let judged = |value: bf16, y: f64| {
            let mut verdict = CompressionVerdict::default();
            verdict.judge(value, (y, y, 3), storage, || "x".into());
            verdict
        };
        for y in [1e-3, 1e3] {
            let b = compression_bound(y, y, 3, storage);
            let near = bf16::from_f64(y + 0.5 * b);
            let verdict = judged(near, y);
            let ratio = (near.to_f64() - y).abs() / b;
            assert!(verdict.passed() && (verdict.worst_ratio - ratio).abs() < 1e-9, "half the bound at {y}");
            assert!(ratio > 0.3 && ratio < 0.7, "the test's value at {y}: ratio {ratio}");
            assert!(!judged(bf16::from_f64(y + 2.0 * b), y).passed(), "twice the bound at {y}");
        }
        let mut verdict = CompressionVerdict::default();
        for _ in 0..REPORTED + 3 {
            verdict.judge(bf16::from_f32(2.0), (1.0, 1.0, 3), storage, || "x".into());
        }
        assert_eq!(verdict.failures.len(), REPORTED);
        assert!(judged(bf16::INFINITY, 1e39).passed(), "an exact value past the storage type's range");
        assert!(!judged(bf16::INFINITY, 1e30).passed(), "an exact value bf16 holds");
    }
}
