// f32 -> f16 conversion, bit-exact: included by kv_store (the cache stores) and gelu (the index
// into ggml's f16 table). WGSL's own pack2x16float may round either way.

// IEEE binary32 -> binary16 bits, round to nearest even (half::f16::from_f32), subnormals kept.
fn f32_to_f16(x: f32) -> u32 {
    let u = bitcast<u32>(x);
    let sign = (u >> 16u) & 0x8000u;
    let a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return sign | 0x7e00u | ((a >> 13u) & 0x3ffu);
    }
    if (a >= 0x477ff000u) {
        return sign | 0x7c00u;
    }
    if (a >= 0x38800000u) {
        let r = a - 0x38000000u + 0xfffu + ((a >> 13u) & 1u);
        return sign | (r >> 13u);
    }
    let e = a >> 23u;
    if (e < 102u) {
        return sign;
    }
    // Subnormal half: round |x| / 2^-24 to an integer, ties to even.
    let m = (a & 0x7fffffu) | 0x800000u;
    let s = 126u - e;
    var q = m >> s;
    let rem = m & ((1u << s) - 1u);
    let half = 1u << (s - 1u);
    if (rem > half || (rem == half && (q & 1u) == 1u)) {
        q += 1u;
    }
    return sign | q;
}
