#!/usr/bin/env python3
"""A small closed-loop HTTP load generator for `tern serve` (127.0.0.1 only).

C concurrent clients each send R chat completions back to back; prints requests/s and the
p50/p99 request latency. Standard library only (threads + http.client).

    python load.py --port 8080 --clients 8 --requests 10 --max-tokens 16
"""
import argparse
import http.client
import json
import statistics
import threading
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("load tests target this machine only")
    body = json.dumps({
        "messages": [{"role": "user", "content": "Tell me a short story about a fox."}],
        "max_tokens": a.max_tokens,
        "temperature": 0.7,
        "chat_template_kwargs": {"enable_thinking": False},
    })
    lat, errors = [], []
    lock = threading.Lock()

    def client(k):
        conn = http.client.HTTPConnection(a.host, a.port, timeout=120)
        for _ in range(a.requests):
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                data = r.read()
                ok = r.status == 200 and json.loads(data)["choices"]
            except Exception as e:  # counted, never fatal
                ok = False
                data = repr(e).encode()
                conn = http.client.HTTPConnection(a.host, a.port, timeout=120)
            dt = time.perf_counter() - t0
            with lock:
                (lat if ok else errors).append(dt if ok else data[:200])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    n = len(lat)
    p = lambda q: lat[min(n - 1, int(q * n))] * 1e3 if n else float("nan")
    print(json.dumps({
        "tool": "xtask/py/load.py (closed loop, http.client threads)",
        "clients": a.clients, "requests": n, "errors": len(errors),
        "requests_per_s": n / wall, "p50_ms": p(0.50), "p99_ms": p(0.99),
        "mean_ms": statistics.mean(lat) * 1e3 if n else None, "wall_s": wall,
    }, indent=1))
    if errors:
        print("first error:", errors[0])


if __name__ == "__main__":
    main()
