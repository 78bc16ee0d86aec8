//! The serving engine: slots decoded together, queueing beyond the slots, prefix reuse, MTP
//! drafting across several slots, stop conditions, cancellation and the slot window.

mod common;

use std::path::Path;
use std::sync::Arc;

use tern::backend::{Backend, KvTypes};
use tern::gguf::Gguf;
use tern::model::Model;
use tern::runtime::engine::{Engine, EngineConfig, EngineError, Event, FinishReason, Request};
use tern::runtime::sampler::{Sampler, SamplerConfig};
use tern::runtime::speculative::{Generator, SpecConfig};
use tern::tensor::GgmlType;
use tern::tokenizer::Tokenizer;

fn path(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

fn engine<B: Backend + 'static>(be: B, file: &str, cfg: EngineConfig) -> Result<Engine, EngineError>
where
    B::W: 'static,
{
    let g = Arc::new(Gguf::open(path(file)).unwrap());
    let tok = Arc::new(Tokenizer::from_gguf(&g).unwrap());
    let m = Model::load(&be, g).unwrap();
    Engine::start(m, be, tok, cfg)
}

fn cfg(parallel: usize, spec: Option<SpecConfig>) -> EngineConfig {
    EngineConfig {
        ctx_size: 512 * parallel,
        parallel,
        ubatch: 16,
        kv_types: KvTypes::default(),
        draft_kv_types: KvTypes {
            k: GgmlType::F16,
            v: GgmlType::F16,
        },
        spec,
    }
}

fn req(prompt: Vec<u32>, n: usize) -> Request {
    Request {
        prompt,
        max_tokens: n,
        sampler: SamplerConfig::greedy(),
        stop: vec![],
        ignore_eos: true,
        ..Default::default()
    }
}

fn prompts() -> Vec<Vec<u32>> {
    (0..5)
        .map(|k| {
            (0..(9 + 7 * k))
                .map(|i| ((i * 31 + k * 17) % 400 + 20) as u32)
                .collect()
        })
        .collect()
}

/// Greedy tokens for one prompt computed alone, without the engine.
fn alone<B: Backend>(be: &B, file: &str, prompt: &[u32], n: usize) -> Vec<u32> {
    let m = Model::open(be, path(file)).unwrap();
    let mut g = Generator::new(
        &m,
        be,
        m.new_state(be),
        Sampler::new(SamplerConfig::greedy()),
        None,
    )
    .unwrap();
    let mut out = vec![g.prefill(prompt).unwrap()];
    while out.len() < n {
        out.extend(g.step().unwrap());
    }
    out.truncate(n);
    out
}

/// Several slots at once, drafting on and off, on each backend: every stream equals its
/// greedy tokens computed alone on the CPU.
fn concurrent<B: Backend + 'static>(make: impl Fn() -> B, n: usize)
where
    B::W: 'static,
{
    let be = common::cpu();
    for spec in [
        None,
        Some(SpecConfig {
            n_max: 2,
            n_min: 0,
            p_min: 0.0,
            adaptive: false,
        }),
    ] {
        let e = engine(make(), "tiny-q8_0.gguf", cfg(3, spec.clone())).unwrap();
        let handles: Vec<_> = prompts().into_iter().map(|p| e.submit(req(p, n))).collect();
        for (p, h) in prompts().iter().zip(handles) {
            let (ids, _text, fin) = h.collect().unwrap();
            assert_eq!(fin.reason, FinishReason::Length);
            assert_eq!(fin.completion_tokens, n);
            assert_eq!(
                ids,
                alone(&be, "tiny-q8_0.gguf", p, n),
                "spec {spec:?}: batched decoding changed the tokens"
            );
            if spec.is_some() {
                assert!(fin.timings.draft_n > 0, "drafting ran");
            }
        }
        let m = e.metrics();
        assert_eq!(m.tokens_predicted_total, 5 * n as u64);
        assert!(
            m.n_busy_slots_total > m.n_decode_total,
            "slots shared steps"
        );
        if spec.is_some() {
            assert!(m.spec.drafted > 0);
        }
    }
}

#[test]
fn concurrent_requests_over_fewer_slots_match_each_alone_cpu() {
    concurrent(common::cpu, 96);
}

#[test]
fn concurrent_requests_over_fewer_slots_match_each_alone_wgpu() {
    match common::wgpu() {
        Some(_) => concurrent(|| tern::backend::wgpu::WgpuBackend::new().unwrap(), 24),
        None => eprintln!("skipped: no wgpu adapter"),
    }
}

#[cfg(feature = "cuda")]
#[test]
fn concurrent_requests_over_fewer_slots_match_each_alone_cuda() {
    if let Some(be) = common::cuda() {
        // An engine owns its backend: a new one of the same kind (device or emulator).
        let emulated = be.dev.is_emulated();
        concurrent(
            move || {
                if emulated {
                    tern::backend::cuda::CudaBackend::emulated().unwrap()
                } else {
                    tern::backend::cuda::CudaBackend::new().unwrap()
                }
            },
            24,
        );
    }
}

#[test]
fn a_follow_up_reuses_the_slot_prefix() {
    let be = common::cpu();
    let e = engine(
        common::cpu(),
        "tiny-f32.gguf",
        cfg(1, Some(SpecConfig::default())),
    )
    .unwrap();
    let p1: Vec<u32> = (0..40).map(|i| (i * 13 % 300 + 30) as u32).collect();
    let (g1, _, f1) = e.submit(req(p1.clone(), 10)).collect().unwrap();
    assert_eq!(f1.cached_tokens, 0);
    // The conversation continues: previous prompt + reply + new text.
    let mut p2 = p1.clone();
    p2.extend(&g1);
    p2.extend([77, 78, 79]);
    let (g2, _, f2) = e.submit(req(p2.clone(), 10)).collect().unwrap();
    assert_eq!(
        f2.cached_tokens,
        p1.len() + g1.len() - 1,
        "everything fed to the slot is reused"
    );
    assert_eq!(f2.timings.prompt_n, p2.len() - f2.cached_tokens);
    assert_eq!(g2, alone(&be, "tiny-f32.gguf", &p2, 10));
    // A branch at the end of the last prompt (e.g. a regenerated reply) rewinds to its
    // checkpoint: the recurrent state is not reversible, so only that point and the slot's end
    // are resumable.
    let mut p3 = p2.clone();
    p3.extend([5, 6, 7]);
    let (g3, _, f3) = e.submit(req(p3.clone(), 8)).collect().unwrap();
    assert_eq!(f3.cached_tokens, p2.len());
    assert_eq!(g3, alone(&be, "tiny-f32.gguf", &p3, 8));
    // Unrelated: nothing reused.
    let (_, _, f4) = e.submit(req(vec![1, 2, 3], 4)).collect().unwrap();
    assert_eq!(f4.cached_tokens, 0);
}

#[test]
fn quantized_cache_types_run() {
    let mut c = cfg(2, None);
    c.kv_types = KvTypes {
        k: GgmlType::F16,
        v: GgmlType::Q8_0,
    };
    let e = engine(common::cpu(), "tiny-q8_0.gguf", c).unwrap();
    let (ids, _, fin) = e.submit(req(prompts()[0].clone(), 12)).collect().unwrap();
    assert_eq!((ids.len(), fin.reason), (12, FinishReason::Length));
}

#[test]
fn bad_shapes_and_requests_are_errors() {
    let mut c = cfg(3, None);
    c.ctx_size = 1000;
    assert!(matches!(
        engine(common::cpu(), "tiny-q8_0.gguf", c).err(),
        Some(EngineError::UnevenPool { .. })
    ));
    let mut c = cfg(1, None);
    c.ctx_size = 8192;
    assert!(matches!(
        engine(common::cpu(), "tiny-q8_0.gguf", c).err(),
        Some(EngineError::WindowTooLong { .. })
    ));
    assert!(
        engine(
            common::cpu(),
            "tiny-tied-f32.gguf",
            cfg(1, Some(SpecConfig::default()))
        )
        .is_err(),
        "no MTP block"
    );

    let mut c = cfg(2, None);
    c.ctx_size = 64;
    let e = engine(common::cpu(), "tiny-q8_0.gguf", c).unwrap();
    let long: Vec<u32> = (0..40).map(|i| i + 10).collect();
    match e.submit(req(long, 4)).collect() {
        Err(EngineError::PromptTooLong {
            n_prompt: 40,
            n_ctx_slot: 32,
        }) => {}
        other => panic!("expected the slot window error, got {other:?}"),
    }
    assert_eq!(
        e.submit(req(vec![], 4)).collect().unwrap_err(),
        EngineError::EmptyPrompt
    );
    assert!(e
        .submit(req(vec![1, 999_999], 4))
        .collect()
        .unwrap_err()
        .to_string()
        .contains("999999"));
    let mut r = req(vec![1, 2], 4);
    r.sampler.top_p = 7.0;
    assert!(e
        .submit(r)
        .collect()
        .unwrap_err()
        .to_string()
        .contains("top_p"));
    // Generation stops at the window.
    let (ids, _, fin) = e.submit(req((0..20).collect(), 100)).collect().unwrap();
    assert_eq!(fin.reason, FinishReason::Length);
    assert_eq!(
        20 + ids.len(),
        32,
        "prompt + generated fill the 32-token window"
    );
}

#[test]
fn cancel_frees_the_slot_and_stop_strings_end_text() {
    let e = engine(common::cpu(), "tiny-q8_0.gguf", cfg(1, None)).unwrap();
    let h = e.submit(req(prompts()[1].clone(), 400));
    // Wait for the first token, then cancel.
    loop {
        if let Event::Token { .. } = h.events.recv().unwrap() {
            break;
        }
    }
    h.cancel();
    let fin = loop {
        match h.events.recv().unwrap() {
            Event::Done(f) => break f,
            _ => continue,
        }
    };
    assert_eq!(fin.reason, FinishReason::Cancelled);
    // The single slot is free again.
    let (_, text, _) = e.submit(req(prompts()[2].clone(), 30)).collect().unwrap();
    assert!(!text.is_empty());
    // A stop string taken from that output ends the same request early, excluded from the text.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let mut r = req(prompts()[2].clone(), 30);
    r.stop = vec![stop.clone()];
    let (_, t2, f2) = e.submit(r).collect().unwrap();
    assert_eq!(
        f2.reason,
        FinishReason::Stop,
        "text {text:?} stop {stop:?} got {t2:?}"
    );
    assert_eq!(f2.stop_word.as_deref(), Some(stop.as_str()));
    assert!(
        text.starts_with(&t2) && !t2.contains(&stop),
        "{t2:?} vs {text:?} stop {stop:?}"
    );
    assert_eq!(t2, text[..text.find(&stop).unwrap()]);
}

fn grammars(file: &str) -> tern::runtime::constraint::Grammars {
    let g = Gguf::open(path(file)).unwrap();
    tern::runtime::constraint::Grammars::new(Arc::new(Tokenizer::from_gguf(&g).unwrap())).unwrap()
}

/// Under a JSON schema the masks (computed while the forward runs, drafts checked against
/// them) keep greedy output identical with MTP drafting on and off, on the trained demo model
/// and on a random-weight fixture, and the output is a prefix of valid JSON.
#[test]
fn constrained_greedy_is_identical_with_drafting_on_and_off() {
    use tern::runtime::constraint::GrammarSpec;
    let schema = serde_json::json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["lord", "lady", "fool"]},
        "lines": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
        "required": ["name", "kind", "lines"]});
    for file in ["demo/demo-q8_0.gguf", "tiny-q8_0.gguf"] {
        let gr = grammars(file);
        let spec = GrammarSpec::JsonSchema(schema.clone());
        let mut outs = Vec::new();
        for draft in [None, Some(2), Some(3)] {
            let sp = draft.map(|n_max| SpecConfig {
                n_max,
                n_min: 0,
                p_min: 0.0,
                adaptive: false,
            });
            let e = engine(common::cpu(), file, cfg(2, sp)).unwrap();
            let g = Gguf::open(path(file)).unwrap();
            let tok = Tokenizer::from_gguf(&g).unwrap();
            let prompt = tok.encode("Enter the king: ", false, true).unwrap();
            let mut r = req(prompt, 120);
            r.ignore_eos = false;
            r.constraint = Some(gr.compile(&spec, false).unwrap());
            let (ids, text, fin) = e.submit(r).collect().unwrap();
            println!("{file} drafting {draft:?}: {fin:?}\n{text}");
            if draft.is_some() {
                assert!(fin.timings.draft_n > 0, "drafting ran");
            }
            if fin.reason == FinishReason::Stop {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                assert!(v["lines"].is_array() && v["kind"].is_string(), "{v}");
            }
            outs.push(ids);
        }
        assert_eq!(
            outs[0], outs[1],
            "{file}: drafting (2) changed constrained output"
        );
        assert_eq!(
            outs[0], outs[2],
            "{file}: drafting (3) changed constrained output"
        );
    }
}

/// n = 3: the prompt runs once and the state is forked; greedy choices agree with the request
/// run alone, seeded choices are reproducible and differ from each other.
#[test]
fn n_choices_share_one_prefill() {
    let e = engine(
        common::cpu(),
        "tiny-q8_0.gguf",
        cfg(3, Some(SpecConfig::default())),
    )
    .unwrap();
    let p = prompts()[3].clone();
    let mut r = req(p.clone(), 20);
    r.n = 3;
    let before = e.metrics().prompt_tokens_total;
    let outs = e.submit(r).collect_all().unwrap();
    assert_eq!(outs.len(), 3);
    let want = alone(&common::cpu(), "tiny-q8_0.gguf", &p, 20);
    for (c, (ids, _, f)) in outs.iter().enumerate() {
        assert_eq!(f.choice, c);
        assert_eq!(ids, &want, "greedy choice {c}");
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(
        e.metrics().prompt_tokens_total - before,
        p.len() as u64,
        "one prefill"
    );
    let sampled = |seed: u64| {
        let mut r = req(p.clone(), 24);
        r.n = 3;
        r.sampler = SamplerConfig {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed,
            ..Default::default()
        };
        e.submit(r)
            .collect_all()
            .unwrap()
            .into_iter()
            .map(|o| o.0)
            .collect::<Vec<_>>()
    };
    let a = sampled(11);
    assert_eq!(a, sampled(11), "seeded choices are reproducible");
    assert!(a[0] != a[1] || a[1] != a[2], "choices draw differently");
    let mut r = req(p, 4);
    r.n = 4;
    assert!(matches!(
        e.submit(r).collect_all(),
        Err(EngineError::TooManyChoices { n: 4, parallel: 3 })
    ));
}

/// A -inf bias bans a token over 200 sampled tokens; reported probabilities are sorted, sum to
/// at most 1 and carry the sampled token's own.
#[test]
fn logit_bias_bans_and_probabilities_are_reported() {
    use tern::runtime::sampler::ProbsRequest;
    let e = engine(common::cpu(), "tiny-q8_0.gguf", cfg(1, None)).unwrap();
    let p = prompts()[0].clone();
    let sampler = SamplerConfig {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 3,
        ..Default::default()
    };
    // The most frequent token of an unbiased run is the one to ban.
    let mut r = req(p.clone(), 200);
    r.sampler = sampler.clone();
    let (ids, _, _) = e.submit(r).collect().unwrap();
    let mut counts = std::collections::HashMap::new();
    for &t in &ids {
        *counts.entry(t).or_insert(0) += 1;
    }
    let (&banned, &n) = counts.iter().max_by_key(|(_, &n)| n).unwrap();
    assert!(n > 1);
    let mut r = req(p, 200);
    r.sampler = SamplerConfig {
        logit_bias: vec![(banned, f32::NEG_INFINITY)],
        ..sampler
    };
    r.probs = Some(ProbsRequest {
        n: 5,
        post_sampling: false,
    });
    let h = e.submit(r);
    let mut n_tok = 0;
    for ev in h.events.iter() {
        match ev {
            Event::Token { id, probs, .. } => {
                n_tok += 1;
                assert_ne!(id, banned, "a banned token was emitted");
                let p = probs.expect("probabilities were asked for");
                assert_eq!(p.top.len(), 5);
                assert!(p.top.windows(2).all(|w| w[0].p >= w[1].p), "sorted");
                assert!(p.top.iter().map(|t| t.p).sum::<f32>() <= 1.0 + 1e-6);
                assert!(p.p > 0.0 && p.p <= 1.0);
            }
            Event::Done(_) => break,
            Event::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
    assert_eq!(n_tok, 200);
}
