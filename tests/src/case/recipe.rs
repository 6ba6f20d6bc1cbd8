//! Precision recipes of external kernels, by name, and the kernel parameters a case may state: the names a case file
//! may give and the [`FlashRecipe`] each selects (its values live in [`crate::recipes::external`], with every other
//! recipe the harness uses). A parameter the case does not state is set to its worst case over every kernel the
//! recipe covers; a stated one replaces it, and the report lists which were stated.

use std::collections::BTreeMap;
use std::fmt;

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
    /// A fused kernel on f32 inputs whose MMAs run in TF32 (PyTorch's `allow_tf32`, cuBLAS's
    /// `CUBLAS_TF32_TENSOR_OP_MATH`): `q`, `k`, `P` and `v` enter the products with 10 fraction bits,
    /// the sums stay f32.
    Tf32,
    /// PyTorch's math SDPA with its default upcast: inputs widened to f32, `q·√α` and `k·√α`
    /// in f32, f32 matmuls and softmax, the output rounded to the storage type.
    MathF32,
    /// PyTorch's math SDPA with `allow_fp16_bf16_reduction_math_sdp(True)`: `q·√α`, `k·√α`, the
    /// scores and the probabilities rounded to the storage type, f32 accumulation inside the
    /// matmuls.
    MathReduced,
}

/// How the candidate forms its exponentials (`kernel_exp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpForm {
    /// `ex2.approx` of an argument formed as `s·log2 e − fl(m·log2 e)` (FlashAttention 2 and 3, cuDNN, attnproof's
    /// kernels): within 2 ulp, subnormal results flushed to zero.
    Exp2Approx,
    /// An `expf` within 1 ulp of `exp(fl(s − m))` (libm, SLEEF, PyTorch's CPU kernels).
    Expf,
}

impl ExpForm {
    /// The metadata spelling.
    pub fn name(self) -> &'static str {
        match self {
            ExpForm::Exp2Approx => "ex2",
            ExpForm::Expf => "expf",
        }
    }
}

/// The kernel's real parameters, as far as a case states them (`kernel_*` metadata; `None`: not stated, the bound
/// takes the worst case over every kernel).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelParams {
    /// Keys per KV tile (`kernel_kv_tile`).
    pub kv_tile: Option<usize>,
    /// Query rows per tile of the backward (`kernel_q_tile`).
    pub q_tile: Option<usize>,
    /// Products per MMA instruction along a reduction (`kernel_mma_k`: 16 for bf16/f16 `m16n8k16`, 8 for TF32
    /// `m16n8k8`).
    pub mma_k: Option<usize>,
    /// The exponential (`kernel_exp`).
    pub exp: Option<ExpForm>,
    /// Pieces a row's keys are split into and merged from (`kernel_split_kv`, 1: no split).
    pub split_kv: Option<usize>,
}

/// The metadata keys of [`KernelParams`], in report order.
pub const KERNEL_PARAM_KEYS: [&str; 5] =
    ["kernel_kv_tile", "kernel_q_tile", "kernel_mma_k", "kernel_exp", "kernel_split_kv"];

impl KernelParams {
    /// The parameters stated in `metadata`, each checked: a positive integer, or for `kernel_exp` one of `ex2`,
    /// `expf`. An empty value or `unknown` states nothing.
    pub fn from_metadata(metadata: &BTreeMap<String, String>) -> Result<KernelParams, CaseError> {
        let value = |key: &str| {
            metadata.get(key).map(|v| v.trim().to_ascii_lowercase()).filter(|v| !v.is_empty() && v != "unknown")
        };
        let count = |key: &str| -> Result<Option<usize>, CaseError> {
            let Some(text) = value(key) else { return Ok(None) };
            match text.parse::<usize>() {
                Ok(n) if n > 0 => Ok(Some(n)),
                _ => Err(CaseError::Key {
                    key: key.into(),
                    reason: format!("expected a positive integer, got {text:?}"),
                }),
            }
        };
        let exp = match value("kernel_exp").as_deref() {
            None => None,
            Some("ex2" | "exp2" | "ex2.approx") => Some(ExpForm::Exp2Approx),
            Some("expf" | "exp") => Some(ExpForm::Expf),
            Some(other) => {
                return Err(CaseError::Key {
                    key: "kernel_exp".into(),
                    reason: format!(
                        "expected ex2 (ex2.approx of s·log2 e − m·log2 e) or expf (exp of s − m), got {other:?}"
                    ),
                });
            }
        };
        let params = KernelParams {
            kv_tile: count("kernel_kv_tile")?,
            q_tile: count("kernel_q_tile")?,
            mma_k: count("kernel_mma_k")?,
            exp,
            split_kv: count("kernel_split_kv")?,
        };
        if params.kv_tile == Some(1) && params.split_kv.is_none() {
            return Err(CaseError::Key {
                key: "kernel_split_kv".into(),
                reason: "needed with kernel_kv_tile 1: the default assumption of at most one split per tile covers \
                         tiles of two or more keys only"
                    .into(),
            });
        }
        Ok(params)
    }

    /// One phrase per parameter saying what the bound assumed: the stated value, or the worst case.
    pub fn assumptions(&self) -> Vec<String> {
        let stated = |name: &str, value: Option<String>, worst: &str| match value {
            Some(v) => format!("{name} {v} (stated)"),
            None => format!("{name} {worst}"),
        };
        vec![
            stated("kv_tile", self.kv_tile.map(|t| t.to_string()), "1 (worst case)"),
            stated("q_tile", self.q_tile.map(|t| t.to_string()), "1 (worst case)"),
            stated("mma_k", self.mma_k.map(|k| k.to_string()), "1 (worst case)"),
            stated("exp", self.exp.map(|e| e.name().to_string()), "worst of ex2 and expf"),
            stated(
                "split_kv",
                self.split_kv.map(|s| s.to_string()),
                if self.kv_tile.is_some() { "up to one per KV tile (worst case)" } else { "any (worst case)" },
            ),
        ]
    }

    /// Whether the case states any parameter.
    pub fn any_stated(&self) -> bool {
        *self != KernelParams::default()
    }
}

impl fmt::Display for KernelParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.assumptions().join(", "))
    }
}

/// A recipe: the name as written in the case file, the input type it implies, the kernel's stated parameters and
/// the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Recipe {
    /// The `recipe` metadata value.
    pub name: String,
    /// Storage type of the inputs and outputs.
    pub storage: Dtype,
    /// Which computation.
    pub kind: RecipeKind,
    /// The kernel's parameters the case states.
    pub params: KernelParams,
    /// The bound model's parameters.
    pub flash: FlashRecipe,
    /// Query rows per tile for the backward's partial-dQ count (1: any tiling).
    pub q_tile: usize,
}

/// The recipe names `cargo xtask check` understands.
pub const KNOWN_RECIPES: [(&str, Dtype, RecipeKind); 8] = [
    ("bf16-in/f32-acc/p-bf16", Dtype::Bf16, RecipeKind::Fused),
    ("f16-in/f32-acc/p-f16", Dtype::F16, RecipeKind::Fused),
    ("f32-in/f32-acc", Dtype::F32, RecipeKind::Fused),
    ("f32-in/tf32", Dtype::F32, RecipeKind::Tf32),
    ("bf16-in/f32-math", Dtype::Bf16, RecipeKind::MathF32),
    ("f16-in/f32-math", Dtype::F16, RecipeKind::MathF32),
    ("bf16-in/bf16-math", Dtype::Bf16, RecipeKind::MathReduced),
    ("f16-in/f16-math", Dtype::F16, RecipeKind::MathReduced),
];

impl Recipe {
    /// The recipe named `name` (case-insensitive) with no kernel parameters stated, or an error naming the `recipe`
    /// key.
    pub fn parse(name: &str) -> Result<Recipe, CaseError> {
        Recipe::with_params(name, KernelParams::default())
    }

    /// The recipe named `name` for a kernel with the stated `params`.
    pub fn with_params(name: &str, params: KernelParams) -> Result<Recipe, CaseError> {
        let wanted = name.trim().to_ascii_lowercase();
        let Some(&(_, storage, kind)) = KNOWN_RECIPES.iter().find(|(n, _, _)| *n == wanted) else {
            let known: Vec<&str> = KNOWN_RECIPES.iter().map(|r| r.0).collect();
            return Err(CaseError::Key {
                key: "recipe".into(),
                reason: format!("unknown recipe {:?}; known: {}", name.trim(), known.join(", ")),
            });
        };
        Ok(Recipe::of(wanted, storage, kind, params))
    }

    /// The recipe of `kind` on `storage` under `params`, named `name`.
    pub fn of(name: String, storage: Dtype, kind: RecipeKind, params: KernelParams) -> Recipe {
        let BackwardRecipe { recipe: flash, q_tile } = recipes::external(storage, kind, params);
        Recipe { name, storage, kind, params, flash, q_tile }
    }

    /// Whether the backward model covers this recipe's gradients (the reduced-precision math
    /// backward, autograd through bf16 matmuls and softmax, and the TF32 backward, whose products
    /// round `dO`, `Q`, `K` and `V` too, have none).
    pub fn has_backward_model(&self) -> bool {
        !matches!(self.kind, RecipeKind::MathReduced | RecipeKind::Tf32)
    }
}
