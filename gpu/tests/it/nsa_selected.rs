//! NSA's selected-block attention forward (`attnproof_gpu::nsa::selected`, E18's selection branch, E31) on the
//! device: every draw runs on two inputs, A, B, A (A's two runs the same bits), NaN-poisoned and guarded with the
//! inputs and lists checked unchanged, and each (sequence, KV head) is held by the harness
//! (`attnproof_harness::nsa_selected`) to the dense forward's derived bound under `causal ∧ listed` with the gate's
//! dropped-block answer scored. Where every list names every block and blocks are whole 64-key tiles, the output
//! must equal the dense forward kernel's bit for bit (a row performs the same operations in the same order).
//!
//! The suites draw [`selected_draws`]: blocks of 8 to 192 tokens, lists of 1 to 32 of every kind (empty, every
//! eligible block, shared by neighbours, random, with blocks after the token), lengths from none past a tile and a
//! block, dense and varlen with empty sequences, GQA groups 1–16 and 24, 32, 64, E31's head dims and others, the
//! configuration's scale or another. Without a device each test prints `skipped: no CUDA device` and passes.

use std::sync::Arc;

use crate::common::*;
use crate::property::{SECOND_INPUT, assert_typed_suites_reach, run_typed_production};
use attnproof_gpu::GpuError;
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::flash_forward;
use attnproof_gpu::nsa::compress::compress_kv;
use attnproof_gpu::nsa::compressed::compressed_spec;
use attnproof_gpu::nsa::select::{NSA_SELECT, select};
use attnproof_gpu::nsa::selected::{NSA_SELECTED, SelectedTiling, selected, selected_device};
use attnproof_harness::nsa_selected::{
    ListMix, SelectedDraw, selected_case, selected_draws, selected_guarded, selected_lists, verify_selected,
};
use attnproof_oracle::nsa::NsaConfig;
use attnproof_oracle::{AttentionSpec, Layout, Mask, Scale};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::{Array3, ArrayD, IxDyn};
use proptest::test_runner::{Config, TestCaseError, TestError};

/// The two suites ("gpunsasl" in ASCII, plus the dtype).
pub const SELECTED_SUITES: [TypedSuite; 2] = [
    TypedSuite { name: "gpu_nsa_selected_bf16", bf16: true, cases: 48, seed: 0x6770_756e_7361_736c },
    TypedSuite { name: "gpu_nsa_selected_f16", bf16: false, cases: 32, seed: 0x6770_756e_7361_736d },
];

/// Whether `draw`'s output must equal the dense forward's bits: every list names every block, and blocks are whole
/// 64-key tiles (the dense kernel's tiles).
fn dense_equal(draw: &SelectedDraw) -> bool {
    draw.lists == ListMix::AllBlocks && draw.config.select_block.is_multiple_of(64)
}

/// One draw through `kernel` ([`check_token_list_draw`]): inputs A and B, A, B, A, both verdicts passing and
/// discriminating (the dropped-block answer rejected where it differs), and the dense kernel's bits where
/// [`dense_equal`].
fn check_selected<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    draw: &SelectedDraw,
) -> Result<(), TestCaseError> {
    let lists = selected_lists(draw);
    let cases = [selected_case::<T>(draw, draw.seed), selected_case::<T>(draw, draw.seed ^ SECOND_INPUT)];
    check_token_list_draw(
        stream,
        &cases,
        |case| selected_guarded(stream, &draw.config, (kernel, draw.tiling), case, &lists),
        |case, run| verify_selected(case, &draw.config, &lists, run.o.view(), run.lse.view()),
        dense_equal(draw),
    )
}

/// Runs a suite's draws under `config` through the kernel text `kernel` on `stream`; a failing draw comes back
/// described.
pub fn run_selected_suite(
    suite: &TypedSuite,
    config: Config,
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
) -> Result<(), Box<TestError<String>>> {
    let describe =
        |d: &SelectedDraw| format!("{:?} {:?} {:?} seed {} {:?}", d.layer, d.config, d.profile, d.seed, d.lists);
    if suite.bf16 {
        run_described(config, selected_draws(), |d| check_selected::<bf16>(stream, kernel, d), describe)
    } else {
        run_described(config, selected_draws(), |d| check_selected::<f16>(stream, kernel, d), describe)
    }
}

fn run_production(suite: &TypedSuite) {
    run_typed_production(suite, NSA_SELECTED, run_selected_suite);
}

#[test]
fn selected_attention_is_within_bound_bf16() {
    run_production(&SELECTED_SUITES[0]);
}

#[test]
fn selected_attention_is_within_bound_f16() {
    run_production(&SELECTED_SUITES[1]);
}

/// What a draw reaches, by name.
pub fn classes(draw: &SelectedDraw) -> Vec<&'static str> {
    let layer = &draw.layer;
    let group = layer.group_size();
    let seqs = layer.sequences();
    let block = draw.config.select_block;
    let tiling = draw.tiling.unwrap_or(SelectedTiling::for_group(group));
    [
        ("group > 8", group > 8 && group <= 16),
        ("group not a power of two", !group.is_power_of_two()),
        ("group 64", group == 64),
        ("rows left over", 64 % group != 0),
        ("one token per CTA", tiling.rows_per_cta / group == 1),
        ("a union of many tokens", tiling.rows_per_cta / group >= 8),
        ("a tiling other than the default", draw.tiling.is_some_and(|t| t != SelectedTiling::for_group(group))),
        ("d 192", layer.head_dim == 192),
        ("block shorter than a tile", block < 64),
        ("short blocks, a tile holding several", block < 64 && seqs.iter().any(|s| s.len_q > 2 * block)),
        ("block of several tiles", block > 64),
        (
            "varlen with an empty sequence",
            matches!(layer.layout, Layout::Varlen { .. }) && seqs.iter().any(|s| s.len_q == 0),
        ),
        ("past a tile", seqs.iter().any(|s| s.len_q > 64)),
        ("more blocks than the list holds", seqs.iter().any(|s| s.len_q.div_ceil(block) > draw.config.n_selected)),
        ("every block, dense bits", dense_equal(draw)),
        ("another scale", draw.config.scale != Scale::InverseSqrtHeadDim),
        ("large logits", draw.profile.logit_scale >= 20.0),
    ]
    .into_iter()
    .filter(|(_, reached)| *reached)
    .map(|(class, _)| class)
    .collect()
}

/// The suites' fixed seeds, replayed without a device, reach every class of [`classes`].
#[test]
fn the_selected_suites_draw_every_class() {
    assert_typed_suites_reach(&SELECTED_SUITES, selected_draws, classes, &ALL_CLASSES);
}

/// Every class of [`classes`].
pub const ALL_CLASSES: [&str; 17] = [
    "group > 8",
    "group not a power of two",
    "group 64",
    "rows left over",
    "one token per CTA",
    "a union of many tokens",
    "a tiling other than the default",
    "d 192",
    "block shorter than a tile",
    "short blocks, a tile holding several",
    "block of several tiles",
    "varlen with an empty sequence",
    "past a tile",
    "more blocks than the list holds",
    "every block, dense bits",
    "another scale",
    "large logits",
];

/// The paper's layer at 2048 tokens end to end on the device: compression, compressed attention, block selection
/// (top-16 with the first and two local blocks forced), then the selected attention over those lists, for a GQA
/// group of 16 at `d = 192` (E31) and a group of 5 over two KV heads.
#[test]
fn the_paper_layer_at_2048_tokens_attends_to_its_selection() {
    let Some(stream) = device_stream("the_paper_layer_at_2048_tokens_attends_to_its_selection") else { return };
    for (n_heads_q, n_heads_kv, d, dv) in [(16, 1, 192, 128), (10, 2, 128, 128)] {
        let draw = SelectedDraw {
            layer: AttentionSpec::dense(1, n_heads_q, n_heads_kv, 2048, 2048, d, dv).with_mask(Mask::Causal),
            config: NsaConfig::default(),
            profile: gaussian(1.0),
            seed: 0x006e_7361_736c_6431,
            lists: ListMix::Mixed,
            tiling: None,
        };
        let case = selected_case::<bf16>(&draw, draw.seed);
        let config = &draw.config;
        let layer = &draw.layer;
        let kv = compress_kv(&stream, layer, config, case.k.view(), case.v.view()).expect("compression");
        let cmp = compressed_spec(layer, config).expect("compressed spec");
        let lse =
            flash_forward(&stream, &cmp, case.q.view(), kv.k.view(), kv.v.view()).expect("compressed attention").lse;
        let lists = select(&stream, layer, config, NSA_SELECT, case.q.view(), kv.k.view(), lse.view())
            .expect("selection")
            .lists;
        let run = selected_guarded(&stream, config, (NSA_SELECTED, None), &case, &lists).expect("selected attention");
        let verdicts = verify_selected(&case, config, &lists, run.o.view(), run.lse.view()).expect("verdicts");
        for v in &verdicts {
            assert!(v.passed() && v.valid(), "{:?}:\n{v}", draw.layer);
        }
    }
}

/// Fixed draws that kill the catalog's `gpu-nsa-selected-*` mutants: a group of 3 at 300 tokens with blocks of 16
/// (several blocks per tile, rows left over), a group of 16 with 128-token blocks (two tiles per block), a group of 1
/// with 64-token blocks over varlen sequences (64 tokens per CTA: a wide union), and a group of 3 whose every token
/// lists every block (CTAs of 21 tokens straddle the tiles' ends, where a warp's two rows of a thread disagree about
/// the mask-free path).
pub fn killing_cases() -> Vec<(&'static str, SelectedDraw)> {
    let draw = |name, layout, n_heads_q, block, n_selected, lists| {
        (
            name,
            SelectedDraw {
                layer: AttentionSpec { layout, ..AttentionSpec::dense(1, n_heads_q, 1, 1, 1, 64, 64) }
                    .with_mask(Mask::Causal),
                config: NsaConfig {
                    select_block: block,
                    n_selected,
                    n_forced_initial: 0,
                    n_forced_local: 0,
                    ..NsaConfig::default()
                },
                profile: gaussian(2.0),
                seed: 0x006b_696c_6c73_6c64,
                lists,
                // The cases were built for CTAs of 64 rows (21 tokens at a group of 3, 64 at a group of 1).
                tiling: Some(SelectedTiling { rows_per_cta: 64 }),
            },
        )
    };
    let dense = |len| Layout::Dense { batch: 1, len_q: len, len_k: len };
    let cu = vec![0, 130, 130, 400];
    vec![
        draw("blocks_16_gqa3_300", dense(300), 3, 16, 8, ListMix::Mixed),
        draw("blocks_128_gqa16_400", dense(400), 16, 128, 3, ListMix::Mixed),
        draw(
            "blocks_64_gqa1_varlen",
            Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu },
            1,
            64,
            4,
            ListMix::Mixed,
        ),
        // Every token lists every block, and a group of 3 puts 21 tokens in a CTA, so CTAs are not aligned to the
        // 64-key tiles: some warp's first rows hold tokens just below a tile's last key while its second rows hold
        // that key's token or later (token 189 of the CTA at 189, say), the one place where a wrong mask-free test
        // of the first rows alone changes the tile's path.
        draw("all_blocks_64_gqa3_300", dense(300), 3, 64, 8, ListMix::AllBlocks),
    ]
}

/// Runs the selected attention's kernel text `kernel` on a killing case; `Ok(())` when it passes.
pub fn check_selected_case(stream: &Arc<CudaStream>, kernel: KernelSource, case: &SelectedDraw) -> Result<(), String> {
    check_selected::<bf16>(stream, kernel, case).map_err(|e| e.to_string())
}

/// Small draws under compute-sanitizer (`run.sh sanitize`): a group of 3 at 130 tokens with 16-token blocks (the
/// default 48 rows), varlen with an empty sequence in CTAs of 16 rows, a group of 16 at `d = 192` with 128-token
/// blocks (one token per CTA of 16 rows), groups of 24 and 5 in CTAs of 48 and 32 rows, and a group of 64 at
/// `d = 256` (64 rows).
#[test]
fn sanitizer_shapes() {
    let Some(stream) = device_stream("nsa_selected::sanitizer_shapes") else { return };
    let layer = |layout, hq, d, dv| {
        AttentionSpec { layout, ..AttentionSpec::dense(1, hq, 1, 1, 1, d, dv) }.with_mask(Mask::Causal)
    };
    let dense = |len| Layout::Dense { batch: 1, len_q: len, len_k: len };
    let cu = vec![0, 0, 90, 130];
    let varlen = Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu };
    let rows = |rows_per_cta| Some(SelectedTiling { rows_per_cta });
    for (spec, block, tiling) in [
        (layer(dense(130), 3, 64, 64), 16, None),
        (layer(varlen, 2, 64, 64), 64, rows(16)),
        (layer(dense(200), 16, 192, 128), 128, rows(16)),
        (layer(dense(100), 24, 128, 128), 64, rows(48)),
        (layer(dense(100), 5, 128, 128), 64, rows(32)),
        (layer(dense(70), 64, 256, 256), 64, None),
    ] {
        let draw = SelectedDraw {
            layer: spec,
            config: NsaConfig {
                select_block: block,
                n_selected: 4,
                n_forced_initial: 0,
                n_forced_local: 0,
                ..NsaConfig::default()
            },
            profile: gaussian(1.0),
            seed: 5,
            lists: ListMix::Mixed,
            tiling,
        };
        check_selected_case(&stream, NSA_SELECTED, &draw).unwrap_or_else(|e| panic!("{:?}: {e}", draw.layer));
    }
}

/// The host wrapper gives the guarded device run's bits.
#[test]
fn the_host_wrapper_equals_the_device_wrapper() {
    let Some(stream) = device_stream("nsa_selected::the_host_wrapper_equals_the_device_wrapper") else { return };
    let (_, draw) = killing_cases().swap_remove(0);
    let case = selected_case::<bf16>(&draw, draw.seed);
    let lists = selected_lists(&draw);
    let host = selected(
        &stream,
        &case.spec,
        &draw.config,
        NSA_SELECTED,
        case.q.view(),
        case.k.view(),
        case.v.view(),
        lists.view(),
    )
    .expect("host run");
    let device =
        selected_guarded(&stream, &draw.config, (NSA_SELECTED, draw.tiling), &case, &lists).expect("device run");
    assert!(host.o.iter().zip(device.o.iter()).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(host.lse.iter().zip(device.lse.iter()).all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// Bad input is a typed error before any launch: each kind of bad list (out of range, duplicate, not ascending, a
/// block after a pad, a negative other than −1), lists of the wrong width, a group above 64, a block length the
/// kernel does not tile, a layer that is not causal self-attention, an odd head dim, Q of the wrong shape, device
/// buffers too small. Device lists are not validated, but no list makes the kernel fault or loop: garbage lists
/// run to completion under the guards.
#[test]
fn bad_selected_input_is_a_typed_error_before_any_launch() {
    let Some(stream) = device_stream("nsa_selected::bad_selected_input_is_a_typed_error_before_any_launch") else {
        return;
    };
    let layer = AttentionSpec::dense(1, 2, 1, 100, 100, 64, 64).with_mask(Mask::Causal);
    let config = NsaConfig { n_selected: 3, n_forced_initial: 0, n_forced_local: 0, ..NsaConfig::default() };
    let zeros = |shape: &[usize]| ArrayD::from_elem(IxDyn(shape), bf16::ZERO);
    let (q, kv) = (zeros(&[1, 2, 100, 64]), zeros(&[1, 1, 100, 64]));
    let good = Array3::from_shape_fn((100, 1, 3), |(t, _, e)| if e <= t / 64 { e as i32 } else { -1 });
    let run = |layer: &AttentionSpec, config: &NsaConfig, q: &ArrayD<bf16>, lists: &Array3<i32>| {
        selected(&stream, layer, config, NSA_SELECTED, q.view(), kv.view(), kv.view(), lists.view())
    };
    assert!(run(&layer, &config, &q, &good).is_ok(), "the well-formed call");
    for (entries, what) in [
        ([0, 2, -1], "out of range"),
        ([1, 1, -1], "duplicate"),
        ([1, 0, -1], "not ascending"),
        ([0, -1, 1], "after a pad"),
        ([-3, -1, -1], "negative"),
    ] {
        let mut bad = good.clone();
        for (e, x) in entries.into_iter().enumerate() {
            bad[[70, 0, e]] = x;
        }
        let r = run(&layer, &config, &q, &bad);
        assert!(matches!(r, Err(GpuError::BlockList { position: [0, 0, 70, _], .. })), "{what}: {r:?}");
    }
    let wide = Array3::from_elem((100, 1, 4), -1);
    assert!(matches!(run(&layer, &config, &q, &wide), Err(GpuError::Shape { argument: "lists", .. })));
    let split = NsaConfig { select_block: 100, ..config.clone() };
    assert!(matches!(run(&layer, &split, &q, &good), Err(GpuError::Unsupported { argument: "select_block", .. })));
    let open = layer.clone().with_mask(Mask::None);
    assert!(matches!(run(&open, &config, &q, &good), Err(GpuError::Unsupported { argument: "mask", .. })));
    assert!(matches!(run(&layer, &config, &zeros(&[1, 2, 99, 64]), &good), Err(GpuError::Shape { argument: "q", .. })));
    let odd = AttentionSpec::dense(1, 2, 1, 100, 100, 60, 64).with_mask(Mask::Causal);
    assert!(matches!(run(&odd, &config, &q, &good), Err(GpuError::Unsupported { argument: "head_dim", .. })));
    let big_group = AttentionSpec::dense(1, 65, 1, 100, 100, 64, 64).with_mask(Mask::Causal);
    let r = run(&big_group, &config, &zeros(&[1, 65, 100, 64]), &good);
    assert!(matches!(r, Err(GpuError::Unsupported { argument: "n_heads_q / n_heads_kv", .. })), "{r:?}");
    // Device buffers too small.
    let up = |x: &ArrayD<bf16>| stream.clone_htod(x.as_slice().expect("contiguous")).expect("upload");
    let (dq, dkv) = (up(&q), up(&kv));
    let dl = stream.clone_htod(good.as_slice().expect("contiguous")).expect("upload");
    let mut o = stream.alloc_zeros::<bf16>(2 * 100 * 64).expect("alloc");
    let mut lse = stream.alloc_zeros::<f32>(2 * 100 - 1).expect("alloc");
    let r = selected_device(&stream, &layer, &config, NSA_SELECTED, (&dq, &dkv, &dkv), &dl, &mut o, &mut lse);
    assert!(matches!(r, Err(GpuError::BufferTooSmall { argument: "lse", .. })), "{r:?}");
    // Garbage device lists (every entry a large, negative or repeated value) run and stay inside the guards.
    let case = attnproof_harness::flash::Case { spec: layer.clone(), q: q.clone(), k: kv.clone(), v: kv.clone() };
    let garbage = Array3::from_shape_fn((100, 1, 3), |(t, _, e)| [i32::MAX, -7, 1, 0][(t + e) % 4]);
    selected_guarded(&stream, &config, (NSA_SELECTED, None), &case, &garbage).expect("garbage lists run guarded");
}
