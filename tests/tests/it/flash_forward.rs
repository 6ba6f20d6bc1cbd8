//! The reference FlashAttention forward verified against the oracle on fuzzed shapes and
//! values, in bf16 and f16, and on the harness's adversarial table (`candidate_tests!`, the
//! same cases the GPU kernel runs): every verdict within bound, every case discriminating.

use attnproof_harness::adversarial::{Repeat, forward_verdicts};
use attnproof_harness::candidate::{ReferenceCandidate, Storage};
use attnproof_harness::candidate_tests;
use attnproof_harness::generate::make_case;
use attnproof_harness::strategies::{profile, spec, suite_config};
use attnproof_oracle::AttentionSpec;
use attnproof_reference::TileConfig;
use half::{bf16, f16};
use proptest::prelude::*;

const TILE: usize = 16;

/// The reference schedule in tiles of `TILE`, on one fuzzed case: the verdict passes and the gate is valid (a case
/// outside the model's hypothesis is rejected, not failed).
fn check<T: Storage>(
    spec: &AttentionSpec,
    profile: attnproof_harness::generate::ValueProfile,
    seed: u64,
) -> Result<(), TestCaseError> {
    let candidate = ReferenceCandidate { tiles: TileConfig { q_tile: TILE, kv_tile: TILE } };
    let case = make_case::<T>(spec, profile, seed);
    forward_verdicts(&candidate, &[&case], Repeat::Never).map_err(|e| e.into_test_case_error())?;
    Ok(())
}

proptest! {
    #![proptest_config(suite_config("flash_forward", 48))]

    #[test]
    fn reference_forward_is_within_bound_bf16(spec in spec(TILE), profile in profile(), seed in any::<u64>()) {
        check::<bf16>(&spec, profile, seed)?;
    }

    #[test]
    fn reference_forward_is_within_bound_f16(spec in spec(TILE), profile in profile(), seed in any::<u64>()) {
        check::<f16>(&spec, profile, seed)?;
    }
}

// The adversarial table in tiles of 64 (its lengths sit around 64 and 128): one test per group, the dtype alternating.
candidate_tests!(ReferenceCandidate::for_tests, [forward]);

/// The unit roundoff of each storage type is half its machine epsilon, `2^-p` for `p` significand bits (the implicit
/// one included): `1 + 2u` is the next value after 1, and `1 + u` is a tie that rounds back to 1. Every bound of the
/// reference schedules and the kernels scales with it, so a wrong constant loosens or breaks them all.
#[test]
fn the_unit_roundoff_of_each_storage_type_is_half_its_epsilon() {
    use attnproof_reference::Element;
    fn check<T: Element>(bits: i32) {
        let u = T::UNIT_ROUNDOFF;
        assert_eq!(u, 2f64.powi(-bits), "{}", T::NAME);
        let round = |x: f64| T::from_f32(x as f32).to_f32();
        assert_eq!(f64::from(round(1.0 + 2.0 * u)), 1.0 + 2.0 * u, "{}: 1 + 2u is representable", T::NAME);
        assert_eq!(round(1.0 + u), 1.0, "{}: 1 + u ties to 1", T::NAME);
    }
    check::<bf16>(8);
    check::<f16>(11);
    check::<f32>(24);
}

/// The dense reference forward refuses, with a typed error naming the argument, an input of the wrong shape, a
/// non-finite input, an output of the wrong shape and a zero tile size; the unchanged problem runs.
#[test]
fn the_dense_reference_forward_refuses_bad_shapes_non_finite_inputs_and_zero_tiles() {
    use attnproof_oracle::OracleError;
    use attnproof_oracle::spec::Operand;
    use attnproof_reference::{ForwardOutputs, Inputs, ReferenceError, flash_forward};
    use ndarray::{ArrayD, IxDyn};
    let spec = AttentionSpec::dense(1, 2, 1, 16, 20, 8, 8);
    let case = make_case::<bf16>(&spec, attnproof_harness::generate::ValueProfile::GAUSSIAN, 5);
    let tiles = TileConfig { q_tile: 8, kv_tile: 8 };
    let run = |inputs: &Inputs<'_, bf16>, o_shape: &[usize]| {
        let mut o = ArrayD::from_elem(IxDyn(o_shape), bf16::ZERO);
        let mut lse = ArrayD::from_elem(spec.expected_shape(Operand::RowStat), 0f32);
        flash_forward(&spec, inputs, tiles, ForwardOutputs { o: o.view_mut(), lse: lse.view_mut() })
    };
    let o_shape = spec.expected_shape(Operand::O);
    let shape_error = |r: Result<(), ReferenceError>, name: &str| matches!(r, Err(ReferenceError::Problem(OracleError::ShapeMismatch { argument, .. })) if argument == name);
    assert!(run(&case.inputs(), &o_shape).is_ok(), "the unchanged problem runs");
    let short_k = case.k.slice_axis(ndarray::Axis(2), (0..19).into()).to_owned();
    let inputs = Inputs { k: short_k.view(), ..case.inputs() };
    assert!(shape_error(run(&inputs, &o_shape), "k"), "19 keys accepted for Lk = 20");
    let mut nan_v = case.v.clone();
    nan_v[[0, 0, 7, 3]] = bf16::NAN;
    let inputs = Inputs { v: nan_v.view(), ..case.inputs() };
    let r = run(&inputs, &o_shape);
    assert!(
        matches!(&r, Err(ReferenceError::Problem(OracleError::NonFinite { argument: "v", index, .. })) if index == &[0, 0, 7, 3]),
        "a NaN value accepted: {r:?}"
    );
    let mut wide = o_shape.clone();
    wide[3] += 1;
    assert!(shape_error(run(&case.inputs(), &wide), "o"), "an output one column too wide accepted");
    for (bad, name) in
        [(TileConfig { q_tile: 0, kv_tile: 8 }, "q_tile"), (TileConfig { q_tile: 8, kv_tile: 0 }, "kv_tile")]
    {
        let r = attnproof_reference::flash_forward_owned(&spec, &case.inputs(), bad).map(|_| ());
        assert!(
            matches!(r, Err(ReferenceError::ZeroTile { argument }) if argument == name),
            "a zero {name} accepted: {r:?}"
        );
    }
}
