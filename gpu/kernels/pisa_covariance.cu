// PISA's covariance-aware block selection (E24) on the GPU, compiled by NVRTC after common.cuh and before
// bsa_select.cu (gpu/src/pisa/covariance.rs is the host side and documents the convention; the oracle is
// oracle/src/pisa.rs's covariance_block_scores).
//
// Four kernels feed bsa_select.cu's selectors, which through the hooks defined here take two more buffers and add to
// each block's group-summed pooled score S_ab the spread term  Σ_{h ∈ group} ln(n_b + c_{a,h} s_b)  (heads ascending,
// from 0, then added to S_ab; n_b the block's key count; covariance_term below, one function for both selectors, so
// their scores stay equal). All run after bsa_pool_keys, whose f64 mean keys μ_b (the pooled workspace's first
// [B, Hkv, n_k, d]) they read, and all work in f64 from the inputs' exact values:
//   pisa_covariance_hbar  one CTA per (range of RANGE_BLOCKS key blocks, KV head, sequence): the range's part of
//                   Σ_b H_b = Σ_j fl(k_j − μ_{b(j)}) v_jᵀ, each entry one fma chain over the range's keys in ascending
//                   order, into the partial sums [ranges, B, Hkv, d, dv].
//   pisa_covariance_hbar_sum  one thread per entry of [d, dv] and (KV head, sequence): H̄ = (Σ of the sequence's
//                   ranges' partial sums, ascending) / n_blocks, into [B, Hkv, d, dv] after the partial sums.
//   pisa_covariance_spread  one CTA per (key block, KV head, sequence): the block's s_b, the estimate of ‖H_b − H̄‖₂
//                   by exactly E24_POWER_STEPS steps of power iteration from the all-ones vector. The CTA forms
//                   M = H_b − H̄ in shared memory (H_b's fma chain over the block's keys, as above, then one
//                   subtraction), then repeats the oracle's step: x ← x/‖x‖, a = M x, s = ‖a‖, x ← Mᵀ a (each matvec
//                   entry an fma chain over its columns or rows, ascending; each norm the square root of a sum of
//                   squares over a fixed shuffle tree). A zero ‖x‖ stops the steps, as in the oracle. Blocks past a
//                   sequence's own get s_b = 0.
//   pisa_covariance_coefficients  one thread per (query block, query head, sequence): c_{a,h} = γ|α| · ‖q̄_{a,h}‖
//                   from the selector's f64 pooled queries (the sum of squares over the columns ascending).
// Outputs in caller-owned f64 buffers: H̄'s partial sums and H̄, spreads [B, Hkv, n_k], coefficients [B, Hq, n_q].
// H̄ is summed in f64 from the centred products (not from Σ_j k_j v_jᵀ on the tensor cores, as the tail's is): its
// error is then a few f64 roundings of Σ_j |k_j − μ_b||v_j|, which keeps the spreads' bound tight.
//
// Determinism: every sum runs in an order fixed by the block's offsets only, so two blocks with bitwise equal keys,
// values and counts get bitwise equal spreads, and their scores tie exactly as the oracle's do.

#define COVARIANCE_ARGS , const double* __restrict__ spreads, const double* __restrict__ coefficients
#define WITH_COVARIANCE(score, a, b) \
    ((score) + covariance_term(spreads, coefficients, params, seq, kv, (a), (b), len_k))

// The spread term of query block a and key block b of (sequence seq, KV head kv) whose sequence has len_k keys.
__device__ __forceinline__ double covariance_term(const double* __restrict__ spreads,
                                                  const double* __restrict__ coefficients, const BsaParams& params,
                                                  int seq, int kv, int a, int b, int len_k) {
    const int group = params.flash.group;
    const long long n_heads_q = (long long)params.n_heads_kv * group;
    const double s = spreads[((long long)seq * params.n_heads_kv + kv) * params.n_key_blocks + b];
    const double n = (double)min(params.kv_block, len_k - b * params.kv_block);
    const double* c = coefficients + ((long long)seq * n_heads_q + (long long)kv * group) * params.n_query_blocks + a;
    double term = 0.0;
    for (int h = 0; h < group; ++h) term += log(n + c[(long long)h * params.n_query_blocks] * s);
    return term;
}

#define SPREAD_THREADS 256
#define COEFFICIENT_THREADS 128
#define SPREAD_WARPS (SPREAD_THREADS / 32)
#define SPREAD_CHUNK 8  // keys staged per step of M's sum (8: the E31 head dims, 192 × 128, fit)
#ifndef E24_POWER_STEPS
#define E24_POWER_STEPS 32
#endif

// The sum of `x` over the CTA in a fixed order: the xor-shuffle tree in each warp, then the warps ascending; every
// thread gets the result. `scratch` holds SPREAD_WARPS doubles; the call syncs the CTA twice.
__device__ __forceinline__ double spread_block_sum(double x, double* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    double total = 0.0;
#pragma unroll
    for (int w = 0; w < SPREAD_WARPS; ++w) total += scratch[w];
    __syncthreads();  // scratch is reused by the next call
    return total;
}

#define RANGE_BLOCKS 16  // key blocks per partial sum of H̄

// The dynamic shared memory's parts, as both kernels that form sums of products lay it out (covariance.rs's
// spread_shared_bytes): M [d][dv + 1] (rows padded by one f64, so that the row-wise matvec's lanes read distinct
// banks), a chunk of deviations [SPREAD_CHUNK][d] and of values [SPREAD_CHUNK][dv], then the power steps' vectors
// x [dv] and a [d] and the reduction's scratch [SPREAD_WARPS].
struct SpreadShared {
    double* m;
    double* dev;
    double* val;
    double* x;
    double* ax;
    double* scratch;
};

__device__ __forceinline__ SpreadShared spread_shared(unsigned char* raw, int d, int dv) {
    SpreadShared s;
    s.m = reinterpret_cast<double*>(raw);
    s.dev = s.m + (long long)d * (dv + 1);
    s.val = s.dev + SPREAD_CHUNK * d;
    s.x = s.val + SPREAD_CHUNK * dv;
    s.ax = s.x + dv;
    s.scratch = s.ax + d;
    return s;
}

// Sets M to Σ_j fl(k_j − μ_{b(j)}) v_jᵀ over the keys [j_begin, j_end) of one (sequence, KV head): the keys staged
// SPREAD_CHUNK at a time, each entry of M one fma chain from zero over the keys in ascending order. `k`, `v` point at
// the head's first key and value, `means` at its first block's mean key (f64, d per block). Ends synced.
__device__ __forceinline__ void centred_products(const SpreadShared& sh, const elem_t* __restrict__ k,
                                                 const elem_t* __restrict__ v, const double* __restrict__ means,
                                                 const FlashParams& fp, int kv_block, int j_begin, int j_end) {
    const int d = fp.d, dv = fp.dv, row = dv + 1;
    for (int e = threadIdx.x; e < d * dv; e += SPREAD_THREADS) sh.m[(e / dv) * row + e % dv] = 0.0;
    __syncthreads();
    for (int j0 = j_begin; j0 < j_end; j0 += SPREAD_CHUNK) {
        const int rows = min(SPREAD_CHUNK, j_end - j0);
        for (int e = threadIdx.x; e < rows * d; e += SPREAD_THREADS) {
            const int key = j0 + e / d, c = e % d;
            const double mean = means[(long long)(key / kv_block) * d + c];
            sh.dev[e] = (double)to_f32(k[(long long)key * fp.k_row + c]) - mean;
        }
        for (int e = threadIdx.x; e < rows * dv; e += SPREAD_THREADS) {
            const int key = j0 + e / dv, c = e % dv;
            sh.val[e] = (double)to_f32(v[(long long)key * fp.v_row + c]);
        }
        __syncthreads();
        for (int e = threadIdx.x; e < d * dv; e += SPREAD_THREADS) {
            const int r = e / dv, c = e % dv;
            double acc = sh.m[r * row + c];
            for (int j = 0; j < rows; ++j) acc = fma(sh.dev[j * d + r], sh.val[j * dv + c], acc);
            sh.m[r * row + c] = acc;
        }
        __syncthreads();  // the next chunk overwrites the staged rows
    }
}

// The keys' count of (sequence seq) and the head's first key and value.
__device__ __forceinline__ int head_keys(const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                                         const int* __restrict__ cu_k, const FlashParams& fp, int seq, int kv,
                                         const elem_t*& k_head, const elem_t*& v_head) {
    const int len_k = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
    k_head = k + (fp.varlen ? (long long)cu_k[seq] * fp.k_row : seq * fp.k_batch) + kv * fp.k_head;
    v_head = v + (fp.varlen ? (long long)cu_k[seq] * fp.v_row : seq * fp.v_batch) + kv * fp.v_head;
    return len_k;
}

extern "C" __global__ void __launch_bounds__(SPREAD_THREADS)
pisa_covariance_hbar(const elem_t* __restrict__ k, const elem_t* __restrict__ v, const double* __restrict__ pooled,
                     double* __restrict__ hbar, double* __restrict__ spreads, const int* __restrict__ cu_k,
                     const BsaParams params, const int batch, const int n_ranges) {
    const FlashParams& fp = params.flash;
    const int range = blockIdx.x, kv = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv, row = dv + 1;
    const elem_t *k_head, *v_head;
    const int len_k = head_keys(k, v, cu_k, fp, seq, kv, k_head, v_head);
    const int j_begin = range * RANGE_BLOCKS * params.kv_block;
    if (j_begin >= len_k) return;  // the sum kernel reads only the sequence's own ranges
    const int j_end = min(len_k, j_begin + RANGE_BLOCKS * params.kv_block);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const SpreadShared sh = spread_shared(smem_raw, d, dv);
    const double* means = pooled + ((long long)seq * params.n_heads_kv + kv) * params.n_key_blocks * d;
    centred_products(sh, k_head, v_head, means, fp, params.kv_block, j_begin, j_end);
    double* out = hbar + (((long long)range * batch + seq) * params.n_heads_kv + kv) * d * dv;
    for (int e = threadIdx.x; e < d * dv; e += SPREAD_THREADS) out[e] = sh.m[(e / dv) * row + e % dv];
}

extern "C" __global__ void __launch_bounds__(COEFFICIENT_THREADS)
pisa_covariance_hbar_sum(const elem_t* __restrict__ k, const elem_t* __restrict__ v, const double* __restrict__ pooled,
                         double* __restrict__ hbar, double* __restrict__ spreads, const int* __restrict__ cu_k,
                         const BsaParams params, const int batch, const int n_ranges) {
    const FlashParams& fp = params.flash;
    const int kv = blockIdx.y, seq = blockIdx.z;
    const long long e = (long long)blockIdx.x * COEFFICIENT_THREADS + threadIdx.x, size = (long long)fp.d * fp.dv;
    if (e >= size) return;
    const int len_k = fp.varlen ? cu_k[seq + 1] - cu_k[seq] : fp.dense_len_k;
    const int blocks = (len_k + params.kv_block - 1) / params.kv_block;
    const int ranges = (blocks + RANGE_BLOCKS - 1) / RANGE_BLOCKS;
    double total = 0.0;
    for (int r = 0; r < ranges; ++r) total += hbar[(((long long)r * batch + seq) * params.n_heads_kv + kv) * size + e];
    hbar[(((long long)n_ranges * batch + seq) * params.n_heads_kv + kv) * size + e] = blocks > 0 ? total / blocks : 0.0;
}

extern "C" __global__ void __launch_bounds__(SPREAD_THREADS)
pisa_covariance_spread(const elem_t* __restrict__ k, const elem_t* __restrict__ v, const double* __restrict__ pooled,
                       double* __restrict__ hbar, double* __restrict__ spreads, const int* __restrict__ cu_k,
                       const BsaParams params, const int batch, const int n_ranges) {
    const FlashParams& fp = params.flash;
    const int b = blockIdx.x, kv = blockIdx.y, seq = blockIdx.z, d = fp.d, dv = fp.dv, row = dv + 1;
    const long long block_row = ((long long)seq * params.n_heads_kv + kv) * params.n_key_blocks + b;
    const elem_t *k_head, *v_head;
    const int len_k = head_keys(k, v, cu_k, fp, seq, kv, k_head, v_head);
    const int key0 = b * params.kv_block;
    if (key0 >= len_k) {
        if (threadIdx.x == 0) spreads[block_row] = 0.0;
        return;
    }
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const SpreadShared sh = spread_shared(smem_raw, d, dv);
    const double* means = pooled + ((long long)seq * params.n_heads_kv + kv) * params.n_key_blocks * d;
    centred_products(sh, k_head, v_head, means, fp, params.kv_block, key0, min(len_k, key0 + params.kv_block));
    const double* h_bar = hbar + (((long long)n_ranges * batch + seq) * params.n_heads_kv + kv) * d * dv;
    for (int e = threadIdx.x; e < d * dv; e += SPREAD_THREADS) sh.m[(e / dv) * row + e % dv] -= h_bar[e];
    for (int c = threadIdx.x; c < dv; c += SPREAD_THREADS) sh.x[c] = 1.0;
    __syncthreads();

    // The oracle's steps (oracle/src/vector.rs's power_iteration under AllSteps); d, dv ≤ SPREAD_THREADS, so each
    // thread owns at most one entry of x and one of a.
    const int t = threadIdx.x;
    double estimate = 0.0;
    for (int step = 0; step < E24_POWER_STEPS; ++step) {
        const double xt = t < dv ? sh.x[t] : 0.0;
        const double norm = sqrt(spread_block_sum(xt * xt, sh.scratch));
        if (norm == 0.0) break;
        if (t < dv) sh.x[t] = xt / norm;
        __syncthreads();
        double a = 0.0;
        if (t < d) {
            for (int c = 0; c < dv; ++c) a = fma(sh.m[t * row + c], sh.x[c], a);
            sh.ax[t] = a;
        }
        estimate = sqrt(spread_block_sum(a * a, sh.scratch));  // the syncs inside publish a
        if (t < dv) {
            double y = 0.0;
            for (int r = 0; r < d; ++r) y = fma(sh.m[r * row + t], sh.ax[r], y);
            sh.x[t] = y;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) spreads[block_row] = estimate;
}

extern "C" __global__ void __launch_bounds__(COEFFICIENT_THREADS)
pisa_covariance_coefficients(const double* __restrict__ pooled, double* __restrict__ coefficients,
                             const BsaParams params, const int batch, const double gamma_scale) {
    const int n_heads_q = params.n_heads_kv * params.flash.group, d = params.flash.d;
    const long long i = (long long)blockIdx.x * COEFFICIENT_THREADS + threadIdx.x;
    if (i >= (long long)batch * n_heads_q * params.n_query_blocks) return;
    const double* q = pooled + params.pooled_queries_at + i * d;  // [B, Hq, n_q, d]: entry i's pooled query
    double squares = 0.0;
    for (int c = 0; c < d; ++c) squares = fma(q[c], q[c], squares);
    coefficients[i] = gamma_scale * sqrt(squares);
}
