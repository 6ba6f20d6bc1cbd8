// NSA's block selection (E19, E32), compiled by NVRTC (see gpu/src/compile.rs) after common.cuh with NSA_D_PAD (the
// query head dim rounded up to 64, 128, 192 or 256). The rule is the oracle's (oracle/src/nsa.rs: block_scores and
// select_blocks); the host wrapper is gpu/src/nsa/select.rs, and the rounding-error bound of the scores is
// proofs/src/nsa_bound.rs (block_score_bound).
//
// Two kernels:
//   nsa_block_scores  one CTA per (TOKENS tokens, KV head, sequence), TOKENS = ⌊64/G⌋: its 64 rows are the pairs
//                     (token, query head of the group), token-major, so that the group's heads of one token sit in
//                     consecutive rows and their sum stays inside the CTA. It walks the compressed keys visible to
//                     its last token in tiles of 64 windows, recomputes each row's compressed scores with the tensor
//                     cores (E32's first tensor, p_cmp = exp(α q·k̃_c − LSE_cmp), from the compressed attention's LSE;
//                     never written to device memory), adds the group's heads in ascending order (E32's second
//                     tensor, in shared memory for one tile), and adds each window into the selection blocks it
//                     overlaps with weight |window ∩ block| / s (E32's third tensor; a warp per token, a lane per
//                     block, each block's windows from a table built once per tile, each weight from a table of every
//                     overlap built once per CTA), reading the block's running
//                     score from the output and writing it back: scores [token rows, Hkv, n_blocks] f32, zeroed by the
//                     host before the launch. The CTA owns its tokens' rows of the output, so the read-modify-write
//                     needs no atomics, and a block's windows are added in ascending order whichever tile holds them:
//                     blocks with equal windows get equal scores.
//   nsa_top_n         one warp per (token, KV head): the forced blocks (the first n_forced_initial and the
//                     n_forced_local most recent, eligible ones only), then the best of the other eligible blocks
//                     (those that start at or before the token: j·l' ≤ t) up to n_selected: each lane keeps its own
//                     best (larger score first, equal scores to the lower index) over blocks lane, lane + 32, …, the
//                     warp merges the lanes' heads round by round, and the list is written ascending and −1-padded:
//                     lists [token rows, Hkv, n_selected] i32.
//
// Arithmetic (the bound's recipe): the score ŝ = Σ_e q_e k̃_e by m16n8k16 MMAs with f32 accumulators; x = fl(ŝ · α̂)
// (α̂ the f32 scale); p = ex2.approx.ftz(fmaf(x, fl32(log2 e), −fl(LSE · fl32(log2 e)))), 0 for a window the token
// does not see or a row whose LSE is −∞ (no window visible); the group sum q_c = (…(p_0 + p_1) + …) + p_{G−1} in f32;
// the block score acc = fmaf(q_c, fl(overlap / s), acc) over the block's windows in ascending order.

#define SEL_ROWS 64                 // (token, head) rows per CTA
#define SEL_WINDOWS 64              // compressed keys per tile
#define SEL_SCORE_THREADS 128       // four warps of 16 rows
#define SEL_K_STRIDE (NSA_D_PAD + 8)  // shared row stride of Q and K̃ tiles in elements (the padding spreads banks)
#define SEL_P_STRIDE (SEL_WINDOWS + 4)  // shared row stride of the probability tile in floats
#define TOPN_MAX 32                 // the longest list nsa_top_n writes (one entry per lane)
#define TOPN_WARPS 4

// The sequence's extent in the token rows of the scores and lists, and its first elements of Q, K̃ and LSE.
struct SelectSeq {
    int len;                // tokens
    int windows;            // complete compression windows (rows of K̃)
    long long q_base, k_base, lse_base;
    long long token_row0;   // the sequence's first token row of the scores and lists
};

__device__ __forceinline__ SelectSeq select_seq(const FlashParams& fp, const int* __restrict__ cu_q,
                                                const int* __restrict__ cu_k, int seq) {
    SelectSeq s;
    if (fp.varlen) {
        const int q0 = cu_q[seq], k0 = cu_k[seq];
        s.len = cu_q[seq + 1] - q0;
        s.windows = cu_k[seq + 1] - k0;
        s.q_base = (long long)q0 * fp.q_row;
        s.k_base = (long long)k0 * fp.k_row;
        s.lse_base = q0;
        s.token_row0 = q0;
    } else {
        s.len = fp.dense_len_q;
        s.windows = fp.dense_len_k;
        s.q_base = seq * fp.q_batch;
        s.k_base = seq * fp.k_batch;
        s.lse_base = seq * fp.lse_batch;
        s.token_row0 = (long long)seq * fp.dense_len_q;
    }
    return s;
}

// The windows token t sees: those with c·s + l − 1 ≤ t, at most the sequence's.
__device__ __forceinline__ int windows_seen(const NsaSelectParams& p, int t, int windows) {
    const int x = t + 1 - p.compress_len;
    return x < 0 ? 0 : min(windows, x / p.compress_stride + 1);
}

extern "C" __global__ void __launch_bounds__(SEL_SCORE_THREADS)
nsa_block_scores(const elem_t* __restrict__ q, const elem_t* __restrict__ k_cmp, const float* __restrict__ lse,
                 float* __restrict__ scores, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                 const NsaSelectParams params) {
    const FlashParams& fp = params.flash;
    const int group = fp.group, kv = blockIdx.y, seq = blockIdx.z;
    const SelectSeq sq = select_seq(fp, cu_q, cu_k, seq);
    const int t0 = blockIdx.x * params.tokens_per_cta;
    if (t0 >= sq.len) return;
    const int tokens = min(params.tokens_per_cta, sq.len - t0);
    const int rows = tokens * group;
    const int visible = windows_seen(params, t0 + tokens - 1, sq.windows);
    if (visible == 0) return;  // no token of the CTA sees a window: its scores stay 0

    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_s = reinterpret_cast<elem_t*>(smem_raw);                         // [SEL_ROWS][SEL_K_STRIDE]
    elem_t* k_s = q_s + SEL_ROWS * SEL_K_STRIDE;                               // [2][SEL_WINDOWS][SEL_K_STRIDE]
    float* p_s = reinterpret_cast<float*>(k_s + 2 * SEL_WINDOWS * SEL_K_STRIDE);  // [SEL_ROWS][SEL_P_STRIDE]
    // Per tile, for each block it touches, its first and last window (unclipped): params.tile_blocks entries each.
    int* first_window = reinterpret_cast<int*>(p_s + SEL_ROWS * SEL_P_STRIDE);
    int* last_window = first_window + params.tile_blocks;
    // fl(o / s) for every overlap o = 0 ..= min(l, l'): the only weights a window can have in a block.
    float* weight_of = reinterpret_cast<float*>(last_window + params.tile_blocks);
    __shared__ float lse_l2[SEL_ROWS];
    __shared__ int seen[SEL_ROWS];  // windows each row's token sees

    // The rows (token t0 + r / G, head kv·G + r % G): Q rows and their LSE·log2 e.
    load_group_rows_async<SEL_ROWS, NSA_D_PAD, SEL_K_STRIDE, SEL_SCORE_THREADS>(q_s, q + sq.q_base, fp.q_head, fp.q_row,
                                                                             kv * group, ConsecutiveTokens{t0}, group, rows,
                                                                             fp.d);
    for (int r = threadIdx.x; r < SEL_ROWS; r += SEL_SCORE_THREADS) {
        float l2 = NEG_INF;
        if (r < rows) {
            const float x = lse[sq.lse_base + (long long)(kv * group + r % group) * fp.lse_head + t0 + r / group];
            l2 = x == NEG_INF ? NEG_INF : __fmul_rn(x, LOG2E_F);
        }
        lse_l2[r] = l2;
        seen[r] = r < rows ? windows_seen(params, t0 + r / group, sq.windows) : 0;
    }
    for (int o = threadIdx.x; o <= min(params.compress_len, params.select_block); o += SEL_SCORE_THREADS) {
        weight_of[o] = __fdiv_rn((float)o, (float)params.compress_stride);
    }
    const elem_t* k_g = k_cmp + sq.k_base + (long long)kv * fp.k_head;
    const int n_tiles = (visible + SEL_WINDOWS - 1) / SEL_WINDOWS;
    load_tile_async<SEL_WINDOWS, NSA_D_PAD, SEL_K_STRIDE, SEL_SCORE_THREADS>(k_s, k_g, fp.k_row,
                                                                            min(SEL_WINDOWS, visible), fp.d);
    cp_async_commit();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
    const unsigned a_lane = smem_u32(q_s) + (warp * 16 * SEL_K_STRIDE + lane_a(lane, SEL_K_STRIDE)) * ESZ;
    const long long row_out0 = (sq.token_row0 + t0) * params.n_heads_kv + kv;
    // The thread's two rows of the accumulator layout (g and g + 8 of its warp's slice): the windows their token
    // sees and their LSE·log2 e, the same in every tile.
    __syncthreads();
    const int seen_r[2] = {seen[warp * 16 + g], seen[warp * 16 + g + 8]};
    const float lse_r[2] = {lse_l2[warp * 16 + g], lse_l2[warp * 16 + g + 8]};
    // Positions fit an int: the host checks T ≤ 2^30, and a seen window's c·s + l − 1 is at most its token.
    const int s = params.compress_stride, l = params.compress_len, lb = params.select_block;
    for (int tile = 0; tile < n_tiles; ++tile) {
        cp_async_wait_all();
        __syncthreads();
        const int w0 = tile * SEL_WINDOWS;
        const int nw = min(SEL_WINDOWS, visible - w0);
        if (tile + 1 < n_tiles) {
            const int next = w0 + SEL_WINDOWS;
            load_tile_async<SEL_WINDOWS, NSA_D_PAD, SEL_K_STRIDE, SEL_SCORE_THREADS>(
                k_s + ((tile + 1) % 2) * SEL_WINDOWS * SEL_K_STRIDE, k_g + (long long)next * fp.k_row, fp.k_row,
                min(SEL_WINDOWS, visible - next), fp.d);
        }
        cp_async_commit();

        // Scores of the warp's 16 rows against the tile's 64 windows, then probabilities into p_s (a window the row's
        // token does not see, which includes every column past the tile's windows, gives 0).
        float acc[SEL_WINDOWS / 8][4];
#pragma unroll
        for (int n = 0; n < SEL_WINDOWS / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
        const unsigned b_lane =
            smem_u32(k_s + (tile % 2) * SEL_WINDOWS * SEL_K_STRIDE) + lane_b(lane, SEL_K_STRIDE) * ESZ;
        warp_mma_nt<NSA_D_PAD / 16, SEL_WINDOWS / 16, SEL_K_STRIDE>(acc, a_lane, b_lane);
#pragma unroll
        for (int n = 0; n < SEL_WINDOWS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int half = e / 2;
                const int col = n * 8 + 2 * tig + (e % 2);
                float p = 0.f;
                if (w0 + col < seen_r[half] && lse_r[half] != NEG_INF) {
                    p = ex2_approx_ftz(__fmaf_rn(__fmul_rn(acc[n][e], fp.scale), LOG2E_F, -lse_r[half]));
                }
                p_s[(warp * 16 + g + 8 * half) * SEL_P_STRIDE + col] = p;
            }
        }
        // The tile's blocks j_lo ..= j_hi (at most params.tile_blocks) and the windows of each: those with
        // c·s < (j + 1)·l' and c·s + l > j·l'.
        const int j_lo = w0 * s / lb;
        const int n_blocks_here = ((w0 + nw - 1) * s + l - 1) / lb - j_lo + 1;
        for (int jj = threadIdx.x; jj < n_blocks_here; jj += SEL_SCORE_THREADS) {
            const int block_start = (j_lo + jj) * lb;
            first_window[jj] = block_start - l + 1 <= 0 ? 0 : (block_start - l + s) / s;
            last_window[jj] = (block_start + lb - 1) / s;
        }
        __syncthreads();

        // The group sum of every window, in ascending head order, into the token's first row.
        if (group > 1) {
            for (int idx = threadIdx.x; idx < tokens * SEL_WINDOWS; idx += SEL_SCORE_THREADS) {
                float* column = p_s + (idx / SEL_WINDOWS) * group * SEL_P_STRIDE + idx % SEL_WINDOWS;
                float summed = column[0];
                for (int h = 1; h < group; ++h) summed = __fadd_rn(summed, column[h * SEL_P_STRIDE]);
                column[0] = summed;
            }
            __syncthreads();
        }

        // A warp per token, a lane per block the token's seen windows of the tile touch: the block's windows (from
        // the tile's table) in ascending order, each with weight fl(overlap / s) (from the weight table), onto the
        // block's running score, which a previous tile left in the output when the block's first window lies before
        // this tile.
        for (int tl = warp; tl < tokens; tl += SEL_SCORE_THREADS / 32) {
            const int c_end = min(w0 + nw, seen[tl * group]);
            if (c_end <= w0) continue;
            const float* sums = p_s + tl * group * SEL_P_STRIDE - w0;
            float* out_row = scores + (row_out0 + (long long)tl * params.n_heads_kv) * params.n_blocks;
            const int j_end = ((c_end - 1) * s + l - 1) / lb;
            for (int j = j_lo + lane; j <= j_end; j += 32) {
                const int first = first_window[j - j_lo];
                const int c_lo = max(w0, first);
                const int c_hi = min(c_end - 1, last_window[j - j_lo]);
                if (c_lo > c_hi) continue;
                const int block_start = j * lb, block_end = block_start + lb;
                float block_score = first < w0 ? out_row[j] : 0.f;
                for (int c = c_lo; c <= c_hi; ++c) {
                    const int w_start = c * s;
                    const int overlap = min(w_start + l, block_end) - max(w_start, block_start);
                    block_score = __fmaf_rn(sums[c], weight_of[overlap], block_score);
                }
                out_row[j] = block_score;
            }
        }
    }
}

// The better of two candidates: larger score, then lower index; a NaN score or index -1 never wins.
__device__ __forceinline__ bool better_block(float s, int i, float t, int j) {
    if (j < 0 || t != t) return i >= 0 && s == s;
    if (i < 0 || s != s) return false;
    return s > t || (s == t && i < j);
}

extern "C" __global__ void __launch_bounds__(TOPN_WARPS * 32)
nsa_top_n(const float* __restrict__ scores, int* __restrict__ lists, const int* __restrict__ cu_q,
          const int* __restrict__ cu_k, const NsaSelectParams params) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kv = blockIdx.y, seq = blockIdx.z;
    const SelectSeq sq = select_seq(params.flash, cu_q, cu_k, seq);
    const int t = blockIdx.x * TOPN_WARPS + warp;
    if (t >= sq.len) return;
    const long long row = (sq.token_row0 + t) * params.n_heads_kv + kv;
    const float* row_scores = scores + row * params.n_blocks;
    int* list = lists + row * params.n_selected;

    // Eligible blocks 0 ..= current; forced: [0, n_initial) and [local_from, current]; candidates: [n_initial,
    // current + 1 − n_local), which lies between the two forced runs (empty when they meet).
    const int current = t / params.select_block;
    const int n_initial = min(params.n_forced_initial, current + 1);
    const int n_local = min(params.n_forced_local, current + 1);
    const int local_from = max(n_initial, current + 1 - n_local);
    const int cand_lo = n_initial, cand_hi = current + 1 - n_local;
    const int n_forced = n_initial + (current + 1 - local_from);
    const int want = max(0, min(params.n_selected - n_forced, cand_hi - cand_lo));

    // Each lane's best `want` candidates, best first; blocks arrive in ascending order, so an equal score never
    // displaces an earlier (lower) block.
    float best_s[TOPN_MAX];
    int best_i[TOPN_MAX];
#pragma unroll
    for (int i = 0; i < TOPN_MAX; ++i) {
        best_s[i] = 0.f;
        best_i[i] = -1;
    }
    float last_s = 0.f;
    int last_i = -1;
    for (int j = cand_lo + lane; want > 0 && j < cand_hi; j += 32) {
        float cs = row_scores[j];
        int ci = j;
        if (!better_block(cs, ci, last_s, last_i)) continue;
#pragma unroll
        for (int i = 0; i < TOPN_MAX; ++i) {
            if (i < want && better_block(cs, ci, best_s[i], best_i[i])) {
                const float ts = best_s[i];
                const int ti = best_i[i];
                best_s[i] = cs;
                best_i[i] = ci;
                cs = ts;
                ci = ti;
            }
        }
#pragma unroll
        for (int i = 0; i < TOPN_MAX; ++i) {
            if (i == want - 1) {
                last_s = best_s[i];
                last_i = best_i[i];
            }
        }
    }

    // Rounds of a warp-wide arg-max over the lanes' heads: round r's winner goes to lane r.
    int mine = 0x7fffffff;
    int chosen = 0;
    for (; chosen < want; ++chosen) {
        float s = best_s[0];
        int i = best_i[0];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float os = __shfl_xor_sync(0xffffffffu, s, o);
            const int oi = __shfl_xor_sync(0xffffffffu, i, o);
            if (better_block(os, oi, s, i)) {
                s = os;
                i = oi;
            }
        }
        if (i < 0) break;
        if (lane == chosen) mine = i;
        if (best_i[0] == i) {
#pragma unroll
            for (int k = 0; k + 1 < TOPN_MAX; ++k) {
                best_s[k] = best_s[k + 1];
                best_i[k] = best_i[k + 1];
            }
            best_s[TOPN_MAX - 1] = 0.f;
            best_i[TOPN_MAX - 1] = -1;
        }
    }

    // The chosen blocks ascending (a bitonic sort across the lanes; empty lanes hold INT_MAX and sort last).
#pragma unroll
    for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
            const int other = __shfl_xor_sync(0xffffffffu, mine, j);
            const bool ascending = (lane & k) == 0, lower = (lane & j) == 0;
            mine = (lower == ascending) ? min(mine, other) : max(mine, other);
        }
    }
    // Slot `lane`: the initial forced blocks, the chosen ones, the local forced ones, then −1.
    const int from_sorted = __shfl_sync(0xffffffffu, mine, (lane - n_initial) & 31);
    int value = -1;
    if (lane < n_initial) {
        value = lane;
    } else if (lane < n_initial + chosen) {
        value = from_sorted;
    } else if (lane < n_initial + chosen + (current + 1 - local_from)) {
        value = local_from + (lane - n_initial - chosen);
    }
    if (lane < params.n_selected) list[lane] = value;
}
