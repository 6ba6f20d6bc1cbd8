//! Proptest strategies for shapes and values: batch, GQA groups 1–16 over one or two KV heads,
//! `Lq ≠ Lk` both ways, lengths 1, tile − 1, tile, tile + 1 and primes, head dims every multiple
//! of 8 up to 256 and the awkward 1, 59 and 111, every mask kind with windows of every width
//! class relative to the tile, varlen with zero-length sequences, and the value profiles of
//! [`crate::generate`]; HiLS's draws ([`hils_draws`]). Built with `prop_flat_map` so dependent sizes shrink
//! together; the unit test below draws specs and checks that every class is reached.

use attnproof_oracle::hils::{ChunkMass, HilsConfig};
use attnproof_oracle::{AttentionSpec, Layout, Mask, Scale};
use attnproof_reference::Element;
use ndarray::{Array4, Axis};
use proptest::prelude::*;

use crate::flash::Case;
use crate::generate::{Distribution, ValueProfile, make_case};
use crate::hils_routing::first_query_landmarks;

/// Sequence lengths that break weak schedules for tile `tile`: 1, tile ± 1, tile, 2·tile + 1,
/// and primes.
pub fn interesting_length(tile: usize) -> impl Strategy<Value = usize> {
    prop::sample::select(vec![1, 2, tile - 1, tile, tile + 1, 2 * tile + 1, 7, 13, 31, 61, 67])
}

/// Head dimensions: every multiple of 8 from 8 to 256 (what the GPU kernels compile), the awkward 1, 59 and 111
/// (which only the reference and the oracle accept), and small dims often, which keeps CPU cases cheap.
pub fn head_dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        2 => (1usize..=32).prop_map(|m| 8 * m),
        1 => prop::sample::select(vec![1, 59, 111]),
        1 => prop::sample::select(vec![8, 16]),
    ]
}

/// One side of a sliding window, by width class relative to tile size `tile`: none (0), narrow (1), inside a tile,
/// exactly a tile, and wider than a tile (up to three tiles).
pub fn window_side(tile: usize) -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), Just(1usize), 2..tile.max(3), Just(tile), (tile + 1)..=(3 * tile)]
}

/// Every mask kind, with windows of every width class relative to tile size `tile` on either side (so one-sided
/// windows, narrow ones and ones wider than a tile all occur), with and without causal, and NSA's strided causal
/// mask ([`strided_causal`]).
pub fn mask(tile: usize) -> impl Strategy<Value = Mask> {
    let window = || (window_side(tile), window_side(tile));
    // Causal and windowed masks as often as before the strided one joined (three in four draws), no mask and the
    // strided one an eighth each.
    prop_oneof![
        1 => Just(Mask::None),
        2 => Just(Mask::Causal),
        2 => window().prop_map(|(left, right)| Mask::Window { left, right }),
        2 => window().prop_map(|(left, right)| Mask::And(vec![Mask::Causal, Mask::Window { left, right }])),
        1 => strided_causal(tile),
    ]
}

/// NSA's compressed-branch mask (E18) with window lengths from 1 to beyond a tile and strides from 1 to a quarter
/// tile: overlapping windows (the paper's `l = 32, s = 16`), adjacent ones (`l = s`), gaps between them (`l < s`),
/// and windows wider than a KV tile, so that a query tile's first visible window lies tiles after its rows.
pub fn strided_causal(tile: usize) -> impl Strategy<Value = Mask> {
    let len = prop_oneof![1usize..=4, Just(tile / 2), Just(tile), Just(tile + 1)];
    let stride = prop_oneof![1usize..=3, Just((tile / 4).max(1)), Just(tile / 2)];
    (len, stride).prop_map(|(len, stride)| Mask::StridedCausal { len: len.max(1), stride: stride.max(1) })
}

/// `(Hq, Hkv)`: one KV head shared by a group of 1 to 16 query heads (MQA above 1), or two KV heads with groups of 1
/// to 8 (`Hq ≤ 16`, which bounds the CPU cost); non-powers of two included, groups up to 4 four times as often as
/// larger ones. The group's range depends on the KV heads drawn, hence `prop_flat_map`.
pub fn heads() -> impl Strategy<Value = (usize, usize)> {
    (1usize..=2).prop_flat_map(|n_heads_kv| {
        let largest = 16 / n_heads_kv;
        prop_oneof![4 => 1usize..=4, 1 => 5usize..=largest].prop_map(move |group| (group * n_heads_kv, n_heads_kv))
    })
}

/// Dense (batch 1–2) or varlen (1–3 sequences, zero-length ones included) layouts with lengths
/// drawn around tile size `tile`, dense three times out of four.
pub fn layout(tile: usize) -> impl Strategy<Value = Layout> {
    let dense = (1usize..=2, interesting_length(tile), interesting_length(tile))
        .prop_map(|(batch, len_q, len_k)| Layout::Dense { batch, len_q, len_k });
    let varlen = prop::collection::vec(
        (prop_oneof![Just(0usize), interesting_length(tile)], prop_oneof![Just(0usize), interesting_length(tile)]),
        1..=3,
    )
    .prop_map(|lens| {
        let (mut cu_q, mut cu_k) = (vec![0i32], vec![0i32]);
        for (lq, lk) in lens {
            cu_q.push(cu_q.last().copied().unwrap_or(0) + lq as i32);
            cu_k.push(cu_k.last().copied().unwrap_or(0) + lk as i32);
        }
        Layout::Varlen { cu_seqlens_q: cu_q, cu_seqlens_k: cu_k }
    });
    prop_oneof![3 => dense, 1 => varlen]
}

/// A problem spec with lengths drawn around tile size `tile` (at most `2·tile + 1`). Under NSA's strided causal mask
/// the keys are the compression windows of the queries, as in NSA's compressed branch: each sequence's key length
/// becomes its complete windows, plus one key that never completes when the drawn key length was odd.
pub fn spec(tile: usize) -> impl Strategy<Value = AttentionSpec> {
    (layout(tile), heads(), head_dim(), head_dim(), mask(tile)).prop_map(
        |(layout, (n_heads_q, n_heads_kv), head_dim, head_dim_v, mask)| {
            let layout = match mask {
                Mask::StridedCausal { len, stride } => windows_as_keys(layout, len, stride),
                _ => layout,
            };
            AttentionSpec {
                layout,
                n_heads_q,
                n_heads_kv,
                head_dim,
                head_dim_v,
                scale: Scale::InverseSqrtHeadDim,
                mask,
            }
        },
    )
}

/// `layout` with each sequence's key length replaced by the complete windows of `len` tokens every `stride` in its
/// queries, plus one when the key length was odd (a deterministic function of the draw, so shrinking stays simple).
fn windows_as_keys(layout: Layout, len: usize, stride: usize) -> Layout {
    let keys = |len_q: usize, len_k: usize| {
        attnproof_oracle::spec::strided_causal_keys(len_q.saturating_sub(1), len, stride) * usize::from(len_q > 0)
            + len_k % 2
    };
    match layout {
        Layout::Dense { batch, len_q, len_k } => Layout::Dense { batch, len_q, len_k: keys(len_q, len_k) },
        Layout::Varlen { cu_seqlens_q, cu_seqlens_k } => {
            let mut cu_k = vec![0i32];
            for (q, k) in cu_seqlens_q.windows(2).zip(cu_seqlens_k.windows(2)) {
                let added = keys((q[1] - q[0]) as usize, (k[1] - k[0]) as usize) as i32;
                cu_k.push(cu_k.last().copied().unwrap_or(0) + added);
            }
            Layout::Varlen { cu_seqlens_q, cu_seqlens_k: cu_k }
        }
    }
}

/// Value profiles: Gaussian, heavy tails, peaked rows, maximum in the last KV tile; logit scales
/// from 0.5 up to 100; value means 0 or 3.
pub fn profile() -> impl Strategy<Value = ValueProfile> {
    (
        prop::sample::select(vec![
            Distribution::Gaussian,
            Distribution::HeavyTail,
            Distribution::Peaked,
            Distribution::MaxInLastTile,
        ]),
        prop::sample::select(vec![0.5, 1.0, 4.0, 20.0, 100.0]),
        prop::sample::select(vec![0.0, 3.0]),
    )
        .prop_map(|(distribution, logit_scale, value_mean)| ValueProfile { distribution, logit_scale, value_mean })
}

/// One HiLS draw (E21): causal self-attention, the config, how retrieved chunks weigh in the output, the values, their
/// seed, and whether chunk 2 repeats chunk 0 (keys and landmark) so that their router scores tie for every query.
#[derive(Clone, Debug)]
pub struct HilsDraw {
    /// Causal self-attention.
    pub spec: AttentionSpec,
    /// `C`, `w`, `K`.
    pub config: HilsConfig,
    /// The chunks' log-mass in the factorized output.
    pub mass: ChunkMass,
    /// Values.
    pub profile: ValueProfile,
    /// Seed of the values.
    pub seed: u64,
    /// Twin chunks 0 and 2.
    pub twins: bool,
}

/// HiLS's problems: causal self-attention over 0 to 700 tokens (dense, or varlen with an empty sequence), GQA groups
/// of 1 to 16, head dims and value head dims 8 to 256 (multiples of 8, the GPU kernels' domain); chunk sizes 1 to 100
/// and windows below, at and above a chunk; routing widths 1 to 32 (wider than the eligible chunks too); both masses;
/// the value profiles of [`profile`]; twin chunks in about a third of the draws.
pub fn hils_draws() -> impl Strategy<Value = HilsDraw> {
    let heads = prop::sample::select(vec![(1usize, 1usize), (2, 1), (3, 1), (4, 2), (5, 5), (6, 3), (16, 1)]);
    let dims =
        prop::sample::select(vec![(8usize, 8usize), (16, 8), (64, 40), (72, 72), (128, 128), (256, 256), (32, 256)]);
    let layout = (1usize..=2, 0usize..=700, any::<bool>()).prop_map(|(b, n, packed)| {
        if packed {
            let cu = vec![0, n as i32, n as i32, (n + n / 3) as i32];
            Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu }
        } else {
            Layout::Dense { batch: b, len_q: n, len_k: n }
        }
    });
    let chunk = prop::sample::select(vec![1usize, 7, 16, 64, 100]);
    (layout, heads, dims, chunk).prop_flat_map(|(layout, (hq, hkv), (d, dv), chunk)| {
        let spec = AttentionSpec { layout, ..AttentionSpec::dense(1, hq, hkv, 1, 1, d, dv).with_mask(Mask::Causal) };
        let window = prop::sample::select(vec![1usize, chunk.saturating_sub(1).max(1), chunk, 3 * chunk + 5, 200]);
        let width = prop::sample::select(vec![1usize, 3, 8, 32]);
        let mass = prop::sample::select(vec![ChunkMass::Surrogate, ChunkMass::Exact]);
        (Just(spec), Just(chunk), window, width, mass, profile(), any::<u64>(), prop::bool::weighted(0.3)).prop_map(
            |(spec, chunk_size, local_window, retrieved_chunks, mass, profile, seed, twins)| HilsDraw {
                spec,
                config: HilsConfig { chunk_size, local_window, retrieved_chunks },
                mass,
                profile,
                seed,
                twins,
            },
        )
    })
}

impl HilsDraw {
    /// The draw's case and landmarks `[B, Hq, n_c, d]`: the generated values, landmarks from each chunk's first query
    /// ([`crate::hils_routing::first_query_landmarks`]), and with `twins` chunk 2 made a copy of chunk 0 (keys of
    /// every KV head, landmark of every query head) in every sequence long enough.
    pub fn case<T: Element>(&self) -> (Case<T>, Array4<T>) {
        let mut case = make_case::<T>(&self.spec, self.profile, self.seed);
        let c = self.config.chunk_size;
        let mut landmarks = first_query_landmarks(&case, self.config);
        if self.twins {
            let spec = case.spec.clone();
            for seq in spec.sequences().iter().filter(|s| s.len_k >= 3 * c) {
                for kv in 0..spec.n_heads_kv {
                    let mut keys = case.k.slice_mut(spec.head_slice(seq, kv, true));
                    for j in 0..c {
                        let row = keys.index_axis(Axis(0), j).to_owned();
                        keys.index_axis_mut(Axis(0), 2 * c + j).assign(&row);
                    }
                }
                for h in 0..spec.n_heads_q {
                    let row = landmarks.index_axis(Axis(0), seq.index).index_axis(Axis(0), h).row(0).to_owned();
                    landmarks.index_axis_mut(Axis(0), seq.index).index_axis_mut(Axis(0), h).row_mut(2).assign(&row);
                }
            }
        }
        (case, landmarks)
    }
}

/// The proptest configuration of a harness suite: `default_cases` unless `PROPTEST_CASES` is set
/// (so that `cargo xtask fuzz` and the mutation runner can change the budget), failures persisted
/// to `proptest-regressions/<suite>.txt` in the harness package (commit those files; each
/// regression also becomes a named test).
pub fn suite_config(suite: &str, default_cases: u32) -> proptest::test_runner::Config {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default_cases);
    proptest::test_runner::Config {
        cases,
        max_global_rejects: 4 * cases.max(64),
        failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::Direct(Box::leak(
            format!("proptest-regressions/{suite}.txt").into_boxed_str(),
        )))),
        ..proptest::test_runner::Config::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{RngAlgorithm, TestRng, TestRunner};

    /// Draws specs with a fixed seed and requires every class the module docs promise: a strategy that lost one
    /// (a window class, a head dim, a GQA group, an empty varlen sequence) would fail here.
    #[test]
    fn drawn_specs_reach_every_class() {
        const TILE: usize = 16;
        let config = proptest::test_runner::Config::default();
        let mut runner = TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]));
        let strategy = spec(TILE);
        let specs: Vec<AttentionSpec> =
            (0..3000).map(|_| strategy.new_tree(&mut runner).expect("draw").current()).collect();

        let windows: Vec<(usize, usize, bool)> = specs
            .iter()
            .filter_map(|s| match &s.mask {
                Mask::Window { left, right } => Some((*left, *right, false)),
                Mask::And(parts) => parts.iter().find_map(|p| match p {
                    Mask::Window { left, right } => Some((*left, *right, true)),
                    _ => None,
                }),
                _ => None,
            })
            .collect();
        type Class = (&'static str, fn(usize, usize) -> bool);
        let classes: [Class; 8] = [
            ("zero width", |l, r| l == 0 && r == 0),
            ("one each side", |l, r| l == 1 && r == 1),
            ("left only", |l, r| l > 0 && r == 0),
            ("right only", |l, r| l == 0 && r > 0),
            ("left inside a tile", |l, _| (2..TILE).contains(&l)),
            ("left exactly a tile", |l, _| l == TILE),
            ("left wider than a tile", |l, _| l > TILE),
            ("right wider than a tile", |_, r| r > TILE),
        ];
        for causal in [false, true] {
            for (name, class) in classes {
                assert!(windows.iter().any(|&(l, r, c)| c == causal && class(l, r)), "window {name}, causal {causal}");
            }
        }
        assert!(
            specs.iter().any(|s| matches!(s.mask, Mask::None)) && specs.iter().any(|s| matches!(s.mask, Mask::Causal))
        );
        let strided: Vec<(usize, usize)> = specs
            .iter()
            .filter_map(|s| match s.mask {
                Mask::StridedCausal { len, stride } => Some((len, stride)),
                _ => None,
            })
            .collect();
        type StridedClass = (&'static str, fn(usize, usize) -> bool);
        let strided_classes: [StridedClass; 5] = [
            ("overlapping windows", |l, s| l > s && s > 1),
            ("adjacent windows", |l, s| l == s),
            ("gaps between windows", |l, s| l < s),
            ("stride 1", |_, s| s == 1),
            ("a window wider than a tile", |l, _| l > TILE),
        ];
        for (name, class) in strided_classes {
            assert!(strided.iter().any(|&(l, s)| class(l, s)), "strided causal: {name}");
        }

        for d in (8..=256).step_by(8) {
            assert!(specs.iter().any(|s| s.head_dim == d), "head_dim {d}");
            assert!(specs.iter().any(|s| s.head_dim_v == d), "head_dim_v {d}");
        }
        assert!(specs.iter().any(|s| s.head_dim != s.head_dim_v));
        for group in 1..=16 {
            assert!(specs.iter().any(|s| s.group_size() == group), "GQA group {group}");
        }
        assert!(specs.iter().any(|s| s.n_heads_kv == 1 && s.n_heads_q > 1), "MQA");
        assert!(
            specs.iter().any(|s| s.n_heads_kv == 2 && s.group_size() == 7),
            "a non-power-of-two group over 2 KV heads"
        );

        let empty = |cu: &[i32]| cu.windows(2).any(|w| w[0] == w[1]);
        assert!(specs.iter().any(|s| matches!(&s.layout, Layout::Varlen { cu_seqlens_q, .. } if empty(cu_seqlens_q))));
        assert!(specs.iter().any(|s| matches!(&s.layout, Layout::Varlen { cu_seqlens_k, .. } if empty(cu_seqlens_k))));
        let dense_lengths: Vec<(usize, usize)> = specs
            .iter()
            .filter_map(|s| match s.layout {
                Layout::Dense { len_q, len_k, .. } => Some((len_q, len_k)),
                Layout::Varlen { .. } => None,
            })
            .collect();
        for len in [1, TILE - 1, TILE, TILE + 1] {
            assert!(dense_lengths.iter().any(|&(_, lk)| lk == len), "Lk = {len}");
        }
        assert!(dense_lengths.iter().any(|&(lq, lk)| lq > lk) && dense_lengths.iter().any(|&(lq, lk)| lq < lk));
    }
}
