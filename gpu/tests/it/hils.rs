//! HiLS on the device (`attnproof_gpu::hils`, E21): the chunk summaries and router verified against the oracle's
//! `hils` module through `attnproof_harness::hils_routing` (every summary and router score within the f64 evaluation's
//! bound, every list equal to the top-k of the kernel's own scores, ties to the lower chunk), and the factorized output
//! over the router's lists through `attnproof_harness::hils_output` (O and the LSE within the f64 evaluation's bound
//! and their roundings of the oracle's `factorized_output` over the same lists, under either chunk mass).
//!
//! The suites draw `attnproof_harness::strategies::hils_draws`: causal self-attention, dense or varlen with an empty
//! sequence, GQA groups of 1 to 16, head dims 8 to 256 and value head dims 1 to 256, chunk sizes from 1 to 100 with
//! windows below, at and above a chunk, routing widths from 1 to 32 (wider than the eligible chunks too), both masses,
//! large logit scales, and as often twin chunks (same keys, same landmark) whose scores tie. Outputs are poisoned with
//! guard bands, inputs checked unchanged, each draw run twice with the same bits. Without a device each test prints
//! `skipped: no CUDA device` and passes.

use std::cell::RefCell;
use std::sync::Arc;

use crate::common::*;
use crate::property::{default_run_config, run_config};
use attnproof_gpu::GpuError;
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::hils::{
    ChunkMass, HILS, HilsForwardDevice, HilsRouting, HilsRoutingDevice, hils_forward, hils_forward_device_with,
    hils_route, hils_route_device_with, landmarks_len, lists_len, scores_len, summaries_len,
};
use attnproof_harness::Case;
use attnproof_harness::generate::make_case;
use attnproof_harness::hils_output::{HilsOutputVerdict, verify_hils_output};
use attnproof_harness::hils_routing::{DeviceRouting, RoutingVerdict, first_query_landmarks, verify_hils_routing};
use attnproof_harness::strategies::{HilsDraw, hils_draws};
use attnproof_oracle::hils::HilsConfig;
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Layout, Mask};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::{Array4, ArrayD, IxDyn};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

/// A HiLS suite: name (and regression file), dtype, cases, seed.
#[derive(Clone, Copy, Debug)]
pub struct HilsSuite {
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
pub const HILS_SUITES: [HilsSuite; 2] = [
    HilsSuite { name: "gpu_hils_bf16", bf16: true, cases: 48, seed: 0x6770_6869_6c73_0001 },
    HilsSuite { name: "gpu_hils_f16", bf16: false, cases: 48, seed: 0x6770_6869_6c73_0002 },
];

/// What one guarded run returns: the routing (summaries, lists and scores, widened for the harness), O and the LSE.
#[derive(Clone, Debug)]
pub struct HilsRun<T> {
    /// Summaries, the router's lists and every eligible score.
    pub routing: HilsRouting,
    /// O.
    pub o: ArrayD<T>,
    /// The LSE.
    pub lse: ArrayD<f32>,
}

/// Elements of poison-filled guard past each output.
const GUARD: usize = 64;

/// One forward of `kernel` (router, then the output with the chunks weighed by `mass`) into poisoned, guarded outputs
/// (NaN summaries, scores, O and LSE, `i32::MIN` lists, guard bands of [`GUARD`] elements checked untouched), the
/// inputs checked unchanged.
pub fn run_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    landmarks: &Array4<T>,
    (config, mass): (HilsConfig, ChunkMass),
    kernel: KernelSource,
) -> Result<HilsRun<T>, String> {
    let spec = &case.spec;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let (q, k, v) = (upload(stream, &case.q)?, upload(stream, &case.k)?, upload(stream, &case.v)?);
    let l = upload(stream, &landmarks.clone().into_dyn())?;
    let poison = |n: usize, x: f64| stream.clone_htod(&vec![x; n + GUARD]).map_err(|e| err(&e));
    let mut summaries = poison(summaries_len(spec, config), f64::NAN)?;
    let mut scores = poison(scores_len(spec, config), f64::NAN)?;
    let mut lists = stream.clone_htod(&vec![i32::MIN; lists_len(spec, config) + GUARD]).map_err(|e| err(&e))?;
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    let nan = T::from_f32(f32::NAN);
    let mut o = stream.clone_htod(&vec![nan; size(Operand::O) + GUARD]).map_err(|e| err(&e))?;
    let mut lse = stream.clone_htod(&vec![f32::NAN; size(Operand::RowStat) + GUARD]).map_err(|e| err(&e))?;
    let routing = HilsRoutingDevice { summaries: &mut summaries, lists: &mut lists, scores: Some(&mut scores) };
    let out = HilsForwardDevice { routing, o: &mut o, lse: &mut lse };
    hils_forward_device_with(stream, spec, config, mass, kernel, (&q, &k, &v, &l), out).map_err(|e| err(&e))?;
    let back = |x: &cudarc::driver::CudaSlice<f64>| stream.clone_dtoh(x).map_err(|e| err(&e));
    let (s, r) = (back(&summaries)?, back(&scores)?);
    let li = stream.clone_dtoh(&lists).map_err(|e| err(&e))?;
    let o_host = stream.clone_dtoh(&o).map_err(|e| err(&e))?;
    let lse_host = stream.clone_dtoh(&lse).map_err(|e| err(&e))?;
    let guard_ok = s[s.len() - GUARD..].iter().all(|x| x.is_nan())
        && r[r.len() - GUARD..].iter().all(|x| x.is_nan())
        && li[li.len() - GUARD..].iter().all(|&x| x == i32::MIN)
        && o_host[o_host.len() - GUARD..].iter().all(|x| x.to_f32().is_nan())
        && lse_host[lse_host.len() - GUARD..].iter().all(|x| x.is_nan());
    if !guard_ok {
        return Err("a guard band past an output was written".into());
    }
    for (name, before, after) in [("q", &case.q, &q), ("k", &case.k, &k), ("v", &case.v, &v)] {
        let after = stream.clone_dtoh(after).map_err(|e| err(&e))?;
        if before.iter().zip(&after).any(|(a, b)| a.bits() != b.bits()) {
            return Err(format!("input {name} changed"));
        }
    }
    let after = stream.clone_dtoh(&l).map_err(|e| err(&e))?;
    if landmarks.iter().zip(&after).any(|(a, b)| a.bits() != b.bits()) {
        return Err("the landmarks changed".into());
    }
    let shaped = |op: Operand| IxDyn(&spec.expected_shape(op)).clone();
    let o = ArrayD::from_shape_vec(shaped(Operand::O), o_host[..size(Operand::O)].to_vec()).map_err(|e| err(&e))?;
    let lse = ArrayD::from_shape_vec(shaped(Operand::RowStat), lse_host[..size(Operand::RowStat)].to_vec())
        .map_err(|e| err(&e))?;
    Ok(HilsRun { routing: HilsRouting::from_buffers(spec, config, &s, &li, &r), o, lse })
}

/// Runs `kernel` on a case and verifies the routing and the output; both verdicts and the run when they pass.
pub fn check_forward<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    landmarks: &Array4<T>,
    config: (HilsConfig, ChunkMass),
    kernel: KernelSource,
) -> Result<(RoutingVerdict, HilsOutputVerdict, HilsRun<T>), String> {
    let run = run_guarded(stream, case, landmarks, config, kernel)?;
    let r = &run.routing;
    let device = DeviceRouting { summaries: r.summaries.view(), lists: r.lists.view(), scores: r.scores.view() };
    let routing =
        verify_hils_routing(case, landmarks.view(), config.0, device).map_err(|e| format!("verification: {e}"))?;
    if !routing.passed() {
        return Err(format!("{routing:?}"));
    }
    let output =
        verify_hils_output(case, landmarks.view(), config.0, config.1, r.lists.view(), (run.o.view(), run.lse.view()))
            .map_err(|e| format!("verification: {e}"))?;
    if !output.passed() {
        return Err(format!("{output:?}"));
    }
    Ok((routing, output, run))
}

fn check_draw<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    tally: &RefCell<(usize, usize)>,
    draw: &HilsDraw,
) -> Result<(), TestCaseError> {
    let (case, landmarks) = draw.case::<T>();
    let config = (draw.config, draw.mass);
    let (routing, output, run) =
        check_forward(stream, &case, &landmarks, config, kernel).map_err(TestCaseError::fail)?;
    let again = run_guarded(stream, &case, &landmarks, config, kernel).map_err(TestCaseError::fail)?;
    let bits = |x: &Array4<f64>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let (a, b) = (&run.routing, &again.routing);
    prop_assert!(
        bits(&a.summaries) == bits(&b.summaries)
            && a.lists == b.lists
            && bits(&a.scores) == bits(&b.scores)
            && run.o.iter().zip(&again.o).all(|(x, y)| x.bits() == y.bits())
            && run.lse.iter().zip(&again.lse).all(|(x, y)| x.to_bits() == y.to_bits()),
        "the same input gave different bits"
    );
    let mut t = tally.borrow_mut();
    t.0 += routing.routed_rows.min(output.retrieved_rows);
    t.1 += usize::from(draw.twins);
    Ok(())
}

impl HilsSuite {
    /// Runs the suite under `config` with `check`.
    pub fn run(
        &self,
        config: Config,
        check: impl Fn(&HilsDraw) -> Result<(), TestCaseError>,
    ) -> Result<(), Box<TestError<HilsDraw>>> {
        TestRunner::new(config).run(&hils_draws(), |draw| check(&draw)).map_err(Box::new)
    }

    /// The check of one draw by `kernel` (rows with retrieved chunks in `tally.0`, twin draws in `tally.1`).
    pub fn check(
        &self,
        stream: &Arc<CudaStream>,
        kernel: KernelSource,
        tally: &RefCell<(usize, usize)>,
        draw: &HilsDraw,
    ) -> Result<(), TestCaseError> {
        if self.bf16 {
            check_draw::<bf16>(stream, kernel, tally, draw)
        } else {
            check_draw::<f16>(stream, kernel, tally, draw)
        }
    }
}

fn run_production(suite: &HilsSuite) {
    let Some(stream) = device_stream(suite.name) else { return };
    let tally = RefCell::new((0usize, 0usize));
    if let Err(e) =
        suite.run(run_config(suite.name, suite.cases, suite.seed), |d| suite.check(&stream, HILS, &tally, d))
    {
        panic!("{}: {e}", suite.name);
    }
    let (rows, twins) = *tally.borrow();
    println!("{}: {rows} rows with retrieved chunks, {twins} draws with twin chunks", suite.name);
    assert!(rows > 0 && twins > 0, "{}: the suite never routed or never tied", suite.name);
}

#[test]
fn hils_matches_the_oracle_bf16() {
    run_production(&HILS_SUITES[0]);
}

#[test]
fn hils_matches_the_oracle_f16() {
    run_production(&HILS_SUITES[1]);
}

/// Without a device: the suites draw varlen, GQA groups above 1, twins, widths above the eligible chunks, windows
/// below a chunk, both masses and value head dims above 32; the oracle's own routing passes the routing verifier and
/// the CPU schedule of `hils_output` (`attnproof_reference::sparse::hils`) over it passes the output verifier on their
/// first draws.
#[test]
fn the_suites_draw_their_cases_and_the_cpu_schedules_pass() {
    let seen = RefCell::new([0usize; 7]);
    for suite in &HILS_SUITES {
        let result = suite.run(default_run_config(suite.name, 5, suite.seed), |d| {
            let mut s = seen.borrow_mut();
            s[0] += usize::from(matches!(d.spec.layout, Layout::Varlen { .. }));
            s[1] += usize::from(d.spec.group_size() > 1);
            s[2] += usize::from(d.twins);
            s[3] += usize::from(d.config.retrieved_chunks > 8);
            s[4] += usize::from(d.config.local_window < d.config.chunk_size);
            s[5] += usize::from(d.mass == ChunkMass::Exact);
            s[6] += usize::from(d.spec.head_dim_v > 32);
            drop(s);
            // Every draw is a problem the GPU wrappers take: a draw they reject fails the device run, not the kernel.
            attnproof_gpu::hils::check_forward(&d.spec, d.config, d.mass)
                .map_err(|e| TestCaseError::fail(format!("{:?}: {e}", d.spec)))?;
            let (case, landmarks) = d.case::<bf16>();
            let fail = |e: &dyn std::fmt::Display| TestCaseError::fail(e.to_string());
            let (summaries, lists, scores) =
                attnproof_harness::hils_routing::oracle_routing(&case, landmarks.view(), d.config)
                    .map_err(|e| fail(&e))?;
            let device = DeviceRouting { summaries: summaries.view(), lists: lists.view(), scores: scores.view() };
            let v = verify_hils_routing(&case, landmarks.view(), d.config, device).map_err(|e| fail(&e))?;
            prop_assert!(v.passed(), "{v:?}");
            let spec = &case.spec;
            let mut o = ArrayD::from_elem(IxDyn(&spec.expected_shape(Operand::O)), bf16::NAN);
            let mut lse = ArrayD::from_elem(IxDyn(&spec.expected_shape(Operand::RowStat)), f32::NAN);
            let out = attnproof_reference::ForwardOutputs { o: o.view_mut(), lse: lse.view_mut() };
            attnproof_reference::sparse::hils::hils_forward(
                spec,
                &case.inputs(),
                (d.config, d.mass),
                summaries.view(),
                lists.view(),
                out,
            )
            .map_err(|e| fail(&e))?;
            let v = verify_hils_output(&case, landmarks.view(), d.config, d.mass, lists.view(), (o.view(), lse.view()))
                .map_err(|e| fail(&e))?;
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
fn bad_hils_input_is_a_typed_error() {
    let Some(stream) = device_stream("bad_hils_input_is_a_typed_error") else { return };
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
    let (q, k, v) =
        (upload(&stream, &case.q).unwrap(), upload(&stream, &case.k).unwrap(), upload(&stream, &case.v).unwrap());
    let l = upload(&stream, &landmarks.clone().into_dyn()).unwrap();
    let short = stream.alloc_zeros::<bf16>(landmarks_len(&spec, config) - 1).unwrap();
    let mut summaries = stream.alloc_zeros::<f64>(summaries_len(&spec, config)).unwrap();
    let mut lists = stream.alloc_zeros::<i32>(lists_len(&spec, config)).unwrap();
    let out = HilsRoutingDevice { summaries: &mut summaries, lists: &mut lists, scores: None };
    let e = hils_route_device_with(&stream, &spec, config, HILS, (&q, &k, &short), out);
    assert!(matches!(e, Err(GpuError::BufferTooSmall { argument: "landmarks", .. })), "{e:?}");
    // The forward: each short buffer is named, before the router launches (its lists stay as they were).
    let mut o = stream.alloc_zeros::<bf16>(100 * 2 * 16).unwrap();
    let mut lse = stream.alloc_zeros::<f32>(2 * 100).unwrap();
    let mut small_o = stream.alloc_zeros::<bf16>(100 * 2 * 16 - 1).unwrap();
    let mut small_lse = stream.alloc_zeros::<f32>(2 * 100 - 1).unwrap();
    let short_v = stream.alloc_zeros::<bf16>(100 * 16 - 1).unwrap();
    let sentinel = vec![-7i32; lists_len(&spec, config)];
    for (argument, which) in [("o", 0), ("lse", 1), ("v", 2)] {
        let mut lists = stream.clone_htod(&sentinel).unwrap();
        let routing = HilsRoutingDevice { summaries: &mut summaries, lists: &mut lists, scores: None };
        let (o, lse) = match which {
            0 => (&mut small_o, &mut lse),
            1 => (&mut o, &mut small_lse),
            _ => (&mut o, &mut lse),
        };
        let v = if which == 2 { &short_v } else { &v };
        let out = HilsForwardDevice { routing, o, lse };
        let e = hils_forward_device_with(&stream, &spec, config, ChunkMass::Surrogate, HILS, (&q, &k, v, &l), out);
        assert!(matches!(e, Err(GpuError::BufferTooSmall { argument: a, .. }) if a == argument), "{e:?}");
        assert_eq!(stream.clone_dtoh(&lists).unwrap(), sentinel, "{argument}: the router ran");
    }
    let forward = |spec: &AttentionSpec, lists: Option<ndarray::ArrayView4<'_, i32>>| {
        let inputs = (case.q.view(), case.k.view(), case.v.view(), landmarks.view().into_dyn());
        hils_forward(&stream, spec, config, ChunkMass::Surrogate, inputs, lists)
    };
    let wide_v = dense(1, 2, 1, 100, 100, 16, 264, Mask::Causal);
    let e = forward(&wide_v, None);
    assert!(matches!(e, Err(GpuError::Unsupported { argument: "head_dim_v", .. })), "{:?}", e.err());
    // The caller's lists: the router's shape, and per row an ascending, distinct, −1-padded prefix of eligible chunks.
    let routed = forward(&spec, None).expect("a valid run");
    let given = routed.routing.lists.clone();
    let fault = |lists: &Array4<i32>| match forward(&spec, Some(lists.view())) {
        Err(GpuError::BlockList { position, fault }) => Some((position, fault)),
        _ => None,
    };
    use attnproof_gpu::error::BlockListFault;
    let mut bad = given.clone();
    bad[[0, 1, 40, 0]] = 2; // row 40's window starts at key 16: only chunk 0 is eligible
    bad[[0, 1, 40, 1]] = -1;
    assert_eq!(fault(&bad), Some(([0, 1, 40, 0], BlockListFault::OutOfRange { index: 2, key_blocks: 1 })));
    let mut bad = given.clone();
    bad[[0, 0, 99, 0]] = 3;
    bad[[0, 0, 99, 1]] = 3;
    assert_eq!(fault(&bad), Some(([0, 0, 99, 1], BlockListFault::Duplicate { index: 3 })));
    let mut bad = given.clone();
    bad[[0, 0, 99, 0]] = 3;
    bad[[0, 0, 99, 1]] = 1;
    assert_eq!(fault(&bad), Some(([0, 0, 99, 1], BlockListFault::NotAscending { index: 1, previous: 3 })));
    let mut bad = given.clone();
    bad[[0, 0, 99, 0]] = -1;
    bad[[0, 0, 99, 1]] = 1;
    assert_eq!(fault(&bad), Some(([0, 0, 99, 1], BlockListFault::AfterPad { index: 1 })));
    let narrow = given.slice(ndarray::s![.., .., .., ..2]).to_owned();
    assert!(matches!(forward(&spec, Some(narrow.view())), Err(GpuError::Shape { argument: "retrieved", .. })));
    // The router's own lists given back reproduce the routed forward bit for bit.
    let again = forward(&spec, Some(given.view())).expect("the router's lists are valid");
    assert!(again.output.o.iter().zip(&routed.output.o).all(|(a, b)| a.bits() == b.bits()));
    assert_eq!(routed.output.o.shape(), [1, 2, 100, 16]);
}

/// Small shapes for `run.sh sanitize`: chunks of one key, a width above the eligible chunks, varlen with an empty
/// sequence, GQA 3, `d = 256` with `dv = 256`, and `dv = 1`.
#[test]
fn sanitizer_shapes() {
    let Some(stream) = device_stream("hils::sanitizer_shapes") else { return };
    for (spec, config, mass) in [
        (
            dense(1, 2, 1, 40, 40, 16, 8, Mask::Causal),
            HilsConfig { chunk_size: 1, local_window: 3, retrieved_chunks: 32 },
            ChunkMass::Surrogate,
        ),
        (
            varlen(&[0, 0, 90], &[0, 0, 90], 3, 1, 256, 256, Mask::Causal),
            HilsConfig { chunk_size: 7, local_window: 7, retrieved_chunks: 5 },
            ChunkMass::Exact,
        ),
        (
            dense(1, 1, 1, 70, 70, 16, 8, Mask::Causal),
            HilsConfig { chunk_size: 16, local_window: 1, retrieved_chunks: 2 },
            ChunkMass::Surrogate,
        ),
    ] {
        let case = make_case::<bf16>(&spec, gaussian(1.0), 52);
        let landmarks = first_query_landmarks(&case, config);
        check_forward(&stream, &case, &landmarks, (config, mass), HILS).unwrap_or_else(|e| panic!("{spec:?}: {e}"));
    }
}

/// The killing cases of the catalog's `hils` mutants: a causal GQA group of 3 over two sequences with twin chunks
/// (ties), chunks of 16, a window of 20 and width 4, HiLS's surrogate mass; one head over 300 tokens with chunks of 7,
/// a width of 32 (wider than the early rows' eligible chunks), logits at scale 4 and 40 value columns, the exact mass;
/// two KV heads with groups of 2 over 260 tokens, chunks of 64 and a window of 100 (up to 163 window keys: six groups
/// of the online softmax, and chunks of two), the surrogate mass.
pub fn killing_cases() -> Vec<(&'static str, KillingCase)> {
    let twins = HilsDraw {
        spec: dense(2, 3, 1, 130, 130, 16, 8, Mask::Causal),
        config: HilsConfig { chunk_size: 16, local_window: 20, retrieved_chunks: 4 },
        mass: ChunkMass::Surrogate,
        profile: gaussian(1.0),
        seed: 53,
        twins: true,
    };
    let wide = HilsDraw {
        spec: dense(1, 1, 1, 300, 300, 64, 40, Mask::Causal),
        config: HilsConfig { chunk_size: 7, local_window: 10, retrieved_chunks: 32 },
        mass: ChunkMass::Exact,
        profile: gaussian(4.0),
        seed: 54,
        twins: false,
    };
    let long = HilsDraw {
        spec: dense(1, 4, 2, 260, 260, 32, 40, Mask::Causal),
        config: HilsConfig { chunk_size: 64, local_window: 100, retrieved_chunks: 3 },
        mass: ChunkMass::Surrogate,
        profile: gaussian(4.0),
        seed: 55,
        twins: false,
    };
    let case = |d: &HilsDraw| {
        let (case, landmarks) = d.case::<bf16>();
        (case, landmarks, (d.config, d.mass))
    };
    vec![
        ("gqa3_twin_chunks", case(&twins)),
        ("wide_lists_chunks_of_7_exact_mass", case(&wide)),
        ("two_kv_heads_windows_of_many_groups", case(&long)),
    ]
}

/// A killing case: the problem, its landmarks, the config and the chunks' mass.
pub type KillingCase = (Case<bf16>, Array4<bf16>, (HilsConfig, ChunkMass));

/// Runs `kernel` on a killing case; `Ok(())` when it passes.
pub fn check_killing_case(stream: &Arc<CudaStream>, kernel: KernelSource, case: &KillingCase) -> Result<(), String> {
    check_forward(stream, &case.0, &case.1, case.2, kernel).map(|_| ())
}
