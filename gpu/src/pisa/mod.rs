//! PISA (seed 003: Pyramid Top-K selection, E25–E28) on the GPU: the mean-pooled key hierarchy and the coarse-to-fine
//! descent that picks each query block's key blocks in `O(N log N)` instead of BSA's `O(N²/C)` ([`select`]); and what
//! a selection loses (E30: Recall@K and the attention-mass ratio from the exact block masses, [`diagnostics`]); and
//! PISA's first-order tail (E22), which keeps the unselected blocks in the same softmax ([`tail`]).
//!
//! The lists it writes are those of [`crate::block_sparse`]: per KV head, ascending, `−1`-padded, ready for
//! [`crate::block_sparse::block_sparse_forward`] as [`crate::block_sparse::ListHeads::PerKvHead`] lists.

pub mod covariance;
pub mod diagnostics;
pub mod select;
pub mod tail;
pub mod tail_backward;

use attnproof_oracle::{AttentionSpec, Mask, Sequence};

/// The query block `a` of `seq` as the selectors and the diagnostics read it: its rows and its last visible key
/// (bottom-right causal: `Lq < Lk` shifts it right, `Lq > Lk` leaves the first blocks seeing nothing; without a mask
/// the sequence's last key), or `None` when the block has no rows or sees no key.
pub fn block_position(spec: &AttentionSpec, seq: &Sequence, q_block: usize, a: usize) -> Option<(usize, usize)> {
    let row0 = a * q_block;
    if row0 >= seq.len_q || seq.len_k == 0 {
        return None;
    }
    let rows = q_block.min(seq.len_q - row0);
    let position = match spec.mask {
        Mask::Causal => (row0 + rows - 1 + seq.len_k).checked_sub(seq.len_q)?,
        _ => seq.len_k - 1,
    };
    Some((rows, position))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_positions_follow_the_mask() {
        let seq = |len_q, len_k| Sequence { index: 0, len_q, len_k, q_start: 0, k_start: 0 };
        let causal = AttentionSpec::dense(1, 1, 1, 1, 1, 8, 8).with_mask(Mask::Causal);
        let none = causal.clone().with_mask(Mask::None);
        assert_eq!(block_position(&causal, &seq(100, 300), 64, 0), Some((64, 263)));
        assert_eq!(block_position(&causal, &seq(100, 300), 64, 1), Some((36, 299)));
        assert_eq!(block_position(&causal, &seq(100, 300), 64, 2), None);
        assert_eq!(block_position(&causal, &seq(300, 100), 64, 0), None);
        assert_eq!(block_position(&causal, &seq(300, 100), 64, 3), Some((64, 55)));
        assert_eq!(block_position(&none, &seq(300, 100), 64, 0), Some((64, 99)));
        assert_eq!(block_position(&none, &seq(300, 0), 64, 0), None);
    }
}
