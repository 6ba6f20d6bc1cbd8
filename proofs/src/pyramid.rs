//! Theorems of Pyramid Top-K selection (E25–E30): Jensen's ordering of the node scores (E29,
//! paper A.1), equality of the descent with exhaustive leaf selection when nothing is pruned,
//! the level-by-level descent rule with GQA-summed scores, causality and forced blocks, the
//! candidate count `O(K·β·log_β(N/C))` against BSA's `N/C`, and the bounds of the diagnostics.
//!
//! Every reference quantity is recomputed here from the definitions (plain sums of `e^{s}` in
//! MPFR, node geometry restated from E25), sharing no code with the oracle's descent except the
//! tie convention of [`top_k`].

use std::ops::Range;

use attnproof_oracle::pyramid::{self, Descent, Diagnostics, Pyramid, PyramidConfig, PyramidQuery, Scoring};
use attnproof_oracle::topk::{padded_ascending, top_k};
use attnproof_oracle::{Mp, OracleError, Precision, Real};
use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis};

use crate::residual::{Agreement, Bits, Violation, agree};

/// One node of the hierarchy for E29: a query and the raw keys of the node, whose children are
/// consecutive groups of `child_size` keys.
#[derive(Clone, Debug)]
pub struct NodeCase {
    /// Query `[d]`.
    pub query: Array1<Mp>,
    /// The node's raw keys `[children · child_size, d]`.
    pub keys: Array2<Mp>,
    /// Keys per child.
    pub child_size: usize,
}

/// An intermediate-node scorer under test: `(query, keys, child_size) ↦` the normalized LSE over
/// the child means of the node.
pub type ChildMeanLseFn<'a> = &'a dyn Fn(ArrayView1<'_, Mp>, ArrayView2<'_, Mp>, usize) -> Mp;

/// The oracle's intermediate score: the keys built into a [`Pyramid`] with `C = child_size` and
/// `β = children`, and the root scored with [`Scoring::Lse`] (so the hierarchy is exercised too).
pub fn oracle_child_mean_lse(query: ArrayView1<'_, Mp>, keys: ArrayView2<'_, Mp>, child_size: usize) -> Mp {
    let children = keys.nrows() / child_size.max(1);
    let config = PyramidConfig { leaf_size: child_size, branching: children.max(2), keep: 1, scoring: Scoring::Lse };
    let ctx = query.first().map(|x| x.ctx()).unwrap_or_default();
    let p = Pyramid::build(keys, &config, ctx).expect("a valid node case");
    p.node_score(1, 0, query, Scoring::Lse).expect("level 1 exists for at least two children")
}

/// `α q·k` with `α = 1/√d`, by an explicit sum.
fn def_score(query: ArrayView1<'_, Mp>, key: ArrayView1<'_, Mp>, ctx: Precision) -> Mp {
    let dot = query.iter().zip(key).fold(Mp::zero(ctx), |acc, (a, b)| acc + a.clone() * b.clone());
    dot / Mp::from_f64(query.len() as f64, ctx).sqrt()
}

/// Mean of the rows of `keys` in `range`.
fn def_mean(keys: ArrayView2<'_, Mp>, range: Range<usize>, ctx: Precision) -> Array1<Mp> {
    let n = Mp::from_f64(range.len() as f64, ctx);
    Array1::from_shape_fn(keys.ncols(), |c| {
        range.clone().fold(Mp::zero(ctx), |a, j| a + keys[[j, c]].clone()) / n.clone()
    })
}

/// `log( Σ_i w_i e^{x_i} / Σ_i w_i )` by direct exponentials (MPFR's exponent range makes this safe).
fn def_log_mean_exp(xs: &[(Mp, usize)], ctx: Precision) -> Mp {
    let total: usize = xs.iter().map(|(_, w)| w).sum();
    let sum = xs.iter().fold(Mp::zero(ctx), |a, (x, w)| a + Mp::from_f64(*w as f64, ctx) * x.exp());
    (sum / Mp::from_f64(total as f64, ctx)).ln()
}

/// `lhs ≤ rhs` up to `2^-slack · max(|rhs|, 1)`.
fn at_most(theorem: &'static str, quantity: &'static str, lhs: &Mp, rhs: &Mp, slack: Bits) -> Result<(), Violation> {
    let ctx = rhs.ctx();
    let tolerance = rhs.abs().max(Mp::one(ctx)) * Mp::from_f64(2f64.powf(-slack.0), ctx);
    let excess = lhs.clone() - rhs.clone();
    if excess > tolerance {
        return Err(Violation::Bound {
            theorem,
            quantity,
            error: excess.to_f64(),
            bound: tolerance.to_f64(),
            ratio: (excess / tolerance).to_f64(),
            index: vec![],
        });
    }
    Ok(())
}

/// Two index lists are equal (compared as exact integers, so any difference is a violation).
fn same_indices(
    theorem: &'static str,
    quantity: &'static str,
    found: &[i32],
    expected: &[i32],
) -> Result<(), Violation> {
    let width = found.len().max(expected.len());
    let as_mp = |xs: &[i32]| {
        Array1::from_shape_fn(width, |i| Mp::from_f64(f64::from(xs.get(i).copied().unwrap_or(-1)), Precision(64)))
    };
    agree(theorem, quantity, &as_mp(found), &as_mp(expected), Bits(f64::INFINITY)).map(|_| ())
}

/// **Theorem (E29, paper A.1: Jensen ordering).** For a node whose children hold equal numbers
/// of keys, with raw scores `s_j = q·k_j/√d`, child means `μ_c` and node mean `μ_n`:
///
/// `q·μ_n/√d ≤ log mean_c e^{q·μ_c/√d} ≤ log mean_j e^{s_j}`,
///
/// hence `|childmean LSE − raw LSE| ≤ |mean score − raw LSE|`: the child-mean LSE is never
/// farther from the exact normalized LSE than the mean score. (Left: Jensen for the convex
/// `exp` over the children, whose mean score is the node's because the counts are equal. Right:
/// Jensen inside each child, `e^{q·μ_c/√d} ≤ mean_{j∈c} e^{s_j}`, averaged over the children.)
///
/// The implementation under test supplies the middle term; the outer terms come from the
/// definition. Each inequality is checked with relative slack `2^-slack`; then the middle term
/// is compared with its definition to `required` bits, which is the agreement returned.
/// Hypotheses: `child_size ≥ 1` divides the key count, at least two children, `d ≥ 1`.
pub fn jensen_ordering(
    child_mean_lse: ChildMeanLseFn<'_>,
    case: &NodeCase,
    slack: Bits,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "jensen_ordering (E29)";
    let (n, d, size) = (case.keys.nrows(), case.keys.ncols(), case.child_size);
    if size == 0 || n % size != 0 || n / size < 2 || d == 0 || case.query.len() != d {
        return Err(Violation::Hypothesis {
            theorem: T,
            reason: format!("{n} keys of dimension {d} in children of {size}, query of {}", case.query.len()),
        });
    }
    let ctx = case.query[0].ctx();
    let q = case.query.view();
    let raw: Vec<(Mp, usize)> = case.keys.rows().into_iter().map(|k| (def_score(q, k, ctx), 1)).collect();
    let mean_score = def_score(q, def_mean(case.keys.view(), 0..n, ctx).view(), ctx);
    let raw_lse = def_log_mean_exp(&raw, ctx);
    let child_scores: Vec<(Mp, usize)> = (0..n / size)
        .map(|c| (def_score(q, def_mean(case.keys.view(), c * size..(c + 1) * size, ctx).view(), ctx), size))
        .collect();
    let found = child_mean_lse(q, case.keys.view(), size);
    at_most(T, "mean score <= child-mean LSE", &mean_score, &found, slack)?;
    at_most(T, "child-mean LSE <= raw-key LSE", &found, &raw_lse, slack)?;
    let child_distance = (found.clone() - raw_lse.clone()).abs();
    let mean_distance = (mean_score - raw_lse).abs();
    at_most(T, "|child-mean LSE - raw LSE| <= |mean score - raw LSE|", &child_distance, &mean_distance, slack)?;
    let expected = def_log_mean_exp(&child_scores, ctx);
    agree(T, "child-mean LSE", &Array1::from_elem(1, found), &Array1::from_elem(1, expected), required)
}

/// A descent problem: the keys of one KV head, the query heads of its group at one position,
/// and the selection parameters.
#[derive(Clone, Debug)]
pub struct DescentCase {
    /// Keys `[N, d]`.
    pub keys: Array2<Mp>,
    /// Query heads `[group, d]`.
    pub heads: Array2<Mp>,
    /// The query's position (it sees keys `0..=position`).
    pub position: usize,
    /// Leaf size, branching, budget and scoring.
    pub config: PyramidConfig,
}

impl DescentCase {
    /// The borrowed query.
    pub fn query(&self) -> PyramidQuery<'_, Mp> {
        PyramidQuery { heads: self.heads.view(), position: self.position }
    }
    fn ctx(&self) -> Precision {
        self.keys.first().map(|x| x.ctx()).unwrap_or_default()
    }
}

/// A descent under test.
pub type DescentFn<'a> = &'a dyn Fn(&DescentCase) -> Result<Descent<Mp>, OracleError>;
/// A diagnostics implementation under test: `(case, selected row) ↦` E30's quantities.
pub type DiagnosticsFn<'a> = &'a dyn Fn(&DescentCase, &[i32]) -> Result<Diagnostics<Mp>, OracleError>;

/// The oracle's descent: [`Pyramid::build`] then [`pyramid::descend`].
pub fn oracle_descent(case: &DescentCase) -> Result<Descent<Mp>, OracleError> {
    let p = Pyramid::build(case.keys.view(), &case.config, case.ctx())?;
    pyramid::descend(&p, &case.query(), &case.config)
}

/// The oracle's diagnostics: [`Pyramid::build`] then [`pyramid::diagnostics`].
pub fn oracle_diagnostics(case: &DescentCase, selected: &[i32]) -> Result<Diagnostics<Mp>, OracleError> {
    let p = Pyramid::build(case.keys.view(), &case.config, case.ctx())?;
    pyramid::diagnostics(&p, &case.query(), selected, case.config.keep)
}

/// E25's geometry restated: node `n` at level `ℓ` covers keys `[n·C·β^ℓ, (n+1)·C·β^ℓ) ∩ [0, N)`;
/// levels are added until one node remains.
struct Geometry {
    n_keys: usize,
    leaf_size: usize,
    branching: usize,
    widths: Vec<usize>,
}

impl Geometry {
    fn of(n_keys: usize, config: &PyramidConfig) -> Self {
        let mut widths = vec![n_keys.div_ceil(config.leaf_size)];
        while *widths.last().expect("non-empty") > 1 {
            let w = widths.last().expect("non-empty").div_ceil(config.branching);
            widths.push(w);
        }
        Geometry { n_keys, leaf_size: config.leaf_size, branching: config.branching, widths }
    }
    fn span(&self, level: usize) -> usize {
        self.leaf_size * self.branching.pow(level as u32)
    }
    fn keys_of(&self, level: usize, node: usize) -> Range<usize> {
        node * self.span(level)..((node + 1) * self.span(level)).min(self.n_keys)
    }
    fn children(&self, level: usize, node: usize) -> Range<usize> {
        node * self.branching..((node + 1) * self.branching).min(self.widths[level - 1])
    }
    /// E28 restated: first, previous and current leaf.
    fn forced_leaves(&self, position: usize) -> Vec<usize> {
        let current = position / self.leaf_size;
        let mut v = vec![0, current.saturating_sub(1), current];
        v.dedup();
        v
    }
}

/// The PISA score (E26) of a node for one query head, from the definition: leaves by the exact
/// log-mean-exp of their raw key scores, intermediate nodes by the count-weighted log-mean-exp of
/// the scores of their children's raw-key means.
fn def_node_score(case: &DescentCase, g: &Geometry, level: usize, node: usize, q: ArrayView1<'_, Mp>) -> Mp {
    let ctx = case.ctx();
    let pooled: Vec<(Mp, usize)> = if level == 0 {
        g.keys_of(0, node).map(|j| (def_score(q, case.keys.row(j), ctx), 1)).collect()
    } else {
        g.children(level, node)
            .map(|c| {
                let range = g.keys_of(level - 1, c);
                (def_score(q, def_mean(case.keys.view(), range.clone(), ctx).view(), ctx), range.len())
            })
            .collect()
    };
    def_log_mean_exp(&pooled, ctx)
}

fn def_group_score(case: &DescentCase, g: &Geometry, level: usize, node: usize) -> Mp {
    case.heads.rows().into_iter().fold(Mp::zero(case.ctx()), |acc, q| acc + def_node_score(case, g, level, node, q))
}

fn run_descent(theorem: &'static str, descent: DescentFn<'_>, case: &DescentCase) -> Result<Descent<Mp>, Violation> {
    descent(case).map_err(|e| Violation::Hypothesis { theorem, reason: format!("the descent refused the case: {e}") })
}

/// **Theorem (E27: no pruning ⇒ exhaustive selection).** With PISA scoring and a budget `K` at
/// least the width of every level above the leaves, the descent keeps every eligible node above
/// the leaves, so its leaf candidates are all eligible leaves and its selection equals the
/// exhaustive (BSA-style) one: the forced leaves plus the best eligible leaves by the exact
/// raw-key score `Σ_h log mean_{j∈b} e^{q_h·k_j/√d}`, `K` in all (ties to the lower leaf).
/// Hypotheses: `scoring = Lse`; `K ≥` width of level 1 (any `K` if there is one leaf).
pub fn exhaustive_when_unpruned(descent: DescentFn<'_>, case: &DescentCase) -> Result<Agreement, Violation> {
    const T: &str = "exhaustive_when_unpruned (E27)";
    let g = Geometry::of(case.keys.nrows(), &case.config);
    if case.config.scoring != Scoring::Lse || g.widths.get(1).is_some_and(|&w| case.config.keep < w) {
        return Err(Violation::Hypothesis {
            theorem: T,
            reason: format!("needs LSE scoring and K ≥ {:?} (level widths {:?})", g.widths.get(1), g.widths),
        });
    }
    let found = run_descent(T, descent, case)?;
    let scores: Vec<Mp> = (0..g.widths[0]).map(|b| def_group_score(case, &g, 0, b)).collect();
    let expected =
        top_k(&scores, case.config.keep, |b| b * g.leaf_size <= case.position, &g.forced_leaves(case.position));
    same_indices(
        T,
        "selected leaves",
        &found.selected,
        &padded_ascending(&expected, found.selected.len().max(expected.len())),
    )?;
    Ok(Agreement::exact())
}

/// **Theorem (E27, E28: the descent rule, GQA-shared).** Walking the trace coarsest first:
/// the first level is the root level, whole; every later level's candidates are the children of
/// the nodes kept above; a candidate is scored iff its first key is at or before the query;
/// each score equals the sum over the query heads of the PISA score from the definition (to
/// `required` bits); the kept nodes are the forced nodes among the candidates (ancestors of the
/// first, previous and current leaf) plus the best eligible candidates by those summed scores,
/// `K` in all; and the selection is the leaf level's kept set. One selection serves the whole
/// group, and it is the one the summed scores give. Hypotheses: `scoring = Lse`.
pub fn descent_rule(descent: DescentFn<'_>, case: &DescentCase, required: Bits) -> Result<Agreement, Violation> {
    const T: &str = "descent_rule (E27, E28)";
    if case.config.scoring != Scoring::Lse {
        return Err(Violation::Hypothesis { theorem: T, reason: "needs LSE scoring".into() });
    }
    let g = Geometry::of(case.keys.nrows(), &case.config);
    let found = run_descent(T, descent, case)?;
    let top = g.widths.len() - 1;
    if found.trace.len() != g.widths.len() {
        return Err(Violation::Hypothesis {
            theorem: T,
            reason: format!("trace has {} levels, the hierarchy {}", found.trace.len(), g.widths.len()),
        });
    }
    let forced = g.forced_leaves(case.position);
    let mut agreement = Agreement::exact();
    let mut expected_candidates: Vec<usize> = (0..g.widths[top]).collect();
    for (step, level) in found.trace.iter().zip((0..=top).rev()) {
        let as_i32 = |xs: &[usize]| xs.iter().map(|&x| x as i32).collect::<Vec<_>>();
        same_indices(T, "candidates", &as_i32(&step.candidates), &as_i32(&expected_candidates))?;
        let eligible: Vec<bool> = step.candidates.iter().map(|&c| g.keys_of(level, c).start <= case.position).collect();
        let scored: Vec<bool> = step.scores.iter().map(Option::is_some).collect();
        if scored != eligible {
            return Err(Violation::Hypothesis {
                theorem: T,
                reason: format!("level {level}: scored {scored:?} but eligible {eligible:?}"),
            });
        }
        let ctx = case.ctx();
        let expected_scores: Vec<Mp> = step
            .candidates
            .iter()
            .zip(&eligible)
            .map(|(&c, &ok)| if ok { def_group_score(case, &g, level, c) } else { Mp::neg_infinity(ctx) })
            .collect();
        let found_scores: Vec<Mp> =
            step.scores.iter().map(|s| s.clone().unwrap_or_else(|| Mp::neg_infinity(ctx))).collect();
        agreement = agreement.and(agree(
            T,
            "summed scores",
            &Array1::from(found_scores),
            &Array1::from(expected_scores.clone()),
            required,
        )?);
        let forced_slots: Vec<usize> = (0..step.candidates.len())
            .filter(|&i| forced.iter().any(|&f| f / g.branching.pow(level as u32) == step.candidates[i]))
            .collect();
        let mut kept: Vec<usize> = top_k(&expected_scores, case.config.keep, |i| eligible[i], &forced_slots)
            .into_iter()
            .map(|i| step.candidates[i])
            .collect();
        kept.sort_unstable();
        same_indices(T, "kept nodes", &as_i32(&step.kept), &as_i32(&kept))?;
        if level > 0 {
            expected_candidates = kept.iter().flat_map(|&n| g.children(level, n)).collect();
        } else {
            same_indices(T, "selected leaves", &found.selected, &padded_ascending(&kept, found.selected.len()))?;
        }
    }
    Ok(agreement)
}

/// **Theorem (E28: causality and forced blocks).** No kept node at any level, and so no selected
/// leaf, starts after the query; the first, previous and current leaves are always selected;
/// and the selection does not depend on the keys after the query: replacing them by `future`
/// gives the same selection (the only eligible summaries that contain future keys are the
/// current leaf's path, which is forced and never ranked by its score).
/// Hypotheses: `future` is `[N − position − 1, d]`.
pub fn causality(
    descent: DescentFn<'_>,
    case: &DescentCase,
    future: ArrayView2<'_, Mp>,
) -> Result<Agreement, Violation> {
    const T: &str = "causality (E28)";
    let (n, d) = case.keys.dim();
    if case.position >= n || future.dim() != (n - case.position - 1, d) {
        return Err(Violation::Hypothesis {
            theorem: T,
            reason: format!("future keys {:?} do not follow position {} of {n}", future.dim(), case.position),
        });
    }
    let g = Geometry::of(n, &case.config);
    let found = run_descent(T, descent, case)?;
    for step in &found.trace {
        let causal: Vec<i32> =
            step.kept.iter().filter(|&&c| g.keys_of(step.level, c).start <= case.position).map(|&c| c as i32).collect();
        let kept: Vec<i32> = step.kept.iter().map(|&c| c as i32).collect();
        same_indices(T, "kept nodes starting at or before the query", &kept, &causal)?;
    }
    let selected = found.selected_leaves();
    let mut with_forced = selected.clone();
    with_forced.extend(g.forced_leaves(case.position));
    with_forced.sort_unstable();
    with_forced.dedup();
    let as_i32 = |xs: &[usize]| xs.iter().map(|&x| x as i32).collect::<Vec<_>>();
    same_indices(T, "selection including the forced leaves", &as_i32(&selected), &as_i32(&with_forced))?;
    let mut altered = case.clone();
    altered.keys.slice_axis_mut(Axis(0), ndarray::Slice::from(case.position + 1..)).assign(&future);
    let again = run_descent(T, descent, &altered)?;
    same_indices(T, "selection after changing future keys", &again.selected, &found.selected)?;
    Ok(Agreement::exact())
}

/// The candidate count of E27 for `N = C·β^L`, a query at the last position and `K ≥ 3`: the
/// root is scored (1), and each of the `L` finer levels scores the children of the nodes kept
/// above, `β · min(K, β^{L−1−ℓ})` at level `ℓ` (the level above has `β^{L−1−ℓ}` nodes, all
/// eligible, and keeps `min(K, width)` of them because the ≤ 3 forced nodes fit in `K`).
pub fn descent_candidate_count(levels_above_leaves: u32, branching: usize, keep: usize) -> usize {
    1 + (0..levels_above_leaves)
        .map(|l| branching * keep.min(branching.pow(levels_above_leaves - 1 - l)))
        .sum::<usize>()
}

/// **Theorem (E27: candidate count).** For `N = C·β^L` and a query at position `N − 1` with
/// `K ≥ 3`, the descent scores exactly [`descent_candidate_count`]`(L, β, K)` candidates, which
/// is at most `1 + L·K·β = O(K·β·log_β(N/C))`, while BSA (`bsa`, the same case with
/// [`Scoring::Bsa`]) scores all `N/C` leaves.
/// Hypotheses: `N = C·β^L`, `position = N − 1`, `K ≥ 3`, a hierarchical scoring.
pub fn candidate_count(descent: DescentFn<'_>, case: &DescentCase) -> Result<Agreement, Violation> {
    const T: &str = "candidate_count (E27)";
    let PyramidConfig { leaf_size, branching, keep, scoring } = case.config;
    let n = case.keys.nrows();
    let levels = (0..=40u32).find(|&l| branching.checked_pow(l).and_then(|b| b.checked_mul(leaf_size)) == Some(n));
    let Some(levels) = levels.filter(|_| case.position + 1 == n && keep >= 3 && scoring != Scoring::Bsa) else {
        return Err(Violation::Hypothesis {
            theorem: T,
            reason: format!("N = {n}, C = {leaf_size}, β = {branching}, K = {keep}, position {}", case.position),
        });
    };
    let count = run_descent(T, descent, case)?.candidates_scored;
    let formula = descent_candidate_count(levels, branching, keep);
    let as_i32 = |x: usize| vec![x as i32];
    same_indices(T, "candidates scored", &as_i32(count), &as_i32(formula))?;
    let log_bound = 1 + levels as usize * keep * branching;
    if count > log_bound {
        return Err(Violation::Bound {
            theorem: T,
            quantity: "candidates scored <= 1 + L·K·β",
            error: count as f64,
            bound: log_bound as f64,
            ratio: count as f64 / log_bound as f64,
            index: vec![],
        });
    }
    let mut bsa = case.clone();
    bsa.config.scoring = Scoring::Bsa;
    let bsa_count = run_descent(T, descent, &bsa)?.candidates_scored;
    same_indices(T, "BSA candidates scored", &as_i32(bsa_count), &as_i32(n / leaf_size))?;
    Ok(Agreement::exact())
}

/// **Theorem (E30: diagnostics).** With block masses `mass_b = mean_h Σ_{j∈b, j≤position} P_hj`
/// from the definition: the implementation's masses agree with them; its reference set captures
/// the most mass any set of its size containing the forced leaves can (the forced masses plus
/// the largest remaining eligible masses); the reference evaluated against itself has Recall@K
/// = 1 and mass ratio = 1; and every selection in `selections` that contains the forced leaves
/// and is no larger than the reference has mass ratio ≤ 1 and recall in `[0, 1]` (within
/// `2^-required`). Hypotheses: the selections are valid index rows.
pub fn diagnostics_bounds(
    diagnostics: DiagnosticsFn<'_>,
    case: &DescentCase,
    selections: &[Vec<i32>],
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "diagnostics_bounds (E30)";
    let ctx = case.ctx();
    let g = Geometry::of(case.keys.nrows(), &case.config);
    let refuse = |e: OracleError| Violation::Hypothesis { theorem: T, reason: e.to_string() };
    // Definition masses: plain exponentials over the visible keys, normalized per head.
    let mut mass = vec![Mp::zero(ctx); g.widths[0]];
    let group = Mp::from_f64(case.heads.nrows() as f64, ctx);
    for q in case.heads.rows() {
        let e: Vec<Mp> = (0..=case.position).map(|j| def_score(q, case.keys.row(j), ctx).exp()).collect();
        let z = e.iter().fold(Mp::zero(ctx), |a, x| a + x.clone());
        for (j, x) in e.into_iter().enumerate() {
            mass[j / g.leaf_size] = mass[j / g.leaf_size].clone() + x / z.clone() / group.clone();
        }
    }
    let empty = vec![-1; case.config.keep.max(1)];
    let first = diagnostics(case, &empty).map_err(refuse)?;
    let mut agreement =
        agree(T, "block masses", &Array1::from(first.block_mass.clone()), &Array1::from(mass.clone()), required)?;
    let forced = g.forced_leaves(case.position);
    let mut rest: Vec<Mp> = (0..g.widths[0])
        .filter(|b| b * g.leaf_size <= case.position && !forced.contains(b))
        .map(|b| mass[b].clone())
        .collect();
    rest.sort_by(|a, b| b.partial_cmp(a).expect("finite masses"));
    let room = case.config.keep.saturating_sub(forced.len());
    let best =
        forced.iter().map(|&b| mass[b].clone()).chain(rest.into_iter().take(room)).fold(Mp::zero(ctx), |a, x| a + x);
    let one = Array1::from_elem(1, Mp::one(ctx));
    agreement = agreement.and(agree(
        T,
        "reference captured mass = best achievable",
        &Array1::from_elem(1, first.reference_captured.clone()),
        &Array1::from_elem(1, best),
        required,
    )?);
    let reference: Vec<i32> = first.reference.iter().map(|&b| b as i32).collect();
    let own = diagnostics(case, &reference).map_err(refuse)?;
    agreement =
        agreement.and(agree(T, "Recall@K of the reference", &Array1::from_elem(1, own.recall), &one, required)?);
    agreement =
        agreement.and(agree(T, "mass ratio of the reference", &Array1::from_elem(1, own.mass_ratio), &one, required)?);
    for selection in selections {
        let valid: Vec<usize> = selection.iter().filter(|&&x| x >= 0).map(|&x| x as usize).collect();
        if !forced.iter().all(|f| valid.contains(f)) || valid.len() > first.reference.len() {
            return Err(Violation::Hypothesis {
                theorem: T,
                reason: format!("selection {selection:?} lacks forced {forced:?} or exceeds the reference size"),
            });
        }
        let dx = diagnostics(case, selection).map_err(refuse)?;
        at_most(T, "mass ratio <= 1", &dx.mass_ratio, &Mp::one(ctx), required)?;
        at_most(T, "recall <= 1", &dx.recall, &Mp::one(ctx), required)?;
        at_most(T, "recall >= 0", &Mp::zero(ctx), &dx.recall, required)?;
    }
    Ok(agreement)
}
