//! F16 weights through the native-f16 matvec (adapters with SHADER_F16) agree with the CPU, and
//! with the unpacking path, for decode-sized batches.

mod common;

use common::{assert_close, cpu, weight, Rng};
use tern::backend::Backend;
use tern::tensor::GgmlType;

fn f16_matvec<B: Backend>(be: &B) {
    let reference = cpu();
    let mut rng = Rng(31);
    for (ne0, rows) in [(8, 5), (256, 33), (1024, 130)] {
        let w = weight("w", GgmlType::F16, ne0, rows, &rng.vec(ne0 * rows, 0.1));
        let (wb, wr) = (be.upload(&w).unwrap(), reference.upload(&w).unwrap());
        for n in [1, 3, 4] {
            let x = rng.vec(n * ne0, 1.0);
            let ours = be.to_host(&be.matmul(&wb, &be.from_host(&x, n, ne0)));
            let want = reference.to_host(&reference.matmul(&wr, &reference.from_host(&x, n, ne0)));
            // f16 -> f32 is exact; only the order of f32 sums differs.
            assert_close(
                &format!("f16 matvec {ne0}x{rows}, {n} tokens [{}]", be.name()),
                &ours,
                &want,
                1e-10,
            );
        }
    }
}

per_gpu_backend!(f16_matvec);
