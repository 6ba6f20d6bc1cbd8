//! Block-sparse attention over `−1`-padded tile lists (E14) and the exact set of E13: list
//! validation errors, equivalence with dense attention when every tile is listed, tile-pair
//! counts, and empty lists giving fully masked rows.

use attnproof_oracle::block_sparse::{BlockSparseLayout, block_sparse_backward, block_sparse_forward};
use attnproof_oracle::inputs::uniform_tensor;
use attnproof_oracle::selection::{ExactSetConfig, exact_set};
use attnproof_oracle::{AttentionSpec, DenseConfig, Mask, OracleError, Qkv, backward_f64, forward_f64};
use ndarray::{Array1, Array4};

/// B = 1, Hq = 2, Hkv = 1, Lq = 5, Lk = 7, d = 2, dv = 3, causal; tiles of 2 queries and 3 keys:
/// 3 query tiles, 3 KV tiles.
fn spec() -> AttentionSpec {
    AttentionSpec::dense(1, 2, 1, 5, 7, 2, 3).with_mask(Mask::Causal)
}

fn layout(lists: Vec<i32>, width: usize) -> BlockSparseLayout {
    BlockSparseLayout {
        q_tile: 2,
        kv_tile: 3,
        lists: Array4::from_shape_vec((1, 2, 3, width), lists).expect("sizes agree"),
    }
}

fn inputs() -> [ndarray::ArrayD<f64>; 4] {
    [
        uniform_tensor(1, &[1, 2, 5, 2]),
        uniform_tensor(2, &[1, 1, 7, 2]),
        uniform_tensor(3, &[1, 1, 7, 3]),
        uniform_tensor(4, &[1, 2, 5, 3]),
    ]
}

#[test]
fn listing_every_tile_is_dense_attention() {
    let all: Vec<i32> = (0..6).flat_map(|_| [0, 1, 2]).collect();
    let l = layout(all, 3);
    let [q, k, v, g] = inputs();
    let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
    let sparse = block_sparse_backward(&spec(), qkv.clone(), g.view(), &l, DenseConfig::default(), ()).unwrap();
    let dense = backward_f64(&spec(), q.view(), k.view(), v.view(), g.view()).unwrap();
    assert_eq!(sparse, dense);
    let pairs = l.tile_pairs(&spec());
    assert_eq!((pairs.visited, pairs.dense), (18, 18));
}

#[test]
fn an_unlisted_tile_changes_the_output_and_an_empty_list_masks_the_rows() {
    // Head 0: tile 0 sees only KV tile 0, tile 1 sees nothing, tile 2 sees tiles 1, 2.
    // Head 1: everything.
    let lists = vec![0, -1, -1, -1, -1, -1, 1, 2, -1, 0, 1, 2, 0, 1, 2, 0, 1, 2];
    let l = layout(lists, 3);
    let [q, k, v, _] = inputs();
    let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
    let sparse = block_sparse_forward(&spec(), qkv, &l, DenseConfig::default(), ()).unwrap();
    let dense = forward_f64(&spec(), q.view(), k.view(), v.view()).unwrap();
    for i in 2..4 {
        assert_eq!(sparse.lse[[0, 0, i]], f64::NEG_INFINITY, "row {i} of head 0 has an empty list");
        assert!((0..3).all(|c| sparse.o[[0, 0, i, c]] == 0.0));
    }
    assert_ne!(sparse.o[[0, 0, 4, 0]], dense.o[[0, 0, 4, 0]], "row 4 of head 0 lost KV tile 0");
    assert_eq!(sparse.o.index_axis(ndarray::Axis(1), 1), dense.o.index_axis(ndarray::Axis(1), 1));
    let pairs = l.tile_pairs(&spec());
    assert_eq!((pairs.visited, pairs.dense), (3 + 9, 18));
}

fn expect_index_error(lists: Vec<i32>, width: usize) -> String {
    let [q, k, v, _] = inputs();
    let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
    match block_sparse_forward(&spec(), qkv, &layout(lists, width), DenseConfig::default(), ()) {
        Err(OracleError::IndexList { argument: "lists", reason, .. }) => reason,
        other => panic!("expected an index-list error, got {other:?}"),
    }
}

#[test]
fn bad_lists_are_rejected_with_the_reason() {
    let base = |bad: [i32; 2]| {
        let mut v: Vec<i32> = [0, 1].repeat(6);
        v[0] = bad[0];
        v[1] = bad[1];
        v
    };
    assert!(expect_index_error(base([0, 3]), 2).contains("out of range"));
    assert!(expect_index_error(base([1, 1]), 2).contains("duplicated"));
    assert!(expect_index_error(base([1, 0]), 2).contains("not ascending"));
    assert!(expect_index_error(base([-1, 0]), 2).contains("after a -1 pad"));
}

#[test]
fn bad_layouts_are_rejected() {
    let [q, k, v, _] = inputs();
    let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
    let wrong_shape = BlockSparseLayout { q_tile: 2, kv_tile: 3, lists: Array4::from_elem((1, 2, 2, 1), 0) };
    assert!(matches!(
        block_sparse_forward(&spec(), qkv.clone(), &wrong_shape, DenseConfig::default(), ()),
        Err(OracleError::ShapeMismatch { argument: "lists", .. })
    ));
    let zero_tile = BlockSparseLayout { q_tile: 0, ..wrong_shape };
    assert_eq!(
        block_sparse_forward(&spec(), qkv, &zero_tile, DenseConfig::default(), ()),
        Err(OracleError::ZeroDimension { argument: "q_tile" })
    );
}

#[test]
fn the_exact_set_is_selected_blocks_plus_the_local_window_within_the_visible_keys() {
    // 10 keys, blocks of 4 (0..4, 4..8, 8..10), query aligned at key 6, causal: keys 0..=6 visible.
    let visible = Array1::from_shape_fn(10, |j| j <= 6);
    let config = ExactSetConfig { block_size: 4, local_window: 2 };
    let e = exact_set(visible.view(), 6, &[0, 2], config);
    let expected: Vec<usize> =
        (0..10).filter(|&j| visible[j] && (j < 4 || (8..10).contains(&j) || (5..=6).contains(&j))).collect();
    assert_eq!(e.iter().enumerate().filter(|(_, x)| **x).map(|(j, _)| j).collect::<Vec<_>>(), expected);
    let no_window = exact_set(visible.view(), 6, &[1], ExactSetConfig { local_window: 0, ..config });
    assert_eq!(no_window.iter().filter(|x| **x).count(), 3, "keys 4, 5, 6 of block 1");
}

#[test]
fn visibility_is_the_mask_and_the_listed_tiles() {
    // Head 0 lists KV tile 0 for query tile 0, nothing for tile 1, tiles 1 and 2 for tile 2. Causal bottom-right with
    // Lq = 5, Lk = 7: query i sees keys j ≤ i + 2.
    let lists = vec![0, -1, -1, -1, -1, -1, 1, 2, -1, 0, 1, 2, 0, 1, 2, 0, 1, 2];
    let l = layout(lists, 3);
    let spec = spec();
    let seq = spec.sequences()[0];
    let visible = l.visibility(&spec, &seq, 0);
    for i in 0..5 {
        for j in 0..7 {
            let listed = match i / 2 {
                0 => j / 3 == 0,
                1 => false,
                _ => (1..=2).contains(&(j / 3)),
            };
            assert_eq!(visible[[i, j]], listed && j <= i + 2, "query {i}, key {j}");
        }
    }
}

/// Two sequences, B = 2 by `cu_seqlens`: Lq = 5, 3 and Lk = 7, 3, so with tiles of 2 queries and 3 keys the first has
/// 3 query tiles over 3 KV tiles and the second 2 query tiles over 1 KV tile (its third list row is padding).
fn varlen_spec() -> AttentionSpec {
    AttentionSpec {
        layout: attnproof_oracle::Layout::Varlen { cu_seqlens_q: vec![0, 5, 8], cu_seqlens_k: vec![0, 7, 10] },
        ..AttentionSpec::dense(1, 2, 1, 0, 0, 2, 3)
    }
}

/// A valid one-wide layout of [`varlen_spec`] (every row lists its sequence's KV tile 0), then `edit` applied.
fn varlen_layout(edit: impl FnOnce(&mut Array4<i32>)) -> BlockSparseLayout {
    let mut lists = Array4::from_shape_fn((2, 2, 3, 1), |(s, _, a, _)| if s == 1 && a == 2 { -1 } else { 0 });
    edit(&mut lists);
    BlockSparseLayout { q_tile: 2, kv_tile: 3, lists }
}

#[test]
fn list_rows_past_a_sequence_s_own_tiles_must_be_padding() {
    assert_eq!(varlen_layout(|_| ()).validate(&varlen_spec()), Ok(()));
    // Row 2 of the second sequence is past its 2 query tiles: even KV tile 0 is out of range there.
    let err = varlen_layout(|l| l[[1, 0, 2, 0]] = 0).validate(&varlen_spec()).unwrap_err();
    match err {
        OracleError::IndexList { argument: "lists", position, reason } => {
            // (sequence 1 · Hq + head 0) · 3 tiles + tile 2.
            assert_eq!(position, vec![2 * 3 + 2, 0]);
            assert!(reason.contains("out of range 0..0"), "{reason}");
        }
        other => panic!("expected an index-list error, got {other:?}"),
    }
}

#[test]
fn a_bad_list_entry_is_reported_at_its_row_and_slot() {
    // The second sequence has one KV tile, so index 1 is out of range at (sequence 1, head 1, tile 1): flattened row
    // (1 · Hq + 1) · n_tiles + 1 = 10.
    let err = varlen_layout(|l| l[[1, 1, 1, 0]] = 1).validate(&varlen_spec()).unwrap_err();
    assert_eq!(
        err,
        OracleError::IndexList { argument: "lists", position: vec![10, 0], reason: "index 1 out of range 0..1".into() }
    );
    // The same index is fine in the first sequence, whose keys span 3 tiles.
    assert_eq!(varlen_layout(|l| l[[0, 1, 1, 0]] = 2).validate(&varlen_spec()), Ok(()));
}
