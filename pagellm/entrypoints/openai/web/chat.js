// The chat page: conversations kept in localStorage, replies streamed from /v1/chat/completions.
import { apiFetch, errorText, setupTheme } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const STORE = "pagellm.conversations";
const SETTINGS = "pagellm.settings";
const $ = (id) => document.getElementById(id);

const state = {
  conversations: JSON.parse(localStorage.getItem(STORE) || "[]"),
  currentId: localStorage.getItem(`${STORE}.current`),
  controller: null, // the AbortController of the reply streaming now
  defaults: { temperature: 1, top_p: 1 }, // the server's (generation_config.json), once /stats answers
  attached: [], // data URLs of the images the next message carries
};

// -- conversations ------------------------------------------------------------------------------

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(state.conversations));
  } catch {  // images can outgrow the browser's quota: the conversation then lives only in this tab
    showError("This browser cannot keep these conversations (their images are too large); they last until a reload.");
  }
  localStorage.setItem(`${STORE}.current`, state.currentId || "");
}

function current() {
  return state.conversations.find((c) => c.id === state.currentId);
}

function newConversation() {
  const conversation = { id: crypto.randomUUID(), title: "New chat", messages: [], updated: Date.now() };
  state.conversations.unshift(conversation);
  state.currentId = conversation.id;
  save();
  render();
  $("input").focus();
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren(...state.conversations.map((c) => {
    const item = document.createElement("li");
    item.className = c.id === state.currentId ? "active" : "";
    item.dataset.id = c.id;
    item.innerHTML = `<span class="title"></span><button type="button" class="icon rename" title="Rename">&#9998;</button>` +
      `<button type="button" class="icon delete" title="Delete">&#10005;</button>`;
    item.querySelector(".title").textContent = c.title;
    item.querySelector(".title").onclick = () => { state.currentId = c.id; save(); render(); closePanels(); };
    item.querySelector(".rename").onclick = () => {
      const title = prompt("Rename the conversation", c.title);
      if (title && title.trim()) { c.title = title.trim(); save(); renderSidebar(); }
    };
    item.querySelector(".delete").onclick = () => {
      if (state.controller && c.id === state.currentId) state.controller.abort();
      state.conversations = state.conversations.filter((other) => other.id !== c.id);
      if (state.currentId === c.id) state.currentId = state.conversations[0]?.id || null;
      save(); render();
    };
    return item;
  }));
}

// -- messages -----------------------------------------------------------------------------------

function copyButton(label, text) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "small";
  button.textContent = label;
  button.onclick = () => copy(button, text());
  return button;
}

async function copy(button, text) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed"; // an insecure (http, not localhost) origin has no clipboard
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1200);
}

function statsText(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.completionTokens != null) parts.push(`${stats.promptTokens} prompt + ${stats.completionTokens} tokens`);
  else if (stats.chunks) parts.push(`~${stats.chunks} tokens`); // stopped: no usage came, a chunk is about a token
  if (stats.tokensPerSecond) parts.push(`${stats.tokensPerSecond.toFixed(1)} tokens/s`);
  if (stats.ttft != null) parts.push(`first token ${(stats.ttft * 1000).toFixed(0)} ms`);
  if (stats.finishReason) parts.push(stats.finishReason);
  return parts.join(" · ");
}

// Fills one message's element (re-run on every streamed chunk).
function fillMessage(element, message) {
  element.dataset.state = message.state || "done";
  const reasoning = element.querySelector(".reasoning");
  reasoning.hidden = !message.reasoning;
  if (message.reasoning) reasoning.querySelector(".reasoning-text").textContent = message.reasoning;
  const content = element.querySelector(".content");
  if (message.role === "assistant") {
    content.innerHTML = renderMarkdown(message.content || "");
    for (const button of content.querySelectorAll(".copy-code")) {
      button.onclick = () => copy(button, button.closest(".code-block").querySelector("code").textContent);
    }
  } else {
    content.textContent = message.content;
    for (const url of message.images || []) {
      const thumb = document.createElement("img");
      thumb.className = "thumb"; thumb.src = url; thumb.alt = "attached image";
      content.append(thumb);
    }
  }
  element.querySelector(".stats").textContent = message.state === "stopped" ? `stopped · ${statsText(message.stats)}`
    : statsText(message.stats);
}

function messageElement(message, index, conversation) {
  const element = document.createElement("article");
  element.className = `msg ${message.role}`;
  element.innerHTML = `<div class="role">${message.role === "user" ? "You" : "Assistant"}</div>` +
    `<details class="reasoning" hidden><summary>Reasoning</summary><div class="reasoning-text"></div></details>` +
    `<div class="content"></div><div class="meta"><span class="stats"></span><span class="actions"></span></div>`;
  const actions = element.querySelector(".actions");
  actions.append(copyButton("Copy", () => message.content));
  const last = index === conversation.messages.length - 1;
  if (message.role === "assistant" && last) {
    const regenerate = document.createElement("button");
    regenerate.type = "button"; regenerate.className = "small regenerate"; regenerate.textContent = "Regenerate";
    regenerate.onclick = () => {
      if (state.controller) return;
      conversation.messages.pop();
      reply(conversation);
    };
    actions.append(regenerate);
  }
  if (message.role === "user") {
    const edit = document.createElement("button");
    edit.type = "button"; edit.className = "small edit"; edit.textContent = "Edit";
    edit.onclick = () => editMessage(element, conversation, index);
    actions.append(edit);
  }
  fillMessage(element, message);
  return element;
}

// Edit-and-resend: the messages after the edited one are dropped, and the reply is asked for again.
function editMessage(element, conversation, index) {
  if (state.controller) return;
  const content = element.querySelector(".content");
  const editor = document.createElement("textarea");
  editor.className = "editor";
  editor.value = conversation.messages[index].content;
  const send = document.createElement("button");
  send.type = "button"; send.className = "primary small"; send.textContent = "Save & send";
  const cancel = document.createElement("button");
  cancel.type = "button"; cancel.className = "small"; cancel.textContent = "Cancel";
  send.onclick = () => {
    if (!editor.value.trim()) return;
    const { images } = conversation.messages[index];
    conversation.messages.splice(index, conversation.messages.length, { role: "user", content: editor.value, images });
    reply(conversation);
  };
  cancel.onclick = () => renderMessages();
  content.replaceChildren(editor, send, cancel);
  editor.focus();
}

function renderMessages() {
  const conversation = current();
  const messages = $("messages");
  const empty = $("empty-state");
  messages.replaceChildren(empty);
  empty.hidden = Boolean(conversation && conversation.messages.length);
  if (!conversation) return;
  conversation.messages.forEach((message, i) => messages.append(messageElement(message, i, conversation)));
  messages.scrollTop = messages.scrollHeight;
}

function render() {
  renderSidebar();
  renderMessages();
}

// -- requests -----------------------------------------------------------------------------------

function settings() {
  const stop = $("stop-sequences").value.split(",").map((s) => s.trim()).filter(Boolean);
  return {
    system: $("system").value,
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: $("max-tokens").value ? Number($("max-tokens").value) : null,
    stop,
    seed: $("seed").value === "" ? null : Number($("seed").value),
    jsonMode: $("json-mode").checked,
    schema: $("json-schema").value,
  };
}

function requestBody(conversation) {
  const s = settings();
  // Images go first, as OpenAI's image_url parts; the server puts them where the model's template wants them.
  const messages = conversation.messages.map(({ role, content, images }) => ({ role, content: images?.length
    ? [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text: content }]
    : content }));
  if (s.system.trim()) messages.unshift({ role: "system", content: s.system });
  const body = { model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
    temperature: s.temperature, top_p: s.top_p };
  if (s.max_tokens) body.max_tokens = s.max_tokens;
  if (s.stop.length) body.stop = s.stop;
  if (s.seed !== null) body.seed = s.seed;
  if (s.jsonMode) {
    body.response_format = { type: "json_schema", json_schema: { name: "reply", schema: JSON.parse(s.schema) } };
  }
  return body;
}

// The server-sent events of a streamed response, as parsed JSON objects.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// Streams the assistant's reply to `conversation`'s last message into a new message.
async function reply(conversation) {
  showError("");
  let body;
  try {
    body = requestBody(conversation);
  } catch (e) {
    showError(`The JSON schema is not valid JSON: ${e.message}`);
    return;
  }
  const message = { role: "assistant", content: "", reasoning: "", state: "streaming", stats: null };
  conversation.messages.push(message);
  conversation.updated = Date.now();
  save();
  renderMessages();
  const element = $("messages").lastElementChild;
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const started = performance.now();
  let firstToken = null;
  let usage = null;
  let finishReason = null;
  let chunks = 0; // the chunks that carried text
  let pending = false;
  const refresh = () => { // at most once a frame, however fast chunks come
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      fillMessage(element, message);
      const messages = $("messages");
      messages.scrollTop = messages.scrollHeight;
    });
  };
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      const text = (delta.content || "") + (delta.reasoning_content || "");
      if (text && firstToken === null) firstToken = performance.now();
      if (text) chunks += 1;
      message.content += delta.content || "";
      message.reasoning += delta.reasoning_content || "";
      if (choice.finish_reason) finishReason = choice.finish_reason;
      refresh();
    }
    message.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      message.state = "stopped";
    } else {
      message.state = "error";
      showError(e.message);
    }
  } finally {
    state.controller = null;
    setBusy(false);
  }
  const now = performance.now();
  const generated = usage?.completion_tokens ?? chunks;
  message.stats = {
    promptTokens: usage?.prompt_tokens ?? null,
    completionTokens: usage?.completion_tokens ?? null,
    chunks,
    ttft: firstToken === null ? null : (firstToken - started) / 1000,
    tokensPerSecond: generated > 1 && firstToken !== null && now > firstToken
      ? (generated - 1) / ((now - firstToken) / 1000) : null,
    finishReason,
  };
  if (conversation.title === "New chat") {
    const first = conversation.messages.find((m) => m.role === "user");
    if (first) conversation.title = first.content.slice(0, 40) || "Image";
  }
  save();
  render();
}

function send(event) {
  event.preventDefault();
  const text = $("input").value;
  if ((!text.trim() && !state.attached.length) || state.controller) return;
  if (!current()) newConversation();
  const conversation = current();
  const message = { role: "user", content: text };
  if (state.attached.length) message.images = state.attached;
  conversation.messages.push(message);
  $("input").value = "";
  attach([]);
  autosize();
  reply(conversation);
}

// The images the next message carries, as data URLs (read in the browser; nothing is uploaded before sending).
function attach(urls) {
  state.attached = urls;
  const chip = $("attached");
  chip.hidden = !urls.length;
  chip.textContent = `${urls.length} image${urls.length === 1 ? "" : "s"} ✕`;
}

async function readImages(files) {
  const read = (file) => new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
  attach([...state.attached, ...await Promise.all([...files].map(read))]);
  $("attach-input").value = "";
}

// -- settings and start-up ----------------------------------------------------------------------

function loadSettings() {
  const saved = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  $("system").value = saved.system || "";
  $("temperature").value = saved.temperature ?? state.defaults.temperature;
  $("top-p").value = saved.top_p ?? state.defaults.top_p;
  $("max-tokens").value = saved.max_tokens ?? "";
  $("stop-sequences").value = (saved.stop || []).join(", ");
  $("seed").value = saved.seed ?? "";
  $("json-mode").checked = Boolean(saved.jsonMode);
  if (saved.schema) $("json-schema").value = saved.schema;
  showSettings();
}

function showSettings() {
  $("temperature-value").textContent = Number($("temperature").value).toFixed(2);
  $("top-p-value").textContent = Number($("top-p").value).toFixed(2);
  $("json-schema").hidden = !$("json-mode").checked;
}

function storeSettings() {
  showSettings();
  localStorage.setItem(SETTINGS, JSON.stringify(settings()));
}

async function loadModels() {
  const response = await apiFetch("/v1/models");
  if (!response.ok) { showError(await errorText(response)); return; }
  const { data } = await response.json();
  const select = $("model");
  select.replaceChildren(...data.map((card) => {
    const option = document.createElement("option");
    option.value = card.id;
    option.textContent = card.parent ? `${card.id} (adapter of ${card.parent})` : card.id;
    return option;
  }));
  const saved = localStorage.getItem("pagellm.model");
  if (saved && data.some((card) => card.id === saved)) select.value = saved;
  $("empty-model").textContent = select.value;
}

async function loadDefaults() {
  // Without /stats (`pagellm router`, an older server, a proxy that hides it) the page keeps the
  // OpenAI defaults, and there is no dashboard to link to.
  const response = await apiFetch("/stats");
  if (!response.ok) { $("dashboard-link").hidden = true; return; }
  const { engine } = await response.json();
  for (const key of ["temperature", "top_p"]) {
    if (engine.sampling_defaults[key] != null) state.defaults[key] = engine.sampling_defaults[key];
  }
}

function autosize() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = `${Math.min(input.scrollHeight, 240)}px`;
}

function closePanels() {
  document.body.classList.remove("show-sidebar", "show-settings");
}

async function main() {
  setupTheme($("theme"));
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) send(event);
  });
  $("input").addEventListener("input", autosize);
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("attach-input").addEventListener("change", (event) => readImages(event.target.files).catch((e) => showError(String(e))));
  $("attached").addEventListener("click", () => attach([]));
  $("new-chat").addEventListener("click", () => { newConversation(); closePanels(); });
  $("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("show-sidebar"));
  $("toggle-settings").addEventListener("click", () => document.body.classList.toggle("show-settings"));
  $("model").addEventListener("change", () => {
    localStorage.setItem("pagellm.model", $("model").value);
    $("empty-model").textContent = $("model").value;
  });
  for (const id of ["system", "temperature", "top-p", "max-tokens", "stop-sequences", "seed", "json-mode", "json-schema"]) {
    $(id).addEventListener("input", storeSettings);
  }
  $("reset-settings").addEventListener("click", () => {
    localStorage.removeItem(SETTINGS);
    loadSettings();
  });
  if (!current()) state.currentId = state.conversations[0]?.id || null;
  render();
  await loadDefaults().catch(() => {});
  loadSettings();
  await loadModels();
  document.body.dataset.ready = "true";
}

main();
