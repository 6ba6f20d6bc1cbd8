//! DSA's token-sparse attention forward (E16, `attnproof_gpu::dsa::sparse`) on the device: every draw runs on two inputs,
//! A, B, A (A's two runs the same bits), NaN-poisoned and guarded with the inputs and lists checked unchanged, and each
//! (sequence, KV head) is held by the harness (`attnproof_harness::dsa_sparse`) to the dense forward's derived bound
//! under "key listed for the query" with the gate's dropped-token answer scored. Where every list holds every visible
//! token, the output must equal the dense causal forward kernel's bit for bit (a row performs the same operations on
//! the same tiles in the same order).
//!
//! The suites draw [`token_sparse_draws`]: lists of 1 to 200 slots and 2048, of every kind (empty, every visible
//! token, the most recent, shared by neighbours, random, a sink with the most recent), shared by every KV head or one
//! per KV head; lengths from none past a tile ± 1, dense and varlen with empty sequences; GQA groups 1–16 and 24 to
//! 128 (several CTAs per token above 64); head dims up to 256; the default scale or another. Without a device each
//! test prints `skipped: no CUDA device` and passes.

use std::sync::Arc;

use crate::common::*;
use crate::property::{SECOND_INPUT, assert_typed_suites_reach, run_typed_production};
use attnproof_gpu::GpuError;
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::dsa::sparse::{
    DSA_SPARSE, DSA_SPARSE_MMA_SYNC, ListSharing, SparseProducts, TokenSelection, rows_per_cta, token_sparse,
    token_sparse_device,
};
use attnproof_harness::dsa_sparse::{
    TokenListMix, TokenSparseDraw, token_lists, token_sparse_case, token_sparse_draws, token_sparse_guarded,
    verify_token_sparse,
};
use attnproof_oracle::{AttentionSpec, Layout, Mask, Scale};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::{Array3, ArrayD, IxDyn};
use proptest::test_runner::{Config, TestCaseError, TestError};

/// The two suites ("gpudsasp" in ASCII, plus the dtype).
pub const TOKEN_SPARSE_SUITES: [TypedSuite; 2] = [
    TypedSuite { name: "gpu_dsa_sparse_bf16", bf16: true, cases: 48, seed: 0x6770_7564_7361_7370 },
    TypedSuite { name: "gpu_dsa_sparse_f16", bf16: false, cases: 32, seed: 0x6770_7564_7361_7371 },
];

/// Whether `draw`'s output must equal the dense causal forward's bits: every list holds every visible token.
fn dense_equal(draw: &TokenSparseDraw) -> bool {
    draw.lists == TokenListMix::AllVisible && draw.layer.sequences().iter().all(|s| s.len_q <= draw.selection.top_k)
}

/// One draw through `kernel` ([`check_token_list_draw`]): inputs A and B, A, B, A, both verdicts passing and
/// discriminating (the dropped-token answer rejected where it differs), and the dense kernel's bits where
/// [`dense_equal`], on either path: a `wgmma` k-step sums its products as `mma.sync`'s k-steps do (the bench found
/// both paths' outputs equal bit for bit), so those rows too perform the dense forward's operations.
fn check_token_sparse<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    draw: &TokenSparseDraw,
) -> Result<(), TestCaseError> {
    let lists = token_lists(draw);
    let cases = [token_sparse_case::<T>(draw, draw.seed), token_sparse_case::<T>(draw, draw.seed ^ SECOND_INPUT)];
    check_token_list_draw(
        stream,
        &cases,
        |case| token_sparse_guarded(stream, draw.selection, kernel, case, &lists),
        |case, run| verify_token_sparse(case, draw.selection, &lists, run.o.view(), run.lse.view()),
        dense_equal(draw),
    )
}

/// Runs a suite's draws under `config` through the kernel text `kernel` on `stream`; a failing draw comes back
/// described.
pub fn run_token_sparse_suite(
    suite: &TypedSuite,
    config: Config,
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
) -> Result<(), Box<TestError<String>>> {
    let describe =
        |d: &TokenSparseDraw| format!("{:?} {:?} {:?} seed {} {:?}", d.layer, d.selection, d.profile, d.seed, d.lists);
    if suite.bf16 {
        run_described(config, token_sparse_draws(), |d| check_token_sparse::<bf16>(stream, kernel, d), describe)
    } else {
        run_described(config, token_sparse_draws(), |d| check_token_sparse::<f16>(stream, kernel, d), describe)
    }
}

fn run_production(suite: &TypedSuite) {
    run_typed_production(suite, DSA_SPARSE, run_token_sparse_suite);
}

#[test]
fn token_sparse_attention_is_within_bound_bf16() {
    run_production(&TOKEN_SPARSE_SUITES[0]);
}

#[test]
fn token_sparse_attention_is_within_bound_f16() {
    run_production(&TOKEN_SPARSE_SUITES[1]);
}

/// The bf16 suite on `mma.sync` everywhere ([`DSA_SPARSE_MMA_SYNC`]): on Hopper the production launch takes `wgmma`
/// for groups of more than 48 heads at `d, dv ≤ 128`, so this runs the path other devices take for those draws.
#[test]
fn token_sparse_attention_on_mma_sync_is_within_bound() {
    run_typed_production(&TOKEN_SPARSE_SUITES[0], DSA_SPARSE_MMA_SYNC, run_token_sparse_suite);
}

/// What a draw reaches, by name.
pub fn classes(draw: &TokenSparseDraw) -> Vec<&'static str> {
    let layer = &draw.layer;
    let group = layer.group_size();
    let seqs = layer.sequences();
    let k = draw.selection.top_k;
    [
        ("MQA group of one", group == 1),
        ("group > 8", group > 8 && group <= 16),
        ("group not a power of two", !group.is_power_of_two()),
        ("rows left over in a warp", !group.is_multiple_of(16) && group < 64),
        ("several CTAs per token", group > 64),
        (
            "CTAs of 64 heads on wgmma (Hopper)",
            SparseProducts::choose(DSA_SPARSE, (9, 0), layer) == SparseProducts::Wgmma,
        ),
        ("a last chunk of fewer heads", group > 64 && !group.is_multiple_of(rows_per_cta(group))),
        ("lists per KV head", draw.selection.heads == ListSharing::PerKvHead && layer.n_heads_kv > 1),
        ("lists shared by KV heads", draw.selection.heads == ListSharing::Shared && layer.n_heads_kv > 1),
        ("d 256", layer.head_dim == 256),
        ("d not a multiple of 16", !layer.head_dim.is_multiple_of(16)),
        ("lists shorter than a tile", k < 64),
        ("lists of whole tiles and one slot", k > 64 && k % 64 == 1),
        ("lists of several tiles", k > 128),
        ("lists wider than the sequence", seqs.iter().all(|s| s.len_q < k)),
        ("a sequence past the list", seqs.iter().any(|s| s.len_q > k)),
        (
            "varlen with an empty sequence",
            matches!(layer.layout, Layout::Varlen { .. }) && seqs.iter().any(|s| s.len_q == 0),
        ),
        ("every visible token, dense bits", dense_equal(draw)),
        ("another scale", layer.scale != Scale::InverseSqrtHeadDim),
        ("large logits", draw.profile.logit_scale >= 20.0),
    ]
    .into_iter()
    .filter(|(_, reached)| *reached)
    .map(|(class, _)| class)
    .collect()
}

/// Every class of [`classes`].
pub const ALL_CLASSES: [&str; 20] = [
    "MQA group of one",
    "group > 8",
    "group not a power of two",
    "rows left over in a warp",
    "several CTAs per token",
    "CTAs of 64 heads on wgmma (Hopper)",
    "a last chunk of fewer heads",
    "lists per KV head",
    "lists shared by KV heads",
    "d 256",
    "d not a multiple of 16",
    "lists shorter than a tile",
    "lists of whole tiles and one slot",
    "lists of several tiles",
    "lists wider than the sequence",
    "a sequence past the list",
    "varlen with an empty sequence",
    "every visible token, dense bits",
    "another scale",
    "large logits",
];

/// The suites' fixed seeds, replayed without a device, reach every class of [`classes`].
#[test]
fn the_token_sparse_suites_draw_every_class() {
    assert_typed_suites_reach(&TOKEN_SPARSE_SUITES, token_sparse_draws, classes, &ALL_CLASSES);
}

/// DSA's shape end to end on the device at 2048 tokens: the indexer's top-256 of a 16-head indexer feeds the attention
/// of 64 query heads over one KV head (MQA, `d = 128`), and of 128 heads in two CTAs per token.
#[test]
fn the_indexer_selection_feeds_the_attention() {
    use attnproof_gpu::dsa::index::{Scores, indexer_top_k};
    let Some(stream) = device_stream("the_indexer_selection_feeds_the_attention") else { return };
    let len = 2048;
    let gaussian_bf16 = |seed: u64, n: usize| -> Vec<bf16> {
        attnproof_harness::generate::gaussian(seed, n).into_iter().map(bf16::from_f64).collect()
    };
    let q_index = ndarray::Array3::from_shape_vec((len, 16, 64), gaussian_bf16(1, len * 16 * 64)).expect("shape");
    let k_index = ndarray::Array2::from_shape_vec((len, 64), gaussian_bf16(2, len * 64)).expect("shape");
    let weights: Vec<f32> = attnproof_harness::generate::gaussian(3, len * 16).into_iter().map(|x| x as f32).collect();
    let weights = ndarray::Array2::from_shape_vec((len, 16), weights).expect("shape");
    let lists = indexer_top_k(&stream, q_index.view(), k_index.view(), weights.view(), 256, Scores::Discard)
        .expect("the indexer")
        .lists
        .insert_axis(ndarray::Axis(1));
    for n_heads in [64, 128] {
        let draw = TokenSparseDraw {
            layer: AttentionSpec::dense(1, n_heads, 1, len, len, 128, 128).with_mask(Mask::Causal),
            selection: TokenSelection { top_k: 256, heads: ListSharing::Shared },
            profile: gaussian(1.0),
            seed: 0x0064_7361_7370_6431,
            lists: TokenListMix::Mixed,
        };
        let case = token_sparse_case::<bf16>(&draw, draw.seed);
        let run = token_sparse_guarded(&stream, draw.selection, DSA_SPARSE, &case, &lists).expect("attention");
        let verdicts =
            verify_token_sparse(&case, draw.selection, &lists, run.o.view(), run.lse.view()).expect("verdicts");
        for v in &verdicts {
            assert!(v.passed() && v.valid(), "{n_heads} heads:\n{v}");
        }
    }
}

/// Fixed draws that kill the catalog's `gpu-dsa-sparse-*` mutants: a GQA group of 3 over two KV heads with lists of
/// 65 per KV head at 300 tokens (a tile and one, rows left over, the KV heads' lists differ), MQA over 100 heads with
/// lists of 100 at 200 tokens (two CTAs per token, the second of 36 heads; `wgmma` on Hopper at `d = 64`, one 64-column
/// chunk), MQA over 64 heads at `d = dv = 128` with lists of 130 at 200 tokens (`wgmma` on Hopper with two chunks per
/// row, three tiles, the last of two slots), and a group of 16 whose lists hold every visible token of varlen
/// sequences of 130 and 70 (the dense forward's bits).
pub fn killing_cases() -> Vec<(&'static str, TokenSparseDraw)> {
    let draw = |layout, heads: (usize, usize), top_k, sharing, lists| TokenSparseDraw {
        layer: AttentionSpec { layout, ..AttentionSpec::dense(1, heads.0, heads.1, 1, 1, 64, 64) }
            .with_mask(Mask::Causal),
        selection: TokenSelection { top_k, heads: sharing },
        profile: gaussian(2.0),
        seed: 0x006b_696c_6c64_7370,
        lists,
    };
    let dense = |len| Layout::Dense { batch: 1, len_q: len, len_k: len };
    let cu = vec![0, 130, 130, 200];
    let mut mqa64_d128 = draw(dense(200), (64, 1), 130, ListSharing::Shared, TokenListMix::Mixed);
    mqa64_d128.layer.head_dim = 128;
    mqa64_d128.layer.head_dim_v = 128;
    vec![
        ("gqa3_kv2_per_head_65_300", draw(dense(300), (6, 2), 65, ListSharing::PerKvHead, TokenListMix::Mixed)),
        ("mqa100_shared_100_200", draw(dense(200), (100, 1), 100, ListSharing::Shared, TokenListMix::Mixed)),
        ("mqa64_d128_shared_130_200", mqa64_d128),
        (
            "gqa16_all_visible_varlen",
            draw(
                Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu },
                (16, 1),
                2048,
                ListSharing::Shared,
                TokenListMix::AllVisible,
            ),
        ),
    ]
}

/// Runs the token-sparse attention's kernel text `kernel` on a killing case; `Ok(())` when it passes.
pub fn check_token_sparse_case(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    case: &TokenSparseDraw,
) -> Result<(), String> {
    check_token_sparse::<bf16>(stream, kernel, case).map_err(|e| e.to_string())
}

/// Small draws under compute-sanitizer (`run.sh sanitize`): a group of 3 at 130 tokens with lists of 65, varlen with
/// an empty sequence and lists per KV head, a group of 100 at `d = 192` (two CTAs per token), a group of 64 at
/// `d = 256` with lists wider than the sequence, and groups of 64 at `d = dv = 128` and of 72 at `d = 72, dv = 40`
/// with lists of 130 and 65 (`wgmma` on Hopper: two stages in turn, a partial last tile, padded columns, a second
/// chunk of 8 heads); each through the production launch and on `mma.sync`.
#[test]
fn sanitizer_shapes() {
    let Some(stream) = device_stream("dsa_sparse::sanitizer_shapes") else { return };
    let layer = |layout, hq, hkv, d, dv| {
        AttentionSpec { layout, ..AttentionSpec::dense(1, hq, hkv, 1, 1, d, dv) }.with_mask(Mask::Causal)
    };
    let dense = |len| Layout::Dense { batch: 1, len_q: len, len_k: len };
    let cu = vec![0, 0, 90, 130];
    let varlen = Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu };
    for (spec, top_k, heads) in [
        (layer(dense(130), 3, 1, 64, 64), 65, ListSharing::Shared),
        (layer(varlen, 4, 2, 64, 64), 16, ListSharing::PerKvHead),
        (layer(dense(100), 100, 1, 192, 128), 70, ListSharing::Shared),
        (layer(dense(70), 64, 1, 256, 256), 2048, ListSharing::Shared),
        (layer(dense(130), 64, 1, 128, 128), 130, ListSharing::Shared),
        (layer(dense(100), 72, 1, 72, 40), 65, ListSharing::Shared),
    ] {
        let draw = TokenSparseDraw {
            layer: spec,
            selection: TokenSelection { top_k, heads },
            profile: gaussian(1.0),
            seed: 5,
            lists: TokenListMix::Mixed,
        };
        for kernel in [DSA_SPARSE, DSA_SPARSE_MMA_SYNC] {
            check_token_sparse_case(&stream, kernel, &draw)
                .unwrap_or_else(|e| panic!("{} {:?}: {e}", kernel.name, draw.layer));
        }
    }
}

/// Lists holding every visible token give the dense forward's bits on the `wgmma` path too (64 heads over one KV head,
/// varlen sequences of 130 and 70, at `d = dv = 128` and at `d = 72, dv = 40`, whose padded columns add zeros), and
/// on `mma.sync`.
#[test]
fn every_visible_token_gives_the_dense_bits_on_both_paths() {
    let Some(stream) = device_stream("dsa_sparse::every_visible_token_gives_the_dense_bits_on_both_paths") else {
        return;
    };
    let cu = vec![0, 130, 200];
    for (d, dv) in [(128, 128), (72, 40)] {
        let layout = Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu.clone() };
        let draw = TokenSparseDraw {
            layer: AttentionSpec { layout, ..AttentionSpec::dense(1, 64, 1, 1, 1, d, dv) }.with_mask(Mask::Causal),
            selection: TokenSelection { top_k: 2048, heads: ListSharing::Shared },
            profile: gaussian(2.0),
            seed: 0x0064_656e_7365_6269,
            lists: TokenListMix::AllVisible,
        };
        assert!(dense_equal(&draw));
        for kernel in [DSA_SPARSE, DSA_SPARSE_MMA_SYNC] {
            check_token_sparse_case(&stream, kernel, &draw)
                .unwrap_or_else(|e| panic!("{} d {d} dv {dv}: {e}", kernel.name));
        }
    }
}

/// The host wrapper gives the guarded device run's bits.
#[test]
fn the_host_wrapper_equals_the_device_wrapper() {
    let Some(stream) = device_stream("dsa_sparse::the_host_wrapper_equals_the_device_wrapper") else { return };
    let (_, draw) = killing_cases().swap_remove(0);
    let case = token_sparse_case::<bf16>(&draw, draw.seed);
    let lists = token_lists(&draw);
    let host = token_sparse(
        &stream,
        &case.spec,
        draw.selection,
        DSA_SPARSE,
        case.q.view(),
        case.k.view(),
        case.v.view(),
        lists.view(),
    )
    .expect("host run");
    let device = token_sparse_guarded(&stream, draw.selection, DSA_SPARSE, &case, &lists).expect("device run");
    assert!(host.o.iter().zip(device.o.iter()).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(host.lse.iter().zip(device.lse.iter()).all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// Bad input is a typed error before any launch: each kind of bad list (a key after its token, duplicate, not
/// ascending, a token after a pad, a negative other than −1), lists of the wrong shape, a layer that is not causal
/// self-attention, an odd head dim, Q of the wrong shape, device buffers too small. Device lists are not validated,
/// but no list makes the kernel fault or read a future key: garbage lists run to completion under the guards, and a
/// list whose entries run past its token attends to the prefix before them only.
#[test]
fn bad_token_sparse_input_is_a_typed_error_before_any_launch() {
    let Some(stream) = device_stream("dsa_sparse::bad_token_sparse_input_is_a_typed_error_before_any_launch") else {
        return;
    };
    let layer = AttentionSpec::dense(1, 2, 1, 100, 100, 64, 64).with_mask(Mask::Causal);
    let selection = TokenSelection { top_k: 3, heads: ListSharing::Shared };
    let zeros = |shape: &[usize]| ArrayD::from_elem(IxDyn(shape), bf16::ZERO);
    let (q, kv) = (zeros(&[1, 2, 100, 64]), zeros(&[1, 1, 100, 64]));
    let good = Array3::from_shape_fn((100, 1, 3), |(t, _, e)| if e <= t { e as i32 } else { -1 });
    let run = |layer: &AttentionSpec, selection: TokenSelection, q: &ArrayD<bf16>, lists: &Array3<i32>| {
        token_sparse(&stream, layer, selection, DSA_SPARSE, q.view(), kv.view(), kv.view(), lists.view())
    };
    assert!(run(&layer, selection, &q, &good).is_ok(), "the well-formed call");
    for (row, entries, what) in [
        (1, [0, 2, -1], "a key after its token"),
        (70, [1, 1, -1], "duplicate"),
        (70, [1, 0, -1], "not ascending"),
        (70, [0, -1, 1], "after a pad"),
        (70, [-3, -1, -1], "negative"),
        (70, [0, 1, 100], "outside the sequence"),
    ] {
        let mut bad = good.clone();
        for (e, x) in entries.into_iter().enumerate() {
            bad[[row, 0, e]] = x;
        }
        let r = run(&layer, selection, &q, &bad);
        assert!(matches!(r, Err(GpuError::BlockList { position: [0, 0, t, _], .. }) if t == row), "{what}: {r:?}");
    }
    let wide = Array3::from_elem((100, 1, 4), -1);
    assert!(matches!(run(&layer, selection, &q, &wide), Err(GpuError::Shape { argument: "lists", .. })));
    let per_head = TokenSelection { heads: ListSharing::PerKvHead, ..selection };
    let two_kv = AttentionSpec::dense(1, 2, 2, 100, 100, 64, 64).with_mask(Mask::Causal);
    let r = token_sparse(&stream, &two_kv, per_head, DSA_SPARSE, q.view(), q.view(), q.view(), good.view());
    assert!(matches!(r, Err(GpuError::Shape { argument: "lists", .. })), "{r:?}");
    let open = layer.clone().with_mask(Mask::None);
    assert!(matches!(run(&open, selection, &q, &good), Err(GpuError::Unsupported { argument: "mask", .. })));
    let shape_q = zeros(&[1, 2, 99, 64]);
    assert!(matches!(run(&layer, selection, &shape_q, &good), Err(GpuError::Shape { argument: "q", .. })));
    let odd = AttentionSpec::dense(1, 2, 1, 100, 100, 60, 64).with_mask(Mask::Causal);
    assert!(matches!(run(&odd, selection, &q, &good), Err(GpuError::Unsupported { argument: "head_dim", .. })));
    // Device buffers too small.
    let up = |x: &ArrayD<bf16>| stream.clone_htod(x.as_slice().expect("contiguous")).expect("upload");
    let (dq, dkv) = (up(&q), up(&kv));
    let dl = stream.clone_htod(good.as_slice().expect("contiguous")).expect("upload");
    let mut o = stream.alloc_zeros::<bf16>(2 * 100 * 64).expect("alloc");
    let mut lse = stream.alloc_zeros::<f32>(2 * 100 - 1).expect("alloc");
    let r = token_sparse_device(&stream, &layer, selection, DSA_SPARSE, (&dq, &dkv, &dkv), &dl, &mut o, &mut lse);
    assert!(matches!(r, Err(GpuError::BufferTooSmall { argument: "lse", .. })), "{r:?}");
    let short = stream.clone_htod(&good.as_slice().expect("contiguous")[..299]).expect("upload");
    let mut lse = stream.alloc_zeros::<f32>(2 * 100).expect("alloc");
    let r = token_sparse_device(&stream, &layer, selection, DSA_SPARSE, (&dq, &dkv, &dkv), &short, &mut o, &mut lse);
    assert!(matches!(r, Err(GpuError::BufferTooSmall { argument: "lists", .. })), "{r:?}");
    // Garbage device lists (large, negative, repeated and future entries) run and stay inside the guards.
    let case = attnproof_harness::flash::Case { spec: layer.clone(), q: q.clone(), k: kv.clone(), v: kv.clone() };
    let garbage = Array3::from_shape_fn((100, 1, 3), |(t, _, e)| [i32::MAX, -7, 1, 0, 99][(t + e) % 5]);
    token_sparse_guarded(&stream, selection, DSA_SPARSE, &case, &garbage).expect("garbage lists run guarded");
    // A device list that runs past its token ends there: token 5 listing 0, 5, 6 attends to 0 and 5 only, which is
    // what the verifier expects of the list 0, 5.
    let draw = TokenSparseDraw {
        layer: AttentionSpec::dense(1, 2, 1, 10, 10, 64, 64).with_mask(Mask::Causal),
        selection,
        profile: gaussian(1.0),
        seed: 9,
        lists: TokenListMix::Mixed,
    };
    let case = token_sparse_case::<bf16>(&draw, draw.seed);
    let mut past = Array3::from_elem((10, 1, 3), -1);
    let mut valid = past.clone();
    for (e, x) in [0, 5, 6].into_iter().enumerate() {
        past[[5, 0, e]] = x;
    }
    valid[[5, 0, 0]] = 0;
    valid[[5, 0, 1]] = 5;
    let run = token_sparse_guarded(&stream, selection, DSA_SPARSE, &case, &past).expect("a list past its token runs");
    let verdicts = verify_token_sparse(&case, selection, &valid, run.o.view(), run.lse.view()).expect("verdicts");
    assert!(verdicts.iter().all(|v| v.passed()), "{}", verdicts.iter().map(|v| v.to_string()).collect::<String>());
}
