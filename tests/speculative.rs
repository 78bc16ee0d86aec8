//! MTP self-speculation keeps greedy output exact: drafting on or off gives the same tokens,
//! an oracle drafter is fully accepted, a wrong draft is rolled back exactly.

mod common;

use std::path::Path;

use tern::backend::Backend;
use tern::model::{BatchItem, Model, MtpRows};
use tern::runtime::sampler::{Sampler, SamplerConfig};
use tern::runtime::speculative::{
    break_even, expected_tokens, AdaptiveDepth, Company, Generator, RoundCosts, SpecConfig,
    HELD_ROWS, PROBE_EVERY, PROBE_FIRST,
};

fn model<B: Backend>(be: &B, name: &str) -> Model<B> {
    Model::open(
        be,
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures")
            .join(name),
    )
    .unwrap()
}

const PROMPT: [u32; 7] = [72, 101, 108, 108, 111, 32, 119];

fn greedy<B: Backend>(
    be: &B,
    m: &Model<B>,
    spec: Option<SpecConfig>,
    n: usize,
) -> (Vec<u32>, tern::runtime::speculative::SpecStats) {
    let mut g = Generator::new(
        m,
        be,
        m.new_state(be),
        Sampler::new(SamplerConfig::greedy()),
        spec,
    )
    .unwrap();
    let mut out = vec![g.prefill(&PROMPT).unwrap()];
    while out.len() < n {
        out.extend(g.step().unwrap());
    }
    out.truncate(n);
    (out, g.stats().clone())
}

fn drafting_does_not_change_greedy_output<B: Backend>(be: &B) {
    // lavapipe runs a GPU on the CPU: a lighter sweep there keeps CI's time.
    let (files, depths, n): (&[&str], &[usize], usize) = if be.name() == "cpu" {
        (
            &["tiny-f32.gguf", "tiny-q8_0.gguf", "tiny-pq2_0.gguf"],
            &[1, 2, 3],
            48,
        )
    } else {
        (&["tiny-q8_0.gguf", "tiny-pq2_0.gguf"], &[2], 32)
    };
    for &file in files {
        let m = model(be, file);
        let (plain, _) = greedy(be, &m, None, n);
        for &n_max in depths {
            let spec = SpecConfig {
                n_max,
                n_min: 0,
                p_min: 0.0,
                adaptive: false,
            };
            let (drafted, stats) = greedy(be, &m, Some(spec), n);
            println!(
                "{file} [{}] n_max {n_max}: drafted {} accepted {} ({:.1}%), per position {:?}",
                be.name(),
                stats.drafted,
                stats.accepted,
                100.0 * stats.acceptance_rate(),
                stats.accepted_per_pos
            );
            assert!(stats.drafted > 0, "drafting ran");
            assert_eq!(
                plain, drafted,
                "{file}: n_max {n_max} changed the greedy tokens"
            );
        }
    }
}

fn oracle_drafts_are_accepted_and_wrong_ones_rolled_back<B: Backend>(be: &B) {
    let m = model(be, "tiny-f32.gguf");
    let (reference, _) = greedy(be, &m, None, 40);
    let mut g = Generator::new(
        &m,
        be,
        m.new_state(be),
        Sampler::new(SamplerConfig::greedy()),
        None,
    )
    .unwrap();
    let mut out = vec![g.prefill(&PROMPT).unwrap()];
    let mut round = 0;
    while out.len() < 36 {
        let k = 1 + round % 3;
        let mut drafts: Vec<u32> = reference[out.len()..out.len() + k].to_vec();
        if round % 4 == 3 {
            // A wrong token in the second place: the first is kept, the rest rolled back.
            if drafts.len() > 1 {
                drafts[1] = (drafts[1] + 1) % m.cfg.n_vocab as u32;
            }
        }
        let before = g.stats().accepted;
        out.extend(g.verify(&drafts).unwrap());
        let acc = g.stats().accepted - before;
        if round % 4 == 3 && k > 1 {
            assert_eq!(acc, 1, "round {round}");
        } else {
            assert_eq!(
                acc as usize, k,
                "round {round}: oracle draft not fully accepted"
            );
        }
        round += 1;
    }
    assert_eq!(&out[..36], &reference[..36]);
}

/// FR-Spec's reduced draft head: the draft step scores token ids `0..n` with the head's first
/// `n` rows, the same numbers as the full head's first `n` columns, and greedy output stays
/// exact with it (a Hadamard-folded head included; the tied fixtures have no MTP block).
fn a_reduced_draft_head_scores_the_low_ids<B: Backend>(be: &B) {
    let files: &[&str] = if be.name() == "cpu" {
        &["tiny-q8_0.gguf", "tiny-q4_0.gguf", "tiny-pq2_0.gguf"]
    } else {
        &["tiny-pq2_0.gguf"]
    };
    for &file in files {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures")
            .join(file);
        let g = std::sync::Arc::new(tern::gguf::Gguf::open(&path).unwrap());
        let n_vocab = tern::model::Config::from_gguf(&g).unwrap().n_vocab;
        // An odd count: the draft head need not be a multiple of any tile.
        let n = n_vocab / 3 + 1;
        let m = Model::load_with_draft(be, g, n).unwrap();
        let mtp = m.w.mtp.as_ref().expect("the fixture has an MTP block");
        assert_eq!(
            mtp.draft_head.as_ref().map(|d| d.n_vocab),
            Some(n),
            "{file}"
        );
        let e = m.cfg.n_embd;
        let h: Vec<f32> = (0..e)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let h = be.from_host(&h, 1, e);
        let mut s1 = m.new_mtp_state(be).unwrap();
        let mut s2 = m.new_mtp_state(be).unwrap();
        let full = be.to_host(&m.mtp_forward(be, &mut s1, &[72], &h).unwrap().logits);
        let draft = be.to_host(&m.mtp_draft(be, &mut s2, &[72], &h).unwrap().logits);
        assert_eq!(full.len(), n_vocab, "{file}");
        assert_eq!(draft.len(), n, "{file}");
        // The same rows dotted with the same input; only the kernel's tiling may differ.
        let worst = full[..n]
            .iter()
            .zip(&draft)
            .map(|(a, b)| (a - b).abs() / a.abs().max(1.0))
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "{file}: draft logits differ by {worst}");

        let (plain, _) = greedy(be, &m, None, 32);
        let spec = SpecConfig {
            n_max: 2,
            n_min: 0,
            p_min: 0.0,
            adaptive: false,
        };
        let (drafted, stats) = greedy(be, &m, Some(spec), 32);
        assert!(stats.drafted > 0, "{file}: drafting ran");
        assert_eq!(
            plain, drafted,
            "{file}: the draft head changed the greedy tokens"
        );
    }
    // Serving's rule: only a vocabulary at least 4 times the draft's gets one.
    assert_eq!(
        tern::model::draft_vocab(248_320, true),
        tern::model::DRAFT_VOCAB
    );
    assert_eq!(tern::model::draft_vocab(248_320, false), 0);
    assert_eq!(
        tern::model::draft_vocab(4 * tern::model::DRAFT_VOCAB - 1, true),
        0
    );
}

/// Greedy decoding of `n` tokens with adaptive drafting; `costs`, when given, replaces the
/// measured round costs before every round (a machine whose costs are known). Returns the
/// tokens, each round's depth, the acceptance counters and the policy's final state.
fn adaptive<B: Backend>(
    be: &B,
    m: &Model<B>,
    n: usize,
    costs: Option<&RoundCosts>,
) -> (
    Vec<u32>,
    Vec<usize>,
    tern::runtime::speculative::SpecStats,
    AdaptiveDepth,
) {
    let mut g = Generator::new(
        m,
        be,
        m.new_state(be),
        Sampler::new(SamplerConfig::greedy()),
        Some(SpecConfig::default()),
    )
    .unwrap();
    let mut out = vec![g.prefill(&PROMPT).unwrap()];
    let mut depths = Vec::new();
    while out.len() < n {
        if let Some(c) = costs {
            g.costs = c.clone();
        }
        out.extend(g.step().unwrap());
        depths.push(g.slot.depth.depth);
    }
    out.truncate(n);
    (out, depths, g.stats().clone(), g.slot.depth.clone())
}

/// A draft head that can only say token 0 (a one-row reduced head) over a trunk that never
/// emits it: every draft is rejected, as with bench-0.8b's random head. The slot falls back to
/// plain decoding within a few rounds, drafting again only to probe, and the output is the
/// plain output. The costs are bench-0.8b's on this class of machine (`xtask bench --engine
/// --draft-rounds`: a draft step 0.062 of a plain step, a verify of 2/3/4 rows 1.26/1.40/1.58),
/// not the tiny model's as timed while the test runs: those are microseconds of overhead, and
/// on a loaded machine their noise alone could make a round look cheaper than a plain step.
#[test]
fn adaptive_depth_drops_to_plain_when_no_draft_is_accepted() {
    let be = common::cpu();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-q8_0.gguf");
    let g = std::sync::Arc::new(tern::gguf::Gguf::open(&path).unwrap());
    let m = Model::load_with_draft(&be, g, 1).unwrap();
    let n = 96;
    let (plain, _) = greedy(&be, &m, None, n);
    assert!(
        !plain.contains(&0),
        "the trunk emits the only draftable token"
    );
    let mut costs = RoundCosts::default();
    costs.observe_draft_step(0.062);
    for (rows, cost) in [(1, 1.0), (2, 1.26), (3, 1.40), (4, 1.58)] {
        costs.observe_forward(rows, cost);
    }
    let (out, depths, stats, policy) = adaptive(&be, &m, n, Some(&costs));
    assert_eq!(out, plain, "adaptive drafting changed the greedy tokens");
    assert!(stats.drafted > 0, "the first rounds draft");
    assert_eq!(stats.accepted, 0);
    let settled = &depths[20..];
    let drafting = settled.iter().filter(|&&d| d > 0).count();
    println!(
        "depths {depths:?}; acceptance estimate {:.4}, {} probes",
        policy.acceptance(),
        policy.probes
    );
    assert!(
        settled.iter().all(|&d| d <= 1) && drafting <= settled.len() / PROBE_EVERY as usize + 2,
        "still drafting after 20 rejected rounds: {depths:?}"
    );
    assert!(policy.probes > 0, "plain decoding never probed again");
}

/// On the demo model's trained head (~40% of drafts accepted) and a machine where a round is
/// cheap (a draft step 0.1 of a plain step, each verify row 0.15 more: depth 1 breaks even at
/// 25% acceptance), the slot keeps drafting, and the output is the plain output.
#[test]
fn adaptive_depth_keeps_drafting_where_it_pays() {
    let be = common::cpu();
    let m = model(&be, "demo/demo-q8_0.gguf");
    let mut costs = RoundCosts::default();
    costs.observe_draft_step(0.1);
    for rows in 1..=4 {
        costs.observe_forward(rows, 1.0 + 0.15 * (rows - 1) as f64);
    }
    let n = 64;
    let (plain, _) = greedy(&be, &m, None, n);
    let (out, depths, stats, policy) = adaptive(&be, &m, n, Some(&costs));
    println!(
        "depths {depths:?}; drafted {} accepted {}; acceptance estimate {:.3}",
        stats.drafted,
        stats.accepted,
        policy.acceptance()
    );
    assert_eq!(out, plain, "adaptive drafting changed the greedy tokens");
    let drafting = depths.iter().filter(|&&d| d > 0).count();
    assert!(
        drafting * 10 >= depths.len() * 8,
        "drafting dropped although it pays: {depths:?}"
    );
    assert!(stats.accepted > 0);
}

/// The policy on known costs: break-even acceptance, the depth it picks, and probing.
#[test]
fn the_depth_policy_follows_acceptance_and_costs() {
    assert_eq!(expected_tokens(0.5, 2), 1.75);
    assert!((break_even(1, 1.25).unwrap() - 0.25).abs() < 1e-9);
    // 1 + a + a^2 = 1.6
    let a2 = (-1.0 + (1.0f64 + 4.0 * 0.6).sqrt()) / 2.0;
    assert!((break_even(2, 1.6).unwrap() - a2).abs() < 1e-9);
    assert_eq!(
        break_even(1, 2.0),
        None,
        "a round of two plain steps never pays at depth 1"
    );

    let mut c = RoundCosts::default();
    assert_eq!(c.forward(1), None);
    c.observe_forward(1, 1.0);
    c.observe_forward(2, 0.9); // noise: two rows never cost less than one
    assert_eq!(c.forward(2), Some(1.0));
    assert_eq!(c.forward(3), Some(1.0), "unmeasured: the largest below");
    c.observe_forward(4, 1.2);
    c.observe_draft_step(0.1);

    let alone = Company::default();
    let mut p = AdaptiveDepth::default();
    assert_eq!(
        p.best(3, &RoundCosts::default(), alone),
        3,
        "nothing measured: draft fully"
    );
    for _ in 0..30 {
        p.observe(3, 3);
    }
    assert!(p.acceptance() > 0.9);
    // a ~ 1: depth 3 yields ~4 tokens for 0.3 + 1.2, depth 2 ~3 for 0.2 + 1.0.
    assert_eq!(p.best(3, &c, alone), 3);
    // Beside two other slots' rows the verify rows are priced at forward(3 + d).
    let two = Company { rows: 2, slots: 2 };
    assert_eq!(p.best(1, &c, two), 1);
    let mut z = AdaptiveDepth::default();
    for _ in 0..30 {
        z.observe(2, 0);
    }
    assert!(z.acceptance() < 0.05);
    assert_eq!(z.best(3, &c, alone), 0);
    // Plain rounds with one-token probes between, the gaps doubling from PROBE_FIRST to
    // PROBE_EVERY.
    let picks: Vec<usize> = (0..60).map(|_| z.pick(3, &c, alone)).collect();
    let probes: Vec<usize> = (0..60).filter(|&i| picks[i] == 1).collect();
    assert!(picks.iter().all(|&d| d <= 1));
    let gaps: Vec<usize> = std::iter::once(probes[0])
        .chain(probes.windows(2).map(|w| w[1] - w[0] - 1))
        .collect();
    assert_eq!(gaps[0], PROBE_FIRST as usize, "{picks:?}");
    assert_eq!(gaps[1], 2 * PROBE_FIRST as usize, "{picks:?}");
    assert!(gaps.iter().all(|&g| g <= PROBE_EVERY as usize), "{picks:?}");
    assert_eq!(*gaps.last().unwrap(), PROBE_EVERY as usize, "{picks:?}");
}

/// A round is priced for the whole step it shares: its extra rows and draft steps delay every
/// other slot's token too. On costs measured on bench-0.8b Q8_0 (3 rows 33 ms, 6 rows 44 ms, a
/// draft step 1.5 ms), a slot at a = 0.5 drafts alone but not beside two others, and beside
/// them drafts once its acceptance is high enough to pay for all three slots' wait.
#[test]
fn a_slot_prices_its_round_for_the_whole_step() {
    let mut c = RoundCosts::default();
    c.observe_draft_step(0.0015);
    for (rows, s) in [
        (1, 0.0255),
        (2, 0.0262),
        (3, 0.033),
        (4, 0.0365),
        (6, 0.044),
    ] {
        c.observe_forward(rows, s);
    }
    let mut p = AdaptiveDepth::default();
    assert!((p.acceptance() - 0.5).abs() < 1e-9);
    assert_eq!(p.best(1, &c, Company::default()), 1);
    let two = Company { rows: 2, slots: 2 };
    assert_eq!(p.best(1, &c, two), 0);
    // Depth 1 beside two plain slots: (2 + 1 + a) / (0.0015 + 0.0365) > 1.02 * 3 / 0.033 from
    // a ~ 0.53 on.
    for _ in 0..40 {
        p.observe(1, 1);
    }
    assert!(p.acceptance() > 0.9);
    assert_eq!(p.best(1, &c, two), 1);
    // Priced as if alone (no other slot's token counted), the same slot drafts at a = 0.5
    // beside them: what the shared step must not do.
    let q = AdaptiveDepth::default();
    assert_eq!(q.best(1, &c, Company { rows: 2, slots: 0 }), 1);
}

/// The engine fills its decoding slots' MTP caches in one pass of the block
/// (`Model::mtp_fill_many`): each head ends where its own fill leaves it, whatever the other
/// items' rows and positions (caches of different lengths, 1 to 3 rows, an item without rows
/// skipped), read back through the next draft's logits.
fn the_mtp_block_fills_several_heads_in_one_pass<B: Backend>(be: &B) {
    let m = model(be, "tiny-q8_0.gguf");
    let e = m.cfg.n_embd;
    let rows = |n: usize, seed: usize| {
        let h: Vec<f32> = (0..n * e)
            .map(|i| (((i + seed) * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        be.from_host(&h, n, e)
    };
    // Per head: the rows it already holds, then the rows of the shared fill.
    let before: [&[u32]; 4] = [&[72, 101], &[108, 108, 111, 32, 119], &[], &[33]];
    let fill: [&[u32]; 4] = [&[44, 45, 46], &[47], &[48, 49], &[]];
    let fresh = || -> Vec<_> {
        before
            .iter()
            .enumerate()
            .map(|(k, toks)| {
                let mut st = m.new_mtp_state(be).unwrap();
                if !toks.is_empty() {
                    m.mtp_fill(be, &mut st, toks, &rows(toks.len(), k)).unwrap();
                }
                st
            })
            .collect()
    };
    let hs: Vec<B::T> = fill
        .iter()
        .enumerate()
        .map(|(k, t)| rows(t.len().max(1), 10 + k))
        .collect();
    let mut one = fresh();
    for ((st, toks), h) in one.iter_mut().zip(fill).zip(&hs) {
        if !toks.is_empty() {
            m.mtp_fill(be, st, toks, h).unwrap();
        }
    }
    let mut many = fresh();
    let mut items: Vec<MtpRows<'_, B>> = many
        .iter_mut()
        .zip(fill)
        .zip(&hs)
        .map(|((st, tokens), h_prev)| MtpRows { st, tokens, h_prev })
        .collect();
    m.mtp_fill_many(be, &mut items).unwrap();
    drop(items);
    for (k, (a, b)) in one.iter_mut().zip(many.iter_mut()).enumerate() {
        assert_eq!((a.pos, a.skip), (b.pos, b.skip), "head {k}");
        let h = rows(1, 20 + k);
        let la = be.to_host(&m.mtp_forward(be, a, &[50], &h).unwrap().logits);
        let lb = be.to_host(&m.mtp_forward(be, b, &[50], &h).unwrap().logits);
        // The same rows through the same weights; a device may tile a product of several rows
        // otherwise than one of a single row.
        let worst = la
            .iter()
            .zip(&lb)
            .map(|(x, y)| (x - y).abs() / x.abs().max(1.0))
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "head {k}: logits differ by {worst}");
    }
}

/// A round's first draft step takes the rows the last fill held back and writes its own row
/// ahead (`Mtp::held`, `Mtp::ahead`), and a slot that does not draft holds at most
/// `HELD_ROWS`: after rounds of any depth, drafted by the head (mostly rejected here) or given
/// by an oracle (all accepted, so the fill holds several rows), the head's cache and held rows
/// are every row the trunk kept, in order. Read back through the next draft's logits, against a
/// fresh head given the whole sequence in one pass with the trunk's h from one prompt pass.
fn held_rows_reach_the_mtp_cache_in_order<B: Backend>(be: &B) {
    let m = model(be, "tiny-f32.gguf");
    let e = m.cfg.n_embd;
    let (reference, _) = greedy(be, &m, None, 40);
    let mut held_seen = 0;
    // The last round drafted by the head or by the oracle; then a prompt continuing the sequence
    // (its fill puts the held rows through first), after a draft whose verify never came (its
    // row written ahead is written again), or a round after two such drafts.
    let endings = [
        (false, ""),
        (true, ""),
        (true, "prompt"),
        (false, "draft, prompt"),
        (true, "two drafts, step"),
    ];
    for n_max in [0, 1, 2, 3] {
        for (oracle_last, then) in endings {
            let spec = SpecConfig {
                n_max,
                n_min: 0,
                p_min: 0.0,
                adaptive: false,
            };
            let mut g = Generator::new(
                &m,
                be,
                m.new_state(be),
                Sampler::new(SamplerConfig::greedy()),
                Some(spec.clone()),
            )
            .unwrap();
            let mut out = vec![g.prefill(&PROMPT).unwrap()];
            for round in 0..9 {
                let oracle = if oracle_last {
                    round % 3 == 2
                } else {
                    round % 3 == 1
                };
                if oracle {
                    let k = 1 + round % 2;
                    let drafts = reference[out.len()..out.len() + k].to_vec();
                    out.extend(g.verify(&drafts).unwrap());
                } else {
                    out.extend(g.step().unwrap());
                }
                let held = g.slot.mtp.as_ref().unwrap().held.len();
                assert!(held <= HELD_ROWS.max(n_max), "n_max {n_max}: {held} held");
            }
            if then == "two drafts, step" {
                for _ in 0..2 {
                    g.slot.draft(&m, be, &spec, n_max, &mut g.costs).unwrap();
                }
                out.extend(g.step().unwrap());
            }
            assert_eq!(&out[..], &reference[..out.len()], "n_max {n_max}");
            let mut last = *out.last().unwrap();
            let mut fed: Vec<u32> = PROMPT
                .iter()
                .chain(&out[..out.len() - 1])
                .copied()
                .collect();
            if then.ends_with("prompt") {
                if then.starts_with("draft") {
                    g.slot.draft(&m, be, &spec, n_max, &mut g.costs).unwrap();
                }
                let more = [33, 34, 35];
                last = g.prefill(&more).unwrap();
                fed.extend(more);
                let mtp = g.slot.mtp.as_ref().unwrap();
                assert!(
                    mtp.held.is_empty(),
                    "n_max {n_max}: a prompt's fill holds nothing"
                );
            }
            assert_eq!(g.slot.seq.pos, fed.len(), "n_max {n_max}");
            let mtp = g.slot.mtp.as_mut().expect("drafting arms the head");
            assert!(
                !mtp.ahead,
                "n_max {n_max}: the verify's fill took the row written ahead"
            );
            assert_eq!(mtp.state.pos + mtp.held.len(), fed.len(), "n_max {n_max}");
            held_seen += mtp.held.len();
            let mut tokens = mtp.held.clone();
            tokens.push(last);
            let h = match &mtp.held_h {
                Some(held) => be.concat_rows(&[held, &mtp.pending_h]),
                None => be.rows(&mtp.pending_h, 0, 1),
            };
            let got = be.to_host(&m.mtp_draft(be, &mut mtp.state, &tokens, &h).unwrap().logits);

            let mut seq = m.new_state(be);
            let mut items = [BatchItem {
                seq: &mut seq,
                tokens: &fed,
                image: None,
                all_rows: false,
                hidden_rows: true,
                snapshot: false,
            }];
            let trunk = m.forward_batch(be, &mut items).unwrap().pop().unwrap();
            let zero = be.from_host(&vec![0.0; e], 1, e);
            let h_prev = be.concat_rows(&[&zero, &trunk.h]);
            let mut tokens = fed.clone();
            tokens.push(last);
            let mut st = m.new_mtp_state(be).unwrap();
            let want = be.to_host(&m.mtp_draft(be, &mut st, &tokens, &h_prev).unwrap().logits);
            // The trunk's h of a prompt pass and of decode steps differ in rounding only (the
            // chunked and the stepwise GDN scan); a row out of place moves the logits by far
            // more.
            let worst = want
                .iter()
                .zip(&got)
                .map(|(x, y)| (x - y).abs() / x.abs().max(1.0))
                .fold(0f32, f32::max);
            println!(
                "n_max {n_max}, oracle last {oracle_last}, then {then:?}: held {}, worst {worst:e}",
                mtp.held.len()
            );
            assert!(
                worst < 1e-3,
                "n_max {n_max}: draft logits differ by {worst}"
            );
        }
    }
    assert!(held_seen > 0, "some check ran with rows held");
}

per_backend!(
    held_rows_reach_the_mtp_cache_in_order,
    drafting_does_not_change_greedy_output,
    oracle_drafts_are_accepted_and_wrong_ones_rolled_back,
    a_reduced_draft_head_scores_the_low_ids,
    the_mtp_block_fills_several_heads_in_one_pass
);
