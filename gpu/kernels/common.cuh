// Helpers shared by the attention kernels (prepended to every kernel text by its KernelSource, see gpu/src/compile.rs):
// the storage type, the kernels' parameter structs, tensor-core MMA, ldmatrix, cp.async, the exp2 instruction and the
// forward's online-softmax step, written once.
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
// One rounding from f64 to the storage type (through f32 would round twice).
__device__ __forceinline__ elem_t to_elem_rn(double x) { return __double2bfloat16(x); }
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
__device__ __forceinline__ elem_t to_elem_rn(double x) { return __double2half(x); }
__device__ __forceinline__ float to_f32(elem_t x) { return __half2float(x); }
#else
#error "define ELEM_BF16 or ELEM_F16"
#endif

// "No bound" for a window side: positions are below 2^30 (the host checks Lq + Lk ≤ 2^30 per sequence).
#define NO_BOUND (1 << 30)
// NVRTC has no <math.h>: −∞ from its bit pattern.
#define NEG_INF __int_as_float((int)0xff800000u)

// ---------------------------------------------------------------------------------------------------------------------
// Kernel parameter structs: one per kernel family, passed by value as one kernel argument (`const FlashParams params`,
// ...) and mirrored field for field by the #[repr(C)] structs of gpu/src/params.rs (the model is FlashAttention's
// Flash_fwd_params). PARAM_SIZE and PARAM_AT pin every layout here, so that NVRTC rejects a kernel text whose struct
// drifted; a unit test of gpu/src/params.rs reads these same lines and compares them with the Rust struct's
// std::mem::size_of and offset_of!, so the two sides cannot disagree silently. One field per line, with no implicit
// padding (`reserved` fills the tail to the 8-byte alignment), so that no byte the host copies is uninitialised.

// The attention problem's scalars, read by flash_fwd and by every kernel of flash_bwd.cu (inside BackwardParams).
struct FlashParams {
    long long q_batch;      // (batch, head, row) strides of Q in elements (varlen: batch stride 0, rows packed)
    long long q_head;
    long long q_row;
    long long k_batch;      // likewise for K
    long long k_head;
    long long k_row;
    long long v_batch;      // likewise for V
    long long v_head;
    long long v_row;
    long long o_batch;      // likewise for O (and dO, dQ's layout is Q's)
    long long o_head;
    long long o_row;
    long long lse_batch;    // (batch, head) strides of LSE (and D); varlen: lse_head is the packed total Tq
    long long lse_head;
    int varlen;             // 1: packed [T, H, D] with cu_seqlens; 0: dense [B, H, L, D]
    int dense_len_q;        // Lq and Lk of every sequence of a dense problem (0 when varlen)
    int dense_len_k;
    int group;              // query heads per KV head (n_heads_q / n_heads_kv)
    int d;                  // head dim of Q and K
    int dv;                 // head dim of V and O
    float scale;            // α̂: fl32(1/√d) or the spec's scale rounded to f32
    int win_left;           // window reaches left and right of the row's diagonal; NO_BOUND is unbounded
    int win_right;
    int diag_stride;        // 0: the diagonal is bottom-right aligned, i + Lk − Lq; s ≥ 1: ⌊(i + diag_offset)/s⌋
    int diag_offset;        // with diag_stride ≥ 1: 1 − l, NSA's compression window length l (E18); else 0
    int reserved;           // explicit tail padding, always 0
};

// The backward family's parameters: the problem's scalars and the trailing scalars of flash_bwd.cu's kernels (each
// kernel reads the ones it needs; the header of flash_bwd.cu says which).
struct BackwardParams {
    FlashParams flash;      // the problem
    long long part_stride;  // elements between two KV tiles' dQ partials (Q's element count)
    long long total_k;      // K rows over all sequences: the row count of the GQA and KV_ACCUM workspaces
    int dq_mode;            // bwd_kv: 0 no dQ (strategy A), 1 atomic accumulator, 2 per-KV-tile partials
    int n_chunks;           // column chunks per query head (bwd_kv: of max(d, dv); bwd_dq: of d)
    int n_heads_q;          // query heads (bwd_kv_group_sum)
    int finalize_mode;      // bwd_dq_finalize: 0 from the atomic accumulator, 1 from the partials
};

// The scalars of ring_state.cu's state_merge and state_finalize.
struct RingStateParams {
    long long rows;           // state rows (LSE rows)
    long long rows_per_head;  // varlen: rows of one query head (Tq), to map an LSE row to O's packed row
    int dv;                   // columns of A and O
    int varlen;               // O is packed [Tq, Hq, dv] (1) or dense [B, Hq, Lq, dv] (0)
    int n_heads;              // query heads (varlen)
    int reserved;             // explicit tail padding, always 0
};

// The block lists of block-sparse attention (E14), read by flash_fwd and flash_bwd.cu compiled with BLOCK_SPARSE
// beside their own parameters. Lists are [B, list heads, query blocks, width] i32, ascending, -1-padded, validated by
// the host. The backward's transpose (key block -> the query blocks that list it) has one CSR row per (sequence, list
// head, key block), in that order.
struct BlockListParams {
    long long seq_stride;     // elements between two sequences' lists
    long long head_stride;    // elements between two list heads' lists
    int width;                // entries per list (and elements between two query blocks' lists)
    int q_block;              // query rows per query block: a multiple of the CTA's rows
    int tiles_per_block;      // 64-key KV tiles per key block (1 or 2)
    int heads_per_list;       // query heads that share one list head: 1 (lists per query head) or the GQA group
    int list_heads;           // list heads per sequence
    int q_blocks;             // query blocks per list head (of the longest sequence)
    int kv_blocks;            // key blocks of the longest sequence: CSR rows per (sequence, list head)
    int reserved;             // explicit tail padding, always 0
};

// The scalars of bsa_select.cu's block selection (BSA): the problem (Q and K layout, lengths, group, d) and the
// selector's parameters.
struct BsaParams {
    FlashParams flash;      // the problem; the value and output fields are unused
    double scale;           // α in f64: fl64(1/√d) or the spec's scale
    int q_block;            // query rows per query block
    int kv_block;           // keys per key block
    int top_k;              // entries per list, forced blocks included
    int force_first;        // 1: key block 0 is always kept (when eligible)
    int force_local;        // how many of the last eligible blocks are always kept
    int causal;             // 1: bottom-right causal eligibility; 0: every key block of the sequence
    int n_heads_kv;         // KV heads (lists and pooled keys are per KV head)
    int n_key_blocks;       // key blocks of the longest sequence (the pooled keys' and the scores' extent)
    long long pooled_queries_at;  // element of the f64 workspace where the pooled queries start (after the keys)
    int n_query_blocks;     // query blocks of the longest sequence: the lists' and the pooled queries' extent
    int first_query_block;  // the first query block of this launch (the selector pools and selects in chunks of query
                            // blocks, bsa_select.cu's header says how); 0 for a launch over all of them
};

// The scalars of pisa_select.cu's pyramid selection (PISA, E25–E28): the block selector's (leaves are its key blocks,
// the list width its top_k; force_first and force_local are unused) and the pyramid's.
struct PisaParams {
    BsaParams bsa;          // the problem, the scale, q_block, the leaf size (kv_block), the list width (top_k)
    long long levels_at;    // element of the f64 workspace where level 1's means start (after the pooled queries)
    int batch;              // sequences
    int branching;          // β: children per node, 2 to 16
    int keep;               // K: nodes kept per level, forced ones included, 1 to 64
    int scoring;            // 0 LSE over the pooled items, 1 PISA-1 (the node's mean), 2 PISA-2 (mean + var / 2)
    int n_levels;           // levels of the longest sequence's pyramid, leaves to root
    int max_candidates;     // max(K, 3) · β: a level's candidates at most, the trace's entries per level
};

// The scalars of pisa_tail.cu (PISA's first-order tail, E22): the problem (Q, K, V, O and LSE layouts, lengths, group,
// head dims), the lists' geometry and where the workspace's statistics start.
struct PisaTailParams {
    FlashParams flash;      // the problem
    double scale;           // α in f64
    long long value_means_at;  // element of the f64 workspace where the blocks' mean values [B, Hkv, n_k, dv] start
    long long hbar_at;      // element where H̄ [B, Hkv, d, dv] starts (the mean keys [B, Hkv, n_k, d] start at 0)
    long long hbar_partials_at;  // element where H̄'s partial sums [splits, B, Hkv, d, dv] start
    long long pooled_values_at;  // element of the storage-type workspace where the rounded mean values
                                 // [B, Hkv, n_k, dv] start (the split mean keys [B, Hkv, n_k, 2d] start at 0)
    long long pooled_hbar_at;    // element where the split H̄ [B, Hkv, 2d, dv] starts
    int q_block;            // query rows per query block of the lists
    int kv_block;           // keys per key block: the tail's block size
    int causal;             // 1: bottom-right causal; 0: no mask
    int n_heads_kv;         // KV heads
    int n_key_blocks;       // key blocks of the longest sequence
    int n_query_blocks;     // query blocks of the longest sequence (the lists' extent)
    int list_width;         // entries per list
    int lists_per_kv_head;  // 1: one list per KV head, shared by its group; 0: one per query head
    int hbar_splits;        // key ranges of HBAR_SPLIT_KEYS keys (H̄'s partial sums) of the longest sequence
    int reserved;           // pads the struct to its 8-byte alignment
};

// The scalars of hils.cu's chunk summaries and router (HiLS, E21): causal self-attention (flash's len_q = len_k per
// sequence), landmarks [B, Hq, n_chunks, d], summaries (slope key and entropy, f64) [B, Hq, n_chunks, d + 1], lists
// [B, Hq, max_len, top_k], router scores (optional) [B, Hq, max_len, n_chunks].
struct HilsParams {
    FlashParams flash;      // the problem (Q and K layouts, lengths, group, d)
    double scale;           // 1/√d in f64: E21's scale, whatever the spec's
    int chunk_size;         // C: keys per chunk, 1 to HILS_MAX_CHUNK
    int local_window;       // w: exact keys before and including a query, extended down to a chunk boundary
    int top_k;              // K: chunks routed per query, 1 to 32
    int n_chunks;           // chunks of the longest sequence
    int max_len;            // the longest sequence
    int write_scores;       // 1: write every eligible router score to the scores buffer
    int exact_mass;         // hils_output: 1 weighs a retrieved chunk by its exact log-mass f_b(q_i), 0 by r_ib
    int reserved;           // explicit tail padding, always 0
};

// The scalars of the NSA kernels (nsa_compress.cu, nsa_gates.cu): the problem (K and V layout, lengths, head dims) and NSA's
// compression parameters. Compressed keys and values are laid out like K and V with one row per complete window:
// dense [B, Hkv, W, cols], varlen packed [total W, Hkv, cols] from the windows' cu_seqlens.
struct NsaParams {
    FlashParams flash;      // the problem (the gates read dv); the query and window fields are unused
    long long rows;         // rows of O: B * Hq * Lq dense, Tq * Hq varlen (the gates' rows)
    int compress_len;       // l: tokens per compression window
    int compress_stride;    // s: tokens between two windows' first tokens
    int n_heads_kv;         // KV heads
    int dense_windows;      // W: complete windows of every sequence of a dense problem (0 when varlen)
    int weighted_keys;      // phi_K: 0 the mean, 1 position weights, 2 the learned matrix (first in the weights)
    int weighted_values;    // phi_V: as weighted_keys; its weights follow phi_K's
};

// The scalars of NSA's selection branch (E19, E31): nsa_select.cu's block scoring and top-n read the compressed
// attention's problem (Q as the layer's, K the compressed keys with one row per complete window, its LSE and scale),
// nsa_selected.cu's attention the layer's (Q, K, V, O, LSE, the configuration's scale); both the selection's
// parameters. Scores [token rows, Hkv, n_blocks] f32 and lists [token rows, Hkv, n_selected] i32 have one token row
// per token of every sequence (B·L dense, the packed total varlen).
struct NsaSelectParams {
    FlashParams flash;      // the compressed attention's problem; the value and output fields are unused
    long long token_rows;   // token rows of the scores and lists
    int compress_len;       // l: tokens per compression window
    int compress_stride;    // s: tokens between two windows' first tokens
    int select_block;       // l': tokens per selection block
    int n_blocks;           // selection blocks of the longest sequence: the scores' columns
    int n_selected;         // n: entries per list, forced blocks included (nsa_top_n: at most TOPN_MAX)
    int n_forced_initial;   // the first blocks every token keeps
    int n_forced_local;     // the most recent blocks every token keeps (its current block and those before it)
    int n_heads_kv;         // KV heads (scores and lists are per KV head)
    int tokens_per_cta;     // nsa_block_scores, nsa_selected_fwd: ⌊64 / G⌋ tokens of G rows each
    int tile_blocks;        // nsa_block_scores: the most selection blocks one tile of 64 windows touches
};

// The scalars of dsa_index.cu's lightning indexer with its exact top-k (DSA, E16): one sequence of T tokens.
struct DsaIndexParams {
    long long scratch_stride;  // f32 elements between two score rows of the scratch (a multiple of 4, at least T)
    int seq_len;               // T: tokens (queries and keys)
    int n_heads;               // H_I: indexer heads per token, at most 64
    int top_k;                 // entries per selection row
    int full_scores;           // 1: scratch row t holds query t's scores ([T, stride]); 0: rows per resident CTA
    int n_groups;              // query groups of IDX_QUERIES consecutive tokens: ceil(T / IDX_QUERIES)
    int reserved;              // explicit tail padding, always 0
};

// The scalars of dsa_loss.cu's indexer loss (DSA, E16, the sparse training stage): one sequence of T tokens, the
// indexer's heads, and the main attention's heads whose probabilities form the teacher.
struct DsaLossParams {
    int seq_len;      // T: tokens
    int top_k;        // entries per list
    int index_heads;  // H_I: indexer heads per token, at most 64
    int n_heads;      // H: the main attention's query heads
    int n_heads_kv;   // its KV heads (H a multiple of them)
    int head_dim;     // d: its query and key head dim, a multiple of 8 up to HEAD_DIM_PAD
    float scale;      // α: its softmax scale, what its forward multiplied q · k by
    int reserved;     // explicit tail padding, always 0
};

// The scalars of dsa_sparse.cu's token-sparse attention (DSA's main attention over the indexer's selection): the
// layer's problem (causal self-attention, GQA, dense or varlen) and the lists' layout. Lists [token rows, list heads,
// top_k] i32 have one token row per token of every sequence (B·L dense, the packed total varlen).
struct DsaSparseParams {
    FlashParams flash;      // the layer: Q, K, V, O and LSE, lengths, group, head dims, scale
    long long token_rows;   // token rows of the lists
    int top_k;              // entries per list
    int list_heads;         // 1: one list per token for every KV head (DSA's indexer); else one per KV head (n_heads_kv)
    int head_chunks;        // CTAs per (token, KV head): ceil(group / SPARSE_ROWS), which is ceil(group / 64) above 64
    int column_chunks;      // the backward's CTAs per (token, head chunk), one per CHUNK columns; 1 in the forward
};

// NVRTC offers neither <cstddef>'s offsetof nor __builtin_offsetof; __INTADDR__, its front end's integral-address
// builtin, is a constant expression, which is all a static_assert needs.
#define PARAM_OFFSET(type, field) __INTADDR__(&((type*)0)->field)
#define PARAM_SIZE(type, bytes) \
    static_assert(sizeof(type) == (bytes), #type " is not " #bytes " bytes as gpu/src/params.rs says")
#define PARAM_AT(type, field, offset)                       \
    static_assert(PARAM_OFFSET(type, field) == (offset), \
                  #type "." #field " is not at byte " #offset " as gpu/src/params.rs says")

PARAM_SIZE(FlashParams, 160);
PARAM_AT(FlashParams, q_batch, 0);
PARAM_AT(FlashParams, q_head, 8);
PARAM_AT(FlashParams, q_row, 16);
PARAM_AT(FlashParams, k_batch, 24);
PARAM_AT(FlashParams, k_head, 32);
PARAM_AT(FlashParams, k_row, 40);
PARAM_AT(FlashParams, v_batch, 48);
PARAM_AT(FlashParams, v_head, 56);
PARAM_AT(FlashParams, v_row, 64);
PARAM_AT(FlashParams, o_batch, 72);
PARAM_AT(FlashParams, o_head, 80);
PARAM_AT(FlashParams, o_row, 88);
PARAM_AT(FlashParams, lse_batch, 96);
PARAM_AT(FlashParams, lse_head, 104);
PARAM_AT(FlashParams, varlen, 112);
PARAM_AT(FlashParams, dense_len_q, 116);
PARAM_AT(FlashParams, dense_len_k, 120);
PARAM_AT(FlashParams, group, 124);
PARAM_AT(FlashParams, d, 128);
PARAM_AT(FlashParams, dv, 132);
PARAM_AT(FlashParams, scale, 136);
PARAM_AT(FlashParams, win_left, 140);
PARAM_AT(FlashParams, win_right, 144);
PARAM_AT(FlashParams, diag_stride, 148);
PARAM_AT(FlashParams, diag_offset, 152);
PARAM_AT(FlashParams, reserved, 156);

PARAM_SIZE(BackwardParams, 192);
PARAM_AT(BackwardParams, flash, 0);
PARAM_AT(BackwardParams, part_stride, 160);
PARAM_AT(BackwardParams, total_k, 168);
PARAM_AT(BackwardParams, dq_mode, 176);
PARAM_AT(BackwardParams, n_chunks, 180);
PARAM_AT(BackwardParams, n_heads_q, 184);
PARAM_AT(BackwardParams, finalize_mode, 188);

PARAM_SIZE(BlockListParams, 48);
PARAM_AT(BlockListParams, seq_stride, 0);
PARAM_AT(BlockListParams, head_stride, 8);
PARAM_AT(BlockListParams, width, 16);
PARAM_AT(BlockListParams, q_block, 20);
PARAM_AT(BlockListParams, tiles_per_block, 24);
PARAM_AT(BlockListParams, heads_per_list, 28);
PARAM_AT(BlockListParams, list_heads, 32);
PARAM_AT(BlockListParams, q_blocks, 36);
PARAM_AT(BlockListParams, kv_blocks, 40);
PARAM_AT(BlockListParams, reserved, 44);

PARAM_SIZE(BsaParams, 216);
PARAM_AT(BsaParams, flash, 0);
PARAM_AT(BsaParams, scale, 160);
PARAM_AT(BsaParams, q_block, 168);
PARAM_AT(BsaParams, kv_block, 172);
PARAM_AT(BsaParams, top_k, 176);
PARAM_AT(BsaParams, force_first, 180);
PARAM_AT(BsaParams, force_local, 184);
PARAM_AT(BsaParams, causal, 188);
PARAM_AT(BsaParams, n_heads_kv, 192);
PARAM_AT(BsaParams, n_key_blocks, 196);
PARAM_AT(BsaParams, pooled_queries_at, 200);
PARAM_AT(BsaParams, n_query_blocks, 208);
PARAM_AT(BsaParams, first_query_block, 212);

PARAM_SIZE(PisaParams, 248);
PARAM_AT(PisaParams, bsa, 0);
PARAM_AT(PisaParams, levels_at, 216);
PARAM_AT(PisaParams, batch, 224);
PARAM_AT(PisaParams, branching, 228);
PARAM_AT(PisaParams, keep, 232);
PARAM_AT(PisaParams, scoring, 236);
PARAM_AT(PisaParams, n_levels, 240);
PARAM_AT(PisaParams, max_candidates, 244);

PARAM_SIZE(HilsParams, 200);
PARAM_AT(HilsParams, flash, 0);
PARAM_AT(HilsParams, scale, 160);
PARAM_AT(HilsParams, chunk_size, 168);
PARAM_AT(HilsParams, local_window, 172);
PARAM_AT(HilsParams, top_k, 176);
PARAM_AT(HilsParams, n_chunks, 180);
PARAM_AT(HilsParams, max_len, 184);
PARAM_AT(HilsParams, write_scores, 188);
PARAM_AT(HilsParams, exact_mass, 192);
PARAM_AT(HilsParams, reserved, 196);

PARAM_SIZE(PisaTailParams, 248);
PARAM_AT(PisaTailParams, flash, 0);
PARAM_AT(PisaTailParams, scale, 160);
PARAM_AT(PisaTailParams, value_means_at, 168);
PARAM_AT(PisaTailParams, hbar_at, 176);
PARAM_AT(PisaTailParams, hbar_partials_at, 184);
PARAM_AT(PisaTailParams, pooled_values_at, 192);
PARAM_AT(PisaTailParams, pooled_hbar_at, 200);
PARAM_AT(PisaTailParams, q_block, 208);
PARAM_AT(PisaTailParams, kv_block, 212);
PARAM_AT(PisaTailParams, causal, 216);
PARAM_AT(PisaTailParams, n_heads_kv, 220);
PARAM_AT(PisaTailParams, n_key_blocks, 224);
PARAM_AT(PisaTailParams, n_query_blocks, 228);
PARAM_AT(PisaTailParams, list_width, 232);
PARAM_AT(PisaTailParams, lists_per_kv_head, 236);
PARAM_AT(PisaTailParams, hbar_splits, 240);
PARAM_AT(PisaTailParams, reserved, 244);

PARAM_SIZE(NsaParams, 192);
PARAM_AT(NsaParams, flash, 0);
PARAM_AT(NsaParams, rows, 160);
PARAM_AT(NsaParams, compress_len, 168);
PARAM_AT(NsaParams, compress_stride, 172);
PARAM_AT(NsaParams, n_heads_kv, 176);
PARAM_AT(NsaParams, dense_windows, 180);
PARAM_AT(NsaParams, weighted_keys, 184);
PARAM_AT(NsaParams, weighted_values, 188);

PARAM_SIZE(NsaSelectParams, 208);
PARAM_AT(NsaSelectParams, flash, 0);
PARAM_AT(NsaSelectParams, token_rows, 160);
PARAM_AT(NsaSelectParams, compress_len, 168);
PARAM_AT(NsaSelectParams, compress_stride, 172);
PARAM_AT(NsaSelectParams, select_block, 176);
PARAM_AT(NsaSelectParams, n_blocks, 180);
PARAM_AT(NsaSelectParams, n_selected, 184);
PARAM_AT(NsaSelectParams, n_forced_initial, 188);
PARAM_AT(NsaSelectParams, n_forced_local, 192);
PARAM_AT(NsaSelectParams, n_heads_kv, 196);
PARAM_AT(NsaSelectParams, tokens_per_cta, 200);
PARAM_AT(NsaSelectParams, tile_blocks, 204);

PARAM_SIZE(DsaSparseParams, 184);
PARAM_AT(DsaSparseParams, flash, 0);
PARAM_AT(DsaSparseParams, token_rows, 160);
PARAM_AT(DsaSparseParams, top_k, 168);
PARAM_AT(DsaSparseParams, list_heads, 172);
PARAM_AT(DsaSparseParams, head_chunks, 176);
PARAM_AT(DsaSparseParams, column_chunks, 180);

PARAM_SIZE(DsaIndexParams, 32);
PARAM_AT(DsaIndexParams, scratch_stride, 0);
PARAM_AT(DsaIndexParams, seq_len, 8);
PARAM_AT(DsaIndexParams, n_heads, 12);
PARAM_AT(DsaIndexParams, top_k, 16);
PARAM_AT(DsaIndexParams, full_scores, 20);
PARAM_AT(DsaIndexParams, n_groups, 24);
PARAM_AT(DsaIndexParams, reserved, 28);

PARAM_SIZE(DsaLossParams, 32);
PARAM_AT(DsaLossParams, seq_len, 0);
PARAM_AT(DsaLossParams, top_k, 4);
PARAM_AT(DsaLossParams, index_heads, 8);
PARAM_AT(DsaLossParams, n_heads, 12);
PARAM_AT(DsaLossParams, n_heads_kv, 16);
PARAM_AT(DsaLossParams, head_dim, 20);
PARAM_AT(DsaLossParams, scale, 24);
PARAM_AT(DsaLossParams, reserved, 28);

PARAM_SIZE(RingStateParams, 32);
PARAM_AT(RingStateParams, rows, 0);
PARAM_AT(RingStateParams, rows_per_head, 8);
PARAM_AT(RingStateParams, dv, 16);
PARAM_AT(RingStateParams, varlen, 20);
PARAM_AT(RingStateParams, n_heads, 24);
PARAM_AT(RingStateParams, reserved, 28);

// The problem's scalars as `const` locals with the names the kernel bodies use (the names of the positional
// parameters they replaced), so that a kernel's body reads as before and every text anchor of the GPU mutation
// catalog still occurs exactly once. A kernel that does not read one of them is not warned about it.
#define UNPACK_FLASH_PARAMS(fp)                                \
    [[maybe_unused]] const int varlen = (fp).varlen;           \
    [[maybe_unused]] const int dense_len_q = (fp).dense_len_q; \
    [[maybe_unused]] const int dense_len_k = (fp).dense_len_k; \
    [[maybe_unused]] const int group = (fp).group;             \
    [[maybe_unused]] const int d = (fp).d;                     \
    [[maybe_unused]] const int dv = (fp).dv;                   \
    [[maybe_unused]] const long long q_batch = (fp).q_batch;   \
    [[maybe_unused]] const long long q_head = (fp).q_head;     \
    [[maybe_unused]] const long long q_row = (fp).q_row;       \
    [[maybe_unused]] const long long k_batch = (fp).k_batch;   \
    [[maybe_unused]] const long long k_head = (fp).k_head;     \
    [[maybe_unused]] const long long k_row = (fp).k_row;       \
    [[maybe_unused]] const long long v_batch = (fp).v_batch;   \
    [[maybe_unused]] const long long v_head = (fp).v_head;     \
    [[maybe_unused]] const long long v_row = (fp).v_row;       \
    [[maybe_unused]] const long long o_batch = (fp).o_batch;   \
    [[maybe_unused]] const long long o_head = (fp).o_head;     \
    [[maybe_unused]] const long long o_row = (fp).o_row;       \
    [[maybe_unused]] const long long lse_batch = (fp).lse_batch; \
    [[maybe_unused]] const long long lse_head = (fp).lse_head; \
    [[maybe_unused]] const float scale = (fp).scale;           \
    [[maybe_unused]] const int win_left = (fp).win_left;       \
    [[maybe_unused]] const int win_right = (fp).win_right

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

// The row's diagonal: the key position its window bounds (win_left, win_right) are measured from, shared by the forward
// and backward kernels. Bottom-right masks (E1a) have i + Lk − Lq; NSA's compressed branch (E18) has ⌊(i + 1 − l)/s⌋,
// the last compression window that has ended at token i, so that causal (right 0) means "windows that have ended".
// Monotone in i: a tile's first and last rows bound the diagonals of the rows between them. The strided diagonal is a
// compile-time mode (STRIDED_DIAGONAL, which the host defines exactly when FlashParams.diag_stride is not 0), so that
// the bottom-right kernels keep their registers: a division per row and a live stride cost the sm_80 forward a fifth
// of its speed at d = 128 when they were runtime choices.
struct Diagonal {
    int shift;   // added to the row (before the division): Lk − Lq, or 1 − l
#if defined(STRIDED_DIAGONAL)
    int stride;  // s

    __device__ __forceinline__ int at(int row) const {
        const int x = row + shift;
        // Floor division (x is negative for the tokens before the first window ends).
        return x >= 0 ? x / stride : -((stride - 1 - x) / stride);
    }
    // The first row whose diagonal is at least `key`: ⌊(i + shift)/stride⌋ ≥ key ⇔ i ≥ key·stride − shift.
    __device__ __forceinline__ long long first_row_reaching(long long key) const { return key * stride - shift; }
    // The last row whose diagonal is at most `key`: ⌊(i + shift)/stride⌋ ≤ key ⇔ i ≤ (key + 1)·stride − 1 − shift.
    __device__ __forceinline__ long long last_row_within(long long key) const {
        return (key + 1) * stride - 1 - shift;
    }
#else
    __device__ __forceinline__ int at(int row) const { return row + shift; }
    __device__ __forceinline__ long long first_row_reaching(long long key) const { return key - shift; }
    __device__ __forceinline__ long long last_row_within(long long key) const { return key - shift; }
#endif
};

// The diagonal of the problem `p` for a sequence of len_q queries and len_k keys.
__device__ __forceinline__ Diagonal row_diagonal(const FlashParams& p, int len_q, int len_k) {
#if defined(STRIDED_DIAGONAL)
    return Diagonal{p.diag_offset, p.diag_stride};
#else
    return Diagonal{len_k - len_q};
#endif
}

// fl32(log2 e): the same constant for every score and every row max (and for the ring's merges), so that the shift
// errors telescope.
#define LOG2E_F 1.44269504088896340736f

// The online-softmax step of one KV tile for a warp's rows (E2–E3, the forward kernels' recipe; flash_fwd.cu's
// header spells it out): scale (and, if MASKED, mask) the scores in `s`, update the running max, rescale ℓ, leave p
// in `s` and the rescale factor of A in `rescale`, which rescale_accumulators applies (the sm_90a kernel applies it
// only once the previous tile's P V product is done). The warp owns SLICES 16-row slices in the m16n8 accumulator
// layout (rows g and g + 8 of each slice, columns 2·tig and + 1 of each 8-key block); `row_t` is the sequence
// position of the thread's first row, row (mi, r) is row_t + 16·mi + 8·r, and `diag_of.at(row)` gives each row's
// diagonal (a Diagonal, or nsa_selected.cu's per-tile diagonals of its (token, head) rows).
template <bool MASKED, int SLICES, int KEY_TILES, class Diag>
__device__ __forceinline__ void softmax_scores(float (&s)[SLICES][KEY_TILES][4], float (&m_run)[SLICES][2],
                                               float (&ml_run)[SLICES][2], float (&l_part)[SLICES][2],
                                               float (&rescale)[SLICES][2], float scale, int key0, int len_k,
                                               const Diag& diag_of, int row_t, int win_left, int win_right,
                                               int tig) {
#pragma unroll
    for (int mi = 0; mi < SLICES; ++mi) {
        float m_new[2] = {m_run[mi][0], m_run[mi][1]};
#pragma unroll
        for (int n = 0; n < KEY_TILES; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e / 2;
                float x = __fmul_rn(s[mi][n][e], scale);
                if (MASKED) {
                    const int j = key0 + n * 8 + tig * 2 + (e % 2);
                    const int diag = diag_of.at(row_t + 16 * mi + 8 * r);
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
        float ml_new[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            ml_new[r] = m_new[r] == NEG_INF ? 0.f : __fmul_rn(m_new[r], LOG2E_F);
            if (m_run[mi][r] == NEG_INF) {
                rescale[mi][r] = 0.f;
            } else {
                rescale[mi][r] =
                    ml_run[mi][r] == ml_new[r] ? 1.f : ex2_approx_ftz(__fsub_rn(ml_run[mi][r], ml_new[r]));
            }
            m_run[mi][r] = m_new[r];
            ml_run[mi][r] = ml_new[r];
            l_part[mi][r] = __fmul_rn(l_part[mi][r], rescale[mi][r]);
        }
#pragma unroll
        for (int n = 0; n < KEY_TILES; ++n) {
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
    }
}

// A ← r·A with the factors softmax_scores left in `rescale`. Multiplying by 1 is exact: a warp whose rows all kept
// their max (most tiles, once a row's max has settled) skips it, and every tiling still computes the same bits.
template <int SLICES, int COL_TILES>
__device__ __forceinline__ void rescale_accumulators(float (&acc)[SLICES][COL_TILES][4],
                                                     const float (&rescale)[SLICES][2]) {
#pragma unroll
    for (int mi = 0; mi < SLICES; ++mi) {
        if (!__all_sync(0xffffffffu, rescale[mi][0] == 1.f && rescale[mi][1] == 1.f)) {
#pragma unroll
            for (int n = 0; n < COL_TILES; ++n) {
                acc[mi][n][0] = __fmul_rn(acc[mi][n][0], rescale[mi][0]);
                acc[mi][n][1] = __fmul_rn(acc[mi][n][1], rescale[mi][0]);
                acc[mi][n][2] = __fmul_rn(acc[mi][n][2], rescale[mi][1]);
                acc[mi][n][3] = __fmul_rn(acc[mi][n][3], rescale[mi][1]);
            }
        }
    }
}

// The inclusive prefix sum of x over the warp's lanes in lane order; every lane of the warp must call it.
__device__ __forceinline__ int warp_inclusive_sum(int x) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    return x;
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
// dimension) at `b_lane` (lane_b) with row stride B_STRIDE, both reduced over K_STEPS k-steps of 16 columns. A stored
// with A_STEPS < K_STEPS steps of columns is read cyclically (k step kk takes A's step kk mod A_STEPS): A repeated
// along k without being stored twice, as PISA's tail multiplies [q | q] by [μ_hi | μ_lo].
template <int K_STEPS, int N_PAIRS, int B_STRIDE, int A_STEPS = K_STEPS>
__device__ __forceinline__ void warp_mma_nt(float (&acc)[2 * N_PAIRS][4], unsigned a_lane, unsigned b_lane) {
#pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk) {
        unsigned af[4];
        ldsm_x4(af, a_lane + (kk % A_STEPS) * 16 * ESZ);
#pragma unroll
        for (int np = 0; np < N_PAIRS; ++np) {
            unsigned bf[4];
            ldsm_x4(bf, b_lane + (np * 16 * B_STRIDE + kk * 16) * ESZ);
            mma_16816(acc[2 * np], af, bf[0], bf[1]);
            mma_16816(acc[2 * np + 1], af, bf[2], bf[3]);
        }
    }
}

// acc += round_T(P) · V for one warp's 16 rows: P in the m16n8 accumulator layout of KEY_TILES tiles of 8 keys (the
// layout of tiles 2kk and 2kk + 1 is the A operand of k-step kk), V at the lane address `v_lane` (lane_b_trans) of a
// [keys][V_STRIDE] tile, COL_TILES output tiles of 8 columns.
template <int KEY_TILES, int COL_TILES, int V_STRIDE>
__device__ __forceinline__ void warp_mma_pv(float (&acc)[COL_TILES][4], const float (&p)[KEY_TILES][4],
                                            unsigned v_lane) {
#pragma unroll
    for (int kk = 0; kk < KEY_TILES / 2; ++kk) {
        unsigned a[4];
        pack_a(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < COL_TILES / 2; ++np) {
            unsigned b[4];
            ldsm_x4_trans(b, v_lane + (kk * 16 * V_STRIDE + np * 16) * ESZ);
            mma_16816(acc[2 * np], a, b[0], b[1]);
            mma_16816(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// 16 bytes global → shared, asynchronously; `valid == false` writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Waits until at most PENDING of this thread's committed groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

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

// The tokens of consecutive rows of NSA's grouped kernels: token index i of a CTA is t0 + i.
struct ConsecutiveTokens {
    int t0;
    __device__ __forceinline__ int operator()(int i) const { return t0 + i; }
};

// The tokens of a gathered tile (nsa_selected_bwd.cu's KV owner): token index i is entry i of a CSR row's segment, in
// device memory.
struct ListedTokens {
    const int* __restrict__ tokens;
    __device__ __forceinline__ int operator()(int i) const { return tokens[i]; }
};

// Starts copying the (token, head) rows of NSA's grouped kernels into a [ROWS][STRIDE] smem tile: row r is token
// token_of(r / group) of query head first_head + r % group (token-major, so that one token's heads are consecutive
// rows), `rows` of them valid with `cols` valid columns (a multiple of 8); the rest is zero-filled, as in
// load_tile_async. `g` is the sequence's first element (its batch or packed offset).
template <int ROWS, int COLS_PAD, int STRIDE, int N_THREADS, typename TokenOf>
__device__ __forceinline__ void load_group_rows_async(elem_t* smem, const elem_t* __restrict__ g, long long head_stride,
                                                      long long row_stride, int first_head, TokenOf token_of,
                                                      int group, int rows, int cols) {
    constexpr int CHUNKS = COLS_PAD / 8;
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += N_THREADS) {
        const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
        const bool valid = r < rows && c < cols;
        const long long at = valid ? (long long)(first_head + r % group) * head_stride +
                                         (long long)token_of(r / group) * row_stride + c
                                   : 0;
        cp_async_16(smem + r * STRIDE + c, g + at, valid);
    }
}

// Whether entry `block` continues a device list whose previous entry was `previous` (−1 before the first) in a
// sequence of `seq_blocks` selection blocks: NSA's kernels end a list at its first entry that does not rise or lies
// past the sequence's blocks (−1 padding among them), the rule the host's validation demands of host lists, so that
// no list on the device can send a kernel outside its sequence or into a loop.
__device__ __forceinline__ bool list_entry_continues(int block, int previous, int seq_blocks) {
    return block > previous && block < seq_blocks;
}

// The valid prefix of token `token`'s device list of `top_k` entries (DSA's token lists, dsa_sparse.cu and
// dsa_sparse_bwd.cu): the list ends at its first slot whose entry does not rise or lies after the token (−1 padding
// among them). The CTA's N_THREADS threads each find their smallest such slot, then the CTA's through the shared int
// `end_s`; every thread calls it, and it synchronizes the CTA twice.
template <int N_THREADS>
__device__ __forceinline__ int token_list_end(const int* __restrict__ list, int top_k, int token, int* end_s) {
    if (threadIdx.x == 0) *end_s = top_k;
    __syncthreads();
    int end = top_k;
    for (int e = threadIdx.x; e < top_k; e += N_THREADS) {
        const int previous = e == 0 ? -1 : __ldg(list + e - 1);
        if (!list_entry_continues(__ldg(list + e), previous, token + 1)) {
            end = e;
            break;
        }
    }
    if (end < top_k) atomicMin(end_s, end);
    __syncthreads();
    return *end_s;
}

// The row diagonals of a tile whose columns are a token list's slots: every slot below the list's end is a visible key
// (the list is causal by construction), so no slot has a diagonal or a window and the masks test only the list's end.
struct EverySlot {
    __device__ __forceinline__ int at(int) const { return NO_BOUND; }
};

// ---------------------------------------------------------------------------------------------------------------------
// The forward kernels' CTA (flash_fwd.cu and flash_fwd_sm90.cu differ in their tile sizes and their products, not in
// which rows a CTA owns, which keys those rows see, or how a finished row is written).

// One forward CTA: its sequence's lengths and first elements, its rows, and the KV tiles its rows can see.
struct ForwardCta {
    int len_q, len_k;                                    // the sequence's lengths
    long long q_base, k_base, v_base, o_base, lse_base;  // the sequence's first element of Q, K, V, O and LSE
    int row0, rows_here;                                 // the CTA's first query row and its rows in the sequence
    Diagonal diag;                                       // each row's diagonal (bottom-right or strided)
    long long diag_lo, diag_hi;                          // the diagonals of the first and the last row
    int tile_lo, tile_hi;                                // the KV tiles holding a visible key: [tile_lo, tile_hi)
    const elem_t* q_g;                                   // the CTA's first query row, of its query head
    const elem_t* k_g;                                   // the sequence's first key and value, of the KV head
    const elem_t* v_g;

    // Whether every row of the CTA sees every key of the tile starting at key0: only other tiles need the mask.
    __device__ __forceinline__ bool sees_whole_tile(int key0, int block_n, int win_left, int win_right) const {
        const bool interior = key0 + block_n <= len_k && key0 >= diag_hi - win_left &&
                              (long long)key0 + block_n - 1 <= diag_lo + win_right;
        return interior;
    }
};

// The CTA of query tile `tile` (block_m rows) of query head `head` of sequence `seq`, with KV tiles of block_n keys;
// false when the sequence has no such query tile (varlen: fewer query tiles than the longest sequence) and the CTA
// has nothing to do. KV tiles outside the rows' visible key range (bottom-right aligned) are never loaded.
__device__ __forceinline__ bool forward_cta(ForwardCta& c, const FlashParams& p, const elem_t* __restrict__ q,
                                            const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                                            const int* __restrict__ cu_q, const int* __restrict__ cu_k, int seq,
                                            int head, int tile, int block_m, int block_n) {
    if (p.varlen) {
        const int q0 = cu_q[seq], k0 = cu_k[seq];
        c.len_q = cu_q[seq + 1] - q0;
        c.len_k = cu_k[seq + 1] - k0;
        c.q_base = (long long)q0 * p.q_row;
        c.k_base = (long long)k0 * p.k_row;
        c.v_base = (long long)k0 * p.v_row;
        c.o_base = (long long)q0 * p.o_row;
        c.lse_base = q0;
    } else {
        c.len_q = p.dense_len_q;
        c.len_k = p.dense_len_k;
        c.q_base = seq * p.q_batch;
        c.k_base = seq * p.k_batch;
        c.v_base = seq * p.v_batch;
        c.o_base = seq * p.o_batch;
        c.lse_base = seq * p.lse_batch;
    }
    c.row0 = tile * block_m;
    if (c.row0 >= c.len_q) return false;
    c.rows_here = min(block_m, c.len_q - c.row0);
    c.diag = row_diagonal(p, c.len_q, c.len_k);
    c.diag_lo = c.diag.at(c.row0);
    c.diag_hi = c.diag.at(c.row0 + c.rows_here - 1);
    long long key_lo = c.diag_lo - p.win_left;
    long long key_hi = c.diag_hi + p.win_right + 1;
    if (key_lo < 0) key_lo = 0;
    if (key_hi > c.len_k) key_hi = c.len_k;
    c.tile_lo = key_lo < key_hi ? (int)(key_lo / block_n) : 0;
    c.tile_hi = key_lo < key_hi ? (int)((key_hi + block_n - 1) / block_n) : 0;
    const int kv_head = head / p.group;
    c.q_g = q + c.q_base + head * p.q_head + (long long)c.row0 * p.q_row;
    c.k_g = k + c.k_base + kv_head * p.k_head;
    c.v_g = v + c.v_base + kv_head * p.v_head;
    return true;
}

// The sum of a row's f32 partials ℓ over the quad (the four threads of a fragment row hold one partial each).
__device__ __forceinline__ float quad_sum(float l) {
    l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 1));
    l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 2));
    return l;
}

// Where a forward CTA's row `row` goes: query head `head` at sequence position `position`, or nowhere (false).
struct OutputRow {
    int head, position;
};

// The dense forward's rows: one query head, rows row0 .. row0 + rows_here − 1.
struct HeadRows {
    int head, row0, rows_here;
    __device__ __forceinline__ bool place(int row, OutputRow& out) const {
        out.head = head;
        out.position = row0 + row;
        return row < rows_here;
    }
};

// E5 for the thread's rows of a forward CTA: O = round_T(A / ℓ) (IEEE division), LSE = m + ln ℓ (natural log); a row
// that saw no key gets O = 0 and LSE = −∞. Rows are the m16n8 accumulator layout of SLICES 16-row slices from `wrow`;
// `rows.place(row, out)` says where each goes (HeadRows, or nsa_selected.cu's (token, head) rows).
template <int SLICES, int COL_TILES, class Rows>
__device__ __forceinline__ void write_rows(elem_t* __restrict__ o, float* __restrict__ lse, const ForwardCta& cta,
                                           const FlashParams& p, const Rows& rows, int wrow, int g, int tig,
                                           const float (&m_run)[SLICES][2], const float (&l_part)[SLICES][2],
                                           const float (&acc)[SLICES][COL_TILES][4]) {
#pragma unroll
    for (int mi = 0; mi < SLICES; ++mi) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(l_part[mi][r]);
            const int row = wrow + 16 * mi + g + 8 * r;
            OutputRow at;
            if (!rows.place(row, at)) continue;
            const bool empty = !(l > 0.f);
            elem_t* o_g = o + cta.o_base + at.head * p.o_head + (long long)at.position * p.o_row;
#pragma unroll
            for (int n = 0; n < COL_TILES; ++n) {
                const int c = n * 8 + tig * 2;
                if (c < p.dv) {
                    const float x0 = empty ? 0.f : __fdiv_rn(acc[mi][n][2 * r], l);
                    const float x1 = empty ? 0.f : __fdiv_rn(acc[mi][n][2 * r + 1], l);
                    *reinterpret_cast<unsigned*>(o_g + c) = pack_elems(to_elem(x0), to_elem(x1));
                }
            }
            if (tig == 0) {
                lse[cta.lse_base + at.head * p.lse_head + at.position] = empty ? NEG_INF : __fadd_rn(m_run[mi][r], logf(l));
            }
        }
    }
}

// write_rows for the dense forward's CTA of query head `head`.
template <int SLICES, int COL_TILES>
__device__ __forceinline__ void write_output_rows(elem_t* __restrict__ o, float* __restrict__ lse,
                                                  const ForwardCta& cta, const FlashParams& p, int head, int wrow,
                                                  int g, int tig, const float (&m_run)[SLICES][2],
                                                  const float (&l_part)[SLICES][2],
                                                  const float (&acc)[SLICES][COL_TILES][4]) {
    write_rows(o, lse, cta, p, HeadRows{head, cta.row0, cta.rows_here}, wrow, g, tig, m_run, l_part, acc);
}

// ---------------------------------------------------------------------------------------------------------------------
// Tile cursors: the tiles a CTA visits, in ascending order, one per call of next() (-1 when there are no more). Without
// BLOCK_SPARSE, every tile of a range [tile_lo, tile_hi) (range_cursor); with it, the tiles of the blocks of an
// ascending block list inside that range (list_cursor), `tiles_per_block` tiles per block. The forward walks a query
// block's key-block list in 64-key tiles; the backward's KV owner walks a CSR row (the query blocks that list its key
// block) in query tiles, its dQ owner and its deterministic dQ sum walk the query block's list again.
struct TileCursor {
    int tile_lo, tile_hi;
#if defined(BLOCK_SPARSE)
    const int* list;   // `width` entries: a valid ascending prefix, then -1 (a CSR row has no pad)
    int width;
    int tiles_per_block;
    int slot;          // the list entry of the next tile
    int sub;           // the next tile's index inside its block
    __device__ __forceinline__ int next() {
        while (slot < width) {
            const int block = __ldg(list + slot);
            if (block < 0) break;
            const int t = block * tiles_per_block + sub;
            if (++sub == tiles_per_block) {
                sub = 0;
                ++slot;
            }
            if (t >= tile_hi) break;  // ascending: every later tile is past the visible range too
            if (t >= tile_lo) return t;
        }
        slot = width;
        return -1;
    }
    // The position, counted in tiles from the list's start, of the tile next() returned last: its entry's index times
    // tiles_per_block plus its index inside the block (pads and skipped tiles count too, so it depends only on the
    // list and the tile).
    __device__ __forceinline__ int last_position() const { return slot * tiles_per_block + sub - 1; }
#else
    int t_next;
    __device__ __forceinline__ int next() { return t_next < tile_hi ? t_next++ : -1; }
#endif
};

#if defined(BLOCK_SPARSE)
__device__ __forceinline__ TileCursor list_cursor(int tile_lo, int tile_hi, const int* list, int width,
                                                  int tiles_per_block) {
    TileCursor c;
    c.tile_lo = tile_lo;
    c.tile_hi = tile_hi;
    c.list = list;
    c.width = width;
    c.tiles_per_block = tiles_per_block;
    c.slot = 0;
    c.sub = 0;
    return c;
}

// The forward CTA's cursor over the key blocks its query block lists (list head `list_head` of sequence `seq`), in
// `lists.tiles_per_block` KV tiles per block. The host chose q_block as a multiple of the CTA's rows, so the CTA's
// rows lie in one query block.
__device__ __forceinline__ TileCursor forward_list_cursor(const ForwardCta& cta, int seq, int list_head,
                                                          const int* __restrict__ block_lists,
                                                          const BlockListParams& lists) {
    const int* list_g = block_lists + seq * lists.seq_stride + (long long)list_head * lists.head_stride +
                        (long long)(cta.row0 / lists.q_block) * lists.width;
    const int tiles_per_block = lists.tiles_per_block;  // 64-key tiles for flash_fwd, 128-key ones for sm_90a
    return list_cursor(cta.tile_lo, cta.tile_hi, list_g, lists.width, tiles_per_block);
}
#else
__device__ __forceinline__ TileCursor range_cursor(int tile_lo, int tile_hi) {
    TileCursor c;
    c.tile_lo = tile_lo;
    c.tile_hi = tile_hi;
    c.t_next = tile_lo;
    return c;
}
#endif
