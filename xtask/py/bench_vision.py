#!/usr/bin/env python3
"""Stock llama.cpp anchor for `cargo xtask bench --vision`: encode one image with a projector
through llama-cpp-python's `llama_cpp.mtmd_cpp` (what llama-server and llama-mtmd-cli run), on the
CPU with n_threads as given and llama.cpp's own defaults otherwise (flash attention auto, the
warm-up encode at init). Times `mtmd_encode_chunk` alone (the image was decoded and resized by
`mtmd_tokenize` before), median of R runs. Prints one JSON object on stdout.

    python bench_vision.py MODEL.gguf MMPROJ.gguf IMAGE.png --runs 5 --threads 2
"""
import argparse
import ctypes
import json
import statistics
import time

import llama_cpp
from llama_cpp import llama_cpp as C
from llama_cpp import mtmd_cpp as M


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("mmproj")
    ap.add_argument("image")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    llama_cpp.llama_backend_init()
    model = C.llama_model_load_from_file(a.model.encode(), C.llama_model_default_params())
    if not model:
        raise SystemExit(f"cannot load {a.model}")
    mp = M.mtmd_context_params_default()
    mp.use_gpu = False
    mp.n_threads = a.threads
    mp.print_timings = False
    mctx = M.mtmd_init_from_file(a.mmproj.encode(), model, mp)
    if not mctx:
        raise SystemExit(f"mtmd_init_from_file failed on {a.mmproj}")
    bmp = M.mtmd_helper_bitmap_init_from_file(mctx, a.image.encode(), False)
    if not bmp:
        raise SystemExit(f"cannot decode {a.image}")
    chunks = M.mtmd_input_chunks_init()
    text = M.mtmd_input_text()
    text.text = b"<__media__>"
    text.text_len = len(text.text)
    text.add_special = False
    text.parse_special = True
    bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(bmp)
    if M.mtmd_tokenize(mctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
        raise SystemExit("mtmd_tokenize failed")
    image = None
    for i in range(M.mtmd_input_chunks_size(chunks)):
        ch = M.mtmd_input_chunks_get(chunks, i)
        if M.mtmd_input_chunk_get_type(ch) != M.MTMD_INPUT_CHUNK_TYPE_TEXT:
            image = ch
    if image is None:
        raise SystemExit("no image chunk")
    n_tok = int(M.mtmd_input_chunk_get_n_tokens(image))
    secs = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        if M.mtmd_encode_chunk(mctx, image) != 0:
            raise SystemExit("mtmd_encode_chunk failed")
        secs.append(time.perf_counter() - t0)
    med = statistics.median(secs)
    print(json.dumps({
        "engine": "llama.cpp",
        "version": llama_cpp.__version__,
        "threads": a.threads,
        "image_tokens": n_tok,
        "encode_ms": [s * 1e3 for s in secs],
        "encode_ms_median": med * 1e3,
        "image_tokens_per_s": n_tok / med,
    }))
    M.mtmd_bitmap_free(bmp)
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_free(mctx)
    C.llama_model_free(model)


if __name__ == "__main__":
    main()
