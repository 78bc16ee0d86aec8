//! Per-position scores and llama-perplexity's estimators (`tools/perplexity/perplexity.cpp`:
//! `log_softmax`, `mean_and_uncertainty`, `covariance`, `percentile`), so that tern's figures
//! and their ± are llama.cpp's.

use half::f16;
use serde::Serialize;

/// The normaliser of one logits row as llama-perplexity computes it: the max in f32 and
/// Σ exp(l − max) summed in f64 over f32 exponentials. `argmax` is the first maximum.
#[derive(Clone, Copy, Debug)]
pub struct Softmax {
    pub max: f32,
    pub argmax: u32,
    pub sum_exp: f64,
    pub log_sum_exp: f64,
}

impl Softmax {
    pub fn of(row: &[f32]) -> Softmax {
        let mut max = row[0];
        let mut argmax = 0;
        for (i, &x) in row.iter().enumerate().skip(1) {
            if x > max {
                max = x;
                argmax = i;
            }
        }
        let sum_exp: f64 = row.iter().map(|&x| (x - max).exp() as f64).sum();
        Softmax {
            max,
            argmax: argmax as u32,
            sum_exp,
            log_sum_exp: sum_exp.ln(),
        }
    }

    /// ln p of token `i`.
    pub fn log_prob(&self, row: &[f32], i: usize) -> f64 {
        (row[i] - self.max) as f64 - self.log_sum_exp
    }
}

/// The `k` largest entries of `row` as `(id, logit)`, by logit descending and, among equal
/// logits, id ascending (so the first is llama.cpp's argmax). NaN entries are never taken.
pub fn top_k(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return top;
    }
    for (i, &x) in row.iter().enumerate() {
        if x.is_nan() || (top.len() == k && x <= top[k - 1].1) {
            continue;
        }
        let at = top.partition_point(|&(_, v)| v >= x);
        top.insert(at, (i as u32, x));
        top.truncate(k);
    }
    top
}

/// What the base file keeps of one reference position: the top-K tokens with their ln p (f16),
/// the probability mass of every other token, and ln p of the token that followed.
#[derive(Clone, Debug, PartialEq)]
pub struct BaseRow {
    pub ids: Vec<u32>,
    pub logp: Vec<f16>,
    pub rest: f32,
    pub target_logp: f32,
}

/// The reference's row at one scored position (`target` is the next token of the text).
pub fn base_row(row: &[f32], target: u32, k: usize) -> BaseRow {
    let sm = Softmax::of(row);
    let top = top_k(row, k);
    // The same f32 exponentials as in the normaliser, so the rest mass does not lose what
    // the top-K hold to rounding.
    let top_sum: f64 = top.iter().map(|&(_, v)| (v - sm.max).exp() as f64).sum();
    BaseRow {
        ids: top.iter().map(|&(i, _)| i).collect(),
        logp: top
            .iter()
            .map(|&(i, _)| f16::from_f64(sm.log_prob(row, i as usize)))
            .collect(),
        rest: (1.0 - top_sum / sm.sum_exp).max(0.0) as f32,
        target_logp: sm.log_prob(row, target as usize) as f32,
    }
}

/// A stored base position, borrowed from the base file.
#[derive(Clone, Copy, Debug)]
pub struct BaseEntry<'a> {
    pub ids: &'a [u32],
    pub logp: &'a [f16],
    pub rest: f32,
    pub target_logp: f32,
}

/// One candidate position against its base entry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowCmp {
    /// KL(base ‖ candidate) over the base's top-K tokens and one bin for all the others.
    pub kld: f64,
    /// −ln p of the next token, candidate and base.
    pub nll: f64,
    pub nll_base: f64,
    /// p(next token) of the candidate minus the base's.
    pub p_diff: f64,
    /// The candidate's argmax is the base's (llama-perplexity's "Same top p").
    pub same_top: bool,
    /// The candidate's top-p nucleus is the base's, as a set; `None` where the base's nucleus
    /// reaches past its stored top-K and so cannot be told.
    pub same_nucleus: Option<bool>,
}

/// The base distribution of an entry: its top-K probabilities and the rest mass, renormalised
/// so they sum to 1 (f16 rounding of the stored ln p leaves them off by ~1e-3 relative).
fn base_probs(b: &BaseEntry<'_>) -> (Vec<f64>, f64) {
    let mut p: Vec<f64> = b.logp.iter().map(|l| l.to_f64().exp()).collect();
    let z = p.iter().sum::<f64>() + b.rest as f64;
    for v in &mut p {
        *v /= z;
    }
    (p, b.rest as f64 / z)
}

/// The size of the top-p nucleus of a distribution given by its largest probabilities in
/// descending order (llama.cpp's top-p: the fewest tokens whose mass reaches p), or `None`
/// when those do not reach p.
fn nucleus_size(sorted: &[f64], top_p: f64) -> Option<usize> {
    let mut cum = 0.0;
    for (i, &p) in sorted.iter().enumerate() {
        cum += p;
        if cum >= top_p {
            return Some(i + 1);
        }
    }
    None
}

/// Scores the candidate's logits `row` at a position against the base entry. The KL is that of
/// the two distributions coarsened to the base's top-K tokens plus one bin for the rest: exact
/// when the rest holds no mass, a lower bound of the full-vocabulary KL otherwise (log-sum
/// inequality), and ≥ 0 either way.
pub fn compare_row(row: &[f32], target: u32, b: BaseEntry<'_>, top_p: f64) -> RowCmp {
    let sm = Softmax::of(row);
    let nll = -sm.log_prob(row, target as usize);
    let nll_base = -(b.target_logp as f64);
    let (p, r) = base_probs(&b);
    let mut kld = 0.0;
    let mut q_top = 0.0;
    for (&id, &pk) in b.ids.iter().zip(&p) {
        let lq = sm.log_prob(row, id as usize);
        q_top += lq.exp();
        if pk > 0.0 {
            kld += pk * (pk.ln() - lq);
        }
    }
    if r > 0.0 {
        let q_rest = (1.0 - q_top).max(f64::MIN_POSITIVE);
        kld += r * (r.ln() - q_rest.ln());
    }
    let same_nucleus = nucleus_size(&p, top_p).map(|m| {
        let cand = top_k(row, m + 1);
        if cand.len() < m {
            return false;
        }
        let mut c: Vec<u32> = cand[..m].iter().map(|x| x.0).collect();
        let mut s: Vec<u32> = b.ids[..m].to_vec();
        c.sort_unstable();
        s.sort_unstable();
        let q = |i: u32| sm.log_prob(row, i as usize).exp();
        let q_sum: f64 = cand[..m].iter().map(|x| q(x.0)).sum();
        let q_last = q(cand[m - 1].0);
        // The candidate's own nucleus is these m tokens: they reach p and m−1 of them do not.
        c == s && q_sum >= top_p && q_sum - q_last < top_p
    });
    RowCmp {
        kld,
        nll,
        nll_base,
        p_diff: (-nll).exp() - (-nll_base).exp(),
        same_top: sm.argmax == b.ids.first().copied().unwrap_or(u32::MAX),
        same_nucleus,
    }
}

/// llama-perplexity's `mean_and_uncertainty`: the mean and the standard error of the mean
/// (0 for fewer than 11 samples).
pub fn mean_and_uncertainty(sum: f64, sum2: f64, count: usize) -> (f64, f64) {
    if count < 1 {
        return (0.0, 0.0);
    }
    let f = sum / count as f64;
    let df = sum2 / count as f64 - f * f;
    let df = if df > 0.0 && count > 10 {
        (df / (count - 1) as f64).sqrt()
    } else {
        0.0
    };
    (f, df)
}

/// llama-perplexity's `covariance` of two means (0 for fewer than 10 samples).
pub fn covariance(suma: f64, sumb: f64, sumab: f64, count: usize) -> f64 {
    if count < 10 {
        return 0.0;
    }
    let n = count as f64;
    (sumab / n - (suma / n) * (sumb / n)) / (n - 1.0)
}

/// llama-perplexity's `percentile` of ascending `values` (linear between neighbours, in f32).
pub fn percentile(values: &[f32], fraction: f32) -> f32 {
    if values.is_empty() {
        return f32::NAN;
    }
    if fraction <= 0.0 {
        return values[0];
    }
    if fraction >= 1.0 {
        return values[values.len() - 1];
    }
    let p = fraction * (values.len() - 1) as f32;
    let ip = p as usize;
    let p = p - ip as f32;
    (1.0 - p) * values[ip] + p * values[(ip + 1).min(values.len() - 1)]
}

/// The median of ascending `values` as llama-perplexity takes it.
pub fn median(values: &[f32]) -> f32 {
    let n = values.len();
    match n {
        0 => f32::NAN,
        _ if n.is_multiple_of(2) => 0.5 * (values[n / 2] + values[n / 2 - 1]),
        _ => values[n / 2],
    }
}

/// The running sums of `perplexity()`: Σ −ln p and Σ (ln p)² over the scored positions.
#[derive(Clone, Copy, Debug, Default)]
pub struct NllSums {
    pub nll: f64,
    pub nll2: f64,
    pub count: usize,
}

impl NllSums {
    pub fn add(&mut self, nll: f64) {
        self.nll += nll;
        self.nll2 += nll * nll;
        self.count += 1;
    }

    pub fn ppl(&self) -> f64 {
        (self.nll / self.count as f64).exp()
    }

    /// The final estimate and its ±, exactly as llama-perplexity prints them (`None` where
    /// it reports an unexpected negative variance).
    pub fn estimate(&self) -> (f64, Option<f64>) {
        let n = self.count as f64;
        let nll = self.nll / n;
        let ppl = nll.exp();
        let var = self.nll2 / n - nll * nll;
        if var > 0.0 && self.count > 1 {
            (ppl, Some((var / (n - 1.0)).sqrt() * ppl))
        } else {
            (ppl, None)
        }
    }
}

/// llama-perplexity's `kl_divergence_result`, plus the nucleus counts.
#[derive(Clone, Copy, Debug, Default)]
pub struct KldSums {
    pub sum_nll: f64,
    pub sum_nll2: f64,
    pub sum_nll_base: f64,
    pub sum_nll_base2: f64,
    pub sum_nll_nll_base: f64,
    pub sum_kld: f64,
    pub sum_kld2: f64,
    pub sum_p_diff: f64,
    pub sum_p_diff2: f64,
    pub sum_p_diff4: f64,
    pub max_p_diff: f64,
    pub n_same_top: usize,
    pub n_nucleus_decided: usize,
    pub n_same_nucleus: usize,
    pub count: usize,
}

impl KldSums {
    pub fn add(&mut self, c: &RowCmp) {
        self.sum_nll += c.nll;
        self.sum_nll2 += c.nll * c.nll;
        self.sum_nll_base += c.nll_base;
        self.sum_nll_base2 += c.nll_base * c.nll_base;
        self.sum_nll_nll_base += c.nll * c.nll_base;
        self.sum_kld += c.kld;
        self.sum_kld2 += c.kld * c.kld;
        self.sum_p_diff += c.p_diff;
        let d2 = c.p_diff * c.p_diff;
        self.sum_p_diff2 += d2;
        self.sum_p_diff4 += d2 * d2;
        self.max_p_diff = self.max_p_diff.max(c.p_diff.abs());
        self.n_same_top += c.same_top as usize;
        if let Some(same) = c.same_nucleus {
            self.n_nucleus_decided += 1;
            self.n_same_nucleus += same as usize;
        }
        self.count += 1;
    }

    /// One row of llama-perplexity's per-chunk table: PPL(Q) ±, ln(PPL(Q)/PPL(base)) ±, KLD ±,
    /// Δp RMS ± (%), same top ± (%).
    pub fn running(&self) -> [(f64, f64); 5] {
        let lp = mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count);
        let lb = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count);
        let cov = covariance(
            self.sum_nll,
            self.sum_nll_base,
            self.sum_nll_nll_base,
            self.count,
        );
        let ratio_unc = (lp.1 * lp.1 + lb.1 * lb.1 - 2.0 * cov).max(0.0).sqrt();
        let kl = mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count);
        let mse = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count);
        let rms = mse.0.sqrt();
        let top = self.n_same_top as f64 / self.count as f64;
        let top_unc = (top * (1.0 - top) / (self.count as f64 - 1.0)).sqrt();
        [
            (lp.0.exp(), lp.0.exp() * lp.1),
            (lp.0 - lb.0, ratio_unc),
            kl,
            (100.0 * rms, 100.0 * 0.5 / rms * mse.1),
            (100.0 * top, 100.0 * top_unc),
        ]
    }
}

/// A value and its ± (one standard error).
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Est {
    pub value: f64,
    pub err: f64,
}

/// Quantiles of a per-position distribution, at llama-perplexity's fractions.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Quantiles {
    pub max: f64,
    pub p99_9: f64,
    pub p99: f64,
    pub p95: f64,
    pub p90: f64,
    pub p75: f64,
    pub median: f64,
    pub p25: f64,
    pub p10: f64,
    pub p5: f64,
    pub p1: f64,
    pub p0_1: f64,
    pub min: f64,
}

impl Quantiles {
    /// `values` ascending.
    pub fn of(values: &[f32]) -> Quantiles {
        let p = |f: f32| percentile(values, f) as f64;
        Quantiles {
            max: p(1.0),
            p99_9: p(0.999),
            p99: p(0.99),
            p95: p(0.95),
            p90: p(0.90),
            p75: p(0.75),
            median: median(values) as f64,
            p25: p(0.25),
            p10: p(0.10),
            p5: p(0.05),
            p1: p(0.01),
            p0_1: p(0.001),
            min: p(0.0),
        }
    }
}

/// Counts of per-position values by decade: `counts[0]` below `edges[0]`, `counts[i]` in
/// `[edges[i-1], edges[i])`, the last at or above the last edge.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Histogram {
    pub edges: Vec<f64>,
    pub counts: Vec<usize>,
}

impl Histogram {
    /// Decades from 1e-9 to 10: the whole range from a backend check's f16 floor to a
    /// different argmax.
    pub fn decades(values: &[f32]) -> Histogram {
        let edges: Vec<f64> = (-9..=1).map(|e| 10f64.powi(e)).collect();
        let mut counts = vec![0; edges.len() + 1];
        for &v in values {
            counts[edges.partition_point(|&e| e <= v as f64)] += 1;
        }
        Histogram { edges, counts }
    }
}

/// The candidate's nucleus agreement.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct NucleusAgreement {
    pub top_p: f64,
    /// Positions whose base nucleus lies within the stored top-K (the rate's denominator).
    pub decided: usize,
    pub rate: f64,
}

/// Everything `tern kld --base` reports (and `--json` writes).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct KldReport {
    pub positions: usize,
    pub ppl: Est,
    pub ppl_base: Est,
    /// Cor(ln PPL(Q), ln PPL(base)).
    pub ppl_correlation: f64,
    pub ln_ppl_ratio: Est,
    pub ppl_ratio: Est,
    pub ppl_diff: Est,
    pub kld_mean: Est,
    pub kld: Quantiles,
    pub kld_histogram: Histogram,
    /// The share of positions where the candidate's argmax is the base's (llama-perplexity's
    /// "Same top p").
    pub top1: Est,
    pub same_top_p: NucleusAgreement,
    /// Δp = p_candidate(next token) − p_base(next token).
    pub delta_p_mean: Est,
    pub delta_p_rms: Est,
    pub delta_p: Quantiles,
}

impl KldReport {
    /// From the sums and the per-position KL and Δp values (sorted here).
    pub fn new(s: &KldSums, mut kld: Vec<f32>, mut p_diff: Vec<f32>, top_p: f64) -> KldReport {
        kld.sort_by(f32::total_cmp);
        p_diff.sort_by(f32::total_cmp);
        let lp = mean_and_uncertainty(s.sum_nll, s.sum_nll2, s.count);
        let lb = mean_and_uncertainty(s.sum_nll_base, s.sum_nll_base2, s.count);
        let ppl = lp.0.exp();
        let ppl_unc = ppl * lp.1;
        let ppl_base = lb.0.exp();
        let ppl_base_unc = ppl_base * lb.1;
        let cov = covariance(s.sum_nll, s.sum_nll_base, s.sum_nll_nll_base, s.count);
        let ratio = lp.0 - lb.0;
        let ratio_unc = (lp.1 * lp.1 + lb.1 * lb.1 - 2.0 * cov).max(0.0).sqrt();
        let ppl_cov = ppl * ppl_base * cov;
        let diff_unc = (ppl_unc * ppl_unc + ppl_base_unc * ppl_base_unc - 2.0 * ppl_cov)
            .max(0.0)
            .sqrt();
        let kl = mean_and_uncertainty(s.sum_kld, s.sum_kld2, s.count);
        let pd = mean_and_uncertainty(s.sum_p_diff, s.sum_p_diff2, s.count);
        let mse = mean_and_uncertainty(s.sum_p_diff2, s.sum_p_diff4, s.count);
        let rms = mse.0.sqrt();
        let n = s.count as f64;
        let top = s.n_same_top as f64 / n;
        KldReport {
            positions: s.count,
            ppl: Est {
                value: ppl,
                err: ppl_unc,
            },
            ppl_base: Est {
                value: ppl_base,
                err: ppl_base_unc,
            },
            ppl_correlation: cov / (lp.1 * lb.1),
            ln_ppl_ratio: Est {
                value: ratio,
                err: ratio_unc,
            },
            ppl_ratio: Est {
                value: ratio.exp(),
                err: ratio.exp() * ratio_unc,
            },
            ppl_diff: Est {
                value: ppl - ppl_base,
                err: diff_unc,
            },
            kld_mean: Est {
                value: kl.0,
                err: kl.1,
            },
            kld: Quantiles::of(&kld),
            kld_histogram: Histogram::decades(&kld),
            top1: Est {
                value: top,
                err: (top * (1.0 - top) / (n - 1.0)).sqrt(),
            },
            same_top_p: NucleusAgreement {
                top_p,
                decided: s.n_nucleus_decided,
                rate: s.n_same_nucleus as f64 / s.n_nucleus_decided.max(1) as f64,
            },
            delta_p_mean: Est {
                value: pd.0,
                err: pd.1,
            },
            delta_p_rms: Est {
                value: rms,
                err: if rms > 0.0 { 0.5 / rms * mse.1 } else { 0.0 },
            },
            delta_p: Quantiles::of(&p_diff),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 12.0
            })
            .collect()
    }

    /// The full-vocabulary KL(p ‖ q) in f64.
    fn exact_kl(p: &[f32], q: &[f32]) -> f64 {
        let lp = |r: &[f32]| {
            let m = r.iter().cloned().fold(f32::MIN, f32::max) as f64;
            let z = r.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
            r.iter().map(|&x| x as f64 - z).collect::<Vec<_>>()
        };
        let (a, b) = (lp(p), lp(q));
        a.iter().zip(&b).map(|(x, y)| x.exp() * (x - y)).sum()
    }

    fn entry(b: &BaseRow) -> BaseEntry<'_> {
        BaseEntry {
            ids: &b.ids,
            logp: &b.logp,
            rest: b.rest,
            target_logp: b.target_logp,
        }
    }

    #[test]
    fn top_k_orders_by_logit_then_id() {
        let row = [1.0, 3.0, 2.0, 3.0, f32::NAN, -1.0];
        assert_eq!(top_k(&row, 3), vec![(1, 3.0), (3, 3.0), (2, 2.0)]);
        assert_eq!(top_k(&row, 0), vec![]);
        assert_eq!(top_k(&row, 9).len(), 5);
    }

    #[test]
    fn full_top_k_gives_the_exact_kl() {
        let (p, q) = (logits(64, 1), logits(64, 2));
        let b = base_row(&p, 5, 64);
        assert!(b.rest < 1e-6, "rest {}", b.rest);
        let c = compare_row(&q, 5, entry(&b), 0.9);
        let want = exact_kl(&p, &q);
        // f16 ln p carries ~1e-3 relative error per probability.
        assert!(
            (c.kld - want).abs() < 2e-3 * want.max(1.0),
            "{} vs {want}",
            c.kld
        );
    }

    #[test]
    fn partial_top_k_is_a_lower_bound_and_self_kl_is_zero() {
        let (p, q) = (logits(2048, 3), logits(2048, 4));
        let b = base_row(&p, 7, 32);
        assert!(b.rest > 0.1, "a flat row leaves mass outside the top 32");
        let c = compare_row(&q, 7, entry(&b), 0.95);
        let want = exact_kl(&p, &q);
        assert!(c.kld > 0.0 && c.kld <= want + 1e-9, "{} vs {want}", c.kld);
        let s = compare_row(&p, 7, entry(&b), 0.95);
        assert!(s.kld.abs() < 1e-5, "self KL {}", s.kld);
        assert!(s.same_top);
        assert!(s.p_diff.abs() < 1e-6);
        assert!((s.nll - s.nll_base).abs() < 1e-5);
        // The flat row's 95% nucleus is far wider than 32 tokens: undecidable.
        assert_eq!(s.same_nucleus, None);
    }

    #[test]
    fn nucleus_agreement() {
        // A peaked row: the 0.9 nucleus is tokens {0, 1}.
        let mut p = vec![-10.0f32; 100];
        p[0] = 5.0;
        p[1] = 4.0;
        let b = base_row(&p, 0, 8);
        assert_eq!(compare_row(&p, 0, entry(&b), 0.9).same_nucleus, Some(true));
        // Same argmax, but the second token loses mass: the nucleus shrinks to {0}.
        let mut q = p.clone();
        q[1] = 0.0;
        let c = compare_row(&q, 0, entry(&b), 0.9);
        assert_eq!(c.same_nucleus, Some(false));
        assert!(c.same_top);
        // Swapped top two: the same nucleus, another argmax.
        let mut r = p.clone();
        r.swap(0, 1);
        let c = compare_row(&r, 0, entry(&b), 0.9);
        assert_eq!(c.same_nucleus, Some(true));
        assert!(!c.same_top);
    }

    #[test]
    fn histogram_by_decade() {
        let h = Histogram::decades(&[0.0, 2e-9, 5e-4, 0.02, 0.03, 50.0]);
        assert_eq!(h.counts.len(), 12);
        assert_eq!(h.counts[0], 1);
        assert_eq!(h.counts[1], 1);
        assert_eq!(h.counts[6], 1);
        assert_eq!(h.counts[8], 2);
        assert_eq!(h.counts[11], 1);
        assert_eq!(h.counts.iter().sum::<usize>(), 6);
    }

    #[test]
    fn llama_estimators() {
        assert_eq!(mean_and_uncertainty(5.0, 30.0, 5), (1.0, 0.0));
        let v: Vec<f64> = (1..=20).map(|x| x as f64).collect();
        let (s, s2) = (v.iter().sum(), v.iter().map(|x| x * x).sum());
        let (m, e) = mean_and_uncertainty(s, s2, 20);
        assert_eq!(m, 10.5);
        // population variance 33.25 / 19
        assert!((e - (33.25f64 / 19.0).sqrt()).abs() < 1e-12);
        let sorted = [0.0f32, 1.0, 2.0, 3.0];
        assert_eq!(percentile(&sorted, 0.5), 1.5);
        assert_eq!(percentile(&sorted, 1.0), 3.0);
        assert_eq!(median(&sorted), 1.5);
        assert_eq!(median(&sorted[..3]), 1.0);
        let mut n = NllSums::default();
        for x in [1.0, 2.0, 3.0] {
            n.add(x);
        }
        let (ppl, err) = n.estimate();
        assert!((ppl - 2f64.exp()).abs() < 1e-12);
        assert!((err.unwrap() - (2.0f64 / 3.0 / 2.0).sqrt() * ppl).abs() < 1e-12);
    }
}
