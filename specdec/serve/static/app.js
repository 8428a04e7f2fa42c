// specdec's playground: chats through this server's /v1/chat/completions, streaming, and colours each
// token by how it came (specdec_tokens). No build step, nothing fetched from another host.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];          // {role, content} of the chat so far
let lastBody = null;              // the last request sent, for compare / curl / Python
let lastPrompt = null;

function key() { return sessionStorage.getItem("specdec-key") || ""; }

function settings(overrides) {
  const k = $("k").value.trim();
  const body = {
    messages: conversation.slice(), stream: true, stream_options: {include_usage: true},
    specdec_tokens: true, specdec_stats: true, drafter: $("drafter").value,
    temperature: Number($("temperature").value), top_p: Number($("top_p").value),
    seed: Number($("seed").value), max_tokens: Number($("max_tokens").value),
  };
  if (k && k !== "auto") body.num_draft_tokens = Number(k); else if (k === "auto") body.num_draft_tokens = "auto";
  return Object.assign(body, overrides || {});
}

function showError(text) { $("error").textContent = text; }

// POST `body`; call onEvent(parsed SSE object) per event; resolve with {ttft, seconds} or throw.
async function stream(body, onEvent) {
  const headers = {"Content-Type": "application/json"};
  if (key()) headers["Authorization"] = "Bearer " + key();
  const start = performance.now();
  const reply = await fetch("/v1/chat/completions", {method: "POST", headers, body: JSON.stringify(body)});
  if (reply.status === 401) {
    $("keyform").hidden = false;
    throw new Error("this server needs an API key: enter it above, then send again");
  }
  if (!reply.ok) {
    let message = reply.status + " " + reply.statusText;
    try { message += ": " + (await reply.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  const reader = reply.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", ttft = null;
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const event = JSON.parse(line.slice(6));
      if (event.error) throw new Error(event.error.message);
      if (ttft === null && event.specdec_tokens) ttft = (performance.now() - start) / 1000;
      onEvent(event);
    }
  }
  return {ttft, seconds: (performance.now() - start) / 1000};
}

function addTurn(role, text) {
  const div = document.createElement("div");
  div.className = "turn " + role;
  div.textContent = text || "";
  $("conversation").appendChild(div);
  return div;
}

function plotK(iterations) {
  const svg = $("kplot"), width = 320, height = 60;
  svg.innerHTML = "";
  const shown = iterations.slice(-80), bar = width / Math.max(shown.length, 1);
  const top = Math.max(1, ...shown.map((it) => it.drafted));
  shown.forEach((it, i) => {
    for (const [count, colour] of [[it.drafted, "#ddd"], [it.accepted, "#5c5"]]) {
      const h = (count / top) * (height - 4);
      const rect = document.createElementNS("http://www.w3.org/2000/svg", "rect");
      rect.setAttribute("x", i * bar); rect.setAttribute("width", Math.max(bar - 1, 1));
      rect.setAttribute("y", height - h); rect.setAttribute("height", h); rect.setAttribute("fill", colour);
      svg.appendChild(rect);
    }
  });
}

function figures(prefix, timing, stats, tokens) {
  const put = (id, text) => { $(prefix + id).textContent = text; };
  put("tps", stats && stats.decode_tokens_per_second ? stats.decode_tokens_per_second.toFixed(1)
                                                      : (tokens / timing.seconds).toFixed(1));
  put("ttft", timing.ttft === null ? "-" : (timing.ttft * 1000).toFixed(0) + " ms");
  put("alpha", stats && stats.drafted > 0 ? stats.acceptance_rate.toFixed(2) : "-");  // nothing drafted: none
  put("tpc", stats && stats.tokens_per_target_call ? stats.tokens_per_target_call.toFixed(2) : "-");
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text) return;
  showError("");
  $("prompt").value = "";
  conversation.push({role: "user", content: text});
  addTurn("user", text);
  const answer = addTurn("assistant");
  answer.id = "answer-" + conversation.length;
  const body = settings();
  lastBody = body; lastPrompt = text;
  const iterations = [];
  let stats = null, count = 0, content = "";
  $("status").textContent = "generating";
  try {
    const timing = await stream(body, (event) => {
      if (event.specdec_tokens) {
        const it = event.specdec_tokens;
        let accepted = 0;
        for (const token of it.tokens) {
          const span = document.createElement("span");
          span.dataset.kind = token.kind;
          span.textContent = token.text;
          answer.appendChild(span);
          content += token.text;
          count += 1;
          if (token.kind === "accepted") accepted += 1;
        }
        if (it.rejected !== null && it.rejected !== undefined) {
          const span = document.createElement("span");
          span.dataset.kind = "rejected";
          span.textContent = it.rejected;
          answer.insertBefore(span, answer.lastChild);
        }
        if (!it.prefill) iterations.push({drafted: it.drafted, accepted});
        plotK(iterations);
      }
      if (event.specdec) stats = event.specdec;
    });
    conversation.push({role: "assistant", content});
    figures("", timing, stats, count);
    for (const id of ["compare", "curl", "python"]) $(id).disabled = false;
    $("status").textContent = "done";
  } catch (err) {
    conversation.pop();
    showError(err.message);
    $("status").textContent = "failed";
  }
}

async function compare() {
  if (!lastBody) return;
  showError("");
  $("status").textContent = "comparing";
  let stats = null, count = 0;
  try {
    const timing = await stream(Object.assign({}, lastBody, {drafter: "none"}), (event) => {
      if (event.specdec_tokens) count += event.specdec_tokens.tokens.length;
      if (event.specdec) stats = event.specdec;
    });
    figures("cmp_", timing, stats, count);
    $("status").textContent = "compared";
  } catch (err) {
    showError(err.message);
    $("status").textContent = "failed";
  }
}

function snippet(kind) {
  if (!lastBody) return;
  const body = Object.assign({}, lastBody);
  delete body.specdec_tokens;
  const url = location.origin + "/v1/chat/completions";
  const auth = key() ? " -H 'Authorization: Bearer $SPECDEC_API_KEY'" : "";
  const text = kind === "curl"
    ? `curl -sN ${url} -H 'Content-Type: application/json'${auth} -d '${JSON.stringify(body).replace(/'/g, "'\\''")}'`
    : `import openai\nclient = openai.OpenAI(base_url="${location.origin}/v1", api_key="${key() ? "$SPECDEC_API_KEY" : "unused"}")\n` +
      `extra = ${JSON.stringify({drafter: body.drafter, num_draft_tokens: body.num_draft_tokens ?? null})}\n` +
      `for chunk in client.chat.completions.create(model="${$("model").textContent || "default"}", ` +
      `messages=${JSON.stringify(body.messages)}, max_tokens=${body.max_tokens}, temperature=${body.temperature}, ` +
      `top_p=${body.top_p}, seed=${body.seed}, stream=True, extra_body=extra):\n` +
      `    print(chunk.choices[0].delta.content or "", end="", flush=True)`;
  $("snippet").textContent = text;
  if (navigator.clipboard) navigator.clipboard.writeText(text).catch(() => {});
}

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); send(); }
});
$("send").addEventListener("click", send);
$("compare").addEventListener("click", compare);
$("curl").addEventListener("click", () => snippet("curl"));
$("python").addEventListener("click", () => snippet("python"));
$("clear").addEventListener("click", () => { conversation.length = 0; $("conversation").innerHTML = ""; });
$("show_rejected").addEventListener("change", (e) => document.body.classList.toggle("show-rejected", e.target.checked));
$("keysave").addEventListener("click", () => {
  sessionStorage.setItem("specdec-key", $("key").value);
  $("key").value = "";
  $("keyform").hidden = true;
  showError("");
});
fetch("/v1/models", {headers: key() ? {Authorization: "Bearer " + key()} : {}}).then((r) => r.json())
  .then((m) => { $("model").textContent = m.data[0].id; }).catch(() => {});
fetch("/health").then((r) => r.json()).then((h) => { $("status").textContent = "server: " + h.status; }).catch(() => {});
