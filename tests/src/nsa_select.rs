//! Verifying NSA's block selection (E19, E32: `attnproof_gpu::nsa::select`) against the oracle: the f32 block scores
//! within `attnproof_proofs::nsa_bound::block_score_bound` of the exact scores of the same inputs (the layer's
//! queries, the compressed keys and the compressed attention's LSE as the GPU stored them), the integer lists equal
//! entry for entry to the oracle's `select_blocks` run on the kernel's own f32 scores (ties included). The two checks
//! together explain every difference from the oracle's lists on the exact scores, so that needs no check of its own:
//! if the kernel keeps block `a` and leaves out block `b` that the exact scores rank higher, then its scores rank `a`
//! at least as high, `Ŝ_a ≥ Ŝ_b`, and with `|Ŝ − S| ≤ B` for both, `S_b − S_a ≤ B_a + B_b`: the swap is within the
//! two bounds. The verdict counts such lists (`lists_off_the_exact`) and the lists whose boundary is a tie of the
//! kernel's scores (`boundary_ties`), which the GPU tests require of the draws made for ties.
//!
//! [`selection_draws`] draws the layers (the paper's configuration, fla-core's, and short windows and blocks that
//! do not divide each other; forced blocks from none to three; lists of 1 to 32; GQA groups 1–16; keys made periodic
//! with the block length on purpose, so that whole blocks tie at the top-`n` boundary), [`select_guarded`] launches a
//! kernel text with poisoned lists and guard bands.

use std::sync::Arc;

use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::flash::{EXP_RELATIVE_ERROR, EXP_UNDERFLOW};
use attnproof_gpu::nsa::compressed::compressed_spec;
use attnproof_gpu::nsa::select::{Selection, lists_shape, scores_shape, select_device};
use attnproof_oracle::nsa::{NsaConfig, select_blocks, selection_blocks};
use attnproof_oracle::spec::{Layout, strided_causal_keys};
use attnproof_oracle::{AttentionSpec, Sequence};
use attnproof_proofs::flash_bound::Accumulation;
use attnproof_proofs::nsa_bound::{SelectionRecipe, WindowTerm, block_score_bound};
use cudarc::driver::CudaStream;
use ndarray::{Array3, ArrayD, ArrayViewD, Axis, Slice};
use proptest::prelude::*;

use crate::candidate::{GUARD_BITS_32, LaunchError, Storage, poisoned, unchanged, unguard, upload};
use crate::flash::{Case, HarnessError};
use crate::nsa::{causal_layer, self_attention_layout};

/// Failures listed in a verdict (the rest are counted).
const REPORTED: usize = 8;

/// The selection kernel's recipe (`gpu/kernels/nsa_select.cu`'s header): tensor-core dot products over `head_dim`
/// columns, `ex2.approx.ftz`.
pub fn selection_recipe(head_dim: usize) -> SelectionRecipe {
    SelectionRecipe {
        dot_gamma: Accumulation::TensorCore { k_step: 16 }.gamma(head_dim),
        exp_error: EXP_RELATIVE_ERROR,
        exp_underflow: EXP_UNDERFLOW,
    }
}

/// The verdict of one selection.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SelectionVerdict {
    /// Block scores compared.
    pub scores: usize,
    /// The largest `|Ŝ − S| / bound` over scores with a non-zero bound.
    pub worst_ratio: f64,
    /// Lists (token, KV head) compared.
    pub lists: usize,
    /// Lists that differ from the oracle's on the kernel's own scores.
    pub list_mismatches: usize,
    /// Lists that differ from the oracle's on the exact scores (each such swap is explained by the bounds, see the
    /// module docs): how often rounding moved the top-n boundary.
    pub lists_off_the_exact: usize,
    /// Lists whose last chosen block ties (equal f32 scores) with a block left out: ties at the top-`n` boundary.
    pub boundary_ties: usize,
    /// What failed, the first few.
    pub failures: Vec<String>,
}

impl SelectionVerdict {
    /// Whether every check held.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    fn fail(&mut self, what: impl FnOnce() -> String) {
        if self.failures.len() < REPORTED {
            self.failures.push(what());
        } else if self.failures.len() == REPORTED {
            self.failures.push("…".into());
        }
    }
}

/// The first token row of `seq` in the scores and lists: `b·L` dense, `cu_seqlens_q[b]` varlen.
fn token_row0(spec: &AttentionSpec, seq: &Sequence) -> usize {
    match spec.layout {
        Layout::Dense { len_q, .. } => seq.index * len_q,
        Layout::Varlen { .. } => seq.q_start,
    }
}

/// The exact block scores of one sequence `[T, Hkv, M]` and their bounds, from the widened inputs.
pub fn exact_scores(
    compressed: &AttentionSpec,
    config: &NsaConfig,
    seq: &Sequence,
    [q, k_cmp, lse]: [ArrayViewD<'_, f64>; 3],
) -> Result<(Array3<f64>, Array3<f64>), HarnessError> {
    let (len, windows) = (seq.len_q, seq.len_k);
    let n_blocks = selection_blocks(len, config.select_block)?;
    let (hkv, group, d) = (compressed.n_heads_kv, compressed.group_size(), compressed.head_dim);
    let alpha = config.scale_value::<f64>(d, ());
    let recipe = selection_recipe(d);
    let mut truth = Array3::zeros((len, hkv, n_blocks));
    let mut bounds = Array3::zeros((len, hkv, n_blocks));
    for kv in 0..hkv {
        let keys = compressed.head_rows(k_cmp.view(), seq, kv, true);
        let key_abs = keys.mapv(f64::abs);
        for t in 0..len {
            let seen = strided_causal_keys(t, config.compress_len, config.compress_stride).min(windows);
            let mut terms: Vec<Vec<WindowTerm>> = vec![vec![]; n_blocks];
            let mut window_counts = vec![0usize; n_blocks];
            for c in 0..seen {
                for j in 0..n_blocks {
                    if config.window_block_overlap(c, j) > 0 {
                        window_counts[j] += 1;
                    }
                }
            }
            for h in kv * group..(kv + 1) * group {
                let row_lse = compressed.head_row_stat(lse.view(), seq, h)[t];
                if row_lse == f64::NEG_INFINITY {
                    continue;
                }
                let query = compressed.head_rows(q.view(), seq, h, false).row(t).to_owned();
                let query_abs = query.mapv(f64::abs);
                for c in 0..seen {
                    let exponent = alpha * query.dot(&keys.row(c)) - row_lse;
                    let magnitude = alpha.abs() * query_abs.dot(&key_abs.row(c));
                    let probability = exponent.exp();
                    for j in 0..n_blocks {
                        let overlap = config.window_block_overlap(c, j);
                        if overlap == 0 {
                            continue;
                        }
                        let weight = overlap as f64 / config.compress_stride as f64;
                        truth[[t, kv, j]] += weight * probability;
                        terms[j].push(WindowTerm { weight, probability, exponent, magnitude, lse: row_lse });
                    }
                }
            }
            for j in 0..n_blocks {
                bounds[[t, kv, j]] = block_score_bound(&terms[j], group, window_counts[j], recipe);
            }
        }
    }
    Ok((truth, bounds))
}

/// Verifies `selection` as the block scores and lists of the layer `layer` under `config`, for the queries `q` (the
/// layer's), compressed keys `k_cmp` and compressed-attention LSE `lse` the kernel was given.
pub fn verify_selection<T: Storage>(
    layer: &AttentionSpec,
    config: &NsaConfig,
    q: ArrayViewD<'_, T>,
    k_cmp: ArrayViewD<'_, T>,
    lse: ArrayViewD<'_, f32>,
    selection: &Selection,
) -> Result<SelectionVerdict, HarnessError> {
    let compressed = compressed_spec(layer, config)?;
    let expected_scores = scores_shape(layer, config)?;
    for (argument, expected, actual) in [
        ("scores", expected_scores.to_vec(), selection.scores.shape().to_vec()),
        ("lists", lists_shape(layer, config).to_vec(), selection.lists.shape().to_vec()),
    ] {
        if expected != actual {
            return Err(HarnessError::CandidateShape { argument, expected, actual });
        }
    }
    let widen = |x: ArrayViewD<'_, T>| x.mapv(|v| f64::from(v.to_f32()));
    let (q, k_cmp, lse) = (widen(q), widen(k_cmp), lse.mapv(f64::from));
    let columns = expected_scores[2];
    let mut verdict = SelectionVerdict::default();
    for (seq, layer_seq) in compressed.sequences().iter().zip(layer.sequences()) {
        let row0 = token_row0(layer, &layer_seq);
        let len = seq.len_q;
        let (truth, bounds) = exact_scores(&compressed, config, seq, [q.view(), k_cmp.view(), lse.view()])?;
        let n_blocks = truth.dim().2;
        let got = selection.scores.slice_axis(Axis(0), Slice::from(row0..row0 + len));
        // The scores: within the bound of the exact ones; 0 past the sequence's own blocks.
        for ((t, kv, j), &value) in got.indexed_iter() {
            let value = f64::from(value);
            if j >= n_blocks {
                if value != 0.0 {
                    verdict.fail(|| format!("scores[{}, {kv}, {j}] = {value:e} past the sequence's blocks", row0 + t));
                }
                continue;
            }
            verdict.scores += 1;
            let (exact, bound) = (truth[[t, kv, j]], bounds[[t, kv, j]]);
            let error = (value - exact).abs();
            if bound > 0.0 && error.is_finite() {
                verdict.worst_ratio = verdict.worst_ratio.max(error / bound);
            }
            let within = error <= bound;
            if !within {
                verdict.fail(|| {
                    format!(
                        "scores[{}, {kv}, {j}] (sequence {}, token {t}): {value:e} against {exact:e}, bound {bound:e}",
                        row0 + t,
                        seq.index
                    )
                });
            }
        }
        if columns < n_blocks {
            let actual = selection.scores.shape().to_vec();
            return Err(HarnessError::CandidateShape {
                argument: "scores",
                expected: vec![actual[0], actual[1], n_blocks],
                actual,
            });
        }
        // The lists: the oracle's on the kernel's own scores, entry for entry.
        let own: Array3<f64> = got.slice_axis(Axis(2), Slice::from(..n_blocks)).mapv(f64::from);
        let from_own = select_blocks(own.view(), config)?;
        let from_truth = select_blocks(truth.view(), config)?;
        let lists = selection.lists.slice_axis(Axis(0), Slice::from(row0..row0 + len));
        for t in 0..len {
            for kv in 0..compressed.n_heads_kv {
                verdict.lists += 1;
                let gpu: Vec<i32> = lists.index_axis(Axis(0), t).row(kv).to_vec();
                let want: Vec<i32> = from_own.index_axis(Axis(0), t).row(kv).to_vec();
                if gpu != want {
                    verdict.list_mismatches += 1;
                    verdict.fail(|| {
                        format!(
                            "lists[{}, {kv}] (sequence {}, token {t}): {gpu:?}, the oracle on these scores {want:?}",
                            row0 + t,
                            seq.index
                        )
                    });
                }
                if boundary_tie(&own.index_axis(Axis(0), t).row(kv).to_vec(), &gpu, config, t) {
                    verdict.boundary_ties += 1;
                }
                if lists.index_axis(Axis(0), t).row(kv) != from_truth.index_axis(Axis(0), t).row(kv) {
                    verdict.lists_off_the_exact += 1;
                }
            }
        }
    }
    Ok(verdict)
}

/// Whether a candidate block left out of token `t`'s `list` has the same score as the lowest-scored candidate in it
/// (the kernel's scores `row`): a tie at the top-`n` boundary. The forced blocks (the first `n_forced_initial` and
/// the `n_forced_local` most recent eligible ones) are in every list whatever they score, so they take no part: the
/// first block, with one window fewer than the others, scores lowest and would hide every tie.
fn boundary_tie(row: &[f64], list: &[i32], config: &NsaConfig, t: usize) -> bool {
    let eligible = (t / config.select_block + 1).min(row.len());
    let forced = |j: usize| j < config.n_forced_initial || j + config.n_forced_local >= eligible;
    let candidate = |j: usize| j < eligible && !forced(j);
    let chosen: Vec<usize> = list.iter().filter_map(|&j| usize::try_from(j).ok()).filter(|&j| candidate(j)).collect();
    let Some(&last) = chosen.iter().min_by(|&&a, &&b| row[a].total_cmp(&row[b])) else {
        return false;
    };
    (0..eligible).any(|j| candidate(j) && !chosen.contains(&j) && row[j] == row[last])
}

/// Runs the selection kernel text `kernel` on the layer's queries, compressed keys and LSE through the device
/// wrapper into poisoned lists and scores followed by guard bands; checks the guards and that the inputs are
/// unchanged on the device.
pub fn select_guarded<T: Storage>(
    stream: &Arc<CudaStream>,
    layer: &AttentionSpec,
    config: &NsaConfig,
    kernel: KernelSource,
    [q, k_cmp]: [&ArrayD<T>; 2],
    lse: &ArrayD<f32>,
) -> Result<Selection, LaunchError> {
    let (dq, dk, dl) = (upload(stream, q)?, upload(stream, k_cmp)?, upload(stream, lse)?);
    let s_shape = scores_shape(layer, config)?;
    let l_shape = lists_shape(layer, config);
    let (ns, nl) = (s_shape.iter().product::<usize>(), l_shape.iter().product::<usize>());
    let guard32 = f32::from_bits(GUARD_BITS_32);
    // A list entry no kernel writes: neither a block nor −1.
    const LIST_POISON: i32 = -0x5a5a_5a5b;
    const LIST_GUARD: i32 = 0x7fa5_a5a5;
    let mut scores = poisoned(stream, ns, f32::NAN, guard32)?;
    let mut lists = poisoned(stream, nl, LIST_POISON, LIST_GUARD)?;
    select_device(stream, layer, config, kernel, &dq, &dk, &dl, &mut scores, &mut lists)?;
    let driver = |e: cudarc::driver::DriverError| LaunchError::Driver(e.to_string());
    let scores_back = stream.clone_dtoh(&scores).map_err(driver)?;
    let lists_back = stream.clone_dtoh(&lists).map_err(driver)?;
    let inputs_back = [stream.clone_dtoh(&dq).map_err(driver)?, stream.clone_dtoh(&dk).map_err(driver)?];
    let lse_back = stream.clone_dtoh(&dl).map_err(driver)?;
    stream.synchronize().map_err(driver)?;
    unchanged(&[("q", q), ("k_cmp", k_cmp)], &inputs_back)?;
    if lse_back.iter().zip(lse.iter()).any(|(a, b)| a.to_bits() != b.to_bits()) {
        return Err(LaunchError::InputChanged { input: "lse" });
    }
    let scores = unguard("scores", scores_back, ns, &s_shape, |v: f32| v.to_bits() == GUARD_BITS_32)?;
    let lists = unguard("lists", lists_back, nl, &l_shape, |v: i32| v == LIST_GUARD)?;
    let scores = scores.into_dimensionality::<ndarray::Ix3>().expect("rank 3");
    let lists = lists.into_dimensionality::<ndarray::Ix3>().expect("rank 3");
    Ok(Selection { scores, lists })
}

/// A drawn NSA layer for the selection: the layer's spec, NSA's configuration, how its inputs are made, and whether
/// its keys repeat with the selection block's period (every sequence's token `t` takes token `t mod l'`'s key), which
/// makes whole blocks score alike and ties at the top-`n` boundary certain.
#[derive(Clone, Debug)]
pub struct SelectionDraw {
    /// The layer: causal, `Lq = Lk` per sequence.
    pub layer: AttentionSpec,
    /// Windows, blocks, list width and forced blocks (the means for both maps).
    pub config: NsaConfig,
    /// How Q, K and V are made.
    pub profile: crate::generate::ValueProfile,
    /// Their seed.
    pub seed: u64,
    /// Keys periodic with the block length.
    pub periodic_keys: bool,
}

/// Layers for the selection: the paper's configuration (`l = 32, s = 16, l' = 64`, 16 blocks, forced first and two
/// local ones) half the time, fla-core's (`l = s = l' = 64`), and short windows and blocks that do not divide each
/// other; lists of 1 to 32 entries with 0–2 forced initial and 0–3 forced local blocks; lengths with no window, around
/// a block, a few hundred tokens and past one 64-window tile of compressed keys (1100 tokens at `s = 16`); GQA groups
/// 1–16 uniformly over one or two KV heads; E31's head dims and others; periodic keys one draw in three.
pub fn selection_draws() -> impl Strategy<Value = SelectionDraw> {
    let shape = prop_oneof![
        4 => Just((32usize, 16usize, 64usize)),
        1 => Just((64, 64, 64)),
        1 => Just((8, 4, 16)),
        1 => Just((5, 3, 8)),
        1 => Just((16, 16, 32)),
    ];
    let lists = prop_oneof![
        1 => Just((16usize, 1usize, 2usize)),
        1 => (0usize..=2, 0usize..=3).prop_flat_map(|(fi, fl)| ((fi + fl).max(1)..=32, Just(fi), Just(fl))),
    ];
    let dims = prop_oneof![
        3 => prop::sample::select(vec![(64usize, 64usize), (128, 128), (192, 128)]),
        1 => ((1usize..=32).prop_map(|m| 8 * m), Just(64usize)),
    ];
    (shape, lists, dims)
        .prop_flat_map(|((l, s, block), lists, dims)| {
            let length =
                prop::sample::select(vec![0, 1, l - 1, l, block - 1, block, block + 1, 2 * block + 1, 300, 1100]);
            (
                Just(((l, s, block), lists, dims)),
                self_attention_layout(length),
                (1usize..=16, 1usize..=2).prop_map(|(group, n_heads_kv)| (group * n_heads_kv, n_heads_kv)),
                crate::strategies::profile(),
                any::<u64>(),
                prop::bool::weighted(1.0 / 3.0),
            )
        })
        .prop_map(|(((l, s, block), (n, fi, fl), dims), layout, heads, profile, seed, periodic_keys)| {
            let layer = causal_layer(layout, heads, dims);
            let config = NsaConfig {
                compress_len: l,
                compress_stride: s,
                select_block: block,
                n_selected: n,
                n_forced_initial: fi,
                n_forced_local: fl,
                ..NsaConfig::default()
            };
            SelectionDraw { layer, config, profile, seed, periodic_keys }
        })
}

/// The layer's case for `draw` from `seed`: Q, K, V from the draw's profile, K made periodic when the draw says so.
pub fn selection_case<T: Storage>(draw: &SelectionDraw, seed: u64) -> Case<T> {
    let mut case = crate::generate::make_case::<T>(&draw.layer, draw.profile, seed);
    if draw.periodic_keys {
        let period = draw.config.select_block;
        let spec = case.spec.clone();
        for seq in spec.sequences() {
            for head in 0..spec.n_heads_kv {
                let mut rows = case.k.slice_mut(spec.head_slice(&seq, head, true));
                let mut rows = rows.view_mut().into_dimensionality::<ndarray::Ix2>().expect("rank 2");
                for t in period..rows.nrows() {
                    let source = rows.row(t % period).to_owned();
                    rows.row_mut(t).assign(&source);
                }
            }
        }
    }
    case
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_gpu::nsa::compress::compressed_shape;
    use attnproof_oracle::spec::Operand;
    use half::bf16;

    /// A tie at the boundary is between candidates only: the forced first block scoring lowest hides nothing, a
    /// left-out candidate equal to the lowest chosen candidate is a tie, and one equal to a forced block is not.
    #[test]
    fn boundary_ties_are_among_the_candidates() {
        // Token 400 with blocks of 64: blocks 0..=6 eligible, 0 forced first, 5 and 6 forced local, 1..=4 candidates.
        let config = NsaConfig { n_selected: 5, n_forced_initial: 1, n_forced_local: 2, ..NsaConfig::default() };
        let tied = [0.1, 3.0, 2.0, 2.0, 1.0, 0.5, 0.7];
        assert!(boundary_tie(&tied, &[0, 1, 2, 5, 6], &config, 400));
        assert!(!boundary_tie(&tied, &[0, 1, 5, 6, -1], &config, 400), "no candidate left out ties block 1");
        let untied = [0.1, 3.0, 2.0, 1.5, 1.0, 2.0, 0.7];
        assert!(!boundary_tie(&untied, &[0, 1, 2, 5, 6], &config, 400), "block 5 ties block 2 but is forced");
        // Before the token reaches block 6, block 4 and 5 are the local ones.
        assert!(!boundary_tie(&[0.1, 3.0, 2.0, 1.0, 2.0, 1.0, 0.0], &[0, 1, 2, 4, 5], &config, 370));
    }

    /// A selection made from the exact scores rounded to f32 (and the oracle's lists on them) passes; a list entry
    /// changed, a score moved by twice its bound, a block past the sequence written, or a swap against the exact
    /// lists beyond the bounds fails.
    #[test]
    fn the_verifier_accepts_exact_selections_and_rejects_each_kind_of_fault() {
        let cu = vec![0, 400, 400, 500];
        let layer = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu },
            ..AttentionSpec::dense(1, 6, 2, 1, 1, 16, 16).with_mask(attnproof_oracle::Mask::Causal)
        };
        let config = NsaConfig { n_selected: 4, n_forced_initial: 1, n_forced_local: 1, ..NsaConfig::default() };
        let compressed = compressed_spec(&layer, &config).unwrap();
        let draw = |shape: Vec<usize>, salt| {
            let n = shape.iter().product();
            let values = crate::generate::draw(salt, n, crate::generate::Distribution::Gaussian);
            ArrayD::from_shape_vec(shape, values.iter().map(|&v| bf16::from_f64(2.0 * v)).collect()).unwrap()
        };
        let q = draw(layer.expected_shape(Operand::Q), 1);
        let k_cmp = draw(compressed_shape(&layer, &config, Operand::K).unwrap(), 2);
        let lse_shape = compressed.expected_shape(Operand::RowStat);
        let lse = ArrayD::from_shape_vec(
            lse_shape.clone(),
            (0..lse_shape.iter().product()).map(|i| (i % 7) as f32 * 0.5).collect(),
        )
        .unwrap();
        // The exact scores per sequence, rounded to f32, and the oracle's lists on them.
        let [rows, heads, columns] = scores_shape(&layer, &config).unwrap();
        let mut scores = Array3::<f32>::zeros((rows, heads, columns));
        let mut lists = Array3::<i32>::zeros((rows, heads, config.n_selected));
        let widen = |x: &ArrayD<bf16>| x.mapv(|v| f64::from(v.to_f32()));
        let (qw, kw, lw) = (widen(&q), widen(&k_cmp), lse.mapv(f64::from));
        for (seq, layer_seq) in compressed.sequences().iter().zip(layer.sequences()) {
            let row0 = token_row0(&layer, &layer_seq);
            let (truth, _) = exact_scores(&compressed, &config, seq, [qw.view(), kw.view(), lw.view()]).unwrap();
            let rounded = truth.mapv(|x| x as f32);
            let picked = select_blocks(rounded.mapv(f64::from).view(), &config).unwrap();
            let n = truth.dim().2;
            scores
                .slice_axis_mut(Axis(0), Slice::from(row0..row0 + seq.len_q))
                .slice_axis_mut(Axis(2), Slice::from(..n))
                .assign(&rounded);
            lists.slice_axis_mut(Axis(0), Slice::from(row0..row0 + seq.len_q)).assign(&picked);
        }
        let good = Selection { scores, lists };
        let verify = |s: &Selection| verify_selection(&layer, &config, q.view(), k_cmp.view(), lse.view(), s).unwrap();
        let verdict = verify(&good);
        assert!(verdict.passed(), "{:?}", verdict.failures);
        assert_eq!(verdict.lists, 500 * 2);
        assert!(verdict.worst_ratio < 1.0);
        // Token 149 of the first sequence (row 149) has blocks 0, 1, 2 eligible: a list of 3 and a −1.
        assert_eq!(good.lists.index_axis(Axis(0), 149).row(0).to_vec(), vec![0, 1, 2, -1]);
        let mut wrong_list = good.clone();
        wrong_list.lists[[149, 1, 1]] = 2;
        wrong_list.lists[[149, 1, 2]] = -1;
        assert!(!verify(&wrong_list).passed());
        let mut moved = good.clone();
        moved.scores[[120, 0, 1]] *= 1.01;
        assert!(!verify(&moved).passed(), "a score off by 1%");
        let mut past = good.clone();
        past.scores[[450, 0, columns - 1]] = 1.0;
        assert!(!verify(&past).passed(), "a block past the second sequence's two");
        // Scores that put the weakest candidate of token 390 (blocks 1 to 5 compete for two places) far above the
        // rest, and lists that follow them: the scores fail their bound, the lists match those scores and differ
        // from the exact lists.
        let mut swapped = good.clone();
        let row = 390;
        let weakest = (1..6).min_by(|&a, &b| good.scores[[row, 0, a]].total_cmp(&good.scores[[row, 0, b]])).unwrap();
        swapped.scores[[row, 0, weakest]] = 1e6;
        let picked =
            select_blocks(swapped.scores.slice_axis(Axis(0), Slice::from(0..400)).mapv(f64::from).view(), &config)
                .unwrap();
        swapped.lists.slice_axis_mut(Axis(0), Slice::from(0..400)).assign(&picked);
        assert!(swapped.lists.index_axis(Axis(0), row).row(0).to_vec().contains(&(weakest as i32)));
        let verdict = verify(&swapped);
        assert!(!verdict.passed());
        assert_eq!((verdict.list_mismatches, verdict.lists_off_the_exact), (0, 1), "{:?}", verdict.failures);
        assert_eq!(verify(&good).lists_off_the_exact, 0);
    }
}
