//! GPU mutants: named source patches of `gpu/kernels/flash_fwd.cu` and `gpu/kernels/flash_bwd.cu`, each compiled by
//! NVRTC through the same `compile::module_from_source` path as the production kernels and launched through the
//! production wrappers (`flash_forward_device_with`, `flash_backward_device_with`), with NaN-poisoned, guarded
//! outputs, must all be killed by the oracle verdicts of a few small cases.
//!
//! Production code has no mutation hook: the patches are applied here, to the text the crate embeds, and the patched
//! text is an ordinary argument of the public API. The unpatched kernel must pass every case first, so that a kill
//! means the patch, not the case, broke the result. Each patch must match its anchor exactly once, so a refactor of
//! a kernel that moves an anchor fails this test instead of silently dropping the mutant. Without a device the tests
//! print `skipped: no CUDA device` and pass.

mod common;

use std::sync::Arc;

use attnproof_gpu::backward::Q_TILE;
use attnproof_gpu::compile::{FLASH_BWD, FLASH_FWD, KernelSource, compile_for_arch};
use attnproof_gpu::flash::ForwardTiling;
use attnproof_gpu::{BackwardTiling, GpuBackwardStrategy, module_variants, nvrtc_or_skip, skip_unless_gpu};
use attnproof_harness::backward::{BackwardCandidate, BackwardExpectation};
use attnproof_harness::generate::{Distribution, ValueProfile, make_case};
use attnproof_harness::{Case, verify_forward};
use attnproof_oracle::{AttentionSpec, Mask};
use common::*;
use cudarc::driver::CudaStream;
use half::bf16;

/// One mutant: replace `find` (which must occur exactly once) by `replace`.
struct Mutant {
    name: &'static str,
    find: &'static str,
    replace: &'static str,
}

/// Mutants of `flash_fwd.cu`. Each entry is a plausible kernel bug; the comment says which check should see it.
const FORWARD_MUTANTS: &[Mutant] = &[
    // Causal aligned top-left instead of bottom-right: wrong whenever Lq ≠ Lk.
    Mutant {
        name: "causal_top_left",
        find: "const long long shift = (long long)len_k - len_q;",
        replace: "const long long shift = 0;",
    },
    // The key past the end is visible in the tail tile (it reads the zero-filled padding row: a spurious s = 0).
    Mutant {
        name: "tail_mask_off_by_one",
        find: "const bool vis = j < len_k &&",
        replace: "const bool vis = j <= len_k &&",
    },
    // ℓ and A are never rescaled when the running max moves.
    Mutant { name: "missing_rescale", find: "ex2_approx_ftz(__fsub_rn(ml_run[mi][r], ml_new[r]))", replace: "1.f" },
    // A is not rescaled, ℓ is (a half-done rescale).
    Mutant {
        name: "accumulator_not_rescaled",
        find: "acc[mi][n][0] = __fmul_rn(acc[mi][n][0], rescale[0]);",
        replace: "",
    },
    // p = 2^(s·L) without subtracting the running max: overflows at large logits, and LSE loses m.
    Mutant {
        name: "missing_max_subtraction",
        find: "ex2_approx_ftz(__fmaf_rn(x, LOG2E_F, -ml_new[r]))",
        replace: "ex2_approx_ftz(__fmul_rn(x, LOG2E_F))",
    },
    // LSE in base 2.
    Mutant {
        name: "lse_base_2",
        find: "__fadd_rn(m_run[mi][r], logf(l))",
        replace: "__fadd_rn(m_run[mi][r], log2f(l))",
    },
    // Scale 1/d instead of 1/√d.
    Mutant {
        name: "scale_one_over_d",
        find: "float x = __fmul_rn(s[mi][n][e], scale);",
        replace: "float x = __fmul_rn(s[mi][n][e], scale * scale);",
    },
    // GQA maps query head h to KV head h % group instead of h / group.
    Mutant {
        name: "gqa_head_map",
        find: "const int kv_head = head / group;",
        replace: "const int kv_head = head % group;",
    },
    // The last KV tile of every CTA is skipped.
    Mutant {
        name: "last_kv_tile_skipped",
        find: "for (int t = tile_lo; t < tile_hi; ++t) {",
        replace: "for (int t = tile_lo; t + 1 < tile_hi; ++t) {",
    },
    // Only warp 0 stores its rows (the others' stay NaN-poisoned).
    Mutant {
        name: "only_first_warp_writes",
        find: "if (row >= rows_here) continue;",
        replace: "if (row >= rows_here || warp > 0) continue;",
    },
    // The row max is reduced over half the quad only.
    Mutant {
        name: "row_max_half_reduced",
        find: "m_new[r] = fmaxf(m_new[r], __shfl_xor_sync(0xffffffffu, m_new[r], 2));",
        replace: "",
    },
    // ℓ is reduced over half the quad only.
    Mutant { name: "row_sum_half_reduced", find: "l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 2));", replace: "" },
    // The last tile's K is never fetched: its scores use the previous tile's keys.
    Mutant { name: "stale_k_tile", find: "if (t + 1 < tile_hi) {", replace: "if (t + 2 < tile_hi) {" },
    // The tail tile is taken for an interior one (no mask past Lk).
    Mutant {
        name: "interior_ignores_tail",
        find: "const bool interior = key0 + BLOCK_N <= len_k && key0 >= diag_hi - win_left &&",
        replace: "const bool interior = key0 >= diag_hi - win_left &&",
    },
    // Diagonal tiles are taken for interior ones when their first key is visible.
    Mutant {
        name: "interior_ignores_diagonal",
        find: "(long long)key0 + BLOCK_N - 1 <= diag_lo + win_right;",
        replace: "(long long)key0 <= diag_lo + win_right;",
    },
    // The window's left bound is not applied inside a tile.
    Mutant { name: "window_left_ignored", find: "&& j >= diag - win_left;", replace: ";" },
];

/// Mutants of `flash_bwd.cu`, each a plausible bug of one of its four kernels.
const BACKWARD_MUTANTS: &[Mutant] = &[
    // dS = P ∘ dP without subtracting D (E9): the softmax Jacobian's rank-one term is lost.
    Mutant {
        name: "bwd_ds_missing_delta",
        find: "__fmul_rn(p, __fsub_rn(dpt[n][e], delta_t[qc]))",
        replace: "__fmul_rn(p, dpt[n][e])",
    },
    // The last query tile that sees a KV tile is skipped: its rows add nothing to dK and dV.
    Mutant {
        name: "bwd_kv_tile_rows_off_by_one",
        find: "*a_hi = (int)(row_hi / Q_TILE);",
        replace: "*a_hi = (int)(row_hi / Q_TILE) - 1;",
    },
    // GQA: each query head's dK overwrites the group's sum instead of adding to it.
    Mutant {
        name: "bwd_gqa_dk_overwritten",
        find: "tot_k = hh == 0 ? x : __fadd_rn(tot_k, x);",
        replace: "tot_k = x;",
    },
    // GQA: the group sum of dK and dV leaves out the last query head of each group.
    Mutant {
        name: "bwd_gqa_last_head_dropped",
        find: "for (int hh = 0; hh < group; ++hh) {",
        replace: "for (int hh = 0; hh + 1 < group; ++hh) {",
    },
    // dK is written without the softmax scale α̂ (dS is the gradient of the scaled scores).
    Mutant {
        name: "bwd_dk_missing_scale",
        find: "pack_elems(to_elem(__fmul_rn(scale, xk[0])), to_elem(__fmul_rn(scale, xk[1])))",
        replace: "pack_elems(to_elem(xk[0]), to_elem(xk[1]))",
    },
    // D = rowsum(dO ∘ O) reduced over 16 of the 32 lanes only.
    Mutant {
        name: "bwd_delta_half_reduced",
        find: "for (int off = 16; off > 0; off >>= 1)",
        replace: "for (int off = 16; off > 1; off >>= 1)",
    },
    // The atomic dQ mode drops the odd column of each pair.
    Mutant {
        name: "bwd_atomic_dq_column_lost",
        find: "red_add_v2(live, dq_row + n * 8, part[mt][n][2 * r], part[mt][n][2 * r + 1]);",
        replace: "red_add_v2(live, dq_row + n * 8, part[mt][n][2 * r], 0.f);",
    },
    // The next query tile is prefetched into the stage being computed on (a race that mixes two tiles).
    Mutant {
        name: "bwd_q_prefetch_same_stage",
        find: "load_q_tile(a + 1, stage ^ 1);",
        replace: "load_q_tile(a + 1, stage);",
    },
    // Every column part of bwd_kv's warps computes the first part of the chunk's dQ columns.
    Mutant {
        name: "bwd_dq_column_half_repeated",
        find: "const int dq_c = c0 + (warp / DQ_ROW_GROUPS) * DQ_COLS;",
        replace: "const int dq_c = c0;",
    },
    // The window's left bound is not applied when P is recomputed in the KV-owner kernel.
    Mutant {
        name: "bwd_window_left_ignored",
        find: "j <= i + win_right && j >= i - win_left;",
        replace: "j <= i + win_right;",
    },
    // Strategy A takes a KV tile that crosses the diagonal (or a window's right edge) for an interior one: future keys
    // leak into dQ.
    Mutant {
        name: "bwd_dq_interior_ignores_diagonal",
        find: "key0 + DQ_KV_TILE - 1 <= row0 + shift + win_right &&",
        replace: "",
    },
    // A warp's keys that cross the diagonal (or a window's right edge) are taken as fully visible: future keys leak.
    Mutant {
        name: "bwd_interior_ignores_window_right",
        find: "wkey0 + 15 <= row0 + shift + win_right && ",
        replace: "",
    },
];

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
    let n = base.source.matches(m.find).count();
    assert_eq!(n, 1, "mutant `{}`: anchor {:?} occurs {n} times in {}", m.name, m.find, base.name);
    // Leaked: a module's cache key holds its source for the rest of the process, and the catalog is small.
    let text: &'static str = Box::leak(base.source.replacen(m.find, m.replace, 1).into_boxed_str());
    KernelSource { name: base.name, source: text }
}

/// Requires the unpatched `base` to pass every case, then every mutant of `catalog` to fail one; prints the table.
fn hunt<C>(
    base: KernelSource,
    catalog: &[Mutant],
    cases: &[(&str, C)],
    check: impl Fn(KernelSource, &C) -> Result<(), String>,
) {
    for (name, case) in cases {
        if let Err(why) = check(base, case) {
            panic!("the unpatched {} fails case `{name}`: {why}", base.name);
        }
    }
    let mut survivors = vec![];
    println!("{:<28} {:<24} detail", "mutant", "killed by");
    for m in catalog {
        let kernel = patched(base, m);
        let kill = cases.iter().find_map(|(name, case)| check(kernel, case).err().map(|why| (*name, why)));
        match kill {
            Some((by, why)) => {
                let first_line = why.lines().next().unwrap_or("").chars().take(70).collect::<String>();
                println!("{:<28} {:<24} {first_line}", m.name, by);
            }
            None => {
                println!("{:<28} {:<24}", m.name, "SURVIVED");
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
    hunt(FLASH_FWD, FORWARD_MUTANTS, &forward_cases(), |kernel, case| check_forward(&stream, kernel, case));
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
    hunt(FLASH_BWD, BACKWARD_MUTANTS, &cases, |kernel, c| check_backward(&stream, kernel, c));
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
    for (base, catalog) in [(FLASH_FWD, FORWARD_MUTANTS), (FLASH_BWD, BACKWARD_MUTANTS)] {
        let defines = plain(base).defines;
        for m in catalog {
            if let Err(e) = compile_for_arch(patched(base, m), "sm_90a", &defines) {
                broken.push(format!("{}: {e}", m.name));
            }
        }
    }
    assert!(broken.is_empty(), "mutants that do not compile:\n{}", broken.join("\n\n"));
}

#[test]
fn catalogs_have_distinct_mutants_with_unique_anchors() {
    assert!(FORWARD_MUTANTS.len() + BACKWARD_MUTANTS.len() >= 10);
    for (base, catalog) in [(FLASH_FWD, FORWARD_MUTANTS), (FLASH_BWD, BACKWARD_MUTANTS)] {
        let mut names: Vec<_> = catalog.iter().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), catalog.len(), "duplicate mutant names in {}", base.name);
        for m in catalog {
            assert_eq!(base.source.matches(m.find).count(), 1, "mutant `{}`: anchor {:?}", m.name, m.find);
            assert_ne!(m.find, m.replace, "mutant `{}` changes nothing", m.name);
        }
    }
}
