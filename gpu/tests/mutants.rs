//! GPU mutants: named source patches of `gpu/kernels/flash_fwd.cu`, each compiled by NVRTC through the same
//! `compile::module_from_source` path as the production kernel and launched through the production wrapper
//! (`flash::flash_forward_device_with`), must all be killed by the oracle verdicts of a few small cases.
//!
//! Production code has no mutation hook: the patches are applied here, to the text the crate embeds, and the patched
//! text is an ordinary argument of the public API. The unpatched kernel must pass every case first, so that a kill
//! means the patch, not the case, broke the result. Each patch must match its anchor exactly once, so a refactor of
//! the kernel that moves an anchor fails this test instead of silently dropping the mutant. Without a device the test
//! prints `skipped: no CUDA device` and passes.

use std::sync::Arc;

use attnproof_gpu::compile::{FLASH_FWD, KernelSource};
use attnproof_gpu::flash::{EXP_RELATIVE_ERROR, ForwardTiling, KV_TILE, SHIFT_ROUNDING, flash_forward_device_with};
use attnproof_gpu::skip_unless_gpu;
use attnproof_harness::flash::recipe;
use attnproof_harness::generate::{Distribution, ValueProfile, make_case};
use attnproof_harness::{Case, verify_forward};
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Mask};
use attnproof_proofs::flash_bound::{Accumulation, FlashRecipe};
use cudarc::driver::CudaStream;
use half::bf16;
use ndarray::{ArrayD, IxDyn};

/// One mutant: replace `find` (which must occur exactly once) by `replace`.
struct Mutant {
    name: &'static str,
    find: &'static str,
    replace: &'static str,
}

/// The catalog. Each entry is a plausible kernel bug; the comment says which check should see it.
const MUTANTS: &[Mutant] = &[
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
    Mutant { name: "missing_rescale", find: "ex2_approx(__fsub_rn(ml_run[mi][r], ml_new[r]))", replace: "1.f" },
    // A is not rescaled, ℓ is (a half-done rescale).
    Mutant {
        name: "accumulator_not_rescaled",
        find: "acc[mi][n][0] = __fmul_rn(acc[mi][n][0], rescale[0]);",
        replace: "",
    },
    // p = 2^(s·L) without subtracting the running max: overflows at large logits, and LSE loses m.
    Mutant {
        name: "missing_max_subtraction",
        find: "ex2_approx(__fmaf_rn(x, LOG2E_F, -ml_new[r]))",
        replace: "ex2_approx(__fmul_rn(x, LOG2E_F))",
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

fn kernel_recipe() -> FlashRecipe {
    FlashRecipe {
        exp_error: EXP_RELATIVE_ERROR,
        shift_rounding: SHIFT_ROUNDING,
        accumulation: Accumulation::TensorCore { k_step: 16 },
        ..recipe::<bf16>(KV_TILE)
    }
}

fn gaussian(logit_scale: f64) -> ValueProfile {
    ValueProfile { distribution: Distribution::Gaussian, logit_scale, value_mean: 0.0 }
}

/// The killing cases: one head dim (one module per mutant), masks, Lq ≠ Lk both ways, tails, GQA, a window, and a
/// row max in the last tile at logit scale 100.
fn cases() -> Vec<(&'static str, Case<bf16>)> {
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

/// Runs `kernel` on `case` with NaN-poisoned outputs; `Ok(())` when the verdict passes and the gate is valid,
/// otherwise why not.
fn check(stream: &Arc<CudaStream>, kernel: KernelSource, case: &Case<bf16>) -> Result<(), String> {
    let spec = &case.spec;
    let up = |t: &ArrayD<bf16>| stream.clone_htod(t.as_slice().expect("standard layout")).map_err(|e| e.to_string());
    let (q, k, v) = (up(&case.q)?, up(&case.k)?, up(&case.v)?);
    let o_shape = spec.expected_shape(Operand::O);
    let lse_shape = spec.expected_shape(Operand::RowStat);
    let mut o = stream.clone_htod(&vec![bf16::NAN; o_shape.iter().product()]).map_err(|e| e.to_string())?;
    let mut lse = stream.clone_htod(&vec![f32::NAN; lse_shape.iter().product()]).map_err(|e| e.to_string())?;
    let tiling = ForwardTiling::for_head_dims(spec.head_dim, spec.head_dim_v);
    flash_forward_device_with(stream, spec, kernel, tiling, &q, &k, &v, &mut o, &mut lse).map_err(|e| e.to_string())?;
    let o = stream.clone_dtoh(&o).map_err(|e| e.to_string())?;
    let lse = stream.clone_dtoh(&lse).map_err(|e| e.to_string())?;
    stream.synchronize().map_err(|e| e.to_string())?;
    let o = ArrayD::from_shape_vec(IxDyn(&o_shape), o).map_err(|e| e.to_string())?;
    let lse = ArrayD::from_shape_vec(IxDyn(&lse_shape), lse).map_err(|e| e.to_string())?;
    let verdict = verify_forward(case, kernel_recipe(), o.view(), lse.view()).map_err(|e| e.to_string())?;
    if verdict.passed() && verdict.valid() {
        Ok(())
    } else {
        Err(format!("verdict failed, worst error/bound {:.3e}", verdict.max_ratio()))
    }
}

/// The kernel text with one patch applied; panics unless the anchor occurs exactly once.
fn patched(m: &Mutant) -> KernelSource {
    let n = FLASH_FWD.source.matches(m.find).count();
    assert_eq!(n, 1, "mutant `{}`: anchor {:?} occurs {n} times in flash_fwd.cu", m.name, m.find);
    // Leaked: a module's cache key holds its source for the rest of the process, and the catalog is small.
    let text: &'static str = Box::leak(FLASH_FWD.source.replacen(m.find, m.replace, 1).into_boxed_str());
    KernelSource { name: FLASH_FWD.name, source: text }
}

#[test]
fn all_gpu_mutants_are_killed() {
    let Some(ctx) = skip_unless_gpu("all_gpu_mutants_are_killed") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let cases = cases();
    for (name, case) in &cases {
        if let Err(why) = check(&stream, FLASH_FWD, case) {
            panic!("the unpatched kernel fails case `{name}`: {why}");
        }
    }
    let mut survivors = vec![];
    println!("{:<28} {:<24} detail", "mutant", "killed by");
    for m in MUTANTS {
        let kernel = patched(m);
        let kill = cases.iter().find_map(|(name, case)| check(&stream, kernel, case).err().map(|why| (*name, why)));
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
    println!("gpu mutants: {} of {} killed", MUTANTS.len() - survivors.len(), MUTANTS.len());
    assert!(survivors.is_empty(), "surviving GPU mutants: {survivors:?}");
}

#[test]
fn catalog_has_at_least_ten_distinct_mutants_with_unique_anchors() {
    assert!(MUTANTS.len() >= 10);
    let mut names: Vec<_> = MUTANTS.iter().map(|m| m.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), MUTANTS.len(), "duplicate mutant names");
    for m in MUTANTS {
        assert_eq!(FLASH_FWD.source.matches(m.find).count(), 1, "mutant `{}`: anchor {:?}", m.name, m.find);
        assert_ne!(m.find, m.replace, "mutant `{}` changes nothing", m.name);
    }
}
