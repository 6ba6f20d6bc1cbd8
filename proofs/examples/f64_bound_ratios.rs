//! Prints the distribution of `error / bound` of the f64 oracle against the MPFR oracle, output
//! by output, over deterministic problems of growing size: how tight the derived bound is.
//! Run: `cargo run --release -p attnproof-proofs --example f64_bound_ratios`.

use attnproof_oracle::inputs::uniform_tensor;
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Mask, Precision, Scale, backward_f64};
use attnproof_proofs::f64_oracle_bound::f64_oracle_within_bound;

fn main() {
    let mut ratios: std::collections::BTreeMap<&'static str, Vec<f64>> = Default::default();
    let mut seed = 0;
    for len in [7, 33, 64, 129] {
        for d in [4, 16, 64] {
            for (mask, scale) in [(Mask::None, Scale::InverseSqrtHeadDim), (Mask::Causal, Scale::Value(4.0))] {
                let spec = AttentionSpec::dense(1, 2, 1, len, len + 3, d, d).with_mask(mask).with_scale(scale);
                let mut t = |op| {
                    seed += 1;
                    uniform_tensor(seed, &spec.expected_shape(op))
                };
                let (q, k, v, g) = (t(Operand::Q), t(Operand::K), t(Operand::V), t(Operand::O));
                let report = f64_oracle_within_bound(
                    &|s, q, k, v, g| backward_f64(s, q, k, v, g),
                    &spec,
                    q.view(),
                    k.view(),
                    v.view(),
                    g.view(),
                    Precision(256),
                )
                .expect("the f64 oracle is within its bound");
                for o in report.outputs {
                    ratios.entry(o.output).or_default().push(o.max_ratio);
                }
            }
        }
    }
    println!("max error/bound per problem, over {} problems:", ratios.values().next().map_or(0, Vec::len));
    println!("{:<4} {:>10} {:>10} {:>10}", "out", "min", "median", "max");
    for (name, mut r) in ratios {
        r.sort_by(f64::total_cmp);
        println!("{name:<4} {:>10.2e} {:>10.2e} {:>10.2e}", r[0], r[r.len() / 2], r[r.len() - 1]);
    }
}
