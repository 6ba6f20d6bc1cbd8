// PISA's first-order tail (E22) on top of the block-sparse forward, compiled by NVRTC (see gpu/src/compile.rs) after
// common.cuh and bsa_select.cu, whose block mean (pool_block) it reuses. The host wrapper is gpu/src/pisa/tail.rs; the
// reference is the oracle's pisa::tail_output (oracle/src/pisa.rs), the verifier attnproof_harness::pisa_tail.
//
// The exact part of every row (its query block's listed key blocks, every block the mask cuts for a row of the block
// and a partial last block, which the wrapper adds to the lists) is the block-sparse forward's O and LSE. This file adds
// the tail: the whole key blocks the row sees and its list does not hold, each as its first-order summary, in the same
// softmax. Every tail block therefore has exactly kv_block keys (C).
//
// Four kernels:
//   pisa_tail_means  one CTA per (key block, KV head, sequence): the block's mean key μ_b and mean value v̄_b in f64
//                    (pool_block, the selector's block mean) into the f64 workspace's [B, Hkv, n_k, d] and [.., dv],
//                    and their storage-type forms for the tensor cores: the mean key split in two, μ_hi = RN(μ_b) and
//                    μ_lo = RN(μ_b − μ_hi) (one row [μ_hi | μ_lo] of 2d, so that q·μ_hi + q·μ_lo is one dot product
//                    of length 2d whose products are exact), and RN(v̄_b), each rounded once from f64.
//   pisa_tail_hbar   one CTA per (64 × 64 tile of [d, dv], range of HBAR_SPLIT_KEYS keys, KV head, sequence),
//                    after pisa_tail_means: the range's part of Σ_b Σ_{j∈b} (k_j − μ_b) v_jᵀ (E22's H̄ before the
//                    division, over every block of the sequence, the partial last block too) as
//                    Σ_j k_j v_jᵀ − Σ_b n_b μ_b v̄_bᵀ: the first sum on the tensor cores, each stage of 32 keys in
//                    f32 from zero (two MMAs of 16 exact products), added in f64 in ascending key order; the
//                    centring term in f64 from the f64 means, blocks ascending; into the partial sums
//                    [ranges, B, Hkv, d, dv]. The f32 part of the error, at most γ'(32 + 2)·Σ_j |k_jc||v_je| (the
//                    tensor cores' accumulation model, proofs::flash_bound), is in the verifier's tolerance for H̄.
//   pisa_tail_hbar_sum  H̄ = (1/n_b) Σ of the ranges' partial sums in ascending order, into [B, Hkv, d, dv] in f64,
//                    and split like μ.
//   pisa_tail_merge  one CTA of TAIL_M rows of a query block per (row tile, query head, sequence), on tensor cores:
//                    the forward's recipe (flash_fwd.cu's header) over the pooled keys [μ_hi | μ_lo] against [q | q]
//                    and the rounded mean values, every row masked to its tail (whole blocks it sees, not listed),
//                    giving O_T = Σ_b α_b v̄_b / Σ_b α_b and lse_T = ln Σ_b α_b, α_b = e^{α q·μ_b}; then the shared
//                    term h = [q | q]·[H̄_hi ; H̄_lo] (H̄ split like μ, on the tensor cores), and in f64 the tail's
//                    average T = O_T + α h / C with log-mass lse_T + ln C (Σ_b α_b |B_b| = C Σ_b α_b, and A/Z = 1/C in
//                    E22's shared term), merged with the exact part read from O and LSE:
//                        M = max(lse_E, lse_T + ln C),  w_E = e^{lse_E − M},  w_T = e^{lse_T + ln C − M},
//                        o = (w_E O_E + w_T T) / (w_E + w_T),  lse = M + ln(w_E + w_T),
//                    written over O and LSE. A row whose tail is empty keeps its O and LSE bit for bit.
//
// Determinism: every sum runs in a fixed order (the tensor cores' tiles in ascending order, keys ascending in H̄), so
// the outputs are bitwise reproducible.

#ifndef HEAD_DIM_PAD
#error "define HEAD_DIM_PAD"
#endif
#ifndef HEAD_DIM_V_PAD
#error "define HEAD_DIM_V_PAD"
#endif

#define TAIL_WARPS 4
#define TAIL_THREADS (TAIL_WARPS * 32)
#define TAIL_M (TAIL_WARPS * 16)  // rows per CTA, one 16-row slice per warp: a query block of 64 or 128 rows
#define TAIL_N 64                 // pooled keys (tail blocks) per tile
#define TAIL_QK (2 * HEAD_DIM_PAD)  // columns of [q | q] and [μ_hi | μ_lo]; q is stored once and read twice
#define TAIL_QK_STRIDE (TAIL_QK + 8)  // 16 bytes of row padding: ldmatrix phases hit distinct bank groups
#define TAIL_Q_STRIDE (HEAD_DIM_PAD + 8)
#define TAIL_V_STRIDE (HEAD_DIM_V_PAD + 8)
#define TAIL_TILES_S (TAIL_N / 8)
#define TAIL_TILES_O (HEAD_DIM_V_PAD / 8)
// The shared term's column tiles are done in halves from dv = 128 on, so that its accumulators and O_T's fit together
// in few enough registers for three CTAs per SM (168 at d = dv = 128, 234 in one pass); each half must hold whole
// pairs of tiles (one ldmatrix.x4.trans feeds two).
#define TAIL_HALVES ((TAIL_TILES_O >= 16 && TAIL_TILES_O % 4 == 0) ? 2 : 1)
#define TAIL_HALF_TILES (TAIL_TILES_O / TAIL_HALVES)
// H̄'s rows are staged in chunks of TAIL_H_ROWS over the pooled keys' and values' buffers together (contiguous, free
// once the pooled tiles are done): as many whole k steps as fit, at most all of [H̄_hi ; H̄_lo].
#define TAIL_H_STRIDE (TAIL_HALF_TILES * 8 + 8)
#define TAIL_H_FIT ((TAIL_N * (TAIL_QK_STRIDE + TAIL_V_STRIDE) / TAIL_H_STRIDE) / 16 * 16)
#define TAIL_H_ROWS (TAIL_H_FIT < TAIL_QK ? TAIL_H_FIT : TAIL_QK)
#define HBAR_TILE 64      // rows (key columns) and columns (value columns) of pisa_tail_hbar's tile of H̄
#define HBAR_KEYS 32      // keys per pipeline stage of pisa_tail_hbar
#define HBAR_STAGES 4
#define HBAR_STRIDE (HBAR_TILE + 8)
#define HBAR_THREADS 128  // four warps of 16 tile rows
#define HBAR_SPLIT_KEYS 4096  // keys per CTA of pisa_tail_hbar (a partial sum each), a multiple of both block sizes
#define HBAR_SUM_THREADS 128

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
                elem_t* __restrict__ pooled, const int* __restrict__ cu_k, const PisaTailParams p) {
    const FlashParams& fp = p.flash;
    const int b = blockIdx.x, kv = blockIdx.y, seq = blockIdx.z;
    const long long block_row = ((long long)seq * p.n_heads_kv + kv) * p.n_key_blocks + b;
    double* mean_key = work + block_row * fp.d;
    double* mean_value = work + p.value_means_at + block_row * fp.dv;
    pool_block(k, cu_k, fp.dense_len_k, fp.k_batch, kv * fp.k_head, fp.k_row, p.kv_block, b, seq, fp.varlen, fp.d,
               mean_key);
    __syncthreads();  // pool_block's shared sums are reused
    pool_block(v, cu_k, fp.dense_len_k, fp.v_batch, kv * fp.v_head, fp.v_row, p.kv_block, b, seq, fp.varlen, fp.dv,
               mean_value);
    __syncthreads();  // the means are in global memory, written by other threads of this CTA
    const int len_k = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
    if (b * p.kv_block >= len_k) return;  // no such block in this sequence: pool_block wrote nothing
    elem_t* key_row = pooled + block_row * 2 * fp.d;
    for (int c = threadIdx.x; c < fp.d; c += POOL_THREADS) {
        const double x = mean_key[c];
        const elem_t hi = to_elem_rn(x);
        key_row[c] = hi;
        key_row[fp.d + c] = to_elem_rn(x - (double)to_f32(hi));  // x − hi is exact in f64
    }
    elem_t* value_row = pooled + p.pooled_values_at + block_row * fp.dv;
    for (int c = threadIdx.x; c < fp.dv; c += POOL_THREADS) value_row[c] = to_elem_rn(mean_value[c]);
}

extern "C" __global__ void __launch_bounds__(HBAR_THREADS)
pisa_tail_hbar(const elem_t* __restrict__ k, const elem_t* __restrict__ v, double* __restrict__ work,
               elem_t* __restrict__ pooled, const int* __restrict__ cu_k, const PisaTailParams p) {
    const FlashParams& fp = p.flash;
    const int kv = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv;
    const int col_tiles = (dv + HBAR_TILE - 1) / HBAR_TILE;
    const int split = blockIdx.x % p.hbar_splits, tile = blockIdx.x / p.hbar_splits;
    const int c0 = (tile / col_tiles) * HBAR_TILE, e0 = (tile % col_tiles) * HBAR_TILE;
    const int len_k = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
    // The CTA's keys [j_begin, j_end): whole blocks, HBAR_SPLIT_KEYS being a multiple of kv_block.
    const int j_begin = split * HBAR_SPLIT_KEYS, j_end = min(len_k, j_begin + HBAR_SPLIT_KEYS);
    if (j_begin >= len_k) return;  // pisa_tail_hbar_sum adds only the ranges that hold keys
    // HBAR_STAGES stages of HBAR_KEYS keys: the tile's key columns [c0, c0 + 64) and value columns [e0, e0 + 64).
    __shared__ __align__(16) elem_t k_s[HBAR_STAGES][HBAR_KEYS * HBAR_STRIDE];
    __shared__ __align__(16) elem_t v_s[HBAR_STAGES][HBAR_KEYS * HBAR_STRIDE];
    const long long k_base = fp.varlen ? (long long)cu_k[seq] * fp.k_row : seq * fp.k_batch;
    const long long v_base = fp.varlen ? (long long)cu_k[seq] * fp.v_row : seq * fp.v_batch;
    const elem_t* k_g = k + k_base + kv * fp.k_head + (long long)j_begin * fp.k_row + c0;
    const elem_t* v_g = v + v_base + kv * fp.v_head + (long long)j_begin * fp.v_row + e0;
    const int k_cols = min(HBAR_TILE, d - c0), v_cols = min(HBAR_TILE, dv - e0), keys = j_end - j_begin;
    const int n_stages = (keys + HBAR_KEYS - 1) / HBAR_KEYS;
    auto load_stage = [&](int stage) {
        const int j0 = stage * HBAR_KEYS, rows = min(HBAR_KEYS, keys - j0), slot = stage % HBAR_STAGES;
        load_tile_async<HBAR_KEYS, HBAR_TILE, HBAR_STRIDE, HBAR_THREADS>(k_s[slot], k_g + (long long)j0 * fp.k_row,
                                                                        fp.k_row, rows, k_cols);
        load_tile_async<HBAR_KEYS, HBAR_TILE, HBAR_STRIDE, HBAR_THREADS>(v_s[slot], v_g + (long long)j0 * fp.v_row,
                                                                        fp.v_row, rows, v_cols);
    };
#pragma unroll
    for (int s = 0; s < HBAR_STAGES - 1; ++s) {
        if (s < n_stages) load_stage(s);
        cp_async_commit();  // an empty group past the last stage keeps the wait counts uniform
    }
    // Warp w owns rows [16w, 16w + 16) of the tile (key columns) and its 64 value columns: the m16n8 accumulator
    // layout, rows g and g + 8, columns n·8 + 2·tig and + 1. Each stage of HBAR_KEYS keys is summed per n tile in f32
    // from zero (two MMAs of 16 keys) and added in f64: the f32 part of a sum never holds more than 32 exact products.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
    double sum[HBAR_TILE / 8][4];
#pragma unroll
    for (int n = 0; n < HBAR_TILE / 8; ++n) sum[n][0] = sum[n][1] = sum[n][2] = sum[n][3] = 0.0;
    // Kᵀ as the A operand: the stage holds K row-major by key, so A's 8×8 matrices are read transposed, at the lane
    // addresses of a non-transposed B operand (rows k, columns m: the same four matrices in the same order).
    const unsigned a_lane = smem_u32(&k_s[0][0]) + (lane_b(lane, HBAR_STRIDE) + 16 * warp) * ESZ;
    const unsigned b_lane = smem_u32(&v_s[0][0]) + lane_b_trans(lane, HBAR_STRIDE) * ESZ;
    const unsigned slot_bytes = HBAR_KEYS * HBAR_STRIDE * ESZ;
    for (int stage = 0; stage < n_stages; ++stage) {
        cp_async_wait_group<HBAR_STAGES - 2>();
        __syncthreads();  // this stage landed; every warp is done with the slot the next load overwrites
        if (stage + HBAR_STAGES - 1 < n_stages) load_stage(stage + HBAR_STAGES - 1);
        cp_async_commit();
        const unsigned slot = (unsigned)(stage % HBAR_STAGES) * slot_bytes;
        unsigned af[HBAR_KEYS / 16][4];
#pragma unroll
        for (int kk = 0; kk < HBAR_KEYS / 16; ++kk) ldsm_x4_trans(af[kk], a_lane + slot + kk * 16 * HBAR_STRIDE * ESZ);
#pragma unroll
        for (int np = 0; np < HBAR_TILE / 16; ++np) {
            // The stage's HBAR_KEYS keys in f32 from zero (one MMA per k step of 16), then added in f64: one
            // conversion per HBAR_KEYS products, which the f64 pipe's conversion rate makes the bound on this loop.
            float lo[4] = {0.f, 0.f, 0.f, 0.f}, hi[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kk = 0; kk < HBAR_KEYS / 16; ++kk) {
                unsigned bf[4];
                ldsm_x4_trans(bf, b_lane + slot + (kk * 16 * HBAR_STRIDE + np * 16) * ESZ);
                mma_16816(lo, af[kk], bf[0], bf[1]);
                mma_16816(hi, af[kk], bf[2], bf[3]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                sum[2 * np][i] += (double)lo[i];
                sum[2 * np + 1][i] += (double)hi[i];
            }
        }
    }
    // The range's part of Σ_j (k_j − μ_b) v_jᵀ = Σ_j k_j v_jᵀ − Σ_b n_b μ_b v̄_bᵀ: the centring term over the range's
    // blocks from the f64 means pisa_tail_means wrote, in ascending order, into the range's partial sum.
    const int b_begin = j_begin / p.kv_block, b_end = (j_end + p.kv_block - 1) / p.kv_block;
    const long long head = (long long)seq * p.n_heads_kv + kv;
    const double* mean_keys = work + head * p.n_key_blocks * d;
    const double* mean_values = work + p.value_means_at + head * p.n_key_blocks * dv;
    const long long heads = (long long)gridDim.z * p.n_heads_kv;
    double* partial = work + p.hbar_partials_at + (split * heads + head) * d * dv;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int c = c0 + 16 * warp + g + 8 * r;
        if (c >= d) continue;
#pragma unroll
        for (int n = 0; n < HBAR_TILE / 8; ++n) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int e = e0 + 8 * n + 2 * tig + i;
                if (e >= dv) continue;
                double centre = 0.0;
                for (int b = b_begin; b < b_end; ++b) {
                    const int count = min(p.kv_block, len_k - b * p.kv_block);
                    centre = fma((double)count * mean_keys[(long long)b * d + c], mean_values[(long long)b * dv + e],
                                 centre);
                }
                partial[(long long)c * dv + e] = sum[n][2 * r + i] - centre;
            }
        }
    }
}

// H̄ = (1/n_b) Σ_ranges partial, the ranges in ascending order, into the f64 workspace and split like μ: one thread per
// element of [d, dv] (grid (elements / HBAR_SUM_THREADS, KV head, sequence)).
extern "C" __global__ void __launch_bounds__(HBAR_SUM_THREADS)
pisa_tail_hbar_sum(const elem_t* __restrict__ k, const elem_t* __restrict__ v, double* __restrict__ work,
                   elem_t* __restrict__ pooled, const int* __restrict__ cu_k, const PisaTailParams p) {
    const FlashParams& fp = p.flash;
    const int kv = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv;
    const long long at = (long long)blockIdx.x * HBAR_SUM_THREADS + threadIdx.x;
    const int len_k = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
    if (at >= (long long)d * dv || len_k == 0) return;
    const int n_blocks = (len_k + p.kv_block - 1) / p.kv_block;
    const int ranges = (len_k + HBAR_SPLIT_KEYS - 1) / HBAR_SPLIT_KEYS;
    const long long head = (long long)seq * p.n_heads_kv + kv, heads = (long long)gridDim.z * p.n_heads_kv;
    double total = 0.0;
    for (int r = 0; r < ranges; ++r) total += work[p.hbar_partials_at + (r * heads + head) * d * dv + at];
    const double x = total / n_blocks;
    const elem_t hi = to_elem_rn(x);
    const int c = (int)(at / dv), e = (int)(at % dv);
    elem_t* split = pooled + p.pooled_hbar_at + head * 2 * d * dv;  // [H̄_hi ; H̄_lo], [2d, dv]
    work[p.hbar_at + head * d * dv + at] = x;
    split[(long long)c * dv + e] = hi;
    split[(long long)(d + c) * dv + e] = to_elem_rn(x - (double)to_f32(hi));  // x − hi is exact in f64
}

extern "C" __global__ void __launch_bounds__(TAIL_THREADS)
pisa_tail_merge(const elem_t* __restrict__ q, const elem_t* __restrict__ pooled, const int* __restrict__ lists,
                elem_t* __restrict__ o, float* __restrict__ lse,
                const int* __restrict__ cu_q, const int* __restrict__ cu_k, const PisaTailParams p) {
    const FlashParams& fp = p.flash;
    const int h = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv;
    const int kv = h / fp.group;
    const int len_q = fp.varlen ? cu_q[seq + 1] - cu_q[seq] : fp.dense_len_q;
    const int len_k = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
    // Highest row tiles first: under the causal mask they have the longest tails.
    const int row0 = (gridDim.x - 1 - blockIdx.x) * TAIL_M;
    if (row0 >= len_q) return;
    const int rows_here = min(TAIL_M, len_q - row0);
    const int a = row0 / p.q_block;  // every row of the CTA is in query block a (TAIL_M divides q_block)
    // The tail's blocks are whole blocks: the partial last block is always exact. Rows see more whole blocks the
    // later they are, so the CTA's last row bounds every row's tail.
    const int whole_blocks = len_k / p.kv_block;
    const int tail_end = min(tail_whole_blocks(p, row0 + rows_here - 1, len_q, len_k), whole_blocks);
    if (tail_end == 0) return;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_s = reinterpret_cast<elem_t*>(smem_raw);  // [TAIL_M][TAIL_Q_STRIDE]: q, read as [q | q]
    elem_t* k_s = q_s + TAIL_M * TAIL_Q_STRIDE;         // [TAIL_N][TAIL_QK_STRIDE]: μ_hi | μ_lo
    elem_t* v_s = k_s + TAIL_N * TAIL_QK_STRIDE;        // [TAIL_N][TAIL_V_STRIDE]: v̄ (then with k_s, H̄'s chunks)
    unsigned char* listed = reinterpret_cast<unsigned char*>(v_s + TAIL_N * TAIL_V_STRIDE);  // [n_key_blocks]

    const long long q_base = fp.varlen ? (long long)cu_q[seq] * fp.q_row : seq * fp.q_batch;
    const long long o_base = fp.varlen ? (long long)cu_q[seq] * fp.o_row : seq * fp.o_batch;
    const long long lse_base = fp.varlen ? (long long)cu_q[seq] + h * fp.lse_head : seq * fp.lse_batch + h * fp.lse_head;
    const long long block_rows = ((long long)seq * p.n_heads_kv + kv) * p.n_key_blocks;
    const elem_t* q_g = q + q_base + h * fp.q_head + (long long)row0 * fp.q_row;
    const elem_t* keys_g = pooled + block_rows * 2 * d;
    const elem_t* values_g = pooled + p.pooled_values_at + block_rows * dv;
    const elem_t* hbar_g = pooled + p.pooled_hbar_at + ((long long)seq * p.n_heads_kv + kv) * 2 * d * dv;

    for (int b = threadIdx.x; b < p.n_key_blocks; b += TAIL_THREADS) listed[b] = 0;
    __syncthreads();
    const int list_head = p.lists_per_kv_head ? kv : h;
    const int n_list_heads = p.lists_per_kv_head ? p.n_heads_kv : p.n_heads_kv * fp.group;
    const int* list = lists + (((long long)seq * n_list_heads + list_head) * p.n_query_blocks + a) * p.list_width;
    for (int w = threadIdx.x; w < p.list_width; w += TAIL_THREADS) {
        const int b = list[w];
        if (b >= 0 && b < p.n_key_blocks) listed[b] = 1;
    }
    load_tile_async<TAIL_M, HEAD_DIM_PAD, TAIL_Q_STRIDE, TAIL_THREADS>(q_s, q_g, fp.q_row, rows_here, d);
    load_tile_async<TAIL_N, HEAD_DIM_PAD, TAIL_QK_STRIDE, TAIL_THREADS>(k_s, keys_g, 2 * d, min(TAIL_N, tail_end), d);
    load_tile_async<TAIL_N, HEAD_DIM_PAD, TAIL_QK_STRIDE, TAIL_THREADS>(k_s + HEAD_DIM_PAD, keys_g + d, 2 * d,
                                                                       min(TAIL_N, tail_end), d);
    cp_async_commit();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    const int wrow = warp * 16;
    // Each of the thread's two rows (g and g + 8 of the warp's slice): the tail blocks it may see.
    int whole_r[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + wrow + g + 8 * r;
        whole_r[r] = row < len_q ? min(tail_whole_blocks(p, row, len_q, len_k), whole_blocks) : 0;
    }
    float m_run[1][2] = {{NEG_INF, NEG_INF}}, ml_run[1][2] = {{0.f, 0.f}}, l_part[1][2] = {{0.f, 0.f}};
    float acc[1][TAIL_TILES_O][4];
#pragma unroll
    for (int n = 0; n < TAIL_TILES_O; ++n) acc[0][n][0] = acc[0][n][1] = acc[0][n][2] = acc[0][n][3] = 0.f;
    const unsigned q_lane = smem_u32(q_s + wrow * TAIL_Q_STRIDE + lane_a(lane, TAIL_Q_STRIDE));
    const unsigned k_lane = smem_u32(k_s + lane_b(lane, TAIL_QK_STRIDE));
    const unsigned v_lane = smem_u32(v_s + lane_b_trans(lane, TAIL_V_STRIDE));

    const int n_tiles = (tail_end + TAIL_N - 1) / TAIL_N;
    for (int t = 0; t < n_tiles; ++t) {
        const int key0 = t * TAIL_N;
        const int keys_here = min(TAIL_N, tail_end - key0);
        cp_async_wait_all();
        __syncthreads();  // the tile's pooled keys (and Q, the flags) landed; every warp is done with the last v̄
        load_tile_async<TAIL_N, HEAD_DIM_V_PAD, TAIL_V_STRIDE, TAIL_THREADS>(v_s, values_g + (long long)key0 * dv, dv,
                                                                             keys_here, dv);
        cp_async_commit();
        float s[1][TAIL_TILES_S][4];
#pragma unroll
        for (int n = 0; n < TAIL_TILES_S; ++n) s[0][n][0] = s[0][n][1] = s[0][n][2] = s[0][n][3] = 0.f;
        warp_mma_nt<TAIL_QK / 16, TAIL_TILES_S / 2, TAIL_QK_STRIDE, HEAD_DIM_PAD / 16>(s[0], q_lane, k_lane);
        // Scale, then mask to the row's tail: scaled first, as the forward does, so that a negative scale cannot
        // turn a masked −∞ into +∞. softmax_scores then takes the scaled scores with a scale of 1 (exact).
#pragma unroll
        for (int n = 0; n < TAIL_TILES_S; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int b = key0 + n * 8 + tig * 2 + (e % 2);
                const bool tail = b < whole_r[e / 2] && !listed[b];
                s[0][n][e] = tail ? __fmul_rn(s[0][n][e], fp.scale) : NEG_INF;
            }
        }
        float rescale[1][2];
        softmax_scores<false>(s, m_run, ml_run, l_part, rescale, 1.f, key0, len_k, EverySlot{}, 0, 0, 0, tig);
        rescale_accumulators(acc, rescale);
        cp_async_wait_all();
        __syncthreads();  // v̄ landed; every warp is done with the pooled keys
        if (t + 1 < n_tiles) {
            const int key1 = key0 + TAIL_N;
            const int next = min(TAIL_N, tail_end - key1);
            load_tile_async<TAIL_N, HEAD_DIM_PAD, TAIL_QK_STRIDE, TAIL_THREADS>(
                k_s, keys_g + (long long)key1 * 2 * d, 2 * d, next, d);
            load_tile_async<TAIL_N, HEAD_DIM_PAD, TAIL_QK_STRIDE, TAIL_THREADS>(
                k_s + HEAD_DIM_PAD, keys_g + (long long)key1 * 2 * d + d, 2 * d, next, d);
            cp_async_commit();
        }
        warp_mma_pv<TAIL_TILES_S, TAIL_TILES_O, TAIL_V_STRIDE>(acc[0], s[0], v_lane);
    }
    __syncthreads();  // every warp is done with the pooled keys and v̄: k_s and v_s take H̄'s chunks
    const unsigned h_lane = smem_u32(k_s + lane_b_trans(lane, TAIL_H_STRIDE));

    // The shared term h = [q | q]·[H̄_hi ; H̄_lo] for TAIL_HALF_TILES column tiles at a time, then the merge of those
    // columns. Rows are (g, g + 8) of the warp's slice; columns n·8 + 2·tig and + 1.
    float l[2], lse_out[2];
    double w_exact[2], w_tail[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] = quad_sum(l_part[0][r]);
        const int row = wrow + g + 8 * r;
        w_exact[r] = 1.0;
        w_tail[r] = 0.0;
        lse_out[r] = 0.f;
        if (row < rows_here && l[r] > 0.f) {
            // The forward's LSE of the tail's pooled attention (m + ln ℓ in f32), then its log-mass with |B_b| = C.
            const double lse_tail = (double)__fadd_rn(m_run[0][r], logf(l[r])) + log((double)p.kv_block);
            const double lse_exact = (double)lse[lse_base + row0 + row];
            const double top = fmax(lse_exact, lse_tail);
            const double we = exp(lse_exact - top), wt = exp(lse_tail - top);  // we = 0 when the exact part is empty
            const double denominator = we + wt;
            w_exact[r] = we / denominator;
            w_tail[r] = wt / denominator;
            lse_out[r] = (float)(top + log(denominator));
        }
    }
#pragma unroll
    for (int half = 0; half < TAIL_HALVES; ++half) {
        const int col0 = half * TAIL_HALF_TILES * 8;
        float acc_h[TAIL_HALF_TILES][4];
#pragma unroll
        for (int n = 0; n < TAIL_HALF_TILES; ++n) acc_h[n][0] = acc_h[n][1] = acc_h[n][2] = acc_h[n][3] = 0.f;
        for (int k0 = 0; k0 < TAIL_QK; k0 += TAIL_H_ROWS) {
            // Rows k0 .. k0 + TAIL_H_ROWS − 1 of [H̄_hi ; H̄_lo] padded to [HEAD_DIM_PAD ; HEAD_DIM_PAD] rows, the
            // half's columns; zero outside [d] × [dv] (dv is a multiple of 8: a 16-byte chunk is valid whole or not at
            // all). At d = dv = 128 a half's 256 rows are one chunk: one round trip to memory per half.
            for (int idx = threadIdx.x; idx < TAIL_H_ROWS * TAIL_HALF_TILES; idx += TAIL_THREADS) {
                const int rr = idx / TAIL_HALF_TILES, cc = (idx % TAIL_HALF_TILES) * 8, kr = k0 + rr;
                const int c = kr < HEAD_DIM_PAD ? kr : kr - HEAD_DIM_PAD;
                const int source = kr < HEAD_DIM_PAD ? c : d + c;
                const bool valid = kr < TAIL_QK && c < d && col0 + cc < dv;
                cp_async_16(k_s + rr * TAIL_H_STRIDE + cc, hbar_g + (valid ? (long long)source * dv + col0 + cc : 0),
                            valid);
            }
            cp_async_commit();
            cp_async_wait_all();
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < TAIL_H_ROWS / 16; ++kk) {
                // The last chunk may end past [q | q]'s 2·HEAD_DIM_PAD columns: its rows there are zero, and the
                // row's padding must not be read as a factor (0 · NaN = NaN).
                if (k0 + kk * 16 >= TAIL_QK) break;
                unsigned af[4];
                ldsm_x4(af, q_lane + ((k0 + kk * 16) % HEAD_DIM_PAD) * ESZ);  // column k0 + 16kk of [q | q]
#pragma unroll
                for (int np = 0; np < TAIL_HALF_TILES / 2; ++np) {
                    unsigned bf[4];
                    ldsm_x4_trans(bf, h_lane + (kk * 16 * TAIL_H_STRIDE + np * 16) * ESZ);
                    mma_16816(acc_h[2 * np], af, bf[0], bf[1]);
                    mma_16816(acc_h[2 * np + 1], af, bf[2], bf[3]);
                }
            }
            __syncthreads();  // the next chunk overwrites the buffer
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = wrow + g + 8 * r;
            if (row >= rows_here || !(l[r] > 0.f)) continue;  // no tail: O is the exact part's, untouched
            elem_t* o_g = o + o_base + h * fp.o_head + (long long)(row0 + row) * fp.o_row;
#pragma unroll
            for (int n = 0; n < TAIL_HALF_TILES; ++n) {
                const int c = col0 + n * 8 + tig * 2;
                if (c >= dv) continue;
                elem_t out[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    // T = O_T + α h / C, O_T as the forward would finalize it (A / ℓ in f32).
                    const double o_tail = (double)__fdiv_rn(acc[0][half * TAIL_HALF_TILES + n][2 * r + e], l[r]);
                    const double tail = o_tail + p.scale * (double)acc_h[n][2 * r + e] / p.kv_block;
                    const double exact = (double)to_f32(o_g[c + e]);
                    out[e] = to_elem_rn(w_exact[r] * exact + w_tail[r] * tail);
                }
                *reinterpret_cast<unsigned*>(o_g + c) = pack_elems(out[0], out[1]);
            }
        }
    }
    if (tig == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = wrow + g + 8 * r;
            if (row < rows_here && l[r] > 0.f) lse[lse_base + row0 + row] = lse_out[r];
        }
    }
}
