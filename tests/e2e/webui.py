"""The chat page in a real browser: Debian's chromium driven headless by Playwright (no
browser download), against `tern serve` on the bundled model (started by tests/webui.rs).

Checks, in order (each prints one line):
- the page loads with no console errors, names the model and its context from /props, and
  hides the image control (the bundled model has no projector);
- settings are saved from the dialog and change the request: the server's slot shows
  temperature 0 and the max tokens set;
- the reasoning block streams open (the DOM grows frame by frame) and collapses when the
  answer ends; a click opens and closes it;
- a plain reply streams token by token and ends with tokens/s from its `timings`;
- Esc mid-stream stops it and /slots shows the slot idle at once, with the reply marked
  stopped;
- a reload keeps the conversation; regenerate and edit rerun a turn;
- with /props reporting vision, images attach (picker, drop) and go as `image_url` parts;
- the keyed server's --ui-config becomes the page's default settings;
- with --api-key the page itself opens, asks for the key, stores it and sends it on every call;
- screenshots at desktop and phone widths (light and dark) under --out.
"""

import argparse
import base64
import json
import os
import sys
import time
import urllib.request

from playwright.sync_api import sync_playwright

# The flags known to work on these machines (as root, with no network).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# The bundled model closes its <think> block at once; banning `</think>` (token 2045, a
# special token of its vocabulary) keeps it thinking, so the page gets reasoning to show.
THINK_CLOSE_ID = 2045

# The keyed server runs with `--ui-config` set to this (tests/webui.rs).
UI_CONFIG = {"systemMessage": "Answer briefly.", "temperature": 0.5, "max_tokens": 8}

# A 1x1 PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"ok: {what}", flush=True)


def get_json(url, key=None):
    req = urllib.request.Request(url)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def wait_until(f, timeout, what):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = f()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s: {what}")


def set_settings(page, **fields):
    page.click("#open-settings")
    page.wait_for_selector("#settings[open]")
    form = "#settings-form"
    for name, value in fields.items():
        sel = f"{form} [name={name}]"
        if name == "enable_thinking":
            page.select_option(sel, value)
        else:
            page.fill(sel, value)
    page.click("#settings-save")
    page.wait_for_selector("#settings", state="hidden")


# Records, on every DOM change, the text length of the last assistant message's part that
# `sel` names and whether its reasoning block is open.
RECORDER = """(sel) => {
  window.__growth = [];
  const box = document.getElementById('messages');
  const obs = new MutationObserver(() => {
    const msgs = box.querySelectorAll('.msg.assistant');
    const m = msgs[msgs.length - 1];
    if (!m) return;
    const part = m.querySelector(sel);
    const d = m.querySelector('details.reasoning');
    window.__growth.push({len: part ? part.textContent.length : 0,
                          open: d ? d.open : null, t: performance.now()});
  });
  obs.observe(box, {childList: true, subtree: true, characterData: true});
  window.__stopRecorder = () => obs.disconnect();
}"""


def send(page, text):
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_idle(page, timeout=60):
    # The Send button returns when the reply has ended.
    page.wait_for_selector("#send:not([hidden])", timeout=timeout * 1000)


def throttle(cdp, bytes_per_s):
    """Caps the page's download rate (None lifts the cap). The streaming checks count the
    frames in which a reply grew; the bundled model can write 600 tokens in a few frames'
    time, so without a cap how many frames a stream spans depends on the machine's speed at
    that moment, not on the page. Capped, the ~150 KB of a 600-token stream take about 1.5 s
    to arrive: the page must still render them as they come for the counts to hold."""
    rate = -1 if bytes_per_s is None else bytes_per_s
    cdp.send(
        "Network.emulateNetworkConditions",
        {"offline": False, "latency": 0, "downloadThroughput": rate, "uploadThroughput": -1},
    )


def growth(page):
    page.evaluate("window.__stopRecorder()")
    return page.evaluate("window.__growth")


def chat_requests(page):
    """The bodies the page posts to /v1/chat/completions, in order, as they are sent."""
    bodies = []
    page.on(
        "request",
        lambda r: bodies.append(json.loads(r.post_data))
        if r.url.endswith("/v1/chat/completions")
        else None,
    )
    return bodies


def assistant_count(page):
    return page.locator(".msg.assistant").count()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--keyed-url", required=True, help="a server started with --api-key")
    ap.add_argument("--key", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    base = a.base_url.rstrip("/")
    t_start = time.time()

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=a.chromium, headless=True, args=CHROMIUM_ARGS
        )
        ctx = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light")
        page = ctx.new_page()
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        chat_bodies = chat_requests(page)
        cdp = ctx.new_cdp_session(page)
        cdp.send("Network.enable")

        # -- load ------------------------------------------------------------------------
        page.goto(base + "/")
        props = get_json(base + "/props")
        name = props["model_alias"]
        n_ctx = props["default_generation_settings"]["n_ctx"]
        page.wait_for_function(
            "(n) => document.getElementById('model-name').textContent === n", arg=name
        )
        check(page.text_content("#model-ctx") == f"ctx {n_ctx}", f"the page shows {name}, ctx {n_ctx} from /props")
        check(page.is_hidden("#attach"), "no image control while /props says vision is off")

        # -- the Markdown renderer, in the page -------------------------------------------
        md = page.evaluate(
            """(cases) => cases.map((s) => Markdown.render(s))""",
            [
                "**b** *i* `c<d>` ~~s~~",
                "```rust\nfn main() {}\n```",
                "- a\n- b\n  1. c",
                "<img src=x onerror=alert(1)> <script>x</script>",
                "[ok](https://example.org) [bad](javascript:alert(1))",
                "| a | b |\n|---|--:|\n| 1 | 2 |",
                "# Title\nline one\nline two",
            ],
        )
        check(md[0] == "<p><strong>b</strong> <em>i</em> <code>c&lt;d&gt;</code> <del>s</del></p>", f"inline Markdown: {md[0]}")
        check('<pre><code class="language-rust">fn main() {}</code></pre>' in md[1] and "data-copy" in md[1], f"a code block with a copy button: {md[1]}")
        check(md[2] == "<ul><li>a</li><li>b<ol><li>c</li></ol></li></ul>", f"nested lists: {md[2]}")
        check("<img" not in md[3] and "<script" not in md[3] and "&lt;img" in md[3], f"HTML is escaped: {md[3]}")
        check('href="https://example.org"' in md[4] and md[4].count("<a ") == 1
              and 'href="javascript' not in md[4], f"only safe links: {md[4]}")
        check("<table>" in md[5] and '<td class="al-right">2</td>' in md[5], f"tables: {md[5]}")
        check(md[6] == "<h1>Title</h1><p>line one<br>line two</p>", f"headings and line breaks: {md[6]}")

        # -- settings change the request; reasoning streams and collapses -------------------
        set_settings(
            page,
            temperature="0",
            max_tokens="600",
            enable_thinking="true",
            custom=json.dumps({"ignore_eos": True, "logit_bias": [[THINK_CLOSE_ID, False]]}),
        )
        stored = page.evaluate("JSON.parse(localStorage.getItem('tern.settings'))")
        check(stored["temperature"] == "0", "settings are kept in localStorage")
        page.evaluate(RECORDER, ".reasoning-body")
        throttle(cdp, 100_000)
        send(page, "Speak of the king.")
        wait_idle(page)
        throttle(cdp, None)
        g = growth(page)
        lens = sorted({x["len"] for x in g if x["len"] > 0})
        span = (g[-1]["t"] - g[0]["t"]) / 1000 if g else 0
        check(len(lens) >= 4, f"the reasoning streamed: {len(lens)} distinct lengths over the DOM changes in {span:.2f} s")
        check(any(x["open"] for x in g if x["len"] > 0), "the reasoning block is open while it streams")
        body = chat_bodies[-1]
        check(
            body["temperature"] == 0
            and body["max_tokens"] == 600
            and body["chat_template_kwargs"] == {"enable_thinking": True}
            and body["stream"] is True,
            f"the request carries the settings: {json.dumps({k: v for k, v in body.items() if k != 'messages'})}",
        )
        slot = get_json(base + "/slots")[0]
        check(
            slot["params"]["temperature"] == 0 and slot["params"]["n_predict"] == 600,
            f"the server saw temperature {slot['params']['temperature']}, n_predict {slot['params']['n_predict']}",
        )
        last = page.locator(".msg.assistant").last
        details = last.locator("details.reasoning")
        check(details.count() == 1 and not details.evaluate("d => d.open"), "the reasoning block collapsed when the reply ended")
        check(len(details.locator(".reasoning-body").text_content()) > 20, "it holds the reasoning text")
        details.locator("summary").click()
        check(details.evaluate("d => d.open"), "a click opens it")
        details.locator("summary").press("Enter")
        check(not details.evaluate("d => d.open"), "Enter on its summary closes it (keyboard)")
        stats = last.locator(".stats").text_content()
        check("600 tokens" in stats and "t/s" in stats, f"the reply shows its timings: {stats!r}")

        # -- a plain reply streams token by token ------------------------------------------
        set_settings(page, enable_thinking="false", max_tokens="600", custom='{"ignore_eos": true}')
        page.evaluate(RECORDER, ".content")
        throttle(cdp, 100_000)
        send(page, "And of the queen?")
        wait_idle(page)
        throttle(cdp, None)
        g = growth(page)
        lens = [x["len"] for x in g if x["len"] > 0]
        span = (g[-1]["t"] - g[0]["t"]) / 1000 if g else 0
        check(len(set(lens)) >= 4 and lens == sorted(lens), f"the reply grew over {len(set(lens))} DOM updates in {span:.2f} s")
        last = page.locator(".msg.assistant").last
        check(last.locator("details.reasoning").count() == 0, "no reasoning block with thinking off")
        check(len(last.locator(".content").text_content()) > 50, "the reply is rendered as Markdown content")

        # -- stop mid-stream frees the slot ------------------------------------------------
        set_settings(page, max_tokens="-1")
        send(page, "Tell me a long tale.")
        # The server says when the stream is under way: on a loaded machine the page renders
        # seconds behind it, and the ~2,900 tokens left in the window take about 5 s.
        wait_until(lambda: get_json(base + "/slots")[0]["is_processing"], 30, "the slot is busy mid-stream")
        print("ok: the slot is busy mid-stream", flush=True)
        page.wait_for_function(
            """() => { const m = [...document.querySelectorAll('.msg.assistant .content')].pop();
                       return m && m.textContent.length > 0; }""",
            timeout=30000,
            polling=20,
        )
        page.keyboard.press("Escape")
        t0 = time.time()
        wait_until(lambda: not get_json(base + "/slots")[0]["is_processing"], 5, "/slots shows the slot idle")
        print(f"ok: Esc stopped the stream; /slots idle after {time.time() - t0:.2f} s", flush=True)
        wait_idle(page, 5)
        slot = get_json(base + "/slots")[0]
        n = slot["next_token"][0]["n_decoded"]
        check(n < n_ctx - 64, f"it stopped early ({n} tokens decoded of a {n_ctx}-token window)")
        stats = page.locator(".msg.assistant").last.locator(".stats").text_content()
        check("stopped" in stats, f"the reply is marked stopped: {stats!r}")

        # -- a reload keeps the conversation; regenerate and edit --------------------------
        before = page.eval_on_selector_all(".msg .bubble", "els => els.map(e => e.textContent)")
        page.reload()
        page.wait_for_selector(".msg.assistant")
        after = page.eval_on_selector_all(".msg .bubble", "els => els.map(e => e.textContent)")
        check(after == before and len(after) == 6, f"a reload keeps the conversation ({len(after)} messages)")
        check(page.locator("#conv-list li").count() == 1, "one conversation in the list")

        set_settings(page, max_tokens="24", custom="")
        n_req = len(chat_bodies)
        page.locator(".msg.assistant").last.get_by_role("button", name="Regenerate").click()
        wait_idle(page)
        check(len(chat_bodies) == n_req + 1 and assistant_count(page) == 3, "regenerate reruns the last turn")
        page.locator(".msg.user").nth(1).get_by_role("button", name="Edit").click()
        page.fill(".msg.user .edit textarea", "Say it again, plainly.")
        page.press(".msg.user .edit textarea", "Enter")
        wait_idle(page)
        sent = [m["content"] for m in chat_bodies[-1]["messages"]]
        check(
            assistant_count(page) == 2 and sent[-1] == "Say it again, plainly." and len(sent) == 3,
            "editing a turn drops what followed and reruns it",
        )

        # -- a second conversation: a tool call, shown as such ------------------------------
        page.click("#new-chat")
        check(page.locator(".msg").count() == 0, "New chat opens an empty conversation")
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "required": ["city"],
                           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}}]
        set_settings(page, max_tokens="64", system="You are a helpful assistant.",
                     custom=json.dumps({"tools": tools, "tool_choice": "required"}))
        send(page, "What is the weather in Paris?")
        wait_idle(page)
        call = page.locator(".msg.assistant .tool-call")
        check(call.count() == 1 and call.locator(".tool-head code").text_content() == "get_weather"
              and "city" in call.locator("pre").text_content(),
              f"the tool call is shown as such: {call.text_content()!r}")
        check(page.locator("#conv-list li").count() == 2, "the list holds both conversations")
        check(chat_bodies[-1]["messages"][0] == {"role": "system", "content": "You are a helpful assistant."},
              "the system prompt leads the request")
        # The reasoning conversation shows every kind of block: go back to it for the pictures.
        page.locator("#conv-list .conv").nth(1).click()
        details = page.locator(".msg.assistant").first.locator("details.reasoning")
        details.locator("summary").click()
        check(details.evaluate("d => d.open"), "the reader's choice to open it outlasts a redraw")
        check(errors == [], f"no console errors: {errors}")
        page.screenshot(path=os.path.join(a.out, "desktop.png"))
        page.emulate_media(color_scheme="dark")
        page.screenshot(path=os.path.join(a.out, "desktop-dark.png"))
        page.emulate_media(color_scheme="light")
        page.set_viewport_size({"width": 390, "height": 844})
        # The list slides out of view when the width drops: wait for it to settle.
        page.wait_for_function("() => document.getAnimations().length === 0")
        page.evaluate("document.getElementById('messages').scrollTop = 0")
        page.screenshot(path=os.path.join(a.out, "phone.png"))
        width = page.evaluate("document.documentElement.scrollWidth")
        check(width <= 390, f"nothing overflows the phone width ({width} px)")
        page.click("#open-side")
        page.wait_for_function("() => document.getAnimations().length === 0")
        page.screenshot(path=os.path.join(a.out, "phone-list.png"))
        # Delete takes two clicks.
        page.locator("#conv-list .del").first.click()
        check(page.locator("#conv-list li").count() == 2, "one click on delete only arms it")
        page.locator("#conv-list .del").first.click()
        check(page.locator("#conv-list li").count() == 1, "a second click deletes the conversation")
        page.keyboard.press("Escape")
        check(page.evaluate("!document.body.classList.contains('side-open')"), "Esc closes the phone list")
        check(errors == [], f"no console errors: {errors}")
        ctx.close()

        # -- images: the control shows once /props reports vision --------------------------
        # The bundled model has no projector, so /props is answered here as a server with
        # one would answer it; the request's shape is what is checked (OpenAI's image_url
        # part with a data URL), and the server's answer to it, whatever it is, is shown.
        vctx = browser.new_context(viewport={"width": 1280, "height": 800})
        vpage = vctx.new_page()
        verrors = []
        vpage.on("pageerror", lambda e: verrors.append(str(e)))

        def vision_props(route):
            r = route.fetch()
            j = r.json()
            j["modalities"] = {"vision": True, "video": False, "audio": False}
            route.fulfill(response=r, json=j)

        vpage.route("**/props", vision_props)
        vbodies = chat_requests(vpage)
        vpage.goto(base + "/")
        vpage.wait_for_selector("#attach:not([hidden])")
        vpage.set_input_files("#file", files=[{"name": "dot.png", "mimeType": "image/png", "buffer": PNG}])
        vpage.wait_for_selector("#attachments .thumb img")
        # A dropped file joins it.
        vpage.evaluate(
            """(b64) => {
                const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
                const dt = new DataTransfer();
                dt.items.add(new File([bytes], 'drop.png', {type: 'image/png'}));
                document.getElementById('main').dispatchEvent(
                    new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));
            }""",
            base64.b64encode(PNG).decode(),
        )
        vpage.wait_for_function("() => document.querySelectorAll('#attachments .thumb').length === 2")
        vpage.locator("#attachments .rm").nth(1).click()
        check(vpage.locator("#attachments .thumb").count() == 1, "images attach by picker and drop, and come off")
        vpage.fill("#input", "What is in this picture?")
        vpage.press("#input", "Enter")
        wait_idle(vpage)
        content = vbodies[-1]["messages"][-1]["content"]
        check(
            isinstance(content, list) and content[0] == {"type": "text", "text": "What is in this picture?"}
            and content[1]["type"] == "image_url"
            and content[1]["image_url"]["url"].startswith("data:image/png;base64,"),
            "the image goes as an OpenAI image_url part with a data URL",
        )
        check(vpage.locator(".msg.user .images img").count() == 1, "the sent image shows in the conversation")
        shown = vpage.locator(".msg.assistant").last.text_content()
        check(len(shown) > 0, f"the server's answer is shown: {shown[:120]!r}")
        check(verrors == [], f"no page errors with images: {verrors}")
        vctx.close()

        # -- --api-key: the page opens, asks for the key, then sends it ---------------------
        kctx = browser.new_context(viewport={"width": 1280, "height": 800})
        kpage = kctx.new_page()
        auth = []
        kpage.on(
            "request",
            lambda r: auth.append((r.url, r.headers.get("authorization")))
            if not r.url.endswith((".js", ".css", "/"))
            else None,
        )
        kerrors = []
        kpage.on("pageerror", lambda e: kerrors.append(str(e)))
        keyed = a.keyed_url.rstrip("/")
        resp = kpage.goto(keyed + "/")
        check(resp.status == 200, "with --api-key the page itself opens without a key")
        kpage.wait_for_selector("#keyprompt[open]")
        kpage.fill("#key-input", a.key)
        kpage.press("#key-input", "Enter")
        kname = get_json(keyed + "/props", a.key)["model_alias"]
        kpage.wait_for_function(
            "(n) => document.getElementById('model-name').textContent === n", arg=kname
        )
        check(kpage.evaluate("localStorage.getItem('tern.apiKey')") == a.key, "the key is stored in the browser")
        kbodies = chat_requests(kpage)
        kpage.fill("#input", "Hello")
        kpage.press("#input", "Enter")
        kpage.wait_for_selector(".msg.assistant .stats:not(:empty)", timeout=60000)
        kb = kbodies[-1]
        check(
            kb["messages"][0] == {"role": "system", "content": UI_CONFIG["systemMessage"]}
            and kb["temperature"] == UI_CONFIG["temperature"]
            and kb["max_tokens"] == UI_CONFIG["max_tokens"],
            "the server's --ui-config sets the page's defaults (llama-server's names)",
        )
        api_calls = [(u, h) for u, h in auth if "/props" in u or "/v1/" in u]
        authed = [u for u, h in api_calls if h == f"Bearer {a.key}"]
        check(
            any("/v1/chat/completions" in u for u in authed) and any("/props" in u for u in authed),
            f"the page's calls carry the key ({len(authed)} of {len(api_calls)} API calls; the first, before the prompt, had none)",
        )
        check(kerrors == [], f"no page errors with a key: {kerrors}")
        kctx.close()
        browser.close()
    print(f"all webui checks passed in {time.time() - t_start:.1f} s", flush=True)


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", flush=True)
        sys.exit(1)
