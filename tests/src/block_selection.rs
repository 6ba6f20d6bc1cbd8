//! Verifying a block selector's lists (BSA: E15 pooling feeding E14 lists) against the oracle (`oracle::bsa`).
//!
//! Lists are integers, so they are compared exactly wherever rounding cannot move the top-k boundary. The oracle's
//! f64 scores and a kernel's both lie within `E` of the exact pooled score (`attnproof_proofs::bsa_bound`), so two
//! blocks `x` (selected by the oracle) and `y` (not) can trade places only when `s_x − s_y ≤ 2(E_x + E_y)`, unless
//! their keys are bitwise identical: then every deterministic evaluation gives both the same score and breaks the tie
//! to the lower index, as the oracle does. A row without such a pair is *decided* and the candidate's list must equal
//! the oracle's entry for entry. A row with one is *near-tied*: the candidate's list must still be a valid list (the
//! E14 convention, eligible blocks only, the forced ones, as many entries as the oracle's), and no block it left out
//! may beat one it took by more than the bound. Query blocks past a sequence's own must list nothing.
//!
//! The list logic ([`check_lists`]) is shared with E24's covariance-aware selection (`crate::pisa_covariance`), which
//! passes its own scores, bounds and rule for blocks that must score bitwise equal.

use attnproof_oracle::bsa::{BsaConfig, bsa_scores, bsa_select};
use attnproof_oracle::spec::Sequence;
use attnproof_oracle::topk::validate_index_row;
use attnproof_oracle::{AttentionSpec, Mask};
use attnproof_proofs::bsa_bound::pooled_score_bound;
use attnproof_reference::Element;
use ndarray::{Array4, ArrayView4, ArrayViewD};

use crate::flash::{Case, HarnessError};

/// The outcome of one verification: rows checked, rows decided, and one line per failing row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SelectionVerdict {
    /// List rows of the sequences' own query blocks.
    pub rows: usize,
    /// Of those, rows whose boundary rounding cannot move (compared exactly).
    pub decided: usize,
    /// Why each failing row failed.
    pub failures: Vec<String>,
}

impl SelectionVerdict {
    /// No row failed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// The oracle's view of a case: scores, lists and each score's bound (`[B, Hkv, n_q_blocks, n_k_blocks]` for the
/// scores and bounds, the lists' shape for the lists). Shared by every selector verified through [`check_lists`].
pub(crate) struct SelectionTruth {
    /// The oracle's f64 scores, `−∞` where ineligible.
    pub(crate) scores: Array4<f64>,
    /// The oracle's lists.
    pub(crate) lists: Array4<i32>,
    /// `E`: the oracle's score and any admitted evaluation of it are each within `E` of the exact score.
    pub(crate) bounds: Array4<f64>,
}

/// `mean_i |x_ic|` over `rows` of a head's `[L, d]` rows.
pub(crate) fn abs_means(x: ndarray::ArrayView2<'_, f64>, rows: std::ops::Range<usize>) -> Vec<f64> {
    let n = rows.len() as f64;
    (0..x.ncols()).map(|c| rows.clone().map(|i| x[[i, c]].abs()).sum::<f64>() / n).collect()
}

/// The bound `E` of every pooled (BSA) score, `[B, Hkv, n_q_blocks, n_k_blocks]` (`attnproof_proofs::bsa_bound`):
/// `pooled_score_bound` of `α Σ_h Σ_c Q_hc K_c` with `Q`, `K` the query and key blocks' mean absolute values. Entries
/// past a sequence's blocks stay 0.
pub(crate) fn pooled_score_bounds(
    spec: &AttentionSpec,
    q: ArrayViewD<'_, f64>,
    k: ArrayViewD<'_, f64>,
    config: &BsaConfig,
) -> Array4<f64> {
    let seqs = spec.sequences();
    let n_q = seqs.iter().map(|s| config.query_blocks(s)).max().unwrap_or(0);
    let n_k = seqs.iter().map(|s| config.key_blocks(s)).max().unwrap_or(0);
    let alpha = spec.scale_value::<f64>(());
    let group = spec.group_size();
    let mut bounds = Array4::zeros((seqs.len(), spec.n_heads_kv, n_q, n_k));
    for seq in seqs {
        for kv in 0..spec.n_heads_kv {
            let keys = spec.head_rows(k.view(), &seq, kv, true);
            let key_means: Vec<Vec<f64>> = (0..config.key_blocks(&seq))
                .map(|b| abs_means(keys, b * config.kv_block..((b + 1) * config.kv_block).min(seq.len_k)))
                .collect();
            for a in 0..config.query_blocks(&seq) {
                let rows = a * config.q_block..((a + 1) * config.q_block).min(seq.len_q);
                let query_means: Vec<Vec<f64>> = (kv * group..(kv + 1) * group)
                    .map(|h| abs_means(spec.head_rows(q.view(), &seq, h, false), rows.clone()))
                    .collect();
                for (b, km) in key_means.iter().enumerate() {
                    let magnitude: f64 = alpha
                        * query_means.iter().map(|qm| qm.iter().zip(km).map(|(x, y)| x * y).sum::<f64>()).sum::<f64>();
                    let keys_here = ((b + 1) * config.kv_block).min(seq.len_k) - b * config.kv_block;
                    bounds[[seq.index, kv, a, b]] =
                        pooled_score_bound(magnitude, rows.len(), keys_here, spec.head_dim, group);
                }
            }
        }
    }
    bounds
}

fn truth(
    spec: &AttentionSpec,
    q: ArrayViewD<'_, f64>,
    k: ArrayViewD<'_, f64>,
    config: &BsaConfig,
) -> Result<SelectionTruth, HarnessError> {
    let scores = bsa_scores(spec, q.view(), k.view(), config, ())?;
    let lists = bsa_select(spec, scores.view(), config)?;
    let bounds = pooled_score_bounds(spec, q, k, config);
    Ok(SelectionTruth { scores, lists, bounds })
}

/// Whether key blocks `x` and `y` of (sequence, KV head) hold bitwise the same rows of `t` (keys or values, laid out
/// by `spec`), and as many.
pub(crate) fn same_rows(
    spec: &AttentionSpec,
    t: &ArrayViewD<'_, f64>,
    seq: &Sequence,
    kv: usize,
    kv_block: usize,
    x: usize,
    y: usize,
) -> bool {
    let rows = spec.head_rows(t.view(), seq, kv, true);
    let range = |b: usize| b * kv_block..((b + 1) * kv_block).min(seq.len_k);
    let (rx, ry) = (range(x), range(y));
    rx.len() == ry.len()
        && rx.zip(ry).all(|(i, j)| rows.row(i).iter().zip(rows.row(j)).all(|(p, q)| p.to_bits() == q.to_bits()))
}

/// Whether the oracle's list of (sequence `seq`, KV head `kv`, query block `a`), whose first `end` key blocks are
/// eligible, sits at a near-tie: a chosen block that is not forced and an eligible block left out whose scores lie
/// within twice the sum of their bounds, unless `same_score(seq, kv, x, y)` says every deterministic evaluation scores
/// the two bitwise equal (then the tie breaks to the lower index, as in the oracle).
pub(crate) fn near_tied(
    truth: &SelectionTruth,
    (seq, kv, a): (&Sequence, usize, usize),
    end: usize,
    forced: &[usize],
    same_score: &impl Fn(&Sequence, usize, usize, usize) -> bool,
) -> bool {
    let width = truth.lists.dim().3;
    let score = |b: usize| truth.scores[[seq.index, kv, a, b]];
    let bound = |b: usize| truth.bounds[[seq.index, kv, a, b]];
    let chosen: Vec<usize> =
        (0..width).map(|w| truth.lists[[seq.index, kv, a, w]]).filter(|&b| b >= 0).map(|b| b as usize).collect();
    chosen.iter().filter(|b| !forced.contains(b)).any(|&x| {
        (0..end)
            .filter(|y| !chosen.contains(y))
            .any(|y| score(x) - score(y) <= 2.0 * (bound(x) + bound(y)) && !same_score(seq, kv, x, y))
    })
}

/// Checks a candidate's `lists` (`[B, Hkv, n_q_blocks, top_k]`) against the oracle's `truth` under `config` (module
/// docs): decided rows entry for entry, near-tied rows as valid lists that no left-out block beats beyond the bounds,
/// rows past a sequence's query blocks all `−1`. `same_score(seq, kv, x, y)` says when key blocks `x` and `y` must
/// score bitwise equal in every deterministic evaluation (for BSA: the same keys).
pub(crate) fn check_lists(
    spec: &AttentionSpec,
    config: &BsaConfig,
    truth: &SelectionTruth,
    lists: ArrayView4<'_, i32>,
    same_score: impl Fn(&Sequence, usize, usize, usize) -> bool,
) -> Result<SelectionVerdict, HarnessError> {
    let t = truth;
    if lists.shape() != t.lists.shape() {
        return Err(HarnessError::CandidateShape {
            argument: "lists",
            expected: t.lists.shape().to_vec(),
            actual: lists.shape().to_vec(),
        });
    }
    let causal = matches!(spec.mask, Mask::Causal);
    let mut verdict = SelectionVerdict::default();
    let (_, heads, n_q, width) = lists.dim();
    for seq in spec.sequences() {
        for kv in 0..heads {
            for a in 0..n_q {
                let got: Vec<i32> = (0..width).map(|w| lists[[seq.index, kv, a, w]]).collect();
                let want: Vec<i32> = (0..width).map(|w| t.lists[[seq.index, kv, a, w]]).collect();
                let at = format!("sequence {}, KV head {kv}, query block {a}", seq.index);
                if a >= config.query_blocks(&seq) {
                    if got != want {
                        verdict.failures.push(format!("{at} (past the sequence): {got:?}, expected all -1"));
                    }
                    continue;
                }
                verdict.rows += 1;
                let end = config.eligible_end(&seq, a, causal);
                let forced = config.forced(end);
                let score = |b: usize| t.scores[[seq.index, kv, a, b]];
                let bound = |b: usize| t.bounds[[seq.index, kv, a, b]];
                let chosen: Vec<usize> = want.iter().filter(|&&b| b >= 0).map(|&b| b as usize).collect();
                if !near_tied(t, (&seq, kv, a), end, &forced, &same_score) {
                    verdict.decided += 1;
                    if got != want {
                        verdict.failures.push(format!("{at}: {got:?}, the oracle's {want:?} (decided boundary)"));
                    }
                    continue;
                }
                // Near-tied: a valid list of the oracle's length, with the forced blocks, that no block left out
                // beats by more than the bound.
                let taken = match validate_index_row("lists", 0, &got, end) {
                    Ok(taken) => taken,
                    Err(e) => {
                        verdict.failures.push(format!("{at}: {got:?} is not a valid list: {e}"));
                        continue;
                    }
                };
                if taken.len() != chosen.len() || forced.iter().any(|f| !taken.contains(f)) {
                    verdict.failures.push(format!("{at}: {got:?}, the oracle's {want:?} (length or forced blocks)"));
                    continue;
                }
                let beaten = taken.iter().filter(|b| !forced.contains(b)).find_map(|&x| {
                    (0..end)
                        .filter(|y| !taken.contains(y))
                        .find(|&y| score(y) - score(x) > 2.0 * (bound(x) + bound(y)))
                        .map(|y| (x, y))
                });
                if let Some((x, y)) = beaten {
                    verdict.failures.push(format!(
                        "{at}: {got:?} takes block {x} (score {:e}) over block {y} ({:e}) beyond the bound",
                        score(x),
                        score(y)
                    ));
                }
            }
        }
    }
    Ok(verdict)
}

/// Verifies `lists` (`[B, Hkv, n_q_blocks, top_k]`) as the BSA selection of `case` under `config`.
pub fn verify_block_selection<T: Element>(
    case: &Case<T>,
    config: &BsaConfig,
    lists: ArrayView4<'_, i32>,
) -> Result<SelectionVerdict, HarnessError> {
    let spec = &case.spec;
    let [q, k, _] = case.widened();
    let t = truth(spec, q.view(), k.view(), config)?;
    let keys = k.view();
    check_lists(spec, config, &t, lists, |seq, kv, x, y| same_rows(spec, &keys, seq, kv, config.kv_block, x, y))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::make_case;
    use crate::generate::{Distribution, ValueProfile};
    use half::bf16;

    fn profile() -> ValueProfile {
        ValueProfile { distribution: Distribution::Gaussian, logit_scale: 1.0, value_mean: 0.0 }
    }

    fn config() -> BsaConfig {
        BsaConfig { q_block: 4, kv_block: 4, top_k: 3, force_first: true, force_local: 1 }
    }

    /// The oracle's own lists pass; every single-entry change of a decided row fails; a list of the wrong shape is an
    /// error, not a verdict.
    #[test]
    fn the_oracles_lists_pass_and_changed_ones_fail() {
        let spec = AttentionSpec::dense(2, 4, 2, 21, 30, 8, 8).with_mask(Mask::Causal);
        let case = make_case::<bf16>(&spec, profile(), 7);
        let [q, k, _] = case.widened();
        let t = truth(&spec, q.view(), k.view(), &config()).unwrap();
        let v = verify_block_selection(&case, &config(), t.lists.view()).unwrap();
        assert!(v.passed(), "{v:?}");
        assert_eq!(v.rows, 2 * 2 * 6);
        assert!(v.decided > v.rows / 2, "{v:?}");
        let mut changed = 0;
        for (index, &x) in t.lists.indexed_iter() {
            let mut wrong = t.lists.clone();
            wrong[index] = if x == -1 { 0 } else { -1 };
            let v = verify_block_selection(&case, &config(), wrong.view()).unwrap();
            assert!(!v.passed(), "entry {index:?} changed from {x} passed");
            changed += 1;
        }
        assert_eq!(changed, t.lists.len());
        let narrow = t.lists.slice_axis(ndarray::Axis(3), (0..2).into()).to_owned();
        assert!(matches!(
            verify_block_selection(&case, &config(), narrow.view()),
            Err(HarnessError::CandidateShape { argument: "lists", .. })
        ));
    }

    /// Identical key blocks tie exactly; the tie must break to the lower index: the list that takes the higher one
    /// fails although both blocks have the same score.
    #[test]
    fn a_tie_between_identical_blocks_must_break_to_the_lower_index() {
        let spec = AttentionSpec::dense(1, 1, 1, 16, 16, 8, 8).with_mask(Mask::None);
        let mut case = make_case::<bf16>(&spec, profile(), 3);
        // Every query is the same vector v; key blocks 1 and 2 are v four times over (the same keys, so the same
        // score in any deterministic evaluation), blocks 0 and 3 are −v: 1 and 2 tie for the best.
        for i in 0..16 {
            for c in 0..8 {
                let v = case.q[[0, 0, 0, c]];
                case.q[[0, 0, i, c]] = v;
                let sign = if (4..12).contains(&i) { 1.0 } else { -1.0 };
                case.k[[0, 0, i, c]] = bf16::from_f32(sign * v.to_f32());
            }
        }
        let c = BsaConfig { q_block: 16, kv_block: 4, top_k: 1, force_first: false, force_local: 0 };
        let [q, k, _] = case.widened();
        let t = truth(&spec, q.view(), k.view(), &c).unwrap();
        assert_eq!(t.scores[[0, 0, 0, 1]], t.scores[[0, 0, 0, 2]]);
        assert_eq!(t.lists[[0, 0, 0, 0]], 1);
        let v = verify_block_selection(&case, &c, t.lists.view()).unwrap();
        assert!(v.passed() && v.decided == 1, "{v:?}");
        let mut higher = t.lists.clone();
        higher[[0, 0, 0, 0]] = 2;
        assert!(!verify_block_selection(&case, &c, higher.view()).unwrap().passed());
    }
}
