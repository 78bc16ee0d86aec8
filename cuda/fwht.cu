// The Hadamard fold's transform on rows of activations (port of shaders/fwht.wgsl;
// format-pq2_0.md §5), out of place: forward (a folded matmul's input): optional GDN permutation
// tiled -> grouped, then x ⊙ s, then the normalized blockwise Walsh-Hadamard transform; inverse
// (after an embedding lookup): the transform, then ⊙ s. The transform is the CPU's exactly:
// scale by 1/sqrt(block) (passed in as bits, so it is the same f32), then butterflies
// (u+v, u-v) with len = 1, 2, ... in natural order; every value goes through the same
// operations, so the results are bit-identical.
//
// One block per chunk of min(block, 1024) elements of a row, held in shared memory. Blocks
// larger than 1024 finish with one fwht_stage pass per remaining len (1024 ... block/2).
#include "common.cuh"


// flags: 1 GDN permutation, 2 ⊙ s before the transform, 4 ⊙ s after it. `s` (±1 per column)
// may be null when the flags use none.
extern "C" __global__ void __launch_bounds__(WG)
    fwht(const float* __restrict__ x, const float* __restrict__ s, float* __restrict__ y,
         u32 rows, u32 width, u32 chunk, float scale, u32 flags, u32 hd, u32 nk, u32 rep) {
    __shared__ float buf[FWHT_CHUNK];
    const u32 lid = threadIdx.x;
    const u32 n_chunks = width / chunk;
    const u32 idx = blockIdx.x;
    if (idx >= rows * n_chunks) {
        return;
    }
    const u64 row = (u64)(idx / n_chunks) * width;
    const u32 base = (idx % n_chunks) * chunk;
    for (u32 i = lid; i < chunk; i += WG) {
        const u32 g = base + i;
        u32 src = g;
        if ((flags & 1u) != 0u) {
            // grouped[i + hd*(r + rep*k)] = tiled[i + hd*(k + nk*r)]
            const u32 head = g / hd;
            src = (head / rep + nk * (head % rep)) * hd + g % hd;
        }
        float v = x[row + src];
        if ((flags & 2u) != 0u) {
            v = __fmul_rn(v, s[g]);
        }
        buf[i] = __fmul_rn(v, scale);
    }
    __syncthreads();
    for (u32 len = 1u; len < chunk; len <<= 1u) {
        for (u32 q = lid; q < chunk / 2u; q += WG) {
            const u32 i = (q / len) * 2u * len + q % len;
            const float a = buf[i];
            const float b = buf[i + len];
            buf[i] = a + b;
            buf[i + len] = a - b;
        }
        __syncthreads();
    }
    for (u32 i = lid; i < chunk; i += WG) {
        const u32 g = base + i;
        float v = buf[i];
        if ((flags & 4u) != 0u) {
            v = __fmul_rn(v, s[g]);
        }
        y[row + g] = v;
    }
}
