//! The ring attention reference (E11, E11a zigzag), forward and backward, verified against the
//! oracle on fuzzed shapes (G ∈ 1..=4, both layouts, every mask kind, lengths that G and 2G do
//! not divide, GQA, varlen) in bf16 and f16, under the flash model with the ring's extra tiles
//! (`RingConfig::extra_merges`); plus the schedule's own claims: G = 1 is the single-pass flash
//! schedule bit for bit, the causal skip count matches an independent count, zigzag balances
//! causal work and contiguous does not, and every layout agrees within the bound; and the ring
//! driver's own schedule over the CPU-threads backend (which block each device attends at each
//! step, the skip count, accumulators travelling home), with a worker that only records.

use std::marker::PhantomData;

use attnproof_harness::backward::{BackwardCandidate, verify_backward};
use attnproof_harness::flash::{ForwardTruth, problem_forward_bounds};
use attnproof_harness::generate::{Distribution, ValueProfile, make_case, make_d_out};
use attnproof_harness::recipes::reference_ring;
use attnproof_harness::strategies::{profile, spec};
use attnproof_harness::{Case, HarnessError, Verdict, verify_forward};
use attnproof_oracle::spec::{Operand, Sequence};
use attnproof_oracle::{AttentionSpec, Layout, Mask, OracleError, Pair, Scale};
use attnproof_reference::ring::cpu::run_on_threads;
use attnproof_reference::ring::{DeviceRun, RingFault, RingWorker, Travel};
use attnproof_reference::{
    BackwardOutputs, BackwardStrategy, Element, ForwardOutputs, ReferenceError, RingConfig, RingLayout, RingStats,
    TileConfig, flash_backward, flash_forward, ring_backward, ring_forward,
};
use half::{bf16, f16};
use ndarray::ArrayD;
use proptest::prelude::*;

const TILE: usize = 8;
const TILES: TileConfig = TileConfig { q_tile: TILE, kv_tile: TILE };

fn config(n_devices: usize, layout: RingLayout) -> RingConfig {
    RingConfig { n_devices, layout, tiles: TILES }
}

fn ring_config() -> impl Strategy<Value = RingConfig> {
    (1usize..=4, prop_oneof![Just(RingLayout::Contiguous), Just(RingLayout::Zigzag)])
        .prop_map(|(g, layout)| config(g, layout))
}

fn fail<E: std::fmt::Display>(e: E) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// A case outside the model's hypothesis is rejected, not failed.
fn verdict(v: Result<Verdict, HarnessError>) -> Result<Verdict, TestCaseError> {
    match v {
        Ok(v) => Ok(v),
        Err(HarnessError::Model(m)) => Err(TestCaseError::reject(m.to_string())),
        Err(e) => Err(fail(e)),
    }
}

/// Ring forward into NaN-poisoned outputs, so that an element no device writes fails.
fn forward<T: Element>(
    case: &Case<T>,
    config: RingConfig,
) -> Result<(ArrayD<T>, ArrayD<f32>, RingStats), ReferenceError> {
    let mut o = ArrayD::from_elem(case.spec.expected_shape(Operand::O), T::from_f32(f32::NAN));
    let mut lse = ArrayD::from_elem(case.spec.expected_shape(Operand::RowStat), f32::NAN);
    let stats =
        ring_forward(&case.spec, &case.inputs(), config, ForwardOutputs { o: o.view_mut(), lse: lse.view_mut() })?;
    Ok((o, lse, stats))
}

/// NaN-poisoned gradients after one backward run.
#[derive(Debug)]
struct Grads<T> {
    dq: ArrayD<T>,
    dk: ArrayD<T>,
    dv: ArrayD<T>,
    delta: ArrayD<f32>,
}

impl<T: Element> Grads<T> {
    fn poisoned(spec: &AttentionSpec) -> Self {
        let nan = |op| ArrayD::from_elem(spec.expected_shape(op), T::from_f32(f32::NAN));
        Grads {
            dq: nan(Operand::Q),
            dk: nan(Operand::K),
            dv: nan(Operand::V),
            delta: ArrayD::from_elem(spec.expected_shape(Operand::RowStat), f32::NAN),
        }
    }
    fn outputs(&mut self) -> BackwardOutputs<'_, T> {
        BackwardOutputs {
            dq: self.dq.view_mut(),
            dk: self.dk.view_mut(),
            dv: self.dv.view_mut(),
            delta: self.delta.view_mut(),
        }
    }
    fn candidate(&self) -> BackwardCandidate<'_, T> {
        BackwardCandidate { dq: self.dq.view(), dk: self.dk.view(), dv: self.dv.view(), delta: self.delta.view() }
    }
}

/// Ring forward, then ring backward from its `O` and `LSE`, both under `config`.
fn backward<T: Element>(
    case: &Case<T>,
    d_out: &ArrayD<T>,
    config: RingConfig,
) -> Result<(Grads<T>, RingStats), ReferenceError> {
    let (o, lse, _) = forward(case, config)?;
    let mut g = Grads::poisoned(&case.spec);
    let inputs = case.backward_inputs(&o, &lse, d_out);
    let stats = ring_backward(&case.spec, &inputs, config, g.outputs())?;
    Ok((g, stats))
}

fn check_forward<T: Element>(case: &Case<T>, config: RingConfig) -> Result<(), TestCaseError> {
    let (o, lse, _) = forward(case, config).map_err(fail)?;
    let v = verdict(verify_forward(case, reference_ring::<T>(config), o.view(), lse.view()))?;
    prop_assert!(v.passed(), "{config:?}\n{v}");
    prop_assert!(v.valid(), "{config:?}\n{v}");
    Ok(())
}

fn check_backward<T: Element>(case: &Case<T>, d_out: &ArrayD<T>, config: RingConfig) -> Result<(), TestCaseError> {
    let (g, _) = backward(case, d_out, config).map_err(fail)?;
    let v = verdict(verify_backward(case, d_out, TILE, reference_ring::<T>(config), g.candidate()))?;
    prop_assert!(v.passed(), "{config:?}\n{v}");
    prop_assert!(v.valid(), "{config:?}\n{v}");
    Ok(())
}

/// The pieces of `len` positions that `device` holds, re-derived here from E11/E11a (not taken
/// from the schedule): `P` pieces `⌊c·n/P⌋ .. ⌊(c+1)·n/P⌋`; contiguous piece `g`, zigzag pieces
/// `g` and `2G − 1 − g`.
fn held(layout: RingLayout, n_devices: usize, device: usize, len: usize) -> Vec<usize> {
    let (p, pieces) = match layout {
        RingLayout::Contiguous => (n_devices, vec![device]),
        RingLayout::Zigzag => (2 * n_devices, vec![device, 2 * n_devices - 1 - device]),
    };
    pieces.into_iter().flat_map(|c| c * len / p..(c + 1) * len / p).collect()
}

fn sees(spec: &AttentionSpec, seq: &Sequence, query: usize, key: usize) -> bool {
    spec.mask.visible(Pair { query, key, len_q: seq.len_q, len_k: seq.len_k })
}

/// Independent counts: `(sequence, device, step)` triples where the block `(g − t) mod G` holds
/// no key visible to the device's queries, and per device its visible (head, query, key) pairs.
fn expected_stats(spec: &AttentionSpec, config: RingConfig) -> RingStats {
    let g_count = config.n_devices;
    let mut stats = RingStats { skipped_blocks: 0, visible_pairs: vec![0; g_count] };
    for seq in spec.sequences() {
        for g in 0..g_count {
            let queries = held(config.layout, g_count, g, seq.len_q);
            for t in 0..g_count {
                let keys = held(config.layout, g_count, (g + g_count - t) % g_count, seq.len_k);
                let pairs =
                    queries.iter().map(|&i| keys.iter().filter(|&&j| sees(spec, &seq, i, j)).count()).sum::<usize>();
                if pairs == 0 {
                    stats.skipped_blocks += 1;
                }
                stats.visible_pairs[g] += (pairs * spec.n_heads_q) as u64;
            }
        }
    }
    stats
}

fn bits<T: Element>(a: &ArrayD<T>) -> Vec<u32> {
    a.iter().map(|x| x.to_f32().to_bits()).collect()
}

fn dense_causal(len: usize, heads: (usize, usize), d: usize) -> AttentionSpec {
    AttentionSpec {
        layout: Layout::Dense { batch: 1, len_q: len, len_k: len },
        n_heads_q: heads.0,
        n_heads_kv: heads.1,
        head_dim: d,
        head_dim_v: d,
        scale: Scale::InverseSqrtHeadDim,
        mask: Mask::Causal,
    }
}

const GAUSSIAN: ValueProfile = ValueProfile { distribution: Distribution::Gaussian, logit_scale: 4.0, value_mean: 0.0 };

proptest! {
    #![proptest_config(attnproof_harness::strategies::suite_config("ring", 24))]

    #[test]
    fn ring_forward_is_within_bound_bf16(spec in spec(TILE), cfg in ring_config(), profile in profile(), seed in any::<u64>()) {
        check_forward(&make_case::<bf16>(&spec, profile, seed), cfg)?;
    }

    #[test]
    fn ring_forward_is_within_bound_f16(spec in spec(TILE), cfg in ring_config(), profile in profile(), seed in any::<u64>()) {
        check_forward(&make_case::<f16>(&spec, profile, seed), cfg)?;
    }

    #[test]
    fn ring_backward_is_within_bound_bf16(spec in spec(TILE), cfg in ring_config(), profile in profile(), seed in any::<u64>()) {
        check_backward(&make_case::<bf16>(&spec, profile, seed), &make_d_out(&spec, seed), cfg)?;
    }

    #[test]
    fn ring_backward_is_within_bound_f16(spec in spec(TILE), cfg in ring_config(), profile in profile(), seed in any::<u64>()) {
        check_backward(&make_case::<f16>(&spec, profile, seed), &make_d_out(&spec, seed), cfg)?;
    }

    /// One device holds everything and visits its tiles in the flash order: same bits, forward
    /// and backward (against strategy A, whose dQ also sums keys in ascending order).
    #[test]
    fn one_device_is_flash_bit_for_bit(spec in spec(TILE), profile in profile(), seed in any::<u64>()) {
        let case = make_case::<bf16>(&spec, profile, seed);
        let cfg = config(1, RingLayout::Contiguous);
        let (o, lse, _) = forward(&case, cfg).map_err(fail)?;
        let mut o_flash = ArrayD::from_elem(spec.expected_shape(Operand::O), bf16::from_f32(f32::NAN));
        let mut lse_flash = ArrayD::from_elem(spec.expected_shape(Operand::RowStat), f32::NAN);
        flash_forward(&spec, &case.inputs(), TILES, ForwardOutputs { o: o_flash.view_mut(), lse: lse_flash.view_mut() })
            .map_err(fail)?;
        prop_assert_eq!(bits(&o), bits(&o_flash));
        prop_assert_eq!(bits(&lse), bits(&lse_flash));
        let d_out = make_d_out::<bf16>(&spec, seed);
        let (ring, _) = backward(&case, &d_out, cfg).map_err(fail)?;
        let mut flash = Grads::poisoned(&spec);
        let inputs = case.backward_inputs(&o, &lse, &d_out);
        flash_backward(&spec, &inputs, TILES, BackwardStrategy::TwoTraversals, flash.outputs()).map_err(fail)?;
        prop_assert_eq!(bits(&ring.dq), bits(&flash.dq));
        prop_assert_eq!(bits(&ring.dk), bits(&flash.dk));
        prop_assert_eq!(bits(&ring.dv), bits(&flash.dv));
        prop_assert_eq!(bits(&ring.delta), bits(&flash.delta));
    }

    /// Every device count and layout gives the same answer within the bound: each pair differs
    /// by at most the sum of the two bounds (a layout-dependent bug shows here as a pair).
    #[test]
    fn layouts_agree_within_the_bound(spec in spec(TILE), profile in profile(), seed in any::<u64>()) {
        let case = make_case::<f16>(&spec, profile, seed);
        let [q, k, v] = case.widened();
        let mut runs = Vec::new();
        for g in 1..=4 {
            for layout in [RingLayout::Contiguous, RingLayout::Zigzag] {
                let cfg = config(g, layout);
                let (o, lse, _) = forward(&case, cfg).map_err(fail)?;
                let truth = match problem_forward_bounds(&spec, &q, &k, &v, reference_ring::<f16>(cfg)) {
                    Ok(t) => t,
                    Err(HarnessError::Model(m)) => return Err(TestCaseError::reject(m.to_string())),
                    Err(e) => return Err(fail(e)),
                };
                runs.push((cfg, o.mapv(|x| x.to_f32() as f64), lse.mapv(|x| x as f64), truth));
            }
        }
        for (a, b) in runs.iter().zip(runs.iter().skip(1)) {
            let close = |x: &ArrayD<f64>, y: &ArrayD<f64>, bx: &ArrayD<f64>, by: &ArrayD<f64>| {
                x.iter().zip(y).zip(bx.iter().zip(by)).all(|((x, y), (bx, by))| {
                    if x.is_finite() && y.is_finite() { (x - y).abs() <= bx + by } else { x == y }
                })
            };
            let (ta, tb): (&ForwardTruth, &ForwardTruth) = (&a.3, &b.3);
            prop_assert!(close(&a.1, &b.1, &ta.bound_o, &tb.bound_o), "O: {:?} vs {:?}", a.0, b.0);
            prop_assert!(close(&a.2, &b.2, &ta.bound_lse, &tb.bound_lse), "LSE: {:?} vs {:?}", a.0, b.0);
        }
    }
}

proptest! {
    // Cheap (no oracle): more cases, so that rare shapes (empty pieces, G > Lq) come up.
    #![proptest_config(attnproof_harness::strategies::suite_config("ring_counts", 128))]

    /// The skip count and per-device loads of forward and backward equal an independent count.
    #[test]
    fn skips_and_loads_match_an_independent_count(spec in spec(TILE), cfg in ring_config(), seed in any::<u64>()) {
        let case = make_case::<bf16>(&spec, GAUSSIAN, seed);
        let expected = expected_stats(&spec, cfg);
        let (_, _, fwd) = forward(&case, cfg).map_err(fail)?;
        prop_assert_eq!(&fwd, &expected, "forward {:?}", cfg);
        let (_, bwd) = backward(&case, &make_d_out(&spec, seed), cfg).map_err(fail)?;
        prop_assert_eq!(&bwd, &expected, "backward {:?}", cfg);
    }
}

/// Causal, `Lq = Lk = 64`, 4 devices: contiguous skips the `G(G−1)/2 = 6` blocks above the
/// diagonal; zigzag skips none (every device's late piece sees every block's early piece).
#[test]
fn causal_skip_counts() {
    let spec = dense_causal(64, (1, 1), 16);
    let case = make_case::<bf16>(&spec, GAUSSIAN, 7);
    let (_, _, contiguous) = forward(&case, config(4, RingLayout::Contiguous)).unwrap();
    assert_eq!(contiguous.skipped_blocks, 6);
    let (_, _, zigzag) = forward(&case, config(4, RingLayout::Zigzag)).unwrap();
    assert_eq!(zigzag.skipped_blocks, 0);
    // Non-causal: nothing to skip.
    let full = AttentionSpec { mask: Mask::None, ..spec };
    let (_, _, none) = forward(&make_case::<bf16>(&full, GAUSSIAN, 7), config(4, RingLayout::Contiguous)).unwrap();
    assert_eq!(none.skipped_blocks, 0);
}

/// Causal load per device: zigzag within one row's worth (`n` pairs) of perfect balance, exact
/// when `2G` divides `n`; contiguous off by more than that (≈ `(n/G)²(G−1)`).
#[test]
fn zigzag_balances_causal_work_and_contiguous_does_not() {
    for g in 2..=4 {
        for n in [4 * g, 4 * g + 1, 6 * g - 1, 8 * g, 8 * g + 3, 61] {
            let spec = dense_causal(n, (1, 1), 8);
            let case = make_case::<bf16>(&spec, GAUSSIAN, n as u64);
            let spread = |layout| {
                let (_, _, s) = forward(&case, config(g, layout)).unwrap();
                assert_eq!(s, expected_stats(&spec, config(g, layout)), "G={g} n={n} {layout:?}");
                s.visible_pairs.iter().max().unwrap() - s.visible_pairs.iter().min().unwrap()
            };
            let (zigzag, contiguous) = (spread(RingLayout::Zigzag), spread(RingLayout::Contiguous));
            assert!(zigzag <= n as u64, "G={g} n={n}: zigzag spread {zigzag}");
            if n % (2 * g) == 0 {
                assert_eq!(zigzag, 0, "G={g} n={n}");
            }
            assert!(contiguous > n as u64, "G={g} n={n}: contiguous spread {contiguous}");
        }
    }
}

/// More devices than tokens (empty pieces), `Lq > Lk` causal (fully masked rows: O = 0,
/// LSE = −∞, zero gradients), GQA 6:3 in one run, both layouts, forward and backward.
#[test]
fn empty_pieces_and_fully_masked_rows_verify() {
    for (len_q, len_k) in [(1, 1), (3, 2), (9, 3), (2, 13)] {
        let spec = AttentionSpec {
            layout: Layout::Dense { batch: 2, len_q, len_k },
            n_heads_q: 6,
            n_heads_kv: 3,
            head_dim: 16,
            head_dim_v: 8,
            scale: Scale::InverseSqrtHeadDim,
            mask: Mask::Causal,
        };
        let case = make_case::<f16>(&spec, GAUSSIAN, 11);
        let d_out = make_d_out::<f16>(&spec, 11);
        for layout in [RingLayout::Contiguous, RingLayout::Zigzag] {
            let cfg = config(4, layout);
            let (o, lse, _) = forward(&case, cfg).unwrap();
            let v = verify_forward(&case, reference_ring::<f16>(cfg), o.view(), lse.view()).unwrap();
            assert!(v.passed() && v.valid(), "{len_q}x{len_k} {layout:?}\n{v}");
            if len_q > len_k {
                assert!(lse.iter().any(|x| *x == f32::NEG_INFINITY), "a fully masked row exists");
            }
            let (grads, _) = backward(&case, &d_out, cfg).unwrap();
            let v = verify_backward(&case, &d_out, TILE, reference_ring::<f16>(cfg), grads.candidate()).unwrap();
            assert!(v.passed() && v.valid(), "{len_q}x{len_k} {layout:?}\n{v}");
        }
    }
}

#[test]
fn bad_configurations_are_typed_errors() {
    let spec = dense_causal(8, (2, 1), 8);
    let case = make_case::<bf16>(&spec, GAUSSIAN, 3);
    let zero = RingConfig { n_devices: 0, ..config(2, RingLayout::Zigzag) };
    assert_eq!(
        forward(&case, zero).unwrap_err(),
        ReferenceError::Problem(OracleError::ZeroDimension { argument: "n_devices" })
    );
    let no_tile = RingConfig { tiles: TileConfig { q_tile: 8, kv_tile: 0 }, ..config(2, RingLayout::Zigzag) };
    assert_eq!(forward(&case, no_tile).unwrap_err(), ReferenceError::ZeroTile { argument: "kv_tile" });
    let d_out = make_d_out::<bf16>(&spec, 3);
    assert_eq!(
        backward(&case, &d_out, zero).unwrap_err(),
        ReferenceError::Problem(OracleError::ZeroDimension { argument: "n_devices" })
    );
    // A wrong output shape names the output.
    let mut o = ArrayD::from_elem(vec![1, 2, 8, 7], bf16::from_f32(0.0));
    let mut lse = ArrayD::from_elem(spec.expected_shape(Operand::RowStat), 0f32);
    let err = ring_forward(
        &spec,
        &case.inputs(),
        config(2, RingLayout::Contiguous),
        ForwardOutputs { o: o.view_mut(), lse: lse.view_mut() },
    )
    .unwrap_err();
    assert!(matches!(err, ReferenceError::Problem(OracleError::ShapeMismatch { argument: "o", .. })), "{err}");
}

/// A travelling block that records who worked on it: its owner and, in order, the `(device,
/// part)` pairs that attended it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stamp {
    owner: usize,
    attended_by: Vec<(usize, usize)>,
}

/// How a [`Recorder`]'s blocks travel.
trait Pass {
    const TRAVEL: Travel;
}

/// Read-only blocks (the forward pass).
struct ReadOnly;

impl Pass for ReadOnly {
    const TRAVEL: Travel = Travel::ReadOnly;
}

/// Blocks carrying accumulators (the backward pass).
struct Accumulating;

impl Pass for Accumulating {
    const TRAVEL: Travel = Travel::Accumulating;
}

/// A worker with no numbers: two parts, part 0 seeing every block, part 1 only blocks whose
/// owner is not after this device (a causal skip); it records every `(part, owner)` it attends.
struct Recorder<P> {
    device: usize,
    attended: Vec<(usize, usize)>,
    pass: PhantomData<fn() -> P>,
}

impl<P: Pass> RingWorker for Recorder<P> {
    type Block = Stamp;
    type Error = RingFault;
    const TRAVEL: Travel = P::TRAVEL;

    fn owner(&self, block: &Stamp) -> usize {
        block.owner
    }

    fn parts(&self) -> usize {
        2
    }

    fn sees(&self, part: usize, block: &Stamp) -> bool {
        part == 0 || block.owner <= self.device
    }

    fn attend(&mut self, part: usize, block: &mut Stamp) -> Result<(), RingFault> {
        self.attended.push((part, block.owner));
        if P::TRAVEL == Travel::Accumulating {
            block.attended_by.push((self.device, part));
        }
        Ok(())
    }
}

/// Runs a ring of `Recorder`s on the CPU-threads backend.
fn record<P: Pass>(n_devices: usize) -> Vec<(Recorder<P>, DeviceRun<Stamp>)> {
    run_on_threads(n_devices, |device| {
        let worker = Recorder { device, attended: Vec::new(), pass: PhantomData };
        (worker, Stamp { owner: device, attended_by: Vec::new() })
    })
    .unwrap_or_else(|e| panic!("G={n_devices}: {e}"))
}

/// The `(part, owner)` pairs device `g` must attend, in order: at step `t` the block of
/// `(g − t) mod G` (E11, written out here rather than taken from the oracle), each block once,
/// part 1 skipping the blocks of later devices.
fn expected_visits(g: usize, n_devices: usize) -> Vec<(usize, usize)> {
    (0..n_devices)
        .map(|t| (g + n_devices - t) % n_devices)
        .flat_map(|b| std::iter::once((0, b)).chain((b <= g).then_some((1, b))))
        .collect()
}

/// The driver over the CPU-threads backend, read-only blocks: each device attends every block
/// exactly once, in E11 order, skips what its parts cannot see, and ends holding its
/// successor's block after `G − 1` hops.
#[test]
fn driver_visits_every_block_once_in_ring_order() {
    for n_devices in 1..=5 {
        let runs = record::<ReadOnly>(n_devices);
        assert_eq!(runs.len(), n_devices);
        for (g, (worker, run)) in runs.iter().enumerate() {
            assert_eq!(worker.device, g);
            assert_eq!(worker.attended, expected_visits(g, n_devices), "G={n_devices} device {g}");
            assert_eq!(run.skipped_parts, n_devices - 1 - g, "G={n_devices} device {g}");
            assert_eq!(run.held, Stamp { owner: (g + 1) % n_devices, attended_by: Vec::new() }, "G={n_devices}");
        }
    }
}

/// The driver over the CPU-threads backend, accumulating blocks: every block is attended by
/// every device once, in ring order from its owner on (so no device worked on a stale copy),
/// and comes home to its owner after `G` hops.
#[test]
fn driver_brings_accumulators_home_after_every_device_added() {
    for n_devices in 1..=5 {
        for (g, (worker, run)) in record::<Accumulating>(n_devices).iter().enumerate() {
            assert_eq!(worker.attended, expected_visits(g, n_devices), "G={n_devices} device {g}");
            assert_eq!(run.held.owner, g, "G={n_devices}: block {g} is home");
            // Block g is at device g + t at step t; part 1 of device d sees it when g <= d.
            let expected: Vec<(usize, usize)> = (0..n_devices)
                .map(|t| (g + t) % n_devices)
                .flat_map(|d| std::iter::once((d, 0)).chain((g <= d).then_some((d, 1))))
                .collect();
            assert_eq!(run.held.attended_by, expected, "G={n_devices} block {g}");
        }
    }
}

/// The ring recipe's `extra_merges` is the most KV tiles a row can visit beyond `⌈Lk/kv_tile⌉`: each device tiles its
/// own pieces of the keys (`P = G` contiguous, `2G` zigzag), a piece can end in a partial tile, so a row visits at most
/// `⌈Lk/kv_tile⌉ + P − 1` tiles, and exactly that many when every piece is one key longer than a tile.
#[test]
fn the_ring_recipe_merges_at_most_one_extra_tile_per_piece_boundary() {
    for layout in [RingLayout::Contiguous, RingLayout::Zigzag] {
        for n_devices in 1..=4 {
            for kv_tile in [1usize, 4, 8] {
                let config = RingConfig { n_devices, layout, tiles: TileConfig { q_tile: 4, kv_tile } };
                let pieces = if layout == RingLayout::Zigzag { 2 * n_devices } else { n_devices };
                assert_eq!(config.pieces(), pieces, "{config:?}");
                let tiles_visited = |len_k: usize| -> usize {
                    (0..n_devices)
                        .flat_map(|device| config.positions(device, len_k))
                        .map(|piece| piece.len().div_ceil(kv_tile))
                        .sum()
                };
                for len_k in 0..=3 * pieces * kv_tile {
                    let most = len_k.div_ceil(kv_tile) + config.extra_merges();
                    assert!(tiles_visited(len_k) <= most, "{config:?}, Lk = {len_k}");
                }
                if kv_tile >= pieces {
                    let len_k = pieces * (kv_tile + 1);
                    let most = len_k.div_ceil(kv_tile) + config.extra_merges();
                    assert_eq!(tiles_visited(len_k), most, "{config:?}: the bound is reached");
                }
            }
        }
    }
}

/// A worker whose device `failing` refuses its first block; every other device records, as `Recorder` does.
struct FailsOn {
    device: usize,
    failing: usize,
}

/// The fault `FailsOn` reports (a distinctive one, so that the test can tell it from a neighbour's leaving).
fn planted_fault(device: usize) -> RingFault {
    RingFault::Misrouted { device, step: 99, expected: 0, received: 0 }
}

impl RingWorker for FailsOn {
    type Block = Stamp;
    type Error = RingFault;
    const TRAVEL: Travel = Travel::ReadOnly;

    fn owner(&self, block: &Stamp) -> usize {
        block.owner
    }

    fn parts(&self) -> usize {
        1
    }

    fn sees(&self, _part: usize, _block: &Stamp) -> bool {
        true
    }

    fn attend(&mut self, _part: usize, _block: &mut Stamp) -> Result<(), RingFault> {
        if self.device == self.failing { Err(planted_fault(self.device)) } else { Ok(()) }
    }
}

/// When one device fails, its neighbours see it leave the ring and fail too; the CPU-threads backend reports the
/// cause, the failing device's own error, not a neighbour's disconnection, whichever device fails.
#[test]
fn a_failing_device_is_reported_as_the_cause_not_its_neighbours() {
    for n_devices in 1..=4 {
        for failing in 0..n_devices {
            let runs = run_on_threads(n_devices, |device| {
                (FailsOn { device, failing }, Stamp { owner: device, attended_by: Vec::new() })
            });
            match runs {
                Err(fault) => assert_eq!(fault, planted_fault(failing), "G={n_devices}, device {failing} failing"),
                Ok(_) => panic!("G={n_devices}: device {failing} failed, but the ring reported success"),
            }
        }
    }
}
