//! NSA's compression kernel (`attnproof_gpu::nsa::compress`, `gpu/kernels/nsa_compress.cu`) against the oracle's E18
//! (`oracle::nsa::compress`) through `attnproof_harness::nsa`: every compressed element within the derived bound of the
//! oracle's value and equal, bit for bit, to the recipe's CPU reference, with NaN-poisoned and guarded outputs and K,
//! V checked unchanged on the device; each draw runs twice and must give the same bits. Every draw and killing case
//! then runs the pooling's transpose (the backward's `∂L/∂x`, `compress_kv_backward_device`) on the forward's own
//! outputs made finite, twice, within the bound of the oracle's `compress_backward`, and, for a learned matrix, its own
//! gradient (`compress_map_gradient_device`) within the bound of the oracle's `∂L/∂W` summed over sequences and heads.
//!
//! The property suites draw the harness's compression problems (`compression_draws`: windows of 1 to 64 tokens with
//! overlapping, adjacent and gapped strides, lengths with no window, one window and a window or stride ± 1, dense and
//! varlen with empty sequences, head dims up to 256, the mean, every kind of weights and learned matrices, values over the storage
//! type's whole range up to results past its largest finite value). Without a device each test prints
//! `skipped: no CUDA device` and passes.

use std::sync::Arc;

use crate::common::*;
use crate::property::{default_run_config, run_typed_production};
use attnproof_gpu::GpuError;
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::nsa::compress::{
    NSA_COMPRESS, compress_kv, compress_kv_device, compress_map_gradient_device, compressed_shape,
};
use attnproof_harness::Case;
use attnproof_harness::generate::make_case;
use attnproof_harness::nsa::{
    Compressed, CompressionDraw, compress_backward_guarded, compress_guarded, compression_draws, largest_finite,
    map_gradients_guarded, upstream_of, verify_compression, verify_compression_backward, verify_map_gradients,
};
use attnproof_oracle::nsa::{Compression, NsaConfig};
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Mask};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::ArrayD;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

/// The two suites ("gpunsac" in ASCII, plus the dtype).
pub const COMPRESSION_SUITES: [TypedSuite; 2] = [
    TypedSuite { name: "gpu_nsa_compress_bf16", bf16: true, cases: 64, seed: 0x6770_756e_7361_6301 },
    TypedSuite { name: "gpu_nsa_compress_f16", bf16: false, cases: 64, seed: 0x6770_756e_7361_6302 },
];

/// Runs a compression suite's draws under `config` through the compression kernel text `kernel` on `stream`; a
/// failing draw comes back described (spec, configuration, value kind).
pub fn run_compression_suite(
    suite: &TypedSuite,
    config: Config,
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
) -> Result<(), Box<TestError<String>>> {
    fn describe<T>(d: &CompressionDraw<T>) -> String {
        format!("{:?} {:?} {:?}", d.case.spec, d.config, d.values)
    }
    if suite.bf16 {
        run_described(config, compression_draws::<bf16>(), |d| check_draw(stream, kernel, d), describe)
    } else {
        run_described(config, compression_draws::<f16>(), |d| check_draw(stream, kernel, d), describe)
    }
}

/// One draw: two guarded launches (the same bits), then the verdict.
fn check_draw<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    draw: &CompressionDraw<T>,
) -> Result<(), TestCaseError> {
    let fail = |e: &dyn std::fmt::Display| TestCaseError::fail(e.to_string());
    let first = compress_guarded(stream, &draw.case, &draw.config, kernel).map_err(|e| fail(&e))?;
    let again = compress_guarded(stream, &draw.case, &draw.config, kernel).map_err(|e| fail(&e))?;
    let bits = |t: &ArrayD<T>| t.iter().map(|x| x.bits()).collect::<Vec<_>>();
    if bits(&first.k) != bits(&again.k) || bits(&first.v) != bits(&again.v) {
        return Err(TestCaseError::fail("the same input gave different bits"));
    }
    let verdict = verify_compression(&draw.case, &draw.config, &first).map_err(|e| fail(&e))?;
    if !verdict.passed() {
        return Err(TestCaseError::fail(format!("{:?} values: {}", draw.values, verdict.failures.join("\n"))));
    }
    let why = check_transpose(stream, kernel, &draw.case, &draw.config, &first);
    why.map_err(|e| TestCaseError::fail(format!("{:?} values, the pooling's transpose: {e}", draw.values)))
}

/// The pooling's transpose of `forward`'s outputs (made finite, `upstream_of`) through `kernel`: twice the same bits,
/// and within the bound of the oracle's `compress_backward`.
fn check_transpose<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    case: &Case<T>,
    config: &NsaConfig,
    forward: &Compressed<T>,
) -> Result<(), String> {
    let upstream = upstream_of(forward);
    let run = || compress_backward_guarded(stream, case, config, kernel, &upstream).map_err(|e| e.to_string());
    let (first, again) = (run()?, run()?);
    let bits = |t: &ArrayD<T>| t.iter().map(|x| x.bits()).collect::<Vec<_>>();
    if bits(&first.dk) != bits(&again.dk) || bits(&first.dv) != bits(&again.dv) {
        return Err("the same input gave different bits".into());
    }
    let verdict = verify_compression_backward(case, config, &upstream, &first).map_err(|e| e.to_string())?;
    if !verdict.passed() {
        return Err(verdict.failures.join("\n"));
    }
    check_map_gradients(stream, kernel, case, config, &upstream)
}

/// The learned matrices' gradients (for the operands whose map is a matrix) from `upstream` through `kernel`: twice
/// the same bits, and within the bound of the oracle's `∂L/∂W` summed over sequences and KV heads.
fn check_map_gradients<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    case: &Case<T>,
    config: &NsaConfig,
    upstream: &Compressed<T>,
) -> Result<(), String> {
    let run = || map_gradients_guarded(stream, case, config, kernel, upstream).map_err(|e| e.to_string());
    let (first, again) = (run()?, run()?);
    let bits = |t: &Option<ndarray::Array2<f32>>| t.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
    if bits(&first.keys) != bits(&again.keys) || bits(&first.values) != bits(&again.values) {
        return Err("the matrix gradient: the same input gave different bits".into());
    }
    let verdict = verify_map_gradients(case, config, upstream, &first).map_err(|e| e.to_string())?;
    if verdict.passed() { Ok(()) } else { Err(format!("the matrix gradient: {}", verdict.failures.join("\n"))) }
}

fn run_production(suite: &TypedSuite) {
    run_typed_production(suite, NSA_COMPRESS, run_compression_suite);
}

#[test]
fn compression_matches_the_recipe_and_the_oracle_bf16() {
    run_production(&COMPRESSION_SUITES[0]);
}

#[test]
fn compression_matches_the_recipe_and_the_oracle_f16() {
    run_production(&COMPRESSION_SUITES[1]);
}

/// The suites' fixed seeds reach what the mutants need, replayed without a device: every value kind, weights on the
/// values, varlen, and a length with no window.
#[test]
fn the_compression_suites_draw_every_value_kind_and_layout() {
    for suite in &COMPRESSION_SUITES {
        let seen = std::cell::RefCell::new(std::collections::BTreeSet::new());
        let config = default_run_config(suite.name, suite.cases, suite.seed);
        TestRunner::new(config)
            .run(&compression_draws::<bf16>(), |draw| {
                let mut s = seen.borrow_mut();
                s.insert(format!("{:?}", draw.values));
                s.insert(format!(
                    "varlen {}",
                    !matches!(draw.case.spec.layout, attnproof_oracle::Layout::Dense { .. })
                ));
                s.insert(format!(
                    "weighted values {}",
                    matches!(draw.config.compress_values, Compression::Weighted(_))
                ));
                for (name, map) in [("keys", &draw.config.compress_keys), ("values", &draw.config.compress_values)] {
                    if matches!(map, Compression::Linear(_)) {
                        s.insert(format!("matrix {name}"));
                        if draw.case.spec.n_heads_kv > 1 && draw.case.spec.sequences().len() > 1 {
                            s.insert(format!("matrix {name} over heads and sequences"));
                        }
                    }
                }
                if draw.case.spec.sequences().iter().any(|q| q.len_k < draw.config.compress_len) {
                    s.insert("no window".to_owned());
                }
                Ok(())
            })
            .expect("replay");
        let seen = seen.into_inner();
        for class in ["Gaussian", "Tiny", "NearLargest", "Cancelling", "varlen true", "varlen false"] {
            assert!(seen.contains(class), "{}: no draw of {class}: {seen:?}", suite.name);
        }
        for class in [
            "weighted values true",
            "weighted values false",
            "no window",
            "matrix keys",
            "matrix values",
            "matrix keys over heads and sequences",
            "matrix values over heads and sequences",
        ] {
            assert!(seen.contains(class), "{}: no draw of {class}: {seen:?}", suite.name);
        }
    }
}

/// Fixed cases that kill the catalog's `gpu-nsa-compress-*` mutants: two dense heads with the paper's windows and the
/// mean (a head written to the other's place, a mean divided by the stride, a row dropped, a window one token late);
/// varlen with an empty sequence and weighted values of awkward head dims (the last packed window, the values' own
/// weights and flag); a window of values near bf16's largest with the mean (an f32 sum overflows where the f64
/// sum does not); and learned matrices of different shapes on both operands over two KV heads and three sequences, the
/// last one with windows (the stacking, the transpose's index, the values' matrix after the keys', the gradient's sum
/// over heads and sequences).
pub fn killing_cases() -> Vec<(&'static str, (Case<bf16>, NsaConfig))> {
    let paper = NsaConfig::default();
    let dense_case = make_case::<bf16>(&dense(2, 4, 2, 100, 100, 64, 32, Mask::Causal), gaussian(1.0), 51);
    let weights: Vec<f64> = (0..32).map(|i| 1.0 / (i as f64 + 1.5)).collect();
    let weighted_values = NsaConfig { compress_values: Compression::Weighted(weights), ..NsaConfig::default() };
    let packed = make_case::<bf16>(
        &varlen(&[0, 49, 49, 130], &[0, 49, 49, 130], 3, 1, 40, 256, Mask::Causal),
        gaussian(1.0),
        52,
    );
    let mut large = make_case::<bf16>(&dense(1, 1, 1, 64, 64, 16, 16, Mask::Causal), gaussian(1.0), 53);
    let largest = largest_finite::<bf16>();
    for t in [&mut large.k, &mut large.v] {
        t.mapv_inplace(|x| bf16::from_f32(x.to_f32().clamp(-4.0, 4.0).abs() * (largest / 4.0)));
    }
    let matrices =
        make_case::<bf16>(&varlen(&[0, 23, 23, 61], &[0, 23, 23, 61], 4, 2, 16, 8, Mask::Causal), gaussian(1.0), 54);
    let matrix = |rows: usize, cols: usize, salt: usize| {
        let w = ndarray::Array2::from_shape_fn((rows, cols), |(r, c)| ((r * 7 + c * 3 + salt) % 11) as f64 / 5.0 - 1.0);
        Compression::Linear(w)
    };
    let learned = NsaConfig {
        compress_len: 4,
        compress_stride: 2,
        compress_keys: matrix(4 * 16, 16, 0),
        compress_values: matrix(4 * 8, 8, 5),
        ..NsaConfig::default()
    };
    vec![
        ("dense_two_heads_paper_windows", (dense_case, paper.clone())),
        ("varlen_empty_weighted_values", (packed, weighted_values)),
        ("mean_near_the_largest_value", (large, paper)),
        ("varlen_two_heads_learned_matrices", (matrices, learned)),
    ]
}

/// Runs the compression kernel `kernel` on a killing case; `Ok(())` when its outputs pass the verification.
pub fn check_compression(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    case: &(Case<bf16>, NsaConfig),
) -> Result<(), String> {
    let (case, config) = case;
    let out = compress_guarded(stream, case, config, kernel).map_err(|e| e.to_string())?;
    let verdict = verify_compression(case, config, &out).map_err(|e| e.to_string())?;
    if !verdict.passed() {
        return Err(verdict.failures[0].clone());
    }
    check_transpose(stream, kernel, case, config, &out)
}

/// The killing cases under compute-sanitizer (`run.sh sanitize`): tail windows, an empty sequence, odd head dims.
#[test]
fn sanitizer_shapes() {
    let Some(stream) = device_stream("nsa_compress::sanitizer_shapes") else { return };
    for (name, case) in killing_cases() {
        if let Err(why) = check_compression(&stream, NSA_COMPRESS, &case) {
            panic!("case `{name}`: {why}");
        }
    }
}

/// Regression (`gpu_nsa_compress_{bf16,f16}`, their first run on the H200: a window of `l = 1` over a negative zero):
/// the kernel sums from +0, so windows of negative zeros compress to +0; the recipe's reference had kept −0 and the
/// bits differed. Both maps, both operands, one window and the paper's.
#[test]
fn windows_of_negative_zeros_give_the_recipes_positive_zero() {
    let Some(stream) = device_stream("nsa_compress::windows_of_negative_zeros_give_the_recipes_positive_zero") else {
        return;
    };
    let mut case = make_case::<bf16>(&dense(1, 2, 2, 40, 40, 16, 8, Mask::Causal), gaussian(1.0), 9);
    case.k.fill(bf16::NEG_ZERO);
    case.v.fill(bf16::NEG_ZERO);
    for (l, s) in [(1, 1), (32, 16)] {
        let weighted = NsaConfig {
            compress_len: l,
            compress_stride: s,
            compress_values: Compression::Weighted(vec![-1.0; l]),
            ..NsaConfig::default()
        };
        let mean = NsaConfig { compress_values: Compression::Mean, ..weighted.clone() };
        for config in [mean, weighted] {
            let out = compress_guarded(&stream, &case, &config, NSA_COMPRESS).expect("launch");
            assert!(out.k.iter().chain(out.v.iter()).all(|x| x.to_bits() == 0), "{config:?}");
            let verdict = verify_compression(&case, &config, &out).expect("verification");
            assert!(verdict.passed(), "{config:?}: {:?}", verdict.failures);
        }
    }
}

/// The host wrapper (copies in and out) gives the bits of the guarded launch through the device wrapper.
#[test]
fn the_host_wrapper_equals_the_device_wrapper() {
    let Some(stream) = device_stream("nsa_compress::the_host_wrapper_equals_the_device_wrapper") else { return };
    let (_, (case, config)) = killing_cases().swap_remove(1);
    let host = compress_kv(&stream, &case.spec, &config, case.k.view(), case.v.view()).expect("host wrapper");
    let guarded = compress_guarded(&stream, &case, &config, NSA_COMPRESS).expect("device wrapper");
    assert_eq!(host.k, guarded.k);
    assert_eq!(host.v, guarded.v);
    assert_eq!(host.k.shape(), compressed_shape(&case.spec, &config, Operand::K).unwrap().as_slice());
}

/// Bad input is a typed error before any launch: a zero stride, weights of the wrong length or not finite, a head
/// dim the kernels do not take, host tensors of the wrong shape, device buffers too small.
#[test]
fn bad_compression_input_is_a_typed_error_before_any_launch() {
    let Some(stream) = device_stream("nsa_compress::bad_compression_input_is_a_typed_error_before_any_launch") else {
        return;
    };
    let spec = AttentionSpec::dense(1, 2, 1, 64, 64, 16, 16).with_mask(Mask::Causal);
    let case = make_case::<bf16>(&spec, gaussian(1.0), 7);
    let host =
        |config: &NsaConfig, spec: &AttentionSpec| compress_kv(&stream, spec, config, case.k.view(), case.v.view());
    let paper = NsaConfig::default();
    for bad in [
        NsaConfig { compress_stride: 0, ..paper.clone() },
        NsaConfig { compress_len: 0, ..paper.clone() },
        NsaConfig { compress_keys: Compression::Weighted(vec![1.0; 31]), ..paper.clone() },
        NsaConfig { compress_values: Compression::Weighted(vec![f64::INFINITY; 32]), ..paper.clone() },
    ] {
        assert!(matches!(host(&bad, &spec), Err(GpuError::Spec(_))), "{bad:?}");
    }
    let odd = AttentionSpec::dense(1, 2, 1, 64, 64, 12, 16).with_mask(Mask::Causal);
    assert!(matches!(host(&paper, &odd), Err(GpuError::Unsupported { argument: "head_dim", .. })));
    let longer = AttentionSpec::dense(1, 2, 1, 64, 65, 16, 16).with_mask(Mask::Causal);
    assert!(matches!(host(&paper, &longer), Err(GpuError::Shape { argument: "k", .. })));
    let k = upload(&stream, &case.k).unwrap();
    let v = upload(&stream, &case.v).unwrap();
    let windows = compressed_shape(&spec, &paper, Operand::K).unwrap().iter().product::<usize>();
    let mut enough = stream.alloc_zeros::<bf16>(windows).unwrap();
    let mut short = stream.alloc_zeros::<bf16>(windows - 1).unwrap();
    let err = compress_kv_device(&stream, &spec, &paper, NSA_COMPRESS, &k, &v, &mut short, &mut enough).unwrap_err();
    assert!(matches!(err, GpuError::BufferTooSmall { argument: "k_cmp", .. }), "{err}");
    let err = compress_kv_device(&stream, &spec, &paper, NSA_COMPRESS, &v, &k, &mut enough, &mut short).unwrap_err();
    assert!(matches!(err, GpuError::BufferTooSmall { argument: "v_cmp", .. }), "{err}");
    let tiny = stream.alloc_zeros::<bf16>(3).unwrap();
    let mut other = stream.alloc_zeros::<bf16>(windows).unwrap();
    let err = compress_kv_device(&stream, &spec, &paper, NSA_COMPRESS, &tiny, &v, &mut other, &mut enough).unwrap_err();
    assert!(matches!(err, GpuError::BufferTooSmall { argument: "k", .. }), "{err}");
    // Nothing was launched: the outputs are still the zeros they were allocated with.
    assert!(stream.clone_dtoh(&enough).unwrap().iter().all(|x| x.to_bits() == 0));
    // A learned matrix of the wrong shape; the gradient of a map without parameters, of Q, into too small a buffer.
    let wrong = NsaConfig { compress_keys: Compression::Linear(ndarray::Array2::zeros((32 * 16, 8))), ..paper.clone() };
    // (The configuration's own check sees rows that are not `l` times the columns; a matrix of the right form for
    // other columns passes it and meets the kernel's shape check.)
    assert!(matches!(host(&wrong, &spec), Err(GpuError::Spec(_))));
    let other_cols =
        NsaConfig { compress_keys: Compression::Linear(ndarray::Array2::zeros((32 * 8, 8))), ..paper.clone() };
    assert!(matches!(host(&other_cols, &spec), Err(GpuError::Shape { argument: "compress_keys", .. })));
    let learned =
        NsaConfig { compress_keys: Compression::Linear(ndarray::Array2::zeros((32 * 16, 16))), ..paper.clone() };
    let mut grad = stream.alloc_zeros::<f32>(32 * 16 * 16).unwrap();
    let mut small = stream.alloc_zeros::<f32>(32 * 16 * 16 - 1).unwrap();
    let gradient = |config: &NsaConfig, operand, out: &mut cudarc::driver::CudaSlice<f32>| {
        compress_map_gradient_device(&stream, &spec, config, NSA_COMPRESS, operand, &k, &enough, out)
    };
    let err = gradient(&learned, Operand::V, &mut grad).unwrap_err();
    assert!(matches!(err, GpuError::Unsupported { argument: "compression map", .. }), "{err}");
    let err = gradient(&learned, Operand::Q, &mut grad).unwrap_err();
    assert!(matches!(err, GpuError::Unsupported { argument: "operand", .. }), "{err}");
    let err = gradient(&learned, Operand::K, &mut small).unwrap_err();
    assert!(matches!(err, GpuError::BufferTooSmall { argument: "d_map", .. }), "{err}");
    assert!(stream.clone_dtoh(&grad).unwrap().iter().all(|x| x.to_bits() == 0));
}
