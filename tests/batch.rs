//! A batched step over several sequences gives each the logits it would get alone.

mod common;

use std::path::Path;

use tern::backend::{nmse, Backend};
use tern::model::{BatchItem, Model};

fn batched_equals_separate<B: Backend>(be: &B) {
    for file in ["tiny-q8_0.gguf", "tiny-tied-f32.gguf", "tiny-pq2_0.gguf"] {
        let m = Model::open(
            be,
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures")
                .join(file),
        )
        .unwrap();
        let prompts: [&[u32]; 3] = [
            &[1, 2, 3, 4, 5],
            &[9, 8, 7],
            &[100, 200, 300, 40, 50, 60, 70],
        ];
        // Separate: each prompt, then one decode token.
        let mut want = Vec::new();
        for p in prompts {
            let mut st = m.new_state(be);
            let a = be.to_host(&m.forward(be, &mut st, p, true).unwrap().logits);
            let b = be.to_host(&m.forward(be, &mut st, &[p[0] + 1], false).unwrap().logits);
            want.push((a, b));
        }
        // Batched: the three prompts in one step (mixed lengths), then a decode step of all.
        let mut states: Vec<_> = prompts.iter().map(|_| m.new_state(be)).collect();
        let mut items: Vec<BatchItem<B>> = states
            .iter_mut()
            .zip(prompts)
            .map(|(seq, tokens)| BatchItem {
                seq,
                tokens,
                image: None,
                all_rows: true,
                hidden_rows: false,
                snapshot: false,
            })
            .collect();
        let outs = m.forward_batch(be, &mut items).unwrap();
        let next: Vec<[u32; 1]> = prompts.iter().map(|p| [p[0] + 1]).collect();
        let mut items: Vec<BatchItem<B>> = states
            .iter_mut()
            .zip(&next)
            .map(|(seq, tokens)| BatchItem {
                seq,
                tokens,
                image: None,
                all_rows: false,
                hidden_rows: false,
                snapshot: false,
            })
            .collect();
        let outs2 = m.forward_batch(be, &mut items).unwrap();
        for (i, (a, b)) in want.iter().enumerate() {
            let ea = nmse(&be.to_host(&outs[i].logits), a);
            let eb = nmse(&be.to_host(&outs2[i].logits), b);
            println!(
                "{file} [{}] seq {i}: prefill NMSE {ea:.2e}, decode NMSE {eb:.2e}",
                be.name()
            );
            // Same math; only the matmul batching (summation order) differs.
            assert!(ea < 1e-9 && eb < 1e-9, "{file} seq {i}: {ea:e} {eb:e}");
        }
    }
}

/// `forward_batch_joined` leaves every item's logits rows in one tensor at the runs it names,
/// the rows `forward_batch` splits out, and gives each item the same h rows: items with every
/// row (a verify), with h rows only (a prompt chunk for the MTP head) and with the last alone.
fn joined_rows_are_the_split_outputs<B: Backend>(be: &B) {
    let m = Model::open(
        be,
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures")
            .join("tiny-q8_0.gguf"),
    )
    .unwrap();
    let prompts: [&[u32]; 3] = [&[1, 2, 3, 4, 5], &[9, 8, 7], &[100, 200, 300, 40]];
    // (all_rows, hidden_rows) per item.
    let wants = [(true, false), (false, true), (false, false)];
    let run = |joined: bool| {
        let mut states: Vec<_> = prompts.iter().map(|_| m.new_state(be)).collect();
        let mut items: Vec<BatchItem<B>> = states
            .iter_mut()
            .zip(prompts)
            .zip(wants)
            .map(|((seq, tokens), (all_rows, hidden_rows))| BatchItem {
                seq,
                tokens,
                image: None,
                all_rows,
                hidden_rows,
                snapshot: false,
            })
            .collect();
        if !joined {
            let outs = m.forward_batch(be, &mut items).unwrap();
            return outs
                .iter()
                .map(|o| (be.to_host(&o.logits), be.to_host(&o.h)))
                .collect::<Vec<_>>();
        }
        let j = m.forward_batch_joined(be, &mut items).unwrap();
        let runs: Vec<(usize, usize)> = (0..prompts.len()).map(|i| j.logits_run(i)).collect();
        let n_rows = j.logits_rows();
        assert_eq!(n_rows, runs.iter().map(|r| r.1).sum::<usize>());
        let (logits, hs) = j.split_h(be);
        let all = be.to_host(&logits);
        let cols = all.len() / n_rows;
        runs.iter()
            .zip(hs)
            .map(|(&(first, n), h)| {
                (
                    all[first * cols..(first + n) * cols].to_vec(),
                    be.to_host(&h),
                )
            })
            .collect()
    };
    let (split, joined) = (run(false), run(true));
    for (i, ((ls, hs), (lj, hj))) in split.iter().zip(&joined).enumerate() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(ls), bits(lj), "item {i}: logits rows [{}]", be.name());
        assert_eq!(bits(hs), bits(hj), "item {i}: h rows [{}]", be.name());
    }
    // Every row, h rows only, the last alone: 5, 1 and 1 logits rows.
    assert_eq!(split[0].0.len(), 5 * split[2].0.len());
    assert_eq!(split[1].0.len(), split[2].0.len());
}

per_backend!(batched_equals_separate, joined_rows_are_the_split_outputs);
