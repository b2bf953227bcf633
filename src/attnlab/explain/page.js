/* attnlab explainer page. Inlined into the HTML file at write time; no network.
 *
 * Everything shown comes from the JSON block #attnlab-data. Token text is data:
 * it is only ever assigned with textContent, never parsed as markup.
 */
(function () {
  "use strict";

  /* viridis (9 stops): perceptually uniform, readable in grey and by colour-blind
   * readers. Shared with the serve page's views (window.attnlabColour). */
  var VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
    [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]];
  function viridisRgb(v) {
    v = Math.max(0, Math.min(1, v || 0)) * (VIRIDIS.length - 1);
    var i = Math.min(Math.floor(v), VIRIDIS.length - 2), f = v - i;
    var a = VIRIDIS[i], b = VIRIDIS[i + 1];
    return [0, 1, 2].map(function (c) { return Math.round(a[c] + (b[c] - a[c]) * f); });
  }
  function viridis(v) { return "rgb(" + viridisRgb(v).join(",") + ")"; }
  /* A colour bar from 0 to `top` (its numbers as text, so they can be read and copied). */
  function colourBar(top) {
    function span(cls, text) {
      var e = document.createElement("span");
      if (cls) e.className = cls;
      if (text !== undefined) e.textContent = text;
      return e;
    }
    var bar = document.createElement("div");
    bar.className = "cbar";
    bar.appendChild(span(null, "0"));
    var g = span("cbar-grad");
    g.style.background = "linear-gradient(to right," + VIRIDIS.map(function (c) {
      return "rgb(" + c.join(",") + ")"; }).join(",") + ")";
    bar.appendChild(g);
    bar.appendChild(span("cbar-top", top === undefined ? "1" : String(top)));
    return bar;
  }
  window.attnlabColour = { viridis: viridis, bar: colourBar };

  /* Draw the views from DATA; attnlab serve calls it again (window.attnlabRender) with
   * every new trace, into the same panels. */
  function render(DATA) {
  var S_ = DATA.strings;
  var A = DATA.attention; // may be null (walkthrough only)
  var W = DATA.walkthrough; // may be null
  var PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
    "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"];
  var ALPHA_LEVELS = 12;

  function $(id) { return document.getElementById(id); }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmt(w) { return w.toFixed(4); }
  function headColor(h) {
    if (h < PALETTE.length) return PALETTE[h];
    return "hsl(" + ((h * 137.508) % 360).toFixed(1) + ", 62%, 44%)";
  }
  function hexToRgb(c) {
    if (c.charAt(0) === "#") {
      return [parseInt(c.substr(1, 2), 16), parseInt(c.substr(3, 2), 16),
        parseInt(c.substr(5, 2), 16)];
    }
    var probe = document.createElement("canvas").getContext("2d");
    probe.fillStyle = c;
    return hexToRgb(probe.fillStyle);
  }
  function tokLabel(t) {
    // Make whitespace visible; the text itself stays text.
    if (t === "") return "\u2205";
    return t.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
  }

  /* ---------------------------------------------------------------- decoding */
  function b64bytes(s) {
    var bin = atob(s);
    var out = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  function u16(s) {
    var b = b64bytes(s);
    var dv = new DataView(b.buffer);
    var out = new Uint16Array(b.length / 2);
    for (var i = 0; i < out.length; i++) out[i] = dv.getUint16(2 * i, true);
    return out;
  }
  function f32(s) {
    var b = b64bytes(s);
    var dv = new DataView(b.buffer);
    var out = new Float32Array(b.length / 4);
    for (var i = 0; i < out.length; i++) out[i] = dv.getFloat32(4 * i, true);
    return out;
  }
  function u32(s) {
    var b = b64bytes(s);
    var dv = new DataView(b.buffer);
    var out = new Uint32Array(b.length / 4);
    for (var i = 0; i < out.length; i++) out[i] = dv.getUint32(4 * i, true);
    return out;
  }

  var T = A ? A.tokens.length : 0;
  var S = A ? A.key_tokens.length : 0;
  var K = A ? A.k : 0;
  var cache = {};

  /* One head: rows of (key index, weight), strongest first, K per row. */
  function head(li, hi) {
    var key = li + ":" + hi;
    if (cache[key]) return cache[key];
    var raw = A.data[li][hi];
    var val;
    if (A.dense) {
      val = f32(raw.v); // exact float32 weights
    } else {
      var q = u16(raw.v); // 16-bit fixed point
      val = new Float32Array(q.length);
      for (var i = 0; i < q.length; i++) val[i] = q[i] / 65535;
    }
    var idx;
    if (A.dense) {
      // Dense rows: sort each row's keys by weight once.
      idx = new Uint32Array(T * S);
      var sorted = new Float32Array(T * S);
      var order = new Array(S);
      for (var r = 0; r < T; r++) {
        for (var c = 0; c < S; c++) order[c] = c;
        var base = r * S;
        order.sort(function (a, b) { return val[base + b] - val[base + a] || a - b; });
        for (c = 0; c < S; c++) {
          idx[base + c] = order[c];
          sorted[base + c] = val[base + order[c]];
        }
      }
      cache[key] = { idx: idx, val: sorted, dense: val };
    } else {
      idx = A.index_bytes === 2 ? u16(raw.i) : u32(raw.i);
      cache[key] = { idx: idx, val: val, dense: null };
    }
    return cache[key];
  }
  function weightAt(hd, q, k) {
    if (hd.dense) return hd.dense[q * S + k];
    for (var j = 0; j < K; j++) if (hd.idx[q * K + j] === k) return hd.val[q * K + j];
    return 0;
  }

  /* Mixture of experts: the routing of the layer at position li of A.layers, as
   * {chosen: (T, k) expert indices, weights: (T, k) router weights, row-major}, or null
   * when that layer has no experts. */
  var EX = A ? A.experts : null;
  var exCache = {};
  function routing(li) {
    if (!EX) return null;
    var at = EX.layers.indexOf(A.layers[li]);
    if (at < 0) return null;
    if (!exCache[at]) {
      exCache[at] = { chosen: EX.index_bytes === 2 ? u16(EX.chosen[at]) : u32(EX.chosen[at]),
        weights: f32(EX.weights[at]) };
    }
    return exCache[at];
  }
  function routedText(r, q) {
    var parts = [];
    for (var j = 0; j < EX.top_k; j++) {
      parts.push(S_.expert + " " + r.chosen[q * EX.top_k + j] + " (" +
        r.weights[q * EX.top_k + j].toFixed(4) + ")");
    }
    return parts.join(", ");
  }
  /* The token x expert grid of one layer: a table of the weights when it is small, a
   * heatmap (one pixel per cell, scaled) when it is not. Focused query row marked. */
  var EX_TABLE_CELLS = 2048;
  function expertGrid(li, focusRow) {
    var r = routing(li);
    var E = EX.num_experts, k = EX.top_k;
    if (T * E <= EX_TABLE_CELLS) {
      var t = el("table", "ex-table");
      t.id = "experts-table";
      var hr = el("tr");
      hr.appendChild(el("th", null, S_.token));
      for (var e = 0; e < E; e++) {
        var th = el("th", "num", String(e));
        th.scope = "col";
        th.title = S_.expert + " " + e;
        hr.appendChild(th);
      }
      t.appendChild(hr);
      for (var q = 0; q < T; q++) {
        var tr = el("tr");
        tr.dataset.index = String(q);
        if (q === focusRow) tr.className = "active";
        var lab = el("th", null, "#" + q + " " + tokLabel(A.tokens[q]));
        lab.scope = "row";
        tr.appendChild(lab);
        var cells = [];
        for (e = 0; e < E; e++) {
          cells.push(el("td", "num"));
          tr.appendChild(cells[e]);
        }
        for (var j = 0; j < k; j++) {
          var w = r.weights[q * k + j];
          var td = cells[r.chosen[q * k + j]];
          td.textContent = w.toFixed(2);
          td.dataset.w = w.toFixed(6);
          td.title = S_.expert + " " + r.chosen[q * k + j] + ": " + fmt(w);
          td.style.background = "rgba(31,95,168," + (0.15 + 0.6 * Math.min(1, w)).toFixed(3) + ")";
        }
        t.appendChild(tr);
      }
      var wrap = el("div", "ex-wrap");
      wrap.appendChild(t);
      return wrap;
    }
    var cv = el("canvas", "ex-heat");
    cv.id = "experts-heat";
    paintExperts(cv, li);
    cv.setAttribute("role", "img");
    return cv;
  }
  function paintExperts(cv, li) {
    var r = routing(li);
    var E = EX.num_experts, k = EX.top_k;
    var img = new ImageData(E, T);
    for (var i = 0; i < E * T; i++) {
      img.data[4 * i] = img.data[4 * i + 1] = img.data[4 * i + 2] = 255;
      img.data[4 * i + 3] = 255;
    }
    var top = 0; // colours from 0 to the layer's largest weight (unrenormalised routers)
    for (var m = 0; m < T * k; m++) if (r.weights[m] > top) top = r.weights[m];
    for (var q = 0; q < T; q++) {
      for (var j = 0; j < k; j++) {
        var c = viridisRgb(top > 0 ? r.weights[q * k + j] / top : 0);
        var at = 4 * (q * E + r.chosen[q * k + j]);
        img.data[at] = c[0]; img.data[at + 1] = c[1]; img.data[at + 2] = c[2];
      }
    }
    cv.width = E;
    cv.height = T;
    cv.getContext("2d").putImageData(img, 0, 0);
  }
  function drawExperts(insp) {
    if (!EX) return;
    var f = state.focus;
    var box = el("div", "experts");
    box.id = "experts";
    box.appendChild(el("h3", null, S_.experts));
    if (!routing(state.layer)) {
      box.appendChild(el("p", "small", S_.no_experts));
      insp.appendChild(box);
      return;
    }
    box.appendChild(el("p", "small", S_.experts_caption
      .replace("{layer}", A.layer_names[state.layer]).replace("{k}", EX.top_k)
      .replace("{n}", EX.num_experts)));
    if (EX.shared) box.appendChild(el("p", "small", S_.experts_shared));
    box.appendChild(expertGrid(state.layer, f && f.side === "q" ? f.i : -1));
    insp.appendChild(box);
  }

  /* ------------------------------------------------------------------- state */
  var state = {
    view: "head",
    layer: 0, // position in A.layers
    heads: [], // positions in A.heads
    k: 1,
    focus: null, // {side: "q"|"k", i: index}
  };
  var api = { ready: false, drawn: [], state: state, renderMs: null };
  window.attnlabPage = api;
  var keep = DATA.keep_panels === true; // serve: panels stay for the next render

  var tabs0 = [];

  /* --------------------------------------------------------------- the shell */
  function buildShell() {
    document.title = DATA.title;
    $("title").textContent = DATA.title;
    $("source").textContent = DATA.source || "";
    var tabs = [];
    if (A) tabs.push(["head", S_.head_view], ["model", S_.model_view]);
    if (W) tabs.push(["walk", S_.walkthrough]);
    tabs0 = tabs.map(function (t) { return t[0]; });
    var list = $("tabs");
    list.textContent = "";
    ["head", "model", "walk"].forEach(function (v) {
      var p = $("panel-" + v);
      if (p) p.textContent = "";
    });
    tabs.forEach(function (t) {
      var b = el("button", null, t[1]);
      b.id = "tab-" + t[0];
      b.setAttribute("role", "tab");
      b.setAttribute("aria-controls", "panel-" + t[0]);
      b.dataset.view = t[0];
      b.addEventListener("click", function () { showView(t[0], true); });
      b.addEventListener("keydown", function (ev) {
        var i = tabs.findIndex(function (x) { return x[0] === t[0]; });
        var j = -1;
        if (ev.key === "ArrowRight") j = (i + 1) % tabs.length;
        if (ev.key === "ArrowLeft") j = (i - 1 + tabs.length) % tabs.length;
        if (ev.key === "Home") j = 0;
        if (ev.key === "End") j = tabs.length - 1;
        if (j >= 0) { ev.preventDefault(); showView(tabs[j][0], true); }
      });
      list.appendChild(b);
    });
    if (!keep) {
      if (!A) { $("panel-head").remove(); $("panel-model").remove(); }
      if (!W) $("panel-walk").remove();
    } else {
      if (!A) { $("panel-head").hidden = true; $("panel-model").hidden = true; }
      if (!W) $("panel-walk").hidden = true;
    }
    state.view = DATA.initial_view && $("panel-" + DATA.initial_view) ? DATA.initial_view
      : tabs[0][0];
  }

  function showView(v, focusTab) {
    state.view = v;
    document.querySelectorAll("[role=tab]").forEach(function (b) {
      var on = b.dataset.view === v;
      b.setAttribute("aria-selected", on ? "true" : "false");
      b.tabIndex = on ? 0 : -1;
      if (on && focusTab) b.focus();
    });
    document.querySelectorAll("[role=tabpanel]").forEach(function (p) {
      var shown = tabs0.indexOf(p.id.replace("panel-", "")) >= 0;
      p.hidden = !shown || p.id !== "panel-" + v;
    });
    if (v === "head") drawHead();
    if (v === "model") drawModel();
  }

  /* --------------------------------------------------------------- head view */
  var hv = {};

  function buildHeadView() {
    var panel = $("panel-head");
    var controls = el("div", "controls");
    var lab = el("label", null, S_.layer + " ");
    lab.setAttribute("for", "layer");
    var sel = el("select");
    sel.id = "layer";
    A.layers.forEach(function (l, i) {
      var o = el("option", null, A.layer_names[i]);
      o.value = String(i);
      sel.appendChild(o);
    });
    sel.addEventListener("change", function () {
      state.layer = +sel.value; state.focus = null; drawHead();
    });
    lab.appendChild(sel);
    controls.appendChild(lab);

    var fs = el("fieldset");
    fs.id = "heads";
    fs.appendChild(el("legend", null, S_.heads));
    A.heads.forEach(function (h, i) {
      var chip = el("label", "chip");
      var cb = el("input");
      cb.type = "checkbox";
      cb.value = String(i);
      cb.dataset.head = String(h);
      cb.setAttribute("aria-label", S_.head + " " + h);
      cb.addEventListener("change", function () {
        state.heads = Array.prototype.filter.call(
          fs.querySelectorAll("input"), function (x) { return x.checked; })
          .map(function (x) { return +x.value; });
        drawHead();
      });
      var sw = el("span", "swatch");
      sw.style.background = headColor(h);
      chip.appendChild(cb);
      chip.appendChild(sw);
      chip.appendChild(el("span", null, String(h)));
      fs.appendChild(chip);
    });
    controls.appendChild(fs);

    var kl = el("label", null, S_.top_k + " ");
    var kin = el("input");
    kin.type = "number";
    kin.id = "topk";
    kin.min = "1";
    kin.max = String(K);
    kin.addEventListener("input", function () {
      var v = Math.round(+kin.value);
      if (v >= 1 && v <= K) { state.k = v; refresh(); }
    });
    kl.appendChild(kin);
    controls.appendChild(kl);
    panel.appendChild(controls);
    panel.appendChild(el("p", "hint", S_.head_hint));

    var layout = el("div", "hv-layout");
    var scroll = el("div", "hv-scroll");
    scroll.id = "hv-scroll";
    var inner = el("div", "hv-inner");
    var canvas = el("canvas", "hv-canvas");
    canvas.id = "hv-canvas";
    canvas.setAttribute("aria-hidden", "true");
    var qcol = el("div", "hv-col queries");
    qcol.setAttribute("role", "listbox");
    qcol.setAttribute("aria-label", S_.queries);
    var kcol = el("div", "hv-col keys");
    kcol.setAttribute("role", "listbox");
    kcol.setAttribute("aria-label", S_.keys);
    qcol.appendChild(el("div", "hv-colhead", S_.queries));
    kcol.appendChild(el("div", "hv-colhead", S_.keys));
    var qf = document.createDocumentFragment();
    var kf = document.createDocumentFragment();
    A.tokens.forEach(function (t, i) { qf.appendChild(makeTok(t, i, "q")); });
    A.key_tokens.forEach(function (t, i) { kf.appendChild(makeTok(t, i, "k")); });
    qcol.appendChild(qf);
    kcol.appendChild(kf);
    inner.appendChild(canvas);
    inner.appendChild(qcol);
    inner.appendChild(el("div"));
    inner.appendChild(kcol);
    scroll.appendChild(inner);
    layout.appendChild(scroll);

    var insp = el("aside", "inspector");
    insp.id = "inspector";
    insp.setAttribute("aria-live", "polite");
    layout.appendChild(insp);
    panel.appendChild(layout);

    hv = { scroll: scroll, inner: inner, canvas: canvas, qcol: qcol, kcol: kcol,
      insp: insp, sel: sel, kin: kin, fs: fs };
    var pending = false;
    scroll.addEventListener("scroll", function () {
      if (pending) return;
      pending = true;
      requestAnimationFrame(function () { pending = false; paintEdges(); });
    });
    if (window.attnlabResize) window.removeEventListener("resize", window.attnlabResize);
    window.attnlabResize = function () { if (state.view === "head") drawHead(); };
    window.addEventListener("resize", window.attnlabResize);
    [qcol, kcol].forEach(function (col) {
      col.addEventListener("mouseleave", function () { setFocus(null); });
    });
  }

  function makeTok(t, i, side) {
    var d = el("div", "tok", tokLabel(t));
    d.title = "#" + i + " " + t;
    d.dataset.i = String(i);
    d.dataset.side = side;
    d.setAttribute("role", "option");
    d.tabIndex = i === 0 ? 0 : -1;
    d.addEventListener("mouseenter", function () { setFocus({ side: side, i: i }); });
    d.addEventListener("focus", function () { setFocus({ side: side, i: i }); });
    d.addEventListener("keydown", onTokKey);
    if (side === "q") d.addEventListener("click", function () { stepInto(i); });
    return d;
  }

  function onTokKey(ev) {
    var side = ev.currentTarget.dataset.side;
    var i = +ev.currentTarget.dataset.i;
    var n = side === "q" ? T : S;
    var j = null;
    if (ev.key === "ArrowDown") j = Math.min(n - 1, i + 1);
    else if (ev.key === "ArrowUp") j = Math.max(0, i - 1);
    else if (ev.key === "Home") j = 0;
    else if (ev.key === "End") j = n - 1;
    else if (ev.key === "PageDown") j = Math.min(n - 1, i + 10);
    else if (ev.key === "PageUp") j = Math.max(0, i - 10);
    else if (ev.key === "ArrowRight" && side === "q") { focusTok("k", Math.min(i, S - 1)); }
    else if (ev.key === "ArrowLeft" && side === "k") { focusTok("q", Math.min(i, T - 1)); }
    else if (ev.key === "Escape") { setFocus(null); ev.preventDefault(); return; }
    else if (ev.key === "Enter" && side === "q") { ev.preventDefault(); stepInto(i); return; }
    else return;
    ev.preventDefault();
    if (j !== null) focusTok(side, j);
  }

  /* attnlab serve: open the step view of the first selected head for query i. */
  function stepInto(i) {
    if (typeof window.attnlabStepInto !== "function" || !state.heads.length) return;
    window.attnlabStepInto({ layer: A.layers[state.layer], head: A.heads[state.heads[0]],
      token: i });
  }

  function tokEl(side, i) {
    return (side === "q" ? hv.qcol : hv.kcol).children[i + 1];
  }
  function focusTok(side, i) {
    var col = side === "q" ? hv.qcol : hv.kcol;
    var old = col.querySelector(".tok[tabindex='0']");
    if (old) old.tabIndex = -1;
    var t = tokEl(side, i);
    t.tabIndex = 0;
    t.focus();
  }

  function setFocus(f) {
    var same = (f === null && state.focus === null) || (f && state.focus &&
      f.side === state.focus.side && f.i === state.focus.i);
    if (same) return;
    state.focus = f;
    refresh();
  }

  /* Edges to draw: for every query, its k strongest keys, per selected head. */
  function selectEdges() {
    var edges = [];
    var k = Math.min(state.k, K);
    var f = state.focus;
    state.heads.forEach(function (hi) {
      var hd = head(state.layer, hi);
      var q0 = 0, q1 = T;
      if (f && f.side === "q") { q0 = f.i; q1 = f.i + 1; }
      for (var q = q0; q < q1; q++) {
        for (var j = 0; j < k; j++) {
          var w = hd.val[q * K + j];
          if (!(w > 0)) break; // sorted: the rest are 0 (masked)
          var key = hd.idx[q * K + j];
          if (f && f.side === "k" && key !== f.i) continue;
          edges.push({ q: q, k: key, h: A.heads[hi], hi: hi, w: w });
        }
      }
    });
    return edges;
  }

  function rowH() {
    var t = tokEl("q", 0);
    return t ? t.getBoundingClientRect().height || 22 : 22;
  }

  /* Recompute which edges to draw, then the token shading and the canvas. */
  function refresh() {
    if (!A) return;
    api.drawn = selectEdges();
    updateTokens();
    paintEdges();
  }

  function paintEdges() {
    if (!A || state.view !== "head") return;
    var t0 = performance.now();
    var edges = api.drawn;
    var sc = hv.scroll, cv = hv.canvas;
    var dpr = window.devicePixelRatio || 1;
    var width = hv.inner.clientWidth;
    var viewH = sc.clientHeight;
    var top = sc.scrollTop;
    var rh = rowH();
    var head0 = hv.qcol.children[0].getBoundingClientRect().height;
    var qRect = hv.qcol.getBoundingClientRect();
    var kRect = hv.kcol.getBoundingClientRect();
    var iRect = hv.inner.getBoundingClientRect();
    var x1 = qRect.right - iRect.left + 2;
    var x2 = kRect.left - iRect.left - 2;
    cv.style.top = top + "px";
    cv.style.width = width + "px";
    cv.style.height = viewH + "px";
    if (cv.width !== Math.round(width * dpr) || cv.height !== Math.round(viewH * dpr)) {
      cv.width = Math.round(width * dpr);
      cv.height = Math.round(viewH * dpr);
    }
    var ctx = cv.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, viewH);
    // Bucket edges by head and opacity so each bucket is one path (fast at 2,048 tokens).
    var buckets = {};
    var shown = 0;
    for (var e = 0; e < edges.length; e++) {
      var ed = edges[e];
      var ya = head0 + (ed.q + 0.5) * rh - top;
      var yb = head0 + (ed.k + 0.5) * rh - top;
      if (Math.max(ya, yb) < 0 || Math.min(ya, yb) > viewH) continue;
      shown++;
      var level = Math.min(ALPHA_LEVELS - 1, Math.floor(Math.sqrt(ed.w) * ALPHA_LEVELS));
      var key = ed.hi + ":" + level;
      (buckets[key] = buckets[key] || { hi: ed.hi, level: level, pts: [] }).pts.push(ya, yb);
    }
    Object.keys(buckets).forEach(function (key) {
      var b = buckets[key];
      var frac = (b.level + 1) / ALPHA_LEVELS;
      ctx.strokeStyle = headColor(A.heads[b.hi]);
      ctx.globalAlpha = Math.max(0.08, frac);
      ctx.lineWidth = 0.6 + 3.4 * frac * frac;
      ctx.beginPath();
      for (var p = 0; p < b.pts.length; p += 2) {
        ctx.moveTo(x1, b.pts[p]);
        ctx.lineTo(x2, b.pts[p + 1]);
      }
      ctx.stroke();
    });
    ctx.globalAlpha = 1;
    cv.dataset.edges = String(edges.length);
    cv.dataset.visibleEdges = String(shown);
    api.paintMs = performance.now() - t0;
  }

  /* Token highlighting and the inspector for the focused token. */
  function updateTokens() {
    if (!A) return;
    hv.qcol.querySelectorAll(".tok.active, .tok.dim").forEach(function (t) {
      t.classList.remove("active", "dim");
    });
    hv.kcol.querySelectorAll(".tok").forEach(function (t) {
      t.classList.remove("active", "dim");
      t.style.background = "";
      delete t.dataset.w;
    });
    var f = state.focus;
    var insp = hv.insp;
    insp.textContent = "";
    insp.appendChild(el("h3", null, A.layer_names[state.layer] + " \u00b7 " + S_.heads + " " +
      (state.heads.length ? state.heads.map(function (hi) { return A.heads[hi]; }).join(", ")
        : "\u2013")));
    if (!f || !state.heads.length) {
      insp.appendChild(el("p", "small", S_.inspector_hint));
      drawMatrix(insp);
      drawExperts(insp);
      return;
    }
    var other = f.side === "q" ? hv.kcol : hv.qcol;
    tokEl(f.side, f.i).classList.add("active");
    var hi0 = state.heads[0];
    var rgb = hexToRgb(headColor(A.heads[hi0]));
    var label = f.side === "q" ? S_.attends_to : S_.attended_by;
    var tokText = f.side === "q" ? A.tokens[f.i] : A.key_tokens[f.i];
    var p = el("p");
    p.appendChild(el("strong", null, "#" + f.i + " " + tokLabel(tokText)));
    p.appendChild(document.createTextNode(" " + label + ":"));
    insp.appendChild(p);
    var routed = f.side === "q" ? routing(state.layer) : null;
    if (routed) {
      var rp = el("p", "small", S_.routed_to + ": " + routedText(routed, f.i));
      rp.id = "routed-to";
      insp.appendChild(rp);
    }
    // Shade the other column by the first selected head's weights.
    var n = f.side === "q" ? S : T;
    var hd0 = head(state.layer, hi0);
    for (var j = 0; j < n; j++) {
      var w = f.side === "q" ? weightAt(hd0, f.i, j) : weightAt(hd0, j, f.i);
      var t = other.children[j + 1];
      if (w > 0) {
        t.style.background = "rgba(" + rgb.join(",") + "," + Math.sqrt(w).toFixed(3) + ")";
        t.dataset.w = fmt(w);
      } else {
        t.classList.add("dim");
      }
    }
    // Table: the strongest links of this token, one column per selected head.
    var rows = {};
    api.drawn.forEach(function (e) {
      var j2 = f.side === "q" ? e.k : e.q;
      (rows[j2] = rows[j2] || {})[e.hi] = e.w;
    });
    var ids = Object.keys(rows).map(Number);
    ids.sort(function (a, b) {
      return (rows[b][hi0] || 0) - (rows[a][hi0] || 0) || a - b;
    });
    var tbl = el("table");
    tbl.id = "inspector-table";
    var hr = el("tr");
    hr.appendChild(el("th", null, S_.token));
    state.heads.forEach(function (hi) {
      var th = el("th", null, S_.head + " " + A.heads[hi]);
      th.style.color = headColor(A.heads[hi]);
      hr.appendChild(th);
    });
    tbl.appendChild(hr);
    ids.slice(0, 40).forEach(function (j2) {
      var tr = el("tr");
      tr.dataset.index = String(j2);
      var tt = f.side === "q" ? A.key_tokens[j2] : A.tokens[j2];
      tr.appendChild(el("td", null, "#" + j2 + " " + tokLabel(tt)));
      state.heads.forEach(function (hi) {
        var v = rows[j2][hi];
        var td = el("td", "num", v === undefined ? "" : fmt(v));
        td.dataset.head = String(A.heads[hi]);
        tr.appendChild(td);
      });
      tbl.appendChild(tr);
    });
    insp.appendChild(tbl);
    drawMatrix(insp);
    drawExperts(insp);
  }

  /* The first selected head as a heatmap (binned when large), queries down, keys across;
   * the axes carry token labels (thinned when there are many), hover shows the weight. */
  var MAX_LABELS = 16;
  function axisLabels(cls, tokens, across) {
    var box = el("div", cls);
    box.setAttribute("aria-hidden", "true");
    var n = tokens.length;
    var step = Math.max(1, Math.ceil(n / MAX_LABELS));
    for (var i = 0; i < n; i += step) {
      var lab = el("span", "mx-lab", tokLabel(tokens[i]));
      lab.title = "#" + i + " " + tokens[i];
      var at = ((i + 0.5) / n * 100).toFixed(3) + "%";
      if (across) lab.style.left = at; else lab.style.top = at;
      box.appendChild(lab);
    }
    box.dataset.labels = String(box.children.length);
    return box;
  }
  function drawMatrix(insp) {
    if (!state.heads.length) return;
    var hi = state.heads[0];
    var wrap = el("div", "matrix-wrap");
    wrap.appendChild(el("p", "small", S_.matrix_caption.replace("{head}", A.heads[hi])));
    var grid = el("div", "mx-grid");
    grid.appendChild(el("span", "mx-axis mx-axis-k", S_.keys + " →"));
    grid.appendChild(axisLabels("mx-cols", A.key_tokens, true));
    grid.appendChild(axisLabels("mx-rows", A.tokens, false));
    var cv = el("canvas", "matrix");
    cv.id = "matrix";
    var img = heatImage(hi, state.layer, 256, true);
    cv.width = img.width;
    cv.height = img.height;
    cv.getContext("2d").putImageData(img, 0, 0);
    cv.setAttribute("role", "img");
    cv.setAttribute("aria-label", S_.matrix_caption.replace("{head}", A.heads[hi]));
    grid.appendChild(cv);
    grid.appendChild(el("span", "mx-axis mx-axis-q", S_.queries + " ↓"));
    var bar = colourBar(fmt(img.top));
    bar.classList.add("mx-cbar");
    grid.appendChild(bar);
    var out = el("p", "small", "\u00a0");
    out.id = "matrix-hover";
    function at(ev) {
      var r = cv.getBoundingClientRect();
      var q = Math.max(0, Math.min(T - 1, Math.floor((ev.clientY - r.top) / r.height * T)));
      var kk = Math.max(0, Math.min(S - 1, Math.floor((ev.clientX - r.left) / r.width * S)));
      return { q: q, k: kk };
    }
    cv.addEventListener("mousemove", function (ev) {
      var p = at(ev);
      var w = weightAt(head(state.layer, hi), p.q, p.k);
      out.textContent = "#" + p.q + " " + tokLabel(A.tokens[p.q]) + " \u2192 #" + p.k + " " +
        tokLabel(A.key_tokens[p.k]) + ": " + fmt(w);
      cv.title = out.textContent;
    });
    cv.addEventListener("click", function (ev) { stepInto(at(ev).q); });
    wrap.appendChild(grid);
    wrap.appendChild(out);
    insp.appendChild(wrap);
  }

  function heatImage(hi, li, maxBins, perceptual) {
    var rows = Math.min(T, maxBins), cols = Math.min(S, maxBins);
    var grid = new Float32Array(rows * cols);
    var hd = head(li, hi);
    for (var q = 0; q < T; q++) {
      var r = Math.floor(q * rows / T);
      for (var j = 0; j < K; j++) {
        var w = hd.val[q * K + j];
        if (!(w > 0)) break;
        var c = Math.floor(hd.idx[q * K + j] * cols / S);
        if (w > grid[r * cols + c]) grid[r * cols + c] = w;
      }
    }
    // The heatmap: linear viridis from 0 to the largest weight shown (the colour bar says
    // which), so near-uniform rows keep their contrast instead of washing out. The
    // thumbnails: the head's own colour on white (white = no weight), as in the head view.
    var top = 0;
    for (var m = 0; m < rows * cols; m++) if (grid[m] > top) top = grid[m];
    var rgb = perceptual ? null : hexToRgb(headColor(A.heads[hi]));
    var img = new ImageData(cols, rows);
    for (var i = 0; i < rows * cols; i++) {
      var c;
      if (perceptual) {
        c = viridisRgb(top > 0 ? grid[i] / top : 0);
      } else {
        var a = Math.sqrt(grid[i]);
        c = [0, 1, 2].map(function (ch) { return Math.round(255 + (rgb[ch] - 255) * a); });
      }
      img.data[4 * i] = c[0];
      img.data[4 * i + 1] = c[1];
      img.data[4 * i + 2] = c[2];
      img.data[4 * i + 3] = 255;
    }
    img.top = top;
    return img;
  }

  function syncControls() {
    hv.sel.value = String(state.layer);
    hv.fs.querySelectorAll("input").forEach(function (cb) {
      cb.checked = state.heads.indexOf(+cb.value) >= 0;
    });
    hv.kin.value = String(state.k);
  }

  function drawHead() {
    if (!A) return;
    syncControls();
    refresh();
  }

  /* -------------------------------------------------------------- model view */
  var mvBuilt = false;
  function buildModelView() {
    var panel = $("panel-model");
    panel.appendChild(el("p", "hint", S_.model_hint));
    var scroll = el("div", "mv-scroll");
    var grid = el("div", "mv-grid");
    grid.id = "mv-grid";
    var extra = EX ? 1 : 0;
    grid.style.gridTemplateColumns = "auto repeat(" + (A.heads.length + extra) + ", auto)";
    grid.appendChild(el("div", "mv-label", ""));
    A.heads.forEach(function (h) { grid.appendChild(el("div", "mv-label", S_.head + " " + h)); });
    if (EX) grid.appendChild(el("div", "mv-label", S_.experts));
    A.layers.forEach(function (l, li) {
      grid.appendChild(el("div", "mv-label", A.layer_names[li]));
      A.heads.forEach(function (h, hi) {
        var b = el("button", "thumb");
        b.type = "button";
        b.dataset.layer = String(l);
        b.dataset.head = String(h);
        b.dataset.li = String(li);
        b.dataset.hi = String(hi);
        b.setAttribute("aria-label", A.layer_names[li] + ", " + S_.head + " " + h);
        b.title = A.layer_names[li] + ", " + S_.head + " " + h;
        b.appendChild(el("canvas"));
        b.addEventListener("click", function () {
          state.layer = li;
          state.heads = [hi];
          state.focus = null;
          showView("head", true);
        });
        grid.appendChild(b);
      });
      if (!EX) return;
      if (!routing(li)) { grid.appendChild(el("div", "mv-label", "\u2013")); return; }
      // beside the layer's heads: its token x expert routing (click: the head view)
      var x = el("button", "thumb ex-thumb");
      x.type = "button";
      x.dataset.li = String(li);
      x.dataset.layer = String(l);
      var name = A.layer_names[li] + ", " + S_.experts;
      x.setAttribute("aria-label", name);
      x.title = name;
      x.appendChild(el("canvas"));
      x.addEventListener("click", function () {
        state.layer = li;
        state.focus = null;
        showView("head", true);
      });
      grid.appendChild(x);
    });
    scroll.appendChild(grid);
    panel.appendChild(scroll);
  }
  function drawModel() {
    if (!A) return;
    if (!mvBuilt) {
      mvBuilt = true;
      document.querySelectorAll("#mv-grid .ex-thumb").forEach(function (b) {
        paintExperts(b.firstChild, +b.dataset.li);
      });
      document.querySelectorAll("#mv-grid .thumb:not(.ex-thumb)").forEach(function (b) {
        var img = heatImage(+b.dataset.hi, +b.dataset.li, 64);
        var cv = b.firstChild;
        cv.width = img.width;
        cv.height = img.height;
        cv.getContext("2d").putImageData(img, 0, 0);
      });
    }
    document.querySelectorAll("#mv-grid .thumb:not(.ex-thumb)").forEach(function (b) {
      b.classList.toggle("current", +b.dataset.li === state.layer &&
        state.heads.indexOf(+b.dataset.hi) >= 0);
    });
  }

  /* ------------------------------------------------------------- walkthrough */
  function buildWalkthrough() {
    var panel = $("panel-walk");
    if (W.intro) panel.appendChild(el("p", "hint", W.intro));
    var nav = el("ol", "wt-nav");
    nav.setAttribute("aria-label", S_.steps);
    var n = 0;
    W.steps.forEach(function (st, i) {
      st.label = st.kind === "part" ? st.title : (++n) + ". " + st.title;
      if (st.kind === "part") return;
      var li = el("li");
      var a = el("a", null, st.label);
      a.href = "#step-" + i;
      li.appendChild(a);
      nav.appendChild(li);
    });
    var det = el("details", "wt-toc");
    det.appendChild(el("summary", null, S_.steps + " (" + n + ")"));
    det.appendChild(nav);
    det.open = window.innerWidth > 760; // folded on phones
    panel.appendChild(det);
    W.steps.forEach(function (st, i) {
      if (st.kind === "part") {
        var h = el("h2", "wt-part", st.title);
        h.id = "step-" + i;
        panel.appendChild(h);
        return;
      }
      var sec = el("section", "wt-step");
      sec.id = "step-" + i;
      sec.dataset.step = st.id || String(i);
      sec.tabIndex = -1;
      sec.appendChild(el("h3", null, st.label));
      if (st.body) sec.appendChild(el("p", null, st.body));
      if (st.code) sec.appendChild(el("code", "wt-code", st.code));
      (st.tables || []).forEach(function (tb) { sec.appendChild(numTable(tb)); });
      panel.appendChild(sec);
    });
  }
  function numTable(tb) {
    var wrap = el("div", "tbl-wrap");
    var t = el("table", "nums");
    t.dataset.name = tb.name || "";
    if (tb.caption) t.appendChild(el("caption", null, tb.caption));
    var shade = tb.shade === true;
    if (tb.cols) {
      var hr = el("tr");
      if (tb.rows) hr.appendChild(el("th", null, tb.corner || ""));
      tb.cols.forEach(function (c) {
        var th = el("th", null, c);
        th.scope = "col";
        hr.appendChild(th);
      });
      t.appendChild(hr);
    }
    tb.cells.forEach(function (row, r) {
      var tr = el("tr");
      if (tb.rows) {
        var th = el("th", null, tb.rows[r]);
        th.scope = "row";
        tr.appendChild(th);
      }
      row.forEach(function (cell) {
        var td = el("td", null, cell);
        var v = parseFloat(cell);
        if (shade && v > 0 && v <= 1) td.style.background = "rgba(31,95,168," +
          (0.6 * v).toFixed(3) + ")";
        tr.appendChild(td);
      });
      t.appendChild(tr);
    });
    wrap.appendChild(t);
    return wrap;
  }

  /* -------------------------------------------------------------------- main */
  var t0 = performance.now();
  buildShell();
  if (A) {
    var init = A.initial;
    state.layer = init.layer;
    state.heads = init.heads.slice();
    state.k = init.k;
    buildHeadView();
    buildModelView();
  }
  if (W) buildWalkthrough();
  showView(state.view, false);
  api.renderMs = performance.now() - t0;
  api.ready = true;
  document.body.dataset.ready = "1";
  }

  function $(id) { return document.getElementById(id); }
  window.attnlabRender = render;
  var node = $("attnlab-data");
  if (node) render(JSON.parse(node.textContent));
})();
