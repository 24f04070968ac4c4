// A small Markdown renderer that escapes everything first.
// Model output is untrusted: every character is HTML-escaped before any Markdown rule runs, the
// rules only add a fixed set of tags, and links are kept only for http(s) URLs. Nothing the model
// writes can become a tag or an attribute.
(function (global) {
  "use strict";

  function escapeHtml(text) {
    return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  // Inline rules run on already-escaped text.
  function inline(escaped) {
    const codes = [];
    let s = escaped.replace(/`([^`\n]+)`/g, function (_, code) {
      codes.push(code);
      return "\u0000" + (codes.length - 1) + "\u0000";
    });
    s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>");
    s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)"]+)\)/g, function (_, label, url) {
      return '<a href="' + url + '" target="_blank" rel="noopener noreferrer">' + label + "</a>";
    });
    return s.replace(/\u0000(\d+)\u0000/g, function (_, i) { return "<code>" + codes[+i] + "</code>"; });
  }

  function render(source) {
    const lines = escapeHtml(source).split("\n");
    const out = [];
    let para = [];
    let list = null; // "ul" | "ol"
    const flushPara = function () {
      if (para.length) { out.push("<p>" + inline(para.join("<br>")) + "</p>"); para = []; }
    };
    const closeList = function () { if (list) { out.push("</" + list + ">"); list = null; } };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^```\s*([\w+-]*)\s*$/);
      if (fence) {
        flushPara(); closeList();
        const body = [];
        i++;
        while (i < lines.length && !/^```\s*$/.test(lines[i])) { body.push(lines[i]); i++; }
        const lang = fence[1] ? ' data-lang="' + fence[1] + '"' : "";
        out.push("<pre><code" + lang + ">" + body.join("\n") + "</code></pre>");
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
      const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (heading) {
        flushPara(); closeList();
        const level = Math.min(heading[1].length + 2, 6);
        out.push("<h" + level + ">" + inline(heading[2]) + "</h" + level + ">");
      } else if (bullet || numbered) {
        flushPara();
        const kind = bullet ? "ul" : "ol";
        if (list !== kind) { closeList(); out.push("<" + kind + ">"); list = kind; }
        out.push("<li>" + inline((bullet || numbered)[1]) + "</li>");
      } else if (/^\s*$/.test(line)) {
        flushPara(); closeList();
      } else {
        closeList();
        para.push(line);
      }
    }
    flushPara(); closeList();
    return out.join("");
  }

  global.TreadleMarkdown = { render: render, escapeHtml: escapeHtml };
})(window);
