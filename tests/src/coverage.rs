//! Which kernel features a property suite's draws reach: every drawn problem is classified by mask kind, window width
//! relative to the KV tile on each side, head dims, GQA group, layout (dense, varlen, empty sequences), lengths
//! around the tile and dtype, and the suite prints the table. A strategy that stopped drawing a feature would then
//! show a zero here, and the coverage tests (the GPU suites' in `gpu/tests/it/coverage.rs`) fail on it.

use std::collections::BTreeMap;
use std::fmt;

use attnproof_oracle::{AttentionSpec, Layout, Mask};

/// Every feature, in table order. A draw counts towards each feature it shows.
pub const FEATURES: &[&str] = &[
    "dtype bf16",
    "dtype f16",
    "mask none",
    "mask causal",
    "mask window",
    "mask causal + window",
    "mask strided causal",
    "strided: windows overlap (len > stride)",
    "strided: windows apart (len <= stride)",
    "window left 0",
    "window left 1",
    "window left inside a tile",
    "window left = tile",
    "window left > tile",
    "window right 0",
    "window right 1",
    "window right inside a tile",
    "window right = tile",
    "window right > tile",
    "d <= 64",
    "64 < d <= 128",
    "128 < d < 256",
    "d = 256",
    "d != dv",
    "GQA group 1",
    "GQA group 2",
    "GQA group 3",
    "GQA group 4",
    "GQA group 5-8",
    "GQA group 9-16",
    "two KV heads",
    "dense, batch 2",
    "varlen",
    "varlen, an empty query sequence",
    "varlen, an empty key sequence",
    "Lq > Lk",
    "Lq < Lk",
    "Lk = 1",
    "Lk = tile - 1",
    "Lk = tile",
    "Lk = tile + 1",
    "Lk > 2 tiles",
];

/// The features `spec` in `dtype` shows, for KV tile `tile`.
pub fn features(spec: &AttentionSpec, dtype: &str, tile: usize) -> Vec<&'static str> {
    let mut found = Vec::new();
    match dtype {
        "bf16" => found.push("dtype bf16"),
        "f16" => found.push("dtype f16"),
        _ => {}
    }
    let window = |m: &Mask| match m {
        Mask::Window { left, right } => Some((*left, *right)),
        _ => None,
    };
    let (kind, window) = match &spec.mask {
        Mask::None => ("mask none", None),
        Mask::Causal => ("mask causal", None),
        w @ Mask::Window { .. } => ("mask window", window(w)),
        Mask::And(parts) => match parts.iter().find_map(window) {
            Some(w) if parts.iter().any(|p| matches!(p, Mask::Causal)) => ("mask causal + window", Some(w)),
            w => ("", w),
        },
        Mask::StridedCausal { len, stride } => {
            found.push(if len > stride {
                "strided: windows overlap (len > stride)"
            } else {
                "strided: windows apart (len <= stride)"
            });
            ("mask strided causal", None)
        }
        // The kernels take no predicate mask, so the kernel suites never draw one; it shows no mask feature.
        Mask::Predicate(_) => ("", None),
    };
    if !kind.is_empty() {
        found.push(kind);
    }
    if let Some((left, right)) = window {
        found.push(width_class(left, tile, "left"));
        found.push(width_class(right, tile, "right"));
    }
    found.push(match spec.head_dim {
        0..=64 => "d <= 64",
        65..=128 => "64 < d <= 128",
        129..=255 => "128 < d < 256",
        _ => "d = 256",
    });
    if spec.head_dim != spec.head_dim_v {
        found.push("d != dv");
    }
    found.push(match spec.group_size() {
        1 => "GQA group 1",
        2 => "GQA group 2",
        3 => "GQA group 3",
        4 => "GQA group 4",
        5..=8 => "GQA group 5-8",
        _ => "GQA group 9-16",
    });
    if spec.n_heads_kv >= 2 {
        found.push("two KV heads");
    }
    let mut lengths = Vec::new();
    match &spec.layout {
        Layout::Dense { batch, len_q, len_k } => {
            if *batch >= 2 {
                found.push("dense, batch 2");
            }
            lengths.push((*len_q, *len_k));
        }
        Layout::Varlen { cu_seqlens_q, cu_seqlens_k } => {
            found.push("varlen");
            let lens = |cu: &[i32]| cu.windows(2).map(|w| (w[1] - w[0]) as usize).collect::<Vec<_>>();
            let (lq, lk) = (lens(cu_seqlens_q), lens(cu_seqlens_k));
            if lq.contains(&0) {
                found.push("varlen, an empty query sequence");
            }
            if lk.contains(&0) {
                found.push("varlen, an empty key sequence");
            }
            lengths.extend(lq.into_iter().zip(lk));
        }
    }
    let mut length_features = Vec::new();
    for (len_q, len_k) in lengths {
        if len_q > len_k {
            length_features.push("Lq > Lk");
        }
        if len_q < len_k {
            length_features.push("Lq < Lk");
        }
        length_features.push(match len_k {
            1 => "Lk = 1",
            k if k + 1 == tile => "Lk = tile - 1",
            k if k == tile => "Lk = tile",
            k if k == tile + 1 => "Lk = tile + 1",
            k if k > 2 * tile => "Lk > 2 tiles",
            _ => "",
        });
    }
    length_features.retain(|f| !f.is_empty());
    length_features.sort_unstable();
    length_features.dedup();
    found.extend(length_features);
    found
}

/// One side of a window, by width relative to the tile.
fn width_class(width: usize, tile: usize, side: &str) -> &'static str {
    let class = match width {
        0 => 0,
        1 => 1,
        w if w < tile => 2,
        w if w == tile => 3,
        _ => 4,
    };
    let names: [&'static str; 5] = if side == "left" {
        ["window left 0", "window left 1", "window left inside a tile", "window left = tile", "window left > tile"]
    } else {
        ["window right 0", "window right 1", "window right inside a tile", "window right = tile", "window right > tile"]
    };
    names[class]
}

/// Draws per feature, for one suite or several merged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Coverage {
    /// The KV tile the width and length classes are relative to.
    pub tile: usize,
    /// Problems recorded.
    pub draws: usize,
    /// Draws per feature, every feature of [`FEATURES`] present.
    pub counts: BTreeMap<&'static str, usize>,
}

impl Coverage {
    /// No draw yet, for KV tile `tile`.
    pub fn new(tile: usize) -> Self {
        Coverage { tile, draws: 0, counts: FEATURES.iter().map(|&f| (f, 0)).collect() }
    }

    /// Records one drawn problem.
    pub fn record(&mut self, spec: &AttentionSpec, dtype: &str) {
        self.draws += 1;
        for feature in features(spec, dtype, self.tile) {
            *self.counts.entry(feature).or_insert(0) += 1;
        }
    }

    /// Adds another suite's draws (same tile).
    pub fn merge(&mut self, other: &Coverage) {
        assert_eq!(self.tile, other.tile, "coverage of different tiles");
        self.draws += other.draws;
        for (feature, n) in &other.counts {
            *self.counts.entry(feature).or_insert(0) += n;
        }
    }

    /// The features no draw showed, in table order.
    pub fn unreached(&self) -> Vec<&'static str> {
        FEATURES.iter().copied().filter(|f| self.counts.get(f).copied().unwrap_or(0) == 0).collect()
    }
}

impl fmt::Display for Coverage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "coverage of {} draws (KV tile {}):", self.draws, self.tile)?;
        for feature in FEATURES {
            let n = self.counts.get(feature).copied().unwrap_or(0);
            writeln!(f, "  {feature:<32} {n:>5}{}", if n == 0 { "  NOT REACHED" } else { "" })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::Scale;

    fn spec(layout: Layout, heads: (usize, usize), dims: (usize, usize), mask: Mask) -> AttentionSpec {
        AttentionSpec {
            layout,
            n_heads_q: heads.0,
            n_heads_kv: heads.1,
            head_dim: dims.0,
            head_dim_v: dims.1,
            scale: Scale::InverseSqrtHeadDim,
            mask,
        }
    }

    #[test]
    fn each_feature_is_recognised_and_only_where_it_shows() {
        let window = Mask::And(vec![Mask::Causal, Mask::Window { left: 64, right: 1 }]);
        let s = spec(Layout::Dense { batch: 2, len_q: 65, len_k: 63 }, (14, 2), (256, 200), window);
        let mut got = features(&s, "f16", 64);
        got.sort_unstable();
        let mut want = vec![
            "dtype f16",
            "mask causal + window",
            "window left = tile",
            "window right 1",
            "d = 256",
            "d != dv",
            "GQA group 5-8",
            "two KV heads",
            "dense, batch 2",
            "Lq > Lk",
            "Lk = tile - 1",
        ];
        want.sort_unstable();
        assert_eq!(got, want);

        let varlen = Layout::Varlen { cu_seqlens_q: vec![0, 0, 3], cu_seqlens_k: vec![0, 1, 1] };
        let s = spec(varlen, (3, 1), (8, 8), Mask::Window { left: 0, right: 200 });
        let got = features(&s, "bf16", 64);
        for f in [
            "varlen",
            "varlen, an empty query sequence",
            "varlen, an empty key sequence",
            "GQA group 3",
            "window left 0",
            "window right > tile",
            "Lk = 1",
            "Lq < Lk",
            "Lq > Lk",
        ] {
            assert!(got.contains(&f), "{f} missing from {got:?}");
        }
        assert!(!got.contains(&"two KV heads") && !got.contains(&"d != dv"), "{got:?}");
        for f in got {
            assert!(FEATURES.contains(&f), "{f} is not in FEATURES");
        }
    }

    #[test]
    fn coverage_counts_merges_and_reports_what_is_missing() {
        let s = spec(Layout::Dense { batch: 1, len_q: 1, len_k: 1 }, (1, 1), (64, 64), Mask::None);
        let mut a = Coverage::new(64);
        a.record(&s, "bf16");
        let mut b = Coverage::new(64);
        b.record(&s, "f16");
        a.merge(&b);
        assert_eq!(a.draws, 2);
        assert_eq!(a.counts["mask none"], 2);
        assert_eq!(a.counts["dtype f16"], 1);
        assert!(a.unreached().contains(&"mask causal") && !a.unreached().contains(&"Lk = 1"));
        let table = a.to_string();
        assert!(table.contains("mask causal") && table.contains("NOT REACHED"), "{table}");
    }
}
