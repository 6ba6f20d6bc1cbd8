// Block selection for block-sparse attention (BSA: E15 pooling feeding E14 lists), compiled by NVRTC (see
// gpu/src/compile.rs) after common.cuh. The selection rule is the oracle's (oracle/src/bsa.rs); the host wrapper is
// gpu/src/block_sparse/select.rs, which documents the rounding-error bound of the scores.
//
// Four kernels:
//   bsa_pool_keys   per (key block, KV head, sequence): k̄_b = mean of the block's keys (the last block of a
//                   sequence over the keys it has), f64, written to the workspace's pooled keys [B, Hkv, n_k, d].
//   bsa_pool_queries  likewise per (query block, query head, sequence): q̄_{a,h}, written to the workspace's pooled
//                   queries [B, Hq, n_q, d] (from element pooled_queries_at on).
//                   Both take their (block, head, sequence) items with the block fastest, CTA x the items x,
//                   x + gridDim.x, ...: one CTA per item in the serial schedule, a few per multiprocessor in the
//                   overlapped one, so that the selection's CTAs fit beside them.
//   bsa_select_stream  for lists up to STREAM_MAX_TOP_K wide: one CTA per 8 query blocks of a (KV head, sequence),
//                   pooled keys in shared-memory tiles read once for the 8 and scored on the f64 tensor cores, a
//                   running list of the best candidates per query block in a warp's registers (its own section below).
//   bsa_select      for wider lists: one CTA per (query block, KV head, sequence) holding that query block's scores.
// Both selectors take the group's mean-pooled queries summed over the group, q̃_a = Σ_h q̄_{a,h} (f64, heads in
// ascending order), and the pooled score of every eligible key block
//                       S_ab = fl(α · dot(q̃_a, k̄_b)) = Σ_h α q̄_{a,h}·k̄_b in exact arithmetic
// (the group sum taken before the dot product: one pass over k̄_b per key block instead of one per head, which bounds
// the memory traffic; the rounding bound is the same), the forced blocks, then the top-k of the rest (larger score
// first, equal scores to the lower index, NaN never), and write the list ascending and -1-padded: lists
// [B, Hkv, n_q, top_k] i32. Query blocks past a sequence's own get an all -1 list.
//
// Determinism: every sum is taken in a fixed order that does not depend on the block's position or on which warp
// computes it (for the means, interleaved row groups each in ascending order, then the groups in ascending order;
// heads in ascending order for the group sum; for bsa_select's dot product a lane's columns in ascending order, then
// the xor-shuffle tree, for bsa_select_stream's tensor-core accumulation in ascending steps of 4 columns). Two key blocks
// with bitwise equal keys therefore get bitwise equal scores, and their tie breaks to the lower index exactly as the oracle's does.
//
// Chunks: the host may pool and select the query blocks in ranges, the last range first, each range's selection on a
// second stream behind that range's pooling, so that the selection of one range runs while the next range's queries
// are pooled (the query pooling reads all of Q and is bound by memory bandwidth; the selection is not). A launch covers
// query blocks params.first_query_block + blockIdx.x (pooling, bsa_select) or the STREAM_QUERIES blocks from
// params.first_query_block + STREAM_QUERIES * (gridDim.x - 1 - blockIdx.x) (bsa_select_stream); a range's first block
// is a multiple of STREAM_QUERIES. Every block is computed as in one launch over all of them: the same bits.
//
// Eligibility (the oracle's BsaConfig::eligible_end): every key block of the sequence without a mask; under the
// bottom-right causal mask the blocks whose first key the query block's last query sees. Forced: block 0
// (force_first) and the force_local last eligible blocks, eligible ones only; they count towards top_k.

// Hooks for PISA's covariance-aware selection (E24): gpu/kernels/pisa_covariance.cu, compiled before this text,
// defines COVARIANCE_ARGS (two more buffers for both selectors) and WITH_COVARIANCE (the score of query block a and key
// block b with its spread term); without it the selectors take and score what BSA does.
#ifndef COVARIANCE_ARGS
#define COVARIANCE_ARGS
#define WITH_COVARIANCE(score, a, b) (score)
#endif

#define SEL_THREADS 256
#define SEL_WARPS (SEL_THREADS / 32)
#define SEL_KEYS_PER_WARP 8
#define POOL_THREADS 128

// The mean of block `block` of one head's rows (`block_rows` rows per block; the sequence's rows from `cu` when
// varlen, else `dense_len` rows of batch entry `seq`), written as d f64 values to `out`; nothing past the sequence's
// own blocks. The CTA splits the block's rows into `groups` interleaved row groups (row j in group j mod groups);
// each thread sums one group's rows of 8 adjacent columns in ascending order, reading 16 bytes per row with four
// rows in flight (the rows are read once from device memory, so this kernel runs at memory speed only with many
// independent wide loads), and the group sums are then added in ascending group order and divided once by the row
// count. The order depends only on the rows' offsets inside the block, so equal blocks get equal means.
// The group sums take at most POOL_THREADS * 8 f64: a group is POOL_THREADS / (d / 8) threads of 8 columns each, so
// groups · d ≤ 8 · POOL_THREADS for every d (8 KB of shared memory, which leaves room for the selection's CTAs).
#define POOL_GROUPS 8
#define POOL_SUMS (POOL_THREADS * 8)
#define POOL_MAX_D 256
__device__ __forceinline__ void pool_block(const elem_t* __restrict__ x, const int* __restrict__ cu, int dense_len,
                                           long long batch_stride, long long head_offset, long long row_stride,
                                           int block_rows, int block, int seq, int varlen, int d,
                                           double* __restrict__ out) {
    __shared__ double group_sums[POOL_SUMS];  // [groups][d]
    const int len = varlen ? cu[seq + 1] - cu[seq] : dense_len;
    const long long base = varlen ? (long long)cu[seq] * row_stride : seq * batch_stride;
    const int row0 = block * block_rows;
    if (row0 >= len) return;
    const int count = min(block_rows, len - row0);
    const elem_t* x_g = x + base + head_offset + (long long)row0 * row_stride;
    // Every row starts 16 bytes aligned: d is a multiple of 8 (FlashParams::for_spec), so are the strides and
    // offsets, and the buffers are whole device allocations.
    const int chunks = d / 8;
    const int groups = min(POOL_GROUPS, POOL_THREADS / chunks);
    const int chunk = threadIdx.x % chunks, g = threadIdx.x / chunks;
    if (g < groups) {
        double acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.0;
        int j = g;
        for (; j + 3 * groups < count; j += 4 * groups) {
            uint4 rows[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                rows[r] = *reinterpret_cast<const uint4*>(x_g + (long long)(j + r * groups) * row_stride + chunk * 8);
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const elem_t* e8 = reinterpret_cast<const elem_t*>(&rows[r]);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] += (double)to_f32(e8[e]);
            }
        }
        for (; j < count; j += groups) {
            const uint4 row = *reinterpret_cast<const uint4*>(x_g + (long long)j * row_stride + chunk * 8);
            const elem_t* e8 = reinterpret_cast<const elem_t*>(&row);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] += (double)to_f32(e8[e]);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) group_sums[g * d + chunk * 8 + e] = acc[e];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += POOL_THREADS) {
        double sum = 0.0;
        for (int group = 0; group < groups; ++group) sum += group_sums[group * d + c];
        out[c] = sum / count;
    }
}

// The item `item` of a pooling launch over `blocks` blocks, `heads` heads and the sequences: block, head, sequence.
struct PoolItem {
    int block, head, seq;
};
__device__ __forceinline__ PoolItem pool_item(long long item, int blocks, int heads) {
    const long long rest = item / blocks;
    return PoolItem{(int)(item % blocks), (int)(rest % heads), (int)(rest / heads)};
}

extern "C" __global__ void __launch_bounds__(POOL_THREADS)
bsa_pool_keys(const elem_t* __restrict__ k, double* __restrict__ pooled, const int* __restrict__ cu_k,
              const BsaParams params, const int blocks, const int heads, const int seqs) {
    const FlashParams& fp = params.flash;
    const long long items = (long long)blocks * heads * seqs;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const PoolItem it = pool_item(item, blocks, heads);
        double* out = pooled + (((long long)it.seq * params.n_heads_kv + it.head) * params.n_key_blocks + it.block) * fp.d;
        pool_block(k, cu_k, fp.dense_len_k, fp.k_batch, it.head * fp.k_head, fp.k_row, params.kv_block, it.block,
                   it.seq, fp.varlen, fp.d, out);
        __syncthreads();  // the next item's group sums overwrite these
    }
}

extern "C" __global__ void __launch_bounds__(POOL_THREADS)
bsa_pool_queries(const elem_t* __restrict__ q, double* __restrict__ pooled, const int* __restrict__ cu_q,
                 const BsaParams params, const int blocks, const int heads, const int seqs) {
    const FlashParams& fp = params.flash;
    const long long items = (long long)blocks * heads * seqs;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const PoolItem it = pool_item(item, blocks, heads);
        const int a = params.first_query_block + it.block;
        double* out =
            pooled + params.pooled_queries_at + (((long long)it.seq * heads + it.head) * params.n_query_blocks + a) * fp.d;
        pool_block(q, cu_q, fp.dense_len_q, fp.q_batch, it.head * fp.q_head, fp.q_row, params.q_block, a, it.seq,
                   fp.varlen, fp.d, out);
        __syncthreads();  // the next item's group sums overwrite these
    }
}

// The better of two candidates: larger score, then lower index; a NaN score or index -1 never wins.
__device__ __forceinline__ bool better(double s, int i, double t, int j) {
    if (j < 0 || t != t) return i >= 0 && s == s;
    if (i < 0 || s != s) return false;
    return s > t || (s == t && i < j);
}

// The query and key lengths of sequence `seq`: from the cu_seqlens when varlen, else the dense lengths.
__device__ __forceinline__ void sequence_lengths(const FlashParams& fp, const int* __restrict__ cu_q,
                                                 const int* __restrict__ cu_k, int seq, int& len_q, int& len_k) {
    len_q = fp.varlen ? cu_q[seq + 1] - cu_q[seq] : fp.dense_len_q;
    len_k = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
}

// What query block `a` of a sequence chooses from: the eligible key blocks [0, eligible) (none for a query block past
// the sequence's own), the first competing block `first` (1 when block 0 is forced, else 0), the forced local blocks
// [local_from, eligible), and `room`, how many blocks the top-k rule adds to the forced ones. Both selectors read it.
struct SelectionRange {
    int eligible;
    int first;
    int local_from;
    int room;
};

__device__ __forceinline__ SelectionRange selection_range(const BsaParams& params, int a, int len_q, int len_k) {
    SelectionRange range;
    const int row0 = a * params.q_block;
    const int key_blocks = (len_k + params.kv_block - 1) / params.kv_block;
    int eligible = row0 < len_q ? key_blocks : 0;
    if (params.causal && row0 < len_q) {
        const int rows = min(params.q_block, len_q - row0);
        const long long last_key = (long long)row0 + rows - 1 + len_k - len_q;
        eligible = last_key < 0 ? 0 : min(key_blocks, (int)(last_key / params.kv_block) + 1);
    }
    const int local_from = eligible - min(params.force_local, eligible);
    range.eligible = eligible;
    range.local_from = local_from;
    // Block 0 counts once: as the forced first block only when the local blocks do not already hold it.
    range.first = (params.force_first && local_from > 0) ? 1 : 0;
    range.room = max(0, min(params.top_k, eligible) - range.first - (eligible - local_from));
    return range;
}

// Column c of query block a's pooled queries summed over KV head kv's group, heads in ascending order (q̃_a of E15's
// group sum, taken before the dot product).
__device__ __forceinline__ double group_query_sum(const double* __restrict__ pooled, const BsaParams& params, int seq,
                                                  int kv, int a, int c) {
    const double* q_pool = pooled + params.pooled_queries_at;
    const int group = params.flash.group, d = params.flash.d;
    const long long n_heads_q = (long long)params.n_heads_kv * group;
    double group_sum = 0.0;
    for (int h = 0; h < group; ++h) {
        group_sum += q_pool[((seq * n_heads_q + kv * group + h) * params.n_query_blocks + a) * d + c];
    }
    return group_sum;
}

// The best candidate not yet chosen among scores[from], scores[from + stride], ... below n (each lane its own
// stride), then the best over the warp by the xor-shuffle tree, so that every lane ends with the same pair: its score
// in s and its index in i, -1 when there is none. All 32 lanes call it together.
__device__ __forceinline__ void warp_best_unchosen(const double* scores, const unsigned char* chosen, int from, int n,
                                                   int stride, double& s, int& i) {
    s = 0.0;
    i = -1;
    for (int b = from; b < n; b += stride) {
        if (!chosen[b] && better(scores[b], b, s, i)) {
            s = scores[b];
            i = b;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const double t = __shfl_xor_sync(0xffffffffu, s, o);
        const int j = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(t, j, s, i)) {
            s = t;
            i = j;
        }
    }
}

extern "C" __global__ void __launch_bounds__(SEL_THREADS)
bsa_select(const double* __restrict__ pooled, int* __restrict__ lists, const int* __restrict__ cu_q,
           const int* __restrict__ cu_k, const BsaParams params COVARIANCE_ARGS) {
    const FlashParams& fp = params.flash;
    const int a = params.first_query_block + blockIdx.x, kv = blockIdx.y, seq = blockIdx.z;
    const int d = fp.d;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    double* q_sum = reinterpret_cast<double*>(smem_raw);              // [d]
    double* scores = q_sum + d;                                       // [n_key_blocks]
    unsigned char* chosen = reinterpret_cast<unsigned char*>(scores + params.n_key_blocks);  // [n_key_blocks]
    __shared__ double best_s[SEL_WARPS];
    __shared__ int best_i[SEL_WARPS];
    __shared__ int written;

    int* list = lists + (((long long)seq * params.n_heads_kv + kv) * params.n_query_blocks + a) * params.top_k;
    int len_q, len_k;
    sequence_lengths(fp, cu_q, cu_k, seq, len_q, len_k);
    const SelectionRange range = selection_range(params, a, len_q, len_k);
    const int eligible = range.eligible;
    if (eligible > 0) {
        for (int c = threadIdx.x; c < d; c += SEL_THREADS) q_sum[c] = group_query_sum(pooled, params, seq, kv, a, c);
    }
    for (int b = threadIdx.x; b < eligible; b += SEL_THREADS) chosen[b] = 0;
    __syncthreads();

    // The scores, SEL_KEYS_PER_WARP key blocks per warp at a time: for each block, the dot product (a lane's columns
    // ascending, then the shuffle tree) and the scale, exactly as one block at a time would compute it; the blocks
    // are interleaved only so that each lane has that many independent loads of pooled keys in flight (one block at
    // a time left a lane four loads deep at d = 128; eight blocks took 12% off the selector's time at L = 256K).
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const double* k_pool = pooled + ((long long)seq * params.n_heads_kv + kv) * params.n_key_blocks * d;
    for (int base = warp * SEL_KEYS_PER_WARP; base < eligible; base += SEL_WARPS * SEL_KEYS_PER_WARP) {
        double part[SEL_KEYS_PER_WARP];
        int row[SEL_KEYS_PER_WARP];
#pragma unroll
        for (int i = 0; i < SEL_KEYS_PER_WARP; ++i) {
            part[i] = 0.0;
            row[i] = min(base + i, eligible - 1);
        }
#pragma unroll 4
        for (int c = lane; c < d; c += 32) {
            const double qc = q_sum[c];
#pragma unroll
            for (int i = 0; i < SEL_KEYS_PER_WARP; ++i) part[i] = fma(qc, k_pool[(long long)row[i] * d + c], part[i]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int i = 0; i < SEL_KEYS_PER_WARP; ++i) part[i] += __shfl_xor_sync(0xffffffffu, part[i], o);
        }
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < SEL_KEYS_PER_WARP; ++i)
                if (base + i < eligible) scores[base + i] = WITH_COVARIANCE(params.scale * part[i], a, base + i);
        }
    }

    // Forced blocks, then top-k rounds over the rest.
    if (range.first && threadIdx.x == 0) chosen[0] = 1;
    for (int b = range.local_from + threadIdx.x; b < eligible; b += SEL_THREADS) chosen[b] = 1;
    __syncthreads();
    for (int round = 0; round < range.room; ++round) {
        double s;
        int i;
        warp_best_unchosen(scores, chosen, threadIdx.x, eligible, SEL_THREADS, s, i);
        if (lane == 0) {
            best_s[warp] = s;
            best_i[warp] = i;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double bs = best_s[0];
            int bi = best_i[0];
            for (int w = 1; w < SEL_WARPS; ++w) {
                if (better(best_s[w], best_i[w], bs, bi)) {
                    bs = best_s[w];
                    bi = best_i[w];
                }
            }
            if (bi >= 0) chosen[bi] = 1;
        }
        __syncthreads();
    }

    // The list, ascending: warp 0 compacts the chosen flags 32 blocks at a time, then everyone pads.
    if (warp == 0) {
        int count = 0;
        for (int base = 0; base < eligible; base += 32) {
            const int b = base + lane;
            const bool take = b < eligible && chosen[b];
            const unsigned mask = __ballot_sync(0xffffffffu, take);
            const int slot = count + __popc(mask & ((1u << lane) - 1u));
            // The rounds choose at most top_k blocks; the guard keeps a wrong count from writing past the list.
            if (take && slot < params.top_k) list[slot] = b;
            count += __popc(mask);
        }
        if (lane == 0) written = min(count, params.top_k);
    }
    __syncthreads();
    for (int w = written + threadIdx.x; w < params.top_k; w += SEL_THREADS) list[w] = -1;
}

// ---------------------------------------------------------------------------------------------------------------------
// bsa_select_stream: the same lists for top_k <= STREAM_MAX_TOP_K, without holding a query block's scores.
//
// One CTA per STREAM_QUERIES consecutive query blocks of one (KV head, sequence). It walks the eligible key blocks in
// tiles of STREAM_KEYS: the tile's pooled keys go to shared memory once for all the CTA's query blocks (where
// bsa_select reads every pooled key once per query block, which bounds it by the L2's bandwidth), each warp scores
// 8 key blocks of the tile against the 8 query blocks, and each query block's warp merges the tile's scores
// into a running list of its best `room` candidates, one per lane, in registers. Nothing but the current tile's
// scores is ever stored. The merge keeps exactly the `room` best candidates seen so far in the order of `better`, so
// the final list does not depend on the order candidates arrive in: it is the top-k rounds' choice.
//
// The dot product of query block a and key block b is one f64 tensor-core accumulation over the columns in steps of
// 4, ascending (PTX's mma.m8n8k4 .f64: IEEE double, round to nearest), then the scale: a fixed evaluation that does
// not depend on the blocks' positions in the tile, so bitwise equal key blocks still score bitwise equal (the scores
// may differ from bsa_select's in their last bits, both inside the bound of proofs/src/bsa_bound.rs, which assumes no
// order and at most one rounding per operation).
#define STREAM_THREADS 256
#define STREAM_WARPS (STREAM_THREADS / 32)
#define STREAM_QUERIES 8
#define STREAM_KEYS 64
#define STREAM_MAX_TOP_K 32
#define STREAM_PAD 2  // f64 after each row of the query and key tiles: 16-byte rows that do not share banks

// Offers each lane's candidate (score s, key block i; `offer` false for none) to the warp's list of the `room` best so
// far: lane l holds the l-th best (ls, li), `count` of them, in the order of `better`. Once the list is full only the
// candidates better than its last entry are taken up, one at a time in ascending lane order, each checked again
// against the last entry as it stands then; after the first tiles few are.
__device__ __forceinline__ void stream_offer(double s, int i, bool offer, int room, double& ls, int& li, int& count) {
    if (room == 0) return;
    const int lane = threadIdx.x % 32;
    double last_s = __shfl_sync(0xffffffffu, ls, room - 1);
    int last_i = __shfl_sync(0xffffffffu, li, room - 1);
    unsigned pending = __ballot_sync(0xffffffffu, offer && s == s && (count < room || better(s, i, last_s, last_i)));
    while (pending) {
        const int src = __ffs(pending) - 1;
        pending &= pending - 1;
        const double cs = __shfl_sync(0xffffffffu, s, src);
        const int ci = __shfl_sync(0xffffffffu, i, src);
        if (count == room && !better(cs, ci, last_s, last_i)) continue;
        // The entries better than the candidate are a prefix of the list; the candidate goes after them.
        const int at = __popc(__ballot_sync(0xffffffffu, lane < count && better(ls, li, cs, ci)));
        const double up_s = __shfl_up_sync(0xffffffffu, ls, 1);
        const int up_i = __shfl_up_sync(0xffffffffu, li, 1);
        if (lane > at) {
            ls = up_s;
            li = up_i;
        }
        if (lane == at) {
            ls = cs;
            li = ci;
        }
        count = min(count + 1, room);
        last_s = __shfl_sync(0xffffffffu, ls, room - 1);
        last_i = __shfl_sync(0xffffffffu, li, room - 1);
    }
}

extern "C" __global__ void __launch_bounds__(STREAM_THREADS)
bsa_select_stream(const double* __restrict__ pooled, int* __restrict__ lists, const int* __restrict__ cu_q,
                  const int* __restrict__ cu_k, const BsaParams params COVARIANCE_ARGS) {
    const FlashParams& fp = params.flash;
    const int kv = blockIdx.y, seq = blockIdx.z, d = fp.d, row = d + STREAM_PAD;
    // Under the causal mask the last query blocks see the most key blocks: the grid's first CTAs take them, so that
    // the heaviest start first (a chunk's first query block is a multiple of STREAM_QUERIES).
    const int a0 = params.first_query_block + (gridDim.x - 1 - blockIdx.x) * STREAM_QUERIES;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    double* q_tile = reinterpret_cast<double*>(smem_raw);  // [STREAM_QUERIES][row]
    double* k_tile = q_tile + STREAM_QUERIES * row;          // [STREAM_KEYS][row]
    double* tile_scores = k_tile + STREAM_KEYS * row;        // [STREAM_QUERIES][STREAM_KEYS]
    __shared__ SelectionRange ranges[STREAM_QUERIES];

    int len_q, len_k;
    sequence_lengths(fp, cu_q, cu_k, seq, len_q, len_k);
    if (threadIdx.x < STREAM_QUERIES) ranges[threadIdx.x] = selection_range(params, a0 + threadIdx.x, len_q, len_k);
    for (int e = threadIdx.x; e < STREAM_QUERIES * d; e += STREAM_THREADS) {
        const int j = e / d, c = e % d, a = a0 + j;
        q_tile[j * row + c] = (a < params.n_query_blocks && a * params.q_block < len_q)
                                  ? group_query_sum(pooled, params, seq, kv, a, c)
                                  : 0.0;
    }
    __syncthreads();
    int key_end = 0;  // the key blocks any of the CTA's query blocks may choose
#pragma unroll
    for (int j = 0; j < STREAM_QUERIES; ++j) key_end = max(key_end, ranges[j].local_from);

    // Warp w keeps the list of query block w.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    double best_s[STREAM_QUERIES / STREAM_WARPS];
    int best_i[STREAM_QUERIES / STREAM_WARPS], count[STREAM_QUERIES / STREAM_WARPS];
#pragma unroll
    for (int m = 0; m < STREAM_QUERIES / STREAM_WARPS; ++m) {
        best_s[m] = 0.0;
        best_i[m] = -1;
        count[m] = 0;
    }
    const double* k_pool = pooled + ((long long)seq * params.n_heads_kv + kv) * params.n_key_blocks * d;
    // Warp w scores key blocks [8w, 8w + 8) of each tile against the CTA's 8 query blocks as one f64 tensor-core
    // product (mma.m8n8k4.f64, an 8 × 8 tile per warp): A the query tile, row g = lane / 4; B the warp's 8 key rows;
    // the columns in steps of 4, ascending. Lane (g, t) ends with the scores of query block g against key blocks
    // 8w + 2t and 8w + 2t + 1. At d = 128 that is 32 instructions and 64 shared-memory loads per warp and tile, where
    // an fma chain per (query, key) pair took 16 times the loads (the kernel was bound by their latency).
    const int g = lane >> 2, t = lane & 3;
    for (int tile0 = 0; tile0 < key_end; tile0 += STREAM_KEYS) {
        const int tile_rows = min(STREAM_KEYS, key_end - tile0);
        // The tile's pooled keys, 16 bytes per copy, all in flight at once (rows past the range read as zeros).
        for (int e = threadIdx.x; e < STREAM_KEYS * (d / 2); e += STREAM_THREADS) {
            const int r = e / (d / 2), c = 2 * (e % (d / 2));
            const bool valid = r < tile_rows;
            cp_async_16(k_tile + r * row + c, k_pool + (long long)(valid ? tile0 + r : 0) * d + c, valid);
        }
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
        {
            const double* q_row = q_tile + g * row + t;
            const double* k_row = k_tile + (8 * warp + g) * row + t;
            double acc[2] = {0.0, 0.0};
#pragma unroll 8
            for (int c = 0; c < d; c += 4) {
                const double a = q_row[c], b = k_row[c];
                asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
                    : "+d"(acc[0]), "+d"(acc[1])
                    : "d"(a), "d"(b));
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                // The spread term only where it is read: a key block in the range and a query block of the grid.
                const int key = 8 * warp + 2 * t + r;
                const int a = a0 + g, b = tile0 + key;
                const bool scored = b < key_end && a < params.n_query_blocks;
                const double pooled_score = params.scale * acc[r];
                tile_scores[g * STREAM_KEYS + key] = scored ? WITH_COVARIANCE(pooled_score, a, b) : pooled_score;
            }
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < STREAM_QUERIES / STREAM_WARPS; ++m) {
            const SelectionRange range = ranges[warp + STREAM_WARPS * m];
#pragma unroll
            for (int half = 0; half < STREAM_KEYS / 32; ++half) {
                const int j = 32 * half + lane, b = tile0 + j;
                const double s = tile_scores[(warp + STREAM_WARPS * m) * STREAM_KEYS + j];
                stream_offer(s, b, b >= range.first && b < range.local_from, range.room, best_s[m], best_i[m],
                             count[m]);
            }
        }
        __syncthreads();  // the next tile overwrites the keys and the scores
    }

    // The lists, ascending: the forced first block, the chosen ones by rank, the forced local blocks, then -1.
#pragma unroll
    for (int m = 0; m < STREAM_QUERIES / STREAM_WARPS; ++m) {
        const int a = a0 + warp + STREAM_WARPS * m;
        if (a >= params.n_query_blocks) continue;
        const SelectionRange range = ranges[warp + STREAM_WARPS * m];
        int* list = lists + (((long long)seq * params.n_heads_kv + kv) * params.n_query_blocks + a) * params.top_k;
        int rank = range.first;
        for (int t = 0; t < count[m]; ++t) rank += __shfl_sync(0xffffffffu, best_i[m], t) < best_i[m];
        // The guards keep a wrong count from writing past the list.
        if (lane < count[m] && rank < params.top_k) list[rank] = best_i[m];
        if (lane == 0 && range.first) list[0] = 0;
        const int local_at = range.first + count[m];
        for (int t = lane; t < range.eligible - range.local_from; t += 32) {
            if (local_at + t < params.top_k) list[local_at + t] = range.local_from + t;
        }
        const int written = min(local_at + range.eligible - range.local_from, params.top_k);
        for (int w = written + lane; w < params.top_k; w += 32) list[w] = -1;
    }
}
