//! NSA's compression (E18): the recipe's CPU reference (`attnproof_reference::sparse::nsa::compress_head`) through
//! the harness's compression verifier (`attnproof_harness::nsa`) on drawn problems over the storage types' whole
//! range, the bound (`attnproof_proofs::nsa_bound`) against MPFR-exact values, and the verifier rejecting what it must
//! reject (a flipped bit, a mean over one row too few, a wrong shape).

use attnproof_harness::HarnessError;
use attnproof_harness::candidate::Storage;
use attnproof_harness::nsa::{
    CompressionDraw, CompressionValues, compression_draws, magnitudes, reference_compression, verify_compression,
};
use attnproof_harness::strategies::suite_config;
use attnproof_oracle::nsa::{Compression, compress};
use attnproof_oracle::{Mp, Precision, Real};
use attnproof_proofs::nsa_bound::{StorageRounding, compression_bound};
use attnproof_reference::Element;
use half::{bf16, f16};
use ndarray::{ArrayD, IxDyn};
use proptest::prelude::*;
use proptest::strategy::ValueTree;

/// The reference passes the verifier: within the bound of the oracle everywhere, and its own bits.
fn check_reference<T: Storage>(draw: &CompressionDraw<T>) -> Result<(), TestCaseError> {
    let reference = reference_compression(&draw.case, &draw.config).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let verdict =
        verify_compression(&draw.case, &draw.config, &reference).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert!(verdict.passed(), "{:?} values: {:?}", draw.values, verdict.failures);
    prop_assert_eq!(verdict.reference_mismatches, 0);
    prop_assert!(verdict.worst_ratio <= 1.0);
    Ok(())
}

proptest! {
    #![proptest_config(suite_config("nsa_compress", 48))]

    #[test]
    fn the_reference_compression_passes_the_verifier_bf16(draw in compression_draws::<bf16>()) {
        check_reference(&draw)?;
    }

    #[test]
    fn the_reference_compression_passes_the_verifier_f16(draw in compression_draws::<f16>()) {
        check_reference(&draw)?;
    }
}

/// The bound holds against the exact value, not only the oracle's f64 one: every compressed element of one head of
/// each drawn problem, evaluated by the oracle in 256-bit MPFR.
fn check_exact<T: Storage>(draw: &CompressionDraw<T>, unit_roundoff: f64, subnormal: f64) -> Result<(), TestCaseError> {
    let case = &draw.case;
    let Some(seq) = case.spec.sequences().into_iter().max_by_key(|s| s.len_k) else { return Ok(()) };
    let precision = Precision(256);
    let storage = StorageRounding { unit_roundoff, subnormal };
    let keys = case.spec.head_rows(case.k.view(), &seq, 0, true);
    let reference = attnproof_reference::sparse::nsa::compress_head(keys, &draw.config.compress_keys, &draw.config)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let wide = keys.mapv(|x| f64::from(x.to_f32()));
    let exact =
        compress(wide.mapv(|x| Mp::new(x, precision)).view(), &draw.config.compress_keys, &draw.config, precision)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let f64_value = compress(wide.view(), &draw.config.compress_keys, &draw.config, ())
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let l = draw.config.compress_len;
    let magnitudes = magnitudes(wide.view(), &draw.config.compress_keys, &draw.config, reference.nrows());
    for ((c, col), got) in reference.indexed_iter() {
        let got = f64::from(got.to_f32());
        if !got.is_finite() {
            continue; // overflow beyond the largest finite value: the verifier's infinite branch, checked above
        }
        let magnitude = magnitudes[[c, col]];
        let bound = compression_bound(f64_value[[c, col]], magnitude, l, storage);
        let error = (exact[[c, col]].clone() - Mp::new(got, precision)).abs().to_f64();
        prop_assert!(error <= bound, "window {c} column {col}: |{got:e} − exact| = {error:e} > {bound:e}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(suite_config("nsa_compress_exact", 24))]

    #[test]
    fn the_bound_holds_against_mpfr_bf16(draw in compression_draws::<bf16>()) {
        check_exact(&draw, bf16::UNIT_ROUNDOFF, 9.183_549_615_799_121e-41)?;
    }

    #[test]
    fn the_bound_holds_against_mpfr_f16(draw in compression_draws::<f16>()) {
        check_exact(&draw, f16::UNIT_ROUNDOFF, 5.960_464_477_539_063e-8)?;
    }
}

/// A problem with windows everywhere: two sequences of 100 tokens, the paper's windows, Gaussian values.
fn plain_draw() -> CompressionDraw<bf16> {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    loop {
        let draw = compression_draws::<bf16>().new_tree(&mut runner).expect("a draw").current();
        let windows = reference_compression(&draw.case, &draw.config).expect("valid").k.len();
        if windows > 0 && draw.values == CompressionValues::Gaussian {
            return draw;
        }
    }
}

#[test]
fn a_flipped_bit_a_short_mean_a_nan_and_bad_shapes_or_inputs_fail_the_verifier() {
    let draw = plain_draw();
    let reference = reference_compression(&draw.case, &draw.config).unwrap();
    // One bit of one element: off the recipe's bits (inside the bound or not, it must fail).
    let mut flipped = reference.clone();
    let first = flipped.v.iter_mut().next().unwrap();
    *first = bf16::from_bits(first.to_bits() ^ 1);
    let verdict = verify_compression(&draw.case, &draw.config, &flipped).unwrap();
    assert!(!verdict.passed() && verdict.reference_mismatches == 1, "{verdict:?}");
    // A mean divided by one row more than it summed (or weights scaled likewise): outside the bound wherever the
    // value is not tiny.
    let mut short = reference.clone();
    let l = draw.config.compress_len as f32;
    short.k.mapv_inplace(|x| bf16::from_f32(x.to_f32() * l / (l + 1.0)));
    let verdict = verify_compression(&draw.case, &draw.config, &short).unwrap();
    assert!(!verdict.passed() && verdict.worst_ratio > 1.0, "{verdict:?}");
    // A NaN where the truth is finite.
    let mut nan = reference.clone();
    *nan.k.iter_mut().last().unwrap() = bf16::NAN;
    assert!(!verify_compression(&draw.case, &draw.config, &nan).unwrap().passed());
    // Inputs a caller may not give the kernel (an infinity in V) are an error, not a verdict.
    let mut infinite = draw.case.clone();
    *infinite.v.iter_mut().next().unwrap() = bf16::INFINITY;
    assert!(matches!(
        verify_compression(&infinite, &draw.config, &reference),
        Err(HarnessError::Oracle(attnproof_oracle::OracleError::NonFinite { argument: "v", .. }))
    ));
    // A candidate of the wrong shape is an error, not a verdict.
    let wrong = attnproof_harness::nsa::Compressed { k: ArrayD::from_elem(IxDyn(&[1]), bf16::ZERO), v: reference.v };
    assert!(matches!(
        verify_compression(&draw.case, &draw.config, &wrong),
        Err(HarnessError::CandidateShape { argument: "k_cmp", .. })
    ));
}

/// The draws reach what the suites rely on: every value kind, the mean and weights on both operands, windows of
/// every stride class (overlapping, adjacent, gapped), sequences with no window, varlen with an empty sequence,
/// results beyond the largest finite value (the verifier's infinite branch), and head dims above 128.
#[test]
fn compression_draws_reach_every_class() {
    use attnproof_harness::nsa::CompressionValues::*;
    use attnproof_oracle::Layout;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..400 {
        let draw = compression_draws::<bf16>().new_tree(&mut runner).expect("a draw").current();
        let (config, spec) = (&draw.config, &draw.case.spec);
        seen.insert(format!("{:?}", draw.values));
        for (name, map) in [("keys", &config.compress_keys), ("values", &config.compress_values)] {
            seen.insert(format!("{name} {}", if matches!(map, Compression::Mean) { "mean" } else { "weighted" }));
        }
        let (l, s) = (config.compress_len, config.compress_stride);
        seen.insert(
            (if s < l {
                "overlapping"
            } else if s == l {
                "adjacent"
            } else {
                "gapped"
            })
            .to_owned(),
        );
        if spec.sequences().iter().any(|q| q.len_k < l) {
            seen.insert("no window".to_owned());
        }
        if let Layout::Varlen { cu_seqlens_k, .. } = &spec.layout
            && cu_seqlens_k.windows(2).any(|w| w[0] == w[1])
        {
            seen.insert("empty sequence".to_owned());
        }
        if spec.head_dim.max(spec.head_dim_v) > 128 {
            seen.insert("wide head".to_owned());
        }
        let reference = reference_compression(&draw.case, config).expect("valid");
        if reference.k.iter().chain(reference.v.iter()).any(|x| x.is_infinite()) {
            seen.insert("overflow".to_owned());
        }
    }
    for class in [
        format!("{Gaussian:?}"),
        format!("{Tiny:?}"),
        format!("{NearLargest:?}"),
        format!("{Cancelling:?}"),
        "keys mean".into(),
        "keys weighted".into(),
        "values mean".into(),
        "values weighted".into(),
        "overlapping".into(),
        "adjacent".into(),
        "gapped".into(),
        "no window".into(),
        "empty sequence".into(),
        "wide head".into(),
        "overflow".into(),
    ] {
        assert!(seen.contains(&class), "no draw of class {class}: {seen:?}");
    }
}

/// Regression (`proptest-regressions/nsa_compress.txt`): a weighted window of bf16's largest values whose result lies
/// beyond f32's range rounds to infinity in the recipe, rightly; the verifier had held the infinity to the whole bound
/// (dominated by the storage rounding) instead of the truth's own f64 uncertainty, and failed it. Weights put the
/// result below bf16's overflow threshold (finite), between it and f32's largest value, and beyond that.
#[test]
fn results_past_the_largest_finite_value_round_to_infinity_and_pass() {
    use attnproof_harness::Case;
    use attnproof_oracle::nsa::NsaConfig;
    use attnproof_oracle::{AttentionSpec, Mask};
    let spec = AttentionSpec::dense(1, 1, 1, 1, 1, 8, 8).with_mask(Mask::Causal);
    let full = |x: bf16| ArrayD::from_elem(IxDyn(&[1, 1, 1, 8]), x);
    let case = Case { spec, q: full(bf16::ONE), k: full(-bf16::MAX), v: full(bf16::MAX) };
    for (weight, infinite) in [(1.0015, false), (1.0025, true), (1.0045, true)] {
        let config = NsaConfig {
            compress_len: 1,
            compress_stride: 1,
            compress_keys: Compression::Weighted(vec![weight]),
            compress_values: Compression::Weighted(vec![weight]),
            ..NsaConfig::default()
        };
        let reference = reference_compression(&case, &config).unwrap();
        assert_eq!(reference.k[[0, 0, 0, 0]].is_infinite(), infinite, "weight {weight}");
        assert_eq!(reference.k[[0, 0, 0, 0]], -reference.v[[0, 0, 0, 0]]);
        let verdict = verify_compression(&case, &config, &reference).unwrap();
        assert!(verdict.passed(), "weight {weight}: {:?}", verdict.failures);
    }
}
