// FlashAttention forward with LSE (E2–E5) on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a only),
// compiled by NVRTC after common.cuh and sm90.cuh (see gpu/src/compile.rs); the launch wrappers pick it where it
// applies (gpu/src/flash.rs, gpu/src/block_sparse/mod.rs).
//
// One CTA of two warpgroups (8 warps, 256 threads) per (query tile of BLOCK_M = 128 rows, query head, sequence); each
// warpgroup owns 64 rows and each warp 16, so that a thread's accumulators have the m16n8 fragment layout of
// flash_fwd.cu (rows g and g + 8, columns 2·tig and + 1 of every 8-column block) and the two kernels share the
// online-softmax step and the output rows (common.cuh). KV tiles are BLOCK_N = 128 keys.
//
// Products: S = Q Kᵀ by wgmma.mma_async.m64n128k16 with Q and K in shared memory (K-major); O += P V by
// wgmma.mma_async.m64n{64,128}k16 with P from registers (the accumulators of S rounded to the storage type: two
// adjacent 8-column blocks of S are the m64k16 A fragment) and V in shared memory, N-major (transposed).
//
// Shared memory: Q, and K and V in KV_STAGES stages each, every tile in sm90.cuh's 128-byte swizzle (64-column chunks
// of 128-byte rows, each chunk on a 1024-byte boundary: the kernel aligns the dynamic window itself; the host asks for
// 1024 more bytes). Q and K are K-major operands; V is N-major (transposed), its leading offset the distance between
// two 64-column chunks (BLOCK_N · 128 bytes).
//
// Loads, two ways, both leaving tail rows and padding columns 0, never garbage (0 · NaN = NaN in a product), so both
// put the same bytes in shared memory and give the same bits:
// - TMA_LOADS (the host's choice where the tensor copy engine can read the operands: d and dv multiples of 8 in
//   [64, 128]): K and V tiles come through the tensor copy engine (cp.async.bulk.tensor), one 2-D tensor map per
//   (sequence, KV head) whose row count is the sequence's key count, so rows past it are out of bounds and filled
//   with 0. KV_STAGES = 3 stages each; per stage a "full" mbarrier (the copy's bytes landed) and an "empty" one (all 8
//   consumer warps are done reading it). One thread (thread 0) issues the copies: at the start of iteration i it
//   loads K_{i+1} and V_i, into the stages that held K_{i−2} and V_{i−3}, which the warps released in iteration
//   i − 2: the two warpgroups may drift a whole iteration apart before the copies wait, and no CTA barrier is left in
//   the loop. Q (once per CTA) is still loaded with cp.async.
// - otherwise: cp.async of 16 bytes with zero fill by every thread, two stages, one CTA barrier per iteration (every
//   thread's copies visible to both warpgroups; the stages read in iteration i − 1 free again).
//
// Pipeline: iteration i issues S_i = Q K_iᵀ and then O += P_{i-1} V_{i-1}, waits for S_i only, runs the softmax of
// S_i while the tensor cores run the PV product, then waits for it and rescales A by S_i's factors. A therefore goes
// through exactly flash_fwd.cu's sequence A ← r_i·A + round_T(P_i)·V_i, and the recipe of flash_fwd.cu's header
// holds unchanged (its rounding-error model in gpu/src/flash.rs charges ⌈Lk/64⌉ rescale steps, or the listed tiles'
// count in block-sparse mode; this kernel takes at most half as many).
//
// Compile-time parameters: ELEM_BF16 or ELEM_F16; HEAD_DIM_PAD and HEAD_DIM_V_PAD, d and dv rounded up to 64 or
// 128; BLOCK_SPARSE (optional): block-sparse attention (E14), the CTA visits only the tiles of the key blocks its
// query block lists (the host gives 128-key blocks, one tile each, and 128-row query blocks); TMA_LOADS (optional,
// above), which adds the tensor maps' argument. The other arguments are flash_fwd.cu's (without its STATE_OUT mode),
// so the same launch code serves both kernels.

#if defined(STATE_OUT)
#error "flash_fwd_sm90.cu has no STATE_OUT mode; the ring forward runs flash_fwd.cu"
#endif
#if !(HEAD_DIM_PAD == 64 || HEAD_DIM_PAD == 128) || !(HEAD_DIM_V_PAD == 64 || HEAD_DIM_V_PAD == 128)
#error "HEAD_DIM_PAD and HEAD_DIM_V_PAD must be 64 or 128"
#endif

#define THREADS 256
#define BLOCK_M 128
#define BLOCK_N 128
#define QK_CHUNKS (HEAD_DIM_PAD / 64)
#define V_CHUNKS (HEAD_DIM_V_PAD / 64)
#define N_TILES_S (BLOCK_N / 8)
#define N_TILES_O (HEAD_DIM_V_PAD / 8)
// Bytes of the tiles (SW_ROW, one swizzled row of 64 elements, is sm90.cuh's).
#define Q_BYTES (QK_CHUNKS * BLOCK_M * SW_ROW)
#define K_BYTES (QK_CHUNKS * BLOCK_N * SW_ROW)
#define V_BYTES (V_CHUNKS * BLOCK_N * SW_ROW)
#if defined(TMA_LOADS)
#define KV_STAGES 3
#else
#define KV_STAGES 2
#endif

#if defined(TMA_LOADS)
// Thread 0's side of the TMA pipeline: the K and V tiles in the consumers' order, each into the next of KV_STAGES
// stages once the 8 consumer warps released that stage's previous tile.
struct KvLoader {
    TileCursor k_tiles, v_tiles;  // copies of the consumers' cursor, advanced as K and V tiles are issued
    int k_issued, v_issued;       // tiles issued so far
    const void* k_map;
    const void* v_map;
    unsigned k_s, v_s;            // shared-memory addresses of stage 0
    unsigned bars;                // k_full[KV_STAGES], v_full[KV_STAGES], k_empty[KV_STAGES], v_empty[KV_STAGES]

    __device__ __forceinline__ void issue(TileCursor& tiles, int& issued, const void* map, unsigned smem, int bytes,
                                          int chunks, unsigned full, unsigned empty) {
        const int t = tiles.next();
        if (t < 0) return;
        const int stage = issued % KV_STAGES;
        const int use = issued / KV_STAGES;
        if (use > 0) mbarrier_wait(empty + 8 * stage, (use - 1) & 1);  // the stage's previous tile was released
        mbarrier_arrive_expect_tx(full + 8 * stage, bytes);
        for (int c = 0; c < chunks; ++c) {
            tma_load_box(smem + stage * bytes + c * (BLOCK_N * SW_ROW), map, c * 64, t * BLOCK_N, full + 8 * stage);
        }
        ++issued;
    }
    __device__ __forceinline__ void issue_k() {
        issue(k_tiles, k_issued, k_map, k_s, K_BYTES, QK_CHUNKS, bars, bars + 16 * KV_STAGES);
    }
    __device__ __forceinline__ void issue_v() {
        issue(v_tiles, v_issued, v_map, v_s, V_BYTES, V_CHUNKS, bars + 8 * KV_STAGES, bars + 24 * KV_STAGES);
    }
};
#endif

__device__ __forceinline__ void s_product(float (&s)[N_TILES_S][4], unsigned long long a, unsigned long long b) {
    wgmma_ss_m64n128k16(s, a, b);
}
__device__ __forceinline__ void pv_product(float (&acc)[N_TILES_O][4], const unsigned (&a)[4], unsigned long long b) {
    wgmma_rs_n<HEAD_DIM_V_PAD>(acc, a, b);
}


// O += round_T(P) V for one tile: `a` holds P as the A fragments of the tile's 8 k-steps of 16 keys.
__device__ __forceinline__ void pv_tile(float (&acc)[N_TILES_O][4], const unsigned (&a)[BLOCK_N / 16][4],
                                        unsigned v_addr) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        pv_product(acc, a[kk], smem_desc(v_addr + kk * 16 * SW_ROW, BLOCK_N * SW_ROW, 1024));
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_fwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
          elem_t* __restrict__ o, float* __restrict__ lse, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
          const FlashParams params
#if defined(BLOCK_SPARSE)
          , const int* __restrict__ block_lists, const BlockListParams lists
#endif
#if defined(TMA_LOADS)
          // Two 128-byte tensor maps (K, then V) per (sequence, KV head), sequence-major (gpu/src/flash.rs).
          , const unsigned long long* __restrict__ kv_maps
#endif
) {
    UNPACK_FLASH_PARAMS(params);
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* q_s = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    unsigned char* k_s = q_s + Q_BYTES;               // KV_STAGES stages
    unsigned char* v_s = k_s + KV_STAGES * K_BYTES;  // KV_STAGES stages

    // Highest query tiles first, as flash_fwd.cu: under a causal mask they see the most keys.
    const int tile = gridDim.x - 1 - blockIdx.x;
    const int head = blockIdx.y;
    const int seq = blockIdx.z;
    ForwardCta cta;
    if (!forward_cta(cta, params, q, k, v, cu_q, cu_k, seq, head, tile, BLOCK_M, BLOCK_N)) return;
    const int len_k = cta.len_k;

#if defined(BLOCK_SPARSE)
    TileCursor cursor = forward_list_cursor(cta, seq, head / lists.heads_per_list, block_lists, lists);
#else
    TileCursor cursor = range_cursor(cta.tile_lo, cta.tile_hi);
#endif

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;
    const int tig = lane % 4;
    const int wrow = warp * 16;                                   // the warp's 16 rows
    const unsigned q_addr = smem_u32(q_s) + (warp / 4) * 64 * SW_ROW;  // the warpgroup's 64 rows

#if defined(TMA_LOADS)
    __shared__ __align__(8) unsigned long long kv_bars[4 * KV_STAGES];
    const unsigned bars = smem_u32(kv_bars);
    const unsigned k_full = bars, v_full = bars + 8 * KV_STAGES;
    const unsigned k_empty = bars + 16 * KV_STAGES, v_empty = bars + 24 * KV_STAGES;
    KvLoader loader;
    if (threadIdx.x == 0) {
        const unsigned long long* maps = kv_maps + 32ll * ((long long)seq * (gridDim.y / group) + head / group);
        loader = KvLoader{cursor, cursor, 0, 0, maps, maps + 16, smem_u32(k_s), smem_u32(v_s), bars};
        for (int st = 0; st < KV_STAGES; ++st) {
            mbarrier_init(k_full + 8 * st, 1);
            mbarrier_init(v_full + 8 * st, 1);
            mbarrier_init(k_empty + 8 * st, THREADS / 32);
            mbarrier_init(v_empty + 8 * st, THREADS / 32);
        }
        fence_mbarrier_init();
        tensormap_acquire(loader.k_map);
        tensormap_acquire(loader.v_map);
        loader.issue_k();  // K_0
    }
#endif
    int t = cursor.next();

    float m_run[1][2] = {{NEG_INF, NEG_INF}}, ml_run[1][2] = {{0.f, 0.f}}, l_part[1][2] = {{0.f, 0.f}};
    float acc[1][N_TILES_O][4];
#pragma unroll
    for (int n = 0; n < N_TILES_O; ++n) acc[0][n][0] = acc[0][n][1] = acc[0][n][2] = acc[0][n][3] = 0.f;
    const int row_t = cta.row0 + wrow + g;

    if (t >= 0) {
        load_swizzled_async<BLOCK_M, QK_CHUNKS, THREADS>(q_s, cta.q_g, q_row, cta.rows_here, d);
#if !defined(TMA_LOADS)
        const int key0 = t * BLOCK_N;
        load_swizzled_async<BLOCK_N, QK_CHUNKS, THREADS>(k_s, cta.k_g + (long long)key0 * k_row, k_row,
                                                         min(BLOCK_N, len_k - key0), d);
#endif
        cp_async_commit();
    }
#if defined(TMA_LOADS)
    // Q landed for everyone (and the barriers are initialised) before the loop; a CTA without tiles waits here too.
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
#endif
    unsigned p_frag[BLOCK_N / 16][4];  // P_{i-1} in the storage type: the A operand of the next PV product
    bool pending_pv = false;
    int i = 0;
    while (t >= 0) {
        const int t_next = cursor.next();
        const int key0 = t * BLOCK_N;
#if defined(TMA_LOADS)
        if (threadIdx.x == 0) {
            loader.issue_k();  // K_{i+1}
            loader.issue_v();  // V_i
        }
        __syncwarp();
        const int k_stage = i % KV_STAGES;
        mbarrier_wait(k_full + 8 * k_stage, (i / KV_STAGES) & 1);
#else
        const int k_stage = i & 1;
        cp_async_wait_all();
        fence_proxy_async();
        __syncthreads();  // K_i and V_{i-1} landed for everyone; every warp is done with iteration i − 1
        if (t_next >= 0) {
            const int key1 = t_next * BLOCK_N;
            load_swizzled_async<BLOCK_N, QK_CHUNKS, THREADS>(k_s + ((i + 1) & 1) * K_BYTES,
                                                             cta.k_g + (long long)key1 * k_row, k_row,
                                                             min(BLOCK_N, len_k - key1), d);
        }
        load_swizzled_async<BLOCK_N, V_CHUNKS, THREADS>(v_s + (i & 1) * V_BYTES, cta.v_g + (long long)key0 * v_row,
                                                        v_row, min(BLOCK_N, len_k - key0), dv);
        cp_async_commit();
#endif
        // The stage of V_{i-1}, the tile of the pending PV product.
        const int v_stage = (i + KV_STAGES - 1) % KV_STAGES;

        float s[1][N_TILES_S][4];
#pragma unroll
        for (int n = 0; n < N_TILES_S; ++n) s[0][n][0] = s[0][n][1] = s[0][n][2] = s[0][n][3] = 0.f;
        const unsigned k_addr = smem_u32(k_s + k_stage * K_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM_PAD / 16; ++kk) {
            s_product(s[0], smem_desc(q_addr + (kk / 4) * (BLOCK_M * SW_ROW) + (kk % 4) * 32, 16, 1024),
                      smem_desc(k_addr + (kk / 4) * (BLOCK_N * SW_ROW) + (kk % 4) * 32, 16, 1024));
        }
        wgmma_commit();
        if (pending_pv) {
#if defined(TMA_LOADS)
            mbarrier_wait(v_full + 8 * v_stage, ((i - 1) / KV_STAGES) & 1);
#endif
            pv_tile(acc[0], p_frag, smem_u32(v_s + v_stage * V_BYTES));
            wgmma_commit();
            wgmma_wait<1>();  // S_i is ready; P_{i-1} V_{i-1} may still run
        } else {
            wgmma_wait<0>();
        }
#if defined(TMA_LOADS)
        if (lane == 0) mbarrier_arrive(k_empty + 8 * k_stage);  // this warp is done reading K_i
#endif

        float rescale[1][2];
        if (cta.sees_whole_tile(key0, BLOCK_N, win_left, win_right)) {
            softmax_scores<false>(s, m_run, ml_run, l_part, rescale, scale, key0, len_k, cta.diag, row_t, win_left,
                                  win_right, tig);
        } else {
            softmax_scores<true>(s, m_run, ml_run, l_part, rescale, scale, key0, len_k, cta.diag, row_t, win_left,
                                  win_right, tig);
        }
        wgmma_wait<0>();  // P_{i-1} V_{i-1} is done: A may be rescaled and the fragments refilled
#if defined(TMA_LOADS)
        if (pending_pv && lane == 0) mbarrier_arrive(v_empty + 8 * v_stage);  // this warp is done reading V_{i-1}
#endif
        rescale_accumulators(acc, rescale);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) pack_a(p_frag[kk], s[0][2 * kk], s[0][2 * kk + 1]);
        pending_pv = true;
        t = t_next;
        ++i;
    }
    if (pending_pv) {
        // The last tile's product: V_{i-1}.
        const int v_stage = (i + KV_STAGES - 1) % KV_STAGES;
#if defined(TMA_LOADS)
        mbarrier_wait(v_full + 8 * v_stage, ((i - 1) / KV_STAGES) & 1);
#else
        cp_async_wait_all();
        fence_proxy_async();
        __syncthreads();
#endif
        wgmma_fence();
        pv_tile(acc[0], p_frag, smem_u32(v_s + v_stage * V_BYTES));
        wgmma_commit();
        wgmma_wait<0>();
    }
    // No asynchronous copy is outstanding here: every K and V tile issued was waited for above (a CTA that sees no KV
    // tile starts none), and the cp.async path's last copies (V only) were waited for before the last product.

    write_output_rows(o, lse, cta, params, head, wrow, g, tig, m_run, l_part, acc);
}
