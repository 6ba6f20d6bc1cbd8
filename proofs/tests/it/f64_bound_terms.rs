//! The f64 oracle's bound model (proofs/src/f64_oracle_bound.rs) term by term: every term of the model, evaluated by
//! hand on cases small enough to do on paper, against `head_bounds` and `problem_bounds`. A term dropped, mis-signed
//! or mis-scaled changes one of these numbers, whereas the theorem's own test only sees a bound that got too small.
//!
//! The constants are restated here rather than imported (`u = 2^-53`, the second-order factor `1 + 2^-10`, the
//! subnormal unit `2^-1074`), so that a wrong constant in the model cannot agree with itself.

use crate::common::{PREC, mp_matrix};
use attnproof_oracle::dense;
use attnproof_oracle::{AttentionSpec, DenseConfig, Mp, Real};
use attnproof_proofs::backward::HeadCase;
use attnproof_proofs::f64_oracle_bound::{HeadBounds, compare, gamma, head_bounds, problem_bounds};
use attnproof_proofs::residual::Violation;
use ndarray::{Array2, ArrayD, IxDyn, array};

/// Unit roundoff of f64, `2^-53`.
const U: f64 = 1.0 / 9_007_199_254_740_992.0;
/// The factor that covers second-order terms, `1 + 2^-10`.
const F: f64 = 1.0 + 1.0 / 1024.0;
/// The smallest subnormal, `2^-1074`: the absolute error of an underflowing result.
fn tiny() -> f64 {
    f64::from_bits(1)
}

/// `γ_n = nu / (1 − nu)`, by hand.
fn g(n: f64) -> f64 {
    n * U / (1.0 - n * U)
}

/// The model's bounds for one head given as f64 matrices (all exact in MPFR).
fn bounds(
    q: &Array2<f64>,
    k: &Array2<f64>,
    v: &Array2<f64>,
    d_out: &Array2<f64>,
    visible: Array2<bool>,
    scale: f64,
) -> HeadBounds {
    let mp = |a: &Array2<f64>| mp_matrix(a.nrows(), a.ncols(), &a.iter().copied().collect::<Vec<_>>());
    let case = HeadCase { q: mp(q), k: mp(k), v: mp(v), d_out: mp(d_out), visible, scale: Mp::new(scale, PREC) };
    let fwd = dense::head_forward(case.inputs(), &case.scale, DenseConfig::default(), PREC);
    let grads = dense::head_backward(case.inputs(), case.d_out.view(), &fwd, &case.scale, DenseConfig::default(), PREC);
    head_bounds(&case, &fwd, &grads).expect("small cases satisfy the hypothesis")
}

/// `got` equals the hand value to 1e-12 relative: the two evaluate the same sums in different orders, so they agree
/// to a few units in the last place, while the smallest term checked here is `u ≈ 1e-16` of a bound near `1e-15`, so
/// far above that.
#[track_caller]
fn close(what: &str, got: f64, want: f64) {
    assert!(want > 0.0, "{what}: a hand value must be positive to test anything, got {want:e}");
    assert!(((got - want) / want).abs() <= 1e-12, "{what}: model {got:e}, hand-derived {want:e}");
}

/// One query, one key, `d = dv = 1`: `q = k = 1`, `v = 2`, `dO = 3`, `α = 1`. Then `s = m = LSE = 1`, `p = 1`,
/// `O = 2`, `dP = D = 6`, `dS = 0`, so every term multiplied by `|v − o|`, `|s − m|`, `|dS|` or `|dP − D|` is zero and
/// what remains is each output's own rounding and the propagated `η`, `π`.
#[test]
fn single_key_terms() {
    let b = bounds(&array![[1.0]], &array![[1.0]], &array![[2.0]], &array![[3.0]], array![[true]], 1.0);
    let sigma = g(1.0) + 3.0 * U; // (γ_d + 3u)|α| Σ|q||k|
    let eta = sigma + 2.0 * U; // σ + u|s − m| + 2u, with s = m
    let o_raw = g(1.0) * 2.0 + (g(1.0) + U) * 2.0; // γ_Lk Σ p|v| + (γ_Lk + u)|o|
    let lse_raw = eta + g(1.0) + U * 1.0; // Σ p η + γ_Lk + 2u|log ℓ| + u|LSE|, log ℓ = 0
    let pi = sigma + lse_raw + 2.0 * U; // σ + b^L + u|s − LSE| + 2u
    let rho = g(1.0) * 3.0 * 2.0; // γ_dv |dO||v|
    let nu = g(1.0) * 3.0 * 2.0 + 3.0 * o_raw; // γ_dv |dO||o| + |dO| b^O
    let zeta = rho + nu; // p (ρ + ν)
    close("O", b.o[[0, 0]], o_raw * F);
    close("LSE", b.lse[0], lse_raw * F);
    close("D", b.delta[0], nu * F);
    close("dQ", b.dq[[0, 0]], zeta * F);
    close("dK", b.dk[[0, 0]], zeta * F);
    close("dV", b.dv[[0, 0]], (pi + g(1.0)) * 3.0 * F);
}

/// One query, two keys, `d = dv = 2`, all terms non-zero: unequal scores (`|s − m| ≠ 0, 1`), values on both sides of
/// `O`, and a non-zero `dS`. Each line below is one term of the model's docs, in the same order.
#[test]
fn two_key_terms() {
    let q = array![[1.5, -0.5]];
    let k = array![[0.5, 1.0], [2.0, -1.0]];
    let v = array![[0.0, 4.0], [1.0, -2.0]];
    let d_out = array![[1.0, -3.0]];
    let alpha = 0.75;
    let b = bounds(&q, &k, &v, &d_out, array![[true, true]], alpha);

    let s = [alpha * (0.75 - 0.5), alpha * (3.0 + 0.5)];
    let abs_qk = [0.75 + 0.5, 3.0 + 0.5];
    let m = s[1];
    let ell = (s[0] - m).exp() + 1.0;
    let lse = m + ell.ln();
    let p = [(s[0] - m).exp() / ell, 1.0 / ell];
    let o = [p[1], 4.0 * p[0] - 2.0 * p[1]];
    let sigma = abs_qk.map(|x| (g(2.0) + 3.0 * U) * alpha * x);
    let eta = [sigma[0] + U * (s[0] - m).abs() + 2.0 * U, sigma[1] + 2.0 * U];
    let o_raw = [0, 1].map(|c| {
        (0..2).map(|j| p[j] * eta[j] * (v[[j, c]] - o[c]).abs()).sum::<f64>()
            + g(2.0) * (0..2).map(|j| p[j] * v[[j, c]].abs()).sum::<f64>()
            + (g(2.0) + U) * o[c].abs()
    });
    let lse_raw = p[0] * eta[0] + p[1] * eta[1] + g(2.0) + 2.0 * U * (lse - m).abs() + U * lse.abs();
    let pi = [0, 1].map(|j| sigma[j] + lse_raw + U * (s[j] - lse).abs() + 2.0 * U);
    let dp = [0, 1].map(|j| d_out[[0, 0]] * v[[j, 0]] + d_out[[0, 1]] * v[[j, 1]]);
    let delta = d_out[[0, 0]] * o[0] + d_out[[0, 1]] * o[1];
    let ds = [0, 1].map(|j| p[j] * (dp[j] - delta));
    let rho = [0, 1].map(|j| g(2.0) * (d_out[[0, 0]].abs() * v[[j, 0]].abs() + d_out[[0, 1]].abs() * v[[j, 1]].abs()));
    let nu = g(2.0) * (o[0].abs() + 3.0 * o[1].abs()) + o_raw[0] + 3.0 * o_raw[1];
    let zeta = [0, 1].map(|j| (pi[j] + 2.0 * U) * ds[j].abs() + p[j] * (rho[j] + nu));
    assert!(ds.iter().all(|x| x.abs() > 0.1), "the case must exercise the dS terms: {ds:?}");

    for c in 0..2 {
        close(&format!("O[{c}]"), b.o[[0, c]], o_raw[c] * F);
        let dq = alpha * (ds[0] * k[[0, c]] + ds[1] * k[[1, c]]);
        let dq_raw = alpha * (0..2).map(|j| (zeta[j] + g(2.0) * ds[j].abs()) * k[[j, c]].abs()).sum::<f64>()
            + 3.0 * U * dq.abs();
        close(&format!("dQ[{c}]"), b.dq[[0, c]], dq_raw * F);
        for j in 0..2 {
            let dk = alpha * ds[j] * q[[0, c]];
            let dk_raw = alpha * (zeta[j] + g(1.0) * ds[j].abs()) * q[[0, c]].abs() + 3.0 * U * dk.abs();
            close(&format!("dK[{j},{c}]"), b.dk[[j, c]], dk_raw * F);
            close(&format!("dV[{j},{c}]"), b.dv[[j, c]], p[j] * (pi[j] + g(1.0)) * d_out[[0, c]].abs() * F);
        }
    }
    close("LSE", b.lse[0], lse_raw * F);
    close("D", b.delta[0], nu * F);
}

/// The underflow terms, isolated: the only visible key has `v = 0` while a masked key has `v = 4`, so `O = 0`, every
/// relative term vanishes and each bound below is a whole number of subnormal units (exact, so compared exactly; the
/// second-order factor rounds away on that grid). `dO = 2`, so that no factor of these terms is 1.
#[test]
fn underflow_terms() {
    let b = bounds(
        &array![[1.0]],
        &array![[1.0], [1.0]],
        &array![[0.0], [4.0]],
        &array![[2.0]],
        array![[true, false]],
        2.0,
    );
    // Lk · 2^-1074 · (max_j |v_j| + |o|), the maximum taken over masked keys too.
    assert_eq!(b.o[[0, 0]], 8.0 * tiny(), "O's underflow term");
    // dV of the masked key: Lq · 2^-1074 · max_i |dO_i|.
    assert_eq!(b.dv[[1, 0]], 2.0 * tiny(), "dV's underflow term");
    // dK of the masked key: |α| ζ |q| with ζ = 2^-1074 |dP − D| = 8 · 2^-1074 (dP = 2 · 4, D = 0).
    assert_eq!(b.dk[[1, 0]], 16.0 * tiny(), "dS's underflow term, through dK");
    // dQ: |α| Σ_j ζ_j |k_j|, ζ_0 = p ν = |dO| b^O = 16 · 2^-1074 and ζ_1 = 8 · 2^-1074.
    assert_eq!(b.dq[[0, 0]], 48.0 * tiny(), "ν's share of b^O, through dQ");
    assert_eq!(b.delta[0], 16.0 * tiny(), "D: |dO| b^O");
}

/// The theorem's report gives the largest ratio over its outputs.
#[test]
fn the_report_gives_the_largest_ratio() {
    use attnproof_proofs::f64_oracle_bound::{BoundReport, OutputRatio};
    let ratio = |output, max_ratio| OutputRatio { output, max_ratio, index: vec![] };
    let report = BoundReport { outputs: vec![ratio("O", 0.25), ratio("dK", 0.75), ratio("dV", 0.5)] };
    assert_eq!(report.max_ratio(), 0.75);
    assert_eq!(BoundReport { outputs: vec![] }.max_ratio(), 0.0);
}

/// GQA: the model sums the per-head dK and dV bounds of a KV head's query heads and adds `γ_g Σ_h |dK_h|` (and the
/// same for dV), for the rounding of that sum.
#[test]
fn gqa_sum_term() {
    let spec = AttentionSpec::dense(1, 3, 1, 2, 3, 2, 2);
    let t = attnproof_oracle::inputs::uniform_tensor;
    let (q, k, v, d_out) = (t(11, &[1, 3, 2, 2]), t(12, &[1, 1, 3, 2]), t(13, &[1, 1, 3, 2]), t(14, &[1, 3, 2, 2]));
    let whole = problem_bounds(&spec, q.view(), k.view(), v.view(), d_out.view(), PREC).unwrap();
    let scale = spec.scale_value::<Mp>(PREC);
    let kv = |a: &ArrayD<f64>| mp_matrix(3, 2, &a.iter().copied().collect::<Vec<_>>());
    let (km, vm) = (kv(&k), kv(&v));
    let mut sum_dk = Array2::<f64>::zeros((3, 2));
    let mut sum_dv = Array2::<f64>::zeros((3, 2));
    let mut abs_dk = Array2::<f64>::zeros((3, 2));
    let mut abs_dv = Array2::<f64>::zeros((3, 2));
    for h in 0..3 {
        let rows = |a: &ArrayD<f64>| {
            let head = a.index_axis(ndarray::Axis(1), h);
            mp_matrix(2, 2, &head.iter().copied().collect::<Vec<_>>())
        };
        let case = HeadCase {
            q: rows(&q),
            k: km.clone(),
            v: vm.clone(),
            d_out: rows(&d_out),
            visible: Array2::from_elem((2, 3), true),
            scale: scale.clone(),
        };
        let fwd = dense::head_forward(case.inputs(), &case.scale, DenseConfig::default(), PREC);
        let grads =
            dense::head_backward(case.inputs(), case.d_out.view(), &fwd, &case.scale, DenseConfig::default(), PREC);
        let b = head_bounds(&case, &fwd, &grads).unwrap();
        sum_dk += &b.dk;
        sum_dv += &b.dv;
        abs_dk += &grads.dk.mapv(|x| x.to_f64().abs());
        abs_dv += &grads.dv.mapv(|x| x.to_f64().abs());
    }
    assert_eq!(gamma(3), g(3.0), "γ_n");
    for j in 0..3 {
        for c in 0..2 {
            let at = IxDyn(&[0, 0, j, c]);
            close(&format!("dK[{j},{c}]"), whole.dk[&at], sum_dk[[j, c]] + g(3.0) * abs_dk[[j, c]] * F);
            close(&format!("dV[{j},{c}]"), whole.dv[&at], sum_dv[[j, c]] + g(3.0) * abs_dv[[j, c]] * F);
        }
    }
}

/// The model holds only while every first-order perturbation is at most `2^-20`: scores `2·10^10` apart make
/// `u|s − m| ≈ 2.2·10^-6` and the bound is refused, not returned.
#[test]
fn the_hypothesis_refuses_perturbations_above_its_limit() {
    let case = |gap: f64| {
        let mp = |a: &Array2<f64>| mp_matrix(a.nrows(), a.ncols(), &a.iter().copied().collect::<Vec<_>>());
        HeadCase {
            q: mp(&array![[1.0]]),
            k: mp(&array![[gap / 2.0], [-gap / 2.0]]),
            v: mp(&array![[1.0], [2.0]]),
            d_out: mp(&array![[1.0]]),
            visible: array![[true, true]],
            scale: Mp::new(1.0, PREC),
        }
    };
    let bounds = |c: &HeadCase| {
        let fwd = dense::head_forward(c.inputs(), &c.scale, DenseConfig::default(), PREC);
        let grads = dense::head_backward(c.inputs(), c.d_out.view(), &fwd, &c.scale, DenseConfig::default(), PREC);
        head_bounds(c, &fwd, &grads)
    };
    assert!(bounds(&case(2.0e10)).is_err_and(|v| matches!(v, attnproof_proofs::Violation::Hypothesis { .. })));
    assert!(bounds(&case(2.0e8)).is_ok(), "u · 2·10^8 ≈ 2.2·10^-8 is within the hypothesis");
}

/// `dS`'s underflow term is `2^-1074 |dP − D|`, the gap and not the sum: for a masked key every other term of its
/// `ζ` vanishes (`p = 0`, `dS = 0`), so its `dK` bound is `|α| 2^-1074 |dP − D| |q|` exactly; here `D = O = 1` (the
/// visible key's value) and `dP = 4` (the masked key's), a gap of 3 where a sum would give 5.
#[test]
fn the_underflow_term_of_ds_is_the_gap_between_dp_and_d() {
    let b = bounds(
        &array![[1.0]],
        &array![[1.0], [1.0]],
        &array![[1.0], [4.0]],
        &array![[1.0]],
        array![[true, false]],
        2.0,
    );
    assert_eq!(b.dk[[1, 0]], 6.0 * tiny());
}

/// `compare`'s verdict on one row of candidates against exact values under a bound of `2^-10` everywhere.
fn compare_row(candidate: &[f64], exact: &[f64]) -> Result<attnproof_proofs::f64_oracle_bound::OutputRatio, Violation> {
    let n = candidate.len();
    let candidate = ArrayD::from_shape_vec(IxDyn(&[n]), candidate.to_vec()).unwrap();
    let exact = ArrayD::from_shape_vec(IxDyn(&[n]), exact.iter().map(|&x| Mp::new(x, PREC)).collect()).unwrap();
    compare("O", &candidate, &exact, &ArrayD::from_elem(IxDyn(&[n]), 1.0 / 1024.0))
}

#[test]
fn the_comparison_fails_a_nan_and_an_unmatched_infinity_and_passes_matched_ones() {
    let non_finite = |candidate: &[f64], exact: &[f64]| matches!(compare_row(candidate, exact), Err(Violation::NonFinite { index, .. }) if index == [1]);
    assert!(non_finite(&[1.0, f64::NAN], &[1.0, 1.0]), "a NaN candidate");
    assert!(non_finite(&[1.0, f64::NAN], &[1.0, f64::NAN]), "NaN on both sides");
    assert!(non_finite(&[1.0, 1.0], &[1.0, f64::INFINITY]), "a finite candidate for an infinity");
    assert!(non_finite(&[1.0, f64::INFINITY], &[1.0, f64::NEG_INFINITY]), "an infinity of the wrong sign");
    assert!(non_finite(&[1.0, f64::INFINITY], &[1.0, 1.0]), "an infinity for a finite value");
    let matched = compare_row(&[f64::NEG_INFINITY, 1.0], &[f64::NEG_INFINITY, 1.0]).unwrap();
    assert_eq!((matched.max_ratio, matched.index.as_slice()), (0.0, [].as_slice()));
}

#[test]
fn an_error_equal_to_its_bound_passes_and_the_worst_element_is_the_first_largest_ratio() {
    let step = 1.0 / 1024.0;
    let exactly_at_bound = compare_row(&[1.0], &[1.0 + step]).unwrap();
    assert_eq!(exactly_at_bound.max_ratio, 1.0);
    assert!(matches!(compare_row(&[1.0], &[1.0 + 2.0 * step]), Err(Violation::Bound { ratio, .. }) if ratio == 2.0));
    // Ratios 1/4, 1/2, 1/2, 1/8: the worst is the first of the two halves.
    let exact = [1.0, 2.0, 3.0, 4.0];
    let candidate = [1.0 + step / 4.0, 2.0 - step / 2.0, 3.0 + step / 2.0, 4.0 - step / 8.0];
    let worst = compare_row(&candidate, &exact).unwrap();
    assert_eq!((worst.output, worst.max_ratio, worst.index.as_slice()), ("O", 0.5, [1].as_slice()));
}
