#!/usr/bin/env python3
"""Make tern's golden logits from stock llama.cpp (llama-cpp-python) + the float64 NumPy reference.

Usage (with the venv that has llama-cpp-python, gguf, numpy):

    python xtask/py/goldens.py --fixtures fixtures --out fixtures/golden
    python xtask/py/goldens.py --model some.gguf --tokens 1,2,3 --out /tmp/golden [--twin some.twin-f32.gguf]

`--fixtures DIR` reads DIR/manifest.json, written by the Rust fixture generator:

    {"fixtures": [{"file": "tiny-q8_0.gguf", "twin": "tiny-q8_0.twin-f32.gguf" | null,
                   "tokens": [ints...], "sha256": "..."}]}

Per fixture `<stem>` (file name without .gguf) it writes into --out:
  <stem>.exact.npy   llama.cpp on the F32 twin (or on the file itself when it is all-F32):
                     float32 [n_tokens, n_vocab]. Evaluated with an F32 KV cache (see --exact-kv) so
                     that it is the exact f32 math of the file.
  <stem>.llama.npy   llama.cpp on the file itself with stock settings (F16 KV cache); skipped with
                     a reason when llama.cpp cannot load the file (e.g. PQ2_0, ggml type 142).
                     For an all-F32 file this is the same file as the exact golden (no copy).
  <stem>.mtp.npy     only when the file has an MTP block: reference.py (float64) MTP logits,
                     float32 [T, n_vocab], for rows p = 0..T-1 where row p gets token x_p and the
                     trunk's h_nextn row p-1; row 0 gets a zero h (as llama.cpp's draft-mtp does for a
                     fresh sequence: pending_h starts at 0). MTP positions = token positions 0..T-1,
                     causal attention over the rows with a fresh KV.
  <stem>.mtp_h.npy   the MTP head's h' rows (post shared_head_norm), float32 [T, n_embd].
  tokens.json        tokenizer golden from the first fixture.
  embeddings.json    only with --embeddings (and then nothing else is written): llama.cpp's
                     pooled embeddings (llama-cpp-python `embedding=True`, pooling last and mean,
                     L2-normalized by `embed(normalize=True)`) of EMBED_TEXTS on EMBED_FILES, with
                     the token ids llama.cpp used.
  manifest.json      sha256, tokens, file names, NMSEs, versions, date.

Checks (exit status 1 when one fails; the manifest is still written with "ok": false):
  * reference.py trunk logits vs the exact golden: NMSE <= 1e-6.
  * reference.py MTP logits vs llama.cpp's own MTP graph (driven through ctypes, llama_mtp.py)
    on the same h rows: NMSE <= 1e-6 (recorded as skipped if that API is unavailable).

Every llama.cpp call runs in a child process, so a GGML_ASSERT abort on an unsupported file
is recorded as "skipped: ..." instead of killing the run.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

NMSE_MAX = 1e-6
GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1
DEQUANT_OK = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1",
              10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
TYPE_NAMES = {**DEQUANT_OK, 142: "PQ2_0", 143: "PTQ1_0", 41: "Q1_0", 42: "Q2_0", 34: "TQ1_0", 35: "TQ2_0"}

# (text, parse_special)
TOKENIZER_CASES = [
    ("Hello world", True),
    ("Hello, world! How are you?", True),
    ("The quick brown fox jumps over the lazy dog.", True),
    ("don't I'LL we've they're she's he'd I'M", True),
    ("12345", True),
    ("3.14159 and 1,000,000 and 2024-06-01", True),
    ("a  b   c    d", True),
    ("line1\nline2\n\nline3\r\nend", True),
    ("   leading and trailing   ", True),
    ("\t\ttabs\tand\n \n  spaces\n\n\n", True),
    ("!!!??? ... --- *** ;;", True),
    ("$100 @user #tag %50 ^&*() {}[]<>", True),
    ("mixedCASE camelCase snake_case SCREAMING", True),
    ("http://example.com/path?q=1&x=2", True),
    ("你好，世界！", True),
    ("日本語のテキストです。", True),
    ("emoji 😀👍🏽 and 🇺🇸 flags", True),
    ("e\u0301 cafe\u0301 café", True),
    ("مرحبا بالعالم", True),
    ("Привет, мир", True),
    ("ﬁ ligature, ½ fraction, ① circled, Ⅻ roman", True),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", True),
    ("<|endoftext|>", True),
    ("text<|im_end|>more text", True),
    ("<|im_start|>user\nhi<|im_end|>", False),
    ("<|endoftext|>", False),
    ("don't I'LL", False),
    (" ", True),
    ("\n", True),
    ("", True),
]


# Embedding goldens: the bundled demo model (a trained Shakespeare model) and a random fixture.
EMBED_FILES = ["fixtures/demo/demo-q8_0.gguf", "fixtures/tiny-q8_0.gguf"]
EMBED_TEXTS = [
    "To be, or not to be, that is the question:",
    "Now is the winter of our discontent",
    "What light through yonder window breaks?",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.",
]
LLAMA_POOLING = {"mean": 1, "cls": 2, "last": 3}


# --------------------------------------------------------------------------------------------
# small helpers

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """Minimal GGUF header walk -> {tensor name: ggml type id}. Works for types gguf-py does not
    know (PQ2_0 = 142), where GGUFReader would raise."""
    with open(path, "rb") as f:
        buf = f.read(1 << 16)
        pos = 0

        def need(n):
            nonlocal buf
            while pos + n > len(buf):
                more = f.read(1 << 20)
                if not more:
                    raise ValueError(f"{path}: truncated GGUF header")
                buf += more

        def rd(fmt):
            nonlocal pos
            n = struct.calcsize(fmt)
            need(n)
            v = struct.unpack_from("<" + fmt, buf, pos)
            pos += n
            return v[0] if len(v) == 1 else v

        def rd_str():
            nonlocal pos
            n = rd("Q")
            need(n)
            s = bytes(buf[pos:pos + n])
            pos += n
            return s

        scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

        def skip_val(t):
            nonlocal pos
            if t in scalar:
                rd(scalar[t])
            elif t == 8:
                rd_str()
            elif t == 9:
                it = rd("I")
                n = rd("Q")
                if it in scalar:
                    sz = struct.calcsize(scalar[it]) * n
                    need(sz)
                    pos += sz
                else:
                    for _ in range(n):
                        skip_val(it)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {t}")

        if rd("I") != 0x46554747:
            raise ValueError(f"{path}: not a GGUF file")
        rd("I")  # version
        n_t = rd("Q")
        n_kv = rd("Q")
        for _ in range(n_kv):
            rd_str()
            skip_val(rd("I"))
        out = {}
        for _ in range(n_t):
            name = rd_str().decode("utf-8")
            nd = rd("I")
            for _ in range(nd):
                rd("Q")
            out[name] = rd("I")
            rd("Q")
        return out


def type_histogram(types: dict[str, int]) -> dict[str, int]:
    h: dict[str, int] = {}
    for t in types.values():
        k = TYPE_NAMES.get(t, f"type{t}")
        h[k] = h.get(k, 0) + 1
    return dict(sorted(h.items()))


def nmse(a, b) -> float:
    import numpy as np
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.sum((a - b) ** 2) / np.sum(b ** 2))


def top1_agree(a, b) -> float:
    import numpy as np
    return float(np.mean(np.argmax(a, -1) == np.argmax(b, -1)))


# --------------------------------------------------------------------------------------------
# F32 twin writer

def write_f32_twin(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` with every tensor dequantized to F32 (gguf.quants.dequantize);
    all metadata keys copied exactly (same order, same value types, strings byte-exact),
    except general.file_type = 0 (u32)."""
    import numpy as np
    import gguf
    from gguf import GGUFReader, GGUFWriter, GGUFValueType as VT

    r = GGUFReader(str(src), "r")
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(str(dst), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer emits the architecture first
            continue
        vt = f.types[0]
        if key == "general.file_type":
            w.add_key_value(key, 0, VT.UINT32)
            continue
        if key == "general.alignment":
            w.add_custom_alignment(int(f.contents()))
            continue
        if vt == VT.STRING:
            w.add_key_value(key, bytes(f.parts[-1]), VT.STRING)
        elif vt == VT.ARRAY:
            sub = VT(int(f.parts[3][0]))  # parts: [klen, key, vtype, item type, n, items...]
            if len(f.data) == 0:
                raise NotImplementedError(f"{src}: empty array metadata {key} cannot be copied by GGUFWriter")
            if sub == VT.STRING:
                vals = [bytes(f.parts[i]) for i in f.data]
            elif sub == VT.ARRAY:
                raise NotImplementedError(f"{src}: nested array metadata {key}")
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(key, vals, VT.ARRAY, sub_type=sub)
        else:
            w.add_key_value(key, f.parts[-1].tolist()[0], vt)
    if "general.file_type" not in r.fields:
        w.add_key_value("general.file_type", 0, VT.UINT32)

    for t in r.tensors:
        shape = tuple(int(x) for x in reversed([int(d) for d in t.shape]))
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            arr = np.asarray(t.data, dtype=np.float32)
        elif t.tensor_type == gguf.GGMLQuantizationType.F16:
            arr = np.asarray(t.data).view(np.float16).astype(np.float32)
        else:
            arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        arr = np.ascontiguousarray(arr.reshape(shape))
        w.add_tensor(t.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --------------------------------------------------------------------------------------------
# llama.cpp, in a child process

def _worker(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    import numpy as np
    kind = job["kind"]
    if kind == "eval":
        from llama_cpp import Llama
        kw = {}
        if job.get("kv") == "f32":
            kw = dict(type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
        toks = job["tokens"]
        # verbose=True only so that a load failure leaves llama.cpp's reason on stderr (captured by the parent)
        llm = Llama(model_path=job["model"], logits_all=True, n_ctx=max(256, len(toks) + 8), n_batch=512,
                    n_threads=2, verbose=True, seed=0, **kw)
        llm.eval(toks)
        sc = np.array(llm.scores[:len(toks)], dtype=np.float32)
        np.save(job["out"], sc)
    elif kind == "tokenize":
        from llama_cpp import Llama
        llm = Llama(model_path=job["model"], vocab_only=True, verbose=False)
        cases = []
        for text, special in job["cases"]:
            ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
            cases.append({"text": text, "parse_special": special, "ids": [int(i) for i in ids]})
        Path(job["out"]).write_text(json.dumps(cases, ensure_ascii=False))
    elif kind == "embed":
        from llama_cpp import Llama
        out = []
        for pooling in job["poolings"]:
            llm = Llama(model_path=job["model"], embedding=True, pooling_type=LLAMA_POOLING[pooling],
                        n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2, verbose=True, seed=0)
            for text in job["texts"]:
                ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
                e = llm.embed(text, normalize=True)
                out.append({"text": text, "pooling": pooling, "tokens": [int(i) for i in ids],
                            "embedding": [float(x) for x in e]})
            del llm
        Path(job["out"]).write_text(json.dumps(out))
    elif kind == "mtp":
        import llama_mtp
        h = np.load(job["h"])
        lg, hh = llama_mtp.mtp_eval(job["model"], job["tokens"], h)
        np.save(job["out"], lg)
        np.save(job["out_h"], hh)
    else:
        raise ValueError(kind)
    return 0


def run_llama(job: dict, tmp: Path) -> tuple[bool, str]:
    """Run one llama.cpp job in a child. Returns (ok, reason-if-not)."""
    jp = tmp / f"job-{os.getpid()}-{abs(hash(json.dumps(job, sort_keys=True)))}.json"
    jp.write_text(json.dumps(job))
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_worker", str(jp)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        lines = [ln.strip() for ln in (p.stderr or "").strip().splitlines() if ln.strip()]
        errs = [ln for ln in lines if any(w in ln.lower() for w in ("error", "failed", "invalid", "assert"))
                and not ln.startswith(("raise ", "File "))]
        msg = " | ".join((errs[:3] if errs else lines[-3:])) if lines else f"exit status {p.returncode}"
        return False, f"llama.cpp failed (exit {p.returncode}): {msg[-600:]}"
    return True, ""


# --------------------------------------------------------------------------------------------
# main flow

def process_fixture(fx: dict, fixtures_dir: Path | None, out: Path, tmp: Path, twin_dir: Path | None,
                    exact_kv: str, do_llama_mtp: bool, rel_name: str) -> dict:
    import numpy as np
    import reference as R

    path = Path(fx["file"]) if fixtures_dir is None else fixtures_dir / fx["file"]
    stem = path.name[:-5] if path.name.endswith(".gguf") else path.stem
    tokens = [int(t) for t in fx["tokens"]]
    if not tokens:
        raise ValueError(f"{path}: empty token list")
    rec: dict = {"file": rel_name, "tokens": tokens, "n_tokens": len(tokens)}
    problems: list[str] = []

    sha = sha256_file(path)
    rec["sha256"] = sha
    if fx.get("sha256") and fx["sha256"] != sha:
        raise SystemExit(f"FAIL {path}: sha256 {sha} != manifest {fx['sha256']} (stale fixtures manifest?)")
    types = gguf_tensor_types(path)
    rec["tensor_types"] = type_histogram(types)
    all_f32 = all(t == GGML_TYPE_F32 for t in types.values())

    # ---- which file is the exact (F32) source
    twin_src = None
    if fx.get("twin"):
        twin_src = Path(fx["twin"]) if fixtures_dir is None else fixtures_dir / fx["twin"]
        ttypes = gguf_tensor_types(twin_src)
        if not all(t == GGML_TYPE_F32 for t in ttypes.values()):
            raise SystemExit(f"FAIL {twin_src}: twin is not all-F32: {type_histogram(ttypes)}")
        tsha = sha256_file(twin_src)
        if fx.get("twin_sha256") and fx["twin_sha256"] != tsha:
            raise SystemExit(f"FAIL {twin_src}: sha256 {tsha} != manifest twin_sha256 {fx['twin_sha256']}")
        rec["twin"] = {"file": fx["twin"], "source": "fixture manifest", "sha256": tsha}
    elif all_f32:
        rec["twin"] = {"file": None, "source": "file is all-F32 (its own exact source)"}
    else:
        bad = sorted({TYPE_NAMES.get(t, str(t)) for t in types.values() if t not in DEQUANT_OK})
        if bad:
            raise SystemExit(f"FAIL {path}: no twin given and types {bad} cannot be dequantized by gguf-py")
        tdir = twin_dir if twin_dir is not None else tmp
        tdir.mkdir(parents=True, exist_ok=True)
        twin_src = tdir / f"{stem}.twin-f32.gguf"
        write_f32_twin(path, twin_src)
        rec["twin"] = {"file": str(twin_src) if twin_dir is not None else None,
                       "source": "generated by goldens.py (gguf.quants.dequantize)" + ("" if twin_dir else ", not kept"),
                       "sha256": sha256_file(twin_src)}
    exact_src = twin_src if twin_src is not None else path

    # ---- exact golden
    exact_name = f"{stem}.exact.npy"
    ok, why = run_llama({"kind": "eval", "model": str(exact_src), "tokens": tokens, "kv": exact_kv,
                         "out": str(out / exact_name)}, tmp)
    if not ok:
        raise SystemExit(f"FAIL {exact_src}: exact golden: {why}")
    exact = np.load(out / exact_name)
    rec["exact"] = {"file": exact_name, "model": "twin" if twin_src is not None else "file",
                    "kv_cache": exact_kv, "shape": list(exact.shape)}

    # ---- llama.cpp golden on the file itself
    if twin_src is None:
        rec["llama"] = {"file": exact_name, "note": "file is all-F32: the exact golden is its llama.cpp golden"}
        if exact_kv != "f16":
            # also record stock settings (F16 KV) for reference, without a second .npy
            ok, why = run_llama({"kind": "eval", "model": str(path), "tokens": tokens, "kv": "f16",
                                 "out": str(tmp / f"{stem}.stock.npy")}, tmp)
            if ok:
                st = np.load(tmp / f"{stem}.stock.npy")
                rec["llama"]["stock_f16_kv_vs_exact_nmse"] = nmse(st, exact)
    else:
        llama_name = f"{stem}.llama.npy"
        ok, why = run_llama({"kind": "eval", "model": str(path), "tokens": tokens, "kv": "f16",
                             "out": str(out / llama_name)}, tmp)
        if ok:
            lg = np.load(out / llama_name)
            rec["llama"] = {"file": llama_name, "kv_cache": "f16 (llama.cpp default)",
                            "vs_exact_nmse": nmse(lg, exact), "vs_exact_top1": top1_agree(lg, exact)}
        else:
            rec["llama"] = {"file": None, "skipped": why}

    # ---- reference cross-check
    model = R.load(str(exact_src))
    if model.n_vocab != exact.shape[1]:
        raise SystemExit(f"FAIL {path}: n_vocab {model.n_vocab} != golden width {exact.shape[1]}")
    ref_logits, h_nextn = R.forward(model, tokens)
    e = nmse(ref_logits, exact)
    rec["reference_vs_exact_nmse"] = e
    rec["reference_vs_exact_top1"] = top1_agree(ref_logits, exact)
    if not (e <= NMSE_MAX):
        problems.append(f"reference.py vs llama.cpp exact golden NMSE {e:.3e} > {NMSE_MAX:g}")

    # ---- MTP golden
    if R.has_mtp(model):
        hprev = R.mtp_shifted_h(h_nextn)
        mtp_logits, mtp_h = R.mtp_forward(model, tokens, hprev)
        mtp_name, mtph_name = f"{stem}.mtp.npy", f"{stem}.mtp_h.npy"
        np.save(out / mtp_name, mtp_logits.astype(np.float32))
        np.save(out / mtph_name, mtp_h.astype(np.float32))
        m = {"logits": mtp_name, "h": mtph_name, "layer": model.n_layer,
             "rows": "row p: token x_p, position p, h = trunk h_nextn[p-1] (reference.py float64); row 0: h = 0",
             "source": "reference.py (float64) on the exact source"}
        if do_llama_mtp:
            hfile = tmp / f"{stem}.mtp_in_h.npy"
            np.save(hfile, hprev.astype(np.float32))
            ok, why = run_llama({"kind": "mtp", "model": str(exact_src), "tokens": tokens, "h": str(hfile),
                                 "out": str(tmp / f"{stem}.lmtp.npy"), "out_h": str(tmp / f"{stem}.lmtp_h.npy")}, tmp)
            if ok:
                ll = np.load(tmp / f"{stem}.lmtp.npy")
                lh = np.load(tmp / f"{stem}.lmtp_h.npy")
                m["llama_cpp_mtp_vs_reference_nmse"] = nmse(mtp_logits, ll)
                m["llama_cpp_mtp_h_vs_reference_nmse"] = nmse(mtp_h, lh)
                m["llama_cpp_mtp_top1"] = top1_agree(mtp_logits, ll)
                if not (m["llama_cpp_mtp_vs_reference_nmse"] <= NMSE_MAX):
                    problems.append(f"reference.py MTP vs llama.cpp graph_mtp NMSE "
                                    f"{m['llama_cpp_mtp_vs_reference_nmse']:.3e} > {NMSE_MAX:g}")
            else:
                m["llama_cpp_mtp_check"] = "skipped: " + why
        rec["mtp"] = m
    else:
        rec["mtp"] = None

    rec["ok"] = not problems
    if problems:
        rec["problems"] = problems
    return rec


def dumps_compact(obj) -> str:
    """json.dumps(indent=1) with lists of numbers kept on one line."""
    import re
    s = json.dumps(obj, indent=1, ensure_ascii=False)
    return re.sub(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", s)


def tokenizer_golden(model_path: Path, model_label: str, out: Path, tmp: Path) -> dict:
    ok, why = run_llama({"kind": "tokenize", "model": str(model_path), "cases": TOKENIZER_CASES,
                         "out": str(tmp / "tok.json")}, tmp)
    if not ok:
        return {"file": None, "skipped": why}
    cases = json.loads((tmp / "tok.json").read_text())
    (out / "tokens.json").write_text(dumps_compact({"model": model_label, "cases": cases}) + "\n")
    return {"file": "tokens.json", "model": model_label, "n_cases": len(cases)}


def embeddings_golden(out: Path) -> int:
    import llama_cpp
    tmp = Path(tempfile.mkdtemp(prefix="tern-goldens-"))
    cases = []
    try:
        for f in EMBED_FILES:
            ok, why = run_llama({"kind": "embed", "model": f, "texts": EMBED_TEXTS,
                                 "poolings": ["last", "mean"], "out": str(tmp / "embd.json")}, tmp)
            if not ok:
                print(f"FAIL {f}: {why}", file=sys.stderr)
                return 1
            for c in json.loads((tmp / "embd.json").read_text()):
                cases.append({"file": f, **c})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {"generator": "xtask/py/goldens.py --embeddings", "llama_cpp_python": llama_cpp.__version__,
           "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "how": "Llama(embedding=True, pooling_type=...).embed(text, normalize=True): L2-normalized",
           "cases": cases}
    out.mkdir(parents=True, exist_ok=True)
    (out / "embeddings.json").write_text(dumps_compact(doc) + "\n")
    print(f"[goldens] wrote {out / 'embeddings.json'} ({len(cases)} cases)", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_worker"]:
        return _worker(argv[1])

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--fixtures", type=Path, help="directory with manifest.json from the Rust fixture generator")
    src.add_argument("--model", type=Path, help="single GGUF (with --tokens)")
    ap.add_argument("--tokens", help="comma-separated token ids (with --model)")
    ap.add_argument("--twin", type=Path, help="F32 twin of --model (optional)")
    ap.add_argument("--out", type=Path, help="output dir (default: FIXTURES/golden)")
    ap.add_argument("--twin-dir", type=Path, help="keep generated F32 twins here (default: temp, deleted)")
    ap.add_argument("--exact-kv", choices=["f32", "f16"], default="f32",
                    help="KV-cache type for the exact golden (default f32: exact f32 math; f16 = llama.cpp default)")
    ap.add_argument("--no-llama-mtp", action="store_true", help="skip the llama.cpp graph_mtp cross-check")
    ap.add_argument("--no-tokenizer", action="store_true", help="skip tokens.json")
    ap.add_argument("--embeddings", action="store_true",
                    help="write only OUT/embeddings.json (llama.cpp's pooled embeddings of EMBED_TEXTS)")
    a = ap.parse_args(argv)
    if a.embeddings:
        return embeddings_golden(a.out or Path("fixtures/golden"))

    if a.fixtures is not None:
        mf = a.fixtures / "manifest.json"
        if not mf.exists():
            ap.error(f"{mf} does not exist (run `cargo xtask fixtures` first)")
        fixtures = json.loads(mf.read_text())["fixtures"]
        out = a.out or (a.fixtures / "golden")
        fixtures_dir = a.fixtures
        labels = [f"fixtures/{fx['file']}" for fx in fixtures]
    else:
        if not a.tokens:
            ap.error("--model needs --tokens")
        fixtures = [{"file": str(a.model), "twin": str(a.twin) if a.twin else None,
                     "tokens": [int(x) for x in a.tokens.split(",") if x.strip()]}]
        if not a.out:
            ap.error("--model needs --out")
        out = a.out
        fixtures_dir = None
        labels = [str(a.model)]
    out.mkdir(parents=True, exist_ok=True)

    import numpy as np
    import gguf  # noqa: F401
    import llama_cpp
    from importlib.metadata import version as _v

    tmp = Path(tempfile.mkdtemp(prefix="tern-goldens-"))
    recs = []
    try:
        for fx, label in zip(fixtures, labels):
            print(f"[goldens] {label} ({len(fx['tokens'])} tokens)", file=sys.stderr)
            rec = process_fixture(fx, fixtures_dir, out, tmp, a.twin_dir, a.exact_kv, not a.no_llama_mtp, label)
            msg = f"[goldens]   reference vs exact NMSE {rec['reference_vs_exact_nmse']:.3e}"
            msg += f"; llama.cpp golden: {rec['llama'].get('skipped') or rec['llama']['file']}"
            if rec["mtp"]:
                v = rec["mtp"].get("llama_cpp_mtp_vs_reference_nmse")
                msg += f"; MTP reference vs llama.cpp NMSE {v:.3e}" if v is not None else \
                    f"; MTP check {rec['mtp'].get('llama_cpp_mtp_check')}"
            print(msg, file=sys.stderr)
            recs.append(rec)
        tok = None
        if not a.no_tokenizer and fixtures:
            first = (fixtures_dir / fixtures[0]["file"]) if fixtures_dir else Path(fixtures[0]["file"])
            tok = tokenizer_golden(first, labels[0], out, tmp)
            if tok.get("skipped") and fixtures[0].get("twin"):
                twin = (fixtures_dir / fixtures[0]["twin"]) if fixtures_dir else Path(fixtures[0]["twin"])
                tok = tokenizer_golden(twin, labels[0], out, tmp)
                tok["note"] = "tokenized with the twin (same tokenizer metadata); the file itself did not load"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    all_ok = all(r["ok"] for r in recs)
    manifest = {
        "generator": "xtask/py/goldens.py",
        "llama_cpp_python": llama_cpp.__version__,
        "gguf_py": _v("gguf"),
        "numpy": np.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "nmse_max": NMSE_MAX,
        "nmse": "sum((a-b)^2)/sum(b^2) over the whole [T, n_vocab] array",
        "ok": all_ok,
        "tokenizer": tok,
        "fixtures": recs,
    }
    (out / "manifest.json").write_text(dumps_compact(manifest) + "\n")
    print(f"[goldens] wrote {out / 'manifest.json'}", file=sys.stderr)
    if not all_ok:
        for r in recs:
            for p in r.get("problems", []):
                print(f"FAIL {r['file']}: {p}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
