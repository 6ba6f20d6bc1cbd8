//! The first link of the trust chain: the f64 oracle agrees with the MPFR oracle within the
//! derived bound on proptest problems, and the bound rejects an f64 oracle fed f32-rounded inputs.

use crate::common::{PREC, f64_inputs, fail, spec};
use attnproof_oracle::{AttentionSpec, Gradients, OracleError, backward_f64};
use attnproof_proofs::Violation;
use attnproof_proofs::f64_oracle_bound::f64_oracle_within_bound;
use ndarray::ArrayViewD;
use proptest::prelude::*;

fn oracle(
    spec: &AttentionSpec,
    q: ArrayViewD<'_, f64>,
    k: ArrayViewD<'_, f64>,
    v: ArrayViewD<'_, f64>,
    g: ArrayViewD<'_, f64>,
) -> Result<Gradients<f64>, OracleError> {
    backward_f64(spec, q, k, v, g)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn f64_oracle_is_within_its_bound((spec, [q, k, v, g]) in spec(24, 16).prop_flat_map(f64_inputs)) {
        let report = f64_oracle_within_bound(&oracle, &spec, q.view(), k.view(), v.view(), g.view(), PREC)
            .map_err(fail)?;
        prop_assert!(report.max_ratio() <= 1.0);
    }
}

#[test]
fn bound_rejects_an_oracle_on_f32_rounded_inputs() {
    let spec = AttentionSpec::dense(1, 2, 1, 9, 7, 5, 3).with_mask(attnproof_oracle::Mask::Causal);
    let t = attnproof_oracle::inputs::uniform_tensor;
    let (q, k, v, g) = (t(1, &[1, 2, 9, 5]), t(2, &[1, 1, 7, 5]), t(3, &[1, 1, 7, 3]), t(4, &[1, 2, 9, 3]));
    let f32_inputs = |spec: &AttentionSpec,
                      q: ArrayViewD<'_, f64>,
                      k: ArrayViewD<'_, f64>,
                      v: ArrayViewD<'_, f64>,
                      g: ArrayViewD<'_, f64>| {
        let r = |a: ArrayViewD<'_, f64>| a.mapv(|x| x as f32 as f64);
        backward_f64(spec, r(q).view(), r(k).view(), r(v).view(), r(g).view())
    };
    let ok = f64_oracle_within_bound(&oracle, &spec, q.view(), k.view(), v.view(), g.view(), PREC)
        .expect("the oracle holds");
    assert!(ok.max_ratio() <= 1.0);
    let err = f64_oracle_within_bound(&f32_inputs, &spec, q.view(), k.view(), v.view(), g.view(), PREC).unwrap_err();
    assert!(matches!(err, Violation::Bound { .. }), "{err}");
}
