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
        })
    }

    pub fn new_mtp_state(&self, be: &B) -> Result<MtpState<B>, ModelError> {
        if self.w.mtp.is_none() {
            return Err(ModelError::NoMtp);
        }
        Ok(MtpState {
            pos: 0,
            kv: be.new_kv(&self.cfg.attn_params(), KvTypes::default())?,
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

    fn gdn_mixer(&self, be: &B, layer: &Layer<B::W>, h: &B::T, rs: &mut B::Rs) -> B::T {
        let Mixer::Gdn(g) = &layer.mixer else {
            unreachable!("GDN layer with an attention mixer")
        };
        let mixed = be.matmul(&g.qkv, h);
        let z = be.matmul(&g.gate, h);
        let b = be.matmul(&g.beta, h);
        let a = be.matmul(&g.alpha, h);
        let w = GdnWeights {
            conv: &g.conv,
            dt_bias: &g.dt_bias,
            ssm_a: &g.ssm_a,
            norm: &g.norm,
        };
        let y = be.gdn(&self.cfg.gdn_params(), &mixed, &z, &b, &a, &w, rs);
        be.matmul(&g.out, &y)
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
        self.check_tokens(tokens)?;
        assert!(!tokens.is_empty(), "forward of an empty batch");
        let end = st.pos + tokens.len();
        if end > self.cfg.context_length {
            return Err(ModelError::ContextFull {
                pos: end,
                n_ctx: self.cfg.context_length,
            });
        }
        let eps = self.cfg.eps;
        let mut x = be.embed(&self.w.token_embd, tokens);
        for (il, layer) in self.w.layers.iter().enumerate() {
            let h = be.rms_norm(&x, &layer.attn_norm, eps);
            let a = if self.cfg.is_recurrent(il) {
                self.gdn_mixer(be, layer, &h, st.rs[il].as_mut().expect("recurrent state"))
            } else {
                self.attn_mixer(be, layer, &h, st.kv[il].as_mut().expect("kv cache"), st.pos)
            };
            be.add_assign(&mut x, &a);
            self.ffn(be, layer, &mut x);
        }
        st.pos = end;
        let x = if all_rows {
            x
        } else {
            be.rows(&x, tokens.len() - 1, 1)
        };
        let h = be.rms_norm(&x, &self.w.output_norm, eps);
        let logits = be.matmul(&self.w.output, &h);
        Ok(Output { logits, h })
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
        let h = be.rms_norm(
            &c,
            mtp.head_norm.as_ref().unwrap_or(&self.w.output_norm),
            eps,
        );
        let logits = be.matmul(mtp.head.as_ref().unwrap_or(&self.w.output), &h);
        Ok(Output { logits, h })
    }
}
