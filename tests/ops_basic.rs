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

        // Per-row scales, a zero among them: that row must come back untouched.
        let scales: Vec<f32> = (0..rows)
            .map(|r| if r % 3 == 1 { 0.0 } else { rng.f32() * 2.0 })
            .collect();
        let mut y = be.from_host(&a, rows, cols);
        be.add_scaled_rows(&mut y, &be.from_host(&b, rows, cols), &scales);
        let mut want = reference.from_host(&a, rows, cols);
        reference.add_scaled_rows(&mut want, &reference.from_host(&b, rows, cols), &scales);
        let ours = be.to_host(&y);
        assert_close(
            &format!("add_scaled_rows {rows}x{cols} [{}]", be.name()),
            &ours,
            &reference.to_host(&want),
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
