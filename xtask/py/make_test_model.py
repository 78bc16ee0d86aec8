#!/usr/bin/env python3
"""Write a tiny random `qwen35` GGUF (for testing reference.py / goldens.py only).

The Rust fixture generator (`cargo xtask fixtures`) is the real source of fixtures;
this script exists so the Python side can be proven against stock llama.cpp on its own.
It emits exactly the metadata keys / tensor names / value types that stock llama.cpp
(llama-cpp-python 0.3.36) accepts for `qwen35`; see the list in KEYS_DOC below.

    python make_test_model.py OUT.gguf [--seed 0] [--untied] [--no-mtp] [--ftype f32|f16|bf16|q8_0|q4_0]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import gguf
from gguf import GGUFWriter, GGMLQuantizationType, GGUFValueType

KEYS_DOC = """
general.architecture            string  "qwen35"   (GGUFWriter writes it)
general.name                    string  (optional)
general.file_type               u32     0=F32 1=F16 7=Q8_0 2=Q4_0 32=BF16 (informational)
general.quantization_version    u32     2 (only when quantized tensors present)
qwen35.block_count              u32     n_layer + nextn_predict_layers
qwen35.context_length           u32
qwen35.embedding_length         u32
qwen35.feed_forward_length      u32
qwen35.attention.head_count     u32
qwen35.attention.head_count_kv  u32
qwen35.attention.key_length     u32     head_dim
qwen35.attention.value_length   u32     head_dim
qwen35.attention.layer_norm_rms_epsilon f32
qwen35.rope.freq_base           f32
qwen35.rope.dimension_count     u32     n_rot
qwen35.rope.dimension_sections  array[i32] of length exactly 4, e.g. [11,11,10,0]
qwen35.full_attention_interval  u32
qwen35.ssm.conv_kernel          u32
qwen35.ssm.state_size           u32     d_k = d_v
qwen35.ssm.group_count          u32     n_k
qwen35.ssm.time_step_rank       u32     n_v
qwen35.ssm.inner_size           u32     n_v * d_v
qwen35.nextn_predict_layers     u32     (optional)
tokenizer.ggml.model            string  "gpt2"
tokenizer.ggml.pre              string  "qwen35"
tokenizer.ggml.tokens           array[string]  (len == token_embd rows)
tokenizer.ggml.token_type       array[i32]     1 normal, 3 control (optional for loading)
tokenizer.ggml.merges           array[string]  "a b" (required for gpt2)
tokenizer.ggml.eos_token_id     u32
tokenizer.ggml.padding_token_id u32
tokenizer.ggml.add_bos_token    bool
"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (same as HF/llama.cpp)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


MERGES = ["Ġ t", "h e", "i n", "Ġ a", "e r", "o n", "Ġt he", "r e", "Ġ s", "a n", "Ġ w", "o u",
          "Ċ Ċ", "Ġ Ġ", "Ġ 1", "l l", "' t", "Ġ i"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_vocab() -> tuple[list[str], list[int], list[str]]:
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [1] * 256
    for m in MERGES:
        a, b = m.split(" ")
        tokens.append(a + b)
        types.append(1)
    for s in SPECIALS:
        tokens.append(s)
        types.append(3)
    assert len(set(tokens)) == len(tokens)
    return tokens, types, list(MERGES)


FTYPE = {"f32": (GGMLQuantizationType.F32, 0), "f16": (GGMLQuantizationType.F16, 1),
         "bf16": (GGMLQuantizationType.BF16, 32), "q8_0": (GGMLQuantizationType.Q8_0, 7),
         "q4_0": (GGMLQuantizationType.Q4_0, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--untied", action="store_true", help="write output.weight (default: tied to token_embd)")
    ap.add_argument("--no-mtp", action="store_true", help="no MTP block (nextn_predict_layers absent)")
    ap.add_argument("--mtp-key-only", action="store_true", help="nextn_predict_layers=1 but no MTP tensors")
    ap.add_argument("--ftype", default="f32", choices=sorted(FTYPE))
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--n-k", type=int, default=2)
    ap.add_argument("--n-v", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-head-kv", type=int, default=2)
    ap.add_argument("--n-rot", type=int, default=16)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-ff", type=int, default=96)
    ap.add_argument("--d-state", type=int, default=16)
    ap.add_argument("--d-conv", type=int, default=4)
    a = ap.parse_args(argv)

    rng = np.random.default_rng(a.seed)
    tokens, toktypes, merges = build_vocab()
    n_vocab = len(tokens)
    E, FF, L = a.n_embd, a.n_ff, a.n_layer
    hd, nh, nkv = a.head_dim, a.n_head, a.n_head_kv
    dk = dv = a.d_state
    nk, nv, K = a.n_k, a.n_v, a.d_conv
    conv_dim = 2 * nk * dk + nv * dv
    n_mtp = 0 if a.no_mtp else 1
    eps = 1e-6
    qtype, ftype_id = FTYPE[a.ftype]

    w = GGUFWriter(a.out, "qwen35")
    w.add_name("tern-py-test-qwen35")
    w.add_file_type(ftype_id)
    if qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(L + n_mtp)
    w.add_context_length(4096)
    w.add_embedding_length(E)
    w.add_feed_forward_length(FF)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(10000000.0)
    w.add_rope_dimension_count(a.n_rot)
    w.add_rope_dimension_sections([11, 11, 10, 0])  # array[i32], length 4
    w.add_full_attention_interval(a.interval)
    w.add_ssm_conv_kernel(K)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(nv * dv)
    if n_mtp or a.mtp_key_only:
        w.add_nextn_predict_layers(1)
        if a.mtp_key_only:
            n_mtp = 0
            # block_count must include the MTP layer index even without tensors
            w.add_block_count(L + 1)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)

    def mat(n_out, n_in, scale=1.0):  # numpy (n_out, n_in) == ggml {n_in, n_out}
        return (rng.standard_normal((n_out, n_in)) * scale / np.sqrt(n_in)).astype(np.float32)

    def normw(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    def put(name, arr, quant=True):
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        t = qtype if (quant and arr.ndim == 2) else GGMLQuantizationType.F32
        if t == GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        elif t == GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            q = gguf.quants.quantize(arr, t)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=t)

    put("token_embd.weight", rng.standard_normal((n_vocab, E)).astype(np.float32))
    put("output_norm.weight", normw(E), quant=False)
    if a.untied:
        put("output.weight", mat(n_vocab, E, 2.0))

    def attn_block(i):
        put(f"blk.{i}.attn_q.weight", mat(2 * nh * hd, E))
        put(f"blk.{i}.attn_k.weight", mat(nkv * hd, E))
        put(f"blk.{i}.attn_v.weight", mat(nkv * hd, E))
        put(f"blk.{i}.attn_output.weight", mat(E, nh * hd))
        put(f"blk.{i}.attn_q_norm.weight", normw(hd), quant=False)
        put(f"blk.{i}.attn_k_norm.weight", normw(hd), quant=False)

    def ffn_block(i):
        put(f"blk.{i}.ffn_gate.weight", mat(FF, E))
        put(f"blk.{i}.ffn_up.weight", mat(FF, E))
        put(f"blk.{i}.ffn_down.weight", mat(E, FF))

    for i in range(L):
        put(f"blk.{i}.attn_norm.weight", normw(E), quant=False)
        put(f"blk.{i}.post_attention_norm.weight", normw(E), quant=False)
        if (i + 1) % a.interval == 0:
            attn_block(i)
        else:
            put(f"blk.{i}.attn_qkv.weight", mat(conv_dim, E))
            put(f"blk.{i}.attn_gate.weight", mat(nv * dv, E))
            put(f"blk.{i}.ssm_beta.weight", mat(nv, E))
            put(f"blk.{i}.ssm_alpha.weight", mat(nv, E))
            # {d_conv, conv_dim}: numpy (conv_dim, d_conv); small ne0=4 -> keep F32 (not a multiple of 32)
            put(f"blk.{i}.ssm_conv1d.weight", (0.5 * rng.standard_normal((conv_dim, K))).astype(np.float32), quant=False)
            put(f"blk.{i}.ssm_dt.bias", (0.5 * rng.standard_normal(nv)).astype(np.float32), quant=False)
            put(f"blk.{i}.ssm_a", (-np.exp(rng.uniform(-1.5, 1.0, nv))).astype(np.float32), quant=False)
            put(f"blk.{i}.ssm_norm.weight", normw(dv), quant=False)
            put(f"blk.{i}.ssm_out.weight", mat(E, nv * dv))
        ffn_block(i)

    if n_mtp:
        i = L
        put(f"blk.{i}.attn_norm.weight", normw(E), quant=False)
        put(f"blk.{i}.post_attention_norm.weight", normw(E), quant=False)
        attn_block(i)
        ffn_block(i)
        put(f"blk.{i}.nextn.eh_proj.weight", mat(E, 2 * E))  # ggml {2*n_embd, n_embd}
        put(f"blk.{i}.nextn.enorm.weight", normw(E), quant=False)
        put(f"blk.{i}.nextn.hnorm.weight", normw(E), quant=False)
        put(f"blk.{i}.nextn.shared_head_norm.weight", normw(E), quant=False)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {a.out}: n_vocab={n_vocab} n_layer={L} mtp={n_mtp} ftype={a.ftype}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
