//! The block-sparse forward (`attnproof_gpu::block_sparse`, E14) verified on the device against the f64 oracle under
//! the forward kernel's rounding-error bound with the lists' visibility (`attnproof_harness::sparse`), in bf16 and f16.
//!
//! The property suites draw the harness's shapes (every mask kind, windows narrow and wide, Lq ≠ Lk, tile ± 1
//! lengths, varlen with empty sequences, GQA groups of 1 to 16), both block sizes on each side, lists per query head
//! and per KV head, and a density class per draw: no block listed, sparse, dense, or every block. Each draw runs
//! inputs A, B, A with NaN-poisoned, guarded outputs and checks the inputs unchanged (both A runs bitwise equal); each
//! verdict must pass with a valid gate (including the dropped-listed-block wrong answer); a draw with every block
//! listed must equal the dense kernel bit for bit in the same tiling. The sm_90a forward (`flash_fwd_sm90.cu`, which
//! the wrappers run for 128×128 blocks and head dims up to 128 on compute capability 9.0) has suites of its own over
//! those shapes, compared in the all-blocks draws with its own dense mode. Without a device each test prints
//! `skipped: no CUDA device` and passes.

use std::cell::RefCell;
use std::sync::Arc;

use crate::common::*;
use crate::property::{compile_ahead, default_run_config, run_config};
use attnproof_gpu::block_sparse::{BLOCK_SIZES, BlockLists, ListHeads, block_sparse_forward};
use attnproof_gpu::compile::{FLASH_FWD, FLASH_FWD_SM90, KernelSource, ModuleVariant};
use attnproof_gpu::flash::{ForwardTiling, WGMMA_KV_TILE, WGMMA_MAX_HEAD_DIM, is_wgmma};
use attnproof_gpu::{BlockListFault, GpuError, forward_variant, skip_unless_gpu, skip_unless_hopper};
use attnproof_harness::adversarial::Worst;
use attnproof_harness::candidate::{block_sparse_forward_guarded, forward_guarded};
use attnproof_harness::generate::{ValueProfile, make_case};
use attnproof_harness::sparse::{SparseHarnessError, verify_block_sparse_forward};
use attnproof_harness::strategies::profile;
use attnproof_harness::{Case, HarnessError};
use attnproof_oracle::{AttentionSpec, Layout, Mask};
use cudarc::driver::{CudaContext, CudaStream};
use half::{bf16, f16};
use ndarray::{Array4, Axis};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

/// How many key blocks a draw lists: the probability that a query block lists a given key block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Density {
    /// Nothing listed: every row gets `O = 0`, `LSE = −∞`.
    Empty,
    /// About a quarter of the blocks.
    Sparse,
    /// About three quarters.
    Dense,
    /// Every block: the dense kernel's bits.
    Full,
}

impl Density {
    /// Every class, for the coverage check.
    pub const ALL: [Density; 4] = [Density::Empty, Density::Sparse, Density::Dense, Density::Full];

    fn probability(self) -> f64 {
        match self {
            Density::Empty => 0.0,
            Density::Sparse => 0.25,
            Density::Dense => 0.75,
            Density::Full => 1.0,
        }
    }
}

/// One block-sparse draw: the problem, its lists and density class, the value profile and the seed of input A.
#[derive(Clone, Debug)]
pub struct BlockDraw {
    /// The problem.
    pub spec: AttentionSpec,
    /// The lists (validated by construction).
    pub lists: BlockLists,
    /// How densely they were drawn.
    pub density: Density,
    /// Values.
    pub profile: ValueProfile,
    /// Input A's seed.
    pub seed: u64,
}

/// The key blocks of each list row `(sequence, list head, query block)`, from `picks` (one row of "list key block
/// b" flags per row, as wide as the most key blocks); rows past a sequence's own query blocks list nothing. The width
/// is the most key blocks, so full lists have no pad and every other list is `−1`-padded.
pub fn lists_from(
    spec: &AttentionSpec,
    q_block: usize,
    kv_block: usize,
    heads: ListHeads,
    picks: &[Vec<bool>],
) -> BlockLists {
    let seqs = spec.sequences();
    let n_q = seqs.iter().map(|s| s.len_q.div_ceil(q_block)).max().unwrap_or(0);
    let n_k = seqs.iter().map(|s| s.len_k.div_ceil(kv_block)).max().unwrap_or(0);
    let n_heads = if heads == ListHeads::PerQueryHead { spec.n_heads_q } else { spec.n_heads_kv };
    let mut lists = Array4::from_elem((seqs.len(), n_heads, n_q, n_k), -1i32);
    for seq in &seqs {
        for h in 0..n_heads {
            for a in 0..seq.len_q.div_ceil(q_block) {
                let row = &picks[(seq.index * n_heads + h) * n_q + a];
                let chosen = (0..seq.len_k.div_ceil(kv_block)).filter(|&b| row[b]);
                for (w, b) in chosen.enumerate() {
                    lists[[seq.index, h, a, w]] = b as i32;
                }
            }
        }
    }
    BlockLists { q_block, kv_block, heads, lists }
}

/// Which problems a block-sparse suite draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrawShapes {
    /// The kernels' shapes (`crate::common::kernel_spec`).
    Kernel,
    /// Those, and one draw in four with 1500 to 2600 keys over a few heads: 12 to 41 key blocks per list head, so
    /// that the backward's CSR transpose has more rows than its scan's first warp covers.
    KernelAndLongKeys,
    /// The kernels' shapes with head dims up to [`WGMMA_MAX_HEAD_DIM`] and 128×128 blocks: what the sm_90a forward
    /// takes (`BlockLists::suits_wgmma`).
    Wgmma,
    /// The kernels' shapes with head dims up to [`WGMMA_MAX_HEAD_DIM`], query blocks of every size and 128-key
    /// blocks: what the `wgmma` backward takes (`BlockLists::suits_wgmma_backward`); one draw in four is causal with
    /// its diagonal inside a warpgroup's 64 keys ([`wgmma_diagonal_spec`]).
    WgmmaBackward,
}

impl DrawShapes {
    /// The query block sizes the draws take.
    pub fn block_sizes(self) -> Vec<usize> {
        match self {
            DrawShapes::Kernel | DrawShapes::KernelAndLongKeys | DrawShapes::WgmmaBackward => BLOCK_SIZES.to_vec(),
            DrawShapes::Wgmma => vec![WGMMA_KV_TILE],
        }
    }

    /// The key block sizes the draws take.
    pub fn kv_block_sizes(self) -> Vec<usize> {
        match self {
            DrawShapes::Kernel | DrawShapes::KernelAndLongKeys => BLOCK_SIZES.to_vec(),
            DrawShapes::Wgmma | DrawShapes::WgmmaBackward => vec![WGMMA_KV_TILE],
        }
    }
}

/// The kernels' shapes with both head dims cut to the sm_90a forward's largest (still multiples of 8).
fn wgmma_spec() -> impl Strategy<Value = AttentionSpec> {
    kernel_spec().prop_map(|mut s| {
        s.head_dim = s.head_dim.min(WGMMA_MAX_HEAD_DIM);
        s.head_dim_v = s.head_dim_v.min(WGMMA_MAX_HEAD_DIM);
        s
    })
}

/// Causal problems whose diagonal crosses a warpgroup's 64 keys past its first warp's 16: `(Lk − Lq) mod 64` in
/// 15 ..= 62, over two to four 128-key tiles. There one warp of a warpgroup sees whole key slices while the next
/// needs the mask, so a kernel that decides the mask per warpgroup instead of per warp leaves keys past the diagonal
/// visible (the catalog's `gpu-sm90-bwd-interior-by-warpgroup`, which the plain kernel shapes reach too rarely).
pub fn wgmma_diagonal_spec() -> impl Strategy<Value = AttentionSpec> {
    let heads = prop::sample::select(vec![(1usize, 1usize), (2, 1), (3, 1), (4, 4)]);
    let dims = prop::sample::select(vec![32usize, 64, 96, 128]);
    (1usize..=2, heads, 1usize..=300, 15usize..=62, 0usize..=2, dims).prop_map(
        |(b, (hq, hkv), lq, residue, laps, d)| {
            AttentionSpec::dense(b, hq, hkv, lq, lq + residue + 64 * laps, d, d).with_mask(Mask::Causal)
        },
    )
}

/// Few heads and queries over many keys, dense, no mask or causal.
fn long_key_spec() -> impl Strategy<Value = AttentionSpec> {
    let heads = prop::sample::select(vec![(1usize, 1usize), (2, 1), (3, 3), (4, 2)]);
    let mask = prop::sample::select(vec![Mask::None, Mask::Causal]);
    (1usize..=2, heads, 1usize..=200, 1500usize..=2600, prop::sample::select(vec![32usize, 64]), mask)
        .prop_map(|(b, (hq, hkv), lq, lk, d, mask)| AttentionSpec::dense(b, hq, hkv, lq, lk, d, d).with_mask(mask))
}

/// What the block-sparse suites draw (dependent shapes through `prop_flat_map`: the picks follow the spec and the
/// block sizes).
pub fn block_draws(shapes: DrawShapes) -> impl Strategy<Value = BlockDraw> {
    let specs = match shapes {
        DrawShapes::Kernel => kernel_spec().boxed(),
        DrawShapes::KernelAndLongKeys => prop_oneof![3 => kernel_spec(), 1 => long_key_spec()].boxed(),
        DrawShapes::Wgmma => wgmma_spec().boxed(),
        DrawShapes::WgmmaBackward => prop_oneof![3 => wgmma_spec(), 1 => wgmma_diagonal_spec()].boxed(),
    };
    draws_over(specs, shapes.block_sizes(), shapes.kv_block_sizes())
}

/// Draws over the problems `specs`: query and key block sizes from `q_sizes` and `kv_sizes`, lists per query head or
/// per KV head, a density class and the picks it weights, a value profile and a seed (also PISA's tail suites').
pub fn draws_over(
    specs: BoxedStrategy<AttentionSpec>,
    q_sizes: Vec<usize>,
    kv_sizes: Vec<usize>,
) -> impl Strategy<Value = BlockDraw> {
    let q_sizes = prop::sample::select(q_sizes);
    let kv_sizes = prop::sample::select(kv_sizes);
    let heads = prop::sample::select(vec![ListHeads::PerQueryHead, ListHeads::PerKvHead]);
    let density = prop::sample::select(Density::ALL.to_vec());
    (specs, q_sizes, kv_sizes, heads, density, profile(), any::<u64>()).prop_flat_map(
        |(spec, q_block, kv_block, heads, density, profile, seed)| {
            let seqs = spec.sequences();
            let n_q = seqs.iter().map(|s| s.len_q.div_ceil(q_block)).max().unwrap_or(0);
            let n_k = seqs.iter().map(|s| s.len_k.div_ceil(kv_block)).max().unwrap_or(0);
            let n_heads = if heads == ListHeads::PerQueryHead { spec.n_heads_q } else { spec.n_heads_kv };
            let rows = seqs.len() * n_heads * n_q;
            let picks =
                prop::collection::vec(prop::collection::vec(prop::bool::weighted(density.probability()), n_k), rows);
            picks.prop_map(move |picks| BlockDraw {
                lists: lists_from(&spec, q_block, kv_block, heads, &picks),
                spec: spec.clone(),
                density,
                profile,
                seed,
            })
        },
    )
}

/// One block-sparse suite: its name (and regression file), dtype, case count and fixed seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSuite {
    /// The name.
    pub name: &'static str,
    /// bf16 (`true`) or f16.
    pub bf16: bool,
    /// Cases per run unless `PROPTEST_CASES` says otherwise.
    pub cases: u32,
    /// The seed unless `PROPTEST_RNG_SEED` says otherwise.
    pub seed: u64,
    /// The problems it draws.
    pub shapes: DrawShapes,
}

/// The two suites ("gpublock" in ASCII, plus the dtype).
pub const BLOCK_SUITES: [BlockSuite; 2] = [
    BlockSuite {
        name: "gpu_block_sparse_forward_bf16",
        bf16: true,
        cases: 64,
        seed: 0x6770_7562_6c6f_636b,
        shapes: DrawShapes::Kernel,
    },
    BlockSuite {
        name: "gpu_block_sparse_forward_f16",
        bf16: false,
        cases: 64,
        seed: 0x6770_7562_6c6f_636c,
        shapes: DrawShapes::Kernel,
    },
];

/// The sm_90a forward's suites ("gpuwgmma" in ASCII, plus the dtype): 128×128 blocks, head dims up to 128.
pub const WGMMA_SUITES: [BlockSuite; 2] = [
    BlockSuite {
        name: "gpu_block_sparse_wgmma_forward_bf16",
        bf16: true,
        cases: 64,
        seed: 0x6770_7577_676d_6d61,
        shapes: DrawShapes::Wgmma,
    },
    BlockSuite {
        name: "gpu_block_sparse_wgmma_forward_f16",
        bf16: false,
        cases: 64,
        seed: 0x6770_7577_676d_6d62,
        shapes: DrawShapes::Wgmma,
    },
];

impl BlockSuite {
    /// The run's configuration (`crate::property::run_config`).
    pub fn config(&self) -> Config {
        run_config(self.name, self.cases, self.seed)
    }

    /// The draws as CI runs them (`crate::property::default_run_config`), without shrinking: a mutant's run stops at
    /// its first failing draw.
    pub fn default_config(&self) -> Config {
        Config { max_shrink_iters: 0, ..default_run_config(self.name, self.cases, self.seed) }
    }

    /// Runs the suite under `config`, calling `check` on each draw; returns the draws' features and the result.
    pub fn run(
        &self,
        config: Config,
        check: impl Fn(&BlockDraw) -> Result<(), TestCaseError>,
    ) -> (BlockCoverage, Result<(), TestError<BlockDraw>>) {
        let coverage = RefCell::new(BlockCoverage::default());
        let mut runner = TestRunner::new(config);
        let result = runner.run(&block_draws(self.shapes), |draw| {
            coverage.borrow_mut().record(&draw);
            check(&draw)
        });
        (coverage.into_inner(), result)
    }

    /// The check of one draw by `kernel` in the suite's dtype.
    pub fn check(
        &self,
        stream: &Arc<CudaStream>,
        kernel: KernelSource,
        worst: &RefCell<Worst>,
        draw: &BlockDraw,
    ) -> Result<(), TestCaseError> {
        if self.bf16 {
            check_draw::<bf16>(stream, kernel, worst, draw)
        } else {
            check_draw::<f16>(stream, kernel, worst, draw)
        }
    }
}

/// The block-sparse features of a suite's draws: each (query block, key block, list heads, density) combination.
#[derive(Clone, Debug, Default)]
pub struct BlockCoverage {
    /// Draws per combination.
    pub seen: std::collections::BTreeMap<(usize, usize, bool, Density), usize>,
    /// Draws with a GQA group above 1 and lists per KV head (the group shares a list).
    pub shared_group_lists: usize,
    /// Draws with a varlen layout.
    pub varlen: usize,
    /// Draws whose CSR transpose (one row per sequence, list head and key block) has a non-empty row past the 32nd,
    /// so that its offsets need the scan's second warp.
    pub csr_rows_past_a_warp: usize,
}

impl BlockCoverage {
    fn record(&mut self, d: &BlockDraw) {
        let per_kv = d.lists.heads == ListHeads::PerKvHead;
        *self.seen.entry((d.lists.q_block, d.lists.kv_block, per_kv, d.density)).or_default() += 1;
        self.shared_group_lists += usize::from(per_kv && d.spec.group_size() > 1);
        self.varlen += usize::from(matches!(d.spec.layout, Layout::Varlen { .. }));
        let l = &d.lists;
        let (key_blocks, list_heads) = (l.key_blocks(&d.spec), l.lists.dim().1);
        let row_listed = |row: usize| {
            let (seq, head, block) = (row / (list_heads * key_blocks), row / key_blocks % list_heads, row % key_blocks);
            l.lists.index_axis(Axis(0), seq).index_axis(Axis(0), head).iter().any(|&b| b == block as i32)
        };
        let rows = d.spec.sequences().len() * list_heads * key_blocks;
        self.csr_rows_past_a_warp += usize::from((32..rows).any(row_listed));
    }

    /// The combinations of `sizes` (each side) no draw reached.
    pub fn unreached(&self, sizes: &[usize]) -> Vec<(usize, usize, bool, Density)> {
        self.unreached_of(sizes, sizes)
    }

    /// The combinations of query block sizes `q_sizes` and key block sizes `kv_sizes` no draw reached.
    pub fn unreached_of(&self, q_sizes: &[usize], kv_sizes: &[usize]) -> Vec<(usize, usize, bool, Density)> {
        let mut missing = vec![];
        for &q in q_sizes {
            for &k in kv_sizes {
                for per_kv in [false, true] {
                    for density in Density::ALL {
                        if !self.seen.contains_key(&(q, k, per_kv, density)) {
                            missing.push((q, k, per_kv, density));
                        }
                    }
                }
            }
        }
        missing
    }
}

/// The second input's seed, from the first's.
const SECOND_INPUT: u64 = 0x9e37_79b9_7f4a_7c15;

/// Whether every own query block of every sequence lists every key block of its sequence.
pub fn lists_everything(draw: &BlockDraw) -> bool {
    let l = &draw.lists;
    draw.spec.sequences().iter().all(|seq| {
        let key_blocks = seq.len_k.div_ceil(l.kv_block) as i32;
        (0..l.lists.dim().1).all(|h| {
            (0..seq.len_q.div_ceil(l.q_block))
                .all(|a| (0..key_blocks).all(|b| l.lists[[seq.index, h, a, b as usize]] == b))
        })
    })
}

fn check_draw<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    worst: &RefCell<Worst>,
    draw: &BlockDraw,
) -> Result<(), TestCaseError> {
    let layout = draw.lists.oracle_layout(&draw.spec);
    let a = make_case::<T>(&draw.spec, draw.profile, draw.seed);
    let b = make_case::<T>(&draw.spec, draw.profile, draw.seed ^ SECOND_INPUT);
    let mut first_bits = None;
    for (n, case) in [&a, &b, &a].into_iter().enumerate() {
        let run = block_sparse_forward_guarded(stream, case, &draw.lists, kernel)
            .map_err(|e| TestCaseError::fail(format!("launch {n}: {e}")))?;
        let verdicts =
            match verify_block_sparse_forward(case, &layout, forward_recipe::<T>(), run.o.view(), run.lse.view()) {
                Ok(v) => v,
                Err(SparseHarnessError::Harness(HarnessError::Model(m))) => {
                    return Err(TestCaseError::reject(m.to_string()));
                }
                Err(e) => return Err(TestCaseError::fail(format!("input {n}: {e}"))),
            };
        for (i, v) in verdicts.iter().enumerate() {
            prop_assert!(v.passed() && v.valid(), "input {n}, verdict {i} (sequence, head in order):\n{v}");
            worst.borrow_mut().record(v);
        }
        let bits = (
            run.o.iter().map(|x| x.bits()).collect::<Vec<_>>(),
            run.lse.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        );
        match n {
            0 => first_bits = Some(bits),
            2 => prop_assert!(first_bits.as_ref() == Some(&bits), "input A gave different bits the second time"),
            _ => {}
        }
        if n == 0 && lists_everything(draw) {
            let (dense_kernel, tiling) = dense_forward_of(kernel, draw);
            let dense = forward_guarded(stream, case, dense_kernel, tiling)
                .map_err(|e| TestCaseError::fail(format!("dense launch: {e}")))?;
            prop_assert!(dense.same(&run), "every block listed, but the bits differ from the dense kernel's");
        }
    }
    Ok(())
}

/// Runs `suite` on a device with `check` (the production kernels' check of one draw), compiling the `variants` of
/// the draws ahead in parallel (`crate::property::compile_ahead`); prints the worst ratio and the draws' coverage.
pub fn run_on_device(
    suite: &BlockSuite,
    variants: impl Fn(&BlockDraw) -> Vec<ModuleVariant> + Sync,
    check: impl Fn(&Arc<CudaStream>, &RefCell<Worst>, &BlockDraw) -> Result<(), TestCaseError>,
) {
    let Some(ctx) = skip_unless_gpu(suite.name) else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let worst = RefCell::new(Worst::default());
    let replay = |sink: &dyn Fn(Vec<ModuleVariant>)| {
        let _ = suite.run(Config { max_shrink_iters: 0, ..suite.config() }, |draw| {
            sink(variants(draw));
            Ok(())
        });
    };
    let (coverage, result) = compile_ahead(&ctx, replay, |next_draw| {
        suite.run(suite.config(), |draw| {
            next_draw();
            check(&stream, &worst, draw)
        })
    });
    if let Err(e) = result {
        panic!("{}: {e}", suite.name);
    }
    println!("{}: worst error/bound {}; coverage {coverage:?}", suite.name, worst.borrow());
}

/// The modules the forward check of `draw` by `kernel` compiles in `suite`'s dtype: the block-sparse forward's, and
/// the dense forward's when every block is listed.
pub fn forward_variants(suite: &BlockSuite, kernel: KernelSource, draw: &BlockDraw) -> Vec<ModuleVariant> {
    fn of<T: Storage>(kernel: KernelSource, draw: &BlockDraw) -> Vec<ModuleVariant> {
        let spec = &draw.spec;
        let mut out = vec![draw.lists.forward_variant::<T>(spec, kernel)];
        if lists_everything(draw) {
            let (dense_kernel, tiling) = dense_forward_of(kernel, draw);
            out.push(forward_variant::<T>(spec, tiling, dense_kernel));
        }
        out.into_iter().flatten().collect()
    }
    if suite.bf16 { of::<bf16>(kernel, draw) } else { of::<f16>(kernel, draw) }
}

/// The dense forward whose bits a block-sparse forward of `kernel` listing every block must give: the same kernel
/// family (unpatched) in the same tiling.
fn dense_forward_of(kernel: KernelSource, draw: &BlockDraw) -> (KernelSource, ForwardTiling) {
    if is_wgmma(kernel) { (FLASH_FWD_SM90, ForwardTiling::WGMMA) } else { (FLASH_FWD, draw.lists.tiling(&draw.spec)) }
}

/// Runs `suite` on the production forward.
fn run_production(suite: &BlockSuite) {
    run_on_device(
        suite,
        |draw| forward_variants(suite, FLASH_FWD, draw),
        |stream, worst, draw| suite.check(stream, FLASH_FWD, worst, draw),
    );
}

#[test]
fn block_sparse_forward_is_within_bound_bf16() {
    run_production(&BLOCK_SUITES[0]);
}

#[test]
fn block_sparse_forward_is_within_bound_f16() {
    run_production(&BLOCK_SUITES[1]);
}

/// Runs `suite` on the sm_90a forward, on a device of compute capability 9.0 (elsewhere the kernel is an
/// `UnsupportedDevice` error and the test prints why it skips).
fn run_wgmma(suite: &BlockSuite) {
    if skip_unless_hopper(suite.name).is_none() {
        return;
    }
    run_on_device(
        suite,
        |draw| forward_variants(suite, FLASH_FWD_SM90, draw),
        |stream, worst, draw| suite.check(stream, FLASH_FWD_SM90, worst, draw),
    );
}

#[test]
fn block_sparse_wgmma_forward_is_within_bound_bf16() {
    run_wgmma(&WGMMA_SUITES[0]);
}

#[test]
fn block_sparse_wgmma_forward_is_within_bound_f16() {
    run_wgmma(&WGMMA_SUITES[1]);
}

/// The production wrapper runs the sm_90a forward for 128×128 blocks on 9.0: its bits are that kernel's, and they
/// differ from `flash_fwd`'s on the same lists (the tensor cores sum in another order), which the comparison needs to
/// mean anything.
#[test]
fn the_production_block_sparse_forward_runs_the_wgmma_kernel_on_hopper() {
    let Some(ctx) = skip_unless_hopper("the_production_block_sparse_forward_runs_the_wgmma_kernel_on_hopper") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    let spec = dense(1, 2, 1, 300, 300, 128, 128, Mask::Causal);
    let lists = uniform_lists(&spec, 128, 128, ListHeads::PerKvHead, &[0, 2]);
    let case = make_case::<bf16>(&spec, ValueProfile::GAUSSIAN, 21);
    let production = block_sparse_forward(&stream, &spec, &lists, case.q.view(), case.k.view(), case.v.view())
        .expect("the production forward");
    let wgmma = block_sparse_forward_guarded(&stream, &case, &lists, FLASH_FWD_SM90).expect("the sm_90a forward");
    let mma = block_sparse_forward_guarded(&stream, &case, &lists, FLASH_FWD).expect("flash_fwd");
    let bits = |o: &ndarray::ArrayD<bf16>| o.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&production.o), bits(&wgmma.o), "the production forward is not the sm_90a kernel");
    assert_ne!(bits(&production.o), bits(&mma.o), "flash_fwd and the sm_90a kernel agree bit for bit");
}

/// The features of `suites`' draws together, replayed without a device as CI runs them; every drawn list must be
/// valid (the strategy builds them by the convention).
pub fn suites_coverage(suites: &[BlockSuite]) -> BlockCoverage {
    let mut union = BlockCoverage::default();
    for suite in suites {
        let (coverage, result) = suite.run(suite.default_config(), |draw| {
            draw.lists.validate(&draw.spec).map_err(|e| TestCaseError::fail(e.to_string()))
        });
        assert!(result.is_ok(), "{}: {result:?}", suite.name);
        for (k, n) in coverage.seen {
            *union.seen.entry(k).or_default() += n;
        }
        union.shared_group_lists += coverage.shared_group_lists;
        union.varlen += coverage.varlen;
        union.csr_rows_past_a_warp += coverage.csr_rows_past_a_warp;
    }
    union
}

/// The suites' draws, replayed without a device, reach every combination of block sizes, list heads and density,
/// lists shared by a GQA group, and varlen problems.
#[test]
fn the_block_sparse_suites_draw_every_list_feature() {
    let union = suites_coverage(&BLOCK_SUITES);
    println!("block-sparse suites: {union:?}");
    assert!(union.unreached(&BLOCK_SIZES).is_empty(), "never drawn: {:?}", union.unreached(&BLOCK_SIZES));
    assert!(union.shared_group_lists > 0 && union.varlen > 0, "{union:?}");
}

/// The sm_90a forward's suites reach every list-head and density class at 128×128, GQA-shared lists, varlen, and
/// both paddings of each head dim (up to 64 and up to 128).
#[test]
fn the_wgmma_suites_draw_every_list_feature_at_their_block_size() {
    let union = suites_coverage(&WGMMA_SUITES);
    println!("sm_90a block-sparse suites: {union:?}");
    let sizes = DrawShapes::Wgmma.block_sizes();
    assert!(union.unreached(&sizes).is_empty(), "never drawn: {:?}", union.unreached(&sizes));
    assert!(union.shared_group_lists > 0 && union.varlen > 0, "{union:?}");
    let pads = RefCell::new(std::collections::BTreeSet::new());
    for suite in &WGMMA_SUITES {
        let _ = suite.run(suite.default_config(), |draw| {
            assert!(draw.lists.suits_wgmma(&draw.spec), "{:?}", draw.spec);
            pads.borrow_mut().insert((draw.spec.head_dim.div_ceil(64), draw.spec.head_dim_v.div_ceil(64)));
            Ok(())
        });
    }
    let pads = pads.into_inner();
    assert!(pads.contains(&(1, 1)) && pads.contains(&(2, 2)), "head-dim paddings drawn: {pads:?}");
}

/// Lists of `spec` that name the key blocks among `entries` (those inside the sequence) then `−1`, in every own query
/// block of every sequence and list head.
pub fn uniform_lists(
    spec: &AttentionSpec,
    q_block: usize,
    kv_block: usize,
    heads: ListHeads,
    entries: &[i32],
) -> BlockLists {
    let seqs = spec.sequences();
    let n_q = seqs.iter().map(|s| s.len_q.div_ceil(q_block)).max().unwrap_or(0);
    let n_k = seqs.iter().map(|s| s.len_k.div_ceil(kv_block)).max().unwrap_or(0);
    let rows = seqs.len() * spec.n_heads_q * n_q;
    let picks: Vec<Vec<bool>> = vec![(0..n_k).map(|b| entries.contains(&(b as i32))).collect(); rows];
    lists_from(spec, q_block, kv_block, heads, &picks)
}

/// A query block that lists nothing gets exactly `O = 0` and `LSE = −∞`, next to one that lists blocks.
#[test]
fn unlisted_query_blocks_give_zero_and_minus_infinity() {
    let Some(stream) = device_stream("unlisted_query_blocks_give_zero_and_minus_infinity") else { return };
    let spec = dense(1, 2, 1, 200, 200, 64, 64, Mask::None);
    let mut lists = uniform_lists(&spec, 64, 64, ListHeads::PerKvHead, &[1, 3]);
    lists.lists.slice_axis_mut(ndarray::Axis(2), (1..2).into()).fill(-1);
    let case = make_case::<bf16>(&spec, gaussian(1.0), 3);
    let run = block_sparse_forward_guarded(&stream, &case, &lists, FLASH_FWD).expect("launch");
    for h in 0..2 {
        for i in 64..128 {
            assert_eq!(run.lse[[0, h, i]], f32::NEG_INFINITY, "head {h} row {i}");
            assert!((0..64).all(|c| run.o[[0, h, i, c]].to_f32() == 0.0), "head {h} row {i}");
        }
        assert!(run.lse[[0, h, 0]].is_finite() && run.lse[[0, h, 128]].is_finite());
    }
}

/// Every way a list can break the convention is a typed error before any launch, and the device stays usable.
#[test]
fn bad_lists_are_typed_errors_before_any_launch() {
    let Some(stream) = device_stream("bad_lists_are_typed_errors_before_any_launch") else { return };
    let spec = dense(1, 2, 1, 150, 150, 64, 64, Mask::Causal);
    let case = make_case::<bf16>(&spec, gaussian(1.0), 4);
    let good = uniform_lists(&spec, 64, 64, ListHeads::PerQueryHead, &[0, 1]);
    let run =
        |lists: &BlockLists| block_sparse_forward(&stream, &spec, lists, case.q.view(), case.k.view(), case.v.view());
    every_list_fault_is_refused(&good, run);
    // Nothing was launched with a bad list, so the context is intact and a good launch runs.
    let out = run(&good).expect("a valid launch after the refusals");
    assert!(out.lse.iter().all(|x| x.is_finite()));
}

/// Every way a list can break the convention (`good`'s lists with one entry wrong, too wide, a block size that does
/// not match the lists' shape or is not supported) makes `run` a typed error naming the fault: shared by the forward
/// and backward wrappers, which must refuse the same lists before any launch.
pub fn every_list_fault_is_refused<R>(good: &BlockLists, run: impl Fn(&BlockLists) -> Result<R, GpuError>) {
    let with = |at: [usize; 4], x: i32| {
        let mut l = good.clone();
        l.lists[at] = x;
        l
    };
    let fault = |lists: &BlockLists| match run(lists) {
        Err(GpuError::BlockList { fault, .. }) => fault,
        Err(other) => panic!("expected a block list error, got {other:?}"),
        Ok(_) => panic!("expected a block list error, got a launch"),
    };
    assert!(matches!(fault(&with([0, 1, 2, 2], 3)), BlockListFault::OutOfRange { index: 3, .. }));
    assert!(matches!(fault(&with([0, 0, 0, 1], 0)), BlockListFault::Duplicate { index: 0 }));
    assert!(matches!(fault(&with([0, 0, 1, 0], -1)), BlockListFault::AfterPad { index: 1 }));
    assert!(matches!(fault(&with([0, 0, 1, 0], 2)), BlockListFault::NotAscending { index: 1, previous: 2 }));
    let (batch, heads, blocks, _) = good.lists.dim();
    let wide = BlockLists { lists: Array4::from_elem((batch, heads, blocks, 4), -1), ..good.clone() };
    assert!(matches!(fault(&wide), BlockListFault::TooWide { width: 4, key_blocks: 3 }));
    let mismatched = BlockLists { q_block: 128, ..good.clone() };
    assert!(matches!(run(&mismatched), Err(GpuError::Shape { argument: "lists", .. })));
    let odd_size = BlockLists { kv_block: 96, ..good.clone() };
    assert!(matches!(run(&odd_size), Err(GpuError::Unsupported { argument: "kv_block", .. })));
}

/// Small shapes for `run.sh sanitize` (compute-sanitizer memcheck and racecheck), forward and backward: both block
/// sizes, lists per KV head over a group of 3 and per query head, a partial last key block, varlen with an empty
/// sequence, pads and an empty list.
pub fn sanitizer_draws() -> Vec<BlockDraw> {
    let shapes = [
        (dense(1, 3, 1, 130, 129, 32, 32, Mask::Causal), 64, 128, ListHeads::PerKvHead, vec![0, 1]),
        (
            dense(1, 2, 2, 65, 200, 64, 64, Mask::Window { left: 70, right: 3 }),
            128,
            64,
            ListHeads::PerQueryHead,
            vec![1, 3],
        ),
        (varlen(&[0, 0, 70], &[0, 20, 150], 2, 1, 32, 32, Mask::None), 64, 64, ListHeads::PerKvHead, vec![0, 2]),
        (dense(1, 1, 1, 70, 70, 64, 64, Mask::None), 64, 64, ListHeads::PerKvHead, vec![]),
    ];
    uniform_draws(shapes, 9)
}

/// Draws of uniform lists: each shape is (spec, query block, key block, list heads, the key blocks every list holds).
pub fn uniform_draws<const N: usize>(
    shapes: [(AttentionSpec, usize, usize, ListHeads, Vec<i32>); N],
    seed: u64,
) -> Vec<BlockDraw> {
    shapes
        .into_iter()
        .map(|(spec, q_block, kv_block, heads, entries)| {
            let lists = uniform_lists(&spec, q_block, kv_block, heads, &entries);
            BlockDraw { spec, lists, density: Density::Sparse, profile: gaussian(1.0), seed }
        })
        .collect()
}

/// Checks every draw of `draws` on the device of `ctx` with `check` and prints the worst error/bound under `name`:
/// the sanitizer tests of the block-sparse kernels.
pub fn check_draws(
    ctx: &Arc<CudaContext>,
    name: &str,
    draws: Vec<BlockDraw>,
    check: impl Fn(&Arc<CudaStream>, &RefCell<Worst>, &BlockDraw) -> Result<(), TestCaseError>,
) {
    let stream = ctx.new_stream().expect("create a stream");
    let worst = RefCell::new(Worst::default());
    for draw in draws {
        if let Err(e) = check(&stream, &worst, &draw) {
            panic!("{draw:?}: {e}");
        }
    }
    println!("{name}: worst error/bound {}", worst.borrow());
}

/// The forward over [`sanitizer_draws`], for `run.sh sanitize`.
#[test]
fn sanitizer_shapes() {
    let Some(ctx) = skip_unless_gpu("block_sparse::sanitizer_shapes") else {
        return;
    };
    check_draws(&ctx, "block_sparse::sanitizer_shapes", sanitizer_draws(), |stream, worst, draw| {
        check_draw::<bf16>(stream, FLASH_FWD, worst, draw)
    });
}

/// Small draws for the sm_90a forward under `run.sh sanitize`: its tensor-copy pipeline over more tiles than stages
/// (every stage refilled, its barriers through a second phase) with a GQA group of 3 and dv ≠ d, varlen with an empty
/// key sequence and a tail tile per sequence (each sequence's tensor maps end at its keys), and its cp.async loads
/// (d < 64).
pub fn wgmma_sanitizer_draws() -> Vec<BlockDraw> {
    let heads_per_kv = ListHeads::PerKvHead;
    let per_query_head = ListHeads::PerQueryHead;
    let shapes = [
        (dense(1, 3, 1, 130, 900, 128, 64, Mask::Causal), 128, 128, heads_per_kv, vec![0, 1, 2, 3, 4, 5, 6]),
        (varlen(&[0, 60, 60, 200], &[0, 0, 150, 420], 2, 1, 64, 64, Mask::None), 128, 128, per_query_head, vec![0, 1]),
        (dense(1, 2, 2, 129, 200, 40, 40, Mask::Window { left: 70, right: 3 }), 128, 128, per_query_head, vec![0, 1]),
    ];
    uniform_draws(shapes, 10)
}

/// The sm_90a forward over [`wgmma_sanitizer_draws`], for `run.sh sanitize`.
#[test]
fn wgmma_sanitizer_shapes() {
    let Some(ctx) = skip_unless_hopper("block_sparse::wgmma_sanitizer_shapes") else {
        return;
    };
    check_draws(&ctx, "block_sparse::wgmma_sanitizer_shapes", wgmma_sanitizer_draws(), |stream, worst, draw| {
        check_draw::<bf16>(stream, FLASH_FWD_SM90, worst, draw)
    });
}

/// The block-sparse killing cases of the catalog's `BLOCK_SPARSE` mutants: 128-key blocks with pads (so that a pad
/// read as block 0 and half-visited blocks show), causal with the diagonal block listed, lists per query head in a
/// GQA group with different lists per head, two sequences with different lists, and a row max at logit scale 20.
/// The sm_90a forward's killing cases: 128×128 blocks, a causal diagonal with Lq ≠ Lk and a GQA group sharing
/// lists, a window over a 257-row tail with dv ≠ d, and two sequences with lists per query head at logit scale 4.
pub fn wgmma_killing_cases() -> Vec<(&'static str, Case<bf16>, BlockLists)> {
    let mut out = vec![];
    let spec = dense(1, 4, 2, 300, 260, 64, 64, Mask::Causal);
    let lists = uniform_lists(&spec, 128, 128, ListHeads::PerKvHead, &[0, 1, 2]);
    out.push(("causal_gqa_lq_gt_lk", make_case(&spec, gaussian(1.0), 31), lists));
    let spec = dense(1, 2, 2, 257, 257, 128, 64, Mask::Window { left: 100, right: 5 });
    let lists = uniform_lists(&spec, 128, 128, ListHeads::PerQueryHead, &[0, 1, 2]);
    out.push(("window_tail_dv64", make_case(&spec, gaussian(1.0), 32), lists));
    let spec = dense(2, 2, 1, 200, 400, 128, 128, Mask::None);
    let picks: Vec<Vec<bool>> = (0..8).map(|r| (0..4).map(|b| (r + b) % 2 == 0).collect()).collect();
    let lists = lists_from(&spec, 128, 128, ListHeads::PerQueryHead, &picks);
    out.push(("two_sequences_x4", make_case(&spec, gaussian(4.0), 33), lists));
    // d = 40 takes the cp.async loads (flash::wgmma_uses_tma), every case above the tensor copies.
    let spec = dense(1, 2, 1, 130, 200, 40, 72, Mask::Causal);
    let lists = uniform_lists(&spec, 128, 128, ListHeads::PerKvHead, &[0, 1]);
    out.push(("cp_async_loads_d40", make_case(&spec, gaussian(1.0), 34), lists));
    out
}

pub fn killing_cases() -> Vec<(&'static str, Case<bf16>, BlockLists)> {
    let mut out = vec![];
    let spec = dense(1, 2, 1, 200, 300, 64, 64, Mask::Causal);
    let lists = uniform_lists(&spec, 64, 128, ListHeads::PerKvHead, &[1]);
    out.push(("causal_kv128_padded", make_case(&spec, gaussian(1.0), 21), lists));
    let spec = dense(1, 4, 2, 256, 256, 64, 64, Mask::None);
    let picks: Vec<Vec<bool>> = (0..16).map(|r| (0..4).map(|b| (r + b) % 3 == 0).collect()).collect();
    let lists = lists_from(&spec, 64, 64, ListHeads::PerQueryHead, &picks);
    out.push(("per_query_head_lists", make_case(&spec, gaussian(1.0), 22), lists));
    let spec = dense(2, 1, 1, 128, 256, 64, 64, Mask::None);
    let picks: Vec<Vec<bool>> = vec![vec![true, false, false, true], vec![false, true, true, false]];
    let lists = lists_from(&spec, 128, 64, ListHeads::PerQueryHead, &picks);
    out.push(("two_sequences", make_case(&spec, gaussian(4.0), 23), lists));
    out
}
