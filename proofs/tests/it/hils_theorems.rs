//! The HiLS theorems (E21) on proptest inputs against the oracle, and each against a broken
//! implementation that it must reject.

use crate::common::{PREC, REQUIRED, fail, mp_matrix, mp_vector, pseudo_random, values};
use attnproof_oracle::hils::{ChunkMass, ChunkSummary, HilsConfig, HilsInputs, HilsOutput, chunk_count, route};
use attnproof_oracle::vector::mean_row;
use attnproof_oracle::{Mp, OracleError, Real};
use attnproof_proofs::hils::{
    ChunkCase, HilsCase, exact_masses_give_dense_attention, intercept_is_entropy, oracle_factorized, oracle_router,
    oracle_summarize, router_error_is_quadratic, slope_key_is_gradient,
};
use attnproof_proofs::{Bits, Violation};
use ndarray::{Array1, Array2, ArrayView1, ArrayView2};
use proptest::prelude::*;

/// Central differences with `h = 2^-64` at 256 bits: `O(h²) = 2^-128` truncation and
/// `2^-256/h = 2^-192` cancellation, so 80 bits leave a wide margin.
const STEP_BITS: u32 = 64;
const FINITE_DIFFERENCE_BITS: Bits = Bits(80.0);

/// A chunk of 2–5 keys in `d ≤ 3` with a landmark and a direction `u` for the Taylor theorem.
fn chunk_case() -> impl Strategy<Value = (ChunkCase, Array1<Mp>)> {
    (2usize..=5, 1usize..=3).prop_flat_map(|(n, d)| {
        (values(n * d, 2.0), values(d, 2.0), values(d, 1.0)).prop_map(move |(k, q, u)| {
            (ChunkCase { keys: mp_matrix(n, d, &k), landmark: mp_vector(&q) }, mp_vector(&u))
        })
    })
}

/// A sequence of `n ≤ 8` tokens with chunk size `≤ 3`, window `≤ 4`, routing width `≤ 3`, and the
/// oracle router's selection (or every eligible chunk, when the width covers them all).
fn hils_case() -> impl Strategy<Value = HilsCase> {
    (1usize..=8, 1usize..=2, 1usize..=2, 1usize..=3, 1usize..=4, 0usize..=3).prop_flat_map(
        |(n, d, dv, chunk_size, local_window, retrieved_chunks)| {
            let config = HilsConfig { chunk_size, local_window, retrieved_chunks };
            let chunks = chunk_count(n, config);
            (values(n * d, 2.0), values(n * d, 1.0), values(n * dv, 2.0), values(chunks * d, 2.0)).prop_map(
                move |(q, k, v, l)| {
                    let (query, key, value, landmarks) =
                        (mp_matrix(n, d, &q), mp_matrix(n, d, &k), mp_matrix(n, dv, &v), mp_matrix(chunks, d, &l));
                    let inputs = HilsInputs {
                        query: query.view(),
                        key: key.view(),
                        value: value.view(),
                        landmarks: landmarks.view(),
                    };
                    let retrieved = route(inputs, config, PREC).expect("valid inputs");
                    HilsCase { query, key, value, landmarks, retrieved, config }
                },
            )
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn slope_key_is_the_gradient_of_the_chunk_log_mass((case, _) in chunk_case()) {
        slope_key_is_gradient(&oracle_summarize, &case, STEP_BITS, FINITE_DIFFERENCE_BITS)
            .map_err(fail)?;
    }

    #[test]
    fn taylor_intercept_is_the_landmark_entropy((case, _) in chunk_case()) {
        intercept_is_entropy(&oracle_summarize, &case, REQUIRED).map_err(fail)?;
    }

    #[test]
    fn router_error_shrinks_quadratically((case, direction) in chunk_case()) {
        router_error_is_quadratic(&oracle_summarize, &oracle_router, &case, &direction, 4)
            .map_err(fail)?;
    }

    #[test]
    fn exact_chunk_masses_give_dense_attention_over_the_keys_read(case in hils_case()) {
        exact_masses_give_dense_attention(&oracle_factorized, &case, REQUIRED)
            .map_err(fail)?;
    }
}

/// Four keys in `d = 2` with distinct scores at the landmark.
fn fixed_chunk() -> ChunkCase {
    ChunkCase { keys: mp_matrix(4, 2, &[1.0, 0.0, 0.0, 1.0, -1.0, 0.5, 0.5, -1.0]), landmark: mp_vector(&[0.5, -0.25]) }
}

#[test]
fn gradient_theorem_rejects_the_mean_key_as_slope() {
    let case = fixed_chunk();
    assert!(slope_key_is_gradient(&oracle_summarize, &case, STEP_BITS, FINITE_DIFFERENCE_BITS).is_ok());
    let mean_key = |landmark: ArrayView1<'_, Mp>, keys: ArrayView2<'_, Mp>| -> Result<ChunkSummary<Mp>, OracleError> {
        let summary = oracle_summarize(landmark, keys)?;
        Ok(ChunkSummary { slope_key: mean_row(keys, PREC).expect("non-empty chunk"), ..summary })
    };
    assert!(slope_key_is_gradient(&mean_key, &case, STEP_BITS, FINITE_DIFFERENCE_BITS).is_err());
}

#[test]
fn intercept_theorem_rejects_a_base_2_entropy_and_a_missing_minus_sign() {
    let case = fixed_chunk();
    assert!(intercept_is_entropy(&oracle_summarize, &case, REQUIRED).is_ok());
    let with_entropy = |entropy: fn(&Array1<Mp>) -> Mp| {
        move |landmark: ArrayView1<'_, Mp>, keys: ArrayView2<'_, Mp>| -> Result<ChunkSummary<Mp>, OracleError> {
            let summary = oracle_summarize(landmark, keys)?;
            Ok(ChunkSummary { entropy: entropy(&summary.landmark_probabilities), ..summary })
        }
    };
    let base_2 = with_entropy(|p| {
        let ln2 = Mp::new(2.0, PREC).ln();
        p.iter().fold(Mp::zero(PREC), |acc, x| acc - x.clone() * x.ln() / ln2.clone())
    });
    let no_minus = with_entropy(|p| p.iter().fold(Mp::zero(PREC), |acc, x| acc + x.clone() * x.ln()));
    assert!(intercept_is_entropy(&base_2, &case, REQUIRED).is_err());
    assert!(intercept_is_entropy(&no_minus, &case, REQUIRED).is_err());
}

#[test]
fn quadratic_theorem_rejects_a_router_without_the_entropy_intercept() {
    let case = fixed_chunk();
    let direction = mp_vector(&[1.0, -0.5]);
    let ratios = router_error_is_quadratic(&oracle_summarize, &oracle_router, &case, &direction, 4).expect("holds");
    assert_eq!(ratios.ratios.len(), 4);
    let slope_only = |query: ArrayView1<'_, Mp>, summary: &ChunkSummary<Mp>| -> Result<Mp, OracleError> {
        Ok(oracle_router(query, summary)? - summary.entropy.clone())
    };
    let err = router_error_is_quadratic(&oracle_summarize, &slope_only, &case, &direction, 4).unwrap_err();
    assert!(matches!(err, Violation::Bound { .. }), "{err}");
}

#[test]
fn quadratic_theorem_refuses_a_chunk_without_curvature() {
    // Identical keys make f_b linear: the router is exact and there is no ratio to measure.
    let case = ChunkCase { keys: mp_matrix(2, 2, &[1.0, 2.0, 1.0, 2.0]), landmark: mp_vector(&[0.0, 1.0]) };
    let err =
        router_error_is_quadratic(&oracle_summarize, &oracle_router, &case, &mp_vector(&[1.0, 1.0]), 3).unwrap_err();
    assert!(matches!(err, Violation::Hypothesis { .. }), "{err}");
}

#[test]
fn dense_theorem_rejects_an_output_that_ignores_the_requested_mass() {
    let n = 6;
    let config = HilsConfig { chunk_size: 2, local_window: 2, retrieved_chunks: 2 };
    let case = HilsCase {
        query: mp_matrix(n, 2, &pseudo_random(21, n * 2)),
        key: mp_matrix(n, 2, &pseudo_random(22, n * 2).iter().map(|x| 2.0 * x).collect::<Vec<_>>()),
        value: mp_matrix(n, 1, &[1.0, -2.0, 3.0, 0.5, 4.0, -1.0]),
        landmarks: mp_matrix(3, 2, &[1.0, 0.0, 0.0, 1.0, 0.5, 0.5]),
        retrieved: Array2::from_shape_vec((n, 2), vec![-1, -1, -1, -1, -1, -1, 0, -1, 0, -1, 0, 1]).expect("sizes"),
        config,
    };
    assert!(exact_masses_give_dense_attention(&oracle_factorized, &case, REQUIRED).is_ok());
    let always_surrogate = |inputs: HilsInputs<'_, Mp>,
                            retrieved: ArrayView2<'_, i32>,
                            config: HilsConfig,
                            _mass: ChunkMass|
     -> Result<HilsOutput<Mp>, OracleError> {
        oracle_factorized(inputs, retrieved, config, ChunkMass::Surrogate)
    };
    assert!(exact_masses_give_dense_attention(&always_surrogate, &case, REQUIRED).is_err());
    let mut not_eligible = case.clone();
    not_eligible.retrieved[[3, 0]] = 1;
    assert!(matches!(
        exact_masses_give_dense_attention(&oracle_factorized, &not_eligible, REQUIRED),
        Err(Violation::Hypothesis { .. })
    ));
}
