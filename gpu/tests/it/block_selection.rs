//! The GPU block selector (`attnproof_gpu::block_sparse::select`, BSA) against the oracle's selection
//! (`attnproof_oracle::bsa`), through `attnproof_harness::block_selection`: the lists are integers, equal to the
//! oracle's entry for entry wherever the pooled scores' rounding bound cannot move the top-k boundary, ties between
//! identical key blocks broken to the lower index.
//!
//! The property suites draw the harness's shapes (no mask or causal, Lq ≠ Lk, varlen with empty sequences, GQA
//! groups of 1 to 16), both block sizes on each side, every `top_k` up to the key blocks, forced first and local
//! blocks, and in half the draws copy key blocks onto others so that exact ties sit at the top-k boundary on purpose.
//! Each draw runs twice on the same input, under its drawn schedule (the query blocks pooled and selected in one to
//! five ranges on two streams) and under the serial one, which must give the same bits, and ends with the block-sparse forward over the
//! selected lists, verified against the oracle. Without a device each test prints `skipped: no CUDA device` and
//! passes.

use std::cell::RefCell;
use std::sync::Arc;

use crate::common::*;
use crate::property::{default_run_config, run_config};
use attnproof_gpu::GpuError;
use attnproof_gpu::block_sparse::select::{
    BSA_SELECT, STREAM_MAX_TOP_K, SelectSchedule, lists_shape, select_blocks, select_blocks_device,
    select_blocks_device_scheduled, workspace_len,
};
use attnproof_gpu::block_sparse::{BLOCK_SIZES, BlockLists, ListHeads};
use attnproof_gpu::compile::{FLASH_FWD, KernelSource};
use attnproof_harness::Case;
use attnproof_harness::HarnessError;
use attnproof_harness::block_selection::{SelectionVerdict, verify_block_selection};
use attnproof_harness::candidate::{block_sparse_forward_guarded, poisoned, unguard};
use attnproof_harness::generate::{ValueProfile, make_case};
use attnproof_harness::sparse::{SparseHarnessError, verify_block_sparse_forward};
use attnproof_harness::strategies::profile;
use attnproof_oracle::bsa::BsaConfig;
use attnproof_oracle::{AttentionSpec, Mask};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::{Array4, Axis};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

/// One selection draw: the problem (no mask or causal), the selector's parameters, values, seed, and whether key
/// blocks are copied onto others to make exact ties.
#[derive(Clone, Debug)]
pub struct SelectionDraw {
    /// The problem.
    pub spec: AttentionSpec,
    /// The selector.
    pub config: BsaConfig,
    /// Values.
    pub profile: ValueProfile,
    /// Input seed.
    pub seed: u64,
    /// Exact ties made on purpose.
    pub ties: Ties,
    /// The block selector's launch order (the query blocks pooled and selected in ranges on two streams, or all at
    /// once); E24's selector, which draws these problems too, has one order.
    pub schedule: SelectSchedule,
}

/// How a draw makes exact ties between key blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ties {
    /// None on purpose.
    None,
    /// Key block `b` copied onto block `b + 2`, for every third `b`.
    Pairs,
    /// Every whole key block the same: every choice is a tie, decided by the index.
    All,
}

impl Ties {
    /// Every kind.
    pub const ALL: [Ties; 3] = [Ties::None, Ties::Pairs, Ties::All];

    /// The (source, copy) pairs of whole key blocks among `whole` of them.
    pub fn copies(self, whole: usize) -> Vec<(usize, usize)> {
        match self {
            Ties::None => vec![],
            Ties::Pairs => (0..whole.saturating_sub(2)).step_by(3).map(|b| (b, b + 2)).collect(),
            Ties::All => (1..whole).map(|b| (0, b)).collect(),
        }
    }
}

/// Problems for the selector: dense or varlen (an empty sequence included), lengths around one block and long ones
/// (up to 67 key blocks of 64, so that `top_k` chooses among many and lists wider than [`STREAM_MAX_TOP_K`] come up), GQA groups of 1 to 16, head dims multiple of 8 up
/// to 256, no mask or causal.
pub fn selection_spec() -> impl Strategy<Value = AttentionSpec> {
    let length = prop_oneof![prop::sample::select(vec![1usize, 63, 64, 65, 127, 128, 129]), 300usize..2100,];
    let heads =
        prop::sample::select(vec![(1usize, 1usize), (2, 1), (3, 1), (4, 2), (6, 2), (8, 8), (5, 5), (16, 1), (12, 4)]);
    let dim = prop::sample::select(vec![8usize, 64, 128, 136, 256]);
    let layout = prop_oneof![
        // Many key blocks (up to 67 of 64 keys): lists wider than `STREAM_MAX_TOP_K`, which the selector builds with
        // its other kernel, are drawn as often as narrow ones (this arm twice as often as each other).
        // Queries over more than 8 query blocks of 64 in most of these draws, so that wide lists under a schedule of
        // several ranges come up in every suite.
        2 => (500usize..1300, 2100usize..4300).prop_map(|(len_q, len_k)| attnproof_oracle::Layout::Dense {
            batch: 1,
            len_q,
            len_k
        }),
        1 => (1usize..=2, length.clone(), length.clone())
            .prop_map(|(batch, len_q, len_k)| attnproof_oracle::Layout::Dense { batch, len_q, len_k }),
        // Self-attention, the common case: under the causal mask a query block's last visible key then ends a block
        // whenever the block sizes divide each other, so the next block starts one key past the eligible range.
        1 => (1usize..=2, length.clone()).prop_map(|(batch, len)| attnproof_oracle::Layout::Dense {
            batch,
            len_q: len,
            len_k: len
        }),
        1 => prop::collection::vec((0usize..700, 1usize..1400), 1..=3).prop_map(|lens| {
            let mut cu_q = vec![0i32];
            let mut cu_k = vec![0i32];
            for (lq, lk) in lens {
                cu_q.push(cu_q.last().unwrap() + lq as i32);
                cu_k.push(cu_k.last().unwrap() + lk as i32);
            }
            attnproof_oracle::Layout::Varlen { cu_seqlens_q: cu_q, cu_seqlens_k: cu_k }
        }),
    ];
    (layout, heads, dim, any::<bool>()).prop_map(|(layout, (n_heads_q, n_heads_kv), head_dim, causal)| AttentionSpec {
        layout,
        n_heads_q,
        n_heads_kv,
        head_dim,
        head_dim_v: 8,
        scale: attnproof_oracle::Scale::InverseSqrtHeadDim,
        mask: if causal { Mask::Causal } else { Mask::None },
    })
}

/// The draws: [`selection_spec`], then parameters that fit it.
pub fn selection_draws() -> impl Strategy<Value = SelectionDraw> {
    let sizes = prop::sample::select(BLOCK_SIZES.to_vec());
    let key_blocks = |spec: &AttentionSpec, kv_block: usize| {
        spec.sequences().iter().map(|s| s.len_k.div_ceil(kv_block)).max().unwrap_or(0)
    };
    // Two to five ranges in half the draws (three and five leave ranges of unequal size); Serial is one range. A
    // quarter cap the query pooling at 1 to 7 CTAs, so that each pooling CTA strides over several items.
    let schedules = prop_oneof![
        1 => Just(SelectSchedule::Serial),
        1 => Just(SelectSchedule::Chunks(1)),
        4 => (2usize..=5).prop_map(SelectSchedule::Chunks),
        2 => (1usize..=5, 1usize..=7)
            .prop_map(|(chunks, pool_ctas)| SelectSchedule::ChunksPooledBy { chunks, pool_ctas }),
    ];
    let ties = prop::sample::select(Ties::ALL.to_vec());
    (selection_spec(), sizes.clone(), sizes, profile(), any::<u64>(), ties, schedules)
        // A selector needs a key block to choose from (`top_k` is at least 1 and at most the key blocks).
        .prop_filter("no key at all", move |(spec, _, kv_block, ..)| key_blocks(spec, *kv_block) > 0)
        .prop_flat_map(move |(spec, q_block, kv_block, profile, seed, ties, schedule)| {
            let key_blocks = key_blocks(&spec, kv_block);
            // Every width, or (half the draws) one past the streaming kernel's limit up to every key block: wide
            // lists, full ones and, under the causal mask, wide lists padded with -1 come up in every suite.
            let width = prop_oneof![1..=key_blocks, (STREAM_MAX_TOP_K + 1).min(key_blocks)..=key_blocks];
            (width, any::<bool>(), 0..=2usize).prop_filter_map(
                "forced blocks must fit in top_k",
                move |(top_k, force_first, force_local)| {
                    let config = BsaConfig { q_block, kv_block, top_k, force_first, force_local };
                    config.validate().ok().map(|()| SelectionDraw {
                        spec: spec.clone(),
                        config,
                        profile,
                        seed,
                        ties,
                        schedule,
                    })
                },
            )
        })
}

/// `case` with exact ties between whole key blocks of every (sequence, KV head): key block `b` copied onto block
/// `b + 2` for every third `b` ([`Ties::Pairs`]), or every whole block a copy of block 0 ([`Ties::All`]).
pub fn with_tied_blocks<T: Storage>(mut case: Case<T>, kv_block: usize, ties: Ties) -> Case<T> {
    let spec = case.spec.clone();
    for seq in spec.sequences() {
        let copies = ties.copies(seq.len_k / kv_block);
        for kv in 0..spec.n_heads_kv {
            for &(b, to_block) in &copies {
                for j in 0..kv_block {
                    for c in 0..spec.head_dim {
                        let (from, to) = (b * kv_block + j, to_block * kv_block + j);
                        let x = spec.head_rows(case.k.view(), &seq, kv, true)[[from, c]];
                        set_key(&spec, &mut case.k, &seq, kv, to, c, x);
                    }
                }
            }
        }
    }
    case
}

/// Writes key `row` (within sequence `seq`), column `c` of KV head `kv`.
fn set_key<T: Clone>(
    spec: &AttentionSpec,
    k: &mut ndarray::ArrayD<T>,
    seq: &attnproof_oracle::Sequence,
    kv: usize,
    row: usize,
    c: usize,
    x: T,
) {
    match &spec.layout {
        attnproof_oracle::Layout::Dense { .. } => k[[seq.index, kv, row, c]] = x,
        attnproof_oracle::Layout::Varlen { .. } => k[[seq.k_start + row, kv, c]] = x,
    }
}

/// One guarded selection on the device under `schedule`: the lists buffer NaN-free but poisoned with a sentinel and
/// followed by a guard band; the lists come back checked.
fn select_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    config: &BsaConfig,
    kernel: KernelSource,
    schedule: SelectSchedule,
) -> Result<Array4<i32>, String> {
    let spec = &case.spec;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let (q, k) = (upload(stream, &case.q)?, upload(stream, &case.k)?);
    let shape = lists_shape(spec, config);
    let n: usize = shape.iter().product();
    // A sentinel no valid list holds (below −1), then the guard band.
    let mut lists = poisoned(stream, n, i32::MIN, 0x5a5a_5a5a).map_err(|e| err(&e))?;
    let mut pooled = stream.alloc_zeros::<f64>(workspace_len(spec, config).max(1)).map_err(|e| err(&e))?;
    select_blocks_device_scheduled(stream, spec, config, kernel, (&q, &k), &mut pooled, &mut lists, schedule)
        .map_err(|e| err(&e))?;
    let back = stream.clone_dtoh(&lists).map_err(|e| err(&e))?;
    stream.synchronize().map_err(|e| err(&e))?;
    let lists = unguard("lists", back, n, &shape, |x: i32| x == 0x5a5a_5a5a).map_err(|e| err(&e))?;
    Ok(lists.into_dimensionality().expect("rank 4"))
}

/// A selection suite: name, dtype, cases, seed.
#[derive(Clone, Copy, Debug)]
pub struct SelectionSuite {
    /// The name (and regression file).
    pub name: &'static str,
    /// bf16 (`true`) or f16.
    pub bf16: bool,
    /// Cases per run.
    pub cases: u32,
    /// Fixed seed.
    pub seed: u64,
}

/// The two suites ("gpusel" in ASCII, plus the dtype).
pub const SELECTION_SUITES: [SelectionSuite; 2] = [
    SelectionSuite { name: "gpu_block_selection_bf16", bf16: true, cases: 64, seed: 0x6770_7573_656c_0001 },
    SelectionSuite { name: "gpu_block_selection_f16", bf16: false, cases: 64, seed: 0x6770_7573_656c_0002 },
];

/// Tally of a suite's draws: rows, decided rows, draws with ties, causal draws.
#[derive(Clone, Debug, Default)]
pub struct SelectionTally {
    /// List rows verified.
    pub rows: usize,
    /// Rows compared exactly.
    pub decided: usize,
    /// Draws with copied blocks.
    pub tied_draws: usize,
    /// Causal draws.
    pub causal_draws: usize,
}

impl SelectionSuite {
    /// Runs the suite under `config`.
    pub fn run(
        &self,
        config: Config,
        check: impl Fn(&SelectionDraw) -> Result<(), TestCaseError>,
    ) -> (SelectionTally, Result<(), TestError<SelectionDraw>>) {
        let tally = RefCell::new(SelectionTally::default());
        let mut runner = TestRunner::new(config);
        let result = runner.run(&selection_draws(), |draw| {
            let mut t = tally.borrow_mut();
            t.tied_draws += usize::from(draw.ties != Ties::None);
            t.causal_draws += usize::from(matches!(draw.spec.mask, Mask::Causal));
            drop(t);
            check(&draw)
        });
        (tally.into_inner(), result)
    }

    /// The check of one draw by the selector `kernel` (and the production forward over its lists).
    pub fn check(
        &self,
        stream: &Arc<CudaStream>,
        kernel: KernelSource,
        tally: &RefCell<SelectionTally>,
        draw: &SelectionDraw,
    ) -> Result<(), TestCaseError> {
        if self.bf16 {
            check_draw::<bf16>(stream, kernel, tally, draw)
        } else {
            check_draw::<f16>(stream, kernel, tally, draw)
        }
    }
}

fn check_draw<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    tally: &RefCell<SelectionTally>,
    draw: &SelectionDraw,
) -> Result<(), TestCaseError> {
    let mut case = make_case::<T>(&draw.spec, draw.profile, draw.seed);
    case = with_tied_blocks(case, draw.config.kv_block, draw.ties);
    let first = select_guarded(stream, &case, &draw.config, kernel, draw.schedule).map_err(TestCaseError::fail)?;
    let serial = SelectSchedule::Chunks(1);
    let again = select_guarded(stream, &case, &draw.config, kernel, serial).map_err(TestCaseError::fail)?;
    prop_assert!(first == again, "the same input gave different lists under {:?} and {serial:?}", draw.schedule);
    let verdict: SelectionVerdict = verify_block_selection(&case, &draw.config, first.view())
        .map_err(|e| TestCaseError::fail(format!("verification: {e}")))?;
    prop_assert!(verdict.passed(), "{}", verdict.failures.join("\n"));
    {
        let mut t = tally.borrow_mut();
        t.rows += verdict.rows;
        t.decided += verdict.decided;
    }
    let lists = BlockLists {
        q_block: draw.config.q_block,
        kv_block: draw.config.kv_block,
        heads: ListHeads::PerKvHead,
        lists: first,
    };
    forward_over_lists(stream, &case, &lists).map_err(TestCaseError::fail)
}

/// The production block-sparse forward over a selector's `lists` (per KV head), verified against the f64 oracle where
/// that costs no more than about 2^27 multiply-adds (the forward's own suites cover long problems).
pub fn forward_over_lists<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    lists: &BlockLists,
) -> Result<(), String> {
    let spec = &case.spec;
    let work: usize = spec.sequences().iter().map(|s| s.len_q * s.len_k).sum::<usize>()
        * spec.n_heads_q
        * (spec.head_dim + spec.head_dim_v);
    if work > 1 << 27 {
        return Ok(());
    }
    let run = block_sparse_forward_guarded(stream, case, lists, FLASH_FWD)
        .map_err(|e| format!("forward over the selected lists: {e}"))?;
    let layout = lists.oracle_layout(spec);
    let verdicts = match verify_block_sparse_forward(case, &layout, forward_recipe::<T>(), run.o.view(), run.lse.view())
    {
        Ok(v) => v,
        // The forward's model does not cover this draw (logit scales too large for its first-order hypothesis): the
        // selection was still verified; the forward's own suites judge the forward.
        Err(SparseHarnessError::Harness(HarnessError::Model(_))) => return Ok(()),
        Err(e) => return Err(format!("forward verification: {e}")),
    };
    match verdicts.iter().find(|v| !(v.passed() && v.valid())) {
        Some(v) => Err(format!("forward over the selected lists:\n{v}")),
        None => Ok(()),
    }
}

fn run_production(suite: &SelectionSuite) {
    let Some(stream) = device_stream(suite.name) else { return };
    let tally = RefCell::new(SelectionTally::default());
    let (draws, result) =
        suite.run(run_config(suite.name, suite.cases, suite.seed), |d| suite.check(&stream, BSA_SELECT, &tally, d));
    if let Err(e) = result {
        panic!("{}: {e}", suite.name);
    }
    let t = tally.borrow();
    println!("{}: {} rows, {} decided; {draws:?}", suite.name, t.rows, t.decided);
    assert!(t.decided > 0, "{}: no row was compared exactly", suite.name);
}

#[test]
fn selection_equals_the_oracles_bf16() {
    run_production(&SELECTION_SUITES[0]);
}

#[test]
fn selection_equals_the_oracles_f16() {
    run_production(&SELECTION_SUITES[1]);
}

/// Replayed without a device: the suites draw ties, causal and unmasked problems, GQA groups above 1, every
/// `top_k` from 1 to above 2, lists for both kernels (up to [`STREAM_MAX_TOP_K`] wide and wider), forced first and
/// local blocks, schedules of several ranges over more than 8 query blocks, and query pooling CTAs that take
/// several items each.
#[test]
fn the_selection_suites_draw_ties_masks_and_forced_blocks() {
    let seen = RefCell::new((0usize, 0usize, 0usize, 0usize, 0usize, 0usize, 0usize));
    for suite in &SELECTION_SUITES {
        let config = default_run_config(suite.name, suite.cases, suite.seed);
        // Wide lists (the rounds kernel) under several ranges, and wide lists padded with -1 (a query block that sees
        // fewer blocks than the width), in each suite: its general-suite hunt needs both.
        let wide_ranged = std::cell::Cell::new(0usize);
        let wide_padded = std::cell::Cell::new(0usize);
        let strided_pooling = std::cell::Cell::new(0usize);
        let (tally, result) = suite.run(config, |d| {
            let mut s = seen.borrow_mut();
            s.0 += usize::from(d.spec.group_size() > 1);
            s.1 += usize::from(d.config.top_k >= 3);
            s.2 += usize::from(d.config.force_first);
            s.3 += usize::from(d.config.force_local > 0);
            s.4 += usize::from(d.config.q_block != d.config.kv_block);
            s.5 += usize::from(d.config.top_k > STREAM_MAX_TOP_K);
            // Overlapped for real: more than one range of 8 query blocks.
            let query_blocks = d.spec.sequences().iter().map(|q| d.config.query_blocks(q)).max().unwrap_or(0);
            let ranged = matches!(
                d.schedule,
                SelectSchedule::Chunks(n) | SelectSchedule::ChunksPooledBy { chunks: n, .. } if n > 1
            ) && query_blocks > 8;
            // Pooling CTAs that stride: fewer of them than one range's (block, head, sequence) items.
            let strided = matches!(
                d.schedule,
                SelectSchedule::ChunksPooledBy { pool_ctas, .. } if pool_ctas < query_blocks.min(8) * d.spec.n_heads_q
            );
            strided_pooling.set(strided_pooling.get() + usize::from(strided));
            s.6 += usize::from(ranged);
            wide_ranged.set(wide_ranged.get() + usize::from(ranged && d.config.top_k > STREAM_MAX_TOP_K));
            let causal = matches!(d.spec.mask, Mask::Causal);
            let padded =
                d.spec.sequences().iter().any(|q| {
                    (0..d.config.query_blocks(q)).any(|a| d.config.eligible_end(q, a, causal) < d.config.top_k)
                });
            wide_padded.set(wide_padded.get() + usize::from(padded && d.config.top_k > STREAM_MAX_TOP_K));
            Ok(())
        });
        assert!(wide_ranged.get() > 0, "{}: no wide lists under several ranges", suite.name);
        assert!(wide_padded.get() > 0, "{}: no padded wide lists", suite.name);
        assert!(strided_pooling.get() > 0, "{}: no pooling CTA took several items", suite.name);
        assert!(result.is_ok(), "{result:?}");
        assert!(
            tally.tied_draws > 0 && tally.causal_draws > 0 && tally.causal_draws < suite.cases as usize,
            "{tally:?}"
        );
    }
    let s = seen.into_inner();
    assert!(s.0 > 0 && s.1 > 0 && s.2 > 0 && s.3 > 0 && s.4 > 0 && s.5 > 0 && s.6 > 0, "{s:?}");
}

/// Every key block identical: every score ties, so the lists are the forced blocks and then the lowest indices.
#[test]
fn all_tied_blocks_select_the_lowest_indices() {
    let Some(stream) = device_stream("all_tied_blocks_select_the_lowest_indices") else { return };
    let spec = dense(1, 4, 2, 256, 640, 64, 64, Mask::Causal);
    let mut case = make_case::<bf16>(&spec, gaussian(1.0), 8);
    for kv in 0..2 {
        for j in 0..640 {
            for c in 0..64 {
                case.k[[0, kv, j, c]] = case.k[[0, kv, j % 128, c]];
            }
        }
    }
    let config = BsaConfig { q_block: 128, kv_block: 128, top_k: 3, force_first: false, force_local: 1 };
    let lists = select_guarded(&stream, &case, &config, BSA_SELECT, SelectSchedule::Serial).expect("selection");
    // Query blocks 0 and 1 see key blocks 0..=3 and 0..=4 (Lk − Lq = 384): forced last eligible, then 0, 1.
    assert_eq!(
        lists.index_axis(Axis(0), 0).index_axis(Axis(0), 1).iter().copied().collect::<Vec<_>>(),
        [0, 1, 3, 0, 1, 4]
    );
    let verdict = verify_block_selection(&case, &config, lists.view()).expect("verification");
    assert!(verdict.passed() && verdict.decided == verdict.rows, "{verdict:?}");
}

/// Bad parameters and buffers are typed errors before any launch; the device stays usable.
#[test]
fn bad_selection_input_is_a_typed_error() {
    let Some(stream) = device_stream("bad_selection_input_is_a_typed_error") else { return };
    let spec = dense(1, 2, 1, 200, 300, 64, 64, Mask::Causal);
    let case = make_case::<bf16>(&spec, gaussian(1.0), 9);
    let good = BsaConfig { q_block: 64, kv_block: 128, top_k: 2, force_first: true, force_local: 1 };
    let run = |spec: &AttentionSpec, c: &BsaConfig| select_blocks(&stream, spec, c, case.q.view(), case.k.view());
    assert!(matches!(
        run(&spec, &BsaConfig { top_k: 4, ..good }),
        Err(GpuError::Unsupported { argument: "top_k", .. })
    ));
    assert!(matches!(
        run(&spec, &BsaConfig { kv_block: 96, ..good }),
        Err(GpuError::Unsupported { argument: "kv_block", .. })
    ));
    assert!(matches!(run(&spec, &BsaConfig { top_k: 1, ..good }), Err(GpuError::Spec(_))));
    let window = spec.clone().with_mask(Mask::Window { left: 8, right: 0 });
    assert!(matches!(run(&window, &good), Err(GpuError::Unsupported { argument: "mask", .. })));
    let other = dense(1, 2, 1, 200, 301, 64, 64, Mask::Causal);
    assert!(matches!(run(&other, &good), Err(GpuError::Shape { argument: "k", .. })));
    let (q, k) = (upload(&stream, &case.q).unwrap(), upload(&stream, &case.k).unwrap());
    let mut small = stream.alloc_zeros::<f64>(1).unwrap();
    let mut lists = stream.alloc_zeros::<i32>(64).unwrap();
    let e = select_blocks_device(&stream, &spec, &good, BSA_SELECT, &q, &k, &mut small, &mut lists);
    assert!(matches!(e, Err(GpuError::BufferTooSmall { argument: "pooled", .. })), "{e:?}");
    let lists = run(&spec, &good).expect("a valid selection after the refusals");
    assert_eq!(lists.lists.dim(), (1, 1, 4, 2));
    lists.validate(&spec).expect("the selector's lists follow the convention");
}

/// The killing cases of the catalog's `bsa_select.cu` mutants: causal with a partial last key block, a GQA group of 3,
/// forced first and local blocks, every whole key block the same (so exact ties decide the lists) and early query
/// blocks with fewer eligible blocks than `top_k` (padded lists); a second case without a mask over two sequences;
/// a third with lists wider than [`STREAM_MAX_TOP_K`] (the rounds kernel), causal over two sequences of which the
/// second has fewer key blocks than the width (padded lists), forced first and local blocks; a fourth without a mask
/// over 65 key blocks (two tiles of the streaming kernel, the second with one block) whose pooled scores grow with the
/// block index, so that the last blocks of both tiles are chosen; a fifth causal over 25 query blocks in the three
/// ranges of [`KILLING_SCHEDULE`] (8, 8 and 9 blocks), a GQA group of 3, one query column growing with the position
/// so that the lists of all-zero pooled queries (a range never pooled) are not the right ones; a sixth causal over 41
/// query blocks in three ranges with lists 34 wide (the rounds kernel).
pub fn killing_cases() -> Vec<(&'static str, Case<bf16>, BsaConfig)> {
    let spec = dense(1, 3, 1, 300, 300, 64, 64, Mask::Causal);
    let mut tied = make_case::<bf16>(&spec, gaussian(1.0), 31);
    for j in 64..300 {
        for c in 0..64 {
            tied.k[[0, 0, j, c]] = tied.k[[0, 0, j % 64, c]];
        }
    }
    let forced = BsaConfig { q_block: 64, kv_block: 64, top_k: 4, force_first: true, force_local: 1 };
    let spec = dense(2, 2, 2, 130, 520, 64, 64, Mask::None);
    let plain = make_case::<bf16>(&spec, gaussian(4.0), 32);
    let unforced = BsaConfig { q_block: 128, kv_block: 128, top_k: 2, force_first: false, force_local: 0 };
    let spec = AttentionSpec {
        layout: attnproof_oracle::Layout::Varlen { cu_seqlens_q: vec![0, 256, 456], cu_seqlens_k: vec![0, 4000, 5000] },
        ..dense(1, 4, 2, 1, 1, 64, 64, Mask::Causal)
    };
    let wide = make_case::<bf16>(&spec, gaussian(2.0), 33);
    let width = STREAM_MAX_TOP_K + 8;
    let rounds = BsaConfig { q_block: 64, kv_block: 64, top_k: width, force_first: true, force_local: 2 };
    let spec = dense(2, 4, 2, 128, 4100, 64, 64, Mask::None);
    let mut growing = make_case::<bf16>(&spec, gaussian(1.0), 34);
    growing.q.index_axis_mut(Axis(3), 0).fill(bf16::from_f32(2.0));
    for j in 0..4100 {
        growing.k.index_axis_mut(Axis(2), j).index_axis_mut(Axis(2), 0).fill(bf16::from_f32(4.0 * j as f32 / 4100.0));
    }
    let last_tiles = BsaConfig { q_block: 64, kv_block: 64, top_k: 16, force_first: false, force_local: 0 };
    let spec = dense(1, 3, 1, 1600, 1600, 64, 64, Mask::Causal);
    let mut ranged = make_case::<bf16>(&spec, gaussian(1.0), 35);
    for i in 0..1600 {
        ranged.q.index_axis_mut(Axis(2), i).index_axis_mut(Axis(2), 1).fill(bf16::from_f32(3.0 * i as f32 / 1600.0));
    }
    let three_ranges = BsaConfig { q_block: 64, kv_block: 64, top_k: 3, force_first: true, force_local: 1 };
    let spec = dense(1, 2, 1, 2600, 2600, 64, 64, Mask::Causal);
    let wide_ranged = make_case::<bf16>(&spec, gaussian(1.0), 36);
    let wide_three_ranges =
        BsaConfig { q_block: 64, kv_block: 64, top_k: STREAM_MAX_TOP_K + 2, force_first: false, force_local: 0 };
    vec![
        ("causal_gqa3_forced_ties", tied, forced),
        ("no_mask_two_sequences", plain, unforced),
        ("causal_wide_lists_varlen", wide, rounds),
        ("no_mask_growing_scores_two_tiles", growing, last_tiles),
        ("causal_gqa3_three_ranges", ranged, three_ranges),
        ("causal_wide_lists_three_ranges", wide_ranged, wide_three_ranges),
    ]
}

/// The killing cases' schedule: three ranges where a case has at least three units of 8 query blocks, each range's
/// queries pooled by 7 CTAs (fewer than the items of every case, so that each CTA pools several).
const KILLING_SCHEDULE: SelectSchedule = SelectSchedule::ChunksPooledBy { chunks: 3, pool_ctas: 7 };

/// Runs the selector `kernel` on a killing case under [`KILLING_SCHEDULE`]; `Ok(())` when its lists pass the
/// verification.
pub fn check_selection(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    case: &(Case<bf16>, BsaConfig),
) -> Result<(), String> {
    let (case, config) = case;
    let lists = select_guarded(stream, case, config, kernel, KILLING_SCHEDULE)?;
    let verdict = verify_block_selection(case, config, lists.view()).map_err(|e| e.to_string())?;
    if verdict.passed() { Ok(()) } else { Err(verdict.failures[0].clone()) }
}
