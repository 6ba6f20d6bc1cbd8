//! Attention computed straight from its definition (E1, E10), with no running max and no
//! blocking, so that theorems compare the oracle's algorithms against something that shares
//! none of their structure. MPFR's exponent range (about ±2^30 binary orders) makes `e^{s}`
//! safe for any logit an attention problem can produce.

use attnproof_oracle::{Mp, Real};
use ndarray::{Array1, Array2, ArrayView2};

/// `P_ij = e^{s_ij} / Σ_{k visible} e^{s_ik}` on visible pairs, 0 elsewhere and on fully masked rows.
pub fn probabilities(
    scores: ArrayView2<'_, Mp>,
    visible: ArrayView2<'_, bool>,
    ctx: attnproof_oracle::Precision,
) -> Array2<Mp> {
    let mut p = Array2::from_elem(scores.dim(), Mp::zero(ctx));
    for i in 0..scores.nrows() {
        let z = (0..scores.ncols()).filter(|&j| visible[[i, j]]).fold(Mp::zero(ctx), |z, j| z + scores[[i, j]].exp());
        for j in 0..scores.ncols() {
            if visible[[i, j]] {
                p[[i, j]] = scores[[i, j]].exp() / z.clone();
            }
        }
    }
    p
}

/// `LSE_i = log Σ_{j visible} e^{s_ij}` (E10), `−∞` for a fully masked row.
pub fn log_sum_exp(
    scores: ArrayView2<'_, Mp>,
    visible: ArrayView2<'_, bool>,
    ctx: attnproof_oracle::Precision,
) -> Array1<Mp> {
    Array1::from_shape_fn(scores.nrows(), |i| {
        (0..scores.ncols()).filter(|&j| visible[[i, j]]).fold(Mp::zero(ctx), |z, j| z + scores[[i, j]].exp()).ln()
    })
}

/// `S = α Q Kᵀ` with `−∞` where masked (E1), by explicit dot products.
pub fn scores(q: ArrayView2<'_, Mp>, k: ArrayView2<'_, Mp>, scale: &Mp, visible: ArrayView2<'_, bool>) -> Array2<Mp> {
    let ctx = scale.ctx();
    Array2::from_shape_fn((q.nrows(), k.nrows()), |(i, j)| {
        if visible[[i, j]] {
            let dot = q.row(i).iter().zip(k.row(j)).fold(Mp::zero(ctx), |acc, (a, b)| acc + a.clone() * b.clone());
            scale.clone() * dot
        } else {
            Mp::neg_infinity(ctx)
        }
    })
}

/// `A · B` by explicit dot products.
pub fn product(a: ArrayView2<'_, Mp>, b: ArrayView2<'_, Mp>, ctx: attnproof_oracle::Precision) -> Array2<Mp> {
    attnproof_oracle::real::naive_matmul(a, b, ctx)
}

/// The whole forward of one head from the definitions: `(O, LSE)`.
pub fn forward(
    q: ArrayView2<'_, Mp>,
    k: ArrayView2<'_, Mp>,
    v: ArrayView2<'_, Mp>,
    scale: &Mp,
    visible: ArrayView2<'_, bool>,
) -> (Array2<Mp>, Array1<Mp>) {
    let ctx = scale.ctx();
    let s = scores(q, k, scale, visible);
    let p = probabilities(s.view(), visible, ctx);
    (product(p.view(), v, ctx), log_sum_exp(s.view(), visible, ctx))
}
