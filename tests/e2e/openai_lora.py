#!/usr/bin/env python3
"""LoRA through the official OpenAI client against `tern serve` (run by tests/server_lora.rs).

The server holds three adapters (ids 0, 1, 2) with global scales [1, 0, 0]. Requests with
different `lora` lists run concurrently over two slots; each must equal its own golden: stock
llama.cpp's greedy continuation with those scales (fixtures/golden/lora/manifest.json, "greedy"),
given here as text. Then POST /lora-adapters changes the global scales, as llama-server's does.
"""
import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import urllib.error
import urllib.request

import openai


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        check.failed = True


check.failed = False


class Resp:
    def __init__(self, status_code, text):
        self.status_code, self.text = status_code, text

    def json(self):
        return json.loads(self.text)


class Http:
    """GET and POST of JSON with the standard library (the client's own HTTP stack is private)."""

    def __init__(self, base):
        self.base = base

    def _do(self, req):
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return Resp(r.status, r.read().decode())
        except urllib.error.HTTPError as e:
            return Resp(e.code, e.read().decode())

    def get(self, path):
        return self._do(urllib.request.Request(self.base + path))

    def post(self, path, json=None):
        body = __import__("json").dumps(json).encode()
        return self._do(urllib.request.Request(self.base + path, data=body, method="POST",
                                               headers={"Content-Type": "application/json"}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--cases", required=True, help="JSON: prompt ids, n, expected texts by case")
    a = ap.parse_args()
    cases = json.loads(open(a.cases).read())
    client = openai.OpenAI(base_url=a.base_url + "/v1", api_key="none")
    http = Http(a.base_url)

    def complete(lora):
        extra = {} if lora is None else {"lora": lora}
        r = client.completions.create(model="tern", prompt=cases["prompt"], max_tokens=cases["n"],
                                      temperature=0, extra_body=extra)
        return r.choices[0].text

    ads = http.get("/lora-adapters").json()
    print("GET /lora-adapters:", json.dumps(ads))
    check([x["id"] for x in ads] == [0, 1, 2], "three adapters, ids 0..2")
    check([x["scale"] for x in ads] == [1.0, 0.0, 0.0], "global scales from --lora / --lora-scaled")
    check(all(x["path"].endswith(".gguf") for x in ads), "each with its path")

    # Concurrent requests, each with its own scales (no `lora`: the global ones).
    jobs = {
        "a0s1": [{"id": 0, "scale": 1.0}],
        "a1s2": [{"id": 1, "scale": 2.0}],
        "a0s1+a2s0.5": [{"id": 0, "scale": 1.0}, {"id": 2, "scale": 0.5}],
        "a0s0.5": [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0.0}],
        "global": None,
    }
    with ThreadPoolExecutor(len(jobs)) as ex:
        got = dict(zip(jobs, ex.map(complete, jobs.values())))
    for case, text in got.items():
        want = cases["expect"]["a0s1" if case == "global" else case]
        check(text == want, f"concurrent {case}: {text!r} == golden {want!r}")
    check(len({got[c] for c in ["a0s1", "a1s2", "a0s1+a2s0.5", "a0s0.5"]}) == 4,
          "the four scale sets give four different continuations")

    # POST /lora-adapters sets the global scales; unlisted adapters go to 0.
    r = http.post("/lora-adapters", json=[{"id": 0, "scale": 0.5}])
    check(r.status_code == 200 and r.json() == {"success": True}, f"POST /lora-adapters: {r.text}")
    check([x["scale"] for x in http.get("/lora-adapters").json()] == [0.5, 0.0, 0.0],
          "global scales now [0.5, 0, 0]")
    text = complete(None)
    check(text == cases["expect"]["a0s0.5"], f"no lora field after POST: {text!r} (scale 0.5 golden)")
    text = complete([])
    check(text == cases["expect"]["a0s0.5"], "an empty lora list also takes the global scales")
    r = http.post("/lora-adapters", json=[])
    check(r.status_code == 200, "POST [] sets every adapter to 0")
    text = complete(None)
    check(text == cases["expect"]["base"], f"all adapters at 0: the base model's golden {text!r}")
    text = complete([{"id": 0, "scale": 1.0}])
    check(text == cases["expect"]["a0s1"], "a request's own list still applies after POST []")

    # Bad input: a 400 naming the field, in OpenAI's error shape.
    r = http.post("/lora-adapters", json={"id": 0, "scale": 1})
    check(r.status_code == 400, f"POST /lora-adapters with an object: {r.status_code} {r.text}")
    for bad, why in [([{"id": 7, "scale": 1.0}], "unknown id"), ("x", "not a list"),
                     ([{"id": 0, "scale": "big"}], "scale not a number")]:
        try:
            client.completions.create(model="tern", prompt=cases["prompt"], max_tokens=2,
                                      extra_body={"lora": bad})
            check(False, f"lora {bad!r} ({why}) refused")
        except openai.BadRequestError as e:
            check("lora" in str(e), f"lora {bad!r} ({why}): 400 {e.message}")

    if check.failed:
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
