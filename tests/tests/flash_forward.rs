//! The reference FlashAttention forward verified against the oracle on fuzzed shapes and
//! values, in bf16 and f16: every verdict within bound, every case discriminating.

use attnproof_harness::flash::recipe;
use attnproof_harness::generate::make_case;
use attnproof_harness::strategies::{profile, spec, suite_config};
use attnproof_harness::{Case, HarnessError, Verdict, verify_forward};
use attnproof_oracle::spec::Operand;
use attnproof_reference::{Element, ForwardOutputs, TileConfig, flash_forward};
use half::{bf16, f16};
use ndarray::ArrayD;
use proptest::prelude::*;

const TILE: usize = 16;

fn check<T: Element>(case: &Case<T>, tiles: TileConfig) -> Result<Verdict, TestCaseError> {
    // Outputs start as NaN so that an element the schedule never writes fails the verdict.
    let mut o = ArrayD::from_elem(case.spec.expected_shape(Operand::O), T::from_f32(f32::NAN));
    let mut lse = ArrayD::from_elem(case.spec.expected_shape(Operand::RowStat), f32::NAN);
    let outputs = ForwardOutputs { o: o.view_mut(), lse: lse.view_mut() };
    flash_forward(&case.spec, &case.inputs(), tiles, outputs).map_err(|e| TestCaseError::fail(e.to_string()))?;
    match verify_forward(case, recipe::<T>(tiles.kv_tile), o.view(), lse.view()) {
        Ok(v) => Ok(v),
        // A case outside the model's hypothesis is not a failure of the schedule.
        Err(HarnessError::Model(m)) => Err(TestCaseError::reject(m.to_string())),
        Err(e) => Err(TestCaseError::fail(e.to_string())),
    }
}

proptest! {
    #![proptest_config(suite_config("flash_forward", 48))]

    #[test]
    fn reference_forward_is_within_bound_bf16(spec in spec(TILE), profile in profile(), seed in any::<u64>()) {
        let case = make_case::<bf16>(&spec, profile, seed);
        let v = check(&case, TileConfig { q_tile: TILE, kv_tile: TILE })?;
        prop_assert!(v.passed(), "{v}");
        prop_assert!(v.valid(), "{v}");
    }

    #[test]
    fn reference_forward_is_within_bound_f16(spec in spec(TILE), profile in profile(), seed in any::<u64>()) {
        let case = make_case::<f16>(&spec, profile, seed);
        let v = check(&case, TileConfig { q_tile: TILE, kv_tile: TILE })?;
        prop_assert!(v.passed(), "{v}");
        prop_assert!(v.valid(), "{v}");
    }
}
