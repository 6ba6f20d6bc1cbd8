//! The recipe mapping against simulations of the computations it names: PyTorch's math SDPA
//! with reduced-precision reductions (scaled inputs, scores and probabilities rounded to bf16)
//! stays within the bound of `bf16-in/bf16-math`, and exceeds it without the score-storage
//! term of `flash_bound` (extension E-score-storage), so that term is needed.

use attnproof_harness::Case;
use attnproof_harness::case::recipe::Recipe;
use attnproof_harness::flash::problem_forward_bounds;
use attnproof_harness::generate::{Distribution, ValueProfile, make_case};
use attnproof_harness::verdict::compare;
use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Operand;
use attnproof_proofs::flash_bound::FlashRecipe;
use half::bf16;
use ndarray::ArrayD;

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
