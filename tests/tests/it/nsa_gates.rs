//! NSA's gates (E18): the harness's gates verifier (`attnproof_harness::nsa::{verify_gate_combine,
//! verify_gate_backward}`) passes the oracle's own values rounded as the kernel stores them, over the draws of the GPU
//! suites, and rejects gates of moved logits, the gradients of another problem, logit gradients of a wrong derivative
//! and a NaN.

use attnproof_harness::candidate::Storage;
use attnproof_harness::nsa::{GateDraw, gate_draws, verify_gate_backward, verify_gate_combine};
use attnproof_harness::strategies::suite_config;
use attnproof_oracle::nsa::{gate_combine, gate_combine_backward};
use half::{bf16, f16};
use ndarray::{Array3, ArrayD, IxDyn};
use proptest::prelude::*;
use proptest::strategy::ValueTree;

/// The oracle's f64 gated sum and gradients of `draw`, stored as the kernel stores them (`O` and `dO_b` rounded to
/// `T`, the logits' gradients to f32), in the draw's shapes.
fn rounded<T: Storage>(draw: &GateDraw<T>) -> (ArrayD<T>, [ArrayD<T>; 3], ArrayD<f32>) {
    let rows = |t: &ArrayD<T>| {
        let cols = *t.shape().last().unwrap();
        let n = t.len().checked_div(cols).unwrap_or(0);
        Array3::from_shape_vec((n, 1, cols), t.iter().map(|x| f64::from(x.to_f32())).collect()).unwrap()
    };
    let b = draw.branches.each_ref().map(rows);
    let x = rows(&draw.gate_logits);
    let dy = rows(&draw.d_out);
    let (_, o) = gate_combine([b[0].view(), b[1].view(), b[2].view()], x.view(), ()).unwrap();
    let grads = gate_combine_backward([b[0].view(), b[1].view(), b[2].view()], x.view(), dy.view(), ()).unwrap();
    let store = |t: &Array3<f64>, shape: &[usize]| {
        ArrayD::from_shape_vec(IxDyn(shape), t.iter().map(|&v| T::from_f32(v as f32)).collect()).unwrap()
    };
    let shape = draw.d_out.shape();
    let dx = ArrayD::from_shape_vec(
        IxDyn(draw.gate_logits.shape()),
        grads.d_gate_logits.iter().map(|&v| v as f32).collect(),
    )
    .unwrap();
    (store(&o, shape), grads.d_branches.each_ref().map(|t| store(t, shape)), dx)
}

fn check<T: Storage>(draw: &GateDraw<T>) -> Result<(), TestCaseError> {
    let (o, d, dx) = rounded(draw);
    let forward = verify_gate_combine(draw, &o).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert!(forward.passed(), "{:?}", forward.failures);
    let backward = verify_gate_backward(draw, &d, &dx).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert!(backward.passed(), "{:?}", backward.failures);
    Ok(())
}

proptest! {
    #![proptest_config(suite_config("nsa_gates", 48))]

    #[test]
    fn the_oracle_rounded_as_stored_passes_the_gates_verifier_bf16(draw in gate_draws::<bf16>()) {
        check(&draw)?;
    }

    #[test]
    fn the_oracle_rounded_as_stored_passes_the_gates_verifier_f16(draw in gate_draws::<f16>()) {
        check(&draw)?;
    }
}

#[test]
fn the_gates_verifier_rejects_moved_gates_moved_gradients_a_wrong_derivative_and_nan() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let draw = loop {
        let d = gate_draws::<bf16>().new_tree(&mut runner).unwrap().current();
        if d.d_out.len() >= 8 && d.gate_logits.iter().any(|x| x.to_f32().abs() > 0.5) {
            break d;
        }
    };
    let (o, d, dx) = rounded(&draw);
    assert!(verify_gate_combine(&draw, &o).unwrap().passed());
    // Every compressed branch's logit moved by 3.
    let mut swapped = draw.clone();
    for (i, x) in swapped.gate_logits.iter_mut().enumerate() {
        if i % 3 == 0 {
            *x = bf16::from_f32(x.to_f32() + 3.0);
        }
    }
    assert!(!verify_gate_combine(&swapped, &o).unwrap().passed(), "a moved gate passed");
    // The gradients of another problem (every logit moved) fail the logits' and the branches' checks.
    let (_, d_moved, dx_moved) = rounded(&swapped);
    let verdict = verify_gate_backward(&draw, &d_moved, &dx_moved).unwrap();
    assert!(!verdict.passed(), "moved gradients passed");
    // Logit gradients half again as large (a wrong derivative).
    let squared = dx.mapv(|v| v * 1.5);
    assert!(!verify_gate_backward(&draw, &d, &squared).unwrap().passed(), "scaled logit gradients passed");
    let mut nan = o.clone();
    *nan.iter_mut().next().unwrap() = bf16::NAN;
    assert!(!verify_gate_combine(&draw, &nan).unwrap().passed());
    assert!(verify_gate_backward(&draw, &d, &dx).unwrap().passed());
}
