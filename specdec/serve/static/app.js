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

// The OpenAI fields of the second row: output format, tools, prediction, logprobs. Throws (naming the
// textarea) where a JSON box does not parse, so nothing is sent.
function fields() {
  const body = {}, format = $("format").value, choice = $("tool_choice").value;
  if (format === "json_object") body.response_format = {type: "json_object"};
  if (format === "json_schema") {
    body.response_format = {type: "json_schema", json_schema: {name: "page", schema: parsed("schema"), strict: true}};
  }
  if (choice !== "none") Object.assign(body, {tools: parsed("tools"), tool_choice: choice,
                                              parallel_tool_calls: $("parallel").checked});
  if ($("predict").checked && $("prediction").value) body.prediction = {type: "content", content: $("prediction").value};
  if ($("logprobs").checked) Object.assign(body, {logprobs: true, top_logprobs: 3});
  return body;
}

// The JSON in textarea `id`, which is marked (and the error thrown) when it does not parse.
function parsed(id) {
  try {
    const value = JSON.parse($(id).value);
    $(id).classList.remove("invalid");
    return value;
  } catch (err) {
    $(id).classList.add("invalid");
    throw new Error(`the ${id} box is not JSON: ${err.message}`);
  }
}

// Show each textarea only while its setting asks for it.
function showSpecs() {
  const on = {json_schema: $("format").value === "json_schema", tools: $("tool_choice").value !== "none",
              predict: $("predict").checked};
  for (const el of document.querySelectorAll("[data-for]")) el.hidden = !on[el.dataset.for];
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

// Fold streamed delta.tool_calls into whole calls, as the openai client does: a call's first delta carries its
// index, id and name; later ones add to its arguments.
function mergeCalls(calls, deltas) {
  for (const delta of deltas) {
    const call = calls[delta.index] || (calls[delta.index] = {index: delta.index, id: delta.id, type: "function",
                                                               function: {name: "", arguments: ""}});
    if (delta.id) call.id = delta.id;
    if (delta.function && delta.function.name) call.function.name = delta.function.name;
    if (delta.function && delta.function.arguments) call.function.arguments += delta.function.arguments;
  }
}

// Replace the answer's tokens by a box per call: the function's name and its arguments, pretty-printed.
function showCalls(answer, calls) {
  answer.textContent = "";
  for (const call of calls) {
    const box = document.createElement("div"), name = document.createElement("div"), args = document.createElement("pre");
    box.className = "call"; name.className = "name"; args.className = "arguments";
    name.textContent = call.function.name;
    try { args.textContent = JSON.stringify(JSON.parse(call.function.arguments), null, 2); }
    catch (e) { args.textContent = call.function.arguments; }  // shown as sent
    box.append(name, args);
    answer.appendChild(box);
  }
}

// A token's logprob and its alternatives, for its title.
function logprobTitle(entry) {
  const top = (entry.top_logprobs || []).map((t) => `${JSON.stringify(t.token)} ${t.logprob.toFixed(3)}`);
  return `logprob ${entry.logprob.toFixed(3)}` + (top.length ? `\ntop: ${top.join(", ")}` : "");
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

function figures(prefix, timing, stats, tokens, usage) {
  const put = (id, text) => { $(prefix + id).textContent = text; };
  put("tps", stats && stats.decode_tokens_per_second ? stats.decode_tokens_per_second.toFixed(1)
                                                      : (tokens / timing.seconds).toFixed(1));
  put("ttft", timing.ttft === null ? "-" : (timing.ttft * 1000).toFixed(0) + " ms");
  put("alpha", stats && stats.drafted > 0 ? stats.acceptance_rate.toFixed(2) : "-");  // nothing drafted: none
  put("tpc", stats && stats.tokens_per_target_call ? stats.tokens_per_target_call.toFixed(2) : "-");
  const details = usage && usage.completion_tokens_details;  // present where a prediction was sent
  put("pred", details ? `${details.accepted_prediction_tokens} / ${details.rejected_prediction_tokens}` : "-");
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text) return;
  showError("");
  let extra;
  try { extra = fields(); } catch (err) { showError(err.message); $("status").textContent = "not sent"; return; }
  $("prompt").value = "";
  const last = conversation[conversation.length - 1];
  // After a tool call, the next message is that call's result (the first call's, where there were several).
  const turn = last && last.tool_calls ? {role: "tool", tool_call_id: last.tool_calls[0].id, content: text}
                                       : {role: "user", content: text};
  conversation.push(turn);
  addTurn(turn.role, text);
  const answer = addTurn("assistant");
  answer.id = "answer-" + conversation.length;
  const body = settings(extra);
  lastBody = body; lastPrompt = text;
  const iterations = [], spans = [], entries = [], calls = [];
  let stats = null, usage = null, count = 0, content = "", labelled = 0;
  // the i-th logprob entry is the i-th committed token's: a span gets its title once both have come
  const label = () => {
    for (; labelled < Math.min(spans.length, entries.length); labelled++) spans[labelled].title = logprobTitle(entries[labelled]);
  };
  $("status").textContent = "generating";
  try {
    const timing = await stream(body, (event) => {
      const choice = event.choices && event.choices[0];
      if (choice && choice.delta && choice.delta.tool_calls) mergeCalls(calls, choice.delta.tool_calls);
      if (choice && choice.logprobs && choice.logprobs.content) entries.push(...choice.logprobs.content);
      if (event.usage) usage = event.usage;
      if (event.specdec_tokens) {
        const it = event.specdec_tokens;
        let accepted = 0;
        for (const token of it.tokens) {
          const span = document.createElement("span");
          span.dataset.kind = token.kind;
          span.textContent = token.text;
          answer.appendChild(span);
          spans.push(span);
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
      label();
      if (event.specdec) stats = event.specdec;
    });
    if (calls.length) {
      showCalls(answer, calls);
      conversation.push({role: "assistant", content: null, tool_calls: calls.map(({index, ...call}) => call)});
    } else {
      conversation.push({role: "assistant", content});
    }
    figures("", timing, stats, count, usage);
    for (const id of ["compare", "curl", "python"]) $(id).disabled = false;
    $("status").textContent = "done";
  } catch (err) {
    conversation.pop();  // the turn leaves the chat, its text goes back to the box to send again
    answer.previousSibling.remove();
    answer.remove();
    $("prompt").value = text;
    showError(err.message);
    $("status").textContent = "failed";
  }
}

async function compare() {
  if (!lastBody) return;
  showError("");
  $("status").textContent = "comparing";
  let stats = null, usage = null, count = 0;
  try {
    const timing = await stream(Object.assign({}, lastBody, {drafter: "none"}), (event) => {
      if (event.specdec_tokens) count += event.specdec_tokens.tokens.length;
      if (event.specdec) stats = event.specdec;
      if (event.usage) usage = event.usage;
    });
    figures("cmp_", timing, stats, count, usage);
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
  // Python gets the body as JSON (true/null and all), specdec's own fields moved to extra_body
  const text = kind === "curl"
    ? `curl -sN ${url} -H 'Content-Type: application/json'${auth} -d '${JSON.stringify(body).replace(/'/g, "'\\''")}'`
    : `import json, openai\nclient = openai.OpenAI(base_url="${location.origin}/v1", api_key="${key() ? "$SPECDEC_API_KEY" : "unused"}")\n` +
      `body = json.loads(r"""${JSON.stringify(body)}""")\n` +
      `extra = {k: body.pop(k) for k in ("drafter", "num_draft_tokens", "specdec_stats") if k in body}\n` +
      `for chunk in client.chat.completions.create(model="${$("model").textContent || "default"}", **body, extra_body=extra):\n` +
      `    if chunk.choices:\n` +
      `        delta = chunk.choices[0].delta\n` +
      `        print(delta.content or delta.tool_calls or "", end="", flush=True)`;
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
for (const id of ["format", "tool_choice", "predict"]) $(id).addEventListener("change", showSpecs);
for (const id of ["schema", "tools"]) $(id).addEventListener("input", () => { try { parsed(id); } catch (e) { /* marked */ } });
showSpecs();
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
