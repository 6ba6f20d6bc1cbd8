//! Block-sparse attention (E14) over `−1`-padded per-query-tile KV tile lists, as a kernel runs
//! it: the forward's query tile `a` visits only the KV tiles of its list `C_a`, in list order,
//! with the online softmax; the backward transposes the lists of each (sequence, head) into CSR
//! (KV tile → the query tiles that list it, E20) so that each KV tile owns its dK/dV and
//! iterates only over its listed query tiles, and each query tile owns its dQ and iterates over
//! its own list (strategy A of E10a: `P` is recomputed in both traversals).
//!
//! Precision recipe: that of [`crate::sparse`] (the dense recipe, unchanged). Lists are read
//! directly (never through a mask predicate); the spec's mask is applied inside each listed tile
//! through [`crate::mask::visible`]. Listing every tile of every query tile reproduces
//! [`crate::flash::flash_forward`] and [`crate::backward::flash_backward`] (strategy
//! `TwoTraversals`) bit for bit: a listed tile holding no visible key for a row rescales by
//! `exp(0) = 1` and adds zeros.

use std::ops::Range;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::block_sparse::BlockSparseLayout;
use attnproof_oracle::nsa::{BlockQueries, transpose_selection};
use attnproof_oracle::spec::{Operand, Sequence};
use ndarray::{Array1, Array2, Axis, Slice};
use rayon::prelude::*;

use crate::backward::{
    BackwardInputs, BackwardOutputs, Head, HeadGrads, add_dq_tile, add_kv_tile, backward_heads, tile_p_ds, write_rows,
};
use crate::element::Element;
use crate::error::ReferenceError;
use crate::flash::{ForwardOutputs, Inputs, check_input, check_output, head_f32, scale_f32};
use crate::mask::{kv_head, visible};
use crate::sparse::{RowState, dot32};
use crate::tile::TileConfig;

/// Rows `[a·tile, min((a+1)·tile, len))`.
fn tile_range(a: usize, tile: usize, len: usize) -> Range<usize> {
    a * tile..((a + 1) * tile).min(len)
}

/// The valid prefix of the list of query tile `a` of (sequence, head). Call after validation.
fn list_of(layout: &BlockSparseLayout, seq: &Sequence, head: usize, a: usize) -> Vec<usize> {
    let row = layout.lists.index_axis(Axis(0), seq.index);
    let row = row.index_axis(Axis(0), head);
    row.row(a).iter().take_while(|&&b| b >= 0).map(|&b| b as usize).collect()
}

/// Checks tile sizes (typed [`ReferenceError::ZeroTile`]) and the lists (shape, range, order,
/// padding: the oracle layout's own validation, so both sides accept the same lists).
fn validate_layout(spec: &AttentionSpec, layout: &BlockSparseLayout) -> Result<TileConfig, ReferenceError> {
    spec.validate()?;
    let tiles = TileConfig { q_tile: layout.q_tile, kv_tile: layout.kv_tile };
    tiles.validate()?;
    layout.validate(spec)?;
    Ok(tiles)
}

/// E20 for tiles: the lists of (sequence `seq`, query head `head`) transposed to KV tile → query
/// tiles that list it, in CSR form (`offsets[n_kv_tiles + 1]`, query tiles ascending within a KV
/// tile). The lists' rows are the "queries" of the oracle's [`transpose_selection`], whose
/// semantics fit exactly (rows validated by the E14 convention against `⌈Lk/kv_tile⌉`).
pub fn transpose_lists(
    spec: &AttentionSpec,
    layout: &BlockSparseLayout,
    seq: &Sequence,
    head: usize,
) -> Result<BlockQueries, ReferenceError> {
    validate_layout(spec, layout)?;
    transpose_validated(layout, seq, head)
}

/// [`transpose_lists`] on an already validated layout.
fn transpose_validated(
    layout: &BlockSparseLayout,
    seq: &Sequence,
    head: usize,
) -> Result<BlockQueries, ReferenceError> {
    let own_tiles = seq.len_q.div_ceil(layout.q_tile);
    let lists = layout.lists.index_axis(Axis(0), seq.index);
    let lists = lists.index_axis(Axis(0), head);
    let own = lists.slice_axis(Axis(0), Slice::from(0..own_tiles));
    Ok(transpose_selection(own, seq.len_k.div_ceil(layout.kv_tile))?)
}

/// Forward of one (sequence, head): every query tile over its list; `(O [Lq, dv], LSE [Lq])`.
fn head_forward<T: Element>(
    spec: &AttentionSpec,
    layout: &BlockSparseLayout,
    seq: &Sequence,
    head: usize,
    qkv: [&Array2<f32>; 3],
    scale: f32,
) -> (Array2<f32>, Array1<f32>) {
    let [q, k, v] = qkv;
    let dv = v.ncols();
    let mut o = Array2::<f32>::zeros((seq.len_q, dv));
    let mut lse = Array1::from_elem(seq.len_q, f32::NEG_INFINITY);
    for a in 0..seq.len_q.div_ceil(layout.q_tile) {
        let rows = tile_range(a, layout.q_tile, seq.len_q);
        let mut states = vec![RowState::new(dv); rows.len()];
        for b in list_of(layout, seq, head, a) {
            let keys = tile_range(b, layout.kv_tile, seq.len_k);
            for (state, i) in states.iter_mut().zip(rows.clone()) {
                let s: Vec<f32> = keys
                    .clone()
                    .map(|j| {
                        if visible(&spec.mask, i, j, seq.len_q, seq.len_k) {
                            dot32(q.row(i), k.row(j)) * scale
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                    .collect();
                state.update::<T>(&s, |jj, c| v[[keys.start + jj, c]]);
            }
        }
        for (state, i) in states.iter().zip(rows) {
            let (o_row, l) = state.finish::<T>();
            o.row_mut(i).assign(&Array1::from(o_row));
            lse[i] = l;
        }
    }
    (o, lse)
}

/// E14 block-sparse forward into caller-owned outputs, parallel over (sequence, head). Query tile
/// `a` of head `h` visits the KV tiles `layout.lists[b, h, a, ..]` (valid prefix, in list order);
/// an empty list gives `O = 0`, `LSE = −∞` on the whole tile.
pub fn block_sparse_forward<T: Element>(
    spec: &AttentionSpec,
    inputs: &Inputs<'_, T>,
    layout: &BlockSparseLayout,
    out: ForwardOutputs<'_, T>,
) -> Result<(), ReferenceError> {
    validate_layout(spec, layout)?;
    check_input(spec, "q", Operand::Q, &inputs.q)?;
    check_input(spec, "k", Operand::K, &inputs.k)?;
    check_input(spec, "v", Operand::V, &inputs.v)?;
    let ForwardOutputs { mut o, mut lse } = out;
    check_output(spec, "o", Operand::O, &o)?;
    check_output(spec, "lse", Operand::RowStat, &lse)?;
    let scale = scale_f32(spec);
    let tasks: Vec<(Sequence, usize)> =
        spec.sequences().into_iter().flat_map(|s| (0..spec.n_heads_q).map(move |h| (s, h))).collect();
    let results: Vec<(Array2<f32>, Array1<f32>)> = tasks
        .par_iter()
        .map(|(seq, h)| {
            let kv = kv_head(*h, spec.n_heads_q, spec.n_heads_kv);
            let q = head_f32(spec, &inputs.q, seq, *h, false);
            let k = head_f32(spec, &inputs.k, seq, kv, true);
            let v = head_f32(spec, &inputs.v, seq, kv, true);
            head_forward::<T>(spec, layout, seq, *h, [&q, &k, &v], scale)
        })
        .collect();
    for ((seq, h), (o_head, lse_head)) in tasks.iter().zip(results) {
        write_rows(&mut o, spec.head_slice(seq, *h, false), &o_head);
        lse.slice_mut(spec.row_stat_slice(seq, *h)).assign(&lse_head);
    }
    Ok(())
}

fn head_backward<T: Element>(
    spec: &AttentionSpec,
    layout: &BlockSparseLayout,
    seq: &Sequence,
    h: usize,
    head: &Head,
    csr: &BlockQueries,
    scale: f32,
) -> HeadGrads {
    let (len_q, d) = head.q.dim();
    let (len_k, dv) = head.v.dim();
    let delta = Array1::from_shape_fn(len_q, |i| dot32(head.d_out.row(i), head.o.row(i)));
    let mut g = HeadGrads {
        dq: Array2::zeros((len_q, d)),
        dk: Array2::zeros((len_k, d)),
        dv: Array2::zeros((len_k, dv)),
        delta: delta.clone(),
    };
    // dK/dV: KV tile b owns its rows and visits the query tiles that list it (the CSR transpose).
    for b in 0..csr.n_blocks() {
        let keys = tile_range(b, layout.kv_tile, len_k);
        for &a in csr.queries_of(b) {
            let rows = tile_range(a as usize, layout.q_tile, len_q);
            let (p, ds) = tile_p_ds::<T>(spec, seq, head, &delta, &rows, &keys, scale);
            add_kv_tile::<T>(&mut g, head, &p, &ds, &rows, &keys);
        }
    }
    // dQ: query tile a owns its rows and visits its own list, recomputing P and dS.
    for a in 0..len_q.div_ceil(layout.q_tile) {
        let rows = tile_range(a, layout.q_tile, len_q);
        for b in list_of(layout, seq, h, a) {
            let keys = tile_range(b, layout.kv_tile, len_k);
            let (_, ds) = tile_p_ds::<T>(spec, seq, head, &delta, &rows, &keys, scale);
            add_dq_tile(&mut g.dq, head, &ds, &rows, &keys);
        }
    }
    g.dq.mapv_inplace(|x| x * scale);
    g.dk.mapv_inplace(|x| x * scale);
    g
}

/// E14 block-sparse backward through the CSR transpose of the lists (E20) into caller-owned
/// outputs, parallel over (sequence, query head); dK/dV of a KV head summed over its query heads
/// in ascending head order. `inputs.o`/`inputs.lse` are the block-sparse forward's.
pub fn block_sparse_backward<T: Element>(
    spec: &AttentionSpec,
    inputs: &BackwardInputs<'_, T>,
    layout: &BlockSparseLayout,
    out: BackwardOutputs<'_, T>,
) -> Result<(), ReferenceError> {
    validate_layout(spec, layout)?;
    let scale = scale_f32(spec);
    backward_heads(spec, inputs, out, &|seq, h, head| {
        let csr = transpose_validated(layout, seq, h)?;
        Ok(head_backward::<T>(spec, layout, seq, h, head, &csr, scale))
    })
}
