// NSA's selected-block attention forward (E18's selection branch, E31) on tensor cores, compiled by NVRTC
// (gpu/src/nsa/selected.rs).
//
// Every token t attends, for each query head of its KV head's group, to the tokens ≤ t of the blocks of l' tokens its
// list names (lists [token rows, Hkv, n] i32 from nsa_select.cu's nsa_top_n or from the caller: ascending, −1-padded),
// with one softmax over all of them; outputs O (the layer's layout) and LSE.
//
// One CTA of SLC_ROWS / 16 warps per (⌊SLC_ROWS/G⌋ consecutive tokens, KV head, sequence), whose SLC_ROWS rows are the
// pairs (token, query head of the group), token-major as in nsa_select.cu: with 64 rows a warp's 16 rows are one
// token's heads at G = 16, four tokens' at G = 4, and every group size from 1 to 64 fits (G ∤ 64 leaves the remainder
// rows idle); with SLC_ROWS = G (16, 32, 48 or 64) a CTA owns one token and its walk is that token's list. The CTA walks the union of
// its tokens' lists in ascending block order, each block in tiles of 64 keys starting at the block's first token, so
// each K and V tile is loaded once for all the group's heads and all the CTA's tokens (E31's shared block tile). A
// row attends to a tile only if its token lists the block: for the others the tile is fully masked, which leaves
// the row's state bit for bit as it was (the max does not move, so the rescale is exactly 1, and p = 0), and a warp
// none of whose rows lists the block skips its products altogether. The union step is a minimum over the rows' next
// list entries: each thread keeps, for its two rows, a pointer into its token's list, and the warps' minima meet in
// shared memory at the barrier the pipeline needs anyway.
//
// Pipeline and arithmetic: those of flash_fwd.cu with WARP_M = 1 (its header states the precision recipe; V_t is
// fetched during S = Q K_tᵀ and the softmax, K_{t+1} during O += P V_t), so a row's operations are the dense forward's
// over the tiles of its own blocks: the bound is the dense forward's with one rescale per visited tile.
//
// The host validated the lists it was given (ascending, no duplicate, in the sequence's blocks, −1-padded); lists on
// the device are read defensively all the same: a list ends at its first entry that is not above the previous one or
// not below the sequence's block count, so no list can send the kernel out of its sequence's keys or into a loop.
//
// Compile-time parameters: ELEM_BF16 or ELEM_F16; HEAD_DIM_PAD and HEAD_DIM_V_PAD, d and dv rounded up to a multiple
// of 16, as in flash_fwd.cu; SLC_ROWS, the rows per CTA (default 64).
//
// Arguments: Q, K, V, O, LSE, the lists, cu_seqlens of the queries and keys, and NsaSelectParams (common.cuh) whose
// FlashParams is the layer's problem (causal self-attention) and whose select_block, n_selected, n_heads_kv,
// tokens_per_cta and token_rows this kernel reads.

#ifndef HEAD_DIM_PAD
#error "define HEAD_DIM_PAD"
#endif
#ifndef HEAD_DIM_V_PAD
#error "define HEAD_DIM_V_PAD"
#endif

#ifndef SLC_ROWS
#define SLC_ROWS 64                          // (token, head) rows per CTA: 16, 32, 48 or 64
#endif
#define SLC_THREADS (2 * SLC_ROWS)           // a warp per 16 rows
#define SLC_KEYS 64                          // keys per tile
#define SLC_QK_STRIDE (HEAD_DIM_PAD + 8)     // shared row strides in elements (the padding spreads banks)
#define SLC_V_STRIDE (HEAD_DIM_V_PAD + 8)
#define SLC_N_TILES_O (HEAD_DIM_V_PAD / 8)
#define LIST_END 0x7fffffff                  // past a list's last entry: above every block

static_assert(SLC_ROWS % 16 == 0 && SLC_ROWS >= 16 && SLC_ROWS <= 64, "SLC_ROWS must be 16, 32, 48 or 64");
static_assert(HEAD_DIM_PAD % 16 == 0 && HEAD_DIM_PAD <= 256, "HEAD_DIM_PAD must be a multiple of 16 up to 256");
static_assert(HEAD_DIM_V_PAD % 16 == 0 && HEAD_DIM_V_PAD <= 256, "HEAD_DIM_V_PAD must be a multiple of 16 up to 256");

// The diagonals of a thread's two rows for one tile (softmax_scores asks for rows 0 and 8 of the thread's slice): the
// row's token where the token lists the tile's block, −1 (no key visible) where it does not.
struct ListedDiagonals {
    int first, second;
    __device__ __forceinline__ int at(int row) const { return row == 0 ? first : second; }
};

// Where the CTA's rows go: row r is token t0 + r / G of query head first_head + r % G.
struct GroupRows {
    int t0, group, rows, first_head;
    __device__ __forceinline__ bool place(int row, OutputRow& out) const {
        out.head = first_head + row % group;
        out.position = t0 + row / group;
        return row < rows;
    }
};

// The minimum over the warp's 32 lanes. `redux.sync` exists from sm_80 on; it is written as PTX (not as the
// `__reduce_min_sync` intrinsic, which older targets do not declare) so that an older target rejects it in ptxas by
// name, as it rejects `cp.async`, and the support table's test sees why.
__device__ __forceinline__ int warp_min(int value) {
    int out;
    asm volatile("redux.sync.min.s32 %0, %1, 0xffffffff;" : "=r"(out) : "r"(value));
    return out;
}

extern "C" __global__ void __launch_bounds__(SLC_THREADS)
nsa_selected_fwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                 elem_t* __restrict__ o, float* __restrict__ lse, const int* __restrict__ lists,
                 const int* __restrict__ cu_q, const int* __restrict__ cu_k, const NsaSelectParams params) {
    const FlashParams& fp = params.flash;
    const int group = fp.group, kv = blockIdx.y, seq = blockIdx.z;
    ForwardCta cta;
    if (!forward_cta(cta, fp, q, k, v, cu_q, cu_k, seq, kv * group, blockIdx.x, params.tokens_per_cta, SLC_KEYS)) {
        return;
    }
    const int t0 = cta.row0, tokens = cta.rows_here, rows = tokens * group, len = cta.len_k;
    const int lb = params.select_block, n = params.n_selected, width = n + 1;
    const int seq_blocks = (len + lb - 1) / lb;
    const long long token_row0 = fp.varlen ? (long long)cu_q[seq] : (long long)seq * fp.dense_len_q;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_s = reinterpret_cast<elem_t*>(smem_raw);  // [SLC_ROWS][SLC_QK_STRIDE]
    elem_t* k_s = q_s + SLC_ROWS * SLC_QK_STRIDE;       // [SLC_KEYS][SLC_QK_STRIDE]
    elem_t* v_s = k_s + SLC_KEYS * SLC_QK_STRIDE;       // [SLC_KEYS][SLC_V_STRIDE]
    // The CTA's tokens' lists, n entries and LIST_END each: [tokens_per_cta][n + 1].
    int* list_s = reinterpret_cast<int*>(v_s + SLC_KEYS * SLC_V_STRIDE);
    __shared__ int warp_next[2][SLC_THREADS / 32];  // each warp's smallest next entry, by iteration parity

    load_group_rows_async<SLC_ROWS, HEAD_DIM_PAD, SLC_QK_STRIDE, SLC_THREADS>(q_s, q + cta.q_base, fp.q_head,
                                                                            fp.q_row, kv * group, ConsecutiveTokens{t0}, group, rows,
                                                                            fp.d);
    cp_async_commit();
    for (int idx = threadIdx.x; idx < tokens * n; idx += SLC_THREADS) {
        const int tl = idx / n, e = idx % n;
        list_s[tl * width + e] = lists[((token_row0 + t0 + tl) * params.n_heads_kv + kv) * n + e];
    }
    __syncthreads();
    // Each list ends at its first entry that does not rise or lies past the sequence's blocks (−1 among them).
    for (int tl = threadIdx.x; tl < tokens; tl += SLC_THREADS) {
        int* list = list_s + tl * width;
        int previous = -1;
        bool open = true;
        for (int e = 0; e < n; ++e) {
            const int block = list[e];
            open = open && list_entry_continues(block, previous, seq_blocks);
            list[e] = open ? block : LIST_END;
            previous = block;
        }
        list[n] = LIST_END;
    }
    __syncthreads();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
    // The thread's rows warp·16 + g and + 8: their tokens, their lists, and the pointers to their next entries.
    const int row_a = warp * 16 + g, row_b = row_a + 8;
    const bool valid_a = row_a < rows, valid_b = row_b < rows;
    const int token_a = t0 + row_a / group, token_b = t0 + row_b / group;
    const int* list_a = list_s + (valid_a ? row_a / group : 0) * width;
    const int* list_b = list_s + (valid_b ? row_b / group : 0) * width;
    int next_a = valid_a ? list_a[0] : LIST_END, next_b = valid_b ? list_b[0] : LIST_END;
    int ptr_a = 0, ptr_b = 0;

    // The union's first block: the smallest first entry of every row.
    int parity = 0;
    {
        const int m = warp_min(min(next_a, next_b));
        if (lane == 0) warp_next[parity][warp] = m;
    }
    __syncthreads();
    int block = warp_next[parity][0];
#pragma unroll
    for (int w = 1; w < SLC_THREADS / 32; ++w) block = min(block, warp_next[parity][w]);
    int sub = 0;  // the tile's index inside its block
    if (block != LIST_END) {
        const int key0 = block * lb;
        load_tile_async<SLC_KEYS, HEAD_DIM_PAD, SLC_QK_STRIDE, SLC_THREADS>(
            k_s, cta.k_g + (long long)key0 * fp.k_row, fp.k_row, min(SLC_KEYS, min(key0 + lb, len) - key0), fp.d);
    }
    cp_async_commit();

    float m_run[1][2] = {{NEG_INF, NEG_INF}}, ml_run[1][2] = {{0.f, 0.f}}, l_part[1][2] = {{0.f, 0.f}};
    float acc[1][SLC_N_TILES_O][4];
#pragma unroll
    for (int c = 0; c < SLC_N_TILES_O; ++c) acc[0][c][0] = acc[0][c][1] = acc[0][c][2] = acc[0][c][3] = 0.f;
    const unsigned q_lane = smem_u32(q_s + warp * 16 * SLC_QK_STRIDE + lane_a(lane, SLC_QK_STRIDE));
    const unsigned k_lane = smem_u32(k_s + lane_b(lane, SLC_QK_STRIDE));
    const unsigned v_lane = smem_u32(v_s + lane_b_trans(lane, SLC_V_STRIDE));

    while (block != LIST_END) {
        const int key0 = block * lb + sub * SLC_KEYS;
        const int key_end = min(block * lb + lb, len);  // the block's end: later keys of the tile are masked
        const int keys_here = min(SLC_KEYS, key_end - key0);
        const bool last_of_block = key0 + SLC_KEYS >= key_end;
        const bool member_a = next_a == block, member_b = next_b == block;
        // After the block's last tile, each row's next entry and the union's next block.
        int after_a = next_a, after_b = next_b;
        parity ^= 1;
        if (last_of_block) {
            if (member_a) after_a = list_a[ptr_a + 1];
            if (member_b) after_b = list_b[ptr_b + 1];
            const int m = warp_min(min(after_a, after_b));
            if (lane == 0) warp_next[parity][warp] = m;
        }
        cp_async_wait_all();
        __syncthreads();  // K_t (and Q) landed for everyone; every warp is done reading V_{t−1}; the minima are in
        int next_block = block, next_sub = sub + 1;
        if (last_of_block) {
            next_block = warp_next[parity][0];
#pragma unroll
            for (int w = 1; w < SLC_THREADS / 32; ++w) next_block = min(next_block, warp_next[parity][w]);
            next_sub = 0;
        }
        load_tile_async<SLC_KEYS, HEAD_DIM_V_PAD, SLC_V_STRIDE, SLC_THREADS>(
            v_s, cta.v_g + (long long)key0 * fp.v_row, fp.v_row, keys_here, fp.dv);
        cp_async_commit();

        const bool warp_attends = __any_sync(0xffffffffu, member_a || member_b);
        float s[1][SLC_KEYS / 8][4];
        if (warp_attends) {
#pragma unroll
            for (int c = 0; c < SLC_KEYS / 8; ++c) s[0][c][0] = s[0][c][1] = s[0][c][2] = s[0][c][3] = 0.f;
            warp_mma_nt<HEAD_DIM_PAD / 16, SLC_KEYS / 16, SLC_QK_STRIDE>(s[0], q_lane, k_lane);
            float rescale[1][2];
            // Every row of the warp lists the block and sees every key of a full tile: no mask arithmetic.
            const bool sees_all_a = !valid_a || (member_a && key0 + SLC_KEYS - 1 <= token_a);
            const bool sees_all_b = !valid_b || (member_b && key0 + SLC_KEYS - 1 <= token_b);
            if (keys_here == SLC_KEYS && __all_sync(0xffffffffu, sees_all_a && sees_all_b)) {
                softmax_scores<false>(s, m_run, ml_run, l_part, rescale, fp.scale, key0, key_end,
                                      ListedDiagonals{token_a, token_b}, 0, NO_BOUND, 0, tig);
            } else {
                const ListedDiagonals diag{member_a ? token_a : -1, member_b ? token_b : -1};
                softmax_scores<true>(s, m_run, ml_run, l_part, rescale, fp.scale, key0, key_end, diag, 0, NO_BOUND,
                                     0, tig);
            }
            rescale_accumulators(acc, rescale);
        }

        cp_async_wait_all();
        __syncthreads();  // V_t landed for everyone; every warp is done reading K_t
        if (next_block != LIST_END) {
            const int key1 = next_block * lb + next_sub * SLC_KEYS;
            load_tile_async<SLC_KEYS, HEAD_DIM_PAD, SLC_QK_STRIDE, SLC_THREADS>(
                k_s, cta.k_g + (long long)key1 * fp.k_row, fp.k_row,
                min(SLC_KEYS, min(next_block * lb + lb, len) - key1), fp.d);
            cp_async_commit();
        }
        if (warp_attends) warp_mma_pv<SLC_KEYS / 8, SLC_N_TILES_O, SLC_V_STRIDE>(acc[0], s[0], v_lane);

        if (last_of_block) {
            ptr_a += member_a;
            ptr_b += member_b;
            next_a = after_a;
            next_b = after_b;
        }
        block = next_block;
        sub = next_sub;
    }

    // Every iteration waits for all copies and the last starts no K prefetch; a CTA with no block waits for its Q here.
    cp_async_wait_all();
    write_rows(o, lse, cta, fp, GroupRows{t0, group, rows, kv * group}, warp * 16, g, tig, m_run, l_part, acc);
}
