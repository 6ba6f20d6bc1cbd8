// Pyramid Top-K block selection (PISA: E25–E28), compiled by NVRTC (see gpu/src/compile.rs) after common.cuh and
// bsa_select.cu, whose key and query pooling (bsa_pool_keys, bsa_pool_queries: the leaves' and the query blocks' mean
// vectors in f64), candidate order (better) and sequence_lengths it reuses. The rule is the
// oracle's (oracle/src/pyramid.rs) applied to a query block's mean-pooled queries at the block's last visible
// position; the host wrapper is gpu/src/pisa/select.rs, which documents that convention, and
// proofs/src/pyramid_bound.rs bounds the scores' rounding.
//
// Three kernels beside the reused pooling:
//   pisa_pool_level  one CTA per (node, KV head, sequence) of one level ℓ ≥ 1: the node's mean key, the
//                    count-weighted mean of its children's means, μ_n = (Σ_c fl(n_c · μ_c)) / n_n, children in
//                    ascending order (n_c the keys under child c, the last node of a level covering fewer). Launched
//                    once per level, coarser after finer.
//   pisa_select,     one warp per (query block, KV head, sequence), up to 8 per CTA, each on its own slice of
//   pisa_select_mean shared memory and never waiting for another: the coarse-to-fine descent (pisa_descend, one body;
//                    pisa_select_mean is PISA-1's entry, pisa_select LSE's and PISA-2's, so that each gets the
//                    registers of its own scoring loop). From the sequence's root
//                    down to its leaves: score every eligible candidate (first key at or before the query block's
//                    last visible position), summed over the group's query heads; keep the forced nodes (the
//                    ancestors of the first, previous and current leaf) and then the eligible ones whose rank among
//                    the unforced (larger score first, equal scores to the lower node, NaN never) is below the room
//                    the forced ones leave, `keep` in all; the kept nodes' children are the next level's candidates.
//                    The kept leaves are the list, ascending, padded with -1 to the list width. With a trace buffer it
//                    also writes every level's candidates and their scores.
//
// The scores (E26, per query head h with pooled query q̄_h and α the scale; "items" are the raw keys of a leaf, weight
// 1 each, or the child means of an intermediate node, weight n_c each, with x_i = α · (q̄_h · item_i) and W the total
// weight):
//   LSE     m + log((Σ_i w_i e^{x_i − m}) / W), m the items' maximum, summed over the heads in ascending order;
//   PISA-1  α · (q̃ · μ_n), the node's own mean against the group's summed query q̃ = Σ_h q̄_h (heads in ascending
//           order): linear in the query, so equal to Σ_h α q̄_h · μ_n in exact arithmetic, with one dot product per
//           candidate (pyramid_bound.rs's presummed_score_bound covers the other rounding order);
//   PISA-2  mean + var / 2, mean = (Σ_i w_i x_i) / W, var = (Σ_i w_i (x_i − mean)²) / W, summed over the heads.
// Every sum runs in an order fixed by the items' offsets inside the node (a lane's items in ascending order, then the
// xor-shuffle tree, which leaves the same bits in every lane, or PISA-1's reduce-scatter along the same tree), a dot
// product over the columns in ascending order with fused multiply-adds; so two nodes with bitwise equal contents
// score bitwise equal, and tie to the lower index as in the oracle.
//
// The host (select.rs) bounds K ≤ 64 and β ≤ 16: a warp's shared memory holds K·β candidates, and a lane scores at
// most PISA_ITEMS_PER_LANE items of a node.

#define PISA_THREADS 256
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

// PISA-1's dot products of a chunk of 16 candidates at once: lane l holds its columns' partial sums v[j] of candidate
// j, and ends with candidate (l mod 16)'s total. A reduce-scatter along the same xor-shuffle tree as pisa_warp_sum
// (lanes 16 apart first, then 8, 4, 2, 1), so every candidate's total has the bits pisa_warp_sum would give it,
// whichever position of the chunk it holds; 31 shuffles for the 16 totals instead of 80.
template <int O>
__device__ __forceinline__ void pisa_scatter_step(double (&v)[16], int lane) {
    // Lanes O apart swap halves of their first 2O values and add the halves they keep (O < 16), or add all 16 (O = 16).
    if (O == 16) {
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], 16);
        return;
    }
    const bool upper = (lane & O) != 0;
#pragma unroll
    for (int j = 0; j < O; ++j) {
        const double theirs = __shfl_xor_sync(0xffffffffu, upper ? v[j] : v[j + O], O);
        v[j] = (upper ? v[j + O] : v[j]) + theirs;
    }
}

__device__ __forceinline__ double pisa_warp_sum_scatter(double (&v)[16]) {
    const int lane = threadIdx.x % 32;
    pisa_scatter_step<16>(v, lane);
    pisa_scatter_step<8>(v, lane);
    pisa_scatter_step<4>(v, lane);
    pisa_scatter_step<2>(v, lane);
    pisa_scatter_step<1>(v, lane);
    return v[0];
}

// The LSE or PISA-2 score of one head from its items' scores: lane l holds x[r] and weight w[r] of items l + 32r
// (weight 0: no item), `weights` the items' total weight. Every lane returns the same bits: the maximum and the sums
// run along the xor-shuffle tree over the lanes after each lane's items in ascending order.
template <int R>
__device__ __forceinline__ double pisa_pooled_score(int scoring, const double (&x)[R], const double (&w)[R],
                                                    double weights) {
    if (scoring == PISA_LSE) {
        double max_x = (double)NEG_INF;
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (w[r] > 0.0) max_x = fmax(max_x, x[r]);
        const double m = pisa_warp_max(max_x);
        double y = 0.0;
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (w[r] > 0.0) y += w[r] * exp(x[r] - m);
        return m + log(pisa_warp_sum(y) / weights);
    }
    double t = 0.0;
#pragma unroll
    for (int r = 0; r < R; ++r) t += w[r] * x[r];
    const double mean = pisa_warp_sum(t) / weights;
    double v = 0.0;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const double dev = x[r] - mean;
        v += w[r] * (dev * dev);
    }
    return mean + 0.5 * (pisa_warp_sum(v) / weights);
}

// Query heads a pass over a leaf's keys serves: each key column is read and widened once per pass, then used by this
// many heads' dot products (8 heads for up to two keys per lane, 4 for four, which keeps the widened columns and the
// dot products in registers).
#define PISA_HEAD_CHUNK(R) ((R) >= 4 ? 4 : 8)

// The LSE or PISA-2 score of leaf `node` summed over the group's heads in ascending order (q_s: the group's pooled
// queries, d f64 per head), returned in every lane of the calling warp (all 32 lanes call it together). Its items are
// the leaf's raw keys [first, last), weight 1 each; lane l holds keys first + l + 32r, r < R, and takes each key's dot
// products over the columns in ascending order with fused multiply-adds.
template <int R>
__device__ double pisa_leaf_group_score(const PisaParams& p, const PisaNodeSource& src, const double* q_s, int first,
                                        int last) {
    const int d = p.bsa.flash.d, group = p.bsa.flash.group, lane = threadIdx.x % 32;
    double w[R];
    double weights = 0.0;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        w[r] = first + lane + 32 * r < last ? 1.0 : 0.0;
        weights += w[r];
    }
    weights = pisa_warp_sum(weights);
    double group_total = 0.0;
    constexpr int HC = PISA_HEAD_CHUNK(R);
    for (int h0 = 0; h0 < group; h0 += HC) {
        const int heads = min(HC, group - h0);
        const double* q0 = q_s + (long long)h0 * d;
        // dot[r][hh]: key r against head h0 + hh.
        double dot[R][HC];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int hh = 0; hh < HC; ++hh) dot[r][hh] = 0.0;
        for (int c = 0; c < d; c += 8) {
            double k8[R][8];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int item = first + lane + 32 * r;
                uint4 raw = make_uint4(0u, 0u, 0u, 0u);
                if (item < last) raw = *reinterpret_cast<const uint4*>(src.keys + (long long)item * src.key_row + c);
                const elem_t* e8 = reinterpret_cast<const elem_t*>(&raw);
#pragma unroll
                for (int e = 0; e < 8; ++e) k8[r][e] = (double)to_f32(e8[e]);
            }
#pragma unroll
            for (int hh = 0; hh < HC; ++hh) {
                if (hh < heads) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const double qv = q0[hh * d + c + e];
#pragma unroll
                        for (int r = 0; r < R; ++r) dot[r][hh] = fma(qv, k8[r][e], dot[r][hh]);
                    }
                }
            }
        }
#pragma unroll
        for (int hh = 0; hh < HC; ++hh) {
            if (hh >= heads) break;
            double x[R];
#pragma unroll
            for (int r = 0; r < R; ++r) x[r] = w[r] > 0.0 ? p.bsa.scale * dot[r][hh] : 0.0;
            group_total += pisa_pooled_score<R>(p.scoring, x, w, weights);
        }
    }
    return group_total;
}

// The LSE or PISA-2 score of a coarser node summed over the group's heads in ascending order. Its items are its
// children's means [first, last), at most 16 (`below`, weight their key counts, nodes below spanning span_below
// keys). The (child, head) pairs go 16 at a time (children fastest, pair j = hh · items + i): lane l accumulates
// columns l, l + 32, ... of every pair's dot product with fused multiply-adds (the children's mean rows read
// coalesced, all loads in flight), and the reduce-scatter leaves pair j's dot product in lanes j and j + 16. Each
// lane then holds one item's score of one head, so the exponentials and logarithms of a pass run side by side; a
// head's maximum and sums read its children's lanes in ascending order, and the total weight is summed in that order
// too, so the order depends only on the items' offsets inside the node.
__device__ double pisa_node_group_score(const PisaParams& p, const PisaNodeSource& src, const double* q_s, int first,
                                        int last, const double* below, long long span_below) {
    const int d = p.bsa.flash.d, group = p.bsa.flash.group, lane = threadIdx.x % 32;
    const int items = last - first;
    const int heads_per_pass = max(1, 16 / items);
    double weights = 0.0;
    for (int i = 0; i < items; ++i) weights += (double)pisa_count(first + i, span_below, src.len_k);
    // This lane's pair after the reduce-scatter: head hh_l of the pass, child i_l.
    const int pair = lane % 16, hh_l = pair / items, i_l = pair - hh_l * items;
    const double w_l = (double)pisa_count(first + min(i_l, items - 1), span_below, src.len_k);
    const double* rows = below + (long long)first * d;
    double group_total = 0.0;
    for (int h0 = 0; h0 < group; h0 += heads_per_pass) {
        const int heads = min(heads_per_pass, group - h0);
        const int pairs = heads * items;
        const double* q_rows = q_s + (long long)h0 * d;
        // Column offsets of each pair's query row and child row, without a division per pair.
        int q_off[16], r_off[16];
        {
            int i = 0, hh = 0;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                q_off[j] = hh * d;
                r_off[j] = i * d;
                if (++i == items) {
                    i = 0;
                    ++hh;
                }
            }
        }
        double part[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) part[j] = 0.0;
        for (int c = lane; c < d; c += 32) {
#pragma unroll
            for (int j = 0; j < 16; ++j)
                if (j < pairs) part[j] = fma(q_rows[q_off[j] + c], rows[r_off[j] + c], part[j]);
        }
        const double dot = pisa_warp_sum_scatter(part);
        const bool valid = pair < pairs;
        const double x = valid ? p.bsa.scale * dot : 0.0;
        const int head_lane = hh_l * items;  // the lane of this pair's head's first child
        const auto child = [&](double v, int i) { return __shfl_sync(0xffffffffu, v, (head_lane + i) & 31); };
        double score;
        if (p.scoring == PISA_LSE) {
            double m = (double)NEG_INF;
            for (int i = 0; i < items; ++i) m = fmax(m, child(x, i));
            const double e = valid ? w_l * exp(x - m) : 0.0;
            double y = 0.0;
            for (int i = 0; i < items; ++i) y += child(e, i);
            score = m + log(y / weights);
        } else {
            double t = 0.0;
            for (int i = 0; i < items; ++i) t += child(valid ? w_l * x : 0.0, i);
            const double mean = t / weights;
            const double dev = x - mean;
            double v = 0.0;
            for (int i = 0; i < items; ++i) v += child(valid ? w_l * (dev * dev) : 0.0, i);
            score = mean + 0.5 * (v / weights);
        }
        for (int hh = 0; hh < heads; ++hh) group_total += __shfl_sync(0xffffffffu, score, hh * items);
    }
    return group_total;
}

// pisa_leaf_group_score or pisa_node_group_score for `node` at `level`.
__device__ double pisa_group_score(const PisaParams& p, const PisaNodeSource& src, const double* q_s, int level,
                                   int node) {
    if (level > 0) {
        long long span_below = p.bsa.kv_block;
        for (int l = 1; l < level; ++l) span_below *= p.branching;
        const int first = node * p.branching;
        const int last = min(first + p.branching, pisa_width(src.leaves, p.branching, level - 1));
        const double* below = src.pooled + pisa_level_offset(p, level - 1, src.seq, src.kv);
        return pisa_node_group_score(p, src, q_s, first, last, below, span_below);
    }
    const int first = node * p.bsa.kv_block;
    const int last = min(first + p.bsa.kv_block, src.len_k);
    const int keys = last - first;
    if (keys <= 32) return pisa_leaf_group_score<1>(p, src, q_s, first, last);
    if (keys <= 64) return pisa_leaf_group_score<2>(p, src, q_s, first, last);
    return pisa_leaf_group_score<PISA_ITEMS_PER_LANE>(p, src, q_s, first, last);
}

// Bytes of shared memory one warp of pisa_descend holds: its query columns (q_cols f64), a level's scores
// (max_candidates f64), its candidates (max_candidates int) and the kept nodes (width int), rounded up to 8 bytes.
// select.rs sizes the launch by the same sum (warp_shared_bytes).
__device__ __forceinline__ long long pisa_warp_bytes(int q_cols, int max_candidates, int width) {
    return ((8ll * (q_cols + max_candidates) + 4ll * (max_candidates + width)) + 7) & ~7ll;
}

// The descent of pisa_select (LSE, PISA-2: PRESUMMED false) and pisa_select_mean (PISA-1: true), one body for both;
// two entry points so that each gets the registers of its own scoring loop.
template <bool PRESUMMED>
__device__ __forceinline__ void pisa_descend(const elem_t* __restrict__ k, const double* __restrict__ pooled,
                                             int* __restrict__ lists, const int* __restrict__ cu_q,
                                             const int* __restrict__ cu_k, double* __restrict__ trace_scores,
                                             int* __restrict__ trace_nodes, const PisaParams& params) {
    // One warp per (query block, KV head, sequence): the warps of a CTA never wait for each other.
    const FlashParams& fp = params.bsa.flash;
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int a = blockIdx.x * warps + warp, kv = blockIdx.y, seq = blockIdx.z;
    if (a >= params.bsa.n_query_blocks) return;
    const int group = fp.group, d = fp.d, width = params.bsa.top_k, max_candidates = params.max_candidates;
    // PISA-1's score is linear in the query: the group's pooled queries are summed first (as bsa_select does), one dot
    // product per candidate instead of one per head.
    const int q_cols = PRESUMMED ? d : group * d;
    extern __shared__ __align__(16) unsigned char pisa_smem[];
    unsigned char* mine = pisa_smem + warp * pisa_warp_bytes(q_cols, max_candidates, width);
    double* q_s = reinterpret_cast<double*>(mine);  // [q_cols]: q̃ = Σ_h q̄_h, or the group's q̄_h, one row each
    double* scores = q_s + q_cols;                   // [max_candidates]
    int* candidates = reinterpret_cast<int*>(scores + max_candidates);  // [max_candidates], ascending
    int* kept = candidates + max_candidates;                             // [width], ascending

    const long long row_index = ((long long)seq * params.bsa.n_heads_kv + kv) * params.bsa.n_query_blocks + a;
    int* list = lists + row_index * width;
    const long long trace_row = row_index * params.n_levels * max_candidates;
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
        for (int w = lane; w < width; w += 32) list[w] = -1;
    }
    // Levels this row does not visit: an empty trace.
    if (trace_nodes != nullptr) {
        for (long long i = (long long)(top + 1) * max_candidates + lane; i < (long long)params.n_levels * max_candidates;
             i += 32) {
            trace_nodes[trace_row + i] = -1;
            trace_scores[trace_row + i] = PISA_NOT_SCORED;
        }
    }
    if (top < 0) return;

    // The group's pooled queries (bsa_pool_queries): summed over the heads in ascending order, or one row per head.
    const long long n_heads_q = (long long)params.bsa.n_heads_kv * group;
    const double* q_pool = pooled + params.bsa.pooled_queries_at;
    const auto pooled_query = [&](int h, int c) {
        return q_pool[((seq * n_heads_q + kv * group + h) * params.bsa.n_query_blocks + a) * d + c];
    };
    for (int i = lane; i < q_cols; i += 32) {
        if (PRESUMMED) {
            double sum = 0.0;
            for (int h = 0; h < group; ++h) sum += pooled_query(h, i);
            q_s[i] = sum;
        } else {
            q_s[i] = pooled_query(i / d, i % d);
        }
    }
    if (lane == 0) candidates[0] = 0;
    int n = 1;  // this level's candidates (the same in every lane)
    const long long key_base = fp.varlen ? (long long)cu_k[seq] * fp.k_row : seq * fp.k_batch;
    const PisaNodeSource src{k + key_base + kv * fp.k_head, fp.k_row, pooled, seq, kv, len_k, leaves};
    const long long current = position / params.bsa.kv_block;
    const long long forced_leaves[3] = {0, current > 0 ? current - 1 : 0, current};
    __syncwarp();

    for (int level = top; level >= 0; --level) {
        long long span = params.bsa.kv_block, stride = 1;
        for (int l = 0; l < level; ++l) {
            span *= params.branching;
            stride *= params.branching;
        }
        // Scores. An ineligible candidate (first key after the position) is not scored: NaN, which never wins.
        if (PRESUMMED) {
            // Chunks of 16 candidates: every lane takes its columns of all 16 dot products (16 independent loads in
            // flight), then the reduce-scatter leaves candidate base + (l mod 16)'s sum in lane l.
            const double* means = pooled + pisa_level_offset(params, level, seq, kv);
            for (int base = 0; base < n; base += 16) {
                double part[16];
#pragma unroll
                for (int j = 0; j < 16; ++j) part[j] = 0.0;
                for (int c = lane; c < d; c += 32) {
                    const double qc = q_s[c];
#pragma unroll
                    for (int j = 0; j < 16; ++j)
                        if (base + j < n) part[j] = fma(qc, means[(long long)candidates[base + j] * d + c], part[j]);
                }
                const double dot = pisa_warp_sum_scatter(part);
                const int i = base + lane;
                if (lane < 16 && i < n) {
                    const bool eligible = (long long)candidates[i] * span <= position;
                    scores[i] = eligible ? params.bsa.scale * dot : PISA_NOT_SCORED;
                }
            }
        } else {
            // One candidate at a time over the warp, the group's heads in ascending order.
            for (int i = 0; i < n; ++i) {
                const int node = candidates[i];
                double total = PISA_NOT_SCORED;
                if ((long long)node * span <= position) total = pisa_group_score(params, src, q_s, level, node);
                if (lane == 0) scores[i] = total;
            }
        }
        __syncwarp();
        if (trace_nodes != nullptr) {
            for (int i = lane; i < max_candidates; i += 32) {
                const long long at = trace_row + (long long)level * max_candidates + i;
                trace_nodes[at] = i < n ? candidates[i] : -1;
                trace_scores[at] = i < n ? scores[i] : PISA_NOT_SCORED;
            }
        }
        // Keep the forced nodes, then the eligible others whose rank among the unforced (larger score first, equal
        // scores to the lower node, NaN never) is below the room the forced ones leave.
        long long forced_nodes[3];  // this level's ancestors of the forced leaves
#pragma unroll
        for (int f = 0; f < 3; ++f) forced_nodes[f] = forced_leaves[f] / stride;
        const auto is_forced = [&](int node) {
            bool forced = false;
#pragma unroll
            for (int f = 0; f < 3; ++f) forced |= (long long)node == forced_nodes[f];
            return forced;
        };
        int n_forced = 0;
        for (int base = 0; base < n; base += 32) {
            const int i = base + lane;
            n_forced += __popc(__ballot_sync(0xffffffffu, i < n && is_forced(candidates[i])));
        }
        const int room = max(0, params.keep - n_forced);
        int n_kept = 0;
        for (int base = 0; base < n; base += 32) {
            const int i = base + lane;
            bool keep = false;
            if (i < n) {
                if (is_forced(candidates[i])) {
                    keep = true;
                } else if (scores[i] == scores[i]) {
                    int rank = 0;
                    for (int j = 0; j < n; ++j)
                        rank += !is_forced(candidates[j]) && better(scores[j], j, scores[i], i);
                    keep = rank < room;
                }
            }
            const unsigned mask = __ballot_sync(0xffffffffu, keep);
            if (keep) kept[n_kept + __popc(mask & ((1u << lane) - 1u))] = candidates[i];
            n_kept += __popc(mask);
        }
        __syncwarp();
        // The kept nodes, ascending: the leaves' are the list; a coarser level's expand to the next candidates (only
        // the last node of a level has fewer than β children).
        if (level == 0) {
            for (int w = lane; w < width; w += 32) list[w] = w < n_kept ? kept[w] : -1;
        } else {
            const int below = pisa_width(leaves, params.branching, level - 1);
            const int last = kept[n_kept - 1];
            const int next = (n_kept - 1) * params.branching + min(params.branching, below - last * params.branching);
            for (int t = lane; t < next; t += 32)
                candidates[t] = kept[t / params.branching] * params.branching + t % params.branching;
            n = next;
        }
        __syncwarp();
    }
}

extern "C" __global__ void __launch_bounds__(PISA_THREADS)
pisa_select(const elem_t* __restrict__ k, const double* __restrict__ pooled, int* __restrict__ lists,
            const int* __restrict__ cu_q, const int* __restrict__ cu_k, double* __restrict__ trace_scores,
            int* __restrict__ trace_nodes, const PisaParams params) {
    pisa_descend<false>(k, pooled, lists, cu_q, cu_k, trace_scores, trace_nodes, params);
}

extern "C" __global__ void __launch_bounds__(PISA_THREADS)
pisa_select_mean(const elem_t* __restrict__ k, const double* __restrict__ pooled, int* __restrict__ lists,
                 const int* __restrict__ cu_q, const int* __restrict__ cu_k, double* __restrict__ trace_scores,
                 int* __restrict__ trace_nodes, const PisaParams params) {
    pisa_descend<true>(k, pooled, lists, cu_q, cu_k, trace_scores, trace_nodes, params);
}
