//! Whole-problem oracle entry points: batch, heads, GQA (E1b), varlen, forward and backward,
//! parallel over (sequence, head) pairs with rayon. Generic over [`Real`]; concrete `f64` and
//! MPFR wrappers sit at the crate boundary.

use ndarray::{Array2, ArrayD, ArrayViewD, IxDyn, Zip};
use rayon::prelude::*;

use crate::dense::{DenseConfig, HeadForward, HeadGradients, HeadInputs, head_backward, head_forward};
use crate::error::OracleError;
use crate::real::{Mp, Precision, Real};
use crate::spec::{AttentionSpec, Operand, Sequence};

/// Forward outputs: `O` (shape of Q with `dv`) and natural-log `LSE` (dense `[B,Hq,Lq]`,
/// varlen `[Hq,Tq]`).
#[derive(Clone, Debug, PartialEq)]
pub struct Forward<S> {
    /// Attention output.
    pub o: ArrayD<S>,
    /// Log-sum-exp of each row's visible scores; `−∞` for fully masked rows.
    pub lse: ArrayD<S>,
}

/// Backward outputs (and the forward they were computed from).
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients<S> {
    /// Gradient with respect to Q.
    pub dq: ArrayD<S>,
    /// Gradient with respect to K, summed over the query heads of each KV head.
    pub dk: ArrayD<S>,
    /// Gradient with respect to V, summed over the query heads of each KV head.
    pub dv: ArrayD<S>,
    /// `D = rowsum(dO ∘ O)` (E7), laid out like LSE.
    pub delta: ArrayD<S>,
    /// The forward pass the gradients used.
    pub forward: Forward<S>,
}

/// Inputs of an attention problem, borrowed.
#[derive(Clone, Debug)]
pub struct Qkv<'a, S> {
    /// Queries.
    pub q: ArrayViewD<'a, S>,
    /// Keys.
    pub k: ArrayViewD<'a, S>,
    /// Values.
    pub v: ArrayViewD<'a, S>,
}

impl<'a, S: Real> Qkv<'a, S> {
    fn validate(&self, spec: &AttentionSpec) -> Result<(), OracleError> {
        spec.validate()?;
        spec.check_tensor("q", Operand::Q, &self.q)?;
        spec.check_tensor("k", Operand::K, &self.k)?;
        spec.check_tensor("v", Operand::V, &self.v)
    }

    fn head<'b>(
        &'b self,
        spec: &AttentionSpec,
        seq: &Sequence,
        h: usize,
        visible: &'b Array2<bool>,
    ) -> HeadInputs<'b, S> {
        let kv = spec.kv_head(h);
        HeadInputs {
            q: spec.head_rows(self.q.view(), seq, h, false),
            k: spec.head_rows(self.k.view(), seq, kv, true),
            v: spec.head_rows(self.v.view(), seq, kv, true),
            visible: visible.view(),
        }
    }
}

fn tasks(spec: &AttentionSpec) -> Vec<(Sequence, usize)> {
    spec.sequences().into_iter().flat_map(|seq| (0..spec.n_heads_q).map(move |h| (seq, h))).collect()
}

fn filled<S: Real>(shape: Vec<usize>, ctx: S::Ctx) -> ArrayD<S> {
    ArrayD::from_elem(IxDyn(&shape), S::zero(ctx))
}

/// Which keys each (sequence, query head) sees: `[Lq, Lk]` per pair. The spec's mask for dense
/// attention; the mask AND a block pattern for block-sparse attention (E14).
pub type Visibility<'a> = &'a (dyn Fn(&Sequence, usize) -> Array2<bool> + Sync);

/// The dense forward of every (sequence, head), in `ctx`'s precision.
pub fn forward<S: Real>(
    spec: &AttentionSpec,
    qkv: Qkv<'_, S>,
    config: DenseConfig,
    ctx: S::Ctx,
) -> Result<Forward<S>, OracleError> {
    spec.validate()?;
    let masks: Vec<_> = spec.sequences().iter().map(|s| spec.mask.matrix(s.len_q, s.len_k)).collect();
    forward_with_visibility(spec, qkv, &|seq: &Sequence, _| masks[seq.index].clone(), config, ctx)
}

/// The forward of every (sequence, head) with the visibility given per pair (E1 with an
/// arbitrary `M`). The spec's own mask is not applied: `visibility` decides alone.
pub fn forward_with_visibility<S: Real>(
    spec: &AttentionSpec,
    qkv: Qkv<'_, S>,
    visibility: Visibility<'_>,
    config: DenseConfig,
    ctx: S::Ctx,
) -> Result<Forward<S>, OracleError> {
    qkv.validate(spec)?;
    let scale = spec.scale_value::<S>(ctx);
    let results: Vec<HeadForward<S>> = tasks(spec)
        .par_iter()
        .map(|(seq, h)| {
            let visible = visibility(seq, *h);
            head_forward(qkv.head(spec, seq, *h, &visible), &scale, config, ctx)
        })
        .collect();
    let mut out = Forward {
        o: filled(spec.expected_shape(Operand::O), ctx),
        lse: filled(spec.expected_shape(Operand::RowStat), ctx),
    };
    for ((seq, h), r) in tasks(spec).iter().zip(results) {
        out.o.slice_mut(spec.head_slice(seq, *h, false)).assign(&r.o);
        out.lse.slice_mut(spec.row_stat_slice(seq, *h)).assign(&r.lse);
    }
    Ok(out)
}

/// The dense backward of every (sequence, head) for upstream gradient `d_out`; dK and dV of a
/// KV head are summed over its query heads in ascending order (E9 under GQA).
pub fn backward<S: Real>(
    spec: &AttentionSpec,
    qkv: Qkv<'_, S>,
    d_out: ArrayViewD<'_, S>,
    config: DenseConfig,
    ctx: S::Ctx,
) -> Result<Gradients<S>, OracleError> {
    spec.validate()?;
    let masks: Vec<_> = spec.sequences().iter().map(|s| spec.mask.matrix(s.len_q, s.len_k)).collect();
    backward_with_visibility(spec, qkv, d_out, &|seq: &Sequence, _| masks[seq.index].clone(), config, ctx)
}

/// The backward of every (sequence, head) with the visibility given per pair; see
/// [`forward_with_visibility`].
pub fn backward_with_visibility<S: Real>(
    spec: &AttentionSpec,
    qkv: Qkv<'_, S>,
    d_out: ArrayViewD<'_, S>,
    visibility: Visibility<'_>,
    config: DenseConfig,
    ctx: S::Ctx,
) -> Result<Gradients<S>, OracleError> {
    qkv.validate(spec)?;
    spec.check_tensor("d_out", Operand::O, &d_out)?;
    let scale = spec.scale_value::<S>(ctx);
    let results: Vec<(HeadForward<S>, HeadGradients<S>)> = tasks(spec)
        .par_iter()
        .map(|(seq, h)| {
            let visible = visibility(seq, *h);
            let inputs = qkv.head(spec, seq, *h, &visible);
            let fwd = head_forward(inputs, &scale, config, ctx);
            let grads = head_backward(inputs, spec.head_rows(d_out.view(), seq, *h, false), &fwd, &scale, config, ctx);
            (fwd, grads)
        })
        .collect();
    let mut out = Gradients {
        dq: filled(spec.expected_shape(Operand::Q), ctx),
        dk: filled(spec.expected_shape(Operand::K), ctx),
        dv: filled(spec.expected_shape(Operand::V), ctx),
        delta: filled(spec.expected_shape(Operand::RowStat), ctx),
        forward: Forward {
            o: filled(spec.expected_shape(Operand::O), ctx),
            lse: filled(spec.expected_shape(Operand::RowStat), ctx),
        },
    };
    for ((seq, h), (fwd, g)) in tasks(spec).iter().zip(results) {
        let kv = spec.kv_head(*h);
        out.forward.o.slice_mut(spec.head_slice(seq, *h, false)).assign(&fwd.o);
        out.forward.lse.slice_mut(spec.row_stat_slice(seq, *h)).assign(&fwd.lse);
        out.delta.slice_mut(spec.row_stat_slice(seq, *h)).assign(&g.delta);
        out.dq.slice_mut(spec.head_slice(seq, *h, false)).assign(&g.dq);
        Zip::from(out.dk.slice_mut(spec.head_slice(seq, kv, true)))
            .and(&g.dk.into_dyn())
            .for_each(|a, b| *a += b.clone());
        Zip::from(out.dv.slice_mut(spec.head_slice(seq, kv, true)))
            .and(&g.dv.into_dyn())
            .for_each(|a, b| *a += b.clone());
    }
    Ok(out)
}

/// Converts f64 tensors to MPFR exactly.
pub fn to_mpfr(t: ArrayViewD<'_, f64>, precision: Precision) -> ArrayD<Mp> {
    t.mapv(|x| Mp::new(x, precision))
}

/// Forward in f64 (faer products, parallel over heads).
pub fn forward_f64(
    spec: &AttentionSpec,
    q: ArrayViewD<'_, f64>,
    k: ArrayViewD<'_, f64>,
    v: ArrayViewD<'_, f64>,
) -> Result<Forward<f64>, OracleError> {
    forward(spec, Qkv { q, k, v }, DenseConfig::default(), ())
}

/// Backward in f64.
pub fn backward_f64(
    spec: &AttentionSpec,
    q: ArrayViewD<'_, f64>,
    k: ArrayViewD<'_, f64>,
    v: ArrayViewD<'_, f64>,
    d_out: ArrayViewD<'_, f64>,
) -> Result<Gradients<f64>, OracleError> {
    backward(spec, Qkv { q, k, v }, d_out, DenseConfig::default(), ())
}

/// Forward in MPFR at `precision`, from f64 inputs (converted exactly).
pub fn forward_mpfr(
    spec: &AttentionSpec,
    q: ArrayViewD<'_, f64>,
    k: ArrayViewD<'_, f64>,
    v: ArrayViewD<'_, f64>,
    precision: Precision,
) -> Result<Forward<Mp>, OracleError> {
    let (q, k, v) = (to_mpfr(q, precision), to_mpfr(k, precision), to_mpfr(v, precision));
    forward(spec, Qkv { q: q.view(), k: k.view(), v: v.view() }, DenseConfig::default(), precision)
}

/// Backward in MPFR at `precision`, from f64 inputs (converted exactly).
pub fn backward_mpfr(
    spec: &AttentionSpec,
    q: ArrayViewD<'_, f64>,
    k: ArrayViewD<'_, f64>,
    v: ArrayViewD<'_, f64>,
    d_out: ArrayViewD<'_, f64>,
    precision: Precision,
) -> Result<Gradients<Mp>, OracleError> {
    let (q, k, v, g) = (to_mpfr(q, precision), to_mpfr(k, precision), to_mpfr(v, precision), to_mpfr(d_out, precision));
    backward(spec, Qkv { q: q.view(), k: k.view(), v: v.view() }, g.view(), DenseConfig::default(), precision)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::uniform_tensor;
    use crate::spec::Mask;

    /// The f64 results do not depend on the thread count: row chunks run in parallel and the backward adds their
    /// dK, dV terms in chunk order. Compared bit for bit between the global pool, one thread and three threads, with
    /// chunks of 7 rows so that the backward runs several waves, on a causal GQA problem with Lq ≠ Lk.
    #[test]
    fn f64_results_are_the_same_bits_on_any_thread_count() {
        let spec = AttentionSpec::dense(1, 4, 2, 150, 130, 64, 48).with_mask(Mask::Causal);
        let shape = |op| spec.expected_shape(op);
        let q = uniform_tensor(1, &shape(Operand::Q));
        let k = uniform_tensor(2, &shape(Operand::K));
        let v = uniform_tensor(3, &shape(Operand::V));
        let d_out = uniform_tensor(4, &shape(Operand::O));
        let config = DenseConfig { row_chunk: 7 };
        let run = || {
            let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
            backward(&spec, qkv, d_out.view(), config, ()).expect("a valid problem")
        };
        let bits = |g: &Gradients<f64>| {
            [&g.dq, &g.dk, &g.dv, &g.delta, &g.forward.o, &g.forward.lse]
                .iter()
                .flat_map(|t| t.iter().map(|x| x.to_bits()))
                .collect::<Vec<_>>()
        };
        let pool = |threads| rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
        let outside = bits(&run());
        assert_eq!(bits(&pool(1).install(run)), outside, "one thread");
        assert_eq!(bits(&pool(3).install(run)), outside, "three threads");
    }
}
