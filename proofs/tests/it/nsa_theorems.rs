//! The NSA theorems (E18–E20) on proptest inputs against the oracle, and each against a broken
//! implementation that it must reject.

use crate::common::{PREC, REQUIRED, fail, mp_matrix, pseudo_random, values};
use attnproof_oracle::nsa::{
    BlockQueries, Compression, MapGradient, NsaConfig, NsaInputs, complete_windows, complete_windows_at, compress,
    remap_to_blocks, selected_attention, selection_blocks, transpose_selection,
};
use attnproof_oracle::nsa_backward::NsaGradients;
use attnproof_oracle::topk::{padded_ascending, top_k};
use attnproof_oracle::{Mp, OracleError, Real};
use attnproof_proofs::nsa::{
    CompressionCase, GateCase, LayerCase, NsaCase, SelectionCase, complete_window_count,
    compression_gradients_match_finite_differences, csr_round_trip, gate_gradients_match_finite_differences,
    layer_gradients_match_finite_differences, layer_map_gradients_match_finite_differences, measured_remap_weights,
    oracle_compress_backward, oracle_gate_backward, oracle_layer_backward, oracle_nsa_forward, oracle_remap,
    oracle_selector, paper_double_sum_reindexed, position_maps_are_linear_maps, remap_matches_token_count,
    remap_weights_are_overlaps, selection_alone_is_dense_when_all_selected, selection_invariants,
};
use ndarray::{Array2, Array3, ArrayView2, ArrayView3, Axis};
use proptest::prelude::*;

/// A config with small lengths; `dividing` makes `s | l` and `s | l'` (the hypothesis of the
/// paper's double sum).
fn small_config(dividing: bool) -> impl Strategy<Value = NsaConfig> {
    let lengths = if dividing {
        (1usize..=3, 1usize..=3, 1usize..=4).prop_map(|(s, a, b)| (s * a, s, s * b)).boxed()
    } else {
        (1usize..=6, 1usize..=4, 1usize..=8).boxed()
    };
    lengths.prop_map(|(compress_len, compress_stride, select_block)| NsaConfig {
        compress_len,
        compress_stride,
        select_block,
        n_selected: 4,
        window: 5,
        ..NsaConfig::default()
    })
}

/// Window probabilities `[rows, W]` for a sequence of up to 40 tokens under `config`, with the
/// number of blocks.
fn remap_problem(dividing: bool) -> impl Strategy<Value = (NsaConfig, Array2<Mp>, usize)> {
    (small_config(dividing), 1usize..=40, 1usize..=2).prop_flat_map(|(config, len, rows)| {
        let windows = complete_windows(len, config.compress_len, config.compress_stride).expect("valid");
        let blocks = selection_blocks(len, config.select_block).expect("valid");
        prop::collection::vec(0.0f64..=1.0, rows * windows)
            .prop_map(move |p| (config.clone(), mp_matrix(rows, windows, &p), blocks))
    })
}

/// The paper's Eq. 9 as printed, without the `+(l'/s − 1)` shift: block `j` reads windows
/// `(l'/s)·j − m − n`, i.e. `4j−4 … 4j` for `l=32, s=16, l'=64`.
fn unshifted_paper_sum(p: ArrayView2<'_, Mp>, n_blocks: usize, config: &NsaConfig) -> Result<Array2<Mp>, OracleError> {
    let blocks_per = config.select_block / config.compress_stride;
    let windows_per = config.compress_len / config.compress_stride;
    let mut out = Array2::from_elem((p.nrows(), n_blocks), Mp::zero(PREC));
    for j in 0..n_blocks {
        for m in 0..blocks_per {
            for n in 0..windows_per {
                if let Some(c) = (blocks_per * j).checked_sub(m + n).filter(|&c| c < p.ncols()) {
                    for r in 0..p.nrows() {
                        out[[r, j]] += p[[r, c]].clone();
                    }
                }
            }
        }
    }
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn remap_overlap_form_equals_the_token_count((config, p, blocks) in remap_problem(false)) {
        remap_matches_token_count(&oracle_remap, p.view(), blocks, &config, REQUIRED).map_err(fail)?;
        remap_weights_are_overlaps(&oracle_remap, p.ncols(), blocks, &config, PREC, REQUIRED).map_err(fail)?;
    }

    #[test]
    fn reindexed_paper_double_sum_equals_the_overlap_form((config, p, blocks) in remap_problem(true)) {
        paper_double_sum_reindexed(&oracle_remap, p.view(), blocks, &config, REQUIRED).map_err(fail)?;
    }
}

#[test]
fn paper_weights_of_block_j_are_the_window_overlaps_4j_minus_1_to_4j_plus_3() {
    let config = NsaConfig::default();
    let (l, s, block) = (config.compress_len, config.compress_stride, config.select_block);
    let len = 6 * block;
    let windows = complete_windows(len, l, s).expect("valid");
    let blocks = selection_blocks(len, block).expect("valid");
    let weights = measured_remap_weights(&oracle_remap, windows, blocks, &config, PREC).expect("valid");
    remap_weights_are_overlaps(&oracle_remap, windows, blocks, &config, PREC, REQUIRED).expect("overlap weights");
    for j in 1..blocks - 1 {
        // Brute force: count the tokens of window c that fall in block j.
        let counts: Vec<usize> = (0..windows).map(|c| (c * s..c * s + l).filter(|&x| x / block == j).count()).collect();
        let support: Vec<usize> = (0..windows).filter(|&c| counts[c] > 0).collect();
        // The windows touching block j run from the one ending s tokens into it to the one
        // starting s tokens before its end: (l'/s)·j − (l/s − 1) ..= (l'/s)·j + l'/s − 1.
        let first = (block / s) * j + 1 - l / s;
        let last = (block / s) * j + block / s - 1;
        assert_eq!(support, (first..=last).collect::<Vec<_>>());
        for c in 0..windows {
            assert_eq!(weights[[c, j]], Mp::new(counts[c] as f64 / s as f64, PREC), "window {c}, block {j}");
        }
        // The end windows share s tokens with the block, the inner ones all l = 2s.
        assert_eq!(counts[first], s);
        assert!(support[1..support.len() - 1].iter().all(|&c| counts[c] == l));
    }
}

#[test]
fn remap_theorems_reject_the_unshifted_paper_sum() {
    let config = NsaConfig::default();
    let len = 5 * config.select_block;
    let windows = complete_windows(len, config.compress_len, config.compress_stride).expect("valid");
    let blocks = selection_blocks(len, config.select_block).expect("valid");
    let p = mp_matrix(1, windows, &pseudo_random(11, windows));
    assert!(paper_double_sum_reindexed(&oracle_remap, p.view(), blocks, &config, REQUIRED).is_ok());
    assert!(paper_double_sum_reindexed(&unshifted_paper_sum, p.view(), blocks, &config, REQUIRED).is_err());
    assert!(remap_matches_token_count(&unshifted_paper_sum, p.view(), blocks, &config, REQUIRED).is_err());
    assert!(remap_weights_are_overlaps(&unshifted_paper_sum, windows, blocks, &config, PREC, REQUIRED).is_err());
}

#[test]
fn double_sum_theorem_refuses_a_stride_that_does_not_divide() {
    let config = NsaConfig { compress_len: 5, compress_stride: 2, select_block: 8, ..NsaConfig::default() };
    let p = mp_matrix(1, 3, &[0.1, 0.2, 0.3]);
    let err = paper_double_sum_reindexed(&oracle_remap, p.view(), 2, &config, REQUIRED).unwrap_err();
    assert!(matches!(err, attnproof_proofs::Violation::Hypothesis { .. }), "{err}");
}

/// A selection case: `Hq = Hkv·G` heads over up to 40 tokens, `l = 4, s = 2, l' = 8` or
/// `l = 2, s = 1, l' = 4`, `n` from 3 to 5.
fn selection_case() -> impl Strategy<Value = SelectionCase> {
    (1usize..=2, 1usize..=3, 1usize..=40, prop::bool::ANY, 3usize..=5).prop_flat_map(
        |(n_heads_kv, group, len, coarse, n_selected)| {
            let (compress_len, compress_stride, select_block) = if coarse { (4, 2, 8) } else { (2, 1, 4) };
            let config = NsaConfig { compress_len, compress_stride, select_block, n_selected, ..NsaConfig::default() };
            let windows = complete_windows(len, compress_len, compress_stride).expect("valid");
            let n_heads_q = n_heads_kv * group;
            prop::collection::vec(0.0f64..=1.0, n_heads_q * len * windows).prop_map(move |p| SelectionCase {
                p_cmp: Array3::from_shape_vec((n_heads_q, len, windows), p.iter().map(|&x| Mp::new(x, PREC)).collect())
                    .expect("sizes agree"),
                n_heads_kv,
                config: config.clone(),
            })
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn selection_is_forced_causal_shared_and_top_n(case in selection_case()) {
        selection_invariants(&oracle_selector, &case).map_err(fail)?;
    }
}

/// Which mistake a broken selector makes.
#[derive(Clone, Copy)]
enum BrokenSelector {
    /// Forces the initial blocks but forgets the local ones.
    ForgetsLocalBlocks,
    /// Ranks each query head's own remapped scores instead of the group sum.
    PerHead,
}

impl BrokenSelector {
    fn select(self, case: &SelectionCase) -> Result<Array3<i32>, OracleError> {
        let config = &case.config;
        let (n_heads_q, len, _) = case.p_cmp.dim();
        let group = n_heads_q / case.n_heads_kv;
        let n_blocks = selection_blocks(len, config.select_block)?;
        let mut out = Array3::from_elem((len, n_heads_q, config.n_selected), -1);
        for h in 0..n_heads_q {
            let heads = match self {
                BrokenSelector::ForgetsLocalBlocks => h / group * group..(h / group + 1) * group,
                BrokenSelector::PerHead => h..h + 1,
            };
            let summed = Array2::from_shape_fn((len, case.p_cmp.dim().2), |(t, c)| {
                heads.clone().fold(Mp::zero(PREC), |acc, g| acc + case.p_cmp[[g, t, c]].clone())
            });
            let scores = remap_to_blocks(summed.view(), n_blocks, config, PREC)?;
            for t in 0..len {
                let forced = match self {
                    BrokenSelector::ForgetsLocalBlocks => (0..config.n_forced_initial).collect(),
                    BrokenSelector::PerHead => config.forced_blocks(t),
                };
                let row = scores.row(t).to_vec();
                let chosen = top_k(&row, config.n_selected, |j| config.block_eligible(j, t), &forced);
                out.index_axis_mut(Axis(0), t)
                    .row_mut(h)
                    .assign(&ndarray::Array1::from(padded_ascending(&chosen, config.n_selected)));
            }
        }
        Ok(out)
    }
}

/// Two query heads of one KV head over 40 tokens (`l = 4, s = 2, l' = 8`, `n = 4`: one free
/// slot beside the three forced blocks): head 0 puts three times more mass on early windows than
/// head 1 puts on late ones, so early blocks win the group sum and the local blocks lose it,
/// while each head alone would fill the free slot differently.
fn contrasting_heads() -> SelectionCase {
    let config =
        NsaConfig { compress_len: 4, compress_stride: 2, select_block: 8, n_selected: 4, ..NsaConfig::default() };
    let len = 40;
    let windows = complete_windows(len, 4, 2).expect("valid");
    let p_cmp = Array3::from_shape_fn((2, len, windows), |(h, _, c)| {
        let rank = if h == 0 { windows - c } else { c + 1 };
        Mp::new(rank as f64 * if h == 0 { 3.0 } else { 1.0 }, PREC)
    });
    SelectionCase { p_cmp, n_heads_kv: 1, config }
}

#[test]
fn selection_theorem_rejects_forgotten_local_blocks_and_per_head_selection() {
    let case = contrasting_heads();
    assert!(selection_invariants(&oracle_selector, &case).is_ok());
    let forgets = |c: &SelectionCase| BrokenSelector::ForgetsLocalBlocks.select(c);
    let err = selection_invariants(&forgets, &case).unwrap_err();
    assert!(err.to_string().contains("forced blocks kept"), "{err}");
    let per_head = |c: &SelectionCase| BrokenSelector::PerHead.select(c);
    let err = selection_invariants(&per_head, &case).unwrap_err();
    assert!(err.to_string().contains("group"), "{err}");
}

/// An NSA case with every block selectable: `T ≤ 20`, `l = 2, s = 1, l' = 4` or
/// `l = 4, s = 2, l' = 8`, `n = max(M, 3)`, GQA, `d, dv ≤ 3`.
fn dense_case() -> impl Strategy<Value = NsaCase> {
    (1usize..=20, 1usize..=2, 1usize..=2, 1usize..=3, 1usize..=3, prop::bool::ANY).prop_flat_map(
        |(len, n_heads_kv, group, d, dv, coarse)| {
            let (compress_len, compress_stride, select_block) = if coarse { (4, 2, 8) } else { (2, 1, 4) };
            let n_heads_q = n_heads_kv * group;
            let config = NsaConfig {
                compress_len,
                compress_stride,
                select_block,
                n_selected: len.div_ceil(select_block).max(3),
                window: 3,
                ..NsaConfig::default()
            };
            let sizes = [len * n_heads_q * d, len * n_heads_kv * d, len * n_heads_kv * dv];
            (
                prop::collection::vec(-2.0f64..=2.0, sizes[0]),
                prop::collection::vec(-2.0f64..=2.0, sizes[1]),
                prop::collection::vec(-1.0f64..=1.0, sizes[2]),
            )
                .prop_map(move |(q, k, v)| {
                    let t = |shape: (usize, usize, usize), x: Vec<f64>| {
                        Array3::from_shape_vec(shape, x.into_iter().map(|y| Mp::new(y, PREC)).collect())
                            .expect("sizes agree")
                    };
                    NsaCase {
                        q: t((len, n_heads_q, d), q),
                        k: t((len, n_heads_kv, d), k),
                        v: t((len, n_heads_kv, dv), v),
                        config: config.clone(),
                    }
                })
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn selection_branch_with_every_block_is_dense_causal_attention(case in dense_case()) {
        selection_alone_is_dense_when_all_selected(&oracle_nsa_forward, &case, REQUIRED).map_err(fail)?;
    }
}

/// The oracle's forward, except that its selection branch drops block 0 wherever another block
/// is selected.
fn forward_dropping_block_zero(
    case: &NsaCase,
    gates: ArrayView3<'_, Mp>,
) -> Result<attnproof_oracle::nsa::NsaForward<Mp>, OracleError> {
    let mut out = oracle_nsa_forward(case, gates)?;
    let width = case.config.n_selected;
    let mut selection = out.selection.clone();
    for mut row in selection.lanes_mut(Axis(2)) {
        let kept: Vec<usize> = row.iter().filter(|&&b| b > 0).map(|&b| b as usize).collect();
        if !kept.is_empty() {
            row.assign(&ndarray::Array1::from(padded_ascending(&kept, width)));
        }
    }
    out.selected = selected_attention(case.inputs(), selection.view(), &case.config, PREC)?;
    out.o = out.selected.clone();
    Ok(out)
}

#[test]
fn dense_theorem_rejects_a_selection_that_drops_a_block() {
    let (len, d) = (20, 2);
    let config =
        NsaConfig { compress_len: 4, compress_stride: 2, select_block: 8, n_selected: 3, ..NsaConfig::default() };
    let t = |seed: u64, heads: usize| {
        Array3::from_shape_vec(
            (len, heads, d),
            pseudo_random(seed, len * heads * d).iter().map(|&x| Mp::new(x, PREC)).collect(),
        )
        .expect("sizes agree")
    };
    let case = NsaCase { q: t(1, 2), k: t(2, 1), v: t(3, 1), config };
    assert!(selection_alone_is_dense_when_all_selected(&oracle_nsa_forward, &case, REQUIRED).is_ok());
    assert!(selection_alone_is_dense_when_all_selected(&forward_dropping_block_zero, &case, REQUIRED).is_err());
}

/// A valid selection `[T, n]` over `M` blocks: each row a random ascending subset.
fn csr_case() -> impl Strategy<Value = (Array2<i32>, usize)> {
    (1usize..=12, 1usize..=6, 1usize..=4).prop_flat_map(|(len, n_blocks, width)| {
        prop::collection::vec(prop::collection::btree_set(0..n_blocks, 0..=width.min(n_blocks)), len).prop_map(
            move |rows| {
                let flat: Vec<i32> =
                    rows.iter().flat_map(|r| padded_ascending(&r.iter().copied().collect::<Vec<_>>(), width)).collect();
                (Array2::from_shape_vec((len, width), flat).expect("sizes agree"), n_blocks)
            },
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn csr_transpose_round_trips((selection, n_blocks) in csr_case()) {
        csr_round_trip(&transpose_selection, selection.view(), n_blocks).map_err(fail)?;
    }
}

#[test]
fn csr_theorem_rejects_off_by_one_offsets() {
    let selection = ndarray::array![[0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, 3]];
    assert!(csr_round_trip(&transpose_selection, selection.view(), 4).is_ok());
    // Every interior offset one too far: still monotone, still ending at nnz.
    let shifted = |s: ArrayView2<'_, i32>, n: usize| -> Result<BlockQueries, OracleError> {
        let mut csr = transpose_selection(s, n)?;
        for o in &mut csr.offsets[1..n] {
            *o += 1;
        }
        Ok(csr)
    };
    assert!(csr_round_trip(&shifted, selection.view(), 4).is_err());
    // The offsets of the first n blocks only, without the closing nnz.
    let truncated = |s: ArrayView2<'_, i32>, n: usize| -> Result<BlockQueries, OracleError> {
        let mut csr = transpose_selection(s, n)?;
        csr.offsets.pop();
        Ok(csr)
    };
    assert!(csr_round_trip(&truncated, selection.view(), 4).is_err());
}

#[test]
fn complete_window_formula_matches_counting() {
    for (l, s) in [(32, 16), (4, 2), (5, 2), (3, 3), (1, 1), (7, 3), (16, 32)] {
        complete_window_count(&complete_windows_at, 300, l, s).unwrap_or_else(|e| panic!("l={l}, s={s}: {e}"));
    }
}

#[test]
fn complete_window_theorem_rejects_counting_from_t_instead_of_t_plus_1() {
    let off_by_one =
        |t: usize, l: usize, s: usize| -> Result<usize, OracleError> { Ok(if t >= l { (t - l) / s + 1 } else { 0 }) };
    assert!(complete_window_count(&off_by_one, 300, 32, 16).is_err());
}

/// Finite differences of the gated sum with `h = 2^-64` at 256 bits agree to about 120 bits; 80 is the bar.
const GATE_STEP_BITS: u32 = 64;
const GATE_REQUIRED: attnproof_proofs::Bits = attnproof_proofs::Bits(80.0);

/// A gated sum's inputs: `T` 1–3 tokens, 1–3 heads, `dv` 1–4, branch outputs and `dO` in ±4, gate logits in ±30 (gates
/// from about 1e-13 to 1 − 1e-13, where `1 − σ` would lose every digit in f64 and `σ(−x)` does not).
fn gate_case() -> impl Strategy<Value = GateCase> {
    (1usize..=3, 1usize..=3, 1usize..=4).prop_flat_map(|(len, heads, dv)| {
        let n = len * heads * dv;
        (values(3 * n, 4.0), values(n, 4.0), values(len * heads * 3, 30.0)).prop_map(move |(o, g, x)| {
            let tensor = |cols: usize, v: &[f64]| {
                Array3::from_shape_fn((len, heads, cols), |(t, h, e)| Mp::new(v[(t * heads + h) * cols + e], PREC))
            };
            GateCase {
                branches: [tensor(dv, &o[..n]), tensor(dv, &o[n..2 * n]), tensor(dv, &o[2 * n..])],
                gate_logits: tensor(3, &x),
                d_out: tensor(dv, &g),
                precision: PREC,
            }
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn gate_gradients_equal_finite_differences(case in gate_case()) {
        gate_gradients_match_finite_differences(&oracle_gate_backward, &case, GATE_STEP_BITS, GATE_REQUIRED)
            .map_err(fail)?;
    }
}

/// The theorem rejects a backward that writes `σ'(x)` as `σ(x)²` and one that hands each branch the next branch's
/// gate.
#[test]
fn gate_theorem_rejects_a_wrong_derivative_and_a_shifted_gate() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let case = proptest::strategy::ValueTree::current(&gate_case().new_tree(&mut runner).unwrap());
    let squared = |b: [ArrayView3<'_, Mp>; 3], x: ArrayView3<'_, Mp>, g: ArrayView3<'_, Mp>, p| {
        let mut grads = oracle_gate_backward(b, x, g, p)?;
        for ((t, h, i), d) in grads.d_gate_logits.indexed_iter_mut() {
            let s = attnproof_oracle::nsa::sigmoid(&x[[t, h, i]]);
            let dot = (0..g.dim().2).fold(Mp::zero(p), |acc, e| acc + g[[t, h, e]].clone() * b[i][[t, h, e]].clone());
            *d = s.clone() * s * dot;
        }
        Ok::<_, OracleError>(grads)
    };
    assert!(gate_gradients_match_finite_differences(&squared, &case, GATE_STEP_BITS, GATE_REQUIRED).is_err());
    let shifted = |b: [ArrayView3<'_, Mp>; 3], x: ArrayView3<'_, Mp>, g: ArrayView3<'_, Mp>, p| {
        let mut grads = oracle_gate_backward(b, x, g, p)?;
        grads.d_branches.rotate_left(1);
        Ok::<_, OracleError>(grads)
    };
    assert!(gate_gradients_match_finite_differences(&shifted, &case, GATE_STEP_BITS, GATE_REQUIRED).is_err());
    gate_gradients_match_finite_differences(&oracle_gate_backward, &case, GATE_STEP_BITS, GATE_REQUIRED)
        .expect("the oracle's backward holds");
}

const COMPRESSION_STEP_BITS: u32 = 20;
const COMPRESSION_REQUIRED: attnproof_proofs::Bits = attnproof_proofs::Bits(200.0);

/// Weights on the dyadic grid of 2^-10 in ±8: `w ± 2^-20` stays exact in f64, as the theorem's hypothesis asks.
fn dyadic(n: usize) -> impl Strategy<Value = Vec<f64>> {
    prop::collection::vec(-8192i32..=8192, n).prop_map(|v| v.into_iter().map(|k| f64::from(k) / 1024.0).collect())
}

/// One head's compression problem: windows of 1–4 tokens every 1–3 (overlapping, adjacent and gapped), 0–12 tokens
/// (none, part of a window, several windows and a tail no window covers), `d` 1–3, rows and `dx̃` in ±4, and each map:
/// the mean, dyadic position weights, a dyadic `[l·d, d]` matrix.
fn compression_case() -> impl Strategy<Value = CompressionCase> {
    (1usize..=4, 1usize..=3, 0usize..=12, 1usize..=3, 0usize..3).prop_flat_map(|(l, s, len, d, kind)| {
        let config =
            NsaConfig { compress_len: l, compress_stride: s, select_block: 4, n_selected: 4, ..NsaConfig::default() };
        let windows = complete_windows(len, l, s).expect("valid");
        let map = match kind {
            0 => Just(Compression::Mean).boxed(),
            1 => dyadic(l).prop_map(Compression::Weighted).boxed(),
            _ => dyadic(l * d * d)
                .prop_map(move |w| Compression::Linear(Array2::from_shape_vec((l * d, d), w).expect("sizes agree")))
                .boxed(),
        };
        (values(len * d, 4.0), values(windows * d, 4.0), map).prop_map(move |(x, g, map)| CompressionCase {
            x: mp_matrix(len, d, &x),
            map,
            d_compressed: mp_matrix(windows, d, &g),
            config: config.clone(),
            precision: PREC,
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn compression_gradients_equal_finite_differences(case in compression_case()) {
        compression_gradients_match_finite_differences(
            &oracle_compress_backward, &case, COMPRESSION_STEP_BITS, COMPRESSION_REQUIRED,
        ).map_err(fail)?;
    }

    #[test]
    fn position_maps_equal_their_linear_maps(
        (l, len, d) in (0u32..=2, 0usize..=10, 1usize..=3).prop_map(|(e, len, d)| (1usize << e, len, d)),
        seed in any::<u64>(),
    ) {
        let config = NsaConfig { compress_len: l, compress_stride: 1, select_block: 4, n_selected: 4, ..NsaConfig::default() };
        let x = mp_matrix(len, d, &pseudo_random(seed, len * d));
        let weights: Vec<f64> = pseudo_random(seed ^ 1, l);
        position_maps_are_linear_maps(x.view(), &weights, &config, PREC, REQUIRED).map_err(fail)?;
    }
}

/// The gradient theorem rejects a mean's backward that forgets to divide by `l`, and a matrix's backward whose
/// `dW` misses the last window; the map theorem rejects a matrix stacked column-major (`W[j·l + i]` for position `i`).
#[test]
fn compression_theorems_reject_a_missing_division_a_dropped_window_and_a_transposed_stack() {
    let config =
        NsaConfig { compress_len: 2, compress_stride: 1, select_block: 4, n_selected: 4, ..NsaConfig::default() };
    let (len, d) = (5, 2);
    let windows = complete_windows(len, 2, 1).unwrap();
    let case = |map| CompressionCase {
        x: mp_matrix(len, d, &pseudo_random(3, len * d)),
        map,
        d_compressed: mp_matrix(windows, d, &pseudo_random(4, windows * d)),
        config: config.clone(),
        precision: PREC,
    };
    let undivided = |x: ArrayView2<'_, Mp>, map: &Compression, g: ArrayView2<'_, Mp>, c: &NsaConfig, p| {
        let mut grads = oracle_compress_backward(x, map, g, c, p)?;
        grads.dx.mapv_inplace(|v| v * Mp::new(2.0, p));
        Ok::<_, OracleError>(grads)
    };
    let mean = case(Compression::Mean);
    assert!(
        compression_gradients_match_finite_differences(&oracle_compress_backward, &mean, 20, COMPRESSION_REQUIRED)
            .is_ok()
    );
    assert!(compression_gradients_match_finite_differences(&undivided, &mean, 20, COMPRESSION_REQUIRED).is_err());
    let matrix = Array2::from_shape_fn((2 * d, d), |(r, k)| ((r * d + k) as f64 - 3.0) / 4.0);
    let linear = case(Compression::Linear(matrix));
    let dropped = |x: ArrayView2<'_, Mp>, map: &Compression, g: ArrayView2<'_, Mp>, c: &NsaConfig, p| {
        let mut short = g.to_owned();
        short.row_mut(g.nrows() - 1).fill(Mp::zero(p));
        let mut grads = oracle_compress_backward(x, map, g, c, p)?;
        grads.d_map = oracle_compress_backward(x, map, short.view(), c, p)?.d_map;
        Ok::<_, OracleError>(grads)
    };
    assert!(
        compression_gradients_match_finite_differences(&oracle_compress_backward, &linear, 20, COMPRESSION_REQUIRED)
            .is_ok()
    );
    assert!(compression_gradients_match_finite_differences(&dropped, &linear, 20, COMPRESSION_REQUIRED).is_err());
    // A weight that moves off the f64 grid breaks the hypothesis, which the theorem says rather than mismeasuring.
    let off_grid = case(Compression::Weighted(vec![2f64.powi(40), 0.5]));
    assert!(matches!(
        compression_gradients_match_finite_differences(&oracle_compress_backward, &off_grid, 20, COMPRESSION_REQUIRED),
        Err(attnproof_proofs::Violation::Hypothesis { .. })
    ));
    // Column-major stacking: position i's block read from the rows j·l + i. Compared through the oracle directly,
    // since the map theorem builds its own stack.
    let x = mp_matrix(len, d, &pseudo_random(5, len * d));
    let w = [0.75, -1.5];
    let stacked = |row_of: &dyn Fn(usize, usize) -> usize| {
        let mut m = Array2::zeros((2 * d, d));
        for i in 0..2 {
            for j in 0..d {
                m[[row_of(i, j), j]] = w[i];
            }
        }
        Compression::Linear(m)
    };
    let right = compress(x.view(), &stacked(&|i, j| i * d + j), &config, PREC).unwrap();
    let wrong = compress(x.view(), &stacked(&|i, j| j * 2 + i), &config, PREC).unwrap();
    let weighted = compress(x.view(), &Compression::Weighted(w.to_vec()), &config, PREC).unwrap();
    assert_eq!(right, weighted);
    assert_ne!(wrong, weighted);
    assert!(position_maps_are_linear_maps(x.view(), &w, &config, PREC, REQUIRED).is_ok());
}

const LAYER_STEP_BITS: u32 = 64;
const LAYER_REQUIRED: attnproof_proofs::Bits = attnproof_proofs::Bits(80.0);

/// The paper's layer in miniature: 11 tokens, a GQA group of 2 over two KV heads, d = dv = 4, windows of 4 every 2,
/// blocks of 2 (six of them, the last partial), lists of 3 with the first and the local block forced (so tokens from
/// 6 on leave blocks out), a window of 3; inputs in [−2, 2], the selection the oracle's own on these inputs.
fn layer_case() -> LayerCase {
    let config = NsaConfig {
        compress_len: 4,
        compress_stride: 2,
        select_block: 2,
        n_selected: 3,
        n_forced_initial: 1,
        n_forced_local: 1,
        window: 3,
        ..NsaConfig::default()
    };
    layer_case_of(11, 4, 2, 4, config)
}

/// A layer of `len` tokens, `hq` query heads over `hkv` KV heads, `d = dv`, under `config`: Q, K, V, the gate logits
/// and `dO` pseudo-random in [−2, 2], the selection the oracle's own on these inputs.
fn layer_case_of(len: usize, hq: usize, hkv: usize, d: usize, config: NsaConfig) -> LayerCase {
    let tensor = |seed: u64, heads: usize, cols: usize| {
        let v = pseudo_random(seed, len * heads * cols);
        Array3::from_shape_fn((len, heads, cols), |(t, h, e)| Mp::new(2.0 * v[(t * heads + h) * cols + e], PREC))
    };
    let layer = NsaCase { q: tensor(1, hq, d), k: tensor(2, hkv, d), v: tensor(3, hkv, d), config };
    let gate_logits = tensor(4, hq, 3);
    let selection = oracle_nsa_forward(&layer, gate_logits.view()).expect("the oracle's forward").selection;
    LayerCase { layer, gate_logits, selection, d_out: tensor(5, hq, d) }
}

/// The layer's gradients equal central differences (E18, selection held fixed), and the theorem rejects a backward
/// that ignores the selection (every block attended), one whose window is one token narrower, and one that hands
/// each branch the next branch's gate.
#[test]
fn layer_gradients_equal_finite_differences_and_broken_backwards_are_rejected() {
    let case = layer_case();
    // Some token leaves an eligible block out, so attending to every block is a different function.
    let last = |t: usize| t / case.layer.config.select_block;
    assert!(
        (0..11).any(|t| last(t) + 1 > case.selection.index_axis(Axis(0), t).row(0).iter().filter(|&&b| b >= 0).count())
    );
    layer_gradients_match_finite_differences(&oracle_layer_backward, &case, LAYER_STEP_BITS, LAYER_REQUIRED)
        .expect("the oracle's layer backward holds");
    fn every_block(
        i: NsaInputs<'_, Mp>,
        x: ArrayView3<'_, Mp>,
        s: ArrayView3<'_, i32>,
        g: ArrayView3<'_, Mp>,
        c: &NsaConfig,
        p: attnproof_oracle::Precision,
    ) -> Result<NsaGradients<Mp>, OracleError> {
        let all = Array3::from_shape_fn(s.raw_dim(), |(_, _, e)| e as i32);
        oracle_layer_backward(i, x, all.view(), g, c, p)
    }
    fn narrow(
        i: NsaInputs<'_, Mp>,
        x: ArrayView3<'_, Mp>,
        s: ArrayView3<'_, i32>,
        g: ArrayView3<'_, Mp>,
        c: &NsaConfig,
        p: attnproof_oracle::Precision,
    ) -> Result<NsaGradients<Mp>, OracleError> {
        oracle_layer_backward(i, x, s, g, &NsaConfig { window: c.window - 1, ..c.clone() }, p)
    }
    fn shifted_gates(
        i: NsaInputs<'_, Mp>,
        x: ArrayView3<'_, Mp>,
        s: ArrayView3<'_, i32>,
        g: ArrayView3<'_, Mp>,
        c: &NsaConfig,
        p: attnproof_oracle::Precision,
    ) -> Result<NsaGradients<Mp>, OracleError> {
        let rotated = Array3::from_shape_fn(x.raw_dim(), |(t, h, b)| x[[t, h, (b + 1) % 3]].clone());
        oracle_layer_backward(i, rotated.view(), s, g, c, p)
    }
    for (name, broken) in [
        ("every block attended", &every_block as attnproof_proofs::nsa::LayerBackwardFn<'_>),
        ("a narrower window", &narrow),
        ("the next branch's gate", &shifted_gates),
    ] {
        assert!(
            layer_gradients_match_finite_differences(broken, &case, LAYER_STEP_BITS, LAYER_REQUIRED).is_err(),
            "{name} passed"
        );
    }
}

const MAP_STEP_BITS: u32 = 40;

/// A layer whose compression maps are learned: 8 tokens, a GQA group of 2 over two KV heads, d = dv = 2,
/// windows of 2 every token (7 of them), blocks of 2 with lists of 2 (the first and the local block forced), a window
/// of 3. The maps' weights are dyadic (so that `w ± 2^-40` is exact in f64) and their magnitudes sum to at most 1 per
/// column, as the theorem asks.
fn learned_map_case(compress_keys: Compression, compress_values: Compression) -> LayerCase {
    let config = NsaConfig {
        compress_len: 2,
        compress_stride: 1,
        select_block: 2,
        n_selected: 2,
        n_forced_initial: 1,
        n_forced_local: 1,
        window: 3,
        compress_keys,
        compress_values,
        ..NsaConfig::default()
    };
    layer_case_of(8, 4, 2, 2, config)
}

/// A `[l·d, d] = [4, 2]` matrix of multiples of 2^-5 in ±7/32 (so each column's magnitudes sum to at most 7/8), its
/// rows 1 and 2 different so that swapping positions and columns changes it.
fn learned_matrix(seed: i32) -> Compression {
    Compression::Linear(Array2::from_shape_fn((4, 2), |(r, k)| {
        f64::from((7 * seed + 5 * r as i32 + 3 * k as i32) % 15 - 7) / 32.0
    }))
}

/// The oracle's map gradients with `dO` zeroed outside the query heads of the KV heads `heads`. Query head `h` reads
/// only KV head `h / G`, so this is the share of those KV heads alone in the sum over heads.
fn map_gradients_of_heads(
    i: NsaInputs<'_, Mp>,
    x: ArrayView3<'_, Mp>,
    s: ArrayView3<'_, i32>,
    g: ArrayView3<'_, Mp>,
    c: &NsaConfig,
    p: attnproof_oracle::Precision,
    heads: std::ops::Range<usize>,
) -> Result<(MapGradient<Mp>, MapGradient<Mp>), OracleError> {
    let group = i.group();
    let masked = Array3::from_shape_fn(g.raw_dim(), |(t, h, e)| {
        if heads.contains(&(h / group)) { g[[t, h, e]].clone() } else { Mp::zero(p) }
    });
    let grads = oracle_layer_backward(i, x, s, masked.view(), c, p)?;
    Ok((grads.d_map_keys, grads.d_map_values))
}

/// The map gradients of KV head 0 alone, not summed over the heads.
fn first_head_only(
    i: NsaInputs<'_, Mp>,
    x: ArrayView3<'_, Mp>,
    s: ArrayView3<'_, i32>,
    g: ArrayView3<'_, Mp>,
    c: &NsaConfig,
    p: attnproof_oracle::Precision,
) -> Result<NsaGradients<Mp>, OracleError> {
    let (d_map_keys, d_map_values) = map_gradients_of_heads(i, x, s, g, c, p, 0..1)?;
    Ok(NsaGradients { d_map_keys, d_map_values, ..oracle_layer_backward(i, x, s, g, c, p)? })
}

/// The sum over the heads with the last KV head's share counted twice.
fn last_head_twice(
    i: NsaInputs<'_, Mp>,
    x: ArrayView3<'_, Mp>,
    s: ArrayView3<'_, i32>,
    g: ArrayView3<'_, Mp>,
    c: &NsaConfig,
    p: attnproof_oracle::Precision,
) -> Result<NsaGradients<Mp>, OracleError> {
    let mut grads = oracle_layer_backward(i, x, s, g, c, p)?;
    let (keys, values) = map_gradients_of_heads(i, x, s, g, c, p, i.n_heads_kv() - 1..i.n_heads_kv())?;
    grads.d_map_keys.add(&keys)?;
    grads.d_map_values.add(&values)?;
    Ok(grads)
}

/// φ_K's gradient reported as φ_V's and the other way round (the two maps have the same shape here).
fn maps_swapped(
    i: NsaInputs<'_, Mp>,
    x: ArrayView3<'_, Mp>,
    s: ArrayView3<'_, i32>,
    g: ArrayView3<'_, Mp>,
    c: &NsaConfig,
    p: attnproof_oracle::Precision,
) -> Result<NsaGradients<Mp>, OracleError> {
    let grads = oracle_layer_backward(i, x, s, g, c, p)?;
    Ok(NsaGradients { d_map_keys: grads.d_map_values.clone(), d_map_values: grads.d_map_keys.clone(), ..grads })
}

/// φ_K's matrix gradient with the window stacked column-major: the entry of position `i`, column `j` written to row
/// `j·l + i` instead of `i·d + j`.
fn transposed_stack(
    i: NsaInputs<'_, Mp>,
    x: ArrayView3<'_, Mp>,
    s: ArrayView3<'_, i32>,
    g: ArrayView3<'_, Mp>,
    c: &NsaConfig,
    p: attnproof_oracle::Precision,
) -> Result<NsaGradients<Mp>, OracleError> {
    let mut grads = oracle_layer_backward(i, x, s, g, c, p)?;
    let (l, d) = (c.compress_len, i.k.dim().2);
    if let MapGradient::Linear(dw) = &grads.d_map_keys {
        let moved = Array2::from_shape_fn(dw.raw_dim(), |(r, k)| dw[[(r % l) * d + r / l, k]].clone());
        grads.d_map_keys = MapGradient::Linear(moved);
    }
    Ok(grads)
}

/// φ_K's matrix gradient transposed to `[d, l·d]`: the wrong shape for the map's parameters.
fn transposed_matrix(
    i: NsaInputs<'_, Mp>,
    x: ArrayView3<'_, Mp>,
    s: ArrayView3<'_, i32>,
    g: ArrayView3<'_, Mp>,
    c: &NsaConfig,
    p: attnproof_oracle::Precision,
) -> Result<NsaGradients<Mp>, OracleError> {
    let mut grads = oracle_layer_backward(i, x, s, g, c, p)?;
    if let MapGradient::Linear(dw) = &grads.d_map_keys {
        grads.d_map_keys = MapGradient::Linear(dw.t().to_owned());
    }
    Ok(grads)
}

/// The layer's learned maps: the summed gradients of φ_K's and φ_V's matrices equal the extrapolated central
/// differences in each weight, and so do dQ, dK, dV and the gate logits' (through the matrices' pooling
/// transpose); the map theorem rejects the gradient of KV head 0 alone, the last head counted twice, the two maps
/// swapped, a column-major stack of the window and the matrix's gradient transposed.
#[test]
fn learned_map_gradients_are_summed_over_kv_heads_and_broken_sums_are_rejected() {
    let case = learned_map_case(learned_matrix(1), learned_matrix(2));
    let oracle = oracle_layer_backward(
        case.layer.inputs(),
        case.gate_logits.view(),
        case.selection.view(),
        case.d_out.view(),
        &case.layer.config,
        PREC,
    )
    .expect("the oracle's layer backward");
    // Both KV heads contribute: the first head's share alone is not the sum.
    let p = PREC;
    let (first_keys, _) = map_gradients_of_heads(
        case.layer.inputs(),
        case.gate_logits.view(),
        case.selection.view(),
        case.d_out.view(),
        &case.layer.config,
        p,
        0..1,
    )
    .unwrap();
    assert_ne!(first_keys, oracle.d_map_keys);
    assert!(matches!(&oracle.d_map_values, MapGradient::Linear(dw) if dw.dim() == (4, 2)));
    layer_map_gradients_match_finite_differences(&oracle_layer_backward, &case, MAP_STEP_BITS, LAYER_REQUIRED)
        .expect("the oracle's map gradients hold");
    layer_gradients_match_finite_differences(&oracle_layer_backward, &case, LAYER_STEP_BITS, LAYER_REQUIRED)
        .expect("the oracle's layer backward holds with learned maps");
    for (name, broken, quantity) in [
        ("KV head 0 alone", &first_head_only as attnproof_proofs::nsa::LayerBackwardFn<'_>, "d_map_keys"),
        ("the last head twice", &last_head_twice, "d_map_keys"),
        ("the maps swapped", &maps_swapped, "d_map_keys"),
        ("a column-major stack", &transposed_stack, "d_map_keys"),
        ("the matrix transposed", &transposed_matrix, "d_map_keys"),
    ] {
        let verdict = layer_map_gradients_match_finite_differences(broken, &case, MAP_STEP_BITS, LAYER_REQUIRED);
        assert!(
            matches!(&verdict, Err(attnproof_proofs::Violation::Residual { quantity: q, .. }) if *q == quantity),
            "{name}: {verdict:?}"
        );
    }
}

/// Position weights on both maps: the oracle's summed gradients hold (also at the coarsest step the theorem allows,
/// with φ_V's magnitudes summing to exactly 1) and KV head 0's share alone, or a gradient missing a position, is
/// rejected; a mean map must come back as [`MapGradient::Mean`].
#[test]
fn position_weight_gradients_are_summed_over_kv_heads_and_broken_sums_are_rejected() {
    let weighted =
        learned_map_case(Compression::Weighted(vec![0.375, -0.5]), Compression::Weighted(vec![0.375, 0.625]));
    layer_map_gradients_match_finite_differences(&oracle_layer_backward, &weighted, MAP_STEP_BITS, LAYER_REQUIRED)
        .expect("the oracle's position-weight gradients hold");
    // 4 · 36 = 80 + 64: the coarsest step the hypothesis allows at this requirement.
    layer_map_gradients_match_finite_differences(&oracle_layer_backward, &weighted, 36, LAYER_REQUIRED)
        .expect("the oracle's position-weight gradients hold at the coarsest step");
    fn dropped_position(
        i: NsaInputs<'_, Mp>,
        x: ArrayView3<'_, Mp>,
        s: ArrayView3<'_, i32>,
        g: ArrayView3<'_, Mp>,
        c: &NsaConfig,
        p: attnproof_oracle::Precision,
    ) -> Result<NsaGradients<Mp>, OracleError> {
        let mut grads = oracle_layer_backward(i, x, s, g, c, p)?;
        if let MapGradient::Weighted(dw) = &grads.d_map_values {
            grads.d_map_values = MapGradient::Weighted(dw.slice(ndarray::s![..dw.len() - 1]).to_owned());
        }
        Ok(grads)
    }
    for (name, broken, quantity) in [
        ("KV head 0 alone", &first_head_only as attnproof_proofs::nsa::LayerBackwardFn<'_>, "d_map_keys"),
        ("a dropped position", &dropped_position, "d_map_values"),
    ] {
        let verdict = layer_map_gradients_match_finite_differences(broken, &weighted, MAP_STEP_BITS, LAYER_REQUIRED);
        assert!(
            matches!(&verdict, Err(attnproof_proofs::Violation::Residual { quantity: q, .. }) if *q == quantity),
            "{name}: {verdict:?}"
        );
    }
    // The mean has no weight: the oracle passes, a backward that invents a gradient for it does not.
    let mean = learned_map_case(Compression::Mean, Compression::Weighted(vec![0.25, 0.625]));
    layer_map_gradients_match_finite_differences(&oracle_layer_backward, &mean, MAP_STEP_BITS, LAYER_REQUIRED)
        .expect("the mean's gradient is MapGradient::Mean");
    fn invented(
        i: NsaInputs<'_, Mp>,
        x: ArrayView3<'_, Mp>,
        s: ArrayView3<'_, i32>,
        g: ArrayView3<'_, Mp>,
        c: &NsaConfig,
        p: attnproof_oracle::Precision,
    ) -> Result<NsaGradients<Mp>, OracleError> {
        let grads = oracle_layer_backward(i, x, s, g, c, p)?;
        Ok(NsaGradients { d_map_keys: grads.d_map_values.clone(), ..grads })
    }
    assert!(matches!(
        layer_map_gradients_match_finite_differences(&invented, &mean, MAP_STEP_BITS, LAYER_REQUIRED),
        Err(attnproof_proofs::Violation::Residual { quantity: "d_map_keys", .. })
    ));
}

/// The map theorem refuses, as a failed hypothesis naming the reason rather than a mismeasured gradient: a weight the
/// f64 config cannot move by the step, weights that grow the compressed rows (position weights or a matrix column),
/// a step too coarse for the extrapolation, and a precision too low for the cancellation.
#[test]
fn map_theorem_refuses_cases_outside_its_hypotheses() {
    let reason = |keys: Compression, values: Compression, step_bits: u32, required: f64| {
        let case = learned_map_case(keys, values);
        match layer_map_gradients_match_finite_differences(
            &oracle_layer_backward,
            &case,
            step_bits,
            attnproof_proofs::Bits(required),
        ) {
            Err(attnproof_proofs::Violation::Hypothesis { reason, .. }) => reason,
            other => panic!("expected a refused hypothesis, got {other:?}"),
        }
    };
    let fine = || Compression::Weighted(vec![0.25, 0.5]);
    // The last bit of 1e-30 lies far below 2^-41, so 1e-30 ± 2^-41 rounds in f64 although (1e-30 + 2^-41) − 1e-30
    // gives 2^-41 back.
    assert!(reason(fine(), Compression::Weighted(vec![1e-30, 0.5]), MAP_STEP_BITS, 80.0).contains("not exact"));
    assert!(reason(Compression::Weighted(vec![0.75, 0.5]), fine(), MAP_STEP_BITS, 80.0).contains("above 1"));
    let wide_column = Compression::Linear(Array2::from_shape_fn((4, 2), |(_, k)| if k == 1 { 0.5 } else { 0.0 }));
    assert!(reason(fine(), wide_column, MAP_STEP_BITS, 80.0).contains("above 1"));
    // 4 · 35 < 80 + 64.
    assert!(reason(fine(), fine(), 35, 80.0).contains("too coarse"));
    // 100 + 150 + 16 > 256 bits, although 4 · 100 ≥ 150 + 64.
    assert!(reason(fine(), fine(), 100, 150.0).contains("precision"));
}
