//! Verifying a FlashAttention backward (reference schedule or kernel) against the f64 oracle
//! under the bound of `attnproof_proofs::flash_bound::backward_bounds`, with the
//! discriminability gate (zeros, scale `1/d`, last KV tile dropped).

use attnproof_oracle::attention::{Visibility, backward_with_visibility};
use attnproof_oracle::dense::{self, HeadInputs};
use attnproof_oracle::spec::{Operand, Sequence};
use attnproof_oracle::{AttentionSpec, DenseConfig, Qkv, Scale};
use attnproof_proofs::flash_bound::{
    FlashRecipe, HeadBackwardExact, HeadExact, backward_bounds, forward_bounds, gqa_sum_term,
};
use attnproof_proofs::sums;
use attnproof_reference::Element;
use ndarray::{ArrayD, ArrayViewD, IxDyn, Zip};

use crate::flash::{Case, HarnessError};
use crate::gate::GateReport;
use crate::verdict::{Verdict, compare};

/// A candidate's backward outputs.
#[derive(Clone, Debug)]
pub struct BackwardCandidate<'a, T> {
    /// Gradient of Q.
    pub dq: ArrayViewD<'a, T>,
    /// Gradient of K.
    pub dk: ArrayViewD<'a, T>,
    /// Gradient of V.
    pub dv: ArrayViewD<'a, T>,
    /// The preprocess `D` (f32).
    pub delta: ArrayViewD<'a, f32>,
}

/// Exact gradients, the model's bounds on them, and the magnitude of the terms each gradient
/// sums (before cancellation), the scale the gate judges visibility by.
#[derive(Debug)]
struct BackwardTruth {
    grads: attnproof_oracle::Gradients<f64>,
    magnitude: [f64; 3],
    bound_dq: ArrayD<f64>,
    bound_dk: ArrayD<f64>,
    bound_dv: ArrayD<f64>,
    bound_delta: ArrayD<f64>,
}

/// [`backward_truth_with_visibility`] under the spec's own mask (the unit tests' hand-worked cases).
#[cfg(test)]
fn backward_truth(
    spec: &AttentionSpec,
    t: [&ArrayD<f64>; 4],
    recipe: FlashRecipe,
    q_tile: usize,
) -> Result<BackwardTruth, HarnessError> {
    spec.validate()?;
    let masks: Vec<_> = spec.sequences().iter().map(|s| spec.mask.matrix(s.len_q, s.len_k)).collect();
    backward_truth_with_visibility(spec, t, &|seq: &Sequence, _| masks[seq.index].clone(), recipe, q_tile)
}

/// Exact gradients of the whole problem and the model's bounds on them.
#[derive(Clone, Debug)]
pub struct BackwardBoundsTruth {
    /// The f64 oracle's gradients (and `D`).
    pub grads: attnproof_oracle::Gradients<f64>,
    /// Bound on dQ.
    pub bound_dq: ArrayD<f64>,
    /// Bound on dK (GQA sums included).
    pub bound_dk: ArrayD<f64>,
    /// Bound on dV (GQA sums included).
    pub bound_dv: ArrayD<f64>,
}

/// The oracle's gradients and the backward model's bounds for upstream gradient `g`, with the
/// visibility of each (sequence, head) given (the spec's own mask is not applied).
pub fn problem_backward_bounds_with_visibility(
    spec: &AttentionSpec,
    qkvg: [&ArrayD<f64>; 4],
    visibility: Visibility<'_>,
    recipe: FlashRecipe,
    q_tile: usize,
) -> Result<BackwardBoundsTruth, HarnessError> {
    let t = backward_truth_with_visibility(spec, qkvg, visibility, recipe, q_tile)?;
    Ok(BackwardBoundsTruth { grads: t.grads, bound_dq: t.bound_dq, bound_dk: t.bound_dk, bound_dv: t.bound_dv })
}

fn backward_truth_with_visibility(
    spec: &AttentionSpec,
    t: [&ArrayD<f64>; 4],
    visibility: Visibility<'_>,
    recipe: FlashRecipe,
    q_tile: usize,
) -> Result<BackwardTruth, HarnessError> {
    let [q, k, v, g] = t;
    let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
    let grads = backward_with_visibility(spec, qkv, g.view(), visibility, DenseConfig::default(), ())?;
    let zeros = |op| ArrayD::<f64>::zeros(IxDyn(&spec.expected_shape(op)));
    let (mut bound_dq, mut bound_dk, mut bound_dv, mut bound_delta) =
        (zeros(Operand::Q), zeros(Operand::K), zeros(Operand::V), zeros(Operand::RowStat));
    let (mut abs_dk, mut abs_dv) = (zeros(Operand::K), zeros(Operand::V));
    // Magnitudes of the terms each gradient sums, blind to cancellation at every level: with
    // t_ij = P_ij (Σ_c |dO_ic||v_jc| + Σ_c |dO_ic||o_ic|) (the terms of dP and of D inside dS),
    // |α| Σ_j t_ij |k_jc| (dQ), |α| Σ_i t_ij |q_ic| (dK), Σ_i P_ij |dO_ic| (dV); the largest of each.
    let mut magnitude = [0f64; 3];
    let scale = spec.scale_value::<f64>(());
    for seq in spec.sequences() {
        for h in 0..spec.n_heads_q {
            let visible = visibility(&seq, h);
            let kv = spec.kv_head(h);
            let (qh, kh) = (spec.head_rows(q.view(), &seq, h, false), spec.head_rows(k.view(), &seq, kv, true));
            let (vh, gh) = (spec.head_rows(v.view(), &seq, kv, true), spec.head_rows(g.view(), &seq, h, false));
            let inputs = HeadInputs { q: qh, k: kh, v: vh, visible: visible.view() };
            let fwd = dense::head_forward(inputs, &scale, DenseConfig::default(), ());
            let hg = dense::head_backward(inputs, gh, &fwd, &scale, DenseConfig::default(), ());
            let s = dense::scores(qh, kh, &scale, visible.view(), ());
            let p = dense::probabilities_from_lse(s.view(), fwd.lse.view(), visible.view(), ());
            let dp = f64_matmul(gh, vh);
            let ds = dense::score_gradient(p.view(), dp.view(), hg.delta.view());
            let fx = HeadExact {
                q: qh,
                k: kh,
                v: vh,
                s: s.view(),
                p: p.view(),
                o: fwd.o.view(),
                lse: fwd.lse.view(),
                scale: scale.abs(),
            };
            let fb = forward_bounds(fx, recipe)?;
            let bx = HeadBackwardExact {
                forward: fx,
                d_out: gh,
                dp: dp.view(),
                ds: ds.view(),
                delta: hg.delta.view(),
                dq: hg.dq.view(),
                dk: hg.dk.view(),
                dv: hg.dv.view(),
            };
            let b = backward_bounds(bx, &fb, recipe, q_tile)?;
            let (len_q, len_k) = p.dim();
            let abs_dot =
                |a: ndarray::ArrayView2<'_, f64>, i: usize, b: ndarray::ArrayView2<'_, f64>, j: usize| -> f64 {
                    a.row(i).iter().zip(b.row(j)).map(|(x, y)| x.abs() * y.abs()).sum()
                };
            // Each term once per (i, j), not once per column c of the sums below; the sums run vectorized and in
            // parallel, each adding its terms in ascending order (`attnproof_proofs::sums`), as the plain loops do.
            let row_o: Vec<f64> = (0..len_q).map(|i| abs_dot(gh, i, fwd.o.view(), i)).collect();
            let abs_vt = sums::abs_transposed(vh);
            let mut terms = ndarray::Array2::<f64>::zeros((len_q, len_k));
            for (i, mut row) in terms.rows_mut().into_iter().enumerate() {
                for (j, (t, dot)) in row.iter_mut().zip(sums::abs_dots(gh.row(i), &abs_vt)).enumerate() {
                    *t = p[[i, j]] * (dot + row_o[i]);
                }
            }
            let largest = |a: ndarray::Array2<f64>, factor: f64| a.iter().map(|m| m * factor).fold(0.0, f64::max);
            let by_query = sums::weighted_row_sums(len_q, kh, |i, j| terms[[i, j]]);
            magnitude[0] = magnitude[0].max(largest(by_query.mapv(|m| scale.abs() * m), 1.0));
            let by_key = sums::weighted_column_sums(len_k, qh, |i, j| terms[[i, j]]);
            magnitude[1] = magnitude[1].max(largest(by_key.mapv(|m| scale.abs() * m), group_size(spec)));
            let values = sums::weighted_column_sums(len_k, gh, |i, j| p[[i, j]]);
            magnitude[2] = magnitude[2].max(largest(values, group_size(spec)));
            bound_dq.slice_mut(spec.head_slice(&seq, h, false)).assign(&b.dq);
            bound_delta.slice_mut(spec.row_stat_slice(&seq, h)).assign(&b.delta);
            let ks = spec.head_slice(&seq, kv, true);
            Zip::from(bound_dk.slice_mut(ks.clone())).and(&b.dk.into_dyn()).for_each(|a, x| *a += x);
            Zip::from(bound_dv.slice_mut(ks.clone())).and(&b.dv.into_dyn()).for_each(|a, x| *a += x);
            Zip::from(abs_dk.slice_mut(ks.clone())).and(&hg.dk.into_dyn()).for_each(|a, x| *a += x.abs());
            Zip::from(abs_dv.slice_mut(ks)).and(&hg.dv.into_dyn()).for_each(|a, x| *a += x.abs());
        }
    }
    let group = spec.group_size();
    Zip::from(&mut bound_dk).and(&abs_dk).for_each(|b, a| *b += gqa_sum_term(group, *a));
    Zip::from(&mut bound_dv).and(&abs_dv).for_each(|b, a| *b += gqa_sum_term(group, *a));
    Ok(BackwardTruth { grads, magnitude, bound_dq, bound_dk, bound_dv, bound_delta })
}

/// Query heads per KV head: dK, dV sum that many per-head terms (an upper bound on the summed
/// magnitude from one head's).
fn group_size(spec: &AttentionSpec) -> f64 {
    spec.group_size() as f64
}

fn f64_matmul(a: ndarray::ArrayView2<'_, f64>, b: ndarray::ArrayView2<'_, f64>) -> ndarray::Array2<f64> {
    <f64 as attnproof_oracle::Real>::matmul(a, b.t(), ())
}

/// Verifies a backward candidate on `case` with upstream gradient `d_out`, under the model for
/// `recipe` with query tiles of `q_tile` rows (the partial-dQ count).
pub fn verify_backward<T: Element>(
    case: &Case<T>,
    d_out: &ArrayD<T>,
    q_tile: usize,
    recipe: FlashRecipe,
    candidate: BackwardCandidate<'_, T>,
) -> Result<Verdict, HarnessError> {
    BackwardExpectation::new(case, d_out, q_tile, recipe)?.verify(candidate)
}

/// What every candidate backward of one problem is judged against: the oracle's gradients, the
/// model's bounds and the discriminability gate, computed once (three oracle backward passes) and
/// reused for any number of candidates (strategies, repeated runs, mutants) of the same problem.
#[derive(Debug)]
pub struct BackwardExpectation {
    spec: AttentionSpec,
    truth: BackwardTruth,
    gate: GateReport,
}

impl BackwardExpectation {
    /// The expectation for `case` with upstream gradient `d_out`, under the model for `recipe` with
    /// query tiles of `q_tile` rows (the partial-dQ count).
    pub fn new<T: Element>(
        case: &Case<T>,
        d_out: &ArrayD<T>,
        q_tile: usize,
        recipe: FlashRecipe,
    ) -> Result<Self, HarnessError> {
        let spec = &case.spec;
        spec.validate()?;
        let masks: Vec<_> = spec.sequences().iter().map(|s| spec.mask.matrix(s.len_q, s.len_k)).collect();
        Self::with_visibility(case, d_out, q_tile, recipe, &|seq: &Sequence, _| masks[seq.index].clone())
    }

    /// [`BackwardExpectation::new`] with the visibility of each (sequence, query head) given in place of the spec's
    /// mask (block-sparse lists, which differ from head to head): the oracle, the bounds and the gate's wrong answers
    /// all use it.
    pub fn with_visibility<T: Element>(
        case: &Case<T>,
        d_out: &ArrayD<T>,
        q_tile: usize,
        recipe: FlashRecipe,
        visibility: Visibility<'_>,
    ) -> Result<Self, HarnessError> {
        let spec = &case.spec;
        let [q, k, v] = case.widened();
        let g = d_out.mapv(|x| x.to_f32() as f64);
        let kv_tile = recipe.kv_tile;
        let truth = backward_truth_with_visibility(spec, [&q, &k, &v, &g], visibility, recipe, q_tile)?;
        let mut gate = GateReport::default();
        let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
        let wrong_scale = backward_with_visibility(
            &spec.clone().with_scale(Scale::Value(1.0 / spec.head_dim as f64)),
            qkv.clone(),
            g.view(),
            visibility,
            DenseConfig::default(),
            (),
        )?;
        let without_last_tile = |seq: &Sequence, h: usize| {
            let cut = seq.len_k.div_ceil(kv_tile).saturating_sub(1) * kv_tile;
            let mut m = visibility(seq, h);
            m.indexed_iter_mut().for_each(|((_, j), x)| *x = *x && j < cut);
            m
        };
        let dropped = backward_with_visibility(spec, qkv, g.view(), &without_last_tile, DenseConfig::default(), ())?;
        let unit = recipe.unit_roundoff;
        for (name, truth_t, bound, wrong, dropped_t, scale) in [
            ("dQ", &truth.grads.dq, &truth.bound_dq, &wrong_scale.dq, &dropped.dq, truth.magnitude[0]),
            ("dK", &truth.grads.dk, &truth.bound_dk, &wrong_scale.dk, &dropped.dk, truth.magnitude[1]),
            ("dV", &truth.grads.dv, &truth.bound_dv, &wrong_scale.dv, &dropped.dv, truth.magnitude[2]),
        ] {
            gate.score(
                "zeros",
                name,
                ArrayD::zeros(truth_t.raw_dim()).view(),
                truth_t.view(),
                bound.view(),
                unit,
                scale,
            );
            gate.score("scale 1/d", name, wrong.view(), truth_t.view(), bound.view(), unit, scale);
            gate.score("last KV tile dropped", name, dropped_t.view(), truth_t.view(), bound.view(), unit, scale);
        }
        Ok(BackwardExpectation { spec: spec.clone(), truth, gate })
    }

    /// The verdict on one candidate: every output against its bound, and the case's gate.
    pub fn verify<T: Element>(&self, candidate: BackwardCandidate<'_, T>) -> Result<Verdict, HarnessError> {
        for (argument, op, shape) in [
            ("dq", Operand::Q, candidate.dq.shape()),
            ("dk", Operand::K, candidate.dk.shape()),
            ("dv", Operand::V, candidate.dv.shape()),
            ("delta", Operand::RowStat, candidate.delta.shape()),
        ] {
            let expected = self.spec.expected_shape(op);
            if shape != expected.as_slice() {
                return Err(HarnessError::CandidateShape { argument, expected, actual: shape.to_vec() });
            }
        }
        let truth = &self.truth;
        let widen = |t: &ArrayViewD<'_, T>| t.mapv(|x| x.to_f32() as f64);
        let outputs = vec![
            compare("D", candidate.delta.mapv(|x| x as f64).view(), truth.grads.delta.view(), truth.bound_delta.view()),
            compare("dQ", widen(&candidate.dq).view(), truth.grads.dq.view(), truth.bound_dq.view()),
            compare("dK", widen(&candidate.dk).view(), truth.grads.dk.view(), truth.bound_dk.view()),
            compare("dV", widen(&candidate.dv).view(), truth.grads.dv.view(), truth.bound_dv.view()),
        ];
        Ok(Verdict { outputs, gate: self.gate.clone() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{Distribution, ValueProfile, make_case, make_d_out};
    use ndarray::{ArrayD, Axis, IxDyn, Slice};

    /// Each canned wrong answer of the backward gate is the wrong answer it names, recomputed here on its own, for dQ,
    /// dK and dV: "zeros", "scale 1/d" (the oracle's gradients with scale `1/d`) and "last KV tile dropped" (Lk = 65
    /// with tiles of 64: the gradients over the first 64 keys alone, and zero dK, dV for the 65th). The gate scores
    /// them in that order per output; each is visibly wrong here and rejected.
    #[test]
    fn the_canned_answers_are_the_wrong_answers_they_name() {
        let spec = AttentionSpec::dense(1, 1, 1, 3, 65, 8, 8);
        let profile = ValueProfile { distribution: Distribution::MaxInLastTile, logit_scale: 4.0, value_mean: 0.0 };
        let case = make_case::<half::bf16>(&spec, profile, 5);
        let d_out = make_d_out::<half::bf16>(&spec, 5);
        let recipe = crate::recipes::reference::<half::bf16>(64);
        let expectation = BackwardExpectation::new(&case, &d_out, 64, recipe).unwrap();
        let [q, k, v] = case.widened();
        let g = d_out.mapv(|x| x.to_f32() as f64);
        let truth = backward_truth(&spec, [&q, &k, &v, &g], recipe, 64).unwrap();
        let scaled = spec.clone().with_scale(Scale::Value(1.0 / 8.0));
        let wrong_scale = attnproof_oracle::backward(
            &scaled,
            Qkv { q: q.view(), k: k.view(), v: v.view() },
            g.view(),
            DenseConfig::default(),
            (),
        )
        .unwrap();
        let cut = |t: &ArrayD<f64>| t.slice_axis(Axis(2), Slice::from(0..64)).to_owned();
        let (k64, v64) = (cut(&k), cut(&v));
        let first_tile = AttentionSpec::dense(1, 1, 1, 3, 64, 8, 8);
        let qkv = Qkv { q: q.view(), k: k64.view(), v: v64.view() };
        let dropped = attnproof_oracle::backward(&first_tile, qkv, g.view(), DenseConfig::default(), ()).unwrap();
        let padded = |t: &ArrayD<f64>| {
            let zero = ArrayD::<f64>::zeros(IxDyn(&[1, 1, 1, 8]));
            ndarray::concatenate(Axis(2), &[t.view(), zero.view()]).unwrap()
        };
        let grads = &truth.grads;
        let outputs = [
            ("dQ", &grads.dq, &truth.bound_dq, wrong_scale.dq.clone(), dropped.dq.clone()),
            ("dK", &grads.dk, &truth.bound_dk, wrong_scale.dk.clone(), padded(&dropped.dk)),
            ("dV", &grads.dv, &truth.bound_dv, wrong_scale.dv.clone(), padded(&dropped.dv)),
        ];
        let canned = &expectation.gate.canned;
        assert_eq!(canned.len(), 9, "three answers for each of dQ, dK, dV: {canned:?}");
        for (n, (name, exact, bound, scale_answer, dropped_answer)) in outputs.into_iter().enumerate() {
            let ratio = |t: &ArrayD<f64>| compare(name, t.view(), exact.view(), bound.view()).max_ratio;
            let zeros = ArrayD::<f64>::zeros(exact.raw_dim());
            let expected = [
                ("zeros", ratio(&zeros)),
                ("scale 1/d", ratio(&scale_answer)),
                ("last KV tile dropped", ratio(&dropped_answer)),
            ];
            for (m, (answer, want)) in expected.into_iter().enumerate() {
                let c = &canned[3 * n + m];
                assert_eq!(c.name, answer, "{name}");
                assert!(c.applicable && c.rejected, "{name}: {c:?}");
                assert_eq!(c.max_ratio, want, "{name}: {answer}");
            }
        }
    }

    /// The gate's magnitudes on a case worked by hand: one query over two keys (`d = dv = 1`, `α = 1`), two query heads
    /// sharing the KV head (group 2), `q = 1`, `k = (0, ln 3)` so that `P = (1/4, 3/4)`, `v = (2, −2)` so that
    /// `o = −1`, `dO = 1/2`. Then `t_j = P_j (|dO||v_j| + |dO||o|) = 1.5 P_j = (0.375, 1.125)`, and the magnitudes are
    /// dQ: `|α| Σ_j t_j |k_j| = 1.125 ln 3`; dK: `G · max_j |α| t_j |q| = 2.25`; dV: `G · max_j P_j |dO| = 0.75`.
    #[test]
    fn magnitudes_follow_their_formulas() {
        let spec = AttentionSpec::dense(1, 2, 1, 1, 2, 1, 1);
        let t = |shape: &[usize], x: &[f64]| ArrayD::from_shape_vec(IxDyn(shape), x.to_vec()).unwrap();
        let q = t(&[1, 2, 1, 1], &[1.0, 1.0]);
        let k = t(&[1, 1, 2, 1], &[0.0, 3f64.ln()]);
        let v = t(&[1, 1, 2, 1], &[2.0, -2.0]);
        let g = t(&[1, 2, 1, 1], &[0.5, 0.5]);
        let recipe = crate::recipes::reference::<half::bf16>(64);
        let truth = backward_truth(&spec, [&q, &k, &v, &g], recipe, 64).unwrap();
        let expected = [1.125 * 3f64.ln(), 2.25, 0.75];
        for (n, (got, want)) in truth.magnitude.iter().zip(expected).enumerate() {
            assert!((got - want).abs() <= 1e-14 * want, "magnitude {n}: {got} against {want}");
        }
        // dK and dV of a GQA group: the two heads' own bounds (the same head twice here), plus the model's group-sum
        // term over the sum of the heads' |dK| (|dV|) in place of each lone head's.
        let one = AttentionSpec::dense(1, 1, 1, 1, 2, 1, 1);
        let (q1, g1) = (t(&[1, 1, 1, 1], &[1.0]), t(&[1, 1, 1, 1], &[0.5]));
        let single = backward_truth(&one, [&q1, &k, &v, &g1], recipe, 64).unwrap();
        for (both, alone, grad) in [
            (&truth.bound_dk, &single.bound_dk, &single.grads.dk),
            (&truth.bound_dv, &single.bound_dv, &single.grads.dv),
        ] {
            for ((b, a), x) in both.iter().zip(alone.iter()).zip(grad.iter()) {
                // The lone head's bound carries its own (group of 1) sum term; the group's carries one over both.
                let want = 2.0 * (a - gqa_sum_term(1, x.abs())) + gqa_sum_term(2, 2.0 * x.abs());
                assert!((b - want).abs() <= 1e-15 * want, "{b} against {want}");
            }
        }
    }
}
