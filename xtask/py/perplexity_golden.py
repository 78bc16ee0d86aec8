#!/usr/bin/env python3
"""Record stock llama.cpp's perplexity golden: llama-perplexity's figure on a model and text at
fixed settings, and llama.cpp's tokenization of the text, for tests/perplexity.rs.

Usage (the venv with llama-cpp-python 0.3.36; `cargo xtask goldens` runs it):

    python xtask/py/perplexity_golden.py --llama-bin /path/to/llama.cpp/build/bin \
        --model fixtures/demo/demo-f16.gguf --text fixtures/demo/heldout.txt \
        --out fixtures/golden/perplexity.json

For each setting it runs `llama-perplexity -m MODEL -f TEXT -c CTX -b BATCH [--chunks N]`
(CPU, stock defaults otherwise: F16 KV cache) and parses the running `[i]x` values and the
`Final estimate: PPL = x +/- e` line. The tokens are llama.cpp's own (`Llama.tokenize` with
add_bos as llama-perplexity's `common_tokenize(ctx, text, true)`, special text not parsed, after
dropping one trailing newline as `-f` does), stored as a count and a sha256 of the u32 LE ids.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

# The settings recorded. "ci" is what tests/perplexity.rs checks on every run (a few seconds);
# "full" is the whole held-out text, checked by the ignored test of the same file.
SETTINGS = [
    {"name": "ci", "ctx": 256, "batch": 2048, "chunks": 32},
    {"name": "full", "ctx": 256, "batch": 2048, "chunks": None},
]

FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
RUNNING = re.compile(r"\[(\d+)\]([0-9.]+|nan|inf),")
PLAN = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)")


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def llama_tokens(model: Path, text: str) -> list[int]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(model), vocab_only=True, verbose=False)
    # add_bos=True is common_tokenize's add_special: llama.cpp adds BOS only when the vocabulary
    # asks for it (tokenizer.ggml.add_bos_token).
    return list(llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))


def run_perplexity(binary: Path, model: Path, text: Path, s: dict, threads: int) -> dict:
    cmd = [str(binary), "-m", str(model), "-f", str(text), "-c", str(s["ctx"]), "-b", str(s["batch"]),
           "-t", str(threads), "-ngl", "0"]
    if s["chunks"] is not None:
        cmd += ["--chunks", str(s["chunks"])]
    print("running", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    out = p.stdout + "\n" + p.stderr
    if p.returncode != 0:
        sys.stderr.write(out[-4000:])
        raise SystemExit(f"llama-perplexity failed ({p.returncode})")
    m = FINAL.search(out)
    if not m:
        sys.stderr.write(out[-4000:])
        raise SystemExit("no 'Final estimate' line in llama-perplexity's output")
    plan = PLAN.search(out)
    running = [float(v) for _, v in RUNNING.findall(p.stdout)]
    return {
        **s,
        "command": ["llama-perplexity"] + cmd[1:],
        "ppl": float(m.group(1)),
        "ppl_err": float(m.group(2)),
        "n_chunk": int(plan.group(1)) if plan else None,
        "n_seq": int(plan.group(4)) if plan else None,
        "running": running,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", required=True, help="directory with llama-perplexity")
    ap.add_argument("--model", default="fixtures/demo/demo-f16.gguf")
    ap.add_argument("--text", default="fixtures/demo/heldout.txt")
    ap.add_argument("--out", default="fixtures/golden/perplexity.json")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()

    binary = Path(args.llama_bin) / "llama-perplexity"
    if not binary.exists():
        raise SystemExit(f"{binary} not found (set TERN_LLAMA_BIN to llama.cpp's build/bin)")
    model, text_path = Path(args.model), Path(args.text)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    version = (version.stdout + version.stderr).strip().splitlines()

    raw = text_path.read_bytes()
    text = raw.decode("utf-8")
    if text.endswith("\n"):
        text = text[:-1]
    ids = llama_tokens(model, text)
    runs = [run_perplexity(binary, model, text_path, s, args.threads) for s in SETTINGS]
    for r in runs:
        print(f"{r['name']}: PPL = {r['ppl']} +/- {r['ppl_err']} ({r['n_chunk']} chunks of {r['ctx']})")

    golden = {
        "generator": "xtask/py/perplexity_golden.py (cargo xtask goldens)",
        "llama_cpp_version": [l for l in version if "version" in l.lower()][:2],
        "date": _dt.date.today().isoformat(),
        "model": {"file": model.name, "sha256": sha256_file(model)},
        "text": {"file": text_path.name, "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)},
        "tokens": {"count": len(ids),
                   "sha256_u32le": hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest(),
                   "first": ids[:16]},
        "kv": "f16 (llama-perplexity's default)",
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(golden, indent=2) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
