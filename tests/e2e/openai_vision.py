#!/usr/bin/env python3
"""The official `openai` client sends an image to a running `tern serve` started with --mmproj:
a chat with a data-URL image part, the same streamed, and a remote URL (refused: the server never
fetches). Prints a transcript; exits non-zero on the first failed check.

    python3 tests/e2e/openai_vision.py --base-url http://127.0.0.1:8080 --image red-512.png
"""

import argparse
import base64
import sys

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
    ap.add_argument("--image", required=True)
    ap.add_argument("--model", default="tern")
    args = ap.parse_args()

    print(f"openai {openai.__version__} -> {args.base_url}", flush=True)
    client = OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key="no-key", max_retries=0)
    with open(args.image, "rb") as f:
        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    content = [
        {"type": "text", "text": "What colour is this image?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    print(f"> user: What colour is this image? [image_url: {args.image}, {len(url)} chars of data URL]")

    r = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": content}],
        max_tokens=12,
        temperature=0,
    )
    msg = r.choices[0].message
    print(f"< assistant: content={msg.content!r} reasoning_content={extra(msg, 'reasoning_content')!r}")
    print(f"  timings={extra(r, 'timings')}")
    print(f"  finish_reason={r.choices[0].finish_reason} usage={r.usage.model_dump()}")
    check(r.choices[0].finish_reason in ("stop", "length"), "the chat finishes")
    # A 512 px image is a 16x16 grid: 256 image tokens, besides the text's.
    check(r.usage.prompt_tokens > 256 + 2, "prompt_tokens counts the image's 256 tokens")

    stream = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": content}],
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    parts, thought = [], []
    for chunk in stream:
        if chunk.choices:
            d = chunk.choices[0].delta
            parts.append(d.content or "")
            thought.append(extra(d, "reasoning_content") or "")
    streamed, reasoned = "".join(parts), "".join(thought)
    print(f"< assistant (stream): content={streamed!r} reasoning_content={reasoned!r}")
    check(
        streamed == (msg.content or "") and reasoned == (extra(msg, "reasoning_content") or ""),
        "the stream says what the whole answer said",
    )

    try:
        client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "And this?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            ]}],
            max_tokens=4,
        )
        check(False, "a remote image URL is refused")
    except openai.BadRequestError as e:
        print(f"< 400: {e.body.get('message') if isinstance(e.body, dict) else e.body}")
        check(e.status_code == 400, "a remote image URL is refused with a 400")


if __name__ == "__main__":
    main()
