//! Sparse attention schedules: block-sparse forward/backward over `−1`-padded per-query-tile KV
//! tile lists with the backward through the lists' CSR transpose (E14, E20), DSA token-gather
//! forward (E16), the NSA selection branch forward/backward with the `G` query heads of a KV
//! group sharing each selected block tile (E18–E20), and PISA's first-order tail over pooled keys
//! (E22, [`pisa`], which adds storage-type statistics and an f64 merge to this recipe).
//!
//! # Precision recipe (all schedules)
//!
//! The recipe of [`crate::flash`] and [`crate::backward`], unchanged: inputs in the storage type
//! `T`, widened to f32; scores `s = α̂ (q·k)` with an f32 dot product left to right over `d` and
//! `α̂ = fl32(α)`; online softmax `(m, ℓ, A)` in f32, one rescale per visited tile, `ℓ` summing the
//! f32 `p`, `A` accumulating `round_T(p)·v`; `O = round_T(A/ℓ)`, `LSE = m + ln ℓ` in f32, `O = 0`
//! and `LSE = −∞` for a row that sees nothing (E1c). Backward: `D = rowsum(dO ∘ O)` in f32,
//! `P = exp(s − LSE)` in f32, `dV += round_T(P)ᵀ dO`, `dS = round_T(P ∘ (dP − D))`,
//! `dQ += dS K`, `dK += dSᵀ Q` in f32 (one accumulator per query head), `dQ, dK ← α̂·(…)`,
//! per-head dK/dV summed over a KV group in ascending head order, every gradient rounded to `T`.
//!
//! The only departure from the dense schedules is which tiles a row visits, and a sparse row
//! visits at most as many tiles (and sums at most as many terms) as the dense one, so the dense
//! rounding-error model of `attnproof-proofs` (`flash_bound`) bounds these schedules with the
//! KV tile of the schedule (block-sparse: `kv_tile`; DSA: the gather chunk; NSA: the selection
//! block) and no extra merges.

pub mod block;
pub mod dsa;
pub mod hils;
pub mod nsa;
pub mod pisa;

pub use block::{block_sparse_backward, block_sparse_forward, transpose_lists};
pub use dsa::{DsaConfig, DsaInputs, DsaOutputs, dsa_forward};
pub use nsa::{
    SelectionBackwardInputs, SelectionConfig, SelectionGradients, SelectionInputs, SelectionOutputs,
    nsa_selection_backward, nsa_selection_forward,
};

use attnproof_oracle::{OracleError, Scale};
use ndarray::{ArrayBase, Data, Dimension};

use crate::element::Element;
use crate::error::ReferenceError;

/// The f32 online-softmax state `(m, ℓ, A)` of one query row (E2), updated one tile at a time
/// with exactly the arithmetic of the dense forward tile, so that a schedule visiting the same
/// tiles in the same order gives the same bits.
#[derive(Clone, Debug)]
pub(crate) struct RowState {
    m: f32,
    l: f32,
    acc: Vec<f32>,
}

impl RowState {
    pub(crate) fn new(dv: usize) -> Self {
        RowState { m: f32::NEG_INFINITY, l: 0.0, acc: vec![0.0; dv] }
    }

    /// One tile: `s[j]` the scaled scores (`−∞` where masked), `v(j, c)` the tile's values.
    pub(crate) fn update<T: Element>(&mut self, s: &[f32], v: impl Fn(usize, usize) -> f32) {
        let m_new = s.iter().fold(self.m, |a, &b| a.max(b));
        if m_new == f32::NEG_INFINITY {
            return; // nothing visible yet: the state stays empty
        }
        let rescale = if self.m == f32::NEG_INFINITY { 0.0 } else { (self.m - m_new).exp() };
        let p: Vec<f32> = s.iter().map(|&x| if x == f32::NEG_INFINITY { 0.0 } else { (x - m_new).exp() }).collect();
        self.l = rescale * self.l + p.iter().sum::<f32>();
        for (c, a) in self.acc.iter_mut().enumerate() {
            // The PV product takes P in the storage type, as the tensor-core GEMM does.
            let pv = p.iter().enumerate().fold(0f32, |acc, (j, &pj)| acc + T::round(pj) * v(j, c));
            *a = rescale * *a + pv;
        }
        self.m = m_new;
    }

    /// `(O, LSE)` of the row: `O = round_T(A/ℓ)`, `LSE = m + ln ℓ`; `(0, −∞)` if nothing was seen.
    pub(crate) fn finish<T: Element>(&self) -> (Vec<f32>, f32) {
        if self.l > 0.0 {
            (self.acc.iter().map(|a| T::round(a / self.l)).collect(), self.m + self.l.ln())
        } else {
            (vec![0.0; self.acc.len()], f32::NEG_INFINITY)
        }
    }
}

/// `Σ_c a_c b_c` in f32, left to right (one MMA chain).
pub(crate) fn dot32<'a>(a: impl IntoIterator<Item = &'a f32>, b: impl IntoIterator<Item = &'a f32>) -> f32 {
    a.into_iter().zip(b).fold(0f32, |acc, (x, y)| acc + x * y)
}

/// `fl32(α)` for head dimension `head_dim`, rejecting a non-finite explicit scale.
pub(crate) fn scale32(scale: Scale, head_dim: usize) -> Result<f32, ReferenceError> {
    scale.check()?;
    Ok(match scale {
        Scale::InverseSqrtHeadDim => 1.0 / (head_dim as f32).sqrt(),
        Scale::Value(x) => x as f32,
    })
}

/// A typed error unless `t` has shape `expected`.
pub(crate) fn check_shape(argument: &'static str, actual: &[usize], expected: &[usize]) -> Result<(), ReferenceError> {
    Ok(attnproof_oracle::error::check_shape(argument, actual, expected)?)
}

/// A typed error at the first non-finite entry of `t`.
pub(crate) fn check_finite<T: Element, A: Data<Elem = T>, D: Dimension>(
    argument: &'static str,
    t: &ArrayBase<A, D>,
) -> Result<(), ReferenceError> {
    let t = t.view().into_dyn();
    match t.indexed_iter().find(|(_, x)| !x.to_f32().is_finite()) {
        Some((index, value)) => {
            Err(OracleError::NonFinite { argument, index: index.slice().to_vec(), value: value.to_f32() as f64 }.into())
        }
        None => Ok(()),
    }
}
