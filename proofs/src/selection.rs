//! Theorems of selection: the block split is exact (E12), and the mass decomposition of
//! drop-and-renormalize (E17) holds with its exact error identity.

use std::ops::Range;

use attnproof_oracle::selection::MassDecomposition;
use attnproof_oracle::{Mp, Precision, Real, SoftmaxState};
use ndarray::{Array1, ArrayView1, ArrayView2};

use crate::residual::{Agreement, Bits, Violation, agree};

/// A per-block state function under test: `(scores, visible, v, blocks) ↦ states`.
pub type BlockStatesFn<'a> =
    &'a dyn Fn(ArrayView1<'_, Mp>, ArrayView1<'_, bool>, ArrayView2<'_, Mp>, &[Range<usize>]) -> Vec<SoftmaxState<Mp>>;

/// `(Z, N)` of one row straight from the definition: `Σ e^{s_j}` and `Σ e^{s_j} v_j` over
/// visible keys (MPFR does not overflow).
fn definition_masses(
    scores: ArrayView1<'_, Mp>,
    visible: ArrayView1<'_, bool>,
    v: ArrayView2<'_, Mp>,
    ctx: Precision,
) -> (Mp, Array1<Mp>) {
    let mut z = Mp::zero(ctx);
    let mut n = Array1::from_elem(v.ncols(), Mp::zero(ctx));
    for j in (0..scores.len()).filter(|&j| visible[j]) {
        let w = scores[j].exp();
        z += w.clone();
        n.zip_mut_with(&v.row(j), |a, x| *a += w.clone() * x.clone());
    }
    (z, n)
}

/// **Theorem (E12).** For a partition of the keys into contiguous blocks `blocks`, the block
/// masses and numerators of the states under test, `Z_b = e^{m_b} ℓ_b` and `N_b = e^{m_b} A_b`,
/// sum to the row's `Z = Σ_j e^{s_j}` and `N = Σ_j e^{s_j} v_j`. Hypotheses: `blocks` partition
/// the keys (as `key_blocks` returns).
pub fn block_split_is_exact(
    states_fn: BlockStatesFn<'_>,
    scores: ArrayView1<'_, Mp>,
    visible: ArrayView1<'_, bool>,
    v: ArrayView2<'_, Mp>,
    blocks: &[Range<usize>],
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "block_split_is_exact (E12)";
    let ctx = v.first().or(scores.first()).map(|x| x.ctx()).unwrap_or_default();
    let (z, n) = definition_masses(scores, visible, v, ctx);
    let mut z_sum = Mp::zero(ctx);
    let mut n_sum = Array1::from_elem(v.ncols(), Mp::zero(ctx));
    for st in states_fn(scores, visible, v, blocks) {
        let e = if st.m[0].is_finite() { st.m[0].exp() } else { Mp::zero(ctx) };
        z_sum += e.clone() * st.l[0].clone();
        n_sum.zip_mut_with(&st.a.row(0), |a, x| *a += e.clone() * x.clone());
    }
    let z_arr = Array1::from_elem(1, z);
    Ok(agree(T, "Z", &Array1::from_elem(1, z_sum), &z_arr, required)?.and(agree(T, "N", &n_sum, &n, required)?))
}

/// A decomposition under test: `(scores, visible, v, selected) ↦ MassDecomposition`.
pub type DecomposeFn<'a> = &'a dyn Fn(
    ArrayView1<'_, Mp>,
    ArrayView1<'_, bool>,
    ArrayView2<'_, Mp>,
    ArrayView1<'_, bool>,
) -> MassDecomposition<Mp>;

/// **Theorem (E17).** With `E` the selected visible keys and `U` the other visible keys:
/// `λ = Z_E/(Z_E + Z_U)`; the dense output is `o = λ o_E + (1 − λ) o_U` and equals the
/// definition; and the drop-and-renormalize error is exactly `o_E − o = (1 − λ)(o_E − o_U)`.
/// Hypotheses: `E` and `U` are both non-empty (else `λ ∈ {0, 1}` and the identity is trivial).
pub fn mass_decomposition(
    decompose: DecomposeFn<'_>,
    scores: ArrayView1<'_, Mp>,
    visible: ArrayView1<'_, bool>,
    v: ArrayView2<'_, Mp>,
    selected: ArrayView1<'_, bool>,
    required: Bits,
) -> Result<Agreement, Violation> {
    const T: &str = "mass_decomposition (E17)";
    let ctx = v.first().map(|x| x.ctx()).unwrap_or_default();
    let sel = |keep: bool| Array1::from_shape_fn(scores.len(), |j| visible[j] && selected[j] == keep);
    let (e, u) = (sel(true), sel(false));
    if !e.iter().any(|&x| x) || !u.iter().any(|&x| x) {
        return Err(Violation::Hypothesis { theorem: T, reason: "E or U is empty".into() });
    }
    let d = decompose(scores, visible, v, selected);
    let (z, n) = definition_masses(scores, visible, v, ctx);
    let (z_e, n_e) = definition_masses(scores, e.view(), v, ctx);
    let (z_u, n_u) = definition_masses(scores, u.view(), v, ctx);
    let lambda = z_e.clone() / z.clone();
    let one = Mp::one(ctx);
    let mixture = ndarray::Zip::from(&d.selected)
        .and(&d.omitted)
        .map_collect(|a, b| d.lambda.clone() * a.clone() + (one.clone() - d.lambda.clone()) * b.clone());
    Ok(agree(T, "lambda", &Array1::from_elem(1, d.lambda.clone()), &Array1::from_elem(1, lambda), required)?
        .and(agree(T, "o", &d.dense, &n.mapv(|x| x / z.clone()), required)?)
        .and(agree(T, "o_E", &d.selected, &n_e.mapv(|x| x / z_e.clone()), required)?)
        .and(agree(T, "o_U", &d.omitted, &n_u.mapv(|x| x / z_u.clone()), required)?)
        .and(agree(T, "λ o_E + (1−λ) o_U", &mixture, &d.dense, required)?)
        .and(agree(T, "o_E − o", &d.renormalization_error, &d.error_identity, required)?))
}
