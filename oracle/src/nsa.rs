//! NSA (E18–E20): compression windows and compressed attention, the compression's backward (the
//! tokens' gradient and the map's own, which [`MapGradient::add`] sums over the heads sharing the
//! map), the Eq. 9 remap of window probabilities onto selection blocks, the GQA group sum, forced
//! top-n block selection, the selection and sliding-window branches, the sigmoid gates, and the CSR
//! transpose of a selection (block → selecting queries) that the backward pass of dK/dV needs.
//!
//! Tensors of one sequence of length `T` are packed `[T, H, D]`: queries `[T, Hq, d]`, keys
//! `[T, Hkv, d]`, values `[T, Hkv, dv]`. Query head `h` reads KV head `h / (Hq/Hkv)` (E1b).
//! Attention is causal: query `t` sees tokens `0..=t` only.
//!
//! Indices used throughout: compression window `c` covers tokens `[c·s, c·s + l)` (only
//! complete windows exist); selection block `j` covers tokens `[j·l', (j+1)·l')` (the last block
//! may be partial); `W` is the number of complete windows of the sequence and `M = ⌈T/l'⌉` the
//! number of selection blocks.

use ndarray::{Array1, Array2, Array3, ArrayView2, ArrayView3, Axis, Dimension};

use crate::dense::{probabilities_from_lse, scores};
use crate::error::{OracleError, check_finite};
use crate::online::SoftmaxState;
use crate::real::Real;
use crate::spec::Scale;
use crate::topk::{padded_rows, top_k, validate_index_row};
use crate::vector::{dot, mean_row};

/// The map φ that turns the `l` keys (or values) of one compression window into one compressed
/// key (value) (E18).
#[derive(Clone, Debug, PartialEq, Default)]
pub enum Compression {
    /// `φ(x_{cs..cs+l−1}) = mean of the l rows` (the default of E18).
    #[default]
    Mean,
    /// A caller-given linear map with one weight per position in the window:
    /// `φ(x_{cs..cs+l−1}) = Σ_{i<l} w_i x_{cs+i}`. The weights must number exactly `l` and be
    /// finite. This is the position-wise special case of [`Compression::Linear`].
    Weighted(Vec<f64>),
    /// The paper's learned map as a caller-given matrix `W` `[l·d, d]`: the window's `l` rows are
    /// stacked into one vector of `l·d` (row `i`, column `j` at `i·d + j`) and multiplied by `W`,
    /// `φ(x)_k = Σ_{i<l} Σ_{j<d} x_{cs+i, j} · W[i·d + j, k]`. The rows must number a multiple of
    /// `l` (`l·d`, checked against `d` when compressing), the columns `d`, every entry finite. The
    /// mean is `W = [I/l; …; I/l]` and [`Compression::Weighted`] is `W = [w_0 I; …; w_{l−1} I]`
    /// (`proofs::nsa::position_maps_are_linear_maps`).
    Linear(Array2<f64>),
}

/// The parameters of NSA (E18, E19). [`Default`] gives the paper's values.
#[derive(Clone, Debug, PartialEq)]
pub struct NsaConfig {
    /// Compression window length `l` (paper: 32).
    pub compress_len: usize,
    /// Compression stride `s` (paper: 16).
    pub compress_stride: usize,
    /// Selection block length `l'` (paper: 64).
    pub select_block: usize,
    /// Blocks kept per (query, KV head), forced ones included: `n` (paper: 16).
    pub n_selected: usize,
    /// How many initial blocks (`0, 1, …`) are always kept (paper: 1).
    pub n_forced_initial: usize,
    /// How many of the most recent blocks (the current block and those before it) are always
    /// kept (paper: 2, the current and the previous block).
    pub n_forced_local: usize,
    /// Sliding-window size: query `t` sees tokens `t+1−window ..= t` in the window branch
    /// (paper: 512). Zero disables the branch (it then outputs 0 by E1c).
    pub window: usize,
    /// φ_K, the map that compresses keys.
    pub compress_keys: Compression,
    /// φ_V, the map that compresses values.
    pub compress_values: Compression,
    /// Softmax scale of all three branches.
    pub scale: Scale,
}

impl Default for NsaConfig {
    fn default() -> Self {
        NsaConfig {
            compress_len: 32,
            compress_stride: 16,
            select_block: 64,
            n_selected: 16,
            n_forced_initial: 1,
            n_forced_local: 2,
            window: 512,
            compress_keys: Compression::Mean,
            compress_values: Compression::Mean,
            scale: Scale::InverseSqrtHeadDim,
        }
    }
}

impl NsaConfig {
    /// Checks the parameters: positive lengths, room in `n_selected` for every forced block,
    /// weight lists of length `compress_len` with finite entries, a finite scale.
    pub fn validate(&self) -> Result<(), OracleError> {
        for (argument, value) in [
            ("compress_len", self.compress_len),
            ("compress_stride", self.compress_stride),
            ("select_block", self.select_block),
            ("n_selected", self.n_selected),
        ] {
            if value == 0 {
                return Err(OracleError::ZeroDimension { argument });
            }
        }
        let forced = self.n_forced_initial + self.n_forced_local;
        if self.n_selected < forced {
            return Err(OracleError::InvalidParameter {
                argument: "n_selected",
                reason: format!("{} blocks cannot hold the {forced} forced ones", self.n_selected),
            });
        }
        for (argument, map) in [("compress_keys", &self.compress_keys), ("compress_values", &self.compress_values)] {
            match map {
                Compression::Mean => {}
                Compression::Weighted(w) => {
                    if w.len() != self.compress_len {
                        return Err(OracleError::ShapeMismatch {
                            argument,
                            expected: vec![self.compress_len],
                            actual: vec![w.len()],
                        });
                    }
                    if let Some(i) = w.iter().position(|x| !x.is_finite()) {
                        return Err(OracleError::NonFinite { argument, index: vec![i], value: w[i] });
                    }
                }
                Compression::Linear(w) => {
                    let (rows, cols) = w.dim();
                    if cols == 0 || rows != self.compress_len * cols {
                        return Err(OracleError::ShapeMismatch {
                            argument,
                            expected: vec![self.compress_len * cols.max(1), cols.max(1)],
                            actual: vec![rows, cols],
                        });
                    }
                    if let Some(((i, j), x)) = w.indexed_iter().find(|(_, x)| !x.is_finite()) {
                        return Err(OracleError::NonFinite { argument, index: vec![i, j], value: *x });
                    }
                }
            }
        }
        self.scale.check()
    }

    /// The softmax scale for head dimension `head_dim` in `ctx`'s precision.
    pub fn scale_value<S: Real>(&self, head_dim: usize, ctx: S::Ctx) -> S {
        self.scale.value(head_dim, ctx)
    }

    /// E18: the compressed branch's visibility as a spec mask, window `c` visible to token `t` iff
    /// `c·s + l − 1 ≤ t`: what the GPU's compressed attention runs under.
    pub fn compressed_mask(&self) -> crate::spec::Mask {
        crate::spec::Mask::StridedCausal { len: self.compress_len, stride: self.compress_stride }
    }

    /// Whether selection block `block` is eligible for query `query`: its first token is not in
    /// the query's future (`block·l' ≤ t`).
    pub fn block_eligible(&self, block: usize, query: usize) -> bool {
        block * self.select_block <= query
    }

    /// The blocks query `query` always keeps, ascending: the first `n_forced_initial` blocks
    /// and the `n_forced_local` most recent ones (current block `⌊t/l'⌋` and those before it),
    /// restricted to eligible blocks and without duplicates.
    pub fn forced_blocks(&self, query: usize) -> Vec<usize> {
        let current = query / self.select_block.max(1);
        let initial = 0..self.n_forced_initial.min(current + 1);
        let local = current + 1 - self.n_forced_local.min(current + 1)..current + 1;
        let mut forced: Vec<usize> = initial.chain(local).collect();
        forced.sort_unstable();
        forced.dedup();
        forced
    }

    /// `|window c ∩ block j|`, the number of tokens compression window `window` shares with
    /// selection block `block` (E19).
    pub fn window_block_overlap(&self, window: usize, block: usize) -> usize {
        let (w_start, w_end) = (window * self.compress_stride, window * self.compress_stride + self.compress_len);
        let (b_start, b_end) = (block * self.select_block, (block + 1) * self.select_block);
        w_end.min(b_end).saturating_sub(w_start.max(b_start))
    }
}

/// E18: the number of complete compression windows visible at position `position`, i.e. those
/// with `c·s + l − 1 ≤ t`: `⌊(t+1−l)/s⌋ + 1` for `t + 1 ≥ l`, else 0. At `t = 65535` with
/// `l = 32, s = 16` it is 4095.
pub fn complete_windows_at(position: usize, compress_len: usize, compress_stride: usize) -> Result<usize, OracleError> {
    if compress_len == 0 {
        return Err(OracleError::ZeroDimension { argument: "compress_len" });
    }
    if compress_stride == 0 {
        return Err(OracleError::ZeroDimension { argument: "compress_stride" });
    }
    Ok(crate::spec::strided_causal_keys(position, compress_len, compress_stride))
}

/// The number of complete compression windows of a sequence of `len` tokens: those visible to
/// its last position (0 for an empty sequence).
pub fn complete_windows(len: usize, compress_len: usize, compress_stride: usize) -> Result<usize, OracleError> {
    match len {
        0 => complete_windows_at(0, compress_len, compress_stride).map(|_| 0),
        _ => complete_windows_at(len - 1, compress_len, compress_stride),
    }
}

/// E19: the number of selection blocks of a sequence of `len` tokens, `M_T = ⌈T/l'⌉` (1024 at
/// `T = 65536, l' = 64`).
pub fn selection_blocks(len: usize, select_block: usize) -> Result<usize, OracleError> {
    if select_block == 0 {
        return Err(OracleError::ZeroDimension { argument: "select_block" });
    }
    Ok(len.div_ceil(select_block))
}

/// A [`Compression::Linear`] matrix must have `l·d` rows for rows of `d` columns.
fn check_linear_map(w: &Array2<f64>, head_dim: usize, config: &NsaConfig) -> Result<(), OracleError> {
    if w.dim() != (config.compress_len * head_dim, head_dim) {
        return Err(OracleError::ShapeMismatch {
            argument: "compression map",
            expected: vec![config.compress_len * head_dim, head_dim],
            actual: w.shape().to_vec(),
        });
    }
    Ok(())
}

/// The window `c`'s rows of `x`: tokens `c·s .. c·s + l`.
fn window_rows<'a, S>(x: ArrayView2<'a, S>, c: usize, config: &NsaConfig) -> ArrayView2<'a, S> {
    let start = c * config.compress_stride;
    x.slice_axis_move(Axis(0), ndarray::Slice::from(start..start + config.compress_len))
}

/// E18: compress the rows `x` `[T, d]` of one head into `[W, d]`, one row per complete window,
/// with the map `map` (φ_K or φ_V of `config`).
pub fn compress<S: Real>(
    x: ArrayView2<'_, S>,
    map: &Compression,
    config: &NsaConfig,
    ctx: S::Ctx,
) -> Result<Array2<S>, OracleError> {
    config.validate()?;
    let n_windows = complete_windows(x.nrows(), config.compress_len, config.compress_stride)?;
    let mut out = Array2::from_elem((n_windows, x.ncols()), S::zero(ctx));
    let linear = match map {
        Compression::Linear(w) => {
            check_linear_map(w, x.ncols(), config)?;
            Some(w.mapv(|v| S::from_f64(v, ctx)))
        }
        _ => None,
    };
    for c in 0..n_windows {
        let rows = window_rows(x, c, config);
        let row = match map {
            Compression::Mean => mean_row(rows, ctx).expect("a complete window has compress_len > 0 rows"),
            Compression::Weighted(w) => {
                let weights: Array1<S> = w.iter().map(|&x| S::from_f64(x, ctx)).collect();
                rows.t().map_axis(Axis(1), |column| dot(column, weights.view(), ctx))
            }
            Compression::Linear(_) => {
                let w = linear.as_ref().expect("converted above");
                let stacked: Array1<S> = rows.iter().cloned().collect();
                w.columns().into_iter().map(|column| dot(stacked.view(), column, ctx)).collect()
            }
        };
        out.row_mut(c).assign(&row);
    }
    Ok(out)
}

/// The gradient of the loss with respect to the compression map's own parameters (E18).
#[derive(Clone, Debug, PartialEq)]
pub enum MapGradient<S> {
    /// The mean has none.
    Mean,
    /// `∂L/∂w_i` for [`Compression::Weighted`], `[l]`.
    Weighted(Array1<S>),
    /// `∂L/∂W` for [`Compression::Linear`], `[l·d, d]`.
    Linear(Array2<S>),
}

impl<S: Real> MapGradient<S> {
    /// The gradient of no head yet: zero, shaped like `map`'s parameters (`[l]` for position weights, `[l·d, d]` for
    /// the matrix), so that adding every head's gradient to it gives their sum.
    pub fn zeros(map: &Compression, ctx: S::Ctx) -> Self {
        match map {
            Compression::Mean => MapGradient::Mean,
            Compression::Weighted(w) => MapGradient::Weighted(Array1::from_elem(w.len(), S::zero(ctx))),
            Compression::Linear(w) => MapGradient::Linear(Array2::from_elem(w.raw_dim(), S::zero(ctx))),
        }
    }

    /// Adds `other` element by element. A map shared by several heads (E18: φ_K and φ_V are one parameter of the
    /// layer, whatever the number of KV heads) has the sum of every head's gradient as its own. Two gradients of
    /// different kinds or shapes belong to different maps, so adding them is refused.
    pub fn add(&mut self, other: &MapGradient<S>) -> Result<(), OracleError> {
        match (self, other) {
            (MapGradient::Mean, MapGradient::Mean) => Ok(()),
            (MapGradient::Weighted(sum), MapGradient::Weighted(g)) => add_same_shape(sum, g),
            (MapGradient::Linear(sum), MapGradient::Linear(g)) => add_same_shape(sum, g),
            (sum, other) => Err(OracleError::InvalidParameter {
                argument: "map gradient",
                reason: format!("a {} gradient cannot be added to a {} one", other.kind(), sum.kind()),
            }),
        }
    }

    /// The name of the map the gradient belongs to, for error messages.
    fn kind(&self) -> &'static str {
        match self {
            MapGradient::Mean => "mean",
            MapGradient::Weighted(_) => "position-weight",
            MapGradient::Linear(_) => "matrix",
        }
    }
}

/// `sum += g` for two arrays of one shape; a different shape is a typed error (ndarray would broadcast or panic).
fn add_same_shape<S: Real, D: Dimension>(
    sum: &mut ndarray::Array<S, D>,
    g: &ndarray::Array<S, D>,
) -> Result<(), OracleError> {
    if sum.shape() != g.shape() {
        return Err(OracleError::ShapeMismatch {
            argument: "map gradient",
            expected: sum.shape().to_vec(),
            actual: g.shape().to_vec(),
        });
    }
    sum.zip_mut_with(g, |a, b| *a = a.clone() + b.clone());
    Ok(())
}

/// The gradients of [`compress`] for a loss with upstream gradient `dx̃` `[W, d]`.
#[derive(Clone, Debug, PartialEq)]
pub struct CompressionGradients<S> {
    /// `∂L/∂x` `[T, d]`: each token collects the gradient of every window it lies in (tokens after
    /// the last complete window get 0).
    pub dx: Array2<S>,
    /// `∂L/∂φ`'s parameters.
    pub d_map: MapGradient<S>,
}

/// The backward of [`compress`] (E18): with `x̃_c = φ(x_{c·s .. c·s+l})` and upstream gradient
/// `d_compressed` `[W, d]`, per window `c` and position `i`: the mean gives `dx_{c·s+i} += dx̃_c / l`;
/// weights give `dx_{c·s+i} += w_i dx̃_c` and `dw_i += ⟨x_{c·s+i}, dx̃_c⟩`; the matrix gives
/// `dx_{c·s+i, j} += Σ_k W[i·d+j, k] dx̃_{c,k}` and `dW[i·d+j, k] += x_{c·s+i, j} dx̃_{c,k}`.
/// Windows are taken in ascending order, so the bits do not depend on anything but the inputs.
pub fn compress_backward<S: Real>(
    x: ArrayView2<'_, S>,
    map: &Compression,
    d_compressed: ArrayView2<'_, S>,
    config: &NsaConfig,
    ctx: S::Ctx,
) -> Result<CompressionGradients<S>, OracleError> {
    config.validate()?;
    let (len, head_dim) = x.dim();
    let n_windows = complete_windows(len, config.compress_len, config.compress_stride)?;
    if d_compressed.dim() != (n_windows, head_dim) {
        return Err(OracleError::ShapeMismatch {
            argument: "d_compressed",
            expected: vec![n_windows, head_dim],
            actual: d_compressed.shape().to_vec(),
        });
    }
    check_finite("x", &x)?;
    check_finite("d_compressed", &d_compressed)?;
    let l = config.compress_len;
    let mut dx = Array2::from_elem((len, head_dim), S::zero(ctx));
    let d_map = match map {
        Compression::Mean => {
            let count = S::from_f64(l as f64, ctx);
            for (c, g) in d_compressed.rows().into_iter().enumerate() {
                for i in 0..l {
                    let mut row = dx.row_mut(c * config.compress_stride + i);
                    row.zip_mut_with(&g, |a, b| *a = a.clone() + b.clone() / count.clone());
                }
            }
            MapGradient::Mean
        }
        Compression::Weighted(w) => {
            let weights: Vec<S> = w.iter().map(|&v| S::from_f64(v, ctx)).collect();
            let mut dw = Array1::from_elem(l, S::zero(ctx));
            for (c, g) in d_compressed.rows().into_iter().enumerate() {
                let rows = window_rows(x, c, config);
                for i in 0..l {
                    let mut row = dx.row_mut(c * config.compress_stride + i);
                    row.zip_mut_with(&g, |a, b| *a = a.clone() + weights[i].clone() * b.clone());
                    dw[i] = dw[i].clone() + dot(rows.row(i), g, ctx);
                }
            }
            MapGradient::Weighted(dw)
        }
        Compression::Linear(w) => {
            check_linear_map(w, head_dim, config)?;
            let w = w.mapv(|v| S::from_f64(v, ctx));
            let mut dw = Array2::from_elem(w.raw_dim(), S::zero(ctx));
            for (c, g) in d_compressed.rows().into_iter().enumerate() {
                let rows = window_rows(x, c, config);
                for i in 0..l {
                    for j in 0..head_dim {
                        let r = i * head_dim + j;
                        let token = c * config.compress_stride + i;
                        dx[[token, j]] = dx[[token, j]].clone() + dot(w.row(r), g, ctx);
                        let xv = rows[[i, j]].clone();
                        dw.row_mut(r).zip_mut_with(&g, |a, b| *a = a.clone() + xv.clone() * b.clone());
                    }
                }
            }
            MapGradient::Linear(dw)
        }
    };
    Ok(CompressionGradients { dx, d_map })
}

/// E19, the **Convention** of `docs/equations.md`: remap window probabilities `p_cmp` `[rows, W]` onto
/// `n_blocks` selection blocks, `p_slc[j] = Σ_c p_cmp[c] · |window c ∩ block j| / s`. Windows
/// beyond the `W` given contribute nothing. With `l = 32, s = 16, l' = 64` block `j` weighs
/// windows `4j−1 … 4j+3` by `1, 2, 2, 2, 1`.
pub fn remap_to_blocks<S: Real>(
    p_cmp: ArrayView2<'_, S>,
    n_blocks: usize,
    config: &NsaConfig,
    ctx: S::Ctx,
) -> Result<Array2<S>, OracleError> {
    config.validate()?;
    let stride = S::from_f64(config.compress_stride as f64, ctx);
    let mut out = Array2::from_elem((p_cmp.nrows(), n_blocks), S::zero(ctx));
    for c in 0..p_cmp.ncols() {
        for j in 0..n_blocks {
            // Only the few blocks that window c touches contribute; the row loop is skipped for the others.
            let overlap = config.window_block_overlap(c, j);
            if overlap == 0 {
                continue;
            }
            let weight = S::from_f64(overlap as f64, ctx) / stride.clone();
            for r in 0..p_cmp.nrows() {
                out[[r, j]] += p_cmp[[r, c]].clone() * weight.clone();
            }
        }
    }
    Ok(out)
}

/// E19 group sum: `[Hq, T, W]` per-head probabilities to `[T, Hkv, W]`, summing the `G` query
/// heads of each KV head in ascending head order.
pub fn group_sum<S: Real>(p_cmp: ArrayView3<'_, S>, n_heads_kv: usize, ctx: S::Ctx) -> Result<Array3<S>, OracleError> {
    let (n_heads_q, len, width) = p_cmp.dim();
    check_head_ratio(n_heads_q, n_heads_kv)?;
    let group = n_heads_q / n_heads_kv;
    let mut out = Array3::from_elem((len, n_heads_kv, width), S::zero(ctx));
    for h in 0..n_heads_q {
        for t in 0..len {
            for c in 0..width {
                out[[t, h / group, c]] += p_cmp[[h, t, c]].clone();
            }
        }
    }
    Ok(out)
}

/// E19: the block scores that the selection ranks, `[T, Hkv, M]`: the group sum of `p_cmp`
/// `[Hq, T, W]` (E32's second place), remapped onto `n_blocks` blocks (E32's third place).
pub fn block_scores<S: Real>(
    p_cmp: ArrayView3<'_, S>,
    n_heads_kv: usize,
    n_blocks: usize,
    config: &NsaConfig,
    ctx: S::Ctx,
) -> Result<Array3<S>, OracleError> {
    let summed = group_sum(p_cmp, n_heads_kv, ctx)?;
    let (len, _, width) = summed.dim();
    let flat = summed.into_shape_with_order((len * n_heads_kv, width)).expect("contiguous reshape");
    let remapped = remap_to_blocks(flat.view(), n_blocks, config, ctx)?;
    Ok(remapped.into_shape_with_order((len, n_heads_kv, n_blocks)).expect("contiguous reshape"))
}

/// E19: the selection `[T, Hkv, n]` from block scores `[T, Hkv, M]`: per (query, KV head) the
/// forced blocks ([`NsaConfig::forced_blocks`]) and then the best eligible blocks (ties to the
/// lower index) up to `n = n_selected`, written ascending and padded with `−1` (E14).
pub fn select_blocks<S: Real>(block_scores: ArrayView3<'_, S>, config: &NsaConfig) -> Result<Array3<i32>, OracleError> {
    config.validate()?;
    let (len, n_heads_kv, n_blocks) = block_scores.dim();
    let expected_blocks = selection_blocks(len, config.select_block)?;
    if n_blocks != expected_blocks {
        return Err(OracleError::ShapeMismatch {
            argument: "block_scores",
            expected: vec![len, n_heads_kv, expected_blocks],
            actual: vec![len, n_heads_kv, n_blocks],
        });
    }
    check_finite("block_scores", &block_scores)?;
    // One list per (query, KV head), in that order.
    let lists = padded_rows(len * n_heads_kv, config.n_selected, |r| {
        let (t, kv) = (r / n_heads_kv, r % n_heads_kv);
        let row: Vec<S> = block_scores.index_axis(Axis(0), t).row(kv).to_vec();
        top_k(&row, config.n_selected, |j| config.block_eligible(j, t), &config.forced_blocks(t))
    });
    Ok(lists.into_shape_with_order((len, n_heads_kv, config.n_selected)).expect("the same number of entries"))
}

/// The inputs of one NSA sequence, borrowed: queries `[T, Hq, d]`, keys `[T, Hkv, d]`,
/// values `[T, Hkv, dv]`.
#[derive(Debug)]
pub struct NsaInputs<'a, S> {
    /// Queries `[T, Hq, d]`.
    pub q: ArrayView3<'a, S>,
    /// Keys `[T, Hkv, d]`.
    pub k: ArrayView3<'a, S>,
    /// Values `[T, Hkv, dv]`.
    pub v: ArrayView3<'a, S>,
}

// Views are `Copy` whatever the element type, so the derive's `S: Copy` bound is not wanted.
impl<S> Clone for NsaInputs<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for NsaInputs<'_, S> {}

impl<S: Real> NsaInputs<'_, S> {
    /// Sequence length `T`.
    pub fn seq_len(&self) -> usize {
        self.q.dim().0
    }
    /// Query heads `Hq`.
    pub fn n_heads_q(&self) -> usize {
        self.q.dim().1
    }
    /// KV heads `Hkv`.
    pub fn n_heads_kv(&self) -> usize {
        self.k.dim().1
    }
    /// Query heads per KV head, `G = Hq/Hkv`.
    pub fn group(&self) -> usize {
        self.n_heads_q() / self.n_heads_kv().max(1)
    }

    /// Checks shapes (`k`, `v` share `T` and `Hkv` with each other and `T` with `q`; `q`, `k`
    /// share `d`), the head ratio, positive head dims and finite entries.
    pub fn validate(&self) -> Result<(), OracleError> {
        let (len, n_heads_q, head_dim) = self.q.dim();
        let (_, n_heads_kv, _) = self.k.dim();
        let head_dim_v = self.v.dim().2;
        if head_dim == 0 {
            return Err(OracleError::ZeroDimension { argument: "head_dim" });
        }
        if head_dim_v == 0 {
            return Err(OracleError::ZeroDimension { argument: "head_dim_v" });
        }
        check_head_ratio(n_heads_q, n_heads_kv)?;
        for (argument, actual, expected) in
            [("k", self.k.shape(), [len, n_heads_kv, head_dim]), ("v", self.v.shape(), [len, n_heads_kv, head_dim_v])]
        {
            if actual != expected {
                return Err(OracleError::ShapeMismatch {
                    argument,
                    expected: expected.to_vec(),
                    actual: actual.to_vec(),
                });
            }
        }
        check_finite("q", &self.q)?;
        check_finite("k", &self.k)?;
        check_finite("v", &self.v)
    }
}

/// The compressed branch of every query head.
#[derive(Clone, Debug, PartialEq)]
pub struct CompressedBranch<S> {
    /// `o_cmp` `[T, Hq, dv]`.
    pub o: Array3<S>,
    /// Per-head window probabilities `p_cmp` `[Hq, T, W]` (E32's first place); 0 on windows not
    /// yet complete at `t`.
    pub p: Array3<S>,
}

/// E18: compressed attention. Query `t` of head `h` attends, with one softmax, to the compressed
/// keys/values of its KV head's windows `c` with `c·s + l − 1 ≤ t`; rows with no such window
/// give 0 (E1c).
pub fn compressed_attention<S: Real>(
    inputs: NsaInputs<'_, S>,
    config: &NsaConfig,
    ctx: S::Ctx,
) -> Result<CompressedBranch<S>, OracleError> {
    inputs.validate()?;
    config.validate()?;
    let (len, n_heads_q, head_dim) = inputs.q.dim();
    let head_dim_v = inputs.v.dim().2;
    let n_windows = complete_windows(len, config.compress_len, config.compress_stride)?;
    let scale = config.scale_value::<S>(head_dim, ctx);
    let visible = config.compressed_mask().matrix(len, n_windows);
    let mut o = Array3::from_elem((len, n_heads_q, head_dim_v), S::zero(ctx));
    let mut p = Array3::from_elem((n_heads_q, len, n_windows), S::zero(ctx));
    for kv in 0..inputs.n_heads_kv() {
        let keys = compress(inputs.k.index_axis(Axis(1), kv), &config.compress_keys, config, ctx)?;
        let values = compress(inputs.v.index_axis(Axis(1), kv), &config.compress_values, config, ctx)?;
        for h in kv * inputs.group()..(kv + 1) * inputs.group() {
            let s = scores(inputs.q.index_axis(Axis(1), h), keys.view(), &scale, visible.view(), ctx);
            let (o_h, lse) = SoftmaxState::of_block(s.view(), visible.view(), values.view(), ctx).finalize();
            o.index_axis_mut(Axis(1), h).assign(&o_h);
            p.index_axis_mut(Axis(0), h).assign(&probabilities_from_lse(s.view(), lse.view(), visible.view(), ctx));
        }
    }
    Ok(CompressedBranch { o, p })
}

/// Attention of the `G` query heads of KV head `kv` at query `t` to the tokens `tokens` (each
/// `≤ t`), as one E2 block; no token gives 0 (E1c).
fn attend_tokens<S: Real>(
    inputs: NsaInputs<'_, S>,
    t: usize,
    kv: usize,
    tokens: &[usize],
    scale: &S,
    ctx: S::Ctx,
) -> Array2<S> {
    let group = inputs.group();
    let head_dim_v = inputs.v.dim().2;
    if tokens.is_empty() {
        return Array2::from_elem((group, head_dim_v), S::zero(ctx));
    }
    let keys = inputs.k.index_axis(Axis(1), kv).select(Axis(0), tokens);
    let values = inputs.v.index_axis(Axis(1), kv).select(Axis(0), tokens);
    let queries = inputs
        .q
        .index_axis_move(Axis(0), t)
        .slice_axis_move(Axis(0), ndarray::Slice::from(kv * group..(kv + 1) * group));
    let visible = Array2::from_elem((group, tokens.len()), true);
    let s = scores(queries, keys.view(), scale, visible.view(), ctx);
    SoftmaxState::of_block(s.view(), visible.view(), values.view(), ctx).finalize().0
}

/// Runs `branch_tokens(t, kv)` → token list for every (query, KV head) and attends.
fn branch_output<S: Real>(
    inputs: NsaInputs<'_, S>,
    config: &NsaConfig,
    ctx: S::Ctx,
    mut branch_tokens: impl FnMut(usize, usize) -> Result<Vec<usize>, OracleError>,
) -> Result<Array3<S>, OracleError> {
    let (len, n_heads_q, head_dim) = inputs.q.dim();
    let scale = config.scale_value::<S>(head_dim, ctx);
    let group = inputs.group();
    let mut o = Array3::from_elem((len, n_heads_q, inputs.v.dim().2), S::zero(ctx));
    for t in 0..len {
        for kv in 0..inputs.n_heads_kv() {
            let tokens = branch_tokens(t, kv)?;
            let rows = attend_tokens(inputs, t, kv, &tokens, &scale, ctx);
            o.index_axis_mut(Axis(0), t)
                .slice_axis_mut(Axis(0), ndarray::Slice::from(kv * group..(kv + 1) * group))
                .assign(&rows);
        }
    }
    Ok(o)
}

/// E18 selection branch: query `t` of every head of KV head `kv` attends to the tokens of the
/// blocks `selection[t, kv, ..]` (validated: ascending, in `0..M`, `−1` padded), restricted to
/// tokens `≤ t` (causal inside the current block; a block wholly in the future adds nothing).
pub fn selected_attention<S: Real>(
    inputs: NsaInputs<'_, S>,
    selection: ArrayView3<'_, i32>,
    config: &NsaConfig,
    ctx: S::Ctx,
) -> Result<Array3<S>, OracleError> {
    inputs.validate()?;
    config.validate()?;
    let len = inputs.seq_len();
    let n_blocks = selection_blocks(len, config.select_block)?;
    let (sel_len, sel_heads, width) = selection.dim();
    if (sel_len, sel_heads) != (len, inputs.n_heads_kv()) {
        return Err(OracleError::ShapeMismatch {
            argument: "selection",
            expected: vec![len, inputs.n_heads_kv(), width],
            actual: vec![sel_len, sel_heads, width],
        });
    }
    branch_output(inputs, config, ctx, |t, kv| selected_tokens(selection, t, kv, n_blocks, config))
}

/// The tokens query `t` of KV head `kv` attends to in the selection branch: those `≤ t` of the blocks its row of
/// `selection` lists (validated against `n_blocks`), ascending.
pub(crate) fn selected_tokens(
    selection: ArrayView3<'_, i32>,
    t: usize,
    kv: usize,
    n_blocks: usize,
    config: &NsaConfig,
) -> Result<Vec<usize>, OracleError> {
    let row = selection.index_axis(Axis(0), t).row(kv).to_vec();
    let blocks = validate_index_row("selection", t * selection.dim().1 + kv, &row, n_blocks)?;
    Ok(blocks.into_iter().flat_map(|j| j * config.select_block..((j + 1) * config.select_block).min(t + 1)).collect())
}

/// The tokens query `t` attends to in the sliding-window branch: `max(0, t + 1 − window) ..= t`.
pub(crate) fn window_tokens(t: usize, config: &NsaConfig) -> std::ops::Range<usize> {
    (t + 1).saturating_sub(config.window)..t + 1
}

/// E18 sliding-window branch: query `t` attends to tokens `max(0, t+1−window) ..= t`.
pub fn window_attention<S: Real>(
    inputs: NsaInputs<'_, S>,
    config: &NsaConfig,
    ctx: S::Ctx,
) -> Result<Array3<S>, OracleError> {
    inputs.validate()?;
    config.validate()?;
    branch_output(inputs, config, ctx, |t, _| Ok(window_tokens(t, config).collect()))
}

/// The three NSA branches, in the order of the last axis of the gate logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Branch {
    /// Compressed attention, `o_cmp` (gate index 0).
    Compressed = 0,
    /// Selected-block attention, `o_slc` (gate index 1).
    Selected = 1,
    /// Sliding-window attention, `o_win` (gate index 2).
    Window = 2,
}

/// `σ(x) = 1/(1 + e^{−x})`; `σ(+∞) = 1`, `σ(−∞) = 0`.
pub fn sigmoid<S: Real>(x: &S) -> S {
    let ctx = x.ctx();
    S::one(ctx) / (S::one(ctx) + (-x.clone()).exp())
}

/// Checks the shapes and values of a gated sum's operands: branch outputs (and `d_out`) `[T, Hq, dv]` alike and
/// finite, gate logits `[T, Hq, 3]` without NaN (`±∞` is a gate of exactly 1 or 0).
fn check_gate_operands<S: Real>(
    branches: &[ArrayView3<'_, S>; 3],
    gate_logits: ArrayView3<'_, S>,
    d_out: Option<ArrayView3<'_, S>>,
) -> Result<(), OracleError> {
    let (len, n_heads_q, dv) = branches[0].dim();
    let named = [("o_cmp", branches[0]), ("o_slc", branches[1]), ("o_win", branches[2])];
    for (argument, t) in named.into_iter().chain(d_out.map(|d| ("d_out", d))) {
        if t.dim() != (len, n_heads_q, dv) {
            return Err(OracleError::ShapeMismatch {
                argument,
                expected: vec![len, n_heads_q, dv],
                actual: t.shape().to_vec(),
            });
        }
        check_finite(argument, &t.into_dyn())?;
    }
    if gate_logits.dim() != (len, n_heads_q, 3) {
        return Err(OracleError::ShapeMismatch {
            argument: "gate_logits",
            expected: vec![len, n_heads_q, 3],
            actual: gate_logits.shape().to_vec(),
        });
    }
    if let Some((index, x)) = gate_logits.into_dyn().indexed_iter().find(|(_, x)| x.is_nan()) {
        return Err(OracleError::NonFinite {
            argument: "gate_logits",
            index: index.slice().to_vec(),
            value: x.to_f64(),
        });
    }
    Ok(())
}

/// E18's gated sum: `o = Σ_b σ(x_b) o_b` per `(t, h)`, over the branch outputs `[T, Hq, dv]` in [`Branch`] order and
/// the gate logits `x` `[T, Hq, 3]` (last axis in [`Branch`] order; `±∞` allowed, no NaN). The gates need not sum
/// to 1. Returns the gates `σ(x)` and `o`.
pub fn gate_combine<S: Real>(
    branches: [ArrayView3<'_, S>; 3],
    gate_logits: ArrayView3<'_, S>,
    ctx: S::Ctx,
) -> Result<(Array3<S>, Array3<S>), OracleError> {
    check_gate_operands(&branches, gate_logits, None)?;
    let gates = gate_logits.mapv(|x| sigmoid(&x));
    let mut o = Array3::from_elem(branches[0].dim(), S::zero(ctx));
    for ((t, h, e), out) in o.indexed_iter_mut() {
        let term = |b: usize| gates[[t, h, b]].clone() * branches[b][[t, h, e]].clone();
        *out = term(0) + term(1) + term(2);
    }
    Ok((gates, o))
}

/// The gradients of E18's gated sum for a loss with upstream gradient `dO` `[T, Hq, dv]`.
#[derive(Clone, Debug, PartialEq)]
pub struct GateGradients<S> {
    /// `dO_b = σ(x_b) dO` per branch, in [`Branch`] order: the upstream gradient of each branch's attention.
    pub d_branches: [Array3<S>; 3],
    /// `∂L/∂x_b = σ(x_b) σ(−x_b) ⟨dO, o_b⟩` `[T, Hq, 3]` (σ' written as `σ(x) σ(−x)`, which has no cancellation where
    /// `σ(x)` is near 1).
    pub d_gate_logits: Array3<S>,
}

/// The gradients of [`gate_combine`] (E18): per `(t, h)` and branch `b`, `dO_b = σ(x_b) dO` and
/// `∂L/∂x_b = σ(x_b) σ(−x_b) Σ_e dO_e o_{b,e}`.
pub fn gate_combine_backward<S: Real>(
    branches: [ArrayView3<'_, S>; 3],
    gate_logits: ArrayView3<'_, S>,
    d_out: ArrayView3<'_, S>,
    ctx: S::Ctx,
) -> Result<GateGradients<S>, OracleError> {
    check_gate_operands(&branches, gate_logits, Some(d_out))?;
    let gates = gate_logits.mapv(|x| sigmoid(&x));
    let d_branches = [0, 1, 2]
        .map(|b| Array3::from_shape_fn(d_out.dim(), |(t, h, e)| gates[[t, h, b]].clone() * d_out[[t, h, e]].clone()));
    let d_gate_logits = Array3::from_shape_fn(gate_logits.dim(), |(t, h, b)| {
        let x = &gate_logits[[t, h, b]];
        let dot = (0..d_out.dim().2)
            .fold(S::zero(ctx), |acc, e| acc + d_out[[t, h, e]].clone() * branches[b][[t, h, e]].clone());
        sigmoid(x) * sigmoid(&-x.clone()) * dot
    });
    Ok(GateGradients { d_branches, d_gate_logits })
}

/// Everything an NSA forward computes, in the order of the data flow.
#[derive(Clone, Debug, PartialEq)]
pub struct NsaForward<S> {
    /// The compressed branch `o_cmp` and per-head `p_cmp`.
    pub compressed: CompressedBranch<S>,
    /// Group-summed, remapped block scores `[T, Hkv, M]`.
    pub block_scores: Array3<S>,
    /// The selection `[T, Hkv, n]` (ascending, `−1` padded).
    pub selection: Array3<i32>,
    /// `o_slc` `[T, Hq, dv]`.
    pub selected: Array3<S>,
    /// `o_win` `[T, Hq, dv]`.
    pub window: Array3<S>,
    /// `g = σ(gate logits)` `[T, Hq, 3]`, last axis in [`Branch`] order.
    pub gates: Array3<S>,
    /// `o = g_cmp o_cmp + g_slc o_slc + g_win o_win` `[T, Hq, dv]`.
    pub o: Array3<S>,
}

/// E18–E19: the whole NSA forward of one sequence. `gate_logits` `[T, Hq, 3]` (last axis in
/// [`Branch`] order) may hold `±∞` (a gate of exactly 1 or 0) but no NaN. Each branch is
/// normalized on its own; the gates need not sum to 1.
pub fn nsa_forward<S: Real>(
    inputs: NsaInputs<'_, S>,
    gate_logits: ArrayView3<'_, S>,
    config: &NsaConfig,
    ctx: S::Ctx,
) -> Result<NsaForward<S>, OracleError> {
    inputs.validate()?;
    config.validate()?;
    let (len, n_heads_q, _) = inputs.q.dim();
    // The gates are checked again where they are used; checking them first spares the branches' work on bad ones.
    let branch_shape = Array3::from_elem((len, n_heads_q, 0), S::zero(ctx));
    check_gate_operands(&[branch_shape.view(), branch_shape.view(), branch_shape.view()], gate_logits, None)?;
    let compressed = compressed_attention(inputs, config, ctx)?;
    let n_blocks = selection_blocks(len, config.select_block)?;
    let block_scores = block_scores(compressed.p.view(), inputs.n_heads_kv(), n_blocks, config, ctx)?;
    let selection = select_blocks(block_scores.view(), config)?;
    let selected = selected_attention(inputs, selection.view(), config, ctx)?;
    let window = window_attention(inputs, config, ctx)?;
    let (gates, o) = gate_combine([compressed.o.view(), selected.view(), window.view()], gate_logits, ctx)?;
    Ok(NsaForward { compressed, block_scores, selection, selected, window, gates, o })
}

/// E20: a selection transposed to block → selecting queries, in CSR form. The queries of block
/// `b` are `indices[offsets[b]..offsets[b+1]]`, ascending.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockQueries {
    /// `[n_blocks + 1]`, non-decreasing, from 0 to `indices.len()`.
    pub offsets: Vec<i32>,
    /// The selecting queries of every block, block after block, ascending within a block.
    pub indices: Vec<i32>,
}

/// How many queries select each block (E20 fan-in), with a histogram in powers of two.
#[derive(Clone, Debug, PartialEq)]
pub struct FanIn {
    /// Largest number of queries selecting one block.
    pub max: usize,
    /// Number of (query, block) pairs, `nnz`.
    pub total: usize,
    /// `total / n_blocks` (0 when there are no blocks).
    pub mean: f64,
    /// `histogram[0]` counts blocks selected by no query; `histogram[k]` for `k ≥ 1` counts
    /// blocks selected by `2^{k−1} ≤ count < 2^k` queries. Its length is the last non-empty
    /// bucket plus one, so that the histogram of a given selection is unique.
    pub histogram: Vec<usize>,
}

impl BlockQueries {
    /// Number of blocks.
    pub fn n_blocks(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// The queries selecting `block`, ascending.
    pub fn queries_of(&self, block: usize) -> &[i32] {
        &self.indices[self.offsets[block] as usize..self.offsets[block + 1] as usize]
    }

    /// Fan-in statistics of the blocks.
    pub fn fan_in(&self) -> FanIn {
        let counts: Vec<usize> = (0..self.n_blocks()).map(|b| self.queries_of(b).len()).collect();
        let mut histogram = Vec::new();
        for &count in &counts {
            let bucket = if count == 0 { 0 } else { count.ilog2() as usize + 1 };
            if histogram.len() <= bucket {
                histogram.resize(bucket + 1, 0);
            }
            histogram[bucket] += 1;
        }
        let total: usize = counts.iter().sum();
        let mean = if counts.is_empty() { 0.0 } else { total as f64 / counts.len() as f64 };
        FanIn { max: counts.iter().copied().max().unwrap_or(0), total, mean, histogram }
    }
}

/// E20: transposes one KV head's selection `[T, n]` (each row validated by the E14 convention
/// against `n_blocks`) into block → selecting queries.
pub fn transpose_selection(selection: ArrayView2<'_, i32>, n_blocks: usize) -> Result<BlockQueries, OracleError> {
    let mut per_block: Vec<Vec<i32>> = vec![Vec::new(); n_blocks];
    for (t, row) in selection.rows().into_iter().enumerate() {
        let query = i32::try_from(t).map_err(|_| OracleError::InvalidParameter {
            argument: "selection",
            reason: format!("{} queries do not fit in i32", selection.nrows()),
        })?;
        for b in validate_index_row("selection", t, &row.to_vec(), n_blocks)? {
            // Rows are visited in ascending query order, so each block's list stays ascending.
            per_block[b].push(query);
        }
    }
    let mut offsets = Vec::with_capacity(n_blocks + 1);
    offsets.push(0);
    let mut indices = Vec::new();
    for queries in per_block {
        indices.extend(queries);
        offsets.push(i32::try_from(indices.len()).map_err(|_| OracleError::InvalidParameter {
            argument: "selection",
            reason: "more than i32::MAX selected pairs".into(),
        })?);
    }
    Ok(BlockQueries { offsets, indices })
}

/// E20 for every KV head of a selection `[T, Hkv, n]`: one [`BlockQueries`] per KV head.
pub fn transpose_selection_heads(
    selection: ArrayView3<'_, i32>,
    n_blocks: usize,
) -> Result<Vec<BlockQueries>, OracleError> {
    (0..selection.dim().1).map(|kv| transpose_selection(selection.index_axis(Axis(1), kv), n_blocks)).collect()
}

/// The inverse of [`transpose_selection`]: the selection `[len, width]` (ascending, `−1`
/// padded) that a CSR describes. The CSR is validated: `offsets` starts at 0, never decreases,
/// ends at `indices.len()`; the queries of a block are ascending, distinct and in `0..len`; no
/// query selects more than `width` blocks.
pub fn selection_from_csr(csr: &BlockQueries, len: usize, width: usize) -> Result<Array2<i32>, OracleError> {
    let bad = |argument: &'static str, position: usize, reason: String| OracleError::IndexList {
        argument,
        position: vec![position],
        reason,
    };
    if csr.offsets.first() != Some(&0) {
        return Err(bad("offsets", 0, "offsets must start at 0".into()));
    }
    for (b, pair) in csr.offsets.windows(2).enumerate() {
        if pair[1] < pair[0] {
            return Err(bad("offsets", b + 1, format!("offset {} after {}: decreasing", pair[1], pair[0])));
        }
    }
    let last = *csr.offsets.last().expect("offsets is not empty");
    if last as usize != csr.indices.len() {
        return Err(bad(
            "offsets",
            csr.offsets.len() - 1,
            format!("ends at {last}, indices hold {}", csr.indices.len()),
        ));
    }
    let mut out = Array2::from_elem((len, width), -1);
    let mut filled = vec![0usize; len];
    for b in 0..csr.n_blocks() {
        let start = csr.offsets[b] as usize;
        let queries = csr.queries_of(b);
        validate_index_row("indices", b, queries, len).map_err(|e| match e {
            OracleError::IndexList { argument, position, reason } => {
                OracleError::IndexList { argument, position: vec![start + position[1]], reason }
            }
            other => other,
        })?;
        for &q in queries {
            let q = q as usize;
            if filled[q] == width {
                return Err(OracleError::InvalidParameter {
                    argument: "width",
                    reason: format!("query {q} selects more than {width} blocks"),
                });
            }
            // Blocks are visited in ascending order, so each query's row stays ascending.
            out[[q, filled[q]]] = b as i32;
            filled[q] += 1;
        }
    }
    Ok(out)
}

fn check_head_ratio(n_heads_q: usize, n_heads_kv: usize) -> Result<(), OracleError> {
    // `is_multiple_of(0)` is false for any count but 0, so no KV head fails here as well.
    if n_heads_q == 0 || !n_heads_q.is_multiple_of(n_heads_kv) {
        return Err(OracleError::HeadRatio { n_heads_q, n_heads_kv });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::uniform;
    use crate::real::{Mp, Precision};

    /// A small configuration: `l = 4, s = 2, l' = 8, n = 4`, window 5.
    fn small() -> NsaConfig {
        NsaConfig {
            compress_len: 4,
            compress_stride: 2,
            select_block: 8,
            n_selected: 4,
            window: 5,
            ..NsaConfig::default()
        }
    }

    fn tensor(seed: u64, shape: (usize, usize, usize)) -> Array3<f64> {
        Array3::from_shape_vec(shape, uniform(seed, shape.0 * shape.1 * shape.2)).expect("sizes agree")
    }

    /// `T = 19`, `Hq = 4`, `Hkv = 2`, `d = 3`, `dv = 2`.
    fn problem() -> (Array3<f64>, Array3<f64>, Array3<f64>) {
        (tensor(1, (19, 4, 3)), tensor(2, (19, 2, 3)), tensor(3, (19, 2, 2)))
    }

    #[test]
    fn window_and_block_counts_at_65536() {
        assert_eq!(complete_windows_at(65535, 32, 16), Ok(4095));
        assert_eq!(complete_windows(65536, 32, 16), Ok(4095));
        assert_eq!(complete_windows_at(30, 32, 16), Ok(0));
        assert_eq!(complete_windows_at(31, 32, 16), Ok(1));
        assert_eq!(complete_windows(0, 32, 16), Ok(0));
        assert_eq!(selection_blocks(65536, 64), Ok(1024));
        assert_eq!(selection_blocks(65, 64), Ok(2));
    }

    #[test]
    fn zero_lengths_are_refused() {
        assert_eq!(complete_windows_at(3, 0, 1), Err(OracleError::ZeroDimension { argument: "compress_len" }));
        assert_eq!(complete_windows_at(3, 1, 0), Err(OracleError::ZeroDimension { argument: "compress_stride" }));
        assert_eq!(selection_blocks(3, 0), Err(OracleError::ZeroDimension { argument: "select_block" }));
        let bad = NsaConfig { n_selected: 0, ..small() };
        assert_eq!(bad.validate(), Err(OracleError::ZeroDimension { argument: "n_selected" }));
    }

    #[test]
    fn bad_configs_are_refused() {
        let too_few = NsaConfig { n_selected: 2, ..small() };
        assert!(matches!(too_few.validate(), Err(OracleError::InvalidParameter { argument: "n_selected", .. })));
        let short = NsaConfig { compress_keys: Compression::Weighted(vec![1.0; 3]), ..small() };
        assert!(matches!(short.validate(), Err(OracleError::ShapeMismatch { argument: "compress_keys", .. })));
        let nan = NsaConfig { compress_values: Compression::Weighted(vec![0.0, f64::NAN, 0.0, 0.0]), ..small() };
        assert!(matches!(
            nan.validate(),
            Err(OracleError::NonFinite { argument: "compress_values", ref index, .. }) if index == &[1]
        ));
        let scale = NsaConfig { scale: Scale::Value(f64::INFINITY), ..small() };
        assert!(matches!(scale.validate(), Err(OracleError::NonFinite { argument: "scale", .. })));
        // The learned matrix: l·d rows for d columns (small() has l = 4), finite, and d checked when compressing.
        let linear =
            |rows, cols| NsaConfig { compress_keys: Compression::Linear(Array2::zeros((rows, cols))), ..small() };
        assert!(linear(8, 2).validate().is_ok());
        for (rows, cols) in [(7, 2), (8, 3), (0, 0), (4, 0)] {
            assert!(
                matches!(
                    linear(rows, cols).validate(),
                    Err(OracleError::ShapeMismatch { argument: "compress_keys", .. })
                ),
                "[{rows}, {cols}]"
            );
        }
        let mut w = Array2::zeros((8, 2));
        w[[5, 1]] = f64::NAN;
        let nan = NsaConfig { compress_keys: Compression::Linear(w), ..small() };
        assert!(matches!(
            nan.validate(),
            Err(OracleError::NonFinite { argument: "compress_keys", ref index, .. }) if index == &[5, 1]
        ));
        let rows = Array2::from_elem((6, 3), 1.0);
        let map = Compression::Linear(Array2::zeros((8, 2)));
        assert!(matches!(
            compress(rows.view(), &map, &linear(8, 2), ()),
            Err(OracleError::ShapeMismatch { argument: "compression map", .. })
        ));
        let short = compress_backward(rows.view(), &Compression::Mean, Array2::zeros((1, 3)).view(), &small(), ());
        assert!(matches!(short, Err(OracleError::ShapeMismatch { argument: "d_compressed", .. })));
    }

    #[test]
    fn the_default_scale_is_one_over_root_d() {
        assert_eq!(small().scale_value::<f64>(16, ()), 0.25);
        assert_eq!(NsaConfig { scale: Scale::Value(0.3), ..small() }.scale_value::<f64>(16, ()), 0.3);
    }

    #[test]
    fn a_block_is_eligible_once_its_first_token_is_visible() {
        let config = small();
        for (block, query, eligible) in [(0, 0, true), (1, 7, false), (1, 8, true), (3, 23, false), (3, 24, true)] {
            assert_eq!(config.block_eligible(block, query), eligible, "block {block}, query {query}");
        }
    }

    #[test]
    fn selection_never_reaches_a_block_that_starts_after_the_query() {
        // T = 32: four blocks of 8 and room for all four; every score is equal, so only eligibility keeps a later
        // block out of the list.
        let lists = select_blocks(Array3::<f64>::zeros((32, 1, 4)).view(), &small()).unwrap();
        for t in 0..32 {
            let expected: Vec<i32> = (0..4).map(|j| if j * 8 <= t { j as i32 } else { -1 }).collect();
            assert_eq!(lists.index_axis(Axis(0), t).row(0).to_vec(), expected, "query {t}");
        }
    }

    /// `T = 19`, `Hq = 4`, `Hkv = 2`, zero queries (so every branch averages the values it attends to) and values
    /// `v[s, kv, 0] = s + 100·kv`, `v[s, kv, 1] = s²`: an average names the tokens and the KV head it came from.
    fn averaging_problem() -> (Array3<f64>, Array3<f64>, Array3<f64>) {
        let v =
            Array3::from_shape_fn((19, 2, 2), |(s, kv, c)| if c == 0 { (s + 100 * kv) as f64 } else { (s * s) as f64 });
        (Array3::zeros((19, 4, 3)), tensor(2, (19, 2, 3)), v)
    }

    /// The mean of `v[s, kv, ·]` over `tokens`.
    fn mean_value(v: &Array3<f64>, kv: usize, tokens: impl Iterator<Item = usize>) -> [f64; 2] {
        let tokens: Vec<usize> = tokens.collect();
        let n = tokens.len() as f64;
        [0, 1].map(|c| tokens.iter().map(|&s| v[[s, kv, c]]).sum::<f64>() / n)
    }

    fn assert_close(actual: [f64; 2], expected: [f64; 2], what: &str) {
        for c in 0..2 {
            assert!(
                (actual[c] - expected[c]).abs() <= 1e-12 * expected[c].abs().max(1.0),
                "{what}: {actual:?} vs {expected:?}"
            );
        }
    }

    #[test]
    fn the_window_branch_averages_exactly_the_last_window_tokens_of_its_kv_head() {
        let (q, k, v) = averaging_problem();
        let config = small();
        let o = window_attention(NsaInputs { q: q.view(), k: k.view(), v: v.view() }, &config, ()).unwrap();
        for t in 0..19usize {
            for h in 0..4 {
                let expected = mean_value(&v, h / 2, (t + 1).saturating_sub(config.window)..=t);
                assert_close([o[[t, h, 0]], o[[t, h, 1]]], expected, &format!("query {t}, head {h}"));
            }
        }
    }

    #[test]
    fn the_selected_branch_averages_the_visible_tokens_of_the_listed_blocks() {
        let (q, k, v) = averaging_problem();
        let config = small();
        // KV head 0 lists blocks 0 and 2 wherever they exist, KV head 1 block 1 only (nothing before token 8).
        let selection = Array3::from_shape_fn((19, 2, 4), |(t, kv, w)| match (kv, w) {
            (0, 0) => 0,
            (0, 1) if t >= 16 => 2,
            (1, 0) if t >= 8 => 1,
            _ => -1,
        });
        let o = selected_attention(NsaInputs { q: q.view(), k: k.view(), v: v.view() }, selection.view(), &config, ())
            .unwrap();
        for t in 0..19 {
            for h in 0..4 {
                let tokens: Vec<usize> = match h / 2 {
                    0 => (0..8.min(t + 1)).chain(16..(t + 1).max(16)).collect(),
                    _ => (8..16.min(t + 1)).collect(),
                };
                let actual = [o[[t, h, 0]], o[[t, h, 1]]];
                if tokens.is_empty() {
                    assert_eq!(actual, [0.0, 0.0], "query {t}, head {h}: nothing listed is visible");
                } else {
                    assert_close(actual, mean_value(&v, h / 2, tokens.into_iter()), &format!("query {t}, head {h}"));
                }
            }
        }
    }

    #[test]
    fn a_bad_selection_entry_is_reported_at_its_query_and_kv_head() {
        let (q, k, v) = problem();
        // T = 19 makes 3 blocks of 8, so index 3 is out of range; at query 10, KV head 1 the row is 10 · 2 + 1 = 21.
        let mut selection = Array3::from_elem((19, 2, 4), -1);
        selection[[10, 1, 0]] = 3;
        let err =
            selected_attention(NsaInputs { q: q.view(), k: k.view(), v: v.view() }, selection.view(), &small(), ())
                .unwrap_err();
        assert!(
            matches!(err, OracleError::IndexList { argument: "selection", ref position, .. } if position == &[21, 0]),
            "{err}"
        );
    }

    #[test]
    fn compressed_windows_are_visible_once_complete_and_each_head_reads_its_group_s_kv_head() {
        let (q, k, v) = problem();
        let config = small();
        let full = compressed_attention(NsaInputs { q: q.view(), k: k.view(), v: v.view() }, &config, ()).unwrap();
        // Window c covers tokens 2c..2c+4: query t sees it when 2c + 3 ≤ t.
        for h in 0..4 {
            for t in 0..19 {
                for c in 0..full.p.dim().2 {
                    assert_eq!(full.p[[h, t, c]] > 0.0, 2 * c + 3 <= t, "head {h}, query {t}, window {c}");
                }
            }
        }
        // Head h alone over KV head h / 2 alone gives the same output.
        for h in 0..4 {
            let kv = h / 2;
            let one = compressed_attention(
                NsaInputs {
                    q: q.slice_axis(Axis(1), ndarray::Slice::from(h..h + 1)),
                    k: k.slice_axis(Axis(1), ndarray::Slice::from(kv..kv + 1)),
                    v: v.slice_axis(Axis(1), ndarray::Slice::from(kv..kv + 1)),
                },
                &config,
                (),
            )
            .unwrap();
            assert_eq!(one.o.index_axis(Axis(1), 0), full.o.index_axis(Axis(1), h), "head {h}");
        }
    }

    #[test]
    fn the_output_mixes_the_three_branches_by_their_sigmoid_gates() {
        let (q, k, v) = problem();
        // Distinct gate logits per (query, head, branch), negative and positive.
        let gates = Array3::from_shape_fn((19, 4, 3), |(t, h, b)| (t as f64 - 9.0) / 4.0 + h as f64 - b as f64 * 1.5);
        let f = nsa_forward(NsaInputs { q: q.view(), k: k.view(), v: v.view() }, gates.view(), &small(), ()).unwrap();
        let sigma = |x: f64| 1.0 / (1.0 + (-x).exp());
        for ((t, h, e), &o) in f.o.indexed_iter() {
            let expected = sigma(gates[[t, h, 0]]) * f.compressed.o[[t, h, e]]
                + sigma(gates[[t, h, 1]]) * f.selected[[t, h, e]]
                + sigma(gates[[t, h, 2]]) * f.window[[t, h, e]];
            assert!((o - expected).abs() <= 1e-14, "query {t}, head {h}, column {e}: {o} vs {expected}");
        }
        assert!(f.window.iter().any(|&x| x.abs() > 0.1), "the window branch contributes");
    }

    #[test]
    fn every_kv_head_is_transposed_on_its_own() {
        let heads =
            [ndarray::array![[0, -1], [0, 1], [1, -1], [0, 1]], ndarray::array![[1, -1], [0, -1], [0, 1], [-1, -1]]];
        let selection = Array3::from_shape_fn((4, 2, 2), |(t, kv, w)| heads[kv][[t, w]]);
        let per_head = transpose_selection_heads(selection.view(), 2).unwrap();
        let expected: Vec<BlockQueries> = heads.iter().map(|h| transpose_selection(h.view(), 2).unwrap()).collect();
        assert_eq!(per_head, expected);
        assert_ne!(expected[0], expected[1]);
    }

    #[test]
    fn a_bad_csr_is_reported_where_it_goes_wrong() {
        let position =
            |offsets: Vec<i32>, indices: Vec<i32>| match selection_from_csr(&BlockQueries { offsets, indices }, 4, 2) {
                Err(OracleError::IndexList { argument: "offsets", position, .. }) => position,
                other => panic!("expected an offsets error, got {other:?}"),
            };
        assert_eq!(position(vec![1, 2], vec![0, 1]), [0], "offsets start at 0");
        assert_eq!(position(vec![0, 2, 1, 3], vec![0, 1, 2]), [2], "the offset that decreases");
        assert_eq!(position(vec![0, 1, 2], vec![0, 1, 2]), [2], "the last offset, which must be the number of indices");
    }

    #[test]
    fn the_group_sum_adds_the_query_heads_of_each_kv_head_and_no_others() {
        // Six query heads over three KV heads (groups of two); head h carries 10^h so that every sum names its heads.
        let p_cmp = Array3::from_shape_fn((6, 2, 1), |(h, t, _)| 10f64.powi(h as i32) * (t + 1) as f64);
        let summed = group_sum(p_cmp.view(), 3, ()).unwrap();
        assert_eq!(summed.dim(), (2, 3, 1));
        for t in 0..2 {
            let scale = (t + 1) as f64;
            assert_eq!(summed[[t, 0, 0]], 11.0 * scale);
            assert_eq!(summed[[t, 1, 0]], 1_100.0 * scale);
            assert_eq!(summed[[t, 2, 0]], 110_000.0 * scale);
        }
        // One KV head per query head: the sum is a transpose.
        assert_eq!(group_sum(p_cmp.view(), 6, ()).unwrap().index_axis(Axis(0), 1), p_cmp.index_axis(Axis(1), 1));
    }

    #[test]
    fn head_counts_must_be_positive_and_divide() {
        assert_eq!(check_head_ratio(4, 2), Ok(()));
        for (q, kv) in [(0, 1), (0, 0), (4, 0), (4, 3)] {
            assert_eq!(check_head_ratio(q, kv), Err(OracleError::HeadRatio { n_heads_q: q, n_heads_kv: kv }));
        }
    }

    #[test]
    fn bad_inputs_are_refused() {
        let (q, k, v) = problem();
        let config = small();
        let run = |q: &Array3<f64>, k: &Array3<f64>, v: &Array3<f64>, g: &Array3<f64>| {
            nsa_forward(NsaInputs { q: q.view(), k: k.view(), v: v.view() }, g.view(), &config, ())
        };
        let gates = Array3::zeros((19, 4, 3));
        assert!(run(&q, &k, &v, &gates).is_ok());
        let k3 = tensor(2, (19, 3, 3));
        assert_eq!(
            run(&q, &k3, &tensor(3, (19, 3, 2)), &gates).unwrap_err(),
            OracleError::HeadRatio { n_heads_q: 4, n_heads_kv: 3 }
        );
        assert!(matches!(
            run(&q, &tensor(2, (18, 2, 3)), &v, &gates),
            Err(OracleError::ShapeMismatch { argument: "k", .. })
        ));
        assert!(matches!(
            run(&q, &k, &tensor(3, (19, 1, 2)), &gates),
            Err(OracleError::ShapeMismatch { argument: "v", .. })
        ));
        assert!(matches!(
            run(&q, &k, &v, &Array3::zeros((19, 4, 2))),
            Err(OracleError::ShapeMismatch { argument: "gate_logits", .. })
        ));
        let mut bad_q = q.clone();
        bad_q[[5, 1, 2]] = f64::INFINITY;
        assert!(matches!(
            run(&bad_q, &k, &v, &gates),
            Err(OracleError::NonFinite { argument: "q", ref index, .. }) if index == &[5, 1, 2]
        ));
        let mut bad_gates = gates.clone();
        bad_gates[[0, 0, 1]] = f64::NAN;
        assert!(matches!(run(&q, &k, &v, &bad_gates), Err(OracleError::NonFinite { argument: "gate_logits", .. })));
        let empty_d = Array3::zeros((19, 4, 0));
        assert_eq!(
            run(&empty_d, &Array3::zeros((19, 2, 0)), &v, &gates).unwrap_err(),
            OracleError::ZeroDimension { argument: "head_dim" }
        );
    }

    #[test]
    fn bad_selections_are_refused() {
        let (q, k, v) = problem();
        let inputs = NsaInputs { q: q.view(), k: k.view(), v: v.view() };
        let mut selection = Array3::from_elem((19, 2, 4), -1);
        selection[[3, 1, 0]] = 3; // M = ⌈19/8⌉ = 3 blocks: index 3 is out of range.
        assert!(matches!(
            selected_attention(inputs, selection.view(), &small(), ()),
            Err(OracleError::IndexList { argument: "selection", .. })
        ));
        assert!(matches!(
            selected_attention(inputs, Array3::from_elem((19, 1, 4), -1).view(), &small(), ()),
            Err(OracleError::ShapeMismatch { argument: "selection", .. })
        ));
        let scores = Array3::<f64>::zeros((19, 2, 2));
        assert!(matches!(
            select_blocks(scores.view(), &small()),
            Err(OracleError::ShapeMismatch { argument: "block_scores", .. })
        ));
    }

    #[test]
    fn f64_and_mpfr_run_the_same_forward() {
        let (q, k, v) = problem();
        let gates = tensor(4, (19, 4, 3));
        let config = NsaConfig { compress_values: Compression::Weighted(vec![0.5, -1.0, 2.0, 0.25]), ..small() };
        let f =
            nsa_forward(NsaInputs { q: q.view(), k: k.view(), v: v.view() }, gates.view(), &config, ()).expect("valid");
        let p = Precision(256);
        let mp = |x: &Array3<f64>| x.mapv(|y| Mp::new(y, p));
        let (qm, km, vm) = (mp(&q), mp(&k), mp(&v));
        let m = nsa_forward(NsaInputs { q: qm.view(), k: km.view(), v: vm.view() }, mp(&gates).view(), &config, p)
            .expect("valid");
        assert_eq!(f.selection, m.selection);
        for (a, b) in f.o.iter().zip(m.o.iter()) {
            assert!((a - b.to_f64()).abs() < 1e-13, "{a} vs {b}");
        }
        // Queries 0..=2 see no complete window (l = 4): their compressed output is 0 (E1c).
        assert!(f.compressed.o.index_axis(Axis(0), 2).iter().all(|&x| x == 0.0));
        assert!(f.compressed.o.index_axis(Axis(0), 3).iter().any(|&x| x != 0.0));
        // Each row of p_cmp is a distribution over the visible windows.
        let row_sum: f64 = f.compressed.p.index_axis(Axis(0), 1).row(10).sum();
        assert!((row_sum - 1.0).abs() < 1e-14);
    }

    #[test]
    fn mean_compression_averages_each_window_at_its_stride() {
        // x_t = (t, −2t): window c covers tokens 2c..2c+4 (l = 4, s = 2), whose mean is (2c + 1.5, −4c − 3).
        let x = Array2::from_shape_fn((11, 2), |(t, j)| if j == 0 { t as f64 } else { -2.0 * t as f64 });
        let compressed = compress(x.view(), &Compression::Mean, &small(), ()).unwrap();
        assert_eq!(compressed.nrows(), 4, "windows 0..4 end by token 10");
        for c in 0..4 {
            assert_eq!(compressed.row(c).to_vec(), vec![2.0 * c as f64 + 1.5, -4.0 * c as f64 - 3.0], "window {c}");
        }
        // A caller's map weighs the window's tokens in order.
        let weighted = NsaConfig { compress_keys: Compression::Weighted(vec![1.0, 0.0, 0.0, 2.0]), ..small() };
        let compressed = compress(x.view(), &weighted.compress_keys, &weighted, ()).unwrap();
        assert_eq!(compressed.row(1).to_vec(), vec![2.0 + 2.0 * 5.0, -4.0 - 4.0 * 5.0]);
    }

    #[test]
    fn map_gradients_sum_per_kind_and_refuse_another_map() {
        // Zero is shaped like the map's parameters, so the first head's gradient added to it is that gradient.
        let linear = Compression::Linear(Array2::zeros((4, 2)));
        let mut sum = MapGradient::<f64>::zeros(&linear, ());
        assert_eq!(sum, MapGradient::Linear(Array2::zeros((4, 2))));
        let head = |base: f64| MapGradient::Linear(Array2::from_shape_fn((4, 2), |(r, k)| base + (2 * r + k) as f64));
        sum.add(&head(1.0)).unwrap();
        sum.add(&head(-0.5)).unwrap();
        assert_eq!(sum, MapGradient::Linear(Array2::from_shape_fn((4, 2), |(r, k)| 0.5 + 2.0 * (2 * r + k) as f64)));
        let mut weighted = MapGradient::<f64>::zeros(&Compression::Weighted(vec![1.0, 2.0, 3.0]), ());
        weighted.add(&MapGradient::Weighted(ndarray::array![1.0, -2.0, 4.0])).unwrap();
        weighted.add(&MapGradient::Weighted(ndarray::array![0.5, 0.5, 0.5])).unwrap();
        assert_eq!(weighted, MapGradient::Weighted(ndarray::array![1.5, -1.5, 4.5]));
        let mut mean = MapGradient::<f64>::zeros(&Compression::Mean, ());
        assert_eq!(mean.add(&MapGradient::Mean), Ok(()));
        assert_eq!(mean, MapGradient::Mean);
        // Another map's gradient (another kind or another shape) is refused, naming both maps, and the sum is left as
        // it was.
        let refused = |reason: &str| OracleError::InvalidParameter { argument: "map gradient", reason: reason.into() };
        assert_eq!(
            mean.add(&MapGradient::Weighted(ndarray::array![1.0])),
            Err(refused("a position-weight gradient cannot be added to a mean one"))
        );
        assert_eq!(sum.add(&MapGradient::Mean), Err(refused("a mean gradient cannot be added to a matrix one")));
        assert_eq!(
            weighted.add(&MapGradient::Weighted(ndarray::array![1.0, 2.0])),
            Err(OracleError::ShapeMismatch { argument: "map gradient", expected: vec![3], actual: vec![2] })
        );
        assert_eq!(weighted, MapGradient::Weighted(ndarray::array![1.5, -1.5, 4.5]));
        assert!(matches!(
            sum.add(&MapGradient::Linear(Array2::zeros((2, 4)))),
            Err(OracleError::ShapeMismatch { expected, actual, .. }) if expected == [4, 2] && actual == [2, 4]
        ));
    }

    #[test]
    fn forced_blocks_and_overlaps() {
        let config = NsaConfig::default();
        assert_eq!(config.forced_blocks(0), vec![0]);
        assert_eq!(config.forced_blocks(64), vec![0, 1]);
        assert_eq!(config.forced_blocks(64 * 5 + 3), vec![0, 4, 5]);
        // More forced blocks than the query can see: only the blocks up to its own (the current one included).
        let initial_only = NsaConfig { n_forced_initial: 3, n_forced_local: 0, ..NsaConfig::default() };
        assert_eq!(initial_only.forced_blocks(0), vec![0]);
        assert_eq!(initial_only.forced_blocks(64), vec![0, 1]);
        assert_eq!(initial_only.forced_blocks(64 * 7), vec![0, 1, 2]);
        let local_only = NsaConfig { n_forced_initial: 0, n_forced_local: 3, ..NsaConfig::default() };
        assert_eq!(local_only.forced_blocks(0), vec![0]);
        assert_eq!(local_only.forced_blocks(64), vec![0, 1]);
        assert_eq!(local_only.forced_blocks(64 * 7 + 63), vec![5, 6, 7]);
        // Window 4j−1 overlaps block j in its second half only: s tokens.
        assert_eq!(config.window_block_overlap(4 * 3 - 1, 3), config.compress_stride);
        assert_eq!(config.window_block_overlap(4 * 3, 3), config.compress_len);
        assert_eq!(config.window_block_overlap(4 * 3 + 4, 3), 0);
    }

    #[test]
    fn csr_round_trip_and_fan_in() {
        let selection = ndarray::array![[0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, -1]];
        let csr = transpose_selection(selection.view(), 4).expect("valid");
        assert_eq!(csr.offsets, vec![0, 3, 6, 8, 8]);
        assert_eq!(csr.queries_of(1), &[1, 2, 3]);
        assert_eq!(selection_from_csr(&csr, 4, 3), Ok(selection.clone()));
        let fan_in = csr.fan_in();
        assert_eq!((fan_in.max, fan_in.total), (3, 8));
        assert_eq!(fan_in.mean, 2.0);
        // Counts 3, 3, 2, 0: one block in bucket 0, one in [2, 4) twice over.
        assert_eq!(fan_in.histogram, vec![1, 0, 3]);
        let mut broken = csr.clone();
        broken.offsets[2] = 7;
        broken.offsets[3] = 6;
        assert!(matches!(selection_from_csr(&broken, 4, 3), Err(OracleError::IndexList { argument: "offsets", .. })));
        let mut unsorted = csr.clone();
        unsorted.indices.swap(0, 1);
        assert!(matches!(selection_from_csr(&unsorted, 4, 3), Err(OracleError::IndexList { argument: "indices", .. })));
        assert!(matches!(selection_from_csr(&csr, 4, 2), Err(OracleError::InvalidParameter { argument: "width", .. })));
        let bad = ndarray::array![[1, 0, -1]];
        assert!(matches!(
            transpose_selection(bad.view(), 4),
            Err(OracleError::IndexList { argument: "selection", .. })
        ));
    }
}
