#!/usr/bin/env python3
"""The official `openai` client against a running `tern serve`: models, a chat, a stream, a
request with tools, an error, and 5 concurrent requests. Prints a transcript; exits non-zero on
the first failed check.

    python3 tests/e2e/openai_client.py --base-url http://127.0.0.1:8080 [--model ID] [--api-key K]
"""

import argparse
import concurrent.futures
import json
import sys
import time

import openai
from openai import OpenAI


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


def extra(obj, key):
    """A field the OpenAI schema does not declare (reasoning_content, timings)."""
    return (getattr(obj, "model_extra", None) or {}).get(key)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default="tern")
    ap.add_argument("--api-key", default="no-key")
    ap.add_argument("--concurrency", type=int, default=5)
    args = ap.parse_args()

    print(f"openai {openai.__version__} -> {args.base_url}", flush=True)
    client = OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key,
                    max_retries=0, timeout=120)
    # A random-weight model may sample end-of-generation at once; llama-server's `ignore_eos`
    # keeps every request generating so that the token counts below are never zero.
    keep = {"ignore_eos": True}
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three colours."},
    ]

    # 1. The model list.
    models = client.models.list()
    ids = [m.id for m in models.data]
    print(f"models: {ids}")
    check(len(ids) == 1, "one model is listed")
    model = ids[0]

    # 2. A chat (any model id is served by the loaded model; the response echoes the alias).
    t0 = time.time()
    r = client.chat.completions.create(model="whatever-the-client-calls-it", messages=messages,
                                       max_tokens=16, temperature=0.7, seed=1, extra_body=keep)
    ch = r.choices[0]
    print(f"chat: {time.time() - t0:.3f}s finish={ch.finish_reason} usage={r.usage.model_dump()}")
    print(f"  content={ch.message.content!r}")
    print(f"  reasoning_content={extra(ch.message, 'reasoning_content')!r}")
    print(f"  timings={json.dumps(extra(r, 'timings'))}")
    check(r.object == "chat.completion", "chat.completion object")
    check(r.model == model, "the response names the served alias")
    check(ch.finish_reason == "length", "finish_reason length (max_tokens)")
    check(r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, "usage counts tokens")
    check(r.usage.prompt_tokens_details is not None
          and r.usage.prompt_tokens_details.cached_tokens is not None, "usage has cached_tokens")
    timings = extra(r, "timings") or {}
    check(all(k in timings for k in ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n",
                                       "predicted_ms", "predicted_per_second", "draft_n",
                                       "draft_n_accepted")), "llama-server timings")

    # 3. A stream.
    t0 = time.time()
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=keep)
    n_chunks, text, reasoning, finish, usage = 0, "", "", None, None
    for chunk in stream:
        n_chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            reasoning += extra(c.delta, "reasoning_content") or ""
            finish = c.finish_reason or finish
    print(f"stream: {time.time() - t0:.3f}s {n_chunks} chunks finish={finish} "
          f"usage={usage.model_dump() if usage else None}")
    print(f"  content={text!r}")
    print(f"  reasoning_content={reasoning!r}")
    check(n_chunks >= 3, "several chunks")
    check(finish == "length", "the stream ends with finish_reason length (max_tokens)")
    check(usage is not None and usage.completion_tokens > 0, "the last chunk carries usage")

    # 4. Tools: a random-weight model will not call the tool; the shape must still be right.
    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {"type": "object",
                           "properties": {"city": {"type": "string"},
                                          "unit": {"type": "string", "enum": ["c", "f"]}},
                           "required": ["city"]},
        },
    }]
    r = client.chat.completions.create(model=model, max_tokens=16, tools=tools, tool_choice="auto",
                                       messages=[{"role": "user", "content": "Weather in Paris?"}])
    ch = r.choices[0]
    print(f"tools: finish={ch.finish_reason} tool_calls={ch.message.tool_calls} "
          f"prompt_tokens={r.usage.prompt_tokens}")
    check(ch.finish_reason in ("stop", "length", "tool_calls"), "tools: a valid finish_reason")
    check(ch.message.tool_calls is None or all(
        json.loads(tc.function.arguments) is not None for tc in ch.message.tool_calls),
        "tools: tool_calls absent or with JSON arguments")
    check(r.usage.prompt_tokens > 200, "tools: the tool schema is in the prompt")
    # A conversation that carries a tool call and its result renders and answers.
    r = client.chat.completions.create(model=model, max_tokens=8, tools=tools, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21}"},
    ])
    check(r.choices[0].finish_reason in ("stop", "length"), "tools: a tool result round-trips")

    # 5. A bad request is a 400 in OpenAI's error shape.
    try:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
        check(False, "empty messages are refused")
    except openai.BadRequestError as e:
        print(f"error: {e.status_code} {e.body}")
        check(e.status_code == 400 and e.body.get("type") == "invalid_request_error",
              "empty messages: 400 invalid_request_error")

    # 6. More requests than slots: they wait for a slot, all succeed.
    def one(i):
        t = time.time()
        r = client.chat.completions.create(
            model=model, max_tokens=24, extra_body=keep,
            messages=[{"role": "user", "content": f"Request number {i}: count to ten."}])
        return i, time.time() - t, r.choices[0].finish_reason, r.usage.completion_tokens

    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as ex:
        results = list(ex.map(one, range(args.concurrency)))
    for i, dt, fin, n in results:
        print(f"  concurrent {i}: {dt:.3f}s finish={fin} completion_tokens={n}")
    print(f"concurrent: {args.concurrency} requests in {time.time() - t0:.3f}s")
    check(len(results) == args.concurrency and all(n > 0 for *_, n in results),
          f"{args.concurrency} concurrent requests succeed")
    print("all checks passed")


if __name__ == "__main__":
    main()
