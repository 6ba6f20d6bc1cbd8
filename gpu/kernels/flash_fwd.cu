// FlashAttention-2 style forward with LSE (E2–E5) on tensor cores, compiled by NVRTC (see gpu/src/compile.rs).
//
// One CTA of NUM_WARPS warps per (query tile of BLOCK_M = NUM_WARPS · 16 · WARP_M rows, query head, sequence); each
// warp owns WARP_M consecutive 16-row slices, so that every K/V fragment it loads from shared memory feeds WARP_M
// MMAs. S = Q Kᵀ and O += P V use mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}, their operands loaded with
// ldmatrix (V with .trans); the online softmax (running max m, partial sums ℓ, accumulator A) lives in registers;
// P is rounded to the storage type for the PV product.
//
// Pipeline (cp.async, one K and one V buffer, as in FlashAttention-2): V_t is fetched while S = Q K_tᵀ and the
// softmax run, K_{t+1} while O += P V_t runs. Shared rows carry 16 bytes of padding, so the 8 rows an ldmatrix
// phase reads (and the 16-byte chunks cp.async writes) fall in distinct bank groups: no bank conflicts without a
// swizzle. KV tiles that every row of the CTA sees completely take a path without mask arithmetic; only tiles that
// cross the key tail, the diagonal or a window edge pay for masking.
//
// Compile-time parameters (one module per combination, cached by the host):
//   ELEM_BF16 or ELEM_F16  storage type of Q, K, V, O
//   HEAD_DIM_PAD           d rounded up to a multiple of 16 (the mma k step); padding columns are zero in smem
//   HEAD_DIM_V_PAD         dv rounded up to a multiple of 16 (two mma n tiles per ldmatrix.x4.trans)
//   STATE_OUT              (optional) write each row's online-softmax state m, ℓ, A in f32 instead of O and LSE:
//                          one chunk pair's partial state for the ring forward, merged (E4) and finalized (E5) by
//                          gpu/kernels/ring_state.cu
//   NUM_WARPS, WARP_M      warps per CTA and 16-row slices per warp (the tuning; the arithmetic does not depend on
//                          them: every row sees the same sequence of operations whatever the tiling)
//   BLOCK_SPARSE           (optional) block-sparse attention (E14): the CTA visits only the KV tiles of the key
//                          blocks its query block lists (two trailing arguments: the lists and BlockListParams); the
//                          mask still applies inside them. The host validated every list (ascending, no duplicate,
//                          in range, -1-padded), so the kernel trusts them.
//
// Arguments: the pointers of Q, K, V, the outputs (O and LSE, or the state's A, m, ℓ) and the sequence offsets, then
// the problem's scalars as one FlashParams (common.cuh), unpacked into locals of the same names at the kernel's top.
//
// Precision recipe (the rounding-error argument is in gpu/src/flash.rs):
//   s   = fl(dot(q, k) · α̂)            dot accumulated in f32 by the tensor cores, α̂ = fl32(1/√d) from the host
//   m   = running max of s (f32), mL = fl(m · L) with L = fl32(log2 e)
//   p   = ex2.approx.ftz.f32(fma(s, L, −mL))  f32; results below 2^-126 flush to +0
//   r   = ex2.approx.ftz.f32(fl(mL_old − mL_new)) rescale of ℓ and A when the max moves (exactly 1 when it does
//         not, and then a warp whose rows all keep their max skips A's rescale: multiplying by 1 is exact)
//   ℓ   = r·ℓ + Σ p                      f32, thread partials reduced over the quad at the end
//   A   = r·A + round_T(p) · V           f32 accumulators of the tensor cores
//   O   = round_T(A / ℓ)                 IEEE division (__fdiv_rn), round to nearest even
//   LSE = m + logf(ℓ)                    natural log; a row that sees no key gets O = 0, LSE = −∞
// Tile order: a CTA visits its KV tiles in ascending order, block-sparse or not. With every key block listed, the
// block-sparse mode visits exactly the dense mode's tiles and computes the same bits.
// Masks: a key j is visible to row i iff j < Lk, j ≤ i + Lk − Lq + right and j ≥ i + Lk − Lq − left (bottom-right
// aligned); causal is right = 0, and "no bound" is passed as 1 << 30. KV tiles outside the CTA's visible key range
// are skipped, not merely masked. Positions are 32-bit ints: the host guarantees Lq + Lk ≤ 2^30 per sequence, so
// i + Lk − Lq ± (a reach ≤ 2^30) cannot overflow.

#ifndef HEAD_DIM_PAD
#error "define HEAD_DIM_PAD"
#endif
#ifndef HEAD_DIM_V_PAD
#error "define HEAD_DIM_V_PAD"
#endif
#ifndef NUM_WARPS
#define NUM_WARPS 4
#endif
#ifndef WARP_M
#define WARP_M 1
#endif

#define THREADS (NUM_WARPS * 32)
#define BLOCK_M (NUM_WARPS * 16 * WARP_M)
#define BLOCK_N 64
// Row padding of 8 elements (16 bytes): row r starts 16·r bytes past a multiple of 128 (mod 128), so the 8 rows of
// an ldmatrix phase hit 8 distinct 16-byte bank groups.
#define SMEM_PAD 8
#define QK_STRIDE (HEAD_DIM_PAD + SMEM_PAD)
#define V_STRIDE (HEAD_DIM_V_PAD + SMEM_PAD)
#define N_TILES_S (BLOCK_N / 8)
#define N_TILES_O (HEAD_DIM_V_PAD / 8)

static_assert(HEAD_DIM_PAD % 16 == 0 && HEAD_DIM_PAD <= 256, "HEAD_DIM_PAD must be a multiple of 16 up to 256");
static_assert(HEAD_DIM_V_PAD % 16 == 0 && HEAD_DIM_V_PAD <= 256, "HEAD_DIM_V_PAD must be a multiple of 16 up to 256");
static_assert(NUM_WARPS == 4 || NUM_WARPS == 8, "NUM_WARPS must be 4 or 8");
static_assert(WARP_M == 1 || WARP_M == 2, "WARP_M must be 1 or 2");

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_fwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
#if defined(STATE_OUT)
          float* __restrict__ state_a, float* __restrict__ state_m, float* __restrict__ state_l,
#else
          elem_t* __restrict__ o, float* __restrict__ lse,
#endif
          const int* __restrict__ cu_q, const int* __restrict__ cu_k, const FlashParams params
#if defined(BLOCK_SPARSE)
          , const int* __restrict__ block_lists, const BlockListParams lists
#endif
) {
    UNPACK_FLASH_PARAMS(params);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_s = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* k_s = q_s + BLOCK_M * QK_STRIDE;
    elem_t* v_s = k_s + BLOCK_N * QK_STRIDE;

    // Highest query tiles first: under a causal mask they see the most keys, and starting the longest CTAs first
    // shortens the launch's tail. Neighbouring CTAs still share a head, so its K/V stay in L2.
    const int tile = gridDim.x - 1 - blockIdx.x;
    const int head = blockIdx.y;
    const int seq = blockIdx.z;

    ForwardCta cta;
    if (!forward_cta(cta, params, q, k, v, cu_q, cu_k, seq, head, tile, BLOCK_M, BLOCK_N)) return;
    const int len_k = cta.len_k;
    const int row0 = cta.row0;
    const int rows_here = cta.rows_here;

    const elem_t* q_g = cta.q_g;
    const elem_t* k_g = cta.k_g;
    const elem_t* v_g = cta.v_g;
#if defined(BLOCK_SPARSE)
    TileCursor cursor = forward_list_cursor(cta, seq, head / lists.heads_per_list, block_lists, lists);
#else
    TileCursor cursor = range_cursor(cta.tile_lo, cta.tile_hi);
#endif
    int t = cursor.next();

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;    // fragment row (and +8)
    const int tig = lane % 4;  // thread in group: fragment column pair
    const int wrow = warp * 16 * WARP_M;

    if (t >= 0) {
        load_tile_async<BLOCK_M, HEAD_DIM_PAD, QK_STRIDE, THREADS>(q_s, q_g, q_row, rows_here, d);
        const int key0 = t * BLOCK_N;
        load_tile_async<BLOCK_N, HEAD_DIM_PAD, QK_STRIDE, THREADS>(k_s, k_g + (long long)key0 * k_row, k_row,
                                                          min(BLOCK_N, len_k - key0), d);
        cp_async_commit();
    }

    // Row state for the thread's rows g and g + 8 of each of the warp's slices.
    float m_run[WARP_M][2], ml_run[WARP_M][2], l_part[WARP_M][2];
    float acc[WARP_M][N_TILES_O][4];
#pragma unroll
    for (int mi = 0; mi < WARP_M; ++mi) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            m_run[mi][r] = NEG_INF;
            ml_run[mi][r] = 0.f;
            l_part[mi][r] = 0.f;
        }
#pragma unroll
        for (int n = 0; n < N_TILES_O; ++n) acc[mi][n][0] = acc[mi][n][1] = acc[mi][n][2] = acc[mi][n][3] = 0.f;
    }
    const int row_t = row0 + wrow + g;

    // ldmatrix row addresses of this lane: Q is the A operand of S, K its B operand (rows are n), V the B operand of
    // PV (rows are k, transposed).
    const unsigned q_lane = smem_u32(q_s + wrow * QK_STRIDE + lane_a(lane, QK_STRIDE));
    const unsigned k_lane = smem_u32(k_s + lane_b(lane, QK_STRIDE));
    const unsigned v_lane = smem_u32(v_s + lane_b_trans(lane, V_STRIDE));

    while (t >= 0) {
        const int t_next = cursor.next();
        const int key0 = t * BLOCK_N;
        const int keys_here = min(BLOCK_N, len_k - key0);
        cp_async_wait_all();
        __syncthreads();  // K_t (and Q) landed for everyone; every warp is done reading V_{t-1}
        load_tile_async<BLOCK_N, HEAD_DIM_V_PAD, V_STRIDE, THREADS>(v_s, v_g + (long long)key0 * v_row, v_row, keys_here, dv);
        cp_async_commit();

        // S = Q K_tᵀ for the warp's rows and the tile's 64 keys.
        float s[WARP_M][N_TILES_S][4];
#pragma unroll
        for (int mi = 0; mi < WARP_M; ++mi)
#pragma unroll
            for (int n = 0; n < N_TILES_S; ++n) s[mi][n][0] = s[mi][n][1] = s[mi][n][2] = s[mi][n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM_PAD / 16; ++kk) {
            unsigned a[WARP_M][4];
#pragma unroll
            for (int mi = 0; mi < WARP_M; ++mi) ldsm_x4(a[mi], q_lane + (mi * 16 * QK_STRIDE + kk * 16) * ESZ);
#pragma unroll
            for (int np = 0; np < N_TILES_S / 2; ++np) {
                unsigned b[4];
                ldsm_x4(b, k_lane + (np * 16 * QK_STRIDE + kk * 16) * ESZ);
#pragma unroll
                for (int mi = 0; mi < WARP_M; ++mi) {
                    mma_16816(s[mi][2 * np], a[mi], b[0], b[1]);
                    mma_16816(s[mi][2 * np + 1], a[mi], b[2], b[3]);
                }
            }
        }

        float rescale[WARP_M][2];
        if (cta.sees_whole_tile(key0, BLOCK_N, win_left, win_right)) {
            softmax_scores<false>(s, m_run, ml_run, l_part, rescale, scale, key0, len_k, cta.diag, row_t, win_left,
                                  win_right, tig);
        } else {
            softmax_scores<true>(s, m_run, ml_run, l_part, rescale, scale, key0, len_k, cta.diag, row_t, win_left,
                                  win_right, tig);
        }
        rescale_accumulators(acc, rescale);

        cp_async_wait_all();
        __syncthreads();  // V_t landed for everyone; every warp is done reading K_t
        if (t_next >= 0) {
            const int key1 = t_next * BLOCK_N;
            load_tile_async<BLOCK_N, HEAD_DIM_PAD, QK_STRIDE, THREADS>(k_s, k_g + (long long)key1 * k_row, k_row,
                                                              min(BLOCK_N, len_k - key1), d);
            cp_async_commit();
        }

        // A += round_T(P) V_t: the S accumulator layout of key tiles 2kk and 2kk+1 is the A-operand layout of PV.
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            unsigned a[WARP_M][4];
#pragma unroll
            for (int mi = 0; mi < WARP_M; ++mi) pack_a(a[mi], s[mi][2 * kk], s[mi][2 * kk + 1]);
#pragma unroll
            for (int np = 0; np < N_TILES_O / 2; ++np) {
                unsigned b[4];
                ldsm_x4_trans(b, v_lane + (kk * 16 * V_STRIDE + np * 16) * ESZ);
#pragma unroll
                for (int mi = 0; mi < WARP_M; ++mi) {
                    mma_16816(acc[mi][2 * np], a[mi], b[0], b[1]);
                    mma_16816(acc[mi][2 * np + 1], a[mi], b[2], b[3]);
                }
            }
        }
        t = t_next;
    }

    // No asynchronous copy is outstanding here: every iteration waits for all of them, and the last one starts no K
    // prefetch (a CTA that sees no KV tile starts none at all).

#if defined(STATE_OUT)
    // The rows' states as they stand (E2): m, ℓ and A relative to 2^fl(m·L); a row that saw no key keeps m = −∞,
    // ℓ = 0, A = 0. State rows are LSE rows; A is [LSE row][dv].
#pragma unroll
    for (int mi = 0; mi < WARP_M; ++mi) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(l_part[mi][r]);
            const int row = wrow + 16 * mi + g + 8 * r;
            if (row >= rows_here) continue;
            const long long srow = cta.lse_base + head * lse_head + row0 + row;
#pragma unroll
            for (int n = 0; n < N_TILES_O; ++n) {
                const int c = n * 8 + tig * 2;
                if (c < dv) {
                    *reinterpret_cast<float2*>(state_a + srow * dv + c) =
                        make_float2(acc[mi][n][2 * r], acc[mi][n][2 * r + 1]);
                }
            }
            if (tig == 0) {
                state_m[srow] = m_run[mi][r];
                state_l[srow] = l;
            }
        }
    }
#else
    // Finalize (E5): O = round_T(A/ℓ), LSE = m + ln ℓ; rows that saw no key get 0 and −∞.
    write_output_rows(o, lse, cta, params, head, wrow, g, tig, m_run, l_part, acc);
#endif
}
