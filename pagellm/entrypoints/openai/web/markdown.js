// A small, safe Markdown renderer: the text is HTML-escaped first, so the model's output can never
// inject markup; then fenced code blocks, inline code, headings, lists, quotes, bold, italic and
// http(s) links. Code is coloured by a few token classes (comments, strings, numbers, keywords).

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const KEYWORDS = new Set(("def class return if elif else for while in import from as with try except finally " +
  "raise lambda yield async await const let var function new this null undefined true false True False None " +
  "fn pub struct impl use mut match int char void static public private package func go type interface").split(" "));

// Colours already-escaped code, token by token (one regular expression, so tokens never overlap).
function highlight(code) {
  const token = /(\/\/[^\n]*|(?<![&\w])#[^\n]*|\/\*[\s\S]*?\*\/)|(&quot;.*?&quot;|&#39;.*?&#39;|`[^`]*`)|(\b\d+(?:\.\d+)?\b)|(\b[A-Za-z_]\w*\b)/g;
  return code.replace(token, (match, comment, string, number, word) => {
    if (comment) return `<span class="tok-comment">${match}</span>`;
    if (string) return `<span class="tok-string">${match}</span>`;
    if (number) return `<span class="tok-number">${match}</span>`;
    if (word && KEYWORDS.has(word)) return `<span class="tok-keyword">${match}</span>`;
    return match;
  });
}

function inline(text) {
  return text
    .replace(/`([^`]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
    .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
}

function renderBlocks(text) {
  const out = [];
  let list = null; // "ul" | "ol" while inside a list
  const closeList = () => {
    if (list) out.push(`</${list}>`);
    list = null;
  };
  let paragraph = [];
  const flush = () => {
    if (paragraph.length) out.push(`<p>${inline(paragraph.join("<br>"))}</p>`);
    paragraph = [];
  };
  for (const line of text.split("\n")) {
    let m;
    if ((m = line.match(/^(#{1,6})\s+(.*)$/))) {
      flush(); closeList();
      out.push(`<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`);
    } else if ((m = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/))) {
      flush();
      const kind = /\d/.test(m[1]) ? "ol" : "ul";
      if (list !== kind) { closeList(); out.push(`<${kind}>`); list = kind; }
      out.push(`<li>${inline(m[2])}</li>`);
    } else if ((m = line.match(/^&gt;\s?(.*)$/))) {
      flush(); closeList();
      out.push(`<blockquote>${inline(m[1])}</blockquote>`);
    } else if (line.trim() === "") {
      flush(); closeList();
    } else {
      closeList();
      paragraph.push(line);
    }
  }
  flush(); closeList();
  return out.join("");
}

// Markdown text (possibly incomplete, while it streams) to HTML.
export function renderMarkdown(text) {
  const parts = escapeHtml(text).split(/^```/m);
  // Even parts are prose; odd parts are code blocks (`lang\ncode`), the last one maybe unclosed.
  return parts.map((part, i) => {
    if (i % 2 === 0) return renderBlocks(part);
    const newline = part.indexOf("\n");
    const lang = newline < 0 ? part : part.slice(0, newline);
    const code = newline < 0 ? "" : part.slice(newline + 1).replace(/\n$/, "");
    return `<div class="code-block"><div class="code-head"><span>${lang.trim() || "code"}</span>` +
      `<button class="copy-code" type="button">Copy</button></div><pre><code>${highlight(code)}</code></pre></div>`;
  }).join("");
}
