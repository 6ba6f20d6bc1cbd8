//! Problem specifications: layout (dense batch or varlen), heads and GQA (E1b), head dims,
//! scale, and masks (E1a), with the validation that turns bad input into typed errors.

use std::fmt;
use std::sync::Arc;

use ndarray::{ArrayView1, ArrayView2, ArrayViewD, Dimension, Ix1, Ix2, IxDyn, SliceInfo, SliceInfoElem};

use crate::error::OracleError;
use crate::real::Real;

/// How the sequences of a batch are laid out in memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `batch` sequences of equal lengths; tensors `[B, H, L, D]`, LSE `[B, Hq, Lq]`.
    Dense {
        /// Number of sequences.
        batch: usize,
        /// Query length of every sequence.
        len_q: usize,
        /// Key length of every sequence.
        len_k: usize,
    },
    /// Packed sequences of varying lengths; tensors `[T, H, D]`, LSE `[Hq, Tq]`. Sequence `b`
    /// holds rows `cu_seqlens[b] .. cu_seqlens[b + 1]`; zero-length sequences are allowed.
    Varlen {
        /// Cumulative query lengths, starting at 0, non-decreasing.
        cu_seqlens_q: Vec<i32>,
        /// Cumulative key lengths, starting at 0, non-decreasing, as long as `cu_seqlens_q`.
        cu_seqlens_k: Vec<i32>,
    },
}

/// One query/key position pair inside a sequence, as a mask predicate sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pair {
    /// Query row within its sequence.
    pub query: usize,
    /// Key column within its sequence.
    pub key: usize,
    /// Query length of the sequence.
    pub len_q: usize,
    /// Key length of the sequence.
    pub len_k: usize,
}

impl Pair {
    /// The query position aligned to the key axis (bottom-right alignment, E1a):
    /// `i + Lk − Lq`, which may be negative when `Lq > Lk`.
    pub fn aligned_query(&self) -> i64 {
        self.query as i64 + self.len_k as i64 - self.len_q as i64
    }
}

/// An arbitrary visibility predicate, for masks the named ones do not cover.
#[derive(Clone)]
pub struct Predicate {
    /// A name for error messages and snapshots.
    pub name: String,
    /// `true` where the key is visible to the query.
    pub visible: Arc<dyn Fn(Pair) -> bool + Send + Sync>,
}

impl fmt::Debug for Predicate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Predicate({})", self.name)
    }
}

/// Which keys each query sees (E1a). Masks compose by AND.
#[derive(Clone, Debug, Default)]
pub enum Mask {
    /// Every key is visible.
    #[default]
    None,
    /// Bottom-right causal: visible iff `j ≤ i + Lk − Lq`.
    Causal,
    /// Sliding window: visible iff `i + Lk − Lq − left ≤ j ≤ i + Lk − Lq + right`.
    Window {
        /// Keys visible before the aligned query position.
        left: usize,
        /// Keys visible after the aligned query position.
        right: usize,
    },
    /// NSA's compressed branch (E18): the keys are compression windows of `len` tokens taken every `stride` tokens,
    /// and key `j` (window `j`) is visible to query `i` iff the window has ended at or before it:
    /// `j·stride + len − 1 ≤ i`, i.e. `j ≤ ⌊(i + 1 − len)/stride⌋`. Query positions are the sequence's own (no
    /// bottom-right alignment: the queries are the tokens, the keys their windows, and `Lk ≠ Lq`).
    StridedCausal {
        /// Tokens per window `l` (at least 1).
        len: usize,
        /// Tokens between two windows' starts `s` (at least 1).
        stride: usize,
    },
    /// A caller-given predicate.
    Predicate(Predicate),
    /// All of the given masks at once.
    And(Vec<Mask>),
}

impl Mask {
    /// Whether key `pair.key` is visible to query `pair.query`.
    pub fn visible(&self, pair: Pair) -> bool {
        let j = pair.key as i64;
        let i = pair.aligned_query();
        match self {
            Mask::None => true,
            Mask::Causal => j <= i,
            Mask::Window { left, right } => i - *left as i64 <= j && j <= i + *right as i64,
            Mask::StridedCausal { len, stride } => pair.key * stride + len <= pair.query + 1,
            Mask::Predicate(p) => (p.visible)(pair),
            Mask::And(parts) => parts.iter().all(|m| m.visible(pair)),
        }
    }

    /// A range of keys that contains every key visible to `query` (exact for the named masks,
    /// all keys under a predicate). Schedules use it to skip tiles that hold no visible key.
    pub fn key_range(&self, query: usize, len_q: usize, len_k: usize) -> std::ops::Range<usize> {
        let i = Pair { query, key: 0, len_q, len_k }.aligned_query();
        let clamp = |lo: i64, hi_inclusive: i64| -> std::ops::Range<usize> {
            let lo = lo.clamp(0, len_k as i64) as usize;
            let hi = (hi_inclusive + 1).clamp(0, len_k as i64) as usize;
            lo..hi.max(lo)
        };
        match self {
            Mask::None | Mask::Predicate(_) => 0..len_k,
            Mask::Causal => clamp(0, i),
            Mask::Window { left, right } => clamp(i - *left as i64, i + *right as i64),
            Mask::StridedCausal { len, stride } => 0..strided_causal_keys(query, *len, *stride).min(len_k),
            Mask::And(parts) => parts.iter().fold(0..len_k, |acc, m| {
                let r = m.key_range(query, len_q, len_k);
                let (lo, hi) = (acc.start.max(r.start), acc.end.min(r.end));
                lo..hi.max(lo)
            }),
        }
    }

    /// A typed error for a [`Mask::StridedCausal`] (anywhere in the mask) with a zero window length or stride.
    pub fn check(&self) -> Result<(), OracleError> {
        match self {
            Mask::StridedCausal { len: 0, .. } => Err(OracleError::ZeroDimension { argument: "mask.len" }),
            Mask::StridedCausal { stride: 0, .. } => Err(OracleError::ZeroDimension { argument: "mask.stride" }),
            Mask::And(parts) => parts.iter().try_for_each(Mask::check),
            _ => Ok(()),
        }
    }

    /// Whether every row's visible keys are exactly [`Mask::key_range`] (no predicate anywhere in the mask).
    fn is_interval(&self) -> bool {
        match self {
            Mask::None | Mask::Causal | Mask::Window { .. } | Mask::StridedCausal { .. } => true,
            Mask::Predicate(_) => false,
            Mask::And(parts) => parts.iter().all(Mask::is_interval),
        }
    }

    /// The visibility matrix `[len_q, len_k]` of one sequence. Masks without a predicate fill each row's key range
    /// (a memset per row); a predicate is asked element by element.
    pub fn matrix(&self, len_q: usize, len_k: usize) -> ndarray::Array2<bool> {
        if !self.is_interval() {
            return ndarray::Array2::from_shape_fn((len_q, len_k), |(query, key)| {
                self.visible(Pair { query, key, len_q, len_k })
            });
        }
        let mut m = ndarray::Array2::from_elem((len_q, len_k), false);
        for (query, mut row) in m.rows_mut().into_iter().enumerate() {
            let keys = self.key_range(query, len_q, len_k);
            row.slice_mut(ndarray::s![keys]).fill(true);
        }
        m
    }
}

/// How many keys [`Mask::StridedCausal`] shows query `query`: the windows `j` with `j·stride + len − 1 ≤ query`,
/// `⌊(query + 1 − len)/stride⌋ + 1` once `query + 1 ≥ len`, else none. A zero `stride` (which
/// [`AttentionSpec::validate`] refuses) shows none.
pub fn strided_causal_keys(query: usize, len: usize, stride: usize) -> usize {
    match (query + 1).checked_sub(len) {
        Some(reach) if stride > 0 => reach / stride + 1,
        _ => 0,
    }
}

/// The softmax scale `α`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Scale {
    /// `1/√d`, computed in the oracle's own precision.
    #[default]
    InverseSqrtHeadDim,
    /// A given value (finite).
    Value(f64),
}

impl Scale {
    /// `α` for head dimension `head_dim` in `ctx`'s precision: `1/√d` computed there, or the given value. Every
    /// family takes its scale from here; call [`Scale::check`] first.
    pub fn value<S: Real>(self, head_dim: usize, ctx: S::Ctx) -> S {
        match self {
            Scale::InverseSqrtHeadDim => S::one(ctx) / S::from_f64(head_dim as f64, ctx).sqrt(),
            Scale::Value(x) => S::from_f64(x, ctx),
        }
    }

    /// A typed error for a given value that is not finite.
    pub fn check(self) -> Result<(), OracleError> {
        match self {
            Scale::Value(x) if !x.is_finite() => {
                Err(OracleError::NonFinite { argument: "scale", index: vec![], value: x })
            }
            _ => Ok(()),
        }
    }
}

/// Everything about an attention problem except the tensors.
#[derive(Clone, Debug)]
pub struct AttentionSpec {
    /// Dense batch or varlen.
    pub layout: Layout,
    /// Query heads `Hq`.
    pub n_heads_q: usize,
    /// Key/value heads `Hkv`; `Hq % Hkv == 0` (E1b).
    pub n_heads_kv: usize,
    /// Query/key head dimension `d`.
    pub head_dim: usize,
    /// Value head dimension `dv` (may differ from `d`).
    pub head_dim_v: usize,
    /// Softmax scale.
    pub scale: Scale,
    /// Visibility mask.
    pub mask: Mask,
}

/// One sequence of a batch: where its rows start and how many there are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sequence {
    /// Index in the batch.
    pub index: usize,
    /// First query row (varlen: packed row; dense: 0).
    pub q_start: usize,
    /// Query length.
    pub len_q: usize,
    /// First key row (varlen: packed row; dense: 0).
    pub k_start: usize,
    /// Key length.
    pub len_k: usize,
}

/// Which tensor a shape belongs to, for expected-shape computation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    /// Queries `[.., Hq, .., d]`.
    Q,
    /// Keys `[.., Hkv, .., d]`.
    K,
    /// Values `[.., Hkv, .., dv]`.
    V,
    /// Outputs and their gradients `[.., Hq, .., dv]`.
    O,
    /// Row statistics (LSE, D): dense `[B, Hq, Lq]`, varlen `[Hq, Tq]`.
    RowStat,
}

impl AttentionSpec {
    /// A dense problem with default scale and no mask.
    pub fn dense(
        batch: usize,
        n_heads_q: usize,
        n_heads_kv: usize,
        len_q: usize,
        len_k: usize,
        head_dim: usize,
        head_dim_v: usize,
    ) -> Self {
        AttentionSpec {
            layout: Layout::Dense { batch, len_q, len_k },
            n_heads_q,
            n_heads_kv,
            head_dim,
            head_dim_v,
            scale: Scale::default(),
            mask: Mask::None,
        }
    }

    /// The same problem with another mask.
    pub fn with_mask(mut self, mask: Mask) -> Self {
        self.mask = mask;
        self
    }

    /// The same problem with another scale.
    pub fn with_scale(mut self, scale: Scale) -> Self {
        self.scale = scale;
        self
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.n_heads_q / self.n_heads_kv
    }

    /// The KV head read by query head `h` (E1b): `h / (Hq/Hkv)`.
    pub fn kv_head(&self, h: usize) -> usize {
        h / self.group_size()
    }

    /// `α` in the precision of `ctx`.
    pub fn scale_value<S: Real>(&self, ctx: S::Ctx) -> S {
        self.scale.value(self.head_dim, ctx)
    }

    /// Checks everything that does not involve tensors: dims, head ratio, cu_seqlens, scale.
    pub fn validate(&self) -> Result<(), OracleError> {
        if self.head_dim == 0 {
            return Err(OracleError::ZeroDimension { argument: "head_dim" });
        }
        if self.head_dim_v == 0 {
            return Err(OracleError::ZeroDimension { argument: "head_dim_v" });
        }
        if self.n_heads_q == 0 {
            return Err(OracleError::ZeroDimension { argument: "n_heads_q" });
        }
        if self.n_heads_kv == 0 || !self.n_heads_q.is_multiple_of(self.n_heads_kv) {
            return Err(OracleError::HeadRatio { n_heads_q: self.n_heads_q, n_heads_kv: self.n_heads_kv });
        }
        self.scale.check()?;
        self.mask.check()?;
        if let Layout::Varlen { cu_seqlens_q, cu_seqlens_k } = &self.layout {
            check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)?;
            check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)?;
            if cu_seqlens_q.len() != cu_seqlens_k.len() {
                return Err(OracleError::CuSeqlens {
                    argument: "cu_seqlens_k",
                    reason: format!("has {} entries but cu_seqlens_q has {}", cu_seqlens_k.len(), cu_seqlens_q.len()),
                });
            }
        }
        Ok(())
    }

    /// The sequences of the batch, in order. Call after [`AttentionSpec::validate`].
    pub fn sequences(&self) -> Vec<Sequence> {
        match &self.layout {
            Layout::Dense { batch, len_q, len_k } => (0..*batch)
                .map(|index| Sequence { index, q_start: 0, len_q: *len_q, k_start: 0, len_k: *len_k })
                .collect(),
            Layout::Varlen { cu_seqlens_q, cu_seqlens_k } => (0..cu_seqlens_q.len() - 1)
                .map(|index| Sequence {
                    index,
                    q_start: cu_seqlens_q[index] as usize,
                    len_q: (cu_seqlens_q[index + 1] - cu_seqlens_q[index]) as usize,
                    k_start: cu_seqlens_k[index] as usize,
                    len_k: (cu_seqlens_k[index + 1] - cu_seqlens_k[index]) as usize,
                })
                .collect(),
        }
    }

    /// The shape a tensor must have.
    pub fn expected_shape(&self, operand: Operand) -> Vec<usize> {
        let (heads, dim) = match operand {
            Operand::Q => (self.n_heads_q, self.head_dim),
            Operand::K => (self.n_heads_kv, self.head_dim),
            Operand::V => (self.n_heads_kv, self.head_dim_v),
            Operand::O | Operand::RowStat => (self.n_heads_q, self.head_dim_v),
        };
        match &self.layout {
            Layout::Dense { batch, len_q, len_k } => {
                let len = if matches!(operand, Operand::K | Operand::V) { *len_k } else { *len_q };
                if operand == Operand::RowStat { vec![*batch, heads, len] } else { vec![*batch, heads, len, dim] }
            }
            Layout::Varlen { cu_seqlens_q, cu_seqlens_k } => {
                let total = |cu: &[i32]| *cu.last().expect("validated: non-empty") as usize;
                let len =
                    if matches!(operand, Operand::K | Operand::V) { total(cu_seqlens_k) } else { total(cu_seqlens_q) };
                if operand == Operand::RowStat { vec![heads, len] } else { vec![len, heads, dim] }
            }
        }
    }

    /// Checks a tensor's shape and that it holds only finite values.
    pub fn check_tensor<S: Real>(
        &self,
        argument: &'static str,
        operand: Operand,
        t: &ArrayViewD<'_, S>,
    ) -> Result<(), OracleError> {
        let expected = self.expected_shape(operand);
        if t.shape() != expected.as_slice() {
            return Err(OracleError::ShapeMismatch { argument, expected, actual: t.shape().to_vec() });
        }
        // A flat scan (the indexed iterator builds a dynamic index per element, a few percent of a large forward); the
        // index is recovered only for the error.
        if let Some(position) = t.iter().position(|x| !x.is_finite()) {
            let index = ndarray::indices(t.shape()).into_iter().nth(position).expect("a position inside the tensor");
            let value = t.iter().nth(position).expect("a position inside the tensor").to_f64();
            return Err(OracleError::NonFinite { argument, index: index.slice().to_vec(), value });
        }
        Ok(())
    }

    /// The slice of a `[B,H,L,D]` or `[T,H,D]` tensor that holds head `head` of sequence `seq`
    /// (its query rows, or its key rows when `keys`); it views as `[L, D]`.
    pub fn head_slice(&self, seq: &Sequence, head: usize, keys: bool) -> SliceInfo<Vec<SliceInfoElem>, IxDyn, IxDyn> {
        let (start, len) = if keys { (seq.k_start, seq.len_k) } else { (seq.q_start, seq.len_q) };
        let elems: Vec<SliceInfoElem> = match self.layout {
            Layout::Dense { .. } => vec![
                SliceInfoElem::Index(seq.index as isize),
                SliceInfoElem::Index(head as isize),
                SliceInfoElem::from(..),
                SliceInfoElem::from(..),
            ],
            Layout::Varlen { .. } => vec![
                SliceInfoElem::from(start..start + len),
                SliceInfoElem::Index(head as isize),
                SliceInfoElem::from(..),
            ],
        };
        SliceInfo::try_from(elems).expect("slice elements match the validated rank")
    }

    /// The slice of a row-statistics tensor (LSE or D; dense `[B,Hq,Lq]`, varlen `[Hq,Tq]`) that
    /// holds head `head` of sequence `seq`; it views as `[Lq]`.
    pub fn row_stat_slice(&self, seq: &Sequence, head: usize) -> SliceInfo<Vec<SliceInfoElem>, IxDyn, IxDyn> {
        let elems: Vec<SliceInfoElem> = match self.layout {
            Layout::Dense { .. } => {
                vec![
                    SliceInfoElem::Index(seq.index as isize),
                    SliceInfoElem::Index(head as isize),
                    SliceInfoElem::from(..),
                ]
            }
            Layout::Varlen { .. } => {
                vec![SliceInfoElem::Index(head as isize), SliceInfoElem::from(seq.q_start..seq.q_start + seq.len_q)]
            }
        };
        SliceInfo::try_from(elems).expect("slice elements match the validated rank")
    }

    /// Head `head` of sequence `seq` of a validated tensor, as `[L, D]`.
    pub fn head_rows<'a, S>(&self, t: ArrayViewD<'a, S>, seq: &Sequence, head: usize, keys: bool) -> ArrayView2<'a, S> {
        t.slice_move(self.head_slice(seq, head, keys)).into_dimensionality::<Ix2>().expect("head slice has rank 2")
    }

    /// Row statistics of head `head` of sequence `seq` of a validated tensor, as `[Lq]`.
    pub fn head_row_stat<'a, S>(&self, t: ArrayViewD<'a, S>, seq: &Sequence, head: usize) -> ArrayView1<'a, S> {
        t.slice_move(self.row_stat_slice(seq, head)).into_dimensionality::<Ix1>().expect("row-stat slice has rank 1")
    }
}

fn check_cu_seqlens(argument: &'static str, cu: &[i32]) -> Result<(), OracleError> {
    let err = |reason: String| Err(OracleError::CuSeqlens { argument, reason });
    match cu.first() {
        None => return err("is empty; it needs at least the leading 0".into()),
        Some(&first) if first != 0 => return err(format!("starts at {first}, not 0")),
        _ => {}
    }
    if let Some(w) = cu.windows(2).position(|w| w[1] < w[0]) {
        return err(format!("decreases at index {}: {} then {}", w + 1, cu[w], cu[w + 1]));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_predicate_prints_its_name() {
        // Error messages and snapshots name a custom mask by its name; the closure itself has no printable form.
        let mask = Mask::Predicate(Predicate {
            name: "even keys".into(),
            visible: Arc::new(|p: Pair| p.key.is_multiple_of(2)),
        });
        assert_eq!(format!("{mask:?}"), "Predicate(Predicate(even keys))");
    }

    #[test]
    fn a_matrix_filled_by_key_ranges_is_the_masks_element_by_element() {
        let even =
            Mask::Predicate(Predicate { name: "even".into(), visible: Arc::new(|p: Pair| p.key.is_multiple_of(2)) });
        let masks = [
            Mask::None,
            Mask::Causal,
            Mask::Window { left: 0, right: 0 },
            Mask::Window { left: 3, right: 1 },
            Mask::Window { left: 100, right: 100 },
            Mask::And(vec![Mask::Causal, Mask::Window { left: 2, right: 5 }]),
            Mask::And(vec![Mask::Causal, even.clone()]),
            even,
            Mask::StridedCausal { len: 4, stride: 2 },
            Mask::StridedCausal { len: 1, stride: 1 },
            Mask::StridedCausal { len: 3, stride: 5 },
            Mask::And(vec![Mask::StridedCausal { len: 2, stride: 3 }, Mask::Window { left: 1, right: 1 }]),
        ];
        for mask in &masks {
            for (len_q, len_k) in [(7, 7), (9, 4), (4, 9), (0, 5), (5, 0), (1, 1), (40, 3)] {
                let by_element = ndarray::Array2::from_shape_fn((len_q, len_k), |(query, key)| {
                    mask.visible(Pair { query, key, len_q, len_k })
                });
                assert_eq!(mask.matrix(len_q, len_k), by_element, "{mask:?} {len_q}x{len_k}");
            }
        }
    }

    #[test]
    fn a_compression_window_is_visible_from_its_last_token_on() {
        // E18 with the paper's l = 32, s = 16: window j covers tokens 16j ..= 16j + 31, so query 31 sees window 0
        // alone, query 46 still only window 0, query 47 windows 0 and 1; query 30 sees nothing.
        let mask = Mask::StridedCausal { len: 32, stride: 16 };
        let keys = |query| mask.key_range(query, 100, 10);
        assert_eq!([keys(30), keys(31), keys(46), keys(47), keys(99)], [0..0, 0..1, 0..1, 0..2, 0..5]);
        assert_eq!(strided_causal_keys(65535, 32, 16), 4095);
        // A zero stride shows nothing (and divides by nothing), as its doc says.
        assert_eq!([strided_causal_keys(5, 2, 0), strided_causal_keys(1, 2, 0)], [0, 0]);
        assert!(mask.visible(Pair { query: 47, key: 1, len_q: 100, len_k: 10 }));
        assert!(!mask.visible(Pair { query: 46, key: 1, len_q: 100, len_k: 10 }));
        // A window never complete in the sequence is outside the key range, whatever the keys' count says.
        assert_eq!(mask.key_range(99, 100, 3), 0..3);
        let spec =
            |len, stride| AttentionSpec::dense(1, 1, 1, 4, 4, 8, 8).with_mask(Mask::StridedCausal { len, stride });
        assert!(matches!(spec(0, 1).validate(), Err(OracleError::ZeroDimension { argument: "mask.len" })));
        assert!(matches!(spec(1, 0).validate(), Err(OracleError::ZeroDimension { argument: "mask.stride" })));
        let nested = AttentionSpec::dense(1, 1, 1, 4, 4, 8, 8)
            .with_mask(Mask::And(vec![Mask::Causal, Mask::StridedCausal { len: 2, stride: 0 }]));
        assert!(matches!(nested.validate(), Err(OracleError::ZeroDimension { argument: "mask.stride" })));
        assert!(spec(1, 1).validate().is_ok());
    }

    #[test]
    fn a_non_finite_input_is_named_by_its_index() {
        let spec = AttentionSpec::dense(1, 2, 2, 3, 3, 4, 4);
        let mut q = ndarray::ArrayD::<f64>::zeros(IxDyn(&[1, 2, 3, 4]));
        q[[0, 1, 2, 3]] = f64::NAN;
        q[[0, 1, 2, 2]] = f64::INFINITY;
        match spec.check_tensor("q", Operand::Q, &q.view()) {
            Err(OracleError::NonFinite { argument, index, value }) => {
                assert_eq!((argument, index, value), ("q", vec![0, 1, 2, 2], f64::INFINITY));
            }
            other => panic!("{other:?}"),
        }
        q[[0, 1, 2, 2]] = 1.0;
        q[[0, 1, 2, 3]] = 2.0;
        assert!(spec.check_tensor("q", Operand::Q, &q.view()).is_ok());
    }
}
