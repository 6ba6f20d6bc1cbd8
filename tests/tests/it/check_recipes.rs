//! The recipe mapping against simulations of the computations it names: PyTorch's math SDPA
//! with reduced-precision reductions (scaled inputs, scores and probabilities rounded to bf16)
//! stays within the bound of `bf16-in/bf16-math`, and exceeds it without the score-storage
//! term of `flash_bound` (extension E-score-storage), so that term is needed.

use attnproof_harness::Case;
use attnproof_harness::case::build::CaseBuilder;
use attnproof_harness::case::recipe::Recipe;
use attnproof_harness::case::safetensors::Dtype;
use attnproof_harness::case::{OracleChoice, Status, check, format};
use attnproof_harness::flash::problem_forward_bounds;
use attnproof_harness::generate::{Distribution, ValueProfile, make_case};
use attnproof_harness::verdict::compare;
use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Operand;
use attnproof_proofs::flash_bound::FlashRecipe;
use half::bf16;
use ndarray::{ArrayD, Axis};

fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// `O` as `torch.ops.aten._scaled_dot_product_attention_math` computes it with
/// `allow_fp16_bf16_reduction_math_sdp(True)`: `q·√α` and `k·√α` rounded to bf16, the score
/// matmul accumulated in f32 and rounded to bf16, softmax in f32 rounded to bf16, `P·V`
/// accumulated in f32 and rounded to bf16.
fn reduced_math_forward(spec: &AttentionSpec, q: &ArrayD<f64>, k: &ArrayD<f64>, v: &ArrayD<f64>) -> ArrayD<f64> {
    let mut o = ArrayD::zeros(spec.expected_shape(Operand::O));
    let root = (1.0 / (spec.head_dim as f32).sqrt()).sqrt();
    for seq in spec.sequences() {
        for h in 0..spec.n_heads_q {
            let kv = spec.kv_head(h);
            let qh = spec.head_rows(q.view(), &seq, h, false).mapv(|x| round_bf16(x as f32 * root));
            let kh = spec.head_rows(k.view(), &seq, kv, true).mapv(|x| round_bf16(x as f32 * root));
            let vh = spec.head_rows(v.view(), &seq, kv, true).mapv(|x| x as f32);
            let mut out = o.slice_mut(spec.head_slice(&seq, h, false));
            for i in 0..seq.len_q {
                let s: Vec<f32> = (0..seq.len_k)
                    .map(|j| round_bf16((0..spec.head_dim).fold(0f32, |acc, c| acc + qh[[i, c]] * kh[[j, c]])))
                    .collect();
                let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f32 = e.iter().sum();
                let p: Vec<f32> = e.iter().map(|x| round_bf16(x / l)).collect();
                for c in 0..spec.head_dim_v {
                    let acc = (0..seq.len_k).fold(0f32, |acc, j| acc + p[j] * vh[[j, c]]);
                    out[[i, c]] = round_bf16(acc) as f64;
                }
            }
        }
    }
    o
}

/// `max(error / bound)` of the simulated reduced math forward under `recipe`.
fn ratio(case: &Case<bf16>, recipe: FlashRecipe) -> f64 {
    let [q, k, v] = case.widened();
    let truth = problem_forward_bounds(&case.spec, &q, &k, &v, recipe).expect("model hypothesis holds");
    let o = reduced_math_forward(&case.spec, &q, &k, &v);
    compare("O", o.view(), truth.o.view(), truth.bound_o.view()).max_ratio
}

/// The simulated score of `q·k` minus the exact one (the error E-score-storage bounds).
fn score_error(q: &[f32], k: &[f32], scale: f64) -> f64 {
    let root = (scale as f32).sqrt();
    let simulated =
        round_bf16(q.iter().zip(k).fold(0f32, |acc, (a, b)| acc + round_bf16(a * root) * round_bf16(b * root)));
    let exact: f64 = q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale;
    simulated as f64 - exact
}

/// A case whose score errors all push `O` the same way: positive aligned keys (scores near 2,
/// where bf16's spacing is 2^-6, within the model's first-order hypothesis) chosen for large
/// score errors, and each value `±1` with the sign of its key's score error.
fn coherent_case(seed: u64) -> Case<bf16> {
    let (len_k, d) = (64, 12);
    let spec = AttentionSpec::dense(1, 1, 1, 1, len_k, d, 1);
    let scale = 1.0 / (d as f64).sqrt();
    let candidates = 16 * len_k;
    let noise = attnproof_harness::generate::gaussian(seed, candidates * d);
    let q = vec![1f32; d];
    let mut keys: Vec<Vec<f32>> = (0..candidates)
        .map(|j| (0..d).map(|c| round_bf16(0.62 + 0.04 * noise[j * d + c].tanh() as f32)).collect())
        .collect();
    // Keep the keys whose scores the recipe raises most and those it lowers most, half each (all
    // of one sign would leave O = ±1 whatever the weights).
    keys.sort_by(|a, b| score_error(&q, b, scale).total_cmp(&score_error(&q, a, scale)));
    let lowered = keys.split_off(candidates - len_k / 2);
    keys.truncate(len_k / 2);
    keys.extend(lowered);
    let values: Vec<f32> = keys.iter().map(|kj| if score_error(&q, kj, scale) >= 0.0 { 1.0 } else { -1.0 }).collect();
    let tensor = |shape: Vec<usize>, data: Vec<f32>| {
        ArrayD::from_shape_vec(shape, data.into_iter().map(bf16::from_f32).collect()).expect("shape")
    };
    Case {
        q: tensor(vec![1, 1, 1, d], q.clone()),
        k: tensor(vec![1, 1, len_k, d], keys.concat()),
        v: tensor(vec![1, 1, len_k, 1], values),
        spec,
    }
}

#[test]
fn reduced_precision_math_is_within_its_bound() {
    // d = 12: √α is irrational, so rounding q·√α to bf16 is not exact. Logits of about 0.3 keep
    // the model's first-order hypothesis.
    let spec = AttentionSpec::dense(1, 2, 2, 24, 96, 12, 12);
    let profile = ValueProfile { distribution: Distribution::Gaussian, logit_scale: 0.3, value_mean: 0.0 };
    let recipe = Recipe::parse("bf16-in/bf16-math").expect("known recipe").flash;
    for seed in 0..4 {
        let r = ratio(&make_case(&spec, profile, seed), recipe);
        assert!(r <= 1.0, "seed {seed}: reduced math exceeds its bound: ratio {r}");
    }
}

#[test]
fn reduced_precision_math_needs_the_score_storage_term() {
    let recipe = Recipe::parse("bf16-in/bf16-math").expect("known recipe").flash;
    let without_term = FlashRecipe { score_storage_rounding: 0.0, ..recipe };
    for seed in 0..4 {
        let case = coherent_case(seed);
        let with = ratio(&case, recipe);
        assert!(with <= 1.0, "seed {seed}: coherent case exceeds the bound: ratio {with}");
        let without = ratio(&case, without_term);
        assert!(without > 1.0, "seed {seed}: the score-storage term is not needed (ratio without it {without})");
    }
}

#[test]
fn recipe_names_map_to_their_storage_and_reject_unknown_names() {
    let fused = Recipe::parse("BF16-in/f32-acc/p-bf16").expect("case-insensitive");
    assert_eq!(fused.flash.unit_roundoff, 2f64.powi(-8));
    assert_eq!(fused.flash.score_storage_rounding, 0.0);
    let f16 = Recipe::parse("f16-in/f32-acc/p-f16").expect("known");
    assert_eq!(f16.flash.unit_roundoff, 2f64.powi(-11));
    assert!(Recipe::parse("f32-in/f32-acc").expect("known").has_backward_model());
    assert!(!Recipe::parse("bf16-in/bf16-math").expect("known").has_backward_model());
    let err = Recipe::parse("bf16-in/tf32-acc").expect_err("unknown").to_string();
    assert!(err.contains("recipe") && err.contains("bf16-in/f32-acc/p-bf16"), "{err}");
}

/// `x` rounded to TF32 (10 fraction bits, to nearest with ties to even), as `cvt.rna.tf32.f32` and cuBLAS's TF32
/// tensor-op path feed an f32 operand to the MMA.
fn round_tf32(x: f32) -> f32 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0xfff + ((bits >> 13) & 1)) & !0x1fff;
    f32::from_bits(rounded)
}

/// A tiled f32 FlashAttention forward (tiles of `kv_tile` keys, online softmax, f32 sums) whose MMA operands `q`, `k`,
/// `P` and `v` pass through `operand` first: the identity for an honest f32 kernel, [`round_tf32`] for one running its
/// products in TF32. Returns `O` and the natural-log `LSE`, both f32.
fn tiled_f32_forward(
    spec: &AttentionSpec,
    [q, k, v]: [&ArrayD<f64>; 3],
    kv_tile: usize,
    operand: fn(f32) -> f32,
) -> (ArrayD<f64>, ArrayD<f64>) {
    let mut o = ArrayD::zeros(spec.expected_shape(Operand::O));
    let mut lse = ArrayD::zeros(spec.expected_shape(Operand::RowStat));
    let scale = (1.0 / (spec.head_dim as f64).sqrt()) as f32;
    for seq in spec.sequences() {
        for h in 0..spec.n_heads_q {
            let kv = spec.kv_head(h);
            let qh = spec.head_rows(q.view(), &seq, h, false).mapv(|x| operand(x as f32));
            let kh = spec.head_rows(k.view(), &seq, kv, true).mapv(|x| operand(x as f32));
            let vh = spec.head_rows(v.view(), &seq, kv, true).mapv(|x| operand(x as f32));
            let mut out = o.slice_mut(spec.head_slice(&seq, h, false));
            let mut stat = lse.slice_mut(spec.row_stat_slice(&seq, h));
            for i in 0..seq.len_q {
                let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                let mut acc = vec![0f32; spec.head_dim_v];
                for start in (0..seq.len_k).step_by(kv_tile) {
                    let keys = start..(start + kv_tile).min(seq.len_k);
                    let s: Vec<f32> = keys
                        .clone()
                        .map(|j| (0..spec.head_dim).fold(0f32, |a, c| qh[[i, c]].mul_add(kh[[j, c]], a)) * scale)
                        .collect();
                    let m_new = s.iter().copied().fold(m, f32::max);
                    let rescale = (m - m_new).exp();
                    l *= rescale;
                    acc.iter_mut().for_each(|a| *a *= rescale);
                    for (j, sj) in keys.zip(&s) {
                        let p = (sj - m_new).exp();
                        l += p;
                        for (c, a) in acc.iter_mut().enumerate() {
                            *a = operand(p).mul_add(vh[[j, c]], *a);
                        }
                    }
                    m = m_new;
                }
                for (c, a) in acc.iter().enumerate() {
                    out[[i, c]] = (a / l) as f64;
                }
                stat[i] = (m + l.ln()) as f64;
            }
        }
    }
    (o, lse)
}

/// Inputs on which TF32 shows at any length: every query `1 + 3·2^-12` per element (TF32 rounds it up by `2^-12`),
/// keys of small random scores below zero, and the last key (the maximum in the last tile) `1.5 + 4.5·2^-12` per
/// element, whose score (about 8.5 for `d = 32`) TF32 raises by `α·d·2^-12` while it carries most of the row's weight.
fn tf32_sensitive_inputs(spec: &AttentionSpec, seed: u64) -> [ArrayD<f64>; 3] {
    let profile = ValueProfile { distribution: Distribution::Gaussian, logit_scale: 1.0, value_mean: 0.0 };
    let [mut q, mut k, v] = make_case::<f32>(spec, profile, seed).widened();
    q.fill(1.0 + 3.0 * 2f64.powi(-12));
    k.mapv_inplace(|x| (0.3 * x - 0.35) as f32 as f64);
    let len_k = k.shape()[2];
    if len_k > 0 {
        k.index_axis_mut(Axis(2), len_k - 1).fill(1.5 + 4.5 * 2f64.powi(-12));
    }
    [q, k, v]
}

/// The verdicts of `check` on the tiled f32 forward with `operand` over `inputs`, stated under `recipe` with `params`
/// metadata.
fn tiled_report(
    spec: &AttentionSpec,
    [q, k, v]: &[ArrayD<f64>; 3],
    operand: fn(f32) -> f32,
    recipe: &str,
    params: &[(&str, &str)],
) -> attnproof_harness::case::CaseReport {
    let (o, lse) = tiled_f32_forward(spec, [q, k, v], TF32_KV_TILE, operand);
    let mut builder = CaseBuilder::new()
        .tensor("q", Dtype::F32, q)
        .tensor("k", Dtype::F32, k)
        .tensor("v", Dtype::F32, v)
        .tensor("o", Dtype::F32, &o)
        .tensor("lse", Dtype::F32, &lse)
        .meta("recipe", recipe);
    for (key, value) in params {
        builder = builder.meta(key, value);
    }
    let case = format::from_bytes(&builder.bytes()).expect("the case loads");
    check(&case, OracleChoice::F64)
}

/// KV tile of the simulated f32 kernels.
const TF32_KV_TILE: usize = 64;

/// The simulated kernels' parameters as a case states them: 64-key tiles, no split, Rust's `f32::exp` (libm's
/// `expf`, within 1 ulp) of `fl(s − m)`, and sequential f32 sums (round to nearest, covered by any MMA depth: 8, TF32's
/// `m16n8k8`).
const STATED_TILES: [(&str, &str); 5] = [
    ("kernel_kv_tile", "64"),
    ("kernel_q_tile", "1"),
    ("kernel_mma_k", "8"),
    ("kernel_exp", "expf"),
    ("kernel_split_kv", "1"),
];

/// Query rows, key lengths (one tile, tile ± 1, many tiles) and head dims the TF32 tests run over.
fn tf32_problems() -> Vec<AttentionSpec> {
    [(1, 1), (16, 63), (16, 64), (16, 65), (32, 300), (16, 1024), (8, 4096)]
        .into_iter()
        .map(|(len_q, len_k)| AttentionSpec::dense(1, 2, 1, len_q, len_k, 32, 32))
        .collect()
}

/// An honest f32 kernel passes `f32-in/f32-acc` with its tiles stated; the same kernel with its products in TF32
/// fails it at every length, its cause named, and passes the `f32-in/tf32` recipe made for it. The honest kernel
/// passes on Gaussian inputs too.
#[test]
fn f32_recipe_with_stated_tiles_rejects_tf32_at_every_length() {
    for (i, spec) in tf32_problems().into_iter().enumerate() {
        let seed = 40 + i as u64;
        let profile = ValueProfile { distribution: Distribution::Gaussian, logit_scale: 1.0, value_mean: 0.0 };
        let gaussian = make_case::<f32>(&spec, profile, seed).widened();
        let honest = tiled_report(&spec, &gaussian, |x| x, "f32-in/f32-acc", &STATED_TILES);
        assert!(!honest.failed(), "{spec:?}: the honest f32 kernel fails: {honest:?}");
        let inputs = tf32_sensitive_inputs(&spec, seed);
        let honest = tiled_report(&spec, &inputs, |x| x, "f32-in/f32-acc", &STATED_TILES);
        assert!(!honest.failed(), "{spec:?}: the honest f32 kernel fails: {honest:?}");
        let tf32 = tiled_report(&spec, &inputs, round_tf32, "f32-in/f32-acc", &STATED_TILES);
        assert!(tf32.failed(), "{spec:?}: TF32 passes f32-in/f32-acc with stated tiles: {tf32:?}");
        for o in tf32.outputs.iter().filter(|o| o.status == Status::Fail) {
            let cause = o.cause.as_deref().unwrap_or_default();
            assert!(cause.contains("ran in TF32") && cause.contains("f32-in/tf32"), "{spec:?} {}: {o:?}", o.output);
        }
        let stated = tiled_report(&spec, &inputs, round_tf32, "f32-in/tf32", &STATED_TILES);
        assert!(stated.outputs.iter().all(|o| o.status == Status::Pass), "{spec:?}: f32-in/tf32: {stated:?}");
    }
}

/// Stated tiles are what makes the f32 recipe sharp: without them the bound assumes one-key tiles and split-KV
/// merges, and at 4096 keys the TF32 kernel passes the unstated recipe that it fails once the tiles are stated.
#[test]
fn unstated_tiles_leave_the_f32_bound_too_wide_for_tf32() {
    let spec = AttentionSpec::dense(1, 2, 1, 8, 4096, 32, 32);
    let inputs = tf32_sensitive_inputs(&spec, 7);
    let unstated = tiled_report(&spec, &inputs, round_tf32, "f32-in/f32-acc", &[]);
    assert!(!unstated.failed(), "{unstated:?}");
    let stated = tiled_report(&spec, &inputs, round_tf32, "f32-in/f32-acc", &STATED_TILES);
    assert!(stated.failed(), "{stated:?}");
    assert_eq!((unstated.kernel_params.kv_tile, stated.kernel_params.kv_tile), (None, Some(TF32_KV_TILE)));
}

/// The bf16 math backend with reduced-precision reductions, stated as the default math recipe, fails it with the
/// recipe mismatch named, not a structural cause: eight heads, each a coherent case of its own, so that no other
/// hypothesis (a scale, a dropped key) can match them all by chance as it may match one output element.
#[test]
fn scores_rounded_to_storage_are_named_a_recipe_mismatch() {
    let heads: Vec<Case<bf16>> = (0..8).map(coherent_case).collect();
    let stack = |part: fn(&Case<bf16>) -> &ArrayD<bf16>| {
        let views: Vec<_> = heads.iter().map(|c| part(c).mapv(|x| x.to_f64())).collect();
        let views: Vec<_> = views.iter().map(|a| a.view()).collect();
        ndarray::concatenate(Axis(1), &views).expect("heads of one shape")
    };
    let (q, k, v) = (stack(|c| &c.q), stack(|c| &c.k), stack(|c| &c.v));
    let one = &heads[0].spec;
    let spec = AttentionSpec { n_heads_q: heads.len(), n_heads_kv: heads.len(), ..one.clone() };
    let o = reduced_math_forward(&spec, &q, &k, &v);
    let builder = CaseBuilder::new()
        .tensor("q", Dtype::Bf16, &q)
        .tensor("k", Dtype::Bf16, &k)
        .tensor("v", Dtype::Bf16, &v)
        .tensor("o", Dtype::Bf16, &o)
        .meta("recipe", "bf16-in/f32-math");
    let r = check(&format::from_bytes(&builder.bytes()).expect("loads"), OracleChoice::F64);
    let out = &r.outputs[0];
    assert_eq!(out.status, Status::Fail, "{r:?}");
    let cause = out.cause.as_deref().unwrap_or_default();
    assert!(cause.starts_with("recipe mismatch") && cause.contains("bf16-in/bf16-math"), "{out:?}");
}
