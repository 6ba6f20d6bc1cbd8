// Hopper (sm_90a) helpers shared by the warpgroup-MMA kernels, flash_fwd_sm90.cu, flash_bwd_sm90.cu and dsa_index.cu
// (placed after common.cuh by gpu/src/compile.rs and gpu/src/dsa/index.rs): shared-memory matrix descriptors in the
// 128-byte swizzle, the wgmma instructions the kernels issue, the mbarrier and tensor-copy (TMA) primitives, and the
// swizzled cp.async tile load.
//
// Tiles in shared memory are stored as 64-column chunks of 128-byte rows in the tensor cores' 128-byte swizzle (the
// 16-byte unit u of row r sits at unit u ^ (r % 8)); every chunk starts on a 1024-byte boundary. Matrix descriptors
// (PTX ISA, "Matrix Descriptor Format"): start address >> 4 in bits 0–13, leading byte offset >> 4 in 16–29, stride
// byte offset >> 4 in 32–45, swizzle mode 1 (128 bytes) in 62–63. A K-major operand (the reduction dimension
// contiguous) has stride offset 1024 (8 rows of 128 bytes), its leading offset unused, and a k-step of 16 columns is
// 32 bytes further inside a chunk. An MN-major operand (transposed: rows are the reduction dimension) has leading
// offset = the distance between two 64-column chunks, stride offset 1024 (8 rows), and a k-step of 16 rows is 2048
// bytes further.

// Bytes of one swizzled row (64 two-byte elements).
#define SW_ROW 128

// A shared-memory matrix descriptor in the 128-byte swizzle.
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr, unsigned lead_bytes, unsigned stride_bytes) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lead_bytes >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((stride_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}
// Orders this thread's generic-proxy writes to shared memory (cp.async's) before the tensor cores' reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The mbarriers of the TMA pipeline (PTX ISA, "mbarrier"): a phase completes when its pending arrivals and expected
// transaction bytes reach zero; waits name the parity of the phase they wait for.
__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// Makes the initialised barriers visible to the tensor copy engine's completions.
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
    asm volatile("{\n.reg .pred done;\nWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// The tensor maps were written by the host before the launch; the acquire orders that write before this CTA's copies
// read them through the tensor-map proxy.
__device__ __forceinline__ void tensormap_acquire(const void* map) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
}
// Copies the box at (column `col`, row `row`) of the 2-D tensor map `map` (64 columns × BLOCK_N rows, 128-byte
// swizzle) to `dst` and signals its bytes on `bar`.
__device__ __forceinline__ void tma_load_box(unsigned dst, const void* map, int col, int row, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"(map), "r"(col), "r"(row), "r"(bar) : "memory");
}

// The accumulator operands of an m64nN wgmma with f32 accumulators: the placeholders of the first 32 or 64 operands
// and the "+f" bindings of `d` (float[N / 8][4], four per 8-column block, the m16n8 fragment order).
#define WGMMA_SLOTS_32                                                                 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "          \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_SLOTS_64                                                                 \
    WGMMA_SLOTS_32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                   "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_ACC_BLOCK(d, n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define WGMMA_ACC_32(d)                                                                                      \
    WGMMA_ACC_BLOCK(d, 0), WGMMA_ACC_BLOCK(d, 1), WGMMA_ACC_BLOCK(d, 2), WGMMA_ACC_BLOCK(d, 3),              \
        WGMMA_ACC_BLOCK(d, 4), WGMMA_ACC_BLOCK(d, 5), WGMMA_ACC_BLOCK(d, 6), WGMMA_ACC_BLOCK(d, 7)
#define WGMMA_ACC_64(d)                                                                                      \
    WGMMA_ACC_32(d), WGMMA_ACC_BLOCK(d, 8), WGMMA_ACC_BLOCK(d, 9), WGMMA_ACC_BLOCK(d, 10),                   \
        WGMMA_ACC_BLOCK(d, 11), WGMMA_ACC_BLOCK(d, 12), WGMMA_ACC_BLOCK(d, 13), WGMMA_ACC_BLOCK(d, 14),      \
        WGMMA_ACC_BLOCK(d, 15)

// D (64×128, f32) += A·B: A (64×16) and B (128×16) K-major in shared memory.
__device__ __forceinline__ void wgmma_ss_m64n128k16(float (&d)[16][4], unsigned long long a, unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_ELEM "." MMA_ELEM " {" WGMMA_SLOTS_64
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WGMMA_ACC_64(d)
                 : "l"(a), "l"(b), "n"(1));
}

// D (64×128, f32) += A·B: A (64×16) from registers, B (128 columns) N-major in shared memory.
__device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[16][4], const unsigned (&a)[4], unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_ELEM "." MMA_ELEM " {" WGMMA_SLOTS_64
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : WGMMA_ACC_64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
}

// D (64×64, f32) += A·B: A (64×16) from registers, B (64 columns) N-major in shared memory.
__device__ __forceinline__ void wgmma_rs_m64n64k16(float (&d)[8][4], const unsigned (&a)[4], unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_ELEM "." MMA_ELEM " {" WGMMA_SLOTS_32
                 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : WGMMA_ACC_32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
}

// D (64×64, f32) = A·B (+ D if `accumulate`) with A (64×16) and B (64×16) in shared memory, each K-major
// (TRANS_* = 0) or MN-major (TRANS_* = 1: the tile is stored with the reduction dimension as rows, as the backward's
// dSᵀ and K are for dQ). A first k-step that does not accumulate needs no zeroed accumulators.
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_ss_m64n64k16(float (&d)[8][4], unsigned long long a, unsigned long long b,
                                                   bool accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_ELEM "." MMA_ELEM " {" WGMMA_SLOTS_32
                 "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
                 : WGMMA_ACC_32(d)
                 : "l"(a), "l"(b), "r"((int)accumulate), "n"(TRANS_A), "n"(TRANS_B));
}

// D (64×N, f32) += A·B for N = 64 or 128: A (64×16) from registers, B (N columns) N-major in shared memory.
template <int N>
__device__ __forceinline__ void wgmma_rs_n(float (&d)[N / 8][4], const unsigned (&a)[4], unsigned long long b) {
    static_assert(N == 64 || N == 128, "wgmma_rs_n takes N = 64 or 128");
    if constexpr (N == 128) {
        wgmma_rs_m64n128k16(d, a, b);
    } else {
        wgmma_rs_m64n64k16(d, a, b);
    }
}

// The byte offset of 16-byte unit u (0 to 7) of row r inside a swizzled 128-byte row: the unit sits at u ^ (r % 8).
__device__ __forceinline__ int swizzled_unit(int u, int r) { return ((u % 8) ^ (r % 8)) << 4; }

// Starts copying `rows` valid rows (row r < `rows` starting at row_at(r), an element pointer) of `cols` valid columns
// (a multiple of 8) of a ROWS-row tile into its swizzled chunks at `smem` with the CTA's N_THREADS threads,
// zero-filling everything else from `fallback` (any readable address: a zero-byte copy reads nothing, and row_at is
// never asked for a row past `rows`), since 0 · NaN = NaN in a product and padding must never be garbage. Thread t
// copies the 16-byte unit t % UNITS of rows t / UNITS + i · ROW_STEP: unrolled, so that issuing the copies costs a few
// instructions each (evenly spaced rows differ by constant offsets). A strided loop with a division per copy took a
// sixth of the wgmma backward's issue time: eight copies per thread and visit.
template <int ROWS, int CHUNKS, int N_THREADS, typename RowAt>
__device__ __forceinline__ void load_swizzled_rows_async(unsigned char* smem, RowAt row_at, const elem_t* fallback,
                                                         int rows, int cols) {
    constexpr int UNITS = CHUNKS * 8;  // 16-byte units per row
    static_assert(N_THREADS % UNITS == 0 && (ROWS * UNITS) % N_THREADS == 0, "whole rows per pass, whole passes");
    constexpr int ROW_STEP = N_THREADS / UNITS;
    const unsigned t = threadIdx.x;
    const int u = (int)(t % UNITS), r0 = (int)(t / UNITS);
    const bool col_ok = u * 8 < cols;
    unsigned char* dst = smem + (u / 8) * (ROWS * SW_ROW) + r0 * SW_ROW;
#pragma unroll
    for (int i = 0; i < ROWS * UNITS / N_THREADS; ++i) {
        const int r = r0 + i * ROW_STEP;
        const bool valid = col_ok && r < rows;
        cp_async_16(reinterpret_cast<elem_t*>(dst + i * ROW_STEP * SW_ROW + swizzled_unit(u, r)),
                    valid ? row_at(r) + u * 8 : fallback, valid);
    }
}

// Rows evenly spaced in global memory: row r starts at first + r · stride elements.
struct StridedRows {
    const elem_t* first;
    long long stride;
    __device__ __forceinline__ const elem_t* operator()(int r) const { return first + r * stride; }
};

// load_swizzled_rows_async of the tile whose first row starts at `g`, rows `row_stride` elements apart.
template <int ROWS, int CHUNKS, int N_THREADS>
__device__ __forceinline__ void load_swizzled_async(unsigned char* smem, const elem_t* __restrict__ g,
                                                    long long row_stride, int rows, int cols) {
    load_swizzled_rows_async<ROWS, CHUNKS, N_THREADS>(smem, StridedRows{g, row_stride}, g, rows, cols);
}
