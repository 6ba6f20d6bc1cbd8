//! Recipe conformance: tiny cases whose exact output under the reference's precision recipe is
//! worked out here step by step, so that a schedule that rounds at a different point (or not at
//! all) is caught even when its error would still fit the bound.

use attnproof_oracle::{AttentionSpec, Scale};
use attnproof_reference::{Element, Inputs, TileConfig, flash_forward_owned};
use half::{bf16, f16};
use ndarray::{ArrayD, IxDyn};

/// One query over two keys, `d = dv = 1`, scale 1: logits 0 and −1, values 0 and 1.
fn two_key_forward<T: Element>() -> (f32, f32) {
    let spec = AttentionSpec::dense(1, 1, 1, 1, 2, 1, 1).with_scale(Scale::Value(1.0));
    let t = |shape: &[usize], xs: &[f32]| {
        ArrayD::from_shape_vec(IxDyn(shape), xs.iter().map(|&x| T::from_f32(x)).collect()).unwrap()
    };
    let (q, k, v) = (t(&[1, 1, 1, 1], &[1.0]), t(&[1, 1, 2, 1], &[0.0, -1.0]), t(&[1, 1, 2, 1], &[0.0, 1.0]));
    let inputs = Inputs { q: q.view(), k: k.view(), v: v.view() };
    let (o, lse) = flash_forward_owned(&spec, &inputs, TileConfig { q_tile: 1, kv_tile: 2 }).unwrap();
    (o[[0, 0, 0, 0]].to_f32(), lse[[0, 0, 0]])
}

/// The recipe by hand: `p = exp(s − m)` in f32, `ℓ` sums the f32 `p`, the numerator takes
/// `round_T(p)`, `O = round_T(A/ℓ)`, `LSE = m + ln ℓ`.
fn expected<T: Element>() -> (f32, f32) {
    let p1 = (-1.0f32 - 0.0).exp();
    let l = 1.0f32 + p1;
    let a = T::round(1.0) * 0.0 + T::round(p1) * 1.0;
    (T::round(a / l), 0.0 + l.ln())
}

#[test]
fn forward_rounds_p_to_the_storage_type_before_pv_bf16() {
    let (o, lse) = two_key_forward::<bf16>();
    let (eo, expected_lse) = expected::<bf16>();
    assert_eq!(o.to_bits(), eo.to_bits(), "O = {o}, recipe gives {eo}");
    assert_eq!(lse.to_bits(), expected_lse.to_bits());
    // The case is chosen so that skipping the rounding of P changes O: the test can fail.
    let unrounded = bf16::round((-1.0f32).exp() / (1.0 + (-1.0f32).exp()));
    assert_ne!(eo.to_bits(), unrounded.to_bits());
}

#[test]
fn forward_rounds_p_to_the_storage_type_before_pv_f16() {
    let (o, lse) = two_key_forward::<f16>();
    let (eo, expected_lse) = expected::<f16>();
    assert_eq!(o.to_bits(), eo.to_bits(), "O = {o}, recipe gives {eo}");
    assert_eq!(lse.to_bits(), expected_lse.to_bits());
}
