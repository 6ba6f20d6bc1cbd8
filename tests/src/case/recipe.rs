//! Precision recipes of external kernels, by name: the names a case file may give and the
//! conservative [`FlashRecipe`] each selects (its values live in [`crate::recipes::external`],
//! with every other recipe the harness uses).

use attnproof_proofs::flash_bound::FlashRecipe;

use super::error::CaseError;
use super::safetensors::Dtype;
use crate::recipes::{self, BackwardRecipe};

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
        let BackwardRecipe { recipe: flash, q_tile } = recipes::external(storage, kind);
        Ok(Recipe { name: wanted, storage, kind, flash, q_tile })
    }

    /// Whether the backward model covers this recipe's gradients (the reduced-precision math
    /// backward, autograd through bf16 matmuls and softmax, has no model).
    pub fn has_backward_model(&self) -> bool {
        self.kind != RecipeKind::MathReduced
    }
}
