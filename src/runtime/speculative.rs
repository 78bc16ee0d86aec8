//! One sequence's decoding state, with optional MTP self-speculation (model-qwen35.md §6): the
//! MTP head drafts up to `n_max` tokens, the trunk verifies `[last, d1..dn]` in one batch, the
//! longest prefix the sampler agrees with is kept, and the attention caches and recurrent states
//! roll back exactly past it. Greedy output is identical with drafting on or off.
//!
//! `SlotDecoder` holds the per-sequence pieces and the steps of a round; `Generator` drives one
//! sequence with them, the engine drives many in shared batches.
//!
//! The head's cache holds the same rows as llama.cpp's draft-mtp writes, in fewer passes of the
//! MTP block. llama.cpp runs the block over every verify batch's kept rows (`process`), then
//! again for the next round's first draft step, which reads the last sampled token and the
//! trunk's last h: the row that the next `process` writes first. Here the fill holds the kept
//! rows back ([`Mtp::held`]) and the first draft step takes them in its own pass, keeping its
//! own row ([`Mtp::ahead`]), so a round reads the block's weights once fewer: a decode step of
//! bench-0.8b streams them at about the cost of a draft step.

use std::collections::VecDeque;
use std::time::Instant;

use crate::backend::{Backend, KvTypes};
use crate::model::phase::{self, Phase};
use crate::model::{BatchItem, Model, ModelError, MtpRows, MtpState, SeqState};

use super::constraint::{Constraint, Masks};
use super::sampler::{argmax, non_finite, probability, ProbsRequest, Sampler, TokenProbs};

#[derive(Clone, Debug, PartialEq)]
pub struct SpecConfig {
    /// `--spec-draft-n-max` (llama.cpp default 3).
    pub n_max: usize,
    /// `--spec-draft-n-min`: shorter drafts are dropped.
    pub n_min: usize,
    /// `--spec-draft-p-min`: drafting stops at a token the head is less sure of.
    pub p_min: f32,
    /// Each slot picks its depth in `0..=n_max` from its acceptance and the measured round
    /// costs ([`AdaptiveDepth`]); off, every round drafts `n_max` (llama.cpp's behaviour, and
    /// what a round-cost measurement needs).
    pub adaptive: bool,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            n_max: 3,
            n_min: 0,
            p_min: 0.0,
            adaptive: true,
        }
    }
}

/// How many of the latest measurements of each kind a median is taken over.
const COST_WINDOW: usize = 64;

/// The latest [`COST_WINDOW`] durations of one kind, in seconds.
#[derive(Clone, Debug, Default)]
struct Window(VecDeque<f64>);

impl Window {
    fn push(&mut self, s: f64) {
        if self.0.len() == COST_WINDOW {
            self.0.pop_front();
        }
        self.0.push_back(s);
    }

    fn median(&self) -> Option<f64> {
        if self.0.is_empty() {
            return None;
        }
        let mut v: Vec<f64> = self.0.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    }
}

/// What the parts of a draft round cost on this machine, measured as decoding runs (wall
/// time; medians of the latest [`COST_WINDOW`], which a shared machine's spikes do not move):
/// one MTP draft step (the MTP block, the draft head, the argmax; each round's mean, its first
/// step carrying the rows the fill held back), and a decode-only step by its row count (the
/// trunk's forward, sampling the rows, and the MTP cache fill of rows past [`HELD_ROWS`]; one
/// row is a plain step, a slot's verify batch adds its drafts).
#[derive(Clone, Debug, Default)]
pub struct RoundCosts {
    draft: Window,
    /// `forward[r - 1]`: forwards of `r` rows.
    forward: Vec<Window>,
}

/// [`RoundCosts`]' medians, for `/metrics` and the bench.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoundCostSummary {
    pub draft_step_s: Option<f64>,
    /// `(rows, seconds)` for every row count measured.
    pub forward_s: Vec<(usize, f64)>,
}

impl RoundCostSummary {
    pub fn forward(&self, rows: usize) -> Option<f64> {
        self.forward_s
            .iter()
            .find(|(r, _)| *r == rows)
            .map(|&(_, s)| s)
    }
}

impl RoundCosts {
    pub fn observe_draft_step(&mut self, s: f64) {
        self.draft.push(s);
    }

    /// A trunk forward of `rows` rows that carried no prompt.
    pub fn observe_forward(&mut self, rows: usize, s: f64) {
        if rows == 0 {
            return;
        }
        if self.forward.len() < rows {
            self.forward.resize(rows, Window::default());
        }
        self.forward[rows - 1].push(s);
    }

    pub fn draft_step(&self) -> Option<f64> {
        self.draft.median()
    }

    /// The cost of a forward of `rows` rows: more rows never cost less (the largest median at
    /// or below `rows`, so noise cannot make a deeper verify look cheaper than a shallower
    /// one); with nothing measured at or below, the cheapest measured above (an optimistic
    /// guess that gets measured once acted on). `None` before any forward.
    pub fn forward(&self, rows: usize) -> Option<f64> {
        let medians: Vec<(usize, f64)> = self.summary_forward();
        medians
            .iter()
            .filter(|(r, _)| *r <= rows)
            .map(|&(_, s)| s)
            .reduce(f64::max)
            .or_else(|| {
                medians
                    .iter()
                    .filter(|(r, _)| *r > rows)
                    .map(|&(_, s)| s)
                    .reduce(f64::min)
            })
    }

    fn summary_forward(&self) -> Vec<(usize, f64)> {
        self.forward
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.median().map(|m| (i + 1, m)))
            .collect()
    }

    pub fn summary(&self) -> RoundCostSummary {
        RoundCostSummary {
            draft_step_s: self.draft_step(),
            forward_s: self.summary_forward(),
        }
    }
}

/// Tokens a round of depth `d` yields when each draft token is accepted with probability `a`
/// given the ones before it were: `1 + a + ... + a^d`.
pub fn expected_tokens(a: f64, d: usize) -> f64 {
    (0..=d).map(|i| a.powi(i as i32)).sum()
}

/// The per-position acceptance above which a round of depth `d` yields more tokens per second
/// than plain steps, for a round that costs `round_cost` plain steps (the root of
/// `expected_tokens(a, d) = round_cost` in `[0, 1]`; `None` when even `a = 1` does not pay).
pub fn break_even(d: usize, round_cost: f64) -> Option<f64> {
    if expected_tokens(1.0, d) <= round_cost {
        return None;
    }
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if expected_tokens(mid, d) < round_cost {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(hi)
}

/// Forgetting factor of the acceptance estimate, per drafted round: about the last ten rounds
/// count, so a slot follows its text's changes in predictability.
const ACCEPT_DECAY: f64 = 0.9;

/// How much more a depth must be expected to yield per second than the best shallower one.
/// The costs are medians timed on a shared machine and the acceptance an estimate: where a
/// verify row and a draft step cost next to nothing (a tiny model, whose steps are mostly
/// fixed overhead), a 0.6% acceptance made depth 1 "win" by less than that noise, round after
/// round, without a single accepted draft.
const MIN_GAIN: f64 = 1.02;
/// Plain rounds before a slot drafts one token to re-measure acceptance: first
/// [`PROBE_FIRST`], doubling after each probe that does not bring drafting back, up to
/// [`PROBE_EVERY`]: a slot that dropped on a few unlucky rounds comes back soon, one whose
/// drafts never pay spends one draft step in `PROBE_EVERY` rounds.
pub const PROBE_FIRST: u32 = 2;
pub const PROBE_EVERY: u32 = 16;

/// The other decoding slots a slot's round shares its step with: the rows they fed last step
/// and how many they are.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Company {
    pub rows: usize,
    pub slots: usize,
}

/// A slot's draft depth, chosen per round. Acceptance is modelled per position (a draft token
/// accepted with probability `a` given the ones before it were, which is what makes a round's
/// yield `1 + a + ... + a^d`) and estimated as accepted / (accepted + rejections), each round
/// contributing its accepted tokens and one rejection when it stopped short, both decayed by
/// [`ACCEPT_DECAY`]. (accepted / drafted would count the tokens after a rejection, which were
/// never tested, as failures.) The depth maximizes the step's expected tokens per unit of time:
/// a round costs `d` draft steps plus a forward of the slot's `d + 1` rows beside the other
/// slots' rows, from [`RoundCosts`] as the engine measured them, and yields
/// `expected_tokens(a, d)` plus a token for each other slot, whose step takes as long. (Priced
/// alone, a slot beside two others drafted wherever its own yield paid for the extra rows, and
/// made their tokens wait for them: bench-0.8b Q8_0, 3 streams with a random head, 63 t/s
/// drafting against 95 plain.) 0 is plain decoding, and now and then ([`PROBE_FIRST`],
/// [`PROBE_EVERY`]) a plain slot drafts one token so a slot whose text became predictable
/// recovers.
#[derive(Clone, Debug)]
pub struct AdaptiveDepth {
    accepted: f64,
    rejected: f64,
    plain_rounds: u32,
    probe_gap: u32,
    /// The depth of the latest round.
    pub depth: usize,
    /// Rounds that drafted nothing by choice, and rounds that probed.
    pub plain: u64,
    pub probes: u64,
}

impl Default for AdaptiveDepth {
    fn default() -> Self {
        // A prior of one acceptance and one rejection: a = 0.5 until measured.
        AdaptiveDepth {
            accepted: 1.0,
            rejected: 1.0,
            plain_rounds: 0,
            probe_gap: PROBE_FIRST,
            depth: 0,
            plain: 0,
            probes: 0,
        }
    }
}

impl AdaptiveDepth {
    /// The estimated per-position acceptance.
    pub fn acceptance(&self) -> f64 {
        self.accepted / (self.accepted + self.rejected)
    }

    /// A verified round that carried `drafted` tokens, `accepted` of them kept.
    pub fn observe(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.accepted = ACCEPT_DECAY * self.accepted + accepted as f64;
        self.rejected = ACCEPT_DECAY * self.rejected + f64::from(u8::from(accepted < drafted));
    }

    /// The depth (at most `n_max`) with the most expected tokens per second in a step shared
    /// with `others`.
    pub fn best(&self, n_max: usize, costs: &RoundCosts, others: Company) -> usize {
        let (Some(draft), Some(_)) = (costs.draft_step(), costs.forward(1)) else {
            // Nothing measured yet: draft fully, which measures both.
            return n_max;
        };
        let a = self.acceptance();
        let rate = |d: usize| {
            let t = costs
                .forward(others.rows + d + 1)
                .expect("a forward was measured");
            (others.slots as f64 + expected_tokens(a, d)) / (d as f64 * draft + t)
        };
        (1..=n_max).fold(0, |best, d| {
            if rate(d) > MIN_GAIN * rate(best) {
                d
            } else {
                best
            }
        })
    }

    /// Picks this round's depth (records it in `depth`).
    pub fn pick(&mut self, n_max: usize, costs: &RoundCosts, others: Company) -> usize {
        let mut d = self.best(n_max, costs, others);
        if d == 0 && n_max > 0 {
            self.plain_rounds += 1;
            if self.plain_rounds > self.probe_gap {
                self.plain_rounds = 0;
                self.probe_gap = (2 * self.probe_gap).min(PROBE_EVERY);
                self.probes += 1;
                d = 1;
            } else {
                self.plain += 1;
            }
        } else {
            self.plain_rounds = 0;
            self.probe_gap = PROBE_FIRST;
        }
        self.depth = d;
        d
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

    pub fn add(&mut self, o: &SpecStats) {
        self.drafts += o.drafts;
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        if self.accepted_per_pos.len() < o.accepted_per_pos.len() {
            self.accepted_per_pos.resize(o.accepted_per_pos.len(), 0);
        }
        for (a, b) in self.accepted_per_pos.iter_mut().zip(&o.accepted_per_pos) {
            *a += b;
        }
    }
}

/// Accepted rows the MTP head's cache holds back for the next draft step, at most this many a
/// slot (more go through the block at the end of the step, as [`SlotDecoder::mtp_process_many`]
/// fills them). Rows beyond a verify's own (`n_max`) gather only while a slot does not draft;
/// a draft step of a few rows more costs little more than one of one row, since the block's
/// weight stream bounds it.
pub const HELD_ROWS: usize = 4;

pub struct Mtp<B: Backend> {
    pub state: MtpState<B>,
    /// The trunk's `h_nextn` of the last position fed to the trunk (zeros before any).
    pub pending_h: B::T,
    /// Rows the trunk kept that the head's cache does not hold yet (positions `state.pos..`):
    /// their tokens and the trunk's `h` of the positions before them. The round's first draft
    /// step takes them in its own pass of the block, so a round reads the block's weights once
    /// for the fill and that step where it read them twice (see [`SlotDecoder::draft`]).
    pub held: Vec<u32>,
    pub held_h: Option<B::T>,
    /// The cache already holds the row of the last sampled token (the round's first draft
    /// step wrote it, reading `pending_h`, as the fill would): the fill after the verify
    /// starts at the row after it.
    pub ahead: bool,
}

impl<B: Backend> Mtp<B> {
    /// Forgets the held rows and the row written ahead: the caller has truncated the cache
    /// (or copied another's), and `pending_h` is set for the next row.
    pub fn drop_held(&mut self) {
        self.held.clear();
        self.held_h = None;
        self.ahead = false;
    }

    /// Takes the row written ahead back out of the cache, if there is one: its verify never
    /// ran, and the next pass of the block writes that position again from its own rows.
    fn take_back_ahead(&mut self, be: &B) {
        if std::mem::take(&mut self.ahead) {
            self.state.pos -= 1;
            be.kv_truncate(&mut self.state.kv, self.state.pos);
        }
    }
}

/// The outcome of sampling a verify batch.
pub struct Verified {
    /// Tokens produced this round: the accepted drafts and the trunk's own next token.
    pub produced: Vec<u32>,
    pub accepted: usize,
    /// Rows of the batch the trunk keeps (`accepted + 1`): the state now ends after them.
    pub kept: usize,
}

pub struct SlotDecoder<B: Backend> {
    pub seq: SeqState<B>,
    pub mtp: Option<Mtp<B>>,
    pub sampler: Sampler,
    /// Sampled but not yet fed to the trunk.
    pub last: Option<u32>,
    pub stats: SpecStats,
    pub depth: AdaptiveDepth,
    /// The request's grammar; `masks` are its masks for the rows about to be sampled (computed
    /// while the forward ran, or here when missing).
    pub constraint: Option<Constraint>,
    pub masks: Masks,
    /// What the request wants to know of each sampled token's distribution, and what the last
    /// sampling round found (one entry per produced token).
    pub probs: Option<ProbsRequest>,
    pub sampled_probs: Vec<TokenProbs>,
    /// A grammar failure (the request fails with it).
    pub constraint_error: Option<String>,
}

impl<B: Backend> SlotDecoder<B> {
    /// `mtp = Some((draft cache dtypes, draft depth))` arms drafting (the model must have an
    /// MTP block) and gives each GDN layer `depth` rollback cells: with the live state that
    /// makes the `1 + depth` recurrent copies per slot the planner prices.
    pub fn new(
        model: &Model<B>,
        be: &B,
        mut seq: SeqState<B>,
        sampler: Sampler,
        mtp: Option<(KvTypes, usize)>,
    ) -> Result<Self, ModelError> {
        if let Some((_, depth)) = mtp {
            seq.arm_cells(be, &model.cfg.gdn_params(), depth);
        }
        let mtp = if let Some((types, _)) = mtp {
            Some(Mtp {
                state: model.new_mtp_state_with(be, types)?,
                pending_h: be.from_host(&vec![0.0; model.cfg.n_embd], 1, model.cfg.n_embd),
                held: Vec::new(),
                held_h: None,
                ahead: false,
            })
        } else {
            None
        };
        Ok(SlotDecoder {
            seq,
            mtp,
            sampler,
            last: None,
            stats: SpecStats::default(),
            depth: AdaptiveDepth::default(),
            constraint: None,
            masks: Vec::new(),
            probs: None,
            sampled_probs: Vec::new(),
            constraint_error: None,
        })
    }

    /// Sets up the slot for a new request's sampling.
    pub fn start_request(
        &mut self,
        sampler: Sampler,
        constraint: Option<Constraint>,
        probs: Option<ProbsRequest>,
    ) {
        self.sampler = sampler;
        self.constraint = constraint;
        self.probs = probs;
        self.masks.clear();
        self.sampled_probs.clear();
        self.constraint_error = None;
        self.last = None;
    }

    /// Whether rows of every batch must come back (the MTP head needs the trunk's h per row).
    pub fn wants_rows(&self) -> bool {
        self.mtp.is_some()
    }

    /// Samples logits row `row` (of `n_rows`) as the `k`-th row of this round (the mask index),
    /// records the token with the sampler and the grammar, and returns it with whether it woke
    /// a dormant grammar (`</think>`: masks computed before it no longer hold).
    ///
    /// A row with a non-finite logit is refused. A row that comes to the host anyway (sampling,
    /// a grammar mask, probabilities, or the CPU backend, where it is already there) is checked
    /// whole; on a device, greedy decoding reads back only the id, so there the first row of
    /// each request is read back for the check (a model that yields NaN does so from its first
    /// token).
    pub fn sample_row(
        &mut self,
        be: &B,
        logits: &B::T,
        row: usize,
        n_rows: usize,
        k: usize,
    ) -> Result<(u32, bool), ModelError> {
        let active = self.constraint.as_ref().is_some_and(Constraint::is_active);
        if active && self.masks.len() <= k && self.constraint_error.is_none() {
            // No mask was computed ahead for this row: compute it now.
            let c = self.constraint.as_mut().expect("active");
            match c.masks_for(&[]) {
                Ok(m) => {
                    self.masks.truncate(k);
                    while self.masks.len() < k {
                        self.masks.push(Vec::new());
                    }
                    self.masks.extend(m);
                }
                Err(e) => self.constraint_error = Some(e),
            }
        }
        let mask = if active {
            self.masks.get(k).map(Vec::as_slice)
        } else {
            None
        };
        // Plain greedy needs only the id from the device; a mask or probabilities need the row.
        let id_only = self.sampler.is_greedy() && mask.is_none() && self.probs.is_none();
        // Where the backend scans the row in place (the CPU), it checks and picks in one pass.
        let in_place = id_only.then(|| be.argmax_checked(logits, row)).flatten();
        if let Some((_, Some((token, value)))) = in_place {
            return Err(ModelError::NonFiniteLogits { row, token, value });
        }
        let picked = (in_place.is_none() && n_rows != 1).then(|| be.rows(logits, row, 1));
        let t = picked.as_ref().unwrap_or(logits);
        let host = (in_place.is_none() && (!id_only || self.last.is_none())).then(|| be.to_host(t));
        if let Some(h) = &host {
            if let Some((token, value)) = non_finite(h) {
                return Err(ModelError::NonFiniteLogits { row, token, value });
            }
        }
        // A token the reasoning budget forces (closing the thinking block) still comes from a
        // checked row.
        let id = match (self.sampler.forced(), &host) {
            (Some(forced), _) => forced,
            (None, Some(h)) if !id_only => {
                if self.sampler.is_greedy() && self.probs.is_none() {
                    // The chain would keep only the allowed argmax: skip building it.
                    super::sampler::masked_argmax(h, mask)
                } else {
                    let (id, p) = self.sampler.sample_with(h, mask, self.probs);
                    if let Some(p) = p {
                        self.sampled_probs.push(p);
                    }
                    id
                }
            }
            _ => match in_place {
                Some((id, _)) => id,
                None => be.argmax_rows(t)[0],
            },
        };
        self.sampler.accept(id);
        let mut woke = false;
        if let Some(c) = self.constraint.as_mut() {
            match c.commit(id) {
                Ok(w) => woke = w,
                Err(e) => {
                    self.constraint_error.get_or_insert(e);
                }
            }
        }
        Ok((id, woke))
    }

    /// Fills the MTP cache over tokens just fed to the trunk: row k reads token k and the
    /// trunk's h of the position before it. With `hold` (a decode step's kept rows), the cache
    /// holds them back for the next draft step ([`Mtp::held`]) while they are at most
    /// [`HELD_ROWS`].
    pub fn mtp_process(
        &mut self,
        model: &Model<B>,
        be: &B,
        tokens: &[u32],
        h: &B::T,
        hold: bool,
    ) -> Result<(), ModelError> {
        Self::mtp_process_many(model, be, &mut [(self, tokens, h)], hold)
    }

    /// [`SlotDecoder::mtp_process`] for several slots in one pass of the MTP block
    /// ([`Model::mtp_fill_many`]): a step of three streams read the block's weights three
    /// times, one slot after another. Slots without a head are left as they are.
    ///
    /// A slot whose first row the round's first draft step already wrote ([`Mtp::ahead`])
    /// starts at its second. Without `hold` (prompt rows), rows held from decoding go through
    /// the block first in a pass of their own, so a pass never takes more rows than the
    /// prompt's batch and a verify's.
    pub fn mtp_process_many(
        model: &Model<B>,
        be: &B,
        work: &mut [(&mut SlotDecoder<B>, &[u32], &B::T)],
        hold: bool,
    ) -> Result<(), ModelError> {
        let _t = phase::time(Phase::MtpFill);
        if !hold {
            for (d, tokens, _) in work.iter_mut() {
                if let Some(m) = d.mtp.as_mut().filter(|_| !tokens.is_empty()) {
                    m.take_back_ahead(be);
                }
            }
            Self::fill_held(model, be, work.iter_mut().map(|(d, ..)| &mut **d), 0)?;
        }
        for (d, tokens, h) in work.iter_mut() {
            let Some(m) = d.mtp.as_mut() else { continue };
            let n = tokens.len();
            if n == 0 {
                continue;
            }
            let skip = usize::from(std::mem::take(&mut m.ahead));
            if skip < n {
                // Row k's h is the trunk's of row k - 1, row 0's the one pending from before.
                let prev = match (skip, n) {
                    (0, 1) => be.rows(&m.pending_h, 0, 1),
                    (0, _) => be.concat_rows(&[&m.pending_h, &be.rows(h, 0, n - 1)]),
                    _ => be.rows(h, skip - 1, n - skip),
                };
                m.held_h = Some(match m.held_h.take() {
                    Some(before) => be.concat_rows(&[&before, &prev]),
                    None => prev,
                });
                m.held.extend_from_slice(&tokens[skip..]);
            }
            m.pending_h = be.rows(h, n - 1, 1);
        }
        let keep = if hold { HELD_ROWS } else { 0 };
        Self::fill_held(model, be, work.iter_mut().map(|(d, ..)| &mut **d), keep)
    }

    /// Puts the held rows of every slot holding more than `keep` through the MTP block, in one
    /// pass.
    fn fill_held<'s>(
        model: &Model<B>,
        be: &B,
        slots: impl Iterator<Item = &'s mut SlotDecoder<B>>,
        keep: usize,
    ) -> Result<(), ModelError>
    where
        B: 's,
    {
        let mut heads: Vec<&mut Mtp<B>> = slots
            .filter_map(|d| d.mtp.as_mut())
            .filter(|m| m.held.len() > keep)
            .collect();
        if heads.is_empty() {
            return Ok(());
        }
        let mut items: Vec<MtpRows<'_, B>> = heads
            .iter_mut()
            .map(|m| {
                let Mtp {
                    state,
                    held,
                    held_h,
                    ..
                } = &mut **m;
                MtpRows {
                    st: state,
                    tokens: held,
                    h_prev: held_h.as_ref().expect("held rows carry their h"),
                }
            })
            .collect();
        model.mtp_fill_many(be, &mut items)?;
        drop(items);
        for m in heads {
            m.held.clear();
            m.held_h = None;
        }
        Ok(())
    }

    /// An image has gone through the trunk: the head skips its rows, as llama.cpp's draft-mtp
    /// does (it never sees embedding batches, and the next text row pairs with the h it already
    /// holds), and its text resumes at the trunk's position, `advance` = max(rows, cols) on.
    pub fn mtp_past_image(&mut self, advance: usize) {
        if let Some(m) = self.mtp.as_mut() {
            m.state.skip += advance;
        }
    }

    /// The MTP head's greedy draft of at most `limit` tokens from the last sampled token. The
    /// first step takes the held rows with it ([`Mtp::held`]) and its own row stays in the
    /// cache ([`Mtp::ahead`]): it reads the last token and `pending_h`, as the fill after the
    /// verify would. The later steps' rows, which read the head's own h, are dropped. The
    /// round's mean time per step goes to `costs`.
    pub fn draft(
        &mut self,
        model: &Model<B>,
        be: &B,
        spec: &SpecConfig,
        limit: usize,
        costs: &mut RoundCosts,
    ) -> Result<Vec<u32>, ModelError> {
        let Some(last) = self.last else {
            return Ok(Vec::new());
        };
        let Some(m) = self.mtp.as_mut() else {
            return Ok(Vec::new());
        };
        let steps = spec.n_max.min(limit);
        if steps == 0 {
            return Ok(Vec::new());
        }
        m.take_back_ahead(be);
        let t0 = Instant::now();
        let mut tokens = std::mem::take(&mut m.held);
        tokens.push(last);
        let mut h = match m.held_h.take() {
            Some(held) => be.concat_rows(&[&held, &m.pending_h]),
            None => be.rows(&m.pending_h, 0, 1),
        };
        // The first step's rows stay in the cache; the later steps' are dropped below.
        let keep = m.state.pos + tokens.len();
        let mut drafts = Vec::new();
        let mut ran = 0;
        for _ in 0..steps {
            let _t = phase::time(Phase::Draft);
            let out = model.mtp_draft(be, &mut m.state, &tokens, &h)?;
            ran += 1;
            // Only a p_min test needs the row on the host; otherwise read back the id alone.
            let d = if spec.p_min > 0.0 {
                let logits = be.to_host(&out.logits);
                // A broken draft row drafts nothing; the trunk's own rows are checked.
                if non_finite(&logits).is_some() {
                    break;
                }
                let d = argmax(&logits);
                if probability(&logits, d) < spec.p_min {
                    break;
                }
                d
            } else {
                be.argmax_rows(&out.logits)[0]
            };
            drafts.push(d);
            tokens = vec![d];
            h = out.h;
        }
        costs.observe_draft_step(t0.elapsed().as_secs_f64() / ran as f64);
        be.kv_truncate(&mut m.state.kv, keep);
        m.state.pos = keep;
        m.ahead = true;
        if drafts.len() < spec.n_min {
            drafts.clear();
        }
        Ok(drafts)
    }

    /// The verify batch `[last, drafts..]`. Run it with `snapshot` set when it carries drafts,
    /// so `finish_verify` can roll back to any row (cells grow here for an outside drafter
    /// longer than the armed depth).
    pub fn begin_verify(&mut self, model: &Model<B>, be: &B, drafts: &[u32]) -> Vec<u32> {
        let mut batch = Vec::with_capacity(drafts.len() + 1);
        batch.push(self.last.expect("a sampled token before decoding"));
        batch.extend_from_slice(drafts);
        let armed = self.seq.cells.iter().map(Vec::len).max().unwrap_or(0);
        if !drafts.is_empty() && armed < drafts.len() {
            self.seq
                .arm_cells(be, &model.cfg.gdn_params(), drafts.len());
        }
        batch
    }

    /// Samples the verify rows, keeps the agreed prefix, and rolls the trunk back past it when
    /// a draft was rejected: the recurrent state from the cell of the last kept row, the
    /// attention caches truncated. The caller hands the kept rows' h to `mtp_process`. The
    /// batch's logits rows start at row `first` of `logits`, which has `n_rows` rows (other
    /// sequences' rows beside them: `Model::forward_batch_joined`).
    pub fn finish_verify(
        &mut self,
        be: &B,
        logits: &B::T,
        (first, n_rows): (usize, usize),
        batch: &[u32],
        rows: bool,
    ) -> Result<Verified, ModelError> {
        let drafts = &batch[1..];
        let mut produced = Vec::new();
        let mut accepted = 0;
        self.sampled_probs.clear();
        let sampling = phase::time(Phase::Sample);
        for i in 0..batch.len() {
            let row = first + if rows { i } else { 0 };
            let (t, woke) = self.sample_row(be, logits, row, n_rows, i)?;
            produced.push(t);
            // A token that woke the grammar ends the round: the rows after it were not masked.
            let grammar_ok = !woke && self.constraint_error.is_none();
            if i < drafts.len() && t == drafts[i] && grammar_ok {
                accepted += 1;
            } else {
                break;
            }
        }
        self.masks.clear();
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
            self.depth.observe(drafts.len(), accepted);
        }
        self.last = produced.last().copied();
        drop(sampling);
        let kept = accepted + 1;
        if kept < batch.len() {
            let _t = phase::time(Phase::Rollback);
            let end = self.seq.pos - batch.len() + kept;
            self.seq.restore_cell(be, kept - 1);
            for kv in self.seq.kv.iter_mut().flatten() {
                be.kv_truncate(kv, end);
            }
            self.seq.pos = end;
        }
        Ok(Verified {
            produced,
            accepted,
            kept,
        })
    }
}

/// Drives one sequence: prefill, then rounds of (draft, verify, rollback).
pub struct Generator<'a, B: Backend> {
    model: &'a Model<B>,
    be: &'a B,
    pub slot: SlotDecoder<B>,
    spec: Option<SpecConfig>,
    /// This sequence's measured round costs (the adaptive depth's input).
    pub costs: RoundCosts,
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
        let slot = SlotDecoder::new(
            model,
            be,
            seq,
            sampler,
            spec.as_ref().map(|s| (KvTypes::default(), s.n_max)),
        )?;
        Ok(Generator {
            model,
            be,
            slot,
            spec,
            costs: RoundCosts::default(),
        })
    }

    pub fn stats(&self) -> &SpecStats {
        &self.slot.stats
    }

    /// Runs the prompt and samples the first token.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<u32, ModelError> {
        // The MTP head reads h of every prompt row; only the last row's logits are sampled.
        let hidden_rows = self.slot.wants_rows();
        let mut items = [BatchItem {
            seq: &mut self.slot.seq,
            tokens: prompt,
            image: None,
            all_rows: false,
            hidden_rows,
            snapshot: false,
        }];
        let out = self
            .model
            .forward_batch(self.be, &mut items)?
            .pop()
            .expect("one output");
        self.slot
            .mtp_process(self.model, self.be, prompt, &out.h, false)?;
        for &t in prompt {
            self.slot.sampler.accept_prompt(t);
        }
        self.slot.sampled_probs.clear();
        let (id, _) = self.slot.sample_row(self.be, &out.logits, 0, 1, 0)?;
        self.slot.masks.clear();
        self.slot.last = Some(id);
        Ok(id)
    }

    /// One decode round: returns the tokens it produced (one without drafting; up to
    /// `n_max + 1` with it).
    pub fn step(&mut self) -> Result<Vec<u32>, ModelError> {
        let drafts = match &self.spec {
            Some(spec) => {
                let room = self
                    .model
                    .cfg
                    .context_length
                    .saturating_sub(self.slot.seq.pos + 1);
                let depth = if spec.adaptive {
                    self.slot
                        .depth
                        .pick(spec.n_max, &self.costs, Company::default())
                } else {
                    spec.n_max
                };
                let spec = spec.clone();
                self.slot
                    .draft(self.model, self.be, &spec, room.min(depth), &mut self.costs)?
            }
            None => Vec::new(),
        };
        self.verify(&drafts)
    }

    /// Verifies `drafts` (from the MTP head or any other drafter) after the last sampled token
    /// in one trunk batch and keeps the agreed prefix plus the trunk's next token.
    pub fn verify(&mut self, drafts: &[u32]) -> Result<Vec<u32>, ModelError> {
        let batch = self.slot.begin_verify(self.model, self.be, drafts);
        let rows = !drafts.is_empty() || self.slot.wants_rows();
        let mut items = [BatchItem {
            seq: &mut self.slot.seq,
            tokens: &batch,
            image: None,
            all_rows: rows,
            hidden_rows: false,
            snapshot: !drafts.is_empty(),
        }];
        let t0 = Instant::now();
        let out = self
            .model
            .forward_batch(self.be, &mut items)?
            .pop()
            .expect("one output");
        let n_rows = if rows { batch.len() } else { 1 };
        let v = self
            .slot
            .finish_verify(self.be, &out.logits, (0, n_rows), &batch, rows)?;
        if self.slot.mtp.is_some() {
            let h = if v.kept < batch.len() {
                self.be.rows(&out.h, 0, v.kept)
            } else {
                out.h
            };
            self.slot
                .mtp_process(self.model, self.be, &batch[..v.kept], &h, true)?;
        }
        self.costs
            .observe_forward(batch.len(), t0.elapsed().as_secs_f64());
        Ok(v.produced)
    }
}
