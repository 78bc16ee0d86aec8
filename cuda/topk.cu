// One pass of per-row top-k, k <= 64 (port of shaders/topk.wgsl): each thread owns segment s of a
// row, the items s, s + g, s + 2g, ... of its n items (adjacent threads read adjacent items),
// keeps a sorted list of the best k by insertion, and writes it to out[row][s][0..k]. The host
// repeats the pass on the lists until one segment per row is left; that list is the answer,
// sorted by value descending, ties to the lower id. Slots past the number of items hold id
// 0xffffffff, which later passes skip. `xi` is read only when has_ids (else the id is the
// column) and may be null otherwise.
#include "common.cuh"

#define NONE 0xffffffffu

__device__ __forceinline__ bool better(float av, u32 ai, float bv, u32 bi) {
    return av > bv || (av == bv && ai < bi);
}

extern "C" __global__ void __launch_bounds__(WG)
    topk(const float* __restrict__ xv, const u32* __restrict__ xi, float* __restrict__ ov,
         u32* __restrict__ oi, u32 rows, u32 n, u32 g, u32 k, u32 has_ids) {
    float lv[KMAX];
    u32 li[KMAX];
    const u64 u = (u64)blockIdx.x * WG + threadIdx.x;
    if (u >= (u64)rows * g) {
        return;
    }
    const u64 r = u / g;
    const u32 s = (u32)(u % g);
    u32 cnt = 0u;
    for (u32 i = s; i < n; i += g) {
        const float v = xv[r * n + i];
        u32 id = i;
        if (has_ids != 0u) {
            id = xi[r * n + i];
            if (id == NONE) {
                continue;
            }
        }
        u32 pos = cnt;
        if (cnt < k) {
            cnt += 1u;
        } else if (better(v, id, lv[k - 1u], li[k - 1u])) {
            pos = k - 1u;
        } else {
            continue;
        }
        while (pos > 0u && better(v, id, lv[pos - 1u], li[pos - 1u])) {
            lv[pos] = lv[pos - 1u];
            li[pos] = li[pos - 1u];
            pos -= 1u;
        }
        lv[pos] = v;
        li[pos] = id;
    }
    const u64 out = u * k;
    for (u32 j = 0u; j < k; j++) {
        if (j < cnt) {
            ov[out + j] = lv[j];
            oi[out + j] = li[j];
        } else {
            ov[out + j] = 0.0f;
            oi[out + j] = NONE;
        }
    }
}
