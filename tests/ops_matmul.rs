//! Op-level tests of `matmul` (every weight dtype, folded or not) and `embed` (with the inverse
//! rule) against the CPU reference, on every GPU backend; plus checks of the Hadamard transform
//! on its own and of weights split into several parts. (The CPU itself: tests/ops_cpu.rs; the
//! kernel sources: tests/shaders.rs and tests/cuda_kernels.rs.)

mod common;

use common::{assert_close, cpu, hadamard, weight, with_fold, Rng};
use tern::backend::gpu::{matmul::fold_input, Device, GpuBackend};
use tern::backend::{Backend, Fold, WeightSource};
use tern::quant::hadamard::GdnPermutation;
use tern::tensor::GgmlType;

/// matmul: the kernels decode exactly the values the reference decodes (level times scale, one
/// rounding) and the fold's transform is bit-identical (see `fwht_bit_exact`), so what is left is
/// f32 sums in a different order (and possibly fused multiply-adds): rounding only.
const TOL: f64 = 1e-10;

/// embed: the same decoded values and, for the inverse rule, the same float operations in the
/// same order as the reference: bit-identical.
const EXACT: f64 = 0.0;

/// Token counts: decode, a partial and a full matvec token group, the smallest tiled case, and
/// two full 32-token tiles + 1 (chunk + 1).
const TOKENS: [usize; 5] = [1, 3, 4, 5, 65];

/// Input widths per dtype: one block, a few blocks, many; odd widths (and a width small enough
/// for the dense f32 path, ne0 <= 8) for the float types, which have no blocks.
fn widths(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => &[7, 100, 1030],
        GgmlType::Q8_0 | GgmlType::Q4_0 => &[32, 96, 1024],
        _ => &[128, 384, 1024, 2048],
    }
}

fn compare_matmul<B: Backend>(
    be: &B,
    what: &str,
    w: &WeightSource,
    n_tok: usize,
    rng: &mut Rng,
    tol: f64,
) {
    let reference = cpu();
    let (ne0, rows) = w.shape2();
    let x = rng.vec(n_tok * ne0, 1.0);
    let ours = be.to_host(&be.matmul(&be.upload(w).unwrap(), &be.from_host(&x, n_tok, ne0)));
    let want = reference.to_host(&reference.matmul(
        &reference.upload(w).unwrap(),
        &reference.from_host(&x, n_tok, ne0),
    ));
    assert_close(
        &format!("matmul {what} {ne0}->{rows} x{n_tok} [{}]", be.name()),
        &ours,
        &want,
        tol,
    );
}

/// A weight of type `ty`. The GGUF writer has no way to say type 42 is the legacy PrismML layout
/// (the reader infers it from byte spans), so Q2_0Legacy is made as PQ2_0 bytes relabelled.
fn typed_weight(name: &str, ty: GgmlType, ne0: usize, rows: usize, data: &[f32]) -> WeightSource {
    if ty == GgmlType::Q2_0Legacy {
        let mut w = weight(name, GgmlType::PQ2_0, ne0, rows, data);
        w.info.ty = GgmlType::Q2_0Legacy;
        return w;
    }
    weight(name, ty, ne0, rows, data)
}

fn matmul_dtype<B: Backend>(be: &B, ty: GgmlType, seed: u64) {
    let mut rng = Rng(seed);
    for &ne0 in widths(ty) {
        for (i, &n_out) in [7usize, 33, 130].iter().enumerate() {
            let w = typed_weight(
                "blk.0.ffn_up.weight",
                ty,
                ne0,
                n_out,
                &rng.vec(ne0 * n_out, 1.0),
            );
            // Every token count on one output count, a spread on the others.
            let toks: &[usize] = if i == 1 { &TOKENS } else { &[1, 65] };
            for &n_tok in toks {
                compare_matmul(be, &format!("{ty}"), &w, n_tok, &mut rng, TOL);
            }
        }
    }
}

fn matmul_f32<B: Backend>(be: &B) {
    matmul_dtype(be, GgmlType::F32, 21)
}
fn matmul_f16<B: Backend>(be: &B) {
    matmul_dtype(be, GgmlType::F16, 22)
}
fn matmul_bf16<B: Backend>(be: &B) {
    matmul_dtype(be, GgmlType::BF16, 23)
}
fn matmul_q8_0<B: Backend>(be: &B) {
    matmul_dtype(be, GgmlType::Q8_0, 24)
}
fn matmul_q4_0<B: Backend>(be: &B) {
    matmul_dtype(be, GgmlType::Q4_0, 25)
}
fn matmul_pq2_0<B: Backend>(be: &B) {
    matmul_dtype(be, GgmlType::PQ2_0, 26);
    // Same bytes under the legacy type id.
    matmul_dtype(be, GgmlType::Q2_0Legacy, 27);
}
fn matmul_ptq1_0<B: Backend>(be: &B) {
    matmul_dtype(be, GgmlType::PTQ1_0, 28)
}

/// More output rows than one dispatch dimension holds (65,535 workgroups): the matvec grid
/// spreads over x and y.
fn matmul_many_outputs<B: Backend>(be: &B) {
    let mut rng = Rng(29);
    let (ne0, n_out) = (32, 66_000);
    let w = weight(
        "output.weight",
        GgmlType::Q4_0,
        ne0,
        n_out,
        &rng.vec(ne0 * n_out, 1.0),
    );
    for n_tok in [1, 5] {
        compare_matmul(be, "Q4_0", &w, n_tok, &mut rng, TOL);
    }
}

/// One folded-weight case: the config's block and the weight's width, explicit or identity
/// signs, the GDN permutation if any, and the weight dtypes to try.
struct FoldCase {
    block: usize,
    ne0: usize,
    explicit: bool,
    perm: Option<GdnPermutation>,
    types: &'static [GgmlType],
}

/// Folded weights: blocks of 64, one full 1024 block and two, a 2048 block (past one workgroup's
/// shared memory), identity signs, and an ssm_out-style weight with the GDN permutation.
fn matmul_folded<B: Backend>(be: &B) {
    use GgmlType::*;
    let mut rng = Rng(31);
    let case = |block, ne0, explicit, perm, types| FoldCase {
        block,
        ne0,
        explicit,
        perm,
        types,
    };
    let cases = [
        case(64, 384, true, None, &[F32, Q8_0, PQ2_0, PTQ1_0]),
        case(1024, 1024, true, None, &[F32, PQ2_0]),
        case(1024, 2048, true, None, &[Q4_0, PTQ1_0]),
        case(2048, 4096, true, None, &[F32, PQ2_0]),
        case(128, 256, false, None, &[BF16, PQ2_0]),
        // hd 32, nk 2, rep 2: 4 V heads in 2 key groups.
        case(
            64,
            128,
            true,
            Some(GdnPermutation::new(128, 4, 2).unwrap()),
            &[F32, PQ2_0],
        ),
    ];
    for c in cases {
        let h = hadamard(c.block, &[c.ne0], c.explicit, (c.block + c.ne0) as u64);
        for &ty in c.types {
            let n_out = 33;
            let w = weight(
                "blk.0.ssm_out.weight",
                ty,
                c.ne0,
                n_out,
                &rng.vec(c.ne0 * n_out, 1.0),
            );
            let w = with_fold(w, &h, c.perm);
            let what = format!(
                "{ty} fold {}{}{}",
                c.block,
                if c.explicit { "" } else { " identity" },
                if c.perm.is_some() { " gdn" } else { "" }
            );
            for n_tok in [1, 3, 65] {
                compare_matmul(be, &what, &w, n_tok, &mut rng, TOL);
            }
        }
    }
}

fn compare_embed<B: Backend>(be: &B, what: &str, table: &WeightSource, ids: &[u32], tol: f64) {
    let reference = cpu();
    let ours = be.to_host(&be.embed(&be.upload(table).unwrap(), ids));
    let want = reference.to_host(&reference.embed(&reference.upload(table).unwrap(), ids));
    let (ne0, rows) = table.shape2();
    assert_close(
        &format!("embed {what} {rows}x{ne0} [{}]", be.name()),
        &ours,
        &want,
        tol,
    );
}

fn embed_dtypes<B: Backend>(be: &B) {
    let mut rng = Rng(41);
    let ids = [0u32, 49, 3, 3, 17, 48, 0];
    for ty in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::PQ2_0,
        GgmlType::Q2_0Legacy,
        GgmlType::PTQ1_0,
    ] {
        for &ne0 in widths(ty) {
            if ne0 <= 8 {
                continue; // the dense path is for vectors, not tables
            }
            let t = typed_weight("token_embd.weight", ty, ne0, 50, &rng.vec(ne0 * 50, 1.0));
            compare_embed(be, &format!("{ty}"), &t, &ids, EXACT);
        }
    }
}

/// Tables stored with the inverse rule: blocks of 64, a full 1024 block, a 2048 block (the signs
/// come after the last global stage), and identity signs.
fn embed_inverse<B: Backend>(be: &B) {
    let mut rng = Rng(42);
    let ids = [5u32, 0, 31, 5, 12];
    for (block, ne0, explicit, ty) in [
        (64, 384, true, GgmlType::PQ2_0),
        (64, 384, true, GgmlType::Q8_0),
        (1024, 2048, true, GgmlType::F16),
        (1024, 1024, true, GgmlType::PTQ1_0),
        (2048, 4096, true, GgmlType::PQ2_0),
        (128, 256, false, GgmlType::F32),
    ] {
        let h = hadamard(block, &[ne0], explicit, 7 + block as u64);
        let mut t = weight("token_embd.weight", ty, ne0, 32, &rng.vec(ne0 * 32, 1.0));
        t.inverse = Some(h);
        compare_embed(be, &format!("{ty} inverse {block}"), &t, &ids, EXACT);
    }
}

per_gpu_backend!(
    matmul_f32,
    matmul_f16,
    matmul_bf16,
    matmul_q8_0,
    matmul_q4_0,
    matmul_pq2_0,
    matmul_ptq1_0,
    matmul_many_outputs,
    matmul_folded,
    embed_dtypes,
    embed_inverse,
    fwht_bit_exact,
    split_parts,
);

/// The forward transform alone (`fold_input`) against `Fold::apply`, and the inverse against
/// `inverse_in_place`: same scale, same butterflies in the same order, so bit-identical.
fn fwht_bit_exact<D: Device>(be: &GpuBackend<D>) {
    let mut rng = Rng(51);
    for (block, width, explicit, perm) in [
        (64, 128, true, Some(GdnPermutation::new(128, 4, 2).unwrap())),
        (64, 384, true, None),
        (128, 256, false, None),
        (1024, 1024, true, None),
        (1024, 3072, true, None),
        (2048, 4096, true, None),
        (4096, 8192, true, None),
    ] {
        let h = hadamard(block, &[width], explicit, 3 * block as u64);
        let w = with_fold(
            weight(
                "blk.0.ffn_down.weight",
                GgmlType::F32,
                width,
                2,
                &rng.vec(2 * width, 1.0),
            ),
            &h,
            perm,
        );
        let gw = be.upload(&w).unwrap();
        let fold = Fold {
            hadamard: h.clone(),
            perm,
        };
        for rows in [1, 3] {
            let x = rng.vec(rows * width, 2.0);
            let xt = be.from_host(&x, rows, width);
            let ours = be.to_host(&fold_input(be, &xt, gw.fold.as_ref().unwrap(), false));
            let mut want = x.clone();
            let mut scratch = Vec::new();
            want.chunks_mut(width)
                .for_each(|r| fold.apply(r, &mut scratch));
            assert_close(
                &format!("fwht forward block {block} width {width} x{rows}"),
                &ours,
                &want,
                0.0,
            );
            assert_eq!(be.to_host(&xt), x, "the input must not be modified");

            let inv = be
                .upload(&WeightSource {
                    inverse: Some(h.clone()),
                    fold: None,
                    ..w.clone()
                })
                .unwrap();
            let ours = be.to_host(&fold_input(be, &xt, inv.inverse.as_ref().unwrap(), true));
            let mut want = x.clone();
            want.chunks_mut(width).for_each(|r| h.inverse_in_place(r));
            assert_close(
                &format!("fwht inverse block {block} width {width} x{rows}"),
                &ours,
                &want,
                0.0,
            );
        }
    }
}

/// Weights in several parts, as `upload` splits those above the binding limit: each part's
/// dispatch writes its own output columns, and the embedding picks the part per row. Rows of
/// 102 bytes (Q8_0 at 96) make every part boundary fall off 4-byte alignment in the source.
fn split_parts<D: Device>(be: &GpuBackend<D>) {
    let reference = cpu();
    let mut rng = Rng(61);
    let h = hadamard(64, &[384], true, 62);
    for (ty, ne0, n_out, per_part, fold) in [
        (GgmlType::Q8_0, 96, 33, 7, false),
        (GgmlType::PTQ1_0, 384, 130, 64, true),
        (GgmlType::F16, 100, 20, 1, false),
    ] {
        let mut w = weight(
            "blk.0.ffn_down.weight",
            ty,
            ne0,
            n_out,
            &rng.vec(ne0 * n_out, 1.0),
        );
        if fold {
            w = with_fold(w, &h, None);
        }
        let gw = be.upload_split(&w, Some(per_part)).unwrap();
        assert_eq!(gw.parts.len(), n_out.div_ceil(per_part));
        let cw = reference.upload(&w).unwrap();
        for n_tok in [1, 3, 65] {
            let x = rng.vec(n_tok * ne0, 1.0);
            let ours = be.to_host(&be.matmul(&gw, &be.from_host(&x, n_tok, ne0)));
            let want =
                reference.to_host(&reference.matmul(&cw, &reference.from_host(&x, n_tok, ne0)));
            assert_close(
                &format!("split matmul {ty} {ne0}->{n_out} in parts of {per_part} x{n_tok}"),
                &ours,
                &want,
                TOL,
            );
        }
        let mut t = weight(
            "token_embd.weight",
            ty,
            ne0,
            n_out,
            &rng.vec(ne0 * n_out, 1.0),
        );
        if fold {
            t.inverse = Some(h.clone());
        }
        let gt = be.upload_split(&t, Some(per_part)).unwrap();
        let ids: Vec<u32> = (0..9)
            .map(|_| rng.below(n_out as u64) as u32)
            .chain([0, n_out as u32 - 1])
            .collect();
        let ours = be.to_host(&be.embed(&gt, &ids));
        let want = reference.to_host(&reference.embed(&reference.upload(&t).unwrap(), &ids));
        assert_close(
            &format!("split embed {ty} {n_out}x{ne0} in parts of {per_part}"),
            &ours,
            &want,
            EXACT,
        );
    }
}
