#!/usr/bin/env python3
"""Stock llama.cpp anchor for `cargo xtask bench` (../shared/docs/bench.md).

Prefill = evaluate an N-token prompt; decode = D single-token evaluations after it; median of
R runs; n_threads as given. Prints one JSON object on stdout.

    python bench_llama.py MODEL.gguf --prompt-tokens 128 --decode 32 --runs 3 --threads 2
"""
import argparse
import json
import statistics
import time

import llama_cpp
from llama_cpp import Llama


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    n_ctx = a.prompt_tokens + a.decode + 16
    llm = Llama(model_path=a.model, n_ctx=n_ctx, n_batch=max(512, a.prompt_tokens),
                n_ubatch=512, n_threads=a.threads, n_threads_batch=a.threads,
                logits_all=False, verbose=False, seed=0)
    # The same deterministic token ids tern's bench uses: (i * 7919 + 13) % 200 + 256.
    prompt = [(i * 7919 + 13) % 200 + 256 for i in range(a.prompt_tokens)]
    pre, dec = [], []
    for _ in range(a.runs):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        tok = prompt[-1]
        for i in range(a.decode):
            llm.eval([(tok + i) % 200 + 256])
        t2 = time.perf_counter()
        pre.append(a.prompt_tokens / (t1 - t0))
        dec.append(a.decode / (t2 - t1))
    print(json.dumps({
        "engine": "llama.cpp",
        "version": llama_cpp.__version__,
        "threads": a.threads,
        "prefill_tokens": a.prompt_tokens,
        "prefill_tps": statistics.median(pre),
        "decode_tokens": a.decode,
        "decode_tps": statistics.median(dec),
    }))


if __name__ == "__main__":
    main()
