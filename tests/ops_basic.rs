//! Op-level tests of the elementwise and row ops against the CPU reference, on every GPU
//! backend (the CPU's own: tests/ops_cpu.rs).

mod common;

use common::{assert_close, cpu, weight, Rng};
use tern::backend::Backend;
use tern::tensor::GgmlType;

/// f32 arithmetic in a different order than the reference: rounding only.
const TOL: f64 = 1e-10;

fn rms_norm<B: Backend>(be: &B) {
    let reference = cpu();
    let mut rng = Rng(11);
    // Awkward widths: odd, one, and wider than a workgroup.
    for (rows, cols) in [(1, 1), (3, 7), (5, 300), (2, 1024), (70, 64)] {
        let x = rng.vec(rows * cols, 2.0);
        let w = rng.vec(cols, 1.0);
        let ws = weight("norm", GgmlType::F32, cols, 1, &w);
        let ours = be.to_host(&be.rms_norm(
            &be.from_host(&x, rows, cols),
            &be.upload(&ws).unwrap(),
            1e-6,
        ));
        let want = reference.to_host(&reference.rms_norm(
            &reference.from_host(&x, rows, cols),
            &reference.upload(&ws).unwrap(),
            1e-6,
        ));
        assert_close(
            &format!("rms_norm {rows}x{cols} [{}]", be.name()),
            &ours,
            &want,
            TOL,
        );
    }
}

fn add_swiglu_concat<B: Backend>(be: &B) {
    let reference = cpu();
    let mut rng = Rng(12);
    for (rows, cols) in [(1, 1), (3, 257), (65, 64)] {
        let a = rng.vec(rows * cols, 3.0);
        let b = rng.vec(rows * cols, 3.0);
        let mut x = be.from_host(&a, rows, cols);
        be.add_assign(&mut x, &be.from_host(&b, rows, cols));
        let sum: Vec<f32> = a.iter().zip(&b).map(|(p, q)| p + q).collect();
        assert_close(
            &format!("add {rows}x{cols} [{}]", be.name()),
            &be.to_host(&x),
            &sum,
            0.0,
        );

        let ours =
            be.to_host(&be.swiglu(&be.from_host(&a, rows, cols), &be.from_host(&b, rows, cols)));
        let want = reference.to_host(&reference.swiglu(
            &reference.from_host(&a, rows, cols),
            &reference.from_host(&b, rows, cols),
        ));
        assert_close(
            &format!("swiglu {rows}x{cols} [{}]", be.name()),
            &ours,
            &want,
            TOL,
        );

        let c = rng.vec(rows * 3, 1.0);
        let ours =
            be.to_host(&be.concat_cols(&be.from_host(&a, rows, cols), &be.from_host(&c, rows, 3)));
        let want = reference.to_host(&reference.concat_cols(
            &reference.from_host(&a, rows, cols),
            &reference.from_host(&c, rows, 3),
        ));
        assert_close(
            &format!("concat {rows}x{cols}+3 [{}]", be.name()),
            &ours,
            &want,
            0.0,
        );

        let ours = be.to_host(&be.rows(&be.from_host(&a, rows, cols), rows / 2, rows - rows / 2));
        assert_close(
            &format!("rows [{}]", be.name()),
            &ours,
            &a[(rows / 2) * cols..],
            0.0,
        );
    }
}

per_gpu_backend!(rms_norm, add_swiglu_concat);
