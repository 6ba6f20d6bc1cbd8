//! The DSA theorems (E16) on proptest inputs against the oracle, and each against a broken
//! implementation that it must reject.

use crate::common::{PREC, REQUIRED, fail, mp_matrix, pseudo_random};
use attnproof_oracle::dsa::{
    IndexerInputs, IndexerLoss, LossSupport, TokenSparseInputs, TokenSparseOutput, TopKConfig, causal_top_k,
    indexer_distribution, main_attention_probabilities, teacher_distribution,
};
use attnproof_oracle::topk::padded_ascending;
use attnproof_oracle::{Mp, OracleError, Real, Scale};
use attnproof_proofs::dsa::{
    IndexerCase, IndexerLossGradientsFn, TokenSparseCase, causal_top_k_is_exact, full_selection_is_dense,
    hadamard_invariance, indexer_loss_gradients_match_finite_differences, kl_loss_matches_definition,
    kl_loss_vanishes_at_teacher, oracle_indexer, oracle_indexer_loss, oracle_indexer_loss_and_gradients,
    oracle_token_sparse, sylvester_hadamard,
};
use attnproof_proofs::residual::Bits;
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

/// The step of the gradient theorem's central differences, `2^-STEP_BITS`, and the bits its agreement must reach
/// (the theorem's hypotheses: `4 · 48 ≥ 100 + 64`, and `48 + 100 + 16` bits within the 256 of `PREC`).
const STEP_BITS: u32 = 48;
const GRADIENT_BITS: Bits = Bits(100.0);

/// An indexer case whose logits sit away from the ReLU's kink, a teacher from causal main attention, and a selection
/// of `k` keys per row (the first `min(k, t + 1)` causal keys by a fixed shuffle, ascending, `−1`-padded): `T ≤ 5`,
/// `H_I ≤ 2`, `d_I ≤ 3`.
fn loss_case() -> impl Strategy<Value = (IndexerCase, Array2<Mp>, Array2<i32>)> {
    (1usize..=5, 1usize..=2, 1usize..=3, 1usize..=4, any::<u64>())
        .prop_flat_map(|(t, h, d, k, seed)| {
            (reals(t * h * d), reals(t * h), reals(t * d), reals(t * d)).prop_map(move |(q, w, kk, main_q)| {
                // Inputs on a grid of 1/64, moved by 1/1024: logits rarely land on the kink, and the filter below drops
                // those that do.
                let nudge = |x: &f64| (x * 64.0).round() / 64.0 + 1.0 / 1024.0;
                let case = IndexerCase {
                    q_index: mp_tensor3((t, h, d), &q.iter().map(nudge).collect::<Vec<_>>()),
                    weights: mp_matrix(t, h, &w.iter().map(|x| 2.0 * x).collect::<Vec<_>>()),
                    k_index: mp_matrix(t, d, &kk.iter().map(nudge).collect::<Vec<_>>()),
                };
                let probs = main_attention_probabilities(
                    mp_tensor3((t, 1, d), &main_q.iter().map(|x| 3.0 * x).collect::<Vec<_>>()).view(),
                    case.k_index.view(),
                    Scale::default(),
                    PREC,
                )
                .expect("valid main attention");
                let teacher = teacher_distribution(probs.view(), PREC).expect("valid probabilities");
                let selection = Array2::from_shape_fn((t, k), |(row, slot)| {
                    let mut keys: Vec<i32> = (0..=row as i32).collect();
                    keys.sort_by_key(|&s| (s as u64).wrapping_mul(seed | 1).rotate_left(17));
                    keys.truncate(k);
                    keys.sort_unstable();
                    keys.get(slot).copied().unwrap_or(-1)
                });
                (case, teacher, selection)
            })
        })
        .prop_filter("a logit at the ReLU's kink", |(case, _, selection)| {
            // Dyadic inputs this small multiply and add exactly in f64: an exact 0 is seen as one.
            let (t, h, d) = case.q_index.dim();
            (0..t).all(|row| {
                selection.row(row).iter().take_while(|&&s| s >= 0).all(|&s| {
                    (0..h).all(|a| {
                        let logit: f64 = (0..d)
                            .map(|c| case.q_index[[row, a, c]].to_f64() * case.k_index[[s as usize, c]].to_f64())
                            .sum();
                        logit.abs() > 1e-9
                    })
                })
            })
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn indexer_loss_gradients_are_central_differences((case, teacher, selection) in loss_case()) {
        indexer_loss_gradients_match_finite_differences(
            &oracle_indexer_loss_and_gradients, &case, &teacher, selection.view(), STEP_BITS, GRADIENT_BITS,
        ).map_err(fail)?;
    }
}

fn fixed_loss_case() -> (IndexerCase, Array2<Mp>, Array2<i32>) {
    let case = IndexerCase {
        q_index: mp_tensor3((3, 2, 2), &[1.0, 0.25, -0.5, 1.5, 0.75, -1.0, 0.5, 0.5, 2.0, 0.125, -0.25, -1.0]),
        weights: mp_matrix(3, 2, &[1.0, -2.0, 0.5, 1.0, 1.0, 1.5]),
        k_index: mp_matrix(3, 2, &[1.0, 1.25, -1.0, 2.0, 0.5, 0.375]),
    };
    let selection = ndarray::array![[0, -1], [0, 1], [0, 2]];
    (case, fixed_teacher(), selection)
}

/// The gradient theorem rejects a backward whose key gradient counts a head twice, one whose weights' gradient is off
/// by half of another, and one that forgets to renormalize the teacher on the selection; it refuses a case at the
/// kink.
#[test]
fn gradient_theorem_rejects_broken_backwards() {
    let (case, teacher, selection) = fixed_loss_case();
    let check = |f: IndexerLossGradientsFn<'_>| {
        indexer_loss_gradients_match_finite_differences(f, &case, &teacher, selection.view(), STEP_BITS, GRADIENT_BITS)
    };
    assert!(check(&oracle_indexer_loss_and_gradients).is_ok());
    // The key gradient doubled (a head counted twice).
    let doubled = |inputs: IndexerInputs<'_, Mp>, teacher: ArrayView2<'_, Mp>, support: LossSupport<'_>| {
        let (loss, mut grads) = oracle_indexer_loss_and_gradients(inputs, teacher, support)?;
        grads.d_k_index.mapv_inplace(|x| x.clone() + x);
        Ok((loss, grads))
    };
    assert!(check(&doubled).is_err());
    // The weights' gradient moved by half the gradient of unit weights.
    let off_by_half = |inputs: IndexerInputs<'_, Mp>, teacher: ArrayView2<'_, Mp>, support: LossSupport<'_>| {
        let (loss, mut grads) = oracle_indexer_loss_and_gradients(inputs, teacher, support)?;
        let ones = Array2::from_elem(inputs.weights.dim(), Mp::new(1.0, PREC));
        let plain = IndexerInputs { weights: ones.view(), ..inputs };
        let (_, unit) = oracle_indexer_loss_and_gradients(plain, teacher, support)?;
        grads.d_weights = grads.d_weights.clone() + unit.d_weights.mapv(|x| x * Mp::new(0.5, PREC));
        Ok((loss, grads))
    };
    assert!(check(&off_by_half).is_err());
    // The teacher not renormalized on the selection: the loss and its gradients of the causal support.
    let unrestricted = |inputs: IndexerInputs<'_, Mp>, teacher: ArrayView2<'_, Mp>, _: LossSupport<'_>| {
        oracle_indexer_loss_and_gradients(inputs, teacher, LossSupport::Causal)
    };
    assert!(check(&unrestricted).is_err());
    // A logit at exactly 0 is outside the hypotheses.
    let mut kink = case.clone();
    kink.q_index[[2, 0, 0]] = Mp::new(0.0, PREC);
    kink.q_index[[2, 0, 1]] = Mp::new(0.0, PREC);
    let refused = indexer_loss_gradients_match_finite_differences(
        &oracle_indexer_loss_and_gradients,
        &kink,
        &teacher,
        selection.view(),
        STEP_BITS,
        REQUIRED,
    );
    assert!(matches!(refused, Err(attnproof_proofs::residual::Violation::Hypothesis { .. })), "{refused:?}");
}
