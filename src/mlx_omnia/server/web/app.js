// The mlx-omnia web app: chat (OpenAI chat completions, streamed), models, pulls, status.
import { ApiError, apiKey, authEvents, getJson, readEvents, request, sendJson, setApiKey }
  from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { loadSettings, saveSettings, Store } from "./store.js";

const STATUS_EVERY_MS = 4000;

const $ = (id) => document.getElementById(id);
const ui = {
  newChat: $("new-chat"), conversations: $("conversations"), title: $("chat-title"),
  chatModel: $("chat-model"), messages: $("messages"), empty: $("empty"), composer: $("composer"),
  prompt: $("prompt"), send: $("send"), stop: $("stop"),
  auth: $("auth"), authForm: $("auth-form"), apiKey: $("api-key"), authError: $("auth-error"),
  changeKey: $("change-key"),
  model: $("model"), modelInfo: $("model-info"), load: $("load"), unload: $("unload"),
  temperature: $("temperature"), maxTokens: $("max-tokens"), system: $("system"),
  pullForm: $("pull-form"), pullRepo: $("pull-repo"), pull: $("pull"), pullState: $("pull-state"),
  pullProgress: $("pull-progress"), pullText: $("pull-text"),
  backend: $("status-backend"), memory: $("status-memory"), resident: $("status-resident"),
  last: $("status-last"), memoryBar: $("memory-bar"),
};

const store = new Store();
const settings = loadSettings();
let models = [];          // the last /admin/models listing
let streaming = null;     // {controller, message} while an answer streams
const elements = new WeakMap();  // message object -> its <article>

// -- helpers --------------------------------------------------------------------------------------

export function formatBytes(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  let v = n;
  while (v >= 1000 && i < units.length - 1) {
    v /= 1000;
    i++;
  }
  return `${v >= 100 || i === 0 ? Math.round(v) : v.toFixed(1)} ${units[i]}`;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);  // strings become text nodes
  return node;
}

function describeError(e) {
  if (e instanceof ApiError && e.status === 401) return "The server needs an API key (see above).";
  if (e instanceof ApiError && e.code === "context_length_exceeded") {
    return `${e.message}. Start a new chat (New chat) to go on.`;
  }
  if (e instanceof ApiError) return `${e.message} (HTTP ${e.status})`;
  return e?.message || String(e);
}

// -- conversations --------------------------------------------------------------------------------

function renderConversationList() {
  ui.conversations.replaceChildren(...store.conversations.map((c) => {
    const current = c.id === store.currentId;
    return el("li", { class: current ? "current" : "" },
      el("button", {
        type: "button", class: "conv", ...(current ? { "aria-current": "true" } : {}),
        onclick: () => openConversation(c.id),
      }, c.title),
      el("button", {
        type: "button", class: "icon", title: "Delete", "aria-label": `Delete conversation: ${c.title}`,
        onclick: () => deleteConversation(c.id),
      }, "×"));
  }));
}

function messageMeta(m) {
  const parts = [];
  if (m.role === "assistant") {
    if (m.model) parts.push(m.model);
    if (m.usage?.completion_tokens) parts.push(`${m.usage.completion_tokens} tokens`);
    if (m.tokensPerSecond) parts.push(`${m.tokensPerSecond.toFixed(1)} tok/s`);
    if (m.state === "streaming") parts.push("answering…");
    if (m.state === "stopped") parts.push("stopped");
    if (m.finish === "length") parts.push("cut at max tokens");
  }
  return parts.join(" · ");
}

function fillMessage(article, m) {
  const body = article.querySelector(".content");
  if (m.role === "assistant") {
    body.innerHTML = renderMarkdown(m.content);  // renderMarkdown escapes all source text
    if (m.state === "streaming") body.append(el("span", { class: "cursor", "aria-hidden": "true" }));
  } else {
    body.textContent = m.content;
  }
  const error = article.querySelector(".error");
  error.textContent = m.error ?? "";
  error.hidden = !m.error;
  article.querySelector(".meta").textContent = messageMeta(m);
  article.setAttribute("aria-busy", m.state === "streaming" ? "true" : "false");
}

function messageElement(m) {
  const article = el("article", {
    class: `msg ${m.role}`, "aria-label": m.role === "user" ? "You" : "Assistant",
  },
  el("div", { class: "who" }, m.role === "user" ? "You" : "Assistant"),
  el("div", { class: m.role === "user" ? "content plain" : "content markdown" }),
  el("p", { class: "error", role: "alert" }),
  el("div", { class: "meta" }));
  elements.set(m, article);
  fillMessage(article, m);
  return article;
}

function renderConversation() {
  const c = store.current();
  ui.title.textContent = c?.title ?? "New chat";
  const lastModel = c?.messages.findLast((m) => m.role === "assistant" && m.model)?.model;
  ui.chatModel.textContent = lastModel ? `last answer by ${lastModel}` : "";
  const nodes = (c?.messages ?? []).map(messageElement);
  ui.empty.hidden = nodes.length > 0;
  ui.messages.replaceChildren(ui.empty, ...nodes);
  ui.messages.scrollTop = ui.messages.scrollHeight;
  renderConversationList();
}

function updateMessage(m) {
  const article = elements.get(m);
  if (!article || !article.isConnected) return;
  const box = ui.messages;
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
  fillMessage(article, m);
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function openConversation(id) {
  const left = store.current();
  if (left && left.id !== id && left.messages.length === 0) store.remove(left.id);  // unused
  store.select(id);
  renderConversation();
  ui.prompt.focus();
}

function newConversation() {
  const c = store.current();
  if (c && c.messages.length === 0) {  // reuse an empty one
    ui.prompt.focus();
    return;
  }
  store.create();
  store.save();
  renderConversation();
  ui.prompt.focus();
}

function deleteConversation(id) {
  if (streaming && store.conversations.find((c) => c.id === id)?.messages.includes(streaming.message)) {
    streaming.controller.abort();
  }
  store.remove(id);
  renderConversation();
}

// -- chat -----------------------------------------------------------------------------------------

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
  ui.composer.setAttribute("aria-busy", busy ? "true" : "false");
}

function requestBody(conversation, model) {
  const history = conversation.messages
    .filter((m) => m.state !== "streaming" && !(m.role === "assistant" && !m.content))
    .map((m) => ({ role: m.role, content: m.content }));
  const messages = settings.system.trim()
    ? [{ role: "system", content: settings.system.trim() }, ...history]
    : history;
  const body = { model, messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat(settings.temperature);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  const maxTokens = parseInt(settings.maxTokens, 10);
  if (Number.isFinite(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

async function send(text) {
  if (streaming || !text.trim()) return;
  // Sent before the model list arrived: fetch it first, so the request names the model.
  if (!ui.model.value) await refreshModels();
  if (streaming) return;
  const conversation = store.current() ?? store.create();
  const model = ui.model.value || undefined;
  conversation.messages.push({ role: "user", content: text });
  const body = requestBody(conversation, model);
  const answer = { role: "assistant", content: "", model: model ?? "", state: "streaming" };
  conversation.messages.push(answer);
  store.touch(conversation);
  store.save();
  renderConversation();

  const controller = new AbortController();
  streaming = { controller, message: answer };
  setBusy(true);
  let firstAt = null;
  let lastSave = performance.now();
  try {
    const response = await request("POST", "/api/openai/v1/chat/completions", body,
      { signal: controller.signal });
    for await (const { data } of readEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message ?? "the server stopped the answer");
      if (chunk.model) answer.model = chunk.model;
      const choice = chunk.choices?.[0];
      const delta = choice?.delta?.content;
      if (delta) {
        firstAt ??= performance.now();
        answer.content += delta;
      }
      if (choice?.finish_reason) answer.finish = choice.finish_reason;
      if (chunk.usage) answer.usage = chunk.usage;
      updateMessage(answer);
      if (performance.now() - lastSave > 1000) {
        store.save();
        lastSave = performance.now();
      }
    }
    answer.state = "done";
    const tokens = answer.usage?.completion_tokens;
    const seconds = firstAt === null ? 0 : (performance.now() - firstAt) / 1000;
    if (tokens > 1 && seconds > 0) answer.tokensPerSecond = (tokens - 1) / seconds;
  } catch (e) {
    if (e?.name === "AbortError") {
      answer.state = "stopped";
    } else {
      answer.state = "error";
      answer.error = describeError(e);
    }
  } finally {
    streaming = null;
    setBusy(false);
    store.touch(conversation);
    store.save();
    if (store.current() === conversation) renderConversation();
    else renderConversationList();
    refreshStatus();
    refreshModels();
    ui.prompt.focus();
  }
}

function stop() {
  // Aborting the fetch closes the connection: the server stops generating at the next token.
  streaming?.controller.abort();
}

// -- models ---------------------------------------------------------------------------------------

function selectedModel() {
  return models.find((m) => m.id === ui.model.value) ?? null;
}

function renderModelInfo() {
  const m = selectedModel();
  ui.load.disabled = !m || m.resident;
  ui.unload.disabled = !m || !m.resident;
  if (!m) {
    ui.modelInfo.textContent = models.length ? "" : "No model listed.";
    return;
  }
  const where = m.resident
    ? `Resident, ${formatBytes(m.resident_bytes)} in memory`
    : `On disk${m.size_on_disk ? `, ${formatBytes(m.size_on_disk)}` : ""}`
      + (m.estimated_bytes ? ` (needs about ${formatBytes(m.estimated_bytes)})` : "");
  ui.modelInfo.textContent = `${where} · ${m.source}${m.default ? " · default" : ""}`;
}

async function refreshModels() {
  let listing;
  try {
    listing = await getJson("/admin/models");
  } catch (e) {
    if (!(e instanceof ApiError && e.status === 401)) ui.modelInfo.textContent = describeError(e);
    return;
  }
  models = listing.models ?? [];
  const wanted = ui.model.value || settings.model || models.find((m) => m.default)?.id || models[0]?.id;
  const group = (label, list) => list.length
    ? [el("optgroup", { label }, ...list.map((m) => el("option", { value: m.id }, m.id)))] : [];
  ui.model.replaceChildren(
    ...group("In memory", models.filter((m) => m.resident)),
    ...group("On disk", models.filter((m) => !m.resident)));
  if (models.some((m) => m.id === wanted)) ui.model.value = wanted;
  renderModelInfo();
}

async function residency(method) {
  const m = selectedModel();
  if (!m) return;
  ui.load.disabled = ui.unload.disabled = true;
  ui.modelInfo.textContent = method === "PUT" ? `Loading ${m.id}…` : `Unloading ${m.id}…`;
  try {
    await sendJson(method, `/admin/models/${m.id.split("/").map(encodeURIComponent).join("/")}/residency`);
    await refreshModels();
  } catch (e) {
    await refreshModels();
    ui.modelInfo.textContent = describeError(e);
  }
  refreshStatus();
}

// -- pulls ----------------------------------------------------------------------------------------

function showPull(job) {
  const total = job.total ?? 0;
  const pct = job.state === "done" ? 100 : total > 0 ? Math.floor((100 * job.done) / total) : 0;
  ui.pullProgress.value = pct;
  ui.pullProgress.setAttribute("aria-valuetext", `${pct}%`);
  const amount = total ? ` · ${formatBytes(job.done)} of ${formatBytes(total)}` : "";
  const text = {
    queued: `Waiting to start ${job.model}…`,
    running: `${pct}%${amount}`,
    done: `100% · ${job.model} is ready`,
    failed: `Failed: ${job.error?.message ?? "unknown error"}`,
  }[job.state] ?? job.state;
  ui.pullText.textContent = text;
  ui.pullText.classList.toggle("error", job.state === "failed");
}

async function pullModel(repo) {
  ui.pull.disabled = true;
  ui.pullState.hidden = false;
  ui.pullProgress.value = 0;
  ui.pullText.classList.remove("error");
  ui.pullText.textContent = `Starting ${repo}…`;
  try {
    const { job } = await sendJson("POST", "/admin/models", { model: repo });
    const response = await request("GET", `/admin/jobs/${encodeURIComponent(job)}/events`);
    for await (const { data } of readEvents(response)) {
      const view = JSON.parse(data);
      showPull(view);
      if (view.state === "done") {
        await refreshModels();
        ui.model.value = view.model;
        settings.model = view.model;
        saveSettings(settings);
        renderModelInfo();
      }
    }
  } catch (e) {
    ui.pullText.classList.add("error");
    ui.pullText.textContent = `Failed: ${describeError(e)}`;
  } finally {
    ui.pull.disabled = false;
  }
}

// -- status ---------------------------------------------------------------------------------------

async function refreshStatus() {
  let s;
  try {
    s = await getJson("/admin/status");
  } catch (e) {
    if (!(e instanceof ApiError && e.status === 401)) ui.backend.textContent = describeError(e);
    return;
  }
  const rt = s.runtime ?? {};
  ui.backend.textContent = [rt.backend, rt.mlx && `MLX ${rt.mlx}`, rt.blas && rt.backend === "cpu" ? rt.blas : null]
    .filter(Boolean).join(" · ");
  const mem = s.memory ?? {};
  ui.memory.textContent = `${formatBytes(mem.resident_bytes ?? 0)} of ${formatBytes(mem.limit_bytes)} limit`;
  const share = mem.limit_bytes ? Math.min(1, (mem.resident_bytes ?? 0) / mem.limit_bytes) : 0;
  ui.memoryBar.style.width = `${(share * 100).toFixed(1)}%`;
  const resident = s.resident ?? [];
  ui.resident.replaceChildren(...(resident.length
    ? resident.map((r) => el("div", {}, `${r.id} (${formatBytes(r.bytes)})${r.busy ? " · busy" : ""}`))
    : ["none"]));
  const last = s.last_answer;
  ui.last.textContent = last
    ? `${last.tokens_per_second ? `${last.tokens_per_second.toFixed(1)} tok/s` : "—"} · ${last.completion_tokens} tokens · ${last.model}`
    : "—";
}

// -- API key --------------------------------------------------------------------------------------

function askForKey(message) {
  ui.auth.hidden = false;
  ui.authError.textContent = message ?? "";
  ui.apiKey.focus();
}

authEvents.addEventListener("unauthorized", () =>
  askForKey(apiKey() ? "The server refused this key." : ""));

// -- wiring ---------------------------------------------------------------------------------------

function bindSetting(input, name) {
  input.value = settings[name];
  input.addEventListener("input", () => {
    settings[name] = input.value;
    saveSettings(settings);
  });
}

function init() {
  bindSetting(ui.temperature, "temperature");
  bindSetting(ui.maxTokens, "maxTokens");
  bindSetting(ui.system, "system");

  ui.newChat.addEventListener("click", newConversation);
  ui.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    const text = ui.prompt.value;
    if (!text.trim() || streaming) return;
    ui.prompt.value = "";
    send(text);
  });
  ui.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      ui.composer.requestSubmit();
    }
  });
  ui.stop.addEventListener("click", stop);

  ui.model.addEventListener("change", () => {
    settings.model = ui.model.value;
    saveSettings(settings);
    renderModelInfo();
  });
  ui.load.addEventListener("click", () => residency("PUT"));
  ui.unload.addEventListener("click", () => residency("DELETE"));

  ui.pullForm.addEventListener("submit", (e) => {
    e.preventDefault();
    const repo = ui.pullRepo.value.trim();
    if (repo) pullModel(repo);
  });

  ui.authForm.addEventListener("submit", async (e) => {
    e.preventDefault();
    setApiKey(ui.apiKey.value.trim());
    ui.apiKey.value = "";
    ui.auth.hidden = true;
    ui.authError.textContent = "";
    await Promise.all([refreshModels(), refreshStatus()]);
  });
  ui.changeKey.addEventListener("click", () => askForKey(""));

  setBusy(false);
  renderModelInfo();  // nothing listed yet: Load and Unload start disabled
  renderConversation();
  refreshModels();
  refreshStatus();
  setInterval(() => {
    if (!document.hidden) refreshStatus();
  }, STATUS_EVERY_MS);
  ui.prompt.focus();
}

init();
