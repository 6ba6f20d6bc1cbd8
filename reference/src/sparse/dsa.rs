//! DSA token-gather forward (E16): query token `t` gathers the rows of its selected tokens
//! (one selection `[T, κ]` per token, shared by all `H` heads: DSA's MQA-style main attention)
//! into a dense tile, and all heads run the FlashAttention online softmax over that gathered
//! tile, `kv_tile` gathered keys at a time.
//!
//! Layout of the oracle's `attnproof_oracle::dsa::token_sparse_attention` (one sequence): queries
//! `[T, H, d]`, shared keys `[T, d]` and values `[T, dv]`, outputs `[T, H, dv]`, LSE `[H, T]`.
//! Selections follow the E14/E16 convention (`i32`, valid prefix ascending without duplicates,
//! `−1` padded) and are causal (`s ≤ t`); anything else is a typed error.
//!
//! Precision recipe: that of [`crate::sparse`]. A row's keys are its selected tokens, visited in
//! selection order in chunks of `kv_tile`: `⌈κ/kv_tile⌉ ≤ ⌈T/kv_tile⌉` rescales and at most
//! `κ ≤ T` summed terms, so the dense model with `Lk = T` and this `kv_tile` bounds it.

use attnproof_oracle::topk::validate_index_row;
use attnproof_oracle::{OracleError, Scale};
use ndarray::{Array2, ArrayView2, ArrayView3, ArrayViewMut2, ArrayViewMut3, Axis};
use rayon::prelude::*;

use crate::element::Element;
use crate::error::ReferenceError;
use crate::sparse::{RowState, check_finite, check_shape, dot32, scale32};

/// Inputs of the DSA token-gather forward, in the storage type.
#[derive(Clone, Debug)]
pub struct DsaInputs<'a, T> {
    /// Queries `[T, H, d]`.
    pub query: ArrayView3<'a, T>,
    /// Shared keys `[T, d]`.
    pub key: ArrayView2<'a, T>,
    /// Shared values `[T, dv]`.
    pub value: ArrayView2<'a, T>,
    /// Selected tokens `[T, κ]`, shared by all heads of a query.
    pub selection: ArrayView2<'a, i32>,
}

/// Tiling and scale of the DSA forward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DsaConfig {
    /// Gathered keys per online-softmax step (the kernel's KV tile over the gathered tile).
    pub kv_tile: usize,
    /// Softmax scale `α`.
    pub scale: Scale,
}

impl Default for DsaConfig {
    fn default() -> Self {
        DsaConfig { kv_tile: 64, scale: Scale::InverseSqrtHeadDim }
    }
}

/// Caller-owned outputs of the DSA forward.
#[derive(Debug)]
pub struct DsaOutputs<'a, T> {
    /// `O` `[T, H, dv]`.
    pub o: ArrayViewMut3<'a, T>,
    /// Natural-log LSE `[H, T]` (f32), `−∞` for a query that selected nothing.
    pub lse: ArrayViewMut2<'a, f32>,
}

/// DSA token-gather forward into caller-owned outputs, parallel over query tokens.
pub fn dsa_forward<T: Element>(
    inputs: &DsaInputs<'_, T>,
    config: DsaConfig,
    out: DsaOutputs<'_, T>,
) -> Result<(), ReferenceError> {
    if config.kv_tile == 0 {
        return Err(ReferenceError::ZeroTile { argument: "kv_tile" });
    }
    let (len, n_heads, head_dim) = inputs.query.dim();
    if n_heads == 0 {
        return Err(OracleError::ZeroDimension { argument: "n_heads" }.into());
    }
    if head_dim == 0 {
        return Err(OracleError::ZeroDimension { argument: "head_dim" }.into());
    }
    let head_dim_v = inputs.value.ncols();
    if head_dim_v == 0 {
        return Err(OracleError::ZeroDimension { argument: "head_dim_v" }.into());
    }
    check_shape("key", inputs.key.shape(), &[len, head_dim])?;
    check_shape("value", inputs.value.shape(), &[len, head_dim_v])?;
    check_shape("selection", inputs.selection.shape(), &[len, inputs.selection.ncols()])?;
    check_finite("query", &inputs.query)?;
    check_finite("key", &inputs.key)?;
    check_finite("value", &inputs.value)?;
    let DsaOutputs { mut o, mut lse } = out;
    check_shape("o", o.shape(), &[len, n_heads, head_dim_v])?;
    check_shape("lse", lse.shape(), &[n_heads, len])?;
    let scale = scale32(config.scale, head_dim)?;
    let mut selected = Vec::with_capacity(len);
    for t in 0..len {
        let row = validate_index_row("selection", t, &inputs.selection.row(t).to_vec(), len)?;
        if let Some(slot) = row.iter().position(|&s| s > t) {
            return Err(OracleError::IndexList {
                argument: "selection",
                position: vec![t, slot],
                reason: format!("key {} is after query {t}", row[slot]),
            }
            .into());
        }
        selected.push(row);
    }
    let widen = |x: &T| x.to_f32();
    let rows: Vec<(Array2<f32>, Vec<f32>)> = (0..len)
        .into_par_iter()
        .map(|t| {
            // The gather: the selected rows of K and V become one dense tile, shared by all heads.
            let keys = inputs.key.select(Axis(0), &selected[t]).mapv(|x| widen(&x));
            let values = inputs.value.select(Axis(0), &selected[t]).mapv(|x| widen(&x));
            let q = inputs.query.index_axis(Axis(0), t).mapv(|x| widen(&x));
            let mut states = vec![RowState::new(head_dim_v); n_heads];
            let kappa = keys.nrows();
            for start in (0..kappa).step_by(config.kv_tile) {
                let chunk = start..(start + config.kv_tile).min(kappa);
                for (h, state) in states.iter_mut().enumerate() {
                    let s: Vec<f32> = chunk.clone().map(|j| dot32(q.row(h), keys.row(j)) * scale).collect();
                    state.update::<T>(&s, |jj, c| values[[chunk.start + jj, c]]);
                }
            }
            let mut o_t = Array2::<f32>::zeros((n_heads, head_dim_v));
            let mut lse_t = vec![f32::NEG_INFINITY; n_heads];
            for (h, state) in states.iter().enumerate() {
                let (o_row, l) = state.finish::<T>();
                o_t.row_mut(h).iter_mut().zip(o_row).for_each(|(a, b)| *a = b);
                lse_t[h] = l;
            }
            (o_t, lse_t)
        })
        .collect();
    for (t, (o_t, lse_t)) in rows.into_iter().enumerate() {
        o.index_axis_mut(Axis(0), t).zip_mut_with(&o_t, |a, &b| *a = T::from_f32(b));
        lse.column_mut(t).iter_mut().zip(lse_t).for_each(|(a, b)| *a = b);
    }
    Ok(())
}
