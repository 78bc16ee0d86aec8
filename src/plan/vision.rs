//! The projector's terms: its weights as the backend stores them, and the worst-case compute of
//! one encode (the largest image `--image-max-tokens` lets through), priced before anything is
//! allocated (the seeds' trap: a projector charged after the fit check, ~1.4 GiB unpriced).
//!
//! **Weights** are walked by the projector's own loader ([`vision::upload_weights`]) with the
//! backend's allocation rule, as the text weights are; the CPU also keeps the learned position
//! grid decoded to f32 on the host (a GPU's budget is its device memory, where the grid never
//! goes).
//!
//! **Encoder compute** replays `Projector::encode`'s allocations over the patches of the largest
//! image the size rule lets through (`n = 4 ·` [`VisionConfig::worst_case_tokens`]: the
//! maximum, or the overshoot of a large minimum) (widths: `k = 3·patch²` im2col, `W` tower, `ff` MLP, `hd` head, `mid` merger, `P`
//! output) in the backend's own rule:
//! - cpu (the heap, peak of the live set): the prepared pixels, the im2col and its tensor
//!   (`3·n·k`), the residual, the position rows and the rotary table (`2·n·W + n·hd`), then the
//!   widest step: a layer's `h, qkv, a, o, h2, d` and `u, gelu(u)` live together
//!   (`8·n·W + 2·n·ff`; the attention's rotated q, k, its per-task outputs and its result fit
//!   under that), or the merger (`n/4 · (2·mid + P)`). The attention never holds `n x n`
//!   scores: each thread keeps one `n x TB` score block (and its `TB x hd` output), and each
//!   matmul thread one tile of dequantized weight rows, both priced at twice their size for
//!   the Vec's amortized growth.
//! - wgpu / cuda (the buffer pool): the same sequence through the pool's power-of-two size
//!   classes, a freed buffer serving only its own class; what the pool grows to is the term.
//!   The attention is flash-style (rotated q, k copies and the rotary table, no score matrix),
//!   and the GELU table is uploaded once.

use super::price::{Line, Term};
use super::table::count;
use super::BackendKind;
use crate::model::vision::VisionConfig;

/// Query rows per task of the CPU's full attention (`cpu::attention::TB`).
const CPU_ATTN_TB: u64 = 16;
/// The CPU matmul's per-thread tile of dequantized weight rows: `TILE_ROWS × KC` f32
/// (`cpu::gemm`).
const CPU_GEMM_TILE: u64 = 96 * 1024;
const F32: u64 = 4;

/// The shapes the encoder's compute depends on.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Encoder {
    pub cfg: VisionConfig,
    /// `mm.0`'s output width (the merger's hidden layer).
    pub mid: u64,
    /// Whether the tower has `v.pre_ln` / `v.post_ln` (each norm takes a new residual).
    pub pre_ln: bool,
    pub post_ln: bool,
}

impl Encoder {
    fn widths(&self) -> (u64, u64, u64, u64, u64, u64, u64) {
        let c = &self.cfg;
        let n = c.max_patches() as u64;
        let p = c.patch as u64;
        (
            n,
            3 * p * p,
            c.width as u64,
            c.n_ff as u64,
            c.head_dim as u64,
            self.mid,
            c.proj_dim as u64,
        )
    }

    /// The worst-case compute line for `backend`; `threads` is the CPU pool's size.
    pub fn line(&self, backend: BackendKind, threads: u64) -> Line {
        let (n, k, w, ff, hd, mid, proj) = self.widths();
        let (rows, cols) = self.cfg.worst_case_grid();
        let m = |xs: &[u64]| xs.iter().fold(1u64, |a, &b| a.saturating_mul(b));
        let parts: Vec<(String, u64)> = match backend {
            BackendKind::Cpu | BackendKind::Auto => {
                let input = m(&[3, n, k, F32]);
                let base = m(&[n, 2 * w + hd, F32]);
                let layer = m(&[n, 8 * w + 2 * ff, F32]);
                let merger = m(&[n / 4, 2 * mid + proj, F32]);
                let scratch = m(&[2, threads, CPU_ATTN_TB, n.saturating_add(hd), F32]);
                let tiles = m(&[2, threads, CPU_GEMM_TILE, F32]);
                vec![
                    ("pixels and im2col".into(), input),
                    ("residual, positions, rotary".into(), base),
                    ("widest step".into(), layer.max(merger)),
                    (format!("attention scores ({threads} threads)"), scratch),
                    (format!("matmul tiles ({threads} threads)"), tiles),
                ]
            }
            BackendKind::Wgpu | BackendKind::Cuda => {
                vec![("buffer pool".into(), self.pool_replay())]
            }
        };
        let bytes = parts.iter().fold(0u64, |a, (_, b)| a.saturating_add(*b));
        Line {
            term: Term::VisionCompute,
            bytes,
            detail: format!(
                "estimated: one encode of the largest image image-max-tokens {} (min {}) \
                 lets through ({rows} x {cols} tokens, {} patches × width {w}, ff {ff}, {} \
                 layers); no n² score matrix on any backend",
                self.cfg.max_tokens,
                self.cfg.min_tokens,
                count(n),
                self.cfg.n_layer
            ),
            estimated: true,
            parts,
        }
    }

    /// What the GPU buffer pool grows to over one encode, replayed allocation by allocation.
    fn pool_replay(&self) -> u64 {
        let (n, k, w, ff, hd, mid, proj) = self.widths();
        // Bytes of `rows x cols` f32, saturating: the limits come from the user.
        let f = |rows: u64, cols: u64| rows.saturating_mul(cols).saturating_mul(F32);
        let mut p = Pool::default();
        // The GELU table (65,536 f16 entries as f32), uploaded on the first use and kept.
        p.take(f(1, 65_536));
        let x0 = p.take(f(n, k));
        let mut x = p.take(f(n, w));
        let t = p.take(f(n, w));
        p.give(t);
        let pos = p.take(f(n, w));
        p.give(pos);
        let norm = |p: &mut Pool, x: u64| {
            let y = p.take(f(n, w));
            p.give(x);
            y
        };
        if self.pre_ln {
            x = norm(&mut p, x);
        }
        for _ in 0..self.cfg.n_layer {
            let h = p.take(f(n, w));
            let qkv = p.take(f(n, 3 * w));
            let a = p.take(f(n, w));
            let table = p.take(f(n, hd));
            let (qr, kr) = (p.take(f(n, w)), p.take(f(n, w)));
            for b in [table, qr, kr] {
                p.give(b);
            }
            let o = p.take(f(n, w));
            let h2 = p.take(f(n, w));
            let u = p.take(f(n, ff));
            let g = p.take(f(n, ff));
            let d = p.take(f(n, w));
            for b in [g, h, qkv, a, o, h2, u, d] {
                p.give(b);
            }
        }
        if self.post_ln {
            x = norm(&mut p, x);
        }
        let mm = p.take(f(n / 4, mid));
        let g = p.take(f(n / 4, mid));
        let out = p.take(f(n / 4, proj));
        for b in [g, mm, out, x, x0] {
            p.give(b);
        }
        p.allocated
    }
}

/// The GPU pool's rule: a buffer is its size rounded up to a power of two (at least 256 B); a
/// freed buffer serves only its own size.
#[derive(Default)]
struct Pool {
    free: std::collections::HashMap<u64, u64>,
    allocated: u64,
}

impl Pool {
    fn take(&mut self, bytes: u64) -> u64 {
        let size = bytes
            .max(256)
            .checked_next_power_of_two()
            .unwrap_or(u64::MAX);
        match self.free.get_mut(&size) {
            Some(c) if *c > 0 => *c -= 1,
            _ => self.allocated = self.allocated.saturating_add(size),
        }
        size
    }

    fn give(&mut self, size: u64) {
        *self.free.entry(size).or_default() += 1;
    }
}
