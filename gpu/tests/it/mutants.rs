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
//! means the patch, not the case, broke the result. Each mutant is judged in a process of its own (this binary run
//! again on the one test, see `judge_isolated`): a mutant that faults leaves its CUDA context unusable, and in a shared
//! process every later launch would fail with it. Each patch must match its anchor exactly once, so a refactor of
//! a kernel that moves an anchor fails this test instead of silently dropping the mutant. Without a device the tests
//! print `skipped: no CUDA device` and pass.

use std::sync::Arc;

use crate::block_selection;
use crate::block_sparse;
use crate::block_sparse_backward;
use crate::common::*;
use crate::dsa_index;
use crate::dsa_loss;
use crate::dsa_sparse;
use crate::dsa_sparse_backward;
use crate::hils;
use crate::nsa_compress;
use crate::nsa_gates;
use crate::nsa_select;
use crate::nsa_selected;
use crate::nsa_selected_backward;
use crate::pisa_covariance;
use crate::pisa_tail;
use crate::pisa_tail_backward;
use crate::property::{PropertySuite, check, run_suite, suite};
use crate::pyramid_diagnostics;
use crate::pyramid_selection;
use attnproof_catalog::{Mutant, Runner};
use attnproof_gpu::backward::{Q_TILE, is_wgmma_backward};
use attnproof_gpu::block_sparse::BlockLists;
use attnproof_gpu::block_sparse::select::BSA_SELECT;
use attnproof_gpu::compile::{FLASH_BWD, FLASH_BWD_SM90, FLASH_FWD, FLASH_FWD_SM90, KernelSource, compile_for_arch};
use attnproof_gpu::dsa::index::DSA_INDEX;
use attnproof_gpu::dsa::loss::DSA_LOSS;
use attnproof_gpu::dsa::sparse::DSA_SPARSE;
use attnproof_gpu::dsa::sparse_backward::DSA_SPARSE_BWD;
use attnproof_gpu::flash::ForwardTiling;
use attnproof_gpu::hils::HILS;
use attnproof_gpu::nsa::compress::NSA_COMPRESS;
use attnproof_gpu::nsa::gates::NSA_GATES;
use attnproof_gpu::nsa::select::NSA_SELECT;
use attnproof_gpu::nsa::selected::NSA_SELECTED;
use attnproof_gpu::nsa::selected_backward::NSA_SELECTED_BWD;
use attnproof_gpu::pisa::covariance::PISA_COVARIANCE;
use attnproof_gpu::pisa::diagnostics::{MassConfig, PISA_MASS};
use attnproof_gpu::pisa::select::{PISA_SELECT, PyramidSelectConfig};
use attnproof_gpu::pisa::tail::PISA_TAIL;
use attnproof_gpu::pisa::tail_backward::PISA_TAIL_BWD;
use attnproof_gpu::{
    BackwardTiling, GpuBackwardStrategy, module_variants, nvrtc_or_skip, skip_unless_gpu, skip_unless_hopper,
};
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
use rayon::prelude::*;

/// The kernels whose catalog mutants ([`Runner::KernelText`]) this test launches. Each has its killing cases below,
/// and every mutant of a kernel is tried against every case of that kernel until one kills it.
const KERNELS: [KernelSource; 20] = [
    FLASH_FWD,
    FLASH_BWD,
    BSA_SELECT,
    PISA_SELECT,
    PISA_TAIL,
    PISA_TAIL_BWD,
    PISA_COVARIANCE,
    PISA_MASS,
    HILS,
    NSA_COMPRESS,
    NSA_GATES,
    NSA_SELECT,
    NSA_SELECTED,
    NSA_SELECTED_BWD,
    FLASH_FWD_SM90,
    FLASH_BWD_SM90,
    DSA_INDEX,
    DSA_SPARSE,
    DSA_SPARSE_BWD,
    DSA_LOSS,
];

/// The define of `flash_fwd`'s block-sparse mode, whose mutants the block-sparse cases hunt.
const BLOCK_SPARSE: &str = "BLOCK_SPARSE";

/// A general suite's configuration for a hunt: its fixed seed and case count, no shrinking (a hunt wants the first
/// failure of each mutant, not the smallest).
fn no_shrink(name: &str, cases: u32, seed: u64) -> Config {
    Config { max_shrink_iters: 0, ..crate::property::default_run_config(name, cases, seed) }
}

/// The catalog's kernel-text mutants of `kernel`'s plain mode, in catalog order.
fn catalog_mutants(kernel: KernelSource) -> Vec<&'static Mutant> {
    attnproof_catalog::kernel_text_mutants(kernel.name, None).collect()
}

/// The catalog's mutants of `flash_fwd`'s block-sparse mode.
fn block_sparse_mutants() -> Vec<&'static Mutant> {
    attnproof_catalog::kernel_text_mutants(FLASH_FWD.name, Some(BLOCK_SPARSE)).collect()
}

/// The backward's killing cases: Lq ≠ Lk both ways with tails, GQA, a window, causal, a logit scale of 4, and NSA's
/// strided causal mask (the paper's windows over a GQA group, and short overlapping ones).
fn backward_cases(stream: &Arc<CudaStream>) -> Vec<(&'static str, Problem<bf16>)> {
    let d64 = |b, hq, hkv, lq, lk, mask: Mask| AttentionSpec::dense(b, hq, hkv, lq, lk, 64, 64).with_mask(mask);
    vec![
        ("causal_lq_gt_lk_gqa", problem(stream, &d64(1, 4, 2, 150, 100, Mask::Causal), gaussian(1.0), 13)),
        ("none_lq_lt_lk_tail", problem(stream, &d64(1, 2, 1, 70, 140, Mask::None), gaussian(1.0), 14)),
        ("window_7_3", problem(stream, &d64(1, 2, 2, 130, 130, Mask::Window { left: 7, right: 3 }), gaussian(1.0), 15)),
        ("logit_scale_4", problem(stream, &d64(1, 1, 1, 65, 129, Mask::None), gaussian(4.0), 16)),
        ("nsa_strided_32_16_gqa", problem(stream, &d64(1, 4, 2, 150, 8, paper_windows()), gaussian(1.0), 17)),
        (
            "strided_5_3",
            problem(stream, &d64(1, 2, 1, 100, 32, Mask::StridedCausal { len: 5, stride: 3 }), gaussian(1.0), 18),
        ),
    ]
}

/// NSA's compressed-branch mask with the paper's windows (`l = 32`, `s = 16`).
fn paper_windows() -> Mask {
    Mask::StridedCausal { len: 32, stride: 16 }
}

/// The killing cases: one head dim (one module per mutant), masks, Lq ≠ Lk both ways, tails, GQA, a window, a row
/// max in the last tile at logit scale 100, and NSA's strided causal mask (keys are the windows complete in Lq).
fn forward_cases() -> Vec<(&'static str, Case<bf16>)> {
    let dense = |b, hq, hkv, lq, lk, mask: Mask| AttentionSpec::dense(b, hq, hkv, lq, lk, 64, 64).with_mask(mask);
    vec![
        ("causal_lq_gt_lk_gqa", make_case(&dense(1, 4, 2, 200, 130, Mask::Causal), gaussian(1.0), 3)),
        ("none_lq_lt_lk_tail", make_case(&dense(1, 2, 1, 130, 200, Mask::None), gaussian(1.0), 4)),
        ("window_7_3", make_case(&dense(1, 2, 2, 190, 190, Mask::Window { left: 7, right: 3 }), gaussian(1.0), 5)),
        ("nsa_strided_32_16_gqa", make_case(&dense(1, 4, 2, 200, 11, paper_windows()), gaussian(1.0), 7)),
        (
            "strided_5_3",
            make_case(&dense(1, 2, 1, 130, 42, Mask::StridedCausal { len: 5, stride: 3 }), gaussian(1.0), 8),
        ),
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

/// The environment variable that makes a process of this test binary a hunt's child: it names the one mutant the
/// child judges (see [`judge_isolated`]).
const CHILD_MUTANT: &str = "ATTNPROOF_GPU_MUTANT";

/// The mark of the stdout line on which a child reports its verdict to the hunt that started it.
const VERDICT_LINE: &str = "attnproof-mutant-verdict:";

/// Children of one hunt that run at once: each holds a CUDA context and runs the f64 oracle on the CPU.
const CHILDREN_AT_ONCE: usize = 4;

/// How a mutant was killed: the case (or suite, or draw count) and the first line of why.
#[derive(Debug, Clone, PartialEq)]
struct Kill {
    by: String,
    why: String,
}

impl Kill {
    fn new(by: &str, why: &str) -> Self {
        // One line, without the tabs that separate the fields of the verdict line.
        let first_line = why.lines().next().unwrap_or("").replace('\t', " ");
        Kill { by: by.replace('\t', " "), why: first_line }
    }
}

/// The mutant this process judges alone, when it is a hunt's child.
fn child_mutant() -> Option<String> {
    std::env::var(CHILD_MUTANT).ok()
}

/// A child's verdict as one stdout line, and back.
fn verdict_line(verdict: &Option<Kill>) -> String {
    match verdict {
        Some(kill) => format!("{VERDICT_LINE} killed\t{}\t{}", kill.by, kill.why),
        None => format!("{VERDICT_LINE} survived"),
    }
}

fn parse_verdict(stdout: &str) -> Option<Option<Kill>> {
    // libtest may have written `test NAME ... ` on the same line before the test printed anything.
    let line = stdout.lines().find_map(|line| line.split_once(VERDICT_LINE))?.1.trim_start();
    if line == "survived" {
        return Some(None);
    }
    let mut fields = line.strip_prefix("killed\t")?.splitn(2, '\t');
    Some(Some(Kill { by: fields.next()?.to_owned(), why: fields.next().unwrap_or("").to_owned() }))
}

/// The last `n` lines of a child's output, for a failure message.
fn tail(bytes: &[u8], n: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Judges every mutant of `mutants` by `judge` (`None`: it survived), each in a process of its own: this test binary
/// run again on the test `test` of this module alone, with [`CHILD_MUTANT`] naming the mutant. A mutant that faults
/// (an illegal address, say) leaves its CUDA context unusable for every later launch of the process, so judged in one
/// process it would count every later mutant killed whatever that mutant does and fail the baselines of the tests
/// running beside it; in a child, its fault is its own kill and nothing else's. Returns the verdicts in the order of
/// `mutants`, or `None` in a child, which has printed its one verdict. Panics when a child ends without a verdict.
fn judge_isolated(
    test: &str,
    mutants: &[&Mutant],
    judge: impl Fn(&Mutant) -> Option<Kill>,
) -> Option<Vec<Option<Kill>>> {
    if let Some(name) = child_mutant() {
        let m = mutants.iter().find(|m| m.name == name).unwrap_or_else(|| panic!("`{name}` is not a mutant of {test}"));
        println!("{}", verdict_line(&judge(m)));
        return None;
    }
    let exe = std::env::current_exe().expect("the path of this test binary");
    // libtest names a test by its module path without the crate: `mutants::all_forward_mutants_are_killed`.
    let module = module_path!().split_once("::").map_or(module_path!(), |(_, module)| module);
    let filter = format!("{module}::{test}");
    let mut verdicts = Vec::with_capacity(mutants.len());
    for chunk in mutants.chunks(CHILDREN_AT_ONCE) {
        let children: Vec<_> = chunk
            .iter()
            .map(|m| {
                std::process::Command::new(&exe)
                    .args([filter.as_str(), "--exact", "--nocapture", "--test-threads=1"])
                    .env(CHILD_MUTANT, m.name)
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap_or_else(|e| panic!("mutant `{}`: start {}: {e}", m.name, exe.display()))
            })
            .collect();
        for (m, child) in chunk.iter().zip(children) {
            let out =
                child.wait_with_output().unwrap_or_else(|e| panic!("mutant `{}`: wait for its process: {e}", m.name));
            match parse_verdict(&String::from_utf8_lossy(&out.stdout)) {
                Some(verdict) if out.status.success() => verdicts.push(verdict),
                _ => panic!(
                    "mutant `{}`: its process (`{filter}`) ended without a verdict ({}); last lines:\n{}\n{}",
                    m.name,
                    out.status,
                    tail(&out.stdout, 10),
                    tail(&out.stderr, 20)
                ),
            }
        }
    }
    Some(verdicts)
}

/// The isolation itself, without a device: each mutant is judged in a child process of its own (its process id differs
/// from this process's and from every other child's), and each child's verdict comes back to the right mutant, killed
/// or not, with its case and reason intact.
#[test]
fn a_hunt_judges_each_mutant_in_a_process_of_its_own() {
    let mutants: Vec<&Mutant> = catalog_mutants(FLASH_FWD).into_iter().take(CHILDREN_AT_ONCE + 2).collect();
    assert!(mutants.len() > CHILDREN_AT_ONCE, "more mutants than one batch of children");
    // Mutants at even catalog positions are killed, by a case naming the child's process.
    let position = |m: &Mutant| mutants.iter().position(|n| n.name == m.name).expect("a listed mutant");
    let judged = judge_isolated("a_hunt_judges_each_mutant_in_a_process_of_its_own", &mutants, |m| {
        (position(m) % 2 == 0)
            .then(|| Kill::new(&std::process::id().to_string(), &format!("{}\twith a tab\nand more", m.name)))
    });
    let Some(verdicts) = judged else { return };
    let mut processes = vec![std::process::id().to_string()];
    for (i, (m, verdict)) in mutants.iter().zip(&verdicts).enumerate() {
        match verdict {
            Some(kill) => {
                assert_eq!(i % 2, 0, "mutant `{}` at {i} was not to be killed", m.name);
                assert_eq!(kill.why, format!("{} with a tab", m.name), "the first line of why, tabs replaced");
                assert!(
                    !processes.contains(&kill.by),
                    "mutant `{}` was judged in process {}, not its own",
                    m.name,
                    kill.by
                );
                processes.push(kill.by.clone());
            }
            None => assert_eq!(i % 2, 1, "mutant `{}` at {i} was to be killed", m.name),
        }
    }
    assert_eq!(verdicts.len(), mutants.len());
}

/// Requires the unpatched `base` to pass every case, then every mutant of `catalog` to fail one, each judged in a
/// process of its own ([`judge_isolated`]); prints the table. `test` is the calling test's name in this module.
fn hunt<C>(
    test: &str,
    base: KernelSource,
    catalog: &[&Mutant],
    cases: &[(&str, C)],
    check: impl Fn(KernelSource, &C) -> Result<(), String>,
) {
    if child_mutant().is_none() {
        for (name, case) in cases {
            if let Err(why) = check(base, case) {
                panic!("the unpatched {} fails case `{name}`: {why}", base.name);
            }
        }
    }
    assert!(!catalog.is_empty(), "the catalog holds no kernel-text mutant of {}", base.name);
    let judged = judge_isolated(test, catalog, |m| {
        let kernel = patched(base, m);
        cases.iter().find_map(|(name, case)| check(kernel, case).err().map(|why| Kill::new(name, &why)))
    });
    let Some(verdicts) = judged else { return };
    let mut survivors = vec![];
    println!("{:<40} {:<24} detail", "mutant", "killed by");
    for (m, verdict) in catalog.iter().zip(verdicts) {
        match verdict {
            Some(kill) => println!("{:<40} {:<24} {}", m.name, kill.by, kill.why.chars().take(70).collect::<String>()),
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
    const TEST: &str = "all_forward_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    hunt(TEST, FLASH_FWD, &catalog_mutants(FLASH_FWD), &forward_cases(), |kernel, case| {
        check_forward(&stream, kernel, case)
    });
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
    const TEST: &str = "all_block_sparse_forward_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases: Vec<(&str, (Case<bf16>, BlockLists))> =
        block_sparse::killing_cases().into_iter().map(|(name, case, lists)| (name, (case, lists))).collect();
    hunt(TEST, FLASH_FWD, &block_sparse_mutants(), &cases, |kernel, c| check_block_sparse(&stream, kernel, c));
}

/// Runs each of `mutants` (patches of `base`) through `run_suite`, which runs a general property suite on the patched
/// kernel and returns its result, each in a process of its own ([`judge_isolated`]); every mutant must make the suite
/// fail. Prints mutant and first line of why. `test` is the calling test's name in this module.
fn hunt_in_suite<D: std::fmt::Debug>(
    test: &str,
    base: KernelSource,
    mutants: &[&Mutant],
    suite_name: &str,
    run_suite: impl Fn(KernelSource) -> Result<(), Box<TestError<D>>>,
) {
    assert!(!mutants.is_empty(), "no mutants of {} to hunt", base.name);
    let judged = judge_isolated(test, mutants, |m| match run_suite(patched(base, m)).map_err(|e| *e) {
        Err(TestError::Fail(why, _)) => Some(Kill::new(suite_name, why.message())),
        Err(TestError::Abort(why)) => panic!("{suite_name}: the suite gave up on mutant `{}`: {why}", m.name),
        Ok(()) => None,
    });
    let Some(verdicts) = judged else { return };
    let mut survivors = vec![];
    for (m, verdict) in mutants.iter().zip(verdicts) {
        match verdict {
            Some(kill) => println!("{:<40} {}", m.name, kill.why),
            None => {
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
    const TEST: &str = "all_block_sparse_forward_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &block_sparse::BLOCK_SUITES[0];
    hunt_in_suite(TEST, FLASH_FWD, &block_sparse_mutants(), suite.name, |kernel| {
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
    let Some(ctx) = skip_unless_hopper("all_wgmma_forward_mutants_are_killed") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let cases: Vec<(&str, (Case<bf16>, BlockLists))> =
        block_sparse::wgmma_killing_cases().into_iter().map(|(name, case, lists)| (name, (case, lists))).collect();
    hunt("all_wgmma_forward_mutants_are_killed", FLASH_FWD_SM90, &wgmma_mutants(), &cases, |kernel, c| {
        check_block_sparse(&stream, kernel, c)
    });
}

/// Every sm_90a forward mutant also fails that kernel's general block-sparse suite (bf16, its default draws).
#[test]
fn all_wgmma_forward_mutants_are_killed_by_the_general_suite() {
    let Some(ctx) = skip_unless_hopper("all_wgmma_forward_mutants_are_killed_by_the_general_suite") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let suite = &block_sparse::WGMMA_SUITES[0];
    hunt_in_suite(
        "all_wgmma_forward_mutants_are_killed_by_the_general_suite",
        FLASH_FWD_SM90,
        &wgmma_mutants(),
        suite.name,
        |kernel| {
            let worst = std::cell::RefCell::new(Worst::default());
            suite.run(suite.default_config(), |draw| suite.check(&stream, kernel, &worst, draw)).1.map_err(Box::new)
        },
    );
}

/// Every sm_90a forward mutant also fails the kernel's dense property suite (bf16, its default draws), the suite the
/// dense wrapper's choice of the kernel on Hopper rests on: each mutant's text lies outside the block-sparse mode's
/// own code, so the dense mode runs it too.
#[test]
fn all_wgmma_forward_mutants_are_killed_by_the_dense_suite() {
    const TEST: &str = "all_wgmma_forward_mutants_are_killed_by_the_dense_suite";
    let suite = suite("gpu_flash_wgmma_forward_bf16");
    let Some(candidate) = crate::property::suite_candidate(suite) else { return };
    hunt_in_suite(TEST, FLASH_FWD_SM90, &wgmma_mutants(), suite.name, |kernel| {
        let mutant = GpuCandidate { forward_kernel: kernel, ..candidate.clone() };
        let worst = std::cell::RefCell::new(Worst::default());
        let config = Config { max_shrink_iters: 0, ..suite.default_config() };
        run_suite(suite, config, |draw| check(suite, &mutant, &worst, draw)).1.map_err(Box::new)
    });
}

/// The catalog's mutants of `flash_bwd`'s block-sparse mode.
fn block_sparse_backward_mutants() -> Vec<&'static Mutant> {
    attnproof_catalog::kernel_text_mutants(FLASH_BWD.name, Some(BLOCK_SPARSE)).collect()
}

/// Hunts `mutants` of the block-sparse backward `base` with the killing `cases`, each judged by the checks of
/// `suite`'s dtype.
fn hunt_block_sparse_backward(
    test: &str,
    base: KernelSource,
    mutants: &[&Mutant],
    suite: &block_sparse::BlockSuite,
    cases: &[(&str, block_sparse::BlockDraw)],
) {
    let Some(ctx) = (if is_wgmma_backward(base) { skip_unless_hopper(test) } else { skip_unless_gpu(test) }) else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    hunt(test, base, mutants, cases, |kernel, draw| {
        let worst = std::cell::RefCell::new(Worst::default());
        block_sparse_backward::check_draw(suite, &stream, kernel, &worst, draw).map_err(|e| e.to_string())
    });
}

/// Hunts `mutants` of the block-sparse backward `base` with the general `suite` (its default draws).
fn hunt_block_sparse_backward_in_suite(
    test: &str,
    base: KernelSource,
    mutants: &[&Mutant],
    suite: &block_sparse::BlockSuite,
) {
    let Some(ctx) = (if is_wgmma_backward(base) { skip_unless_hopper(test) } else { skip_unless_gpu(test) }) else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    hunt_in_suite(test, base, mutants, suite.name, |kernel| {
        let worst = std::cell::RefCell::new(Worst::default());
        suite
            .run(suite.default_config(), |draw| block_sparse_backward::check_draw(suite, &stream, kernel, &worst, draw))
            .1
            .map_err(Box::new)
    });
}

#[test]
fn all_block_sparse_backward_mutants_are_killed() {
    hunt_block_sparse_backward(
        "all_block_sparse_backward_mutants_are_killed",
        FLASH_BWD,
        &block_sparse_backward_mutants(),
        &block_sparse_backward::BACKWARD_SUITES[0],
        &block_sparse_backward::killing_cases(),
    );
}

/// Every block-sparse backward mutant also fails the general block-sparse backward suite (bf16, its default draws).
#[test]
fn all_block_sparse_backward_mutants_are_killed_by_the_general_suite() {
    hunt_block_sparse_backward_in_suite(
        "all_block_sparse_backward_mutants_are_killed_by_the_general_suite",
        FLASH_BWD,
        &block_sparse_backward_mutants(),
        &block_sparse_backward::BACKWARD_SUITES[0],
    );
}

/// The catalog's mutants of the `wgmma` backward (its block-sparse mode, the one the wrappers launch).
fn wgmma_backward_mutants() -> Vec<&'static Mutant> {
    attnproof_catalog::kernel_text_mutants(FLASH_BWD_SM90.name, Some(BLOCK_SPARSE)).collect()
}

#[test]
fn all_wgmma_backward_mutants_are_killed() {
    hunt_block_sparse_backward(
        "all_wgmma_backward_mutants_are_killed",
        FLASH_BWD_SM90,
        &wgmma_backward_mutants(),
        &block_sparse_backward::WGMMA_BACKWARD_SUITES[0],
        &block_sparse_backward::wgmma_killing_cases(),
    );
}

/// Every `wgmma` backward mutant also fails that kernel's general block-sparse backward suite (bf16, its default
/// draws).
#[test]
fn all_wgmma_backward_mutants_are_killed_by_the_general_suite() {
    hunt_block_sparse_backward_in_suite(
        "all_wgmma_backward_mutants_are_killed_by_the_general_suite",
        FLASH_BWD_SM90,
        &wgmma_backward_mutants(),
        &block_sparse_backward::WGMMA_BACKWARD_SUITES[0],
    );
}

#[test]
fn all_block_selection_mutants_are_killed() {
    const TEST: &str = "all_block_selection_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases: Vec<(&str, (Case<bf16>, BsaConfig))> =
        block_selection::killing_cases().into_iter().map(|(name, case, config)| (name, (case, config))).collect();
    hunt(TEST, BSA_SELECT, &catalog_mutants(BSA_SELECT), &cases, |kernel, c| {
        block_selection::check_selection(&stream, kernel, c)
    });
}

/// Every selector mutant also fails the general selection suite (bf16, its default draws).
#[test]
fn all_block_selection_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_block_selection_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &block_selection::SELECTION_SUITES[0];
    hunt_in_suite(TEST, BSA_SELECT, &catalog_mutants(BSA_SELECT), suite.name, |kernel| {
        let tally = std::cell::RefCell::new(block_selection::SelectionTally::default());
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        suite.run(config, |draw| suite.check(&stream, kernel, &tally, draw)).1.map_err(Box::new)
    });
}

#[test]
fn all_pyramid_selection_mutants_are_killed() {
    const TEST: &str = "all_pyramid_selection_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases: Vec<(&str, (Case<bf16>, PyramidSelectConfig))> =
        pyramid_selection::killing_cases().into_iter().map(|(name, case, config)| (name, (case, config))).collect();
    hunt(TEST, PISA_SELECT, &catalog_mutants(PISA_SELECT), &cases, |kernel, c| {
        pyramid_selection::check_selection(&stream, kernel, c)
    });
}

/// Every pyramid selector mutant also fails the general pyramid suite (bf16, its default draws).
#[test]
fn all_pyramid_selection_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_pyramid_selection_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &pyramid_selection::PYRAMID_SUITES[0];
    hunt_in_suite(TEST, PISA_SELECT, &catalog_mutants(PISA_SELECT), suite.name, |kernel| {
        let tally = std::cell::RefCell::new(pyramid_selection::PyramidTally::default());
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        suite.run(config, |draw| suite.check(&stream, kernel, &tally, draw))
    });
}

#[test]
fn all_pisa_tail_mutants_are_killed() {
    const TEST: &str = "all_pisa_tail_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases: Vec<(&str, (Case<bf16>, BlockLists))> =
        pisa_tail::killing_cases().into_iter().map(|(name, case, lists)| (name, (case, lists))).collect();
    hunt(TEST, PISA_TAIL, &catalog_mutants(PISA_TAIL), &cases, |kernel, c| {
        pisa_tail::check_killing_case(&stream, kernel, c)
    });
}

/// Every tail mutant also fails the general tail suite (bf16, its default draws).
#[test]
fn all_pisa_tail_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_pisa_tail_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &pisa_tail::TAIL_SUITES[0];
    hunt_in_suite(TEST, PISA_TAIL, &catalog_mutants(PISA_TAIL), suite.name, |kernel| {
        let tally = std::cell::RefCell::new((0usize, 0usize));
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        suite.run(config, |draw| suite.check(&stream, kernel, &tally, draw))
    });
}

#[test]
fn all_pisa_tail_backward_mutants_are_killed() {
    const TEST: &str = "all_pisa_tail_backward_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases = pisa_tail_backward::killing_cases();
    let mutants = catalog_mutants(PISA_TAIL_BWD);
    hunt(TEST, PISA_TAIL_BWD, &mutants, &cases, |kernel, c| pisa_tail_backward::check_killing_case(&stream, kernel, c));
}

/// Every tail backward mutant also fails the general tail backward suite (bf16, its default draws).
#[test]
fn all_pisa_tail_backward_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_pisa_tail_backward_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &pisa_tail_backward::TAIL_BACKWARD_SUITES[0];
    hunt_in_suite(TEST, PISA_TAIL_BWD, &catalog_mutants(PISA_TAIL_BWD), suite.name, |kernel| {
        let tally = std::cell::RefCell::new(0usize);
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        suite.run(config, |draw| pisa_tail_backward::check_backward(suite, &stream, kernel, &tally, draw))
    });
}

#[test]
fn all_pisa_covariance_mutants_are_killed() {
    const TEST: &str = "all_pisa_covariance_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases = pisa_covariance::killing_cases();
    let mutants = catalog_mutants(PISA_COVARIANCE);
    hunt(TEST, PISA_COVARIANCE, &mutants, &cases, |kernel, c| pisa_covariance::check_killing_case(&stream, kernel, c));
}

/// Every covariance-aware selection mutant also fails the general suite (bf16, its default draws).
#[test]
fn all_pisa_covariance_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_pisa_covariance_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &pisa_covariance::COVARIANCE_SUITES[0];
    hunt_in_suite(TEST, PISA_COVARIANCE, &catalog_mutants(PISA_COVARIANCE), suite.name, |kernel| {
        let decided = std::cell::RefCell::new(0usize);
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        pisa_covariance::run_suite_with(config, |draw| {
            pisa_covariance::check_draw(suite, &stream, kernel, &decided, draw)
        })
    });
}

#[test]
fn all_block_mass_mutants_are_killed() {
    const TEST: &str = "all_block_mass_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases: Vec<(&str, (Case<bf16>, MassConfig))> =
        pyramid_diagnostics::killing_cases().into_iter().map(|(name, case, config)| (name, (case, config))).collect();
    hunt(TEST, PISA_MASS, &catalog_mutants(PISA_MASS), &cases, |kernel, c| {
        pyramid_diagnostics::check_masses(&stream, kernel, c)
    });
}

/// Every HiLS mutant fails one of `hils::killing_cases`.
#[test]
fn all_hils_mutants_are_killed() {
    const TEST: &str = "all_hils_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases: Vec<(&str, hils::KillingCase)> = hils::killing_cases();
    hunt(TEST, HILS, &catalog_mutants(HILS), &cases, |kernel, c| hils::check_killing_case(&stream, kernel, c));
}

/// Every HiLS mutant also fails the general HiLS suite (bf16, its default draws).
#[test]
fn all_hils_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_hils_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &hils::HILS_SUITES[0];
    hunt_in_suite(TEST, HILS, &catalog_mutants(HILS), suite.name, |kernel| {
        let tally = std::cell::RefCell::new((0usize, 0usize));
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        suite.run(config, |draw| suite.check(&stream, kernel, &tally, draw))
    });
}

/// Every block-mass mutant also fails the general mass suite (bf16, its default draws).
#[test]
fn all_block_mass_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_block_mass_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &pyramid_diagnostics::MASS_SUITES[0];
    hunt_in_suite(TEST, PISA_MASS, &catalog_mutants(PISA_MASS), suite.name, |kernel| {
        let tally = std::cell::RefCell::new(pyramid_diagnostics::MassTally::default());
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        suite.run(config, |draw| suite.check(&stream, kernel, &tally, draw))
    });
}

#[test]
fn all_dsa_index_mutants_are_killed() {
    const TEST: &str = "all_dsa_index_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases = dsa_index::killing_cases();
    hunt(TEST, DSA_INDEX, &catalog_mutants(DSA_INDEX), &cases, |kernel, draw| {
        dsa_index::check_draw::<bf16>(&stream, kernel, draw).map(|_| ())
    });
}

/// Every indexer mutant also fails the general indexer suite (its default draws, no shrinking).
#[test]
fn all_dsa_index_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_dsa_index_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let (name, cases, seed) = dsa_index::SUITE;
    hunt_in_suite(TEST, DSA_INDEX, &catalog_mutants(DSA_INDEX), name, |kernel| {
        let config = no_shrink(name, cases, seed);
        dsa_index::run_suite(&stream, kernel, config).map(|_| ()).map_err(Box::new)
    });
}

#[test]
fn all_dsa_sparse_mutants_are_killed() {
    const TEST: &str = "all_dsa_sparse_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases = dsa_sparse::killing_cases();
    hunt(TEST, DSA_SPARSE, &catalog_mutants(DSA_SPARSE), &cases, |kernel, c| {
        dsa_sparse::check_token_sparse_case(&stream, kernel, c)
    });
}

/// Every token-sparse attention mutant also fails the general suite (bf16, its default draws, no shrinking).
#[test]
fn all_dsa_sparse_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_dsa_sparse_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &dsa_sparse::TOKEN_SPARSE_SUITES[0];
    hunt_in_suite(TEST, DSA_SPARSE, &catalog_mutants(DSA_SPARSE), suite.name, |kernel| {
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        dsa_sparse::run_token_sparse_suite(suite, config, &stream, kernel)
    });
}

#[test]
fn all_dsa_sparse_backward_mutants_are_killed() {
    const TEST: &str = "all_dsa_sparse_backward_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases = dsa_sparse_backward::backward_killing_cases();
    hunt(TEST, DSA_SPARSE_BWD, &catalog_mutants(DSA_SPARSE_BWD), &cases, |kernel, c| {
        dsa_sparse_backward::check_backward_case(&stream, kernel, c)
    });
}

/// Every token-sparse backward mutant also fails the general suite (bf16, its default draws, no shrinking).
#[test]
fn all_dsa_sparse_backward_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_dsa_sparse_backward_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &dsa_sparse_backward::BACKWARD_SUITES[0];
    hunt_in_suite(TEST, DSA_SPARSE_BWD, &catalog_mutants(DSA_SPARSE_BWD), suite.name, |kernel| {
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        dsa_sparse_backward::run_backward_suite(suite, config, &stream, kernel)
    });
}

#[test]
fn all_dsa_loss_mutants_are_killed() {
    const TEST: &str = "all_dsa_loss_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases = dsa_loss::killing_cases();
    hunt(TEST, DSA_LOSS, &catalog_mutants(DSA_LOSS), &cases, |kernel, draw| {
        dsa_loss::check_any(&stream, kernel, draw).map(|_| ())
    });
}

/// Every indexer-loss mutant also fails the general suite (its default draws, no shrinking).
#[test]
fn all_dsa_loss_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_dsa_loss_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let (name, cases, seed) = dsa_loss::SUITE;
    hunt_in_suite(TEST, DSA_LOSS, &catalog_mutants(DSA_LOSS), name, |kernel| {
        let config = no_shrink(name, cases, seed);
        dsa_loss::run_suite(&stream, kernel, config).map(|_| ()).map_err(Box::new)
    });
}

#[test]
fn all_nsa_compression_mutants_are_killed() {
    const TEST: &str = "all_nsa_compression_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases = nsa_compress::killing_cases();
    hunt(TEST, NSA_COMPRESS, &catalog_mutants(NSA_COMPRESS), &cases, |kernel, c| {
        nsa_compress::check_compression(&stream, kernel, c)
    });
}

/// Every compression mutant also fails the general compression suite (bf16, its default draws).
#[test]
fn all_nsa_compression_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_nsa_compression_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &nsa_compress::COMPRESSION_SUITES[0];
    hunt_in_suite(TEST, NSA_COMPRESS, &catalog_mutants(NSA_COMPRESS), suite.name, |kernel| {
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        nsa_compress::run_compression_suite(suite, config, &stream, kernel)
    });
}

#[test]
fn all_nsa_gate_mutants_are_killed() {
    const TEST: &str = "all_nsa_gate_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases = nsa_gates::killing_cases();
    hunt(TEST, NSA_GATES, &catalog_mutants(NSA_GATES), &cases, |kernel, c| {
        nsa_gates::check_gate_case(&stream, kernel, c)
    });
}

/// Every gate mutant also fails the general gates suite (bf16, its default draws).
#[test]
fn all_nsa_gate_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_nsa_gate_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &nsa_gates::GATE_SUITES[0];
    hunt_in_suite(TEST, NSA_GATES, &catalog_mutants(NSA_GATES), suite.name, |kernel| {
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        nsa_gates::run_gate_suite(suite, config, &stream, kernel)
    });
}

#[test]
fn all_nsa_selection_mutants_are_killed() {
    const TEST: &str = "all_nsa_selection_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases = nsa_select::killing_cases();
    hunt(TEST, NSA_SELECT, &catalog_mutants(NSA_SELECT), &cases, |kernel, c| {
        nsa_select::check_select_case(&stream, kernel, c)
    });
}

/// Every selection mutant also fails the general selection suite (bf16, its default draws).
#[test]
fn all_nsa_selection_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_nsa_selection_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &nsa_select::SELECT_SUITES[0];
    hunt_in_suite(TEST, NSA_SELECT, &catalog_mutants(NSA_SELECT), suite.name, |kernel| {
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        nsa_select::run_select_suite(suite, config, &stream, kernel)
    });
}

#[test]
fn all_nsa_selected_mutants_are_killed() {
    const TEST: &str = "all_nsa_selected_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases = nsa_selected::killing_cases();
    hunt(TEST, NSA_SELECTED, &catalog_mutants(NSA_SELECTED), &cases, |kernel, c| {
        nsa_selected::check_selected_case(&stream, kernel, c)
    });
}

/// Every selected-attention mutant also fails the general suite (bf16, its default draws).
#[test]
fn all_nsa_selected_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_nsa_selected_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &nsa_selected::SELECTED_SUITES[0];
    hunt_in_suite(TEST, NSA_SELECTED, &catalog_mutants(NSA_SELECTED), suite.name, |kernel| {
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        nsa_selected::run_selected_suite(suite, config, &stream, kernel)
    });
}

#[test]
fn all_nsa_selected_backward_mutants_are_killed() {
    const TEST: &str = "all_nsa_selected_backward_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases = nsa_selected_backward::backward_killing_cases();
    hunt(TEST, NSA_SELECTED_BWD, &catalog_mutants(NSA_SELECTED_BWD), &cases, |kernel, c| {
        nsa_selected_backward::check_backward_case(&stream, kernel, c)
    });
}

/// Every selected-backward mutant also fails the general suite (bf16, its default draws).
#[test]
fn all_nsa_selected_backward_mutants_are_killed_by_the_general_suite() {
    const TEST: &str = "all_nsa_selected_backward_mutants_are_killed_by_the_general_suite";
    let Some(stream) = device_stream(TEST) else { return };
    let suite = &nsa_selected_backward::BACKWARD_SUITES[0];
    hunt_in_suite(TEST, NSA_SELECTED_BWD, &catalog_mutants(NSA_SELECTED_BWD), suite.name, |kernel| {
        let config = no_shrink(suite.name, suite.cases, suite.seed);
        nsa_selected_backward::run_backward_suite(suite, config, &stream, kernel)
    });
}

#[test]
fn all_backward_mutants_are_killed() {
    const TEST: &str = "all_backward_mutants_are_killed";
    let Some(stream) = device_stream(TEST) else { return };
    let cases: Vec<(&str, BackwardCase)> = backward_cases(&stream)
        .into_iter()
        .map(|(name, problem)| {
            let expect = BackwardExpectation::new(&problem.case, &problem.d_out, Q_TILE, backward_recipe::<bf16>())
                .unwrap_or_else(|e| panic!("case `{name}`: {e}"));
            (name, BackwardCase { problem, expect })
        })
        .collect();
    hunt(TEST, FLASH_BWD, &catalog_mutants(FLASH_BWD), &cases, |kernel, c| check_backward(&stream, kernel, c));
}

/// Runs every catalog mutant of `base` through the general property suite `suite` (its default draws, bf16, no
/// shrinking: the first failing draw kills) and requires each to fail, as the hand-picked cases above do. The
/// production kernel passes the same draws in `flash_forward`/`flash_backward`, so a failure is the patch's. Prints
/// the table: mutant, the draw that killed it, the first line of why.
fn hunt_with_general_suite(test: &str, base: KernelSource, suite: &PropertySuite, candidate: &GpuCandidate) {
    let catalog = catalog_mutants(base);
    assert!(!catalog.is_empty(), "the catalog holds no kernel-text mutant of {}", base.name);
    let judged = judge_isolated(test, &catalog, |m| {
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
            Err(TestError::Fail(why, _)) => Some(Kill::new(&draws.get().to_string(), why.message())),
            Err(TestError::Abort(why)) => panic!("{}: the suite gave up on mutant `{}`: {why}", suite.name, m.name),
            Ok(()) => None,
        }
    });
    let Some(verdicts) = judged else { return };
    let mut survivors = vec![];
    println!("{:<40} {:<8} detail", "mutant", "draw");
    for (m, verdict) in catalog.iter().zip(verdicts) {
        match verdict {
            Some(kill) => println!("{:<40} {:<8} {}", m.name, kill.by, kill.why.chars().take(70).collect::<String>()),
            None => {
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
    hunt_with_general_suite(
        "all_forward_mutants_are_killed_by_the_general_suite",
        FLASH_FWD,
        suite("gpu_flash_forward_bf16"),
        &candidate,
    );
}

#[test]
fn all_backward_mutants_are_killed_by_the_general_suite() {
    let Some(candidate) = GpuCandidate::if_available("all_backward_mutants_are_killed_by_the_general_suite") else {
        return;
    };
    hunt_with_general_suite(
        "all_backward_mutants_are_killed_by_the_general_suite",
        FLASH_BWD,
        suite("gpu_flash_backward_bf16"),
        &candidate,
    );
}

/// Every mutant compiles (for sm_90a, with the killing cases' defines at head dims 64 and 128): a patch that broke the
/// build would fail every case and pass for killed without modelling any bug. Needs NVRTC only, not a device.
#[test]
fn every_mutant_compiles_for_sm_90a() {
    if !nvrtc_or_skip("every_mutant_compiles_for_sm_90a") {
        return;
    }
    // Head dims 64 and 128: a patch may break only the wider variant (the wgmma kernels' two column chunks).
    let jobs: Vec<(usize, KernelSource, &'static Mutant, Vec<String>)> =
        [64, 128].into_iter().flat_map(mutant_compiles_at).collect();
    // One compile per core (NVRTC is single-threaded per program): serial, this took over four minutes on the
    // device machine's sixteen cores and nine on CI's two.
    let broken: Vec<String> = jobs
        .par_iter()
        .filter_map(|(d, text, m, defines)| {
            compile_for_arch(*text, "sm_90a", defines).err().map(|e| format!("{} (d = {d}): {e}", m.name))
        })
        .collect();
    assert!(!jobs.is_empty(), "no kernel-text mutant to compile");
    assert!(broken.is_empty(), "mutants that do not compile:\n{}", broken.join("\n\n"));
}

/// The compiles that check every kernel-text mutant with the plain module's defines of a problem with head dims `d`:
/// (d, patched text, mutant, defines).
fn mutant_compiles_at(d: usize) -> Vec<(usize, KernelSource, &'static Mutant, Vec<String>)> {
    let spec = AttentionSpec::dense(1, 2, 1, 64, 64, d, d);
    let variants = module_variants::<bf16>(&spec, ForwardTiling::for_head_dims(d, d), BackwardTiling::DEFAULT)
        .expect("the cases' modules");
    // The plain module of each kernel (the ring modes add a define to it).
    let plain = |kernel: KernelSource| {
        variants.iter().filter(|v| v.kernel == kernel).min_by_key(|v| v.defines.len()).expect("a variant").clone()
    };
    let mut jobs = vec![];
    for base in KERNELS {
        let defines = plain(base).defines;
        for m in attnproof_catalog::all() {
            let Runner::KernelText { kernel, mode } = m.runner else { continue };
            if kernel != base.name {
                continue;
            }
            let defines: Vec<String> = defines.iter().cloned().chain(mode.map(str::to_owned)).collect();
            jobs.push((d, patched(base, m), m, defines));
        }
    }
    jobs
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
            // The shared header is part of every attention kernel's text, the Hopper header of every wgmma kernel's.
            let sm90_header = m.file == attnproof_catalog::SM90_HEADER && kernel.ends_with("_sm90");
            assert!(
                m.file.ends_with(&format!("{kernel}.cu")) || m.file == attnproof_catalog::COMMON_HEADER || sm90_header,
                "mutant `{}`: file {} is not {kernel}.cu or a shared header",
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
