//! `cargo xtask fuzz`: the structure-aware fuzz suite (`tern::fuzz`) run at length.
//!
//! Cases run in worker processes (this binary, `fuzz-worker`), each under an address-space
//! limit so that an allocation sized by a hostile header fails there instead of swapping the
//! machine, and each watched: a worker that dies in a case counts it as an abort, one that
//! stays in a case past the hang limit is killed and the case counts as a hang; either way a
//! fresh worker resumes after it. Every case is a function of (seed, index), so a failure is
//! replayed with `--case INDEX`; its input is written to `target/fuzz/`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tern::fuzz::{self, Outcome};

pub const DEFAULT_SEED: u64 = 0x7465_726e_6675_7a7a;

#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    Gguf,
    Request,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Gguf => "gguf",
            Target::Request => "request",
        }
    }
    pub fn parse_list(s: &str) -> Result<Vec<Target>> {
        Ok(match s {
            "gguf" => vec![Target::Gguf],
            "request" => vec![Target::Request],
            "all" => vec![Target::Gguf, Target::Request],
            _ => bail!("--target is gguf, request or all"),
        })
    }
}

pub struct Options {
    pub targets: Vec<Target>,
    pub seconds: Option<u64>,
    pub cases: Option<u64>,
    pub seed: u64,
    pub jobs: usize,
    pub mem_mib: u64,
    pub hang_s: u64,
    pub start: u64,
    pub one_case: Option<u64>,
}

/// The seed files: the committed fixtures (every weight type, tied and untied, MTP, a fold)
/// and the demo model.
pub fn gguf_seeds(root: &Path) -> Result<Vec<fuzz::gguf::Seed>> {
    let names = [
        "fixtures/tiny-q8_0.gguf",
        "fixtures/tiny-pq2_0.gguf",
        "fixtures/tiny-tied-q8_0.gguf",
        "fixtures/tiny-q4_0.gguf",
        "fixtures/tiny-bf16.gguf",
    ];
    names
        .iter()
        .map(|n| {
            let bytes = std::fs::read(root.join(n)).with_context(|| n.to_string())?;
            fuzz::gguf::Seed::new(n, bytes).map_err(anyhow::Error::msg)
        })
        .collect()
}

/// The worker: runs cases `from..to` of one target, one line per case on stdout
/// (`S index` when it starts, `D index outcome micros detail` when it is done).
pub fn worker(root: &Path, target: Target, seed: u64, from: u64, to: u64) -> Result<()> {
    fuzz::quiet_panics();
    let out = std::io::stdout();
    let mut out = out.lock();
    let mut run = |i: u64, f: &mut dyn FnMut(u64) -> fuzz::Verdict| -> Result<()> {
        writeln!(out, "S {i}")?;
        out.flush()?;
        let t0 = Instant::now();
        let v = fuzz::guarded(|| f(i));
        let detail = v.detail.replace(['\n', '\r'], " ");
        writeln!(
            out,
            "D {i} {} {} {detail}",
            v.outcome.name(),
            t0.elapsed().as_micros()
        )?;
        out.flush()?;
        Ok(())
    };
    match target {
        Target::Gguf => {
            let seeds = gguf_seeds(root)?;
            for i in from..to {
                run(i, &mut |i| {
                    let (bytes, _) = fuzz::gguf::case(&seeds, seed, i);
                    fuzz::gguf::run(bytes)
                })?;
            }
        }
        Target::Request => {
            let t = fuzz::request::Target::new()?;
            for i in from..to {
                run(i, &mut |i| t.run(&t.case(seed, i)))?;
            }
        }
    }
    Ok(())
}

struct Worker {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// The case it is in, and since when.
    current: Option<(u64, Instant)>,
    next: u64,
    to: u64,
}

fn spawn(target: Target, o: &Options, from: u64, to: u64) -> Result<Worker> {
    let exe = std::env::current_exe()?;
    let kib = o.mem_mib * 1024;
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {kib} && exec \"$0\" \"$@\""))
        .arg(&exe)
        .args([
            "fuzz-worker",
            target.name(),
            &o.seed.to_string(),
            &from.to_string(),
            &to.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Ok(Worker {
        child,
        lines: rx,
        current: None,
        next: from,
        to,
    })
}

#[derive(Default)]
struct Tally {
    counts: BTreeMap<Outcome, u64>,
    micros: u128,
    failures: Vec<(u64, Outcome, String)>,
    /// Clean errors by their first words, to see what the refusals are.
    reasons: BTreeMap<String, u64>,
}

impl Tally {
    fn add(&mut self, i: u64, o: Outcome, us: u128, detail: &str) {
        *self.counts.entry(o).or_default() += 1;
        self.micros += us;
        if o.is_failure() {
            self.failures.push((i, o, detail.to_string()));
        }
        if o == Outcome::CleanError {
            *self.reasons.entry(reason_key(detail)).or_default() += 1;
        }
    }
    fn total(&self) -> u64 {
        self.counts.values().sum()
    }
}

/// A refusal's message with the particulars blanked (quoted names to `_`, numbers to `#`), so
/// that refusals of one kind count together.
fn reason_key(detail: &str) -> String {
    let detail = detail.strip_prefix("fuzz.gguf: ").unwrap_or(detail);
    let mut out = String::new();
    let mut quoted = false;
    let mut prev_digit = false;
    for c in detail.chars() {
        if c == '"' {
            if !quoted {
                out.push('_');
            }
            quoted = !quoted;
            continue;
        }
        if quoted {
            continue;
        }
        if c.is_ascii_digit() {
            if !prev_digit {
                out.push('#');
            }
            prev_digit = true;
            continue;
        }
        prev_digit = false;
        out.push(c);
        if out.chars().count() >= 64 {
            break;
        }
    }
    out
}

fn status_text(st: Option<std::process::ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match st {
        Some(s) => match s.signal() {
            Some(sig) => format!("killed by signal {sig}"),
            None => format!("exited with {s}"),
        },
        None => "gone".into(),
    }
}

/// Runs one target until its share of the cases or time is used up.
fn run_target(target: Target, o: &Options, deadline: Option<Instant>) -> Result<Tally> {
    let mut tally = Tally::default();
    let chunk = 5_000u64;
    let total = o.cases.unwrap_or(u64::MAX);
    let mut handed = o.start;
    let end = o.start.saturating_add(total);
    let mut workers: Vec<Worker> = Vec::new();
    let hang = Duration::from_secs(o.hang_s);
    let t0 = Instant::now();
    let mut last_report = Instant::now();
    loop {
        let time_up = deadline.is_some_and(|d| Instant::now() >= d);
        // Keep every job busy with a chunk of cases.
        while !time_up && workers.len() < o.jobs && handed < end {
            let to = (handed + chunk).min(end);
            workers.push(spawn(target, o, handed, to)?);
            handed = to;
        }
        if workers.is_empty() {
            break;
        }
        let mut i = 0;
        while i < workers.len() {
            let w = &mut workers[i];
            let mut restart: Option<u64> = None;
            let mut finished = false;
            loop {
                match w.lines.recv_timeout(Duration::from_millis(20)) {
                    Ok(line) => {
                        let mut parts = line.splitn(5, ' ');
                        match (
                            parts.next(),
                            parts.next().and_then(|x| x.parse::<u64>().ok()),
                        ) {
                            (Some("S"), Some(k)) => w.current = Some((k, Instant::now())),
                            (Some("D"), Some(k)) => {
                                let outcome = parts.next().and_then(Outcome::parse);
                                let us = parts.next().and_then(|x| x.parse().ok()).unwrap_or(0);
                                let detail = parts.next().unwrap_or("");
                                if let Some(oc) = outcome {
                                    tally.add(k, oc, us, detail);
                                }
                                w.current = None;
                                w.next = k + 1;
                            }
                            _ => {}
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        if let Some((k, since)) = w.current {
                            if since.elapsed() > hang {
                                let _ = w.child.kill();
                                let _ = w.child.wait();
                                tally.add(
                                    k,
                                    Outcome::Hang,
                                    since.elapsed().as_micros(),
                                    &format!("no answer in {} s", o.hang_s),
                                );
                                restart = Some(k + 1);
                            }
                        }
                        break;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        let st = w.child.wait().ok();
                        match w.current {
                            Some((k, since)) => {
                                tally.add(
                                    k,
                                    Outcome::Abort,
                                    since.elapsed().as_micros(),
                                    &status_text(st),
                                );
                                restart = Some(k + 1);
                            }
                            None if w.next < w.to => {
                                // Died between cases (at startup): nothing to resume from.
                                bail!("{} worker {}", target.name(), status_text(st));
                            }
                            None => finished = true,
                        }
                        break;
                    }
                }
            }
            if let Some(from) = restart {
                let to = w.to;
                let time_up = deadline.is_some_and(|d| Instant::now() >= d);
                if from < to && !time_up {
                    workers[i] = spawn(target, o, from, to)?;
                } else {
                    workers.remove(i);
                    continue;
                }
            } else if finished {
                workers.remove(i);
                continue;
            } else if deadline.is_some_and(|d| Instant::now() >= d) && workers[i].current.is_none()
            {
                let _ = workers[i].child.kill();
                let _ = workers[i].child.wait();
                workers.remove(i);
                continue;
            }
            i += 1;
        }
        if last_report.elapsed() > Duration::from_secs(30) {
            last_report = Instant::now();
            eprintln!(
                "[fuzz] {} {} cases in {:.0} s",
                target.name(),
                tally.total(),
                t0.elapsed().as_secs_f64()
            );
        }
    }
    Ok(tally)
}

fn write_repro(root: &Path, target: Target, seed: u64, i: u64) -> Result<PathBuf> {
    let dir = root.join("target/fuzz");
    std::fs::create_dir_all(&dir)?;
    let (bytes, note, ext) = match target {
        Target::Gguf => {
            let seeds = gguf_seeds(root)?;
            let (b, n) = fuzz::gguf::case(&seeds, seed, i);
            (b, n, "gguf")
        }
        Target::Request => {
            let t = fuzz::request::Target::new()?;
            let c = t.case(seed, i);
            let b = match &c {
                fuzz::request::Case::Http { body, .. } => body.clone(),
                fuzz::request::Case::ToolText { text, .. } => text.as_bytes().to_vec(),
            };
            (b, c.note(), "bin")
        }
    };
    let p = dir.join(format!("{}-{seed:x}-{i}.{ext}", target.name()));
    std::fs::write(&p, bytes)?;
    std::fs::write(p.with_extension("txt"), note)?;
    Ok(p)
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    if let Some(i) = o.one_case {
        fuzz::quiet_panics();
        for &t in &o.targets {
            let (v, note) = match t {
                Target::Gguf => {
                    let seeds = gguf_seeds(root)?;
                    let (bytes, note) = fuzz::gguf::case(&seeds, o.seed, i);
                    (fuzz::guarded(|| fuzz::gguf::run(bytes)), note)
                }
                Target::Request => {
                    let tg = fuzz::request::Target::new()?;
                    let c = tg.case(o.seed, i);
                    (fuzz::guarded(|| tg.run(&c)), c.note())
                }
            };
            println!(
                "{} case {i}: {}\n  input: {note}\n  {}",
                t.name(),
                v.outcome.name(),
                v.detail
            );
        }
        return Ok(());
    }
    let t_all = Instant::now();
    let n_t = o.targets.len() as u32;
    let mut failed = 0;
    let mut summary = Vec::new();
    for (k, &t) in o.targets.iter().enumerate() {
        // The time is split evenly over the targets.
        let deadline = o.seconds.map(|s| {
            let share = Duration::from_secs(s) / n_t;
            t_all + share * (k as u32 + 1)
        });
        let t0 = Instant::now();
        let tally = run_target(t, o, deadline)?;
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "{}: {} cases in {secs:.0} s ({:.0} cases/s, mean {:.2} ms/case) seed {:#x}",
            t.name(),
            tally.total(),
            tally.total() as f64 / secs.max(1e-9),
            tally.micros as f64 / 1e3 / tally.total().max(1) as f64,
            o.seed
        );
        for oc in Outcome::ALL {
            println!(
                "  {:<15} {}",
                oc.name(),
                tally.counts.get(&oc).copied().unwrap_or(0)
            );
        }
        let mut reasons: Vec<_> = tally.reasons.iter().collect();
        reasons.sort_by(|a, b| b.1.cmp(a.1));
        println!("  most frequent refusals:");
        for (r, n) in reasons.iter().take(12) {
            println!("    {n:>7}  {r}");
        }
        for (i, oc, detail) in tally.failures.iter().take(20) {
            let p = write_repro(root, t, o.seed, *i)?;
            println!(
                "  FAIL {} case {i}: {detail}\n    input: {}",
                oc.name(),
                p.display()
            );
        }
        failed += tally.failures.len();
        summary.push(serde_json::json!({
            "target": t.name(),
            "seed": format!("{:#x}", o.seed),
            "cases": tally.total(),
            "seconds": secs,
            "outcomes": Outcome::ALL.iter().map(|oc| (oc.name().to_string(), serde_json::json!(tally.counts.get(oc).copied().unwrap_or(0)))).collect::<serde_json::Map<_, _>>(),
        }));
    }
    let dir = root.join("target/fuzz");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    if failed > 0 {
        bail!("{failed} failing cases (panic, abort, hang or silent NaN)");
    }
    Ok(())
}
