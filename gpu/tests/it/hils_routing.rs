//! HiLS's chunk summaries and router (`attnproof_gpu::hils`, E21) verified on the device against the oracle's `hils`
//! module through `attnproof_harness::hils_routing`: every summary and router score within the f64 evaluation's
//! bound of the oracle's, every list equal to the top-k of the kernel's own scores (ties to the lower chunk).
//!
//! The suites draw causal self-attention, dense or varlen with an empty sequence, GQA groups of 1 to 16, head dims 8
//! to 256, chunk sizes from 1 to 100 with windows below, at and above a chunk, routing widths from 1 to 32 (wider than
//! the eligible chunks too), large logit scales, and as often twin chunks (same keys, same landmark) whose scores tie.
//! Outputs are poisoned with guard bands, inputs checked unchanged, each draw run twice with the same bits. Without a
//! device each test prints `skipped: no CUDA device` and passes.

use std::cell::RefCell;
use std::sync::Arc;

use crate::common::*;
use crate::property::{default_run_config, run_config};
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::hils::{
    HILS, HilsRouting, HilsRoutingDevice, hils_route, hils_route_device_with, landmarks_len, lists_len, scores_len,
    summaries_len,
};
use attnproof_gpu::{GpuError, skip_unless_gpu};
use attnproof_harness::Case;
use attnproof_harness::generate::{ValueProfile, make_case};
use attnproof_harness::hils_routing::{
    DeviceRouting, Routing, RoutingVerdict, first_query_landmarks, verify_hils_routing,
};
use attnproof_harness::strategies::profile;
use attnproof_oracle::hils::HilsConfig;
use attnproof_oracle::{AttentionSpec, Layout, Mask};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::{Array4, Axis};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

/// One routing draw: the problem, the config, the value profile, the seed, and whether chunk 2 repeats chunk 0 (keys
/// and landmark) so that their scores tie for every query.
#[derive(Clone, Debug)]
pub struct RoutingDraw {
    /// Causal self-attention.
    pub spec: AttentionSpec,
    /// `C`, `w`, `K`.
    pub config: HilsConfig,
    /// Values.
    pub profile: ValueProfile,
    /// Seed of the values.
    pub seed: u64,
    /// Twin chunks 0 and 2.
    pub twins: bool,
}

/// The problems: causal self-attention over 0 to 700 tokens (dense, or varlen with an empty sequence), GQA groups
/// of 1 to 16, head dims 8 to 256; chunk sizes 1 to 100 and windows below, at and above a chunk; widths 1 to 32.
pub fn routing_draws() -> impl Strategy<Value = RoutingDraw> {
    let heads = prop::sample::select(vec![(1usize, 1usize), (2, 1), (3, 1), (4, 2), (5, 5), (6, 3), (16, 1)]);
    let dims = prop::sample::select(vec![8usize, 16, 64, 72, 128, 256]);
    let layout = (1usize..=2, 0usize..=700, any::<bool>()).prop_map(|(b, n, packed)| {
        if packed {
            Layout::Varlen {
                cu_seqlens_q: vec![0, n as i32, n as i32, (n + n / 3) as i32],
                cu_seqlens_k: vec![0, n as i32, n as i32, (n + n / 3) as i32],
            }
        } else {
            Layout::Dense { batch: b, len_q: n, len_k: n }
        }
    });
    let chunk = prop::sample::select(vec![1usize, 7, 16, 64, 100]);
    (layout, heads, dims, chunk).prop_flat_map(|(layout, (hq, hkv), d, chunk)| {
        let spec = AttentionSpec { layout, ..AttentionSpec::dense(1, hq, hkv, 1, 1, d, 8).with_mask(Mask::Causal) };
        let window = prop::sample::select(vec![1usize, chunk.saturating_sub(1).max(1), chunk, 3 * chunk + 5, 200]);
        let width = prop::sample::select(vec![1usize, 3, 8, 32]);
        (Just(spec), Just(chunk), window, width, profile(), any::<u64>(), prop::bool::weighted(0.3)).prop_map(
            |(spec, chunk_size, local_window, retrieved_chunks, profile, seed, twins)| RoutingDraw {
                spec,
                config: HilsConfig { chunk_size, local_window, retrieved_chunks },
                profile,
                seed,
                twins,
            },
        )
    })
}

/// A routing suite: name (and regression file), dtype, cases, seed.
#[derive(Clone, Copy, Debug)]
pub struct RoutingSuite {
    /// The name.
    pub name: &'static str,
    /// bf16 (`true`) or f16.
    pub bf16: bool,
    /// Cases per run.
    pub cases: u32,
    /// Fixed seed.
    pub seed: u64,
}

/// The two suites ("gphils" in ASCII, plus the dtype).
pub const ROUTING_SUITES: [RoutingSuite; 2] = [
    RoutingSuite { name: "gpu_hils_routing_bf16", bf16: true, cases: 48, seed: 0x6770_6869_6c73_0001 },
    RoutingSuite { name: "gpu_hils_routing_f16", bf16: false, cases: 48, seed: 0x6770_6869_6c73_0002 },
];

/// The case and landmarks of a draw: the generated values, landmarks from each chunk's first query, and with
/// `twins` chunk 2 made a copy of chunk 0 (keys of every KV head, landmark of every query head) in every sequence long
/// enough.
pub fn draw_case<T: Storage>(draw: &RoutingDraw) -> (Case<T>, Array4<T>) {
    let mut case = make_case::<T>(&draw.spec, draw.profile, draw.seed);
    let c = draw.config.chunk_size;
    let mut landmarks = first_query_landmarks(&case, draw.config);
    if draw.twins {
        let spec = case.spec.clone();
        for seq in spec.sequences().iter().filter(|s| s.len_k >= 3 * c) {
            for kv in 0..spec.n_heads_kv {
                let mut keys = case.k.slice_mut(spec.head_slice(seq, kv, true));
                for j in 0..c {
                    let row = keys.index_axis(Axis(0), j).to_owned();
                    keys.index_axis_mut(Axis(0), 2 * c + j).assign(&row);
                }
            }
            for h in 0..spec.n_heads_q {
                let row = landmarks.index_axis(Axis(0), seq.index).index_axis(Axis(0), h).row(0).to_owned();
                landmarks.index_axis_mut(Axis(0), seq.index).index_axis_mut(Axis(0), h).row_mut(2).assign(&row);
            }
        }
    }
    (case, landmarks)
}

/// What one guarded run returns: summaries, lists and scores, widened for the harness.
pub type RoutingRun = Routing;

/// Elements of poison-filled guard past each output.
const GUARD: usize = 64;

/// One run of `kernel` into poisoned, guarded outputs (NaN summaries and scores, `i32::MIN` lists, guard bands of
/// [`GUARD`] elements checked untouched), the inputs checked unchanged.
pub fn run_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    landmarks: &Array4<T>,
    config: HilsConfig,
    kernel: KernelSource,
) -> Result<RoutingRun, String> {
    let spec = &case.spec;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let (q, k) = (upload(stream, &case.q)?, upload(stream, &case.k)?);
    let l = upload(stream, &landmarks.clone().into_dyn())?;
    let poison = |n: usize, x: f64| stream.clone_htod(&vec![x; n + GUARD]).map_err(|e| err(&e));
    let mut summaries = poison(summaries_len(spec, config), f64::NAN)?;
    let mut scores = poison(scores_len(spec, config), f64::NAN)?;
    let mut lists = stream.clone_htod(&vec![i32::MIN; lists_len(spec, config) + GUARD]).map_err(|e| err(&e))?;
    let out = HilsRoutingDevice { summaries: &mut summaries, lists: &mut lists, scores: Some(&mut scores) };
    hils_route_device_with(stream, spec, config, kernel, (&q, &k, &l), out).map_err(|e| err(&e))?;
    let back = |x: &cudarc::driver::CudaSlice<f64>| stream.clone_dtoh(x).map_err(|e| err(&e));
    let (s, r) = (back(&summaries)?, back(&scores)?);
    let li = stream.clone_dtoh(&lists).map_err(|e| err(&e))?;
    let guard_ok = s[s.len() - GUARD..].iter().all(|x| x.is_nan())
        && r[r.len() - GUARD..].iter().all(|x| x.is_nan())
        && li[li.len() - GUARD..].iter().all(|&x| x == i32::MIN);
    if !guard_ok {
        return Err("a guard band past an output was written".into());
    }
    for (name, before, after) in [("q", &case.q, &q), ("k", &case.k, &k)] {
        let after = stream.clone_dtoh(after).map_err(|e| err(&e))?;
        if before.iter().zip(&after).any(|(a, b)| a.bits() != b.bits()) {
            return Err(format!("input {name} changed"));
        }
    }
    let after = stream.clone_dtoh(&l).map_err(|e| err(&e))?;
    if landmarks.iter().zip(&after).any(|(a, b)| a.bits() != b.bits()) {
        return Err("the landmarks changed".into());
    }
    let out = HilsRouting::from_buffers(spec, config, &s, &li, &r);
    Ok((out.summaries, out.lists, out.scores))
}

/// Runs `kernel` on a case and verifies it; the verdict when it passes.
pub fn check_routing<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    landmarks: &Array4<T>,
    config: HilsConfig,
    kernel: KernelSource,
) -> Result<(RoutingVerdict, RoutingRun), String> {
    let run = run_guarded(stream, case, landmarks, config, kernel)?;
    let device = DeviceRouting { summaries: run.0.view(), lists: run.1.view(), scores: run.2.view() };
    let verdict =
        verify_hils_routing(case, landmarks.view(), config, device).map_err(|e| format!("verification: {e}"))?;
    if !verdict.passed() {
        return Err(format!("{verdict:?}"));
    }
    Ok((verdict, run))
}

fn check_draw<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    tally: &RefCell<(usize, usize)>,
    draw: &RoutingDraw,
) -> Result<(), TestCaseError> {
    let (case, landmarks) = draw_case::<T>(draw);
    let (verdict, run) = check_routing(stream, &case, &landmarks, draw.config, kernel).map_err(TestCaseError::fail)?;
    let again = run_guarded(stream, &case, &landmarks, draw.config, kernel).map_err(TestCaseError::fail)?;
    let bits = |x: &Array4<f64>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    prop_assert!(
        bits(&run.0) == bits(&again.0) && run.1 == again.1 && bits(&run.2) == bits(&again.2),
        "the same input gave different bits"
    );
    let mut t = tally.borrow_mut();
    t.0 += verdict.routed_rows;
    t.1 += usize::from(draw.twins);
    Ok(())
}

impl RoutingSuite {
    /// Runs the suite under `config` with `check`.
    pub fn run(
        &self,
        config: Config,
        check: impl Fn(&RoutingDraw) -> Result<(), TestCaseError>,
    ) -> Result<(), Box<TestError<RoutingDraw>>> {
        TestRunner::new(config).run(&routing_draws(), |draw| check(&draw)).map_err(Box::new)
    }

    /// The check of one draw by `kernel` (routed rows in `tally.0`, twin draws in `tally.1`).
    pub fn check(
        &self,
        stream: &Arc<CudaStream>,
        kernel: KernelSource,
        tally: &RefCell<(usize, usize)>,
        draw: &RoutingDraw,
    ) -> Result<(), TestCaseError> {
        if self.bf16 {
            check_draw::<bf16>(stream, kernel, tally, draw)
        } else {
            check_draw::<f16>(stream, kernel, tally, draw)
        }
    }
}

fn run_production(suite: &RoutingSuite) {
    let Some(ctx) = skip_unless_gpu(suite.name) else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let tally = RefCell::new((0usize, 0usize));
    if let Err(e) =
        suite.run(run_config(suite.name, suite.cases, suite.seed), |d| suite.check(&stream, HILS, &tally, d))
    {
        panic!("{}: {e}", suite.name);
    }
    let (rows, twins) = *tally.borrow();
    println!("{}: {rows} routed rows, {twins} draws with twin chunks", suite.name);
    assert!(rows > 0 && twins > 0, "{}: the suite never routed or never tied", suite.name);
}

#[test]
fn hils_routing_matches_the_oracle_bf16() {
    run_production(&ROUTING_SUITES[0]);
}

#[test]
fn hils_routing_matches_the_oracle_f16() {
    run_production(&ROUTING_SUITES[1]);
}

/// Without a device: the suites draw varlen, GQA groups above 1, twins, widths above the eligible chunks, windows
/// below a chunk, and the oracle's own routing passes the verifier on their first draws.
#[test]
fn the_routing_suites_draw_their_cases_and_the_oracle_passes() {
    let seen = RefCell::new([0usize; 5]);
    for suite in &ROUTING_SUITES {
        let result = suite.run(default_run_config(suite.name, 10, suite.seed), |d| {
            let mut s = seen.borrow_mut();
            s[0] += usize::from(matches!(d.spec.layout, Layout::Varlen { .. }));
            s[1] += usize::from(d.spec.group_size() > 1);
            s[2] += usize::from(d.twins);
            s[3] += usize::from(d.config.retrieved_chunks > 8);
            s[4] += usize::from(d.config.local_window < d.config.chunk_size);
            drop(s);
            let (case, landmarks) = draw_case::<bf16>(d);
            let (summaries, lists, scores) =
                attnproof_harness::hils_routing::oracle_routing(&case, landmarks.view(), d.config)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let device = DeviceRouting { summaries: summaries.view(), lists: lists.view(), scores: scores.view() };
            let v = verify_hils_routing(&case, landmarks.view(), d.config, device)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(v.passed(), "{v:?}");
            Ok(())
        });
        assert!(result.is_ok(), "{}: {result:?}", suite.name);
    }
    let s = seen.into_inner();
    assert!(s.iter().all(|&c| c > 0), "{s:?}");
}

/// Bad input is a typed error before any launch; the device stays usable.
#[test]
fn bad_routing_input_is_a_typed_error() {
    let Some(ctx) = skip_unless_gpu("bad_routing_input_is_a_typed_error") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let spec = dense(1, 2, 1, 100, 100, 16, 16, Mask::Causal);
    let case = make_case::<bf16>(&spec, gaussian(1.0), 51);
    let config = HilsConfig { chunk_size: 16, local_window: 20, retrieved_chunks: 3 };
    let landmarks = first_query_landmarks(&case, config);
    let run = |spec: &AttentionSpec, config: HilsConfig| {
        hils_route(&stream, spec, config, (case.q.view(), case.k.view(), landmarks.view().into_dyn()))
    };
    let refused = |r: Result<_, GpuError>, argument: &str| matches!(r, Err(GpuError::Unsupported { argument: a, .. }) if a == argument);
    assert!(refused(run(&spec.clone().with_mask(Mask::None), config), "mask"));
    assert!(refused(run(&spec, HilsConfig { retrieved_chunks: 33, ..config }), "retrieved_chunks"));
    assert!(refused(run(&spec, HilsConfig { chunk_size: 0, ..config }), "chunk_size"));
    let (q, k) = (upload(&stream, &case.q).unwrap(), upload(&stream, &case.k).unwrap());
    let short = stream.alloc_zeros::<bf16>(landmarks_len(&spec, config) - 1).unwrap();
    let mut summaries = stream.alloc_zeros::<f64>(summaries_len(&spec, config)).unwrap();
    let mut lists = stream.alloc_zeros::<i32>(lists_len(&spec, config)).unwrap();
    let out = HilsRoutingDevice { summaries: &mut summaries, lists: &mut lists, scores: None };
    let e = hils_route_device_with(&stream, &spec, config, HILS, (&q, &k, &short), out);
    assert!(matches!(e, Err(GpuError::BufferTooSmall { argument: "landmarks", .. })), "{e:?}");
    let out = run(&spec, config).expect("a valid run after the refusals");
    assert_eq!(out.lists.shape(), [1, 2, 100, 3]);
}

/// Small shapes for `run.sh sanitize`: chunks of one key, a width above the eligible chunks, varlen with an empty
/// sequence, GQA 3, `d = 256`.
#[test]
fn sanitizer_shapes() {
    let Some(ctx) = skip_unless_gpu("hils_routing::sanitizer_shapes") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    for (spec, config) in [
        (
            dense(1, 2, 1, 40, 40, 16, 8, Mask::Causal),
            HilsConfig { chunk_size: 1, local_window: 3, retrieved_chunks: 32 },
        ),
        (
            varlen(&[0, 0, 90], &[0, 0, 90], 3, 1, 256, 8, Mask::Causal),
            HilsConfig { chunk_size: 7, local_window: 7, retrieved_chunks: 5 },
        ),
    ] {
        let case = make_case::<bf16>(&spec, gaussian(1.0), 52);
        let landmarks = first_query_landmarks(&case, config);
        check_routing(&stream, &case, &landmarks, config, HILS).unwrap_or_else(|e| panic!("{spec:?}: {e}"));
    }
}

/// The killing cases of the catalog's `hils` mutants: a causal GQA group of 3 over two sequences with twin chunks (ties),
/// chunks of 16, a window of 20 and width 4; one head over 300 tokens with chunks of 7, a width of 32 (wider than the
/// early rows' eligible chunks) and logits at scale 4.
pub fn killing_cases() -> Vec<(&'static str, Case<bf16>, Array4<bf16>, HilsConfig)> {
    let twins = RoutingDraw {
        spec: dense(2, 3, 1, 130, 130, 16, 8, Mask::Causal),
        config: HilsConfig { chunk_size: 16, local_window: 20, retrieved_chunks: 4 },
        profile: gaussian(1.0),
        seed: 53,
        twins: true,
    };
    let wide = RoutingDraw {
        spec: dense(1, 1, 1, 300, 300, 64, 8, Mask::Causal),
        config: HilsConfig { chunk_size: 7, local_window: 10, retrieved_chunks: 32 },
        profile: gaussian(4.0),
        seed: 54,
        twins: false,
    };
    let (c1, l1) = draw_case::<bf16>(&twins);
    let (c2, l2) = draw_case::<bf16>(&wide);
    vec![("gqa3_twin_chunks", c1, l1, twins.config), ("wide_lists_chunks_of_7", c2, l2, wide.config)]
}

/// A killing case: the problem, its landmarks and the config.
pub type KillingCase = (Case<bf16>, Array4<bf16>, HilsConfig);

/// Runs `kernel` on a killing case; `Ok(())` when it passes.
pub fn check_killing_case(stream: &Arc<CudaStream>, kernel: KernelSource, case: &KillingCase) -> Result<(), String> {
    check_routing(stream, &case.0, &case.1, case.2, kernel).map(|_| ())
}
