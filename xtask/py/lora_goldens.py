#!/usr/bin/env python3
"""LoRA goldens from stock llama.cpp (llama-cpp-python 0.3.36), run by `cargo xtask goldens`.

For each base model of fixtures/lora/manifest.json (tiny-f32.gguf, and tiny-pq2_0.gguf through
its F32 twin tiny-pq2_0.twin-f32.gguf, which `cargo xtask fixtures` writes: llama.cpp cannot load
PQ2_0, and the adapter was made for the unfolded model) and each adapter, llama.cpp's logits for
every position of the fixture's first N_TOKENS tokens, with an F32 KV cache (the exact f32 math),
at adapter scales 0, 0.5, 1 and 2; and one run with two adapters at once (the low-level
`llama_set_adapters_lora`). The MTP block's logits with the adapter come from llama.cpp's own
MTP graph (llama_mtp.py). The float64 NumPy reference (reference.py with the adapters merged into
its weights, W + s·B·A) checks both.

Writes fixtures/golden/lora/<base>.<adapter>.s<scale>.npy (float32 [N_TOKENS, n_vocab]),
<base>.combo.npy, <base>.<adapter>.s1.mtp.npy (llama.cpp's MTP graph, its input h rows in
.s1.mtp_hin.npy), and manifest.json with the NMSEs between
llama.cpp and the reference and between adapted and base logits.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import hashlib
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

N_TOKENS = 24
SCALES = [0.0, 0.5, 1.0, 2.0]
# Two adapters at once: (adapter index, scale).
COMBO = [(0, 1.0), (2, 0.5)]
GGML_TYPE_F32 = 0
# Greedy continuations for the server test (tests/server_lora.rs): the folded base, its first
# GREEDY_PROMPT tokens, GREEDY_N tokens, per case a list of (adapter index, scale).
GREEDY_BASE = "tiny-pq2_0.gguf"
GREEDY_PROMPT = 8
GREEDY_N = 12
GREEDY_CASES = {"base": [], "a0s1": [(0, 1.0)], "a1s2": [(1, 2.0)], "a0s0.5": [(0, 0.5)],
                "a0s1+a2s0.5": [(0, 1.0), (2, 0.5)]}
NMSE_MAX = 1e-6


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def nmse(a, b) -> float:
    import numpy as np
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-300))


def worker(job: dict) -> None:
    """One llama.cpp evaluation, in a child process (an abort costs one result, not the run).
    The model is loaded with its MTP layers (load_mtp), so that an adapter may name them: a
    plain load skips them and llama.cpp then refuses such an adapter."""
    import numpy as np
    import llama_cpp
    from llama_cpp import llama_cpp as C
    import llama_mtp

    adapters = list(zip(job["adapters"], job["scales"]))
    if job["kind"] == "greedy":
        Path(job["out"]).write_text(json.dumps(greedy(job["model"], job["tokens"], adapters, job["n"])))
        return
    if job["kind"] == "mtp":
        lg, hh = llama_mtp.mtp_eval(job["model"], job["tokens"], np.load(job["h"]), adapters=adapters)
        np.save(job["out"], lg)
        return
    toks = [int(t) for t in job["tokens"]]
    T = len(toks)
    llama_cpp.llama_backend_init()
    mp = C.llama_model_default_params()
    mp.load_mtp = True
    model = C.llama_model_load_from_file(job["model"].encode(), mp)
    if not model:
        raise RuntimeError(f"cannot load {job['model']}")
    cp = C.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 256, 256, 256, 1
    cp.n_threads = cp.n_threads_batch = 2
    cp.type_k = cp.type_v = GGML_TYPE_F32
    ctx = C.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    llama_mtp.set_adapters(model, ctx, adapters)
    batch = C.llama_batch_init(T, 0, 1)
    for i, t in enumerate(toks):
        batch.token[i] = t
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1
    batch.n_tokens = T
    if C.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    out = np.empty((T, n_vocab), dtype=np.float32)
    for i in range(T):
        out[i] = np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
    np.save(job["out"], out)
    C.llama_batch_free(batch)
    C.llama_free(ctx)
    C.llama_model_free(model)


def greedy(model_path: str, toks: list[int], adapters, n: int) -> dict:
    """llama.cpp's greedy continuation (F32 KV), one token at a time, with the top-2 margin of
    each step (a test can only demand equality where the margin is not a rounding tie) and the
    text as llama.cpp's token_to_piece gives it."""
    import numpy as np
    import llama_cpp
    from llama_cpp import llama_cpp as C
    import llama_mtp

    llama_cpp.llama_backend_init()
    mp = C.llama_model_default_params()
    mp.load_mtp = True
    model = C.llama_model_load_from_file(model_path.encode(), mp)
    cp = C.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 256, 256, 256, 1
    cp.n_threads = cp.n_threads_batch = 2
    cp.type_k = cp.type_v = GGML_TYPE_F32
    ctx = C.llama_init_from_model(model, cp)
    llama_mtp.set_adapters(model, ctx, adapters)
    vocab = C.llama_model_get_vocab(model)
    n_vocab = C.llama_vocab_n_tokens(vocab)
    eos = C.llama_vocab_eos(vocab)
    batch = C.llama_batch_init(len(toks), 0, 1)

    def decode(ids, pos0):
        for i, t in enumerate(ids):
            batch.token[i] = t
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if i == len(ids) - 1 else 0
        batch.n_tokens = len(ids)
        if C.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, len(ids) - 1), shape=(n_vocab,)).copy()

    logits = decode(toks, 0)
    out, margins, text = [], [], b""
    buf = ctypes.create_string_buffer(256)
    for k in range(n):
        order = np.argsort(-logits, kind="stable")
        t = int(order[0])
        margins.append(float(logits[order[0]] - logits[order[1]]))
        if t == eos:
            break
        out.append(t)
        m = C.llama_token_to_piece(vocab, t, buf, len(buf), 0, False)
        text += buf.raw[:m]
        logits = decode([t], len(toks) + k)
    C.llama_batch_free(batch)
    C.llama_free(ctx)
    C.llama_model_free(model)
    return {"tokens": out, "text": text.decode("utf-8", errors="replace"), "min_margin": min(margins)}


def f32_twin(src: Path, dst: Path) -> Path:
    """The adapter with every tensor dequantized to F32 (gguf-py's dequantizer, not ours).
    llama.cpp's CPU matmul rounds activations to F16 against F16 weights and to Q8 against
    Q8_0 ones, so its logits with a quantized adapter are not the adapter's exact math; its
    logits with the twin are (the same scheme as goldens.md's exact goldens)."""
    import numpy as np
    from gguf import GGUFReader, GGUFWriter
    from gguf.quants import dequantize

    r = GGUFReader(str(src))
    meta = {f.name: f for f in r.fields.values()}
    w = GGUFWriter(str(dst), "qwen35")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    alpha = meta["adapter.lora.alpha"]
    w.add_float32("adapter.lora.alpha", float(alpha.parts[alpha.data[0]][0]))
    for t in r.tensors:
        arr = dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, arr.reshape([int(d) for d in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def run(job: dict, tmp: Path) -> None:
    jp = tmp / f"job-{abs(hash(json.dumps(job, sort_keys=True)))}.json"
    jp.write_text(json.dumps(job))
    p = subprocess.run([sys.executable, __file__, "--_worker", str(jp)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama.cpp failed on {job}: {p.stderr[-2000:]}")


def reference(base: Path, adapters: list[tuple[Path, float]], tokens: list[int]):
    """reference.py's trunk and MTP with the adapters merged into the weights (float64)."""
    import numpy as np
    import reference as ref
    from gguf import GGUFReader

    m = ref.load(str(base))
    for path, scale in adapters:
        r = GGUFReader(str(path))
        alpha = 0.0
        for f in r.fields.values():
            if f.name == "adapter.lora.alpha":
                alpha = float(f.parts[f.data[0]][0])
        pairs: dict[str, dict[str, np.ndarray]] = {}
        for t in r.tensors:
            name, half = t.name.rsplit(".", 1)
            pairs.setdefault(name, {})[half] = ref.dequant_tensor(t)
        for name, p in pairs.items():
            a, b = p["lora_a"], p["lora_b"]          # (rank, n_in), (n_out, rank)
            rank = a.shape[0]
            s = np.float32(scale) * np.float32(alpha) / np.float32(rank) if alpha else scale
            m.add_delta(name, float(s) * (b @ a))
    logits, h = ref.forward(m, tokens)
    out = {"trunk": logits}
    if ref.has_mtp(m):
        hin = ref.mtp_shifted_h(h)
        mtp_logits, _ = ref.mtp_forward(m, tokens, hin)
        out["mtp"] = mtp_logits
        out["mtp_h_in"] = hin
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="fixtures")
    ap.add_argument("--out", default="fixtures/golden/lora")
    ap.add_argument("--_worker")
    ap.add_argument("--greedy-only", action="store_true",
                    help="only (re)record the greedy continuations into an existing manifest")
    a = ap.parse_args(argv)
    if a._worker:
        worker(json.loads(Path(a._worker).read_text()))
        return 0

    import numpy as np
    import llama_cpp

    fx_dir = Path(a.fixtures)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".tmp"
    tmp.mkdir(exist_ok=True)
    lora_manifest = json.loads((fx_dir / "lora" / "manifest.json").read_text())
    fixtures = {f["file"]: f for f in json.loads((fx_dir / "manifest.json").read_text())["fixtures"]}
    adapters = lora_manifest["adapters"]
    # What llama.cpp evaluates for each adapter: the file itself when all-F32, else its F32 twin.
    exact = {}
    for ad in adapters:
        src = fx_dir / "lora" / ad["file"]
        exact[ad["file"]] = src if ad["lora_a_type"] == "F32" else f32_twin(src, tmp / f"twin-{ad['file']}")
    gfx = fixtures[GREEDY_BASE]
    gmodel = fx_dir / (gfx["twin"] or gfx["file"])
    greedy_out = {"base": GREEDY_BASE, "evaluated": gmodel.name, "kv": "f32",
                  "prompt": gfx["tokens"][:GREEDY_PROMPT], "n": GREEDY_N, "cases": {}}
    for case, pairs in GREEDY_CASES.items():
        gp = tmp / f"greedy-{case}.json"
        run({"kind": "greedy", "model": str(gmodel), "tokens": greedy_out["prompt"], "n": GREEDY_N,
             "adapters": [str(exact[adapters[i]["file"]]) for i, _ in pairs],
             "scales": [sc for _, sc in pairs], "out": str(gp)}, tmp)
        g = json.loads(gp.read_text())
        g["adapters"] = [[adapters[i]["file"], sc] for i, sc in pairs]
        greedy_out["cases"][case] = g
        print(case, json.dumps(g))
    if a.greedy_only:
        mpath = out / "manifest.json"
        manifest = json.loads(mpath.read_text())
        manifest["greedy"] = greedy_out
        mpath.write_text(json.dumps(manifest, indent=1) + "\n")
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
        return 0
    bases = []
    for base_file in ["tiny-f32.gguf", "tiny-pq2_0.gguf"]:
        fx = fixtures[base_file]
        model = fx_dir / (fx["twin"] or fx["file"])
        if not model.exists():
            raise SystemExit(f"{model} is missing: run `cargo xtask fixtures` first")
        bases.append((Path(base_file).stem, model, fx["tokens"][:N_TOKENS], fx))

    results = []
    ok = True
    for stem, model, toks, fx in bases:
        base_out = tmp / f"{stem}.base.npy"
        run({"kind": "trunk", "model": str(model), "tokens": toks, "adapters": [], "scales": [], "out": str(base_out)}, tmp)
        base_logits = np.load(base_out)
        for ad in adapters:
            apath = exact[ad["file"]]
            astem = Path(ad["file"]).stem
            for s in SCALES:
                name = f"{stem}.{astem}.s{s:g}.npy"
                run({"kind": "trunk", "model": str(model), "tokens": toks, "adapters": [str(apath)],
                     "scales": [s], "out": str(out / name)}, tmp)
                got = np.load(out / name)
                r = {"base": fx["file"], "evaluated": model.name, "adapter": ad["file"],
                     "adapter_evaluated": apath.name, "scale": s,
                     "golden": name, "nmse_vs_base": nmse(got, base_logits)}
                if s == 0.0:
                    r["equals_base"] = bool(np.array_equal(got, base_logits))
                if s == 1.0:
                    refs = reference(model, [(apath, s)], toks)
                    r["reference_nmse"] = nmse(refs["trunk"], got)
                    ok &= r["reference_nmse"] <= NMSE_MAX
                    if "mtp" in refs:
                        # The MTP rows read the (adapted) reference trunk's h, shifted; the golden
                        # is llama.cpp's own MTP graph on those rows, checked against reference.py.
                        hin = f"{stem}.{astem}.s1.mtp_hin.npy"
                        np.save(out / hin, refs["mtp_h_in"].astype(np.float32))
                        mname = f"{stem}.{astem}.s1.mtp.npy"
                        run({"kind": "mtp", "model": str(model), "tokens": toks, "adapters": [str(apath)],
                             "scales": [s], "h": str(out / hin), "out": str(out / mname)}, tmp)
                        r["mtp_golden"] = mname
                        r["mtp_h_in"] = hin
                        r["mtp_reference_nmse"] = nmse(refs["mtp"], np.load(out / mname))
                        ok &= r["mtp_reference_nmse"] <= NMSE_MAX
                results.append(r)
                print(json.dumps(r))
        combo = [(exact[adapters[i]["file"]], s) for i, s in COMBO]
        name = f"{stem}.combo.npy"
        run({"kind": "trunk", "model": str(model), "tokens": toks,
             "adapters": [str(p) for p, _ in combo], "scales": [s for _, s in combo],
             "out": str(out / name)}, tmp)
        refs = reference(model, combo, toks)
        r = {"base": fx["file"], "evaluated": model.name,
             "adapters": [[adapters[i]["file"], s] for i, s in COMBO], "golden": name,
             "reference_nmse": nmse(refs["trunk"], np.load(out / name))}
        ok &= r["reference_nmse"] <= NMSE_MAX
        results.append(r)
        print(json.dumps(r))
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    manifest = {
        "generator": "xtask/py/lora_goldens.py (cargo xtask goldens)",
        "llama_cpp_python": llama_cpp.__version__,
        "date": _dt.date.today().isoformat(),
        "n_tokens": N_TOKENS,
        "kv": "f32",
        "adapters": {ad["file"]: ad["sha256"] for ad in adapters},
        "bases": {stem: {"file": fx["file"], "evaluated": model.name,
                         "sha256": sha256_file(model), "tokens": toks}
                  for stem, model, toks, fx in bases},
        "reference_nmse_max": NMSE_MAX,
        "ok": ok,
        "results": results,
        "greedy": greedy_out,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
