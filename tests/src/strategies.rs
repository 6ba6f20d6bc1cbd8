//! Proptest strategies for shapes and values: batch, `Hq`/`Hkv` with `Hkv > 1`, `Lq ≠ Lk` both
//! ways, lengths 1, tile − 1, tile, tile + 1 and primes, head dims including 59, 111 and 256,
//! every mask kind, varlen with zero-length sequences, and the value profiles of
//! [`crate::generate`]. Built with `prop_flat_map` so dependent sizes shrink together.

use attnproof_oracle::{AttentionSpec, Layout, Mask, Scale};
use proptest::prelude::*;

use crate::generate::{Distribution, ValueProfile};

/// Sequence lengths that break weak schedules for tile `tile`: 1, tile ± 1, tile, 2·tile + 1,
/// and primes.
pub fn interesting_length(tile: usize) -> impl Strategy<Value = usize> {
    prop::sample::select(vec![1, 2, tile - 1, tile, tile + 1, 2 * tile + 1, 7, 13, 31, 61, 67])
}

/// Head dimensions, including the awkward 59 and 111 and the large 256.
pub fn head_dim() -> impl Strategy<Value = usize> {
    prop::sample::select(vec![1, 8, 16, 59, 64, 111, 128, 256])
}

/// Every mask kind, with windows that cut tiles.
pub fn mask() -> impl Strategy<Value = Mask> {
    prop_oneof![
        Just(Mask::None),
        Just(Mask::Causal),
        (0usize..20, 0usize..20).prop_map(|(left, right)| Mask::Window { left, right }),
        (0usize..20).prop_map(|left| Mask::And(vec![Mask::Causal, Mask::Window { left, right: 0 }])),
    ]
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

/// A problem spec with lengths drawn around tile size `tile` (at most `2·tile + 1`).
pub fn spec(tile: usize) -> impl Strategy<Value = AttentionSpec> {
    let heads = prop_oneof![Just((1usize, 1usize)), Just((2, 2)), Just((4, 2)), Just((3, 1)), Just((6, 3))];
    (layout(tile), heads, head_dim(), head_dim(), mask()).prop_map(
        |(layout, (n_heads_q, n_heads_kv), head_dim, head_dim_v, mask)| AttentionSpec {
            layout,
            n_heads_q,
            n_heads_kv,
            head_dim,
            head_dim_v,
            scale: Scale::InverseSqrtHeadDim,
            mask,
        },
    )
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
