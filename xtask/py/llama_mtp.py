#!/usr/bin/env python3
"""Drive stock llama.cpp's own MTP graph (LLAMA_CONTEXT_TYPE_MTP, `graph_mtp`) through ctypes.

llama-cpp-python 0.3.36 does not wrap the MTP API, but its libllama exports it: the C functions
`llama_batch_ext_*` / `llama_process`, and the staging C++ functions from src/llama-ext.h
(`llama_set_embeddings_nextn`, `llama_get_embeddings_nextn_ith`), which are *not* extern "C" and
are looked up here by their Itanium-mangled names.

This is used only as an independent cross-check of reference.mtp_forward (the MTP golden itself
comes from reference.py): each row p gets token x_p, position p and the given h row, exactly like
common/speculative.cpp `common_speculative_impl_draft_mtp::process()` on a fresh sequence.
"""
from __future__ import annotations

import ctypes

import numpy as np
import llama_cpp
from llama_cpp import llama_cpp as C

GGML_TYPE_F32 = 0


class llama_embd(ctypes.Structure):
    _fields_ = [("data", ctypes.POINTER(ctypes.c_float)), ("n_rows", ctypes.c_size_t), ("n_embd", ctypes.c_size_t)]


def _lib():
    lib = C._lib
    f = lib.llama_batch_ext_init; f.argtypes = [ctypes.c_void_p]; f.restype = ctypes.c_void_p
    f = lib.llama_batch_ext_free; f.argtypes = [ctypes.c_void_p]; f.restype = None
    f = lib.llama_batch_ext_add_token; f.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]; f.restype = ctypes.c_int32
    f = lib.llama_batch_ext_set_pos; f.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)]; f.restype = ctypes.c_bool
    f = lib.llama_batch_ext_set_embd_token; f.argtypes = [ctypes.c_void_p, ctypes.c_int32, llama_embd]; f.restype = ctypes.c_bool
    f = lib.llama_batch_ext_set_output_logits; f.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool]; f.restype = ctypes.c_bool
    f = lib.llama_process; f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]; f.restype = ctypes.c_int32
    f = getattr(lib, "_Z26llama_set_embeddings_nextnP13llama_contextbb")
    f.argtypes = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool]; f.restype = None
    f = getattr(lib, "_Z30llama_get_embeddings_nextn_ithP13llama_contexti")
    f.argtypes = [ctypes.c_void_p, ctypes.c_int32]; f.restype = ctypes.POINTER(ctypes.c_float)
    return lib


def set_adapters(model, ctx, adapters) -> None:
    """Applies LoRA adapters [(path, scale)] to a context (llama_set_adapters_lora)."""
    if not adapters:
        return
    ptrs = []
    for path, _ in adapters:
        a = C.llama_adapter_lora_init(model, str(path).encode())
        if not a:
            raise RuntimeError(f"llama_adapter_lora_init failed for {path}")
        ptrs.append(a)
    arr = (C.llama_adapter_lora_p_ctypes * len(ptrs))(*ptrs)
    scales = (ctypes.c_float * len(ptrs))(*[float(s) for _, s in adapters])
    if C.llama_set_adapters_lora(ctx, arr, len(ptrs), scales):
        raise RuntimeError("llama_set_adapters_lora failed")


def mtp_eval(path: str, tokens, h_rows, n_threads: int = 2, kv_f32: bool = True, flash_attn: int | None = 0,
             adapters=()):
    """Returns (logits [T, n_vocab] f32, h' [T, n_embd] f32) from llama.cpp's MTP graph, with
    the LoRA adapters [(path, scale)] applied."""
    lib = _lib()
    tokens = [int(x) for x in tokens]
    T = len(tokens)
    llama_cpp.llama_backend_init()
    mp = C.llama_model_default_params()
    mp.load_mtp = True
    model = C.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path} with load_mtp=true")
    try:
        if C.llama_model_n_layer_nextn(model) < 1:
            raise RuntimeError("model has no nextn layers")
        n_embd = C.llama_model_n_embd(model)
        n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
        cp = C.llama_context_default_params()
        cp.n_ctx = max(256, T + 8)
        cp.n_batch = max(512, T)
        cp.n_ubatch = max(512, T)
        cp.n_seq_max = 1
        cp.n_threads = n_threads
        cp.n_threads_batch = n_threads
        cp.ctx_type = 1  # LLAMA_CONTEXT_TYPE_MTP
        if flash_attn is not None:
            cp.flash_attn_type = flash_attn
        if kv_f32:
            cp.type_k = GGML_TYPE_F32
            cp.type_v = GGML_TYPE_F32
        ctx = C.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError("llama_init_from_model (MTP context) failed")
        try:
            set_adapters(model, ctx, adapters)
            lib._Z26llama_set_embeddings_nextnP13llama_contextbb(ctx, True, True)
            h = np.ascontiguousarray(np.asarray(h_rows, dtype=np.float32).reshape(T, n_embd))
            batch = lib.llama_batch_ext_init(ctx)
            try:
                for p, tok in enumerate(tokens):
                    idx = lib.llama_batch_ext_add_token(batch, 0, tok)
                    if idx != p:
                        raise RuntimeError(f"llama_batch_ext_add_token -> {idx}")
                    pos = (ctypes.c_int32 * 4)(p, 0, 0, 0)
                    if not lib.llama_batch_ext_set_pos(batch, idx, pos):
                        raise RuntimeError("set_pos failed")
                    row = h[p]
                    e = llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd)
                    if not lib.llama_batch_ext_set_embd_token(batch, idx, e):
                        raise RuntimeError("set_embd_token failed")
                    lib.llama_batch_ext_set_output_logits(batch, idx, True)
                rc = lib.llama_process(ctx, 1, batch)  # LLAMA_PROCESS_TYPE_DECODE
                if rc != 0:
                    raise RuntimeError(f"llama_process returned {rc}")
                logits = np.empty((T, n_vocab), dtype=np.float32)
                hout = np.empty((T, n_embd), dtype=np.float32)
                for p in range(T):
                    lp = C.llama_get_logits_ith(ctx, p)
                    logits[p] = np.ctypeslib.as_array(lp, shape=(n_vocab,))
                    hp = lib._Z30llama_get_embeddings_nextn_ithP13llama_contexti(ctx, p)
                    hout[p] = np.ctypeslib.as_array(hp, shape=(n_embd,))
                return logits, hout
            finally:
                lib.llama_batch_ext_free(batch)
        finally:
            C.llama_free(ctx)
    finally:
        C.llama_model_free(model)
