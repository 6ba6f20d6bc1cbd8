//! The case file format (`docs/case-format.md`): a safetensors file holding `q`, `k`, `v`, any
//! candidate outputs, and string metadata describing the problem and the candidate's recipe.
//! [`load`] validates everything it can before any arithmetic, so a bad file is one
//! [`CaseError`] naming the tensor or key.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use attnproof_oracle::spec::{Layout, Mask, Operand, Pair, Predicate, Sequence};
use attnproof_oracle::{AttentionSpec, Scale};
use ndarray::{Array2, ArrayD, Dimension, IxDyn};

use super::error::CaseError;
use super::recipe::{KernelParams, Recipe};
use super::safetensors::{self, Dtype, RawTensor, SafeTensors};
use super::sparsity::Sparsity;

/// The format version this loader reads.
pub const FORMAT_VERSION: &str = "1";
/// Largest case file accepted (cases are small problems; the oracle is O(L²) per head).
pub const MAX_FILE_BYTES: u64 = 1 << 30;

/// How a causal mask aligns the query and key axes when `Lq ≠ Lk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CausalAlign {
    /// Query `i` sees keys `j ≤ i + Lk − Lq` (FlashAttention, attnproof's convention).
    BottomRight,
    /// Query `i` sees keys `j ≤ i` (PyTorch SDPA's `is_causal`).
    TopLeft,
}

impl CausalAlign {
    /// The metadata spelling.
    pub fn name(self) -> &'static str {
        match self {
            CausalAlign::BottomRight => "bottom_right",
            CausalAlign::TopLeft => "top_left",
        }
    }
}

/// The base of the candidate's LSE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LseBase {
    /// Natural log.
    E,
    /// Base 2.
    Two,
}

/// What the candidate writes as the LSE of a row that sees no key (`masked_lse`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaskedLse {
    /// `−∞`, the log of an empty sum (attnproof, PyTorch's math backend).
    NegInf,
    /// `+∞` (FlashAttention 2 and 3, whose `LSE` of an empty row is `+∞` so that `exp(s − LSE)` is 0 in the backward).
    PosInf,
}

/// Which keys a query sees, as the metadata states it; [`MaskSpec::mask`] builds the oracle's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaskSpec {
    /// Causal.
    pub causal: bool,
    /// Alignment of the causal mask and the window.
    pub align: CausalAlign,
    /// Keys visible before the aligned query position (`None`: unbounded).
    pub window_left: Option<usize>,
    /// Keys visible after the aligned query position (`None`: unbounded).
    pub window_right: Option<usize>,
}

/// How far a hypothesis moves a stated mask's bounds, in keys (a mask off by one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MaskShift {
    /// Added to the causal bound: query `i` sees `j ≤ i + diagonal`.
    pub diagonal: i64,
    /// Added to the window's left reach.
    pub left: i64,
    /// Added to the window's right reach.
    pub right: i64,
}

impl MaskSpec {
    /// The oracle mask.
    pub fn mask(self) -> Mask {
        self.shifted(MaskShift::default())
    }

    /// The oracle mask with its bounds moved by `shift`.
    pub fn shifted(self, shift: MaskShift) -> Mask {
        let MaskSpec { causal, align, window_left, window_right } = self;
        let unshifted = shift == MaskShift::default();
        if unshifted && !causal && window_left.is_none() && window_right.is_none() {
            return Mask::None;
        }
        if unshifted && align == CausalAlign::BottomRight && window_left.is_none() && window_right.is_none() {
            return Mask::Causal;
        }
        let moved = |name: &str, by: i64| if by == 0 { String::new() } else { format!(" {name}{by:+}") };
        let name = format!(
            "{}{}{}{}{}{}",
            if causal { "causal " } else { "" },
            align.name(),
            match (window_left, window_right) {
                (None, None) => String::new(),
                (l, r) => format!(" window({},{})", fmt_side(l), fmt_side(r)),
            },
            moved("diagonal", shift.diagonal),
            moved("left", shift.left),
            moved("right", shift.right),
        );
        Mask::Predicate(Predicate {
            name,
            visible: Arc::new(move |pair: Pair| {
                let i = match align {
                    CausalAlign::BottomRight => pair.aligned_query(),
                    CausalAlign::TopLeft => pair.query as i64,
                };
                let j = pair.key as i64;
                (!causal || j <= i + shift.diagonal)
                    && window_left.is_none_or(|l| j >= i - (l as i64 + shift.left))
                    && window_right.is_none_or(|r| j <= i + r as i64 + shift.right)
            }),
        })
    }
}

fn fmt_side(side: Option<usize>) -> String {
    side.map_or("-1".into(), |s| s.to_string())
}

/// A loaded, validated case: the problem, the candidate's recipe and outputs, all widened to
/// f64 (exact for every storage type).
#[derive(Clone, Debug)]
pub struct CaseFile {
    /// The problem (its mask is the stated one; block or token lists in `sparsity`).
    pub spec: AttentionSpec,
    /// The stated mask.
    pub mask: MaskSpec,
    /// Block-sparse tile lists (`block_indices`) or token lists (`token_indices`), when the case states them.
    pub sparsity: Option<Sparsity>,
    /// The candidate's recipe.
    pub recipe: Recipe,
    /// The stated LSE base.
    pub lse_base: LseBase,
    /// The stated LSE of a row that sees no key (a `+∞` there is read as `−∞`).
    pub masked_lse: MaskedLse,
    /// The `kernel` metadata (free text).
    pub kernel: String,
    /// Storage type of the inputs.
    pub storage: Dtype,
    /// Inputs.
    pub q: ArrayD<f64>,
    /// Keys.
    pub k: ArrayD<f64>,
    /// Values.
    pub v: ArrayD<f64>,
    /// Candidate outputs by name (`o`, `lse`, `dq`, `dk`, `dv`), LSE as stored (any base).
    pub outputs: BTreeMap<&'static str, ArrayD<f64>>,
    /// Upstream gradient, when the case has a backward.
    pub d_out: Option<ArrayD<f64>>,
    /// All metadata as written.
    pub metadata: BTreeMap<String, String>,
}

/// Output tensors a case may hold, in report order.
pub const OUTPUT_NAMES: [&str; 5] = ["o", "lse", "dq", "dk", "dv"];

/// Reads and validates a case file.
pub fn load(path: &Path) -> Result<CaseFile, CaseError> {
    let io = |e: std::io::Error| CaseError::Io { reason: e.to_string() };
    size_within_limit(std::fs::metadata(path).map_err(io)?.len())?;
    from_bytes(&std::fs::read(path).map_err(io)?)
}

/// Refuses a file above [`MAX_FILE_BYTES`] by its size, before anything is read.
fn size_within_limit(size: u64) -> Result<(), CaseError> {
    if size > MAX_FILE_BYTES {
        return Err(CaseError::Header {
            reason: format!("file is {size} bytes, above the {MAX_FILE_BYTES}-byte limit"),
        });
    }
    Ok(())
}

/// Validates a case from the bytes of a file.
pub fn from_bytes(bytes: &[u8]) -> Result<CaseFile, CaseError> {
    from_safetensors(safetensors::parse(bytes)?)
}

pub(super) fn key_error(key: &str, reason: impl Into<String>) -> CaseError {
    CaseError::Key { key: key.into(), reason: reason.into() }
}

pub(super) fn tensor_error(name: &str, reason: impl Into<String>) -> CaseError {
    CaseError::Tensor { name: name.into(), reason: reason.into() }
}

/// Normalized spelling of a metadata value: lower case, `-` as `_`, trimmed.
fn normalized(value: &str) -> String {
    value.trim().to_ascii_lowercase().replace('-', "_")
}

fn parse_bool(key: &str, value: &str) -> Result<bool, CaseError> {
    match normalized(value).as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" | "" => Ok(false),
        other => Err(key_error(key, format!("expected true or false, got {other:?}"))),
    }
}

fn parse_window(key: &str, value: Option<&String>) -> Result<Option<usize>, CaseError> {
    let Some(value) = value else { return Ok(None) };
    if matches!(normalized(value).as_str(), "" | "none") {
        return Ok(None);
    }
    match value.trim().parse::<i64>() {
        Ok(-1) => Ok(None),
        Ok(n) if n >= 0 => Ok(Some(n as usize)),
        _ => Err(key_error(key, format!("expected an integer ≥ -1 (-1: unbounded), got {value:?}"))),
    }
}

fn from_safetensors(file: SafeTensors) -> Result<CaseFile, CaseError> {
    let SafeTensors { tensors, metadata } = file;
    let meta = |key: &str| metadata.get(key);
    if let Some(version) = meta("format_version")
        && !matches!(version.trim(), "1" | "1.0")
    {
        return Err(key_error(
            "format_version",
            format!("unsupported version {version:?} (this reader: {FORMAT_VERSION})"),
        ));
    }
    let recipe = match meta("recipe") {
        Some(r) => Recipe::with_params(r, KernelParams::from_metadata(&metadata)?)?,
        None => return Err(key_error("recipe", "missing (it selects the bound; see docs/case-format.md)")),
    };
    let raw = |name: &str| tensors.get(name);
    let required = |name: &str, why: &str| {
        raw(name).ok_or_else(|| CaseError::MissingTensor { name: name.into(), why: why.into() })
    };
    let (q_raw, k_raw, v_raw) = (
        required("q", "every case needs it")?,
        required("k", "every case needs it")?,
        required("v", "every case needs it")?,
    );
    for (name, t) in [("q", q_raw), ("k", k_raw), ("v", v_raw)] {
        if !matches!(t.dtype, Dtype::Bf16 | Dtype::F16 | Dtype::F32) {
            return Err(tensor_error(name, format!("dtype {} is not BF16, F16 or F32", t.dtype.name())));
        }
        if t.dtype != q_raw.dtype {
            return Err(tensor_error(
                name,
                format!("dtype {} differs from q's {}", t.dtype.name(), q_raw.dtype.name()),
            ));
        }
    }
    if recipe.storage != q_raw.dtype {
        return Err(key_error(
            "recipe",
            format!("{:?} takes {} inputs but q is {}", recipe.name, recipe.storage.name(), q_raw.dtype.name()),
        ));
    }
    let layout_name = meta("layout").map(|l| normalized(l).replace(['[', ']', ',', ' '], ""));
    let packed = match (layout_name.as_deref(), q_raw.shape.len()) {
        (Some("bhld" | "dense"), _) | (None, 4) => false,
        (Some("thd" | "packed" | "varlen"), _) | (None, 3) => true,
        (Some(other), _) => return Err(key_error("layout", format!("expected bhld or thd, got {other:?}"))),
        (None, rank) => return Err(tensor_error("q", format!("rank {rank}; expected [B,H,L,D] or [T,H,D]"))),
    };
    let rank = if packed { 3 } else { 4 };
    for (name, t) in [("q", q_raw), ("k", k_raw), ("v", v_raw)] {
        if t.shape.len() != rank {
            return Err(tensor_error(
                name,
                format!(
                    "shape {:?} has rank {}, layout {} needs {rank}",
                    t.shape,
                    t.shape.len(),
                    if packed { "thd" } else { "bhld" }
                ),
            ));
        }
    }
    let (hq, hkv) = (q_raw.shape[1], k_raw.shape[1]);
    let (d, dv) = (q_raw.shape[rank - 1], v_raw.shape[rank - 1]);
    if k_raw.shape[rank - 1] != d {
        return Err(tensor_error("k", format!("head dim {} differs from q's {d}", k_raw.shape[rank - 1])));
    }
    if v_raw.shape[..rank - 1] != k_raw.shape[..rank - 1] {
        return Err(tensor_error(
            "v",
            format!("shape {:?} does not match k's {:?} except the head dim", v_raw.shape, k_raw.shape),
        ));
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(tensor_error("k", format!("{hkv} KV heads do not divide q's {hq} heads")));
    }
    let layout = if packed {
        let cu = |name: &str| -> Result<Vec<i32>, CaseError> {
            let t = required(name, "the thd layout needs it")?;
            if t.dtype != Dtype::I32 || t.shape.len() != 1 {
                return Err(tensor_error(
                    name,
                    format!("must be a 1-D I32 tensor, got {} {:?}", t.dtype.name(), t.shape),
                ));
            }
            Ok(t.to_f64().into_iter().map(|x| x as i32).collect())
        };
        let (cu_q, cu_k) = (cu("cu_seqlens_q")?, cu("cu_seqlens_k")?);
        for (name, cu, total) in [("cu_seqlens_q", &cu_q, q_raw.shape[0]), ("cu_seqlens_k", &cu_k, k_raw.shape[0])] {
            if cu.first() != Some(&0) {
                return Err(tensor_error(name, "must start at 0"));
            }
            if let Some(w) = cu.windows(2).position(|w| w[1] < w[0]) {
                return Err(tensor_error(name, format!("decreases at index {}", w + 1)));
            }
            let end = cu[cu.len() - 1];
            if usize::try_from(end).ok() != Some(total) {
                return Err(tensor_error(name, format!("ends at {end}, but the packed tensor has {total} rows")));
            }
        }
        if cu_q.len() != cu_k.len() {
            return Err(tensor_error(
                "cu_seqlens_k",
                format!("has {} entries, cu_seqlens_q {}", cu_k.len(), cu_q.len()),
            ));
        }
        Layout::Varlen { cu_seqlens_q: cu_q, cu_seqlens_k: cu_k }
    } else {
        let (b, lq, lk) = (q_raw.shape[0], q_raw.shape[2], k_raw.shape[2]);
        if k_raw.shape[0] != b {
            return Err(tensor_error("k", format!("batch {} differs from q's {b}", k_raw.shape[0])));
        }
        Layout::Dense { batch: b, len_q: lq, len_k: lk }
    };
    if d == 0 || dv == 0 || hq == 0 {
        return Err(tensor_error("q", "has a zero head count or head dimension"));
    }

    let causal = meta("causal").map(|c| parse_bool("causal", c)).transpose()?.unwrap_or(false);
    let align = match meta("causal_align").map(|a| normalized(a)).as_deref() {
        None | Some("bottom_right") => CausalAlign::BottomRight,
        Some("top_left") => CausalAlign::TopLeft,
        Some(other) => {
            return Err(key_error("causal_align", format!("expected bottom_right or top_left, got {other:?}")));
        }
    };
    let mask = MaskSpec {
        causal,
        align,
        window_left: parse_window("window_left", meta("window_left"))?,
        window_right: parse_window("window_right", meta("window_right"))?,
    };
    let scale = match meta("scale").map(|s| s.trim().to_ascii_lowercase()) {
        None => Scale::InverseSqrtHeadDim,
        Some(s) if s.is_empty() || s == "default" || s == "none" => Scale::InverseSqrtHeadDim,
        Some(s) => match s.parse::<f64>() {
            Ok(x) if x.is_finite() && x != 0.0 => Scale::Value(x),
            _ => return Err(key_error("scale", format!("expected a finite non-zero number, got {s:?}"))),
        },
    };
    let lse_base = match meta("lse_base").map(|b| normalized(b)).as_deref() {
        None | Some("e" | "ln" | "natural") => LseBase::E,
        Some("2" | "2.0" | "log2" | "base2") => LseBase::Two,
        Some(other) => return Err(key_error("lse_base", format!("expected e or 2, got {other:?}"))),
    };
    let masked_lse = match meta("masked_lse").map(|m| normalized(m)).as_deref() {
        None | Some("" | "_inf" | "-inf" | "neg_inf") => MaskedLse::NegInf,
        Some("+inf" | "inf" | "pos_inf") => MaskedLse::PosInf,
        Some(other) => {
            return Err(key_error("masked_lse", format!("expected -inf or +inf, got {other:?}")));
        }
    };
    let spec =
        AttentionSpec { layout, n_heads_q: hq, n_heads_kv: hkv, head_dim: d, head_dim_v: dv, scale, mask: mask.mask() };
    spec.validate().map_err(|e| tensor_error("q", e.to_string()))?;

    let widen = |name: &str, t: &RawTensor| -> Result<ArrayD<f64>, CaseError> {
        ArrayD::from_shape_vec(IxDyn(&t.shape), t.to_f64()).map_err(|e| tensor_error(name, e.to_string()))
    };
    let finite_input = |name: &str, t: &RawTensor| -> Result<ArrayD<f64>, CaseError> {
        let a = widen(name, t)?;
        if let Some((idx, x)) = a.indexed_iter().find(|(_, x)| !x.is_finite()) {
            return Err(tensor_error(name, format!("holds {x} at {:?} (inputs must be finite)", idx.slice())));
        }
        Ok(a)
    };
    let (q, k, v) = (finite_input("q", q_raw)?, finite_input("k", k_raw)?, finite_input("v", v_raw)?);

    let mut outputs = BTreeMap::new();
    for name in OUTPUT_NAMES {
        let Some(t) = raw(name) else { continue };
        let operand = match name {
            "o" => Operand::O,
            "lse" => Operand::RowStat,
            "dq" => Operand::Q,
            "dk" => Operand::K,
            _ => Operand::V,
        };
        if !matches!(t.dtype, Dtype::Bf16 | Dtype::F16 | Dtype::F32 | Dtype::F64) {
            return Err(tensor_error(name, format!("dtype {} is not a float type", t.dtype.name())));
        }
        let expected = spec.expected_shape(operand);
        // cuDNN returns its LSE as [B, H, Lq, 1]: accept one trailing unit axis.
        let shape_ok =
            t.shape == expected || (name == "lse" && t.shape.split_last() == Some((&1, expected.as_slice())));
        if !shape_ok {
            return Err(tensor_error(name, format!("shape {:?}, expected {expected:?} for this problem", t.shape)));
        }
        let mut a =
            widen(name, t)?.into_shape_with_order(IxDyn(&expected)).map_err(|e| tensor_error(name, e.to_string()))?;
        if name == "lse" && masked_lse == MaskedLse::PosInf {
            // The stated convention for a row that sees no key (FlashAttention 2 and 3 write +∞ there), read as the
            // oracle's −∞; a +∞ in a row that sees keys then fails as any wrong value does.
            a.mapv_inplace(|x| if x == f64::INFINITY { f64::NEG_INFINITY } else { x });
        }
        outputs.insert(name, a);
    }
    let d_out = match raw("do") {
        Some(t) => {
            let expected = spec.expected_shape(Operand::O);
            if t.shape != expected {
                return Err(tensor_error("do", format!("shape {:?}, expected {expected:?} (the shape of O)", t.shape)));
            }
            if !matches!(t.dtype, Dtype::Bf16 | Dtype::F16 | Dtype::F32 | Dtype::F64) {
                return Err(tensor_error("do", format!("dtype {} is not a float type", t.dtype.name())));
            }
            Some(finite_input("do", t)?)
        }
        None => None,
    };
    if d_out.is_none()
        && let Some(g) = ["dq", "dk", "dv"].into_iter().find(|g| outputs.contains_key(g))
    {
        return Err(CaseError::MissingTensor { name: "do".into(), why: format!("needed to check {g}") });
    }

    let sparsity = Sparsity::read(raw("block_indices"), raw("token_indices"), &metadata, &spec)?;
    Ok(CaseFile {
        spec,
        mask,
        sparsity,
        recipe,
        lse_base,
        masked_lse,
        kernel: meta("kernel").cloned().unwrap_or_default(),
        storage: q_raw.dtype,
        q,
        k,
        v,
        outputs,
        d_out,
        metadata,
    })
}

impl CaseFile {
    /// The visibility of (sequence, head) under the stated mask and block or token lists.
    pub fn visibility(&self, spec: &AttentionSpec, seq: &Sequence, head: usize) -> Array2<bool> {
        match &self.sparsity {
            Some(sparsity) => sparsity.visibility(spec, seq, head),
            None => spec.mask.matrix(seq.len_q, seq.len_k),
        }
    }

    /// Whether the case holds any forward (`o`, `lse`) or backward output.
    pub fn has(&self, name: &str) -> bool {
        self.outputs.contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::spec::Pair;

    /// Every pair of a `len_q × len_k` sequence, both ways round.
    fn pairs() -> Vec<Pair> {
        let mut out = Vec::new();
        for (len_q, len_k) in [(5, 9), (9, 5), (6, 6)] {
            for query in 0..len_q {
                for key in 0..len_k {
                    out.push(Pair { query, key, len_q, len_k });
                }
            }
        }
        out
    }

    #[test]
    fn the_size_limit_is_inclusive() {
        assert!(size_within_limit(MAX_FILE_BYTES).is_ok());
        assert!(size_within_limit(0).is_ok());
        let e = size_within_limit(MAX_FILE_BYTES + 1).unwrap_err().to_string();
        assert!(e.contains(&format!("{} bytes, above the", MAX_FILE_BYTES + 1)), "{e}");
    }

    /// A stated mask means what the oracle's named masks mean: bottom-right windows and causal masks agree with
    /// `Mask::Window` and `Mask::Causal` pair by pair, and top-left ones with the same masks shifted to `i` itself.
    #[test]
    fn stated_masks_mean_what_the_oracle_masks_mean() {
        let spec = |causal, align, l, r| MaskSpec { causal, align, window_left: l, window_right: r };
        let window = Mask::Window { left: 2, right: 1 };
        for p in pairs() {
            let i = p.aligned_query();
            let j = p.key as i64;
            let bottom_right = [
                (spec(false, CausalAlign::BottomRight, None, None), true),
                (spec(true, CausalAlign::BottomRight, None, None), Mask::Causal.visible(p)),
                (spec(false, CausalAlign::BottomRight, Some(2), Some(1)), window.visible(p)),
                (spec(true, CausalAlign::BottomRight, Some(2), None), j <= i && j >= i - 2),
                (spec(false, CausalAlign::BottomRight, None, Some(0)), j <= i),
            ];
            let t = p.query as i64;
            let top_left = [
                (spec(true, CausalAlign::TopLeft, None, None), j <= t),
                (spec(false, CausalAlign::TopLeft, Some(2), Some(1)), t - 2 <= j && j <= t + 1),
            ];
            for (stated, want) in bottom_right.into_iter().chain(top_left) {
                assert_eq!(stated.mask().visible(p), want, "{stated:?} at {p:?}");
            }
        }
        // Reports name the stated mask; an unbounded side reads -1, as the metadata writes it.
        let name = |m: MaskSpec| match m.mask() {
            Mask::Predicate(p) => p.name,
            other => panic!("{m:?} is the named mask {other:?}, not a predicate"),
        };
        assert_eq!(name(spec(false, CausalAlign::BottomRight, Some(2), None)), "bottom_right window(2,-1)");
        assert_eq!(name(spec(true, CausalAlign::TopLeft, None, Some(3))), "causal top_left window(-1,3)");
        assert_eq!(name(spec(true, CausalAlign::TopLeft, None, None)), "causal top_left");
    }
}
