//! Block selection for block-sparse attention (BSA; E15 pooling feeding the E14 lists): mean-pooled keys per key
//! block, mean-pooled queries per query block, their scaled dot product summed over each KV head's GQA group, causal
//! eligibility, forced blocks (the first block, the most recent ones), and top-k with ties to the lower index,
//! written as the `−1`-padded ascending lists of E14, one per (sequence, KV head, query block) and shared by the
//! group's query heads.
//!
//! Query pooling: the mean of the query block's queries. The pooled score of query block `a` and key block `b` for
//! query head `h`, `α q̄_a·k̄_b`, is then the mean over `a`'s queries of E15's per-query pooled score `α q_i·k̄_b`
//! (the map is linear), so the selector ranks blocks by the pooled score of E15 averaged over the query block. The
//! last block of a sequence may be partial: its mean is over the rows it has.
//!
//! Eligibility follows the mask: without a mask every key block of the sequence is eligible; under the
//! bottom-right causal mask a key block is eligible when its first key is visible to the query block's last query
//! (`b·kv_block ≤ last row + Lk − Lq`). Other masks are not offered: a window would need a rule for blocks that it
//! cuts on both sides. Forced blocks are kept whatever their scores, eligible ones only, and count towards `top_k`.

use ndarray::{Array1, Array2, Array4, ArrayView4, ArrayViewD, Axis, Slice};

use crate::error::OracleError;
use crate::real::Real;
use crate::spec::{AttentionSpec, Mask, Sequence};
use crate::topk::{padded_ascending, top_k};
use crate::vector::{dot, mean_row};

/// The selector's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BsaConfig {
    /// Query rows per query block.
    pub q_block: usize,
    /// Keys per key block.
    pub kv_block: usize,
    /// Blocks kept per list, forced ones included (the lists' width).
    pub top_k: usize,
    /// Whether key block 0 is always kept (when eligible).
    pub force_first: bool,
    /// How many of the most recent eligible key blocks (the last eligible one and those before it) are always kept.
    pub force_local: usize,
}

impl BsaConfig {
    /// Positive block sizes and width, and room in `top_k` for every forced block.
    pub fn validate(&self) -> Result<(), OracleError> {
        for (argument, value) in [("q_block", self.q_block), ("kv_block", self.kv_block), ("top_k", self.top_k)] {
            if value == 0 {
                return Err(OracleError::ZeroDimension { argument });
            }
        }
        let forced = usize::from(self.force_first) + self.force_local;
        if self.top_k < forced {
            return Err(OracleError::InvalidParameter {
                argument: "top_k",
                reason: format!("{} blocks cannot hold the {forced} forced ones", self.top_k),
            });
        }
        Ok(())
    }

    /// Query blocks of `seq`.
    pub fn query_blocks(&self, seq: &Sequence) -> usize {
        seq.len_q.div_ceil(self.q_block)
    }

    /// Key blocks of `seq`.
    pub fn key_blocks(&self, seq: &Sequence) -> usize {
        seq.len_k.div_ceil(self.kv_block)
    }

    /// The key blocks eligible for query block `a` of `seq` under a causal (`causal`) or no mask: `0..end`.
    pub fn eligible_end(&self, seq: &Sequence, a: usize, causal: bool) -> usize {
        let blocks = self.key_blocks(seq);
        if !causal {
            return blocks;
        }
        let last_row = ((a + 1) * self.q_block).min(seq.len_q) as i64 - 1;
        let last_key = last_row + seq.len_k as i64 - seq.len_q as i64;
        if last_key < 0 { 0 } else { (last_key as usize / self.kv_block + 1).min(blocks) }
    }

    /// The forced blocks among the first `eligible` key blocks, ascending, without duplicates.
    pub fn forced(&self, eligible: usize) -> Vec<usize> {
        let first = (self.force_first && eligible > 0).then_some(0);
        let local = eligible - self.force_local.min(eligible)..eligible;
        let mut forced: Vec<usize> = first.into_iter().chain(local).collect();
        forced.dedup();
        forced
    }
}

/// Whether the mask is causal (`true`) or absent (`false`); any other mask is refused.
fn causal_of(spec: &AttentionSpec) -> Result<bool, OracleError> {
    match &spec.mask {
        Mask::None => Ok(false),
        Mask::Causal => Ok(true),
        other => Err(OracleError::InvalidParameter {
            argument: "mask",
            reason: format!("block selection takes no mask or the causal mask, not {other:?}"),
        }),
    }
}

/// Means of consecutive row blocks of `rows` (`[L, d]`): `[⌈L/block⌉, d]`, the last over the rows it has.
pub(crate) fn pooled<S: Real>(rows: ndarray::ArrayView2<'_, S>, block: usize, ctx: S::Ctx) -> Array2<S> {
    let n = rows.nrows().div_ceil(block);
    let means: Vec<Array1<S>> = (0..n)
        .map(|b| {
            let part = rows.slice_axis(Axis(0), Slice::from(b * block..((b + 1) * block).min(rows.nrows())));
            mean_row(part, ctx).expect("a block has at least one row")
        })
        .collect();
    let views: Vec<_> = means.iter().map(|m| m.view()).collect();
    if views.is_empty() {
        return Array2::from_shape_fn((0, rows.ncols()), |_| S::zero(ctx));
    }
    ndarray::stack(Axis(0), &views).expect("rows of one width")
}

/// The group-summed pooled scores `[B, Hkv, n_q_blocks, n_k_blocks]` (the most blocks of any sequence):
/// `Σ_{h ∈ group} α q̄_{a,h}·k̄_{b}` for eligible blocks, `−∞` for ineligible ones and for blocks past a sequence's
/// own. `q`, `k` are laid out by `spec`.
pub fn bsa_scores<S: Real>(
    spec: &AttentionSpec,
    q: ArrayViewD<'_, S>,
    k: ArrayViewD<'_, S>,
    config: &BsaConfig,
    ctx: S::Ctx,
) -> Result<Array4<S>, OracleError> {
    spec.validate()?;
    config.validate()?;
    let causal = causal_of(spec)?;
    for (argument, t, op) in [("q", &q, crate::spec::Operand::Q), ("k", &k, crate::spec::Operand::K)] {
        let expected = spec.expected_shape(op);
        if t.shape() != expected.as_slice() {
            return Err(OracleError::ShapeMismatch { argument, expected, actual: t.shape().to_vec() });
        }
        crate::error::check_finite(argument, t)?;
    }
    let seqs = spec.sequences();
    let n_q = seqs.iter().map(|s| config.query_blocks(s)).max().unwrap_or(0);
    let n_k = seqs.iter().map(|s| config.key_blocks(s)).max().unwrap_or(0);
    let alpha = spec.scale_value::<S>(ctx);
    let group = spec.group_size();
    let mut out = Array4::from_elem((seqs.len(), spec.n_heads_kv, n_q, n_k), S::neg_infinity(ctx));
    for seq in &seqs {
        for kv in 0..spec.n_heads_kv {
            let keys = pooled(spec.head_rows(k.view(), seq, kv, true), config.kv_block, ctx);
            let queries: Vec<Array2<S>> = (kv * group..(kv + 1) * group)
                .map(|h| pooled(spec.head_rows(q.view(), seq, h, false), config.q_block, ctx))
                .collect();
            for a in 0..config.query_blocks(seq) {
                for b in 0..config.eligible_end(seq, a, causal) {
                    let total = queries
                        .iter()
                        .fold(S::zero(ctx), |acc, qh| acc + alpha.clone() * dot(qh.row(a), keys.row(b), ctx));
                    out[[seq.index, kv, a, b]] = total;
                }
            }
        }
    }
    Ok(out)
}

/// The lists `[B, Hkv, n_q_blocks, top_k]` from [`bsa_scores`]: per (sequence, KV head, query block) the forced
/// blocks, then the best eligible blocks (larger score first, ties to the lower index) up to `top_k`, ascending and
/// `−1`-padded; query blocks past a sequence's own list nothing.
pub fn bsa_select<S: Real>(
    spec: &AttentionSpec,
    scores: ArrayView4<'_, S>,
    config: &BsaConfig,
) -> Result<Array4<i32>, OracleError> {
    config.validate()?;
    let causal = causal_of(spec)?;
    let seqs = spec.sequences();
    let (batch, heads, n_q, n_k) = scores.dim();
    let expected_q = seqs.iter().map(|s| config.query_blocks(s)).max().unwrap_or(0);
    let expected_k = seqs.iter().map(|s| config.key_blocks(s)).max().unwrap_or(0);
    let expected = vec![seqs.len(), spec.n_heads_kv, expected_q, expected_k];
    if [batch, heads, n_q, n_k] != expected.as_slice() {
        return Err(OracleError::ShapeMismatch { argument: "scores", expected, actual: scores.shape().to_vec() });
    }
    let mut lists = Array4::from_elem((batch, heads, n_q, config.top_k), -1i32);
    for seq in &seqs {
        for kv in 0..heads {
            for a in 0..config.query_blocks(seq) {
                let end = config.eligible_end(seq, a, causal);
                let row: Vec<S> = (0..n_k).map(|b| scores[[seq.index, kv, a, b]].clone()).collect();
                let chosen = top_k(&row, config.top_k, |b| b < end, &config.forced(end));
                for (w, x) in padded_ascending(&chosen, config.top_k).into_iter().enumerate() {
                    lists[[seq.index, kv, a, w]] = x;
                }
            }
        }
    }
    Ok(lists)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Layout;
    use ndarray::{ArrayD, IxDyn};

    fn config(top_k: usize, force_first: bool, force_local: usize) -> BsaConfig {
        BsaConfig { q_block: 2, kv_block: 2, top_k, force_first, force_local }
    }

    #[test]
    fn eligibility_follows_the_bottom_right_causal_mask() {
        let c = config(4, false, 0);
        let seq = |len_q, len_k| Sequence { index: 0, q_start: 0, len_q, k_start: 0, len_k };
        // Lq = Lk = 5: query block 0 (rows 0, 1) sees key block 0; block 2 (row 4) sees blocks 0..=2.
        assert_eq!((0..3).map(|a| c.eligible_end(&seq(5, 5), a, true)).collect::<Vec<_>>(), [1, 2, 3]);
        // Lq = 3 < Lk = 8: row 0 is aligned with key 5, so block 0 sees key blocks 0..=3; row 2 (key 7) all 4.
        assert_eq!((0..2).map(|a| c.eligible_end(&seq(3, 8), a, true)).collect::<Vec<_>>(), [4, 4]);
        // Lq = 6 > Lk = 2: rows 0..=3 see no key; block 2 (rows 4, 5) sees key block 0.
        assert_eq!((0..3).map(|a| c.eligible_end(&seq(6, 2), a, true)).collect::<Vec<_>>(), [0, 0, 1]);
        assert_eq!(c.eligible_end(&seq(6, 2), 0, false), 1, "no mask: every key block");
        // Lq = 5, Lk = 2: row 3, the last of block 1, is aligned with key 0 exactly, so block 1 sees key block 0.
        assert_eq!((0..3).map(|a| c.eligible_end(&seq(5, 2), a, true)).collect::<Vec<_>>(), [0, 1, 1]);
    }

    #[test]
    fn forced_blocks_are_the_first_and_the_most_recent_eligible_ones() {
        assert_eq!(config(4, true, 2).forced(5), [0, 3, 4]);
        assert_eq!(config(4, true, 2).forced(2), [0, 1]);
        assert_eq!(config(4, true, 2).forced(1), [0]);
        assert_eq!(config(4, true, 2).forced(0), Vec::<usize>::new());
        assert_eq!(config(4, false, 1).forced(3), [2]);
        assert_eq!(config(4, true, 0).forced(3), [0]);
        assert!(config(2, true, 2).validate().is_err());
        // A list exactly as wide as the forced blocks is valid (they fill it).
        assert_eq!(config(3, true, 2).validate(), Ok(()));
        assert_eq!(config(1, false, 1).validate(), Ok(()));
        assert!(BsaConfig { q_block: 0, ..config(2, false, 0) }.validate().is_err());
    }

    /// One sequence of 6 queries and 6 keys, 2 query heads over one KV head, d = 1: scores are sums over the group
    /// of `α · mean(q) · mean(k)`, computed here by hand.
    #[test]
    fn scores_pool_both_sides_and_sum_the_group() {
        let spec = AttentionSpec::dense(1, 2, 1, 6, 6, 1, 1).with_mask(Mask::None);
        let q = ArrayD::from_shape_vec(IxDyn(&[1, 2, 6, 1]), vec![1., 3., 0., 0., 2., 2., 1., 1., 4., 0., -2., 0.])
            .unwrap();
        let k = ArrayD::from_shape_vec(IxDyn(&[1, 1, 6, 1]), vec![1., 1., 2., 4., -1., 0.]).unwrap();
        let s = bsa_scores(&spec, q.view(), k.view(), &config(2, false, 0), ()).unwrap();
        // Pooled keys 1, 3, -0.5; pooled queries head 0: 2, 0, 2; head 1: 1, 2, -1.
        let (qh0, qh1, kb) = ([2., 0., 2.], [1., 2., -1.], [1., 3., -0.5]);
        for a in 0..3 {
            for b in 0..3 {
                assert_eq!(s[[0, 0, a, b]], qh0[a] * kb[b] + qh1[a] * kb[b], "a = {a}, b = {b}");
            }
        }
        let lists = bsa_select(&spec, s.view(), &config(2, false, 0)).unwrap();
        // Query block 0 (group query mean 3): scores 3, 9, -1.5 → blocks 1, 0.
        assert_eq!(lists.index_axis(Axis(2), 0).iter().copied().collect::<Vec<_>>(), [0, 1]);
        // Query block 2 (1): 1, 3, -0.5 → 1, 0. Query block 1 (2): 2, 6, -1 → 1, 0.
        assert_eq!(lists.iter().copied().collect::<Vec<_>>(), [0, 1, 0, 1, 0, 1]);
    }

    /// Each KV head sums the pooled scores of its own group only: with 4 query heads over 2 KV heads, KV head 1 sums
    /// query heads 2 and 3, not heads 0 to 3 (one block per side, d = 1, α = 1, computed by hand).
    #[test]
    fn each_kv_head_sums_its_own_group_only() {
        let spec = AttentionSpec::dense(1, 4, 2, 2, 2, 1, 1).with_mask(Mask::None);
        // Query head h holds h + 1 in both rows; KV head 0 holds keys 1, 1 and KV head 1 holds 10, 10.
        let q = ArrayD::from_shape_vec(IxDyn(&[1, 4, 2, 1]), vec![1., 1., 2., 2., 3., 3., 4., 4.]).unwrap();
        let k = ArrayD::from_shape_vec(IxDyn(&[1, 2, 2, 1]), vec![1., 1., 10., 10.]).unwrap();
        let s = bsa_scores(&spec, q.view(), k.view(), &config(1, false, 0), ()).unwrap();
        assert_eq!(s[[0, 0, 0, 0]], (1. + 2.) * 1., "KV head 0: query heads 0 and 1");
        assert_eq!(s[[0, 1, 0, 0]], (3. + 4.) * 10., "KV head 1: query heads 2 and 3");
    }

    /// Equal scores break to the lower block index; forced blocks come in first even with the worst scores; a
    /// causal row keeps only eligible blocks and pads the rest; a query block past a sequence's own lists nothing.
    #[test]
    fn ties_forced_blocks_causality_and_padding() {
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 8, 10], cu_seqlens_k: vec![0, 8, 10] },
            ..AttentionSpec::dense(1, 1, 1, 1, 1, 1, 1).with_mask(Mask::Causal)
        };
        // Sequence 0: keys 1,1 | 5,5 | 5,5 | -9,-9: blocks 1 and 2 tie; block 3 is the worst.
        let mut k = vec![1., 1., 5., 5., 5., 5., -9., -9.];
        k.extend([1., 1.]);
        let k = ArrayD::from_shape_vec(IxDyn(&[10, 1, 1]), k).unwrap();
        let q = ArrayD::from_elem(IxDyn(&[10, 1, 1]), 1.0);
        let c = config(2, false, 1);
        let s = bsa_scores(&spec, q.view(), k.view(), &c, ()).unwrap();
        let lists = bsa_select(&spec, s.view(), &c).unwrap();
        let row = |seq: usize, a: usize| (0..2).map(|w| lists[[seq, 0, a, w]]).collect::<Vec<_>>();
        assert_eq!(row(0, 0), [0, -1], "only block 0 is eligible, and it is forced");
        assert_eq!(row(0, 1), [0, 1]);
        assert_eq!(row(0, 2), [1, 2], "block 2 is forced (local); block 1 is the best of the rest");
        assert_eq!(row(0, 3), [1, 3], "block 3 is forced although the worst; of the tie 1 = 2, the lower index");
        assert_eq!(row(1, 0), [0, -1]);
        assert_eq!(row(1, 1), [-1, -1], "sequence 1 has one query block");
        assert!(s[[1, 0, 1, 0]] == f64::NEG_INFINITY && s[[0, 0, 0, 1]] == f64::NEG_INFINITY);
    }

    #[test]
    fn windows_and_shapes_are_refused() {
        let spec = AttentionSpec::dense(1, 1, 1, 4, 4, 1, 1).with_mask(Mask::Window { left: 1, right: 0 });
        let x = ArrayD::<f64>::zeros(IxDyn(&[1, 1, 4, 1]));
        assert!(matches!(
            bsa_scores(&spec, x.view(), x.view(), &config(1, false, 0), ()),
            Err(OracleError::InvalidParameter { argument: "mask", .. })
        ));
        let spec = spec.with_mask(Mask::Causal);
        let short = ArrayD::<f64>::zeros(IxDyn(&[1, 1, 3, 1]));
        assert!(matches!(
            bsa_scores(&spec, x.view(), short.view(), &config(1, false, 0), ()),
            Err(OracleError::ShapeMismatch { argument: "k", .. })
        ));
        let wrong = Array4::<f64>::zeros((1, 1, 2, 3));
        assert!(matches!(
            bsa_select(&spec, wrong.view(), &config(1, false, 0)),
            Err(OracleError::ShapeMismatch { argument: "scores", .. })
        ));
    }
}
