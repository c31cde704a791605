// The chat: one WebSocket on /v1/stream (streamd.v1), one answer generated at a time.
// - Learns from GET /v1/server-info whether a key is needed (the key field shows only then) and the
//   model's name. A key travels as a `bearer.<key>` subprotocol (browsers cannot set WebSocket headers).
// - Streams an answer's deltas into its bubble through streamdRender.into (sanitized markdown), at most
//   once per animation frame (re-rendering an 8 KB answer takes a few ms).
// - Stop cancels, Regenerate asks again, New chat starts over, Copy copies an answer's markdown.
// - After a dropped connection it reconnects with backoff; an unfinished answer whose `start` frame had
//   a `resume_token` is resumed (`resume` frame, after the last delta seq received), else it ends with
//   the error. The socket also subscribes to the engine view's `stats` frames.
// Tests and scripts: window.streamdChat.connected resolves when the socket first opens; a
// `streamd:done` event on document carries each finished answer.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "streamd.apiKey", SETTINGS_STORE = "streamd.settings";
  const SETTINGS = ["system-prompt", "max-tokens", "temperature", "top-p", "seed"];
  const STATS_INTERVAL_MS = 500;

  const chat = {
    history: [],    // the conversation sent as context: [{role, content}]
    current: null,  // the answer being generated
    ws: null,
    backoff: 500,
    nextId: 1,
    info: null,     // the last /v1/server-info
  };
  let markConnected;
  window.streamdChat = {connected: new Promise((resolve) => { markConnected = resolve; })};

  const apiKey = () => localStorage.getItem(KEY_STORE) || "";
  const socketOpen = () => chat.ws !== null && chat.ws.readyState === WebSocket.OPEN;

  function setStatus(state, text) {
    $("status").dataset.state = state;
    $("status-text").textContent = text;
  }

  function updateButtons() {
    const busy = chat.current !== null;
    $("send").disabled = busy || !socketOpen();
    $("stop").disabled = !busy || !socketOpen();
    for (const button of document.querySelectorAll(".regenerate")) button.disabled = busy || !socketOpen();
  }

  // ---- server info and connection ----------------------------------------------------------------
  async function loadServerInfo() {
    const key = apiKey();
    const response = await fetch("/v1/server-info", {headers: key ? {Authorization: `Bearer ${key}`} : {},
                                                      cache: "no-store"});
    const info = await response.json();
    chat.info = info;
    $("key-box").hidden = !info.auth_required;
    $("model").textContent = info.model ?? (info.auth_required ? "enter an API key" : "–");
    $("model").title = info.max_model_len ? `context: ${info.max_model_len} tokens · streamd ${info.version}` : "";
    return info;
  }

  function wsUrl() {
    return `${location.protocol === "https:" ? "wss:" : "ws:"}//${location.host}/v1/stream`;
  }

  function connect() {
    const key = apiKey();
    if (chat.info?.auth_required && !key) {
      setStatus("error", "API key required");
      return;
    }
    const ws = new WebSocket(wsUrl(), ["streamd.v1"].concat(key ? [`bearer.${key}`] : []));
    chat.ws = ws;
    ws.onopen = () => onOpen(ws);
    ws.onmessage = (event) => onFrame(JSON.parse(event.data));
    ws.onclose = (event) => onClose(ws, event);
  }

  function onOpen(ws) {
    chat.backoff = 500;
    ws.send(JSON.stringify({type: "subscribe_stats", interval_ms: STATS_INTERVAL_MS}));
    const c = chat.current;
    if (c) {
      c.resuming = true;  // until the server's first frame for it: an error then means no resume
      ws.send(JSON.stringify({type: "resume", id: c.id, resume_token: c.resumeToken, after_seq: c.lastSeq}));
      setStatus("busy", "generating…");
    } else {
      setStatus("ok", "ready");
    }
    updateButtons();
    markConnected();
    loadServerInfo().then(showServerState, () => {});
  }

  // The server is up but not ready (warming up, draining, engine unavailable): say so while idle.
  function showServerState(info) {
    if (info.status !== "ready" && chat.current === null && socketOpen()) {
      setStatus("warn", info.status.replace("_", " "));
    }
  }

  function onClose(ws, event) {
    if (ws !== chat.ws) return;  // a socket replaced on purpose (new key)
    chat.ws = null;
    window.streamdEngineView.disconnected();
    const c = chat.current;
    if (c && !c.resumeToken) finish(c, "error", null, "connection lost");
    const delay = chat.backoff * (0.75 + Math.random() / 2);
    chat.backoff = Math.min(chat.backoff * 2, 10000);
    const why = event.code === 1001 || event.code === 1012 ? "server restarting" : `closed ${event.code}`;
    setStatus("warn", chat.info?.auth_required && event.code === 1006 && !c ? "cannot connect: check the API key"
                                                                          : `reconnecting… (${why})`);
    updateButtons();
    setTimeout(connect, delay);
  }

  function reconnect() {
    const old = chat.ws;
    chat.ws = null;
    if (old) old.close();
    connect();
  }

  // ---- messages ----------------------------------------------------------------------------------
  function addBubble(role) {
    $("empty")?.remove();
    const el = document.createElement("article");
    el.className = `msg ${role}`;
    const body = document.createElement("div");
    body.className = "body";
    el.appendChild(body);
    $("messages").appendChild(el);
    el.scrollIntoView({block: "end"});
    return {el, body};
  }

  function addUserBubble(text) {
    addBubble("user").body.textContent = text;
  }

  function actionButton(label, className, onClick) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = `action ${className}`;
    button.textContent = label;
    button.addEventListener("click", onClick);
    return button;
  }

  function readSettings() {
    const params = {max_tokens: Number($("max-tokens").value) || 512, temperature: Number($("temperature").value)};
    const topP = Number($("top-p").value);
    if (topP > 0 && topP < 1) params.top_p = topP;
    if ($("seed").value !== "") params.seed = Number($("seed").value);
    return {system: $("system-prompt").value.trim(), params};
  }

  // Asks for an answer to the conversation as it stands (it ends with a user turn).
  function start() {
    const {el, body} = addBubble("assistant");
    const c = {id: `r${chat.nextId++}`, el, body, text: "", tokens: 0, deltas: 0, sent: performance.now(),
               first: null, started: false, resumeToken: null, resuming: false, lastSeq: -1, error: null,
               renderPending: false};
    el.dataset.deltas = "0";
    el.classList.add("streaming");
    chat.current = c;
    const {system, params} = readSettings();
    const messages = (system ? [{role: "system", content: system}] : []).concat(chat.history);
    chat.ws.send(JSON.stringify({type: "generate", id: c.id, messages, params}));
    $("ttft").textContent = "–";
    $("tps").textContent = "–";
    $("ntok").textContent = "0";
    setStatus("busy", "generating…");
    updateButtons();
  }

  function send(text) {
    if (!socketOpen() || chat.current) return false;
    chat.history.push({role: "user", content: text});
    addUserBubble(text);
    start();
    return true;
  }

  function regenerate() {
    if (!socketOpen() || chat.current) return;
    const last = $("messages").lastElementChild;
    if (last?.classList.contains("assistant")) last.remove();
    if (chat.history.at(-1)?.role === "assistant") chat.history.pop();
    if (chat.history.length) start();
  }

  function newChat() {
    const c = chat.current;
    if (c && socketOpen()) chat.ws.send(JSON.stringify({type: "cancel", id: c.id}));
    chat.current = null;
    chat.history = [];
    const empty = document.createElement("p");
    empty.id = "empty";
    empty.className = "empty";
    empty.textContent = "New conversation.";
    $("messages").replaceChildren(empty);
    setStatus(socketOpen() ? "ok" : "warn", socketOpen() ? "ready" : "reconnecting…");
    updateButtons();
    $("prompt").focus();
  }

  // ---- frames ------------------------------------------------------------------------------------
  function onFrame(frame) {
    if (frame.type === "stats") {
      window.streamdEngineView.update(frame);
      return;
    }
    const c = chat.current;
    if (!c || frame.id !== c.id) {
      if (frame.type === "error" && frame.id === null) setStatus("error", `error: ${frame.error.message}`);
      return;
    }
    if (frame.type === "start") {
      c.started = true;
      c.resumeToken = frame.resume_token ?? null;
    } else if (frame.type === "progress") {
      onProgress(c, frame);
    } else if (frame.type === "delta") {
      c.resuming = false;
      if (c.first === null) setStatus("busy", "generating…");
      onDelta(c, frame);
    } else if (frame.type === "error") {
      c.error = frame.error.message;
      if (!c.started || c.resuming) finish(c, "error", null, c.error);  // refused: no done will follow
    } else if (frame.type === "done") {
      // the answer is whole here: the server need not keep it for a resume any longer
      if (c.resumeToken && socketOpen()) chat.ws.send(JSON.stringify({type: "ack", id: c.id, resume_token: c.resumeToken}));
      finish(c, frame.finish_reason, frame.usage, c.error);
    }
  }

  // Before the first token: where the request waits, or how much of the prompt the model has read.
  function progressText(frame) {
    if (frame.queue_position !== null) return `queued #${frame.queue_position}`;
    const share = frame.prompt_tokens ? frame.prompt_tokens_done / frame.prompt_tokens : 0;
    return `reading the prompt ${Math.floor(100 * share)}%`;
  }

  function onProgress(c, frame) {
    if (c.first !== null) return;
    const text = progressText(frame);
    setStatus("busy", `${text}…`);
    let note = c.body.querySelector(".progress-note");
    if (!note) {
      note = document.createElement("p");
      note.className = "progress-note";
      c.body.appendChild(note);
    }
    note.textContent = text;
  }

  function onDelta(c, frame) {
    if (frame.index !== 0 || frame.seq <= c.lastSeq) return;  // one choice; a resumed replay never repeats
    c.lastSeq = frame.seq;
    const now = performance.now();
    if (c.first === null) {
      c.first = now;
      $("ttft").textContent = `${Math.round(now - c.sent)} ms`;
    }
    c.text += frame.text;
    c.tokens += frame.token_ids.length;
    c.deltas += 1;
    c.el.dataset.deltas = String(c.deltas);
    if (!c.renderPending) {  // deltas that arrive within one frame are rendered once
      c.renderPending = true;
      requestAnimationFrame(() => render(c));
    }
    const secs = (now - c.first) / 1000;
    if (c.tokens > 1 && secs > 0) $("tps").textContent = ((c.tokens - 1) / secs).toFixed(1);
    $("ntok").textContent = String(c.tokens);
  }

  // Shows the answer's markdown so far (sanitized); keeps the view at the end if the reader was there.
  function render(c) {
    if (!c.renderPending) return;
    c.renderPending = false;
    const box = $("messages");
    const following = box.scrollHeight - box.scrollTop - box.clientHeight < 48;
    window.streamdRender.into(c.body, c.text);
    if (following) box.scrollTop = box.scrollHeight;
  }

  function finish(c, reason, usage, error) {
    if (chat.current !== c) return;
    chat.current = null;
    render(c);
    c.el.classList.remove("streaming");
    if (c.text) chat.history.push({role: "assistant", content: c.text});
    if (error) {
      c.el.classList.add("error");
      const note = document.createElement("p");
      note.className = "error-note";
      note.textContent = `⚠ ${error}`;
      c.body.appendChild(note);
    }
    c.el.appendChild(footer(c, reason));
    setStatus(error ? "error" : "ok", error ? "error" : socketOpen() ? "ready" : "reconnecting…");
    updateButtons();
    document.dispatchEvent(new CustomEvent("streamd:done", {detail: {
      id: c.id, reason, text: c.text, tokens: c.tokens, deltas: c.deltas, usage, error: error || null}}));
  }

  function footer(c, reason) {
    const bar = document.createElement("div");
    bar.className = "meta";
    const secs = c.first === null ? 0 : (performance.now() - c.first) / 1000;
    const rate = c.tokens > 1 && secs > 0 ? ` · ${((c.tokens - 1) / secs).toFixed(1)} tokens/s` : "";
    const facts = document.createElement("span");
    facts.textContent = `${reason} · ${c.tokens} tokens${rate}`;
    bar.appendChild(facts);
    if (c.text) bar.appendChild(actionButton("Copy", "copy", (e) => window.streamdRender.copyText(c.text, e.target)));
    bar.appendChild(actionButton("Regenerate", "regenerate", regenerate));
    return bar;
  }

  // ---- controls ----------------------------------------------------------------------------------
  function restoreSettings() {
    const saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}");
    for (const id of SETTINGS) {
      if (typeof saved[id] === "string") $(id).value = saved[id];
      $(id).addEventListener("change", () => {
        const values = Object.fromEntries(SETTINGS.map((name) => [name, $(name).value]));
        localStorage.setItem(SETTINGS_STORE, JSON.stringify(values));
      });
    }
  }

  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (text && send(text)) $("prompt").value = "";
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => {
    if (chat.current && socketOpen()) chat.ws.send(JSON.stringify({type: "cancel", id: chat.current.id}));
  });
  $("new-chat").addEventListener("click", newChat);
  $("key-box").addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(KEY_STORE, $("api-key").value.trim());
    $("api-key").value = "";
    loadServerInfo().finally(reconnect);
  });

  restoreSettings();
  updateButtons();
  loadServerInfo().catch(() => setStatus("error", "server unreachable")).finally(connect);
})();
