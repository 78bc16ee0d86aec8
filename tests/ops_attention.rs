//! Op-level tests of the gated attention core (with its KV cache in every dtype), argmax and
//! top-k, against the CPU reference, on every GPU backend (the CPU's own: tests/ops_cpu.rs).

mod common;

use common::{assert_close, cpu, weight, Rng};
use tern::backend::gpu::attention::{read_cache, topk_rows};
use tern::backend::gpu::{Device, GpuBackend};
use tern::backend::{rope_table, AttnParams, Backend, KvTypes};
use tern::tensor::GgmlType;

use GgmlType::{BF16, F16, F32, Q4_0, Q8_0};

/// f32 cache: the same math in another order (f32 tree sums where the reference sums in f64,
/// online softmax, polynomial sin/cos) differs by a few ulps per element: NMSE <= 3e-13 on
/// lavapipe. 1e-9 leaves room for other drivers without hiding a wrong value (one output
/// element off by its own size among the ~10^4 of a test costs ~1e-4).
const TOL_F32: f64 = 1e-9;
/// Quantized caches store exactly the reference's bytes for equal inputs (V is stored raw and
/// is checked byte for byte below), but the K rows carry the few-ulp differences above, and a K
/// element that sits on a rounding boundary of its dtype can land one step (a 16-bit ulp, or
/// one Q8_0/Q4_0 level) away: the worst seen on lavapipe is 1e-11 (bf16 K). Calibration on the
/// reference itself: perturbing its K by a relative 1e-6 (several times the discrepancy
/// above) moves its output by NMSE <= 3e-9 with f16/bf16 caches; by 1e-5, ~2e-8 with Q8_0/Q4_0
/// caches. A wrong kernel is off by >= 1e-4.
const TOL_16BIT: f64 = 1e-8;
const TOL_QUANT: f64 = 1e-7;

fn tol(types: KvTypes) -> f64 {
    let one = |t: GgmlType| match t {
        F32 => TOL_F32,
        F16 | BF16 => TOL_16BIT,
        _ => TOL_QUANT,
    };
    one(types.k).max(one(types.v))
}

fn attn_params(
    n_head: usize,
    n_head_kv: usize,
    hd: usize,
    n_rot: usize,
    sections: [i32; 4],
) -> AttnParams {
    AttnParams {
        n_head,
        n_head_kv,
        head_dim: hd,
        n_rot,
        rope_base: 10_000_000.0,
        rope_sections: sections,
        eps: 1e-6,
        scale: 1.0 / (hd as f32).sqrt(),
    }
}

/// Inputs of `n` tokens: qg `[n, 2*n_head*hd]`, k and v `[n, n_head_kv*hd]`, the norms.
struct Inputs {
    qg: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

fn inputs(p: &AttnParams, n: usize, seed: u64) -> Inputs {
    let mut rng = Rng(seed);
    let width = p.n_head_kv * p.head_dim;
    Inputs {
        qg: rng.vec(n * 2 * p.n_head * p.head_dim, 2.0),
        k: rng.vec(n * width, 2.0),
        v: rng.vec(n * width, 1.5),
        q_norm: rng
            .vec(p.head_dim, 1.0)
            .iter()
            .map(|x| 1.0 + 0.5 * x)
            .collect(),
        k_norm: rng
            .vec(p.head_dim, 1.0)
            .iter()
            .map(|x| 1.0 + 0.5 * x)
            .collect(),
    }
}

/// Runs consecutive batches of `batches[i]` tokens through one cache and returns every output
/// row, concatenated.
fn run<B: Backend>(
    be: &B,
    p: &AttnParams,
    types: KvTypes,
    x: &Inputs,
    batches: &[usize],
) -> Vec<f32> {
    let hd = p.head_dim;
    let qn = be.upload(&weight("q_norm", F32, hd, 1, &x.q_norm)).unwrap();
    let kn = be.upload(&weight("k_norm", F32, hd, 1, &x.k_norm)).unwrap();
    let mut kv = be.new_kv(p, types).unwrap();
    run_on(be, p, x, &qn, &kn, &mut kv, 0, batches)
}

#[allow(clippy::too_many_arguments)]
fn run_on<B: Backend>(
    be: &B,
    p: &AttnParams,
    x: &Inputs,
    qn: &B::W,
    kn: &B::W,
    kv: &mut B::Kv,
    start: usize,
    batches: &[usize],
) -> Vec<f32> {
    let (qw, kw) = (2 * p.n_head * p.head_dim, p.n_head_kv * p.head_dim);
    let mut out = Vec::new();
    let mut t0 = start;
    for &n in batches {
        let qg = be.from_host(&x.qg[t0 * qw..(t0 + n) * qw], n, qw);
        let k = be.from_host(&x.k[t0 * kw..(t0 + n) * kw], n, kw);
        let v = be.from_host(&x.v[t0 * kw..(t0 + n) * kw], n, kw);
        let pos0 = be.kv_len(kv);
        assert_eq!(pos0, t0);
        let rope = rope_table(pos0, n, p.n_rot, p.rope_base, p.rope_sections);
        let y = be.attention(p, &qg, &k, &v, qn, kn, kv, pos0, &rope);
        assert_eq!(be.kv_len(kv), t0 + n);
        out.extend(be.to_host(&y));
        t0 += n;
    }
    out
}

fn check<B: Backend>(
    be: &B,
    what: &str,
    p: &AttnParams,
    types: KvTypes,
    batches: &[usize],
    seed: u64,
) {
    let n: usize = batches.iter().sum();
    let x = inputs(p, n, seed);
    let ours = run(be, p, types, &x, batches);
    let want = run(&cpu(), p, types, &x, batches);
    let label = format!(
        "{what} heads {}/{} hd {} rot {} K {} V {} batches {batches:?} [{}]",
        p.n_head,
        p.n_head_kv,
        p.head_dim,
        p.n_rot,
        types.k,
        types.v,
        be.name()
    );
    assert_close(&label, &ours, &want, tol(types));
}

/// Geometries: partial and full rotation, GQA (4/2) and MQA (4/1), head_dim 32 and 256, with
/// sections that put every pair in t/h/w and ones that leave pairs in the fourth stream.
fn geometries() -> Vec<AttnParams> {
    vec![
        attn_params(4, 2, 32, 16, [3, 3, 2, 0]),
        attn_params(4, 1, 32, 32, [2, 2, 1, 3]),
        attn_params(4, 2, 256, 64, [11, 11, 10, 0]),
        attn_params(4, 1, 256, 256, [24, 24, 16, 0]),
        attn_params(4, 2, 32, 32, [0, 0, 0, 0]),
    ]
}

fn attention_f32<B: Backend>(be: &B) {
    let types = KvTypes { k: F32, v: F32 };
    for (i, p) in geometries().iter().enumerate() {
        for batches in [&[1][..], &[3], &[65], &[3, 1, 1, 1], &[65, 1, 1]] {
            check(be, "f32", p, types, batches, 100 + i as u64);
        }
    }
}

fn attention_kv_types<B: Backend>(be: &B) {
    let all = [F32, F16, BF16, Q8_0, Q4_0];
    let p = attn_params(4, 2, 32, 16, [3, 3, 2, 0]);
    for (i, &k) in all.iter().enumerate() {
        for (j, &v) in all.iter().enumerate() {
            check(
                be,
                "types",
                &p,
                KvTypes { k, v },
                &[65, 1, 1],
                200 + (i * 5 + j) as u64,
            );
        }
    }
    // The real geometry, quantized both ways and mixed.
    let p = attn_params(4, 2, 256, 64, [11, 11, 10, 0]);
    for (k, v) in [
        (Q8_0, Q8_0),
        (Q4_0, Q4_0),
        (F16, Q8_0),
        (BF16, Q4_0),
        (Q8_0, F16),
    ] {
        check(be, "types", &p, KvTypes { k, v }, &[3, 1, 1], 300);
        check(be, "types", &p, KvTypes { k, v }, &[1, 65], 301);
    }
}

/// Past the cache's first capacity (growth keeps the rows) and over several split-K chunks.
fn attention_long<B: Backend>(be: &B) {
    let p = attn_params(4, 1, 32, 16, [3, 3, 2, 0]);
    for (k, v) in [(F32, F32), (Q8_0, Q4_0), (F16, BF16)] {
        check(be, "long", &p, KvTypes { k, v }, &[200, 100, 1, 1], 400);
        check(be, "long", &p, KvTypes { k, v }, &[1; 300], 401);
    }
    let p = attn_params(4, 2, 256, 64, [11, 11, 10, 0]);
    check(be, "long", &p, KvTypes { k: F32, v: F32 }, &[600, 1], 402);
}

/// Rolling the cache back and re-running gives what a fresh cache gives, bit for bit.
fn kv_truncate<B: Backend>(be: &B) {
    for types in [KvTypes { k: F32, v: F32 }, KvTypes { k: Q8_0, v: Q4_0 }] {
        let p = attn_params(4, 2, 32, 32, [3, 3, 2, 0]);
        let x = inputs(&p, 20, 500);
        let y = inputs(&p, 20, 501);
        let qn = be.upload(&weight("q_norm", F32, 32, 1, &x.q_norm)).unwrap();
        let kn = be.upload(&weight("k_norm", F32, 32, 1, &x.k_norm)).unwrap();
        // Fresh: 8 tokens of x, then 5 of y at positions 8..13.
        let mut kv = be.new_kv(&p, types).unwrap();
        run_on(be, &p, &x, &qn, &kn, &mut kv, 0, &[8]);
        let fresh = run_on(be, &p, &y, &qn, &kn, &mut kv, 8, &[5, 1]);
        // Rolled back: 10 tokens of x and 3 decode steps, back to 8, then the same.
        let mut kv = be.new_kv(&p, types).unwrap();
        run_on(be, &p, &x, &qn, &kn, &mut kv, 0, &[10, 1, 1, 1]);
        be.kv_truncate(&mut kv, 8);
        assert_eq!(be.kv_len(&kv), 8);
        be.kv_truncate(&mut kv, 100);
        assert_eq!(be.kv_len(&kv), 8);
        let again = run_on(be, &p, &y, &qn, &kn, &mut kv, 8, &[5, 1]);
        assert_close(
            &format!("truncate K {} V {} [{}]", types.k, types.v, be.name()),
            &again,
            &fresh,
            0.0,
        );
    }
}

/// Rows with repeated maxima (ties go to the lowest index), negative rows, a lone column, and a
/// row wider than a workgroup's stripe many times over.
fn argmax<B: Backend>(be: &B) {
    let reference = cpu();
    let mut rng = Rng(600);
    for (rows, cols) in [(1, 1), (3, 7), (5, 300), (4, 70_000), (65, 64)] {
        // Few levels, so that ties are common.
        let mut x: Vec<f32> = (0..rows * cols)
            .map(|_| (rng.below(16) as f32 - 12.0) * 0.25)
            .collect();
        // Row 0: the maximum repeated at the end and the start.
        if cols > 2 {
            x[cols - 1] = 9.0;
            x[1] = 9.0;
            x[cols / 2] = 9.0;
        }
        let ours = be.argmax_rows(&be.from_host(&x, rows, cols));
        let want = reference.argmax_rows(&reference.from_host(&x, rows, cols));
        assert_eq!(ours, want, "argmax {rows}x{cols} [{}]", be.name());
    }
}

per_gpu_backend!(
    attention_f32,
    attention_kv_types,
    attention_long,
    kv_truncate,
    argmax,
    topk,
    cache_bytes_match_ggml,
);

/// The CPU's answer for top-k: sort by value descending, then index.
fn topk_reference(x: &[f32], cols: usize, k: usize) -> (Vec<u32>, Vec<f32>) {
    let mut ids = Vec::new();
    let mut vals = Vec::new();
    for row in x.chunks(cols) {
        let mut idx: Vec<usize> = (0..cols).collect();
        idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        ids.extend(idx[..k].iter().map(|&i| i as u32));
        vals.extend(idx[..k].iter().map(|&i| row[i]));
    }
    (ids, vals)
}

fn topk<D: Device>(be: &GpuBackend<D>) {
    let mut rng = Rng(700);
    for (rows, cols) in [
        (1, 1),
        (2, 64),
        (3, 1000),
        (2, 5000),
        (1, 150_000),
        (4, 1025),
    ] {
        // Coarse values: many ties, broken by the lower index.
        let x: Vec<f32> = (0..rows * cols)
            .map(|_| (rng.below(512) as f32 - 256.0) / 16.0)
            .collect();
        for k in [1, 5, 64] {
            if k > cols {
                continue;
            }
            let (ids, vals) = topk_rows(be, &be.from_host(&x, rows, cols), k);
            let (want_ids, want_vals) = topk_reference(&x, cols, k);
            assert_eq!(
                ids,
                want_ids,
                "topk ids {rows}x{cols} k {k} [{}]",
                be.name()
            );
            assert_eq!(
                vals,
                want_vals,
                "topk values {rows}x{cols} k {k} [{}]",
                be.name()
            );
        }
    }
}

/// V rows go into the cache untransformed, so the stored bytes must be exactly ggml's
/// reference quantization of them (`quant::quantize_row`), for every cache dtype, including a
/// row whose byte size is not a multiple of 4 (one Q8_0 or Q4_0 block per row).
fn cache_bytes_match_ggml<D: Device>(be: &GpuBackend<D>) {
    for (n_head_kv, hd) in [(1, 32), (3, 32), (2, 256)] {
        let p = attn_params(n_head_kv, n_head_kv, hd, 16, [3, 3, 2, 0]);
        let mut x = inputs(&p, 9, 800);
        // Values of every size, including tiny ones (subnormal f16 scales) and zeros.
        let width = n_head_kv * hd;
        for (i, v) in x.v.iter_mut().enumerate() {
            match (i / width) % 3 {
                1 => *v *= 1e-6,
                2 if i % 7 == 0 => *v = 0.0,
                _ => {}
            }
        }
        // Row 0: a zero block, then values on the rounding boundaries of every dtype: Q8_0
        // and Q4_0 blocks with scale 1 and x.5 levels (C's roundf rounds them away from zero;
        // Q4_0 truncates x + 8.5), f16 and bf16 ties (to even) and f16 subnormal ties.
        x.v[..32].iter_mut().for_each(|v| *v = 0.0);
        let q8: Vec<f32> = (0..32)
            .map(|j| if j == 0 { 127.0 } else { j as f32 * 0.5 - 8.0 })
            .collect();
        let q4: Vec<f32> = (0..32)
            .map(|j| {
                if j == 5 {
                    -8.0
                } else {
                    (j % 16) as f32 * 0.5 - 4.0
                }
            })
            .collect();
        let e = 2f32.powi(-11);
        let b = 2f32.powi(-8);
        let s = 2f32.powi(-25);
        let ties: Vec<f32> = (0..32)
            .map(|j| match j % 8 {
                0 => 1.0 + e,
                1 => 1.0 + 3.0 * e,
                2 => -(2.0 + 2.0 * e),
                3 => 1.0 + b,
                4 => 1.0 + 3.0 * b,
                5 => s,
                6 => 3.0 * s,
                _ => 65520.0,
            })
            .collect();
        let mut row0 = [q8, q4, ties].concat();
        row0.truncate(width - 32);
        x.v[32..32 + row0.len()].copy_from_slice(&row0);
        for ty in [F32, F16, BF16, Q8_0, Q4_0] {
            let types = KvTypes { k: ty, v: ty };
            let qn = be.upload(&weight("q_norm", F32, hd, 1, &x.q_norm)).unwrap();
            let kn = be.upload(&weight("k_norm", F32, hd, 1, &x.k_norm)).unwrap();
            let mut kv = be.new_kv(&p, types).unwrap();
            run_on(be, &p, &x, &qn, &kn, &mut kv, 0, &[4, 5]);
            let (_, v_bytes) = read_cache(be, &kv);
            let mut want = Vec::new();
            for row in x.v.chunks(width) {
                want.extend(tern::quant::quantize_row(ty, row).unwrap());
            }
            let bad = v_bytes.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(v_bytes.len(), want.len(), "{ty} cache length");
            assert_eq!(
                bad,
                0,
                "{ty} width {width}: {bad} of {} cache bytes differ from ggml's [{}]",
                want.len(),
                be.name()
            );
        }
    }
}
