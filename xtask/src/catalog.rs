//! The mutation catalog: named, small source changes to the reference schedules that the test suite must detect.
//!
//! Each mutant is a literal find/replace applied by `cargo xtask mutants` to a scratch copy of the repository, never
//! to the working tree and never through a hook in production code. The `find` text must occur exactly once in its
//! file when the runner applies it; otherwise the mutant is reported as stale, so that an edit of the schedule can
//! never make a mutant stop applying without anyone noticing. Adding a mutant is adding one entry to [`CATALOG`]:
//! start from the base entry of the file it mutates ([`FLASH`], [`MASK`]) or write a new base for a new schedule.

/// One mutant: a single textual change to one file, and the tests expected to detect it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mutant {
    /// Kebab-case name, unique in the catalog; `--only NAME` selects it.
    pub name: &'static str,
    /// The bug it models, in words, for the `--list` output.
    pub description: &'static str,
    /// The mutated file, relative to the repository root.
    pub file: &'static str,
    /// The exact text to replace; must occur exactly once in `file`.
    pub find: &'static str,
    /// Its replacement.
    pub replace: &'static str,
    /// The package whose tests must kill the mutant (`cargo test -p <test_package>`).
    pub test_package: &'static str,
    /// One integration test target (`--test <name>`), or `None` for every target of the package.
    pub test_target: Option<&'static str>,
    /// A libtest name filter passed after `--`, or `None` for every test.
    pub test_filter: Option<&'static str>,
}

/// Why a mutant cannot be applied to the current source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stale {
    /// The `find` text does not occur in the file.
    NotFound,
    /// The `find` text occurs more than once, so the change would be ambiguous.
    Ambiguous(usize),
}

impl std::fmt::Display for Stale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stale::NotFound => write!(f, "find text not found"),
            Stale::Ambiguous(n) => write!(f, "find text occurs {n} times"),
        }
    }
}

impl Mutant {
    /// The mutated source, or why the mutant no longer applies to `source`.
    pub fn apply(&self, source: &str) -> Result<String, Stale> {
        match source.matches(self.find).count() {
            0 => Err(Stale::NotFound),
            1 => Ok(source.replacen(self.find, self.replace, 1)),
            n => Err(Stale::Ambiguous(n)),
        }
    }

    /// The arguments of the `cargo` command that must fail once the mutant is applied.
    ///
    /// `--no-fail-fast` lets every test binary run, so the report names every test that kills the mutant rather than
    /// only the first binary to fail.
    pub fn test_args(&self) -> Vec<String> {
        let mut args =
            vec!["test".to_owned(), "-p".to_owned(), self.test_package.to_owned(), "--no-fail-fast".to_owned()];
        if let Some(target) = self.test_target {
            args.extend(["--test".to_owned(), target.to_owned()]);
        }
        if let Some(filter) = self.test_filter {
            args.extend(["--".to_owned(), filter.to_owned()]);
        }
        args
    }

    /// The tests it runs, for tables: `attnproof-harness`, `attnproof-harness --test flash_forward`, ...
    pub fn test_label(&self) -> String {
        let mut label = self.test_package.to_owned();
        if let Some(target) = self.test_target {
            label.push_str(&format!(" --test {target}"));
        }
        if let Some(filter) = self.test_filter {
            label.push_str(&format!(" -- {filter}"));
        }
        label
    }
}

/// The package holding the verifier's tests, which every reference mutant must fail.
const HARNESS: &str = "attnproof-harness";

/// Base entry for mutants of the FlashAttention forward schedule; entries override the name and the change.
const FLASH: Mutant = Mutant {
    name: "",
    description: "",
    file: "reference/src/flash.rs",
    find: "",
    replace: "",
    test_package: HARNESS,
    test_target: None,
    test_filter: None,
};

/// Base entry for mutants of the reference's own mask (E1a) and GQA (E1b) arithmetic, which every schedule uses.
const MASK: Mutant = Mutant { file: "reference/src/mask.rs", ..FLASH };

/// Base entry for mutants of the FlashAttention backward schedule.
const BACKWARD: Mutant = Mutant { file: "reference/src/backward.rs", test_target: Some("flash_backward"), ..FLASH };

/// Base entry for mutants of the ring attention schedule's layout (`reference/src/ring/mod.rs`).
const RING: Mutant = Mutant { file: "reference/src/ring/mod.rs", test_target: Some("ring"), ..FLASH };

/// Base entry for mutants of the ring driver, the step schedule every ring backend runs.
const RING_DRIVER: Mutant = Mutant { file: "reference/src/ring/driver.rs", ..RING };

/// Base entry for mutants of the ring forward worker.
const RING_FORWARD: Mutant = Mutant { file: "reference/src/ring/forward.rs", ..RING };

/// Base entry for mutants of the ring backward worker.
const RING_BACKWARD: Mutant = Mutant { file: "reference/src/ring/backward.rs", ..RING };

/// Base entry for mutants of the block-sparse schedule.
const BLOCK_SPARSE: Mutant = Mutant { file: "reference/src/sparse/block.rs", test_target: Some("sparse"), ..FLASH };

/// Base entry for mutants of the NSA selection schedule.
const NSA: Mutant = Mutant { file: "reference/src/sparse/nsa.rs", test_target: Some("sparse"), ..FLASH };

/// Base entry for mutants of the DSA token-gather schedule.
const DSA: Mutant = Mutant { file: "reference/src/sparse/dsa.rs", test_target: Some("sparse"), ..FLASH };

/// Base entry for mutants of the bound model's plumbing (`proofs/src/flash_bound.rs`): a recipe parameter that stops
/// entering its term.
const BOUND_MODEL: Mutant = Mutant {
    file: "proofs/src/flash_bound.rs",
    test_target: Some("flash_backward"),
    test_filter: Some("exp_underflow"),
    ..FLASH
};

/// Base entry for mutants of a CUDA kernel's text that break one of its compiled variants: the GPU crate's
/// compile-only test (NVRTC, no device; `gpu/tests/compile_only.rs`) must reject them.
const KERNEL_TEXT: Mutant = Mutant {
    file: "gpu/kernels/flash_bwd.cu",
    test_package: "attnproof-gpu",
    test_target: Some("compile_only"),
    ..FLASH
};

/// Every mutant, in the order the runner applies them.
pub const CATALOG: &[Mutant] = &[
    // --- Online softmax state (E2-E5) ---
    Mutant {
        name: "running-max-not-subtracted",
        description: "p = exp(s) instead of exp(s - m'): overflows for large logits, and LSE is off by m",
        find: "(x - m_new).exp()",
        replace: "x.exp()",
        ..FLASH
    },
    Mutant {
        name: "rescale-forced-to-one",
        description: "the correction e^(m - m') is taken as 1: earlier tiles keep their stale scaling",
        find: "(m[r] - m_new).exp()",
        replace: "1.0",
        ..FLASH
    },
    Mutant {
        name: "sum-not-rescaled",
        description: "l = l + sum(p) without the e^(m - m') factor (the accumulator is still rescaled)",
        find: "rescale * l[r]",
        replace: "l[r]",
        ..FLASH
    },
    Mutant {
        name: "accumulator-not-rescaled",
        description: "A = A + P.V without the e^(m - m') factor (the sum is still rescaled)",
        find: "rescale * acc[[r, c]]",
        replace: "acc[[r, c]]",
        ..FLASH
    },
    Mutant {
        name: "running-max-not-stored",
        description: "m is never updated after a tile: every tile is treated as the first and overwrites the state",
        find: "m[r] = m_new;",
        replace: "",
        ..FLASH
    },
    Mutant {
        name: "running-max-starts-at-zero",
        description: "m starts at 0 instead of -inf: rows whose logits are all very negative underflow to l = 0",
        find: "let mut m = vec![f32::NEG_INFINITY; n_rows];",
        replace: "let mut m = vec![0f32; n_rows];",
        ..FLASH
    },
    Mutant {
        name: "fully-masked-row-guard-removed",
        description: "finalize divides by l = 0 on a row with no visible key: O = NaN instead of 0 (E1c)",
        find: "if l[r] > 0.0 {",
        replace: "if true {",
        ..FLASH
    },
    Mutant {
        name: "lse-base-2",
        description: "LSE = log2 of the sum of exponentials instead of the natural log",
        find: "m[r] + l[r].ln()",
        replace: "(m[r] + l[r].ln()) / std::f32::consts::LN_2",
        ..FLASH
    },
    Mutant {
        name: "lse-missing-log-sum",
        description: "LSE = m, the running max alone, without + ln l",
        find: "m[r] + l[r].ln()",
        replace: "m[r]",
        ..FLASH
    },
    // --- Scores and the precision recipe ---
    Mutant {
        name: "scale-one-over-d",
        description: "default scale 1/d instead of 1/sqrt(d)",
        find: "1.0 / (spec.head_dim as f32).sqrt()",
        replace: "1.0 / (spec.head_dim as f32)",
        ..FLASH
    },
    Mutant {
        name: "scale-not-applied",
        description: "scores are q.k without the softmax scale",
        find: "dot * scale",
        replace: "dot",
        ..FLASH
    },
    Mutant {
        name: "mask-ignored-inside-tile",
        description: "every key of a visited KV tile counts as visible; only whole-tile skipping still masks",
        find: "if visible(&spec.mask, i, j, seq.len_q, seq.len_k) {",
        replace: "if true {",
        ..FLASH
    },
    Mutant {
        name: "scores-accumulated-in-input-dtype",
        description: "the q.k dot product is rounded to bf16/f16 after every term instead of accumulating in f32",
        find: "fold(0f32, |a, (x, y)| a + x * y)",
        replace: "fold(0f32, |a, (x, y)| T::round(a + x * y))",
        ..FLASH
    },
    Mutant {
        name: "p-not-rounded-before-pv",
        description: "P enters the PV product in f32 instead of being rounded to the input dtype as the MMA does",
        find: "T::round(pj) * v[[j, c]]",
        replace: "pj * v[[j, c]]",
        ..FLASH
    },
    Mutant {
        name: "pv-accumulated-in-input-dtype",
        description: "the P.V sum is rounded to bf16/f16 after every term instead of accumulating in f32",
        find: "|a, (j, &pj)| a + T::round(pj) * v[[j, c]]",
        replace: "|a, (j, &pj)| T::round(a + T::round(pj) * v[[j, c]])",
        ..FLASH
    },
    // --- Tiling ---
    Mutant {
        name: "last-partial-kv-tile-skipped",
        description: "kv_tile_range ends at floor(hi / tile) instead of ceil: a partial last KV tile is never visited",
        find: "hi.div_ceil(kv_tile)",
        replace: "hi / kv_tile",
        ..FLASH
    },
    Mutant {
        name: "first-kv-tile-skipped",
        description: "kv_tile_range starts at ceil(lo / tile) instead of floor: a window's first, partial tile is skipped",
        find: "lo / kv_tile..",
        replace: "lo.div_ceil(kv_tile)..",
        ..FLASH
    },
    Mutant {
        name: "last-key-dropped",
        description: "a KV tile ends at len_k - 1 instead of len_k: the sequence's last key is never read",
        find: ".min(seq.len_k)",
        replace: ".min(seq.len_k - 1)",
        ..FLASH
    },
    Mutant {
        name: "last-partial-q-tile-skipped",
        description: "floor(len_q / q_tile) query tiles instead of ceil: the last rows are never computed",
        find: "seq.len_q.div_ceil(tiles.q_tile)",
        replace: "seq.len_q / tiles.q_tile",
        ..FLASH
    },
    Mutant {
        name: "q-tile-offset-wrong",
        description: "a query tile's rows are written at its tile index instead of index * q_tile",
        find: "let start = a * tiles.q_tile;",
        replace: "let start = *a;",
        ..FLASH
    },
    Mutant {
        name: "only-first-row-written",
        description: "the write-back loop stores only the first row of each query tile",
        find: ".zip(r.lse.iter()).enumerate()",
        replace: ".zip(r.lse.iter()).enumerate().take(1)",
        ..FLASH
    },
    // --- Mask (E1a) and GQA (E1b) arithmetic ---
    Mutant {
        name: "causal-top-left",
        description: "causal is j <= i (top-left) instead of bottom-right aligned j <= i + Lk - Lq",
        find: "Mask::Causal => key <= diagonal,",
        replace: "Mask::Causal => key <= query as i64,",
        ..MASK
    },
    Mutant {
        name: "mask-diagonal-top-left",
        description: "the diagonal of causal and window masks ignores Lk - Lq (top-left alignment for both)",
        find: "let diagonal = query as i64 + len_k as i64 - len_q as i64;",
        replace: "let diagonal = query as i64;",
        ..MASK
    },
    Mutant {
        name: "window-left-off-by-one",
        description: "the window's left bound is exclusive: one key too few on the left",
        find: "key >= diagonal - *left as i64",
        replace: "key > diagonal - *left as i64",
        ..MASK
    },
    Mutant {
        name: "window-right-off-by-one",
        description: "the window's right bound is exclusive: one key too few on the right",
        find: "key <= diagonal + *right as i64",
        replace: "key < diagonal + *right as i64",
        ..MASK
    },
    Mutant {
        name: "mask-and-as-or",
        description: "an AND of masks is evaluated as OR: causal + sliding window becomes plain causal",
        find: "parts.iter().all(",
        replace: "parts.iter().any(",
        ..MASK
    },
    Mutant {
        name: "gqa-head-modulo",
        description: "query head h reads KV head h % Hkv instead of h / (Hq / Hkv)",
        find: "head / (n_heads_q / n_heads_kv)",
        replace: "head % n_heads_kv",
        ..MASK
    },
    Mutant {
        name: "output-unnormalized",
        description: "O = A instead of A / l: the unnormalized accumulator is returned, and the backward's D is \
                      computed from it (D from unnormalized A)",
        find: "T::round(acc[[r, c]] / l[r])",
        replace: "T::round(acc[[r, c]])",
        ..FLASH
    },
    // --- Backward (E6-E10a) ---
    Mutant {
        name: "scale-missing-from-dk",
        description: "dK is never multiplied by the softmax scale",
        find: "g.dk.mapv_inplace(|x| x * scale);",
        replace: "",
        ..BACKWARD
    },
    Mutant {
        name: "dq-partials-dropped",
        description: "strategy B sums only the first KV tile's partial dQ",
        find: "for partial in &partial_dq {",
        replace: "for partial in partial_dq.iter().take(1) {",
        ..BACKWARD
    },
    Mutant {
        name: "dk-not-summed-over-group",
        description: "GQA: a KV head's dK keeps only its last query head instead of the group sum",
        find: "entry.0 += &g.dk;",
        replace: "entry.0.assign(&g.dk);",
        ..BACKWARD
    },
    Mutant {
        name: "delta-not-subtracted",
        description: "dS = P dP instead of P (dP - D): the rows of dS no longer sum to zero",
        find: "T::round(pij * (dp - delta[i]))",
        replace: "T::round(pij * dp)",
        ..BACKWARD
    },
    Mutant {
        name: "p-from-lse-in-base-2",
        description: "the backward reconstructs P with an LSE read as base 2",
        find: "(s - head.lse[i]).exp()",
        replace: "(s - head.lse[i] / std::f32::consts::LN_2).exp()",
        ..BACKWARD
    },
    // --- Ring attention (E11, E11a) ---
    Mutant {
        name: "ring-diagonal-mask-skipped",
        description: "ring steps evaluate every key of a block, so the diagonal block is not causally masked",
        find: "if visible(&spec.mask, i, j, seq.len_q, seq.len_k) {",
        replace: "if true {",
        ..RING_FORWARD
    },
    Mutant {
        name: "ring-sum-not-rescaled",
        description: "a device's running sum is not rescaled when a later block raises the max",
        find: "st.l[r] = rescale * st.l[r] + p.iter().sum::<f32>();",
        replace: "st.l[r] = st.l[r] + p.iter().sum::<f32>();",
        ..RING_FORWARD
    },
    Mutant {
        name: "ring-dk-missing-scale",
        description: "the owner adds the travelling dK back without the softmax scale",
        find: "dk_sum += &part.dk[h].mapv(|x| x * scale);",
        replace: "dk_sum += &part.dk[h];",
        ..RING_BACKWARD
    },
    Mutant {
        name: "ring-dkdv-not-summed-over-group",
        description: "GQA: the owner keeps only the first query head's dK/dV of a group",
        find: "for h in kv * group..(kv + 1) * group {",
        replace: "for h in kv * group..kv * group + 1 {",
        ..RING_BACKWARD
    },
    Mutant {
        name: "zigzag-chunk-swapped",
        description: "zigzag device g takes chunks g and g + G instead of g and 2G - 1 - g: causal work unbalanced",
        find: "zigzag_chunks(device, self.n_devices).iter().map(|&c| piece(c)).collect()",
        replace: "[device, device + self.n_devices].iter().map(|&c| piece(c)).collect()",
        ..RING
    },
    Mutant {
        name: "ring-block-merged-twice",
        description: "the ring driver runs one step too many: each device attends its own block a second time when it comes back",
        find: "for step in 0..n_devices {",
        replace: "for step in 0..=n_devices {",
        ..RING_DRIVER
    },
    Mutant {
        name: "ring-stale-receive-buffer",
        description: "the ring driver ignores the block it received and attends the one it sent again (stale receive buffer)",
        find: "held = transport.wait()?;",
        replace: "transport.wait()?;",
        ..RING_DRIVER
    },
    Mutant {
        name: "ring-accumulators-sent-before-attend",
        description: "backward: the driver posts a block before adding its dK/dV, so the successor receives a stale copy",
        find: "Travel::ReadOnly if hop => transport.post(&held)?,",
        replace: "_ if hop => transport.post(&held)?,",
        ..RING_DRIVER
    },
    // --- Bound model parameters ---
    Mutant {
        name: "bound-exp-underflow-ignored-in-o",
        description: "the forward bound charges gradual underflow whatever the recipe's exp_underflow says",
        find: "+ len_k as f64 * (tiny + recipe.exp_underflow) * vmax;",
        replace: "+ len_k as f64 * (tiny + F32_SUBNORMAL) * vmax;",
        ..BOUND_MODEL
    },
    Mutant {
        name: "bound-exp-underflow-ignored-in-dv",
        description: "the dV bound charges gradual underflow whatever the recipe's exp_underflow says",
        find: "+ len_q as f64 * (tiny + recipe.exp_underflow) * gmax",
        replace: "+ len_q as f64 * (tiny + F32_SUBNORMAL) * gmax",
        ..BOUND_MODEL
    },
    Mutant {
        name: "bound-exp-underflow-ignored-in-ds",
        description: "the dS term of the dQ and dK bounds charges gradual underflow whatever exp_underflow says",
        find: "+ recipe.exp_underflow * (x.dp[[i, j]] - x.delta[i]).abs()",
        replace: "+ F32_SUBNORMAL * (x.dp[[i, j]] - x.delta[i]).abs()",
        // The harness test sees dQ and dK grow through D's bound too: the model's own test holds the forward fixed.
        test_package: "attnproof-proofs",
        test_target: None,
        ..BOUND_MODEL
    },
    // --- Kernel texts (compiled by NVRTC without a device) ---
    Mutant {
        name: "kernel-dq-row-groups-ignore-narrow-chunks",
        description: "bwd_kv's dQ step always takes two row groups, so a 32-column chunk splits into parts of 8 columns",
        find: "#define DQ_ROW_GROUPS ((CHUNK / (KV_WARPS / 2)) % 16 == 0 ? 2 : 4)",
        replace: "#define DQ_ROW_GROUPS 2",
        ..KERNEL_TEXT
    },
    // --- Sparse schedules (E14, E16, E18-E20) ---
    Mutant {
        name: "block-sparse-index-zero-ignored",
        description: "the list reader stops at index 0 as if it were the -1 pad: one block-sparse index ignored",
        find: ".take_while(|&&b| b >= 0)",
        replace: ".take_while(|&&b| b > 0)",
        ..BLOCK_SPARSE
    },
    Mutant {
        name: "block-sparse-query-tile-size",
        description: "query tile rows computed with the KV tile size",
        find: "let rows = tile_range(a as usize, layout.q_tile, len_q);",
        replace: "let rows = tile_range(a as usize, layout.kv_tile, len_q);",
        ..BLOCK_SPARSE
    },
    Mutant {
        name: "csr-first-entry-dropped",
        description: "the CSR transpose walk skips the first query tile listed for each KV tile (off by one)",
        find: "for &a in csr.queries_of(b) {",
        replace: "for &a in csr.queries_of(b).iter().skip(1) {",
        ..BLOCK_SPARSE
    },
    Mutant {
        name: "nsa-csr-of-wrong-kv-head",
        description: "the NSA backward walks KV head 0's selecting queries for every KV head",
        find: "for &t in csr[kv].queries_of(b) {",
        replace: "for &t in csr[0].queries_of(b) {",
        ..NSA
    },
    Mutant {
        name: "nsa-gqa-head-modulo",
        description: "NSA maps query head h to KV head h % Hkv instead of h / G",
        find: "let kv = h / dims.group;",
        replace: "let kv = h % dims.n_heads_kv;",
        ..NSA
    },
    Mutant {
        name: "dsa-gather-offset-lost",
        description: "the DSA gather reads value rows from the start of the chunk buffer, not the gathered offset",
        find: "values[[chunk.start + jj, c]]",
        replace: "values[[jj, c]]",
        ..DSA
    },
];
/// The catalog entry named `name`.
pub fn find(name: &str) -> Option<&'static Mutant> {
    CATALOG.iter().find(|m| m.name == name)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn names_are_unique_kebab_case_and_catalog_is_large_enough() {
        let mut seen = HashSet::new();
        for m in CATALOG {
            assert!(seen.insert(m.name), "duplicate mutant name `{}`", m.name);
            assert!(
                !m.name.is_empty() && m.name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "mutant name `{}` is not kebab-case",
                m.name
            );
            assert!(!m.description.is_empty(), "mutant `{}` has no description", m.name);
        }
        assert!(CATALOG.len() >= 20, "the catalog must hold at least 20 mutants, has {}", CATALOG.len());
    }

    #[test]
    fn every_entry_changes_something() {
        for m in CATALOG {
            assert!(!m.find.is_empty(), "mutant `{}` has an empty find text", m.name);
            assert_ne!(m.find, m.replace, "mutant `{}` replaces its text with itself", m.name);
            assert!(!m.test_package.is_empty(), "mutant `{}` names no test package", m.name);
        }
    }

    /// Keeps the catalog in step with the code: `cargo xtask test` fails as soon as an edit of a schedule makes a
    /// mutant stale, not only when someone next runs `cargo xtask mutants`.
    #[test]
    fn every_entry_applies_to_the_current_sources() {
        let root = crate::repo_root();
        for m in CATALOG {
            let path = root.join(m.file);
            let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if let Err(stale) = m.apply(&source) {
                panic!("mutant `{}` is stale in {}: {stale}", m.name, m.file);
            }
        }
    }

    #[test]
    fn apply_replaces_exactly_one_occurrence() {
        let m = Mutant { find: "b", replace: "X", ..FLASH };
        assert_eq!(m.apply("abc"), Ok("aXc".to_owned()));
        assert_eq!(m.apply("acd"), Err(Stale::NotFound));
        assert_eq!(m.apply("abcb"), Err(Stale::Ambiguous(2)));
    }

    #[test]
    fn test_args_follow_the_entry() {
        let all = Mutant { ..FLASH };
        assert_eq!(all.test_args(), ["test", "-p", "attnproof-harness", "--no-fail-fast"]);
        let one = Mutant { test_target: Some("flash_forward"), test_filter: Some("bf16"), ..FLASH };
        assert_eq!(
            one.test_args(),
            ["test", "-p", "attnproof-harness", "--no-fail-fast", "--test", "flash_forward", "--", "bf16"]
        );
        assert_eq!(one.test_label(), "attnproof-harness --test flash_forward -- bf16");
    }

    #[test]
    fn find_by_name() {
        assert_eq!(find("gqa-head-modulo").map(|m| m.file), Some("reference/src/mask.rs"));
        assert!(find("no-such-mutant").is_none());
    }
}
