//! `cargo xtask bench --step [--decode N] [FILE...]`: where the wall time of a one-row decode
//! step goes on the CPU serving path (int8 activations), against the memory roofline.
//!
//! Per file: the bytes a token reads, the step's median wall time, and the same matrices run
//! class by class (the products a step runs, with its inputs' shapes; grouped as
//! `matmul_many` runs them and one matrix at a time) so that the step splits into matmul time
//! per class and the rest (norms, the mixers' cores, rayon's wake-ups), and of the rest the
//! GDN cores against their state's bytes. The roofline is what this machine's threads
//! stream from memory in a plain read loop. Wall time on a shared machine measures the
//! neighbours too: the load average is printed beside it.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use rayon::prelude::*;
use tern::backend::cpu::{CpuBackend, Recurrent, Weight};
use tern::backend::{Backend, GdnSeq};
use tern::model::weights::Mixer;
use tern::model::Model;

use crate::bench::{load_average, median, prompt, streamed_bytes};

/// Read bandwidth of `threads` threads each summing its share of a buffer larger than the
/// caches, in GB/s of wall time (the best of three passes).
pub(crate) fn read_bandwidth(buf: &[u64], threads: usize) -> f64 {
    let share = buf.len().div_ceil(threads);
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(share)
                .map(|c| {
                    s.spawn(move || {
                        // Eight independent lanes, so the loop vectorizes and is bound by loads.
                        let mut acc = [0u64; 8];
                        for v in c.chunks_exact(8) {
                            for (a, &x) in acc.iter_mut().zip(v) {
                                *a = a.wrapping_add(x);
                            }
                        }
                        acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        });
        std::hint::black_box(sums);
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::mem::size_of_val(buf) as f64 / best / 1e9
}

/// Voluntary context switches of this process's threads so far (each a thread that went to
/// sleep waiting for work or for a result: rayon's parks and wake-ups).
fn voluntary_switches() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .filter_map(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .sum()
}

/// Median wall ms of `reps` calls of `f`.
fn time_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

/// How `bench --step` has the serving path hold the matrices (`--copies`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Copies {
    /// As `serve` does on this CPU (`CpuBackend::int8`).
    Native,
    /// As a CPU without the packed kernels does (`CpuBackend::int8_transcoded`).
    Transcoded,
    /// Every matrix read as stored (`CpuBackend::int8_unpacked`).
    Stored,
}

pub fn run(files: &[PathBuf], decode: usize, rows: usize, held: Copies) -> Result<()> {
    let threads = rayon::current_num_threads();
    println!("{} | rayon threads {threads}", load_average());
    // 512 MiB, touched once so that the passes read memory, not fresh zero pages.
    let buf: Vec<u64> = (0..64u64 << 20).collect();
    for n in [1, threads] {
        println!(
            "read bandwidth, {n} thread(s): {:.2} GB/s",
            read_bandwidth(&buf, n)
        );
    }
    drop(buf);
    let region = |inside: bool| {
        let empty = || {
            (0..threads).into_par_iter().for_each(|i| {
                std::hint::black_box(i);
            })
        };
        let reps = 2000;
        let t = Instant::now();
        if inside {
            rayon::scope(|_| (0..reps).for_each(|_| empty()));
        } else {
            (0..reps).for_each(|_| empty());
        }
        t.elapsed().as_secs_f64() * 1e6 / reps as f64
    };
    println!(
        "an empty parallel region: {:.1} µs from the calling thread, {:.1} µs from a worker",
        region(false),
        region(true)
    );
    for f in files {
        let be = match held {
            Copies::Native => CpuBackend::int8(),
            Copies::Transcoded => CpuBackend::int8_transcoded(),
            Copies::Stored => CpuBackend::int8_unpacked(),
        };
        let m = Model::open(&be, f).with_context(|| format!("loading {}", f.display()))?;
        let cfg = &m.cfg;
        let streamed = streamed_bytes(&m.file);
        let mut st = m.new_state(&be);
        let p = prompt(128);
        m.forward(&be, &mut st, &p, false)?;
        // `Model::forward` runs the step as `Backend::run_step` does: on a worker of the pool,
        // the other workers kept hot (each part below is timed the same way).
        let mut logits = None;
        let mut tok = 256u32;
        let (mut step_ms, mut switches) = (Vec::new(), 0.0);
        for _ in 0..3 {
            let sw = voluntary_switches();
            step_ms.push(time_ms(decode, || {
                let out = m.forward(&be, &mut st, &[tok], false).expect("decode step");
                tok = be.argmax_rows(&out.logits)[0] % 200 + 256;
                logits = Some(out.logits);
            }));
            switches = (voluntary_switches() - sw) as f64 / decode as f64;
        }
        let step = median(step_ms);
        let logits = logits.context("no decode step ran")?;
        let argmax = time_ms(decode, || {
            std::hint::black_box(be.argmax_rows(&logits));
        });
        // Each class's products over every layer, with a step's input shapes.
        // `rows` token rows (a few streams' step), the same activations in each.
        let row = |cols: usize| {
            let x: Vec<f32> = crate::bench::bench_acts(cols).repeat(rows);
            be.from_host(&x, rows, cols)
        };
        let (h, ff, attn) = (
            row(cfg.n_embd),
            row(cfg.n_ff),
            row(cfg.n_head * cfg.head_dim),
        );
        let gdn_y = row(cfg.ssm_inner);
        let w = &m.w;
        // Each class: the groups of matrices one step multiplies together, and their input.
        type Group<'a> = Vec<&'a tern::backend::cpu::Weight>;
        let mut sets: Vec<(&str, Vec<Group>, &tern::backend::cpu::Tensor)> = vec![
            ("GDN in (qkv, gate, beta, alpha)", Vec::new(), &h),
            ("GDN out (ssm_out)", Vec::new(), &gdn_y),
            ("attention in (q, k, v)", Vec::new(), &h),
            ("attention out (o)", Vec::new(), &attn),
            ("FFN gate + up", Vec::new(), &h),
            ("FFN down", Vec::new(), &ff),
            ("output head", vec![vec![&w.output]], &h),
        ];
        for l in &w.layers {
            match &l.mixer {
                Mixer::Gdn(g) => {
                    sets[0].1.push(vec![&g.qkv, &g.gate, &g.beta, &g.alpha]);
                    sets[1].1.push(vec![&g.out]);
                }
                Mixer::Attn(a) => {
                    sets[2].1.push(vec![&a.q, &a.k, &a.v]);
                    sets[3].1.push(vec![&a.o]);
                }
            }
            sets[4].1.push(vec![&l.ffn_gate, &l.ffn_up]);
            sets[5].1.push(vec![&l.ffn_down]);
        }
        // Each class as a step runs it (`matmul_many` per group) and, where a group has
        // several matrices, one `matmul` (one parallel region) per matrix, in turns.
        let mut apart: Vec<(&str, f64)> = Vec::new();
        let classes: Vec<(&str, f64, u64)> = sets
            .iter()
            .map(|(name, groups, x)| {
                let (mut fused, mut each) = (Vec::new(), Vec::new());
                for _ in 0..3 {
                    fused.push(CpuBackend::run_step(|| {
                        time_ms(decode, || {
                            for g in groups {
                                std::hint::black_box(be.matmul_many(g, x));
                            }
                        })
                    }));
                    if groups.iter().any(|g| g.len() > 1) {
                        each.push(CpuBackend::run_step(|| {
                            time_ms(decode, || {
                                for w in groups.iter().flatten() {
                                    std::hint::black_box(be.matmul(w, x));
                                }
                            })
                        }));
                    }
                }
                if !each.is_empty() {
                    apart.push((name, median(each)));
                }
                let ms = median(fused);
                let bytes = groups
                    .iter()
                    .flatten()
                    .map(|w| {
                        // What the serving path reads: the packed copy where the matrix
                        // has one, else a decoded f32 copy, else the mapped bytes.
                        let b = be.weight_bytes(w);
                        [b.shared, b.owned, b.mapped]
                            .into_iter()
                            .find(|&n| n > 0)
                            .unwrap_or(0)
                    })
                    .sum();
                (*name, ms, bytes)
            })
            .collect();
        // The GDN cores of a step (every GDN layer, one row, on the decoded states): each
        // reads and writes its layer's state once.
        let gp = cfg.gdn_params();
        let (mixed, z) = (row(gp.conv_dim()), row(gp.n_v * gp.d));
        let (beta, alpha) = (row(gp.n_v), row(gp.n_v));
        // One layer's GDN core on a state, as a step runs it (attention layers have none).
        let core = |mixer: &Mixer<Weight>, rs: &mut Recurrent| {
            if let Mixer::Gdn(g) = mixer {
                let gw = g.core();
                std::hint::black_box(be.gdn(&gp, &mixed, &z, &beta, &alpha, &gw, rs));
            }
        };
        let mut cores = Vec::new();
        for _ in 0..3 {
            cores.push(CpuBackend::run_step(|| {
                time_ms(decode, || {
                    for (l, rs) in w.layers.iter().zip(st.rs.iter_mut()) {
                        if let Some(rs) = rs.as_mut() {
                            core(&l.mixer, rs);
                        }
                    }
                })
            }));
        }
        let gdn_ms = median(cores);
        let gdn_layers = st.rs.iter().flatten().count();
        let state_bytes = (gdn_layers * gp.ssm_state_len() * 4) as f64;
        // The same from memory, as a step finds them (its matmuls stream hundreds of MB
        // through the caches between two visits of a state): the calls cycle through enough
        // copies of the states to outgrow the last-level cache (32 MiB on the bench machine).
        let copies = (96e6 / state_bytes).ceil().max(2.0) as usize;
        let mut states: Vec<Vec<_>> = (0..copies)
            .map(|_| {
                st.rs
                    .iter()
                    .flatten()
                    .map(|r| {
                        let mut c = be.new_recurrent(&gp);
                        be.recurrent_copy(r, &mut c);
                        c
                    })
                    .collect()
            })
            .collect();
        // Three timed runs of `f(k)` over the copies in turn (k the copy), their median.
        let cycled = |f: &mut (dyn FnMut(usize) + Send)| {
            let runs = (0..3).map(|_| {
                let mut at = 0;
                CpuBackend::run_step(|| {
                    time_ms(decode.max(copies), || {
                        f(at % copies);
                        at += 1;
                    })
                })
            });
            median(runs.collect())
        };
        let gdn_cold_ms = cycled(&mut |k| {
            let gdn = w.layers.iter().filter(|l| matches!(l.mixer, Mixer::Gdn(_)));
            for (l, rs) in gdn.zip(states[k].iter_mut()) {
                core(&l.mixer, rs);
            }
        });
        // A depth-2 verify's GDN cores from memory, the same way: three rows on each layer's
        // state with two rollback cells, then the rollback a rejected first draft makes (the
        // state after row 0 kept), so each call also folds in the row the last one kept.
        let rows3 = |cols: usize| be.from_host(&crate::bench::bench_acts(cols).repeat(3), 3, cols);
        let (vm, vz) = (rows3(gp.conv_dim()), rows3(gp.n_v * gp.d));
        let (vb, va) = (rows3(gp.n_v), rows3(gp.n_v));
        let mut cells: Vec<Vec<Vec<Recurrent>>> = states
            .iter()
            .map(|s| {
                s.iter()
                    .map(|_| (0..2).map(|_| be.new_recurrent(&gp)).collect())
                    .collect()
            })
            .collect();
        let verify_ms = cycled(&mut |k| {
            let gdn = w.layers.iter().filter_map(|l| match &l.mixer {
                Mixer::Gdn(g) => Some(g),
                _ => None,
            });
            for ((g, rs), cs) in gdn.zip(states[k].iter_mut()).zip(cells[k].iter_mut()) {
                let mut seqs = [GdnSeq {
                    rows: 3,
                    state: &mut *rs,
                    cells: Some(&mut cs[..]),
                }];
                std::hint::black_box(be.gdn_batch(&gp, &vm, &vz, &vb, &va, &g.core(), &mut seqs));
                be.recurrent_restore(rs, &mut cs[0]);
            }
        });
        let matmul: f64 = classes.iter().map(|c| c.1).sum();
        println!(
            "\n{}: {:.1} MB read per token, {threads} threads, matmuls of {rows} token row(s), \
             matrices {held:?}",
            f.display(),
            streamed as f64 / 1e6
        );
        println!(
            "{:<36} {:>9} {:>7} {:>9} {:>7}",
            "part of a decode step", "ms", "share", "MB", "GB/s"
        );
        for (name, ms, mb) in classes.iter().copied().chain([
            (
                "matmul, all classes",
                matmul,
                classes.iter().map(|c| c.2).sum(),
            ),
            ("the rest (norms, mixers, wake-ups)", step - matmul, 0),
            ("argmax of the logits", argmax, 0),
            ("whole step (forward + argmax)", step, 0),
        ]) {
            let rate = if mb > 0 {
                format!("{:>9.1} {:>7.2}", mb as f64 / 1e6, mb as f64 / ms / 1e6)
            } else {
                String::new()
            };
            println!("{name:<36} {ms:>9.2} {:>6.1}% {rate}", 100.0 * ms / step);
        }
        for (name, ms) in &apart {
            println!("{name}, one region per matrix: {ms:.2} ms");
        }
        println!(
            "of the rest, the GDN cores ({gdn_layers} layers): {gdn_ms:.2} ms, their state \
             ({:.1} MB) read and written at {:.2} GB/s",
            state_bytes / 1e6,
            2.0 * state_bytes / gdn_ms / 1e6
        );
        println!(
            "  the same from memory ({copies} copies of the states in turn): {gdn_cold_ms:.2} ms, \
             {:.2} GB/s",
            2.0 * state_bytes / gdn_cold_ms / 1e6
        );
        println!(
            "  a depth-2 verify's from memory (3 rows, 2 rollback cells a layer, the first row \
             kept): {verify_ms:.2} ms, {:.2}x the one-row cores",
            verify_ms / gdn_cold_ms
        );
        println!(
            "weights streamed at {:.2} GB/s over the whole step, {:.2} GB/s over its matmuls; \
             voluntary context switches per step: {switches:.0}",
            streamed as f64 / step / 1e6,
            streamed as f64 / matmul / 1e6
        );
    }
    println!("{}", load_average());
    Ok(())
}
