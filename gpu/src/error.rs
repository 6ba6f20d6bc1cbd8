//! Typed errors of the GPU crate: every way a compile or launch can fail, with the argument or log that explains it.
//! Both error types live here, so that every module can name them without importing the crate root.

/// Why no CUDA device can be used on this machine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuUnavailable {
    /// The CUDA driver library (`libcuda.so` / `nvcuda.dll`) could not be loaded.
    #[error("no CUDA driver library (libcuda) could be loaded")]
    NoDriverLibrary,
    /// The driver library loaded, but it reported no usable device 0.
    #[error("no usable CUDA device: the driver says {0}")]
    NoDevice(String),
    /// cudarc panicked while talking to the driver (for example a symbol missing from an old driver).
    #[error("the CUDA driver could not be used: {0}")]
    DriverPanicked(String),
}

/// Why a GPU operation failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuError {
    /// No usable CUDA device or driver.
    #[error(transparent)]
    Unavailable(#[from] GpuUnavailable),
    /// The NVRTC library could not be loaded (`libnvrtc.so.13` not on the loader path).
    #[error("the NVRTC library (libnvrtc) could not be loaded; put CUDA's lib64 on LD_LIBRARY_PATH")]
    NoNvrtc,
    /// NVRTC rejected the kernel source; `log` is NVRTC's own program log.
    #[error("NVRTC could not compile `{kernel}` with {options:?}: {status}\n{log}")]
    Compile {
        /// The kernel (source file stem).
        kernel: &'static str,
        /// The exact options passed to NVRTC.
        options: Vec<String>,
        /// NVRTC's status code.
        status: String,
        /// NVRTC's program log.
        log: String,
    },
    /// A CUDA driver call failed (module load, allocation, copy, launch, synchronize).
    #[error("CUDA driver call `{call}` failed: {message}")]
    Driver {
        /// Which call.
        call: &'static str,
        /// The driver's error.
        message: String,
    },
    /// The device cannot run this kernel: its compute capability is below the one the kernel's instructions need
    /// (`compile::check_device_supports`, asked before NVRTC is called).
    #[error(
        "`{kernel}` needs compute capability {}.{} ({instructions}); the device has {}.{}",
        needs.0,
        needs.1,
        have.0,
        have.1
    )]
    UnsupportedDevice {
        /// The kernel (source file stem).
        kernel: &'static str,
        /// The compute capability (major, minor) the kernel needs: the lowest that has every instruction it uses, or,
        /// for an architecture-specific kernel (sm_90a), the only one.
        needs: (i32, i32),
        /// The instructions that set `needs` (and say whether later devices have them).
        instructions: &'static str,
        /// The device's compute capability (major, minor).
        have: (i32, i32),
    },
    /// The problem is valid but outside what the kernel implements (a predicate mask, a head dim not a multiple of
    /// 8 or above 256, ...).
    #[error("`{argument}` is not supported by the kernel: {reason}")]
    Unsupported {
        /// The argument.
        argument: &'static str,
        /// Why.
        reason: String,
    },
    /// The spec itself is invalid (the oracle's validation).
    #[error(transparent)]
    Spec(#[from] attnproof_oracle::OracleError),
    /// A tensor has the wrong shape.
    #[error("`{argument}` has shape {actual:?}, expected {expected:?}")]
    Shape {
        /// The argument.
        argument: &'static str,
        /// Expected shape.
        expected: Vec<usize>,
        /// Actual shape.
        actual: Vec<usize>,
    },
    /// A host tensor is not in standard (row-major, contiguous) layout.
    #[error("`{argument}` is not contiguous in row-major order (strides {strides:?})")]
    Stride {
        /// The argument.
        argument: &'static str,
        /// Its strides, in elements.
        strides: Vec<isize>,
    },
    /// A device buffer is shorter than the tensor it must hold.
    #[error("device buffer `{argument}` holds {actual} elements, the problem needs at least {needed}")]
    BufferTooSmall {
        /// The argument.
        argument: &'static str,
        /// Elements needed.
        needed: usize,
        /// Elements available.
        actual: usize,
    },
    /// A block list of the block-sparse kernels breaks the list convention (E14).
    #[error("block list entry {position:?} (sequence, list head, query block, slot): {fault}")]
    BlockList {
        /// Where: sequence, list head, query block, slot (the slot is the list's width for [`BlockListFault::TooWide`]).
        position: [usize; 4],
        /// What is wrong.
        fault: BlockListFault,
    },
    /// A size does not fit the kernel's 32-bit index arguments.
    #[error("`{argument}` = {value} does not fit the kernel's 32-bit arguments")]
    TooLarge {
        /// The argument.
        argument: &'static str,
        /// Its value.
        value: usize,
    },
}

/// How a block list breaks the convention: per query block, an ascending prefix of distinct key-block indices in
/// `0..key_blocks`, then `−1` to the end of the list, and no list wider than the key blocks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockListFault {
    /// An index outside `0..key_blocks` (a negative other than the `−1` pad included), or any index in a query block
    /// past its sequence's own query blocks (`key_blocks` is 0 there).
    #[error("index {index} is outside 0..{key_blocks}")]
    OutOfRange {
        /// The entry.
        index: i32,
        /// The sequence's key blocks.
        key_blocks: usize,
    },
    /// The same index twice in a row.
    #[error("index {index} is listed twice")]
    Duplicate {
        /// The entry.
        index: i32,
    },
    /// An index below the one before it.
    #[error("index {index} follows {previous}: the list is not ascending")]
    NotAscending {
        /// The entry.
        index: i32,
        /// The entry before it.
        previous: i32,
    },
    /// A valid index after a `−1` pad.
    #[error("index {index} follows a -1 pad")]
    AfterPad {
        /// The entry.
        index: i32,
    },
    /// More slots per list than the longest sequence has key blocks.
    #[error("lists are {width} wide, more than the {key_blocks} key blocks of the longest sequence")]
    TooWide {
        /// The lists' width.
        width: usize,
        /// The most key blocks of any sequence.
        key_blocks: usize,
    },
}

impl GpuError {
    /// A driver error from cudarc, tagged with the call that produced it.
    pub(crate) fn driver(call: &'static str, err: impl std::fmt::Display) -> Self {
        GpuError::Driver { call, message: err.to_string() }
    }
}
