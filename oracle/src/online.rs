//! The online-softmax state `(m, ℓ, A)` of E2 for a batch of rows, its update (E3), merge (E4)
//! and finalize (E5); the ring-attention arrival order (E11) and the zigzag layout (E11a).
//!
//! Each row of a [`SoftmaxState`] is the state of one query row over some set of keys. Rows are
//! independent; batching them lets `A` be formed with one matrix product.

use std::ops::Range;

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, ArrayViewMut1, Axis, Zip, s};

use crate::real::Real;

/// The online-softmax state of E2 for `rows` query rows: running max `m`, running sum
/// `ℓ = Σ e^{s−m}` and unnormalized output `A = Σ e^{s−m} v`.
#[derive(Clone, Debug, PartialEq)]
pub struct SoftmaxState<S> {
    /// Running max per row; `−∞` for a row that has seen no visible key.
    pub m: Array1<S>,
    /// Running sum of exponentials per row.
    pub l: Array1<S>,
    /// Unnormalized output `[rows, dv]`.
    pub a: Array2<S>,
}

/// The maximal runs of equal visibility in one row of a mask, left to right: `(keys, visible)`. The hot loops walk a
/// row run by run, so that a span of keys entirely visible or entirely hidden (a causal row's prefix, a window, a
/// listed block) is one slice operation with no per-element branch.
pub fn visibility_runs(row: ArrayView1<'_, bool>) -> impl Iterator<Item = (Range<usize>, bool)> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        let visible = *row.get(at)?;
        let rest = row.slice_move(s![at..]);
        let len = match rest.as_slice() {
            Some(rest) => run_length(rest, visible),
            None => rest.iter().position(|&v| v != visible).unwrap_or(rest.len()),
        };
        let run = at..at + len;
        at += len;
        Some((run, visible))
    })
}

/// How many leading elements of `flags` equal `value`. Whole blocks of 64 are tested without an early exit, which
/// compiles to vector compares: a mask row is scanned once per pass, and an element-by-element search cost as much as
/// the exponentials it was meant to save.
fn run_length(flags: &[bool], value: bool) -> usize {
    const BLOCK: usize = 64;
    let uniform =
        flags.chunks(BLOCK).take_while(|c| c.len() == BLOCK && c.iter().fold(true, |all, &v| all & (v == value)));
    let whole = uniform.count() * BLOCK;
    whole + flags[whole..].iter().position(|&v| v != value).unwrap_or(flags.len() - whole)
}

/// Calls `f` on each run of [`visibility_runs`] with the row's elements there as a slice (copied through a buffer
/// when the row is not contiguous).
pub(crate) fn for_each_run<S: Clone>(
    mut row: ArrayViewMut1<'_, S>,
    vis: ArrayView1<'_, bool>,
    mut f: impl FnMut(&mut [S], bool),
) {
    match row.as_slice_mut() {
        Some(elements) => visibility_runs(vis).for_each(|(run, visible)| f(&mut elements[run], visible)),
        None => {
            let mut elements = row.to_vec();
            visibility_runs(vis).for_each(|(run, visible)| f(&mut elements[run], visible));
            row.iter_mut().zip(elements).for_each(|(x, y)| *x = y);
        }
    }
}

/// The row max over visible entries (`−∞` where a row has none), E2's `m`.
pub fn row_max<S: Real>(scores: ArrayView2<'_, S>, visible: ArrayView2<'_, bool>, ctx: S::Ctx) -> Array1<S> {
    Zip::from(scores.rows()).and(visible.rows()).map_collect(|s, vis| max_of_row(s, vis, ctx))
}

/// [`row_max`] of one row.
fn max_of_row<S: Real>(s: ArrayView1<'_, S>, vis: ArrayView1<'_, bool>, ctx: S::Ctx) -> S {
    visibility_runs(vis)
        .filter(|(_, visible)| *visible)
        .flat_map(|(run, _)| s.slice_move(s![run]))
        .fold(S::neg_infinity(ctx), |m, x| m.max(x.clone()))
}

/// `e^{s_ij − m_i}` on visible entries and exactly 0 elsewhere, so that a masked entry never
/// produces `e^{−∞ − (−∞)}`.
pub fn shifted_exponentials<S: Real>(
    scores: ArrayView2<'_, S>,
    visible: ArrayView2<'_, bool>,
    m: ArrayView1<'_, S>,
    ctx: S::Ctx,
) -> Array2<S> {
    exponentials_and_sums(scores, visible, m, ctx).0
}

/// `Σ_j w_ij` per row, summed left to right.
pub fn row_sums<S: Real>(w: ArrayView2<'_, S>, ctx: S::Ctx) -> Array1<S> {
    w.map_axis(Axis(1), |row| row.iter().fold(S::zero(ctx), |acc, x| acc + x.clone()))
}

/// [`shifted_exponentials`] and their [`row_sums`] in one pass over each row (the dense oracle's hot loop: one walk
/// over the `[rows, keys]` array instead of two). Every exponential is the same operation, and each row's sum adds
/// the same terms, masked zeros included, in the same left-to-right order, so both results are bit for bit those of
/// the two separate functions.
pub fn exponentials_and_sums<S: Real>(
    scores: ArrayView2<'_, S>,
    visible: ArrayView2<'_, bool>,
    m: ArrayView1<'_, S>,
    ctx: S::Ctx,
) -> (Array2<S>, Array1<S>) {
    let mut w = scores.to_owned();
    let sums = exponentials_and_sums_in_place(&mut w, visible, m, ctx);
    (w, sums)
}

/// [`exponentials_and_sums`] over the scores in `w`, which become the weights (the backward reuses its arrays).
pub fn exponentials_and_sums_in_place<S: Real>(
    w: &mut Array2<S>,
    visible: ArrayView2<'_, bool>,
    m: ArrayView1<'_, S>,
    ctx: S::Ctx,
) -> Array1<S> {
    Zip::from(w.rows_mut()).and(visible.rows()).and(&m).map_collect(|w, vis, m| exponentials_of_row(w, vis, m, ctx))
}

/// [`exponentials_and_sums_in_place`] of one row: its weights in place, and their sum.
fn exponentials_of_row<S: Real>(w: ArrayViewMut1<'_, S>, vis: ArrayView1<'_, bool>, m: &S, ctx: S::Ctx) -> S {
    let mut sum = S::zero(ctx);
    // Run by run: the exponentials of a visible run in one slice operation (vector lanes for f64), then its terms
    // added left to right. A hidden run's zeros are not added: the sum starts at +0 and every term is at least +0, so
    // adding them would not change a bit.
    for_each_run(w, vis, |elements, visible| {
        if visible {
            S::exp_shifted_in_place(elements, m);
            elements.iter().for_each(|x| sum += x.clone());
        } else {
            elements.fill(S::zero(ctx));
        }
    });
    sum
}

/// E2's `m` and E3's weights and their sums over a block of scores, in place, one row at a time: each row's max and
/// exponentials are taken while the row is in the cache ([`row_max`] then [`exponentials_and_sums_in_place`] would
/// stream the whole block from memory twice), with the same bits.
fn maxima_and_weights_in_place<S: Real>(
    w: &mut Array2<S>,
    visible: ArrayView2<'_, bool>,
    ctx: S::Ctx,
) -> (Array1<S>, Array1<S>) {
    let mut m = Array1::from_elem(w.nrows(), S::zero(ctx));
    let l = Zip::from(w.rows_mut()).and(visible.rows()).and(&mut m).map_collect(|w, vis, m| {
        *m = max_of_row(w.view(), vis, ctx);
        exponentials_of_row(w, vis, m, ctx)
    });
    (m, l)
}

/// `e^{a − b}` with the E4 convention that `e^{−∞ − (−∞)}` is 0 (an empty state contributes nothing).
pub fn rescale_factor<S: Real>(a: &S, b: &S, ctx: S::Ctx) -> S {
    if a.is_finite() { (a.clone() - b.clone()).exp() } else { S::zero(ctx) }
}

impl<S: Real> SoftmaxState<S> {
    /// The state of the empty set for `rows` rows: `(−∞, 0, 0)`, the identity of ⊕ (E2).
    pub fn empty(rows: usize, dv: usize, ctx: S::Ctx) -> Self {
        SoftmaxState {
            m: Array1::from_elem(rows, S::neg_infinity(ctx)),
            l: Array1::from_elem(rows, S::zero(ctx)),
            a: Array2::from_elem((rows, dv), S::zero(ctx)),
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.m.len()
    }

    /// E2: the state of one block of keys, from its scores `[rows, keys]`, visibility and
    /// values `[keys, dv]`.
    pub fn of_block(
        scores: ArrayView2<'_, S>,
        visible: ArrayView2<'_, bool>,
        v: ArrayView2<'_, S>,
        ctx: S::Ctx,
    ) -> Self {
        Self::of_owned_block(scores.to_owned(), visible, v, ctx)
    }

    /// [`SoftmaxState::of_block`] from scores the caller no longer needs: their array becomes the weights.
    pub fn of_owned_block(
        mut scores: Array2<S>,
        visible: ArrayView2<'_, bool>,
        v: ArrayView2<'_, S>,
        ctx: S::Ctx,
    ) -> Self {
        let (m, l) = maxima_and_weights_in_place(&mut scores, visible, ctx);
        let a = S::matmul(scores.view(), v, ctx);
        SoftmaxState { m, l, a }
    }

    /// E3: absorb a new block `J` directly, `m' = max(m, max_J s)`,
    /// `ℓ' = e^{m−m'} ℓ + Σ_J e^{s−m'}`, `A' = e^{m−m'} A + Σ_J e^{s−m'} v`.
    pub fn update(
        &mut self,
        scores: ArrayView2<'_, S>,
        visible: ArrayView2<'_, bool>,
        v: ArrayView2<'_, S>,
        ctx: S::Ctx,
    ) {
        let block_max = row_max(scores, visible, ctx);
        let m_new = Zip::from(&self.m).and(&block_max).map_collect(|a, b| a.clone().max(b.clone()));
        let (w, block_l) = exponentials_and_sums(scores, visible, m_new.view(), ctx);
        let block_a = S::matmul(w.view(), v, ctx);
        for i in 0..self.rows() {
            let c = rescale_factor(&self.m[i], &m_new[i], ctx);
            self.l[i] = c.clone() * self.l[i].clone() + block_l[i].clone();
            for (a, b) in self.a.row_mut(i).iter_mut().zip(block_a.row(i)) {
                *a = c.clone() * a.clone() + b.clone();
            }
        }
        self.m = m_new;
    }

    /// E4: `(m_a,ℓ_a,A_a) ⊕ (m_b,ℓ_b,A_b)` for disjoint key sets.
    pub fn merge(&self, other: &Self) -> Self {
        assert_eq!(self.a.dim(), other.a.dim(), "merge: states of different shapes");
        let mut out = self.clone();
        for i in 0..self.rows() {
            let ctx = self.l[i].ctx();
            let m = self.m[i].clone().max(other.m[i].clone());
            let ca = rescale_factor(&self.m[i], &m, ctx);
            let cb = rescale_factor(&other.m[i], &m, ctx);
            out.l[i] = ca.clone() * self.l[i].clone() + cb.clone() * other.l[i].clone();
            for (o, (a, b)) in out.a.row_mut(i).iter_mut().zip(self.a.row(i).iter().zip(other.a.row(i))) {
                *o = ca.clone() * a.clone() + cb.clone() * b.clone();
            }
            out.m[i] = m;
        }
        out
    }

    /// E5: `O = A/ℓ`, `LSE = m + log ℓ`; a row with `ℓ = 0` saw no visible key and gives
    /// `O = 0`, `LSE = −∞` (E1c).
    pub fn finalize(&self) -> (Array2<S>, Array1<S>) {
        let mut o = self.a.clone();
        let mut lse = self.m.clone();
        for i in 0..self.rows() {
            let ctx = self.l[i].ctx();
            if self.l[i] == S::zero(ctx) {
                o.row_mut(i).fill(S::zero(ctx));
                lse[i] = S::neg_infinity(ctx);
            } else {
                let l = self.l[i].clone();
                o.row_mut(i).mapv_inplace(|a| a / l.clone());
                lse[i] = self.m[i].clone() + l.ln();
            }
        }
        (o, lse)
    }
}

/// E11: the KV block device `device` holds at ring step `step` of `n_devices`: `(g − t) mod G`.
pub fn ring_block_at(device: usize, step: usize, n_devices: usize) -> usize {
    (device + n_devices - step % n_devices) % n_devices
}

/// E11: the order in which device `device` receives the `n_devices` KV blocks.
pub fn ring_arrival_order(device: usize, n_devices: usize) -> Vec<usize> {
    (0..n_devices).map(|t| ring_block_at(device, t, n_devices)).collect()
}

/// E11a: the two chunks (of `2G`) that device `g` holds under the zigzag layout: `g` and `2G−1−g`.
pub fn zigzag_chunks(device: usize, n_devices: usize) -> [usize; 2] {
    [device, 2 * n_devices - 1 - device]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::uniform_tensor;
    use ndarray::{Array2, Ix2};

    /// The fused pass gives `e^{s − m}` and the left-to-right row sums bit for bit: rows with some keys masked, one row with
    /// every key masked (`m = −∞`, all weights exactly 0), and scores large enough that exponentials span many
    /// binades.
    #[test]
    fn visibility_runs_cover_a_row_in_maximal_runs() {
        let row = ndarray::arr1(&[true, true, false, false, false, true, false, true, true, true]);
        let runs: Vec<_> = visibility_runs(row.view()).collect();
        assert_eq!(runs, [(0..2, true), (2..5, false), (5..6, true), (6..7, false), (7..10, true)]);
        assert_eq!(visibility_runs(ndarray::arr1(&[false; 4]).view()).collect::<Vec<_>>(), [(0..4, false)]);
        assert_eq!(visibility_runs(ndarray::Array1::<bool>::from(vec![]).view()).count(), 0);
    }

    /// Runs across the scan's 64-element blocks: every run length from 0 to 200 at every offset class, compared with
    /// an element-by-element search.
    #[test]
    fn run_lengths_across_blocks_equal_the_plain_search() {
        for value in [false, true] {
            for len in 0..200 {
                for tail in [0usize, 1, 63, 64, 65, 130] {
                    let mut flags = vec![value; len];
                    flags.extend(std::iter::repeat_n(!value, usize::from(tail > 0)));
                    flags.extend(std::iter::repeat_n(value, tail.saturating_sub(1)));
                    let plain = flags.iter().position(|&v| v != value).unwrap_or(flags.len());
                    assert_eq!(run_length(&flags, value), plain, "value {value}, len {len}, tail {tail}");
                    assert_eq!(run_length(&flags, value), len, "value {value}, len {len}, tail {tail}");
                }
            }
        }
    }

    /// A row that is not contiguous (a column of a transposed array) goes through the buffer and gets the same values
    /// as a contiguous one.
    #[test]
    fn runs_of_a_strided_row_write_back() {
        let visible = Array2::from_shape_fn((3, 9), |(i, j)| (i + j) % 4 != 0);
        let scores = Array2::from_shape_fn((3, 9), |(i, j)| (i * 9 + j) as f64 / 7.0 - 2.0);
        let m = row_max(scores.view(), visible.view(), ());
        let (contiguous, sums) = exponentials_and_sums(scores.view(), visible.view(), m.view(), ());
        let mut strided = scores.t().to_owned();
        let mut strided = strided.view_mut().reversed_axes();
        let mut strided_sums = Array1::<f64>::zeros(3);
        Zip::from(strided.rows_mut()).and(&mut strided_sums).and(visible.rows()).and(&m).for_each(
            |w, sum: &mut f64, vis, m: &f64| {
                for_each_run(w, vis, |elements, visible| {
                    if visible {
                        f64::exp_shifted_in_place(elements, m);
                        elements.iter().for_each(|x| *sum += *x);
                    } else {
                        elements.fill(0.0);
                    }
                });
            },
        );
        assert_eq!(strided, contiguous);
        assert_eq!(strided_sums, sums);
    }

    #[test]
    fn the_fused_pass_equals_exponentials_then_sums() {
        let scores = uniform_tensor(7, &[5, 37]).into_dimensionality::<Ix2>().expect("2-D").mapv(|x| 40.0 * x);
        let visible = Array2::from_shape_fn((5, 37), |(i, j)| i != 3 && (i + 2 * j) % 5 != 0);
        let m = row_max(scores.view(), visible.view(), ());
        assert_eq!(m[3], f64::NEG_INFINITY, "the fully masked row");
        let (w, sums) = exponentials_and_sums(scores.view(), visible.view(), m.view(), ());
        let direct =
            Array2::from_shape_fn(
                (5, 37),
                |(i, j)| if visible[[i, j]] { Real::exp(&(scores[[i, j]] - m[i])) } else { 0.0 },
            );
        let bits = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(w.as_slice().unwrap()), bits(direct.as_slice().unwrap()));
        assert_eq!(bits(sums.as_slice().unwrap()), bits(row_sums(direct.view(), ()).as_slice().unwrap()));
        assert!(w.row(3).iter().all(|&x| x == 0.0) && sums[3] == 0.0);
        // The row-at-a-time pass of `of_owned_block` gives the same bits as the two whole-array passes.
        let mut fused = scores.clone();
        let (fused_m, fused_sums) = maxima_and_weights_in_place(&mut fused, visible.view(), ());
        assert_eq!(bits(fused.as_slice().unwrap()), bits(w.as_slice().unwrap()));
        assert_eq!(bits(fused_m.as_slice().unwrap()), bits(m.as_slice().unwrap()));
        assert_eq!(bits(fused_sums.as_slice().unwrap()), bits(sums.as_slice().unwrap()));
    }
}
