// Ember's dashboard and chat playground. Plain JS, no build step, no CDN:
// everything it shows comes from this server's /stats, /health (downloads), /v1/models and
// /v1/chat/completions, called with the API key the user typed (kept in
// sessionStorage, this tab only). docs/ui.md.
"use strict";

const KEY = "ember.apiKey";
const POLL_MS = 1000;
const HISTORY = 60; // samples kept per model for rates and trends (one a second)
const $ = (id) => document.getElementById(id);

// ---- the API, with the key ------------------------------------------------
function headers(json) {
  const h = {};
  const key = sessionStorage.getItem(KEY);
  if (key) h["Authorization"] = "Bearer " + key;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function api(path, opts = {}) {
  const res = await fetch(path, { ...opts, headers: headers(opts.body !== undefined) });
  if (res.status === 401) askForKey("The server refused the API key (401). Enter the right one.");
  return res;
}

async function errorText(res) {
  try {
    const body = await res.json();
    return `${res.status}: ${(body.error && body.error.message) || JSON.stringify(body)}`;
  } catch (_) {
    return `${res.status} ${res.statusText}`;
  }
}

function askForKey(why) {
  const form = $("key-form");
  if (why) form.querySelector("label").textContent = why;
  // focus only when the bar appears: each refused poll asks again, and taking
  // focus then would move what the user is typing elsewhere into the key field
  if (!form.hidden) return;
  form.hidden = false;
  $("key-input").focus();
}

// ---- small DOM helpers (text only: nothing from the server becomes HTML) --
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}
const num = (x, d = 0) => (x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toLocaleString(undefined, { maximumFractionDigits: d, minimumFractionDigits: d }));
const pct = (x) => (x === null || x === undefined || Number.isNaN(x) ? "–" : `${Math.round(x * 100)}%`);
function bytes(n) {
  if (n === null || n === undefined) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}
function tile(label, value, hint, opts = {}) {
  const t = el("div", "tile" + (opts.bad ? " bad" : ""));
  if (opts.id) t.dataset.testid = opts.id;
  t.append(el("div", "l", label), el("div", "v", value));
  if (hint) t.append(el("div", "h", hint));
  return t;
}
function row(label, value, bad, title) {
  const r = el("div", "row" + (bad ? " bad" : ""));
  if (title) r.title = title;
  r.append(el("span", "k", label), el("span", "n", value));
  return r;
}
function panel(title, ...children) {
  const p = el("div", "panel");
  p.append(el("h3", null, title), ...children);
  return p;
}
function bar(parts) { // [[fraction, class], ...]
  const b = el("div", "bar");
  for (const [f, cls] of parts) {
    const s = el("span", cls);
    s.style.width = `${Math.max(0, Math.min(1, f || 0)) * 100}%`;
    b.append(s);
  }
  return b;
}
function legend(items) {
  const l = el("div", "legend");
  for (const [cls, text] of items) {
    const s = el("span");
    s.append(el("i", cls), document.createTextNode(text));
    l.append(s);
  }
  return l;
}

// ---- dashboard ----------------------------------------------------------------
const history = new Map(); // model name -> [{t, s}] (s: that model's stats)

// /stats of one engine, or (multi-model) {models: {name: stats}}: one section each.
function modelSections(stats) {
  if (stats.models && typeof stats.models === "object" && !Array.isArray(stats.models)) {
    return Object.entries(stats.models).map(([name, s]) => [name, { recent_requests: stats.recent_requests, ...s }]);
  }
  return [[stats.model || "model", stats]];
}

function rate(hist, get) { // per second, over the last ~5 s of samples
  if (hist.length < 2) return null;
  const a = hist[Math.max(0, hist.length - 6)], b = hist[hist.length - 1];
  const dt = (b.t - a.t) / 1000;
  const d = get(b.s) - get(a.s);
  return dt > 0 && d >= 0 ? d / dt : null;
}

function quantile(xs, q) {
  if (!xs.length) return null;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(q * s.length))];
}

function share(reqs) { // cached share of prompt tokens: {ram, ssd, total}
  let p = 0, ram = 0, ssd = 0;
  for (const r of reqs) { p += r.prompt_tokens || 0; ram += r.ram_cached_tokens || 0; ssd += r.ssd_cached_tokens || 0; }
  return p ? { ram: ram / p, ssd: ssd / p, total: (ram + ssd) / p, tokens: p } : null;
}

function renderModel(name, s, hist) {
  const sched = s.scheduler || {}, gw = s.gateway || {}, pc = s.prompt_cache, ssd = s.ssd_cache, spec = s.speculation;
  const box = el("div", "model");
  box.dataset.model = name;
  const h = el("h2", null, name);
  h.append(el("span", "sub", s.dead ? `engine stopped: ${s.dead}` : s.ready === false ? "not ready" : "ready"));
  box.append(h);

  // the batch, right now
  const tiles = el("div", "tiles");
  const running = gw.in_flight ?? sched.active_rows;
  tiles.append(
    tile("Requests running", num(running), "admitted, not yet finished", { id: "running" }),
    tile("Waiting for a batch slot", num(sched.queued), "queued behind a full batch", { id: "queued", bad: sched.queued > 0 && sched.active_rows >= sched.max_batch }),
    tile("Batch rows in use", `${num(sched.active_rows)} / ${num(sched.max_batch)}`, null, { id: "rows" }),
    tile("Decode speed", `${num(rate(hist, (x) => x.scheduler.generated_tokens), 1)}`, "tokens generated per second", { id: "decode" }),
    tile("Prefill speed", `${num(rate(hist, (x) => x.scheduler.prefilled_tokens ?? x.scheduler.prompt_tokens - x.scheduler.cached_tokens), 1)}`, "prompt tokens computed per second", { id: "prefill" }),
    tile("Requests served", num(sched.finished), `${num(sched.generated_tokens)} tokens generated in all`, { id: "finished" }),
  );
  tiles.children[2].append(bar([[sched.max_batch ? sched.active_rows / sched.max_batch : 0, "acc"]]));
  box.append(tiles);

  const grid = el("div", "grid");
  const recent = ((s.recent_requests && s.recent_requests.requests) || []).filter((r) => !r.model || r.model === name);

  // time to first token
  const ttfts = recent.map((r) => r.ttft_ms).filter((x) => x !== null && x !== undefined);
  const tp = panel("Time to first token, last requests");
  tp.dataset.testid = "ttft";
  if (ttfts.length) {
    const spark = el("div", "spark");
    const max = Math.max(...ttfts);
    for (const t of ttfts) {
      const b = el("span");
      b.style.height = `${Math.max(3, (t / max) * 100)}%`;
      b.title = `${num(t, 1)} ms`;
      spark.append(b);
    }
    tp.append(spark, row("median", `${num(quantile(ttfts, 0.5), 1)} ms`), row("slowest 10% above", `${num(quantile(ttfts, 0.9), 1)} ms`), row("requests shown", num(ttfts.length)));
  } else tp.append(el("p", "empty", "No request has finished yet."));
  grid.append(tp);

  // where prompts came from
  const cp = panel(`Prompt tokens served from cache, last ${recent.length || "N"} requests`);
  cp.dataset.testid = "cache-share";
  const withUsage = recent.filter((r) => r.prompt_tokens);
  if (withUsage.length) {
    const st = el("div", "stack");
    for (const r of withUsage) {
      const col = el("div", "col");
      const p = r.prompt_tokens;
      for (const [n, cls] of [[r.ram_cached_tokens, "ram"], [r.ssd_cached_tokens, "ssd"], [p - r.ram_cached_tokens - r.ssd_cached_tokens, "cold"]]) {
        const seg = el("span", cls);
        seg.style.height = `${(n / p) * 100}%`;
        col.append(seg);
      }
      col.title = `${p} prompt tokens: ${r.ram_cached_tokens} from RAM, ${r.ssd_cached_tokens} from SSD`;
      st.append(col);
    }
    const all = share(withUsage);
    const half = Math.floor(withUsage.length / 2);
    const before = half >= 3 ? share(withUsage.slice(0, half)) : null, after = half >= 3 ? share(withUsage.slice(half)) : null;
    const falling = before && after && after.total < before.total - 0.15;
    if (falling) cp.classList.add("bad");
    cp.append(st, legend([["ram", "RAM tier"], ["ssd", "SSD tier"], ["cold", "computed (not cached)"]]),
      row("from RAM", pct(all.ram)), row("from SSD", pct(all.ssd)),
      row("cache hit rate trend", falling ? `falling: ${pct(before.total)} → ${pct(after.total)}` : after ? `${pct(before.total)} → ${pct(after.total)}` : "–", falling,
        "the cached share of the older half of these requests against the newer half"));
  } else cp.append(el("p", "empty", "No request has finished yet."));
  grid.append(cp);

  // RAM tier
  if (pc) {
    const lookups = pc.hits + pc.misses;
    grid.append(panel("RAM prompt cache",
      row("prefixes held", num(pc.entries)),
      row("memory", `${bytes(pc.bytes)} of ${bytes(pc.max_bytes)}`), bar([[pc.max_bytes ? pc.bytes / pc.max_bytes : 0, "ram"]]),
      row("lookups that hit", lookups ? `${pct(pc.hits / lookups)} (${num(pc.hits)} of ${num(lookups)})` : "–"),
      row("evicted to make room", num(pc.evictions)),
      row("moved to SSD", num((pc.spills || 0) + (pc.demotions || 0)))));
  }

  // SSD tier and write-behind
  if (ssd) {
    const q = hist.slice(-6).map((x) => (x.s.ssd_cache || {}).pending_spill_bytes || 0);
    const growing = q.length >= 6 && q.every((v, i) => i === 0 || v > q[i - 1]);
    const faults = (ssd.write_failures || 0) + (ssd.failed_spills || 0) + (ssd.dropped_spills || 0) + (ssd.enospc || 0);
    const p = panel("SSD prompt cache",
      row("prefixes on disk", num(ssd.entries)),
      row("disk used", `${bytes(ssd.bytes)} of ${bytes(ssd.max_bytes)}`), bar([[ssd.max_bytes ? ssd.bytes / ssd.max_bytes : 0, "ssd"]]),
      row("restores (last took)", `${num(ssd.restores)} (${ssd.restore_ms_last === null || ssd.restore_ms_last === undefined ? "–" : num(ssd.restore_ms_last, 1) + " ms"})`),
      row("write-behind queue", `${num(ssd.pending_spills)} caches, ${bytes(ssd.pending_spill_bytes)}${growing ? " — growing" : ""}`, growing, "RAM caches waiting to be written to SSD; it drains while the engine is idle"),
      row("snapshots waiting", num(ssd.pending_snapshots)),
      row("durable on disk", `${num(ssd.durable)} of ${num(ssd.scheduled)} scheduled`),
      row("writes lost or failed", num(faults), faults > 0, "write failures, failed or dropped spills, disk full"),
      row("corrupt files deleted", num((ssd.corrupt_deleted || 0) + (ssd.mismatch_deleted || 0)), (ssd.corrupt_deleted || 0) + (ssd.mismatch_deleted || 0) > 0));
    if (growing || faults > 0) p.classList.add("bad");
    p.dataset.testid = "ssd";
    grid.append(p);
  }

  // speculation
  if (spec) {
    const prev = hist.length > 5 ? hist[hist.length - 6].s.speculation : null;
    const chosen = spec.gamma_chosen || {};
    let inUse = null, best = -1;
    for (const [g, n] of Object.entries(chosen)) {
      const d = n - ((prev && prev.gamma_chosen && prev.gamma_chosen[g]) || 0);
      if (d > best && d > 0) { best = d; inUse = g; }
    }
    const mode = spec.policy && spec.policy.mode;
    const fixed = spec.policy && spec.policy.fixed_gamma;
    const gammaText = inUse !== null ? `γ = ${inUse}` : fixed !== null && fixed !== undefined ? `γ = ${fixed}` : "idle";
    const totalChosen = Object.values(chosen).reduce((a, b) => a + b, 0);
    const gbars = el("div", "legend");
    for (const [g, n] of Object.entries(chosen)) gbars.append(el("span", null, `γ${g}: ${pct(totalChosen ? n / totalChosen : 0)}`));
    const lowAccept = spec.spec_decode_num_draft_tokens > 50 && spec.acceptance_rate < 0.2;
    grid.append(panel(`Speculative decoding: ${spec.drafter || spec.kind}`,
      row("draft tokens proposed", num(spec.spec_decode_num_draft_tokens)),
      row("accepted by the model", `${num(spec.spec_decode_num_accepted_tokens)} (${pct(spec.acceptance_rate)})`, lowAccept),
      bar([[spec.acceptance_rate, "acc"]]),
      row("tokens per model call", num(spec.mean_accept_len, 2), false, "mean accepted length: 1 + accepted / drafts"),
      row(`draft length in use (${mode || "fixed"})`, gammaText, false, "γ: draft tokens per round, the one chosen most in the last 5 s"),
      row("rounds without drafting", num(spec.plain_rounds)),
      gbars));
  }

  // what went wrong
  const problems = [];
  for (const [k, v] of Object.entries(s.fallbacks || {})) problems.push([k.replaceAll("_", " "), v]);
  if (spec) problems.push(["drafter faults", spec.draft_faults || 0]);
  for (const [k, v] of Object.entries(gw.rejected || {})) problems.push([`refused: ${k}`, v]);
  problems.push(["requests failed", sched.failed || 0], ["requests aborted", sched.aborted || 0]);
  const fp = panel("Fallbacks and refusals (should stay 0)", ...problems.map(([k, v]) => row(k, num(v), v > 0 && k !== "requests aborted")));
  if (problems.some(([k, v]) => v > 0 && k !== "requests aborted")) fp.classList.add("bad");
  fp.dataset.testid = "fallbacks";
  grid.append(fp);

  box.append(grid);
  return box;
}

// Hub downloads under way (issue #43): /health lists them, as {model, done_bytes,
// total_bytes}, while a model loads (the /stats below may still answer 503).
function renderPulls(pulls) {
  const box = $("pulls");
  box.hidden = !pulls.length;
  box.replaceChildren(...pulls.map((p) => {
    const frac = p.total_bytes ? p.done_bytes / p.total_bytes : null;
    const row = el("div", "pull");
    row.append(el("span", "pull-model", `Downloading ${p.model}`),
      el("span", "pull-bytes", `${bytes(p.done_bytes)} / ${p.total_bytes ? bytes(p.total_bytes) : "?"}`),
      el("span", "pull-pct", pct(frac)));
    if (frac !== null) row.append(bar([[Math.min(frac, 1), "pull-done"]]));
    return row;
  }));
}

async function pollPulls() {
  try { // /health answers 503 while loading, with the pulls in its body all the same
    const body = await (await fetch("/health")).json();
    renderPulls(body.pulls || []);
  } catch (_) { renderPulls([]); }
}

async function poll() {
  pollPulls();
  let ok = false;
  try {
    const res = await api("/stats");
    if (res.ok) {
      const stats = await res.json();
      const now = Date.now();
      const models = $("models");
      const boxes = [];
      for (const [name, s] of modelSections(stats)) {
        const hist = history.get(name) || [];
        hist.push({ t: now, s });
        while (hist.length > HISTORY) hist.shift();
        history.set(name, hist);
        boxes.push(renderModel(name, s, hist));
      }
      models.replaceChildren(...boxes);
      $("dash-error").hidden = true;
      ok = true;
    } else {
      $("dash-error").textContent = res.status === 503 ? "The engine is starting or draining…" : `Could not read /stats: ${await errorText(res)}`;
      $("dash-error").hidden = false;
    }
  } catch (e) {
    $("dash-error").textContent = `The server does not answer: ${e.message}`;
    $("dash-error").hidden = false;
  }
  const c = $("conn");
  c.textContent = ok ? "live" : "offline";
  c.className = "pill " + (ok ? "ok" : "bad");
}

// ---- playground ---------------------------------------------------------------
let messages = []; // the conversation sent to the model
let lastBody = null; // the last request, for the replay button
let controller = null;
let started = false; // polling runs (the key, if one is needed, was given)

async function loadModels() {
  const sel = $("model-select");
  const res = await api("/v1/models");
  if (!res.ok) return;
  const { data } = await res.json();
  const current = sel.value;
  sel.replaceChildren(...data.map((m) => el("option", null, m.id)));
  if (data.some((m) => m.id === current)) sel.value = current;
}

function addMessage(role, text) {
  const m = el("div", "msg " + role);
  if (text !== undefined) m.textContent = text;
  $("chat").append(m);
  m.scrollIntoView({ block: "end" });
  return m;
}

// One streamed answer: content, reasoning and tool calls each in their own block.
class Answer {
  constructor(replay) {
    this.box = addMessage("assistant");
    this.box.dataset.testid = "answer";
    if (replay) this.box.append(el("div", "tag", "replay of the last request"));
    this.reasoning = null; this.content = null; this.tools = new Map();
    this.text = ""; this.toolCalls = [];
    this.t0 = performance.now(); this.tFirst = null; this.tokens = 0;
  }
  first() { if (this.tFirst === null) this.tFirst = performance.now(); }
  addReasoning(t) {
    if (!this.reasoning) {
      const d = el("details", "reasoning"); d.open = true;
      d.append(el("summary", null, "Reasoning"));
      this.reasoningText = el("div"); d.append(this.reasoningText);
      this.box.append(d); this.reasoning = d;
    }
    this.reasoningText.textContent += t;
  }
  addContent(t) {
    if (!this.content) { this.content = el("div", "content"); this.content.dataset.testid = "content"; this.box.append(this.content); }
    this.content.textContent += t; this.text += t;
  }
  addTool(tc) {
    let t = this.tools.get(tc.index);
    if (!t) {
      const box = el("div", "toolcall");
      box.dataset.testid = "toolcall";
      const name = el("span", "name"), args = el("span", "args");
      box.append(el("span", null, "tool call "), name, el("span", null, "("), args, el("span", null, ")"));
      this.box.append(box);
      t = { id: tc.id, name, args, call: { id: tc.id, type: "function", function: { name: "", arguments: "" } } };
      this.tools.set(tc.index, t); this.toolCalls.push(t.call);
    }
    if (tc.id) t.call.id = tc.id;
    if (tc.function && tc.function.name) { t.call.function.name += tc.function.name; t.name.textContent = t.call.function.name; }
    if (tc.function && tc.function.arguments) { t.call.function.arguments += tc.function.arguments; t.args.textContent = t.call.function.arguments; }
  }
  usage(u) {
    const line = el("div", "usage");
    line.dataset.testid = "usage";
    const cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
    line.append(el("span", null, `prompt ${num(u.prompt_tokens)} tokens`));
    const c = el("span", cached > 0 ? "hit" : null, cached > 0 ? `cache hit: ${num(cached)} cached (${pct(cached / u.prompt_tokens)})` : "no cached prefix");
    c.dataset.testid = "cached";
    c.dataset.cached = String(cached);
    line.append(c, el("span", null, `answer ${num(u.completion_tokens)} tokens`));
    if (this.tFirst !== null) {
      line.append(el("span", null, `first token after ${num(this.tFirst - this.t0)} ms`));
      const dt = (performance.now() - this.tFirst) / 1000;
      if (u.completion_tokens > 1 && dt > 0) line.append(el("span", null, `${num((u.completion_tokens - 1) / dt, 1)} tokens/s`));
    }
    const sp = u.speculation;
    if (sp && sp.drafted) line.append(el("span", null, `speculation: ${num(sp.accepted)} of ${num(sp.drafted)} drafts accepted`));
    this.box.append(line);
  }
}

async function send(body, replay) {
  lastBody = body;
  $("replay").disabled = true; $("send").disabled = true; $("stop").disabled = false;
  controller = new AbortController();
  const ans = new Answer(replay);
  try {
    const res = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true), body: JSON.stringify(body), signal: controller.signal });
    if (!res.ok) {
      if (res.status === 401) askForKey("The server refused the API key (401). Enter the right one.");
      ans.box.remove();
      const e = addMessage("error", `Refused — ${await errorText(res)}`);
      e.dataset.testid = "chat-error";
      return;
    }
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += value;
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, i); buf = buf.slice(i + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
          for (const ch of chunk.choices || []) {
            const d = ch.delta || {};
            if (d.reasoning_content) { ans.first(); ans.addReasoning(d.reasoning_content); }
            if (d.content) { ans.first(); ans.addContent(d.content); }
            for (const tc of d.tool_calls || []) { ans.first(); ans.addTool(tc); }
          }
          if (chunk.usage) ans.usage(chunk.usage);
          ans.box.scrollIntoView({ block: "end" });
        }
      }
    }
    if (!replay) {
      const msg = { role: "assistant", content: ans.text };
      if (ans.toolCalls.length) msg.tool_calls = ans.toolCalls;
      messages.push(msg);
    }
  } catch (e) {
    if (e.name !== "AbortError") addMessage("error", `Stream failed: ${e.message}`);
  } finally {
    controller = null;
    $("send").disabled = false; $("stop").disabled = true; $("replay").disabled = lastBody === null;
  }
}

function submitPrompt(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  addMessage("user", text);
  messages.push({ role: "user", content: text });
  send({
    model: $("model-select").value || undefined,
    messages: messages.slice(),
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number($("max-tokens").value) || 64,
    temperature: Number($("temperature").value) || 0,
  }, false);
}

// ---- views and wiring ---------------------------------------------------------
function show() {
  const view = location.hash === "#playground" ? "playground" : "dashboard";
  for (const v of ["dashboard", "playground"]) {
    $("view-" + v).hidden = v !== view;
    $("tab-" + v).classList.toggle("active", v === view);
  }
  if (view === "playground" && started) loadModels();
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-button").addEventListener("click", () => { askForKey(); $("key-input").focus(); });
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("key-input").value.trim();
    if (key) sessionStorage.setItem(KEY, key); else sessionStorage.removeItem(KEY);
    $("key-input").value = "";
    $("key-form").hidden = true;
    if (started) { poll(); loadModels(); }
  });
  $("key-clear").addEventListener("click", () => { sessionStorage.removeItem(KEY); $("key-form").hidden = true; });
  $("chat-form").addEventListener("submit", submitPrompt);
  $("prompt").addEventListener("keydown", (ev) => { if (ev.key === "Enter" && !ev.shiftKey) submitPrompt(ev); });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("replay").addEventListener("click", () => { if (lastBody && !controller) { addMessage("user", "↻ " + (lastBody.messages.at(-1).content || "")); send(lastBody, true); } });
  $("clear").addEventListener("click", () => { messages = []; lastBody = null; $("replay").disabled = true; $("chat").replaceChildren(); });
  window.addEventListener("hashchange", show);
  start();
});

// Ask for the key before any API call when the server wants one and this tab has none.
async function start() {
  let required = false;
  try { required = (await (await fetch("/ui/config.json")).json()).api_key_required; } catch (_) { /* poll reports it */ }
  if (required && !sessionStorage.getItem(KEY)) {
    askForKey("This server wants an API key. It is kept in this tab only (sessionStorage) and sent with each API call.");
    await new Promise((resolve) => $("key-form").addEventListener("submit", resolve, { once: true }));
  }
  started = true;
  show();
  poll();
  setInterval(poll, POLL_MS);
}
