// tern's chat page: streams /v1/chat/completions and keeps conversations in localStorage.
// No framework: the page is small, and the server must carry it with no build step.
"use strict";

const KEYS = {
  convs: "tern.conversations",
  current: "tern.current",
  settings: "tern.settings",
  apiKey: "tern.apiKey",
};
const SETTING_NUMBERS = ["temperature", "top_p", "top_k", "min_p", "max_tokens"];

const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
};
const uid = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

function loadJson(key, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(key));
    return v ?? fallback;
  } catch {
    return fallback;
  }
}

// What another version of the page (or a hand edit) left in storage is taken only if it has
// the shape this one reads.
function storedConvs() {
  const v = loadJson(KEYS.convs, []);
  return Array.isArray(v)
    ? v.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages))
    : [];
}
function storedSettings() {
  const v = loadJson(KEYS.settings, {});
  return v && typeof v === "object" && !Array.isArray(v) ? v : {};
}

const state = {
  convs: storedConvs(),
  currentId: localStorage.getItem(KEYS.current),
  settings: storedSettings(),
  apiKey: localStorage.getItem(KEYS.apiKey) || "",
  props: null,
  uiDefaults: {}, // the server's --ui-config, under the user's own settings
  pending: [], // data URLs of images attached to the next message
  busy: null, // { controller, conv, msg } while a reply streams
  editing: null, // id of the user message being edited
};

// ---- storage ----------------------------------------------------------------------------

let saveTimer = null;
function saveNow() {
  clearTimeout(saveTimer);
  saveTimer = null;
  try {
    localStorage.setItem(KEYS.convs, JSON.stringify(state.convs));
    if (state.currentId) localStorage.setItem(KEYS.current, state.currentId);
    else localStorage.removeItem(KEYS.current);
  } catch (e) {
    // Mostly the quota (images are stored inline): say so rather than lose the page.
    notice(`Could not save the conversations in this browser: ${e.message}`);
  }
}
// While a reply streams, writes are batched so a long answer is not serialized per token.
function saveSoon() {
  if (!saveTimer) saveTimer = setTimeout(saveNow, 400);
}

const current = () => state.convs.find((c) => c.id === state.currentId) || null;

// A setting: the user's, else the server's --ui-config default, else unset.
const setting = (k) => (k in state.settings ? state.settings[k] : state.uiDefaults[k]);

// --ui-config, in llama-server's web UI names (systemMessage, temperature, ...) or this page's.
function uiDefaults(u) {
  const names = {
    systemMessage: "system", system: "system", temperature: "temperature", top_p: "top_p",
    top_k: "top_k", min_p: "min_p", max_tokens: "max_tokens",
    enable_thinking: "enable_thinking", custom: "custom",
  };
  const out = {};
  for (const [k, v] of Object.entries(u && typeof u === "object" ? u : {})) {
    const ours = names[k];
    if (!ours || v === null || v === undefined) continue;
    out[ours] = ours === "custom" && typeof v !== "string" ? JSON.stringify(v) : String(v);
  }
  return out;
}

// ---- server -----------------------------------------------------------------------------

async function api(path, init = {}) {
  for (;;) {
    const headers = new Headers(init.headers || {});
    if (state.apiKey) headers.set("Authorization", `Bearer ${state.apiKey}`);
    if (init.body) headers.set("Content-Type", "application/json");
    const res = await fetch(path, { ...init, headers });
    if (res.status !== 401) return res;
    // The key is missing or wrong: ask once per refusal; a cancelled prompt returns the 401.
    const key = await askKey();
    if (key === null) return res;
    state.apiKey = key;
    localStorage.setItem(KEYS.apiKey, key);
  }
}

async function errorText(res) {
  const text = await res.text().catch(() => "");
  try {
    const j = JSON.parse(text);
    if (j.error) return `${res.status}: ${j.error.message || JSON.stringify(j.error)}`;
  } catch {
    // not JSON: the body as it is
  }
  return `${res.status} ${res.statusText}${text ? ": " + text.slice(0, 300) : ""}`;
}

async function loadProps(attempt = 0) {
  let res;
  try {
    res = await api("props");
  } catch (e) {
    notice(`The server cannot be reached: ${e.message}`);
    return;
  }
  if (res.status === 503 && attempt < 120) {
    // The model is still loading.
    $("model-ctx").textContent = "loading…";
    setTimeout(() => loadProps(attempt + 1), 1000);
    return;
  }
  if (!res.ok) {
    notice(`/props: ${await errorText(res)}`);
    return;
  }
  state.props = await res.json();
  const p = state.props;
  state.uiDefaults = uiDefaults(p.ui_settings);
  const name = p.model_alias || (p.model_path || "").split(/[\\/]/).pop() || "model";
  $("model-name").textContent = name;
  const nCtx = p.default_generation_settings && p.default_generation_settings.n_ctx;
  $("model-ctx").textContent = nCtx ? `ctx ${nCtx}` : "";
  document.title = `${name} · tern`;
  $("attach").hidden = !visionOn();
}

const visionOn = () => !!(state.props && state.props.modalities && state.props.modalities.vision);

// ---- notices ----------------------------------------------------------------------------

function notice(text) {
  let n = $("notice");
  if (!n) {
    n = el("div", "notice");
    n.id = "notice";
    n.setAttribute("role", "alert");
    $("main").insertBefore(n, $("messages"));
  }
  n.textContent = text;
  n.hidden = false;
  clearTimeout(notice.timer);
  notice.timer = setTimeout(() => (n.hidden = true), 8000);
}

// ---- the conversation list ----------------------------------------------------------------

function renderList() {
  const ul = $("conv-list");
  ul.replaceChildren();
  const sorted = [...state.convs].sort((a, b) => b.updated - a.updated);
  for (const c of sorted) {
    const li = el("li", c.id === state.currentId ? "active" : "");
    const open = el("button", "conv", c.title || "New chat");
    open.type = "button";
    open.title = c.title || "New chat";
    if (c.id === state.currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => {
      selectConv(c.id);
      closeSide();
      $("input").focus();
    });
    const del = el("button", "del", "✕");
    del.type = "button";
    del.setAttribute("aria-label", `Delete “${c.title || "New chat"}”`);
    // Two steps, so a stray click or keypress loses nothing.
    del.addEventListener("click", () => {
      if (!del.classList.contains("armed")) {
        del.classList.add("armed");
        del.textContent = "Delete?";
        setTimeout(() => {
          del.classList.remove("armed");
          del.textContent = "✕";
        }, 3000);
        return;
      }
      deleteConv(c.id);
    });
    li.append(open, del);
    ul.append(li);
  }
}

function selectConv(id) {
  state.currentId = id;
  state.editing = null;
  saveNow();
  renderList();
  renderMessages();
}

function newConv() {
  const c = current();
  // An empty chat is reused rather than piling up.
  if (c && c.messages.length === 0) {
    $("input").focus();
    return;
  }
  state.currentId = null;
  state.editing = null;
  saveNow();
  renderList();
  renderMessages();
  $("input").focus();
}

function deleteConv(id) {
  if (state.busy && state.busy.conv.id === id) state.busy.controller.abort();
  state.convs = state.convs.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = null;
  saveNow();
  renderList();
  renderMessages();
}

// ---- messages ---------------------------------------------------------------------------

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  const c = current();
  if (!c || c.messages.length === 0) {
    const e = el("div", "empty");
    e.id = "empty";
    e.append(el("h1", "", $("model-name").textContent));
    e.append(el("p", "muted", "Type a message below. Enter sends, Shift+Enter adds a line, Esc stops."));
    box.append(e);
    return;
  }
  for (const m of c.messages) box.append(messageEl(c, m));
  scrollDown(true);
}

function lastAssistant(c) {
  for (let i = c.messages.length - 1; i >= 0; i--) {
    if (c.messages[i].role === "assistant") return c.messages[i];
  }
  return null;
}

function messageEl(conv, m) {
  const art = el("article", `msg ${m.role}`);
  art.dataset.id = m.id;
  const bubble = el("div", "bubble");
  art.append(bubble);
  if (m.role === "user") {
    if (state.editing === m.id) {
      bubble.append(editor(conv, m));
    } else {
      if (m.images && m.images.length) {
        const imgs = el("div", "images");
        for (const src of m.images) {
          const img = el("img");
          img.src = src;
          img.alt = "attached image";
          imgs.append(img);
        }
        bubble.append(imgs);
      }
      bubble.append(el("div", "text", m.content));
    }
  } else {
    fillAssistant(bubble, m);
  }
  const meta = el("div", "meta");
  art.append(meta);
  fillMeta(conv, m, meta);
  return art;
}

function fillAssistant(bubble, m) {
  const streaming = state.busy && state.busy.msg === m;
  if (m.reasoning) {
    const d = el("details", "reasoning");
    // Open while the model is still thinking; closed once the answer starts or it ends,
    // unless the reader toggled it.
    const auto = streaming && !m.content && !(m.tool_calls && m.tool_calls.length);
    d.open = m.reasoningOpen ?? auto;
    const s = el("summary", "", auto ? "Thinking…" : "Reasoning");
    d.append(s, el("div", "reasoning-body", m.reasoning));
    // A reader's choice (click, or Enter/Space on the summary, which also clicks) sticks
    // across redraws; `open` is still the old state when the click arrives.
    s.addEventListener("click", () => {
      m.reasoningOpen = !d.open;
    });
    bubble.append(d);
  }
  for (const t of m.tool_calls || []) {
    const box = el("div", "tool-call");
    const head = el("div", "tool-head");
    head.append(el("span", "tag", "tool call"), el("code", "", t.name || "…"));
    let args = t.arguments || "";
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch {
      // still streaming or not JSON: shown as it came
    }
    const pre = el("pre");
    pre.append(el("code", "", args));
    box.append(head, pre);
    bubble.append(box);
  }
  if (m.content) {
    const c = el("div", "content md");
    c.innerHTML = Markdown.render(m.content); // escaped by the renderer
    bubble.append(c);
  } else if (streaming && !m.reasoning && !(m.tool_calls && m.tool_calls.length)) {
    bubble.append(el("div", "typing", "…"));
  }
  if (m.error) bubble.append(el("div", "error", m.error));
}

function fillMeta(conv, m, meta) {
  meta.replaceChildren();
  const busy = !!state.busy;
  if (m.role === "assistant") {
    const parts = [];
    const t = m.timings;
    if (t && t.predicted_n) {
      parts.push(`${t.predicted_n} tokens`);
      if (t.predicted_per_second) parts.push(`${t.predicted_per_second.toFixed(1)} t/s`);
    }
    if (m.stopped) parts.push("stopped");
    else if (m.finish_reason === "length") parts.push("stopped at the token limit");
    const stats = el("span", "stats", parts.join(" · "));
    if (t && t.prompt_n !== undefined) {
      stats.title = `prompt: ${t.prompt_n} tokens` +
        (t.prompt_per_second ? ` at ${t.prompt_per_second.toFixed(1)} t/s` : "") +
        (t.cache_n ? `, ${t.cache_n} cached` : "");
    }
    meta.append(stats);
    if (m.content) meta.append(metaButton("Copy", () => copyText(m.content)));
    if (!busy && lastAssistant(conv) === m) {
      meta.append(metaButton("Regenerate", () => regenerate(conv, m)));
    }
  } else if (!busy && state.editing !== m.id) {
    meta.append(metaButton("Edit", () => {
      state.editing = m.id;
      renderMessages();
      const ta = document.querySelector(".msg.user .edit textarea");
      if (ta) {
        ta.focus();
        ta.setSelectionRange(ta.value.length, ta.value.length);
      }
    }));
  }
}

function metaButton(label, onClick) {
  const b = el("button", "link", label);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

function editor(conv, m) {
  const form = el("form", "edit");
  const ta = el("textarea");
  ta.value = m.content;
  ta.rows = Math.min(10, Math.max(2, m.content.split("\n").length));
  ta.setAttribute("aria-label", "Edit the message");
  const row = el("div", "actions");
  const cancel = el("button", "btn", "Cancel");
  cancel.type = "button";
  const ok = el("button", "btn primary", "Send");
  ok.type = "submit";
  row.append(cancel, ok);
  form.append(ta, row);
  const stopEditing = () => {
    state.editing = null;
    renderMessages();
  };
  cancel.addEventListener("click", stopEditing);
  ta.addEventListener("keydown", (e) => {
    if (e.key === "Escape") {
      e.preventDefault();
      e.stopPropagation();
      stopEditing();
    } else if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      form.requestSubmit();
    }
  });
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const text = ta.value.trim();
    if (!text || state.busy) return;
    // The edited turn replaces the old one and everything after it.
    const i = conv.messages.indexOf(m);
    m.content = text;
    conv.messages.length = i + 1;
    state.editing = null;
    if (i === 0) conv.title = titleOf(text);
    conv.updated = Date.now();
    generate(conv);
  });
  return form;
}

function regenerate(conv, m) {
  if (state.busy) return;
  conv.messages.length = conv.messages.indexOf(m);
  generate(conv);
}

function updateMessage(conv, m) {
  if (conv.id !== state.currentId) return;
  const art = document.querySelector(`.msg[data-id="${m.id}"]`);
  if (!art) return;
  const bubble = art.querySelector(".bubble");
  bubble.replaceChildren();
  fillAssistant(bubble, m);
  // The newest thought is at the bottom of the reasoning box.
  const thoughts = bubble.querySelector(".reasoning[open] .reasoning-body");
  if (thoughts) thoughts.scrollTop = thoughts.scrollHeight;
  fillMeta(conv, m, art.querySelector(".meta"));
  scrollDown(false);
}

let pinned = true;
function scrollDown(force) {
  const box = $("messages");
  if (force || pinned) box.scrollTop = box.scrollHeight;
}

// ---- sending ----------------------------------------------------------------------------

const titleOf = (text) => {
  const t = text.replace(/\s+/g, " ").trim();
  return t.length > 48 ? t.slice(0, 47) + "…" : t || "Image";
};

function send() {
  const input = $("input");
  const text = input.value.trim();
  if (state.busy || (!text && state.pending.length === 0)) return;
  let c = current();
  if (!c) {
    c = { id: uid(), title: titleOf(text), created: Date.now(), updated: Date.now(), messages: [] };
    state.convs.push(c);
    state.currentId = c.id;
  }
  const m = { id: uid(), role: "user", content: text };
  if (state.pending.length) m.images = state.pending;
  c.messages.push(m);
  c.updated = Date.now();
  input.value = "";
  autosize();
  state.pending = [];
  renderAttachments();
  generate(c);
}

function requestMessages(conv) {
  const out = [];
  const sys = (setting("system") || "").trim();
  if (sys) out.push({ role: "system", content: sys });
  for (const m of conv.messages) {
    if (m.role === "user") {
      const content = m.images && m.images.length
        ? [{ type: "text", text: m.content },
           ...m.images.map((url) => ({ type: "image_url", image_url: { url } }))]
        : m.content;
      out.push({ role: "user", content });
    } else if (m.role === "assistant") {
      // A call cut off mid-arguments cannot be sent back; a turn that failed before saying
      // anything is left out.
      const calls = (m.tool_calls || []).filter((t) => {
        try {
          return t.name && typeof JSON.parse(t.arguments) === "object";
        } catch {
          return false;
        }
      });
      if (!m.content && !m.reasoning && calls.length === 0) continue;
      const a = { role: "assistant", content: m.content };
      if (calls.length) {
        a.tool_calls = calls.map((t) => ({
          id: t.id, type: "function", function: { name: t.name, arguments: t.arguments },
        }));
      }
      out.push(a);
    }
  }
  return out;
}

function requestBody(conv) {
  const body = { messages: requestMessages(conv), stream: true };
  for (const k of SETTING_NUMBERS) {
    const v = setting(k);
    if (v !== undefined && v !== "") body[k] = Number(v);
  }
  const thinking = setting("enable_thinking");
  if (thinking === "true" || thinking === "false") {
    body.chat_template_kwargs = { enable_thinking: thinking === "true" };
  }
  const custom = parseCustom(setting("custom"));
  if (custom.value) {
    for (const [k, v] of Object.entries(custom.value)) {
      body[k] = k === "chat_template_kwargs" && body[k] ? { ...body[k], ...v } : v;
    }
  }
  return body;
}

function parseCustom(text) {
  if (!text || !text.trim()) return { value: null };
  try {
    const v = JSON.parse(text);
    if (v === null || typeof v !== "object" || Array.isArray(v)) {
      return { error: "Extra request fields must be a JSON object, like {\"seed\": 42}." };
    }
    return { value: v };
  } catch (e) {
    return { error: `Extra request fields are not valid JSON: ${e.message}` };
  }
}

async function generate(conv) {
  const msg = { id: uid(), role: "assistant", content: "", reasoning: "", tool_calls: [] };
  conv.messages.push(msg);
  conv.updated = Date.now();
  const controller = new AbortController();
  state.busy = { controller, conv, msg };
  setBusy(true);
  saveNow();
  renderList();
  renderMessages();
  let frame = 0;
  const redraw = () => {
    if (!frame) {
      frame = requestAnimationFrame(() => {
        frame = 0;
        updateMessage(conv, msg);
      });
    }
  };
  try {
    const res = await api("v1/chat/completions", {
      method: "POST",
      body: JSON.stringify(requestBody(conv)),
      signal: controller.signal,
    });
    if (!res.ok) {
      msg.error = await errorText(res);
    } else {
      await readEvents(res, (ev) => {
        applyChunk(msg, ev);
        saveSoon();
        redraw();
      });
    }
  } catch (e) {
    if (e.name === "AbortError") msg.stopped = true;
    else msg.error = e.message || String(e);
  } finally {
    cancelAnimationFrame(frame);
    state.busy = null;
    setBusy(false);
    conv.updated = Date.now();
    saveNow();
    if (conv.id === state.currentId) renderMessages();
    $("input").focus();
  }
}

// Server-sent events from a fetch body: `data:` lines, events split by a blank line.
async function readEvents(res, onEvent) {
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let k;
    while ((k = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, k);
      buf = buf.slice(k + 2);
      const data = block.split("\n")
        .filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue; // a comment (keep-alive ping)
      if (data === "[DONE]") return;
      let ev;
      try {
        ev = JSON.parse(data);
      } catch {
        continue;
      }
      onEvent(ev);
    }
  }
}

function applyChunk(msg, ev) {
  if (ev.error) {
    msg.error = ev.error.message || JSON.stringify(ev.error);
    return;
  }
  for (const ch of ev.choices || []) {
    if (ch.index) continue; // the page asks for one choice
    const d = ch.delta || {};
    if (d.reasoning_content) msg.reasoning += d.reasoning_content;
    if (d.content) msg.content += d.content;
    for (const tc of d.tool_calls || []) {
      const i = tc.index ?? msg.tool_calls.length;
      const t = msg.tool_calls[i] || (msg.tool_calls[i] = { id: "", name: "", arguments: "" });
      if (tc.id) t.id = tc.id;
      if (tc.function && tc.function.name) t.name += tc.function.name;
      if (tc.function && tc.function.arguments) t.arguments += tc.function.arguments;
    }
    if (ch.finish_reason) msg.finish_reason = ch.finish_reason;
  }
  if (ev.timings) {
    const t = ev.timings;
    msg.timings = {
      prompt_n: t.prompt_n,
      prompt_per_second: t.prompt_per_second,
      cache_n: t.cache_n,
      predicted_n: t.predicted_n,
      predicted_per_second: t.predicted_per_second,
    };
  }
}

function stop() {
  if (state.busy) state.busy.controller.abort();
}

function setBusy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  document.body.classList.toggle("busy", on);
}

// ---- images -----------------------------------------------------------------------------

function addImages(files) {
  if (!visionOn()) return;
  for (const f of files) {
    if (!f.type.startsWith("image/")) continue;
    const r = new FileReader();
    r.onload = () => {
      state.pending.push(r.result);
      renderAttachments();
    };
    r.onerror = () => notice(`Could not read ${f.name}`);
    r.readAsDataURL(f);
  }
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  box.hidden = state.pending.length === 0;
  state.pending.forEach((src, i) => {
    const fig = el("div", "thumb");
    const img = el("img");
    img.src = src;
    img.alt = `attachment ${i + 1}`;
    const rm = el("button", "rm", "✕");
    rm.type = "button";
    rm.setAttribute("aria-label", `Remove attachment ${i + 1}`);
    rm.addEventListener("click", () => {
      state.pending.splice(i, 1);
      renderAttachments();
    });
    fig.append(img, rm);
    box.append(fig);
  });
}

// ---- dialogs ----------------------------------------------------------------------------

function askKey() {
  const dlg = $("keyprompt");
  if (dlg.open) return Promise.resolve(null);
  $("key-input").value = state.apiKey;
  dlg.returnValue = "";
  dlg.showModal();
  return new Promise((resolve) => {
    dlg.addEventListener("close", () => {
      const v = $("key-input").value.trim();
      resolve(dlg.returnValue === "save" && v ? v : null);
    }, { once: true });
  });
}

function openSettings() {
  const f = $("settings-form");
  f.system.value = setting("system") || "";
  const defaults = (state.props && state.props.default_generation_settings &&
    state.props.default_generation_settings.params) || {};
  for (const k of SETTING_NUMBERS) {
    f[k].value = setting(k) ?? "";
    const d = k === "max_tokens" ? defaults.n_predict : defaults[k];
    f[k].placeholder = d === undefined ? "" : d === -1 ? "no limit" : String(d);
  }
  f.enable_thinking.value = setting("enable_thinking") || "";
  f.custom.value = setting("custom") || "";
  f.api_key.value = state.apiKey;
  $("settings-error").hidden = true;
  $("settings").showModal();
}

function saveSettings(e) {
  const f = $("settings-form");
  if (e.submitter && e.submitter.value !== "save") return;
  const custom = parseCustom(f.custom.value);
  if (custom.error) {
    e.preventDefault();
    const err = $("settings-error");
    err.textContent = custom.error;
    err.hidden = false;
    f.custom.focus();
    return;
  }
  const s = { system: f.system.value, enable_thinking: f.enable_thinking.value, custom: f.custom.value };
  for (const k of SETTING_NUMBERS) if (f[k].value !== "") s[k] = f[k].value;
  state.settings = s;
  localStorage.setItem(KEYS.settings, JSON.stringify(s));
  state.apiKey = f.api_key.value.trim();
  if (state.apiKey) localStorage.setItem(KEYS.apiKey, state.apiKey);
  else localStorage.removeItem(KEYS.apiKey);
  if (!state.props) loadProps();
}

// ---- layout -----------------------------------------------------------------------------

function autosize() {
  const ta = $("input");
  ta.style.height = "auto";
  ta.style.height = Math.min(ta.scrollHeight, 240) + "px";
}

function openSide() {
  document.body.classList.add("side-open");
  $("scrim").hidden = false;
  $("new-chat").focus();
}

function closeSide() {
  document.body.classList.remove("side-open");
  $("scrim").hidden = true;
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // No clipboard API (plain HTTP on another host): copy through a selection.
    const ta = el("textarea");
    ta.value = text;
    document.body.append(ta);
    ta.select();
    document.execCommand("copy");
    ta.remove();
  }
}

// ---- wiring -----------------------------------------------------------------------------

function init() {
  const input = $("input");
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  input.addEventListener("input", autosize);
  input.addEventListener("paste", (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])];
    if (files.length && visionOn()) {
      e.preventDefault();
      addImages(files);
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    newConv();
    closeSide();
  });
  $("open-side").addEventListener("click", openSide);
  $("close-side").addEventListener("click", closeSide);
  $("scrim").addEventListener("click", closeSide);
  $("open-settings").addEventListener("click", openSettings);
  $("settings-form").addEventListener("submit", saveSettings);
  $("attach").addEventListener("click", () => $("file").click());
  $("file").addEventListener("change", (e) => {
    addImages([...e.target.files]);
    e.target.value = "";
  });
  const main = $("main");
  main.addEventListener("dragover", (e) => {
    if (visionOn()) e.preventDefault();
  });
  main.addEventListener("drop", (e) => {
    if (!visionOn()) return;
    e.preventDefault();
    addImages([...e.dataTransfer.files]);
  });
  $("messages").addEventListener("scroll", () => {
    const b = $("messages");
    pinned = b.scrollHeight - b.scrollTop - b.clientHeight < 40;
  });
  $("messages").addEventListener("click", (e) => {
    const b = e.target.closest("[data-copy]");
    if (!b) return;
    const code = b.closest(".code").querySelector("code");
    copyText(code.textContent);
    b.textContent = "Copied";
    setTimeout(() => (b.textContent = "Copy"), 1500);
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && !document.querySelector("dialog[open]")) {
      if (state.busy) {
        e.preventDefault();
        stop();
      } else if (document.body.classList.contains("side-open")) {
        closeSide();
      }
    } else if (e.key.toLowerCase() === "o" && e.shiftKey && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      newConv();
    }
  });
  // Another tab's changes show here when this one is idle.
  window.addEventListener("storage", (e) => {
    if (e.key === KEYS.convs && !state.busy) {
      state.convs = storedConvs();
      renderList();
      renderMessages();
    }
  });

  if (state.currentId && !current()) state.currentId = null;
  renderList();
  renderMessages();
  loadProps();
  input.focus();
}

init();
