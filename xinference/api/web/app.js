// The web page: plain DOM calls against the REST API of the server that served it.
// Validation is the API's own: the page sends what the form holds and shows the
// API's 4xx message next to the field it names.
"use strict";

const REFRESH_MS = 2000;
const $ = (id) => document.getElementById(id);

// ---- small helpers ---------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

async function api(method, path, body, signal) {
  const options = { method, headers: {}, signal };
  if (body !== undefined) {
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  return { ok: response.ok, status: response.status, data, headers: response.headers };
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

// What a failed API call says: a 4xx is the request refused (the user can fix it),
// anything else a fault of the server's, named as such.
function failure(response) {
  const detail = response.data && response.data.detail;
  const text = typeof detail === "string" ? detail : JSON.stringify(detail ?? null);
  return response.status >= 400 && response.status < 500
    ? `Refused: ${text}`
    : `Server error (HTTP ${response.status}): ${text}`;
}

// Messages about one model that must go once it is gone: element id -> model uid.
const aboutModel = {};

function say(id, text, uid = null) {
  $(id).textContent = text;
  if (uid === null) delete aboutModel[id];
  else aboutModel[id] = uid;
}

// "1 block", "2 blocks"
function plural(count, word) {
  return `${count} ${word}${count === 1 ? "" : "s"}`;
}

function ms(seconds) {
  return seconds === null || seconds === undefined ? "–" : `${(seconds * 1000).toFixed(2)} ms`;
}

// ---- launch form -----------------------------------------------------------------

// API option -> the element that shows its errors (the form's one model box
// stands for model_name and model_path).
const fieldErrors = {};
for (const field of document.querySelectorAll("#launch-form .field[data-fields]")) {
  for (const name of field.dataset.fields.split(" ")) {
    fieldErrors[name] = field.querySelector(".error");
  }
}

function clearErrors() {
  for (const node of document.querySelectorAll("#launch-form .error")) node.textContent = "";
  for (const node of document.querySelectorAll("#launch-form [aria-invalid]")) {
    node.removeAttribute("aria-invalid");
  }
  $("launch-error").textContent = "";
}

function showError(field, message) {
  const target = field && fieldErrors[field];
  if (!target) {
    $("launch-error").textContent = message;
    return;
  }
  target.textContent = message;
  const input = target.parentElement.querySelector("input, select");
  if (input) input.setAttribute("aria-invalid", "true");
}

// The option a 400 message is about: the one named first in it.
function fieldOf(message) {
  let best = null;
  let bestAt = Infinity;
  for (const name of Object.keys(fieldErrors)) {
    const match = new RegExp(`\\b${name}\\b`).exec(message);
    if (match && match.index < bestAt) { best = name; bestAt = match.index; }
  }
  return best;
}

function showApiError(response) {
  const detail = response.data && response.data.detail;
  if (Array.isArray(detail)) { // 422 from the request schema: one entry per field
    for (const item of detail) showError(item.loc[item.loc.length - 1], item.msg);
  } else {
    const message = typeof detail === "string" ? detail : `HTTP ${response.status}`;
    showError(fieldOf(message), message);
  }
}

function launchBody() {
  const form = $("launch-form");
  const value = (name) => form.elements[name].value.trim();
  const body = {
    replica: Number(value("replica")),
    enable_xavier: form.elements.enable_xavier.checked,
    xavier_transport: value("xavier_transport"),
    xavier_cross_layer_blocks: form.elements.xavier_cross_layer_blocks.checked,
    router: value("router"),
    router_busy_margin: Number(value("router_busy_margin")),
    dtype: value("dtype"),
    enforce_eager: form.elements.enforce_eager.checked,
    tensor_parallel_size: Number(value("tensor_parallel_size")),
    pipeline_parallel_size: Number(value("pipeline_parallel_size")),
    seed: Number(value("seed")),
  };
  const model = value("model");
  if (model) body[/[\\/]/.test(model) ? "model_path" : "model_name"] = model;
  if (value("model_uid")) body.model_uid = value("model_uid");
  if (value("xavier_gpu_cache_bytes")) {
    body.xavier_gpu_cache_bytes = `${value("xavier_gpu_cache_bytes")}${value("budget_unit")}`;
  }
  for (const name of ["block_size", "max_model_len", "max_num_seqs"]) {
    if (value(name)) body[name] = Number(value(name));
  }
  if (value("gpu_memory_utilization")) {
    body.gpu_memory_utilization = Number(value("gpu_memory_utilization"));
  }
  return body;
}

$("launch-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  clearErrors();
  const button = $("launch-button");
  button.disabled = true;
  say("launch-status", "Launching: engines are loading (progress below)…");
  refresh();
  try {
    const response = await api("POST", "/v1/models", launchBody());
    if (response.ok) {
      const uid = response.data.model_uid;
      say("launch-status", `Launched ${uid}: ${response.data.xavier}`, uid);
    } else if (response.status === 409) {
      say("launch-status", response.data.detail);
    } else if (response.status < 500) {
      say("launch-status", "Launch refused.");
      showApiError(response);
    } else {
      say("launch-status", `Launch failed: ${failure(response)}`);
    }
  } catch (error) {
    say("launch-status", `Launch failed: ${error}`);
  } finally {
    button.disabled = false;
    refresh();
  }
});

// ---- models and their replicas ----------------------------------------------------

// Models whose Terminate was clicked and awaits its confirmation (the cards are
// drawn again at every refresh, so the question lives here).
const confirming = new Set();

async function terminate(uid, button) {
  button.disabled = true;
  const response = await api("DELETE", `/v1/models/${encodeURIComponent(uid)}`);
  if (!response.ok) {
    button.disabled = false;
    $("connection").textContent = `Could not stop ${uid}: ${failure(response)}`;
  } else {
    // not tied to the model: its final counters stay once it is gone
    say("models-status", finalCounters(uid, response.data.xavier_counters || {}));
  }
  refresh();
}

// What each replica moved, from the counters a terminate returns (both tiers
// and both load paths, as the table had them).
function finalCounters(uid, counters) {
  const ranks = Object.keys(counters).sort((a, b) => Number(a) - Number(b));
  if (!ranks.length) return `Stopped ${uid}.`;
  const replicas = ranks.map((rank) => {
    const moved = counters[rank].totals || {};
    const blocks = (moved.device_tier_blocks ?? 0) + (moved.cpu_tier_blocks ?? 0);
    return `replica ${rank} loaded ${plural(blocks, "block")} from peers ` +
      `(${bytes(moved.received_useful_bytes ?? 0)}) in ${plural(moved.loads ?? 0, "load")} ` +
      `and sent ${bytes(moved.sent_useful_bytes ?? 0)}`;
  });
  return `Terminated ${uid}. Final counters: ${replicas.join("; ")}.`;
}

// Terminate, or while it awaits confirmation, the question and its two answers.
function terminateControls(model) {
  const uid = model.id;
  if (!confirming.has(uid)) {
    const stop = el("button", { type: "button", text: "Terminate", "aria-label": `Terminate ${uid}` });
    stop.addEventListener("click", () => { confirming.add(uid); refresh(); });
    return stop;
  }
  const yes = el("button", { type: "button", text: "Yes, terminate", "aria-label": `Yes, terminate ${uid}` });
  const keep = el("button", { type: "button", class: "secondary", text: "Keep serving", "aria-label": `Keep ${uid} serving` });
  yes.addEventListener("click", () => { confirming.delete(uid); terminate(uid, yes); });
  keep.addEventListener("click", () => { confirming.delete(uid); refresh(); });
  return el("div", { class: "confirm", role: "group", "aria-label": `Terminate ${uid}?` },
    el("span", { text: `Terminate ${uid}? Its engines stop; its final counters are shown above.` }),
    yes, keep);
}

function launchingCard(model, progress) {
  const card = el("article", { class: "model", "aria-label": `Model ${model.id}` });
  const total = model.replica || 1;
  const ready = model.replicas_ready || 0;
  // the share of the launch's steps done, engines loaded included (not only the
  // replicas that serve, which stay 0 until the last step)
  const done = progress ? progress.progress : 0;
  card.append(
    el("h3", { text: `${model.id} — ${model.status}` }),
    el("progress", {
      max: "1", value: String(done),
      "aria-label": `Launch of ${model.id}`,
    }),
    el("p", {
      class: "detail",
      text: `${ready}/${total} replicas ready · ${progress ? progress.detail : ""}` +
        (progress ? ` · ${progress.elapsed_s.toFixed(0)} s` : ""),
    }),
  );
  if (model.status === "launching") {
    const cancel = el("button", { type: "button", text: "Cancel launch", "aria-label": `Cancel the launch of ${model.id}` });
    cancel.addEventListener("click", () => terminate(model.id, cancel));
    card.append(cancel);
  }
  return card;
}

// One row per replica: [column header, value] pairs.
function replicaFigures(replica) {
  const x = replica.xavier;
  const rows = [
    ["State", x ? (x.closed ? "closed" : x.store ? "serving, cache mapped" : "serving, mapping cache") : "serving"],
    ["In flight", replica.requests_in_flight],
    ["Requests", replica.requests_total],
    ["Cached prompt tokens", `${replica.cached_prompt_tokens_total} / ${replica.prompt_tokens_total}`],
  ];
  if (!x) return rows;
  const store = x.store || {};
  const transport = x.transport || {};
  // both tiers and both load paths (the actor's loads and the engine's
  // lease-free READs), summed by the server as /metrics sums them
  const moved = x.totals || {};
  const tier = (name) => {
    const held = store[`${name}_snapshots`] || 0;
    const capacity = store[`${name}_capacity_blocks`] || 0;
    const used = store[`${name}_bytes`] || 0;
    const budget = held ? (used / held) * capacity : null;
    return `${held} / ${capacity} snapshots (${bytes(used)}${budget === null ? "" : ` of ${bytes(budget)}`})`;
  };
  const device = moved.device_tier_blocks ?? 0;
  const cpu = moved.cpu_tier_blocks ?? 0;
  rows.push(
    ["Device tier", tier("device")],
    ["CPU tier", tier("cpu")],
    ["Remote hits (device)", device],
    ["Remote hits (CPU)", cpu],
    ["External tokens", (device + cpu) * replica.block_size],
    ["Received wire / useful", `${bytes(moved.received_wire_bytes)} / ${bytes(moved.received_useful_bytes)}`],
    ["Sent wire / useful", `${bytes(moved.sent_wire_bytes)} / ${bytes(moved.sent_useful_bytes)}`],
    ["Loads (actor / lease-free)", `${moved.loads ?? 0} (${moved.actor_loads ?? 0} / ${moved.lease_free_loads ?? 0})`],
    ["Actor load p50 / p95", `${ms(x.load_latency.p50_s)} / ${ms(x.load_latency.p95_s)}`],
    ["Registration changes", transport.registration_changes ?? "–"],
    ["Demotions", store.demotions ?? "–"],
    ["Skips", store.skips ?? "–"],
    ["Load errors", x.actor.loads_failed],
  );
  return rows;
}

function readyCard(model, stats) {
  const card = el("article", { class: "model", "aria-label": `Model ${model.id}` });
  card.append(
    el("h3", { text: `${model.id} — ${model.status}` }),
    el("p", { class: "detail", text: `${model.xavier} · router ${model.router} · ${model.replica} replicas` }),
  );
  // A degraded model still serves on its other replicas: say which do not, and why.
  if (model.detail) card.append(el("p", { class: "detail degraded", text: model.detail }));
  card.append(terminateControls(model));
  if (!stats.length) return card;
  // One column per replica, one row per figure: stays narrow for a few replicas.
  const figures = stats.map((replica) => replicaFigures(replica));
  const table = el("table", { "aria-label": `Replicas of ${model.id}` });
  const head = el("tr", {}, el("th", { scope: "col", text: "Replica" }));
  for (const replica of stats) head.append(el("th", { scope: "col", text: String(replica.rank) }));
  table.append(el("thead", {}, head));
  const body = el("tbody");
  figures[0].forEach(([name], row) => {
    const line = el("tr", {}, el("th", { scope: "row", text: name }));
    stats.forEach((replica, i) => {
      line.append(el("td", {
        "data-rank": String(replica.rank), "data-figure": name, text: String(figures[i][row][1]),
      }));
    });
    body.append(line);
  });
  table.append(body);
  card.append(el("div", { class: "scroll" }, table));
  return card;
}

function fillModelSelects(ready) {
  for (const select of document.querySelectorAll(".model-select")) {
    const current = select.value;
    const ids = ready.map((model) => model.id);
    const have = [...select.options].map((option) => option.value);
    if (ids.join("\n") === have.join("\n")) continue;
    select.replaceChildren(...ids.map((id) => el("option", { value: id, text: id })));
    if (ids.includes(current)) select.value = current;
  }
}

// Ready, or degraded (some replicas gone or unresponsive, the others serve).
const serving = (model) => model.status === "ready" || model.status === "degraded";

let refreshing = false;
async function refresh() {
  if (refreshing) return;
  refreshing = true;
  try {
    const listing = await api("GET", "/v1/models");
    if (!listing.ok) throw new Error(`HTTP ${listing.status}`);
    const models = listing.data.data;
    const cards = await Promise.all(models.map(async (model) => {
      const uid = encodeURIComponent(model.id);
      if (!serving(model)) {
        const progress = await api("GET", `/v1/models/${uid}/progress`);
        return launchingCard(model, progress.ok ? progress.data : null);
      }
      const stats = await api("GET", `/v1/models/${uid}/stats`);
      return readyCard(model, stats.ok ? stats.data : []);
    }));
    $("models").replaceChildren(...(cards.length ? cards : [el("p", { class: "empty", text: "No model is launched." })]));
    for (const uid of confirming) {
      if (!models.some((model) => model.id === uid && serving(model))) confirming.delete(uid);
    }
    fillModelSelects(models.filter(serving));
    // a finished launch's status and a chat error go with their model
    const listed = new Set(models.map((model) => model.id));
    for (const [id, uid] of Object.entries(aboutModel)) {
      if (!listed.has(uid)) say(id, "");
    }
    $("connection").textContent = `Updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    $("connection").textContent = `Cannot reach the server: ${error.message}`;
    // what the page showed may be gone with the server: say so, not "No model"
    $("models").replaceChildren(el("p", {
      class: "empty", text: "The server does not answer: which models run is unknown until it does.",
    }));
  } finally {
    refreshing = false;
  }
}

// ---- prefix lookup and chat --------------------------------------------------------

$("prefix-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const model = $("prefix-model").value;
  const result = $("prefix-result");
  if (!model) { result.textContent = "Launch a model first."; return; }
  const messages = [{ role: "user", content: $("prefix-prompt").value }];
  const response = await api("POST", `/v1/models/${encodeURIComponent(model)}/prefix`, { messages });
  if (!response.ok) {
    result.textContent = `Lookup failed: ${failure(response)}`;
    return;
  }
  const hit = response.data;
  result.textContent = hit.holder === null
    ? `No replica holds a cached prefix of this prompt (${hit.prompt_tokens} tokens).`
    : `Replica ${hit.holder} holds ${plural(hit.prefix_blocks, "block")}: ${hit.prefix_tokens} of ${hit.prompt_tokens} prompt tokens.`;
});

$("chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const model = $("chat-model").value;
  say("chat-error", "");
  if (!model) { say("chat-error", "Launch a model first."); return; }
  const prompt = $("chat-prompt").value;
  const send = $("chat-send");
  send.disabled = true;
  try {
    const response = await api("POST", "/v1/chat/completions", {
      model,
      messages: [{ role: "user", content: prompt }],
      max_tokens: Number($("chat-max-tokens").value) || 16,
      temperature: 0,
    });
    if (!response.ok) {
      say("chat-error", failure(response), model);
      return;
    }
    const replica = response.headers.get("X-Xinference-Replica");
    const external = Number(response.headers.get("X-Xinference-Xavier-External-Tokens") || 0);
    const holder = response.headers.get("X-Xinference-Xavier-Holder");
    const usage = response.data.usage;
    const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    const verdict = external > 0
      ? `remote hit: ${external} tokens loaded from replica ${holder}`
      : "no remote hit";
    $("chat-log").prepend(el("li", { class: external > 0 ? "remote-hit" : "" },
      el("p", { class: "meta", text: `Served by replica ${replica} · ${verdict} · ${cached} of ${usage.prompt_tokens} prompt tokens cached` }),
      el("p", { class: "you", text: prompt }),
      el("p", { class: "reply", text: response.data.choices[0].message.content }),
    ));
    refresh();
  } catch (problem) {
    say("chat-error", `Request failed: ${problem}`, model);
  } finally {
    send.disabled = false;
  }
});

// The model names a launch takes, offered as the model box's suggestions (none
// for a caller who may not list them: the box takes any name or path).
async function fillModelNames() {
  const response = await api("GET", "/v1/model_registrations/LLM");
  if (!response.ok || !Array.isArray(response.data)) return;
  $("model-names").replaceChildren(...response.data.map((model) =>
    el("option", { value: model.model_name, label: model.description || model.model_name })));
}

fillModelNames().catch(() => {});
refresh();
setInterval(refresh, REFRESH_MS);
