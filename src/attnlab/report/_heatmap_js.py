"""The heatmap viewer: plain JavaScript, inlined once per report that has heatmaps.

No library; canvas 2-D only.  Token text is only ever set with ``textContent`` or drawn
with ``fillText``.  ``window.attnlab.figures[id]`` exposes a small API (view, setView,
select, cellCenter) used by the browser tests and handy from the devtools console.
"""

JS = r"""
(function () {
"use strict";
var ML = 124, MT = 104, MR = 14, MB = 10, MAXPLOT = 760;
var api = { figures: {} };
window.attnlab = api;

function el(tag, cls, parent, text) {
  var e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function b64bytes(s) {
  s = s.trim();
  if (Uint8Array.fromBase64) return Uint8Array.fromBase64(s);
  var bin = atob(s), n = bin.length, out = new Uint8Array(n);
  for (var i = 0; i < n; i++) out[i] = bin.charCodeAt(i);
  return out;
}
function inflate(bytes) {
  var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Response(stream).arrayBuffer().then(function (b) { return new Uint8Array(b); });
}
function fmtW(v) {
  if (v === 0) return "0";
  if (v >= 0.001 && v < 1e4) return String(Number(v.toPrecision(3)));
  return v.toExponential(2);
}
function px(v) { return v >= 10 ? v.toFixed(0) : v.toFixed(1); }
function nice(n) { return n.toLocaleString("en-US"); }
function showTok(s) { return s.replace(/\n/g, "\u23ce").replace(/\r/g, "\u240d").replace(/\t/g, "\u21e5"); }
// a round step (1, 2, 5 x 10^k cells, at least 1) giving ~n ticks at least minPx apart
function niceStep(span, n, pxPerCell, minPx) {
  var raw = Math.max(span / n, minPx / pxPerCell, 1), mag = Math.pow(10, Math.floor(Math.log10(raw))), ms = [1, 2, 5, 10];
  for (var i = 0; i < ms.length; i++) if (raw <= ms[i] * mag) return ms[i] * mag;
  return 10 * mag;
}

function Heat(fig) {
  var self = this;
  this.fig = fig;
  this.cfg = JSON.parse(fig.querySelector("script.al-config").textContent);
  var c = this.cfg, LV = 254;
  this.blocks = fig.querySelectorAll("script.al-b64");
  this.data = new Array(c.heads.length);
  this.cur = 0;
  this.color = c.color; this.pool = c.pool;
  this.full = { q0: 0, q1: c.nq, k0: 0, k1: c.nk };
  this.view = { q0: 0, q1: c.nq, k0: 0, k1: c.nk };
  this.invLog = 1 / Math.log(1 / c.floor);
  // r = weight / top for each code; colour LUTs per colour mode
  this.r = new Float64Array(256);
  for (var k = 1; k < 256; k++) this.r[k] = Math.pow(c.floor, 1 - (k - 1) / LV);
  this.luts = {};
  var modes = ["linear", "sqrt", "log"];
  for (var m = 0; m < modes.length; m++) {
    var lut = new Uint8ClampedArray(1024);
    for (k = 0; k < 256; k++) {
      var t = k === 0 ? 0 : modes[m] === "linear" ? this.r[k] : modes[m] === "sqrt" ? Math.sqrt(this.r[k]) : 0.06 + 0.94 * (k - 1) / LV;
      var rgb = this.ramp(t);
      lut[4 * k] = rgb[0]; lut[4 * k + 1] = rgb[1]; lut[4 * k + 2] = rgb[2]; lut[4 * k + 3] = 255;
    }
    this.luts[modes[m]] = lut;
  }
  this.build();
  this.layout();
  this.render();
  var order = [];
  for (var i = 0; i < c.heads.length; i++) order.push(i);
  this.ready = order.reduce(function (p, i) {
    return p.then(function () { return self.decode(i); });
  }, Promise.resolve()).then(function () {
    self.render(); self.thumbs(); fig.setAttribute("data-ready", "1");
  }).catch(function (e) {
    self.status.textContent = "Could not decode the embedded data: " + e;
    fig.setAttribute("data-ready", "error");
  });
  api.figures[fig.id] = {
    view: function () { var v = self.view; return [v.q0, v.q1, v.k0, v.k1]; },
    setView: function (q0, q1, k0, k1) { self.setView({ q0: q0, q1: q1, k0: k0, k1: k1 }); },
    select: function (i) { self.select(i); },
    current: function () { return self.cur; },
    cellCenter: function (q, k) { return self.cellCenter(q, k); },
    ready: this.ready
  };
}

Heat.prototype.ramp = function (t) {
  var a = this.cfg.anchors, x = Math.min(1, Math.max(0, t)) * (a.length - 1);
  var i = Math.min(Math.floor(x), a.length - 2), f = x - i;
  return [0, 1, 2].map(function (j) { return Math.round(a[i][j] + (a[i + 1][j] - a[i][j]) * f); });
};

Heat.prototype.decode = function (i) {
  var self = this;
  if (this.data[i]) return Promise.resolve();
  return inflate(b64bytes(this.blocks[i].textContent)).then(function (d) {
    if (d.length !== self.cfg.nq * self.cfg.nk) throw new Error("head " + i + ": " + d.length + " bytes");
    self.data[i] = d;
    if (i === self.cur) self.render();
  });
};

Heat.prototype.build = function () {
  var self = this, c = this.cfg, app = this.fig.querySelector(".al-heat-app");
  var bar = el("div", "al-controls", app);
  function sel(label, cls, opts) {
    var lab = el("label", null, bar, label + " ");
    var s = el("select", cls, lab);
    opts.forEach(function (o) { var op = el("option", null, s, o[1]); op.value = o[0]; });
    return s;
  }
  var layers = c.layers.map(function (h, l) { return [String(l), String(l)]; });
  this.selL = sel("layer", "al-layer", layers);
  this.selH = sel("head", "al-head", []);
  this.selC = sel("colour", "al-color", [["linear", "linear"], ["sqrt", "√ weight"], ["log", "log"]]);
  this.selP = sel("pooling", "al-pool", [["max", "max"], ["mean", "mean"]]);
  this.selC.value = this.color; this.selP.value = this.pool;
  var reset = el("button", "al-reset", bar, "Reset zoom");
  reset.type = "button";
  this.fillHeads();
  this.selL.addEventListener("change", function () { self.fillHeads(); self.selectLH(+self.selL.value, +self.selH.value); });
  this.selH.addEventListener("change", function () { self.selectLH(+self.selL.value, +self.selH.value); });
  this.selC.addEventListener("change", function () { self.color = self.selC.value; self.render(); self.thumbs(); });
  this.selP.addEventListener("change", function () { self.pool = self.selP.value; self.render(); });
  reset.addEventListener("click", function () { self.setView(self.full); });
  var wrap = el("div", "al-canvas-wrap", app);
  this.canvas = el("canvas", "al-canvas", wrap);
  this.canvas.tabIndex = 0;
  this.canvas.setAttribute("role", "img");
  this.canvas.setAttribute("aria-label", this.fig.querySelector("figcaption").textContent);
  this.overlay = el("canvas", "al-overlay", wrap);
  this.tip = el("div", "al-tip", wrap);
  this.tip.hidden = true;
  this.cbar = el("canvas", "al-cbar", app);
  this.status = el("p", "al-status", app);
  el("p", "al-hint", app, "Drag a box to zoom in \u00b7 click the map, then scroll to zoom (or Ctrl+scroll) \u00b7 " +
    "arrow keys pan, + / \u2212 zoom \u00b7 double-click or Esc resets.");
  this.thumbBox = el("div", "al-thumbs", app);
  this.bind();
  var pending = false;
  window.addEventListener("resize", function () {
    if (pending) return;
    pending = true;
    requestAnimationFrame(function () { pending = false; self.layout(); self.render(); });
  });
};

Heat.prototype.fillHeads = function () {
  var c = this.cfg, l = +this.selL.value, s = this.selH;
  s.textContent = "";
  c.heads.forEach(function (hd) {
    if (hd.l !== l) return;
    var o = el("option", null, s, String(hd.h) + (hd.label ? " \u2014 " + hd.label : ""));
    o.value = String(hd.h);
  });
};

Heat.prototype.selectLH = function (l, h) {
  var c = this.cfg;
  for (var i = 0; i < c.heads.length; i++) if (c.heads[i].l === l && c.heads[i].h === h) return this.select(i);
};

Heat.prototype.select = function (i) {
  var hd = this.cfg.heads[i];
  this.cur = i;
  if (+this.selL.value !== hd.l) { this.selL.value = String(hd.l); this.fillHeads(); }
  this.selH.value = String(hd.h);
  var th = this.thumbBox.children;
  for (var j = 0; j < th.length; j++) th[j].classList.toggle("al-on", +th[j].dataset.i === i);
  this.render();
};

Heat.prototype.layout = function () {
  var c = this.cfg, app = this.fig.querySelector(".al-heat-app");
  var cw = Math.max(320, app.clientWidth || 800);
  this.pw = Math.max(160, Math.min(MAXPLOT, cw - ML - MR));
  // square cells where possible; short matrices get >= 14 px rows so their tokens show
  this.ph = Math.round(Math.min(MAXPLOT, Math.max(48, Math.min(c.nq * 14, 240), this.pw * c.nq / c.nk)));
  this.dpr = window.devicePixelRatio || 1;
  this.cssW = ML + this.pw + MR; this.cssH = MT + this.ph + MB;
  [this.canvas, this.overlay].forEach(function (cv) {
    cv.width = Math.round(this.cssW * this.dpr); cv.height = Math.round(this.cssH * this.dpr);
    cv.style.width = this.cssW + "px"; cv.style.height = this.cssH + "px";
  }, this);
  this.cbar.width = Math.round(340 * this.dpr); this.cbar.height = Math.round(38 * this.dpr);
  this.cbar.style.width = "340px"; this.cbar.style.height = "38px";
};

// pooled image of the view: one pixel per tile of tq x tk cells
Heat.prototype.image = function (d, v, tq, tk, pool) {
  var c = this.cfg, nkAll = c.nk, lut = this.luts[this.color];
  var iw = Math.ceil((v.k1 - v.k0) / tk), ih = Math.ceil((v.q1 - v.q0) / tq);
  var img = new ImageData(iw, ih), px = img.data, row = new Uint8Array(iw), sum = new Float64Array(iw);
  var r = this.r, floor = c.floor, inv = this.invLog;
  for (var oy = 0; oy < ih; oy++) {
    var qs = v.q0 + oy * tq, qe = Math.min(v.q1, qs + tq), ox, k, m, ks, ke;
    if (pool === "max" || (tq === 1 && tk === 1)) {
      row.fill(0);
      for (var q = qs; q < qe; q++) {
        var base = q * nkAll;
        for (ox = 0, ks = v.k0; ox < iw; ox++, ks += tk) {
          ke = Math.min(ks + tk, v.k1); m = row[ox];
          for (k = ks; k < ke; k++) { var cc = d[base + k]; if (cc > m) m = cc; }
          row[ox] = m;
        }
      }
    } else {
      sum.fill(0);
      for (q = qs; q < qe; q++) {
        base = q * nkAll;
        for (ox = 0, ks = v.k0; ox < iw; ox++, ks += tk) {
          ke = Math.min(ks + tk, v.k1); var s = 0;
          for (k = ks; k < ke; k++) s += r[d[base + k]];
          sum[ox] += s;
        }
      }
      for (ox = 0; ox < iw; ox++) {
        var cnt = (qe - qs) * (Math.min(v.k0 + (ox + 1) * tk, v.k1) - (v.k0 + ox * tk));
        var mean = sum[ox] / cnt;
        row[ox] = mean < floor ? 0 : Math.max(1, Math.min(255, 1 + Math.round(254 * (1 + Math.log(mean) * inv))));
      }
    }
    var o = oy * iw * 4;
    for (ox = 0; ox < iw; ox++, o += 4) {
      var L = row[ox] * 4;
      px[o] = lut[L]; px[o + 1] = lut[L + 1]; px[o + 2] = lut[L + 2]; px[o + 3] = 255;
    }
  }
  return img;
};

Heat.prototype.tiles = function (v, pw, ph) {
  var dpr = this.dpr;
  return [Math.max(1, Math.ceil((v.q1 - v.q0) / (ph * dpr))), Math.max(1, Math.ceil((v.k1 - v.k0) / (pw * dpr)))];
};

Heat.prototype.render = function () {
  var c = this.cfg, v = this.view, ctx = this.canvas.getContext("2d"), dpr = this.dpr;
  var pw = this.pw, ph = this.ph, nq = v.q1 - v.q0, nk = v.k1 - v.k0;
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, this.cssW, this.cssH);
  this.fig.setAttribute("data-view", [v.q0, v.q1, v.k0, v.k1].join(","));
  var hd = c.heads[this.cur], d = this.data[this.cur];
  var t = this.tiles(v, pw, ph), tq = t[0], tk = t[1];
  this.tq = tq; this.tk = tk;
  var cw = pw / nk, ch = ph / nq;
  if (!d) {
    ctx.fillStyle = "#6b7280"; ctx.font = "13px system-ui, sans-serif";
    ctx.fillText("decoding\u2026", ML + 10, MT + 20);
  } else {
    var img = this.image(d, v, tq, tk, this.pool);
    var off = this.off || (this.off = document.createElement("canvas"));
    off.width = img.width; off.height = img.height;
    off.getContext("2d").putImageData(img, 0, 0);
    ctx.save();
    ctx.beginPath(); ctx.rect(ML, MT, pw, ph); ctx.clip();
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, ML, MT, img.width * tk * cw, img.height * tq * ch);
    if (tq === 1 && tk === 1 && cw >= 12 && ch >= 12) this.cells(ctx, d, v, cw, ch, hd);
    ctx.restore();
  }
  ctx.strokeStyle = "#9ca3af"; ctx.lineWidth = 1;
  ctx.strokeRect(ML - 0.5, MT - 0.5, pw + 1, ph + 1);
  this.axes(ctx, v, cw, ch);
  this.colorbar(hd);
  var where = "query " + nice(v.q0) + "\u2013" + nice(v.q1 - 1) + " \u00d7 key " + nice(v.k0) + "\u2013" + nice(v.k1 - 1) +
    " (" + nice(nq) + " \u00d7 " + nice(nk) + " cells)";
  var how = (tq > 1 || tk > 1) ? (this.pool + "-pooled tiles of " + tq + " \u00d7 " + tk + " cells")
    : ("1 cell = " + px(cw) + (Math.abs(cw - ch) > 0.5 ? " \u00d7 " + px(ch) : "") + " px");
  this.status.textContent = "layer " + hd.l + " \u00b7 head " + hd.h + (hd.label ? " (" + hd.label + ")" : "") +
    " \u2014 " + where + " \u00b7 " + how + " \u00b7 colour: " + this.color +
    " \u00b7 weights quantized to 8 bits on a log scale (\u00b1" + (50 * (Math.pow(1 / c.floor, 1 / 254) - 1)).toFixed(1) + "%)";
};

Heat.prototype.cells = function (ctx, d, v, cw, ch, hd) {
  var nk = this.cfg.nk;
  ctx.strokeStyle = "rgba(255,255,255,0.9)"; ctx.lineWidth = 1;
  ctx.beginPath();
  for (var k = v.k0; k <= v.k1; k++) { var x = Math.round(ML + (k - v.k0) * cw) + 0.5; ctx.moveTo(x, MT); ctx.lineTo(x, MT + this.ph); }
  for (var q = v.q0; q <= v.q1; q++) { var y = Math.round(MT + (q - v.q0) * ch) + 0.5; ctx.moveTo(ML, y); ctx.lineTo(ML + this.pw, y); }
  ctx.stroke();
  if (cw < 34 || ch < 16) return;
  ctx.font = Math.min(12, Math.floor(ch * 0.5)) + "px system-ui, sans-serif";
  ctx.textAlign = "center"; ctx.textBaseline = "middle";
  for (q = v.q0; q < v.q1; q++) for (k = v.k0; k < v.k1; k++) {
    var code = d[q * nk + k];
    if (code === 0) continue;
    var w = hd.top * this.r[code], lum = this.lum(code);
    ctx.fillStyle = lum > 0.45 ? "#111" : "#fff";
    var s = w >= 0.01 ? w.toFixed(2) : w.toExponential(0);
    ctx.fillText(s, ML + (k - v.k0 + 0.5) * cw, MT + (q - v.q0 + 0.5) * ch);
  }
  ctx.textAlign = "left"; ctx.textBaseline = "alphabetic";
};

Heat.prototype.lum = function (code) {
  var l = this.luts[this.color], i = 4 * code;
  return (0.2126 * l[i] + 0.7152 * l[i + 1] + 0.0722 * l[i + 2]) / 255;
};

function fit(ctx, s, w) {
  s = showTok(s);
  if (ctx.measureText(s).width <= w) return s;
  var lo = 0, hi = s.length;
  while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (ctx.measureText(s.slice(0, mid) + "\u2026").width <= w) lo = mid; else hi = mid - 1; }
  return s.slice(0, lo) + "\u2026";
}

Heat.prototype.axes = function (ctx, v, cw, ch) {
  var c = this.cfg, nq = v.q1 - v.q0, nk = v.k1 - v.k0, i, step, p;
  ctx.fillStyle = "#374151"; ctx.strokeStyle = "#6b7280";
  ctx.font = "12px system-ui, sans-serif";
  if (ch >= 11) {
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (i = v.q0; i < v.q1; i++) ctx.fillText(fit(ctx, c.tq[i], ML - 12), ML - 6, MT + (i - v.q0 + 0.5) * ch);
  } else {
    step = niceStep(nq, 6, ch, 18); ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (p = Math.ceil(v.q0 / step) * step; p < v.q1; p += step) {
      var y = MT + (p - v.q0 + 0.5) * ch;
      ctx.fillText(nice(p), ML - 9, y); ctx.beginPath(); ctx.moveTo(ML - 5, y); ctx.lineTo(ML, y); ctx.stroke();
    }
  }
  if (cw >= 11) {
    ctx.textAlign = "left"; ctx.textBaseline = "middle";
    for (i = v.k0; i < v.k1; i++) {
      ctx.save(); ctx.translate(ML + (i - v.k0 + 0.5) * cw, MT - 6); ctx.rotate(-Math.PI / 2);
      ctx.fillText(fit(ctx, c.tk[i], MT - 28), 0, 0); ctx.restore();
    }
  } else {
    step = niceStep(nk, 6, cw, ctx.measureText(nice(v.k1)).width + 14); ctx.textAlign = "center"; ctx.textBaseline = "bottom";
    for (p = Math.ceil(v.k0 / step) * step; p < v.k1; p += step) {
      var x = ML + (p - v.k0 + 0.5) * cw;
      ctx.fillText(nice(p), x, MT - 8); ctx.beginPath(); ctx.moveTo(x, MT - 5); ctx.lineTo(x, MT); ctx.stroke();
    }
  }
  ctx.textAlign = "left"; ctx.textBaseline = "alphabetic";
  ctx.font = "600 12px system-ui, sans-serif"; ctx.fillStyle = "#1f2937";
  ctx.fillText("key \u2192", 8, 16);
  ctx.fillText("query \u2193", 8, 34);
};

Heat.prototype.colorbar = function (hd) {
  var c = this.cfg, cv = this.cbar, ctx = cv.getContext("2d"), dpr = this.dpr, W = 300, x0 = 20;
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, 340, 38);
  var lut = this.luts[this.color];
  for (var i = 0; i < W; i++) {
    var best = Math.round(i / (W - 1) * 255);
    if (this.color !== "log") {
      var target = i / (W - 1);
      if (this.color === "sqrt") target = target * target;
      best = target < c.floor ? 0 : Math.max(1, Math.min(255, 1 + Math.round(254 * (1 + Math.log(target) * this.invLog))));
    }
    ctx.fillStyle = "rgb(" + lut[4 * best] + "," + lut[4 * best + 1] + "," + lut[4 * best + 2] + ")";
    ctx.fillRect(x0 + i, 2, 1.5, 12);
  }
  ctx.strokeStyle = "#9ca3af"; ctx.strokeRect(x0 - 0.5, 1.5, W + 1, 13);
  ctx.fillStyle = "#374151"; ctx.font = "11px system-ui, sans-serif"; ctx.textAlign = "center";
  var top = hd.top, ticks = [];
  if (top === 0) ticks.push([0, "0 (all weights are 0)"]);
  else if (this.color === "log") {
    var lo = Math.log10(top * c.floor), hi = Math.log10(top);
    var stride = Math.max(1, Math.ceil((hi - lo) / 6));
    for (var e = Math.ceil(lo); e <= Math.floor(hi); e += stride) ticks.push([(1 + 254 * (e - lo) / (hi - lo)) / 255, "1e" + e]);
  } else {
    [0, 0.25, 0.5, 0.75, 1].forEach(function (pos) {  // evenly spaced on the bar
      var w = (this.color === "sqrt" ? pos * pos : pos) * top;
      ticks.push([pos, w === 0 ? "0" : Number(w.toPrecision(2)).toString().replace(/e-(\d)$/, "e-$1")]);
    }, this);
  }
  ctx.textAlign = top === 0 ? "left" : "center";
  ticks.forEach(function (tk) { ctx.fillText(tk[1], x0 + tk[0] * W, 30); });
};

Heat.prototype.cellAt = function (x, y) {
  var v = this.view;
  if (x < ML || y < MT || x >= ML + this.pw || y >= MT + this.ph) return null;
  var q = v.q0 + Math.floor((y - MT) / this.ph * (v.q1 - v.q0));
  var k = v.k0 + Math.floor((x - ML) / this.pw * (v.k1 - v.k0));
  return [Math.min(q, v.q1 - 1), Math.min(k, v.k1 - 1)];
};

Heat.prototype.cellCenter = function (q, k) {
  var v = this.view, r = this.canvas.getBoundingClientRect();
  return { x: r.left + ML + (k - v.k0 + 0.5) * this.pw / (v.k1 - v.k0),
           y: r.top + MT + (q - v.q0 + 0.5) * this.ph / (v.q1 - v.q0) };
};

Heat.prototype.hover = function (x, y) {
  var cell = this.cellAt(x, y), tip = this.tip, c = this.cfg, d = this.data[this.cur];
  var octx = this.overlay.getContext("2d");
  octx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0); octx.clearRect(0, 0, this.cssW, this.cssH);
  if (!cell || !d) { tip.hidden = true; return; }
  var v = this.view, tq = this.tq, tk = this.tk, hd = c.heads[this.cur];
  // the tile under the cursor (a single cell when not pooled)
  var qs = v.q0 + Math.floor((cell[0] - v.q0) / tq) * tq, ks = v.k0 + Math.floor((cell[1] - v.k0) / tk) * tk;
  var qe = Math.min(qs + tq, v.q1), ke = Math.min(ks + tk, v.k1), bq = qs, bk = ks, best = -1, sum = 0;
  for (var q = qs; q < qe; q++) for (var k = ks; k < ke; k++) {
    var code = d[q * c.nk + k]; sum += this.r[code];
    if (code > best) { best = code; bq = q; bk = k; }
  }
  var cw = this.pw / (v.k1 - v.k0), ch = this.ph / (v.q1 - v.q0);
  octx.strokeStyle = "#D55E00"; octx.lineWidth = 2;
  octx.strokeRect(ML + (ks - v.k0) * cw, MT + (qs - v.q0) * ch, Math.max(2, (ke - ks) * cw), Math.max(2, (qe - qs) * ch));
  tip.textContent = "";
  el("div", "al-tip-head", tip, "layer " + hd.l + " \u00b7 head " + hd.h + (hd.label ? " (" + hd.label + ")" : ""));
  if (qe - qs > 1 || ke - ks > 1) {
    el("div", "al-tip-tile", tip, "tile: query " + qs + "\u2013" + (qe - 1) + " \u00d7 key " + ks + "\u2013" + (ke - 1) +
      " \u00b7 mean \u2248 " + fmtW(hd.top * sum / ((qe - qs) * (ke - ks))) + " \u00b7 max at:");
  }
  function line(name, i, s) {
    var row = el("div", "al-tip-row", tip);
    el("span", "al-tip-k", row, name + " " + i);
    el("span", "al-tok", row, showTok(s));
  }
  line("query", bq, c.tq[bq]);
  line("key", bk, c.tk[bk]);
  var w = best === 0 ? (hd.top === 0 ? "0" : "< " + fmtW(hd.top * c.floor)) : "\u2248 " + fmtW(hd.top * this.r[best]);
  el("div", "al-tip-w", tip, "weight " + w);
  tip.hidden = false;
  var tx = x + 16, ty = y + 16;
  if (tx + tip.offsetWidth > this.cssW) tx = Math.max(0, x - tip.offsetWidth - 12);
  if (ty + tip.offsetHeight > this.cssH) ty = Math.max(0, y - tip.offsetHeight - 12);
  tip.style.left = tx + "px"; tip.style.top = ty + "px";
};

Heat.prototype.setView = function (v) {
  var f = this.full;
  var nq = Math.max(1, Math.min(f.q1, Math.round(v.q1 - v.q0))), nk = Math.max(1, Math.min(f.k1, Math.round(v.k1 - v.k0)));
  var q0 = Math.max(0, Math.min(f.q1 - nq, Math.round(v.q0))), k0 = Math.max(0, Math.min(f.k1 - nk, Math.round(v.k0)));
  this.view = { q0: q0, q1: q0 + nq, k0: k0, k1: k0 + nk };
  this.tip.hidden = true;
  this.render();
};

Heat.prototype.zoom = function (factor, fx, fy) {
  // fx, fy: the anchor as a fraction of the plot; the cell under it stays put
  var v = this.view, nq = v.q1 - v.q0, nk = v.k1 - v.k0;
  function size(n, full) {
    var m = Math.round(n * factor);
    if (factor < 1) m = Math.min(m, n - 1); else m = Math.max(m, n + 1);
    return Math.max(Math.min(2, full), Math.min(full, m));
  }
  var mq = size(nq, this.full.q1), mk = size(nk, this.full.k1);
  this.setView({ q0: v.q0 + fy * nq - fy * mq, q1: v.q0 + fy * nq - fy * mq + mq,
                 k0: v.k0 + fx * nk - fx * mk, k1: v.k0 + fx * nk - fx * mk + mk });
};

Heat.prototype.bind = function () {
  var self = this, cv = this.overlay, drag = null;
  function pos(e) { var r = cv.getBoundingClientRect(); return [e.clientX - r.left, e.clientY - r.top]; }
  cv.addEventListener("mousemove", function (e) {
    var p = pos(e);
    if (drag) {
      drag.x1 = p[0]; drag.y1 = p[1];
      var o = cv.getContext("2d");
      o.setTransform(self.dpr, 0, 0, self.dpr, 0, 0); o.clearRect(0, 0, self.cssW, self.cssH);
      o.fillStyle = "rgba(0,114,178,0.12)"; o.strokeStyle = "#0072B2"; o.lineWidth = 1.5;
      o.fillRect(drag.x0, drag.y0, p[0] - drag.x0, p[1] - drag.y0);
      o.strokeRect(drag.x0, drag.y0, p[0] - drag.x0, p[1] - drag.y0);
      self.tip.hidden = true;
      return;
    }
    self.hover(p[0], p[1]);
  });
  cv.addEventListener("mouseleave", function () { if (!drag) self.hover(-1, -1); });
  cv.addEventListener("mousedown", function (e) {
    if (e.button !== 0) return;
    self.canvas.focus({ preventScroll: true });
    var p = pos(e);
    if (self.cellAt(p[0], p[1])) drag = { x0: p[0], y0: p[1], x1: p[0], y1: p[1] };
    e.preventDefault();
  });
  window.addEventListener("mouseup", function () {
    if (!drag) return;
    var d = drag; drag = null;
    if (Math.abs(d.x1 - d.x0) < 5 && Math.abs(d.y1 - d.y0) < 5) { self.hover(d.x1, d.y1); return; }
    var clamp = function (x, y) { return self.cellAt(Math.min(Math.max(x, ML), ML + self.pw - 0.01), Math.min(Math.max(y, MT), MT + self.ph - 0.01)); };
    var a = clamp(Math.min(d.x0, d.x1), Math.min(d.y0, d.y1)), b = clamp(Math.max(d.x0, d.x1), Math.max(d.y0, d.y1));
    var nq = b[0] - a[0] + 1, nk = b[1] - a[1] + 1, v = self.view;
    // keep the view's aspect (so cells keep their shape): grow the short side of the box
    var R = (v.k1 - v.k0) / (v.q1 - v.q0);
    var tq = nq, tkk = nk;
    if (nk / nq < R) tkk = Math.max(nk, Math.round(nq * R)); else tq = Math.max(nq, Math.round(nk / R));
    var cq = (a[0] + b[0] + 1) / 2, ck = (a[1] + b[1] + 1) / 2;
    self.setView({ q0: cq - tq / 2, q1: cq + tq / 2, k0: ck - tkk / 2, k1: ck + tkk / 2 });
  });
  cv.addEventListener("dblclick", function () { self.setView(self.full); });
  cv.addEventListener("wheel", function (e) {
    if (!(e.ctrlKey || document.activeElement === self.canvas)) return;
    var p = pos(e), fx = (p[0] - ML) / self.pw, fy = (p[1] - MT) / self.ph;
    if (fx < 0 || fy < 0 || fx > 1 || fy > 1) return;
    e.preventDefault();
    self.zoom(Math.exp(Math.max(-300, Math.min(300, e.deltaY)) * 0.002), fx, fy);
    self.hover(p[0], p[1]);
  }, { passive: false });
  this.canvas.addEventListener("keydown", function (e) {
    var v = self.view, dq = Math.max(1, Math.round((v.q1 - v.q0) / 10)), dk = Math.max(1, Math.round((v.k1 - v.k0) / 10));
    var mv = { ArrowUp: [-dq, 0], ArrowDown: [dq, 0], ArrowLeft: [0, -dk], ArrowRight: [0, dk] }[e.key];
    if (mv) self.setView({ q0: v.q0 + mv[0], q1: v.q1 + mv[0], k0: v.k0 + mv[1], k1: v.k1 + mv[1] });
    else if (e.key === "+" || e.key === "=") self.zoom(0.7, 0.5, 0.5);
    else if (e.key === "-" || e.key === "_") self.zoom(1 / 0.7, 0.5, 0.5);
    else if (e.key === "Escape" || e.key === "0") self.setView(self.full);
    else return;
    e.preventDefault();
  });
};

Heat.prototype.thumbs = function () {
  var c = this.cfg, self = this, box = this.thumbBox;
  if (c.heads.length < 2 || c.heads.length > 256) return;
  var side = 76, tw = side, th = Math.max(12, Math.round(side * Math.min(1, c.nq / c.nk)));
  if (!box.children.length) {
    c.heads.forEach(function (hd, i) {
      var b = el("button", "al-thumb", box);
      b.type = "button"; b.dataset.i = String(i);
      b.title = "layer " + hd.l + ", head " + hd.h + (hd.label ? ": " + hd.label : "");
      var cv = el("canvas", null, b);
      cv.width = tw; cv.height = th; cv.style.width = tw + "px"; cv.style.height = th + "px";
      el("span", null, b, "L" + hd.l + " H" + hd.h);
      b.addEventListener("click", function () { self.select(i); });
    });
    box.style.setProperty("--cols", String(Math.max.apply(null, c.layers)));
  }
  c.heads.forEach(function (hd, i) {
    var b = box.children[i], d = self.data[i];
    b.classList.toggle("al-on", i === self.cur);
    if (!d) return;
    var cv = b.querySelector("canvas"), f = self.full;
    var tq = Math.ceil(c.nq / cv.height), tk = Math.ceil(c.nk / cv.width);
    var img = self.image(d, f, tq, tk, "max"), off = document.createElement("canvas");
    off.width = img.width; off.height = img.height; off.getContext("2d").putImageData(img, 0, 0);
    var ctx = cv.getContext("2d"); ctx.imageSmoothingEnabled = false;
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, cv.width, cv.height);
    ctx.drawImage(off, 0, 0, img.width * tk * cv.width / c.nk, img.height * tq * cv.height / c.nq);
  });
};

function init() {
  var figs = document.querySelectorAll("figure.al-heat");
  var all = [];
  if (typeof DecompressionStream === "undefined") {
    figs.forEach(function (f) {
      el("p", "al-note", f.querySelector(".al-heat-app"), "This browser lacks DecompressionStream; open the report in a current Chrome, Firefox or Safari.");
    });
    return;
  }
  figs.forEach(function (f) { all.push(new Heat(f).ready); });
  api.ready = Promise.all(all);
}
if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init); else init();
})();
"""
