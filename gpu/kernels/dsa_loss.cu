// DSA's indexer loss (E16's KL in the sparse training stage) and its gradients, compiled by NVRTC after common.cuh
// with INDEX_DIM (d_I: 64 or 128), HEAD_DIM_PAD (the main attention's d rounded up to a multiple of 16) and the
// element type's define. The host wrapper is gpu/src/dsa/loss.rs, which checks every shape before a launch and names
// the rounding bound (attnproof_proofs::dsa_loss_bound) the outputs are held to.
//
// One sequence of T tokens. Token t's list J_t (lists [T, top_k] i32: ascending, −1-padded, every entry ≤ t, what
// dsa_index.cu writes) is the support of its row of the loss:
//   student  I_ts = Σ_a w_ta ReLU(q^I_ta · k^I_s)                    (the indexer's score, E16)
//   teacher  τ_ts = Σ_h exp(α q_th · k_{s,kv(h)} − lse_th)           (the main attention's probabilities, head-summed)
//            τ'_ts = τ_ts / Σ_{s∈J_t} τ_ts                            (renormalized on the list)
//   KL_t = Σ_{s∈J_t, τ'>0} τ'_ts (log τ'_ts − I_ts + lse_t(I)),  lse_t(I) = log Σ_{s∈J_t} e^{I_ts}
// With the LSE of the token-sparse forward over the same lists, τ'_ts = τ_ts / H already (each head's probabilities
// sum to 1 on J_t), the sparse training stage's teacher; with a dense forward's LSE it is the dense distribution
// restricted to J_t. A row without teacher mass (an empty list) has no target: KL_t = 0 and no gradient.
//
// Two kernels, one CTA of 256 threads per token:
//   dsa_loss_rows: the student's scores over the list in tiles of 64 gathered k^I rows (logits of the 64 indexer head
//     rows on tensor cores, f32 accumulation; ReLU; weighted sum over the heads), then the teacher's, per KV head and
//     chunk of 64 of its query heads (logits on tensor cores, expf(fmaf(z, α, −lse)), summed over the heads), each
//     written in slot order to the token's rows of `student` and `teacher` ([T, top_k] f32); then the row's
//     statistics from those rows (the CTA's own writes): the teacher's mass, the student's max and Σ e^{I − max},
//     τ' written back over τ, KL_t and lse_t(I) (+∞ for a row without mass, so that its σ = e^{I − lse} is 0).
//   dsa_loss_grad: per tile again the k^I rows and the logits l_tas (the same products as dsa_loss_rows), then
//     ∂KL/∂I_ts = σ_ts − τ'_ts with σ_ts = expf(I_ts − lse_t), the gate g_tas = (∂KL/∂I_ts · w_ta) [l_tas > 0], and in
//     f32 on the CUDA cores: ∂/∂w_ta += ∂KL/∂I_ts · ReLU(l_tas), ∂/∂q^I_ta += Σ_s g_tas k^I_s (registers of the
//     token's CTA, written once), ∂/∂k^I_s += Σ_a g_tas q^I_ta (atomicAdd into the caller's zeroed f32 rows: the
//     one output whose bits depend on the order of the tokens' CTAs).
// Slots past a list's end are 0 in `student` and `teacher`.
//
// Lists on the device are read defensively: a list ends at its first entry that does not rise or lies after its
// token (token_list_end), so no list makes a kernel read outside the sequence or a future token.

#ifndef INDEX_DIM
#error "define INDEX_DIM (64 or 128)"
#endif
#ifndef HEAD_DIM_PAD
#error "define HEAD_DIM_PAD"
#endif
static_assert(INDEX_DIM == 64 || INDEX_DIM == 128, "the indexer's head dim is 64 or 128");
static_assert(HEAD_DIM_PAD % 16 == 0 && HEAD_DIM_PAD <= 256, "HEAD_DIM_PAD must be a multiple of 16 up to 256");

#define LOSS_THREADS 256
#define LOSS_WARPS (LOSS_THREADS / 32)
#define LOSS_ROWS 64  // head rows of a pass: the indexer's heads, or a chunk of one KV head's query heads
#define LOSS_KEYS 64  // gathered tokens per tile
#define LOSS_IDX_STRIDE (INDEX_DIM + 8)
#define LOSS_QK_STRIDE (HEAD_DIM_PAD + 8)
#define LOSS_TILE_STRIDE (LOSS_QK_STRIDE > LOSS_IDX_STRIDE ? LOSS_QK_STRIDE : LOSS_IDX_STRIDE)
#define LOSS_LOGIT_STRIDE (LOSS_KEYS + 1)
#define LOSS_COLS (INDEX_DIM / 4)  // gradient columns per thread

// acc = the 64 × 64 tile of logits a · bᵀ: warp w owns rows 16·(w % 4) … + 15 and keys 32·(w / 4) … + 31, so that
// acc[n][c] is row 16·(w % 4) + g + 8·(c / 2), key 32·(w / 4) + 8n + 2·tig + c % 2 (g = lane / 4, tig = lane % 4).
template <int K_STEPS, int A_STRIDE>
__device__ __forceinline__ void loss_logits(float (&acc)[4][4], const elem_t* a_s, const elem_t* b_s) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < 4; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    const unsigned a_lane = smem_u32(a_s) + ((warp % 4) * 16 * A_STRIDE + lane_a(lane, A_STRIDE)) * ESZ;
    const unsigned b_lane =
        smem_u32(b_s) + ((warp / 4) * 32 * LOSS_TILE_STRIDE + lane_b(lane, LOSS_TILE_STRIDE)) * ESZ;
    warp_mma_nt<K_STEPS, 2, LOSS_TILE_STRIDE>(acc, a_lane, b_lane);
}

// Tiles of LOSS_KEYS slots that cover a list's n valid slots.
__device__ __forceinline__ int loss_tiles(int n) { return (n + LOSS_KEYS - 1) / LOSS_KEYS; }

// The tile's row of acc (loss_logits' layout) for element c of a thread's fragment.
__device__ __forceinline__ int loss_row(int c) {
    return (threadIdx.x / 32 % 4) * 16 + (threadIdx.x % 32) / 4 + 8 * (c / 2);
}

// Sums v (loss_logits' layout) over the tile's 64 rows for each key: a thread's two rows, the warp's eight row groups
// (xor shuffles), then the four row warps in order. Returns key threadIdx.x's sum to the first 64 threads (0 to the
// others). Every thread calls it; it synchronizes the CTA twice, and leaves part_s ([4][64]) free.
__device__ __forceinline__ float loss_key_sums(const float (&v)[4][4], float* part_s) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            float x = v[n][c] + v[n][2 + c];
            x += __shfl_xor_sync(0xffffffffu, x, 4);
            x += __shfl_xor_sync(0xffffffffu, x, 8);
            x += __shfl_xor_sync(0xffffffffu, x, 16);
            if (g == 0) part_s[(warp % 4) * LOSS_KEYS + (warp / 4) * 32 + n * 8 + 2 * tig + c] = x;
        }
    }
    __syncthreads();
    const int key = threadIdx.x;
    const float sum = key < LOSS_KEYS ? ((part_s[key] + part_s[LOSS_KEYS + key]) + part_s[2 * LOSS_KEYS + key]) +
                                            part_s[3 * LOSS_KEYS + key]
                                      : 0.f;
    __syncthreads();
    return sum;
}

// The CTA's sum (MAX: maximum) of x: a xor-shuffle tree in each warp, then the warps in order. Every thread calls it
// and receives the result; it synchronizes the CTA twice.
template <bool MAX>
__device__ __forceinline__ float loss_cta_reduce(float x, float* red_s) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float y = __shfl_xor_sync(0xffffffffu, x, off);
        x = MAX ? fmaxf(x, y) : x + y;
    }
    if (threadIdx.x % 32 == 0) red_s[threadIdx.x / 32] = x;
    __syncthreads();
    float r = red_s[0];
#pragma unroll
    for (int w = 1; w < LOSS_WARPS; ++w) r = MAX ? fmaxf(r, red_s[w]) : r + red_s[w];
    __syncthreads();
    return r;
}

// Gathers the k^I rows of slots slot0 … slot0 + rows − 1 of a list into the tile (zero rows past `rows`).
__device__ __forceinline__ void loss_gather_index_keys(elem_t* kt_s, const elem_t* __restrict__ ki, const int* list,
                                                       int slot0, int rows) {
    load_group_rows_async<LOSS_KEYS, INDEX_DIM, LOSS_TILE_STRIDE, LOSS_THREADS>(
        kt_s, ki, 0, INDEX_DIM, 0, ListedTokens{list + slot0}, 1, rows, INDEX_DIM);
}

// Token t's indexer query rows (heads past H_I are zero rows) and weights (0 past H_I).
__device__ __forceinline__ void loss_load_index_queries(elem_t* qi_s, float* w_s, const elem_t* __restrict__ qi,
                                                        const float* __restrict__ w, int t, int index_heads) {
    load_group_rows_async<LOSS_ROWS, INDEX_DIM, LOSS_IDX_STRIDE, LOSS_THREADS>(
        qi_s, qi + (long long)t * index_heads * INDEX_DIM, INDEX_DIM, 0, 0, ConsecutiveTokens{0}, LOSS_ROWS,
        index_heads, INDEX_DIM);
    if (threadIdx.x < LOSS_ROWS)
        w_s[threadIdx.x] = threadIdx.x < index_heads ? w[(long long)t * index_heads + threadIdx.x] : 0.f;
}

// qi [T, H_I, d_I], ki [T, d_I], w [T, H_I] f32, lists [T, top_k]; the main attention's q [T, H, d], k [T, H_kv, d],
// lse [H, T] f32; out: student and teacher [T, top_k] f32, kl [T] and student_lse [T] f32.
extern "C" __global__ void __launch_bounds__(LOSS_THREADS, 1)
dsa_loss_rows(const elem_t* __restrict__ qi, const elem_t* __restrict__ ki, const float* __restrict__ w,
              const int* __restrict__ lists, const elem_t* __restrict__ q, const elem_t* __restrict__ k,
              const float* __restrict__ lse, float* student, float* teacher, float* __restrict__ kl,
              float* __restrict__ student_lse, const DsaLossParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* qi_s = reinterpret_cast<elem_t*>(smem_raw);  // [LOSS_ROWS][LOSS_IDX_STRIDE]
    elem_t* q_s = qi_s + LOSS_ROWS * LOSS_IDX_STRIDE;     // [LOSS_ROWS][LOSS_QK_STRIDE]
    elem_t* kt_s = q_s + LOSS_ROWS * LOSS_QK_STRIDE;      // [LOSS_KEYS][LOSS_TILE_STRIDE]
    float* w_s = reinterpret_cast<float*>(kt_s + LOSS_KEYS * LOSS_TILE_STRIDE);  // [LOSS_ROWS]
    float* lse_s = w_s + LOSS_ROWS;                                               // [LOSS_ROWS]
    float* part_s = lse_s + LOSS_ROWS;                                            // [4][LOSS_KEYS]
    float* red_s = part_s + 4 * LOSS_KEYS;                                        // [LOSS_WARPS]
    __shared__ int list_end;

    const int t = blockIdx.x, tid = threadIdx.x, T = p.seq_len, top_k = p.top_k;
    const int* list = lists + (long long)t * top_k;
    float* student_row = student + (long long)t * top_k;
    float* teacher_row = teacher + (long long)t * top_k;
    const int n = token_list_end<LOSS_THREADS>(list, top_k, t, &list_end);
    for (int s = n + tid; s < top_k; s += LOSS_THREADS) student_row[s] = teacher_row[s] = 0.f;
    const int n_tiles = loss_tiles(n);

    // The student: I_ts over the list, tile by tile.
    loss_load_index_queries(qi_s, w_s, qi, w, t, p.index_heads);
#pragma unroll 1
    for (int j = 0; j < n_tiles; ++j) {
        const int slot0 = j * LOSS_KEYS, rows = min(LOSS_KEYS, n - slot0);
        __syncthreads();  // the previous tile's products have read kt_s
        loss_gather_index_keys(kt_s, ki, list, slot0, rows);
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
        float acc[4][4];
        loss_logits<INDEX_DIM / 16, LOSS_IDX_STRIDE>(acc, qi_s, kt_s);
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[m][c] = w_s[loss_row(c)] * fmaxf(acc[m][c], 0.f);
        const float score = loss_key_sums(acc, part_s) + 0.f;
        if (tid < rows) student_row[slot0 + tid] = score;
    }

    // The teacher: Σ_h exp(α z − lse) per slot, KV head by KV head, 64 query heads at a time. An empty list has
    // none: its chunks would only start copies of the query rows that no tile waits for, each chunk's over the
    // previous one's still in flight (racecheck's write-write hazards on q_s).
    const int group = p.n_heads / p.n_heads_kv;
#pragma unroll 1
    for (int kv = 0; n_tiles > 0 && kv < p.n_heads_kv; ++kv) {
#pragma unroll 1
        for (int chunk = 0; chunk * LOSS_ROWS < group; ++chunk) {
            const int first_head = kv * group + chunk * LOSS_ROWS;
            const int heads = min(LOSS_ROWS, group - chunk * LOSS_ROWS);
            const bool first_pass = kv == 0 && chunk == 0;
            __syncthreads();  // the previous chunk's products have read q_s and lse_s
            load_group_rows_async<LOSS_ROWS, HEAD_DIM_PAD, LOSS_QK_STRIDE, LOSS_THREADS>(
                q_s, q + (long long)t * p.n_heads * p.head_dim, p.head_dim, 0, first_head, ConsecutiveTokens{0},
                LOSS_ROWS, heads, p.head_dim);
            if (tid < LOSS_ROWS) lse_s[tid] = tid < heads ? lse[(long long)(first_head + tid) * T + t] : 0.f;
#pragma unroll 1
            for (int j = 0; j < n_tiles; ++j) {
                const int slot0 = j * LOSS_KEYS, rows = min(LOSS_KEYS, n - slot0);
                __syncthreads();
                load_group_rows_async<LOSS_KEYS, HEAD_DIM_PAD, LOSS_TILE_STRIDE, LOSS_THREADS>(
                    kt_s, k + (long long)kv * p.head_dim, 0, (long long)p.n_heads_kv * p.head_dim, 0,
                    ListedTokens{list + slot0}, 1, rows, p.head_dim);
                cp_async_commit();
                cp_async_wait_all();
                __syncthreads();
                float acc[4][4];
                loss_logits<HEAD_DIM_PAD / 16, LOSS_QK_STRIDE>(acc, q_s, kt_s);
#pragma unroll
                for (int m = 0; m < 4; ++m)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int row = loss_row(c);
                        acc[m][c] = row < heads ? expf(fmaf(acc[m][c], p.scale, -lse_s[row])) : 0.f;
                    }
                const float mass = loss_key_sums(acc, part_s);
                if (tid < rows) teacher_row[slot0 + tid] = first_pass ? mass : teacher_row[slot0 + tid] + mass;
            }
        }
    }
    cp_async_wait_all();  // an empty list leaves the query rows' copies unawaited: none may outlive the CTA
    __syncthreads();      // the rows are written: the statistics read them

    float mass = 0.f, top = NEG_INF;
    for (int s = tid; s < n; s += LOSS_THREADS) {
        mass += teacher_row[s];
        top = fmaxf(top, student_row[s]);
    }
    mass = loss_cta_reduce<false>(mass, red_s);
    top = loss_cta_reduce<true>(top, red_s);
    float z = 0.f;
    for (int s = tid; s < n; s += LOSS_THREADS) z += expf(student_row[s] - top);
    z = loss_cta_reduce<false>(z, red_s);
    const bool active = n > 0 && mass > 0.f;
    const float row_lse = active ? top + logf(z) : -NEG_INF;
    float row_kl = 0.f;
    for (int s = tid; s < n; s += LOSS_THREADS) {
        const float tau = active ? teacher_row[s] / mass : 0.f;
        teacher_row[s] = tau;
        if (tau > 0.f) row_kl += tau * ((logf(tau) - student_row[s]) + row_lse);
    }
    row_kl = loss_cta_reduce<false>(row_kl, red_s);
    if (tid == 0) {
        kl[t] = row_kl;
        student_lse[t] = row_lse;
    }
}

// The inputs of dsa_loss_rows and its outputs student, teacher ([T, top_k]) and student_lse [T]; out: d_qi
// [T, H_I, d_I] and d_w [T, H_I] f32 (written), d_ki [T, d_I] f32 (added to: the caller zeroes it).
extern "C" __global__ void __launch_bounds__(LOSS_THREADS, 1)
dsa_loss_grad(const elem_t* __restrict__ qi, const elem_t* __restrict__ ki, const float* __restrict__ w,
              const int* __restrict__ lists, const float* __restrict__ student, const float* __restrict__ teacher,
              const float* __restrict__ student_lse, float* __restrict__ d_qi, float* __restrict__ d_w, float* d_ki,
              const DsaLossParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* qi_s = reinterpret_cast<elem_t*>(smem_raw);  // [LOSS_ROWS][LOSS_IDX_STRIDE]
    elem_t* kt_s = qi_s + LOSS_ROWS * LOSS_IDX_STRIDE;    // [LOSS_KEYS][LOSS_TILE_STRIDE]
    float* w_s = reinterpret_cast<float*>(kt_s + LOSS_KEYS * LOSS_TILE_STRIDE);  // [LOSS_ROWS]
    float* logit_s = w_s + LOSS_ROWS;                  // [LOSS_ROWS][LOSS_LOGIT_STRIDE]
    float* dscore_s = logit_s + LOSS_ROWS * LOSS_LOGIT_STRIDE;  // [LOSS_KEYS]
    __shared__ int list_end;

    const int t = blockIdx.x, tid = threadIdx.x, top_k = p.top_k, index_heads = p.index_heads;
    const int* list = lists + (long long)t * top_k;
    const int n = token_list_end<LOSS_THREADS>(list, top_k, t, &list_end);
    const float row_lse = student_lse[t];
    loss_load_index_queries(qi_s, w_s, qi, w, t, index_heads);

    // Thread (head a = tid / 4, quarter e = tid % 4) owns ∂/∂q^I of head a at columns e, e + 4, …, and ∂/∂w_a over
    // the slots ≡ e (mod 4); in the ∂/∂k^I step it owns slot tid / 4 of the tile at the same columns.
    const int a = tid / 4, e = tid % 4;
    float dq[LOSS_COLS];
#pragma unroll
    for (int m = 0; m < LOSS_COLS; ++m) dq[m] = 0.f;
    float dw = 0.f;
    const int n_tiles = loss_tiles(n);
#pragma unroll 1
    for (int j = 0; j < n_tiles; ++j) {
        const int slot0 = j * LOSS_KEYS, rows = min(LOSS_KEYS, n - slot0);
        __syncthreads();  // the previous tile's sums have read kt_s, logit_s and dscore_s
        loss_gather_index_keys(kt_s, ki, list, slot0, rows);
        cp_async_commit();
        if (tid < LOSS_KEYS) {
            const long long at = (long long)t * top_k + slot0 + tid;
            dscore_s[tid] = tid < rows ? expf(student[at] - row_lse) - teacher[at] : 0.f;
        }
        cp_async_wait_all();
        __syncthreads();
        float acc[4][4];
        loss_logits<INDEX_DIM / 16, LOSS_IDX_STRIDE>(acc, qi_s, kt_s);
        {
            const int warp = tid / 32, lane = tid % 32;
#pragma unroll
            for (int m = 0; m < 4; ++m)
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    logit_s[loss_row(c) * LOSS_LOGIT_STRIDE + (warp / 4) * 32 + m * 8 + 2 * (lane % 4) + c % 2] =
                        acc[m][c];
        }
        __syncthreads();
        // ∂/∂w_a and ∂/∂q^I_a over the tile's slots.
        const float w_a = w_s[a];
#pragma unroll 4
        for (int s = 0; s < LOSS_KEYS; ++s) {
            const float l = logit_s[a * LOSS_LOGIT_STRIDE + s];
            if (l > 0.f) {
                const float ds = dscore_s[s];
                if (s % 4 == e) dw = fmaf(ds, l, dw);
                const float gate = ds * w_a;
#pragma unroll
                for (int m = 0; m < LOSS_COLS; ++m)
                    dq[m] = fmaf(gate, to_f32(kt_s[s * LOSS_TILE_STRIDE + e + 4 * m]), dq[m]);
            }
        }
        // ∂/∂k^I of slot tid / 4 of the tile.
        const int slot = tid / 4;
        const float ds = dscore_s[slot];
        if (slot < rows && ds != 0.f) {
            float dk[LOSS_COLS];
#pragma unroll
            for (int m = 0; m < LOSS_COLS; ++m) dk[m] = 0.f;
#pragma unroll 1
            for (int h = 0; h < index_heads; ++h) {
                if (logit_s[h * LOSS_LOGIT_STRIDE + slot] > 0.f) {
                    const float gate = ds * w_s[h];
#pragma unroll
                    for (int m = 0; m < LOSS_COLS; ++m)
                        dk[m] = fmaf(gate, to_f32(qi_s[h * LOSS_IDX_STRIDE + e + 4 * m]), dk[m]);
                }
            }
            float* dst = d_ki + (long long)list[slot0 + slot] * INDEX_DIM;
#pragma unroll
            for (int m = 0; m < LOSS_COLS; ++m) atomicAdd(dst + e + 4 * m, dk[m]);
        }
    }
    cp_async_wait_all();  // as in dsa_loss_rows, for an empty list
    // ∂/∂w_a: the four quarters' sums, in order.
    const float dw1 = __shfl_sync(0xffffffffu, dw, (tid % 32) - e + 1);
    const float dw2 = __shfl_sync(0xffffffffu, dw, (tid % 32) - e + 2);
    const float dw3 = __shfl_sync(0xffffffffu, dw, (tid % 32) - e + 3);
    if (a < index_heads) {
        if (e == 0) d_w[(long long)t * index_heads + a] = ((dw + dw1) + dw2) + dw3;
        float* dst = d_qi + ((long long)t * index_heads + a) * INDEX_DIM;
#pragma unroll
        for (int m = 0; m < LOSS_COLS; ++m) dst[e + 4 * m] = dq[m];
    }
}
