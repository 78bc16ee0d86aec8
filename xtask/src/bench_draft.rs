//! Drafting in `cargo xtask bench`: what a draft round costs against a plain step, per depth,
//! from the engine's own per-phase timers (`bench --engine`), and the drafting and 3-stream
//! rows of the llama.cpp ratio table (`bench`).

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use serde_json::{json, Value};
use tern::backend::cpu::CpuBackend;
use tern::backend::Backend;
use tern::runtime::engine::{Engine, EngineConfig, Request};
use tern::runtime::sampler::SamplerConfig;
use tern::runtime::speculative::{break_even, RoundCostSummary, SpecConfig};

use crate::bench::{load_average, median, prompt};

/// Each slot's window: 1,024 positions, or the whole of a longer prompt and its decode.
fn config(parallel: usize, slot_ctx: usize, spec: Option<SpecConfig>) -> EngineConfig {
    EngineConfig {
        ctx_size: slot_ctx.max(1024) * parallel,
        parallel,
        ubatch: 512,
        kv_types: crate::bench::F16_KV,
        spec,
        draft_kv_types: crate::bench::F16_KV,
    }
}

/// An engine on `file` as `serve` starts one (the reduced draft head when drafting).
fn start<B: Backend + 'static>(
    be: B,
    g: &Arc<tern::gguf::Gguf>,
    parallel: usize,
    slot_ctx: usize,
    spec: Option<SpecConfig>,
) -> Result<Engine>
where
    B::W: 'static,
{
    let tok = Arc::new(tern::tokenizer::Tokenizer::from_gguf(g)?);
    let m = tern::plan::boot::load_model(&be, g.clone(), &[], spec.is_some())?;
    Ok(Engine::start(m, be, tok, config(parallel, slot_ctx, spec))?)
}

fn start_on(
    backend: &str,
    g: &Arc<tern::gguf::Gguf>,
    parallel: usize,
    slot_ctx: usize,
    spec: Option<SpecConfig>,
) -> Result<Engine> {
    match backend {
        "wgpu" => start(
            tern::backend::wgpu::WgpuBackend::new()?,
            g,
            parallel,
            slot_ctx,
            spec,
        ),
        _ => start(CpuBackend::int8(), g, parallel, slot_ctx, spec),
    }
}

/// `parallel` greedy streams of `decode` tokens after `prompt_tokens` of prompt (the same
/// prompt each time: a repeated run reuses it from the slot). Returns the aggregate decode t/s,
/// prompt t/s per stream and the engine's round costs afterwards.
fn run(
    e: &Engine,
    parallel: usize,
    prompt_tokens: usize,
    decode: usize,
) -> Result<(f64, f64, RoundCostSummary)> {
    run_prompt(e, parallel, prompt(prompt_tokens), decode)
}

/// `run` of a given prompt. The decode rate is taken over the window in which every stream
/// decodes (from the last stream's first token to the first stream's last), tokens arrived in
/// it over its length, from each token's arrival: streams that start decoding apart (the engine
/// took one request a step before the others) then count only steps of all of them, where
/// their own `predicted_ms` took in the others' prefill. For one stream this is its tokens
/// after the first over the time since it, one forward pass a token as llama-bench's `tg`.
fn run_prompt(
    e: &Engine,
    parallel: usize,
    tokens: Vec<u32>,
    decode: usize,
) -> Result<(f64, f64, RoundCostSummary)> {
    let hs: Vec<_> = (0..parallel)
        .map(|_| {
            e.submit(Request {
                prompt: tokens.clone(),
                max_tokens: decode,
                sampler: SamplerConfig::greedy(),
                ignore_eos: true,
                ..Default::default()
            })
        })
        .collect();
    let (rate, prompt_tps, _) = collect_streams(hs)?;
    // The worker publishes its counters right after the step that finished.
    std::thread::sleep(std::time::Duration::from_millis(100));
    Ok((rate, prompt_tps, e.metrics().round_costs))
}

/// Waits for every stream of a run, each on a thread of its own that notes when its tokens
/// arrive; returns the aggregate decode rate over the window in which every stream decodes
/// (`run_prompt`), the streams' mean prompt t/s and each stream's end.
pub(crate) fn collect_streams(
    hs: Vec<tern::runtime::engine::RequestHandle>,
) -> Result<(f64, f64, Vec<tern::runtime::engine::Finish>)> {
    use std::time::Instant;
    use tern::runtime::engine::Event;
    let streams: Vec<(Vec<Instant>, tern::runtime::engine::Finish)> = std::thread::scope(|sc| {
        let js: Vec<_> = hs
            .into_iter()
            .map(|h| {
                sc.spawn(move || -> Result<_> {
                    let mut at = Vec::new();
                    for ev in h.events.iter() {
                        match ev {
                            Event::Token { .. } => at.push(Instant::now()),
                            Event::Done(f) => return Ok((at, f)),
                            Event::Error(e) => return Err(anyhow!("{e}")),
                            _ => {}
                        }
                    }
                    Err(anyhow!("the engine stopped"))
                })
            })
            .collect();
        js.into_iter()
            .map(|j| {
                j.join()
                    .map_err(|_| anyhow!("a stream's reader panicked"))?
            })
            .collect::<Result<Vec<_>>>()
    })?;
    let arrivals: Vec<&[Instant]> = streams.iter().map(|s| s.0.as_slice()).collect();
    let rate = window_rate(&arrivals)?;
    let prompt_tps = streams
        .iter()
        .map(|(_, f)| f.timings.prompt_n as f64 / (f.timings.prompt_ms / 1e3).max(1e-9))
        .sum::<f64>()
        / streams.len() as f64;
    Ok((rate, prompt_tps, streams.into_iter().map(|s| s.1).collect()))
}

/// The aggregate decode rate over the window in which every stream decodes (from the last
/// stream's first token to the first stream's last), from each token's arrival at its reader.
/// Each stream's rate is its own tokens in the window over the time between its first and its
/// last of them, and the streams' rates add up. Counting every stream's tokens inside the
/// window's bounds instead is biased: the readers wake a little apart, so of the tokens a
/// step gives at the window's end, only the one that set the end is inside it (the others
/// arrive after), and the window held a whole step's time but a third of its tokens (3
/// streams of 32 tokens: 91 counted where 31 steps gave 93, 2.2% short).
pub(crate) fn window_rate(arrivals: &[&[std::time::Instant]]) -> Result<f64> {
    let t0 = arrivals.iter().filter_map(|a| a.first()).max();
    let t1 = arrivals.iter().filter_map(|a| a.last()).min();
    let (Some(&t0), Some(&t1)) = (t0, t1) else {
        return Err(anyhow!("a stream decoded no token"));
    };
    let mut rate = 0.0;
    for a in arrivals {
        let inside: Vec<_> = a.iter().filter(|&&t| t >= t0 && t <= t1).collect();
        let (Some(&&first), Some(&&last)) = (inside.first(), inside.last()) else {
            return Err(anyhow!("a stream decoded no token while all decoded"));
        };
        if inside.len() < 2 {
            return Err(anyhow!(
                "a stream decoded fewer than two tokens while all decoded"
            ));
        }
        let span = last.saturating_duration_since(first).as_secs_f64();
        rate += (inside.len() - 1) as f64 / span.max(1e-9);
    }
    Ok(rate)
}

/// A fixed depth (what a cost measurement needs: the adaptive policy would drop a random head's
/// drafts).
fn fixed(depth: usize) -> SpecConfig {
    SpecConfig {
        n_max: depth,
        adaptive: false,
        ..SpecConfig::default()
    }
}

/// `bench --engine`'s draft-round table: for depth 1, 2 and 3, one MTP draft step, the verify
/// step of `depth + 1` rows and a plain step (an engine without drafting), from the engines'
/// own timers. The four engines stay up and take turns, `rounds` x 4 requests of `decode`
/// tokens each, so every figure is measured across the same stretch of a shared machine's
/// load: each request's medians (of the engine's latest 64 steps), then the median over
/// requests. A round's cost in plain steps is `depth` draft steps + the verify; it breaks even
/// at the per-position acceptance `a` with `1 + a + .. + a^depth` = that cost.
pub fn round_costs(file: &Path, backend: &str, decode: usize, rounds: usize) -> Result<Value> {
    let g = Arc::new(tern::gguf::Gguf::open(file)?);
    if !tern::model::Config::from_gguf(&g)?.has_mtp() {
        return Err(anyhow!("{} has no MTP block to draft with", file.display()));
    }
    let depths = [1usize, 2, 3];
    let plain_engine = start_on(backend, &g, 1, 0, None)?;
    let engines = depths
        .iter()
        .map(|&d| start_on(backend, &g, 1, 0, Some(fixed(d))))
        .collect::<Result<Vec<_>>>()?;
    let (mut plain, mut draft, mut verify) = (Vec::new(), vec![Vec::new(); 3], vec![Vec::new(); 3]);
    for round in 0..4 * rounds {
        if round % 4 == 0 {
            eprintln!(
                "draft rounds {}/{}, {}",
                round + 1,
                4 * rounds,
                load_average()
            );
        }
        let (_, _, c) = run(&plain_engine, 1, 64, decode)?;
        plain.push(
            c.forward(1)
                .ok_or_else(|| anyhow!("no plain step was timed"))?,
        );
        for (k, (&d, e)) in depths.iter().zip(&engines).enumerate() {
            let (_, _, c) = run(e, 1, 64, decode)?;
            draft[k].push(
                c.draft_step_s
                    .ok_or_else(|| anyhow!("no draft step was timed"))?,
            );
            verify[k].push(
                c.forward(d + 1)
                    .ok_or_else(|| anyhow!("no verify step of {} rows was timed", d + 1))?,
            );
        }
    }
    let plain = median(plain);
    println!(
        "\ndraft rounds on {} ({backend}, reduced draft head as serve loads it), medians; {}",
        file.display(),
        load_average()
    );
    println!(
        "{:>6} {:>14} {:>12} {:>12} {:>14} {:>12}",
        "depth", "draft step ms", "verify ms", "plain ms", "round / plain", "break-even a"
    );
    let mut rows = Vec::new();
    for (k, &d) in depths.iter().enumerate() {
        let (ds, vs) = (median(draft[k].clone()), median(verify[k].clone()));
        let ratio = (d as f64 * ds + vs) / plain;
        let be = break_even(d, ratio);
        println!(
            "{:>6} {:>14.3} {:>12.3} {:>12.3} {:>14.3} {:>12}",
            d,
            ds * 1e3,
            vs * 1e3,
            plain * 1e3,
            ratio,
            be.map_or("never".to_string(), |a| format!("{:.1}%", 100.0 * a))
        );
        rows.push(json!({"depth": d, "draft_step_ms": ds * 1e3, "verify_ms": vs * 1e3,
            "verify_rows": d + 1, "plain_ms": plain * 1e3, "round_over_plain": ratio,
            "break_even_acceptance": be, "draft_step_ms_rounds": draft[k], "verify_ms_rounds": verify[k]}));
    }
    Ok(
        json!({"file": file.display().to_string(), "backend": backend, "decode_tokens": decode,
        "rounds": rounds, "load_average_after": load_average(), "depths": rows}),
    )
}

/// The engine's rows of the llama.cpp ratio table on `file` (cpu, the serving path, as
/// `serve` runs it): one stream without and with drafting (`--spec-type draft-mtp`, adaptive
/// depth up to 3, the reduced draft head), and three streams without drafting (aggregate t/s;
/// prompt t/s per stream). llama-bench has neither MTP drafting nor concurrent streams: these
/// rows' ratios are to its plain one-stream decode.
///
/// The three engines take `TURNS` turns of one run each; the medians are the figures. Each
/// turn's prompt differs from the last in its first token, so no slot reuses it: three streams
/// reusing a repeated prompt unevenly started decoding apart, and the first one's decode time
/// took in the others' prefill (3 streams at 46-52 t/s against 80 when they prefilled
/// together). Three streams over one is a ratio of two of tern's own runs, so it is taken
/// within each turn (runs seconds apart) and its median kept: the bench machine's memory bus
/// drifts between minutes, and one run of each put it at 2.57 one day and 2.15 the next.
pub fn llama_table_rows(file: &Path, prompt_tokens: usize, decode: usize) -> Result<Vec<Value>> {
    const TURNS: usize = 3;
    let g = Arc::new(tern::gguf::Gguf::open(file)?);
    let has_mtp = tern::model::Config::from_gguf(&g)?.has_mtp();
    let kinds: Vec<(&str, usize, Option<SpecConfig>)> = [
        ("eng", 1, None),
        ("eng-mtp", 1, Some(SpecConfig::default())),
        ("eng-x3", 3, None),
    ]
    .into_iter()
    .filter(|k| k.2.is_none() || has_mtp)
    .collect();
    let engines = kinds
        .iter()
        .map(|(_, n, spec)| start_on("cpu", &g, *n, prompt_tokens + decode + 16, spec.clone()))
        .collect::<Result<Vec<_>>>()?;
    let mut prefill = vec![Vec::new(); kinds.len()];
    let mut decode_tps = vec![Vec::new(); kinds.len()];
    for turn in 0..TURNS {
        eprintln!(
            "tern {} on {}, turn {}/{TURNS} ...",
            kinds.iter().map(|k| k.0).collect::<Vec<_>>().join(", "),
            file.display(),
            turn + 1,
        );
        let mut tokens = prompt(prompt_tokens);
        tokens[0] += turn as u32;
        for (k, e) in engines.iter().enumerate() {
            let (tps, ptps, _) = run_prompt(e, kinds[k].1, tokens.clone(), decode)?;
            prefill[k].push(ptps);
            decode_tps[k].push(tps);
        }
    }
    // The filter above drops only the drafting kind: "eng" is first, "eng-x3" last.
    let x3_over_one: Vec<f64> = decode_tps[kinds.len() - 1]
        .iter()
        .zip(&decode_tps[0])
        .map(|(m, o)| m / o)
        .collect();
    Ok(kinds
        .iter()
        .zip(prefill)
        .zip(decode_tps)
        .map(|(((label, streams, spec), ptps), d)| {
            let mut row = json!({"engine": "tern", "backend": label, "streams": streams,
                "drafting": spec.is_some(), "prefill_tps": median(ptps.clone()),
                "prefill_tps_turns": ptps, "decode_tps": median(d.clone()), "decode_tps_turns": d});
            if *streams == 3 {
                row["over_one_stream"] = json!(median(x3_over_one.clone()));
                row["over_one_stream_turns"] = json!(x3_over_one);
            }
            row
        })
        .collect())
}

/// `bench --engine --phases`: where a decode step's time goes, from the engine's phase timers
/// (`tern::model::phase`): a plain step of one stream, a step of three streams and a draft
/// round of depth 2 (two MTP steps and a verify of three rows, fixed depth). The three engines
/// take turns, `rounds` requests of `decode` tokens after `prompt_tokens` of prompt each (the
/// depth sets what the attention cores read); every figure is the median over the steps of its
/// kind, `other` the median of what the phases leave of a step's wall time.
pub fn phases(
    file: &Path,
    backend: &str,
    prompt_tokens: usize,
    decode: usize,
    rounds: usize,
) -> Result<Value> {
    use tern::model::phase::{self, Phase};
    let g = Arc::new(tern::gguf::Gguf::open(file)?);
    let has_mtp = tern::model::Config::from_gguf(&g)?.has_mtp();
    // (label, streams, drafting, trunk rows and drafts of the steps it times)
    let mut kinds = vec![
        ("1 stream", 1, None, (1, 0)),
        ("3 streams", 3, None, (3, 0)),
    ];
    if has_mtp {
        kinds.push(("depth 2", 1, Some(fixed(2)), (3, 2)));
    }
    let engines = kinds
        .iter()
        .map(|&(_, n, ref spec, _)| {
            start_on(backend, &g, n, prompt_tokens + decode + 16, spec.clone())
        })
        .collect::<Result<Vec<_>>>()?;
    phase::enable(true);
    let mut steps = vec![Vec::new(); kinds.len()];
    // Each run's wall time per decoded token of a stream (`run_prompt`'s window), beside the
    // steps' own timers: what the engine spends outside its steps shows as the difference.
    let mut wall = vec![Vec::new(); kinds.len()];
    for r in 0..rounds.max(1) {
        eprintln!("phases {}/{}, {}", r + 1, rounds.max(1), load_average());
        // Each round's prompt differs in its first token, so no slot starts from a reused one.
        let mut tokens = prompt(prompt_tokens);
        tokens[0] += r as u32;
        for (k, e) in engines.iter().enumerate() {
            let (tps, ..) = run_prompt(e, kinds[k].1, tokens.clone(), decode)?;
            wall[k].push(kinds[k].1 as f64 / tps * 1e3);
            let want = kinds[k].3;
            steps[k].extend(
                phase::take_steps()
                    .into_iter()
                    .filter(|s| (s.rows, s.drafted) == want),
            );
        }
    }
    phase::enable(false);
    let ms = |v: Vec<f64>| {
        if v.is_empty() {
            f64::NAN
        } else {
            median(v) * 1e-6
        }
    };
    println!(
        "\nstep phases on {} ({backend}), medians in ms; {}",
        file.display(),
        load_average()
    );
    print!("{:<12}", "phase");
    for (label, ..) in &kinds {
        print!(" {label:>10}");
    }
    println!();
    let mut table = Vec::new();
    let mut line = |name: &str, f: &dyn Fn(&phase::StepPhases) -> f64| {
        let v: Vec<f64> = steps
            .iter()
            .map(|s| ms(s.iter().map(f).collect()))
            .collect();
        print!("{name:<12}");
        for x in &v {
            print!(" {x:>10.3}");
        }
        println!();
        table.push(json!({"phase": name, "ms": v}));
    };
    for p in Phase::ALL {
        line(p.name(), &|s| s.ns[p as usize] as f64);
    }
    line("other", &|s| {
        s.total_ns.saturating_sub(s.ns.iter().sum::<u64>()) as f64
    });
    line("step", &|s| s.total_ns as f64);
    let total: Vec<f64> = steps
        .iter()
        .map(|s| ms(s.iter().map(|s| s.total_ns as f64).collect()))
        .collect();
    print!("{:<12}", "÷ 1 stream");
    for t in &total {
        print!(" {:>10.3}", t / total[0]);
    }
    println!();
    let wall: Vec<f64> = wall.into_iter().map(median).collect();
    print!("{:<12}", "wall/token");
    for w in &wall {
        print!(" {w:>10.3}");
    }
    println!();
    println!(
        "steps timed: {}",
        steps
            .iter()
            .map(|s| s.len().to_string())
            .collect::<Vec<_>>()
            .join(" / ")
    );
    Ok(
        json!({"file": file.display().to_string(), "backend": backend, "prompt_tokens": prompt_tokens, "decode_tokens": decode,
        "rounds": rounds, "kinds": kinds.iter().map(|k| k.0).collect::<Vec<_>>(),
        "steps": steps.iter().map(Vec::len).collect::<Vec<_>>(), "phases": table,
        "over_one_stream": total.iter().map(|t| t / total[0]).collect::<Vec<_>>(),
        "wall_ms_per_stream_token": wall,
        "load_average_after": load_average()}),
    )
}

#[cfg(test)]
mod tests {
    use super::window_rate;
    use std::time::{Duration, Instant};

    /// Steps of 10 ms, each giving one token to every decoding stream; the readers note a
    /// token up to 0.9 ms late, each differently.
    fn arrivals(start_step: &[usize], steps: usize) -> Vec<Vec<Instant>> {
        let base = Instant::now();
        start_step
            .iter()
            .enumerate()
            .map(|(s, &from)| {
                (from..steps)
                    .map(|k| {
                        let late = ((s * 7 + k * 13) % 10) as u64 * 90;
                        base + Duration::from_millis(10 * k as u64) + Duration::from_micros(late)
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn streams_decoding_together_add_up_to_their_step_rate() {
        for starts in [vec![0], vec![0, 0, 0], vec![0, 1, 0], vec![2, 0, 1, 0]] {
            let a = arrivals(&starts, 32);
            let refs: Vec<&[Instant]> = a.iter().map(|v| v.as_slice()).collect();
            let r = window_rate(&refs).unwrap();
            let want = 100.0 * starts.len() as f64;
            // The readers' lateness moves each stream's ends by under 0.9 ms over ~300 ms.
            assert!(
                (r - want).abs() / want < 0.005,
                "{starts:?}: {r} t/s, want {want}"
            );
        }
    }

    #[test]
    fn a_stream_without_tokens_in_the_window_is_an_error() {
        let a = arrivals(&[0, 0], 32);
        let refs: Vec<&[Instant]> = vec![&a[0], &a[1][..1]];
        assert!(window_rate(&refs).is_err());
        let empty: Vec<&[Instant]> = vec![&a[0], &[]];
        assert!(window_rate(&empty).is_err());
    }
}
