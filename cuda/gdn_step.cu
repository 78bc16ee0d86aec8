// Gated DeltaNet recurrence, token by token (port of shaders/gdn_step.wgsl; the decode form, and
// the reference form for any number of tokens). Per token and V head j (K head kh = j % n_k,
// tiled order):
//   beta = sigmoid(b_j), g = ssm_a[j] * softplus(a_j + dt_bias[j]), S *= exp(g),
//   kv = S^T k, S += k (x) beta (v - kv), o = S^T q (after the update).
// S is [d_k][d_v] per head, v fastest. Columns of S are independent, so one block takes one head
// and a block of CB columns (grid (n_v, ceil(D / CB))); thread (rg, c) keeps rows i = rg + R m of
// column c in registers across the whole token loop, and the R partial sums of S^T k and S^T q
// are combined in shared memory. o is written pre-norm ([rows][n_v D]); gdn_gated_norm follows.
// q and k arrive L2-normalised (q scaled) from gdn_conv. The head size D, CB, R and WG come
// with the kernel (backend::gpu::kernels).
#include "common.cuh"

#define NR ((D + R - 1u) / R)

extern "C" __global__ void __launch_bounds__(WG)
    gdn_step(const float* __restrict__ u, const float* __restrict__ b, const float* __restrict__ a,
             const float* __restrict__ dt_bias, const float* __restrict__ ssm_a,
             float* __restrict__ s, float* __restrict__ o, u32 rows, u32 n_k, u32 n_v, u32 cd) {
    __shared__ float kq[2u * D];  // k, then q, of the current token
    __shared__ float red[R * CB];
    const u32 lid = threadIdx.x;
    const u32 j = blockIdx.x;
    const u32 c = lid % CB;
    const u32 rg = lid / CB;
    const u32 col = blockIdx.y * CB + c;
    const bool valid = col < D;
    const u32 kh = j % n_k;
    const u64 sbase = (u64)j * D * D;

    float st[NR];
#pragma unroll
    for (u32 m = 0; m < NR; m++) {
        const u32 i = rg + R * m;
        st[m] = 0.0f;
        if (valid && i < D) {
            st[m] = s[sbase + (u64)i * D + col];
        }
    }

    const u64 ow = (u64)n_v * D;
    for (u32 t = 0; t < rows; t++) {
        const u64 ub = (u64)t * cd;
        for (u32 x = lid; x < D; x += CB * R) {
            kq[x] = u[ub + (u64)n_k * D + kh * D + x];
            kq[D + x] = u[ub + kh * D + x];
        }
        __syncthreads();
        const float beta = 1.0f / (1.0f + expf(-b[(u64)t * n_v + j]));
        const float g = ssm_a[j] * softplus(a[(u64)t * n_v + j] + dt_bias[j]);
        const float decay = expf(g);

        float part = 0.0f;
#pragma unroll
        for (u32 m = 0; m < NR; m++) {
            const u32 i = rg + R * m;
            if (i < D) {
                st[m] *= decay;
                part += st[m] * kq[i];
            }
        }
        red[rg * CB + c] = part;
        __syncthreads();
        float kv = 0.0f;
#pragma unroll
        for (u32 r = 0; r < R; r++) {
            kv += red[r * CB + c];
        }
        float v = 0.0f;
        if (valid) {
            v = u[ub + 2ull * n_k * D + (u64)j * D + col];
        }
        const float delta = beta * (v - kv);
        __syncthreads();

        float po = 0.0f;
#pragma unroll
        for (u32 m = 0; m < NR; m++) {
            const u32 i = rg + R * m;
            if (i < D) {
                st[m] += kq[i] * delta;
                po += st[m] * kq[D + i];
            }
        }
        red[rg * CB + c] = po;
        __syncthreads();
        if (rg == 0u && valid) {
            float acc = 0.0f;
#pragma unroll
            for (u32 r = 0; r < R; r++) {
                acc += red[r * CB + c];
            }
            o[(u64)t * ow + (u64)j * D + col] = acc;
        }
        // kq and red are rewritten by the next token.
        __syncthreads();
    }

#pragma unroll
    for (u32 m = 0; m < NR; m++) {
        const u32 i = rg + R * m;
        if (valid && i < D) {
            s[sbase + (u64)i * D + col] = st[m];
        }
    }
}
