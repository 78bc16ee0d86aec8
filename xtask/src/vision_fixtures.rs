//! The vision fixtures (`cargo xtask fixtures` writes them to `fixtures/vision/`): a tiny qwen35
//! text model whose vocabulary has the Qwen-VL wrapper tokens, random Qwen3-VL projectors
//! (`clip.projector_type = qwen3vl_merger`) in F32, F16 and Q8_0 whose output width is that
//! model's n_embd, and test images in PNG, JPEG, WebP and GIF whose sizes take every branch of
//! llama.cpp's size rule (upscale, downscale, pad, copy). Everything is drawn from fixed seeds.

use std::path::Path;

use anyhow::{bail, Context, Result};
use tern::gguf::{Gguf, GgufWriter, Value};
use tern::tensor::GgmlType;

use crate::fixtures::{self, Geometry, SEED};
use crate::rng::Rng;
use crate::vocab;

/// The tower: width, heads, FFN width, layers, patch side, the learned position grid's image
/// side (a 4x4 grid, so every image interpolates it), the merge side.
pub const WIDTH: usize = 64;
pub const HEADS: usize = 2;
pub const FF: usize = 128;
pub const LAYERS: usize = 2;
pub const PATCH: usize = 16;
pub const IMAGE_SIZE: usize = 64;
pub const MERGE: usize = 2;
/// Not Qwen's 0.5/0.5: distinct per channel, so a channel mix-up shows.
pub const MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
pub const STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

pub const TEXT_MODEL: &str = "tiny-vl-f32.gguf";

/// Projector files and the type of their 2-D weights (the patch kernels are F16 in the F16 and
/// Q8_0 files, as converters write them; norms, biases and the position grid stay F32).
pub const PROJECTORS: [(&str, GgmlType); 3] = [
    ("mmproj-f32.gguf", GgmlType::F32),
    ("mmproj-f16.gguf", GgmlType::F16),
    ("mmproj-q8_0.gguf", GgmlType::Q8_0),
];

/// The text model: the tiny geometry at half the depth (three GDN layers, one attention layer
/// and the MTP block), so the file stays small.
pub fn text_geometry() -> Geometry {
    Geometry {
        label: "tiny-vl",
        n_layer: 4,
        ..Geometry::tiny()
    }
}

fn uniform(label: &str, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut rng = Rng::for_label(SEED, &format!("vision/{label}"));
    let mut w = vec![0f32; n];
    rng.fill_uniform(&mut w, lo, hi);
    w
}

/// The projector: every tensor llama.cpp's qwen3vl graph reads, no deepstack layers.
pub fn projector(ty: GgmlType, n_embd_text: usize) -> Result<GgufWriter> {
    let mut w = GgufWriter::new();
    let u = |x: usize| Value::U32(x as u32);
    w.set("general.architecture", Value::String("clip".into()));
    w.set(
        "general.name",
        Value::String(format!(
            "tern tiny Qwen3-VL projector ({}, random weights)",
            fixtures::type_name(ty)
        )),
    );
    w.set("general.file_type", Value::U32(fixtures::file_type_of(ty)));
    w.set(
        "clip.projector_type",
        Value::String("qwen3vl_merger".into()),
    );
    w.set("clip.has_vision_encoder", Value::Bool(true));
    w.set("clip.use_gelu", Value::Bool(true));
    w.set("clip.vision.embedding_length", u(WIDTH));
    w.set("clip.vision.feed_forward_length", u(FF));
    w.set("clip.vision.block_count", u(LAYERS));
    w.set("clip.vision.attention.head_count", u(HEADS));
    w.set("clip.vision.attention.layer_norm_epsilon", Value::F32(1e-6));
    w.set("clip.vision.patch_size", u(PATCH));
    w.set("clip.vision.image_size", u(IMAGE_SIZE));
    w.set("clip.vision.projection_dim", u(n_embd_text));
    w.set("clip.vision.spatial_merge_size", u(MERGE));
    w.set("clip.vision.image_mean", Value::f32_array(&MEAN));
    w.set("clip.vision.image_std", Value::f32_array(&STD));

    // Seeds name the tensor, not the file: the three files hold one set of master weights.
    let mut add = |name: &str, dims: &[usize], t: GgmlType, lo: f32, hi: f32| -> Result<()> {
        let n: usize = dims.iter().product();
        let v = uniform(name, n, lo, hi);
        let bytes = fixtures::encode(t, dims[0], &v).with_context(|| name.to_string())?;
        let d: Vec<u64> = dims.iter().map(|&x| x as u64).collect();
        w.add_tensor(name, &d, t, bytes);
        Ok(())
    };
    let mat = |n_in: usize| (3.0 / n_in as f32).sqrt();
    let kernel_ty = if ty == GgmlType::F32 {
        GgmlType::F32
    } else {
        GgmlType::F16
    };
    let k_in = 3 * PATCH * PATCH;
    let a = mat(2 * k_in);
    add(
        "v.patch_embd.weight",
        &[PATCH, PATCH, 3, WIDTH],
        kernel_ty,
        -a,
        a,
    )?;
    add(
        "v.patch_embd.weight.1",
        &[PATCH, PATCH, 3, WIDTH],
        kernel_ty,
        -a,
        a,
    )?;
    add("v.patch_embd.bias", &[WIDTH], GgmlType::F32, -0.1, 0.1)?;
    let grid = (IMAGE_SIZE / PATCH) * (IMAGE_SIZE / PATCH);
    add(
        "v.position_embd.weight",
        &[WIDTH, grid],
        GgmlType::F32,
        -0.5,
        0.5,
    )?;
    for il in 0..LAYERS {
        let p = |s: &str| format!("v.blk.{il}.{s}");
        for ln in ["ln1", "ln2"] {
            add(
                &p(&format!("{ln}.weight")),
                &[WIDTH],
                GgmlType::F32,
                0.8,
                1.2,
            )?;
            add(
                &p(&format!("{ln}.bias")),
                &[WIDTH],
                GgmlType::F32,
                -0.1,
                0.1,
            )?;
        }
        let m = mat(WIDTH);
        add(&p("attn_qkv.weight"), &[WIDTH, 3 * WIDTH], ty, -m, m)?;
        add(&p("attn_qkv.bias"), &[3 * WIDTH], GgmlType::F32, -0.1, 0.1)?;
        add(&p("attn_out.weight"), &[WIDTH, WIDTH], ty, -m, m)?;
        add(&p("attn_out.bias"), &[WIDTH], GgmlType::F32, -0.1, 0.1)?;
        add(&p("ffn_up.weight"), &[WIDTH, FF], ty, -m, m)?;
        add(&p("ffn_up.bias"), &[FF], GgmlType::F32, -0.1, 0.1)?;
        let f = mat(FF);
        add(&p("ffn_down.weight"), &[FF, WIDTH], ty, -f, f)?;
        add(&p("ffn_down.bias"), &[WIDTH], GgmlType::F32, -0.1, 0.1)?;
    }
    add("v.post_ln.weight", &[WIDTH], GgmlType::F32, 0.8, 1.2)?;
    add("v.post_ln.bias", &[WIDTH], GgmlType::F32, -0.1, 0.1)?;
    let m4 = mat(4 * WIDTH);
    add("mm.0.weight", &[4 * WIDTH, 4 * WIDTH], ty, -m4, m4)?;
    add("mm.0.bias", &[4 * WIDTH], GgmlType::F32, -0.1, 0.1)?;
    add("mm.2.weight", &[4 * WIDTH, n_embd_text], ty, -m4, m4)?;
    add("mm.2.bias", &[n_embd_text], GgmlType::F32, -0.1, 0.1)?;
    Ok(w)
}

/// One test image: file name, what it exercises, and its pixels (RGB8, row-major).
pub struct TestImage {
    pub file: &'static str,
    pub why: &'static str,
    pub width: u32,
    pub height: u32,
}

pub const IMAGES: [TestImage; 5] = [
    TestImage {
        file: "red-512.png",
        why: "the fleet probe: 512 px solid red, already a multiple of 32 (copied), 256 tokens",
        width: 512,
        height: 512,
    },
    TestImage {
        file: "wide-100x37.jpg",
        why: "JPEG (grayscale); under the 8-token minimum: upscaled to 160x64, resized to 160x60, padded",
        width: 100,
        height: 37,
    },
    TestImage {
        file: "tall-45x70.webp",
        why: "WebP (lossless); upscaled to 96x128, resized to 83x128, padded left and right",
        width: 45,
        height: 70,
    },
    TestImage {
        file: "grad-200x120.gif",
        why: "GIF, two frames (the first is read); rounded to 192x128, downscaled to 192x116, padded",
        width: 200,
        height: 120,
    },
    TestImage {
        file: "noise-96.png",
        why: "random pixels at 96x96: already the target, copied; an odd 3x3 token grid",
        width: 96,
        height: 96,
    },
];

/// The pixels of frame `frame` of an image: smooth colour fields with some texture, so that
/// resizing and the encoder see structure (the red probe is flat, noise-96 is pure noise).
fn pixels(img: &TestImage, frame: u32) -> image::RgbImage {
    let (w, h) = (img.width, img.height);
    let mut rng = Rng::for_label(SEED, &format!("vision/image/{}/{frame}", img.file));
    image::RgbImage::from_fn(w, h, |x, y| {
        if img.file.starts_with("red") {
            return image::Rgb([255, 0, 0]);
        }
        if img.file.starts_with("noise") {
            let v = rng.next_u64();
            return image::Rgb([v as u8, (v >> 8) as u8, (v >> 16) as u8]);
        }
        let fx = x as f32 / w as f32;
        let fy = y as f32 / h as f32;
        let ripple = ((x as f32 * 0.7 + frame as f32).sin() * (y as f32 * 0.4).cos()) * 40.0;
        let r = 230.0 * fx + ripple;
        let g = 200.0 * fy - ripple * 0.5;
        let b = 120.0 + 100.0 * (fx - fy) + if (x / 8 + y / 8) % 2 == 0 { 20.0 } else { 0.0 };
        let c = |v: f32| v.round().clamp(0.0, 255.0) as u8;
        image::Rgb([c(r), c(g), c(b)])
    })
}

fn encode_image(img: &TestImage) -> Result<Vec<u8>> {
    use image::ImageEncoder;
    let mut out = Vec::new();
    let px = pixels(img, 0);
    let (w, h) = (img.width, img.height);
    let ext = img.file.rsplit('.').next().unwrap_or("");
    match ext {
        "png" => image::codecs::png::PngEncoder::new(&mut out).write_image(
            &px,
            w,
            h,
            image::ExtendedColorType::Rgb8,
        )?,
        // Grayscale: JPEG decoders differ in chroma upsampling (stb_image's, which llama.cpp
        // uses, is not zune-jpeg's), never in a single component's IDCT.
        "jpg" => image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 90).write_image(
            &image::DynamicImage::ImageRgb8(px).to_luma8(),
            w,
            h,
            image::ExtendedColorType::L8,
        )?,
        "webp" => image::codecs::webp::WebPEncoder::new_lossless(&mut out).write_image(
            &px,
            w,
            h,
            image::ExtendedColorType::Rgb8,
        )?,
        "gif" => {
            let mut enc = image::codecs::gif::GifEncoder::new_with_speed(&mut out, 10);
            for f in 0..2 {
                let rgba = image::DynamicImage::ImageRgb8(pixels(img, f)).to_rgba8();
                enc.encode_frame(image::Frame::new(rgba))?;
            }
        }
        other => bail!("no encoder for .{other}"),
    }
    Ok(out)
}

/// Writes the text model, the projectors, the images and `vision/manifest.json`. WebP images
/// also get their decoded RGB bytes (`.rgb`): stb_image, which llama.cpp's helper uses, reads no
/// WebP, so the goldens feed llama.cpp those bytes (a lossless file decodes to exactly them).
pub fn write(dir: &Path) -> Result<()> {
    let dir = dir.join("vision");
    std::fs::create_dir_all(&dir)?;
    let g = text_geometry();
    let v = vocab::build_vl(fixtures::N_MERGES);
    let text = fixtures::plain_file(
        &g,
        &v,
        GgmlType::F32,
        "tern tiny-vl fixture (F32, random weights, Qwen-VL wrapper tokens)",
    )?;
    let (text_bytes, text_sha) = fixtures::write_checked(&text, &dir.join(TEXT_MODEL))?;
    let mut projs = Vec::new();
    for (file, ty) in PROJECTORS {
        let path = dir.join(file);
        projector(ty, g.n_embd)?
            .write(&path)
            .with_context(|| format!("writing {}", path.display()))?;
        let back = Gguf::open(&path).with_context(|| format!("re-opening {}", path.display()))?;
        if back.architecture() != Some("clip") {
            bail!("{}: architecture did not round-trip", path.display());
        }
        let bytes = back.file_len();
        let sha = fixtures::sha256_file(&path)?;
        println!("{file:<34} {bytes:>12} bytes  sha256 {sha}");
        projs.push(serde_json::json!({
            "file": file, "weight_type": fixtures::type_name(ty), "sha256": sha, "bytes": bytes,
        }));
    }
    let mut images = Vec::new();
    for img in &IMAGES {
        let bytes = encode_image(img).with_context(|| img.file.to_string())?;
        std::fs::write(dir.join(img.file), &bytes)?;
        if img.file.ends_with(".webp") {
            let raw = image::load_from_memory(&bytes)?.to_rgb8().into_raw();
            std::fs::write(dir.join(format!("{}.rgb", img.file)), raw)?;
        }
        println!("{:<34} {:>12} bytes", img.file, bytes.len());
        images.push(serde_json::json!({
            "file": img.file, "width": img.width, "height": img.height, "why": img.why,
        }));
    }
    let manifest = serde_json::json!({
        "generator": "cargo xtask fixtures",
        "text_model": {"file": TEXT_MODEL, "sha256": text_sha, "bytes": text_bytes,
                       "geometry": g.label, "n_layer": g.n_layer, "vision_tokens": vocab::VISION_SPECIALS},
        "tower": {"width": WIDTH, "heads": HEADS, "ff": FF, "layers": LAYERS, "patch": PATCH,
                  "image_size": IMAGE_SIZE, "merge": MERGE},
        "projectors": projs,
        "images": images,
    });
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_string_pretty(&manifest)? + "\n",
    )?;
    Ok(())
}
