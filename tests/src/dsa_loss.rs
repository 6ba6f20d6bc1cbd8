//! Verifying DSA's indexer loss and its gradients on the GPU (`attnproof_gpu::dsa::loss`, E16's KL on the selected
//! tokens) against the oracle (`oracle::dsa::indexer_loss_and_gradients`).
//!
//! The teacher is written here from its definition (`τ_ts = Σ_h exp(α q_th · k_{s,kv(h)} − lse_th)` on the list, in
//! f64 from the case's exact inputs) and handed to the oracle, which renormalizes it on the lists and computes the
//! KL and the gradients. Every output of the candidate is held to its bound from `attnproof_proofs::dsa_loss_bound`
//! (the scores to `dsa_bound::indexer_score_bound`), each bound multiplied by `1 + 2^-20`, which covers the f64
//! reference's own rounding (at most `γ64(m)` of the same magnitudes, `m` far below `2^9` times each f32 sum's
//! length). Slots past a list's end must be exactly 0, a row without teacher mass must have `KL = 0`, `lse = +∞` and
//! no gradient.

use std::sync::Arc;

use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::dsa::index::IndexerShape;
use attnproof_gpu::dsa::loss::{LossGradients, LossInputsDevice, LossOutput, LossRows, LossShape, indexer_loss_device};
use attnproof_oracle::dsa::{IndexerInputs, LossSupport, indexer_loss_and_gradients, indexer_scores};
use attnproof_proofs::dsa_bound::{INDEXER_ACCUMULATION, indexer_score_bound};
use attnproof_proofs::dsa_loss_bound::{
    GatedTerm, SlotExact, gated_sum_bound, loss_row_bounds, relu_sum_bound, teacher_entry_error, teacher_exponent_error,
};
use attnproof_proofs::f64_oracle_bound::gamma;
use cudarc::driver::CudaStream;
use ndarray::{Array2, Array3, ArrayView1, Axis, Ix1, Ix2, Ix3};

use crate::candidate::{GUARD_BITS_32, LaunchError, Storage, poisoned, unguard, upload};
use crate::flash::HarnessError;

/// The factor on every bound that covers the f64 reference's own rounding (module docs).
pub const REFERENCE_FACTOR: f64 = 1.0 + 1.0 / (1u64 << 20) as f64;

/// An indexer-loss problem in its storage types (the layouts of `attnproof_gpu::dsa::loss`).
#[derive(Clone, Debug)]
pub struct LossProblem<T> {
    /// `q^I [T, H_I, d_I]`.
    pub q_index: Array3<T>,
    /// `k^I [T, d_I]`.
    pub k_index: Array2<T>,
    /// `w [T, H_I]`.
    pub weights: Array2<f32>,
    /// `[T, k]` lists.
    pub lists: Array2<i32>,
    /// The main attention's `q [T, H, d]`.
    pub query: Array3<T>,
    /// Its `k [T, H_kv, d]`.
    pub key: Array3<T>,
    /// Its `lse [H, T]`.
    pub lse: Array2<f32>,
    /// Its softmax scale.
    pub scale: f32,
}

impl<T: Storage> LossProblem<T> {
    /// The kernels' view of the problem.
    pub fn shape(&self) -> LossShape {
        let (seq_len, n_index_heads, index_dim) = self.q_index.dim();
        let (_, n_heads, head_dim) = self.query.dim();
        LossShape {
            indexer: IndexerShape { seq_len, n_index_heads, index_dim, top_k: self.lists.ncols() },
            n_heads,
            n_heads_kv: self.key.dim().1,
            head_dim,
            scale: self.scale,
        }
    }
}

/// Whether every output except `d_k_index` (summed by atomics) has the same bits in both runs.
pub fn same_bits(a: &LossOutput, b: &LossOutput) -> bool {
    fn same<D: ndarray::Dimension>(a: &ndarray::Array<f32, D>, b: &ndarray::Array<f32, D>) -> bool {
        a.shape() == b.shape() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }
    same(&a.student, &b.student)
        && same(&a.teacher, &b.teacher)
        && same(&a.kl, &b.kl)
        && same(&a.student_lse, &b.student_lse)
        && same(&a.d_q_index, &b.d_q_index)
        && same(&a.d_weights, &b.d_weights)
}

/// One launch of `kernel` on `problem` with every output NaN-poisoned and followed by a guard band; checks the bands
/// and that the inputs are unchanged.
pub fn loss_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    problem: &LossProblem<T>,
) -> Result<LossOutput, LaunchError> {
    let shape = problem.shape();
    let ix = shape.indexer;
    let driver = |e: cudarc::driver::DriverError| LaunchError::Driver(e.to_string());
    let q_index = upload(stream, &problem.q_index.clone().into_dyn())?;
    let k_index = upload(stream, &problem.k_index.clone().into_dyn())?;
    let weights = upload(stream, &problem.weights.clone().into_dyn())?;
    let lists = upload(stream, &problem.lists.clone().into_dyn())?;
    let query = upload(stream, &problem.query.clone().into_dyn())?;
    let key = upload(stream, &problem.key.clone().into_dyn())?;
    let lse = upload(stream, &problem.lse.clone().into_dyn())?;
    let guard = f32::from_bits(GUARD_BITS_32);
    let lens = [shape.rows_len(), shape.rows_len(), ix.seq_len, ix.seq_len, ix.q_len(), ix.weights_len(), ix.k_len()];
    let mut outs = Vec::with_capacity(lens.len());
    for &n in &lens {
        outs.push(poisoned(stream, n, f32::NAN, guard)?);
    }
    let [student, teacher, kl, student_lse, d_qi, d_w, d_ki] = &mut outs[..] else { unreachable!("seven outputs") };
    indexer_loss_device(
        stream,
        kernel,
        &shape,
        LossInputsDevice {
            q_index: &q_index,
            k_index: &k_index,
            weights: &weights,
            lists: &lists,
            query: &query,
            key: &key,
            lse: &lse,
        },
        LossRows { student, teacher, kl, student_lse },
        Some(LossGradients { d_q_index: d_qi, d_weights: d_w, d_k_index: d_ki }),
    )?;
    let mut back = Vec::with_capacity(outs.len());
    for out in &outs {
        back.push(stream.clone_dtoh(out).map_err(driver)?);
    }
    let inputs16 = [
        ("q_index", stream.clone_dtoh(&q_index).map_err(driver)?, problem.q_index.as_slice()),
        ("k_index", stream.clone_dtoh(&k_index).map_err(driver)?, problem.k_index.as_slice()),
        ("query", stream.clone_dtoh(&query).map_err(driver)?, problem.query.as_slice()),
        ("key", stream.clone_dtoh(&key).map_err(driver)?, problem.key.as_slice()),
    ];
    let inputs32 = [
        ("weights", stream.clone_dtoh(&weights).map_err(driver)?, problem.weights.as_slice()),
        ("lse", stream.clone_dtoh(&lse).map_err(driver)?, problem.lse.as_slice()),
    ];
    let lists_back = stream.clone_dtoh(&lists).map_err(driver)?;
    stream.synchronize().map_err(driver)?;
    for (input, device, host) in &inputs16 {
        if !host.unwrap_or(&[]).iter().zip(device).all(|(x, y)| x.bits() == y.bits()) {
            return Err(LaunchError::InputChanged { input });
        }
    }
    for (input, device, host) in &inputs32 {
        if !host.unwrap_or(&[]).iter().zip(device).all(|(x, y)| x.to_bits() == y.to_bits()) {
            return Err(LaunchError::InputChanged { input });
        }
    }
    if !problem.lists.iter().zip(&lists_back).all(|(x, y)| x == y) {
        return Err(LaunchError::InputChanged { input: "lists" });
    }
    let (t, k, h, d) = (ix.seq_len, ix.top_k, ix.n_index_heads, ix.index_dim);
    let names = ["student", "teacher", "kl", "student_lse", "d_q_index", "d_weights", "d_k_index"];
    let shapes: [&[usize]; 7] = [&[t, k], &[t, k], &[t], &[t], &[t, h, d], &[t, h], &[t, d]];
    let mut arrays = Vec::with_capacity(7);
    for ((values, &n), (name, dims)) in back.into_iter().zip(&lens).zip(names.into_iter().zip(shapes)) {
        arrays.push(unguard(name, values, n, dims, |x: f32| x.to_bits() == GUARD_BITS_32)?);
    }
    let shape_error = |e: ndarray::ShapeError| LaunchError::Driver(e.to_string());
    let mut arrays = arrays.into_iter();
    let mut next = || arrays.next().expect("seven outputs");
    Ok(LossOutput {
        student: next().into_dimensionality::<Ix2>().map_err(shape_error)?,
        teacher: next().into_dimensionality::<Ix2>().map_err(shape_error)?,
        kl: next().into_dimensionality::<Ix1>().map_err(shape_error)?,
        student_lse: next().into_dimensionality::<Ix1>().map_err(shape_error)?,
        d_q_index: next().into_dimensionality::<Ix3>().map_err(shape_error)?,
        d_weights: next().into_dimensionality::<Ix2>().map_err(shape_error)?,
        d_k_index: next().into_dimensionality::<Ix2>().map_err(shape_error)?,
    })
}

/// The outcome of one verification.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LossVerdict {
    /// Tokens checked.
    pub rows: usize,
    /// Rows with a target (teacher mass on a non-empty list).
    pub active_rows: usize,
    /// The largest `|candidate − reference| / bound` over every output.
    pub worst_ratio: f64,
    /// Why the verdict failed, one line per output element (the first few of each kind).
    pub failures: Vec<String>,
}

impl LossVerdict {
    /// No check failed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// Records one comparison of `what` against `reference` within `bound`.
    fn check(&mut self, what: impl FnOnce() -> String, candidate: f64, reference: f64, bound: f64) {
        let error = (candidate - reference).abs();
        let ratio = if candidate == reference {
            0.0
        } else if error.is_nan() {
            f64::INFINITY
        } else {
            error / bound
        };
        self.worst_ratio = self.worst_ratio.max(ratio);
        if ratio > 1.0 && self.failures.len() < 40 {
            self.failures.push(format!(
                "{} = {candidate:e} is {error:e} from the reference {reference:e}, beyond its bound {bound:e}",
                what()
            ));
        }
    }
}

fn dot(a: ArrayView1<'_, f64>, b: ArrayView1<'_, f64>) -> (f64, f64) {
    a.iter().zip(b).fold((0.0, 0.0), |(sum, magnitude), (x, y)| (sum + x * y, magnitude + (x * y).abs()))
}

/// Verifies a candidate's outputs on `problem` (module docs).
pub fn verify_indexer_loss<T: Storage>(
    problem: &LossProblem<T>,
    run: &LossOutput,
) -> Result<LossVerdict, HarnessError> {
    let shape = problem.shape();
    let ix = shape.indexer;
    let (seq_len, n_index, index_dim, top_k) = (ix.seq_len, ix.n_index_heads, ix.index_dim, ix.top_k);
    let wide3 = |x: &Array3<T>| x.mapv(|v| f64::from(v.to_f32()));
    let (qi, q, k) = (wide3(&problem.q_index), wide3(&problem.query), wide3(&problem.key));
    let ki = problem.k_index.mapv(|v| f64::from(v.to_f32()));
    let w = problem.weights.mapv(f64::from);
    let lse = problem.lse.mapv(f64::from);
    let scale = f64::from(problem.scale);
    let expect = |argument, actual: &[usize], expected: &[usize]| {
        if actual == expected {
            Ok(())
        } else {
            Err(HarnessError::CandidateShape { argument, expected: expected.to_vec(), actual: actual.to_vec() })
        }
    };
    expect("student", run.student.shape(), &[seq_len, top_k])?;
    expect("teacher", run.teacher.shape(), &[seq_len, top_k])?;
    expect("kl", run.kl.shape(), &[seq_len])?;
    expect("student_lse", run.student_lse.shape(), &[seq_len])?;
    expect("d_q_index", run.d_q_index.shape(), &[seq_len, n_index, index_dim])?;
    expect("d_weights", run.d_weights.shape(), &[seq_len, n_index])?;
    expect("d_k_index", run.d_k_index.shape(), &[seq_len, index_dim])?;
    let mut verdict = LossVerdict { rows: seq_len, ..LossVerdict::default() };
    if seq_len == 0 {
        return Ok(verdict);
    }
    let lists: Vec<Vec<usize>> = problem
        .lists
        .outer_iter()
        .map(|row| row.iter().take_while(|&&s| s >= 0).map(|&s| s as usize).collect())
        .collect();
    let inputs = IndexerInputs { q_index: qi.view(), weights: w.view(), k_index: ki.view() };
    let scores = indexer_scores(inputs, ())?;
    // The teacher from its definition, and each entry's bound.
    let (n_heads, group) = (shape.n_heads, shape.n_heads / shape.n_heads_kv);
    let head_dim_pad = shape.head_dim.div_ceil(16) * 16;
    let mut teacher = Array2::<f64>::zeros((seq_len, seq_len));
    let mut teacher_error = Array2::<f64>::zeros((seq_len, seq_len));
    for (t, list) in lists.iter().enumerate() {
        for &s in list {
            let mut sum = 0.0;
            let mut worst_exponent: f64 = 0.0;
            for h in 0..n_heads {
                let (logit, magnitude) = dot(
                    q.index_axis(Axis(0), t).index_axis_move(Axis(0), h),
                    k.index_axis(Axis(0), s).index_axis_move(Axis(0), h / group),
                );
                let logit_error = INDEXER_ACCUMULATION.gamma(head_dim_pad) * magnitude;
                sum += (scale * logit - lse[[h, t]]).exp();
                worst_exponent = worst_exponent.max(teacher_exponent_error(scale, logit, lse[[h, t]], logit_error));
            }
            teacher[[t, s]] = sum;
            teacher_error[[t, s]] = teacher_entry_error(sum, worst_exponent, n_heads);
        }
    }
    let (loss, grads) =
        indexer_loss_and_gradients(inputs, teacher.view(), LossSupport::Selected(problem.lists.view()), ())?;
    let factor = REFERENCE_FACTOR;
    // Per row: the outputs in slot order, and ∂ and its bound per key for the gradients.
    let mut d_score = Array2::<f64>::zeros((seq_len, seq_len));
    let mut d_score_error = Array2::<f64>::zeros((seq_len, seq_len));
    for (t, list) in lists.iter().enumerate() {
        let score_error = |s: usize| {
            let magnitude: f64 = (0..n_index)
                .map(|a| w[[t, a]].abs() * dot(qi.index_axis(Axis(0), t).index_axis_move(Axis(0), a), ki.row(s)).1)
                .sum();
            indexer_score_bound(magnitude, index_dim, n_index) + gamma(index_dim + n_index + 2) * magnitude
        };
        let slots: Vec<SlotExact> = list
            .iter()
            .map(|&s| SlotExact {
                score: scores[[t, s]],
                score_error: score_error(s),
                teacher: teacher[[t, s]],
                teacher_error: teacher_error[[t, s]],
            })
            .collect();
        for (slot, exact) in slots.iter().enumerate() {
            let at = || format!("student [{t}, slot {slot}]");
            verdict.check(at, f64::from(run.student[[t, slot]]), exact.score, factor * exact.score_error);
        }
        for slot in list.len()..top_k {
            for (name, row) in [("student", &run.student), ("teacher", &run.teacher)] {
                if row[[t, slot]] != 0.0 {
                    verdict
                        .failures
                        .push(format!("{name} [{t}, slot {slot}] past the list's end is {}", row[[t, slot]]));
                    verdict.worst_ratio = f64::INFINITY;
                }
            }
        }
        match loss_row_bounds(&slots) {
            None => {
                if run.kl[t] != 0.0 || run.student_lse[t] != f32::INFINITY {
                    verdict.failures.push(format!(
                        "row {t} has no target, yet KL = {} and lse = {} (0 and +inf expected)",
                        run.kl[t], run.student_lse[t]
                    ));
                    verdict.worst_ratio = f64::INFINITY;
                }
                for slot in 0..list.len() {
                    verdict.check(
                        || format!("teacher [{t}, slot {slot}]"),
                        f64::from(run.teacher[[t, slot]]),
                        0.0,
                        0.0,
                    );
                }
            }
            Some(row) => {
                verdict.active_rows += 1;
                for slot in 0..list.len() {
                    let at = || format!("teacher [{t}, slot {slot}]");
                    let bound = factor * row.teacher_error[slot];
                    verdict.check(at, f64::from(run.teacher[[t, slot]]), row.teacher[slot], bound);
                    d_score[[t, list[slot]]] = row.d_score[slot];
                    d_score_error[[t, list[slot]]] = row.d_score_error[slot];
                }
                let lse_at = || format!("student_lse [{t}]");
                verdict.check(lse_at, f64::from(run.student_lse[t]), row.lse, factor * row.lse_error);
                let kl_at = || format!("kl [{t}]");
                verdict.check(kl_at, f64::from(run.kl[t]), loss.per_query[t], factor * row.kl_error);
            }
        }
    }
    // The gradients.
    let logit_gamma = INDEXER_ACCUMULATION.gamma(index_dim);
    let logits = |t: usize, a: usize, s: usize| {
        let (l, magnitude) = dot(qi.index_axis(Axis(0), t).index_axis_move(Axis(0), a), ki.row(s));
        (l, logit_gamma * magnitude * factor)
    };
    let mut listing = vec![0usize; seq_len];
    for list in &lists {
        for &s in list {
            listing[s] += 1;
        }
    }
    for (t, list) in lists.iter().enumerate() {
        for a in 0..n_index {
            let row_logits: Vec<(f64, f64)> = list.iter().map(|&s| logits(t, a, s)).collect();
            let relu_terms =
                list.iter().zip(&row_logits).map(|(&s, &(l, e))| (d_score[[t, s]], d_score_error[[t, s]], l, e));
            let bound = factor * relu_sum_bound(relu_terms, list.len());
            let at = || format!("d_weights [{t}, {a}]");
            verdict.check(at, f64::from(run.d_weights[[t, a]]), grads.d_weights[[t, a]], bound);
            for c in 0..index_dim {
                let terms = list.iter().zip(&row_logits).map(|(&s, &(logit, logit_error))| GatedTerm {
                    d_score: d_score[[t, s]],
                    d_score_error: d_score_error[[t, s]],
                    weight: w[[t, a]],
                    logit,
                    logit_error,
                    value: ki[[s, c]],
                });
                let bound = factor * gated_sum_bound(terms, list.len());
                let at = || format!("d_q_index [{t}, {a}, {c}]");
                verdict.check(at, f64::from(run.d_q_index[[t, a, c]]), grads.d_q_index[[t, a, c]], bound);
            }
        }
    }
    // ∂k^I: every (token, head) whose list names the key.
    let mut naming: Vec<Vec<usize>> = vec![vec![]; seq_len];
    for (t, list) in lists.iter().enumerate() {
        for &s in list {
            naming[s].push(t);
        }
    }
    for (s, tokens) in naming.iter().enumerate() {
        let pairs: Vec<(usize, usize, f64, f64)> = tokens
            .iter()
            .flat_map(|&t| (0..n_index).map(move |a| (t, a)))
            .map(|(t, a)| {
                let (l, e) = logits(t, a, s);
                (t, a, l, e)
            })
            .collect();
        for c in 0..index_dim {
            let terms = pairs.iter().map(|&(t, a, logit, logit_error)| GatedTerm {
                d_score: d_score[[t, s]],
                d_score_error: d_score_error[[t, s]],
                weight: w[[t, a]],
                logit,
                logit_error,
                value: qi[[t, a, c]],
            });
            let bound = factor * gated_sum_bound(terms, n_index + listing[s]);
            let at = || format!("d_k_index [{s}, {c}]");
            verdict.check(at, f64::from(run.d_k_index[[s, c]]), grads.d_k_index[[s, c]], bound);
        }
    }
    Ok(verdict)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::gaussian;
    use half::bf16;

    /// A small problem: 40 tokens, 3 indexer heads of 64, 4 query heads over 2 KV heads of 16, lists of up to 24 of
    /// every third visible token, the sparse forward's LSE.
    fn problem() -> LossProblem<bf16> {
        let (t, hi, di, h, hkv, d, k) = (40, 3, 64, 4, 2, 16, 24);
        let g = |salt: u64, n: usize| gaussian(salt, n);
        let b = |x: f64| bf16::from_f64(x);
        let (gq, gk, gw) = (g(1, t * hi * di), g(2, t * di), g(3, t * hi));
        let (gmq, gmk) = (g(4, t * h * d), g(5, t * hkv * d));
        let q_index = Array3::from_shape_fn((t, hi, di), |(i, a, c)| b(gq[(i * hi + a) * di + c]));
        let k_index = Array2::from_shape_fn((t, di), |(i, c)| b(gk[i * di + c]));
        let weights = Array2::from_shape_fn((t, hi), |(i, a)| gw[i * hi + a] as f32);
        let query = Array3::from_shape_fn((t, h, d), |(i, a, c)| b(gmq[(i * h + a) * d + c]));
        let key = Array3::from_shape_fn((t, hkv, d), |(i, a, c)| b(gmk[(i * hkv + a) * d + c]));
        let lists = Array2::from_shape_fn((t, k), |(i, slot)| {
            let s = 3 * slot + i % 3;
            if s <= i { s as i32 } else { -1 }
        });
        let scale = 0.25f32;
        let lse = Array2::from_shape_fn((h, t), |(a, i)| {
            let z: Vec<f64> = lists
                .row(i)
                .iter()
                .take_while(|&&s| s >= 0)
                .map(|&s| {
                    let s = s as usize;
                    (0..d).map(|c| query[[i, a, c]].to_f64() * key[[s, a / 2, c]].to_f64()).sum::<f64>() * 0.25
                })
                .collect();
            if z.is_empty() { 0.0 } else { z.iter().map(|x| x.exp()).sum::<f64>().ln() as f32 }
        });
        LossProblem { q_index, k_index, weights, lists, query, key, lse, scale }
    }

    /// The kernels' recipe in f32 on the CPU, with sums in index order: what a correct kernel may return.
    fn emulate(p: &LossProblem<bf16>, renormalize: bool) -> LossOutput {
        let shape = p.shape();
        let (t_len, hi, di, k) =
            (shape.indexer.seq_len, shape.indexer.n_index_heads, shape.indexer.index_dim, p.lists.ncols());
        let (h, group, d) = (shape.n_heads, shape.n_heads / shape.n_heads_kv, shape.head_dim);
        let f = |x: bf16| x.to_f32();
        let logit = |t: usize, a: usize, s: usize| {
            (0..di).fold(0f32, |acc, c| acc + f(p.q_index[[t, a, c]]) * f(p.k_index[[s, c]]))
        };
        let mut run = LossOutput {
            student: Array2::zeros((t_len, k)),
            teacher: Array2::zeros((t_len, k)),
            kl: ndarray::Array1::zeros(t_len),
            student_lse: ndarray::Array1::zeros(t_len),
            d_q_index: Array3::zeros((t_len, hi, di)),
            d_weights: Array2::zeros((t_len, hi)),
            d_k_index: Array2::zeros((t_len, di)),
        };
        for t in 0..t_len {
            let list: Vec<usize> = p.lists.row(t).iter().take_while(|&&s| s >= 0).map(|&s| s as usize).collect();
            for (slot, &s) in list.iter().enumerate() {
                run.student[[t, slot]] = (0..hi).fold(0f32, |acc, a| acc + p.weights[[t, a]] * logit(t, a, s).max(0.0));
                run.teacher[[t, slot]] = (0..h).fold(0f32, |acc, head| {
                    let z = (0..d).fold(0f32, |z, c| z + f(p.query[[t, head, c]]) * f(p.key[[s, head / group, c]]));
                    acc + z.mul_add(p.scale, -p.lse[[head, t]]).exp()
                });
            }
            let n = list.len();
            let mass: f32 = (0..n).map(|i| run.teacher[[t, i]]).sum();
            let top = (0..n).map(|i| run.student[[t, i]]).fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = (0..n).map(|i| (run.student[[t, i]] - top).exp()).sum();
            let lse = if n > 0 && mass > 0.0 { top + z.ln() } else { f32::INFINITY };
            run.student_lse[t] = lse;
            let mut kl = 0f32;
            for i in 0..n {
                let tau = if renormalize { run.teacher[[t, i]] / mass } else { run.teacher[[t, i]] };
                run.teacher[[t, i]] = tau;
                if tau > 0.0 {
                    kl += tau * ((tau.ln() - run.student[[t, i]]) + lse);
                }
            }
            run.kl[t] = kl;
            for (i, &s) in list.iter().enumerate() {
                let ds = (run.student[[t, i]] - lse).exp() - run.teacher[[t, i]];
                for a in 0..hi {
                    let l = logit(t, a, s);
                    if l > 0.0 {
                        run.d_weights[[t, a]] += ds * l;
                        let gate = ds * p.weights[[t, a]];
                        for c in 0..di {
                            run.d_q_index[[t, a, c]] += gate * f(p.k_index[[s, c]]);
                            run.d_k_index[[s, c]] += gate * f(p.q_index[[t, a, c]]);
                        }
                    }
                }
            }
        }
        run
    }

    #[test]
    fn the_recipe_in_f32_passes_and_a_broken_one_fails() {
        let p = problem();
        let verdict = verify_indexer_loss(&p, &emulate(&p, true)).unwrap();
        assert!(verdict.passed(), "{:?}", verdict.failures);
        assert_eq!((verdict.rows, verdict.active_rows), (40, 40));
        assert!(verdict.worst_ratio > 1e-4, "the bounds are not vacuous: {}", verdict.worst_ratio);
        let broken = verify_indexer_loss(&p, &emulate(&p, false)).unwrap();
        assert!(!broken.passed(), "a teacher left unnormalized passed");
    }

    #[test]
    fn each_output_is_checked() {
        let p = problem();
        let good = emulate(&p, true);
        let fails = |change: &dyn Fn(&mut LossOutput)| {
            let mut run = good.clone();
            change(&mut run);
            !verify_indexer_loss(&p, &run).unwrap().passed()
        };
        assert!(fails(&|r| r.student[[7, 1]] *= 1.001));
        assert!(fails(&|r| r.teacher[[7, 1]] *= 1.001));
        // The scores' bound (the indexer's, about 1e-3 here) dominates the KL's and the LSE's.
        assert!(fails(&|r| r.kl[9] += 1e-2));
        assert!(fails(&|r| r.student_lse[9] += 1e-2));
        // The gradients' bounds carry ∂'s, which carries the scores'.
        assert!(fails(&|r| r.d_q_index[[9, 1, 3]] += 0.5));
        assert!(fails(&|r| r.d_weights[[9, 2]] += 0.5));
        assert!(fails(&|r| r.d_k_index[[3, 5]] += 0.5));
        // A slot past a list's end must be 0; a NaN anywhere fails.
        assert!(fails(&|r| r.student[[0, 5]] = 1e-30));
        assert!(fails(&|r| r.d_q_index[[0, 0, 0]] = f32::NAN));
    }
}
