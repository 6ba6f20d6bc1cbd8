//! The GPU property suites in one place: what they draw (the harness's shapes rounded to the kernels' head dims, value
//! profiles, seeds, the backward's tilings), how many cases from which seed, the check of one drawn case, and the
//! coverage of their draws (`attnproof_harness::coverage`). `flash_forward` and `flash_backward` run them on the
//! production kernels and print their coverage; `mutants` runs every catalog kernel-text mutant through them; the
//! test below replays their draws without a device and requires every kernel feature to be drawn.

use std::cell::RefCell;

use crate::common::kernel_spec;
use attnproof_gpu::backward::BackwardTiling;
use attnproof_gpu::flash::KV_TILE;
use attnproof_harness::adversarial::{Direction, Repeat, Worst, backward_verdicts, forward_verdicts};
use attnproof_harness::candidate::{GpuCandidate, Storage};
use attnproof_harness::coverage::Coverage;
use attnproof_harness::generate::{ValueProfile, make_case, make_d_out};
use attnproof_harness::strategies::{profile, suite_config};
use attnproof_oracle::AttentionSpec;
use half::{bf16, f16};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};

/// The base of the GPU suites' seeds ("gpusuite" in ASCII); suite `n` of [`SUITES`] draws from `SUITE_SEED + n` unless
/// `PROPTEST_RNG_SEED` is set. Fixed, so that a suite's draws are known without a device (the coverage test replays
/// them) and a mutant's run through the general suite can be repeated; distinct, so that the bf16 and f16 suites do
/// not draw the same problems. `PROPTEST_RNG_SEED` draws fresh ones.
pub const SUITE_SEED: u64 = 0x6770_7573_7569_7465;

/// A storage dtype of the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
}

impl Dtype {
    /// The name [`Coverage`] records.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }
}

/// One GPU property suite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PropertySuite {
    /// Its name: the test's, the proptest regression file's.
    pub name: &'static str,
    /// Which kernels it runs.
    pub direction: Direction,
    /// The storage dtype of every case.
    pub dtype: Dtype,
    /// Cases per run, unless `PROPTEST_CASES` says otherwise.
    pub cases: u32,
    /// Its seed, unless `PROPTEST_RNG_SEED` says otherwise.
    pub seed: u64,
}

/// Every GPU property suite. The backward's cases cost about three times a forward's (one forward, then every dQ
/// strategy), hence half as many.
pub const SUITES: [PropertySuite; 4] = [
    PropertySuite {
        name: "gpu_flash_forward_bf16",
        direction: Direction::Forward,
        dtype: Dtype::Bf16,
        cases: 64,
        seed: SUITE_SEED,
    },
    PropertySuite {
        name: "gpu_flash_forward_f16",
        direction: Direction::Forward,
        dtype: Dtype::F16,
        cases: 64,
        seed: SUITE_SEED + 1,
    },
    PropertySuite {
        name: "gpu_flash_backward_bf16",
        direction: Direction::Backward,
        dtype: Dtype::Bf16,
        cases: 32,
        seed: SUITE_SEED + 2,
    },
    PropertySuite {
        name: "gpu_flash_backward_f16",
        direction: Direction::Backward,
        dtype: Dtype::F16,
        cases: 32,
        seed: SUITE_SEED + 3,
    },
];

/// The suite named `name`.
pub fn suite(name: &str) -> &'static PropertySuite {
    SUITES.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no GPU property suite `{name}`"))
}

impl PropertySuite {
    /// The configuration of a run ([`run_config`]).
    pub fn config(&self) -> Config {
        run_config(self.name, self.cases, self.seed)
    }

    /// The draws of a run without any `PROPTEST_*` override ([`default_run_config`]).
    pub fn default_config(&self) -> Config {
        default_run_config(self.name, self.cases, self.seed)
    }
}

/// The configuration of a GPU suite's run: the harness's (`PROPTEST_CASES` honoured, failures persisted under the
/// suite's `name`), from the suite's `seed` unless `PROPTEST_RNG_SEED` is set.
pub fn run_config(name: &str, cases: u32, seed: u64) -> Config {
    let mut config = suite_config(name, cases);
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        config.rng_seed = RngSeed::Fixed(seed);
    }
    config
}

/// The draws of a GPU suite's run without any `PROPTEST_*` override (as CI and `run.sh` run it): the suite's own case
/// count from its own seed, nothing replayed from a regression file.
pub fn default_run_config(name: &str, cases: u32, seed: u64) -> Config {
    Config { cases, rng_seed: RngSeed::Fixed(seed), failure_persistence: None, ..suite_config(name, cases) }
}

/// One draw: the problem, its value profile, its seed, and the backward's tiling (drawn in both directions, so that
/// the forward and backward suites draw from one strategy; the forward ignores it).
pub type Draw = (AttentionSpec, ValueProfile, u64, BackwardTiling);

/// What every GPU property suite draws.
pub fn draws() -> impl Strategy<Value = Draw> {
    (kernel_spec(), profile(), any::<u64>(), proptest::sample::select(BackwardTiling::ALL.to_vec()))
}

/// Runs `suite` under `config`, calling `check` on each draw and recording the coverage of the draws.
pub fn run_suite(
    suite: &PropertySuite,
    config: Config,
    check: impl Fn(&Draw) -> Result<(), TestCaseError>,
) -> (Coverage, Result<(), TestError<Draw>>) {
    let coverage = RefCell::new(Coverage::new(KV_TILE));
    let mut runner = TestRunner::new(config);
    let result = runner.run(&draws(), |draw| {
        coverage.borrow_mut().record(&draw.0, suite.dtype.name());
        check(&draw)
    });
    (coverage.into_inner(), result)
}

/// The check of one draw by `candidate` in `suite`'s direction and dtype: inputs A, B, A with outputs poisoned and
/// guarded (both A results bitwise equal), each verdict within bound with a valid gate; the backward also runs every
/// dQ strategy in the drawn tiling.
pub fn check(
    suite: &PropertySuite,
    candidate: &GpuCandidate,
    worst: &RefCell<Worst>,
    draw: &Draw,
) -> Result<(), TestCaseError> {
    match (suite.direction, suite.dtype) {
        (Direction::Forward, Dtype::Bf16) => check_forward::<bf16>(candidate, worst, draw),
        (Direction::Forward, Dtype::F16) => check_forward::<f16>(candidate, worst, draw),
        (Direction::Backward, Dtype::Bf16) => check_backward::<bf16>(candidate, worst, draw),
        (Direction::Backward, Dtype::F16) => check_backward::<f16>(candidate, worst, draw),
    }
}

/// The second input's seed, from the first's.
const SECOND_INPUT: u64 = 0x9e37_79b9_7f4a_7c15;

fn check_forward<T: Storage>(
    candidate: &GpuCandidate,
    worst: &RefCell<Worst>,
    (spec, profile, seed, _): &Draw,
) -> Result<(), TestCaseError> {
    let a = make_case::<T>(spec, *profile, *seed);
    let b = make_case::<T>(spec, *profile, seed ^ SECOND_INPUT);
    let verdicts = forward_verdicts(candidate, &[&a, &b], Repeat::FirstInput).map_err(|e| e.into_test_case_error())?;
    verdicts.iter().for_each(|v| worst.borrow_mut().record(v));
    Ok(())
}

fn check_backward<T: Storage>(
    candidate: &GpuCandidate,
    worst: &RefCell<Worst>,
    (spec, profile, seed, tiling): &Draw,
) -> Result<(), TestCaseError> {
    let candidate = candidate.clone().with_backward_tiling(*tiling);
    let seeds = [*seed, seed ^ SECOND_INPUT];
    let cases = seeds.map(|s| make_case::<T>(spec, *profile, s));
    let d_outs = seeds.map(|s| make_d_out::<T>(spec, s));
    let problems = [(&cases[0], &d_outs[0]), (&cases[1], &d_outs[1])];
    let verdicts =
        backward_verdicts(&candidate, &problems, Repeat::FirstInput).map_err(|e| e.into_test_case_error())?;
    verdicts.iter().for_each(|v| worst.borrow_mut().record(v));
    Ok(())
}

/// Runs `suite` on the production kernels: fails on the first case outside its bound, and prints the worst ratio
/// and the coverage of the draws. Without a device it reports its skip and returns.
pub fn run_production(suite: &PropertySuite) {
    let Some(candidate) = GpuCandidate::if_available(suite.name) else {
        return;
    };
    let worst = RefCell::new(Worst::default());
    let (coverage, result) = run_suite(suite, suite.config(), |draw| check(suite, &candidate, &worst, draw));
    if let Err(e) = result {
        panic!("{}: {e}", suite.name);
    }
    println!("{}: {} draws, worst error/bound {}", suite.name, coverage.draws, worst.borrow());
    print!("{coverage}");
}

/// The GPU suites' draws, replayed without a device from their default configuration, reach every kernel feature of
/// `attnproof_harness::coverage` together: a mask kind, a window class on either side, a head dim class, a GQA
/// group, a varlen pattern, a length class or a dtype that no suite draws would be a kernel path no general suite
/// tests. Prints each suite's table and the union's.
#[test]
fn the_gpu_suites_draw_every_kernel_feature() {
    let mut union = Coverage::new(KV_TILE);
    for suite in &SUITES {
        let (coverage, result) = run_suite(suite, suite.default_config(), |_| Ok(()));
        assert!(result.is_ok(), "{}: recording alone cannot fail: {result:?}", suite.name);
        assert_eq!(coverage.draws, suite.cases as usize, "{}: one draw per case", suite.name);
        println!("{}: {coverage}", suite.name);
        union.merge(&coverage);
    }
    print!("all GPU property suites: {union}");
    let missing = union.unreached();
    assert!(missing.is_empty(), "kernel features no GPU property suite draws: {missing:?}");
}

/// Both directions and both dtypes have a suite; every suite's name is unique (it names its regression file), and so
/// is its seed.
#[test]
fn every_direction_and_dtype_has_one_suite() {
    for direction in [Direction::Forward, Direction::Backward] {
        for dtype in [Dtype::Bf16, Dtype::F16] {
            let n = SUITES.iter().filter(|s| s.direction == direction && s.dtype == dtype).count();
            assert_eq!(n, 1, "{direction:?} {dtype:?}");
        }
    }
    for s in &SUITES {
        assert_eq!(suite(s.name), s);
        assert_eq!(SUITES.iter().filter(|t| t.seed == s.seed).count(), 1, "{}'s seed", s.name);
    }
}
