// A small Markdown renderer for chat messages. Everything the model wrote is HTML-escaped
// first and only the markup below is turned into tags, so no model output can inject HTML.
// It covers what chat models write: fenced and indented code, headings, lists (nested),
// quotes, tables, rules, emphasis, inline code, links; single newlines are line breaks, as
// in llama-server's UI. An unclosed fence (a reply still streaming) renders as code to the end.
"use strict";

const Markdown = (() => {
  const esc = (s) =>
    s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");

  // Links keep only schemes that cannot run script.
  const safeUrl = (u) => {
    const url = u.trim().replace(/&amp;/g, "&");
    if (/^(https?:|mailto:|#|\/|\.\/)/i.test(url)) return esc(url);
    return null;
  };

  function inline(src) {
    const codes = [];
    // Code spans first: their content is literal.
    let s = src.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, __, code) => {
      codes.push("<code>" + esc(code.replace(/^ (.*) $/s, "$1")) + "</code>");
      return "\u0000" + (codes.length - 1) + "\u0000";
    });
    s = esc(s);
    s = s.replace(/!?\[([^\]]*)\]\(([^)\s]+)(?:\s+&quot;[^&]*&quot;)?\)/g, (m, text, url) => {
      const u = safeUrl(url);
      return u ? `<a href="${u}" target="_blank" rel="noopener noreferrer">${text}</a>` : m;
    });
    s = s.replace(/&lt;(https?:\/\/[^\s&]+)&gt;/g, (m, url) => {
      const u = safeUrl(url);
      return u ? `<a href="${u}" target="_blank" rel="noopener noreferrer">${u}</a>` : m;
    });
    s = s.replace(/(\*\*|__)(?=\S)([\s\S]*?\S)\1/g, "<strong>$2</strong>");
    s = s.replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>");
    s = s.replace(/(^|[^_\w])_(?=[^\s_])([^_]*?[^\s_])_(?![_\w])/g, "$1<em>$2</em>");
    s = s.replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
    s = s.replace(/ {2,}\n|\\\n|\n/g, "<br>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => codes[+i]);
  }

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])(\s+|$)/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  const cells = (line) => {
    let l = line.trim();
    if (l.startsWith("|")) l = l.slice(1);
    if (l.endsWith("|") && !l.endsWith("\\|")) l = l.slice(0, -1);
    return l.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  };

  const startsBlock = (line, next) =>
    FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    ITEM.test(line) || (line.includes("|") && next !== undefined && TABLE_SEP.test(next));

  function codeBlock(lang, body) {
    const cls = lang ? ` class="language-${esc(lang)}"` : "";
    const label = lang ? `<span class="lang">${esc(lang)}</span>` : "<span></span>";
    return `<div class="code"><div class="code-head">${label}<button type="button" class="copy" data-copy>Copy</button></div><pre><code${cls}>${esc(body)}</code></pre></div>`;
  }

  function blocks(lines) {
    let out = "";
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) { i++; continue; }
      let m;
      if ((m = line.match(FENCE))) {
        const fence = m[1];
        const body = [];
        i++;
        while (i < lines.length) {
          const t = lines[i].trim();
          if (t.startsWith(fence[0].repeat(fence.length)) && /^[`~]+$/.test(t)) { i++; break; }
          body.push(lines[i]);
          i++;
        }
        out += codeBlock(m[2], body.join("\n"));
        continue;
      }
      if (/^( {4}|\t)/.test(line)) {
        const body = [];
        while (i < lines.length && (/^( {4}|\t)/.test(lines[i]) || !lines[i].trim())) {
          body.push(lines[i].replace(/^( {4}|\t)/, ""));
          i++;
        }
        while (body.length && !body[body.length - 1].trim()) body.pop();
        out += codeBlock("", body.join("\n"));
        continue;
      }
      if ((m = line.match(HEADING))) {
        const n = m[1].length;
        out += `<h${n}>${inline(m[2] || "")}</h${n}>`;
        i++;
        continue;
      }
      if (RULE.test(line)) { out += "<hr>"; i++; continue; }
      if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && lines[i].trim() && (QUOTE.test(lines[i]) || body.length)) {
          if (!QUOTE.test(lines[i]) && startsBlock(lines[i], lines[i + 1])) break;
          body.push(lines[i].replace(QUOTE, ""));
          i++;
        }
        out += `<blockquote>${blocks(body)}</blockquote>`;
        continue;
      }
      if ((m = line.match(ITEM))) {
        const ordered = /\d/.test(m[2]);
        const start = ordered ? parseInt(m[2], 10) : 1;
        const items = [];
        while (i < lines.length) {
          const im = lines[i].match(ITEM);
          if (!im || /\d/.test(im[2]) !== ordered) break;
          const indent = im[0].length;
          const body = [lines[i].slice(indent)];
          i++;
          while (i < lines.length) {
            const l = lines[i];
            if (!l.trim()) {
              // A blank line continues the item only if indented text follows.
              if (i + 1 < lines.length && /^\s{2,}\S/.test(lines[i + 1])) { body.push(""); i++; continue; }
              break;
            }
            const lead = l.length - l.trimStart().length;
            if (lead >= 2) { body.push(l.slice(Math.min(lead, indent))); i++; continue; }
            if (ITEM.test(l) || startsBlock(l, lines[i + 1])) break;
            body.push(l); // a lazy continuation line
            i++;
          }
          items.push(body);
        }
        const tag = ordered ? "ol" : "ul";
        const st = ordered && start !== 1 ? ` start="${start}"` : "";
        out += `<${tag}${st}>` + items.map((b) => {
          const inner = blocks(b);
          // A tight item is one paragraph: drop its <p> so the list stays compact.
          const tight = inner.match(/^<p>([\s\S]*?)<\/p>([\s\S]*)$/);
          return `<li>${tight && !tight[1].includes("<p>") ? tight[1] + tight[2] : inner}</li>`;
        }).join("") + `</${tag}>`;
        continue;
      }
      if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
        const head = cells(line);
        const aligns = cells(lines[i + 1]).map((c) =>
          c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
        const al = (j) => (aligns[j] ? ` class="al-${aligns[j]}"` : "");
        i += 2;
        let t = "<div class=\"table\"><table><thead><tr>" +
          head.map((c, j) => `<th${al(j)}>${inline(c)}</th>`).join("") + "</tr></thead><tbody>";
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
          const row = cells(lines[i]);
          t += "<tr>" + head.map((_, j) => `<td${al(j)}>${inline(row[j] || "")}</td>`).join("") + "</tr>";
          i++;
        }
        out += t + "</tbody></table></div>";
        continue;
      }
      const para = [line];
      i++;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i], lines[i + 1])) {
        para.push(lines[i]);
        i++;
      }
      out += `<p>${inline(para.join("\n"))}</p>`;
    }
    return out;
  }

  return {
    render: (text) => blocks(String(text).replace(/\r\n?/g, "\n").split("\n")),
    escape: esc,
  };
})();
