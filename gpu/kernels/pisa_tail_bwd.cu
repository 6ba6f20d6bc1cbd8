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
//   pisa_tail_bwd_rows     a warp per (row, query head): w, through, the row's tail blocks ascending (a merge walk
//                          along the row's exact list), dq += the tail's part, rounded once to storage from the exact
//                          part's stored value plus the f64 sum; through_i and A_i into the row workspace.
//   pisa_tail_bwd_blocks   a CTA per (key block, KV head, sequence): dμ_b and dV^Σ_b over the rows of every query head
//                          of the group whose tail holds b, each warp's rows in ascending order, the warps' sums added
//                          in warp order (deterministic).
//   pisa_tail_bwd_g        a CTA per (64 × 64 tile of [d, dv], range of TAILB_G_ROWS rows, query head, sequence):
//                          the range's part of Σ_i A_i α q_i dO_iᵀ; pisa_tail_bwd_g_sum adds the ranges and the group's
//                          heads in ascending order into G.
//   pisa_tail_bwd_scatter  a CTA per TAILB_KEYS keys of a KV head: dk and dv of every key, rounded once from the exact
//                          part's stored value plus the f64 sum. A key whose tail part is exactly 0 keeps its bits.
// Every sum runs in a fixed order: the outputs are bitwise reproducible when the exact part's are.

#define TAILB_WARPS 4
#define TAILB_THREADS (TAILB_WARPS * 32)
#define TAILB_QC ((HEAD_DIM_PAD + 31) / 32)    // q / μ columns per lane: lane + 32t
#define TAILB_VC ((HEAD_DIM_V_PAD + 31) / 32)  // dO / v̄ columns per lane
#define TAILB_G_TILE 64                        // rows (q columns) and columns (dO columns) of pisa_tail_bwd_g's tile
#define TAILB_G_ROWS 4096                      // query rows per CTA of pisa_tail_bwd_g (a partial sum each)
#define TAILB_G_STAGE 32                       // rows staged in shared memory at a time
#define TAILB_KEYS 8                           // keys per CTA of pisa_tail_bwd_scatter (32 KiB of shared at 256)

__device__ __forceinline__ double warp_sum_f64(double x) {
#pragma unroll
    for (int s = 16; s > 0; s /= 2) x += __shfl_xor_sync(0xffffffffu, x, s);
    return x;
}

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

// Loads a row's columns lane + 32t of a storage-type row into f64 registers (0 past n).
template <int N>
__device__ __forceinline__ void load_row(double (&x)[N], const elem_t* row, int n, int lane) {
#pragma unroll
    for (int t = 0; t < N; ++t) {
        const int c = lane + 32 * t;
        x[t] = c < n ? (double)to_f32(row[c]) : 0.0;
    }
}

extern "C" __global__ void __launch_bounds__(TAILB_THREADS)
pisa_tail_bwd_rows(const elem_t* __restrict__ q, const elem_t* __restrict__ d_out, const int* __restrict__ lists,
                   const double* __restrict__ stats, const float* __restrict__ lse, const float* __restrict__ delta,
                   double* __restrict__ through_out, double* __restrict__ mass_out, elem_t* __restrict__ dq,
                   const int* __restrict__ cu_q, const int* __restrict__ cu_k, const PisaTailParams p) {
    const FlashParams& fp = p.flash;
    const int h = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv, kv = h / fp.group;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const TailRows r = tail_rows(fp, cu_q, cu_k, seq, h);
    const int i = blockIdx.x * TAILB_WARPS + warp;
    if (i >= r.len_q) return;
    const long long stat_row = r.lse_base + i;
    const int whole_blocks = r.len_k / p.kv_block;
    const int tail_end = min(tail_whole_blocks(p, i, r.len_q, r.len_k), whole_blocks);
    const int* list = tail_list(p, lists, seq, h, i / p.q_block);
    // Does the row have a tail block at all? Every whole block it sees below tail_end is listed, or not.
    int listed_below = 0;
    for (int w = 0; w < p.list_width; ++w) listed_below += (list[w] >= 0 && list[w] < tail_end);
    const float row_lse = lse[stat_row];
    if (tail_end == listed_below || row_lse == NEG_INF) {
        if (lane == 0) through_out[stat_row] = mass_out[stat_row] = 0.0;
        return;  // no tail: dQ is the exact part's, untouched
    }
    double qr[TAILB_QC], gr[TAILB_VC], w[TAILB_QC];
    load_row(qr, q + r.q_base + (long long)i * fp.q_row, d, lane);
    load_row(gr, d_out + r.o_base + (long long)i * fp.o_row, dv, lane);
    const long long head = (long long)seq * p.n_heads_kv + kv;
    const double* hbar = stats + p.hbar_at + head * d * dv;
    const double* means = stats + head * p.n_key_blocks * d;
    const double* value_means = stats + p.value_means_at + head * p.n_key_blocks * dv;
    // w = H̄ dO (the lane's rows of H̄), through = α q·w.
    double through = 0.0;
#pragma unroll
    for (int t = 0; t < TAILB_QC; ++t) {
        const int c = lane + 32 * t;
        double s = 0.0;
#pragma unroll
        for (int u = 0; u < TAILB_VC; ++u) {
            for (int src = 0; src < 32 && 32 * u + src < dv; ++src) {
                const double g_e = __shfl_sync(0xffffffffu, gr[u], src);  // dO_e, e = 32u + src
                if (c < d) s = fma(hbar[(long long)c * dv + 32 * u + src], g_e, s);
            }
        }
        w[t] = c < d ? s : 0.0;
        through = fma(qr[t], w[t], through);
    }
    through = p.scale * warp_sum_f64(through);
    const double row_delta = (double)delta[stat_row], count = (double)p.kv_block;
    double acc[TAILB_QC];
#pragma unroll
    for (int t = 0; t < TAILB_QC; ++t) acc[t] = 0.0;
    double mass = 0.0;
    int next = 0;  // the list's first entry not below b: the walk skips the row's listed blocks
    for (int b = 0; b < tail_end; ++b) {
        while (next < p.list_width && list[next] >= 0 && list[next] < b) ++next;
        if (next < p.list_width && list[next] == b) continue;
        double mu[TAILB_QC], score = 0.0, dp = 0.0;
#pragma unroll
        for (int t = 0; t < TAILB_QC; ++t) {
            const int c = lane + 32 * t;
            mu[t] = c < d ? means[(long long)b * d + c] : 0.0;
            score = fma(qr[t], mu[t], score);
        }
#pragma unroll
        for (int t = 0; t < TAILB_VC; ++t) {
            const int e = lane + 32 * t;
            if (e < dv) dp = fma(gr[t], value_means[(long long)b * dv + e], dp);
        }
        score = warp_sum_f64(score);
        dp = warp_sum_f64(dp);
        const double a = exp(p.scale * score - (double)row_lse);
        const double g = a * (count * (dp - row_delta) + through);
        mass += a;
#pragma unroll
        for (int t = 0; t < TAILB_QC; ++t) acc[t] = fma(p.scale * g, mu[t], acc[t]);
    }
    elem_t* dq_row = dq + r.q_base + (long long)i * fp.q_row;
#pragma unroll
    for (int t = 0; t < TAILB_QC; ++t) {
        const int c = lane + 32 * t;
        if (c >= d) continue;
        const double add = fma(mass * p.scale, w[t], acc[t]);
        if (add != 0.0) dq_row[c] = to_elem_rn((double)to_f32(dq_row[c]) + add);
    }
    if (lane == 0) {
        through_out[stat_row] = through;
        mass_out[stat_row] = mass;
    }
}

extern "C" __global__ void __launch_bounds__(TAILB_THREADS)
pisa_tail_bwd_blocks(const elem_t* __restrict__ q, const elem_t* __restrict__ d_out, const int* __restrict__ lists,
                     const double* __restrict__ stats, const float* __restrict__ lse, const float* __restrict__ delta,
                     const double* __restrict__ through_in, double* __restrict__ grads, const int* __restrict__ cu_q,
                     const int* __restrict__ cu_k, const PisaTailParams p) {
    const FlashParams& fp = p.flash;
    const int b = blockIdx.x, kv = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long head = (long long)seq * p.n_heads_kv + kv;
    double* d_means = grads + (head * p.n_key_blocks + b) * d;
    double* d_sums = grads + p.value_means_at + (head * p.n_key_blocks + b) * dv;
    const double* mu_g = stats + (head * p.n_key_blocks + b) * d;
    const double* vbar_g = stats + p.value_means_at + (head * p.n_key_blocks + b) * dv;
    double mu[TAILB_QC], vbar[TAILB_VC], dm[TAILB_QC], ds[TAILB_VC];
#pragma unroll
    for (int t = 0; t < TAILB_QC; ++t) dm[t] = 0.0;
#pragma unroll
    for (int t = 0; t < TAILB_VC; ++t) ds[t] = 0.0;
    const TailRows r0 = tail_rows(fp, cu_q, cu_k, seq, 0);
    const bool whole = (b + 1) * p.kv_block <= r0.len_k;  // only whole blocks are ever tail
    if (whole) {
#pragma unroll
        for (int t = 0; t < TAILB_QC; ++t) mu[t] = lane + 32 * t < d ? mu_g[lane + 32 * t] : 0.0;
#pragma unroll
        for (int t = 0; t < TAILB_VC; ++t) vbar[t] = lane + 32 * t < dv ? vbar_g[lane + 32 * t] : 0.0;
        const double count = (double)p.kv_block;
        for (int hg = 0; hg < fp.group; ++hg) {
            const int h = kv * fp.group + hg;
            const TailRows r = tail_rows(fp, cu_q, cu_k, seq, h);
            for (int a = 0; a * p.q_block < r.len_q; ++a) {
                const int a_end = min(r.len_q, (a + 1) * p.q_block);
                // The query block's last row sees the most: if even it does not see b whole, no row does.
                if (tail_whole_blocks(p, a_end - 1, r.len_q, r.len_k) <= b) continue;
                if (tail_listed(tail_list(p, lists, seq, h, a), p.list_width, b)) continue;
                for (int i = a * p.q_block + warp; i < a_end; i += TAILB_WARPS) {
                    if (tail_whole_blocks(p, i, r.len_q, r.len_k) <= b) continue;
                    const long long stat_row = r.lse_base + i;
                    const float row_lse = lse[stat_row];
                    if (row_lse == NEG_INF) continue;
                    double qr[TAILB_QC], gr[TAILB_VC];
                    load_row(qr, q + r.q_base + (long long)i * fp.q_row, d, lane);
                    load_row(gr, d_out + r.o_base + (long long)i * fp.o_row, dv, lane);
                    double score = 0.0, dp = 0.0;
#pragma unroll
                    for (int t = 0; t < TAILB_QC; ++t) score = fma(qr[t], mu[t], score);
#pragma unroll
                    for (int t = 0; t < TAILB_VC; ++t) dp = fma(gr[t], vbar[t], dp);
                    score = warp_sum_f64(score);
                    dp = warp_sum_f64(dp);
                    const double a_ib = exp(p.scale * score - (double)row_lse);
                    const double g = a_ib * (count * (dp - (double)delta[stat_row]) + through_in[stat_row]);
#pragma unroll
                    for (int t = 0; t < TAILB_QC; ++t) dm[t] = fma(p.scale * g, qr[t], dm[t]);
#pragma unroll
                    for (int t = 0; t < TAILB_VC; ++t) ds[t] = fma(a_ib, gr[t], ds[t]);
                }
            }
        }
    }
    // The warps' sums, added in warp order.
    __shared__ double part[TAILB_WARPS][TAILB_QC * 32 + TAILB_VC * 32];
#pragma unroll
    for (int t = 0; t < TAILB_QC; ++t) part[warp][lane + 32 * t] = dm[t];
#pragma unroll
    for (int t = 0; t < TAILB_VC; ++t) part[warp][TAILB_QC * 32 + lane + 32 * t] = ds[t];
    __syncthreads();
    if (b * p.kv_block >= r0.len_k) return;  // no such block in this sequence: nothing reads its gradients
    for (int x = threadIdx.x; x < d + dv; x += TAILB_THREADS) {
        const int slot = x < d ? x : TAILB_QC * 32 + (x - d);
        double total = 0.0;
        for (int w = 0; w < TAILB_WARPS; ++w) total += part[w][slot];
        if (x < d) {
            d_means[x] = total;
        } else {
            d_sums[x - d] = total;
        }
    }
}

extern "C" __global__ void __launch_bounds__(TAILB_THREADS)
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
    // Thread t owns row c0 + t/2 of the tile and its 32 columns e0 + 32(t % 2) + k.
    const int c_local = threadIdx.x / 2, e_local = (threadIdx.x % 2) * 32;
    double acc[32];
#pragma unroll
    for (int k = 0; k < 32; ++k) acc[k] = 0.0;
    __shared__ double qa_s[TAILB_G_STAGE][TAILB_G_TILE];  // A_i α q_ic
    __shared__ double g_s[TAILB_G_STAGE][TAILB_G_TILE];   // dO_ie
    for (int i0 = i_begin; i0 < i_end; i0 += TAILB_G_STAGE) {
        __syncthreads();  // every thread is done with the last stage
        for (int x = threadIdx.x; x < TAILB_G_STAGE * TAILB_G_TILE; x += TAILB_THREADS) {
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
            for (int k = 0; k < 32; ++k) acc[k] = fma(qa, g_s[rr][e_local + k], acc[k]);
        }
    }
    const int c = c0 + c_local;
    if (c >= d) return;
    const long long heads = (long long)gridDim.z * gridDim.y;
    double* out = partials + ((long long)split * heads + (long long)seq * gridDim.y + h) * d * dv + (long long)c * dv;
#pragma unroll
    for (int k = 0; k < 32; ++k) {
        const int e = e0 + e_local + k;
        if (e < dv) out[e] = acc[k];
    }
}

// G = Σ over the group's query heads (ascending) of Σ over the row ranges (ascending) of the partial sums, into the
// f64 gradient workspace at hbar_at: one thread per element of [d, dv] (grid (elements / TAILB_THREADS, KV head,
// sequence)).
extern "C" __global__ void __launch_bounds__(TAILB_THREADS)
pisa_tail_bwd_g_sum(const double* __restrict__ partials, double* __restrict__ grads, const int* __restrict__ cu_q,
                    const PisaTailParams p, const int row_splits) {
    const FlashParams& fp = p.flash;
    const int kv = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv;
    const long long at = (long long)blockIdx.x * TAILB_THREADS + threadIdx.x;
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

extern "C" __global__ void __launch_bounds__(TAILB_THREADS)
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
    for (int idx = threadIdx.x; idx < TAILB_KEYS * HEAD_DIM_PAD; idx += TAILB_THREADS) {
        const int jj = idx / HEAD_DIM_PAD, c = idx % HEAD_DIM_PAD, j = j0 + jj, b = j / p.kv_block;
        y_s[jj][c] = (jj < keys && c < d)
                         ? (double)to_f32(k[k_base + (long long)j * fp.k_row + c]) - means[(long long)b * d + c]
                         : 0.0;
    }
    for (int idx = threadIdx.x; idx < TAILB_KEYS * HEAD_DIM_V_PAD; idx += TAILB_THREADS) {
        const int jj = idx / HEAD_DIM_V_PAD, e = idx % HEAD_DIM_V_PAD, j = j0 + jj, b = j / p.kv_block;
        x_s[jj][e] = (jj < keys && e < dv)
                         ? (double)to_f32(v[v_base + (long long)j * fp.v_row + e]) - value_means[(long long)b * dv + e]
                         : 0.0;
    }
    __syncthreads();
    const double per_block = 1.0 / (double)n_blocks;
    // dK: column c, Σ_e G_ce x_je.
    for (int c = threadIdx.x; c < d; c += TAILB_THREADS) {
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
    for (int e = threadIdx.x; e < dv; e += TAILB_THREADS) {
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
