// tl's chat page (serve/page.py serves it): a multi-turn chat over the public API only.
//
// GET /v1/models names the model, its context length and its backend card; each turn is a
// POST /v1/chat/completions with stream: true, read as server-sent events through fetch and a
// ReadableStream. A delta's reasoning_content (or reasoning) goes to a collapsed <details>
// above the answer; content is rendered by markdown.js as it arrives. Stop aborts the fetch
// (the server sees the disconnect and frees the request's KV blocks); the partial answer stays
// in the conversation. The API key, when the server wants one, is sent as Authorization:
// Bearer and kept in localStorage with the other settings. Tested by tests/serve/test_chat_page.py.
"use strict";

(function () {
  const SETTINGS = ["system", "temperature", "max-tokens", "api-key"];
  const state = { model: null, messages: [], controller: null, conversation: 0 };

  function $(id) {
    return document.getElementById(id);
  }

  function el(tag, parent, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }

  function load(key) {
    try {
      return localStorage.getItem("tl." + key);
    } catch (e) {
      return null; // storage disabled: settings last as long as the page
    }
  }

  function save(key, value) {
    try {
      localStorage.setItem("tl." + key, value);
    } catch (e) {
      // storage disabled
    }
  }

  function setStatus(text, isError) {
    const s = $("status");
    s.textContent = text;
    s.classList.toggle("error", !!isError);
  }

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = $("api-key").value.trim();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  // The message of an API error response (OpenAI's {"error": {"message"}} shape), or its status.
  async function errorMessage(resp) {
    try {
      const doc = await resp.json();
      if (doc && doc.error && doc.error.message) return resp.status + ": " + doc.error.message;
    } catch (e) {
      // not JSON
    }
    return "HTTP " + resp.status;
  }

  // ---- the model card

  async function loadModel() {
    let resp;
    try {
      resp = await fetch("/v1/models", { headers: headers(false) });
    } catch (e) {
      $("model-id").textContent = "server unreachable";
      setStatus(String(e), true);
      return;
    }
    if (!resp.ok) {
      state.model = null;
      $("model-id").textContent = resp.status === 401 ? "API key needed" : "unavailable";
      setStatus(await errorMessage(resp), true);
      if (resp.status === 401) $("api-key").focus();
      if (resp.status === 503) setTimeout(loadModel, 2000); // still loading (or draining)
      return;
    }
    const card = (await resp.json()).data[0];
    state.model = card;
    $("model-id").textContent = card.id;
    $("model-ctx").textContent = "context " + card.max_model_len.toLocaleString("en") + " tokens";
    showBackend(card.backend);
    setStatus("");
  }

  function showBackend(b) {
    const list = $("backend-list");
    list.replaceChildren();
    const summary = $("backend").querySelector("summary");
    if (!b) {
      summary.textContent = "Backend: not reported";
      return;
    }
    summary.textContent = "Backend: " + b.platform + " " + b.device_kind + " \u00d7" + b.device_count;
    for (const [key, value] of Object.entries(b)) {
      el("dt", list, null, key.replace(/_/g, " "));
      const dd = el("dd", list, Array.isArray(value) && value.length ? "mono wide" : "mono");
      const items = Array.isArray(value) ? value : [value];
      if (!items.length || (items.length === 1 && items[0] === "")) dd.textContent = "\u2014";
      for (const item of items) el("div", dd, null, String(item));
    }
  }

  // ---- the conversation

  function scrollToEnd(force) {
    const log = $("log");
    if (force || log.scrollHeight - log.scrollTop - log.clientHeight < 120) log.scrollTop = log.scrollHeight;
  }

  function userView(text) {
    const box = el("div", $("log"), "msg user");
    el("div", box, "who", "you");
    el("div", box, "text", text);
    scrollToEnd(true);
    return box;
  }

  // The assistant's bubble: a collapsed <details> for reasoning (hidden until some arrives),
  // the answer as markdown, and a line of metadata. update() redraws at most once a frame.
  function assistantView() {
    const box = el("div", $("log"), "msg assistant streaming");
    el("div", box, "who", "assistant");
    const details = el("details", box, "reasoning");
    details.hidden = true;
    const summary = el("summary", details, null, "Thinking\u2026");
    const thoughts = el("div", details, "reasoning-text");
    const content = el("div", box, "content md");
    const meta = el("div", box, "meta");
    let pending = false;
    let turn = null;
    function draw() {
      pending = false;
      if (turn.reasoning) {
        details.hidden = false;
        thoughts.textContent = turn.reasoning;
        summary.textContent = turn.content || !box.classList.contains("streaming") ? "Reasoning" : "Thinking\u2026";
      }
      content.replaceChildren(window.tlMarkdown.render(turn.content));
      scrollToEnd(false);
    }
    return {
      update(t) {
        turn = t;
        if (!pending) {
          pending = true;
          requestAnimationFrame(draw);
        }
      },
      finish(t, note, isError) {
        turn = t;
        box.classList.remove("streaming");
        draw();
        meta.replaceChildren();
        if (note) el("span", meta, isError ? "error" : "note", note);
        const u = t.usage;
        if (u) {
          const ctx = state.model ? " of " + state.model.max_model_len.toLocaleString("en") : "";
          el("span", meta, null, u.prompt_tokens + " prompt + " + u.completion_tokens + " completion tokens" + ctx);
          const seconds = (t.lastAt - t.firstAt) / 1000;
          if (u.completion_tokens > 1 && seconds > 0) {
            el("span", meta, null, ((u.completion_tokens - 1) / seconds).toFixed(1) + " tokens/s");
          }
        }
        if (t.finish) el("span", meta, null, "finish: " + t.finish);
        box.dataset.state = isError ? "error" : note || "done";
      },
    };
  }

  // Calls onEvent with each JSON document of a server-sent event stream; returns at [DONE] or
  // the end of the stream.
  async function readEvents(body, onEvent) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let m;
      while ((m = /\r?\n\r?\n/.exec(buf))) {
        const block = buf.slice(0, m.index);
        buf = buf.slice(m.index + m[0].length);
        const data = block
          .split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (!data) continue; // a comment (": ping") or an event with no data
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }

  function applyChunk(doc, turn) {
    if (doc.error) throw new Error(doc.error.message || "the stream ended with an error");
    if (doc.usage) turn.usage = doc.usage;
    const choice = (doc.choices || []).find((c) => c.index === 0);
    if (!choice) return;
    const delta = choice.delta || {};
    const reasoning = delta.reasoning_content != null ? delta.reasoning_content : delta.reasoning;
    if (reasoning || delta.content) {
      turn.lastAt = performance.now();
      if (!turn.firstAt) turn.firstAt = turn.lastAt;
    }
    if (reasoning) turn.reasoning += reasoning;
    if (delta.content) turn.content += delta.content;
    if (choice.finish_reason) turn.finish = choice.finish_reason;
  }

  function requestBody() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of state.messages) messages.push({ role: m.role, content: m.content });
    const body = {
      model: state.model.id,
      messages: messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    const temperature = $("temperature").value.trim();
    if (temperature !== "") body.temperature = Number(temperature);
    const maxTokens = $("max-tokens").value.trim();
    if (maxTokens !== "") body.max_tokens = Number(maxTokens);
    return body;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    document.body.classList.toggle("busy", busy);
  }

  async function send(text) {
    if (!state.model) await loadModel();
    if (!state.model) return false;
    const conversation = state.conversation;
    state.messages.push({ role: "user", content: text });
    const userBox = userView(text);
    const turn = { role: "assistant", content: "", reasoning: "", usage: null, finish: null, firstAt: 0, lastAt: 0 };
    const view = assistantView();
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    setStatus("");
    let note = null;
    let failed = false;
    try {
      const resp = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: headers(true),
        body: JSON.stringify(requestBody()),
        signal: controller.signal,
      });
      if (!resp.ok) throw new Error(await errorMessage(resp));
      await readEvents(resp.body, function (doc) {
        applyChunk(doc, turn);
        view.update(turn);
      });
    } catch (e) {
      if (e.name === "AbortError") {
        note = "stopped";
      } else {
        note = e.message || String(e);
        failed = true;
      }
    } finally {
      state.controller = null;
      setBusy(false);
    }
    view.finish(turn, note, failed);
    if (conversation !== state.conversation) return true; // "New chat" while it streamed: this turn is gone
    if (turn.content) {
      state.messages.push({ role: "assistant", content: turn.content });
    } else if (failed || note) {
      state.messages.pop(); // nothing came back: the question leaves the history, its text returns to the box
      userBox.classList.add("unsent");
      return false;
    }
    return true;
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  function newChat() {
    stop();
    state.conversation++;
    state.messages = [];
    $("log").replaceChildren();
    setStatus("");
    $("prompt").focus();
  }

  async function submit(event) {
    if (event) event.preventDefault();
    const prompt = $("prompt");
    const text = prompt.value.trim();
    if (!text || state.controller) return;
    prompt.value = "";
    if (!(await send(text)) && !prompt.value) prompt.value = text;
  }

  function init() {
    for (const id of SETTINGS) {
      const saved = load(id);
      if (saved !== null) $(id).value = saved;
      if (id !== "api-key") $(id).addEventListener("change", () => save(id, $(id).value));
    }
    $("save-key").addEventListener("click", function () {
      save("api-key", $("api-key").value.trim());
      loadModel();
    });
    $("api-key").addEventListener("keydown", function (e) {
      if (e.key === "Enter") {
        e.preventDefault();
        $("save-key").click();
      }
    });
    $("composer").addEventListener("submit", submit);
    $("prompt").addEventListener("keydown", function (e) {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) submit(e);
    });
    $("stop").addEventListener("click", stop);
    $("new-chat").addEventListener("click", newChat);
    setBusy(false);
    loadModel();
    $("prompt").focus();
  }

  init();
})();
