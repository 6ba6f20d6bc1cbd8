// HiLS's chunk summaries, router and factorized output (E21) on the GPU, compiled by NVRTC (see gpu/src/compile.rs) after common.cuh and
// bsa_select.cu, whose warp top-k (stream_offer, better) the router reuses. The host wrapper is gpu/src/hils.rs; the
// reference is the oracle's hils module (summarize_chunks, router_scores, route), the verifier
// attnproof_harness::hils_routing.
//
// Conventions (the oracle's, for each query head of each sequence of n tokens, causal self-attention): chunk b holds
// keys [b·C, min((b+1)·C, n)) and has one landmark query q'_b; the local window of query i starts at
// start_i = C·⌊max(0, i + 1 − w)/C⌋; query i may retrieve the chunks b < start_i / C (whole, in its past).
//
// Three kernels, all arithmetic in f64 from the inputs' exact values:
//   hils_summaries  one CTA per (chunk, query head, sequence): the landmark's scores s_j = α q'_b·k_j over the chunk's
//                   keys (one fma chain over the columns, ascending), p_j = e^{s_j − m} / Σ e^{s − m}, the slope key
//                   k'_b = Σ_j p_j k_j (keys ascending) and the entropy H(p_b) = −Σ_j p_j ln p_j (p_j = 0 adds 0),
//                   into the workspace's [B, Hq, n_chunks, d + 1] (slope key, then entropy).
//   hils_route      one warp per (query, query head, sequence), HILS_ROUTE_WARPS per CTA: r_ib = α q_i·k'_b + H(p_b)
//                   over the eligible chunks, 32 chunks at a time (one per lane), the best min(K, eligible) kept in
//                   the warp's registers by stream_offer (larger score, then lower chunk), written ascending and
//                   −1-padded into [B, Hq, max_len, K]; with write_scores, every eligible score into
//                   [B, Hq, max_len, n_chunks] (the verifier ranks them itself).
//   hils_output     one warp per (query, query head, sequence), HILS_ROUTE_WARPS per CTA: the factorized output
//                   o_i = [Σ_local e^{s_ij} v_j + Σ_{b∈R_i} Ẑ_ib ō_ib] / [Z_local + Σ_b Ẑ_ib]. The local window's keys
//                   [start_i, i] through an online softmax, 32 keys at a time (lane t scores key t, the value columns
//                   c ≡ lane mod 32 accumulate); each listed chunk b (its list row from the router, ascending, −1-padded)
//                   through its own online softmax, giving ō_ib = a/l and f_b(q_i) = m + ln l; then the chunk enters
//                   the row's state as one virtual key of value ō_ib and log-mass ln Ẑ_ib: the router score
//                   r_ib = α q_i·k'_b + H(p_b) (computed as hils_route computes it, from the summaries) or, with
//                   exact_mass, f_b(q_i). O rounded once from f64 to the storage type, the LSE m + ln l to f32.
// Sums run in a fixed order (block reductions over fixed thread partials; a warp's sums a fixed tree read from lane
// 0), so every output is bitwise reproducible.

#define HILS_THREADS 128
#define HILS_MAX_CHUNK 1024   // keys per chunk: the landmark's scores live in shared memory
#define HILS_ROUTE_WARPS 4
#define HILS_MAX_DV 256       // value columns: HILS_MAX_DV / 32 accumulators per lane

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

// An online-softmax state of one query over some keys, relative to its running maximum m: l = Σ e^{s − m} and, per lane,
// the numerator a_c = Σ e^{s − m} v_c of the value columns c = lane + 32t.
struct HilsState {
    double m, l;
    double a[HILS_MAX_DV / 32];
};

__device__ __forceinline__ void hils_state_init(HilsState& st) {
    st.m = (double)NEG_INF;
    st.l = 0.0;
#pragma unroll
    for (int t = 0; t < HILS_MAX_DV / 32; ++t) st.a[t] = 0.0;
}

// The warp's sum of one value per lane: a fixed tree (lane 0 gathers), then lane 0's total broadcast, so every lane
// holds the same bits.
__device__ __forceinline__ double warp_sum_fixed(double x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
    return __shfl_sync(0xffffffffu, x, 0);
}

// Adds keys [j0, j1) of one head (rows of k_g and v_g) to the state, 32 at a time: lane t scores key j0 + 32g + t
// (one fma chain over the columns, ascending), the group's maximum rescales the state, and the group's weights reach
// every lane by shuffles for the value columns.
__device__ __forceinline__ void hils_attend(HilsState& st, const double* query, const elem_t* k_g, long long k_row,
                                            const elem_t* v_g, long long v_row, int j0, int j1, int d, int dv,
                                            double scale, int lane) {
    for (int g = j0; g < j1; g += 32) {
        const int j = g + lane, n = min(32, j1 - g);
        double s = (double)NEG_INF;
        if (j < j1) {
            double dot = 0.0;
            for (int c = 0; c < d; ++c) dot = fma(query[c], (double)to_f32(k_g[(long long)j * k_row + c]), dot);
            s = scale * dot;
        }
        double top = s;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) top = fmax(top, __shfl_xor_sync(0xffffffffu, top, off));
        const double m_new = fmax(st.m, top);
        const double carry = exp(st.m - m_new);  // 0 for the empty state (m = −∞)
        const double w = j < j1 ? exp(s - m_new) : 0.0;
        st.l = st.l * carry + warp_sum_fixed(w);
#pragma unroll
        for (int t = 0; t < HILS_MAX_DV / 32; ++t) st.a[t] *= carry;
        for (int r = 0; r < n; ++r) {
            const double wr = __shfl_sync(0xffffffffu, w, r);
            const elem_t* v_r = v_g + (long long)(g + r) * v_row;
#pragma unroll
            for (int t = 0; t < HILS_MAX_DV / 32; ++t) {
                const int c = lane + 32 * t;
                if (c < dv) st.a[t] = fma(wr, (double)to_f32(v_r[c]), st.a[t]);
            }
        }
        st.m = m_new;
    }
}

extern "C" __global__ void __launch_bounds__(HILS_ROUTE_WARPS * 32)
hils_output(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
            const double* __restrict__ summaries, const int* __restrict__ lists, elem_t* __restrict__ o,
            float* __restrict__ lse, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
            const HilsParams p) {
    const FlashParams& fp = p.flash;
    const int h = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv;
    const int kv = h / fp.group;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int i = blockIdx.x * HILS_ROUTE_WARPS + warp;
    const int len = fp.varlen ? cu_q[seq + 1] - cu_q[seq] : fp.dense_len_q;
    if (i >= len) return;  // past this sequence's queries: the whole warp leaves together
    __shared__ double query[HILS_ROUTE_WARPS][POOL_MAX_D];
    const long long head_row = ((long long)seq * gridDim.y + h);
    const long long q_base = fp.varlen ? (long long)cu_q[seq] * fp.q_row : seq * fp.q_batch;
    const elem_t* q_g = q + q_base + h * fp.q_head + (long long)i * fp.q_row;
    for (int c = lane; c < d; c += 32) query[warp][c] = (double)to_f32(q_g[c]);
    __syncwarp();
    const long long k_base = fp.varlen ? (long long)cu_k[seq] * fp.k_row : seq * fp.k_batch;
    const long long v_base = fp.varlen ? (long long)cu_k[seq] * fp.v_row : seq * fp.v_batch;
    const elem_t* k_g = k + k_base + kv * fp.k_head;
    const elem_t* v_g = v + v_base + kv * fp.v_head;
    HilsState row;
    hils_state_init(row);
    const int start = (max(0, i + 1 - p.local_window) / p.chunk_size) * p.chunk_size;
    hils_attend(row, query[warp], k_g, fp.k_row, v_g, fp.v_row, start, i + 1, d, dv, p.scale, lane);
    const int* list = lists + (head_row * p.max_len + i) * p.top_k;
    const double* summary = summaries + head_row * p.n_chunks * (d + 1);
    for (int slot = 0; slot < p.top_k; ++slot) {
        const int b = list[slot];
        if (b < 0) break;  // the −1 padding
        HilsState chunk;
        hils_state_init(chunk);
        const int key0 = b * p.chunk_size;
        hils_attend(chunk, query[warp], k_g, fp.k_row, v_g, fp.v_row, key0, key0 + p.chunk_size, d, dv, p.scale, lane);
        double log_mass;
        if (p.exact_mass) {
            log_mass = chunk.m + log(chunk.l);
        } else {
            const double* s_b = summary + (long long)b * (d + 1);
            double dot = 0.0;
            for (int c = 0; c < d; ++c) dot = fma(query[warp][c], s_b[c], dot);
            log_mass = p.scale * dot + s_b[d];
        }
        // The chunk as one key of value ō_ib and weight e^{log_mass}.
        const double m_new = fmax(row.m, log_mass);
        const double keep = exp(row.m - m_new), enter = exp(log_mass - m_new);
        row.l = row.l * keep + enter;
#pragma unroll
        for (int t = 0; t < HILS_MAX_DV / 32; ++t) row.a[t] = row.a[t] * keep + (chunk.a[t] / chunk.l) * enter;
        row.m = m_new;
    }
    const long long o_base = fp.varlen ? (long long)cu_q[seq] * fp.o_row : seq * fp.o_batch;
    elem_t* o_g = o + o_base + h * fp.o_head + (long long)i * fp.o_row;
#pragma unroll
    for (int t = 0; t < HILS_MAX_DV / 32; ++t) {
        const int c = lane + 32 * t;
        if (c < dv) o_g[c] = to_elem_rn(row.a[t] / row.l);
    }
    const long long lse_base = fp.varlen ? (long long)cu_q[seq] + h * fp.lse_head : seq * fp.lse_batch + h * fp.lse_head;
    if (lane == 0) lse[lse_base + i] = (float)(row.m + log(row.l));
}
