// The live engine view: draws each `stats` frame (see stats_feed.py) the chat socket subscribed to.
// KV blocks as a grid (one cell per block, or per few blocks on a large pool: used, cached, free; the
// host swap pool's used blocks after them), request counts, prefix-cache hit rate, speculative decoding's
// draft acceptance rate and tokens/s with a
// one-minute sparkline. Canvas drawing and CSSOM only, so a strict CSP holds.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const MAX_CELLS = 1200;
  const HISTORY = 120;  // tokens/s samples in the sparkline (a minute at 500 ms)
  const rates = [];
  let frames = 0;

  const colour = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

  function sized(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || canvas.width, height = canvas.clientHeight || canvas.height;
    if (canvas.width !== Math.round(width * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    return {ctx, width, height};
  }

  // The largest square cell (3 px at least) with which `cells` fit the canvas.
  function layout(cells, width, height) {
    let side = 3;
    const fits = (size) => Math.ceil(cells / Math.floor(width / size)) * size <= height;
    while (side < 40 && fits(side + 1)) side += 1;
    return {side, columns: Math.max(1, Math.floor(width / side))};
  }

  // Cells in order: used, cached, free, then the swap pool's used blocks.
  function drawGrid(kv, swap) {
    const {ctx, width, height} = sized($("kv-grid"));
    const blocks = kv.total + swap.used;
    const perCell = Math.max(1, Math.ceil(blocks / MAX_CELLS));
    const cells = Math.ceil(blocks / perCell);
    const {side, columns} = layout(cells, width, height);
    const runs = [["--used", kv.used], ["--cached", kv.cached], ["--free", kv.free], ["--swapped", swap.used]];
    let cell = 0;
    for (const [name, count] of runs) {
      ctx.fillStyle = colour(name);
      for (let i = 0; i < Math.ceil(count / perCell); i++, cell++) {
        const x = (cell % columns) * side, y = Math.floor(cell / columns) * side;
        if (y + side > height) return;
        ctx.fillRect(x + 0.5, y + 0.5, side - 1.5, side - 1.5);
      }
    }
  }

  function drawRates() {
    const {ctx, width, height} = sized($("tps-chart"));
    const top = Math.max(1, ...rates);
    ctx.strokeStyle = colour("--accent");
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    rates.forEach((rate, i) => {
      const x = width - (rates.length - 1 - i) * (width / (HISTORY - 1));
      const y = height - 2 - (rate / top) * (height - 4);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  }

  function show(id, value) { $(id).textContent = String(value); }

  // Per-tenant share: served tokens (prompt + output) and preemptions, most served first.
  function showTenants(tenants) {
    const rows = tenants.map(t => {
      const row = document.createElement("div");
      const name = document.createElement("span");
      const served = document.createElement("b");
      name.textContent = t.tenant;
      const queued = t.admissions ? `, queued ${(1000 * t.queue_seconds / t.admissions).toFixed(0)} ms avg` : "";
      served.textContent = `${t.prompt_tokens + t.output_tokens} tok` + queued + (t.preemptions ? `, ${t.preemptions} preempted` : "");
      row.append(name, served);
      return row;
    });
    $("tenants").replaceChildren(...rows);
  }

  function update(frame) {
    const {kv, swap, requests, prefix_cache: prefix} = frame;
    show("kv-total", `${kv.total} on device` + (swap.total ? `, ${swap.total} host` : ""));
    show("kv-used", kv.used);
    show("kv-cached", kv.cached);
    show("kv-free", kv.free);
    show("kv-swapped", swap.total ? swap.used : "no pool");
    show("req-running", requests.running);
    show("req-waiting", requests.waiting);
    show("req-swapped", requests.swapped);
    show("req-paused", requests.paused);
    show("prefix-hit", prefix.queried_tokens ? `${(prefix.hit_rate * 100).toFixed(1)}%` : "–");
    $("prefix-hit").title = `${prefix.hit_tokens} of ${prefix.queried_tokens} prompt tokens found in the cache`;
    show("prefix-tiers", "hit blocks: " + (prefix.tiers || []).map(
      (t) => `${t.name} ${t.hit_blocks}` + (t.blocks === undefined ? "" : ` (holds ${t.blocks})`)).join(" · "));
    show("engine-tps", frame.tokens_per_s.toFixed(1));
    showTenants(frame.tenants || []);
    const spec = frame.speculation;
    show("spec-accept", spec && spec.draft_tokens ? `${(spec.acceptance_rate * 100).toFixed(1)}%` : "–");
    show("spec-drafts", spec ? spec.draft_tokens : "–");
    $("spec-accept").title = spec ? `${spec.accepted_tokens} of ${spec.draft_tokens} draft tokens accepted` : "";
    rates.push(frame.tokens_per_s);
    if (rates.length > HISTORY) rates.shift();
    drawGrid(kv, swap);
    drawRates();
    frames += 1;
    $("engine").dataset.frames = String(frames);
    $("engine").classList.remove("stale");
  }

  // The socket is gone: the numbers shown are no longer live.
  function disconnected() { $("engine").classList.add("stale"); }

  window.streamdEngineView = {update, disconnected};
})();
