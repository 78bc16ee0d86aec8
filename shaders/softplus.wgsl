// softplus as ggml computes it: x above 20 as it is, else log1p(exp(x)). Included by gdn_step
// and gdn_chunk_prep (cuda/common.cuh holds the port).

fn softplus(x: f32) -> f32 {
    if (x > 20.0) {
        return x;
    }
    let e = exp(x);
    // log1p(e): the series where 1 + e would lose e's digits.
    if (e < 1e-3) {
        return e * (1.0 - e * (0.5 - e / 3.0));
    }
    return log(1.0 + e);
}
