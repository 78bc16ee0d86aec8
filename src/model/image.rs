//! Image → normalized pixels, as llama.cpp's mtmd prepares an image for a Qwen-VL tower
//! (model-vision.md §2): decode to RGB8, the size rule, aspect-preserving Pillow bicubic resize
//! centred on black, then per-channel normalization into planar f32.

/// Why an image cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image: not a PNG, JPEG, WebP or GIF file (the first bytes are {0})")]
    Format(String),
    #[error("image: cannot decode the {format} data: {msg}")]
    Decode { format: &'static str, msg: String },
    #[error("image: {width}x{height} pixels is empty")]
    Empty { width: u32, height: u32 },
    #[error("image: {width}x{height} needs a resize to {tw}x{th}, beyond 65536 pixels a side")]
    TooLarge {
        width: u32,
        height: u32,
        tw: usize,
        th: usize,
    },
}

/// An RGB8 image, row-major, 3 bytes a pixel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rgb {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

/// Decodes PNG, JPEG, WebP or GIF (its first frame) to RGB8; nothing else is accepted.
pub fn decode(bytes: &[u8]) -> Result<Rgb, ImageError> {
    use image::ImageFormat as F;
    let format = image::guess_format(bytes).map_err(|_| {
        let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
        ImageError::Format(if head.is_empty() {
            "empty".into()
        } else {
            head.join(" ")
        })
    })?;
    let name = match format {
        F::Png => "PNG",
        F::Jpeg => "JPEG",
        F::WebP => "WebP",
        F::Gif => "GIF",
        other => return Err(ImageError::Format(format!("{other:?}"))),
    };
    let img =
        image::load_from_memory_with_format(bytes, format).map_err(|e| ImageError::Decode {
            format: name,
            msg: e.to_string(),
        })?;
    let rgb = img.to_rgb8();
    let (width, height) = rgb.dimensions();
    if width == 0 || height == 0 {
        return Err(ImageError::Empty { width, height });
    }
    Ok(Rgb {
        width: width as usize,
        height: height as usize,
        data: rgb.into_raw(),
    })
}

/// The size an image is brought to (llama.cpp's `calc_size_preserved_ratio`, f32 as there):
/// each side rounded to a multiple of `align` (half away from zero, at least `align`); an area
/// over `max_pixels` scales down by `floor`, under `min_pixels` up by `ceil`.
pub fn target_size(
    width: usize,
    height: usize,
    align: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> (usize, usize) {
    let f = align as f32;
    let round_by = |x: f32| ((x / f).round() as i64 * align as i64).max(0) as usize;
    let ceil_by = |x: f32| ((x / f).ceil() as i64 * align as i64).max(0) as usize;
    let floor_by = |x: f32| ((x / f).floor() as i64 * align as i64).max(0) as usize;
    let (w, h) = (width as f32, height as f32);
    let mut tw = round_by(w).max(align);
    let mut th = round_by(h).max(align);
    if max_pixels > 0 && tw * th > max_pixels {
        let beta = (h * w / max_pixels as f32).sqrt();
        th = floor_by(h / beta).max(align);
        tw = floor_by(w / beta).max(align);
    } else if min_pixels > 0 && tw * th < min_pixels {
        let beta = (min_pixels as f32 / (h * w)).sqrt();
        th = ceil_by(h * beta);
        tw = ceil_by(w * beta);
    }
    (tw, th)
}

/// Resizes into `tw x th` keeping the aspect ratio: scaled by min(tw/w, th/h) (sides by `ceil`,
/// at most the target), Pillow bicubic, centred on black. An image already at the target is
/// copied.
pub fn fit(img: &Rgb, tw: usize, th: usize) -> Result<Rgb, ImageError> {
    if tw > 65536 || th > 65536 {
        return Err(ImageError::TooLarge {
            width: img.width as u32,
            height: img.height as u32,
            tw,
            th,
        });
    }
    if (img.width, img.height) == (tw, th) {
        return Ok(img.clone());
    }
    let scale = (tw as f32 / img.width as f32).min(th as f32 / img.height as f32);
    let nw = ((img.width as f32 * scale).ceil() as usize).min(tw);
    let nh = ((img.height as f32 * scale).ceil() as usize).min(th);
    let resized = resize_bicubic(img, nw, nh);
    let mut out = Rgb {
        width: tw,
        height: th,
        data: vec![0; tw * th * 3],
    };
    let (ox, oy) = ((tw - nw) / 2, (th - nh) / 2);
    for y in 0..nh {
        let src = &resized.data[y * nw * 3..(y + 1) * nw * 3];
        let at = ((y + oy) * tw + ox) * 3;
        out.data[at..at + nw * 3].copy_from_slice(src);
    }
    Ok(out)
}

/// Pillow's fixed-point separable resampling with its bicubic filter (a = −0.5, support 2,
/// widened when shrinking), horizontal pass then vertical, u8 in and out (22 fraction bits).
pub fn resize_bicubic(img: &Rgb, tw: usize, th: usize) -> Rgb {
    const BITS: u32 = 22;
    let filter = |x: f64| -> f64 {
        let x = x.abs();
        let a = -0.5;
        if x < 1.0 {
            ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
        } else if x < 2.0 {
            (((x - 5.0) * x + 8.0) * x - 4.0) * a
        } else {
            0.0
        }
    };
    // (first input index, count, fixed-point weights) per output index.
    let weights = |in_size: usize, out_size: usize| -> Vec<(usize, Vec<i32>)> {
        let scale = in_size as f64 / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = 2.0 * filterscale;
        let ss = 1.0 / filterscale;
        let fxp = (1u64 << BITS) as f64;
        (0..out_size)
            .map(|xx| {
                let center = (xx as f64 + 0.5) * scale;
                let xmin = ((center - support + 0.5) as i64).max(0) as usize;
                let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
                let n = xmax.saturating_sub(xmin);
                let w: Vec<f64> = (0..n)
                    .map(|x| filter((x as f64 + xmin as f64 - center + 0.5) * ss))
                    .collect();
                let sum: f64 = w.iter().sum();
                let k = w
                    .iter()
                    .map(|&v| {
                        let v = if sum != 0.0 { v / sum } else { v };
                        (v * fxp + if v < 0.0 { -0.5 } else { 0.5 }) as i32
                    })
                    .collect();
                (xmin, k)
            })
            .collect()
    };
    let clip8 = |v: i32| (v >> BITS).clamp(0, 255) as u8;
    let (w, h) = (img.width, img.height);
    let mut cur = img.data.clone();
    let mut cw = w;
    if tw != w {
        let k = weights(w, tw);
        let mut out = vec![0u8; tw * h * 3];
        for y in 0..h {
            let row = &cur[y * w * 3..(y + 1) * w * 3];
            for (xx, (xmin, ws)) in k.iter().enumerate() {
                let mut s = [1i32 << (BITS - 1); 3];
                for (x, &wt) in ws.iter().enumerate() {
                    let p = &row[(xmin + x) * 3..(xmin + x) * 3 + 3];
                    for c in 0..3 {
                        s[c] = s[c].wrapping_add(p[c] as i32 * wt);
                    }
                }
                for c in 0..3 {
                    out[(y * tw + xx) * 3 + c] = clip8(s[c]);
                }
            }
        }
        cur = out;
        cw = tw;
    }
    if th != h {
        let k = weights(h, th);
        let n = cw * 3;
        let mut out = vec![0u8; n * th];
        let mut acc = vec![0i32; n];
        for (yy, (ymin, ws)) in k.iter().enumerate() {
            acc.fill(1 << (BITS - 1));
            for (y, &wt) in ws.iter().enumerate() {
                let row = &cur[(ymin + y) * n..(ymin + y + 1) * n];
                for (a, &p) in acc.iter_mut().zip(row) {
                    *a = a.wrapping_add(p as i32 * wt);
                }
            }
            for (o, &a) in out[yy * n..(yy + 1) * n].iter_mut().zip(&acc) {
                *o = clip8(a);
            }
        }
        cur = out;
    }
    Rgb {
        width: tw,
        height: th,
        data: cur,
    }
}

/// Planar f32 `[3][height][width]`: v = u8/255, then (v − mean[c]) / std[c], in f32 as
/// llama.cpp's `normalize_image_u8_to_f32`.
pub fn normalize(img: &Rgb, mean: [f32; 3], std: [f32; 3]) -> Vec<f32> {
    let n = img.width * img.height;
    let mut out = vec![0f32; 3 * n];
    for (i, px) in img.data.chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * n + i] = (px[c] as f32 / 255.0 - mean[c]) / std[c];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_rule_takes_each_branch() {
        // 32 = patch 16 x merge 2; 8 and 4096 tokens of 32x32 pixels.
        let t = |w, h| target_size(w, h, 32, 8 * 1024, 4096 * 1024);
        assert_eq!(t(512, 512), (512, 512));
        assert_eq!(t(100, 37), (160, 64));
        assert_eq!(t(45, 70), (96, 128));
        assert_eq!(t(200, 120), (192, 128));
        assert_eq!(t(96, 96), (96, 96));
        // Over 4096 tokens: floor after scaling down.
        let (w, h) = t(4000, 3000);
        assert!(w * h <= 4096 * 1024 && w % 32 == 0 && h % 32 == 0);
    }

    #[test]
    fn fit_pads_centred_on_black() {
        let img = Rgb {
            width: 4,
            height: 2,
            data: vec![200; 4 * 2 * 3],
        };
        let out = fit(&img, 8, 8).unwrap();
        // Scale 2 -> 8x4 content, rows 2..6.
        assert_eq!(out.data[0], 0);
        assert_eq!(out.data[(2 * 8) * 3], 200);
        assert_eq!(out.data[(6 * 8) * 3], 0);
    }

    #[test]
    fn flat_image_stays_flat_through_bicubic() {
        let img = Rgb {
            width: 7,
            height: 5,
            data: [10u8, 20, 30].repeat(35),
        };
        let r = resize_bicubic(&img, 13, 3);
        assert!(r.data.chunks(3).all(|p| p == [10, 20, 30]));
    }
}
