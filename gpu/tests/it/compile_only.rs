//! Every module the launch plans compile, for a grid of head dims, dtypes and tilings, compiles with NVRTC for sm_90a
//! (the H200's target) on any machine that has NVRTC, device or not: a kernel edit that breaks a variant (a
//! `static_assert` for some head dim, a syntax error in a mode's `#if`) fails here, in CI, before any device time.
//! `cargo xtask test` and `verify` provide NVRTC from NVIDIA's wheel; without it the test prints `skipped: no NVRTC`.
//! A second test compiles each kernel for the architectures from Turing to Blackwell and checks that NVRTC accepts
//! exactly the devices `compile::check_device_supports` admits, so that the launch paths' early "unsupported device"
//! answer is neither too strict nor too lax.

use std::collections::BTreeSet;

use attnproof_gpu::GpuError;
use attnproof_gpu::compile::{arch_for, check_device_supports, compile_for_arch};
use attnproof_gpu::{BackwardTiling, ForwardTiling, GpuElement, ModuleVariant, module_variants, nvrtc_or_skip};
use attnproof_oracle::{AttentionSpec, Mask};
use half::{bf16, f16};
use rayon::prelude::*;

/// (d, dv) pairs: the benchmark's 64 and 128, the smallest, a non-multiple of 16, d ≠ dv both ways, wide heads
/// (two column chunks, one query stage) and the largest.
const HEAD_DIMS: [(usize, usize); 8] =
    [(8, 8), (64, 64), (128, 128), (40, 40), (64, 128), (160, 96), (200, 200), (256, 256)];
/// Head dims at which every tiling and both dtypes are compiled (the tuned paths); elsewhere bf16 in the default
/// forward tiling (the storage type only changes the header's types and conversions).
const EVERY_TILING_AT: [(usize, usize); 2] = [(64, 64), (128, 128)];

/// The variants of `T` for one spec's head dims, in the given forward tilings and both backward tilings.
fn variants<T: GpuElement>(d: usize, dv: usize, forward: &[ForwardTiling]) -> Vec<ModuleVariant> {
    variants_under::<T>(Mask::Causal, d, dv, forward)
}

/// [`variants`] under `mask` (NSA's strided causal mask compiles the kernels' `STRIDED_DIAGONAL` mode).
fn variants_under<T: GpuElement>(mask: Mask, d: usize, dv: usize, forward: &[ForwardTiling]) -> Vec<ModuleVariant> {
    let spec = AttentionSpec::dense(1, 2, 1, 100, 130, d, dv).with_mask(mask);
    let pairs = forward.iter().flat_map(|&f| BackwardTiling::ALL.map(|b| (f, b)));
    pairs
        .flat_map(|(fwd, bwd)| {
            module_variants::<T>(&spec, fwd, bwd).unwrap_or_else(|e| panic!("d = {d}, dv = {dv}: {e}"))
        })
        .collect()
}

/// The whole grid.
fn grid() -> Vec<ModuleVariant> {
    let mut out = vec![];
    for (d, dv) in HEAD_DIMS {
        out.extend(variants::<bf16>(d, dv, &[ForwardTiling::for_head_dims(d, dv)]));
    }
    for (d, dv) in EVERY_TILING_AT {
        let every: Vec<ForwardTiling> = ForwardTiling::ALL.into_iter().filter(|t| t.supports(d, dv)).collect();
        out.extend(variants::<bf16>(d, dv, &every));
        out.extend(variants::<f16>(d, dv, &every));
    }
    // NSA's compressed branch: the strided diagonal at E31's head dims and at the widest.
    for (d, dv) in [(64, 64), (128, 128), (192, 128), (256, 256)] {
        let mask = Mask::StridedCausal { len: 32, stride: 16 };
        out.extend(variants_under::<bf16>(mask, d, dv, &[ForwardTiling::for_head_dims(d, dv)]));
    }
    out
}

#[test]
fn every_planned_module_compiles_for_sm_90a() {
    if !nvrtc_or_skip("every_planned_module_compiles_for_sm_90a") {
        return;
    }
    // Distinct modules only: the backward's defines repeat across forward tilings and so on.
    let mut seen = BTreeSet::new();
    let unique: Vec<ModuleVariant> =
        grid().into_iter().filter(|v| seen.insert((v.kernel.name, v.defines.clone()))).collect();
    // One compile per core (NVRTC is single-threaded per program): two on CI's machines, sixteen on the device's.
    let failures: Vec<String> = unique
        .par_iter()
        .filter_map(|v| compile_for_arch(v.kernel, "sm_90a", &v.defines).err().map(|e| format!("{e}")))
        .collect();
    println!("compiled {} distinct modules for sm_90a, {} failed", unique.len(), failures.len());
    assert!(failures.is_empty(), "modules that do not compile:\n{}", failures.join("\n\n"));
    // The grid really reaches the wide-head paths: two column chunks and one query stage in the backward; and the
    // sm_90a forward with both of its paddings.
    assert!(unique.iter().any(|v| v.defines.iter().any(|d| d == "Q_STAGES=1")), "no single-stage backward variant");
    for pad in ["HEAD_DIM_PAD=64", "HEAD_DIM_PAD=128"] {
        for kernel in ["flash_fwd_sm90", "flash_bwd_sm90"] {
            let sm90 = |v: &&ModuleVariant| v.kernel.name == kernel && v.defines.iter().any(|d| d == pad);
            assert!(unique.iter().any(|v| sm90(&v)), "no {kernel} variant with {pad}");
        }
    }
    for kernel in ["flash_fwd", "flash_bwd", "flash_bwd_sm90"] {
        let strided = |v: &&ModuleVariant| v.kernel.name == kernel && v.defines.iter().any(|d| d == "STRIDED_DIAGONAL");
        assert!(unique.iter().any(|v| strided(&v)), "no {kernel} variant with the strided diagonal");
    }
}

/// Compute capabilities from Turing (the oldest target of CUDA 13's NVRTC) to consumer Blackwell.
const CAPABILITIES: [(i32, i32); 7] = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)];

#[test]
fn nvrtc_compiles_a_kernel_exactly_for_the_devices_the_support_table_admits() {
    if !nvrtc_or_skip("nvrtc_compiles_a_kernel_exactly_for_the_devices_the_support_table_admits") {
        return;
    }
    // Every kernel text and mode a launch compiles, at one head dim: the instructions do not depend on it.
    let spec = AttentionSpec::dense(1, 2, 1, 100, 130, 64, 64).with_mask(Mask::Causal);
    let variants = module_variants::<bf16>(&spec, ForwardTiling::for_head_dims(64, 64), BackwardTiling::DEFAULT)
        .expect("the spec's modules");
    let cases: Vec<(&ModuleVariant, (i32, i32))> =
        variants.iter().flat_map(|v| CAPABILITIES.map(|cc| (v, cc))).collect();
    let disagreements: Vec<String> = cases
        .par_iter()
        .filter_map(|&(v, (major, minor))| {
            let admitted = check_device_supports(v.kernel.name, (major, minor)).is_ok();
            let arch = arch_for(major, minor);
            let compiled = compile_for_arch(v.kernel, &arch, &v.defines);
            // A rejection must come from an instruction the target lacks, not from a broken text.
            let lacks_instruction = matches!(
                &compiled,
                Err(GpuError::Compile { log, .. })
                    if log.contains("requires .target sm_") || log.contains("not supported on .target")
            );
            (compiled.is_ok() != admitted || (!admitted && !lacks_instruction)).then(|| {
                let nvrtc = compiled.err().map_or("compiled".to_owned(), |e| e.to_string());
                format!("{} {:?} for {arch}: the table admits it: {admitted}; NVRTC: {nvrtc}", v.kernel.name, v.defines)
            })
        })
        .collect();
    println!("compiled {} (module, architecture) pairs, {} disagree with the table", cases.len(), disagreements.len());
    assert!(disagreements.is_empty(), "NVRTC and check_device_supports disagree:\n{}", disagreements.join("\n\n"));
    // Both answers occur, so neither half of the comparison is vacuous.
    assert!(cases.iter().any(|(v, cc)| check_device_supports(v.kernel.name, *cc).is_err()));
    assert!(cases.iter().any(|(v, cc)| check_device_supports(v.kernel.name, *cc).is_ok()));
}
