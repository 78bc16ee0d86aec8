#!/usr/bin/env python3
"""Independent float64 NumPy reference of the `qwen35` forward (shared/docs/model-qwen35.md §1-§6).

Written from the spec, not from tern's Rust code. Reads a GGUF with gguf-py's GGUFReader and
dequantizes with `gguf.quants.dequantize` (F32/F16/BF16/Q8_0/Q4_0 and whatever else gguf-py knows;
PQ2_0 files must be evaluated through their F32 twin).

API:
    model = load(path)
    logits, h_nextn = forward(model, tokens)             # [T, n_vocab], [T, n_embd]
    logits, h_out   = mtp_forward(model, tokens, h_prev)  # MTP block (index n_layer), row p gets x_p and h_{p-1}

Shapes: GGUFReader gives a tensor with ggml dims {ne0, ne1} as a numpy array of shape (ne1, ne0)
(`ReaderTensor.shape` is the ggml order, `.data.shape` the reversed numpy order). A weight
{n_in, n_out} is therefore a numpy (n_out, n_in) matrix W and y = W @ x (row-major: X @ W.T).

CLI (self-check):  python reference.py MODEL.gguf 1,2,3,...
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np
import gguf
from gguf import GGUFReader, GGMLQuantizationType

ARCH = "qwen35"


# --------------------------------------------------------------------------------------------
# loading

def _field_value(f):
    """Value of a GGUFReader field: scalar, str, or list."""
    from gguf import GGUFValueType as VT
    if not f.types:
        return None
    if f.types[0] == VT.ARRAY:
        return list(f.contents())
    return f.contents()


def read_metadata(reader: GGUFReader) -> dict:
    md = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            md[k] = _field_value(f)
        except Exception:  # pragma: no cover - exotic field
            md[k] = None
    return md


def dequant_tensor(t) -> np.ndarray:
    """ReaderTensor -> float64 numpy array of shape reversed(ggml dims)."""
    shape = tuple(int(x) for x in reversed([int(d) for d in t.shape]))
    if t.tensor_type == GGMLQuantizationType.F32:
        arr = np.asarray(t.data, dtype=np.float32)
    elif t.tensor_type == GGMLQuantizationType.F16:
        arr = np.asarray(t.data).view(np.float16).astype(np.float32)
    else:
        arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    return np.asarray(arr, dtype=np.float64).reshape(shape)


@dataclass
class Model:
    path: str
    md: dict
    t: dict                      # name -> float64 ndarray (numpy order)
    n_embd: int = 0
    n_vocab: int = 0
    n_layer_all: int = 0
    n_nextn: int = 0
    n_layer: int = 0             # trunk layers
    n_ff: int = 0
    n_head: int = 0
    n_head_kv: int = 0
    hd: int = 0
    n_rot: int = 0
    rope_base: float = 10000.0
    sections: list = field(default_factory=list)
    eps: float = 1e-6
    interval: int = 4
    recurrent: list = field(default_factory=list)
    d_conv: int = 0
    d_state: int = 0
    n_k: int = 0
    n_v: int = 0
    d_inner: int = 0
    ttypes: dict = field(default_factory=dict)   # name -> ggml type id

    def is_recr(self, il: int) -> bool:
        return self.recurrent[il]

    def w(self, name: str) -> np.ndarray:
        return self.t[name]

    def has(self, name: str) -> bool:
        return name in self.t

    def add_delta(self, name: str, delta: np.ndarray) -> None:
        """Merges a LoRA term into a weight: W <- W + s·B·A (lora_goldens.py)."""
        self.t[name] = self.t[name] + delta


def load(path: str) -> Model:
    reader = GGUFReader(path, "r")
    md = read_metadata(reader)
    arch = md.get("general.architecture")
    if arch != ARCH:
        raise ValueError(f"{path}: general.architecture={arch!r}, expected {ARCH!r}")
    p = ARCH + "."

    def g(key, default=None, required=True):
        if p + key in md:
            return md[p + key]
        if required and default is None:
            raise KeyError(f"{path}: missing metadata {p + key}")
        return default

    t = {}
    ttypes = {}
    for rt in reader.tensors:
        t[rt.name] = dequant_tensor(rt)
        ttypes[rt.name] = int(rt.tensor_type)

    m = Model(path=path, md=md, t=t, ttypes=ttypes)
    m.n_embd = int(g("embedding_length"))
    m.n_layer_all = int(g("block_count"))
    m.n_nextn = int(g("nextn_predict_layers", 0, required=False))
    m.n_layer = m.n_layer_all - m.n_nextn
    m.n_ff = int(g("feed_forward_length"))
    m.n_head = int(g("attention.head_count"))
    m.n_head_kv = int(g("attention.head_count_kv", m.n_head, required=False))
    m.hd = int(g("attention.key_length", m.n_embd // m.n_head, required=False))
    hdv = int(g("attention.value_length", m.hd, required=False))
    if hdv != m.hd:
        raise ValueError("attention.key_length != attention.value_length")
    m.n_rot = int(g("rope.dimension_count", m.hd, required=False))
    m.rope_base = float(g("rope.freq_base", 10000.0, required=False))
    secs = g("rope.dimension_sections")
    m.sections = [int(x) for x in (secs if isinstance(secs, list) else [secs] * 4)]
    m.eps = float(g("attention.layer_norm_rms_epsilon"))
    m.interval = int(g("full_attention_interval", 4, required=False))
    m.d_conv = int(g("ssm.conv_kernel"))
    m.d_state = int(g("ssm.state_size"))
    m.n_k = int(g("ssm.group_count"))
    m.n_v = int(g("ssm.time_step_rank"))
    m.d_inner = int(g("ssm.inner_size"))
    if m.d_inner != m.n_v * m.d_state:
        raise ValueError(f"ssm.inner_size {m.d_inner} != n_v*d_state {m.n_v * m.d_state}")
    rl = md.get(p + "attention.recurrent_layers")
    if isinstance(rl, list) and len(rl) == m.n_layer_all:
        m.recurrent = [bool(x) for x in rl]
    else:
        m.recurrent = [(i < m.n_layer) and ((i + 1) % m.interval != 0) for i in range(m.n_layer_all)]
    m.n_vocab = t["token_embd.weight"].shape[0]
    if t["token_embd.weight"].shape[1] != m.n_embd:
        raise ValueError("token_embd shape mismatch")
    rope_scaling = md.get(p + "rope.scaling.type")
    if rope_scaling not in (None, "none", "linear") or md.get(p + "rope.scaling.factor", 0.0) not in (0.0, 1.0):
        raise NotImplementedError(f"rope scaling {rope_scaling!r} not supported by the reference")
    if m.n_rot % 2 or m.n_rot > m.hd:
        raise ValueError("bad rope.dimension_count")
    return m


# --------------------------------------------------------------------------------------------
# math helpers (all float64)

def rmsnorm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y


def l2norm(x: np.ndarray, eps: float, form: str = "max") -> np.ndarray:
    """model-qwen35.md §4.6: ggml_l2_norm = x / max(||x||, eps) ("max" form).
    (The llama.cpp vendored in llama-cpp-python 0.3.36 builds it as
    rms_norm(x, eps/n)/sqrt(n) = x / sqrt(sum x^2 + eps) -- "sum" form; the two differ by ~eps/||x||^2.)"""
    ss = np.sum(x * x, axis=-1, keepdims=True)
    if form == "max":
        return x / np.maximum(np.sqrt(ss), eps)
    return x / np.sqrt(ss + eps)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    # ggml_softplus: x > 20 ? x : log1p(exp(x))
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def rope_neox_partial(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float) -> np.ndarray:
    """x: [T, H, hd]; NEOX half-split rotation on dims [0, n_rot), rest pass through (§3.3).
    Text-only IMROPE with sections whose t/h/w streams cover all n_rot/2 pairs == plain NEOX."""
    half = n_rot // 2
    i = np.arange(half, dtype=np.float64)
    inv = base ** (-2.0 * i / n_rot)
    ang = pos.astype(np.float64)[:, None] * inv[None, :]          # [T, half]
    c = np.cos(ang)[:, None, :]
    s = np.sin(ang)[:, None, :]
    y = x.copy()
    x1 = x[..., :half]
    x2 = x[..., half:n_rot]
    y[..., :half] = x1 * c - x2 * s
    y[..., half:n_rot] = x1 * s + x2 * c
    return y


def _check_sections(m: Model):
    """IMROPE sector rule (§3.3): with position rows (p,p,p,0) every pair whose sector falls in the
    4th stream would get position 0.  Make sure no rotated pair does (true for [11,11,10,0])."""
    s = m.sections
    tot = sum(s)
    for i in range(m.n_rot // 2):
        sec = i % tot if tot else 0
        ok = (sec % 3 == 0 and sec < 3 * s[0]) or (sec % 3 == 1 and sec < 3 * s[1]) or (sec % 3 == 2 and sec < 3 * s[2])
        if not ok:
            raise NotImplementedError(f"rope pair {i} falls in the 4th M-RoPE stream for sections {s}")


# --------------------------------------------------------------------------------------------
# blocks

def ffn(m: Model, pfx: str, x: np.ndarray) -> np.ndarray:
    gt = x @ m.w(pfx + "ffn_gate.weight").T
    up = x @ m.w(pfx + "ffn_up.weight").T
    return (silu(gt) * up) @ m.w(pfx + "ffn_down.weight").T


def attn_full(m: Model, pfx: str, h: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """§3 gated full attention, causal over the T rows given (fresh KV)."""
    T = h.shape[0]
    nh, nkv, hd = m.n_head, m.n_head_kv, m.hd
    qg = (h @ m.w(pfx + "attn_q.weight").T).reshape(T, nh, 2 * hd)
    q = qg[:, :, :hd]
    gate = qg[:, :, hd:].reshape(T, nh * hd)
    k = (h @ m.w(pfx + "attn_k.weight").T).reshape(T, nkv, hd)
    v = (h @ m.w(pfx + "attn_v.weight").T).reshape(T, nkv, hd)
    q = rmsnorm(q, m.w(pfx + "attn_q_norm.weight"), m.eps)
    k = rmsnorm(k, m.w(pfx + "attn_k_norm.weight"), m.eps)
    q = rope_neox_partial(q, pos, m.n_rot, m.rope_base)
    k = rope_neox_partial(k, pos, m.n_rot, m.rope_base)
    scale = 1.0 / np.sqrt(hd)
    grp = nh // nkv
    mask = np.tril(np.ones((T, T), dtype=bool))
    out = np.empty((T, nh, hd))
    for hh in range(nh):
        kh = hh // grp                                            # grouped GQA
        s = (q[:, hh, :] @ k[:, kh, :].T) * scale                 # [T, T]
        s = np.where(mask, s, -np.inf)
        s = s - s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        out[:, hh, :] = p @ v[:, kh, :]
    o = out.reshape(T, nh * hd) * sigmoid(gate)
    return o @ m.w(pfx + "attn_output.weight").T


def gdn(m: Model, pfx: str, h: np.ndarray, l2form: str = "max") -> np.ndarray:
    """§4 Gated DeltaNet over a fresh sequence (zero conv / ssm state), per-token recurrence."""
    T = h.shape[0]
    nk, nv, dk = m.n_k, m.n_v, m.d_state
    dv = dk
    K = m.d_conv
    kd = nk * dk
    mixed = h @ m.w(pfx + "attn_qkv.weight").T                     # [T, conv_dim]
    z = (h @ m.w(pfx + "attn_gate.weight").T).reshape(T, nv, dv)
    beta = sigmoid(h @ m.w(pfx + "ssm_beta.weight").T)              # [T, nv]
    a = h @ m.w(pfx + "ssm_alpha.weight").T
    g = m.w(pfx + "ssm_a")[None, :] * softplus(a + m.w(pfx + "ssm_dt.bias")[None, :])   # [T, nv], <= 0

    cw = m.w(pfx + "ssm_conv1d.weight")                            # [conv_dim, K]
    C = mixed.shape[1]
    X = np.concatenate([np.zeros((K - 1, C)), mixed], axis=0)      # zero initial conv state
    c = np.zeros((T, C))
    for kk in range(K):
        c += cw[None, :, kk] * X[kk:kk + T, :]
    u = silu(c)

    q = u[:, :kd].reshape(T, nk, dk)
    k = u[:, kd:2 * kd].reshape(T, nk, dk)
    v = u[:, 2 * kd:].reshape(T, nv, dv)
    q = l2norm(q, m.eps, l2form) * (1.0 / np.sqrt(dk))
    k = l2norm(k, m.eps, l2form)

    kh = np.arange(nv) % nk                                        # tiled head mapping
    S = np.zeros((nv, dk, dv))                                     # S[j][i=k][v]
    o = np.empty((T, nv, dv))
    for t in range(T):
        qq = q[t, kh, :]                                           # [nv, dk]
        kk_ = k[t, kh, :]
        S *= np.exp(g[t])[:, None, None]
        kv = np.einsum("jiv,ji->jv", S, kk_)
        d = beta[t][:, None] * (v[t] - kv)
        S += kk_[:, :, None] * d[:, None, :]
        o[t] = np.einsum("jiv,ji->jv", S, qq)
    y = rmsnorm(o, m.w(pfx + "ssm_norm.weight"), m.eps) * silu(z)
    return y.reshape(T, nv * dv) @ m.w(pfx + "ssm_out.weight").T


def output_weight(m: Model) -> np.ndarray:
    return m.w("output.weight") if m.has("output.weight") else m.w("token_embd.weight")


def forward(m: Model, tokens, pos=None, l2form: str = "max"):
    """Trunk forward over a fresh sequence. Returns (logits [T, n_vocab], h_nextn [T, n_embd])."""
    _check_sections(m)
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    pos = np.arange(T) if pos is None else np.asarray(pos)
    x = m.w("token_embd.weight")[tokens].copy()                    # no embedding scale
    for il in range(m.n_layer):
        pfx = f"blk.{il}."
        hn = rmsnorm(x, m.w(pfx + "attn_norm.weight"), m.eps)
        a = gdn(m, pfx, hn, l2form) if m.is_recr(il) else attn_full(m, pfx, hn, pos)
        x = x + a
        x = x + ffn(m, pfx, rmsnorm(x, m.w(pfx + "post_attention_norm.weight"), m.eps))
    h_nextn = rmsnorm(x, m.w("output_norm.weight"), m.eps)
    logits = h_nextn @ output_weight(m).T
    return logits, h_nextn


def has_mtp(m: Model) -> bool:
    return m.n_nextn > 0 and m.has(f"blk.{m.n_layer}.nextn.eh_proj.weight")


def mtp_forward(m: Model, tokens, h_prev_rows, pos=None):
    """§6 MTP block at index n_layer over rows p=0..T-1: row p gets token x_p and the target's
    h_{p-1} (h_prev_rows[p]); the block's attention is causal over these rows with a fresh KV,
    positions = token positions (default 0..T-1). Returns (logits [T, n_vocab], h' [T, n_embd])."""
    if not has_mtp(m):
        raise ValueError("model has no MTP block")
    _check_sections(m)
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    hprev = np.asarray(h_prev_rows, dtype=np.float64).reshape(T, m.n_embd)
    pos = np.arange(T) if pos is None else np.asarray(pos)
    il = m.n_layer
    pfx = f"blk.{il}."
    emb_name = pfx + "nextn.embed_tokens.weight"
    emb = m.w(emb_name) if m.has(emb_name) else m.w("token_embd.weight")
    e = rmsnorm(emb[tokens], m.w(pfx + "nextn.enorm.weight"), m.eps)
    hh = rmsnorm(hprev, m.w(pfx + "nextn.hnorm.weight"), m.eps)
    c = np.concatenate([e, hh], axis=1) @ m.w(pfx + "nextn.eh_proj.weight").T   # embedding half first
    c = c + attn_full(m, pfx, rmsnorm(c, m.w(pfx + "attn_norm.weight"), m.eps), pos)
    c = c + ffn(m, pfx, rmsnorm(c, m.w(pfx + "post_attention_norm.weight"), m.eps))
    nname = pfx + "nextn.shared_head_norm.weight"
    h_out = rmsnorm(c, m.w(nname) if m.has(nname) else m.w("output_norm.weight"), m.eps)
    hname = pfx + "nextn.shared_head_head.weight"
    head = m.w(hname) if m.has(hname) else output_weight(m)
    return h_out @ head.T, h_out


def mtp_shifted_h(h_nextn: np.ndarray) -> np.ndarray:
    """Rows for the MTP pass over a fresh prompt: row p gets h_{p-1}; row 0 gets zeros
    (llama.cpp's draft-mtp starts with pending_h = 0 for a new sequence)."""
    hp = np.zeros_like(h_nextn)
    hp[1:] = h_nextn[:-1]
    return hp


def nmse(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.sum((a - b) ** 2) / np.sum(b ** 2))


if __name__ == "__main__":
    path = sys.argv[1]
    toks = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 3]
    mm = load(path)
    lg, hn = forward(mm, toks)
    print("logits", lg.shape, "argmax", lg.argmax(-1).tolist())
    if has_mtp(mm):
        ml, mh = mtp_forward(mm, toks, mtp_shifted_h(hn))
        print("mtp argmax", ml.argmax(-1).tolist())
