// PISA's first-order tail (E22) on top of the block-sparse forward, compiled by NVRTC (see gpu/src/compile.rs) after
// common.cuh and bsa_select.cu, whose block mean (pool_block) it reuses. The host wrapper is gpu/src/pisa/tail.rs; the
// reference is the oracle's pisa::tail_output (oracle/src/pisa.rs), the verifier attnproof_harness::pisa_tail.
//
// The exact part of every row (its query block's listed key blocks, and every block the mask cuts for a row of the
// block, which the wrapper adds to the lists) is the block-sparse forward's O and LSE. This file adds the tail: the
// key blocks wholly visible to the row and not listed, each as its first-order summary, in the same softmax.
//
// Three kernels, all in f64 (the inputs' bf16/f16 values are exact in f64):
//   pisa_tail_means  one CTA per (key block, KV head, sequence): the block's mean key μ_b and mean value, by
//                    pool_block (the selector's block mean), into the workspace's [B, Hkv, n_k, d] and [.., dv].
//   pisa_tail_hbar   one CTA per (32 × 32 tile of [d, dv], KV head, sequence): H̄ = (1/n_b) Σ_b Σ_{j∈b} (k_j − μ_b) v_jᵀ
//                    over every block of the sequence (E22's convention: the partial last block too), keys in
//                    ascending order, into [B, Hkv, d, dv].
//   pisa_tail_merge  one CTA per (TAIL_ROWS rows of a query block, query head, sequence): per row i the tail
//                    U_i = {b wholly visible to i, b not in the list}, s_b = α q_i·μ_b (one fma chain over the columns),
//                    an online softmax over U_i in tiles of TAIL_BLOCKS blocks carrying m (the largest s_b so far),
//                    A = Σ e^{s_b − m}, Z = Σ e^{s_b − m}|B_b| and N = Σ e^{s_b − m} V^Σ_b (V^Σ_b = |B_b| · mean
//                    value), then N += A · α q_iᵀ H̄, and the merge with the exact part read from O and LSE:
//                        M = max(lse_E, m + ln Z),  D = e^{lse_E − M} + e^{m − M} Z,
//                        o = (e^{lse_E − M} O_E + e^{m − M} N) / D,  lse = M + ln D,
//                    written over O and LSE. A row whose tail is empty keeps its O and LSE bit for bit.
//
// Determinism: every sum runs in a fixed order (columns ascending in a dot product, blocks ascending in the softmax,
// keys ascending in H̄), so the outputs are bitwise reproducible.

#define TAIL_THREADS 128
#define TAIL_ROWS 16      // rows per CTA: a query block of 64 or 128 rows takes 4 or 8 CTAs
#define TAIL_BLOCKS 16    // key blocks per tile of the online softmax
#define TAIL_MAX_COL_GROUPS (POOL_MAX_D / 32)
#define HBAR_TILE 32
#define HBAR_KEYS 32      // keys staged per step of pisa_tail_hbar

// The key blocks wholly visible to sequence row i (query rows len_q, keys len_k, blocks of kv_block keys): every
// block without a mask; under the bottom-right causal mask the blocks whose last key the row sees.
__device__ __forceinline__ int tail_whole_blocks(const PisaTailParams& p, int i, int len_q, int len_k) {
    const int n_blocks = (len_k + p.kv_block - 1) / p.kv_block;
    if (!p.causal) return n_blocks;
    const long long last = (long long)i + len_k - len_q;  // the row's last visible key
    if (last < 0) return 0;
    if (last >= len_k - 1) return n_blocks;
    return (int)((last + 1) / p.kv_block);
}

extern "C" __global__ void __launch_bounds__(POOL_THREADS)
pisa_tail_means(const elem_t* __restrict__ k, const elem_t* __restrict__ v, double* __restrict__ work,
                const int* __restrict__ cu_k, const PisaTailParams p) {
    const FlashParams& fp = p.flash;
    const int b = blockIdx.x, kv = blockIdx.y, seq = blockIdx.z;
    const long long block_row = ((long long)seq * p.n_heads_kv + kv) * p.n_key_blocks + b;
    pool_block(k, cu_k, fp.dense_len_k, fp.k_batch, kv * fp.k_head, fp.k_row, p.kv_block, b, seq, fp.varlen, fp.d,
               work + block_row * fp.d);
    __syncthreads();  // pool_block's shared sums are reused
    pool_block(v, cu_k, fp.dense_len_k, fp.v_batch, kv * fp.v_head, fp.v_row, p.kv_block, b, seq, fp.varlen, fp.dv,
               work + p.value_means_at + block_row * fp.dv);
}

extern "C" __global__ void __launch_bounds__(256)
pisa_tail_hbar(const elem_t* __restrict__ k, const elem_t* __restrict__ v, double* __restrict__ work,
               const int* __restrict__ cu_k, const PisaTailParams p) {
    const FlashParams& fp = p.flash;
    const int kv = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv;
    const int col_tiles = (dv + HBAR_TILE - 1) / HBAR_TILE;
    const int c0 = (blockIdx.x / col_tiles) * HBAR_TILE, e0 = (blockIdx.x % col_tiles) * HBAR_TILE;
    __shared__ double dev[HBAR_KEYS][HBAR_TILE + 1];  // k_j − μ_b on the tile's key columns
    __shared__ double val[HBAR_KEYS][HBAR_TILE + 1];  // v_j on the tile's value columns
    const int len_k = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
    const long long k_base = fp.varlen ? (long long)cu_k[seq] * fp.k_row : seq * fp.k_batch;
    const long long v_base = fp.varlen ? (long long)cu_k[seq] * fp.v_row : seq * fp.v_batch;
    const elem_t* k_g = k + k_base + kv * fp.k_head;
    const elem_t* v_g = v + v_base + kv * fp.v_head;
    const double* means = work + ((long long)seq * p.n_heads_kv + kv) * p.n_key_blocks * d;
    // Thread t owns element (c0 + t / 8, e0 + 4·(t % 8) + r) for r < 4 of the tile.
    const int row = threadIdx.x / 8, col = 4 * (threadIdx.x % 8);
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    for (int j0 = 0; j0 < len_k; j0 += HBAR_KEYS) {
        for (int e = threadIdx.x; e < HBAR_KEYS * HBAR_TILE; e += 256) {
            const int r = e / HBAR_TILE, c = e % HBAR_TILE, j = j0 + r;
            const bool in_k = j < len_k && c0 + c < d, in_v = j < len_k && e0 + c < dv;
            dev[r][c] = in_k ? (double)to_f32(k_g[(long long)j * fp.k_row + c0 + c]) -
                                   means[(long long)(j / p.kv_block) * d + c0 + c]
                             : 0.0;
            val[r][c] = in_v ? (double)to_f32(v_g[(long long)j * fp.v_row + e0 + c]) : 0.0;
        }
        __syncthreads();
        const int keys = min(HBAR_KEYS, len_k - j0);
        for (int r = 0; r < keys; ++r) {
            const double x = dev[r][row];
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[q] = fma(x, val[r][col + q], acc[q]);
        }
        __syncthreads();
    }
    const int n_blocks = (len_k + p.kv_block - 1) / p.kv_block;
    double* h_bar = work + p.hbar_at + ((long long)seq * p.n_heads_kv + kv) * d * dv;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        if (c0 + row < d && e0 + col + q < dv && n_blocks > 0) {
            h_bar[(long long)(c0 + row) * dv + e0 + col + q] = acc[q] / n_blocks;
        }
    }
}

extern "C" __global__ void __launch_bounds__(TAIL_THREADS)
pisa_tail_merge(const elem_t* __restrict__ q, const double* __restrict__ work, const int* __restrict__ lists,
                elem_t* __restrict__ o, float* __restrict__ lse, const int* __restrict__ cu_q,
                const int* __restrict__ cu_k, const PisaTailParams p) {
    const FlashParams& fp = p.flash;
    const int h = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv;
    const int kv = h / fp.group;
    const int len_q = fp.varlen ? cu_q[seq + 1] - cu_q[seq] : fp.dense_len_q;
    const int len_k = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
    const int row0 = blockIdx.x * TAIL_ROWS;
    if (row0 >= len_q) return;
    const int rows = min(TAIL_ROWS, len_q - row0);
    const int a = row0 / p.q_block;  // every row of the CTA is in query block a (TAIL_ROWS divides q_block)
    const int n_blocks = (len_k + p.kv_block - 1) / p.kv_block;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    double* mu = reinterpret_cast<double*>(smem_raw);         // [TAIL_BLOCKS][d]
    double* vsum = mu + TAIL_BLOCKS * d;                      // [TAIL_BLOCKS][dv]
    double* s = vsum + TAIL_BLOCKS * dv;                      // [TAIL_ROWS][TAIL_BLOCKS]: s_b, then e^{s_b − m}
    float* q_s = reinterpret_cast<float*>(s + TAIL_ROWS * TAIL_BLOCKS);  // [TAIL_ROWS][d + 1]
    unsigned char* listed = reinterpret_cast<unsigned char*>(q_s + TAIL_ROWS * (d + 1));  // [n_key_blocks]
    __shared__ double m_s[TAIL_ROWS], a_s[TAIL_ROWS], z_s[TAIL_ROWS], factor_s[TAIL_ROWS];
    __shared__ double exact_s[TAIL_ROWS], tail_s[TAIL_ROWS];
    __shared__ float lse_s[TAIL_ROWS];
    __shared__ int whole_s[TAIL_ROWS];

    const long long q_base = fp.varlen ? (long long)cu_q[seq] * fp.q_row : seq * fp.q_batch;
    const long long o_base = fp.varlen ? (long long)cu_q[seq] * fp.o_row : seq * fp.o_batch;
    const long long lse_base = fp.varlen ? (long long)cu_q[seq] + h * fp.lse_head : seq * fp.lse_batch + h * fp.lse_head;
    for (int e = threadIdx.x; e < TAIL_ROWS * d; e += TAIL_THREADS) {
        const int r = e / d, c = e % d;
        q_s[r * (d + 1) + c] = r < rows ? to_f32(q[q_base + h * fp.q_head + (long long)(row0 + r) * fp.q_row + c]) : 0.f;
    }
    for (int b = threadIdx.x; b < p.n_key_blocks; b += TAIL_THREADS) listed[b] = 0;
    __syncthreads();
    const int list_head = p.lists_per_kv_head ? kv : h;
    const int n_list_heads = p.lists_per_kv_head ? p.n_heads_kv : p.n_heads_kv * fp.group;
    const int* list = lists + (((long long)seq * n_list_heads + list_head) * p.n_query_blocks + a) * p.list_width;
    for (int w = threadIdx.x; w < p.list_width; w += TAIL_THREADS) {
        const int b = list[w];
        if (b >= 0 && b < p.n_key_blocks) listed[b] = 1;
    }
    if (threadIdx.x < TAIL_ROWS) {
        const int r = threadIdx.x;
        m_s[r] = (double)NEG_INF;
        a_s[r] = 0.0;
        z_s[r] = 0.0;
        whole_s[r] = r < rows ? tail_whole_blocks(p, row0 + r, len_q, len_k) : 0;
    }
    __syncthreads();
    int tail_end = 0;  // the blocks wholly visible to the CTA's last row bound every row's tail
    for (int r = 0; r < TAIL_ROWS; ++r) tail_end = max(tail_end, whole_s[r]);

    // Thread t accumulates rows t / 32 + 4·k (k < 4) at columns t % 32 + 32·g (g < dv / 32 rounded up).
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int col_groups = (dv + 31) / 32;
    double acc[TAIL_ROWS / 4][TAIL_MAX_COL_GROUPS];
#pragma unroll
    for (int k = 0; k < TAIL_ROWS / 4; ++k)
#pragma unroll
        for (int g = 0; g < TAIL_MAX_COL_GROUPS; ++g) acc[k][g] = 0.0;

    const double* means = work + ((long long)seq * p.n_heads_kv + kv) * p.n_key_blocks * d;
    const double* value_means = work + p.value_means_at + ((long long)seq * p.n_heads_kv + kv) * p.n_key_blocks * dv;
    for (int b0 = 0; b0 < tail_end; b0 += TAIL_BLOCKS) {
        const int tile = min(TAIL_BLOCKS, tail_end - b0);
        for (int e = threadIdx.x; e < TAIL_BLOCKS * d; e += TAIL_THREADS) {
            const int t = e / d;
            mu[e] = t < tile ? means[(long long)(b0 + t) * d + e % d] : 0.0;
        }
        for (int e = threadIdx.x; e < TAIL_BLOCKS * dv; e += TAIL_THREADS) {
            const int t = e / dv, b = b0 + t;
            const int count = min(p.kv_block, len_k - b * p.kv_block);
            vsum[e] = t < tile ? value_means[(long long)b * dv + e % dv] * count : 0.0;
        }
        __syncthreads();
        // Scores: thread t takes row t / 8 and blocks t % 8 and t % 8 + 8 of the tile.
        {
            const int r = threadIdx.x / 8;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int t = threadIdx.x % 8 + 8 * half, b = b0 + t;
                double score = (double)NEG_INF;
                if (t < tile && b < whole_s[r] && !listed[b]) {
                    double dot = 0.0;
                    for (int c = 0; c < d; ++c) dot = fma((double)q_s[r * (d + 1) + c], mu[t * d + c], dot);
                    score = p.scale * dot;
                }
                s[r * TAIL_BLOCKS + t] = score;
            }
        }
        __syncthreads();
        // The online softmax's step per row.
        if (threadIdx.x < TAIL_ROWS) {
            const int r = threadIdx.x;
            double tile_max = (double)NEG_INF;
            for (int t = 0; t < TAIL_BLOCKS; ++t) tile_max = fmax(tile_max, s[r * TAIL_BLOCKS + t]);
            const double m_old = m_s[r], m_new = fmax(m_old, tile_max);
            double factor = 1.0, a_sum = 0.0, z_sum = 0.0;
            if (m_new != (double)NEG_INF) {
                factor = exp(m_old - m_new);  // 0 when m_old = −∞
                for (int t = 0; t < TAIL_BLOCKS; ++t) {
                    const double w = exp(s[r * TAIL_BLOCKS + t] - m_new);  // 0 outside the tail
                    s[r * TAIL_BLOCKS + t] = w;
                    a_sum += w;
                    z_sum += w * min(p.kv_block, len_k - (b0 + t) * p.kv_block);
                }
            } else {
                for (int t = 0; t < TAIL_BLOCKS; ++t) s[r * TAIL_BLOCKS + t] = 0.0;
            }
            m_s[r] = m_new;
            a_s[r] = a_s[r] * factor + a_sum;
            z_s[r] = z_s[r] * factor + z_sum;
            factor_s[r] = factor;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TAIL_ROWS / 4; ++k) {
            const int r = warp + 4 * k;
            const double factor = factor_s[r];
#pragma unroll
            for (int g = 0; g < TAIL_MAX_COL_GROUPS; ++g) {
                const int c = lane + 32 * g;
                if (g < col_groups && c < dv) {
                    double x = acc[k][g] * factor;
                    for (int t = 0; t < TAIL_BLOCKS; ++t) x = fma(s[r * TAIL_BLOCKS + t], vsum[t * dv + c], x);
                    acc[k][g] = x;
                }
            }
        }
        __syncthreads();  // the next tile overwrites mu, vsum and s
    }

    // The shared heterogeneity term, A · α q_iᵀ H̄, then the merge with the exact part.
    const double* h_bar = work + p.hbar_at + ((long long)seq * p.n_heads_kv + kv) * d * dv;
    if (threadIdx.x < TAIL_ROWS) {
        const int r = threadIdx.x;
        double lse_exact = r < rows ? (double)lse[lse_base + row0 + r] : (double)NEG_INF;
        const double z = z_s[r], m = m_s[r];
        double exact_weight = 1.0, tail_weight = 0.0, lse_out = lse_exact;
        if (z > 0.0) {
            const double tail_log = m + log(z);
            const double top = fmax(lse_exact, tail_log);
            const double we = exp(lse_exact - top), wt = exp(m - top);  // we = 0 when the exact part is empty
            const double denominator = we + wt * z;
            exact_weight = we / denominator;
            tail_weight = wt / denominator;
            lse_out = top + log(denominator);
        }
        exact_s[r] = exact_weight;
        tail_s[r] = tail_weight;
        lse_s[r] = (float)lse_out;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < TAIL_ROWS / 4; ++k) {
        const int r = warp + 4 * k;
        if (r >= rows || tail_s[r] == 0.0) continue;  // no tail: O is the exact part's, untouched
        const double shared_weight = a_s[r] * p.scale;
#pragma unroll
        for (int g = 0; g < TAIL_MAX_COL_GROUPS; ++g) {
            const int c = lane + 32 * g;
            if (g < col_groups && c < dv) {
                double qh = 0.0;
                for (int cc = 0; cc < d; ++cc) qh = fma((double)q_s[r * (d + 1) + cc], h_bar[(long long)cc * dv + c], qh);
                const double numerator = fma(shared_weight, qh, acc[k][g]);
                elem_t* out = o + o_base + h * fp.o_head + (long long)(row0 + r) * fp.o_row + c;
                const double exact = (double)to_f32(*out);
                *out = to_elem((float)(exact_s[r] * exact + tail_s[r] * numerator));
            }
        }
    }
    if (threadIdx.x < rows && tail_s[threadIdx.x] != 0.0) lse[lse_base + row0 + threadIdx.x] = lse_s[threadIdx.x];
}
