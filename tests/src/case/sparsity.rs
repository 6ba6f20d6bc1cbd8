//! The sparsity a case may state beside its mask: key-block lists per query block (`block_indices`, E14) or key lists
//! per query row (`token_indices`: E13 over DSA's selection, E16, as FlashMLA's and TileLang's sparse kernels take
//! it). Each is read and validated before any arithmetic, and turned into the keys a (sequence, query head) sees,
//! which the stated mask still restricts.

use std::collections::BTreeMap;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::block_sparse::BlockSparseLayout;
use attnproof_oracle::spec::{Layout, Sequence};
use ndarray::{Array2, Array3, Array4, Axis, Slice};

use super::error::CaseError;
use super::format::{key_error, tensor_error};
use super::safetensors::{Dtype, RawTensor};

/// What restricts a case's keys beyond its mask.
#[derive(Clone, Debug, PartialEq)]
pub enum Sparsity {
    /// Key-block lists per (batch, query head, query block): `block_indices` with `block_q` and `block_k`.
    Blocks(BlockSparseLayout),
    /// Key lists per query row: `token_indices`.
    Tokens(TokenLists),
}

/// Token-level key lists: which keys each query row may attend to.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLists {
    /// `[query rows, list heads, κ]`. Row `b·Lq + i` (layout `bhld`) or `cu_seqlens_q[b] + i` (`thd`) names
    /// sequence-local keys of query `i` of sequence `b`, in any order, without duplicates; `−1` marks an unused slot
    /// wherever it stands. One list head serves every query head (DSA's MQA lists), `Hkv` list heads serve their KV
    /// head's group, `Hq` serve one query head each.
    pub lists: Array3<i32>,
    /// The list head serving each query head, fixed from the stated heads when the file is read (a diagnosis that
    /// re-maps KV heads does not re-map the lists).
    pub head_lists: Vec<usize>,
}

impl TokenLists {
    /// The first list row of `seq`.
    fn first_row(spec: &AttentionSpec, seq: &Sequence) -> usize {
        match spec.layout {
            Layout::Dense { len_q, .. } => seq.index * len_q,
            Layout::Varlen { .. } => seq.q_start,
        }
    }

    /// `[len_q, len_k]`: whether query `i` of `seq` lists key `j` for query head `head`.
    fn listed(&self, spec: &AttentionSpec, seq: &Sequence, head: usize) -> Array2<bool> {
        let (row0, list) = (Self::first_row(spec, seq), self.head_lists[head]);
        let mut listed = Array2::from_elem((seq.len_q, seq.len_k), false);
        for i in 0..seq.len_q {
            for &key in self.lists.index_axis(Axis(0), row0 + i).index_axis(Axis(0), list) {
                if key >= 0 {
                    listed[[i, key as usize]] = true;
                }
            }
        }
        listed
    }

    /// Reads `token_indices`: I32 `[query rows, list heads, κ]`, or `[B, Lq, list heads, κ]` in layout `bhld`; every
    /// entry `−1` or a key of its row's sequence, none twice in a row.
    fn read(t: &RawTensor, spec: &AttentionSpec) -> Result<TokenLists, CaseError> {
        let error = |reason: String| tensor_error("token_indices", reason);
        let dense = match spec.layout {
            Layout::Dense { batch, len_q, .. } => Some((batch, len_q)),
            Layout::Varlen { .. } => None,
        };
        let rows: usize = spec.sequences().iter().map(|s| s.len_q).sum();
        let (heads, width) = match (t.dtype, t.shape.as_slice(), dense) {
            (Dtype::I32, &[r, h, w], _) if r == rows => (h, w),
            (Dtype::I32, &[b, l, h, w], Some((batch, len_q))) if (b, l) == (batch, len_q) => (h, w),
            (Dtype::I32, shape, _) => {
                let four = dense.map_or(String::new(), |(b, l)| format!(" or [{b}, {l}, list heads, κ]"));
                return Err(error(format!("shape {shape:?}; expected [{rows}, list heads, κ]{four}")));
            }
            (dtype, shape, _) => {
                return Err(error(format!("must be an I32 tensor of key lists, got {} {shape:?}", dtype.name())));
            }
        };
        let (hq, hkv) = (spec.n_heads_q, spec.n_heads_kv);
        if ![1, hkv, hq].contains(&heads) {
            return Err(error(format!(
                "{heads} list heads; expected 1 (shared), {hkv} (per KV head) or {hq} (per query head)"
            )));
        }
        let values: Vec<i32> = t.to_f64().into_iter().map(|x| x as i32).collect();
        let lists = Array3::from_shape_vec((rows, heads, width), values).map_err(|e| error(e.to_string()))?;
        for seq in spec.sequences() {
            let row0 = Self::first_row(spec, &seq);
            for row in row0..row0 + seq.len_q {
                for head in 0..heads {
                    let mut seen = BTreeMap::new();
                    for (slot, &key) in lists.index_axis(Axis(0), row).index_axis(Axis(0), head).iter().enumerate() {
                        let at = format!("[{row}, {head}, {slot}]");
                        if key < -1 || key as i64 >= seq.len_k as i64 {
                            return Err(error(format!(
                                "entry {at} = {key} is neither -1 nor a key of its sequence (0..{})",
                                seq.len_k
                            )));
                        }
                        if key >= 0
                            && let Some(first) = seen.insert(key, slot)
                        {
                            return Err(error(format!("entry {at} lists key {key} again (first at slot {first})")));
                        }
                    }
                }
            }
        }
        let head_lists = (0..hq)
            .map(|h| match heads {
                1 => 0,
                n if n == hq => h,
                _ => spec.kv_head(h),
            })
            .collect();
        Ok(TokenLists { lists, head_lists })
    }
}

impl Sparsity {
    /// Reads the case's stated sparsity, if any: `block_indices` (with `block_q`, `block_k`) or `token_indices`, not
    /// both.
    pub(super) fn read(
        block_indices: Option<&RawTensor>,
        token_indices: Option<&RawTensor>,
        metadata: &BTreeMap<String, String>,
        spec: &AttentionSpec,
    ) -> Result<Option<Sparsity>, CaseError> {
        match (block_indices, token_indices) {
            (None, None) => Ok(None),
            (Some(_), Some(_)) => Err(tensor_error(
                "token_indices",
                "a case states block_indices or token_indices, not both (one list of keys per query)",
            )),
            (Some(t), None) => Ok(Some(Sparsity::Blocks(block_layout(t, metadata, spec)?))),
            (None, Some(t)) => Ok(Some(Sparsity::Tokens(TokenLists::read(t, spec)?))),
        }
    }

    /// The keys of (sequence, query head) the lists leave visible under `spec`'s mask.
    pub fn visibility(&self, spec: &AttentionSpec, seq: &Sequence, head: usize) -> Array2<bool> {
        match self {
            Sparsity::Blocks(layout) => layout.visibility(spec, seq, head),
            Sparsity::Tokens(tokens) => {
                let mask = spec.mask.matrix(seq.len_q, seq.len_k);
                mask & tokens.listed(spec, seq, head)
            }
        }
    }

    /// The lists of batch `b` and query head `h` of a dense `spec`, for the case restricted to them (one sequence,
    /// one query head); the checker restricts dense layouts only (a packed layout keeps its sequences together).
    pub(super) fn one_head(&self, spec: &AttentionSpec, b: usize, h: usize) -> Sparsity {
        let one = |i: usize| Slice::from(i..=i);
        match self {
            Sparsity::Blocks(layout) => Sparsity::Blocks(BlockSparseLayout {
                lists: layout.lists.slice_axis(Axis(0), one(b)).slice_axis(Axis(1), one(h)).to_owned(),
                ..layout.clone()
            }),
            Sparsity::Tokens(tokens) => {
                let Layout::Dense { len_q, .. } = spec.layout else {
                    unreachable!("one_head restricts dense layouts only")
                };
                let rows = Slice::from(b * len_q..(b + 1) * len_q);
                Sparsity::Tokens(TokenLists {
                    lists: tokens
                        .lists
                        .slice_axis(Axis(0), rows)
                        .slice_axis(Axis(1), one(tokens.head_lists[h]))
                        .to_owned(),
                    head_lists: vec![0],
                })
            }
        }
    }
}

/// Reads `block_indices`: a 4-D I32 tensor with positive `block_q` and `block_k`, valid for `spec`.
fn block_layout(
    t: &RawTensor,
    metadata: &BTreeMap<String, String>,
    spec: &AttentionSpec,
) -> Result<BlockSparseLayout, CaseError> {
    if t.dtype != Dtype::I32 || t.shape.len() != 4 {
        return Err(tensor_error(
            "block_indices",
            format!("must be a 4-D I32 tensor, got {} {:?}", t.dtype.name(), t.shape),
        ));
    }
    let tile = |key: &str| -> Result<usize, CaseError> {
        let value =
            metadata.get(key).ok_or_else(|| key_error(key, "missing (block_indices needs block_q and block_k)"))?;
        match value.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(key_error(key, format!("expected a positive integer, got {value:?}"))),
        }
    };
    let (q_tile, kv_tile) = (tile("block_q")?, tile("block_k")?);
    let values: Vec<i32> = t.to_f64().into_iter().map(|x| x as i32).collect();
    let dims = (t.shape[0], t.shape[1], t.shape[2], t.shape[3]);
    let lists = Array4::from_shape_vec(dims, values).map_err(|e| tensor_error("block_indices", e.to_string()))?;
    let layout = BlockSparseLayout { q_tile, kv_tile, lists };
    layout.validate(spec).map_err(|e| tensor_error("block_indices", e.to_string()))?;
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::Mask;

    /// An I32 tensor of `values` in `shape`.
    fn raw(shape: &[usize], values: &[i32]) -> RawTensor {
        RawTensor {
            dtype: Dtype::I32,
            shape: shape.to_vec(),
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// Restricted to one (batch, query head), token lists show that head the keys the whole lists show it, whether
    /// the lists are shared, per KV head or per query head (the diagnosis screens its hypotheses on such a head).
    #[test]
    fn one_head_keeps_each_heads_keys() {
        let spec = AttentionSpec::dense(2, 4, 2, 3, 5, 4, 4).with_mask(Mask::Causal);
        let sub_spec = AttentionSpec {
            layout: Layout::Dense { batch: 1, len_q: 3, len_k: 5 },
            n_heads_q: 1,
            n_heads_kv: 1,
            ..spec.clone()
        };
        let sub_seq = &sub_spec.sequences()[0];
        for heads in [1usize, 2, 4] {
            // Row r, list head h: key (r + h) % 5 and, unless (r + h) % 3 == 0, key (r + h + 2) % 5.
            let values: Vec<i32> = (0..6i32)
                .flat_map(|r| {
                    (0..heads as i32)
                        .flat_map(move |h| [(r + h) % 5, if (r + h) % 3 == 0 { -1 } else { (r + h + 2) % 5 }])
                })
                .collect();
            let lists = Sparsity::Tokens(TokenLists::read(&raw(&[6, heads, 2], &values), &spec).expect("valid lists"));
            let mut distinct = BTreeMap::new();
            for seq in spec.sequences() {
                for h in 0..4 {
                    let full = lists.visibility(&spec, &seq, h);
                    let sub = lists.one_head(&spec, seq.index, h).visibility(&sub_spec, sub_seq, 0);
                    assert_eq!(sub, full, "{heads} list heads, batch {}, head {h}", seq.index);
                    distinct.insert(format!("{full:?}"), h);
                }
            }
            // Per KV head and per query head, the heads see different keys: the comparison is not vacuous.
            assert!(heads == 1 || distinct.len() > 2, "{heads} list heads: {} distinct visibilities", distinct.len());
        }
    }
}
