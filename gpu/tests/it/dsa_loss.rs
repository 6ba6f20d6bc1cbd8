//! DSA's indexer loss and its gradients on the GPU (`attnproof_gpu::dsa::loss`, E16's KL on the selected tokens)
//! against the oracle through `attnproof_harness::dsa_loss`: every output within its derived bound, slots past a list
//! and rows without target exactly as specified, poisoned outputs, guard bands, unchanged inputs, and two runs with
//! the same bits (`d_k_index`, summed by atomics, excepted).
//!
//! The property suite draws lengths around the 64-token tile (0 included), `k` from 1 to past `T`, 1 to 64 indexer
//! heads, both index dims, GQA groups of 1 to 17 and of 63 to 66 query heads (the teacher's 64-head chunks) over 1 to 3
//! KV heads, head dims 8 to 256, bf16 and f16, lists of every kind (full top-k rows, short and empty ones), the
//! sparse forward's LSE or a dense one (the teacher then has less than `H` mass), and values that break weak kernels:
//! large logits on both sides, indexer logits that are all negative (every score 0, every gate closed), exactly zero
//! logits (the ReLU's kink: a gate that must stay closed), and weights of both signs. Without a device each test
//! prints `skipped: no CUDA device` and passes.

use std::sync::Arc;

use crate::property::run_config;
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::dsa::index::{INDEX_DIMS, IndexerShape};
use attnproof_gpu::dsa::loss::{
    DSA_LOSS, LossGradients, LossInputs, LossInputsDevice, LossRows, LossShape, indexer_loss, indexer_loss_device,
};
use attnproof_gpu::{BlockListFault, GpuError, skip_unless_gpu};
use attnproof_harness::candidate::Storage;
use attnproof_harness::dsa_loss::{LossProblem, LossVerdict, loss_guarded, same_bits, verify_indexer_loss};
use attnproof_harness::generate::gaussian;
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::{Array2, Array3};
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestError, TestRunner};

/// How a draw's indexer values are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Values {
    /// Standard normal inputs, positive weights.
    Normal,
    /// Inputs scaled by 4 on both sides: sharp students and teachers.
    Large,
    /// Indexer queries negative and keys positive: every logit ≤ 0, every score 0, every gate closed.
    NegativeLogits,
    /// Half the indexer key columns and the other half of the query columns are 0 on some rows: logits exactly 0.
    ZeroLogits,
    /// Weights of both signs.
    SignedWeights,
}

/// Which LSE the teacher is normalized by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LseKind {
    /// The token-sparse forward's over the same lists (the sparse training stage: `τ' = τ / H`).
    Sparse,
    /// A dense causal forward's over every visible token (less than `H` mass on the list).
    Dense,
}

/// How the lists are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListKind {
    /// Full rows: `min(k, t + 1)` distinct visible tokens, drawn at random.
    Full,
    /// Random lengths from 0 to the full row's: short and empty lists.
    Short,
}

/// The storage type of a draw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
}

/// One draw of the suite.
#[derive(Clone, Copy, Debug)]
pub struct LossDraw {
    /// The problem's shape (its scale is the draw's).
    pub shape: LossShape,
    /// The indexer's values.
    pub values: Values,
    /// The LSE of the teacher.
    pub lse: LseKind,
    /// The lists.
    pub lists: ListKind,
    /// The storage type.
    pub dtype: Dtype,
    /// Input seed.
    pub seed: u64,
}

/// The draw's lists: per token, distinct visible tokens in ascending order, `−1`-padded.
fn lists_of(draw: &LossDraw) -> Array2<i32> {
    let IndexerShape { seq_len, top_k, .. } = draw.shape.indexer;
    let mut rng = proptest::test_runner::TestRng::from_seed(
        proptest::test_runner::RngAlgorithm::ChaCha,
        &[(draw.seed % 251) as u8; 32],
    );
    use proptest::prelude::RngExt;
    let mut lists = Array2::from_elem((seq_len, top_k), -1);
    for t in 0..seq_len {
        let full = top_k.min(t + 1);
        let n = if draw.lists == ListKind::Short { rng.random_range(0..=full) } else { full };
        let mut tokens: Vec<usize> = (0..=t).collect();
        // A partial Fisher–Yates shuffle picks n distinct tokens.
        for i in 0..n {
            let j = rng.random_range(i..tokens.len());
            tokens.swap(i, j);
        }
        let mut chosen = tokens[..n].to_vec();
        chosen.sort_unstable();
        for (slot, s) in chosen.into_iter().enumerate() {
            lists[[t, slot]] = s as i32;
        }
    }
    lists
}

/// The draw's inputs in storage type `T`, with the LSE the draw names computed in f64 from the rounded inputs.
pub fn problem_of<T: Storage>(draw: &LossDraw) -> LossProblem<T> {
    let LossShape { indexer, n_heads, n_heads_kv, head_dim, scale } = draw.shape;
    let IndexerShape { seq_len, n_index_heads: heads, index_dim: dim, .. } = indexer;
    let g = |salt: u64, n: usize| gaussian(draw.seed ^ salt, n);
    let size = if draw.values == Values::Large { 4.0 } else { 1.0 };
    let (gq, gk, gw) = (g(0x51, seq_len * heads * dim), g(0x4b, seq_len * dim), g(0x57, seq_len * heads));
    let zero_row = |t: usize| draw.values == Values::ZeroLogits && t.is_multiple_of(2);
    let q_index = Array3::from_shape_fn((seq_len, heads, dim), |(t, a, c)| {
        let x = gq[(t * heads + a) * dim + c] * size;
        let x = match draw.values {
            Values::NegativeLogits => -x.abs(),
            // Even tokens' queries live on the upper half of the columns, every key on the lower half: their logits
            // are exactly 0.
            Values::ZeroLogits if zero_row(t) && c < dim / 2 => 0.0,
            _ => x,
        };
        T::from_f32(x as f32)
    });
    let k_index = Array2::from_shape_fn((seq_len, dim), |(s, c)| {
        let x = gk[s * dim + c] * size;
        let x = match draw.values {
            Values::NegativeLogits => x.abs(),
            Values::ZeroLogits if c >= dim / 2 => 0.0,
            _ => x,
        };
        T::from_f32(x as f32)
    });
    let weights = Array2::from_shape_fn((seq_len, heads), |(t, a)| {
        let x = gw[t * heads + a];
        (if draw.values == Values::SignedWeights { x } else { x.abs() + 0.125 }) as f32
    });
    let (gmq, gmk) = (g(0x71, seq_len * n_heads * head_dim), g(0x6b, seq_len * n_heads_kv * head_dim));
    let query = Array3::from_shape_fn((seq_len, n_heads, head_dim), |(t, h, c)| {
        T::from_f32((gmq[(t * n_heads + h) * head_dim + c] * size) as f32)
    });
    let key = Array3::from_shape_fn((seq_len, n_heads_kv, head_dim), |(s, h, c)| {
        T::from_f32((gmk[(s * n_heads_kv + h) * head_dim + c] * size) as f32)
    });
    let lists = lists_of(draw);
    let group = n_heads / n_heads_kv;
    let wide = |x: T| f64::from(x.to_f32());
    let lse = Array2::from_shape_fn((n_heads, seq_len), |(h, t)| {
        let logit = |s: usize| {
            (0..head_dim).map(|c| wide(query[[t, h, c]]) * wide(key[[s, h / group, c]])).sum::<f64>() * f64::from(scale)
        };
        let visible: Vec<usize> = match draw.lse {
            LseKind::Sparse => lists.row(t).iter().take_while(|&&s| s >= 0).map(|&s| s as usize).collect(),
            LseKind::Dense => (0..=t).collect(),
        };
        if visible.is_empty() {
            return 0.0;
        }
        let z: Vec<f64> = visible.iter().map(|&s| logit(s)).collect();
        let top = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (top + z.iter().map(|x| (x - top).exp()).sum::<f64>().ln()) as f32
    });
    LossProblem { q_index, k_index, weights, lists, query, key, lse, scale }
}

fn draws() -> impl Strategy<Value = LossDraw> {
    let seq_len = prop_oneof![0usize..=5, 60usize..=70, 124usize..=132];
    let index_heads = prop_oneof![Just(1usize), 2usize..=16, 17usize..=63, Just(64usize)];
    let group = prop_oneof![4 => 1usize..=17, 1 => 63usize..=66];
    let head_dim = prop::sample::select(vec![8usize, 16, 24, 64, 72, 128, 136, 256]);
    let values = prop_oneof![
        Just(Values::Normal),
        Just(Values::Large),
        Just(Values::NegativeLogits),
        Just(Values::ZeroLogits),
        Just(Values::SignedWeights)
    ];
    let lse = prop_oneof![Just(LseKind::Sparse), Just(LseKind::Dense)];
    let lists = prop_oneof![Just(ListKind::Full), Just(ListKind::Short)];
    let dtype = prop_oneof![Just(Dtype::Bf16), Just(Dtype::F16)];
    let kinds = (values, lse, lists, dtype, any::<u64>());
    (seq_len, index_heads, prop::sample::select(INDEX_DIMS.to_vec()), group, 1usize..=3, head_dim, kinds).prop_flat_map(
        |(seq_len, n_index_heads, index_dim, group, n_heads_kv, head_dim, kinds)| {
            // k from 1 to past T, with T − 1, T and the 64-token tile's edges drawn on purpose.
            let top_k = prop_oneof![
                1usize..=seq_len + 8,
                Just(seq_len.max(1)),
                Just(seq_len.saturating_sub(1).max(1)),
                Just(63usize),
                Just(65usize)
            ];
            let scale = prop_oneof![Just(1.0 / (head_dim as f32).sqrt()), Just(0.5f32)];
            (top_k, scale).prop_map(move |(top_k, scale)| {
                let (values, lse, lists, dtype, seed) = kinds;
                LossDraw {
                    shape: LossShape {
                        indexer: IndexerShape { seq_len, n_index_heads, index_dim, top_k },
                        n_heads: group * n_heads_kv,
                        n_heads_kv,
                        head_dim,
                        scale,
                    },
                    values,
                    lse,
                    lists,
                    dtype,
                    seed,
                }
            })
        },
    )
}

/// Runs a draw with `kernel` twice (the same bits but for `d_k_index`) and verifies the first run.
pub fn check_draw<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    draw: &LossDraw,
) -> Result<LossVerdict, String> {
    let problem = problem_of::<T>(draw);
    let first = loss_guarded(stream, kernel, &problem).map_err(|e| e.to_string())?;
    let second = loss_guarded(stream, kernel, &problem).map_err(|e| e.to_string())?;
    if !same_bits(&first, &second) {
        return Err("two runs differ in bits outside d_k_index (A/A)".into());
    }
    let verdict = verify_indexer_loss(&problem, &first).map_err(|e| e.to_string())?;
    if !verdict.passed() {
        let shown: Vec<&String> = verdict.failures.iter().take(4).collect();
        return Err(format!("{} failures, first: {shown:?}", verdict.failures.len()));
    }
    Ok(verdict)
}

/// Dispatches a draw on its storage type.
pub fn check_any(stream: &Arc<CudaStream>, kernel: KernelSource, draw: &LossDraw) -> Result<LossVerdict, String> {
    match draw.dtype {
        Dtype::Bf16 => check_draw::<bf16>(stream, kernel, draw),
        Dtype::F16 => check_draw::<f16>(stream, kernel, draw),
    }
}

/// The suite's draws and seed.
pub const SUITE: (&str, u32, u64) = ("dsa_loss", 40, 0xd5a1_0055);

/// Runs the suite with `kernel` under `config`: the worst error as a fraction of its bound, or the first failing draw.
pub fn run_suite(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    config: proptest::test_runner::Config,
) -> Result<f64, TestError<LossDraw>> {
    let mut runner = TestRunner::new(config);
    let worst = std::cell::Cell::new(0.0f64);
    runner.run(&draws(), |draw| {
        let verdict = check_any(stream, kernel, &draw).map_err(|e| TestCaseError::fail(format!("{draw:?}: {e}")))?;
        worst.set(worst.get().max(verdict.worst_ratio));
        Ok(())
    })?;
    Ok(worst.get())
}

fn draw(
    (seq_len, index_heads, index_dim, top_k): (usize, usize, usize, usize),
    (n_heads, n_heads_kv, head_dim): (usize, usize, usize),
    values: Values,
    (lse, lists): (LseKind, ListKind),
    seed: u64,
) -> LossDraw {
    LossDraw {
        shape: LossShape {
            indexer: IndexerShape { seq_len, n_index_heads: index_heads, index_dim, top_k },
            n_heads,
            n_heads_kv,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
        },
        values,
        lse,
        lists,
        dtype: Dtype::Bf16,
        seed,
    }
}

/// Named draws that kill the catalog's loss mutants (`gpu-dsa-loss-*`): the 64-token tile's edges, DSA's MQA shape,
/// GQA over several KV heads, more than 64 heads of a group, exactly zero logits, a dense LSE, short lists.
pub fn killing_cases() -> Vec<(&'static str, LossDraw)> {
    use ListKind::{Full, Short};
    use LseKind::{Dense, Sparse};
    vec![
        ("empty", draw((0, 4, 64, 3), (4, 1, 64), Values::Normal, (Sparse, Full), 1)),
        ("mqa_tile_plus_one", draw((65, 64, 128, 65), (16, 1, 128), Values::Normal, (Sparse, Full), 2)),
        ("gqa_three_kv_heads_dense", draw((70, 8, 64, 40), (9, 3, 72), Values::Large, (Dense, Short), 3)),
        ("group_of_66", draw((62, 5, 128, 63), (66, 1, 64), Values::SignedWeights, (Sparse, Full), 4)),
        ("zero_logits", draw((64, 16, 64, 20), (4, 2, 16), Values::ZeroLogits, (Dense, Full), 5)),
        ("negative_logits", draw((66, 3, 64, 64), (2, 1, 256), Values::NegativeLogits, (Sparse, Short), 6)),
        ("tile_minus_one_short", draw((128, 64, 128, 129), (4, 4, 128), Values::Normal, (Dense, Short), 7)),
    ]
}

#[test]
fn indexer_loss_and_gradients_are_within_bound() {
    let Some(ctx) = skip_unless_gpu("indexer_loss_and_gradients_are_within_bound") else { return };
    let stream = ctx.default_stream();
    let (name, cases, seed) = SUITE;
    let worst = run_suite(&stream, DSA_LOSS, run_config(name, cases, seed)).unwrap_or_else(|e| panic!("{e}"));
    println!("dsa_loss: worst error {worst:.3} of the bound");
}

/// The killing cases, in bf16 and f16.
#[test]
fn indexer_loss_named_edges() {
    let Some(ctx) = skip_unless_gpu("indexer_loss_named_edges") else { return };
    let stream = ctx.default_stream();
    for (name, draw) in killing_cases() {
        check_draw::<bf16>(&stream, DSA_LOSS, &draw).unwrap_or_else(|e| panic!("{name}: {e}"));
        let draw = LossDraw { dtype: Dtype::F16, ..draw };
        check_draw::<f16>(&stream, DSA_LOSS, &draw).unwrap_or_else(|e| panic!("{name} (f16): {e}"));
    }
}

/// The host wrapper gives the device run's bits (but `d_k_index`'s order), and refuses bad input with a typed error
/// before any launch, one test per kind.
#[test]
fn bad_input_is_a_typed_error() {
    let Some(ctx) = skip_unless_gpu("dsa_loss::bad_input_is_a_typed_error") else { return };
    let stream = ctx.default_stream();
    let base = draw((70, 4, 64, 9), (6, 2, 32), Values::Normal, (LseKind::Sparse, ListKind::Full), 11);
    let p = problem_of::<bf16>(&base);
    let inputs = LossInputs {
        q_index: p.q_index.view(),
        k_index: p.k_index.view(),
        weights: p.weights.view(),
        lists: p.lists.view(),
        query: p.query.view(),
        key: p.key.view(),
        lse: p.lse.view(),
        scale: p.scale,
    };
    let host = indexer_loss(&stream, DSA_LOSS, inputs).expect("a valid problem");
    let device = loss_guarded(&stream, DSA_LOSS, &p).expect("a valid problem");
    assert!(host.kl.iter().zip(&device.kl).all(|(a, b)| a.to_bits() == b.to_bits()), "host and device KL");
    assert!(host.d_q_index.iter().zip(&device.d_q_index).all(|(a, b)| a.to_bits() == b.to_bits()));
    let refuse = |inputs: LossInputs<'_, bf16>| indexer_loss(&stream, DSA_LOSS, inputs).err();
    let short_k = Array2::from_elem((69, 64), bf16::from_f32(0.5));
    assert!(matches!(
        refuse(LossInputs { k_index: short_k.view(), ..inputs }),
        Some(GpuError::Shape { argument: "k_index", .. })
    ));
    let wide_w = Array2::from_elem((70, 5), 1.0f32);
    assert!(matches!(
        refuse(LossInputs { weights: wide_w.view(), ..inputs }),
        Some(GpuError::Shape { argument: "weights", .. })
    ));
    let short_lse = Array2::from_elem((6, 69), 0.0f32);
    assert!(matches!(
        refuse(LossInputs { lse: short_lse.view(), ..inputs }),
        Some(GpuError::Shape { argument: "lse", .. })
    ));
    let odd_key = Array3::from_elem((70, 4, 32), bf16::from_f32(0.5));
    assert!(matches!(
        refuse(LossInputs { key: odd_key.view(), ..inputs }),
        Some(GpuError::Unsupported { argument: "n_heads", .. })
    ));
    assert!(matches!(
        refuse(LossInputs { scale: f32::NAN, ..inputs }),
        Some(GpuError::Unsupported { argument: "scale", .. })
    ));
    let odd_dim_q = Array3::from_elem((70, 6, 36), bf16::from_f32(0.5));
    let odd_dim_k = Array3::from_elem((70, 2, 36), bf16::from_f32(0.5));
    assert!(matches!(
        refuse(LossInputs { query: odd_dim_q.view(), key: odd_dim_k.view(), ..inputs }),
        Some(GpuError::Unsupported { argument: "head_dim", .. })
    ));
    // Lists: a future token, a duplicate, descending, a valid entry after the pad, out of range.
    let bad_list = |t: usize, slot: usize, value: i32| {
        let mut lists = p.lists.clone();
        lists[[t, slot]] = value;
        lists
    };
    for (lists, fault) in [
        (bad_list(3, 3, 4), "future"),
        (bad_list(20, 1, p.lists[[20, 0]]), "duplicate"),
        (bad_list(20, 2, p.lists[[20, 0]]), "descending"),
        (bad_list(2, 5, 1), "after the pad"),
        (bad_list(20, 0, -7), "negative"),
    ] {
        let e = refuse(LossInputs { lists: lists.view(), ..inputs });
        assert!(matches!(e, Some(GpuError::BlockList { .. })), "{fault}: {e:?}");
    }
    assert!(matches!(
        refuse(LossInputs { lists: bad_list(2, 5, 1).view(), ..inputs }),
        Some(GpuError::BlockList { position: [0, 0, 2, 5], fault: BlockListFault::AfterPad { index: 1 } })
    ));
    let mut inf_lse = p.lse.clone();
    inf_lse[[1, 4]] = f32::INFINITY;
    let e = refuse(LossInputs { lse: inf_lse.view(), ..inputs }).map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("lse"), "{e}");
    // The token-sparse forward's LSE of a token with an empty list is −∞: accepted there, and the row has no target.
    let (mut emptied, mut minus_inf) = (p.lists.clone(), p.lse.clone());
    emptied.row_mut(5).fill(-1);
    minus_inf.column_mut(5).fill(f32::NEG_INFINITY);
    let out = indexer_loss(&stream, DSA_LOSS, LossInputs { lists: emptied.view(), lse: minus_inf.view(), ..inputs })
        .expect("-inf LSE on an empty list");
    assert_eq!((out.kl[5], out.student_lse[5]), (0.0, f32::INFINITY));
    assert!(out.d_q_index.index_axis(ndarray::Axis(0), 5).iter().all(|&x| x == 0.0), "no gradient without target");
    minus_inf.column_mut(6).fill(f32::NEG_INFINITY);
    let e = refuse(LossInputs { lists: emptied.view(), lse: minus_inf.view(), ..inputs });
    assert!(e.is_some_and(|e| e.to_string().contains("lse")), "-inf LSE on a listed token is refused");
    let mut nan_q = p.query.clone();
    nan_q[[1, 1, 1]] = bf16::NAN;
    let e = refuse(LossInputs { query: nan_q.view(), ..inputs }).map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("query"), "{e}");
    let strided = Array2::from_elem((70, 128), bf16::from_f32(0.5));
    assert!(matches!(
        refuse(LossInputs { k_index: strided.slice(ndarray::s![.., ..;2]), ..inputs }),
        Some(GpuError::Stride { argument: "k_index", .. })
    ));
    // The device wrapper: a buffer too short.
    let shape = base.shape;
    let f32s = |n: usize| stream.alloc_zeros::<f32>(n).unwrap();
    let elems = |n: usize| stream.alloc_zeros::<bf16>(n).unwrap();
    let (qi, ki, q, k) =
        (elems(shape.indexer.q_len()), elems(shape.indexer.k_len()), elems(shape.query_len()), elems(shape.key_len()));
    let (w, lse) = (f32s(shape.indexer.weights_len()), f32s(shape.lse_len() - 1));
    let lists = stream.alloc_zeros::<i32>(shape.indexer.lists_len()).unwrap();
    let (mut st, mut te, mut kl, mut sl) = (f32s(shape.rows_len()), f32s(shape.rows_len()), f32s(70), f32s(70));
    let e = indexer_loss_device(
        &stream,
        DSA_LOSS,
        &shape,
        LossInputsDevice { q_index: &qi, k_index: &ki, weights: &w, lists: &lists, query: &q, key: &k, lse: &lse },
        LossRows { student: &mut st, teacher: &mut te, kl: &mut kl, student_lse: &mut sl },
        None::<LossGradients<'_>>,
    );
    assert!(matches!(e, Err(GpuError::BufferTooSmall { argument: "lse", .. })), "{e:?}");
}

/// Garbage device lists (unsorted, repeated, future, out of range) run without a fault: the kernels end each list at
/// its first entry that breaks the convention, and every output stays finite.
#[test]
fn garbage_device_lists_end_early() {
    let Some(ctx) = skip_unless_gpu("dsa_loss::garbage_device_lists_end_early") else { return };
    let stream = ctx.default_stream();
    let base = draw((67, 8, 64, 12), (4, 1, 64), Values::Normal, (LseKind::Dense, ListKind::Full), 12);
    let mut p = problem_of::<bf16>(&base);
    let values = [i32::MAX, -5, 1_000_000, 66, 0, 0];
    for (i, x) in p.lists.iter_mut().enumerate() {
        if i % 3 == 1 {
            *x = values[i % values.len()];
        }
    }
    let run = loss_guarded(&stream, DSA_LOSS, &p).expect("garbage lists run guarded");
    assert!(run.kl.iter().all(|x| x.is_finite()), "KL finite");
    assert!(run.d_k_index.iter().chain(&run.d_q_index).all(|x| x.is_finite()), "gradients finite");
}

/// Small shapes for compute-sanitizer (`run.sh sanitize`): MQA with a tail tile, GQA of 3 over a group of 66 (two
/// teacher chunks), the widest head dim, short and empty lists.
#[test]
fn sanitizer_shapes() {
    let Some(ctx) = skip_unless_gpu("dsa_loss::sanitizer_shapes") else { return };
    let stream = ctx.default_stream();
    for d in [
        draw((5, 3, 64, 8), (2, 1, 8), Values::Normal, (LseKind::Sparse, ListKind::Short), 3),
        draw((70, 5, 128, 66), (66, 1, 256), Values::ZeroLogits, (LseKind::Dense, ListKind::Full), 4),
        draw((65, 64, 64, 9), (9, 3, 40), Values::SignedWeights, (LseKind::Sparse, ListKind::Short), 5),
    ] {
        check_draw::<bf16>(&stream, DSA_LOSS, &d).unwrap_or_else(|e| panic!("{d:?}: {e}"));
    }
}
