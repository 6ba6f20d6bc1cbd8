// NSA's selected-block attention backward (the gradients of E18's selection branch, E20, E31) on tensor cores,
// compiled by NVRTC after common.cuh and flash_bwd.cu (gpu/src/nsa/selected_backward.rs), whose helpers, recipe and
// bwd_preprocess (D = rowsum(dO ∘ O)), bwd_csr_scan and bwd_dq_finalize (mode 0) it reuses.
//
// The selection is held fixed: every (token t, query head h of KV head kv's group) row attends to the keys ≤ t of the
// blocks of l' tokens t's list names (lists [token rows, Hkv, n] i32, as nsa_selected.cu reads them), so the backward
// is the dense backward of that visibility.
//
// Kernels (each takes its pointers, the sequence offsets and NsaSelectParams, whose FlashParams is the layer's
// problem under the configuration's scale):
//   nsa_csr_count          one thread per (token, KV head, sequence): adds 1 to the CSR row (sequence, KV head, block)
//                          of every block its list names that starts at or before the token (a later block hides
//                          every key from the token: its rows would add exact zeros). Counts only: any order.
//   nsa_csr_fill           one warp per CSR row: the lanes test 32 tokens at a time from the block's first token and
//                          write the listing tokens ascending from a ballot (E20's transpose, deterministic).
//   nsa_csr_segments       one thread per CSR row: how many segments of at most seg_tokens tokens the KV owner splits
//                          the row into (at least one per block of the sequence, so that every key gets its dK and dV),
//                          scanned into offsets by bwd_csr_scan. NSA's forced first block is listed by every token: one
//                          CTA walking its whole row would run T·G/64 tiles while the others run about n·l'·G/64.
//   nsa_selected_bwd_kv    the KV owner: one CTA of four warps per (segment of a block's CSR row, KV tile of 64 keys
//                          inside the block; KV head × column chunk; sequence), warp w owning keys 16w … 16w + 15. It
//                          walks its segment in tiles of ⌊64/G⌋ tokens × G heads (rows token-major, the group's heads consecutive, as the
//                          forward's CTAs), gathering each row's Q, dO, LSE and D, and runs bwd_kv's step on every
//                          tile: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, Pᵀ and dSᵀ (tile_p_ds, each row's diagonal its token), dV +=
//                          round_T(P)ᵀ dO and dK += dSᵀ Q, and dQ = dS K added to an f32 accumulator with vector atomics
//                          (dq_mode 1) or stored as the row's partial of this (block, tile) (dq_mode 2). Because a CTA
//                          holds every head of the group, its dK and dV already sum the group: a block of one segment
//                          writes them rounded (dK = round_T(α̂ · dK)); a block of several writes each segment's f32
//                          sums to its slot of a workspace. Keys that no token attends to get zeros.
//   nsa_dkv_finalize       blocks of several segments: dK = round_T(α̂ · Σ), dV = round_T(Σ) over the segments' sums in
//                          ascending segment order (so dK and dV are bitwise reproducible in both dQ modes).
//   nsa_dq_finalize_partials   dq_mode 2: dQ = round_T(α̂ · Σ partials) per row, in ascending slot order (the list's
//                          order, then the block's tiles): bitwise reproducible.
//
// Every element's arithmetic is flash_bwd.cu's (its header states the recipe); the sums differ in how many terms and
// partial sums they gather: a key's dK and dV chain runs over every (token, head) row that sees it, in tiles of up to
// 64 rows (the bound's query tile), and a row's dQ collects one partial per visited KV tile.
//
// Device lists are read defensively, with nsa_selected.cu's rule (list_entry_continues): the count and the fill read
// the same prefix of each list, so the CSR's rows hold exactly the counted entries.

#define NSA_BWD_THREADS (KV_WARPS * 32)

static_assert(KV_WARPS == 4, "nsa_selected_bwd_kv owns KV tiles of 64 keys (KV_WARPS = 4)");

// The position of `block` in a device list of n entries (read with list_entry_continues in a sequence of seq_blocks
// blocks of block_len tokens), or −1 where the list does not name it or the block starts after `token`.
__device__ __forceinline__ int listed_position(const int* __restrict__ list, int n, int seq_blocks, int block,
                                               int block_len, int token) {
    if (block * block_len > token) return -1;
    int previous = -1;
    for (int e = 0; e < n; ++e) {
        const int x = __ldg(list + e);
        if (!list_entry_continues(x, previous, seq_blocks) || x > block) return -1;
        if (x == block) return e;
        previous = x;
    }
    return -1;
}

// The end of block `block` (of lb tokens) in a sequence of len tokens: a KV tile never runs past its block.
__device__ __forceinline__ int block_end(int block, int lb, int len) { return min(block * lb + lb, len); }

// One sequence's token range and list rows.
struct NsaSeq {
    int len;               // tokens (queries and keys: causal self-attention)
    long long token_row0;  // the sequence's first row of the lists
    int seq_blocks;        // its selection blocks
};

__device__ __forceinline__ NsaSeq nsa_seq(const NsaSelectParams& params, const int* __restrict__ cu_q, int seq) {
    const FlashParams& fp = params.flash;
    NsaSeq s;
    s.len = fp.varlen ? cu_q[seq + 1] - cu_q[seq] : fp.dense_len_q;
    s.token_row0 = fp.varlen ? (long long)cu_q[seq] : (long long)seq * fp.dense_len_q;
    s.seq_blocks = (s.len + params.select_block - 1) / params.select_block;
    return s;
}

// The list of token t (of the sequence) for KV head kv.
__device__ __forceinline__ const int* token_list(const int* __restrict__ lists, const NsaSelectParams& params,
                                                 const NsaSeq& s, int t, int kv) {
    return lists + ((s.token_row0 + t) * params.n_heads_kv + kv) * params.n_selected;
}

// The first CSR row of (sequence, KV head): rows are (sequence, KV head, block of the longest sequence).
__device__ __forceinline__ long long csr_row0(const NsaSelectParams& params, int seq, int kv) {
    return ((long long)seq * params.n_heads_kv + kv) * params.n_blocks;
}

extern "C" __global__ void __launch_bounds__(THREADS)
nsa_csr_count(const int* __restrict__ lists, int* __restrict__ counts, const int* __restrict__ cu_q,
              const NsaSelectParams params) {
    const int seq = blockIdx.z, kv = blockIdx.y;
    const NsaSeq s = nsa_seq(params, cu_q, seq);
    const int t = blockIdx.x * THREADS + threadIdx.x;
    if (t >= s.len) return;
    const int* list = token_list(lists, params, s, t, kv);
    int* row_counts = counts + csr_row0(params, seq, kv);
    int previous = -1;
    for (int e = 0; e < params.n_selected; ++e) {
        const int block = list[e];
        if (!list_entry_continues(block, previous, s.seq_blocks)) break;
        if (block * params.select_block <= t) atomicAdd(row_counts + block, 1);
        previous = block;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
nsa_csr_fill(const int* __restrict__ lists, const int* __restrict__ csr_offsets, int* __restrict__ csr_tokens,
             const int* __restrict__ cu_q, const NsaSelectParams params) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int seq = blockIdx.z, kv = blockIdx.y, block = blockIdx.x * NUM_WARPS + warp;
    const NsaSeq s = nsa_seq(params, cu_q, seq);
    if (block >= s.seq_blocks) return;
    int written = csr_offsets[csr_row0(params, seq, kv) + block];
    for (int base = block * params.select_block; base < s.len; base += 32) {
        const int t = base + lane;
        const bool listed = t < s.len && listed_position(token_list(lists, params, s, t, kv), params.n_selected,
                                                         s.seq_blocks, block, params.select_block, t) >= 0;
        const unsigned ballot = __ballot_sync(0xffffffffu, listed);
        if (listed) csr_tokens[written + __popc(ballot & ((1u << lane) - 1u))] = t;
        written += __popc(ballot);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
nsa_csr_segments(const int* __restrict__ csr_offsets, int* __restrict__ seg_offsets, const int* __restrict__ cu_q,
                 const NsaSelectParams params, const int seg_tokens) {
    const int seq = blockIdx.z, kv = blockIdx.y, block = blockIdx.x * THREADS + threadIdx.x;
    if (block >= params.n_blocks) return;
    const NsaSeq s = nsa_seq(params, cu_q, seq);
    const long long row = csr_row0(params, seq, kv) + block;
    const int count = csr_offsets[row + 1] - csr_offsets[row];
    seg_offsets[row] = block < s.seq_blocks ? max(1, (count + seg_tokens - 1) / seg_tokens) : 0;
}

// The CSR row (a block of the sequence) holding segment `g` (counted over every row): the last row of (sequence, KV
// head) whose first segment is at or before `g`, by binary search over the scanned segment offsets (rows past the
// sequence have no segment and share the end offset, so they are never found for a `g` below it).
__device__ __forceinline__ int segment_block(const int* __restrict__ seg_offsets, long long row0, int n_blocks,
                                             int g) {
    int lo = 0, hi = n_blocks - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (seg_offsets[row0 + mid] <= g) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// A gathered tile's row diagonals for tile_p_ds: row r (counted from the tile's first row) is a query of token
// tokens[r / group], which sees the keys up to its token.
struct TokenDiagonals {
    const int* tokens;
    int group;
    __device__ __forceinline__ int at(int row) const { return tokens[row / group]; }
};

extern "C" __global__ void __launch_bounds__(NSA_BWD_THREADS, 2)
nsa_selected_bwd_kv(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                    const elem_t* __restrict__ d_out, const float* __restrict__ lse, const float* __restrict__ delta,
                    elem_t* __restrict__ dk_out, elem_t* __restrict__ dv_out, float* __restrict__ dq_acc,
                    float* __restrict__ dq_part, float* __restrict__ dkv_part, const int* __restrict__ lists,
                    const int* __restrict__ csr_offsets, const int* __restrict__ csr_tokens,
                    const int* __restrict__ seg_offsets, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                    const NsaSelectParams params, const long long part_stride, const int dq_mode, const int n_chunks,
                    const int seg_tokens, const long long dkv_slots) {
    UNPACK_FLASH_PARAMS(params.flash);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* k_s = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* v_s = k_s + KV_TILE * QK_STRIDE;
    elem_t* q_s = v_s + KV_TILE * V_STRIDE;              // [Q_STAGES][Q_TILE][QK_STRIDE]
    elem_t* do_s = q_s + Q_STAGES * Q_TILE * QK_STRIDE;  // [Q_STAGES][Q_TILE][V_STRIDE]
    elem_t* ds_s = do_s + Q_STAGES * Q_TILE * V_STRIDE;  // [Q_TILE][DS_STRIDE]
    float* bl_s = reinterpret_cast<float*>(ds_s + Q_TILE * DS_STRIDE);  // [Q_STAGES][Q_TILE] each
    float* delta_s = bl_s + Q_STAGES * Q_TILE;
    __shared__ int tok_s[Q_STAGES][Q_TILE];   // each stage's tokens (at most 64)
    __shared__ int slot_s[Q_STAGES][Q_TILE];  // dq_mode 2: each token's partial slot

    const int lb = params.select_block;
    const int tiles_per_block = (lb + KV_TILE - 1) / KV_TILE;
    const int sub = blockIdx.x % tiles_per_block;
    const int kv = ONE_CHUNK ? blockIdx.y : blockIdx.y / n_chunks;
    const int c0 = ONE_CHUNK ? 0 : (blockIdx.y % n_chunks) * CHUNK;
    const int seq = blockIdx.z;
    const NsaSeq ns = nsa_seq(params, cu_q, seq);
    // The CTA's segment: the grid covers the most segments (sequence, KV head) can have; the rest return.
    const long long row0 = csr_row0(params, seq, kv);
    const int seg = seg_offsets[row0] + (int)(blockIdx.x / tiles_per_block);
    if (seg >= seg_offsets[row0 + params.n_blocks]) return;
    const int block = segment_block(seg_offsets, row0, params.n_blocks, seg);
    const int segment = seg - seg_offsets[row0 + block];
    const int n_segments = seg_offsets[row0 + block + 1] - seg_offsets[row0 + block];
    const int key0 = block * lb + sub * KV_TILE;
    const int key_end = block_end(block, lb, ns.len);
    if (block >= ns.seq_blocks || key0 >= key_end) return;
    const int keys_here = min(KV_TILE, key_end - key0);
    const SeqView sv = SEQ_VIEW(seq);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    const int wk = warp * 16;
    const int first_head = kv * group;
    // Tokens per row tile: the group's heads of each, rows token-major.
    const int tile_tokens = Q_TILE / group;
    const long long csr_row = row0 + block;
    const int csr_lo = csr_offsets[csr_row] + segment * seg_tokens;
    const int csr_hi = min(csr_offsets[csr_row + 1], csr_lo + seg_tokens);
    const int n_tiles = (csr_hi - csr_lo + tile_tokens - 1) / tile_tokens;

    const elem_t* k_tile = k + sv.k_base + kv * k_head + (long long)key0 * k_row;
    const elem_t* v_tile = v + sv.v_base + kv * v_head + (long long)key0 * v_row;
    load_tile_async<KV_TILE, HEAD_DIM_PAD, QK_STRIDE, NSA_BWD_THREADS>(k_s, k_tile, k_row, keys_here, d);
    load_tile_async<KV_TILE, HEAD_DIM_V_PAD, V_STRIDE, NSA_BWD_THREADS>(v_s, v_tile, v_row, keys_here, dv);
    // Starts loading row tile `a` into `stage`: the gathered Q and dO rows by cp.async, the tokens, slots and row
    // statistics (b_L = fl32(LSE · log2 e) and D; +∞ and 0 past the valid rows) by plain loads.
    auto load_rows = [&](int a, int stage) {
        const int first = csr_lo + a * tile_tokens;
        const int tokens_here = min(tile_tokens, csr_hi - first);
        const int rows = tokens_here * group;
        const ListedTokens tokens{csr_tokens + first};
        load_group_rows_async<Q_TILE, HEAD_DIM_PAD, QK_STRIDE, NSA_BWD_THREADS>(
            q_s + stage * Q_TILE * QK_STRIDE, q + sv.q_base, q_head, q_row, first_head, tokens, group, rows, d);
        load_group_rows_async<Q_TILE, HEAD_DIM_V_PAD, V_STRIDE, NSA_BWD_THREADS>(
            do_s + stage * Q_TILE * V_STRIDE, d_out + sv.o_base, o_head, o_row, first_head, tokens, group, rows, dv);
        for (int r = threadIdx.x; r < Q_TILE; r += NSA_BWD_THREADS) {
            float bl = POS_INF, dl = 0.f;
            if (r < rows) {
                const long long at = sv.lse_base + (long long)(first_head + r % group) * lse_head + tokens(r / group);
                bl = row_bl(lse[at]);
                dl = delta[at];
            }
            bl_s[stage * Q_TILE + r] = bl;
            delta_s[stage * Q_TILE + r] = dl;
            if (r < tile_tokens) {
                const int t = r < tokens_here ? tokens(r) : 0;
                tok_s[stage][r] = t;
                slot_s[stage][r] =
                    dq_mode == 2 && r < tokens_here
                        ? listed_position(token_list(lists, params, ns, t, kv), params.n_selected, ns.seq_blocks,
                                          block, lb, t) * tiles_per_block + sub
                        : 0;
            }
        }
    };
    int a = 0;
    if (a < n_tiles) load_rows(a, 0);
    cp_async_commit();

    const auto [k_a, v_a, q_b, do_b, q_bt, do_bt, ds_a, ds_st, k_bt, wq, dq_c] =
        kv_owner_lanes(k_s, v_s, q_s, do_s, ds_s, warp, lane, c0);
    const int key_t = key0 + wk + g;
    const float cl = scale_log2(scale);

    float acc_k[CHUNK / 8][4], acc_v[CHUNK / 8][4];
#pragma unroll
    for (int n = 0; n < CHUNK / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_k[n][e] = acc_v[n][e] = 0.f;
    }

    for (int visit = 0; a < n_tiles; ++visit) {
        const int stage = Q_STAGES == 2 ? visit & 1 : 0;
        if (Q_STAGES == 1 && visit > 0) {
            __syncthreads();  // every warp is done with the previous tile's rows and dS
            load_rows(a, 0);
            cp_async_commit();
        }
        cp_async_wait_all();
        __syncthreads();  // tile a (and K, V) landed for everyone; every warp is done with the previous tile
        const int a_next = a + 1;
        if (Q_STAGES == 2 && a_next < n_tiles) {
            load_rows(a_next, stage ^ 1);
            cp_async_commit();
        }
        const int tokens_here = min(tile_tokens, csr_hi - (csr_lo + a * tile_tokens));
        const int rows_here = tokens_here * group;
        const unsigned q_off = stage * Q_TILE * QK_STRIDE * ESZ;
        const unsigned do_off = stage * Q_TILE * V_STRIDE * ESZ;
        const float* bl_t = bl_s + stage * Q_TILE;
        const float* delta_t = delta_s + stage * Q_TILE;
        const int* tok_t = tok_s[stage];

        float st[Q_TILE / 8][4], dpt[Q_TILE / 8][4];
#pragma unroll
        for (int n = 0; n < Q_TILE / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
        }
        warp_mma_nt<HEAD_DIM_PAD / 16, Q_TILE / 16, QK_STRIDE>(st, k_a, q_b + q_off);
        warp_mma_nt<HEAD_DIM_V_PAD / 16, Q_TILE / 16, V_STRIDE>(dpt, v_a, do_b + do_off);

        // The tile's tokens ascend, so its first token is its smallest: a warp whose 16 keys are all valid and at or
        // before that token needs no mask (rows past the valid ones are zero with b_L = +∞: p = 0, dS = 0).
        const int wkey0 = key0 + wk;
        const TokenDiagonals diag{tok_t, group};
        unsigned dsp[Q_TILE / 8][2];
        if (wkey0 + 16 <= key_end && wkey0 + 15 <= tok_t[0]) {
            tile_p_ds<false>(st, dpt, dsp, bl_t, delta_t, cl, tig, diag, 0, 0, 0, 0, 0, 0);
        } else {
            tile_p_ds<true>(st, dpt, dsp, bl_t, delta_t, cl, tig, diag, tig * 2, key_t, rows_here - tig * 2, key_end,
                            NO_BOUND, 0);
        }

        if (rows_here == Q_TILE) {
            add_dk_dv<true>(acc_k, acc_v, st, dsp, do_bt + do_off, q_bt + q_off, c0, rows_here);
        } else {
            add_dk_dv<false>(acc_k, acc_v, st, dsp, do_bt + do_off, q_bt + q_off, c0, rows_here);
        }

        if (c0 < d) {
#pragma unroll
            for (int n = 0; n < Q_TILE / 8; n += 2) {
                stsm_x4_trans(ds_st + n * 8 * DS_STRIDE * ESZ, dsp[n][0], dsp[n][1], dsp[n + 1][0], dsp[n + 1][1]);
            }
            __syncthreads();
            float part[DQ_MT][DQ_COLS / 8][4];
            if (keys_here == KV_TILE) {
                tile_dq<true>(part, ds_a, k_bt, dq_c, keys_here);
            } else {
                tile_dq<false>(part, ds_a, k_bt, dq_c, keys_here);
            }
            // Each row's dQ goes to its own (token, head) row: the accumulator (mode 1) or its partial (mode 2).
#pragma unroll
            for (int rr = 0; rr < 2 * DQ_MT; ++rr) {
                const int mt = rr / 2, r = rr % 2;
                const int row = wq + 16 * mt + g + 8 * r;
                const bool row_live = row < rows_here;
                const int token = tok_t[row_live ? row / group : 0];
                const long long at =
                    sv.q_base + (long long)(first_head + row % group) * q_head + (long long)token * q_row;
                float* dq_row = dq_mode == 1 ? dq_acc + at
                                             : dq_part + (long long)slot_s[stage][row_live ? row / group : 0] *
                                                             part_stride + at;
#pragma unroll
                for (int n = 0; n < DQ_COLS / 8; ++n) {
                    const int col = dq_c + n * 8 + tig * 2;
                    const bool live = row_live && col < d;
                    if (dq_mode == 1) {
                        red_add_v2(live, dq_row + col, part[mt][n][2 * r], part[mt][n][2 * r + 1]);
                    } else {
                        store_v2(live, dq_row + col, part[mt][n][2 * r], part[mt][n][2 * r + 1]);
                    }
                }
            }
        }
        a = a_next;
    }
    // Drain: a CTA whose block no token attends to skips the loop, and its K, V copies were never waited for.
    cp_async_wait_all();

    // dK = round_T(α̂ · Σ), dV = round_T(Σ) over every row of the group: written directly by a block's only segment,
    // else this segment's f32 sums to its slot ([slot][64 keys][d], then [slot][64 keys][dv] after all slots' dK).
    const bool direct = n_segments == 1;
    const long long slot = (long long)seg * tiles_per_block + sub;
    float* part_k = dkv_part + slot * KV_TILE * d;
    float* part_v = dkv_part + dkv_slots * KV_TILE * d + slot * KV_TILE * dv;
#pragma unroll
    for (int n = 0; n < CHUNK / 8; ++n) {
        const int col = c0 + n * 8 + tig * 2;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = wk + g + 8 * r;
            if (key >= keys_here) continue;
            const KvGradRow<false> dk_row{dk_out + sv.k_base + kv * k_head + (long long)(key0 + key) * k_row,
                                          part_k + key * d, d, scale, direct};
            const KvGradRow<true> dv_row{dv_out + sv.v_base + kv * v_head + (long long)(key0 + key) * v_row,
                                         part_v + key * dv, dv, scale, direct};
            dk_row.store(col, acc_k[n][2 * r], acc_k[n][2 * r + 1]);
            dv_row.store(col, acc_v[n][2 * r], acc_v[n][2 * r + 1]);
        }
    }
}

// Blocks of several segments: dK = round_T(α̂ · Σ) and dV = round_T(Σ) over the segments' f32 sums, in ascending
// segment order. One CTA per (KV tile of a block, KV head, sequence); blocks of one segment return (their only CTA
// wrote them).
extern "C" __global__ void __launch_bounds__(THREADS)
nsa_dkv_finalize(const float* __restrict__ dkv_part, elem_t* __restrict__ dk_out, elem_t* __restrict__ dv_out,
                 const int* __restrict__ seg_offsets, const int* __restrict__ cu_q, const NsaSelectParams params,
                 const long long dkv_slots) {
    UNPACK_FLASH_PARAMS(params.flash);
    const int* cu_k = cu_q;  // self-attention: SEQ_VIEW reads the keys' offsets too
    const int lb = params.select_block;
    const int tiles_per_block = (lb + KV_TILE - 1) / KV_TILE;
    const int block = blockIdx.x / tiles_per_block, sub = blockIdx.x % tiles_per_block;
    const int kv = blockIdx.y, seq = blockIdx.z;
    const NsaSeq ns = nsa_seq(params, cu_q, seq);
    const int key0 = block * lb + sub * KV_TILE;
    const int key_end = block_end(block, lb, ns.len);
    if (block >= ns.seq_blocks || key0 >= key_end) return;
    const long long row = csr_row0(params, seq, kv) + block;
    const int first = seg_offsets[row], n_segments = seg_offsets[row + 1] - first;
    if (n_segments <= 1) return;
    const SeqView sv = SEQ_VIEW(seq);
    const int keys_here = min(KV_TILE, key_end - key0);
    const int width = max(d, dv);
    for (int idx = threadIdx.x; idx < keys_here * width; idx += THREADS) {
        const int key = idx / width, col = idx % width;
        float tot_k = 0.f, tot_v = 0.f;
        for (int s = 0; s < n_segments; ++s) {
            const long long slot = (long long)(first + s) * tiles_per_block + sub;
            if (col < d) tot_k = __fadd_rn(tot_k, dkv_part[(slot * KV_TILE + key) * d + col]);
            if (col < dv) tot_v = __fadd_rn(tot_v, dkv_part[dkv_slots * KV_TILE * d + (slot * KV_TILE + key) * dv + col]);
        }
        if (col < d) dk_out[sv.k_base + kv * k_head + (long long)(key0 + key) * k_row + col] =
            to_elem(__fmul_rn(scale, tot_k));
        if (col < dv) dv_out[sv.v_base + kv * v_head + (long long)(key0 + key) * v_row + col] = to_elem(tot_v);
    }
}

// dq_mode 2: dQ = round_T(α̂ · x), x the sum of the row's n · ⌈l'/64⌉ partials in ascending slot order (slots no KV
// tile wrote are zero: the host zeroes the workspace). One thread per (token row, query head, column pair).
extern "C" __global__ void __launch_bounds__(THREADS)
nsa_dq_finalize_partials(const float* __restrict__ dq_part, elem_t* __restrict__ dq, const int* __restrict__ cu_q,
                         const NsaSelectParams params, const long long part_stride, const int slots) {
    UNPACK_FLASH_PARAMS(params.flash);
    const int* cu_k = cu_q;  // self-attention: SEQ_VIEW reads the keys' offsets too
    const int seq = blockIdx.z, head = blockIdx.y;
    const NsaSeq ns = nsa_seq(params, cu_q, seq);
    const SeqView sv = SEQ_VIEW(seq);
    const int pairs = (d + 1) / 2;
    const long long idx = (long long)blockIdx.x * THREADS + threadIdx.x;
    if (idx >= (long long)ns.len * pairs) return;
    const int t = (int)(idx / pairs), col = (int)(idx % pairs) * 2;
    const long long at = sv.q_base + (long long)head * q_head + (long long)t * q_row + col;
    float x0 = 0.f, x1 = 0.f;
    for (int slot = 0; slot < slots; ++slot) {
        const float2 p = *reinterpret_cast<const float2*>(dq_part + (long long)slot * part_stride + at);
        x0 = __fadd_rn(x0, p.x);
        x1 = __fadd_rn(x1, p.y);
    }
    *reinterpret_cast<unsigned*>(dq + at) = pack_elems(to_elem(__fmul_rn(scale, x0)), to_elem(__fmul_rn(scale, x1)));
}
