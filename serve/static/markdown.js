// tl's small markdown renderer for the chat page (serve/page.py serves it).
//
// Builds DOM nodes (createElement, createTextNode), never HTML strings, so a model's text can
// add no markup of its own: whatever it writes ends up as text. Covers paragraphs (a single
// newline is a line break, as chat answers mean it), headings, bold, italic, strikethrough,
// inline code, fenced code blocks (an unclosed fence, mid-stream, runs to the end), bullet and
// numbered lists nested by indentation, block quotes, rules, and links (http, https and mailto
// only: any other target stays plain text). Tested through tests/serve/test_chat_page.py.
"use strict";

(function () {
  const FENCE = /^(\s*)(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(\s+#+)?\s*$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const QUOTE = /^ {0,3}>\s?(.*)$/;
  const SAFE_URL = /^(https?:\/\/|mailto:)/i;
  const PUNCT = /[!-/:-@[-`{-~]/;

  function el(tag, parent, cls) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (parent) parent.appendChild(e);
    return e;
  }

  function render(text) {
    const frag = document.createDocumentFragment();
    blocks(String(text).replace(/\r\n?/g, "\n").split("\n"), frag);
    return frag;
  }

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
  }

  function blocks(lines, parent) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) {
        i++;
      } else if ((m = FENCE.exec(line))) {
        i = fence(lines, i, m, parent);
      } else if ((m = HEADING.exec(line))) {
        inline(m[2], el("h" + m[1].length, parent));
        i++;
      } else if (RULE.test(line)) {
        el("hr", parent);
        i++;
      } else if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          inner.push(m[1]);
          i++;
        }
        blocks(inner, el("blockquote", parent));
      } else if (ITEM.test(line)) {
        i = list(lines, i, parent);
      } else {
        i = paragraph(lines, i, parent);
      }
    }
  }

  function paragraph(lines, i, parent) {
    const p = el("p", parent);
    inline(lines[i].trim(), p);
    i++;
    while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) {
      el("br", p);
      inline(lines[i].trim(), p);
      i++;
    }
    return i;
  }

  // A fenced code block from lines[start] (its opening fence, matched as m) to the closing fence
  // or the end; the fence's own indentation is taken off each line.
  function fence(lines, start, m, parent) {
    const indent = m[1].length;
    const marker = m[2];
    const body = [];
    let i = start + 1;
    for (; i < lines.length; i++) {
      const t = lines[i].trim();
      if (t.length >= marker.length && t === marker[0].repeat(t.length)) {
        i++;
        break;
      }
      body.push(lines[i].slice(Math.min(indent, lines[i].length - lines[i].trimStart().length)));
    }
    const box = el("div", parent, "code");
    const head = el("div", box, "code-head");
    el("span", head).textContent = m[3] || "code";
    const code = body.join("\n");
    if (navigator.clipboard) {
      const copy = el("button", head, "copy");
      copy.type = "button";
      copy.textContent = "Copy";
      copy.addEventListener("click", function () {
        navigator.clipboard.writeText(code).then(function () {
          copy.textContent = "Copied";
        });
      });
    }
    const c = el("code", el("pre", box));
    if (m[3]) c.className = "language-" + m[3];
    c.textContent = code;
    return i;
  }

  // A list from lines[i]: items nest by indentation; an indented line continues the last item
  // (a fence there is a code block inside it); a blank line ends the list unless an item or an
  // indented line follows.
  function list(lines, i, parent) {
    const stack = []; // {indent, ordered, list, item}, innermost last
    while (i < lines.length) {
      const line = lines[i];
      const m = ITEM.exec(line);
      if (!line.trim()) {
        let j = i + 1;
        while (j < lines.length && !lines[j].trim()) j++;
        if (j < lines.length && (ITEM.test(lines[j]) || /^\s{2,}\S/.test(lines[j]))) {
          i = j;
          continue;
        }
        break;
      }
      if (m && !RULE.test(line)) {
        const indent = m[1].replace(/\t/g, "    ").length;
        const ordered = /\d/.test(m[2][0]);
        while (stack.length && indent < stack[stack.length - 1].indent) stack.pop();
        let top = stack[stack.length - 1];
        if (top && indent === top.indent && ordered !== top.ordered) {
          stack.pop();
          top = stack[stack.length - 1];
        }
        if (!top || indent > top.indent) {
          const listEl = el(ordered ? "ol" : "ul", top ? top.item : parent);
          const n = parseInt(m[2], 10);
          if (ordered && n !== 1) listEl.start = n;
          top = { indent: indent, ordered: ordered, list: listEl, item: null };
          stack.push(top);
        }
        top.item = el("li", top.list);
        inline(m[3], top.item);
        i++;
      } else if (stack.length && /^\s/.test(line)) {
        const item = stack[stack.length - 1].item;
        const f = FENCE.exec(line);
        if (f) {
          i = fence(lines, i, f, item);
        } else {
          el("br", item);
          inline(line.trim(), item);
          i++;
        }
      } else {
        break;
      }
    }
    return i;
  }

  function isSpace(ch) {
    return ch === undefined || /\s/.test(ch);
  }

  function isWord(ch) {
    return ch !== undefined && /[\p{L}\p{N}]/u.test(ch);
  }

  // The index of the `delim` closing a span opened just before `from`: content not empty, not
  // starting or ending with a space; -1 if none.
  function closing(text, delim, from) {
    if (isSpace(text[from])) return -1;
    for (let j = text.indexOf(delim, from + 1); j !== -1; j = text.indexOf(delim, j + 1)) {
      if (isSpace(text[j - 1])) continue;
      if (delim.length === 1 && (text[j + 1] === delim || text[j - 1] === delim)) continue;
      if (delim[0] === "_" && isWord(text[j + delim.length])) continue;
      return j;
    }
    return -1;
  }

  // The end of a code span opened by `n` backticks at i (the index of its closing run), or -1.
  function codeEnd(text, i, n) {
    let j = i + n;
    while ((j = text.indexOf("`", j)) !== -1) {
      let k = j;
      while (text[k] === "`") k++;
      if (k - j === n) return j;
      j = k;
    }
    return -1;
  }

  function link(a, href) {
    a.href = href;
    a.rel = "noopener noreferrer";
    a.target = "_blank";
  }

  function inline(text, parent) {
    let buf = "";
    function flush() {
      if (buf) parent.appendChild(document.createTextNode(buf));
      buf = "";
    }
    let i = 0;
    while (i < text.length) {
      const c = text[i];
      const two = text.slice(i, i + 2);
      let m;
      if (c === "\\" && PUNCT.test(text[i + 1] || "")) {
        buf += text[i + 1];
        i += 2;
        continue;
      }
      if (c === "`") {
        let n = 1;
        while (text[i + n] === "`") n++;
        const j = codeEnd(text, i, n);
        if (j === -1) {
          buf += text.slice(i, i + n);
          i += n;
          continue;
        }
        let code = text.slice(i + n, j);
        if (code.length > 2 && code[0] === " " && code[code.length - 1] === " ") code = code.slice(1, -1);
        flush();
        el("code", parent).textContent = code;
        i = j + n;
        continue;
      }
      if (c === "[" && (m = /^\[([^\]]*)\]\(\s*<?([^\s<>()]*)>?(?:\s+"[^"]*")?\s*\)/.exec(text.slice(i)))) {
        flush();
        if (SAFE_URL.test(m[2])) {
          const a = el("a", parent);
          link(a, m[2]);
          inline(m[1] || m[2], a);
        } else {
          inline(m[1], parent);
        }
        i += m[0].length;
        continue;
      }
      if (two === "**" || two === "__" || two === "~~") {
        const j = two === "__" && isWord(text[i - 1]) ? -1 : closing(text, two, i + 2);
        if (j !== -1) {
          flush();
          inline(text.slice(i + 2, j), el(two === "~~" ? "del" : "strong", parent));
          i = j + 2;
          continue;
        }
      }
      if ((c === "*" || c === "_") && text[i + 1] !== c && !(c === "_" && isWord(text[i - 1]))) {
        const j = closing(text, c, i + 1);
        if (j !== -1) {
          flush();
          inline(text.slice(i + 1, j), el("em", parent));
          i = j + 1;
          continue;
        }
      }
      if (c === "h" && !isWord(text[i - 1]) && (m = /^https?:\/\/[^\s<>()]*[^\s<>().,;:!?'"*_]/.exec(text.slice(i)))) {
        flush();
        const a = el("a", parent);
        link(a, m[0]);
        a.textContent = m[0];
        i += m[0].length;
        continue;
      }
      buf += c;
      i++;
    }
    flush();
  }

  window.tlMarkdown = { render: render };
})();
