// The backward's KV owner (bwd_kv, E6–E10) on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a only),
// compiled by NVRTC after common.cuh, sm90.cuh and flash_bwd.cu (see gpu/src/compile.rs), whose other kernels
// (bwd_preprocess, bwd_kv_group_sum, bwd_dq, bwd_dq_finalize and the CSR transpose) it shares; the host defines
// BWD_KV_SM90 so that flash_bwd.cu leaves bwd_kv to this file. The launch wrappers pick it where it applies
// (gpu/src/backward.rs): compute capability 9.0, head dims up to 128, and, block-sparse, key blocks of 128 keys.
//
// One CTA of two warpgroups (8 warps, 256 threads) per (KV tile of KV_TILE = 128 keys, query head, sequence), as
// flash_bwd.cu's bwd_kv with KV_WARPS = 8: warpgroup w owns keys 64w … 64w + 63, its warp v the 16 keys 64w + 16v …,
// and a thread's accumulators have the m16n8 fragment layout there (key rows g and g + 8, query columns 2·tig and + 1
// of every 8-column block), so that flash_bwd.cu's tile_p_ds forms Pᵀ and dSᵀ unchanged. For every query tile of
// Q_TILE = 64 rows the CTA visits (kv_owner_cursor, the same walk):
//   Sᵀ  = K Qᵀ           wgmma m64n64k16, K and Q in shared memory (K-major), over d
//   dPᵀ = V dOᵀ          wgmma m64n64k16, V and dO in shared memory (K-major), over dv
//   Pᵀ, dSᵀ              tile_p_ds: the recipe of flash_bwd.cu's header, element for element
//   dV += round_T(P)ᵀ dO  wgmma m64n{64,128}k16, Pᵀ from registers, dO in shared memory (N-major), over the queries
//   dK += dSᵀ Q           likewise with dSᵀ and Q
//   dQ  = dS K            dSᵀ stored to shared memory (rows are keys), then wgmma m64n64k16 with both operands
//                         MN-major (transposed): warpgroup w computes dQ's columns 64w … 64w + 63 over the tile's 128
//                         keys (at d ≤ 64 warpgroup 0 alone); added to the f32 accumulator with vector atomics
//                         (dq_mode 1) or written as the tile's partial (dq_mode 2), as bwd_kv does.
// Every product accumulates in f32 on the tensor cores in k-steps of 16, as the mma.sync kernels do, so the recipe
// and its rounding-error model (gpu/src/backward.rs) hold unchanged: the model counts a sum of n terms over t tiles
// as at most ⌈n/16⌉ + t instructions, and padded rows and columns are zeros, whose products add nothing.
//
// Shared memory (sm90.cuh's 128-byte swizzle, 64-column chunks of 128-byte rows, each on a 1024-byte boundary; the
// kernel aligns the dynamic window itself and the host asks for 1024 more bytes): K and V of the KV tile, loaded
// once; Q and dO of the query tile in two stages (tile a + 1 loads by cp.async while tile a computes); dSᵀ, 128 keys
// × 64 queries; the query tile's b_L = fl32(LSE · log2 e) and D, per stage. Tail rows and padding columns are zero.
// One CTA barrier at the top of each visit (the tile's copies landed for every thread, every warp is done with the
// previous visit's stage and dSᵀ) and one before the dQ product (both warpgroups' dSᵀ stored). Each thread waits for
// its copies of the next tile and fences them for the tensor cores at the end of the visit before, ahead of its dQ
// atomics: the fence waits for the thread's outstanding memory operations, and at the top of the visit the atomics
// were among them (docs/gpu-performance.md has the profile; the move gained about 1%).
//
// Compile-time parameters: flash_bwd.cu's, with BWD_KV_SM90, KV_WARPS = 8, and HEAD_DIM_PAD, HEAD_DIM_V_PAD each 64
// or 128. No KV_ACCUM mode: the ring backward runs flash_bwd.cu's bwd_kv.

#if !defined(BWD_KV_SM90)
#error "flash_bwd_sm90.cu is compiled with BWD_KV_SM90, which keeps flash_bwd.cu's bwd_kv out"
#endif
#if defined(KV_ACCUM)
#error "flash_bwd_sm90.cu has no KV_ACCUM mode; the ring backward runs flash_bwd.cu's bwd_kv"
#endif
#if !(HEAD_DIM_PAD == 64 || HEAD_DIM_PAD == 128) || !(HEAD_DIM_V_PAD == 64 || HEAD_DIM_V_PAD == 128)
#error "HEAD_DIM_PAD and HEAD_DIM_V_PAD must be 64 or 128"
#endif
static_assert(KV_WARPS == 8 && KV_TILE == 128 && Q_TILE == 64, "two warpgroups of 64 keys over query tiles of 64");

#define SM90_QK_CHUNKS (HEAD_DIM_PAD / 64)
#define SM90_V_CHUNKS (HEAD_DIM_V_PAD / 64)
#define SM90_K_BYTES (SM90_QK_CHUNKS * KV_TILE * SW_ROW)
#define SM90_V_BYTES (SM90_V_CHUNKS * KV_TILE * SW_ROW)
#define SM90_Q_BYTES (SM90_QK_CHUNKS * Q_TILE * SW_ROW)
#define SM90_DO_BYTES (SM90_V_CHUNKS * Q_TILE * SW_ROW)
// dSᵀ: KV_TILE rows of Q_TILE = 64 queries, one chunk.
#define SM90_DS_BYTES (KV_TILE * SW_ROW)
// Warpgroups computing dQ: each takes 64 of its columns.
#define SM90_DQ_GROUPS (HEAD_DIM_PAD / 64)

// acc (64 keys × 64 queries) = A Bᵀ over K_STEPS k-steps of 16: A (the warpgroup's 64 rows of K or V, in chunks of
// KV_TILE rows) and B (the query tile's Q or dO, in chunks of Q_TILE rows), both K-major.
template <int K_STEPS>
__device__ __forceinline__ void transposed_scores(float (&acc)[Q_TILE / 8][4], unsigned a_addr, unsigned b_addr) {
#pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk) {
        wgmma_ss_m64n64k16<0, 0>(acc, smem_desc(a_addr + (kk / 4) * (KV_TILE * SW_ROW) + (kk % 4) * 32, 16, 1024),
                                 smem_desc(b_addr + (kk / 4) * (Q_TILE * SW_ROW) + (kk % 4) * 32, 16, 1024), kk > 0);
    }
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1)
bwd_kv(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
       const elem_t* __restrict__ d_out, const float* __restrict__ lse, const float* __restrict__ delta,
       elem_t* __restrict__ dk_out, elem_t* __restrict__ dv_out, float* __restrict__ dq_acc,
       float* __restrict__ dq_part, float* __restrict__ dkv_part, COMMON_PARAMS SPARSE_PARAMS) {
    UNPACK_FLASH_PARAMS(params.flash);
    const int dq_mode = params.dq_mode;
    const long long part_stride = params.part_stride;
    const long long total_k = params.total_k;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* k_s = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    unsigned char* v_s = k_s + SM90_K_BYTES;
    unsigned char* q_s = v_s + SM90_V_BYTES;          // two stages
    unsigned char* do_s = q_s + 2 * SM90_Q_BYTES;     // two stages
    unsigned char* ds_s = do_s + 2 * SM90_DO_BYTES;   // dSᵀ
    float* bl_s = reinterpret_cast<float*>(ds_s + SM90_DS_BYTES);  // [2][Q_TILE]
    float* delta_s = bl_s + 2 * Q_TILE;                           // [2][Q_TILE]

    const int b = blockIdx.x;
    const int head = blockIdx.y;
    const SeqView sv = SEQ_VIEW(blockIdx.z);
    const int key0 = b * KV_TILE;
    if (key0 >= sv.len_k) return;
    const int keys_here = min(KV_TILE, sv.len_k - key0);
    const Diagonal diag = row_diagonal(params.flash, sv.len_q, sv.len_k);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    const int wg = warp / 4;          // the warpgroup
    const int wrow = (warp % 4) * 16;  // the warp's 16 rows inside its warpgroup's 64
    const int wk = wg * 64 + wrow;     // the warp's first key in the tile

    const KvOwnerTensors tensors = kv_owner_tensors(params.flash, sv, head, key0, q, k, v, d_out, lse, delta);
    load_swizzled_async<KV_TILE, SM90_QK_CHUNKS, KV_THREADS>(k_s, tensors.k_tile, k_row, keys_here, d);
    load_swizzled_async<KV_TILE, SM90_V_CHUNKS, KV_THREADS>(v_s, tensors.v_tile, v_row, keys_here, dv);
    // Starts loading query tile `a` into `stage`: Q and dO by cp.async, the row statistics by plain loads.
    auto load_q_tile = [&](int a, int stage) {
        const int row0 = a * Q_TILE;
        const int rows = min(Q_TILE, sv.len_q - row0);
        load_swizzled_async<Q_TILE, SM90_QK_CHUNKS, KV_THREADS>(q_s + stage * SM90_Q_BYTES,
                                                                tensors.q_g + (long long)row0 * q_row, q_row, rows, d);
        load_swizzled_async<Q_TILE, SM90_V_CHUNKS, KV_THREADS>(do_s + stage * SM90_DO_BYTES,
                                                               tensors.do_g + (long long)row0 * o_row, o_row, rows, dv);
        tensors.load_row_stats<KV_THREADS>(bl_s + stage * Q_TILE, delta_s + stage * Q_TILE, row0, rows);
    };
    TileCursor cursor = kv_owner_cursor(params.flash, b, sv, head SPARSE_ARGS);
    int a = cursor.next();
    if (a >= 0) load_q_tile(a, 0);
    cp_async_commit();
    // Each visit ends by waiting for its thread's copies of the next tile (here, of the first) and ordering them before
    // the tensor cores' reads; the barrier at the top of the visit then shows every thread's to all.
    cp_async_wait_all();
    fence_proxy_async();

    // The warpgroup's 64 keys of K and V (A operands of Sᵀ and dPᵀ), the KV tile's columns 64·wg … of K (the B operand
    // of dQ), and dSᵀ.
    const unsigned k_addr = smem_u32(k_s) + wg * 64 * SW_ROW;
    const unsigned v_addr = smem_u32(v_s) + wg * 64 * SW_ROW;
    const unsigned k_dq_addr = smem_u32(k_s) + wg * (KV_TILE * SW_ROW);
    const unsigned ds_addr = smem_u32(ds_s);
    const int key_t = key0 + wk + g;  // the key of the thread's accumulator rows g (and key_t + 8: row g + 8)
    const float cl = scale_log2(scale);

    float acc_k[HEAD_DIM_PAD / 8][4], acc_v[HEAD_DIM_V_PAD / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM_PAD / 8; ++n) acc_k[n][0] = acc_k[n][1] = acc_k[n][2] = acc_k[n][3] = 0.f;
#pragma unroll
    for (int n = 0; n < HEAD_DIM_V_PAD / 8; ++n) acc_v[n][0] = acc_v[n][1] = acc_v[n][2] = acc_v[n][3] = 0.f;

    for (int visit = 0; a >= 0; ++visit) {
        const int stage = visit & 1;
        __syncthreads();  // tile a (and K, V) landed for everyone; every warp is done with the previous visit
        const int a_next = cursor.next();
        if (a_next >= 0) load_q_tile(a_next, stage ^ 1);
        cp_async_commit();
        const int row0 = a * Q_TILE;
        const int rows_here = min(Q_TILE, sv.len_q - row0);
        const unsigned q_addr = smem_u32(q_s + stage * SM90_Q_BYTES);
        const unsigned do_addr = smem_u32(do_s + stage * SM90_DO_BYTES);
        const float* bl_t = bl_s + stage * Q_TILE;
        const float* delta_t = delta_s + stage * Q_TILE;

        // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warpgroup's 64 keys and the tile's 64 queries.
        float st[Q_TILE / 8][4], dpt[Q_TILE / 8][4];  // written whole by their first k-step
        wgmma_fence();
        transposed_scores<HEAD_DIM_PAD / 16>(st, k_addr, q_addr);
        transposed_scores<HEAD_DIM_V_PAD / 16>(dpt, v_addr, do_addr);
        wgmma_commit();
        wgmma_wait<0>();

        // Pᵀ (kept in st, f32) and dSᵀ (in dsp, rounded to T and packed). Only a warp whose 16 keys some row of the
        // tile does not see completely pays for the mask.
        unsigned dsp[Q_TILE / 8][2];
        if (warp_keys_interior(sv, rows_here, row0, key0 + wk, diag, win_left, win_right)) {
            tile_p_ds<false>(st, dpt, dsp, bl_t, delta_t, cl, tig, diag, 0, 0, 0, 0, 0, 0);
        } else {
            tile_p_ds<true>(st, dpt, dsp, bl_t, delta_t, cl, tig, diag, row0 + tig * 2, key_t, rows_here - tig * 2,
                            sv.len_k, win_left, win_right);
        }

        // dV += round_T(P)ᵀ dO and dK += dSᵀ Q over the tile's queries (k = queries; dO and Q N-major).
        unsigned pa[Q_TILE / 16][4];
#pragma unroll
        for (int kk = 0; kk < Q_TILE / 16; ++kk) pack_a(pa[kk], st[2 * kk], st[2 * kk + 1]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < Q_TILE / 16; ++kk) {
            wgmma_rs_n<HEAD_DIM_V_PAD>(acc_v, pa[kk], smem_desc(do_addr + kk * 16 * SW_ROW, Q_TILE * SW_ROW, 1024));
        }
#pragma unroll
        for (int kk = 0; kk < Q_TILE / 16; ++kk) {
            unsigned sa[4];
            ds_fragment(sa, dsp, kk);
            wgmma_rs_n<HEAD_DIM_PAD>(acc_k, sa, smem_desc(q_addr + kk * 16 * SW_ROW, Q_TILE * SW_ROW, 1024));
        }
        wgmma_commit();

        // dQ of this KV tile: dSᵀ (keys × queries) through shared memory, times K (k = keys), both MN-major. The next
        // tile's copies are waited for and ordered before the tensor cores' reads once per visit (next_landed), before
        // this visit's dQ atomics where there are any: the fence waits for the thread's outstanding memory operations,
        // which the atomics would otherwise be among at the top of the next visit.
        bool next_landed = false;
        if (dq_mode != 0) {
            // dsp[n][h] holds queries 8n + 2·tig, + 1 of key row wk + g + 8h: one 4-byte word of that row's 16-byte
            // unit n, which the swizzle moves to unit n ^ (row % 8) = n ^ g (wk and 8h are multiples of 8). The
            // addresses are formed here from two per-row bases rather than kept for the whole kernel: sixteen live
            // addresses were spilled to local memory.
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned row_addr = ds_addr + (wk + g + 8 * h) * SW_ROW + tig * 4;
#pragma unroll
                for (int n = 0; n < Q_TILE / 8; ++n) {
                    const unsigned addr = row_addr + ((n ^ g) << 4);
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(dsp[n][h]) : "memory");
                }
            }
            fence_proxy_async();  // the stores are read next by the tensor cores
            __syncthreads();      // both warpgroups' dSᵀ stored
            wgmma_wait<0>();      // dV and dK: their fragments' registers are free for dQ's accumulators
            if (wg < SM90_DQ_GROUPS) {
                float part[HEAD_DIM_PAD / SM90_DQ_GROUPS / 8][4];  // written whole by the first k-step
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < KV_TILE / 16; ++kk) {
                    wgmma_ss_m64n64k16<1, 1>(part, smem_desc(ds_addr + kk * 16 * SW_ROW, KV_TILE * SW_ROW, 1024),
                                             smem_desc(k_dq_addr + kk * 16 * SW_ROW, KV_TILE * SW_ROW, 1024), kk > 0);
                }
                wgmma_commit();
                cp_async_wait_all();
                fence_proxy_async();
                next_landed = true;
                wgmma_wait<0>();
                // The warp's 16 query rows of the tile's dQ, columns 64·wg …: added to the f32 accumulator (mode 1)
                // or stored as this KV tile's partial (mode 2).
                float* dq_tile =
                    dq_tile_rows(params.flash, dq_mode, dq_acc, dq_part, part_stride, sv, head, b, row0 SPARSE_ARGS);
                const int dq_c = wg * 64 + tig * 2;
                const int cols_live = (d - dq_c + 7) / 8;  // the thread's 8-column blocks inside d
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = wrow + g + 8 * r;
                    float* dq_row = dq_tile + (long long)row * q_row + dq_c;
                    const bool row_live = row < rows_here;
                    // dq_mode is the same for the whole launch: one loop per mode keeps each free of the other's
                    // predicates.
                    if (dq_mode == 1) {
#pragma unroll
                        for (int n = 0; n < 8; ++n) {
                            red_add_v2(row_live && n < cols_live, dq_row + n * 8, part[n][2 * r], part[n][2 * r + 1]);
                        }
                    } else {
#pragma unroll
                        for (int n = 0; n < 8; ++n) {
                            store_v2(row_live && n < cols_live, dq_row + n * 8, part[n][2 * r], part[n][2 * r + 1]);
                        }
                    }
                }
            }
        }
        if (!next_landed) {
            cp_async_wait_all();
            fence_proxy_async();
        }
        wgmma_wait<0>();  // dV and dK: the fragments pa, dsp and this stage's Q and dO are free again
        a = a_next;
    }

    // dK = round_T(α̂ · dK), dV = round_T(dV) for the thread's keys (under GQA this head's f32 sums).
    const long long n_heads_q = gridDim.y;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = wk + g + 8 * r;
        if (key >= keys_here) continue;
        const auto dk_row = kv_grad_row<false>(params.flash, dk_out, dkv_part, sv, head, n_heads_q, total_k, key0 + key);
#pragma unroll
        for (int n = 0; n < HEAD_DIM_PAD / 8; ++n) dk_row.store(n * 8 + tig * 2, acc_k[n][2 * r], acc_k[n][2 * r + 1]);
        const auto dv_row = kv_grad_row<true>(params.flash, dv_out, dkv_part, sv, head, n_heads_q, total_k, key0 + key);
#pragma unroll
        for (int n = 0; n < HEAD_DIM_V_PAD / 8; ++n) dv_row.store(n * 8 + tig * 2, acc_v[n][2 * r], acc_v[n][2 * r + 1]);
    }
}
