//! DSA's indexer loss in the sparse training stage (E16's KL on the selected tokens) and its gradients on the GPU:
//! `gpu/kernels/dsa_loss.cu` behind typed wrappers, from device buffers ([`indexer_loss_device`]) or host tensors
//! ([`indexer_loss`]).
//!
//! # What it computes
//!
//! One sequence of `T` tokens. Token `t`'s list `J_t` (`lists [T, k]` `i32`, the indexer's rows: ascending, `−1`-padded,
//! every entry `≤ t`) is the support of its row. The student is the indexer's score `I_ts = Σ_a w_ta ReLU(q^I_ta ·
//! k^I_s)`; the teacher is the main attention's probabilities summed over its `H` query heads, `τ_ts = Σ_h exp(α q_th
//! · k_{s,kv(h)} − lse_th)`, renormalized on the list, `τ'_ts = τ_ts / Σ_{s∈J_t} τ_ts`. The loss of row `t` is
//! `KL_t = Σ_{s∈J_t, τ'>0} τ'_ts (log τ'_ts − log σ_ts)` with `σ_ts = softmax_{s∈J_t}(I_ts)`, and its gradients
//! (the lists held fixed) follow from `∂KL_t/∂I_ts = σ_ts − τ'_ts` through the ReLU (its derivative 0 at 0):
//! `∂/∂w_ta = Σ_s (σ − τ')_ts ReLU(l_tas)`, `∂/∂q^I_ta = Σ_s (σ − τ')_ts w_ta [l_tas > 0] k^I_s` and `∂/∂k^I_s =
//! Σ_{t,a} (σ − τ')_ts w_ta [l_tas > 0] q^I_ta`, with `l_tas = q^I_ta · k^I_s`. This is
//! `attnproof_oracle::dsa::indexer_loss_and_gradients` with `LossSupport::Selected(lists)` and the teacher above; a
//! row with no teacher mass on its list (an empty list) contributes nothing.
//!
//! Given the LSE of the token-sparse forward over the same lists (`dsa::sparse`), every head's probabilities sum to
//! 1 on `J_t`, so `τ' = τ / H`: the sparse training stage's teacher. Given a dense forward's LSE, `τ'` is the dense
//! attention's head-summed distribution restricted to the list and renormalized. The main attention's keys are
//! `[T, H_kv, d]` (any GQA group, MQA included), its queries `[T, H, d]`, its LSE `[H, T]` f32 (the varlen layout of
//! the crate's forwards for one sequence); `d` a multiple of 8 up to 256.
//!
//! # Outputs
//!
//! `student` and `teacher` `[T, k]` f32 (the scores `I_ts` and `τ'_ts` in the list's slot order, 0 past its end),
//! `kl [T]` and `student_lse [T]` (`log Σ_{s∈J_t} e^{I_ts}`, `+∞` on a row without teacher mass, so that its `σ` and
//! its gradient vanish), and with [`LossGradients`] `d_q_index [T, H_I, d_I]`, `d_weights [T, H_I]` and
//! `d_k_index [T, d_I]`, all f32. `d_k_index` gathers the contributions of every token that lists a key by f32
//! atomics, so its low bits may differ between runs; everything else is bitwise reproducible.
//!
//! # Rounding
//!
//! Every output is held to `attnproof_proofs::dsa_loss_bound` against the exact loss of the same inputs: the scores
//! to the indexer's bound, the teacher through the tensor-core logits and `expf`, the statistics and the gradients
//! through f32 sums whose lengths the kernel's header states (the module's docs derive each term).
//!
//! # Errors
//!
//! Before any launch: the indexer's shape ([`IndexerShape::validate`]), the main attention's head counts and head dim,
//! a non-finite scale, the buffers' lengths; from host tensors also every shape, non-finite inputs (an LSE of `−∞` is
//! accepted for a token whose list is empty, as the token-sparse forward writes it) and every list against the
//! convention ([`GpuError::BlockList`] names the entry as (0, 0, token, slot), the bound being the
//! token's visible keys `t + 1`).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ndarray::{Array1, Array2, Array3, ArrayView2, ArrayView3};

use crate::block_sparse::check_block_list;
use crate::common::{GpuElement, check_len, grid_dim, to_i32};
use crate::compile::{self, KernelSource};
use crate::dsa::index::{IndexerShape, contiguous};
use crate::error::GpuError;
use crate::launch;
use crate::params::DsaLossParams;

/// `gpu/kernels/dsa_loss.cu` after the shared helpers.
pub const DSA_LOSS: KernelSource = KernelSource {
    name: "dsa_loss",
    source: concat!(include_str!("../../kernels/common.cuh"), include_str!("../../kernels/dsa_loss.cu")),
};

/// The largest head dim of the main attention the teacher's tiles take.
pub const MAX_HEAD_DIM: usize = 256;
/// Threads per CTA (`LOSS_THREADS`); one CTA per token.
const THREADS: u32 = 256;
/// Head rows of one pass (`LOSS_ROWS`) and gathered tokens per tile (`LOSS_KEYS`).
const TILE: usize = 64;

/// The loss's problem: the indexer's shape (its `top_k` is the lists' width) and the main attention whose
/// probabilities form the teacher.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossShape {
    /// `T`, `H_I`, `d_I` and the lists' width `k`.
    pub indexer: IndexerShape,
    /// The main attention's query heads `H`.
    pub n_heads: usize,
    /// Its KV heads (`H` a multiple of them).
    pub n_heads_kv: usize,
    /// Its query and key head dim `d`.
    pub head_dim: usize,
    /// Its softmax scale `α` (what its forward multiplied `q · k` by).
    pub scale: f32,
}

impl LossShape {
    /// Checks the shape against what the kernels implement.
    pub fn validate(&self) -> Result<(), GpuError> {
        self.indexer.validate()?;
        let unsupported = |argument, reason: String| Err(GpuError::Unsupported { argument, reason });
        if self.n_heads_kv == 0 || self.n_heads == 0 || !self.n_heads.is_multiple_of(self.n_heads_kv) {
            return unsupported(
                "n_heads",
                format!(
                    "{} query heads over {} KV heads: a positive multiple is needed",
                    self.n_heads, self.n_heads_kv
                ),
            );
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(8) || self.head_dim > MAX_HEAD_DIM {
            return unsupported(
                "head_dim",
                format!("{} is not a multiple of 8 from 8 to {MAX_HEAD_DIM}", self.head_dim),
            );
        }
        if !self.scale.is_finite() {
            return unsupported("scale", format!("{} is not finite", self.scale));
        }
        to_i32("n_heads", self.n_heads)?;
        to_i32("seq_len", self.indexer.seq_len)?;
        Ok(())
    }

    /// Elements of the main attention's queries `[T, H, d]`.
    pub fn query_len(&self) -> usize {
        self.indexer.seq_len * self.n_heads * self.head_dim
    }

    /// Elements of its keys `[T, H_kv, d]`.
    pub fn key_len(&self) -> usize {
        self.indexer.seq_len * self.n_heads_kv * self.head_dim
    }

    /// Elements of its LSE `[H, T]`.
    pub fn lse_len(&self) -> usize {
        self.n_heads * self.indexer.seq_len
    }

    /// Elements of one `[T, k]` row matrix (`student`, `teacher`).
    pub fn rows_len(&self) -> usize {
        self.indexer.lists_len()
    }

    /// `d` rounded up to the tensor core's k-step of 16 (`HEAD_DIM_PAD`).
    fn head_dim_pad(&self) -> usize {
        self.head_dim.div_ceil(16) * 16
    }
}

/// The kernels' module defines for storage type `T`.
pub fn loss_defines<T: GpuElement>(shape: &LossShape) -> Vec<String> {
    vec![
        T::DEFINE.to_owned(),
        format!("INDEX_DIM={}", shape.indexer.index_dim),
        format!("HEAD_DIM_PAD={}", shape.head_dim_pad()),
    ]
}

/// Row stride of the shared key tile in elements (`LOSS_TILE_STRIDE`).
fn tile_stride(shape: &LossShape) -> usize {
    (shape.head_dim_pad() + 8).max(shape.indexer.index_dim + 8)
}

/// Dynamic shared memory of `dsa_loss_rows`: the indexer query rows, the main query rows and the key tile, then
/// weights, LSE, the key sums' partials and the CTA reduction's words.
pub fn rows_shared_bytes(shape: &LossShape) -> usize {
    let elems = TILE * (shape.indexer.index_dim + 8) + TILE * (shape.head_dim_pad() + 8) + TILE * tile_stride(shape);
    2 * elems + 4 * (TILE + TILE + 4 * TILE + 8)
}

/// Dynamic shared memory of `dsa_loss_grad`: the indexer query rows and the key tile, then weights, the tile's logits
/// (`[64][65]` f32) and its `∂KL/∂I`.
pub fn grad_shared_bytes(shape: &LossShape) -> usize {
    2 * (TILE * (shape.indexer.index_dim + 8) + TILE * tile_stride(shape)) + 4 * (TILE + TILE * (TILE + 1) + TILE)
}

/// The device inputs: the indexer's (as [`IndexerShape`] lays them out, with the lists `[T, k]`) and the main
/// attention's (as [`LossShape`] says).
#[derive(Clone, Copy, Debug)]
pub struct LossInputsDevice<'a, T> {
    /// `q^I [T, H_I, d_I]`.
    pub q_index: &'a CudaSlice<T>,
    /// `k^I [T, d_I]`.
    pub k_index: &'a CudaSlice<T>,
    /// `w [T, H_I]`.
    pub weights: &'a CudaSlice<f32>,
    /// `[T, k]` lists.
    pub lists: &'a CudaSlice<i32>,
    /// The main attention's `q [T, H, d]`.
    pub query: &'a CudaSlice<T>,
    /// Its `k [T, H_kv, d]`.
    pub key: &'a CudaSlice<T>,
    /// Its `lse [H, T]`.
    pub lse: &'a CudaSlice<f32>,
}

/// Where the per-token rows go (each at least its length).
#[derive(Debug)]
pub struct LossRows<'a> {
    /// `[T, k]` scores `I_ts` in slot order.
    pub student: &'a mut CudaSlice<f32>,
    /// `[T, k]` renormalized teacher `τ'_ts` in slot order.
    pub teacher: &'a mut CudaSlice<f32>,
    /// `[T]` per-token KL.
    pub kl: &'a mut CudaSlice<f32>,
    /// `[T]` student LSE over the list (`+∞` without teacher mass).
    pub student_lse: &'a mut CudaSlice<f32>,
}

/// Where the gradients go (each at least its length; `d_k_index` is zeroed first).
#[derive(Debug)]
pub struct LossGradients<'a> {
    /// `[T, H_I, d_I]`.
    pub d_q_index: &'a mut CudaSlice<f32>,
    /// `[T, H_I]`.
    pub d_weights: &'a mut CudaSlice<f32>,
    /// `[T, d_I]`.
    pub d_k_index: &'a mut CudaSlice<f32>,
}

/// The indexer loss's rows and, with `gradients`, its gradients on device buffers. Every check runs before the
/// launches, which are asynchronous on `stream`. `kernel` is [`DSA_LOSS`] or a variant of its text. Device lists are
/// not validated (that would cost a copy): the kernels end a list at its first entry that does not rise or lies after
/// its token.
pub fn indexer_loss_device<T: GpuElement>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    shape: &LossShape,
    inputs: LossInputsDevice<'_, T>,
    rows: LossRows<'_>,
    mut gradients: Option<LossGradients<'_>>,
) -> Result<(), GpuError> {
    shape.validate()?;
    let ix = &shape.indexer;
    check_len("q_index", inputs.q_index, ix.q_len())?;
    check_len("k_index", inputs.k_index, ix.k_len())?;
    check_len("weights", inputs.weights, ix.weights_len())?;
    check_len("lists", inputs.lists, ix.lists_len())?;
    check_len("query", inputs.query, shape.query_len())?;
    check_len("key", inputs.key, shape.key_len())?;
    check_len("lse", inputs.lse, shape.lse_len())?;
    check_len("student", rows.student, shape.rows_len())?;
    check_len("teacher", rows.teacher, shape.rows_len())?;
    check_len("kl", rows.kl, ix.seq_len)?;
    check_len("student_lse", rows.student_lse, ix.seq_len)?;
    if let Some(g) = &gradients {
        check_len("d_q_index", g.d_q_index, ix.q_len())?;
        check_len("d_weights", g.d_weights, ix.weights_len())?;
        check_len("d_k_index", g.d_k_index, ix.k_len())?;
    }
    let grid = grid_dim("seq_len", ix.seq_len, i32::MAX as usize)?;
    let params = DsaLossParams {
        seq_len: to_i32("seq_len", ix.seq_len)?,
        top_k: to_i32("top_k", ix.top_k)?,
        index_heads: to_i32("n_index_heads", ix.n_index_heads)?,
        n_heads: to_i32("n_heads", shape.n_heads)?,
        n_heads_kv: to_i32("n_heads_kv", shape.n_heads_kv)?,
        head_dim: to_i32("head_dim", shape.head_dim)?,
        scale: shape.scale,
        reserved: 0,
    };
    if let Some(g) = gradients.as_mut() {
        // The sums of ∂/∂k^I start from 0, also for keys no list names (their gradient is 0).
        stream
            .memset_zeros(&mut g.d_k_index.slice_mut(..ix.k_len()))
            .map_err(|e| GpuError::driver("cuMemsetD8(d_k_index)", e))?;
    }
    if ix.seq_len == 0 {
        return Ok(());
    }
    let ctx = stream.context();
    let module = compile::module(ctx, kernel, &loss_defines::<T>(shape))?;
    let load = |name: &'static str| {
        module.load_function(name).map_err(|e| GpuError::driver("cuModuleGetFunction(dsa_loss.cu)", e))
    };
    let rows_func = load("dsa_loss_rows")?;
    let rows_shared = rows_shared_bytes(shape);
    compile::allow_shared_memory(ctx, &rows_func, rows_shared, "head_dim")?;
    let cfg = |shared: usize| LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let indexer = (inputs.q_index, inputs.k_index, inputs.weights, inputs.lists);
    launch::launch_dsa_loss_rows(
        stream,
        &rows_func,
        cfg(rows_shared),
        indexer,
        (inputs.query, inputs.key, inputs.lse),
        (&mut *rows.student, &mut *rows.teacher, &mut *rows.kl, &mut *rows.student_lse),
        &params,
    )?;
    let Some(g) = gradients else {
        return Ok(());
    };
    let grad_func = load("dsa_loss_grad")?;
    let grad_shared = grad_shared_bytes(shape);
    compile::allow_shared_memory(ctx, &grad_func, grad_shared, "index_dim")?;
    launch::launch_dsa_loss_grad(
        stream,
        &grad_func,
        cfg(grad_shared),
        indexer,
        (rows.student, rows.teacher, rows.student_lse),
        (g.d_q_index, g.d_weights, g.d_k_index),
        &params,
    )
}

/// The indexer loss's inputs as host tensors, row-major and finite.
#[derive(Clone, Copy, Debug)]
pub struct LossInputs<'a, T> {
    /// `q^I [T, H_I, d_I]`.
    pub q_index: ArrayView3<'a, T>,
    /// `k^I [T, d_I]`.
    pub k_index: ArrayView2<'a, T>,
    /// `w [T, H_I]`.
    pub weights: ArrayView2<'a, f32>,
    /// `[T, k]` lists (the convention above).
    pub lists: ArrayView2<'a, i32>,
    /// The main attention's `q [T, H, d]`.
    pub query: ArrayView3<'a, T>,
    /// Its `k [T, H_kv, d]`.
    pub key: ArrayView3<'a, T>,
    /// Its `lse [H, T]`.
    pub lse: ArrayView2<'a, f32>,
    /// Its softmax scale `α`.
    pub scale: f32,
}

impl<T> LossInputs<'_, T> {
    /// The problem these tensors describe, after checking that their shapes agree.
    pub fn shape(&self) -> Result<LossShape, GpuError> {
        let (seq_len, n_index_heads, index_dim) = self.q_index.dim();
        let (_, n_heads, head_dim) = self.query.dim();
        let (_, n_heads_kv, _) = self.key.dim();
        let expect = |argument, actual: &[usize], expected: Vec<usize>| {
            if actual == expected.as_slice() {
                Ok(())
            } else {
                Err(GpuError::Shape { argument, expected, actual: actual.to_vec() })
            }
        };
        let top_k = self.lists.ncols();
        expect("k_index", self.k_index.shape(), vec![seq_len, index_dim])?;
        expect("weights", self.weights.shape(), vec![seq_len, n_index_heads])?;
        expect("lists", self.lists.shape(), vec![seq_len, top_k])?;
        expect("query", self.query.shape(), vec![seq_len, n_heads, head_dim])?;
        expect("key", self.key.shape(), vec![seq_len, n_heads_kv, head_dim])?;
        expect("lse", self.lse.shape(), vec![n_heads, seq_len])?;
        let shape = LossShape {
            indexer: IndexerShape { seq_len, n_index_heads, index_dim, top_k },
            n_heads,
            n_heads_kv,
            head_dim,
            scale: self.scale,
        };
        shape.validate()?;
        Ok(shape)
    }
}

/// What [`indexer_loss`] returns (the outputs of the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct LossOutput {
    /// `[T, k]` student scores in slot order, 0 past the list's end.
    pub student: Array2<f32>,
    /// `[T, k]` renormalized teacher in slot order, 0 past the list's end.
    pub teacher: Array2<f32>,
    /// `[T]` per-token KL.
    pub kl: Array1<f32>,
    /// `[T]` student LSE (`+∞` without teacher mass).
    pub student_lse: Array1<f32>,
    /// `[T, H_I, d_I]`.
    pub d_q_index: Array3<f32>,
    /// `[T, H_I]`.
    pub d_weights: Array2<f32>,
    /// `[T, d_I]`.
    pub d_k_index: Array2<f32>,
}

/// The indexer loss and its gradients from host tensors: validates the shapes, the values and the lists, copies in,
/// launches, copies out, synchronizes. `kernel` is [`DSA_LOSS`] or a variant of its text.
pub fn indexer_loss<T: GpuElement>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    inputs: LossInputs<'_, T>,
) -> Result<LossOutput, GpuError> {
    let shape = inputs.shape()?;
    let ix = shape.indexer;
    for (t, list) in inputs.lists.outer_iter().enumerate() {
        check_block_list(list.iter().copied(), t + 1)
            .map_err(|(slot, fault)| GpuError::BlockList { position: [0, 0, t, slot], fault })?;
    }
    let (hqi, hki) = (contiguous("q_index", &inputs.q_index)?, contiguous("k_index", &inputs.k_index)?);
    let (hq, hk) = (contiguous("query", &inputs.query)?, contiguous("key", &inputs.key)?);
    let (hw, hlse) = (contiguous("weights", &inputs.weights)?, contiguous("lse", &inputs.lse)?);
    let lists = contiguous("lists", &inputs.lists)?;
    let non_finite = |argument: &'static str, at: Option<usize>| match at {
        Some(i) => {
            Err(GpuError::from(attnproof_oracle::OracleError::NonFinite { argument, index: vec![i], value: f64::NAN }))
        }
        None => Ok(()),
    };
    non_finite("q_index", hqi.iter().position(|x| !x.is_finite_value()))?;
    non_finite("k_index", hki.iter().position(|x| !x.is_finite_value()))?;
    non_finite("query", hq.iter().position(|x| !x.is_finite_value()))?;
    non_finite("key", hk.iter().position(|x| !x.is_finite_value()))?;
    non_finite("weights", hw.iter().position(|x| !x.is_finite()))?;
    // The token-sparse forward writes −∞ for a token whose list is empty; such a token's LSE is never read. Anywhere
    // else the LSE must be finite.
    let empty = |t: usize| inputs.lists[[t, 0]] < 0;
    let seq_len = ix.seq_len;
    non_finite(
        "lse",
        hlse.iter().enumerate().position(|(i, &x)| !(x.is_finite() || (x == f32::NEG_INFINITY && empty(i % seq_len)))),
    )?;
    let driver = |what: &'static str| move |e| GpuError::driver(what, e);
    // A zero-length buffer cannot be allocated: empty tensors travel as one element the kernels never read.
    let up = |data: &[T]| {
        if data.is_empty() { stream.alloc_zeros::<T>(1) } else { stream.clone_htod(data) }
            .map_err(driver("cuMemcpyHtoD"))
    };
    let up_f32 = |data: &[f32]| {
        if data.is_empty() { stream.alloc_zeros::<f32>(1) } else { stream.clone_htod(data) }
            .map_err(driver("cuMemcpyHtoD"))
    };
    let d_lists = if lists.is_empty() { stream.alloc_zeros::<i32>(1) } else { stream.clone_htod(lists) }
        .map_err(driver("cuMemcpyHtoD"))?;
    let (dqi, dki, dq, dk) = (up(hqi)?, up(hki)?, up(hq)?, up(hk)?);
    let (dw, dlse) = (up_f32(hw)?, up_f32(hlse)?);
    let zeros = |n: usize| stream.alloc_zeros::<f32>(n.max(1)).map_err(driver("cuMemAlloc"));
    let (mut student, mut teacher) = (zeros(shape.rows_len())?, zeros(shape.rows_len())?);
    let (mut kl, mut student_lse) = (zeros(ix.seq_len)?, zeros(ix.seq_len)?);
    let (mut d_qi, mut d_w, mut d_ki) = (zeros(ix.q_len())?, zeros(ix.weights_len())?, zeros(ix.k_len())?);
    indexer_loss_device(
        stream,
        kernel,
        &shape,
        LossInputsDevice {
            q_index: &dqi,
            k_index: &dki,
            weights: &dw,
            lists: &d_lists,
            query: &dq,
            key: &dk,
            lse: &dlse,
        },
        LossRows { student: &mut student, teacher: &mut teacher, kl: &mut kl, student_lse: &mut student_lse },
        Some(LossGradients { d_q_index: &mut d_qi, d_weights: &mut d_w, d_k_index: &mut d_ki }),
    )?;
    let down = |buffer: &CudaSlice<f32>, len: usize| -> Result<Vec<f32>, GpuError> {
        let mut host = stream.clone_dtoh(buffer).map_err(driver("cuMemcpyDtoH"))?;
        host.truncate(len);
        Ok(host)
    };
    let (t, k, h, d) = (ix.seq_len, ix.top_k, ix.n_index_heads, ix.index_dim);
    let output = LossOutput {
        student: Array2::from_shape_vec((t, k), down(&student, t * k)?).expect("length matches"),
        teacher: Array2::from_shape_vec((t, k), down(&teacher, t * k)?).expect("length matches"),
        kl: Array1::from_vec(down(&kl, t)?),
        student_lse: Array1::from_vec(down(&student_lse, t)?),
        d_q_index: Array3::from_shape_vec((t, h, d), down(&d_qi, t * h * d)?).expect("length matches"),
        d_weights: Array2::from_shape_vec((t, h), down(&d_w, t * h)?).expect("length matches"),
        d_k_index: Array2::from_shape_vec((t, d), down(&d_ki, t * d)?).expect("length matches"),
    };
    stream.synchronize().map_err(driver("cuStreamSynchronize"))?;
    Ok(output)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n_heads: usize, n_heads_kv: usize, head_dim: usize, index_dim: usize) -> LossShape {
        LossShape {
            indexer: IndexerShape { seq_len: 100, n_index_heads: 64, index_dim, top_k: 32 },
            n_heads,
            n_heads_kv,
            head_dim,
            scale: 0.125,
        }
    }

    #[test]
    fn shapes_outside_the_kernels_are_typed_errors() {
        assert!(shape(64, 1, 128, 128).validate().is_ok());
        assert!(shape(12, 4, 8, 64).validate().is_ok());
        let unsupported = |s: LossShape, arg: &str| {
            assert!(
                matches!(s.validate(), Err(GpuError::Unsupported { argument, .. }) if argument == arg),
                "{s:?}: {:?}",
                s.validate()
            );
        };
        unsupported(shape(12, 5, 128, 128), "n_heads");
        unsupported(shape(0, 1, 128, 128), "n_heads");
        unsupported(shape(4, 0, 128, 128), "n_heads");
        unsupported(shape(4, 1, 260, 128), "head_dim");
        unsupported(shape(4, 1, 100, 128), "head_dim");
        unsupported(shape(4, 1, 0, 128), "head_dim");
        unsupported(shape(4, 1, 64, 96), "index_dim");
        unsupported(LossShape { scale: f32::NAN, ..shape(4, 1, 64, 64) }, "scale");
        unsupported(LossShape { scale: f32::INFINITY, ..shape(4, 1, 64, 64) }, "scale");
    }

    #[test]
    fn sizes_and_defines_follow_the_layout() {
        let s = shape(12, 4, 72, 64);
        assert_eq!((s.query_len(), s.key_len(), s.lse_len(), s.rows_len()), (100 * 12 * 72, 100 * 4 * 72, 1200, 3200));
        assert_eq!(loss_defines::<half::bf16>(&s), ["ELEM_BF16", "INDEX_DIM=64", "HEAD_DIM_PAD=80"]);
        // The kernels' carve of shared memory, spelled out: 16-bit rows of d_I + 8, d_pad + 8 and the larger of the
        // two, then 4-byte words.
        assert_eq!(rows_shared_bytes(&s), 2 * 64 * (72 + 88 + 88) + 4 * (64 + 64 + 256 + 8));
        assert_eq!(grad_shared_bytes(&s), 2 * 64 * (72 + 88) + 4 * (64 + 64 * 65 + 64));
        let widest = shape(64, 1, 256, 128);
        assert!(rows_shared_bytes(&widest) <= 227 * 1024, "fits the H200's opt-in limit");
        assert!(grad_shared_bytes(&widest) <= 227 * 1024);
    }
}
