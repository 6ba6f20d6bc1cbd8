//! Bad input gives a typed error naming the argument, one test per kind of mistake.

use attnproof_oracle::{AttentionSpec, Layout, OracleError, Scale, backward_f64, forward_f64};
use ndarray::{ArrayD, IxDyn};

fn zeros(shape: &[usize]) -> ArrayD<f64> {
    ArrayD::zeros(IxDyn(shape))
}

/// A valid dense problem: B=1, Hq=4, Hkv=2, Lq=3, Lk=5, d=2, dv=3.
fn spec() -> AttentionSpec {
    AttentionSpec::dense(1, 4, 2, 3, 5, 2, 3)
}

fn run(spec: &AttentionSpec, q: &[usize], k: &[usize], v: &[usize]) -> Result<(), OracleError> {
    forward_f64(spec, zeros(q).view(), zeros(k).view(), zeros(v).view()).map(|_| ())
}

#[test]
fn valid_input_is_accepted() {
    assert_eq!(run(&spec(), &[1, 4, 3, 2], &[1, 2, 5, 2], &[1, 2, 5, 3]), Ok(()));
}

#[test]
fn shape_mismatch_names_the_tensor() {
    let err = run(&spec(), &[1, 4, 3, 2], &[1, 2, 5, 2], &[1, 2, 4, 3]).unwrap_err();
    assert_eq!(err, OracleError::ShapeMismatch { argument: "v", expected: vec![1, 2, 5, 3], actual: vec![1, 2, 4, 3] });
    let err = run(&spec(), &[1, 4, 3], &[1, 2, 5, 2], &[1, 2, 5, 3]).unwrap_err();
    assert!(matches!(err, OracleError::ShapeMismatch { argument: "q", .. }), "{err}");
}

#[test]
fn head_ratio_must_divide() {
    let mut s = spec();
    s.n_heads_kv = 3;
    let err = run(&s, &[1, 4, 3, 2], &[1, 3, 5, 2], &[1, 3, 5, 3]).unwrap_err();
    assert_eq!(err, OracleError::HeadRatio { n_heads_q: 4, n_heads_kv: 3 });
    s.n_heads_kv = 0;
    assert!(matches!(run(&s, &[1, 4, 3, 2], &[1, 0, 5, 2], &[1, 0, 5, 3]), Err(OracleError::HeadRatio { .. })));
}

#[test]
fn zero_head_dims_are_rejected() {
    let mut s = spec();
    s.head_dim = 0;
    assert_eq!(
        run(&s, &[1, 4, 3, 0], &[1, 2, 5, 0], &[1, 2, 5, 3]),
        Err(OracleError::ZeroDimension { argument: "head_dim" })
    );
    let mut s = spec();
    s.head_dim_v = 0;
    assert_eq!(
        run(&s, &[1, 4, 3, 2], &[1, 2, 5, 2], &[1, 2, 5, 0]),
        Err(OracleError::ZeroDimension { argument: "head_dim_v" })
    );
}

fn varlen(cu_q: Vec<i32>, cu_k: Vec<i32>) -> AttentionSpec {
    AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: cu_q, cu_seqlens_k: cu_k },
        ..AttentionSpec::dense(1, 2, 1, 0, 0, 2, 2)
    }
}

#[test]
fn non_monotone_cu_seqlens_are_rejected() {
    let s = varlen(vec![0, 3, 2], vec![0, 1, 2]);
    let err = run(&s, &[2, 2, 2], &[2, 1, 2], &[2, 1, 2]).unwrap_err();
    assert!(matches!(err, OracleError::CuSeqlens { argument: "cu_seqlens_q", .. }), "{err}");
    assert!(err.to_string().contains("decreases at index 2"), "{err}");
}

#[test]
fn cu_seqlens_must_start_at_zero_and_agree_in_length() {
    let err = run(&varlen(vec![0, 2], vec![1, 2]), &[2, 2, 2], &[2, 1, 2], &[2, 1, 2]).unwrap_err();
    assert!(matches!(err, OracleError::CuSeqlens { argument: "cu_seqlens_k", .. }), "{err}");
    let err = run(&varlen(vec![0, 2], vec![0, 1, 2]), &[2, 2, 2], &[2, 1, 2], &[2, 1, 2]).unwrap_err();
    assert!(matches!(err, OracleError::CuSeqlens { argument: "cu_seqlens_k", .. }), "{err}");
    let err = run(&varlen(vec![], vec![]), &[0, 2, 2], &[0, 1, 2], &[0, 1, 2]).unwrap_err();
    assert!(matches!(err, OracleError::CuSeqlens { argument: "cu_seqlens_q", .. }), "{err}");
}

#[test]
fn non_finite_inputs_are_rejected_with_their_index() {
    let s = spec();
    let q = zeros(&[1, 4, 3, 2]);
    let mut k = zeros(&[1, 2, 5, 2]);
    k[[0, 1, 4, 0]] = f64::NAN;
    let v = zeros(&[1, 2, 5, 3]);
    match forward_f64(&s, q.view(), k.view(), v.view()).unwrap_err() {
        OracleError::NonFinite { argument, index, .. } => {
            assert_eq!(argument, "k");
            assert_eq!(index, vec![0, 1, 4, 0]);
        }
        other => panic!("unexpected {other}"),
    }
    let mut g = zeros(&[1, 4, 3, 3]);
    g[[0, 3, 2, 2]] = f64::INFINITY;
    let err = backward_f64(&s, q.view(), zeros(&[1, 2, 5, 2]).view(), v.view(), g.view()).unwrap_err();
    assert!(matches!(err, OracleError::NonFinite { argument: "d_out", .. }), "{err}");
}

#[test]
fn non_finite_scale_is_rejected() {
    let s = spec().with_scale(Scale::Value(f64::INFINITY));
    let err = run(&s, &[1, 4, 3, 2], &[1, 2, 5, 2], &[1, 2, 5, 3]).unwrap_err();
    assert!(matches!(err, OracleError::NonFinite { argument: "scale", .. }), "{err}");
}
