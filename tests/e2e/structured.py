#!/usr/bin/env python3
"""The official `openai` client against `tern serve` on the bundled demo model: structured output
(a JSON schema over 20 seeds at temperature 1.0, validated with `jsonschema`; json_object; a
forced tool call), probabilities (top_logprobs sorted, their exponentials summing to at most 1,
streamed too), n = 3, a -100 logit bias over 200 sampled tokens, an unknown field refused, and
embeddings. Prints a transcript with the figures; exits non-zero on the first failed check.

    python3 tests/e2e/structured.py --base-url http://127.0.0.1:8080
"""

import argparse
import json
import math
import sys

import jsonschema
import openai
from openai import OpenAI


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


SCHEMA = {
    "type": "object",
    "properties": {
        "speaker": {"type": "string", "maxLength": 16},
        "mood": {"enum": ["merry", "sad", "wroth"]},
        "line": {
            "type": "object",
            "properties": {
                "act": {"type": "integer", "minimum": 1, "maximum": 5},
                "words": {"type": "array", "items": {"type": "string", "maxLength": 10},
                          "minItems": 1, "maxItems": 3},
            },
            "required": ["act", "words"],
            "additionalProperties": False,
        },
    },
    "required": ["speaker", "mood", "line"],
    "additionalProperties": False,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--seeds", type=int, default=20)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key="no-key", max_retries=0,
                    timeout=120)
    model = client.models.list().data[0].id
    # Thinking off: the grammar applies from the first token (with thinking on it waits for
    # </think>).
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    user = [{"role": "user", "content": "Who speaks, and how?"}]

    # 1. A JSON schema (nested objects, an enum, arrays, required) over seeds at temperature 1.
    valid = 0
    for seed in range(args.seeds):
        r = client.chat.completions.create(
            model=model, messages=user, max_tokens=256, temperature=1.0, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "speech", "strict": True, "schema": SCHEMA}},
            extra_body=no_think)
        text = r.choices[0].message.content
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            print(f"  seed {seed}: invalid ({r.choices[0].finish_reason}): {e}: {text!r}")
        if seed < 3:
            print(f"  seed {seed}: {text}")
    print(f"json_schema: {valid}/{args.seeds} valid")
    check(valid == args.seeds, f"json_schema output validates for {valid}/{args.seeds} seeds")

    # 2. json_object: any JSON object.
    r = client.chat.completions.create(model=model, messages=user, max_tokens=120, temperature=1.0,
                                       seed=7, response_format={"type": "json_object"},
                                       extra_body=no_think)
    text = r.choices[0].message.content
    print(f"json_object: {text!r}")
    if r.choices[0].finish_reason == "stop":
        check(isinstance(json.loads(text), dict), "json_object output is an object")
    else:
        check(text.lstrip().startswith("{"), "json_object output opens an object")

    # 3. A forced tool call: a named function, arguments that validate against its schema.
    params = {"type": "object",
              "properties": {"city": {"type": "string", "maxLength": 24},
                             "days": {"type": "integer", "minimum": 1, "maximum": 7},
                             "unit": {"enum": ["c", "f"]}},
              "required": ["city", "days"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "get_time",
                                               "parameters": {"type": "object", "properties": {}}}}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(
            model=model, max_tokens=200, temperature=0.8, seed=3, tools=tools, tool_choice=choice,
            messages=[{"role": "user", "content": "Weather in Verona?"}], extra_body=no_think)
        ch = r.choices[0]
        print(f"tool_choice {json.dumps(choice)}: finish={ch.finish_reason} "
              f"calls={[(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]} "
              f"content={ch.message.content!r}")
        check(ch.finish_reason == "tool_calls" and ch.message.tool_calls, "a forced tool call is made")
        call = ch.message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        if isinstance(choice, dict):
            check(call.function.name == "get_weather", "the named function is called")
        if call.function.name == "get_weather":
            jsonschema.validate(arguments, params)
        check(True, "the forced tool call parses and its arguments validate")

    # 4. Probabilities: top_logprobs sorted, exponentials summing to at most 1; streamed too.
    r = client.chat.completions.create(model=model, messages=user, max_tokens=24, temperature=1.0,
                                       seed=5, logprobs=True, top_logprobs=5,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    check(len(content) == r.usage.completion_tokens, "one logprobs entry per token")
    worst = 0.0
    for t in content:
        lps = [x.logprob for x in t.top_logprobs]
        if lps != sorted(lps, reverse=True) or len(lps) != 5:
            check(False, f"top_logprobs sorted at {t.token!r}: {lps}")
        worst = max(worst, sum(math.exp(x) for x in lps))
    print(f"logprobs: {len(content)} tokens, largest sum of exp(top_logprobs) = {worst:.6f}")
    check(True, f"top_logprobs sorted (5 per token, {len(content)} tokens)")
    check(worst <= 1.0 + 1e-6, "exp(top_logprobs) sums to at most 1")
    stream = client.chat.completions.create(model=model, messages=user, max_tokens=12, stream=True,
                                            logprobs=True, top_logprobs=3, seed=5,
                                            extra_body={"ignore_eos": True})
    streamed = [t for ch in stream for c in ch.choices if c.logprobs and c.logprobs.content
                for t in c.logprobs.content]
    print(f"streamed logprobs: {len(streamed)} tokens")
    check(len(streamed) == 12 and all(len(t.top_logprobs) == 3 for t in streamed),
          "streamed chunks carry logprobs")

    # 5. n = 3: three choices.
    r = client.chat.completions.create(model=model, messages=user, max_tokens=16, temperature=1.0,
                                       seed=9, n=3, extra_body={"ignore_eos": True})
    print(f"n=3: {[c.message.content for c in r.choices]}")
    check(len(r.choices) == 3 and sorted(c.index for c in r.choices) == [0, 1, 2], "n=3 gives 3 choices")
    stream = client.chat.completions.create(model=model, messages=user, max_tokens=8, n=3, seed=9,
                                            stream=True, extra_body={"ignore_eos": True})
    seen = {c.index for ch in stream for c in ch.choices}
    check(seen == {0, 1, 2}, "streamed choices carry their index")

    # 6. logit_bias -100 on the most likely first token: never emitted over 200 sampled tokens.
    r = client.chat.completions.create(model=model, messages=user, max_tokens=1, logprobs=True,
                                       top_logprobs=1, temperature=0)
    top = r.choices[0].logprobs.content[0]
    banned_id = top.model_extra["id"]
    r = client.chat.completions.create(
        model=model, messages=user, max_tokens=200, temperature=1.0, seed=11,
        logit_bias={str(banned_id): -100}, logprobs=True, top_logprobs=1,
        extra_body={"ignore_eos": True})
    n_sampled = r.usage.completion_tokens
    ids = [t.model_extra["id"] for t in r.choices[0].logprobs.content]
    hits = ids.count(banned_id)
    print(f"logit_bias: token {banned_id} ({top.token!r}) banned; {n_sampled} tokens sampled, "
          f"{hits} of them the banned token")
    check(n_sampled == 200 and len(ids) == 200 and hits == 0,
          "a -100 bias never emits the token over 200 sampled tokens")

    # 7. A field tern does not implement is refused, naming it.
    try:
        client.chat.completions.create(model=model, messages=user, max_tokens=4,
                                       extra_body={"samplers": ["top_k"]})
        check(False, "an unimplemented field is refused")
    except openai.BadRequestError as e:
        check("samplers" in str(e.body), "an unimplemented field gets a 400 naming it")

    # 8. A schema the grammar library rejects is a 400 naming the problem.
    try:
        client.chat.completions.create(
            model=model, messages=user, max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}}})
        check(False, "a bad schema is refused")
    except openai.BadRequestError as e:
        print(f"bad schema: {e.body}")
        check("json_schema" in str(e.body), "a rejected schema gets a 400 naming it")

    # 9. Embeddings: one vector per input, L2-normalized.
    e = client.embeddings.create(model=model, input=["To be, or not to be", "Now is the winter"])
    norms = [math.sqrt(sum(x * x for x in d.embedding)) for d in e.data]
    print(f"embeddings: {len(e.data)} x {len(e.data[0].embedding)}, norms {norms}, usage {e.usage}")
    check(len(e.data) == 2 and all(abs(n - 1) < 1e-4 for n in norms), "embeddings are L2-normalized")
    check(e.data[0].embedding != e.data[1].embedding, "different inputs embed differently")
    print("all checks passed")


if __name__ == "__main__":
    main()
