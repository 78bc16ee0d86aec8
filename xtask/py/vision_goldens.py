#!/usr/bin/env python3
"""Vision goldens from stock llama.cpp (llama-cpp-python 0.3.36's `llama_cpp.mtmd_cpp`), run by
`cargo xtask goldens [--vision-only]`.

For each projector of fixtures/vision/manifest.json and each test image: mtmd's decoded pixels
(their sha256: tern's decoder must give the same bytes), its token grid, the image embeddings
(`mtmd_encode_chunk` + `mtmd_get_output_embd`, float32 [n_image_tokens, n_embd]) and, for the
F32 projector on every image and the others on one, the text model's logits at every position of
PROMPT with the image in place of its marker (float32 [n_positions, n_vocab]): text chunks as
token batches, the image as an embedding batch at mtmd's M-RoPE positions, every output on.
Flash attention is off in the tower and the text model (it casts K/V to F16: model-vision.md §3)
and the KV cache is F32.

Writes fixtures/golden/vision/<projector>.<image>.embd.npy, .logits.npy and manifest.json, and
limits.json: the token grid mtmd gives each LIMITS case under custom --image-min-tokens /
--image-max-tokens (`--limits-only` writes just that).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import subprocess
import sys
from pathlib import Path

PROMPT = "<|im_start|>user\n<__media__>What is the dog?<|im_end|>\n<|im_start|>assistant\n"
# Logits for every image with this projector, and for LOGITS_IMAGE with the others.
LOGITS_PROJECTOR = "mmproj-f32.gguf"
LOGITS_IMAGE = "wide-100x37.jpg"
GGML_TYPE_F32 = 0


def worker(job: dict) -> dict:
    import numpy as np
    import llama_cpp
    from llama_cpp import llama_cpp as C
    from llama_cpp import mtmd_cpp as M

    llama_cpp.llama_backend_init()
    mp = C.llama_model_default_params()
    model = C.llama_model_load_from_file(job["model"].encode(), mp)
    if not model:
        raise RuntimeError(f"cannot load {job['model']}")
    mparams = M.mtmd_context_params_default()
    mparams.use_gpu = False
    mparams.n_threads = 2
    mparams.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_DISABLED
    mparams.warmup = False
    mctx = M.mtmd_init_from_file(job["mmproj"].encode(), model, mparams)
    if not mctx:
        raise RuntimeError(f"mtmd_init_from_file failed on {job['mmproj']}")
    img = Path(job["image"])
    raw = Path(str(img) + ".rgb")
    if raw.exists():
        # stb_image reads no WebP: give mtmd the lossless file's exact pixels.
        data = raw.read_bytes()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bmp = M.mtmd_bitmap_init(job["width"], job["height"], buf)
    else:
        bmp = M.mtmd_helper_bitmap_init_from_file(mctx, str(img).encode(), False)
    if not bmp:
        raise RuntimeError(f"cannot decode {img}")
    nx, ny = M.mtmd_bitmap_get_nx(bmp), M.mtmd_bitmap_get_ny(bmp)
    nbytes = M.mtmd_bitmap_get_n_bytes(bmp)
    px = bytes(ctypes.cast(M.mtmd_bitmap_get_data(bmp), ctypes.POINTER(ctypes.c_uint8 * nbytes)).contents)
    out = {"decoded": [nx, ny], "pixels_sha256": hashlib.sha256(px).hexdigest()}

    chunks = M.mtmd_input_chunks_init()
    text = M.mtmd_input_text()
    text.text = PROMPT.encode()
    text.text_len = len(PROMPT.encode())
    text.add_special = False
    text.parse_special = True
    bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(bmp)
    if M.mtmd_tokenize(mctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
        raise RuntimeError("mtmd_tokenize failed")
    parts = []
    for i in range(M.mtmd_input_chunks_size(chunks)):
        ch = M.mtmd_input_chunks_get(chunks, i)
        if M.mtmd_input_chunk_get_type(ch) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            p = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
            parts.append(("text", [int(p[k]) for k in range(n.value)]))
        else:
            it = M.mtmd_input_chunk_get_tokens_image(ch)
            gx, gy = M.mtmd_image_tokens_get_nx(it), M.mtmd_image_tokens_get_ny(it)
            if M.mtmd_encode_chunk(mctx, ch) != 0:
                raise RuntimeError("mtmd_encode_chunk failed")
            n_tok = M.mtmd_input_chunk_get_n_tokens(ch)
            n_embd = C.llama_model_n_embd(model)
            e = np.ctypeslib.as_array(M.mtmd_get_output_embd(mctx), shape=(n_tok * n_embd,))
            embd = e.reshape(n_tok, n_embd).astype(np.float32).copy()
            np.save(job["embd_out"], embd)
            out.update({"grid": [gy, gx], "n_image_tokens": n_tok,
                        "n_pos": int(M.mtmd_input_chunk_get_n_pos(ch))})
            parts.append(("image", embd))
    # The prompt as token ids, an image position as -1.
    out["tokens"] = [t for kind, v in parts for t in (v if kind == "text" else [-1] * len(v))]

    if job.get("logits_out"):
        cp = C.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 1024, 1024, 1024, 1
        cp.n_threads = cp.n_threads_batch = 2
        cp.type_k = cp.type_v = GGML_TYPE_F32
        cp.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = C.llama_init_from_model(model, cp)
        n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
        rows = []
        n_past = 0
        for kind, v in parts:
            n = len(v)
            batch = C.llama_batch()
            batch.n_tokens = n
            n_seq = (ctypes.c_int32 * n)(*([1] * n))
            seq0 = ctypes.c_int32(0)
            seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * n)(*([ctypes.pointer(seq0)] * n))
            logits = (ctypes.c_int8 * n)(*([1] * n))
            if kind == "text":
                toks = (C.llama_token * n)(*v)
                pos = (C.llama_pos * n)(*range(n_past, n_past + n))
                batch.token = toks
                n_past += n
            else:
                gy, gx = out["grid"]
                flat = np.ascontiguousarray(v, dtype=np.float32)
                emb = flat.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                # mtmd's layout: [t..., y..., x..., z...] (set_position_mrope_2d).
                p4 = [n_past] * n + [n_past + k // gx for k in range(n)] + \
                     [n_past + k % gx for k in range(n)] + [0] * n
                pos = (C.llama_pos * (4 * n))(*p4)
                batch.embd = emb
                n_past += out["n_pos"]
            batch.pos = pos
            batch.n_seq_id = n_seq
            batch.seq_id = seq_ptrs
            batch.logits = logits
            if C.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for k in range(n):
                rows.append(np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, k), shape=(n_vocab,)).copy())
        np.save(job["logits_out"], np.stack(rows).astype(np.float32))
        out["n_positions"] = len(rows)
        out["next_pos"] = n_past
        C.llama_free(ctx)
    M.mtmd_bitmap_free(bmp)
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_free(mctx)
    C.llama_model_free(model)
    return out


# (image, --image-min-tokens, --image-max-tokens): llama.cpp's token grid under custom limits
# (0 keeps the projector's own 8..4096). Large images under a small maximum, small ones under a
# large minimum, min = max where the upscale overshoots the maximum (the rule does not re-check
# it), and a maximum under the projector's minimum (refused).
LIMITS = [
    ("red-512.png", 0, 10),
    ("red-512.png", 0, 64),
    ("grad-200x120.gif", 0, 16),
    ("grad-200x120.gif", 0, 7),
    ("wide-100x37.jpg", 64, 0),
    ("noise-96.png", 64, 0),
    ("tall-45x70.webp", 1024, 2048),
    ("red-512.png", 300, 300),
]


def limits_worker(job: dict) -> dict:
    import llama_cpp
    from llama_cpp import llama_cpp as C
    from llama_cpp import mtmd_cpp as M

    llama_cpp.llama_backend_init()
    model = C.llama_model_load_from_file(job["model"].encode(), C.llama_model_default_params())
    if not model:
        raise RuntimeError(f"cannot load {job['model']}")
    out = []
    for c in job["cases"]:
        mparams = M.mtmd_context_params_default()
        mparams.use_gpu = False
        mparams.n_threads = 2
        mparams.warmup = False
        mparams.image_min_tokens = c["min_tokens"]
        mparams.image_max_tokens = c["max_tokens"]
        mctx = M.mtmd_init_from_file(job["mmproj"].encode(), model, mparams)
        img = Path(c["path"])
        if not mctx:
            # A maximum under the minimum (the projector's 8 when unset): mtmd refuses it.
            out.append({"image": img.name, "min_tokens": c["min_tokens"],
                        "max_tokens": c["max_tokens"], "refused": True})
            continue
        raw = Path(str(img) + ".rgb")
        if raw.exists():
            data = raw.read_bytes()
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            bmp = M.mtmd_bitmap_init(c["width"], c["height"], buf)
        else:
            bmp = M.mtmd_helper_bitmap_init_from_file(mctx, str(img).encode(), False)
        chunks = M.mtmd_input_chunks_init()
        text = M.mtmd_input_text()
        text.text = b"<__media__>"
        text.text_len = len(text.text)
        text.add_special = False
        text.parse_special = True
        bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(bmp)
        if M.mtmd_tokenize(mctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
            raise RuntimeError("mtmd_tokenize failed")
        for i in range(M.mtmd_input_chunks_size(chunks)):
            ch = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(ch) != M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                it = M.mtmd_input_chunk_get_tokens_image(ch)
                gx, gy = M.mtmd_image_tokens_get_nx(it), M.mtmd_image_tokens_get_ny(it)
                out.append({"image": img.name, "min_tokens": c["min_tokens"],
                            "max_tokens": c["max_tokens"], "grid": [gy, gx],
                            "n_image_tokens": int(M.mtmd_input_chunk_get_n_tokens(ch))})
        M.mtmd_bitmap_free(bmp)
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_free(mctx)
    C.llama_model_free(model)
    return {"cases": out}


def record_limits(vdir: Path, man: dict, out: Path, tmp: Path) -> None:
    """Writes limits.json: mtmd's token grid for LIMITS (the grid needs no encode)."""
    images = {i["file"]: i for i in man["images"]}
    job = {"model": str(vdir / man["text_model"]["file"]),
           "mmproj": str(vdir / man["projectors"][0]["file"]),
           "cases": [{"path": str(vdir / f), "width": images[f]["width"],
                      "height": images[f]["height"], "min_tokens": lo, "max_tokens": hi}
                     for f, lo, hi in LIMITS],
           "result": str(tmp / "limits.json"), "kind": "limits"}
    jp = tmp / "limits.job.json"
    jp.write_text(json.dumps(job))
    p = subprocess.run([sys.executable, __file__, "--_worker", str(jp)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        raise SystemExit(f"llama.cpp failed on the token-limit cases (exit {p.returncode})")
    r = json.loads(Path(job["result"]).read_text())
    import llama_cpp
    for c in r["cases"]:
        print(f"limits {c['image']:<18} min {c['min_tokens']:>4} max {c['max_tokens']:>4} "
              f"grid {c.get('grid', 'refused')}")
    doc = {"generator": "cargo xtask goldens (xtask/py/vision_goldens.py, LIMITS)",
           "llama_cpp_python": llama_cpp.__version__,
           "projector": man["projectors"][0]["file"],
           "note": "mtmd_context_params.image_min_tokens / image_max_tokens (0: the "
                   "projector's own); grid is [rows, cols] of merged tokens",
           "cases": r["cases"]}
    (out / "limits.json").write_text(json.dumps(doc, indent=2) + "\n")


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="fixtures")
    ap.add_argument("--out", default="fixtures/golden/vision")
    ap.add_argument("--limits-only", action="store_true",
                    help="only limits.json (the token grids under custom limits)")
    ap.add_argument("--_worker")
    a = ap.parse_args()
    if a._worker:
        job = json.loads(Path(a._worker).read_text())
        run = limits_worker if job.get("kind") == "limits" else worker
        Path(job["result"]).write_text(json.dumps(run(job)))
        return
    vdir = Path(a.fixtures) / "vision"
    man = json.loads((vdir / "manifest.json").read_text())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path("target/vision-goldens")
    tmp.mkdir(parents=True, exist_ok=True)
    record_limits(vdir, man, out, tmp)
    if a.limits_only:
        return
    model = vdir / man["text_model"]["file"]
    cases = []
    for proj in man["projectors"]:
        for img in man["images"]:
            stem = f"{Path(proj['file']).stem}.{img['file']}"
            job = {"model": str(model), "mmproj": str(vdir / proj["file"]),
                   "image": str(vdir / img["file"]), "width": img["width"], "height": img["height"],
                   "embd_out": str(out / f"{stem}.embd.npy"), "result": str(tmp / f"{stem}.json")}
            if proj["file"] == LOGITS_PROJECTOR or img["file"] == LOGITS_IMAGE:
                job["logits_out"] = str(out / f"{stem}.logits.npy")
            jp = tmp / f"{stem}.job.json"
            jp.write_text(json.dumps(job))
            p = subprocess.run([sys.executable, __file__, "--_worker", str(jp)],
                               capture_output=True, text=True)
            if p.returncode != 0:
                sys.stderr.write(p.stderr[-4000:])
                raise SystemExit(f"llama.cpp failed on {stem} (exit {p.returncode})")
            r = json.loads(Path(job["result"]).read_text())
            r.update({"projector": proj["file"], "image": img["file"],
                      "embd": Path(job["embd_out"]).name,
                      "logits": Path(job["logits_out"]).name if "logits_out" in job else None})
            print(f"{stem:<40} decoded {r['decoded']} grid {r['grid']} tokens {r['n_image_tokens']}")
            cases.append(r)
    import llama_cpp
    manifest = {
        "generator": "cargo xtask goldens (xtask/py/vision_goldens.py)",
        "llama_cpp_python": llama_cpp.__version__,
        "prompt": PROMPT,
        "text_model": {"file": man["text_model"]["file"], "sha256": sha256_file(model)},
        "projectors": {p["file"]: sha256_file(vdir / p["file"]) for p in man["projectors"]},
        "images": {i["file"]: sha256_file(vdir / i["file"]) for i in man["images"]},
        "flash_attn": False,
        "kv_type": "F32",
        "cases": cases,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    main()
