// FlashAttention backward (E6–E10) on tensor cores, compiled by NVRTC (see gpu/src/compile.rs and gpu/src/backward.rs).
//
// Kernels (one module per storage type and padded head dims; all take the forward's scalar block, in its order):
//   bwd_preprocess   D = rowsum(dO ∘ O) in f32 (E7), one warp per row.
//   bwd_kv           KV owner: one CTA of 4 warps per (KV tile of 64 keys, KV head × column chunk, sequence); each warp
//                    owns 16 keys. For every query head of the KV head's group and every query tile of 64 rows that
//                    can see the KV tile (the others are skipped, not masked) it recomputes Sᵀ = α̂ K Qᵀ, Pᵀ, dPᵀ = V dOᵀ,
//                    dSᵀ, accumulates dV += round_T(P)ᵀ dO and dK += dSᵀ Q in registers, and, per `dq_mode`, adds the
//                    tile's dQ = dS K to an f32 accumulator with atomicAdd (1) or writes it as a per-KV-tile partial (2).
//   bwd_dq           Strategy A's second traversal: one CTA per (query tile, query head × column chunk, sequence) owns
//                    dQ, recomputing P and dS, no atomics.
//   bwd_dq_finalize  dQ = round_T(α̂ · acc) from the atomic accumulator (mode 0) or from the partials summed in
//                    ascending KV-tile order (mode 1: bitwise deterministic).
// Every product uses mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}; k-steps whose 16 rows are all past the valid
// length are skipped (they would add zeros), so a sum of n terms over t tiles takes at most ⌈n/16⌉ + t instructions.
// Output columns are split in chunks of CHUNK (grid y), so the accumulators stay at 64 registers for any head dim;
// S and dP are recomputed per chunk (correctness first: there is no tuned path yet).
//
// Compile-time parameters: ELEM_BF16 or ELEM_F16; HEAD_DIM_PAD (d rounded up to 16); HEAD_DIM_V_PAD (dv rounded up to
// 16: dv is the reduction of dP). Padding columns are zero in shared memory.
//
// Precision recipe (the rounding-error argument is in gpu/src/backward.rs):
//   s    = fl(dot(q, k) · α̂)                      f32 from the tensor cores, α̂ = fl32(1/√d) from the host
//   bL   = fl(LSE · L_hi)                         per row; L_hi + L_lo = log2 e to 2^-50
//   arg  = fma(s, L_hi, fma(s, L_lo, −bL))        ≈ (s − LSE)·log2 e with one rounding of the difference
//   p    = ex2.approx(arg) if arg ≥ −64, else fl(ex2.approx(arg + 32) · 2^-32) (arg + 32 exact there): p is never
//          a subnormal ex2 result, so its error is relative plus ½ ulp of the final underflow; p = 0 when masked
//          or when LSE = −∞ (a row that sees no key)
//   dP   = dO · vᵀ                                f32 tensor cores
//   dS   = round_T(fl(p · fl(dP − D)))
//   dV  += round_T(p)ᵀ dO, dK += dSᵀ Q, dQ += dS K   f32 accumulators (GQA: per head, then summed in f32 in
//          ascending head order in shared memory)
//   dK   = round_T(fl(α̂ · dK)), dQ likewise, dV = round_T(dV)
// Masks: as the forward (bottom-right aligned; "no bound" is 1 << 30).

#if defined(ELEM_BF16)
#include <cuda_bf16.h>
typedef __nv_bfloat16 elem_t;
#define MMA_ELEM "bf16"
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ elem_t to_elem(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ float to_f32(elem_t x) { return __bfloat162float(x); }
#elif defined(ELEM_F16)
#include <cuda_fp16.h>
typedef __half elem_t;
#define MMA_ELEM "f16"
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ elem_t to_elem(float x) { return __float2half_rn(x); }
__device__ __forceinline__ float to_f32(elem_t x) { return __half2float(x); }
#else
#error "define ELEM_BF16 or ELEM_F16"
#endif

#ifndef HEAD_DIM_PAD
#error "define HEAD_DIM_PAD"
#endif
#ifndef HEAD_DIM_V_PAD
#error "define HEAD_DIM_V_PAD"
#endif

#define TILE 64
#define NUM_WARPS 4
#define CHUNK 64
#define SMEM_PAD 8
#define QK_STRIDE (HEAD_DIM_PAD + SMEM_PAD)
#define V_STRIDE (HEAD_DIM_V_PAD + SMEM_PAD)
#define DS_STRIDE (TILE + SMEM_PAD)

static_assert(HEAD_DIM_PAD % 16 == 0 && HEAD_DIM_PAD <= 256, "HEAD_DIM_PAD must be a multiple of 16 up to 256");
static_assert(HEAD_DIM_V_PAD % 16 == 0 && HEAD_DIM_V_PAD <= 256, "HEAD_DIM_V_PAD must be a multiple of 16 up to 256");

// log2 e = L_HI + L_LO: L_HI = fl32(log2 e), L_LO = fl32(log2 e − L_HI); the pair is within 2^-50 of log2 e.
#define L_HI 1.44269502162933349609375f
#define L_LO 1.925963033500011079e-8f
#define NO_BOUND (1 << 30)
#define NEG_INF __int_as_float((int)0xff800000u)
#define TWO_M32 2.3283064365386962890625e-10f

__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm volatile("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 2^arg without a subnormal ex2 result: below −64 the argument is shifted by 32 (exact: |arg| ≥ 64 has an ulp of at
// least 2^-17, and the sum is smaller in magnitude) and the normal result scaled back by 2^-32 (exact unless it
// underflows, then one rounding of at most ½ ulp of the smallest subnormal).
__device__ __forceinline__ float exp2_scaled(float arg) {
    if (arg >= -64.f) return ex2_approx(arg);
    return __fmul_rn(ex2_approx(__fadd_rn(arg, 32.f)), TWO_M32);
}

// P = exp(s − LSE) from the scaled score s and the row's bL = fl(LSE · L_HI).
__device__ __forceinline__ float prob(float s, float bl) {
    const float inner = __fmaf_rn(s, L_LO, -bl);
    return exp2_scaled(__fmaf_rn(s, L_HI, inner));
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

// Copies `rows` valid rows of `cols` valid columns (a multiple of 8) into a [TILE][stride] smem tile of `cols_pad`
// columns, zero-filling the rest (0 · NaN = NaN in the mma, so padding must be zeros, not garbage).
__device__ __forceinline__ void load_tile(elem_t* smem, int stride, const elem_t* __restrict__ g, long long row_stride,
                                          int rows, int cols, int cols_pad) {
    const int chunks = cols_pad / 8;
    for (int idx = threadIdx.x; idx < TILE * chunks; idx += blockDim.x) {
        const int r = idx / chunks;
        const int c = (idx % chunks) * 8;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < rows && c < cols) {
            val = *reinterpret_cast<const uint4*>(g + (long long)r * row_stride + c);
        }
        *reinterpret_cast<uint4*>(smem + r * stride + c) = val;
    }
}

// The per-sequence view of the problem (dense or varlen).
struct SeqView {
    int len_q, len_k;
    long long q_base, k_base, v_base, o_base, lse_base;
};

__device__ __forceinline__ SeqView seq_view(int seq, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                            int varlen, int dense_len_q, int dense_len_k, long long q_batch,
                                            long long q_row, long long k_batch, long long k_row, long long v_batch,
                                            long long v_row, long long o_batch, long long o_row,
                                            long long lse_batch) {
    SeqView s;
    if (varlen) {
        const int q0 = cu_q[seq], k0 = cu_k[seq];
        s.len_q = cu_q[seq + 1] - q0;
        s.len_k = cu_k[seq + 1] - k0;
        s.q_base = (long long)q0 * q_row;
        s.k_base = (long long)k0 * k_row;
        s.v_base = (long long)k0 * v_row;
        s.o_base = (long long)q0 * o_row;
        s.lse_base = q0;
    } else {
        s.len_q = dense_len_q;
        s.len_k = dense_len_k;
        s.q_base = seq * q_batch;
        s.k_base = seq * k_batch;
        s.v_base = seq * v_batch;
        s.o_base = seq * o_batch;
        s.lse_base = seq * lse_batch;
    }
    return s;
}

// The query tiles [a_lo, a_hi] that can see some key of KV tile `b`: rows i with
// i + shift − left ≤ key_end − 1 and i + shift + right ≥ key0. The same predicate decides which partials exist.
__device__ __forceinline__ bool kv_tile_rows(int b, int len_q, int len_k, int win_left, int win_right, int* a_lo,
                                             int* a_hi) {
    const long long key0 = (long long)b * TILE;
    const long long key_end = min((long long)len_k, key0 + TILE);
    const long long shift = (long long)len_k - len_q;
    long long row_lo = key0 - shift - win_right;
    long long row_hi = key_end - 1 - shift + win_left;
    if (row_lo < 0) row_lo = 0;
    if (row_hi > (long long)len_q - 1) row_hi = (long long)len_q - 1;
    if (key0 >= key_end || row_lo > row_hi) return false;
    *a_lo = (int)(row_lo / TILE);
    *a_hi = (int)(row_hi / TILE);
    return true;
}

#define COMMON_PARAMS                                                                                               \
    const int *__restrict__ cu_q, const int *__restrict__ cu_k, int varlen, int dense_len_q, int dense_len_k,       \
        int group, int d, int dv, long long q_batch, long long q_head, long long q_row, long long k_batch,           \
        long long k_head, long long k_row, long long v_batch, long long v_head, long long v_row, long long o_batch,  \
        long long o_head, long long o_row, long long lse_batch, long long lse_head, float scale, int win_left,      \
        int win_right

#define SEQ_VIEW(seq)                                                                                                \
    seq_view(seq, cu_q, cu_k, varlen, dense_len_q, dense_len_k, q_batch, q_row, k_batch, k_row, v_batch, v_row,     \
             o_batch, o_row, lse_batch)

// D = rowsum(dO ∘ O) in f32: one warp per row, lanes over column pairs, then a shuffle tree (any order: γ(dv)).
extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32)
bwd_preprocess(const elem_t* __restrict__ o, const elem_t* __restrict__ d_out, float* __restrict__ delta,
               COMMON_PARAMS) {
    const SeqView sv = SEQ_VIEW(blockIdx.z);
    const int head = blockIdx.y;
    const int row0 = blockIdx.x * TILE;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < TILE; r += NUM_WARPS) {
        const int row = row0 + r;
        if (row >= sv.len_q) break;
        const long long base = sv.o_base + head * o_head + (long long)row * o_row;
        float acc = 0.f;
        for (int c = lane * 2; c < dv; c += 64) {
            const elem_t* po = o + base + c;
            const elem_t* pg = d_out + base + c;
            acc = __fmaf_rn(to_f32(pg[0]), to_f32(po[0]), acc);
            acc = __fmaf_rn(to_f32(pg[1]), to_f32(po[1]), acc);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
        if (lane == 0) delta[sv.lse_base + head * lse_head + row] = acc;
    }
}

extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32)
bwd_kv(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
       const elem_t* __restrict__ d_out, const float* __restrict__ lse, const float* __restrict__ delta,
       elem_t* __restrict__ dk_out, elem_t* __restrict__ dv_out, float* __restrict__ dq_acc,
       float* __restrict__ dq_part, COMMON_PARAMS, int dq_mode, int n_chunks, long long part_stride) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* k_s = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* q_s = k_s + TILE * QK_STRIDE;
    elem_t* v_s = q_s + TILE * QK_STRIDE;
    elem_t* do_s = v_s + TILE * V_STRIDE;
    elem_t* ds_s = do_s + TILE * V_STRIDE;
    float* lse_s = reinterpret_cast<float*>(ds_s + TILE * DS_STRIDE);
    float* bl_s = lse_s + TILE;
    float* delta_s = bl_s + TILE;
    float* tot_k = delta_s + TILE;        // [TILE][CHUNK], only when group > 1
    float* tot_v = tot_k + TILE * CHUNK;  // [TILE][CHUNK], only when group > 1

    const int b = blockIdx.x;
    const int kv_head = blockIdx.y / n_chunks;
    const int c0 = (blockIdx.y % n_chunks) * CHUNK;
    const SeqView sv = SEQ_VIEW(blockIdx.z);
    const int key0 = b * TILE;
    if (key0 >= sv.len_k) return;
    const int keys_here = min(TILE, sv.len_k - key0);
    const long long shift = (long long)sv.len_k - sv.len_q;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    const int wk = warp * 16;

    load_tile(k_s, QK_STRIDE, k + sv.k_base + kv_head * k_head + (long long)key0 * k_row, k_row, keys_here, d,
              HEAD_DIM_PAD);
    load_tile(v_s, V_STRIDE, v + sv.v_base + kv_head * v_head + (long long)key0 * v_row, v_row, keys_here, dv,
              HEAD_DIM_V_PAD);

    int a_lo = 0, a_hi = -1;
    if (!kv_tile_rows(b, sv.len_q, sv.len_k, win_left, win_right, &a_lo, &a_hi)) {
        a_lo = 0;
        a_hi = -1;
    }
    const long long key_g[2] = {key0 + wk + g, key0 + wk + g + 8};

    float acc_k[CHUNK / 8][4], acc_v[CHUNK / 8][4];
    for (int hh = 0; hh < group; ++hh) {
        const int head = kv_head * group + hh;
#pragma unroll
        for (int n = 0; n < CHUNK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_k[n][e] = acc_v[n][e] = 0.f;
        }
        for (int a = a_lo; a <= a_hi; ++a) {
            const int row0 = a * TILE;
            const int rows_here = min(TILE, sv.len_q - row0);
            __syncthreads();  // everyone is done with the previous Q/dO/dS tiles (and K/V are visible at the start)
            load_tile(q_s, QK_STRIDE, q + sv.q_base + head * q_head + (long long)row0 * q_row, q_row, rows_here, d,
                      HEAD_DIM_PAD);
            load_tile(do_s, V_STRIDE, d_out + sv.o_base + head * o_head + (long long)row0 * o_row, o_row, rows_here,
                      dv, HEAD_DIM_V_PAD);
            for (int r = threadIdx.x; r < TILE; r += blockDim.x) {
                float l = NEG_INF, dl = 0.f;
                if (r < rows_here) {
                    l = lse[sv.lse_base + head * lse_head + row0 + r];
                    dl = delta[sv.lse_base + head * lse_head + row0 + r];
                }
                lse_s[r] = l;
                bl_s[r] = l == NEG_INF ? 0.f : __fmul_rn(l, L_HI);
                delta_s[r] = dl;
            }
            __syncthreads();

            // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's 16 keys and the tile's 64 queries.
            float st[TILE / 8][4], dpt[TILE / 8][4];
#pragma unroll
            for (int n = 0; n < TILE / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
            }
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM_PAD / 16; ++kk) {
                const elem_t* ka = k_s + (wk + g) * QK_STRIDE + kk * 16 + tig * 2;
                const unsigned a0 = ld_pair(ka), a1 = ld_pair(ka + 8 * QK_STRIDE);
                const unsigned a2 = ld_pair(ka + 8), a3 = ld_pair(ka + 8 * QK_STRIDE + 8);
#pragma unroll
                for (int n = 0; n < TILE / 8; ++n) {
                    const elem_t* qb = q_s + (n * 8 + g) * QK_STRIDE + kk * 16 + tig * 2;
                    mma_16816(st[n], a0, a1, a2, a3, ld_pair(qb), ld_pair(qb + 8));
                }
            }
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM_V_PAD / 16; ++kk) {
                const elem_t* va = v_s + (wk + g) * V_STRIDE + kk * 16 + tig * 2;
                const unsigned a0 = ld_pair(va), a1 = ld_pair(va + 8 * V_STRIDE);
                const unsigned a2 = ld_pair(va + 8), a3 = ld_pair(va + 8 * V_STRIDE + 8);
#pragma unroll
                for (int n = 0; n < TILE / 8; ++n) {
                    const elem_t* gb = do_s + (n * 8 + g) * V_STRIDE + kk * 16 + tig * 2;
                    mma_16816(dpt[n], a0, a1, a2, a3, ld_pair(gb), ld_pair(gb + 8));
                }
            }

            // Pᵀ (kept in st, f32) and dSᵀ (in dpt, already rounded to T).
#pragma unroll
            for (int n = 0; n < TILE / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qc = n * 8 + tig * 2 + (e % 2);
                    const long long i = row0 + qc;
                    const long long j = key_g[e / 2];
                    const bool vis = qc < rows_here && j < sv.len_k && j <= i + shift + win_right &&
                                     j >= i + shift - win_left && lse_s[qc] != NEG_INF;
                    const float p = vis ? prob(__fmul_rn(st[n][e], scale), bl_s[qc]) : 0.f;
                    const float ds = __fmul_rn(p, __fsub_rn(dpt[n][e], delta_s[qc]));
                    st[n][e] = p;
                    dpt[n][e] = to_f32(to_elem(ds));
                }
            }

            // dV += round_T(P)ᵀ dO and dK += dSᵀ Q over the tile's query rows (k = queries).
#pragma unroll
            for (int kk = 0; kk < TILE / 16; ++kk) {
                if (kk * 16 >= rows_here) break;
                const unsigned pa0 = pack2(st[2 * kk][0], st[2 * kk][1]);
                const unsigned pa1 = pack2(st[2 * kk][2], st[2 * kk][3]);
                const unsigned pa2 = pack2(st[2 * kk + 1][0], st[2 * kk + 1][1]);
                const unsigned pa3 = pack2(st[2 * kk + 1][2], st[2 * kk + 1][3]);
                const unsigned sa0 = pack2(dpt[2 * kk][0], dpt[2 * kk][1]);
                const unsigned sa1 = pack2(dpt[2 * kk][2], dpt[2 * kk][3]);
                const unsigned sa2 = pack2(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
                const unsigned sa3 = pack2(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
                for (int n = 0; n < CHUNK / 8; ++n) {
                    const int col = c0 + n * 8;
                    if (col < dv) {
                        const elem_t* gb = do_s + (kk * 16 + tig * 2) * V_STRIDE + col + g;
                        mma_16816(acc_v[n], pa0, pa1, pa2, pa3, pack_elems(gb[0], gb[V_STRIDE]),
                                  pack_elems(gb[8 * V_STRIDE], gb[9 * V_STRIDE]));
                    }
                    if (col < d) {
                        const elem_t* qb = q_s + (kk * 16 + tig * 2) * QK_STRIDE + col + g;
                        mma_16816(acc_k[n], sa0, sa1, sa2, sa3, pack_elems(qb[0], qb[QK_STRIDE]),
                                  pack_elems(qb[8 * QK_STRIDE], qb[9 * QK_STRIDE]));
                    }
                }
            }

            // dQ of this KV tile: dS (queries × keys) through shared memory, times K (k = keys).
            if (dq_mode != 0 && c0 < d) {
#pragma unroll
                for (int n = 0; n < TILE / 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int qc = n * 8 + tig * 2 + (e % 2);
                        ds_s[qc * DS_STRIDE + wk + g + 8 * (e / 2)] = to_elem(dpt[n][e]);
                    }
                }
                __syncthreads();
                const int wq = warp * 16;
#pragma unroll
                for (int n = 0; n < CHUNK / 8; ++n) {
                    const int col = c0 + n * 8;
                    if (col >= d) break;
                    float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int kk = 0; kk < TILE / 16; ++kk) {
                        if (kk * 16 >= keys_here) break;
                        const elem_t* sa = ds_s + (wq + g) * DS_STRIDE + kk * 16 + tig * 2;
                        const elem_t* kb = k_s + (kk * 16 + tig * 2) * QK_STRIDE + col + g;
                        mma_16816(part, ld_pair(sa), ld_pair(sa + 8 * DS_STRIDE), ld_pair(sa + 8),
                                  ld_pair(sa + 8 * DS_STRIDE + 8), pack_elems(kb[0], kb[QK_STRIDE]),
                                  pack_elems(kb[8 * QK_STRIDE], kb[9 * QK_STRIDE]));
                    }
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = wq + g + 8 * r;
                        if (row >= rows_here) continue;
                        const long long idx =
                            sv.q_base + head * q_head + (long long)(row0 + row) * q_row + col + tig * 2;
                        if (dq_mode == 1) {
                            atomicAdd(dq_acc + idx, part[2 * r]);
                            atomicAdd(dq_acc + idx + 1, part[2 * r + 1]);
                        } else {
                            float2 val = make_float2(part[2 * r], part[2 * r + 1]);
                            *reinterpret_cast<float2*>(dq_part + (long long)b * part_stride + idx) = val;
                        }
                    }
                }
            }
        }
        // GQA: this head's f32 dK/dV join the group's sum in ascending head order (each thread owns its elements).
        if (group > 1) {
#pragma unroll
            for (int n = 0; n < CHUNK / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int at = (wk + g + 8 * (e / 2)) * CHUNK + n * 8 + tig * 2 + (e % 2);
                    tot_k[at] = hh == 0 ? acc_k[n][e] : __fadd_rn(tot_k[at], acc_k[n][e]);
                    tot_v[at] = hh == 0 ? acc_v[n][e] : __fadd_rn(tot_v[at], acc_v[n][e]);
                }
            }
        }
    }

    // dK = round_T(α̂ · ΣdK), dV = round_T(ΣdV) for the warp's keys and the chunk's columns.
#pragma unroll
    for (int n = 0; n < CHUNK / 8; ++n) {
        const int col = c0 + n * 8 + tig * 2;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = wk + g + 8 * r;
            if (key >= keys_here) continue;
            float xk[2], xv[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int at = key * CHUNK + n * 8 + tig * 2 + e;
                xk[e] = group > 1 ? tot_k[at] : acc_k[n][2 * r + e];
                xv[e] = group > 1 ? tot_v[at] : acc_v[n][2 * r + e];
            }
            if (col < d) {
                elem_t* p = dk_out + sv.k_base + kv_head * k_head + (long long)(key0 + key) * k_row + col;
                *reinterpret_cast<unsigned*>(p) =
                    pack_elems(to_elem(__fmul_rn(scale, xk[0])), to_elem(__fmul_rn(scale, xk[1])));
            }
            if (col < dv) {
                elem_t* p = dv_out + sv.v_base + kv_head * v_head + (long long)(key0 + key) * v_row + col;
                *reinterpret_cast<unsigned*>(p) = pack_elems(to_elem(xv[0]), to_elem(xv[1]));
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32)
bwd_dq(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
       const elem_t* __restrict__ d_out, const float* __restrict__ lse, const float* __restrict__ delta,
       elem_t* __restrict__ dq, COMMON_PARAMS, int n_chunks) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_s = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* k_s = q_s + TILE * QK_STRIDE;
    elem_t* do_s = k_s + TILE * QK_STRIDE;
    elem_t* v_s = do_s + TILE * V_STRIDE;

    const int tile = blockIdx.x;
    const int head = blockIdx.y / n_chunks;
    const int c0 = (blockIdx.y % n_chunks) * CHUNK;
    const int kv_head = head / group;
    const SeqView sv = SEQ_VIEW(blockIdx.z);
    const int row0 = tile * TILE;
    if (row0 >= sv.len_q) return;
    const int rows_here = min(TILE, sv.len_q - row0);
    const long long shift = (long long)sv.len_k - sv.len_q;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    const int wrow = warp * 16;

    load_tile(q_s, QK_STRIDE, q + sv.q_base + head * q_head + (long long)row0 * q_row, q_row, rows_here, d,
              HEAD_DIM_PAD);
    load_tile(do_s, V_STRIDE, d_out + sv.o_base + head * o_head + (long long)row0 * o_row, o_row, rows_here, dv,
              HEAD_DIM_V_PAD);
    float bl[2], dl[2];
    bool live[2];
    long long diag[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = wrow + g + 8 * r;
        live[r] = false;
        bl[r] = 0.f;
        dl[r] = 0.f;
        diag[r] = row0 + row + shift;
        if (row < rows_here) {
            const float l = lse[sv.lse_base + head * lse_head + row0 + row];
            live[r] = l != NEG_INF;
            bl[r] = live[r] ? __fmul_rn(l, L_HI) : 0.f;
            dl[r] = delta[sv.lse_base + head * lse_head + row0 + row];
        }
    }

    // The KV tiles this query tile visits: exactly those whose kv_tile_rows range contains it.
    const int n_kt = (sv.len_k + TILE - 1) / TILE;
    float acc[CHUNK / 8][4];
#pragma unroll
    for (int n = 0; n < CHUNK / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

    for (int t = 0; t < n_kt; ++t) {
        int a_lo, a_hi;
        if (!kv_tile_rows(t, sv.len_q, sv.len_k, win_left, win_right, &a_lo, &a_hi) || tile < a_lo || tile > a_hi)
            continue;
        const int key0 = t * TILE;
        const int keys_here = min(TILE, sv.len_k - key0);
        __syncthreads();
        load_tile(k_s, QK_STRIDE, k + sv.k_base + kv_head * k_head + (long long)key0 * k_row, k_row, keys_here, d,
                  HEAD_DIM_PAD);
        load_tile(v_s, V_STRIDE, v + sv.v_base + kv_head * v_head + (long long)key0 * v_row, v_row, keys_here, dv,
                  HEAD_DIM_V_PAD);
        __syncthreads();

        float s[TILE / 8][4], dp[TILE / 8][4];
#pragma unroll
        for (int n = 0; n < TILE / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM_PAD / 16; ++kk) {
            const elem_t* qa = q_s + (wrow + g) * QK_STRIDE + kk * 16 + tig * 2;
            const unsigned a0 = ld_pair(qa), a1 = ld_pair(qa + 8 * QK_STRIDE);
            const unsigned a2 = ld_pair(qa + 8), a3 = ld_pair(qa + 8 * QK_STRIDE + 8);
#pragma unroll
            for (int n = 0; n < TILE / 8; ++n) {
                const elem_t* kb = k_s + (n * 8 + g) * QK_STRIDE + kk * 16 + tig * 2;
                mma_16816(s[n], a0, a1, a2, a3, ld_pair(kb), ld_pair(kb + 8));
            }
        }
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM_V_PAD / 16; ++kk) {
            const elem_t* ga = do_s + (wrow + g) * V_STRIDE + kk * 16 + tig * 2;
            const unsigned a0 = ld_pair(ga), a1 = ld_pair(ga + 8 * V_STRIDE);
            const unsigned a2 = ld_pair(ga + 8), a3 = ld_pair(ga + 8 * V_STRIDE + 8);
#pragma unroll
            for (int n = 0; n < TILE / 8; ++n) {
                const elem_t* vb = v_s + (n * 8 + g) * V_STRIDE + kk * 16 + tig * 2;
                mma_16816(dp[n], a0, a1, a2, a3, ld_pair(vb), ld_pair(vb + 8));
            }
        }
#pragma unroll
        for (int n = 0; n < TILE / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e / 2;
                const long long j = key0 + n * 8 + tig * 2 + (e % 2);
                const bool vis = live[r] && j < sv.len_k && j <= diag[r] + win_right && j >= diag[r] - win_left;
                const float p = vis ? prob(__fmul_rn(s[n][e], scale), bl[r]) : 0.f;
                s[n][e] = to_f32(to_elem(__fmul_rn(p, __fsub_rn(dp[n][e], dl[r]))));
            }
        }
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk) {
            if (kk * 16 >= keys_here) break;
            const unsigned a0 = pack2(s[2 * kk][0], s[2 * kk][1]);
            const unsigned a1 = pack2(s[2 * kk][2], s[2 * kk][3]);
            const unsigned a2 = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const unsigned a3 = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int n = 0; n < CHUNK / 8; ++n) {
                const int col = c0 + n * 8;
                if (col >= d) break;
                const elem_t* kb = k_s + (kk * 16 + tig * 2) * QK_STRIDE + col + g;
                mma_16816(acc[n], a0, a1, a2, a3, pack_elems(kb[0], kb[QK_STRIDE]),
                          pack_elems(kb[8 * QK_STRIDE], kb[9 * QK_STRIDE]));
            }
        }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = wrow + g + 8 * r;
        if (row >= rows_here) continue;
        elem_t* out = dq + sv.q_base + head * q_head + (long long)(row0 + row) * q_row;
#pragma unroll
        for (int n = 0; n < CHUNK / 8; ++n) {
            const int col = c0 + n * 8 + tig * 2;
            if (col < d) {
                *reinterpret_cast<unsigned*>(out + col) = pack_elems(to_elem(__fmul_rn(scale, acc[n][2 * r])),
                                                                     to_elem(__fmul_rn(scale, acc[n][2 * r + 1])));
            }
        }
    }
}

// dQ = round_T(α̂ · x): x the atomic accumulator (mode 0) or the sum of the visited partials in ascending KV tile
// order (mode 1).
extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32)
bwd_dq_finalize(const float* __restrict__ dq_acc, const float* __restrict__ dq_part, elem_t* __restrict__ dq,
                COMMON_PARAMS, int mode, long long part_stride) {
    const SeqView sv = SEQ_VIEW(blockIdx.z);
    const int head = blockIdx.y;
    const int tile = blockIdx.x;
    const int row0 = tile * TILE;
    if (row0 >= sv.len_q) return;
    const int rows_here = min(TILE, sv.len_q - row0);
    const int n_kt = (sv.len_k + TILE - 1) / TILE;
    for (int idx = threadIdx.x; idx < rows_here * d; idx += blockDim.x) {
        const int r = idx / d, c = idx % d;
        const long long at = sv.q_base + head * q_head + (long long)(row0 + r) * q_row + c;
        float x = 0.f;
        if (mode == 0) {
            x = dq_acc[at];
        } else {
            for (int t = 0; t < n_kt; ++t) {
                int a_lo, a_hi;
                if (kv_tile_rows(t, sv.len_q, sv.len_k, win_left, win_right, &a_lo, &a_hi) && tile >= a_lo &&
                    tile <= a_hi) {
                    x = __fadd_rn(x, dq_part[(long long)t * part_stride + at]);
                }
            }
        }
        dq[at] = to_elem(__fmul_rn(scale, x));
    }
}
