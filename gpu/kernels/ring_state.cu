// Online-softmax states of query rows on the device, for the ring forward on GPUs (E11 with E2–E5), compiled by NVRTC
// after common.cuh (see gpu/src/ring/state.rs). A state is, per query row, m (the running max of the scaled scores),
// ℓ and the unnormalized accumulator A, in f32, exactly as flash_fwd.cu's STATE_OUT mode writes them: p and A are
// relative to 2^fl(m·L) with L = fl32(log2 e). Rows are LSE rows (dense [B, Hq, Lq], varlen [Hq, Tq]); A is
// [row][dv]. An empty row (no visible key yet) is m = −∞, ℓ = 0, A = 0.
//
// Kernels (one warp per row, lanes over columns):
//   state_merge     run ← run ⊕ part (E4): m = max(m₁, m₂), rᵢ = ex2(fl(fl(mᵢ·L) − fl(m·L))) (0 for an empty side),
//                   ℓ = fl(fl(r₁ℓ₁) + fl(r₂ℓ₂)), A likewise per column: one rescale of each side, as the forward's
//                   own tile step rescales its state, so a row's terms pass through at most one rescale per merge.
//   state_finalize  E5: O = round_T(A / ℓ) (IEEE division), LSE = m + logf(ℓ); an empty row gets O = 0, LSE = −∞.
// Both take their pointers and one RingStateParams (common.cuh): state_merge reads rows and dv, state_finalize all of
// it.

extern "C" __global__ void state_merge(float* __restrict__ a_run, float* __restrict__ m_run, float* __restrict__ l_run,
                                       const float* __restrict__ a_part, const float* __restrict__ m_part,
                                       const float* __restrict__ l_part, const RingStateParams params) {
    const long long rows = params.rows;
    const int dv = params.dv;
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float m1 = m_run[row], m2 = m_part[row];
    const float m = fmaxf(m1, m2);
    if (m == NEG_INF) return;  // both sides empty: the running state stays empty
    const float ml = __fmul_rn(m, LOG2E_F);
    const float r1 = m1 == NEG_INF ? 0.f : ex2_approx(__fsub_rn(__fmul_rn(m1, LOG2E_F), ml));
    const float r2 = m2 == NEG_INF ? 0.f : ex2_approx(__fsub_rn(__fmul_rn(m2, LOG2E_F), ml));
    for (int c = lane; c < dv; c += 32) {
        const long long at = row * dv + c;
        a_run[at] = __fadd_rn(__fmul_rn(r1, a_run[at]), __fmul_rn(r2, a_part[at]));
    }
    __syncwarp();  // every lane has read m_run[row] before lane 0 replaces it
    if (lane == 0) {
        l_run[row] = __fadd_rn(__fmul_rn(r1, l_run[row]), __fmul_rn(r2, l_part[row]));
        m_run[row] = m;
    }
}

// `o` in the spec's layout: dense [B, Hq, Lq, dv] (row r at r·dv), varlen [Tq, Hq, dv] (LSE row h·Tq + t at
// (t·Hq + h)·dv).
extern "C" __global__ void state_finalize(const float* __restrict__ a, const float* __restrict__ m,
                                          const float* __restrict__ l, elem_t* __restrict__ o,
                                          float* __restrict__ lse, const RingStateParams params) {
    const long long rows = params.rows;
    const int dv = params.dv;
    const int varlen = params.varlen;
    const int n_heads = params.n_heads;
    const long long rows_per_head = params.rows_per_head;
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float lf = l[row];
    const bool empty = !(lf > 0.f);
    const long long o_row = varlen ? (row % rows_per_head) * n_heads + row / rows_per_head : row;
    for (int c = lane; c < dv; c += 32) {
        o[o_row * dv + c] = to_elem(empty ? 0.f : __fdiv_rn(a[row * dv + c], lf));
    }
    if (lane == 0) lse[row] = empty ? NEG_INF : __fadd_rn(m[row], logf(lf));
}
