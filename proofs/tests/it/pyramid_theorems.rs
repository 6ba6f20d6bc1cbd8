//! The Pyramid Top-K theorems (E25–E30) on proptest inputs against the oracle at 256 bits, and
//! each against a deliberately broken scorer, descent or diagnostics that it must reject.

use crate::common::{PREC, REQUIRED, fail, mp_matrix, values};
use attnproof_oracle::pyramid::{
    self, Descent, Diagnostics, Pyramid, PyramidConfig, Scoring, descent_step, expand, finish_descent,
};
use attnproof_oracle::topk::top_k;
use attnproof_oracle::vector::{block_means, log_sum_exp};
use attnproof_oracle::{Mp, OracleError, Real};
use attnproof_proofs::Violation;
use attnproof_proofs::pyramid::{
    DescentCase, NodeCase, candidate_count, causality, descent_candidate_count, descent_rule, diagnostics_bounds,
    exhaustive_when_unpruned, jensen_ordering, oracle_child_mean_lse, oracle_descent, oracle_diagnostics,
};
use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis, Slice};
use proptest::prelude::*;

/// A node of 2–4 children of 1–4 keys each, `d ≤ 3`, logits up to about ±30.
fn node_case() -> impl Strategy<Value = NodeCase> {
    (1usize..=3, 2usize..=4, 1usize..=4, prop::sample::select(vec![1.0, 5.0, 30.0])).prop_flat_map(
        |(d, children, child_size, magnitude)| {
            (values(d, 1.0), values(children * child_size * d, magnitude)).prop_map(move |(q, k)| NodeCase {
                query: Array1::from(q.into_iter().map(|x| Mp::new(x, PREC)).collect::<Vec<_>>()),
                keys: mp_matrix(children * child_size, d, &k),
                child_size,
            })
        },
    )
}

/// A descent case with `N ≤ 30`, `C ≤ 4`, `β ≤ 3`, `d ≤ 3`, a GQA group of 1–2 heads, the query
/// anywhere, and the budget chosen by `keep` from the level-1 width.
fn descent_case_with(keep: fn(usize, usize) -> BoxedStrategy<usize>) -> impl Strategy<Value = DescentCase> {
    (1usize..=30, 1usize..=4, 2usize..=3, 1usize..=3, 1usize..=2, prop::sample::select(vec![1.0, 4.0])).prop_flat_map(
        move |(n, leaf_size, branching, d, group, magnitude)| {
            let level1 = n.div_ceil(leaf_size).div_ceil(branching);
            (values(n * d, magnitude), values(group * d, 1.0), 0..n, keep(level1, n)).prop_map(
                move |(k, q, position, keep)| DescentCase {
                    keys: mp_matrix(n, d, &k),
                    heads: mp_matrix(group, d, &q),
                    position,
                    config: PyramidConfig { leaf_size, branching, keep, scoring: Scoring::Lse },
                },
            )
        },
    )
}

fn any_keep(_level1: usize, _n: usize) -> BoxedStrategy<usize> {
    (1usize..=5).boxed()
}

fn unpruned_keep(level1: usize, _n: usize) -> BoxedStrategy<usize> {
    (level1.max(1)..=level1.max(1) + 2).boxed()
}

/// `N = C·β^L` with the query at the end and `K ≥ 3`.
fn count_case() -> impl Strategy<Value = DescentCase> {
    (1usize..=3, 2usize..=3, 0u32..=3, 3usize..=5, 1usize..=2).prop_flat_map(
        |(leaf_size, branching, levels, keep, d)| {
            let n = leaf_size * branching.pow(levels);
            (
                values(n * d, 2.0),
                values(d, 1.0),
                prop::sample::select(vec![Scoring::Lse, Scoring::Pisa1, Scoring::Pisa2]),
            )
                .prop_map(move |(k, q, scoring)| DescentCase {
                    keys: mp_matrix(n, d, &k),
                    heads: mp_matrix(1, d, &q),
                    position: n - 1,
                    config: PyramidConfig { leaf_size, branching, keep, scoring },
                })
        },
    )
}

fn selection_with(case: &DescentCase, scoring: Scoring) -> Vec<i32> {
    let mut c = case.clone();
    c.config.scoring = scoring;
    oracle_descent(&c).expect("valid case").selected
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn child_mean_lse_sits_between_mean_score_and_raw_lse(case in node_case()) {
        jensen_ordering(&oracle_child_mean_lse, &case, REQUIRED, REQUIRED).map_err(fail)?;
    }

    #[test]
    fn unpruned_descent_equals_exhaustive_selection(case in descent_case_with(unpruned_keep)) {
        exhaustive_when_unpruned(&oracle_descent, &case).map_err(fail)?;
    }

    #[test]
    fn every_level_follows_the_descent_rule_with_summed_scores(case in descent_case_with(any_keep)) {
        descent_rule(&oracle_descent, &case, REQUIRED).map_err(fail)?;
    }

    #[test]
    fn selection_is_causal_keeps_forced_leaves_and_ignores_future_keys(
        (case, future) in descent_case_with(any_keep).prop_flat_map(|c| {
            let (n, d) = c.keys.dim();
            (Just(c.clone()), values((n - c.position - 1) * d, 5.0).prop_map(move |f| mp_matrix(f.len() / d, d, &f)))
        })
    ) {
        for scoring in [Scoring::Lse, Scoring::Pisa1, Scoring::Pisa2, Scoring::Bsa] {
            let mut c = case.clone();
            c.config.scoring = scoring;
            causality(&oracle_descent, &c, future.view()).map_err(fail)?;
        }
    }

    #[test]
    fn candidates_scored_follow_the_formula(case in count_case()) {
        candidate_count(&oracle_descent, &case).map_err(fail)?;
    }

    #[test]
    fn diagnostics_are_bounded_by_the_reference(case in descent_case_with(any_keep)) {
        let selections: Vec<Vec<i32>> =
            [Scoring::Lse, Scoring::Pisa1, Scoring::Pisa2, Scoring::Bsa].into_iter().map(|s| selection_with(&case, s)).collect();
        diagnostics_bounds(&oracle_diagnostics, &case, &selections, REQUIRED).map_err(fail)?;
    }
}

#[test]
fn candidate_count_formula_is_logarithmic_while_bsa_is_linear() {
    // Closed form from the descent rule: the root, then β·min(K, width above) per finer level.
    for (levels, branching, keep) in [(3u32, 4usize, 4usize), (6, 2, 3), (5, 3, 8)] {
        let mut by_walk = 1;
        let mut width_above = 1;
        for _ in 0..levels {
            by_walk += branching * keep.min(width_above);
            width_above *= branching;
        }
        assert_eq!(descent_candidate_count(levels, branching, keep), by_walk);
        assert!(by_walk <= 1 + levels as usize * keep * branching);
    }
    // N/C = 4^8 leaves: BSA scores 65536 candidates, the pyramid 1 + 4 + 16·7 = 117.
    assert_eq!(descent_candidate_count(8, 4, 4), 1 + 4 + 16 * 7);
}

/// An MPFR problem in `d = 1` with `q = [1]`, so every score is a key value (`α = 1`).
fn scalar_case(keys: &[f64], leaf_size: usize, branching: usize, keep: usize, position: usize) -> DescentCase {
    DescentCase {
        keys: mp_matrix(keys.len(), 1, keys),
        heads: mp_matrix(1, 1, &[1.0]),
        position,
        config: PyramidConfig { leaf_size, branching, keep, scoring: Scoring::Lse },
    }
}

/// An intermediate scorer that forgets the count normalization: `log Σ_c` instead of `log mean_c`.
fn child_sum_lse(query: ArrayView1<'_, Mp>, keys: ArrayView2<'_, Mp>, child_size: usize) -> Mp {
    let means = block_means(keys, child_size, PREC);
    let alpha = Mp::one(PREC) / Mp::from_f64(query.len() as f64, PREC).sqrt();
    let scores: Vec<Mp> = means
        .rows()
        .into_iter()
        .map(|m| m.iter().zip(query).fold(Mp::zero(PREC), |a, (x, y)| a + x.clone() * y.clone()) * alpha.clone())
        .collect();
    log_sum_exp(&scores, PREC)
}

#[test]
fn jensen_ordering_rejects_an_lse_without_the_count_normalization() {
    // Equal logits within each child make the raw-key LSE equal the child-mean LSE, so the
    // unnormalized log Σ (larger by log 2) overshoots it.
    let case = NodeCase {
        query: Array1::from(vec![Mp::new(1.0, PREC)]),
        keys: mp_matrix(4, 1, &[1.0, 1.0, -1.0, -1.0]),
        child_size: 2,
    };
    assert!(jensen_ordering(&oracle_child_mean_lse, &case, REQUIRED, REQUIRED).is_ok());
    let err = jensen_ordering(&child_sum_lse, &case, REQUIRED, REQUIRED).unwrap_err();
    assert!(matches!(err, Violation::Bound { quantity: "child-mean LSE <= raw-key LSE", .. }), "{err}");
}

/// Ways a descent can go wrong, each built from the oracle's own steps.
#[derive(Clone, Copy)]
enum BrokenDescent {
    /// Keeps only `K − 1` nodes at this level.
    KeepsOneFewerAt(usize),
    /// Expands the children of every candidate instead of only the kept ones.
    ExpandsEveryCandidate,
    /// Scores with the first query head only, ignoring the rest of the GQA group.
    FirstHeadOnly,
    /// Re-ranks the leaves by score ignoring every forced block.
    DropsForcedLeaves,
    /// Forces the first and previous leaves but ranks the current leaf by its score, which sees
    /// the current block's future keys.
    RanksCurrentLeafByScore,
}

impl BrokenDescent {
    fn run(self, case: &DescentCase) -> Result<Descent<Mp>, OracleError> {
        let p = Pyramid::build(case.keys.view(), &case.config, PREC)?;
        let heads = match self {
            BrokenDescent::FirstHeadOnly => case.heads.slice_axis(Axis(0), Slice::from(0..1)),
            _ => case.heads.view(),
        };
        let query = pyramid::PyramidQuery { heads, position: case.position };
        let top = p.levels().len() - 1;
        let mut candidates: Vec<usize> = (0..p.width(top)).collect();
        let mut trace = Vec::new();
        for level in (0..=top).rev() {
            let keep = match self {
                BrokenDescent::KeepsOneFewerAt(l) if l == level => case.config.keep - 1,
                _ => case.config.keep,
            };
            let mut step = descent_step(&p, level, &candidates, &query, keep, case.config.scoring)?;
            let parents = match self {
                BrokenDescent::ExpandsEveryCandidate => step.candidates.clone(),
                _ => step.kept.clone(),
            };
            candidates = expand(&p, level, &parents);
            if level == 0 {
                let forced_leaves = pyramid::forced_leaves(case.position, case.config.leaf_size);
                let current = case.position / case.config.leaf_size;
                let forced: Vec<usize> = match self {
                    BrokenDescent::DropsForcedLeaves => vec![],
                    BrokenDescent::RanksCurrentLeafByScore => {
                        forced_leaves.into_iter().filter(|&f| f != current).collect()
                    }
                    _ => forced_leaves,
                };
                let slots: Vec<usize> =
                    (0..step.candidates.len()).filter(|&i| forced.contains(&step.candidates[i])).collect();
                let ranked: Vec<Mp> =
                    step.scores.iter().map(|s| s.clone().unwrap_or_else(|| Mp::neg_infinity(PREC))).collect();
                let mut kept: Vec<usize> = top_k(&ranked, case.config.keep, |i| step.scores[i].is_some(), &slots)
                    .into_iter()
                    .map(|i| step.candidates[i])
                    .collect();
                kept.sort_unstable();
                step.kept = kept;
            }
            trace.push(step);
        }
        Ok(finish_descent(trace, case.position, &case.config))
    }
}

/// 8 leaves of 2 keys, `β = 2` (widths 8, 4, 2, 1), `K = 4`, query at the end (forced 0, 6, 7).
/// Leaf 2 = {5, −5} has the best exact LSE but a mean of 0, and its sibling leaf 3 = {−3, −3}
/// drags their parent below the parent of leaves 4, 5 = {1, 1}: keeping 3 instead of 4 parents
/// at level 1 loses leaf 2.
fn pruning_matters() -> DescentCase {
    let keys = [0.0, 0.0, 0.0, 0.0, 5.0, -5.0, -3.0, -3.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
    scalar_case(&keys, 2, 2, 4, 15)
}

#[test]
fn exhaustive_equivalence_rejects_a_descent_that_keeps_one_fewer() {
    let case = pruning_matters();
    assert!(exhaustive_when_unpruned(&oracle_descent, &case).is_ok());
    let broken = |c: &DescentCase| BrokenDescent::KeepsOneFewerAt(1).run(c);
    let err = exhaustive_when_unpruned(&broken, &case).unwrap_err();
    assert!(matches!(err, Violation::Residual { quantity: "selected leaves", .. }), "{err}");
    // The variant is the oracle's descent whenever the budget is not cut.
    let honest = |c: &DescentCase| BrokenDescent::KeepsOneFewerAt(usize::MAX).run(c);
    assert_eq!(honest(&case).unwrap(), oracle_descent(&case).unwrap());
}

#[test]
fn descent_rule_rejects_first_head_scoring_and_a_short_budget() {
    let mut case = pruning_matters();
    case.heads = mp_matrix(2, 1, &[1.0, -0.5]);
    assert!(descent_rule(&oracle_descent, &case, REQUIRED).is_ok());
    let first_head = |c: &DescentCase| BrokenDescent::FirstHeadOnly.run(c);
    let err = descent_rule(&first_head, &case, REQUIRED).unwrap_err();
    assert!(matches!(err, Violation::Residual { quantity: "summed scores", .. }), "{err}");
    let short = |c: &DescentCase| BrokenDescent::KeepsOneFewerAt(1).run(c);
    let err = descent_rule(&short, &case, REQUIRED).unwrap_err();
    assert!(matches!(err, Violation::Residual { quantity: "kept nodes", .. }), "{err}");
}

/// Query at key 8, the first key of leaf 4 = {−5, +10}: the future key 9 makes the current leaf
/// look best. Leaves 0 and 3 are forced and weak ({−5, −5}); leaves 1, 2, 5–7 are {0, 0}.
fn future_in_current_leaf() -> (DescentCase, Array2<Mp>) {
    let keys = [-5.0, -5.0, 0.0, 0.0, 0.0, 0.0, -5.0, -5.0, -5.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    let future = [-10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    (scalar_case(&keys, 2, 2, 4, 8), mp_matrix(7, 1, &future))
}

#[test]
fn causality_rejects_dropped_forced_leaves_and_a_current_leaf_ranked_by_future_keys() {
    let (case, future) = future_in_current_leaf();
    assert!(causality(&oracle_descent, &case, future.view()).is_ok());
    let drops = |c: &DescentCase| BrokenDescent::DropsForcedLeaves.run(c);
    let err = causality(&drops, &case, future.view()).unwrap_err();
    assert!(matches!(err, Violation::Residual { quantity: "selection including the forced leaves", .. }), "{err}");
    // Ranked by its future-containing score, the current leaf is selected now, so every forced
    // leaf is present; only changing the future keys exposes it.
    let ranks = |c: &DescentCase| BrokenDescent::RanksCurrentLeafByScore.run(c);
    assert!(ranks(&case).unwrap().selected_leaves().contains(&4));
    let err = causality(&ranks, &case, future.view()).unwrap_err();
    assert!(matches!(err, Violation::Residual { quantity: "selection after changing future keys", .. }), "{err}");
}

#[test]
fn candidate_count_rejects_a_descent_that_expands_every_candidate() {
    // N = 1·2^3, K = 3: the honest descent scores 1 + 2 + 4 + 6 = 13, expanding all scores 15.
    let keys: Vec<f64> = attnproof_oracle::inputs::uniform(3, 8);
    let mut case = scalar_case(&keys, 1, 2, 3, 7);
    assert!(candidate_count(&oracle_descent, &case).is_ok());
    let everything = |c: &DescentCase| BrokenDescent::ExpandsEveryCandidate.run(c);
    let err = candidate_count(&everything, &case).unwrap_err();
    assert!(matches!(err, Violation::Residual { quantity: "candidates scored", .. }), "{err}");
    case.position = 6;
    assert!(matches!(candidate_count(&oracle_descent, &case), Err(Violation::Hypothesis { .. })));
}

/// Diagnostics whose reference set ranks leaves by the pooled mean score (BSA-style) instead of
/// the exact attention mass.
fn mean_score_reference(case: &DescentCase, selected: &[i32]) -> Result<Diagnostics<Mp>, OracleError> {
    let honest = oracle_diagnostics(case, selected)?;
    let p = Pyramid::build(case.keys.view(), &case.config, PREC)?;
    let scores: Vec<Mp> = (0..p.n_leaves())
        .map(|b| {
            case.heads
                .rows()
                .into_iter()
                .fold(Mp::zero(PREC), |a, q| a + p.node_score(0, b, q, Scoring::Pisa1).unwrap())
        })
        .collect();
    let forced = pyramid::forced_leaves(case.position, case.config.leaf_size);
    let mut reference = top_k(&scores, case.config.keep, |b| b * case.config.leaf_size <= case.position, &forced);
    reference.sort_unstable();
    let mass = |set: &[usize]| set.iter().fold(Mp::zero(PREC), |a, &b| a + honest.block_mass[b].clone());
    let chosen: Vec<usize> = selected.iter().filter(|&&x| x >= 0).map(|&x| x as usize).collect();
    let hits = chosen.iter().filter(|b| reference.contains(b)).count();
    Ok(Diagnostics {
        recall: Mp::from_f64(hits as f64, PREC) / Mp::from_f64(reference.len() as f64, PREC),
        captured: mass(&chosen),
        reference_captured: mass(&reference),
        mass_ratio: mass(&chosen) / mass(&reference),
        reference,
        block_mass: honest.block_mass,
    })
}

#[test]
fn diagnostics_reject_a_reference_ranked_by_mean_score() {
    // Leaf 2 = {6, −6} holds most of the mass with a mean score of 0; leaves 1, 3–5 = {1, 1}.
    let keys = [0.0, 0.0, 1.0, 1.0, 6.0, -6.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
    let case = scalar_case(&keys, 2, 2, 4, 15);
    let selection = oracle_descent(&case).unwrap().selected;
    assert!(selection.contains(&2));
    assert!(diagnostics_bounds(&oracle_diagnostics, &case, std::slice::from_ref(&selection), REQUIRED).is_ok());
    let err = diagnostics_bounds(&mean_score_reference, &case, &[selection], REQUIRED).unwrap_err();
    assert!(matches!(err, Violation::Residual { quantity: "reference captured mass = best achievable", .. }), "{err}");
}
