//! Token sampling for `tern generate`: greedy at temperature 0, otherwise temperature with
//! optional top-k / top-p, from a seeded generator so a run can be repeated.

#[derive(Clone, Debug)]
pub struct SamplerConfig {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    state: u64,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let state = cfg.seed ^ 0x9E37_79B9_7F4A_7C15;
        Sampler { cfg, state }
    }

    /// splitmix64: small, seedable, and good enough to draw one uniform per token.
    fn next_f64(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        if self.cfg.top_k > 0 {
            idx.truncate(self.cfg.top_k);
        }
        let t = self.cfg.temperature;
        let m = logits[idx[0]];
        let mut p: Vec<f64> = idx
            .iter()
            .map(|&i| (((logits[i] - m) / t) as f64).exp())
            .collect();
        let total: f64 = p.iter().sum();
        p.iter_mut().for_each(|v| *v /= total);
        if self.cfg.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = p.len();
            for (i, v) in p.iter().enumerate() {
                acc += v;
                if acc >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            p.truncate(keep);
            let total: f64 = p.iter().sum();
            p.iter_mut().for_each(|v| *v /= total);
        }
        let r = self.next_f64();
        let mut acc = 0.0;
        for (k, v) in p.iter().enumerate() {
            acc += v;
            if r < acc {
                return idx[k] as u32;
            }
        }
        idx[p.len() - 1] as u32
    }
}

pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded() {
        let logits = [0.1f32, 2.0, -1.0, 1.9];
        assert_eq!(Sampler::new(SamplerConfig::default()).sample(&logits), 1);
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 7,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(cfg.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(cfg);
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b, "same seed, same draws");
        assert!(
            a.contains(&3) && a.contains(&1),
            "temperature 1 explores: {a:?}"
        );
        let mut top1 = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: 1,
        });
        assert!((0..20).all(|_| top1.sample(&logits) == 1));
    }
}
