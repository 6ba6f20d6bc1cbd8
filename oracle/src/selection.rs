//! Splitting a row's keys into blocks (E12), into an exact set and an omitted set (E13), and
//! what dropping the omitted mass does (E17): `λ`, `o_E`, `o_U` and the exact error identity of
//! drop-and-renormalize.

use std::ops::Range;

use ndarray::{Array1, Array2, ArrayView1, ArrayView2};

use crate::online::SoftmaxState;
use crate::real::Real;

/// E12: contiguous blocks of `block_size` keys covering `0..n_keys`; the last block holds the
/// remainder. Panics on `block_size = 0` (a programming error, not user input: callers validate
/// sizes first).
pub fn key_blocks(n_keys: usize, block_size: usize) -> Vec<Range<usize>> {
    assert!(block_size > 0, "key_blocks: block size must be positive");
    (0..n_keys.div_ceil(block_size)).map(|b| b * block_size..((b + 1) * block_size).min(n_keys)).collect()
}

/// E12 for one row: the online-softmax state `(m_b, ℓ_b, A_b)` of every block, i.e. the block's
/// mass `Z_b = e^{m_b} ℓ_b` and numerator `N_b = e^{m_b} A_b` without ever forming `e^{m_b}`.
pub fn block_states<S: Real>(
    scores: ArrayView1<'_, S>,
    visible: ArrayView1<'_, bool>,
    v: ArrayView2<'_, S>,
    blocks: &[Range<usize>],
    ctx: S::Ctx,
) -> Vec<SoftmaxState<S>> {
    blocks
        .iter()
        .map(|r| {
            let s = Array2::from_shape_fn((1, r.len()), |(_, j)| scores[r.start + j].clone());
            let vis = Array2::from_shape_fn((1, r.len()), |(_, j)| visible[r.start + j]);
            let rows = v.slice_axis(ndarray::Axis(0), ndarray::Slice::from(r.clone()));
            SoftmaxState::of_block(s.view(), vis.view(), rows, ctx)
        })
        .collect()
}

/// How the exact set of a query is formed (E13).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExactSetConfig {
    /// Keys per selection block.
    pub block_size: usize,
    /// Keys of the mandatory local window: the `local_window` keys ending at the query's aligned
    /// position (bottom-right alignment of E1a); 0 for none.
    pub local_window: usize,
}

/// E13: the exact set `E_i` of one query — the keys of its selected blocks plus its local
/// window — intersected with the keys visible to it (`A_i`). The omitted set is `A_i \ E_i`.
pub fn exact_set(
    visible: ArrayView1<'_, bool>,
    aligned_query: i64,
    selected_blocks: &[usize],
    config: ExactSetConfig,
) -> Array1<bool> {
    Array1::from_shape_fn(visible.len(), |j| {
        let in_block = selected_blocks.contains(&(j / config.block_size.max(1)));
        let offset = aligned_query - j as i64;
        // A window of 0 keys is the empty range: no key is in it.
        let in_window = (0..config.local_window as i64).contains(&offset);
        visible[j] && (in_block || in_window)
    })
}

/// The E17 decomposition of one query row.
#[derive(Clone, Debug, PartialEq)]
pub struct MassDecomposition<S> {
    /// Dense output `o = λ o_E + (1 − λ) o_U`.
    pub dense: Array1<S>,
    /// Output over the selected keys alone, `N_E / Z_E` (what drop-and-renormalize returns).
    pub selected: Array1<S>,
    /// Output over the omitted keys alone, `N_U / Z_U` (0 if nothing is omitted).
    pub omitted: Array1<S>,
    /// Selected share of the mass, `λ = Z_E / (Z_E + Z_U)`.
    pub lambda: S,
    /// `o_E − o`, computed directly.
    pub renormalization_error: Array1<S>,
    /// `(1 − λ)(o_E − o_U)`, the right-hand side of the E17 error identity.
    pub error_identity: Array1<S>,
}

/// E13 + E17 for one row: `scores` and `visible` over all keys, `v` `[keys, dv]`, `selected`
/// marking the exact set `E` (the omitted set `U` is the rest of the visible keys).
pub fn decompose_row<S: Real>(
    scores: ArrayView1<'_, S>,
    visible: ArrayView1<'_, bool>,
    v: ArrayView2<'_, S>,
    selected: ArrayView1<'_, bool>,
    ctx: S::Ctx,
) -> MassDecomposition<S> {
    let s = scores.to_owned().insert_axis(ndarray::Axis(0));
    let part = |keep: bool| -> SoftmaxState<S> {
        let vis = Array2::from_shape_fn((1, scores.len()), |(_, j)| visible[j] && selected[j] == keep);
        SoftmaxState::of_block(s.view(), vis.view(), v, ctx)
    };
    let (e, u) = (part(true), part(false));
    // Masses relative to the larger max, so that f64 does not overflow on large logits.
    let top = e.m[0].clone().max(u.m[0].clone());
    let mass = |st: &SoftmaxState<S>| crate::online::rescale_factor(&st.m[0], &top, ctx) * st.l[0].clone();
    let (z_e, z_u) = (mass(&e), mass(&u));
    let total = z_e.clone() + z_u;
    // A row with no visible key has no mass to split; E1c makes every output 0, and λ = 0.
    let lambda = if total == S::zero(ctx) { S::zero(ctx) } else { z_e / total };
    let (o_e, _) = e.finalize();
    let (o_u, _) = u.finalize();
    let (o, _) = e.merge(&u).finalize();
    let (o, o_e, o_u) = (o.row(0).to_owned(), o_e.row(0).to_owned(), o_u.row(0).to_owned());
    let renormalization_error = &o_e - &o;
    let one_minus = S::one(ctx) - lambda.clone();
    let error_identity = (&o_e - &o_u).mapv(|x| one_minus.clone() * x);
    MassDecomposition { dense: o, selected: o_e, omitted: o_u, lambda, renormalization_error, error_identity }
}
