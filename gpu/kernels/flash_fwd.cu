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

// fl32(log2 e): the same constant for every score and every row max, so that the shift errors telescope.
#define LOG2E_F 1.44269504088896340736f

// The online-softmax step of one KV tile for the warp's rows: scale (and, if MASKED, mask) the scores in `s`,
// update the running max, rescale ℓ and A, and leave p in `s`. `diag0` is the aligned key position of the thread's
// first row (row g of the warp's first slice); row (mi, r) has diag0 + 16·mi + 8·r.
template <bool MASKED>
__device__ __forceinline__ void softmax_tile(float (&s)[WARP_M][N_TILES_S][4], float (&m_run)[WARP_M][2],
                                             float (&ml_run)[WARP_M][2], float (&l_part)[WARP_M][2],
                                             float (&acc)[WARP_M][N_TILES_O][4], float scale, int key0, int len_k,
                                             int diag0, int win_left, int win_right, int tig) {
#pragma unroll
    for (int mi = 0; mi < WARP_M; ++mi) {
        float m_new[2] = {m_run[mi][0], m_run[mi][1]};
#pragma unroll
        for (int n = 0; n < N_TILES_S; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e / 2;
                float x = __fmul_rn(s[mi][n][e], scale);
                if (MASKED) {
                    const int j = key0 + n * 8 + tig * 2 + (e % 2);
                    const int diag = diag0 + 16 * mi + 8 * r;
                    const bool vis = j < len_k && j <= diag + win_right && j >= diag - win_left;
                    x = vis ? x : NEG_INF;
                }
                s[mi][n][e] = x;
                m_new[r] = fmaxf(m_new[r], x);
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            m_new[r] = fmaxf(m_new[r], __shfl_xor_sync(0xffffffffu, m_new[r], 1));
            m_new[r] = fmaxf(m_new[r], __shfl_xor_sync(0xffffffffu, m_new[r], 2));
        }
        // p = 2^(s·L − fl(m·L)); rescale factor 2^(fl(mL_old − mL_new)), exactly 1 when the max did not move. Both
        // flush results below 2^-126 to zero (the recipe's exp_underflow, gpu/src/flash.rs).
        float rescale[2];
        float ml_new[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            ml_new[r] = m_new[r] == NEG_INF ? 0.f : __fmul_rn(m_new[r], LOG2E_F);
            if (m_run[mi][r] == NEG_INF) {
                rescale[r] = 0.f;
            } else {
                rescale[r] = ml_run[mi][r] == ml_new[r] ? 1.f : ex2_approx_ftz(__fsub_rn(ml_run[mi][r], ml_new[r]));
            }
            m_run[mi][r] = m_new[r];
            ml_run[mi][r] = ml_new[r];
            l_part[mi][r] = __fmul_rn(l_part[mi][r], rescale[r]);
        }
#pragma unroll
        for (int n = 0; n < N_TILES_S; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e / 2;
                const float x = s[mi][n][e];
                // A masked score is −∞, and ex2.approx(−∞) = +0: the unmasked formula serves both paths.
                const float p = ex2_approx_ftz(__fmaf_rn(x, LOG2E_F, -ml_new[r]));
                s[mi][n][e] = p;
                l_part[mi][r] = __fadd_rn(l_part[mi][r], p);
            }
        }
        // Multiplying by 1 is exact: a warp whose rows all kept their max (most tiles, once a row's max has settled)
        // skips A's rescale, and every tiling still computes the same bits.
        if (!__all_sync(0xffffffffu, rescale[0] == 1.f && rescale[1] == 1.f)) {
#pragma unroll
            for (int n = 0; n < N_TILES_O; ++n) {
                acc[mi][n][0] = __fmul_rn(acc[mi][n][0], rescale[0]);
                acc[mi][n][1] = __fmul_rn(acc[mi][n][1], rescale[0]);
                acc[mi][n][2] = __fmul_rn(acc[mi][n][2], rescale[1]);
                acc[mi][n][3] = __fmul_rn(acc[mi][n][3], rescale[1]);
            }
        }
    }
}

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
    const int kv_head = head / group;

    int len_q, len_k;
    long long q_base, k_base, v_base, o_base, lse_base;
    if (varlen) {
        const int q0 = cu_q[seq], k0 = cu_k[seq];
        len_q = cu_q[seq + 1] - q0;
        len_k = cu_k[seq + 1] - k0;
        q_base = (long long)q0 * q_row;
        k_base = (long long)k0 * k_row;
        v_base = (long long)k0 * v_row;
        o_base = (long long)q0 * o_row;
        lse_base = q0;
    } else {
        len_q = dense_len_q;
        len_k = dense_len_k;
        q_base = seq * q_batch;
        k_base = seq * k_batch;
        v_base = seq * v_batch;
        o_base = seq * o_batch;
        lse_base = seq * lse_batch;
    }
    const int row0 = tile * BLOCK_M;
    if (row0 >= len_q) return;  // varlen: this sequence has fewer query tiles than the longest one
    const int rows_here = min(BLOCK_M, len_q - row0);

    const elem_t* q_g = q + q_base + head * q_head + (long long)row0 * q_row;
    const elem_t* k_g = k + k_base + kv_head * k_head;
    const elem_t* v_g = v + v_base + kv_head * v_head;

    // Visible key range of this CTA's rows (bottom-right aligned); tiles outside it are never loaded.
    const long long shift = (long long)len_k - len_q;
    const long long diag_lo = row0 + shift;
    const long long diag_hi = row0 + rows_here - 1 + shift;
    long long key_lo = diag_lo - win_left;
    long long key_hi = diag_hi + win_right + 1;
    if (key_lo < 0) key_lo = 0;
    if (key_hi > len_k) key_hi = len_k;
    const int tile_lo = key_lo < key_hi ? (int)(key_lo / BLOCK_N) : 0;
    const int tile_hi = key_lo < key_hi ? (int)((key_hi + BLOCK_N - 1) / BLOCK_N) : 0;
#if defined(BLOCK_SPARSE)
    // The host chose q_block as a multiple of BLOCK_M, so the CTA's rows lie in one query block.
    const int* list_g = block_lists + seq * lists.seq_stride + (long long)(head / lists.heads_per_list) * lists.head_stride +
                        (long long)(row0 / lists.q_block) * lists.width;
    TileCursor cursor = list_cursor(tile_lo, tile_hi, list_g, lists.width, lists.tiles_per_block);
#else
    TileCursor cursor = range_cursor(tile_lo, tile_hi);
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
    const int diag0 = (int)(row0 + wrow + g + shift);

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

        // Only tiles that some row of the CTA does not see completely need the mask.
        const bool interior = key0 + BLOCK_N <= len_k && key0 >= diag_hi - win_left &&
                              (long long)key0 + BLOCK_N - 1 <= diag_lo + win_right;
        if (interior) {
            softmax_tile<false>(s, m_run, ml_run, l_part, acc, scale, key0, len_k, diag0, win_left, win_right, tig);
        } else {
            softmax_tile<true>(s, m_run, ml_run, l_part, acc, scale, key0, len_k, diag0, win_left, win_right, tig);
        }

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

    // Finalize: ℓ over the quad, O = round_T(A/ℓ), LSE = m + ln ℓ; rows that saw no key get 0 and −∞.
#pragma unroll
    for (int mi = 0; mi < WARP_M; ++mi) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_part[mi][r];
            l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 1));
            l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 2));
            const int row = wrow + 16 * mi + g + 8 * r;
            if (row >= rows_here) continue;
#if defined(STATE_OUT)
            // The row's state as it stands (E2): m, ℓ and A relative to 2^fl(m·L); a row that saw no key keeps
            // m = −∞, ℓ = 0, A = 0. State rows are LSE rows; A is [LSE row][dv].
            const long long srow = lse_base + head * lse_head + row0 + row;
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
#else
            const bool empty = !(l > 0.f);
            elem_t* o_g = o + o_base + head * o_head + (long long)(row0 + row) * o_row;
#pragma unroll
            for (int n = 0; n < N_TILES_O; ++n) {
                const int c = n * 8 + tig * 2;
                if (c < dv) {
                    const float x0 = empty ? 0.f : __fdiv_rn(acc[mi][n][2 * r], l);
                    const float x1 = empty ? 0.f : __fdiv_rn(acc[mi][n][2 * r + 1], l);
                    *reinterpret_cast<unsigned*>(o_g + c) = pack_elems(to_elem(x0), to_elem(x1));
                }
            }
            if (tig == 0) {
                lse[lse_base + head * lse_head + row0 + row] = empty ? NEG_INF : __fadd_rn(m_run[mi][r], logf(l));
            }
#endif
        }
    }
}
