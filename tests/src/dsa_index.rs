//! Verifying a DSA lightning indexer with its top-k selection (E16) against the oracle (`oracle::dsa`).
//!
//! Three checks, each able to fail on its own:
//! 1. **The selection is exact.** A candidate that hands back its f32 scores must list, in every row, exactly what the
//!    oracle's `causal_top_k` lists from those same scores: the `k` largest visible tokens, ties to the lower index,
//!    ascending, `−1`-padded. Integers, compared entry for entry.
//! 2. **The scores are within the derived bound.** Each candidate score lies within
//!    `attnproof_proofs::dsa_bound::indexer_score_bound` of the exact score (plus the f64 evaluation's own
//!    `γ(d_I + H_I + 2)` of the same magnitude, the oracle's rounding).
//! 3. **Every boundary swap is explained by the bound.** Where the candidate's set differs from the oracle's set on
//!    the exact (f64) scores, each token the candidate took but the oracle did not (`x`) and each the oracle took but
//!    the candidate did not (`y`) must satisfy `I_y − I_x ≤ E_x + E_y`: rounding can move a token across the boundary
//!    only past one whose true score is within both bounds of its own. A row whose sets agree is *decided*.

use attnproof_oracle::dsa::{IndexerInputs, TopKConfig, causal_top_k, indexer_scores};
use attnproof_proofs::dsa_bound::indexer_score_bound;
use attnproof_proofs::f64_oracle_bound::gamma;
use std::sync::Arc;

use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::dsa::index::{IndexerShape, ScoreRows, full_scores_len, indexer_top_k_device, workspace_len};
use cudarc::driver::CudaStream;
use ndarray::{Array2, Array3, ArrayView2, ArrayView3};

use crate::candidate::{GUARD_BITS_32, LaunchError, Storage, poisoned, unguard, upload};
use crate::flash::HarnessError;

/// The outcome of one verification.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IndexerVerdict {
    /// Selection rows checked (`T`).
    pub rows: usize,
    /// Rows whose selected set equals the oracle's on the exact scores.
    pub decided: usize,
    /// The largest `|candidate − exact| / bound` over every visible score (0 when there is none).
    pub worst_score_ratio: f64,
    /// Why each failing row failed, one line each.
    pub failures: Vec<String>,
}

impl IndexerVerdict {
    /// No check failed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// The indexer's inputs widened to f64: `q [T, H_I, d_I]`, `k [T, d_I]`, `w [T, H_I]`.
#[derive(Clone, Copy, Debug)]
pub struct IndexerCase<'a> {
    /// Indexer queries.
    pub q: ArrayView3<'a, f64>,
    /// Indexer keys.
    pub k: ArrayView2<'a, f64>,
    /// Head weights.
    pub w: ArrayView2<'a, f64>,
    /// Entries per selection row.
    pub top_k: usize,
}

/// An indexer problem in its storage types: `q [T, H_I, d_I]`, `k [T, d_I]` of `T`, `w [T, H_I]` f32, and `k`.
#[derive(Clone, Debug)]
pub struct IndexerProblem<T> {
    /// Indexer queries.
    pub q: Array3<T>,
    /// Indexer keys.
    pub k: Array2<T>,
    /// Head weights.
    pub w: Array2<f32>,
    /// Entries per selection row.
    pub top_k: usize,
}

impl<T: Storage> IndexerProblem<T> {
    /// The kernel's view of the problem.
    pub fn shape(&self) -> IndexerShape {
        let (seq_len, n_index_heads, index_dim) = self.q.dim();
        IndexerShape { seq_len, n_index_heads, index_dim, top_k: self.top_k }
    }

    /// The inputs widened to f64 (exactly: every 16-bit and f32 value is an f64).
    pub fn widened(&self) -> (Array3<f64>, Array2<f64>, Array2<f64>) {
        (self.q.mapv(|x| f64::from(x.to_f32())), self.k.mapv(|x| f64::from(x.to_f32())), self.w.mapv(f64::from))
    }
}

/// Where a guarded launch puts the scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreMode {
    /// A workspace for this many CTAs (the scores are not returned).
    Workspace {
        /// CTAs the workspace is sized for.
        ctas: usize,
    },
    /// The full `[T, T]` score matrix, returned.
    Full,
}

/// What a guarded launch gives back.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerRun {
    /// `[T, k]` lists.
    pub lists: Array2<i32>,
    /// `[T, T]` scores widened to f64 (`−∞` after the diagonal) with [`ScoreMode::Full`].
    pub scores: Option<Array2<f64>>,
}

/// The poison of a list entry before the launch: no valid entry nor the `−1` pad.
pub const LIST_POISON: i32 = i32::MIN;

/// One launch of the indexer `kernel` on `problem`, every output (lists, scores or workspace) poisoned and followed by
/// a guard band; checks the bands and that the inputs are unchanged.
pub fn indexer_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    problem: &IndexerProblem<T>,
    mode: ScoreMode,
) -> Result<IndexerRun, LaunchError> {
    let shape = problem.shape();
    let driver = |e: cudarc::driver::DriverError| LaunchError::Driver(e.to_string());
    let (q, k) = (upload(stream, &problem.q.clone().into_dyn())?, upload(stream, &problem.k.clone().into_dyn())?);
    let w = upload(stream, &problem.w.clone().into_dyn())?;
    let guard_i32 = GUARD_BITS_32 as i32;
    let guard_f32 = f32::from_bits(GUARD_BITS_32);
    let n_lists = shape.lists_len();
    let mut lists = poisoned(stream, n_lists, LIST_POISON, guard_i32)?;
    let n_scores = match mode {
        ScoreMode::Workspace { ctas } => workspace_len(&shape, ctas),
        ScoreMode::Full => full_scores_len(&shape),
    };
    // The workspace gets no guard band: the wrapper sizes its grid by the buffer's length, so every element of it
    // is the kernel's to write. The full score matrix and the lists get one.
    let guarded = mode == ScoreMode::Full;
    let mut scores = if guarded {
        poisoned(stream, n_scores, f32::NAN, guard_f32)?
    } else {
        stream.clone_htod(&vec![f32::NAN; n_scores.max(1)]).map_err(driver)?
    };
    let rows = match mode {
        ScoreMode::Workspace { .. } => ScoreRows::Workspace(&mut scores),
        ScoreMode::Full => ScoreRows::Full(&mut scores),
    };
    indexer_top_k_device(stream, kernel, &shape, &q, &k, &w, &mut lists, rows)?;
    let lists_back = stream.clone_dtoh(&lists).map_err(driver)?;
    let scores_back = stream.clone_dtoh(&scores).map_err(driver)?;
    let (q_back, k_back, w_back) = (
        stream.clone_dtoh(&q).map_err(driver)?,
        stream.clone_dtoh(&k).map_err(driver)?,
        stream.clone_dtoh(&w).map_err(driver)?,
    );
    stream.synchronize().map_err(driver)?;
    let same16 = |a: &[T], b: &[T]| a.iter().zip(b).all(|(x, y)| x.bits() == y.bits());
    if !same16(problem.q.as_slice().unwrap_or(&[]), &q_back) {
        return Err(LaunchError::InputChanged { input: "q_index" });
    }
    if !same16(problem.k.as_slice().unwrap_or(&[]), &k_back) {
        return Err(LaunchError::InputChanged { input: "k_index" });
    }
    if !problem.w.iter().zip(&w_back).all(|(x, y)| x.to_bits() == y.to_bits()) {
        return Err(LaunchError::InputChanged { input: "weights" });
    }
    let (seq_len, top_k) = (shape.seq_len, shape.top_k);
    let lists = unguard("lists", lists_back, n_lists, &[seq_len, top_k], |x| x == guard_i32)?;
    let lists = lists.into_dimensionality().map_err(|e| LaunchError::Driver(e.to_string()))?;
    let scores = if guarded {
        let full = unguard("scores", scores_back, n_scores, &[n_scores], |x: f32| x.to_bits() == GUARD_BITS_32)?;
        let stride = shape.score_stride();
        Some(Array2::from_shape_fn((seq_len, seq_len), |(t, s)| {
            if s <= t { f64::from(full[t * stride + s]) } else { f64::NEG_INFINITY }
        }))
    } else {
        None
    };
    Ok(IndexerRun { lists, scores })
}

/// Each visible score's bound `[T, T]` (0 after the diagonal): the kernel's derived bound plus the oracle's f64 error.
pub fn score_bounds(case: &IndexerCase<'_>) -> Array2<f64> {
    let (seq_len, heads, dim) = case.q.dim();
    Array2::from_shape_fn((seq_len, seq_len), |(t, s)| {
        if s > t {
            return 0.0;
        }
        let magnitude: f64 = (0..heads)
            .map(|a| case.w[[t, a]].abs() * (0..dim).map(|c| (case.q[[t, a, c]] * case.k[[s, c]]).abs()).sum::<f64>())
            .sum();
        indexer_score_bound(magnitude, dim, heads) + gamma(dim + heads + 2) * magnitude
    })
}

fn check_shape(argument: &'static str, actual: &[usize], expected: &[usize]) -> Result<(), HarnessError> {
    if actual != expected {
        return Err(HarnessError::CandidateShape { argument, expected: expected.to_vec(), actual: actual.to_vec() });
    }
    Ok(())
}

fn set_of(row: ndarray::ArrayView1<'_, i32>) -> Vec<usize> {
    row.iter().filter(|&&x| x >= 0).map(|&x| x as usize).collect()
}

/// Verifies a candidate's `lists [T, k]` and, when it hands them back, its f32 `scores [T, T]` (widened to f64; only
/// the entries `s ≤ t` are read).
pub fn verify_indexer(
    case: &IndexerCase<'_>,
    lists: ArrayView2<'_, i32>,
    scores: Option<ArrayView2<'_, f64>>,
) -> Result<IndexerVerdict, HarnessError> {
    let seq_len = case.q.dim().0;
    check_shape("lists", lists.shape(), &[seq_len, case.top_k])?;
    let config = TopKConfig { top_k: case.top_k };
    let mut verdict = IndexerVerdict { rows: seq_len, ..IndexerVerdict::default() };
    if seq_len == 0 {
        return Ok(verdict);
    }
    let exact = indexer_scores(IndexerInputs { q_index: case.q, weights: case.w, k_index: case.k }, ())?;
    let bounds = score_bounds(case);
    if let Some(scores) = scores {
        check_shape("scores", scores.shape(), &[seq_len, seq_len])?;
        // A non-finite visible score (an entry left poisoned) is a failure of the candidate, not of the verifier: the
        // rows' own top-k is then undefined and not compared.
        let non_finite: Vec<(usize, usize)> =
            (0..seq_len).flat_map(|t| (0..=t).map(move |s| (t, s))).filter(|&ix| !scores[ix].is_finite()).collect();
        let own = if non_finite.is_empty() { Some(causal_top_k(scores, config)?) } else { None };
        if let Some(&(t, s)) = non_finite.first() {
            verdict.failures.push(format!(
                "{} visible scores are not finite, the first [{t}, {s}] = {}",
                non_finite.len(),
                scores[[t, s]]
            ));
        }
        for t in 0..seq_len {
            if own.as_ref().is_some_and(|own| own.row(t) != lists.row(t)) {
                let own = own.as_ref().expect("compared above");
                verdict.failures.push(format!(
                    "row {t}: the list {:?} is not the top-{} of the candidate's own scores, {:?}",
                    lists.row(t).to_vec(),
                    case.top_k,
                    own.row(t).to_vec()
                ));
            }
            for s in 0..=t {
                let error = (scores[[t, s]] - exact[[t, s]]).abs();
                // A NaN score (an entry the kernel never wrote keeps the poison) is infinitely far; an error against
                // a bound of 0 too (`x / 0 = ∞` for `x > 0`).
                let ratio = if error == 0.0 {
                    0.0
                } else if error.is_nan() {
                    f64::INFINITY
                } else {
                    error / bounds[[t, s]]
                };
                verdict.worst_score_ratio = verdict.worst_score_ratio.max(ratio);
                if ratio > 1.0 {
                    verdict.failures.push(format!(
                        "score [{t}, {s}] = {:e} is {error:e} from the exact {:e}, beyond its bound {:e}",
                        scores[[t, s]],
                        exact[[t, s]],
                        bounds[[t, s]]
                    ));
                }
            }
        }
    }
    let truth = causal_top_k(exact.view(), config)?;
    for t in 0..seq_len {
        let mine = set_of(lists.row(t));
        let theirs = set_of(truth.row(t));
        if mine == theirs {
            verdict.decided += 1;
            continue;
        }
        if mine.len() != theirs.len() {
            verdict.failures.push(format!("row {t}: {} tokens listed, the oracle lists {}", mine.len(), theirs.len()));
            continue;
        }
        let only_mine: Vec<usize> = mine.iter().copied().filter(|x| !theirs.contains(x)).collect();
        let only_theirs: Vec<usize> = theirs.iter().copied().filter(|y| !mine.contains(y)).collect();
        for &x in &only_mine {
            if x > t {
                verdict.failures.push(format!("row {t}: token {x} is after the query"));
                continue;
            }
            for &y in &only_theirs {
                let gap = exact[[t, y]] - exact[[t, x]];
                if gap > bounds[[t, x]] + bounds[[t, y]] {
                    verdict.failures.push(format!(
                        "row {t}: token {x} was kept over {y}, whose exact score is higher by {gap:e}, beyond the \
                         bounds {:e} + {:e}",
                        bounds[[t, x]],
                        bounds[[t, y]]
                    ));
                }
            }
        }
    }
    Ok(verdict)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array3, Axis, Slice};

    /// A small case with distinct scores: `T = 9`, two heads of dim 3, positive weights.
    fn small_case() -> (Array3<f64>, Array2<f64>, Array2<f64>) {
        let q = Array3::from_shape_fn((9, 2, 3), |(t, a, c)| ((t * 7 + a * 3 + c * 5) % 11) as f64 / 8.0 - 0.3);
        let k = Array2::from_shape_fn((9, 3), |(s, c)| ((s * 5 + c * 3) % 13) as f64 / 8.0 - 0.5);
        let w = Array2::from_shape_fn((9, 2), |(t, a)| 0.5 + ((t + a) % 3) as f64 / 4.0);
        (q, k, w)
    }

    fn exact_of(q: &Array3<f64>, k: &Array2<f64>, w: &Array2<f64>) -> Array2<f64> {
        indexer_scores(IndexerInputs { q_index: q.view(), weights: w.view(), k_index: k.view() }, ()).unwrap()
    }

    /// The bound's oracle term is `γ(d + H + 2)` of the magnitude at any head count: with three heads of dim 5 (where
    /// `H + 2`, `2H` and `H·2` differ) each visible score's bound is the kernel's plus that term, to the last bits.
    #[test]
    fn the_oracle_term_counts_the_dim_the_heads_and_two() {
        let q = Array3::from_shape_fn((4, 3, 5), |(t, a, c)| ((t * 3 + a * 7 + c) % 5) as f64 / 4.0 - 0.4);
        let k = Array2::from_shape_fn((4, 5), |(s, c)| ((s * 2 + c * 3) % 7) as f64 / 4.0 - 0.6);
        let w = Array2::from_shape_fn((4, 3), |(t, a)| 1.0 + (t + a) as f64 / 8.0);
        let bounds = score_bounds(&IndexerCase { q: q.view(), k: k.view(), w: w.view(), top_k: 2 });
        for t in 0..4 {
            for s in 0..=t {
                let magnitude: f64 =
                    (0..3).map(|a| w[[t, a]] * (0..5).map(|c| (q[[t, a, c]] * k[[s, c]]).abs()).sum::<f64>()).sum();
                let expected = indexer_score_bound(magnitude, 5, 3) + gamma(5 + 3 + 2) * magnitude;
                assert!(magnitude > 0.0 && (bounds[[t, s]] - expected).abs() <= 1e-12 * expected, "[{t}, {s}]");
            }
        }
    }

    #[test]
    fn the_oracles_own_lists_and_scores_pass_and_every_planted_fault_fails() {
        let (q, k, w) = small_case();
        let case = IndexerCase { q: q.view(), k: k.view(), w: w.view(), top_k: 3 };
        let exact = exact_of(&q, &k, &w);
        let lists = causal_top_k(exact.view(), TopKConfig { top_k: 3 }).unwrap();
        let good = verify_indexer(&case, lists.view(), Some(exact.view())).unwrap();
        assert!(good.passed(), "{:?}", good.failures);
        assert_eq!((good.rows, good.decided), (9, 9));
        assert_eq!(good.worst_score_ratio, 0.0);

        // A list entry off by one in a row with more visible tokens than k: not the top-k of its own scores.
        let mut shifted = lists.clone();
        let last = shifted[[8, 2]];
        shifted[[8, 2]] = if last > 0 { last - 1 } else { last + 1 };
        assert!(!verify_indexer(&case, shifted.view(), Some(exact.view())).unwrap().passed());
        // A padded row that should list every visible token: dropping one fails.
        let mut dropped = lists.clone();
        dropped[[1, 1]] = -1;
        assert!(!verify_indexer(&case, dropped.view(), Some(exact.view())).unwrap().passed());
        // A score moved past its bound fails even when the list is unchanged.
        let mut moved = exact.clone();
        let b = score_bounds(&case)[[5, 2]];
        moved[[5, 2]] += 2.0 * b + 1e-12;
        let v = verify_indexer(&case, lists.view(), Some(moved.view())).unwrap();
        assert!(!v.passed() && v.worst_score_ratio > 1.0, "{v:?}");
        // A score moved within its bound passes the score check.
        let mut nudged = exact.clone();
        nudged[[5, 2]] += 0.5 * b;
        let v = verify_indexer(&case, lists.view(), Some(nudged.view())).unwrap();
        assert!(v.passed() && v.worst_score_ratio > 0.4 && v.worst_score_ratio <= 0.5, "{v:?}");
        // An unwritten (NaN-poisoned) score fails.
        let mut poisoned = exact.clone();
        poisoned[[4, 4]] = f64::NAN;
        assert!(!verify_indexer(&case, lists.view(), Some(poisoned.view())).unwrap().passed());
        // Without scores, a swap far beyond the bound fails: the best token of row 8 replaced by the worst.
        let row: Vec<f64> = exact.row(8).iter().take(9).copied().collect();
        let worst = (0..9).min_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
        let mut swapped = lists.clone();
        let mut set: Vec<i32> = swapped.row(8).to_vec();
        let best = (0..9).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as i32;
        for x in set.iter_mut() {
            if *x == best {
                *x = worst as i32;
            }
        }
        set.sort_unstable();
        swapped.row_mut(8).assign(&ndarray::Array1::from(set));
        assert!(!verify_indexer(&case, swapped.view(), None).unwrap().passed());
        // The wrong shape is an error, not a verdict.
        assert!(verify_indexer(&case, lists.slice_axis(Axis(1), Slice::from(..2)), None).is_err());
    }

    /// Each bound is the derived bound of its own magnitude `Σ_a |w_ta| Σ_c |q_tac k_sc|` plus the f64 term, on the
    /// diagonal too, and 0 after it; a diagonal score moved within its bound passes, beyond it fails.
    #[test]
    fn score_bounds_are_the_derived_bound_of_each_magnitude() {
        let (q, k, w) = small_case();
        let case = IndexerCase { q: q.view(), k: k.view(), w: w.view(), top_k: 3 };
        let bounds = score_bounds(&case);
        for t in 0..9 {
            for s in 0..9 {
                if s > t {
                    assert_eq!(bounds[[t, s]], 0.0, "[{t}, {s}] is after the diagonal");
                    continue;
                }
                let mut magnitude = 0.0;
                for a in 0..2 {
                    let mut row = 0.0;
                    for c in 0..3 {
                        row += (q[[t, a, c]] * k[[s, c]]).abs();
                    }
                    magnitude += w[[t, a]].abs() * row;
                }
                let expected = indexer_score_bound(magnitude, 3, 2) + gamma(3 + 2 + 2) * magnitude;
                let relative = (bounds[[t, s]] - expected).abs() / expected;
                assert!(relative < 1e-12, "[{t}, {s}]: {} against {expected}", bounds[[t, s]]);
                assert!(expected > 0.0, "[{t}, {s}]: the case has no zero magnitude");
            }
        }
        let exact = exact_of(&q, &k, &w);
        let lists = causal_top_k(exact.view(), TopKConfig { top_k: 3 }).unwrap();
        for (factor, passes) in [(0.9, true), (1.1, false)] {
            let mut moved = exact.clone();
            moved[[6, 6]] += factor * bounds[[6, 6]];
            let v = verify_indexer(&case, lists.view(), Some(moved.view())).unwrap();
            assert_eq!(v.passed(), passes, "diagonal moved by {factor} of its bound: {v:?}");
        }
    }

    #[test]
    fn a_swap_between_near_ties_within_the_bounds_passes_and_beyond_them_fails() {
        // Tokens 1 and 2 of row 2 differ in exact score by 1e-7, less than the sum of their bounds (about 2.4e-6) but
        // more than their product: a candidate may take either.
        let q = Array3::from_shape_fn((3, 1, 2), |_| 1.0);
        let mut k = Array2::from_shape_fn((3, 2), |(s, _)| [0.0, 1.0, 1.0][s]);
        k[[2, 0]] = 1.0 + 1e-7;
        let w = Array2::from_elem((3, 1), 1.0);
        let case = IndexerCase { q: q.view(), k: k.view(), w: w.view(), top_k: 1 };
        let truth = causal_top_k(exact_of(&q, &k, &w).view(), TopKConfig { top_k: 1 }).unwrap();
        assert_eq!(truth.column(0).to_vec(), [0, 1, 2]);
        let near = ndarray::arr2(&[[0], [1], [1]]);
        let v = verify_indexer(&case, near.view(), None).unwrap();
        assert!(v.passed(), "{:?}", v.failures);
        assert_eq!(v.decided, 2);
        // Token 0 scores 0 against 2 + 1e-7: no rounding explains taking it.
        let far = ndarray::arr2(&[[0], [1], [0]]);
        assert!(!verify_indexer(&case, far.view(), None).unwrap().passed());
        // The query's own token kept over a near tie is no future token: keys 1 and 2 swapped, so that the exact
        // scores prefer 1 by 1e-7 and the candidate keeps 2, its own.
        let mut k_swapped = k.clone();
        k_swapped[[1, 0]] = 1.0 + 1e-7;
        k_swapped[[2, 0]] = 1.0;
        let case = IndexerCase { q: q.view(), k: k_swapped.view(), w: w.view(), top_k: 1 };
        let own = ndarray::arr2(&[[0], [1], [2]]);
        let v = verify_indexer(&case, own.view(), None).unwrap();
        assert!(v.passed(), "{:?}", v.failures);
        assert_eq!(v.decided, 2);
    }

    /// A score whose error is exactly its bound passes (the bound is inclusive): an exact score of 0 (every logit
    /// negative) moved by exactly its bound.
    #[test]
    fn an_error_of_exactly_the_bound_passes() {
        let q = Array3::from_shape_fn((2, 1, 2), |(t, _, _)| if t == 0 { 1.0 } else { -1.0 });
        let k = Array2::from_elem((2, 2), 1.0);
        let w = Array2::from_elem((2, 1), 1.0);
        let case = IndexerCase { q: q.view(), k: k.view(), w: w.view(), top_k: 2 };
        let mut scores = exact_of(&q, &k, &w);
        assert_eq!(scores[[1, 1]], 0.0);
        let bound = score_bounds(&case)[[1, 1]];
        assert!(bound > 0.0);
        scores[[1, 1]] = bound;
        let lists = ndarray::arr2(&[[0, -1], [0, 1]]);
        let v = verify_indexer(&case, lists.view(), Some(scores.view())).unwrap();
        assert!(v.passed(), "{:?}", v.failures);
        assert_eq!(v.worst_score_ratio, 1.0);
    }
}
