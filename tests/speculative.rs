//! MTP self-speculation keeps greedy output exact: drafting on or off gives the same tokens,
//! an oracle drafter is fully accepted, a wrong draft is rolled back exactly.

mod common;

use std::path::Path;

use tern::backend::Backend;
use tern::model::Model;
use tern::runtime::sampler::{Sampler, SamplerConfig};
use tern::runtime::speculative::{Generator, SpecConfig};

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

per_backend!(
    drafting_does_not_change_greedy_output,
    oracle_drafts_are_accepted_and_wrong_ones_rolled_back,
    a_reduced_draft_head_scores_the_low_ids
);
