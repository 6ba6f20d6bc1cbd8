// Helpers shared by the FlashAttention kernels (prepended to flash_fwd.cu and flash_bwd.cu by gpu/src/compile.rs):
// the storage type, tensor-core MMA, ldmatrix, cp.async and the exp2 instruction, written once.
//
// Compile-time parameter: ELEM_BF16 or ELEM_F16 (the storage type of every elem_t tensor).

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

// "No bound" for a window side: positions are below 2^30 (the host checks Lq + Lk ≤ 2^30 per sequence).
#define NO_BOUND (1 << 30)
// NVRTC has no <math.h>: −∞ from its bit pattern.
#define NEG_INF __int_as_float((int)0xff800000u)

__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    // Not .ftz: subnormal results are kept (the bounds' underflow terms assume gradual underflow).
    asm volatile("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 2^x with subnormal inputs and results flushed to zero: one MUFU.EX2, where the gradual-underflow form above adds a
// range fix-up of three instructions. A result below 2^-126 is lost whole (the recipes that use it charge
// exp_underflow = 2^-126); a subnormal input gives 2^0 = 1, its correctly rounded result anyway.
__device__ __forceinline__ float ex2_approx_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// C += A·B for one m16n8k16 tile: A row-major 16×16, B column-major 16×8, f32 accumulators.
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_ELEM "." MMA_ELEM ".f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A operand of the next MMA from the f32 accumulators of two adjacent n tiles (columns 16kk … 16kk + 15), each
// value rounded to the storage type: the accumulator layout of m16n8 tiles 2kk, 2kk + 1 is the A layout of m16k16.
__device__ __forceinline__ void pack_a(unsigned (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack2(lo[0], lo[1]);
    a[1] = pack2(lo[2], lo[3]);
    a[2] = pack2(hi[0], hi[1]);
    a[3] = pack2(hi[2], hi[3]);
}

// Bytes per element, for offsets of 32-bit shared-window addresses.
#define ESZ ((unsigned)sizeof(elem_t))

// Shared-window address of a generic pointer into shared memory (what ldmatrix and cp.async take).
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(p));
    return addr;
}

// Four 8x8 b16 matrices; lane l supplies the row address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Four 8x8 b16 matrices stored transposed: register r[i] is the thread's fragment of matrix i (the m16n8 accumulator
// layout: row lane / 4, columns 2·(lane % 4) and + 1), and lane l supplies the address of memory row l % 8 of matrix
// l / 8, which receives column l % 8 of the fragment (sm_90).
__device__ __forceinline__ void stsm_x4_trans(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

// ldmatrix row addresses of a lane (in elements from the tile's origin), for a row-major [rows][stride] tile:
//   A operand (16 rows × 16 k):                matrices (rows 0-7 | 8-15) × (k 0-7 | 8-15)
//   B operand, rows are n (non-transposed):    (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
//   B operand, rows are k (.trans):            (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)
// so that one ldsm_x4 gives the A fragment, or the B fragments {b0, b1} of n tile 2np and {b2, b3} of 2np + 1.
__device__ __forceinline__ int lane_a(int lane, int stride) { return (lane % 16) * stride + (lane / 16) * 8; }
__device__ __forceinline__ int lane_b(int lane, int stride) {
    return ((lane % 8) + (lane / 16) * 8) * stride + ((lane / 8) % 2) * 8;
}
__device__ __forceinline__ int lane_b_trans(int lane, int stride) {
    return ((lane % 8) + ((lane / 8) % 2) * 8) * stride + (lane / 16) * 8;
}

// acc += A · Bᵀ for one warp: A is 16 rows at the lane address `a_lane` (lane_a), B has 16·N_PAIRS rows (the n
// dimension) at `b_lane` (lane_b) with row stride B_STRIDE, both reduced over K_STEPS k-steps of 16 columns.
template <int K_STEPS, int N_PAIRS, int B_STRIDE>
__device__ __forceinline__ void warp_mma_nt(float (&acc)[2 * N_PAIRS][4], unsigned a_lane, unsigned b_lane) {
#pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk) {
        unsigned af[4];
        ldsm_x4(af, a_lane + kk * 16 * ESZ);
#pragma unroll
        for (int np = 0; np < N_PAIRS; ++np) {
            unsigned bf[4];
            ldsm_x4(bf, b_lane + (np * 16 * B_STRIDE + kk * 16) * ESZ);
            mma_16816(acc[2 * np], af, bf[0], bf[1]);
            mma_16816(acc[2 * np + 1], af, bf[2], bf[3]);
        }
    }
}

// 16 bytes global → shared, asynchronously; `valid == false` writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(elem_t* dst, const elem_t* src, bool valid) {
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ unsigned pack_elems(elem_t lo, elem_t hi) {
    unsigned short l = *reinterpret_cast<unsigned short*>(&lo);
    unsigned short h = *reinterpret_cast<unsigned short*>(&hi);
    return (unsigned)l | ((unsigned)h << 16);
}

// Starts copying `rows` valid rows of `cols` valid columns (a multiple of 8) into a [ROWS][STRIDE] smem tile of
// COLS_PAD columns with the CTA's N_THREADS threads, zero-filling everything else: padding must be 0, not garbage,
// because 0 · NaN = NaN in the mma.
template <int ROWS, int COLS_PAD, int STRIDE, int N_THREADS>
__device__ __forceinline__ void load_tile_async(elem_t* smem, const elem_t* __restrict__ g, long long row_stride,
                                                int rows, int cols) {
    constexpr int CHUNKS = COLS_PAD / 8;
    // 32-bit offsets (a tile spans fewer than 2^31 elements: the host checks the row strides), recomputed each
    // time instead of hoisted out of the tile loops as 64-bit pointers, which cost two registers per chunk and made
    // the forward's 128-row tiling spill inside its loop. 16-byte aligned: cudaMalloc bases are 256-byte aligned and
    // every stride is a multiple of 8 elements.
    const int stride = (int)row_stride;
#pragma unroll 4
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += N_THREADS) {
        const int r = idx / CHUNKS;
        const int c = (idx % CHUNKS) * 8;
        const bool valid = r < rows && c < cols;
        const int offset = valid ? r * stride + c : 0;
        cp_async_16(smem + r * STRIDE + c, g + offset, valid);
    }
}
