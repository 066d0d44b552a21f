// The server's public HTTP API, as the page uses it: JSON requests with the stored API key as a
// Bearer token, and Server-Sent Events read from a fetch() body (EventSource cannot send headers).

const KEY_STORAGE = "omnia.apiKey";

/** Fired (as "unauthorized") whenever the server answers 401. */
export const authEvents = new EventTarget();

export class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code; // OpenAI's error.code, e.g. "context_length_exceeded"
  }
}

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

/** [message, code] of an error response. */
async function errorOf(response) {
  const text = await response.text().catch(() => "");
  try {
    const body = JSON.parse(text);
    const error = body.error ?? body;
    if (typeof error === "string") return [error, null];
    if (error && typeof error.message === "string") return [error.message, error.code ?? null];
    if (typeof body.detail === "string") return [body.detail, null];
  } catch {
    // not JSON: fall through
  }
  return [text.trim().slice(0, 300) || `${response.status} ${response.statusText}`, null];
}

/** fetch() with the API key; resolves to the Response when it is 2xx, throws ApiError otherwise. */
export async function request(method, path, body, { signal } = {}) {
  const response = await fetch(path, {
    method,
    headers: headers(body !== undefined),
    body: body !== undefined ? JSON.stringify(body) : undefined,
    signal,
    cache: "no-store",
  });
  if (response.status === 401) {
    authEvents.dispatchEvent(new Event("unauthorized"));
    throw new ApiError(401, ...(await errorOf(response)));
  }
  if (!response.ok) throw new ApiError(response.status, ...(await errorOf(response)));
  return response;
}

export async function getJson(path) {
  return (await request("GET", path)).json();
}

export async function sendJson(method, path, body) {
  return (await request(method, path, body)).json();
}

/** The events of a text/event-stream Response: {event, data} with data as the raw string. */
export async function* readEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      buffer += decoder.decode(value ?? new Uint8Array(), { stream: !done });
      let end;
      while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
        let event = "message";
        const data = [];
        for (const line of block.split(/\r?\n/)) {
          if (line.startsWith(":")) continue;  // a comment (keep-alive)
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "event") event = value;
          else if (field === "data") data.push(value);
        }
        if (data.length) yield { event, data: data.join("\n") };
      }
      if (done) return;
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}
