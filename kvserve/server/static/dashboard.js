// kvserve live dashboard: polls dashboard/data (the server's ring of metric points, see
// kvserve/server/dashboard.py) and draws each panel as a line chart on its own canvas.
// No libraries: works offline. The last data drawn is on window.kvserveDashboard for tests.
"use strict";

(function () {
  const BLUE = "#2563eb", ORANGE = "#ea580c", GREEN = "#16a34a", PURPLE = "#9333ea", RED = "#dc2626";

  // One panel per chart: series keys of the data's columns, a scale to display units, y limits.
  const PANELS = [
    { id: "requests", title: "Requests", unit: "count", lines: [
      { key: "running", label: "running", color: BLUE }, { key: "waiting", label: "waiting", color: ORANGE }] },
    { id: "throughput", title: "Throughput", unit: "tokens/s", lines: [
      { key: "output_tokens_per_s", label: "output", color: GREEN },
      { key: "prompt_tokens_per_s", label: "prompt", color: PURPLE }] },
    { id: "ttft", title: "Time to first token", unit: "ms", scale: 1000, lines: [
      { key: "ttft_p50_s", label: "p50", color: BLUE }, { key: "ttft_p99_s", label: "p99", color: RED }] },
    { id: "tpot", title: "Time per output token", unit: "ms", scale: 1000, lines: [
      { key: "tpot_p50_s", label: "p50", color: BLUE }, { key: "tpot_p99_s", label: "p99", color: RED }] },
    { id: "kv", title: "KV cache usage", unit: "% of blocks", yMax: 100, lines: [
      { key: "kv_usage_pct", label: "used", color: BLUE }] },
    { id: "prefix", title: "Prefix cache hit rate", unit: "% of prompt tokens", yMax: 100, lines: [
      { key: "prefix_hit_rate_pct", label: "hits", color: GREEN }] },
    { id: "preemptions", title: "Preemptions", unit: "per minute", lines: [
      { key: "preemptions_per_min", label: "preempted", color: RED }] },
    { id: "spec", title: "Speculative decoding", unit: "% of draft tokens accepted", yMax: 100, spec: true, lines: [
      { key: "spec_acceptance_pct", label: "acceptance", color: PURPLE }] },
  ];

  // Headline figures: the latest point's value (or a total), with its unit.
  const TILES = [
    { label: "running", get: d => last(d, "running"), unit: "" },
    { label: "waiting", get: d => last(d, "waiting"), unit: "" },
    { label: "output tokens/s", get: d => last(d, "output_tokens_per_s"), unit: "" },
    { label: "TTFT p50", get: d => scaled(last(d, "ttft_p50_s"), 1000), unit: " ms" },
    { label: "TPOT p50", get: d => scaled(last(d, "tpot_p50_s"), 1000), unit: " ms" },
    { label: "KV cache used", get: d => last(d, "kv_usage_pct"), unit: " %" },
    { label: "prefix hit rate", get: d => last(d, "prefix_hit_rate_pct"), unit: " %" },
    { label: "preemptions (total)", get: d => d.totals.preemptions, unit: "" },
    { label: "requests finished", get: d => d.totals.finished_requests, unit: "" },
    { label: "accepted drafts / verification", get: d => last(d, "spec_accepted_per_draft"), unit: "", spec: true },
  ];

  const state = { data: null, draws: 0, drawn: {}, errors: 0, key: sessionStorage.getItem("kvserve-api-key") };
  window.kvserveDashboard = state;

  function last(d, key) { const s = d.series[key]; return s.length ? s[s.length - 1] : null; }
  function scaled(v, k) { return v === null || v === undefined ? null : v * k; }
  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    const a = Math.abs(v);
    if (Math.abs(v - Math.round(v)) < 1e-9) return Math.round(v).toString();
    return a >= 100 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : v.toFixed(2);
  }

  // ---- layout, built once ---------------------------------------------------------------------
  const panelEls = {}, tileEls = [];
  for (const p of PANELS) {
    const el = document.createElement("div");
    el.className = "panel";
    el.id = "panel-" + p.id;
    el.hidden = !!p.spec;
    el.innerHTML = `<h2>${p.title} <span class="unit">${p.unit}</span></h2><div class="legend"></div><canvas></canvas>`;
    document.getElementById("panels").appendChild(el);
    panelEls[p.id] = { root: el, legend: el.querySelector(".legend"), canvas: el.querySelector("canvas") };
  }
  for (const t of TILES) {
    const el = document.createElement("div");
    el.className = "tile";
    el.hidden = !!t.spec;
    el.innerHTML = `<div class="value">–</div><div class="label">${t.label}</div>`;
    document.getElementById("tiles").appendChild(el);
    tileEls.push({ tile: t, root: el, value: el.querySelector(".value") });
  }

  // ---- the chart ------------------------------------------------------------------------------
  function niceStep(span) {   // 1, 2 or 5 times a power of ten, about a quarter of the span
    const raw = span / 4, p = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
  }

  function drawChart(canvas, panel, xs, columns, historyS) {
    const ratio = window.devicePixelRatio || 1, w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
      canvas.width = Math.round(w * ratio);
      canvas.height = Math.round(h * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const L = 46, R = 8, T = 6, B = 20, pw = w - L - R, ph = h - T - B;
    let max = 0, any = false;
    for (const ys of columns) for (const v of ys) if (v !== null) { any = true; max = Math.max(max, v); }
    const span = panel.yMax ? Math.max(panel.yMax, max) : (max > 0 ? max : 1);
    const step = niceStep(span), top = Math.max(step, Math.ceil(span / step - 1e-9) * step);
    const x = t => L + pw * (1 + t / historyS), y = v => T + ph * (1 - v / top);

    ctx.font = "11px system-ui, sans-serif";
    ctx.strokeStyle = "#e5e7eb";
    ctx.fillStyle = "#6b7280";
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i * step <= top + step / 2; i++) {   // horizontal grid and y labels
      const v = i * step;
      ctx.beginPath(); ctx.moveTo(L, Math.round(y(v)) + 0.5); ctx.lineTo(L + pw, Math.round(y(v)) + 0.5); ctx.stroke();
      ctx.fillText(fmt(v), L - 5, y(v));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const xStep = historyS > 120 ? 60 : historyS > 30 ? 15 : 5;
    for (let t = 0; t <= historyS; t += xStep) {   // x labels: time before the latest point
      ctx.textAlign = t === 0 ? "right" : "center";
      ctx.fillText(t === 0 ? "now" : (t % 60 === 0 ? `−${t / 60} min` : `−${t} s`), x(-t), T + ph + 5);
    }
    ctx.textAlign = "center";
    if (!any) {
      ctx.textBaseline = "middle";
      ctx.fillText("no data in this window yet", L + pw / 2, T + ph / 2);
    }
    ctx.lineWidth = 1.8;
    ctx.lineJoin = "round";
    panel.lines.forEach((line, i) => {   // each line, broken where a value is missing
      const ys = columns[i];
      ctx.strokeStyle = line.color;
      ctx.fillStyle = line.color;
      ctx.beginPath();
      let pen = false;
      for (let j = 0; j < ys.length; j++) {
        if (ys[j] === null || xs[j] < -historyS) { pen = false; continue; }
        const isolated = (j === 0 || ys[j - 1] === null) && (j === ys.length - 1 || ys[j + 1] === null);
        if (isolated) { ctx.fillRect(x(xs[j]) - 1.5, y(ys[j]) - 1.5, 3, 3); pen = false; continue; }
        pen ? ctx.lineTo(x(xs[j]), y(ys[j])) : ctx.moveTo(x(xs[j]), y(ys[j]));
        pen = true;
      }
      ctx.stroke();
    });
  }

  // ---- one refresh ----------------------------------------------------------------------------
  function render(d) {
    const times = d.series.time, now = times.length ? times[times.length - 1] : 0;
    const xs = times.map(t => t - now);
    document.getElementById("model").textContent = d.model + (d.speculative ? " · speculative decoding on" : "");
    for (const p of PANELS) {
      const el = panelEls[p.id];
      el.root.hidden = !!p.spec && !d.speculative;
      if (el.root.hidden) continue;
      const columns = p.lines.map(line => d.series[line.key].map(v => scaled(v, p.scale || 1)));
      drawChart(el.canvas, p, xs, columns, d.history_s);
      state.drawn[p.id] = columns;
      el.legend.innerHTML = p.lines.map((line, i) =>
        `<span><span class="swatch" style="background:${line.color}"></span>${line.label} ` +
        `<b>${fmt(columns[i].length ? columns[i][columns[i].length - 1] : null)}</b></span>`).join("");
    }
    for (const t of tileEls) {
      t.root.hidden = !!t.tile.spec && !d.speculative;
      const v = t.tile.get(d);
      t.value.textContent = fmt(v) + (v === null || v === undefined ? "" : t.tile.unit);
    }
    document.getElementById("footer").textContent =
      `Rates and percentiles over the trailing ${d.window_s} s, a point every ${d.interval_s} s, the last ` +
      `${d.history_s / 60} minutes. Percentiles are estimated from the Prometheus histogram buckets ` +
      `(as histogram_quantile) and count finished requests; the server has been up ${Math.round(d.uptime_s)} s.`;
    state.draws += 1;
  }

  function setStatus(text, error) {
    const el = document.getElementById("status");
    el.textContent = text;
    el.className = error ? "error" : "";
  }

  const auth = document.getElementById("auth");
  auth.addEventListener("submit", ev => {
    ev.preventDefault();
    state.key = document.getElementById("auth-key").value.trim();
    sessionStorage.setItem("kvserve-api-key", state.key);
    auth.style.display = "none";
    poll();
  });

  let timer = null;
  async function poll() {
    clearTimeout(timer);
    let interval = state.data ? state.data.interval_s * 1000 : 1000;
    try {
      const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
      const resp = await fetch("dashboard/data", { headers, cache: "no-store" });
      if (resp.status === 401) {
        auth.style.display = "block";
        setStatus("API key needed", true);
        return;   // polling resumes when a key is entered
      }
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      state.data = await resp.json();
      render(state.data);
      setStatus("updated " + new Date().toLocaleTimeString(), false);
    } catch (e) {
      state.errors += 1;
      setStatus(`cannot reach the server (${e.message}); retrying`, true);
      interval = 2000;
    }
    timer = setTimeout(poll, interval);
  }
  window.addEventListener("resize", () => { if (state.data) render(state.data); });
  poll();
})();
