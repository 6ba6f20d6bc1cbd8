//! Precision recipes of external kernels, by name, and the conservative [`FlashRecipe`] each
//! selects. An external kernel's tiles, exponential and MMA shape are unknown, so every
//! parameter is set to the value that makes the bound largest over the kernels the recipe
//! covers (the argument for each is in `docs/case-format.md`).

use attnproof_proofs::flash_bound::{
    Accumulation, F32_MIN_NORMAL, F32_SUBNORMAL, F32_UNIT_ROUNDOFF, FlashRecipe, ScoreReuse,
};

use super::error::CaseError;
use super::safetensors::Dtype;

/// How the candidate computes, as far as the bound cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecipeKind {
    /// A fused FlashAttention-style kernel: f32 scores and online softmax, `P` rounded to the
    /// storage type before `PV` with f32 accumulation, outputs rounded to the storage type.
    Fused,
    /// PyTorch's math SDPA with its default upcast: inputs widened to f32, `q·√α` and `k·√α`
    /// in f32, f32 matmuls and softmax, the output rounded to the storage type.
    MathF32,
    /// PyTorch's math SDPA with `allow_fp16_bf16_reduction_math_sdp(True)`: `q·√α`, `k·√α`, the
    /// scores and the probabilities rounded to the storage type, f32 accumulation inside the
    /// matmuls.
    MathReduced,
}

/// A recipe: the name as written in the case file, the input type it implies, and the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Recipe {
    /// The `recipe` metadata value.
    pub name: String,
    /// Storage type of the inputs and outputs.
    pub storage: Dtype,
    /// Which computation.
    pub kind: RecipeKind,
    /// The bound model's parameters.
    pub flash: FlashRecipe,
    /// Query rows per tile for the backward's partial-dQ count (1: any tiling).
    pub q_tile: usize,
}

/// The recipe names `cargo xtask check` understands.
pub const KNOWN_RECIPES: [(&str, Dtype, RecipeKind); 7] = [
    ("bf16-in/f32-acc/p-bf16", Dtype::Bf16, RecipeKind::Fused),
    ("f16-in/f32-acc/p-f16", Dtype::F16, RecipeKind::Fused),
    ("f32-in/f32-acc", Dtype::F32, RecipeKind::Fused),
    ("bf16-in/f32-math", Dtype::Bf16, RecipeKind::MathF32),
    ("f16-in/f32-math", Dtype::F16, RecipeKind::MathF32),
    ("bf16-in/bf16-math", Dtype::Bf16, RecipeKind::MathReduced),
    ("f16-in/f16-math", Dtype::F16, RecipeKind::MathReduced),
];

/// Unit roundoff and smallest positive subnormal of a storage type.
pub fn storage_constants(storage: Dtype) -> (f64, f64) {
    match storage {
        Dtype::Bf16 => (2f64.powi(-8), 2f64.powi(-133)),
        Dtype::F16 => (2f64.powi(-11), 2f64.powi(-24)),
        _ => (F32_UNIT_ROUNDOFF, F32_SUBNORMAL),
    }
}

impl Recipe {
    /// The recipe named `name` (case-insensitive), or an error naming the `recipe` key.
    pub fn parse(name: &str) -> Result<Recipe, CaseError> {
        let wanted = name.trim().to_ascii_lowercase();
        let Some(&(_, storage, kind)) = KNOWN_RECIPES.iter().find(|(n, _, _)| *n == wanted) else {
            let known: Vec<&str> = KNOWN_RECIPES.iter().map(|r| r.0).collect();
            return Err(CaseError::Key {
                key: "recipe".into(),
                reason: format!("unknown recipe {name:?}; known: {}", known.join(", ")),
            });
        };
        let (unit_roundoff, subnormal) = storage_constants(storage);
        let u = F32_UNIT_ROUNDOFF;
        let flash = FlashRecipe {
            unit_roundoff,
            subnormal,
            // One key per tile and one extra merge: n_t = Lk + 1 rescales, at least the tiles
            // plus split-KV merges of any tiling with tiles of two or more keys.
            kv_tile: 1,
            extra_merges: 1,
            // The query side's partial sums come from the q_tile the checker passes (one query per tile).
            extra_query_partials: 0,
            // ex2.approx.f32 is within 2 ulp (5u, see attnproof_gpu::flash); libm expf within
            // 1 ulp. 8u covers both with margin.
            exp_error: 8.0 * u,
            // Arguments formed as s·c − fl(m·c) (FlashAttention 2/3, cuDNN) shift by ≤ u|m|;
            // a backward's fma(dot, c, −fl(LSE·log2 e)) by ≤ 1.23u|LSE| with an f32 log2 e
            // (its rounding multiplies LSE). 4u covers both.
            shift_rounding: 4.0 * u,
            // FlashAttention 2 and 3 build with --use_fast_math, whose exp2f flushes subnormal
            // results to zero: a lost probability of up to 2^-126 covers it and gradual underflow.
            exp_underflow: F32_MIN_NORMAL,
            // One product per "instruction": γ'_{2n} with u' = 2u dominates round-to-nearest
            // γ_n and every tensor-core MMA shape (k ≥ 1), and absorbs the two extra f32
            // roundings of the math backend's q·√α, k·√α.
            accumulation: Accumulation::TensorCore { k_step: 1 },
            score_reuse: ScoreReuse::Recomputed,
            score_storage_rounding: if kind == RecipeKind::MathReduced { unit_roundoff } else { 0.0 },
        };
        Ok(Recipe { name: wanted, storage, kind, flash, q_tile: 1 })
    }

    /// Whether the backward model covers this recipe's gradients (the reduced-precision math
    /// backward, autograd through bf16 matmuls and softmax, has no model).
    pub fn has_backward_model(&self) -> bool {
        self.kind != RecipeKind::MathReduced
    }
}
