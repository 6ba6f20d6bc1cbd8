//! Verifying HiLS's factorized output (`attnproof_gpu::hils::hils_forward`, E21) against the oracle's
//! `hils::factorized_output` over the kernel's own lists.
//!
//! Row `i` of a head is a weighted average over its terms `t`: the local window's keys (log-weight `s_ij = α q_i·k_j`,
//! value `v_j`) and the retrieved chunks (log-weight `r_ib` or `f_b(q_i)`, value `ō_ib`). The kernel and the oracle
//! both evaluate it in f64 from the same exact inputs, in different orders, so the candidate is held to the oracle
//! within the sum of two f64 evaluation bounds (each side against the exact value of the oracle's formula) and the
//! final roundings (O to the storage type, the LSE to f32). The router's scores come from the device's summaries,
//! which `crate::hils_routing` holds within its tolerances; that is this bound's hypothesis, so a test of the forward
//! judges both.
//!
//! **The weighted-average lemma.** Let `o = Σ w_t x_t / Σ w_t` and a computation whose numerator and denominator
//! weights are `w_t(1 + a_t)` and `w_t(1 + b_t)` with `|a_t|, |b_t| ≤ η`, values `x̂_t` within `ξ` of `x_t`, then one
//! division (`u = 2^-53`). Since `Σ w_t (x_t − o) = 0`, the error is at most
//! `(η R + 2η |o| + (1 + η) ξ) / (1 − η) + u (X + ξ)` with `R = max |x_t − o| ≤ 2X`, `X = max |x_t|`. Weights that
//! underflow f64 on one side only (below `2^-1022` of the largest, which is 1) move the average by less than
//! `2^-1021 X` each, far below a second `u X` for any number of keys below `2^960`: so
//! `E(η, X, ξ) = (4η X + (1 + η) ξ) / (1 − η) + 2u (X + ξ)`.
//!
//! **The weights.** A weight leaves the online softmax as `e^{ℓ̂_t − M̂}` times the rescalings it went through; in
//! exact arithmetic of the computed maxima the rescalings telescope, so relative to the common `e^{−M̂}` a weight's
//! log is off by its log-weight's error `ε_t` plus, per `exp` on its path (at most `n`: one per 32-key group of the
//! set and per merged chunk, plus one), the argument's subtraction (`u · 2Λ`, `Λ` the largest `|log-weight|`); each
//! `exp` (≤ 2u relative, CUDA's and libm's double `exp` within one ulp) and each rescaling product adds `3u`. The
//! sums (the kernel's warp trees and running sums, the oracle's sequential sums) add `γ_N`, `N = terms + 7n + 8`.
//! Hence `η = e^{x} (1 + γ_{3n}) (1 + γ_N) − 1 ≤ (e^x − 1) + γ_{N+3n} e^x`, `x = max ε_t + 2uΛn`.
//!
//! **The pieces.** Scores: `ε_s = γ_{d+2} S`, `S = max_j α Σ_c |q_ic k_jc|` over the row's keys (local and retrieved).
//! A chunk's average `ō_ib` (its keys exact values, `n = ⌈C/32⌉ + 1`): within `ξ_b = E(η_b, X_b, 0)` per column. Its
//! exact log-mass `f_b = m + ln l`: within `ε_f = −ln(1 − η_b) + γ_3 (|f_b| + ln C + 1)`. The router score: the
//! device's within `crate::hils_routing`'s score tolerance of the oracle's, which this verifier takes as exact (so the
//! oracle's side has `ε = 0` there). The row (`n = ⌈W/32⌉ + K + 1`, `W` the window's keys): `E(η, X, max_b ξ_b)` per
//! column on each side, then O's rounding `u_T (|o| + E) + τ/2`. The LSE `M + ln L`: `−ln(1 − η) + γ_3 (|lse| +
//! ln(W + K) + 1)` per side, then f32's `u_32 (|lse| + E)`.

use attnproof_oracle::hils::{
    ChunkMass, HilsConfig, chunk_keys, chunk_log_mass, factorized_output, local_window_start, router_score,
};
use attnproof_proofs::f64_oracle_bound::gamma;
use attnproof_reference::Element;
use ndarray::{ArrayD, ArrayView4, ArrayViewD, Axis, IxDyn, Slice};

use crate::flash::{Case, HarnessError};
use crate::hils_routing::{HeadSummaries, head_inputs, head_summaries, score_tolerance};
use crate::recipes::subnormal_of;
use crate::verdict::{OutputVerdict, compare, lse_row, output_row};

/// f64's unit roundoff.
const U: f64 = f64::EPSILON / 2.0;

/// What [`verify_hils_output`] found.
#[derive(Clone, Debug)]
pub struct HilsOutputVerdict {
    /// O against the oracle's.
    pub o: OutputVerdict,
    /// The LSE against the oracle's.
    pub lse: OutputVerdict,
    /// Query rows with at least one retrieved chunk.
    pub retrieved_rows: usize,
}

impl HilsOutputVerdict {
    /// O and the LSE within their bounds.
    pub fn passed(&self) -> bool {
        self.o.passed() && self.lse.passed()
    }
}

/// The oracle's outputs over given lists, with each element's bound, laid out as the kernel's.
#[derive(Clone, Debug)]
pub struct HilsOutputTargets {
    /// O.
    pub o: ArrayD<f64>,
    /// O's bounds.
    pub o_bound: ArrayD<f64>,
    /// The LSE.
    pub lse: ArrayD<f64>,
    /// The LSE's bounds.
    pub lse_bound: ArrayD<f64>,
    /// Query rows with at least one retrieved chunk.
    pub retrieved_rows: usize,
}

/// `E(η, X, ξ)` of the module docs: how far a computed weighted average lies from the exact one.
fn average_error(eta: f64, x: f64, xi: f64) -> f64 {
    (4.0 * eta * x + (1.0 + eta) * xi) / (1.0 - eta) + 2.0 * U * (x + xi)
}

/// `η` of the module docs for a set of `terms` weights whose log-weights err by at most `eps`, with `exps` exps on a
/// weight's path and `|log-weight| ≤ lambda`: `(e^x − 1) + γ_{N + 3n} e^x`, `x = eps + 2uΛn`, the bound
/// `(1 + γ_{3n})(1 + γ_N) ≤ 1 + γ_{N+3n}` folded in. `e^x − 1` comes from `exp_m1`, so that `η`, of the order of `u`,
/// keeps its relative precision (`e^x` rounds near 1); the result is raised by `2^-40` to cover its own roundings.
fn weight_error(eps: f64, lambda: f64, exps: usize, terms: usize) -> f64 {
    let x = eps + 2.0 * U * lambda * exps as f64;
    (x.exp_m1() + gamma(terms + 10 * exps + 8) * x.exp()) * (1.0 + 2f64.powi(-40))
}

/// One head's inputs and summaries, from which [`RowModel`]s are formed.
struct HeadModel<'a> {
    inputs: attnproof_oracle::hils::HilsInputs<'a, f64>,
    summaries: &'a [attnproof_oracle::hils::ChunkSummary<f64>],
    tolerances: &'a [(Vec<f64>, f64)],
    scale: f64,
    config: HilsConfig,
    mass: ChunkMass,
}

/// What one row's bounds are made of (module docs): `η` of the kernel's evaluation and of the oracle's, per value
/// column `X` and `max_b ξ_b`, and the weights summed (the LSE's `ln` term).
#[derive(Clone, Debug, PartialEq)]
struct RowModel {
    eta: (f64, f64),
    x: Vec<f64>,
    xi: Vec<f64>,
    terms: usize,
}

impl RowModel {
    /// O's bound at column `c` around the oracle's `o`: both f64 evaluations, then the rounding to a storage type of
    /// unit roundoff `u` and smallest subnormal `tau`.
    fn o_bound(&self, c: usize, o: f64, (u, tau): (f64, f64)) -> f64 {
        let (x, xi) = (self.x[c], self.xi[c]);
        let e = average_error(self.eta.0, x, xi) + average_error(self.eta.1, x, xi);
        e + u * (o.abs() + e) + tau / 2.0
    }

    /// The LSE's bound around the oracle's `lse`: both evaluations, then f32's rounding (`u32`).
    fn lse_bound(&self, lse: f64, u32_: f64) -> f64 {
        let side = |eta: f64| -(1.0 - eta).ln() + gamma(3) * (lse.abs() + (self.terms as f64).ln() + 1.0);
        let e = side(self.eta.0) + side(self.eta.1);
        e + u32_ * (lse.abs() + e)
    }
}

impl HeadModel<'_> {
    /// The model of row `i` retrieving `chunks`.
    fn row(&self, i: usize, chunks: &[usize]) -> Result<RowModel, HarnessError> {
        let (q, k, v) = (self.inputs.query, self.inputs.key, self.inputs.value);
        let (n, d, dv, scale) = (k.nrows(), q.ncols(), v.ncols(), self.scale);
        let reach = |j: usize| scale * (0..d).map(|c| (q[[i, c]] * k[[j, c]]).abs()).sum::<f64>();
        let start = local_window_start(i, self.config);
        let chunk_ranges: Vec<_> = chunks.iter().map(|&b| chunk_keys(b, n, self.config)).collect();
        let s_max = (start..=i).chain(chunk_ranges.iter().flat_map(|r| r.clone())).map(reach).fold(0f64, f64::max);
        let eps_s = gamma(d + 2) * s_max;
        // Per chunk: its log-mass, the log-weight errors on each side, its average's error per column.
        let mut logs = Vec::with_capacity(chunks.len());
        let (mut eps_device, mut eps_oracle) = (eps_s, eps_s);
        let mut xi = vec![0f64; dv];
        let mut x: Vec<f64> = (0..dv).map(|c| (start..=i).map(|j| v[[j, c]].abs()).fold(0f64, f64::max)).collect();
        for (&b, range) in chunks.iter().zip(&chunk_ranges) {
            let f_b = chunk_log_mass(q.row(i), k.slice_axis(Axis(0), Slice::from(range.clone())), ())?;
            let exps = range.len().div_ceil(32) + 1;
            let eta_b = weight_error(eps_s, s_max + eps_s, exps, range.len());
            let eps_f = -(1.0 - eta_b).ln() + gamma(3) * (f_b.abs() + (range.len() as f64).ln() + 1.0);
            for c in 0..dv {
                let x_b = range.clone().map(|j| v[[j, c]].abs()).fold(0f64, f64::max);
                xi[c] = xi[c].max(average_error(eta_b, x_b, 0.0));
                x[c] = x[c].max(x_b);
            }
            match self.mass {
                ChunkMass::Exact => {
                    logs.push(f_b);
                    eps_device = eps_device.max(eps_f);
                    eps_oracle = eps_oracle.max(eps_f);
                }
                ChunkMass::Surrogate => {
                    logs.push(router_score(q.row(i), &self.summaries[b], ())?);
                    let tolerance = score_tolerance(q.row(i), &self.summaries[b], &self.tolerances[b], scale);
                    eps_device = eps_device.max(tolerance);
                }
            }
        }
        // `Λ` bounds the computed log-weights as well as the exact ones.
        let lambda = logs.iter().fold(s_max, |m, l| m.max(l.abs())) + eps_device.max(eps_oracle);
        let window = i + 1 - start;
        let (exps, terms) = (window.div_ceil(32) + chunks.len() + 1, window + chunks.len());
        let eta = (weight_error(eps_device, lambda, exps, terms), weight_error(eps_oracle, lambda, exps, terms));
        Ok(RowModel { eta, x, xi, terms })
    }
}

/// The targets of HiLS's forward for `case` (causal self-attention), `landmarks` `[B, Hq, n_c, d]`, `config`, the
/// chunks weighed by `mass`, over the kernel's `lists` `[B, Hq, max_len, K]`. See the module docs.
pub fn hils_output_targets<T: Element>(
    case: &Case<T>,
    landmarks: ArrayView4<'_, T>,
    config: HilsConfig,
    mass: ChunkMass,
    lists: ArrayView4<'_, i32>,
) -> Result<HilsOutputTargets, HarnessError> {
    let spec = &case.spec;
    let (d, dv) = (spec.head_dim, spec.head_dim_v);
    let scale = 1.0 / (d as f64).sqrt();
    let (u_t, tau, u32_) = (T::UNIT_ROUNDOFF, subnormal_of::<T>() as f64, f64::from(f32::EPSILON) / 2.0);
    let o_shape = spec.expected_shape(attnproof_oracle::spec::Operand::O);
    let lse_shape = spec.expected_shape(attnproof_oracle::spec::Operand::RowStat);
    let mut t = HilsOutputTargets {
        o: ArrayD::zeros(IxDyn(&o_shape)),
        o_bound: ArrayD::zeros(IxDyn(&o_shape)),
        lse: ArrayD::zeros(IxDyn(&lse_shape)),
        lse_bound: ArrayD::zeros(IxDyn(&lse_shape)),
        retrieved_rows: 0,
    };
    let widened = case.widened();
    let landmarks: ArrayD<f64> = landmarks.mapv(|x| x.to_f32() as f64).into_dyn();
    // An empty sequence has no rows, and the oracle answers it with empty outputs.
    for seq in &spec.sequences() {
        let n = seq.len_q;
        for h in 0..spec.n_heads_q {
            let inputs = head_inputs(spec, seq, h, (&widened, &landmarks), config);
            let head_lists = lists
                .index_axis(Axis(0), seq.index)
                .index_axis_move(Axis(0), h)
                .slice_axis_move(Axis(0), Slice::from(0..n));
            let oracle = factorized_output(inputs, head_lists, config, mass, ())?;
            let HeadSummaries { oracle: summaries, tolerances } = head_summaries(inputs, config, scale)?;
            let head = HeadModel { inputs, summaries: &summaries, tolerances: &tolerances, scale, config, mass };
            for i in 0..n {
                let chunks: Vec<usize> = head_lists.row(i).iter().filter(|&&b| b >= 0).map(|&b| b as usize).collect();
                t.retrieved_rows += usize::from(!chunks.is_empty());
                let row = head.row(i, &chunks)?;
                let at = output_row(spec, seq, h, i);
                for c in 0..dv {
                    let o = oracle.o[[i, c]];
                    let coords: Vec<usize> = [at.as_slice(), &[c]].concat();
                    t.o[IxDyn(&coords)] = o;
                    t.o_bound[IxDyn(&coords)] = row.o_bound(c, o, (u_t, tau));
                }
                let lse = oracle.lse[i];
                let at = lse_row(spec, seq, h, i);
                t.lse[IxDyn(&at)] = lse;
                t.lse_bound[IxDyn(&at)] = row.lse_bound(lse, u32_);
            }
        }
    }
    Ok(t)
}

/// The verdict of candidate outputs (widened to f64) against `t`.
pub fn judge(t: &HilsOutputTargets, o: ArrayViewD<'_, f64>, lse: ArrayViewD<'_, f64>) -> HilsOutputVerdict {
    HilsOutputVerdict {
        o: compare("O", o, t.o.view(), t.o_bound.view()),
        lse: compare("LSE", lse, t.lse.view(), t.lse_bound.view()),
        retrieved_rows: t.retrieved_rows,
    }
}

/// Verifies a candidate `(O, LSE)` of HiLS's forward over the kernel's own `lists` against
/// [`hils_output_targets`].
pub fn verify_hils_output<T: Element>(
    case: &Case<T>,
    landmarks: ArrayView4<'_, T>,
    config: HilsConfig,
    mass: ChunkMass,
    lists: ArrayView4<'_, i32>,
    (o, lse): (ArrayViewD<'_, T>, ArrayViewD<'_, f32>),
) -> Result<HilsOutputVerdict, HarnessError> {
    let spec = &case.spec;
    for (argument, op, shape) in [
        ("o", attnproof_oracle::spec::Operand::O, o.shape()),
        ("lse", attnproof_oracle::spec::Operand::RowStat, lse.shape()),
    ] {
        let expected = spec.expected_shape(op);
        if shape != expected.as_slice() {
            return Err(HarnessError::CandidateShape { argument, expected, actual: shape.to_vec() });
        }
    }
    let t = hils_output_targets(case, landmarks, config, mass, lists)?;
    Ok(judge(&t, o.mapv(|x| x.to_f32() as f64).view(), lse.mapv(f64::from).view()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{ValueProfile, make_case};
    use crate::hils_routing::{first_query_landmarks, oracle_routing};
    use attnproof_oracle::spec::Operand;
    use attnproof_oracle::{AttentionSpec, Mask};
    use half::bf16;
    use ndarray::Array4;

    /// Two sequences over two KV heads with a GQA group of 2, chunks of 16, a window of 24 and 3 chunks per row: the
    /// oracle's routing gives the lists.
    fn setup(seed: u64) -> (Case<bf16>, Array4<bf16>, HilsConfig, Array4<i32>) {
        let spec = AttentionSpec::dense(2, 4, 2, 150, 150, 16, 8).with_mask(Mask::Causal);
        let case = make_case::<bf16>(&spec, ValueProfile::GAUSSIAN, seed);
        let config = HilsConfig { chunk_size: 16, local_window: 24, retrieved_chunks: 3 };
        let landmarks = first_query_landmarks(&case, config);
        let (_, lists, _) = oracle_routing(&case, landmarks.view(), config).unwrap();
        (case, landmarks, config, lists)
    }

    fn rounded(t: &HilsOutputTargets) -> (ArrayD<f64>, ArrayD<f64>) {
        (t.o.mapv(|x| bf16::from_f64(x).to_f64()), t.lse.mapv(|x| x as f32 as f64))
    }

    /// The oracle's outputs rounded as the kernel rounds them pass under both masses; O moved by twice its bound at
    /// its loosest element fails, and so does the LSE moved likewise.
    #[test]
    fn the_rounded_oracle_passes_and_perturbations_fail() {
        let (case, landmarks, config, lists) = setup(3);
        for mass in [ChunkMass::Surrogate, ChunkMass::Exact] {
            let t = hils_output_targets(&case, landmarks.view(), config, mass, lists.view()).unwrap();
            let listed = lists.lanes(Axis(3)).into_iter().filter(|row| row[0] >= 0).count();
            assert!(t.retrieved_rows == listed && listed > 0, "{} against {listed}", t.retrieved_rows);
            let (o, lse) = rounded(&t);
            let v = judge(&t, o.view(), lse.view());
            assert!(v.passed(), "{mass:?}: {v:?}");
            let mut moved = o.clone();
            let worst = t.o_bound.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
            moved.as_slice_mut().unwrap()[worst] += 2.0 * t.o_bound.as_slice().unwrap()[worst];
            let v = judge(&t, moved.view(), lse.view());
            assert!(!v.o.passed() && v.lse.passed() && !v.passed(), "{mass:?}");
            let mut moved = lse.clone();
            let worst = t.lse_bound.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
            moved.as_slice_mut().unwrap()[worst] += 2.0 * t.lse_bound.as_slice().unwrap()[worst];
            let v = judge(&t, o.view(), moved.view());
            assert!(v.o.passed() && !v.lse.passed() && !v.passed(), "{mass:?}");
        }
    }

    /// The f64 evaluations add almost nothing: every O bound is the storage rounding `u_T |o| + τ/2` plus less than
    /// `2^-30` of the row's largest value, and every LSE bound f32's rounding plus less than `2^-30 (|lse| + 1)`; the
    /// bounds of a row with a tenfold value are at least those of the original.
    #[test]
    fn the_bound_is_the_rounding_plus_a_small_f64_term() {
        let (case, landmarks, config, lists) = setup(11);
        let x = case.v.iter().fold(0f64, |m, v| m.max(v.to_f64().abs()));
        let (u, tau) = (bf16::UNIT_ROUNDOFF, f64::from(subnormal_of::<bf16>()));
        let u32_ = f64::from(f32::EPSILON) / 2.0;
        for mass in [ChunkMass::Surrogate, ChunkMass::Exact] {
            let t = hils_output_targets(&case, landmarks.view(), config, mass, lists.view()).unwrap();
            for (o, b) in t.o.iter().zip(&t.o_bound) {
                let rounding = u * o.abs() + tau / 2.0;
                assert!(*b >= rounding && *b - rounding < 2f64.powi(-30) * x, "{mass:?}: {o} {b}");
            }
            for (l, b) in t.lse.iter().zip(&t.lse_bound) {
                let rounding = u32_ * l.abs();
                assert!(*b >= rounding && *b - rounding < 2f64.powi(-30) * (l.abs() + 1.0), "{mass:?}: {l} {b}");
            }
            let mut louder = case.clone();
            louder.v.mapv_inplace(|v| bf16::from_f32(10.0 * v.to_f32()));
            let t10 = hils_output_targets(&louder, landmarks.view(), config, mass, lists.view()).unwrap();
            let f64_part = |t: &HilsOutputTargets| {
                t.o.iter().zip(&t.o_bound).map(|(o, b)| b - u * o.abs() - tau / 2.0).fold(0f64, f64::max)
            };
            assert!(f64_part(&t10) > f64_part(&t), "{mass:?}: the f64 term grows with the values");
        }
    }

    /// The targets bound each element by its row's model, formed with the scale `1/√d` over the head's own inputs,
    /// summaries, lists and mass (here the last row of sequence 1, query head 3, which reads KV head 1).
    #[test]
    fn the_targets_bound_each_element_by_its_rows_model() {
        let (case, landmarks, config, lists) = setup(13);
        let spec = &case.spec;
        let (u, tau) = (bf16::UNIT_ROUNDOFF, f64::from(subnormal_of::<bf16>()));
        let u32_ = f64::from(f32::EPSILON) / 2.0;
        let widened = case.widened();
        let landmarks_f64: ArrayD<f64> = landmarks.mapv(|x| x.to_f32() as f64).into_dyn();
        let seq = &spec.sequences()[1];
        let inputs = head_inputs(spec, seq, 3, (&widened, &landmarks_f64), config);
        let scale = 1.0 / 4.0;
        let HeadSummaries { oracle: summaries, tolerances } = head_summaries(inputs, config, scale).unwrap();
        let i = 149;
        let chunks: Vec<usize> =
            (0..config.retrieved_chunks).map(|w| lists[[1, 3, i, w]]).filter(|&b| b >= 0).map(|b| b as usize).collect();
        assert!(!chunks.is_empty());
        for mass in [ChunkMass::Surrogate, ChunkMass::Exact] {
            let t = hils_output_targets(&case, landmarks.view(), config, mass, lists.view()).unwrap();
            let head = HeadModel { inputs, summaries: &summaries, tolerances: &tolerances, scale, config, mass };
            let row = head.row(i, &chunks).unwrap();
            for c in 0..spec.head_dim_v {
                let o = t.o[[1, 3, i, c]];
                assert_eq!(t.o_bound[[1, 3, i, c]], row.o_bound(c, o, (u, tau)), "{mass:?} column {c}");
            }
            assert_eq!(t.lse_bound[[1, 3, i]], row.lse_bound(t.lse[[1, 3, i]], u32_), "{mass:?}");
        }
    }

    /// The verdict tells the two masses apart (HiLS's surrogate `r_ib` is not the chunk's exact log-mass) and a dropped
    /// chunk: each of those outputs, rounded, fails.
    #[test]
    fn a_wrong_mass_or_a_dropped_chunk_fails() {
        let (case, landmarks, config, lists) = setup(5);
        let surrogate =
            hils_output_targets(&case, landmarks.view(), config, ChunkMass::Surrogate, lists.view()).unwrap();
        let exact = hils_output_targets(&case, landmarks.view(), config, ChunkMass::Exact, lists.view()).unwrap();
        let (o, lse) = rounded(&exact);
        assert!(!judge(&surrogate, o.view(), lse.view()).passed());
        let (o, lse) = rounded(&surrogate);
        assert!(!judge(&exact, o.view(), lse.view()).passed());
        let mut fewer = lists.clone();
        for mut row in fewer.lanes_mut(Axis(3)) {
            let last = row.iter().rposition(|&b| b >= 0);
            if let Some(slot) = last {
                row[slot] = -1;
            }
        }
        let dropped = hils_output_targets(&case, landmarks.view(), config, ChunkMass::Surrogate, fewer.view()).unwrap();
        let (o, lse) = rounded(&dropped);
        assert!(!judge(&surrogate, o.view(), lse.view()).passed());
    }

    /// Rows of a varlen batch land where the kernel writes them (O `[T, Hq, dv]`, the LSE `[Hq, T]`), an empty
    /// sequence and one shorter than a chunk retrieve nothing, and a list naming a chunk that is not before a row's
    /// window is an error, not a verdict.
    #[test]
    fn varlen_rows_and_bad_lists() {
        let spec = crate::adversarial::varlen(&[0, 70, 70, 75, 175], &[0, 70, 70, 75, 175], 3, 1, 8, 4, Mask::Causal);
        let case = make_case::<bf16>(&spec, ValueProfile::GAUSSIAN, 9);
        let config = HilsConfig { chunk_size: 8, local_window: 9, retrieved_chunks: 2 };
        let landmarks = first_query_landmarks(&case, config);
        let (_, lists, _) = oracle_routing(&case, landmarks.view(), config).unwrap();
        let t = hils_output_targets(&case, landmarks.view(), config, ChunkMass::Surrogate, lists.view()).unwrap();
        assert_eq!(t.o.shape(), [175, 3, 4]);
        assert_eq!(t.lse.shape(), [3, 175]);
        assert!(t.retrieved_rows > 0 && t.o_bound.iter().all(|b| *b > 0.0 && b.is_finite()));
        let (o, lse) = rounded(&t);
        assert!(judge(&t, o.view(), lse.view()).passed());
        let mut bad = lists.clone();
        bad[[3, 0, 20, 0]] = 2; // row 20's window starts at key 8: only chunk 0 is before it
        bad[[3, 0, 20, 1]] = -1;
        assert!(hils_output_targets(&case, landmarks.view(), config, ChunkMass::Surrogate, bad.view()).is_err());
    }

    /// The CPU schedule of the kernel (`attnproof_reference::sparse::hils`: groups of 32 keys, the warp's tree sums,
    /// f64 in the kernel's order) passes under both masses, with the oracle's summaries and lists: on the small
    /// setup, and over two KV heads with chunks of 64 and a window of 100 (six groups of the online softmax).
    #[test]
    fn the_reference_schedule_passes() {
        let long = {
            let spec = AttentionSpec::dense(1, 4, 2, 260, 260, 32, 40).with_mask(Mask::Causal);
            let profile = ValueProfile { logit_scale: 4.0, ..ValueProfile::GAUSSIAN };
            let case = make_case::<bf16>(&spec, profile, 55);
            let config = HilsConfig { chunk_size: 64, local_window: 100, retrieved_chunks: 3 };
            let landmarks = first_query_landmarks(&case, config);
            (case, landmarks, config)
        };
        let small = setup(7);
        for (case, landmarks, config) in [(small.0, small.1, small.2), long] {
            let (summaries, lists, _) = oracle_routing(&case, landmarks.view(), config).unwrap();
            for mass in [ChunkMass::Surrogate, ChunkMass::Exact] {
                let spec = &case.spec;
                let mut o = ArrayD::from_elem(IxDyn(&spec.expected_shape(Operand::O)), bf16::NAN);
                let mut lse = ArrayD::from_elem(IxDyn(&spec.expected_shape(Operand::RowStat)), f32::NAN);
                let out = attnproof_reference::ForwardOutputs { o: o.view_mut(), lse: lse.view_mut() };
                let lists_view = lists.view();
                attnproof_reference::sparse::hils::hils_forward(
                    spec,
                    &case.inputs(),
                    (config, mass),
                    summaries.view(),
                    lists_view,
                    out,
                )
                .unwrap();
                let v = verify_hils_output(&case, landmarks.view(), config, mass, lists_view, (o.view(), lse.view()))
                    .unwrap();
                assert!(v.passed() && v.retrieved_rows > 0, "{config:?} {mass:?}: {v:?}");
            }
        }
    }

    /// One row's model, term by term, on a head of six keys (`d = 3`, two value columns, chunks of 2, a window of 2):
    /// row 5 reads its window (keys 4 and 5) and chunk 1 (keys 2 and 3), where both the largest `|q·k|` (key 3) and
    /// the largest value of each column (key 2) lie; row 1 retrieves nothing. Then the bounds from a model.
    #[test]
    fn a_rows_model_is_assembled_from_its_window_and_chunks() {
        // d = 3 (so that no count of the bound's terms coincides with another formula's), the third query column 0.
        let q = ndarray::array![
            [0.5, -1.0, 0.0],
            [1.0, 0.5, 0.0],
            [0.0, 1.0, 0.0],
            [1.0, 1.0, 0.0],
            [-1.0, 0.5, 0.0],
            [1.0, 2.0, 0.0]
        ];
        let k = ndarray::array![
            [1.0, 0.0, 9.0],
            [0.5, 0.5, 9.0],
            [-1.0, 1.0, 9.0],
            [2.0, -3.0, 9.0],
            [0.5, 1.0, 9.0],
            [1.0, 0.25, 9.0]
        ];
        let v = ndarray::array![[1.0, -1.0], [0.5, 2.0], [-4.0, 8.0], [1.0, -2.0], [0.25, 0.5], [3.0, 1.0]];
        let landmarks = ndarray::array![[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]];
        let inputs = attnproof_oracle::hils::HilsInputs {
            query: q.view(),
            key: k.view(),
            value: v.view(),
            landmarks: landmarks.view(),
        };
        let config = HilsConfig { chunk_size: 2, local_window: 2, retrieved_chunks: 1 };
        let scale = 1.0 / 3f64.sqrt();
        let HeadSummaries { oracle: summaries, tolerances } = head_summaries(inputs, config, scale).unwrap();
        let head = |mass| HeadModel { inputs, summaries: &summaries, tolerances: &tolerances, scale, config, mass };
        // Row 5, q = (1, 2): |q·k| over keys 2..=5 is 3, 8, 2.5, 1.5; the largest is key 3's.
        let s_max = scale * 8.0;
        let eps_s = gamma(5) * s_max;
        let (s2, s3) = (scale * (-1.0 + 2.0), scale * (2.0 - 6.0));
        let f_b = chunk_log_mass(q.row(5), k.slice_axis(Axis(0), Slice::from(2..4)), ()).unwrap();
        assert!((f_b - (s2.exp() + s3.exp()).ln()).abs() < 1e-15);
        let eta_b = weight_error(eps_s, s_max + eps_s, 2, 2);
        let eps_f = -(1.0 - eta_b).ln() + gamma(3) * (f_b.abs() + 2f64.ln() + 1.0);
        let xi = vec![average_error(eta_b, 4.0, 0.0), average_error(eta_b, 8.0, 0.0)];
        let eps = eps_s.max(eps_f);
        let lambda = s_max.max(f_b.abs()) + eps;
        let eta = weight_error(eps, lambda, 3, 3);
        let expected = RowModel { eta: (eta, eta), x: vec![4.0, 8.0], xi: xi.clone(), terms: 3 };
        assert_eq!(head(ChunkMass::Exact).row(5, &[1]).unwrap(), expected);
        // The surrogate: the kernel's log-weight errs by the router score's tolerance, the oracle's does not.
        let r = router_score(q.row(5), &summaries[1], ()).unwrap();
        let tolerance = score_tolerance(q.row(5), &summaries[1], &tolerances[1], scale);
        let lambda = s_max.max(r.abs()) + eps_s.max(tolerance);
        let eta = (weight_error(eps_s.max(tolerance), lambda, 3, 3), weight_error(eps_s, lambda, 3, 3));
        let expected = RowModel { eta, x: vec![4.0, 8.0], xi, terms: 3 };
        assert_eq!(head(ChunkMass::Surrogate).row(5, &[1]).unwrap(), expected);
        // Row 1, q = (1, 0.5): its window is keys 0 and 1 (|q·k| 1 and 0.75), no chunk.
        let (s_max, eps_s) = (scale * 1.0, gamma(5) * scale * 1.0);
        let eta = weight_error(eps_s, s_max + eps_s, 2, 2);
        let expected = RowModel { eta: (eta, eta), x: vec![1.0, 2.0], xi: vec![0.0, 0.0], terms: 2 };
        assert_eq!(head(ChunkMass::Surrogate).row(1, &[]).unwrap(), expected);
        // The bounds of a model.
        let model = RowModel { eta: (0.01, 0.02), x: vec![2.0], xi: vec![0.5], terms: 4 };
        let (u, tau) = (1.0 / 256.0, 2f64.powi(-133));
        let e = average_error(0.01, 2.0, 0.5) + average_error(0.02, 2.0, 0.5);
        assert_eq!(model.o_bound(0, -1.5, (u, tau)), e + u * (1.5 + e) + tau / 2.0);
        let u32_ = f64::from(f32::EPSILON) / 2.0;
        let side = |eta: f64| -(1.0 - eta).ln() + gamma(3) * (3.0 + 4f64.ln() + 1.0);
        let e = side(0.01) + side(0.02);
        assert_eq!(model.lse_bound(-3.0, u32_), e + u32_ * (3.0 + e));
        // Nothing to err: O's bound is half the smallest subnormal, the LSE's the logarithm's rounding of one term.
        let exact = RowModel { eta: (0.0, 0.0), x: vec![0.0], xi: vec![0.0], terms: 1 };
        assert_eq!(exact.o_bound(0, 0.0, (u, tau)), tau / 2.0);
        let e = 2.0 * gamma(3);
        assert_eq!(exact.lse_bound(0.0, u32_), e + u32_ * e);
    }

    /// The lemma's and the weights' bounds, term by term.
    #[test]
    fn the_error_terms_are_the_derived_formulas() {
        assert_eq!(U, 2f64.powi(-53));
        assert_eq!(average_error(0.25, 2.0, 0.5), (4.0 * 0.25 * 2.0 + 1.25 * 0.5) / 0.75 + 2.0 * U * 2.5);
        assert_eq!(average_error(0.0, 3.0, 0.0), 2.0 * U * 3.0);
        // The division's terms carry the values' own error too: 1 + 2u(1 + 1).
        assert_eq!(average_error(0.0, 1.0, 1.0), 1.0 + 2f64.powi(-51));
        let eta = weight_error(1e-3, 10.0, 4, 20);
        let x = 1e-3 + 2.0 * U * 10.0 * 4.0;
        let expected = (x.exp_m1() + gamma(20 + 40 + 8) * x.exp()) * (1.0 + 2f64.powi(-40));
        assert_eq!(eta, expected);
        // At the size the bounds meet, `η` is `x + γ_{N+3n}` to a relative 2^-30 and above it; `e^x (1 + γ) − 1` in
        // f64 would lose about 1 % here.
        let small = weight_error(3e-15, 6.0, 3, 3);
        let first_order = (3e-15 + 36.0 * U) + gamma(3 + 30 + 8);
        assert!(small >= first_order && small <= first_order * (1.0 + 2f64.powi(-30)), "{small} {first_order}");
    }
}
