//! PISA's covariance-aware selection on the GPU (`attnproof_gpu::pisa::covariance`, E24) against the oracle
//! (`attnproof_oracle::pisa::covariance_block_scores`), through `attnproof_harness::pisa_covariance`: every key block's
//! spread within its derived bound of the oracle's, and the lists equal to the oracle's entry for entry wherever the
//! scores' bounds cannot move the top-k boundary, ties between identical blocks (keys and values) to the lower index.
//!
//! The property suites draw the block selector's problems (`block_selection::selection_draws`: no mask or causal,
//! Lq ≠ Lk, varlen with empty sequences, GQA groups of 1 to 16, both block sizes, every `top_k`, forced blocks, copied
//! key blocks for exact ties) with value head dims 8 to 128, whole copied blocks (keys and values) where the draw ties
//! keys, and `γ` from 0 (BSA's ranking) to 64 (the spread decides); each draw runs twice (the same bits), with the
//! lists and spreads poisoned and guarded and the inputs checked unchanged. Without a device each test prints
//! `skipped: no CUDA device` and passes.

use std::cell::RefCell;
use std::sync::Arc;

use crate::block_selection::{SelectionDraw, SelectionSuite, Ties, selection_draws, with_tied_blocks};
use crate::common::*;
use crate::property::{default_run_config, run_config};
use attnproof_gpu::GpuError;
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::pisa::covariance::{
    CovarianceWorkspace, MAX_SPREAD_SHARED_BYTES, PISA_COVARIANCE, check_selection, covariance_select,
    covariance_select_device, spread_shared_bytes, spreads_len,
};
use attnproof_harness::Case;
use attnproof_harness::candidate::{poisoned, unguard};
use attnproof_harness::generate::make_case;
use attnproof_harness::pisa_covariance::{CovarianceVerdict, verify_covariance_selection};
use attnproof_oracle::bsa::BsaConfig;
use attnproof_oracle::pisa::CovarianceConfig;
use attnproof_oracle::{AttentionSpec, Layout, Mask};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::{Array3, Array4};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

/// One draw: the block selector's draw, the value head dim (in the spec) and `γ`.
#[derive(Clone, Debug)]
pub struct CovarianceDraw {
    /// Problem, blocks, values, seed and ties.
    pub selection: SelectionDraw,
    /// E24's weight on the spread.
    pub gamma: f64,
}

impl CovarianceDraw {
    /// The selector's configuration.
    pub fn config(&self) -> CovarianceConfig {
        CovarianceConfig { bsa: self.selection.config, gamma: self.gamma }
    }
}

/// The draws: [`selection_draws`] with a value head dim of 8, 64 or 128 (8 where `H_b − H̄` would not fit the spread
/// kernel's shared memory) and `γ` of 0, 0.5, 4 or 64.
pub fn covariance_draws() -> impl Strategy<Value = CovarianceDraw> {
    let dims = prop::sample::select(vec![8usize, 64, 128]);
    let gammas = prop::sample::select(vec![0.0, 0.5, 4.0, 64.0]);
    (selection_draws(), dims, gammas).prop_map(|(mut selection, dv, gamma)| {
        let d = selection.spec.head_dim;
        selection.spec.head_dim_v = if spread_shared_bytes(d, dv) <= MAX_SPREAD_SHARED_BYTES { dv } else { 8 };
        CovarianceDraw { selection, gamma }
    })
}

/// `case` with the draw's key-block copies made whole: the values of each copied key block copied too, so that the
/// two blocks are identical and their scores tie exactly.
pub fn with_tied_values<T: Storage>(mut case: Case<T>, kv_block: usize, ties: Ties) -> Case<T> {
    let spec = case.spec.clone();
    for seq in spec.sequences() {
        let copies = ties.copies(seq.len_k / kv_block);
        for kv in 0..spec.n_heads_kv {
            for &(from_block, to_block) in &copies {
                for j in 0..kv_block {
                    let (from, to) = (from_block * kv_block + j, to_block * kv_block + j);
                    for c in 0..spec.head_dim_v {
                        let x = spec.head_rows(case.v.view(), &seq, kv, true)[[from, c]];
                        match &spec.layout {
                            Layout::Dense { .. } => case.v[[seq.index, kv, to, c]] = x,
                            Layout::Varlen { .. } => case.v[[seq.k_start + to, kv, c]] = x,
                        }
                    }
                }
            }
        }
    }
    case
}

/// The case of a draw: its inputs with whole blocks copied where the draw ties keys.
pub fn draw_case<T: Storage>(draw: &CovarianceDraw) -> Case<T> {
    let s = &draw.selection;
    let case = make_case::<T>(&s.spec, s.profile, s.seed);
    with_tied_values(with_tied_blocks(case, s.config.kv_block, s.ties), s.config.kv_block, s.ties)
}

/// One guarded selection on the device: the lists poisoned with a sentinel below −1 and the spreads with NaN, both
/// followed by guard bands; Q, K and V read back unchanged.
pub fn select_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    config: &CovarianceConfig,
    kernel: KernelSource,
) -> Result<(Array4<i32>, Array3<f64>), String> {
    let spec = &case.spec;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let (q, k, v) = (upload(stream, &case.q)?, upload(stream, &case.k)?, upload(stream, &case.v)?);
    let shape = attnproof_gpu::block_sparse::select::lists_shape(spec, &config.bsa);
    let n: usize = shape.iter().product();
    let mut lists = poisoned(stream, n, i32::MIN, 0x5a5a_5a5a).map_err(|e| err(&e))?;
    let mut work = CovarianceWorkspace::alloc(stream, spec, config).map_err(|e| err(&e))?;
    let n_spreads = spreads_len(spec, config);
    work.spreads = poisoned(stream, n_spreads, f64::NAN, 7.25).map_err(|e| err(&e))?;
    covariance_select_device(stream, spec, config, kernel, (&q, &k, &v), &mut work, &mut lists).map_err(|e| err(&e))?;
    let back = stream.clone_dtoh(&lists).map_err(|e| err(&e))?;
    let spreads = stream.clone_dtoh(&work.spreads).map_err(|e| err(&e))?;
    for (name, device, host) in [("q", &q, &case.q), ("k", &k, &case.k), ("v", &v, &case.v)] {
        let again = stream.clone_dtoh(device).map_err(|e| err(&e))?;
        if again.iter().zip(host.iter()).any(|(a, b)| a.to_f32().to_bits() != b.to_f32().to_bits()) {
            return Err(format!("the selection changed its input {name}"));
        }
    }
    stream.synchronize().map_err(|e| err(&e))?;
    let lists = unguard("lists", back, n, &shape, |x: i32| x == 0x5a5a_5a5a).map_err(|e| err(&e))?;
    let blocks = shape_of_spreads(spec, config);
    let spreads = unguard("spreads", spreads, n_spreads, &blocks, |x: f64| x == 7.25).map_err(|e| err(&e))?;
    if let Some(at) = spreads.iter().position(|x| !x.is_finite()) {
        return Err(format!("spread {at} is {} (poison left or not finite)", spreads.iter().nth(at).unwrap()));
    }
    Ok((lists.into_dimensionality().expect("rank 4"), spreads.into_dimensionality().expect("rank 3")))
}

/// The spreads' shape: `[B, Hkv, key blocks of the longest sequence]`.
fn shape_of_spreads(spec: &AttentionSpec, config: &CovarianceConfig) -> [usize; 3] {
    let blocks = spec.sequences().iter().map(|s| config.bsa.key_blocks(s)).max().unwrap_or(0);
    [spec.sequences().len(), spec.n_heads_kv, blocks]
}

/// The verdict of a selection's outputs for `case`.
fn verdict<T: Storage>(
    case: &Case<T>,
    config: &CovarianceConfig,
    (lists, spreads): &(Array4<i32>, Array3<f64>),
) -> Result<CovarianceVerdict, String> {
    verify_covariance_selection(case, config, lists.view(), spreads.view()).map_err(|e| e.to_string())
}

/// Runs `kernel` on `case` twice and verifies the first run; `Err` names the failure.
pub fn check_case<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    case: &Case<T>,
    config: &CovarianceConfig,
) -> Result<CovarianceVerdict, String> {
    let first = select_guarded(stream, case, config, kernel)?;
    let again = select_guarded(stream, case, config, kernel)?;
    let same_spreads = first.1.iter().zip(again.1.iter()).all(|(a, b)| a.to_bits() == b.to_bits());
    if first.0 != again.0 || !same_spreads {
        return Err("the same input gave different lists or spreads".into());
    }
    let v = verdict(case, config, &first)?;
    if v.passed() {
        Ok(v)
    } else {
        let first_failure = v.selection.failures.first().cloned().unwrap_or_default();
        Err(format!("spread ratio {:e} at {}; {first_failure}", v.spread_ratio, v.spread_worst))
    }
}

/// The two suites ("pisacov" in ASCII, plus the dtype), with the block selector's suite fields.
pub const COVARIANCE_SUITES: [SelectionSuite; 2] = [
    SelectionSuite { name: "gpu_pisa_covariance_bf16", bf16: true, cases: 40, seed: 0x7069_7361_636f_7601 },
    SelectionSuite { name: "gpu_pisa_covariance_f16", bf16: false, cases: 40, seed: 0x7069_7361_636f_7602 },
];

/// Runs the draws of [`covariance_draws`] under `config` (a suite's), `check` on every draw.
pub fn run_suite_with(
    config: Config,
    check: impl Fn(&CovarianceDraw) -> Result<(), TestCaseError>,
) -> Result<(), Box<TestError<CovarianceDraw>>> {
    TestRunner::new(config).run(&covariance_draws(), |draw| check(&draw)).map_err(Box::new)
}

/// The check of one draw of `suite` by `kernel`, adding the rows compared exactly to `decided`.
pub fn check_draw(
    suite: &SelectionSuite,
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    decided: &RefCell<usize>,
    draw: &CovarianceDraw,
) -> Result<(), TestCaseError> {
    let verdict = if suite.bf16 {
        check_case(stream, kernel, &draw_case::<bf16>(draw), &draw.config())
    } else {
        check_case(stream, kernel, &draw_case::<f16>(draw), &draw.config())
    };
    let verdict = verdict.map_err(TestCaseError::fail)?;
    *decided.borrow_mut() += verdict.selection.decided;
    Ok(())
}

fn run_suite(suite: &SelectionSuite) {
    let Some(stream) = device_stream(suite.name) else { return };
    let decided = RefCell::new(0usize);
    let result = run_suite_with(run_config(suite.name, suite.cases, suite.seed), |d| {
        check_draw(suite, &stream, PISA_COVARIANCE, &decided, d)
    });
    if let Err(e) = result {
        panic!("{}: {e}", suite.name);
    }
    assert!(*decided.borrow() > 0, "{}: no row was compared exactly", suite.name);
}

#[test]
fn covariance_selection_matches_the_oracle_bf16() {
    run_suite(&COVARIANCE_SUITES[0]);
}

#[test]
fn covariance_selection_matches_the_oracle_f16() {
    run_suite(&COVARIANCE_SUITES[1]);
}

/// Replayed without a device: every draw passes the wrappers' checks (so the suites test the kernels, not the
/// refusals), and the suites draw GQA, ties, value head dims above 8, every `γ` and both selector kernels.
#[test]
fn the_covariance_suites_draw_what_they_claim_and_pass_the_checks() {
    let seen = RefCell::new([0usize; 6]);
    for suite in &COVARIANCE_SUITES {
        let result = run_suite_with(default_run_config(suite.name, suite.cases, suite.seed), |d| {
            check_selection(&d.selection.spec, &d.config()).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let mut s = seen.borrow_mut();
            s[0] += usize::from(d.selection.spec.group_size() > 1);
            s[1] += usize::from(d.selection.ties != Ties::None);
            s[2] += usize::from(d.selection.spec.head_dim_v > 8);
            s[3] += usize::from(d.gamma == 0.0);
            s[4] += usize::from(d.gamma >= 4.0);
            s[5] += usize::from(d.selection.config.top_k > attnproof_gpu::block_sparse::select::STREAM_MAX_TOP_K);
            Ok(())
        });
        assert!(result.is_ok(), "{result:?}");
    }
    let s = seen.into_inner();
    assert!(s.iter().all(|&n| n > 0), "{s:?}");
}

/// The first draws of each suite through the kernels' schedule on the CPU
/// (`attnproof_reference::sparse::pisa::pisa_covariance_select`: the same statistics, the spreads' fused multiply-add
/// chains and power steps, BSA's pooled scores plus the spread term), held by the same verifier: no device needed, so
/// the verifier's bounds meet the suites' shapes, ties, `γ` and logit scales on every machine.
#[test]
fn the_reference_schedule_passes_the_suites_draws() {
    for suite in &COVARIANCE_SUITES {
        let config = Config { cases: 16, ..default_run_config(suite.name, suite.cases, suite.seed) };
        let decided = RefCell::new(0usize);
        let result = run_suite_with(config, |d| {
            let verdict = if suite.bf16 { reference_verdict::<bf16>(d) } else { reference_verdict::<f16>(d) };
            let v = verdict.map_err(TestCaseError::fail)?;
            prop_assert!(v.passed(), "{:e} at {}; {:?}", v.spread_ratio, v.spread_worst, v.selection.failures);
            *decided.borrow_mut() += v.selection.decided;
            Ok(())
        });
        assert!(result.is_ok(), "{}: {result:?}", suite.name);
        assert!(*decided.borrow() > 0, "{}: no row was compared exactly", suite.name);
    }
}

/// The reference schedule's lists and spreads for a draw, verified.
fn reference_verdict<T: Storage>(draw: &CovarianceDraw) -> Result<CovarianceVerdict, String> {
    let case = draw_case::<T>(draw);
    let inputs = attnproof_reference::flash::Inputs { q: case.q.view(), k: case.k.view(), v: case.v.view() };
    let run = attnproof_reference::sparse::pisa::pisa_covariance_select(&case.spec, &inputs, &draw.config())
        .map_err(|e| e.to_string())?;
    verdict(&case, &draw.config(), &(run.lists, run.spreads))
}

/// Bad parameters and buffers are typed errors before any launch; the device stays usable.
#[test]
fn bad_covariance_input_is_a_typed_error() {
    let Some(stream) = device_stream("pisa_covariance::bad_covariance_input_is_a_typed_error") else { return };
    let spec = dense(1, 2, 1, 200, 300, 64, 64, Mask::Causal);
    let case = make_case::<bf16>(&spec, gaussian(1.0), 9);
    let good = CovarianceConfig {
        bsa: BsaConfig { q_block: 64, kv_block: 64, top_k: 2, force_first: true, force_local: 1 },
        gamma: 2.0,
    };
    let run = |spec: &AttentionSpec, c: &CovarianceConfig| {
        covariance_select(&stream, spec, c, case.q.view(), case.k.view(), case.v.view())
    };
    for gamma in [-0.5, f64::NAN, f64::INFINITY] {
        assert!(matches!(run(&spec, &CovarianceConfig { gamma, ..good }), Err(GpuError::Spec(_))), "{gamma}");
    }
    let wide = CovarianceConfig { bsa: BsaConfig { top_k: 6, ..good.bsa }, ..good };
    assert!(matches!(run(&spec, &wide), Err(GpuError::Unsupported { argument: "top_k", .. })));
    let window = spec.clone().with_mask(Mask::Window { left: 8, right: 0 });
    assert!(matches!(run(&window, &good), Err(GpuError::Unsupported { argument: "mask", .. })));
    let big = dense(1, 2, 1, 200, 300, 256, 256, Mask::Causal);
    let big_case = make_case::<bf16>(&big, gaussian(1.0), 9);
    let e = covariance_select(&stream, &big, &good, big_case.q.view(), big_case.k.view(), big_case.v.view());
    assert!(matches!(e, Err(GpuError::Unsupported { argument: "head_dim", .. })), "{e:?}");
    let other = dense(1, 2, 1, 200, 301, 64, 64, Mask::Causal);
    assert!(matches!(run(&other, &good), Err(GpuError::Shape { .. })));
    let (q, k, v) =
        (upload(&stream, &case.q).unwrap(), upload(&stream, &case.k).unwrap(), upload(&stream, &case.v).unwrap());
    let mut work = CovarianceWorkspace::alloc(&stream, &spec, &good).unwrap();
    work.spreads = stream.alloc_zeros::<f64>(1).unwrap();
    let mut lists = stream.alloc_zeros::<i32>(64).unwrap();
    let e = covariance_select_device(&stream, &spec, &good, PISA_COVARIANCE, (&q, &k, &v), &mut work, &mut lists);
    assert!(matches!(e, Err(GpuError::BufferTooSmall { argument: "work.spreads", .. })), "{e:?}");
    let selection = run(&spec, &good).expect("a valid selection after the refusals");
    assert_eq!(selection.lists.lists.dim(), (1, 1, 4, 2));
    assert_eq!(selection.spreads.dim(), (1, 1, 5));
    selection.lists.validate(&spec).expect("the selector's lists follow the convention");
}

/// Small shapes for compute-sanitizer: a partial last block of 1 key, a GQA group of 3, varlen with an empty
/// sequence and one shorter than a block, both selector kernels, the E31 head dims (192 × 128).
#[test]
fn sanitizer_shapes() {
    let Some(stream) = device_stream("pisa_covariance::sanitizer_shapes") else { return };
    let config = |top_k, kv_block| CovarianceConfig {
        bsa: BsaConfig { q_block: 64, kv_block, top_k, force_first: true, force_local: 1 },
        gamma: 4.0,
    };
    let varlen = AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: vec![0, 70, 70, 130], cu_seqlens_k: vec![0, 129, 129, 169] },
        ..dense(1, 3, 1, 1, 1, 64, 32, Mask::Causal)
    };
    let shapes = [
        (dense(1, 3, 1, 65, 129, 64, 64, Mask::Causal), config(2, 64)),
        (dense(2, 2, 2, 64, 2200, 32, 16, Mask::None), config(34, 64)),
        (varlen, config(2, 64)),
        (dense(1, 2, 1, 128, 257, 192, 128, Mask::Causal), config(3, 128)),
    ];
    for (spec, config) in shapes {
        let case = make_case::<bf16>(&spec, gaussian(1.0), 61);
        check_case(&stream, PISA_COVARIANCE, &case, &config).unwrap_or_else(|e| panic!("{spec:?}: {e}"));
    }
}

/// A killing case: the inputs and the configuration.
pub type KillingCase = (Case<bf16>, CovarianceConfig);

/// The killing cases of the catalog's `pisa_covariance` mutants: causal with a GQA group of 3, Lq ≠ Lk and a partial
/// last block, `γ = 16` so that the spread term decides many rows; no mask over two KV heads of a group of 5, the
/// partial last block a candidate (nothing forced), small logits; no mask over a last block of three keys with `γ = 0`
/// (the key count alone separates it); and lists wider than the streaming kernel's (the rounds kernel) over a varlen
/// batch.
pub fn killing_cases() -> Vec<(&'static str, KillingCase)> {
    let cfg = |q_block, kv_block, top_k, force_first, force_local, gamma| CovarianceConfig {
        bsa: BsaConfig { q_block, kv_block, top_k, force_first, force_local },
        gamma,
    };
    let causal = dense(1, 3, 1, 200, 650, 64, 64, Mask::Causal);
    let none = dense(1, 10, 2, 130, 64 * 9 + 5, 32, 32, Mask::None);
    let wide = AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: vec![0, 256, 400], cu_seqlens_k: vec![0, 2600, 3000] },
        ..dense(1, 4, 2, 1, 1, 64, 64, Mask::Causal)
    };
    // Eight query blocks over five whole key blocks and one of three keys, nothing forced, γ = 0: the short block's
    // ln 3 against the others' ln 64 (times the group of 3) keeps it out of the lists unless its pooled score leads.
    let short = dense(1, 6, 2, 64 * 8, 64 * 5 + 3, 32, 32, Mask::None);
    vec![
        ("causal_gqa3_partial_block", (make_case(&causal, gaussian(1.0), 71), cfg(64, 64, 4, true, 1, 16.0))),
        ("no_mask_short_last_block", (make_case(&short, gaussian(1.0), 74), cfg(64, 64, 2, false, 0, 0.0))),
        ("no_mask_gqa5_partial_candidate", (make_case(&none, gaussian(0.25), 72), cfg(64, 64, 3, false, 0, 4.0))),
        ("causal_wide_lists_varlen", (make_case(&wide, gaussian(1.0), 73), cfg(64, 64, 36, true, 1, 2.0))),
    ]
}

/// Runs `kernel` on a killing case; `Ok(())` when it passes.
pub fn check_killing_case(stream: &Arc<CudaStream>, kernel: KernelSource, case: &KillingCase) -> Result<(), String> {
    check_case(stream, kernel, &case.0, &case.1).map(|_| ())
}

/// The spread term moves the lists: on the first killing case, `γ = 16` chooses differently from `γ = 0` (BSA's
/// ranking) in some row, so the suites' `γ` reaches the kernels' spread path.
#[test]
fn the_spread_term_changes_the_choice() {
    let Some(stream) = device_stream("pisa_covariance::the_spread_term_changes_the_choice") else { return };
    let (case, config) = &killing_cases()[0].1;
    let with = select_guarded(&stream, case, config, PISA_COVARIANCE).expect("γ = 16");
    let without =
        select_guarded(&stream, case, &CovarianceConfig { gamma: 0.0, ..*config }, PISA_COVARIANCE).expect("γ = 0");
    assert_ne!(with.0, without.0, "the spread term chose nothing differently");
    assert_eq!(with.1, without.1, "the spreads do not depend on γ");
}
