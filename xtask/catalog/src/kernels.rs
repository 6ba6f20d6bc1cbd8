//! Mutants of the CUDA kernel texts (`gpu/kernels/*.cu`).
//!
//! Most are launched on a device in-process ([`Runner::KernelText`]): `gpu/tests/it/mutants.rs` patches the text the
//! GPU crate embeds, first requires the unpatched kernel to pass every killing case, then requires each patch to fail
//! one, and compiles every patch with NVRTC for `sm_90a` (no device needed) so that a patch that does not build cannot
//! pass for killed. A mutant that breaks only the compilation of one variant is a [`Runner::Scratch`] mutant killed by
//! the compile-only test.

use crate::{COMMON_HEADER, Mutant, Runner, SM90_HEADER};

/// Base entry for mutants of the FlashAttention forward kernel, launched in-process on a device.
const FLASH_FWD: Mutant = Mutant {
    name: "",
    description: "",
    file: "gpu/kernels/flash_fwd.cu",
    find: "",
    replace: "",
    runner: Runner::KernelText { kernel: "flash_fwd", mode: None },
};

/// Base entry for mutants of the forward kernels' shared code in `gpu/kernels/common.cuh` (the online-softmax step, the
/// CTA's rows and visible tiles, the output rows), launched in-process with `flash_fwd`'s killing cases.
const FORWARD_COMMON: Mutant = Mutant { file: COMMON_HEADER, ..FLASH_FWD };

/// Base entry for mutants of the block selector (`bsa_select.cu`: key pooling and selection), launched in-process on a
/// device with selection killing cases.
const BSA_SELECT: Mutant = Mutant {
    file: "gpu/kernels/bsa_select.cu",
    runner: Runner::KernelText { kernel: "bsa_select", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of NSA's compression (`nsa_compress.cu`: compressed keys and values per window), launched
/// in-process on a device with compression killing cases.
const NSA_COMPRESS: Mutant = Mutant {
    file: "gpu/kernels/nsa_compress.cu",
    runner: Runner::KernelText { kernel: "nsa_compress", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of NSA's gates (`nsa_gates.cu`: the gated sum of the branches and its gradients), launched
/// in-process on a device with gate killing cases.
const NSA_GATES: Mutant = Mutant {
    file: "gpu/kernels/nsa_gates.cu",
    runner: Runner::KernelText { kernel: "nsa_gates", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of NSA's block selection (`nsa_select.cu`: block scores and top-n lists), launched in-process
/// on a device with selection killing cases.
const NSA_SELECT: Mutant = Mutant {
    file: "gpu/kernels/nsa_select.cu",
    runner: Runner::KernelText { kernel: "nsa_select", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of NSA's selected attention (`nsa_selected.cu`: the union walk over the CTA's tokens'
/// block lists), launched in-process on a device with selected-attention killing cases.
const NSA_SELECTED: Mutant = Mutant {
    file: "gpu/kernels/nsa_selected.cu",
    runner: Runner::KernelText { kernel: "nsa_selected", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of NSA's selected attention backward (`nsa_selected_bwd.cu`: the device-built block → token
/// transpose and the KV owner over it), launched in-process on a device with the forward's killing cases.
const NSA_SELECTED_BWD: Mutant = Mutant {
    file: "gpu/kernels/nsa_selected_bwd.cu",
    runner: Runner::KernelText { kernel: "nsa_selected_bwd", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of DSA's lightning indexer with its exact top-k (`dsa_index.cu`), launched in-process on a
/// device with indexer killing cases.
const DSA_INDEX: Mutant = Mutant {
    file: "gpu/kernels/dsa_index.cu",
    runner: Runner::KernelText { kernel: "dsa_index", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of DSA's token-sparse attention forward (`dsa_sparse.cu`: the gather of each token's listed
/// keys for a chunk of its query heads), launched in-process on a device with token-sparse killing cases.
const DSA_SPARSE: Mutant = Mutant {
    file: "gpu/kernels/dsa_sparse.cu",
    runner: Runner::KernelText { kernel: "dsa_sparse", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of the token-list rule DSA's token-sparse kernels share (`common.cuh`'s `token_list_end`), as
/// the forward runs it.
const DSA_SPARSE_COMMON: Mutant = Mutant { file: COMMON_HEADER, ..DSA_SPARSE };

/// Base entry for mutants of DSA's token-sparse attention backward (`dsa_sparse_bwd.cu`: each token's gathered tile
/// step, dQ owned per token, dK and dV added to the gathered rows), launched in-process on a device with the forward's
/// killing cases.
const DSA_SPARSE_BWD: Mutant = Mutant {
    file: "gpu/kernels/dsa_sparse_bwd.cu",
    runner: Runner::KernelText { kernel: "dsa_sparse_bwd", mode: None },
    ..FLASH_FWD
};

/// The token-list rule as the backward runs it.
const DSA_SPARSE_BWD_COMMON: Mutant = Mutant { file: COMMON_HEADER, ..DSA_SPARSE_BWD };

/// Base entry for mutants of DSA's indexer loss (`dsa_loss.cu`: the student's and the teacher's rows, the KL, and the
/// gradients through the ReLU), launched in-process on a device with the loss's killing cases.
const DSA_LOSS: Mutant = Mutant {
    file: "gpu/kernels/dsa_loss.cu",
    runner: Runner::KernelText { kernel: "dsa_loss", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of PISA's pyramid selector (`pisa_select.cu`: the coarser levels' means and the descent),
/// launched in-process on a device with the pyramid's killing cases.
const PISA_SELECT: Mutant = Mutant {
    file: "gpu/kernels/pisa_select.cu",
    runner: Runner::KernelText { kernel: "pisa_select", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of PISA's tail (`pisa_tail.cu`: the blocks' statistics, `H̄`, the tail's softmax and its
/// merge into the exact part), launched in-process on a device with the tail's killing cases.
const PISA_TAIL: Mutant = Mutant {
    file: "gpu/kernels/pisa_tail.cu",
    runner: Runner::KernelText { kernel: "pisa_tail", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of PISA's tail backward (`pisa_tail_bwd.cu`: the rows' dQ, the blocks' dμ and dV^Σ, G and
/// the scatter onto the keys), launched in-process on a device with the tail backward's killing cases.
const PISA_TAIL_BWD: Mutant = Mutant {
    file: "gpu/kernels/pisa_tail_bwd.cu",
    runner: Runner::KernelText { kernel: "pisa_tail_bwd", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of PISA's covariance-aware selection (`pisa_covariance.cu`: the blocks' spreads, the pooled
/// queries' coefficients and the spread term both selectors add), launched in-process on a device with its killing
/// cases.
const PISA_COVARIANCE: Mutant = Mutant {
    file: "gpu/kernels/pisa_covariance.cu",
    runner: Runner::KernelText { kernel: "pisa_covariance", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of HiLS's chunk summaries and router (`hils.cu`), launched in-process on a device with the
/// router's killing cases.
const HILS: Mutant =
    Mutant { file: "gpu/kernels/hils.cu", runner: Runner::KernelText { kernel: "hils", mode: None }, ..FLASH_FWD };

/// Base entry for mutants of E30's block masses (`pisa_mass.cu`), launched in-process on a device with the masses'
/// killing cases.
const PISA_MASS: Mutant = Mutant {
    file: "gpu/kernels/pisa_mass.cu",
    runner: Runner::KernelText { kernel: "pisa_mass", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of the forward kernel's block-sparse mode (`BLOCK_SPARSE`: the tile cursor over the key
/// blocks a query block lists), launched in-process on a device with block-sparse killing cases.
const BLOCK_SPARSE_FWD: Mutant =
    Mutant { runner: Runner::KernelText { kernel: "flash_fwd", mode: Some("BLOCK_SPARSE") }, ..FLASH_FWD };

/// Base entry for mutants of the sm_90a forward (`gpu/kernels/flash_fwd_sm90.cu`) in its block-sparse mode, the one
/// the wrappers launch, run on a device of compute capability 9.0 with its own killing cases and suites.
const WGMMA_FWD: Mutant = Mutant {
    file: "gpu/kernels/flash_fwd_sm90.cu",
    runner: Runner::KernelText { kernel: "flash_fwd_sm90", mode: Some("BLOCK_SPARSE") },
    ..FLASH_FWD
};

/// Base entry for mutants of the Hopper helpers (`gpu/kernels/sm90.cuh`) as the sm_90a forward runs them.
const SM90_FWD: Mutant = Mutant { file: SM90_HEADER, ..WGMMA_FWD };

/// Base entry for mutants of the backward's `wgmma` KV owner (`gpu/kernels/flash_bwd_sm90.cu`) in its block-sparse
/// mode, the one the wrappers launch, run on a device of compute capability 9.0 with its own killing cases and suites.
const WGMMA_BWD: Mutant = Mutant {
    file: "gpu/kernels/flash_bwd_sm90.cu",
    runner: Runner::KernelText { kernel: "flash_bwd_sm90", mode: Some("BLOCK_SPARSE") },
    ..FLASH_FWD
};

/// Base entry for mutants of `gpu/kernels/common.cuh` (prepended to every attention kernel) that the forward's
/// block-sparse mode runs: the tile cursor walking a query block's key-block list, the CTA's list and masked tiles.
const CURSOR_FWD: Mutant = Mutant { file: COMMON_HEADER, ..BLOCK_SPARSE_FWD };

/// Base entry for mutants of the FlashAttention backward kernels, launched in-process on a device.
const FLASH_BWD: Mutant = Mutant {
    file: "gpu/kernels/flash_bwd.cu",
    runner: Runner::KernelText { kernel: "flash_bwd", mode: None },
    ..FLASH_FWD
};

/// Base entry for mutants of the backward kernels' block-sparse mode (`BLOCK_SPARSE`: the CSR transpose, the KV
/// owner's walk over its CSR row, the dQ owner's and the deterministic dQ sum's walk over the query block's list),
/// launched in-process on a device with block-sparse backward killing cases.
const BLOCK_SPARSE_BWD: Mutant =
    Mutant { runner: Runner::KernelText { kernel: "flash_bwd", mode: Some("BLOCK_SPARSE") }, ..FLASH_BWD };

/// Base entry for mutants of the tile cursor as the backward's block-sparse mode uses it.
const CURSOR_BWD: Mutant = Mutant { file: COMMON_HEADER, ..BLOCK_SPARSE_BWD };

/// Base entry for mutants of a kernel text that break one of its compiled variants: the GPU crate's compile-only test
/// (NVRTC, no device; `gpu/tests/it/compile_only.rs`) must reject them.
const COMPILE_ONLY: Mutant = Mutant {
    runner: Runner::Scratch { package: "attnproof-gpu", target: Some("it"), filter: Some("compile_only::") },
    ..FLASH_BWD
};

/// The kernel-text mutants: the compile-only one, then the forward kernel's, then the backward kernels'.
pub const MUTANTS: &[Mutant] = &[
    // --- Compiled by NVRTC without a device ---
    Mutant {
        name: "kernel-dq-row-groups-ignore-narrow-chunks",
        description: "bwd_kv's dQ step always takes two row groups, so a 32-column chunk splits into parts of 8 columns",
        find: "#define DQ_ROW_GROUPS ((CHUNK / (KV_WARPS / 2)) % 16 == 0 ? 2 : 4)",
        replace: "#define DQ_ROW_GROUPS 2",
        ..COMPILE_ONLY
    },
    // --- flash_fwd.cu, launched on a device ---
    Mutant {
        name: "gpu-fwd-causal-top-left",
        description: "Causal aligned top-left instead of bottom-right: wrong whenever Lq ≠ Lk",
        find: "return Diagonal{len_k - len_q};",
        replace: "return Diagonal{0};",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-strided-window-visible-early",
        description: "NSA's compressed branch sees each window one token before it has ended (E18's c·s + l − 1 ≤ t off by one)",
        find: "Diagonal{p.diag_offset, p.diag_stride}",
        replace: "Diagonal{p.diag_offset + 1, p.diag_stride}",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-strided-floor-as-truncation",
        description: "The strided diagonal divides toward zero: tokens in the last stride before the first window ends see window 0",
        find: "x >= 0 ? x / stride : -((stride - 1 - x) / stride)",
        replace: "x / stride",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-strided-diagonal-slope-one",
        description: "The forward's mask steps the diagonal by one key per row, right for bottom-right masks, wrong for strided ones",
        find: "const int diag = diag_of.at(row_t + 16 * mi + 8 * r);",
        replace: "const int diag = diag_of.at(row_t) + 16 * mi + 8 * r;",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-tail-mask-off-by-one",
        description: "The key past the end is visible in the tail tile (it reads the zero-filled padding row: a spurious s = 0)",
        find: "const bool vis = j < len_k &&",
        replace: "const bool vis = j <= len_k &&",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-missing-rescale",
        description: "ℓ and A are never rescaled when the running max moves",
        find: "ex2_approx_ftz(__fsub_rn(ml_run[mi][r], ml_new[r]))",
        replace: "1.f",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-accumulator-not-rescaled",
        description: "A is not rescaled, ℓ is (a half-done rescale)",
        find: "acc[mi][n][0] = __fmul_rn(acc[mi][n][0], rescale[mi][0]);",
        replace: "",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-missing-max-subtraction",
        description: "p = 2^(s·L) without subtracting the running max: overflows at large logits, and LSE loses m",
        find: "ex2_approx_ftz(__fmaf_rn(x, LOG2E_F, -ml_new[r]))",
        replace: "ex2_approx_ftz(__fmul_rn(x, LOG2E_F))",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-lse-base-2",
        description: "LSE in base 2",
        find: "__fadd_rn(m_run[mi][r], logf(l))",
        replace: "__fadd_rn(m_run[mi][r], log2f(l))",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-scale-one-over-d",
        description: "Scale 1/d instead of 1/√d",
        find: "float x = __fmul_rn(s[mi][n][e], scale);",
        replace: "float x = __fmul_rn(s[mi][n][e], scale * scale);",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-gqa-head-map",
        description: "GQA maps query head h to KV head h % group instead of h / group",
        find: "const int kv_head = head / p.group;",
        replace: "const int kv_head = head % p.group;",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-last-kv-tile-skipped",
        description: "The last KV tile of every CTA is skipped",
        find: "__device__ __forceinline__ int next() { return t_next < tile_hi ? t_next++ : -1; }",
        replace: "__device__ __forceinline__ int next() { return t_next + 1 < tile_hi ? t_next++ : -1; }",
        file: COMMON_HEADER,
        ..FLASH_FWD
    },
    Mutant {
        name: "gpu-fwd-only-first-warp-writes",
        description: "Only warp 0 stores its rows (the others' stay NaN-poisoned)",
        find: "if (!rows.place(row, at)) continue;",
        replace: "if (!rows.place(row, at) || wrow > 0) continue;",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-row-max-half-reduced",
        description: "The row max is reduced over half the quad only",
        find: "m_new[r] = fmaxf(m_new[r], __shfl_xor_sync(0xffffffffu, m_new[r], 2));",
        replace: "",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-row-sum-half-reduced",
        description: "ℓ is reduced over half the quad only",
        find: "l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 2));",
        replace: "",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-stale-k-tile",
        description: "The last tile's K is never fetched: its scores use the previous tile's keys",
        find: "if (t_next >= 0) {",
        replace: "if (t_next >= 0 && t_next + 1 < cta.tile_hi) {",
        ..FLASH_FWD
    },
    Mutant {
        name: "gpu-fwd-interior-ignores-tail",
        description: "The tail tile is taken for an interior one (no mask past Lk)",
        find: "const bool interior = key0 + block_n <= len_k && key0 >= diag_hi - win_left &&",
        replace: "const bool interior = key0 >= diag_hi - win_left &&",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-interior-ignores-diagonal",
        description: "Diagonal tiles are taken for interior ones when their first key is visible",
        find: "(long long)key0 + block_n - 1 <= diag_lo + win_right;",
        replace: "(long long)key0 <= diag_lo + win_right;",
        ..FORWARD_COMMON
    },
    Mutant {
        name: "gpu-fwd-window-left-ignored",
        description: "The window's left bound is not applied inside a tile",
        find: "&& j >= diag - win_left;",
        replace: ";",
        ..FORWARD_COMMON
    },
    // --- flash_fwd.cu in its block-sparse mode, launched on a device ---
    Mutant {
        name: "gpu-bsa-fwd-list-off-by-one",
        description: "Every listed key block is read as the next one (the list's indices off by one)",
        find: "const int t = block * tiles_per_block + sub;",
        replace: "const int t = (block + 1) * tiles_per_block + sub;",
        ..CURSOR_FWD
    },
    Mutant {
        name: "gpu-bsa-fwd-pad-read-as-block-0",
        description: "A −1 pad is read as key block 0, so block 0 is visited once per pad slot",
        find: "const int block = __ldg(list + slot);",
        replace: "const int block = max(__ldg(list + slot), 0);",
        ..CURSOR_FWD
    },
    Mutant {
        name: "gpu-bsa-fwd-half-of-each-128-block",
        description: "Only the first 64-key tile of every 128-key block is visited",
        find: "if (++sub == tiles_per_block) {",
        replace: "if (++sub >= 1) {",
        ..CURSOR_FWD
    },
    Mutant {
        name: "gpu-bsa-fwd-query-lists-read-per-kv-head",
        description: "Lists given per query head are read per KV head (query head h uses the list of head h / group)",
        find: "head / lists.heads_per_list, block_lists",
        replace: "head / group, block_lists",
        ..BLOCK_SPARSE_FWD
    },
    Mutant {
        name: "gpu-bsa-fwd-first-sequence-lists",
        description: "Every sequence reads the first sequence's lists",
        find: "block_lists + seq * lists.seq_stride",
        replace: "block_lists + 0 * lists.seq_stride",
        ..CURSOR_FWD
    },
    Mutant {
        name: "gpu-bsa-fwd-listed-tiles-unmasked",
        description: "A listed tile is never masked: the diagonal block sees future keys, windows and the key tail vanish",
        find: "const bool interior = key0 + block_n <= len_k &&",
        replace: "const bool interior = true || key0 + block_n <= len_k &&",
        ..CURSOR_FWD
    },
    // --- flash_fwd_sm90.cu (wgmma) in its block-sparse mode, launched on a 9.0 device ---
    Mutant {
        name: "gpu-sm90-swizzle-dropped",
        description: "Tiles are stored unswizzled while the descriptors say 128-byte swizzle: the products read the wrong units",
        find: "return ((u % 8) ^ (r % 8)) << 4;",
        replace: "return (u % 8) << 4;",
        ..SM90_FWD
    },
    Mutant {
        name: "gpu-sm90-last-product-skipped",
        description: "The last tile's P·V is never issued: each row loses its last visited block's values",
        find: "    if (pending_pv) {\n        // The last tile's product",
        replace: "    if (false) {\n        // The last tile's product",
        ..WGMMA_FWD
    },
    Mutant {
        name: "gpu-sm90-v-descriptor-offsets-swapped",
        description: "V's leading and stride byte offsets swapped (the order the PTX ISA's N-major layout fixes)",
        find: "BLOCK_N * SW_ROW, 1024));",
        replace: "1024, BLOCK_N * SW_ROW));",
        ..WGMMA_FWD
    },
    Mutant {
        name: "gpu-sm90-q-k-step-half",
        description: "Q's descriptor advances 16 bytes per k-step instead of 32: scores use the wrong head-dim columns",
        find: "smem_desc(q_addr + (kk / 4) * (BLOCK_M * SW_ROW) + (kk % 4) * 32, 16, 1024)",
        replace: "smem_desc(q_addr + (kk / 4) * (BLOCK_M * SW_ROW) + (kk % 4) * 16, 16, 1024)",
        ..WGMMA_FWD
    },
    Mutant {
        name: "gpu-sm90-second-warpgroup-reads-first-rows",
        description: "Both warpgroups read Q's first 64 rows: rows 64 to 127 of every tile get rows 0 to 63's scores",
        find: "smem_u32(q_s) + (warp / 4) * 64 * SW_ROW;",
        replace: "smem_u32(q_s) + 0 * 64 * SW_ROW;",
        ..WGMMA_FWD
    },
    Mutant {
        name: "gpu-sm90-diagonal-unmasked",
        description: "Every tile is taken for one all rows see whole: the diagonal block sees future keys, the tail garbage",
        find: "if (cta.sees_whole_tile(key0, BLOCK_N, win_left, win_right)) {",
        replace: "if (true) {",
        ..WGMMA_FWD
    },
    Mutant {
        name: "gpu-sm90-tma-box-one-tile-late",
        description: "The tensor copies read each listed block's successor: every row attends to the wrong keys",
        find: "c * 64, t * BLOCK_N, full + 8 * stage);",
        replace: "c * 64, (t + 1) * BLOCK_N, full + 8 * stage);",
        ..WGMMA_FWD
    },
    Mutant {
        name: "gpu-sm90-tma-v-through-k-map",
        description: "V's tiles are copied through K's tensor map: the products weight the keys instead of the values",
        find: "issue(v_tiles, v_issued, v_map,",
        replace: "issue(v_tiles, v_issued, k_map,",
        ..WGMMA_FWD
    },
    Mutant {
        name: "gpu-sm90-tma-maps-of-the-first-sequence",
        description: "Every sequence's CTAs use the first sequence's tensor maps: later sequences attend to its keys",
        find: "32ll * ((long long)seq * (gridDim.y / group)",
        replace: "32ll * ((long long)0 * (gridDim.y / group)",
        ..WGMMA_FWD
    },
    // --- flash_bwd_sm90.cu (the wgmma KV owner) in its block-sparse mode, launched on a 9.0 device ---
    Mutant {
        name: "gpu-sm90-bwd-dq-columns-of-warpgroup-0",
        description: "Both warpgroups multiply dS by K's first 64 columns: dQ's columns 64 to 127 repeat 0 to 63",
        find: "const unsigned k_dq_addr = smem_u32(k_s) + wg * (KV_TILE * SW_ROW);",
        replace: "const unsigned k_dq_addr = smem_u32(k_s) + 0 * (KV_TILE * SW_ROW);",
        ..WGMMA_BWD
    },
    Mutant {
        name: "gpu-sm90-bwd-keys-of-warpgroup-0",
        description: "Both warpgroups take the tile's first 64 keys for S and dP: keys 64 to 127 get keys 0 to 63's",
        find: "const unsigned k_addr = smem_u32(k_s) + wg * 64 * SW_ROW;",
        replace: "const unsigned k_addr = smem_u32(k_s) + 0 * 64 * SW_ROW;",
        ..WGMMA_BWD
    },
    Mutant {
        name: "gpu-sm90-bwd-ds-unswizzled",
        description: "dSᵀ is stored unswizzled while its descriptor says 128-byte swizzle: dQ reads the wrong queries",
        find: "const unsigned addr = row_addr + ((n ^ g) << 4);",
        replace: "const unsigned addr = row_addr + (n << 4);",
        ..WGMMA_BWD
    },
    Mutant {
        name: "gpu-sm90-bwd-do-k-step-half",
        description: "dO's descriptor for dV advances 8 query rows per k-step instead of 16: dV pairs P with the wrong rows",
        find: "do_addr + kk * 16 * SW_ROW, Q_TILE * SW_ROW, 1024",
        replace: "do_addr + kk * 8 * SW_ROW, Q_TILE * SW_ROW, 1024",
        ..WGMMA_BWD
    },
    Mutant {
        name: "gpu-sm90-bwd-dp-over-d",
        description: "dPᵀ = V dOᵀ is reduced over d instead of dv: wrong (or past V's tile) when the head dims differ",
        find: "transposed_scores<HEAD_DIM_V_PAD / 16>(dpt, v_addr, do_addr);",
        replace: "transposed_scores<HEAD_DIM_PAD / 16>(dpt, v_addr, do_addr);",
        ..WGMMA_BWD
    },
    Mutant {
        name: "gpu-sm90-bwd-interior-by-warpgroup",
        description: "A warp decides whether it needs the mask from its warpgroup's first key: the diagonal goes unmasked",
        find: "warp_keys_interior(sv, rows_here, row0, key0 + wk, diag, win_left, win_right)",
        replace: "warp_keys_interior(sv, rows_here, row0, key0 + wg * 64, diag, win_left, win_right)",
        ..WGMMA_BWD
    },
    Mutant {
        name: "gpu-sm90-bwd-warp-keys-of-warpgroup-0",
        description: "A warp's keys are counted inside warpgroup 0: the mask and dK, dV's rows of warpgroup 1 are wrong",
        find: "const int wk = wg * 64 + wrow;",
        replace: "const int wk = wrow;",
        ..WGMMA_BWD
    },
    Mutant {
        name: "gpu-sm90-bwd-dq-one-warpgroup",
        description: "One warpgroup computes dQ at every head dim: at d = 128 its columns 64 to 127 stay zero",
        find: "if (wg < SM90_DQ_GROUPS) {",
        replace: "if (wg < 1) {",
        ..WGMMA_BWD
    },
    Mutant {
        name: "gpu-sm90-bwd-dq-last-column-block-dropped",
        description: "The dQ stores count a thread's 8-column blocks inside d rounding down: its last block is never added",
        find: "const int cols_live = (d - dq_c + 7) / 8;",
        replace: "const int cols_live = (d - dq_c) / 8;",
        ..WGMMA_BWD
    },
    // --- flash_bwd.cu in its block-sparse mode, launched on a device ---
    Mutant {
        name: "gpu-bsa-bwd-list-off-by-one",
        description: "The dQ owner and the deterministic dQ sum read every listed key block as the next one",
        find: "const int t = block * tiles_per_block + sub;",
        replace: "const int t = (block + 1) * tiles_per_block + sub;",
        ..CURSOR_BWD
    },
    Mutant {
        name: "gpu-bsa-bwd-pad-read-as-block-0",
        description: "A −1 pad of a query block's list is read as key block 0 by the dQ owner and the dQ sum",
        find: "const int block = __ldg(list + slot);",
        replace: "const int block = max(__ldg(list + slot), 0);",
        ..CURSOR_BWD
    },
    Mutant {
        name: "gpu-bsa-bwd-csr-drops-last-row",
        description: "The CSR transpose leaves out the last key block's row: nobody computes its dK, dV",
        find: "if (key_block >= lists.kv_blocks) return;",
        replace: "if (key_block >= lists.kv_blocks - 1) return;",
        ..BLOCK_SPARSE_BWD
    },
    Mutant {
        name: "gpu-bsa-bwd-csr-drops-last-query-block",
        description: "The CSR transpose never lists the last query block",
        find: "const bool listed = qb < lists.q_blocks &&",
        replace: "const bool listed = qb + 1 < lists.q_blocks &&",
        ..BLOCK_SPARSE_BWD
    },
    Mutant {
        name: "gpu-bsa-bwd-csr-scan-drops-earlier-warps",
        description: "The CSR offsets leave out the counts of earlier warps: rows past the 32nd overlap earlier ones",
        find: "(warp > 0 ? warp_totals[warp - 1] : 0) + incl - x;",
        replace: "0 + incl - x;",
        ..BLOCK_SPARSE_BWD
    },
    Mutant {
        name: "gpu-bsa-bwd-csr-order-reversed",
        description: "A CSR row's query blocks are written in descending order inside each group of 32",
        find: "csr_q_blocks[written + __popc(ballot & ((1u << lane) - 1u))] = qb;",
        replace: "csr_q_blocks[written + __popc(ballot) - 1 - __popc(ballot & ((1u << lane) - 1u))] = qb;",
        ..BLOCK_SPARSE_BWD
    },
    Mutant {
        name: "gpu-bsa-bwd-dq-partials-share-a-slot",
        description: "The deterministic dQ mode stores every listed KV tile's partial in the slot of the first entry",
        find: "return list_position(list, width, t / kv_tiles_per_block) * kv_tiles_per_block + t % kv_tiles_per_block;",
        replace: "return t % kv_tiles_per_block;",
        ..BLOCK_SPARSE_BWD
    },
    Mutant {
        name: "gpu-bsa-bwd-dq-sum-reads-the-next-slot",
        description: "The deterministic dQ sum reads each listed tile's partial one slot past the one written",
        find: "__device__ __forceinline__ int last_position() const { return slot * tiles_per_block + sub - 1; }",
        replace: "__device__ __forceinline__ int last_position() const { return slot * tiles_per_block + sub; }",
        ..CURSOR_BWD
    },
    Mutant {
        name: "gpu-bsa-bwd-query-lists-read-per-kv-head",
        description: "The KV owner reads the CSR row of the query head's KV head where the lists are per query head",
        find: "head / lists.heads_per_list) * lists.kv_blocks",
        replace: "head / group) * lists.kv_blocks",
        ..BLOCK_SPARSE_BWD
    },
    Mutant {
        name: "gpu-bsa-bwd-first-query-tile-of-each-block",
        description: "The KV owner visits only the first 64-row query tile of every listed 128-row query block",
        find: "csr_offsets[csr_row + 1] - csr_lo, lists.q_block / Q_TILE);",
        replace: "csr_offsets[csr_row + 1] - csr_lo, 1);",
        ..BLOCK_SPARSE_BWD
    },
    Mutant {
        name: "gpu-bsa-bwd-dq-owner-half-of-each-128-block",
        description: "The dQ owner visits only the first 64-key tile of every listed 128-key block",
        find: "lists.width, lists.tiles_per_block);",
        replace: "lists.width, 1);",
        ..BLOCK_SPARSE_BWD
    },
    Mutant {
        name: "gpu-bsa-bwd-first-sequence-csr",
        description: "Every sequence's KV owner walks the first sequence's CSR rows",
        find: "const long long csr_row = ((long long)blockIdx.z * lists.list_heads",
        replace: "const long long csr_row = ((long long)0 * lists.list_heads",
        ..BLOCK_SPARSE_BWD
    },
    Mutant {
        name: "gpu-bsa-bwd-listed-tiles-unmasked",
        description: "The KV owner never masks a visited tile: the diagonal block sees future keys in dK, dV",
        find: "const bool interior = rows_here == Q_TILE && wkey0 + 16 <= sv.len_k &&",
        replace: "const bool interior = true || rows_here == Q_TILE && wkey0 + 16 <= sv.len_k &&",
        ..BLOCK_SPARSE_BWD
    },
    // --- pisa_select.cu (pyramid selection), launched on a device ---
    Mutant {
        name: "gpu-pisa-candidates-descending",
        description: "The kept nodes expand in descending order, so a level's candidates are not ascending and equal \
                      scores break to the higher node",
        find: "candidates[t] = kept[t / params.branching] * params.branching + t % params.branching;",
        replace: "candidates[t] = kept[n_kept - 1 - t / params.branching] * params.branching + t % params.branching;",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa-current-leaf-not-forced",
        description: "Only the first and the previous leaf (and their ancestors) are forced; the current leaf must win its slot",
        find: "for (int f = 0; f < 3; ++f) forced |=",
        replace: "for (int f = 0; f < 2; ++f) forced |=",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa-previous-leaf-not-forced",
        description: "The previous leaf is replaced by the current one among the forced leaves",
        find: "current > 0 ? current - 1 : 0, current};",
        replace: "current, current};",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa-causal-one-key-late",
        description: "A candidate whose first key is the one just after the query block's position is scored and can be kept",
        find: "if ((long long)node * span <= position) total =",
        replace: "if ((long long)node * span <= position + 1) total =",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa-expansion-drops-last-node",
        description: "Expanding a kept node never reaches the last node of the level below (beta off by one at a level's end)",
        find: "min(params.branching, below - last * params.branching);",
        replace: "min(params.branching, below - 1 - last * params.branching);",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa-level-mean-full-child-counts",
        description: "A coarser node's mean weighs a partial last child as if it held a full span of keys",
        find: "sum += (double)pisa_count(child, span_below, len_k) * below[",
        replace: "sum += (double)span_below * below[",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa-lse-ignores-weights",
        description: "The LSE over child means forgets the children's key counts (a partial child weighs as much as a full one)",
        find: "const double e = valid ? w_l * exp(x - m) : 0.0;",
        replace: "const double e = valid ? exp(x - m) : 0.0;",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa2-variance-sign",
        description: "PISA-2 subtracts half the variance instead of adding it",
        find: "return mean + 0.5 * (pisa_warp_sum(v) / weights);",
        replace: "return mean - 0.5 * (pisa_warp_sum(v) / weights);",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa-group-sum-misses-a-head",
        description: "The GQA sum of a leaf's LSE or PISA-2 score leaves out the group's first query head",
        find: "group_total += pisa_pooled_score<R>(p.scoring, x, w, weights);",
        replace: "if (h0 + hh > 0) group_total += pisa_pooled_score<R>(p.scoring, x, w, weights);",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa-node-gathers-the-wrong-head",
        description: "A coarser node's LSE or PISA-2 score reads every head's children from the batch's first head",
        find: "const int head_lane = hh_l * items;",
        replace: "const int head_lane = 0;",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa-keeps-one-less",
        description: "Every level keeps K - 1 nodes when the forced ones leave room",
        find: "const int room = max(0, params.keep - n_forced);",
        replace: "const int room = max(0, params.keep - 1 - n_forced);",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa-leaf-lse-drops-last-key",
        description: "A leaf's raw-key scores leave out its last key",
        find: "last = min(first + p.bsa.kv_block, src.len_k);",
        replace: "last = min(first + p.bsa.kv_block, src.len_k) - 1;",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa1-reads-the-leaf-means",
        description: "PISA-1 scores every node by the leaf mean of the same index instead of its own level's mean",
        find: "const double* means = pooled + pisa_level_offset(params, level, seq, kv);",
        replace: "const double* means = pooled + pisa_level_offset(params, 0, seq, kv);",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa-query-of-the-next-block",
        description: "The descent reads the next query block's pooled queries",
        find: "* params.bsa.n_query_blocks + a) * d + c];",
        replace: "* params.bsa.n_query_blocks + min(a + 1, params.bsa.n_query_blocks - 1)) * d + c];",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa1-group-sum-misses-a-head",
        description: "PISA-1's summed query leaves out the group's first query head",
        find: "for (int h = 0; h < group; ++h) sum += pooled_query(h, i);",
        replace: "for (int h = 1; h < group; ++h) sum += pooled_query(h, i);",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa1-causal-one-key-late",
        description: "PISA-1 scores a candidate whose first key is the one just after the query block's position",
        find: "const bool eligible = (long long)candidates[i] * span <= position;",
        replace: "const bool eligible = (long long)candidates[i] * span <= position + 1;",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa1-scatter-skips-the-last-step",
        description: "PISA-1's reduce-scatter stops one step early: each candidate's dot product misses half the lanes",
        find: "    pisa_scatter_step<1>(v, lane);\n",
        replace: "",
        ..PISA_SELECT
    },
    Mutant {
        name: "gpu-pisa-forced-rank-counted",
        description: "Forced candidates count in the unforced ones' ranks, so a level keeps fewer than K when they \
                      outscore the rest",
        find: "rank += !is_forced(candidates[j]) && better(",
        replace: "rank += better(",
        ..PISA_SELECT
    },
    // --- pisa_mass.cu (E30's block masses), launched on a device ---
    Mutant {
        name: "gpu-mass-causal-one-key-late",
        description: "Each row sees one key past its bottom-right diagonal",
        find: "return max(0, min(len_k, row + 1 + len_k - len_q));",
        replace: "return max(0, min(len_k, row + 2 + len_k - len_q));",
        ..PISA_MASS
    },
    Mutant {
        name: "gpu-mass-leaf-by-query-block",
        description: "A tile's probabilities go to the leaf numbered by the query block size instead of the leaf size",
        find: "out[tile / params.kv_block] += total;",
        replace: "out[tile / params.q_block] += total;",
        ..PISA_MASS
    },
    Mutant {
        name: "gpu-mass-first-head-only",
        description: "Every pair of a row reads the group's first query head",
        find: "const int r = row0 + pp / group, h = kv * group + pp % group;",
        replace: "const int r = row0 + pp / group, h = kv * group;",
        ..PISA_MASS
    },
    Mutant {
        name: "gpu-mass-averages-rows-that-see-nothing",
        description: "The masses are averaged over every row of the block, also those that see no key",
        find: "const double counted = (double)(rows - first_seeing) * group;",
        replace: "const double counted = (double)rows * group;",
        ..PISA_MASS
    },
    Mutant {
        name: "gpu-mass-unnormalized",
        description: "Pass 2 adds the exponentials without dividing by the row's sum",
        find: "part += exp(mass_score(q_col, q_stride, k_tile + j * d, d, params.scale) - m) / l;",
        replace: "part += exp(mass_score(q_col, q_stride, k_tile + j * d, d, params.scale) - m);",
        ..PISA_MASS
    },
    Mutant {
        name: "gpu-mass-sum-not-rescaled",
        description: "A new maximum does not rescale the running sum of exponentials",
        find: "l = l * exp(m - x) + 1.0;",
        replace: "l = l + 1.0;",
        ..PISA_MASS
    },
    Mutant {
        name: "gpu-mass-last-tile-dropped",
        description: "Pass 2 stops one tile early: the keys of the last tile add nothing",
        find: "// Pass 2: each tile's probabilities, summed over the chunk's pairs into the tile's leaf.\n        for (int tile = 0; tile < last_end; tile += MASS_KEYS) {",
        replace: "// Pass 2: each tile's probabilities, summed over the chunk's pairs into the tile's leaf.\n        for (int tile = 0; tile + MASS_KEYS < last_end; tile += MASS_KEYS) {",
        ..PISA_MASS
    },
    Mutant {
        name: "gpu-mass-unscaled-scores",
        description: "The scores are the raw dot products, without the softmax scale",
        find: "return dot * scale;",
        replace: "return dot;",
        ..PISA_MASS
    },
    Mutant {
        name: "gpu-mass-first-chunk-queries",
        description: "Every chunk of (row, head) pairs loads the first chunk's queries",
        find: "const int t = i / d, c = i % d, pp = chunk + t;",
        replace: "const int t = i / d, c = i % d, pp = t;",
        ..PISA_MASS
    },
    // --- pisa_covariance.cu (PISA's covariance-aware selection, E24), launched on a device ---
    Mutant {
        name: "gpu-pisa-cov-hbar-not-subtracted",
        description: "The spread is the norm of H_b instead of H_b − H̄",
        find: "for (int e = threadIdx.x; e < d * dv; e += SPREAD_THREADS) sh.m[(e / dv) * row + e % dv] -= h_bar[e];",
        replace: "",
        ..PISA_COVARIANCE
    },
    Mutant {
        name: "gpu-pisa-cov-deviation-without-mean",
        description: "H_b and H̄ sum k_j v_jᵀ instead of (k_j − μ_b) v_jᵀ",
        find: "sh.dev[e] = (double)to_f32(k[(long long)key * fp.k_row + c]) - mean;",
        replace: "sh.dev[e] = (double)to_f32(k[(long long)key * fp.k_row + c]);",
        ..PISA_COVARIANCE
    },
    Mutant {
        name: "gpu-pisa-cov-one-step-short",
        description: "The power iteration stops one step before the oracle's count",
        find: "for (int step = 0; step < E24_POWER_STEPS; ++step) {",
        replace: "for (int step = 0; step < E24_POWER_STEPS - 1; ++step) {",
        ..PISA_COVARIANCE
    },
    Mutant {
        name: "gpu-pisa-cov-first-chunk-only",
        description: "H_b and H̄'s partial sums take the first 8 keys of their range only",
        find: "for (int j0 = j_begin; j0 < j_end; j0 += SPREAD_CHUNK) {",
        replace: "for (int j0 = j_begin; j0 < min(j_end, j_begin + SPREAD_CHUNK); j0 += SPREAD_CHUNK) {",
        ..PISA_COVARIANCE
    },
    Mutant {
        name: "gpu-pisa-cov-values-of-head-0",
        description: "Every KV head's spread reads the values of KV head 0",
        find: "v_head = v + (fp.varlen ? (long long)cu_k[seq] * fp.v_row : seq * fp.v_batch) + kv * fp.v_head;",
        replace: "v_head = v + (fp.varlen ? (long long)cu_k[seq] * fp.v_row : seq * fp.v_batch);",
        ..PISA_COVARIANCE
    },
    Mutant {
        name: "gpu-pisa-cov-hbar-last-range-dropped",
        description: "H̄ leaves out the partial sum of the sequence's last range of 16 key blocks",
        find: "for (int r = 0; r < ranges; ++r) total +=",
        replace: "for (int r = 0; r < ranges - 1; ++r) total +=",
        ..PISA_COVARIANCE
    },
    Mutant {
        name: "gpu-pisa-cov-squared-norm",
        description: "The coefficient takes ‖q̄‖² instead of ‖q̄‖",
        find: "coefficients[i] = gamma_scale * sqrt(squares);",
        replace: "coefficients[i] = gamma_scale * squares;",
        ..PISA_COVARIANCE
    },
    Mutant {
        name: "gpu-pisa-cov-term-one-head",
        description: "The spread term sums the first query head of the GQA group only",
        find: "for (int h = 0; h < group; ++h) term += log(",
        replace: "for (int h = 0; h < 1; ++h) term += log(",
        ..PISA_COVARIANCE
    },
    Mutant {
        name: "gpu-pisa-cov-term-full-count",
        description: "A short last block counts as a whole block in the spread term",
        find: "const double n = (double)min(params.kv_block, len_k - b * params.kv_block);",
        replace: "const double n = (double)params.kv_block;",
        ..PISA_COVARIANCE
    },
    Mutant {
        name: "gpu-pisa-cov-term-first-block-spread",
        description: "Every key block's term reads the spread of the KV head's first block",
        find: "const double s = spreads[((long long)seq * params.n_heads_kv + kv) * params.n_key_blocks + b];",
        replace: "const double s = spreads[((long long)seq * params.n_heads_kv + kv) * params.n_key_blocks];",
        ..PISA_COVARIANCE
    },
    Mutant {
        name: "gpu-pisa-cov-term-without-count",
        description: "The spread term drops the block's key count: ln(c s) instead of ln(n + c s)",
        find: "term += log(n + c[(long long)h * params.n_query_blocks] * s);",
        replace: "term += log(c[(long long)h * params.n_query_blocks] * s);",
        ..PISA_COVARIANCE
    },
    // --- pisa_tail_bwd.cu (PISA's tail backward), launched on a device ---
    Mutant {
        name: "gpu-pisa-tail-bwd-shared-term-dropped-from-dq",
        description: "dQ leaves out the shared term's A α H̄ dO",
        find: "const double add = fma(t.row_lse[i] * p.scale, t.w[i * TAILB_QS + c], acc[j]);",
        replace: "const double add = acc[j];",
        ..PISA_TAIL_BWD
    },
    Mutant {
        name: "gpu-pisa-tail-bwd-through-dropped",
        description: "The tail weights' score gradient leaves out dO·h, the shared term's part of each tail block's weight",
        find: "g = a * (count * (dp[j] - t.row_delta[r]) + t.row_through[r]);",
        replace: "g = a * (count * (dp[j] - t.row_delta[r]));",
        ..PISA_TAIL_BWD
    },
    Mutant {
        name: "gpu-pisa-tail-bwd-listed-block-in-tail",
        description: "The rows kernel takes the listed blocks into the tail too",
        find: "t.tail[idx] = row_sees && bb < blocks && !listed[b] && t.row_lse[i] != (double)NEG_INF;",
        replace: "t.tail[idx] = row_sees && bb < blocks && t.row_lse[i] != (double)NEG_INF;",
        ..PISA_TAIL_BWD
    },
    Mutant {
        name: "gpu-pisa-tail-bwd-blocks-one-head",
        description: "The blocks' gradients sum the first query head of the GQA group only",
        find: "for (int hg = 0; hg < fp.group; ++hg) {",
        replace: "for (int hg = 0; hg < 1; ++hg) {",
        ..PISA_TAIL_BWD
    },
    Mutant {
        name: "gpu-pisa-tail-bwd-g-last-range-dropped",
        description: "G's sum leaves out the last range of 4096 rows",
        find: "for (int s = 0; s < ranges && s < row_splits; ++s)",
        replace: "for (int s = 0; s < ranges - 1 && s < row_splits; ++s)",
        ..PISA_TAIL_BWD
    },
    Mutant {
        name: "gpu-pisa-tail-bwd-g-scatter-uncentred-keys",
        description: "dV's share of G multiplies the keys instead of their deviations from the block mean",
        find: "? (double)to_f32(k[k_base + (long long)j * fp.k_row + c]) - means[(long long)b * d + c]",
        replace: "? (double)to_f32(k[k_base + (long long)j * fp.k_row + c])",
        ..PISA_TAIL_BWD
    },
    Mutant {
        name: "gpu-pisa-tail-bwd-value-sum-gradient-dropped",
        description: "The blocks' dV^Σ is never accumulated",
        find: "ds[j] = fma(t.pa[i * TAILB_PS + bb], x, ds[j]);",
        replace: "",
        ..PISA_TAIL_BWD
    },
    Mutant {
        name: "gpu-pisa-tail-bwd-mean-gradient-not-divided",
        description: "dK takes dμ_b whole instead of dμ_b / |B_b| per key",
        find: "const double add = d_means[(long long)b * d + c] / count + s[jj] * per_block;",
        replace: "const double add = d_means[(long long)b * d + c] + s[jj] * per_block;",
        ..PISA_TAIL_BWD
    },
    Mutant {
        name: "gpu-pisa-tail-bwd-weight-without-lse",
        description: "The tail weights are e^{α q·μ_b}, not divided by the row's denominator",
        find: "a = exp(p.scale * score[j] - t.row_lse[r]);",
        replace: "a = exp(p.scale * score[j]);",
        ..PISA_TAIL_BWD
    },
    Mutant {
        name: "gpu-pisa-tail-bwd-dq-overwrites-exact-part",
        description: "dQ's tail part replaces the exact part's dQ instead of adding to it",
        find: "if (add != 0.0) *dq_out = to_elem_rn((double)to_f32(*dq_out) + add);",
        replace: "if (add != 0.0) *dq_out = to_elem_rn(add);",
        ..PISA_TAIL_BWD
    },
    Mutant {
        name: "gpu-pisa-tail-bwd-rows-last-block-tile-skipped",
        description: "The rows kernel leaves out the last, partial tile of tail blocks",
        find: "for (int b0 = 0; b0 < tail_end; b0 += TAILB_TILE) {",
        replace: "for (int b0 = 0; b0 + TAILB_TILE <= tail_end; b0 += TAILB_TILE) {",
        ..PISA_TAIL_BWD
    },
    Mutant {
        name: "gpu-pisa-tail-bwd-blocks-last-row-tile-skipped",
        description: "The blocks kernel leaves out each head's last, partial tile of rows",
        find: "for (int row0 = 0; row0 < r.len_q; row0 += TAILB_TILE) {",
        replace: "for (int row0 = 0; row0 + TAILB_TILE <= r.len_q; row0 += TAILB_TILE) {",
        ..PISA_TAIL_BWD
    },
    // --- pisa_tail.cu (PISA's first-order tail), launched on a device ---
    Mutant {
        name: "gpu-pisa-tail-listed-block-in-tail",
        description: "The tail ignores the lists: a listed block enters the softmax twice, exactly and as its summary",
        find: "const bool tail = b < whole_r[e / 2] && !listed[b];",
        replace: "const bool tail = b < whole_r[e / 2];",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-hbar-term-missing",
        description: "The shared first-order term α qᵀH̄ / C is left out (the zeroth-order tail)",
        find: "const double tail = o_tail + p.scale * (double)acc_h[n][2 * r + e] / p.kv_block;",
        replace: "const double tail = o_tail;",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-hbar-over-one-block-fewer",
        description: "H̄ divides the sum of the H_b by one block fewer than the sequence has",
        find: "const double x = total / n_blocks;",
        replace: "const double x = total / max(n_blocks - 1, 1);",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-deviation-not-subtracted",
        description: "H̄ sums k_j v_jᵀ instead of (k_j − μ_b) v_jᵀ: the centring term is left out",
        find: "partial[(long long)c * dv + e] = sum[n][2 * r + i] - centre;",
        replace: "partial[(long long)c * dv + e] = sum[n][2 * r + i];",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-hbar-last-stage-dropped",
        description: "H̄'s products stop at the last whole stage of 32 keys: a key range's last keys are left out",
        find: "const int n_stages = (keys + HBAR_KEYS - 1) / HBAR_KEYS;",
        replace: "const int n_stages = keys / HBAR_KEYS;",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-hbar-last-range-dropped",
        description: "H̄'s sum leaves out the last range of 4096 keys of a sequence longer than one range",
        find: "const int ranges = (len_k + HBAR_SPLIT_KEYS - 1) / HBAR_SPLIT_KEYS;",
        replace: "const int ranges = max((len_k + HBAR_SPLIT_KEYS - 1) / HBAR_SPLIT_KEYS - 1, 1);",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-hbar-partial-block-as-whole",
        description: "The centring term weighs the partial last block's means by C keys instead of its own count",
        find: "const int count = min(p.kv_block, len_k - b * p.kv_block);",
        replace: "const int count = p.kv_block;",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-mean-key-low-half-dropped",
        description: "The split mean key keeps only its high half: μ_lo is written as 0",
        find: "key_row[fp.d + c] = to_elem_rn(x - (double)to_f32(hi));",
        replace: "key_row[fp.d + c] = to_elem_rn(0.0);",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-value-sums-for-means",
        description: "The pooled values are the blocks' value sums instead of their means",
        find: "for (int c = threadIdx.x; c < fp.dv; c += POOL_THREADS) value_row[c] = to_elem_rn(mean_value[c]);",
        replace: "for (int c = threadIdx.x; c < fp.dv; c += POOL_THREADS) value_row[c] = to_elem_rn(mean_value[c] * p.kv_block);",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-last-partial-tile-skipped",
        description: "The tail's softmax skips a last tile of fewer than 64 pooled keys",
        find: "const int n_tiles = (tail_end + TAIL_N - 1) / TAIL_N;",
        replace: "const int n_tiles = tail_end / TAIL_N;",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-exact-weight-inverted",
        description: "The merge weighs the exact part by e^{M − lse_E} instead of e^{lse_E − M}",
        find: "const double we = exp(lse_exact - top), wt = exp(lse_tail - top);",
        replace: "const double we = exp(top - lse_exact), wt = exp(lse_tail - top);",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-rescale-forgotten",
        description: "The tail's accumulators are not rescaled when a tile raises the row's maximum",
        find: "rescale_accumulators(acc, rescale);",
        replace: "",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-block-size-left-out",
        description: "The tail's log-mass forgets |B_b| = C: each tail block weighs like one key",
        find: "logf(l[r])) + log((double)p.kv_block);",
        replace: "logf(l[r]));",
        ..PISA_TAIL
    },
    Mutant {
        name: "gpu-pisa-tail-hbar-high-half-twice",
        description: "The shared term reads H̄'s high half in place of its low half: H̄ counted about twice",
        find: "const int source = kr < HEAD_DIM_PAD ? c : d + c;",
        replace: "const int source = c;",
        ..PISA_TAIL
    },
    // --- hils.cu (HiLS's chunk summaries and router, E21), launched on a device ---
    Mutant {
        name: "gpu-hils-entropy-sign",
        description: "The entropy is summed with the wrong sign: H(p_b) = +Σ p ln p",
        find: "if (pj > 0.0) entropy -= pj * log(pj);",
        replace: "if (pj > 0.0) entropy += pj * log(pj);",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-chunk-eligible-one-step-early",
        description: "A query may retrieve the chunk its local window starts in",
        find: "const int eligible = start / p.chunk_size;",
        replace: "const int eligible = min(start / p.chunk_size + 1, p.n_chunks);",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-landmark-over-the-next-chunk",
        description: "The landmark's softmax reads the next chunk's keys (where the sequence has them)",
        find: "const elem_t* k_g = k + k_base + kv * fp.k_head + (long long)key0 * fp.k_row;",
        replace: "const elem_t* k_g = k + k_base + kv * fp.k_head + (long long)(key0 + count < len ? key0 + count : key0) * fp.k_row;",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-ties-to-the-higher-chunk",
        description: "Every chunk but the first ranks one ulp above its score: equal scores go to the higher chunk",
        find: "stream_offer(score, b, b < eligible, room, best_s, best_i, count);",
        replace: "stream_offer(b > 0 ? nextafter(score, __longlong_as_double(0x7ff0000000000000LL)) : score, b, b < eligible, room, best_s, best_i, count);",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-slope-key-unnormalized",
        description: "The slope key sums e^{s_j − m} k_j without dividing by the mass",
        find: "const double pj = scores[j] / mass;",
        replace: "const double pj = scores[j] / (mass > 1.0 ? 1.0 : mass);",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-router-without-entropy",
        description: "The router scores omit the entropy intercept: r_ib = α q_i·k'_b",
        find: "score = p.scale * dot + s_b[d];",
        replace: "score = p.scale * dot;",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-gqa-landmarks-of-the-kv-head",
        description: "Every query head of a group reads the landmarks of the group's first head",
        find: "const long long row = ((long long)seq * gridDim.y + h) * p.n_chunks + b;\n    for (int c = threadIdx.x; c < d; c += HILS_THREADS) landmark[c] = (double)to_f32(landmarks[row * d + c]);",
        replace: "const long long row = ((long long)seq * gridDim.y + h) * p.n_chunks + b;\n    const long long first = ((long long)seq * gridDim.y + kv * fp.group) * p.n_chunks + b;\n    for (int c = threadIdx.x; c < d; c += HILS_THREADS) landmark[c] = (double)to_f32(landmarks[first * d + c]);",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-last-pad-unwritten",
        description: "The router never pads the last slot of a list that is not full",
        find: "for (int w = count + lane; w < p.top_k; w += 32) list[w] = -1;",
        replace: "for (int w = count + lane; w < p.top_k - 1; w += 32) list[w] = -1;",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-second-lane-group-skipped",
        description: "The router offers only the first 32 eligible chunks",
        find: "for (int b0 = 0; b0 < eligible; b0 += 32) {",
        replace: "for (int b0 = 0; b0 < min(eligible, 32); b0 += 32) {",
        ..HILS
    },
    // --- hils.cu's factorized output (E21), launched on a device ---
    Mutant {
        name: "gpu-hils-output-window-not-chunk-aligned",
        description: "The output's local window starts at i + 1 − w, not extended down to its chunk's first key",
        find: "const int start = (max(0, i + 1 - p.local_window) / p.chunk_size) * p.chunk_size;\n    hils_attend(row,",
        replace: "const int start = max(0, i + 1 - p.local_window);\n    hils_attend(row,",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-output-sum-not-rescaled",
        description: "The online softmax adds a group's weights to l without rescaling it to the new maximum",
        find: "st.l = st.l * carry + warp_sum_fixed(w);",
        replace: "st.l = st.l + warp_sum_fixed(w);",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-output-numerator-not-rescaled",
        description: "The online softmax keeps the value numerators at the old maximum",
        find: "for (int t = 0; t < HILS_MAX_DV / 32; ++t) st.a[t] *= carry;",
        replace: "for (int t = 0; t < HILS_MAX_DV / 32; ++t) st.a[t] *= 1.0;",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-output-chunk-average-unnormalized",
        description: "A retrieved chunk enters with its numerator, not its average ō = a / l",
        find: "row.a[t] = row.a[t] * keep + (chunk.a[t] / chunk.l) * enter;",
        replace: "row.a[t] = row.a[t] * keep + chunk.a[t] * enter;",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-output-exact-mass-always",
        description: "Every chunk weighs by its exact log-mass: HiLS's surrogate r_ib is never used",
        find: "if (p.exact_mass) {",
        replace: "if (true) {",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-output-lse-without-log-sum",
        description: "The LSE is the running maximum alone, without ln l",
        find: "if (lane == 0) lse[lse_base + i] = (float)(row.m + log(row.l));",
        replace: "if (lane == 0) lse[lse_base + i] = (float)(row.m);",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-output-last-slot-skipped",
        description: "The output never reads a list's last slot: a full list loses its highest chunk",
        find: "for (int slot = 0; slot < p.top_k; ++slot) {",
        replace: "for (int slot = 0; slot < p.top_k - 1; ++slot) {",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-output-first-kv-head",
        description: "Every query head's output reads KV head 0's keys and values",
        find: "const int kv = h / fp.group;\n    const int lane",
        replace: "const int kv = 0 * (h / fp.group);\n    const int lane",
        ..HILS
    },
    Mutant {
        name: "gpu-hils-output-warp-sum-not-broadcast",
        description: "Each lane keeps its own partial of a group's weight sum: only lane 0's columns are normalized right",
        find: "return __shfl_sync(0xffffffffu, x, 0);",
        replace: "return x;",
        ..HILS
    },
    // --- bsa_select.cu (block selection), launched on a device ---
    Mutant {
        name: "gpu-bsa-select-tie-to-higher-index",
        description: "Equal pooled scores break to the higher block index",
        find: "return s > t || (s == t && i < j);",
        replace: "return s > t || (s == t && i > j);",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-select-first-block-not-forced",
        description: "The rounds kernel counts key block 0 as forced but never marks it: wide lists lose it and one entry",
        find: "if (range.first && threadIdx.x == 0) chosen[0] = 1;",
        replace: "if (range.first && threadIdx.x == 0) chosen[0] = 0;",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-select-first-block-competes",
        description: "Block 0 is never forced: it competes like any other block (both kernels)",
        find: "range.first = (params.force_first && local_from > 0) ? 1 : 0;",
        replace: "range.first = 0;",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-stream-tile-last-key-unloaded",
        description: "The streaming kernel leaves the last pooled key block of every tile at zero",
        find: "const bool valid = r < tile_rows;",
        replace: "const bool valid = r < tile_rows - 1;",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-stream-keys-of-the-first-query-block",
        description: "The streaming CTA walks only the key blocks its first query block may choose",
        find: "key_end = max(key_end, ranges[j].local_from);",
        replace: "key_end = ranges[0].local_from;",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-stream-rank-counts-itself",
        description: "A chosen block's place in the ascending list counts itself, one slot too far",
        find: "rank += __shfl_sync(0xffffffffu, best_i[m], t) < best_i[m];",
        replace: "rank += __shfl_sync(0xffffffffu, best_i[m], t) <= best_i[m];",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-stream-grid-skips-first-group",
        description: "The heavy-first order is off by one CTA: the first eight query blocks get no list",
        find: "const int a0 = params.first_query_block + (gridDim.x - 1 - blockIdx.x) * STREAM_QUERIES;",
        replace: "const int a0 = params.first_query_block + (gridDim.x - blockIdx.x) * STREAM_QUERIES;",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-stream-range-offset-dropped",
        description: "The streaming kernel ignores its launch's first query block: every range selects the first blocks",
        find: "const int a0 = params.first_query_block + (gridDim.x - 1 - blockIdx.x) * STREAM_QUERIES;",
        replace: "const int a0 = (gridDim.x - 1 - blockIdx.x) * STREAM_QUERIES;",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-pool-range-offset-dropped",
        description: "The query pooling ignores its launch's first query block: only the first range's blocks are pooled",
        find: "const int a = params.first_query_block + it.block;",
        replace: "const int a = it.block;",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-pool-first-item-only",
        description: "Each query pooling CTA pools only its first item: with fewer CTAs than items, later blocks stay unpooled",
        find: "for (long long item = blockIdx.x; item < items; item += gridDim.x) {\n        const PoolItem it = pool_item(item, blocks, heads);\n        const int a",
        replace: "for (long long item = blockIdx.x; item < items && item < gridDim.x; item += gridDim.x) {\n        const PoolItem it = pool_item(item, blocks, heads);\n        const int a",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-select-range-offset-dropped",
        description: "The rounds kernel ignores its launch's first query block: the later ranges' lists are never written",
        find: "const int a = params.first_query_block + blockIdx.x, kv = blockIdx.y, seq = blockIdx.z;",
        replace: "const int a = blockIdx.x, kv = blockIdx.y, seq = blockIdx.z;",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-stream-score-reads-next-key",
        description: "The streaming kernel scores each key block of a tile with the next block's pooled keys",
        find: "const double* k_row = k_tile + (8 * warp + g) * row + t;",
        replace: "const double* k_row = k_tile + min(8 * warp + g + 1, STREAM_KEYS - 1) * row + t;",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-stream-last-pad-unwritten",
        description: "The streaming kernel never pads the last slot of a list that is not full",
        find: "for (int w = written + lane; w < params.top_k; w += 32) list[w] = -1;",
        replace: "for (int w = written + lane; w < params.top_k - 1; w += 32) list[w] = -1;",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-stream-merge-skips-second-half",
        description: "The streaming kernel offers only the first 32 key blocks of each 64-block tile to the lists",
        find: "for (int half = 0; half < STREAM_KEYS / 32; ++half) {",
        replace: "for (int half = 0; half < 1; ++half) {",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-select-group-sum-misses-a-head",
        description: "The GQA group sum of the pooled scores leaves out the group's first query head",
        find: "for (int h = 0; h < group; ++h) {",
        replace: "for (int h = 1; h < group; ++h) {",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-select-causal-one-block-late",
        description: "Causal eligibility admits one key block past the one holding the query block's last visible key",
        find: "(int)(last_key / params.kv_block) + 1);",
        replace: "(int)(last_key / params.kv_block) + 2);",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-pool-partial-block-full-count",
        description: "The last, partial block's mean (keys and queries) divides by the block size instead of its count",
        find: "out[c] = sum / count;",
        replace: "out[c] = sum / block_rows;",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-select-last-pad-unwritten",
        description: "The rounds kernel never pads the last slot of a list that is not full",
        find: "for (int w = written + threadIdx.x; w < params.top_k; w += SEL_THREADS) list[w] = -1;",
        replace: "for (int w = written + threadIdx.x; w < params.top_k - 1; w += SEL_THREADS) list[w] = -1;",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-pool-last-row-group-dropped",
        description: "The pooled mean leaves out the last row group's sum (an eighth of a 128-row block's rows)",
        find: "for (int group = 0; group < groups; ++group) sum += group_sums[group * d + c];",
        replace: "for (int group = 0; group < groups - 1; ++group) sum += group_sums[group * d + c];",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-select-score-reads-next-block",
        description: "The rounds kernel scores each interleaved key block with the next block's pooled keys",
        find: "row[i] = min(base + i, eligible - 1);",
        replace: "row[i] = min(base + i + 1, eligible - 1);",
        ..BSA_SELECT
    },
    Mutant {
        name: "gpu-bsa-select-local-block-missing",
        description: "One local block fewer is forced than configured",
        find: "const int local_from = eligible - min(params.force_local, eligible);",
        replace: "const int local_from = eligible - min(params.force_local, eligible) + 1;",
        ..BSA_SELECT
    },
    // --- nsa_compress.cu (NSA's compressed keys and values), launched on a device ---
    Mutant {
        name: "gpu-nsa-compress-window-starts-one-token-late",
        description: "Window c starts at token c·s + 1 instead of c·s (the last window then reads past its sequence)",
        find: "(long long)c * params.compress_stride * row_stride + chunk * 8;",
        replace: "((long long)c * params.compress_stride + 1) * row_stride + chunk * 8;",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-last-row-dropped",
        description: "Each window sums its first l − 1 rows only (the mean still divides by l)",
        find: "for (int i = 0; i < params.compress_len; ++i) add_row(",
        replace: "for (int i = 0; i < params.compress_len - 1; ++i) add_row(",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-mean-divides-by-stride",
        description: "The mean divides the window's sum by the stride s instead of the window length l",
        find: "weighted ? acc[e] : acc[e] / params.compress_len;",
        replace: "weighted ? acc[e] : acc[e] / params.compress_stride;",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-f32-accumulation",
        description: "The mean's sum is accumulated in f32 (within the bound, off the recipe's bits; the transpose's too)",
        find: "for (int e = 0; e < 8; ++e) acc[e] += (double)to_f32(e8[e]);",
        replace: "for (int e = 0; e < 8; ++e) acc[e] = (double)((float)acc[e] + to_f32(e8[e]));",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-values-take-key-weights",
        description: "φ_V reads φ_K's weights (the start of the weights) instead of its own",
        find: "compress_window(v, v_cmp, value_weights(weights, params),",
        replace: "compress_window(v, v_cmp, weights,",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-varlen-last-window-missing",
        description: "Each packed sequence's last window is never written",
        find: "windows = cu_windows[seq + 1] - cu_windows[seq];",
        replace: "windows = cu_windows[seq + 1] - cu_windows[seq] - 1;",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-dense-heads-collide",
        description: "Every KV head of a dense problem writes head 0's compressed rows",
        find: "out_at = (((long long)seq * params.n_heads_kv + h) * windows + c) * cols;",
        replace: "out_at = (((long long)seq * params.n_heads_kv) * windows + c) * cols;",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-weighted-flag-of-keys",
        description: "The values' map is taken as weighted or mean by the keys' flag",
        find: "params.weighted_values, cu_k, cu_windows, params,",
        replace: "params.weighted_keys, cu_k, cu_windows, params,",
        ..NSA_COMPRESS
    },
    // --- nsa_gates.cu (NSA's gated sum and its gradients), launched on a device ---
    Mutant {
        name: "gpu-nsa-gates-sigmoid-of-the-negated-logit",
        description: "Every gate is σ(−x) instead of σ(x)",
        find: "return 1.0f / (1.0f + expf(-x));",
        replace: "return 1.0f / (1.0f + expf(x));",
        ..NSA_GATES
    },
    Mutant {
        name: "gpu-nsa-gates-gate-of-the-next-branch",
        description: "The gated sum weighs each branch by the next branch's gate",
        find: "const float g = gate_sigmoid(to_f32(logits[row * 3 + b]));\n        float x[8];",
        replace: "const float g = gate_sigmoid(to_f32(logits[row * 3 + (b + 1) % 3]));\n        float x[8];",
        ..NSA_GATES
    },
    Mutant {
        name: "gpu-nsa-gates-window-branch-dropped",
        description: "The gated sum leaves out the window branch",
        find: "acc[e] = b == 0 ? g * x[e] : fmaf(g, x[e], acc[e]);",
        replace: "acc[e] = b == 0 ? g * x[e] : (b == 2 ? acc[e] : fmaf(g, x[e], acc[e]));",
        ..NSA_GATES
    },
    Mutant {
        name: "gpu-nsa-gates-derivative-as-one-minus",
        description: "σ'(x) as σ(x)(1 − σ(x)): equal in exact arithmetic, every digit lost where the gate rounds to 1",
        find: "d_logits[row * 3 + b] = g * gate_sigmoid(-x) * dot;",
        replace: "d_logits[row * 3 + b] = g * (1.0f - g) * dot;",
        ..NSA_GATES
    },
    Mutant {
        name: "gpu-nsa-gates-branch-gradient-ungated",
        description: "Each branch receives dO instead of σ(x_b) dO",
        find: "dob[e] = g * dy[e];",
        replace: "dob[e] = dy[e];",
        ..NSA_GATES
    },
    Mutant {
        name: "gpu-nsa-gates-dot-skips-the-last-shuffle",
        description: "The logit gradient's dot product stops one shuffle short: neighbouring lanes' partial sums only",
        find: "for (int offset = 16; offset > 0; offset /= 2) dot +=",
        replace: "for (int offset = 16; offset > 1; offset /= 2) dot +=",
        ..NSA_GATES
    },
    Mutant {
        name: "gpu-nsa-gates-last-row-skipped",
        description: "The gated sum's last row of O is never written",
        find: "if (row >= params.rows || lane >= dv / 8) return;",
        replace: "if (row >= params.rows - 1 || lane >= dv / 8) return;",
        ..NSA_GATES
    },
    Mutant {
        name: "gpu-nsa-gates-backward-last-columns-unwritten",
        description: "The backward's last 8 columns of each row (dO_b and their part of the dot product) are left out",
        find: "const bool owns = lane < dv / 8;",
        replace: "const bool owns = lane < dv / 8 - 1;",
        ..NSA_GATES
    },
    // --- nsa_select.cu (NSA's block scores and top-n lists), launched on a device ---
    Mutant {
        name: "gpu-nsa-select-remap-window-shifted",
        description: "The remap starts each block's windows l'/s − 1 later (the paper's indexing trap, E19): the windows \
                      reaching into a block from before it are lost",
        find: "const int c_lo = max(w0, first);",
        replace: "const int c_lo = max(w0, first + lb / s - 1);",
        ..NSA_SELECT
    },
    Mutant {
        name: "gpu-nsa-select-group-sum-one-head",
        description: "The group sum keeps the group's first head only",
        find: "for (int h = 1; h < group; ++h) summed",
        replace: "for (int h = 1; h < 1; ++h) summed",
        ..NSA_SELECT
    },
    Mutant {
        name: "gpu-nsa-select-window-visible-early",
        description: "A compression window counts for a token one step before it ends",
        find: "const int x = t + 1 - p.compress_len;",
        replace: "const int x = t + 2 - p.compress_len;",
        ..NSA_SELECT
    },
    Mutant {
        name: "gpu-nsa-select-lse-of-the-first-head",
        description: "Every head of the group normalizes by the group's first head's LSE_cmp",
        find: "lse[sq.lse_base + (long long)(kv * group + r % group) * fp.lse_head",
        replace: "lse[sq.lse_base + (long long)(kv * group) * fp.lse_head",
        ..NSA_SELECT
    },
    Mutant {
        name: "gpu-nsa-select-tie-to-the-higher-block",
        description: "Equal block scores go to the higher block",
        find: "return s > t || (s == t && i < j);",
        replace: "return s > t || (s == t && i > j);",
        ..NSA_SELECT
    },
    Mutant {
        name: "gpu-nsa-select-forced-initial-missing",
        description: "The first blocks are no longer forced (they compete by score)",
        find: "const int n_initial = min(params.n_forced_initial, current + 1);",
        replace: "const int n_initial = min(0, current + 1);",
        ..NSA_SELECT
    },
    Mutant {
        name: "gpu-nsa-select-keeps-one-fewer",
        description: "The top-n keeps one scored block fewer than the list has room for",
        find: "const int want = max(0, min(params.n_selected - n_forced, cand_hi - cand_lo));",
        replace: "const int want = max(0, min(params.n_selected - n_forced - 1, cand_hi - cand_lo));",
        ..NSA_SELECT
    },
    Mutant {
        name: "gpu-nsa-select-last-window-tile-skipped",
        description: "The scoring stops one tile of 64 compressed keys short",
        find: "const int n_tiles = (visible + SEL_WINDOWS - 1) / SEL_WINDOWS;",
        replace: "const int n_tiles = visible / SEL_WINDOWS;",
        ..NSA_SELECT
    },
    Mutant {
        name: "gpu-nsa-compress-transpose-first-window-skipped",
        description: "A token's transpose starts one window late: the earliest window that holds it adds nothing",
        find: "const int c_lo = t >= l ? (t - l + s) / s : 0;",
        replace: "const int c_lo = t >= l ? (t - l + 2 * s) / s : 1;",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-transpose-last-window-dropped",
        description: "The sequence's last complete window gives its tokens nothing in the transpose",
        find: "const int c_hi = min(t / s, windows - 1);",
        replace: "const int c_hi = min(t / s, windows - 2);",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-transpose-weight-mirrored",
        description: "The transpose weighs a token by its position counted from the window's other end",
        find: "const double w = weights[t - c * s];",
        replace: "const double w = weights[l - 1 - (t - c * s)];",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-transpose-mean-over-the-stride",
        description: "The mean's transpose divides by the stride s instead of the window length l",
        find: "const double y = weighted ? acc[e] : acc[e] / l;",
        replace: "const double y = weighted ? acc[e] : acc[e] / s;",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-matrix-rows-unstacked",
        description: "The learned matrix reads the window's rows column-major (row j·l + i of W for token i, column j) \
                      instead of stacking them row after row (i·d + j)",
        find: "const double* w = weights + ((long long)i * cols + j) * cols + chunk * 8;",
        replace: "const double* w = weights + ((long long)j * params.compress_len + i) * cols + chunk * 8;",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-matrix-transpose-not-transposed",
        description: "The matrix's transpose onto the tokens multiplies by W[i·d + k, j] instead of W[i·d + j, k]",
        find: "acc[e] = fma(w_rows[(long long)e * cols + k], g, acc[e]);",
        replace: "acc[e] = fma(weights[((long long)(t - c * s) * cols + k) * cols + chunk * 8 + e], g, acc[e]);",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-values-matrix-at-the-keys-offset",
        description: "φ_V's weights are looked up l entries on even when φ_K is a matrix: the values read the keys' \
                      matrix",
        find: "return weights + (params.weighted_keys == MAP_MATRIX ?",
        replace: "return weights + (params.weighted_keys == MAP_WEIGHTS ?",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-map-gradient-first-head-only",
        description: "The learned matrix's gradient sums the first KV head's windows only",
        find: "for (int h = 0; h < n_heads; ++h) {",
        replace: "for (int h = 0; h < 1; ++h) {",
        ..NSA_COMPRESS
    },
    Mutant {
        name: "gpu-nsa-compress-map-gradient-last-sequence-dropped",
        description: "The learned matrix's gradient leaves out the batch's last sequence",
        find: "for (int seq = 0; seq < n_sequences; ++seq) {",
        replace: "for (int seq = 0; seq < n_sequences - 1; ++seq) {",
        ..NSA_COMPRESS
    },
    // --- nsa_selected.cu (NSA's selected attention), launched on a device ---
    Mutant {
        name: "gpu-nsa-selected-list-entry-skipped",
        description: "After a block its listing rows step two entries on: every other listed block is lost",
        find: "if (member_a) after_a = list_a[ptr_a + 1];",
        replace: "if (member_a) after_a = list_a[min(ptr_a + 2, n)];",
        ..NSA_SELECTED
    },
    Mutant {
        name: "gpu-nsa-selected-unlisted-rows-attend",
        description: "Every row attends to every block of the union, listed by its token or not (a neighbour's block leaks)",
        find: "const ListedDiagonals diag{member_a ? token_a : -1, member_b ? token_b : -1};",
        replace: "const ListedDiagonals diag{token_a, token_b};",
        ..NSA_SELECTED
    },
    Mutant {
        name: "gpu-nsa-selected-sees-the-next-token",
        description: "The causal mask inside a listed block lets each token see the token after it",
        find: "const ListedDiagonals diag{member_a ? token_a : -1, member_b ? token_b : -1};",
        replace: "const ListedDiagonals diag{member_a ? token_a + 1 : -1, member_b ? token_b + 1 : -1};",
        ..NSA_SELECTED
    },
    Mutant {
        name: "gpu-nsa-selected-block-end-ignored",
        description: "A tile runs to the sequence's end instead of its block's: a short block's tile takes in the next \
                      block's keys",
        find: "const int key_end = min(block * lb + lb, len);",
        replace: "const int key_end = len;",
        ..NSA_SELECTED
    },
    Mutant {
        name: "gpu-nsa-selected-last-tile-of-block-skipped",
        description: "A block of several tiles ends one tile early",
        find: "const bool last_of_block = key0 + SLC_KEYS >= key_end;",
        replace: "const bool last_of_block = key0 + 2 * SLC_KEYS >= key_end;",
        ..NSA_SELECTED
    },
    Mutant {
        name: "gpu-nsa-selected-second-rows-ignored-by-the-skip",
        description: "A warp skips a tile unless one of its first eight rows lists the block",
        find: "const bool warp_attends = __any_sync(0xffffffffu, member_a || member_b);",
        replace: "const bool warp_attends = __any_sync(0xffffffffu, member_a);",
        ..NSA_SELECTED
    },
    Mutant {
        name: "gpu-nsa-selected-union-of-warp-zero",
        description: "The union's next block is the first warp's alone: blocks only other warps' tokens list are lost",
        find: "for (int w = 1; w < SLC_THREADS / 32; ++w) next_block = min(next_block, warp_next[parity][w]);",
        replace: "",
        ..NSA_SELECTED
    },
    Mutant {
        name: "gpu-nsa-selected-diagonal-tile-unmasked",
        description: "The mask-free path also takes the tile that holds a row's own token (its future keys leak)",
        find: "const bool sees_all_a = !valid_a || (member_a && key0 + SLC_KEYS - 1 <= token_a);",
        replace: "const bool sees_all_a = !valid_a || (member_a && key0 <= token_a);",
        ..NSA_SELECTED
    },
    Mutant {
        name: "gpu-nsa-selected-output-head-of-the-token-index",
        description: "Rows are written to the head of their token index in the CTA instead of their head in the group",
        find: "out.head = first_head + row % group;",
        replace: "out.head = first_head + (row / group) % group;",
        ..NSA_SELECTED
    },
    // --- nsa_selected_bwd.cu (NSA's selected attention backward), launched on a device ---
    Mutant {
        name: "gpu-nsa-selected-bwd-csr-row-drops-its-last-token",
        description: "The KV owner stops one token short of its block's CSR row (E20's transpose missing a query)",
        find: "const int csr_hi = min(csr_offsets[csr_row + 1], csr_lo + seg_tokens);",
        replace: "const int csr_hi = min(csr_offsets[csr_row + 1] - 1, csr_lo + seg_tokens);",
        ..NSA_SELECTED_BWD
    },
    Mutant {
        name: "gpu-nsa-selected-bwd-first-segment-dropped",
        description: "dK and dV of a block split into segments leave out the first segment's sums",
        find: "for (int s = 0; s < n_segments; ++s) {",
        replace: "for (int s = 1; s < n_segments; ++s) {",
        ..NSA_SELECTED_BWD
    },
    Mutant {
        name: "gpu-nsa-selected-bwd-diagonal-tile-unmasked",
        description: "The mask-free path also takes a warp whose keys reach past the tile's first token (future keys leak)",
        find: "if (wkey0 + 16 <= key_end && wkey0 + 15 <= tok_t[0]) {",
        replace: "if (wkey0 + 16 <= key_end && wkey0 <= tok_t[0]) {",
        ..NSA_SELECTED_BWD
    },
    Mutant {
        name: "gpu-nsa-selected-bwd-sees-the-next-token",
        description: "Each gathered row's diagonal is its token plus one: every row sees the key after its token",
        find: "__device__ __forceinline__ int at(int row) const { return tokens[row / group]; }",
        replace: "__device__ __forceinline__ int at(int row) const { return tokens[row / group] + 1; }",
        ..NSA_SELECTED_BWD
    },
    Mutant {
        name: "gpu-nsa-selected-bwd-tile-drops-its-last-row",
        description: "A row tile loads one (token, head) row fewer: the last head of its last token is left out of dK, dV, dQ",
        find: "const int rows = tokens_here * group;",
        replace: "const int rows = tokens_here * group - 1;",
        ..NSA_SELECTED_BWD
    },
    Mutant {
        name: "gpu-nsa-selected-bwd-dq-to-the-head-of-the-token-index",
        description: "A row's dQ goes to the head of its token index in the tile instead of its head in the group",
        find: "sv.q_base + (long long)(first_head + row % group) * q_head + (long long)token * q_row;",
        replace: "sv.q_base + (long long)(first_head + (row / group) % group) * q_head + (long long)token * q_row;",
        ..NSA_SELECTED_BWD
    },
    Mutant {
        name: "gpu-nsa-selected-bwd-block-end-ignored",
        description: "A KV tile runs to the sequence's end instead of its block's: a short block's tile takes in the next block's keys",
        find: "__device__ __forceinline__ int block_end(int block, int lb, int len) { return min(block * lb + lb, len); }",
        replace: "__device__ __forceinline__ int block_end(int block, int lb, int len) { return len; }",
        ..NSA_SELECTED_BWD
    },
    Mutant {
        name: "gpu-nsa-selected-bwd-partial-slot-ignores-the-tile",
        description: "The deterministic dQ partial of a block's tiles shares one slot: a block of several tiles keeps its last",
        find: "block, lb, t) * tiles_per_block + sub",
        replace: "block, lb, t) * tiles_per_block",
        ..NSA_SELECTED_BWD
    },
    Mutant {
        name: "gpu-nsa-selected-bwd-dk-unscaled",
        description: "dK of a block of one segment is written without the score scale α̂",
        find: "part_k + key * d, d, scale, direct};",
        replace: "part_k + key * d, d, 1.0f, direct};",
        ..NSA_SELECTED_BWD
    },
    Mutant {
        name: "gpu-nsa-selected-bwd-delta-of-the-first-head",
        description: "Every gathered row takes D of its token's first head (E9's rank-one term of the wrong row)",
        find: "dl = delta[at];",
        replace: "dl = delta[at - (long long)(r % group) * lse_head];",
        ..NSA_SELECTED_BWD
    },
    // --- dsa_index.cu (DSA's lightning indexer and exact top-k), launched on a device ---
    Mutant {
        name: "gpu-dsa-index-tie-to-higher-index",
        description: "Of the tokens whose scores equal the threshold, the last ones in index order are kept",
        find: "if (masked[e] == prefix) take = equal_rank++ < remaining;",
        replace: "if (masked[e] == prefix) take = equal_rank++ >= found[2] - remaining;",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-diagonal-never-scored",
        description: "Causal off by one in the scores: a token's own key is never written to its score row",
        find: "if (qi < nq && key <= t0 + qi) {",
        replace: "if (qi < nq && key < t0 + qi) {",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-own-token-not-eligible",
        description: "Causal off by one in the selection: a token selects among the keys before it only",
        find: "select_row(rows + qi * stride, t0 + qi + 1, p.top_k,",
        replace: "select_row(rows + qi * stride, t0 + qi, p.top_k,",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-relu-missing",
        description: "The ReLU is left out of the first row group's logits: negative logits subtract",
        find: "v[n][c] = w00 * fmaxf(acc[0][n][c], 0.f);",
        replace: "v[n][c] = w00 * acc[0][n][c];",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-one-weight-per-warp",
        description: "Every head row of a warp's first m tile is weighted by the warp's first head's weight",
        find: "const float w00 = w_s[warp * 32 + g], w01 = w_s[warp * 32 + g + 8];",
        replace: "const float w00 = w_s[warp * 32], w01 = w_s[warp * 32];",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-top-k-keeps-k-minus-one",
        description: "The radix select takes one token fewer than k (the row's last entry is never written)",
        find: "int remaining = top_k;",
        replace: "int remaining = top_k - 1;",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-upper-heads-dropped",
        description: "A token's score leaves out the second warp's heads (32 to 63)",
        find: "(part_s[(2 * qi) * IDX_KEYS + col] + part_s[(2 * qi + 1) * IDX_KEYS + col]) + 0.f;",
        replace: "(part_s[(2 * qi) * IDX_KEYS + col] + 0.f) + 0.f;",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-bin-taken-whole",
        description: "The radix select stops at the first bin that holds what is needed, taking its lowest indices",
        find: "if (count == remaining) break;",
        replace: "if (count >= remaining) break;",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-last-key-tile-skipped",
        description: "The key tile holding the group's last token is never scored",
        find: "const int n_tiles = t_last / IDX_KEYS + 1;",
        replace: "const int n_tiles = t_last / IDX_KEYS;",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-short-row-drops-its-last-token",
        description: "A row with at most k visible tokens lists all but the last, then -1",
        find: "for (int i = tid; i < top_k; i += IDX_THREADS) out[i] = i < n ? i : -1;",
        replace: "for (int i = tid; i < top_k; i += IDX_THREADS) out[i] = i < n - 1 ? i : -1;",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-middle-level-shift",
        description: "The second radix level reads bits 11 to 21 instead of 10 to 20, overlapping the first",
        find: "const int shift = level == 0 ? 21 : level == 1 ? 10 : 0;",
        replace: "const int shift = level == 0 ? 21 : level == 1 ? 11 : 0;",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-wgmma-accumulates-across-tiles",
        description: "The wgmma logits' first k-step adds to the previous key tile's accumulators instead of starting \
                      from zero",
        find: "                                     kk > 0);",
        replace: "                                     true);",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-wgmma-query-blocks-swapped",
        description: "The wgmma path stores each token's heads 16 to 31 where heads 0 to 15 belong (and the reverse): \
                      the logits meet the wrong heads' weights",
        find: "const int qi = w / 2, h = 32 * (w % 2) + 16 * (b % 2) + r;",
        replace: "const int qi = w / 2, h = 32 * (w % 2) + 16 * (1 - b % 2) + r;",
        ..DSA_INDEX
    },
    Mutant {
        name: "gpu-dsa-index-wgmma-key-step-halved",
        description: "The wgmma path's key operand advances 8 columns per k-step instead of 16: the logits pair \
                      query columns with the wrong key columns",
        find: "smem_desc(k_addr + (kk / 4) * (IDX_KEYS * SW_ROW) + (kk % 4) * 32, 16, 1024),",
        replace: "smem_desc(k_addr + (kk / 4) * (IDX_KEYS * SW_ROW) + (kk % 4) * 16, 16, 1024),",
        ..DSA_INDEX
    },
    // --- dsa_sparse.cu (DSA's token-sparse attention forward), launched on a device ---
    Mutant {
        name: "gpu-dsa-sparse-last-slot-dropped",
        description: "Top-k keeping k-1: a list's last valid entry is never attended to",
        find: "const int n_valid = token_list_end<SPARSE_THREADS>(",
        replace: "const int n_valid = -1 + token_list_end<SPARSE_THREADS>(",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-own-token-ends-the-list",
        description: "Causal off by one in the device list rule: a list ends at its own token, which it may list",
        find: "previous, token + 1)) {",
        replace: "previous, token)) {",
        ..DSA_SPARSE_COMMON
    },
    Mutant {
        name: "gpu-dsa-sparse-query-heads-collapsed",
        description: "Every row of the CTA loads the query of the sequence's first head instead of its own",
        find: "q_s, q + cta.q_base, fp.q_head, fp.q_row, first_head,",
        replace: "q_s, q + cta.q_base, 0, fp.q_row, first_head,",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-chunk-offset-missing",
        description: "Every head chunk of a group above 64 computes the group's first heads: the later heads are never written",
        find: "const int first_head = kv * group + chunk * SPARSE_ROWS;",
        replace: "const int first_head = kv * group;",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-per-head-lists-ignored",
        description: "Every KV head reads the first KV head's list where lists are per KV head",
        find: "const int list_head = params.list_heads == 1 ? 0 : kv;",
        replace: "const int list_head = 0;",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-partial-tile-unmasked",
        description: "A list's last, partial tile skips the mask: its zero-filled slots enter the softmax with score 0",
        find: "if (keys_here == SPARSE_KEYS) {",
        replace: "if (keys_here > 0) {",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-v-rows-of-the-first-tile",
        description: "Every tile gathers its V rows from the list's first 64 slots instead of its own",
        find: "v_s, cta.v_g, 0, fp.v_row, 0, ListedTokens{list + slot0}",
        replace: "v_s, cta.v_g, 0, fp.v_row, 0, ListedTokens{list}",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-k-prefetch-repeats-the-tile",
        description: "The K prefetch gathers the current tile's slots again instead of the next tile's",
        find: "k_s, cta.k_g, 0, fp.k_row, 0, ListedTokens{list + slot1}",
        replace: "k_s, cta.k_g, 0, fp.k_row, 0, ListedTokens{list + slot0}",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-kv-head-zero",
        description: "Every group gathers its K and V rows from KV head 0 instead of its own",
        find: "seq, first_head, blockIdx.x, 1, SPARSE_KEYS",
        replace: "seq, chunk * SPARSE_ROWS, blockIdx.x, 1, SPARSE_KEYS",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-list-of-the-previous-token",
        description: "A token attends over the list of the token before it",
        find: ": (long long)seq * fp.dense_len_q) + token;",
        replace: ": (long long)seq * fp.dense_len_q) + max(token - 1, 0);",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-partly-filled-warp-idle",
        description: "A warp only some of whose 16 rows are heads of the chunk computes nothing: those heads get O = 0",
        find: "const bool warp_active = warp * 16 < heads;",
        replace: "const bool warp_active = warp * 16 + 16 <= heads;",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-wgmma-scores-accumulate-across-tiles",
        description: "The wgmma path's first k-step of S adds to the previous tile's scores instead of starting from zero",
        find: "kk > 0);",
        replace: "true);",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-wgmma-query-heads-collapsed",
        description: "The wgmma path loads the chunk's first head's query into every row of its Q tile",
        find: "StridedRows{cta.q_g, fp.q_head}",
        replace: "StridedRows{cta.q_g, 0}",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-wgmma-value-step-halved",
        description: "The wgmma path's V operand advances 8 rows per k-step instead of 16: P meets the wrong values",
        find: "smem_desc(v_addr + kk * 16 * SW_ROW, SPARSE_KEYS * SW_ROW, 1024)",
        replace: "smem_desc(v_addr + kk * 8 * SW_ROW, SPARSE_KEYS * SW_ROW, 1024)",
        ..DSA_SPARSE
    },
    Mutant {
        name: "gpu-dsa-sparse-wgmma-last-product-dropped",
        description: "The wgmma path never adds the last tile's P V: its keys count in the LSE but not in O",
        find: "sparse_pv(acc, p_frag, smem_u32(v_s + ((n_tiles - 1) & 1) * SPARSE_V_BYTES));",
        replace: "wgmma_commit();",
        ..DSA_SPARSE
    },
    // --- dsa_sparse_bwd.cu (DSA's token-sparse attention backward), launched on a device ---
    Mutant {
        name: "gpu-dsa-sparse-bwd-last-slot-dropped",
        description: "Top-k keeping k-1 in the backward: a list's last valid entry gets no gradient and adds none to dQ",
        find: "const int n_valid = token_list_end<DSA_BWD_THREADS>(",
        replace: "const int n_valid = -1 + token_list_end<DSA_BWD_THREADS>(",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-own-token-ends-the-list",
        description: "Causal off by one in the backward's list rule: a list ends at its own token, which it may list",
        find: "previous, token + 1)) {",
        replace: "previous, token)) {",
        ..DSA_SPARSE_BWD_COMMON
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-dk-scattered-to-the-previous-row",
        description: "dK scattered to the wrong row: each gathered key's dK partial is added to the key before it",
        find: "float* dk_row = dk_acc + sv.k_base + kv * k_head + key * k_row;",
        replace: "float* dk_row = dk_acc + sv.k_base + kv * k_head + max(key - 1, 0LL) * k_row;",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-second-row-of-each-fragment-dropped",
        description: "Slots 8 to 15 of every warp add nothing to dK and dV: half of the gathered keys lose their gradient",
        find: "for (int r = 0; r < 2; ++r) {\n                const int slot = wk + g + 8 * r;",
        replace: "for (int r = 0; r < 1; ++r) {\n                const int slot = wk + g + 8 * r;",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-query-heads-collapsed",
        description: "A gathered row loaded for one head only: every row of the CTA reads the query of its first head",
        find: "q_s, q + sv.q_base, q_head, q_row, first_head, ConsecutiveTokens{token}",
        replace: "q_s, q + sv.q_base, 0, q_row, first_head, ConsecutiveTokens{token}",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-head-chunks-collapsed",
        description: "Every head chunk of a group above 64 heads computes the group's first 64 heads",
        find: "const int first_head = kv * group + chunk * Q_TILE;",
        replace: "const int first_head = kv * group;",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-shared-list-for-every-kv-head",
        description: "Lists per KV head read as one shared list: every KV head's rows walk KV head 0's list",
        find: "const int list_head = params.list_heads == 1 ? 0 : kv;",
        replace: "const int list_head = 0;",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-delta-dropped",
        description: "dS = P ∘ dP without subtracting D (E9): the backward's rows read D as 0",
        find: "delta_s[r] = r < heads ? delta[at] : 0.f;",
        replace: "delta_s[r] = 0.f;",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-last-tile-skipped",
        description: "A row walks all but its list's last tile of 64 slots",
        find: "for (int tile = 0; tile < n_tiles; ++tile) {",
        replace: "for (int tile = 0; tile + 1 < n_tiles; ++tile) {",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-transpose-skips-the-tiles-first-token",
        description: "The deterministic mode's transpose starts one token late: the tile's first token adds nothing to its \
                      dK and dV",
        find: "for (int base = tile * KV_TILE; base < sv.len_q; base += 32) {",
        replace: "for (int base = tile * KV_TILE + 1; base < sv.len_q; base += 32) {",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-unlisted-keys-unmasked",
        description: "The deterministic KV owner gives a token every key of a tile it lists any key of",
        find: "mask_unlisted(st, dsp, mask_s, group, wk + g, tig);",
        replace: "",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-kv-owner-reads-the-first-kv-heads-transpose",
        description: "The deterministic KV owner walks the transpose of KV head 0's lists for every KV head",
        find: "const int list_head = params.list_heads > 1 ? kv : 0;",
        replace: "const int list_head = 0;",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-mask-bits-of-neighbours",
        description: "The transpose's masks name each listed key's neighbour (key ^ 1) instead of the key",
        find: "mask |= 1ull << (s - key0);",
        replace: "mask |= 1ull << ((s - key0) ^ 1);",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-dq-unscaled",
        description: "dQ written without the softmax scale α̂",
        find: "pack_elems(to_elem(__fmul_rn(scale, dq0)), to_elem(__fmul_rn(scale, dq1)));",
        replace: "pack_elems(to_elem(dq0), to_elem(dq1));",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-dk-unscaled",
        description: "dK finalized without the softmax scale α̂",
        find: "pack_elems(to_elem(__fmul_rn(scale, x.x)), to_elem(__fmul_rn(scale, x.y)));",
        replace: "pack_elems(to_elem(x.x), to_elem(x.y));",
        ..DSA_SPARSE_BWD
    },
    Mutant {
        name: "gpu-dsa-sparse-bwd-dv-scaled",
        description: "dV finalized with the softmax scale α̂, as dK is",
        find: "pack_elems(to_elem(x.x), to_elem(x.y));",
        replace: "pack_elems(to_elem(__fmul_rn(scale, x.x)), to_elem(__fmul_rn(scale, x.y)));",
        ..DSA_SPARSE_BWD
    },
    // --- dsa_loss.cu (DSA's indexer loss and its gradients), launched on a device ---
    Mutant {
        name: "gpu-dsa-loss-teacher-not-renormalized",
        description: "The teacher is not renormalized on the list: tau' = tau (H times too large in the sparse stage)",
        find: "const float tau = active ? teacher_row[s] / mass : 0.f;",
        replace: "const float tau = active ? teacher_row[s] : 0.f;",
        ..DSA_LOSS
    },
    Mutant {
        name: "gpu-dsa-loss-relu-missing",
        description: "The ReLU is left out of the student's scores: negative indexer logits subtract",
        find: "acc[m][c] = w_s[loss_row(c)] * fmaxf(acc[m][c], 0.f);",
        replace: "acc[m][c] = w_s[loss_row(c)] * acc[m][c];",
        ..DSA_LOSS
    },
    Mutant {
        name: "gpu-dsa-loss-teacher-first-head-only",
        description: "The teacher sums the first query head of each chunk only",
        find: "acc[m][c] = row < heads ? expf(",
        replace: "acc[m][c] = row < 1 ? expf(",
        ..DSA_LOSS
    },
    Mutant {
        name: "gpu-dsa-loss-teacher-kv-head-zero",
        description: "GQA: every KV head's teacher reads the keys of KV head 0",
        find: "k + (long long)kv * p.head_dim, 0,",
        replace: "k, 0,",
        ..DSA_LOSS
    },
    Mutant {
        name: "gpu-dsa-loss-gate-open-at-zero",
        description: "The gate of dq^I opens at a logit of exactly 0 (the ReLU's derivative taken as 1 there)",
        find: "const float l = logit_s[a * LOSS_LOGIT_STRIDE + s];\n            if (l > 0.f) {",
        replace: "const float l = logit_s[a * LOSS_LOGIT_STRIDE + s];\n            if (l >= 0.f) {",
        ..DSA_LOSS
    },
    Mutant {
        name: "gpu-dsa-loss-dk-scattered-to-the-first-slot",
        description: "dk^I scattered to the wrong row: every slot of a tile adds to the tile's first key",
        find: "float* dst = d_ki + (long long)list[slot0 + slot] * INDEX_DIM;",
        replace: "float* dst = d_ki + (long long)list[slot0] * INDEX_DIM;",
        ..DSA_LOSS
    },
    Mutant {
        name: "gpu-dsa-loss-lse-without-max",
        description: "The student's normalizer drops the maximum from its exponentials but keeps it in the LSE",
        find: "z += expf(student_row[s] - top);",
        replace: "z += expf(student_row[s]);",
        ..DSA_LOSS
    },
    Mutant {
        name: "gpu-dsa-loss-last-tile-dropped",
        description: "A list's partial last tile is never visited: its slots get no score, teacher or gradient",
        find: "return (n + LOSS_KEYS - 1) / LOSS_KEYS;",
        replace: "return n / LOSS_KEYS;",
        ..DSA_LOSS
    },
    Mutant {
        name: "gpu-dsa-loss-dw-summed-four-times",
        description: "Every quarter of a head's threads adds every slot to dw: the weight gradient four times over",
        find: "if (s % 4 == e) dw = fmaf(ds, l, dw);",
        replace: "dw = fmaf(ds, l, dw);",
        ..DSA_LOSS
    },
    Mutant {
        name: "gpu-dsa-loss-kl-lse-sign",
        description: "The KL's student log-probability adds the LSE with the wrong sign",
        find: "row_kl += tau * ((logf(tau) - student_row[s]) + row_lse);",
        replace: "row_kl += tau * ((logf(tau) - student_row[s]) - row_lse);",
        ..DSA_LOSS
    },
    Mutant {
        name: "gpu-dsa-loss-dq-weight-missing",
        description: "The gate of dq^I forgets the head's weight (dk^I keeps it)",
        find: "const float gate = ds * w_a;",
        replace: "const float gate = ds;",
        ..DSA_LOSS
    },
    // --- flash_bwd.cu, launched on a device ---
    Mutant {
        name: "gpu-bwd-ds-missing-delta",
        description: "dS = P ∘ dP without subtracting D (E9): the softmax Jacobian's rank-one term is lost",
        find: "__fmul_rn(p, __fsub_rn(dpt[n][e], delta_t[qc]))",
        replace: "__fmul_rn(p, dpt[n][e])",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-kv-tile-rows-off-by-one",
        description: "The last query tile that sees a KV tile is skipped: its rows add nothing to dK and dV",
        find: "*a_hi = (int)(row_hi / Q_TILE);",
        replace: "*a_hi = (int)(row_hi / Q_TILE) - 1;",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-gqa-dk-overwritten",
        description: "GQA: each query head's dK overwrites the group's sum instead of adding to it",
        find: "tot_k = hh == 0 ? x : __fadd_rn(tot_k, x);",
        replace: "tot_k = x;",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-gqa-last-head-dropped",
        description: "GQA: the group sum of dK and dV leaves out the last query head of each group",
        find: "for (int hh = 0; hh < group; ++hh) {",
        replace: "for (int hh = 0; hh + 1 < group; ++hh) {",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-dk-missing-scale",
        description: "dK is written without the softmax scale α̂ (dS is the gradient of the scaled scores)",
        find: "pack_elems(to_elem(__fmul_rn(scale, x0)), to_elem(__fmul_rn(scale, x1)))",
        replace: "pack_elems(to_elem(x0), to_elem(x1))",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-delta-half-reduced",
        description: "D = rowsum(dO ∘ O) reduced over 16 of the 32 lanes only",
        find: "for (int off = 16; off > 0; off >>= 1)",
        replace: "for (int off = 16; off > 1; off >>= 1)",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-atomic-dq-column-lost",
        description: "The atomic dQ mode drops the odd column of each pair",
        find: "red_add_v2(live, dq_row + n * 8, part[mt][n][2 * r], part[mt][n][2 * r + 1]);",
        replace: "red_add_v2(live, dq_row + n * 8, part[mt][n][2 * r], 0.f);",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-q-prefetch-same-stage",
        description: "The next query tile is prefetched into the stage being computed on (a race that mixes two tiles)",
        find: "load_q_tile(a_next, stage ^ 1);",
        replace: "load_q_tile(a_next, stage);",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-dq-column-half-repeated",
        description: "Every column part of bwd_kv's warps computes the first part of the chunk's dQ columns",
        find: "const int dq_c = c0 + (warp / DQ_ROW_GROUPS) * DQ_COLS;",
        replace: "const int dq_c = c0;",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-window-left-ignored",
        description: "The window's left bound is not applied when P is recomputed in the KV-owner kernel",
        find: "j <= i + win_right && j >= i - win_left;",
        replace: "j <= i + win_right;",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-dq-interior-ignores-diagonal",
        description: "Strategy A takes a KV tile that crosses the diagonal (or a window's right edge) for an interior one: future keys leak into dQ",
        find: "key0 + DQ_KV_TILE - 1 <= diag_of.at(row0) + win_right &&",
        replace: "",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-interior-ignores-window-right",
        description: "A warp's keys that cross the diagonal (or a window's right edge) are taken as fully visible: future keys leak",
        find: "wkey0 + 15 <= diag.at(row0) + win_right && ",
        replace: "",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-strided-diagonal-slope-one",
        description: "The KV owner's mask steps the diagonal by one key per query, wrong for NSA's strided one: dK, dV off",
        find: "const int i = diag.at(row_t + n * 8 + (e % 2));",
        replace: "const int i = diag.at(row_t) + n * 8 + (e % 2);",
        ..FLASH_BWD
    },
    Mutant {
        name: "gpu-bwd-dq-strided-diagonal-slope-one",
        description: "Strategy A's dQ owner steps the diagonal by one key per row, wrong for NSA's strided one: dQ off",
        find: "diag[r] = diag_of.at(row0 + row);",
        replace: "diag[r] = diag_of.at(row0) + row;",
        ..FLASH_BWD
    },
];
