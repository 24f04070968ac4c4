// treadle web chat: conversations in localStorage, streaming replies, stop, settings, engine panel
// (its numbers, and recent requests' timelines on a time axis).
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const STORE = "treadle.conversations";
  const SETTINGS = "treadle.settings";
  const KEY = "treadle.apiKey";

  let conversations = load(STORE, []);
  let settings = Object.assign({ system: "", temperature: 0.7, top_p: 1, max_tokens: 512 }, load(SETTINGS, {}));
  let currentId = conversations.length ? conversations[0].id : null;
  let model = null;
  let controller = null;

  function load(key, fallback) {
    try { const v = JSON.parse(localStorage.getItem(key)); return v == null ? fallback : v; } catch (e) { return fallback; }
  }
  function save() {
    try { localStorage.setItem(STORE, JSON.stringify(conversations)); }
    catch (e) {  // over the browser's quota: keep the conversations, not their pictures
      const light = conversations.map((c) => ({ ...c, messages: c.messages.map((m) => ({ ...m, images: undefined })) }));
      try { localStorage.setItem(STORE, JSON.stringify(light)); } catch (e2) { /* nothing more to drop */ }
    }
  }
  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = localStorage.getItem(KEY);
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }
  function current() { return conversations.find((c) => c.id === currentId) || null; }

  // ---------------------------------------------------------------- rendering

  function renderList() {
    const ul = $("conversations");
    ul.textContent = "";
    for (const c of conversations) {
      const li = document.createElement("li");
      li.className = c.id === currentId ? "active" : "";
      const title = document.createElement("span");
      title.className = "title";
      title.textContent = c.title || "New chat";
      title.onclick = () => { currentId = c.id; renderAll(); closeSidebarOnPhone(); };
      const del = document.createElement("button");
      del.className = "delete";
      del.type = "button";
      del.title = "Delete chat";
      del.setAttribute("aria-label", "Delete chat");
      del.textContent = "×";
      del.onclick = () => deleteChat(c.id);
      li.append(title, del);
      ul.append(li);
    }
  }

  function messageNode(m) {
    const div = document.createElement("div");
    div.className = "msg " + m.role;
    const body = document.createElement("div");
    body.className = "body";
    if (m.images && m.images.length) {
      const row = document.createElement("div");
      row.className = "images";
      for (const src of m.images) {
        const img = document.createElement("img");
        img.src = src;
        img.alt = "attached image";
        row.append(img);
      }
      div.append(row);
    }
    // Markdown renderer escapes all model text before adding its own tags.
    if (m.role === "assistant") body.innerHTML = TreadleMarkdown.render(m.content || "");
    else body.textContent = m.content;
    div.append(body);
    if (m.stats) {
      const st = document.createElement("div");
      st.className = "stats";
      st.textContent = statsText(m.stats);
      div.append(st);
    }
    return div;
  }

  function statsText(s) {
    const parts = [];
    if (s.prompt_tokens != null) parts.push(s.prompt_tokens + " prompt tokens");
    if (s.cached_tokens != null) parts.push(s.cached_tokens + " cached");
    if (s.ttft_ms != null) parts.push("TTFT " + Math.round(s.ttft_ms) + " ms");
    if (s.tokens_per_s != null) parts.push(s.tokens_per_s.toFixed(1) + " tok/s");
    if (s.finish_reason) parts.push(s.finish_reason);
    return parts.join(" · ");
  }

  function renderMessages() {
    const box = $("messages");
    box.textContent = "";
    const c = current();
    $("chat-title").textContent = c ? c.title || "New chat" : "New chat";
    if (!c) return;
    for (const m of c.messages) box.append(messageNode(m));
    box.scrollTop = box.scrollHeight;
  }

  function renderAll() { renderList(); renderMessages(); }

  // ---------------------------------------------------------------- conversations

  function newChat() {
    const c = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "", messages: [] };
    conversations.unshift(c);
    currentId = c.id;
    save();
    renderAll();
    $("input").focus();
  }

  function deleteChat(id) {
    conversations = conversations.filter((c) => c.id !== id);
    if (currentId === id) currentId = conversations.length ? conversations[0].id : null;
    save();
    renderAll();
  }

  // ---------------------------------------------------------------- sending

  // a message's content as the API takes it: its images (data: URLs) before its text
  function apiContent(m) {
    if (!m.images || !m.images.length) return m.content;
    const parts = m.images.map((url) => ({ type: "image_url", image_url: { url: url } }));
    if (m.content) parts.push({ type: "text", text: m.content });
    return parts;
  }

  // ---------------------------------------------------------------- images (a model that sees)

  let sees = false;  // the model takes images (/v1/models: input_modalities)
  let pending = [];  // data: URLs attached to the next message

  function renderAttachments() {
    const box = $("attachments");
    box.textContent = "";
    box.hidden = !pending.length;
    pending.forEach((url, i) => {
      const fig = document.createElement("figure");
      const img = document.createElement("img");
      img.src = url;
      img.alt = "image to send";
      const drop = document.createElement("button");
      drop.type = "button";
      drop.textContent = "×";
      drop.setAttribute("aria-label", "remove image");
      drop.onclick = () => { pending.splice(i, 1); renderAttachments(); };
      fig.append(img, drop);
      box.append(fig);
    });
  }

  function attach(files) {
    if (!sees) return;
    for (const file of files) {
      if (!file || !file.type.startsWith("image/")) continue;
      const reader = new FileReader();
      reader.onload = () => { pending.push(reader.result); renderAttachments(); };
      reader.readAsDataURL(file);
    }
  }

  async function send(text) {
    if (!current()) newChat();
    const c = current();
    const images = pending;
    pending = [];
    renderAttachments();
    c.messages.push(images.length ? { role: "user", content: text, images: images } : { role: "user", content: text });
    if (!c.title) c.title = (text || "image").slice(0, 40);
    const reply = { role: "assistant", content: "", stats: null };
    c.messages.push(reply);
    save();
    renderAll();
    const node = $("messages").lastChild;
    const body = node.querySelector(".body");

    const messages = [];
    if (settings.system) messages.push({ role: "system", content: settings.system });
    for (const m of c.messages.slice(0, -1)) messages.push({ role: m.role, content: apiContent(m) });
    const payload = {
      model: model || undefined,
      messages: messages,
      temperature: Number(settings.temperature),
      top_p: Number(settings.top_p),
      max_tokens: Number(settings.max_tokens),
      stream: true,
      stream_options: { include_usage: true },
    };

    controller = new AbortController();
    setBusy(true);
    const start = performance.now();
    let first = null, tokens = 0, finish = null, usage = null;
    try {
      const resp = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(payload), signal: controller.signal,
      });
      if (!resp.ok) {
        const err = await resp.json().catch(() => ({}));
        if (resp.status === 401) askForKey();
        throw new Error((err.error && err.error.message) || resp.statusText);
      }
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut).trim();
          buffer = buffer.slice(cut + 2);
          if (!event.startsWith("data:")) continue;
          const data = event.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const piece = choice.delta && choice.delta.content;
            if (piece) {
              if (first === null) first = performance.now();
              tokens += 1;
              reply.content += piece;
              body.innerHTML = TreadleMarkdown.render(reply.content);
              $("messages").scrollTop = $("messages").scrollHeight;
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else { reply.content += (reply.content ? "\n\n" : "") + "⚠ " + e.message; finish = "error"; }
    } finally {
      controller = null;
      setBusy(false);
    }
    const end = performance.now();
    const generated = usage ? usage.completion_tokens : tokens;
    reply.stats = {
      prompt_tokens: usage ? usage.prompt_tokens : null,
      cached_tokens: usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null,
      ttft_ms: first !== null ? first - start : null,
      tokens_per_s: first !== null && generated > 1 ? (generated - 1) / ((end - first) / 1000) : null,
      finish_reason: finish,
    };
    save();
    renderMessages();
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("input").disabled = false;
  }

  function askForKey() {
    $("settings").hidden = false;
    $("set-api-key").focus();
  }

  // ---------------------------------------------------------------- engine panel

  let lastTokens = null, lastTime = null;
  async function pollStats() {
    try {
      const r = await fetch("/stats", { headers: headers() });
      if (r.ok) {
        const s = await r.json();
        const used = s.kv_blocks_total - s.kv_blocks_free;
        $("st-running").textContent = s.num_running;
        $("st-waiting").textContent = s.num_waiting;
        $("st-kv").textContent = used + " / " + s.kv_blocks_total;
        $("st-kvbar").style.width = (100 * used / Math.max(1, s.kv_blocks_total)).toFixed(1) + "%";
        $("st-hits").textContent = s.prefix_cache_queries ? (100 * s.prefix_cache_hits / s.prefix_cache_queries).toFixed(1) + "%" : "–";
        $("st-preempt").textContent = s.num_preemptions;
        const spec = s.spec_decode;  // speculative decoding: 1 + accepted / verifications
        $("st-spec-label").hidden = $("st-spec").hidden = !spec;
        if (spec) $("st-spec").textContent = spec.mean_acceptance_length ? spec.mean_acceptance_length.toFixed(2) : "–";
        const now = performance.now();
        if (lastTokens !== null) {
          const tps = (s.generation_tokens - lastTokens) / ((now - lastTime) / 1000);
          $("st-tps").textContent = tps.toFixed(1);
        }
        lastTokens = s.generation_tokens;
        lastTime = now;
      }
    } catch (e) { /* server restarting: try again next tick */ }
    setTimeout(pollStats, 1000);
  }

  // ---------------------------------------------------------------- request timelines

  // each phase's colour, as `treadle bench serve --save-timelines` draws them (treadle/bench/timeline_plot.py)
  const PHASE_COLOURS = { model_load: "#8e8e93", queued: "#e0a526", prefill: "#3b7dd8", decode: "#2f9e5a", preempted: "#d0453c" };
  const SVG_NS = "http://www.w3.org/2000/svg";

  function svgNode(name, attrs) {
    const n = document.createElementNS(SVG_NS, name);
    for (const k in attrs) n.setAttribute(k, attrs[k]);
    return n;
  }

  function drawLegend() {
    const box = $("st-legend");
    for (const name in PHASE_COLOURS) {
      const s = document.createElement("span");
      s.style.setProperty("--c", PHASE_COLOURS[name]);
      s.textContent = name.replace("_", " ");
      box.append(s);
    }
  }

  function phaseEnd(rec, p) { return p.end != null ? p.end : (rec.e2e || p.start || 0); }

  // the latest requests, one row each (its first choice's phases) on one time axis; a click shows one
  function drawTimelines(records) {
    const svg = $("st-timeline");
    svg.textContent = "";
    if (!records.length) { svg.setAttribute("height", 0); return; }
    const width = Number(svg.getAttribute("width")), row = 7, gap = 2;
    const t0 = Math.min(...records.map((r) => r.arrival));
    const t1 = Math.max(...records.map((r) => r.arrival + (r.e2e || 0)));
    const scale = width / Math.max(1e-6, t1 - t0);
    svg.setAttribute("height", records.length * (row + gap));
    records.forEach((rec, i) => {
      const y = i * (row + gap);
      const g = svgNode("g", { "data-id": rec.id });
      const x0 = (rec.arrival - t0) * scale;
      // the whole row takes the click (a short request's bars are a pixel or two wide)
      g.append(svgNode("rect", { class: "hit", x: 0, y: y, width: width, height: row, fill: "transparent" }));
      g.append(svgNode("rect", { class: "track", x: x0, y: y, width: Math.max(1, (rec.e2e || 0) * scale), height: row, fill: "#eee" }));
      const phases = rec.choices.length ? rec.choices[0].phases : [];
      for (const p of phases) {
        if (p.start == null) continue;
        const x = Math.min(width - 1, x0 + p.start * scale);  // inside the axis, however the clocks round
        const bar = svgNode("rect", {
          class: "phase " + p.name, x: x, y: y,
          width: Math.max(1, Math.min(width - x, (phaseEnd(rec, p) - p.start) * scale)), height: row, fill: PHASE_COLOURS[p.name] || "#999",
        });
        const tip = svgNode("title", {});
        tip.textContent = p.name + " " + Math.round(1000 * (phaseEnd(rec, p) - p.start)) + " ms";
        bar.append(tip);
        g.append(bar);
      }
      g.addEventListener("click", () => showTimeline(rec.id));
      svg.append(g);
    });
  }

  async function showTimeline(id) {
    const box = $("st-request");
    try {
      const r = await fetch("/v1/requests/" + encodeURIComponent(id) + "/timeline", { headers: headers() });
      if (!r.ok) { box.hidden = false; box.textContent = "no timeline for " + id; return; }
      const rec = await r.json();
      box.textContent = "";
      const head = document.createElement("div");
      head.textContent = rec.id + " · " + (rec.e2e != null ? Math.round(1000 * rec.e2e) + " ms" : "");
      box.append(head);
      for (const c of rec.choices) {
        const table = document.createElement("table");
        const cap = document.createElement("caption");
        cap.textContent = "choice " + c.index + ": " + c.finish_reason + ", " + c.prompt_tokens + " in (" + c.cached_tokens + " cached), " + c.generation_tokens + " out";
        table.append(cap);
        for (const p of c.phases) {
          const tr = document.createElement("tr");
          const name = document.createElement("td");
          const sw = document.createElement("span");
          sw.className = "swatch";
          sw.style.background = PHASE_COLOURS[p.name] || "#999";
          name.append(sw, document.createTextNode(p.name));
          const when = document.createElement("td");
          when.textContent = Math.round(1000 * (p.start || 0)) + "–" + Math.round(1000 * phaseEnd(rec, p)) + " ms";
          const what = document.createElement("td");
          what.textContent = p.steps ? p.tokens + " tok · " + p.steps + " st · " + p.mean_batch_rows + " rows" : "";
          tr.append(name, when, what);
          table.append(tr);
        }
        box.append(table);
      }
      box.hidden = false;
    } catch (e) { /* the server went away: the next click tries again */ }
  }

  async function pollTimelines() {
    try {
      const r = await fetch("/v1/requests?limit=24", { headers: headers() });
      if (r.ok) drawTimelines((await r.json()).data);
    } catch (e) { /* server restarting: try again next tick */ }
    setTimeout(pollTimelines, 2000);
  }

  async function loadModel() {
    try {
      const r = await fetch("/v1/models", { headers: headers() });
      if (r.status === 401) { askForKey(); return; }
      const body = await r.json();
      model = body.data[0].id;
      $("model-name").textContent = model;
      sees = (body.data[0].input_modalities || []).includes("image");
      $("attach").hidden = !sees;
    } catch (e) { setTimeout(loadModel, 2000); }
  }

  // ---------------------------------------------------------------- wiring

  function closeSidebarOnPhone() { document.body.classList.remove("sidebar-open"); }

  function bindSettings() {
    $("set-system").value = settings.system;
    $("set-temperature").value = settings.temperature;
    $("set-top-p").value = settings.top_p;
    $("set-max-tokens").value = settings.max_tokens;
    $("set-api-key").value = localStorage.getItem(KEY) || "";
    const update = () => {
      settings = {
        system: $("set-system").value,
        temperature: $("set-temperature").value,
        top_p: $("set-top-p").value,
        max_tokens: $("set-max-tokens").value,
      };
      localStorage.setItem(SETTINGS, JSON.stringify(settings));
    };
    for (const id of ["set-system", "set-temperature", "set-top-p", "set-max-tokens"]) $(id).addEventListener("input", update);
    $("set-api-key").addEventListener("change", () => {
      const v = $("set-api-key").value.trim();
      if (v) localStorage.setItem(KEY, v); else localStorage.removeItem(KEY);
      loadModel();
    });
  }

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if ((!text && !pending.length) || controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("attach").addEventListener("click", () => $("attach-file").click());
  $("attach-file").addEventListener("change", (e) => { attach(e.target.files); e.target.value = ""; });
  $("input").addEventListener("paste", (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])].filter((f) => f.type.startsWith("image/"));
    if (files.length && sees) { e.preventDefault(); attach(files); }
  });
  const main = document.querySelector("main");
  main.addEventListener("dragover", (e) => { if (sees) { e.preventDefault(); main.classList.add("dropping"); } });
  main.addEventListener("dragleave", () => main.classList.remove("dropping"));
  main.addEventListener("drop", (e) => {
    main.classList.remove("dropping");
    if (!sees) return;
    e.preventDefault();
    attach(e.dataTransfer.files);
  });
  $("new-chat").addEventListener("click", newChat);
  $("toggle-settings").addEventListener("click", () => { $("settings").hidden = !$("settings").hidden; });
  $("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));

  bindSettings();
  renderAll();
  loadModel();
  pollStats();
  drawLegend();
  pollTimelines();
})();
