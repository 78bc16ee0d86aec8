//! Vision against stock llama.cpp (model-vision.md; goldens from `cargo xtask goldens`, made by
//! xtask/py/vision_goldens.py through `llama_cpp.mtmd_cpp` with flash attention off): the
//! decoded pixels and token grid of every fixture image, and the text model's logits at every
//! position of a prompt with an image, fed llama.cpp's own image embeddings (so the trunk's
//! M-RoPE positions are checked apart from the tower). One test body, one instance per backend.

#[macro_use]
mod common;

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tern::backend::{nmse, Backend};
use tern::model::Model;

fn vision_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/vision")
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/golden/vision")
}

fn manifest() -> serde_json::Value {
    let p = golden_dir().join("manifest.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run `cargo xtask goldens --vision-only`)",
            p.display()
        )
    });
    serde_json::from_str(&text).expect("manifest.json parses")
}

fn cases() -> Vec<serde_json::Value> {
    manifest()["cases"].as_array().expect("cases").clone()
}

fn npy(name: &str) -> (Vec<f32>, Vec<usize>) {
    tern::npy::read(golden_dir().join(name)).unwrap()
}

fn sha256(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// tern's decoder gives stb_image's bytes (llama.cpp's helper) for PNG and GIF; WebP, which
/// stb_image does not read, was given to llama.cpp as the lossless file's own pixels. JPEG is
/// not bit-equal: zune-jpeg's IDCT (the image crate's) rounds differently from stb_image's,
/// even on one component, so JPEG is held to its size here and to the embedding and logits
/// tolerances below.
#[test]
fn decoded_pixels_match_llama_cpp() {
    let mut seen = std::collections::BTreeSet::new();
    for c in cases() {
        let file = c["image"].as_str().unwrap();
        if !seen.insert(file.to_string()) {
            continue;
        }
        let exact = !file.ends_with(".jpg");
        let bytes = std::fs::read(vision_dir().join(file)).unwrap();
        let img = tern::model::image::decode(&bytes).unwrap();
        assert_eq!(
            [img.width as u64, img.height as u64],
            [
                c["decoded"][0].as_u64().unwrap(),
                c["decoded"][1].as_u64().unwrap()
            ],
            "{file}: size"
        );
        if exact {
            assert_eq!(
                sha256(&img.data),
                c["pixels_sha256"].as_str().unwrap(),
                "{file}: decoded pixels differ from llama.cpp's"
            );
        }
    }
}

/// The size rule (model-vision.md §2) gives llama.cpp's token grid for every image.
#[test]
fn token_grid_matches_llama_cpp() {
    for c in cases() {
        let file = c["image"].as_str().unwrap();
        let img =
            tern::model::image::decode(&std::fs::read(vision_dir().join(file)).unwrap()).unwrap();
        // patch 16 x merge 2; llama.cpp's default 8..4096 tokens.
        let (tw, th) =
            tern::model::image::target_size(img.width, img.height, 32, 8 << 10, 4096 << 10);
        let grid = [th / 32, tw / 32];
        assert_eq!(
            grid.map(|g| g as u64),
            [
                c["grid"][0].as_u64().unwrap(),
                c["grid"][1].as_u64().unwrap()
            ],
            "{file}"
        );
        let n_pos = grid[0].max(grid[1]);
        assert_eq!(n_pos as u64, c["n_pos"].as_u64().unwrap(), "{file}: n_pos");
    }
}

/// `--image-min-tokens` / `--image-max-tokens` in the size rule: llama.cpp's grid for every
/// case of limits.json (mtmd given those limits: large images under a small maximum, small ones
/// under a large minimum, an upscale that overshoots min = max), and its refusal of a maximum
/// under the minimum.
#[test]
fn token_limits_give_llama_cpp_grids() {
    use tern::gguf::Gguf;
    use tern::model::vision::VisionConfig;
    let p = golden_dir().join("limits.json");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let text = Gguf::open(vision_dir().join("tiny-vl-f32.gguf")).unwrap();
    let n_embd = tern::model::Config::from_gguf(&text).unwrap().n_embd;
    let proj = Gguf::open(vision_dir().join(doc["projector"].as_str().unwrap())).unwrap();
    let base = VisionConfig::from_gguf(&proj, n_embd).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 8, "{}", p.display());
    let mut refused = 0;
    for c in cases {
        let file = c["image"].as_str().unwrap();
        let limit = |k: &str| c[k].as_i64().filter(|&n| n > 0).map(|n| n as usize);
        let mut cfg = base.clone();
        let r = cfg.set_token_limits(limit("min_tokens"), limit("max_tokens"));
        if c["refused"] == true {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("less than the minimum"), "{file}: {e}");
            refused += 1;
            continue;
        }
        r.unwrap();
        let img =
            tern::model::image::decode(&std::fs::read(vision_dir().join(file)).unwrap()).unwrap();
        let (tw, th) = cfg.target_size(img.width, img.height);
        assert_eq!(
            [th / 32, tw / 32].map(|g| g as u64),
            [
                c["grid"][0].as_u64().unwrap(),
                c["grid"][1].as_u64().unwrap()
            ],
            "{file} with min {} max {}",
            c["min_tokens"],
            c["max_tokens"]
        );
    }
    assert_eq!(refused, 1);
}

/// The planner prices the encoder for `worst_case_tokens`: no image, however thin, gets more
/// tokens through the size rule (a large minimum scales a thin image up past the maximum).
#[test]
fn no_image_exceeds_the_priced_worst_case() {
    use tern::gguf::Gguf;
    use tern::model::vision::VisionConfig;
    let proj = Gguf::open(vision_dir().join("mmproj-f32.gguf")).unwrap();
    let base = VisionConfig::from_gguf(&proj, 128).unwrap();
    for (min, max) in [
        (None, None),
        (Some(64), Some(64)),
        (Some(300), Some(300)),
        (Some(1024), None),
    ] {
        let mut cfg = base.clone();
        cfg.set_token_limits(min, max).unwrap();
        let bound = cfg.worst_case_tokens();
        let m = cfg.min_tokens;
        let mut most = 0;
        for w in [1, 2, 3, 5, 8, 13, 21, 31, 32, 33, 47, 64, 100] {
            for h in (1..=(m + 1) * 32 + 64).step_by(3) {
                let (tw, th) = cfg.target_size(w, h);
                most = most.max((tw / 32) * (th / 32));
            }
        }
        assert!(
            most <= bound,
            "min {min:?} max {max:?}: {most} tokens > {bound}"
        );
        if min.is_some() && min == max {
            // The overshoot is real (limits.json has llama.cpp's 324 tokens at 300/300).
            assert!(most > cfg.max_tokens, "min = max {max:?}: at most {most}");
        }
        eprintln!("min {min:?} max {max:?}: most {most}, priced for {bound}");
    }
}

fn argmax(r: &[f32]) -> usize {
    (0..r.len()).fold(0, |b, i| if r[i] > r[b] { i } else { b })
}

/// The prompt's logits at every position (text, the image's tokens, text again), the image
/// run from llama.cpp's own embeddings: positions, the resume at p0 + max(rows, cols) and the
/// causal order are the trunk's alone here.
fn trunk_logits_from_llama_embeddings<B: Backend>(be: &B) {
    let m = Model::open(be, vision_dir().join("tiny-vl-f32.gguf")).unwrap();
    let nv = m.cfg.n_vocab;
    let mut checked = 0;
    for c in cases() {
        let Some(lname) = c["logits"].as_str() else {
            continue;
        };
        let (gold, shape) = npy(lname);
        let (embd, eshape) = npy(c["embd"].as_str().unwrap());
        let grid = [
            c["grid"][0].as_u64().unwrap() as usize,
            c["grid"][1].as_u64().unwrap() as usize,
        ];
        let toks: Vec<i64> = c["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        assert_eq!(shape, vec![toks.len(), nv]);
        let first = toks.iter().position(|&t| t < 0).unwrap();
        let n_img = grid[0] * grid[1];
        assert_eq!(eshape, vec![n_img, m.cfg.n_embd]);
        let text =
            |r: std::ops::Range<usize>| -> Vec<u32> { toks[r].iter().map(|&t| t as u32).collect() };
        let mut st = m.new_state(be);
        let mut ours = be.to_host(
            &m.forward(be, &mut st, &text(0..first), true)
                .unwrap()
                .logits,
        );
        let e = be.from_host(&embd, n_img, m.cfg.n_embd);
        ours.extend(
            be.to_host(
                &m.forward_image(be, &mut st, &e, grid[0], grid[1], true)
                    .unwrap()
                    .logits,
            ),
        );
        ours.extend(
            be.to_host(
                &m.forward(be, &mut st, &text(first + n_img..toks.len()), true)
                    .unwrap()
                    .logits,
            ),
        );
        assert_eq!(
            st.pos - st.lag,
            c["next_pos"].as_u64().unwrap() as usize,
            "{lname}: the position counter after the prompt"
        );
        let e = nmse(&ours, &gold);
        let bad: Vec<usize> = ours
            .chunks(nv)
            .zip(gold.chunks(nv))
            .enumerate()
            .filter(|(_, (a, g))| {
                let mut s = g.to_vec();
                s.sort_by(|x, y| y.total_cmp(x));
                s[0] - s[1] > 1e-3 && argmax(a) != argmax(g)
            })
            .map(|(i, _)| i)
            .collect();
        println!(
            "{lname} [{}]: logits NMSE {e:.3e} over {} positions, top-1 mismatches {bad:?}",
            be.name(),
            toks.len()
        );
        // An F32 text model and f32 embeddings: llama.cpp's math up to f32 rounding
        // (goldens.md: exact goldens at 1e-6).
        assert!(e <= 1e-6, "{lname}: NMSE {e:e}");
        assert!(bad.is_empty(), "{lname}: top-1 differs at {bad:?}");
        checked += 1;
    }
    assert!(checked >= 5, "only {checked} logits goldens");
}

/// NMSE bound of the projector's embeddings against llama.cpp's, per weight type. F32: the
/// same f32 math (issue #13: 1e-5; the fp16-rounded im2col is reproduced, GELU reads ggml's
/// f16 table). F16: llama.cpp's CPU matmul rounds the activations to f16 against F16
/// weights, tern keeps them in f32. Q8_0: llama.cpp quantizes the activations to Q8_0 blocks;
/// tern keeps them in f32 (goldens.md's "two goldens" reasoning; measured figures in the
/// test output).
fn embd_tolerance(projector: &str) -> f64 {
    if projector.contains("f32") {
        1e-5
    } else if projector.contains("f16") {
        1e-4
    } else {
        5e-3
    }
}

/// The projector's output for every fixture image and projector against llama.cpp's, and the
/// whole path (tower and trunk) against llama.cpp's logits at every position.
fn embeddings_and_logits_match_llama_cpp<B: Backend>(be: &B) {
    use tern::model::vision::{tokenize_with_media, Piece, Projector};
    let m = Model::open(be, vision_dir().join("tiny-vl-f32.gguf")).unwrap();
    let tok = tern::tokenizer::Tokenizer::from_gguf(&m.file).unwrap();
    let prompt = manifest()["prompt"].as_str().unwrap().to_string();
    let nv = m.cfg.n_vocab;
    for c in cases() {
        let pname = c["projector"].as_str().unwrap();
        let file = c["image"].as_str().unwrap();
        let proj = Projector::open(be, vision_dir().join(pname), m.cfg.n_embd).unwrap();
        let img = proj
            .cfg
            .prepare(&std::fs::read(vision_dir().join(file)).unwrap())
            .unwrap();
        let (r, cc) = img.grid(&proj.cfg);
        let e = proj.encode(be, &img);
        let ours = be.to_host(&e);
        let (gold, _) = npy(c["embd"].as_str().unwrap());
        let tol = embd_tolerance(pname);
        let err = nmse(&ours, &gold);
        println!(
            "{pname} {file} [{}]: embeddings NMSE {err:.3e} (tolerance {tol:e})",
            be.name()
        );
        assert!(err <= tol, "{pname} {file}: embeddings NMSE {err:e}");
        let Some(lname) = c["logits"].as_str() else {
            continue;
        };
        let pieces = tokenize_with_media(&tok, &prompt, 1).unwrap();
        let want: Vec<i64> = c["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        let mut st = m.new_state(be);
        let mut logits = Vec::new();
        let mut ids = Vec::new();
        for p in &pieces {
            let out = match p {
                Piece::Text(t) => {
                    ids.extend(t.iter().map(|&x| x as i64));
                    m.forward(be, &mut st, t, true).unwrap()
                }
                Piece::Image(_) => {
                    ids.extend(std::iter::repeat_n(-1, r * cc));
                    m.forward_image(be, &mut st, &e, r, cc, true).unwrap()
                }
            };
            logits.extend(be.to_host(&out.logits));
        }
        assert_eq!(ids, want, "{file}: the prompt's tokens differ from mtmd's");
        let (lg, _) = npy(lname);
        let err = nmse(&logits, &lg);
        println!(
            "{pname} {file} [{}]: logits NMSE {err:.3e} over {} positions",
            be.name(),
            logits.len() / nv
        );
        // The embeddings' own error carried through an F32 text model.
        assert!(err <= 10.0 * tol, "{pname} {file}: logits NMSE {err:e}");
    }
}

/// A projector for another width, a text model given as a projector: refused with the
/// mismatch named.
#[test]
fn mismatched_projectors_are_refused() {
    use tern::model::vision::Projector;
    let be = common::cpu();
    let err = Projector::open(&be, vision_dir().join("mmproj-f32.gguf"), 256)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("projection_dim = 128") && err.contains("n_embd = 256"),
        "{err}"
    );
    let err = Projector::open(&be, vision_dir().join("tiny-vl-f32.gguf"), 128)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("not a projector"), "{err}");
}

per_backend!(
    trunk_logits_from_llama_embeddings,
    embeddings_and_logits_match_llama_cpp
);

/// Images through the serving engine (CPU): the engine's output after an image is the model's
/// own greedy continuation (the position lag, images fed in ubatch pieces), MTP drafting
/// changes nothing across images, and prefix reuse keys on the image's bytes.
mod engine_images {
    use std::sync::Arc;

    use super::vision_dir;
    use tern::backend::{Backend, KvTypes};
    use tern::gguf::Gguf;
    use tern::model::vision::{Projector, VisionConfig, MEDIA_MARKER};
    use tern::model::Model;
    use tern::runtime::engine::{Engine, EngineConfig, Finish, PromptImage, Request};
    use tern::runtime::media::prompt_with_images;
    use tern::runtime::sampler::SamplerConfig;
    use tern::runtime::speculative::SpecConfig;
    use tern::tensor::GgmlType;
    use tern::tokenizer::Tokenizer;

    const PROJECTOR: &str = "mmproj-f32.gguf";

    fn spec() -> Option<SpecConfig> {
        Some(SpecConfig::default())
    }

    fn engine(spec: Option<SpecConfig>, ubatch: usize, projector: bool) -> Engine {
        let g = Arc::new(Gguf::open(vision_dir().join("tiny-vl-f32.gguf")).unwrap());
        let tok = Arc::new(Tokenizer::from_gguf(&g).unwrap());
        let be = super::common::cpu();
        let m = Model::load(&be, g).unwrap();
        let cfg = EngineConfig {
            ctx_size: 1024,
            parallel: 1,
            ubatch,
            kv_types: KvTypes::default(),
            draft_kv_types: KvTypes {
                k: GgmlType::F16,
                v: GgmlType::F16,
            },
            spec,
        };
        let p = projector.then(|| {
            (
                Arc::new(Gguf::open(vision_dir().join(PROJECTOR)).unwrap()),
                tokenizer().1,
            )
        });
        Engine::start_full(m, be, tok, cfg, Default::default(), p).unwrap()
    }

    fn tokenizer() -> (Tokenizer, VisionConfig) {
        let g = Gguf::open(vision_dir().join("tiny-vl-f32.gguf")).unwrap();
        let p = Gguf::open(vision_dir().join(PROJECTOR)).unwrap();
        let n_embd = tern::model::Config::from_gguf(&g).unwrap().n_embd;
        (
            Tokenizer::from_gguf(&g).unwrap(),
            VisionConfig::from_gguf(&p, n_embd).unwrap(),
        )
    }

    /// A 96x96 PNG (a 3x3 token grid, as noise-96.png) of another colour per `seed`.
    fn png(seed: u8) -> Vec<u8> {
        let img = image::RgbImage::from_fn(96, 96, |x, y| {
            image::Rgb([seed, (x as u8).wrapping_mul(seed), (y as u8) ^ seed])
        });
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    fn file(name: &str) -> Vec<u8> {
        std::fs::read(vision_dir().join(name)).unwrap()
    }

    fn layout(prompt: &str, images: &[Vec<u8>]) -> (Vec<u32>, Vec<PromptImage>) {
        let (tok, cfg) = tokenizer();
        let bytes: Vec<&[u8]> = images.iter().map(Vec::as_slice).collect();
        prompt_with_images(&tok, &cfg, prompt, MEDIA_MARKER, &bytes).unwrap()
    }

    fn text(s: &str) -> Vec<u32> {
        tokenizer().0.encode(s, false, true).unwrap()
    }

    fn run(
        e: &Engine,
        prompt: &(Vec<u32>, Vec<PromptImage>),
        n: usize,
        cache: bool,
    ) -> (Vec<u32>, Finish) {
        let (ids, _, fin) = e
            .submit(Request {
                prompt: prompt.0.clone(),
                images: prompt.1.clone(),
                max_tokens: n,
                sampler: SamplerConfig::greedy(),
                ignore_eos: true,
                cache_prompt: cache,
                ..Default::default()
            })
            .collect()
            .unwrap();
        (ids, fin)
    }

    /// The model's greedy continuation, fed piece by piece as `tern logits` does.
    fn reference(prompt: &str, images: &[Vec<u8>], n: usize) -> Vec<u32> {
        use tern::model::vision::{tokenize_with_media, Piece};
        let be = super::common::cpu();
        let m = Model::open(&be, vision_dir().join("tiny-vl-f32.gguf")).unwrap();
        let proj = Projector::open(&be, vision_dir().join(PROJECTOR), m.cfg.n_embd).unwrap();
        let (tok, _) = tokenizer();
        let mut st = m.new_state(&be);
        let mut last = None;
        for p in tokenize_with_media(&tok, prompt, images.len()).unwrap() {
            last = Some(match p {
                Piece::Text(t) => m.forward(&be, &mut st, &t, false).unwrap(),
                Piece::Image(i) => {
                    let img = proj.cfg.prepare(&images[i]).unwrap();
                    let (r, c) = img.grid(&proj.cfg);
                    let e = proj.encode(&be, &img);
                    m.forward_image(&be, &mut st, &e, r, c, false).unwrap()
                }
            });
        }
        let mut out = vec![be.argmax_rows(&last.unwrap().logits)[0]];
        while out.len() < n {
            let o = m
                .forward(&be, &mut st, &out[out.len() - 1..], false)
                .unwrap();
            out.push(be.argmax_rows(&o.logits)[0]);
        }
        out
    }

    const PROMPT: &str = "Look: <__media__> and <__media__>, then say";

    /// Two images (a 3x3 and a 5x2 grid) fed 4 rows a step: the engine's tokens are the model's.
    #[test]
    fn engine_continues_as_the_model_does() {
        let images = [file("noise-96.png"), file("wide-100x37.jpg")];
        let want = reference(PROMPT, &images, 12);
        let p = layout(PROMPT, &images);
        for ubatch in [4, 512] {
            let e = engine(None, ubatch, true);
            let (got, fin) = run(&e, &p, 12, true);
            assert_eq!(got, want, "ubatch {ubatch}");
            assert_eq!(fin.prompt_tokens, p.0.len());
        }
    }

    /// Greedy output is identical with MTP drafting on and off after images, and drafts were
    /// made and checked after them.
    #[test]
    fn drafting_is_exact_across_images() {
        let images = [file("noise-96.png"), file("wide-100x37.jpg")];
        let p = layout(PROMPT, &images);
        let (plain, _) = run(&engine(None, 8, true), &p, 24, true);
        let (drafted, fin) = run(&engine(spec(), 8, true), &p, 24, true);
        assert_eq!(drafted, plain);
        assert!(fin.timings.draft_n > 0, "no drafts: {:?}", fin.timings);
    }

    /// The same image in the next turn reuses the cache, another image with the same grid does
    /// not (past its first row), and each answer is the one a fresh slot gives.
    #[test]
    fn prefix_reuse_keys_on_the_image_bytes() {
        let e = engine(spec(), 16, true);
        let fresh = engine(spec(), 16, true);
        let (a, b) = (png(7), png(200));
        let turn1 = layout("Picture <__media__> shows", std::slice::from_ref(&a));
        let (out1, _) = run(&e, &turn1, 6, true);
        let image_at = turn1.1[0].at;
        // The next turn: the whole history and more text, the same image.
        let mut turn2 = turn1.clone();
        turn2.0.extend(&out1);
        turn2.0.extend(text(" and more"));
        let (out2, fin2) = run(&e, &turn2, 6, true);
        assert!(
            fin2.cached_tokens >= turn1.0.len(),
            "{} of {} cached",
            fin2.cached_tokens,
            turn2.0.len()
        );
        assert_eq!(out2, run(&fresh, &turn2, 6, false).0);
        // It extended with another image's bytes in place of the first (the same tokens):
        // nothing past the image's start.
        let mut turn3 = turn2.clone();
        turn3.0.extend(text(" again"));
        turn3.1 = layout("Picture <__media__> shows", std::slice::from_ref(&b)).1;
        let (out3, fin3) = run(&e, &turn3, 6, true);
        assert!(fin3.cached_tokens <= image_at, "{}", fin3.cached_tokens);
        assert_eq!(out3, run(&fresh, &turn3, 6, false).0);
        // Back to the last prompt with a new ending: the prompt checkpoint (after the image)
        // is reused, with the position lag it had.
        let mut turn4 = turn3.clone();
        turn4.0.extend(text(" twice"));
        let (out4, fin4) = run(&e, &turn4, 6, true);
        assert!(fin4.cached_tokens > image_at, "{}", fin4.cached_tokens);
        assert_eq!(out4, run(&fresh, &turn4, 6, false).0);
    }

    /// Images without a projector, or a grid that is not the pixels' own: the request fails
    /// with the reason, the engine goes on.
    #[test]
    fn images_the_engine_cannot_run_are_refused() {
        let p = layout("Picture <__media__> shows", &[png(1)]);
        let e = engine(None, 16, false);
        let err = e
            .submit(Request {
                prompt: p.0.clone(),
                images: p.1.clone(),
                max_tokens: 2,
                ..Default::default()
            })
            .collect()
            .unwrap_err()
            .to_string();
        assert!(err.contains("no projector (--mmproj)"), "{err}");
        let e = engine(None, 16, true);
        let mut bad = p.1.clone();
        bad[0].cols += 1;
        let err = e
            .submit(Request {
                prompt: p.0.clone(),
                images: bad,
                max_tokens: 2,
                ..Default::default()
            })
            .collect()
            .unwrap_err()
            .to_string();
        assert!(err.contains("image 0"), "{err}");
        assert_eq!(run(&e, &p, 3, true).0.len(), 3);
    }
}
