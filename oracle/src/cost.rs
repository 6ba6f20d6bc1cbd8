//! The cost model of the seeds (E1d): arithmetic and HBM traffic of a dense three-kernel
//! schedule versus FlashAttention, and the token count of the video example (E11).

/// Shape and element size of one attention head for the cost model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CostShape {
    /// Query length.
    pub len_q: u64,
    /// Key length.
    pub len_k: u64,
    /// Query/key head dim.
    pub head_dim: u64,
    /// Value head dim.
    pub head_dim_v: u64,
    /// Bytes per element of Q, K, V, O and of the materialized S and P (2 for bf16).
    pub element_bytes: u64,
}

/// HBM traffic and arithmetic of one head under the two schedules of E1d.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DenseCost {
    /// Multiply-adds counted as 2 FLOP: `2·Lq·Lk·d + 2·Lq·Lk·dv` (same for both schedules).
    pub flops: u64,
    /// Bytes of Q, K, V read and O written once (compulsory traffic, both schedules).
    pub io_bytes: u64,
    /// Bytes of the intermediate `Lq×Lk` matrices the three-kernel schedule moves:
    /// write S, read S, write P, read P (`4·Lq·Lk` elements).
    pub intermediate_bytes: u64,
    /// Bytes of the f32 row statistics (LSE) FlashAttention saves for the backward pass.
    pub row_stat_bytes: u64,
    /// Total bytes of the three-kernel schedule: `io_bytes + intermediate_bytes`.
    pub three_kernel_bytes: u64,
    /// Total bytes of FlashAttention: `io_bytes + row_stat_bytes`.
    pub flash_bytes: u64,
}

/// E1d for one head.
pub fn dense_cost(shape: CostShape) -> DenseCost {
    let CostShape { len_q, len_k, head_dim, head_dim_v, element_bytes } = shape;
    let flops = 2 * len_q * len_k * head_dim + 2 * len_q * len_k * head_dim_v;
    let io_bytes = element_bytes * (len_q * head_dim + len_k * head_dim + len_k * head_dim_v + len_q * head_dim_v);
    let intermediate_bytes = 4 * len_q * len_k * element_bytes;
    let row_stat_bytes = 4 * len_q;
    DenseCost {
        flops,
        io_bytes,
        intermediate_bytes,
        row_stat_bytes,
        three_kernel_bytes: io_bytes + intermediate_bytes,
        flash_bytes: io_bytes + row_stat_bytes,
    }
}

/// A video cut into spatio-temporal patches (the E11 worked example).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VideoTokenizer {
    /// Clip length in seconds.
    pub seconds: u64,
    /// Frames per second.
    pub fps: u64,
    /// Frame width in pixels.
    pub width: u64,
    /// Frame height in pixels.
    pub height: u64,
    /// Square patch side in pixels.
    pub patch: u64,
    /// Frames per tubelet.
    pub tubelet: u64,
}

impl VideoTokenizer {
    /// `(seconds·fps / tubelet) · (width/patch) · (height/patch)`, counting whole tubelets and
    /// whole patches only.
    pub fn tokens(&self) -> u64 {
        (self.seconds * self.fps / self.tubelet) * (self.width / self.patch) * (self.height / self.patch)
    }
}
