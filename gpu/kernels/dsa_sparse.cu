// DSA's token-sparse attention forward (E16's main attention over the selected tokens, drop-and-renormalize) on tensor
// cores, compiled by NVRTC after common.cuh (gpu/src/dsa/sparse.rs).
//
// Every token t attends, for each query head of a KV head's group, to the tokens its list names (lists
// [token rows, list heads, top_k] i32 from dsa_index.cu's dsa_index_topk or from the caller: ascending, −1-padded,
// every entry at most t; one list head shared by every KV head, as DSA's indexer writes them, or one per KV head), with
// one softmax over them; outputs O (the layer's layout) and LSE.
//
// One CTA of SPARSE_ROWS / 16 warps per (token, chunk of SPARSE_ROWS query heads of a KV head's group, sequence):
// its rows are the chunk's heads of that one token, so each gathered K and V row is loaded once for all of them (the
// MQA sharing of FlashMLA's sparse kernel; a group above 64 heads, MLA's 128, takes several chunks, each loading the
// rows again). Groups of fewer than 16 heads leave rows of the warp idle: the kernel is bound by the gather, not the
// products, there. The CTA walks its token's list in tiles of 64 consecutive entries, gathering the 64 listed K rows
// into one tile, then the V rows, with flash_fwd.cu's pipeline (WARP_M = 1): V_t is fetched during S = Q K_tᵀ and the
// softmax, K_{t+1} during O += P V_t. So a row performs the dense forward's operations over ⌈n/64⌉ tiles, the last one
// masked past the list's end: the bound is the dense forward's with one rescale per visited tile.
//
// The host validated the lists it was given; lists on the device are read defensively all the same: a list ends at
// its first entry that does not rise or lies after its token (nsa_selected.cu's rule, with t + 1 in place of the
// block count), so no list can send the kernel outside its sequence's keys, to a future key, or read a row twice.
//
// On Hopper (SPARSE_WGMMA, the host's choice for sm_90a where a CTA holds 64 heads and d, dv round up to 64 or 128)
// the same CTA is one warpgroup and its products run on wgmma, as flash_fwd_sm90.cu's cp.async path runs them: the
// tiles in sm90.cuh's 128-byte swizzle (the gathered rows copied into it by load_swizzled_rows_async), two stages of K
// and of V, S_i = Q K_iᵀ by m64n64k16 from shared memory, then O += P_{i−1} V_{i−1} from registers while the
// softmax of S_i runs; iteration i starts copying K_{i+1} and V_i, so each gathered tile has a whole iteration to
// land. A row goes through the same sequence A ← r_i·A + round_T(P_i)·V_i over the same 64-slot tiles, so the
// bound is unchanged. Rows past the chunk's heads are zero-filled queries: the warpgroup computes them and
// write_rows drops them.
//
// Compile-time parameters: ELEM_BF16 or ELEM_F16; HEAD_DIM_PAD and HEAD_DIM_V_PAD, d and dv rounded up to a multiple
// of 16, as in flash_fwd.cu (to 64 or 128 with SPARSE_WGMMA); SPARSE_ROWS, the query heads per CTA (16, 32, 48 or
// 64; 64 with SPARSE_WGMMA); SPARSE_WGMMA (optional, above).
//
// Arguments: Q, K, V, O, LSE, the lists, cu_seqlens of the queries and keys, and DsaSparseParams (common.cuh).

#ifndef HEAD_DIM_PAD
#error "define HEAD_DIM_PAD"
#endif
#ifndef HEAD_DIM_V_PAD
#error "define HEAD_DIM_V_PAD"
#endif
#ifndef SPARSE_ROWS
#error "define SPARSE_ROWS"
#endif

#define SPARSE_THREADS (2 * SPARSE_ROWS)        // a warp per 16 rows
#define SPARSE_KEYS 64                          // gathered keys per tile
#define SPARSE_QK_STRIDE (HEAD_DIM_PAD + 8)     // shared row strides in elements (the padding spreads banks)
#define SPARSE_V_STRIDE (HEAD_DIM_V_PAD + 8)
#define SPARSE_N_TILES_O (HEAD_DIM_V_PAD / 8)

static_assert(SPARSE_ROWS % 16 == 0 && SPARSE_ROWS >= 16 && SPARSE_ROWS <= 64, "SPARSE_ROWS must be 16, 32, 48 or 64");
static_assert(HEAD_DIM_PAD % 16 == 0 && HEAD_DIM_PAD <= 256, "HEAD_DIM_PAD must be a multiple of 16 up to 256");
static_assert(HEAD_DIM_V_PAD % 16 == 0 && HEAD_DIM_V_PAD <= 256, "HEAD_DIM_V_PAD must be a multiple of 16 up to 256");
// SPARSE_WGMMA asks for the wgmma path, which only sm_90a has; other targets compile the mma.sync path (the host asks
// for it on compute capability 9.0 only, and the compile tests build every text for every target).
#if defined(SPARSE_WGMMA) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPARSE_ON_WGMMA 1
static_assert(SPARSE_ROWS == 64, "SPARSE_WGMMA's CTA is one warpgroup of 64 rows");
static_assert((HEAD_DIM_PAD == 64 || HEAD_DIM_PAD == 128) && (HEAD_DIM_V_PAD == 64 || HEAD_DIM_V_PAD == 128),
              "SPARSE_WGMMA takes d and dv padded to 64 or 128");
#define SPARSE_QK_BYTES (HEAD_DIM_PAD / 64 * SPARSE_KEYS * SW_ROW)  // a swizzled 64-row tile of d (Q, or a K stage)
#define SPARSE_V_BYTES (HEAD_DIM_V_PAD / 64 * SPARSE_KEYS * SW_ROW)  // a V stage

// Row r of a gathered tile: the key (or value) the list's slot r names.
struct GatheredRows {
    const elem_t* sequence;
    long long row_stride;
    const int* __restrict__ slots;
    __device__ __forceinline__ const elem_t* operator()(int r) const { return sequence + slots[r] * row_stride; }
};
// Issues O += round_T(P) V for one tile and commits it: `p` holds P as the A fragments of the tile's 4 k-steps of 16
// slots, `v_addr` the V stage (N-major: its leading offset is the distance between two 64-column chunks).
__device__ __forceinline__ void sparse_pv(float (&acc)[1][SPARSE_N_TILES_O][4], const unsigned (&p)[SPARSE_KEYS / 16][4],
                                          unsigned v_addr) {
#pragma unroll
    for (int kk = 0; kk < SPARSE_KEYS / 16; ++kk) {
        wgmma_rs_n<HEAD_DIM_V_PAD>(acc[0], p[kk], smem_desc(v_addr + kk * 16 * SW_ROW, SPARSE_KEYS * SW_ROW, 1024));
    }
    wgmma_commit();
}
#endif

// Where the CTA's rows go: row r is query head first_head + r of the token, the first `heads` rows only.
struct TokenHeads {
    int token, first_head, heads;
    __device__ __forceinline__ bool place(int row, OutputRow& out) const {
        out.head = first_head + row;
        out.position = token;
        return row < heads;
    }
};

// The online softmax of one gathered tile's scores (flash_fwd.cu's step): slots from `slot0`, the slots past the list's
// end (n_valid) masked in its last, partial tile. EverySlot (common.cuh) has no diagonal.
__device__ __forceinline__ void tile_softmax(float (&s)[1][SPARSE_KEYS / 8][4], float (&m_run)[1][2],
                                             float (&ml_run)[1][2], float (&l_part)[1][2], float (&rescale)[1][2],
                                             float scale, int slot0, int keys_here, int n_valid, int tig) {
    if (keys_here == SPARSE_KEYS) {
        softmax_scores<false>(s, m_run, ml_run, l_part, rescale, scale, slot0, n_valid, EverySlot{}, 0, NO_BOUND, 0,
                              tig);
    } else {
        softmax_scores<true>(s, m_run, ml_run, l_part, rescale, scale, slot0, n_valid, EverySlot{}, 0, NO_BOUND, 0,
                             tig);
    }
}

extern "C" __global__ void __launch_bounds__(SPARSE_THREADS)
dsa_sparse_fwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
               elem_t* __restrict__ o, float* __restrict__ lse, const int* __restrict__ lists,
               const int* __restrict__ cu_q, const int* __restrict__ cu_k, const DsaSparseParams params) {
    const FlashParams& fp = params.flash;
    const int group = fp.group, seq = blockIdx.z;
    const int kv = blockIdx.y / params.head_chunks, chunk = blockIdx.y % params.head_chunks;
    const int first_head = kv * group + chunk * SPARSE_ROWS;
    const int heads = min(SPARSE_ROWS, group - chunk * SPARSE_ROWS);
    ForwardCta cta;
    if (!forward_cta(cta, fp, q, k, v, cu_q, cu_k, seq, first_head, blockIdx.x, 1, SPARSE_KEYS)) return;
    const int token = cta.row0, top_k = params.top_k;
    const long long token_row = (fp.varlen ? (long long)cu_q[seq] : (long long)seq * fp.dense_len_q) + token;
    const int list_head = params.list_heads == 1 ? 0 : kv;
    const int* list = lists + (token_row * params.list_heads + list_head) * top_k;
    __shared__ int list_end;  // the list's valid prefix: its first slot that ends it

    // The Q tile of the chunk's heads starts loading before the list is read.
#if defined(SPARSE_ON_WGMMA)
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* q_s = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    unsigned char* k_s = q_s + SPARSE_QK_BYTES;      // two stages
    unsigned char* v_s = k_s + 2 * SPARSE_QK_BYTES;  // two stages
    load_swizzled_rows_async<SPARSE_ROWS, HEAD_DIM_PAD / 64, SPARSE_THREADS>(q_s, StridedRows{cta.q_g, fp.q_head},
                                                                            cta.q_g, heads, fp.d);
#else
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_s = reinterpret_cast<elem_t*>(smem_raw);  // [SPARSE_ROWS][SPARSE_QK_STRIDE]
    elem_t* k_s = q_s + SPARSE_ROWS * SPARSE_QK_STRIDE;  // [SPARSE_KEYS][SPARSE_QK_STRIDE]
    elem_t* v_s = k_s + SPARSE_KEYS * SPARSE_QK_STRIDE;  // [SPARSE_KEYS][SPARSE_V_STRIDE]
    load_group_rows_async<SPARSE_ROWS, HEAD_DIM_PAD, SPARSE_QK_STRIDE, SPARSE_THREADS>(
        q_s, q + cta.q_base, fp.q_head, fp.q_row, first_head, ConsecutiveTokens{token}, heads, heads, fp.d);
#endif
    cp_async_commit();
    const int n_valid = token_list_end<SPARSE_THREADS>(list, top_k, token, &list_end);
    const int n_tiles = (n_valid + SPARSE_KEYS - 1) / SPARSE_KEYS;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
    float m_run[1][2] = {{NEG_INF, NEG_INF}}, ml_run[1][2] = {{0.f, 0.f}}, l_part[1][2] = {{0.f, 0.f}};
    float acc[1][SPARSE_N_TILES_O][4];
#pragma unroll
    for (int c = 0; c < SPARSE_N_TILES_O; ++c) acc[0][c][0] = acc[0][c][1] = acc[0][c][2] = acc[0][c][3] = 0.f;

#if defined(SPARSE_ON_WGMMA)
    // Gathered row i of a tile starting at slot `slot0` is key list[slot0 + i] of the sequence's KV head.
    if (n_tiles > 0) {
        load_swizzled_rows_async<SPARSE_KEYS, HEAD_DIM_PAD / 64, SPARSE_THREADS>(
            k_s, GatheredRows{cta.k_g, fp.k_row, list}, cta.k_g, min(SPARSE_KEYS, n_valid), fp.d);
    }
    cp_async_commit();
    const unsigned q_addr = smem_u32(q_s);
    unsigned p_frag[SPARSE_KEYS / 16][4];  // P_{i−1} in the storage type: the A operand of the pending PV product

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int slot0 = tile * SPARSE_KEYS;
        const int keys_here = min(SPARSE_KEYS, n_valid - slot0);
        cp_async_wait_all();
        fence_proxy_async();
        __syncthreads();  // K_i and V_{i−1} landed for everyone; every warp is done with iteration i − 1
        if (tile + 1 < n_tiles) {
            const int slot1 = slot0 + SPARSE_KEYS;
            load_swizzled_rows_async<SPARSE_KEYS, HEAD_DIM_PAD / 64, SPARSE_THREADS>(
                k_s + ((tile + 1) & 1) * SPARSE_QK_BYTES, GatheredRows{cta.k_g, fp.k_row, list + slot1}, cta.k_g,
                min(SPARSE_KEYS, n_valid - slot1), fp.d);
        }
        load_swizzled_rows_async<SPARSE_KEYS, HEAD_DIM_V_PAD / 64, SPARSE_THREADS>(
            v_s + (tile & 1) * SPARSE_V_BYTES, GatheredRows{cta.v_g, fp.v_row, list + slot0}, cta.v_g, keys_here,
            fp.dv);
        cp_async_commit();

        float s[1][SPARSE_KEYS / 8][4];
        const unsigned k_addr = smem_u32(k_s + (tile & 1) * SPARSE_QK_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM_PAD / 16; ++kk) {
            wgmma_ss_m64n64k16<0, 0>(s[0],
                                     smem_desc(q_addr + (kk / 4) * (SPARSE_ROWS * SW_ROW) + (kk % 4) * 32, 16, 1024),
                                     smem_desc(k_addr + (kk / 4) * (SPARSE_KEYS * SW_ROW) + (kk % 4) * 32, 16, 1024),
                                     kk > 0);
        }
        wgmma_commit();
        if (tile > 0) {
            sparse_pv(acc, p_frag, smem_u32(v_s + ((tile - 1) & 1) * SPARSE_V_BYTES));  // P_{i−1} V_{i−1}
            wgmma_wait<1>();  // S_i is ready; P_{i−1} V_{i−1} may still run
        } else {
            wgmma_wait<0>();
        }
        float rescale[1][2];
        tile_softmax(s, m_run, ml_run, l_part, rescale, fp.scale, slot0, keys_here, n_valid, tig);
        wgmma_wait<0>();  // P_{i−1} V_{i−1} is done: A may be rescaled and the fragments refilled
        rescale_accumulators(acc, rescale);
#pragma unroll
        for (int kk = 0; kk < SPARSE_KEYS / 16; ++kk) pack_a(p_frag[kk], s[0][2 * kk], s[0][2 * kk + 1]);
    }
    if (n_tiles > 0) {
        // The last tile's product, P_{n−1} V_{n−1}, once its V landed.
        cp_async_wait_all();
        fence_proxy_async();
        __syncthreads();
        wgmma_fence();
        sparse_pv(acc, p_frag, smem_u32(v_s + ((n_tiles - 1) & 1) * SPARSE_V_BYTES));
        wgmma_wait<0>();
    }
#else
    // Gathered row i of the tile starting at slot `slot0` is key list[slot0 + i] of the sequence's KV head.
    if (n_tiles > 0) {
        load_group_rows_async<SPARSE_KEYS, HEAD_DIM_PAD, SPARSE_QK_STRIDE, SPARSE_THREADS>(
            k_s, cta.k_g, 0, fp.k_row, 0, ListedTokens{list}, 1, min(SPARSE_KEYS, n_valid), fp.d);
    }
    cp_async_commit();
    // A warp none of whose rows is one of the chunk's heads has nothing to compute (the last chunk of a group that
    // is not a multiple of the rows).
    const bool warp_active = warp * 16 < heads;
    const unsigned q_lane = smem_u32(q_s + warp * 16 * SPARSE_QK_STRIDE + lane_a(lane, SPARSE_QK_STRIDE));
    const unsigned k_lane = smem_u32(k_s + lane_b(lane, SPARSE_QK_STRIDE));
    const unsigned v_lane = smem_u32(v_s + lane_b_trans(lane, SPARSE_V_STRIDE));

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int slot0 = tile * SPARSE_KEYS;
        const int keys_here = min(SPARSE_KEYS, n_valid - slot0);
        cp_async_wait_all();
        __syncthreads();  // K_t (and Q) landed for everyone; every warp is done reading V_{t−1}
        load_group_rows_async<SPARSE_KEYS, HEAD_DIM_V_PAD, SPARSE_V_STRIDE, SPARSE_THREADS>(
            v_s, cta.v_g, 0, fp.v_row, 0, ListedTokens{list + slot0}, 1, keys_here, fp.dv);
        cp_async_commit();

        float s[1][SPARSE_KEYS / 8][4];
        if (warp_active) {
#pragma unroll
            for (int c = 0; c < SPARSE_KEYS / 8; ++c) s[0][c][0] = s[0][c][1] = s[0][c][2] = s[0][c][3] = 0.f;
            warp_mma_nt<HEAD_DIM_PAD / 16, SPARSE_KEYS / 16, SPARSE_QK_STRIDE>(s[0], q_lane, k_lane);
            float rescale[1][2];
            tile_softmax(s, m_run, ml_run, l_part, rescale, fp.scale, slot0, keys_here, n_valid, tig);
            rescale_accumulators(acc, rescale);
        }

        cp_async_wait_all();
        __syncthreads();  // V_t landed for everyone; every warp is done reading K_t
        if (tile + 1 < n_tiles) {
            const int slot1 = slot0 + SPARSE_KEYS;
            load_group_rows_async<SPARSE_KEYS, HEAD_DIM_PAD, SPARSE_QK_STRIDE, SPARSE_THREADS>(
                k_s, cta.k_g, 0, fp.k_row, 0, ListedTokens{list + slot1}, 1, min(SPARSE_KEYS, n_valid - slot1), fp.d);
            cp_async_commit();
        }
        if (warp_active) warp_mma_pv<SPARSE_KEYS / 8, SPARSE_N_TILES_O, SPARSE_V_STRIDE>(acc[0], s[0], v_lane);
    }
#endif
    // Every iteration waits for all copies and the last starts no K prefetch; a CTA with no tile waits for its Q here.
    cp_async_wait_all();
    write_rows(o, lse, cta, fp, TokenHeads{token, first_head, heads}, warp * 16, g, tig, m_run, l_part, acc);
}
