// MawForge dashboard: one EventSource (/dashboard/events) feeds the heatmap, the charts, the
// plan bars and the request table; the chat box talks to the server's own OpenAI endpoint.
// Plain canvas and SVG, no libraries, nothing fetched from outside this server.
"use strict";

const $ = (id) => document.getElementById(id);
// the server's root: "" at /, "/replicas/NAME" when a replica's page is shown through `serve --replicas`
const ROOT = location.pathname.replace(/\/[^/]*$/, "");
const state = { hello: null, cells: null, charts: {}, messages: [], frames: 0, selected: null, lastFrame: null };
const HISTORY = 150;                 // chart points kept (30 s at 200 ms)
const FADE = 5;                      // frames an event stays visible on the heatmap
// drawn on top of the residency colour, most telling first
const EVENTS = [
  ["misses", "#e5534b", "miss (read from the pack)"],
  ["evictions", "#e0a030", "evicted"],
  ["prefetch_wasted", "#d04fc0", "prefetch wasted"],
  ["prefetch_useful", "#3cc8d8", "prefetch useful"],
  ["hits", "#46c46b", "hit"],
  ["prefetch_loads", "#8d7be8", "prefetched"],
];
const BASE = { empty: "#1b2029", resident: "#2d4a7a", prefetched: "#5b4a8a" };

// ---- formatting ---------------------------------------------------------------------------
function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const a = Math.abs(n);
  if (a >= 2 ** 30) return (n / 2 ** 30).toFixed(2) + " GiB";
  if (a >= 2 ** 20) return (n / 2 ** 20).toFixed(1) + " MiB";
  if (a >= 2 ** 10) return (n / 2 ** 10).toFixed(1) + " KiB";
  return Math.round(n) + " B";
}
const fmtPct = (x) => (x === null || x === undefined) ? "–" : (100 * x).toFixed(1) + "%";
const fmtS = (x) => (x === null || x === undefined) ? "–" : (x < 1 ? (1000 * x).toFixed(1) + " ms" : x.toFixed(2) + " s");
const fmtNum = (x, d = 2) => (x === null || x === undefined) ? "–" : Number(x).toFixed(d);
const FIELDS = [              // [telemetry key, label, formatter] for the last response and the table
  ["prompt_tokens", "prompt tokens", String], ["cached_tokens", "cached tokens", String], ["completion_tokens", "completion tokens", String],
  ["ttft_s", "TTFT", fmtS], ["decode_tok_s", "decode tok/s", (x) => fmtNum(x)],
  ["hit_rate", "hit rate", fmtPct], ["hits", "hits", String], ["misses", "misses", String],
  ["evictions", "evictions", String], ["materialized_bytes", "read (materialized)", fmtBytes],
  ["prefetched_bytes", "prefetched", fmtBytes], ["demand_load_s", "demand-read stall", fmtS],
  ["prefetch_stall_s", "prefetch stall", fmtS], ["peak_rss_bytes", "peak RSS", fmtBytes],
  ["finish_reason", "finish", String],
];
const FORMAT = Object.fromEntries(FIELDS.map(([k, , f]) => [k, f]));

function cookieKey() {
  const m = document.cookie.match(/(?:^|; )mawforge_key=([^;]*)/);
  return m ? decodeURIComponent(m[1]) : null;
}
function authHeaders() {
  const key = cookieKey();
  return key ? { Authorization: "Bearer " + key } : {};
}

// ---- the event stream ---------------------------------------------------------------------
function connect() {
  const es = new EventSource(ROOT + "/dashboard/events");
  es.addEventListener("hello", (e) => onHello(JSON.parse(e.data)));
  es.addEventListener("frame", (e) => onFrame(JSON.parse(e.data)));
  es.addEventListener("requests", (e) => onRequests(JSON.parse(e.data)));
  es.onopen = () => { $("conn").textContent = "live"; $("conn").className = "pill on"; };
  es.onerror = () => { $("conn").textContent = "reconnecting"; $("conn").className = "pill off"; };
}

function onHello(h) {
  state.hello = h;
  $("model").textContent = `${h.model} · ${h.architecture} · ${h.n_layers} layers × ${h.n_experts} experts, top-${h.top_k} · policy ${h.policy}, prefetch ${h.prefetch} · context ${h.context}`;
  $("cache-caption").textContent = `layers (rows) × experts (columns), every ${Math.round(1000 * h.interval_s)} ms`;
  const n = h.n_layers * h.n_experts;
  state.cells = { base: new Array(n).fill("empty"), pinned: new Uint8Array(n), ev: new Int8Array(n).fill(-1), age: new Uint8Array(n) };
  legend();
  drawPlan(null);
  drawHeatmap();
}

function onFrame(f) {
  if (!state.cells) return;
  state.frames++;
  const c = state.cells;
  c.base.fill("empty");
  c.pinned.fill(0);
  for (const i of f.resident) c.base[i] = "resident";
  for (const i of f.prefetched) c.base[i] = "prefetched";
  for (const i of f.pinned) c.pinned[i] = 1;
  for (let i = 0; i < c.age.length; i++) if (c.age[i] > 0) c.age[i]--;
  // the most telling event of this frame wins the cell
  for (let j = EVENTS.length - 1; j >= 0; j--) {
    for (const i of f.events[EVENTS[j][0]] || []) { c.ev[i] = j; c.age[i] = FADE; }
  }
  drawHeatmap();
  const E = state.hello.plan.E;
  $("cache-summary").textContent = `${f.resident.length} blocks resident (${fmtBytes(f.used_bytes)} of ${fmtBytes(E)}), ` +
    `${f.pinned.length} pinned, ${f.prefetched.length} prefetched and not yet used · KV position ${f.kv_pos}` +
    (f.request_id ? ` · ${f.request_id}` : "");
  const pc = f.prompt_cache;
  $("prompt-cache").textContent = pc ? `prompt cache: ${pc.hits} hits of ${pc.lookups}, ${pc.cached_tokens} tokens ` +
    `cached, ${pc.entries} saved (${fmtBytes(pc.held_bytes)} of ${fmtBytes(pc.budget_bytes)})` : "prompt cache off";
  $("phase").textContent = f.phase; $("phase").className = "pill " + f.phase;
  $("rss").textContent = fmtBytes(f.rss_bytes); $("peak-rss").textContent = fmtBytes(f.peak_rss_bytes);
  $("queue").textContent = f.queue_depth;
  state.lastFrame = f;
  drawPlan(f);
  if (f.point) {
    for (const k of ["tok_s", "hit_rate", "bytes_per_token", "stall_ms_per_s"]) pushPoint(k, f.point[k]);
  }
}

// ---- heatmap ------------------------------------------------------------------------------
function legend() {
  const items = [["resident", BASE.resident], ["prefetched, unused", BASE.prefetched], ["not resident", BASE.empty]]
    .concat(EVENTS.map(([, col, label]) => [label, col]));
  $("legend").innerHTML = items.map(([l, col]) => `<span><i style="background:${col}"></i>${l}</span>`).join("") +
    `<span><i style="border:2px solid #fff"></i>pinned</span>`;
}

function drawHeatmap() {
  const h = state.hello, c = state.cells, cv = $("heatmap");
  if (!h || !c) return;
  const W = cv.clientWidth || 600;
  const cw = Math.max(2, Math.floor((W - 40) / h.n_experts));
  const ch = Math.max(3, Math.min(28, Math.floor(420 / h.n_layers)));
  cv.width = W; cv.height = ch * h.n_layers + 18;
  const g = cv.getContext("2d");
  g.fillStyle = "#0c0f13"; g.fillRect(0, 0, cv.width, cv.height);
  g.font = "10px system-ui";
  // residency fills the cell; the last event sits inside it for FADE frames, so both stay readable
  const inset = Math.max(1, Math.floor(Math.min(cw, ch) / 5));
  for (let l = 0; l < h.n_layers; l++) {
    g.fillStyle = "#8a93a3";
    if (ch >= 10 || l % Math.ceil(10 / ch) === 0) g.fillText(String(l), 2, 14 + l * ch + ch / 2 + 3);
    for (let e = 0; e < h.n_experts; e++) {
      const i = l * h.n_experts + e, x = 36 + e * cw, y = 14 + l * ch;
      g.fillStyle = BASE[c.base[i]];
      g.fillRect(x, y, cw - 1, ch - 1);
      if (c.age[i] > 0 && c.ev[i] >= 0) {
        g.fillStyle = EVENTS[c.ev[i]][1];
        g.fillRect(x + inset, y + inset, cw - 1 - 2 * inset, ch - 1 - 2 * inset);
      }
      if (c.pinned[i]) { g.strokeStyle = "#fff"; g.lineWidth = 1.5; g.strokeRect(x + .75, y + .75, cw - 2.5, ch - 2.5); }
    }
  }
  g.fillStyle = "#8a93a3"; g.fillText("layer \\ expert →", 36, 10);
}

// ---- time series --------------------------------------------------------------------------
const CHART_FMT = { tok_s: (x) => fmtNum(x, 1), hit_rate: fmtPct, bytes_per_token: fmtBytes, stall_ms_per_s: (x) => fmtNum(x, 1) };
function pushPoint(k, v) {
  const s = state.charts[k] || (state.charts[k] = []);
  s.push(v === undefined ? null : v);
  if (s.length > HISTORY) s.shift();
  if (v !== null && v !== undefined) $("v-" + k).textContent = CHART_FMT[k](v);
  drawChart(k);
}
function drawChart(k) {
  const cv = $("c-" + k), s = state.charts[k] || [];
  cv.width = cv.clientWidth || 200; cv.height = 90;
  const g = cv.getContext("2d");
  g.fillStyle = "#0c0f13"; g.fillRect(0, 0, cv.width, cv.height);
  const vals = s.filter((v) => v !== null);
  if (!vals.length) return;
  let lo = Math.min(0, ...vals), hi = Math.max(...vals);
  if (k === "hit_rate") { lo = 0; hi = 1; }
  if (hi <= lo) hi = lo + 1;
  const slots = Math.max(40, s.length);
  const x = (i) => 4 + (cv.width - 8) * i / (slots - 1), y = (v) => cv.height - 12 - (cv.height - 20) * (v - lo) / (hi - lo);
  g.strokeStyle = "#2a303a"; g.beginPath(); g.moveTo(0, y(lo)); g.lineTo(cv.width, y(lo)); g.stroke();
  g.strokeStyle = "#5aa9ff"; g.lineWidth = 1.5; g.beginPath();
  let pen = false;
  s.forEach((v, i) => {
    if (v === null) { pen = false; return; }
    if (pen) g.lineTo(x(i), y(v)); else { g.moveTo(x(i), y(v)); pen = true; }
  });
  g.stroke();
  g.fillStyle = "#8a93a3"; g.font = "10px system-ui"; g.fillText("max " + CHART_FMT[k](hi), 4, 10);
}

// ---- plan against measured memory ---------------------------------------------------------
function drawPlan(f) {
  const h = state.hello;
  if (!h) return;
  const p = h.plan, svg = $("plan-bars"), W = svg.clientWidth || 800;
  const rss = f ? f.rss_bytes : 0, peak = f ? f.peak_rss_bytes : 0;
  const scale = Math.max(p.budget_bytes || 0, p.F, peak) * 1.05, left = 70, w = W - left - 10;
  const px = (n) => left + w * n / scale;
  const parts = [["C", p.C, "#5aa9ff"], ["E", p.E, "#46c46b"], ["K", p.K, "#c9a227"], ["O", p.O, "#8a93a3"]];
  let x = 0, out = "";
  for (const [name, n, col] of parts) {
    const x0 = px(x), x1 = px(x + n);
    out += `<rect x="${x0}" y="8" width="${Math.max(0, x1 - x0)}" height="26" fill="${col}"><title>${name} ${fmtBytes(n)}</title></rect>`;
    if (x1 - x0 > 60) out += `<text x="${x0 + 4}" y="26" fill="#06121f" font-size="11">${name} ${fmtBytes(n)}</text>`;
    x += n;
  }
  out += `<text x="0" y="26" fill="#8a93a3" font-size="12">plan F</text>`;
  out += `<text x="0" y="62" fill="#8a93a3" font-size="12">RSS</text>`;
  out += `<rect x="${left}" y="44" width="${px(rss) - left}" height="26" fill="#e0a030"><title>RSS ${fmtBytes(rss)}</title></rect>`;
  out += `<line x1="${px(peak)}" x2="${px(peak)}" y1="42" y2="72" stroke="#fff" stroke-width="2"/>`;
  out += `<text x="${left + 4}" y="62" fill="#06121f" font-size="11" data-testid="rss-label">${fmtBytes(rss)} (peak ${fmtBytes(peak)})</text>`;
  if (p.budget_bytes) {
    out += `<line x1="${px(p.budget_bytes)}" x2="${px(p.budget_bytes)}" y1="2" y2="78" stroke="#e5534b" stroke-width="2" stroke-dasharray="4 3"/>`;
    out += `<text x="${Math.min(px(p.budget_bytes) - 4, W - 10)}" y="92" fill="#e5534b" font-size="11" text-anchor="end">budget ${fmtBytes(p.budget_bytes)}</text>`;
  }
  out += `<text x="${left}" y="110" fill="#8a93a3" font-size="11">C ${fmtBytes(p.C)} + E ${fmtBytes(p.E)} (${p.cache_percent.toFixed(1)}% of experts) + K ${fmtBytes(p.K)} + P ${fmtBytes(p.P)} + O ${fmtBytes(p.O)} = F ${fmtBytes(p.F)}</text>`;
  svg.innerHTML = out;
  $("plan-caption").textContent = p.budget_bytes ? `budget ${fmtBytes(p.budget_bytes)} (${p.budget_source})` : "no memory budget given";
}

// ---- requests and replay ------------------------------------------------------------------
function cell(k, v) { return `<td data-field="${k}" data-value="${v}">${FORMAT[k] ? FORMAT[k](v) : v}</td>`; }
function onRequests(rows) {
  const body = $("requests").querySelector("tbody");
  body.innerHTML = rows.slice().reverse().map((r) =>
    `<tr data-request-id="${r.request_id}" class="${r.request_id === state.selected ? "selected" : ""}"><td>${r.request_id}</td>` +
    ["prompt_tokens", "completion_tokens", "ttft_s", "decode_tok_s", "hit_rate", "materialized_bytes"].map((k) => cell(k, r[k])).join("") +
    `<td data-field="stall_s" data-value="${r.demand_load_s + r.prefetch_stall_s}">${fmtS(r.demand_load_s + r.prefetch_stall_s)}</td>` +
    cell("finish_reason", r.finish_reason) + "</tr>").join("");
  body.querySelectorAll("tr").forEach((tr) => tr.addEventListener("click", () => replay(tr.dataset.requestId)));
}

async function replay(rid) {
  state.selected = rid;
  document.querySelectorAll("#requests tbody tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.requestId === rid));
  const box = $("replay");
  box.textContent = "replaying " + rid + "…";
  const r = await fetch(ROOT + "/dashboard/api/replay/" + encodeURIComponent(rid), { headers: authHeaders() });
  const d = await r.json();
  if (!r.ok) { box.textContent = d.error ? d.error.message : "replay failed"; return; }
  const bar = (label, rate, cls, note) => `<div class="bar" data-testid="replay-row"><span>${label}</span>` +
    `<span class="track"><span class="fill ${cls}" style="display:block;width:${(100 * (rate || 0)).toFixed(1)}%"></span></span>` +
    `<span>${fmtPct(rate)} · ${note}</span></div>`;
  let html = `<h3>${rid}: ${d.steps} steps, cache ${fmtBytes(d.capacity_bytes)}</h3>`;
  if (d.live) html += bar("live (cache as it was)", d.live.hit_rate, "live", `${d.live.hits} hits, ${d.live.misses} misses`);
  for (const row of d.rows) {
    const label = row.policy === "belady" ? "Belady (bound, from empty)" : row.policy === "belady-pinned" ?
      "Belady with pins (from empty)" : `${row.policy_spec} replayed (from empty)`;
    html += row.status === "ok" ? bar(label, row.hit_rate, row.policy.startsWith("belady") ? "oracle" : "", `${row.hits} hits, ${row.misses} misses`)
      : `<div class="bar"><span>${label}</span><span>${row.note}</span></div>`;
  }
  if (d.lookahead) html += `<p class="muted">router lookahead is live-only; the replays do not include it</p>`;
  box.innerHTML = html;
}

// ---- chat ---------------------------------------------------------------------------------
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role; div.textContent = text;
  $("messages").appendChild(div); $("messages").scrollTop = 1e9;
  return div;
}

function showTelemetry(rid, t) {
  $("last-id").textContent = rid;
  $("last-telemetry").innerHTML = FIELDS.map(([k, label, f]) =>
    `<dt>${label}</dt><dd data-field="${k}" data-value="${t[k]}">${f(t[k])}</dd>`).join("");
}

async function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || !state.hello) return;
  $("prompt").value = ""; $("send").disabled = true;
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.dataset.state = "streaming";
  let reply = "", rid = null, telemetry = null;
  try {
    const r = await fetch(ROOT + "/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({ model: state.hello.model, messages: state.messages, stream: true,
        max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value),
        stream_options: { include_usage: true } }),
    });
    if (!r.ok) { const e = await r.json(); throw new Error(e.error ? e.error.message : r.statusText); }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, cut).trim(); buf = buf.slice(cut + 2);
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const c = JSON.parse(data);
        if (c.error) throw new Error(c.error.message);
        rid = c.id;
        for (const ch of c.choices || []) if (ch.delta && ch.delta.content) { reply += ch.delta.content; out.textContent = reply; }
        if (c.telemetry) telemetry = c.telemetry;
      }
    }
    state.messages.push({ role: "assistant", content: reply });
    if (telemetry) showTelemetry(rid, telemetry);
    out.dataset.state = "done";
  } catch (e) {
    out.className = "msg error"; out.textContent = "error: " + e.message; out.dataset.state = "error";
  } finally {
    $("send").disabled = false;
  }
}

$("chat-form").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) send(e); });
$("clear").addEventListener("click", () => { state.messages = []; $("messages").innerHTML = ""; });
window.addEventListener("resize", () => { drawHeatmap(); Object.keys(state.charts).forEach(drawChart); drawPlan(state.lastFrame); });
window.mawforgeDashboard = state;      // for tests and curious users
connect();
