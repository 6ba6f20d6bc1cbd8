//! What the GPU test modules share: the kernels' recipes and the guarded launches (NaN-poisoned outputs followed by
//! sentinel guard bands, device inputs checked unchanged afterwards), both at home in the harness
//! (`attnproof_harness::recipes`, `attnproof_harness::candidate`) and offered here with `String` errors for the
//! tests that launch patched kernel texts and ring steps by hand; the backward problem builder; and the check of one
//! draw of a token-list forward kernel (NSA's selected attention, DSA's token-sparse attention).

use std::sync::Arc;

use attnproof_gpu::backward::BackwardTiling;
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::flash::{ForwardTiling, KV_TILE};
use attnproof_gpu::{GpuBackwardStrategy, flash_forward};
use attnproof_harness::Case;
use attnproof_harness::adversarial::{AdversarialCase, Direction, Directions, Group, Worst, run_case};
use attnproof_harness::candidate::{BackwardProblem, ForwardRun, GpuCandidate, backward_guarded, forward_guarded};
use attnproof_harness::generate::{ValueProfile, make_case, make_d_out};
use attnproof_harness::recipes;
use attnproof_harness::strategies::spec;
use attnproof_oracle::{AttentionSpec, Mask};
use attnproof_proofs::flash_bound::FlashRecipe;
use attnproof_reference::Element;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};
use ndarray::ArrayD;
use proptest::strategy::Strategy;

pub use attnproof_harness::adversarial::{dense, gaussian, varlen};
pub use attnproof_harness::candidate::{Gradients as Grads, Storage};

/// A stream on the device for the test `test`, or `None` (and the skip line printed) without one.
pub fn device_stream(test: &str) -> Option<Arc<CudaStream>> {
    Some(attnproof_gpu::skip_unless_gpu(test)?.new_stream().expect("create a stream"))
}

/// The forward kernel's recipe for `T` (`attnproof_harness::recipes::gpu_forward`).
pub fn forward_recipe<T: Element>() -> FlashRecipe {
    recipes::gpu_forward::<T>()
}

/// The backward kernels' recipe for `T` in the default tiling (`attnproof_harness::recipes::gpu_backward`).
pub fn backward_recipe<T: Element>() -> FlashRecipe {
    backward_recipe_for::<T>(BackwardTiling::DEFAULT)
}

/// The backward kernels' recipe for `T` in `tiling`.
pub fn backward_recipe_for<T: Element>(tiling: BackwardTiling) -> FlashRecipe {
    recipes::gpu_backward::<T>(tiling).recipe
}

/// A host tensor on the device (`attnproof_harness::candidate::upload`).
pub fn upload<X: DeviceRepr + ValidAsZeroBits + Copy>(
    stream: &Arc<CudaStream>,
    t: &ArrayD<X>,
) -> Result<CudaSlice<X>, String> {
    attnproof_harness::candidate::upload(stream, t).map_err(|e| e.to_string())
}

/// One forward launch of `kernel` with `tiling`, guarded (`attnproof_harness::candidate::forward_guarded`). Returns
/// `O` and `LSE`.
pub fn run_forward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    kernel: KernelSource,
    tiling: ForwardTiling,
) -> Result<(ArrayD<T>, ArrayD<f32>), String> {
    let run = forward_guarded(stream, case, kernel, tiling).map_err(|e| e.to_string())?;
    Ok((run.o, run.lse))
}

/// A backward case: inputs, upstream gradient and the (unpatched) GPU forward's outputs.
pub struct Problem<T> {
    /// Inputs.
    pub case: Case<T>,
    /// Upstream gradient.
    pub d_out: ArrayD<T>,
    /// The forward's output.
    pub o: ArrayD<T>,
    /// The forward's LSE.
    pub lse: ArrayD<f32>,
}

/// Draws the case and its upstream gradient and runs the production GPU forward for `O` and `LSE`.
pub fn problem<T: Storage>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    profile: ValueProfile,
    seed: u64,
) -> Problem<T> {
    let case = make_case::<T>(spec, profile, seed);
    let d_out = make_d_out::<T>(spec, seed);
    let fwd = flash_forward(stream, spec, case.q.view(), case.k.view(), case.v.view())
        .unwrap_or_else(|e| panic!("GPU forward of {spec:?}: {e}"));
    Problem { case, d_out, o: fwd.o, lse: fwd.lse }
}

/// One backward of `kernel` with `strategy` in the default tiling, guarded.
pub fn run_backward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    p: &Problem<T>,
    kernel: KernelSource,
    strategy: GpuBackwardStrategy,
) -> Result<Grads<T>, String> {
    run_backward_guarded_tiled(stream, p, kernel, BackwardTiling::DEFAULT, strategy)
}

/// [`run_backward_guarded`] in `tiling` (`attnproof_harness::candidate::backward_guarded`).
pub fn run_backward_guarded_tiled<T: Storage>(
    stream: &Arc<CudaStream>,
    p: &Problem<T>,
    kernel: KernelSource,
    tiling: BackwardTiling,
    strategy: GpuBackwardStrategy,
) -> Result<Grads<T>, String> {
    // The forward's outputs travel by value in the harness's problem; one copy per launch is negligible beside it.
    let forward = ForwardRun { o: p.o.clone(), lse: p.lse.clone() };
    let problem = BackwardProblem { case: &p.case, forward: &forward, d_out: &p.d_out };
    backward_guarded(stream, problem, kernel, tiling, strategy).map_err(|e| e.to_string())
}

/// The harness's shapes (lengths around the kernels' 64-row tiles), head dims rounded up to the supported multiples
/// of 8 (the strategy's awkward 1, 59 and 111 included).
pub fn kernel_spec() -> impl Strategy<Value = AttentionSpec> {
    spec(KV_TILE).prop_map(|mut s| {
        s.head_dim = s.head_dim.div_ceil(8) * 8;
        s.head_dim_v = s.head_dim_v.div_ceil(8) * 8;
        s
    })
}

/// The small shapes that `run.sh sanitize` runs under compute-sanitizer's memcheck and racecheck
/// (`flash_forward::sanitizer_shapes`, `flash_backward::sanitizer_shapes`). Under the sanitizer every launch is about
/// a hundred times slower, so each shape is the smallest that reaches one edge of the kernels' index arithmetic or one
/// path of their pipelines (one batch, at most 4 heads, lengths at most 130); the adversarial table
/// (`candidate_tests!`) covers the same families with far more cases, too many for the sanitizer. Every case runs in
/// both directions.
pub fn sanitizer_shapes() -> Vec<AdversarialCase> {
    let case = |group: Group, why: &str, spec: AttentionSpec| AdversarialCase {
        name: format!("sanitizer {group:?} ({why}): {spec:?}"),
        group,
        spec,
        profile: gaussian(1.0),
        directions: Directions::Both,
    };
    vec![
        // Tail tiles: 65 queries are one 64-row query tile plus one row, 129 keys two 64-key forward tiles (one
        // 128-key backward tile) plus one key, so every last tile is partial and its loads and stores must be masked.
        case(Group::TileEdges, "tiles + 1", dense(1, 2, 2, 65, 129, 64, 64, Mask::Causal)),
        // One short of the tiles on both sides: the partial tile is the only tile.
        case(Group::TileEdges, "tiles - 1", dense(1, 2, 2, 63, 127, 64, 64, Mask::None)),
        // Bottom-right causal with Lq > Lk: the first 70 rows see no key (O = 0, LSE = -inf, zero gradients), so
        // whole query tiles skip every KV tile.
        case(Group::FullyMasked, "rows that see no key", dense(1, 2, 2, 100, 30, 64, 64, Mask::Causal)),
        // A GQA group of 3 (not a power of two): the query head to KV head division and the backward's sums of a
        // group's dK, dV over three query heads.
        case(
            Group::GroupedHeads,
            "GQA group of 3",
            dense(1, 3, 1, 33, 70, 32, 32, Mask::Window { left: 10, right: 2 }),
        ),
        // Varlen with an empty query sequence first and an empty key sequence second (its queries see no key): the
        // cu_seqlens offsets of empty sequences and tiles that start past a sequence's end.
        case(Group::Varlen, "empty sequences", varlen(&[0, 0, 33, 70], &[0, 20, 20, 65], 2, 1, 32, 32, Mask::Causal)),
        // A sliding window wider than a KV tile on the left and narrow on the right: the tile skip on both sides.
        case(Group::SlidingWindows, "window", dense(1, 1, 1, 130, 130, 32, 32, Mask::Window { left: 70, right: 3 })),
        // NSA's compressed branch: 130 tokens over their 14 windows of 8 every 9 (a gap between windows), plus a key
        // that never completes; the first 7 rows see nothing, and the strided diagonal's floor division meets
        // negative positions.
        case(
            Group::StridedCausal,
            "strided causal",
            dense(1, 2, 1, 130, 15, 64, 64, Mask::StridedCausal { len: 8, stride: 9 }),
        ),
        // The largest head dim, d = dv = 256: the forward's single-slice tiling (`ForwardTiling::for_head_dims` above
        // 128) and the backward's single-stage Q/dO pipeline (`Q_STAGES = 1`: two stages exceed the shared memory).
        case(Group::HeadDims, "d = dv = 256", dense(1, 1, 1, 65, 129, 256, 256, Mask::Causal)),
        // d != dv at the largest d: two dv chunks of different widths, and again one stage in the backward (dv = 200
        // pads to 208, and two stages of K, V, Q and dO tiles at 256 and 208 columns exceed the shared memory).
        case(Group::HeadDims, "d = 256, dv = 200", dense(1, 1, 1, 65, 129, 256, 200, Mask::None)),
    ]
}

/// Runs [`sanitizer_shapes`] in `direction` through the production [`GpuCandidate`] and the harness's checks
/// (guarded outputs, inputs A, B, A, every backward strategy, the verdicts and the gate; see
/// `attnproof_harness::adversarial`). The cases alternate bf16 and f16, which halves the launches under the sanitizer
/// while both dtypes' kernels still run. Without a device the test reports its skip and returns.
pub fn run_sanitizer_shapes(test_name: &str, direction: Direction) {
    let Some(candidate) = GpuCandidate::if_available(test_name) else {
        return;
    };
    let mut worst = Worst::default();
    let cases = sanitizer_shapes();
    for (n, case) in cases.iter().enumerate() {
        let verdicts = if n % 2 == 0 {
            run_case::<_, bf16>(&candidate, case, direction)
        } else {
            run_case::<_, f16>(&candidate, case, direction)
        };
        match verdicts {
            Ok(verdicts) => verdicts.iter().for_each(|v| worst.record(v)),
            Err(e) => panic!("{test_name} {direction:?} {}: {e}", case.name),
        }
    }
    println!("{test_name}: {} cases, worst error/bound {worst}", cases.len());
}

/// The sanitizer's shapes reach what their comments promise, checked without a device from the modules their
/// launches compile: both forward tilings of the production choice (two 16-row slices per warp up to 128 columns,
/// one above), both backward pipelines (`Q_STAGES` 2 and 1), `d ≠ dv` at the largest `d`, and the limits that keep
/// them cheap under the sanitizer.
#[test]
fn sanitizer_shapes_reach_every_pipeline_path() {
    let mut defines = std::collections::BTreeSet::new();
    for case in sanitizer_shapes() {
        let spec = &case.spec;
        let lengths = spec.sequences().iter().map(|s| s.len_q.max(s.len_k)).sum::<usize>();
        assert!(lengths <= 130 && spec.n_heads_q <= 4, "{} is not small", case.name);
        assert!(case.directions.include(Direction::Backward), "{}", case.name);
        let forward = ForwardTiling::for_head_dims(spec.head_dim, spec.head_dim_v);
        let variants = attnproof_gpu::module_variants::<bf16>(spec, forward, BackwardTiling::DEFAULT)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        defines.extend(variants.into_iter().flat_map(|v| v.defines));
    }
    for expected in ["WARP_M=1", "WARP_M=2", "Q_STAGES=1", "Q_STAGES=2", "HEAD_DIM_PAD=256", "HEAD_DIM_V_PAD=208"] {
        assert!(defines.contains(expected), "no sanitizer shape compiles {expected}: {defines:?}");
    }
}

/// A GPU property suite of one storage type (the NSA suites'): name (and regression file), bf16 or f16, cases per
/// run, fixed seed.
#[derive(Clone, Copy, Debug)]
pub struct TypedSuite {
    /// The name.
    pub name: &'static str,
    /// bf16 (`true`) or f16.
    pub bf16: bool,
    /// Cases per run.
    pub cases: u32,
    /// Fixed seed.
    pub seed: u64,
}

/// Runs `strategy`'s draws under `config` through `check`; a failing draw comes back as `describe` writes it, so that
/// the suites of either storage type report one error type.
pub fn run_described<S: Strategy>(
    config: proptest::test_runner::Config,
    strategy: S,
    check: impl Fn(&S::Value) -> Result<(), proptest::test_runner::TestCaseError>,
    describe: impl Fn(&S::Value) -> String,
) -> Result<(), Box<proptest::test_runner::TestError<String>>> {
    use proptest::test_runner::{TestError, TestRunner};
    TestRunner::new(config).run(&strategy, |draw| check(&draw)).map_err(|e| {
        Box::new(match e {
            TestError::Fail(why, draw) => TestError::Fail(why, describe(&draw)),
            TestError::Abort(why) => TestError::Abort(why),
        })
    })
}

/// One draw of a token-list forward kernel (NSA's selected attention, DSA's token-sparse attention): the two inputs of
/// `cases` run as A, B, A through `run` (A's two runs must give the same bits), every verdict of `verify` on A and on
/// B must pass and discriminate (a draw the error model does not cover, an overflow of its own terms, is rejected, as
/// in the other suites), and where `dense_bits` A's output must equal the dense forward kernel's bit for bit.
pub fn check_token_list_draw<T: Storage>(
    stream: &Arc<CudaStream>,
    cases: &[Case<T>; 2],
    run: impl Fn(&Case<T>) -> Result<ForwardRun<T>, attnproof_harness::candidate::LaunchError>,
    verify: impl Fn(
        &Case<T>,
        &ForwardRun<T>,
    ) -> Result<Vec<attnproof_harness::Verdict>, attnproof_harness::sparse::SparseHarnessError>,
    dense_bits: bool,
) -> Result<(), proptest::test_runner::TestCaseError> {
    use attnproof_harness::flash::HarnessError;
    use attnproof_harness::sparse::SparseHarnessError;
    use proptest::test_runner::TestCaseError;
    let fail = |e: String| TestCaseError::fail(e);
    let launch = |case| run(case).map_err(|e| fail(e.to_string()));
    let (first, second, again) = (launch(&cases[0])?, launch(&cases[1])?, launch(&cases[0])?);
    let bits = |r: &ForwardRun<T>| {
        (r.o.iter().map(|x| x.bits()).collect::<Vec<_>>(), r.lse.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
    };
    if bits(&first) != bits(&again) {
        return Err(fail("the same input gave different bits".into()));
    }
    for (n, (case, run)) in cases.iter().zip([&first, &second]).enumerate() {
        let verdicts = match verify(case, run) {
            Ok(v) => v,
            Err(SparseHarnessError::Harness(HarnessError::Model(m))) => {
                return Err(TestCaseError::reject(m.to_string()));
            }
            Err(e) => return Err(fail(format!("input {n}: {e}"))),
        };
        for (i, v) in verdicts.iter().enumerate() {
            if !(v.passed() && v.valid()) {
                return Err(fail(format!("input {n}, verdict {i} (sequence, KV head in order):\n{v}")));
            }
        }
    }
    if dense_bits {
        let dense = forward_guarded(
            stream,
            &cases[0],
            attnproof_gpu::compile::FLASH_FWD,
            ForwardTiling { warps: 4, slices: 1 },
        )
        .map_err(|e| fail(e.to_string()))?;
        if bits(&dense) != bits(&first) {
            return Err(fail("every key listed: not the dense forward's bits".into()));
        }
    }
    Ok(())
}
