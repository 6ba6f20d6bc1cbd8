//! The block-sparse backward (`attnproof_gpu::block_sparse::backward`, the gradients of E14) verified on the device
//! against the f64 oracle under the backward kernels' rounding-error bound with the lists' visibility of every
//! (sequence, query head), in bf16 and f16, with every dQ strategy; and its CSR transpose compared with the oracle's
//! (E20) exactly.
//!
//! The property suites draw what the forward's block-sparse suites draw (`crate::block_sparse::block_draws`: every
//! mask kind, windows, Lq ≠ Lk, tile ± 1 lengths, varlen with empty sequences, GQA groups of 1 to 16, both block sizes
//! on each side, lists per query head and per KV head, densities from nothing listed to everything), and one draw in
//! four over 1500 to 2600 keys, so that the CSR transpose has more rows than one warp of its scan covers. Each draw runs
//! the production block-sparse forward, then every strategy on inputs A, B, A with NaN-poisoned, guarded outputs and
//! unchanged inputs; every verdict must pass with a valid gate; the deterministic strategies repeat A bit for bit,
//! and all three agree on dK, dV and D bit for bit; the device's CSR transpose equals the oracle's; and a draw with
//! every block listed gives the dense backward's bits in the same tiling. Without a device each test prints
//! `skipped: no CUDA device` and passes.
//!
//! The backward with the `wgmma` KV owner (`compile::FLASH_BWD_SM90`, what the production wrapper runs on an H200 for
//! 128-key blocks) has suites of its own over the same checks ([`WGMMA_BACKWARD_SUITES`]: key blocks of 128, query
//! blocks of 64 and 128, head dims up to 128), sanitizer shapes and killing cases; they skip unless the device has
//! compute capability 9.0.

use std::cell::RefCell;
use std::sync::Arc;

use crate::block_sparse::{
    BlockDraw, BlockSuite, Density, DrawShapes, check_draws, every_list_fault_is_refused, lists_everything, lists_from,
    run_on_device, sanitizer_draws, uniform_lists,
};
use crate::common::*;
use attnproof_gpu::backward::BackwardOutput;
use attnproof_gpu::backward::Q_TILE;
use attnproof_gpu::backward::is_wgmma_backward;
use attnproof_gpu::block_sparse::backward::{block_csr_with, block_sparse_backward};
use attnproof_gpu::block_sparse::{BLOCK_SIZES, BlockLists, ListHeads};
use attnproof_gpu::compile::{FLASH_BWD, FLASH_BWD_SM90, FLASH_FWD, KernelSource, ModuleVariant};
use attnproof_gpu::flash::WGMMA_KV_TILE;
use attnproof_gpu::{
    BackwardTiling, GpuBackwardStrategy, GpuError, backward_variant, skip_unless_gpu, skip_unless_hopper,
};
use attnproof_harness::Case;
use attnproof_harness::HarnessError;
use attnproof_harness::adversarial::Worst;
use attnproof_harness::backward::BackwardExpectation;
use attnproof_harness::candidate::{
    BackwardProblem, ForwardRun, backward_guarded, block_sparse_backward_guarded, block_sparse_forward_guarded,
};
use attnproof_harness::generate::{make_case, make_d_out};
use attnproof_oracle::nsa::transpose_selection;
use attnproof_oracle::spec::Sequence;
use attnproof_oracle::{AttentionSpec, Mask};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::{Axis, s};
use proptest::test_runner::TestCaseError;

/// The two backward suites ("gpublkbw" in ASCII, plus the dtype).
pub const BACKWARD_SUITES: [BlockSuite; 2] = [
    BlockSuite {
        name: "gpu_block_sparse_backward_bf16",
        bf16: true,
        cases: 48,
        seed: 0x6770_7562_6c6b_6277,
        shapes: DrawShapes::KernelAndLongKeys,
    },
    BlockSuite {
        name: "gpu_block_sparse_backward_f16",
        bf16: false,
        cases: 48,
        seed: 0x6770_7562_6c6b_6278,
        shapes: DrawShapes::KernelAndLongKeys,
    },
];

/// The `wgmma` backward's suites ("gpuwgbwd" in ASCII, plus the dtype).
pub const WGMMA_BACKWARD_SUITES: [BlockSuite; 2] = [
    BlockSuite {
        name: "gpu_block_sparse_wgmma_backward_bf16",
        bf16: true,
        cases: 48,
        seed: 0x6770_7577_6762_7764,
        shapes: DrawShapes::WgmmaBackward,
    },
    BlockSuite {
        name: "gpu_block_sparse_wgmma_backward_f16",
        bf16: false,
        cases: 48,
        seed: 0x6770_7577_6762_7765,
        shapes: DrawShapes::WgmmaBackward,
    },
];

/// The second input's seed, from the first's.
const SECOND_INPUT: u64 = 0x9e37_79b9_7f4a_7c15;

/// The backward check of one draw by `kernel` (the forward is the production kernel) in the suite's dtype.
pub fn check_draw(
    suite: &BlockSuite,
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    worst: &RefCell<Worst>,
    draw: &BlockDraw,
) -> Result<(), TestCaseError> {
    if suite.bf16 { check::<bf16>(stream, kernel, worst, draw) } else { check::<f16>(stream, kernel, worst, draw) }
}

/// The CSR transpose built on the device by `kernel`'s transpose kernels against the oracle's (E20) of every
/// (sequence, list head), row for row.
pub fn check_csr(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    lists: &BlockLists,
    kernel: KernelSource,
) -> Result<(), String> {
    let csr = block_csr_with(stream, spec, lists, kernel).map_err(|e| format!("CSR launch: {e}"))?;
    let key_blocks = lists.key_blocks(spec);
    let list_heads = lists.lists.dim().1;
    let rows = spec.sequences().len() * list_heads * key_blocks;
    if csr.offsets.len() != rows + 1 || csr.offsets[0] != 0 {
        return Err(format!("{} offsets for {rows} rows, starting at {:?}", csr.offsets.len(), csr.offsets.first()));
    }
    for seq in spec.sequences() {
        for head in 0..list_heads {
            let selection = lists.lists.index_axis(Axis(0), seq.index);
            let selection = selection.index_axis(Axis(0), head);
            let want = transpose_selection(selection, key_blocks).map_err(|e| format!("oracle transpose: {e}"))?;
            for block in 0..key_blocks {
                let row = (seq.index * list_heads + head) * key_blocks + block;
                let (lo, hi) = (csr.offsets[row] as usize, csr.offsets[row + 1] as usize);
                let got =
                    csr.q_blocks.get(lo..hi).ok_or_else(|| format!("row {row}: offsets {lo}..{hi} out of range"))?;
                if got != want.queries_of(block) {
                    return Err(format!(
                        "sequence {}, list head {head}, key block {block}: {got:?}, the oracle {:?}",
                        seq.index,
                        want.queries_of(block)
                    ));
                }
            }
        }
    }
    Ok(())
}

fn check<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    worst: &RefCell<Worst>,
    draw: &BlockDraw,
) -> Result<(), TestCaseError> {
    let spec = &draw.spec;
    let lists = &draw.lists;
    let tiling = lists.backward_tiling();
    let layout = lists.oracle_layout(spec);
    let visibility = |seq: &Sequence, h: usize| layout.visibility(spec, seq, h);
    check_csr(stream, spec, lists, kernel).map_err(TestCaseError::fail)?;
    let inputs = [draw.seed, draw.seed ^ SECOND_INPUT].map(|seed| {
        let case = make_case::<T>(spec, draw.profile, seed);
        let d_out = make_d_out::<T>(spec, seed);
        (case, d_out)
    });
    let mut expectations = vec![];
    let mut forwards = vec![];
    for (case, d_out) in &inputs {
        let forward = block_sparse_forward_guarded(stream, case, lists, FLASH_FWD)
            .map_err(|e| TestCaseError::fail(format!("forward: {e}")))?;
        let expect =
            BackwardExpectation::with_visibility(case, d_out, Q_TILE, backward_recipe_for::<T>(tiling), &visibility);
        match expect {
            Ok(e) => expectations.push(e),
            Err(HarnessError::Model(m)) => return Err(TestCaseError::reject(m.to_string())),
            Err(e) => return Err(TestCaseError::fail(format!("expectation: {e}"))),
        }
        forwards.push(forward);
    }
    let mut first: Option<Vec<Grads<T>>> = None;
    for (n, which) in [0, 1, 0].into_iter().enumerate() {
        let (case, d_out) = &inputs[which];
        let problem = BackwardProblem { case, forward: &forwards[which], d_out };
        let mut runs = vec![];
        for strategy in GpuBackwardStrategy::ALL {
            let g = block_sparse_backward_guarded(stream, problem, lists, kernel, tiling, strategy)
                .map_err(|e| TestCaseError::fail(format!("run {n}, {strategy:?}: {e}")))?;
            let verdict = expectations[which]
                .verify(g.candidate())
                .map_err(|e| TestCaseError::fail(format!("run {n}, {strategy:?}: {e}")))?;
            if !(verdict.passed() && verdict.valid()) {
                return Err(TestCaseError::fail(format!("run {n}, {strategy:?}:\n{verdict}")));
            }
            worst.borrow_mut().record(&verdict);
            runs.push(g);
        }
        for (strategy, g) in GpuBackwardStrategy::ALL.into_iter().zip(&runs).skip(1) {
            if !g.same_dk_dv_delta(&runs[0]) {
                return Err(TestCaseError::fail(format!(
                    "run {n}: {strategy:?} differs from {:?} in dK, dV or D",
                    GpuBackwardStrategy::ALL[0]
                )));
            }
        }
        if n == 0 && lists_everything(draw) {
            for (strategy, g) in GpuBackwardStrategy::ALL.into_iter().zip(&runs) {
                let dense = backward_guarded(stream, problem, dense_backward_of(kernel), tiling, strategy)
                    .map_err(|e| TestCaseError::fail(format!("dense {strategy:?}: {e}")))?;
                let same = if strategy.is_deterministic() { dense.same(g) } else { dense.same_dk_dv_delta(g) };
                if !same {
                    return Err(TestCaseError::fail(format!(
                        "{strategy:?}: every block listed, but not the dense bits"
                    )));
                }
            }
        }
        match n {
            0 => first = Some(runs),
            2 => {
                let first = first.as_ref().expect("run 0 came first");
                for ((strategy, a), b) in GpuBackwardStrategy::ALL.into_iter().zip(first).zip(&runs) {
                    let same = if strategy.is_deterministic() { a.same(b) } else { a.same_dk_dv_delta(b) };
                    if !same {
                        return Err(TestCaseError::fail(format!("{strategy:?}: input A gave different bits")));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The dense backward whose bits a block-sparse backward of `kernel` listing every block must give: the same kernel
/// family, unpatched.
fn dense_backward_of(kernel: KernelSource) -> KernelSource {
    if is_wgmma_backward(kernel) { FLASH_BWD_SM90 } else { FLASH_BWD }
}

/// The modules the backward check of `draw` by `kernel` compiles in `suite`'s dtype: the production block-sparse
/// forward's, the CSR transpose's, the block-sparse backward's, and the dense backward's when every block is listed.
pub fn backward_variants(suite: &BlockSuite, kernel: KernelSource, draw: &BlockDraw) -> Vec<ModuleVariant> {
    fn of<T: Storage>(kernel: KernelSource, draw: &BlockDraw) -> Vec<ModuleVariant> {
        let (spec, lists) = (&draw.spec, &draw.lists);
        let mut out = vec![
            lists.forward_variant::<T>(spec, FLASH_FWD),
            lists.csr_variant(spec, kernel),
            lists.backward_variant::<T>(spec, kernel),
        ];
        if lists_everything(draw) {
            out.push(backward_variant::<T>(spec, lists.backward_tiling(), dense_backward_of(kernel)));
        }
        out.into_iter().flatten().collect()
    }
    if suite.bf16 { of::<bf16>(kernel, draw) } else { of::<f16>(kernel, draw) }
}

/// Runs `suite` with the backward `kernel`; the `wgmma` backward only on a device of compute capability 9.0
/// (elsewhere it is an `UnsupportedDevice` error and the test prints why it skips).
fn run_suite(suite: &BlockSuite, kernel: KernelSource) {
    if is_wgmma_backward(kernel) && skip_unless_hopper(suite.name).is_none() {
        return;
    }
    run_on_device(
        suite,
        |draw| backward_variants(suite, kernel, draw),
        |stream, worst, draw| check_draw(suite, stream, kernel, worst, draw),
    );
}

#[test]
fn block_sparse_backward_is_within_bound_bf16() {
    run_suite(&BACKWARD_SUITES[0], FLASH_BWD);
}

#[test]
fn block_sparse_backward_is_within_bound_f16() {
    run_suite(&BACKWARD_SUITES[1], FLASH_BWD);
}

#[test]
fn block_sparse_wgmma_backward_is_within_bound_bf16() {
    run_suite(&WGMMA_BACKWARD_SUITES[0], FLASH_BWD_SM90);
}

#[test]
fn block_sparse_wgmma_backward_is_within_bound_f16() {
    run_suite(&WGMMA_BACKWARD_SUITES[1], FLASH_BWD_SM90);
}

/// The `wgmma` backward's suites draw every combination of its block sizes (query blocks of 64 and 128 over 128-key
/// blocks), list heads and density, lists shared by a GQA group, varlen problems, and only problems it takes.
#[test]
fn the_wgmma_backward_suites_draw_every_list_feature_at_their_block_sizes() {
    let union = crate::block_sparse::suites_coverage(&WGMMA_BACKWARD_SUITES);
    println!("wgmma backward suites: {union:?}");
    let shapes = DrawShapes::WgmmaBackward;
    let unreached = union.unreached_of(&shapes.block_sizes(), &shapes.kv_block_sizes());
    assert!(unreached.is_empty(), "never drawn: {unreached:?}");
    assert!(union.shared_group_lists > 0 && union.varlen > 0, "{union:?}");
    for suite in &WGMMA_BACKWARD_SUITES {
        let mid_warpgroup_diagonals = std::cell::Cell::new(0);
        let (_, result) = suite.run(suite.default_config(), |draw| {
            proptest::prop_assert!(draw.lists.suits_wgmma_backward(&draw.spec), "{:?}", draw.spec);
            let crosses = matches!(draw.spec.mask, Mask::Causal)
                && draw.spec.sequences().iter().any(|s| {
                    s.len_k > WGMMA_KV_TILE && s.len_k >= s.len_q && (15..=62).contains(&((s.len_k - s.len_q) % 64))
                });
            mid_warpgroup_diagonals.set(mid_warpgroup_diagonals.get() + usize::from(crosses));
            Ok(())
        });
        result.unwrap_or_else(|e| panic!("{}: {e}", suite.name));
        // Every such draw whose lists hold a diagonal block catches a per-warpgroup mask decision; a handful per
        // suite makes that nearly certain.
        assert!(
            mid_warpgroup_diagonals.get() >= 6,
            "{}: {} causal draws with a mid-warpgroup diagonal",
            suite.name,
            mid_warpgroup_diagonals.get()
        );
    }
}

/// On an H200 the production block-sparse backward of 128-key blocks runs the `wgmma` kernel: its deterministic
/// outputs are that kernel's bits.
#[test]
fn the_production_block_sparse_backward_runs_the_wgmma_kernel_on_hopper() {
    let Some(ctx) = skip_unless_hopper("the_production_block_sparse_backward_runs_the_wgmma_kernel_on_hopper") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let spec = dense(1, 2, 1, 300, 400, 128, 128, Mask::Causal);
    let lists = uniform_lists(&spec, 64, 128, ListHeads::PerQueryHead, &[0, 2]);
    let case = make_case::<bf16>(&spec, gaussian(1.0), 51);
    let d_out = make_d_out::<bf16>(&spec, 51);
    let fwd = block_sparse_forward_guarded(&stream, &case, &lists, FLASH_FWD).expect("forward");
    let strategy = GpuBackwardStrategy::KvOwnerDeterministic;
    let production = backward_after_forward(&stream, &case, &lists, &fwd, &d_out, strategy).expect("production");
    let problem = BackwardProblem { case: &case, forward: &fwd, d_out: &d_out };
    let run = |kernel| {
        block_sparse_backward_guarded(&stream, problem, &lists, kernel, BackwardTiling::DEFAULT, strategy)
            .unwrap_or_else(|e| panic!("{}: {e}", kernel.name))
    };
    let bits = |x: &ndarray::ArrayD<bf16>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let wgmma = run(FLASH_BWD_SM90);
    for (name, a, b) in
        [("dQ", &production.dq, &wgmma.dq), ("dK", &production.dk, &wgmma.dk), ("dV", &production.dv, &wgmma.dv)]
    {
        assert!(bits(a) == bits(b), "{name}: the production backward's bits are not the wgmma kernel's");
    }
}

/// The backward suites' draws, replayed without a device, reach every combination of block sizes, list heads and
/// density, lists shared by a GQA group, and varlen problems.
#[test]
fn the_block_sparse_backward_suites_draw_every_list_feature() {
    let union = crate::block_sparse::suites_coverage(&BACKWARD_SUITES);
    println!("block-sparse backward suites: {union:?}");
    let sizes = BLOCK_SIZES;
    assert!(union.unreached(&sizes).is_empty(), "never drawn: {:?}", union.unreached(&sizes));
    assert!(union.shared_group_lists > 0 && union.varlen > 0, "{union:?}");
    // The transpose's scan runs a warp per 32 CSR rows: some draws must need the second warp's offsets.
    assert!(union.csr_rows_past_a_warp >= 4, "{union:?}");
}

/// The transpose on adversarial lists: everything listed, nothing listed, one key block listed by every query block
/// (a long row), lists per query head in a group of 3, varlen with an empty sequence, and more query blocks than a
/// warp's 32 lanes (the ballot's second round).
#[test]
fn the_csr_transpose_equals_the_oracles() {
    let Some(stream) = device_stream("the_csr_transpose_equals_the_oracles") else { return };
    let cases: Vec<(AttentionSpec, BlockLists)> = vec![
        {
            let spec = dense(1, 2, 1, 300, 300, 64, 64, Mask::None);
            let l = uniform_lists(&spec, 64, 64, ListHeads::PerKvHead, &[0, 1, 2, 3, 4]);
            (spec, l)
        },
        {
            let spec = dense(1, 1, 1, 200, 200, 64, 64, Mask::Causal);
            let l = uniform_lists(&spec, 64, 128, ListHeads::PerKvHead, &[]);
            (spec, l)
        },
        {
            let spec = dense(2, 3, 1, 64 * 70 + 1, 129, 64, 64, Mask::None);
            let l = uniform_lists(&spec, 64, 64, ListHeads::PerQueryHead, &[2]);
            (spec, l)
        },
        {
            let spec = varlen(&[0, 0, 190, 300], &[0, 64, 64, 400], 3, 1, 32, 32, Mask::None);
            let seqs = spec.sequences();
            let (n_q, n_k) = (3, 7);
            let picks: Vec<Vec<bool>> =
                (0..seqs.len() * 3 * n_q).map(|r| (0..n_k).map(|b| (r * 5 + b * 3) % 4 == 0).collect()).collect();
            let l = lists_from(&spec, 64, 64, ListHeads::PerQueryHead, &picks);
            (spec, l)
        },
    ];
    for (spec, lists) in &cases {
        lists.validate(spec).expect("valid lists");
        check_csr(&stream, spec, lists, FLASH_BWD).unwrap_or_else(|e| panic!("{spec:?}: {e}"));
    }
}

/// The production block-sparse backward of `case` over `lists`, after the forward run `fwd`, with `d_out`.
fn backward_after_forward(
    stream: &Arc<CudaStream>,
    case: &Case<bf16>,
    lists: &BlockLists,
    fwd: &ForwardRun<bf16>,
    d_out: &ndarray::ArrayD<bf16>,
    strategy: GpuBackwardStrategy,
) -> Result<BackwardOutput<bf16>, GpuError> {
    let (q, k, v) = (case.q.view(), case.k.view(), case.v.view());
    block_sparse_backward(stream, &case.spec, lists, q, k, v, fwd.o.view(), fwd.lse.view(), d_out.view(), strategy)
}

/// A query block that lists nothing gets dQ = 0 on its rows, and a key block no query block lists gets dK = dV = 0,
/// for every strategy.
#[test]
fn unlisted_blocks_get_zero_gradients() {
    let Some(stream) = device_stream("unlisted_blocks_get_zero_gradients") else { return };
    let spec = dense(1, 2, 1, 200, 300, 64, 64, Mask::None);
    let mut lists = uniform_lists(&spec, 64, 64, ListHeads::PerKvHead, &[1, 3]);
    lists.lists.slice_axis_mut(Axis(2), (1..2).into()).fill(-1);
    let case = make_case::<bf16>(&spec, gaussian(1.0), 31);
    let d_out = make_d_out::<bf16>(&spec, 31);
    let fwd = block_sparse_forward_guarded(&stream, &case, &lists, FLASH_FWD).expect("forward");
    for strategy in GpuBackwardStrategy::ALL {
        let g = backward_after_forward(&stream, &case, &lists, &fwd, &d_out, strategy).expect("launch");
        assert!(g.dq.slice(s![0, .., 64..128, ..]).iter().all(|x| x.to_f32() == 0.0), "{strategy:?}: dQ");
        for unlisted in [0usize, 2, 4] {
            let keys = unlisted * 64..(unlisted * 64 + 64).min(300);
            assert!(g.dk.slice(s![0, .., keys.clone(), ..]).iter().all(|x| x.to_f32() == 0.0), "{strategy:?}: dK");
            assert!(g.dv.slice(s![0, .., keys, ..]).iter().all(|x| x.to_f32() == 0.0), "{strategy:?}: dV");
        }
        assert!(g.dk.slice(s![0, .., 64..128, ..]).iter().any(|x| x.to_f32() != 0.0), "{strategy:?}: listed dK");
        assert!(g.dq.slice(s![0, .., 0..64, ..]).iter().any(|x| x.to_f32() != 0.0), "{strategy:?}: listed dQ");
    }
}

/// The deterministic dQ mode keeps one f32 partial per listed KV tile, not one per KV tile of the sequence: at 512K
/// keys (4096 KV tiles) the dense-sized workspace would be 4096 copies of Q's 128 MiB, more than the device holds,
/// while lists of the first block and the diagonal need two. Each dQ row then sums at most two partials, and a sum of
/// two is the same in either order, so the deterministic mode's dQ must equal the atomic mode's bit for bit (and
/// dK, dV, D, which do not depend on the dQ mode, too); the atomic mode is held to the oracle by the suites.
#[test]
fn the_deterministic_dq_workspace_fits_long_sequences() {
    let Some(stream) = device_stream("the_deterministic_dq_workspace_fits_long_sequences") else { return };
    let len = 512 * 1024;
    let spec = dense(1, 1, 1, len, len, 64, 64, Mask::Causal);
    let blocks = len / 128;
    let mut entries = ndarray::Array4::from_elem((1, 1, blocks, 2), -1i32);
    for a in 0..blocks {
        entries[[0, 0, a, 0]] = 0;
        if a > 0 {
            entries[[0, 0, a, 1]] = a as i32;
        }
    }
    let lists = BlockLists { q_block: 128, kv_block: 128, heads: ListHeads::PerKvHead, lists: entries };
    let case = make_case::<bf16>(&spec, gaussian(1.0), 41);
    let d_out = make_d_out::<bf16>(&spec, 41);
    let fwd = block_sparse_forward_guarded(&stream, &case, &lists, FLASH_FWD).expect("forward");
    let run = |strategy| {
        backward_after_forward(&stream, &case, &lists, &fwd, &d_out, strategy)
            .unwrap_or_else(|e| panic!("{strategy:?} at {len} keys: {e}"))
    };
    let atomic = run(GpuBackwardStrategy::KvOwnerAtomic);
    let deterministic = run(GpuBackwardStrategy::KvOwnerDeterministic);
    let bits = |x: &ndarray::ArrayD<bf16>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert!(atomic.dq.iter().any(|x| x.to_f32() != 0.0), "a dQ to compare");
    assert!(bits(&atomic.dq) == bits(&deterministic.dq), "dQ: the deterministic mode differs from the atomic one");
    assert!(bits(&atomic.dk) == bits(&deterministic.dk), "dK");
    assert!(bits(&atomic.dv) == bits(&deterministic.dv), "dV");
    let delta_bits = |x: &ndarray::ArrayD<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert!(delta_bits(&atomic.delta) == delta_bits(&deterministic.delta), "D");
}

/// Bad lists and a tiling whose KV tiles straddle key blocks are typed errors before any launch; the device stays
/// usable.
#[test]
fn bad_lists_and_tilings_are_typed_errors_before_any_launch() {
    let Some(stream) = device_stream("bad_lists_and_tilings_are_typed_errors_before_any_launch") else { return };
    let spec = dense(1, 2, 1, 150, 150, 64, 64, Mask::Causal);
    let p = problem::<bf16>(&stream, &spec, gaussian(1.0), 4);
    let good = uniform_lists(&spec, 64, 64, ListHeads::PerQueryHead, &[0, 1]);
    let run = |lists: &BlockLists| {
        block_sparse_backward(
            &stream,
            &spec,
            lists,
            p.case.q.view(),
            p.case.k.view(),
            p.case.v.view(),
            p.o.view(),
            p.lse.view(),
            p.d_out.view(),
            GpuBackwardStrategy::KvOwnerDeterministic,
        )
    };
    every_list_fault_is_refused(&good, run);
    // 128-key KV tiles over 64-key blocks.
    let forward = ForwardRun { o: p.o.clone(), lse: p.lse.clone() };
    let problem = BackwardProblem { case: &p.case, forward: &forward, d_out: &p.d_out };
    let straddling = block_sparse_backward_guarded(
        &stream,
        problem,
        &good,
        FLASH_BWD,
        BackwardTiling::DEFAULT,
        GpuBackwardStrategy::TwoTraversals,
    );
    assert!(straddling.as_ref().is_err_and(|e| e.to_string().contains("straddle")), "{:?}", straddling.map(|_| ()));
    let out = run(&good).expect("a valid launch after the refusals");
    assert!(out.dq.iter().all(|x| x.is_finite()));
}

/// The backward over [`sanitizer_draws`] (the forward's shapes), for `run.sh sanitize`: every strategy, the CSR
/// kernels included.
#[test]
fn sanitizer_shapes() {
    let Some(ctx) = skip_unless_gpu("block_sparse_backward::sanitizer_shapes") else {
        return;
    };
    check_draws(&ctx, "block_sparse_backward::sanitizer_shapes", sanitizer_draws(), |stream, worst, draw| {
        check::<bf16>(stream, FLASH_BWD, worst, draw)
    });
}

/// Small draws for the `wgmma` backward under `run.sh sanitize`: a GQA group of 3 with dv ≠ d over 64-row query
/// blocks and a causal tail, varlen with an empty key sequence and tails, a window with head dims below 64 (padded
/// columns), and a KV tile no query sees.
pub fn wgmma_backward_sanitizer_draws() -> Vec<BlockDraw> {
    let shapes = [
        (dense(1, 3, 1, 130, 300, 128, 64, Mask::Causal), 64, 128, ListHeads::PerKvHead, vec![0, 1, 2]),
        (
            varlen(&[0, 60, 60, 200], &[0, 0, 150, 420], 2, 1, 64, 64, Mask::None),
            128,
            128,
            ListHeads::PerQueryHead,
            vec![0, 1],
        ),
        (
            dense(1, 2, 2, 129, 200, 40, 40, Mask::Window { left: 70, right: 3 }),
            128,
            128,
            ListHeads::PerQueryHead,
            vec![0, 1],
        ),
        (dense(1, 1, 1, 64, 300, 64, 64, Mask::Causal), 64, 128, ListHeads::PerKvHead, vec![0, 1, 2]),
    ];
    crate::block_sparse::uniform_draws(shapes, 11)
}

/// The `wgmma` backward over [`wgmma_backward_sanitizer_draws`], for `run.sh sanitize`.
#[test]
fn wgmma_sanitizer_shapes() {
    let Some(ctx) = skip_unless_hopper("block_sparse_backward::wgmma_sanitizer_shapes") else {
        return;
    };
    let draws = wgmma_backward_sanitizer_draws();
    check_draws(&ctx, "block_sparse_backward::wgmma_sanitizer_shapes", draws, |stream, worst, draw| {
        check::<bf16>(stream, FLASH_BWD_SM90, worst, draw)
    });
}

/// The killing cases of the catalog's `wgmma` backward mutants: a causal GQA group of 2 sharing lists over 64-row
/// query blocks with d = 128 ≠ dv = 64 (both warpgroups' dQ columns, the diagonal inside each warp's keys) and a tail
/// KV tile; a window over 40-column heads (one dQ warpgroup, padded columns) with lists per query head and a 129-row
/// tail; two varlen sequences with different lists at d = dv = 128.
pub fn wgmma_killing_cases() -> Vec<(&'static str, BlockDraw)> {
    let draw = |spec: AttentionSpec, lists: BlockLists, seed| BlockDraw {
        spec,
        lists,
        density: Density::Sparse,
        profile: gaussian(1.0),
        seed,
    };
    let mut out = vec![];
    let spec = dense(1, 2, 1, 200, 300, 128, 64, Mask::Causal);
    let lists = uniform_lists(&spec, 64, 128, ListHeads::PerKvHead, &[0, 1, 2]);
    out.push(("causal_gqa_d128_dv64", draw(spec, lists, 61)));
    let spec = dense(1, 2, 2, 129, 260, 40, 40, Mask::Window { left: 100, right: 20 });
    let picks: Vec<Vec<bool>> = (0..6).map(|r| (0..3).map(|b| (r + b) % 2 == 0).collect()).collect();
    let lists = lists_from(&spec, 64, 128, ListHeads::PerQueryHead, &picks);
    out.push(("window_d40_per_query_head", draw(spec, lists, 62)));
    let spec = varlen(&[0, 150, 300], &[0, 256, 400], 1, 1, 128, 128, Mask::None);
    let picks: Vec<Vec<bool>> = vec![vec![true, false], vec![false, true], vec![true, true], vec![false, true]];
    let lists = lists_from(&spec, 128, 128, ListHeads::PerQueryHead, &picks);
    out.push(("two_varlen_sequences_d128", draw(spec, lists, 63)));
    out
}

/// The killing cases of the catalog's `BLOCK_SPARSE` backward mutants: 128-row query blocks (two query tiles each)
/// over 128-key blocks with pads, causal with the diagonal block listed, the last key block listed (the CSR's last
/// row); lists per query head in a GQA group with different lists per head and more CSR rows than a warp; and two
/// sequences with different lists.
pub fn killing_cases() -> Vec<(&'static str, BlockDraw)> {
    let draw = |spec: AttentionSpec, lists: BlockLists, seed| BlockDraw {
        spec,
        lists,
        density: Density::Sparse,
        profile: gaussian(1.0),
        seed,
    };
    let mut out = vec![];
    let spec = dense(1, 2, 1, 256, 384, 64, 64, Mask::Causal);
    let lists = uniform_lists(&spec, 128, 128, ListHeads::PerKvHead, &[0, 2]);
    out.push(("causal_q128_kv128_last_block", draw(spec, lists, 41)));
    // 4 list heads × 10 key blocks: 40 CSR rows, more than one warp of the scan.
    let spec = dense(1, 4, 2, 256, 640, 64, 64, Mask::None);
    let picks: Vec<Vec<bool>> = (0..16).map(|r| (0..10).map(|b| (r + b) % 3 == 0).collect()).collect();
    let lists = lists_from(&spec, 64, 64, ListHeads::PerQueryHead, &picks);
    out.push(("per_query_head_lists_40_csr_rows", draw(spec, lists, 42)));
    let spec = dense(2, 1, 1, 128, 256, 64, 64, Mask::None);
    let picks: Vec<Vec<bool>> = vec![vec![true, false, false, true], vec![false, true, true, false]];
    let lists = lists_from(&spec, 128, 64, ListHeads::PerQueryHead, &picks);
    out.push(("two_sequences", draw(spec, lists, 43)));
    out
}
