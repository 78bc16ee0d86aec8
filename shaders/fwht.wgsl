// The Hadamard fold's transform on rows of activations (format-pq2_0.md §5), out of place:
// forward (a folded matmul's input): optional GDN permutation tiled -> grouped, then x ⊙ s, then
// the normalized blockwise Walsh-Hadamard transform; inverse (after an embedding lookup): the
// transform, then ⊙ s. The transform is the CPU's exactly: scale by 1/sqrt(block) (passed in as
// bits, so it is the same f32), then butterflies (u+v, u-v) with len = 1, 2, ... in natural
// order; every value goes through the same operations, so the results are bit-identical.
//
// One workgroup per chunk of min(block, 1024) elements of a row, held in shared memory. Blocks
// larger than 1024 finish with one fwht_stage.wgsl pass per remaining len (1024 ... block/2).

struct Params {
    rows: u32,
    width: u32,
    // Elements per workgroup, min(block, 1024): butterflies run for len < chunk.
    chunk: u32,
    scale: f32,
    // 1: GDN permutation, 2: ⊙ s before the transform, 4: ⊙ s after it.
    flags: u32,
    hd: u32,
    nk: u32,
    rep: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
// ±1 per column; bound to x when the flags use none.
@group(0) @binding(2) var<storage, read> s: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

var<workgroup> buf: array<f32, FWHT_CHUNK>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let n_chunks = p.width / p.chunk;
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= p.rows * n_chunks) {
        return;
    }
    let row = (idx / n_chunks) * p.width;
    let base = (idx % n_chunks) * p.chunk;
    for (var i = lid; i < p.chunk; i += WG) {
        let g = base + i;
        var src = g;
        if ((p.flags & 1u) != 0u) {
            // grouped[i + hd*(r + rep*k)] = tiled[i + hd*(k + nk*r)]
            let head = g / p.hd;
            src = (head / p.rep + p.nk * (head % p.rep)) * p.hd + g % p.hd;
        }
        var v = x[row + src];
        if ((p.flags & 2u) != 0u) {
            v *= s[g];
        }
        buf[i] = v * p.scale;
    }
    workgroupBarrier();
    for (var len = 1u; len < p.chunk; len <<= 1u) {
        for (var q = lid; q < p.chunk / 2u; q += WG) {
            let i = (q / len) * 2u * len + q % len;
            let a = buf[i];
            let b = buf[i + len];
            buf[i] = a + b;
            buf[i + len] = a - b;
        }
        workgroupBarrier();
    }
    for (var i = lid; i < p.chunk; i += WG) {
        let g = base + i;
        var v = buf[i];
        if ((p.flags & 4u) != 0u) {
            v *= s[g];
        }
        y[row + g] = v;
    }
}
