//! Verifying a pyramid selector's lists and trace (PISA: E25–E28) against the oracle (`oracle::pyramid`), under the
//! GPU's convention (`attnproof_gpu::pisa::select`): each query block is its mean-pooled queries at its last visible
//! position.
//!
//! Lists are integers, and a descent's boundary at one level decides which nodes the next level even sees, so the
//! lists are held to the candidate's own scores: the trace gives every level's candidates and their scores, and the
//! verifier replays the descent from those scores with the oracle's rule (`topk::top_k`, the forced leaves'
//! ancestors, causal eligibility, `expand`). Each level's candidates must be the replay's, entry for entry; every
//! eligible candidate's score must lie within the bounds of `attnproof_proofs::pyramid_bound` (the kernel's plus the
//! oracle's f64 evaluation's) of the oracle's score; an ineligible one must be unscored (NaN); and the list must be the
//! replay's kept leaves. A row whose replay never came within those bounds of a boundary (no kept node beaten by a
//! dropped one by less than twice the bounds) is *decided*: its list must also equal the oracle's own descent's. Rows
//! past a sequence's query blocks, or that see no key, list nothing and trace nothing.

use attnproof_gpu::pisa::block_position;
use attnproof_gpu::pisa::select::{PyramidSelectConfig, lists_shape, trace_shape};
use attnproof_oracle::pyramid::{Pyramid, PyramidQuery, Scoring, descend, expand, forced_leaves};
use attnproof_oracle::topk::{padded_ascending, top_k};
use attnproof_proofs::pyramid_bound::{
    gpu_mean_terms, group_bound, item_score_bound, lse_bound, oracle_mean_terms, pisa2_bound, presummed_score_bound,
};
use attnproof_reference::Element;
use ndarray::{Array1, Array2, ArrayView2, ArrayView4, ArrayView5, Axis};

use crate::flash::{Case, HarnessError};

/// The outcome of one verification: rows checked, rows decided, and one line per failing row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PyramidVerdict {
    /// List rows of the sequences' own query blocks that see at least one key.
    pub rows: usize,
    /// Of those, rows whose replay never came near a boundary (their lists equal the oracle's).
    pub decided: usize,
    /// Candidate scores compared with the oracle's.
    pub scores: usize,
    /// The largest `|kernel − oracle| / bound` over those scores.
    pub worst_ratio: f64,
    /// Why each failing row failed.
    pub failures: Vec<String>,
}

impl PyramidVerdict {
    /// No row failed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// The candidate's outputs: the lists and the trace (`attnproof_gpu::pisa::select::PyramidTrace`'s arrays).
#[derive(Clone, Copy, Debug)]
pub struct PyramidOutputs<'a> {
    /// `[B, Hkv, query blocks, max(K, 3)]`.
    pub lists: ArrayView4<'a, i32>,
    /// `[B, Hkv, query blocks, levels, candidates]`.
    pub nodes: ArrayView5<'a, i32>,
    /// Same shape.
    pub scores: ArrayView5<'a, f64>,
}

/// The sub-array at `[sequence, KV head, query block]` of a per-row output.
fn row_of<'a, S, D: ndarray::RemoveAxis>(
    x: ndarray::ArrayView<'a, S, D>,
    [seq, kv, a]: [usize; 3],
) -> ndarray::ArrayView<'a, S, <<D::Smaller as ndarray::Dimension>::Smaller as ndarray::Dimension>::Smaller>
where
    D::Smaller: ndarray::RemoveAxis,
    <D::Smaller as ndarray::Dimension>::Smaller: ndarray::RemoveAxis,
{
    x.index_axis_move(Axis(0), seq).index_axis_move(Axis(0), kv).index_axis_move(Axis(0), a)
}

/// One (sequence, KV head)'s keys: the oracle's f64 pyramid and per-column prefix sums of `|k|` for magnitudes.
struct HeadKeys<'a> {
    keys: ArrayView2<'a, f64>,
    pyramid: Pyramid<f64>,
    abs_prefix: Array2<f64>,
}

impl HeadKeys<'_> {
    /// Whether the key ranges `x` and `y` hold bitwise the same keys (and as many).
    fn same_keys(&self, x: std::ops::Range<usize>, y: std::ops::Range<usize>) -> bool {
        x.len() == y.len()
            && x.zip(y)
                .all(|(i, j)| self.keys.row(i).iter().zip(self.keys.row(j)).all(|(a, b)| a.to_bits() == b.to_bits()))
    }

    /// `mean_j |k_jc|` over the keys `range`.
    fn abs_mean(&self, range: std::ops::Range<usize>) -> Array1<f64> {
        let n = range.len() as f64;
        (&self.abs_prefix.row(range.end) - &self.abs_prefix.row(range.start)) / n
    }
}

/// What a candidate's score and its two bounds are, from the oracle's side.
struct Scored {
    score: f64,
    gpu_bound: f64,
    oracle_bound: f64,
}

/// `α · dot(q, x)` as the oracle evaluates it.
fn item_score(alpha: f64, q: ndarray::ArrayView1<'_, f64>, x: ndarray::ArrayView1<'_, f64>) -> f64 {
    q.iter().zip(x).fold(0.0, |acc, (a, b)| acc + a * b) * alpha
}

/// The oracle's score of `node` at `level` summed over the pooled query heads, and the kernel's and the oracle's
/// bounds on it (module docs of `attnproof_proofs::pyramid_bound`).
fn score_node(
    head: &HeadKeys<'_>,
    config: &PyramidSelectConfig,
    heads: ArrayView2<'_, f64>,
    query_abs: ArrayView2<'_, f64>,
    rows: usize,
    (level, node): (usize, usize),
) -> Result<Scored, HarnessError> {
    let p = &head.pyramid;
    let (c, beta, d) = (config.pyramid.leaf_size, config.pyramid.branching, p.head_dim());
    let alpha = 1.0 / (d as f64).sqrt();
    let (mut scores, mut gpu_bounds, mut oracle_bounds) = (vec![], vec![], vec![]);
    // PISA-1's magnitudes over the group: the kernel sums the group's queries before its one dot product.
    let mut magnitude_sum = 0.0;
    for (q, qa) in heads.rows().into_iter().zip(query_abs.rows()) {
        let score = p.node_score(level, node, q, config.pyramid.scoring)?;
        let magnitude = |range: std::ops::Range<usize>| alpha * qa.dot(&head.abs_mean(range));
        let (gpu, oracle) = if config.pyramid.scoring == Scoring::Pisa1 {
            let range = p.key_range(level, node);
            let m = magnitude(range.clone());
            magnitude_sum += m;
            (
                item_score_bound(m, rows, gpu_mean_terms(c, beta, level), d),
                item_score_bound(m, rows, oracle_mean_terms(range.len()), d),
            )
        } else {
            // The pooled items: the leaf's raw keys (weight 1) or the children's means (weight = their keys).
            let items: Vec<(std::ops::Range<usize>, f64, usize, usize)> = if level == 0 {
                p.key_range(0, node).map(|j| (j..j + 1, item_score(alpha, q, head.keys.row(j)), 0, 0)).collect()
            } else {
                let below = &p.levels()[level - 1];
                p.children(level, node)
                    .map(|child| {
                        let range = p.key_range(level - 1, child);
                        let x = item_score(alpha, q, below.means.row(child));
                        let terms = (gpu_mean_terms(c, beta, level - 1), oracle_mean_terms(range.len()));
                        (range, x, terms.0, terms.1)
                    })
                    .collect()
            };
            let errors = |oracle: bool| {
                items
                    .iter()
                    .map(|(range, _, gpu_terms, oracle_terms)| {
                        let terms = if oracle { *oracle_terms } else { *gpu_terms };
                        item_score_bound(magnitude(range.clone()), rows, terms, d)
                    })
                    .fold(0.0, f64::max)
            };
            let (e_gpu, e_oracle) = (errors(false), errors(true));
            let e = e_gpu.max(e_oracle);
            let weight = |range: &std::ops::Range<usize>| range.len() as f64;
            let total: f64 = items.iter().map(|(r, ..)| weight(r)).sum();
            let x_max = items.iter().map(|(_, x, ..)| x.abs()).fold(0.0, f64::max) + e;
            if config.pyramid.scoring == Scoring::Lse {
                (lse_bound(e_gpu, items.len(), total, x_max), lse_bound(e_oracle, items.len(), total, x_max))
            } else {
                let mean = items.iter().map(|(r, x, ..)| weight(r) * x).sum::<f64>() / total;
                let spread = items.iter().map(|(_, x, ..)| (x - mean).abs()).fold(0.0, f64::max) + 2.0 * e;
                let variance = items.iter().map(|(r, x, ..)| weight(r) * (x - mean).powi(2)).sum::<f64>() / total;
                let variance = variance + 4.0 * e * spread;
                (
                    pisa2_bound(e_gpu, items.len(), x_max, spread, variance),
                    pisa2_bound(e_oracle, items.len(), x_max, spread, variance),
                )
            }
        };
        scores.push(score);
        gpu_bounds.push(gpu);
        oracle_bounds.push(oracle);
    }
    let score = scores.iter().sum::<f64>();
    let abs_sum = |bounds: &[f64]| scores.iter().zip(bounds).map(|(s, b)| s.abs() + b).sum::<f64>();
    let gpu_bound = if config.pyramid.scoring == Scoring::Pisa1 {
        presummed_score_bound(magnitude_sum, rows, scores.len(), gpu_mean_terms(c, beta, level), d)
    } else {
        group_bound(&gpu_bounds, abs_sum(&gpu_bounds))
    };
    Ok(Scored { score, gpu_bound, oracle_bound: group_bound(&oracle_bounds, abs_sum(&oracle_bounds)) })
}

/// Verifies `outputs` as the pyramid selection of `case` under `config`.
pub fn verify_pyramid_selection<T: Element>(
    case: &Case<T>,
    config: &PyramidSelectConfig,
    outputs: PyramidOutputs<'_>,
) -> Result<PyramidVerdict, HarnessError> {
    let spec = &case.spec;
    let (want_lists, want_trace) = (lists_shape(spec, config), trace_shape(spec, config));
    for (argument, actual, expected) in [
        ("lists", outputs.lists.shape(), &want_lists[..]),
        ("trace nodes", outputs.nodes.shape(), &want_trace[..]),
        ("trace scores", outputs.scores.shape(), &want_trace[..]),
    ] {
        if actual != expected {
            return Err(HarnessError::CandidateShape {
                argument,
                expected: expected.to_vec(),
                actual: actual.to_vec(),
            });
        }
    }
    let [q, k, _] = case.widened();
    let pyramid_config = config.pyramid;
    let group = spec.group_size();
    let [_, _, n_q, n_levels, n_cand] = want_trace;
    let mut verdict = PyramidVerdict::default();
    for seq in spec.sequences() {
        for kv in 0..spec.n_heads_kv {
            let keys = spec.head_rows(k.view(), &seq, kv, true);
            let head = if keys.nrows() == 0 {
                None
            } else {
                let mut abs_prefix = Array2::zeros((keys.nrows() + 1, keys.ncols()));
                for j in 0..keys.nrows() {
                    let next = &abs_prefix.row(j) + &keys.row(j).mapv(f64::abs);
                    abs_prefix.row_mut(j + 1).assign(&next);
                }
                Some(HeadKeys { keys, pyramid: Pyramid::build(keys, &pyramid_config, ())?, abs_prefix })
            };
            for a in 0..n_q {
                let at = format!("sequence {}, KV head {kv}, query block {a}", seq.index);
                let list: Vec<i32> = row_of(outputs.lists, [seq.index, kv, a]).to_vec();
                let nodes = row_of(outputs.nodes, [seq.index, kv, a]);
                let scores = row_of(outputs.scores, [seq.index, kv, a]);
                let (Some(head), Some((rows, position))) = (&head, block_position(spec, &seq, config.q_block, a))
                else {
                    if list.iter().any(|&b| b != -1) || nodes.iter().any(|&n| n != -1) {
                        verdict.failures.push(format!("{at} sees no key: lists {list:?}, or a traced candidate"));
                    }
                    continue;
                };
                verdict.rows += 1;
                // The block's pooled queries (f64 means of its rows) and their column magnitudes.
                let row0 = a * config.q_block;
                let mut heads = Array2::zeros((group, spec.head_dim));
                let mut query_abs = Array2::zeros((group, spec.head_dim));
                for h in 0..group {
                    let block = spec.head_rows(q.view(), &seq, kv * group + h, false);
                    let block = block.slice_axis(Axis(0), (row0..row0 + rows).into());
                    heads.row_mut(h).assign(&block.sum_axis(Axis(0)).mapv(|s| s / rows as f64));
                    query_abs.row_mut(h).assign(&block.mapv(f64::abs).sum_axis(Axis(0)).mapv(|s| s / rows as f64));
                }
                let p = &head.pyramid;
                let top = p.levels().len() - 1;
                let forced = forced_leaves(position, pyramid_config.leaf_size);
                let mut candidates = vec![0usize];
                let mut near_tie = false;
                let mut failed = None;
                for level in (0..n_levels).rev() {
                    let traced: Vec<i32> = nodes.row(level).to_vec();
                    if level > top {
                        if traced.iter().any(|&n| n != -1) {
                            failed = Some(format!("level {level} is above the root but traces {traced:?}"));
                            break;
                        }
                        continue;
                    }
                    let want = padded_ascending(&candidates, n_cand);
                    if traced != want {
                        failed = Some(format!("level {level} candidates {traced:?}, the replay's {want:?}"));
                        break;
                    }
                    let eligible: Vec<bool> =
                        candidates.iter().map(|&c| p.key_range(level, c).start <= position).collect();
                    let got: Vec<f64> = (0..candidates.len()).map(|i| scores[[level, i]]).collect();
                    let mut bounds = vec![0.0; candidates.len()];
                    for (i, &c) in candidates.iter().enumerate() {
                        if !eligible[i] {
                            if !got[i].is_nan() {
                                failed = Some(format!("level {level} node {c} starts after {position}: {}", got[i]));
                            }
                            continue;
                        }
                        let truth = score_node(head, config, heads.view(), query_abs.view(), rows, (level, c))?;
                        let bound = truth.gpu_bound + truth.oracle_bound;
                        bounds[i] = bound;
                        verdict.scores += 1;
                        let error = (got[i] - truth.score).abs();
                        verdict.worst_ratio = verdict.worst_ratio.max(error / bound);
                        if error.is_nan() || error > bound {
                            failed = Some(format!(
                                "level {level} node {c}: score {:e}, the oracle's {:e}, beyond the bound {bound:e}",
                                got[i], truth.score
                            ));
                        }
                    }
                    if failed.is_some() {
                        break;
                    }
                    let forced_slots: Vec<usize> = (0..candidates.len())
                        .filter(|&i| forced.iter().any(|&f| p.ancestor(f, level) == candidates[i]))
                        .collect();
                    let kept = top_k(&got, pyramid_config.keep, |i| eligible[i], &forced_slots);
                    // A dropped eligible candidate within twice the bounds of a kept, unforced one: rounding could
                    // have swapped them.
                    // (Nodes over bitwise equal keys score bitwise equal in any deterministic evaluation and break
                    // their tie to the lower node, as the oracle does: no rounding can swap them.)
                    near_tie |= kept.iter().filter(|x| !forced_slots.contains(x)).any(|&x| {
                        (0..candidates.len()).filter(|y| eligible[*y] && !kept.contains(y)).any(|y| {
                            got[x] - got[y] <= 2.0 * (bounds[x] + bounds[y])
                                && !head.same_keys(p.key_range(level, candidates[x]), p.key_range(level, candidates[y]))
                        })
                    });
                    let mut kept_nodes: Vec<usize> = kept.iter().map(|&i| candidates[i]).collect();
                    kept_nodes.sort_unstable();
                    if level == 0 {
                        candidates = kept_nodes;
                    } else {
                        candidates = expand(p, level, &kept_nodes);
                    }
                }
                if let Some(why) = failed {
                    verdict.failures.push(format!("{at}: {why}"));
                    continue;
                }
                let replay = padded_ascending(&candidates, want_lists[3]);
                if list != replay {
                    verdict.failures.push(format!("{at}: list {list:?}, the replay of its own scores {replay:?}"));
                    continue;
                }
                if !near_tie {
                    verdict.decided += 1;
                    let query = PyramidQuery { heads: heads.view(), position };
                    let oracle = descend(p, &query, &pyramid_config)?;
                    let oracle_list = padded_ascending(&oracle.selected_leaves(), want_lists[3]);
                    if list != oracle_list {
                        verdict.failures.push(format!("{at}: {list:?}, the oracle's {oracle_list:?} (decided)"));
                    }
                }
            }
        }
    }
    Ok(verdict)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{Distribution, ValueProfile, make_case};
    use attnproof_oracle::pyramid::PyramidConfig;
    use attnproof_oracle::{AttentionSpec, Mask};
    use half::bf16;
    use ndarray::{Array4, Array5};

    fn profile() -> ValueProfile {
        ValueProfile { distribution: Distribution::Gaussian, logit_scale: 1.0, value_mean: 0.0 }
    }

    fn config(scoring: Scoring) -> PyramidSelectConfig {
        PyramidSelectConfig { q_block: 64, pyramid: PyramidConfig { leaf_size: 64, branching: 3, keep: 3, scoring } }
    }

    /// The recipe a correct kernel follows, from the oracle's f64 scores: the lists and the trace of every row.
    fn oracle_outputs(case: &Case<bf16>, config: &PyramidSelectConfig) -> (Array4<i32>, Array5<i32>, Array5<f64>) {
        let spec = &case.spec;
        let mut lists = Array4::from_elem(lists_shape(spec, config), -1);
        let mut nodes = Array5::from_elem(trace_shape(spec, config), -1);
        let mut scores = Array5::from_elem(trace_shape(spec, config), f64::NAN);
        let [q, k, _] = case.widened();
        let group = spec.group_size();
        for seq in spec.sequences() {
            for kv in 0..spec.n_heads_kv {
                let keys = spec.head_rows(k.view(), &seq, kv, true);
                if keys.nrows() == 0 {
                    continue;
                }
                let p = Pyramid::build(keys, &config.pyramid, ()).unwrap();
                for a in 0..lists.dim().2 {
                    let Some((rows, position)) = block_position(spec, &seq, config.q_block, a) else { continue };
                    let mut heads = Array2::zeros((group, spec.head_dim));
                    for h in 0..group {
                        let block = spec.head_rows(q.view(), &seq, kv * group + h, false);
                        let block = block.slice_axis(Axis(0), (a * config.q_block..a * config.q_block + rows).into());
                        heads.row_mut(h).assign(&block.sum_axis(Axis(0)).mapv(|s| s / rows as f64));
                    }
                    let d = descend(&p, &PyramidQuery { heads: heads.view(), position }, &config.pyramid).unwrap();
                    for (w, &b) in d.selected.iter().enumerate().take(lists.dim().3) {
                        lists[[seq.index, kv, a, w]] = b;
                    }
                    for step in &d.trace {
                        for (i, &c) in step.candidates.iter().enumerate() {
                            nodes[[seq.index, kv, a, step.level, i]] = c as i32;
                            scores[[seq.index, kv, a, step.level, i]] = step.scores[i].unwrap_or(f64::NAN);
                        }
                    }
                }
            }
        }
        (lists, nodes, scores)
    }

    fn verify(
        case: &Case<bf16>,
        c: &PyramidSelectConfig,
        o: &(Array4<i32>, Array5<i32>, Array5<f64>),
    ) -> PyramidVerdict {
        let outputs = PyramidOutputs { lists: o.0.view(), nodes: o.1.view(), scores: o.2.view() };
        verify_pyramid_selection(case, c, outputs).unwrap()
    }

    /// The oracle's own lists and trace pass under every scoring, causal and unmasked, GQA and varlen with an empty
    /// sequence; most rows are decided.
    #[test]
    fn the_oracles_descent_passes() {
        let varlen = AttentionSpec {
            layout: attnproof_oracle::Layout::Varlen {
                cu_seqlens_q: vec![0, 130, 130, 400],
                cu_seqlens_k: vec![0, 700, 700, 1000],
            },
            ..AttentionSpec::dense(1, 3, 1, 1, 1, 16, 16)
        };
        let specs = [
            AttentionSpec::dense(1, 4, 2, 700, 900, 16, 16).with_mask(Mask::Causal),
            AttentionSpec::dense(2, 2, 2, 200, 600, 8, 8).with_mask(Mask::None),
            varlen.with_mask(Mask::Causal),
        ];
        for (i, spec) in specs.iter().enumerate() {
            let case = make_case::<bf16>(spec, profile(), 11 + i as u64);
            for scoring in [Scoring::Lse, Scoring::Pisa1, Scoring::Pisa2] {
                let c = config(scoring);
                let v = verify(&case, &c, &oracle_outputs(&case, &c));
                assert!(v.passed(), "{i} {scoring:?}: {v:?}");
                assert!(v.rows > 0 && v.decided * 2 > v.rows && v.scores > v.rows, "{i} {scoring:?}: {v:?}");
                assert!(v.worst_ratio < 1e-3, "the oracle against itself: {v:?}");
            }
        }
    }

    /// Random keys and queries leave no boundary within the bounds: with `K` = 6, so that unforced nodes are kept at
    /// every level, every row is decided.
    #[test]
    fn random_rows_are_decided() {
        let spec = AttentionSpec::dense(1, 3, 1, 600, 900, 16, 16).with_mask(Mask::Causal);
        let case = make_case::<bf16>(&spec, profile(), 17);
        for scoring in [Scoring::Lse, Scoring::Pisa1, Scoring::Pisa2] {
            let c = PyramidSelectConfig {
                q_block: 64,
                pyramid: PyramidConfig { leaf_size: 64, branching: 3, keep: 6, scoring },
            };
            let v = verify(&case, &c, &oracle_outputs(&case, &c));
            assert!(v.passed() && v.rows == 10 && v.decided == v.rows, "{scoring:?}: {v:?}");
        }
    }

    /// Every single-entry change fails: a list entry, a traced candidate, a score moved past its bound, an
    /// ineligible candidate scored; a wrong shape is an error, not a verdict.
    #[test]
    fn changed_outputs_fail() {
        let spec = AttentionSpec::dense(1, 2, 1, 500, 800, 16, 16).with_mask(Mask::Causal);
        let case = make_case::<bf16>(&spec, profile(), 5);
        let c = config(Scoring::Lse);
        let good = oracle_outputs(&case, &c);
        assert!(verify(&case, &c, &good).passed());
        for (index, &x) in good.0.indexed_iter() {
            let mut wrong = good.clone();
            wrong.0[index] = if x == -1 {
                0
            } else if x > 0 {
                x - 1
            } else {
                -1
            };
            assert!(!verify(&case, &c, &wrong).passed(), "list entry {index:?} changed from {x} passed");
        }
        let mut traced = 0;
        for (index, &x) in good.1.indexed_iter() {
            if x < 0 {
                continue;
            }
            traced += 1;
            let mut wrong = good.clone();
            wrong.1[index] = x + 1;
            assert!(!verify(&case, &c, &wrong).passed(), "traced node {index:?} changed from {x} passed");
            let mut wrong = good.clone();
            let s = good.2[index];
            wrong.2[index] = if s.is_nan() { 0.0 } else { s + 1e-9 * (1.0 + s.abs()) };
            assert!(!verify(&case, &c, &wrong).passed(), "score {index:?} ({s}) moved passed");
        }
        assert!(traced > 20, "{traced}");
        // A query block that sees no key (causal, Lq > Lk: block 0's last row is 100 rows before the first key) lists
        // nothing and traces nothing: an entry in either fails.
        let spec = AttentionSpec::dense(1, 1, 1, 300, 200, 8, 8).with_mask(Mask::Causal);
        let blind = make_case::<bf16>(&spec, profile(), 6);
        let good = oracle_outputs(&blind, &c);
        assert!(verify(&blind, &c, &good).passed());
        let mut listed = good.clone();
        listed.0[[0, 0, 0, 0]] = 0;
        assert!(!verify(&blind, &c, &listed).passed(), "a list entry for a block that sees no key passed");
        let mut traced = good.clone();
        traced.1[[0, 0, 0, 0, 0]] = 0;
        assert!(!verify(&blind, &c, &traced).passed(), "a traced node for a block that sees no key passed");
        let narrow = good.0.slice_axis(Axis(3), (0..2).into()).to_owned();
        let outputs = PyramidOutputs { lists: narrow.view(), nodes: good.1.view(), scores: good.2.view() };
        assert!(matches!(
            verify_pyramid_selection(&case, &c, outputs),
            Err(HarnessError::CandidateShape { argument: "lists", .. })
        ));
    }

    /// Two leaves with bitwise equal keys tie exactly; the replay breaks the tie to the lower one, and a kernel that
    /// kept the higher one fails although both have the same score.
    #[test]
    fn a_tie_must_break_to_the_lower_node() {
        let spec = AttentionSpec::dense(1, 1, 1, 64, 64 * 8, 8, 8).with_mask(Mask::None);
        let mut case = make_case::<bf16>(&spec, profile(), 9);
        // Leaves 3 and 5 repeat leaf 1; the query block is all one vector v, leaf 1 holds v: the three tie for best.
        let v: Vec<bf16> = (0..8).map(|c| case.q[[0, 0, 0, c]]).collect();
        for i in 0..64 {
            for c in 0..8 {
                case.q[[0, 0, i, c]] = v[c];
                for leaf in [1, 3, 5] {
                    case.k[[0, 0, leaf * 64 + i, c]] = v[c];
                }
            }
        }
        let c = PyramidSelectConfig {
            q_block: 64,
            pyramid: PyramidConfig { keep: 4, branching: 8, ..config(Scoring::Pisa1).pyramid },
        };
        let good = oracle_outputs(&case, &c);
        // Forced: leaf 0 (first), 6 and 7 (previous, current); the fourth slot goes to leaf 1.
        assert_eq!(row_of(good.0.view(), [0, 0, 0]).to_vec(), [0, 1, 6, 7]);
        // The tie is between bitwise equal leaves, which no rounding can swap: the row is decided.
        let verdict = verify(&case, &c, &good);
        assert!(verdict.passed() && verdict.decided == 1, "{verdict:?}");
        let mut higher = good.clone();
        higher.0[[0, 0, 0, 1]] = 3;
        assert!(!verify(&case, &c, &higher).passed());
        // Leaves 1 and 5 alternate v and 2v, leaf 3 alternates 2v and v: one mean, so one score up to rounding, but
        // leaf 3 holds other keys than leaf 1, so rounding could have swapped them: the row is near-tied and no longer
        // decided, although the lists still pass (and still take leaf 1).
        let mut near = case.clone();
        for i in 0..64 {
            for (c, &x) in v.iter().enumerate() {
                let (once, twice) = (x, bf16::from_f32(2.0 * x.to_f32()));
                let (even, odd) = if i % 2 == 0 { (once, twice) } else { (twice, once) };
                near.k[[0, 0, 64 + i, c]] = even;
                near.k[[0, 0, 5 * 64 + i, c]] = even;
                near.k[[0, 0, 3 * 64 + i, c]] = odd;
            }
        }
        let near_outputs = oracle_outputs(&near, &c);
        assert_eq!(row_of(near_outputs.0.view(), [0, 0, 0]).to_vec(), [0, 1, 6, 7]);
        let verdict = verify(&near, &c, &near_outputs);
        assert!(verdict.passed() && verdict.rows == 1 && verdict.decided == 0, "{verdict:?}");
        // The near-tie threshold is twice the two candidates' bounds: leaf 3's traced score lowered by 0.9 of its own
        // bound (read back from the verdict) still passes and is still near-tied with leaf 1's.
        let slot = (0..near_outputs.1.dim().4).find(|&i| near_outputs.1[[0, 0, 0, 0, i]] == 3).expect("leaf 3 traced");
        let at = [0, 0, 0, 0, slot];
        let mut probe = near_outputs.clone();
        probe.2[at] -= 1e-3 * probe.2[at].abs();
        let step = near_outputs.2[at] - probe.2[at];
        let bound = step / verify(&near, &c, &probe).worst_ratio;
        let mut lowered = near_outputs.clone();
        lowered.2[at] -= 0.9 * bound;
        let verdict = verify(&near, &c, &lowered);
        assert!(verdict.passed() && verdict.decided == 0, "{verdict:?}");
    }

    /// Each scoring's bound on a candidate, read back from the verdict (one traced score moved by `δ` gives a worst
    /// ratio of `δ / bound`), equals the module docs of `attnproof_proofs::pyramid_bound` evaluated here from the
    /// definitions: the root (every key, the coarsest means) and leaf 0 (raw keys) of a one-head, one-query-block case.
    #[test]
    fn the_bounds_are_the_derived_ones() {
        let spec = AttentionSpec::dense(1, 2, 1, 64, 64 * 9 + 5, 8, 8).with_mask(Mask::None);
        let case = make_case::<bf16>(&spec, profile(), 21);
        let [q, k, _] = case.widened();
        let keys = spec.head_rows(k.view(), &spec.sequences()[0], 0, true);
        let (d, alpha) = (8usize, 1.0 / 8f64.sqrt());
        let rows = 64;
        // Per head: the pooled query and `Q_c = mean_i |q_ic|`.
        let heads: Vec<(Array1<f64>, Array1<f64>)> = (0..2)
            .map(|h| {
                let x = spec.head_rows(q.view(), &spec.sequences()[0], h, false);
                (x.mean_axis(Axis(0)).unwrap(), x.mapv(f64::abs).mean_axis(Axis(0)).unwrap())
            })
            .collect();
        let abs_mean = |r: std::ops::Range<usize>| keys.slice_axis(Axis(0), r.into()).mapv(f64::abs).mean_axis(Axis(0));
        for scoring in [Scoring::Lse, Scoring::Pisa1, Scoring::Pisa2] {
            let c = PyramidSelectConfig {
                q_block: 64,
                pyramid: PyramidConfig { leaf_size: 64, branching: 3, keep: 3, scoring },
            };
            let p = Pyramid::build(keys, &c.pyramid, ()).unwrap();
            let top = p.levels().len() - 1;
            let good = oracle_outputs(&case, &c);
            for (level, slot) in [(top, 0), (0, 0)] {
                let node = good.1[[0, 0, 0, level, slot]] as usize;
                let range = p.key_range(level, node);
                let (mut gpu, mut oracle, mut scores) = (vec![], vec![], vec![]);
                // PISA-1's item magnitudes per head: the kernel's bound is over their sum (the group summed first).
                let mut magnitudes = vec![];
                for (query, query_abs) in &heads {
                    scores.push(p.node_score(level, node, query.view(), scoring).unwrap());
                    let items: Vec<(f64, f64, usize, usize)> = if scoring == Scoring::Pisa1 {
                        let m = alpha * query_abs.dot(&abs_mean(range.clone()).unwrap());
                        magnitudes.push(m);
                        vec![(0.0, m, gpu_mean_terms(64, 3, level), range.len())]
                    } else if level == 0 {
                        range
                            .clone()
                            .map(|j| {
                                (
                                    alpha * query.dot(&keys.row(j)),
                                    alpha * query_abs.dot(&keys.row(j).mapv(f64::abs)),
                                    0,
                                    0,
                                )
                            })
                            .collect()
                    } else {
                        p.children(level, node)
                            .map(|child| {
                                let r = p.key_range(level - 1, child);
                                let x = alpha * query.dot(&p.levels()[level - 1].means.row(child));
                                let m = alpha * query_abs.dot(&abs_mean(r.clone()).unwrap());
                                (x, m, gpu_mean_terms(64, 3, level - 1), r.len())
                            })
                            .collect()
                    };
                    let bound = |oracle_side: bool| {
                        let e_of = |&(_, m, g, o): &(f64, f64, usize, usize)| {
                            item_score_bound(m, rows, if oracle_side { o } else { g }, d)
                        };
                        if scoring == Scoring::Pisa1 {
                            return e_of(&items[0]);
                        }
                        let e_all = |side: bool| {
                            items
                                .iter()
                                .map(|i| item_score_bound(i.1, rows, if side { i.3 } else { i.2 }, d))
                                .fold(0.0, f64::max)
                        };
                        let (e, e_side) = (e_all(false).max(e_all(true)), items.iter().map(e_of).fold(0.0, f64::max));
                        let weights: Vec<f64> = if level == 0 {
                            vec![1.0; items.len()]
                        } else {
                            p.children(level, node).map(|ch| p.key_range(level - 1, ch).len() as f64).collect()
                        };
                        let total: f64 = weights.iter().sum();
                        let x_max = items.iter().map(|i| i.0.abs()).fold(0.0, f64::max) + e;
                        if scoring == Scoring::Lse {
                            return lse_bound(e_side, items.len(), total, x_max);
                        }
                        let mean = items.iter().zip(&weights).map(|(i, w)| w * i.0).sum::<f64>() / total;
                        let spread = items.iter().map(|i| (i.0 - mean).abs()).fold(0.0, f64::max) + 2.0 * e;
                        let variance =
                            items.iter().zip(&weights).map(|(i, w)| w * (i.0 - mean).powi(2)).sum::<f64>() / total;
                        pisa2_bound(e_side, items.len(), x_max, spread, variance + 4.0 * e * spread)
                    };
                    gpu.push(bound(false));
                    oracle.push(bound(true));
                }
                let abs_sum = |b: &[f64]| scores.iter().zip(b).map(|(s, b)| s.abs() + b).sum::<f64>();
                let gpu_bound = if scoring == Scoring::Pisa1 {
                    let sum = magnitudes.iter().sum();
                    presummed_score_bound(sum, rows, heads.len(), gpu_mean_terms(64, 3, level), d)
                } else {
                    group_bound(&gpu, abs_sum(&gpu))
                };
                let expected = gpu_bound + group_bound(&oracle, abs_sum(&oracle));
                let mut moved = good.clone();
                let at = [0, 0, 0, level, slot];
                moved.2[at] += 0.5 * expected;
                // The step the stored score actually took (exact: the two values are within a factor of two).
                let delta = moved.2[at] - good.2[at];
                assert!(delta > 0.0, "{scoring:?} level {level}: the score did not move");
                let v = verify(&case, &c, &moved);
                let read_back = delta / v.worst_ratio;
                assert!(v.passed(), "{scoring:?} level {level}: {v:?}");
                assert!(
                    (read_back / expected - 1.0).abs() < 1e-6,
                    "{scoring:?} level {level}: {read_back:e} vs {expected:e}"
                );
            }
        }
    }
}
