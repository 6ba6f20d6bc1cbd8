//! Verifying PISA's tail backward (`attnproof_gpu::pisa::tail_backward`) against the oracle's `pisa::tail_backward`:
//! the gradients of `L = Σ_i dO_i · o_i` for PISA's output with every row's classes held fixed.
//!
//! **The exact part.** The kernel is the block-sparse backward over the exact lists with the tail forward's `O` and
//! LSE. Its error is the backward model's (`attnproof_proofs::flash_bound::backward_bounds`) over the exact keys, with
//! the PISA row statistics as the forward quantities (`p_j = e^{s_j − lse}` over the exact keys, `o` PISA's output,
//! `D = dO·o`) and the tail forward's bounds on `O` and LSE as the forward's ([`crate::pisa_tail::TailTargets`]); the
//! GQA sum of dK and dV adds `gqa_sum_term`.
//!
//! **The tail part** runs in f64 from the device's f64 statistics ([`TailMoments`], read back: `μ_b`, `v̄_b`, `H̄`).
//! The oracle's gradients over those statistics differ from the oracle's over its own by a computed amount (f64, both
//! sides), which the bound adds, as the forward's does. Against the gradients over the device's statistics, the
//! tail part's error is first order in the errors of what it reads: the LSE (`b^L`, so each weight
//! `a_ib = e^{α q_i·μ_b − lse_i}` is off by at most `a_ib π_i`, `π_i = e^{b^L_i + ρ_i} − 1`), `D` (`ν_i`, the exact
//! part's bound on it), and f64's own roundings (`ρ = γ_n(2^-53)` of every magnitude a sum carries, `n` the longest
//! sum). With `r_ib = |B_b| (dO_i·v̄_b − D_i) + dO_i·h_i` and `g_ib = a_ib r_ib`:
//! `Δg_ib ≤ a_ib π_i |r_ib| + a_ib (1 + π_i)(|B_b| ν_i + ρ(|B_b| (Σ|dO_i||v̄_b| + |D_i|) + |dO_i|·|h_i|))`,
//! `ΔA_i ≤ π_i A_i`, and through the sums:
//! `Δdq_ic ≤ |α| Σ_b Δg_ib |μ_bc| + |α| ΔA_i Σ_e |H̄_ce||dO_ie|`, `Δdμ_bc ≤ |α| Σ_i Δg_ib |q_ic|`,
//! `ΔdV^Σ_be ≤ Σ_i a_ib π_i |dO_ie|`, `ΔG_ce ≤ |α| Σ_i ΔA_i |q_ic||dO_ie|`, then
//! `Δdk_jc ≤ Δdμ_bc / |B_b| + Σ_e ΔG_ce |v_je − v̄_be| / n_b` and `Δdv_je ≤ ΔdV^Σ_be + Σ_c ΔG_ce |k_jc − μ_bc| / n_b`,
//! each with `ρ` of the magnitudes its f64 sums carry. The kernel rounds every gradient once more to the storage type
//! from the exact part's stored value plus the f64 tail part: `u (|x| + B) + τ` with `B` the bound so far. Every
//! bound is multiplied by `SECOND_ORDER_FACTOR`, as the backward model's are.
//!
//! **The gate.** The exact part's gradients alone (the tail's gradients dropped) and zeros are scored as wrong answers
//! wherever they differ visibly from the oracle.

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::block_sparse::BlockSparseLayout;
use attnproof_oracle::pisa::{
    BlockClasses, TailRule, TailStatistics, classify_blocks, tail_backward, tail_moments, tail_output,
};
use attnproof_oracle::spec::Operand;
use attnproof_proofs::f64_oracle_bound::gamma;
use attnproof_proofs::flash_bound::{
    FlashRecipe, ForwardBounds, HeadBackwardExact, HeadExact, SECOND_ORDER_FACTOR, backward_bounds, gqa_sum_term,
};
use attnproof_reference::Element;
use ndarray::{Array1, Array2, Array4, ArrayD, ArrayViewD, Axis, IxDyn, Slice, Zip};

use crate::flash::{Case, HarnessError};
use crate::gate::GateReport;
use crate::pisa_tail::{TailTargets, exact_layout};
use crate::verdict::{Verdict, compare, lse_row, output_row};

/// The f64 statistics the tail's backward computed with (`attnproof_gpu::pisa::tail::TailWorkspace::stats`), per
/// (sequence, KV head): the blocks' mean keys and mean values and `H̄`.
#[derive(Clone, Debug)]
pub struct TailMoments {
    /// `[B, Hkv, n_k, d]`.
    pub means: Array4<f64>,
    /// `[B, Hkv, n_k, dv]`.
    pub value_means: Array4<f64>,
    /// `[B, Hkv, d, dv]`.
    pub h_bar: Array4<f64>,
}

impl TailMoments {
    /// The statistics from the f64 workspace's elements in its layout (means, then mean values, then `H̄`), for
    /// `spec` with key blocks of `kv_block` keys; `None` when `flat` is shorter than the layout needs.
    pub fn from_workspace(spec: &AttentionSpec, kv_block: usize, flat: &[f64]) -> Option<Self> {
        let (batch, heads, d, dv) = (spec.sequences().len(), spec.n_heads_kv, spec.head_dim, spec.head_dim_v);
        let blocks = spec.sequences().iter().map(|s| s.len_k.div_ceil(kv_block)).max().unwrap_or(0);
        let sizes = [batch * heads * blocks * d, batch * heads * blocks * dv, batch * heads * d * dv];
        if flat.len() < sizes.iter().sum::<usize>() {
            return None;
        }
        let (means, rest) = flat.split_at(sizes[0]);
        let (values, rest) = rest.split_at(sizes[1]);
        let take = |shape: (usize, usize, usize, usize), x: &[f64]| Array4::from_shape_vec(shape, x.to_vec());
        Some(TailMoments {
            means: take((batch, heads, blocks, d), means).ok()?,
            value_means: take((batch, heads, blocks, dv), values).ok()?,
            h_bar: take((batch, heads, d, dv), &rest[..sizes[2]]).ok()?,
        })
    }

    /// The oracle's own f64 statistics of `case` (blocks of `kv_block` keys); blocks a shorter sequence lacks stay 0.
    pub fn of_case<T: Element>(case: &Case<T>, kv_block: usize) -> Self {
        let spec = &case.spec;
        let (d, dv) = (spec.head_dim, spec.head_dim_v);
        let blocks = spec.sequences().iter().map(|s| s.len_k.div_ceil(kv_block)).max().unwrap_or(0);
        let (batch, heads) = (spec.sequences().len(), spec.n_heads_kv);
        let mut out = TailMoments {
            means: Array4::zeros((batch, heads, blocks, d)),
            value_means: Array4::zeros((batch, heads, blocks, dv)),
            h_bar: Array4::zeros((batch, heads, d, dv)),
        };
        let [_, k, v] = case.widened();
        for seq in spec.sequences().iter().filter(|s| s.len_k > 0) {
            for kv in 0..heads {
                let st = tail_moments(
                    spec.head_rows(k.view(), seq, kv, true),
                    spec.head_rows(v.view(), seq, kv, true),
                    kv_block,
                    (),
                );
                for (b, &count) in st.counts.iter().enumerate() {
                    for c in 0..d {
                        out.means[[seq.index, kv, b, c]] = st.means[[b, c]];
                    }
                    for e in 0..dv {
                        out.value_means[[seq.index, kv, b, e]] = st.value_sums[[b, e]] / count as f64;
                    }
                }
                out.h_bar.index_axis_mut(Axis(0), seq.index).index_axis_mut(Axis(0), kv).assign(&st.h_bar);
            }
        }
        out
    }

    /// The statistics of (sequence `seq`, KV head `kv`) as the oracle's struct, for a sequence of `len_k` keys in
    /// blocks of `kv_block` (value sums `|B_b| v̄_b`; no per-block `H_b`, which the PISA rule does not read).
    fn head(&self, seq: usize, kv: usize, len_k: usize, kv_block: usize) -> TailStatistics<f64> {
        let blocks = len_k.div_ceil(kv_block);
        let counts: Vec<usize> = (0..blocks).map(|b| kv_block.min(len_k - b * kv_block)).collect();
        let head = |x: &Array4<f64>| x.index_axis(Axis(0), seq).index_axis(Axis(0), kv).to_owned();
        let means = head(&self.means).slice_axis(Axis(0), Slice::from(..blocks)).to_owned();
        let mut value_sums = head(&self.value_means).slice_axis(Axis(0), Slice::from(..blocks)).to_owned();
        for (mut row, &n) in value_sums.rows_mut().into_iter().zip(&counts) {
            row.mapv_inplace(|x| x * n as f64);
        }
        TailStatistics {
            block_size: kv_block,
            means,
            value_sums,
            counts,
            h: vec![],
            h_bar: head(&self.h_bar),
            heterogeneity: vec![],
        }
    }
}

/// What a tail backward is held to: the oracle's gradients and `D`, their bounds, and the exact part's gradients
/// alone (the gate's "tail dropped").
#[derive(Clone, Debug)]
pub struct TailBackwardTargets {
    /// `[dQ, dK, dV]` of the oracle over its own statistics.
    pub grads: [ArrayD<f64>; 3],
    /// Their bounds.
    pub bounds: [ArrayD<f64>; 3],
    /// `D = dO·o` per row (LSE's layout) and its bound.
    pub delta: (ArrayD<f64>, ArrayD<f64>),
    /// The exact part's gradients alone.
    pub exact_part: [ArrayD<f64>; 3],
    /// Rows with at least one tail block.
    pub tail_rows: usize,
}

/// The targets of the tail backward over the lists `layout` (per query head) for upstream gradient `d_out`: the exact
/// part's kernel `recipe` with query tiles of `q_tile` rows, `forward` the tail forward's targets (its bounds on `O`
/// and LSE), `moments` the device's f64 statistics. See the module docs for the bounds.
pub fn tail_backward_targets<T: Element>(
    case: &Case<T>,
    layout: &BlockSparseLayout,
    d_out: &ArrayD<T>,
    forward: &TailTargets,
    recipe: FlashRecipe,
    q_tile: usize,
    moments: &TailMoments,
) -> Result<TailBackwardTargets, HarnessError> {
    let spec = &case.spec;
    let exact = exact_layout(spec, layout);
    let c_keys = exact.kv_tile;
    let scale = spec.scale_value::<f64>(());
    let alpha = scale.abs();
    let (d, dv) = (spec.head_dim, spec.head_dim_v);
    let (u, tau) = (T::UNIT_ROUNDOFF, recipe.subnormal);
    let zeros = |op: Operand| ArrayD::<f64>::zeros(IxDyn(&spec.expected_shape(op)));
    let mut t = TailBackwardTargets {
        grads: [zeros(Operand::Q), zeros(Operand::K), zeros(Operand::V)],
        bounds: [zeros(Operand::Q), zeros(Operand::K), zeros(Operand::V)],
        delta: (zeros(Operand::RowStat), zeros(Operand::RowStat)),
        exact_part: [zeros(Operand::Q), zeros(Operand::K), zeros(Operand::V)],
        tail_rows: 0,
    };
    // Bounds before the last rounding, and the sum of the group's |exact dK|, |exact dV| (the GQA sum term).
    let mut pre = [zeros(Operand::Q), zeros(Operand::K), zeros(Operand::V)];
    let mut kernel_grads = [zeros(Operand::Q), zeros(Operand::K), zeros(Operand::V)];
    let (mut abs_dk, mut abs_dv) = (zeros(Operand::K), zeros(Operand::V));
    let [q_all, k_all, v_all] = case.widened();
    let g_all = d_out.mapv(|x| x.to_f32() as f64);
    for seq in spec.sequences() {
        let visible = spec.mask.matrix(seq.len_q, seq.len_k);
        if seq.len_k == 0 {
            continue;
        }
        let n_blocks = seq.len_k.div_ceil(c_keys);
        let rho = gamma(2 * (d + dv + n_blocks + c_keys + seq.len_q * spec.group_size()) + 64);
        for kv in 0..spec.n_heads_kv {
            let (k2, v2) = (spec.head_rows(k_all.view(), &seq, kv, true), spec.head_rows(v_all.view(), &seq, kv, true));
            let st_o = tail_moments(k2, v2, c_keys, ());
            let st_k = moments.head(seq.index, kv, seq.len_k, c_keys);
            // The tail part's errors of the KV head's blocks and G, summed over the group's rows.
            let mut d_means_err = Array2::<f64>::zeros((n_blocks, d));
            let mut d_sums_err = Array2::<f64>::zeros((n_blocks, dv));
            let mut g_err = Array2::<f64>::zeros((d, dv));
            let mut d_means_abs = Array2::<f64>::zeros((n_blocks, d));
            let mut g_abs = Array2::<f64>::zeros((d, dv));
            for h in kv * spec.group_size()..(kv + 1) * spec.group_size() {
                let (q2, g2) =
                    (spec.head_rows(q_all.view(), &seq, h, false), spec.head_rows(g_all.view(), &seq, h, false));
                let classes: Vec<BlockClasses> = (0..seq.len_q)
                    .map(|i| {
                        let a = i / exact.q_tile;
                        let listed: Vec<usize> = exact
                            .lists
                            .index_axis(Axis(0), seq.index)
                            .index_axis(Axis(0), h)
                            .index_axis(Axis(0), a)
                            .iter()
                            .filter(|&&b| b >= 0)
                            .map(|&b| b as usize)
                            .collect();
                        classify_blocks(visible.row(i), c_keys, &listed)
                    })
                    .collect();
                let oracle = tail_backward(q2, k2, v2, visible.view(), &classes, &st_o, &scale, g2, ());
                let kernel = tail_backward(q2, k2, v2, visible.view(), &classes, &st_k, &scale, g2, ());
                // The exact part as a dense backward over the exact keys, with PISA's row statistics.
                let (len_q, len_k) = (seq.len_q, seq.len_k);
                let mut s = Array2::from_elem((len_q, len_k), f64::NEG_INFINITY);
                let mut o = Array2::<f64>::zeros((len_q, dv));
                let mut lse = Array1::from_elem(len_q, f64::NEG_INFINITY);
                let mut lse_k = Array1::from_elem(len_q, f64::NEG_INFINITY);
                let mut o_shift = Array1::<f64>::zeros(len_q);
                let mut lse_shift = Array1::<f64>::zeros(len_q);
                for i in 0..len_q {
                    let out =
                        tail_output(q2.row(i), k2, v2, visible.row(i), &classes[i], &st_o, &scale, TailRule::Pisa, ());
                    let out_k =
                        tail_output(q2.row(i), k2, v2, visible.row(i), &classes[i], &st_k, &scale, TailRule::Pisa, ());
                    if out.denominator > 0.0 {
                        lse[i] = out.shift + out.denominator.ln();
                        o.row_mut(i).assign(&out.o);
                    }
                    if out_k.denominator > 0.0 {
                        lse_k[i] = out_k.shift + out_k.denominator.ln();
                        o_shift[i] = Zip::from(&out.o).and(&out_k.o).fold(0f64, |m, a, b| m.max((a - b).abs()));
                    }
                    lse_shift[i] = if lse[i].is_finite() { (lse[i] - lse_k[i]).abs() } else { 0.0 };
                    for &b in &classes[i].exact {
                        for j in (b * c_keys..(b * c_keys + c_keys).min(len_k)).filter(|&j| visible[[i, j]]) {
                            s[[i, j]] = scale * q2.row(i).dot(&k2.row(j));
                        }
                    }
                }
                let p = Array2::from_shape_fn((len_q, len_k), |(i, j)| {
                    if s[[i, j]] == f64::NEG_INFINITY { 0.0 } else { (s[[i, j]] - lse[i]).exp() }
                });
                let dp = g2.dot(&v2.t());
                let delta = Array1::from_shape_fn(len_q, |i| g2.row(i).dot(&o.row(i)));
                let ds = Array2::from_shape_fn((len_q, len_k), |(i, j)| p[[i, j]] * (dp[[i, j]] - delta[i]));
                let dq_e = ds.dot(&k2) * scale;
                let dk_e = ds.t().dot(&q2) * scale;
                let dv_e = p.t().dot(&g2);
                // The forward's bounds on O and LSE, plus how far PISA's output moves between the two statistics.
                let fb = ForwardBounds {
                    o: Array2::from_shape_fn((len_q, dv), |(i, e)| {
                        let at = [output_row(spec, &seq, h, i).as_slice(), &[e]].concat();
                        forward.o_bound[IxDyn(&at)] + o_shift[i]
                    }),
                    lse: Array1::from_shape_fn(len_q, |i| {
                        forward.lse_bound[IxDyn(&lse_row(spec, &seq, h, i))] + lse_shift[i]
                    }),
                };
                let fx = HeadExact {
                    q: q2,
                    k: k2,
                    v: v2,
                    s: s.view(),
                    p: p.view(),
                    o: o.view(),
                    lse: lse.view(),
                    scale: alpha,
                };
                let bx = HeadBackwardExact {
                    forward: fx,
                    d_out: g2,
                    dp: dp.view(),
                    ds: ds.view(),
                    delta: delta.view(),
                    dq: dq_e.view(),
                    dk: dk_e.view(),
                    dv: dv_e.view(),
                };
                let eb = backward_bounds(bx, &fb, recipe, q_tile)?;
                // The tail part's first-order errors, row by row.
                let mut dq_tail_err = Array2::<f64>::zeros((len_q, d));
                for i in 0..len_q {
                    let tail = &classes[i].tail;
                    if tail.is_empty() || !lse_k[i].is_finite() {
                        continue;
                    }
                    t.tail_rows += 1;
                    let (qi, gi) = (q2.row(i), g2.row(i));
                    let pi = (fb.lse[i] + rho * (lse_k[i].abs() + 1.0)).exp_m1();
                    let nu = eb.delta[i] / SECOND_ORDER_FACTOR;
                    let abs_w: Array1<f64> =
                        (0..d).map(|c| (0..dv).map(|e| st_k.h_bar[[c, e]].abs() * gi[e].abs()).sum()).collect();
                    let through_abs = alpha * qi.iter().zip(&abs_w).map(|(x, w)| x.abs() * w).sum::<f64>();
                    let through = scale
                        * (0..d).map(|c| qi[c] * (0..dv).map(|e| st_k.h_bar[[c, e]] * gi[e]).sum::<f64>()).sum::<f64>();
                    let delta_k = gi.dot(&o.row(i));
                    let mut mass = 0.0;
                    for &b in tail {
                        let count = st_k.counts[b] as f64;
                        let a = (scale * qi.dot(&st_k.means.row(b)) - lse_k[i]).exp();
                        let vbar = st_k.value_sums.row(b).mapv(|x| x / count);
                        let dp_b = gi.dot(&vbar);
                        let r = count * (dp_b - delta_k) + through;
                        let r_abs = count
                            * (gi.iter().zip(&vbar).map(|(x, y)| (x * y).abs()).sum::<f64>() + delta_k.abs())
                            + through_abs;
                        let dg = a * pi * r.abs() + a * (1.0 + pi) * (count * nu + rho * r_abs);
                        let g_abs_b = a * r.abs();
                        mass += a;
                        for c in 0..d {
                            let mu = st_k.means[[b, c]].abs();
                            dq_tail_err[[i, c]] += alpha * (dg + rho * g_abs_b) * mu;
                            d_means_err[[b, c]] += alpha * (dg + rho * g_abs_b) * qi[c].abs();
                            d_means_abs[[b, c]] += alpha * g_abs_b * qi[c].abs();
                        }
                        for e in 0..dv {
                            d_sums_err[[b, e]] += a * (pi + rho) * gi[e].abs();
                        }
                    }
                    for c in 0..d {
                        dq_tail_err[[i, c]] += alpha * mass * (pi + rho) * abs_w[c];
                        for e in 0..dv {
                            let term = alpha * mass * qi[c].abs() * gi[e].abs();
                            g_err[[c, e]] += (pi + rho) * term;
                            g_abs[[c, e]] += term;
                        }
                    }
                }
                // Into the whole problem's tensors.
                let qs = spec.head_slice(&seq, h, false);
                let ks = spec.head_slice(&seq, kv, true);
                t.grads[0].slice_mut(qs.clone()).assign(&oracle.dq.view().into_dyn());
                kernel_grads[0].slice_mut(qs.clone()).assign(&kernel.dq.view().into_dyn());
                t.exact_part[0].slice_mut(qs.clone()).assign(&dq_e.view().into_dyn());
                let dq_dist = (&kernel.dq - &oracle.dq).mapv(f64::abs);
                pre[0]
                    .slice_mut(qs.clone())
                    .assign(&((&eb.dq + &(dq_tail_err * SECOND_ORDER_FACTOR) + dq_dist).into_dyn()));
                for (slot, (o_, k_, e_)) in [(1, (&oracle.dk, &kernel.dk, &dk_e)), (2, (&oracle.dv, &kernel.dv, &dv_e))]
                {
                    Zip::from(t.grads[slot].slice_mut(ks.clone())).and(&o_.view().into_dyn()).for_each(|a, x| *a += x);
                    Zip::from(kernel_grads[slot].slice_mut(ks.clone()))
                        .and(&k_.view().into_dyn())
                        .for_each(|a, x| *a += x);
                    Zip::from(t.exact_part[slot].slice_mut(ks.clone()))
                        .and(&e_.view().into_dyn())
                        .for_each(|a, x| *a += x);
                }
                Zip::from(pre[1].slice_mut(ks.clone())).and(&eb.dk.view().into_dyn()).for_each(|a, x| *a += x);
                Zip::from(pre[2].slice_mut(ks.clone())).and(&eb.dv.view().into_dyn()).for_each(|a, x| *a += x);
                Zip::from(abs_dk.slice_mut(ks.clone())).and(&dk_e.view().into_dyn()).for_each(|a, x| *a += x.abs());
                Zip::from(abs_dv.slice_mut(ks.clone())).and(&dv_e.view().into_dyn()).for_each(|a, x| *a += x.abs());
                for i in 0..len_q {
                    let at = lse_row(spec, &seq, h, i);
                    t.delta.0[IxDyn(&at)] = delta[i];
                    t.delta.1[IxDyn(&at)] = eb.delta[i];
                }
            }
            // The scatter onto the KV head's keys and values.
            let ks = spec.head_slice(&seq, kv, true);
            let per_block = 1.0 / n_blocks as f64;
            let mut dk_err = Array2::<f64>::zeros((seq.len_k, d));
            let mut dv_err = Array2::<f64>::zeros((seq.len_k, dv));
            for j in 0..seq.len_k {
                let b = j / c_keys;
                let count = st_k.counts[b] as f64;
                let x: Array1<f64> = (0..dv).map(|e| (v2[[j, e]] - st_k.value_sums[[b, e]] / count).abs()).collect();
                let y: Array1<f64> = (0..d).map(|c| (k2[[j, c]] - st_k.means[[b, c]]).abs()).collect();
                for c in 0..d {
                    let via_g: f64 = (0..dv).map(|e| (g_err[[c, e]] + rho * g_abs[[c, e]]) * x[e]).sum();
                    dk_err[[j, c]] = (d_means_err[[b, c]] + rho * d_means_abs[[b, c]]) / count + via_g * per_block;
                }
                for e in 0..dv {
                    let via_g: f64 = (0..d).map(|c| (g_err[[c, e]] + rho * g_abs[[c, e]]) * y[c]).sum();
                    dv_err[[j, e]] = d_sums_err[[b, e]] + via_g * per_block;
                }
            }
            Zip::from(pre[1].slice_mut(ks.clone()))
                .and(&dk_err.into_dyn())
                .for_each(|a, x| *a += x * SECOND_ORDER_FACTOR);
            Zip::from(pre[2].slice_mut(ks)).and(&dv_err.into_dyn()).for_each(|a, x| *a += x * SECOND_ORDER_FACTOR);
        }
    }
    let group = spec.group_size();
    Zip::from(&mut pre[1]).and(&abs_dk).for_each(|b, a| *b += gqa_sum_term(group, *a));
    Zip::from(&mut pre[2]).and(&abs_dv).for_each(|b, a| *b += gqa_sum_term(group, *a));
    // The distance between the two statistics' gradients of dK and dV, then the last rounding of every gradient.
    for slot in 0..3 {
        if slot > 0 {
            Zip::from(&mut pre[slot])
                .and(&kernel_grads[slot])
                .and(&t.grads[slot])
                .for_each(|b, k, o| *b += (k - o).abs());
        }
        t.bounds[slot] = Zip::from(&pre[slot])
            .and(&kernel_grads[slot])
            .map_collect(|&b, &x| b + (u * (x.abs() + b) + tau) * SECOND_ORDER_FACTOR);
    }
    Ok(t)
}

/// The verdict on a tail backward candidate (`dq`, `dk`, `dv` in the storage type, `delta` the exact part's `D`): every
/// output against its bound, and the gate's wrong answers (the tail's gradients dropped, zeros).
pub fn judge_tail_backward<T: Element>(
    t: &TailBackwardTargets,
    [dq, dk, dv]: [ArrayViewD<'_, T>; 3],
    delta: ArrayViewD<'_, f32>,
) -> Verdict {
    let widen = |x: &ArrayViewD<'_, T>| x.mapv(|v| v.to_f32() as f64);
    let outputs = vec![
        compare("D", delta.mapv(|x| x as f64).view(), t.delta.0.view(), t.delta.1.view()),
        compare("dQ", widen(&dq).view(), t.grads[0].view(), t.bounds[0].view()),
        compare("dK", widen(&dk).view(), t.grads[1].view(), t.bounds[1].view()),
        compare("dV", widen(&dv).view(), t.grads[2].view(), t.bounds[2].view()),
    ];
    let mut gate = GateReport::default();
    for (slot, name) in ["dQ", "dK", "dV"].into_iter().enumerate() {
        let scale = t.grads[slot].iter().fold(0f64, |m, x| m.max(x.abs()));
        let (truth, bound) = (&t.grads[slot], &t.bounds[slot]);
        let unit = T::UNIT_ROUNDOFF;
        gate.score("tail dropped", name, t.exact_part[slot].view(), truth.view(), bound.view(), unit, scale);
        gate.score("zeros", name, ArrayD::zeros(truth.raw_dim()).view(), truth.view(), bound.view(), unit, scale);
    }
    Verdict { outputs, gate }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{ValueProfile, make_case, make_d_out};
    use crate::pisa_tail::{PooledStatistics, tail_targets};
    use attnproof_gpu::backward::{BackwardTiling, Q_TILE};
    use attnproof_oracle::Mask;
    use half::bf16;
    use ndarray::Array4 as Lists;

    /// Lists of the first key block for every query block of 64 rows, blocks of 64 keys.
    fn layout(spec: &AttentionSpec, keep: &[i32]) -> BlockSparseLayout {
        let query_blocks = spec.sequences().iter().map(|s| s.len_q.div_ceil(64)).max().unwrap_or(0);
        let mut lists = Lists::from_elem((spec.sequences().len(), spec.n_heads_q, query_blocks, keep.len().max(1)), -1);
        for mut lane in lists.lanes_mut(Axis(3)) {
            for (slot, &b) in keep.iter().enumerate() {
                lane[slot] = b;
            }
        }
        BlockSparseLayout { q_tile: 64, kv_tile: 64, lists }
    }

    fn targets(mask: Mask, group: usize, seed: u64) -> (Case<bf16>, TailBackwardTargets) {
        let spec = AttentionSpec::dense(1, 2 * group, 2, 130, 260, 16, 8).with_mask(mask);
        let case = make_case::<bf16>(&spec, ValueProfile::GAUSSIAN, seed);
        let d_out = make_d_out::<bf16>(&spec, seed);
        let lists = layout(&spec, &[0]);
        let pooled = PooledStatistics::rounded(&case, 64);
        let forward = tail_targets(
            &case,
            &lists,
            crate::recipes::gpu_forward::<bf16>(),
            crate::recipes::gpu_tail::<bf16>(),
            &pooled,
        )
        .unwrap();
        let recipe = crate::recipes::gpu_backward::<bf16>(BackwardTiling::DEFAULT).recipe;
        let moments = TailMoments::of_case(&case, 64);
        let t = tail_backward_targets(&case, &lists, &d_out, &forward, recipe, Q_TILE, &moments).unwrap();
        (case, t)
    }

    fn rounded(x: &ArrayD<f64>) -> ArrayD<bf16> {
        x.mapv(bf16::from_f64)
    }

    /// The oracle's gradients rounded to the storage type pass, with every GQA group size the suites draw; the gate's
    /// wrong answers (the tail's gradients dropped, zeros) are visibly wrong here and rejected.
    #[test]
    fn the_rounded_oracle_passes_and_the_dropped_tail_fails() {
        for (mask, group) in [(Mask::Causal, 1), (Mask::None, 1), (Mask::Causal, 3)] {
            let (_, t) = targets(mask.clone(), group, 7);
            assert!(t.tail_rows > 0);
            let grads = t.grads.clone().map(|g| rounded(&g));
            let delta = t.delta.0.mapv(|x| x as f32);
            let v = judge_tail_backward(&t, [grads[0].view(), grads[1].view(), grads[2].view()], delta.view());
            assert!(v.passed(), "{mask:?} group {group}: {v:?}");
            assert!(v.valid(), "{mask:?} group {group}: {}", v.gate);
            let dropped = t.exact_part.clone().map(|g| rounded(&g));
            let w = judge_tail_backward(&t, [dropped[0].view(), dropped[1].view(), dropped[2].view()], delta.view());
            assert!(!w.passed(), "{mask:?} group {group}: the exact part alone passes");
        }
    }

    /// Each gradient moved by twice its bound at its worst element fails, and so does the tail part of dK alone
    /// dropped (the scatter of G and dμ missing), which the exact part's bound must not absorb.
    #[test]
    fn moved_gradients_fail() {
        let (_, t) = targets(Mask::Causal, 2, 11);
        let delta = t.delta.0.mapv(|x| x as f32);
        for slot in 0..3 {
            let mut grads = t.grads.clone().map(|g| rounded(&g));
            let worst = t.bounds[slot].iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
            let x = grads[slot].as_slice_mut().unwrap();
            let moved = t.grads[slot].as_slice().unwrap()[worst] + 2.0 * t.bounds[slot].as_slice().unwrap()[worst];
            x[worst] = bf16::from_f64(moved + moved.abs() * 0.01);
            let v = judge_tail_backward(&t, [grads[0].view(), grads[1].view(), grads[2].view()], delta.view());
            assert!(!v.outputs[slot + 1].passed(), "slot {slot}: {v:?}");
        }
        let mut grads = t.grads.clone().map(|g| rounded(&g));
        grads[1] = rounded(&t.exact_part[1]);
        let v = judge_tail_backward(&t, [grads[0].view(), grads[1].view(), grads[2].view()], delta.view());
        assert!(!v.outputs[2].passed(), "dK without its tail part passes: {v:?}");
    }

    /// The device's statistics are read from the f64 workspace's layout: means, mean values, `H̄`.
    #[test]
    fn moments_come_from_the_workspace_layout() {
        let spec = AttentionSpec::dense(2, 2, 1, 3, 130, 2, 3);
        let (blocks, d, dv) = (3, 2, 3);
        let n = 2 * blocks * d + 2 * blocks * dv + 2 * d * dv;
        let flat: Vec<f64> = (0..n).map(|x| x as f64).collect();
        let m = TailMoments::from_workspace(&spec, 64, &flat).unwrap();
        assert_eq!(m.means[[1, 0, 2, 1]], (blocks * d + 2 * d + 1) as f64);
        assert_eq!(m.value_means[[0, 0, 1, 2]], (2 * blocks * d + dv + 2) as f64);
        assert_eq!(m.h_bar[[1, 0, 1, 0]], (2 * blocks * (d + dv) + d * dv + dv) as f64);
        assert!(TailMoments::from_workspace(&spec, 64, &flat[..n - 1]).is_none());
    }
}
