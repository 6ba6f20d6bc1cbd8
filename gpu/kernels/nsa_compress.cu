// NSA's compression (E18), compiled by NVRTC (see gpu/src/compile.rs) after common.cuh: the compressed keys
// k̃_c = φ_K(k_{cs .. cs+l-1}) and values ṽ_c = φ_V(v_{cs .. cs+l-1}) of every complete window c of every sequence and
// KV head. The rule is the oracle's (oracle/src/nsa.rs, `compress`); the host wrapper is gpu/src/nsa/compress.rs, and
// the rounding-error bound of this recipe is proofs/src/nsa_bound.rs's `compression_bound`.
//
// Two kernels, one per operand, over one helper:
//   nsa_compress_keys    K [.., Hkv, L, d]  -> k̃ [.., Hkv, W, d]   with φ_K (first in the weights buffer)
//   nsa_compress_values  V [.., Hkv, L, dv] -> ṽ [.., Hkv, W, dv]  with φ_V (after φ_K's weights)
// and their transposes, the backward of the pooling (the oracle's `compress_backward`, its dx), over a second helper:
//   nsa_compress_keys_backward    dk̃ [.., Hkv, W, d]  -> dK [.., Hkv, L, d]:  dK_t = Σ_c w_{t−c·s} dk̃_c (mean: Σ_c dk̃_c / l)
//   nsa_compress_values_backward  dṽ [.., Hkv, W, dv] -> dV [.., Hkv, L, dv], over the windows c that hold token t
// whose grid runs over token groups instead of window groups (every token of the sequence is written: a token no
// complete window holds gets zero); and the learned map's own gradient (the oracle's `compress_backward`'s dW, summed
// over every sequence and KV head, since one matrix serves them all):
//   nsa_compress_keys_map_backward    K, dk̃ -> dW_K [l·d, d]   f32: dW[i·d + j, k] = Σ_{seq, h, c} x_{c·s+i, j} dk̃_{c,k}
//   nsa_compress_values_map_backward  V, dṽ -> dW_V [l·dv, dv] f32
// whose grid runs over groups of rows of W (a thread owns 8 adjacent columns of one row).
//
// The map (the `map` flag of each operand in NsaParams): 0 the mean, 1 position weights w [l] (f64), 2 the learned
// matrix W [l·cols, cols] (f64, row-major; the window's l rows stacked into one vector of l·cols, as the oracle's
// `Compression::Linear`). The weights buffer holds φ_K's then φ_V's (l entries each, or l·cols² for a matrix).
// Grid (window groups, KV heads, sequences); a thread owns 8 adjacent columns of one window, so a CTA of 128 threads
// covers 128 / (cols / 8) windows. Windows past a sequence's own are skipped.
//
// Recipe (the bound's model; the CPU reference `attnproof_reference::sparse::nsa::compress` is the same operations
// in the same order, so the two agree bit for bit): each column's l values, widened exactly to f64, are added in
// ascending window position (the mean: plain additions, then one division by l) or accumulated with one fused
// multiply-add per position (weighted: acc = fma(w_i, x_i, acc), w_i the caller's f64 weight); the f64 result is
// rounded to f32 and then to the storage type, both to nearest. The transposes take a token's windows in ascending
// order the same way (plain additions then one division by l, or one fused multiply-add per window with the weight of
// the token's position in it), then the same two roundings. f64 keeps the sum of up to l values of the storage
// type's whole range from overflowing (an f32 sum of 32 bf16 values near the largest one would) and makes the
// accumulation error negligible beside the storage rounding. The learned matrix takes the same path with l·cols
// terms: acc = fma(W[r, k], x_r, acc) over the stacked index r = i·cols + j ascending; its transpose takes the
// windows ascending and, in each, k ascending: acc = fma(W[i·cols + j, k], dx̃_{c,k}, acc); its own gradient takes
// the sequences, then the KV heads, then the windows ascending: acc = fma(x_{c·s+i, j}, dx̃_{c,k}, acc), rounded once
// to f32. These are CUDA-core f64 loops, not tensor-core GEMMs: the map is a parameter a user verifies, and every
// operation above is fixed so that the CPU reference can follow it.

#define CMP_THREADS 128

// The `map` flag's values.
#define MAP_MEAN 0
#define MAP_WEIGHTS 1
#define MAP_MATRIX 2

// φ_V's weights follow φ_K's: l of them, or l·d² for φ_K's matrix.
__device__ __forceinline__ const double* value_weights(const double* __restrict__ weights, const NsaParams& params) {
    const long long d = params.flash.d;
    return weights + (params.weighted_keys == MAP_MATRIX ? (long long)params.compress_len * d * d
                                                         : (long long)params.compress_len);
}

// The thread's row (a window forward, a token backward) and its chunk of 8 of the `cols` columns: a CTA covers
// 128 / (cols / 8) rows. 128 threads need not split into whole rows (d = 40 has 5 chunks): false for the idle tail.
__device__ __forceinline__ bool thread_row(const int cols, int& row, int& chunk) {
    const int chunks = cols / 8;
    const int per_cta = CMP_THREADS / chunks;
    const int slot = threadIdx.x / chunks;
    chunk = threadIdx.x % chunks;
    row = blockIdx.x * per_cta + slot;
    return slot < per_cta;
}

// Adds one row's 8 columns at `p` (16-byte aligned) to `acc`, widened exactly to f64: a plain addition (the mean) or
// one fused multiply-add with the weight `w` (position weights).
__device__ __forceinline__ void add_row(double (&acc)[8], const elem_t* __restrict__ p, const int map,
                                        const double w) {
    const uint4 row = *reinterpret_cast<const uint4*>(p);
    const elem_t* e8 = reinterpret_cast<const elem_t*>(&row);
    if (map == MAP_WEIGHTS) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fma(w, (double)to_f32(e8[e]), acc[e]);
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += (double)to_f32(e8[e]);
    }
}

// One window's 8 columns: rows `cs .. cs + l - 1` of head `h` of the current sequence, from `x` (strides of the
// operand) into `out` (the compressed layout), with the caller's weights or the mean.
__device__ __forceinline__ void compress_window(const elem_t* __restrict__ x, elem_t* __restrict__ out,
                                                const double* __restrict__ weights, const int weighted,
                                                const int* __restrict__ cu_k, const int* __restrict__ cu_windows,
                                                const NsaParams& params, const long long batch_stride,
                                                const long long head_stride, const long long row_stride,
                                                const int cols) {
    const FlashParams& fp = params.flash;
    const int h = blockIdx.y, seq = blockIdx.z;
    int c, chunk;
    if (!thread_row(cols, c, chunk)) return;
    int windows;
    long long in_base, out_at;
    if (fp.varlen) {
        windows = cu_windows[seq + 1] - cu_windows[seq];
        in_base = (long long)cu_k[seq] * row_stride;
        out_at = (((long long)cu_windows[seq] + c) * params.n_heads_kv + h) * cols;
    } else {
        windows = params.dense_windows;
        in_base = seq * batch_stride;
        out_at = (((long long)seq * params.n_heads_kv + h) * windows + c) * cols;
    }
    if (c >= windows) return;
    // Rows start 16 bytes aligned: cols is a multiple of 8 (FlashParams::for_spec), so are the strides and offsets.
    const elem_t* src = x + in_base + h * head_stride + (long long)c * params.compress_stride * row_stride + chunk * 8;
    double acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.0;
    if (weighted == MAP_MATRIX) {
        // The stacked index r = i·cols + j ascending; the window's 16 threads read the same x and adjacent W columns.
        const elem_t* rows = src - chunk * 8;
        for (int i = 0; i < params.compress_len; ++i) {
            const elem_t* row = rows + (long long)i * row_stride;
            for (int j = 0; j < cols; ++j) {
                const double xv = (double)to_f32(row[j]);
                const double* w = weights + ((long long)i * cols + j) * cols + chunk * 8;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] = fma(w[e], xv, acc[e]);
            }
        }
    } else {
        for (int i = 0; i < params.compress_len; ++i) add_row(acc, src + (long long)i * row_stride, weighted, weights[i]);
    }
    __align__(16) elem_t result[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const double y = weighted ? acc[e] : acc[e] / params.compress_len;
        result[e] = to_elem(__double2float_rn(y));
    }
    *reinterpret_cast<uint4*>(out + out_at + chunk * 8) = *reinterpret_cast<const uint4*>(result);
}

extern "C" __global__ void __launch_bounds__(CMP_THREADS)
nsa_compress_keys(const elem_t* __restrict__ k, elem_t* __restrict__ k_cmp, const double* __restrict__ weights,
                  const int* __restrict__ cu_k, const int* __restrict__ cu_windows, const NsaParams params) {
    const FlashParams& fp = params.flash;
    compress_window(k, k_cmp, weights, params.weighted_keys, cu_k, cu_windows, params, fp.k_batch, fp.k_head,
                    fp.k_row, fp.d);
}

extern "C" __global__ void __launch_bounds__(CMP_THREADS)
nsa_compress_values(const elem_t* __restrict__ v, elem_t* __restrict__ v_cmp, const double* __restrict__ weights,
                    const int* __restrict__ cu_k, const int* __restrict__ cu_windows, const NsaParams params) {
    const FlashParams& fp = params.flash;
    compress_window(v, v_cmp, value_weights(weights, params), params.weighted_values, cu_k, cu_windows, params,
                    fp.v_batch, fp.v_head, fp.v_row, fp.dv);
}

// The transpose of compress_window for one token's 8 columns: row t of head h of the current sequence in `dx` (the
// operand's layout) from the windows that hold it in `dx_cmp` (the compressed layout).
__device__ __forceinline__ void compress_transpose_row(const elem_t* __restrict__ dx_cmp, elem_t* __restrict__ dx,
                                                       const double* __restrict__ weights, const int weighted,
                                                       const int* __restrict__ cu_k,
                                                       const int* __restrict__ cu_windows, const NsaParams& params,
                                                       const long long batch_stride, const long long head_stride,
                                                       const long long row_stride, const int cols) {
    const FlashParams& fp = params.flash;
    const int h = blockIdx.y, seq = blockIdx.z;
    int t, chunk;
    if (!thread_row(cols, t, chunk)) return;
    int windows, len;
    long long out_base, cmp_row0;
    if (fp.varlen) {
        cmp_row0 = cu_windows[seq];
        windows = cu_windows[seq + 1] - (int)cmp_row0;
        len = cu_k[seq + 1] - cu_k[seq];
        out_base = (long long)cu_k[seq] * row_stride;
    } else {
        windows = params.dense_windows;
        len = fp.dense_len_k;
        out_base = seq * batch_stride;
        cmp_row0 = (long long)seq * windows;
    }
    if (t >= len) return;
    const int l = params.compress_len, s = params.compress_stride;
    // The windows c with c·s ≤ t ≤ c·s + l − 1 among the sequence's complete ones.
    const int c_lo = t >= l ? (t - l + s) / s : 0;
    const int c_hi = min(t / s, windows - 1);
    double acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.0;
    for (int c = c_lo; c <= c_hi; ++c) {
        // Varlen windows are packed [ΣW, Hkv, cols]; dense ones [B, Hkv, W, cols].
        const long long at = fp.varlen ? ((cmp_row0 + c) * params.n_heads_kv + h) * cols
                                       : (((long long)seq * params.n_heads_kv + h) * windows + c) * cols;
        const double w = weights[t - c * s];
        if (weighted == MAP_MATRIX) {
            // Column j = chunk·8 + e of the token's position i in the window: Σ_k W[i·cols + j, k] dx̃_{c,k}.
            const double* w_rows = weights + ((long long)(t - c * s) * cols + chunk * 8) * cols;
            for (int k = 0; k < cols; ++k) {
                const double g = (double)to_f32(dx_cmp[at + k]);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] = fma(w_rows[(long long)e * cols + k], g, acc[e]);
            }
        } else {
            add_row(acc, dx_cmp + at + chunk * 8, weighted, w);
        }
    }
    __align__(16) elem_t result[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const double y = weighted ? acc[e] : acc[e] / l;
        result[e] = to_elem(__double2float_rn(y));
    }
    *reinterpret_cast<uint4*>(dx + out_base + h * head_stride + (long long)t * row_stride + chunk * 8) =
        *reinterpret_cast<const uint4*>(result);
}

extern "C" __global__ void __launch_bounds__(CMP_THREADS)
nsa_compress_keys_backward(const elem_t* __restrict__ dk_cmp, elem_t* __restrict__ dk,
                           const double* __restrict__ weights, const int* __restrict__ cu_k,
                           const int* __restrict__ cu_windows, const NsaParams params) {
    const FlashParams& fp = params.flash;
    compress_transpose_row(dk_cmp, dk, weights, params.weighted_keys, cu_k, cu_windows, params, fp.k_batch, fp.k_head,
                           fp.k_row, fp.d);
}

extern "C" __global__ void __launch_bounds__(CMP_THREADS)
nsa_compress_values_backward(const elem_t* __restrict__ dv_cmp, elem_t* __restrict__ dv,
                             const double* __restrict__ weights, const int* __restrict__ cu_k,
                             const int* __restrict__ cu_windows, const NsaParams params) {
    const FlashParams& fp = params.flash;
    // The values' weights and flag (the forward's call spells the same arguments on one line).
    compress_transpose_row(dv_cmp, dv, value_weights(weights, params), params.weighted_values,
                           cu_k, cu_windows, params, fp.v_batch, fp.v_head, fp.v_row, fp.dv);
}

// The learned matrix's gradient for one operand, 8 columns k of one row r = i·cols + j of dW: Σ over every sequence,
// KV head and complete window c of x_{c·s+i, j} dx̃_{c,k}, in that order, in f64, rounded once to f32.
__device__ __forceinline__ void compress_map_gradient(const elem_t* __restrict__ x, const elem_t* __restrict__ dx_cmp,
                                                      float* __restrict__ dw, const int* __restrict__ cu_k,
                                                      const int* __restrict__ cu_windows, const NsaParams& params,
                                                      const int n_sequences, const long long batch_stride,
                                                      const long long head_stride, const long long row_stride,
                                                      const int cols) {
    const FlashParams& fp = params.flash;
    int r, chunk;
    if (!thread_row(cols, r, chunk)) return;
    if (r >= params.compress_len * cols) return;
    const int i = r / cols, j = r % cols, s = params.compress_stride, n_heads = params.n_heads_kv;
    double acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.0;
    for (int seq = 0; seq < n_sequences; ++seq) {
        const int windows = fp.varlen ? cu_windows[seq + 1] - cu_windows[seq] : params.dense_windows;
        const long long x_base = fp.varlen ? (long long)cu_k[seq] * row_stride : seq * batch_stride;
        for (int h = 0; h < n_heads; ++h) {
            for (int c = 0; c < windows; ++c) {
                const double xv = (double)to_f32(x[x_base + h * head_stride + (long long)(c * s + i) * row_stride + j]);
                // Varlen windows are packed [ΣW, Hkv, cols]; dense ones [B, Hkv, W, cols].
                const long long at = fp.varlen ? (((long long)cu_windows[seq] + c) * n_heads + h) * cols
                                               : (((long long)seq * n_heads + h) * windows + c) * cols;
                const uint4 packed = *reinterpret_cast<const uint4*>(dx_cmp + at + chunk * 8);
                const elem_t* g = reinterpret_cast<const elem_t*>(&packed);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] = fma(xv, (double)to_f32(g[e]), acc[e]);
            }
        }
    }
    float4 lo, hi;
    lo.x = __double2float_rn(acc[0]); lo.y = __double2float_rn(acc[1]);
    lo.z = __double2float_rn(acc[2]); lo.w = __double2float_rn(acc[3]);
    hi.x = __double2float_rn(acc[4]); hi.y = __double2float_rn(acc[5]);
    hi.z = __double2float_rn(acc[6]); hi.w = __double2float_rn(acc[7]);
    float4* out = reinterpret_cast<float4*>(dw + (long long)r * cols + chunk * 8);
    out[0] = lo;
    out[1] = hi;
}

extern "C" __global__ void __launch_bounds__(CMP_THREADS)
nsa_compress_keys_map_backward(const elem_t* __restrict__ k, const elem_t* __restrict__ dk_cmp,
                               float* __restrict__ dw, const int* __restrict__ cu_k,
                               const int* __restrict__ cu_windows, const NsaParams params, const int n_sequences) {
    const FlashParams& fp = params.flash;
    compress_map_gradient(k, dk_cmp, dw, cu_k, cu_windows, params, n_sequences, fp.k_batch, fp.k_head, fp.k_row,
                          fp.d);
}

extern "C" __global__ void __launch_bounds__(CMP_THREADS)
nsa_compress_values_map_backward(const elem_t* __restrict__ v, const elem_t* __restrict__ dv_cmp,
                                 float* __restrict__ dw, const int* __restrict__ cu_k,
                                 const int* __restrict__ cu_windows, const NsaParams params, const int n_sequences) {
    const FlashParams& fp = params.flash;
    compress_map_gradient(v, dv_cmp, dw, cu_k, cu_windows, params, n_sequences, fp.v_batch, fp.v_head, fp.v_row,
                          fp.dv);
}
