//! The FlashAttention bound model (proofs/src/flash_bound.rs) term by term: the forward and backward bounds of one
//! query and two keys, every recipe parameter non-zero, evaluated by hand from the model's docs and compared with
//! `forward_bounds` and `backward_bounds`; the underflow terms isolated where everything else vanishes; the sum
//! factors of both accumulations; the GQA term; and the hypothesis at its limit. A term dropped, mis-signed or
//! mis-scaled changes one of these numbers, whereas the kernel suites only notice a bound that became too small.
//!
//! The constants are restated here (`u = 2^-24`, the second-order factor `1 + 2^-3`, the hypothesis `2^-5`), so that
//! a wrong constant in the model cannot agree with itself.

use attnproof_proofs::Violation;
use attnproof_proofs::flash_bound::{
    Accumulation, BackwardBounds, F32_MIN_NORMAL, FlashRecipe, ForwardBounds, HeadBackwardExact, HeadExact, ScoreReuse,
    backward_bounds, forward_bounds, gqa_sum_term,
};
use ndarray::{Array1, Array2, array};

/// f32 unit roundoff, `2^-24`.
const U: f64 = 1.0 / 16_777_216.0;
/// The second-order factor, `1 + 2^-3`.
const F: f64 = 1.125;

/// `γ_n` of round-to-nearest f32 sums, by hand.
fn g_rn(n: f64) -> f64 {
    n * U / (1.0 - n * U)
}

/// `γ'_n` of tensor-core sums with `k_step` products per instruction: `n + ⌈n / k_step⌉` additions at `2u`.
fn g_tc(n: usize, k_step: usize) -> f64 {
    let terms = (n + n.div_ceil(k_step)) as f64;
    2.0 * terms * U / (1.0 - 2.0 * terms * U)
}

#[track_caller]
fn close(what: &str, got: f64, want: f64) {
    assert!(want > 0.0, "{what}: a hand value must be positive to test anything, got {want:e}");
    assert!(((got - want) / want).abs() <= 1e-12, "{what}: model {got:e}, hand-derived {want:e}");
}

/// The one-query, two-key head of these tests: `d = dv = 2`, scores `α q·k` unequal, values on both sides of `O`.
struct Head {
    q: Array2<f64>,
    k: Array2<f64>,
    v: Array2<f64>,
    s: Array2<f64>,
    p: Array2<f64>,
    o: Array2<f64>,
    lse: Array1<f64>,
    d_out: Array2<f64>,
    dp: Array2<f64>,
    ds: Array2<f64>,
    delta: Array1<f64>,
    dq: Array2<f64>,
    dk: Array2<f64>,
    dv: Array2<f64>,
    alpha: f64,
}

impl Head {
    /// Exact (f64) quantities of the head with `visible` keys; a hidden key has `s = −∞`, `p = 0`.
    fn new(q: Array2<f64>, k: Array2<f64>, v: Array2<f64>, d_out: Array2<f64>, alpha: f64, visible: [bool; 2]) -> Head {
        let s = Array2::from_shape_fn((1, 2), |(_, j)| {
            if visible[j] { alpha * (q[[0, 0]] * k[[j, 0]] + q[[0, 1]] * k[[j, 1]]) } else { f64::NEG_INFINITY }
        });
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        let p = s.mapv(|x| (x - lse).exp());
        let o = Array2::from_shape_fn((1, 2), |(_, c)| p[[0, 0]] * v[[0, c]] + p[[0, 1]] * v[[1, c]]);
        let dp = Array2::from_shape_fn((1, 2), |(_, j)| d_out[[0, 0]] * v[[j, 0]] + d_out[[0, 1]] * v[[j, 1]]);
        let delta = d_out[[0, 0]] * o[[0, 0]] + d_out[[0, 1]] * o[[0, 1]];
        let ds = Array2::from_shape_fn((1, 2), |(_, j)| p[[0, j]] * (dp[[0, j]] - delta));
        let dq = Array2::from_shape_fn((1, 2), |(_, c)| alpha * (ds[[0, 0]] * k[[0, c]] + ds[[0, 1]] * k[[1, c]]));
        let dk = Array2::from_shape_fn((2, 2), |(j, c)| alpha * ds[[0, j]] * q[[0, c]]);
        let dv = Array2::from_shape_fn((2, 2), |(j, c)| p[[0, j]] * d_out[[0, c]]);
        Head { q, k, v, s, p, o, lse: array![lse], d_out, dp, ds, delta: array![delta], dq, dk, dv, alpha }
    }

    /// The head of the absolute tests.
    fn standard() -> Head {
        Head::new(
            array![[1.5, -0.5]],
            array![[0.5, 1.0], [2.0, -1.0]],
            array![[0.0, 4.0], [1.0, -2.0]],
            array![[1.0, -3.0]],
            0.75,
            [true, true],
        )
    }

    fn exact(&self) -> HeadExact<'_> {
        HeadExact {
            q: self.q.view(),
            k: self.k.view(),
            v: self.v.view(),
            s: self.s.view(),
            p: self.p.view(),
            o: self.o.view(),
            lse: self.lse.view(),
            scale: self.alpha,
        }
    }

    fn backward_exact(&self) -> HeadBackwardExact<'_> {
        HeadBackwardExact {
            forward: self.exact(),
            d_out: self.d_out.view(),
            dp: self.dp.view(),
            ds: self.ds.view(),
            delta: self.delta.view(),
            dq: self.dq.view(),
            dk: self.dk.view(),
            dv: self.dv.view(),
        }
    }

    /// `Σ_c |q_c||k_jc|`.
    fn abs_qk(&self, j: usize) -> f64 {
        (0..2).map(|c| self.q[[0, c]].abs() * self.k[[j, c]].abs()).sum()
    }
}

/// A recipe with every parameter non-zero and distinct: bf16 storage, KV tiles of one key (so `n_t = Lk + merges`),
/// one extra merge, an `exp` of error `3u`, a shift rounding `u`, flushing underflow, tensor-core sums, a score
/// storage rounding of `2^-11`.
fn recipe(score_reuse: ScoreReuse) -> FlashRecipe {
    FlashRecipe {
        unit_roundoff: 1.0 / 256.0,
        subnormal: 2f64.powi(-133),
        kv_tile: 1,
        extra_merges: 1,
        visited_tiles: None,
        extra_query_partials: 2,
        exp_error: 3.0 * U,
        shift_rounding: U,
        exp_underflow: 2f64.powi(-126),
        accumulation: Accumulation::TensorCore { k_step: 16 },
        score_reuse,
        score_storage_rounding: 1.0 / 2048.0,
        atomic_kv_sums: false,
    }
}

/// The forward model of the module docs, by hand, for [`Head::standard`] under [`recipe`]: returns `(b^O, b^L, σ)`
/// before the second-order factor.
fn forward_by_hand(h: &Head, r: &FlashRecipe) -> ([f64; 2], f64, [f64; 2]) {
    // ⌈Lk / kv_tile⌉ = 2 tiles of one key, or the visited ones when fewer, + extra_merges.
    let n_t = r.visited_tiles.map_or(2, |v| v.min(2)) + 1;
    let g = g_tc(2 + n_t, 16); // g(Lk + n_t)
    let m = h.s[[0, 0]].max(h.s[[0, 1]]);
    let sigma = [0, 1].map(|j| (g_tc(2, 16) + 3.0 * U + 3.0 * r.score_storage_rounding) * h.alpha * h.abs_qk(j));
    let eta = [0, 1].map(|j| {
        sigma[j]
            + 2.0 * U * (h.s[[0, j]] - m).abs()
            + r.exp_error
            + r.shift_rounding * m.abs()
            + (r.exp_error + U) * n_t as f64
    });
    let (ut, tiny) = (r.unit_roundoff, r.subnormal);
    let o = [0, 1].map(|c| {
        let weighted_abs_v = h.p[[0, 0]] * h.v[[0, c]].abs() + h.p[[0, 1]] * h.v[[1, c]].abs();
        let vmax = h.v[[0, c]].abs().max(h.v[[1, c]].abs());
        let oc = h.o[[0, c]];
        (0..2).map(|j| h.p[[0, j]] * eta[j] * (h.v[[j, c]] - oc).abs()).sum::<f64>()
            + ut * weighted_abs_v
            + g * (weighted_abs_v + oc.abs())
            + (U + ut) * oc.abs()
            + tiny
            + 2.0 * (tiny + r.exp_underflow) * vmax
    });
    let lse = h.lse[0];
    let b_l = h.p[[0, 0]] * eta[0] + h.p[[0, 1]] * eta[1] + g + 2.0 * U * (lse - m).abs() + U * lse.abs();
    (o, b_l, sigma)
}

#[test]
fn forward_terms() {
    let h = Head::standard();
    let r = recipe(ScoreReuse::BitwiseAsForward);
    let b = forward_bounds(h.exact(), r).unwrap();
    let (o, lse, _) = forward_by_hand(&h, &r);
    close("O[0]", b.o[[0, 0]], o[0] * F);
    close("O[1]", b.o[[0, 1]], o[1] * F);
    close("LSE", b.lse[0], lse * F);
}

/// A schedule that visits one of the row's two tiles (a block-sparse forward) is charged one rescale step for it, not
/// two: its bound is the hand-derived one with `n_t = 1 + 1` and below the every-tile bound; a visited count above the
/// tiles the keys make changes nothing.
#[test]
fn forward_terms_count_only_the_visited_tiles() {
    let h = Head::standard();
    let every = recipe(ScoreReuse::BitwiseAsForward);
    let one = FlashRecipe { visited_tiles: Some(1), ..every };
    let b = forward_bounds(h.exact(), one).unwrap();
    let (o, lse, _) = forward_by_hand(&h, &one);
    close("O[0]", b.o[[0, 0]], o[0] * F);
    close("O[1]", b.o[[0, 1]], o[1] * F);
    close("LSE", b.lse[0], lse * F);
    let all = forward_bounds(h.exact(), every).unwrap();
    assert!(b.o[[0, 0]] < all.o[[0, 0]] && b.lse[0] < all.lse[0], "{b:?} against {all:?}");
    let more = forward_bounds(h.exact(), FlashRecipe { visited_tiles: Some(7), ..every }).unwrap();
    assert_eq!(more, all);
    assert_eq!((one.rescale_steps(2), every.rescale_steps(2), every.rescale_steps(5)), (2, 3, 6));
}

/// The backward model of `backward_bounds`' docs, by hand, for [`Head::standard`] under `r`, with the forward bounds
/// `fwd` given (as the backward receives them).
fn backward_by_hand(h: &Head, r: &FlashRecipe, fwd: &ForwardBounds) -> BackwardBounds {
    let (ut, tiny) = (r.unit_roundoff, r.subnormal);
    let q_tile = 1;
    let n_q = 1usize.div_ceil(q_tile) + r.extra_query_partials;
    let n_k = 2 + r.extra_merges;
    let (gq, gk) = (g_tc(1 + n_q, 16), g_tc(2 + n_k, 16));
    let (_, _, sigma) = forward_by_hand(h, r);
    let lse = h.lse[0];
    let weighted = h.p[[0, 0]] * sigma[0] + h.p[[0, 1]] * sigma[1];
    let pi = [0, 1].map(|j| {
        let score_part = match r.score_reuse {
            ScoreReuse::Recomputed => sigma[j] + fwd.lse[0],
            ScoreReuse::BitwiseAsForward => {
                (1.0 - h.p[[0, j]]) * sigma[j] + (weighted - h.p[[0, j]] * sigma[j]) + (fwd.lse[0] - F * weighted)
            }
        };
        score_part + U * (h.s[[0, j]] - lse).abs() + r.exp_error + r.shift_rounding * lse.abs()
    });
    let g_dv = g_tc(2, 16);
    let nu = g_dv * (0..2).map(|c| h.d_out[[0, c]].abs() * h.o[[0, c]].abs()).sum::<f64>()
        + (0..2).map(|c| h.d_out[[0, c]].abs() * fwd.o[[0, c]]).sum::<f64>();
    let rho = [0, 1].map(|j| g_dv * (0..2).map(|c| h.d_out[[0, c]].abs() * h.v[[j, c]].abs()).sum::<f64>());
    let zeta = [0, 1].map(|j| {
        (pi[j] + 2.0 * U + ut) * h.ds[[0, j]].abs()
            + h.p[[0, j]] * (rho[j] + nu)
            + r.exp_underflow * (h.dp[[0, j]] - h.delta[0]).abs()
            + tiny
    });
    let dq = Array2::from_shape_fn((1, 2), |(_, c)| {
        h.alpha
            * ((0..2).map(|j| (zeta[j] + gk * h.ds[[0, j]].abs()) * h.k[[j, c]].abs()).sum::<f64>()
                + n_k as f64 * F32_MIN_NORMAL)
            + (3.0 * U + ut) * h.dq[[0, c]].abs()
            + tiny
    });
    let dk = Array2::from_shape_fn((2, 2), |(j, c)| {
        h.alpha * (zeta[j] + gq * h.ds[[0, j]].abs()) * h.q[[0, c]].abs() + (3.0 * U + ut) * h.dk[[j, c]].abs() + tiny
    });
    let dv = Array2::from_shape_fn((2, 2), |(j, c)| {
        h.p[[0, j]] * (pi[j] + ut + gq) * h.d_out[[0, c]].abs()
            + (tiny + r.exp_underflow) * h.d_out[[0, c]].abs()
            + ut * h.dv[[j, c]].abs()
            + tiny
    });
    BackwardBounds { delta: array![nu * F], dq: dq * F, dk: dk * F, dv: dv * F }
}

#[track_caller]
fn close_all(what: &str, got: &BackwardBounds, want: &BackwardBounds) {
    close(&format!("{what} D"), got.delta[0], want.delta[0]);
    for c in 0..2 {
        close(&format!("{what} dQ[{c}]"), got.dq[[0, c]], want.dq[[0, c]]);
        for j in 0..2 {
            close(&format!("{what} dK[{j},{c}]"), got.dk[[j, c]], want.dk[[j, c]]);
            close(&format!("{what} dV[{j},{c}]"), got.dv[[j, c]], want.dv[[j, c]]);
        }
    }
}

#[test]
fn backward_terms_with_recomputed_scores() {
    let h = Head::standard();
    let r = recipe(ScoreReuse::Recomputed);
    let fwd = forward_bounds(h.exact(), r).unwrap();
    let got = backward_bounds(h.backward_exact(), &fwd, r, 1).unwrap();
    close_all("recomputed", &got, &backward_by_hand(&h, &r, &fwd));
}

#[test]
fn backward_terms_with_scores_bitwise_as_forward() {
    let h = Head::standard();
    let r = recipe(ScoreReuse::BitwiseAsForward);
    let fwd = forward_bounds(h.exact(), r).unwrap();
    let got = backward_bounds(h.backward_exact(), &fwd, r, 1).unwrap();
    close_all("bitwise", &got, &backward_by_hand(&h, &r, &fwd));
    let recomputed = backward_bounds(h.backward_exact(), &fwd, recipe(ScoreReuse::Recomputed), 1).unwrap();
    assert!(got.dv[[0, 0]] < recomputed.dv[[0, 0]], "reusing the forward's scores must tighten P's error");
}

/// The forward LSE bound's score share is subtracted only up to what the LSE bound holds: a forward bound smaller
/// than the score share (a caller's own) leaves no negative remainder.
#[test]
fn bitwise_reuse_never_subtracts_more_than_the_lse_bound() {
    let h = Head::standard();
    let r = recipe(ScoreReuse::BitwiseAsForward);
    let mut fwd = forward_bounds(h.exact(), r).unwrap();
    fwd.lse[0] = 0.0;
    let got = backward_bounds(h.backward_exact(), &fwd, r, 1).unwrap();
    let mut want_fwd = fwd.clone();
    // With the remainder clamped at 0, the hand formula's `fwd.lse − F·Σ p σ` term must be 0: pass a forward LSE
    // bound equal to that share instead.
    let (_, _, sigma) = forward_by_hand(&h, &r);
    want_fwd.lse[0] = F * (h.p[[0, 0]] * sigma[0] + h.p[[0, 1]] * sigma[1]);
    close_all("clamped", &got, &backward_by_hand(&h, &r, &want_fwd));
}

/// The absolute terms, isolated: all values 0 except a hidden key's, so `O = 0`, `dS = 0` and every relative term
/// vanishes. What remains is `τ_T` (output rounding) plus `Lk (τ_T + τ_e) max|v|` for `O`; `Lq (τ_T + τ_e) max|dO| +
/// τ_T` for `dV` of the hidden key, whose `dS` no one computes (so its `dK` is `τ_T` alone); and `b^O` carried by `ν`
/// into `D`, and through `ζ = p ν + τ_T` of the visible key into `dQ` and `dK`.
#[test]
fn underflow_terms() {
    let h = Head::new(
        array![[1.0, 0.0]],
        array![[1.0, 0.0], [1.0, 0.0]],
        array![[0.0, 0.0], [2.0, 0.0]],
        array![[1.0, 0.0]],
        1.0,
        [true, false],
    );
    let r =
        FlashRecipe { subnormal: 2f64.powi(-133), exp_underflow: 2f64.powi(-126), ..recipe(ScoreReuse::Recomputed) };
    let (tiny, tau_e) = (r.subnormal, r.exp_underflow);
    let fwd = forward_bounds(h.exact(), r).unwrap();
    let b_o = tiny + 2.0 * (tiny + tau_e) * 2.0;
    close("O[0]", fwd.o[[0, 0]], b_o * F);
    close("O[1] (no value at all)", fwd.o[[0, 1]], tiny * F);
    let b = backward_bounds(h.backward_exact(), &fwd, r, 1).unwrap();
    close("dV of the hidden key", b.dv[[1, 0]], ((tiny + tau_e) * 1.0 + tiny) * F);
    close("dV of the hidden key, dO = 0", b.dv[[1, 1]], tiny * F);
    close("dK of the hidden key", b.dk[[1, 0]], tiny * F);
    close("D", b.delta[0], b_o * F * F);
    // ζ of the visible key: p ν + τ_T with p = 1 and ν = |dO| b^O (the forward bound, already scaled by F).
    let zeta = b_o * F + tiny;
    close("dK of the visible key", b.dk[[0, 0]], (zeta + tiny) * F);
    // dQ also carries the atomic flush of its n_k = ⌈2/1⌉ + 1 = 3 partials (α = 1).
    close("dQ", b.dq[[0, 0]], (zeta + 3.0 * F32_MIN_NORMAL + tiny) * F);
}

/// Atomic dK, dV sums add exactly the flush of their `n_q` partials: `|α| n_q 2^-126` to dK and `n_q 2^-126` to dV
/// (here `n_q = ⌈1/1⌉ + 2 = 3` under [`recipe`]'s extra query partials, `α = 0.5`), and change nothing else. The
/// terms are seen where nothing else is: the hidden key of [`underflow_terms`]'s head, whose dK is `τ_T` alone and
/// whose dV without `dO` is too.
#[test]
fn atomic_kv_sums_add_the_flush_of_each_partial() {
    let h = Head::new(
        array![[1.0, 0.0]],
        array![[1.0, 0.0], [1.0, 0.0]],
        array![[0.0, 0.0], [2.0, 0.0]],
        array![[1.0, 0.0]],
        0.5,
        [true, false],
    );
    let r =
        FlashRecipe { subnormal: 2f64.powi(-133), exp_underflow: 2f64.powi(-126), ..recipe(ScoreReuse::Recomputed) };
    let tiny = r.subnormal;
    let fwd = forward_bounds(h.exact(), r).unwrap();
    let plain = backward_bounds(h.backward_exact(), &fwd, r, 1).unwrap();
    let atomic = backward_bounds(h.backward_exact(), &fwd, FlashRecipe { atomic_kv_sums: true, ..r }, 1).unwrap();
    let n_q = 3.0;
    close("dK of the hidden key, plain", plain.dk[[1, 0]], tiny * F);
    close("dK of the hidden key, atomic", atomic.dk[[1, 0]], (0.5 * n_q * F32_MIN_NORMAL + tiny) * F);
    close("dV of the hidden key, dO = 0, plain", plain.dv[[1, 1]], tiny * F);
    close("dV of the hidden key, dO = 0, atomic", atomic.dv[[1, 1]], (n_q * F32_MIN_NORMAL + tiny) * F);
    assert_eq!((atomic.dq, atomic.delta), (plain.dq, plain.delta));
}

#[test]
fn sum_factors_of_both_accumulations() {
    assert_eq!(Accumulation::RoundToNearest.gamma(7), g_rn(7.0));
    close("tensor core, n = 33, k_step 16", Accumulation::TensorCore { k_step: 16 }.gamma(33), g_tc(33, 16));
    close("tensor core, n = 16", Accumulation::TensorCore { k_step: 16 }.gamma(16), g_tc(16, 16));
    close("tensor core, k_step 1", Accumulation::TensorCore { k_step: 1 }.gamma(5), g_tc(5, 1));
    assert!(Accumulation::TensorCore { k_step: 0 }.gamma(5).is_finite(), "k_step 0 reads as 1, not a division by 0");
    assert_eq!(gqa_sum_term(3, 2.0), g_rn(3.0) * 2.0 * F);
}

#[test]
fn the_libm_recipe_is_what_its_docs_say() {
    let r = FlashRecipe::libm(1.0 / 256.0, 2f64.powi(-133), 64);
    assert_eq!((r.unit_roundoff, r.subnormal, r.kv_tile), (1.0 / 256.0, 2f64.powi(-133), 64));
    assert_eq!((r.extra_merges, r.extra_query_partials), (0, 0));
    assert_eq!(r.exp_error, 2.0 * U, "a libm expf errs below one ulp: 2u");
    assert_eq!(r.shift_rounding, 0.0, "the argument is fl(s − m)");
    assert_eq!(r.exp_underflow, 2f64.powi(-149), "gradual underflow loses at most the smallest subnormal");
    assert_eq!(r.accumulation, Accumulation::RoundToNearest);
    assert_eq!(r.score_reuse, ScoreReuse::BitwiseAsForward);
    assert_eq!(r.score_storage_rounding, 0.0);
}

/// The hypothesis holds up to `2^-5` inclusive: a storage unit roundoff of exactly `2^-5` is accepted, the next
/// number above it is refused, in both directions.
#[test]
fn the_hypothesis_is_inclusive_at_its_limit() {
    let h = Head::new(
        array![[0.0, 0.0]],
        array![[0.0, 0.0], [0.0, 0.0]],
        array![[1.0, 0.0], [1.0, 0.0]],
        array![[1.0, 0.0]],
        1.0,
        [true, true],
    );
    let at = |ut: f64| FlashRecipe { exp_error: 0.0, ..FlashRecipe::libm(ut, 0.0, 64) };
    let limit = 1.0 / 32.0;
    let fwd = forward_bounds(h.exact(), at(limit)).expect("2^-5 itself is allowed");
    assert!(backward_bounds(h.backward_exact(), &fwd, at(limit), 64).is_ok());
    let above = at(limit.next_up());
    assert!(matches!(forward_bounds(h.exact(), above), Err(Violation::Hypothesis { .. })));
    assert!(matches!(backward_bounds(h.backward_exact(), &fwd, above, 64), Err(Violation::Hypothesis { .. })));
}

/// The first-order hypothesis counts every visible key, also one whose weight underflows to 0: its score error is
/// still a perturbation of the row, so a key `3·10^5` below the row maximum (`2u|s − m| > 2^-5`) is refused.
#[test]
fn the_hypothesis_counts_keys_whose_weight_underflows() {
    let h = Head::new(
        array![[1.0, 0.0]],
        array![[-300_000.0, 0.0], [0.0, 0.0]],
        array![[1.0, 0.0], [1.0, 0.0]],
        array![[1.0, 0.0]],
        1.0,
        [true, true],
    );
    assert_eq!(h.p[[0, 0]], 0.0, "the first key's weight underflows");
    let r = FlashRecipe::libm(1.0 / 256.0, 2f64.powi(-133), 64);
    assert!(matches!(forward_bounds(h.exact(), r), Err(Violation::Hypothesis { .. })));
}

/// The sum factors count additions: `Lq + n_q` and `Lk + n_k` terms, not their products. With 1024 queries in query
/// tiles of one row (`n_q = 1024`) and 1024 keys in KV tiles of one key (`n_k = 1024`), `γ(2048)` is far inside the
/// hypothesis, while `γ(1024²)` would be above `2^-5` and refuse the bound.
#[test]
fn long_rows_in_single_row_tiles_stay_within_the_hypothesis() {
    for (len_q, len_k) in [(1024, 1), (1, 1024)] {
        let zeros = |rows| Array2::<f64>::zeros((rows, 1));
        let (q, k) = (zeros(len_q), zeros(len_k));
        let ones = |rows| Array2::<f64>::ones((rows, 1));
        let (v, d_out) = (ones(len_k), ones(len_q));
        let s = Array2::<f64>::zeros((len_q, len_k));
        let p = Array2::from_elem((len_q, len_k), 1.0 / len_k as f64);
        let o = ones(len_q);
        let lse = Array1::from_elem(len_q, (len_k as f64).ln());
        let dp = Array2::<f64>::ones((len_q, len_k));
        let delta = Array1::<f64>::ones(len_q);
        let ds = Array2::<f64>::zeros((len_q, len_k));
        let (dq, dk) = (zeros(len_q), zeros(len_k));
        let dv = Array2::from_elem((len_k, 1), len_q as f64 / len_k as f64);
        let forward = HeadExact {
            q: q.view(),
            k: k.view(),
            v: v.view(),
            s: s.view(),
            p: p.view(),
            o: o.view(),
            lse: lse.view(),
            scale: 1.0,
        };
        let x = HeadBackwardExact {
            forward,
            d_out: d_out.view(),
            dp: dp.view(),
            ds: ds.view(),
            delta: delta.view(),
            dq: dq.view(),
            dk: dk.view(),
            dv: dv.view(),
        };
        let r = FlashRecipe::libm(1.0 / 256.0, 2f64.powi(-133), 1);
        let fwd = forward_bounds(forward, r).expect("within the hypothesis");
        assert!(backward_bounds(x, &fwd, r, 1).is_ok(), "Lq = {len_q}, Lk = {len_k} in tiles of 1");
    }
}
