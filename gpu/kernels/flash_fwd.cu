// FlashAttention-2 style forward with LSE (E2–E5) on tensor cores, compiled by NVRTC (see gpu/src/compile.rs).
//
// One CTA of 4 warps per (query tile of BLOCK_M = 64 rows, query head, sequence); each warp owns 16 query rows.
// S = Q Kᵀ and O += P V use mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}; the online softmax (running max m,
// partial sums ℓ, accumulator A) lives in registers; P is rounded to the storage type for the PV product. K and V
// tiles of BLOCK_N = 64 keys are staged in shared memory (no cp.async pipelining yet: correctness first).
//
// Compile-time parameters (one module per combination, cached by the host):
//   ELEM_BF16 or ELEM_F16  storage type of Q, K, V, O
//   HEAD_DIM_PAD           d rounded up to a multiple of 16 (the mma k step); padding columns are zero in smem
//   HEAD_DIM_V_PAD         dv rounded up to a multiple of 8 (the mma n step)
//
// Precision recipe (the rounding-error argument is in gpu/src/flash.rs):
//   s   = fl(dot(q, k) · α̂)            dot accumulated in f32 by the tensor cores, α̂ = fl32(1/√d) from the host
//   m   = running max of s (f32), mL = fl(m · L) with L = fl32(log2 e)
//   p   = ex2.approx.f32(fma(s, L, −mL)) f32, subnormals kept (no .ftz)
//   r   = ex2.approx.f32(fl(mL_old − mL_new)) rescale of ℓ and A when the max moves
//   ℓ   = r·ℓ + Σ p                      f32, thread partials reduced over the quad at the end
//   A   = r·A + round_T(p) · V           f32 accumulators of the tensor cores
//   O   = round_T(A / ℓ)                 IEEE division (__fdiv_rn), round to nearest even
//   LSE = m + logf(ℓ)                    natural log; a row that sees no key gets O = 0, LSE = −∞
// Masks: a key j is visible to row i iff j < Lk, j ≤ i + Lk − Lq + right and j ≥ i + Lk − Lq − left (bottom-right
// aligned); causal is right = 0, and "no bound" is passed as 1 << 30. KV tiles outside the CTA's visible key range
// are skipped, not merely masked.

#if defined(ELEM_BF16)
#include <cuda_bf16.h>
typedef __nv_bfloat16 elem_t;
#define MMA_ELEM "bf16"
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ elem_t to_elem(float x) { return __float2bfloat16_rn(x); }
#elif defined(ELEM_F16)
#include <cuda_fp16.h>
typedef __half elem_t;
#define MMA_ELEM "f16"
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ elem_t to_elem(float x) { return __float2half_rn(x); }
#else
#error "define ELEM_BF16 or ELEM_F16"
#endif

#ifndef HEAD_DIM_PAD
#error "define HEAD_DIM_PAD"
#endif
#ifndef HEAD_DIM_V_PAD
#error "define HEAD_DIM_V_PAD"
#endif

#define BLOCK_M 64
#define BLOCK_N 64
#define NUM_WARPS 4
// Row padding of 8 elements (16 bytes) in shared memory: rows g = 0..7 of a fragment then start in different banks.
#define SMEM_PAD 8
#define QK_STRIDE (HEAD_DIM_PAD + SMEM_PAD)
#define V_STRIDE (HEAD_DIM_V_PAD + SMEM_PAD)
#define N_TILES_S (BLOCK_N / 8)
#define N_TILES_O (HEAD_DIM_V_PAD / 8)

static_assert(HEAD_DIM_PAD % 16 == 0 && HEAD_DIM_PAD <= 256, "HEAD_DIM_PAD must be a multiple of 16 up to 256");
static_assert(HEAD_DIM_V_PAD % 8 == 0 && HEAD_DIM_V_PAD <= 256, "HEAD_DIM_V_PAD must be a multiple of 8 up to 256");

// fl32(log2 e): the same constant for every score and every row max, so that the shift errors telescope.
#define LOG2E_F 1.44269504088896340736f
#define NO_BOUND (1 << 30)
// NVRTC has no <math.h>: −∞ from its bit pattern.
#define NEG_INF __int_as_float((int)0xff800000u)

__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    // Not .ftz: subnormal results are kept (the bound's underflow term assumes gradual underflow of p).
    asm volatile("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void mma_16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_ELEM "." MMA_ELEM ".f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned ld_pair(const elem_t* p) { return *reinterpret_cast<const unsigned*>(p); }

__device__ __forceinline__ unsigned pack_elems(elem_t lo, elem_t hi) {
    unsigned short l = *reinterpret_cast<unsigned short*>(&lo);
    unsigned short h = *reinterpret_cast<unsigned short*>(&hi);
    return (unsigned)l | ((unsigned)h << 16);
}

// Copies `rows` valid rows of `cols` valid columns (a multiple of 8) into a [BLOCK rows][stride] smem tile of
// `cols_pad` columns, zero-filling everything else: padding must be 0, not garbage, because 0 · NaN = NaN in the mma.
__device__ __forceinline__ void load_tile(elem_t* smem, int stride, const elem_t* __restrict__ g, long long row_stride,
                                          int rows, int cols, int cols_pad) {
    const int chunks = cols_pad / 8;
    for (int idx = threadIdx.x; idx < BLOCK_N * chunks; idx += blockDim.x) {
        const int r = idx / chunks;
        const int c = (idx % chunks) * 8;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < rows && c < cols) {
            // 16-byte aligned: cudaMalloc bases are 256-byte aligned and every stride is a multiple of 8 elements.
            val = *reinterpret_cast<const uint4*>(g + (long long)r * row_stride + c);
        }
        *reinterpret_cast<uint4*>(smem + r * stride + c) = val;
    }
}

extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32)
flash_fwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
          elem_t* __restrict__ o, float* __restrict__ lse,
          const int* __restrict__ cu_q, const int* __restrict__ cu_k, int varlen,
          int dense_len_q, int dense_len_k, int group, int d, int dv,
          long long q_batch, long long q_head, long long q_row,
          long long k_batch, long long k_head, long long k_row,
          long long v_batch, long long v_head, long long v_row,
          long long o_batch, long long o_head, long long o_row,
          long long lse_batch, long long lse_head,
          float scale, int win_left, int win_right) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_s = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* k_s = q_s + BLOCK_M * QK_STRIDE;
    elem_t* v_s = k_s + BLOCK_N * QK_STRIDE;

    const int tile = blockIdx.x;
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

    load_tile(q_s, QK_STRIDE, q_g, q_row, rows_here, d, HEAD_DIM_PAD);

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;   // fragment row (and +8)
    const int tig = lane % 4; // thread in group: fragment column pair
    const int wrow = warp * 16;

    // Row state for the thread's two rows (g and g + 8 of the warp's slice).
    float m_run[2] = {NEG_INF, NEG_INF};
    float ml_run[2] = {0.f, 0.f};
    float l_part[2] = {0.f, 0.f};
    float acc[N_TILES_O][4];
#pragma unroll
    for (int n = 0; n < N_TILES_O; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

    const long long diag_row[2] = {row0 + wrow + g + shift, row0 + wrow + g + 8 + shift};

    for (int t = tile_lo; t < tile_hi; ++t) {
        const int key0 = t * BLOCK_N;
        const int keys_here = min(BLOCK_N, len_k - key0);
        __syncthreads();  // everyone is done with the previous K/V tile (and the Q tile is visible on t = tile_lo)
        load_tile(k_s, QK_STRIDE, k_g + (long long)key0 * k_row, k_row, keys_here, d, HEAD_DIM_PAD);
        load_tile(v_s, V_STRIDE, v_g + (long long)key0 * v_row, v_row, keys_here, dv, HEAD_DIM_V_PAD);
        __syncthreads();

        // S = Q Kᵀ for the warp's 16 rows and the tile's 64 keys.
        float s[N_TILES_S][4];
#pragma unroll
        for (int n = 0; n < N_TILES_S; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM_PAD / 16; ++kk) {
            const elem_t* qa = q_s + (wrow + g) * QK_STRIDE + kk * 16 + tig * 2;
            const unsigned a0 = ld_pair(qa);
            const unsigned a1 = ld_pair(qa + 8 * QK_STRIDE);
            const unsigned a2 = ld_pair(qa + 8);
            const unsigned a3 = ld_pair(qa + 8 * QK_STRIDE + 8);
#pragma unroll
            for (int n = 0; n < N_TILES_S; ++n) {
                const elem_t* kb = k_s + (n * 8 + g) * QK_STRIDE + kk * 16 + tig * 2;
                mma_16816(s[n], a0, a1, a2, a3, ld_pair(kb), ld_pair(kb + 8));
            }
        }

        // Scale, mask, and the new running max of each row.
        float m_new[2] = {m_run[0], m_run[1]};
#pragma unroll
        for (int n = 0; n < N_TILES_S; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e / 2;
                const long long j = key0 + n * 8 + tig * 2 + (e % 2);
                const bool vis = j < len_k && j <= diag_row[r] + win_right && j >= diag_row[r] - win_left;
                const float x = vis ? __fmul_rn(s[n][e], scale) : NEG_INF;
                s[n][e] = x;
                m_new[r] = fmaxf(m_new[r], x);
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            m_new[r] = fmaxf(m_new[r], __shfl_xor_sync(0xffffffffu, m_new[r], 1));
            m_new[r] = fmaxf(m_new[r], __shfl_xor_sync(0xffffffffu, m_new[r], 2));
        }

        // p = 2^(s·L − fl(m·L)); rescale factor 2^(fl(mL_old − mL_new)).
        float rescale[2];
        float ml_new[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            ml_new[r] = m_new[r] == NEG_INF ? 0.f : __fmul_rn(m_new[r], LOG2E_F);
            rescale[r] = m_run[r] == NEG_INF ? 0.f : ex2_approx(__fsub_rn(ml_run[r], ml_new[r]));
            m_run[r] = m_new[r];
            ml_run[r] = ml_new[r];
            l_part[r] = __fmul_rn(l_part[r], rescale[r]);
        }
#pragma unroll
        for (int n = 0; n < N_TILES_S; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e / 2;
                const float x = s[n][e];
                const float p = x == NEG_INF ? 0.f : ex2_approx(__fmaf_rn(x, LOG2E_F, -ml_new[r]));
                s[n][e] = p;
                l_part[r] = __fadd_rn(l_part[r], p);
            }
        }
#pragma unroll
        for (int n = 0; n < N_TILES_O; ++n) {
            acc[n][0] = __fmul_rn(acc[n][0], rescale[0]);
            acc[n][1] = __fmul_rn(acc[n][1], rescale[0]);
            acc[n][2] = __fmul_rn(acc[n][2], rescale[1]);
            acc[n][3] = __fmul_rn(acc[n][3], rescale[1]);
        }

        // A += round_T(P) V: the S accumulator layout of key tiles 2kk and 2kk+1 is the A-operand layout of PV.
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            const unsigned a0 = pack2(s[2 * kk][0], s[2 * kk][1]);
            const unsigned a1 = pack2(s[2 * kk][2], s[2 * kk][3]);
            const unsigned a2 = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const unsigned a3 = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            const elem_t* vb = v_s + (kk * 16 + tig * 2) * V_STRIDE + g;
#pragma unroll
            for (int n = 0; n < N_TILES_O; ++n) {
                const elem_t* col = vb + n * 8;
                const unsigned b0 = pack_elems(col[0], col[V_STRIDE]);
                const unsigned b1 = pack_elems(col[8 * V_STRIDE], col[9 * V_STRIDE]);
                mma_16816(acc[n], a0, a1, a2, a3, b0, b1);
            }
        }
    }

    // Finalize: ℓ over the quad, O = round_T(A/ℓ), LSE = m + ln ℓ; rows that saw no key get 0 and −∞.
    float l_row[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_part[r];
        l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 1));
        l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 2));
        l_row[r] = l;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = wrow + g + 8 * r;
        if (row >= rows_here) continue;
        const bool empty = !(l_row[r] > 0.f);
        elem_t* o_g = o + o_base + head * o_head + (long long)(row0 + row) * o_row;
#pragma unroll
        for (int n = 0; n < N_TILES_O; ++n) {
            const int c = n * 8 + tig * 2;
            if (c < dv) {
                const float x0 = empty ? 0.f : __fdiv_rn(acc[n][2 * r], l_row[r]);
                const float x1 = empty ? 0.f : __fdiv_rn(acc[n][2 * r + 1], l_row[r]);
                elem_t pair[2] = {to_elem(x0), to_elem(x1)};
                *reinterpret_cast<unsigned*>(o_g + c) = pack_elems(pair[0], pair[1]);
            }
        }
        if (tig == 0) {
            lse[lse_base + head * lse_head + row0 + row] = empty ? NEG_INF : __fadd_rn(m_run[r], logf(l_row[r]));
        }
    }
}
