//! One sequence's generation loop, with optional MTP self-speculation (model-qwen35.md §6):
//! the MTP head drafts up to `n_max` tokens, the trunk verifies `[last, d1..dn]` in one batch,
//! the longest prefix the sampler agrees with is kept, and the attention caches and recurrent
//! states roll back exactly past it. Greedy output is identical with drafting on or off.

use crate::backend::Backend;
use crate::model::{Model, ModelError, MtpState, SeqState};

use super::sampler::{argmax, probability, Sampler};

#[derive(Clone, Debug, PartialEq)]
pub struct SpecConfig {
    /// `--spec-draft-n-max` (llama.cpp default 3).
    pub n_max: usize,
    /// `--spec-draft-n-min`: shorter drafts are dropped.
    pub n_min: usize,
    /// `--spec-draft-p-min`: drafting stops at a token the head is less sure of.
    pub p_min: f32,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            n_max: 3,
            n_min: 0,
            p_min: 0.0,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Verify rounds that carried a draft.
    pub drafts: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// `accepted_per_pos[i]`: drafts whose token i was accepted.
    pub accepted_per_pos: Vec<u64>,
}

impl SpecStats {
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

struct Mtp<B: Backend> {
    state: MtpState<B>,
    /// The trunk's `h_nextn` of the last position fed to the trunk (zeros before any).
    pending_h: Vec<f32>,
}

pub struct Generator<'a, B: Backend> {
    model: &'a Model<B>,
    be: &'a B,
    pub seq: SeqState<B>,
    checkpoint: Vec<Option<B::Rs>>,
    mtp: Option<Mtp<B>>,
    spec: Option<SpecConfig>,
    pub sampler: Sampler,
    /// Sampled but not yet fed to the trunk.
    last: Option<u32>,
    pub stats: SpecStats,
}

impl<'a, B: Backend> Generator<'a, B> {
    /// `spec = Some(..)` arms MTP drafting (the model must have an MTP block).
    pub fn new(
        model: &'a Model<B>,
        be: &'a B,
        seq: SeqState<B>,
        sampler: Sampler,
        spec: Option<SpecConfig>,
    ) -> Result<Self, ModelError> {
        let mtp = match &spec {
            Some(_) => Some(Mtp {
                state: model.new_mtp_state(be)?,
                pending_h: vec![0.0; model.cfg.n_embd],
            }),
            None => None,
        };
        let gp = model.cfg.gdn_params();
        let checkpoint = seq
            .rs
            .iter()
            .map(|r| r.as_ref().map(|_| be.new_recurrent(&gp)))
            .collect();
        Ok(Generator {
            model,
            be,
            seq,
            checkpoint,
            mtp,
            spec,
            sampler,
            last: None,
            stats: SpecStats::default(),
        })
    }

    fn sample_row(&mut self, logits: &B::T, row: usize, n_rows: usize) -> u32 {
        let id = if self.sampler.is_greedy() {
            if n_rows == 1 {
                self.be.argmax_rows(logits)[0]
            } else {
                self.be.argmax_rows(&self.be.rows(logits, row, 1))[0]
            }
        } else {
            let host = self.be.to_host(&self.be.rows(logits, row, 1));
            self.sampler.sample(&host)
        };
        self.sampler.accept(id);
        id
    }

    /// Fills the MTP cache over tokens just accepted by the trunk: row k reads token k and the
    /// trunk's h of the position before it.
    fn mtp_process(&mut self, tokens: &[u32], h_rows: &[f32]) -> Result<(), ModelError> {
        let Some(m) = self.mtp.as_mut() else {
            return Ok(());
        };
        let ne = self.model.cfg.n_embd;
        let mut hp = Vec::with_capacity(tokens.len() * ne);
        hp.extend_from_slice(&m.pending_h);
        hp.extend_from_slice(&h_rows[..(tokens.len() - 1) * ne]);
        let hp = self.be.from_host(&hp, tokens.len(), ne);
        self.model.mtp_forward(self.be, &mut m.state, tokens, &hp)?;
        m.pending_h = h_rows[(tokens.len() - 1) * ne..tokens.len() * ne].to_vec();
        Ok(())
    }

    /// Runs the prompt and samples the first token.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<u32, ModelError> {
        let all = self.mtp.is_some();
        let out = self.model.forward(self.be, &mut self.seq, prompt, all)?;
        let n = if all { prompt.len() } else { 1 };
        if all {
            let h = self.be.to_host(&out.h);
            self.mtp_process(prompt, &h)?;
        }
        let id = self.sample_row(&out.logits, n - 1, n);
        self.last = Some(id);
        Ok(id)
    }

    /// One decode step: returns the tokens it produced (one without drafting; up to
    /// `n_max + 1` with it).
    pub fn step(&mut self) -> Result<Vec<u32>, ModelError> {
        let drafts = match &self.spec {
            Some(spec) => self.draft(&spec.clone())?,
            None => Vec::new(),
        };
        self.verify(&drafts)
    }

    /// The MTP head's greedy draft from the last sampled token (its cache is left as found).
    fn draft(&mut self, spec: &SpecConfig) -> Result<Vec<u32>, ModelError> {
        let last = self.last.expect("prefill before step");
        let Some(m) = self.mtp.as_mut() else {
            return Ok(Vec::new());
        };
        let start = m.state.pos;
        let ne = self.model.cfg.n_embd;
        let mut tok = last;
        let mut h = self.be.from_host(&m.pending_h, 1, ne);
        let mut drafts = Vec::new();
        for _ in 0..spec.n_max {
            if self.seq.pos + drafts.len() + 1 >= self.model.cfg.context_length {
                break;
            }
            let out = self.model.mtp_forward(self.be, &mut m.state, &[tok], &h)?;
            let logits = self.be.to_host(&out.logits);
            let d = argmax(&logits);
            if probability(&logits, d) < spec.p_min {
                break;
            }
            drafts.push(d);
            tok = d;
            h = out.h;
        }
        self.be.kv_truncate(&mut m.state.kv, start);
        m.state.pos = start;
        if drafts.len() < spec.n_min {
            drafts.clear();
        }
        Ok(drafts)
    }

    /// Verifies `drafts` (from the MTP head or any other drafter) after the last sampled
    /// token in one trunk batch and keeps the agreed prefix plus the trunk's next token.
    pub fn verify(&mut self, drafts: &[u32]) -> Result<Vec<u32>, ModelError> {
        let last = self.last.expect("prefill before step");
        let n_past = self.seq.pos;
        let mut batch = Vec::with_capacity(drafts.len() + 1);
        batch.push(last);
        batch.extend_from_slice(drafts);
        if !drafts.is_empty() {
            for (c, s) in self.checkpoint.iter_mut().zip(&self.seq.rs) {
                if let (Some(c), Some(s)) = (c.as_mut(), s.as_ref()) {
                    self.be.recurrent_copy(s, c);
                }
            }
        }
        let want_rows = !drafts.is_empty() || self.mtp.is_some();
        let out = self
            .model
            .forward(self.be, &mut self.seq, &batch, want_rows)?;
        let n_rows = if want_rows { batch.len() } else { 1 };
        let mut produced = Vec::new();
        let mut accepted = 0;
        for i in 0..batch.len() {
            let t = self.sample_row(&out.logits, if want_rows { i } else { 0 }, n_rows);
            produced.push(t);
            if i < drafts.len() && t == drafts[i] {
                accepted += 1;
            } else {
                break;
            }
        }
        if !drafts.is_empty() {
            self.stats.drafts += 1;
            self.stats.drafted += drafts.len() as u64;
            self.stats.accepted += accepted as u64;
            if self.stats.accepted_per_pos.len() < drafts.len() {
                self.stats.accepted_per_pos.resize(drafts.len(), 0);
            }
            for p in &mut self.stats.accepted_per_pos[..accepted] {
                *p += 1;
            }
        }
        let kept = &batch[..accepted + 1];
        let h_rows = if accepted < drafts.len() {
            // Rejected rows advanced the state: restore the recurrent checkpoint, drop their
            // cache rows, and replay the kept prefix so state and h are exactly those of
            // decoding it token by token.
            for (c, s) in self.checkpoint.iter().zip(self.seq.rs.iter_mut()) {
                if let (Some(c), Some(s)) = (c.as_ref(), s.as_mut()) {
                    self.be.recurrent_copy(c, s);
                }
            }
            for kv in self.seq.kv.iter_mut().flatten() {
                self.be.kv_truncate(kv, n_past);
            }
            self.seq.pos = n_past;
            let replay = self.model.forward(self.be, &mut self.seq, kept, true)?;
            self.mtp.is_some().then(|| self.be.to_host(&replay.h))
        } else {
            self.mtp.is_some().then(|| self.be.to_host(&out.h))
        };
        if let Some(h) = h_rows {
            self.mtp_process(kept, &h)?;
        }
        self.last = produced.last().copied();
        Ok(produced)
    }
}
