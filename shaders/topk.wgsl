// One pass of per-row top-k (k <= 64): each invocation owns segment s of a row, the items
// s, s + g, s + 2g, ... of its n items (adjacent invocations read adjacent items), keeps a
// sorted list of the best k by insertion, and writes it to out[row][s][0..k]. The host repeats
// the pass on the lists until one segment per row is left; that list is the answer, sorted by
// value descending, ties to the lower id. Slots past the number of items hold id 0xffffffff,
// which later passes skip.
struct Params {
    rows: u32,
    // Items per input row.
    n: u32,
    // Segments (output lists) per row.
    g: u32,
    k: u32,
    // 0: the input is a plain row, the id is the column; 1: ids come with the values.
    has_ids: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> xv: array<f32>;
@group(0) @binding(2) var<storage, read> xi: array<u32>;
@group(0) @binding(3) var<storage, read_write> ov: array<f32>;
@group(0) @binding(4) var<storage, read_write> oi: array<u32>;

const NONE: u32 = 0xffffffffu;

var<private> lv: array<f32, KMAX>;
var<private> li: array<u32, KMAX>;

fn better(av: f32, ai: u32, bv: f32, bi: u32) -> bool {
    return av > bv || (av == bv && ai < bi);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let u = (wid.x + wid.y * nwg.x) * 64u + lid.x;
    if (u >= p.rows * p.g) {
        return;
    }
    let r = u / p.g;
    let s = u % p.g;
    let k = p.k;
    var cnt = 0u;
    for (var i = s; i < p.n; i += p.g) {
        let v = xv[r * p.n + i];
        var id = i;
        if (p.has_ids != 0u) {
            id = xi[r * p.n + i];
            if (id == NONE) {
                continue;
            }
        }
        var pos = cnt;
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
    let out = u * k;
    for (var j = 0u; j < k; j++) {
        if (j < cnt) {
            ov[out + j] = lv[j];
            oi[out + j] = li[j];
        } else {
            ov[out + j] = 0.0;
            oi[out + j] = NONE;
        }
    }
}
