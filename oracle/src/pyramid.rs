//! Pyramid Top-K block selection (E25–E30, seed 003): the mean-pooled hierarchy of key blocks,
//! the count-normalized node scores (PISA's LSE, the PISA-1/PISA-2 truncations, BSA's pooled
//! score), the coarse-to-fine descent with causal eligibility and forced blocks, GQA-shared
//! selection, and the Recall@K / attention-mass diagnostics against the exact-mass reference.
//!
//! Conventions chosen here (`docs/equations.md` leaves them open):
//! - **Partial nodes.** Leaf `b` holds keys `[bC, min((b+1)C, N))`; only the last leaf can be
//!   partial. A node at level `ℓ` covers `C·β^ℓ` consecutive keys (the last node of a level may
//!   cover fewer and have fewer than `β` children). Every summary is the mean of the *raw keys*
//!   the node covers, and the node stores that count. This equals E25's "mean of the β child
//!   means" whenever the children have equal counts (every node when `N = C·β^L`); for the tail
//!   node it is the count-weighted mean of its children, so a partial leaf weighs what it holds.
//! - **Intermediate scores** are count-weighted in the same way:
//!   `log( Σ_c n_c e^{q·μ_c/√d} / Σ_c n_c )`, which is E26's `log mean_c` for equal counts and
//!   keeps E29's Jensen ordering for the tail node too.
//! - **Levels.** Level 0 are the leaves; levels are added until one node (the root) remains, so
//!   the descent starts by scoring that single root.
//! - **Forced blocks occupy slots inside the budget K** (as in the paper's diagnostic, whose
//!   Recall@8 "includes three forced blocks", and as [`top_k`] counts forced entries): at every
//!   level the forced nodes (the first, previous and current leaf and their ancestors) come first
//!   whatever their score, and the remaining `K − |forced|` slots go to the best eligible
//!   candidates. If more nodes are forced than `K` (only possible for `K < 3`), all of them are
//!   kept. The selection is therefore padded to `max(K, 3)` entries.
//! - **Causality.** The query at `position` sees keys `0..=position`. A candidate whose first key
//!   is after `position` is ineligible and is not scored. The only eligible nodes that contain
//!   future keys are the current leaf and its ancestors; they are forced, so their (scored)
//!   values never decide a rank. Attention itself must still mask the future keys.
//! - **GQA.** The query is the `[group, d]` matrix of the query heads that share one KV head; a
//!   candidate's score is the sum of its per-head scores, and one selection is shared.
//! - **Scale** `α = 1/√d`.

use std::ops::Range;

use ndarray::{Array2, ArrayView1, ArrayView2, Axis, Slice};

use crate::error::{OracleError, check_finite};
use crate::real::Real;
use crate::topk::{padded_ascending, top_k, validate_index_row};
use crate::vector::{block_means, dot, log_sum_exp, softmax};

/// The largest number of forced leaves: the first, the previous and the current block (E28).
pub const MAX_FORCED_LEAVES: usize = 3;

/// How a candidate node is scored (E26). Every score is normalized by the count of what it
/// pools, so candidates of equal count compare on one scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// PISA: intermediate nodes by the (count-weighted) log-mean-exp of their children's mean
    /// scores, leaves by the exact log-mean-exp of their raw key scores.
    Lse,
    /// PISA-1, first-order truncation: the mean score `q·μ_n/√d` at every level.
    Pisa1,
    /// PISA-2, second-order truncation: the mean of the pooled scores plus half their variance
    /// (pooled scores: child-mean scores for intermediate nodes, raw key scores for leaves).
    Pisa2,
    /// Block-sparse attention: no hierarchy, every leaf scored by `q·k̄_b/√d`.
    Bsa,
}

/// Parameters of Pyramid Top-K selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyramidConfig {
    /// Keys per leaf block `C` (paper: 64).
    pub leaf_size: usize,
    /// Children per node `β`.
    pub branching: usize,
    /// Nodes kept per level `K`, forced nodes included.
    pub keep: usize,
    /// The score that ranks candidates.
    pub scoring: Scoring,
}

impl PyramidConfig {
    /// Checks `C ≥ 1`, `β ≥ 2` (a branching of 1 never shrinks a level) and `K ≥ 1`.
    pub fn validate(&self) -> Result<(), OracleError> {
        if self.leaf_size == 0 {
            return Err(OracleError::ZeroDimension { argument: "leaf_size" });
        }
        if self.branching < 2 {
            return Err(OracleError::InvalidParameter {
                argument: "branching",
                reason: format!("branching factor {} must be at least 2", self.branching),
            });
        }
        if self.keep == 0 {
            return Err(OracleError::ZeroDimension { argument: "keep" });
        }
        Ok(())
    }

    /// Width of the padded selection list: `max(K, 3)`, room for every kept leaf.
    pub fn selection_width(&self) -> usize {
        self.keep.max(MAX_FORCED_LEAVES)
    }
}

/// One level of the hierarchy.
#[derive(Clone, Debug, PartialEq)]
pub struct Level<S> {
    /// Mean key of each node `[width, d]`.
    pub means: Array2<S>,
    /// Number of raw keys under each node.
    pub counts: Vec<usize>,
}

/// The mean-pooled key hierarchy of one KV head (E25): level 0 are the leaves, the last level a
/// single root.
#[derive(Clone, Debug, PartialEq)]
pub struct Pyramid<S> {
    keys: Array2<S>,
    leaf_size: usize,
    branching: usize,
    levels: Vec<Level<S>>,
}

/// The query heads of one KV head at one position.
#[derive(Clone, Copy, Debug)]
pub struct PyramidQuery<'a, S> {
    /// Query vectors `[group, d]` of the query heads sharing the KV head (one row without GQA).
    pub heads: ArrayView2<'a, S>,
    /// Index of the query's own key: it sees keys `0..=position`.
    pub position: usize,
}

/// What the descent did at one level.
#[derive(Clone, Debug, PartialEq)]
pub struct LevelTrace<S> {
    /// The level (0 = leaves).
    pub level: usize,
    /// Candidate nodes, ascending.
    pub candidates: Vec<usize>,
    /// Score of each candidate summed over the query heads; `None` for an ineligible candidate,
    /// which is never scored.
    pub scores: Vec<Option<S>>,
    /// Forced nodes among the candidates, ascending.
    pub forced: Vec<usize>,
    /// Nodes kept, ascending.
    pub kept: Vec<usize>,
}

impl<S> LevelTrace<S> {
    /// Number of candidates scored at this level.
    pub fn scored(&self) -> usize {
        self.scores.iter().filter(|s| s.is_some()).count()
    }
    /// The summed score of a kept or candidate node, if it was scored.
    pub fn score_of(&self, node: usize) -> Option<&S> {
        self.candidates.iter().position(|&c| c == node).and_then(|i| self.scores[i].as_ref())
    }
}

/// The result of a descent for one query (E27, E28).
#[derive(Clone, Debug, PartialEq)]
pub struct Descent<S> {
    /// Selected leaves as `i32`, ascending, padded with `−1` to [`PyramidConfig::selection_width`].
    pub selected: Vec<i32>,
    /// The forced leaves (first, previous, current), ascending.
    pub forced_leaves: Vec<usize>,
    /// One entry per level visited, coarsest first.
    pub trace: Vec<LevelTrace<S>>,
    /// Candidates scored for this query, summed over levels (per KV head; each is scored once
    /// per query head).
    pub candidates_scored: usize,
}

impl<S> Descent<S> {
    /// The valid prefix of [`Descent::selected`] as indices.
    pub fn selected_leaves(&self) -> Vec<usize> {
        self.selected.iter().filter(|&&x| x >= 0).map(|&x| x as usize).collect()
    }
}

/// Recall and captured-mass diagnostics of a selection (E30).
#[derive(Clone, Debug, PartialEq)]
pub struct Diagnostics<S> {
    /// Exact attention mass of each leaf, `Σ_{j∈b} P_ij` (averaged over the query heads).
    pub block_mass: Vec<S>,
    /// Reference set: the forced leaves plus the eligible leaves of largest mass, `K` in all
    /// (more only if more are forced), ascending.
    pub reference: Vec<usize>,
    /// `|S ∩ S_ref| / |S_ref|` (Recall@K: `|S_ref| = K` whenever `K ≥ 3`).
    pub recall: S,
    /// Mass captured by the selection, `Σ_{b∈S} mass_b`.
    pub captured: S,
    /// Mass captured by the reference set.
    pub reference_captured: S,
    /// Attention mass ratio `captured(S) / captured(S_ref)`; when the reference set captures no mass at all (every
    /// slot forced and the mass elsewhere, underflowed to zero), 1 if the selection captures none either and `+∞`
    /// otherwise, never `0/0`.
    pub mass_ratio: S,
}

/// `α = 1/√d`.
fn inverse_sqrt<S: Real>(head_dim: usize, ctx: S::Ctx) -> S {
    S::one(ctx) / S::from_f64(head_dim as f64, ctx).sqrt()
}

/// `q·x_r/√d` for every row `r` of `x`.
fn row_scores<S: Real>(query: ArrayView1<'_, S>, x: ArrayView2<'_, S>, ctx: S::Ctx) -> Vec<S> {
    let alpha = inverse_sqrt::<S>(query.len(), ctx);
    x.rows().into_iter().map(|row| dot(query, row, ctx) * alpha.clone()).collect()
}

/// `log( Σ_i w_i e^{x_i} / Σ_i w_i )`, through [`log_sum_exp`] of `x_i + log w_i`.
fn weighted_log_mean_exp<S: Real>(xs: &[S], weights: &[usize], ctx: S::Ctx) -> S {
    let shifted: Vec<S> = xs.iter().zip(weights).map(|(x, &w)| x.clone() + S::from_f64(w as f64, ctx).ln()).collect();
    let total: usize = weights.iter().sum();
    log_sum_exp(&shifted, ctx) - S::from_f64(total as f64, ctx).ln()
}

/// Weighted mean plus half the weighted (population) variance of `xs`: the second-order
/// truncation of [`weighted_log_mean_exp`] about the mean.
fn mean_plus_half_variance<S: Real>(xs: &[S], weights: &[usize], ctx: S::Ctx) -> S {
    let total = S::from_f64(weights.iter().sum::<usize>() as f64, ctx);
    let w = |i: usize| S::from_f64(weights[i] as f64, ctx);
    let mean = (0..xs.len()).fold(S::zero(ctx), |acc, i| acc + w(i) * xs[i].clone()) / total.clone();
    let variance = (0..xs.len()).fold(S::zero(ctx), |acc, i| {
        let dev = xs[i].clone() - mean.clone();
        acc + w(i) * dev.clone() * dev
    }) / total;
    mean + variance / S::from_f64(2.0, ctx)
}

fn check_query_vector<S: Real>(
    argument: &'static str,
    query: ArrayView1<'_, S>,
    head_dim: usize,
) -> Result<(), OracleError> {
    if query.len() != head_dim {
        return Err(OracleError::ShapeMismatch { argument, expected: vec![head_dim], actual: vec![query.len()] });
    }
    check_finite(argument, &query)
}

/// E26 leaf score: `log mean_{j} e^{q·k_j/√d}` over the raw `keys` `[n, d]` of one block
/// (exact; `n ≥ 1`).
pub fn raw_key_lse<S: Real>(query: ArrayView1<'_, S>, keys: ArrayView2<'_, S>, ctx: S::Ctx) -> Result<S, OracleError> {
    if keys.nrows() == 0 {
        return Err(OracleError::ZeroDimension { argument: "keys" });
    }
    check_query_vector("query", query, keys.ncols())?;
    Ok(weighted_log_mean_exp(&row_scores(query, keys, ctx), &vec![1; keys.nrows()], ctx))
}

/// E26 intermediate score: `log( Σ_c n_c e^{q·μ_c/√d} / Σ_c n_c )` over the children's mean keys
/// `child_means` `[children, d]` and their key counts (equal counts: `log mean_c e^{q·μ_c/√d}`).
pub fn child_mean_lse<S: Real>(
    query: ArrayView1<'_, S>,
    child_means: ArrayView2<'_, S>,
    child_counts: &[usize],
    ctx: S::Ctx,
) -> Result<S, OracleError> {
    if child_means.nrows() == 0 {
        return Err(OracleError::ZeroDimension { argument: "child_means" });
    }
    if child_counts.len() != child_means.nrows() {
        return Err(OracleError::ShapeMismatch {
            argument: "child_counts",
            expected: vec![child_means.nrows()],
            actual: vec![child_counts.len()],
        });
    }
    if child_counts.contains(&0) {
        return Err(OracleError::InvalidParameter { argument: "child_counts", reason: "a child with no keys".into() });
    }
    check_query_vector("query", query, child_means.ncols())?;
    Ok(weighted_log_mean_exp(&row_scores(query, child_means, ctx), child_counts, ctx))
}

impl<S: Real> Pyramid<S> {
    /// E25: builds the hierarchy of `keys` `[N, d]` with the leaf size and branching factor of
    /// `config` (its `keep` and `scoring` are not used here).
    pub fn build(keys: ArrayView2<'_, S>, config: &PyramidConfig, ctx: S::Ctx) -> Result<Self, OracleError> {
        config.validate()?;
        if keys.nrows() == 0 {
            return Err(OracleError::ZeroDimension { argument: "keys" });
        }
        if keys.ncols() == 0 {
            return Err(OracleError::ZeroDimension { argument: "head_dim" });
        }
        check_finite("keys", &keys)?;
        let n_keys = keys.nrows();
        let mut levels = Vec::new();
        let mut span = config.leaf_size;
        loop {
            // A node's summary is the mean of the raw keys it covers (see the module docs).
            let means = block_means(keys, span, ctx);
            let width = means.nrows();
            let counts = (0..width).map(|n| ((n + 1) * span).min(n_keys) - n * span).collect();
            levels.push(Level { means, counts });
            if width == 1 {
                break;
            }
            // `span < N` here, so the product cannot overflow for any array that fits in memory.
            span *= config.branching;
        }
        Ok(Pyramid { keys: keys.to_owned(), leaf_size: config.leaf_size, branching: config.branching, levels })
    }

    fn ctx(&self) -> S::Ctx {
        self.keys[[0, 0]].ctx()
    }
    /// The raw keys `[N, d]`.
    pub fn keys(&self) -> ArrayView2<'_, S> {
        self.keys.view()
    }
    /// Keys per leaf `C`.
    pub fn leaf_size(&self) -> usize {
        self.leaf_size
    }
    /// Branching factor `β`.
    pub fn branching(&self) -> usize {
        self.branching
    }
    /// Head dimension `d`.
    pub fn head_dim(&self) -> usize {
        self.keys.ncols()
    }
    /// Number of keys `N`.
    pub fn n_keys(&self) -> usize {
        self.keys.nrows()
    }
    /// Number of leaves `⌈N/C⌉`.
    pub fn n_leaves(&self) -> usize {
        self.levels[0].counts.len()
    }
    /// The levels, leaves first, root last.
    pub fn levels(&self) -> &[Level<S>] {
        &self.levels
    }
    /// Number of nodes at `level` (0 beyond the root).
    pub fn width(&self, level: usize) -> usize {
        self.levels.get(level).map_or(0, |l| l.counts.len())
    }
    /// Keys covered by one node at `level`: `C·β^level`, fewer for the last node.
    pub fn span(&self, level: usize) -> usize {
        self.leaf_size.saturating_mul(self.branching.saturating_pow(level as u32))
    }
    /// The key range of `node` at `level`.
    pub fn key_range(&self, level: usize, node: usize) -> Range<usize> {
        let span = self.span(level);
        node.saturating_mul(span).min(self.n_keys())..node.saturating_add(1).saturating_mul(span).min(self.n_keys())
    }
    /// The children (nodes at `level − 1`) of `node` at `level`; empty for a leaf.
    pub fn children(&self, level: usize, node: usize) -> Range<usize> {
        if level == 0 {
            return 0..0;
        }
        let below = self.width(level - 1);
        node.saturating_mul(self.branching).min(below)..node.saturating_add(1).saturating_mul(self.branching).min(below)
    }
    /// The ancestor at `level` of `leaf`.
    pub fn ancestor(&self, leaf: usize, level: usize) -> usize {
        leaf / self.branching.saturating_pow(level as u32)
    }

    fn check_node(&self, level: usize, node: usize) -> Result<(), OracleError> {
        if level >= self.levels.len() {
            return Err(OracleError::InvalidParameter {
                argument: "level",
                reason: format!("level {level} beyond the root level {}", self.levels.len() - 1),
            });
        }
        if node >= self.width(level) {
            return Err(OracleError::InvalidParameter {
                argument: "node",
                reason: format!("node {node} out of range 0..{} at level {level}", self.width(level)),
            });
        }
        Ok(())
    }

    /// E26: the score of `node` at `level` for one query head `query` `[d]`.
    pub fn node_score(
        &self,
        level: usize,
        node: usize,
        query: ArrayView1<'_, S>,
        scoring: Scoring,
    ) -> Result<S, OracleError> {
        self.check_node(level, node)?;
        check_query_vector("query", query, self.head_dim())?;
        if scoring == Scoring::Bsa && level > 0 {
            return Err(OracleError::InvalidParameter {
                argument: "scoring",
                reason: "BSA scores leaves only; it has no hierarchy".into(),
            });
        }
        Ok(self.score_unchecked(level, node, query, scoring))
    }

    /// The scores being pooled by a node with their weights: the raw key scores of a leaf
    /// (weight 1 each), the child-mean scores of an intermediate node (weight = child count).
    fn pooled(&self, level: usize, node: usize, query: ArrayView1<'_, S>) -> (Vec<S>, Vec<usize>) {
        let ctx = self.ctx();
        if level == 0 {
            let keys = self.keys.slice_axis(Axis(0), Slice::from(self.key_range(0, node)));
            (row_scores(query, keys, ctx), vec![1; keys.nrows()])
        } else {
            let children = self.children(level, node);
            let below = &self.levels[level - 1];
            let means = below.means.slice_axis(Axis(0), Slice::from(children.clone()));
            (row_scores(query, means, ctx), below.counts[children].to_vec())
        }
    }

    fn score_unchecked(&self, level: usize, node: usize, query: ArrayView1<'_, S>, scoring: Scoring) -> S {
        let ctx = self.ctx();
        match scoring {
            Scoring::Lse => {
                let (scores, weights) = self.pooled(level, node, query);
                weighted_log_mean_exp(&scores, &weights, ctx)
            }
            Scoring::Pisa2 => {
                let (scores, weights) = self.pooled(level, node, query);
                mean_plus_half_variance(&scores, &weights, ctx)
            }
            Scoring::Pisa1 | Scoring::Bsa => {
                let mean = self.levels[level].means.row(node);
                dot(query, mean, ctx) * inverse_sqrt::<S>(query.len(), ctx)
            }
        }
    }

    /// Checks a query against this pyramid: `[group ≥ 1, d]`, finite, `position < N`.
    pub fn check_query(&self, query: &PyramidQuery<'_, S>) -> Result<(), OracleError> {
        if query.heads.nrows() == 0 {
            return Err(OracleError::ZeroDimension { argument: "query_heads" });
        }
        if query.heads.ncols() != self.head_dim() {
            return Err(OracleError::ShapeMismatch {
                argument: "query_heads",
                expected: vec![query.heads.nrows(), self.head_dim()],
                actual: query.heads.shape().to_vec(),
            });
        }
        check_finite("query_heads", &query.heads)?;
        if query.position >= self.n_keys() {
            return Err(OracleError::InvalidParameter {
                argument: "position",
                reason: format!("position {} is not among the {} keys", query.position, self.n_keys()),
            });
        }
        Ok(())
    }

    fn check_config(&self, config: &PyramidConfig) -> Result<(), OracleError> {
        config.validate()?;
        if config.leaf_size != self.leaf_size || config.branching != self.branching {
            return Err(OracleError::InvalidParameter {
                argument: "config",
                reason: format!(
                    "leaf size {} / branching {} differ from the pyramid's {} / {}",
                    config.leaf_size, config.branching, self.leaf_size, self.branching
                ),
            });
        }
        Ok(())
    }
}

/// E28: the forced leaves of a query at `position`: the first block, the previous block and the
/// current block (`⌊position/C⌋`), deduplicated, ascending.
pub fn forced_leaves(position: usize, leaf_size: usize) -> Vec<usize> {
    let current = position / leaf_size.max(1);
    let mut forced = vec![0, current.saturating_sub(1), current];
    forced.dedup();
    forced
}

/// One level of the descent (E27, E28): scores the eligible `candidates` at `level` (summed over
/// the query heads), and keeps the forced nodes among them (ancestors of the forced leaves) plus
/// the best eligible ones, `keep` in all. Ties go to the lower node.
pub fn descent_step<S: Real>(
    pyramid: &Pyramid<S>,
    level: usize,
    candidates: &[usize],
    query: &PyramidQuery<'_, S>,
    keep: usize,
    scoring: Scoring,
) -> Result<LevelTrace<S>, OracleError> {
    pyramid.check_query(query)?;
    for &c in candidates {
        pyramid.check_node(level, c)?;
    }
    if scoring == Scoring::Bsa && level > 0 {
        return Err(OracleError::InvalidParameter { argument: "scoring", reason: "BSA scores leaves only".into() });
    }
    let mut candidates = candidates.to_vec();
    candidates.sort_unstable();
    candidates.dedup();
    let ctx = pyramid.ctx();
    let eligible: Vec<bool> = candidates.iter().map(|&c| pyramid.key_range(level, c).start <= query.position).collect();
    let scores: Vec<Option<S>> = candidates
        .iter()
        .zip(&eligible)
        .map(|(&c, &ok)| {
            ok.then(|| {
                query
                    .heads
                    .rows()
                    .into_iter()
                    .fold(S::zero(ctx), |acc, q| acc + pyramid.score_unchecked(level, c, q, scoring))
            })
        })
        .collect();
    let forced_nodes: Vec<usize> =
        forced_leaves(query.position, pyramid.leaf_size()).iter().map(|&leaf| pyramid.ancestor(leaf, level)).collect();
    let forced_slots: Vec<usize> = (0..candidates.len()).filter(|&i| forced_nodes.contains(&candidates[i])).collect();
    // Ineligible candidates get −∞ only to fill the slice; `eligible` keeps them out of the ranking.
    let ranked: Vec<S> = scores.iter().map(|s| s.clone().unwrap_or_else(|| S::neg_infinity(ctx))).collect();
    let mut kept: Vec<usize> =
        top_k(&ranked, keep, |i| eligible[i], &forced_slots).into_iter().map(|i| candidates[i]).collect();
    kept.sort_unstable();
    let forced = forced_slots.iter().map(|&i| candidates[i]).collect();
    Ok(LevelTrace { level, candidates, scores, forced, kept })
}

/// The children of the `kept` nodes at `level`, ascending: the next level's candidates.
pub fn expand<S: Real>(pyramid: &Pyramid<S>, level: usize, kept: &[usize]) -> Vec<usize> {
    let mut next: Vec<usize> = kept.iter().flat_map(|&n| pyramid.children(level, n)).collect();
    next.sort_unstable();
    next.dedup();
    next
}

/// E27: the coarse-to-fine descent for one query (all the query heads of one KV head). Scores
/// the root, keeps up to `K`, expands their children, scores those candidates, keeps `K`, down to
/// the leaves. With [`Scoring::Bsa`] it scores every leaf instead (one level, no hierarchy).
pub fn descend<S: Real>(
    pyramid: &Pyramid<S>,
    query: &PyramidQuery<'_, S>,
    config: &PyramidConfig,
) -> Result<Descent<S>, OracleError> {
    pyramid.check_config(config)?;
    pyramid.check_query(query)?;
    let top = if config.scoring == Scoring::Bsa { 0 } else { pyramid.levels().len() - 1 };
    let mut candidates: Vec<usize> = (0..pyramid.width(top)).collect();
    let mut trace = Vec::with_capacity(top + 1);
    for level in (0..=top).rev() {
        let step = descent_step(pyramid, level, &candidates, query, config.keep, config.scoring)?;
        candidates = expand(pyramid, level, &step.kept);
        trace.push(step);
    }
    Ok(finish_descent(trace, query.position, config))
}

/// Assembles a [`Descent`] from its level traces (coarsest first, leaves last): the padded
/// selection from the leaf level's kept nodes and the count of scored candidates.
pub fn finish_descent<S>(trace: Vec<LevelTrace<S>>, position: usize, config: &PyramidConfig) -> Descent<S> {
    let leaves = trace.last().map(|t| t.kept.clone()).unwrap_or_default();
    Descent {
        selected: padded_ascending(&leaves, config.selection_width().max(leaves.len())),
        forced_leaves: forced_leaves(position, config.leaf_size),
        candidates_scored: trace.iter().map(LevelTrace::scored).sum(),
        trace,
    }
}

/// E30: exact block masses of the query (dense causal softmax over keys `0..=position`, averaged
/// over the query heads), the reference set (forced leaves plus the eligible leaves of largest
/// mass, `keep` in all), and Recall@K, captured mass and attention mass ratio of `selected` (an
/// index row in the E14 convention: ascending, `−1` padded).
pub fn diagnostics<S: Real>(
    pyramid: &Pyramid<S>,
    query: &PyramidQuery<'_, S>,
    selected: &[i32],
    keep: usize,
) -> Result<Diagnostics<S>, OracleError> {
    pyramid.check_query(query)?;
    if keep == 0 {
        return Err(OracleError::ZeroDimension { argument: "keep" });
    }
    let selected = validate_index_row("selected", 0, selected, pyramid.n_leaves())?;
    let ctx = pyramid.ctx();
    let visible = pyramid.keys.slice_axis(Axis(0), Slice::from(0..=query.position));
    let group = S::from_f64(query.heads.nrows() as f64, ctx);
    let mut block_mass = vec![S::zero(ctx); pyramid.n_leaves()];
    for q in query.heads.rows() {
        let p = softmax(&row_scores(q, visible, ctx), ctx);
        for (j, pj) in p.into_iter().enumerate() {
            let b = j / pyramid.leaf_size();
            block_mass[b] = block_mass[b].clone() + pj / group.clone();
        }
    }
    Ok(diagnose_masses(block_mass, query.position, pyramid.leaf_size(), &selected, keep, ctx))
}

/// E30 from block masses already computed (by [`diagnostics`] for one query, or averaged over a query block's rows
/// as the GPU's diagnostics do): the reference set (the forced leaves of `position` plus the eligible leaves of
/// largest mass, `keep` in all, ties to the lower leaf: [`top_k`]), Recall@K, the captured masses and their ratio.
/// `selected` holds leaves below `block_mass.len()` (validated by the caller); a leaf is eligible when it starts at
/// or before `position`. A reference set of zero mass gives the ratio of [`Diagnostics::mass_ratio`]'s convention.
pub fn diagnose_masses<S: Real>(
    block_mass: Vec<S>,
    position: usize,
    leaf_size: usize,
    selected: &[usize],
    keep: usize,
    ctx: S::Ctx,
) -> Diagnostics<S> {
    let eligible = |b: usize| b * leaf_size <= position;
    let mut reference = top_k(&block_mass, keep, eligible, &forced_leaves(position, leaf_size));
    reference.sort_unstable();
    let captured_by = |set: &[usize]| set.iter().fold(S::zero(ctx), |acc, &b| acc + block_mass[b].clone());
    let (captured, reference_captured) = (captured_by(selected), captured_by(&reference));
    let hits = selected.iter().filter(|b| reference.contains(b)).count();
    let recall = S::from_f64(hits as f64, ctx) / S::from_f64(reference.len() as f64, ctx);
    let zero = S::zero(ctx);
    let mass_ratio = match (reference_captured == zero, captured == zero) {
        (false, _) => captured.clone() / reference_captured.clone(),
        (true, true) => S::one(ctx),
        (true, false) => S::one(ctx) / zero,
    };
    Diagnostics { block_mass, reference, recall, captured, reference_captured, mass_ratio }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::uniform;
    use ndarray::Array2;

    fn config(leaf_size: usize, branching: usize, keep: usize) -> PyramidConfig {
        PyramidConfig { leaf_size, branching, keep, scoring: Scoring::Lse }
    }

    fn keys(n: usize, d: usize, seed: u64) -> Array2<f64> {
        Array2::from_shape_vec((n, d), uniform(seed, n * d)).expect("sizes agree")
    }

    /// E30 from given masses: forced leaves of position 255 (leaves of 64: 0, 2, 3) fill the reference set of
    /// `K = 3`; the list {1, 3} holds one of them and captures 0.2 + 0.4 of the reference's 0.1 + 0.3 + 0.4.
    /// All the mass on an unforced leaf while `K = 3` forced leaves fill the reference set (masses that underflowed to
    /// 0 elsewhere, as f64 gives at large logit scales): the reference captures nothing, and a selection that captures
    /// nothing either has ratio 1, one that captures the mass `+∞`, never NaN.
    #[test]
    fn a_reference_of_zero_mass_has_a_defined_ratio() {
        let masses = vec![0.0, 1.0, 0.0, 0.0];
        let same = diagnose_masses(masses.clone(), 255, 64, &[0, 2, 3], 3, ());
        assert_eq!((same.reference.as_slice(), same.reference_captured, same.captured), (&[0, 2, 3][..], 0.0, 0.0));
        assert_eq!((same.recall, same.mass_ratio), (1.0, 1.0));
        let better = diagnose_masses(masses, 255, 64, &[1, 2, 3], 3, ());
        assert_eq!(better.mass_ratio, f64::INFINITY);
        // With mass in the reference set the ratio is the plain quotient, 0 included.
        assert_eq!(diagnose_masses(vec![0.5, 0.5, 0.0, 0.0], 255, 64, &[2, 3], 3, ()).mass_ratio, 0.0);
    }

    #[test]
    fn diagnose_masses_takes_the_forced_leaves_and_sums_the_captured_masses() {
        let d = diagnose_masses(vec![0.1, 0.2, 0.3, 0.4], 255, 64, &[1, 3], 3, ());
        assert_eq!(d.reference, [0, 2, 3]);
        assert!((d.recall - 1.0 / 3.0).abs() < 1e-15);
        assert!((d.captured - 0.6).abs() < 1e-15 && (d.reference_captured - 0.8).abs() < 1e-15);
        assert!((d.mass_ratio - 0.75).abs() < 1e-15);
        // Position 70 (leaf 1): leaf 2 and 3 are not eligible; the forced 0 and 1 and nothing else.
        let early = diagnose_masses(vec![0.1, 0.2, 0.3, 0.4], 70, 64, &[0, 1], 3, ());
        assert_eq!(early.reference, [0, 1]);
        assert_eq!(early.recall, 1.0);
    }

    #[test]
    fn hierarchy_widths_counts_and_partial_tail() {
        // 23 keys, C = 4, β = 2: leaves 6 (last holds 3 keys), then 3, 2, 1 nodes.
        let k = keys(23, 3, 1);
        let p = Pyramid::build(k.view(), &config(4, 2, 2), ()).unwrap();
        let widths: Vec<usize> = (0..p.levels().len()).map(|l| p.width(l)).collect();
        assert_eq!(widths, vec![6, 3, 2, 1]);
        assert_eq!((p.leaf_size(), p.branching(), p.n_keys(), p.head_dim()), (4, 2, 23, 3));
        assert_eq!(p.levels()[0].counts, vec![4, 4, 4, 4, 4, 3]);
        assert_eq!(p.levels()[1].counts, vec![8, 8, 7]);
        assert_eq!(p.levels()[2].counts, vec![16, 7]);
        assert_eq!(p.levels()[3].counts, vec![23]);
        assert_eq!(p.children(2, 1), 2..3);
        assert_eq!(p.key_range(1, 2), 16..23);
        // Every summary is the count-weighted mean of its children's summaries.
        for level in 1..p.levels().len() {
            for node in 0..p.width(level) {
                for c in 0..3 {
                    let children = p.children(level, node);
                    let below = &p.levels()[level - 1];
                    let weighted: f64 = children.clone().map(|ch| below.counts[ch] as f64 * below.means[[ch, c]]).sum();
                    let expected = weighted / p.levels()[level].counts[node] as f64;
                    assert!((p.levels()[level].means[[node, c]] - expected).abs() < 1e-14);
                }
            }
        }
    }

    #[test]
    fn pisa_truncations_match_their_closed_forms_on_a_leaf() {
        // One leaf of two keys in d = 1: scores a, b; PISA-1 = (a+b)/2, PISA-2 adds ((a−b)/2)²/2.
        let k = Array2::from_shape_vec((2, 1), vec![0.5, -1.5]).unwrap();
        let p = Pyramid::build(k.view(), &config(2, 2, 1), ()).unwrap();
        let q = ndarray::array![2.0];
        let (a, b) = (1.0, -3.0);
        let pisa1 = p.node_score(0, 0, q.view(), Scoring::Pisa1).unwrap();
        let pisa2 = p.node_score(0, 0, q.view(), Scoring::Pisa2).unwrap();
        let lse = p.node_score(0, 0, q.view(), Scoring::Lse).unwrap();
        assert!((pisa1 - (a + b) / 2.0).abs() < 1e-15);
        assert!((pisa2 - ((a + b) / 2.0 + ((a - b) / 2.0f64).powi(2) / 2.0)).abs() < 1e-15);
        assert!((lse - ((a.exp() + b.exp()) / 2.0).ln()).abs() < 1e-15);
    }

    #[test]
    fn bsa_scores_leaves_and_refuses_coarser_levels() {
        // BSA is one level of mean-pooled leaves: a leaf's score is the query's dot with the leaf's mean key, over
        // √d (d = 4 here, so the scale is 1/2 and is not its own inverse).
        let k = Array2::from_shape_fn((4, 4), |(j, c)| if c == 0 { [0.5, -1.5, 2.0, 1.0][j] } else { 0.25 });
        let p = Pyramid::build(k.view(), &config(2, 2, 1), ()).unwrap();
        let q = ndarray::array![2.0, 0.0, 0.0, 0.0];
        assert_eq!(p.node_score(0, 0, q.view(), Scoring::Bsa), Ok(-0.5));
        assert_eq!(p.node_score(0, 1, q.view(), Scoring::Bsa), Ok(1.5));
        let refused = |result: Result<(), OracleError>| {
            matches!(result, Err(OracleError::InvalidParameter { argument: "scoring", .. }))
        };
        assert!(refused(p.node_score(1, 0, q.view(), Scoring::Bsa).map(drop)));
        let heads = q.clone().insert_axis(Axis(0));
        let query = PyramidQuery { heads: heads.view(), position: 3 };
        assert!(descent_step(&p, 0, &[0, 1], &query, 1, Scoring::Bsa).is_ok());
        assert!(refused(descent_step(&p, 1, &[0], &query, 1, Scoring::Bsa).map(drop)));
    }

    #[test]
    fn the_reference_set_holds_only_leaves_the_query_can_see() {
        // 8 leaves of 4 keys; a query at key 9 sees leaves 0, 1 and 2. Asking for more than that keeps those three.
        let k = keys(32, 2, 7);
        let p = Pyramid::build(k.view(), &config(4, 2, 8), ()).unwrap();
        let heads = keys(2, 2, 8);
        let query = PyramidQuery { heads: heads.view(), position: 9 };
        let found = diagnostics(&p, &query, &[0, 2, -1], 8).unwrap();
        assert_eq!(found.reference, [0, 1, 2]);
        assert_eq!(found.recall, 2.0 / 3.0);
        assert!(found.block_mass[3..].iter().all(|&m| m == 0.0));
    }

    #[test]
    fn descent_is_causal_and_keeps_forced_leaves() {
        let k = keys(64, 4, 2);
        let cfg = config(4, 2, 4);
        let p = Pyramid::build(k.view(), &cfg, ()).unwrap();
        let heads = keys(2, 4, 3);
        for position in [0, 3, 4, 37, 63] {
            let q = PyramidQuery { heads: heads.view(), position };
            let d = descend(&p, &q, &cfg).unwrap();
            let leaves = d.selected_leaves();
            assert!(leaves.iter().all(|&b| b * 4 <= position), "{leaves:?} at {position}");
            assert!(d.forced_leaves.iter().all(|f| leaves.contains(f)));
            assert_eq!(leaves.len(), (position / 4 + 1).min(4));
            // Every query's list has the same width, padded with −1 after its leaves.
            assert_eq!(d.selected.len(), 4, "{:?} at {position}", d.selected);
            assert!(d.selected[leaves.len()..].iter().all(|&b| b == -1), "{:?}", d.selected);
        }
    }

    #[test]
    fn the_selection_width_has_room_for_the_kept_and_the_forced_leaves() {
        assert_eq!(config(4, 2, 1).selection_width(), MAX_FORCED_LEAVES);
        assert_eq!(config(4, 2, 3).selection_width(), 3);
        assert_eq!(config(4, 2, 7).selection_width(), 7);
        // K = 1 still keeps the three forced leaves of a late query; an early query's list is padded to the same width.
        let k = keys(32, 2, 5);
        let cfg = config(4, 2, 1);
        let p = Pyramid::build(k.view(), &cfg, ()).unwrap();
        let heads = keys(1, 2, 6);
        for (position, width) in [(0, 1), (20, 3)] {
            let d = descend(&p, &PyramidQuery { heads: heads.view(), position }, &cfg).unwrap();
            assert_eq!(d.selected_leaves().len(), width, "{:?} at {position}", d.selected);
            assert_eq!(d.selected.len(), MAX_FORCED_LEAVES, "{:?} at {position}", d.selected);
        }
    }

    #[test]
    fn bad_config_is_rejected_by_name() {
        let k = keys(8, 2, 4);
        let err = Pyramid::build(k.view(), &config(0, 2, 1), ()).unwrap_err();
        assert_eq!(err, OracleError::ZeroDimension { argument: "leaf_size" });
        let err = Pyramid::build(k.view(), &config(2, 1, 1), ()).unwrap_err();
        assert!(matches!(err, OracleError::InvalidParameter { argument: "branching", .. }), "{err}");
        let err = Pyramid::build(k.view(), &config(2, 2, 0), ()).unwrap_err();
        assert_eq!(err, OracleError::ZeroDimension { argument: "keep" });
        let p = Pyramid::build(k.view(), &config(2, 2, 1), ()).unwrap();
        let heads = keys(1, 2, 5);
        let q = PyramidQuery { heads: heads.view(), position: 7 };
        let err = descend(&p, &q, &config(4, 2, 1)).unwrap_err();
        assert!(matches!(err, OracleError::InvalidParameter { argument: "config", .. }), "{err}");
    }

    #[test]
    fn bad_keys_and_queries_are_rejected_by_name() {
        let cfg = config(2, 2, 1);
        let empty = Array2::<f64>::zeros((0, 2));
        assert_eq!(
            Pyramid::build(empty.view(), &cfg, ()).unwrap_err(),
            OracleError::ZeroDimension { argument: "keys" }
        );
        let flat = Array2::<f64>::zeros((4, 0));
        let err = Pyramid::build(flat.view(), &cfg, ()).unwrap_err();
        assert_eq!(err, OracleError::ZeroDimension { argument: "head_dim" });
        let mut k = keys(8, 2, 6);
        k[[5, 1]] = f64::NAN;
        let err = Pyramid::build(k.view(), &cfg, ()).unwrap_err();
        assert!(matches!(err, OracleError::NonFinite { argument: "keys", ref index, .. } if *index == vec![5, 1]));
        let p = Pyramid::build(keys(8, 2, 6).view(), &cfg, ()).unwrap();
        let wide = keys(1, 3, 7);
        let err = descend(&p, &PyramidQuery { heads: wide.view(), position: 0 }, &cfg).unwrap_err();
        assert!(matches!(err, OracleError::ShapeMismatch { argument: "query_heads", .. }), "{err}");
        let none = Array2::<f64>::zeros((0, 2));
        let err = descend(&p, &PyramidQuery { heads: none.view(), position: 0 }, &cfg).unwrap_err();
        assert_eq!(err, OracleError::ZeroDimension { argument: "query_heads" });
        let mut inf = keys(1, 2, 8);
        inf[[0, 0]] = f64::INFINITY;
        let err = descend(&p, &PyramidQuery { heads: inf.view(), position: 0 }, &cfg).unwrap_err();
        assert!(matches!(err, OracleError::NonFinite { argument: "query_heads", .. }), "{err}");
        let heads = keys(1, 2, 9);
        let err = descend(&p, &PyramidQuery { heads: heads.view(), position: 8 }, &cfg).unwrap_err();
        assert!(matches!(err, OracleError::InvalidParameter { argument: "position", .. }), "{err}");
    }

    #[test]
    fn bad_nodes_selections_and_score_inputs_are_rejected_by_name() {
        let cfg = config(2, 2, 1);
        let p = Pyramid::build(keys(8, 2, 10).view(), &cfg, ()).unwrap();
        let q = ndarray::array![0.5, 0.25];
        let err = p.node_score(3, 0, q.view(), Scoring::Lse).unwrap_err();
        assert!(matches!(err, OracleError::InvalidParameter { argument: "level", .. }), "{err}");
        let err = p.node_score(1, 2, q.view(), Scoring::Lse).unwrap_err();
        assert!(matches!(err, OracleError::InvalidParameter { argument: "node", .. }), "{err}");
        let err = p.node_score(1, 0, q.view(), Scoring::Bsa).unwrap_err();
        assert!(matches!(err, OracleError::InvalidParameter { argument: "scoring", .. }), "{err}");
        let short = ndarray::array![0.5];
        let err = p.node_score(0, 0, short.view(), Scoring::Lse).unwrap_err();
        assert!(matches!(err, OracleError::ShapeMismatch { argument: "query", .. }), "{err}");
        let heads = keys(1, 2, 11);
        let query = PyramidQuery { heads: heads.view(), position: 7 };
        let err = diagnostics(&p, &query, &[2, 1, -1], 2).unwrap_err();
        assert!(matches!(err, OracleError::IndexList { argument: "selected", .. }), "{err}");
        let err = diagnostics(&p, &query, &[0, 4], 2).unwrap_err();
        assert!(matches!(err, OracleError::IndexList { argument: "selected", .. }), "{err}");
        let means = keys(2, 2, 12);
        let err = child_mean_lse(q.view(), means.view(), &[1], ()).unwrap_err();
        assert!(matches!(err, OracleError::ShapeMismatch { argument: "child_counts", .. }), "{err}");
        let err = child_mean_lse(q.view(), means.view(), &[1, 0], ()).unwrap_err();
        assert!(matches!(err, OracleError::InvalidParameter { argument: "child_counts", .. }), "{err}");
        let err = raw_key_lse(q.view(), Array2::<f64>::zeros((0, 2)).view(), ()).unwrap_err();
        assert_eq!(err, OracleError::ZeroDimension { argument: "keys" });
        let err = descent_step(&p, 0, &[4], &query, 1, Scoring::Lse).unwrap_err();
        assert!(matches!(err, OracleError::InvalidParameter { argument: "node", .. }), "{err}");
    }

    #[test]
    fn diagnostics_of_the_reference_itself_are_perfect() {
        let cfg = config(4, 2, 3);
        let p = Pyramid::build(keys(32, 3, 13).view(), &cfg, ()).unwrap();
        let heads = keys(2, 3, 14);
        let query = PyramidQuery { heads: heads.view(), position: 30 };
        let first = diagnostics(&p, &query, &[0, 1, -1], 3).unwrap();
        let total: f64 = first.block_mass.iter().sum();
        assert!((total - 1.0).abs() < 1e-14);
        let reference: Vec<i32> = first.reference.iter().map(|&b| b as i32).collect();
        let again = diagnostics(&p, &query, &reference, 3).unwrap();
        assert_eq!(again.recall, 1.0);
        assert_eq!(again.mass_ratio, 1.0);
    }
}
