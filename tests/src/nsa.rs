//! Verifying NSA's compressed keys and values (E18) against the oracle (`oracle::nsa::compress` in f64) within the
//! derived bound (`attnproof_proofs::nsa_bound::compression_bound`), and against the recipe's CPU reference
//! (`attnproof_reference::sparse::nsa::compress_head`) bit for bit: the recipe fixes every operation and its order, so
//! a kernel that follows it has no freedom left, and one that deviates (a sum in f32, another order) is caught even
//! where the bound, dominated by the storage rounding, would let it pass.
//!
//! The compressed layout is the verifier's own reading of E18 (the oracle's `complete_windows` per sequence): dense
//! `[B, Hkv, W, cols]`, varlen `[ΣW_b, Hkv, cols]` with sequence `b` from row `ΣW_{<b}` on. [`compress_guarded`]
//! launches a kernel text through the GPU wrapper with NaN-poisoned, guarded outputs.

use std::sync::Arc;

use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::nsa::compress::compress_kv_device;
use attnproof_oracle::nsa::{Compression, NsaConfig, complete_windows, compress};
use attnproof_oracle::spec::Layout;
use attnproof_proofs::nsa_bound::{StorageRounding, compression_bound, f64_evaluation_error};
use attnproof_reference::Element;
use attnproof_reference::sparse::nsa::compress_head;
use cudarc::driver::CudaStream;
use ndarray::{Array2, ArrayD, ArrayView2, ArrayViewD, Axis, Dimension, IxDyn, Slice};
use proptest::prelude::*;

use crate::candidate::{GUARD_BITS_16, LaunchError, Storage, poisoned, unchanged, unguard, upload};
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
                    let bound = compression_bound(y, m, config.compress_len, storage);
                    let v = f64::from(value.to_f32());
                    let where_ = || format!("{name}[sequence {}, head {head}, window {c}, column {col}]", seq.index);
                    let within = if v.is_infinite() {
                        // Right only where every value the exact result may have (the oracle's within its f64
                        // evaluation error of it) rounds through f32 to the same infinity.
                        let least = (y.abs() - 2.0 * f64_evaluation_error(m, config.compress_len)).max(0.0).copysign(y);
                        T::from_f32(least as f32).to_f32() == value.to_f32()
                    } else {
                        let ratio = (v - y).abs() / bound;
                        if ratio.is_finite() {
                            verdict.worst_ratio = verdict.worst_ratio.max(ratio);
                        }
                        ratio <= 1.0
                    };
                    if !within && verdict.failures.len() < REPORTED {
                        verdict.failures.push(format!("{}: {v:e} against {y:e} (bound {bound:e})", where_()));
                    }
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

/// The bound's magnitude per element: `Σ|x_i| / l` for the mean, `Σ|w_i x_i|` for weights.
fn magnitudes(x: ArrayView2<'_, f64>, map: &Compression, config: &NsaConfig, windows: usize) -> Array2<f64> {
    Array2::from_shape_fn((windows, x.ncols()), |(c, col)| {
        let rows = c * config.compress_stride..c * config.compress_stride + config.compress_len;
        match map {
            Compression::Mean => rows.map(|i| x[[i, col]].abs()).sum::<f64>() / config.compress_len as f64,
            Compression::Weighted(w) => rows.zip(w).map(|(i, w)| (w * x[[i, col]]).abs()).sum(),
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
    let (k, v) = (upload(stream, &case.k)?, upload(stream, &case.v)?);
    let (_, k_shape) = layout(spec, config, spec.head_dim);
    let (_, v_shape) = layout(spec, config, spec.head_dim_v);
    let (k_len, v_len) = (k_shape.iter().product::<usize>(), v_shape.iter().product::<usize>());
    let (nan, guard) = (<T as Element>::from_f32(f32::NAN), T::from_bits16(GUARD_BITS_16));
    let mut k_cmp = poisoned(stream, k_len, nan, guard)?;
    let mut v_cmp = poisoned(stream, v_len, nan, guard)?;
    compress_kv_device(stream, spec, config, kernel, &k, &v, &mut k_cmp, &mut v_cmp)?;
    let driver = |e: cudarc::driver::DriverError| LaunchError::Driver(e.to_string());
    let (k_back, v_back) = (stream.clone_dtoh(&k_cmp).map_err(driver)?, stream.clone_dtoh(&v_cmp).map_err(driver)?);
    let inputs_back = [stream.clone_dtoh(&k).map_err(driver)?, stream.clone_dtoh(&v).map_err(driver)?];
    stream.synchronize().map_err(driver)?;
    unchanged(&[("k", &case.k), ("v", &case.v)], &inputs_back)?;
    let intact = |x: T| x.bits() == GUARD_BITS_16;
    Ok(Compressed {
        k: unguard("k_cmp", k_back, k_len, &k_shape, intact)?,
        v: unguard("v_cmp", v_back, v_len, &v_shape, intact)?,
    })
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

fn weights(kind: WeightKind, len: usize, seed: u64) -> Compression {
    let normal = crate::generate::draw(seed, len, crate::generate::Distribution::Gaussian);
    Compression::Weighted(
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
            .collect(),
    )
}

/// Compression problems: windows `l` of 1, 2, 3, 5, 8, 16, 32 (the paper's) and 64, strides from 1 to `l + 2`
/// (overlapping, adjacent and gapped windows), key lengths of no window, one window exactly, a window ± 1 and a
/// stride ± 1 past it, and a few windows; dense (batch 1–2) or varlen with empty sequences; the GQA heads of
/// [`crate::strategies::heads`]; head dims multiples of 8 up to 256 (small ones often); the mean or weights of every
/// [`WeightKind`] for each of K and V; values of every [`CompressionValues`] kind. Dependent sizes through
/// `prop_flat_map`.
pub fn compression_draws<T: Storage>() -> impl Strategy<Value = CompressionDraw<T>> {
    let dims =
        || prop_oneof![2 => prop::sample::select(vec![8usize, 16, 24, 64]), 1 => (1usize..=32).prop_map(|m| 8 * m)];
    (prop::sample::select(vec![1usize, 2, 3, 5, 8, 16, 32, 32, 64]), 0usize..=2)
        .prop_flat_map(|(l, extra)| (Just(l), 1..=l + extra))
        .prop_flat_map(move |(l, s)| {
            let length = prop::sample::select(vec![0, 1, l - 1, l, l + 1, l + s - 1, l + s, l + s + 1, l + 3 * s, 4 * l + 3]);
            let dense = (1usize..=2, length.clone()).prop_map(|(batch, len)| Layout::Dense { batch, len_q: len, len_k: len });
            let varlen = prop::collection::vec(prop_oneof![Just(0usize), length], 1..=3).prop_map(|lens| {
                let mut cu = vec![0i32];
                for len in lens {
                    cu.push(cu.last().copied().unwrap_or(0) + len as i32);
                }
                Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu }
            });
            let map = prop_oneof![
                2 => Just(None),
                1 => prop::sample::select(vec![WeightKind::Gaussian, WeightKind::Large, WeightKind::Small, WeightKind::Mixed]).prop_map(Some),
            ];
            let values = prop::sample::select(vec![
                CompressionValues::Gaussian,
                CompressionValues::Tiny,
                CompressionValues::NearLargest,
                CompressionValues::Cancelling,
            ]);
            (
                Just((l, s)),
                prop_oneof![3 => dense, 1 => varlen],
                crate::strategies::heads(),
                (dims(), dims()),
                (map.clone(), map),
                values,
                any::<u64>(),
            )
        })
        .prop_map(|((l, s), layout, (n_heads_q, n_heads_kv), (head_dim, head_dim_v), (key_map, value_map), values, seed)| {
            let spec = attnproof_oracle::AttentionSpec {
                layout,
                n_heads_q,
                n_heads_kv,
                head_dim,
                head_dim_v,
                scale: attnproof_oracle::Scale::InverseSqrtHeadDim,
                mask: attnproof_oracle::Mask::Causal,
            };
            let map_of = |kind: Option<WeightKind>, salt| kind.map_or(Compression::Mean, |k| weights(k, l, seed ^ salt));
            let config = NsaConfig {
                compress_len: l,
                compress_stride: s,
                compress_keys: map_of(key_map, 0x6b),
                compress_values: map_of(value_map, 0x76),
                ..NsaConfig::default()
            };
            let mut case = crate::generate::make_case::<T>(&spec, crate::generate::ValueProfile::GAUSSIAN, seed);
            shape_values(&mut case, values);
            CompressionDraw { case, config, values }
        })
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
