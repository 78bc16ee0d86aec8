//! A bounded slice of the fuzz suite (`cargo xtask fuzz` runs it at length): structure-aware
//! GGUF mutations read as a server reads a model, and request bodies, chat-template inputs and
//! tool-call text through the server's router, each case ending in one outcome class. A panic,
//! a silent NaN, a case slower than the hang limit, or the slice outliving its watchdog fails
//! the test (an abort fails it by taking the process down). The slices start at an offset
//! that moves with nothing but this file, so CI always replays the same cases.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tern::fuzz::{self, gguf, request, Outcome, Verdict};

const SEED: u64 = 0x7465_726e_6675_7a7a;
/// Per case: far above the slowest case seen (~0.3 s), far below a hang.
const HANG: Duration = Duration::from_secs(10);

/// Aborts the process if `limit` passes before the returned flag is set: a hang in a slice
/// must fail CI, not stall it.
fn watchdog(what: &'static str, limit: Duration) -> Arc<AtomicBool> {
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    std::thread::spawn(move || {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            if d.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("{what}: still running after {limit:?}: a hang");
        std::process::abort();
    });
    done
}

fn seeds() -> Vec<gguf::Seed> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    [
        "fixtures/tiny-q8_0.gguf",
        "fixtures/tiny-pq2_0.gguf",
        "fixtures/tiny-tied-q8_0.gguf",
        "fixtures/tiny-q4_0.gguf",
        "fixtures/tiny-bf16.gguf",
    ]
    .iter()
    .map(|n| gguf::Seed::new(n, std::fs::read(root.join(n)).unwrap()).unwrap())
    .collect()
}

/// Runs cases, failing on the failure classes with the case index and input to replay.
fn slice(
    what: &str,
    range: std::ops::Range<u64>,
    mut one: impl FnMut(u64) -> (Verdict, String),
) -> BTreeMap<Outcome, usize> {
    let mut counts = BTreeMap::new();
    let mut failures = Vec::new();
    for i in range {
        let t0 = Instant::now();
        let (mut v, note) = one(i);
        if t0.elapsed() > HANG {
            v = Verdict::new(Outcome::Hang, format!("{:?}", t0.elapsed()));
        }
        *counts.entry(v.outcome).or_default() += 1;
        if v.outcome.is_failure() {
            failures.push(format!(
                "{what} case {i} ({}): {}\n  input: {note}\n  replay: cargo xtask fuzz --target {what} --seed {SEED:#x} --case {i}",
                v.outcome.name(),
                v.detail
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    eprintln!("{what}: {counts:?}");
    counts
}

#[test]
fn gguf_mutations_slice() {
    fuzz::quiet_panics();
    let done = watchdog("gguf slice", Duration::from_secs(300));
    let seeds = seeds();
    let counts = slice("gguf", 1_000_000..1_001_500, |i| {
        let (bytes, note) = gguf::case(&seeds, SEED, i);
        (fuzz::guarded(|| gguf::run(bytes)), note)
    });
    done.store(true, Ordering::Relaxed);
    // Both ends of the funnel are reached: refusals, and files that load and generate.
    assert!(counts.get(&Outcome::CleanError).copied().unwrap_or(0) > 1000);
    assert!(counts.get(&Outcome::AcceptedValid).copied().unwrap_or(0) > 20);
}

#[test]
fn request_mutations_slice() {
    fuzz::quiet_panics();
    let done = watchdog("request slice", Duration::from_secs(300));
    let t = request::Target::new().expect("the fuzz server boots on the bundled model");
    let counts = slice("request", 1_000_000..1_000_700, |i| {
        let c = t.case(SEED, i);
        (fuzz::guarded(|| t.run(&c)), c.note())
    });
    done.store(true, Ordering::Relaxed);
    assert!(counts.get(&Outcome::CleanError).copied().unwrap_or(0) > 200);
    assert!(counts.get(&Outcome::AcceptedValid).copied().unwrap_or(0) > 200);
}

/// The issue's reproducers, as fuzz cases: each is now a clean error (their messages are
/// checked in tests/model_load.rs).
#[test]
fn issue_reproducers_are_clean_errors() {
    use tern::gguf::{Gguf, GgufWriter, Value, ValueType};
    fuzz::quiet_panics();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let f = Gguf::open(root.join("fixtures/tiny-f32.gguf")).unwrap();
    let pq = Gguf::open(root.join("fixtures/tiny-pq2_0.gguf")).unwrap();
    let with = |g: &Gguf, key: &str, v: Value, extra: Option<(&str, Vec<u64>)>| -> Vec<u8> {
        let mut w = GgufWriter::new();
        for (k, old) in g.metadata() {
            w.set(k, old.clone());
        }
        w.set(key, v);
        for t in g.tensors() {
            w.add_tensor(&t.name, &t.dims, t.ty, g.tensor_data(t).to_vec());
        }
        if let Some((name, dims)) = extra {
            let n: u64 = dims.iter().product();
            w.add_f32(name, &dims, &vec![0.5; n as usize]);
        }
        w.to_bytes()
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "block_count 2^31",
            with(&f, "qwen35.block_count", Value::U32(1 << 31), None),
        ),
        (
            "block_count u64",
            with(&f, "qwen35.block_count", Value::U64(1 << 62), None),
        ),
        (
            "NaN eps",
            with(
                &f,
                "qwen35.attention.layer_norm_rms_epsilon",
                Value::F32(f32::NAN),
                None,
            ),
        ),
        (
            "negative eps",
            with(
                &f,
                "qwen35.attention.layer_norm_rms_epsilon",
                Value::F32(-1e-6),
                None,
            ),
        ),
        (
            "rope base 0",
            with(&f, "qwen35.rope.freq_base", Value::F32(0.0), None),
        ),
        (
            "block_count below the table",
            with(&f, "qwen35.block_count", Value::U32(5), None),
        ),
        (
            "extra unknown tensor",
            with(
                &f,
                "general.name",
                Value::String("x".into()),
                Some(("mystery.weight", vec![8])),
            ),
        ),
        (
            "empty weight_names beside PQ2_0",
            with(
                &pq,
                "prism.hadamard.weight_names",
                Value::Array(ValueType::String, vec![]),
                None,
            ),
        ),
    ];
    for (what, bytes) in cases {
        let v = fuzz::guarded(|| gguf::run(bytes));
        assert_eq!(v.outcome, Outcome::CleanError, "{what}: {}", v.detail);
    }
}
