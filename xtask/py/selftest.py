#!/usr/bin/env python3
"""Self-test of reference.py / goldens.py against stock llama.cpp, on tiny random qwen35 files
made by make_test_model.py (no Rust needed). Exit status 0 when every check passes.

    /root/llvenv/bin/python xtask/py/selftest.py [--keep DIR] [--tokens 70]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_test_model  # noqa: E402
import goldens  # noqa: E402

VARIANTS = [
    # file, make_test_model args
    ("t-f32.gguf", ["--seed", "10"]),                                        # tied, MTP, n_k<n_v, GQA, partial rope
    ("t-q8_0.gguf", ["--seed", "11", "--untied", "--ftype", "q8_0"]),
    ("t-f16.gguf", ["--seed", "12", "--ftype", "f16", "--no-mtp", "--n-k", "4", "--n-v", "4",
                    "--n-head-kv", "1", "--interval", "2", "--n-rot", "32"]),     # MQA, full-width rope
    ("t-bf16.gguf", ["--seed", "13", "--ftype", "bf16"]),
    ("t-q4_0.gguf", ["--seed", "14", "--ftype", "q4_0", "--n-k", "1", "--n-v", "4"]),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", type=Path, help="build in this dir and keep it")
    ap.add_argument("--tokens", type=int, default=70)
    a = ap.parse_args(argv)
    import numpy as np

    d = a.keep or Path(tempfile.mkdtemp(prefix="tern-py-selftest-"))
    d.mkdir(parents=True, exist_ok=True)
    try:
        rng = np.random.default_rng(7)
        fx = []
        for name, args in VARIANTS:
            make_test_model.main([str(d / name)] + args)
            n_vocab = len(make_test_model.build_vocab()[0])
            fx.append({"file": name, "twin": None, "tokens": rng.integers(0, n_vocab, a.tokens).tolist(),
                       "sha256": hashlib.sha256((d / name).read_bytes()).hexdigest()})
        (d / "manifest.json").write_text(json.dumps({"fixtures": fx}, indent=1))
        rc = goldens.main(["--fixtures", str(d), "--out", str(d / "golden")])
        man = json.loads((d / "golden" / "manifest.json").read_text())
        for r in man["fixtures"]:
            mtp = r["mtp"] or {}
            print(f"{r['file']:24s} ref-vs-exact {r['reference_vs_exact_nmse']:.2e}  "
                  f"llama-vs-exact {r['llama'].get('vs_exact_nmse', 0.0):.2e}  "
                  f"mtp ref-vs-llama.cpp {mtp.get('llama_cpp_mtp_vs_reference_nmse', float('nan')):.2e}")
        print("OK" if rc == 0 else "FAILED")
        return rc
    finally:
        if a.keep is None:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
