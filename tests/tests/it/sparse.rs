//! The sparse reference schedules (E14, E16, E18–E20) verified against the f64 oracle under the
//! dense rounding-error model, through the predicate re-expression of `attnproof_harness::sparse`:
//! block-sparse forward (per-head lists) and backward through the CSR transpose (lists shared
//! within a KV group), DSA token-gather forward, NSA selection forward/backward; bf16 and f16;
//! PISA's tail over pooled keys (E22, against the PISA oracle with the schedule's own statistics),
//! HiLS's factorized output (E21, the kernel's f64 order over the oracle's routing, both masses),
//! plus the named edge cases (out-of-range entries, empty lists, CSR round trip, bit-for-bit
//! agreement with the dense schedules when everything is listed, and the predicate encodings
//! against the oracle's own sparse functions).

use attnproof_harness::backward::BackwardCandidate;
use attnproof_harness::flash::recipe;
use attnproof_harness::generate::{Distribution, ValueProfile, make_case, make_d_out};
use attnproof_harness::hils_output::verify_hils_output;
use attnproof_harness::hils_routing::oracle_routing;
use attnproof_harness::pisa_tail::{PooledStatistics, exact_layout, verify_pisa_tail};
use attnproof_harness::sparse::{
    SparseHarnessError, dsa_case, heads_of, listed_tiles_mask, nsa_group_case, stack_heads, stack_row_stats, sub_case,
    verify_block_sparse_backward, verify_block_sparse_forward, verify_dsa_forward, verify_nsa_group_forward,
    visited_tiles,
};
use attnproof_harness::strategies::{HilsDraw, hils_draws, interesting_length, layout, profile, suite_config};
use attnproof_harness::{Case, HarnessError, Verdict};
use attnproof_oracle::block_sparse::BlockSparseLayout;
use attnproof_oracle::nsa::selection_from_csr;
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Layout, Mask, OracleError, Scale};
use attnproof_reference::backward::{BackwardInputs, BackwardOutputs, BackwardStrategy, flash_backward};
use attnproof_reference::sparse::hils::hils_forward;
use attnproof_reference::sparse::pisa::{POOLED_TILE, TailOutputs, pisa_tail_forward};
use attnproof_reference::sparse::{
    DsaConfig, DsaInputs, DsaOutputs, SelectionBackwardInputs, SelectionConfig, SelectionGradients, SelectionInputs,
    SelectionOutputs, block_sparse_backward, block_sparse_forward, dsa_forward, nsa_selection_backward,
    nsa_selection_forward, transpose_lists,
};
use attnproof_reference::{Element, ForwardOutputs, ReferenceError, TileConfig, flash_forward_owned};
use half::{bf16, f16};
use ndarray::{Array2, Array3, Array4, ArrayD, Axis, Ix3};
use proptest::prelude::*;

const TILE: usize = 8;

// ---------------------------------------------------------------------------------------------
// Shared helpers

fn nan<T: Element>(shape: Vec<usize>) -> ArrayD<T> {
    ArrayD::from_elem(shape, T::from_f32(f32::NAN))
}

fn same_bits<T: Element>(x: &ArrayD<T>, y: &ArrayD<T>) -> bool {
    x.shape() == y.shape() && x.iter().zip(y.iter()).all(|(p, q)| p.to_f32().to_bits() == q.to_f32().to_bits())
}

/// Every verdict passes and discriminates; a model whose hypothesis fails rejects the case.
fn judge(what: &str, verdicts: Result<Vec<Verdict>, SparseHarnessError>) -> Result<(), TestCaseError> {
    match verdicts {
        Ok(vs) => {
            for (n, v) in vs.iter().enumerate() {
                prop_assert!(v.passed(), "{what} #{n}:\n{v}");
                prop_assert!(v.valid(), "{what} #{n}:\n{v}");
            }
            Ok(())
        }
        Err(SparseHarnessError::Harness(HarnessError::Model(m))) => Err(TestCaseError::reject(m.to_string())),
        Err(e) => Err(TestCaseError::fail(format!("{what}: {e}"))),
    }
}

fn single(r: Result<Verdict, HarnessError>) -> Result<Vec<Verdict>, SparseHarnessError> {
    Ok(vec![r?])
}

// ---------------------------------------------------------------------------------------------
// Block-sparse

/// Problems around the tile size: dense or varlen (zero-length sequences included), GQA groups
/// 1–4, causal (mostly) or unmasked, small head dims (59 included).
fn block_spec() -> impl Strategy<Value = AttentionSpec> {
    let heads = prop_oneof![Just((1usize, 1usize)), Just((2, 1)), Just((4, 2)), Just((3, 1)), Just((4, 1))];
    let dims = prop::sample::select(vec![1usize, 8, 16, 59]);
    let mask = prop_oneof![3 => Just(Mask::Causal), 1 => Just(Mask::None)];
    (layout(TILE), heads, dims.clone(), dims, mask).prop_map(
        |(layout, (n_heads_q, n_heads_kv), head_dim, head_dim_v, mask)| AttentionSpec {
            layout,
            n_heads_q,
            n_heads_kv,
            head_dim,
            head_dim_v,
            scale: Scale::InverseSqrtHeadDim,
            mask,
        },
    )
}

/// A valid layout for `spec` from `picks[row][b]` ("list KV tile b"), one row per (sequence,
/// head, query tile), or per (sequence, KV head, query tile) replicated over the group when
/// `shared`. Width: one more than the most KV tiles, so every row is `−1` padded.
fn layout_from(spec: &AttentionSpec, tiles: TileConfig, picks: &[Vec<bool>], shared: bool) -> BlockSparseLayout {
    let seqs = spec.sequences();
    let n_q = seqs.iter().map(|s| s.len_q.div_ceil(tiles.q_tile)).max().unwrap_or(0);
    let n_k = seqs.iter().map(|s| s.len_k.div_ceil(tiles.kv_tile)).max().unwrap_or(0);
    let mut lists = Array4::from_elem((seqs.len(), spec.n_heads_q, n_q, n_k + 1), -1i32);
    for seq in &seqs {
        for h in 0..spec.n_heads_q {
            let owner = if shared { spec.kv_head(h) } else { h };
            let owners = if shared { spec.n_heads_kv } else { spec.n_heads_q };
            for a in 0..seq.len_q.div_ceil(tiles.q_tile) {
                let row = &picks[(seq.index * owners + owner) * n_q + a];
                let chosen = (0..seq.len_k.div_ceil(tiles.kv_tile)).filter(|&b| row[b]);
                for (w, b) in chosen.enumerate() {
                    lists[[seq.index, h, a, w]] = b as i32;
                }
            }
        }
    }
    BlockSparseLayout { q_tile: tiles.q_tile, kv_tile: tiles.kv_tile, lists }
}

/// A block-sparse problem: spec, tiles, value profile, seed and the tile picks.
fn block_problem(
    shared: bool,
) -> impl Strategy<Value = (AttentionSpec, TileConfig, ValueProfile, u64, Vec<Vec<bool>>)> {
    let tiles = prop::sample::select(vec![(8usize, 8usize), (8, 4), (4, 8)])
        .prop_map(|(q_tile, kv_tile)| TileConfig { q_tile, kv_tile });
    (block_spec(), tiles, profile(), any::<u64>()).prop_flat_map(move |(spec, tiles, profile, seed)| {
        let seqs = spec.sequences();
        let n_q = seqs.iter().map(|s| s.len_q.div_ceil(tiles.q_tile)).max().unwrap_or(0);
        let n_k = seqs.iter().map(|s| s.len_k.div_ceil(tiles.kv_tile)).max().unwrap_or(0);
        let owners = if shared { spec.n_heads_kv } else { spec.n_heads_q };
        let rows = seqs.len() * owners * n_q;
        // Mostly listed (so that rows see keys), sometimes not.
        let picks = prop::collection::vec(prop::collection::vec(prop::bool::weighted(0.6), n_k), rows);
        (Just(spec), Just(tiles), Just(profile), Just(seed), picks)
    })
}

fn bs_forward<T: Element>(
    case: &Case<T>,
    layout: &BlockSparseLayout,
) -> Result<(ArrayD<T>, ArrayD<f32>), ReferenceError> {
    let mut o = nan::<T>(case.spec.expected_shape(Operand::O));
    let mut lse = ArrayD::from_elem(case.spec.expected_shape(Operand::RowStat), f32::NAN);
    block_sparse_forward(&case.spec, &case.inputs(), layout, ForwardOutputs { o: o.view_mut(), lse: lse.view_mut() })?;
    Ok((o, lse))
}

/// NaN-poisoned gradients after one backward run: `(dQ, dK, dV, D)`.
type Grads<T> = (ArrayD<T>, ArrayD<T>, ArrayD<T>, ArrayD<f32>);

fn bs_backward<T: Element>(
    case: &Case<T>,
    layout: &BlockSparseLayout,
    o: &ArrayD<T>,
    lse: &ArrayD<f32>,
    d_out: &ArrayD<T>,
) -> Result<Grads<T>, ReferenceError> {
    let spec = &case.spec;
    let (mut dq, mut dk, mut dv) = (
        nan::<T>(spec.expected_shape(Operand::Q)),
        nan::<T>(spec.expected_shape(Operand::K)),
        nan::<T>(spec.expected_shape(Operand::V)),
    );
    let mut delta = ArrayD::from_elem(spec.expected_shape(Operand::RowStat), f32::NAN);
    let inputs = case.backward_inputs(o, lse, d_out);
    let out = BackwardOutputs { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut(), delta: delta.view_mut() };
    block_sparse_backward(spec, &inputs, layout, out)?;
    Ok((dq, dk, dv, delta))
}

fn fail(e: ReferenceError) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

fn check_block_forward<T: Element>(case: &Case<T>, layout: &BlockSparseLayout) -> Result<(), TestCaseError> {
    let (o, lse) = bs_forward(case, layout).map_err(fail)?;
    let verdicts = verify_block_sparse_forward(case, layout, recipe::<T>(layout.kv_tile), o.view(), lse.view());
    // One verdict per (sequence, query head): a verifier that judged fewer would pass what it never saw.
    if let Ok(vs) = &verdicts {
        prop_assert_eq!(vs.len(), case.spec.sequences().len() * case.spec.n_heads_q);
    }
    judge("block-sparse forward", verdicts)
}

fn check_block_backward<T: Element>(
    case: &Case<T>,
    layout: &BlockSparseLayout,
    d_out: &ArrayD<T>,
) -> Result<(), TestCaseError> {
    let (o, lse) = bs_forward(case, layout).map_err(fail)?;
    let r = recipe::<T>(layout.kv_tile);
    judge("block-sparse forward", verify_block_sparse_forward(case, layout, r, o.view(), lse.view()))?;
    let (dq, dk, dv, delta) = bs_backward(case, layout, &o, &lse, d_out).map_err(fail)?;
    let candidate = BackwardCandidate { dq: dq.view(), dk: dk.view(), dv: dv.view(), delta: delta.view() };
    judge("block-sparse backward", verify_block_sparse_backward(case, layout, d_out, layout.q_tile, r, candidate))
}

// ---------------------------------------------------------------------------------------------
// DSA

/// A DSA problem: `T`, `H`, `d`, `dv`, `κ`, gather chunk, profile, seed, per-query picks.
type DsaProblem = (usize, usize, usize, usize, usize, usize, ValueProfile, u64, Vec<Vec<bool>>);

fn dsa_problem() -> impl Strategy<Value = DsaProblem> {
    let dims = prop::sample::select(vec![1usize, 8, 16, 59]);
    (
        prop_oneof![interesting_length(TILE), Just(40usize)],
        1usize..=4,
        dims.clone(),
        dims,
        prop::sample::select(vec![1usize, 4, 16, 64]),
        prop::sample::select(vec![4usize, 8]),
        profile(),
        any::<u64>(),
    )
        .prop_flat_map(|(len, h, d, dv, kappa, tile, profile, seed)| {
            let picks = prop::collection::vec(prop::collection::vec(prop::bool::weighted(0.5), len), len);
            (Just(len), Just(h), Just(d), Just(dv), Just(kappa), Just(tile), Just(profile), Just(seed), picks)
        })
}

/// Selection `[T, κ]`: the picked causal tokens of each query, the first `κ` of them.
fn dsa_selection(len: usize, kappa: usize, picks: &[Vec<bool>]) -> Array2<i32> {
    let mut sel = Array2::from_elem((len, kappa), -1i32);
    for t in 0..len {
        for (w, s) in (0..=t).filter(|&s| picks[t][s]).take(kappa).enumerate() {
            sel[[t, w]] = s as i32;
        }
    }
    sel
}

/// Random `[T, H, d]` queries and shared `[T, d]` keys, `[T, dv]` values in `T`.
fn dsa_values<T: Element>(
    len: usize,
    h: usize,
    d: usize,
    dv: usize,
    profile: ValueProfile,
    seed: u64,
) -> (Array3<T>, Array2<T>, Array2<T>) {
    let spec = AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: vec![0, len as i32], cu_seqlens_k: vec![0, len as i32] },
        n_heads_q: h,
        n_heads_kv: 1,
        head_dim: d,
        head_dim_v: dv,
        scale: Scale::InverseSqrtHeadDim,
        mask: Mask::Causal,
    };
    let c = make_case::<T>(&spec, profile, seed);
    let q = c.q.into_dimensionality::<Ix3>().expect("[T, H, d]");
    let k = c.k.into_dimensionality::<Ix3>().expect("[T, 1, d]").index_axis_move(Axis(1), 0);
    let v = c.v.into_dimensionality::<Ix3>().expect("[T, 1, dv]").index_axis_move(Axis(1), 0);
    (q, k, v)
}

fn run_dsa<T: Element>(
    q: &Array3<T>,
    k: &Array2<T>,
    v: &Array2<T>,
    sel: &Array2<i32>,
    tile: usize,
) -> Result<(Array3<T>, Array2<f32>), ReferenceError> {
    let (len, h, _) = q.dim();
    let mut o = Array3::from_elem((len, h, v.ncols()), T::from_f32(f32::NAN));
    let mut lse = Array2::from_elem((h, len), f32::NAN);
    let inputs = DsaInputs { query: q.view(), key: k.view(), value: v.view(), selection: sel.view() };
    let config = DsaConfig { kv_tile: tile, scale: Scale::InverseSqrtHeadDim };
    dsa_forward(&inputs, config, DsaOutputs { o: o.view_mut(), lse: lse.view_mut() })?;
    Ok((o, lse))
}

fn check_dsa<T: Element>(p: DsaProblem) -> Result<(), TestCaseError> {
    let (len, h, d, dv, kappa, tile, profile, seed, picks) = p;
    let (q, k, v) = dsa_values::<T>(len, h, d, dv, profile, seed);
    let sel = dsa_selection(len, kappa, &picks);
    let (o, lse) = run_dsa(&q, &k, &v, &sel, tile).map_err(fail)?;
    let verdict = verify_dsa_forward(
        q.view(),
        k.view(),
        v.view(),
        sel.view(),
        recipe::<T>(tile),
        o.into_dyn().view(),
        lse.into_dyn().view(),
    );
    judge("DSA forward", single(verdict))
}

// ---------------------------------------------------------------------------------------------
// NSA selection

/// An NSA problem: `T`, `Hkv`, `G`, `d`, `dv`, block, profile, seed, picks per (t, kv).
type NsaProblem = (usize, usize, usize, usize, usize, usize, ValueProfile, u64, Vec<Vec<bool>>);

fn nsa_problem() -> impl Strategy<Value = NsaProblem> {
    let dims = prop::sample::select(vec![1usize, 8, 16, 59]);
    (
        prop_oneof![interesting_length(TILE), Just(40usize)],
        1usize..=2,
        1usize..=4,
        dims.clone(),
        dims,
        prop::sample::select(vec![4usize, 8]),
        profile(),
        any::<u64>(),
    )
        .prop_flat_map(|(len, hkv, g, d, dv, block, profile, seed)| {
            let picks =
                prop::collection::vec(prop::collection::vec(prop::bool::weighted(0.6), len.div_ceil(block)), len * hkv);
            (Just(len), Just(hkv), Just(g), Just(d), Just(dv), Just(block), Just(profile), Just(seed), picks)
        })
}

/// Selection `[T, Hkv, M + 1]` from the picks (future blocks allowed: they add nothing).
fn nsa_selection(len: usize, hkv: usize, block: usize, picks: &[Vec<bool>]) -> Array3<i32> {
    let m = len.div_ceil(block);
    let mut sel = Array3::from_elem((len, hkv, m + 1), -1i32);
    for t in 0..len {
        for kv in 0..hkv {
            for (w, b) in (0..m).filter(|&b| picks[t * hkv + kv][b]).enumerate() {
                sel[[t, kv, w]] = b as i32;
            }
        }
    }
    sel
}

/// `q [T, Hq, d]`, `k [T, Hkv, d]`, `v [T, Hkv, dv]`, `dO [T, Hq, dv]` in `T`.
fn nsa_values<T: Element>(
    len: usize,
    hkv: usize,
    g: usize,
    d: usize,
    dv: usize,
    profile: ValueProfile,
    seed: u64,
) -> [Array3<T>; 4] {
    let spec = AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: vec![0, len as i32], cu_seqlens_k: vec![0, len as i32] },
        n_heads_q: hkv * g,
        n_heads_kv: hkv,
        head_dim: d,
        head_dim_v: dv,
        scale: Scale::InverseSqrtHeadDim,
        mask: Mask::Causal,
    };
    let c = make_case::<T>(&spec, profile, seed);
    let three = |a: ArrayD<T>| a.into_dimensionality::<Ix3>().expect("[T, H, D]");
    [three(c.q), three(c.k), three(c.v), three(make_d_out::<T>(&spec, seed))]
}

/// NSA forward then backward, NaN-poisoned: `(O, LSE, dQ, dK, dV, D)`.
type NsaRun<T> = (Array3<T>, Array2<f32>, Array3<T>, Array3<T>, Array3<T>, Array2<f32>);

fn run_nsa<T: Element>(x: &[Array3<T>; 4], sel: &Array3<i32>, block: usize) -> Result<NsaRun<T>, ReferenceError> {
    let [q, k, v, d_out] = x;
    let (len, hq, _) = q.dim();
    let config = SelectionConfig { select_block: block, scale: Scale::InverseSqrtHeadDim };
    let fwd = SelectionInputs { q: q.view(), k: k.view(), v: v.view(), selection: sel.view() };
    let poison = |s: (usize, usize, usize)| Array3::from_elem(s, T::from_f32(f32::NAN));
    let mut o = poison((len, hq, v.dim().2));
    let mut lse = Array2::from_elem((hq, len), f32::NAN);
    nsa_selection_forward(&fwd, config, SelectionOutputs { o: o.view_mut(), lse: lse.view_mut() })?;
    let (mut dq, mut dk, mut dv) = (poison(q.dim()), poison(k.dim()), poison(v.dim()));
    let mut delta = Array2::from_elem((hq, len), f32::NAN);
    let inputs = SelectionBackwardInputs { forward: fwd, o: o.view(), lse: lse.view(), d_out: d_out.view() };
    let out = SelectionGradients { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut(), delta: delta.view_mut() };
    nsa_selection_backward(&inputs, config, out)?;
    Ok((o, lse, dq, dk, dv, delta))
}

fn check_nsa<T: Element>(x: &[Array3<T>; 4], sel: &Array3<i32>, block: usize) -> Result<(), TestCaseError> {
    let (o, lse, dq, dk, dv, delta) = run_nsa(x, sel, block).map_err(fail)?;
    let [q, k, v, d_out] = x;
    let (hq, hkv) = (q.dim().1, k.dim().1);
    let g = hq / hkv;
    let r = recipe::<T>(block);
    for kv in 0..hkv {
        let heads = kv * g..(kv + 1) * g;
        let case = nsa_group_case(q.view(), k.view(), v.view(), sel.view(), kv, block, Scale::InverseSqrtHeadDim);
        let o_sub = heads_of(o.view().into_dyn(), 1, heads.clone());
        let lse_sub = heads_of(lse.view().into_dyn(), 0, heads.clone());
        let verdict = verify_nsa_group_forward(&case, sel.view(), kv, block, r, o_sub.view(), lse_sub.view());
        judge("NSA forward", single(verdict))?;
        let d_out_sub = heads_of(d_out.view().into_dyn(), 1, heads.clone());
        let (dq_s, dk_s, dv_s, delta_s) = (
            heads_of(dq.view().into_dyn(), 1, heads.clone()),
            heads_of(dk.view().into_dyn(), 1, kv..kv + 1),
            heads_of(dv.view().into_dyn(), 1, kv..kv + 1),
            heads_of(delta.view().into_dyn(), 0, heads.clone()),
        );
        let candidate = BackwardCandidate { dq: dq_s.view(), dk: dk_s.view(), dv: dv_s.view(), delta: delta_s.view() };
        let verdict = attnproof_harness::backward::verify_backward(&case, &d_out_sub, block, r, candidate);
        judge("NSA backward", single(verdict))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Fuzz suites

/// PISA's tail schedule on `case` over `layout` (the exact lists formed by the harness), with its statistics read as
/// the kernel's workspace.
fn run_pisa_tail<T: Element>(
    case: &Case<T>,
    layout: &BlockSparseLayout,
) -> Result<(TailOutputs<T>, PooledStatistics), ReferenceError> {
    let out = pisa_tail_forward(&case.spec, &case.inputs(), &exact_layout(&case.spec, layout))?;
    let flat: Vec<f64> = out.pooled.iter().map(|x| f64::from(x.to_f32())).collect();
    let pooled = PooledStatistics::from_workspace(&case.spec, layout.kv_tile, &flat).expect("the schedule's layout");
    Ok((out, pooled))
}

fn check_pisa_tail<T: Element>(case: &Case<T>, layout: &BlockSparseLayout) -> Result<(), TestCaseError> {
    let (out, pooled) = run_pisa_tail(case, layout).map_err(fail)?;
    let recipes = (recipe::<T>(layout.kv_tile), recipe::<T>(POOLED_TILE));
    match verify_pisa_tail(case, layout, recipes, &pooled, out.o.view(), out.lse.view()) {
        Ok(v) => {
            prop_assert!(v.passed(), "{v:?}");
            Ok(())
        }
        Err(HarnessError::Model(m)) => Err(TestCaseError::reject(m.to_string())),
        Err(e) => Err(TestCaseError::fail(e.to_string())),
    }
}

/// HiLS's forward by its CPU schedule (`attnproof_reference::sparse::hils`, the kernel's order) over the oracle's
/// routing, judged by the output verifier; with the oracle's summaries as the router's, so the routing's own check is
/// the oracle against itself.
fn check_hils<T: Element>(draw: &HilsDraw) -> Result<(), TestCaseError> {
    let (case, landmarks) = draw.case::<T>();
    let fail = |e: &dyn std::fmt::Display| TestCaseError::fail(e.to_string());
    let (summaries, lists, _) = oracle_routing(&case, landmarks.view(), draw.config).map_err(|e| fail(&e))?;
    let spec = &case.spec;
    let mut o = ArrayD::from_elem(spec.expected_shape(Operand::O), T::from_f32(f32::NAN));
    let mut lse = ArrayD::from_elem(spec.expected_shape(Operand::RowStat), f32::NAN);
    let out = ForwardOutputs { o: o.view_mut(), lse: lse.view_mut() };
    hils_forward(spec, &case.inputs(), (draw.config, draw.mass), summaries.view(), lists.view(), out)
        .map_err(|e| fail(&e))?;
    let v = verify_hils_output(&case, landmarks.view(), draw.config, draw.mass, lists.view(), (o.view(), lse.view()))
        .map_err(|e| fail(&e))?;
    prop_assert!(v.passed(), "{v:?}");
    Ok(())
}

proptest! {
    #![proptest_config(suite_config("hils", 6))]

    #[test]
    // Up to 700 tokens with chunks of 1 to 100, both masses, value head dims 1 to 256.
    fn hils_forward_bf16(draw in hils_draws()) {
        check_hils::<bf16>(&draw)?;
    }

    #[test]
    fn hils_forward_f16(draw in hils_draws()) {
        check_hils::<f16>(&draw)?;
    }
}

proptest! {
    #![proptest_config(suite_config("sparse", 16))]

    #[test]
    // Tiles of 4 and 8 keys over up to a few hundred keys: tails of more than one tile of 64 pooled keys.
    fn pisa_tail_bf16((spec, tiles, profile, seed, picks) in block_problem(false)) {
        let layout = layout_from(&spec, tiles, &picks, false);
        check_pisa_tail(&make_case::<bf16>(&spec, profile, seed), &layout)?;
    }

    #[test]
    fn pisa_tail_f16((spec, tiles, profile, seed, picks) in block_problem(false)) {
        let layout = layout_from(&spec, tiles, &picks, false);
        check_pisa_tail(&make_case::<f16>(&spec, profile, seed), &layout)?;
    }

    #[test]
    fn block_sparse_forward_per_head_lists_bf16((spec, tiles, profile, seed, picks) in block_problem(false)) {
        let layout = layout_from(&spec, tiles, &picks, false);
        check_block_forward(&make_case::<bf16>(&spec, profile, seed), &layout)?;
    }

    #[test]
    fn block_sparse_forward_per_head_lists_f16((spec, tiles, profile, seed, picks) in block_problem(false)) {
        let layout = layout_from(&spec, tiles, &picks, false);
        check_block_forward(&make_case::<f16>(&spec, profile, seed), &layout)?;
    }

    #[test]
    // Lists per query head here (a GQA group's heads list different tiles), per KV head in f16.
    fn block_sparse_backward_bf16((spec, tiles, profile, seed, picks) in block_problem(false)) {
        let layout = layout_from(&spec, tiles, &picks, false);
        check_block_backward(&make_case::<bf16>(&spec, profile, seed), &layout, &make_d_out(&spec, seed))?;
    }

    #[test]
    fn block_sparse_backward_f16((spec, tiles, profile, seed, picks) in block_problem(true)) {
        let layout = layout_from(&spec, tiles, &picks, true);
        check_block_backward(&make_case::<f16>(&spec, profile, seed), &layout, &make_d_out(&spec, seed))?;
    }

    #[test]
    fn dsa_forward_bf16(p in dsa_problem()) {
        check_dsa::<bf16>(p)?;
    }

    #[test]
    fn dsa_forward_f16(p in dsa_problem()) {
        check_dsa::<f16>(p)?;
    }

    #[test]
    fn nsa_selection_bf16((len, hkv, g, d, dv, block, profile, seed, picks) in nsa_problem()) {
        let x = nsa_values::<bf16>(len, hkv, g, d, dv, profile, seed);
        check_nsa(&x, &nsa_selection(len, hkv, block, &picks), block)?;
    }

    #[test]
    fn nsa_selection_f16((len, hkv, g, d, dv, block, profile, seed, picks) in nsa_problem()) {
        let x = nsa_values::<f16>(len, hkv, g, d, dv, profile, seed);
        check_nsa(&x, &nsa_selection(len, hkv, block, &picks), block)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Named edge cases

const GAUSS: ValueProfile = ValueProfile { distribution: Distribution::Gaussian, logit_scale: 1.0, value_mean: 0.0 };

fn is_index_error(r: Result<(), ReferenceError>, argument: &str) -> bool {
    matches!(r, Err(ReferenceError::Problem(OracleError::IndexList { argument: a, .. })) if a == argument)
}

#[test]
fn a_list_entry_beyond_the_tile_count_is_a_typed_error() {
    let spec = AttentionSpec::dense(1, 2, 1, 16, 20, 8, 8).with_mask(Mask::Causal);
    let case = make_case::<bf16>(&spec, GAUSS, 1);
    let tiles = TileConfig { q_tile: 8, kv_tile: 8 };
    // Lk = 20 has 3 KV tiles: entry 3 is one past the end.
    let mut layout = layout_from(&spec, tiles, &vec![vec![true; 3]; 2], true);
    layout.lists[[0, 1, 1, 1]] = 3;
    layout.lists[[0, 1, 1, 2]] = -1;
    let mut o = nan::<bf16>(spec.expected_shape(Operand::O));
    let mut lse = ArrayD::from_elem(spec.expected_shape(Operand::RowStat), f32::NAN);
    let r =
        block_sparse_forward(&spec, &case.inputs(), &layout, ForwardOutputs { o: o.view_mut(), lse: lse.view_mut() });
    assert!(is_index_error(r, "lists"), "forward accepted an out-of-range tile");
    let d_out = make_d_out::<bf16>(&spec, 1);
    let r = bs_backward(&case, &layout, &o, &lse, &d_out).map(|_| ());
    assert!(is_index_error(r, "lists"), "backward accepted an out-of-range tile");
    // Unsorted and duplicated lists are refused too.
    let mut dup = layout_from(&spec, tiles, &vec![vec![true; 3]; 2], true);
    dup.lists[[0, 0, 0, 1]] = 0;
    assert!(is_index_error(bs_forward(&case, &dup).map(|_| ()), "lists"));
    let mut zero = layout_from(&spec, tiles, &vec![vec![true; 3]; 2], true);
    zero.kv_tile = 0;
    assert!(matches!(bs_forward(&case, &zero), Err(ReferenceError::ZeroTile { argument: "kv_tile" })));
    // DSA: a key after its query, and a token past the end.
    let (q, k, v) = dsa_values::<bf16>(6, 2, 8, 8, GAUSS, 2);
    let mut sel = dsa_selection(6, 3, &vec![vec![true; 6]; 6]);
    sel[[1, 2]] = 4;
    assert!(is_index_error(run_dsa(&q, &k, &v, &sel, 4).map(|_| ()), "selection"), "DSA accepted a future key");
    let mut sel = dsa_selection(6, 3, &vec![vec![true; 6]; 6]);
    sel[[5, 2]] = 6;
    assert!(is_index_error(run_dsa(&q, &k, &v, &sel, 4).map(|_| ()), "selection"), "DSA accepted token 6 of 6");
    // NSA: block M of M.
    let x = nsa_values::<bf16>(10, 1, 2, 8, 8, GAUSS, 3);
    let mut sel = nsa_selection(10, 1, 4, &vec![vec![true; 3]; 10]);
    sel[[7, 0, 2]] = 3;
    sel[[7, 0, 3]] = -1;
    assert!(is_index_error(run_nsa(&x, &sel, 4).map(|_| ()), "selection"), "NSA accepted block 3 of 3");
}

/// Whether `r` is the shape error of `argument`.
fn is_shape_error(r: Result<(), ReferenceError>, argument: &str) -> bool {
    matches!(r, Err(ReferenceError::Problem(OracleError::ShapeMismatch { argument: a, .. })) if a == argument)
}

/// Whether `r` is the non-finite error of `argument`.
fn is_non_finite_error(r: Result<(), ReferenceError>, argument: &str) -> bool {
    matches!(r, Err(ReferenceError::Problem(OracleError::NonFinite { argument: a, .. })) if a == argument)
}

#[test]
fn sparse_schedules_refuse_misshapen_and_non_finite_inputs_with_typed_errors() {
    // DSA: keys of the wrong length, a NaN query.
    let (q, k, v) = dsa_values::<bf16>(6, 2, 8, 8, GAUSS, 2);
    let sel = dsa_selection(6, 3, &vec![vec![true; 6]; 6]);
    assert!(run_dsa(&q, &k, &v, &sel, 4).is_ok(), "the unchanged DSA problem runs");
    let short = k.slice(ndarray::s![..5, ..]).to_owned();
    assert!(is_shape_error(run_dsa(&q, &short, &v, &sel, 4).map(|_| ()), "key"), "DSA accepted 5 keys for 6 queries");
    let mut bad = q.clone();
    bad[[3, 1, 2]] = bf16::NAN;
    assert!(is_non_finite_error(run_dsa(&bad, &k, &v, &sel, 4).map(|_| ()), "query"), "DSA accepted a NaN query");
    // NSA: values of the wrong head count, an infinite key.
    let x = nsa_values::<bf16>(10, 1, 2, 8, 8, GAUSS, 3);
    let sel = nsa_selection(10, 1, 4, &vec![vec![true; 3]; 10]);
    assert!(run_nsa(&x, &sel, 4).is_ok(), "the unchanged NSA problem runs");
    let mut wide = x.clone();
    wide[2] = Array3::from_elem((10, 2, 8), bf16::ONE);
    assert!(is_shape_error(run_nsa(&wide, &sel, 4).map(|_| ()), "v"), "NSA accepted values for two KV heads");
    let mut bad = x.clone();
    bad[1][[9, 0, 7]] = bf16::INFINITY;
    assert!(is_non_finite_error(run_nsa(&bad, &sel, 4).map(|_| ()), "k"), "NSA accepted an infinite key");
    // NSA: three query heads cannot share two KV heads.
    let x = nsa_values::<bf16>(10, 2, 2, 8, 8, GAUSS, 4);
    let sel = nsa_selection(10, 2, 4, &vec![vec![true; 3]; 20]);
    let mut three = x.clone();
    three[0] = x[0].slice(ndarray::s![.., ..3, ..]).to_owned();
    three[3] = x[3].slice(ndarray::s![.., ..3, ..]).to_owned();
    let r = run_nsa(&three, &sel, 4).map(|_| ());
    assert!(
        matches!(r, Err(ReferenceError::Problem(OracleError::HeadRatio { n_heads_q: 3, n_heads_kv: 2 }))),
        "NSA accepted 3 query heads over 2 KV heads: {r:?}"
    );
    // A bad selection entry is reported at its flattened row `t · Hkv + kv` (token 3, KV head 1: row 7).
    let mut sel_bad = sel.clone();
    sel_bad[[3, 1, 0]] = 3;
    match run_nsa(&x, &sel_bad, 4).map(|_| ()) {
        Err(ReferenceError::Problem(OracleError::IndexList { argument: "selection", position, .. })) => {
            assert_eq!(position[0], 7, "{position:?}")
        }
        other => panic!("NSA accepted block 3 of 3 at token 3, KV head 1: {other:?}"),
    }
}

#[test]
fn an_empty_list_row_gives_a_fully_masked_query_tile() {
    let spec = AttentionSpec::dense(1, 2, 1, 16, 16, 8, 8);
    let case = make_case::<f16>(&spec, GAUSS, 7);
    let tiles = TileConfig { q_tile: 8, kv_tile: 8 };
    // Query tile 0 lists nothing; query tile 1 lists KV tile 0 only, so KV tile 1 is listed by
    // nobody.
    let layout = layout_from(&spec, tiles, &[vec![false, false], vec![true, false]], true);
    let (o, lse) = bs_forward(&case, &layout).expect("valid");
    for h in 0..2 {
        for i in 0..8 {
            assert_eq!(lse[[0, h, i]], f32::NEG_INFINITY, "LSE of an empty tile");
            assert!((0..8).all(|c| o[[0, h, i, c]].to_f32() == 0.0), "O of an empty tile");
        }
        assert!(lse[[0, h, 8]].is_finite());
    }
    let d_out = make_d_out::<f16>(&spec, 7);
    let (dq, dk, dv, delta) = bs_backward(&case, &layout, &o, &lse, &d_out).expect("valid");
    for h in 0..2 {
        for i in 0..8 {
            assert!((0..8).all(|c| dq[[0, h, i, c]].to_f32() == 0.0), "dQ of an empty tile");
            assert_eq!(delta[[0, h, i]], 0.0);
        }
    }
    for j in 8..16 {
        assert!((0..8).all(|c| dk[[0, 0, j, c]].to_f32() == 0.0 && dv[[0, 0, j, c]].to_f32() == 0.0), "unlisted tile");
    }
    assert!((0..8).any(|c| dk[[0, 0, 0, c]].to_f32() != 0.0), "listed tile has gradients");
    let candidate = BackwardCandidate { dq: dq.view(), dk: dk.view(), dv: dv.view(), delta: delta.view() };
    let r = recipe::<f16>(8);
    let fwd = verify_block_sparse_forward(&case, &layout, r, o.view(), lse.view()).expect("verifiable");
    let bwd = verify_block_sparse_backward(&case, &layout, &d_out, layout.q_tile, r, candidate).expect("verifiable");
    assert!(fwd.iter().chain(&bwd).all(|v| v.passed() && v.valid()));
}

#[test]
fn the_tile_csr_transpose_round_trips() {
    let spec = AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: vec![0, 19, 19, 40], cu_seqlens_k: vec![0, 33, 40, 45] },
        ..AttentionSpec::dense(1, 2, 1, 1, 1, 4, 4)
    };
    let tiles = TileConfig { q_tile: 4, kv_tile: 8 };
    let picks: Vec<Vec<bool>> = (0..3 * 2 * 6).map(|r| (0..5).map(|b| (r * 7 + b * 3) % 5 < 3).collect()).collect();
    let layout = layout_from(&spec, tiles, &picks, false);
    let width = layout.lists.dim().3;
    let mut nonempty = 0;
    for seq in spec.sequences() {
        let own = seq.len_q.div_ceil(4);
        for h in 0..2 {
            let csr = transpose_lists(&spec, &layout, &seq, h).expect("valid");
            assert_eq!(csr.n_blocks(), seq.len_k.div_ceil(8));
            let back = selection_from_csr(&csr, own, width).expect("a valid CSR");
            for a in 0..own {
                let original: Vec<i32> = (0..width).map(|w| layout.lists[[seq.index, h, a, w]]).collect();
                assert_eq!(back.row(a).to_vec(), original, "sequence {}, head {h}, tile {a}", seq.index);
                for b in 0..csr.n_blocks() {
                    assert_eq!(csr.queries_of(b).contains(&(a as i32)), original.contains(&(b as i32)));
                }
            }
            nonempty += csr.indices.len();
        }
    }
    assert!(nonempty > 0);
}

/// Every tile listed, ascending: the block-sparse schedules must equal the dense ones bit for bit
/// (forward, and backward against strategy `TwoTraversals`, which it mirrors).
fn every_tile_listed_matches_dense<T: Element>(spec: &AttentionSpec, tiles: TileConfig, seed: u64) {
    let case = make_case::<T>(spec, GAUSS, seed);
    let n_k = spec.sequences().iter().map(|s| s.len_k.div_ceil(tiles.kv_tile)).max().unwrap_or(0);
    let n_q = spec.sequences().iter().map(|s| s.len_q.div_ceil(tiles.q_tile)).max().unwrap_or(0);
    let picks = vec![vec![true; n_k]; spec.sequences().len() * spec.n_heads_q * n_q];
    let layout = layout_from(spec, tiles, &picks, false);
    let (o, lse) = bs_forward(&case, &layout).expect("valid");
    let (o_dense, lse_dense) = flash_forward_owned(spec, &case.inputs(), tiles).expect("valid");
    assert!(same_bits(&o, &o_dense), "O differs from the dense forward");
    assert!(lse.iter().zip(&lse_dense).all(|(a, b)| a.to_bits() == b.to_bits()), "LSE differs");
    let d_out = make_d_out::<T>(spec, seed);
    let (dq, dk, dv, delta) = bs_backward(&case, &layout, &o, &lse, &d_out).expect("valid");
    let shape = |op| spec.expected_shape(op);
    let (mut dq2, mut dk2, mut dv2) =
        (nan::<T>(shape(Operand::Q)), nan::<T>(shape(Operand::K)), nan::<T>(shape(Operand::V)));
    let mut delta2 = ArrayD::from_elem(shape(Operand::RowStat), f32::NAN);
    let inputs = case.backward_inputs(&o, &lse, &d_out);
    let out = BackwardOutputs { dq: dq2.view_mut(), dk: dk2.view_mut(), dv: dv2.view_mut(), delta: delta2.view_mut() };
    flash_backward(spec, &inputs, tiles, BackwardStrategy::TwoTraversals, out).expect("valid");
    assert!(same_bits(&dq, &dq2) && same_bits(&dk, &dk2) && same_bits(&dv, &dv2), "gradients differ from dense");
    assert!(delta.iter().zip(&delta2).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn listing_every_tile_equals_the_dense_flash_schedule_bit_for_bit() {
    let t = TileConfig { q_tile: 8, kv_tile: 8 };
    let causal = AttentionSpec::dense(2, 4, 2, 17, 23, 16, 8).with_mask(Mask::Causal);
    every_tile_listed_matches_dense::<bf16>(&causal, t, 11);
    every_tile_listed_matches_dense::<f16>(&causal, TileConfig { q_tile: 4, kv_tile: 8 }, 12);
    let window = AttentionSpec::dense(1, 3, 1, 20, 13, 8, 59).with_mask(Mask::Window { left: 5, right: 2 });
    every_tile_listed_matches_dense::<bf16>(&window, TileConfig { q_tile: 8, kv_tile: 4 }, 13);
    let varlen = AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: vec![0, 9, 9, 26], cu_seqlens_k: vec![0, 16, 21, 30] },
        mask: Mask::Causal,
        ..AttentionSpec::dense(1, 2, 2, 1, 1, 8, 8)
    };
    every_tile_listed_matches_dense::<f16>(&varlen, t, 14);
}

#[test]
fn selecting_everything_equals_the_dense_flash_schedule_bit_for_bit() {
    // NSA with every block selected is causal attention with kv_tile = select_block; DSA with
    // every causal token selected is causal MQA attention with kv_tile = the gather chunk.
    let (len, hkv, g, block) = (21, 2, 3, 4);
    let x = nsa_values::<bf16>(len, hkv, g, 8, 16, GAUSS, 21);
    let sel = nsa_selection(len, hkv, block, &vec![vec![true; len.div_ceil(block)]; len * hkv]);
    let (o, lse, dq, dk, dv, _) = run_nsa(&x, &sel, block).expect("valid");
    let spec = AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: vec![0, len as i32], cu_seqlens_k: vec![0, len as i32] },
        mask: Mask::Causal,
        ..AttentionSpec::dense(1, hkv * g, hkv, 1, 1, 8, 16)
    };
    let [q, k, v, d_out] = &x;
    let case = Case { spec: spec.clone(), q: q.clone().into_dyn(), k: k.clone().into_dyn(), v: v.clone().into_dyn() };
    let tiles = TileConfig { q_tile: 8, kv_tile: block };
    let (o_dense, lse_dense) = flash_forward_owned(&spec, &case.inputs(), tiles).expect("valid");
    assert!(same_bits(&o.clone().into_dyn(), &o_dense), "NSA O differs from dense");
    assert!(lse.iter().zip(&lse_dense).all(|(a, b)| a.to_bits() == b.to_bits()), "NSA LSE differs");
    let shape = |op| spec.expected_shape(op);
    let (mut dq2, mut dk2, mut dv2) =
        (nan::<bf16>(shape(Operand::Q)), nan::<bf16>(shape(Operand::K)), nan::<bf16>(shape(Operand::V)));
    let mut delta2 = ArrayD::from_elem(shape(Operand::RowStat), f32::NAN);
    let (o_d, lse_d, d_out_d) = (o.clone().into_dyn(), lse.clone().into_dyn(), d_out.clone().into_dyn());
    let inputs = BackwardInputs {
        q: case.q.view(),
        k: case.k.view(),
        v: case.v.view(),
        o: o_d.view(),
        lse: lse_d.view(),
        d_out: d_out_d.view(),
    };
    let out = BackwardOutputs { dq: dq2.view_mut(), dk: dk2.view_mut(), dv: dv2.view_mut(), delta: delta2.view_mut() };
    flash_backward(&spec, &inputs, tiles, BackwardStrategy::TwoTraversals, out).expect("valid");
    assert!(same_bits(&dq.into_dyn(), &dq2), "NSA dQ differs from dense");
    assert!(same_bits(&dk.into_dyn(), &dk2) && same_bits(&dv.into_dyn(), &dv2), "NSA dK/dV differ from dense");

    let (q, k, v) = dsa_values::<f16>(len, 3, 8, 8, GAUSS, 22);
    let sel = dsa_selection(len, len, &vec![vec![true; len]; len]);
    let (o, lse) = run_dsa(&q, &k, &v, &sel, 4).expect("valid");
    let case = dsa_case(q.view(), k.view(), v.view(), sel.view());
    let spec = case.spec.clone().with_mask(Mask::Causal);
    let (o_dense, lse_dense) =
        flash_forward_owned(&spec, &case.inputs(), TileConfig { q_tile: 8, kv_tile: 4 }).expect("valid");
    assert!(same_bits(&o.into_dyn(), &o_dense), "DSA O differs from dense");
    assert!(lse.iter().zip(&lse_dense).all(|(a, b)| a.to_bits() == b.to_bits()), "DSA LSE differs");
}

/// MPFR working precision for comparing two encodings of the same attention: the two paths
/// order their sums differently, so they agree to about this many bits, not bit for bit.
const ENCODING_PRECISION: attnproof_oracle::Precision = attnproof_oracle::Precision(128);
/// Bits two exact-arithmetic encodings must share (128-bit arithmetic over at most a few hundred
/// terms loses under 10 bits).
const ENCODING_BITS: attnproof_proofs::Bits = attnproof_proofs::Bits(100.0);

fn mp<D: ndarray::Dimension>(a: &ndarray::Array<f64, D>) -> ndarray::Array<attnproof_oracle::Mp, D> {
    a.mapv(|x| attnproof_oracle::Mp::new(x, ENCODING_PRECISION))
}

fn agree(what: &'static str, a: &ArrayD<attnproof_oracle::Mp>, b: &ArrayD<attnproof_oracle::Mp>) {
    attnproof_proofs::residual::agree("predicate encoding", what, a, b, ENCODING_BITS)
        .unwrap_or_else(|e| panic!("{e}"));
}

/// The predicate masks the verifier builds encode the same attention as the oracle's sparse
/// functions: both computed in MPFR, they agree to 100 bits.
#[test]
fn the_predicate_encodings_match_the_oracles_sparse_functions() {
    use attnproof_oracle::{DenseConfig, Mp, Qkv, forward};
    let prec = ENCODING_PRECISION;
    // Block-sparse: per-head sub-problems vs block_sparse_forward over the whole problem.
    let spec = AttentionSpec::dense(2, 4, 2, 19, 21, 8, 8).with_mask(Mask::Causal);
    let case = make_case::<bf16>(&spec, GAUSS, 31);
    let tiles = TileConfig { q_tile: 4, kv_tile: 8 };
    let picks: Vec<Vec<bool>> = (0..2 * 4 * 5).map(|r| (0..3).map(|b| (r + b) % 3 != 0).collect()).collect();
    let layout = layout_from(&spec, tiles, &picks, false);
    let [q, k, v] = case.widened().map(|t| mp(&t));
    let whole = attnproof_oracle::block_sparse::block_sparse_forward(
        &spec,
        Qkv { q: q.view(), k: k.view(), v: v.view() },
        &layout,
        DenseConfig::default(),
        prec,
    )
    .expect("valid");
    for seq in spec.sequences() {
        for h in 0..4 {
            let sub = sub_case(&case, &seq, h..h + 1, listed_tiles_mask(&spec, &layout, &seq, h));
            let [sq, sk, sv] = sub.widened().map(|t| mp(&t));
            let f = forward(&sub.spec, Qkv { q: sq.view(), k: sk.view(), v: sv.view() }, DenseConfig::default(), prec)
                .expect("valid");
            agree("block-sparse O", &f.o, &stack_heads(&spec, whole.o.view(), &seq, h..h + 1, false));
        }
    }
    // DSA: the predicate case vs token_sparse_attention.
    let (q, k, v) = dsa_values::<bf16>(13, 3, 8, 4, GAUSS, 32);
    let picks: Vec<Vec<bool>> = (0..13).map(|t| (0..13).map(|s| (t * 5 + s * 3) % 4 != 0).collect()).collect();
    let sel = dsa_selection(13, 5, &picks);
    let case = dsa_case(q.view(), k.view(), v.view(), sel.view());
    let [cq, ck, cv] = case.widened().map(|t| mp(&t));
    let f = forward(&case.spec, Qkv { q: cq.view(), k: ck.view(), v: cv.view() }, DenseConfig::default(), prec)
        .expect("valid");
    let w3 = |a: &Array3<bf16>| mp(&a.mapv(|x| x.to_f32() as f64));
    let w2 = |a: &Array2<bf16>| mp(&a.mapv(|x| x.to_f32() as f64));
    let (tq, tk, tv) = (w3(&q), w2(&k), w2(&v));
    let tok = attnproof_oracle::dsa::token_sparse_attention::<Mp>(
        attnproof_oracle::dsa::TokenSparseInputs {
            query: tq.view(),
            key: tk.view(),
            value: tv.view(),
            selection: sel.view(),
        },
        Default::default(),
        prec,
    )
    .expect("valid");
    agree("DSA O", &f.o, &tok.o.into_dyn());
    agree("DSA LSE", &f.lse, &tok.lse.into_dyn());
    // NSA: per-KV-head cases vs selected_attention.
    let (len, hkv, g, block) = (23, 2, 2, 4);
    let x = nsa_values::<bf16>(len, hkv, g, 8, 8, GAUSS, 33);
    let picks: Vec<Vec<bool>> = (0..len * hkv).map(|r| (0..6).map(|b| (r + 2 * b) % 3 != 1).collect()).collect();
    let sel = nsa_selection(len, hkv, block, &picks);
    let (qm, km, vm) = (w3(&x[0]), w3(&x[1]), w3(&x[2]));
    let config = attnproof_oracle::nsa::NsaConfig { select_block: block, n_selected: 6, ..Default::default() };
    let whole = attnproof_oracle::nsa::selected_attention::<Mp>(
        attnproof_oracle::nsa::NsaInputs { q: qm.view(), k: km.view(), v: vm.view() },
        sel.view(),
        &config,
        prec,
    )
    .expect("valid");
    for kv in 0..hkv {
        let case =
            nsa_group_case(x[0].view(), x[1].view(), x[2].view(), sel.view(), kv, block, Scale::InverseSqrtHeadDim);
        let [cq, ck, cv] = case.widened().map(|t| mp(&t));
        let f = forward(&case.spec, Qkv { q: cq.view(), k: ck.view(), v: cv.view() }, DenseConfig::default(), prec)
            .expect("valid");
        agree("NSA O", &f.o, &heads_of(whole.view().into_dyn(), 1, kv * g..(kv + 1) * g));
    }
}

#[test]
fn nsa_with_64_token_blocks_and_a_gqa_group_of_four_is_within_bound() {
    let (len, hkv, g, block) = (150, 2, 4, 64);
    for (n, profile) in [GAUSS, ValueProfile { distribution: Distribution::Peaked, logit_scale: 4.0, value_mean: 3.0 }]
        .into_iter()
        .enumerate()
    {
        let picks: Vec<Vec<bool>> = (0..len * hkv).map(|r| (0..3).map(|b| (r + b) % 4 != 3).collect()).collect();
        let sel = nsa_selection(len, hkv, block, &picks);
        check_nsa(&nsa_values::<bf16>(len, hkv, g, 16, 16, profile, 40 + n as u64), &sel, block).expect("within bound");
        check_nsa(&nsa_values::<f16>(len, hkv, g, 16, 16, profile, 50 + n as u64), &sel, block).expect("within bound");
    }
}

/// The heads of a GQA group may list different tiles: the backward verifier judges each head's
/// contribution to the group's dK/dV under its own lists, so the reference passes, and a candidate
/// computed as if both heads had the first head's lists fails.
#[test]
fn the_backward_verifier_judges_group_heads_with_different_lists() {
    let spec = AttentionSpec::dense(1, 2, 1, 8, 8, 4, 4);
    let case = make_case::<bf16>(&spec, GAUSS, 60);
    let tiles = TileConfig { q_tile: 8, kv_tile: 4 };
    let layout = layout_from(&spec, tiles, &[vec![true, false], vec![true, true]], false);
    let d_out = make_d_out::<bf16>(&spec, 60);
    let r = recipe::<bf16>(4);
    let judge_grads = |grads: &Grads<bf16>| {
        let (dq, dk, dv, delta) = grads;
        let candidate = BackwardCandidate { dq: dq.view(), dk: dk.view(), dv: dv.view(), delta: delta.view() };
        let verdicts = verify_block_sparse_backward(&case, &layout, &d_out, 8, r, candidate).expect("verifiable");
        assert_eq!(verdicts.len(), 1);
        verdicts[0].passed() && verdicts[0].valid()
    };
    let (o, lse) = bs_forward(&case, &layout).expect("valid");
    assert!(judge_grads(&bs_backward(&case, &layout, &o, &lse, &d_out).expect("valid")), "the reference");
    let first_head_lists = layout_from(&spec, tiles, &[vec![true, false], vec![true, false]], false);
    let (o1, lse1) = bs_forward(&case, &first_head_lists).expect("valid");
    let wrong = bs_backward(&case, &first_head_lists, &o1, &lse1, &d_out).expect("valid");
    assert!(!judge_grads(&wrong), "gradients under the first head's lists for both heads");
}

/// Regression (`cargo xtask fuzz`, sparse.txt): causal 9×7, four query heads on one KV head,
/// d = 59, dv = 1, heavy-tailed logits at scale 100, f16. Rows are nearly one-hot, so "scale 1/d"
/// barely moves dV, and the backward bound — which charged the dominant key's score error twice,
/// once through `s` and once through `LSE` — could not reject it. With the backward recomputing
/// the forward's scores bit for bit, those two errors cancel (`ScoreReuse::BitwiseAsForward`),
/// and the gate holds.
#[test]
fn peaked_rows_at_logit_scale_100_keep_the_backward_gate_valid() {
    let spec = AttentionSpec::dense(1, 4, 1, 9, 7, 59, 1).with_mask(Mask::Causal);
    let tiles = TileConfig { q_tile: 4, kv_tile: 8 };
    let profile = ValueProfile { distribution: Distribution::HeavyTail, logit_scale: 100.0, value_mean: 0.0 };
    let seed = 8267731471133192057;
    let layout = layout_from(&spec, tiles, &[vec![true], vec![false], vec![false]], true);
    check_block_backward(&make_case::<f16>(&spec, profile, seed), &layout, &make_d_out(&spec, seed))
        .expect("verdict passes and the gate is valid");
}

/// The block-sparse forward verifier scores the gate's "dropped selected block" wrong answer on
/// every (sequence, head): where the last listed tile of a query tile holds visible mass, the
/// oracle's output without it must be applicable and rejected. Here every query tile lists both
/// KV tiles, so dropping the second moves `O` by far more than its bound.
#[test]
fn the_forward_gate_scores_the_dropped_selected_block() {
    let spec = AttentionSpec::dense(1, 2, 1, 16, 16, 8, 8);
    let case = make_case::<bf16>(&spec, GAUSS, 70);
    let layout = layout_from(&spec, TileConfig { q_tile: 8, kv_tile: 8 }, &[vec![true, true], vec![true, true]], true);
    let (o, lse) = bs_forward(&case, &layout).expect("valid");
    let verdicts = verify_block_sparse_forward(&case, &layout, recipe::<bf16>(8), o.view(), lse.view()).expect("ok");
    assert_eq!(verdicts.len(), 2, "one verdict per (sequence, query head)");
    for v in &verdicts {
        let dropped: Vec<_> = v.gate.canned.iter().filter(|c| c.name == "dropped selected block").collect();
        assert!(!dropped.is_empty(), "no dropped-block wrong answer scored:\n{v}");
        assert!(dropped.iter().all(|c| c.applicable && c.rejected), "{dropped:?}");
        assert!(v.passed() && v.valid(), "{v}");
    }
}

/// The block-sparse bound charges a row the rescale steps of its query block's listed tiles (E14's merge count),
/// counted by hand here: the longest list of the sequence's own query blocks, times the tiles one block touches.
#[test]
fn the_block_sparse_bound_charges_the_listed_tiles_only() {
    // Two sequences; lists [B = 2, H = 1, 3 query blocks, width 3]: sequence 0 lists 1, 3 and 2 blocks, sequence 1
    // (one own query block) lists 2, and a past-the-end query block that lists nothing.
    let lists =
        Array4::from_shape_vec((2, 1, 3, 3), vec![0, -1, -1, 0, 1, 2, 1, 2, -1, 0, 3, -1, -1, -1, -1, -1, -1, -1])
            .unwrap();
    let seq = |index, len_q| attnproof_oracle::spec::Sequence { index, q_start: 0, len_q, k_start: 0, len_k: 400 };
    for (block, tile, per_block) in [(64, 64, 1), (128, 64, 2), (64, 128, 1), (48, 64, 2), (96, 64, 3), (64, 16, 4)] {
        let layout = BlockSparseLayout { q_tile: 64, kv_tile: block, lists: lists.clone() };
        assert_eq!(visited_tiles(&layout, &seq(0, 150), 0, tile), 3 * per_block, "block {block}, tile {tile}");
        assert_eq!(visited_tiles(&layout, &seq(1, 60), 0, tile), 2 * per_block, "block {block}, tile {tile}");
        assert_eq!(visited_tiles(&layout, &seq(0, 60), 0, tile), per_block, "only the first query block is own");
    }
}

/// The block-sparse verdict charges the listed tiles' rescale steps: against the dense verdict of the same
/// visibility, which charges every tile of the keys, its bound is tighter, so the same candidate's worst ratio is
/// larger (each query tile lists one of the 8 key tiles).
#[test]
fn the_block_sparse_verdict_is_tighter_than_every_tile_charged() {
    let spec = AttentionSpec::dense(1, 1, 1, 16, 64, 8, 8);
    let case = make_case::<bf16>(&spec, GAUSS, 71);
    let one = |b: usize| (0..8).map(|j| j == b).collect::<Vec<bool>>();
    let layout = layout_from(&spec, TileConfig { q_tile: 8, kv_tile: 8 }, &[one(0), one(5)], false);
    let (o, lse) = bs_forward(&case, &layout).expect("valid");
    let r = recipe::<bf16>(8);
    let sparse = verify_block_sparse_forward(&case, &layout, r, o.view(), lse.view()).expect("verifiable");
    let seq = spec.sequences()[0];
    let sub = sub_case(&case, &seq, 0..1, listed_tiles_mask(&spec, &layout, &seq, 0));
    let o_sub = stack_heads(&spec, o.view(), &seq, 0..1, false);
    let lse_sub = stack_row_stats(&spec, lse.view(), &seq, 0..1);
    let every = attnproof_harness::verify_forward(&sub, r, o_sub.view(), lse_sub.view()).expect("verifiable");
    assert!(sparse[0].passed() && every.passed(), "{}\n{every}", sparse[0]);
    for (s, e) in sparse[0].outputs.iter().zip(&every.outputs) {
        assert!(
            s.max_ratio > e.max_ratio && e.max_ratio > 0.0,
            "{}: {} against {}",
            s.output,
            s.max_ratio,
            e.max_ratio
        );
    }
}

/// A candidate of the wrong shape is a typed error of the verifier, named by its argument, for
/// `O` and for LSE alike, whichever dimension is wrong: a missing head is refused before the
/// verifier slices heads out of the candidate, never a panic.
#[test]
fn a_misshapen_block_sparse_candidate_is_a_typed_error() {
    let spec = AttentionSpec::dense(1, 2, 1, 16, 16, 8, 8);
    let case = make_case::<bf16>(&spec, GAUSS, 71);
    let layout = layout_from(&spec, TileConfig { q_tile: 8, kv_tile: 8 }, &[vec![true, false], vec![true, true]], true);
    let (o, lse) = bs_forward(&case, &layout).expect("valid");
    let r = recipe::<bf16>(8);
    let short_o = o.slice(ndarray::s![.., .., ..15, ..]).into_dyn();
    let short_lse = lse.slice(ndarray::s![.., .., ..15]).into_dyn();
    let one_head_o = o.slice(ndarray::s![.., ..1, .., ..]).into_dyn();
    let one_head_lse = lse.slice(ndarray::s![.., ..1, ..]).into_dyn();
    for (argument, result) in [
        ("o", verify_block_sparse_forward(&case, &layout, r, short_o, lse.view())),
        ("lse", verify_block_sparse_forward(&case, &layout, r, o.view(), short_lse)),
        ("o", verify_block_sparse_forward(&case, &layout, r, one_head_o, lse.view())),
        ("lse", verify_block_sparse_forward(&case, &layout, r, o.view(), one_head_lse)),
    ] {
        match result {
            Err(SparseHarnessError::Harness(HarnessError::CandidateShape { argument: a, .. })) => {
                assert_eq!(a, argument)
            }
            other => panic!("{argument}: expected a shape error, got {other:?}"),
        }
    }
}

/// Every block listed: no row has a tail, and PISA's schedule is the block-sparse forward over the same lists, bit for
/// bit. A window mask is a typed error.
#[test]
fn pisa_tail_with_every_block_listed_is_the_block_sparse_forward() {
    let spec = AttentionSpec::dense(2, 3, 1, 21, 37, 8, 16).with_mask(Mask::Causal);
    let case = make_case::<bf16>(&spec, ValueProfile::GAUSSIAN, 61);
    let tiles = TileConfig { q_tile: 8, kv_tile: 4 };
    let every = vec![vec![true; 10]; 2 * 3 * 3];
    let layout = layout_from(&spec, tiles, &every, false);
    let (out, _) = run_pisa_tail(&case, &layout).unwrap();
    let (o, lse) = bs_forward(&case, &exact_layout(&spec, &layout)).unwrap();
    assert!(same_bits(&out.o, &o) && out.lse.iter().zip(&lse).all(|(a, b)| a.to_bits() == b.to_bits()));
    let window = spec.clone().with_mask(Mask::Window { left: 3, right: 0 });
    let case = make_case::<bf16>(&window, ValueProfile::GAUSSIAN, 61);
    assert!(matches!(run_pisa_tail(&case, &layout), Err(ReferenceError::UnsupportedMask { .. })));
}
