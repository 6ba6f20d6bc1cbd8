//! Selection (E12, E17), block-score (E15) and PISA-tail (E22, E23) theorems on proptest
//! inputs against the oracle, and each against a broken variant that it must reject.

use std::ops::Range;

use crate::common::{PREC, REQUIRED, fail, mp_matrix, mp_vector, pseudo_random};
use attnproof_oracle::block_scores::{BlockScore, block_score};
use attnproof_oracle::pisa::{
    BlockClasses, TailOutput, TailRule, TailStatistics, classify_blocks, tail_backward, tail_output, tail_statistics,
};
use attnproof_oracle::selection::{block_states, decompose_row, key_blocks};
use attnproof_oracle::{Mp, Real, SoftmaxState};
use attnproof_proofs::block_scores::{block_score_identity, second_order_limit};
use attnproof_proofs::pisa::{
    SpreadProblem, TailBackward, TailGradientCase, decomposed_tail_backward, first_order_denominator_vanishes,
    oracle_first_order, oracle_pisa, oracle_tail_backward, pisa_within_bound, tail_error_is_second_order,
    tail_gradients_match_finite_differences,
};
use attnproof_proofs::residual::Bits;
use attnproof_proofs::selection::{block_split_is_exact, mass_decomposition};
use ndarray::{Array1, Array2, ArrayView1, ArrayView2};
use proptest::prelude::*;

fn oracle_states(
    s: ArrayView1<'_, Mp>,
    vis: ArrayView1<'_, bool>,
    v: ArrayView2<'_, Mp>,
    blocks: &[Range<usize>],
) -> Vec<SoftmaxState<Mp>> {
    block_states(s, vis, v, blocks, PREC)
}

fn oracle_score(q: ArrayView1<'_, Mp>, k: ArrayView2<'_, Mp>, scale: &Mp) -> BlockScore<Mp> {
    block_score(q, k, scale, PREC)
}

fn oracle_stats(k: ArrayView2<'_, Mp>, v: ArrayView2<'_, Mp>, block: usize) -> TailStatistics<Mp> {
    tail_statistics(k, v, block, PREC)
}

/// A row of `n` logits up to ±`logit`, visibility, values `[n, dv]`, a selection, a block size.
fn row() -> impl Strategy<Value = (Array1<Mp>, Array1<bool>, Array2<Mp>, Array1<bool>, usize)> {
    (1usize..=12, 1usize..=3, 1usize..=5, prop::sample::select(vec![1.0, 30.0, 1000.0])).prop_flat_map(
        |(n, dv, block, logit)| {
            (
                prop::collection::vec(-logit..=logit, n),
                prop::collection::vec(prop::bool::weighted(0.8), n),
                prop::collection::vec(-3.0f64..=3.0, n * dv),
                prop::collection::vec(any::<bool>(), n),
                Just((n, dv, block)),
            )
                .prop_map(|(s, vis, v, sel, (n, dv, block))| {
                    (mp_vector(&s), Array1::from(vis), mp_matrix(n, dv, &v), Array1::from(sel), block)
                })
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn block_split_is_exact_for_every_block_size((s, vis, v, _sel, block) in row()) {
        block_split_is_exact(&oracle_states, s.view(), vis.view(), v.view(), &key_blocks(s.len(), block), REQUIRED).map_err(fail)?;
    }

    #[test]
    fn mass_decomposition_holds((s, vis, v, sel, _block) in row()) {
        let has = |keep: bool| (0..s.len()).any(|j| vis[j] && sel[j] == keep);
        prop_assume!(has(true) && has(false));
        mass_decomposition(&|s, vis, v, sel| decompose_row(s, vis, v, sel, PREC), s.view(), vis.view(), v.view(), sel.view(), REQUIRED).map_err(fail)?;
    }

    #[test]
    fn block_scores_decompose_exactly(
        (q, k, n) in (1usize..=4, 1usize..=8).prop_flat_map(|(d, n)| {
            (prop::collection::vec(-3.0f64..=3.0, d), prop::collection::vec(-3.0f64..=3.0, n * d), Just(n))
        }),
        scale in prop::sample::select(vec![0.5, 4.0, 40.0]),
    ) {
        let keys = mp_matrix(n, q.len(), &k);
        block_score_identity(&oracle_score, mp_vector(&q).view(), keys.view(), &Mp::new(scale, PREC), REQUIRED).map_err(fail)?;
    }
}

fn halving(from: i32, count: i32) -> Vec<Mp> {
    (0..count).map(|i| Mp::new(2f64.powi(-(from + i)), PREC)).collect()
}

/// A block of 6 keys in d = 3 around a random center, random directions.
fn spread_block(seed: u64) -> (Array1<Mp>, Array1<Mp>, Array2<Mp>) {
    let r = pseudo_random(seed, 3 + 3 + 18);
    (mp_vector(&r[0..3]), mp_vector(&r[3..6]), mp_matrix(6, 3, &r[6..24]))
}

#[test]
fn second_order_limit_holds_and_rejects_var_without_half() {
    let scale = Mp::new(2.0, PREC);
    for seed in 1..=8 {
        let (q, center, dirs) = spread_block(seed);
        second_order_limit(&oracle_score, q.view(), center.view(), dirs.view(), &scale, &halving(6, 10), REQUIRED)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    }
    let full_variance = |q: ArrayView1<'_, Mp>, k: ArrayView2<'_, Mp>, a: &Mp| {
        let s = block_score(q, k, a, PREC);
        BlockScore { second_order: s.second_order.clone() * Mp::new(2.0, PREC), ..s }
    };
    let (q, center, dirs) = spread_block(1);
    assert!(
        second_order_limit(&full_variance, q.view(), center.view(), dirs.view(), &scale, &halving(6, 10), REQUIRED)
            .is_err()
    );
}

#[test]
fn block_score_identity_rejects_a_sum_pooled_score() {
    let (q, center, dirs) = spread_block(3);
    let keys = Array2::from_shape_fn(dirs.dim(), |(j, c)| center[c].clone() + dirs[[j, c]].clone());
    let a = Mp::new(1.5, PREC);
    assert!(block_score_identity(&oracle_score, q.view(), keys.view(), &a, REQUIRED).is_ok());
    let summed = |q: ArrayView1<'_, Mp>, k: ArrayView2<'_, Mp>, a: &Mp| {
        let s = block_score(q, k, a, PREC);
        BlockScore { pooled: s.pooled.clone() * s.log_count.exp(), ..s }
    };
    assert!(block_score_identity(&summed, q.view(), keys.view(), &a, REQUIRED).is_err());
}

#[test]
fn block_split_rejects_a_split_that_loses_the_last_partial_block() {
    let s = mp_vector(&pseudo_random(4, 7));
    let vis = Array1::from_elem(7, true);
    let v = mp_matrix(7, 2, &pseudo_random(5, 14));
    let blocks = key_blocks(7, 3);
    assert!(block_split_is_exact(&oracle_states, s.view(), vis.view(), v.view(), &blocks, REQUIRED).is_ok());
    let lossy = |s: ArrayView1<'_, Mp>, vis: ArrayView1<'_, bool>, v: ArrayView2<'_, Mp>, blocks: &[Range<usize>]| {
        block_states(s, vis, v, &blocks[..blocks.len() - 1], PREC)
    };
    assert!(block_split_is_exact(&lossy, s.view(), vis.view(), v.view(), &blocks, REQUIRED).is_err());
}

#[test]
fn mass_decomposition_rejects_a_count_based_lambda() {
    let s = mp_vector(&[0.5, -1.0, 2.0, 0.25]);
    let vis = Array1::from_elem(4, true);
    let v = mp_matrix(4, 1, &[0.0, 3.0, 9.0, -1.0]);
    let sel = Array1::from(vec![true, true, false, false]);
    let decompose = |s: ArrayView1<'_, Mp>,
                     vis: ArrayView1<'_, bool>,
                     v: ArrayView2<'_, Mp>,
                     sel: ArrayView1<'_, bool>| decompose_row(s, vis, v, sel, PREC);
    assert!(mass_decomposition(&decompose, s.view(), vis.view(), v.view(), sel.view(), REQUIRED).is_ok());
    let by_count =
        |s: ArrayView1<'_, Mp>, vis: ArrayView1<'_, bool>, v: ArrayView2<'_, Mp>, sel: ArrayView1<'_, bool>| {
            let d = decompose_row(s, vis, v, sel, PREC);
            attnproof_oracle::selection::MassDecomposition { lambda: Mp::new(0.5, PREC), ..d }
        };
    assert!(mass_decomposition(&by_count, s.view(), vis.view(), v.view(), sel.view(), REQUIRED).is_err());
}

#[test]
fn denominator_term_vanishes_and_rejects_deviations_from_the_first_key() {
    let k = mp_matrix(10, 3, &pseudo_random(6, 30));
    let v = mp_matrix(10, 2, &pseudo_random(7, 20));
    assert!(first_order_denominator_vanishes(&oracle_stats, k.view(), v.view(), 4, REQUIRED).is_ok());
    let first_key_center = |k: ArrayView2<'_, Mp>, v: ArrayView2<'_, Mp>, block: usize| {
        let mut s = tail_statistics(k, v, block, PREC);
        for b in 0..s.counts.len() {
            s.means.row_mut(b).assign(&k.row(b * block));
        }
        s
    };
    assert!(first_order_denominator_vanishes(&first_key_center, k.view(), v.view(), 4, REQUIRED).is_err());
}

/// Four blocks of 4 keys, d = 3, dv = 2; block 1 exact, blocks 0, 2, 3 in the tail.
fn spread_problem(seed: u64, shared_h: bool) -> SpreadProblem {
    let r = pseudo_random(seed, 3 + 12 + 48 + 32);
    let mut directions = mp_matrix(16, 3, &r[15..63]);
    if shared_h {
        // Every block gets the same deviations, hence the same H_b = H̄ when the values repeat too.
        for j in 4..16 {
            let src = directions.row(j % 4).to_owned();
            directions.row_mut(j).assign(&src);
        }
    }
    let mut v = mp_matrix(16, 2, &r[63..95]);
    if shared_h {
        for j in 4..16 {
            let src = v.row(j % 4).to_owned();
            v.row_mut(j).assign(&src);
        }
    }
    SpreadProblem {
        q: mp_vector(&r[0..3]),
        centers: mp_matrix(4, 3, &r[3..15].iter().map(|x| 2.0 * x).collect::<Vec<_>>()),
        directions,
        v,
        block_size: 4,
        classes: BlockClasses { exact: vec![1], tail: vec![0, 2, 3] },
        scale: Mp::new(1.5, PREC),
    }
}

fn zeroth_order(
    q: ArrayView1<'_, Mp>,
    k: ArrayView2<'_, Mp>,
    v: ArrayView2<'_, Mp>,
    vis: ArrayView1<'_, bool>,
    c: &BlockClasses,
    s: &TailStatistics<Mp>,
    a: &Mp,
) -> TailOutput<Mp> {
    tail_output(q, k, v, vis, c, s, a, TailRule::ZerothOrder, PREC)
}

#[test]
fn first_order_tail_error_is_second_order_and_zeroth_order_is_not() {
    for seed in 1..=6 {
        let p = spread_problem(seed, false);
        tail_error_is_second_order(&oracle_first_order, &oracle_stats, &p, &halving(8, 6), REQUIRED)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    }
    let p = spread_problem(1, false);
    assert!(tail_error_is_second_order(&zeroth_order, &oracle_stats, &p, &halving(8, 6), REQUIRED).is_err());
}

#[test]
fn pisa_stays_within_the_e23_bound_and_a_pisa_without_h_bar_does_not() {
    for seed in 1..=12 {
        for t in [0.5, 0.125, 2f64.powi(-10)] {
            let p = spread_problem(seed, seed % 3 == 0);
            pisa_within_bound(&oracle_pisa, &oracle_stats, &p, &Mp::new(t, PREC))
                .unwrap_or_else(|e| panic!("seed {seed}, t {t}: {e}"));
        }
    }
    // With H_b = H̄ everywhere the E23 bound is 0, so the PISA error is pure truncation; leaving
    // out H̄ adds a first-order error that the theorem must catch.
    let p = spread_problem(2, true);
    assert!(pisa_within_bound(&oracle_pisa, &oracle_stats, &p, &Mp::new(2f64.powi(-10), PREC)).is_ok());
    assert!(pisa_within_bound(&zeroth_order, &oracle_stats, &p, &Mp::new(2f64.powi(-10), PREC)).is_err());
}

/// One head of the tail's gradient theorem: 5 queries over 10 keys in blocks of 4 (the last block partial), `d = 3`,
/// `dv = 2`, causal (bottom-right) or unmasked, each row's list given by `listed(row)`.
fn gradient_case(seed: u64, causal: bool, listed: impl Fn(usize) -> Vec<usize>) -> TailGradientCase {
    let (lq, lk, d, dv) = (5, 10, 3, 2);
    let r = pseudo_random(seed, lq * d + lk * (d + dv) + lq * dv);
    let (q, rest) = r.split_at(lq * d);
    let (k, rest) = rest.split_at(lk * d);
    let (v, d_o) = rest.split_at(lk * dv);
    let visible = Array2::from_shape_fn((lq, lk), |(i, j)| !causal || j <= i + lk - lq);
    let classes = (0..lq).map(|i| classify_blocks(visible.row(i), 4, &listed(i))).collect();
    TailGradientCase {
        q: mp_matrix(lq, d, q),
        k: mp_matrix(lk, d, &k.iter().map(|x| 1.5 * x).collect::<Vec<_>>()),
        v: mp_matrix(lk, dv, v),
        visible,
        classes,
        block_size: 4,
        scale: Mp::new(0.75, PREC),
        d_o: mp_matrix(lq, dv, d_o),
    }
}

/// 60 of the 256 bits: the central difference at `h = 2^-80` leaves `O(2^-160)` of truncation and `O(2^-176)` of
/// cancellation.
const GRADIENT_BITS: Bits = Bits(60.0);

#[test]
fn the_tail_backward_is_the_gradient_of_the_pisa_output() {
    for seed in 1..=4 {
        for causal in [false, true] {
            // Rows list nothing, block 1, or blocks 0 and 2: the tail ranges from every whole block to none.
            let case = gradient_case(seed, causal, |i| match i % 3 {
                0 => vec![],
                1 => vec![1],
                _ => vec![0, 2],
            });
            assert!(
                case.classes.iter().any(|c| !c.tail.is_empty()) && case.classes.iter().any(|c| !c.exact.is_empty())
            );
            tail_gradients_match_finite_differences(&oracle_tail_backward, &case, 80, GRADIENT_BITS)
                .unwrap_or_else(|e| panic!("seed {seed}, causal {causal}: {e}"));
            // The GPU plan's decomposition (exact part with the PISA LSE, pooled part with δ') is the same gradient.
            tail_gradients_match_finite_differences(&decomposed_tail_backward, &case, 80, GRADIENT_BITS)
                .unwrap_or_else(|e| panic!("decomposed, seed {seed}, causal {causal}: {e}"));
        }
    }
}

/// The oracle's backward with its statistics and classes changed first: a broken backward to reject.
fn altered_backward(
    stats_of: fn(&TailStatistics<Mp>) -> TailStatistics<Mp>,
    classes_of: fn(&[BlockClasses]) -> Vec<BlockClasses>,
) -> Box<TailBackward> {
    Box::new(move |q, k, v, visible, classes, stats, scale, d_o| {
        tail_backward(q, k, v, visible, &classes_of(classes), &stats_of(stats), scale, d_o, PREC)
    })
}

/// A backward that ignores the shared term (`H̄` taken as 0: no `dq` through `qᵀH̄`, no `dk`, `dv` through `H̄`), and
/// one that differentiates the exact part alone (the tail dropped), are not the gradient.
#[test]
fn tail_backwards_without_h_bar_or_without_the_tail_are_rejected() {
    let case = gradient_case(5, true, |i| if i % 2 == 0 { vec![] } else { vec![1] });
    let same_classes = |c: &[BlockClasses]| c.to_vec();
    let without_h_bar =
        altered_backward(|s| TailStatistics { h_bar: s.h_bar.mapv(|_| Mp::zero(PREC)), ..s.clone() }, same_classes);
    assert!(tail_gradients_match_finite_differences(&*without_h_bar, &case, 80, GRADIENT_BITS).is_err());
    let exact_only = altered_backward(
        |s| s.clone(),
        |c| c.iter().map(|c| BlockClasses { exact: c.exact.clone(), tail: vec![] }).collect(),
    );
    assert!(tail_gradients_match_finite_differences(&*exact_only, &case, 80, GRADIENT_BITS).is_err());
    // The unaltered oracle passes the same case: the rejections are the alterations'.
    let same = altered_backward(|s| s.clone(), same_classes);
    assert!(tail_gradients_match_finite_differences(&*same, &case, 80, GRADIENT_BITS).is_ok());
}
