//! The GPU property suites in one place: what they draw (the harness's shapes rounded to the kernels' head dims, value
//! profiles, seeds, the backward's tilings), how many cases from which seed, the check of one drawn case, and the
//! coverage of their draws (`attnproof_harness::coverage`). `flash_forward` and `flash_backward` run them on the
//! production kernels, and the dense `wgmma` forward's and backward's two suites each on those kernels, and print their coverage; `mutants` runs every catalog kernel-text mutant through them; the
//! test below replays their draws without a device and requires every kernel feature to be drawn.

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use crate::common::{TypedSuite, kernel_spec};
use attnproof_gpu::backward::BackwardTiling;
use attnproof_gpu::compile::{self, FLASH_BWD_SM90, FLASH_FWD_SM90, ModuleVariant};
use attnproof_gpu::flash::{KV_TILE, WGMMA_KV_TILE, WGMMA_MAX_HEAD_DIM, wgmma_uses_tma};
use attnproof_gpu::skip_unless_hopper;
use attnproof_harness::adversarial::{Direction, Repeat, Worst, backward_verdicts, forward_verdicts};
use attnproof_harness::candidate::{GpuCandidate, Storage};
use attnproof_harness::coverage::Coverage;
use attnproof_harness::generate::{ValueProfile, make_case, make_d_out};
use attnproof_harness::strategies::{profile, spec, suite_config};
use attnproof_oracle::AttentionSpec;
use cudarc::driver::CudaContext;
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

/// The kernels a suite runs, which decide what it draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SuiteKernel {
    /// The production kernels (`flash_fwd`, `flash_bwd`) in every backward tiling, over every head dim, with lengths
    /// around the forward's 64-key tile.
    Production,
    /// The backward's KV owner on Hopper's `wgmma` (`flash_bwd_sm90`) in its dense mode, after the production
    /// forward: head dims up to [`WGMMA_MAX_HEAD_DIM`], its one tiling, lengths around its 128-key tile; on compute
    /// capability 9.0 only, where the dense wrapper chooses it for those head dims.
    WgmmaBackward,
    /// The sm_90a forward (`flash_fwd_sm90`) in its dense mode: head dims up to [`WGMMA_MAX_HEAD_DIM`] (both of its
    /// load paths: tensor maps from 64 columns, `cp.async` below), its one tiling, lengths around its 128-key tile; on
    /// compute capability 9.0 only, where the dense wrapper chooses it (`attnproof_gpu::production_forward`).
    WgmmaForward,
}

impl SuiteKernel {
    /// The KV tile whose edges the draws' lengths straddle (and the coverage classes them by).
    pub fn tile(self) -> usize {
        match self {
            SuiteKernel::Production => KV_TILE,
            SuiteKernel::WgmmaBackward | SuiteKernel::WgmmaForward => WGMMA_KV_TILE,
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
    /// The kernels it runs.
    pub kernel: SuiteKernel,
}

/// Every GPU property suite. The backward's cases cost about three times a forward's (one forward, then every dQ
/// strategy), hence half as many.
pub const SUITES: [PropertySuite; 8] = [
    PropertySuite {
        name: "gpu_flash_forward_bf16",
        direction: Direction::Forward,
        dtype: Dtype::Bf16,
        cases: 64,
        seed: SUITE_SEED,
        kernel: SuiteKernel::Production,
    },
    PropertySuite {
        name: "gpu_flash_forward_f16",
        direction: Direction::Forward,
        dtype: Dtype::F16,
        cases: 64,
        seed: SUITE_SEED + 1,
        kernel: SuiteKernel::Production,
    },
    PropertySuite {
        name: "gpu_flash_backward_bf16",
        direction: Direction::Backward,
        dtype: Dtype::Bf16,
        cases: 32,
        seed: SUITE_SEED + 2,
        kernel: SuiteKernel::Production,
    },
    PropertySuite {
        name: "gpu_flash_backward_f16",
        direction: Direction::Backward,
        dtype: Dtype::F16,
        cases: 32,
        seed: SUITE_SEED + 3,
        kernel: SuiteKernel::Production,
    },
    PropertySuite {
        name: "gpu_flash_wgmma_backward_bf16",
        direction: Direction::Backward,
        dtype: Dtype::Bf16,
        cases: 32,
        seed: SUITE_SEED + 4,
        kernel: SuiteKernel::WgmmaBackward,
    },
    PropertySuite {
        name: "gpu_flash_wgmma_backward_f16",
        direction: Direction::Backward,
        dtype: Dtype::F16,
        cases: 32,
        seed: SUITE_SEED + 5,
        kernel: SuiteKernel::WgmmaBackward,
    },
    PropertySuite {
        name: "gpu_flash_wgmma_forward_bf16",
        direction: Direction::Forward,
        dtype: Dtype::Bf16,
        cases: 64,
        seed: SUITE_SEED + 6,
        kernel: SuiteKernel::WgmmaForward,
    },
    PropertySuite {
        name: "gpu_flash_wgmma_forward_f16",
        direction: Direction::Forward,
        dtype: Dtype::F16,
        cases: 64,
        seed: SUITE_SEED + 7,
        kernel: SuiteKernel::WgmmaForward,
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

/// Runs the production kernel `kernel` through `runner`, a typed suite's runner (the NSA suites'), on a fresh stream
/// under the suite's [`run_config`]: skips without a device and panics with the failing draw.
pub fn run_typed_production<E: std::fmt::Display>(
    suite: &TypedSuite,
    kernel: attnproof_gpu::compile::KernelSource,
    runner: impl FnOnce(
        &TypedSuite,
        Config,
        &std::sync::Arc<cudarc::driver::CudaStream>,
        attnproof_gpu::compile::KernelSource,
    ) -> Result<(), E>,
) {
    let Some(ctx) = attnproof_gpu::skip_unless_gpu(suite.name) else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    if let Err(e) = runner(suite, run_config(suite.name, suite.cases, suite.seed), &stream, kernel) {
        panic!("{}: {e}", suite.name);
    }
}

/// Replays each typed suite's draws of `strategy` as CI runs them ([`default_run_config`], no device needed) and
/// asserts that together they reach every class in `all`, as `classes` names a draw's.
pub fn assert_typed_suites_reach<S: proptest::strategy::Strategy>(
    suites: &[TypedSuite],
    strategy: impl Fn() -> S,
    classes: impl Fn(&S::Value) -> Vec<&'static str>,
    all: &[&str],
) {
    for suite in suites {
        let seen = std::cell::RefCell::new(std::collections::BTreeSet::new());
        proptest::test_runner::TestRunner::new(default_run_config(suite.name, suite.cases, suite.seed))
            .run(&strategy(), |draw| {
                seen.borrow_mut().extend(classes(&draw));
                Ok(())
            })
            .expect("replay");
        let seen = seen.into_inner();
        for class in all {
            assert!(seen.contains(class), "{}: no draw of {class}: {seen:?}", suite.name);
        }
    }
}

/// The draws of a GPU suite's run without any `PROPTEST_*` override (as CI and `run.sh` run it): the suite's own case
/// count from its own seed, nothing replayed from a regression file.
pub fn default_run_config(name: &str, cases: u32, seed: u64) -> Config {
    Config { cases, rng_seed: RngSeed::Fixed(seed), failure_persistence: None, ..suite_config(name, cases) }
}

/// One draw: the problem, its value profile, its seed, and the backward's tiling (drawn in both directions, so that
/// the forward and backward suites draw from one strategy; the forward ignores it).
pub type Draw = (AttentionSpec, ValueProfile, u64, BackwardTiling);

/// The harness's problems around the sm_90a kernels' 128-key tile, head dims rounded up to multiples of 8 and those
/// above [`WGMMA_MAX_HEAD_DIM`] folded below it (d − 128: 256 becomes 128, 136 becomes 8).
fn wgmma_spec() -> impl Strategy<Value = AttentionSpec> {
    spec(WGMMA_KV_TILE).prop_map(|mut s| {
        for dim in [&mut s.head_dim, &mut s.head_dim_v] {
            *dim = dim.div_ceil(8) * 8;
            if *dim > WGMMA_MAX_HEAD_DIM {
                *dim -= WGMMA_MAX_HEAD_DIM;
            }
        }
        s
    })
}

/// What a suite of `kernel` draws: for the production kernels the harness's problems rounded to the kernels' head
/// dims, in every backward tiling; for the `wgmma` kernels [`wgmma_spec`]'s problems in their one tiling, and for the
/// forward every other draw's head dims moved into the tensor-map path's 64 ..= 128 (`64 + 8·(d/8 mod 9)`), the path
/// the dense wrapper runs, so that both load paths get draws of every other feature.
pub fn draws(kernel: SuiteKernel) -> BoxedStrategy<Draw> {
    match kernel {
        SuiteKernel::Production => {
            (kernel_spec(), profile(), any::<u64>(), proptest::sample::select(BackwardTiling::ALL.to_vec())).boxed()
        }
        SuiteKernel::WgmmaBackward => (wgmma_spec(), profile(), any::<u64>(), Just(BackwardTiling::DEFAULT)).boxed(),
        SuiteKernel::WgmmaForward => {
            let spec = (wgmma_spec(), any::<bool>()).prop_map(|(mut s, tensor_maps)| {
                if tensor_maps {
                    for dim in [&mut s.head_dim, &mut s.head_dim_v] {
                        *dim = 64 + 8 * ((*dim / 8) % 9);
                    }
                }
                s
            });
            (spec, profile(), any::<u64>(), Just(BackwardTiling::DEFAULT)).boxed()
        }
    }
}

/// Runs `suite` under `config`, calling `check` on each draw and recording the coverage of the draws.
pub fn run_suite(
    suite: &PropertySuite,
    config: Config,
    check: impl Fn(&Draw) -> Result<(), TestCaseError>,
) -> (Coverage, Result<(), TestError<Draw>>) {
    let coverage = RefCell::new(Coverage::new(suite.kernel.tile()));
    let mut runner = TestRunner::new(config);
    let result = runner.run(&draws(suite.kernel), |draw| {
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
pub const SECOND_INPUT: u64 = 0x9e37_79b9_7f4a_7c15;

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

/// The modules `candidate`'s check of `draw` in `suite` compiles: the forward's, and the backward's in the drawn
/// tiling for a backward suite.
pub fn draw_variants(suite: &PropertySuite, candidate: &GpuCandidate, draw: &Draw) -> Vec<ModuleVariant> {
    fn of<T: Storage>(suite: &PropertySuite, candidate: &GpuCandidate, draw: &Draw) -> Vec<ModuleVariant> {
        let (spec, _, _, tiling) = draw;
        let mut out = vec![candidate.forward_variant::<T>(spec)];
        if suite.direction == Direction::Backward {
            out.push(candidate.clone().with_backward_tiling(*tiling).backward_variant::<T>(spec));
        }
        out.into_iter().flatten().collect()
    }
    match suite.dtype {
        Dtype::Bf16 => of::<bf16>(suite, candidate, draw),
        Dtype::F16 => of::<f16>(suite, candidate, draw),
    }
}

/// How many draws ahead of the one under check [`compile_ahead`] compiles: enough to keep every core busy with
/// NVRTC while the checks launch and run the oracle, few enough that a run stopping at its first failing draw (a
/// mutant's) wastes little.
const COMPILE_AHEAD_DRAWS: usize = 8;

/// Sets the flag when dropped, so that [`compile_ahead`]'s helpers stop even when the run panics.
struct Stop<'a>(&'a AtomicBool);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Runs `run` while helper threads compile the modules of the draws ahead of it.
///
/// A suite's draws depend only on its configuration, so `replay` draws them again without a device and passes each
/// draw's modules to its sink; one thread per core compiles them (`attnproof_gpu::compile::module`, whose cache
/// compiles a variant once and lets a launch wait for a compile under way), at most [`COMPILE_AHEAD_DRAWS`] draws
/// ahead of the draw `run` has reached (`run` calls the function it is given once per draw, before the draw's
/// launches). Without it, every NVRTC compile (about a second for `flash_bwd`) ran between two launches, one at a
/// time, and a suite drawing a new head dim in nearly every case spent most of its time compiling. Compile errors
/// are left to the launches, which report them.
pub fn compile_ahead<R>(
    ctx: &Arc<CudaContext>,
    replay: impl FnOnce(&dyn Fn(Vec<ModuleVariant>)) + Send,
    run: impl FnOnce(&dyn Fn()) -> R,
) -> R {
    let compile = |v: &ModuleVariant| {
        let _ = compile::module(ctx, v.kernel, &v.defines);
    };
    run_ahead(compile, replay, run)
}

/// [`compile_ahead`] with any `compile` (the tests below count calls instead of compiling).
fn run_ahead<R>(
    compile: impl Fn(&ModuleVariant) + Sync,
    replay: impl FnOnce(&dyn Fn(Vec<ModuleVariant>)) + Send,
    run: impl FnOnce(&dyn Fn()) -> R,
) -> R {
    let reached = AtomicUsize::new(0);
    let done = AtomicBool::new(false);
    let (sender, receiver) = mpsc::channel::<ModuleVariant>();
    let receiver = Mutex::new(receiver);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        let (reached, done, receiver, compile) = (&reached, &done, &receiver, &compile);
        for _ in 0..threads {
            scope.spawn(move || {
                loop {
                    let next = receiver.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    match next {
                        Ok(v) if !done.load(Ordering::Relaxed) => compile(&v),
                        Ok(_) => continue,
                        Err(_) => break,
                    }
                }
            });
        }
        scope.spawn(move || {
            let seen = RefCell::new(HashSet::new());
            let drawn = Cell::new(0);
            replay(&|variants| {
                while !done.load(Ordering::Relaxed)
                    && drawn.get() >= reached.load(Ordering::Relaxed) + COMPILE_AHEAD_DRAWS
                {
                    std::thread::sleep(Duration::from_millis(2));
                }
                drawn.set(drawn.get() + 1);
                if done.load(Ordering::Relaxed) {
                    return;
                }
                for v in variants {
                    if seen.borrow_mut().insert(v.clone()) {
                        let _ = sender.send(v);
                    }
                }
            });
        });
        let _stop = Stop(done);
        run(&|| {
            reached.fetch_add(1, Ordering::Relaxed);
        })
    })
}

/// The candidate of `suite`'s kernels on a new stream, or `None` after reporting the skip: without a device, and for
/// the `wgmma` backward without compute capability 9.0.
pub fn suite_candidate(suite: &PropertySuite) -> Option<GpuCandidate> {
    match suite.kernel {
        SuiteKernel::Production => GpuCandidate::if_available(suite.name),
        SuiteKernel::WgmmaBackward => {
            let ctx = skip_unless_hopper(suite.name)?;
            let stream = ctx.new_stream().expect("create a stream");
            Some(GpuCandidate { backward_kernel: FLASH_BWD_SM90, ..GpuCandidate::production(stream) })
        }
        SuiteKernel::WgmmaForward => {
            let ctx = skip_unless_hopper(suite.name)?;
            let stream = ctx.new_stream().expect("create a stream");
            Some(GpuCandidate { forward_kernel: FLASH_FWD_SM90, ..GpuCandidate::production(stream) })
        }
    }
}

/// Runs `suite` on its kernels ([`suite_candidate`]): fails on the first case outside its bound, and prints the worst
/// ratio and the coverage of the draws. Without a device (or, for the `wgmma` backward, a Hopper one) it reports its
/// skip and returns.
pub fn run_production(suite: &PropertySuite) {
    let Some(candidate) = suite_candidate(suite) else {
        return;
    };
    let worst = RefCell::new(Worst::default());
    let ctx = candidate.stream.context().clone();
    let replay = |sink: &dyn Fn(Vec<ModuleVariant>)| {
        let config = Config { max_shrink_iters: 0, ..suite.config() };
        let _ = run_suite(suite, config, |draw| {
            sink(draw_variants(suite, &candidate, draw));
            Ok(())
        });
    };
    let (coverage, result) = compile_ahead(&ctx, replay, |next_draw| {
        run_suite(suite, suite.config(), |draw| {
            next_draw();
            check(suite, &candidate, &worst, draw)
        })
    });
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
    for suite in SUITES.iter().filter(|s| s.kernel == SuiteKernel::Production) {
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

/// The dense `wgmma` forward's and backward's suites, replayed without a device, each draw every kernel feature of
/// the kernel's dense mode together (lengths classed around its 128-key tile), all but the head dims it does not
/// take, and only problems it takes: head dims up to 128, multiples of 8, its one tiling. The forward's draw the
/// tensor-map path the dense wrapper runs (both head dims in 64 ..= 128) in at least a third of their cases, each
/// mask kind among them, and the `cp.async` path below 64 columns too.
#[test]
fn the_wgmma_suites_draw_every_feature_of_their_kernel() {
    for kernel in [SuiteKernel::WgmmaBackward, SuiteKernel::WgmmaForward] {
        let mut union = Coverage::new(WGMMA_KV_TILE);
        let (tensor_maps, cp_async, draws) = (Cell::new(0), Cell::new(0), Cell::new(0));
        let masks = RefCell::new(HashSet::new());
        for suite in SUITES.iter().filter(|s| s.kernel == kernel) {
            let (coverage, result) = run_suite(suite, suite.default_config(), |(spec, _, _, tiling)| {
                let (d, dv) = (spec.head_dim, spec.head_dim_v);
                prop_assert!(d <= WGMMA_MAX_HEAD_DIM && dv <= WGMMA_MAX_HEAD_DIM, "{spec:?}");
                prop_assert!(d % 8 == 0 && dv % 8 == 0, "{spec:?}");
                prop_assert_eq!(*tiling, BackwardTiling::DEFAULT);
                draws.set(draws.get() + 1);
                if wgmma_uses_tma(d, dv) {
                    tensor_maps.set(tensor_maps.get() + 1);
                    masks.borrow_mut().insert(std::mem::discriminant(&spec.mask));
                } else {
                    cp_async.set(cp_async.get() + 1);
                }
                Ok(())
            });
            result.unwrap_or_else(|e| panic!("{}: {e}", suite.name));
            union.merge(&coverage);
        }
        print!("{kernel:?} suites: {union}");
        let wide = ["128 < d < 256", "d = 256"];
        let missing: Vec<_> = union.unreached().into_iter().filter(|f| !wide.contains(f)).collect();
        assert!(missing.is_empty(), "features of the {kernel:?} kernel its suites never draw: {missing:?}");
        if kernel == SuiteKernel::WgmmaForward {
            let (tensor_maps, cp_async) = (tensor_maps.get(), cp_async.get());
            println!("{kernel:?}: {tensor_maps} of {} draws on tensor maps, {cp_async} on cp.async", draws.get());
            assert!(3 * tensor_maps >= draws.get() && cp_async > 0, "{tensor_maps} and {cp_async} of {}", draws.get());
            assert!(masks.borrow().len() >= 4, "mask kinds on the tensor-map path: {:?}", masks.borrow());
        }
    }
}

/// Each direction, dtype and kernel set has one suite (each `wgmma` kernel's in its own direction); every suite's
/// name is unique (it names its regression file), and so is its seed.
#[test]
fn every_direction_dtype_and_kernel_has_one_suite() {
    for (direction, kernel) in [
        (Direction::Forward, SuiteKernel::Production),
        (Direction::Backward, SuiteKernel::Production),
        (Direction::Backward, SuiteKernel::WgmmaBackward),
        (Direction::Forward, SuiteKernel::WgmmaForward),
    ] {
        for dtype in [Dtype::Bf16, Dtype::F16] {
            let n =
                SUITES.iter().filter(|s| s.direction == direction && s.dtype == dtype && s.kernel == kernel).count();
            assert_eq!(n, 1, "{direction:?} {dtype:?} {kernel:?}");
        }
    }
    assert!(SUITES.iter().all(|s| match s.kernel {
        SuiteKernel::Production => true,
        SuiteKernel::WgmmaBackward => s.direction == Direction::Backward,
        SuiteKernel::WgmmaForward => s.direction == Direction::Forward,
    }));
    for s in &SUITES {
        assert_eq!(suite(s.name), s);
        assert_eq!(SUITES.iter().filter(|t| t.seed == s.seed).count(), 1, "{}'s seed", s.name);
    }
}

/// A stand-in variant per draw: a `flash_fwd` "module" whose define names the draw.
fn variant_of_draw(n: usize) -> ModuleVariant {
    ModuleVariant { kernel: attnproof_gpu::compile::FLASH_FWD, defines: vec![format!("DRAW={n}")] }
}

/// The compile-ahead helpers compile each draw's modules once (a module two draws share, once in all), never more
/// than `COMPILE_AHEAD_DRAWS` draws ahead of the run, and not past a run that stops early; the run's result comes
/// back.
#[test]
fn compiling_ahead_stays_a_bounded_number_of_draws_ahead() {
    for (draws, stop_after) in [(40, 40), (40, 3), (5, 5), (0, 0)] {
        let reached = AtomicUsize::new(0);
        let compiled = Mutex::new(vec![]);
        let compile = |v: &ModuleVariant| {
            let draw: usize = v.defines[0].trim_start_matches("DRAW=").parse().expect("a draw number");
            compiled.lock().unwrap().push((draw, reached.load(Ordering::SeqCst)));
            std::thread::sleep(Duration::from_millis(1));
        };
        // Each draw lists its own module and the shared module of draw 0.
        let replay = |sink: &dyn Fn(Vec<ModuleVariant>)| {
            for n in 0..draws {
                sink(vec![variant_of_draw(n), variant_of_draw(0)]);
            }
        };
        let answer = run_ahead(compile, replay, |next_draw| {
            for n in 0..stop_after {
                next_draw();
                reached.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(3));
                if stop_after == draws {
                    // A launch waits for its module (the compile cache does): the run that reaches every draw
                    // needs every draw's module, however loaded the machine. A run that ends early needs no more.
                    let start = std::time::Instant::now();
                    while !compiled.lock().unwrap().iter().any(|&(d, _)| d == n) {
                        assert!(start.elapsed() < Duration::from_secs(60), "draw {n}'s module never compiled");
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
            stop_after * 2
        });
        assert_eq!(answer, stop_after * 2);
        let compiled = compiled.into_inner().unwrap();
        let mut once: Vec<usize> = compiled.iter().map(|&(d, _)| d).collect();
        once.sort();
        let before = once.len();
        once.dedup();
        assert_eq!(before, once.len(), "a module compiled twice: {compiled:?}");
        for &(draw, at) in &compiled {
            assert!(draw < at + COMPILE_AHEAD_DRAWS, "draw {draw} compiled when the run had reached {at}");
        }
        if stop_after == draws {
            assert_eq!(once, (0..draws).collect::<Vec<_>>(), "every draw's module, once");
        } else {
            assert!(once.iter().all(|&d| d < stop_after + COMPILE_AHEAD_DRAWS), "compiled past the stop: {once:?}");
        }
    }
}

/// A run that panics takes its helpers down with it instead of leaving them waiting for draws it will never reach.
#[test]
fn compiling_ahead_ends_with_a_panicking_run() {
    let replay = |sink: &dyn Fn(Vec<ModuleVariant>)| (0..100).for_each(|n| sink(vec![variant_of_draw(n)]));
    let outcome = std::panic::catch_unwind(|| {
        run_ahead(
            |_| {},
            replay,
            |next_draw| {
                next_draw();
                panic!("the run fails");
            },
        )
    });
    assert!(outcome.is_err());
}
