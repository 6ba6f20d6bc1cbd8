// The backward of PISA's first-order tail (E22), compiled by NVRTC after common.cuh, bsa_select.cu and pisa_tail.cu
// (whose tail_whole_blocks, workspace layout and statistics it reads). The host wrapper is
// gpu/src/pisa/tail_backward.rs; the reference is the oracle's pisa::tail_backward (oracle/src/pisa.rs) and the plan
// proved by proofs::pisa::decomposed_tail_backward; the verifier is attnproof_harness::pisa_tail_backward.
//
// The loss is L = Σ_i dO_i · o_i with the blocks' classes held fixed. The exact part of every row is the block-sparse
// backward over the exact lists with the PISA output and LSE (the wrapper runs it first: its P = e^{s − lse} and
// D = dO·o are the exact keys' ∂L/∂s_j = p_j (dO·v_j − D)); these kernels add the tail's part to its dQ, dK and dV.
// With a_ib = e^{α q_i·μ_b − lse_i} (a tail block's weight per key: it carries a_ib |B_b| of the denominator),
// w_i = H̄ dO_i, through_i = α q_i·w_i (= dO_i·h_i, h_i = α H̄ᵀ q_i) and A_i = Σ_b a_ib over the row's tail:
//
//   g_ib  = a_ib (|B_b| (dO_i·v̄_b − D_i) + through_i)      (∂L/∂(α q_i·μ_b); V^Σ_b = |B_b| v̄_b)
//   dq_i += α Σ_b g_ib μ_b + A_i α w_i
//   dμ_b  = α Σ_i g_ib q_i,   dV^Σ_b = Σ_i a_ib dO_i,   G = Σ_i A_i α q_i dO_iᵀ   (rows of every query head of the group)
//   dk_j += dμ_b / |B_b| + G (v_j − v̄_b) / n_b,   dv_j += dV^Σ_b + Gᵀ (k_j − μ_b) / n_b   (every key of the sequence)
//
// Kernels, all in f64 from the forward's f64 statistics (μ_b, v̄_b, H̄ in the f64 workspace pisa_tail_means and
// pisa_tail_hbar_sum wrote) and the storage-type inputs, with D read from the block-sparse backward's f32 output:
//   pisa_tail_bwd_rows     a CTA of 256 threads per (TAILB_TILE rows of a query block, query head, sequence): W = H̄ dO
//                          and dO·h per row, then the rows' tail blocks a tile of TAILB_TILE at a time (blocks staged
//                          in shared memory with the rows, f64 products register-tiled over the pair), dq += the tail's
//                          part, rounded once to storage from the exact part's stored value plus the f64 sum; dO·h and
//                          A per row into the row workspaces.
//   pisa_tail_bwd_blocks   a CTA per (TAILB_TILE key blocks, KV head, sequence): dμ_b and dV^Σ_b of its blocks over
//                          the rows of every query head of the group, a tile of rows at a time in ascending order (heads,
//                          then rows), the weights recomputed as the rows kernel computes them (deterministic).
//   pisa_tail_bwd_g        a CTA per (64 × 64 tile of [d, dv], range of TAILB_G_ROWS rows, query head, sequence):
//                          the range's part of Σ_i A_i α q_i dO_iᵀ; pisa_tail_bwd_g_sum adds the ranges and the group's
//                          heads in ascending order into G.
//   pisa_tail_bwd_scatter  a CTA per TAILB_KEYS keys of a KV head: dk and dv of every key, rounded once from the exact
//                          part's stored value plus the f64 sum. A key whose tail part is exactly 0 keeps its bits.
// Every sum runs in a fixed order: the outputs are bitwise reproducible when the exact part's are.

#ifndef TAILB_TILE
#error "define TAILB_TILE (rows and blocks per tile of the tiled kernels: 32, or 16 past head dims of 128)"
#endif
#define TAILB_WARPS 8
#define TAILB_THREADS (TAILB_WARPS * 32)  // the tiled kernels (rows, blocks)
#define TAILB_SMALL_THREADS 128           // the others (G, its sum, the scatter)
#define TAILB_G_TILE 64                        // rows (q columns) and columns (dO columns) of pisa_tail_bwd_g's tile
#define TAILB_G_ROWS 4096                      // query rows per CTA of pisa_tail_bwd_g (a partial sum each)
#define TAILB_G_STAGE 32                       // rows staged in shared memory at a time
#define TAILB_KEYS 8                           // keys per CTA of pisa_tail_bwd_scatter (32 KiB of shared at 256)

// The sequence's row and key extents and the bases of Q/dO (dQ shares Q's layout), O and LSE.
struct TailRows {
    int len_q, len_k;
    long long q_base, o_base, lse_base;
};

__device__ __forceinline__ TailRows tail_rows(const FlashParams& fp, const int* cu_q, const int* cu_k, int seq, int h) {
    TailRows r;
    r.len_q = fp.varlen ? cu_q[seq + 1] - cu_q[seq] : fp.dense_len_q;
    r.len_k = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
    r.q_base = (fp.varlen ? (long long)cu_q[seq] * fp.q_row : seq * fp.q_batch) + h * fp.q_head;
    r.o_base = (fp.varlen ? (long long)cu_q[seq] * fp.o_row : seq * fp.o_batch) + h * fp.o_head;
    r.lse_base = fp.varlen ? (long long)cu_q[seq] + h * fp.lse_head : seq * fp.lse_batch + h * fp.lse_head;
    return r;
}

// The exact list of query block a for query head h (ascending, −1-padded).
__device__ __forceinline__ const int* tail_list(const PisaTailParams& p, const int* lists, int seq, int h, int a) {
    const int kv = h / p.flash.group;
    const int list_head = p.lists_per_kv_head ? kv : h;
    const int n_list_heads = p.lists_per_kv_head ? p.n_heads_kv : p.n_heads_kv * p.flash.group;
    return lists + (((long long)seq * n_list_heads + list_head) * p.n_query_blocks + a) * p.list_width;
}

// Whether key block b is in the (ascending, −1-padded) list.
__device__ __forceinline__ bool tail_listed(const int* list, int width, int b) {
    for (int w = 0; w < width; ++w) {
        const int x = list[w];
        if (x < 0 || x > b) return false;
        if (x == b) return true;
    }
    return false;
}

// The tiled kernels' shared memory, in f64: a tile of TAILB_TILE rows (queries and dO), a tile of TAILB_TILE blocks (μ and
// v̄), the rows' W = H̄ dO (the rows kernel), the tile pair's α g and a, and per row its LSE, D and dO·h; then a byte per
// (row, block) of the pair: 1 where the block is in the row's tail; then the caller's flags (the host's
// tiled_shared_bytes in gpu/src/pisa/tail_backward.rs is this layout's size). Rows of q/μ and dO/v̄ are padded by one f64, so
// that a warp reading one column of TAILB_TILE different rows hits distinct banks.
#define TAILB_QS (HEAD_DIM_PAD + 1)
#define TAILB_VS (HEAD_DIM_V_PAD + 1)
#define TAILB_PS (TAILB_TILE + 1)
struct TailTileShared {
    double* q;        // [TAILB_TILE][TAILB_QS]
    double* g;        // [TAILB_TILE][TAILB_VS]  dO
    double* mu;       // [TAILB_TILE][TAILB_QS]
    double* vbar;     // [TAILB_TILE][TAILB_VS]
    double* w;        // [TAILB_TILE][TAILB_QS]  H̄ dO (rows kernel)
    double* pg;       // [TAILB_TILE][TAILB_PS]  α g
    double* pa;       // [TAILB_TILE][TAILB_PS]  a
    double* row_lse;  // [TAILB_TILE]
    double* row_delta;
    double* row_through;
    unsigned char* tail;  // [TAILB_TILE][TAILB_TILE]
};

__device__ __forceinline__ TailTileShared tail_tile_shared(unsigned char* raw) {
    TailTileShared t;
    double* x = reinterpret_cast<double*>(raw);
    t.q = x;
    x += TAILB_TILE * TAILB_QS;
    t.g = x;
    x += TAILB_TILE * TAILB_VS;
    t.mu = x;
    x += TAILB_TILE * TAILB_QS;
    t.vbar = x;
    x += TAILB_TILE * TAILB_VS;
    t.w = x;
    x += TAILB_TILE * TAILB_QS;
    t.pg = x;
    x += TAILB_TILE * TAILB_PS;
    t.pa = x;
    x += TAILB_TILE * TAILB_PS;
    t.row_lse = x;
    t.row_delta = x + TAILB_TILE;
    t.row_through = x + 2 * TAILB_TILE;
    t.tail = reinterpret_cast<unsigned char*>(x + 3 * TAILB_TILE);
    return t;
}

// Copies `rows` storage-type rows of n columns (row stride `stride`) into an f64 tile of row stride ld, zero past them.
__device__ __forceinline__ void stage_rows(double* tile, int ld, const elem_t* src, long long stride, int rows, int n) {
    for (int idx = threadIdx.x; idx < TAILB_TILE * ld; idx += TAILB_THREADS) {
        const int r = idx / ld, c = idx % ld;
        tile[idx] = (r < rows && c < n) ? (double)to_f32(src[(long long)r * stride + c]) : 0.0;
    }
}

// Copies `rows` f64 rows of n columns (contiguous) into an f64 tile of row stride ld, zero past them.
__device__ __forceinline__ void stage_f64(double* tile, int ld, const double* src, int rows, int n) {
    for (int idx = threadIdx.x; idx < TAILB_TILE * ld; idx += TAILB_THREADS) {
        const int r = idx / ld, c = idx % ld;
        tile[idx] = (r < rows && c < n) ? src[(long long)r * n + c] : 0.0;
    }
}

// The weights of a tile pair (E22's backward): for every (row, block) with t.tail set, s = q·μ_b, dp = dO·v̄_b,
// a = e^{α s − lse}, g = a (C (dp − D) + dO·h), into t.pa = a and t.pg = α g; 0 elsewhere. Every dot product runs over
// its columns in ascending order.
__device__ __forceinline__ void tail_tile_weights(const TailTileShared& t, const PisaTailParams& p) {
    const int d = p.flash.d, dv = p.flash.dv;
    const double count = (double)p.kv_block;
    // Thread t takes block b = t % TAILB_TILE against rows t / TAILB_TILE + STEP j: each μ_b and v̄_b column is read once
    // for its E rows (the entries t + TAILB_THREADS j of the tile pair).
    constexpr int E = TAILB_TILE * TAILB_TILE / TAILB_THREADS, STEP = TAILB_THREADS / TAILB_TILE;
    const int b = threadIdx.x % TAILB_TILE, r_first = threadIdx.x / TAILB_TILE;
    double score[E], dp[E];
#pragma unroll
    for (int j = 0; j < E; ++j) score[j] = dp[j] = 0.0;
    for (int c = 0; c < d; ++c) {
        const double m = t.mu[b * TAILB_QS + c];
#pragma unroll
        for (int j = 0; j < E; ++j) score[j] = fma(t.q[(r_first + STEP * j) * TAILB_QS + c], m, score[j]);
    }
    for (int e = 0; e < dv; ++e) {
        const double v = t.vbar[b * TAILB_VS + e];
#pragma unroll
        for (int j = 0; j < E; ++j) dp[j] = fma(t.g[(r_first + STEP * j) * TAILB_VS + e], v, dp[j]);
    }
#pragma unroll
    for (int j = 0; j < E; ++j) {
        const int r = r_first + STEP * j;
        double a = 0.0, g = 0.0;
        if (t.tail[r * TAILB_TILE + b]) {
            a = exp(p.scale * score[j] - t.row_lse[r]);
            g = a * (count * (dp[j] - t.row_delta[r]) + t.row_through[r]);
        }
        t.pa[r * TAILB_PS + b] = a;
        t.pg[r * TAILB_PS + b] = p.scale * g;
    }
}

// One CTA per (TAILB_TILE rows of a query block, query head, sequence): the rows' tail part of dQ over their tail blocks,
// a tile of TAILB_TILE blocks at a time in ascending order; dO·h and A per row into the row workspaces.
extern "C" __global__ void __launch_bounds__(TAILB_THREADS)
pisa_tail_bwd_rows(const elem_t* __restrict__ q, const elem_t* __restrict__ d_out, const int* __restrict__ lists,
                   const double* __restrict__ stats, const float* __restrict__ lse, const float* __restrict__ delta,
                   double* __restrict__ through_out, double* __restrict__ mass_out, elem_t* __restrict__ dq,
                   const int* __restrict__ cu_q, const int* __restrict__ cu_k, const PisaTailParams p) {
    const FlashParams& fp = p.flash;
    const int h = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv, kv = h / fp.group;
    const TailRows r = tail_rows(fp, cu_q, cu_k, seq, h);
    const int row0 = blockIdx.x * TAILB_TILE;
    if (row0 >= r.len_q) return;
    const int rows = min(TAILB_TILE, r.len_q - row0);
    const int whole_blocks = r.len_k / p.kv_block;
    // The tile's last row sees the most whole blocks (TAILB_TILE divides q_block: one query block, one list).
    const int tail_end = min(tail_whole_blocks(p, row0 + rows - 1, r.len_q, r.len_k), whole_blocks);
    const int* list = tail_list(p, lists, seq, h, row0 / p.q_block);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const TailTileShared t = tail_tile_shared(smem_raw);
    unsigned char* listed = t.tail + TAILB_TILE * TAILB_TILE;  // [n_key_blocks]
    for (int b = threadIdx.x; b < p.n_key_blocks; b += TAILB_THREADS) listed[b] = 0;
    __syncthreads();
    for (int x = threadIdx.x; x < p.list_width; x += TAILB_THREADS) {
        const int b = list[x];
        if (b >= 0 && b < p.n_key_blocks) listed[b] = 1;
    }
    stage_rows(t.q, TAILB_QS, q + r.q_base + (long long)row0 * fp.q_row, fp.q_row, rows, d);
    stage_rows(t.g, TAILB_VS, d_out + r.o_base + (long long)row0 * fp.o_row, fp.o_row, rows, dv);
    for (int i = threadIdx.x; i < TAILB_TILE; i += TAILB_THREADS) {
        const bool here = i < rows;
        t.row_lse[i] = here ? (double)lse[r.lse_base + row0 + i] : 0.0;
        t.row_delta[i] = here ? (double)delta[r.lse_base + row0 + i] : 0.0;
    }
    __syncthreads();
    // W = H̄ dO per row, then dO·h = α q·W.
    const long long head = (long long)seq * p.n_heads_kv + kv;
    const double* hbar = stats + p.hbar_at + head * d * dv;
    for (int idx = threadIdx.x; idx < TAILB_TILE * TAILB_QS; idx += TAILB_THREADS) {
        const int i = idx / TAILB_QS, c = idx % TAILB_QS;
        double s = 0.0;
        if (c < d && i < rows) {
            for (int e = 0; e < dv; ++e) s = fma(hbar[(long long)c * dv + e], t.g[i * TAILB_VS + e], s);
        }
        t.w[idx] = s;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < TAILB_TILE; i += TAILB_THREADS) {
        double s = 0.0;
        for (int c = 0; c < d; ++c) s = fma(t.q[i * TAILB_QS + c], t.w[i * TAILB_QS + c], s);
        t.row_through[i] = p.scale * s;
    }
    constexpr int ACC = TAILB_TILE * HEAD_DIM_PAD / TAILB_THREADS;
    double acc[ACC];
#pragma unroll
    for (int j = 0; j < ACC; ++j) acc[j] = 0.0;
    double mass = 0.0;  // thread i < TAILB_TILE: row i's A, its tiles in ascending order
    const double* means = stats + head * p.n_key_blocks * d;
    const double* value_means = stats + p.value_means_at + head * p.n_key_blocks * dv;
    for (int b0 = 0; b0 < tail_end; b0 += TAILB_TILE) {
        const int blocks = min(TAILB_TILE, tail_end - b0);
        __syncthreads();  // every thread is done with the last tile pair
        stage_f64(t.mu, TAILB_QS, means + (long long)b0 * d, blocks, d);
        stage_f64(t.vbar, TAILB_VS, value_means + (long long)b0 * dv, blocks, dv);
        int any_tail = 0;
        for (int idx = threadIdx.x; idx < TAILB_TILE * TAILB_TILE; idx += TAILB_THREADS) {
            const int i = idx / TAILB_TILE, bb = idx % TAILB_TILE, b = b0 + bb;
            const bool row_sees = i < rows && b < min(tail_whole_blocks(p, row0 + i, r.len_q, r.len_k), whole_blocks);
            t.tail[idx] = row_sees && bb < blocks && !listed[b] && t.row_lse[i] != (double)NEG_INF;
            any_tail |= t.tail[idx];
        }
        if (!__syncthreads_or(any_tail)) continue;  // the tile holds no tail block of any row
        tail_tile_weights(t, p);
        __syncthreads();
        if (threadIdx.x < TAILB_TILE) {
            for (int bb = 0; bb < TAILB_TILE; ++bb) mass += t.pa[threadIdx.x * TAILB_PS + bb];
        }
        // Entry j is (row i_j, column c_j) = divmod(t + TAILB_THREADS j, HEAD_DIM_PAD): where TAILB_THREADS is a multiple
        // of HEAD_DIM_PAD every c_j is the same column, and μ_b's element is read once for all j.
        for (int bb = 0; bb < TAILB_TILE; ++bb) {
            const double m_same = t.mu[bb * TAILB_QS + threadIdx.x % HEAD_DIM_PAD];
#pragma unroll
            for (int j = 0; j < ACC; ++j) {
                const int idx = threadIdx.x + TAILB_THREADS * j, i = idx / HEAD_DIM_PAD, c = idx % HEAD_DIM_PAD;
                const double m = TAILB_THREADS % HEAD_DIM_PAD == 0 ? m_same : t.mu[bb * TAILB_QS + c];
                acc[j] = fma(t.pg[i * TAILB_PS + bb], m, acc[j]);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < TAILB_TILE) t.row_lse[threadIdx.x] = mass;  // A per row, for every thread below
    if (threadIdx.x < rows) {
        through_out[r.lse_base + row0 + threadIdx.x] = t.row_through[threadIdx.x];
        mass_out[r.lse_base + row0 + threadIdx.x] = mass;
    }
    __syncthreads();
    elem_t* dq_tile = dq + r.q_base + (long long)row0 * fp.q_row;
#pragma unroll
    for (int j = 0; j < ACC; ++j) {
        const int idx = threadIdx.x + TAILB_THREADS * j, i = idx / HEAD_DIM_PAD, c = idx % HEAD_DIM_PAD;
        if (i >= rows || c >= d) continue;
        const double add = fma(t.row_lse[i] * p.scale, t.w[i * TAILB_QS + c], acc[j]);
        elem_t* dq_out = dq_tile + (long long)i * fp.q_row + c;
        if (add != 0.0) *dq_out = to_elem_rn((double)to_f32(*dq_out) + add);
    }
}

// One CTA per (TAILB_TILE key blocks, KV head, sequence): dμ_b and dV^Σ_b of its blocks over the rows of every query
// head of the group, a tile of TAILB_TILE rows at a time (heads, then rows, ascending).
extern "C" __global__ void __launch_bounds__(TAILB_THREADS)
pisa_tail_bwd_blocks(const elem_t* __restrict__ q, const elem_t* __restrict__ d_out, const int* __restrict__ lists,
                     const double* __restrict__ stats, const float* __restrict__ lse, const float* __restrict__ delta,
                     const double* __restrict__ through_in, double* __restrict__ grads, const int* __restrict__ cu_q,
                     const int* __restrict__ cu_k, const PisaTailParams p) {
    const FlashParams& fp = p.flash;
    const int kv = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv;
    const int b0 = blockIdx.x * TAILB_TILE;
    const TailRows r0 = tail_rows(fp, cu_q, cu_k, seq, 0);
    if (b0 * p.kv_block >= r0.len_k) return;  // no such block in this sequence: nothing reads its gradients
    const int n_blocks = (r0.len_k + p.kv_block - 1) / p.kv_block, whole_blocks = r0.len_k / p.kv_block;
    const int blocks = min(TAILB_TILE, n_blocks - b0);
    const long long head = (long long)seq * p.n_heads_kv + kv;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const TailTileShared t = tail_tile_shared(smem_raw);
    unsigned char* listed = t.tail + TAILB_TILE * TAILB_TILE;  // [TAILB_TILE]: the tile's blocks a query block lists
    stage_f64(t.mu, TAILB_QS, stats + (head * p.n_key_blocks + b0) * d, blocks, d);
    stage_f64(t.vbar, TAILB_VS, stats + p.value_means_at + (head * p.n_key_blocks + b0) * dv, blocks, dv);
    constexpr int ACC_K = TAILB_TILE * HEAD_DIM_PAD / TAILB_THREADS;
    constexpr int ACC_V = TAILB_TILE * HEAD_DIM_V_PAD / TAILB_THREADS;
    double dm[ACC_K], ds[ACC_V];
#pragma unroll
    for (int j = 0; j < ACC_K; ++j) dm[j] = 0.0;
#pragma unroll
    for (int j = 0; j < ACC_V; ++j) ds[j] = 0.0;
    for (int hg = 0; hg < fp.group; ++hg) {
        const int h = kv * fp.group + hg;
        const TailRows r = tail_rows(fp, cu_q, cu_k, seq, h);
        for (int row0 = 0; row0 < r.len_q; row0 += TAILB_TILE) {
            const int rows = min(TAILB_TILE, r.len_q - row0);
            // The tile's last row sees the most: if it sees none of the blocks whole, no row of the tile does.
            if (min(tail_whole_blocks(p, row0 + rows - 1, r.len_q, r.len_k), whole_blocks) <= b0) continue;
            const int* list = tail_list(p, lists, seq, h, row0 / p.q_block);
            __syncthreads();  // every thread is done with the last row tile
            for (int bb = threadIdx.x; bb < TAILB_TILE; bb += TAILB_THREADS) listed[bb] = tail_listed(list, p.list_width, b0 + bb);
            stage_rows(t.q, TAILB_QS, q + r.q_base + (long long)row0 * fp.q_row, fp.q_row, rows, d);
            stage_rows(t.g, TAILB_VS, d_out + r.o_base + (long long)row0 * fp.o_row, fp.o_row, rows, dv);
            for (int i = threadIdx.x; i < TAILB_TILE; i += TAILB_THREADS) {
                const bool here = i < rows;
                const long long at = r.lse_base + row0 + i;
                t.row_lse[i] = here ? (double)lse[at] : 0.0;
                t.row_delta[i] = here ? (double)delta[at] : 0.0;
                t.row_through[i] = here ? through_in[at] : 0.0;
            }
            __syncthreads();
            int any_tail = 0;
            for (int idx = threadIdx.x; idx < TAILB_TILE * TAILB_TILE; idx += TAILB_THREADS) {
                const int i = idx / TAILB_TILE, bb = idx % TAILB_TILE, b = b0 + bb;
                const bool row_sees =
                    i < rows && b < min(tail_whole_blocks(p, row0 + i, r.len_q, r.len_k), whole_blocks);
                t.tail[idx] = row_sees && bb < blocks && !listed[bb] && t.row_lse[i] != (double)NEG_INF;
                any_tail |= t.tail[idx];
            }
            if (!__syncthreads_or(any_tail)) continue;  // no row of the tile holds one of the blocks in its tail
            tail_tile_weights(t, p);
            __syncthreads();
            // As in the rows kernel: where TAILB_THREADS is a multiple of the padded dim, every entry of a thread has
            // the same column, whose q (dO) element is read once per row for all of them.
            for (int i = 0; i < TAILB_TILE; ++i) {
                const double q_same = t.q[i * TAILB_QS + threadIdx.x % HEAD_DIM_PAD];
#pragma unroll
                for (int j = 0; j < ACC_K; ++j) {
                    const int idx = threadIdx.x + TAILB_THREADS * j, bb = idx / HEAD_DIM_PAD, c = idx % HEAD_DIM_PAD;
                    const double x = TAILB_THREADS % HEAD_DIM_PAD == 0 ? q_same : t.q[i * TAILB_QS + c];
                    dm[j] = fma(t.pg[i * TAILB_PS + bb], x, dm[j]);
                }
                const double g_same = t.g[i * TAILB_VS + threadIdx.x % HEAD_DIM_V_PAD];
#pragma unroll
                for (int j = 0; j < ACC_V; ++j) {
                    const int idx = threadIdx.x + TAILB_THREADS * j, bb = idx / HEAD_DIM_V_PAD, e = idx % HEAD_DIM_V_PAD;
                    const double x = TAILB_THREADS % HEAD_DIM_V_PAD == 0 ? g_same : t.g[i * TAILB_VS + e];
                    ds[j] = fma(t.pa[i * TAILB_PS + bb], x, ds[j]);
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < ACC_K; ++j) {
        const int idx = threadIdx.x + TAILB_THREADS * j, bb = idx / HEAD_DIM_PAD, c = idx % HEAD_DIM_PAD;
        if (bb < blocks && c < d) grads[(head * p.n_key_blocks + b0 + bb) * d + c] = dm[j];
    }
#pragma unroll
    for (int j = 0; j < ACC_V; ++j) {
        const int idx = threadIdx.x + TAILB_THREADS * j, bb = idx / HEAD_DIM_V_PAD, e = idx % HEAD_DIM_V_PAD;
        if (bb < blocks && e < dv) grads[p.value_means_at + (head * p.n_key_blocks + b0 + bb) * dv + e] = ds[j];
    }
}

extern "C" __global__ void __launch_bounds__(TAILB_SMALL_THREADS)
pisa_tail_bwd_g(const elem_t* __restrict__ q, const elem_t* __restrict__ d_out, const double* __restrict__ mass_in,
                double* __restrict__ partials, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                const PisaTailParams p, const int row_splits) {
    const FlashParams& fp = p.flash;
    const int h = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv;
    const int col_tiles = (dv + TAILB_G_TILE - 1) / TAILB_G_TILE;
    const int split = blockIdx.x % row_splits, tile = blockIdx.x / row_splits;
    const int c0 = (tile / col_tiles) * TAILB_G_TILE, e0 = (tile % col_tiles) * TAILB_G_TILE;
    const TailRows r = tail_rows(fp, cu_q, cu_k, seq, h);
    const int i_begin = split * TAILB_G_ROWS, i_end = min(r.len_q, i_begin + TAILB_G_ROWS);
    // Thread t owns row c0 + t / (TILE / COLS) of the tile and its COLS columns from e0 + COLS (t % (TILE / COLS)).
    constexpr int COLS = TAILB_G_TILE * TAILB_G_TILE / TAILB_SMALL_THREADS;
    const int c_local = threadIdx.x / (TAILB_G_TILE / COLS), e_local = (threadIdx.x % (TAILB_G_TILE / COLS)) * COLS;
    double acc[COLS];
#pragma unroll
    for (int k = 0; k < COLS; ++k) acc[k] = 0.0;
    __shared__ double qa_s[TAILB_G_STAGE][TAILB_G_TILE];  // A_i α q_ic
    __shared__ double g_s[TAILB_G_STAGE][TAILB_G_TILE];   // dO_ie
    for (int i0 = i_begin; i0 < i_end; i0 += TAILB_G_STAGE) {
        __syncthreads();  // every thread is done with the last stage
        for (int x = threadIdx.x; x < TAILB_G_STAGE * TAILB_G_TILE; x += TAILB_SMALL_THREADS) {
            const int rr = x / TAILB_G_TILE, cc = x % TAILB_G_TILE, i = i0 + rr;
            double qa = 0.0, g = 0.0;
            if (i < i_end) {
                const double coefficient = mass_in[r.lse_base + i] * p.scale;
                if (c0 + cc < d) qa = coefficient * (double)to_f32(q[r.q_base + (long long)i * fp.q_row + c0 + cc]);
                if (e0 + cc < dv) g = (double)to_f32(d_out[r.o_base + (long long)i * fp.o_row + e0 + cc]);
            }
            qa_s[rr][cc] = qa;
            g_s[rr][cc] = g;
        }
        __syncthreads();
        for (int rr = 0; rr < TAILB_G_STAGE; ++rr) {
            const double qa = qa_s[rr][c_local];
#pragma unroll
            for (int k = 0; k < COLS; ++k) acc[k] = fma(qa, g_s[rr][e_local + k], acc[k]);
        }
    }
    const int c = c0 + c_local;
    if (c >= d) return;
    const long long heads = (long long)gridDim.z * gridDim.y;
    double* out = partials + ((long long)split * heads + (long long)seq * gridDim.y + h) * d * dv + (long long)c * dv;
#pragma unroll
    for (int k = 0; k < COLS; ++k) {
        const int e = e0 + e_local + k;
        if (e < dv) out[e] = acc[k];
    }
}

// G = Σ over the group's query heads (ascending) of Σ over the row ranges (ascending) of the partial sums, into the
// f64 gradient workspace at hbar_at: one thread per element of [d, dv] (grid (elements / TAILB_SMALL_THREADS, KV head,
// sequence)).
extern "C" __global__ void __launch_bounds__(TAILB_SMALL_THREADS)
pisa_tail_bwd_g_sum(const double* __restrict__ partials, double* __restrict__ grads, const int* __restrict__ cu_q,
                    const PisaTailParams p, const int row_splits) {
    const FlashParams& fp = p.flash;
    const int kv = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv;
    const long long at = (long long)blockIdx.x * TAILB_SMALL_THREADS + threadIdx.x;
    if (at >= (long long)d * dv) return;
    const int len_q = fp.varlen ? cu_q[seq + 1] - cu_q[seq] : fp.dense_len_q;
    const int ranges = (len_q + TAILB_G_ROWS - 1) / TAILB_G_ROWS;
    const long long n_heads_q = (long long)p.n_heads_kv * fp.group, heads = (long long)gridDim.z * n_heads_q;
    double total = 0.0;
    for (int member = 0; member < fp.group; ++member) {
        const long long h = (long long)seq * n_heads_q + kv * fp.group + member;
        for (int s = 0; s < ranges && s < row_splits; ++s) total += partials[(s * heads + h) * d * dv + at];
    }
    grads[p.hbar_at + ((long long)seq * p.n_heads_kv + kv) * d * dv + at] = total;
}

extern "C" __global__ void __launch_bounds__(TAILB_SMALL_THREADS)
pisa_tail_bwd_scatter(const elem_t* __restrict__ k, const elem_t* __restrict__ v, const double* __restrict__ stats,
                      const double* __restrict__ grads, elem_t* __restrict__ dk, elem_t* __restrict__ dv_out,
                      const int* __restrict__ cu_k, const PisaTailParams p) {
    const FlashParams& fp = p.flash;
    const int kv = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv;
    const int len_k = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
    const int j0 = blockIdx.x * TAILB_KEYS;
    if (j0 >= len_k) return;
    const int keys = min(TAILB_KEYS, len_k - j0);
    const int n_blocks = (len_k + p.kv_block - 1) / p.kv_block;
    const long long head = (long long)seq * p.n_heads_kv + kv;
    const double* means = stats + head * p.n_key_blocks * d;
    const double* value_means = stats + p.value_means_at + head * p.n_key_blocks * dv;
    const double* d_means = grads + head * p.n_key_blocks * d;
    const double* d_sums = grads + p.value_means_at + head * p.n_key_blocks * dv;
    const double* g = grads + p.hbar_at + head * d * dv;
    const long long k_base = (fp.varlen ? (long long)cu_k[seq] * fp.k_row : seq * fp.k_batch) + kv * fp.k_head;
    const long long v_base = (fp.varlen ? (long long)cu_k[seq] * fp.v_row : seq * fp.v_batch) + kv * fp.v_head;
    // The keys' deviations from their blocks' means: y = k_j − μ_b, x = v_j − v̄_b.
    __shared__ double y_s[TAILB_KEYS][HEAD_DIM_PAD];
    __shared__ double x_s[TAILB_KEYS][HEAD_DIM_V_PAD];
    for (int idx = threadIdx.x; idx < TAILB_KEYS * HEAD_DIM_PAD; idx += TAILB_SMALL_THREADS) {
        const int jj = idx / HEAD_DIM_PAD, c = idx % HEAD_DIM_PAD, j = j0 + jj, b = j / p.kv_block;
        y_s[jj][c] = (jj < keys && c < d)
                         ? (double)to_f32(k[k_base + (long long)j * fp.k_row + c]) - means[(long long)b * d + c]
                         : 0.0;
    }
    for (int idx = threadIdx.x; idx < TAILB_KEYS * HEAD_DIM_V_PAD; idx += TAILB_SMALL_THREADS) {
        const int jj = idx / HEAD_DIM_V_PAD, e = idx % HEAD_DIM_V_PAD, j = j0 + jj, b = j / p.kv_block;
        x_s[jj][e] = (jj < keys && e < dv)
                         ? (double)to_f32(v[v_base + (long long)j * fp.v_row + e]) - value_means[(long long)b * dv + e]
                         : 0.0;
    }
    __syncthreads();
    const double per_block = 1.0 / (double)n_blocks;
    // dK: column c, Σ_e G_ce x_je.
    for (int c = threadIdx.x; c < d; c += TAILB_SMALL_THREADS) {
        double s[TAILB_KEYS];
#pragma unroll
        for (int jj = 0; jj < TAILB_KEYS; ++jj) s[jj] = 0.0;
        for (int e = 0; e < dv; ++e) {
            const double ge = g[(long long)c * dv + e];
#pragma unroll
            for (int jj = 0; jj < TAILB_KEYS; ++jj) s[jj] = fma(ge, x_s[jj][e], s[jj]);
        }
#pragma unroll
        for (int jj = 0; jj < TAILB_KEYS; ++jj) {
            if (jj >= keys) break;
            const int j = j0 + jj, b = j / p.kv_block;
            const int count = min(p.kv_block, len_k - b * p.kv_block);
            const double add = d_means[(long long)b * d + c] / count + s[jj] * per_block;
            elem_t* out = dk + k_base + (long long)j * fp.k_row + c;
            if (add != 0.0) *out = to_elem_rn((double)to_f32(*out) + add);
        }
    }
    // dV: column e, Σ_c G_ce y_jc.
    for (int e = threadIdx.x; e < dv; e += TAILB_SMALL_THREADS) {
        double s[TAILB_KEYS];
#pragma unroll
        for (int jj = 0; jj < TAILB_KEYS; ++jj) s[jj] = 0.0;
        for (int c = 0; c < d; ++c) {
            const double ge = g[(long long)c * dv + e];
#pragma unroll
            for (int jj = 0; jj < TAILB_KEYS; ++jj) s[jj] = fma(ge, y_s[jj][c], s[jj]);
        }
#pragma unroll
        for (int jj = 0; jj < TAILB_KEYS; ++jj) {
            if (jj >= keys) break;
            const int j = j0 + jj, b = j / p.kv_block;
            const double add = d_sums[(long long)b * dv + e] + s[jj] * per_block;
            elem_t* out = dv_out + v_base + (long long)j * fp.v_row + e;
            if (add != 0.0) *out = to_elem_rn((double)to_f32(*out) + add);
        }
    }
}
