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
