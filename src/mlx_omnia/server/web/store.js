// Conversations and settings kept in the browser (localStorage), never on the server.

const CONVERSATIONS = "omnia.conversations";
const CURRENT = "omnia.current";
const SETTINGS = "omnia.settings";

function read(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key) ?? "null");
    return value ?? fallback;
  } catch {
    return fallback;
  }
}

function newId() {
  return `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
}

export class Store {
  constructor() {
    const list = read(CONVERSATIONS, []);
    this.conversations = Array.isArray(list) ? list.filter((c) => c && Array.isArray(c.messages)) : [];
    // An answer cut by a reload mid-stream is kept as it was, marked as interrupted.
    for (const c of this.conversations) {
      for (const m of c.messages) if (m.state === "streaming") m.state = "stopped";
    }
    this.currentId = localStorage.getItem(CURRENT);
    if (!this.current()) this.currentId = this.conversations[0]?.id ?? null;
  }

  current() {
    return this.conversations.find((c) => c.id === this.currentId) ?? null;
  }

  create() {
    const conversation = { id: newId(), title: "New chat", messages: [], updated: Date.now() };
    this.conversations.unshift(conversation);
    this.select(conversation.id);
    return conversation;
  }

  select(id) {
    this.currentId = id;
    if (id) localStorage.setItem(CURRENT, id);
    else localStorage.removeItem(CURRENT);
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) this.select(this.conversations[0]?.id ?? null);
    this.save();
  }

  touch(conversation) {
    conversation.updated = Date.now();
    const firstUser = conversation.messages.find((m) => m.role === "user");
    if (firstUser && conversation.title === "New chat") {
      const title = firstUser.content.replace(/\s+/g, " ").trim();
      conversation.title = title.length > 48 ? `${title.slice(0, 47)}…` : title || "New chat";
    }
    // Most recently used first.
    this.conversations.sort((a, b) => b.updated - a.updated);
  }

  save() {
    try {
      localStorage.setItem(CONVERSATIONS, JSON.stringify(this.conversations));
    } catch (e) {
      console.warn("could not save the conversations", e);
    }
  }
}

export function loadSettings() {
  const s = read(SETTINGS, {});
  return {
    model: typeof s.model === "string" ? s.model : "",
    temperature: typeof s.temperature === "string" ? s.temperature : "",
    maxTokens: typeof s.maxTokens === "string" ? s.maxTokens : "512",
    system: typeof s.system === "string" ? s.system : "",
  };
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}
