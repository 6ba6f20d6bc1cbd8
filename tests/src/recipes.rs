//! Every precision recipe the harness judges a candidate under, in one place: the reference schedule's per storage
//! type and tile, the GPU kernels' forward and backward per tiling, the ring's (reference and GPU, forward and
//! backward, with their extra merges), and the conservative recipes of external kernels named in case files.
//!
//! A [`FlashRecipe`] states how a computation rounds (storage type, tiles, the `exp` and its argument, the
//! accumulation, score reuse); `attnproof_proofs::flash_bound` turns it into a bound. Writing each recipe once here
//! means that a kernel whose arithmetic changes has exactly one place where its model must change too, and that a
//! test cannot quietly judge a candidate under a recipe of its own making. Tests that perturb a recipe to show that
//! a bound term is needed start from one of these functions and change one field with struct update syntax.

use attnproof_gpu::backward::{BACKWARD_SHIFT_ROUNDING, BackwardTiling};
use attnproof_gpu::flash::{EXP_RELATIVE_ERROR, EXP_UNDERFLOW, KV_TILE, SHIFT_ROUNDING};
use attnproof_gpu::ring::gpu_ring_recipe_extra_merges;
use attnproof_proofs::flash_bound::{
    Accumulation, F32_MIN_NORMAL, F32_SUBNORMAL, F32_UNIT_ROUNDOFF, FlashRecipe, ScoreReuse,
};
use attnproof_reference::Element;
use attnproof_reference::ring::{RingConfig, RingSplit};

use crate::case::recipe::{ExpForm, KernelParams, RecipeKind};
use crate::case::safetensors::Dtype;

/// A backward recipe: the model's parameters and the query tile whose partial sums the dK/dV bound counts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackwardRecipe {
    /// The model's parameters.
    pub recipe: FlashRecipe,
    /// Query rows per tile (the partial-dQ count of `attnproof_proofs::flash_bound::backward_bounds`).
    pub q_tile: usize,
}

/// The recipe of the reference schedule for storage type `T` and KV tile `kv_tile`: libm's `exp`, the storage type's
/// unit roundoff and smallest subnormal.
pub fn reference<T: Element>(kv_tile: usize) -> FlashRecipe {
    FlashRecipe::libm(T::UNIT_ROUNDOFF, subnormal_of::<T>() as f64, kv_tile)
}

/// The smallest positive subnormal of `T`: the first power of two, from f32's smallest subnormal upward, that
/// survives rounding to `T`.
pub(crate) fn subnormal_of<T: Element>() -> f32 {
    let mut x = f32::from_bits(1);
    while T::round(x) == 0.0 {
        x *= 2.0;
    }
    T::round(x)
}

/// The forward kernel's recipe for `T` (every tiling: each row's operations do not depend on the CTA shape): the
/// reference's storage type and KV tile, with `ex2.approx`'s exp error, the shift rounding of `fl(m·log2 e)` and the
/// flush-to-zero `ex2`'s underflow (all justified in `attnproof_gpu::flash`).
pub fn gpu_forward<T: Element>() -> FlashRecipe {
    FlashRecipe {
        exp_error: EXP_RELATIVE_ERROR,
        shift_rounding: SHIFT_ROUNDING,
        exp_underflow: EXP_UNDERFLOW,
        // m16n8k16 MMAs: 16 products per instruction, aligned and truncated before the add.
        accumulation: Accumulation::TensorCore { k_step: 16 },
        ..reference::<T>(KV_TILE)
    }
}

/// The recipe of PISA's tail on the tensor cores (`attnproof_gpu::pisa::tail`'s `pisa_tail_merge`): the forward's,
/// over tiles of the pooled keys.
pub fn gpu_tail<T: Element>() -> FlashRecipe {
    FlashRecipe { kv_tile: attnproof_gpu::pisa::tail::POOLED_KEYS_PER_TILE, ..gpu_forward::<T>() }
}

/// The backward kernels' recipe for `T` in `tiling` (its KV tile is the size of the dQ partials; each parameter
/// justified in `attnproof_gpu::backward`), with the kernels' query tile.
pub fn gpu_backward<T: Element>(tiling: BackwardTiling) -> BackwardRecipe {
    let recipe = FlashRecipe {
        exp_error: attnproof_gpu::backward::EXP_RELATIVE_ERROR,
        shift_rounding: BACKWARD_SHIFT_ROUNDING,
        exp_underflow: attnproof_gpu::backward::EXP_UNDERFLOW,
        accumulation: Accumulation::TensorCore { k_step: 16 },
        // The backward forms Sᵀ = K Qᵀ with transposed MMAs: no bitwise reuse of the forward's scores.
        score_reuse: ScoreReuse::Recomputed,
        ..reference::<T>(tiling.kv_tile())
    };
    BackwardRecipe { recipe, q_tile: attnproof_gpu::backward::Q_TILE }
}

/// The reference ring schedule's recipe (forward and backward): the flash recipe of its tiles with the ring's extra
/// rescale steps per row, [`RingConfig::extra_merges`].
pub fn reference_ring<T: Element>(config: RingConfig) -> FlashRecipe {
    FlashRecipe { extra_merges: config.extra_merges(), ..reference::<T>(config.tiles.kv_tile) }
}

/// The GPU ring forward's recipe over `split` (a `RingConfig`'s `split()`): the forward kernel's with
/// `extra_merges = 2(P − 1)` for `P` key chunks per sequence (`attnproof_gpu::ring::gpu_ring_recipe_extra_merges`).
pub fn gpu_ring_forward<T: Element>(split: RingSplit) -> FlashRecipe {
    FlashRecipe { extra_merges: gpu_ring_recipe_extra_merges(split), ..gpu_forward::<T>() }
}

/// The GPU ring backward's recipe over `split`: the backward kernels' in the default tiling with the pair partials and their f32
/// sums counted, `extra_merges = extra_query_partials = 2(P − 1)` (dQ over key chunks, dK and dV over query chunks).
pub fn gpu_ring_backward<T: Element>(split: RingSplit) -> BackwardRecipe {
    let extra = gpu_ring_recipe_extra_merges(split);
    let base = gpu_backward::<T>(BackwardTiling::DEFAULT);
    BackwardRecipe {
        recipe: FlashRecipe { extra_merges: extra, extra_query_partials: extra, ..base.recipe },
        q_tile: base.q_tile,
    }
}

/// Unit roundoff and smallest positive subnormal of a case file's storage type.
pub fn storage_constants(storage: Dtype) -> (f64, f64) {
    match storage {
        Dtype::Bf16 => (2f64.powi(-8), 2f64.powi(-133)),
        Dtype::F16 => (2f64.powi(-11), 2f64.powi(-24)),
        _ => (F32_UNIT_ROUNDOFF, F32_SUBNORMAL),
    }
}

/// TF32's unit roundoff as the model uses it: `2^-10`, the relative error of truncating an f32 to TF32's 10 fraction
/// bits (the tensor cores' own conversion; rounding to nearest, `cvt.rna.tf32.f32`, halves it).
pub const TF32_UNIT_ROUNDOFF: f64 = 1.0 / 1024.0;

/// The recipe of an external kernel (a case file's `recipe`) with storage type `storage` computing as `kind`, under
/// the kernel parameters the case states, and the query tile to count its partial sums with. An unstated parameter
/// (tiles, exponential, MMA shape, split count) is set to the value that makes the bound largest over the kernels the
/// recipe covers; a stated one replaces it (the argument for each is in `docs/case-format.md`).
pub fn external(storage: Dtype, kind: RecipeKind, params: KernelParams) -> BackwardRecipe {
    let (storage_roundoff, subnormal) = storage_constants(storage);
    let u = F32_UNIT_ROUNDOFF;
    let (kv_tile, extra_merges) = match (params.kv_tile, params.split_kv) {
        // One key per tile and one extra merge: n_t = Lk + 1 rescales, at least the tiles plus split-KV merges of
        // any tiling with tiles of two or more keys.
        (None, None) => (1, 1),
        // `s` pieces: each extra piece may start a partial tile and adds a merge.
        (tile, Some(splits)) => (tile.unwrap_or(1), 2 * (splits - 1)),
        // At most one split per tile, on tile boundaries: n_t ≤ 2⌈Lk/t⌉. Counting tiles of ⌊t/2⌋ keys plus one merge
        // covers it, as ⌈Lk/⌊t/2⌋⌉ ≥ ⌈2Lk/t⌉ ≥ 2⌈Lk/t⌉ − 1 (a stated tile of one key needs its split count).
        (Some(tile), None) => ((tile / 2).max(1), 1),
    };
    // ex2.approx.f32 is within 2 ulp (5u, see attnproof_gpu::flash); an expf within 1 ulp is within 2u. Unstated, 8u
    // covers both with margin. Arguments formed as s·c − fl(m·c) (FlashAttention 2/3, cuDNN) shift by ≤ u|m|; a
    // backward's fma(dot, c, −fl(LSE·log2 e)) by ≤ 1.23u|LSE| with an f32 log2 e (its rounding multiplies LSE): 4u
    // covers both. An expf of fl(s − m) has no shift rounding (the subtraction's is in the model's 2u|s − m|).
    let (exp_error, shift_rounding) = match params.exp {
        None => (8.0 * u, 4.0 * u),
        Some(ExpForm::Exp2Approx) => (EXP_RELATIVE_ERROR, 4.0 * u),
        Some(ExpForm::Expf) => (2.0 * u, 0.0),
    };
    // TF32 rounds q and k before the score's products (each product moves by at most (1 + ε)² − 1 ≤ 3ε relative, the
    // model's score-storage term) and P and v before PV (the numerator's products by at most 3ε, charged as the
    // storage rounding of P: u_T = 3ε, which also over-covers the f32 output's own rounding).
    let (unit_roundoff, score_storage_rounding) = match kind {
        RecipeKind::Tf32 => (3.0 * TF32_UNIT_ROUNDOFF, TF32_UNIT_ROUNDOFF),
        RecipeKind::MathReduced => (storage_roundoff, storage_roundoff),
        RecipeKind::Fused | RecipeKind::MathF32 => (storage_roundoff, 0.0),
    };
    let recipe = FlashRecipe {
        unit_roundoff,
        subnormal,
        kv_tile,
        extra_merges,
        // The kernel may visit every key's tile.
        visited_tiles: None,
        // The query side's partial sums come from the q_tile below.
        extra_query_partials: 0,
        exp_error,
        shift_rounding,
        // FlashAttention 2 and 3 build with --use_fast_math, whose exp2f flushes subnormal results to zero: a lost
        // probability of up to 2^-126 covers it and gradual underflow.
        exp_underflow: F32_MIN_NORMAL,
        // One product per "instruction" unless stated: γ'_{2n} with u' = 2u dominates round-to-nearest γ_n and every
        // tensor-core MMA shape (k ≥ 1), and absorbs the two extra f32 roundings of the math backend's q·√α, k·√α.
        accumulation: Accumulation::TensorCore { k_step: params.mma_k.unwrap_or(1) },
        score_reuse: ScoreReuse::Recomputed,
        score_storage_rounding,
        // A peer's dK and dV are taken as owned by one worker per key (FlashAttention 2's, and 3's without GQA).
        atomic_kv_sums: false,
    };
    BackwardRecipe { recipe, q_tile: params.q_tile.unwrap_or(1) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// The storage constants agree with the reference's element types, so that a case file in bf16 or f16 is judged
    /// with the unit roundoff and subnormal of the type our own schedules use.
    #[test]
    fn storage_constants_match_the_element_types() {
        let bf = reference::<bf16>(16);
        assert_eq!(storage_constants(Dtype::Bf16), (bf.unit_roundoff, bf.subnormal));
        let f = reference::<f16>(16);
        assert_eq!(storage_constants(Dtype::F16), (f.unit_roundoff, f.subnormal));
    }

    /// Each GPU recipe differs from the reference's in exactly the parameters its kernel changes, and the ring
    /// recipes only add merges: a recipe that silently fell back to another would make these fail.
    #[test]
    fn gpu_and_ring_recipes_change_only_their_parameters() {
        let fwd = gpu_forward::<bf16>();
        assert_eq!(fwd.kv_tile, KV_TILE);
        assert_eq!(fwd.exp_error, EXP_RELATIVE_ERROR);
        assert_eq!(fwd.accumulation, Accumulation::TensorCore { k_step: 16 });
        assert_ne!(fwd, reference::<bf16>(KV_TILE));
        for tiling in BackwardTiling::ALL {
            let bwd = gpu_backward::<f16>(tiling);
            assert_eq!(bwd.recipe.kv_tile, tiling.kv_tile());
            assert_eq!(bwd.recipe.shift_rounding, BACKWARD_SHIFT_ROUNDING);
            assert_eq!(bwd.q_tile, attnproof_gpu::backward::Q_TILE);
        }
        let config = RingConfig {
            n_devices: 3,
            layout: attnproof_reference::ring::RingLayout::Zigzag,
            tiles: attnproof_reference::TileConfig { q_tile: 8, kv_tile: 8 },
        };
        let ring = reference_ring::<bf16>(config);
        assert_eq!(ring, FlashRecipe { extra_merges: config.extra_merges(), ..reference::<bf16>(8) });
        assert!(ring.extra_merges > 0);
        let gpu_ring = gpu_ring_backward::<bf16>(config.split());
        assert_eq!(gpu_ring.recipe.extra_merges, gpu_ring.recipe.extra_query_partials);
        assert!(gpu_ring.recipe.extra_merges > 0);
        assert_eq!(gpu_ring_forward::<bf16>(config.split()).extra_merges, gpu_ring.recipe.extra_merges);
    }

    /// Every stated kernel parameter tightens the external recipe's bound or leaves it as it was, element by element,
    /// forward and backward: a stated value is never looser than the worst case it replaces.
    #[test]
    fn stated_kernel_parameters_never_widen_the_bound() {
        use crate::backward::problem_backward_bounds_with_visibility;
        use crate::flash::problem_forward_bounds;
        use crate::generate::{Distribution, ValueProfile, make_case, make_d_out};
        use attnproof_oracle::AttentionSpec;
        use attnproof_oracle::spec::Sequence;
        let spec = AttentionSpec::dense(1, 2, 1, 9, 70, 8, 8);
        let profile = ValueProfile { distribution: Distribution::Gaussian, logit_scale: 2.0, value_mean: 0.0 };
        let [q, k, v] = make_case::<bf16>(&spec, profile, 3).widened();
        let g = make_d_out::<bf16>(&spec, 4).mapv(|x| x.to_f64());
        let vis = |seq: &Sequence, _h: usize| spec.mask.matrix(seq.len_q, seq.len_k);
        let bounds = |params: KernelParams| {
            let r = external(Dtype::Bf16, RecipeKind::Fused, params);
            let f = problem_forward_bounds(&spec, &q, &k, &v, r.recipe).expect("forward model");
            let b = problem_backward_bounds_with_visibility(&spec, [&q, &k, &v, &g], &vis, r.recipe, r.q_tile)
                .expect("backward model");
            [f.bound_o, f.bound_lse, b.bound_dq, b.bound_dk, b.bound_dv]
        };
        let worst = bounds(KernelParams::default());
        let stated = [
            KernelParams { kv_tile: Some(2), ..KernelParams::default() },
            KernelParams { kv_tile: Some(64), ..KernelParams::default() },
            KernelParams { kv_tile: Some(16), split_kv: Some(4), ..KernelParams::default() },
            KernelParams { split_kv: Some(1), ..KernelParams::default() },
            KernelParams { q_tile: Some(64), ..KernelParams::default() },
            KernelParams { mma_k: Some(16), ..KernelParams::default() },
            KernelParams { exp: Some(ExpForm::Exp2Approx), ..KernelParams::default() },
            KernelParams { exp: Some(ExpForm::Expf), ..KernelParams::default() },
        ];
        for params in stated {
            let tighter = bounds(params);
            for (name, (t, w)) in ["O", "LSE", "dQ", "dK", "dV"].iter().zip(tighter.iter().zip(&worst)) {
                ndarray::Zip::from(t).and(w).for_each(|t, w| assert!(t <= w, "{params:?}: {name} bound {t} > {w}"));
            }
            // Two-key tiles with up to one split each count as many rescales as the unstated worst case.
            if params.kv_tile != Some(2) {
                assert_ne!(tighter, worst, "{params:?} changes no bound");
            }
        }
    }

    /// The TF32 recipe charges TF32's rounding where TF32 rounds: the score term and the storage rounding of `P`
    /// (which `v`'s rounding shares), with f32's subnormal and no backward model.
    #[test]
    fn the_tf32_recipe_charges_tf32_roundings() {
        let tf32 = external(Dtype::F32, RecipeKind::Tf32, KernelParams::default()).recipe;
        let f32 = external(Dtype::F32, RecipeKind::Fused, KernelParams::default()).recipe;
        assert_eq!(tf32.score_storage_rounding, TF32_UNIT_ROUNDOFF);
        assert_eq!(tf32.unit_roundoff, 3.0 * TF32_UNIT_ROUNDOFF);
        assert_eq!(FlashRecipe { unit_roundoff: f32.unit_roundoff, score_storage_rounding: 0.0, ..tf32 }, f32);
    }
}
