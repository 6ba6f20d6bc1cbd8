// NSA's gates (E18), compiled by NVRTC (see gpu/src/compile.rs) after common.cuh: the gated sum of the three branch
// outputs and its gradients. The rule is the oracle's (oracle/src/nsa.rs, `gate_combine` and
// `gate_combine_backward`); the host wrapper is gpu/src/nsa/gates.rs and the rounding-error bounds of this recipe are
// proofs/src/nsa_bound.rs's `gate_combine_bound` and `gate_backward_bounds`.
//
// Every tensor is read as rows: the branch outputs o_cmp, o_slc, o_win, the output O, the upstream gradient dO and the
// branches' gradients dO_b share O's layout ([B, Hq, L, dv] or packed [T, Hq, dv]: NsaParams::rows rows of dv
// elements), and the gate logits x (storage type) and their gradients dx (f32) have one row of 3 per O row, in the
// branch order compressed, selected, window. One warp owns a row: lane i < dv / 8 its columns 8i .. 8i + 7.
//
//   nsa_gate_combine    O = Σ_b σ(x_b) o_b
//   nsa_gate_backward   dO_b = σ(x_b) dO and dx_b = σ(x_b) σ(−x_b) ⟨dO, o_b⟩
//
// Recipe (the bounds' model): σ(x) = 1 / (1 + expf(−x)) in f32 (IEEE division; expf, not the approximate __expf);
// σ'(x) = σ(x) σ(−x), each factor from its own expf, so that a gate near 1 loses nothing to 1 − σ; the sum
// acc = σ_0 o_0, then fmaf(σ_1, o_1, acc), then fmaf(σ_2, o_2, acc), rounded once to the storage type; dO_b = σ_b dO
// rounded once; the dot product ⟨dO, o_b⟩ in f32, each lane's 8 columns in ascending order by fmaf, then the lanes
// by a fixed xor-shuffle tree, so every run gives the same bits.

#define GATE_WARPS 4

__device__ __forceinline__ float gate_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The 8 columns of `row` at lane `lane` of a [rows, dv] tensor, widened to f32.
__device__ __forceinline__ void load8(const elem_t* __restrict__ t, long long row, int dv, int lane, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(t + row * dv + lane * 8);
    const elem_t* e8 = reinterpret_cast<const elem_t*>(&raw);
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = to_f32(e8[e]);
}

__device__ __forceinline__ void store8(elem_t* __restrict__ t, long long row, int dv, int lane, const float* in) {
    __align__(16) elem_t result[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) result[e] = to_elem(in[e]);
    *reinterpret_cast<uint4*>(t + row * dv + lane * 8) = *reinterpret_cast<const uint4*>(result);
}

extern "C" __global__ void __launch_bounds__(GATE_WARPS * 32)
nsa_gate_combine(const elem_t* __restrict__ o_cmp, const elem_t* __restrict__ o_slc, const elem_t* __restrict__ o_win,
                 const elem_t* __restrict__ logits, elem_t* __restrict__ o, const NsaParams params) {
    const long long row = (long long)blockIdx.x * GATE_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32, dv = params.flash.dv;
    if (row >= params.rows || lane >= dv / 8) return;
    const elem_t* branches[3] = {o_cmp, o_slc, o_win};
    float acc[8];
    for (int b = 0; b < 3; ++b) {
        const float g = gate_sigmoid(to_f32(logits[row * 3 + b]));
        float x[8];
        load8(branches[b], row, dv, lane, x);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = b == 0 ? g * x[e] : fmaf(g, x[e], acc[e]);
    }
    store8(o, row, dv, lane, acc);
}

extern "C" __global__ void __launch_bounds__(GATE_WARPS * 32)
nsa_gate_backward(const elem_t* __restrict__ o_cmp, const elem_t* __restrict__ o_slc,
                  const elem_t* __restrict__ o_win, const elem_t* __restrict__ logits,
                  const elem_t* __restrict__ d_out, elem_t* __restrict__ d_cmp, elem_t* __restrict__ d_slc,
                  elem_t* __restrict__ d_win, float* __restrict__ d_logits, const NsaParams params) {
    const long long row = (long long)blockIdx.x * GATE_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32, dv = params.flash.dv;
    // Whole warps leave together: the shuffles below need every lane of a row's warp.
    if (row >= params.rows) return;
    const bool owns = lane < dv / 8;
    const elem_t* branches[3] = {o_cmp, o_slc, o_win};
    elem_t* grads[3] = {d_cmp, d_slc, d_win};
    float dy[8];
    if (owns) load8(d_out, row, dv, lane, dy);
    for (int b = 0; b < 3; ++b) {
        const float x = to_f32(logits[row * 3 + b]);
        const float g = gate_sigmoid(x);
        float dot = 0.0f;
        if (owns) {
            float y[8], dob[8];
            load8(branches[b], row, dv, lane, y);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                dot = fmaf(dy[e], y[e], dot);
                dob[e] = g * dy[e];
            }
            store8(grads[b], row, dv, lane, dob);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        if (lane == 0) d_logits[row * 3 + b] = g * gate_sigmoid(-x) * dot;
    }
}

// The layer's gradient sum (gpu/src/nsa/layer.rs): dQ, dK and dV of the layer are each the sum of the three branches'
// gradients, which meet here as they meet in the forward's gated sum. `nsa_branch_sum` adds three tensors of `n`
// storage-type elements, element by element, in the fixed order compressed, selected, window: f32 additions
// fl32(fl32(a + b) + c) (round to nearest, never contracted: __fadd_rn), rounded once to the storage type. Every
// element is independent, so any thread layout gives the same bits; the bound is proofs/src/nsa_bound.rs's
// `branch_sum_bound`. A grid-stride loop over 64-bit indices, so that one launch covers any `n`.

#define BRANCH_SUM_THREADS 256

extern "C" __global__ void __launch_bounds__(BRANCH_SUM_THREADS)
nsa_branch_sum(const elem_t* __restrict__ cmp, const elem_t* __restrict__ slc, const elem_t* __restrict__ win,
               elem_t* __restrict__ out, const long long n) {
    const long long stride = (long long)gridDim.x * BRANCH_SUM_THREADS;
    for (long long i = (long long)blockIdx.x * BRANCH_SUM_THREADS + threadIdx.x; i < n; i += stride) {
        const float partial = __fadd_rn(to_f32(cmp[i]), to_f32(slc[i]));
        out[i] = to_elem(__fadd_rn(partial, to_f32(win[i])));
    }
}
