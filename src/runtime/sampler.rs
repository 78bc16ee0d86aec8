//! Token sampling as llama.cpp's default chain applies it (`common/sampling.cpp`,
//! `src/llama-sampler.cpp`): the constraint's mask, logit bias, then penalties (repeat,
//! frequency, presence), DRY, top-n-sigma, top-k, typical-p, top-p, min-p, XTC and temperature
//! (dynamic with `dynatemp_range`), then a seeded draw; or temperature and mirostat (v1/v2) in
//! place of everything after the penalties' neighbours, as llama.cpp's `mirostat` switch does.
//! Greedy at temperature 0. Defaults come from the model file (`general.sampling.*`), then flags,
//! then the request.
//!
//! The penalty and DRY windows see the prompt as well as the output: llama-server feeds every
//! prompt token to the sampler before the first draw.

use crate::gguf::Gguf;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    pub temperature: f32,
    /// Dynamic temperature: the range `temperature ± dynatemp_range` (0 = off).
    pub dynatemp_range: f32,
    pub dynatemp_exponent: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0.0 = off.
    pub min_p: f32,
    /// Locally typical sampling (1.0 = off).
    pub typical_p: f32,
    /// Keep logits within n standard deviations of the maximum (<= 0 = off).
    pub top_n_sigma: f32,
    /// XTC: with this probability, drop the most likely tokens above `xtc_threshold` but the last.
    pub xtc_probability: f32,
    pub xtc_threshold: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// llama.cpp's repeat penalty: a seen token's positive logit is divided by it, a negative
    /// one multiplied (1.0 = off).
    pub repeat_penalty: f32,
    /// How many recent tokens the penalties look at (llama.cpp's penalty_last_n).
    pub penalty_last_n: usize,
    /// DRY ("don't repeat yourself") multiplier (0 = off), base, allowed length and window.
    pub dry_multiplier: f32,
    pub dry_base: f32,
    pub dry_allowed_length: usize,
    pub dry_penalty_last_n: usize,
    /// The sequence breakers as llama.cpp processes them: a head token and the tail tokens that
    /// must precede it (empty for a one-token breaker). Built from the text breakers by
    /// [`dry_breakers`], which needs the vocabulary.
    pub dry_breakers: Vec<(u32, Vec<u32>)>,
    /// 0 = off, 1 = mirostat, 2 = mirostat 2.0.
    pub mirostat: u8,
    pub mirostat_tau: f32,
    pub mirostat_eta: f32,
    /// Fewest candidates top-p, min-p, typical-p and XTC leave.
    pub min_keep: usize,
    /// Added to a token's logit before anything else (`-inf` bans it).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Default for SamplerConfig {
    /// llama.cpp's common defaults.
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            dynatemp_range: 0.0,
            dynatemp_exponent: 1.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            typical_p: 1.0,
            top_n_sigma: -1.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: usize::MAX,
            dry_breakers: Vec::new(),
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            min_keep: 0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

/// llama.cpp's default DRY sequence breakers.
pub const DRY_BREAKERS: [&str; 4] = ["\n", ":", "\"", "*"];

impl SamplerConfig {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// llama.cpp's defaults overridden by the model's own `general.sampling.*` keys.
    pub fn from_gguf(g: &Gguf) -> Self {
        let mut c = SamplerConfig::default();
        if let Some(v) = g.get_f64("general.sampling.temp") {
            c.temperature = v as f32;
        }
        if let Some(v) = g.get_u64("general.sampling.top_k") {
            c.top_k = v as usize;
        }
        if let Some(v) = g.get_f64("general.sampling.top_p") {
            c.top_p = v as f32;
        }
        if let Some(v) = g.get_f64("general.sampling.min_p") {
            c.min_p = v as f32;
        }
        if let Some(v) = g.get_u64("general.sampling.penalty_last_n") {
            c.penalty_last_n = v as usize;
        }
        if let Some(v) = g.get_f64("general.sampling.penalty_repeat") {
            c.repeat_penalty = v as f32;
        }
        if let Some(v) = g.get_f64("general.sampling.xtc_probability") {
            c.xtc_probability = v as f32;
        }
        if let Some(v) = g.get_f64("general.sampling.xtc_threshold") {
            c.xtc_threshold = v as f32;
        }
        if let Some(v) = g.get_u64("general.sampling.mirostat") {
            c.mirostat = v.min(255) as u8;
        }
        if let Some(v) = g.get_f64("general.sampling.mirostat_tau") {
            c.mirostat_tau = v as f32;
        }
        if let Some(v) = g.get_f64("general.sampling.mirostat_eta") {
            c.mirostat_eta = v as f32;
        }
        c
    }

    /// Checks the ranges, naming the field at fault.
    pub fn validate(&self) -> Result<(), String> {
        let bad = |f: &str, v: f32, r: &str| Err(format!("{f} = {v} is out of range ({r})"));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", self.temperature, ">= 0");
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad("top_p", self.top_p, "0..=1");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "0..=1");
        }
        if !(0.0..=1.0).contains(&self.typical_p) {
            return bad("typical_p", self.typical_p, "0..=1");
        }
        if !(0.0..=1.0).contains(&self.xtc_probability) {
            return bad("xtc_probability", self.xtc_probability, "0..=1");
        }
        if !(0.0..=1.0).contains(&self.xtc_threshold) {
            return bad("xtc_threshold", self.xtc_threshold, "0..=1");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", self.presence_penalty, "-2..=2");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", self.frequency_penalty, "-2..=2");
        }
        let r = self.repeat_penalty;
        if !(r.is_finite() && r > 0.0 && (1.0 / r).is_finite()) {
            return bad("repeat_penalty", r, "finite and > 0");
        }
        if !self.dry_multiplier.is_finite() || self.dry_multiplier < 0.0 {
            return bad("dry_multiplier", self.dry_multiplier, ">= 0");
        }
        if !self.dry_base.is_finite() || self.dry_base < 0.0 {
            return bad("dry_base", self.dry_base, ">= 0");
        }
        if !self.dynatemp_range.is_finite() || self.dynatemp_range < 0.0 {
            return bad("dynatemp_range", self.dynatemp_range, ">= 0");
        }
        if !self.dynatemp_exponent.is_finite() {
            return bad("dynatemp_exponent", self.dynatemp_exponent, "finite");
        }
        if !self.top_n_sigma.is_finite() {
            return bad("top_n_sigma", self.top_n_sigma, "finite");
        }
        if self.mirostat > 2 {
            return Err(format!(
                "mirostat = {} is out of range (0, 1 or 2)",
                self.mirostat
            ));
        }
        if !self.mirostat_tau.is_finite() || !self.mirostat_eta.is_finite() {
            return Err("mirostat_tau and mirostat_eta must be finite".into());
        }
        Ok(())
    }

    fn penalties_on(&self) -> bool {
        self.penalty_last_n > 0
            && (self.repeat_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }

    fn dry_on(&self) -> bool {
        self.dry_multiplier != 0.0 && self.dry_base >= 1.0 && self.dry_penalty_last_n > 0
    }
}

/// llama.cpp's processed DRY breakers (`get_overlapping_token_sequences`): every token whose
/// text contains a breaker is a one-token breaker; a token whose text ends with the start of a
/// breaker heads a sequence whose tail is the rest of the breaker, tokenized (at most 40 tokens).
/// `pieces[id]` is each token's text with specials rendered; `tokenize` encodes plain text.
pub fn dry_breakers(
    breakers: &[String],
    pieces: &dyn Fn(u32) -> Vec<u8>,
    n_vocab: usize,
    tokenize: &dyn Fn(&str) -> Vec<u32>,
) -> Vec<(u32, Vec<u32>)> {
    const MAX_SEQ_LEN: usize = 40;
    let mut out: Vec<(u32, Vec<u32>)> = Vec::new();
    for b in breakers {
        // llama.cpp truncates a breaker to MAX_CHAR_LEN (40) bytes.
        let mut end = b.len().min(40);
        while !b.is_char_boundary(end) {
            end -= 1;
        }
        let s = &b.as_bytes()[..end];
        if s.is_empty() {
            continue;
        }
        for id in 0..n_vocab as u32 {
            let word = pieces(id);
            if word.windows(s.len()).any(|w| w == s) {
                out.push((id, Vec::new()));
                continue;
            }
            for pos in (0..word.len()).filter(|&p| word[p] == s[0]) {
                let mut i = 1;
                let mut matched = true;
                while i < s.len() && pos + i < word.len() {
                    if word[pos + i] != s[i] {
                        matched = false;
                        break;
                    }
                    i += 1;
                }
                if !matched {
                    continue;
                }
                let mut tail = std::str::from_utf8(&s[i..])
                    .map(tokenize)
                    .unwrap_or_default();
                tail.truncate(MAX_SEQ_LEN);
                if !out.iter().any(|(t, v)| *t == id && *v == tail) {
                    out.push((id, tail));
                }
            }
        }
    }
    out
}

/// A token and its probability.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenProb {
    pub id: u32,
    pub p: f32,
}

/// What a request wants to know of each sampled token's distribution (`n_probs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProbsRequest {
    /// How many of the most likely tokens to report.
    pub n: usize,
    /// The distribution after the sampling chain (llama-server's `post_sampling_probs`) instead
    /// of the model's softmax.
    pub post_sampling: bool,
}

/// One sampled token's probabilities: its own and the `n` most likely, most likely first.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenProbs {
    pub p: f32,
    pub top: Vec<TokenProb>,
    pub post_sampling: bool,
}

/// A set of allowed token ids, 32 to a word (llguidance's mask layout).
pub type Mask<'a> = &'a [u32];

fn allowed(mask: Option<Mask>, id: usize) -> bool {
    mask.is_none_or(|m| m.get(id / 32).is_some_and(|w| w >> (id % 32) & 1 == 1))
}

#[derive(Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    /// `--reasoning-budget`, when armed.
    budget: Option<super::budget::ReasoningBudget>,
    state: u64,
    /// Prompt and generated tokens (the penalty and DRY windows are its tail).
    history: Vec<u32>,
    /// Mirostat's running target surprise.
    mu: f32,
}

#[derive(Clone, Copy)]
struct Cand {
    id: u32,
    logit: f32,
    p: f32,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let state = cfg.seed ^ 0x9E37_79B9_7F4A_7C15;
        let mu = 2.0 * cfg.mirostat_tau;
        Sampler {
            cfg,
            budget: None,
            state,
            history: Vec::new(),
            mu,
        }
    }

    /// Arms a reasoning budget over this generation.
    pub fn with_budget(mut self, budget: Option<super::budget::BudgetConfig>) -> Sampler {
        self.budget = budget.map(super::budget::ReasoningBudget::new);
        self
    }

    /// The token the reasoning budget forces next, if any.
    pub fn forced(&self) -> Option<u32> {
        self.budget.as_ref().and_then(|b| b.forced())
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Whether the draw is a plain argmax of the logits (it can run on the device).
    pub fn is_greedy(&self) -> bool {
        self.cfg.temperature <= 0.0
            && !self.cfg.penalties_on()
            && !self.cfg.dry_on()
            && self.cfg.logit_bias.is_empty()
    }

    /// Records a prompt token: the penalties and DRY see it (as llama-server feeds the prompt
    /// to its sampler); the reasoning budget keeps its own view of the generation prompt.
    pub fn accept_prompt(&mut self, id: u32) {
        self.history.push(id);
    }

    /// Records a generated token: the penalties see it from now on.
    pub fn accept(&mut self, id: u32) {
        self.history.push(id);
        if let Some(b) = &mut self.budget {
            b.accept(id);
        }
    }

    /// splitmix64: small, seedable, one stream for every random choice.
    fn next_f64(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let c = &self.cfg;
        if !c.penalties_on() {
            return;
        }
        let start = self.history.len().saturating_sub(c.penalty_last_n);
        let mut counts: std::collections::HashMap<u32, u32> = Default::default();
        for &t in &self.history[start..] {
            *counts.entry(t).or_default() += 1;
        }
        for (t, n) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                // llama.cpp multiplies negative logits so that a penalty never raises a token.
                if *l <= 0.0 {
                    *l *= c.repeat_penalty;
                } else {
                    *l /= c.repeat_penalty;
                }
                *l -= n as f32 * c.frequency_penalty + c.presence_penalty;
            }
        }
    }

    /// DRY as llama.cpp computes it: for each token that would extend a repeat of at least
    /// `dry_allowed_length` tokens of the window, `multiplier * base^(len - allowed)`.
    fn apply_dry(&self, logits: &mut [f32]) {
        let c = &self.cfg;
        if !c.dry_on() {
            return;
        }
        let n = self.history.len().min(c.dry_penalty_last_n);
        if n <= c.dry_allowed_length {
            return;
        }
        let last = &self.history[self.history.len() - n..];
        // rat(i): the i-th token from the end.
        let rat = |i: usize| last[n - 1 - i];
        let mut rep_limit = n;
        'scan: for i in 0..n {
            let tok = rat(i);
            let mut longest: Option<usize> = None;
            for (_, tail) in c.dry_breakers.iter().filter(|(h, _)| *h == tok) {
                let len = tail.len();
                if longest.is_none_or(|l| len > l)
                    && len <= i
                    && (0..len).all(|o| tail[o] == rat(i - o - 1))
                {
                    longest = Some(len);
                }
            }
            if let Some(l) = longest {
                rep_limit = i - l;
                break 'scan;
            }
        }
        if rep_limit < c.dry_allowed_length {
            return;
        }
        // repeat[k]: the length of the longest suffix of the window that also ends k tokens
        // before its end (the reverse Z-function), capped by rep_limit.
        let mut max_rep: std::collections::HashMap<u32, usize> = Default::default();
        for k in 1..n {
            let mut m = 0;
            while m + k < n && rat(m) == rat(m + k) {
                m += 1;
            }
            let m = m.min(rep_limit);
            if m >= c.dry_allowed_length {
                // The token that followed that earlier occurrence would continue the repeat.
                let next = rat(k - 1);
                let e = max_rep.entry(next).or_default();
                *e = (*e).max(m);
            }
        }
        let max_exp = if c.dry_base > 1.000_001 {
            (88.722_84 / c.dry_base.ln()) as i64
        } else {
            0
        };
        for (tok, len) in max_rep {
            let single_breaker = c
                .dry_breakers
                .iter()
                .any(|(h, t)| *h == tok && t.is_empty());
            if single_breaker {
                continue;
            }
            let mut e = len as i64 - c.dry_allowed_length as i64;
            if max_exp > 0 && e > max_exp {
                e = max_exp;
            }
            if let Some(l) = logits.get_mut(tok as usize) {
                *l -= c.dry_multiplier * c.dry_base.powi(e as i32);
            }
        }
    }

    /// Draws the next token from a logits row (does not record it: call `accept`), keeping to
    /// `mask` when given, and reports its probabilities when `probs` asks.
    pub fn sample_with(
        &mut self,
        logits: &[f32],
        mask: Option<Mask>,
        probs: Option<ProbsRequest>,
    ) -> (u32, Option<TokenProbs>) {
        let c = &self.cfg;
        // The row is copied only when something rewrites it.
        let edits = mask.is_some() || !c.logit_bias.is_empty() || c.penalties_on() || c.dry_on();
        let mut owned = Vec::new();
        if edits {
            owned = logits.to_vec();
            if mask.is_some() {
                for (i, x) in owned.iter_mut().enumerate() {
                    if !allowed(mask, i) {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
            for &(id, b) in &c.logit_bias {
                if let Some(x) = owned.get_mut(id as usize) {
                    *x += b;
                }
            }
            self.apply_penalties(&mut owned);
            self.apply_dry(&mut owned);
        }
        let l: &[f32] = if edits { &owned } else { logits };
        // top-k is the chain's first cut unless top-n-sigma or mirostat must see every
        // candidate: then one pass over the row keeps the k best instead of building and
        // selecting a candidate per vocabulary entry.
        let mut cands = if c.top_k > 0 && c.top_n_sigma <= 0.0 && c.mirostat == 0 {
            top_k_scan(l, c.top_k)
        } else {
            candidates(l)
        };
        if cands.is_empty() {
            // Everything is banned: llama.cpp would draw from nothing; take the raw argmax of
            // what the mask allows, else of the row.
            let id = (0..logits.len())
                .filter(|&i| allowed(mask, i))
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
                .unwrap_or_else(|| argmax(logits) as usize) as u32;
            let p = probs.map(|r| self.report(logits, &[], id, r));
            return (id, p);
        }
        let id = self.chain(&mut cands);
        let p = probs.map(|r| self.report(logits, &cands, id, r));
        (id, p)
    }

    /// Draws the next token from a logits row (does not record it: call `accept`).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.sample_with(logits, None, None).0
    }

    /// The chain after bias, penalties and DRY; leaves the final candidates (with their
    /// probabilities) in `cands`, most likely first.
    fn chain(&mut self, cands: &mut Vec<Cand>) -> u32 {
        let c = self.cfg.clone();
        if c.mirostat != 0 {
            temp(cands, c.temperature);
            return self.mirostat(cands, c.mirostat);
        }
        top_n_sigma(cands, c.top_n_sigma);
        top_k(cands, c.top_k);
        typical(cands, c.typical_p, c.min_keep);
        top_p(cands, c.top_p, c.min_keep);
        min_p(cands, c.min_p, c.min_keep);
        if c.xtc_probability > 0.0 && c.xtc_threshold <= 0.5 && cands.len() >= 2 {
            let chance = self.next_f64() as f32;
            if chance <= c.xtc_probability {
                softmax_sorted(cands);
                let mut last = 0;
                for (i, x) in cands.iter().enumerate() {
                    if x.p >= c.xtc_threshold {
                        last = i;
                    } else {
                        break;
                    }
                }
                if cands.len() - last >= c.min_keep && last > 0 {
                    cands.drain(..last);
                }
            }
        }
        if c.dynatemp_range > 0.0 {
            dynatemp(cands, c.temperature, c.dynatemp_range, c.dynatemp_exponent);
        } else {
            temp(cands, c.temperature);
        }
        softmax_sorted(cands);
        let r = self.next_f64();
        draw(cands, r)
    }

    fn mirostat(&mut self, cands: &mut Vec<Cand>, version: u8) -> u32 {
        let (tau, eta) = (self.cfg.mirostat_tau, self.cfg.mirostat_eta);
        softmax_sorted(cands);
        if version == 1 {
            let m = 100usize;
            let (mut sum_ti_bi, mut sum_ti_sq) = (0f32, 0f32);
            let mut i = 0;
            while i + 1 < m && i + 1 < cands.len() {
                let t_i = ((i + 2) as f32 / (i + 1) as f32).ln();
                let b_i = (cands[i].p / cands[i + 1].p).ln();
                sum_ti_bi += t_i * b_i;
                sum_ti_sq += t_i * t_i;
                i += 1;
            }
            let s_hat = sum_ti_bi / sum_ti_sq;
            let eps = s_hat - 1.0;
            let n_vocab = self.n_vocab_hint(cands) as f32;
            let k = ((eps * 2f32.powf(self.mu)) / (1.0 - n_vocab.powf(-eps))).powf(1.0 / s_hat);
            let k = if k.is_finite() {
                (k as usize).max(1)
            } else {
                1
            };
            cands.truncate(k.min(cands.len()));
        } else {
            let keep = cands
                .iter()
                .position(|x| -x.p.log2() > self.mu)
                .unwrap_or(cands.len());
            cands.truncate(keep.max(1));
        }
        softmax_sorted(cands);
        let r = self.next_f64();
        let id = draw(cands, r);
        let p = cands.iter().find(|x| x.id == id).map_or(1.0, |x| x.p);
        self.mu -= eta * (-p.log2() - tau);
        id
    }

    fn n_vocab_hint(&self, cands: &[Cand]) -> usize {
        cands.iter().map(|c| c.id as usize + 1).max().unwrap_or(1)
    }

    /// The reported distribution: the model's softmax of the raw row (llama-server's default),
    /// or the chain's final candidates.
    fn report(&self, logits: &[f32], cands: &[Cand], id: u32, r: ProbsRequest) -> TokenProbs {
        if r.post_sampling {
            let p = cands.iter().find(|c| c.id == id).map_or(0.0, |c| c.p);
            let top = cands
                .iter()
                .take(r.n)
                .take_while(|c| c.p > 0.0)
                .map(|c| TokenProb { id: c.id, p: c.p })
                .collect();
            return TokenProbs {
                p,
                top,
                post_sampling: true,
            };
        }
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total: f64 = logits.iter().map(|&l| ((l - m) as f64).exp()).sum();
        let prob = |i: usize| (((logits[i] - m) as f64).exp() / total) as f32;
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        let n = r.n.min(idx.len());
        let cmp = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        if n > 0 && n < idx.len() {
            idx.select_nth_unstable_by(n - 1, cmp);
        }
        idx.truncate(n);
        idx.sort_unstable_by(cmp);
        TokenProbs {
            p: prob(id as usize),
            top: idx
                .into_iter()
                .map(|i| TokenProb {
                    id: i as u32,
                    p: prob(i),
                })
                .collect(),
            post_sampling: false,
        }
    }
}

/// The first non-finite value of a logits row: a forward pass that produced one is broken, and
/// its row must not be sampled (an argmax over NaN quietly picks token 0).
pub fn non_finite(row: &[f32]) -> Option<(usize, f32)> {
    row.iter().position(|v| !v.is_finite()).map(|i| (i, row[i]))
}

/// Every row of `[n_rows, n_vocab]` logits finite, or the first offender as an error.
pub fn check_logits(logits: &[f32], n_vocab: usize) -> Result<(), crate::model::ModelError> {
    match non_finite(logits) {
        None => Ok(()),
        Some((i, value)) => Err(crate::model::ModelError::NonFiniteLogits {
            row: i / n_vocab.max(1),
            token: i % n_vocab.max(1),
            value,
        }),
    }
}

fn sort_desc(c: &mut [Cand]) {
    c.sort_unstable_by(|a, b| b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id)));
}

/// Sorts by logit and sets each candidate's probability.
fn softmax_sorted(c: &mut [Cand]) {
    sort_desc(c);
    let Some(m) = c.first().map(|x| x.logit) else {
        return;
    };
    let mut total = 0f64;
    for x in c.iter_mut() {
        let e = ((x.logit - m) as f64).exp();
        x.p = e as f32;
        total += e;
    }
    for x in c.iter_mut() {
        x.p = (x.p as f64 / total) as f32;
    }
}

fn draw(c: &[Cand], r: f64) -> u32 {
    let mut acc = 0.0;
    for x in c {
        acc += x.p as f64;
        if r < acc {
            return x.id;
        }
    }
    c[c.len() - 1].id
}

fn top_n_sigma(c: &mut Vec<Cand>, n: f32) {
    if n <= 0.0 || c.len() <= 1 {
        return;
    }
    let max = c.iter().map(|x| x.logit).fold(f32::NEG_INFINITY, f32::max);
    let mean = c.iter().map(|x| x.logit).sum::<f32>() / c.len() as f32;
    let var = c.iter().map(|x| (x.logit - mean).powi(2)).sum::<f32>() / c.len() as f32;
    let floor = max - n * var.sqrt();
    c.retain(|x| x.logit >= floor);
}

fn top_k(c: &mut Vec<Cand>, k: usize) {
    if k == 0 || k >= c.len() {
        return;
    }
    c.select_nth_unstable_by(k - 1, |a, b| {
        b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
    });
    c.truncate(k);
    sort_desc(c);
}

/// Every entry of `row` that is not -inf, as a candidate.
fn candidates(row: &[f32]) -> Vec<Cand> {
    row.iter()
        .enumerate()
        .filter(|(_, &x)| x > f32::NEG_INFINITY)
        .map(|(i, &x)| Cand {
            id: i as u32,
            logit: x,
            p: 0.0,
        })
        .collect()
}

/// The candidates `top_k(k)` leaves of a row's finite entries above `-inf`, exactly (the same
/// set, in the same order), in one pass: entries are kept while they can still be among the k
/// best, and the buffer is cut back to k whenever it reaches `4k`. Ids rise along the scan, so
/// once cut, an entry that only ties the k-th logit loses the tie and is never kept.
/// The buffer never holds more than the row: `k` comes from the request, and a `top_k` of
/// 10^10 once asked this for a 100 GB buffer.
fn top_k_scan(row: &[f32], k: usize) -> Vec<Cand> {
    if k >= row.len() {
        return candidates(row);
    }
    let cap = k.max(16).saturating_mul(4).min(row.len());
    let mut buf: Vec<Cand> = Vec::with_capacity(cap + 1);
    let mut floor = f32::NEG_INFINITY;
    let mut cut = false;
    let by_rank = |a: &Cand, b: &Cand| b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id));
    for (i, &x) in row.iter().enumerate() {
        if x > floor {
            buf.push(Cand {
                id: i as u32,
                logit: x,
                p: 0.0,
            });
            if buf.len() >= cap {
                buf.select_nth_unstable_by(k - 1, by_rank);
                buf.truncate(k);
                floor = buf.iter().map(|c| c.logit).fold(f32::INFINITY, f32::min);
                cut = true;
            }
        }
    }
    // As `top_k`: the k best sorted, or every entry in id order when there are no more than k.
    if cut || buf.len() > k {
        if buf.len() > k {
            buf.select_nth_unstable_by(k - 1, by_rank);
            buf.truncate(k);
        }
        sort_desc(&mut buf);
    }
    buf
}

fn typical(c: &mut Vec<Cand>, p: f32, min_keep: usize) {
    if p >= 1.0 {
        return;
    }
    softmax_sorted(c);
    let entropy: f32 = c
        .iter()
        .filter(|x| x.p > 0.0)
        .map(|x| -x.p * x.p.ln())
        .sum();
    let mut order: Vec<(f32, usize)> = c
        .iter()
        .enumerate()
        .map(|(i, x)| ((-x.p.ln() - entropy).abs(), i))
        .collect();
    order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut cum = 0f32;
    let mut last = order.len();
    for (i, &(_, j)) in order.iter().enumerate() {
        cum += c[j].p;
        if cum > p && (min_keep == 0 || i + 1 >= min_keep) {
            last = i + 1;
            break;
        }
    }
    let kept: Vec<Cand> = order[..last].iter().map(|&(_, j)| c[j]).collect();
    *c = kept;
}

fn top_p(c: &mut Vec<Cand>, p: f32, min_keep: usize) {
    if p >= 1.0 {
        return;
    }
    softmax_sorted(c);
    let mut cum = 0f32;
    for i in 0..c.len() {
        cum += c[i].p;
        if cum >= p && i + 1 >= min_keep {
            c.truncate(i + 1);
            return;
        }
    }
}

fn min_p(c: &mut Vec<Cand>, p: f32, min_keep: usize) {
    if p <= 0.0 || c.is_empty() {
        return;
    }
    let max = c.iter().map(|x| x.logit).fold(f32::NEG_INFINITY, f32::max);
    let floor = max + p.ln();
    let kept = c.iter().filter(|x| x.logit >= floor).count();
    if kept >= min_keep.max(1) {
        c.retain(|x| x.logit >= floor);
    } else {
        sort_desc(c);
        c.truncate(min_keep.max(1));
    }
}

fn temp(c: &mut [Cand], t: f32) {
    if t <= 0.0 {
        // Only the most likely survives (llama.cpp sets the rest to -inf).
        sort_desc(c);
        for x in c.iter_mut().skip(1) {
            x.logit = f32::NEG_INFINITY;
        }
        return;
    }
    for x in c.iter_mut() {
        x.logit /= t;
    }
}

fn dynatemp(c: &mut [Cand], t: f32, delta: f32, exponent: f32) {
    if c.len() <= 1 {
        return;
    }
    let (lo, hi) = ((t - delta).max(0.0), t + delta);
    let max_entropy = (c.len() as f32).ln();
    softmax_sorted(c);
    let entropy: f32 = c
        .iter()
        .filter(|x| x.p > 0.0)
        .map(|x| -x.p * x.p.ln())
        .sum();
    let dyn_t = lo + (hi - lo) * (entropy / max_entropy).powf(exponent);
    temp(c, dyn_t);
}

/// The most likely token `mask` allows (ties to the lower id, as the chain's sort has them);
/// the plain argmax when the mask allows nothing.
pub fn masked_argmax(x: &[f32], mask: Option<Mask>) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in x.iter().enumerate() {
        if allowed(mask, i) && best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map_or_else(|| argmax(x), |(i, _)| i as u32)
}

/// Index of the largest value; ties go to the lowest index.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Softmax probability of `id` in a logits row.
pub fn probability(logits: &[f32], id: u32) -> f32 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = logits.iter().map(|&l| ((l - m) as f64).exp()).sum();
    (((logits[id as usize] - m) as f64).exp() / total) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32) -> SamplerConfig {
        SamplerConfig {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        }
    }

    fn draws(c: SamplerConfig, logits: &[f32], n: usize) -> Vec<u32> {
        let mut s = Sampler::new(c);
        (0..n).map(|_| s.sample(logits)).collect()
    }

    /// The one-pass top-k keeps what building every candidate and cutting with `top_k` keeps,
    /// in the same order: ties at the k-th logit, banned entries, fewer entries than k, k = 1.
    #[test]
    fn top_k_scan_matches_the_full_cut() {
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        for (n, k, levels) in [
            (5000, 40, 50),
            (5000, 1, 7),
            (30, 40, 5),
            (1000, 40, 3),
            (200_000, 40, 100_000),
            // 4k past the row, k past the row, and k from a request that asked for 2^31.
            (100, 30, 5),
            (100, 99, 5),
            (64, 1 << 31, 5),
            (64, usize::MAX / 2, 5),
        ] {
            let row: Vec<f32> = (0..n)
                .map(|_| match next() % 97 {
                    0 => f32::NEG_INFINITY,
                    _ => (next() % levels) as f32 * 0.25 - 3.0,
                })
                .collect();
            let mut full = candidates(&row);
            top_k(&mut full, k);
            let fast = top_k_scan(&row, k);
            let ids = |c: &[Cand]| {
                c.iter()
                    .map(|c| (c.id, c.logit.to_bits()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(ids(&fast), ids(&full), "n {n} k {k} levels {levels}");
        }
    }

    #[test]
    fn greedy_takes_the_argmax_with_ties_low() {
        assert_eq!(
            Sampler::new(SamplerConfig::greedy()).sample(&[0.1, 2.0, -1.0, 2.0]),
            1
        );
    }

    /// A request's top_k past the vocabulary is no cut at all (the fuzzer's 2^31 once aborted
    /// the server on a 100 GB allocation).
    #[test]
    fn a_top_k_past_the_vocabulary_draws_as_no_cut() {
        let logits = [0.1f32, 2.0, -1.0, 1.9];
        for k in [4usize, 5, 1 << 31, usize::MAX] {
            let c = |top_k| SamplerConfig {
                seed: 5,
                top_k,
                ..cfg(1.0)
            };
            assert_eq!(
                draws(c(k), &logits, 50),
                draws(c(0), &logits, 50),
                "top_k {k}"
            );
        }
    }

    #[test]
    fn seeded_draws_repeat_and_explore() {
        let logits = [0.1f32, 2.0, -1.0, 1.9];
        let c = |seed| SamplerConfig { seed, ..cfg(1.0) };
        let a = draws(c(7), &logits, 200);
        assert_eq!(a, draws(c(7), &logits, 200));
        assert_ne!(a, draws(c(8), &logits, 200));
        for t in 0..4 {
            assert!(a.contains(&t), "temperature 1 reaches token {t}");
        }
    }

    #[test]
    fn frequencies_follow_the_softmax() {
        let logits = [0.0f32, (2.0f32).ln(), (3.0f32).ln()];
        let n = 30_000;
        let d = draws(
            SamplerConfig {
                seed: 3,
                ..cfg(1.0)
            },
            &logits,
            n,
        );
        for (t, want) in [(0, 1.0 / 6.0), (1, 2.0 / 6.0), (2, 3.0 / 6.0)] {
            let got = d.iter().filter(|&&x| x == t).count() as f64 / n as f64;
            assert!((got - want).abs() < 0.015, "token {t}: {got} vs {want}");
        }
    }

    #[test]
    fn top_k_top_p_min_p_cut_the_tail() {
        let logits = [3.0f32, 2.9, 0.0, -5.0, 2.8];
        let d = draws(
            SamplerConfig {
                top_k: 1,
                ..cfg(1.0)
            },
            &logits,
            50,
        );
        assert!(d.iter().all(|&t| t == 0));
        let d = draws(
            SamplerConfig {
                top_k: 2,
                ..cfg(5.0)
            },
            &logits,
            300,
        );
        assert!(d.iter().all(|&t| t == 0 || t == 1) && d.contains(&1));
        // p = softmax: tokens 0,1,4 hold ~97%; top_p 0.5 keeps 0 and 1.
        let d = draws(
            SamplerConfig {
                top_p: 0.5,
                ..cfg(3.0)
            },
            &logits,
            300,
        );
        assert!(d.iter().all(|&t| t == 0 || t == 1), "{d:?}");
        let d = draws(
            SamplerConfig {
                min_p: 0.5,
                ..cfg(10.0)
            },
            &logits,
            300,
        );
        assert!(d.iter().all(|&t| [0, 1, 4].contains(&t)) && d.contains(&4));
    }

    #[test]
    fn presence_frequency_and_repeat_penalties() {
        let logits = [1.0f32, 0.9, 0.0];
        let mut s = Sampler::new(SamplerConfig {
            presence_penalty: 0.5,
            ..SamplerConfig::greedy()
        });
        assert_eq!(s.sample(&logits), 0);
        s.accept(0);
        assert_eq!(
            s.sample(&logits),
            1,
            "presence penalty moves off a seen token"
        );
        let mut s = Sampler::new(SamplerConfig {
            frequency_penalty: 0.06,
            ..SamplerConfig::greedy()
        });
        s.accept(0);
        assert_eq!(s.sample(&logits), 0, "one occurrence costs 0.06 < 0.1");
        s.accept(0);
        assert_eq!(s.sample(&logits), 1, "two cost 0.12");
        let mut s = Sampler::new(SamplerConfig {
            presence_penalty: 2.0,
            penalty_last_n: 1,
            ..SamplerConfig::greedy()
        });
        s.accept(0);
        s.accept(1);
        assert_eq!(s.sample(&logits), 0, "token 0 left the window");
        // repeat_penalty 1.2 divides a positive logit: 1.0 / 1.2 < 0.9.
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 1.2,
            ..SamplerConfig::greedy()
        });
        s.accept(0);
        assert_eq!(s.sample(&logits), 1);
        // and multiplies a negative one (it never raises a token).
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 2.0,
            ..SamplerConfig::greedy()
        });
        s.accept(1);
        assert_eq!(s.sample(&[-1.0, -1.5, -3.5]), 0);
        s.accept(0);
        assert_eq!(s.sample(&[-1.0, -1.5, -1.9]), 2);
    }

    #[test]
    fn logit_bias_bans_and_favours() {
        let logits = [2.0f32, 1.0, 0.0];
        let mut s = Sampler::new(SamplerConfig {
            logit_bias: vec![(0, f32::NEG_INFINITY)],
            seed: 5,
            ..cfg(1.0)
        });
        for _ in 0..500 {
            assert_ne!(s.sample(&logits), 0);
        }
        let mut s = Sampler::new(SamplerConfig {
            logit_bias: vec![(2, 5.0)],
            ..SamplerConfig::greedy()
        });
        assert!(
            !s.is_greedy(),
            "a bias moves the draw off the device argmax"
        );
        assert_eq!(s.sample(&logits), 2);
    }

    #[test]
    fn the_mask_is_obeyed_and_reported_probs_are_sorted() {
        let logits = [3.0f32, 2.0, 1.0, 0.0, -1.0];
        let mask = [0b10110u32]; // tokens 1, 2 and 4
        let mut s = Sampler::new(SamplerConfig {
            seed: 1,
            ..cfg(2.0)
        });
        for _ in 0..300 {
            let (id, p) = s.sample_with(
                &logits,
                Some(&mask),
                Some(ProbsRequest {
                    n: 3,
                    post_sampling: false,
                }),
            );
            assert!([1, 2, 4].contains(&id));
            let p = p.unwrap();
            assert_eq!(p.top.iter().map(|t| t.id).collect::<Vec<_>>(), [0, 1, 2]);
            assert!(p.top.windows(2).all(|w| w[0].p >= w[1].p));
            assert!(p.top.iter().map(|t| t.p).sum::<f32>() <= 1.0);
            assert!((p.p - probability(&logits, id)).abs() < 1e-6);
        }
        let (id, p) = Sampler::new(SamplerConfig::greedy()).sample_with(
            &logits,
            Some(&mask),
            Some(ProbsRequest {
                n: 2,
                post_sampling: true,
            }),
        );
        assert_eq!(id, 1);
        assert_eq!(p.unwrap().top, [TokenProb { id: 1, p: 1.0 }]);
        // The greedy shortcut agrees with the chain, ties to the lower id.
        assert_eq!(masked_argmax(&logits, Some(&mask)), 1);
        assert_eq!(masked_argmax(&[0.0, 5.0, 5.0, 9.0], Some(&[0b0110])), 1);
        assert_eq!(masked_argmax(&logits, Some(&[0])), 0);
    }

    #[test]
    fn typical_xtc_sigma_mirostat_and_dry() {
        // top_n_sigma 0.5 keeps only logits within half a deviation of the max.
        let logits = [5.0f32, 4.9, 0.0, 0.0, 0.0, 0.0];
        let d = draws(
            SamplerConfig {
                top_n_sigma: 0.5,
                ..cfg(5.0)
            },
            &logits,
            200,
        );
        assert!(d.iter().all(|&t| t <= 1) && d.contains(&1));
        // XTC at probability 1 removes every token above the threshold but the least likely.
        let logits = [2.0f32, 1.9, -3.0];
        let d = draws(
            SamplerConfig {
                xtc_probability: 1.0,
                xtc_threshold: 0.3,
                ..cfg(1.0)
            },
            &logits,
            200,
        );
        assert!(d.iter().all(|&t| t != 0), "{d:?}");
        // typical-p keeps the tokens nearest the entropy.
        let logits = [4.0f32, 1.0, 1.0, 1.0];
        let d = draws(
            SamplerConfig {
                typical_p: 0.2,
                ..cfg(1.0)
            },
            &logits,
            200,
        );
        assert!(d.iter().all(|&t| t == 0));
        // mirostat 2 with a small tau keeps the head of the distribution.
        let logits = [5.0f32, 0.0, 0.0, 0.0];
        let d = draws(
            SamplerConfig {
                mirostat: 2,
                mirostat_tau: 0.1,
                ..cfg(1.0)
            },
            &logits,
            100,
        );
        assert!(d.iter().filter(|&&t| t == 0).count() > 90);
        // DRY: "1 2 3 1 2" -> 3 would extend a repeat of length 2.
        let mut s = Sampler::new(SamplerConfig {
            dry_multiplier: 10.0,
            dry_allowed_length: 2,
            ..SamplerConfig::greedy()
        });
        for t in [1, 2, 3, 1, 2] {
            s.accept(t);
        }
        assert_eq!(s.sample(&[0.0, 0.0, 0.0, 1.0, 0.5]), 4);
    }

    #[test]
    fn dry_breakers_follow_llama_cpp() {
        let pieces = |id: u32| match id {
            0 => b"a:".to_vec(),
            1 => b"x".to_vec(),
            2 => b"ab".to_vec(),
            _ => b"zzzz".to_vec(),
        };
        let tokenize = |s: &str| if s == "c" { vec![7] } else { vec![9] };
        let b = dry_breakers(&[":".into(), "bc".into()], &pieces, 4, &tokenize);
        assert!(b.contains(&(0, vec![])));
        assert!(b.contains(&(2, vec![7])));
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn validation_names_the_field() {
        let bad = |c: SamplerConfig| c.validate().unwrap_err();
        assert!(bad(SamplerConfig {
            top_p: 1.5,
            ..Default::default()
        })
        .contains("top_p"));
        assert!(bad(SamplerConfig {
            temperature: -1.0,
            ..Default::default()
        })
        .contains("temperature"));
        assert!(bad(SamplerConfig {
            mirostat: 3,
            ..Default::default()
        })
        .contains("mirostat"));
        assert!(bad(SamplerConfig {
            typical_p: 2.0,
            ..Default::default()
        })
        .contains("typical_p"));
        assert!(SamplerConfig::default().validate().is_ok());
    }

    #[test]
    fn probability_is_softmax() {
        let p = probability(&[0.0, (3.0f32).ln()], 1);
        assert!((p - 0.75).abs() < 1e-6);
    }
}
