//! Every `unsafe` operation of the crate, each with its `// SAFETY:` argument: probing the CUDA libraries, driving
//! NVRTC to a CUBIN, encoding tensor maps, and launching kernels. The safe modules validate shapes, strides, dtypes and buffer sizes before
//! they call in here, so the arguments below can state their preconditions as facts.

use std::ffi::{CStr, CString, c_char};

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys};

use crate::error::GpuError;
use crate::params::{
    BackwardParams, BlockListParams, BsaParams, DsaIndexParams, DsaLossParams, DsaSparseParams, FlashParams,
    HilsParams, NsaParams, NsaSelectParams, PisaParams, PisaTailParams, RingStateParams,
};

/// Whether the CUDA driver library can be loaded.
pub(crate) fn driver_library_present() -> bool {
    // SAFETY: `is_culib_present` only tries to `dlopen` the driver library under its usual names and closes it again.
    // It is `unsafe` because loading a shared library runs that library's initialisers; the library in question is the
    // system's CUDA driver, which cudarc would load anyway on the first driver call, so probing it adds no new risk.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether the NVRTC library can be loaded (cudarc panics on the first NVRTC call otherwise).
pub(crate) fn nvrtc_library_present() -> bool {
    // SAFETY: as for the driver above: a `dlopen` probe of CUDA's own runtime-compiler library.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// Whether the NCCL library can be loaded (cudarc panics on the first NCCL call otherwise).
pub(crate) fn nccl_library_present() -> bool {
    // SAFETY: as for the driver above: a `dlopen` probe of NVIDIA's collective-communication library, which cudarc
    // would load anyway on the first NCCL call.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// Why NVRTC failed: its status and program log.
pub(crate) struct NvrtcFailure {
    pub status: String,
    pub log: String,
}

/// An NVRTC program that is destroyed on every path out of [`compile_cubin`].
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from `nvrtcCreateProgram` and is destroyed exactly once, here. A failure to destroy
        // leaks host memory only, so the result is ignored rather than turned into a panic in `drop`.
        let _ = unsafe { nvrtc_result::destroy_program(self.0) };
    }
}

/// Compiles `src` with `options` to a CUBIN (a real `sm_XX` target), returning NVRTC's log on failure.
///
/// cudarc's safe wrapper only returns PTX, which NVRTC does not produce for a real architecture such as `sm_90a`;
/// a CUBIN also avoids the driver's PTX JIT and its PTX-version gate.
pub(crate) fn compile_cubin(src: &str, name: &str, options: &[String]) -> Result<Vec<u8>, NvrtcFailure> {
    let fail = |status: String, log: String| NvrtcFailure { status, log };
    let c_src = CString::new(src).map_err(|_| fail("source contains a NUL byte".into(), String::new()))?;
    let c_name = CString::new(name).map_err(|_| fail("name contains a NUL byte".into(), String::new()))?;
    let prog =
        Program(nvrtc_result::create_program(&c_src, Some(&c_name)).map_err(|e| fail(e.to_string(), String::new()))?);
    // SAFETY: `prog.0` is a live program created above from `c_src` and `c_name`, which outlive it (both are dropped
    // after `prog`, in reverse declaration order). The options are plain ASCII strings without NUL bytes (built by
    // `compile::options`), so cudarc's `CString::new(..).unwrap()` inside `compile_program` cannot panic.
    let compiled = unsafe { nvrtc_result::compile_program(prog.0, options) };
    if let Err(e) = compiled {
        // SAFETY: `prog.0` is live; the log is a NUL-terminated buffer of the size NVRTC reported.
        let log = unsafe { nvrtc_result::get_program_log(prog.0) }
            .map(|raw| c_chars_to_string(&raw))
            .unwrap_or_else(|e| format!("(no log: {e})"));
        return Err(fail(e.to_string(), log));
    }
    let mut size = 0usize;
    // SAFETY: `prog.0` is live and compiled; `size` is a valid out-pointer.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| fail(e.to_string(), String::new()))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has exactly the `size` bytes NVRTC asked for, and NVRTC writes no more than that.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(|e| fail(e.to_string(), String::new()))?;
    Ok(cubin)
}

fn c_chars_to_string(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
    CStr::from_bytes_until_nul(&bytes)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
}

// SAFETY: `FlashParams` is `#[repr(C)]` plain old data (`i64`, `i32` and `f32` fields, no padding: an explicit
// `reserved` field fills the tail), valid for every bit pattern and holding no pointer, so the driver may copy its bytes
// as the kernel's `const FlashParams` argument. Its layout is the C struct's of `gpu/kernels/common.cuh`: NVRTC checks
// the C side's size and offsets (`PARAM_SIZE`, `PARAM_AT`), and `params::tests` checks the same numbers against
// `size_of` and `offset_of!` of this struct.
unsafe impl DeviceRepr for FlashParams {}
// SAFETY: as for `FlashParams`: `#[repr(C)]` plain old data (a `FlashParams` and `i64`/`i32` fields, no padding), its
// layout pinned on both sides by the same `PARAM_SIZE`/`PARAM_AT` lines and `params::tests`.
unsafe impl DeviceRepr for BackwardParams {}
// SAFETY: as for `FlashParams`: `#[repr(C)]` plain old data (`i64`/`i32` fields and an explicit `reserved` tail), its
// layout pinned on both sides by the same `PARAM_SIZE`/`PARAM_AT` lines and `params::tests`.
unsafe impl DeviceRepr for RingStateParams {}
// SAFETY: as for `FlashParams`: `#[repr(C)]` plain old data (two `i64` and four `i32` fields, no padding), its layout
// pinned on both sides by the same `PARAM_SIZE`/`PARAM_AT` lines and `params::tests`.
unsafe impl DeviceRepr for BlockListParams {}
// SAFETY: as for `FlashParams`: `#[repr(C)]` plain old data (a `FlashParams`, an `f64`, eight `i32`, an `i64` and two
// `i32` fields, the last an explicit `reserved` tail, no padding), its layout pinned on both sides by the same
// `PARAM_SIZE`/`PARAM_AT` lines and `params::tests`.
unsafe impl DeviceRepr for BsaParams {}
// SAFETY: as for `FlashParams`: `#[repr(C)]` plain old data (a `FlashParams`, an `i64` and six `i32` fields, no
// padding), its layout pinned on both sides by the same `PARAM_SIZE`/`PARAM_AT` lines and `params::tests`.
unsafe impl DeviceRepr for NsaParams {}
// SAFETY: as for `FlashParams`: `#[repr(C)]` plain old data (a `FlashParams`, an `i64` and ten `i32` fields, no
// padding), its layout pinned on both sides by the same `PARAM_SIZE`/`PARAM_AT` lines
// and `params::tests`.
unsafe impl DeviceRepr for NsaSelectParams {}
// SAFETY: as for `FlashParams`: `#[repr(C)]` plain old data (an `i64` and six `i32` fields, the last an explicit
// `reserved` tail, no padding), its layout pinned on both sides by the same `PARAM_SIZE`/`PARAM_AT` lines and
// `params::tests`.
unsafe impl DeviceRepr for DsaIndexParams {}
// SAFETY: as for `FlashParams`: `#[repr(C)]` plain old data (a `FlashParams`, an `i64` and four `i32` fields, the last
// an explicit `reserved` tail, no padding), its layout pinned on both sides by the same `PARAM_SIZE`/`PARAM_AT` lines
// and `params::tests`.
unsafe impl DeviceRepr for DsaSparseParams {}
// SAFETY: as for `FlashParams`: `#[repr(C)]` plain old data (six `i32`, an `f32` and an explicit `reserved` `i32`
// tail, no padding), its layout pinned on both sides by the same `PARAM_SIZE`/`PARAM_AT` lines and `params::tests`.
unsafe impl DeviceRepr for DsaLossParams {}
// SAFETY: as for `FlashParams`: `#[repr(C)]` plain old data (a `BsaParams`, an `i64` and six `i32` fields, no
// padding), its layout pinned on both sides by the same `PARAM_SIZE`/`PARAM_AT` lines and `params::tests`.
unsafe impl DeviceRepr for PisaParams {}
// SAFETY: as for `FlashParams`: `#[repr(C)]` plain old data (a `FlashParams`, an `f64`, four `i64` and eight `i32`
// fields, no padding), its layout pinned on both sides by the same `PARAM_SIZE`/`PARAM_AT` lines and `params::tests`.
unsafe impl DeviceRepr for PisaTailParams {}
// SAFETY: as for `FlashParams`: `#[repr(C)]` plain old data (a `FlashParams`, an `f64` and six `i32` fields, no
// padding), its layout pinned on both sides by the same `PARAM_SIZE`/`PARAM_AT` lines and `params::tests`.
unsafe impl DeviceRepr for HilsParams {}

/// What `flash_fwd` writes: `O` and LSE, or (compiled with `STATE_OUT`) each row's online-softmax state, `a`
/// `[rows][dv]` and `m`, `l` per LSE row.
pub(crate) enum ForwardOut<'a, T> {
    Final { o: &'a mut CudaSlice<T>, lse: &'a mut CudaSlice<f32> },
    State { a: &'a mut CudaSlice<f32>, m: &'a mut CudaSlice<f32>, l: &'a mut CudaSlice<f32> },
}

/// Device operands of `flash_fwd`.
pub(crate) struct FlashBuffers<'a, T> {
    pub q: &'a CudaSlice<T>,
    pub k: &'a CudaSlice<T>,
    pub v: &'a CudaSlice<T>,
    pub out: ForwardOut<'a, T>,
    pub cu_q: &'a CudaSlice<i32>,
    pub cu_k: &'a CudaSlice<i32>,
    /// The block lists and their scalars, for a module compiled with `BLOCK_SPARSE` (and only then).
    pub lists: Option<(&'a CudaSlice<i32>, &'a BlockListParams)>,
    /// The K and V tensor maps (16 words each, two per (sequence, KV head)), for a module of the sm_90a forward
    /// compiled with `TMA_LOADS` (and only then).
    pub kv_maps: Option<&'a CudaSlice<u64>>,
}

/// A 2-D tile (box) of a row-major matrix of 2-byte elements, as the tensor copy engine reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TensorTile {
    /// Device address of the matrix's first element.
    pub base: u64,
    /// Columns and rows of the matrix: the copy engine fills reads past them with zeros.
    pub cols: u64,
    pub rows: u64,
    /// Bytes between two rows.
    pub row_stride_bytes: u64,
    /// Columns and rows of one box.
    pub box_cols: u32,
    pub box_rows: u32,
}

/// The tensor map (`CUtensorMap`, 128 bytes) of `tile` in the tensor cores' 128-byte swizzle, out-of-bounds reads
/// filled with zeros.
pub(crate) fn encode_tensor_map(tile: TensorTile) -> Result<[u64; 16], GpuError> {
    use cudarc::driver::sys;
    // The driver's own requirements, checked first so that a violation is a typed error naming the value.
    let misaligned = |what: &'static str, value: u64| {
        Err(GpuError::Unsupported { argument: what, reason: format!("{value} is not a multiple of 16 bytes") })
    };
    if !tile.base.is_multiple_of(16) {
        return misaligned("tensor map base address", tile.base);
    }
    if !tile.row_stride_bytes.is_multiple_of(16) {
        return misaligned("tensor map row stride", tile.row_stride_bytes);
    }
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let dims = [tile.cols, tile.rows.max(1)];
    let strides = [tile.row_stride_bytes];
    let boxes = [tile.box_cols, tile.box_rows];
    let element_strides = [1u32, 1];
    // SAFETY: `cuTensorMapEncodeTiled` is a host function that writes the 128-byte map it is given (ours, 64-byte
    // aligned by `CUtensorMap`'s declaration) and reads `tensorRank` = 2 entries of each dimension array and 1 of the
    // strides, all of which live on this stack frame for the call. It does not dereference `globalAddress` (the map
    // only records it): the kernel reads through it later, inside the bounds the caller encoded.
    let result = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            2,
            tile.base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    result.result().map_err(|e| GpuError::driver("cuTensorMapEncodeTiled", e))?;
    Ok(map.opaque)
}

/// Launches `flash_fwd` on `stream`.
///
/// Preconditions, established by `flash::flash_forward_device` (or `flash::flash_forward_state_device`) before this
/// call: `func` is `flash_fwd` compiled for the element type `T` and the padded head dims `params` implies, with
/// `STATE_OUT` defined exactly when `out` is [`ForwardOut::State`]; every index the kernel forms from the grid, the
/// lengths (or `cu_q`/`cu_k`, validated non-decreasing and ending at the packed totals) and the strides lies inside
/// the buffer it indexes (the buffer sizes were checked against the spec's shapes; a state holds `rows · dv` values
/// of `a` and `rows` of `m`, `l`, `rows` the spec's LSE element count); `cfg` has the `NUM_WARPS · 32` threads per
/// block the module was compiled for and the dynamic shared memory the kernel's layout needs, which the function
/// attribute allows. With `lists`, the module was compiled with `BLOCK_SPARSE`, the lists buffer holds the
/// `[B, list heads, query blocks, width]` entries the `BlockListParams` strides describe, and every entry was validated
/// on the host (ascending, in range, `−1`-padded), so every tile the kernel forms from one lies inside K and V.
pub(crate) fn launch_flash_forward<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    buffers: FlashBuffers<'_, T>,
    params: &FlashParams,
) -> Result<(), GpuError> {
    let FlashBuffers { q, k, v, out, cu_q, cu_k, lists, kv_maps } = buffers;
    let mut builder = stream.launch_builder(func);
    builder.arg(q).arg(k).arg(v);
    let call = match out {
        ForwardOut::Final { o, lse } => {
            builder.arg(o).arg(lse);
            "cuLaunchKernel(flash_fwd)"
        }
        ForwardOut::State { a, m, l } => {
            builder.arg(a).arg(m).arg(l);
            "cuLaunchKernel(flash_fwd, STATE_OUT)"
        }
    };
    builder.arg(cu_q).arg(cu_k).arg(params);
    if let Some((entries, list_params)) = lists {
        builder.arg(entries).arg(list_params);
    }
    if let Some(maps) = kv_maps {
        builder.arg(maps);
    }
    // SAFETY: the argument list above matches `flash_fwd`'s parameters one for one in order and type: three input
    // pointers of `elem_t` = T, then `o` (T) and `lse` (f32), or under STATE_OUT `a`, `m`, `l` (f32), then the two
    // i32 `cu_seqlens` pointers, all as CUdeviceptr; then `const FlashParams params` by value, whose layout the two
    // sides share (see the `DeviceRepr` impl above); under BLOCK_SPARSE the i32 lists pointer and
    // `const BlockListParams lists` by value; under TMA_LOADS the tensor maps' u64 pointer, which holds two maps per
    // (sequence, KV head) encoded over the extents of this launch's K and V. The kernel writes only the outputs of `out`, within the bounds the
    // caller checked (see the preconditions above), and reads the inputs read-only; the buffers are borrowed for this
    // call, and cudarc records their use on `stream`, so none is freed while the kernel runs.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver(call, e))?;
    Ok(())
}

/// Launches `state_merge` (gpu/kernels/ring_state.cu) on `stream`: `run ← run ⊕ part` over `params.rows` rows of
/// `params.dv` columns.
///
/// Preconditions, established by `ring::state::merge_states`: every buffer holds at least `rows` (`m`, `l`) or
/// `rows · dv` (`a`) elements, and `cfg` gives at least one warp per row.
pub(crate) fn launch_state_merge(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    run: (&mut CudaSlice<f32>, &mut CudaSlice<f32>, &mut CudaSlice<f32>),
    part: (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
    params: &RingStateParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(run.0).arg(run.1).arg(run.2).arg(part.0).arg(part.1).arg(part.2).arg(params);
    // SAFETY: `state_merge(float* a_run, float* m_run, float* l_run, const float* a_part, const float* m_part,
    // const float* l_part, const RingStateParams params)`: six f32 device pointers, then the struct by value (layout
    // shared, see the `DeviceRepr` impl above). It reads and writes `rows` rows of the buffers, which the caller
    // checked hold them; they are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(state_merge)", e))?;
    Ok(())
}

/// Launches `state_finalize` (gpu/kernels/ring_state.cu) on `stream`: `O`, LSE of `params.rows` state rows.
///
/// Preconditions, established by `ring::state::finalize_state`: `a` holds `rows · dv`, `m`, `l` and `lse` `rows`, and
/// `o` `rows · dv` elements (the spec's O, whose layout `varlen`, `n_heads` and `rows_per_head` describe); `cfg` gives
/// at least one warp per row.
pub(crate) fn launch_state_finalize<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    state: (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
    out: (&mut CudaSlice<T>, &mut CudaSlice<f32>),
    params: &RingStateParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(state.0).arg(state.1).arg(state.2).arg(out.0).arg(out.1).arg(params);
    // SAFETY: `state_finalize(const float* a, const float* m, const float* l, elem_t* o, float* lse,
    // const RingStateParams params)` with `elem_t` = T (the module's storage define): five device pointers, then the
    // struct by value (layout shared, see the `DeviceRepr` impl above). Every index it forms is below the sizes the
    // caller checked; the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(state_finalize)", e))?;
    Ok(())
}

/// Device operands of the backward kernels (`gpu/kernels/flash_bwd.cu`). `o` is read by the preprocess only; the
/// f32 workspaces `dq_acc` (atomic accumulator, zeroed by the caller), `dq_part` (per-KV-tile partials) and
/// `dkv_part` (GQA: every query head's dK and dV sums) are one-element placeholders when unused.
pub(crate) struct BackwardBuffers<'a, T> {
    pub q: &'a CudaSlice<T>,
    pub k: &'a CudaSlice<T>,
    pub v: &'a CudaSlice<T>,
    pub o: &'a CudaSlice<T>,
    pub lse: &'a CudaSlice<f32>,
    pub d_out: &'a CudaSlice<T>,
    pub dq: &'a mut CudaSlice<T>,
    pub dk: &'a mut CudaSlice<T>,
    pub dv: &'a mut CudaSlice<T>,
    pub delta: &'a mut CudaSlice<f32>,
    pub dq_acc: &'a mut CudaSlice<f32>,
    pub dq_part: &'a mut CudaSlice<f32>,
    pub dkv_part: &'a mut CudaSlice<f32>,
    pub cu_q: &'a CudaSlice<i32>,
    pub cu_k: &'a CudaSlice<i32>,
    /// The block-sparse module's lists, their CSR transpose and scalars (`None` for the dense module).
    pub sparse: Option<SparseBuffers<'a>>,
}

/// The trailing arguments (`SPARSE_PARAMS`) of `bwd_kv`, `bwd_dq` and `bwd_dq_finalize` compiled with `BLOCK_SPARSE`.
#[derive(Clone, Copy)]
pub(crate) struct SparseBuffers<'a> {
    /// The forward's lists, `[B, list heads, query blocks, width]`.
    pub lists: &'a CudaSlice<i32>,
    /// CSR row offsets, one row per (sequence, list head, key block), then the total.
    pub csr_offsets: &'a CudaSlice<i32>,
    /// The query blocks of every CSR row, ascending within a row.
    pub csr_q_blocks: &'a CudaSlice<i32>,
    /// The lists' scalars.
    pub params: &'a BlockListParams,
}

/// Which kernel of `flash_bwd.cu` to launch; its trailing scalars are the fields of [`BackwardParams`] it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BackwardKernel {
    /// `bwd_preprocess`: writes `delta`.
    Preprocess,
    /// `bwd_kv`: writes `dk`, `dv` (or, under GQA, `dkv_part`), and per `dq_mode` adds to `dq_acc` (1) or writes
    /// `dq_part` (2).
    KvOwner,
    /// `bwd_kv_group_sum`: writes `dk`, `dv` from `dkv_part`.
    GroupSum,
    /// `bwd_dq`: writes `dq`.
    DqOwner,
    /// `bwd_dq_finalize`: writes `dq` from `dq_acc` (mode 0) or `dq_part` (mode 1).
    Finalize,
}

impl BackwardKernel {
    /// The kernel's name in `flash_bwd.cu`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            BackwardKernel::Preprocess => "bwd_preprocess",
            BackwardKernel::KvOwner => "bwd_kv",
            BackwardKernel::GroupSum => "bwd_kv_group_sum",
            BackwardKernel::DqOwner => "bwd_dq",
            BackwardKernel::Finalize => "bwd_dq_finalize",
        }
    }

    /// The driver call's name in an error: `cuLaunchKernel(<kernel>)`.
    fn launch_call(self) -> &'static str {
        match self {
            BackwardKernel::Preprocess => "cuLaunchKernel(bwd_preprocess)",
            BackwardKernel::KvOwner => "cuLaunchKernel(bwd_kv)",
            BackwardKernel::GroupSum => "cuLaunchKernel(bwd_kv_group_sum)",
            BackwardKernel::DqOwner => "cuLaunchKernel(bwd_dq)",
            BackwardKernel::Finalize => "cuLaunchKernel(bwd_dq_finalize)",
        }
    }
}

/// Launches one kernel of `flash_bwd.cu` on `stream`.
///
/// Preconditions, established by `backward::flash_backward_device` before this call: `func` is the kernel `which`
/// names, compiled from `flash_bwd.cu` for the element type `T` and the padded head dims `params` implies; every
/// index the kernel forms from the grid, the lengths (or `cu_q`/`cu_k`, validated non-decreasing and ending at the
/// packed totals) and the strides lies inside the buffer it indexes (sizes checked against the spec's shapes; the
/// workspaces hold `Q`'s element count, times the KV tile count for `dq_part` when mode 2 or finalize mode 1 reads it,
/// and `dkv_part` holds `n_heads_q · total_k · (d + dv)` when the group size exceeds 1); `cfg` has the kernel's
/// threads per block (`32 · KV_WARPS` for `bwd_kv`, 128 for the others) and the dynamic shared memory its layout
/// needs, which the function attribute allows.
pub(crate) fn launch_flash_backward<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    which: BackwardKernel,
    buffers: &mut BackwardBuffers<'_, T>,
    params: &BackwardParams,
) -> Result<(), GpuError> {
    let b = buffers;
    let mut builder = stream.launch_builder(func);
    match which {
        BackwardKernel::Preprocess => {
            builder.arg(b.o).arg(b.d_out).arg(&mut *b.delta);
        }
        BackwardKernel::KvOwner => {
            builder.arg(b.q).arg(b.k).arg(b.v).arg(b.d_out).arg(b.lse).arg(&*b.delta);
            builder.arg(&mut *b.dk).arg(&mut *b.dv).arg(&mut *b.dq_acc).arg(&mut *b.dq_part).arg(&mut *b.dkv_part);
        }
        BackwardKernel::GroupSum => {
            builder.arg(&*b.dkv_part).arg(&mut *b.dk).arg(&mut *b.dv);
        }
        BackwardKernel::DqOwner => {
            builder.arg(b.q).arg(b.k).arg(b.v).arg(b.d_out).arg(b.lse).arg(&*b.delta);
            builder.arg(&mut *b.dq);
        }
        BackwardKernel::Finalize => {
            builder.arg(&*b.dq_acc).arg(&*b.dq_part).arg(&mut *b.dq);
        }
    }
    builder.arg(b.cu_q).arg(b.cu_k).arg(params);
    let takes_lists = matches!(which, BackwardKernel::KvOwner | BackwardKernel::DqOwner | BackwardKernel::Finalize);
    if let (true, Some(sparse)) = (takes_lists, b.sparse) {
        builder.arg(sparse.lists).arg(sparse.csr_offsets).arg(sparse.csr_q_blocks).arg(sparse.params);
    }
    // SAFETY: each arm pushes exactly the pointer parameters of its kernel in `flash_bwd.cu`, in order and type, as
    // CUdeviceptr of the element types the kernel declares (`T` for `elem_t`, f32 for `float`); then every kernel
    // takes `COMMON_PARAMS`: the two i32 `cu_seqlens` pointers and `const BackwardParams params` by value, whose layout
    // the two sides share (see the `DeviceRepr` impl above), and, in the `BLOCK_SPARSE` module (the caller compiles
    // it exactly when `sparse` is set), `bwd_kv`, `bwd_dq` and `bwd_dq_finalize` take `SPARSE_PARAMS`: three i32
    // pointers and `const BlockListParams` by value. The kernel writes only the outputs its arm pushes mutably,
    // within the bounds the caller checked (see the preconditions), and reads the others read-only; the buffers are
    // borrowed for this call, and cudarc records their use on `stream`, so none is freed while the kernel runs.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver(which.launch_call(), e))?;
    Ok(())
}

/// Launches `bwd_csr_count` (`q_blocks` is `None`: writes each CSR row's count into `offsets`) or `bwd_csr_fill`
/// (reads the offsets, writes every row's query blocks) of `flash_bwd.cu`'s `BLOCK_SPARSE` module.
///
/// Preconditions, established by `backward::sparse_csr`: `func` is the kernel the arm names; `lists` holds the
/// validated lists `params` describes (`B · list_heads · q_blocks · width` i32); `offsets` holds
/// `B · list_heads · kv_blocks + 1` i32 (for the fill: the scanned offsets); `q_blocks` holds at least the offsets'
/// total; `cfg`'s grid is `(⌈kv_blocks / 4⌉, list_heads, B)` of 128 threads.
pub(crate) fn launch_csr_rows(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    lists: &CudaSlice<i32>,
    offsets: &mut CudaSlice<i32>,
    q_blocks: Option<&mut CudaSlice<i32>>,
    params: &BlockListParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(lists);
    let call = match q_blocks {
        None => {
            builder.arg(offsets);
            "cuLaunchKernel(bwd_csr_count)"
        }
        Some(q_blocks) => {
            builder.arg(&*offsets).arg(q_blocks);
            "cuLaunchKernel(bwd_csr_fill)"
        }
    };
    builder.arg(params);
    // SAFETY: the arguments match `bwd_csr_count(const int*, int*, const BlockListParams)` and
    // `bwd_csr_fill(const int*, const int*, int*, const BlockListParams)` in order and type; every index the kernels
    // form lies in the buffers the caller sized (see above); the buffers are borrowed for this call and their use is
    // recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver(call, e))?;
    Ok(())
}

/// Launches `bwd_csr_scan` over the first `rows` counts of `offsets` (one CTA of 1024 threads).
///
/// Preconditions, established by `backward::sparse_csr`: `func` is `bwd_csr_scan`; `offsets` holds `rows + 1` i32.
pub(crate) fn launch_csr_scan(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    offsets: &mut CudaSlice<i32>,
    rows: i32,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(offsets).arg(&rows);
    // SAFETY: the arguments match `bwd_csr_scan(int*, int rows)`; the kernel touches `offsets[0..=rows]`, which the
    // caller allocated; the buffer is borrowed for this call and its use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(bwd_csr_scan)", e))?;
    Ok(())
}

/// Launches `bsa_pool_keys` or `bsa_pool_queries` (gpu/kernels/bsa_select.cu, `func`) on `stream`: the mean of every
/// key block (query block) of `x` in the launch's range into the f64 workspace `pooled`.
///
/// Preconditions, established by `block_sparse::select`: `func` is one of the two, compiled for the element type of
/// the buffer at address `x`, which holds the spec's K (for `bsa_pool_keys`) or Q (for `bsa_pool_queries`) as the
/// strides and lengths of `params.flash`, or the validated `cu_seqlens` at `cu`, describe; `pooled` is the address of
/// the workspace of `block_sparse::select::workspace_len` f64 (the keys' `B · n_heads_kv · n_key_blocks · d`, then
/// from `params.pooled_queries_at` the queries' `B · n_heads_q · n_query_blocks · d`); `items` is `(blocks, heads,
/// B)` of the pooled side (`heads` the spec's Hkv for the keys, Hq for the queries), its blocks from
/// `params.first_query_block` (queries) or 0 (keys) within the extent; `cfg` has the kernels' 128 threads per block
/// and any one-dimensional grid (its CTAs stride over the items); the three buffers stay allocated, and their use is
/// recorded on the stream that took the addresses, until the launch has run (the caller holds their guards past it).
pub(crate) fn launch_bsa_pool(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (x, pooled): (u64, u64),
    cu: u64,
    params: &BsaParams,
    (blocks, heads, seqs): (i32, i32, i32),
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(&x).arg(&pooled).arg(&cu).arg(params).arg(&blocks).arg(&heads).arg(&seqs);
    // SAFETY: the arguments match `bsa_pool_keys` and `bsa_pool_queries` (`const elem_t*, double* pooled, const int*
    // cu_seqlens, const BsaParams, int blocks, int heads, int seqs`) in order and type (a device address is passed as
    // the 64-bit pointer it is); every index the kernel forms lies in the buffers the caller sized, which stay alive
    // past the launch (see above).
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(bsa_pool_*)", e))?;
    Ok(())
}

/// Launches `bsa_select` or `bsa_select_stream` (gpu/kernels/bsa_select.cu) on `stream`: one list per (query block,
/// KV head, sequence) of the grid's range.
///
/// Preconditions, established by `block_sparse::select`: `func` is one of the two; `pooled` is the address of the
/// pooled keys and queries `bsa_pool_keys` and `bsa_pool_queries` wrote for the same spec and parameters, ordered
/// before this launch (on `stream`, or through an event it waits for); `lists` that of `B · n_heads_kv ·
/// params.n_query_blocks · top_k` i32; `cu_q`, `cu_k` those of the validated `cu_seqlens`; `cfg` has the kernel's grid
/// (`bsa_select`: a CTA per query block; `bsa_select_stream`: one per 8, `top_k` at most 32) over query blocks from
/// `params.first_query_block` (a multiple of 8) within the extent, its threads and dynamic shared memory
/// (`bsa_select`: `d + n_key_blocks` f64 and `n_key_blocks` bytes; `bsa_select_stream`: its query and key tiles and
/// one tile's scores), which the function attribute allows; the buffers stay allocated until the launch has run.
pub(crate) fn launch_bsa_select(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (pooled, lists): (u64, u64),
    (cu_q, cu_k): (u64, u64),
    params: &BsaParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(&pooled).arg(&lists).arg(&cu_q).arg(&cu_k).arg(params);
    // SAFETY: the arguments match `bsa_select` and `bsa_select_stream` (`const double* pooled, int* lists, const int*
    // cu_q, const int* cu_k, const BsaParams`) in order and type (device addresses as the 64-bit pointers they are);
    // every index the kernel forms lies in the buffers the caller sized, which stay alive past the launch (see above).
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(bsa_select)", e))?;
    Ok(())
}

/// Launches `bsa_select` or `bsa_select_stream` compiled with `COVARIANCE_SCORE` (E24, `pisa::covariance`) on
/// `stream`: the lists of [`launch_bsa_select`] from scores that carry the spread term.
///
/// Preconditions: those of [`launch_bsa_select`], and `spreads` holds `B · n_heads_kv · params.n_key_blocks` f64
/// written by `pisa_covariance_spread`, `coefficients` `B · n_heads_q · params.n_query_blocks` f64 written by
/// `pisa_covariance_coefficients` for the same spec and parameters.
pub(crate) fn launch_covariance_select(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (pooled, lists): (&CudaSlice<f64>, &mut CudaSlice<i32>),
    (cu_q, cu_k): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &BsaParams,
    (spreads, coefficients): (&CudaSlice<f64>, &CudaSlice<f64>),
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(pooled).arg(lists).arg(cu_q).arg(cu_k).arg(params).arg(spreads).arg(coefficients);
    // SAFETY: the arguments match the two selectors under COVARIANCE_SCORE (`const double* pooled, int* lists, const
    // int* cu_q, const int* cu_k, const BsaParams, const double* spreads, const double* coefficients`) in order and
    // type; every index the kernels form lies in the buffers the caller sized (see above); the buffers are borrowed
    // for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(covariance select)", e))?;
    Ok(())
}

/// Launches `pisa_covariance_hbar`, `pisa_covariance_hbar_sum` or `pisa_covariance_spread` (gpu/kernels/
/// pisa_covariance.cu, `func`) on `stream`: `H̄`'s partial sums, `H̄`, or each key block's spread.
///
/// Preconditions, established by `pisa::covariance`: `k`, `v` hold the spec's K and V; `pooled` the mean keys
/// `bsa_pool_keys` wrote for `params`; `hbar` holds `(n_ranges + 1) · batch · n_heads_kv · d · dv` f64 (the partial
/// sums written before `_hbar_sum` runs, `H̄` before `_spread` runs); `spreads` holds `batch · n_heads_kv ·
/// params.n_key_blocks` f64; `cfg`'s grid is `(ranges, n_heads_kv, batch)` for `_hbar`, `(⌈d·dv/128⌉, ...)` for
/// `_hbar_sum` (128 threads), `(n_key_blocks, ...)` for `_spread`, with 256 threads and the dynamic shared memory of
/// `spread_shared_bytes` for the two, which the function attribute allows; both head dims are at most 256; `cu_k`
/// holds the validated key `cu_seqlens` (or one entry, unread, when dense).
pub(crate) fn launch_covariance_statistics<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (k, v): (&CudaSlice<T>, &CudaSlice<T>),
    (pooled, hbar, spreads): (&CudaSlice<f64>, &mut CudaSlice<f64>, &mut CudaSlice<f64>),
    cu_k: &CudaSlice<i32>,
    params: &BsaParams,
    (batch, n_ranges): (i32, i32),
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(k).arg(v).arg(pooled).arg(hbar).arg(spreads).arg(cu_k).arg(params).arg(&batch).arg(&n_ranges);
    // SAFETY: the arguments match the three kernels (`const elem_t* k, const elem_t* v, const double* pooled, double*
    // hbar, double* spreads, const int* cu_k, const BsaParams, const int batch, const int n_ranges`) in order and
    // type; every index the kernels form lies in the buffers the caller sized (see above); the buffers are borrowed
    // for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(pisa_covariance statistics)", e))?;
    Ok(())
}

/// Launches `pisa_covariance_coefficients` (gpu/kernels/pisa_covariance.cu, `func`) on `stream`: `γ|α|‖q̄_{a,h}‖` per
/// pooled query.
///
/// Preconditions, established by `pisa::covariance`: `pooled` holds the pooled queries `bsa_pool_queries` wrote for
/// `params`; `coefficients` holds `batch · n_heads_q · params.n_query_blocks` f64; `cfg` has one thread per entry in
/// CTAs of 128.
pub(crate) fn launch_covariance_coefficients(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (pooled, coefficients): (&CudaSlice<f64>, &mut CudaSlice<f64>),
    params: &BsaParams,
    batch: i32,
    gamma_scale: f64,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(pooled).arg(coefficients).arg(params).arg(&batch).arg(&gamma_scale);
    // SAFETY: the arguments match `pisa_covariance_coefficients` (`const double* pooled, double* coefficients, const
    // BsaParams, const int batch, const double gamma_scale`) in order and type; the kernel reads and writes only the
    // entries below `batch · n_heads_q · n_query_blocks` (see above); the buffers are borrowed for this call and their
    // use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(pisa_covariance_coefficients)", e))?;
    Ok(())
}

/// Launches `pisa_pool_level` (gpu/kernels/pisa_select.cu, `func`) on `stream`: the mean vectors of pyramid level
/// `level ≥ 1` from those of `level − 1`.
///
/// Preconditions, established by `pisa::select`: `func` is `pisa_pool_level`; `pooled` holds the workspace of
/// `pisa::select::workspace_len` f64 with levels `0..level` written; `cfg`'s grid is `(width of level, n_heads_kv, B)`
/// with the pooling's 128 threads; `cu_k` holds the validated key `cu_seqlens` (or one entry, unread, when dense).
pub(crate) fn launch_pisa_pool_level(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    pooled: &mut CudaSlice<f64>,
    cu_k: &CudaSlice<i32>,
    params: &PisaParams,
    level: i32,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(pooled).arg(cu_k).arg(params).arg(&level);
    // SAFETY: the arguments match `pisa_pool_level(double* pooled, const int* cu_k, const PisaParams, int level)` in
    // order and type; the nodes the kernel reads and writes lie in the workspace the caller sized (see above); the
    // buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(pisa_pool_level)", e))?;
    Ok(())
}

/// Launches `pisa_tail_means`, `pisa_tail_hbar` or `pisa_tail_hbar_sum` (gpu/kernels/pisa_tail.cu, `func`) on
/// `stream`: the tail's statistics per key block (means of keys and values, and their storage-type forms), `H̄`'s
/// partial sums per (tile, range of keys), or `H̄` from them (and its split form).
///
/// Preconditions, established by `pisa::tail`: `func` is one of the three, compiled for the element type `T`; `k`, `v`
/// hold the spec's K and V, which the strides and lengths of `params.flash` or the validated `cu_k` describe; `work`
/// holds `pisa::tail::workspace_len` f64 (the mean keys from 0, the mean values from `params.value_means_at`, `H̄` from
/// `params.hbar_at`, its `params.hbar_splits` partial sums from `params.hbar_partials_at`), `pooled`
/// `pisa::tail::pooled_len` elements (the split mean keys from 0, the rounded mean values from
/// `params.pooled_values_at`, the split `H̄` from `params.pooled_hbar_at`); the three run in this order on the same
/// stream; `cfg`'s grid is `(key blocks, n_heads_kv, B)` with 128 threads for the means, `(tiles of H̄ × ranges,
/// n_heads_kv, B)` with 128 for the partial sums and `(⌈d·dv / 128⌉, n_heads_kv, B)` with 128 for their sum.
pub(crate) fn launch_pisa_tail_stats<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (k, v): (&CudaSlice<T>, &CudaSlice<T>),
    (work, pooled): (&mut CudaSlice<f64>, &mut CudaSlice<T>),
    cu_k: &CudaSlice<i32>,
    params: &PisaTailParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(k).arg(v).arg(work).arg(pooled).arg(cu_k).arg(params);
    // SAFETY: the arguments match the three kernels (`const elem_t* k, const elem_t* v, double*
    // work, elem_t* pooled, const int* cu_k, const PisaTailParams`) in order and type; every index the kernels form
    // lies in the buffers the caller sized (see above); the buffers are borrowed for this call and their use is
    // recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(pisa_tail stats)", e))?;
    Ok(())
}

/// Launches `pisa_tail_merge` (gpu/kernels/pisa_tail.cu, `func`) on `stream`: the tail of 64 rows of one query head
/// per CTA on the tensor cores, merged into the exact part's `O` and LSE in place.
///
/// Preconditions, established by `pisa::tail`: `func` is `pisa_tail_merge` compiled for the element type `T` and the
/// spec's padded head dims; `q` holds the spec's Q; `pooled` the storage-type statistics `pisa_tail_means` and
/// `pisa_tail_hbar` wrote for the same K and V; `lists` the validated lists `[B, list heads, n_query_blocks,
/// list_width]` (the exact part's, cut and partial blocks included) with `q_block` a multiple of 64; `o` and `lse`
/// the block-sparse forward's outputs over those lists, in the spec's layout; `cfg`'s grid is
/// `(⌈longest Lq / 64⌉, n_heads_q, B)` with 128 threads and the dynamic shared memory of
/// `pisa::tail::merge_shared_bytes`, which the function attribute allows.
pub(crate) fn launch_pisa_tail_merge<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (q, pooled, lists): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<i32>),
    (o, lse): (&mut CudaSlice<T>, &mut CudaSlice<f32>),
    (cu_q, cu_k): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &PisaTailParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(q).arg(pooled).arg(lists).arg(o).arg(lse).arg(cu_q).arg(cu_k).arg(params);
    // SAFETY: the arguments match `pisa_tail_merge(const elem_t* q, const elem_t* pooled, const int* lists, elem_t* o,
    // float* lse, const int* cu_q, const int* cu_k, const PisaTailParams)` in order and type; every index the kernel
    // forms lies in the buffers the caller sized (see above); the buffers are borrowed for this call and their use is
    // recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(pisa_tail_merge)", e))?;
    Ok(())
}

/// The device buffers of the tail's backward kernels (`gpu/kernels/pisa_tail_bwd.cu`), as `pisa::tail_backward` sized
/// them: the inputs `q`, `d_out` (shaped like O), the exact `lists`, the forward's f64 statistics `stats`
/// (`pisa::tail::workspace_len`), `lse` and the exact part's `delta` (LSE's layout); the row workspaces `through` and
/// `mass` (LSE's layout, f64), the gradient workspace `grads` (the statistics' layout: dμ, dV^Σ and G at the offsets of
/// μ, v̄ and H̄), G's `partials` (`[row ranges, B, Hq, d, dv]`); the gradients `dq`, `dk`, `dv` (the exact part's, added
/// to in place); K and V; and the `cu_seqlens`.
pub(crate) struct TailBackwardBuffers<'a, T> {
    pub q: &'a CudaSlice<T>,
    pub k: &'a CudaSlice<T>,
    pub v: &'a CudaSlice<T>,
    pub d_out: &'a CudaSlice<T>,
    pub lists: &'a CudaSlice<i32>,
    pub stats: &'a CudaSlice<f64>,
    pub lse: &'a CudaSlice<f32>,
    pub delta: &'a CudaSlice<f32>,
    pub through: &'a mut CudaSlice<f64>,
    pub mass: &'a mut CudaSlice<f64>,
    pub grads: &'a mut CudaSlice<f64>,
    pub partials: &'a mut CudaSlice<f64>,
    pub dq: &'a mut CudaSlice<T>,
    pub dk: &'a mut CudaSlice<T>,
    pub dv: &'a mut CudaSlice<T>,
    pub cu_q: &'a CudaSlice<i32>,
    pub cu_k: &'a CudaSlice<i32>,
}

/// The kernels of `pisa_tail_bwd.cu`, in the order [`launch_pisa_tail_backward`] runs them.
pub(crate) struct TailBackwardFunctions {
    pub rows: CudaFunction,
    pub blocks: CudaFunction,
    pub g: CudaFunction,
    pub g_sum: CudaFunction,
    pub scatter: CudaFunction,
}

/// Launch configurations of the five kernels, and G's row ranges (the kernels' `row_splits`).
pub(crate) struct TailBackwardGrids {
    pub rows: LaunchConfig,
    pub blocks: LaunchConfig,
    pub g: LaunchConfig,
    pub g_sum: LaunchConfig,
    pub scatter: LaunchConfig,
    pub row_splits: i32,
}

/// Launches the tail's backward (gpu/kernels/pisa_tail_bwd.cu) on `stream`, after the exact part's block-sparse
/// backward wrote `dq`, `dk`, `dv` and `delta`: `pisa_tail_bwd_rows`, `_blocks`, `_g`, `_g_sum`, `_scatter`.
///
/// Preconditions, established by `pisa::tail_backward`: the functions are those kernels compiled for the element type
/// `T` and the spec's padded head dims; every buffer holds what [`TailBackwardBuffers`] says, sized for the spec
/// (`params.flash`'s strides and lengths, or the validated `cu_seqlens`) and the exact lists
/// (`params.n_query_blocks`, `params.list_width`, `params.n_key_blocks`); `grids` are `(⌈max Lq / tile⌉, Hq, B)` and
/// `(⌈key blocks / tile⌉, Hkv, B)` of 256 threads with the dynamic shared memory of the kernel's `TAILB_TILE` = tile
/// (plus a byte per key block for the rows kernel, per block of the tile for the blocks kernel), then `(64 × 64 tiles
/// of [d, dv] × row_splits, Hq, B)`, `(⌈d·dv / 128⌉, Hkv, B)` and `(⌈max Lk / 8⌉, Hkv, B)` of 128 threads, with
/// `row_splits = ⌈max Lq / 4096⌉` (at least 1) ranges in `partials`.
pub(crate) fn launch_pisa_tail_backward<T>(
    stream: &CudaStream,
    functions: &TailBackwardFunctions,
    grids: TailBackwardGrids,
    b: TailBackwardBuffers<'_, T>,
    params: &PisaTailParams,
) -> Result<(), GpuError>
where
    T: DeviceRepr,
{
    let driver = |e| GpuError::driver("cuLaunchKernel(pisa_tail_bwd)", e);
    let mut rows = stream.launch_builder(&functions.rows);
    rows.arg(b.q).arg(b.d_out).arg(b.lists).arg(b.stats).arg(b.lse).arg(b.delta);
    rows.arg(&mut *b.through).arg(&mut *b.mass).arg(&mut *b.dq).arg(b.cu_q).arg(b.cu_k).arg(params);
    // SAFETY: the arguments match `pisa_tail_bwd_rows(const elem_t* q, const elem_t* d_out, const int* lists, const
    // double* stats, const float* lse, const float* delta, double* through, double* mass, elem_t* dq, const int* cu_q,
    // const int* cu_k, const PisaTailParams)` in order and type; every index it forms lies in the buffers sized as
    // above; the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { rows.launch(grids.rows) }.map_err(driver)?;
    let mut blocks = stream.launch_builder(&functions.blocks);
    blocks.arg(b.q).arg(b.d_out).arg(b.lists).arg(b.stats).arg(b.lse).arg(b.delta);
    blocks.arg(&*b.through).arg(&mut *b.grads).arg(b.cu_q).arg(b.cu_k).arg(params);
    // SAFETY: as above, for `pisa_tail_bwd_blocks(const elem_t* q, const elem_t* d_out, const int* lists, const
    // double* stats, const float* lse, const float* delta, const double* through, double* grads, const int* cu_q,
    // const int* cu_k, const PisaTailParams)`.
    unsafe { blocks.launch(grids.blocks) }.map_err(driver)?;
    let mut g = stream.launch_builder(&functions.g);
    g.arg(b.q).arg(b.d_out).arg(&*b.mass).arg(&mut *b.partials).arg(b.cu_q).arg(b.cu_k).arg(params);
    g.arg(&grids.row_splits);
    // SAFETY: as above, for `pisa_tail_bwd_g(const elem_t* q, const elem_t* d_out, const double* mass, double*
    // partials, const int* cu_q, const int* cu_k, const PisaTailParams, int row_splits)`.
    unsafe { g.launch(grids.g) }.map_err(driver)?;
    let mut g_sum = stream.launch_builder(&functions.g_sum);
    g_sum.arg(&*b.partials).arg(&mut *b.grads).arg(b.cu_q).arg(params).arg(&grids.row_splits);
    // SAFETY: as above, for `pisa_tail_bwd_g_sum(const double* partials, double* grads, const int* cu_q, const
    // PisaTailParams, int row_splits)`.
    unsafe { g_sum.launch(grids.g_sum) }.map_err(driver)?;
    let mut scatter = stream.launch_builder(&functions.scatter);
    scatter.arg(b.k).arg(b.v).arg(b.stats).arg(&*b.grads).arg(&mut *b.dk).arg(&mut *b.dv).arg(b.cu_k).arg(params);
    // SAFETY: as above, for `pisa_tail_bwd_scatter(const elem_t* k, const elem_t* v, const double* stats, const
    // double* grads, elem_t* dk, elem_t* dv, const int* cu_k, const PisaTailParams)`.
    unsafe { scatter.launch(grids.scatter) }.map_err(driver)?;
    Ok(())
}

/// Launches `hils_summaries` (gpu/kernels/hils.cu, `func`) on `stream`: one chunk's landmark summary per CTA.
///
/// Preconditions, established by `hils`: `func` is `hils_summaries` compiled for the element type `T`; `k` holds the
/// spec's K, `landmarks` `B · Hq · params.n_chunks · d` elements, `summaries` `B · Hq · params.n_chunks · (d + 1)`
/// f64; `params.chunk_size` is at most `HILS_MAX_CHUNK` and `d` at most 256; `cfg`'s grid is
/// `(params.n_chunks, n_heads_q, B)` with 128 threads.
pub(crate) fn launch_hils_summaries<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (k, landmarks): (&CudaSlice<T>, &CudaSlice<T>),
    summaries: &mut CudaSlice<f64>,
    cu_k: &CudaSlice<i32>,
    params: &HilsParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(k).arg(landmarks).arg(summaries).arg(cu_k).arg(params);
    // SAFETY: the arguments match `hils_summaries(const elem_t* k, const elem_t* landmarks, double* summaries, const
    // int* cu_k, const HilsParams)` in order and type; every index the kernel forms lies in the buffers the caller
    // sized (see above); the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(hils_summaries)", e))?;
    Ok(())
}

/// Launches `hils_route` (gpu/kernels/hils.cu, `func`) on `stream`: one query's routing per warp.
///
/// Preconditions, established by `hils`: `func` is `hils_route` compiled for the element type `T`; `q` holds the
/// spec's Q; `summaries` what `hils_summaries` wrote for the same K and landmarks, earlier on `stream`; `lists`
/// `B · Hq · params.max_len · params.top_k` i32; `scores` `B · Hq · params.max_len · params.n_chunks` f64 when
/// `params.write_scores` is 1 (else any buffer, unread); `params.top_k` at most 32; `cfg`'s grid is
/// `(⌈params.max_len / 4⌉, n_heads_q, B)` with 128 threads.
pub(crate) fn launch_hils_route<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (q, summaries): (&CudaSlice<T>, &CudaSlice<f64>),
    (lists, scores): (&mut CudaSlice<i32>, &mut CudaSlice<f64>),
    cu_q: &CudaSlice<i32>,
    params: &HilsParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(q).arg(summaries).arg(lists).arg(scores).arg(cu_q).arg(params);
    // SAFETY: the arguments match `hils_route(const elem_t* q, const double* summaries, int* lists, double*
    // router_scores, const int* cu_q, const HilsParams)` in order and type; every index the kernel forms lies in the
    // buffers the caller sized (see above); the buffers are borrowed for this call and their use is recorded on
    // `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(hils_route)", e))?;
    Ok(())
}

/// Launches `hils_output` (gpu/kernels/hils.cu, `func`) on `stream`: one query's factorized output per warp.
///
/// Preconditions, established by `hils`: `func` is `hils_output` compiled for the element type `T`; `q`, `k`, `v`
/// hold the spec's Q, K, V and `o`, `lse` its O and LSE; `summaries` what `hils_summaries` wrote for the same K and
/// landmarks, earlier on `stream`; `lists` `B · Hq · params.max_len · params.top_k` i32 whose valid rows name only
/// chunks eligible for their query (the router's own, or lists the host checked); `dv` at most 256; `cfg`'s grid is
/// `(⌈params.max_len / 4⌉, n_heads_q, B)` with 128 threads.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_hils_output<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (q, k, v): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    (summaries, lists): (&CudaSlice<f64>, &CudaSlice<i32>),
    (o, lse): (&mut CudaSlice<T>, &mut CudaSlice<f32>),
    (cu_q, cu_k): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &HilsParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(q).arg(k).arg(v).arg(summaries).arg(lists).arg(o).arg(lse).arg(cu_q).arg(cu_k).arg(params);
    // SAFETY: the arguments match `hils_output(const elem_t* q, const elem_t* k, const elem_t* v, const double*
    // summaries, const int* lists, elem_t* o, float* lse, const int* cu_q, const int* cu_k, const HilsParams)` in order
    // and type; every index the kernel forms lies in the buffers the caller sized (see above); the buffers are borrowed
    // for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(hils_output)", e))?;
    Ok(())
}

/// The optional trace of a pyramid descent: every level's candidate scores (f64) and nodes (i32).
pub(crate) type PisaTrace<'a> = Option<(&'a mut CudaSlice<f64>, &'a mut CudaSlice<i32>)>;

/// Launches `pisa_select` or `pisa_select_mean` (gpu/kernels/pisa_select.cu, `func`) on `stream`: one descent per
/// (query block, KV head, sequence).
///
/// Preconditions, established by `pisa::select`: `func` is `pisa_select` (LSE, PISA-2) or `pisa_select_mean` (PISA-1)
/// compiled for the element type `T`; `k` holds
/// the spec's K; `pooled` every level's means and the pooled queries; `lists` `B · n_heads_kv · n_query_blocks ·
/// width` i32 with `n_query_blocks` that of `params`; the trace, when given, `B · n_heads_kv · n_query_blocks ·
/// n_levels · max_candidates` of each; `cfg` has `w` warps (1 to 8), a grid x extent of `⌈n_query_blocks / w⌉`
/// and `w` warps' slices of dynamic shared memory (`pisa::select`'s `warp_shared_bytes`), which the caller allowed.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_pisa_select<T: DeviceRepr>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (k, pooled): (&CudaSlice<T>, &CudaSlice<f64>),
    lists: &mut CudaSlice<i32>,
    (cu_q, cu_k): (&CudaSlice<i32>, &CudaSlice<i32>),
    trace: PisaTrace<'_>,
    params: &PisaParams,
) -> Result<(), GpuError> {
    let null: u64 = 0;
    let mut builder = stream.launch_builder(func);
    builder.arg(k).arg(pooled).arg(lists).arg(cu_q).arg(cu_k);
    let (trace_scores, trace_nodes);
    match trace {
        Some((scores, nodes)) => {
            (trace_scores, trace_nodes) = (scores, nodes);
            builder.arg(trace_scores).arg(trace_nodes);
        }
        None => {
            builder.arg(&null).arg(&null);
        }
    }
    builder.arg(params);
    // SAFETY: the arguments match `pisa_select` and `pisa_select_mean(const elem_t* k, const double* pooled, int* lists, const int* cu_q,
    // const int* cu_k, double* trace_scores, int* trace_nodes, const PisaParams)` in order and type (a null device
    // pointer, a 64-bit zero, for an absent trace, which the kernel then never touches); every index it forms lies in
    // the buffers the caller sized (see above); they are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(pisa_select)", e))?;
    Ok(())
}

/// Launches `pisa_block_mass` (gpu/kernels/pisa_mass.cu, `func`) on `stream`: one row of block masses per (query
/// block, KV head, sequence).
///
/// Preconditions, established by `pisa::diagnostics`: `func` is `pisa_block_mass` compiled for the element type `T`;
/// `q`, `k` hold the spec's Q and K, which the strides and lengths of `params.flash`, or the validated `cu_seqlens`,
/// describe; `masses` holds `B · n_heads_kv · n_query_blocks · n_key_blocks` f64 with `n_query_blocks` the grid's x
/// extent; `cfg` has the kernel's 128 threads and `4 · d · (128 + 1 + 32)` bytes of dynamic shared memory, which the
/// caller allowed.
pub(crate) fn launch_pisa_block_mass<T: DeviceRepr>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (q, k): (&CudaSlice<T>, &CudaSlice<T>),
    masses: &mut CudaSlice<f64>,
    (cu_q, cu_k): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &BsaParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(q).arg(k).arg(masses).arg(cu_q).arg(cu_k).arg(params);
    // SAFETY: the arguments match `pisa_block_mass(const elem_t* q, const elem_t* k, double* masses, const int* cu_q,
    // const int* cu_k, const BsaParams)` in order and type; every index the kernel forms lies in the buffers the
    // caller sized (see above); the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(pisa_block_mass)", e))?;
    Ok(())
}

/// Launches `dsa_index_topk` (gpu/kernels/dsa_index.cu, `func`) on `stream`: the lightning indexer's scores and the
/// exact top-k of every token.
///
/// Preconditions, established by `dsa::index`: `func` is `dsa_index_topk` compiled for the element type `T` and
/// `INDEX_DIM = d_I`; `q` holds `T · H_I · d_I` elements, `k` `T · d_I`, `w` `T · H_I`, `lists` `T · top_k`;
/// `scratch` holds `params.scratch_stride` f32 for every row the kernel writes (`T` rows, rounded up to the group of
/// four, with `full_scores`, else four per CTA of `cfg`'s grid), with `scratch_stride ≥ T`; `H_I ≤ 64`; `cfg` has
/// 256 threads and the dynamic shared memory of `dsa::index::shared_bytes`, which the function attribute allows.
pub(crate) fn launch_dsa_index<T: DeviceRepr>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (q, k, w): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<f32>),
    (lists, scratch): (&mut CudaSlice<i32>, &mut CudaSlice<f32>),
    params: &DsaIndexParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(q).arg(k).arg(w).arg(lists).arg(scratch).arg(params);
    // SAFETY: the arguments match `dsa_index_topk(const elem_t* q, const elem_t* k, const float* w, int* lists,
    // float* scratch, const DsaIndexParams)` in order and type; every index the kernel forms lies in the buffers the
    // caller sized (see above); the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(dsa_index_topk)", e))?;
    Ok(())
}

/// The indexer inputs every kernel of `dsa_loss.cu` reads: `q^I`, `k^I`, `w` and the lists.
pub(crate) type LossIndexer<'a, T> = (&'a CudaSlice<T>, &'a CudaSlice<T>, &'a CudaSlice<f32>, &'a CudaSlice<i32>);

/// Launches `dsa_loss_rows` (gpu/kernels/dsa_loss.cu, `func`) on `stream`: each token's student scores and teacher on
/// its list, its KL and its student LSE.
///
/// Preconditions, established by `dsa::loss`: `func` is `dsa_loss_rows` compiled for the element type `T`,
/// `INDEX_DIM = d_I` and `HEAD_DIM_PAD ≥ d`; `q^I` holds `T · H_I · d_I` elements, `k^I` `T · d_I`, `w` `T · H_I`, the
/// lists `T · top_k`; `q` `T · H · d`, `k` `T · H_kv · d`, `lse` `H · T`; `student` and `teacher` `T · top_k` f32,
/// `kl` and `student_lse` `T`; `H_I ≤ 64`, `H` a multiple of `H_kv`; `cfg` has one CTA of 256 threads per token and
/// the dynamic shared memory of `dsa::loss::rows_shared_bytes`, which the function attribute allows.
pub(crate) fn launch_dsa_loss_rows<T: DeviceRepr>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (qi, ki, w, lists): LossIndexer<'_, T>,
    (q, k, lse): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<f32>),
    (student, teacher, kl, student_lse): (
        &mut CudaSlice<f32>,
        &mut CudaSlice<f32>,
        &mut CudaSlice<f32>,
        &mut CudaSlice<f32>,
    ),
    params: &DsaLossParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(qi).arg(ki).arg(w).arg(lists).arg(q).arg(k).arg(lse);
    builder.arg(student).arg(teacher).arg(kl).arg(student_lse).arg(params);
    // SAFETY: the arguments match `dsa_loss_rows(const elem_t* qi, const elem_t* ki, const float* w, const int* lists,
    // const elem_t* q, const elem_t* k, const float* lse, float* student, float* teacher, float* kl,
    // float* student_lse, const DsaLossParams)` in order and type; every index the kernel forms lies in the buffers
    // the caller sized (see above); the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(dsa_loss_rows)", e))?;
    Ok(())
}

/// Launches `dsa_loss_grad` (gpu/kernels/dsa_loss.cu, `func`) on `stream`: the loss's gradients with respect to
/// `q^I` and `w` (written) and `k^I` (added to `d_ki`).
///
/// Preconditions, established by `dsa::loss`: `func` is `dsa_loss_grad` compiled as `dsa_loss_rows` was; the indexer
/// buffers as there, `student`, `teacher` (`T · top_k`) and `student_lse` (`T`) as `dsa_loss_rows` wrote them;
/// `d_qi` holds `T · H_I · d_I` f32, `d_w` `T · H_I`, `d_ki` `T · d_I`; `cfg` has one CTA of 256 threads per token and
/// the dynamic shared memory of `dsa::loss::grad_shared_bytes`, which the function attribute allows.
pub(crate) fn launch_dsa_loss_grad<T: DeviceRepr>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (qi, ki, w, lists): LossIndexer<'_, T>,
    (student, teacher, student_lse): (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
    (d_qi, d_w, d_ki): (&mut CudaSlice<f32>, &mut CudaSlice<f32>, &mut CudaSlice<f32>),
    params: &DsaLossParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(qi).arg(ki).arg(w).arg(lists).arg(student).arg(teacher).arg(student_lse);
    builder.arg(d_qi).arg(d_w).arg(d_ki).arg(params);
    // SAFETY: the arguments match `dsa_loss_grad(const elem_t* qi, const elem_t* ki, const float* w, const int* lists,
    // const float* student, const float* teacher, const float* student_lse, float* d_qi, float* d_w, float* d_ki,
    // const DsaLossParams)` in order and type; every index the kernel forms lies in the buffers the caller sized (see
    // above); the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(dsa_loss_grad)", e))?;
    Ok(())
}

/// Launches `dsa_sparse_fwd` (gpu/kernels/dsa_sparse.cu, `func`) on `stream`: the token-sparse attention's output and
/// LSE of every token and query head from the token's list.
///
/// Preconditions, established by `dsa::sparse`: `func` is `dsa_sparse_fwd` compiled for the element type `T`, padded
/// head dims `HEAD_DIM_PAD ≥ params.flash.d`, `HEAD_DIM_V_PAD ≥ params.flash.dv` and `SPARSE_ROWS` rows;
/// `q`, `k`, `v`, `o` and `lse` hold the layer's Q, K, V, O and LSE as `params.flash` (or the validated `cu_q`,
/// `cu_k`) describes them; `lists` holds `params.token_rows · params.list_heads · params.top_k` i32 (any values: the
/// kernel ends a list at its first entry that does not rise or lies after its token); `cfg`'s grid is `(longest
/// sequence, n_heads_kv · head_chunks, B)` with `2 · SPARSE_ROWS` threads and the shared memory of the Q, K and V
/// tiles, which the function attribute allows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_dsa_sparse_fwd<T: DeviceRepr>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (q, k, v): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    (o, lse): (&mut CudaSlice<T>, &mut CudaSlice<f32>),
    lists: &CudaSlice<i32>,
    (cu_q, cu_k): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &DsaSparseParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(q).arg(k).arg(v).arg(o).arg(lse).arg(lists).arg(cu_q).arg(cu_k).arg(params);
    // SAFETY: the arguments match `dsa_sparse_fwd(const elem_t* q, const elem_t* k, const elem_t* v, elem_t* o,
    // float* lse, const int* lists, const int* cu_q, const int* cu_k, const DsaSparseParams)` in order and type; every
    // index the kernel forms lies in the buffers the caller sized (see above); the buffers are borrowed for this call
    // and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(dsa_sparse_fwd)", e))?;
    Ok(())
}

/// The device buffers of `dsa_sparse_bwd`: the layer's Q, K, V, the upstream gradient, the forward's LSE and `D`;
/// dQ (written), the f32 dK and dV accumulators in K's and V's layouts (added to), the lists and the sequence offsets.
pub(crate) struct DsaSparseBwdBuffers<'a, T> {
    pub q: &'a CudaSlice<T>,
    pub k: &'a CudaSlice<T>,
    pub v: &'a CudaSlice<T>,
    pub d_out: &'a CudaSlice<T>,
    pub lse: &'a CudaSlice<f32>,
    pub delta: &'a CudaSlice<f32>,
    pub dq: &'a mut CudaSlice<T>,
    pub dk_acc: &'a mut CudaSlice<f32>,
    pub dv_acc: &'a mut CudaSlice<f32>,
    pub lists: &'a CudaSlice<i32>,
    pub cu_q: &'a CudaSlice<i32>,
    pub cu_k: &'a CudaSlice<i32>,
}

/// Launches `dsa_sparse_bwd` (gpu/kernels/dsa_sparse_bwd.cu, `func`) on `stream`: every token's dQ, and its gathered
/// keys' dK, dV partials added to the accumulators.
///
/// Preconditions, established by `dsa::sparse_backward`: `func` is the kernel, compiled from `common.cuh`,
/// `flash_bwd.cu` and `dsa_sparse_bwd.cu` for `T` and the padded head dims of `params.flash` in the four-warp tiling;
/// `q`, `k`, `v`, `d_out` (O's layout), `lse` and `delta` hold the layer's tensors as `params.flash` (or the
/// validated `cu_q`, `cu_k`) describes them, `dq` Q's elements, `dk_acc` K's and `dv_acc` V's as f32; `lists` holds
/// `params.token_rows · params.list_heads · params.top_k` i32 (any values: the kernel ends a list at its first entry
/// that does not rise or lies after its token); `cfg`'s grid is `(longest sequence, Hkv · head_chunks ·
/// column_chunks, B)` of 128 threads with the dynamic shared memory of the kernel's layout, which the function
/// attribute allows.
pub(crate) fn launch_dsa_sparse_bwd<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    b: DsaSparseBwdBuffers<'_, T>,
    params: &DsaSparseParams,
    add_kv: i32,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(b.q).arg(b.k).arg(b.v).arg(b.d_out).arg(b.lse).arg(b.delta);
    builder.arg(b.dq).arg(b.dk_acc).arg(b.dv_acc).arg(b.lists).arg(b.cu_q).arg(b.cu_k).arg(params).arg(&add_kv);
    // SAFETY: the arguments match `dsa_sparse_bwd(const elem_t* q, k, v, d_out, const float* lse, delta, elem_t* dq,
    // float* dk_acc, dv_acc, const int* lists, cu_q, cu_k, const DsaSparseParams, int add_kv)` in order and type (`T`
    // for `elem_t`); every index the kernel forms lies in the buffers the caller sized (see above: with `add_kv` 0 the
    // accumulators are not touched and may be placeholders); the buffers are borrowed for this call and their use is
    // recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(dsa_sparse_bwd)", e))?;
    Ok(())
}

/// Launches `dsa_csr_count` (`fill` is `None`: every list's valid length into `lengths` and each CSR row's count into
/// `offsets`) or `dsa_csr_fill` (`fill` holds the tokens and masks to write; reads the scanned offsets and the
/// lengths) of `dsa_sparse_bwd.cu`: the token-level transpose of the deterministic mode.
///
/// Preconditions, established by `dsa::sparse_backward`: `func` is the kernel the arm names, of the module of
/// `launch_dsa_sparse_bwd`; `lists` holds `params.token_rows · params.list_heads · params.top_k` i32 (any values: both
/// kernels read a list's valid prefix by the forward's rule), `lengths` `token_rows · list_heads` i32, `offsets`
/// `B · list_heads · kv_tiles + 1` i32 (`kv_tiles` the longest sequence's tiles of 64 keys), and the fill's tokens and
/// masks at least the offsets' total each; `cfg`'s grid is `(⌈longest / 128⌉, list_heads, B)` for the count and
/// `(⌈kv_tiles / 4⌉, list_heads, B)` for the fill, of 128 threads.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_dsa_csr(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    lists: &CudaSlice<i32>,
    (offsets, lengths): (&mut CudaSlice<i32>, &mut CudaSlice<i32>),
    fill: Option<(&mut CudaSlice<i32>, &mut CudaSlice<u64>)>,
    (cu_q, cu_k): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &DsaSparseParams,
    kv_tiles: i32,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    let name = match fill {
        None => {
            builder.arg(lists).arg(offsets).arg(lengths);
            "cuLaunchKernel(dsa_csr_count)"
        }
        Some((tokens, masks)) => {
            builder.arg(lists).arg(&*lengths).arg(&*offsets).arg(tokens).arg(masks);
            "cuLaunchKernel(dsa_csr_fill)"
        }
    };
    builder.arg(cu_q).arg(cu_k).arg(params).arg(&kv_tiles);
    // SAFETY: the arms push exactly `dsa_csr_count(const int* lists, int* counts, int* lengths, ...)` and
    // `dsa_csr_fill(const int* lists, const int* lengths, const int* csr_offsets, int* csr_tokens, unsigned long long*
    // csr_masks, ...)`, then both take `const int* cu_q, cu_k, const DsaSparseParams, int kv_tiles`, in order and type
    // (`u64` for `unsigned long long`); every index lies in the buffers the caller sized (see above); the buffers are
    // borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver(name, e))?;
    Ok(())
}

/// The device buffers of `dsa_sparse_bwd_kv`: the layer's Q, K, V, the upstream gradient, the forward's LSE and `D`;
/// dK and dV (written), the token-level transpose and the sequence offsets.
pub(crate) struct DsaSparseBwdKvBuffers<'a, T> {
    pub q: &'a CudaSlice<T>,
    pub k: &'a CudaSlice<T>,
    pub v: &'a CudaSlice<T>,
    pub d_out: &'a CudaSlice<T>,
    pub lse: &'a CudaSlice<f32>,
    pub delta: &'a CudaSlice<f32>,
    pub dk: &'a mut CudaSlice<T>,
    pub dv: &'a mut CudaSlice<T>,
    pub csr_offsets: &'a CudaSlice<i32>,
    pub csr_tokens: &'a CudaSlice<i32>,
    pub csr_masks: &'a CudaSlice<u64>,
    pub cu_q: &'a CudaSlice<i32>,
    pub cu_k: &'a CudaSlice<i32>,
}

/// Launches `dsa_sparse_bwd_kv`: the deterministic mode's dK and dV, one CTA per KV tile of 64 keys.
///
/// Preconditions, established by `dsa::sparse_backward`: `func` is the kernel of the module of
/// `launch_dsa_sparse_bwd`; the tensors as there, `dk` K's elements and `dv` V's; the transpose as `launch_dsa_csr`
/// and the scan built it for `kv_tiles`; the group is at most 64 heads; `cfg`'s grid is `(kv_tiles, Hkv ·
/// column_chunks, B)` of 128 threads with the dynamic shared memory of `launch_dsa_sparse_bwd`'s layout, which the
/// function attribute allows.
pub(crate) fn launch_dsa_sparse_bwd_kv<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    b: DsaSparseBwdKvBuffers<'_, T>,
    params: &DsaSparseParams,
    kv_tiles: i32,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(b.q).arg(b.k).arg(b.v).arg(b.d_out).arg(b.lse).arg(b.delta).arg(b.dk).arg(b.dv);
    builder.arg(b.csr_offsets).arg(b.csr_tokens).arg(b.csr_masks).arg(b.cu_q).arg(b.cu_k).arg(params).arg(&kv_tiles);
    // SAFETY: the arguments match `dsa_sparse_bwd_kv(const elem_t* q, k, v, d_out, const float* lse, delta, elem_t*
    // dk_out, dv_out, const int* csr_offsets, csr_tokens, const unsigned long long* csr_masks, const int* cu_q, cu_k,
    // const DsaSparseParams, int kv_tiles)` in order and type; every index lies in the buffers the caller sized (see
    // above); the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(dsa_sparse_bwd_kv)", e))?;
    Ok(())
}

/// Launches `dsa_dkv_finalize`: dK = round_T(α̂ · acc_k), dV = round_T(acc_v) of every key.
///
/// Preconditions, established by `dsa::sparse_backward`: `func` is the kernel of the module of
/// `launch_dsa_sparse_bwd`; `dk_acc` and `dk` hold K's elements, `dv_acc` and `dv` V's; `cfg`'s grid is
/// `(⌈longest · ⌈max(d, dv)/2⌉ / 128⌉, Hkv, B)` of 128 threads.
pub(crate) fn launch_dsa_dkv_finalize<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (dk_acc, dv_acc): (&CudaSlice<f32>, &CudaSlice<f32>),
    (dk, dv): (&mut CudaSlice<T>, &mut CudaSlice<T>),
    (cu_q, cu_k): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &DsaSparseParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(dk_acc).arg(dv_acc).arg(dk).arg(dv).arg(cu_q).arg(cu_k).arg(params);
    // SAFETY: the arguments match `dsa_dkv_finalize(const float* dk_acc, dv_acc, elem_t* dk, dv, const int* cu_q,
    // cu_k, const DsaSparseParams)` in order and type; every index lies in the buffers the caller sized (see above);
    // the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(dsa_dkv_finalize)", e))?;
    Ok(())
}

/// Launches `nsa_gate_combine` (gpu/kernels/nsa_gates.cu, `func`) on `stream`: `o = Σ_b σ(x_b) o_b` per row.
///
/// Preconditions, established by `nsa::gates`: `func` is `nsa_gate_combine` compiled for the element type `T`; the
/// three branch outputs and `o` hold `params.rows · params.flash.dv` elements each, `logits` `params.rows · 3`;
/// `params.flash.dv` is a multiple of 8 up to 256; `cfg`'s grid covers `params.rows` rows at four per block of 128
/// threads.
pub(crate) fn launch_nsa_gate_combine<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    branches: [&CudaSlice<T>; 3],
    logits: &CudaSlice<T>,
    o: &mut CudaSlice<T>,
    params: &NsaParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(branches[0]).arg(branches[1]).arg(branches[2]).arg(logits).arg(o).arg(params);
    // SAFETY: the arguments match `nsa_gate_combine(const elem_t* o_cmp, const elem_t* o_slc, const elem_t* o_win,
    // const elem_t* logits, elem_t* o, const NsaParams)` in order and type; every index the kernel forms lies in the
    // buffers the caller sized (see above); the buffers are borrowed for this call and their use is recorded on
    // `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(nsa_gate_combine)", e))?;
    Ok(())
}

/// Launches `nsa_gate_backward` (gpu/kernels/nsa_gates.cu, `func`) on `stream`: `dO_b = σ(x_b) dO` and
/// `dx_b = σ(x_b) σ(−x_b) ⟨dO, o_b⟩` per row.
///
/// Preconditions, as for [`launch_nsa_gate_combine`], and: `d_out` and the three `d_branches` hold
/// `params.rows · params.flash.dv` elements each, `d_logits` `params.rows · 3` f32.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_nsa_gate_backward<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    branches: [&CudaSlice<T>; 3],
    (logits, d_out): (&CudaSlice<T>, &CudaSlice<T>),
    d_branches: [&mut CudaSlice<T>; 3],
    d_logits: &mut CudaSlice<f32>,
    params: &NsaParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(branches[0]).arg(branches[1]).arg(branches[2]).arg(logits).arg(d_out);
    let [d_cmp, d_slc, d_win] = d_branches;
    builder.arg(d_cmp).arg(d_slc).arg(d_win).arg(d_logits).arg(params);
    // SAFETY: the arguments match `nsa_gate_backward(const elem_t* o_cmp, const elem_t* o_slc, const elem_t* o_win,
    // const elem_t* logits, const elem_t* d_out, elem_t* d_cmp, elem_t* d_slc, elem_t* d_win, float* d_logits, const
    // NsaParams)` in order and type; every index the kernel forms lies in the buffers the caller sized (see above);
    // the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(nsa_gate_backward)", e))?;
    Ok(())
}

/// Launches `nsa_compress_keys` or `nsa_compress_values` (gpu/kernels/nsa_compress.cu, `func`) on `stream`: the
/// compressed rows of every complete window of `x` into `out`; or their transposes `nsa_compress_keys_backward` and
/// `nsa_compress_values_backward`: every token row of `out` from the windows of `x` that hold it.
///
/// Preconditions, established by `nsa::compress`: `func` is one of the four, compiled for the element type `T`; the
/// token-side buffer (`x` forward, `out` backward) holds the spec's K (the keys' kernels) or V (the values'), which the
/// strides and lengths of `params.flash`, or the validated `cu_k`, describe; `cu_windows` holds each sequence's first
/// window in the packed layout (one entry per sequence and one more) and `params.dense_windows` the windows of a dense
/// problem, none past the sequence's keys; the window-side buffer (`out` forward, `x` backward) holds the compressed
/// layout's elements (`nsa::compress::compressed_shape`); `weights` holds `2 · params.compress_len` f64; `cfg`'s grid
/// is `(window groups, n_heads_kv, B)` forward or `(token groups, n_heads_kv, B)` backward, with 128 threads per block
/// and enough groups for the longest sequence.
pub(crate) fn launch_nsa_compress<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (x, out): (&CudaSlice<T>, &mut CudaSlice<T>),
    weights: &CudaSlice<f64>,
    (cu_k, cu_windows): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &NsaParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(x).arg(out).arg(weights).arg(cu_k).arg(cu_windows).arg(params);
    // SAFETY: the arguments match the four kernels (`const elem_t*, elem_t*, const double* weights, const int* cu_k,
    // const int* cu_windows, const NsaParams`) in order and type; every index the
    // kernel forms lies in the buffers the caller sized (see above); the buffers are borrowed for this call and their
    // use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(nsa_compress_*)", e))?;
    Ok(())
}

/// Launches `nsa_compress_{keys,values}_map_backward` (gpu/kernels/nsa_compress.cu, `func`) on `stream`: the learned
/// compression matrix's gradient `[l·cols, cols]` f32 into `d_map`, summed over `n_sequences` sequences and every KV
/// head.
///
/// Preconditions, established by `nsa::compress::compress_map_gradient_device`: `func` is compiled for the element
/// type `T`; `x` holds the operand (K or V) and `dx_cmp` its compressed gradient as `params` and the validated
/// `cu_k`, `cu_windows` describe them; `d_map` holds at least `l·cols²` f32; the grid covers the `l·cols` rows at
/// `128 / (cols / 8)` rows per CTA.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_nsa_compress_map_gradient<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (x, dx_cmp): (&CudaSlice<T>, &CudaSlice<T>),
    d_map: &mut CudaSlice<f32>,
    (cu_k, cu_windows): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &NsaParams,
    n_sequences: i32,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(x).arg(dx_cmp).arg(d_map).arg(cu_k).arg(cu_windows).arg(params).arg(&n_sequences);
    // SAFETY: the arguments match the two kernels (`const elem_t* x, const elem_t* dx_cmp, float* dw, const int* cu_k,
    // const int* cu_windows, const NsaParams, const int n_sequences`) in order and type; every index the kernel forms
    // lies in the buffers the caller sized (see above); the buffers are borrowed for this call and their use is
    // recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(nsa_compress_*_map_backward)", e))?;
    Ok(())
}

/// Launches `nsa_block_scores` (gpu/kernels/nsa_select.cu, `func`) on `stream`: each token's selection block scores
/// of every KV head, added into `scores`.
///
/// Preconditions, established by `nsa::select`: `func` is `nsa_block_scores` compiled for the element type `T` and
/// the padded head dim `NSA_D_PAD ≥ params.flash.d`; `q` holds the layer's Q, `k_cmp` the compressed keys and `lse`
/// the compressed attention's LSE, all as `params.flash` (or the validated `cu_q`, `cu_k`) describes them; `scores`
/// holds `params.token_rows · n_heads_kv · n_blocks` f32 set to 0, `n_blocks` at least every sequence's selection
/// blocks; `cfg`'s grid is `(token groups of tokens_per_cta, n_heads_kv, B)` with 128 threads and the shared memory
/// the kernel's tiles need.
pub(crate) fn launch_nsa_block_scores<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (q, k_cmp, lse): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<f32>),
    scores: &mut CudaSlice<f32>,
    (cu_q, cu_k): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &NsaSelectParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(q).arg(k_cmp).arg(lse).arg(scores).arg(cu_q).arg(cu_k).arg(params);
    // SAFETY: the arguments match `nsa_block_scores(const elem_t* q, const elem_t* k_cmp, const float* lse, float*
    // scores, const int* cu_q, const int* cu_k, const NsaSelectParams)` in order and type; every index the kernel
    // forms lies in the buffers the caller sized (see above); the buffers are borrowed for this call and their use is
    // recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(nsa_block_scores)", e))?;
    Ok(())
}

/// Launches `nsa_top_n` (gpu/kernels/nsa_select.cu, `func`) on `stream`: each token's list of every KV head from the
/// block scores.
///
/// Preconditions, established by `nsa::select`: `func` is `nsa_top_n`; `scores` holds `params.token_rows ·
/// n_heads_kv · n_blocks` f32, `lists` `params.token_rows · n_heads_kv · n_selected` i32 with `n_selected ≤ 32`;
/// `cu_q`, `cu_k` are the validated offsets of `params.flash` (or unused when dense); `cfg`'s grid is `(token groups
/// of 4, n_heads_kv, B)` with 128 threads.
pub(crate) fn launch_nsa_top_n(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    scores: &CudaSlice<f32>,
    lists: &mut CudaSlice<i32>,
    (cu_q, cu_k): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &NsaSelectParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(scores).arg(lists).arg(cu_q).arg(cu_k).arg(params);
    // SAFETY: the arguments match `nsa_top_n(const float* scores, int* lists, const int* cu_q, const int* cu_k, const
    // NsaSelectParams)` in order and type; every index the kernel forms lies in the buffers the caller sized (see
    // above); the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(nsa_top_n)", e))?;
    Ok(())
}

/// Launches `nsa_selected_fwd` (gpu/kernels/nsa_selected.cu, `func`) on `stream`: the selection branch's output and
/// LSE of every token and query head from the token's block list.
///
/// Preconditions, established by `nsa::selected`: `func` is `nsa_selected_fwd` compiled for the element type `T` and
/// padded head dims `HEAD_DIM_PAD ≥ params.flash.d`, `HEAD_DIM_V_PAD ≥ params.flash.dv`; `q`, `k`, `v`, `o` and `lse`
/// hold the layer's Q, K, V, O and LSE as `params.flash` (or the validated `cu_q`, `cu_k`) describes them; `lists`
/// holds `params.token_rows · n_heads_kv · n_selected` i32 (any values: the kernel ends a list at its first entry
/// that does not rise or lies outside the sequence's blocks); `cfg`'s grid is `(token groups of tokens_per_cta,
/// n_heads_kv, B)` with 128 threads and the shared memory of the tiles and of `tokens_per_cta · (n_selected + 1)`
/// list entries.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_nsa_selected_fwd<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (q, k, v): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    (o, lse): (&mut CudaSlice<T>, &mut CudaSlice<f32>),
    lists: &CudaSlice<i32>,
    (cu_q, cu_k): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &NsaSelectParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(q).arg(k).arg(v).arg(o).arg(lse).arg(lists).arg(cu_q).arg(cu_k).arg(params);
    // SAFETY: the arguments match `nsa_selected_fwd(const elem_t* q, const elem_t* k, const elem_t* v, elem_t* o,
    // float* lse, const int* lists, const int* cu_q, const int* cu_k, const NsaSelectParams)` in order and type; every
    // index the kernel forms lies in the buffers the caller sized (see above); the buffers are borrowed for this call
    // and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(nsa_selected_fwd)", e))?;
    Ok(())
}

/// Launches `nsa_csr_count` (`tokens` is `None`: adds each list entry to its CSR row's count in `offsets`, which the
/// caller zeroed) or `nsa_csr_fill` (reads the scanned offsets, writes every row's tokens) of
/// `gpu/kernels/nsa_selected_bwd.cu`.
///
/// Preconditions, established by `nsa::selected_backward`: `func` is the kernel the arm names; `lists` holds the
/// `[token rows, Hkv, n]` i32 lists `params` describes; `offsets` holds `B · Hkv · n_blocks + 1` i32; `tokens` holds
/// `token rows · Hkv · n` i32 (the most entries the count can reach); `cu_q` the validated offsets of a varlen layout;
/// `cfg`'s grid is `(⌈max len / 128⌉, Hkv, B)` (count) or `(⌈n_blocks / 4⌉, Hkv, B)` (fill) of 128 threads.
pub(crate) fn launch_nsa_csr(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    lists: &CudaSlice<i32>,
    offsets: &mut CudaSlice<i32>,
    tokens: Option<&mut CudaSlice<i32>>,
    cu_q: &CudaSlice<i32>,
    params: &NsaSelectParams,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(lists);
    let call = match tokens {
        None => {
            builder.arg(offsets);
            "cuLaunchKernel(nsa_csr_count)"
        }
        Some(tokens) => {
            builder.arg(&*offsets).arg(tokens);
            "cuLaunchKernel(nsa_csr_fill)"
        }
    };
    builder.arg(cu_q).arg(params);
    // SAFETY: the arguments match `nsa_csr_count(const int*, int*, const int* cu_q, const NsaSelectParams)` and
    // `nsa_csr_fill(const int*, const int*, int*, const int* cu_q, const NsaSelectParams)` in order and type; every
    // index the kernels form lies in the buffers the caller sized (see above: the fill writes exactly the counted
    // entries, both kernels reading the same prefix of each list); the buffers are borrowed for this call and their
    // use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver(call, e))?;
    Ok(())
}

/// The device operands of `nsa_selected_bwd_kv` (`gpu/kernels/nsa_selected_bwd.cu`): the layer's inputs, the
/// forward's LSE and the preprocess's `D`, the outputs dK and dV, the dQ workspaces (`dq_acc` zeroed f32 of Q's size
/// for dq_mode 1, `dq_part` zeroed f32 of Q's size per slot for dq_mode 2; a one-element placeholder when unused),
/// the lists and their CSR transpose.
pub(crate) struct NsaSelectedBwdBuffers<'a, T> {
    pub q: &'a CudaSlice<T>,
    pub k: &'a CudaSlice<T>,
    pub v: &'a CudaSlice<T>,
    pub d_out: &'a CudaSlice<T>,
    pub lse: &'a CudaSlice<f32>,
    pub delta: &'a CudaSlice<f32>,
    pub dk: &'a mut CudaSlice<T>,
    pub dv: &'a mut CudaSlice<T>,
    pub dq_acc: &'a mut CudaSlice<f32>,
    pub dq_part: &'a mut CudaSlice<f32>,
    pub dkv_part: &'a mut CudaSlice<f32>,
    pub lists: &'a CudaSlice<i32>,
    pub csr_offsets: &'a CudaSlice<i32>,
    pub csr_tokens: &'a CudaSlice<i32>,
    pub seg_offsets: &'a CudaSlice<i32>,
    pub cu_q: &'a CudaSlice<i32>,
    pub cu_k: &'a CudaSlice<i32>,
}

/// The scalars of `nsa_selected_bwd_kv` beside `NsaSelectParams`: the dQ partials' stride and mode (1 atomic,
/// 2 partials), the column chunks per KV head, the tokens per segment of a CSR row, and the dK/dV workspace's slots.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NsaSelectedBwdScalars {
    pub part_stride: i64,
    pub dq_mode: i32,
    pub n_chunks: i32,
    pub seg_tokens: i32,
    pub dkv_slots: i64,
}

/// Launches `nsa_selected_bwd_kv` with `dq_mode` (1 atomic, 2 partials `part_stride` elements apart) and `n_chunks`
/// column chunks per KV head.
///
/// Preconditions, established by `nsa::selected_backward`: `func` is the kernel, compiled from `common.cuh`,
/// `flash_bwd.cu` and `nsa_selected_bwd.cu` for `T` and the padded head dims of `params.flash`; every buffer holds its
/// spec shape (Q, K, V, O-shaped `d_out`, LSE-shaped `lse` and `delta`), the workspaces as
/// [`NsaSelectedBwdBuffers`] says (`⌈l'/64⌉ · n` slots for mode 2), the CSR as `launch_nsa_csr` built it and its
/// segment offsets as `launch_nsa_csr_segments` and the scan built them; `cfg`'s grid is `(most segments per (sequence,
/// KV head) · ⌈l'/64⌉, Hkv · n_chunks, B)` of 128 threads with the dynamic shared memory of `bwd_kv`'s layout, which
/// the function attribute allows.
pub(crate) fn launch_nsa_selected_bwd_kv<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    b: NsaSelectedBwdBuffers<'_, T>,
    params: &NsaSelectParams,
    x: NsaSelectedBwdScalars,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(b.q).arg(b.k).arg(b.v).arg(b.d_out).arg(b.lse).arg(b.delta);
    builder.arg(b.dk).arg(b.dv).arg(b.dq_acc).arg(b.dq_part).arg(b.dkv_part);
    builder.arg(b.lists).arg(b.csr_offsets).arg(b.csr_tokens).arg(b.seg_offsets).arg(b.cu_q).arg(b.cu_k);
    builder.arg(params).arg(&x.part_stride).arg(&x.dq_mode).arg(&x.n_chunks).arg(&x.seg_tokens).arg(&x.dkv_slots);
    // SAFETY: the arguments match `nsa_selected_bwd_kv(const elem_t* q, k, v, d_out, const float* lse, delta,
    // elem_t* dk, dv, float* dq_acc, dq_part, dkv_part, const int* lists, csr_offsets, csr_tokens, seg_offsets, cu_q,
    // cu_k, const NsaSelectParams, long long part_stride, int dq_mode, int n_chunks, int seg_tokens, long long
    // dkv_slots)` in order and type (`T` for `elem_t`); every index the kernel forms lies in the buffers the caller
    // sized (see above: `dkv_part` holds `dkv_slots · 64 · (d + dv)` f32 and the grid covers at most `dkv_slots`
    // slots); the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(nsa_selected_bwd_kv)", e))?;
    Ok(())
}

/// Launches `nsa_dq_finalize_partials`: dQ from `slots` partials `part_stride` elements apart.
///
/// Preconditions, established by `nsa::selected_backward`: `func` is the kernel of the module above; `dq_part` holds
/// `slots · part_stride` f32, `dq` Q's elements (`part_stride`); `cfg`'s grid is `(⌈max len · d/2 / 128⌉, Hq, B)` of
/// 128 threads.
pub(crate) fn launch_nsa_dq_finalize_partials<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (dq_part, dq): (&CudaSlice<f32>, &mut CudaSlice<T>),
    cu_q: &CudaSlice<i32>,
    params: &NsaSelectParams,
    (part_stride, slots): (i64, i32),
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(dq_part).arg(dq).arg(cu_q).arg(params).arg(&part_stride).arg(&slots);
    // SAFETY: the arguments match `nsa_dq_finalize_partials(const float*, elem_t*, const int* cu_q, const
    // NsaSelectParams, long long part_stride, int slots)` in order and type; every index lies in the buffers the
    // caller sized (see above); the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(nsa_dq_finalize_partials)", e))?;
    Ok(())
}

/// Launches `nsa_csr_segments`: each CSR row's segment count (of at most `seg_tokens` tokens) into `seg_offsets`.
///
/// Preconditions, established by `nsa::selected_backward`: `func` is the kernel; `csr_offsets` holds the scanned
/// offsets of `B · Hkv · n_blocks` rows, `seg_offsets` as many entries plus one; `cfg`'s grid is
/// `(⌈n_blocks / 128⌉, Hkv, B)` of 128 threads.
pub(crate) fn launch_nsa_csr_segments(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (csr_offsets, seg_offsets): (&CudaSlice<i32>, &mut CudaSlice<i32>),
    cu_q: &CudaSlice<i32>,
    params: &NsaSelectParams,
    seg_tokens: i32,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(csr_offsets).arg(seg_offsets).arg(cu_q).arg(params).arg(&seg_tokens);
    // SAFETY: the arguments match `nsa_csr_segments(const int*, int*, const int* cu_q, const NsaSelectParams, int)` in
    // order and type; every index lies in the buffers the caller sized (see above); the buffers are borrowed for this
    // call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(nsa_csr_segments)", e))?;
    Ok(())
}

/// Launches `nsa_dkv_finalize`: dK and dV of the blocks of several segments from the workspace's slots.
///
/// Preconditions, established by `nsa::selected_backward`: `func` is the kernel of the module of
/// `launch_nsa_selected_bwd_kv`, which filled `dkv_part` (`dkv_slots · 64 · (d + dv)` f32) for the segment offsets
/// `seg_offsets`; `dk`, `dv` hold K's and V's elements; `cfg`'s grid is `(n_blocks · ⌈l'/64⌉, Hkv, B)` of 128 threads.
pub(crate) fn launch_nsa_dkv_finalize<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    (dkv_part, dk, dv): (&CudaSlice<f32>, &mut CudaSlice<T>, &mut CudaSlice<T>),
    (seg_offsets, cu_q): (&CudaSlice<i32>, &CudaSlice<i32>),
    params: &NsaSelectParams,
    dkv_slots: i64,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(dkv_part).arg(dk).arg(dv).arg(seg_offsets).arg(cu_q).arg(params).arg(&dkv_slots);
    // SAFETY: the arguments match `nsa_dkv_finalize(const float*, elem_t* dk, elem_t* dv, const int* seg_offsets,
    // const int* cu_q, const NsaSelectParams, long long dkv_slots)` in order and type (`T` for `elem_t`); every index
    // lies in the buffers the caller sized (see above); the buffers are borrowed for this call and their use is
    // recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(nsa_dkv_finalize)", e))?;
    Ok(())
}

/// Launches `nsa_branch_sum` (gpu/kernels/nsa_gates.cu, `func`) on `stream`: `out[i] = fl_T(fl32(fl32(cmp[i] +
/// slc[i]) + win[i]))` for `i < n`, the layer's sum of its three branches' gradients.
///
/// Preconditions, established by `nsa::layer`: `func` is the kernel of a module compiled with `T`'s define; `cmp`,
/// `slc`, `win` and `out` hold at least `n` elements each; `cfg`'s block is 256 threads (the kernel's
/// `BRANCH_SUM_THREADS`; its grid-stride loop covers `n` with any grid).
pub(crate) fn launch_nsa_branch_sum<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    [cmp, slc, win]: [&CudaSlice<T>; 3],
    out: &mut CudaSlice<T>,
    n: i64,
) -> Result<(), GpuError> {
    let mut builder = stream.launch_builder(func);
    builder.arg(cmp).arg(slc).arg(win).arg(out).arg(&n);
    // SAFETY: the arguments match `nsa_branch_sum(const elem_t* cmp, const elem_t* slc, const elem_t* win, elem_t* out,
    // long long n)` in order and type (`T` for `elem_t`); the kernel reads and writes indices below `n` only, which
    // every buffer holds (see above); the buffers are borrowed for this call and their use is recorded on `stream`.
    unsafe { builder.launch(cfg) }.map_err(|e| GpuError::driver("cuLaunchKernel(nsa_branch_sum)", e))?;
    Ok(())
}
