//! The ring forward's GPU arithmetic on one device: every (query chunk, key chunk) pair's partial state from the
//! forward kernel's `STATE_OUT` mode, merged (E4) in the ring order of E11 over contiguous and zigzag (E11a) layouts,
//! then finalized (E5), verified against the f64 oracle under the forward recipe with `extra_merges = 2(P − 1)`
//! (`attnproof_gpu::ring::state`'s docs). With one chunk the pipeline must equal the plain forward bit for bit.
//!
//! `ring_forward` below plays every device in turn on one stream; the crate's `ring::gpu_ring_forward` runs the ring
//! driver with one thread and one stream per simulated device and stream-ordered copies between them, and must give
//! the same bits (same pairs, same merge order per device), which checks that the transport delivers the right data
//! at the right time (a stale or early-read buffer would change them). That bitwise comparison is also what kills the
//! GPU ring's mutants (`xtask/catalog/src/ring.rs`), which the GPU bundle builds as patched copies of this crate.

use std::sync::Arc;

use crate::common::*;
use attnproof_gpu::compile::FLASH_FWD;
use attnproof_gpu::ring::state::{ChunkWindow, DeviceState, finalize_state, merge_states};
use attnproof_gpu::ring::{
    BackwardStart, BlockLayout, GpuKvBlock, KvChunk, NcclLink, RingInputs, dense_dims, gpu_ring_backward,
    gpu_ring_forward, nccl_ring_backward, nccl_ring_forward, pair_spec,
};
use attnproof_gpu::{
    ForwardTiling, GpuElement, flash::flash_forward_state_device, flash_forward_device_with, skip_unless_gpu,
};
use attnproof_harness::generate::make_case;
use attnproof_harness::recipes;
use attnproof_harness::ring_gpu::{backward_start, ring_inputs};
use attnproof_harness::{Case, verify_forward};
use attnproof_oracle::online::ring_block_at;
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Mask};
use attnproof_ring_driver::{RingLayout, RingSplit, RingTransport};
use cudarc::driver::CudaContext;
use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::safe::{Comm, Id};
use half::{bf16, f16};
use ndarray::{ArrayD, Axis, IxDyn, Slice};

/// The rows `range` of axis 2 (the sequence axis of a dense `[B, H, L, D]` or `[B, H, L]` tensor), contiguous.
fn rows<X: Clone>(t: &ArrayD<X>, range: &std::ops::Range<usize>) -> ArrayD<X> {
    t.slice_axis(Axis(2), Slice::from(range.clone())).as_standard_layout().to_owned()
}

/// The ring forward of `case` over `config`'s devices, one stream playing each device in turn: device `g` attends
/// its query chunks to the key chunks of device `(g − t) mod G` at step `t`, merging each visible pair's partial state
/// into its chunk's running state, and finalizes. Returns `O`, LSE, and the pairs skipped as invisible.
fn ring_forward<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    config: RingSplit,
) -> Result<(ArrayD<T>, ArrayD<f32>, usize), String> {
    let spec = &case.spec;
    let (_, len_q, len_k) = dense_dims(spec);
    let mut o = ArrayD::from_elem(spec.expected_shape(Operand::O), T::from_f32(f32::NAN));
    let mut lse = ArrayD::from_elem(spec.expected_shape(Operand::RowStat), f32::NAN);
    let g = config.n_devices;
    let mut skipped = 0;
    for device in 0..g {
        for q_range in config.positions(device, len_q).into_iter().filter(|r| !r.is_empty()) {
            let n_q = q_range.len();
            let q_chunk = upload(stream, &rows(&case.q, &q_range))?;
            let chunk_spec = pair_spec(spec, n_q, 1);
            let mut run = DeviceState::for_spec(stream, &chunk_spec).map_err(|e| e.to_string())?;
            for step in 0..g {
                let owner = ring_block_at(device, step, g);
                for k_range in config.positions(owner, len_k).into_iter().filter(|r| !r.is_empty()) {
                    let n_k = k_range.len();
                    let window =
                        ChunkWindow::for_pair(&spec.mask, (len_q, len_k), (q_range.start, n_q), (k_range.start, n_k))
                            .map_err(|e| e.to_string())?;
                    if !window.sees_any(n_q, n_k) {
                        skipped += 1;
                        continue;
                    }
                    let pair = pair_spec(spec, n_q, n_k);
                    let (k_chunk, v_chunk) =
                        (upload(stream, &rows(&case.k, &k_range))?, upload(stream, &rows(&case.v, &k_range))?);
                    let mut part = DeviceState::for_spec(stream, &pair).map_err(|e| e.to_string())?;
                    flash_forward_state_device(stream, &pair, window, &q_chunk, &k_chunk, &v_chunk, &mut part)
                        .map_err(|e| e.to_string())?;
                    merge_states(stream, &mut run, &part).map_err(|e| e.to_string())?;
                }
            }
            let (o_chunk, lse_chunk) = finalize(stream, &chunk_spec, &run)?;
            o.slice_axis_mut(Axis(2), Slice::from(q_range.clone())).assign(&o_chunk);
            lse.slice_axis_mut(Axis(2), Slice::from(q_range.clone())).assign(&lse_chunk);
        }
    }
    Ok((o, lse, skipped))
}

/// E5 of `state` into host `O` and LSE shaped for `spec`.
fn finalize<T: Storage>(
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    state: &DeviceState,
) -> Result<(ArrayD<T>, ArrayD<f32>), String> {
    let (o_shape, lse_shape) = (spec.expected_shape(Operand::O), spec.expected_shape(Operand::RowStat));
    let mut o: CudaSlice<T> =
        stream.alloc_zeros(o_shape.iter().product::<usize>().max(1)).map_err(|e| e.to_string())?;
    let mut lse: CudaSlice<f32> =
        stream.alloc_zeros(lse_shape.iter().product::<usize>().max(1)).map_err(|e| e.to_string())?;
    finalize_state(stream, spec, state, &mut o, &mut lse).map_err(|e| e.to_string())?;
    let (o, lse) =
        (stream.clone_dtoh(&o).map_err(|e| e.to_string())?, stream.clone_dtoh(&lse).map_err(|e| e.to_string())?);
    let n = |s: &[usize]| s.iter().product::<usize>();
    Ok((
        ArrayD::from_shape_vec(IxDyn(&o_shape), o[..n(&o_shape)].to_vec()).map_err(|e| e.to_string())?,
        ArrayD::from_shape_vec(IxDyn(&lse_shape), lse[..n(&lse_shape)].to_vec()).map_err(|e| e.to_string())?,
    ))
}

fn config(n_devices: usize, layout: RingLayout) -> RingSplit {
    RingSplit { n_devices, layout }
}

/// The cases: causal with Lq = Lk (the skip matters), Lq ≠ Lk both ways, GQA, a window, logit scale 4, chunks that
/// straddle KV tiles (lengths not multiples of 64).
fn cases() -> Vec<AttentionSpec> {
    vec![
        dense(1, 2, 2, 300, 300, 64, 64, Mask::Causal),
        dense(2, 4, 2, 130, 250, 64, 64, Mask::Causal),
        dense(1, 2, 1, 250, 130, 128, 128, Mask::None),
        dense(1, 2, 2, 200, 200, 64, 32, Mask::Window { left: 40, right: 5 }),
    ]
}

fn check<T: Storage>(stream: &Arc<CudaStream>) {
    let name = <T as GpuElement>::NAME;
    for (n, spec) in cases().iter().enumerate() {
        let case = make_case::<T>(spec, gaussian(if n == 1 { 4.0 } else { 1.0 }), 40 + n as u64);
        for layout in [RingLayout::Contiguous, RingLayout::Zigzag] {
            for devices in [2, 3, 4] {
                let config = config(devices, layout);
                let (o, lse, skipped) = ring_forward(stream, &case, config).unwrap_or_else(|e| panic!("{name}: {e}"));
                let verdict = verify_forward(&case, recipes::gpu_ring_forward::<T>(config), o.view(), lse.view())
                    .unwrap_or_else(|e| panic!("{name} {spec:?} {config:?}: {e}"));
                assert!(verdict.passed() && verdict.valid(), "{name} {spec:?} {layout:?} G={devices}:\n{verdict}");
                if matches!(spec.mask, Mask::Causal) && dense_dims(spec).1 == dense_dims(spec).2 {
                    assert!(skipped > 0, "{name} {spec:?} {config:?}: a causal ring skips future chunks");
                }
                println!("{name} {layout:?} G={devices} {spec:?}: worst error/bound {:.3e}", verdict.max_ratio());
            }
        }
    }
}

#[test]
fn ring_forward_states_are_within_the_bound() {
    let Some(stream) = device_stream("ring_forward_states_are_within_the_bound") else { return };
    check::<bf16>(&stream);
    check::<f16>(&stream);
}

/// One chunk holding everything: the state-out forward, a merge into the empty state and the finalize give the plain
/// forward's O and LSE bit for bit (the empty side contributes exact zeros, and the finalize is the forward's own
/// epilogue). The plain forward is `flash_fwd`'s, whose `STATE_OUT` mode the ring runs, in the production tiling (the
/// dense wrapper may run the sm_90a kernel instead, which sums in another order).
#[test]
fn one_chunk_equals_the_plain_forward_bitwise() {
    let Some(stream) = device_stream("one_chunk_equals_the_plain_forward_bitwise") else { return };
    for spec in cases() {
        let case = make_case::<bf16>(&spec, gaussian(1.0), 7);
        let (_, len_q, len_k) = dense_dims(&spec);
        let (q, k, v) =
            (upload(&stream, &case.q).unwrap(), upload(&stream, &case.k).unwrap(), upload(&stream, &case.v).unwrap());
        let mut o = stream.alloc_zeros::<bf16>(case.q.len().max(1) / spec.head_dim * spec.head_dim_v).unwrap();
        let mut lse =
            stream.alloc_zeros::<f32>(spec.expected_shape(Operand::RowStat).iter().product::<usize>().max(1)).unwrap();
        let tiling = ForwardTiling::for_head_dims(spec.head_dim, spec.head_dim_v);
        flash_forward_device_with(&stream, &spec, FLASH_FWD, tiling, &q, &k, &v, &mut o, &mut lse).unwrap();
        let window = ChunkWindow::for_pair(&spec.mask, (len_q, len_k), (0, len_q), (0, len_k)).unwrap();
        let pair = pair_spec(&spec, len_q, len_k);
        let mut part = DeviceState::for_spec(&stream, &pair).unwrap();
        flash_forward_state_device(&stream, &pair, window, &q, &k, &v, &mut part).unwrap();
        let mut run = DeviceState::for_spec(&stream, &pair).unwrap();
        merge_states(&stream, &mut run, &part).unwrap();
        let (o2, lse2) = finalize::<bf16>(&stream, &pair, &run).unwrap();
        let o1 = stream.clone_dtoh(&o).unwrap();
        let lse1 = stream.clone_dtoh(&lse).unwrap();
        assert!(o2.iter().zip(&o1).all(|(a, b)| a.to_bits() == b.to_bits()), "{spec:?}: O differs");
        assert!(lse2.iter().zip(&lse1).all(|(a, b)| a.to_bits() == b.to_bits()), "{spec:?}: LSE differs");
    }
}

/// A state of the wrong size and a masked pair spec are typed errors, before any launch.
#[test]
fn mismatched_states_and_masked_pair_specs_are_typed_errors() {
    let Some(stream) = device_stream("mismatched_states_and_masked_pair_specs_are_typed_errors") else { return };
    let spec = dense(1, 1, 1, 10, 10, 16, 16, Mask::None);
    let mut small = DeviceState::empty(&stream, 5, 16).unwrap();
    let right = DeviceState::for_spec(&stream, &spec).unwrap();
    assert!(merge_states(&stream, &mut small, &right).is_err());
    let q = upload(&stream, &ArrayD::from_elem(IxDyn(&[1, 1, 10, 16]), f16::ZERO)).unwrap();
    let window = ChunkWindow { left: None, right: None };
    let mut state = DeviceState::for_spec(&stream, &spec).unwrap();
    let causal = spec.clone().with_mask(Mask::Causal);
    assert!(flash_forward_state_device(&stream, &causal, window, &q, &q, &q, &mut state).is_err());
}

/// The threaded ring (one host thread and one stream per simulated device, blocks copied between streams and ordered
/// by events) gives the one-stream emulation's bits, its causal skips, and passes the verifier.
#[test]
fn threaded_ring_on_streams_matches_the_one_stream_ring_bitwise() {
    let Some(ctx) = skip_unless_gpu("threaded_ring_on_streams_matches_the_one_stream_ring_bitwise") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    for (n, spec) in cases().iter().enumerate() {
        let case = make_case::<bf16>(spec, gaussian(1.0), 60 + n as u64);
        for layout in [RingLayout::Contiguous, RingLayout::Zigzag] {
            for devices in [2, 4] {
                let config = config(devices, layout);
                let (o, lse, _) = ring_forward(&stream, &case, config).unwrap();
                let run = gpu_ring_forward(&ctx, &ring_inputs(&case), config)
                    .unwrap_or_else(|e| panic!("{spec:?} {config:?}: {e}"));
                assert!(run.o.iter().zip(&o).all(|(a, b)| a.to_bits() == b.to_bits()), "{spec:?} {config:?}: O");
                assert!(run.lse.iter().zip(&lse).all(|(a, b)| a.to_bits() == b.to_bits()), "{spec:?} {config:?}: LSE");
                // Contiguous: a causal ring skips whole blocks in the future; zigzag balances them away (every block
                // holds a piece some query sees), so it skips only chunk pairs inside blocks.
                let causal_square = matches!(spec.mask, Mask::Causal) && dense_dims(spec).1 == dense_dims(spec).2;
                if causal_square && layout == RingLayout::Contiguous {
                    assert!(run.skipped > 0, "{spec:?} {config:?}: a causal ring skips blocks in the future");
                }
                let verdict =
                    verify_forward(&case, recipes::gpu_ring_forward::<bf16>(config), run.o.view(), run.lse.view())
                        .unwrap();
                assert!(verdict.passed() && verdict.valid(), "{spec:?} {config:?}:\n{verdict}");
            }
        }
    }
}

/// NCCL as far as the GPUs at hand allow: on any GPU, a one-rank communicator's link sends a block to itself (its
/// own successor and predecessor) and hands back the same bits; with two or more GPUs, the NCCL ring forward over
/// 2, 4 and 8 of them (as many as there are) gives the simulated ring's bits.
#[test]
fn nccl_link_round_trip_and_multi_gpu_ring() {
    let Some(ctx) = skip_unless_gpu("nccl_link_round_trip_and_multi_gpu_ring") else {
        return;
    };
    if !attnproof_gpu::nccl_present() {
        let required = std::env::var("ATTNPROOF_REQUIRE_GPU").is_ok_and(|v| v.trim() == "1");
        assert!(!required, "the NCCL library is required (ATTNPROOF_REQUIRE_GPU=1) but cannot be loaded");
        println!("skipped: no NCCL library (nccl_link_round_trip_and_multi_gpu_ring)");
        return;
    }
    let one = RingSplit { n_devices: 1, layout: RingLayout::Contiguous };
    // A backward block: K, V and the f32 accumulators (one query head per KV head here) all make the hop.
    let layout = BlockLayout { split: one, len_k: 100, batch: 1, n_heads_kv: 2, d: 16, dv: 8, accumulators: Some(2) };
    let acc_host: Vec<f32> = (0..2 * 100 * 24).map(|i| i as f32 * 1e-3 - 1.0).collect();
    let k_host: Vec<bf16> = (0..2 * 100 * 16).map(|i| bf16::from_f32(i as f32 * 0.25 - 7.0)).collect();
    let v_host: Vec<bf16> = (0..2 * 100 * 8).map(|i| bf16::from_f32(3.0 - i as f32 * 0.5)).collect();
    let compute = ctx.new_stream().unwrap();
    let block = GpuKvBlock::new(
        0,
        vec![KvChunk {
            start: 0,
            len: 100,
            k: compute.clone_htod(&k_host).unwrap(),
            v: compute.clone_htod(&v_host).unwrap(),
            acc: Some(compute.clone_htod(&acc_host).unwrap()),
        }],
    );
    ctx.bind_to_thread().unwrap();
    let comm = Comm::from_rank(ctx.new_stream().unwrap(), 0, 1, Id::new().unwrap()).unwrap();
    let mut link = NcclLink::<bf16>::new(comm, compute.clone(), layout);
    link.post(&block).unwrap();
    let got = link.wait().unwrap();
    assert_eq!((got.owner, got.chunks.len()), (0, 1));
    let (k_back, v_back) =
        (compute.clone_dtoh(&got.chunks[0].k).unwrap(), compute.clone_dtoh(&got.chunks[0].v).unwrap());
    assert!(k_back.iter().zip(&k_host).all(|(a, b)| a.to_bits() == b.to_bits()), "K changed in the hop");
    assert!(v_back.iter().zip(&v_host).all(|(a, b)| a.to_bits() == b.to_bits()), "V changed in the hop");
    let acc_back = compute.clone_dtoh(got.chunks[0].acc.as_ref().expect("accumulators travel")).unwrap();
    assert!(acc_back.iter().zip(&acc_host).all(|(a, b)| a.to_bits() == b.to_bits()), "accumulators changed in the hop");
    // The backward's split hop: K and V at `prefetch` (before the attention), the accumulators at `post` (after).
    link.prefetch(&got).unwrap();
    link.post(&got).unwrap();
    let split = link.wait().unwrap();
    let k_split = compute.clone_dtoh(&split.chunks[0].k).unwrap();
    let acc_split = compute.clone_dtoh(split.chunks[0].acc.as_ref().expect("accumulators travel")).unwrap();
    assert!(k_split.iter().zip(&k_host).all(|(a, b)| a.to_bits() == b.to_bits()), "K changed in the split hop");
    assert!(acc_split.iter().zip(&acc_host).all(|(a, b)| a.to_bits() == b.to_bits()), "accumulators changed");

    let gpus = CudaContext::device_count().unwrap_or(1) as usize;
    if gpus < 2 {
        println!("skipped: the NCCL ring over several GPUs ({gpus} GPU here)");
        return;
    }
    let spec = dense(1, 4, 2, 512, 512, 64, 64, Mask::Causal);
    let case = make_case::<bf16>(&spec, gaussian(1.0), 90);
    let inputs: RingInputs<'_, bf16> = ring_inputs(&case);
    for g in [2, 4, 8].into_iter().filter(|&g| g <= gpus) {
        let contexts: Vec<_> = (0..g).map(|i| CudaContext::new(i).unwrap()).collect();
        for layout in [RingLayout::Contiguous, RingLayout::Zigzag] {
            let config = RingSplit { n_devices: g, layout };
            let nccl =
                nccl_ring_forward(&contexts, &inputs, config).unwrap_or_else(|e| panic!("G={g} {layout:?}: {e}"));
            let simulated = gpu_ring_forward(&ctx, &inputs, config).unwrap();
            assert!(nccl.o.iter().zip(&simulated.o).all(|(a, b)| a.to_bits() == b.to_bits()), "G={g} {layout:?}: O");
            assert!(
                nccl.lse.iter().zip(&simulated.lse).all(|(a, b)| a.to_bits() == b.to_bits()),
                "G={g} {layout:?}: LSE"
            );
            let verdict =
                verify_forward(&case, recipes::gpu_ring_forward::<bf16>(config), nccl.o.view(), nccl.lse.view())
                    .unwrap();
            assert!(verdict.passed() && verdict.valid(), "G={g} {layout:?}:\n{verdict}");
            println!("NCCL ring G={g} {layout:?}: worst error/bound {:.3e}", verdict.max_ratio());
            // The backward, from the NCCL forward's outputs: dK and dV with the simulated ring's bits.
            let d_out = attnproof_harness::generate::make_d_out::<bf16>(&spec, 91);
            let start: BackwardStart<'_, bf16> = backward_start(&nccl.o, &nccl.lse, &d_out);
            let nccl_g =
                nccl_ring_backward(&contexts, &inputs, &start, config).unwrap_or_else(|e| panic!("G={g}: {e}"));
            let sim_g = gpu_ring_backward(&ctx, &inputs, &start, config).unwrap();
            // dQ comes from f32 atomics (its last bits depend on their order); dK and dV from ordered adds.
            for (name, a, b) in [("dK", &nccl_g.dk, &sim_g.dk), ("dV", &nccl_g.dv, &sim_g.dv)] {
                assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "G={g} {layout:?}: NCCL {name}");
            }
            let recipe = recipes::gpu_ring_backward::<bf16>(config).recipe;
            let expect = attnproof_harness::backward::BackwardExpectation::new(
                &case,
                &d_out,
                attnproof_gpu::backward::Q_TILE,
                recipe,
            )
            .unwrap();
            let candidate = attnproof_harness::backward::BackwardCandidate {
                dq: nccl_g.dq.view(),
                dk: nccl_g.dk.view(),
                dv: nccl_g.dv.view(),
                delta: nccl_g.delta.view(),
            };
            let verdict = expect.verify(candidate).unwrap();
            assert!(verdict.passed() && verdict.valid(), "G={g} {layout:?} NCCL backward:\n{verdict}");
        }
    }
}

/// Host copy of the first `shape`-many elements of `buf`.
fn download<X: cudarc::driver::DeviceRepr + Copy>(
    stream: &Arc<CudaStream>,
    buf: &CudaSlice<X>,
    shape: &[usize],
) -> ArrayD<X> {
    let host = stream.clone_dtoh(buf).expect("download");
    ArrayD::from_shape_vec(IxDyn(shape), host[..shape.iter().product::<usize>()].to_vec()).expect("shape")
}

/// The ring backward's GPU arithmetic, one stream playing every device in E11 order: `D` per query chunk, every
/// visible pair's dQ added into its query chunk's f32 accumulator and its dK, dV sums into its KV chunk's travelling
/// f32 accumulator (which visits devices owner, owner + 1, … in step order), then dQ and dK, dV finished.
fn ring_backward<T: Storage>(stream: &Arc<CudaStream>, p: &Problem<T>, config: RingSplit) -> Grads<T> {
    use attnproof_gpu::ring::backward_steps::{
        PairBackwardInputs, ring_backward_finish_dkv, ring_backward_finish_dq, ring_backward_pair,
        ring_backward_preprocess, ring_dkv_accumulator_len,
    };
    let spec = &p.case.spec;
    let (_, len_q, len_k) = dense_dims(spec);
    let g = config.n_devices;
    let nonempty = |device: usize, len: usize| -> Vec<std::ops::Range<usize>> {
        config.positions(device, len).into_iter().filter(|r| !r.is_empty()).collect()
    };
    struct QSide<T> {
        range: std::ops::Range<usize>,
        q: CudaSlice<T>,
        lse: CudaSlice<f32>,
        d_out: CudaSlice<T>,
        delta: CudaSlice<f32>,
        dq_acc: CudaSlice<f32>,
    }
    struct KSide<T> {
        range: std::ops::Range<usize>,
        k: CudaSlice<T>,
        v: CudaSlice<T>,
        acc: CudaSlice<f32>,
    }
    let mut q_sides: Vec<Vec<QSide<T>>> = vec![];
    let mut k_sides: Vec<Vec<KSide<T>>> = vec![];
    for device in 0..g {
        let mut qs = vec![];
        for range in nonempty(device, len_q) {
            let chunk = pair_spec(spec, range.len(), 1);
            let o = upload(stream, &rows(&p.o, &range)).unwrap();
            let d_out = upload(stream, &rows(&p.d_out, &range)).unwrap();
            let rows_n = chunk.expected_shape(Operand::RowStat).iter().product::<usize>();
            let mut delta = stream.alloc_zeros::<f32>(rows_n.max(1)).unwrap();
            ring_backward_preprocess(stream, &chunk, &o, &d_out, &mut delta).unwrap();
            let q = upload(stream, &rows(&p.case.q, &range)).unwrap();
            let lse = upload(stream, &rows(&p.lse, &range)).unwrap();
            let dq_acc = stream.alloc_zeros::<f32>(q.len()).unwrap();
            qs.push(QSide { range, q, lse, d_out, delta, dq_acc });
        }
        q_sides.push(qs);
        let mut ks = vec![];
        for range in nonempty(device, len_k) {
            let chunk = pair_spec(spec, 1, range.len());
            let (k, v) =
                (upload(stream, &rows(&p.case.k, &range)).unwrap(), upload(stream, &rows(&p.case.v, &range)).unwrap());
            let acc = stream.alloc_zeros::<f32>(ring_dkv_accumulator_len(&chunk).max(1)).unwrap();
            ks.push(KSide { range, k, v, acc });
        }
        k_sides.push(ks);
    }
    for step in 0..g {
        for device in 0..g {
            let owner = ring_block_at(device, step, g);
            for qs in q_sides[device].iter_mut() {
                for ks in k_sides[owner].iter_mut() {
                    let (n_q, n_k) = (qs.range.len(), ks.range.len());
                    let window =
                        ChunkWindow::for_pair(&spec.mask, (len_q, len_k), (qs.range.start, n_q), (ks.range.start, n_k))
                            .unwrap();
                    if !window.sees_any(n_q, n_k) {
                        continue;
                    }
                    let inputs = PairBackwardInputs {
                        q: &qs.q,
                        k: &ks.k,
                        v: &ks.v,
                        lse: &qs.lse,
                        d_out: &qs.d_out,
                        delta: &qs.delta,
                    };
                    ring_backward_pair(stream, &pair_spec(spec, n_q, n_k), window, inputs, &mut qs.dq_acc, &mut ks.acc)
                        .unwrap();
                }
            }
        }
    }
    let nan = T::from_f32(f32::NAN);
    let mut grads = Grads {
        dq: ArrayD::from_elem(spec.expected_shape(Operand::Q), nan),
        dk: ArrayD::from_elem(spec.expected_shape(Operand::K), nan),
        dv: ArrayD::from_elem(spec.expected_shape(Operand::V), nan),
        delta: ArrayD::from_elem(spec.expected_shape(Operand::RowStat), f32::NAN),
    };
    for qs in q_sides.iter().flatten() {
        let chunk = pair_spec(spec, qs.range.len(), 1);
        let mut dq = stream.alloc_zeros::<T>(qs.q.len()).unwrap();
        ring_backward_finish_dq(stream, &chunk, &qs.dq_acc, &mut dq).unwrap();
        let rows_at = Slice::from(qs.range.clone());
        grads.dq.slice_axis_mut(Axis(2), rows_at).assign(&download(stream, &dq, &chunk.expected_shape(Operand::Q)));
        let delta = download(stream, &qs.delta, &chunk.expected_shape(Operand::RowStat));
        grads.delta.slice_axis_mut(Axis(2), rows_at).assign(&delta);
    }
    for ks in k_sides.iter().flatten() {
        let chunk = pair_spec(spec, 1, ks.range.len());
        let (mut dk, mut dv) =
            (stream.alloc_zeros::<T>(ks.k.len()).unwrap(), stream.alloc_zeros::<T>(ks.v.len()).unwrap());
        ring_backward_finish_dkv(stream, &chunk, &ks.acc, &mut dk, &mut dv).unwrap();
        let rows_at = Slice::from(ks.range.clone());
        grads.dk.slice_axis_mut(Axis(2), rows_at).assign(&download(stream, &dk, &chunk.expected_shape(Operand::K)));
        grads.dv.slice_axis_mut(Axis(2), rows_at).assign(&download(stream, &dv, &chunk.expected_shape(Operand::V)));
    }
    grads
}

/// The ring backward's arithmetic over contiguous and zigzag layouts of 2 to 4 devices, verified against the oracle
/// under the backward recipe with `extra_merges = extra_query_partials = 2(P − 1)` (the pair partials and their f32
/// additions on both sides).
#[test]
fn ring_backward_states_are_within_the_bound() {
    use attnproof_gpu::backward::Q_TILE;
    use attnproof_harness::backward::{BackwardCandidate, BackwardExpectation};
    let Some(ctx) = skip_unless_gpu("ring_backward_states_are_within_the_bound") else {
        return;
    };
    let stream = ctx.new_stream().expect("create a stream");
    for (n, spec) in cases().iter().enumerate() {
        let p = problem::<bf16>(&stream, spec, gaussian(1.0), 80 + n as u64);
        for layout in [RingLayout::Contiguous, RingLayout::Zigzag] {
            for devices in [2, 3, 4] {
                let config = config(devices, layout);
                let recipe = recipes::gpu_ring_backward::<bf16>(config).recipe;
                let expect = BackwardExpectation::new(&p.case, &p.d_out, Q_TILE, recipe)
                    .unwrap_or_else(|e| panic!("{spec:?} {config:?}: {e}"));
                let g = ring_backward(&stream, &p, config);
                // The threaded ring (blocks and their accumulators moved between streams) gives the same bits.
                let start = backward_start(&p.o, &p.lse, &p.d_out);
                let threaded = gpu_ring_backward(&ctx, &ring_inputs(&p.case), &start, config)
                    .unwrap_or_else(|e| panic!("{spec:?} {config:?}: {e}"));
                // dQ comes from f32 atomics (its last bits depend on their order); dK and dV from ordered adds.
                for (name, a, b) in [("dK", &threaded.dk, &g.dk), ("dV", &threaded.dv, &g.dv)] {
                    assert!(
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{spec:?} {config:?}: threaded {name}"
                    );
                }
                let candidate =
                    BackwardCandidate { dq: g.dq.view(), dk: g.dk.view(), dv: g.dv.view(), delta: g.delta.view() };
                let verdict = expect.verify(candidate).unwrap();
                assert!(verdict.passed() && verdict.valid(), "{spec:?} {layout:?} G={devices}:\n{verdict}");
                let threaded = BackwardCandidate {
                    dq: threaded.dq.view(),
                    dk: threaded.dk.view(),
                    dv: threaded.dv.view(),
                    delta: threaded.delta.view(),
                };
                let verdict_threaded = expect.verify(threaded).unwrap();
                assert!(verdict_threaded.passed(), "{spec:?} {layout:?} G={devices} threaded:\n{verdict_threaded}");
                println!(
                    "ring backward {layout:?} G={devices} {spec:?}: worst error/bound {:.3e}",
                    verdict.max_ratio()
                );
            }
        }
    }
}
