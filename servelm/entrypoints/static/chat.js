// servelm chat page: the server's own OpenAI API, streamed (no framework, no build step).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "servelm.apiKey";
const history = []; // the conversation sent with each request: {role, content}
let controller = null; // the running request's AbortController
let conversation = 0; // bumped by Clear: a request still ending then leaves the new history alone

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function showError(message) {
  $("error").textContent = message || "";
  $("error").hidden = !message;
}

// The message of an error response (OpenAI shape {"error": {"message"}}, else whatever came).
async function errorText(resp) {
  let message = resp.statusText;
  try {
    const body = await resp.json();
    message = (body.error && body.error.message) || body.detail || JSON.stringify(body);
  } catch (_) { /* not JSON: keep the status text */ }
  if (resp.status === 401) return "The server refused the API key (401): " + message;
  return `Error ${resp.status}: ${message}`;
}

function askForKey(message) {
  $("key-form").hidden = false;
  showError(message);
  $("api-key").focus();
}

async function loadModels() {
  let resp;
  try {
    resp = await fetch("v1/models", { headers: headers() });
  } catch (e) {
    showError("Cannot reach the server: " + e.message);
    return;
  }
  if (resp.status === 401) {
    const hadKey = sessionStorage.getItem(KEY);
    askForKey(hadKey ? await errorText(resp) : "This server needs an API key: enter it above.");
    return;
  }
  if (resp.status === 503) { // still loading the model
    showError((await errorText(resp)) + " Retrying...");
    setTimeout(loadModels, 2000);
    return;
  }
  if (!resp.ok) {
    showError(await errorText(resp));
    return;
  }
  const select = $("model");
  select.replaceChildren(...(await resp.json()).data.map((m) => new Option(m.id, m.id)));
  $("key-form").hidden = true;
  showError("");
  $("send").disabled = controller !== null || select.options.length === 0;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  div.append(content);
  if (role === "assistant") {
    const meta = document.createElement("div");
    meta.className = "meta";
    div.append(meta);
  }
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// The `data:` payloads of a server-sent event stream, one per event.
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
        const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function setRunning(running) {
  $("send").disabled = running || $("model").options.length === 0;
  $("stop").disabled = !running;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = { model: $("model").value, messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;
  const schema = $("schema").value.trim();
  if (schema) {
    let parsed;
    try {
      parsed = JSON.parse(schema);
    } catch (e) {
      throw new Error("The JSON schema is not valid JSON: " + e.message);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "schema", schema: parsed } };
  }
  return body;
}

async function send(text) {
  const id = conversation;
  let body;
  history.push({ role: "user", content: text });
  try {
    body = requestBody();
  } catch (e) {
    history.pop();
    showError(e.message);
    return;
  }
  showError("");
  $("prompt").value = "";
  const userDiv = addMessage("user", text);
  const div = addMessage("assistant", "");
  div.classList.add("running");
  const content = div.querySelector(".content");
  const meta = div.querySelector(".meta");
  controller = new AbortController();
  setRunning(true);

  const start = performance.now();
  let first = null, last = null, pieces = 0, usage = null, finish = null, answer = "", outcome;
  const showStats = (end) => {
    const tokens = usage ? usage.completion_tokens : pieces;
    const parts = [];
    if (first !== null) parts.push(`TTFT ${Math.round(first - start)} ms`);
    if (tokens > 1 && last > first) parts.push(`${((tokens - 1) / ((last - first) / 1000)).toFixed(1)} tok/s`);
    parts.push(`${usage ? "" : "~"}${tokens} tokens`);
    if (end) parts.push(end);
    meta.textContent = parts.join(" · ");
  };
  try {
    const resp = await fetch("v1/chat/completions",
      { method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!resp.ok) {
      if (resp.status === 401) $("key-form").hidden = false;
      throw new Error(await errorText(resp));
    }
    for await (const data of sseData(resp.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error("Server error: " + chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      const piece = choice && choice.delta && choice.delta.content;
      if (piece) {
        const now = performance.now();
        if (first === null) first = now;
        last = now;
        pieces += 1;
        answer += piece;
        content.textContent = answer;
        div.scrollIntoView({ block: "end" });
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      showStats();
    }
    outcome = finish ? "finish: " + finish : "done";
  } catch (e) {
    if (e.name === "AbortError") {
      outcome = "stopped";
    } else {
      outcome = "failed";
      showError(e.message);
      div.classList.add("failed");
    }
  } finally {
    controller = null;
    setRunning(false);
    div.classList.remove("running");
  }
  showStats(outcome);
  div.dataset.outcome = outcome;
  if (id !== conversation) return;
  if (answer) {
    history.push({ role: "assistant", content: answer });
  } else { // nothing came back: leave this turn out of the conversation
    history.pop();
    userDiv.classList.add("dropped");
  }
}

$("chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (text && !controller && !$("send").disabled) send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation += 1;
  history.length = 0;
  $("messages").replaceChildren();
  showError("");
});
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY, $("api-key").value.trim());
  loadModels();
});
loadModels();
