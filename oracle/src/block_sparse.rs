//! Block-sparse attention over `−1`-padded per-query-tile lists (E14): query tile `a` visits only
//! the KV tiles in its list `C_a`. Under drop-and-renormalize this is dense attention under the
//! mask `M ∧ (tile(j) ∈ C_{tile(i)})`, so the oracle reuses the dense forward and backward with
//! that visibility, and the pair count falls from `n_Q·n_K` to `Σ_a |C_a|`.

use ndarray::{Array2, Array4, ArrayViewD};

use crate::attention::{Forward, Gradients, Qkv, backward_with_visibility, forward_with_visibility};
use crate::dense::DenseConfig;
use crate::error::OracleError;
use crate::real::Real;
use crate::spec::{AttentionSpec, Sequence};
use crate::topk::validate_index_row;

/// Per-query-tile KV tile lists for every (sequence, query head).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSparseLayout {
    /// Query rows per query tile.
    pub q_tile: usize,
    /// Keys per KV tile.
    pub kv_tile: usize,
    /// `[B, Hq, n_q_tiles, width]` KV tile indices, ascending, no duplicates, `−1`-padded;
    /// `n_q_tiles = ⌈max Lq / q_tile⌉`. Tiles past a sequence's own query tiles must be all `−1`.
    pub lists: Array4<i32>,
}

/// Visited and dense tile-pair counts (E14).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TilePairs {
    /// `Σ_a |C_a|` over every (sequence, head, query tile).
    pub visited: usize,
    /// `n_Q · n_K` summed over every (sequence, head).
    pub dense: usize,
}

impl BlockSparseLayout {
    fn n_q_tiles(&self, spec: &AttentionSpec) -> usize {
        spec.sequences().iter().map(|s| s.len_q.div_ceil(self.q_tile)).max().unwrap_or(0)
    }

    /// Checks tile sizes, the list shape, and every list row against the index convention with
    /// bound `⌈Lk / kv_tile⌉` of its sequence.
    pub fn validate(&self, spec: &AttentionSpec) -> Result<(), OracleError> {
        spec.validate()?;
        if self.q_tile == 0 {
            return Err(OracleError::ZeroDimension { argument: "q_tile" });
        }
        if self.kv_tile == 0 {
            return Err(OracleError::ZeroDimension { argument: "kv_tile" });
        }
        let seqs = spec.sequences();
        let (batch, width) = (seqs.len(), self.lists.dim().3);
        let expected = vec![batch, spec.n_heads_q, self.n_q_tiles(spec), width];
        if self.lists.shape() != expected.as_slice() {
            return Err(OracleError::ShapeMismatch {
                argument: "lists",
                expected,
                actual: self.lists.shape().to_vec(),
            });
        }
        for seq in &seqs {
            let own_tiles = seq.len_q.div_ceil(self.q_tile);
            let bound = seq.len_k.div_ceil(self.kv_tile);
            for h in 0..spec.n_heads_q {
                for a in 0..self.lists.dim().2 {
                    let row: Vec<i32> = (0..width).map(|w| self.lists[[seq.index, h, a, w]]).collect();
                    let row_index = (seq.index * spec.n_heads_q + h) * self.lists.dim().2 + a;
                    // Rows past the sequence's own tiles get bound 0: any index there is an error.
                    validate_index_row("lists", row_index, &row, if a < own_tiles { bound } else { 0 })?;
                }
            }
        }
        Ok(())
    }

    /// The visibility of (sequence, head): the spec's mask AND "the key's tile is listed for the
    /// query's tile". Call after [`BlockSparseLayout::validate`].
    pub fn visibility(&self, spec: &AttentionSpec, seq: &Sequence, head: usize) -> Array2<bool> {
        let mut visible = spec.mask.matrix(seq.len_q, seq.len_k);
        let key_blocks = seq.len_k.div_ceil(self.kv_tile.max(1));
        // Each query block's listed key blocks once, then a lookup per element (not a scan of the list).
        let mut listed = vec![false; key_blocks];
        for (i, mut row) in visible.rows_mut().into_iter().enumerate() {
            if i % self.q_tile.max(1) == 0 {
                listed.fill(false);
                for &b in self.lists.slice(ndarray::s![seq.index, head, i / self.q_tile, ..]) {
                    if let Some(slot) = usize::try_from(b).ok().and_then(|b| listed.get_mut(b)) {
                        *slot = true;
                    }
                }
            }
            for (j, v) in row.iter_mut().enumerate() {
                *v = *v && listed[j / self.kv_tile];
            }
        }
        visible
    }

    /// Tile pairs visited versus dense.
    pub fn tile_pairs(&self, spec: &AttentionSpec) -> TilePairs {
        let mut pairs = TilePairs { visited: 0, dense: 0 };
        for seq in spec.sequences() {
            let (n_q, n_k) = (seq.len_q.div_ceil(self.q_tile), seq.len_k.div_ceil(self.kv_tile));
            pairs.dense += spec.n_heads_q * n_q * n_k;
            for h in 0..spec.n_heads_q {
                for a in 0..n_q {
                    pairs.visited += (0..self.lists.dim().3).filter(|&w| self.lists[[seq.index, h, a, w]] >= 0).count();
                }
            }
        }
        pairs
    }
}

/// E14 forward: drop-and-renormalize attention over the listed tiles.
pub fn block_sparse_forward<S: Real>(
    spec: &AttentionSpec,
    qkv: Qkv<'_, S>,
    layout: &BlockSparseLayout,
    config: DenseConfig,
    ctx: S::Ctx,
) -> Result<Forward<S>, OracleError> {
    layout.validate(spec)?;
    forward_with_visibility(spec, qkv, &|seq: &Sequence, h| layout.visibility(spec, seq, h), config, ctx)
}

/// E14 backward: the gradients of [`block_sparse_forward`].
pub fn block_sparse_backward<S: Real>(
    spec: &AttentionSpec,
    qkv: Qkv<'_, S>,
    d_out: ArrayViewD<'_, S>,
    layout: &BlockSparseLayout,
    config: DenseConfig,
    ctx: S::Ctx,
) -> Result<Gradients<S>, OracleError> {
    layout.validate(spec)?;
    backward_with_visibility(spec, qkv, d_out, &|seq: &Sequence, h| layout.visibility(spec, seq, h), config, ctx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Layout, Mask};

    /// The visibility is the mask AND "the element's key block is listed for its query block", element by element:
    /// varlen sequences shorter than the lists (entries past a sequence's key blocks), `−1` pads, a causal mask,
    /// tiles that do not divide the lengths.
    #[test]
    fn visibility_is_the_mask_and_the_listed_blocks_element_by_element() {
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 7, 20], cu_seqlens_k: vec![0, 5, 23] },
            ..AttentionSpec::dense(1, 2, 2, 1, 1, 4, 4).with_mask(Mask::Causal)
        };
        let (q_tile, kv_tile) = (4, 3);
        let lists = Array4::from_shape_fn((2, 2, 4, 3), |(s, h, a, w)| {
            let entries = [[0, 2, -1], [1, 3, 5], [0, 1, 2], [4, 6, -1]];
            entries[(a + s + h) % 4][w]
        });
        let layout = BlockSparseLayout { q_tile, kv_tile, lists: lists.clone() };
        for seq in spec.sequences() {
            for h in 0..2 {
                let mask = spec.mask.matrix(seq.len_q, seq.len_k);
                let expected = Array2::from_shape_fn((seq.len_q, seq.len_k), |(i, j)| {
                    mask[[i, j]] && (0..3).any(|w| lists[[seq.index, h, i / q_tile, w]] == (j / kv_tile) as i32)
                });
                assert_eq!(layout.visibility(&spec, &seq, h), expected, "sequence {}, head {h}", seq.index);
            }
        }
    }
}
