//! GPU mutants: the catalog's kernel-text mutants (`attnproof-catalog`, `Runner::KernelText`), named source patches
//! of `gpu/kernels/flash_fwd.cu` and `gpu/kernels/flash_bwd.cu`, each compiled by NVRTC through the same
//! `compile::module_from_source` path as the production kernels and launched through the production wrappers
//! (`flash_forward_device_with`, `flash_backward_device_with`), with NaN-poisoned, guarded outputs, must all be
//! killed by the oracle verdicts of a few small cases, and again by the general property suites (`crate::property`)
//! alone, so that the suites that judge every kernel change are shown able to catch each modelled bug. The mutants of
//! `flash_fwd`'s block-sparse mode (`BLOCK_SPARSE`) run through `block_sparse_forward_device_with` against the
//! block-sparse killing cases and suite (`crate::block_sparse`), those of `flash_bwd`'s through
//! `block_sparse_backward_device_with` against the block-sparse backward's (`crate::block_sparse_backward`), and those
//! of the sm_90a forward (`flash_fwd_sm90.cu`, block-sparse mode) against its own cases and suite on a 9.0 device. Mutants
//! of `gpu/kernels/common.cuh`, which is prepended to both attention kernels, name the kernel that must kill them.
//!
//! Production code has no mutation hook: the patches are applied here, to the text the crate embeds, and the patched
//! text is an ordinary argument of the public API. The unpatched kernel must pass every case first, so that a kill
//! means the patch, not the case, broke the result. Each patch must match its anchor exactly once, so a refactor of
//! a kernel that moves an anchor fails this test instead of silently dropping the mutant. Without a device the tests
//! print `skipped: no CUDA device` and pass.

use std::sync::Arc;

use crate::block_selection;
use crate::block_sparse;
use crate::block_sparse_backward;
use crate::common::*;
use crate::property::{PropertySuite, check, run_suite, suite};
use attnproof_catalog::{Mutant, Runner};
use attnproof_gpu::backward::Q_TILE;
use attnproof_gpu::block_sparse::BlockLists;
use attnproof_gpu::block_sparse::select::BSA_SELECT;
use attnproof_gpu::compile::{FLASH_BWD, FLASH_FWD, FLASH_FWD_SM90, KernelSource, compile_for_arch};
use attnproof_gpu::flash::ForwardTiling;
use attnproof_gpu::{BackwardTiling, GpuBackwardStrategy, module_variants, nvrtc_or_skip, skip_unless_gpu};
use attnproof_harness::adversarial::{Direction, Worst};
use attnproof_harness::backward::{BackwardCandidate, BackwardExpectation};
use attnproof_harness::candidate::GpuCandidate;
use attnproof_harness::candidate::block_sparse_forward_guarded;
use attnproof_harness::generate::{Distribution, ValueProfile, make_case};
use attnproof_harness::sparse::verify_block_sparse_forward;
use attnproof_harness::{Case, verify_forward};
use attnproof_oracle::bsa::BsaConfig;
use attnproof_oracle::{AttentionSpec, Mask};
use cudarc::driver::CudaStream;
use half::bf16;
use proptest::test_runner::{Config, TestError};

/// The kernels whose catalog mutants ([`Runner::KernelText`]) this test launches. Each has its killing cases below,
/// and every mutant of a kernel is tried against every case of that kernel until one kills it.
const KERNELS: [KernelSource; 4] = [FLASH_FWD, FLASH_BWD, BSA_SELECT, FLASH_FWD_SM90];

/// The define of `flash_fwd`'s block-sparse mode, whose mutants the block-sparse cases hunt.
const BLOCK_SPARSE: &str = "BLOCK_SPARSE";

/// The catalog's kernel-text mutants of `kernel`'s plain mode, in catalog order.
fn catalog_mutants(kernel: KernelSource) -> Vec<&'static Mutant> {
    attnproof_catalog::kernel_text_mutants(kernel.name, None).collect()
}

/// The catalog's mutants of `flash_fwd`'s block-sparse mode.
fn block_sparse_mutants() -> Vec<&'static Mutant> {
    attnproof_catalog::kernel_text_mutants(FLASH_FWD.name, Some(BLOCK_SPARSE)).collect()
}

/// The backward's killing cases: Lq ≠ Lk both ways with tails, GQA, a window, causal, and a logit scale of 4.
fn backward_cases(stream: &Arc<CudaStream>) -> Vec<(&'static str, Problem<bf16>)> {
    let d64 = |b, hq, hkv, lq, lk, mask: Mask| AttentionSpec::dense(b, hq, hkv, lq, lk, 64, 64).with_mask(mask);
    vec![
        ("causal_lq_gt_lk_gqa", problem(stream, &d64(1, 4, 2, 150, 100, Mask::Causal), gaussian(1.0), 13)),
        ("none_lq_lt_lk_tail", problem(stream, &d64(1, 2, 1, 70, 140, Mask::None), gaussian(1.0), 14)),
        ("window_7_3", problem(stream, &d64(1, 2, 2, 130, 130, Mask::Window { left: 7, right: 3 }), gaussian(1.0), 15)),
        ("logit_scale_4", problem(stream, &d64(1, 1, 1, 65, 129, Mask::None), gaussian(4.0), 16)),
    ]
}

/// The killing cases: one head dim (one module per mutant), masks, Lq ≠ Lk both ways, tails, GQA, a window, and a
/// row max in the last tile at logit scale 100.
fn forward_cases() -> Vec<(&'static str, Case<bf16>)> {
    let dense = |b, hq, hkv, lq, lk, mask: Mask| AttentionSpec::dense(b, hq, hkv, lq, lk, 64, 64).with_mask(mask);
    vec![
        ("causal_lq_gt_lk_gqa", make_case(&dense(1, 4, 2, 200, 130, Mask::Causal), gaussian(1.0), 3)),
        ("none_lq_lt_lk_tail", make_case(&dense(1, 2, 1, 130, 200, Mask::None), gaussian(1.0), 4)),
        ("window_7_3", make_case(&dense(1, 2, 2, 190, 190, Mask::Window { left: 7, right: 3 }), gaussian(1.0), 5)),
        (
            "max_in_last_tile_x100",
            make_case(
                &dense(1, 1, 1, 65, 200, Mask::None),
                ValueProfile { distribution: Distribution::MaxInLastTile, logit_scale: 100.0, value_mean: 3.0 },
                6,
            ),
        ),
    ]
}

/// Runs the forward `kernel` on `case` (guarded); `Ok(())` when the verdict passes and the gate is valid, otherwise
/// why not.
fn check_forward(stream: &Arc<CudaStream>, kernel: KernelSource, case: &Case<bf16>) -> Result<(), String> {
    let tiling = ForwardTiling::for_head_dims(case.spec.head_dim, case.spec.head_dim_v);
    let (o, lse) = run_forward_guarded(stream, case, kernel, tiling)?;
    let verdict = verify_forward(case, forward_recipe::<bf16>(), o.view(), lse.view()).map_err(|e| e.to_string())?;
    if verdict.passed() && verdict.valid() {
        Ok(())
    } else {
        Err(format!("verdict failed, worst error/bound {:.3e}", verdict.max_ratio()))
    }
}

/// A backward killing case and what its runs are judged against (computed once for every mutant).
struct BackwardCase {
    problem: Problem<bf16>,
    expect: BackwardExpectation,
}

/// Runs the backward `kernel` with every dQ strategy on `c` (guarded); `Ok(())` when every verdict passes with a
/// valid gate, otherwise the first strategy's reason.
fn check_backward(stream: &Arc<CudaStream>, kernel: KernelSource, c: &BackwardCase) -> Result<(), String> {
    for strategy in GpuBackwardStrategy::ALL {
        let g = run_backward_guarded(stream, &c.problem, kernel, strategy).map_err(|e| format!("{strategy:?}: {e}"))?;
        let candidate = BackwardCandidate { dq: g.dq.view(), dk: g.dk.view(), dv: g.dv.view(), delta: g.delta.view() };
        let verdict = c.expect.verify(candidate).map_err(|e| format!("{strategy:?}: {e}"))?;
        if !(verdict.passed() && verdict.valid()) {
            return Err(format!("{strategy:?}: verdict failed, worst error/bound {:.3e}", verdict.max_ratio()));
        }
    }
    Ok(())
}

/// `base` with one patch applied; panics unless the anchor occurs exactly once.
fn patched(base: KernelSource, m: &Mutant) -> KernelSource {
    let text = m.apply(base.source).unwrap_or_else(|stale| panic!("mutant `{}` in {}: {stale}", m.name, base.name));
    // Leaked: a module's cache key holds its source for the rest of the process, and the catalog is small.
    KernelSource { name: base.name, source: Box::leak(text.into_boxed_str()) }
}

/// Requires the unpatched `base` to pass every case, then every mutant of `catalog` to fail one; prints the table.
fn hunt<C>(
    base: KernelSource,
    catalog: &[&Mutant],
    cases: &[(&str, C)],
    check: impl Fn(KernelSource, &C) -> Result<(), String>,
) {
    for (name, case) in cases {
        if let Err(why) = check(base, case) {
            panic!("the unpatched {} fails case `{name}`: {why}", base.name);
        }
    }
    assert!(!catalog.is_empty(), "the catalog holds no kernel-text mutant of {}", base.name);
    let mut survivors = vec![];
    println!("{:<40} {:<24} detail", "mutant", "killed by");
    for m in catalog {
        let kernel = patched(base, m);
        let kill = cases.iter().find_map(|(name, case)| check(kernel, case).err().map(|why| (*name, why)));
        match kill {
            Some((by, why)) => {
                let first_line = why.lines().next().unwrap_or("").chars().take(70).collect::<String>();
                println!("{:<40} {:<24} {first_line}", m.name, by);
            }
            None => {
                println!("{:<40} {:<24}", m.name, "SURVIVED");
                survivors.push(m.name);
            }
        }
    }
    println!("gpu mutants of {}: {} of {} killed", base.name, catalog.len() - survivors.len(), catalog.len());
    assert!(survivors.is_empty(), "surviving GPU mutants of {}: {survivors:?}", base.name);
}

#[test]
fn all_forward_mutants_are_killed() {
    let Some(ctx) = skip_unless_gpu("all_forward_mutants_are_killed") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    hunt(FLASH_FWD, &catalog_mutants(FLASH_FWD), &forward_cases(), |kernel, case| check_forward(&stream, kernel, case));
}

/// Runs the block-sparse forward `kernel` on a killing case (guarded); `Ok(())` when every verdict passes with a
/// valid gate.
fn check_block_sparse(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    case: &(Case<bf16>, BlockLists),
) -> Result<(), String> {
    let (case, lists) = case;
    let run = block_sparse_forward_guarded(stream, case, lists, kernel).map_err(|e| e.to_string())?;
    let layout = lists.oracle_layout(&case.spec);
    let verdicts = verify_block_sparse_forward(case, &layout, forward_recipe::<bf16>(), run.o.view(), run.lse.view())
        .map_err(|e| e.to_string())?;
    match verdicts.iter().find(|v| !(v.passed() && v.valid())) {
        None => Ok(()),
        Some(v) => Err(format!("verdict failed, worst error/bound {:.3e}", v.max_ratio())),
    }
}

#[test]
fn all_block_sparse_forward_mutants_are_killed() {
    let Some(ctx) = skip_unless_gpu("all_block_sparse_forward_mutants_are_killed") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let cases: Vec<(&str, (Case<bf16>, BlockLists))> =
        block_sparse::killing_cases().into_iter().map(|(name, case, lists)| (name, (case, lists))).collect();
    hunt(FLASH_FWD, &block_sparse_mutants(), &cases, |kernel, c| check_block_sparse(&stream, kernel, c));
}

/// Runs each of `mutants` (patches of `base`) through `run_suite`, which runs a general property suite on the patched
/// kernel and returns its result; every mutant must make the suite fail. Prints mutant and first line of why.
fn hunt_in_suite<D: std::fmt::Debug>(
    base: KernelSource,
    mutants: &[&Mutant],
    suite_name: &str,
    run_suite: impl Fn(KernelSource) -> Result<(), Box<TestError<D>>>,
) {
    assert!(!mutants.is_empty(), "no mutants of {} to hunt", base.name);
    let mut survivors = vec![];
    for m in mutants {
        match run_suite(patched(base, m)).map_err(|e| *e) {
            Err(TestError::Fail(why, _)) => println!("{:<40} {}", m.name, why.message().lines().next().unwrap_or("")),
            Err(TestError::Abort(why)) => panic!("{suite_name}: the suite gave up on mutant `{}`: {why}", m.name),
            Ok(()) => {
                println!("{:<40} SURVIVED", m.name);
                survivors.push(m.name);
            }
        }
    }
    assert!(survivors.is_empty(), "mutants of {} the general suite {suite_name} misses: {survivors:?}", base.name);
}

/// Every block-sparse mutant also fails the general block-sparse property suite (bf16, its default draws).
#[test]
fn all_block_sparse_forward_mutants_are_killed_by_the_general_suite() {
    let Some(ctx) = skip_unless_gpu("all_block_sparse_forward_mutants_are_killed_by_the_general_suite") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let suite = &block_sparse::BLOCK_SUITES[0];
    hunt_in_suite(FLASH_FWD, &block_sparse_mutants(), suite.name, |kernel| {
        let worst = std::cell::RefCell::new(Worst::default());
        suite.run(suite.default_config(), |draw| suite.check(&stream, kernel, &worst, draw)).1.map_err(Box::new)
    });
}

/// The catalog's mutants of the sm_90a forward (all of its block-sparse mode, the one the wrappers launch).
fn wgmma_mutants() -> Vec<&'static Mutant> {
    attnproof_catalog::kernel_text_mutants(FLASH_FWD_SM90.name, Some(BLOCK_SPARSE)).collect()
}

#[test]
fn all_wgmma_forward_mutants_are_killed() {
    if !block_sparse::on_hopper("all_wgmma_forward_mutants_are_killed") {
        return;
    }
    let ctx = attnproof_gpu::cuda_device().expect("a device");
    let stream = ctx.new_stream().expect("create a stream");
    let cases: Vec<(&str, (Case<bf16>, BlockLists))> =
        block_sparse::wgmma_killing_cases().into_iter().map(|(name, case, lists)| (name, (case, lists))).collect();
    hunt(FLASH_FWD_SM90, &wgmma_mutants(), &cases, |kernel, c| check_block_sparse(&stream, kernel, c));
}

/// Every sm_90a forward mutant also fails that kernel's general block-sparse suite (bf16, its default draws).
#[test]
fn all_wgmma_forward_mutants_are_killed_by_the_general_suite() {
    if !block_sparse::on_hopper("all_wgmma_forward_mutants_are_killed_by_the_general_suite") {
        return;
    }
    let ctx = attnproof_gpu::cuda_device().expect("a device");
    let stream = ctx.new_stream().expect("create a stream");
    let suite = &block_sparse::WGMMA_SUITES[0];
    hunt_in_suite(FLASH_FWD_SM90, &wgmma_mutants(), suite.name, |kernel| {
        let worst = std::cell::RefCell::new(Worst::default());
        suite.run(suite.default_config(), |draw| suite.check(&stream, kernel, &worst, draw)).1.map_err(Box::new)
    });
}

/// The catalog's mutants of `flash_bwd`'s block-sparse mode.
fn block_sparse_backward_mutants() -> Vec<&'static Mutant> {
    attnproof_catalog::kernel_text_mutants(FLASH_BWD.name, Some(BLOCK_SPARSE)).collect()
}

#[test]
fn all_block_sparse_backward_mutants_are_killed() {
    let Some(ctx) = skip_unless_gpu("all_block_sparse_backward_mutants_are_killed") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let suite = &block_sparse_backward::BACKWARD_SUITES[0];
    hunt(FLASH_BWD, &block_sparse_backward_mutants(), &block_sparse_backward::killing_cases(), |kernel, draw| {
        let worst = std::cell::RefCell::new(Worst::default());
        block_sparse_backward::check_draw(suite, &stream, kernel, &worst, draw).map_err(|e| e.to_string())
    });
}

/// Every block-sparse backward mutant also fails the general block-sparse backward suite (bf16, its default draws).
#[test]
fn all_block_sparse_backward_mutants_are_killed_by_the_general_suite() {
    let Some(ctx) = skip_unless_gpu("all_block_sparse_backward_mutants_are_killed_by_the_general_suite") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let suite = &block_sparse_backward::BACKWARD_SUITES[0];
    hunt_in_suite(FLASH_BWD, &block_sparse_backward_mutants(), suite.name, |kernel| {
        let worst = std::cell::RefCell::new(Worst::default());
        suite
            .run(suite.default_config(), |draw| block_sparse_backward::check_draw(suite, &stream, kernel, &worst, draw))
            .1
            .map_err(Box::new)
    });
}

#[test]
fn all_block_selection_mutants_are_killed() {
    let Some(ctx) = skip_unless_gpu("all_block_selection_mutants_are_killed") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let cases: Vec<(&str, (Case<bf16>, BsaConfig))> =
        block_selection::killing_cases().into_iter().map(|(name, case, config)| (name, (case, config))).collect();
    hunt(BSA_SELECT, &catalog_mutants(BSA_SELECT), &cases, |kernel, c| {
        block_selection::check_selection(&stream, kernel, c)
    });
}

/// Every selector mutant also fails the general selection suite (bf16, its default draws).
#[test]
fn all_block_selection_mutants_are_killed_by_the_general_suite() {
    let Some(ctx) = skip_unless_gpu("all_block_selection_mutants_are_killed_by_the_general_suite") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let suite = &block_selection::SELECTION_SUITES[0];
    hunt_in_suite(BSA_SELECT, &catalog_mutants(BSA_SELECT), suite.name, |kernel| {
        let tally = std::cell::RefCell::new(block_selection::SelectionTally::default());
        let config =
            Config { max_shrink_iters: 0, ..crate::property::default_run_config(suite.name, suite.cases, suite.seed) };
        suite.run(config, |draw| suite.check(&stream, kernel, &tally, draw)).1.map_err(Box::new)
    });
}

#[test]
fn all_backward_mutants_are_killed() {
    let Some(ctx) = skip_unless_gpu("all_backward_mutants_are_killed") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let cases: Vec<(&str, BackwardCase)> = backward_cases(&stream)
        .into_iter()
        .map(|(name, problem)| {
            let expect = BackwardExpectation::new(&problem.case, &problem.d_out, Q_TILE, backward_recipe::<bf16>())
                .unwrap_or_else(|e| panic!("case `{name}`: {e}"));
            (name, BackwardCase { problem, expect })
        })
        .collect();
    hunt(FLASH_BWD, &catalog_mutants(FLASH_BWD), &cases, |kernel, c| check_backward(&stream, kernel, c));
}

/// Runs every catalog mutant of `base` through the general property suite `suite` (its default draws, bf16, no
/// shrinking: the first failing draw kills) and requires each to fail, as the hand-picked cases above do. The
/// production kernel passes the same draws in `flash_forward`/`flash_backward`, so a failure is the patch's. Prints
/// the table: mutant, the draw that killed it, the first line of why.
fn hunt_with_general_suite(base: KernelSource, suite: &PropertySuite, candidate: &GpuCandidate) {
    let catalog = catalog_mutants(base);
    assert!(!catalog.is_empty(), "the catalog holds no kernel-text mutant of {}", base.name);
    let mut survivors = vec![];
    println!("{:<40} {:<8} detail", "mutant", "draw");
    for m in &catalog {
        let patched_kernel = patched(base, m);
        let mutant = match suite.direction {
            Direction::Forward => GpuCandidate { forward_kernel: patched_kernel, ..candidate.clone() },
            Direction::Backward => GpuCandidate { backward_kernel: patched_kernel, ..candidate.clone() },
        };
        let config = Config { max_shrink_iters: 0, ..suite.default_config() };
        let draws = std::cell::Cell::new(0usize);
        let worst = std::cell::RefCell::new(Worst::default());
        let (_, result) = run_suite(suite, config, |draw| {
            draws.set(draws.get() + 1);
            check(suite, &mutant, &worst, draw)
        });
        match result {
            Err(TestError::Fail(why, _)) => {
                let first_line = why.message().lines().next().unwrap_or("").chars().take(70).collect::<String>();
                println!("{:<40} {:<8} {first_line}", m.name, draws.get());
            }
            Err(TestError::Abort(why)) => panic!("{}: the suite gave up on mutant `{}`: {why}", suite.name, m.name),
            Ok(()) => {
                println!("{:<40} {:<8}", m.name, "SURVIVED");
                survivors.push(m.name);
            }
        }
    }
    println!(
        "gpu mutants of {} against {}: {} of {} killed",
        base.name,
        suite.name,
        catalog.len() - survivors.len(),
        catalog.len()
    );
    assert!(
        survivors.is_empty(),
        "GPU mutants of {} the general suite {} misses: {survivors:?}",
        base.name,
        suite.name
    );
}

#[test]
fn all_forward_mutants_are_killed_by_the_general_suite() {
    let Some(candidate) = GpuCandidate::if_available("all_forward_mutants_are_killed_by_the_general_suite") else {
        return;
    };
    hunt_with_general_suite(FLASH_FWD, suite("gpu_flash_forward_bf16"), &candidate);
}

#[test]
fn all_backward_mutants_are_killed_by_the_general_suite() {
    let Some(candidate) = GpuCandidate::if_available("all_backward_mutants_are_killed_by_the_general_suite") else {
        return;
    };
    hunt_with_general_suite(FLASH_BWD, suite("gpu_flash_backward_bf16"), &candidate);
}

/// Every mutant compiles (for sm_90a, with the killing cases' defines): a patch that broke the build would fail every
/// case and pass for killed without modelling any bug. Needs NVRTC only, not a device.
#[test]
fn every_mutant_compiles_for_sm_90a() {
    if !nvrtc_or_skip("every_mutant_compiles_for_sm_90a") {
        return;
    }
    let spec = AttentionSpec::dense(1, 2, 1, 64, 64, 64, 64);
    let variants = module_variants::<bf16>(&spec, ForwardTiling::for_head_dims(64, 64), BackwardTiling::DEFAULT)
        .expect("the cases' modules");
    // The plain module of each kernel (the ring modes add a define to it).
    let plain = |kernel: KernelSource| {
        variants.iter().filter(|v| v.kernel == kernel).min_by_key(|v| v.defines.len()).expect("a variant").clone()
    };
    let mut broken = vec![];
    for base in KERNELS {
        let defines = plain(base).defines;
        for m in attnproof_catalog::all() {
            let Runner::KernelText { kernel, mode } = m.runner else { continue };
            if kernel != base.name {
                continue;
            }
            let defines: Vec<String> = defines.iter().cloned().chain(mode.map(str::to_owned)).collect();
            if let Err(e) = compile_for_arch(patched(base, m), "sm_90a", &defines) {
                broken.push(format!("{}: {e}", m.name));
            }
        }
    }
    assert!(broken.is_empty(), "mutants that do not compile:\n{}", broken.join("\n\n"));
}

/// The catalog and this test agree: every kernel-text mutant of the catalog patches a kernel that has killing cases
/// here (else it would never run), applies exactly once to the text the crate embeds (the catalog's own test reads
/// the file; this reads what the crate compiles), and every kernel with cases has mutants.
#[test]
fn every_catalog_kernel_text_mutant_has_cases_and_applies() {
    let names: Vec<&str> = KERNELS.iter().map(|k| k.name).collect();
    for m in attnproof_catalog::all() {
        if let Runner::KernelText { kernel, .. } = m.runner {
            let base = KERNELS.iter().find(|k| k.name == kernel).unwrap_or_else(|| {
                panic!(
                    "catalog mutant `{}` patches kernel `{kernel}`, which has no killing cases here ({names:?})",
                    m.name
                )
            });
            // The shared header is part of every attention kernel's text.
            assert!(
                m.file.ends_with(&format!("{kernel}.cu")) || m.file == attnproof_catalog::COMMON_HEADER,
                "mutant `{}`: file {} is not {kernel}.cu or the shared header",
                m.name,
                m.file
            );
            assert!(m.apply(base.source).is_ok(), "mutant `{}` does not apply to the embedded {kernel}", m.name);
        }
    }
    for base in KERNELS {
        let has_mutants = attnproof_catalog::all()
            .any(|m| matches!(m.runner, Runner::KernelText { kernel, .. } if kernel == base.name));
        assert!(has_mutants, "kernel {} has killing cases but no catalog mutants", base.name);
    }
}
