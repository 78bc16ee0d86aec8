//! Images through `tern serve` on the tiny-vl fixture and its projectors: four concurrent image
//! chats over three slots, each equal to its answer alone; `usage.prompt_tokens` counting the
//! image's tokens; prefix reuse of the same image in the next turn and none for another image;
//! `/props` modalities; the 400s (remote URL, bad data, legacy `images`, no projector); and the
//! official OpenAI client sending a data-URL image (tests/e2e/openai_vision.py).

mod server_common;

use std::path::PathBuf;
use std::process::{Command, Stdio};

use base64::Engine as _;
use serde_json::{json, Value};
use server_common::{get, post, settings, start_with};
use tern::config::Settings;

fn vision(name: &str) -> PathBuf {
    server_common::fixture("vision").join(name)
}

fn data_url(name: &str) -> String {
    let ty = match name.rsplit('.').next().unwrap() {
        "jpg" => "jpeg",
        t => t,
    };
    encode(ty, &std::fs::read(vision(name)).unwrap())
}

fn encode(ty: &str, bytes: &[u8]) -> String {
    format!(
        "data:image/{ty};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// A 96x96 PNG: noise-96.png's 3x3 token grid, other pixels.
fn other_96() -> String {
    let img = image::RgbImage::from_fn(96, 96, |x, y| image::Rgb([x as u8, y as u8, 90]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    encode("png", &out.into_inner())
}

fn vl_settings(parallel: i64, projector: Option<&str>) -> Settings {
    Settings {
        model: Some(vision("tiny-vl-f32.gguf")),
        mmproj: projector.map(vision),
        parallel: Some(parallel),
        ctx_size: Some(1024 * parallel as u64),
        ..settings()
    }
}

fn image_part(name: &str) -> Value {
    url_part(&data_url(name))
}

fn url_part(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

fn chat(messages: Value) -> Value {
    json!({"messages": messages, "max_tokens": 8, "temperature": 0})
}

fn ask(text: &str, image: &str) -> Value {
    chat(json!([{"role": "user", "content": [{"type": "text", "text": text}, image_part(image)]}]))
}

/// Four image chats at once over three slots: the fourth waits for a slot, and every answer
/// (text and token counts) is the one the request gets alone. The F16 projector: the seeds'
/// deployment saw a 16-bit tower crash under concurrent image requests.
#[test]
fn four_concurrent_image_chats_over_three_slots() {
    let h = start_with(
        vl_settings(3, Some("mmproj-f16.gguf")),
        server_common::options(),
    );
    let reqs = [
        ask("What is this?", "noise-96.png"),
        ask("Describe it.", "wide-100x37.jpg"),
        ask("Which colours?", "tall-45x70.webp"),
        ask("And this one?", "grad-200x120.gif"),
    ];
    let answer = |r: &server_common::Resp| {
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        (
            v["choices"][0]["message"].clone(),
            v["usage"]["prompt_tokens"].clone(),
            v["usage"]["completion_tokens"].clone(),
        )
    };
    let alone: Vec<_> = reqs
        .iter()
        .map(|r| answer(&post(h.addr, "/v1/chat/completions", r)))
        .collect();
    let addr = h.addr;
    let together: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = reqs
            .iter()
            .map(|r| s.spawn(move || post(addr, "/v1/chat/completions", r)))
            .collect();
        hs.into_iter().map(|t| answer(&t.join().unwrap())).collect()
    });
    assert_eq!(together, alone);
    let slots = get(h.addr, "/slots").json();
    let slots = slots.as_array().expect("/slots is an array");
    assert_eq!(slots.len(), 3);
    assert!(
        slots.iter().all(|s| s["is_processing"] == false),
        "{slots:?}"
    );
    let props = get(h.addr, "/props").json();
    assert_eq!(props["modalities"]["vision"], true, "{props}");
    h.stop().unwrap();
}

fn tokens(addr: std::net::SocketAddr, text: &str) -> usize {
    let r = post(addr, "/tokenize", &json!({"content": text}));
    r.json()["tokens"].as_array().unwrap().len()
}

/// `prompt_tokens` counts the image's tokens and its two wrapper tokens (as llama-server
/// counts mtmd's chunks); a request that extends the last prompt with the same image reuses the
/// slot's cache, the same request with another image's bytes (the same token layout) reuses
/// nothing past the text before the image, and answers as it did.
#[test]
fn image_tokens_are_counted_and_reused_by_their_bytes() {
    let h = start_with(
        vl_settings(1, Some("mmproj-f32.gguf")),
        server_common::options(),
    );
    let text_only =
        chat(json!([{"role": "user", "content": [{"type": "text", "text": "What is this?"}]}]));
    let r = post(h.addr, "/v1/chat/completions", &text_only);
    assert_eq!(r.status, 200, "{}", r.text());
    let n_text = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    let r = post(
        h.addr,
        "/v1/chat/completions",
        &ask("What is this?", "noise-96.png"),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // noise-96.png is a 3x3 grid: 9 image tokens, <|vision_start|> and <|vision_end|>.
    assert_eq!(
        r.json()["usage"]["prompt_tokens"].as_u64().unwrap(),
        n_text + 9 + 2
    );
    let user = |url: &str| json!({"role": "user", "content": [{"type": "text", "text": "What is this?"}, url_part(url)]});
    // A prompt without the generation prompt, so that the next request extends it.
    let opening = |url: &str| {
        let mut r = chat(json!([user(url)]));
        r["add_generation_prompt"] = json!(false);
        r
    };
    let next = |url: &str| chat(json!([user(url), {"role": "user", "content": "Say more."}]));
    let noise = data_url("noise-96.png");
    let first = post(h.addr, "/v1/chat/completions", &opening(&noise)).json();
    let n_first = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let same = post(h.addr, "/v1/chat/completions", &next(&noise)).json();
    let cached = same["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(same["timings"]["cache_n"].as_u64(), Some(cached));
    assert_eq!(cached, n_first, "the same image: {same}");
    // Where the image starts: the rendered prompt's text before the marker, and vision_start.
    let rendered = post(h.addr, "/apply-template", &next(&noise)).json();
    let prompt = rendered["prompt"].as_str().unwrap();
    let before = prompt.split("<__media__>").next().unwrap();
    let image_at = tokens(h.addr, before) + 1;
    // The opening with another image, then the next request with the first image: its tokens
    // extend the slot's prompt, its image does not.
    let other = post(h.addr, "/v1/chat/completions", &opening(&other_96()));
    assert_eq!(other.status, 200, "{}", other.text());
    assert_eq!(
        other.json()["usage"]["prompt_tokens"].as_u64(),
        Some(n_first)
    );
    let swap = post(h.addr, "/v1/chat/completions", &next(&noise)).json();
    let swap_cached = swap["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as usize;
    assert!(
        swap_cached <= image_at,
        "after another image: {swap_cached} cached, the image starts at {image_at}"
    );
    assert_eq!(
        swap["choices"], same["choices"],
        "the same answer from scratch"
    );
    h.stop().unwrap();
}

/// Image requests the server refuses, each with a 400 that says why; the server serves on.
#[test]
fn bad_image_requests_get_a_400_naming_the_reason() {
    let h = start_with(
        vl_settings(1, Some("mmproj-q8_0.gguf")),
        server_common::options(),
    );
    let with_url = |url: &str| {
        chat(json!([{"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}]))
    };
    let cases = [
        (with_url("https://example.com/cat.png"), "never downloads"),
        (with_url("http://169.254.169.254/latest"), "never downloads"),
        (with_url("file:///etc/passwd"), "file:// URLs are not read"),
        (
            with_url("data:image/png;base64,@@@"),
            "messages[0].content[1]: the image is not valid base64",
        ),
        (with_url("data:text/plain;base64,aGk="), "only images"),
        (with_url("data:image/png,abc"), "base64-encoded"),
        (
            with_url("data:image/png;base64,aGVsbG8gd29ybGQ="),
            "messages[0].content[1]",
        ),
        (
            chat(json!([{"role": "user", "content": [{"type": "image_url"}]}])),
            "without 'image_url'",
        ),
        (
            chat(json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])),
            "input_image parts are not read",
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "images": ["aGk="]}),
            "'images' (a top-level list of images) is not read",
        ),
    ];
    for (body, want) in &cases {
        let r = post(h.addr, "/v1/chat/completions", body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains(want), "{body}: {msg:?} lacks {want:?}");
    }
    // A string image_url and several images in one message are read.
    let two = chat(json!([{"role": "user", "content": [
        {"type": "image_url", "image_url": data_url("noise-96.png")},
        {"type": "text", "text": "and"},
        image_part("wide-100x37.jpg"),
    ]}]));
    let r = post(h.addr, "/v1/chat/completions", &two);
    assert_eq!(r.status, 200, "{}", r.text());
    h.stop().unwrap();
}

/// Without a projector: /props says so, and an image part is refused by name.
#[test]
fn without_a_projector_images_are_refused() {
    let h = start_with(vl_settings(1, None), server_common::options());
    assert_eq!(get(h.addr, "/props").json()["modalities"]["vision"], false);
    let r = post(
        h.addr,
        "/v1/chat/completions",
        &ask("What is this?", "noise-96.png"),
    );
    assert_eq!(r.status, 400);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("messages[0] has an image_url part")
            && msg.contains("without a multimodal projector (--mmproj)"),
        "{msg}"
    );
    h.stop().unwrap();
}

/// The official OpenAI client sends a data-URL image (and a remote URL, refused).
#[test]
fn openai_client_sends_an_image() {
    let have_openai = Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !have_openai {
        println!("SKIPPED openai_client_sends_an_image: `python3 -c \"import openai\"` fails");
        return;
    }
    let h = start_with(
        vl_settings(2, Some("mmproj-q8_0.gguf")),
        server_common::options(),
    );
    let out = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/e2e/openai_vision.py"
        ))
        .args(["--base-url", &format!("http://{}", h.addr)])
        .arg("--image")
        .arg(vision("red-512.png"))
        .output()
        .expect("python3 runs");
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the client's checks failed:\n{text}");
    h.stop().unwrap();
}
