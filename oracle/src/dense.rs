//! Dense attention of one head: scores (E1), forward through one E2 block and E5, and the
//! backward pass (E6–E10). Rows are processed in chunks only to bound memory; every row always
//! sees all of its keys, so the chunking changes no arithmetic of a row.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis, Slice, Zip};
use rayon::prelude::*;

use crate::online::SoftmaxState;
use crate::real::Real;

/// How the dense oracle walks the rows of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DenseConfig {
    /// Query rows whose scores are held at once (memory: `row_chunk × Lk` scalars).
    pub row_chunk: usize,
}

impl Default for DenseConfig {
    fn default() -> Self {
        DenseConfig { row_chunk: 512 }
    }
}

/// The tensors of one (sequence, query head) pair.
#[derive(Debug)]
pub struct HeadInputs<'a, S> {
    /// Queries `[Lq, d]`.
    pub q: ArrayView2<'a, S>,
    /// Keys `[Lk, d]` of the KV head this query head reads.
    pub k: ArrayView2<'a, S>,
    /// Values `[Lk, dv]`.
    pub v: ArrayView2<'a, S>,
    /// Visibility `[Lq, Lk]` (E1a).
    pub visible: ArrayView2<'a, bool>,
}

// Views are `Copy` whatever the element type, so the derive's `S: Copy` bound is not wanted.
impl<S> Clone for HeadInputs<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for HeadInputs<'_, S> {}

/// Forward results of one head.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadForward<S> {
    /// `O = P V`, `[Lq, dv]`.
    pub o: Array2<S>,
    /// Natural-log LSE `[Lq]`, `−∞` for fully masked rows.
    pub lse: Array1<S>,
}

/// Backward results of one head (dK, dV belong to this query head, before the GQA sum).
#[derive(Clone, Debug, PartialEq)]
pub struct HeadGradients<S> {
    /// `dQ = α dS K`, `[Lq, d]`.
    pub dq: Array2<S>,
    /// `dK = α dSᵀ Q`, `[Lk, d]`.
    pub dk: Array2<S>,
    /// `dV = Pᵀ dO`, `[Lk, dv]`.
    pub dv: Array2<S>,
    /// `D_i = dO_i · O_i`, `[Lq]` (E7).
    pub delta: Array1<S>,
}

/// E1: `S = α Q Kᵀ`, with `−∞` where the mask hides the key.
pub fn scores<S: Real>(
    q: ArrayView2<'_, S>,
    k: ArrayView2<'_, S>,
    scale: &S,
    visible: ArrayView2<'_, bool>,
    ctx: S::Ctx,
) -> Array2<S> {
    let mut s = Array2::from_elem((0, 0), S::zero(ctx));
    scores_into(&mut s, q, k, scale, visible, ctx);
    s
}

/// [`scores`] into `s`, reusing its memory where its shape allows.
pub fn scores_into<S: Real>(
    s: &mut Array2<S>,
    q: ArrayView2<'_, S>,
    k: ArrayView2<'_, S>,
    scale: &S,
    visible: ArrayView2<'_, bool>,
    ctx: S::Ctx,
) {
    S::matmul_into(s, q, k.t(), ctx);
    Zip::from(s.rows_mut()).and(visible.rows()).for_each(|row, vis| {
        crate::online::for_each_run(row, vis, |elements, visible| {
            if visible { S::scale_in_place(elements, scale) } else { elements.fill(S::neg_infinity(ctx)) }
        });
    });
}

/// E10: `P_ij = exp(S_ij − LSE_i)` on visible pairs and 0 elsewhere (so rows with
/// `LSE = −∞` give 0, not NaN).
pub fn probabilities_from_lse<S: Real>(
    scores: ArrayView2<'_, S>,
    lse: ArrayView1<'_, S>,
    visible: ArrayView2<'_, bool>,
    ctx: S::Ctx,
) -> Array2<S> {
    crate::online::shifted_exponentials(scores, visible, lse, ctx)
}

/// E7, second form: `D_i = dO_i · O_i` (needs no `P`).
pub fn delta_from_output<S: Real>(d_out: ArrayView2<'_, S>, o: ArrayView2<'_, S>, ctx: S::Ctx) -> Array1<S> {
    Zip::from(d_out.rows())
        .and(o.rows())
        .map_collect(|g, o| g.iter().zip(o).fold(S::zero(ctx), |acc, (a, b)| acc + a.clone() * b.clone()))
}

/// E7, first form: `D_i = Σ_j P_ij dP_ij`.
pub fn delta_from_probabilities<S: Real>(p: ArrayView2<'_, S>, dp: ArrayView2<'_, S>, ctx: S::Ctx) -> Array1<S> {
    delta_from_output(p, dp, ctx)
}

/// E8: `dS_ij = P_ij (dP_ij − D_i)`.
pub fn score_gradient<S: Real>(p: ArrayView2<'_, S>, dp: ArrayView2<'_, S>, delta: ArrayView1<'_, S>) -> Array2<S> {
    let mut ds = dp.to_owned();
    score_gradient_in_place(p, &mut ds, delta);
    ds
}

/// [`score_gradient`] over `dP` in `dp_ds`, which becomes `dS`.
pub fn score_gradient_in_place<S: Real>(p: ArrayView2<'_, S>, dp_ds: &mut Array2<S>, delta: ArrayView1<'_, S>) {
    Zip::from(dp_ds.rows_mut()).and(p.rows()).and(&delta).for_each(|mut row, p, delta| {
        for (x, p) in row.iter_mut().zip(p) {
            *x = p.clone() * (x.clone() - delta.clone());
        }
    });
}

/// Forward of one head: E1 scores, one E2 state over all keys of each row, E5 finalize.
pub fn head_forward<S: Real>(inputs: HeadInputs<'_, S>, scale: &S, config: DenseConfig, ctx: S::Ctx) -> HeadForward<S> {
    let (len_q, dv) = (inputs.q.nrows(), inputs.v.ncols());
    let mut o = Array2::from_elem((len_q, dv), S::zero(ctx));
    let mut lse = Array1::from_elem(len_q, S::zero(ctx));
    // Chunks of rows are independent (each row sees all of its keys), so they run in parallel; each chunk's rows
    // are computed exactly as in a sequential walk.
    let chunks: Vec<_> = row_chunks::<S>(len_q, inputs.k.nrows(), config)
        .into_par_iter()
        .map(|rows| {
            let visible = inputs.visible.slice_axis(Axis(0), Slice::from(rows.clone()));
            let s = scores(inputs.q.slice_axis(Axis(0), Slice::from(rows.clone())), inputs.k, scale, visible, ctx);
            (rows, SoftmaxState::of_owned_block(s, visible, inputs.v, ctx).finalize())
        })
        .collect();
    for (rows, (o_c, lse_c)) in chunks {
        o.slice_axis_mut(Axis(0), Slice::from(rows.clone())).assign(&o_c);
        lse.slice_axis_mut(Axis(0), Slice::from(rows)).assign(&lse_c);
    }
    HeadForward { o, lse }
}

/// Bytes of one chunk's `[rows, Lk]` arrays (scores, weights) at most: below glibc's largest dynamic mmap threshold
/// (32 MiB), so that a chunk's arrays come back from the heap instead of fresh pages. At 512 rows of 16K keys each array
/// was 64 MiB, and a fifth of the dense forward's time went to page faults.
const CHUNK_BYTES: usize = 16 << 20;

/// The row ranges covering `len_q` rows, in order: `config.row_chunk` rows each (the last one shorter), fewer when a
/// chunk's `[rows, len_k]` array of `S` would pass [`CHUNK_BYTES`] (never fewer than 16).
fn row_chunks<S>(len_q: usize, len_k: usize, config: DenseConfig) -> Vec<std::ops::Range<usize>> {
    let by_memory = CHUNK_BYTES / (std::mem::size_of::<S>() * len_k.max(1)).max(1);
    let chunk = config.row_chunk.min(by_memory.max(16)).max(1);
    (0..len_q).step_by(chunk).map(|start| start..(start + chunk).min(len_q)).collect()
}

/// Backward of one head given its forward results (E6–E10): `D` from `dO·O`, then per chunk of
/// rows `P` from LSE, `dV += Pᵀ dO`, `dP = dO Vᵀ`, `dS`, `dQ = α dS K`, `dK += dSᵀ Q`, and
/// finally `dK ← α dK`.
pub fn head_backward<S: Real>(
    inputs: HeadInputs<'_, S>,
    d_out: ArrayView2<'_, S>,
    forward: &HeadForward<S>,
    scale: &S,
    config: DenseConfig,
    ctx: S::Ctx,
) -> HeadGradients<S> {
    let (len_q, d) = inputs.q.dim();
    let (len_k, dv) = inputs.v.dim();
    let delta = delta_from_output(d_out, forward.o.view(), ctx);
    let mut dq = Array2::from_elem((len_q, d), S::zero(ctx));
    let mut dk = Array2::from_elem((len_k, d), S::zero(ctx));
    let mut dv_acc = Array2::from_elem((len_k, dv), S::zero(ctx));
    // Chunks run in parallel, a wave of as many as there are threads at a time; their dK and dV terms are then added
    // in ascending chunk order, so every sum is the sequential walk's, bit for bit, whatever the thread count. Each
    // chunk of a wave works in its own slot, whose arrays the next wave reuses.
    let chunks = row_chunks::<S>(len_q, len_k, config);
    let threads = rayon::current_num_threads().max(1);
    let mut slots: Vec<BackwardSlot<S>> = (0..threads.min(chunks.len())).map(|_| BackwardSlot::new(ctx)).collect();
    for wave in chunks.chunks(threads) {
        wave.par_iter().zip(slots.par_iter_mut()).for_each(|(rows, slot)| {
            let visible = inputs.visible.slice_axis(Axis(0), Slice::from(rows.clone()));
            let q_c = inputs.q.slice_axis(Axis(0), Slice::from(rows.clone()));
            let d_out_c = d_out.slice_axis(Axis(0), Slice::from(rows.clone()));
            let lse_c = forward.lse.slice_axis(Axis(0), Slice::from(rows.clone()));
            // E1 then E10 in place: the scores become P.
            scores_into(&mut slot.p, q_c, inputs.k, scale, visible, ctx);
            crate::online::exponentials_and_sums_in_place(&mut slot.p, visible, lse_c, ctx);
            S::matmul_into(&mut slot.dv, slot.p.t(), d_out_c, ctx);
            // dP, then dS in place (E8).
            S::matmul_into(&mut slot.ds, d_out_c, inputs.v.t(), ctx);
            score_gradient_in_place(slot.p.view(), &mut slot.ds, delta.slice_axis(Axis(0), Slice::from(rows.clone())));
            S::matmul_into(&mut slot.dq, slot.ds.view(), inputs.k, ctx);
            slot.dq.mapv_inplace(|x| x * scale.clone());
            S::matmul_into(&mut slot.dk, slot.ds.t(), q_c, ctx);
        });
        for (rows, slot) in wave.iter().zip(&slots) {
            add_assign(&mut dv_acc, slot.dv.view());
            dq.slice_axis_mut(Axis(0), Slice::from(rows.clone())).assign(&slot.dq);
            add_assign(&mut dk, slot.dk.view());
        }
    }
    dk.mapv_inplace(|x| x * scale.clone());
    HeadGradients { dq, dk, dv: dv_acc, delta }
}

/// One chunk's arrays in [`head_backward`]: `P`, `dP` (then `dS`) and the chunk's terms of dQ, dK and dV, reused from
/// wave to wave (allocating them per chunk made the backward spend a fifth of its time in page faults).
struct BackwardSlot<S> {
    p: Array2<S>,
    ds: Array2<S>,
    dq: Array2<S>,
    dk: Array2<S>,
    dv: Array2<S>,
}

impl<S: Real> BackwardSlot<S> {
    fn new(ctx: S::Ctx) -> Self {
        let empty = || Array2::from_elem((0, 0), S::zero(ctx));
        BackwardSlot { p: empty(), ds: empty(), dq: empty(), dk: empty(), dv: empty() }
    }
}

/// `acc += x`, elementwise.
pub fn add_assign<S: Real>(acc: &mut Array2<S>, x: ArrayView2<'_, S>) {
    Zip::from(acc).and(&x).for_each(|a, b| *a += b.clone());
}

/// Sum of the rows of `x` (used by theorems: rows of `dS` sum to 0).
pub fn row_totals<S: Real>(x: ArrayView2<'_, S>, ctx: S::Ctx) -> Array1<S> {
    x.map_axis(Axis(1), |r| r.iter().fold(S::zero(ctx), |a, b| a + b.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::uniform_tensor;
    use crate::spec::Mask;

    /// The backward's chunks, computed in reused arrays (`BackwardSlot`), give the bits of the allocating functions of
    /// each equation composed in the same order: chunks of 7 rows (waves over the threads, a short last chunk), a
    /// causal mask with Lq ≠ Lk, rows that see no key.
    #[test]
    fn the_backward_in_reused_arrays_is_the_allocating_walk_bit_for_bit() {
        let (len_q, len_k, d, dv) = (30, 23, 5, 6);
        let two = |seed: u64, rows: usize, cols: usize| {
            uniform_tensor(seed, &[rows, cols]).into_dimensionality::<ndarray::Ix2>().expect("two axes")
        };
        let (q, k, v, g) = (two(1, len_q, d), two(2, len_k, d), two(3, len_k, dv), two(4, len_q, dv));
        let visible = Mask::Causal.matrix(len_q, len_k);
        let inputs = HeadInputs { q: q.view(), k: k.view(), v: v.view(), visible: visible.view() };
        let scale = 0.37;
        let config = DenseConfig { row_chunk: 7 };
        let fwd = head_forward(inputs, &scale, config, ());
        let got = head_backward(inputs, g.view(), &fwd, &scale, config, ());
        let delta = delta_from_output(g.view(), fwd.o.view(), ());
        let (mut dq, mut dk, mut dv_acc) =
            (Array2::<f64>::zeros((len_q, d)), Array2::<f64>::zeros((len_k, d)), Array2::<f64>::zeros((len_k, dv)));
        for rows in row_chunks::<f64>(len_q, len_k, config) {
            let cut = |a: ArrayView2<'_, f64>| a.slice_axis(Axis(0), Slice::from(rows.clone())).to_owned();
            let vis = visible.slice_axis(Axis(0), Slice::from(rows.clone()));
            let s = scores(cut(q.view()).view(), k.view(), &scale, vis, ());
            let lse = fwd.lse.slice_axis(Axis(0), Slice::from(rows.clone()));
            let p = probabilities_from_lse(s.view(), lse, vis, ());
            let dp = f64::matmul(cut(g.view()).view(), v.t(), ());
            let ds = score_gradient(p.view(), dp.view(), delta.slice_axis(Axis(0), Slice::from(rows.clone())));
            add_assign(&mut dv_acc, f64::matmul(p.t(), cut(g.view()).view(), ()).view());
            dq.slice_axis_mut(Axis(0), Slice::from(rows.clone()))
                .assign(&f64::matmul(ds.view(), k.view(), ()).mapv(|x| x * scale));
            add_assign(&mut dk, f64::matmul(ds.t(), cut(q.view()).view(), ()).view());
        }
        dk.mapv_inplace(|x| x * scale);
        let bits = |a: &Array2<f64>| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.dq), bits(&dq));
        assert_eq!(bits(&got.dk), bits(&dk));
        assert_eq!(bits(&got.dv), bits(&dv_acc));
        assert!(got.dq.row(0).iter().all(|&x| x == 0.0), "a row that sees no key has no gradient");
    }

    #[test]
    fn a_product_into_a_used_array_ignores_its_old_values() {
        let a = ndarray::array![[1.0, 2.0], [3.0, -4.0], [0.5, 0.25]];
        let b = ndarray::array![[2.0, -1.0, 0.0], [1.0, 3.0, -2.0]];
        let mut dst = Array2::from_elem((3, 3), f64::NAN);
        dst[[0, 0]] = f64::INFINITY;
        f64::matmul_into(&mut dst, a.view(), b.view(), ());
        assert_eq!(dst, f64::matmul(a.view(), b.view(), ()));
        // Another shape reallocates.
        f64::matmul_into(&mut dst, a.t(), a.view(), ());
        assert_eq!(dst, f64::matmul(a.t(), a.view(), ()));
    }

    /// The chunks cover the rows in order, hold `config.row_chunk` rows while a `[rows, Lk]` array of `S` stays
    /// within `CHUNK_BYTES` (16 MiB: 512 rows of 4096 f64 keys, 128 of 16384), fewer past that, and never fewer than
    /// 16; the element size counts (MPFR numbers take more rows' worth of bytes).
    #[test]
    fn row_chunks_keep_each_array_under_the_mmap_threshold() {
        let config = DenseConfig::default();
        let sizes = |len_q, len_k| row_chunks::<f64>(len_q, len_k, config).iter().map(|r| r.len()).collect::<Vec<_>>();
        assert_eq!(sizes(1030, 4096), [512, 512, 6], "up to 4096 keys: the configured 512 rows");
        assert_eq!(sizes(300, 16384), [128, 128, 44], "16384 keys: 16 MiB / (8 B × 16384) = 128 rows");
        assert_eq!(sizes(40, 1 << 22), [16, 16, 8], "at least 16 rows, however long the rows");
        assert_eq!(row_chunks::<[f64; 4]>(300, 16384, config)[0].len(), 32, "32-byte elements: a quarter of the rows");
        let chunks = row_chunks::<f64>(300, 16384, config);
        assert_eq!((chunks[0].start, chunks[2].end), (0, 300));
        assert!(chunks.windows(2).all(|w| w[0].end == w[1].start), "contiguous, in order");
        assert_eq!(sizes(0, 16384), Vec::<usize>::new(), "no rows: no chunk");
        assert_eq!(sizes(5, 0), [5], "no keys: one chunk of every row");
    }
}
