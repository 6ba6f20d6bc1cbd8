//! NSA's compression (E18) on the GPU: `gpu/kernels/nsa_compress.cu` behind typed wrappers, from device buffers
//! ([`compress_kv_device`]) or host tensors ([`compress_kv`]); and its backward onto the tokens
//! ([`compress_kv_backward_device`], the transpose of the pooling: the oracle's `compress_backward`'s `∂L/∂x`); and the
//! learned matrix's own gradient ([`compress_map_gradient_device`], its `∂L/∂W` summed over sequences and KV heads).
//!
//! For every sequence, KV head and complete window `c` (tokens `c·s ..= c·s + l − 1`, all inside the sequence: the
//! oracle's `complete_windows`), the compressed key is `k̃_c = φ_K(k_{c·s}, …, k_{c·s+l−1})` and the compressed value
//! `ṽ_c = φ_V(…)`, with φ the mean (the default of E18), the caller's position weights `Σ_i w_i x_{c·s+i}`, or the
//! paper's learned map as a caller's matrix `W` `[l·d, d]` applied to the window's `l` rows stacked into one vector
//! ([`Compression`]). The compressed operands are laid out like K and V with one row per window
//! ([`compressed_shape`]): dense `[B, Hkv, W, d]` with `W` the windows of the common key length, varlen packed
//! `[ΣW_b, Hkv, d]` whose sequence `b` starts at row [`window_offsets`]`[b]` — the `cu_seqlens_k` of the compressed
//! attention that reads them. Only the key side of the spec matters: its layout, lengths, KV heads and head dims.
//!
//! # Recipe and bound
//!
//! Each output element is an f64 evaluation in ascending window position (plain additions and one division by `l`
//! for the mean, one fused multiply-add per position for weights, one per stacked index `i·d + j` for the matrix),
//! rounded to f32 and then to the storage type. The matrix runs as f64 loops on the CUDA cores, not as a tensor-core
//! GEMM: its recipe stays exact enough to be followed bit for bit by the CPU reference. The
//! CPU reference `attnproof_reference::sparse::nsa::compress_head` performs the same operations in the same order,
//! so the GPU's bits must equal it; both lie within `attnproof_proofs::nsa_bound::compression_bound` of the oracle's
//! value (the storage rounding plus a negligible f64 term). f64 accumulation also keeps a sum of `l` values near the
//! storage type's largest from overflowing, which an f32 sum of bf16 values would not.
//!
//! # Errors
//!
//! Everything is checked before the first launch: the configuration ([`NsaConfig::validate`]: positive lengths,
//! weight lists of length `l` with finite entries), the spec (head dims multiples of 8 up to 256, like every kernel
//! here), the buffers' lengths, and sizes against the kernel's 32-bit arguments.

use std::sync::Arc;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::Layout;
use attnproof_oracle::nsa::{Compression, NsaConfig, complete_windows};
use attnproof_oracle::spec::Operand;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::{ArrayD, ArrayViewD, IxDyn};

use crate::common::{GpuElement, check_len, grid_3d, to_i32};
use crate::compile::{self, KernelSource};
use crate::error::GpuError;
use crate::flash::host_input;
use crate::launch;
use crate::params::{FlashParams, NsaParams};

/// `gpu/kernels/nsa_compress.cu` after the shared helpers.
pub const NSA_COMPRESS: KernelSource = KernelSource {
    name: "nsa_compress",
    source: concat!(include_str!("../../kernels/common.cuh"), include_str!("../../kernels/nsa_compress.cu")),
};

/// Threads per CTA (the kernel's `CMP_THREADS`): each owns 8 columns of one window.
const THREADS: usize = 128;

/// Everything a launch needs, derived from a validated spec and configuration.
struct Plan {
    params: NsaParams,
    cu_k: Vec<i32>,
    cu_windows: Vec<i32>,
    /// The windows of the sequence with the most.
    max_windows: usize,
    /// φ_K's weights, then φ_V's ([`weights_of`]: `l` each, or `l·cols²` for a matrix).
    weights: Vec<f64>,
}

/// The complete windows of each sequence's keys, in batch order.
pub fn window_counts(spec: &AttentionSpec, config: &NsaConfig) -> Result<Vec<usize>, GpuError> {
    config.validate()?;
    spec.sequences()
        .iter()
        .map(|s| complete_windows(s.len_k, config.compress_len, config.compress_stride).map_err(GpuError::from))
        .collect()
}

/// Where each sequence's windows start in a packed layout, `[0, W_0, W_0 + W_1, …]` (one entry per sequence and one
/// more): the compressed keys' `cu_seqlens`.
pub fn window_offsets(spec: &AttentionSpec, config: &NsaConfig) -> Result<Vec<i32>, GpuError> {
    let counts = window_counts(spec, config)?;
    let mut offsets = Vec::with_capacity(counts.len() + 1);
    let mut total = 0usize;
    offsets.push(0);
    for w in counts {
        total += w;
        offsets.push(to_i32("compressed windows", total)?);
    }
    Ok(offsets)
}

/// The shape of the compressed keys (`operand` = [`Operand::K`]) or values ([`Operand::V`]): dense `[B, Hkv, W, d]`,
/// varlen `[ΣW_b, Hkv, d]` (`dv` for values).
pub fn compressed_shape(spec: &AttentionSpec, config: &NsaConfig, operand: Operand) -> Result<Vec<usize>, GpuError> {
    let cols = match operand {
        Operand::K => spec.head_dim,
        Operand::V => spec.head_dim_v,
        other => {
            return Err(GpuError::Unsupported {
                argument: "operand",
                reason: format!("compression takes the keys or the values, not {other:?}"),
            });
        }
    };
    let counts = window_counts(spec, config)?;
    Ok(match spec.layout {
        Layout::Dense { batch, .. } => vec![batch, spec.n_heads_kv, counts.first().copied().unwrap_or(0), cols],
        Layout::Varlen { .. } => vec![counts.iter().sum(), spec.n_heads_kv, cols],
    })
}

/// The map flag of `nsa_compress.cu` (`MAP_MEAN`, `MAP_WEIGHTS`, `MAP_MATRIX`) and the map's weights as the kernel reads
/// them: none for the mean (`l` zeros, never read), the `l` position weights, or the learned matrix row-major
/// `[l·cols, cols]`, whose shape is checked against the operand's `cols` here (the configuration cannot know it).
fn weights_of(map: &Compression, len: usize, cols: usize, argument: &'static str) -> Result<(i32, Vec<f64>), GpuError> {
    match map {
        Compression::Mean => Ok((0, vec![0.0; len])),
        Compression::Weighted(w) => Ok((1, w.clone())),
        Compression::Linear(w) => {
            if w.dim() != (len * cols, cols) {
                return Err(GpuError::Shape { argument, expected: vec![len * cols, cols], actual: w.shape().to_vec() });
            }
            Ok((2, w.iter().copied().collect()))
        }
    }
}

fn plan(spec: &AttentionSpec, config: &NsaConfig) -> Result<Plan, GpuError> {
    let counts = window_counts(spec, config)?;
    let (flash, _, cu_k) = FlashParams::for_spec(spec)?;
    let cu_windows = window_offsets(spec, config)?;
    let dense = matches!(spec.layout, Layout::Dense { .. });
    let l = config.compress_len;
    let (weighted_keys, mut weights) = weights_of(&config.compress_keys, l, spec.head_dim, "compress_keys")?;
    let (weighted_values, value_weights) = weights_of(&config.compress_values, l, spec.head_dim_v, "compress_values")?;
    weights.extend(value_weights);
    let params = NsaParams {
        flash,
        rows: super::o_rows(spec)?,
        compress_len: to_i32("compress_len", config.compress_len)?,
        compress_stride: to_i32("compress_stride", config.compress_stride)?,
        n_heads_kv: to_i32("n_heads_kv", spec.n_heads_kv)?,
        dense_windows: if dense { to_i32("compressed windows", counts.first().copied().unwrap_or(0))? } else { 0 },
        weighted_keys,
        weighted_values,
    };
    let max_windows = counts.iter().copied().max().unwrap_or(0);
    Ok(Plan { params, cu_k, cu_windows, max_windows, weights })
}

/// The grid of one operand's launch: enough CTAs along x for the longest sequence's windows at `128 / (cols / 8)`
/// windows per CTA, the KV heads along y, the sequences along z.
fn grid(max_windows: usize, cols: usize, heads: usize, batch: usize) -> Result<(u32, u32, u32), GpuError> {
    let per_cta = THREADS / (cols / 8);
    grid_3d(("compressed windows", max_windows.div_ceil(per_cta)), ("n_heads_kv", heads), ("sequences", batch))
}

/// Compresses K and V of `spec` under `config` on device buffers: `k`, `v` in the spec's layout, `k_cmp` and `v_cmp`
/// with at least [`compressed_shape`]'s elements (the first ones are written). `kernel` is [`NSA_COMPRESS`] or a
/// patched copy of it (the tests launch mutants through this path). Every check runs before the first launch; the
/// launches are asynchronous on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn compress_kv_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernel: KernelSource,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    k_cmp: &mut CudaSlice<T>,
    v_cmp: &mut CudaSlice<T>,
) -> Result<(), GpuError> {
    let plan = plan(spec, config)?;
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_len("k", k, size(Operand::K))?;
    check_len("v", v, size(Operand::V))?;
    check_len("k_cmp", k_cmp, compressed_shape(spec, config, Operand::K)?.iter().product())?;
    check_len("v_cmp", v_cmp, compressed_shape(spec, config, Operand::V)?.iter().product())?;
    let batch = spec.sequences().len();
    if plan.max_windows == 0 || batch == 0 || spec.n_heads_kv == 0 {
        return Ok(());
    }
    let module = compile::module(stream.context(), kernel, &[T::DEFINE.to_owned()])?;
    let load = |name: &'static str| {
        module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(nsa_compress.cu)", e))
    };
    let (keys, values) = (load("nsa_compress_keys")?, load("nsa_compress_values")?);
    let up_err = |e| GpuError::driver("cuMemcpyHtoD(nsa_compress)", e);
    let cu_k = stream.clone_htod(&plan.cu_k).map_err(up_err)?;
    let cu_windows = stream.clone_htod(&plan.cu_windows).map_err(up_err)?;
    let weights = stream.clone_htod(&plan.weights).map_err(up_err)?;
    for (func, x, out, cols) in [(&keys, k, k_cmp, spec.head_dim), (&values, v, v_cmp, spec.head_dim_v)] {
        let cfg = LaunchConfig {
            grid_dim: grid(plan.max_windows, cols, spec.n_heads_kv, batch)?,
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        launch::launch_nsa_compress(stream, func, cfg, (x, out), &weights, (&cu_k, &cu_windows), &plan.params)?;
    }
    Ok(())
}

/// The backward of the pooling (the oracle's `compress_backward`, its `∂L/∂x`) on device buffers: from the compressed
/// keys' and values' gradients `dk_cmp`, `dv_cmp` ([`compressed_shape`]'s layout) writes every token row of `dk` and
/// `dv` (the spec's K and V layouts): each token collects the gradient of every complete window that holds it, times
/// its weight in the window (`1/l` for the mean), in ascending window order in f64, rounded once to f32 and once to the
/// storage type; a token no complete window holds gets zero. What a layer adds to the compressed attention's backward
/// (its dK̃, dṼ) to reach the tokens. Checks, kernel and asynchrony as in [`compress_kv_device`].
#[allow(clippy::too_many_arguments)]
pub fn compress_kv_backward_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernel: KernelSource,
    dk_cmp: &CudaSlice<T>,
    dv_cmp: &CudaSlice<T>,
    dk: &mut CudaSlice<T>,
    dv: &mut CudaSlice<T>,
) -> Result<(), GpuError> {
    let plan = plan(spec, config)?;
    let size = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
    check_len("dk_cmp", dk_cmp, compressed_shape(spec, config, Operand::K)?.iter().product())?;
    check_len("dv_cmp", dv_cmp, compressed_shape(spec, config, Operand::V)?.iter().product())?;
    check_len("dk", dk, size(Operand::K))?;
    check_len("dv", dv, size(Operand::V))?;
    let batch = spec.sequences().len();
    let max_len = spec.sequences().iter().map(|s| s.len_k).max().unwrap_or(0);
    if max_len == 0 || batch == 0 || spec.n_heads_kv == 0 {
        return Ok(());
    }
    let module = compile::module(stream.context(), kernel, &[T::DEFINE.to_owned()])?;
    let load = |name: &'static str| {
        module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(nsa_compress.cu)", e))
    };
    let (keys, values) = (load("nsa_compress_keys_backward")?, load("nsa_compress_values_backward")?);
    let up_err = |e| GpuError::driver("cuMemcpyHtoD(nsa_compress)", e);
    let cu_k = stream.clone_htod(&plan.cu_k).map_err(up_err)?;
    let cu_windows = stream.clone_htod(&plan.cu_windows).map_err(up_err)?;
    let weights = stream.clone_htod(&plan.weights).map_err(up_err)?;
    for (func, x, out, cols) in [(&keys, dk_cmp, dk, spec.head_dim), (&values, dv_cmp, dv, spec.head_dim_v)] {
        let cfg = LaunchConfig {
            // One thread per 8 columns of one token: the forward's grid with tokens for windows.
            grid_dim: grid(max_len, cols, spec.n_heads_kv, batch)?,
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        launch::launch_nsa_compress(stream, func, cfg, (x, out), &weights, (&cu_k, &cu_windows), &plan.params)?;
    }
    Ok(())
}

/// The learned matrix's own gradient for `operand` (K or V) on device buffers: the oracle's `compress_backward`'s
/// `∂L/∂W` `[l·cols, cols]`, summed over every sequence and KV head (one matrix serves them all), from the operand
/// `x` (the spec's K or V layout) and its compressed gradient `dx_cmp` ([`compressed_shape`]'s layout); written to the
/// first `l·cols²` elements of `d_map` in f32, row-major. Each element is an f64 chain over the sequences, then the
/// KV heads, then the windows, in ascending order, rounded once to f32 (zero where no window exists). Only
/// [`Compression::Linear`] has parameters here; another map for `operand` is [`GpuError::Unsupported`]. Checks,
/// kernel and asynchrony as in [`compress_kv_device`].
#[allow(clippy::too_many_arguments)]
pub fn compress_map_gradient_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    kernel: KernelSource,
    operand: Operand,
    x: &CudaSlice<T>,
    dx_cmp: &CudaSlice<T>,
    d_map: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    let plan = plan(spec, config)?;
    let (map, cols, name) = match operand {
        Operand::K => (&config.compress_keys, spec.head_dim, "nsa_compress_keys_map_backward"),
        Operand::V => (&config.compress_values, spec.head_dim_v, "nsa_compress_values_map_backward"),
        other => {
            return Err(GpuError::Unsupported {
                argument: "operand",
                reason: format!("a compression map belongs to K or V, not {other:?}"),
            });
        }
    };
    if !matches!(map, Compression::Linear(_)) {
        return Err(GpuError::Unsupported {
            argument: "compression map",
            reason: format!("only the learned matrix has parameters to differentiate; {operand:?}'s map is {map:?}"),
        });
    }
    let rows = config.compress_len * cols;
    check_len("x", x, spec.expected_shape(operand).iter().product())?;
    check_len("dx_cmp", dx_cmp, compressed_shape(spec, config, operand)?.iter().product())?;
    check_len("d_map", d_map, rows * cols)?;
    let batch = spec.sequences().len();
    let n_sequences = to_i32("sequences", batch)?;
    if plan.max_windows == 0 || batch == 0 || spec.n_heads_kv == 0 {
        // No window: the loss does not depend on the matrix.
        return stream
            .memset_zeros(&mut d_map.slice_mut(..rows * cols))
            .map_err(|e| GpuError::driver("cuMemsetD8Async(d_map)", e));
    }
    let module = compile::module(stream.context(), kernel, &[T::DEFINE.to_owned()])?;
    let func = module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(nsa_compress.cu)", e))?;
    let up_err = |e| GpuError::driver("cuMemcpyHtoD(nsa_compress)", e);
    let cu_k = stream.clone_htod(&plan.cu_k).map_err(up_err)?;
    let cu_windows = stream.clone_htod(&plan.cu_windows).map_err(up_err)?;
    let cfg = LaunchConfig {
        // One thread per 8 columns of one row of W: the forward's grid with rows of W for windows, no heads or
        // sequences (the kernel sums over them).
        grid_dim: grid(rows, cols, 1, 1)?,
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let seqs = (&cu_k, &cu_windows);
    launch::launch_nsa_compress_map_gradient(stream, &func, cfg, (x, dx_cmp), d_map, seqs, &plan.params, n_sequences)
}

/// The compressed keys and values, host side, in [`compressed_shape`]'s layout.
#[derive(Clone, Debug, PartialEq)]
pub struct CompressedKv<T> {
    /// `k̃`: dense `[B, Hkv, W, d]`, varlen `[ΣW_b, Hkv, d]`.
    pub k: ArrayD<T>,
    /// `ṽ`: dense `[B, Hkv, W, dv]`, varlen `[ΣW_b, Hkv, dv]`.
    pub v: ArrayD<T>,
}

/// Compresses K and V from host tensors (copies in, launches, copies out, synchronizes).
pub fn compress_kv<T: GpuElement>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    config: &NsaConfig,
    k: ArrayViewD<'_, T>,
    v: ArrayViewD<'_, T>,
) -> Result<CompressedKv<T>, GpuError> {
    plan(spec, config)?;
    let (hk, hv) = (host_input(spec, "k", Operand::K, &k)?, host_input(spec, "v", Operand::V, &v)?);
    let up = |data: &[T]| {
        if data.is_empty() { stream.alloc_zeros::<T>(1) } else { stream.clone_htod(data) }
            .map_err(|e| GpuError::driver("cuMemcpyHtoD", e))
    };
    let (dk, dv) = (up(hk)?, up(hv)?);
    let (k_shape, v_shape) = (compressed_shape(spec, config, Operand::K)?, compressed_shape(spec, config, Operand::V)?);
    let alloc = |n: usize| stream.alloc_zeros::<T>(n.max(1)).map_err(|e| GpuError::driver("cuMemAlloc", e));
    let (k_len, v_len) = (k_shape.iter().product::<usize>(), v_shape.iter().product::<usize>());
    let (mut k_cmp, mut v_cmp) = (alloc(k_len)?, alloc(v_len)?);
    compress_kv_device(stream, spec, config, NSA_COMPRESS, &dk, &dv, &mut k_cmp, &mut v_cmp)?;
    let down = |b: &CudaSlice<T>| stream.clone_dtoh(b).map_err(|e| GpuError::driver("cuMemcpyDtoH", e));
    let (mut k_back, mut v_back) = (down(&k_cmp)?, down(&v_cmp)?);
    stream.synchronize().map_err(|e| GpuError::driver("cuStreamSynchronize", e))?;
    k_back.truncate(k_len);
    v_back.truncate(v_len);
    let shaped = |shape: Vec<usize>, data| ArrayD::from_shape_vec(IxDyn(&shape), data).expect("length matches");
    Ok(CompressedKv { k: shaped(k_shape, k_back), v: shaped(v_shape, v_back) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> NsaConfig {
        NsaConfig::default()
    }

    #[test]
    fn dense_and_varlen_shapes_count_complete_windows() {
        let spec = AttentionSpec::dense(2, 4, 2, 100, 100, 64, 32);
        // ⌊(100 − 32) / 16⌋ + 1 = 5 windows.
        assert_eq!(compressed_shape(&spec, &config(), Operand::K).unwrap(), [2, 2, 5, 64]);
        assert_eq!(compressed_shape(&spec, &config(), Operand::V).unwrap(), [2, 2, 5, 32]);
        assert_eq!(window_offsets(&spec, &config()).unwrap(), [0, 5, 10]);
        let varlen = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 31, 31, 80], cu_seqlens_k: vec![0, 31, 31, 80] },
            ..AttentionSpec::dense(1, 3, 3, 1, 1, 16, 8)
        };
        // 31 tokens: none; 0 tokens: none; 49 tokens: ⌊17 / 16⌋ + 1 = 2.
        assert_eq!(window_counts(&varlen, &config()).unwrap(), [0, 0, 2]);
        assert_eq!(window_offsets(&varlen, &config()).unwrap(), [0, 0, 0, 2]);
        assert_eq!(compressed_shape(&varlen, &config(), Operand::V).unwrap(), [2, 3, 8]);
        let p = plan(&varlen, &config()).unwrap();
        assert_eq!((p.max_windows, p.params.dense_windows, p.params.compress_len), (2, 0, 32));
        assert_eq!(p.cu_windows, [0, 0, 0, 2]);
    }

    #[test]
    fn plans_carry_the_weights_of_each_map() {
        let spec = AttentionSpec::dense(1, 2, 1, 40, 40, 8, 8);
        let w: Vec<f64> = (0..32).map(|i| i as f64 / 7.0).collect();
        let cfg = NsaConfig { compress_values: Compression::Weighted(w.clone()), ..config() };
        let p = plan(&spec, &cfg).unwrap();
        assert_eq!((p.params.weighted_keys, p.params.weighted_values), (0, 1));
        assert_eq!(p.weights[..32], [0.0; 32]);
        assert_eq!(p.weights[32..], w[..]);
        assert_eq!(p.params.dense_windows, 1);
    }

    #[test]
    fn bad_configurations_and_operands_are_typed_errors() {
        let spec = AttentionSpec::dense(1, 2, 1, 64, 64, 64, 64);
        let zero = NsaConfig { compress_stride: 0, ..config() };
        assert!(matches!(plan(&spec, &zero), Err(GpuError::Spec(_))));
        let short = NsaConfig { compress_keys: Compression::Weighted(vec![1.0; 31]), ..config() };
        assert!(matches!(plan(&spec, &short), Err(GpuError::Spec(_))));
        let nan = NsaConfig { compress_values: Compression::Weighted(vec![f64::NAN; 32]), ..config() };
        assert!(matches!(plan(&spec, &nan), Err(GpuError::Spec(_))));
        // A learned matrix must be [l·cols, cols] for its operand's columns (here d = dv = 64).
        let learned = |rows, cols| NsaConfig {
            compress_values: Compression::Linear(ndarray::Array2::zeros((rows, cols))),
            ..config()
        };
        assert!(plan(&spec, &learned(32 * 64, 64)).is_ok());
        assert!(matches!(
            plan(&spec, &learned(32 * 64, 32)),
            Err(GpuError::Shape { argument: "compress_values", .. }) | Err(GpuError::Spec(_))
        ));
        assert!(matches!(
            plan(&spec, &learned(31 * 64, 64)),
            Err(GpuError::Shape { argument: "compress_values", .. }) | Err(GpuError::Spec(_))
        ));
        let odd = AttentionSpec::dense(1, 2, 1, 64, 64, 12, 64);
        assert!(matches!(plan(&odd, &config()), Err(GpuError::Unsupported { argument: "head_dim", .. })));
        assert!(matches!(
            compressed_shape(&spec, &config(), Operand::Q),
            Err(GpuError::Unsupported { argument: "operand", .. })
        ));
    }

    #[test]
    fn a_learned_key_matrix_moves_the_value_weights_past_it() {
        // d = 8, dv = 16, l = 2: φ_K's matrix has 2·8·8 = 128 entries, φ_V's 2·16·16 = 512, row-major.
        let spec = AttentionSpec::dense(1, 2, 1, 40, 40, 8, 16);
        let keys = ndarray::Array2::from_shape_fn((16, 8), |(r, c)| (r * 8 + c) as f64);
        let values = ndarray::Array2::from_shape_fn((32, 16), |(r, c)| -((r * 16 + c) as f64));
        let cfg = NsaConfig {
            compress_len: 2,
            compress_stride: 2,
            compress_keys: Compression::Linear(keys),
            compress_values: Compression::Linear(values),
            ..config()
        };
        let p = plan(&spec, &cfg).unwrap();
        assert_eq!((p.params.weighted_keys, p.params.weighted_values), (2, 2));
        assert_eq!(p.weights.len(), 128 + 512);
        assert_eq!(p.weights[..128], (0..128).map(|i| i as f64).collect::<Vec<_>>()[..]);
        assert_eq!(p.weights[128..], (0..512).map(|i| -(i as f64)).collect::<Vec<_>>()[..]);
    }

    #[test]
    fn the_grid_covers_every_window_of_the_longest_sequence() {
        // d = 128: 16 chunks, 8 windows per CTA; d = 40: 5 chunks, 25 windows per CTA.
        assert_eq!(grid(17, 128, 4, 2).unwrap(), (3, 4, 2));
        assert_eq!(grid(25, 40, 1, 1).unwrap(), (1, 1, 1));
        assert_eq!(grid(26, 40, 1, 1).unwrap(), (2, 1, 1));
        assert_eq!(grid(1, 256, 1, 1).unwrap(), (1, 1, 1));
        assert!(matches!(grid(1, 8, 70_000, 1), Err(GpuError::TooLarge { argument: "n_heads_kv", .. })));
    }
}
