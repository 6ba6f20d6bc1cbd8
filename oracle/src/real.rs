//! The scalar trait every oracle equation is generic over, with its two instances: `f64` and
//! MPFR (`Mp`, a `rug::Float` newtype whose precision the caller chooses).

use std::fmt;
use std::iter::Sum;
use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};

use ndarray::{Array2, ArrayView1, ArrayView2, Axis};
use rug::Float;

/// Default MPFR precision of the oracle, in bits.
pub const DEFAULT_PRECISION_BITS: u32 = 256;

/// The precision of an MPFR computation, in bits of significand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Precision(pub u32);

impl Default for Precision {
    fn default() -> Self {
        Precision(DEFAULT_PRECISION_BITS)
    }
}

/// A real number type the oracle can compute in.
///
/// Every value carries the context it was made in (nothing for `f64`, the precision for MPFR),
/// so that generic code can make new constants of the same kind with [`Real::from_f64`].
/// Arithmetic rounds to nearest in the value's own precision. `matmul` has a plain generic
/// implementation; `f64` replaces it with faer's blocked product, which is the only place the
/// fast path differs from the exact one.
pub trait Real:
    Clone
    + fmt::Debug
    + fmt::Display
    + PartialOrd
    + PartialEq
    + Send
    + Sync
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + Sum
    + 'static
{
    /// What a constant needs to be made: `()` for `f64`, the precision for MPFR.
    type Ctx: Copy + fmt::Debug + Send + Sync + 'static;

    /// The context this value was made in.
    fn ctx(&self) -> Self::Ctx;
    /// The value of `x` (exact for MPFR of at least 53 bits).
    fn from_f64(x: f64, ctx: Self::Ctx) -> Self;
    /// Nearest `f64`.
    fn to_f64(&self) -> f64;
    /// `e^self`.
    fn exp(&self) -> Self;
    /// Natural logarithm.
    fn ln(&self) -> Self;
    /// Square root.
    fn sqrt(&self) -> Self;
    /// Absolute value.
    fn abs(&self) -> Self;
    /// Whether the value is neither infinite nor NaN.
    fn is_finite(&self) -> bool;
    /// Whether the value is NaN.
    fn is_nan(&self) -> bool;

    /// Zero in context `ctx`.
    fn zero(ctx: Self::Ctx) -> Self {
        Self::from_f64(0.0, ctx)
    }
    /// One in context `ctx`.
    fn one(ctx: Self::Ctx) -> Self {
        Self::from_f64(1.0, ctx)
    }
    /// Negative infinity in context `ctx`: the running max of an empty set (E2).
    fn neg_infinity(ctx: Self::Ctx) -> Self {
        Self::from_f64(f64::NEG_INFINITY, ctx)
    }
    /// The larger of two values (NaN-free inputs assumed; the oracle rejects NaN input).
    fn max(self, other: Self) -> Self {
        if other > self { other } else { self }
    }
    /// Matrix product `a · b`. Transposed operands are passed as `.t()` views.
    fn matmul(a: ArrayView2<'_, Self>, b: ArrayView2<'_, Self>, ctx: Self::Ctx) -> Array2<Self> {
        naive_matmul(a, b, ctx)
    }
    /// `xs[i] ← e^(xs[i] − shift)` for every element, bit for bit as [`Real::exp`] of each difference (E3's
    /// weights over a run of visible keys). Element by element here; `f64` runs it over the whole slice in vector
    /// lanes.
    fn exp_shifted_in_place(xs: &mut [Self], shift: &Self) {
        for x in xs {
            *x = (x.clone() - shift.clone()).exp();
        }
    }
    /// `xs[i] ← xs[i] · scale` for every element (E1's scale over a run of visible keys).
    fn scale_in_place(xs: &mut [Self], scale: &Self) {
        for x in xs {
            *x = x.clone() * scale.clone();
        }
    }
    /// [`Real::matmul`] into `dst`, bit for bit, reusing its memory when it already has the product's shape (the
    /// backward's chunks reuse their arrays: fresh pages for every chunk cost a fifth of its time).
    fn matmul_into(dst: &mut Array2<Self>, a: ArrayView2<'_, Self>, b: ArrayView2<'_, Self>, ctx: Self::Ctx) {
        *dst = Self::matmul(a, b, ctx);
    }
}

/// The textbook triple loop, summing each dot product left to right.
pub fn naive_matmul<S: Real>(a: ArrayView2<'_, S>, b: ArrayView2<'_, S>, ctx: S::Ctx) -> Array2<S> {
    assert_eq!(a.ncols(), b.nrows(), "matmul: inner dimensions differ");
    let mut c = Array2::from_elem((a.nrows(), b.ncols()), S::zero(ctx));
    for (i, row) in a.axis_iter(Axis(0)).enumerate() {
        for (j, col) in b.axis_iter(Axis(1)).enumerate() {
            let mut acc = S::zero(ctx);
            for (x, y) in row.iter().zip(col.iter()) {
                acc += x.clone() * y.clone();
            }
            c[[i, j]] = acc;
        }
    }
    c
}

impl Real for f64 {
    type Ctx = ();

    fn ctx(&self) {}
    fn from_f64(x: f64, _: ()) -> Self {
        x
    }
    fn to_f64(&self) -> f64 {
        *self
    }
    /// The oracle's own `exp` ([`crate::vexp`]: below one ulp, the same bits one value at a time and in slices).
    fn exp(&self) -> Self {
        crate::vexp::exp(*self)
    }
    fn exp_shifted_in_place(xs: &mut [Self], shift: &Self) {
        crate::vexp::exp_shifted_in_place(xs, *shift);
    }
    fn ln(&self) -> Self {
        f64::ln(*self)
    }
    fn sqrt(&self) -> Self {
        f64::sqrt(*self)
    }
    fn abs(&self) -> Self {
        f64::abs(*self)
    }
    fn is_finite(&self) -> bool {
        f64::is_finite(*self)
    }
    fn is_nan(&self) -> bool {
        f64::is_nan(*self)
    }
    fn matmul(a: ArrayView2<'_, f64>, b: ArrayView2<'_, f64>, _: ()) -> Array2<f64> {
        let mut c = Array2::<f64>::zeros((a.nrows(), b.ncols()));
        faer_matmul_into(&mut c, a, b);
        c
    }
    fn matmul_into(dst: &mut Array2<f64>, a: ArrayView2<'_, f64>, b: ArrayView2<'_, f64>, _: ()) {
        if dst.dim() != (a.nrows(), b.ncols()) || !dst.is_standard_layout() {
            *dst = Array2::zeros((a.nrows(), b.ncols()));
        }
        faer_matmul_into(dst, a, b);
    }
}

/// A view of `a` as a faer matrix, without copying when `a` is row- or column-contiguous.
fn as_faer<'a>(a: &'a ArrayView2<'_, f64>) -> Option<faer::MatRef<'a, f64>> {
    let (rows, cols) = a.dim();
    if a.is_standard_layout() {
        return a.as_slice().map(|s| faer::MatRef::from_row_major_slice(s, rows, cols));
    }
    if a.t().is_standard_layout() {
        return a.as_slice_memory_order().map(|s| faer::MatRef::from_column_major_slice(s, rows, cols));
    }
    None
}

/// `c = a · b` in f64 through faer (blocked, SIMD, parallel over the global rayon pool); `c` is standard layout and
/// of the product's shape, and its old values are never read.
fn faer_matmul_into(c: &mut Array2<f64>, a: ArrayView2<'_, f64>, b: ArrayView2<'_, f64>) {
    assert_eq!(a.ncols(), b.nrows(), "matmul: inner dimensions differ");
    let a_owned;
    let a = match as_faer(&a) {
        Some(m) => m,
        None => {
            a_owned = a.as_standard_layout().into_owned();
            faer::MatRef::from_row_major_slice(a_owned.as_slice().expect("standard layout"), a.nrows(), a.ncols())
        }
    };
    let b_owned;
    let b = match as_faer(&b) {
        Some(m) => m,
        None => {
            b_owned = b.as_standard_layout().into_owned();
            faer::MatRef::from_row_major_slice(b_owned.as_slice().expect("standard layout"), b.nrows(), b.ncols())
        }
    };
    let (rows, cols) = c.dim();
    let c_slice = c.as_slice_mut().expect("the caller gives a standard-layout array");
    faer::linalg::matmul::matmul(
        faer::MatMut::from_row_major_slice_mut(c_slice, rows, cols),
        faer::Accum::Replace,
        a,
        b,
        1.0,
        matmul_parallelism(),
    );
    clear_upper_vector_state();
}

/// Clears the upper halves of the AVX registers (`vzeroupper`) after faer's AVX-512 kernels. They return with the
/// upper state dirty, and on x86 every later legacy-SSE instruction of the same thread (this crate's scalar f64 code
/// and libm's `exp`, compiled for the baseline target) then pays a state-transition penalty: the dense forward at
/// 4096 keys ran in 2.49 s instead of 0.42 s on one thread, its `exp` calls following a product on the same thread.
/// The crate's one `unsafe` (tidy rule 6 keeps it in this file).
#[allow(unsafe_code)]
fn clear_upper_vector_state() {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: `vzeroupper` exists wherever AVX does (checked above) and only zeroes bits 128 and up of the
        // vector registers, which hold no live value here: nothing vector-typed lives across this call.
        unsafe { std::arch::x86_64::_mm256_zeroupper() };
    }
}

/// faer's parallelism for a product: the whole rayon pool when called from outside it, none from inside one of its
/// tasks. The oracle's loops over heads and row chunks already keep every thread busy there, and faer's own
/// parallel kernels, whose threads meet at barriers, would wait for workers that are running other chunks.
fn matmul_parallelism() -> faer::Par {
    if rayon::current_thread_index().is_some() { faer::Par::Seq } else { faer::Par::rayon(0) }
}

/// An MPFR number (`rug::Float`) with the arithmetic the oracle needs.
///
/// Binary operations round to the precision of the left operand; the oracle only ever combines
/// values of one precision.
#[derive(Clone, Debug, PartialEq, PartialOrd)]
pub struct Mp(pub Float);

impl Mp {
    /// The value of `x` at precision `prec`.
    pub fn new(x: f64, prec: Precision) -> Self {
        Mp(Float::with_val(prec.0, x))
    }
    /// The precision of this value.
    pub fn precision(&self) -> Precision {
        Precision(self.0.prec())
    }
    /// `digits` significant decimal digits, truncated; see [`format_significant`].
    pub fn to_significant(&self, digits: usize) -> String {
        format_significant(&self.0, digits)
    }
}

/// Formats `x` with `digits` significant decimal digits, truncated toward zero so that every
/// printed digit is a digit of the exact value (when `x` itself is exact to that many digits).
/// Positional notation for magnitudes in `[1e-5, 1e30)` (`1001.40760…`), scientific otherwise
/// (`1.25e-7`); `-inf`, `inf`, `NaN` for the special values.
pub fn format_significant(x: &Float, digits: usize) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x.is_sign_negative() { "-inf".into() } else { "inf".into() };
    }
    if x.is_zero() {
        return "0".into();
    }
    let (negative, mantissa, exponent) = x.to_sign_string_exp_round(10, Some(digits), rug::float::Round::Zero);
    // `mantissa` holds the digits d1 d2 ... with value 0.d1d2... × 10^exponent.
    let exponent = exponent.expect("finite non-zero values have an exponent");
    let sign = if negative { "-" } else { "" };
    let n = mantissa.len() as i32;
    if (1..=30).contains(&exponent) {
        let (int, frac) = mantissa.split_at(exponent.min(n) as usize);
        let pad = "0".repeat((exponent - n).max(0) as usize);
        if frac.is_empty() { format!("{sign}{int}{pad}") } else { format!("{sign}{int}.{frac}") }
    } else if (-4..=0).contains(&exponent) {
        format!("{sign}0.{}{mantissa}", "0".repeat((-exponent) as usize))
    } else {
        let (head, tail) = mantissa.split_at(1);
        let tail = tail.trim_end_matches('0');
        let e = exponent - 1;
        if tail.is_empty() { format!("{sign}{head}e{e}") } else { format!("{sign}{head}.{tail}e{e}") }
    }
}

impl fmt::Display for Mp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_significant(f.precision().unwrap_or(30)))
    }
}

macro_rules! mp_binary {
    ($trait:ident, $method:ident, $op:tt) => {
        impl $trait for Mp {
            type Output = Mp;
            fn $method(self, rhs: Mp) -> Mp {
                Mp(self.0 $op rhs.0)
            }
        }
    };
}
mp_binary!(Add, add, +);
mp_binary!(Sub, sub, -);
mp_binary!(Mul, mul, *);
mp_binary!(Div, div, /);

impl Neg for Mp {
    type Output = Mp;
    fn neg(self) -> Mp {
        Mp(-self.0)
    }
}

impl AddAssign for Mp {
    fn add_assign(&mut self, rhs: Mp) {
        self.0 += rhs.0;
    }
}

impl Sum for Mp {
    /// Sums left to right. An empty sum has no precision to take, so it is an error to ask for one;
    /// the oracle always sums with an explicit zero instead.
    fn sum<I: Iterator<Item = Mp>>(iter: I) -> Mp {
        iter.reduce(|a, b| a + b).expect("Mp::sum of an empty iterator: start from Real::zero(ctx)")
    }
}

impl Real for Mp {
    type Ctx = Precision;

    fn ctx(&self) -> Precision {
        self.precision()
    }
    /// In place, without the default's three temporaries per element; each operation rounds to the element's own
    /// precision as the owned operators do, so the bits are the default's.
    fn exp_shifted_in_place(xs: &mut [Self], shift: &Self) {
        for x in xs {
            x.0 -= &shift.0;
            x.0.exp_mut();
        }
    }
    fn scale_in_place(xs: &mut [Self], scale: &Self) {
        for x in xs {
            x.0 *= &scale.0;
        }
    }
    fn from_f64(x: f64, ctx: Precision) -> Self {
        Mp::new(x, ctx)
    }
    fn to_f64(&self) -> f64 {
        self.0.to_f64()
    }
    fn exp(&self) -> Self {
        Mp(self.0.clone().exp())
    }
    fn ln(&self) -> Self {
        Mp(self.0.clone().ln())
    }
    fn sqrt(&self) -> Self {
        Mp(self.0.clone().sqrt())
    }
    fn abs(&self) -> Self {
        Mp(self.0.clone().abs())
    }
    fn is_finite(&self) -> bool {
        self.0.is_finite()
    }
    fn is_nan(&self) -> bool {
        self.0.is_nan()
    }
    /// [`naive_matmul`]'s sums, bit for bit (each product rounded to the precision, then added left to right), without
    /// its two clones per multiply-add: the product goes into one reused temporary per row, and rows run in parallel
    /// (a row's arithmetic does not depend on which thread runs it).
    fn matmul(a: ArrayView2<'_, Mp>, b: ArrayView2<'_, Mp>, ctx: Precision) -> Array2<Mp> {
        use rayon::prelude::*;
        use rug::Assign;
        assert_eq!(a.ncols(), b.nrows(), "matmul: inner dimensions differ");
        let rows: Vec<Vec<Mp>> = (0..a.nrows())
            .into_par_iter()
            .map_init(
                || Float::new(ctx.0),
                |product, i| {
                    let row = a.row(i);
                    let dot = |col: ArrayView1<'_, Mp>| {
                        let mut acc = Mp::zero(ctx);
                        for (x, y) in row.iter().zip(col.iter()) {
                            product.assign(&x.0 * &y.0);
                            acc.0 += &*product;
                        }
                        acc
                    };
                    b.axis_iter(Axis(1)).map(dot).collect()
                },
            )
            .collect();
        Array2::from_shape_vec((a.nrows(), b.ncols()), rows.into_iter().flatten().collect())
            .expect("one row of b.ncols() entries per row of a")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::array;

    #[test]
    fn faer_and_naive_products_agree_on_transposed_views() {
        let a = array![[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]];
        let b = array![[1.0, -1.0, 0.5], [2.0, 0.0, -3.0]];
        let fast = f64::matmul(a.view(), b.t(), ());
        let slow = naive_matmul(a.view(), b.t(), ());
        assert_eq!(fast, slow);
        assert_eq!(fast[[1, 1]], 4.0 * 2.0 + 6.0 * -3.0);
    }

    /// The MPFR slice operations round as the owned operators do: the same bits as the trait's element-by-element
    /// defaults (spelled out here), at a precision where every step rounds.
    #[test]
    fn the_mpfr_slice_operations_equal_the_owned_operators() {
        let prec = Precision(64);
        let xs: Vec<Mp> = (0..40).map(|i| Mp::new(-3.0 + i as f64 * 0.173, prec) / Mp::new(7.0, prec)).collect();
        let shift = Mp::new(1.0, prec) / Mp::new(3.0, prec);
        let mut fast = xs.clone();
        Mp::exp_shifted_in_place(&mut fast, &shift);
        let slow: Vec<Mp> = xs.iter().map(|x| (x.clone() - shift.clone()).exp()).collect();
        assert_eq!(fast, slow);
        let mut fast = xs.clone();
        Mp::scale_in_place(&mut fast, &shift);
        let slow: Vec<Mp> = xs.iter().map(|x| x.clone() * shift.clone()).collect();
        assert_eq!(fast, slow);
        assert!(fast.iter().all(|v| v.precision() == prec));
    }

    #[test]
    fn the_mpfr_product_sums_as_the_textbook_loop_does() {
        // Values whose products and sums round at 64 bits, on transposed and strided views: the in-place product must
        // round each product, then each sum, in the loop's order, so the bits are the naive loop's.
        let prec = Precision(64);
        let x = |i: usize| Mp::new(1.0 / 3.0 + i as f64 * 0.715 - (i * i) as f64 * 0.013, prec);
        let a = Array2::from_shape_fn((5, 7), |(i, j)| x(3 * i + j) / x(j + 40));
        let b = Array2::from_shape_fn((4, 7), |(i, j)| x(i + 2 * j + 11));
        let strided = a.slice_axis(Axis(1), ndarray::Slice::new(0, None, 2));
        for (l, r) in [(a.view(), b.t()), (strided, b.slice_axis(Axis(1), ndarray::Slice::new(0, None, 2)).t())] {
            let fast = Mp::matmul(l, r, prec);
            let slow = naive_matmul(l, r, prec);
            assert_eq!(fast, slow);
            assert!(fast.iter().all(|v| v.precision() == prec));
        }
        // An exact dot product rounded once differs somewhere: the comparison above can see a change of rounding.
        let once = naive_matmul(
            a.mapv(|v| Mp(Float::with_val(512, &v.0))).view(),
            b.t().mapv(|v| Mp(Float::with_val(512, &v.0))).view(),
            Precision(512),
        );
        let fast = Mp::matmul(a.view(), b.t(), prec);
        assert!(
            fast.iter().zip(&once).any(|(f, e)| *f != Mp(Float::with_val(64, &e.0))),
            "no element shows the rounding"
        );
    }

    #[test]
    fn significant_digit_formatting() {
        // e = 2.71828182845904..., truncated (not rounded) to 10 digits.
        let e = Mp::new(1.0, Precision(256)).exp();
        assert_eq!(e.to_significant(10), "2.718281828");
        assert_eq!(Mp::new(-0.00125, Precision(64)).to_significant(3), "-0.00125");
        assert_eq!(Mp::new(1001.5, Precision(64)).to_significant(6), "1001.50");
        assert_eq!(Mp::new(2048.0, Precision(64)).to_significant(2), "2000");
        assert_eq!(Mp::new(2f64.powi(-23), Precision(64)).to_significant(3), "1.19e-7");
        assert_eq!(Mp::new(f64::NEG_INFINITY, Precision(64)).to_significant(3), "-inf");
        // An integer part longer than the digits asked for is padded with zeros to its full length.
        assert_eq!(Mp::new(123456.0, Precision(64)).to_significant(3), "123000");
        // `Display` prints 30 digits unless a precision is given.
        let third = Mp::new(1.0, Precision(256)) / Mp::new(3.0, Precision(256));
        assert_eq!(format!("{third:.4}"), "0.3333");
        assert_eq!(format!("{third}"), format!("0.{}", "3".repeat(30)));
    }

    #[test]
    fn a_value_keeps_its_precision() {
        assert_eq!(Mp::new(1.0, Precision(100)).precision(), Precision(100));
        assert_eq!(Mp::new(1.0, Precision(53)).exp().precision(), Precision(53));
        assert_eq!(Real::ctx(&Mp::new(1.0, Precision(100))), Precision(100));
    }

    #[test]
    fn nan_and_infinities_are_classified() {
        let mp = |x: f64| Mp::new(x, Precision(64));
        assert!(Real::is_nan(&mp(f64::NAN)) && Real::is_nan(&f64::NAN));
        assert!(!Real::is_nan(&mp(f64::INFINITY)) && !Real::is_nan(&f64::INFINITY));
        assert!(!Real::is_finite(&mp(f64::NEG_INFINITY)) && !Real::is_finite(&f64::NEG_INFINITY));
        assert!(Real::is_finite(&mp(-2.5)) && Real::is_finite(&-2.5f64));
    }

    #[test]
    fn f64_converts_to_itself() {
        for x in [2.5, -0.0, f64::NEG_INFINITY, f64::MIN_POSITIVE] {
            assert_eq!(Real::to_f64(&x).to_bits(), x.to_bits());
            assert_eq!(<f64 as Real>::from_f64(x, ()).to_bits(), x.to_bits());
        }
    }

    #[test]
    fn a_tie_keeps_the_running_maximum() {
        // On equal values `max` returns its receiver, the maximum so far, so a row's running maximum is the first of
        // equal logits: visible only in the sign of a zero.
        assert!(Real::max(0.0f64, -0.0).is_sign_positive());
        assert!(Real::max(-0.0f64, 0.0).is_sign_negative());
        assert_eq!(Real::max(1.0f64, 2.0), 2.0);
        assert_eq!(Real::max(2.0f64, 1.0), 2.0);
        let zero = |x: f64| Mp::new(x, Precision(64));
        assert!(Real::max(zero(-0.0), zero(0.0)).0.is_sign_negative());
    }

    #[test]
    fn contiguous_views_reach_faer_in_place_and_strided_ones_are_copied() {
        let a = array![[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]];
        let row_major = a.view();
        let column_major = a.t();
        let strided = a.slice_axis(Axis(1), ndarray::Slice::new(0, None, 2));
        let in_place = |view: &ArrayView2<'_, f64>| as_faer(view).map(|m| m.as_ptr() == view.as_ptr());
        assert_eq!(in_place(&row_major), Some(true));
        assert_eq!(in_place(&column_major), Some(true));
        assert_eq!(in_place(&strided), None);
        assert_eq!(f64::matmul(strided, strided.t(), ()), naive_matmul(strided, strided.t(), ()));
    }
}
