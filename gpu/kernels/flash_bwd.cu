// FlashAttention backward (E6–E10) on tensor cores, compiled by NVRTC after common.cuh (see gpu/src/compile.rs and
// gpu/src/backward.rs).
//
// Kernels (one module per storage type and padded head dims). Each takes its pointers, the sequence offsets and one
// BackwardParams (common.cuh): the problem's FlashParams, which every kernel unpacks, and the trailing scalars, of
// which bwd_kv reads dq_mode, n_chunks, part_stride and total_k, bwd_kv_group_sum n_heads_q and total_k, bwd_dq
// n_chunks, and bwd_dq_finalize finalize_mode and part_stride.
//   bwd_preprocess    D = rowsum(dO ∘ O) in f32 (E7), one warp per row.
//   bwd_kv            KV owner: one CTA of KV_WARPS warps per (KV tile of KV_TILE = 16 · KV_WARPS keys, query head ×
//                     column chunk, sequence); warp w owns keys 16w … 16w + 15. For every query tile of Q_TILE = 64 rows
//                     that can see the KV tile (the others are skipped, not masked) it recomputes Sᵀ = K Qᵀ, Pᵀ,
//                     dPᵀ = V dOᵀ and dSᵀ, accumulates dV += round_T(P)ᵀ dO and dK += dSᵀ Q in registers over the
//                     chunk's columns, and, per `dq_mode`, adds the tile's dQ = dS K to an f32 accumulator with
//                     vector atomics (1) or writes it as a per-KV-tile partial (2). Q and dO tiles are double
//                     buffered with cp.async (Q_STAGES = 2; 1 when the head dims are too wide for two stages), so
//                     tile a + 1 loads while tile a computes. Without GQA it writes dK and dV; under GQA it writes
//                     its query head's f32 dK, dV sums to a workspace for bwd_kv_group_sum.
//   bwd_kv_group_sum  GQA: dK = round_T(α̂ · Σ_h dK_h), dV = round_T(Σ_h dV_h), summed in ascending head order.
//   bwd_dq            Strategy A's second traversal: one CTA of 4 warps per (query tile, query head × column chunk,
//                     sequence) owns dQ, recomputing P and dS over KV tiles of DQ_KV_TILE = 64 keys, no atomics.
//   bwd_dq_finalize   dQ = round_T(α̂ · acc) from the atomic accumulator (mode 0) or from the partials summed in
//                     ascending KV-tile order (mode 1: bitwise deterministic).
//   BLOCK_SPARSE      (optional) block-sparse backward (E14): bwd_csr_count, bwd_csr_scan and bwd_csr_fill transpose
//                     the forward's lists on the device (per key block, the query blocks that list it); bwd_kv walks
//                     its key block's CSR row instead of every query tile, bwd_dq and the deterministic
//                     bwd_dq_finalize walk the query block's list instead of every KV tile. Masks, tails and windows
//                     still apply inside the visited tiles, so each element's arithmetic is the dense kernels'.
// Every product uses mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16} with operands from ldmatrix (.trans where the
// reduction runs along the tile's rows); k-steps whose 16 rows are all past the valid length are skipped (they would
// add zeros), so a sum of n terms over t tiles takes at most ⌈n/16⌉ + t instructions. Output columns are split in
// chunks of CHUNK ≤ 128 (grid y): up to 128 columns every accumulator stays in registers and S, dP are computed once;
// wider head dims recompute S and dP per chunk.
//
// Compile-time parameters: ELEM_BF16 or ELEM_F16; HEAD_DIM_PAD (d rounded up to 16); HEAD_DIM_V_PAD (dv rounded up
// to 16: dv is the reduction of dP); CHUNK (a multiple of 32 up to 128); Q_STAGES (1 or 2); KV_WARPS (4 or 8: the
// tiling of bwd_kv; 4 warps over 64 keys leave room for two CTAs per SM). Padding columns are zero in shared memory.
//
// Precision recipe (the rounding-error argument is in gpu/src/backward.rs):
//   dot  = q · k                                  f32 from the tensor cores (unscaled)
//   cL   = fl32(α̂ · log2 e), bL = fl32(LSE · log2 e)   each one rounding of an f64 product; α̂ = fl32(1/√d)
//   arg  = fma(dot, cL, −bL)                      ≈ (α̂·dot − LSE)·log2 e, one rounding
//   p    = ex2.approx.ftz(arg)                    results below 2^-126 flush to +0; p = 0 when masked or when
//          LSE = −∞ (a row that sees no key: bL = +∞ makes arg = −∞)
//   dP   = dO · vᵀ                                f32 tensor cores
//   dS   = round_T(fl(p · fl(dP − D)))
//   dV  += round_T(p)ᵀ dO, dK += dSᵀ Q, dQ += dS K   f32 accumulators (GQA: per head, then summed in f32 in
//          ascending head order by bwd_kv_group_sum)
//   dK   = round_T(fl(α̂ · dK)), dQ likewise, dV = round_T(dV)
// Masks: as the forward (bottom-right aligned; "no bound" is 1 << 30; 32-bit positions, since the host guarantees
// Lq + Lk ≤ 2^30 per sequence).

#ifndef HEAD_DIM_PAD
#error "define HEAD_DIM_PAD"
#endif
#ifndef HEAD_DIM_V_PAD
#error "define HEAD_DIM_V_PAD"
#endif
#ifndef CHUNK
#error "define CHUNK"
#endif
#ifndef Q_STAGES
#error "define Q_STAGES"
#endif
#ifndef KV_WARPS
#error "define KV_WARPS"
#endif

// KV_ACCUM (optional, the ring backward): bwd_kv adds its query head's f32 dK, dV sums to the workspace instead of
// writing them (or, without GQA, the rounded gradients): the workspace travels with its KV block and collects every
// query chunk's sums, and bwd_kv_group_sum turns it into dK, dV at home.
#if defined(KV_ACCUM)
#define KV_ACCUMULATE 1
#else
#define KV_ACCUMULATE 0
#endif

#define Q_TILE 64
#define KV_TILE (KV_WARPS * 16)
#define DQ_KV_TILE 64
#define NUM_WARPS 4
#define THREADS (NUM_WARPS * 32)
#define KV_THREADS (KV_WARPS * 32)
// bwd_kv's dQ step: the warps form DQ_ROW_GROUPS groups along the tile's query rows, DQ_MT m-tiles of 16 rows each,
// and split the chunk's columns in DQ_SPLIT parts. Two groups of 32 rows, where the parts stay whole pairs of 16
// columns, let each dS fragment a warp loads feed twice the MMAs of four groups of 16 rows (fewer ldmatrix per MMA).
#define DQ_ROW_GROUPS ((CHUNK / (KV_WARPS / 2)) % 16 == 0 ? 2 : 4)
#define DQ_MT (Q_TILE / 16 / DQ_ROW_GROUPS)
#define DQ_SPLIT (KV_WARPS / DQ_ROW_GROUPS)
#define DQ_COLS (CHUNK / DQ_SPLIT)
// Whether one chunk covers both padded head dims (then the host launches one chunk, c0 = 0, and every column test
// against a padded width below is a compile-time constant).
#define ONE_CHUNK (HEAD_DIM_PAD <= CHUNK && HEAD_DIM_V_PAD <= CHUNK)
// Row padding of 8 elements (16 bytes): the 8 rows of an ldmatrix phase fall in distinct bank groups.
#define SMEM_PAD 8
#define QK_STRIDE (HEAD_DIM_PAD + SMEM_PAD)
#define V_STRIDE (HEAD_DIM_V_PAD + SMEM_PAD)
#define DS_STRIDE (KV_TILE + SMEM_PAD)

static_assert(HEAD_DIM_PAD % 16 == 0 && HEAD_DIM_PAD <= 256, "HEAD_DIM_PAD must be a multiple of 16 up to 256");
static_assert(HEAD_DIM_V_PAD % 16 == 0 && HEAD_DIM_V_PAD <= 256, "HEAD_DIM_V_PAD must be a multiple of 16 up to 256");
static_assert(CHUNK % 32 == 0 && CHUNK <= 128, "CHUNK must be a multiple of 32 up to 128");
static_assert(Q_STAGES == 1 || Q_STAGES == 2, "Q_STAGES must be 1 or 2");
static_assert(KV_WARPS == 4 || KV_WARPS == 8, "KV_WARPS must be 4 or 8");
static_assert(Q_TILE == 4 * 16, "bwd_kv's dQ step splits the tile's four m-tiles among its row groups");
static_assert(DQ_COLS % 16 == 0, "each dQ column part is whole ldmatrix.x4.trans pairs of n tiles");

// log2 e, the double nearest it (within 2^-53 relative): the two per-launch and per-row products cL and bL are formed
// in f64 and rounded once to f32, so neither carries the rounding of an f32 log2 e.
#define LOG2E_D 1.4426950408889634
#define POS_INF __int_as_float(0x7f800000)

// cL = fl32(α̂ · log2 e): the unscaled dot product times cL is the exponent's score term.
__device__ __forceinline__ float scale_log2(float scale) { return __double2float_rn((double)scale * LOG2E_D); }

// bL = fl32(LSE · log2 e) of a row; a row that sees no key (LSE = −∞) gets +∞, so that its argument is −∞ and p = +0
// for any finite score.
__device__ __forceinline__ float row_bl(float lse) {
    return lse == NEG_INF ? POS_INF : __double2float_rn((double)lse * LOG2E_D);
}

// P = exp(α̂·dot − LSE) = 2^fma(dot, cL, −bL), flushing results below 2^-126 (the recipe's exp_underflow,
// gpu/src/backward.rs).
__device__ __forceinline__ float prob(float dot, float cl, float bl) { return ex2_approx_ftz(__fmaf_rn(dot, cl, -bl)); }

// If `add`, adds two f32 values to consecutive (8-byte aligned) global addresses with one vector reduction (sm_90).
// The condition is a predicate inside the asm: a C++ `if` around an asm statement compiles to a branch per call.
__device__ __forceinline__ void red_add_v2(bool add, float* p, float x0, float x1) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n @p red.global.add.v2.f32 [%0], {%1, %2};\n}\n" ::"l"(p),
        "f"(x0), "f"(x1), "r"((int)add)
        : "memory");
}

// If `store`, writes two f32 values to consecutive (8-byte aligned) global addresses with one vector store (predicated
// inside the asm, as red_add_v2).
__device__ __forceinline__ void store_v2(bool store, float* p, float x0, float x1) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n @p st.global.v2.f32 [%0], {%1, %2};\n}\n" ::"l"(p),
                 "f"(x0), "f"(x1), "r"((int)store)
                 : "memory");
}

// The per-sequence view of the problem (dense or varlen).
struct SeqView {
    int len_q, len_k;
    long long q_base, k_base, v_base, o_base, lse_base;
    // Index of the sequence's first key among all sequences' keys (the row of the GQA workspace).
    long long k_row0;
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
        s.k_row0 = k0;
    } else {
        s.len_q = dense_len_q;
        s.len_k = dense_len_k;
        s.q_base = seq * q_batch;
        s.k_base = seq * k_batch;
        s.v_base = seq * v_batch;
        s.o_base = seq * o_batch;
        s.lse_base = seq * lse_batch;
        s.k_row0 = (long long)seq * dense_len_k;
    }
    return s;
}

// The query tiles [a_lo, a_hi] (of Q_TILE rows) that can see some key of KV tile `b` of `tile_keys` keys: rows i with
// diag(i) − left ≤ key_end − 1 and diag(i) + right ≥ key0. The same predicate decides which partials exist.
__device__ __forceinline__ bool kv_tile_rows(int b, int tile_keys, int len_q, int len_k, const Diagonal& diag,
                                             int win_left, int win_right, int* a_lo, int* a_hi) {
    const long long key0 = (long long)b * tile_keys;
    const long long key_end = min((long long)len_k, key0 + tile_keys);
    long long row_lo = diag.first_row_reaching(key0 - win_right);
    long long row_hi = diag.last_row_within(key_end - 1 + win_left);
    if (row_lo < 0) row_lo = 0;
    if (row_hi > (long long)len_q - 1) row_hi = (long long)len_q - 1;
    if (key0 >= key_end || row_lo > row_hi) return false;
    *a_lo = (int)(row_lo / Q_TILE);
    *a_hi = (int)(row_hi / Q_TILE);
    return true;
}

// The arguments every kernel of this file takes after its own pointers: the sequence offsets and the family's one
// parameter struct (common.cuh), whose problem scalars UNPACK_FLASH_PARAMS(params.flash) turns into locals.
#define COMMON_PARAMS const int *__restrict__ cu_q, const int *__restrict__ cu_k, const BackwardParams params

// BLOCK_SPARSE: bwd_kv, bwd_dq and bwd_dq_finalize also take the forward's block lists, their CSR transpose (built by
// bwd_csr_count, bwd_csr_scan and bwd_csr_fill below) and the lists' scalars.
#if defined(BLOCK_SPARSE)
#define SPARSE_PARAMS                                                                                               \
    , const int *__restrict__ block_lists, const int *__restrict__ csr_offsets, const int *__restrict__ csr_q_blocks, \
        const BlockListParams lists
// The arguments SPARSE_PARAMS names, passed on to a helper that takes SPARSE_PARAMS.
#define SPARSE_ARGS , block_lists, csr_offsets, csr_q_blocks, lists
// The list of the query block holding row `row0` of query head `head` in sequence `seq`.
#define QUERY_BLOCK_LIST(seq, head, row0)                                                                            \
    (block_lists + (seq) * lists.seq_stride + (long long)((head) / lists.heads_per_list) * lists.head_stride +       \
     (long long)((row0) / lists.q_block) * lists.width)
// The index of the first entry of a list (`width` entries, an ascending valid prefix then -1) that is ≥ `block`,
// reading a pad as larger than every block (`width` when there is none): a binary search.
__device__ __forceinline__ int list_position(const int* __restrict__ list, int width, int block) {
    int lo = 0, hi = width;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        const int x = __ldg(list + mid);
        if (x >= 0 && x < block) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// Whether the list holds `block`.
__device__ __forceinline__ bool list_holds(const int* __restrict__ list, int width, int block) {
    const int at = list_position(list, width, block);
    return at < width && __ldg(list + at) == block;
}

// The deterministic mode's dQ partial slot of KV tile `t` (key blocks of `kv_tiles_per_block` tiles) for the query
// block whose list is `list`: the tile's position in that list, as TileCursor::last_position counts it when
// bwd_dq_finalize walks the list. The workspace then holds width × kv_tiles_per_block partials of Q's size, not one
// per KV tile of the longest sequence (which at 128K keys would be a thousand copies of Q).
__device__ __forceinline__ int partial_slot(const int* __restrict__ list, int width, int t, int kv_tiles_per_block) {
    return list_position(list, width, t / kv_tiles_per_block) * kv_tiles_per_block + t % kv_tiles_per_block;
}
#else
#define SPARSE_PARAMS
#define SPARSE_ARGS
#endif

#define SEQ_VIEW(seq)                                                                                                \
    seq_view(seq, cu_q, cu_k, varlen, dense_len_q, dense_len_k, q_batch, q_row, k_batch, k_row, v_batch, v_row,     \
             o_batch, o_row, lse_batch)

// D = rowsum(dO ∘ O) in f32: one warp per row, lanes over column pairs, then a shuffle tree (any order: γ(dv)).
extern "C" __global__ void __launch_bounds__(THREADS)
bwd_preprocess(const elem_t* __restrict__ o, const elem_t* __restrict__ d_out, float* __restrict__ delta,
               COMMON_PARAMS) {
    UNPACK_FLASH_PARAMS(params.flash);
    const SeqView sv = SEQ_VIEW(blockIdx.z);
    const int head = blockIdx.y;
    const int row0 = blockIdx.x * Q_TILE;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < Q_TILE; r += NUM_WARPS) {
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

// A KV owner's tensors in sequence `sv`: K and V from the KV tile's first key (of query head `head`'s KV head), and
// Q, dO, LSE and D from query head `head`'s first row.
struct KvOwnerTensors {
    const elem_t* k_tile;
    const elem_t* v_tile;
    const elem_t* q_g;
    const elem_t* do_g;
    const float* lse_g;
    const float* delta_g;

    // b_L = fl32(LSE · log2 e) and D of the query tile from row `row0` (`rows` valid rows) into `bl` and `dl`
    // (Q_TILE entries each; a row past the valid ones gets b_L = +∞ and D = 0), by the CTA's N_THREADS threads.
    template <int N_THREADS>
    __device__ __forceinline__ void load_row_stats(float* bl, float* dl, int row0, int rows) const {
#pragma unroll
        for (int round = 0; round < (Q_TILE + N_THREADS - 1) / N_THREADS; ++round) {
            const int r = (int)threadIdx.x + round * N_THREADS;
            if (r >= Q_TILE) break;
            const float l = r < rows ? lse_g[row0 + r] : NEG_INF;
            bl[r] = row_bl(l);
            dl[r] = r < rows ? delta_g[row0 + r] : 0.f;
        }
    }
};

__device__ __forceinline__ KvOwnerTensors kv_owner_tensors(const FlashParams& fp, const SeqView& sv, int head, int key0,
                                                           const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                                                           const elem_t* __restrict__ v,
                                                           const elem_t* __restrict__ d_out,
                                                           const float* __restrict__ lse,
                                                           const float* __restrict__ delta) {
    UNPACK_FLASH_PARAMS(fp);
    const int kv_head = head / group;
    return KvOwnerTensors{k + sv.k_base + kv_head * k_head + (long long)key0 * k_row,
                          v + sv.v_base + kv_head * v_head + (long long)key0 * v_row,
                          q + sv.q_base + head * q_head,
                          d_out + sv.o_base + head * o_head,
                          lse + sv.lse_base + head * lse_head,
                          delta + sv.lse_base + head * lse_head};
}

// The KV owner's walk (bwd_kv and flash_bwd_sm90.cu's): the query tiles that can see KV tile `b` (of KV_TILE keys)
// of the sequence `sv` (grid z) for query head `head` under the problem `fp`, ascending; BLOCK_SPARSE, only those
// whose query block lists the tile's key block (a KV tile never straddles two key blocks: the host takes
// KV_TILE ≤ kv_block), read from the tile's CSR row.
__device__ __forceinline__ TileCursor kv_owner_cursor(const FlashParams& fp, int b, const SeqView& sv,
                                                      int head SPARSE_PARAMS) {
    UNPACK_FLASH_PARAMS(fp);
    int a_lo = 0, a_hi = -1;
    if (!kv_tile_rows(b, KV_TILE, sv.len_q, sv.len_k, row_diagonal(fp, sv.len_q, sv.len_k), win_left, win_right, &a_lo,
                      &a_hi)) {
        a_lo = 0;
        a_hi = -1;
    }
#if defined(BLOCK_SPARSE)
    const int key0 = b * KV_TILE;
    const long long csr_row = ((long long)blockIdx.z * lists.list_heads + head / lists.heads_per_list) * lists.kv_blocks +
                              key0 / (lists.tiles_per_block * 64);
    const int csr_lo = csr_offsets[csr_row];
    return list_cursor(a_lo, a_hi + 1, csr_q_blocks + csr_lo, csr_offsets[csr_row + 1] - csr_lo, lists.q_block / Q_TILE);
#else
    return range_cursor(a_lo, a_hi + 1);
#endif
}

// Whether every row of query tile `row0` (rows_here valid rows) sees all 16 keys of a warp from `wkey0`: then the
// warp's P needs no mask.
__device__ __forceinline__ bool warp_keys_interior(const SeqView& sv, int rows_here, int row0, int wkey0,
                                                   const Diagonal& diag, int win_left, int win_right) {
    const bool interior = rows_here == Q_TILE && wkey0 + 16 <= sv.len_k &&
                          wkey0 + 15 <= diag.at(row0) + win_right && wkey0 >= diag.at(row0 + Q_TILE - 1) - win_left;
    return interior;
}

// Where a KV owner puts the dQ of query tile `row0` it computes from KV tile `b`: the f32 accumulator (dq_mode 1) or
// the tile's partial (dq_mode 2), at the tile's first row of query head `head`.
__device__ __forceinline__ float* dq_tile_rows(const FlashParams& fp, int dq_mode, float* __restrict__ dq_acc,
                                               float* __restrict__ dq_part, long long part_stride, const SeqView& sv,
                                               int head, int b, int row0 SPARSE_PARAMS) {
#if defined(BLOCK_SPARSE)
    // The partial's slot: this tile's position in the query block's list (bwd_dq_finalize reads it there).
    const int slot = dq_mode == 1 ? 0
                                  : partial_slot(QUERY_BLOCK_LIST(blockIdx.z, head, row0), lists.width, b,
                                                 lists.tiles_per_block * 64 / KV_TILE);
#else
    const int slot = b;
#endif
    return (dq_mode == 1 ? dq_acc : dq_part + (long long)slot * part_stride) + sv.q_base + head * fp.q_head +
           (long long)row0 * fp.q_row;
}

// Where a KV owner's finished row of dK (V_GRAD false: scaled by α̂) or dV for key `key` (counted from the sequence's
// first key) of query head `head` goes: without GQA the row of `out`, rounded to T; under GQA (or KV_ACCUM) the head's
// f32 row of the workspace ([n_heads_q][total_k][d], then [n_heads_q][total_k][dv]) for bwd_kv_group_sum. One CTA
// owns each element within a launch; launches on one stream run in order, so the adds of KV_ACCUM need no atomics.
// The row's addresses are formed once by kv_grad_row for all the pairs a thread stores in it (flash_bwd_sm90.cu's
// epilogue: formed per pair, the kernel parameters they read were reloaded after every store).
template <bool V_GRAD>
struct KvGradRow {
    elem_t* out;    // the row of dK or dV (direct)
    float* part;    // the head's row of the workspace (not direct)
    int width;      // d or dv
    float scale;    // α̂, for dK
    bool direct;

    // Columns col and col + 1 (nothing past the row's width).
    __device__ __forceinline__ void store(int col, float x0, float x1) const {
        if (col >= width) return;
        if (direct) {
            *reinterpret_cast<unsigned*>(out + col) =
                V_GRAD ? pack_elems(to_elem(x0), to_elem(x1))
                       : pack_elems(to_elem(__fmul_rn(scale, x0)), to_elem(__fmul_rn(scale, x1)));
        } else {
            float2* p = reinterpret_cast<float2*>(part + col);
            const float2 old = KV_ACCUMULATE ? *p : make_float2(0.f, 0.f);
            *p = KV_ACCUMULATE ? make_float2(__fadd_rn(old.x, x0), __fadd_rn(old.y, x1)) : make_float2(x0, x1);
        }
    }
};

template <bool V_GRAD>
__device__ __forceinline__ KvGradRow<V_GRAD> kv_grad_row(const FlashParams& fp, elem_t* __restrict__ out,
                                                         float* __restrict__ dkv_part, const SeqView& sv, int head,
                                                         long long n_heads_q, long long total_k, int key) {
    UNPACK_FLASH_PARAMS(fp);
    KvGradRow<V_GRAD> row{nullptr, nullptr, V_GRAD ? dv : d, scale, group == 1 && !KV_ACCUMULATE};
    if (row.direct) {
        const int kv_head = head / group;
        row.out = out + (V_GRAD ? sv.v_base + kv_head * v_head + (long long)key * v_row
                                : sv.k_base + kv_head * k_head + (long long)key * k_row);
    } else {
        const long long part_row = head * total_k + sv.k_row0 + key;
        row.part = V_GRAD ? dkv_part + n_heads_q * total_k * d + part_row * dv : dkv_part + part_row * d;
    }
    return row;
}

// Columns col and col + 1 of key `key`'s row of dK (V_GRAD false) or dV (kv_grad_row), the row formed for this pair
// alone: flash_bwd.cu's bwd_kv stores this way, which needs fewer live registers than holding rows.
template <bool V_GRAD>
__device__ __forceinline__ void store_kv_grad(const FlashParams& fp, elem_t* __restrict__ out,
                                              float* __restrict__ dkv_part, const SeqView& sv, int head,
                                              long long n_heads_q, long long total_k, int key, int col, float x0,
                                              float x1) {
    if (col >= (V_GRAD ? fp.dv : fp.d)) return;
    kv_grad_row<V_GRAD>(fp, out, dkv_part, sv, head, n_heads_q, total_k, key).store(col, x0, x1);
}

// Pᵀ and dSᵀ of one warp's 16 keys × Q_TILE queries: st holds Sᵀ (unscaled dot products) and becomes P (f32, in
// place); dpt holds dPᵀ, and dsp receives round_T(dS) packed two per register as the A operand of the next MMA takes
// it (dsp[n][h] holds elements e = 2h and 2h + 1 of dpt[n], the first in the low half). If MASKED, element (n, e)
// (query column n·8 + 2·tig + e % 2, key row g + 8·(e / 2)) is visible iff its query is one of the tile's
// `rows_left` rows (counted from the thread's first column), its key below len_k, and the key within the window of
// the query's diagonal `diag.at(row_t + n·8 + e % 2)`, row_t the row of the thread's first column. `RowDiagonals` is
// Diagonal for the dense kernels, and any type with `int at(int row)` (nsa_selected_bwd.cu's gathered rows: the token).
template <bool MASKED, typename RowDiagonals>
__device__ __forceinline__ void tile_p_ds(float (&st)[Q_TILE / 8][4], const float (&dpt)[Q_TILE / 8][4],
                                          unsigned (&dsp)[Q_TILE / 8][2], const float* bl_t, const float* delta_t,
                                          float cl, int tig, const RowDiagonals& diag, int row_t, int key_t,
                                          int rows_left, int len_k,
                                          int win_left, int win_right) {
#pragma unroll
    for (int n = 0; n < Q_TILE / 8; ++n) {
        float ds_pair[2];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int qc = n * 8 + tig * 2 + (e % 2);
            float p = prob(st[n][e], cl, bl_t[qc]);
            if (MASKED) {
                const int i = diag.at(row_t + n * 8 + (e % 2));
                const int j = key_t + 8 * (e / 2);
                const bool vis = n * 8 + (e % 2) < rows_left && j < len_k && j <= i + win_right && j >= i - win_left;
                p = vis ? p : 0.f;
            }
            const float ds = __fmul_rn(p, __fsub_rn(dpt[n][e], delta_t[qc]));
            st[n][e] = p;
            ds_pair[e % 2] = ds;
            if (e % 2 == 1) dsp[n][e / 2] = pack2(ds_pair[0], ds_pair[1]);
        }
    }
}

// The A fragment of dSᵀ for k-step kk (queries 16kk … 16kk + 15) from tile_p_ds's packed pairs: the m16k16 layout of
// n tiles 2kk and 2kk + 1.
__device__ __forceinline__ void ds_fragment(unsigned (&sa)[4], const unsigned (&dsp)[Q_TILE / 8][2], int kk) {
    sa[0] = dsp[2 * kk][0];
    sa[1] = dsp[2 * kk][1];
    sa[2] = dsp[2 * kk + 1][0];
    sa[3] = dsp[2 * kk + 1][1];
}

// dV += round_T(P)ᵀ dO and dK += dSᵀ Q for one warp's 16 keys over the tile's query rows (k = queries): P from `st`
// (f32, rounded here), dS from `dsp`, dO and Q from shared memory (`.trans`: the reduction runs along their rows).
// FULL: all Q_TILE rows are valid (no k-step test); otherwise k-steps wholly past `rows_here` are skipped.
template <bool FULL>
__device__ __forceinline__ void add_dk_dv(float (&acc_k)[CHUNK / 8][4], float (&acc_v)[CHUNK / 8][4],
                                          const float (&st)[Q_TILE / 8][4], const unsigned (&dsp)[Q_TILE / 8][2],
                                          unsigned do_bt, unsigned q_bt, int c0, int rows_here) {
#pragma unroll
    for (int kk = 0; kk < Q_TILE / 16; ++kk) {
        if (!FULL && kk * 16 >= rows_here) break;
        unsigned pa[4], sa[4];
        pack_a(pa, st[2 * kk], st[2 * kk + 1]);
        ds_fragment(sa, dsp, kk);
#pragma unroll
        for (int np = 0; np < CHUNK / 16; ++np) {
            const int col = c0 + np * 16;
            unsigned bf[4];
            if (col < HEAD_DIM_V_PAD) {
                ldsm_x4_trans(bf, do_bt + (kk * 16 * V_STRIDE + col) * ESZ);
                mma_16816(acc_v[2 * np], pa, bf[0], bf[1]);
                mma_16816(acc_v[2 * np + 1], pa, bf[2], bf[3]);
            }
            if (col < HEAD_DIM_PAD) {
                ldsm_x4_trans(bf, q_bt + (kk * 16 * QK_STRIDE + col) * ESZ);
                mma_16816(acc_k[2 * np], sa, bf[0], bf[1]);
                mma_16816(acc_k[2 * np + 1], sa, bf[2], bf[3]);
            }
        }
    }
}

// One warp's share of a KV tile's dQ = dS K: DQ_MT m-tiles of 16 query rows (dS from shared memory at `ds_a`) × DQ_COLS columns from
// `dq_c`, reduced over the tile's keys (K transposed from shared memory at `k_bt`). FULL: all KV_TILE keys are valid;
// otherwise k-steps wholly past `keys_here` are skipped.
template <bool FULL>
__device__ __forceinline__ void tile_dq(float (&part)[DQ_MT][DQ_COLS / 8][4], unsigned ds_a, unsigned k_bt, int dq_c,
                                        int keys_here) {
#pragma unroll
    for (int mt = 0; mt < DQ_MT; ++mt) {
#pragma unroll
        for (int n = 0; n < DQ_COLS / 8; ++n) part[mt][n][0] = part[mt][n][1] = part[mt][n][2] = part[mt][n][3] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < KV_TILE / 16; ++kk) {
        if (!FULL && kk * 16 >= keys_here) break;
        unsigned af[DQ_MT][4];
#pragma unroll
        for (int mt = 0; mt < DQ_MT; ++mt) ldsm_x4(af[mt], ds_a + (mt * 16 * DS_STRIDE + kk * 16) * ESZ);
#pragma unroll
        for (int np = 0; np < DQ_COLS / 16; ++np) {
            const int col = dq_c + np * 16;
            // One chunk as wide as the padded d: every warp's columns are inside it.
            if ((ONE_CHUNK && CHUNK == HEAD_DIM_PAD) || col < HEAD_DIM_PAD) {
                unsigned bf[4];
                ldsm_x4_trans(bf, k_bt + (kk * 16 * QK_STRIDE + col) * ESZ);
#pragma unroll
                for (int mt = 0; mt < DQ_MT; ++mt) {
                    mma_16816(part[mt][2 * np], af[mt], bf[0], bf[1]);
                    mma_16816(part[mt][2 * np + 1], af[mt], bf[2], bf[3]);
                }
            }
        }
    }
}

// The shared-memory lane addresses of a KV owner's warp `warp` over bwd_kv's layout (nsa_selected_bwd.cu's KV owner
// shares it), for the column chunk from c0.
struct KvOwnerLanes {
    // ldmatrix lane addresses: K and V are the A operands of Sᵀ and dPᵀ (the warp's 16 keys); Q and dO their B
    // operands (rows are n), and the B operands of dK and dV (rows are k: transposed).
    unsigned k_a, v_a, q_b, do_b, q_bt, do_bt;
    // The dQ step's dS (A operand, from row wq) and its stmatrix rows, and K transposed (B operand).
    unsigned ds_a, ds_st, k_bt;
    // The dQ step: warp w computes the 16·DQ_MT query rows of row group w % DQ_ROW_GROUPS from wq and DQ_COLS of the
    // chunk's columns from dq_c.
    int wq, dq_c;
};

__device__ __forceinline__ KvOwnerLanes kv_owner_lanes(const elem_t* k_s, const elem_t* v_s, const elem_t* q_s,
                                                       const elem_t* do_s, const elem_t* ds_s, int warp, int lane,
                                                       int c0) {
    const int wk = warp * 16;
    const int wq = (warp % DQ_ROW_GROUPS) * 16 * DQ_MT;
    const int dq_c = c0 + (warp / DQ_ROW_GROUPS) * DQ_COLS;
    // stmatrix row addresses: lane l writes row l % 8 (a query) of block l / 8: keys wk + 8·(l/8 % 2), queries
    // 8·(l / 16) further down.
    return KvOwnerLanes{smem_u32(k_s + wk * QK_STRIDE + lane_a(lane, QK_STRIDE)),
                        smem_u32(v_s + wk * V_STRIDE + lane_a(lane, V_STRIDE)),
                        smem_u32(q_s + lane_b(lane, QK_STRIDE)),
                        smem_u32(do_s + lane_b(lane, V_STRIDE)),
                        smem_u32(q_s + lane_b_trans(lane, QK_STRIDE)),
                        smem_u32(do_s + lane_b_trans(lane, V_STRIDE)),
                        smem_u32(ds_s + wq * DS_STRIDE + lane_a(lane, DS_STRIDE)),
                        smem_u32(ds_s + ((lane % 8) + (lane / 16) * 8) * DS_STRIDE + wk + ((lane / 8) % 2) * 8),
                        smem_u32(k_s + lane_b_trans(lane, QK_STRIDE)),
                        wq,
                        dq_c};
}

// BWD_KV_SM90: flash_bwd_sm90.cu, which follows this text, defines bwd_kv instead.
#if !defined(BWD_KV_SM90)
extern "C" __global__ void __launch_bounds__(KV_THREADS, 8 / KV_WARPS)
bwd_kv(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
       const elem_t* __restrict__ d_out, const float* __restrict__ lse, const float* __restrict__ delta,
       elem_t* __restrict__ dk_out, elem_t* __restrict__ dv_out, float* __restrict__ dq_acc,
       float* __restrict__ dq_part, float* __restrict__ dkv_part, COMMON_PARAMS SPARSE_PARAMS) {
    UNPACK_FLASH_PARAMS(params.flash);
    const int dq_mode = params.dq_mode;
    const int n_chunks = params.n_chunks;
    const long long part_stride = params.part_stride;
    const long long total_k = params.total_k;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* k_s = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* v_s = k_s + KV_TILE * QK_STRIDE;
    elem_t* q_s = v_s + KV_TILE * V_STRIDE;              // [Q_STAGES][Q_TILE][QK_STRIDE]
    elem_t* do_s = q_s + Q_STAGES * Q_TILE * QK_STRIDE;  // [Q_STAGES][Q_TILE][V_STRIDE]
    elem_t* ds_s = do_s + Q_STAGES * Q_TILE * V_STRIDE;  // [Q_TILE][DS_STRIDE]: the tile's dS, queries × keys
    float* bl_s = reinterpret_cast<float*>(ds_s + Q_TILE * DS_STRIDE);  // [Q_STAGES][Q_TILE] each
    float* delta_s = bl_s + Q_STAGES * Q_TILE;

    const int b = blockIdx.x;
    const int head = ONE_CHUNK ? blockIdx.y : blockIdx.y / n_chunks;
    const int c0 = ONE_CHUNK ? 0 : (blockIdx.y % n_chunks) * CHUNK;
    const SeqView sv = SEQ_VIEW(blockIdx.z);
    const int key0 = b * KV_TILE;
    if (key0 >= sv.len_k) return;
    const int keys_here = min(KV_TILE, sv.len_k - key0);
    const Diagonal diag = row_diagonal(params.flash, sv.len_q, sv.len_k);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    const int wk = warp * 16;

    const KvOwnerTensors tensors = kv_owner_tensors(params.flash, sv, head, key0, q, k, v, d_out, lse, delta);
    load_tile_async<KV_TILE, HEAD_DIM_PAD, QK_STRIDE, KV_THREADS>(k_s, tensors.k_tile, k_row, keys_here, d);
    load_tile_async<KV_TILE, HEAD_DIM_V_PAD, V_STRIDE, KV_THREADS>(v_s, tensors.v_tile, v_row, keys_here, dv);
    // Starts loading query tile `a` into `stage`: Q and dO by cp.async, the row statistics by plain loads.
    auto load_q_tile = [&](int a, int stage) {
        const int row0 = a * Q_TILE;
        const int rows = min(Q_TILE, sv.len_q - row0);
        load_tile_async<Q_TILE, HEAD_DIM_PAD, QK_STRIDE, KV_THREADS>(
            q_s + stage * Q_TILE * QK_STRIDE, tensors.q_g + (long long)row0 * q_row, q_row, rows, d);
        load_tile_async<Q_TILE, HEAD_DIM_V_PAD, V_STRIDE, KV_THREADS>(
            do_s + stage * Q_TILE * V_STRIDE, tensors.do_g + (long long)row0 * o_row, o_row, rows, dv);
        tensors.load_row_stats<KV_THREADS>(bl_s + stage * Q_TILE, delta_s + stage * Q_TILE, row0, rows);
    };
    TileCursor cursor = kv_owner_cursor(params.flash, b, sv, head SPARSE_ARGS);
    int a = cursor.next();
    if (a >= 0) load_q_tile(a, 0);
    cp_async_commit();

    const auto [k_a, v_a, q_b, do_b, q_bt, do_bt, ds_a, ds_st, k_bt, wq, dq_c] =
        kv_owner_lanes(k_s, v_s, q_s, do_s, ds_s, warp, lane, c0);
    const int key_t = key0 + wk + g;  // the key of the thread's accumulator rows g (and key_t + 8: row g + 8)
    const float cl = scale_log2(scale);

    float acc_k[CHUNK / 8][4], acc_v[CHUNK / 8][4];
#pragma unroll
    for (int n = 0; n < CHUNK / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_k[n][e] = acc_v[n][e] = 0.f;
    }

    for (int visit = 0; a >= 0; ++visit) {
        const int stage = Q_STAGES == 2 ? visit & 1 : 0;
        if (Q_STAGES == 1 && visit > 0) {
            __syncthreads();  // every warp is done with the previous tile's Q, dO and dS
            load_q_tile(a, 0);
            cp_async_commit();
        }
        cp_async_wait_all();
        __syncthreads();  // tile a (and K, V) landed for everyone; every warp is done with the previous tile
        const int a_next = cursor.next();
        if (Q_STAGES == 2 && a_next >= 0) {
            load_q_tile(a_next, stage ^ 1);
            cp_async_commit();
        }
        const int row0 = a * Q_TILE;
        const int rows_here = min(Q_TILE, sv.len_q - row0);
        const unsigned q_off = stage * Q_TILE * QK_STRIDE * ESZ;
        const unsigned do_off = stage * Q_TILE * V_STRIDE * ESZ;
        const float* bl_t = bl_s + stage * Q_TILE;
        const float* delta_t = delta_s + stage * Q_TILE;

        // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's 16 keys and the tile's 64 queries.
        float st[Q_TILE / 8][4], dpt[Q_TILE / 8][4];
#pragma unroll
        for (int n = 0; n < Q_TILE / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
        }
        warp_mma_nt<HEAD_DIM_PAD / 16, Q_TILE / 16, QK_STRIDE>(st, k_a, q_b + q_off);
        warp_mma_nt<HEAD_DIM_V_PAD / 16, Q_TILE / 16, V_STRIDE>(dpt, v_a, do_b + do_off);

        // Pᵀ (kept in st, f32) and dSᵀ (in dsp, rounded to T and packed). Only a warp whose 16 keys some row of the
        // tile does not see completely pays for the mask.
        const int wkey0 = key0 + wk;
        const bool interior = warp_keys_interior(sv, rows_here, row0, wkey0, diag, win_left, win_right);
        unsigned dsp[Q_TILE / 8][2];
        if (interior) {
            tile_p_ds<false>(st, dpt, dsp, bl_t, delta_t, cl, tig, diag, 0, 0, 0, 0, 0, 0);
        } else {
            tile_p_ds<true>(st, dpt, dsp, bl_t, delta_t, cl, tig, diag, row0 + tig * 2, key_t, rows_here - tig * 2,
                            sv.len_k, win_left, win_right);
        }

        // dV += round_T(P)ᵀ dO and dK += dSᵀ Q over the tile's query rows (k = queries).
        if (rows_here == Q_TILE) {
            add_dk_dv<true>(acc_k, acc_v, st, dsp, do_bt + do_off, q_bt + q_off, c0, rows_here);
        } else {
            add_dk_dv<false>(acc_k, acc_v, st, dsp, do_bt + do_off, q_bt + q_off, c0, rows_here);
        }

        // dQ of this KV tile: dS (queries × keys) through shared memory, times K (k = keys).
        if (dq_mode != 0 && c0 < d) {
            // dsp[n][h] is the fragment of the 8 × 8 block (keys wk + 8h …, queries 8n …); stmatrix.trans writes each
            // block transposed, four per instruction, so ds_s holds dS with queries as rows.
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
            // The warp's rows of the tile's dQ: added to the f32 accumulator (mode 1) or stored as this KV tile's
            // partial (mode 2); one branch on the mode around all of them, so each row's stores are predicated.
            float* dq_tile =
                dq_tile_rows(params.flash, dq_mode, dq_acc, dq_part, part_stride, sv, head, b, row0 SPARSE_ARGS);
            if (dq_mode == 1) {
#pragma unroll
                for (int rr = 0; rr < 2 * DQ_MT; ++rr) {
                    const int mt = rr / 2, r = rr % 2;
                    const int row = wq + 16 * mt + g + 8 * r;
                    float* dq_row = dq_tile + (long long)row * q_row + dq_c + tig * 2;
#pragma unroll
                    for (int n = 0; n < DQ_COLS / 8; ++n) {
                        const bool live = row < rows_here && dq_c + n * 8 + tig * 2 < d;
                        red_add_v2(live, dq_row + n * 8, part[mt][n][2 * r], part[mt][n][2 * r + 1]);
                    }
                }
            } else {
#pragma unroll
                for (int rr = 0; rr < 2 * DQ_MT; ++rr) {
                    const int mt = rr / 2, r = rr % 2;
                    const int row = wq + 16 * mt + g + 8 * r;
                    float* dq_row = dq_tile + (long long)row * q_row;
#pragma unroll
                    for (int n = 0; n < DQ_COLS / 8; ++n) {
                        const int col = dq_c + n * 8 + tig * 2;
                        if (row < rows_here && col < d) {
                            *reinterpret_cast<float2*>(dq_row + col) =
                                make_float2(part[mt][n][2 * r], part[mt][n][2 * r + 1]);
                        }
                    }
                }
            }
        }
        a = a_next;
    }
    // Drain: a KV tile that no query tile sees (a_lo > a_hi: a window, or keys past every row's diagonal) skips the
    // loop, and its K, V copies, committed above, were never waited for. A CTA must not exit with copies into its
    // shared memory in flight (the next CTA on the SM may already own those bytes); after the loop nothing else is
    // outstanding, so for every other CTA this returns at once.
    cp_async_wait_all();

    // dK = round_T(α̂ · dK), dV = round_T(dV) for the warp's keys and the chunk's columns (under GQA this head's f32
    // sums, for bwd_kv_group_sum).
    const long long n_heads_q = gridDim.y / n_chunks;
#pragma unroll
    for (int n = 0; n < CHUNK / 8; ++n) {
        const int col = c0 + n * 8 + tig * 2;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = wk + g + 8 * r;
            if (key >= keys_here) continue;
            store_kv_grad<false>(params.flash, dk_out, dkv_part, sv, head, n_heads_q, total_k, key0 + key, col,
                                 acc_k[n][2 * r], acc_k[n][2 * r + 1]);
            store_kv_grad<true>(params.flash, dv_out, dkv_part, sv, head, n_heads_q, total_k, key0 + key, col,
                                acc_v[n][2 * r], acc_v[n][2 * r + 1]);
        }
    }
}
#endif  // !BWD_KV_SM90

// GQA: dK = round_T(α̂ · Σ_h dK_h) and dV = round_T(Σ_h dV_h) over the KV head's query heads, in ascending head order,
// from bwd_kv's f32 workspace. One CTA per (64 keys, KV head, sequence).
extern "C" __global__ void __launch_bounds__(THREADS)
bwd_kv_group_sum(const float* __restrict__ dkv_part, elem_t* __restrict__ dk_out, elem_t* __restrict__ dv_out,
                 COMMON_PARAMS) {
    UNPACK_FLASH_PARAMS(params.flash);
    const int n_heads_q = params.n_heads_q;
    const long long total_k = params.total_k;
    const SeqView sv = SEQ_VIEW(blockIdx.z);
    const int kv_head = blockIdx.y;
    const int key0 = blockIdx.x * 64;
    if (key0 >= sv.len_k) return;
    const int keys_here = min(64, sv.len_k - key0);
    const int width = max(d, dv);
    const float* part_v = dkv_part + (long long)n_heads_q * total_k * d;
    for (int idx = threadIdx.x; idx < keys_here * width; idx += THREADS) {
        const int key = idx / width, col = idx % width;
        const long long row = sv.k_row0 + key0 + key;
        float tot_k = 0.f, tot_v = 0.f;
        for (int hh = 0; hh < group; ++hh) {
            const long long head_row = (long long)(kv_head * group + hh) * total_k + row;
            if (col < d) {
                const float x = dkv_part[head_row * d + col];
                tot_k = hh == 0 ? x : __fadd_rn(tot_k, x);
            }
            if (col < dv) {
                const float x = part_v[head_row * dv + col];
                tot_v = hh == 0 ? x : __fadd_rn(tot_v, x);
            }
        }
        if (col < d) dk_out[sv.k_base + kv_head * k_head + (long long)(key0 + key) * k_row + col] =
            to_elem(__fmul_rn(scale, tot_k));
        if (col < dv) dv_out[sv.v_base + kv_head * v_head + (long long)(key0 + key) * v_row + col] = to_elem(tot_v);
    }
}

// Strategy A: dQ += dS K for one warp's 16 query rows over a KV tile of DQ_KV_TILE keys (dS from `ds`, f32 values
// already rounded to T; K transposed from shared memory at `k_bt`). FULL: all DQ_KV_TILE keys are valid; otherwise
// k-steps wholly past `keys_here` are skipped.
template <bool FULL>
__device__ __forceinline__ void add_dq(float (&acc)[CHUNK / 8][4], const float (&ds)[DQ_KV_TILE / 8][4], unsigned k_bt,
                                       int c0, int keys_here) {
#pragma unroll
    for (int kk = 0; kk < DQ_KV_TILE / 16; ++kk) {
        if (!FULL && kk * 16 >= keys_here) break;
        unsigned af[4];
        pack_a(af, ds[2 * kk], ds[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < CHUNK / 16; ++np) {
            const int col = c0 + np * 16;
            if (col >= HEAD_DIM_PAD) break;
            unsigned bf[4];
            ldsm_x4_trans(bf, k_bt + (kk * 16 * QK_STRIDE + col) * ESZ);
            mma_16816(acc[2 * np], af, bf[0], bf[1]);
            mma_16816(acc[2 * np + 1], af, bf[2], bf[3]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
bwd_dq(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
       const elem_t* __restrict__ d_out, const float* __restrict__ lse, const float* __restrict__ delta,
       elem_t* __restrict__ dq, COMMON_PARAMS SPARSE_PARAMS) {
    UNPACK_FLASH_PARAMS(params.flash);
    const int n_chunks = params.n_chunks;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_s = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* k_s = q_s + Q_TILE * QK_STRIDE;
    elem_t* do_s = k_s + DQ_KV_TILE * QK_STRIDE;
    elem_t* v_s = do_s + Q_TILE * V_STRIDE;

    const int tile = blockIdx.x;
    const int head = ONE_CHUNK ? blockIdx.y : blockIdx.y / n_chunks;
    const int c0 = ONE_CHUNK ? 0 : (blockIdx.y % n_chunks) * CHUNK;
    const int kv_head = head / group;
    const SeqView sv = SEQ_VIEW(blockIdx.z);
    const int row0 = tile * Q_TILE;
    if (row0 >= sv.len_q) return;
    const int rows_here = min(Q_TILE, sv.len_q - row0);
    const Diagonal diag_of = row_diagonal(params.flash, sv.len_q, sv.len_k);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    const int wrow = warp * 16;

    load_tile_async<Q_TILE, HEAD_DIM_PAD, QK_STRIDE, THREADS>(
        q_s, q + sv.q_base + head * q_head + (long long)row0 * q_row, q_row, rows_here, d);
    load_tile_async<Q_TILE, HEAD_DIM_V_PAD, V_STRIDE, THREADS>(
        do_s, d_out + sv.o_base + head * o_head + (long long)row0 * o_row, o_row, rows_here, dv);
    cp_async_commit();
    float bl[2], dl[2];
    bool live[2];
    int diag[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = wrow + g + 8 * r;
        live[r] = false;
        bl[r] = 0.f;
        dl[r] = 0.f;
        diag[r] = diag_of.at(row0 + row);
        if (row < rows_here) {
            const float l = lse[sv.lse_base + head * lse_head + row0 + row];
            live[r] = l != NEG_INF;
            bl[r] = row_bl(l);  // +∞ for a row that sees no key: its p is +0 on the unmasked path too
            dl[r] = delta[sv.lse_base + head * lse_head + row0 + row];
        }
    }

    // Lane addresses: Q and dO are A operands, K and V the B operands of S and dP (rows are n), K (transposed) the
    // B operand of dQ.
    const unsigned q_a = smem_u32(q_s + wrow * QK_STRIDE + lane_a(lane, QK_STRIDE));
    const unsigned do_a = smem_u32(do_s + wrow * V_STRIDE + lane_a(lane, V_STRIDE));
    const unsigned k_b = smem_u32(k_s + lane_b(lane, QK_STRIDE));
    const unsigned v_b = smem_u32(v_s + lane_b(lane, V_STRIDE));
    const unsigned k_bt = smem_u32(k_s + lane_b_trans(lane, QK_STRIDE));
    const float cl = scale_log2(scale);

    // The KV tiles this query tile visits: exactly those whose kv_tile_rows range contains it.
    const int n_kt = (sv.len_k + DQ_KV_TILE - 1) / DQ_KV_TILE;
    float acc[CHUNK / 8][4];
#pragma unroll
    for (int n = 0; n < CHUNK / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

#if defined(BLOCK_SPARSE)
    TileCursor cursor =
        list_cursor(0, n_kt, QUERY_BLOCK_LIST(blockIdx.z, head, row0), lists.width, lists.tiles_per_block);
#else
    TileCursor cursor = range_cursor(0, n_kt);
#endif
    for (int t = cursor.next(); t >= 0; t = cursor.next()) {
        int a_lo, a_hi;
        if (!kv_tile_rows(t, DQ_KV_TILE, sv.len_q, sv.len_k, diag_of, win_left, win_right, &a_lo, &a_hi) ||
            tile < a_lo || tile > a_hi)
            continue;
        const int key0 = t * DQ_KV_TILE;
        const int keys_here = min(DQ_KV_TILE, sv.len_k - key0);
        __syncthreads();  // every warp is done with the previous K and V
        load_tile_async<DQ_KV_TILE, HEAD_DIM_PAD, QK_STRIDE, THREADS>(
            k_s, k + sv.k_base + kv_head * k_head + (long long)key0 * k_row, k_row, keys_here, d);
        load_tile_async<DQ_KV_TILE, HEAD_DIM_V_PAD, V_STRIDE, THREADS>(
            v_s, v + sv.v_base + kv_head * v_head + (long long)key0 * v_row, v_row, keys_here, dv);
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();

        float s[DQ_KV_TILE / 8][4], dp[DQ_KV_TILE / 8][4];
#pragma unroll
        for (int n = 0; n < DQ_KV_TILE / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
        }
        warp_mma_nt<HEAD_DIM_PAD / 16, DQ_KV_TILE / 16, QK_STRIDE>(s, q_a, k_b);
        warp_mma_nt<HEAD_DIM_V_PAD / 16, DQ_KV_TILE / 16, V_STRIDE>(dp, do_a, v_b);
        // dS = round_T(p·(dP − D)) in place of s. Only a KV tile that some row of the query tile does not see
        // completely (a tail, the diagonal, a window edge, a partial query tile) pays for the mask.
        const bool interior = rows_here == Q_TILE && keys_here == DQ_KV_TILE &&
                              key0 + DQ_KV_TILE - 1 <= diag_of.at(row0) + win_right &&
                              key0 >= diag_of.at(row0 + Q_TILE - 1) - win_left;
        if (interior) {
#pragma unroll
            for (int n = 0; n < DQ_KV_TILE / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e / 2;
                    const float p = prob(s[n][e], cl, bl[r]);
                    s[n][e] = to_f32(to_elem(__fmul_rn(p, __fsub_rn(dp[n][e], dl[r]))));
                }
            }
            add_dq<true>(acc, s, k_bt, c0, keys_here);
        } else {
#pragma unroll
            for (int n = 0; n < DQ_KV_TILE / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e / 2;
                    const int j = key0 + n * 8 + tig * 2 + (e % 2);
                    const bool vis = live[r] && j < sv.len_k && j <= diag[r] + win_right && j >= diag[r] - win_left;
                    const float p = vis ? prob(s[n][e], cl, bl[r]) : 0.f;
                    s[n][e] = to_f32(to_elem(__fmul_rn(p, __fsub_rn(dp[n][e], dl[r]))));
                }
            }
            if (keys_here == DQ_KV_TILE) {
                add_dq<true>(acc, s, k_bt, c0, keys_here);
            } else {
                add_dq<false>(acc, s, k_bt, c0, keys_here);
            }
        }
    }
    // Drain: a query tile that sees no key (a window, a sequence without keys) visits no KV tile, and its Q, dO
    // copies, committed above, were never waited for; a CTA must not exit with copies into its shared memory in
    // flight. Every visited tile waits for all copies, so for every other CTA nothing is outstanding here.
    cp_async_wait_all();

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
extern "C" __global__ void __launch_bounds__(THREADS)
bwd_dq_finalize(const float* __restrict__ dq_acc, const float* __restrict__ dq_part, elem_t* __restrict__ dq,
                COMMON_PARAMS SPARSE_PARAMS) {
    UNPACK_FLASH_PARAMS(params.flash);
    const int mode = params.finalize_mode;
    const long long part_stride = params.part_stride;
    const SeqView sv = SEQ_VIEW(blockIdx.z);
    const int head = blockIdx.y;
    const int tile = blockIdx.x;
    const int row0 = tile * Q_TILE;
    if (row0 >= sv.len_q) return;
    const int rows_here = min(Q_TILE, sv.len_q - row0);
    const int n_kt = (sv.len_k + KV_TILE - 1) / KV_TILE;
    for (int idx = threadIdx.x; idx < rows_here * d; idx += THREADS) {
        const int r = idx / d, c = idx % d;
        const long long at = sv.q_base + head * q_head + (long long)(row0 + r) * q_row + c;
        float x = 0.f;
        if (mode == 0) {
            x = dq_acc[at];
        } else {
#if defined(BLOCK_SPARSE)
            // The KV tiles of the query block's listed key blocks: the only partials bwd_kv wrote for this tile, each
            // at its position in the list (partial_slot).
            TileCursor cursor = list_cursor(0, n_kt, QUERY_BLOCK_LIST(blockIdx.z, head, row0), lists.width,
                                            lists.tiles_per_block * 64 / KV_TILE);
#else
            TileCursor cursor = range_cursor(0, n_kt);
#endif
            for (int t = cursor.next(); t >= 0; t = cursor.next()) {
                int a_lo, a_hi;
                if (kv_tile_rows(t, KV_TILE, sv.len_q, sv.len_k, row_diagonal(params.flash, sv.len_q, sv.len_k),
                                 win_left, win_right, &a_lo, &a_hi) &&
                    tile >= a_lo && tile <= a_hi) {
#if defined(BLOCK_SPARSE)
                    const int slot = cursor.last_position();
#else
                    const int slot = t;
#endif
                    x = __fadd_rn(x, dq_part[(long long)slot * part_stride + at]);
                }
            }
        }
        dq[at] = to_elem(__fmul_rn(scale, x));
    }
}

#if defined(BLOCK_SPARSE)
// ---------------------------------------------------------------------------------------------------------------------
// The CSR transpose of the block lists (E20's layout, seed 001's CSR backward): one row per (sequence, list head, key
// block), holding the query blocks whose list names the key block, ascending. bwd_csr_count writes each row's count
// into csr_offsets[row], bwd_csr_scan turns the counts into offsets in place (csr_offsets[rows] = the total), and
// bwd_csr_fill writes the indices. Every step is deterministic: a row's indices come out in ascending order from a
// warp ballot, with no atomics.

// One warp per CSR row: grid (⌈kv_blocks / NUM_WARPS⌉, list heads, sequences). The lanes test 32 query blocks at a
// time; FILL writes the listing query blocks from the row's offset in ascending order, otherwise the count.
template <bool FILL>
__device__ __forceinline__ void csr_row(const int* __restrict__ block_lists, const int* __restrict__ csr_offsets,
                                        int* __restrict__ counts, int* __restrict__ csr_q_blocks,
                                        const BlockListParams& lists) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int key_block = blockIdx.x * NUM_WARPS + warp;
    if (key_block >= lists.kv_blocks) return;
    const long long row = ((long long)blockIdx.z * lists.list_heads + blockIdx.y) * lists.kv_blocks + key_block;
    const int* head_lists = block_lists + blockIdx.z * lists.seq_stride + (long long)blockIdx.y * lists.head_stride;
    int written = FILL ? csr_offsets[row] : 0;
    for (int base = 0; base < lists.q_blocks; base += 32) {
        const int qb = base + lane;
        const bool listed = qb < lists.q_blocks && list_holds(head_lists + (long long)qb * lists.width, lists.width,
                                                             key_block);
        const unsigned ballot = __ballot_sync(0xffffffffu, listed);
        if (FILL && listed) csr_q_blocks[written + __popc(ballot & ((1u << lane) - 1u))] = qb;
        written += __popc(ballot);
    }
    if (!FILL && lane == 0) counts[row] = written;
}

extern "C" __global__ void __launch_bounds__(THREADS)
bwd_csr_count(const int* __restrict__ block_lists, int* __restrict__ csr_offsets, const BlockListParams lists) {
    csr_row<false>(block_lists, nullptr, csr_offsets, nullptr, lists);
}

extern "C" __global__ void __launch_bounds__(THREADS)
bwd_csr_fill(const int* __restrict__ block_lists, const int* __restrict__ csr_offsets, int* __restrict__ csr_q_blocks,
             const BlockListParams lists) {
    csr_row<true>(block_lists, csr_offsets, nullptr, csr_q_blocks, lists);
}

#endif

// The CSR transposes (BLOCK_SPARSE above, and nsa_selected_bwd.cu's of NSA's token lists, compiled after this text)
// share the scan.
// Exclusive prefix sum of the `rows` counts in csr_offsets, in place, by one CTA of SCAN_THREADS threads (a warp scan,
// then a scan of the warp totals, chunk after chunk with a running carry); csr_offsets[rows] gets the total.
#define SCAN_THREADS 1024
extern "C" __global__ void __launch_bounds__(SCAN_THREADS) bwd_csr_scan(int* __restrict__ csr_offsets, int rows) {
    __shared__ int warp_totals[SCAN_THREADS / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int carry = 0;
    for (int base = 0; base < rows; base += SCAN_THREADS) {
        const int i = base + threadIdx.x;
        const int x = i < rows ? csr_offsets[i] : 0;
        const int incl = warp_inclusive_sum(x);
        if (lane == 31) warp_totals[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            const int w = warp_inclusive_sum(warp_totals[lane]);
            warp_totals[lane] = w;  // inclusive over the warps
        }
        __syncthreads();
        if (i < rows) csr_offsets[i] = carry + (warp > 0 ? warp_totals[warp - 1] : 0) + incl - x;
        carry += warp_totals[SCAN_THREADS / 32 - 1];
        __syncthreads();  // every thread read the totals before the next chunk overwrites them
    }
    if (threadIdx.x == 0) csr_offsets[rows] = carry;
}
