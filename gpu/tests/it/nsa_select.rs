//! NSA's block selection (`attnproof_gpu::nsa::select`, E19, E32) on the device, end to end from the layer: the
//! compression kernel makes `k̃` and `ṽ`, the dense forward over them (the compressed attention) gives `LSE_cmp`, and
//! the selection kernels score the blocks and write the lists. The harness (`attnproof_harness::nsa_select`) holds the
//! f32 scores to the derived bound of the exact scores of those inputs and the lists to the oracle's `select_blocks` on
//! the kernel's own scores entry for entry (the two together explain every difference from the oracle's lists on the
//! exact scores by the bound); outputs are poisoned and guarded, inputs checked unchanged, and the same input runs twice (A, B, A) for the
//! same bits.
//!
//! The suites draw [`selection_draws`]: the paper's configuration and fla-core's, short windows and blocks that do not
//! divide each other, lists of 1 to 32 entries with 0–2 forced initial and 0–3 forced local blocks, lengths from none
//! to past one tile of 64 compressed keys, dense and varlen with empty sequences, GQA groups 1–16, E31's head dims,
//! and keys periodic with the block length (whole blocks tie at the top-`n` boundary). Without a device each test
//! prints `skipped: no CUDA device` and passes.

use std::sync::Arc;

use crate::common::*;
use crate::property::{SECOND_INPUT, assert_typed_suites_reach, run_typed_production};
use attnproof_gpu::GpuError;
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::flash::flash_forward;
use attnproof_gpu::nsa::compress::compress_kv;
use attnproof_gpu::nsa::compressed::compressed_spec;
use attnproof_gpu::nsa::select::{NSA_SELECT, Selection, select};
use attnproof_harness::nsa_select::{SelectionDraw, select_guarded, selection_case, selection_draws, verify_selection};
use attnproof_oracle::nsa::NsaConfig;
use attnproof_oracle::{AttentionSpec, Layout, Mask};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::{ArrayD, IxDyn};
use proptest::test_runner::{Config, TestCaseError, TestError};

/// The two suites ("gpunsase" in ASCII, plus the dtype).
pub const SELECT_SUITES: [TypedSuite; 2] = [
    TypedSuite { name: "gpu_nsa_select_bf16", bf16: true, cases: 32, seed: 0x6770_756e_7361_7365 },
    TypedSuite { name: "gpu_nsa_select_f16", bf16: false, cases: 24, seed: 0x6770_756e_7361_7366 },
];

/// The selection's inputs for one layer case, made on the device by the production kernels: the layer's queries,
/// the compressed keys and the compressed attention's LSE.
struct SelectionInputs<T> {
    q: ArrayD<T>,
    k_cmp: ArrayD<T>,
    lse: ArrayD<f32>,
}

fn selection_inputs<T: Storage>(
    stream: &Arc<CudaStream>,
    draw: &SelectionDraw,
    seed: u64,
) -> Result<SelectionInputs<T>, String> {
    let layer = selection_case::<T>(draw, seed);
    let config = &draw.config;
    let kv = compress_kv(stream, &layer.spec, config, layer.k.view(), layer.v.view()).map_err(|e| e.to_string())?;
    let spec = compressed_spec(&layer.spec, config).map_err(|e| e.to_string())?;
    let forward = flash_forward(stream, &spec, layer.q.view(), kv.k.view(), kv.v.view()).map_err(|e| e.to_string())?;
    Ok(SelectionInputs { q: layer.q, k_cmp: kv.k, lse: forward.lse })
}

/// Runs `kernel` on the inputs, guarded.
fn run_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    draw: &SelectionDraw,
    kernel: KernelSource,
    inputs: &SelectionInputs<T>,
) -> Result<Selection, String> {
    select_guarded(stream, &draw.layer, &draw.config, kernel, [&inputs.q, &inputs.k_cmp], &inputs.lse)
        .map_err(|e| e.to_string())
}

/// One draw: inputs A and B, the selection on A, B, A (A's two runs the same bits), both verdicts passing; returns
/// how many lists of the two verdicts end on a tie of the kernel's scores.
fn check_selection<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    draw: &SelectionDraw,
) -> Result<usize, String> {
    let inputs = [
        selection_inputs::<T>(stream, draw, draw.seed)?,
        selection_inputs::<T>(stream, draw, draw.seed ^ SECOND_INPUT)?,
    ];
    let first = run_guarded(stream, draw, kernel, &inputs[0])?;
    let second = run_guarded(stream, draw, kernel, &inputs[1])?;
    let again = run_guarded(stream, draw, kernel, &inputs[0])?;
    let bits = |s: &Selection| s.scores.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if bits(&first) != bits(&again) || first.lists != again.lists {
        return Err("the same input gave different scores or lists".into());
    }
    let mut ties = 0;
    for (input, selection) in inputs.iter().zip([&first, &second]) {
        let verdict = verify_selection(
            &draw.layer,
            &draw.config,
            input.q.view(),
            input.k_cmp.view(),
            input.lse.view(),
            selection,
        )
        .map_err(|e| e.to_string())?;
        if !verdict.passed() {
            return Err(verdict.failures.join("\n"));
        }
        ties += verdict.boundary_ties;
    }
    Ok(ties)
}

/// Runs a selection suite's draws under `config` through the kernel text `kernel` on `stream`; a failing draw comes
/// back described.
pub fn run_select_suite(
    suite: &TypedSuite,
    config: Config,
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
) -> Result<(), Box<TestError<String>>> {
    let describe = |d: &SelectionDraw| {
        format!("{:?} {:?} {:?} seed {} periodic {}", d.layer, d.config, d.profile, d.seed, d.periodic_keys)
    };
    let fail = |e: String| TestCaseError::fail(e);
    if suite.bf16 {
        run_described(
            config,
            selection_draws(),
            |d| check_selection::<bf16>(stream, kernel, d).map(drop).map_err(fail),
            describe,
        )
    } else {
        run_described(
            config,
            selection_draws(),
            |d| check_selection::<f16>(stream, kernel, d).map(drop).map_err(fail),
            describe,
        )
    }
}

fn run_production(suite: &TypedSuite) {
    run_typed_production(suite, NSA_SELECT, run_select_suite);
}

#[test]
fn block_selection_is_exact_on_its_scores_and_within_bound_bf16() {
    run_production(&SELECT_SUITES[0]);
}

#[test]
fn block_selection_is_exact_on_its_scores_and_within_bound_f16() {
    run_production(&SELECT_SUITES[1]);
}

/// The paper's layer at 2048 tokens (32 blocks, 127 windows: two tiles of compressed keys): a GQA group of 16 over
/// one KV head at `d = 192` (E31), and a group of 5 over two KV heads at `d = 128`, with random and periodic keys.
#[test]
fn the_paper_layer_at_2048_tokens_selects_exactly() {
    let Some(stream) = device_stream("the_paper_layer_at_2048_tokens_selects_exactly") else { return };
    for (n_heads_q, n_heads_kv, d, dv, periodic_keys) in
        [(16, 1, 192, 128, false), (10, 2, 128, 128, false), (16, 1, 128, 128, true)]
    {
        let draw = SelectionDraw {
            layer: AttentionSpec::dense(1, n_heads_q, n_heads_kv, 2048, 2048, d, dv).with_mask(Mask::Causal),
            config: NsaConfig::default(),
            profile: gaussian(1.0),
            seed: 0x006e_7361_7365_6c31,
            periodic_keys,
        };
        let ties =
            check_selection::<bf16>(&stream, NSA_SELECT, &draw).unwrap_or_else(|e| panic!("{:?}: {e}", draw.layer));
        // Periodic keys make every block past the first score alike: the lists' boundaries are ties, resolved to
        // the lower block (the verdict's list comparison), and the draw must really produce them.
        assert!(!periodic_keys || ties > 0, "{:?}: periodic keys gave no tie at a list's boundary", draw.layer);
    }
}

/// What a draw reaches, by name.
fn classes(draw: &SelectionDraw) -> Vec<&'static str> {
    let layer = &draw.layer;
    let config = &draw.config;
    let group = layer.n_heads_q / layer.n_heads_kv;
    let spec = compressed_spec(layer, config).expect("a drawn layer is an NSA layer");
    let paper = config.compress_len == 32 && config.compress_stride == 16 && config.select_block == 64;
    [
        ("group > 8", group > 8),
        ("group not a power of two", !group.is_power_of_two()),
        ("d 192", layer.head_dim == 192),
        ("paper configuration", paper && config.n_selected == 16),
        ("block not a multiple of the stride", !config.select_block.is_multiple_of(config.compress_stride)),
        ("no forced block", config.n_forced_initial + config.n_forced_local == 0),
        ("no complete window", layer.sequences().iter().any(|q| q.len_k > 0 && q.len_k < config.compress_len)),
        ("varlen", matches!(layer.layout, Layout::Varlen { .. })),
        ("compressed keys beyond one tile", spec.sequences().iter().any(|q| q.len_k > 64)),
        (
            "more blocks than the list holds",
            layer.sequences().iter().any(|q| q.len_k > config.n_selected * config.select_block),
        ),
        ("periodic keys", draw.periodic_keys),
    ]
    .into_iter()
    .filter(|(_, reached)| *reached)
    .map(|(class, _)| class)
    .collect()
}

/// The suites' fixed seeds, replayed without a device, reach every class of [`classes`].
#[test]
fn the_selection_suites_draw_every_class() {
    let all = [
        "group > 8",
        "group not a power of two",
        "d 192",
        "paper configuration",
        "block not a multiple of the stride",
        "no forced block",
        "no complete window",
        "varlen",
        "compressed keys beyond one tile",
        "more blocks than the list holds",
        "periodic keys",
    ];
    assert_typed_suites_reach(&SELECT_SUITES, selection_draws, classes, &all);
}

/// Fixed draws that kill the catalog's `gpu-nsa-select-*` mutants: the paper's configuration over a GQA group of 3
/// with random keys past one tile of compressed keys, the same with periodic keys at 1500 tokens (more than 16 blocks: ties at the list's boundary), and short windows with
/// blocks that do not divide the stride.
pub fn killing_cases() -> Vec<(&'static str, SelectionDraw)> {
    let draw = |name, n_heads_q, n_heads_kv, len, config: NsaConfig, periodic_keys| {
        (
            name,
            SelectionDraw {
                layer: AttentionSpec::dense(1, n_heads_q, n_heads_kv, len, len, 64, 64).with_mask(Mask::Causal),
                config,
                profile: gaussian(2.0),
                seed: 0x006b_696c_6c73_656c,
                periodic_keys,
            },
        )
    };
    let short = NsaConfig {
        compress_len: 5,
        compress_stride: 3,
        select_block: 8,
        n_selected: 6,
        n_forced_initial: 2,
        n_forced_local: 1,
        ..NsaConfig::default()
    };
    vec![
        draw("paper_gqa3_1100", 6, 2, 1100, NsaConfig::default(), false),
        draw("paper_periodic_gqa2", 2, 1, 1500, NsaConfig::default(), true),
        draw("short_windows_5_3_8", 3, 1, 200, short, false),
    ]
}

/// Runs the selection's kernel text `kernel` on a killing case; `Ok(())` when it passes.
pub fn check_select_case(stream: &Arc<CudaStream>, kernel: KernelSource, case: &SelectionDraw) -> Result<(), String> {
    check_selection::<bf16>(stream, kernel, case).map(drop)
}

/// Small draws under compute-sanitizer (`run.sh sanitize`): a group of 3 at 130 tokens (tails of a 64-row CTA and
/// three selection blocks), varlen with an empty sequence, and a group of 16 at `d = 192`.
#[test]
fn sanitizer_shapes() {
    let Some(stream) = device_stream("nsa_select::sanitizer_shapes") else { return };
    let layer = |layout, hq, hkv, d| AttentionSpec {
        layout,
        ..AttentionSpec::dense(1, hq, hkv, 1, 1, d, 64).with_mask(Mask::Causal)
    };
    let dense = |len| Layout::Dense { batch: 1, len_q: len, len_k: len };
    let cu = vec![0, 0, 90, 130];
    let varlen = Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu };
    for spec in [layer(dense(130), 3, 1, 64), layer(varlen, 2, 2, 64), layer(dense(100), 16, 1, 192)] {
        let draw = SelectionDraw {
            layer: spec,
            config: NsaConfig::default(),
            profile: gaussian(1.0),
            seed: 5,
            periodic_keys: false,
        };
        check_select_case(&stream, NSA_SELECT, &draw).unwrap_or_else(|e| panic!("{:?}: {e}", draw.layer));
    }
}

/// The host wrapper gives the guarded device run's bits.
#[test]
fn the_host_wrapper_equals_the_device_wrapper() {
    let Some(stream) = device_stream("nsa_select::the_host_wrapper_equals_the_device_wrapper") else { return };
    let (_, draw) = killing_cases().swap_remove(0);
    let inputs = selection_inputs::<bf16>(&stream, &draw, draw.seed).expect("inputs");
    let host =
        select(&stream, &draw.layer, &draw.config, NSA_SELECT, inputs.q.view(), inputs.k_cmp.view(), inputs.lse.view())
            .expect("host selection");
    let device = run_guarded(&stream, &draw, NSA_SELECT, &inputs).expect("device selection");
    assert_eq!(host.lists, device.lists);
    assert!(host.scores.iter().zip(device.scores.iter()).all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// Bad input is a typed error before any launch: a list wider than 32, a group above 64, a layer that is not causal
/// self-attention, an odd head dim, compressed keys or an LSE of the wrong shape, a NaN or `+∞` LSE, device buffers
/// too small.
#[test]
fn bad_selection_input_is_a_typed_error_before_any_launch() {
    let Some(stream) = device_stream("nsa_select::bad_selection_input_is_a_typed_error_before_any_launch") else {
        return;
    };
    let layer = AttentionSpec::dense(1, 2, 1, 100, 100, 64, 64).with_mask(Mask::Causal);
    let config = NsaConfig::default();
    let zeros = |shape: &[usize]| ArrayD::from_elem(IxDyn(shape), bf16::ZERO);
    let q = zeros(&[1, 2, 100, 64]);
    // ⌊(100 − 32)/16⌋ + 1 = 5 windows.
    let k_cmp = zeros(&[1, 1, 5, 64]);
    let lse = ArrayD::from_elem(IxDyn(&[1, 2, 100]), 0.0f32);
    let run = |layer: &AttentionSpec, config: &NsaConfig, k: &ArrayD<bf16>, lse: &ArrayD<f32>| {
        select(&stream, layer, config, NSA_SELECT, q.view(), k.view(), lse.view())
    };
    assert!(run(&layer, &config, &k_cmp, &lse).is_ok(), "the well-formed call");
    let wide = NsaConfig { n_selected: 33, ..config.clone() };
    assert!(matches!(run(&layer, &wide, &k_cmp, &lse), Err(GpuError::Unsupported { argument: "n_selected", .. })));
    let open = layer.clone().with_mask(Mask::None);
    assert!(matches!(run(&open, &config, &k_cmp, &lse), Err(GpuError::Unsupported { argument: "mask", .. })));
    assert!(matches!(
        run(&layer, &config, &zeros(&[1, 1, 6, 64]), &lse),
        Err(GpuError::Shape { argument: "k_cmp", .. })
    ));
    let short_lse = ArrayD::from_elem(IxDyn(&[1, 2, 99]), 0.0f32);
    assert!(matches!(run(&layer, &config, &k_cmp, &short_lse), Err(GpuError::Shape { argument: "lse", .. })));
    for bad in [f32::NAN, f32::INFINITY] {
        let mut poisoned = lse.clone();
        poisoned[[0, 1, 50]] = bad;
        assert!(run(&layer, &config, &k_cmp, &poisoned).is_err(), "an LSE of {bad}");
    }
    let mut empty_rows = lse.clone();
    empty_rows[[0, 0, 3]] = f32::NEG_INFINITY;
    assert!(run(&layer, &config, &k_cmp, &empty_rows).is_ok(), "−∞ is the LSE of a token that sees no window");
    let big_group = AttentionSpec::dense(1, 65, 1, 100, 100, 64, 64).with_mask(Mask::Causal);
    let q65 = zeros(&[1, 65, 100, 64]);
    let lse65 = ArrayD::from_elem(IxDyn(&[1, 65, 100]), 0.0f32);
    let r = select(&stream, &big_group, &config, NSA_SELECT, q65.view(), k_cmp.view(), lse65.view());
    assert!(matches!(r, Err(GpuError::Unsupported { argument: "n_heads_q / n_heads_kv", .. })), "{r:?}");
    // Device buffers too small.
    let up = |x: &ArrayD<bf16>| stream.clone_htod(x.as_slice().expect("contiguous")).expect("upload");
    let (dq, dk) = (up(&q), up(&k_cmp));
    let dl = stream.clone_htod(lse.as_slice().expect("contiguous")).expect("upload");
    let mut scores = stream.alloc_zeros::<f32>(100 * 2 - 1).expect("alloc");
    let mut lists = stream.alloc_zeros::<i32>(100 * 16).expect("alloc");
    let r = attnproof_gpu::nsa::select::select_device(
        &stream,
        &layer,
        &config,
        NSA_SELECT,
        &dq,
        &dk,
        &dl,
        &mut scores,
        &mut lists,
    );
    assert!(matches!(r, Err(GpuError::BufferTooSmall { argument: "scores", .. })), "{r:?}");
}
