// threefold report: search over parameters and ops, and the measured timeline drawn from the
// embedded Chrome trace. Plain DOM, no libraries, no network.
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const dataNode = document.getElementById("report-data");
  const data = dataNode ? JSON.parse(dataNode.textContent) : {};

  // ---- search ---------------------------------------------------------------------------
  const box = document.getElementById("search");
  const count = document.getElementById("search-count");

  function filter(text) {
    const q = text.trim().toLowerCase();
    let params = 0, ops = 0;
    document.querySelectorAll("[data-search]").forEach(function (el) {
      const hit = !q || el.dataset.search.indexOf(q) >= 0;
      el.classList.toggle("hidden", !hit);
      if (hit && q) {
        if (el.dataset.kind === "param") params += 1;
        else if (el.dataset.kind === "op") ops += 1;
      }
    });
    document.querySelectorAll("details.chunk-code").forEach(function (d) {
      const n = d.querySelectorAll(".line.op:not(.hidden)").length;
      d.querySelector(".hits").textContent = q ? n + " matching ops" : "";
      if (q && n) d.open = true;
    });
    if (count) count.textContent = q ? params + " parameters, " + ops + " ops match" : "";
  }
  if (box) box.addEventListener("input", function () { filter(box.value); });

  // ---- measured timeline ------------------------------------------------------------------
  const trace = data.trace;
  const holder = document.getElementById("trace-timeline");
  if (!trace || !holder) return;

  const STREAMS = ["step", "compute", "send", "recv", "collectives"];
  const LANE = 18, GAP = 3, LEFT = 150, RIGHT = 16, TOP = 24;
  const COLORS = { F: "#4c78a8", B: "#59a14f", W: "#f28e2b", optimizer: "#8e6bb8", step: "#d9dde3",
                   send: "#7f9cc0", recv: "#b5c7dc", wait: "#e0787a", collective: "#e6b422" };
  const events = trace.traceEvents.filter(function (e) { return e.ph === "X"; });
  const names = {};
  trace.traceEvents.forEach(function (e) {
    if (e.ph === "M" && e.name === "process_name") names[e.pid] = e.args.name;
  });
  const steps = Array.from(new Set(events.map(function (e) { return e.args.step; }))).sort(function (a, b) { return a - b; });
  const stepSelect = document.getElementById("trace-step");
  const zoom = document.getElementById("trace-zoom");
  steps.forEach(function (s) {
    const o = document.createElement("option");
    o.value = String(s);
    o.textContent = "step " + s;
    stepSelect.appendChild(o);
  });

  function color(e) {
    if (e.cat === "compute") return COLORS[e.args.kind] || COLORS.F;
    return COLORS[e.cat] || "#999";
  }

  function el(tag, attrs, parent) {
    const node = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(node);
    return node;
  }

  function draw() {
    const step = Number(stepSelect.value);
    const shown = events.filter(function (e) { return e.args.step === step; });
    const t0 = Math.min.apply(null, shown.map(function (e) { return e.ts; }));
    const t1 = Math.max.apply(null, shown.map(function (e) { return e.ts + e.dur; }));
    const lanes = [];
    const seen = {};
    shown.forEach(function (e) { seen[e.pid + ":" + e.tid] = true; });
    Object.keys(names).map(Number).sort(function (a, b) { return a - b; }).forEach(function (pid) {
      STREAMS.forEach(function (s, tid) {
        if (seen[pid + ":" + tid]) lanes.push([pid, tid]);
      });
    });
    const width = Math.max(600, (holder.clientWidth || 1000) - 10) * Number(zoom.value);
    const height = TOP + lanes.length * (LANE + GAP) + 26;
    const span = Math.max(t1 - t0, 1e-3);
    const scale = (width - LEFT - RIGHT) / span;
    holder.textContent = "";
    const svg = el("svg", { width: width, height: height, role: "img" }, holder);
    const row = {};
    lanes.forEach(function (lane, i) {
      const y = TOP + i * (LANE + GAP);
      row[lane[0] + ":" + lane[1]] = y;
      const first = i === 0 || lanes[i - 1][0] !== lane[0];
      const label = el("text", { x: LEFT - 6, y: y + LANE - 5, "text-anchor": "end" }, svg);
      label.textContent = (first ? "rank " + lane[0] + " " : "") + STREAMS[lane[1]];
      el("rect", { x: LEFT, y: y, width: span * scale, height: LANE, fill: first ? "#eef0f3" : "#f5f6f8" }, svg);
    });
    shown.forEach(function (e) {
      const y = row[e.pid + ":" + e.tid];
      const x = LEFT + (e.ts - t0) * scale;
      const w = Math.max(e.dur * scale, 0.6);
      const g = el("g", {}, svg);
      const r = el("rect", { x: x.toFixed(2), y: y, width: w.toFixed(2), height: LANE, fill: color(e),
                             "class": "ev", "data-name": e.name }, g);
      r.setAttribute("stroke", "white");
      r.setAttribute("stroke-width", "0.4");
      const tip = el("title", {}, g);
      tip.textContent = e.name + " on " + (names[e.pid] || "rank " + e.pid) + ": " + (e.dur / 1e3).toFixed(3) +
        " ms, at " + ((e.ts - t0) / 1e3).toFixed(3) + " ms";
      if (w > 26 && e.cat === "compute") {
        const t = el("text", { x: (x + w / 2).toFixed(2), y: y + LANE - 5, "text-anchor": "middle", fill: "white" }, g);
        t.textContent = e.name;
      }
    });
    const axis = TOP + lanes.length * (LANE + GAP) + 4;
    el("line", { x1: LEFT, y1: axis, x2: LEFT + span * scale, y2: axis, stroke: "black" }, svg);
    const ms = span / 1e3;
    const stepMs = niceStep(ms / 12);
    for (let t = 0; t <= ms + 1e-9; t += stepMs) {
      const x = LEFT + t * 1e3 * scale;
      el("line", { x1: x, y1: axis, x2: x, y2: axis + 4, stroke: "black" }, svg);
      const label = el("text", { x: x, y: axis + 16, "text-anchor": "middle" }, svg);
      label.textContent = (Math.round(t * 1000) / 1000) + " ms";
    }
    const title = el("text", { x: LEFT, y: 14 }, svg);
    title.textContent = "measured step " + step + ": " + ms.toFixed(2) + " ms, " + lanes.length + " lanes, " +
      shown.length + " events (hover for names and times)";
    holder.dataset.events = String(shown.length);
  }

  function niceStep(x) {
    const p = Math.pow(10, Math.floor(Math.log10(Math.max(x, 1e-9))));
    const m = x / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
  }

  stepSelect.addEventListener("change", draw);
  zoom.addEventListener("input", draw);
  draw();
})();
