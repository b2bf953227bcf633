/* attnlab serve page: a text box and a model picker over the explainer views, the step
 * view (into one head, for one query token) and the generate panel. Talks only to its own
 * server (the CSP allows nothing else). Token text is data: always set with textContent.
 */
(function () {
  "use strict";

  var CONF = JSON.parse(document.getElementById("attnlab-serve").textContent);
  var LANG = CONF.lang;
  var T_ = {
    "en": {
      model: "Model", text: "Text", explain: "Explain", loading: "loading {m} … {s} s",
      working: "working …", ready: "{m}: {n} tokens, {l} layers × {h} heads",
      step_hint: "Click a query token in the head view (or a row of the heatmap) to step " +
        "into that head.", step: "Step into the head", show_all: "show all {n}",
      show_less: "show less", gen: "Generate", gen_step: "Next token", gen_stream: "Stream",
      stop: "Stop", max_new: "new tokens", temperature: "temperature", top_k: "top-k",
      top_p: "top-p", seed: "seed", layer: "layer", head: "head",
      attn_of: "attention of the query #{q} (layer {l}, head {h}) that predicted it:",
      example_text: "(the example's tokens are fixed)", busy: "the server is busy; retrying …",
    },
    "zh-TW": {
      model: "模型", text: "文字", explain: "解說", loading: "正在載入 {m} … {s} 秒",
      working: "計算中 …", ready: "{m}：{n} 個詞元，{l} 層 × {h} 個頭",
      step_hint: "在注意力頭視圖中點一個查詢詞元（或熱圖的一列），即可走進那個頭。",
      step: "走進注意力頭", show_all: "顯示全部 {n} 個", show_less: "收起",
      gen: "生成", gen_step: "下一個詞元", gen_stream: "串流", stop: "停止",
      max_new: "新詞元數", temperature: "溫度", top_k: "top-k", top_p: "top-p", seed: "種子",
      layer: "層", head: "頭", attn_of: "預測它的查詢 #{q}（第 {l} 層、第 {h} 個頭）的注意力：",
      example_text: "（範例的詞元是固定的）", busy: "伺服器忙碌中，稍後重試 …",
    },
  }[LANG];
  function tr(key, vals) {
    var s = T_[key];
    Object.keys(vals || {}).forEach(function (k) { s = s.split("{" + k + "}").join(vals[k]); });
    return s;
  }
  function $(id) { return document.getElementById(id); }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function labelled(text, input) {
    var l = el("label", null, text);
    l.appendChild(input);
    return l;
  }
  function numInput(id, value, min, max, step) {
    var i = el("input");
    i.type = "number"; i.id = id; i.value = String(value);
    if (min !== null) i.min = String(min);
    if (max !== null) i.max = String(max);
    if (step) i.step = String(step);
    return i;
  }
  function fmt(v) { return v === null ? "-inf" : v.toFixed(4); }
  function tokLabel(t) {
    if (t === "") return "\u2205";
    if (/^ +$/.test(t)) return t.replace(/ /g, "\u2423"); // a token of spaces: visible
    return t.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
  }

  var api = window.attnlabServe = { models: [], trace: null, step: null, generated: [],
    busy: 0, errors: [] };

  /* ------------------------------------------------------------------ requests */
  function status(text, isError) {
    var s = $("status");
    s.textContent = text || "";
    s.className = isError ? "err" : "";
    if (isError) api.errors.push(text);
  }
  function postJSON(path, body) {
    api.busy++;
    watchLoading();
    return fetch(path, { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body) }).then(function (r) {
      return r.json().then(function (j) {
        if (!r.ok) throw new Error(j.error || ("HTTP " + r.status));
        return j;
      });
    }).finally(function () { api.busy--; });
  }
  var polling = false;
  function watchLoading() {
    if (polling) return;
    polling = true;
    function tick() {
      if (api.busy <= 0) { polling = false; return; }
      fetch("/api/models").then(function (r) { return r.json(); }).then(function (j) {
        api.models = j.models;
        var m = j.models.filter(function (x) { return x.name === modelSel.value; })[0];
        if (m && m.state === "loading") status(tr("loading", { m: m.name, s: m.seconds }));
        else if (api.busy > 0) status(tr("working"));
      }).catch(function () {}).finally(function () { setTimeout(tick, 400); });
    }
    setTimeout(tick, 150);
  }

  /* ------------------------------------------------------------------ controls */
  var modelSel, textBox, genBtns = {}, typingTimer = null;
  function buildControls() {
    var box = $("serve-controls");
    modelSel = el("select");
    modelSel.id = "model";
    textBox = el("textarea");
    textBox.id = "text";
    textBox.value = "Every effort moves you";
    textBox.setAttribute("maxlength", String(CONF.limits ? CONF.limits.max_chars : 20000));
    var go = el("button", "act", T_.explain);
    go.id = "explain";
    go.type = "button";
    go.addEventListener("click", runTrace);
    textBox.addEventListener("input", function () {
      clearTimeout(typingTimer);
      typingTimer = setTimeout(runTrace, 700);
    });
    modelSel.addEventListener("change", function () { syncExample(); runTrace(); });
    box.appendChild(labelled(T_.model, modelSel));
    box.appendChild(labelled(T_.text, textBox));
    box.appendChild(go);
    var st = el("p", null, "");
    st.id = "status";
    st.setAttribute("role", "status");
    box.appendChild(st);
  }
  function currentModel() {
    return api.models.filter(function (m) { return m.name === modelSel.value; })[0] || null;
  }
  function syncExample() {
    var m = currentModel();
    var ex = m && m.kind === "example";
    textBox.disabled = !!ex;
    textBox.title = ex ? T_.example_text : "";
    $("panel-generate").hidden = !m || m.kind !== "causal-lm" && m.kind !== "checkpoint";
    $("panel-heads").hidden = !headsApplies();
    $("panel-why").hidden = !headsApplies();
  }

  /* ---------------------------------------------------------------- the trace */
  var seq = 0, lastKey = null;
  function runTrace() {
    clearTimeout(typingTimer);
    var body = { model: modelSel.value, text: textBox.value, lang: LANG };
    if (!body.text.trim() && (currentModel() || {}).kind !== "example") return;
    var key = body.model + "\u0000" + body.text;
    if (key === lastKey) return; // already shown (or on its way)
    lastKey = key;
    var mine = ++seq;
    status(tr("working"));
    postJSON("/api/trace", body).then(function (res) {
      if (mine !== seq) return; // a newer request is on its way
      api.trace = res;
      var data = { version: 1, lang: LANG, strings: CONF.strings, title: CONF.strings.title,
        source: res.source, attention: res.attention, walkthrough: res.walkthrough,
        initial_view: "head", keep_panels: true };
      window.attnlabRender(data);
      var a = res.attention;
      status(tr("ready", { m: res.model, n: a.tokens.length, l: a.num_layers,
        h: a.num_heads }) + " \u2014 " + T_.step_hint);
      $("panel-step").hidden = true;
      showHeads(false);
      showWhyStrip();
      api.traced = (api.traced || 0) + 1;
      document.body.dataset.traced = String(api.traced);
    }).catch(function (e) {
      if (mine !== seq) return;
      lastKey = null; // let the same text be tried again
      status(e.message, true);
    });
  }

  /* ------------------------------------------------------------- the step view */
  var MAX_COLS = 12, MAX_ROWS = 16;
  function stepTable(tb) {
    var wrap = el("div", "st-tbl");
    var vals = tb.values || null;
    var cells = tb.cells || null;
    var nRows = vals ? vals.length : cells.length;
    var nCols = vals ? (vals[0] || []).length : (cells[0] || []).length;
    var rowsAsTokens = vals && nRows === 1 && !tb.rows && tb.cols && nCols > 1 &&
      isNaN(+tb.cols[0]);
    var full = false;
    function draw() {
      wrap.textContent = "";
      var t = el("table");
      t.dataset.name = tb.name || "";
      t.appendChild(el("caption", null, tb.name || tb.caption || ""));
      var R = rowsAsTokens ? nCols : nRows;
      var C = rowsAsTokens ? 1 : nCols;
      var rLabels = rowsAsTokens ? tb.cols : tb.rows;
      var cLabels = rowsAsTokens ? [tb.name] : tb.cols;
      var showR = full || R <= MAX_ROWS ? R : MAX_ROWS;
      var showC = full || C <= MAX_COLS ? C : MAX_COLS;
      var hr = el("tr");
      if (rLabels) hr.appendChild(el("th", "rl", tb.corner || ""));
      for (var j = 0; j < showC; j++) hr.appendChild(el("th", null, cLabels ? cLabels[j] : j));
      if (showC < C) hr.appendChild(el("th", null, "\u2026"));
      t.appendChild(hr);
      for (var i = 0; i < showR; i++) {
        var row = el("tr");
        if (rLabels) row.appendChild(el("th", "rl", rLabels[i]));
        for (j = 0; j < showC; j++) {
          var v = vals ? (rowsAsTokens ? vals[0][i] : vals[i][j]) : null;
          var td = el("td", null, vals ? fmt(v) : cells[i][j]);
          if (tb.shade && v !== null && v > 0 && v <= 1) {
            td.style.background = "rgba(31,95,168," + (0.6 * v).toFixed(3) + ")";
          }
          row.appendChild(td);
        }
        if (showC < C) row.appendChild(el("td", null, "\u2026"));
        t.appendChild(row);
      }
      wrap.appendChild(t);
      if (R > MAX_ROWS || C > MAX_COLS) {
        var b = el("button", "more", full ? T_.show_less : tr("show_all", { n: R * C }));
        b.type = "button";
        b.addEventListener("click", function () { full = !full; draw(); });
        wrap.appendChild(b);
      }
    }
    draw();
    return wrap;
  }
  function renderStep(res) {
    var panel = $("panel-step");
    panel.textContent = "";
    panel.hidden = false;
    panel.appendChild(el("h2", null, T_.step));
    panel.appendChild(el("p", "hint", res.summary));
    var n = 0;
    res.sections.forEach(function (sec) {
      if (sec.kind === "part") { panel.appendChild(el("h3", "wt-part", sec.title)); return; }
      var d = el("section", "st-sec");
      d.dataset.step = sec.id;
      d.appendChild(el("h3", null, (++n) + ". " + sec.title));
      if (sec.body) d.appendChild(el("p", null, sec.body));
      if (sec.code) d.appendChild(el("code", "wt-code", sec.code));
      (sec.tables || []).forEach(function (tb) { d.appendChild(stepTable(tb)); });
      panel.appendChild(d);
    });
    panel.scrollIntoView({ block: "start" });
  }
  window.attnlabStepInto = function (where) {
    if (!api.trace) return;
    var body = { model: api.trace.model, text: textBox.value, layer: where.layer,
      head: where.head, token: where.token, lang: LANG };
    status(tr("working"));
    postJSON("/api/step", body).then(function (res) {
      api.step = res;
      renderStep(res);
      status("");
      document.body.dataset.stepped = String((+document.body.dataset.stepped || 0) + 1);
    }).catch(function (e) { status(e.message, true); });
  };

  /* --------------------------------------------------------- the generate panel */
  var gen = {};
  function buildGenerate() {
    var p = $("panel-generate");
    p.appendChild(el("strong", null, T_.gen));
    gen.n = numInput("gen-n", 20, 1, CONF.limits ? CONF.limits.max_new_tokens : 256);
    gen.temp = numInput("gen-temp", 0, 0, 5, 0.1);
    gen.topk = numInput("gen-topk", "", 1, CONF.limits ? CONF.limits.max_top_k : 100);
    gen.topp = numInput("gen-topp", "", 0.01, 1, 0.05);
    gen.seed = numInput("gen-seed", 123, 0, null);
    gen.layer = numInput("gen-layer", 0, 0, null);
    gen.head = numInput("gen-head", 0, 0, null);
    [["max_new", gen.n], ["temperature", gen.temp], ["top_k", gen.topk], ["top_p", gen.topp],
      ["seed", gen.seed], ["layer", gen.layer], ["head", gen.head]].forEach(function (x) {
      p.appendChild(labelled(T_[x[0]], x[1]));
    });
    [["gen-step", T_.gen_step, function () { generate(1); }],
      ["gen-stream", T_.gen_stream, function () { generate(+gen.n.value || 1); }],
      ["gen-stop", T_.stop, stop]].forEach(function (b) {
      var btn = el("button", "act", b[1]);
      btn.id = b[0];
      btn.type = "button";
      btn.addEventListener("click", b[2]);
      genBtns[b[0]] = btn;
      p.appendChild(btn);
    });
    gen.out = el("div"); gen.out.id = "gen-out";
    gen.bars = el("div", "bars"); gen.bars.id = "gen-bars";
    gen.attn = el("div"); gen.attn.id = "gen-attn";
    p.appendChild(gen.out);
    p.appendChild(gen.bars);
    p.appendChild(gen.attn);
  }
  function addGenToken(ev) {
    // One span per generated token (its text as it streamed): a click asks why it came out.
    var span = el("span", "gen-tok", ev.text || tokLabel(ev.token));
    span.dataset.index = String(ev.index);
    span.title = WT.why_click;
    span.tabIndex = 0;
    function open() {
      var runner = ev.top.filter(function (t) { return t.id !== ev.id; })[0];
      openWhy({ ids: ev.context, position: -1, target: ev.id,
        contrast: runner ? runner.id : null, top: ev.top });
    }
    span.addEventListener("click", open);
    span.addEventListener("keydown", function (e) { if (e.key === "Enter") open(); });
    gen.out.appendChild(span);
  }
  function showBars(ev) {
    gen.bars.textContent = "";
    var max = ev.top.length ? ev.top[0].p : 1;
    ev.top.forEach(function (t) {
      gen.bars.appendChild(el("span", "tk", "#" + t.id + " " + tokLabel(t.token)));
      var b = el("div", "bar" + (t.id === ev.id ? " chosen" : ""));
      b.style.width = (100 * t.p / Math.max(max, 1e-9)).toFixed(1) + "%";
      b.dataset.p = String(t.p);
      gen.bars.appendChild(b);
      gen.bars.appendChild(el("span", "p", t.p.toFixed(4)));
    });
    gen.attn.textContent = "";
    var a = ev.attention;
    if (a && a.weights) {
      gen.attn.appendChild(el("p", "small", tr("attn_of", { q: a.query, l: a.layer, h: a.head })));
      var order = a.weights.map(function (w, i) { return i; })
        .sort(function (i, j) { return a.weights[j] - a.weights[i]; }).slice(0, 5);
      order.forEach(function (i) {
        gen.attn.appendChild(el("span", "chip", "#" + i + " " + a.weights[i].toFixed(3) + "  "));
      });
    }
  }
  var controller = null;
  function stop() { if (controller) controller.abort(); }
  function generate(n) {
    if (controller) return;
    var body = { model: modelSel.value, text: textBox.value, max_new_tokens: n,
      temperature: +gen.temp.value || 0, seed: +gen.seed.value || 0,
      layer: +gen.layer.value || 0, head: +gen.head.value || 0 };
    if (gen.topk.value) body.top_k = +gen.topk.value;
    if (gen.topp.value) body.top_p = +gen.topp.value;
    controller = new AbortController();
    api.busy++;
    watchLoading();
    gen.out.textContent = "";
    api.generated = [];
    var added = "";
    fetch("/api/generate", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: controller.signal }).then(function (r) {
      if (!r.ok) return r.json().then(function (j) { throw new Error(j.error); });
      var reader = r.body.getReader();
      var dec = new TextDecoder();
      var buf = "";
      function pump() {
        return reader.read().then(function (chunk) {
          if (chunk.done) return;
          buf += dec.decode(chunk.value, { stream: true });
          var parts = buf.split("\n\n");
          buf = parts.pop();
          parts.forEach(function (block) {
            var ev = null, data = null;
            block.split("\n").forEach(function (line) {
              if (line.indexOf("event: ") === 0) ev = line.slice(7);
              if (line.indexOf("data: ") === 0) data = JSON.parse(line.slice(6));
            });
            if (ev === "prompt") {
              gen.prompt = data.ids;
              gen.ids = [];
            } else if (ev === "token") {
              added += data.text;
              data.context = gen.prompt.concat(gen.ids); // the ids that predicted it
              gen.ids.push(data.id);
              api.generated.push(data);
              addGenToken(data);
              showBars(data);
            } else if (ev === "done") {
              added += data.text;
              if (data.text) gen.out.appendChild(el("span", null, data.text));
              document.body.dataset.generated = String(api.generated.length);
            } else if (ev === "error") {
              status(data.error, true);
            }
          });
          return pump();
        });
      }
      return pump();
    }).catch(function (e) {
      if (e.name !== "AbortError") status(e.message, true);
    }).finally(function () {
      controller = null;
      api.busy--;
      if (added) { textBox.value += added; runTrace(); }
    });
  }

  /* ------------------------------------------------ what heads do: roles, lens, rollout */
  var HT = {
    "en": { heads: "What the heads do", roles: "Roles (click a head to switch it off)",
      lens: "Logit lens", rollout: "Rollout", off: "heads off", none_off: "no head off",
      original: "model", ablated: "with {h} off", kl: "KL(model \u2016 ablated) at the last " +
      "position: {v} nats", lens_hint: "Top token after each block (rows) at each position " +
      "(columns); colour: its probability.", rollout_hint: "Attention rollout (residual " +
      "0.5): how much each input token (column) reaches each position (row) through all " +
      "layers.", reset: "switch all on", input: "scored on {i}",
      previous_token: "previous token", first_token: "first token",
      current_token: "current token", induction: "induction" },
    "zh-TW": { heads: "注意力頭在做什麼", roles: "角色（點一個頭把它關掉）", lens: "Logit lens",
      rollout: "Rollout", off: "關掉的頭", none_off: "沒有關掉的頭", original: "模型",
      ablated: "關掉 {h}", kl: "最後位置的 KL(模型 \u2016 關掉後)：{v} nats",
      lens_hint: "每一層（列）之後、每個位置（欄）的最可能詞元；顏色：機率。",
      rollout_hint: "注意力 rollout（殘差 0.5）：每個輸入詞元（欄）經過所有層到達每個位置（列）的程度。",
      reset: "全部打開", input: "評分輸入：{i}", previous_token: "前一個詞元",
      first_token: "第一個詞元", current_token: "目前詞元", induction: "歸納（induction）" },
  }[LANG];
  function htr(key, vals) {
    var s = HT[key];
    Object.keys(vals || {}).forEach(function (k) { s = s.split("{" + k + "}").join(vals[k]); });
    return s;
  }
  var viridis = window.attnlabColour.viridis; // page.js: one colour scale for both pages
  function colourBar() { return window.attnlabColour.bar("1"); }
  function inkFor(v) { return v > 0.6 ? "#111" : "#fff"; } // text readable on viridis(v)
  var hv = { view: "roles", off: [], roles: null, rolesModel: null };
  function headsKey(l, h) { return l + "." + h; }
  function isOff(l, h) { return hv.off.indexOf(headsKey(l, h)) >= 0; }
  function buildHeads() {
    var p = $("panel-heads");
    p.appendChild(el("h2", null, HT.heads));
    var tabs = el("div", "hd-tabs");
    [["roles", HT.roles], ["lens", HT.lens], ["rollout", HT.rollout]].forEach(function (t) {
      var b = el("button", "act", t[1]);
      b.type = "button";
      b.id = "hd-tab-" + t[0];
      b.addEventListener("click", function () { hv.view = t[0]; showHeads(true); });
      tabs.appendChild(b);
    });
    p.appendChild(tabs);
    hv.body = el("div");
    hv.body.id = "hd-body";
    p.appendChild(hv.body);
  }
  function headsApplies() {
    var m = currentModel();
    return !!m && (m.kind === "causal-lm" || m.kind === "checkpoint");
  }
  function showHeads(force) {
    var p = $("panel-heads");
    p.hidden = !headsApplies();
    if (p.hidden || !api.trace) return;
    ["roles", "lens", "rollout"].forEach(function (v) {
      $("hd-tab-" + v).classList.toggle("on", v === hv.view);
    });
    if (api.trace.model !== hv.rolesModel) { hv.off = []; hv.roles = null; }
    if (hv.view === "roles") showRoles();
    else if (hv.view === "lens") showLens();
    else showRollout();
  }
  function headsDone(what) {
    document.body.dataset[what] = String((+document.body.dataset[what] || 0) + 1);
  }
  function showRoles() {
    var model = api.trace.model;
    var ready = hv.roles && hv.rolesModel === model ? Promise.resolve(hv.roles)
      : postJSON("/api/heads", { model: model }).then(function (res) {
        hv.roles = res; hv.rolesModel = model; return res; });
    ready.then(function (res) {
      if (hv.view !== "roles") return;
      hv.body.textContent = "";
      hv.body.appendChild(el("p", "hint", htr("input", { i: res.input })));
      var grids = el("div", "hd-grids");
      res.roles.forEach(function (role) {
        var box = el("div", "hd-role");
        box.dataset.role = role;
        box.appendChild(el("h3", null, HT[role] || role));
        var t = el("table", "hd-grid");
        var hr = el("tr");
        hr.appendChild(el("th", null, "L\\H"));
        for (var h = 0; h < res.heads; h++) hr.appendChild(el("th", null, h));
        t.appendChild(hr);
        res.scores[role].forEach(function (row, l) {
          var tr_ = el("tr");
          tr_.appendChild(el("th", null, l));
          row.forEach(function (v, h) {
            var td = el("td", "hd-cell" + (isOff(l, h) ? " off" : ""), v.toFixed(2));
            td.style.background = viridis(v);
            td.style.color = inkFor(v);
            td.dataset.layer = String(l);
            td.dataset.head = String(h);
            td.title = (HT[role] || role) + " \u2014 layer " + l + ", head " + h + ": " +
              v.toFixed(4);
            td.addEventListener("click", function () { toggleHead(l, h); });
            tr_.appendChild(td);
          });
          t.appendChild(tr_);
        });
        box.appendChild(t);
        grids.appendChild(box);
      });
      hv.body.appendChild(grids);
      hv.body.appendChild(colourBar());
      hv.dist = el("div", "hd-dist");
      hv.dist.id = "hd-dist";
      hv.body.appendChild(hv.dist);
      headsDone("roles");
      runAblation();
    }).catch(function (e) { status(e.message, true); });
  }
  function toggleHead(l, h) {
    var k = headsKey(l, h), i = hv.off.indexOf(k);
    if (i >= 0) hv.off.splice(i, 1); else hv.off.push(k);
    Array.prototype.forEach.call(hv.body.querySelectorAll(".hd-cell"), function (td) {
      td.classList.toggle("off", isOff(+td.dataset.layer, +td.dataset.head));
    });
    runAblation();
  }
  var ablSeq = 0;
  function runAblation() {
    var heads = hv.off.map(function (k) { return k.split(".").map(Number); });
    var mine = ++ablSeq;
    postJSON("/api/ablate", { model: api.trace.model, text: textBox.value, heads: heads,
      k: 8 }).then(function (res) {
      if (mine !== ablSeq) return;
      api.ablation = res;
      renderDist(res);
      headsDone("ablated");
    }).catch(function (e) { status(e.message, true); });
  }
  function distColumn(title, tops, id) {
    var col = el("div", "hd-col");
    col.id = id;
    col.appendChild(el("h4", null, title));
    var bars = el("div", "bars");
    var max = tops.length ? tops[0].p : 1;
    tops.forEach(function (t) {
      bars.appendChild(el("span", "tk", tokLabel(t.token)));
      var b = el("div", "bar");
      b.style.width = (100 * t.p / Math.max(max, 1e-9)).toFixed(1) + "%";
      b.dataset.p = String(t.p);
      bars.appendChild(b);
      bars.appendChild(el("span", "p", t.p.toFixed(4)));
    });
    col.appendChild(bars);
    return col;
  }
  function renderDist(res) {
    hv.dist.textContent = "";
    var names = res.heads.map(function (x) { return x.join("."); }).join(", ");
    var row = el("div", "hd-cols");
    row.appendChild(distColumn(HT.original, res.before, "hd-before"));
    row.appendChild(distColumn(names ? htr("ablated", { h: names }) : HT.none_off, res.after,
      "hd-after"));
    hv.dist.appendChild(row);
    hv.dist.appendChild(el("p", "small", htr("kl", { v: res.kl[res.kl.length - 1].toFixed(4) })));
    if (names) {
      var reset = el("button", "more", HT.reset);
      reset.type = "button";
      reset.addEventListener("click", function () {
        hv.off = [];
        Array.prototype.forEach.call(hv.body.querySelectorAll(".hd-cell.off"),
          function (td) { td.classList.remove("off"); });
        runAblation();
      });
      hv.dist.appendChild(reset);
    }
  }
  function labelledHeatmap(rows, cols, values, cell, cls) {
    var t = el("table", "hd-heat " + (cls || ""));
    var hr = el("tr");
    hr.appendChild(el("th"));
    cols.forEach(function (c) { hr.appendChild(el("th", "hd-colh", tokLabel(c))); });
    t.appendChild(hr);
    values.forEach(function (row, i) {
      var tr_ = el("tr");
      tr_.appendChild(el("th", "hd-rowh", rows[i]));
      row.forEach(function (v, j) { tr_.appendChild(cell(v, i, j)); });
      t.appendChild(tr_);
    });
    var wrap = el("div", "hd-scroll");
    wrap.appendChild(t);
    return wrap;
  }
  function showLens() {
    var model = api.trace.model;
    postJSON("/api/lens", { model: model, text: textBox.value, k: 3 }).then(function (res) {
      if (hv.view !== "lens") return;
      hv.body.textContent = "";
      hv.body.appendChild(el("p", "hint", HT.lens_hint));
      var rows = res.top.map(function (_, l) { return "L" + l; });
      hv.body.appendChild(labelledHeatmap(rows, res.tokens, res.top, function (tops, l, t) {
        var best = tops[0];
        var td = el("td", "hd-lens", tokLabel(best.token));
        td.style.background = viridis(best.p);
        td.style.color = inkFor(best.p);
        td.title = "layer " + l + ", after " + JSON.stringify(res.tokens[t]) + ": " +
          tops.map(function (x) { return JSON.stringify(x.token) + " " + x.p.toFixed(4); })
            .join(", ");
        return td;
      }, "lens"));
      hv.body.appendChild(colourBar());
      headsDone("lens");
    }).catch(function (e) { status(e.message, true); });
  }
  function showRollout() {
    var model = api.trace.model;
    postJSON("/api/rollout", { model: model, text: textBox.value }).then(function (res) {
      if (hv.view !== "rollout") return;
      hv.body.textContent = "";
      hv.body.appendChild(el("p", "hint", HT.rollout_hint));
      var rows = res.tokens.map(function (t, i) { return i + " " + tokLabel(t); });
      hv.body.appendChild(labelledHeatmap(rows, res.tokens, res.rollout, function (v, i, j) {
        var td = el("td", "hd-roll");
        td.style.background = viridis(v);
        td.title = JSON.stringify(res.tokens[i]) + " \u2190 " + JSON.stringify(res.tokens[j]) +
          ": " + v.toFixed(4);
        return td;
      }, "rollout"));
      hv.body.appendChild(colourBar());
      headsDone("rollout");
    }).catch(function (e) { status(e.message, true); });
  }


  /* --------------------------------------------------------- why this token */
  var WT = {
    "en": { why: "Why this token", why_click: "click: why this token?",
      why_hint: "Click a token of the text (the prediction of the token before it), the " +
        "next-token chip, or a generated token: which heads and MLPs wrote it.",
      next: "next \u2192", rather: "rather than", none: "(no contrast)",
      total: "total {w} = {t}; embedding {e}, bias {b}, error {r}",
      heads_grid: "Heads (layers \u00d7 heads): each head's direct write towards the target",
      mlp_bars: "MLPs, embedding and constant terms",
      src: "Head {l}.{h}: its value-weighted attention over the source tokens (sums to {v})",
      src_hint: "Click a head to see which source tokens it read the answer from.",
      patch: "Patching", clean: "clean", corrupted: "corrupted", target: "target",
      contrast: "contrast", over: "over", method: "method", run_patch: "Patch",
      activation: "activation patching", attribution: "attribution patching",
      patch_hint: "Each cell: the share of the clean answer that putting that component " +
        "back from the clean run restores (1 all, 0 none)." },
    "zh-TW": { why: "為什麼是這個詞元", why_click: "點一下：為什麼是這個詞元？",
      why_hint: "點文字中的一個詞元（它前一個詞元的預測）、下一個詞元，或生成的詞元：看是哪些頭和 MLP 寫出了它。",
      next: "下一個 \u2192", rather: "而不是", none: "（不對比）",
      total: "總計 {w} = {t}；嵌入 {e}，偏置 {b}，誤差 {r}",
      heads_grid: "注意力頭（層 \u00d7 頭）：每個頭直接寫向目標的量",
      mlp_bars: "MLP、嵌入與常數項",
      src: "頭 {l}.{h}：以值加權的注意力在來源詞元上的分配（總和 {v}）",
      src_hint: "點一個頭，看它從哪些來源詞元讀到答案。",
      patch: "修補（patching）", clean: "乾淨", corrupted: "損壞", target: "目標",
      contrast: "對比", over: "對象", method: "方法", run_patch: "修補",
      activation: "激活修補", attribution: "歸因修補",
      patch_hint: "每格：把該元件從乾淨的執行放回後，恢復的答案比例（1 全部，0 沒有）。" },
  }[LANG];
  function wtr(key, vals) {
    var s = WT[key];
    Object.keys(vals || {}).forEach(function (k) { s = s.split("{" + k + "}").join(vals[k]); });
    return s;
  }
  function diverging(v, vmax) {
    // blue (away from the target) - white - red (towards it), as the CLI's figures
    var f = Math.max(-1, Math.min(1, v / (vmax || 1)));
    var end = f >= 0 ? [178, 24, 43] : [33, 102, 172];
    var a = Math.abs(f);
    return "rgb(" + end.map(function (c) { return Math.round(255 + (c - 255) * a); })
      .join(",") + ")";
  }
  function absMax(rows) {
    var m = 0;
    rows.forEach(function (r) { (r.length === undefined ? [r] : r).forEach(function (v) {
      m = Math.max(m, Math.abs(v)); }); });
    return m || 1;
  }
  var why = { req: null, seq: 0 };
  function buildWhy() {
    var p = $("panel-why");
    p.appendChild(el("h2", null, WT.why));
    why.hint = el("p", "hint", WT.why_hint);
    p.appendChild(why.hint);
    why.strip = el("div", "why-strip");
    why.strip.id = "why-strip";
    p.appendChild(why.strip);
    why.body = el("div");
    why.body.id = "why-body";
    p.appendChild(why.body);
    // the clean / corrupted form
    var f = el("div", "why-form");
    f.appendChild(el("h3", null, WT.patch));
    why.clean = el("input"); why.clean.id = "why-clean"; why.clean.size = 48;
    why.corrupted = el("input"); why.corrupted.id = "why-corrupted"; why.corrupted.size = 48;
    why.ptarget = el("input"); why.ptarget.id = "why-target"; why.ptarget.size = 8;
    why.pcontrast = el("input"); why.pcontrast.id = "why-contrast"; why.pcontrast.size = 8;
    why.over = el("select"); why.over.id = "why-over";
    ["heads", "residual", "mlp"].forEach(function (o) {
      var opt = el("option", null, o); opt.value = o; why.over.appendChild(opt); });
    why.method = el("select"); why.method.id = "why-method";
    ["activation", "attribution"].forEach(function (o) {
      var opt = el("option", null, WT[o]); opt.value = o; why.method.appendChild(opt); });
    [["clean", why.clean], ["corrupted", why.corrupted], ["target", why.ptarget],
      ["contrast", why.pcontrast], ["over", why.over], ["method", why.method]]
      .forEach(function (x) { f.appendChild(labelled(WT[x[0]], x[1])); });
    // Filled from the text and the last answer explained, until the user types in them.
    [why.clean, why.ptarget, why.pcontrast].forEach(function (i) {
      i.addEventListener("input", function () { i.dataset.edited = "1"; });
    });
    var go = el("button", "act", WT.run_patch);
    go.id = "why-patch"; go.type = "button";
    go.addEventListener("click", runPatch);
    f.appendChild(go);
    why.grid = el("div"); why.grid.id = "why-patch-grid";
    f.appendChild(why.grid);
    p.appendChild(f);
  }
  function showWhyStrip() {
    // The trace's tokens: token i is what position i-1 predicted; "next" is the model's own.
    var p = $("panel-why");
    p.hidden = !headsApplies();
    if (p.hidden || !api.trace || !api.trace.token_ids) return;
    why.strip.textContent = "";
    var ids = api.trace.token_ids, toks = api.trace.attention.tokens;
    toks.forEach(function (t, i) {
      var chip = el("span", "why-tok" + (i === 0 ? " first" : ""), tokLabel(t));
      chip.dataset.index = String(i);
      if (i > 0) {
        chip.title = WT.why_click;
        chip.tabIndex = 0;
        chip.addEventListener("click", function () {
          openWhy({ ids: ids, position: i - 1, target: ids[i] }); });
      }
      why.strip.appendChild(chip);
    });
    var nxt = el("span", "why-tok next", WT.next);
    nxt.id = "why-next"; nxt.tabIndex = 0; nxt.title = WT.why_click;
    nxt.addEventListener("click", function () { openWhy({ ids: ids, position: -1 }); });
    why.strip.appendChild(nxt);
    if (!why.clean.dataset.edited) why.clean.value = textBox.value;
  }
  function openWhy(q) {
    // q: {ids, position, target?, contrast? (undefined: the runner-up), top?}
    var body = { model: api.trace ? api.trace.model : modelSel.value, ids: q.ids,
      position: q.position, by_source: true, k: 10 };
    if (q.target !== undefined && q.target !== null) body.target = q.target;
    var runnerUp = q.contrast === undefined;
    if (!runnerUp && q.contrast !== null) body.contrast = q.contrast;
    var mine = ++why.seq;
    $("panel-why").hidden = false;
    status(tr("working"));
    return postJSON("/api/attribute", body).then(function (res) {
      if (mine !== why.seq) return null;
      if (runnerUp) { // first the prediction's top tokens, then against the runner-up
        var r = res.top.filter(function (t) { return t.id !== res.target.id; })[0];
        return openWhy({ ids: q.ids, position: q.position, target: res.target.id,
          contrast: r ? r.id : null });
      }
      api.why = res;
      api.whyBody = body;
      renderWhy(res);
      status("");
      document.body.dataset.why = String((+document.body.dataset.why || 0) + 1);
      return res;
    }).catch(function (e) { if (mine === why.seq) status(e.message, true); });
  }
  function renderWhy(res) {
    var b = why.body;
    b.textContent = "";
    var line = el("p", "why-line");
    line.appendChild(el("strong", null, "#" + res.position + " " +
      tokLabel(res.tokens[res.position]) + " \u2192 " + tokLabel(res.target.token)));
    line.appendChild(el("span", null, " " + WT.rather + " "));
    var pick = el("select");
    pick.id = "why-contrast-pick";
    var none = el("option", null, WT.none); none.value = ""; pick.appendChild(none);
    var seen = {};
    res.top.concat(res.contrast ? [res.contrast] : []).forEach(function (t) {
      if (t.id === res.target.id || seen[t.id]) return;
      seen[t.id] = true;
      var o = el("option", null, tokLabel(t.token) + (t.p !== undefined ?
        "  (p " + t.p.toFixed(3) + ")" : ""));
      o.value = String(t.id);
      pick.appendChild(o);
    });
    pick.value = res.contrast ? String(res.contrast.id) : "";
    pick.addEventListener("change", function () {
      openWhy({ ids: res.ids, position: res.position, target: res.target.id,
        contrast: pick.value === "" ? null : +pick.value });
    });
    line.appendChild(pick);
    b.appendChild(line);
    var w = "logit(" + JSON.stringify(res.target.token) + ")" + (res.contrast ?
      " \u2212 logit(" + JSON.stringify(res.contrast.token) + ")" : "");
    var tot = el("p", "small", wtr("total", { w: w, t: res.total.toFixed(4),
      e: res.embedding.toFixed(4), b: res.bias.toFixed(4), r: res.error.toExponential(1) }));
    tot.id = "why-total";
    tot.dataset.total = String(res.total);
    b.appendChild(tot);
    if (res.frozen.length) b.appendChild(el("p", "small why-frozen", res.frozen.join("; ")));
    var row = el("div", "why-cols");
    // the heads grid
    var left = el("div", "why-col");
    left.appendChild(el("h4", null, WT.heads_grid));
    var vmax = absMax(res.heads);
    var t = el("table", "hd-grid why-grid");
    t.id = "why-heads";
    var hr = el("tr");
    hr.appendChild(el("th", null, "L\\H"));
    for (var h = 0; h < res.heads[0].length; h++) hr.appendChild(el("th", null, h));
    t.appendChild(hr);
    res.heads.forEach(function (vals, l) {
      var tr_ = el("tr");
      tr_.appendChild(el("th", null, l));
      vals.forEach(function (v, h_) {
        var td = el("td", "hd-cell why-cell", v.toFixed(2));
        td.style.background = diverging(v, vmax);
        td.style.color = Math.abs(v) / vmax > 0.6 ? "#fff" : "#111";
        td.dataset.layer = String(l);
        td.dataset.head = String(h_);
        td.dataset.v = String(v);
        td.title = "head " + l + "." + h_ + ": " + v.toFixed(4);
        td.addEventListener("click", function () { showSources(res, l, h_); });
        tr_.appendChild(td);
      });
      t.appendChild(tr_);
    });
    left.appendChild(t);
    left.appendChild(el("p", "small", WT.src_hint));
    why.srcTitle = el("p", "small why-src-title");
    left.appendChild(why.srcTitle);
    why.src = el("div", "bars why-src");
    why.src.id = "why-src";
    left.appendChild(why.src);
    row.appendChild(left);
    // the MLP bars (with the embedding and the constant terms)
    var right = el("div", "why-col");
    right.appendChild(el("h4", null, WT.mlp_bars));
    var names = ["embedding"].concat(res.mlp.map(function (_, l) { return "mlp " + l; }),
      ["bias"]);
    var values = [res.embedding].concat(res.mlp, [res.bias]);
    var bmax = absMax(values);
    var bars = el("div", "why-bars");
    bars.id = "why-mlp";
    values.forEach(function (v, i) {
      bars.appendChild(el("span", "tk", names[i]));
      var track = el("div", "why-track");
      var bar = el("div", "why-bar " + (v >= 0 ? "pos" : "neg"));
      bar.style.width = (50 * Math.abs(v) / bmax).toFixed(1) + "%";
      bar.dataset.v = String(v);
      track.appendChild(bar);
      bars.appendChild(track);
      bars.appendChild(el("span", "p", v.toFixed(3)));
    });
    right.appendChild(bars);
    row.appendChild(right);
    b.appendChild(row);
    // open on the strongest head
    var best = [0, 0], bv = -1;
    res.heads.forEach(function (vals, l) { vals.forEach(function (v, h_) {
      if (Math.abs(v) > bv) { bv = Math.abs(v); best = [l, h_]; } }); });
    showSources(res, best[0], best[1]);
    if (!why.ptarget.dataset.edited) why.ptarget.value = res.target.token;
    if (!why.pcontrast.dataset.edited) why.pcontrast.value = res.contrast ? res.contrast.token : "";
    $("panel-why").scrollIntoView({ block: "nearest" });
  }
  function showSources(res, l, h) {
    why.src.textContent = "";
    why.srcTitle.textContent = "";
    Array.prototype.forEach.call(why.body.querySelectorAll(".why-cell"), function (td) {
      td.classList.toggle("sel", +td.dataset.layer === l && +td.dataset.head === h);
    });
    if (!res.by_source) return;
    var row = res.by_source[l][h];
    why.srcTitle.textContent = wtr("src", { l: l, h: h, v: res.heads[l][h].toFixed(4) });
    var m = absMax(row);
    row.forEach(function (v, j) {
      if (j > res.position) return; // a query reads only what came before it
      why.src.appendChild(el("span", "tk", "#" + j + " " + tokLabel(res.tokens[j])));
      var bar = el("div", "bar " + (v >= 0 ? "pos" : "neg"));
      bar.style.width = (100 * Math.abs(v) / m).toFixed(1) + "%";
      bar.dataset.v = String(v);
      why.src.appendChild(bar);
      why.src.appendChild(el("span", "p", v.toFixed(4)));
    });
    api.whySource = { layer: l, head: h };
  }
  function runPatch() {
    var body = { model: api.trace ? api.trace.model : modelSel.value,
      clean: why.clean.value, corrupted: why.corrupted.value, target: why.ptarget.value,
      contrast: why.pcontrast.value, over: why.over.value, method: why.method.value };
    status(tr("working"));
    postJSON("/api/patch", body).then(function (res) {
      api.patch = res;
      why.grid.textContent = "";
      why.grid.appendChild(el("p", "small", WT.patch_hint));
      var cols = res.over === "heads" ? res.grid[0].map(function (_, h) { return String(h); })
        : res.tokens;
      var vmax = absMax(res.grid);
      var rows = res.grid.map(function (_, l) { return "L" + l; });
      var table = labelledHeatmap(rows, cols, res.grid, function (v, l, c) {
        var td = el("td", "why-pcell", v.toFixed(2));
        td.style.background = diverging(v, vmax);
        td.style.color = Math.abs(v) / vmax > 0.6 ? "#fff" : "#111";
        td.dataset.v = String(v);
        td.title = "layer " + l + ", " + (res.over === "heads" ? "head " + c :
          "position " + c + " " + JSON.stringify(res.tokens[c])) + ": " + v.toFixed(4);
        return td;
      }, "why-patch");
      why.grid.appendChild(table);
      status("");
      document.body.dataset.patched = String((+document.body.dataset.patched || 0) + 1);
    }).catch(function (e) { status(e.message, true); });
  }

  /* ---------------------------------------------------------------------- main */
  buildControls();
  buildGenerate();
  buildHeads();
  buildWhy();
  fetch("/api/models").then(function (r) { return r.json(); }).then(function (j) {
    api.models = j.models;
    CONF.limits = j.limits;
    j.models.forEach(function (m) {
      var o = el("option", null, m.name + " \u2014 " + m.description);
      o.value = m.name;
      modelSel.appendChild(o);
    });
    syncExample();
    runTrace();
  }).catch(function (e) { status(e.message, true); });
})();
