//! The DSA theorems (E16) on proptest inputs against the oracle, and each against a broken
//! implementation that it must reject.

use crate::common::{PREC, REQUIRED, fail, mp_matrix, pseudo_random};
use attnproof_oracle::dsa::{
    IndexerLoss, TokenSparseInputs, TokenSparseOutput, TopKConfig, causal_top_k, indexer_distribution,
    main_attention_probabilities, teacher_distribution,
};
use attnproof_oracle::topk::padded_ascending;
use attnproof_oracle::{Mp, OracleError, Real, Scale};
use attnproof_proofs::dsa::{
    IndexerCase, TokenSparseCase, causal_top_k_is_exact, full_selection_is_dense, hadamard_invariance,
    kl_loss_matches_definition, kl_loss_vanishes_at_teacher, oracle_indexer, oracle_indexer_loss, oracle_token_sparse,
    sylvester_hadamard,
};
use ndarray::{Array2, Array3, ArrayView2};
use proptest::prelude::*;

fn mp_tensor3(shape: (usize, usize, usize), values: &[f64]) -> Array3<Mp> {
    Array3::from_shape_vec(shape, values.iter().map(|&x| Mp::new(x, PREC)).collect()).expect("sizes agree")
}

/// `n` multiples of 0.5 in `[-2, 2]`: small exact values, so that equal scores (ties) are common.
fn half_integers(n: usize) -> impl Strategy<Value = Vec<f64>> {
    prop::collection::vec(-4i32..=4, n).prop_map(|v| v.into_iter().map(|x| x as f64 / 2.0).collect())
}

/// `n` values in `[-1, 1]`.
fn reals(n: usize) -> impl Strategy<Value = Vec<f64>> {
    prop::collection::vec(-1.0f64..=1.0, n)
}

/// An indexer case with `T ≤ 6`, `H_I ≤ 3`, `d_I ∈ {1, 2, 4}` (powers of two, for Hadamard), its
/// entries drawn by `entries`.
fn indexer_case<V: Strategy<Value = Vec<f64>>>(entries: fn(usize) -> V) -> impl Strategy<Value = IndexerCase> {
    (1usize..=6, 1usize..=3, prop::sample::select(vec![1usize, 2, 4])).prop_flat_map(move |(t, h, d)| {
        (entries(t * h * d), entries(t * h), entries(t * d)).prop_map(move |(q, w, k)| IndexerCase {
            q_index: mp_tensor3((t, h, d), &q),
            weights: mp_matrix(t, h, &w),
            k_index: mp_matrix(t, d, &k),
        })
    })
}

/// Main attention for token-sparse attention: `T ≤ 5`, `H ≤ 3`, `d ≤ 3`, `dv ≤ 2`, `κ ≥ T`.
fn token_sparse_case() -> impl Strategy<Value = TokenSparseCase> {
    (1usize..=5, 1usize..=3, 1usize..=3, 1usize..=2, 0usize..=2).prop_flat_map(|(t, h, d, dv, extra)| {
        (reals(t * h * d), reals(t * d), reals(t * dv)).prop_map(move |(q, k, v)| TokenSparseCase {
            query: mp_tensor3((t, h, d), &q.iter().map(|x| 3.0 * x).collect::<Vec<_>>()),
            key: mp_matrix(t, d, &k),
            value: mp_matrix(t, dv, &v),
            top_k: t + extra,
        })
    })
}

/// A teacher from causal main attention (`H ≤ 3` heads, `d ≤ 2`) and indexer scores of the same
/// length.
fn teacher_and_scores() -> impl Strategy<Value = (Array2<Mp>, Array2<Mp>)> {
    indexer_case(reals).prop_flat_map(|case| {
        let t = case.k_index.nrows();
        (1usize..=3, 1usize..=2).prop_flat_map(move |(h, d)| {
            let case = case.clone();
            (reals(t * h * d), reals(t * d)).prop_map(move |(q, k)| {
                let q = mp_tensor3((t, h, d), &q.iter().map(|x| 4.0 * x).collect::<Vec<_>>());
                let probs = main_attention_probabilities(q.view(), mp_matrix(t, d, &k).view(), Scale::default(), PREC)
                    .expect("valid main attention");
                let teacher = teacher_distribution(probs.view(), PREC).expect("valid probabilities");
                (teacher, oracle_indexer(case.inputs()).expect("valid indexer"))
            })
        })
    })
}

fn oracle_top_k(scores: ArrayView2<'_, Mp>, config: TopKConfig) -> Result<Array2<i32>, OracleError> {
    causal_top_k(scores, config)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn orthonormal_hadamard_rotation_leaves_indexer_scores_unchanged(case in indexer_case(reals)) {
        let rotation = sylvester_hadamard(case.k_index.ncols(), PREC).expect("power of two");
        hadamard_invariance(&oracle_indexer, &case, &rotation, REQUIRED).map_err(fail)?;
    }

    #[test]
    fn causal_top_k_is_exact_with_ties(case in indexer_case(half_integers), top_k in 1usize..=7) {
        let scores = oracle_indexer(case.inputs()).expect("valid indexer");
        causal_top_k_is_exact(&oracle_top_k, &scores, TopKConfig { top_k })
            .map_err(fail)?;
    }

    #[test]
    fn selecting_every_causal_token_is_dense_causal_attention(case in token_sparse_case()) {
        full_selection_is_dense(&oracle_token_sparse, &case, REQUIRED).map_err(fail)?;
    }

    #[test]
    fn indexer_loss_is_the_kl_definition_and_vanishes_at_the_teacher((teacher, scores) in teacher_and_scores()) {
        kl_loss_matches_definition(&oracle_indexer_loss, &teacher, &scores, REQUIRED)
            .map_err(fail)?;
        kl_loss_vanishes_at_teacher(&oracle_indexer_loss, &teacher, REQUIRED)
            .map_err(fail)?;
    }
}

/// A fixed indexer case with `d_I = 4` and non-zero scores.
fn fixed_indexer_case() -> IndexerCase {
    let q: Vec<f64> = (0..3 * 2 * 4).map(|i| ((i * 7) % 5) as f64 * 0.5 - 0.5).collect();
    let k: Vec<f64> = (0..3 * 4).map(|i| ((i * 3) % 4) as f64 * 0.5 - 0.25).collect();
    IndexerCase {
        q_index: mp_tensor3((3, 2, 4), &q),
        weights: mp_matrix(3, 2, &[1.0, 0.5, 2.0, 1.0, 1.0, 1.5]),
        k_index: mp_matrix(3, 4, &k),
    }
}

#[test]
fn hadamard_invariance_rejects_an_unscaled_hadamard() {
    let case = fixed_indexer_case();
    let orthonormal = sylvester_hadamard(4, PREC).expect("power of two");
    assert!(hadamard_invariance(&oracle_indexer, &case, &orthonormal, REQUIRED).is_ok());
    // H_4 without its 1/√4 doubles every q and k, so each dot product and, ReLU being positively
    // homogeneous, each score is multiplied by 4.
    let unscaled = orthonormal.mapv(|x| x * Mp::new(2.0, PREC));
    assert!(hadamard_invariance(&oracle_indexer, &case, &unscaled, REQUIRED).is_err());
    assert!(sylvester_hadamard(3, PREC).is_none());
}

/// Top-κ over `s ≤ t + reach`, with ties broken to `tie_to_higher` or the lower index.
fn broken_top_k(scores: ArrayView2<'_, Mp>, top_k: usize, reach: usize, tie_to_higher: bool) -> Array2<i32> {
    let seq_len = scores.nrows();
    Array2::from_shape_fn((seq_len, top_k), |(t, slot)| {
        let mut candidates: Vec<usize> = (0..(t + 1 + reach).min(seq_len)).collect();
        candidates.sort_by(|&a, &b| {
            let by_score = scores[[t, b]].partial_cmp(&scores[[t, a]]).expect("finite");
            if tie_to_higher { by_score.then(b.cmp(&a)) } else { by_score.then(a.cmp(&b)) }
        });
        candidates.truncate(top_k);
        padded_ascending(&candidates, top_k)[slot]
    })
}

/// Scores of 4 queries with ties at the selection boundary and a large score just after the
/// diagonal.
fn tied_scores() -> Array2<Mp> {
    mp_matrix(4, 4, &[1.0, 9.0, 0.0, 0.0, 2.0, 2.0, 9.0, 0.0, 1.0, 3.0, 3.0, 9.0, 0.0, 5.0, 5.0, 5.0])
}

#[test]
fn top_k_theorem_rejects_ties_to_the_higher_index() {
    let scores = tied_scores();
    let config = TopKConfig { top_k: 2 };
    assert!(causal_top_k_is_exact(&oracle_top_k, &scores, config).is_ok());
    let broken = |s: ArrayView2<'_, Mp>, c: TopKConfig| Ok(broken_top_k(s, c.top_k, 0, true));
    assert!(causal_top_k_is_exact(&broken, &scores, config).is_err());
}

#[test]
fn top_k_theorem_rejects_a_selection_of_the_next_token() {
    let scores = tied_scores();
    let config = TopKConfig { top_k: 2 };
    let broken = |s: ArrayView2<'_, Mp>, c: TopKConfig| Ok(broken_top_k(s, c.top_k, 1, false));
    assert!(causal_top_k_is_exact(&broken, &scores, config).is_err());
}

#[test]
fn full_selection_theorem_rejects_dropping_the_last_selected_token() {
    let t = 3;
    let case = TokenSparseCase {
        query: mp_tensor3((t, 2, 2), &pseudo_random(11, t * 4)),
        key: mp_matrix(t, 2, &pseudo_random(12, t * 2)),
        value: mp_matrix(t, 1, &[1.0, 2.0, 4.0]),
        top_k: t,
    };
    assert!(full_selection_is_dense(&oracle_token_sparse, &case, REQUIRED).is_ok());
    let drop_last = |inputs: TokenSparseInputs<'_, Mp>| -> Result<TokenSparseOutput<Mp>, OracleError> {
        let mut selection = inputs.selection.to_owned();
        for mut row in selection.rows_mut() {
            if let Some(last) = row.iter().rposition(|&s| s != -1) {
                row[last] = -1;
            }
        }
        oracle_token_sparse(TokenSparseInputs { selection: selection.view(), ..inputs })
    };
    assert!(full_selection_is_dense(&drop_last, &case, REQUIRED).is_err());
}

/// A teacher whose rows are distributions over causal keys, every causal entry positive.
fn fixed_teacher() -> Array2<Mp> {
    let probs = main_attention_probabilities(
        mp_tensor3((3, 1, 2), &[1.0, 0.0, 0.5, 2.0, -1.0, 1.0]).view(),
        mp_matrix(3, 2, &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]).view(),
        Scale::default(),
        PREC,
    )
    .expect("valid");
    teacher_distribution(probs.view(), PREC).expect("valid")
}

#[test]
fn kl_theorem_rejects_swapped_arguments() {
    let teacher = fixed_teacher();
    let scores = mp_matrix(3, 3, &[0.0, 0.0, 0.0, 2.0, 0.0, 0.0, -1.0, 0.5, 3.0]);
    assert!(kl_loss_matches_definition(&oracle_indexer_loss, &teacher, &scores, REQUIRED).is_ok());
    // KL(σ ‖ τ) instead of KL(τ ‖ σ): also non-negative and zero at σ = τ, but a different number.
    let swapped = |teacher: ArrayView2<'_, Mp>, scores: ArrayView2<'_, Mp>| -> Result<IndexerLoss<Mp>, OracleError> {
        let student = indexer_distribution(scores, PREC)?;
        let per_query = ndarray::Array1::from_shape_fn(teacher.nrows(), |t| {
            (0..=t).fold(Mp::zero(PREC), |acc, s| {
                let sigma = student[[t, s]].clone();
                acc + sigma.clone() * (sigma / teacher[[t, s]].clone()).ln()
            })
        });
        let total = per_query.iter().fold(Mp::zero(PREC), |a, x| a + x.clone());
        Ok(IndexerLoss { per_query, total })
    };
    assert!(kl_loss_matches_definition(&swapped, &teacher, &scores, REQUIRED).is_err());
}

#[test]
fn vanishing_theorem_rejects_a_student_softmax_over_future_keys() {
    let teacher = fixed_teacher();
    assert!(kl_loss_vanishes_at_teacher(&oracle_indexer_loss, &teacher, REQUIRED).is_ok());
    // The student normalizes over all T keys, future ones included.
    let acausal = |teacher: ArrayView2<'_, Mp>, scores: ArrayView2<'_, Mp>| -> Result<IndexerLoss<Mp>, OracleError> {
        let per_query = ndarray::Array1::from_shape_fn(teacher.nrows(), |t| {
            let row: Vec<Mp> = scores.row(t).to_vec();
            let lse = attnproof_oracle::vector::log_sum_exp(&row, PREC);
            (0..=t).fold(Mp::zero(PREC), |acc, s| {
                let tau = teacher[[t, s]].clone();
                acc + tau.clone() * (tau.ln() - (scores[[t, s]].clone() - lse.clone()))
            })
        });
        let total = per_query.iter().fold(Mp::zero(PREC), |a, x| a + x.clone());
        Ok(IndexerLoss { per_query, total })
    };
    assert!(kl_loss_vanishes_at_teacher(&acausal, &teacher, REQUIRED).is_err());
}

#[test]
fn theorems_refuse_cases_outside_their_hypotheses() {
    let case = fixed_indexer_case();
    let wrong_size = sylvester_hadamard(2, PREC).expect("power of two");
    assert!(matches!(
        hadamard_invariance(&oracle_indexer, &case, &wrong_size, REQUIRED),
        Err(attnproof_proofs::Violation::Hypothesis { .. })
    ));
    let narrow = TokenSparseCase {
        query: mp_tensor3((2, 1, 1), &[1.0, 2.0]),
        key: mp_matrix(2, 1, &[1.0, 0.0]),
        value: mp_matrix(2, 1, &[1.0, 0.0]),
        top_k: 1,
    };
    assert!(matches!(
        full_selection_is_dense(&oracle_token_sparse, &narrow, REQUIRED),
        Err(attnproof_proofs::Violation::Hypothesis { .. })
    ));
    let not_normalized = mp_matrix(2, 2, &[1.0, 0.0, 0.5, 0.25]);
    assert!(matches!(
        kl_loss_vanishes_at_teacher(&oracle_indexer_loss, &not_normalized, REQUIRED),
        Err(attnproof_proofs::Violation::Hypothesis { .. })
    ));
}
