//! Prints the distribution of `max(error / bound)` of the reference FlashAttention forward and
//! backward (strategy B) over generated cases, per output and storage type: how tight the derived
//! bounds are in practice, and how many cases fail the discriminability gate.
//! Run: `cargo run --release -p attnproof-harness --example error_bound_distribution [-- CASES]`.

use std::collections::BTreeMap;

use attnproof_harness::backward::{BackwardCandidate, verify_backward};
use attnproof_harness::flash::recipe;
use attnproof_harness::generate::{make_case, make_d_out};
use attnproof_harness::strategies::{profile, spec};
use attnproof_harness::{Case, Verdict, verify_forward};
use attnproof_oracle::spec::Operand;
use attnproof_reference::{
    BackwardOutputs, BackwardStrategy, Element, TileConfig, flash_backward, flash_forward_owned,
};
use half::{bf16, f16};
use ndarray::ArrayD;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

const TILE: usize = 16;

/// Forward and backward verdicts of one case, or `None` when the case is outside the model.
fn verdicts<T: Element>(case: &Case<T>, seed: u64) -> Option<(Verdict, Verdict)> {
    let tiles = TileConfig { q_tile: TILE, kv_tile: TILE };
    let (o, lse) = flash_forward_owned(&case.spec, &case.inputs(), tiles).expect("valid case");
    let fwd = verify_forward(case, recipe::<T>(TILE), o.view(), lse.view()).ok()?;
    let d_out = make_d_out::<T>(&case.spec, seed);
    let zeros = |op| ArrayD::from_elem(case.spec.expected_shape(op), T::from_f32(0.0));
    let (mut dq, mut dk, mut dv) = (zeros(Operand::Q), zeros(Operand::K), zeros(Operand::V));
    let mut delta = ArrayD::from_elem(case.spec.expected_shape(Operand::RowStat), 0f32);
    let inputs = case.backward_inputs(&o, &lse, &d_out);
    let outputs = BackwardOutputs { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut(), delta: delta.view_mut() };
    flash_backward(&case.spec, &inputs, tiles, BackwardStrategy::KvOwnerPartialDq, outputs).expect("valid case");
    let candidate = BackwardCandidate { dq: dq.view(), dk: dk.view(), dv: dv.view(), delta: delta.view() };
    let bwd = verify_backward(case, &d_out, TILE, recipe::<T>(TILE), candidate).ok()?;
    Some((fwd, bwd))
}

fn run<T: Element>(cases: usize) {
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = (spec(TILE), profile(), proptest::num::u64::ANY);
    let mut ratios: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    let (mut invalid, mut skipped, mut failed) = (0, 0, 0);
    for _ in 0..cases {
        let (spec, profile, seed) = strategy.new_tree(&mut runner).expect("strategy").current();
        let case: Case<T> = make_case(&spec, profile, seed);
        let Some((fwd, bwd)) = verdicts(&case, seed) else {
            skipped += 1;
            continue;
        };
        for v in [&fwd, &bwd] {
            invalid += usize::from(!v.valid());
            failed += usize::from(!v.passed());
            for r in &v.outputs {
                // Outputs whose every error is exactly zero (empty or fully masked) say nothing.
                if r.max_ratio > 0.0 {
                    ratios.entry(r.output).or_default().push(r.max_ratio);
                }
            }
        }
    }
    println!(
        "{} ({cases} cases: {skipped} outside the model, {failed} verdicts failed, {invalid} gates invalid)",
        T::NAME
    );
    for (name, mut r) in ratios {
        r.sort_by(f64::total_cmp);
        let q = |p: f64| r[((r.len() - 1) as f64 * p) as usize];
        let above = r.iter().filter(|&&x| x >= 0.01).count() as f64 / r.len() as f64 * 100.0;
        println!(
            "  {name:<3} n={:<4} min {:.2e}  p10 {:.2e}  median {:.2e}  p90 {:.2e}  max {:.2e}  ({above:.0}% ≥ 1% of the bound)",
            r.len(),
            q(0.0),
            q(0.1),
            q(0.5),
            q(0.9),
            q(1.0)
        );
    }
}

fn main() {
    let cases = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(300);
    run::<bf16>(cases);
    run::<f16>(cases);
}
