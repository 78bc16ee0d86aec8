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

per_backend!(batched_equals_separate);
