//! Verifying one NSA layer on the GPU (`attnproof_gpu::nsa::layer`) stage by stage against the oracle, forward
//! ([`verify_layer_forward`]) and backward with the selection held fixed ([`verify_layer_backward`]).
//!
//! # Why stage by stage
//!
//! The selection is integer and discontinuous: a rounding error in a block score, however small, may swap two blocks
//! at the top-`n` boundary, and the selected branch then attends to other keys. No bound from the layer's original
//! inputs to its output exists. So each stage is held to the oracle on the inputs that stage actually had (the
//! previous stages' GPU outputs), under the bound derived for that stage's recipe and those inputs: the compression
//! on the layer's K and V; the compressed attention on the GPU's `k̃`, `ṽ`; the selection on the GPU's `LSE_cmp` and
//! `k̃` (its scores within their bound, its lists exactly the oracle's on its own scores); the selected attention on
//! the GPU's lists; the window attention on the layer's inputs; the gates on the GPU's three branch outputs. Every
//! stage's error is checked where it is made, so errors cannot compound unchecked, and a stage wired wrong (a branch
//! in another's place, a list off by a block, a gate on the wrong branch) fails at that stage. The backward likewise:
//! the gates' gradients on the forward's branch outputs, each attention backward on the `dO_b` the gates gave it, the
//! pooling's transpose on the compressed attention's `dk̃`, `dṽ`, and the final sums against the f64 sum of the
//! GPU's own branch gradients within `attnproof_proofs::nsa_bound::branch_sum_bound`.
//!
//! [`layer_draws`] draws the layers (short windows and blocks, lengths around them, GQA groups up to 16, E31's head
//! dims and small ones, dense and varlen with empty sequences, gate logits up to ±100), [`layer_case`] makes their
//! inputs, and [`layer_forward_guarded`], [`layer_backward_guarded`] launch the layer with NaN-poisoned, guarded
//! outputs.

use std::fmt;
use std::sync::Arc;

use attnproof_gpu::nsa::compressed::compressed_spec;
use attnproof_gpu::nsa::layer::{
    BranchGradients, BranchGradientsDevice, NsaLayerBackward, NsaLayerBackwardDevice, NsaLayerBackwardInputs,
    NsaLayerForward, NsaLayerForwardDevice, NsaLayerInputs, NsaLayerKernels, NsaLayerShapes, nsa_layer_backward_device,
    nsa_layer_forward_device,
};
use attnproof_gpu::nsa::select::Selection;
use attnproof_gpu::nsa::selected::selected_spec;
use attnproof_gpu::nsa::window::window_spec;
use attnproof_gpu::{BackwardTiling, GpuBackwardStrategy};
use attnproof_oracle::nsa::NsaConfig;
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Layout};
use attnproof_proofs::nsa_bound::{StorageRounding, branch_sum_bound};
use attnproof_reference::Element;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use ndarray::{ArrayD, IxDyn};
use proptest::prelude::*;

use crate::backward::{BackwardCandidate, BackwardExpectation};
use crate::candidate::{GUARD_BITS_16, GUARD_BITS_32, LaunchError, Storage, poisoned, unchanged, unguard, upload};
use crate::flash::{Case, HarnessError, verify_forward};
use crate::generate::ValueProfile;
use crate::nsa::{
    Compressed, CompressionVerdict, GateDraw, GateVerdict, LogitRange, MapDraw, MapGradients, TokenGradients,
    WeightKind, causal_layer, map_of, self_attention_layout, verify_compression, verify_compression_backward,
    verify_gate_backward, verify_gate_combine, verify_map_gradients,
};
use crate::nsa_select::{SelectionVerdict, verify_selection};
use crate::nsa_selected::{verify_selected, verify_selected_backward};
use crate::recipes::subnormal_of;
use crate::verdict::Verdict;

/// Failing elements described in a sum verdict, at most.
const REPORTED: usize = 8;

/// The forward's verdict, one entry per stage (module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerVerdict {
    /// `k̃`, `ṽ` from the layer's K and V: within `compression_bound` and the recipe's bits.
    pub compression: CompressionVerdict,
    /// `o_cmp`, `LSE_cmp`: the dense forward's verdict under the compressed spec on the GPU's `k̃`, `ṽ`.
    pub compressed: Verdict,
    /// The scores within `block_score_bound` on the GPU's `LSE_cmp` and `k̃`; the lists the oracle's on those scores.
    pub selection: SelectionVerdict,
    /// `o_slc`, `LSE_slc` on the GPU's lists: one verdict per (sequence, KV head).
    pub selected: Vec<Verdict>,
    /// `o_win`, `LSE_win`: the dense forward's verdict under the window spec.
    pub window: Verdict,
    /// `O` from the GPU's three branch outputs.
    pub gates: GateVerdict,
}

impl LayerVerdict {
    /// Every stage within its bound (and the lists exact).
    pub fn passed(&self) -> bool {
        self.failed_stages().is_empty()
    }

    /// The stages that failed, in the layer's order.
    pub fn failed_stages(&self) -> Vec<&'static str> {
        [
            ("compression", self.compression.passed()),
            ("compressed attention", self.compressed.passed()),
            ("selection", self.selection.passed()),
            ("selected attention", self.selected.iter().all(Verdict::passed)),
            ("window attention", self.window.passed()),
            ("gates", self.gates.passed()),
        ]
        .into_iter()
        .filter_map(|(name, passed)| (!passed).then_some(name))
        .collect()
    }

    /// Every dense verdict's discriminability gate is valid (its canned wrong answers all fail).
    pub fn valid(&self) -> bool {
        self.compressed.valid() && self.window.valid() && self.selected.iter().all(Verdict::valid)
    }
}

impl fmt::Display for LayerVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = |passed: bool| if passed { "ok" } else { "FAILED" };
        let c = &self.compression;
        writeln!(f, "compression {} (worst {:.3e}): {:?}", status(c.passed()), c.worst_ratio, c.failures)?;
        writeln!(f, "compressed attention {}:\n{}", status(self.compressed.passed()), self.compressed)?;
        let s = &self.selection;
        writeln!(f, "selection {} (worst {:.3e}): {:?}", status(s.passed()), s.worst_ratio, s.failures)?;
        for (i, v) in self.selected.iter().enumerate() {
            writeln!(f, "selected attention {i} {}:\n{v}", status(v.passed()))?;
        }
        writeln!(f, "window attention {}:\n{}", status(self.window.passed()), self.window)?;
        let g = &self.gates;
        write!(f, "gates {} (worst {:.3e}): {:?}", status(g.passed()), g.worst_ratio, g.failures)
    }
}

/// The sums of the branch gradients against the f64 sum of the GPU's own branch gradients.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SumVerdict {
    /// Elements compared (dQ, dK and dV).
    pub elements: usize,
    /// The largest `|sum − reference| / bound` over the finite ones.
    pub worst_ratio: f64,
    /// The first failing elements.
    pub failures: Vec<String>,
}

impl SumVerdict {
    /// Every element within its bound.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// The backward's verdict, one entry per stage (module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerBackwardVerdict {
    /// Each branch's `dO_b` and the logits' gradients from the forward's branch outputs.
    pub gates: GateVerdict,
    /// The compressed attention's dQ, `dk̃`, `dṽ`, `D` on the GPU's `dO_cmp` (dense backward verdict).
    pub compressed: Verdict,
    /// The pooling's transpose of the GPU's `dk̃`, `dṽ`.
    pub pooling: CompressionVerdict,
    /// The learned compression matrices' gradients from the GPU's `dk̃`, `dṽ` (no element for maps without
    /// parameters).
    pub maps: CompressionVerdict,
    /// The selected branch's gradients on the GPU's `dO_slc` and the forward's lists, per (sequence, KV head).
    pub selected: Vec<Verdict>,
    /// The window branch's gradients on the GPU's `dO_win` (dense backward verdict).
    pub window: Verdict,
    /// dQ, dK, dV: the sums of the branches' gradients.
    pub sums: SumVerdict,
}

impl LayerBackwardVerdict {
    /// Every stage within its bound.
    pub fn passed(&self) -> bool {
        self.failed_stages().is_empty()
    }

    /// The stages that failed, in the backward's order.
    pub fn failed_stages(&self) -> Vec<&'static str> {
        [
            ("gates", self.gates.passed()),
            ("compressed attention", self.compressed.passed()),
            ("pooling transpose", self.pooling.passed()),
            ("compression matrices", self.maps.passed()),
            ("selected attention", self.selected.iter().all(Verdict::passed)),
            ("window attention", self.window.passed()),
            ("branch sums", self.sums.passed()),
        ]
        .into_iter()
        .filter_map(|(name, passed)| (!passed).then_some(name))
        .collect()
    }

    /// Every dense verdict's discriminability gate is valid.
    pub fn valid(&self) -> bool {
        self.compressed.valid() && self.window.valid() && self.selected.iter().all(Verdict::valid)
    }
}

impl fmt::Display for LayerBackwardVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = |passed: bool| if passed { "ok" } else { "FAILED" };
        let g = &self.gates;
        writeln!(f, "gates {} (worst {:.3e}): {:?}", status(g.passed()), g.worst_ratio, g.failures)?;
        writeln!(f, "compressed attention {}:\n{}", status(self.compressed.passed()), self.compressed)?;
        let p = &self.pooling;
        writeln!(f, "pooling transpose {} (worst {:.3e}): {:?}", status(p.passed()), p.worst_ratio, p.failures)?;
        let m = &self.maps;
        writeln!(f, "compression matrices {} (worst {:.3e}): {:?}", status(m.passed()), m.worst_ratio, m.failures)?;
        for (i, v) in self.selected.iter().enumerate() {
            writeln!(f, "selected attention {i} {}:\n{v}", status(v.passed()))?;
        }
        writeln!(f, "window attention {}:\n{}", status(self.window.passed()), self.window)?;
        let s = &self.sums;
        write!(f, "branch sums {} (worst {:.3e}): {:?}", status(s.passed()), s.worst_ratio, s.failures)
    }
}

fn storage_of<T: Storage>() -> StorageRounding {
    StorageRounding { unit_roundoff: T::UNIT_ROUNDOFF, subnormal: f64::from(subnormal_of::<T>()) }
}

/// The selected-branch verifiers' errors as the layer's.
fn sparse(e: crate::sparse::SparseHarnessError) -> HarnessError {
    match e {
        crate::sparse::SparseHarnessError::Harness(e) => e,
    }
}

/// A case of the same queries and heads over other keys and values (a branch's problem).
fn branch_case<T: Clone>(case: &Case<T>, spec: AttentionSpec, k: &ArrayD<T>, v: &ArrayD<T>) -> Case<T> {
    Case { spec, q: case.q.clone(), k: k.clone(), v: v.clone() }
}

/// Verifies a layer's forward `candidate` on `case` (the layer's spec, Q, K, V) under `config` with the gate logits
/// `gate_logits`, stage by stage (module docs).
pub fn verify_layer_forward<T: Storage>(
    case: &Case<T>,
    config: &NsaConfig,
    gate_logits: &ArrayD<T>,
    candidate: &NsaLayerForward<T>,
) -> Result<LayerVerdict, HarnessError> {
    let layer = &case.spec;
    let compressed_kv = Compressed { k: candidate.k_cmp.clone(), v: candidate.v_cmp.clone() };
    let compression = verify_compression(case, config, &compressed_kv)?;
    let cmp_case = branch_case(case, compressed_spec(layer, config)?, &candidate.k_cmp, &candidate.v_cmp);
    let recipe = crate::recipes::gpu_forward::<T>();
    let compressed = verify_forward(&cmp_case, recipe, candidate.o_cmp.view(), candidate.lse_cmp.view())?;
    let selection_out = Selection { scores: candidate.scores.clone(), lists: candidate.lists.clone() };
    let (q, k_cmp, lse_cmp) = (case.q.view(), candidate.k_cmp.view(), candidate.lse_cmp.view());
    let selection = verify_selection(layer, config, q, k_cmp, lse_cmp, &selection_out)?;
    let slc_case = branch_case(case, selected_spec(layer, config)?, &case.k, &case.v);
    let selected =
        verify_selected(&slc_case, config, &candidate.lists, candidate.o_slc.view(), candidate.lse_slc.view())
            .map_err(sparse)?;
    let win_case = branch_case(case, window_spec(layer, config)?, &case.k, &case.v);
    let window = verify_forward(&win_case, recipe, candidate.o_win.view(), candidate.lse_win.view())?;
    let draw = gate_draw(layer, candidate, gate_logits, None);
    let gates = verify_gate_combine(&draw, &candidate.o)?;
    Ok(LayerVerdict { compression, compressed, selection, selected, window, gates })
}

/// The gates' problem of a layer: its spec, the forward's three branch outputs, the logits and `dO` (zeros when the
/// forward alone is judged: the gated sum does not read it).
fn gate_draw<T: Storage>(
    layer: &AttentionSpec,
    forward: &NsaLayerForward<T>,
    gate_logits: &ArrayD<T>,
    d_out: Option<&ArrayD<T>>,
) -> GateDraw<T> {
    let zeros = || ArrayD::from_elem(IxDyn(&layer.expected_shape(Operand::O)), <T as Element>::from_f32(0.0));
    GateDraw {
        spec: layer.clone(),
        branches: [forward.o_cmp.clone(), forward.o_slc.clone(), forward.o_win.clone()],
        gate_logits: gate_logits.clone(),
        d_out: d_out.cloned().unwrap_or_else(zeros),
    }
}

fn backward_candidate<T>(g: &BranchGradients<T>) -> BackwardCandidate<'_, T> {
    BackwardCandidate { dq: g.dq.view(), dk: g.dk.view(), dv: g.dv.view(), delta: g.delta.view() }
}

/// Verifies a layer's backward `candidate` on `case` under `config` with the gate logits `gate_logits`, upstream
/// gradient `d_out` and the layer's forward `forward` (whose outputs and lists the backward read), stage by stage
/// (module docs). The dense backwards are judged under the backward kernels' recipe in the default tiling, which the
/// `wgmma` backward shares.
pub fn verify_layer_backward<T: Storage>(
    case: &Case<T>,
    config: &NsaConfig,
    (gate_logits, d_out): (&ArrayD<T>, &ArrayD<T>),
    forward: &NsaLayerForward<T>,
    candidate: &NsaLayerBackward<T>,
) -> Result<LayerBackwardVerdict, HarnessError> {
    let layer = &case.spec;
    let draw = gate_draw(layer, forward, gate_logits, Some(d_out));
    let d_branches = [candidate.d_o_cmp.clone(), candidate.d_o_slc.clone(), candidate.d_o_win.clone()];
    let gates = verify_gate_backward(&draw, &d_branches, &candidate.d_gate_logits)?;
    let recipe = crate::recipes::gpu_backward::<T>(BackwardTiling::DEFAULT);
    let cmp_case = branch_case(case, compressed_spec(layer, config)?, &forward.k_cmp, &forward.v_cmp);
    let compressed = BackwardExpectation::new(&cmp_case, &candidate.d_o_cmp, recipe.q_tile, recipe.recipe)?
        .verify(backward_candidate(&candidate.compressed))?;
    let upstream = Compressed { k: candidate.compressed.dk.clone(), v: candidate.compressed.dv.clone() };
    let tokens = TokenGradients { dk: candidate.dk_pool.clone(), dv: candidate.dv_pool.clone() };
    let pooling = verify_compression_backward(case, config, &upstream, &tokens)?;
    let [keys, values] = candidate.d_maps.clone();
    let maps = verify_map_gradients(case, config, &upstream, &MapGradients { keys, values })?;
    let slc_case = branch_case(case, selected_spec(layer, config)?, &case.k, &case.v);
    let selected = verify_selected_backward(
        &slc_case,
        config,
        &forward.lists,
        &candidate.d_o_slc,
        backward_candidate(&candidate.selected),
    )
    .map_err(sparse)?;
    let win_case = branch_case(case, window_spec(layer, config)?, &case.k, &case.v);
    let window = BackwardExpectation::new(&win_case, &candidate.d_o_win, recipe.q_tile, recipe.recipe)?
        .verify(backward_candidate(&candidate.window))?;
    let sums = verify_branch_sums(candidate)?;
    Ok(LayerBackwardVerdict { gates, compressed, pooling, maps, selected, window, sums })
}

/// dQ, dK and dV of `candidate` against the f64 sums of its own branch gradients (compressed, selected, window; for dK
/// and dV the compressed branch's is the pooling transpose's), element by element within `branch_sum_bound`. An
/// infinite sum passes only where the exact sum, less its bound, still rounds to that infinity in the storage type.
pub fn verify_branch_sums<T: Storage>(candidate: &NsaLayerBackward<T>) -> Result<SumVerdict, HarnessError> {
    let c = candidate;
    let mut verdict = SumVerdict::default();
    let storage = storage_of::<T>();
    for (name, terms, sum) in [
        ("dq", [&c.compressed.dq, &c.selected.dq, &c.window.dq], &c.dq),
        ("dk", [&c.dk_pool, &c.selected.dk, &c.window.dk], &c.dk),
        ("dv", [&c.dv_pool, &c.selected.dv, &c.window.dv], &c.dv),
    ] {
        for t in terms {
            if t.shape() != sum.shape() {
                return Err(HarnessError::CandidateShape {
                    argument: name,
                    expected: sum.shape().to_vec(),
                    actual: t.shape().to_vec(),
                });
            }
        }
        let wide = |x: T| f64::from(x.to_f32());
        for (i, (((&a, &b), &w), &got)) in terms[0].iter().zip(terms[1]).zip(terms[2]).zip(sum.iter()).enumerate() {
            verdict.elements += 1;
            let (a, b, w) = (wide(a), wide(b), wide(w));
            let reference = (a + b) + w;
            let bound = branch_sum_bound(reference, a.abs() + b.abs() + w.abs(), storage);
            let value = wide(got);
            let within = if value.is_infinite() {
                let least = (reference.abs() - bound).max(0.0).copysign(reference);
                <T as Element>::from_f32(least as f32).to_f32() == got.to_f32()
            } else {
                let ratio = (value - reference).abs() / bound;
                if ratio.is_finite() {
                    verdict.worst_ratio = verdict.worst_ratio.max(ratio);
                }
                ratio <= 1.0
            };
            if !within && verdict.failures.len() < REPORTED {
                verdict.failures.push(format!(
                    "{name}[{i}]: {value:e} against {reference:e} = {a:e} + {b:e} + {w:e} (bound {bound:e})"
                ));
            }
        }
    }
    Ok(verdict)
}

/// A drawn NSA layer: the spec (causal self-attention), NSA's configuration, how Q, K, V are made, the gate logits'
/// range and the seed.
#[derive(Clone, Debug)]
pub struct LayerDraw {
    /// The layer.
    pub layer: AttentionSpec,
    /// Windows, blocks, lists, forced blocks and the sliding window (the means for both maps, the default scale).
    pub config: NsaConfig,
    /// How Q, K and V are made.
    pub profile: ValueProfile,
    /// How the gate logits are made.
    pub logits: LogitRange,
    /// The inputs' seed.
    pub seed: u64,
}

/// Layers small enough for the oracle at every stage: compression windows of 5, 8, 16 and 32 tokens with strides
/// that overlap, abut and leave gaps; selection blocks of 16, 32 and 64 tokens; lists of 2 to 6 with 0–1 forced
/// initial and 0–2 forced local blocks; sliding windows of 16, 32 and 64; lengths of no token, around a compression
/// window (`l − 1`, `l`, `l + s`), around a block (`l' ± 1`, `2l' + 1`, `3l' − 1`) and 300; dense (batch 1–2) or
/// varlen with empty sequences ([`self_attention_layout`]); GQA heads of [`crate::strategies::heads`] and groups
/// 1–16 drawn uniformly (one or two KV heads); head dims 64, 128 and 192 with `dv = 128` (E31's) and small ones (16,
/// 32, `dv` 8 or 16); Gaussian values mostly, every profile now and then; gate logits of every [`LogitRange`] (zero,
/// unit, ±15, up to ±100).
pub fn layer_draws() -> impl Strategy<Value = LayerDraw> {
    let windows = prop::sample::select(vec![(8usize, 4usize), (16, 8), (16, 16), (5, 3), (32, 16)]);
    let blocks = prop::sample::select(vec![16usize, 32, 64]);
    let lists = (0usize..=1, 0usize..=2).prop_flat_map(|(fi, fl)| ((fi + fl).max(2)..=6, Just(fi), Just(fl)));
    let sliding = prop::sample::select(vec![16usize, 32, 64]);
    let dims = prop_oneof![
        3 => prop::sample::select(vec![(64usize, 64usize), (128, 128), (192, 128)]),
        2 => prop::sample::select(vec![(16usize, 16usize), (32, 32), (16, 8), (32, 16)]),
    ];
    (windows, blocks, lists, sliding, dims)
        .prop_flat_map(|((l, s), block, lists, sliding, dims)| {
            let length =
                prop::sample::select(vec![0, l - 1, l, l + s, block - 1, block + 1, 2 * block + 1, 3 * block - 1, 300]);
            let profile = prop_oneof![3 => Just(ValueProfile::GAUSSIAN), 1 => crate::strategies::profile()];
            let logits =
                prop::sample::select(vec![LogitRange::Unit, LogitRange::Wide, LogitRange::Extreme, LogitRange::Zero]);
            (
                Just(((l, s), block, lists, sliding, dims)),
                self_attention_layout(length),
                // The harness's heads (small groups often) and every group size equally often, as the other NSA
                // draws take them: NSA's own group is 16, and the kernels must take every other.
                prop_oneof![
                    1 => crate::strategies::heads(),
                    2 => (1usize..=16, 1usize..=2).prop_map(|(group, n_heads_kv)| (group * n_heads_kv, n_heads_kv)),
                ],
                profile,
                logits,
                // The compression maps (K, V): the mean mostly, a learned matrix or position weights otherwise.
                (layer_map(), layer_map()),
                any::<u64>(),
            )
        })
        .prop_map(|(((l, s), block, (n, fi, fl), sliding, dims), layout, heads, profile, logits, maps, seed)| {
            let config = NsaConfig {
                compress_len: l,
                compress_stride: s,
                compress_keys: map_of(maps.0, l, dims.0, seed ^ 0x6b),
                compress_values: map_of(maps.1, l, dims.1, seed ^ 0x76),
                select_block: block,
                n_selected: n,
                n_forced_initial: fi,
                n_forced_local: fl,
                window: sliding,
                ..NsaConfig::default()
            };
            LayerDraw { layer: causal_layer(layout, heads, dims), config, profile, logits, seed }
        })
}

/// A layer draw's compression map: the mean two times in four, a learned matrix (of Gaussian or mixed-sign
/// weights) or position weights otherwise.
fn layer_map() -> impl Strategy<Value = MapDraw> {
    prop_oneof![
        2 => Just(MapDraw::Mean),
        1 => prop::sample::select(vec![WeightKind::Gaussian, WeightKind::Mixed]).prop_map(MapDraw::Matrix),
        1 => Just(MapDraw::Weights(WeightKind::Gaussian)),
    ]
}

/// The gate logits of `spec` (O's shape with 3 columns) from `seed`, in `range`.
pub fn gate_logits<T: Storage>(spec: &AttentionSpec, range: LogitRange, seed: u64) -> ArrayD<T> {
    let shape = attnproof_gpu::nsa::gates::gate_logits_shape(spec);
    let n = shape.iter().product();
    let normal = crate::generate::draw(seed ^ 0x6761_7465, n, crate::generate::Distribution::Gaussian);
    let logit = |v: f64| match range {
        LogitRange::Unit => v,
        LogitRange::Wide => 15.0 * v,
        LogitRange::Extreme => (60.0 * v).clamp(-100.0, 100.0),
        LogitRange::Zero => 0.0,
    };
    let values = normal.into_iter().map(|v| <T as Element>::from_f32(logit(v) as f32)).collect();
    ArrayD::from_shape_vec(IxDyn(&shape), values).expect("sizes agree")
}

/// The layer's case (Q, K, V from the draw's profile) and gate logits for `draw` from `seed`.
pub fn layer_case<T: Storage>(draw: &LayerDraw, seed: u64) -> (Case<T>, ArrayD<T>) {
    let case = crate::generate::make_case::<T>(&draw.layer, draw.profile, seed);
    let logits = gate_logits::<T>(&draw.layer, draw.logits, seed);
    (case, logits)
}

/// A list entry no kernel writes (neither a block nor `−1`), and the lists' guard value.
const LIST_POISON: i32 = -0x5a5a_5a5b;
const LIST_GUARD: i32 = 0x7fa5_a5a5;

/// A downloaded buffer (synchronize the stream before reading it).
fn back<X: DeviceRepr + Clone>(stream: &Arc<CudaStream>, buffer: &CudaSlice<X>) -> Result<Vec<X>, LaunchError> {
    stream.clone_dtoh(buffer).map_err(|e| LaunchError::Driver(e.to_string()))
}

/// A storage-type output buffer of `shape`: NaNs, then the guard band.
fn poisoned_t<T: Storage>(stream: &Arc<CudaStream>, shape: &[usize]) -> Result<CudaSlice<T>, LaunchError> {
    let n = shape.iter().product();
    poisoned(stream, n, <T as Element>::from_f32(f32::NAN), T::from_bits16(GUARD_BITS_16))
}

/// An f32 output buffer of `shape`: NaNs, then the guard band.
fn poisoned_f32(stream: &Arc<CudaStream>, shape: &[usize]) -> Result<CudaSlice<f32>, LaunchError> {
    poisoned(stream, shape.iter().product(), f32::NAN, f32::from_bits(GUARD_BITS_32))
}

/// A storage-type output's first elements, its guard band checked.
fn guarded_t<T: Storage>(name: &'static str, data: Vec<T>, shape: &[usize]) -> Result<ArrayD<T>, LaunchError> {
    unguard(name, data, shape.iter().product(), shape, |x: T| x.bits() == GUARD_BITS_16)
}

/// An f32 output's first elements, its guard band checked.
fn guarded_f32(name: &'static str, data: Vec<f32>, shape: &[usize]) -> Result<ArrayD<f32>, LaunchError> {
    unguard(name, data, shape.iter().product(), shape, |x: f32| x.to_bits() == GUARD_BITS_32)
}

/// The layer's forward of `kernels` on `case` under `config` with `gate_logits`, through
/// `nsa_layer_forward_device` into NaN-poisoned intermediates followed by guard bands; checks every guard and that
/// the inputs are unchanged on the device.
pub fn layer_forward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    config: &NsaConfig,
    kernels: &NsaLayerKernels,
    gate_logits: &ArrayD<T>,
) -> Result<NsaLayerForward<T>, LaunchError> {
    let spec = &case.spec;
    let s = NsaLayerShapes::new(spec, config)?;
    let (q, k, v, x) =
        (upload(stream, &case.q)?, upload(stream, &case.k)?, upload(stream, &case.v)?, upload(stream, gate_logits)?);
    let mut out = NsaLayerForwardDevice {
        k_cmp: poisoned_t(stream, &s.k_cmp)?,
        v_cmp: poisoned_t(stream, &s.v_cmp)?,
        o_cmp: poisoned_t(stream, &s.o)?,
        lse_cmp: poisoned_f32(stream, &s.row_stat)?,
        scores: poisoned_f32(stream, &s.scores)?,
        lists: poisoned(stream, s.lists.iter().product(), LIST_POISON, LIST_GUARD)?,
        o_slc: poisoned_t(stream, &s.o)?,
        lse_slc: poisoned_f32(stream, &s.row_stat)?,
        o_win: poisoned_t(stream, &s.o)?,
        lse_win: poisoned_f32(stream, &s.row_stat)?,
        o: poisoned_t(stream, &s.o)?,
    };
    let inputs = NsaLayerInputs { q: &q, k: &k, v: &v, gate_logits: &x };
    nsa_layer_forward_device(stream, spec, config, kernels, inputs, &mut out)?;
    let f = &out;
    let t = [&f.k_cmp, &f.v_cmp, &f.o_cmp, &f.o_slc, &f.o_win, &f.o].map(|b| back(stream, b));
    let r = [&f.lse_cmp, &f.scores, &f.lse_slc, &f.lse_win].map(|b| back(stream, b));
    let lists = back(stream, &f.lists)?;
    let inputs_back = [back(stream, &q)?, back(stream, &k)?, back(stream, &v)?, back(stream, &x)?];
    stream.synchronize().map_err(|e| LaunchError::Driver(e.to_string()))?;
    unchanged(&[("q", &case.q), ("k", &case.k), ("v", &case.v), ("gate_logits", gate_logits)], &inputs_back)?;
    let [k_cmp, v_cmp, o_cmp, o_slc, o_win, o] = t;
    let [lse_cmp, scores, lse_slc, lse_win] = r;
    let rank3 = |a: ArrayD<_>| a.into_dimensionality::<ndarray::Ix3>().expect("rank 3");
    Ok(NsaLayerForward {
        k_cmp: guarded_t("k_cmp", k_cmp?, &s.k_cmp)?,
        v_cmp: guarded_t("v_cmp", v_cmp?, &s.v_cmp)?,
        o_cmp: guarded_t("o_cmp", o_cmp?, &s.o)?,
        lse_cmp: guarded_f32("lse_cmp", lse_cmp?, &s.row_stat)?,
        scores: rank3(guarded_f32("scores", scores?, &s.scores)?),
        lists: unguard("lists", lists, s.lists.iter().product(), &s.lists, |x: i32| x == LIST_GUARD)?
            .into_dimensionality::<ndarray::Ix3>()
            .expect("rank 3"),
        o_slc: guarded_t("o_slc", o_slc?, &s.o)?,
        lse_slc: guarded_f32("lse_slc", lse_slc?, &s.row_stat)?,
        o_win: guarded_t("o_win", o_win?, &s.o)?,
        lse_win: guarded_f32("lse_win", lse_win?, &s.row_stat)?,
        o: guarded_t("o", o?, &s.o)?,
    })
}

/// One branch's poisoned gradient buffers: dQ of `q`, dK of `k`, dV of `v`, `D` of `row_stat` elements.
fn poisoned_branch<T: Storage>(
    stream: &Arc<CudaStream>,
    [q, k, v, row_stat]: [&[usize]; 4],
) -> Result<BranchGradientsDevice<T>, LaunchError> {
    Ok(BranchGradientsDevice {
        dq: poisoned_t(stream, q)?,
        dk: poisoned_t(stream, k)?,
        dv: poisoned_t(stream, v)?,
        delta: poisoned_f32(stream, row_stat)?,
    })
}

/// One branch's gradients downloaded and unguarded.
fn guarded_branch<T: Storage>(
    stream: &Arc<CudaStream>,
    g: &BranchGradientsDevice<T>,
    [q, k, v, row_stat]: [&[usize]; 4],
) -> Result<BranchGradients<T>, LaunchError> {
    let (dq, dk, dv, delta) =
        (back(stream, &g.dq)?, back(stream, &g.dk)?, back(stream, &g.dv)?, back(stream, &g.delta)?);
    stream.synchronize().map_err(|e| LaunchError::Driver(e.to_string()))?;
    Ok(BranchGradients {
        dq: guarded_t("dq", dq, q)?,
        dk: guarded_t("dk", dk, k)?,
        dv: guarded_t("dv", dv, v)?,
        delta: guarded_f32("delta", delta, row_stat)?,
    })
}

/// The layer's backward of `kernels` with `strategy` on `case` under `config` (gate logits and `dO` in
/// `gate_logits_and_d_out`), from the forward `forward` (uploaded), through `nsa_layer_backward_device` into
/// NaN-poisoned outputs followed by guard bands; checks every guard and that the inputs and the lists are unchanged
/// on the device.
pub fn layer_backward_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    config: &NsaConfig,
    (kernels, strategy): (&NsaLayerKernels, GpuBackwardStrategy),
    (gate_logits, d_out): (&ArrayD<T>, &ArrayD<T>),
    forward: &NsaLayerForward<T>,
) -> Result<NsaLayerBackward<T>, LaunchError> {
    let spec = &case.spec;
    let s = NsaLayerShapes::new(spec, config)?;
    let (q, k, v) = (upload(stream, &case.q)?, upload(stream, &case.k)?, upload(stream, &case.v)?);
    let (x, dy) = (upload(stream, gate_logits)?, upload(stream, d_out)?);
    let device_forward = NsaLayerForwardDevice::upload(stream, spec, config, forward)?;
    let token: [&[usize]; 4] = [&s.q, &s.k, &s.v, &s.row_stat];
    let mut out = NsaLayerBackwardDevice {
        dq: poisoned_t(stream, &s.q)?,
        dk: poisoned_t(stream, &s.k)?,
        dv: poisoned_t(stream, &s.v)?,
        d_gate_logits: poisoned_f32(stream, &s.gate_logits)?,
        d_o_cmp: poisoned_t(stream, &s.o)?,
        d_o_slc: poisoned_t(stream, &s.o)?,
        d_o_win: poisoned_t(stream, &s.o)?,
        compressed: poisoned_branch(stream, [&s.q, &s.k_cmp, &s.v_cmp, &s.row_stat])?,
        dk_pool: poisoned_t(stream, &s.k)?,
        dv_pool: poisoned_t(stream, &s.v)?,
        selected: poisoned_branch(stream, token)?,
        window: poisoned_branch(stream, token)?,
        d_maps: [
            s.d_maps[0].map(|m| poisoned_f32(stream, &m)).transpose()?,
            s.d_maps[1].map(|m| poisoned_f32(stream, &m)).transpose()?,
        ],
    };
    let inputs = NsaLayerBackwardInputs {
        layer: NsaLayerInputs { q: &q, k: &k, v: &v, gate_logits: &x },
        forward: &device_forward,
        d_out: &dy,
    };
    nsa_layer_backward_device(stream, spec, config, kernels, inputs, strategy, &mut out)?;
    let g = &out;
    let t = [&g.dq, &g.dk, &g.dv, &g.d_o_cmp, &g.d_o_slc, &g.d_o_win, &g.dk_pool, &g.dv_pool].map(|b| back(stream, b));
    let dx = back(stream, &g.d_gate_logits)?;
    let inputs_back = [back(stream, &q)?, back(stream, &k)?, back(stream, &v)?, back(stream, &x)?, back(stream, &dy)?];
    let lists_back = back(stream, &device_forward.lists)?;
    let maps_back = [0, 1].map(|i| g.d_maps[i].as_ref().map(|b| back(stream, b)));
    stream.synchronize().map_err(|e| LaunchError::Driver(e.to_string()))?;
    let originals = [("q", &case.q), ("k", &case.k), ("v", &case.v), ("gate_logits", gate_logits), ("d_out", d_out)];
    unchanged(&originals, &inputs_back)?;
    if forward.lists.iter().zip(&lists_back).any(|(a, b)| a != b) {
        return Err(LaunchError::InputChanged { input: "lists" });
    }
    let [dq, dk, dv, d_o_cmp, d_o_slc, d_o_win, dk_pool, dv_pool] = t;
    Ok(NsaLayerBackward {
        dq: guarded_t("dq", dq?, &s.q)?,
        dk: guarded_t("dk", dk?, &s.k)?,
        dv: guarded_t("dv", dv?, &s.v)?,
        d_gate_logits: guarded_f32("d_gate_logits", dx, &s.gate_logits)?,
        d_o_cmp: guarded_t("d_o_cmp", d_o_cmp?, &s.o)?,
        d_o_slc: guarded_t("d_o_slc", d_o_slc?, &s.o)?,
        d_o_win: guarded_t("d_o_win", d_o_win?, &s.o)?,
        compressed: guarded_branch(stream, &g.compressed, [&s.q, &s.k_cmp, &s.v_cmp, &s.row_stat])?,
        dk_pool: guarded_t("dk_pool", dk_pool?, &s.k)?,
        dv_pool: guarded_t("dv_pool", dv_pool?, &s.v)?,
        selected: guarded_branch(stream, &g.selected, token)?,
        window: guarded_branch(stream, &g.window, token)?,
        d_maps: [map_back(maps_back[0].clone(), s.d_maps[0])?, map_back(maps_back[1].clone(), s.d_maps[1])?],
    })
}

/// A learned matrix's gradient downloaded (`back`) and unguarded to its `[l·cols, cols]` shape.
fn map_back(
    back: Option<Result<Vec<f32>, LaunchError>>,
    shape: Option<[usize; 2]>,
) -> Result<Option<ndarray::Array2<f32>>, LaunchError> {
    match (back, shape) {
        (Some(back), Some(shape)) => {
            let got = guarded_f32("d_map", back?, &shape)?;
            Ok(Some(got.into_dimensionality().expect("rank 2")))
        }
        _ => Ok(None),
    }
}

/// Whether a layout is varlen (the draws' classes).
pub fn is_varlen(spec: &AttentionSpec) -> bool {
    matches!(spec.layout, Layout::Varlen { .. })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nsa::reference_compression;
    use crate::nsa_select::exact_scores;
    use attnproof_oracle::attention::backward_with_visibility;
    use attnproof_oracle::nsa::{Compression, compress_backward, gate_combine, gate_combine_backward, select_blocks};
    use attnproof_oracle::spec::Sequence;
    use attnproof_oracle::{DenseConfig, Mask, Qkv};
    use attnproof_reference::sparse::nsa::{SelectionConfig, SelectionInputs, SelectionOutputs, nsa_selection_forward};
    use half::bf16;
    use ndarray::{Array2, Array3, Axis};

    const LEN: usize = 80;
    const HEADS: (usize, usize) = (4, 2);

    fn config() -> NsaConfig {
        NsaConfig {
            compress_len: 8,
            compress_stride: 4,
            select_block: 16,
            n_selected: 3,
            n_forced_initial: 1,
            n_forced_local: 1,
            window: 16,
            ..NsaConfig::default()
        }
    }

    /// One sequence, varlen: every tensor is `[T, H, ·]`, the oracle's own layout.
    fn spec() -> AttentionSpec {
        AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, LEN as i32], cu_seqlens_k: vec![0, LEN as i32] },
            ..AttentionSpec::dense(1, HEADS.0, HEADS.1, 1, 1, 16, 8).with_mask(Mask::Causal)
        }
    }

    fn widen(t: &ArrayD<bf16>) -> ArrayD<f64> {
        t.mapv(|x| f64::from(x.to_f32()))
    }

    fn round(t: &ArrayD<f64>) -> ArrayD<bf16> {
        t.mapv(bf16::from_f64)
    }

    fn rank3(t: &ArrayD<f64>) -> ndarray::ArrayView3<'_, f64> {
        t.view().into_dimensionality().expect("[T, H, ·]")
    }

    /// The gated sum of `branches` rounded to bf16.
    fn gated(branches: [&ArrayD<bf16>; 3], logits: &ArrayD<bf16>) -> ArrayD<bf16> {
        let b = branches.map(widen);
        let x = widen(logits);
        let (_, o) = gate_combine([rank3(&b[0]), rank3(&b[1]), rank3(&b[2])], rank3(&x), ()).unwrap();
        round(&o.into_dyn())
    }

    /// A layer forward made of independent paths to each stage's numbers: the recipe's CPU compression, the f64
    /// oracle's compressed and window attentions rounded, the exact block scores rounded to f32 with the oracle's lists
    /// on them, the CPU reference's selection branch, and the oracle's gated sum rounded.
    fn oracle_forward(case: &Case<bf16>, config: &NsaConfig, logits: &ArrayD<bf16>) -> NsaLayerForward<bf16> {
        let layer = &case.spec;
        let kv = reference_compression(case, config).unwrap();
        let cmp_spec = compressed_spec(layer, config).unwrap();
        let [q, k, v] = case.widened();
        let (kc, vc) = (widen(&kv.k), widen(&kv.v));
        let cmp = attnproof_oracle::forward(
            &cmp_spec,
            Qkv { q: q.view(), k: kc.view(), v: vc.view() },
            DenseConfig::default(),
            (),
        )
        .unwrap();
        let lse_cmp = cmp.lse.mapv(|x| x as f32);
        let seq = cmp_spec.sequences()[0];
        let (truth, _) =
            exact_scores(&cmp_spec, config, &seq, [q.view(), kc.view(), lse_cmp.mapv(f64::from).view()]).unwrap();
        let scores = truth.mapv(|x| x as f32);
        let lists = select_blocks(scores.mapv(f64::from).view(), config).unwrap();
        let mut o_slc = Array3::from_elem((LEN, HEADS.0, 8), bf16::NAN);
        let mut lse_slc = Array2::from_elem((HEADS.0, LEN), f32::NAN);
        let three = |a: &ArrayD<bf16>| a.clone().into_dimensionality::<ndarray::Ix3>().unwrap();
        let (q3, k3, v3) = (three(&case.q), three(&case.k), three(&case.v));
        let inputs = SelectionInputs { q: q3.view(), k: k3.view(), v: v3.view(), selection: lists.view() };
        let selection = SelectionConfig { select_block: config.select_block, scale: config.scale };
        nsa_selection_forward(&inputs, selection, SelectionOutputs { o: o_slc.view_mut(), lse: lse_slc.view_mut() })
            .unwrap();
        let win = attnproof_oracle::forward(
            &window_spec(layer, config).unwrap(),
            Qkv { q: q.view(), k: k.view(), v: v.view() },
            DenseConfig::default(),
            (),
        )
        .unwrap();
        let (o_cmp, o_slc, o_win) = (round(&cmp.o), o_slc.into_dyn(), round(&win.o));
        let o = gated([&o_cmp, &o_slc, &o_win], logits);
        NsaLayerForward {
            k_cmp: kv.k,
            v_cmp: kv.v,
            o_cmp,
            lse_cmp,
            scores,
            lists,
            o_slc,
            lse_slc: lse_slc.into_dyn(),
            o_win,
            lse_win: win.lse.mapv(|x| x as f32),
            o,
        }
    }

    fn gradients(g: &attnproof_oracle::Gradients<f64>) -> BranchGradients<bf16> {
        BranchGradients { dq: round(&g.dq), dk: round(&g.dk), dv: round(&g.dv), delta: g.delta.mapv(|x| x as f32) }
    }

    /// `fl_bf16(fl32(fl32(a + b) + c))` elementwise: the branch sum's recipe.
    fn recipe_sum(a: &ArrayD<bf16>, b: &ArrayD<bf16>, c: &ArrayD<bf16>) -> ArrayD<bf16> {
        let mut out = a.clone();
        for (((o, &a), &b), &c) in out.iter_mut().zip(a).zip(b).zip(c) {
            *o = bf16::from_f32((a.to_f32() + b.to_f32()) + c.to_f32());
        }
        out
    }

    /// A layer backward from independent paths: the oracle's gate gradients, each branch's f64 oracle backward on the
    /// rounded `dO_b` (the compressed one over the recipe's compressed keys, then the oracle's `compress_backward`
    /// of its rounded `dk̃`, `dṽ`; the selected one under `key ≤ token ∧ listed`), rounded, and the recipe's sums.
    fn oracle_backward(
        case: &Case<bf16>,
        config: &NsaConfig,
        (logits, d_out): (&ArrayD<bf16>, &ArrayD<bf16>),
        forward: &NsaLayerForward<bf16>,
    ) -> NsaLayerBackward<bf16> {
        let layer = &case.spec;
        let b = [&forward.o_cmp, &forward.o_slc, &forward.o_win].map(widen);
        let (x, dy) = (widen(logits), widen(d_out));
        let gates =
            gate_combine_backward([rank3(&b[0]), rank3(&b[1]), rank3(&b[2])], rank3(&x), rank3(&dy), ()).unwrap();
        let [d_o_cmp, d_o_slc, d_o_win] = gates.d_branches.map(|t| round(&t.into_dyn()));
        let d_gate_logits = gates.d_gate_logits.mapv(|x| x as f32).into_dyn();
        let [q, k, v] = case.widened();
        let (kc, vc) = (widen(&forward.k_cmp), widen(&forward.v_cmp));
        let cmp_spec = compressed_spec(layer, config).unwrap();
        let qkv_cmp = Qkv { q: q.view(), k: kc.view(), v: vc.view() };
        let cmp =
            attnproof_oracle::backward(&cmp_spec, qkv_cmp, widen(&d_o_cmp).view(), DenseConfig::default(), ()).unwrap();
        let compressed = gradients(&cmp);
        // The pooling's transpose per KV head (the loss is linear in x, so its values do not matter).
        let transpose = |d_cmp: &ArrayD<bf16>, like: &ArrayD<bf16>| {
            let d_cmp = widen(d_cmp);
            let mut out = like.mapv(|_| bf16::ZERO);
            for h in 0..HEADS.1 {
                let up = d_cmp.index_axis(Axis(1), h).into_dimensionality::<ndarray::Ix2>().unwrap();
                let x = Array2::<f64>::zeros((LEN, up.ncols()));
                let dx = compress_backward(x.view(), &Compression::Mean, up, config, ()).unwrap().dx;
                out.index_axis_mut(Axis(1), h).assign(&dx.mapv(bf16::from_f64).into_dyn());
            }
            out
        };
        let (dk_pool, dv_pool) = (transpose(&compressed.dk, &case.k), transpose(&compressed.dv, &case.v));
        let slc_spec = selected_spec(layer, config).unwrap();
        let lists = &forward.lists;
        let group = layer.group_size();
        let visibility = |seq: &Sequence, h: usize| {
            Array2::from_shape_fn((seq.len_q, seq.len_k), |(t, j)| {
                let list = lists.index_axis(Axis(0), t);
                j <= t && list.row(h / group).iter().any(|&b| b >= 0 && b as usize == j / config.select_block)
            })
        };
        let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
        let slc = backward_with_visibility(
            &slc_spec,
            qkv.clone(),
            widen(&d_o_slc).view(),
            &visibility,
            DenseConfig::default(),
            (),
        )
        .unwrap();
        let win_spec = window_spec(layer, config).unwrap();
        let win =
            attnproof_oracle::backward(&win_spec, qkv, widen(&d_o_win).view(), DenseConfig::default(), ()).unwrap();
        let (selected, window) = (gradients(&slc), gradients(&win));
        NsaLayerBackward {
            dq: recipe_sum(&compressed.dq, &selected.dq, &window.dq),
            dk: recipe_sum(&dk_pool, &selected.dk, &window.dk),
            dv: recipe_sum(&dv_pool, &selected.dv, &window.dv),
            d_gate_logits,
            d_o_cmp,
            d_o_slc,
            d_o_win,
            compressed,
            dk_pool,
            dv_pool,
            selected,
            window,
            d_maps: [None, None],
        }
    }

    /// The stage-wise verifiers accept a layer built from independent paths to each stage (module docs of the
    /// helpers), and each wiring fault fails at its stage: the selected and window outputs swapped, the gated sum
    /// taken with two branches swapped, one token's list moved to another block; in the backward, two branches' `dO`
    /// swapped and dK summed without the pooling's transpose.
    #[test]
    fn the_layer_verifiers_accept_the_oracle_and_reject_each_stage_wired_wrong() {
        let config = config();
        let case = crate::generate::make_case::<bf16>(&spec(), ValueProfile::GAUSSIAN, 21);
        let logits = gate_logits::<bf16>(&case.spec, LogitRange::Unit, 21);
        let good = oracle_forward(&case, &config, &logits);
        let verdict = verify_layer_forward(&case, &config, &logits, &good).unwrap();
        assert!(verdict.passed(), "{verdict}");
        assert_eq!(verdict.selected.len(), HEADS.1);

        let mut swapped = good.clone();
        std::mem::swap(&mut swapped.o_slc, &mut swapped.o_win);
        std::mem::swap(&mut swapped.lse_slc, &mut swapped.lse_win);
        let failed = verify_layer_forward(&case, &config, &logits, &swapped).unwrap().failed_stages();
        assert!(failed.contains(&"selected attention") && failed.contains(&"window attention"), "{failed:?}");

        let mut wrong_gate = good.clone();
        wrong_gate.o = gated([&good.o_cmp, &good.o_win, &good.o_slc], &logits);
        let failed = verify_layer_forward(&case, &config, &logits, &wrong_gate).unwrap().failed_stages();
        assert_eq!(failed, ["gates"]);

        // Token 70 (blocks 0..=4 eligible, 0 and 4 forced) keeps one candidate among 1..=3: move it to another.
        let mut moved = good.clone();
        let list = moved.lists.index_axis(Axis(0), 70).row(0).to_vec();
        let other = (1..4).find(|b| !list.contains(b)).expect("a candidate left out");
        moved.lists[[70, 0, 1]] = other;
        moved.lists.index_axis_mut(Axis(0), 70).row_mut(0).as_slice_mut().unwrap().sort_unstable();
        let failed = verify_layer_forward(&case, &config, &logits, &moved).unwrap().failed_stages();
        assert!(failed.contains(&"selection") && failed.contains(&"selected attention"), "{failed:?}");

        let d_out = crate::generate::make_d_out::<bf16>(&case.spec, 22);
        let grads = oracle_backward(&case, &config, (&logits, &d_out), &good);
        let verdict = verify_layer_backward(&case, &config, (&logits, &d_out), &good, &grads).unwrap();
        assert!(verdict.passed(), "{verdict}");

        let mut crossed = grads.clone();
        std::mem::swap(&mut crossed.d_o_slc, &mut crossed.d_o_win);
        let failed = verify_layer_backward(&case, &config, (&logits, &d_out), &good, &crossed).unwrap().failed_stages();
        assert!(failed.contains(&"gates"), "{failed:?}");

        let mut no_pool = grads.clone();
        no_pool.dk = recipe_sum(&grads.dk_pool.mapv(|_| bf16::ZERO), &grads.selected.dk, &grads.window.dk);
        let failed = verify_layer_backward(&case, &config, (&logits, &d_out), &good, &no_pool).unwrap().failed_stages();
        assert_eq!(failed, ["branch sums"]);
    }

    /// The sum verifier takes the recipe's bits, an infinity only where the exact sum overflows the storage type,
    /// and rejects a sum rounded to bf16 between the additions.
    #[test]
    fn the_sum_verifier_reads_the_recipe_and_infinities() {
        let t = |x: &[f32]| {
            ArrayD::from_shape_vec(IxDyn(&[x.len()]), x.iter().map(|&v| bf16::from_f32(v)).collect()).unwrap()
        };
        let largest = f32::from_bits(0x7f7f_0000);
        let (a, b, c) = (t(&[1.0, largest, 3.0]), t(&[2f32.powi(-8), largest, -3.0]), t(&[-1.0, 0.0, 1.0]));
        let branch = |d: &ArrayD<bf16>| BranchGradients {
            dq: d.clone(),
            dk: d.clone(),
            dv: d.clone(),
            delta: ArrayD::zeros(IxDyn(&[0])),
        };
        let sums = |sum: ArrayD<bf16>| {
            let candidate = NsaLayerBackward {
                dq: sum.clone(),
                dk: sum.clone(),
                dv: sum,
                d_gate_logits: ArrayD::zeros(IxDyn(&[0])),
                d_o_cmp: a.clone(),
                d_o_slc: a.clone(),
                d_o_win: a.clone(),
                compressed: branch(&a),
                dk_pool: a.clone(),
                dv_pool: a.clone(),
                selected: branch(&b),
                window: branch(&c),
                d_maps: [None, None],
            };
            verify_branch_sums(&candidate).unwrap()
        };
        let good = sums(recipe_sum(&a, &b, &c));
        assert!(good.passed() && good.elements == 9, "{:?}", good.failures);
        assert!(recipe_sum(&a, &b, &c)[1].is_infinite(), "two of bf16's largest overflow");
        let twice = t(&[0.0, f32::INFINITY, 1.0]);
        assert!(!sums(twice).passed(), "the partial sum rounded to bf16 loses 2^-8");
        assert!(!sums(t(&[2f32.powi(-8), f32::NEG_INFINITY, 1.0])).passed(), "an infinity of the wrong sign");
    }

    /// The strategy's draws reach what the GPU suites need: varlen, an empty sequence, groups above 8 and not powers
    /// of two, E31's head dims, small head dims, every logit range, a sequence shorter than a compression window and
    /// one of 300 tokens; and every draw is a layer the GPU wrapper takes.
    #[test]
    fn the_draws_reach_every_class_and_are_layers_the_wrapper_takes() {
        use proptest::strategy::ValueTree;
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..300 {
            let d = layer_draws().new_tree(&mut runner).unwrap().current();
            NsaLayerShapes::new(&d.layer, &d.config).unwrap();
            window_spec(&d.layer, &d.config).unwrap();
            let group = d.layer.group_size();
            let lens: Vec<usize> = d.layer.sequences().iter().map(|s| s.len_q).collect();
            for (class, reached) in [
                ("varlen", is_varlen(&d.layer)),
                ("empty sequence", lens.contains(&0)),
                ("group > 8", group > 8),
                ("group not a power of two", !group.is_power_of_two()),
                ("d 192", d.layer.head_dim == 192 && d.layer.head_dim_v == 128),
                ("small d", d.layer.head_dim <= 32),
                ("extreme logits", d.logits == LogitRange::Extreme),
                ("zero logits", d.logits == LogitRange::Zero),
                ("no window", lens.iter().any(|&l| l > 0 && l < d.config.compress_len)),
                ("300 tokens", lens.contains(&300)),
            ] {
                if reached {
                    seen.insert(class);
                }
            }
        }
        assert_eq!(seen.len(), 10, "{seen:?}");
    }
}
