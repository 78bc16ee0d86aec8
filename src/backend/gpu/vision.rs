//! The vision tower's ops: LayerNorm with bias, row bias, ggml's GELU, and the tower's full
//! attention over one image.
//!
//! `vision_attention` queues two launches: `vision_rope` rotates q and k into head-major
//! copies (`[n_head][n][hd]`, one third of `qkv` each), then `vision_attn` runs a flash-style
//! online softmax per (tile of R queries, head) over every key, reading v in place from
//! `qkv`. Nothing of size `n x n` is stored, so the largest binding is `qkv` itself.

use super::kernels::consts::{MAX_Q, VISION_MAX_R};
use super::{u32_of, Device, GpuBackend, Grid, Kernel, PBuf, Scalar, Tensor, View, Weight};

fn buf_view<D: Device>(b: &PBuf<D>, floats: usize) -> View<'_, D::Mem> {
    View {
        mem: b.mem(),
        offset: 0,
        len: (floats * 4).max(4) as u64,
    }
}

pub fn layer_norm<D: Device>(
    be: &GpuBackend<D>,
    x: &Tensor<D>,
    w: &Weight<D>,
    b: &Weight<D>,
    eps: f32,
) -> Tensor<D> {
    assert_eq!(w.ne0 * w.rows, x.cols, "layer_norm {}: width", w.name);
    assert_eq!(b.ne0 * b.rows, x.cols, "layer_norm {}: width", b.name);
    let y = be.new_tensor(x.rows, x.cols);
    if x.is_empty() {
        return y;
    }
    be.dev.launch(
        Kernel::LayerNorm,
        Grid::Linear(x.rows),
        &[x.view(), w.dense_view(), b.dense_view(), y.view()],
        &[
            Scalar::U(u32_of(x.rows, "rows")),
            Scalar::U(u32_of(x.cols, "cols")),
            Scalar::F(eps),
        ],
    );
    y
}

pub fn add_bias<D: Device>(be: &GpuBackend<D>, x: &mut Tensor<D>, b: &Weight<D>) {
    assert_eq!(b.ne0 * b.rows, x.cols, "add_bias {}: width", b.name);
    if x.is_empty() {
        return;
    }
    be.dev.launch(
        Kernel::AddBias,
        Grid::Linear(x.len().div_ceil(256)),
        &[x.view(), b.dense_view()],
        &[
            Scalar::U(u32_of(x.rows, "rows")),
            Scalar::U(u32_of(x.cols, "cols")),
        ],
    );
}

pub fn gelu<D: Device>(be: &GpuBackend<D>, x: &Tensor<D>) -> Tensor<D> {
    let y = be.new_tensor(x.rows, x.cols);
    if x.is_empty() {
        return y;
    }
    let table = be.gelu_table();
    be.dev.launch(
        Kernel::Gelu,
        Grid::Linear(x.len().div_ceil(256)),
        &[x.view(), table.view(), y.view()],
        &[Scalar::U(u32_of(x.len(), "length"))],
    );
    y
}

/// Queries per `vision_attn` workgroup: up to `VISION_MAX_R`, a power of two, with R query
/// rows of `hd` in its `MAX_Q` floats of shared memory, and no more than the image has.
fn queries_per_tile(n: usize, hd: usize) -> usize {
    let mut r = VISION_MAX_R;
    while r > 1 && (r * hd > MAX_Q as usize || r / 2 >= n) {
        r /= 2;
    }
    r
}

pub fn vision_attention<D: Device>(
    be: &GpuBackend<D>,
    qkv: &Tensor<D>,
    n_head: usize,
    hd: usize,
    rope: &[f32],
) -> Tensor<D> {
    let n = qkv.rows;
    let width = n_head * hd;
    crate::backend::check_vision_attention(qkv.cols, n, n_head, hd, rope.len());
    assert!(
        hd <= MAX_Q as usize,
        "vision_attention: head_dim {hd} is over the kernel's {MAX_Q}"
    );
    let out = be.new_tensor(n, width);
    if n == 0 || n_head == 0 {
        return out;
    }
    let dev = &be.dev;
    let table = be.upload_pooled(bytemuck::cast_slice(rope));
    let (qr, kr) = (be.alloc(n * width * 4), be.alloc(n * width * 4));
    let shape = [
        Scalar::U(u32_of(n, "patches")),
        Scalar::U(u32_of(n_head, "heads")),
        Scalar::U(u32_of(hd, "head_dim")),
    ];
    dev.launch(
        Kernel::VisionRope,
        Grid::Linear((n * n_head * (hd / 2)).div_ceil(256)),
        &[
            qkv.view(),
            buf_view(&table, rope.len()),
            buf_view(&qr, n * width),
            buf_view(&kr, n * width),
        ],
        &shape,
    );
    let r = queries_per_tile(n, hd);
    let n_tiles = n.div_ceil(r);
    dev.launch(
        Kernel::VisionAttn { r: r as u32 },
        Grid::Linear(n_tiles * n_head),
        &[
            buf_view(&qr, n * width),
            buf_view(&kr, n * width),
            qkv.view(),
            out.view(),
        ],
        &[
            shape[0],
            shape[1],
            shape[2],
            Scalar::F(1.0 / (hd as f32).sqrt()),
            Scalar::U(u32_of(n_tiles, "query tiles")),
        ],
    );
    out
}

#[cfg(test)]
mod tests {
    use super::queries_per_tile;

    #[test]
    fn query_tiles_fit_shared_memory_and_the_image() {
        assert_eq!(queries_per_tile(4096, 72), 16);
        assert_eq!(queries_per_tile(4096, 512), 4);
        assert_eq!(queries_per_tile(1, 72), 1);
        assert_eq!(queries_per_tile(3, 16), 4);
        assert_eq!(queries_per_tile(9, 16), 16);
    }
}
