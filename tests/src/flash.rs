//! Verifying a FlashAttention forward (reference schedule or kernel) against the f64 oracle
//! under the bound of `attnproof_proofs::flash_bound`, with the discriminability gate.

use attnproof_oracle::attention::{Visibility, forward_with_visibility};
use attnproof_oracle::dense::{probabilities_from_lse, scores};
use attnproof_oracle::spec::{Operand, Sequence};
use attnproof_oracle::{AttentionSpec, DenseConfig, Qkv, Scale, forward};
use attnproof_proofs::flash_bound::{FlashRecipe, HeadExact, forward_bounds};
use attnproof_reference::Element;
use ndarray::{ArrayD, ArrayViewD, IxDyn};
use thiserror::Error;

use crate::gate::GateReport;
use crate::verdict::{Verdict, compare};

/// Why a case could not be verified (not a numerical failure: those are verdicts).
#[derive(Debug, Clone, PartialEq, Error)]
pub enum HarnessError {
    /// The oracle refused the problem.
    #[error(transparent)]
    Oracle(#[from] attnproof_oracle::OracleError),
    /// The rounding-error model does not apply to this case (its hypothesis fails).
    #[error(transparent)]
    Model(#[from] attnproof_proofs::Violation),
    /// The GPU crate's reading of the problem refused it (a layer that is not NSA's, a configuration its kernels do
    /// not take).
    #[error(transparent)]
    Gpu(#[from] attnproof_gpu::GpuError),
    /// The candidate's outputs have the wrong shape.
    #[error("candidate `{argument}` has shape {actual:?}, expected {expected:?}")]
    CandidateShape {
        /// Which output.
        argument: &'static str,
        /// Expected shape.
        expected: Vec<usize>,
        /// Actual shape.
        actual: Vec<usize>,
    },
}

/// The inputs of a case in their storage type.
#[derive(Clone, Debug)]
pub struct Case<T> {
    /// The problem.
    pub spec: AttentionSpec,
    /// Queries.
    pub q: ArrayD<T>,
    /// Keys.
    pub k: ArrayD<T>,
    /// Values.
    pub v: ArrayD<T>,
}

impl<T: Element> Case<T> {
    /// The inputs widened to f64 (exact).
    pub fn widened(&self) -> [ArrayD<f64>; 3] {
        [&self.q, &self.k, &self.v].map(|t| t.mapv(|x| x.to_f32() as f64))
    }
    /// The reference schedule's view of the inputs.
    pub fn inputs(&self) -> attnproof_reference::Inputs<'_, T> {
        attnproof_reference::Inputs { q: self.q.view(), k: self.k.view(), v: self.v.view() }
    }
    /// The reference backward's view of the inputs, with the forward's `o` and `lse` and the upstream gradient.
    pub fn backward_inputs<'a>(
        &'a self,
        o: &'a ArrayD<T>,
        lse: &'a ArrayD<f32>,
        d_out: &'a ArrayD<T>,
    ) -> attnproof_reference::BackwardInputs<'a, T> {
        attnproof_reference::BackwardInputs {
            q: self.q.view(),
            k: self.k.view(),
            v: self.v.view(),
            o: o.view(),
            lse: lse.view(),
            d_out: d_out.view(),
        }
    }
}

/// The oracle's forward outputs and the model's bounds on them.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardTruth {
    /// Oracle `O`.
    pub o: ArrayD<f64>,
    /// Oracle `LSE`.
    pub lse: ArrayD<f64>,
    /// Bound on `O`.
    pub bound_o: ArrayD<f64>,
    /// Bound on `LSE`.
    pub bound_lse: ArrayD<f64>,
}

/// Bounds on `O` and `LSE` for the whole problem, from the per-head model.
pub fn problem_forward_bounds(
    spec: &AttentionSpec,
    q: &ArrayD<f64>,
    k: &ArrayD<f64>,
    v: &ArrayD<f64>,
    recipe: FlashRecipe,
) -> Result<ForwardTruth, HarnessError> {
    spec.validate()?;
    let masks: Vec<_> = spec.sequences().iter().map(|s| spec.mask.matrix(s.len_q, s.len_k)).collect();
    problem_forward_bounds_with_visibility(spec, q, k, v, &|seq: &Sequence, _| masks[seq.index].clone(), recipe)
}

/// [`problem_forward_bounds`] with the visibility of each (sequence, head) given (block-sparse
/// patterns, top-left causal); the spec's own mask is not applied.
pub fn problem_forward_bounds_with_visibility(
    spec: &AttentionSpec,
    q: &ArrayD<f64>,
    k: &ArrayD<f64>,
    v: &ArrayD<f64>,
    visibility: Visibility<'_>,
    recipe: FlashRecipe,
) -> Result<ForwardTruth, HarnessError> {
    let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
    let truth = forward_with_visibility(spec, qkv, visibility, DenseConfig::default(), ())?;
    let mut bound_o = ArrayD::zeros(IxDyn(&spec.expected_shape(Operand::O)));
    let mut bound_lse = ArrayD::zeros(IxDyn(&spec.expected_shape(Operand::RowStat)));
    let scale = spec.scale_value::<f64>(());
    for seq in spec.sequences() {
        for h in 0..spec.n_heads_q {
            let visible = visibility(&seq, h);
            let kv = spec.kv_head(h);
            let (qh, kh, vh) = (
                spec.head_rows(q.view(), &seq, h, false),
                spec.head_rows(k.view(), &seq, kv, true),
                spec.head_rows(v.view(), &seq, kv, true),
            );
            let lse = spec.head_row_stat(truth.lse.view(), &seq, h);
            let s = scores(qh, kh, &scale, visible.view(), ());
            let p = probabilities_from_lse(s.view(), lse, visible.view(), ());
            let o = spec.head_rows(truth.o.view(), &seq, h, false);
            let b = forward_bounds(
                HeadExact { q: qh, k: kh, v: vh, s: s.view(), p: p.view(), o, lse, scale: scale.abs() },
                recipe,
            )?;
            bound_o.slice_mut(spec.head_slice(&seq, h, false)).assign(&b.o);
            bound_lse.slice_mut(spec.row_stat_slice(&seq, h)).assign(&b.lse);
        }
    }
    Ok(ForwardTruth { o: truth.o, lse: truth.lse, bound_o, bound_lse })
}

/// The recipe of the reference forward for storage type `T` and KV tile `kv_tile` (its home, with every other
/// recipe, is [`crate::recipes`]).
pub use crate::recipes::reference as recipe;

/// Verifies a forward candidate's `(O, LSE)` on `case`, under the model for `recipe` (see
/// [`recipe`] for the reference schedule's).
pub fn verify_forward<T: Element>(
    case: &Case<T>,
    recipe: FlashRecipe,
    o: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
) -> Result<Verdict, HarnessError> {
    let spec = &case.spec;
    for (argument, op, shape) in [("o", Operand::O, o.shape()), ("lse", Operand::RowStat, lse.shape())] {
        let expected = spec.expected_shape(op);
        if shape != expected.as_slice() {
            return Err(HarnessError::CandidateShape { argument, expected, actual: shape.to_vec() });
        }
    }
    let [q, k, v] = case.widened();
    let kv_tile = recipe.kv_tile;
    let ForwardTruth { o: o_true, lse: lse_true, bound_o, bound_lse } =
        problem_forward_bounds(spec, &q, &k, &v, recipe)?;
    let o_cand = o.mapv(|x| x.to_f32() as f64);
    let lse_cand = lse.mapv(|x| x as f64);
    let outputs = vec![
        compare("O", o_cand.view(), o_true.view(), bound_o.view()),
        compare("LSE", lse_cand.view(), lse_true.view(), bound_lse.view()),
    ];
    let gate = forward_gate(spec, &q, &k, &v, kv_tile, T::UNIT_ROUNDOFF, (&o_true, &lse_true), (&bound_o, &bound_lse))?;
    Ok(Verdict { outputs, gate })
}

/// Scores the canned wrong answers of a forward case.
pub fn forward_gate(
    spec: &AttentionSpec,
    q: &ArrayD<f64>,
    k: &ArrayD<f64>,
    v: &ArrayD<f64>,
    kv_tile: usize,
    unit_roundoff: f64,
    truth: (&ArrayD<f64>, &ArrayD<f64>),
    bounds: (&ArrayD<f64>, &ArrayD<f64>),
) -> Result<GateReport, HarnessError> {
    let (o_true, lse_true) = truth;
    let (bound_o, bound_lse) = bounds;
    let max_abs = |t: &ArrayD<f64>| t.iter().filter(|x| x.is_finite()).fold(0f64, |m, x| m.max(x.abs()));
    let o_scale = max_abs(o_true).max(max_abs(v));
    let lse_scale = max_abs(lse_true).max(1.0);
    let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
    let mut gate = GateReport::default();
    let score_o = |gate: &mut GateReport, name: &'static str, o: ArrayViewD<'_, f64>| {
        gate.score(name, "O", o, o_true.view(), bound_o.view(), unit_roundoff, o_scale)
    };
    score_o(&mut gate, "zeros", ArrayD::zeros(o_true.raw_dim()).view());
    score_o(&mut gate, "mean(V)", uniform_average(spec, v).view());
    let without_last_tile = |seq: &Sequence, _h: usize| {
        let cut = seq.len_k.div_ceil(kv_tile).saturating_sub(1) * kv_tile;
        let mut m = spec.mask.matrix(seq.len_q, seq.len_k);
        m.indexed_iter_mut().for_each(|((_, j), x)| *x = *x && j < cut);
        m
    };
    let dropped = forward_with_visibility(spec, qkv.clone(), &without_last_tile, DenseConfig::default(), ())?;
    score_o(&mut gate, "last KV tile dropped", dropped.o.view());
    let one_over_d = spec.clone().with_scale(Scale::Value(1.0 / spec.head_dim as f64));
    let wrong_scale = forward(&one_over_d, qkv, DenseConfig::default(), ())?;
    score_o(&mut gate, "scale 1/d", wrong_scale.o.view());
    gate.score(
        "LSE base 2",
        "LSE",
        lse_true.mapv(|x| x / std::f64::consts::LN_2).view(),
        lse_true.view(),
        bound_lse.view(),
        unit_roundoff,
        lse_scale,
    );
    Ok(gate)
}

/// `mean(V)`: each row's uniform average of the values it can see (0 where it sees none).
fn uniform_average(spec: &AttentionSpec, v: &ArrayD<f64>) -> ArrayD<f64> {
    let mut out = ArrayD::zeros(IxDyn(&spec.expected_shape(Operand::O)));
    for seq in spec.sequences() {
        let visible = spec.mask.matrix(seq.len_q, seq.len_k);
        for h in 0..spec.n_heads_q {
            let vh = spec.head_rows(v.view(), &seq, spec.kv_head(h), true);
            let mut oh = out.slice_mut(spec.head_slice(&seq, h, false));
            for i in 0..seq.len_q {
                let keys: Vec<usize> = (0..seq.len_k).filter(|&j| visible[[i, j]]).collect();
                for c in 0..spec.head_dim_v {
                    let mean = if keys.is_empty() {
                        0.0
                    } else {
                        keys.iter().map(|&j| vh[[j, c]]).sum::<f64>() / keys.len() as f64
                    };
                    oh[[i, c]] = mean;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{Distribution, ValueProfile, make_case};
    use ndarray::{Axis, Slice};

    /// Each canned wrong answer of the forward gate is the wrong answer it names, recomputed here on its own: "last KV
    /// tile dropped" removes exactly the keys of the last KV tile (Lk = 65 with tiles of 64: the attention over the
    /// first 64 keys alone), "scale 1/d" is the attention with scale `1/d`, "mean(V)" each row's plain mean of the
    /// values, "LSE base 2" the LSE divided by `ln 2`. Each is visibly wrong here and rejected.
    #[test]
    fn the_canned_answers_are_the_wrong_answers_they_name() {
        let spec = AttentionSpec::dense(1, 1, 1, 3, 65, 8, 8);
        // The last key carries the rows' largest logit, so that removing it is visible.
        let profile = ValueProfile { distribution: Distribution::MaxInLastTile, logit_scale: 4.0, value_mean: 0.0 };
        let case = make_case::<half::bf16>(&spec, profile, 5);
        let recipe = crate::recipes::reference::<half::bf16>(64);
        let [q, k, v] = case.widened();
        let truth = problem_forward_bounds(&spec, &q, &k, &v, recipe).unwrap();
        let gate = forward_gate(
            &spec,
            &q,
            &k,
            &v,
            64,
            recipe.unit_roundoff,
            (&truth.o, &truth.lse),
            (&truth.bound_o, &truth.bound_lse),
        )
        .unwrap();
        let canned = |name: &str| gate.canned.iter().find(|c| c.name == name).cloned().expect("the answer is scored");
        let ratio_o = |o: &ArrayD<f64>| compare("O", o.view(), truth.o.view(), truth.bound_o.view()).max_ratio;
        let first_tile = AttentionSpec::dense(1, 1, 1, 3, 64, 8, 8);
        let cut = |t: &ArrayD<f64>| t.slice_axis(Axis(2), Slice::from(0..64)).to_owned();
        let (k64, v64) = (cut(&k), cut(&v));
        let qkv = Qkv { q: q.view(), k: k64.view(), v: v64.view() };
        let dropped = forward(&first_tile, qkv, DenseConfig::default(), ()).unwrap();
        let scaled = spec.clone().with_scale(Scale::Value(1.0 / 8.0));
        let wrong_scale = forward(&scaled, Qkv { q: q.view(), k: k.view(), v: v.view() }, DenseConfig::default(), ());
        let mean_v = v.mean_axis(Axis(2)).unwrap().insert_axis(Axis(2));
        let mean_v = ndarray::concatenate(Axis(2), &[mean_v.view(), mean_v.view(), mean_v.view()]).unwrap();
        let lse2 = truth.lse.mapv(|x| x / std::f64::consts::LN_2);
        let expected = [
            ("last KV tile dropped", ratio_o(&dropped.o)),
            ("scale 1/d", ratio_o(&wrong_scale.unwrap().o)),
            ("mean(V)", ratio_o(&mean_v)),
            ("LSE base 2", compare("LSE", lse2.view(), truth.lse.view(), truth.bound_lse.view()).max_ratio),
        ];
        for (name, ratio) in expected {
            let c = canned(name);
            assert!(c.applicable && c.rejected, "{c:?}");
            assert_eq!(c.max_ratio, ratio, "{name}");
        }
    }
}
