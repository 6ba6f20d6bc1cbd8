//! The GPU pyramid selector (`attnproof_gpu::pisa::select`, PISA E25–E28) against the oracle's descent
//! (`attnproof_oracle::pyramid`), through `attnproof_harness::pyramid_selection`: every level's traced candidates equal
//! the replay of the kernel's own scores under the oracle's rule, every score within its derived bound of the oracle's,
//! the lists equal the replay's kept leaves, and, where no boundary came within the bounds, the oracle's own lists.
//!
//! The property suites draw BSA's selection shapes (no mask or causal, Lq ≠ Lk, varlen with empty sequences, GQA groups
//! of 1 to 16, head dims 8 to 256), both block sizes on each side, branchings 2 to 16 (powers of two and not), every
//! `K` from 1 (below the three forced leaves) to 16 or the leaves of the longest sequence, the three scorings, and in
//! two draws of three whole leaves copied onto others so that exact ties sit at the boundaries on purpose. Each draw
//! runs twice with the trace (the same bits both times) and once without (the same lists), into poisoned buffers with
//! guard bands, and ends with the block-sparse forward over its lists, verified against the oracle. Without a device
//! each test prints `skipped: no CUDA device` and passes.

use std::cell::RefCell;
use std::sync::Arc;

use crate::block_selection::{Ties, forward_over_lists, selection_spec, with_tied_blocks};
use crate::common::*;
use crate::property::{default_run_config, run_config};
use attnproof_gpu::GpuError;
use attnproof_gpu::block_sparse::{BLOCK_SIZES, BlockLists, ListHeads};
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::pisa::select::{
    MAX_BRANCHING, PISA_SELECT, PyramidSelectConfig, PyramidTrace, lists_shape, select_pyramid, select_pyramid_device,
    trace_shape, workspace_len,
};
use attnproof_harness::Case;
use attnproof_harness::candidate::{poisoned, unguard};
use attnproof_harness::generate::{ValueProfile, make_case};
use attnproof_harness::pyramid_selection::{PyramidOutputs, PyramidVerdict, verify_pyramid_selection};
use attnproof_harness::strategies::profile;
use attnproof_oracle::pyramid::{PyramidConfig, Scoring};
use attnproof_oracle::{AttentionSpec, Mask, Scale};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::Array4;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

/// One pyramid draw: the problem, the selector's parameters, values, seed, and the exact ties made on purpose.
#[derive(Clone, Debug)]
pub struct PyramidDraw {
    /// The problem.
    pub spec: AttentionSpec,
    /// The selector.
    pub config: PyramidSelectConfig,
    /// Values.
    pub profile: ValueProfile,
    /// Input seed.
    pub seed: u64,
    /// Exact ties made on purpose.
    pub ties: Ties,
}

/// The largest `K` the suites draw: the verifier scores every traced candidate of every row in f64 on the host (a
/// leaf's raw keys per candidate and head for LSE and PISA-2), and `K · β` candidates per level bound that work.
const MAX_DRAWN_KEEP: usize = 16;

/// The three scorings the kernel takes.
const SCORINGS: [Scoring; 3] = [Scoring::Lse, Scoring::Pisa1, Scoring::Pisa2];

/// The draws: BSA's selection shapes, then a pyramid that fits them (`max(K, 3)` leaves at least).
pub fn pyramid_draws() -> impl Strategy<Value = PyramidDraw> {
    let sizes = prop::sample::select(BLOCK_SIZES.to_vec());
    let leaves = |spec: &AttentionSpec, leaf: usize| spec.sequences().iter().map(|s| s.len_k.div_ceil(leaf)).max();
    let branching = prop::sample::select(vec![2usize, 3, 4, 5, 7, 8, MAX_BRANCHING]);
    (
        selection_spec(),
        sizes.clone(),
        sizes,
        branching,
        prop::sample::select(SCORINGS.to_vec()),
        profile(),
        any::<u64>(),
    )
        .prop_flat_map(move |(spec, q_block, leaf_size, branching, scoring, profile, seed)| {
            let leaves = leaves(&spec, leaf_size).unwrap_or(0);
            let ties = prop::sample::select(Ties::ALL.to_vec());
            (
                Just((spec, q_block, leaf_size, branching, scoring, profile, seed)),
                1..=leaves.clamp(1, MAX_DRAWN_KEEP),
                ties,
            )
        })
        .prop_filter_map("the lists must fit the leaves", move |(draw, keep, ties)| {
            let (spec, q_block, leaf_size, branching, scoring, profile, seed) = draw;
            let config =
                PyramidSelectConfig { q_block, pyramid: PyramidConfig { leaf_size, branching, keep, scoring } };
            let fits = leaves(&spec, leaf_size).is_some_and(|l| l >= config.pyramid.selection_width());
            fits.then_some(PyramidDraw { spec, config, profile, seed, ties })
        })
}

/// One guarded selection on the device into poisoned buffers followed by guard bands: the lists, and with `traced`
/// the trace (else the trace is `None`).
fn select_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    config: &PyramidSelectConfig,
    kernel: KernelSource,
    traced: bool,
) -> Result<(Array4<i32>, Option<PyramidTrace>), String> {
    let spec = &case.spec;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let (q, k) = (upload(stream, &case.q)?, upload(stream, &case.k)?);
    let shape = lists_shape(spec, config);
    let n: usize = shape.iter().product();
    let tshape = trace_shape(spec, config);
    let entries: usize = tshape.iter().product();
    // Sentinels no valid output holds (an index below −1, a score of 2^1000), then the guard bands.
    let mut lists = poisoned(stream, n, i32::MIN, 0x5a5a_5a5a).map_err(|e| err(&e))?;
    let mut nodes = poisoned(stream, entries, i32::MIN, 0x5a5a_5a5a).map_err(|e| err(&e))?;
    let mut scores = poisoned(stream, entries, 2f64.powi(1000), 1.25).map_err(|e| err(&e))?;
    let mut pooled = stream.alloc_zeros::<f64>(workspace_len(spec, config).max(1)).map_err(|e| err(&e))?;
    let trace = traced.then_some((&mut scores, &mut nodes));
    select_pyramid_device(stream, spec, config, kernel, (&q, &k), &mut pooled, &mut lists, trace)
        .map_err(|e| err(&e))?;
    let back = stream.clone_dtoh(&lists).map_err(|e| err(&e))?;
    let back_nodes = stream.clone_dtoh(&nodes).map_err(|e| err(&e))?;
    let back_scores = stream.clone_dtoh(&scores).map_err(|e| err(&e))?;
    stream.synchronize().map_err(|e| err(&e))?;
    let lists = unguard("lists", back, n, &shape, |x: i32| x == 0x5a5a_5a5a).map_err(|e| err(&e))?;
    let nodes = unguard("trace nodes", back_nodes, entries, &tshape, |x: i32| x == 0x5a5a_5a5a).map_err(|e| err(&e))?;
    let scores = unguard("trace scores", back_scores, entries, &tshape, |x: f64| x == 1.25).map_err(|e| err(&e))?;
    let lists = lists.into_dimensionality().expect("rank 4");
    if !traced {
        // Without a trace the kernel must not touch the trace buffers.
        if nodes.iter().any(|&x| x != i32::MIN) || scores.iter().any(|&x| x != 2f64.powi(1000)) {
            return Err("the untraced selection wrote to the trace buffers".into());
        }
        return Ok((lists, None));
    }
    let trace = PyramidTrace {
        nodes: nodes.into_dimensionality().expect("rank 5"),
        scores: scores.into_dimensionality().expect("rank 5"),
    };
    Ok((lists, Some(trace)))
}

/// The traced selection of `case`, twice with the same bits and once untraced with the same lists, verified.
fn run_and_verify<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    config: &PyramidSelectConfig,
    kernel: KernelSource,
) -> Result<PyramidVerdict, String> {
    let (lists, trace) = select_guarded(stream, case, config, kernel, true)?;
    let PyramidTrace { nodes, scores } = trace.expect("traced");
    let (again, trace_again) = select_guarded(stream, case, config, kernel, true)?;
    let PyramidTrace { nodes: nodes_again, scores: scores_again } = trace_again.expect("traced");
    let same_bits = scores.iter().zip(&scores_again).all(|(x, y)| x.to_bits() == y.to_bits());
    if lists != again || nodes != nodes_again || !same_bits {
        return Err("the same input gave different lists or traces".into());
    }
    let (untraced, _) = select_guarded(stream, case, config, kernel, false)?;
    if untraced != lists {
        return Err("the untraced selection gave other lists than the traced one".into());
    }
    let outputs = PyramidOutputs { lists: lists.view(), nodes: nodes.view(), scores: scores.view() };
    let verdict = verify_pyramid_selection(case, config, outputs).map_err(|e| format!("verification: {e}"))?;
    if !verdict.passed() {
        return Err(verdict.failures.join("\n"));
    }
    // The lists feed the block-sparse kernels: they must follow the block-list convention, and the production forward
    // over them must pass the oracle.
    let block_lists =
        BlockLists { q_block: config.q_block, kv_block: config.pyramid.leaf_size, heads: ListHeads::PerKvHead, lists };
    block_lists.validate(&case.spec).map_err(|e| format!("the lists break the block-list convention: {e}"))?;
    forward_over_lists(stream, case, &block_lists)?;
    Ok(verdict)
}

/// A pyramid suite: name, dtype, cases, seed.
#[derive(Clone, Copy, Debug)]
pub struct PyramidSuite {
    /// The name (and regression file).
    pub name: &'static str,
    /// bf16 (`true`) or f16.
    pub bf16: bool,
    /// Cases per run.
    pub cases: u32,
    /// Fixed seed.
    pub seed: u64,
}

/// The two suites ("pyrmd" in ASCII, plus the dtype).
pub const PYRAMID_SUITES: [PyramidSuite; 2] = [
    PyramidSuite { name: "gpu_pyramid_selection_bf16", bf16: true, cases: 48, seed: 0x7079_726d_6400_0001 },
    PyramidSuite { name: "gpu_pyramid_selection_f16", bf16: false, cases: 48, seed: 0x7079_726d_6400_0002 },
];

/// Tally of a suite's draws: rows, decided rows, scores compared, the worst score-to-bound ratio.
#[derive(Clone, Debug, Default)]
pub struct PyramidTally {
    /// List rows verified.
    pub rows: usize,
    /// Rows whose lists equal the oracle's.
    pub decided: usize,
    /// Scores compared with the oracle's.
    pub scores: usize,
    /// The largest `|kernel − oracle| / bound`.
    pub worst_ratio: f64,
}

impl PyramidSuite {
    /// Runs the suite under `config`.
    pub fn run(
        &self,
        config: Config,
        check: impl Fn(&PyramidDraw) -> Result<(), TestCaseError>,
    ) -> Result<(), Box<TestError<PyramidDraw>>> {
        TestRunner::new(config).run(&pyramid_draws(), |draw| check(&draw)).map_err(Box::new)
    }

    /// The check of one draw by the selector `kernel`.
    pub fn check(
        &self,
        stream: &Arc<CudaStream>,
        kernel: KernelSource,
        tally: &RefCell<PyramidTally>,
        draw: &PyramidDraw,
    ) -> Result<(), TestCaseError> {
        let verdict =
            if self.bf16 { check_draw::<bf16>(stream, kernel, draw) } else { check_draw::<f16>(stream, kernel, draw) }
                .map_err(TestCaseError::fail)?;
        let mut t = tally.borrow_mut();
        t.rows += verdict.rows;
        t.decided += verdict.decided;
        t.scores += verdict.scores;
        t.worst_ratio = t.worst_ratio.max(verdict.worst_ratio);
        Ok(())
    }
}

fn check_draw<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    draw: &PyramidDraw,
) -> Result<PyramidVerdict, String> {
    let case = make_case::<T>(&draw.spec, draw.profile, draw.seed);
    let case = with_tied_blocks(case, draw.config.pyramid.leaf_size, draw.ties);
    run_and_verify(stream, &case, &draw.config, kernel)
}

fn run_production(suite: &PyramidSuite) {
    let Some(stream) = device_stream(suite.name) else { return };
    let tally = RefCell::new(PyramidTally::default());
    let result =
        suite.run(run_config(suite.name, suite.cases, suite.seed), |d| suite.check(&stream, PISA_SELECT, &tally, d));
    if let Err(e) = result {
        panic!("{}: {e}", suite.name);
    }
    let t = tally.borrow();
    println!("{}: {t:?}", suite.name);
    assert!(t.decided > 0 && t.scores > 0, "{}: nothing was compared: {t:?}", suite.name);
}

#[test]
fn pyramid_selection_matches_the_oracle_bf16() {
    run_production(&PYRAMID_SUITES[0]);
}

#[test]
fn pyramid_selection_matches_the_oracle_f16() {
    run_production(&PYRAMID_SUITES[1]);
}

/// Replayed without a device: the suites draw every scoring, ties, causal and unmasked problems, GQA groups above 1,
/// `K` below 3 and above 3, branchings that are not powers of two, pyramids of three levels or more, and query
/// blocks unlike the leaves.
#[test]
fn the_pyramid_suites_draw_scorings_ties_and_deep_pyramids() {
    let seen = RefCell::new(Vec::<PyramidDraw>::new());
    for suite in &PYRAMID_SUITES {
        let result = suite.run(default_run_config(suite.name, suite.cases, suite.seed), |d| {
            seen.borrow_mut().push(d.clone());
            Ok(())
        });
        assert!(result.is_ok(), "{result:?}");
    }
    let draws = seen.into_inner();
    let count = |f: &dyn Fn(&PyramidDraw) -> bool| draws.iter().filter(|d| f(d)).count();
    for scoring in SCORINGS {
        assert!(count(&|d| d.config.pyramid.scoring == scoring) > 0, "{scoring:?}");
    }
    assert!(count(&|d| d.ties != Ties::None) > 0);
    assert!(count(&|d| matches!(d.spec.mask, Mask::Causal)) > 0 && count(&|d| matches!(d.spec.mask, Mask::None)) > 0);
    assert!(count(&|d| d.spec.group_size() > 1) > 0);
    assert!(count(&|d| d.config.pyramid.keep < 3) > 0 && count(&|d| d.config.pyramid.keep > 3) > 0);
    assert!(count(&|d| !d.config.pyramid.branching.is_power_of_two()) > 0);
    assert!(count(&|d| d.config.q_block != d.config.pyramid.leaf_size) > 0);
    let deep = |d: &PyramidDraw| {
        let leaves = d.spec.sequences().iter().map(|s| s.len_k.div_ceil(d.config.pyramid.leaf_size)).max().unwrap_or(0);
        leaves > d.config.pyramid.branching * d.config.pyramid.branching
    };
    assert!(count(&deep) > 0, "no pyramid of three levels or more");
}

/// Every leaf the same: every score ties at every level, so each level keeps the forced nodes and then the lowest
/// ones, and the lists are the forced leaves and the lowest others.
#[test]
fn all_tied_leaves_select_the_lowest_nodes() {
    let Some(stream) = device_stream("all_tied_leaves_select_the_lowest_nodes") else { return };
    let spec = dense(1, 4, 2, 640, 640, 64, 64, Mask::Causal);
    let mut case = make_case::<bf16>(&spec, gaussian(1.0), 8);
    for kv in 0..2 {
        for j in 0..640 {
            for c in 0..64 {
                case.k[[0, kv, j, c]] = case.k[[0, kv, j % 64, c]];
            }
        }
    }
    for scoring in SCORINGS {
        let config = PyramidSelectConfig {
            q_block: 64,
            pyramid: PyramidConfig { leaf_size: 64, branching: 2, keep: 4, scoring },
        };
        run_and_verify(&stream, &case, &config, PISA_SELECT).unwrap_or_else(|e| panic!("{scoring:?}: {e}"));
        let selection = select_pyramid(&stream, &spec, &config, case.q.view(), case.k.view()).expect("selection");
        // Query block 9 sees all ten leaves: forced 0, 8, 9; the fourth slot is the lowest leaf under the lowest kept
        // nodes, leaf 1.
        let row: Vec<i32> = (0..4).map(|w| selection.lists.lists[[0, 1, 9, w]]).collect();
        assert_eq!(row, [0, 1, 8, 9], "{scoring:?}");
    }
}

/// Regression (the bf16 suite on an H100, 2026-12-05; `proptest-regressions/gpu_pyramid_selection_bf16.txt`): a GQA
/// group of 16 at d = 256 holds 32 KiB of pooled queries in dynamic shared memory beside the selector's 17 KiB of
/// static arrays; the launch failed (`CUDA_ERROR_INVALID_VALUE`) until `allow_shared_memory` counted the static part.
#[test]
fn a_group_of_16_at_head_dim_256_launches() {
    let Some(stream) = device_stream("a_group_of_16_at_head_dim_256_launches") else { return };
    let spec = dense(1, 16, 1, 1, 371, 256, 256, Mask::None);
    let case = make_case::<bf16>(&spec, gaussian(1.0), 74);
    for (scoring, branching) in [(Scoring::Pisa2, 7), (Scoring::Lse, 2)] {
        let config =
            PyramidSelectConfig { q_block: 128, pyramid: PyramidConfig { leaf_size: 64, branching, keep: 1, scoring } };
        run_and_verify(&stream, &case, &config, PISA_SELECT).unwrap_or_else(|e| panic!("{scoring:?}: {e}"));
    }
}

/// Small shapes for compute-sanitizer (`run.sh sanitize`): varlen with an empty sequence and a partial leaf of 128,
/// β = 16 over a GQA group of 5, `K` = 1 (the forced leaves only), every scoring, the narrowest and widest head dims.
#[test]
fn sanitizer_shapes() {
    let Some(stream) = device_stream("pyramid_selection::sanitizer_shapes") else { return };
    let varlen = AttentionSpec {
        layout: attnproof_oracle::Layout::Varlen {
            cu_seqlens_q: vec![0, 0, 70, 300],
            cu_seqlens_k: vec![0, 5, 600, 1000],
        },
        ..dense(1, 5, 1, 1, 1, 8, 8, Mask::Causal)
    };
    let pyramid = |leaf_size, branching, keep, scoring| PyramidConfig { leaf_size, branching, keep, scoring };
    let shapes = [
        (varlen.clone(), PyramidSelectConfig { q_block: 64, pyramid: pyramid(128, 16, 1, Scoring::Lse) }),
        (varlen, PyramidSelectConfig { q_block: 128, pyramid: pyramid(64, 3, 5, Scoring::Pisa2) }),
        (
            dense(1, 2, 2, 130, 700, 256, 256, Mask::None),
            PyramidSelectConfig { q_block: 64, pyramid: pyramid(64, 2, 3, Scoring::Pisa1) },
        ),
    ];
    for (i, (spec, config)) in shapes.iter().enumerate() {
        let case = make_case::<bf16>(spec, gaussian(1.0), 60 + i as u64);
        run_and_verify(&stream, &case, config, PISA_SELECT).unwrap_or_else(|e| panic!("shape {i}: {e}"));
    }
}

/// Bad parameters and buffers are typed errors before any launch; the device stays usable.
#[test]
fn bad_pyramid_input_is_a_typed_error() {
    let Some(stream) = device_stream("bad_pyramid_input_is_a_typed_error") else { return };
    let spec = dense(1, 2, 1, 200, 300, 64, 64, Mask::Causal);
    let case = make_case::<bf16>(&spec, gaussian(1.0), 9);
    let good = PyramidSelectConfig {
        q_block: 64,
        pyramid: PyramidConfig { leaf_size: 64, branching: 2, keep: 3, scoring: Scoring::Lse },
    };
    let with = |f: &dyn Fn(&mut PyramidConfig)| {
        let mut c = good;
        f(&mut c.pyramid);
        c
    };
    let run =
        |spec: &AttentionSpec, c: &PyramidSelectConfig| select_pyramid(&stream, spec, c, case.q.view(), case.k.view());
    let refused = |r: Result<_, GpuError>, argument: &str| matches!(r, Err(GpuError::Unsupported { argument: a, .. }) if a == argument);
    assert!(refused(run(&spec, &with(&|p| p.keep = 6)), "keep"), "wider than the leaves");
    assert!(refused(run(&spec, &with(&|p| p.branching = 17)), "branching"));
    assert!(refused(run(&spec, &with(&|p| p.scoring = Scoring::Bsa)), "scoring"));
    assert!(refused(run(&spec, &with(&|p| p.leaf_size = 96)), "kv_block"));
    assert!(refused(run(&spec, &PyramidSelectConfig { q_block: 32, ..good }), "q_block"));
    assert!(matches!(run(&spec, &with(&|p| p.branching = 1)), Err(GpuError::Spec(_))));
    assert!(matches!(run(&spec, &with(&|p| p.keep = 0)), Err(GpuError::Spec(_))));
    let window = spec.clone().with_mask(Mask::Window { left: 8, right: 0 });
    assert!(refused(run(&window, &good), "mask"));
    assert!(refused(run(&spec.clone().with_scale(Scale::Value(0.5)), &good), "scale"));
    let other = dense(1, 2, 1, 200, 301, 64, 64, Mask::Causal);
    assert!(matches!(run(&other, &good), Err(GpuError::Shape { argument: "k", .. })));
    let (q, k) = (upload(&stream, &case.q).unwrap(), upload(&stream, &case.k).unwrap());
    let mut small = stream.alloc_zeros::<f64>(1).unwrap();
    let mut lists = stream.alloc_zeros::<i32>(64).unwrap();
    let e = select_pyramid_device(&stream, &spec, &good, PISA_SELECT, (&q, &k), &mut small, &mut lists, None);
    assert!(matches!(e, Err(GpuError::BufferTooSmall { argument: "pooled", .. })), "{e:?}");
    let mut pooled = stream.alloc_zeros::<f64>(workspace_len(&spec, &good)).unwrap();
    let (mut scores, mut nodes) = (stream.alloc_zeros::<f64>(1).unwrap(), stream.alloc_zeros::<i32>(1).unwrap());
    let e = select_pyramid_device(
        &stream,
        &spec,
        &good,
        PISA_SELECT,
        (&q, &k),
        &mut pooled,
        &mut lists,
        Some((&mut scores, &mut nodes)),
    );
    assert!(matches!(e, Err(GpuError::BufferTooSmall { argument: "trace scores", .. })), "{e:?}");
    let selection = run(&spec, &good).expect("a valid selection after the refusals");
    assert_eq!(selection.lists.lists.dim(), (1, 1, 4, 3));
    selection.lists.validate(&spec).expect("the selector's lists follow the convention");
}

/// The killing cases of the catalog's `pisa_select` mutants: a causal GQA group of 3 over 21 leaves with β = 3 (four
/// levels, a partial last node at every level, a partial last leaf), Lq < Lk, `K` = 4, each scoring; identical leaves
/// so that exact ties decide; and an unmasked pair of sequences with β = 16 and `K` = 2 (below the forced three).
pub fn killing_cases() -> Vec<(&'static str, Case<bf16>, PyramidSelectConfig)> {
    let spec = dense(1, 3, 1, 1000, 1300, 64, 64, Mask::Causal);
    let mut tied = make_case::<bf16>(&spec, gaussian(1.0), 41);
    for j in 0..1300 {
        if (j / 64) % 4 == 2 {
            for c in 0..64 {
                tied.k[[0, 0, j, c]] = tied.k[[0, 0, j % 64 + 64, c]];
            }
        }
    }
    let pyramid = |scoring, branching, keep| PyramidConfig { leaf_size: 64, branching, keep, scoring };
    let spec = dense(2, 2, 2, 130, 1100, 64, 64, Mask::None);
    let plain = make_case::<bf16>(&spec, gaussian(4.0), 42);
    let mut cases = vec![];
    for (name, scoring) in [
        ("causal_gqa3_lse", Scoring::Lse),
        ("causal_gqa3_pisa1", Scoring::Pisa1),
        ("causal_gqa3_pisa2", Scoring::Pisa2),
    ] {
        cases.push((name, tied.clone(), PyramidSelectConfig { q_block: 64, pyramid: pyramid(scoring, 3, 4) }));
    }
    // Self-attention at aligned blocks: every query block's last visible key ends a leaf, so the next leaf (a sibling
    // of the forced current one) starts one key past the eligible range and must stay unscored.
    let spec = dense(1, 4, 2, 704, 704, 64, 64, Mask::Causal);
    let aligned = make_case::<bf16>(&spec, gaussian(2.0), 43);
    for (name, scoring) in
        [("causal_self_attention_lse", Scoring::Lse), ("causal_self_attention_pisa1", Scoring::Pisa1)]
    {
        cases.push((name, aligned.clone(), PyramidSelectConfig { q_block: 64, pyramid: pyramid(scoring, 2, 2) }));
    }
    cases.push((
        "no_mask_two_sequences_beta16",
        plain,
        PyramidSelectConfig { q_block: 128, pyramid: pyramid(Scoring::Lse, 16, 2) },
    ));
    cases
}

/// Runs the selector `kernel` on a killing case; `Ok(())` when its lists and trace pass the verification.
pub fn check_selection(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    case: &(Case<bf16>, PyramidSelectConfig),
) -> Result<(), String> {
    run_and_verify(stream, &case.0, &case.1, kernel).map(|_| ())
}
