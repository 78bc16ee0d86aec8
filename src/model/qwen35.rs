//! The forward recipe of model-qwen35.md §3–§6, once, against the backend ops.

use super::lora::{Mat, Site};
use super::phase::{self, Phase};
use super::weights::{AttnWeights, GdnWeights as GdnLayer, Layer, Mixer};
use super::{Model, ModelError, Output};
use crate::backend::{AttnSeq, Backend, GdnSeq, KvTypes};

/// Per-sequence state of the trunk: attention KV for full-attention layers, conv + SSM state
/// for Gated DeltaNet layers, and the next position.
pub struct SeqState<B: Backend> {
    /// Rows held (the cache index of the next row).
    pub pos: usize,
    /// How far the M-RoPE position counter trails `pos`: an image holds rows × cols cache
    /// entries but advances the position by max(rows, cols) (model-vision.md §4), so the next
    /// text row's position is `pos - lag`.
    pub lag: usize,
    pub kv: Vec<Option<B::Kv>>,
    pub rs: Vec<Option<B::Rs>>,
    /// Rollback cells for speculative verify: `cells[il][t]` stands for layer il's recurrent
    /// state after row t of a batch run with `snapshot`, for every row but the last (empty
    /// until `arm_cells`; see `GdnSeq`).
    pub cells: Vec<Vec<B::Rs>>,
    /// The scale of each loaded LoRA adapter for this sequence (missing entries are 0).
    pub lora: Vec<f32>,
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

    /// Restores every GDN layer to the state after row `t` of the last snapshot batch
    /// (`Backend::recurrent_restore`); the cells are scratch until the next snapshot batch.
    pub fn restore_cell(&mut self, be: &B, t: usize) {
        for (cells, rs) in self.cells.iter_mut().zip(self.rs.iter_mut()) {
            if let (Some(c), Some(r)) = (cells.get_mut(t), rs.as_mut()) {
                be.recurrent_restore(r, c);
            }
        }
    }
}

/// An image's embedding rows (the projector's output, `[rows · cols, n_embd]` in row-major grid
/// order) run in place of token ids: rows `first..first + n` of it, so a large image can be fed
/// in several steps (the position counter moves on once its last row is in).
pub struct ImageRows<'s, T> {
    pub embd: &'s T,
    pub rows: usize,
    pub cols: usize,
    pub first: usize,
    pub n: usize,
}

impl<T> ImageRows<'_, T> {
    /// Whether this chunk holds the image's last row.
    pub fn ends(&self) -> bool {
        self.first + self.n == self.rows * self.cols
    }
}

/// One sequence's share of a batched step: its state, the tokens to run at `seq.pos..` (or an
/// image's rows, with `tokens` empty), and whether it wants a logits row per token or only for
/// the last.
pub struct BatchItem<'s, B: Backend> {
    pub seq: &'s mut SeqState<B>,
    pub tokens: &'s [u32],
    pub image: Option<ImageRows<'s, B::T>>,
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
    /// Rows held (the cache index of the next row).
    pub pos: usize,
    /// How far the head's rotary position runs ahead of `pos`: the head never sees an image's
    /// rows (llama.cpp's draft-mtp skips embedding batches), yet its text rows sit at the
    /// trunk's M-RoPE positions, so after an image of `rows x cols` this grows by
    /// max(rows, cols).
    pub skip: usize,
    pub kv: B::Kv,
    /// The scale of each loaded LoRA adapter (missing entries are 0), as the trunk's.
    pub lora: Vec<f32>,
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
            lag: 0,
            kv,
            rs: (0..n)
                .map(|il| self.cfg.is_recurrent(il).then(|| be.new_recurrent(&gp)))
                .collect(),
            cells: Vec::new(),
            lora: Vec::new(),
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
            skip: 0,
            kv: be.new_kv(&self.cfg.attn_params(), kv_types)?,
            lora: Vec::new(),
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

    /// ATTN(h) of model-qwen35.md §3 for each sequence of the batch on its own cache:
    /// q/k/v projected once for every row, the attention core per sequence, `Wo` once.
    fn attn_mixer(
        &self,
        be: &B,
        il: usize,
        a: &AttnWeights<B::W>,
        h: &B::T,
        batch: &Batch,
        caches: &mut [(&mut B::Kv, usize, &[f32])],
    ) -> B::T {
        let at = |m| Site::Layer(il, m);
        let qkv = self.mm_many(
            be,
            &[(at(Mat::Q), &a.q), (at(Mat::K), &a.k), (at(Mat::V), &a.v)],
            h,
            &batch.lora,
        );
        let ap = self.cfg.attn_params();
        let attn = phase::time(Phase::Attn);
        let mut seqs: Vec<AttnSeq<'_, B::Kv>> = caches
            .iter_mut()
            .zip(&batch.spans)
            .map(|((kv, pos0, rope), &(_, rows))| AttnSeq {
                rows,
                kv: &mut **kv,
                pos0: *pos0,
                rope,
            })
            .collect();
        let o = be.attention_batch(
            &ap, &qkv[0], &qkv[1], &qkv[2], &a.q_norm, &a.k_norm, &mut seqs,
        );
        drop(attn);
        self.mm(be, at(Mat::O), &a.o, &o, &batch.lora)
    }

    /// GDN(h) of model-qwen35.md §4 for each sequence of the batch on its own recurrent state:
    /// the projections once for every row, the recurrence per sequence. A sequence that asks
    /// for `snapshot` keeps what restoring the state after each row but the last needs in its
    /// rollback cells (after the last row the live state is that state).
    fn gdn_mixer(
        &self,
        be: &B,
        g: &GdnLayer<B::W>,
        h: &B::T,
        batch: &Batch,
        items: &mut [BatchItem<'_, B>],
        il: usize,
    ) -> B::T {
        let at = |m| Site::Layer(il, m);
        let proj = self.mm_many(
            be,
            &[
                (at(Mat::Qkv), &g.qkv),
                (at(Mat::Gate), &g.gate),
                (at(Mat::Beta), &g.beta),
                (at(Mat::Alpha), &g.alpha),
            ],
            h,
            &batch.lora,
        );
        let gp = self.cfg.gdn_params();
        let w = g.core();
        let mut seqs: Vec<GdnSeq<'_, B::Rs>> = items
            .iter_mut()
            .zip(&batch.spans)
            .map(|(it, &(_, rows))| {
                let seq = &mut *it.seq;
                let cells = it.snapshot.then(|| {
                    let armed = seq.cells.get_mut(il).filter(|c| c.len() + 1 >= rows);
                    let armed = armed.unwrap_or_else(|| {
                        panic!(
                            "snapshot batch of {rows} rows needs {} armed cells",
                            rows - 1
                        )
                    });
                    &mut armed[..]
                });
                GdnSeq {
                    rows,
                    state: seq.rs[il]
                        .as_mut()
                        .expect("a GDN layer has a recurrent state"),
                    cells,
                }
            })
            .collect();
        let y = {
            let _t = phase::time(Phase::Gdn);
            be.gdn_batch(&gp, &proj[0], &proj[1], &proj[2], &proj[3], &w, &mut seqs)
        };
        self.mm(be, at(Mat::SsmOut), &g.out, &y, &batch.lora)
    }

    /// `x += FFN(rmsnorm(x) * post_attention_norm)`.
    fn ffn(&self, be: &B, il: usize, layer: &Layer<B::W>, x: &mut B::T, lora: &RowScales) {
        let at = |m| Site::Layer(il, m);
        let h = {
            let _t = phase::time(Phase::Elementwise);
            be.rms_norm(x, &layer.post_attn_norm, self.cfg.eps)
        };
        let gu = self.mm_many(
            be,
            &[
                (at(Mat::FfnGate), &layer.ffn_gate),
                (at(Mat::FfnUp), &layer.ffn_up),
            ],
            &h,
            lora,
        );
        let act = {
            let _t = phase::time(Phase::Elementwise);
            be.swiglu(&gu[0], &gu[1])
        };
        let y = self.mm(be, at(Mat::FfnDown), &layer.ffn_down, &act, lora);
        let _t = phase::time(Phase::Elementwise);
        be.add_assign(x, &y);
    }

    /// `W·x` plus the term of every LoRA adapter that modifies this matmul and is active for
    /// some row (model/lora.rs): `y += s·B(A·x)`, each row at its own sequence's scale.
    fn mm(&self, be: &B, site: Site, w: &B::W, x: &B::T, lora: &RowScales) -> B::T {
        let _t = phase::time(mm_phase(site));
        let mut y = be.matmul(w, x);
        self.lora_terms(be, site, &mut y, x, lora);
        y
    }

    /// `mm` of one input by several weights (the fold's transform shared, `matmul_many`).
    fn mm_many(&self, be: &B, ws: &[(Site, &B::W)], x: &B::T, lora: &RowScales) -> Vec<B::T> {
        let _t = phase::time(mm_phase(ws[0].0));
        let mut ys = be.matmul_many(&ws.iter().map(|w| w.1).collect::<Vec<_>>(), x);
        for (y, (site, _)) in ys.iter_mut().zip(ws) {
            self.lora_terms(be, *site, y, x, lora);
        }
        ys
    }

    fn lora_terms(&self, be: &B, site: Site, y: &mut B::T, x: &B::T, lora: &RowScales) {
        for (i, ad) in self.adapters.iter().enumerate() {
            let (Some(scales), Some(pair)) = (lora.of(i), ad.get(site)) else {
                continue;
            };
            let s: Vec<f32> = scales.iter().map(|&sc| ad.pair_scale(pair, sc)).collect();
            let ab = be.matmul(&pair.b, &be.matmul(&pair.a, x));
            be.add_scaled_rows(y, &ab, &s);
        }
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
        // Where the backend runs a step best (the CPU: on a worker of its pool, see
        // `Backend::run_step`); the engine's steps are there already.
        B::run_step(|| self.forward_one(be, st, tokens, None, all_rows))
    }

    /// One sequence's batch: `tokens`, or an image's rows.
    fn forward_one(
        &self,
        be: &B,
        st: &mut SeqState<B>,
        tokens: &[u32],
        image: Option<ImageRows<'_, B::T>>,
        all_rows: bool,
    ) -> Result<Output<B::T>, ModelError> {
        let mut items = [BatchItem {
            seq: st,
            tokens,
            image,
            all_rows,
            hidden_rows: false,
            snapshot: false,
        }];
        Ok(self
            .forward_batch(be, &mut items)?
            .pop()
            .expect("one output per item"))
    }

    /// Runs an image's embedding rows (`[rows · cols, n_embd]`, the projector's output) at the
    /// state's M-RoPE position (model-vision.md §4); afterwards text resumes at that position
    /// plus max(rows, cols). With `all_rows` one logits row per image token.
    pub fn forward_image(
        &self,
        be: &B,
        st: &mut SeqState<B>,
        embd: &B::T,
        rows: usize,
        cols: usize,
        all_rows: bool,
    ) -> Result<Output<B::T>, ModelError> {
        let image = ImageRows {
            embd,
            rows,
            cols,
            first: 0,
            n: rows * cols,
        };
        self.forward_one(be, st, &[], Some(image), all_rows)
    }

    /// One step over several sequences at once (model-qwen35.md §3): every matmul runs once
    /// over the rows of all of them (so the weights are read once per step), attention and the
    /// recurrence run per sequence on its own rows and state. Returns one output per item, in
    /// order.
    pub fn forward_batch(
        &self,
        be: &B,
        items: &mut [BatchItem<'_, B>],
    ) -> Result<Vec<Output<B::T>>, ModelError> {
        let joined = self.forward_batch_joined(be, items)?;
        let _t = phase::time(Phase::Elementwise);
        Ok(joined.split(be))
    }

    /// [`Model::forward_batch`] with the items' logits rows left in one tensor: a caller that
    /// reads each item's rows where they lie (the engine's sampling) skips copying them out,
    /// a row of the vocabulary's width per item.
    pub fn forward_batch_joined(
        &self,
        be: &B,
        items: &mut [BatchItem<'_, B>],
    ) -> Result<Joined<B::T>, ModelError> {
        let batch = self.batch(items)?;
        let eps = self.cfg.eps;
        let mut x = {
            let _t = phase::time(Phase::Elementwise);
            self.input_rows(be, items, &batch)
        };
        for (il, layer) in self.w.layers.iter().enumerate() {
            let h = {
                let _t = phase::time(Phase::Elementwise);
                be.rms_norm(&x, &layer.attn_norm, eps)
            };
            let mixed = match &layer.mixer {
                Mixer::Attn(a) => {
                    let mut caches: Vec<(&mut B::Kv, usize, &[f32])> = items
                        .iter_mut()
                        .zip(&batch.rope)
                        .map(|(it, rope)| {
                            let pos0 = it.seq.pos;
                            let kv = it.seq.kv[il].as_mut();
                            let kv = kv.expect("an attention layer has a KV cache");
                            (kv, pos0, rope.as_slice())
                        })
                        .collect();
                    self.attn_mixer(be, il, a, &h, &batch, &mut caches)
                }
                Mixer::Gdn(g) => self.gdn_mixer(be, g, &h, &batch, items, il),
            };
            {
                let _t = phase::time(Phase::Elementwise);
                be.add_assign(&mut x, &mixed);
            }
            self.ffn(be, il, layer, &mut x, &batch.lora);
        }
        for (it, &(_, n)) in items.iter_mut().zip(&batch.spans) {
            it.seq.pos += n;
            if let Some(img) = it.image.as_ref().filter(|i| i.ends()) {
                it.seq.lag += img.rows * img.cols - img.rows.max(img.cols);
            }
        }
        // h_nextn for the rows each sequence wants, logits for the rows it wants them for.
        let picks = batch.picks(items);
        let (h, hl) = {
            let _t = phase::time(Phase::Elementwise);
            let x = picks.gather_h(be, x);
            let h = be.rms_norm(&x, &self.w.output_norm, eps);
            let hl = picks.gather_logits(be, &h);
            (h, hl)
        };
        let lora = RowScales::new(
            self.adapters.len(),
            items.iter().map(|it| it.seq.lora.as_slice()),
            picks.logits.iter().map(|r| r.1),
        );
        let logits = self.mm(
            be,
            Site::Output,
            &self.w.output,
            hl.as_ref().unwrap_or(&h),
            &lora,
        );
        Ok(Joined { logits, h, picks })
    }

    /// The batch's input rows: token embeddings, an image item's rows as given.
    fn input_rows(&self, be: &B, items: &[BatchItem<'_, B>], batch: &Batch) -> B::T {
        if items.iter().all(|it| it.image.is_none()) {
            return be.embed(&self.w.token_embd, &batch.tokens);
        }
        let parts: Vec<B::T> = items
            .iter()
            .map(|it| match &it.image {
                Some(img) => be.rows(img.embd, img.first, img.n),
                None => be.embed(&self.w.token_embd, it.tokens),
            })
            .collect();
        be.concat_rows(&parts.iter().collect::<Vec<_>>())
    }

    /// Checks a batch's items and lays their rows out one after another, with each item's
    /// rotary table at its M-RoPE positions: text row k at `p + k` on every stream, image token
    /// k at `[p, p + k / cols, p + k % cols, 0]` (`p = pos - lag`, at the image's first row;
    /// model-vision.md §4).
    fn batch(&self, items: &[BatchItem<'_, B>]) -> Result<Batch, ModelError> {
        assert!(!items.is_empty(), "forward of an empty batch");
        let mut tokens = Vec::new();
        let mut spans = Vec::with_capacity(items.len());
        let mut rope = Vec::with_capacity(items.len());
        let mut rows = 0;
        let ap = self.cfg.attn_params();
        for it in items {
            self.check_tokens(it.tokens)?;
            let n = match &it.image {
                Some(img) => {
                    assert!(it.tokens.is_empty(), "an image item with token ids");
                    assert!(
                        img.first + img.n <= img.rows * img.cols,
                        "image rows {}..{} of a {}x{} grid",
                        img.first,
                        img.first + img.n,
                        img.rows,
                        img.cols
                    );
                    img.n
                }
                None => it.tokens.len(),
            };
            assert!(n > 0, "a batch item without rows");
            let end = it.seq.pos + n;
            if end > self.cfg.context_length {
                return Err(ModelError::ContextFull {
                    pos: end,
                    n_ctx: self.cfg.context_length,
                });
            }
            let first = it.image.as_ref().map_or(0, |i| i.first);
            let p = (it.seq.pos - first - it.seq.lag) as u32;
            let pos: Vec<[u32; 4]> = match &it.image {
                Some(img) => (first as u32..(first + n) as u32)
                    .map(|k| {
                        let c = img.cols as u32;
                        [p, p + k / c, p + k % c, 0]
                    })
                    .collect(),
                None => (0..n as u32).map(|k| [p + k, p + k, p + k, 0]).collect(),
            };
            rope.push(crate::backend::rope_table_at(
                &pos,
                ap.n_rot,
                ap.rope_base,
                ap.rope_sections,
            ));
            spans.push((rows, n));
            rows += n;
            tokens.extend_from_slice(it.tokens);
        }
        let lora = RowScales::new(
            self.adapters.len(),
            items.iter().map(|it| it.seq.lora.as_slice()),
            spans.iter().map(|s| s.1),
        );
        Ok(Batch {
            tokens,
            spans,
            rows,
            rope,
            lora,
        })
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
        let h = self.mtp_hidden(be, st, tokens, h_prev, false)?;
        let (site, head) = self.mtp_head()?;
        let lora = RowScales::new(self.adapters.len(), [st.lora.as_slice()], [tokens.len()]);
        let logits = self.mm(be, site, head, &h, &lora);
        Ok(Output { logits, h })
    }

    /// [`Model::mtp_forward`] for drafting, scoring the last row only (the rows before it fill
    /// the cache: held rows that ride a draft step): with a reduced draft head loaded
    /// ([`super::draft_vocab`]) the logits cover token ids `0..n` only, which a draft needs
    /// (the trunk verifies it); the full head when an adapter changes the head, whose rows the
    /// reduced one does not carry. `h` is the last row's.
    pub fn mtp_draft(
        &self,
        be: &B,
        st: &mut MtpState<B>,
        tokens: &[u32],
        h_prev: &B::T,
    ) -> Result<Output<B::T>, ModelError> {
        let h = self.mtp_hidden(be, st, tokens, h_prev, true)?;
        let (site, head) = self.mtp_head()?;
        let adapted = self.adapters.iter().any(|a| a.get(site).is_some());
        let draft = self.w.mtp.as_ref().and_then(|m| m.draft_head.as_ref());
        let logits = match draft.filter(|_| !adapted) {
            Some(d) => be.matmul(&d.w, &h),
            None => {
                let lora = RowScales::new(self.adapters.len(), [st.lora.as_slice()], [1]);
                self.mm(be, site, head, &h, &lora)
            }
        };
        Ok(Output { logits, h })
    }

    /// The matrix that scores the MTP head's rows: its own head where the file has one, else
    /// the output head, with the site an adapter sees it at.
    fn mtp_head(&self) -> Result<(Site, &B::W), ModelError> {
        let mtp = self.w.mtp.as_ref().ok_or(ModelError::NoMtp)?;
        Ok(match &mtp.head {
            Some(w) => (Site::MtpHead, w),
            None => (Site::Output, &self.w.output),
        })
    }

    /// The MTP block's output through the head norm: the rows a head scores (with `last_only`,
    /// the last row alone; the rows before it only fill the cache).
    fn mtp_hidden(
        &self,
        be: &B,
        st: &mut MtpState<B>,
        tokens: &[u32],
        h_prev: &B::T,
        last_only: bool,
    ) -> Result<B::T, ModelError> {
        let mtp = self.w.mtp.as_ref().ok_or(ModelError::NoMtp)?;
        let n = tokens.len();
        let c = self.mtp_block(be, &mut [MtpRows { st, tokens, h_prev }])?;
        let c = if last_only && n > 1 {
            be.rows(&c, n - 1, 1)
        } else {
            c
        };
        Ok(be.rms_norm(
            &c,
            mtp.head_norm.as_ref().unwrap_or(&self.w.output_norm),
            self.cfg.eps,
        ))
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
        self.mtp_block(be, &mut [MtpRows { st, tokens, h_prev }])
            .map(|_| ())
    }

    /// [`Model::mtp_fill`] for several sequences in one pass of the block: each of its weights
    /// is read once for all their rows, as a trunk step reads its own for every slot's rows.
    /// Items without rows are skipped.
    pub fn mtp_fill_many(&self, be: &B, items: &mut [MtpRows<'_, B>]) -> Result<(), ModelError> {
        let mut items: Vec<MtpRows<'_, B>> = items
            .iter_mut()
            .filter(|it| !it.tokens.is_empty())
            .map(|it| MtpRows {
                st: &mut *it.st,
                tokens: it.tokens,
                h_prev: it.h_prev,
            })
            .collect();
        if items.is_empty() {
            return Ok(());
        }
        self.mtp_block(be, &mut items).map(|_| ())
    }

    /// Embedding ‖ hidden → eh_proj → one attention block over each item's rows, appending to
    /// its MTP cache; returns the block's output rows (before the head's norm), item after item.
    fn mtp_block(&self, be: &B, items: &mut [MtpRows<'_, B>]) -> Result<B::T, ModelError> {
        let mtp = self.w.mtp.as_ref().ok_or(ModelError::NoMtp)?;
        for it in items.iter() {
            self.check_tokens(it.tokens)?;
        }
        let eps = self.cfg.eps;
        let batch = Batch::texts(
            items
                .iter()
                .map(|it| (it.tokens, it.st.pos + it.st.skip, it.st.lora.as_slice())),
            &self.cfg.attn_params(),
            self.adapters.len(),
        );
        let emb = be.embed(
            mtp.embed.as_ref().unwrap_or(&self.w.token_embd),
            &batch.tokens,
        );
        let e = be.rms_norm(&emb, &mtp.enorm, eps);
        let hh = match items {
            [it] => be.rms_norm(it.h_prev, &mtp.hnorm, eps),
            _ => {
                let parts: Vec<&B::T> = items.iter().map(|it| it.h_prev).collect();
                be.rms_norm(&be.concat_rows(&parts), &mtp.hnorm, eps)
            }
        };
        let mut c = self.mm(
            be,
            Site::EhProj,
            &mtp.eh_proj,
            &be.concat_cols(&e, &hh),
            &batch.lora,
        );
        let h = be.rms_norm(&c, &mtp.layer.attn_norm, eps);
        let Mixer::Attn(aw) = &mtp.layer.mixer else {
            unreachable!("the MTP block's layer is a full-attention layer")
        };
        let il = self.cfg.n_layer;
        let mut caches: Vec<(&mut B::Kv, usize, &[f32])> = items
            .iter_mut()
            .zip(&batch.rope)
            .map(|(it, rope)| (&mut it.st.kv, it.st.pos, rope.as_slice()))
            .collect();
        let a = self.attn_mixer(be, il, aw, &h, &batch, &mut caches);
        be.add_assign(&mut c, &a);
        self.ffn(be, il, &mtp.layer, &mut c, &batch.lora);
        for it in items.iter_mut() {
            it.st.pos += it.tokens.len();
        }
        Ok(c)
    }
}

/// One sequence's rows for the MTP block: its head state, the tokens, and the trunk's hidden
/// rows of the positions before them.
pub struct MtpRows<'a, B: Backend> {
    pub st: &'a mut MtpState<B>,
    pub tokens: &'a [u32],
    pub h_prev: &'a B::T,
}

/// The phase a matmul's time counts to.
fn mm_phase(site: Site) -> Phase {
    match site {
        Site::Layer(_, Mat::Q | Mat::K | Mat::V | Mat::O) => Phase::MmAttn,
        Site::Layer(_, Mat::FfnGate | Mat::FfnUp | Mat::FfnDown) => Phase::MmFfn,
        Site::Layer(..) => Phase::MmGdn,
        Site::Output | Site::MtpHead => Phase::Head,
        Site::EhProj => Phase::MmAttn,
    }
}

/// The rows of one batched step: every item's tokens, one after another, and each item's
/// `(first row, count)`.
struct Batch {
    /// The token ids of the text items (image rows have none).
    tokens: Vec<u32>,
    spans: Vec<(usize, usize)>,
    rows: usize,
    /// Each item's rotary table (`backend::rope_table_at`).
    rope: Vec<Vec<f32>>,
    /// Each LoRA adapter's scale for every row.
    lora: RowScales,
}

impl Batch {
    /// Text items one after another, each `(tokens, first position, LoRA scales)`: its
    /// tokens at text positions `first..`.
    fn texts<'a>(
        items: impl Iterator<Item = (&'a [u32], usize, &'a [f32])>,
        ap: &crate::backend::AttnParams,
        n_adapters: usize,
    ) -> Batch {
        let (mut tokens, mut spans, mut rope, mut scales) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (t, pos0, lora) in items {
            spans.push((tokens.len(), t.len()));
            rope.push(crate::backend::rope_table(
                pos0,
                t.len(),
                ap.n_rot,
                ap.rope_base,
                ap.rope_sections,
            ));
            scales.push(lora);
            tokens.extend_from_slice(t);
        }
        Batch {
            lora: RowScales::new(n_adapters, scales, spans.iter().map(|s| s.1)),
            rows: tokens.len(),
            tokens,
            spans,
            rope,
        }
    }

    /// Which rows each item wants h for (every row with `all_rows` or `hidden_rows`, else the
    /// last) and, among those, which it wants logits for (every one with `all_rows`, else the
    /// last).
    fn picks<B: Backend>(&self, items: &[BatchItem<'_, B>]) -> Picks {
        let mut h = Vec::with_capacity(items.len());
        let mut logits = Vec::with_capacity(items.len());
        let mut at = 0;
        for (it, &(start, n)) in items.iter().zip(&self.spans) {
            let c = if it.all_rows || it.hidden_rows { n } else { 1 };
            let l = if it.all_rows { n } else { 1 };
            h.push((start + n - c, c));
            logits.push((at + c - l, l));
            at += c;
        }
        Picks {
            h,
            logits,
            rows: self.rows,
        }
    }
}

/// A batch's outputs before they are split per item ([`Model::forward_batch_joined`]): every
/// item's logits rows in one tensor, one item's after another's.
pub struct Joined<T> {
    pub logits: T,
    h: T,
    picks: Picks,
}

impl<T> Joined<T> {
    /// The logits tensor's rows: every item's.
    pub fn logits_rows(&self) -> usize {
        self.picks.logits.iter().map(|r| r.1).sum()
    }

    /// Item `i`'s logits rows in the tensor: (first row, count).
    pub fn logits_run(&self, i: usize) -> (usize, usize) {
        let first = self.picks.logits[..i].iter().map(|r| r.1).sum();
        (first, self.picks.logits[i].1)
    }

    /// One output per item: its logits rows and its h rows.
    pub fn split<B: Backend<T = T>>(self, be: &B) -> Vec<Output<T>> {
        self.picks.split(be, self.logits, self.h)
    }

    /// The logits tensor whole, and each item's h rows.
    pub fn split_h<B: Backend<T = T>>(self, be: &B) -> (T, Vec<T>) {
        let h = match self.picks.h.len() {
            1 => vec![self.h],
            _ => be.split_rows(self.h, &Picks::counts(&self.picks.h)),
        };
        (self.logits, h)
    }
}

/// The output rows of a batch (`Batch::picks`): runs of `(first row, count)` per item, of the
/// batch's rows for h and of h's rows for the logits.
struct Picks {
    h: Vec<(usize, usize)>,
    logits: Vec<(usize, usize)>,
    rows: usize,
}

impl Picks {
    /// Whether `runs` are every one of `rows` rows in order (nothing to gather).
    fn whole(runs: &[(usize, usize)], rows: usize) -> bool {
        let mut at = 0;
        runs.iter().all(|&(s, n)| {
            let ok = s == at;
            at += n;
            ok
        }) && at == rows
    }

    fn gather_h<B: Backend>(&self, be: &B, x: B::T) -> B::T {
        if Self::whole(&self.h, self.rows) {
            x
        } else {
            be.gather_rows(&x, &self.h)
        }
    }

    /// The rows of h that get logits; `None` when that is every row.
    fn gather_logits<B: Backend>(&self, be: &B, h: &B::T) -> Option<B::T> {
        let h_rows = self.h.iter().map(|r| r.1).sum();
        (!Self::whole(&self.logits, h_rows)).then(|| be.gather_rows(h, &self.logits))
    }

    /// The rows of each run.
    fn counts(runs: &[(usize, usize)]) -> Vec<usize> {
        runs.iter().map(|r| r.1).collect()
    }

    /// One output per item: its logits rows and its h rows.
    fn split<B: Backend>(&self, be: &B, logits: B::T, h: B::T) -> Vec<Output<B::T>> {
        if self.h.len() == 1 {
            return vec![Output { logits, h }];
        }
        let logits = be.split_rows(logits, &Self::counts(&self.logits));
        let h = be.split_rows(h, &Self::counts(&self.h));
        logits
            .into_iter()
            .zip(h)
            .map(|(logits, h)| Output { logits, h })
            .collect()
    }
}

/// Each loaded LoRA adapter's scale for every row of a step: the rows of item `i` take its
/// sequence's scale. An adapter no row uses (every scale 0) is skipped, so a model whose
/// adapters are all at scale 0 computes exactly the base model.
struct RowScales {
    per_adapter: Vec<Option<Vec<f32>>>,
}

impl RowScales {
    fn new<'a>(
        n_adapters: usize,
        items: impl IntoIterator<Item = &'a [f32]>,
        rows: impl IntoIterator<Item = usize>,
    ) -> RowScales {
        let mut per_adapter = vec![Vec::new(); n_adapters];
        for (scales, n) in items.into_iter().zip(rows) {
            for (a, col) in per_adapter.iter_mut().enumerate() {
                col.extend(std::iter::repeat_n(
                    scales.get(a).copied().unwrap_or(0.0),
                    n,
                ));
            }
        }
        RowScales {
            per_adapter: per_adapter
                .into_iter()
                .map(|col| col.iter().any(|&s| s != 0.0).then_some(col))
                .collect(),
        }
    }

    /// Adapter `i`'s scale per row, or `None` when no row uses it.
    fn of(&self, i: usize) -> Option<&[f32]> {
        self.per_adapter.get(i)?.as_deref()
    }
}
