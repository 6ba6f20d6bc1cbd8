//! CPU mutants: the reference schedules, the reference's mask and GQA arithmetic, and the bound model's plumbing,
//! each killed by `cargo test` on a patched scratch copy ([`Runner::Scratch`]).
//!
//! Adding a mutant is adding one entry to [`MUTANTS`]: start from the base entry of the file it mutates ([`FLASH`],
//! [`MASK`], ...) or write a new base for a new schedule.

use crate::{Mutant, Runner};

/// The package holding the verifier's tests, which every reference mutant must fail.
const HARNESS: &str = "attnproof-harness";

/// Every test of the harness: its unit tests and every module of its integration-test binary.
const ALL_HARNESS_TESTS: Runner = Runner::Scratch { package: HARNESS, target: None, filter: None };

/// The harness's integration tests whose path contains `filter`: the binary `it` holds one module per former test
/// file, so a module prefix such as `"ring::"` selects that module's tests (libtest filters are substrings).
const fn harness_tests(filter: &'static str) -> Runner {
    Runner::Scratch { package: HARNESS, target: Some("it"), filter: Some(filter) }
}

/// Base entry for mutants of the FlashAttention forward schedule; entries override the name and the change.
pub const FLASH: Mutant = Mutant {
    name: "",
    description: "",
    file: "reference/src/flash.rs",
    find: "",
    replace: "",
    runner: ALL_HARNESS_TESTS,
};

/// Base entry for mutants of the reference's own mask (E1a) and GQA (E1b) arithmetic, which every schedule uses.
pub const MASK: Mutant = Mutant { file: "reference/src/mask.rs", ..FLASH };

/// Base entry for mutants of the FlashAttention backward schedule.
const BACKWARD: Mutant =
    Mutant { file: "reference/src/backward.rs", runner: harness_tests("flash_backward::"), ..FLASH };

/// Base entry for mutants of the ring's layout, how every ring backend cuts sequences among its devices (the driver
/// crate's `layout.rs`); the CPU ring's tests in the harness kill them.
const RING: Mutant = Mutant { file: "reference/ring-driver/src/layout.rs", runner: harness_tests("ring::"), ..FLASH };

/// Base entry for mutants of the ring driver, the step schedule every ring backend runs (the driver crate, whose
/// schedule the CPU ring's tests in the harness exercise end to end).
const RING_DRIVER: Mutant = Mutant { file: "reference/ring-driver/src/driver.rs", ..RING };

/// Base entry for mutants of the ring forward worker.
const RING_FORWARD: Mutant = Mutant { file: "reference/src/ring/forward.rs", ..RING };

/// Base entry for mutants of the ring backward worker.
const RING_BACKWARD: Mutant = Mutant { file: "reference/src/ring/backward.rs", ..RING };

/// Base entry for mutants of the block-sparse schedule.
const BLOCK_SPARSE: Mutant =
    Mutant { file: "reference/src/sparse/block.rs", runner: harness_tests("sparse::"), ..FLASH };

/// Base entry for mutants of the NSA selection schedule.
const NSA: Mutant = Mutant { file: "reference/src/sparse/nsa.rs", runner: harness_tests("sparse::"), ..FLASH };

/// Base entry for mutants of the DSA token-gather schedule.
const DSA: Mutant = Mutant { file: "reference/src/sparse/dsa.rs", runner: harness_tests("sparse::"), ..FLASH };

/// Base entry for mutants of PISA's tail schedule, killed by the harness's tail tests (its unit tests, which verify the
/// schedule on fixed cases, and the `sparse::pisa_tail_*` property tests).
const PISA_TAIL_REF: Mutant = Mutant {
    file: "reference/src/sparse/pisa.rs",
    runner: Runner::Scratch { package: HARNESS, target: None, filter: Some("pisa_tail") },
    ..FLASH
};

/// Base entry for mutants of PISA's tail backward schedule (`pisa_tail_backward` in the same file), killed by the GPU
/// crate's CPU test of it (`pisa_tail_backward::the_reference_schedule_passes_the_suites_draws`, no device needed).
const PISA_TAIL_BWD_REF: Mutant = Mutant {
    runner: Runner::Scratch {
        package: "attnproof-gpu",
        target: Some("it"),
        filter: Some("pisa_tail_backward::the_reference_schedule_passes_the_suites_draws"),
    },
    ..PISA_TAIL_REF
};

/// Base entry for mutants of PISA's covariance-aware selection schedule (`pisa_covariance_select` in the same file),
/// killed by the GPU crate's CPU test of it (`pisa_covariance::the_reference_schedule_passes_the_suites_draws`, no
/// device needed).
const PISA_COVARIANCE_REF: Mutant = Mutant {
    runner: Runner::Scratch {
        package: "attnproof-gpu",
        target: Some("it"),
        filter: Some("pisa_covariance::the_reference_schedule_passes_the_suites_draws"),
    },
    ..PISA_TAIL_REF
};

/// Base entry for mutants of HiLS's factorized output as the kernel runs it (`reference/src/sparse/hils.rs`), judged by
/// the harness's HiLS tests (the output verifier's unit tests and the CPU suites).
const HILS_REF: Mutant = Mutant {
    file: "reference/src/sparse/hils.rs",
    runner: Runner::Scratch { package: HARNESS, target: None, filter: Some("hils") },
    ..FLASH
};

/// Base entry for mutants of the bound model's plumbing (`proofs/src/flash_bound.rs`): a recipe parameter that stops
/// entering its term.
const BOUND_MODEL: Mutant =
    Mutant { file: "proofs/src/flash_bound.rs", runner: harness_tests("flash_backward::exp_underflow"), ..FLASH };

/// The CPU mutants, in the order `cargo xtask mutants` applies them.
pub const MUTANTS: &[Mutant] = &[
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
        find: "+ len_k as f64 * (tiny + recipe.exp_underflow) * vmax[c]",
        replace: "+ len_k as f64 * (tiny + F32_SUBNORMAL) * vmax[c]",
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
        runner: Runner::Scratch { package: "attnproof-proofs", target: None, filter: None },
        ..BOUND_MODEL
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
    // --- PISA's tail (E22), the tensor-core kernel's schedule ---
    Mutant {
        name: "ref-pisa-tail-hbar-term-missing",
        description: "the tail's average leaves out the shared first-order term α qᵀH̄ / C",
        find: "f64::from(state.acc[e] / state.l) + scale64 * shared(e) / block as f64",
        replace: "f64::from(state.acc[e] / state.l)",
        ..PISA_TAIL_REF
    },
    Mutant {
        name: "ref-pisa-tail-bwd-shared-term-dropped",
        description: "the tail backward's dQ leaves out the shared term A α H̄ dO",
        find: "add(&mut dq_head[[i, c]], acc[c] + mass * alpha * w[c]);",
        replace: "add(&mut dq_head[[i, c]], acc[c]);",
        ..PISA_TAIL_BWD_REF
    },
    Mutant {
        name: "ref-pisa-tail-bwd-hbar-gradient-dropped",
        description: "the tail backward's dV leaves out G's share Gᵀ (k_j − μ_b) / n_b",
        find: "add(&mut dv_head[[j, e]], d_sums[[b, e]] + via_g / n_blocks as f64);",
        replace: "add(&mut dv_head[[j, e]], d_sums[[b, e]]);",
        ..PISA_TAIL_BWD_REF
    },
    Mutant {
        name: "ref-pisa-cov-spread-of-h-b",
        description: "E24's spread is the norm of H_b instead of H_b − H̄",
        find: "let m = centred(b * bsa.kv_block..b * bsa.kv_block + count) - &h_bar;",
        replace: "let m = centred(b * bsa.kv_block..b * bsa.kv_block + count);",
        ..PISA_COVARIANCE_REF
    },
    Mutant {
        name: "ref-pisa-cov-term-first-head",
        description: "E24's spread term sums the first query head of the GQA group only",
        find: "let term = coefficients.iter().fold(0f64, |s, c| s + c.mul_add(spread, counts[b] as f64).ln());",
        replace: "let term = coefficients.iter().take(1).fold(0f64, |s, c| s + c.mul_add(spread, counts[b] as f64).ln());",
        ..PISA_COVARIANCE_REF
    },
    Mutant {
        name: "ref-pisa-tail-listed-block-in-tail",
        description: "the tail ignores the lists: a listed block counts exactly and again as its summary",
        find: "(0..whole).map(|b| !listed.contains(&b) && sees_whole(b))",
        replace: "(0..whole).map(sees_whole)",
        ..PISA_TAIL_REF
    },
    Mutant {
        name: "ref-pisa-tail-block-size-left-out",
        description: "the tail's log-mass forgets |B_b| = C: each tail block weighs like one key",
        find: "f64::from(state.m + state.l.ln()) + (block as f64).ln()",
        replace: "f64::from(state.m + state.l.ln())",
        ..PISA_TAIL_REF
    },
    Mutant {
        name: "ref-pisa-tail-mean-key-low-half-dropped",
        description: "the split mean key keeps only its high half (the statistics' check must see it)",
        find: "keys[[b, d + c]] = lo;",
        replace: "keys[[b, d + c]] = 0.0 * lo;",
        ..PISA_TAIL_REF
    },
    Mutant {
        name: "ref-pisa-tail-deviation-not-subtracted",
        description: "H̄ sums k_j v_jᵀ instead of (k_j − μ_b) v_jᵀ: the centring term is left out",
        find: "                products - centre\n",
        replace: "                products - 0.0 * centre\n",
        ..PISA_TAIL_REF
    },
    Mutant {
        name: "ref-pisa-tail-exact-weight-inverted",
        description: "the merge weighs the exact part by e^{M − lse_E} instead of e^{lse_E − M}",
        find: "let (we, wt) = ((lse_exact - top).exp(), (lse_tail - top).exp());",
        replace: "let (we, wt) = ((top - lse_exact).exp(), (lse_tail - top).exp());",
        ..PISA_TAIL_REF
    },
    // --- HiLS's factorized output (E21), the kernel's schedule ---
    Mutant {
        name: "ref-hils-sum-not-rescaled",
        description: "the online softmax adds a group's weights to l without rescaling it to the new maximum",
        find: "self.l = self.l * carry + warp_tree_sum(lanes);",
        replace: "self.l = self.l + warp_tree_sum(lanes);",
        ..HILS_REF
    },
    Mutant {
        name: "ref-hils-chunk-average-unnormalized",
        description: "a retrieved chunk enters with its numerator, not its average a / l",
        find: "let average = chunk.a.mapv(|x| x / chunk.l);",
        replace: "let average = chunk.a.clone();",
        ..HILS_REF
    },
    Mutant {
        name: "ref-hils-surrogate-without-entropy",
        description: "the surrogate log-mass leaves out the chunk's entropy H(p_b)",
        find: "+ summary[d]",
        replace: "+ 0.0 * summary[d]",
        ..HILS_REF
    },
    Mutant {
        name: "ref-hils-window-not-chunk-aligned",
        description: "the local window starts at i + 1 − w, not extended down to its chunk's first key",
        find: "let start = local_window_start(i, config);",
        replace: "let start = (i + 1).saturating_sub(config.local_window);",
        ..HILS_REF
    },
];
