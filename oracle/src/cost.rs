//! The cost model of the seeds: arithmetic and HBM traffic of a dense three-kernel schedule
//! versus FlashAttention (E1d), the token count of the video example (E11), a block-sparse tile
//! schedule (E14), NSA's selected-block tile (E31) and the sizes of NSA's materialized score
//! tensors (E32). All counts are exact integers (`u64`); only ratios are `f64`.

use crate::error::OracleError;

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

/// A block-sparse schedule (E14): `n_Q` query tiles of `query_tile` rows, `n_K` key tiles of
/// `key_tile` keys, each query tile visiting `r` of the `n_K` key tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSparseShape {
    /// Number of query tiles `n_Q`.
    pub n_query_tiles: u64,
    /// Number of key tiles `n_K`.
    pub n_key_tiles: u64,
    /// Key tiles visited per query tile, `r ≤ n_K`.
    pub tiles_per_query_tile: u64,
    /// Query rows per tile.
    pub query_tile: u64,
    /// Keys per tile.
    pub key_tile: u64,
    /// Query/key head dim.
    pub head_dim: u64,
    /// Value head dim.
    pub head_dim_v: u64,
    /// Bytes per element of K and V.
    pub element_bytes: u64,
}

/// Tile pairs, arithmetic and K/V traffic of a block-sparse schedule against the dense one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSparseCost {
    /// Tile pairs of the dense schedule, `n_Q·n_K`.
    pub dense_tile_pairs: u64,
    /// Tile pairs visited, `n_Q·r`.
    pub visited_tile_pairs: u64,
    /// FLOPs of one tile pair, `2·B_q·B_k·(d + dv)` (scores and `P V`, multiply-add = 2).
    pub flops_per_pair: u64,
    /// FLOPs of the dense schedule.
    pub dense_flops: u64,
    /// FLOPs of the visited pairs.
    pub sparse_flops: u64,
    /// K/V bytes of one tile, `B_k·(d + dv)·element_bytes`, loaded once per visited pair.
    pub kv_bytes_per_pair: u64,
    /// K/V bytes loaded by the dense schedule.
    pub dense_kv_bytes: u64,
    /// K/V bytes loaded by the block-sparse schedule.
    pub sparse_kv_bytes: u64,
}

/// E14: the cost of visiting `r` of `n_K` key tiles per query tile. Refuses `r > n_K`.
pub fn block_sparse_cost(shape: BlockSparseShape) -> Result<BlockSparseCost, OracleError> {
    let BlockSparseShape {
        n_query_tiles,
        n_key_tiles,
        tiles_per_query_tile,
        query_tile,
        key_tile,
        head_dim,
        head_dim_v,
        element_bytes,
    } = shape;
    if tiles_per_query_tile > n_key_tiles {
        return Err(OracleError::InvalidParameter {
            argument: "tiles_per_query_tile",
            reason: format!("{tiles_per_query_tile} exceeds the {n_key_tiles} key tiles"),
        });
    }
    let dense_tile_pairs = n_query_tiles * n_key_tiles;
    let visited_tile_pairs = n_query_tiles * tiles_per_query_tile;
    let flops_per_pair = 2 * query_tile * key_tile * (head_dim + head_dim_v);
    let kv_bytes_per_pair = key_tile * (head_dim + head_dim_v) * element_bytes;
    Ok(BlockSparseCost {
        dense_tile_pairs,
        visited_tile_pairs,
        flops_per_pair,
        dense_flops: dense_tile_pairs * flops_per_pair,
        sparse_flops: visited_tile_pairs * flops_per_pair,
        kv_bytes_per_pair,
        dense_kv_bytes: dense_tile_pairs * kv_bytes_per_pair,
        sparse_kv_bytes: visited_tile_pairs * kv_bytes_per_pair,
    })
}

/// NSA's selected-block tile (E31): the query heads of one GQA group against one selected block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelectedTileShape {
    /// Query heads sharing the block (one GQA group; paper: 16).
    pub heads: u64,
    /// Tokens per selection block `l'` (paper: 64).
    pub block_tokens: u64,
    /// Key head dim `d_k` (paper: 192).
    pub head_dim_k: u64,
    /// Value head dim `d_v` (paper: 128).
    pub head_dim_v: u64,
    /// Bytes per K/V element (bf16: 2).
    pub element_bytes: u64,
    /// Blocks per full selection `n` (paper: 16).
    pub n_selected: u64,
}

impl Default for SelectedTileShape {
    /// The figures of E31.
    fn default() -> Self {
        SelectedTileShape {
            heads: 16,
            block_tokens: 64,
            head_dim_k: 192,
            head_dim_v: 128,
            element_bytes: 2,
            n_selected: 16,
        }
    }
}

/// Arithmetic and K/V payload of one selected-block tile and of a full selection (E31).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelectedTileCost {
    /// `2·heads·l'·(d_k + d_v)` (655,360 for E31).
    pub flops: u64,
    /// `l'·(d_k + d_v)·element_bytes` (40,960 B for E31).
    pub kv_payload_bytes: u64,
    /// K/V bytes gathered for one query group's full selection,
    /// `n·l'·(d_k + d_v)·element_bytes` (655,360 B for E31).
    pub full_selection_bytes: u64,
}

impl SelectedTileCost {
    /// FLOP per byte of K/V payload (16 for E31); `0` for an empty payload.
    pub fn arithmetic_intensity(&self) -> f64 {
        if self.kv_payload_bytes == 0 { 0.0 } else { self.flops as f64 / self.kv_payload_bytes as f64 }
    }
}

/// E31 for the given tile.
pub fn selected_tile_cost(shape: SelectedTileShape) -> SelectedTileCost {
    let SelectedTileShape { heads, block_tokens, head_dim_k, head_dim_v, element_bytes, n_selected } = shape;
    let kv_payload_bytes = block_tokens * (head_dim_k + head_dim_v) * element_bytes;
    SelectedTileCost {
        flops: 2 * heads * block_tokens * (head_dim_k + head_dim_v),
        kv_payload_bytes,
        full_selection_bytes: n_selected * kv_payload_bytes,
    }
}

/// The NSA problem whose materialized score tensors E32 sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NsaScoreShape {
    /// Sequence length `T`.
    pub len: u64,
    /// Query heads `Hq`.
    pub n_heads_q: u64,
    /// KV heads `Hkv`.
    pub n_heads_kv: u64,
    /// Compression stride `s`.
    pub compress_stride: u64,
    /// Selection block length `l'`.
    pub select_block: u64,
    /// Bytes per score element (fp32: 4).
    pub element_bytes: u64,
}

impl Default for NsaScoreShape {
    /// The figures of E32: `T = 65536`, `Hq = 64`, `Hkv = 4`, `s = 16`, `l' = 64`, fp32.
    fn default() -> Self {
        NsaScoreShape {
            len: 65536,
            n_heads_q: 64,
            n_heads_kv: 4,
            compress_stride: 16,
            select_block: 64,
            element_bytes: 4,
        }
    }
}

/// Elements and bytes of one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorSize {
    /// Number of elements.
    pub elements: u64,
    /// Number of bytes.
    pub bytes: u64,
}

/// E32: the three places in NSA's data flow where a score tensor is materialized, never to be
/// mixed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NsaScoreSizes {
    /// Per-head compressed scores `[T, Hq, ⌈T/s⌉]`.
    pub per_head_compressed: TensorSize,
    /// Group-summed compressed scores `[T, Hkv, ⌈T/s⌉]`.
    pub group_summed: TensorSize,
    /// Remapped block scores `[T, Hkv, ⌈T/l'⌉]`.
    pub block_scores: TensorSize,
}

/// E32 for the given problem. **Convention:** the compressed axis has `⌈T/s⌉` columns, one per
/// window start inside the sequence (4096 at `T = 65536, s = 16`, as the seed writes), although
/// only `⌊(T − l)/s⌋ + 1` windows are complete (4095): a kernel allocates the padded width, and
/// the last columns are always masked.
pub fn nsa_score_sizes(shape: NsaScoreShape) -> Result<NsaScoreSizes, OracleError> {
    for (argument, value) in [("compress_stride", shape.compress_stride), ("select_block", shape.select_block)] {
        if value == 0 {
            return Err(OracleError::ZeroDimension { argument });
        }
    }
    let size = |heads: u64, columns: u64| {
        let elements = shape.len * heads * columns;
        TensorSize { elements, bytes: elements * shape.element_bytes }
    };
    let windows = shape.len.div_ceil(shape.compress_stride);
    Ok(NsaScoreSizes {
        per_head_compressed: size(shape.n_heads_q, windows),
        group_summed: size(shape.n_heads_kv, windows),
        block_scores: size(shape.n_heads_kv, shape.len.div_ceil(shape.select_block)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sparse_visits_r_of_n_tiles() {
        let shape = BlockSparseShape {
            n_query_tiles: 8,
            n_key_tiles: 8,
            tiles_per_query_tile: 2,
            query_tile: 64,
            key_tile: 64,
            head_dim: 128,
            head_dim_v: 128,
            element_bytes: 2,
        };
        let c = block_sparse_cost(shape).expect("r ≤ n_K");
        assert_eq!(c.dense_tile_pairs, 64);
        assert_eq!(c.visited_tile_pairs, 16);
        assert_eq!(c.dense_flops, 4 * c.sparse_flops);
        assert_eq!(c.sparse_kv_bytes, 16 * 64 * 256 * 2);
        // Every one of the 64 dense pairs would load its key tile's K and V rows.
        assert_eq!(c.dense_kv_bytes, 64 * 64 * 256 * 2);
        assert_eq!(c.kv_bytes_per_pair, 64 * 256 * 2);
        // The dense schedule (r = n_K) has the dense FLOPs of E1d over the same rows and keys.
        let dense = block_sparse_cost(BlockSparseShape { tiles_per_query_tile: 8, ..shape }).expect("r = n_K");
        let e1d = dense_cost(CostShape { len_q: 512, len_k: 512, head_dim: 128, head_dim_v: 128, element_bytes: 2 });
        assert_eq!(dense.sparse_flops, e1d.flops);
        assert!(matches!(
            block_sparse_cost(BlockSparseShape { tiles_per_query_tile: 9, ..shape }),
            Err(OracleError::InvalidParameter { argument: "tiles_per_query_tile", .. })
        ));
    }

    #[test]
    fn selected_tile_scales_with_its_parameters() {
        let base = selected_tile_cost(SelectedTileShape::default());
        let twice_heads = selected_tile_cost(SelectedTileShape { heads: 32, ..SelectedTileShape::default() });
        assert_eq!(twice_heads.flops, 2 * base.flops);
        assert_eq!(twice_heads.kv_payload_bytes, base.kv_payload_bytes);
        assert_eq!(twice_heads.arithmetic_intensity(), 2.0 * base.arithmetic_intensity());
        // FLOP per K/V byte is 2·heads/element_bytes whatever l', d_k and d_v are.
        let shape = SelectedTileShape::default();
        assert_eq!(base.arithmetic_intensity(), (2 * shape.heads) as f64 / shape.element_bytes as f64);
        let wider = selected_tile_cost(SelectedTileShape { head_dim_k: 64, block_tokens: 128, ..shape });
        assert_eq!(wider.arithmetic_intensity(), base.arithmetic_intensity());
    }

    #[test]
    fn score_sizes_refuse_zero_strides() {
        let bad = NsaScoreShape { compress_stride: 0, ..NsaScoreShape::default() };
        assert_eq!(nsa_score_sizes(bad), Err(OracleError::ZeroDimension { argument: "compress_stride" }));
        let bad = NsaScoreShape { select_block: 0, ..NsaScoreShape::default() };
        assert_eq!(nsa_score_sizes(bad), Err(OracleError::ZeroDimension { argument: "select_block" }));
        let sizes = nsa_score_sizes(NsaScoreShape::default()).expect("valid");
        assert_eq!(sizes.per_head_compressed.elements, 16 * sizes.group_summed.elements);
        assert_eq!(sizes.group_summed.elements, 4 * sizes.block_scores.elements);
    }
}
