//! PISA's tail backward (`attnproof_gpu::pisa::tail_backward`) verified on the device against the oracle's
//! `pisa::tail_backward` through `attnproof_harness::pisa_tail_backward`: the block-sparse backward's model over the
//! exact keys with the tail forward's bounds, and the first-order model of the f64 tail part over the statistics the
//! device read (its f64 workspace, read back), plus their distance to the oracle's own.
//!
//! The property suites draw what the tail forward's suites draw (both masks, Lq ≠ Lk, tile ± 1 lengths, varlen with
//! empty sequences, GQA groups of 1 to 5, head dims up to 256 with d ≠ dv, long sequences of several tiles of pooled
//! keys and several of `H̄`'s key ranges, both block sizes, lists per query or KV head, every density class, large logit
//! scales), with each of the three dQ strategies of the exact part. Each draw runs the tail forward and then the
//! backward with NaN-poisoned, guarded gradients and inputs checked unchanged; a deterministic strategy runs twice with
//! the same bits; a draw without tail blocks must return the block-sparse backward's gradients bit for bit. Without a
//! device each test prints `skipped: no CUDA device` and passes.

use std::cell::RefCell;
use std::sync::Arc;

use crate::block_sparse::{BlockDraw, lists_from};
use crate::common::*;
use crate::pisa_tail::{TAIL_SUITES, TailFailure, TailSuite, alternate_lists, sanitizer_specs};
use crate::property::run_config;
use attnproof_gpu::backward::Q_TILE;
use attnproof_gpu::block_sparse::{BlockLists, ListHeads};
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::pisa::tail::{PISA_TAIL, TailPlan, TailWorkspace, pisa_tail_forward_planned, workspace_len};
use attnproof_gpu::pisa::tail_backward::{
    PISA_TAIL_BWD, TailBackwardWorkspace, partials_len, pisa_tail_backward, pisa_tail_backward_device_with,
};
use attnproof_gpu::{GpuBackwardStrategy, GpuError};
use attnproof_harness::candidate::{
    BackwardProblem, ForwardRun, Gradients, backward_guarded_with, block_sparse_backward_guarded, forward_guarded_with,
};
use attnproof_harness::generate::{make_case, make_d_out};
use attnproof_harness::pisa_tail::{PooledStatistics, tail_targets};
use attnproof_harness::pisa_tail_backward::{TailMoments, judge_tail_backward, tail_backward_targets};
use attnproof_harness::recipes::gpu_tail;
use attnproof_harness::{Case, HarnessError};
use attnproof_oracle::{AttentionSpec, Mask};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::ArrayD;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// The tail forward and then the backward of `kernel` with `strategy`, everything guarded: the forward's outputs, the
/// statistics both read (storage-type forms and f64), and the gradients.
pub struct TailBackwardRun<T> {
    /// The tail forward's `O` and LSE (the backward's inputs).
    pub forward: ForwardRun<T>,
    /// The storage-type statistics of the forward's merge.
    pub pooled: PooledStatistics,
    /// The f64 statistics the backward read.
    pub moments: TailMoments,
    /// The gradients and the exact part's `D`.
    pub grads: Gradients<T>,
}

/// Runs the tail forward (production text) and the backward of `kernel` on `case` with upstream gradient `d_out`.
pub fn tail_backward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    lists: &BlockLists,
    d_out: &ArrayD<T>,
    kernel: KernelSource,
    strategy: GpuBackwardStrategy,
) -> Result<TailBackwardRun<T>, String> {
    let spec = &case.spec;
    let plan = TailPlan::new(stream, spec, lists).map_err(|e| e.to_string())?;
    let mut stats = TailWorkspace::<T>::alloc(stream, spec, lists.kv_block).map_err(|e| e.to_string())?;
    let forward = forward_guarded_with(stream, case, |q, k, v, o, lse| {
        pisa_tail_forward_planned(stream, &plan, PISA_TAIL, q, k, v, o, lse, &mut stats)
    })
    .map_err(|e| format!("forward: {e}"))?;
    let widen = |x: Vec<T>| -> Vec<f64> { x.into_iter().map(|x| x.to_f32() as f64).collect() };
    let pooled_flat = widen(stream.clone_dtoh(&stats.pooled).map_err(|e| e.to_string())?);
    let pooled =
        PooledStatistics::from_workspace(spec, lists.kv_block, &pooled_flat).ok_or("a short pooled workspace")?;
    let flat = stream.clone_dtoh(&stats.stats).map_err(|e| e.to_string())?;
    let moments = TailMoments::from_workspace(spec, lists.kv_block, &flat).ok_or("a short f64 workspace")?;
    let mut work = TailBackwardWorkspace::alloc(stream, spec, lists.kv_block).map_err(|e| e.to_string())?;
    let problem = BackwardProblem { case, forward: &forward, d_out };
    let grads = backward_guarded_with(stream, problem, |inputs, outputs| {
        pisa_tail_backward_device_with(stream, &plan, kernel, inputs, outputs, strategy, &stats, &mut work)
    })
    .map_err(|e| format!("backward: {e}"))?;
    Ok(TailBackwardRun { forward, pooled, moments, grads })
}

/// Runs the backward `kernel` on `case` and verifies it; `Ok` with the run and the rows with a tail when it passes.
pub fn check_tail_backward<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    lists: &BlockLists,
    d_out: &ArrayD<T>,
    kernel: KernelSource,
    strategy: GpuBackwardStrategy,
) -> Result<(TailBackwardRun<T>, usize), TailFailure> {
    let run = tail_backward_guarded(stream, case, lists, d_out, kernel, strategy).map_err(TailFailure::Failed)?;
    let layout = lists.oracle_layout(&case.spec);
    let model = |e: HarnessError| match e {
        HarnessError::Model(m) => TailFailure::Model(m.to_string()),
        e => TailFailure::Failed(format!("verification: {e}")),
    };
    let forward = tail_targets(case, &layout, forward_recipe::<T>(), gpu_tail::<T>(), &run.pooled).map_err(model)?;
    let recipe = backward_recipe_for::<T>(lists.backward_tiling());
    let t = tail_backward_targets(case, &layout, d_out, &forward, recipe, Q_TILE, &run.moments).map_err(model)?;
    let g = &run.grads;
    let verdict = judge_tail_backward(&t, [g.dq.view(), g.dk.view(), g.dv.view()], g.delta.view());
    if !verdict.passed() {
        return Err(TailFailure::Failed(format!("{verdict:?}")));
    }
    Ok((run, t.tail_rows))
}

/// The strategy of the exact part a draw runs with, from its seed.
fn strategy_of(seed: u64) -> GpuBackwardStrategy {
    GpuBackwardStrategy::ALL[(seed % 3) as usize]
}

fn check_draw<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    tally: &RefCell<usize>,
    draw: &BlockDraw,
) -> Result<(), TestCaseError> {
    let case = make_case::<T>(&draw.spec, draw.profile, draw.seed);
    let d_out = make_d_out::<T>(&draw.spec, draw.seed ^ 0x5eed);
    let strategy = strategy_of(draw.seed);
    let (run, tail_rows) = match check_tail_backward(stream, &case, &draw.lists, &d_out, kernel, strategy) {
        Ok(x) => x,
        Err(TailFailure::Model(why)) => return Err(TestCaseError::reject(why)),
        Err(e) => return Err(TestCaseError::fail(e.to_string())),
    };
    if strategy.is_deterministic() {
        let again =
            tail_backward_guarded(stream, &case, &draw.lists, &d_out, kernel, strategy).map_err(TestCaseError::fail)?;
        prop_assert!(run.grads.same(&again.grads), "the same input gave different bits");
    }
    if tail_rows == 0 && strategy.is_deterministic() {
        // No tail anywhere: the block-sparse backward's gradients over the exact lists, bit for bit. (G is 0, and every
        // element's tail part is exactly 0.)
        let exact = attnproof_gpu::pisa::tail::exact_lists(&draw.spec, &draw.lists)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let cc = attnproof_gpu::compile::compute_capability(stream.context())
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let problem = BackwardProblem { case: &case, forward: &run.forward, d_out: &d_out };
        let kernel = exact.backward_kernel(&draw.spec, cc);
        let plain = block_sparse_backward_guarded(stream, problem, &exact, kernel, exact.backward_tiling(), strategy)
            .map_err(|e| TestCaseError::fail(format!("block-sparse backward: {e}")))?;
        prop_assert!(run.grads.same(&plain), "no tail, yet not the block-sparse backward's bits");
    }
    *tally.borrow_mut() += tail_rows;
    Ok(())
}

/// The two suites ("gputailb" in ASCII, plus the dtype), over the tail forward's draws (`TailSuite::run`).
pub const TAIL_BACKWARD_SUITES: [TailSuite; 2] = [
    TailSuite { name: "gpu_pisa_tail_backward_bf16", bf16: true, cases: 32, seed: 0x6770_7574_6169_6c62 },
    TailSuite { name: "gpu_pisa_tail_backward_f16", bf16: false, cases: 32, seed: 0x6770_7574_6169_6c63 },
];

/// The check of one draw of `suite` by the backward `kernel` (rows with a tail counted in `tally`).
pub fn check_backward(
    suite: &TailSuite,
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    tally: &RefCell<usize>,
    draw: &BlockDraw,
) -> Result<(), TestCaseError> {
    if suite.bf16 {
        check_draw::<bf16>(stream, kernel, tally, draw)
    } else {
        check_draw::<f16>(stream, kernel, tally, draw)
    }
}

fn run_production(suite: &TailSuite) {
    let Some(stream) = device_stream(suite.name) else { return };
    let tally = RefCell::new(0usize);
    if let Err(e) = suite.run(run_config(suite.name, suite.cases, suite.seed), |d| {
        check_backward(suite, &stream, PISA_TAIL_BWD, &tally, d)
    }) {
        panic!("{}: {e}", suite.name);
    }
    let rows = tally.into_inner();
    println!("{}: {rows} rows with a tail", suite.name);
    assert!(rows > 0, "{}: the suite never exercised the tail", suite.name);
}

#[test]
fn pisa_tail_backward_matches_the_oracle_bf16() {
    run_production(&TAIL_BACKWARD_SUITES[0]);
}

#[test]
fn pisa_tail_backward_matches_the_oracle_f16() {
    run_production(&TAIL_BACKWARD_SUITES[1]);
}

/// Without a device: the suites draw what the tail forward's suites draw (`pisa_tail::the_tail_suites_draw_masks_heads_and_densities`
/// holds those draws to their coverage), every dQ strategy of the exact part among them.
#[test]
fn the_backward_suites_draw_every_strategy() {
    for suite in &TAIL_BACKWARD_SUITES {
        let seen = RefCell::new([0usize; 3]);
        let result = suite.run(crate::property::default_run_config(suite.name, suite.cases, suite.seed), |d| {
            let s = strategy_of(d.seed);
            seen.borrow_mut()[GpuBackwardStrategy::ALL.iter().position(|x| *x == s).expect("a strategy")] += 1;
            Ok(())
        });
        assert!(result.is_ok(), "{result:?}");
        assert!(seen.borrow().iter().all(|&n| n > 0), "{}: {:?}", suite.name, seen.borrow());
    }
    assert_eq!(TAIL_SUITES.len(), TAIL_BACKWARD_SUITES.len());
}

/// Bad input is a typed error before any launch (each workspace too small, a window mask, an unsorted list); the
/// device stays usable.
#[test]
fn bad_tail_backward_input_is_a_typed_error() {
    let Some(stream) = device_stream("bad_tail_backward_input_is_a_typed_error") else { return };
    let spec = dense(1, 2, 1, 130, 200, 64, 64, Mask::Causal);
    let case = make_case::<bf16>(&spec, gaussian(1.0), 52);
    let d_out = make_d_out::<bf16>(&spec, 52);
    let picks = vec![vec![true, false, false, true]; 3];
    let lists = lists_from(&spec, 64, 64, ListHeads::PerKvHead, &picks);
    let forward = attnproof_gpu::pisa::tail::pisa_tail_forward(
        &stream,
        &spec,
        &lists,
        case.q.view(),
        case.k.view(),
        case.v.view(),
    )
    .expect("the forward");
    let run = |spec: &AttentionSpec, lists: &BlockLists| {
        let (q, k, v) = (case.q.view(), case.k.view(), case.v.view());
        pisa_tail_backward(
            &stream,
            spec,
            lists,
            q,
            k,
            v,
            forward.o.view(),
            forward.lse.view(),
            d_out.view(),
            GpuBackwardStrategy::KvOwnerDeterministic,
        )
    };
    let window = spec.clone().with_mask(Mask::Window { left: 8, right: 0 });
    assert!(matches!(run(&window, &lists), Err(GpuError::Unsupported { argument: "mask", .. })));
    let mut unsorted = lists.clone();
    unsorted.lists[[0, 0, 0, 0]] = 3;
    unsorted.lists[[0, 0, 0, 1]] = 0;
    assert!(matches!(run(&spec, &unsorted), Err(GpuError::BlockList { .. })));
    // Each workspace one element short.
    let plan = TailPlan::new(&stream, &spec, &lists).unwrap();
    let stats = TailWorkspace::<bf16>::alloc(&stream, &spec, 64).unwrap();
    let fwd = ForwardRun { o: forward.o.clone(), lse: forward.lse.clone() };
    let problem = BackwardProblem { case: &case, forward: &fwd, d_out: &d_out };
    let rows = 2 * 130;
    let full = (rows, rows, workspace_len(&spec, 64), partials_len(&spec));
    let shorts = [
        ((full.0 - 1, full.1, full.2, full.3), "work.through"),
        ((full.0, full.1 - 1, full.2, full.3), "work.mass"),
        ((full.0, full.1, full.2 - 1, full.3), "work.grads"),
        ((full.0, full.1, full.2, full.3 - 1), "work.partials"),
    ];
    for ((through, mass, grads, partials), argument) in shorts {
        let mut work = TailBackwardWorkspace {
            through: stream.alloc_zeros::<f64>(through).unwrap(),
            mass: stream.alloc_zeros::<f64>(mass).unwrap(),
            grads: stream.alloc_zeros::<f64>(grads).unwrap(),
            partials: stream.alloc_zeros::<f64>(partials).unwrap(),
        };
        let e = backward_guarded_with(&stream, problem, |inputs, outputs| {
            let strategy = GpuBackwardStrategy::KvOwnerAtomic;
            pisa_tail_backward_device_with(&stream, &plan, PISA_TAIL_BWD, inputs, outputs, strategy, &stats, &mut work)
        });
        let text = format!("{e:?}");
        assert!(e.is_err() && text.contains(argument) && text.contains("BufferTooSmall"), "{argument}: {text}");
    }
    let out = run(&spec, &lists).expect("a valid run after the refusals");
    assert_eq!(out.dq.shape(), [1, 2, 130, 64]);
}

/// The tail forward's small shapes for `run.sh sanitize` (`pisa_tail::sanitizer_specs`), through the backward.
#[test]
fn sanitizer_shapes() {
    let Some(stream) = device_stream("pisa_tail_backward::sanitizer_shapes") else { return };
    for spec in sanitizer_specs() {
        let case = make_case::<bf16>(&spec, gaussian(1.0), 53);
        let d_out = make_d_out::<bf16>(&spec, 53);
        let strategy = GpuBackwardStrategy::KvOwnerDeterministic;
        check_tail_backward(&stream, &case, &alternate_lists(&spec), &d_out, PISA_TAIL_BWD, strategy)
            .unwrap_or_else(|e| panic!("{spec:?}: {e}"));
    }
}

/// A killing case: Q, K, V, the lists and the upstream gradient.
pub type KillingCase = (Case<bf16>, BlockLists, ArrayD<bf16>);

/// The killing cases of the catalog's `pisa_tail_bwd` mutants: causal with a GQA group of 3 and Lq ≠ Lk over every
/// other block listed; no mask with lists per query head and a partial last block; and 4200 rows over 300 keys, two
/// of `G`'s row ranges.
pub fn killing_cases() -> Vec<(&'static str, KillingCase)> {
    let make = |spec: AttentionSpec, lists: BlockLists, seed: u64| {
        (make_case::<bf16>(&spec, gaussian(1.0), seed), lists, make_d_out::<bf16>(&spec, seed))
    };
    let causal = dense(1, 3, 1, 150, 400, 32, 32, Mask::Causal);
    let none = dense(1, 2, 1, 70, 64 * 5 + 40, 32, 16, Mask::None);
    let picks = vec![(0..6).map(|b| b == 1).collect::<Vec<_>>(); 2 * 2];
    let none_lists = lists_from(&none, 64, 64, ListHeads::PerQueryHead, &picks);
    let tall = dense(1, 2, 1, 4200, 300, 16, 16, Mask::None);
    vec![
        ("causal_gqa3_alternate", make(causal.clone(), alternate_lists(&causal), 61)),
        ("no_mask_per_query_head_partial_block", make(none, none_lists, 62)),
        ("two_row_ranges_of_g", make(tall.clone(), alternate_lists(&tall), 63)),
    ]
}

/// Runs the backward `kernel` on a killing case (deterministic dQ); `Ok(())` when it passes.
pub fn check_killing_case(stream: &Arc<CudaStream>, kernel: KernelSource, case: &KillingCase) -> Result<(), String> {
    check_tail_backward(stream, &case.0, &case.1, &case.2, kernel, GpuBackwardStrategy::KvOwnerDeterministic)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Without a device: on the bf16 suite's first draws the verifier's targets exist (no shape or model refusal), the
/// oracle's own gradients rounded to bf16 (and `D` to f32) pass them, and on some draws the exact part alone fails
/// (where few blocks are tail, the tail's share of dQ may lie inside the exact part's bound): the bound admits an exact
/// kernel at the suites' shapes, masks, densities and logit scales, and still tells a dropped tail.
#[test]
fn the_rounded_oracle_passes_the_suites_draws() {
    let suite = &TAIL_BACKWARD_SUITES[0];
    let counts = RefCell::new((0usize, 0usize, 0usize));
    let result = suite.run(crate::property::default_run_config(suite.name, 8, suite.seed), |d| {
        let case = make_case::<bf16>(&d.spec, d.profile, d.seed);
        let d_out = make_d_out::<bf16>(&d.spec, d.seed ^ 0x5eed);
        let layout = d.lists.oracle_layout(&d.spec);
        let pooled = PooledStatistics::rounded(&case, layout.kv_tile);
        let moments = TailMoments::of_case(&case, layout.kv_tile);
        let reject = |e: HarnessError| match e {
            HarnessError::Model(m) => TestCaseError::reject(m.to_string()),
            e => TestCaseError::fail(e.to_string()),
        };
        let forward =
            tail_targets(&case, &layout, forward_recipe::<bf16>(), gpu_tail::<bf16>(), &pooled).map_err(reject)?;
        let recipe = backward_recipe_for::<bf16>(d.lists.backward_tiling());
        let t = tail_backward_targets(&case, &layout, &d_out, &forward, recipe, Q_TILE, &moments).map_err(reject)?;
        let round = |x: &ArrayD<f64>| x.mapv(bf16::from_f64);
        let g = t.grads.clone().map(|x| round(&x));
        let delta = t.delta.0.mapv(|x| x as f32);
        let v = judge_tail_backward(&t, [g[0].view(), g[1].view(), g[2].view()], delta.view());
        prop_assert!(v.passed(), "{v:?}");
        let mut c = counts.borrow_mut();
        c.0 += 1;
        c.1 += t.tail_rows;
        c.2 += usize::from(v.gate.canned.iter().any(|x| x.name == "tail dropped" && x.applicable && x.rejected));
        Ok(())
    });
    assert!(result.is_ok(), "{result:?}");
    let (draws, tail_rows, dropped) = counts.into_inner();
    assert!(
        draws > 0 && tail_rows > 0 && dropped > 0,
        "{draws} draws, {tail_rows} rows with a tail, {dropped} rejecting"
    );
}

/// Without a device: the CPU schedule of the kernels (`attnproof_reference::sparse::pisa::pisa_tail_backward`: the
/// block-sparse backward over the exact lists with the reference tail forward's `O` and LSE, then the tail part in
/// f64 from its own f64 statistics) passes the verifier on the suites' first draws of both dtypes, under the reference
/// recipe for the exact part and its own statistics read from its workspace layout: the bound admits a backward that
/// follows the kernels' schedule at every shape, mask, density and logit scale the suites draw.
#[test]
fn the_reference_schedule_passes_the_suites_draws() {
    fn check<T: Storage>(d: &BlockDraw, tally: &RefCell<(usize, usize)>) -> Result<(), TestCaseError> {
        let case = make_case::<T>(&d.spec, d.profile, d.seed);
        let d_out = make_d_out::<T>(&d.spec, d.seed ^ 0x5eed);
        let layout = d.lists.oracle_layout(&d.spec);
        let exact = attnproof_harness::pisa_tail::exact_layout(&d.spec, &layout);
        let fail = |e: &dyn std::fmt::Display| TestCaseError::fail(e.to_string());
        let inputs = attnproof_reference::flash::Inputs { q: case.q.view(), k: case.k.view(), v: case.v.view() };
        let forward =
            attnproof_reference::sparse::pisa::pisa_tail_forward(&d.spec, &inputs, &exact).map_err(|e| fail(&e))?;
        let backward_inputs = attnproof_reference::backward::BackwardInputs {
            q: case.q.view(),
            k: case.k.view(),
            v: case.v.view(),
            o: forward.o.view(),
            lse: forward.lse.view(),
            d_out: d_out.view(),
        };
        let grads = attnproof_reference::sparse::pisa::pisa_tail_backward(&d.spec, &backward_inputs, &exact)
            .map_err(|e| fail(&e))?;
        let flat: Vec<f64> = forward.pooled.iter().map(|x| f64::from(x.to_f32())).collect();
        let pooled = PooledStatistics::from_workspace(&d.spec, layout.kv_tile, &flat)
            .ok_or_else(|| TestCaseError::fail("the schedule's pooled workspace is short"))?;
        let moments = TailMoments::from_workspace(&d.spec, layout.kv_tile, &grads.moments)
            .ok_or_else(|| TestCaseError::fail("the schedule's f64 workspace is short"))?;
        let reject = |e: HarnessError| match e {
            HarnessError::Model(m) => TestCaseError::reject(m.to_string()),
            e => TestCaseError::fail(e.to_string()),
        };
        let recipe = attnproof_harness::recipes::reference::<T>(layout.kv_tile);
        let targets = tail_targets(&case, &layout, recipe, attnproof_harness::recipes::reference::<T>(64), &pooled)
            .map_err(reject)?;
        let t =
            tail_backward_targets(&case, &layout, &d_out, &targets, recipe, exact.q_tile, &moments).map_err(reject)?;
        let v = judge_tail_backward(&t, [grads.dq.view(), grads.dk.view(), grads.dv.view()], grads.delta.view());
        prop_assert!(v.passed(), "{v:?}");
        let mut c = tally.borrow_mut();
        c.0 += 1;
        c.1 += t.tail_rows;
        Ok(())
    }
    for suite in &TAIL_BACKWARD_SUITES {
        let tally = RefCell::new((0usize, 0usize));
        let result = suite.run(crate::property::default_run_config(suite.name, 8, suite.seed), |d| {
            if suite.bf16 { check::<bf16>(d, &tally) } else { check::<f16>(d, &tally) }
        });
        assert!(result.is_ok(), "{}: {result:?}", suite.name);
        let (draws, tail_rows) = tally.into_inner();
        assert!(draws > 0 && tail_rows > 0, "{}: {draws} draws, {tail_rows} rows with a tail", suite.name);
    }
}
