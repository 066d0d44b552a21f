// A small Markdown renderer for model answers: headings, paragraphs, bold/italic/strikethrough,
// inline code, fenced code blocks, (nested) lists, block quotes, rules and links.
//
// Safety: every piece of source text is HTML-escaped before it reaches the output; the only tags
// in the result are the ones this module writes. Link targets are limited to http(s), mailto,
// same-origin paths and fragments, and open with rel="noopener noreferrer".

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const SAFE_URL = /^(https?:\/\/|mailto:|\/(?!\/)|#)/i;
const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const SLOT = /\u0000(\d+)\u0000/g;

function indentOf(line) {
  return line.length - line.trimStart().length;
}

function isBlank(line) {
  return line.trim() === "";
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line)
    || LIST_ITEM.test(line);
}

// -- inline ---------------------------------------------------------------------------------------

function link(url, labelHtml) {
  return `<a href="${escapeHtml(url)}" target="_blank" rel="noopener noreferrer">${labelHtml}</a>`;
}

function emphasis(escaped) {
  return escaped
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>")
    .replace(/\*(?=[^\s*])([^*]*?[^\s*]|[^\s*])\*/g, "<em>$1</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_]|[^\s_])_(?!\w)/g, "$1<em>$2</em>");
}

/** One line (or a few joined lines) of inline Markdown to safe HTML. */
export function renderInline(text) {
  const slots = [];
  const keep = (html) => `\u0000${slots.push(html) - 1}\u0000`;
  let s = String(text).replace(/\u0000/g, "");
  // Code spans first: nothing inside them is Markdown.
  s = s.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, _ticks, code) =>
    keep(`<code>${escapeHtml(code)}</code>`));
  // [label](url "title")
  s = s.replace(/\[([^\]\n]+)\]\(\s*<?([^\s<>()]+(?:\([^\s<>()]*\))?)>?(?:\s+"[^"\n]*")?\s*\)/g,
    (whole, label, url) =>
      SAFE_URL.test(url) ? keep(link(url, emphasis(escapeHtml(label)))) : whole);
  // Bare URLs.
  s = s.replace(/\bhttps?:\/\/[^\s<>"'`\u0000]*[^\s<>"'`\u0000.,;:!?)\]]/g, (url) =>
    keep(link(url, escapeHtml(url))));
  s = emphasis(escapeHtml(s));
  // Slots may hold slots (a code span inside a link label): restore until none is left.
  for (let pass = 0; pass < 4 && s.includes("\u0000"); pass++) {
    s = s.replace(SLOT, (_, n) => slots[Number(n)] ?? "");
  }
  return s;
}

// -- blocks ---------------------------------------------------------------------------------------

function parseList(lines, start) {
  const base = indentOf(lines[start]);
  const first = lines[start].match(LIST_ITEM);
  const ordered = /\d/.test(first[2]);
  const items = [];
  let i = start;
  while (i < lines.length) {
    const line = lines[i];
    if (isBlank(line)) {
      // A blank line inside a list only if the list goes on after it.
      let j = i + 1;
      while (j < lines.length && isBlank(lines[j])) j++;
      const next = j < lines.length ? lines[j] : null;
      if (next !== null && indentOf(next) >= base && LIST_ITEM.test(next)) {
        i = j;
        continue;
      }
      if (next !== null && items.length && indentOf(next) > base) {
        i = j;
        continue;
      }
      break;
    }
    const m = line.match(LIST_ITEM);
    const indent = indentOf(line);
    if (m && indent === base) {
      if (/\d/.test(m[2]) !== ordered) break;
      items.push({ text: [m[3]], nested: [], number: parseInt(m[2], 10) });
      i++;
    } else if (m && indent > base && items.length) {
      const [html, next] = parseList(lines, i);
      items[items.length - 1].nested.push(html);
      i = next;
    } else if (!m && indent > base && items.length && !FENCE.test(line)) {
      items[items.length - 1].text.push(line.trim());  // a continuation line
      i++;
    } else if (!m && items.length && indent <= base && !startsBlock(line) && !isBlank(lines[i - 1])) {
      items[items.length - 1].text.push(line.trim());  // a lazy continuation
      i++;
    } else {
      break;
    }
  }
  const tag = ordered ? "ol" : "ul";
  const startAttr = ordered && items.length && items[0].number !== 1
    ? ` start="${items[0].number}"` : "";
  const body = items
    .map((it) => `<li>${it.text.map(renderInline).join("<br>")}${it.nested.join("")}</li>`)
    .join("");
  return [`<${tag}${startAttr}>${body}</${tag}>`, i];
}

/** Markdown text (possibly cut mid-stream) to safe HTML. */
export function renderMarkdown(source) {
  const lines = String(source).replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const marker = fence[1];
      const lang = fence[2];
      const body = [];
      i++;
      const closing = new RegExp(`^ {0,3}${marker[0] === "`" ? "`" : "~"}{${marker.length},}\\s*$`);
      while (i < lines.length && !closing.test(lines[i])) body.push(lines[i++]);
      i++;  // the closing fence (an answer cut mid-block simply ends here)
      const cls = lang ? ` class="language-${escapeHtml(lang)}"` : "";
      const label = lang ? `<span class="code-lang">${escapeHtml(lang)}</span>` : "";
      out.push(`<pre>${label}<code${cls}>${escapeHtml(body.join("\n"))}</code></pre>`);
      continue;
    }
    if (isBlank(line)) {
      i++;
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      const n = heading[1].length;
      out.push(`<h${n}>${renderInline(heading[2])}</h${n}>`);
      i++;
      continue;
    }
    if (RULE.test(line)) {
      out.push("<hr>");
      i++;
      continue;
    }
    if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && QUOTE.test(lines[i])) inner.push(lines[i++].match(QUOTE)[1]);
      out.push(`<blockquote>${renderMarkdown(inner.join("\n"))}</blockquote>`);
      continue;
    }
    if (LIST_ITEM.test(line)) {
      const [html, next] = parseList(lines, i);
      out.push(html);
      i = next;
      continue;
    }
    const para = [];
    while (i < lines.length && !isBlank(lines[i]) && (para.length === 0 || !startsBlock(lines[i]))) {
      para.push(lines[i++].trim());
    }
    out.push(`<p>${para.map(renderInline).join("<br>")}</p>`);
  }
  return out.join("\n");
}
