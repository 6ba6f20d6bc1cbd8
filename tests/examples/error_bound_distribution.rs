//! Prints the distribution of `max(error / bound)` of the reference FlashAttention forward over
//! generated cases, per output and storage type: how tight the derived bound is in practice.
//! Run: `cargo run --release -p attnproof-harness --example error_bound_distribution [-- CASES]`.

use attnproof_harness::flash::recipe;
use attnproof_harness::generate::make_case;
use attnproof_harness::strategies::{profile, spec};
use attnproof_harness::{Case, verify_forward};
use attnproof_reference::{Element, TileConfig, flash_forward_owned};
use half::{bf16, f16};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, TestRng, TestRunner};

const TILE: usize = 16;

fn run<T: Element>(cases: usize) {
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::deterministic_rng(proptest::test_runner::RngAlgorithm::ChaCha),
    );
    let strategy = (spec(TILE), profile(), proptest::num::u64::ANY);
    let (mut o, mut lse, mut invalid, mut skipped) = (vec![], vec![], 0, 0);
    for _ in 0..cases {
        let (spec, profile, seed) = strategy.new_tree(&mut runner).expect("strategy").current();
        let case: Case<T> = make_case(&spec, profile, seed);
        let tiles = TileConfig { q_tile: TILE, kv_tile: TILE };
        let (out, l) = flash_forward_owned(&case.spec, &case.inputs(), tiles).expect("valid case");
        match verify_forward(&case, recipe::<T>(TILE), out.view(), l.view()) {
            Ok(v) => {
                invalid += usize::from(!v.valid());
                for r in &v.outputs {
                    // Outputs whose every error is exactly zero (empty or fully masked) say nothing.
                    if r.max_ratio > 0.0 {
                        if r.output == "O" { o.push(r.max_ratio) } else { lse.push(r.max_ratio) }
                    }
                }
            }
            Err(_) => skipped += 1,
        }
    }
    println!("{} ({cases} cases, {skipped} outside the model, {invalid} failing the gate)", T::NAME);
    for (name, mut r) in [("O", o), ("LSE", lse)] {
        r.sort_by(f64::total_cmp);
        let q = |p: f64| r[((r.len() - 1) as f64 * p) as usize];
        let above = r.iter().filter(|&&x| x >= 0.01).count() as f64 / r.len() as f64 * 100.0;
        println!(
            "  {name:<3} n={:<4} min {:.2e}  p10 {:.2e}  median {:.2e}  p90 {:.2e}  max {:.2e}  ({above:.0}% of cases ≥ 1% of the bound)",
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
