// HiLS's chunk summaries and router (E21) on the GPU, compiled by NVRTC (see gpu/src/compile.rs) after common.cuh and
// bsa_select.cu, whose warp top-k (stream_offer, better) the router reuses. The host wrapper is gpu/src/hils.rs; the
// reference is the oracle's hils module (summarize_chunks, router_scores, route), the verifier
// attnproof_harness::hils_routing.
//
// Conventions (the oracle's, for each query head of each sequence of n tokens, causal self-attention): chunk b holds
// keys [b·C, min((b+1)·C, n)) and has one landmark query q'_b; the local window of query i starts at
// start_i = C·⌊max(0, i + 1 − w)/C⌋; query i may retrieve the chunks b < start_i / C (whole, in its past).
//
// Two kernels, all arithmetic in f64 from the inputs' exact values:
//   hils_summaries  one CTA per (chunk, query head, sequence): the landmark's scores s_j = α q'_b·k_j over the chunk's
//                   keys (one fma chain over the columns, ascending), p_j = e^{s_j − m} / Σ e^{s − m}, the slope key
//                   k'_b = Σ_j p_j k_j (keys ascending) and the entropy H(p_b) = −Σ_j p_j ln p_j (p_j = 0 adds 0),
//                   into the workspace's [B, Hq, n_chunks, d + 1] (slope key, then entropy).
//   hils_route      one warp per (query, query head, sequence), HILS_ROUTE_WARPS per CTA: r_ib = α q_i·k'_b + H(p_b)
//                   over the eligible chunks, 32 chunks at a time (one per lane), the best min(K, eligible) kept in
//                   the warp's registers by stream_offer (larger score, then lower chunk), written ascending and
//                   −1-padded into [B, Hq, max_len, K]; with write_scores, every eligible score into
//                   [B, Hq, max_len, n_chunks] (the verifier ranks them itself).
// Sums run in a fixed order (block reductions over fixed thread partials), so both outputs are bitwise reproducible.

#define HILS_THREADS 128
#define HILS_MAX_CHUNK 1024   // keys per chunk: the landmark's scores live in shared memory
#define HILS_ROUTE_WARPS 4

// The CTA-wide sum (or max) of one value per thread, in a fixed order: warp trees, then the warps' results in order.
template <bool MAX>
__device__ __forceinline__ double block_reduce(double x, double* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const double y = __shfl_xor_sync(0xffffffffu, x, off);
        x = MAX ? fmax(x, y) : x + y;
    }
    __syncthreads();  // scratch may still be read from the previous reduction
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    double total = scratch[0];
    for (int w = 1; w < HILS_THREADS / 32; ++w) total = MAX ? fmax(total, scratch[w]) : total + scratch[w];
    return total;
}

extern "C" __global__ void __launch_bounds__(HILS_THREADS)
hils_summaries(const elem_t* __restrict__ k, const elem_t* __restrict__ landmarks, double* __restrict__ summaries,
               const int* __restrict__ cu_k, const HilsParams p) {
    const FlashParams& fp = p.flash;
    const int b = blockIdx.x, h = blockIdx.y, seq = blockIdx.z, d = fp.d;
    const int kv = h / fp.group;
    const int len = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
    const int key0 = b * p.chunk_size;
    if (key0 >= len) return;  // no such chunk in this sequence
    const int count = min(p.chunk_size, len - key0);
    __shared__ double landmark[POOL_MAX_D];
    __shared__ double scores[HILS_MAX_CHUNK];
    __shared__ double scratch[HILS_THREADS / 32];
    const long long row = ((long long)seq * gridDim.y + h) * p.n_chunks + b;
    for (int c = threadIdx.x; c < d; c += HILS_THREADS) landmark[c] = (double)to_f32(landmarks[row * d + c]);
    const long long k_base = fp.varlen ? (long long)cu_k[seq] * fp.k_row : seq * fp.k_batch;
    const elem_t* k_g = k + k_base + kv * fp.k_head + (long long)key0 * fp.k_row;
    __syncthreads();
    double top = (double)NEG_INF;
    for (int j = threadIdx.x; j < count; j += HILS_THREADS) {
        double dot = 0.0;
        for (int c = 0; c < d; ++c) dot = fma(landmark[c], (double)to_f32(k_g[(long long)j * fp.k_row + c]), dot);
        scores[j] = p.scale * dot;
        top = fmax(top, scores[j]);
    }
    top = block_reduce<true>(top, scratch);
    double mass = 0.0;
    for (int j = threadIdx.x; j < count; j += HILS_THREADS) {
        scores[j] = exp(scores[j] - top);
        mass += scores[j];
    }
    mass = block_reduce<false>(mass, scratch);
    double entropy = 0.0;
    for (int j = threadIdx.x; j < count; j += HILS_THREADS) {
        const double pj = scores[j] / mass;
        scores[j] = pj;
        if (pj > 0.0) entropy -= pj * log(pj);
    }
    entropy = block_reduce<false>(entropy, scratch);  // its barriers also publish the probabilities
    double* out = summaries + row * (d + 1);
    for (int c = threadIdx.x; c < d; c += HILS_THREADS) {
        double slope = 0.0;
        for (int j = 0; j < count; ++j) slope = fma(scores[j], (double)to_f32(k_g[(long long)j * fp.k_row + c]), slope);
        out[c] = slope;
    }
    if (threadIdx.x == 0) out[d] = entropy;
}

extern "C" __global__ void __launch_bounds__(HILS_ROUTE_WARPS * 32)
hils_route(const elem_t* __restrict__ q, const double* __restrict__ summaries, int* __restrict__ lists,
           double* __restrict__ router_scores, const int* __restrict__ cu_q, const HilsParams p) {
    const FlashParams& fp = p.flash;
    const int h = blockIdx.y, seq = blockIdx.z, d = fp.d;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int i = blockIdx.x * HILS_ROUTE_WARPS + warp;
    const int len = fp.varlen ? cu_q[seq + 1] - cu_q[seq] : fp.dense_len_q;
    __shared__ double query[HILS_ROUTE_WARPS][POOL_MAX_D];
    const long long head_row = ((long long)seq * gridDim.y + h);
    int* list = lists + (head_row * p.max_len + i) * p.top_k;
    if (i >= len) {
        // Past this sequence's queries (a shorter varlen sequence): a padded row. The whole warp leaves together.
        if (i < p.max_len) {
            for (int w = lane; w < p.top_k; w += 32) list[w] = -1;
        }
        return;
    }
    const long long q_base = fp.varlen ? (long long)cu_q[seq] * fp.q_row : seq * fp.q_batch;
    const elem_t* q_g = q + q_base + h * fp.q_head + (long long)i * fp.q_row;
    for (int c = lane; c < d; c += 32) query[warp][c] = (double)to_f32(q_g[c]);
    __syncwarp();
    const int start = (max(0, i + 1 - p.local_window) / p.chunk_size) * p.chunk_size;
    const int eligible = start / p.chunk_size;
    const int room = min(p.top_k, eligible);
    const double* summary = summaries + head_row * p.n_chunks * (d + 1);
    double* scores_row = router_scores + (head_row * p.max_len + i) * p.n_chunks;
    double best_s = (double)NEG_INF;
    int best_i = -1, count = 0;
    for (int b0 = 0; b0 < eligible; b0 += 32) {
        const int b = b0 + lane;
        double score = (double)NEG_INF;
        if (b < eligible) {
            const double* s_b = summary + (long long)b * (d + 1);
            double dot = 0.0;
            for (int c = 0; c < d; ++c) dot = fma(query[warp][c], s_b[c], dot);
            score = p.scale * dot + s_b[d];
            if (p.write_scores) scores_row[b] = score;
        }
        stream_offer(score, b, b < eligible, room, best_s, best_i, count);
    }
    // Ascending: each kept chunk's place is the number of kept chunks below it.
    int rank = 0;
    for (int t = 0; t < count; ++t) rank += __shfl_sync(0xffffffffu, best_i, t) < best_i;
    if (lane < count && rank < p.top_k) list[rank] = best_i;
    for (int w = count + lane; w < p.top_k; w += 32) list[w] = -1;
}
