// The sum over a workgroup of one f32 per invocation, by a fixed tree (the same order every
// time, and the same as cuda/common.cuh's block_sum). Included by rms_norm, gdn_gated_norm,
// attn_prep and gdn_conv. Every invocation of the workgroup calls it; it ends with a barrier,
// so it may be called again (once per token in gdn_conv).

var<workgroup> partial: array<f32, WG>;

fn workgroup_sum(lid: u32, v: f32) -> f32 {
    partial[lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
        }
        workgroupBarrier();
    }
    let sum = partial[0];
    workgroupBarrier();
    return sum;
}
