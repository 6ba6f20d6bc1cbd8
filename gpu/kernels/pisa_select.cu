// Pyramid Top-K block selection (PISA: E25–E28), compiled by NVRTC (see gpu/src/compile.rs) after common.cuh and
// bsa_select.cu, whose key and query pooling (bsa_pool_keys, bsa_pool_queries: the leaves' and the query blocks' mean
// vectors in f64), candidate order (better, warp_best_unchosen) and sequence_lengths it reuses. The rule is the
// oracle's (oracle/src/pyramid.rs) applied to a query block's mean-pooled queries at the block's last visible
// position; the host wrapper is gpu/src/pisa/select.rs, which documents that convention, and
// proofs/src/pyramid_bound.rs bounds the scores' rounding.
//
// Two kernels beside the reused pooling:
//   pisa_pool_level  one CTA per (node, KV head, sequence) of one level ℓ ≥ 1: the node's mean key, the
//                    count-weighted mean of its children's means, μ_n = (Σ_c fl(n_c · μ_c)) / n_n, children in
//                    ascending order (n_c the keys under child c, the last node of a level covering fewer). Launched
//                    once per level, coarser after finer.
//   pisa_select      one CTA per (query block, KV head, sequence): the coarse-to-fine descent. From the sequence's
//                    root down to its leaves: score every eligible candidate (first key at or before the query block's
//                    last visible position), summed over the group's query heads in ascending order; keep the forced
//                    nodes (the ancestors of the first, previous and current leaf) and then the best eligible ones,
//                    `keep` in all (larger score first, equal scores to the lower node, NaN never); the kept nodes'
//                    children are the next level's candidates. The kept leaves are the list, ascending, padded with -1
//                    to the list width. With a trace buffer it also writes every level's candidates and their scores.
//
// The scores (E26, per query head h with pooled query q̄_h and α the scale; "items" are the raw keys of a leaf, weight
// 1 each, or the child means of an intermediate node, weight n_c each, with x_i = α · (q̄_h · item_i) and W the total
// weight):
//   LSE     m + log((Σ_i w_i e^{x_i − m}) / W), m the items' maximum;
//   PISA-1  α · (q̄_h · μ_n), the node's own mean;
//   PISA-2  mean + var / 2, mean = (Σ_i w_i x_i) / W, var = (Σ_i w_i (x_i − mean)²) / W.
// Every sum runs in an order fixed by the items' offsets inside the node (a lane's items in ascending order, then the
// xor-shuffle tree, which leaves the same bits in every lane), a dot product over the columns in ascending order with
// fused multiply-adds; so two nodes with bitwise equal contents score bitwise equal, and tie to the lower index as in
// the oracle.

#define PISA_THREADS 256
#define PISA_WARPS (PISA_THREADS / 32)
#define PISA_MAX_KEEP 64
#define PISA_MAX_BRANCHING 16
#define PISA_MAX_CANDIDATES (PISA_MAX_KEEP * PISA_MAX_BRANCHING)
// Items a lane scores: a leaf of up to 128 keys, or up to 16 children, over 32 lanes.
#define PISA_ITEMS_PER_LANE 4
// The score of a candidate that is not scored (it starts after the query block's position) and of trace padding.
#define PISA_NOT_SCORED __longlong_as_double(0x7ff8000000000000ll)
#define PISA_LSE 0
#define PISA_ONE 1
#define PISA_TWO 2

// Nodes at `level` of a pyramid over `leaves` leaves: ⌈leaves / β^level⌉.
__device__ __forceinline__ int pisa_width(int leaves, int branching, int level) {
    int w = leaves;
    for (int i = 0; i < level; ++i) w = (w + branching - 1) / branching;
    return w;
}

// The mean vectors of `level` for (seq, kv): level 0 is bsa_pool_keys's block means at the workspace's start; level
// ℓ ≥ 1 follows the pooled queries, every level [B, Hkv, width_ℓ, d] of the longest sequence's widths.
__device__ __forceinline__ long long pisa_level_offset(const PisaParams& p, int level, int seq, int kv) {
    const long long d = p.bsa.flash.d, heads = (long long)p.bsa.n_heads_kv;
    if (level == 0) return ((long long)seq * heads + kv) * p.bsa.n_key_blocks * d;
    const long long batch = p.batch;
    long long at = p.levels_at;
    int w = p.bsa.n_key_blocks;
    for (int l = 1; l < level; ++l) {
        w = (w + p.branching - 1) / p.branching;
        at += batch * heads * w * d;
    }
    w = (w + p.branching - 1) / p.branching;
    return at + ((long long)seq * heads + kv) * w * d;
}

// Keys under `node` of a level whose nodes span `span` keys, in a sequence of `len_k` keys.
__device__ __forceinline__ long long pisa_count(long long node, long long span, int len_k) {
    return min((node + 1) * span, (long long)len_k) - node * span;
}

extern "C" __global__ void __launch_bounds__(POOL_THREADS)
pisa_pool_level(double* __restrict__ pooled, const int* __restrict__ cu_k, const PisaParams params, int level) {
    const FlashParams& fp = params.bsa.flash;
    const int node = blockIdx.x, kv = blockIdx.y, seq = blockIdx.z;
    const int len_k = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
    long long span_below = params.bsa.kv_block;
    for (int l = 1; l < level; ++l) span_below *= params.branching;
    const long long span = span_below * params.branching;
    if ((long long)node * span >= len_k) return;  // past this sequence's nodes
    const int leaves = (len_k + params.bsa.kv_block - 1) / params.bsa.kv_block;
    const int below_width = pisa_width(leaves, params.branching, level - 1);
    const int first = node * params.branching, last = min(first + params.branching, below_width);
    const double* below = pooled + pisa_level_offset(params, level - 1, seq, kv);
    double* out = pooled + pisa_level_offset(params, level, seq, kv) + (long long)node * fp.d;
    const double count = (double)pisa_count(node, span, len_k);
    for (int c = threadIdx.x; c < fp.d; c += POOL_THREADS) {
        double sum = 0.0;
        for (int child = first; child < last; ++child) {
            sum += (double)pisa_count(child, span_below, len_k) * below[(long long)child * fp.d + c];
        }
        out[c] = sum / count;
    }
}

// The sum of `v` over the warp by the xor-shuffle tree: every lane ends with the same bits (a + b = b + a in IEEE).
__device__ __forceinline__ double pisa_warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double pisa_warp_max(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// What one warp needs to score the nodes of one (query block, KV head, sequence).
struct PisaNodeSource {
    const elem_t* keys;     // the sequence's keys of this KV head: row j at keys + j * key_row
    long long key_row;      // elements between two key rows
    const double* pooled;   // the workspace (level means)
    int seq, kv, len_k, leaves;
};

// The score of `node` at `level` for one query head `qh` (d f64 in shared memory), returned in every lane of the
// calling warp (all 32 lanes call it together).
__device__ double pisa_head_score(const PisaParams& p, const PisaNodeSource& src, const double* qh, int level,
                                  int node) {
    const int d = p.bsa.flash.d, lane = threadIdx.x % 32;
    const double alpha = p.bsa.scale;
    if (p.scoring == PISA_ONE) {
        const double* mean = src.pooled + pisa_level_offset(p, level, src.seq, src.kv) + (long long)node * d;
        double part = 0.0;
        for (int c = lane; c < d; c += 32) part = fma(qh[c], mean[c], part);
        return alpha * pisa_warp_sum(part);
    }
    // The pooled items: the leaf's raw keys, or the node's children's means.
    long long span_below = 1;
    int first, last;
    if (level == 0) {
        first = node * p.bsa.kv_block;
        last = min(first + p.bsa.kv_block, src.len_k);
    } else {
        span_below = p.bsa.kv_block;
        for (int l = 1; l < level; ++l) span_below *= p.branching;
        first = node * p.branching;
        last = min(first + p.branching, pisa_width(src.leaves, p.branching, level - 1));
    }
    const double* below = level == 0 ? nullptr : src.pooled + pisa_level_offset(p, level - 1, src.seq, src.kv);
    double x[PISA_ITEMS_PER_LANE], w[PISA_ITEMS_PER_LANE];
    double max_x = (double)NEG_INF, total = 0.0;
#pragma unroll
    for (int r = 0; r < PISA_ITEMS_PER_LANE; ++r) {
        const int item = first + lane + 32 * r;
        x[r] = 0.0;
        w[r] = 0.0;
        if (item < last) {
            double dot = 0.0;
            if (level == 0) {
                const elem_t* row = src.keys + (long long)item * src.key_row;
                for (int c = 0; c < d; c += 8) {
                    const uint4 raw = *reinterpret_cast<const uint4*>(row + c);
                    const elem_t* e8 = reinterpret_cast<const elem_t*>(&raw);
#pragma unroll
                    for (int e = 0; e < 8; ++e) dot = fma(qh[c + e], (double)to_f32(e8[e]), dot);
                }
                w[r] = 1.0;
            } else {
                const double* mean = below + (long long)item * d;
                for (int c = 0; c < d; ++c) dot = fma(qh[c], mean[c], dot);
                w[r] = (double)pisa_count(item, span_below, src.len_k);
            }
            x[r] = alpha * dot;
            max_x = fmax(max_x, x[r]);
        }
        total += w[r];
    }
    total = pisa_warp_sum(total);
    if (p.scoring == PISA_LSE) {
        const double m = pisa_warp_max(max_x);
        double y = 0.0;
#pragma unroll
        for (int r = 0; r < PISA_ITEMS_PER_LANE; ++r)
            if (w[r] > 0.0) y += w[r] * exp(x[r] - m);
        return m + log(pisa_warp_sum(y) / total);
    }
    double t = 0.0;
#pragma unroll
    for (int r = 0; r < PISA_ITEMS_PER_LANE; ++r) t += w[r] * x[r];
    const double mean = pisa_warp_sum(t) / total;
    double v = 0.0;
#pragma unroll
    for (int r = 0; r < PISA_ITEMS_PER_LANE; ++r) {
        const double dev = x[r] - mean;
        v += w[r] * (dev * dev);
    }
    return mean + 0.5 * (pisa_warp_sum(v) / total);
}

extern "C" __global__ void __launch_bounds__(PISA_THREADS)
pisa_select(const elem_t* __restrict__ k, const double* __restrict__ pooled, int* __restrict__ lists,
            const int* __restrict__ cu_q, const int* __restrict__ cu_k, double* __restrict__ trace_scores,
            int* __restrict__ trace_nodes, const PisaParams params) {
    const FlashParams& fp = params.bsa.flash;
    const int a = blockIdx.x, kv = blockIdx.y, seq = blockIdx.z;
    const int group = fp.group, d = fp.d, width = params.bsa.top_k;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    double* q_heads = reinterpret_cast<double*>(smem_raw);  // [group, d]
    __shared__ int candidates[PISA_MAX_CANDIDATES];
    __shared__ int next_candidates[PISA_MAX_CANDIDATES];
    __shared__ double scores[PISA_MAX_CANDIDATES];
    __shared__ unsigned char chosen[PISA_MAX_CANDIDATES];
    __shared__ int n_candidates;

    const long long row_index = ((long long)seq * params.bsa.n_heads_kv + kv) * gridDim.x + a;
    int* list = lists + row_index * width;
    const long long trace_row = row_index * params.n_levels * params.max_candidates;
    int len_q, len_k;
    sequence_lengths(fp, cu_q, cu_k, seq, len_q, len_k);
    const int row0 = a * params.bsa.q_block;
    // The block's last visible key: bottom-right causal, or every key without a mask.
    long long position = -1;
    if (row0 < len_q && len_k > 0) {
        const int rows = min(params.bsa.q_block, len_q - row0);
        position = params.bsa.causal ? (long long)row0 + rows - 1 + len_k - len_q : (long long)len_k - 1;
    }
    const int leaves = (len_k + params.bsa.kv_block - 1) / params.bsa.kv_block;
    int top = 0;
    while (pisa_width(leaves, params.branching, top) > 1) ++top;
    if (position < 0) {  // past the sequence's query blocks, or nothing visible: an empty list and an empty trace
        top = -1;
        for (int w = threadIdx.x; w < width; w += PISA_THREADS) list[w] = -1;
    }
    // Levels this row does not visit: an empty trace.
    if (trace_nodes != nullptr) {
        for (long long i = (long long)(top + 1) * params.max_candidates + threadIdx.x;
             i < (long long)params.n_levels * params.max_candidates; i += PISA_THREADS) {
            trace_nodes[trace_row + i] = -1;
            trace_scores[trace_row + i] = PISA_NOT_SCORED;
        }
    }
    if (top < 0) return;

    // The group's pooled queries (bsa_pool_queries), one row per head.
    const long long n_heads_q = (long long)params.bsa.n_heads_kv * group;
    const double* q_pool = pooled + params.bsa.pooled_queries_at;
    for (int i = threadIdx.x; i < group * d; i += PISA_THREADS) {
        const int h = i / d, c = i % d;
        q_heads[i] = q_pool[((seq * n_heads_q + kv * group + h) * gridDim.x + a) * d + c];
    }
    if (threadIdx.x == 0) {
        candidates[0] = 0;
        n_candidates = 1;
    }
    const long long key_base = fp.varlen ? (long long)cu_k[seq] * fp.k_row : seq * fp.k_batch;
    const PisaNodeSource src{k + key_base + kv * fp.k_head, fp.k_row, pooled, seq, kv, len_k, leaves};
    const long long current = position / params.bsa.kv_block;
    const long long forced_leaves[3] = {0, current > 0 ? current - 1 : 0, current};
    __syncthreads();

    for (int level = top; level >= 0; --level) {
        long long span = params.bsa.kv_block, stride = 1;
        for (int l = 0; l < level; ++l) {
            span *= params.branching;
            stride *= params.branching;
        }
        const int n = n_candidates;
        // Scores: one warp per candidate, the group's heads in ascending order. An ineligible candidate is not
        // scored (NaN, which never wins).
        for (int i = warp; i < n; i += PISA_WARPS) {
            const int node = candidates[i];
            double total = PISA_NOT_SCORED;
            if ((long long)node * span <= position) {
                total = 0.0;
                for (int h = 0; h < group; ++h) total += pisa_head_score(params, src, q_heads + h * d, level, node);
            }
            if (lane == 0) {
                scores[i] = total;
                chosen[i] = 0;
            }
        }
        __syncthreads();
        if (trace_nodes != nullptr) {
            for (int i = threadIdx.x; i < params.max_candidates; i += PISA_THREADS) {
                const long long at = trace_row + (long long)level * params.max_candidates + i;
                trace_nodes[at] = i < n ? candidates[i] : -1;
                trace_scores[at] = i < n ? scores[i] : PISA_NOT_SCORED;
            }
        }
        // Warp 0 keeps the forced nodes, then `keep` rounds of the best remaining eligible candidate.
        if (warp == 0) {
            int kept = 0;
            for (int base = 0; base < n; base += 32) {
                const int i = base + lane;
                bool forced = false;
                if (i < n) {
#pragma unroll
                    for (int f = 0; f < 3; ++f) forced |= (long long)candidates[i] == forced_leaves[f] / stride;
                    if (forced) chosen[i] = 1;
                }
                kept += __popc(__ballot_sync(0xffffffffu, forced));
            }
            __syncwarp();
            for (int round = kept; round < params.keep; ++round) {
                double s;
                int best;
                warp_best_unchosen(scores, chosen, lane, n, 32, s, best);
                if (best < 0) break;  // no eligible candidate left
                __syncwarp();  // every lane has read chosen[] (racecheck: the shuffles order no memory)
                if (lane == 0) chosen[best] = 1;
                __syncwarp();
            }
        }
        __syncthreads();
        // The kept nodes, ascending: the leaves' are the list; a coarser level's expand to the next candidates.
        if (threadIdx.x == 0) {
            if (level == 0) {
                int written = 0;
                for (int i = 0; i < n; ++i)
                    if (chosen[i] && written < width) list[written++] = candidates[i];
                for (; written < width; ++written) list[written] = -1;
            } else {
                const int below = pisa_width(leaves, params.branching, level - 1);
                int next = 0;
                for (int i = 0; i < n; ++i) {
                    if (!chosen[i]) continue;
                    const int node = candidates[i];
                    for (int c = node * params.branching; c < min((node + 1) * params.branching, below); ++c)
                        next_candidates[next++] = c;
                }
                for (int i = 0; i < next; ++i) candidates[i] = next_candidates[i];
                n_candidates = next;
            }
        }
        __syncthreads();
    }
}
