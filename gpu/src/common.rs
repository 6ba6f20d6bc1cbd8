//! Helpers every kernel family of the crate shares: the storage types the kernels read and write ([`GpuElement`]),
//! the mask as the kernels evaluate it ([`KernelMask`]) with its unbounded-reach sentinel ([`NO_BOUND`]), the softmax
//! scale the kernels multiply by ([`kernel_scale`]), the kernels' limits, the buffer-length and 32-bit checks of
//! every launch wrapper and the launch grids' extents (`grid_3d`), and the shape rules of the token-list kernels (NSA's
//! and DSA's causal self-attention layers, `check_causal_self_attention`, and their lists' token rows, `token_rows`).
//! They live in one module that imports no other module of the crate but the errors, so that
//! the launch modules (`flash`, `backward`, `ring`) can share them without importing each other.

use attnproof_oracle::{AttentionSpec, Layout, Mask, Scale};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use crate::error::GpuError;

/// "No bound" for a window side, as the kernels receive it (`NO_BOUND` in `gpu/kernels/common.cuh`): key positions
/// are below `2^30` (the launch plans check `Lq + Lk ≤ 2^30` per sequence), so a reach of `2^30` admits every key,
/// and a position plus or minus it still fits the kernels' 32-bit `int`s.
pub const NO_BOUND: i64 = 1 << 30;

/// Largest head dim (`d` and `dv`) the kernels support.
pub const MAX_HEAD_DIM: usize = 256;

/// What the kernels' flush-to-zero `ex2` may lose to underflow: every result below `2^-126`, the smallest normal f32
/// (the recipes' `exp_underflow`, the same for the forward and the backward; see the module docs of
/// [`crate::flash`] and [`crate::backward`]).
pub const EXP_UNDERFLOW: f64 = f32::MIN_POSITIVE as f64;

/// A storage type the kernels read and write.
pub trait GpuElement: DeviceRepr + ValidAsZeroBits + Copy + Send + Sync + std::fmt::Debug + 'static {
    /// Name for errors (`bf16`, `f16`).
    const NAME: &'static str;
    /// The kernels' `-D` define selecting this type.
    const DEFINE: &'static str;
    /// Whether the value is finite.
    fn is_finite_value(self) -> bool;
}

impl GpuElement for bf16 {
    const NAME: &'static str = "bf16";
    const DEFINE: &'static str = "ELEM_BF16";
    fn is_finite_value(self) -> bool {
        self.is_finite()
    }
}

impl GpuElement for f16 {
    const NAME: &'static str = "f16";
    const DEFINE: &'static str = "ELEM_F16";
    fn is_finite_value(self) -> bool {
        self.is_finite()
    }
}

/// A mask as the kernels evaluate it: key `j` visible to row `i` iff `diag(i) − left ≤ j ≤ diag(i) + right`, with
/// `None` meaning unbounded on that side and `diag` the row's [`Diagonal`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelMask {
    /// Keys visible before the row's diagonal (`None`: all).
    pub left: Option<usize>,
    /// Keys visible after the row's diagonal (`None`: all; causal is `Some(0)`).
    pub right: Option<usize>,
    /// Which key position each row's diagonal is.
    pub diagonal: Diagonal,
}

/// The key position a query row's window is measured from (the kernels' `Diagonal`, `gpu/kernels/common.cuh`).
/// Monotone in the row, so that a tile's first and last rows bound every row's visible keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Diagonal {
    /// `i + Lk − Lq`: the causal and window masks, aligned bottom-right (E1a).
    BottomRight,
    /// `⌊(i + 1 − len)/stride⌋`: the last compression window of `len` tokens, taken every `stride`, that has ended at
    /// token `i` (NSA's compressed branch, E18, [`Mask::StridedCausal`] with `right = 0`).
    Strided {
        /// Tokens per window.
        len: usize,
        /// Tokens between two windows' starts.
        stride: usize,
    },
}

impl Diagonal {
    /// The kernels' `diag_stride`: 0 for [`Diagonal::BottomRight`], else the stride.
    pub(crate) fn kernel_stride(self) -> Result<i32, GpuError> {
        match self {
            Diagonal::BottomRight => Ok(0),
            Diagonal::Strided { stride, .. } => to_i32("mask.stride", stride),
        }
    }

    /// The kernels' `diag_offset`: `1 − len` for [`Diagonal::Strided`], else 0.
    pub(crate) fn kernel_offset(self) -> Result<i32, GpuError> {
        match self {
            Diagonal::BottomRight => Ok(0),
            Diagonal::Strided { len, .. } => Ok(1 - to_i32("mask.len", len)?),
        }
    }
}

impl KernelMask {
    /// Every key of every row: the identity of [`Mask::And`].
    const OPEN: KernelMask = KernelMask { left: None, right: None, diagonal: Diagonal::BottomRight };

    /// Translates a spec mask; `And` intersects (smallest reach on each side); a predicate is unsupported, and so is a
    /// strided causal mask combined with any bound of another diagonal.
    pub fn from_mask(mask: &Mask) -> Result<Self, GpuError> {
        let min = |a: Option<usize>, b: Option<usize>| match (a, b) {
            (Some(x), Some(y)) => Some(x.min(y)),
            (x, None) => x,
            (None, y) => y,
        };
        Ok(match mask {
            Mask::None => KernelMask::OPEN,
            Mask::Causal => KernelMask { right: Some(0), ..KernelMask::OPEN },
            Mask::Window { left, right } => KernelMask { left: Some(*left), right: Some(*right), ..KernelMask::OPEN },
            Mask::StridedCausal { len, stride } => {
                KernelMask { left: None, right: Some(0), diagonal: Diagonal::Strided { len: *len, stride: *stride } }
            }
            Mask::Predicate(p) => {
                return Err(GpuError::Unsupported {
                    argument: "mask",
                    reason: format!("predicate mask `{}`: the kernel evaluates only causal and window bounds", p.name),
                });
            }
            Mask::And(parts) => parts.iter().try_fold(KernelMask::OPEN, |acc, m| {
                let k = KernelMask::from_mask(m)?;
                let diagonal = if k == KernelMask::OPEN || acc.diagonal == k.diagonal {
                    acc.diagonal
                } else if acc == KernelMask::OPEN {
                    k.diagonal
                } else {
                    return Err(GpuError::Unsupported {
                        argument: "mask",
                        reason: format!(
                            "{mask:?}: bounds measured from two different diagonals (a strided causal mask combines \
                             only with itself and with masks that bound nothing)"
                        ),
                    });
                };
                Ok::<_, GpuError>(KernelMask { left: min(acc.left, k.left), right: min(acc.right, k.right), diagonal })
            })?,
        })
    }

    /// The side's reach as the kernels' `int`: values beyond any length are [`NO_BOUND`].
    pub(crate) fn kernel_value(side: Option<usize>) -> i32 {
        side.map_or(NO_BOUND, |x| i64::try_from(x).unwrap_or(NO_BOUND).min(NO_BOUND)) as i32
    }
}

/// The scale the kernels multiply the dot products by: `fl32(1/√d)` computed as the reference does, or the given
/// value rounded to f32.
pub fn kernel_scale(spec: &AttentionSpec) -> f32 {
    match spec.scale {
        Scale::InverseSqrtHeadDim => 1.0 / (spec.head_dim as f32).sqrt(),
        Scale::Value(x) => x as f32,
    }
}

/// The context's device's multiprocessors (at least 1): what persistent grids are sized by.
pub fn multiprocessors(ctx: &Arc<CudaContext>) -> Result<usize, GpuError> {
    let sms = ctx
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| GpuError::driver("cuDeviceGetAttribute(multiprocessor count)", e))?;
    Ok(sms.max(1) as usize)
}

/// `value` as a kernel's 32-bit `int`, or [`GpuError::TooLarge`] naming `argument`.
pub(crate) fn to_i32(argument: &'static str, value: usize) -> Result<i32, GpuError> {
    i32::try_from(value).map_err(|_| GpuError::TooLarge { argument, value })
}

/// Checks that the device buffer `argument` holds at least `needed` elements.
pub(crate) fn check_len<X>(argument: &'static str, buffer: &CudaSlice<X>, needed: usize) -> Result<(), GpuError> {
    if buffer.len() < needed {
        return Err(GpuError::BufferTooSmall { argument, needed, actual: buffer.len() });
    }
    Ok(())
}

/// One extent of a launch grid, `value` CTAs along an axis that holds at most `max` (CUDA: 2^31 − 1 along x, 65 535
/// along y and z), or [`GpuError::TooLarge`] naming `argument`.
pub(crate) fn grid_dim(argument: &'static str, value: usize, max: usize) -> Result<u32, GpuError> {
    u32::try_from(value).ok().filter(|&x| x as usize <= max).ok_or(GpuError::TooLarge { argument, value })
}

/// A launch grid of `(name, CTAs)` along x, y and z within CUDA's limits ([`grid_dim`]).
pub(crate) fn grid_3d(
    (x_name, x): (&'static str, usize),
    (y_name, y): (&'static str, usize),
    (z_name, z): (&'static str, usize),
) -> Result<(u32, u32, u32), GpuError> {
    Ok((grid_dim(x_name, x, i32::MAX as usize)?, grid_dim(y_name, y, 65535)?, grid_dim(z_name, z, 65535)?))
}

/// Checks that `spec` describes a causal self-attention layer, what NSA's and DSA's token-list kernels implement:
/// valid, causal (`Mask::Causal`), every sequence's query and key lengths equal. `family` names the kernels in the
/// error ("NSA", "DSA").
pub(crate) fn check_causal_self_attention(spec: &AttentionSpec, family: &str) -> Result<(), GpuError> {
    spec.validate()?;
    if !matches!(spec.mask, Mask::Causal) {
        return Err(GpuError::Unsupported {
            argument: "mask",
            reason: format!("{family} is causal self-attention; the layer's spec has {:?}", spec.mask),
        });
    }
    if let Some(s) = spec.sequences().iter().find(|s| s.len_q != s.len_k) {
        return Err(GpuError::Unsupported {
            argument: "layout",
            reason: format!(
                "{family} is self-attention; sequence {} has {} queries and {} keys",
                s.index, s.len_q, s.len_k
            ),
        });
    }
    Ok(())
}

/// Token rows of per-token tensors (NSA's scores and lists, DSA's lists): `B · L` dense, the packed total varlen.
pub(crate) fn token_rows(spec: &AttentionSpec) -> usize {
    match &spec.layout {
        Layout::Dense { batch, len_q, .. } => batch * len_q,
        Layout::Varlen { cu_seqlens_q, .. } => cu_seqlens_q.last().copied().unwrap_or(0).max(0) as usize,
    }
}

/// The value of `#define NAME value` in a kernel text (a test's check that a host constant is the kernel's).
#[cfg(test)]
pub(crate) fn numeric_define(source: &str, name: &str) -> usize {
    let prefix = format!("#define {name} ");
    let line = source.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("the kernel defines {name}"));
    let value = line[prefix.len()..].split("//").next().unwrap_or_default().trim();
    value.parse().unwrap_or_else(|_| panic!("{name}: {value}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use attnproof_oracle::Predicate;

    #[test]
    fn masks_translate_to_bounds() {
        let m = |mask: Mask| KernelMask::from_mask(&mask).unwrap();
        let bottom_right =
            |left: Option<usize>, right: Option<usize>| KernelMask { left, right, diagonal: Diagonal::BottomRight };
        assert_eq!(m(Mask::None), bottom_right(None, None));
        assert_eq!(m(Mask::Causal), bottom_right(None, Some(0)));
        assert_eq!(m(Mask::Window { left: 3, right: 5 }), bottom_right(Some(3), Some(5)));
        assert_eq!(
            m(Mask::And(vec![Mask::Causal, Mask::Window { left: 4, right: 9 }, Mask::And(vec![])])),
            bottom_right(Some(4), Some(0))
        );
        assert_eq!(m(Mask::And(vec![])), bottom_right(None, None));
        let strided = KernelMask { left: None, right: Some(0), diagonal: Diagonal::Strided { len: 32, stride: 16 } };
        let nsa = Mask::StridedCausal { len: 32, stride: 16 };
        assert_eq!(m(nsa.clone()), strided);
        assert_eq!(m(Mask::And(vec![Mask::None, nsa.clone(), Mask::And(vec![]), nsa.clone()])), strided);
        assert_eq!((strided.diagonal.kernel_stride().unwrap(), strided.diagonal.kernel_offset().unwrap()), (16, -31));
        let plain = Diagonal::BottomRight;
        assert_eq!((plain.kernel_stride().unwrap(), plain.kernel_offset().unwrap()), (0, 0));
        assert_eq!(KernelMask::kernel_value(Some(usize::MAX)), NO_BOUND as i32);
        assert_eq!(KernelMask::kernel_value(None), NO_BOUND as i32);
        assert_eq!(KernelMask::kernel_value(Some(7)), 7);
    }

    #[test]
    fn a_strided_causal_mask_refuses_bounds_of_another_diagonal() {
        // The kernels measure every bound from one diagonal per row; a window or causal bound beside the strided
        // diagonal, or a second strided mask with other windows, would be measured from the wrong one.
        let nsa = Mask::StridedCausal { len: 32, stride: 16 };
        for other in [Mask::Causal, Mask::Window { left: 3, right: 0 }, Mask::StridedCausal { len: 16, stride: 16 }] {
            for parts in [vec![nsa.clone(), other.clone()], vec![other.clone(), nsa.clone()]] {
                let err = KernelMask::from_mask(&Mask::And(parts)).unwrap_err();
                assert!(matches!(err, GpuError::Unsupported { argument: "mask", .. }), "{err}");
            }
        }
        let huge = Diagonal::Strided { len: usize::MAX, stride: 1 };
        assert!(matches!(huge.kernel_offset(), Err(GpuError::TooLarge { argument: "mask.len", .. })));
    }

    #[test]
    fn predicate_masks_are_a_typed_error() {
        let p = Mask::Predicate(Predicate { name: "even".into(), visible: Arc::new(|pair| pair.key % 2 == 0) });
        let err = KernelMask::from_mask(&Mask::And(vec![Mask::Causal, p])).unwrap_err();
        assert!(matches!(err, GpuError::Unsupported { argument: "mask", .. }), "{err}");
    }

    #[test]
    fn the_kernels_no_bound_is_this_one() {
        // The kernels' header defines the same sentinel for their comments and checks; the two must not drift apart.
        let header = include_str!("../kernels/common.cuh");
        let line = header.lines().find(|l| l.starts_with("#define NO_BOUND ")).expect("common.cuh defines NO_BOUND");
        assert_eq!(line.trim_start_matches("#define NO_BOUND ").trim(), "(1 << 30)");
        assert_eq!(NO_BOUND, 1 << 30);
    }

    #[test]
    fn scale_is_the_rounded_inverse_square_root_or_the_given_value() {
        let spec = AttentionSpec::dense(1, 1, 1, 4, 4, 64, 64);
        assert_eq!(kernel_scale(&spec), 0.125);
        let given = AttentionSpec { scale: Scale::Value(0.3), ..spec };
        assert_eq!(kernel_scale(&given), 0.3_f32);
    }
}
