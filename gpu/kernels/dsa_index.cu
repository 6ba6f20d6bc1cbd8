// DSA's lightning indexer (E16) fused with an exact causal top-k, compiled by NVRTC after common.cuh and sm90.cuh with
// INDEX_DIM (d_I: 64 or 128), IDX_CTAS_PER_SM and the element type's define (IDX_MMA_SYNC optional, below). The host
// wrapper is gpu/src/dsa/index.rs, which documents the scores' rounding bound (attnproof_proofs::dsa_bound) and
// checks every shape before the launch.
//
// One kernel, dsa_index_topk: a persistent grid of CTAs of 256 threads; CTA c takes the query groups c, c + grid, …
// of IDX_QUERIES = 4 consecutive tokens. For one group:
//   1. Scores. The group's indexer queries (4 tokens × 64 head rows; heads past H_I are zero rows with weight 0) stay
//      in shared memory, the keys 0 … t_last stream through in tiles of 64 (two cp.async stages). Warp w owns rows
//      32w … 32w + 31 (token w / 2, heads 32·(w % 2) …): logits on tensor cores with f32 accumulation over d_I, by
//      warpgroup MMA on Hopper (sm_90a: wgmma.m64n64k16 from swizzled shared memory, the query rows stored in the
//      order that gives each warp exactly these rows) and by mma.sync.m16n8k16 elsewhere, then per key
//      Σ w_a · ReLU(logit_a) over its rows (a thread's four rows in ascending order, then a xor-shuffle
//      tree over the eight row groups), and the token's two warps' sums are added, warp 2j's first, plus +0.0 (so
//      that −0 becomes +0: equal scores have equal bits). The order depends on nothing but the head, so two keys with
//      equal rows get bitwise equal scores. Each visible score (key ≤ token) is written to the token's row of the f32
//      scratch in device memory: one row per query of a resident CTA, or with full_scores one row per token (the
//      caller's [T, stride] score matrix, for a verifier or the indexer loss).
//   2. Exact top-k per token, from its scratch row (the CTA's own writes, ordered by a barrier). With n = t + 1 ≤ k
//      visible keys the row is 0 … t, then −1. Otherwise a radix select over the scores' order-preserving 32-bit keys
//      (order_key), 11 + 11 + 10 bits from the top: a shared-memory histogram of the keys that match the prefix found
//      so far, then the bin where the count from the top reaches what is still needed. It stops early when that bin
//      holds exactly what is needed. Last, one ascending pass writes the keys above the threshold and, of the keys
//      equal to it (in the bits examined), the first ones in index order: ties go to the lower index, and the row is
//      ascending with exactly k entries.
//
// Memory: nothing of size T × T unless the caller asks for the full scores; the scratch is grid × 4 rows of T floats,
// read back by the CTA that wrote them (from L2 while it fits). Shared memory holds the query tile, two key tiles
// and the histogram's words; the wgmma path's tiles are in sm90.cuh's 128-byte swizzle (64-column chunks, each on a
// 1024-byte boundary: the kernel aligns the window itself, and the host's byte count, sized for the other path's
// padded rows, leaves the up to 1024 bytes that takes).
//
// Two CTAs per multiprocessor (IDX_CTAS_PER_SM, the host's resident_ctas): a CTA's selection is serial behind its own
// scoring and leaves the tensor cores idle, so a second resident CTA scores while the first selects. For both to fit
// (at d_I = 128, 110 KB of shared memory each and at most 128 registers per thread) the scoring's weights and partial
// sums share their bytes with the selection's histogram: the scoring of a group ends, and the next begins, behind a
// barrier, so the two never hold those bytes at once.

#define IDX_THREADS 256
#define IDX_WARPS (IDX_THREADS / 32)
#define IDX_QUERIES 4
#define IDX_HEAD_ROWS 64
#define IDX_ROWS (IDX_QUERIES * IDX_HEAD_ROWS)
#define IDX_KEYS 64
#define RADIX_BINS 2048
#define SELECT_ELEMS 8  // consecutive scores per thread in the output pass

#ifndef INDEX_DIM
#error "define INDEX_DIM (64 or 128)"
#endif
#ifndef IDX_CTAS_PER_SM
#error "define IDX_CTAS_PER_SM (the host's CTAS_PER_SM)"
#endif
static_assert(INDEX_DIM == 64 || INDEX_DIM == 128, "the indexer's head dim is 64 or 128");
static_assert(IDX_ROWS == IDX_WARPS * 32, "every warp owns 32 query rows");
// Warpgroup MMA for the logits where the target has it (sm_90a alone defines the macro), unless the host asks for
// mma.sync (IDX_MMA_SYNC: the other architectures' path, verified and timed on Hopper).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(IDX_MMA_SYNC)
#define IDX_WGMMA 1
#endif
#define IDX_STRIDE (INDEX_DIM + 8)  // padded row of the mma.sync path's tiles (elements)
#define IDX_CHUNKS (INDEX_DIM / 64)  // 64-column chunks of a swizzled row (the wgmma path, sm90.cuh)
#define IDX_Q_BYTES (IDX_ROWS * IDX_CHUNKS * SW_ROW)
#define IDX_K_BYTES (IDX_KEYS * IDX_CHUNKS * SW_ROW)

// A key whose unsigned order is the float order: larger scores get larger keys (−0 never reaches here).
__device__ __forceinline__ unsigned order_key(float x) {
    const unsigned u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The exclusive prefix sum of x over the CTA's threads in thread order, and in `total` the sum over all of them.
// Every thread must call it (it holds two barriers).
__device__ __forceinline__ int cta_exclusive_scan(int x, int* warp_sums, int& total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int inclusive = warp_inclusive_sum(x);
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    int before = 0;
    total = 0;
#pragma unroll
    for (int w = 0; w < IDX_WARPS; ++w) {
        const int s = warp_sums[w];
        if (w < warp) before += s;
        total += s;
    }
    __syncthreads();
    return before + inclusive - x;
}

// Writes the top-k of a score row of n visible keys to `out` (k entries, ascending, ties to the lower index; −1 past
// n when n ≤ k). Every thread of the CTA calls it with the same arguments.
__device__ void select_row(const float* row, int n, int top_k, int* __restrict__ out, unsigned* hist, int* found,
                           int* warp_sums) {
    const int tid = threadIdx.x;
    if (n <= top_k) {
        for (int i = tid; i < top_k; i += IDX_THREADS) out[i] = i < n ? i : -1;
        return;
    }
    unsigned prefix = 0, mask = 0;
    int remaining = top_k;  // how many of the keys that match the prefix are still to be taken
#pragma unroll 1
    for (int level = 0; level < 3; ++level) {
        const int shift = level == 0 ? 21 : level == 1 ? 10 : 0;
        const unsigned bins = level == 2 ? 1023u : 2047u;
        for (int b = tid; b < RADIX_BINS; b += IDX_THREADS) hist[b] = 0;
        __syncthreads();
        for (int s = tid; s < n; s += IDX_THREADS) {
            const unsigned u = order_key(row[s]);
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & bins], 1u);
        }
        __syncthreads();
        if (tid < 32) {
            // Lane L counts bins 64L … 64L + 63; the suffix sums over lanes say which lane holds the threshold bin.
            int own = 0;
            for (int b = 0; b < 64; ++b) own += (int)hist[tid * 64 + b];
            int suffix = own;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int v = __shfl_down_sync(0xffffffffu, suffix, off);
                if (tid + off < 32) suffix += v;
            }
            int above = suffix - own;
            if (above < remaining && remaining <= suffix) {
                for (int b = tid * 64 + 63; b >= tid * 64; --b) {
                    const int c = (int)hist[b];
                    if (above + c >= remaining) {
                        found[0] = b;
                        found[1] = above;
                        found[2] = c;
                        break;
                    }
                    above += c;
                }
            }
        }
        __syncthreads();
        const int bin = found[0], above = found[1], count = found[2];
        prefix |= (unsigned)bin << shift;
        mask |= bins << shift;
        remaining -= above;
        if (count == remaining) break;  // the whole bin is taken: no tie left to break
    }
    // Keys above the threshold are taken; of those equal to it, the first `remaining` in index order.
    int written = 0, equal_seen = 0;
#pragma unroll 1
    for (int base = 0; base < n; base += IDX_THREADS * SELECT_ELEMS) {
        const int s0 = base + tid * SELECT_ELEMS;
        unsigned masked[SELECT_ELEMS];
        int n_equal = 0;
#pragma unroll
        for (int e = 0; e < SELECT_ELEMS; ++e) {
            const int s = s0 + e;
            masked[e] = s < n ? (order_key(row[s]) & mask) : 0u;
            n_equal += (s < n && masked[e] == prefix) ? 1 : 0;
        }
        int total;
        int equal_rank = equal_seen + cta_exclusive_scan(n_equal, warp_sums, total);
        equal_seen += total;
        unsigned taken = 0;
        int n_taken = 0;
#pragma unroll
        for (int e = 0; e < SELECT_ELEMS; ++e) {
            if (s0 + e >= n) continue;
            bool take = masked[e] > prefix;
            if (masked[e] == prefix) take = equal_rank++ < remaining;
            if (take) {
                taken |= 1u << e;
                ++n_taken;
            }
        }
        int position = written + cta_exclusive_scan(n_taken, warp_sums, total);
        written += total;
#pragma unroll
        for (int e = 0; e < SELECT_ELEMS; ++e) {
            if ((taken >> e) & 1u) out[position++] = s0 + e;
        }
    }
}

#if defined(IDX_WGMMA)
typedef unsigned char idx_tile_t;  // swizzled bytes
#define IDX_Q_TILE IDX_Q_BYTES
#define IDX_K_TILE IDX_K_BYTES
#else
typedef elem_t idx_tile_t;  // padded rows of IDX_STRIDE elements
#define IDX_Q_TILE (IDX_ROWS * IDX_STRIDE)
#define IDX_K_TILE (IDX_KEYS * IDX_STRIDE)
#endif

// Starts copying the group's query rows (tokens t0 … t0 + nq − 1, heads 0 … H − 1; zeros for the rest) into the
// query tile, so that warp w's rows 32w + 16m + g and + 8 (token w / 2, head 32·(w % 2) + 16m + g and + 8) are where
// the MMA of tile_logits takes them from.
__device__ __forceinline__ void load_query_tile(idx_tile_t* q_s, const elem_t* __restrict__ q, int t0, int nq, int H) {
    constexpr int UNITS = INDEX_DIM / 8;  // 16-byte units per row
    for (int idx = threadIdx.x; idx < IDX_ROWS * UNITS; idx += IDX_THREADS) {
        const int R = idx / UNITS, u = idx % UNITS;
#if defined(IDX_WGMMA)
        // Row R is row 16i + r of the tile's 64-row block b = R / 64, which warpgroup b / 2 multiplies as its
        // m-block b % 2: wgmma hands its warp i the rows 16i + g and + 8, so the row holds warp w = 4·(b / 2) + i's
        // head 32·(w % 2) + 16·(b % 2) + r of token w / 2.
        const int b = R / 64, i = (R % 64) / 16, r = R % 16;
        const int w = 4 * (b / 2) + i;
        const int qi = w / 2, h = 32 * (w % 2) + 16 * (b % 2) + r;
        elem_t* dst = reinterpret_cast<elem_t*>(q_s + (u / 8) * (IDX_ROWS * SW_ROW) + R * SW_ROW +
                                                swizzled_unit(u, R));
#else
        const int qi = R / IDX_HEAD_ROWS, h = R % IDX_HEAD_ROWS;
        elem_t* dst = q_s + R * IDX_STRIDE + u * 8;
#endif
        const bool valid = qi < nq && h < H;
        const long long at = valid ? ((long long)(t0 + qi) * H + h) * INDEX_DIM + u * 8 : 0;
        cp_async_16(dst, q + at, valid);
    }
}

// Starts copying `rows` keys from `k` into a key tile (zeros past them).
__device__ __forceinline__ void load_key_tile(idx_tile_t* k_s, const elem_t* __restrict__ k, int rows) {
#if defined(IDX_WGMMA)
    load_swizzled_async<IDX_KEYS, IDX_CHUNKS, IDX_THREADS>(k_s, k, INDEX_DIM, rows, INDEX_DIM);
#else
    load_tile_async<IDX_KEYS, INDEX_DIM, IDX_STRIDE, IDX_THREADS>(k_s, k, INDEX_DIM, rows, INDEX_DIM);
#endif
}

// Waits for this thread's copies and makes everyone's visible to the whole CTA (and, on the wgmma path, to the
// tensor cores' reads of shared memory). Every thread calls it.
__device__ __forceinline__ void key_tile_landed() {
    cp_async_wait_all();
#if defined(IDX_WGMMA)
    fence_proxy_async();
#endif
    __syncthreads();
}

// Starts the logits of the warp's 32 query rows against a key tile's 64 keys: acc[m][n] is the m16n8 fragment of
// rows 32·warp + 16m + (g, g + 8) and keys 8n + 2·tig (+ 1), each logit accumulated in f32 over the k-steps of 16
// columns in order. On the wgmma path the products run asynchronously: wait_logits<1>() before reading acc[0],
// wait_logits<0>() before acc[1]; on the mma.sync path they are done when this returns.
__device__ __forceinline__ void tile_logits(float (&acc)[2][IDX_KEYS / 8][4], const idx_tile_t* q_s,
                                            const idx_tile_t* k_s) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#if defined(IDX_WGMMA)
    const unsigned q_addr = smem_u32(q_s) + (warp / 4) * 2 * 64 * SW_ROW, k_addr = smem_u32(k_s);
    wgmma_fence();
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int kk = 0; kk < INDEX_DIM / 16; ++kk) {
            const unsigned step = (kk / 4) * (IDX_ROWS * SW_ROW) + (kk % 4) * 32;
            wgmma_ss_m64n64k16<0, 0>(acc[m], smem_desc(q_addr + m * 64 * SW_ROW + step, 16, 1024),
                                     smem_desc(k_addr + (kk / 4) * (IDX_KEYS * SW_ROW) + (kk % 4) * 32, 16, 1024),
                                     kk > 0);
        }
        wgmma_commit();
    }
#else
    const unsigned q_lane = smem_u32(q_s) + (warp * 32 * IDX_STRIDE + lane_a(lane, IDX_STRIDE)) * ESZ;
    const unsigned k_lane = smem_u32(k_s) + lane_b(lane, IDX_STRIDE) * ESZ;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < IDX_KEYS / 8; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;
#pragma unroll
    for (int m = 0; m < 2; ++m)
        warp_mma_nt<INDEX_DIM / 16, IDX_KEYS / 16, IDX_STRIDE>(acc[m], q_lane + m * 16 * IDX_STRIDE * ESZ, k_lane);
#endif
}
template <int PENDING>
__device__ __forceinline__ void wait_logits() {
#if defined(IDX_WGMMA)
    wgmma_wait<PENDING>();
#endif
}

// q [T, H_I, d_I] and k [T, d_I] of the element type, w [T, H_I] f32, lists [T, top_k] i32, scratch f32 rows of
// scratch_stride elements (grid × IDX_QUERIES rows, or T rows with full_scores).
extern "C" __global__ void __launch_bounds__(IDX_THREADS, IDX_CTAS_PER_SM)
dsa_index_topk(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const float* __restrict__ w,
               int* __restrict__ lists, float* scratch, const DsaIndexParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
#if defined(IDX_WGMMA)
    // The swizzled tiles start on a 1024-byte boundary.
    idx_tile_t* q_s = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
#else
    idx_tile_t* q_s = reinterpret_cast<idx_tile_t*>(smem_raw);
#endif
    idx_tile_t* k_s = q_s + IDX_Q_TILE;  // two stages
    // The scoring's weights and partial sums, then (the same bytes) the selection's histogram.
    unsigned char* phase_s = reinterpret_cast<unsigned char*>(k_s + 2 * IDX_K_TILE);
    float* w_s = reinterpret_cast<float*>(phase_s);            // [IDX_ROWS], scoring
    float* part_s = w_s + IDX_ROWS;                            // [IDX_WARPS][IDX_KEYS], scoring
    unsigned* hist = reinterpret_cast<unsigned*>(phase_s);     // [RADIX_BINS], selection
    static_assert(IDX_ROWS + IDX_WARPS * IDX_KEYS <= RADIX_BINS, "the scoring's words fit in the histogram's");
    int* warp_sums = reinterpret_cast<int*>(hist + RADIX_BINS);  // [IDX_WARPS]
    int* found = warp_sums + IDX_WARPS;                          // [4]

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, tig = lane % 4;
    const int T = p.seq_len, H = p.n_heads;
    const long long stride = p.scratch_stride;

#pragma unroll 1
    for (int group = blockIdx.x; group < p.n_groups; group += gridDim.x) {
        const int t0 = group * IDX_QUERIES;
        const int nq = min(IDX_QUERIES, T - t0);
        const int t_last = t0 + nq - 1;
        float* rows = scratch + (long long)(p.full_scores ? t0 : blockIdx.x * IDX_QUERIES) * stride;
        // The previous group's selection has read its rows and shared memory (the histogram, whose bytes the
        // weights below take).
        __syncthreads();
        if (p.full_scores || t_last + 1 > p.top_k) {
            load_query_tile(q_s, q, t0, nq, H);
            for (int r = tid; r < IDX_ROWS; r += IDX_THREADS) {
                const int qi = r / IDX_HEAD_ROWS, h = r % IDX_HEAD_ROWS;
                w_s[r] = (qi < nq && h < H) ? w[(long long)(t0 + qi) * H + h] : 0.f;
            }
            const int n_tiles = t_last / IDX_KEYS + 1;
            load_key_tile(k_s, k, min(IDX_KEYS, t_last + 1));
            cp_async_commit();
#pragma unroll 1
            for (int j = 0; j < n_tiles; ++j) {
                key_tile_landed();  // tile j is in; every warp is done with tile j − 1's stage and sums
                if (j + 1 < n_tiles) {
                    const int key0 = (j + 1) * IDX_KEYS;
                    load_key_tile(k_s + ((j + 1) & 1) * IDX_K_TILE, k + (long long)key0 * INDEX_DIM,
                                  min(IDX_KEYS, t_last + 1 - key0));
                }
                cp_async_commit();
                float acc[2][IDX_KEYS / 8][4];
                tile_logits(acc, q_s, k_s + (j & 1) * IDX_K_TILE);
                // The thread's rows: 32·warp + 16m + g and + 8. The first m-block's terms are summed while the
                // second's product may still run.
                const float w00 = w_s[warp * 32 + g], w01 = w_s[warp * 32 + g + 8];
                const float w10 = w_s[warp * 32 + 16 + g], w11 = w_s[warp * 32 + 24 + g];
                float v[IDX_KEYS / 8][2];
                wait_logits<1>();
#pragma unroll
                for (int n = 0; n < IDX_KEYS / 8; ++n) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        v[n][c] = w00 * fmaxf(acc[0][n][c], 0.f);
                        v[n][c] += w01 * fmaxf(acc[0][n][2 + c], 0.f);
                    }
                }
                wait_logits<0>();
#pragma unroll
                for (int n = 0; n < IDX_KEYS / 8; ++n) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        float x = v[n][c];
                        x += w10 * fmaxf(acc[1][n][c], 0.f);
                        x += w11 * fmaxf(acc[1][n][2 + c], 0.f);
                        x += __shfl_xor_sync(0xffffffffu, x, 4);
                        x += __shfl_xor_sync(0xffffffffu, x, 8);
                        x += __shfl_xor_sync(0xffffffffu, x, 16);
                        if (g == 0) part_s[warp * IDX_KEYS + n * 8 + 2 * tig + c] = x;
                    }
                }
                __syncthreads();
                {
                    const int qi = tid / IDX_KEYS, col = tid % IDX_KEYS, key = j * IDX_KEYS + col;
                    if (qi < nq && key <= t0 + qi) {
                        const float score =
                            (part_s[(2 * qi) * IDX_KEYS + col] + part_s[(2 * qi + 1) * IDX_KEYS + col]) + 0.f;
                        rows[qi * stride + key] = score;
                    }
                }
            }
            // The scores are written: the selection below reads them, and its histogram takes the bytes of the
            // weights and partial sums, which no thread reads any more.
            __syncthreads();
        }
        for (int qi = 0; qi < nq; ++qi) {
            select_row(rows + qi * stride, t0 + qi + 1, p.top_k, lists + (long long)(t0 + qi) * p.top_k, hist, found,
                       warp_sums);
        }
    }
}
