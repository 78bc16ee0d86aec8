//! llama-perplexity's evaluation loop: the text's tokens cut into `n_chunk` chunks of `n_ctx`,
//! each evaluated from a fresh state (with the first token replaced by BOS when the vocabulary
//! adds one), `n_seq` chunks per batch, and the logits of positions `n_ctx/2 .. n_ctx-2` scored
//! against the token that follows each.

use crate::backend::{Backend, KvTypes};
use crate::model::{BatchItem, Model};

use super::EvalError;

/// How a text is cut and batched; the same for the reference and the candidate of a kld run.
#[derive(Clone, Debug, PartialEq)]
pub struct Chunking {
    pub n_ctx: usize,
    /// Chunks evaluated together in one batch (`max(1, n_batch / n_ctx)`, as llama.cpp).
    pub n_seq: usize,
    pub n_chunk: usize,
    /// The token that replaces each chunk's first (llama.cpp does so when the vocabulary's
    /// `add_bos_token` is set).
    pub bos: Option<u32>,
}

impl Chunking {
    /// llama-perplexity's rules: at least two chunks' worth of tokens, as many whole chunks as
    /// the text holds (or `chunks`, when fewer).
    pub fn new(
        n_tokens: usize,
        n_ctx: usize,
        n_batch: usize,
        chunks: Option<usize>,
        bos: Option<u32>,
    ) -> Result<Chunking, EvalError> {
        if n_ctx < 4 {
            return Err(EvalError::Settings(format!(
                "--ctx-size {n_ctx}: the perplexity tool needs a context of at least 4 tokens"
            )));
        }
        if n_batch == 0 {
            return Err(EvalError::Settings("--batch-size 0: must be > 0".into()));
        }
        if n_tokens < 2 * n_ctx {
            return Err(EvalError::TooShort {
                tokens: n_tokens,
                need: 2 * n_ctx,
                n_ctx,
            });
        }
        let max = n_tokens / n_ctx;
        let n_chunk = match chunks {
            Some(0) => return Err(EvalError::Settings("--chunks 0: must be > 0".into())),
            Some(c) => c.min(max),
            None => max,
        };
        Ok(Chunking {
            n_ctx,
            n_seq: (n_batch / n_ctx).max(1),
            n_chunk,
            bos,
        })
    }

    /// The first scored logits row of a chunk.
    pub fn first(&self) -> usize {
        self.n_ctx / 2
    }

    /// Scored positions per chunk.
    pub fn scored(&self) -> usize {
        self.n_ctx - 1 - self.first()
    }

    pub fn positions(&self) -> usize {
        self.n_chunk * self.scored()
    }
}

/// One chunk's scored logits: `scored` rows of `n_vocab`, row `i` at position `first + i`,
/// and the tokens they predict (`targets[i]` is the text's token at `first + i + 1`).
pub struct ChunkLogits<'a> {
    pub index: usize,
    pub logits: &'a [f32],
    pub targets: &'a [u32],
}

/// The most logits one forward call returns (f32 values, 64 MiB): a 248k vocabulary over a
/// whole batch of half chunks would be gigabytes, and half of lavapipe's 128 MiB storage
/// binding limit keeps the logits tensor bindable, so the scored half runs in slices.
const LOGITS_BUDGET: usize = 1 << 24;

/// Runs the model over every chunk and hands each chunk's scored logits to `each`, in order.
pub fn run<B: Backend>(
    be: &B,
    m: &Model<B>,
    tokens: &[u32],
    c: &Chunking,
    kv: KvTypes,
    mut each: impl FnMut(ChunkLogits<'_>) -> Result<(), EvalError>,
) -> Result<(), EvalError> {
    let (n_ctx, first, scored) = (c.n_ctx, c.first(), c.scored());
    let nv = m.cfg.n_vocab;
    assert!(
        tokens.len() >= c.n_chunk * n_ctx,
        "chunking beyond the text"
    );
    let mut i = 0;
    while i < c.n_chunk {
        let n_seq = c.n_seq.min(c.n_chunk - i);
        let inputs: Vec<Vec<u32>> = (0..n_seq)
            .map(|s| {
                let start = (i + s) * n_ctx;
                let mut t = tokens[start..start + n_ctx].to_vec();
                if let Some(b) = c.bos {
                    t[0] = b;
                }
                t
            })
            .collect();
        let mut states = Vec::with_capacity(n_seq);
        for _ in 0..n_seq {
            let mut st = m.new_state_with(be, kv)?;
            st.reserve(be, n_ctx)?;
            states.push(st);
        }
        // The unscored first half: only its state is needed.
        {
            let mut items: Vec<BatchItem<'_, B>> = states
                .iter_mut()
                .zip(&inputs)
                .map(|(st, t)| BatchItem {
                    seq: st,
                    tokens: &t[..first],
                    image: None,
                    all_rows: false,
                    hidden_rows: false,
                    snapshot: false,
                })
                .collect();
            m.forward_batch(be, &mut items)?;
        }
        let step = (LOGITS_BUDGET / (nv * n_seq)).max(1);
        let mut logits: Vec<Vec<f32>> = vec![Vec::with_capacity(scored * nv); n_seq];
        let mut p = first;
        // Position n_ctx-1's logits predict past the chunk: never computed.
        while p < n_ctx - 1 {
            let end = (p + step).min(n_ctx - 1);
            let mut items: Vec<BatchItem<'_, B>> = states
                .iter_mut()
                .zip(&inputs)
                .map(|(st, t)| BatchItem {
                    seq: st,
                    tokens: &t[p..end],
                    image: None,
                    all_rows: true,
                    hidden_rows: false,
                    snapshot: false,
                })
                .collect();
            let outs = m.forward_batch(be, &mut items)?;
            for (l, o) in logits.iter_mut().zip(outs) {
                l.extend(be.to_host(&o.logits));
            }
            p = end;
        }
        for (s, l) in logits.iter().enumerate() {
            debug_assert_eq!(l.len(), scored * nv);
            let start = (i + s) * n_ctx;
            each(ChunkLogits {
                index: i + s,
                logits: l,
                targets: &tokens[start + first + 1..start + n_ctx],
            })?;
        }
        i += n_seq;
    }
    Ok(())
}
