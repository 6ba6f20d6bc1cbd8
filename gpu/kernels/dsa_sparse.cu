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
// Compile-time parameters: ELEM_BF16 or ELEM_F16; HEAD_DIM_PAD and HEAD_DIM_V_PAD, d and dv rounded up to a multiple
// of 16, as in flash_fwd.cu; SPARSE_ROWS, the query heads per CTA (16, 32, 48 or 64).
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

// Where the CTA's rows go: row r is query head first_head + r of the token, the first `heads` rows only.
struct TokenHeads {
    int token, first_head, heads;
    __device__ __forceinline__ bool place(int row, OutputRow& out) const {
        out.head = first_head + row;
        out.position = token;
        return row < heads;
    }
};

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

    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_s = reinterpret_cast<elem_t*>(smem_raw);  // [SPARSE_ROWS][SPARSE_QK_STRIDE]
    elem_t* k_s = q_s + SPARSE_ROWS * SPARSE_QK_STRIDE;  // [SPARSE_KEYS][SPARSE_QK_STRIDE]
    elem_t* v_s = k_s + SPARSE_KEYS * SPARSE_QK_STRIDE;  // [SPARSE_KEYS][SPARSE_V_STRIDE]
    __shared__ int list_end;                             // the list's valid prefix: its first slot that ends it

    load_group_rows_async<SPARSE_ROWS, HEAD_DIM_PAD, SPARSE_QK_STRIDE, SPARSE_THREADS>(
        q_s, q + cta.q_base, fp.q_head, fp.q_row, first_head, ConsecutiveTokens{token}, heads, heads, fp.d);
    cp_async_commit();
    // softmax_scores masks the slots past the list's end (its `len_k`): EverySlot (common.cuh) has no diagonal.
    const int n_valid = token_list_end<SPARSE_THREADS>(list, top_k, token, &list_end);
    const int n_tiles = (n_valid + SPARSE_KEYS - 1) / SPARSE_KEYS;
    // Gathered row i of the tile starting at slot `slot0` is key list[slot0 + i] of the sequence's KV head.
    if (n_tiles > 0) {
        load_group_rows_async<SPARSE_KEYS, HEAD_DIM_PAD, SPARSE_QK_STRIDE, SPARSE_THREADS>(
            k_s, cta.k_g, 0, fp.k_row, 0, ListedTokens{list}, 1, min(SPARSE_KEYS, n_valid), fp.d);
    }
    cp_async_commit();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
    // A warp none of whose rows is one of the chunk's heads has nothing to compute (the last chunk of a group that
    // is not a multiple of the rows).
    const bool warp_active = warp * 16 < heads;
    float m_run[1][2] = {{NEG_INF, NEG_INF}}, ml_run[1][2] = {{0.f, 0.f}}, l_part[1][2] = {{0.f, 0.f}};
    float acc[1][SPARSE_N_TILES_O][4];
#pragma unroll
    for (int c = 0; c < SPARSE_N_TILES_O; ++c) acc[0][c][0] = acc[0][c][1] = acc[0][c][2] = acc[0][c][3] = 0.f;
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
            if (keys_here == SPARSE_KEYS) {
                softmax_scores<false>(s, m_run, ml_run, l_part, rescale, fp.scale, slot0, n_valid, EverySlot{}, 0,
                                      NO_BOUND, 0, tig);
            } else {
                softmax_scores<true>(s, m_run, ml_run, l_part, rescale, fp.scale, slot0, n_valid, EverySlot{}, 0,
                                     NO_BOUND, 0, tig);
            }
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

    // Every iteration waits for all copies and the last starts no K prefetch; a CTA with no tile waits for its Q here.
    cp_async_wait_all();
    write_rows(o, lse, cta, fp, TokenHeads{token, first_head, heads}, warp * 16, g, tig, m_run, l_part, acc);
}
