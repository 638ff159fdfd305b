// slotstream's web app: a chat over the server's OpenAI endpoint (/v1/chat/completions,
// streamed) and a live view of the pool fed by /stats/stream. Plain JS, no dependencies,
// no requests to anything but this server.
"use strict";

const $ = (id) => document.getElementById(id);

// ---- The API key: from the URL's fragment (#key=..., never sent to the server in the
// URL), else the settings field; kept in this tab's sessionStorage only.
const KEY_ITEM = "slotstream-api-key";
(function keyFromFragment() {
  const m = location.hash.match(/(?:^#|&)key=([^&]*)/);
  if (m) {
    sessionStorage.setItem(KEY_ITEM, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
})();
$("api-key").value = sessionStorage.getItem(KEY_ITEM) || "";
$("api-key").addEventListener("change", () => {
  sessionStorage.setItem(KEY_ITEM, $("api-key").value.trim());
  $("key-needed").hidden = true;
  restartStats();
});

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function keyNeeded() {
  $("key-needed").hidden = false;
  $("settings").open = true;
  $("api-key").focus();
}

$("settings-toggle").addEventListener("click", () => {
  $("settings").open = !$("settings").open;
});

// ---- Server-sent events read from a fetch (EventSource cannot send the key).
// Calls onEvent(name, data) for each event; resolves when the stream ends.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of frame.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}

// ---- Markdown, small and safe: the text is escaped first, so the only tags are those
// made here; links only for http(s) addresses.
function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function inline(s) {
  // s is escaped; code spans are cut out first so nothing inside them is formatted.
  const codes = [];
  s = s.replace(/`([^`\n]+)`/g, (_, c) => `\u0000${codes.push(c) - 1}\u0000`);
  s = s
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>")
    .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)"]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[i]}</code>`);
}

function markdown(text) {
  const out = [];
  const parts = escapeHtml(text).split(/^```/m);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      // A fenced block (possibly still open while streaming): its first line is the language.
      const nl = part.indexOf("\n");
      const lang = nl < 0 ? part : part.slice(0, nl);
      const code = nl < 0 ? "" : part.slice(nl + 1);
      const cls = /^[\w+-]+$/.test(lang.trim()) ? ` class="language-${lang.trim()}"` : "";
      out.push(`<pre><code${cls}>${code.replace(/\n$/, "")}</code></pre>`);
      return;
    }
    let list = null;
    const closeList = () => {
      if (list) out.push(`</${list}>`);
      list = null;
    };
    let para = [];
    const closePara = () => {
      if (para.length) out.push(`<p>${para.map(inline).join("<br>")}</p>`);
      para = [];
    };
    for (const line of part.replace(/^[^\n]*\n?/, i === 0 ? "$&" : "").split("\n")) {
      let m;
      if ((m = line.match(/^(#{1,6})\s+(.*)$/))) {
        closePara(); closeList();
        const h = Math.min(6, m[1].length + 2);
        out.push(`<h${h}>${inline(m[2])}</h${h}>`);
      } else if ((m = line.match(/^\s*(?:[-*+]|(\d+)[.)])\s+(.*)$/))) {
        closePara();
        const kind = m[1] ? "ol" : "ul";
        if (list !== kind) { closeList(); out.push(`<${kind}>`); list = kind; }
        out.push(`<li>${inline(m[2])}</li>`);
      } else if (line.trim() === "") {
        closePara(); closeList();
      } else {
        closeList();
        para.push(line);
      }
    }
    closePara(); closeList();
  });
  return out.join("");
}

// ---- The chat.
const history_ = [];
let controller = null;

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  if (role === "user") el.textContent = text;
  else el.innerHTML = '<div class="who"></div><details class="reasoning" hidden><summary>Reasoning</summary><div class="body"></div></details><div class="content"></div>';
  $("messages").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function number(id) {
  const v = parseFloat($(id).value);
  return Number.isFinite(v) ? v : undefined;
}

async function send(text) {
  history_.push({ role: "user", content: text });
  addMessage("user", text);
  const el = addMessage("assistant", "");
  const who = el.querySelector(".who");
  const reasoningBox = el.querySelector(".reasoning");
  const reasoningBody = reasoningBox.querySelector(".body");
  const content = el.querySelector(".content");
  who.textContent = "…";
  let reasoning = "";
  let answer = "";
  let drawn = false;
  const draw = () => {
    drawn = false;
    if (reasoning) {
      reasoningBox.hidden = false;
      reasoningBody.textContent = reasoning;
    }
    content.innerHTML = markdown(answer);
    el.scrollIntoView({ block: "end" });
  };
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history_);
  const body = {
    messages,
    stream: true,
    temperature: number("temperature"),
    top_p: number("top_p"),
    max_tokens: number("max_tokens") && Math.round(number("max_tokens")),
  };
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let finish = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      if (response.status === 401) keyNeeded();
      let message = response.status + " " + response.statusText;
      try { message = (await response.json()).error.message || message; } catch (_) { /* not JSON */ }
      throw new Error(message);
    }
    who.textContent = "assistant";
    await readEvents(response, (_, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the server failed the reply");
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        if (d.reasoning_content) reasoning += d.reasoning_content;
        if (d.content) answer += d.content;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (!drawn) { drawn = true; requestAnimationFrame(draw); }
    });
    draw();
    who.textContent = "assistant" + (finish && finish !== "stop" ? ` (${finish})` : "");
    el.dataset.done = "true";
  } catch (e) {
    draw();
    if (e.name === "AbortError") {
      who.textContent = "assistant (stopped)";
      el.dataset.done = "stopped";
    } else {
      who.textContent = "error";
      el.classList.add("error");
      content.textContent = e.message;
      el.dataset.done = "error";
      history_.pop(); // the question is not part of the conversation
      return;
    }
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  history_.push({ role: "assistant", content: answer });
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
// Aborting the fetch closes the connection, which the server takes as a cancel.
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  history_.length = 0;
  $("messages").replaceChildren();
});

// ---- The live view.
const GB = 1e9;
let previousRows = null;
let statsController = null;

function gib(bytes) {
  return (bytes / 2 ** 30).toFixed(2) + " GiB";
}

function drawHeatmap(resident) {
  const canvas = $("heatmap");
  const rows = resident.rows.length;
  const cols = resident.num_experts;
  if (!rows || !cols) return;
  const avail = Math.max(200, $("heatmap-box").clientWidth - 8);
  const cw = Math.max(1, Math.floor(avail / cols));
  const ch = Math.max(2, Math.min(14, Math.floor(320 / rows)));
  if (canvas.width !== cols * cw || canvas.height !== rows * ch) {
    canvas.width = cols * cw;
    canvas.height = rows * ch;
  }
  const ctx = canvas.getContext("2d");
  const styles = getComputedStyle(document.documentElement);
  const color = { off: styles.getPropertyValue("--off"), lit: styles.getPropertyValue("--lit"), fresh: styles.getPropertyValue("--new") };
  const bit = (row, e) => {
    const s = row;
    const digit = s.length - 1 - (e >> 2);
    return digit >= 0 && (parseInt(s[digit], 16) >> (e & 3)) & 1;
  };
  for (let r = 0; r < rows; r++) {
    for (let e = 0; e < cols; e++) {
      const on = bit(resident.rows[r], e);
      const was = previousRows && previousRows[r] ? bit(previousRows[r], e) : on;
      ctx.fillStyle = on ? (was ? color.lit : color.fresh) : color.off;
      ctx.fillRect(e * cw, r * ch, cw - (cw > 2 ? 1 : 0), ch - 1);
    }
  }
  const signature = resident.rows.join(",");
  if (canvas.dataset.signature !== signature) {
    canvas.dataset.signature = signature;
    canvas.dataset.changes = String(Number(canvas.dataset.changes || 0) + 1);
  }
  canvas.dataset.resident = String(resident.count);
  previousRows = resident.rows;
  const total = rows * cols;
  $("resident-text").textContent = resident.streamed
    ? `${resident.count} of ${total} records in slots`
    : `all ${total} records resident (mapped, no pool)`;
}

function drawPlan(plan) {
  if (!plan) return;
  const rows = [
    ["budget", gib(plan.budget)], ["resident weights", gib(plan.resident_weights)],
    [`context (${plan.context} tokens)`, gib(plan.context_state)], ["workspaces", gib(plan.workspaces)],
    ["read staging", gib(plan.staging)], ["runtime", gib(plan.runtime)], ["prompt cache", gib(plan.prompt_cache)],
    [`pool (${plan.slots} slots, floor ${plan.floor}, ${plan.records} records)`, gib(plan.pool)], ["unused", gib(plan.unused)],
  ];
  const tbody = document.createElement("tbody");
  for (const [name, value] of rows) {
    const tr = tbody.insertRow();
    tr.insertCell().textContent = name;
    tr.insertCell().textContent = value;
  }
  $("plan").replaceChildren(tbody);
}

function showStats(s) {
  if (!s.loaded) {
    $("status").textContent = "loading the model…";
    return;
  }
  $("status").textContent = s.queued_or_running ? `${s.queued_or_running} request(s) running or queued` : "idle";
  $("model").textContent = s.model;
  const pool = s.pool;
  const last = s.last;
  $("hit-rate").textContent = pool && pool.hits + pool.misses > 0 ? (100 * pool.hit_rate).toFixed(1) + "%" : "–";
  $("disk").textContent = pool ? (s.disk_gbps).toFixed(2) + " GB/s" : "none";
  $("slots").textContent = pool ? `${pool.slots} slots` : "mapped";
  const req = s.request;
  const tps = req && req.decode_tps != null ? req.decode_tps : last && last.decode_tps;
  $("tps").textContent = tps ? tps.toFixed(1) + " tok/s" : "–";
  if (req && req.phase !== "decode") {
    $("prefill").max = Math.max(1, req.prompt_tokens);
    $("prefill").value = req.prefilled;
    $("prefill-text").textContent = `${req.phase}: ${req.prefilled} of ${req.prompt_tokens} tokens`;
  } else if (req) {
    $("prefill").value = $("prefill").max;
    $("prefill-text").textContent = `decoding: ${req.generated} tokens`;
  } else if (last) {
    $("prefill").value = $("prefill").max;
    $("prefill-text").textContent = `last: ${last.prefill_tokens} tokens at ${last.prefill_tps.toFixed(1)} tok/s (${last.reused_prompt_tokens} reused)`;
  }
  drawHeatmap(s.resident);
  drawPlan(s.plan);
}

async function statsLoop() {
  for (;;) {
    const mine = new AbortController();
    statsController = mine;
    try {
      const response = await fetch("/stats/stream", { headers: headers(), signal: mine.signal });
      if (response.status === 401) {
        $("status").textContent = "API key needed";
        keyNeeded();
        return; // restarted when a key is entered
      }
      if (!response.ok) throw new Error(String(response.status));
      await readEvents(response, (name, data) => {
        if (name === "stats") showStats(JSON.parse(data));
      });
    } catch (e) {
      if (mine.signal.aborted) return;
      $("status").textContent = "disconnected; retrying…";
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

function restartStats() {
  if (statsController) statsController.abort();
  statsLoop();
}

statsLoop();
