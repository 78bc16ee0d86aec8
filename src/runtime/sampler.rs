//! Token sampling as llama.cpp's default chain applies it: penalties, top-k, top-p, min-p,
//! temperature, then a seeded draw (greedy at temperature 0). Defaults come from the model file
//! (`general.sampling.*`), then flags, then the request.

use crate::gguf::Gguf;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0.0 = off.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// llama.cpp's repeat penalty: a seen token's positive logit is divided by it, a negative
    /// one multiplied (1.0 = off).
    pub repeat_penalty: f32,
    /// How many recent tokens the penalties look at (llama.cpp's penalty_last_n).
    pub penalty_last_n: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    /// llama.cpp's common defaults.
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repeat_penalty: 1.0,
            penalty_last_n: 64,
            seed: 0,
        }
    }
}

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
        Ok(())
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    /// `--reasoning-budget`, when armed.
    budget: Option<super::budget::ReasoningBudget>,
    state: u64,
    /// Tokens generated so far (the penalty window is the last `penalty_last_n`).
    history: Vec<u32>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let state = cfg.seed ^ 0x9E37_79B9_7F4A_7C15;
        Sampler {
            cfg,
            budget: None,
            state,
            history: Vec::new(),
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

    pub fn is_greedy(&self) -> bool {
        self.cfg.temperature <= 0.0
            && self.cfg.presence_penalty == 0.0
            && self.cfg.frequency_penalty == 0.0
            && self.cfg.repeat_penalty == 1.0
    }

    /// Records a token as generated (penalties see it from now on).
    pub fn accept(&mut self, id: u32) {
        self.history.push(id);
        if let Some(b) = &mut self.budget {
            b.accept(id);
        }
    }

    /// splitmix64: small, seedable, one uniform per token.
    fn next_f64(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let (pp, fp, rp) = (
            self.cfg.presence_penalty,
            self.cfg.frequency_penalty,
            self.cfg.repeat_penalty,
        );
        if (pp == 0.0 && fp == 0.0 && rp == 1.0) || self.cfg.penalty_last_n == 0 {
            return;
        }
        let start = self.history.len().saturating_sub(self.cfg.penalty_last_n);
        let mut counts: std::collections::HashMap<u32, u32> = Default::default();
        for &t in &self.history[start..] {
            *counts.entry(t).or_default() += 1;
        }
        for (t, n) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                if *l <= 0.0 {
                    *l *= rp;
                } else {
                    *l /= rp;
                }
                *l -= n as f32 * fp + pp;
            }
        }
    }

    /// Draws the next token from a logits row (does not record it: call `accept`).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let mut logits = logits.to_vec();
        self.apply_penalties(&mut logits);
        if self.cfg.temperature <= 0.0 {
            return argmax(&logits);
        }
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        let k = if self.cfg.top_k > 0 {
            self.cfg.top_k.min(idx.len())
        } else {
            idx.len()
        };
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
            idx.truncate(k);
        }
        idx.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        // top-p and min-p act on the distribution before temperature, as in llama.cpp's chain.
        let m = logits[idx[0]];
        let mut p: Vec<f64> = idx
            .iter()
            .map(|&i| ((logits[i] - m) as f64).exp())
            .collect();
        let total: f64 = p.iter().sum();
        p.iter_mut().for_each(|v| *v /= total);
        let mut keep = p.len();
        if self.cfg.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, v) in p.iter().enumerate() {
                acc += v;
                if acc >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if self.cfg.min_p > 0.0 {
            let floor = p[0] * self.cfg.min_p as f64;
            keep = keep.min(p.iter().take_while(|&&v| v >= floor).count().max(1));
        }
        idx.truncate(keep);
        let t = self.cfg.temperature as f64;
        let mut w: Vec<f64> = idx
            .iter()
            .map(|&i| (((logits[i] - m) as f64) / t).exp())
            .collect();
        let total: f64 = w.iter().sum();
        w.iter_mut().for_each(|v| *v /= total);
        let r = self.next_f64();
        let mut acc = 0.0;
        for (j, v) in w.iter().enumerate() {
            acc += v;
            if r < acc {
                return idx[j] as u32;
            }
        }
        idx[idx.len() - 1] as u32
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

    #[test]
    fn greedy_takes_the_argmax_with_ties_low() {
        assert_eq!(
            Sampler::new(SamplerConfig::greedy()).sample(&[0.1, 2.0, -1.0, 2.0]),
            1
        );
    }

    #[test]
    fn seeded_draws_repeat_and_explore() {
        let logits = [0.1f32, 2.0, -1.0, 1.9];
        let a = draws(
            SamplerConfig {
                seed: 7,
                ..cfg(1.0)
            },
            &logits,
            200,
        );
        assert_eq!(
            a,
            draws(
                SamplerConfig {
                    seed: 7,
                    ..cfg(1.0)
                },
                &logits,
                200
            )
        );
        assert_ne!(
            a,
            draws(
                SamplerConfig {
                    seed: 8,
                    ..cfg(1.0)
                },
                &logits,
                200
            )
        );
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
        assert!(draws(
            SamplerConfig {
                top_k: 1,
                ..cfg(1.0)
            },
            &logits,
            50
        )
        .iter()
        .all(|&t| t == 0));
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
    fn presence_and_frequency_penalties() {
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
    }

    #[test]
    fn validation_names_the_field() {
        assert!(SamplerConfig {
            top_p: 1.5,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .contains("top_p"));
        assert!(SamplerConfig {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .contains("temperature"));
        assert!(SamplerConfig::default().validate().is_ok());
    }

    #[test]
    fn probability_is_softmax() {
        let p = probability(&[0.0, (3.0f32).ln()], 1);
        assert!((p - 0.75).abs() < 1e-6);
    }
}
