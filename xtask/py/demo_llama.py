#!/usr/bin/env python3
"""Stock llama.cpp (llama-cpp-python 0.3.36) on the demo model: tokenizes the prompts and
continues each greedily (argmax of the logits, no sampler), with an F32 KV cache.

Usage: python demo_llama.py --job JOB.json --out OUT.json
JOB = {"models": {"F16": path, ...}, "prompts": [text, ...], "n": 48}
OUT = {"llama_cpp_python": version, "runs": [{"model", "type", "prompt", "prompt_ids",
       "ids", "text"}]}
"""
import argparse
import json

import numpy as np
import llama_cpp
from llama_cpp import Llama

GGML_TYPE_F32 = 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    job = json.load(open(a.job))
    n = int(job["n"])
    runs = []
    for ty, path in job["models"].items():
        llm = Llama(model_path=path, logits_all=True, n_ctx=512, n_batch=512, n_threads=2,
                    verbose=False, seed=0, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
        for prompt in job["prompts"]:
            ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
            llm.reset()
            llm.eval(ids)
            out = []
            for _ in range(n):
                row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
                t = int(np.argmax(row))
                out.append(t)
                llm.eval([t])
            text = llm.detokenize(out).decode("utf-8", errors="replace")
            runs.append({"model": path.split("/")[-1], "type": ty, "prompt": prompt,
                         "prompt_ids": [int(i) for i in ids], "ids": out, "text": text})
        del llm
    json.dump({"llama_cpp_python": llama_cpp.__version__, "kv": "f32", "greedy": "argmax", "runs": runs},
              open(a.out, "w"), indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
