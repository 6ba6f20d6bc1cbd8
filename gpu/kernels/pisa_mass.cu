// E30's exact block masses per query block, for the selection diagnostics (Recall@K, the attention-mass ratio),
// compiled by NVRTC (see gpu/src/compile.rs) after common.cuh and bsa_select.cu (sequence_lengths). The host wrapper
// is gpu/src/pisa/diagnostics.rs, which states the convention and the rounding-error bound; the oracle is
// attnproof_oracle::pyramid::diagnostics, one query at a time.
//
//   pisa_block_mass  one CTA per (query block, KV head, sequence): for every row r of the block that sees a key and
//                    every query head h of the KV head's group, the dense softmax P_rh over the row's visible keys
//                    (bottom-right causal, or every key of the sequence), summed per leaf of kv_block keys:
//                        mass_b = (1 / (R · G)) Σ_{r, h} Σ_{j ∈ b, j visible to r} P_rh,j,
//                    R the rows that see a key and G the group. Written to masses [B, Hkv, n_q, n_leaves] f64, every
//                    entry of the CTA's row (zeros past the sequence's leaves, for a block that sees no key, and for
//                    query blocks past the sequence's own).
//
// Arithmetic: inputs widened exactly to f32 in shared memory, then f64 throughout. A thread owns one (row, head) pair
// of a chunk of MASS_THREADS pairs (pair p = r · G + h). Per pair, pass 1 takes the running maximum m and the sum
// l = Σ_j e^{x_j − m} over the visible keys in ascending order (x_j = fl(α · dot), the dot a chain of fused
// multiply-adds over the columns in ascending order); pass 2 adds e^{x_j − m} / l over each tile's keys in ascending
// order, the tile sums of the chunk's pairs by the xor-shuffle tree and then warp by warp in ascending order, and the
// chunk totals into the leaf's entry in chunk order; the entries are divided by R · G last. Every order is fixed, so a
// run is bitwise reproducible. A tile of MASS_KEYS keys never spans two leaves (kv_block is 64 or 128).

#define MASS_THREADS 128
#define MASS_WARPS (MASS_THREADS / 32)
#define MASS_KEYS 32

// The keys row `r` of a block (offset `row0` in a sequence of len_q queries and len_k keys) sees: [0, end).
__device__ __forceinline__ int mass_row_end(int causal, int row, int len_q, int len_k) {
    if (!causal) return len_k;
    return max(0, min(len_k, row + 1 + len_k - len_q));
}

// The pair's score x = fl(α · dot) against one key row of the shared tile (the pair's column q_col[c · q_stride]).
__device__ __forceinline__ double mass_score(const float* q_col, int q_stride, const float* key, int d, double scale) {
    double dot = 0.0;
    for (int c = 0; c < d; ++c) dot = fma((double)q_col[c * q_stride], (double)key[c], dot);
    return dot * scale;
}

// Keys tile .. tile + MASS_KEYS of one head (`k_head` at its row 0, rows `k_row` apart) into the shared tile as f32,
// zeros past the sequence's len_k keys. Every thread of the CTA takes part.
__device__ __forceinline__ void mass_load_keys(float* k_tile, const elem_t* __restrict__ k_head, long long k_row,
                                               int tile, int len_k, int d) {
    for (int i = threadIdx.x; i < MASS_KEYS * d; i += MASS_THREADS) {
        const int j = tile + i / d;
        k_tile[i] = j < len_k ? to_f32(k_head[(long long)j * k_row + i % d]) : 0.0f;
    }
}

extern "C" __global__ void __launch_bounds__(MASS_THREADS)
pisa_block_mass(const elem_t* __restrict__ q, const elem_t* __restrict__ k, double* __restrict__ masses,
                const int* __restrict__ cu_q, const int* __restrict__ cu_k, const BsaParams params) {
    const FlashParams& fp = params.flash;
    const int a = blockIdx.x, kv = blockIdx.y, seq = blockIdx.z;
    const int group = fp.group, d = fp.d;
    const int q_stride = MASS_THREADS + 1;  // padded: a column's 128 pairs, conflict-free to write and to read
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* q_cols = reinterpret_cast<float*>(smem_raw);  // [d][MASS_THREADS + 1]: the chunk's queries, by column
    float* k_tile = q_cols + d * q_stride;                // [MASS_KEYS][d]
    __shared__ double warp_sums[MASS_WARPS];

    double* out = masses + (((long long)seq * params.n_heads_kv + kv) * gridDim.x + a) * params.n_key_blocks;
    for (int i = threadIdx.x; i < params.n_key_blocks; i += MASS_THREADS) out[i] = 0.0;
    int len_q, len_k;
    sequence_lengths(fp, cu_q, cu_k, seq, len_q, len_k);
    const int row0 = a * params.q_block;
    if (row0 >= len_q || len_k == 0) return;
    const int rows = min(params.q_block, len_q - row0);
    const int last_end = mass_row_end(params.causal, row0 + rows - 1, len_q, len_k);
    if (last_end == 0) return;  // no row of the block sees a key: all zeros
    // Rows that see a key: all but a prefix of the block under the causal mask when len_q > len_k.
    int first_seeing = 0;
    while (first_seeing < rows && mass_row_end(params.causal, row0 + first_seeing, len_q, len_k) == 0) ++first_seeing;
    const double counted = (double)(rows - first_seeing) * group;

    const long long q_base = fp.varlen ? (long long)cu_q[seq] * fp.q_row : seq * fp.q_batch;
    const long long k_base = (fp.varlen ? (long long)cu_k[seq] * fp.k_row : seq * fp.k_batch) + kv * fp.k_head;
    const int pairs = rows * group;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int chunk = 0; chunk < pairs; chunk += MASS_THREADS) {
        const int p = chunk + threadIdx.x;
        const int end = p < pairs ? mass_row_end(params.causal, row0 + p / group, len_q, len_k) : 0;
        __syncthreads();  // the previous chunk's readers of q_cols are done
        for (int i = threadIdx.x; i < MASS_THREADS * d; i += MASS_THREADS) {
            const int t = i / d, c = i % d, pp = chunk + t;
            float x = 0.0f;
            if (pp < pairs) {
                const int r = row0 + pp / group, h = kv * group + pp % group;
                x = to_f32(q[q_base + h * fp.q_head + (long long)r * fp.q_row + c]);
            }
            q_cols[c * q_stride + t] = x;
        }
        const float* q_col = q_cols + threadIdx.x;
        // Pass 1: the maximum and the sum of exponentials relative to it, online.
        double m = (double)NEG_INF, l = 0.0;
        for (int tile = 0; tile < last_end; tile += MASS_KEYS) {
            __syncthreads();
            mass_load_keys(k_tile, k + k_base, fp.k_row, tile, len_k, d);
            __syncthreads();
            for (int j = 0; j < MASS_KEYS && tile + j < end; ++j) {
                const double x = mass_score(q_col, q_stride, k_tile + j * d, d, params.scale);
                if (x > m) {
                    l = l * exp(m - x) + 1.0;
                    m = x;
                } else {
                    l += exp(x - m);
                }
            }
        }
        // Pass 2: each tile's probabilities, summed over the chunk's pairs into the tile's leaf.
        for (int tile = 0; tile < last_end; tile += MASS_KEYS) {
            __syncthreads();
            mass_load_keys(k_tile, k + k_base, fp.k_row, tile, len_k, d);
            __syncthreads();
            double part = 0.0;
            for (int j = 0; j < MASS_KEYS && tile + j < end; ++j) {
                part += exp(mass_score(q_col, q_stride, k_tile + j * d, d, params.scale) - m) / l;
            }
#pragma unroll
            for (int offset = 16; offset > 0; offset /= 2) part += __shfl_xor_sync(0xffffffffu, part, offset);
            if (lane == 0) warp_sums[warp] = part;
            __syncthreads();
            if (threadIdx.x == 0) {
                double total = 0.0;
                for (int w = 0; w < MASS_WARPS; ++w) total += warp_sums[w];
                out[tile / params.kv_block] += total;
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < params.n_key_blocks; i += MASS_THREADS) out[i] /= counted;
}
