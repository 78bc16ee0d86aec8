//! The forward recipe of model-qwen35.md §3–§6, once, against the backend ops.

use super::weights::{Layer, Mixer};
use super::{Model, ModelError, Output};
use crate::backend::{Backend, GdnWeights, KvTypes};

/// Per-sequence state of the trunk: attention KV for full-attention layers, conv + SSM state
/// for Gated DeltaNet layers, and the next position.
pub struct SeqState<B: Backend> {
    pub pos: usize,
    pub kv: Vec<Option<B::Kv>>,
    pub rs: Vec<Option<B::Rs>>,
    /// Rollback cells for speculative verify: `cells[il][t]` receives layer il's recurrent
    /// state after row t of a batch run with `snapshot`, for every row but the last (empty
    /// until `arm_cells`).
    pub cells: Vec<Vec<B::Rs>>,
}

impl<B: Backend> SeqState<B> {
    /// Allocates `n` checkpoint cells per GDN layer (the draft depth when drafting).
    pub fn arm_cells(&mut self, be: &B, p: &crate::backend::GdnParams, n: usize) {
        self.cells = self
            .rs
            .iter()
            .map(|r| match r {
                Some(_) => (0..n).map(|_| be.new_recurrent(p)).collect(),
                None => Vec::new(),
            })
            .collect();
    }

    /// Allocates every attention cache for `positions` positions now (the slot's window).
    pub fn reserve(
        &mut self,
        be: &B,
        positions: usize,
    ) -> Result<(), crate::backend::BackendError> {
        for kv in self.kv.iter_mut().flatten() {
            be.kv_reserve(kv, positions)?;
        }
        Ok(())
    }

    /// Restores every GDN layer to the state after row `t` of the last snapshot batch.
    pub fn restore_cell(&mut self, be: &B, t: usize) {
        for (cells, rs) in self.cells.iter().zip(self.rs.iter_mut()) {
            if let (Some(c), Some(r)) = (cells.get(t), rs.as_mut()) {
                be.recurrent_copy(c, r);
            }
        }
    }
}

/// One sequence's share of a batched step: its state, the tokens to run at `seq.pos..`, and
/// whether it wants a logits row per token or only for the last.
pub struct BatchItem<'s, B: Backend> {
    pub seq: &'s mut SeqState<B>,
    pub tokens: &'s [u32],
    pub all_rows: bool,
    /// h for every row but logits for the last only: a prompt whose rows feed the MTP head
    /// (its `[rows, n_vocab]` logits would be computed for nothing).
    pub hidden_rows: bool,
    /// Keep the recurrent state after every row in `seq.cells` (speculative verify), so a
    /// rejected suffix rolls back without recomputation.
    pub snapshot: bool,
}

/// The MTP head's own attention cache.
pub struct MtpState<B: Backend> {
    pub pos: usize,
    pub kv: B::Kv,
}

impl<B: Backend> Model<B> {
    /// A fresh sequence with an f32 attention cache.
    pub fn new_state(&self, be: &B) -> SeqState<B> {
        self.new_state_with(be, KvTypes::default())
            .expect("an f32 KV cache is always supported")
    }

    /// A fresh sequence whose attention cache holds K and V in the given dtypes.
    pub fn new_state_with(&self, be: &B, kv_types: KvTypes) -> Result<SeqState<B>, ModelError> {
        let (ap, gp) = (self.cfg.attn_params(), self.cfg.gdn_params());
        let n = self.cfg.n_layer;
        let mut kv = Vec::with_capacity(n);
        for il in 0..n {
            kv.push(if self.cfg.is_recurrent(il) {
                None
            } else {
                Some(be.new_kv(&ap, kv_types)?)
            });
        }
        Ok(SeqState {
            pos: 0,
            kv,
            rs: (0..n)
                .map(|il| self.cfg.is_recurrent(il).then(|| be.new_recurrent(&gp)))
                .collect(),
            cells: Vec::new(),
        })
    }

    pub fn new_mtp_state(&self, be: &B) -> Result<MtpState<B>, ModelError> {
        self.new_mtp_state_with(be, KvTypes::default())
    }

    /// The MTP head's cache in the draft dtypes (`--spec-draft-type-k/-v`).
    pub fn new_mtp_state_with(&self, be: &B, kv_types: KvTypes) -> Result<MtpState<B>, ModelError> {
        if self.w.mtp.is_none() {
            return Err(ModelError::NoMtp);
        }
        Ok(MtpState {
            pos: 0,
            kv: be.new_kv(&self.cfg.attn_params(), kv_types)?,
        })
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), ModelError> {
        match tokens.iter().find(|&&t| t as usize >= self.cfg.n_vocab) {
            Some(&id) => Err(ModelError::BadToken {
                id,
                n_vocab: self.cfg.n_vocab,
            }),
            None => Ok(()),
        }
    }

    /// `x += Wo·attn(...)` for a full-attention mixer.
    fn attn_mixer(
        &self,
        be: &B,
        layer: &Layer<B::W>,
        h: &B::T,
        kv: &mut B::Kv,
        pos0: usize,
    ) -> B::T {
        let Mixer::Attn(a) = &layer.mixer else {
            unreachable!("attention layer with a GDN mixer")
        };
        let qg = be.matmul(&a.q, h);
        let k = be.matmul(&a.k, h);
        let v = be.matmul(&a.v, h);
        let o = be.attention(
            &self.cfg.attn_params(),
            &qg,
            &k,
            &v,
            &a.q_norm,
            &a.k_norm,
            kv,
            pos0,
        );
        be.matmul(&a.o, &o)
    }

    fn ffn(&self, be: &B, layer: &Layer<B::W>, x: &mut B::T) {
        let h = be.rms_norm(x, &layer.post_attn_norm, self.cfg.eps);
        let gate = be.matmul(&layer.ffn_gate, &h);
        let up = be.matmul(&layer.ffn_up, &h);
        let y = be.matmul(&layer.ffn_down, &be.swiglu(&gate, &up));
        be.add_assign(x, &y);
    }

    /// Runs `tokens` at positions `st.pos..`, advancing the state. With `all_rows` the output
    /// has one logits/h row per token (llama.cpp's `logits_all`), otherwise only the last.
    pub fn forward(
        &self,
        be: &B,
        st: &mut SeqState<B>,
        tokens: &[u32],
        all_rows: bool,
    ) -> Result<Output<B::T>, ModelError> {
        let mut items = [BatchItem {
            seq: st,
            tokens,
            all_rows,
            hidden_rows: false,
            snapshot: false,
        }];
        Ok(self
            .forward_batch(be, &mut items)?
            .pop()
            .expect("one output per item"))
    }

    /// One step over several sequences at once: every matmul runs once over the rows of all
    /// of them (so the weights are read once per step), attention and the recurrence run per
    /// sequence on its own rows and state. Returns one output per item, in order.
    pub fn forward_batch(
        &self,
        be: &B,
        items: &mut [BatchItem<'_, B>],
    ) -> Result<Vec<Output<B::T>>, ModelError> {
        assert!(!items.is_empty(), "forward of an empty batch");
        for it in items.iter() {
            self.check_tokens(it.tokens)?;
            assert!(!it.tokens.is_empty(), "a batch item without tokens");
            let end = it.seq.pos + it.tokens.len();
            if end > self.cfg.context_length {
                return Err(ModelError::ContextFull {
                    pos: end,
                    n_ctx: self.cfg.context_length,
                });
            }
        }
        let eps = self.cfg.eps;
        let all_tokens: Vec<u32> = items
            .iter()
            .flat_map(|it| it.tokens.iter().copied())
            .collect();
        let mut offsets = Vec::with_capacity(items.len());
        let mut off = 0;
        for it in items.iter() {
            offsets.push(off);
            off += it.tokens.len();
        }
        let single = items.len() == 1;
        // Each sequence's rows of a batch-wide tensor (no copy for a lone sequence).
        let split = |t: &B::T, i: usize, n: usize| -> Option<B::T> {
            (!single).then(|| be.rows(t, offsets[i], n))
        };
        let mut x = be.embed(&self.w.token_embd, &all_tokens);
        for (il, layer) in self.w.layers.iter().enumerate() {
            let h = be.rms_norm(&x, &layer.attn_norm, eps);
            let a = if self.cfg.is_recurrent(il) {
                let Mixer::Gdn(g) = &layer.mixer else {
                    unreachable!("GDN layer with an attention mixer")
                };
                let mixed = be.matmul(&g.qkv, &h);
                let z = be.matmul(&g.gate, &h);
                let b = be.matmul(&g.beta, &h);
                let a = be.matmul(&g.alpha, &h);
                let w = GdnWeights {
                    conv: &g.conv,
                    dt_bias: &g.dt_bias,
                    ssm_a: &g.ssm_a,
                    norm: &g.norm,
                };
                let gp = self.cfg.gdn_params();
                let mut outs = Vec::with_capacity(items.len());
                for (i, it) in items.iter_mut().enumerate() {
                    let n = it.tokens.len();
                    if it.snapshot {
                        // One row at a time, keeping the state after each but the last in
                        // its cell (after the last row the live state is that state).
                        assert!(
                            it.seq.cells.get(il).is_some_and(|c| c.len() + 1 >= n),
                            "snapshot batch of {n} rows needs {} armed cells",
                            n.saturating_sub(1)
                        );
                        let mut rows_out = Vec::with_capacity(n);
                        for t in 0..n {
                            let r = offsets[i] + t;
                            let (m, zz, bb, aa) = (
                                be.rows(&mixed, r, 1),
                                be.rows(&z, r, 1),
                                be.rows(&b, r, 1),
                                be.rows(&a, r, 1),
                            );
                            let rs = it.seq.rs[il].as_mut().expect("recurrent state");
                            rows_out.push(be.gdn(&gp, &m, &zz, &bb, &aa, &w, rs));
                            if t + 1 < n {
                                let rs = it.seq.rs[il].as_ref().expect("recurrent state");
                                be.recurrent_copy(rs, &mut it.seq.cells[il][t]);
                            }
                        }
                        outs.push(be.concat_rows(&rows_out.iter().collect::<Vec<_>>()));
                        continue;
                    }
                    let rs = it.seq.rs[il].as_mut().expect("recurrent state");
                    outs.push(
                        match (
                            split(&mixed, i, n),
                            split(&z, i, n),
                            split(&b, i, n),
                            split(&a, i, n),
                        ) {
                            (Some(m), Some(zz), Some(bb), Some(aa)) => {
                                be.gdn(&gp, &m, &zz, &bb, &aa, &w, rs)
                            }
                            _ => be.gdn(&gp, &mixed, &z, &b, &a, &w, rs),
                        },
                    );
                }
                let y = if single {
                    outs.pop().unwrap()
                } else {
                    be.concat_rows(&outs.iter().collect::<Vec<_>>())
                };
                be.matmul(&g.out, &y)
            } else {
                let Mixer::Attn(at) = &layer.mixer else {
                    unreachable!("attention layer with a GDN mixer")
                };
                let qg = be.matmul(&at.q, &h);
                let k = be.matmul(&at.k, &h);
                let v = be.matmul(&at.v, &h);
                let ap = self.cfg.attn_params();
                let mut outs = Vec::with_capacity(items.len());
                for (i, it) in items.iter_mut().enumerate() {
                    let n = it.tokens.len();
                    let pos0 = it.seq.pos;
                    let kv = it.seq.kv[il].as_mut().expect("kv cache");
                    outs.push(match (split(&qg, i, n), split(&k, i, n), split(&v, i, n)) {
                        (Some(q), Some(kk), Some(vv)) => {
                            be.attention(&ap, &q, &kk, &vv, &at.q_norm, &at.k_norm, kv, pos0)
                        }
                        _ => be.attention(&ap, &qg, &k, &v, &at.q_norm, &at.k_norm, kv, pos0),
                    });
                }
                let o = if single {
                    outs.pop().unwrap()
                } else {
                    be.concat_rows(&outs.iter().collect::<Vec<_>>())
                };
                be.matmul(&at.o, &o)
            };
            be.add_assign(&mut x, &a);
            self.ffn(be, layer, &mut x);
        }
        // The rows each sequence wants h for, gathered into one norm and one output matmul.
        let mut picked = Vec::with_capacity(items.len());
        let mut counts = Vec::with_capacity(items.len());
        let mut logit_rows = Vec::with_capacity(items.len());
        for (i, it) in items.iter_mut().enumerate() {
            let n = it.tokens.len();
            it.seq.pos += n;
            let every = it.all_rows || it.hidden_rows;
            let (start, count) = if every {
                (offsets[i], n)
            } else {
                (offsets[i] + n - 1, 1)
            };
            counts.push(count);
            logit_rows.push(if it.hidden_rows && !it.all_rows {
                1
            } else {
                count
            });
            if !(single && every) {
                picked.push(be.rows(&x, start, count));
            }
        }
        let trimmed = logit_rows != counts;
        let x = if picked.is_empty() {
            x
        } else if picked.len() == 1 {
            picked.pop().unwrap()
        } else {
            be.concat_rows(&picked.iter().collect::<Vec<_>>())
        };
        let h = be.rms_norm(&x, &self.w.output_norm, eps);
        // The logits rows: the h rows, less the prompt rows wanted for h alone.
        let logits = if trimmed {
            let mut parts = Vec::with_capacity(counts.len());
            let mut at = 0;
            for (&c, &l) in counts.iter().zip(&logit_rows) {
                parts.push(be.rows(&h, at + c - l, l));
                at += c;
            }
            let hl = if parts.len() == 1 {
                parts.pop().unwrap()
            } else {
                be.concat_rows(&parts.iter().collect::<Vec<_>>())
            };
            be.matmul(&self.w.output, &hl)
        } else {
            be.matmul(&self.w.output, &h)
        };
        if single {
            return Ok(vec![Output { logits, h }]);
        }
        let mut outs = Vec::with_capacity(items.len());
        let (mut at, mut at_l) = (0, 0);
        for (c, l) in counts.into_iter().zip(logit_rows) {
            outs.push(Output {
                logits: be.rows(&logits, at_l, l),
                h: be.rows(&h, at, c),
            });
            at += c;
            at_l += l;
        }
        Ok(outs)
    }

    /// The MTP head (§6) over rows at positions `st.pos..`: row k reads token `tokens[k]` and
    /// the target's hidden `h_prev[k]` (the `h_nextn` of the position before it). Returns the
    /// draft logits (predicting the token after next) and the head's own `h'` rows.
    pub fn mtp_forward(
        &self,
        be: &B,
        st: &mut MtpState<B>,
        tokens: &[u32],
        h_prev: &B::T,
    ) -> Result<Output<B::T>, ModelError> {
        let mtp = self.w.mtp.as_ref().ok_or(ModelError::NoMtp)?;
        let c = self.mtp_block(be, st, tokens, h_prev)?;
        let eps = self.cfg.eps;
        let h = be.rms_norm(
            &c,
            mtp.head_norm.as_ref().unwrap_or(&self.w.output_norm),
            eps,
        );
        let logits = be.matmul(mtp.head.as_ref().unwrap_or(&self.w.output), &h);
        Ok(Output { logits, h })
    }

    /// The MTP block over `tokens` for its cache alone (prompt rows and accepted rows): the
    /// head's logits, a `[rows, n_vocab]` product nobody reads there, are not computed.
    pub fn mtp_fill(
        &self,
        be: &B,
        st: &mut MtpState<B>,
        tokens: &[u32],
        h_prev: &B::T,
    ) -> Result<(), ModelError> {
        self.mtp_block(be, st, tokens, h_prev).map(|_| ())
    }

    /// Embedding ‖ hidden → eh_proj → one attention block, appending to the MTP cache;
    /// returns the block's output rows (before the head's norm).
    fn mtp_block(
        &self,
        be: &B,
        st: &mut MtpState<B>,
        tokens: &[u32],
        h_prev: &B::T,
    ) -> Result<B::T, ModelError> {
        let mtp = self.w.mtp.as_ref().ok_or(ModelError::NoMtp)?;
        self.check_tokens(tokens)?;
        let eps = self.cfg.eps;
        let emb = be.embed(mtp.embed.as_ref().unwrap_or(&self.w.token_embd), tokens);
        let e = be.rms_norm(&emb, &mtp.enorm, eps);
        let hh = be.rms_norm(h_prev, &mtp.hnorm, eps);
        let mut c = be.matmul(&mtp.eh_proj, &be.concat_cols(&e, &hh));
        let h = be.rms_norm(&c, &mtp.layer.attn_norm, eps);
        let a = self.attn_mixer(be, &mtp.layer, &h, &mut st.kv, st.pos);
        be.add_assign(&mut c, &a);
        self.ffn(be, &mtp.layer, &mut c);
        st.pos += tokens.len();
        Ok(c)
    }
}
