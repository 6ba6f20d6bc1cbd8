// DSA's token-sparse attention backward (the gradients of E16's main attention over the selected tokens) on tensor
// cores, compiled by NVRTC after common.cuh and flash_bwd.cu (gpu/src/dsa/sparse_backward.rs), whose helpers,
// recipe, KV-owner tile step and bwd_preprocess (D = rowsum(dO ∘ O)) it reuses.
//
// The lists are held fixed (top-k has no gradient), so the backward is the dense backward of the visibility "key
// listed for (token, list head)": every (token t, query head h) row sees exactly the keys of t's list.
//
// Kernels (each takes its pointers, the sequence offsets and DsaSparseParams, the forward's one parameter struct):
//   dsa_sparse_bwd     one CTA of four warps per (token, chunk of up to 64 query heads of a KV head's group, column
//                      chunk; sequence), as the forward's CTAs: its rows are the chunk's heads of one token, so each
//                      gathered K and V row is loaded once for all of them. It walks the token's list in tiles of 64
//                      consecutive slots, gathering the listed K and V rows, and runs bwd_kv's step on each with the
//                      slots in the KV owner's place (warp w owns slots 16w … 16w + 15): Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, Pᵀ
//                      and dSᵀ (tile_p_ds, only the slots past the list's end masked), then the tile's dV = round_T(P)ᵀ
//                      dO and dK = dSᵀ Q summed over the chunk's heads (add_dk_dv) and added to f32 accumulators of the
//                      gathered keys' rows with vector reductions (red.global.add.v2.f32: the order of a key's adds
//                      across tokens is not fixed), and dQ = dS K (tile_dq) added to the rows' f32 sums in registers. A
//                      token owns its rows, so it writes dQ = round_T(α̂ · Σ) once at the end, without atomics: dQ is
//                      bitwise reproducible, dK and dV are not.
//   dsa_dkv_finalize   dK = round_T(α̂ · acc_k), dV = round_T(acc_v) for every key of every sequence (keys no list names
//                      get zeros: the host zeroes the accumulators).
//
// Every element's arithmetic is flash_bwd.cu's (its header states the recipe). A row's dQ sums one tile partial per
// visited tile (at most ⌈k/64⌉); a key's dK and dV sum one partial per (token, head chunk) that lists it, each the
// tensor cores' sum over the chunk's heads: so the bound is the dense backward's for the group's rows stacked as one
// head, with query tiles of a chunk's heads, and the flush of the reductions (red.add.f32 flushes subnormal inputs and
// results) counted once per partial (attnproof_proofs::flash_bound::FlashRecipe::atomic_kv_sums).
//
// Device lists are read with the forward's rule (token_list_end): a list ends at its first entry that does not rise or
// lies after its token, so no list can send the kernel outside its sequence, to a future key, or to a row twice.

#define DSA_BWD_THREADS (KV_WARPS * 32)

// A thread's share of tile_dq's output, part[DQ_MT][DQ_COLS / 8][4] (CHUNK / 2 values), and the index of (mt, n, e).
#define DQ_SHARE (DQ_MT * (DQ_COLS / 8) * 4)
__device__ __forceinline__ int dq_share(int mt, int n, int e) { return (mt * (DQ_COLS / 8) + n) * 4 + e; }

static_assert(KV_WARPS == 4, "dsa_sparse_bwd gathers tiles of 64 slots (KV_WARPS = 4)");
static_assert(DQ_SHARE * 2 == CHUNK, "each thread holds CHUNK / 2 of the rows' dQ sums (gpu/src/dsa/sparse_backward.rs)");

extern "C" __global__ void __launch_bounds__(DSA_BWD_THREADS)
dsa_sparse_bwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
               const elem_t* __restrict__ d_out, const float* __restrict__ lse, const float* __restrict__ delta,
               elem_t* __restrict__ dq, float* __restrict__ dk_acc, float* __restrict__ dv_acc,
               const int* __restrict__ lists, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
               const DsaSparseParams params, const int add_kv) {
    UNPACK_FLASH_PARAMS(params.flash);
    const int seq = blockIdx.z;
    const int per_kv = params.head_chunks * params.column_chunks;
    const int kv = blockIdx.y / per_kv;
    const int chunk = (blockIdx.y % per_kv) / params.column_chunks;
    const int c0 = ONE_CHUNK ? 0 : (blockIdx.y % params.column_chunks) * CHUNK;
    const int first_head = kv * group + chunk * Q_TILE;
    const int heads = min(Q_TILE, group - chunk * Q_TILE);
    const SeqView sv = SEQ_VIEW(seq);
    const int token = blockIdx.x;
    if (token >= sv.len_q) return;
    const int top_k = params.top_k;
    const long long token_row = (varlen ? (long long)cu_q[seq] : (long long)seq * dense_len_q) + token;
    const int list_head = params.list_heads == 1 ? 0 : kv;
    const int* list = lists + (token_row * params.list_heads + list_head) * top_k;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* k_s = reinterpret_cast<elem_t*>(smem_raw);  // [KV_TILE][QK_STRIDE]: the gathered keys
    elem_t* v_s = k_s + KV_TILE * QK_STRIDE;             // [KV_TILE][V_STRIDE]: the gathered values
    elem_t* q_s = v_s + KV_TILE * V_STRIDE;              // [Q_TILE][QK_STRIDE]: the chunk's query heads
    elem_t* do_s = q_s + Q_TILE * QK_STRIDE;             // [Q_TILE][V_STRIDE]: their dO
    elem_t* ds_s = do_s + Q_TILE * V_STRIDE;             // [Q_TILE][DS_STRIDE]: round_T(dS) of the tile
    float* bl_s = reinterpret_cast<float*>(ds_s + Q_TILE * DS_STRIDE);  // [Q_TILE] b_L = fl32(LSE · log2 e)
    float* delta_s = bl_s + Q_TILE;                                      // [Q_TILE] D
    // [DQ_SHARE][DSA_BWD_THREADS]: each thread's share of the rows' dQ sums (its tile_dq fragment, CHUNK / 2 values),
    // thread-major so that a warp's accesses fall in distinct banks. In shared memory rather than registers, where
    // they would push the tile step past 255 registers.
    float* dq_s = delta_s + Q_TILE;
    __shared__ int list_end;                                             // the list's valid prefix

    // The rows: the chunk's heads of the token (Q, dO by cp.async; b_L and D by plain loads, +∞ and 0 past them).
    load_group_rows_async<Q_TILE, HEAD_DIM_PAD, QK_STRIDE, DSA_BWD_THREADS>(
        q_s, q + sv.q_base, q_head, q_row, first_head, ConsecutiveTokens{token}, heads, heads, d);
    load_group_rows_async<Q_TILE, HEAD_DIM_V_PAD, V_STRIDE, DSA_BWD_THREADS>(
        do_s, d_out + sv.o_base, o_head, o_row, first_head, ConsecutiveTokens{token}, heads, heads, dv);
    cp_async_commit();
    for (int r = threadIdx.x; r < Q_TILE; r += DSA_BWD_THREADS) {
        const long long at = sv.lse_base + (long long)(first_head + r) * lse_head + token;
        bl_s[r] = r < heads ? row_bl(lse[at]) : POS_INF;
        delta_s[r] = r < heads ? delta[at] : 0.f;
    }
    const int n_valid = token_list_end<DSA_BWD_THREADS>(list, top_k, token, &list_end);
    const int n_tiles = (n_valid + KV_TILE - 1) / KV_TILE;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    const int wk = warp * 16;
    const auto [k_a, v_a, q_b, do_b, q_bt, do_bt, ds_a, ds_st, k_bt, wq, dq_c] =
        kv_owner_lanes(k_s, v_s, q_s, do_s, ds_s, warp, lane, c0);
    const float cl = scale_log2(scale);
    const elem_t* k_g = k + sv.k_base + kv * k_head;
    const elem_t* v_g = v + sv.v_base + kv * v_head;

    // The thread's share of dQ (tile_dq's fragment of the warp's rows and columns), summed over the visited tiles.
    float* dq_sum = dq_s + threadIdx.x;
#pragma unroll
    for (int i = 0; i < DQ_SHARE; ++i) dq_sum[i * DSA_BWD_THREADS] = 0.f;

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int slot0 = tile * KV_TILE;
        const int keys_here = min(KV_TILE, n_valid - slot0);
        const ListedTokens keys{list + slot0};
        // Gathered row i of the tile is key list[slot0 + i] of the sequence's KV head.
        load_group_rows_async<KV_TILE, HEAD_DIM_PAD, QK_STRIDE, DSA_BWD_THREADS>(k_s, k_g, 0, k_row, 0, keys, 1,
                                                                                 keys_here, d);
        load_group_rows_async<KV_TILE, HEAD_DIM_V_PAD, V_STRIDE, DSA_BWD_THREADS>(v_s, v_g, 0, v_row, 0, keys, 1,
                                                                                  keys_here, dv);
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();  // the tile (and the rows, on the first) landed for everyone

        float st[Q_TILE / 8][4], dpt[Q_TILE / 8][4];
#pragma unroll
        for (int n = 0; n < Q_TILE / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
        }
        warp_mma_nt<HEAD_DIM_PAD / 16, Q_TILE / 16, QK_STRIDE>(st, k_a, q_b);
        warp_mma_nt<HEAD_DIM_V_PAD / 16, Q_TILE / 16, V_STRIDE>(dpt, v_a, do_b);
        // A slot past the list's end holds a zero key, whose score is 0, not −∞: masked. Rows past the chunk's heads
        // have b_L = +∞ (p = 0) and zero dO, D (dS = 0), so a warp whose 16 slots are all listed needs no mask.
        unsigned dsp[Q_TILE / 8][2];
        if (wk + 16 <= keys_here) {
            tile_p_ds<false>(st, dpt, dsp, bl_s, delta_s, cl, tig, EverySlot{}, 0, 0, 0, 0, 0, 0);
        } else {
            tile_p_ds<true>(st, dpt, dsp, bl_s, delta_s, cl, tig, EverySlot{}, tig * 2, wk + g, heads - tig * 2,
                            keys_here, NO_BOUND, 0);
        }

        // The tile's dK and dV over the chunk's heads, added to the gathered keys' accumulators (the atomic mode; the
        // deterministic mode's dsa_sparse_bwd_kv forms them instead).
        if (add_kv) {
            float acc_k[CHUNK / 8][4], acc_v[CHUNK / 8][4];
#pragma unroll
            for (int n = 0; n < CHUNK / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_k[n][e] = acc_v[n][e] = 0.f;
            }
            if (heads == Q_TILE) {
                add_dk_dv<true>(acc_k, acc_v, st, dsp, do_bt, q_bt, c0, heads);
            } else {
                add_dk_dv<false>(acc_k, acc_v, st, dsp, do_bt, q_bt, c0, heads);
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int slot = wk + g + 8 * r;
                const bool listed = slot < keys_here;
                const long long key = listed ? keys(slot) : 0;
                float* dk_row = dk_acc + sv.k_base + kv * k_head + key * k_row;
                float* dv_row = dv_acc + sv.v_base + kv * v_head + key * v_row;
#pragma unroll
                for (int n = 0; n < CHUNK / 8; ++n) {
                    const int col = c0 + n * 8 + tig * 2;
                    red_add_v2(listed && col < d, dk_row + col, acc_k[n][2 * r], acc_k[n][2 * r + 1]);
                    red_add_v2(listed && col < dv, dv_row + col, acc_v[n][2 * r], acc_v[n][2 * r + 1]);
                }
            }
        }

        // The tile's dQ = dS K, added to the rows' sums.
        if (c0 < d) {
#pragma unroll
            for (int n = 0; n < Q_TILE / 8; n += 2) {
                stsm_x4_trans(ds_st + n * 8 * DS_STRIDE * ESZ, dsp[n][0], dsp[n][1], dsp[n + 1][0], dsp[n + 1][1]);
            }
            __syncthreads();  // dS of every warp's slots stored
            float part[DQ_MT][DQ_COLS / 8][4];
            if (keys_here == KV_TILE) {
                tile_dq<true>(part, ds_a, k_bt, dq_c, keys_here);
            } else {
                tile_dq<false>(part, ds_a, k_bt, dq_c, keys_here);
            }
#pragma unroll
            for (int mt = 0; mt < DQ_MT; ++mt) {
#pragma unroll
                for (int n = 0; n < DQ_COLS / 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float* x = dq_sum + dq_share(mt, n, e) * DSA_BWD_THREADS;
                        *x = __fadd_rn(*x, part[mt][n][e]);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with the tile's K, V and dS before the next gather overwrites them
    }
    // A token with no listed key waits for its rows' copies here (its dQ is 0).
    cp_async_wait_all();

    // dQ = round_T(α̂ · Σ) of the chunk's heads: row wq + 16·mt + g + 8·(e / 2), columns dq_c + 8n + 2·tig + e % 2.
    if (c0 < d) {
#pragma unroll
        for (int mt = 0; mt < DQ_MT; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = wq + 16 * mt + g + 8 * r;
                if (row >= heads) continue;
                elem_t* dq_row = dq + sv.q_base + (long long)(first_head + row) * q_head + (long long)token * q_row;
#pragma unroll
                for (int n = 0; n < DQ_COLS / 8; ++n) {
                    const int col = dq_c + n * 8 + tig * 2;
                    if (col >= d) continue;
                    const float dq0 = dq_sum[dq_share(mt, n, 2 * r) * DSA_BWD_THREADS];
                    const float dq1 = dq_sum[dq_share(mt, n, 2 * r + 1) * DSA_BWD_THREADS];
                    *reinterpret_cast<unsigned*>(dq_row + col) =
                        pack_elems(to_elem(__fmul_rn(scale, dq0)), to_elem(__fmul_rn(scale, dq1)));
                }
            }
        }
    }
}

// dK = round_T(α̂ · acc_k) and dV = round_T(acc_v) in K's and V's layouts: one thread per (key, KV head, column pair)
// of a sequence (grid (⌈longest · ⌈max(d, dv)/2⌉ / 128⌉, Hkv, B)).
extern "C" __global__ void __launch_bounds__(THREADS)
dsa_dkv_finalize(const float* __restrict__ dk_acc, const float* __restrict__ dv_acc, elem_t* __restrict__ dk,
                 elem_t* __restrict__ dv_out, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                 const DsaSparseParams params) {
    UNPACK_FLASH_PARAMS(params.flash);
    const SeqView sv = SEQ_VIEW(blockIdx.z);
    const int kv = blockIdx.y;
    const int pairs = (max(d, dv) + 1) / 2;
    const long long idx = (long long)blockIdx.x * THREADS + threadIdx.x;
    if (idx >= (long long)sv.len_k * pairs) return;
    const int key = (int)(idx / pairs), col = (int)(idx % pairs) * 2;
    if (col < d) {
        const long long at = sv.k_base + kv * k_head + (long long)key * k_row + col;
        const float2 x = *reinterpret_cast<const float2*>(dk_acc + at);
        *reinterpret_cast<unsigned*>(dk + at) =
            pack_elems(to_elem(__fmul_rn(scale, x.x)), to_elem(__fmul_rn(scale, x.y)));
    }
    if (col < dv) {
        const long long at = sv.v_base + kv * v_head + (long long)key * v_row + col;
        const float2 x = *reinterpret_cast<const float2*>(dv_acc + at);
        *reinterpret_cast<unsigned*>(dv_out + at) = pack_elems(to_elem(x.x), to_elem(x.y));
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// The deterministic mode's dK and dV: the token-level transpose of the lists (E20's, with keys in the blocks' place),
// one CSR row per (sequence, list head, KV tile of 64 keys of the longest sequence) holding the tokens whose list
// names a key of the tile, ascending, each with the 64-bit mask of the tile's keys it names (a token's entries in one
// tile are a run of its ascending list). dsa_csr_count counts each row and writes every list's valid length,
// bwd_csr_scan turns the counts into offsets, dsa_csr_fill writes the tokens and masks from a warp ballot (no atomics
// in the result), and dsa_sparse_bwd_kv owns each KV tile: it walks its row in tiles of ⌊64/G⌋ tokens × G heads and
// runs bwd_kv's step with P and dS of the keys a token does not list zeroed, so each key's sums run in one fixed order.

// The first CSR row of (sequence, list head): rows are (sequence, list head, KV tile of the longest sequence).
__device__ __forceinline__ long long dsa_csr_row0(const DsaSparseParams& params, int seq, int head, int kv_tiles) {
    return ((long long)seq * params.list_heads + head) * kv_tiles;
}

// The list of token t of sequence `seq` (token rows from `token_row0`) for list head `head`.
__device__ __forceinline__ const int* dsa_token_list(const int* __restrict__ lists, const DsaSparseParams& params,
                                                     long long token_row0, int t, int head) {
    return lists + ((token_row0 + t) * params.list_heads + head) * params.top_k;
}

// The sequence's first token row of the lists.
__device__ __forceinline__ long long dsa_token_row0(const FlashParams& fp, const int* __restrict__ cu_q, int seq) {
    return fp.varlen ? (long long)cu_q[seq] : (long long)seq * fp.dense_len_q;
}

// One thread per (token, list head, sequence): the list's valid length (token_list_end's rule) into `lengths`, and 1
// added to the count of every KV tile its valid entries fall in (once per tile: they ascend). Counts only: any order.
extern "C" __global__ void __launch_bounds__(THREADS)
dsa_csr_count(const int* __restrict__ lists, int* __restrict__ counts, int* __restrict__ lengths,
              const int* __restrict__ cu_q, const int* __restrict__ cu_k, const DsaSparseParams params,
              const int kv_tiles) {
    UNPACK_FLASH_PARAMS(params.flash);
    const int seq = blockIdx.z, head = blockIdx.y;
    const SeqView sv = SEQ_VIEW(seq);
    const int t = blockIdx.x * THREADS + threadIdx.x;
    if (t >= sv.len_q) return;
    const long long token_row0 = dsa_token_row0(params.flash, cu_q, seq);
    const int* list = dsa_token_list(lists, params, token_row0, t, head);
    int* row_counts = counts + dsa_csr_row0(params, seq, head, kv_tiles);
    int previous = -1, last_tile = -1, e = 0;
    for (; e < params.top_k; ++e) {
        const int s = __ldg(list + e);
        if (!list_entry_continues(s, previous, t + 1)) break;
        if (s / KV_TILE != last_tile) {
            last_tile = s / KV_TILE;
            atomicAdd(row_counts + last_tile, 1);
        }
        previous = s;
    }
    lengths[(token_row0 + t) * params.list_heads + head] = e;
}

// The 64-bit mask of the keys key0 … key0 + 63 that the valid prefix (`len` entries, ascending) of `list` names: a
// binary search for the first entry at or after key0, then the run of entries below key0 + 64.
__device__ __forceinline__ unsigned long long tile_mask(const int* __restrict__ list, int len, int key0) {
    int lo = 0, hi = len;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (__ldg(list + mid) < key0) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    unsigned long long mask = 0;
    for (int e = lo; e < len; ++e) {
        const int s = __ldg(list + e);
        if (s >= key0 + KV_TILE) break;
        mask |= 1ull << (s - key0);
    }
    return mask;
}

// One warp per CSR row (grid (⌈kv_tiles / NUM_WARPS⌉, list heads, sequences)): the lanes test 32 tokens at a time
// from the tile's first key (no earlier token lists it) and write the listing tokens and their masks ascending.
extern "C" __global__ void __launch_bounds__(THREADS)
dsa_csr_fill(const int* __restrict__ lists, const int* __restrict__ lengths, const int* __restrict__ csr_offsets,
             int* __restrict__ csr_tokens, unsigned long long* __restrict__ csr_masks, const int* __restrict__ cu_q,
             const int* __restrict__ cu_k, const DsaSparseParams params, const int kv_tiles) {
    UNPACK_FLASH_PARAMS(params.flash);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int seq = blockIdx.z, head = blockIdx.y, tile = blockIdx.x * NUM_WARPS + warp;
    const SeqView sv = SEQ_VIEW(seq);
    if (tile >= kv_tiles || tile * KV_TILE >= sv.len_k) return;
    const long long token_row0 = dsa_token_row0(params.flash, cu_q, seq);
    int written = csr_offsets[dsa_csr_row0(params, seq, head, kv_tiles) + tile];
    for (int base = tile * KV_TILE; base < sv.len_q; base += 32) {
        const int t = base + lane;
        unsigned long long mask = 0;
        if (t < sv.len_q) {
            const int len = lengths[(token_row0 + t) * params.list_heads + head];
            mask = tile_mask(dsa_token_list(lists, params, token_row0, t, head), len, tile * KV_TILE);
        }
        const unsigned ballot = __ballot_sync(0xffffffffu, mask != 0);
        if (mask != 0) {
            const int at = written + __popc(ballot & ((1u << lane) - 1u));
            csr_tokens[at] = t;
            csr_masks[at] = mask;
        }
        written += __popc(ballot);
    }
}

// Zeroes P (st) and dS (dsp) of the pairs whose token does not list the key: column q of the tile is row q, token
// q / group of the stage, whose mask (masks[q / group], 0 past the tile's tokens) holds bit k for key key0 + k; the
// thread's keys are bit_g and bit_g + 8 (tile_p_ds's fragment: element e is key row e / 2, column e % 2).
__device__ __forceinline__ void mask_unlisted(float (&st)[Q_TILE / 8][4], unsigned (&dsp)[Q_TILE / 8][2],
                                              const unsigned long long* masks, int group, int bit_g, int tig) {
#pragma unroll
    for (int n = 0; n < Q_TILE / 8; ++n) {
        const int q0 = n * 8 + tig * 2;
        const unsigned long long m0 = masks[q0 / group], m1 = masks[(q0 + 1) / group];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int bit = bit_g + 8 * h;
            const bool vis0 = (m0 >> bit) & 1ull, vis1 = (m1 >> bit) & 1ull;
            st[n][2 * h] = vis0 ? st[n][2 * h] : 0.f;
            st[n][2 * h + 1] = vis1 ? st[n][2 * h + 1] : 0.f;
            dsp[n][h] &= (vis0 ? 0x0000ffffu : 0u) | (vis1 ? 0xffff0000u : 0u);
        }
    }
}

// The deterministic mode's KV owner: one CTA of four warps per (KV tile of 64 keys, KV head × column chunk, sequence),
// warp w owning keys 16w … 16w + 15, as bwd_kv. It walks its tile's CSR row (the list head its KV head reads) in tiles
// of ⌊64/G⌋ tokens × G heads (rows token-major, the group's heads consecutive; G ≤ 64, which the host checks),
// gathering each row's Q, dO, LSE and D, and runs bwd_kv's step on each: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, Pᵀ and dSᵀ
// (tile_p_ds masks the rows past the tile's and the keys past the sequence, mask_unlisted the keys a token does not
// list), dV += round_T(P)ᵀ dO, dK += dSᵀ Q. It holds every row that sees its keys, so it writes dK = round_T(α̂ · Σ) and
// dV = round_T(Σ) itself; keys no token lists get zeros.
extern "C" __global__ void __launch_bounds__(DSA_BWD_THREADS)
dsa_sparse_bwd_kv(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                  const elem_t* __restrict__ d_out, const float* __restrict__ lse, const float* __restrict__ delta,
                  elem_t* __restrict__ dk_out, elem_t* __restrict__ dv_out, const int* __restrict__ csr_offsets,
                  const int* __restrict__ csr_tokens, const unsigned long long* __restrict__ csr_masks,
                  const int* __restrict__ cu_q, const int* __restrict__ cu_k, const DsaSparseParams params,
                  const int kv_tiles) {
    UNPACK_FLASH_PARAMS(params.flash);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* k_s = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* v_s = k_s + KV_TILE * QK_STRIDE;
    elem_t* q_s = v_s + KV_TILE * V_STRIDE;  // [Q_TILE][QK_STRIDE]
    elem_t* do_s = q_s + Q_TILE * QK_STRIDE;  // [Q_TILE][V_STRIDE]
    elem_t* ds_s = do_s + Q_TILE * V_STRIDE;  // [Q_TILE][DS_STRIDE] (unused: no dQ here; kept for kv_owner_lanes)
    float* bl_s = reinterpret_cast<float*>(ds_s + Q_TILE * DS_STRIDE);
    float* delta_s = bl_s + Q_TILE;
    __shared__ unsigned long long mask_s[Q_TILE];  // each row tile's tokens' masks (0 past them)

    const int n_chunks = params.column_chunks;
    const int kv = ONE_CHUNK ? blockIdx.y : blockIdx.y / n_chunks;
    const int c0 = ONE_CHUNK ? 0 : (blockIdx.y % n_chunks) * CHUNK;
    const int seq = blockIdx.z, tile = blockIdx.x;
    const SeqView sv = SEQ_VIEW(seq);
    const int key0 = tile * KV_TILE;
    if (key0 >= sv.len_k) return;
    const int keys_here = min(KV_TILE, sv.len_k - key0);
    const int first_head = kv * group;
    const int tile_tokens = Q_TILE / group;
    const int list_head = params.list_heads > 1 ? kv : 0;  // the CSR rows of the list its KV head reads
    const long long csr_row = dsa_csr_row0(params, seq, list_head, kv_tiles) + tile;
    const int csr_lo = csr_offsets[csr_row], csr_hi = csr_offsets[csr_row + 1];
    const int n_row_tiles = (csr_hi - csr_lo + tile_tokens - 1) / tile_tokens;

    load_tile_async<KV_TILE, HEAD_DIM_PAD, QK_STRIDE, DSA_BWD_THREADS>(
        k_s, k + sv.k_base + kv * k_head + (long long)key0 * k_row, k_row, keys_here, d);
    load_tile_async<KV_TILE, HEAD_DIM_V_PAD, V_STRIDE, DSA_BWD_THREADS>(
        v_s, v + sv.v_base + kv * v_head + (long long)key0 * v_row, v_row, keys_here, dv);
    cp_async_commit();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    const int wk = warp * 16;
    const auto [k_a, v_a, q_b, do_b, q_bt, do_bt, ds_a, ds_st, k_bt, wq, dq_c] =
        kv_owner_lanes(k_s, v_s, q_s, do_s, ds_s, warp, lane, c0);
    const float cl = scale_log2(scale);
    float acc_k[CHUNK / 8][4], acc_v[CHUNK / 8][4];
#pragma unroll
    for (int n = 0; n < CHUNK / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_k[n][e] = acc_v[n][e] = 0.f;
    }

    for (int a = 0; a < n_row_tiles; ++a) {
        const int first = csr_lo + a * tile_tokens;
        const int tokens_here = min(tile_tokens, csr_hi - first);
        const int rows_here = tokens_here * group;
        const ListedTokens tokens{csr_tokens + first};
        __syncthreads();  // every warp is done with the previous row tile
        load_group_rows_async<Q_TILE, HEAD_DIM_PAD, QK_STRIDE, DSA_BWD_THREADS>(
            q_s, q + sv.q_base, q_head, q_row, first_head, tokens, group, rows_here, d);
        load_group_rows_async<Q_TILE, HEAD_DIM_V_PAD, V_STRIDE, DSA_BWD_THREADS>(
            do_s, d_out + sv.o_base, o_head, o_row, first_head, tokens, group, rows_here, dv);
        cp_async_commit();
        for (int r = threadIdx.x; r < Q_TILE; r += DSA_BWD_THREADS) {
            float bl = POS_INF, dl = 0.f;
            if (r < rows_here) {
                const long long at = sv.lse_base + (long long)(first_head + r % group) * lse_head + tokens(r / group);
                bl = row_bl(lse[at]);
                dl = delta[at];
            }
            bl_s[r] = bl;
            delta_s[r] = dl;
            mask_s[r] = r < tokens_here ? csr_masks[first + r] : 0ull;
        }
        cp_async_wait_all();
        __syncthreads();  // the row tile (and K, V on the first) landed for everyone

        float st[Q_TILE / 8][4], dpt[Q_TILE / 8][4];
#pragma unroll
        for (int n = 0; n < Q_TILE / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
        }
        warp_mma_nt<HEAD_DIM_PAD / 16, Q_TILE / 16, QK_STRIDE>(st, k_a, q_b);
        warp_mma_nt<HEAD_DIM_V_PAD / 16, Q_TILE / 16, V_STRIDE>(dpt, v_a, do_b);
        unsigned dsp[Q_TILE / 8][2];
        tile_p_ds<true>(st, dpt, dsp, bl_s, delta_s, cl, tig, EverySlot{}, tig * 2, wk + g, rows_here - tig * 2,
                        keys_here, NO_BOUND, 0);
        mask_unlisted(st, dsp, mask_s, group, wk + g, tig);
        if (rows_here == Q_TILE) {
            add_dk_dv<true>(acc_k, acc_v, st, dsp, do_bt, q_bt, c0, rows_here);
        } else {
            add_dk_dv<false>(acc_k, acc_v, st, dsp, do_bt, q_bt, c0, rows_here);
        }
    }
    // Drain: a tile no token lists skips the loop, and its K, V copies were never waited for.
    cp_async_wait_all();

    // dK = round_T(α̂ · Σ), dV = round_T(Σ) of the warp's keys.
#pragma unroll
    for (int n = 0; n < CHUNK / 8; ++n) {
        const int col = c0 + n * 8 + tig * 2;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = wk + g + 8 * r;
            if (key >= keys_here) continue;
            if (col < d) {
                elem_t* row = dk_out + sv.k_base + kv * k_head + (long long)(key0 + key) * k_row;
                *reinterpret_cast<unsigned*>(row + col) = pack_elems(to_elem(__fmul_rn(scale, acc_k[n][2 * r])),
                                                                     to_elem(__fmul_rn(scale, acc_k[n][2 * r + 1])));
            }
            if (col < dv) {
                elem_t* row = dv_out + sv.v_base + kv * v_head + (long long)(key0 + key) * v_row;
                *reinterpret_cast<unsigned*>(row + col) = pack_elems(to_elem(acc_v[n][2 * r]), to_elem(acc_v[n][2 * r + 1]));
            }
        }
    }
}
