"""The token-to-token / head view: plain JavaScript, inlined once per report that has one.

Canvas 2-D only, no library.  Token text is drawn with ``fillText`` and set with
``textContent``, never parsed as HTML.  ``window.attnlab.views[id]`` exposes ``select``,
``state``, ``tokenCenter`` and ``focus`` (browser tests; handy from the devtools console).
"""

JS = r"""
(function () {
"use strict";
var ROW = 18, TOP = 8, COLW = 190, GAP = 300, FONT = "13px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";
var api = window.attnlab = window.attnlab || {};
api.views = api.views || {};

function el(tag, cls, parent, text) {
  var e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function bytes(s) {
  s = s.trim();
  var bin = atob(s), n = bin.length, out = new Uint8Array(n);
  for (var i = 0; i < n; i++) out[i] = bin.charCodeAt(i);
  return out;
}
function showTok(s) { return s.replace(/\n/g, "\u23ce").replace(/\r/g, "\u240d").replace(/\t/g, "\u21e5"); }
function clip(ctx, s, w) {
  if (ctx.measureText(s).width <= w) return s;
  while (s.length > 1 && ctx.measureText(s + "\u2026").width > w) s = s.slice(0, -1);
  return s + "\u2026";
}

function View(fig) {
  var self = this, c = this.cfg = JSON.parse(fig.querySelector("script.al-tv-config").textContent);
  this.fig = fig;
  this.data = Array.prototype.map.call(fig.querySelectorAll("script.al-tv-b64"), function (b) { return bytes(b.textContent); });
  this.layer = c.layer; this.head = c.head; this.focusOn = null; this.lines = 0;
  var app = fig.querySelector(".al-tv-app");
  var ctl = el("div", "al-controls", app);
  el("label", null, ctl, "layer ");
  this.selL = el("select", "al-tv-layer", ctl);
  c.layers.forEach(function (_, l) { var o = el("option", null, self.selL, "layer " + l); o.value = String(l); });
  el("label", null, ctl, " head ");
  this.selH = el("select", "al-tv-head", ctl);
  this.selL.addEventListener("change", function () { self.select(+self.selL.value, "all"); });
  this.selH.addEventListener("change", function () {
    self.select(self.layer, self.selH.value === "all" ? "all" : +self.selH.value);
  });
  this.legend = el("div", "al-tv-legend", app);
  var wrap = el("div", "al-tv-wrap", app);
  this.canvas = el("canvas", "al-tv-canvas", wrap);
  this.tip = el("div", "al-tip", wrap); this.tip.style.display = "none";
  this.status = el("div", "al-status", app);
  var n = Math.max(c.nq, c.nk), dpr = window.devicePixelRatio || 1;
  this.W = COLW * 2 + GAP; this.H = TOP * 2 + n * ROW;
  this.canvas.width = Math.round(this.W * dpr); this.canvas.height = Math.round(this.H * dpr);
  this.canvas.style.width = this.W + "px"; this.canvas.style.height = this.H + "px";
  this.ctx = this.canvas.getContext("2d"); this.ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  this.canvas.addEventListener("mousemove", function (e) {
    var r = self.canvas.getBoundingClientRect(), x = e.clientX - r.left, y = e.clientY - r.top;
    var side = x < self.W / 2 ? "q" : "k", i = Math.floor((y - TOP) / ROW), lim = side === "q" ? c.nq : c.nk;
    if (i < 0 || i >= lim) { self.focus(null); return; }
    self.focus(side, i);
    self.tip.style.left = Math.min(x + 14, self.W - 220) + "px"; self.tip.style.top = (y + 12) + "px";
  });
  this.canvas.addEventListener("mouseleave", function () { self.focus(null); });
  this.select(this.layer, this.head);
  fig.dataset.ready = "1";
  api.views[fig.id] = this;
}

View.prototype.index = function (l, h) {
  var c = this.cfg, i = 0;
  for (var a = 0; a < l; a++) i += c.layers[a];
  return i + h;
};
View.prototype.w = function (h, i, j) { return this.data[this.index(this.layer, h)][i * this.cfg.nk + j] / 255; };
View.prototype.shown = function () {
  var H = this.cfg.layers[this.layer], out = [];
  for (var h = 0; h < H; h++) if (this.head === "all" || this.head === h) out.push(h);
  return out;
};
View.prototype.select = function (layer, head) {
  var self = this, c = this.cfg;
  this.layer = layer; this.head = head; this.focusOn = null;
  this.selL.value = String(layer);
  while (this.selH.firstChild) this.selH.removeChild(this.selH.firstChild);
  var o = el("option", null, this.selH, "all heads"); o.value = "all";
  for (var h = 0; h < c.layers[layer]; h++) {
    var lab = c.heads[this.index(layer, h)].label;
    o = el("option", null, this.selH, "head " + h + (lab ? " \u00b7 " + lab : "")); o.value = String(h);
  }
  this.selH.value = String(head);
  while (this.legend.firstChild) this.legend.removeChild(this.legend.firstChild);
  this.shown().forEach(function (h) {
    var s = el("span", "al-tv-key", self.legend, "head " + h);
    s.style.borderLeftColor = c.colors[h % c.colors.length];
  });
  this.draw();
};
View.prototype.focus = function (side, i) {
  var f = side === null || side === undefined ? null : { side: side, i: i };
  var same = (f === null && this.focusOn === null) || (f && this.focusOn && f.side === this.focusOn.side && f.i === this.focusOn.i);
  this.focusOn = f;
  if (!same) this.draw();
  this.showTip();
};
View.prototype.yq = function (i) { return TOP + i * ROW + ROW / 2; };
View.prototype.draw = function () {
  var c = this.cfg, ctx = this.ctx, self = this, f = this.focusOn, x0 = COLW, x1 = COLW + GAP;
  ctx.clearRect(0, 0, this.W, this.H);
  ctx.lineWidth = 2; this.lines = 0;
  this.shown().forEach(function (h) {
    ctx.strokeStyle = c.colors[h % c.colors.length];
    for (var i = 0; i < c.nq; i++) {
      if (f && f.side === "q" && f.i !== i) continue;
      for (var j = 0; j < c.nk; j++) {
        if (f && f.side === "k" && f.i !== j) continue;
        var w = self.w(h, i, j);
        if (w < 0.01) continue;
        ctx.globalAlpha = Math.min(1, w);
        ctx.beginPath(); ctx.moveTo(x0, self.yq(i)); ctx.lineTo(x1, self.yq(j)); ctx.stroke();
        self.lines++;
      }
    }
  });
  ctx.globalAlpha = 1; ctx.font = FONT; ctx.textBaseline = "middle";
  function col(toks, side, x, align) {
    ctx.textAlign = align;
    for (var i = 0; i < toks.length; i++) {
      var on = f && f.side === side && f.i === i;
      if (on) { ctx.fillStyle = "#e0e7ff"; ctx.fillRect(align === "right" ? 0 : x1, TOP + i * ROW, COLW, ROW); }
      ctx.fillStyle = on ? "#1e3a8a" : "#0f172a";
      ctx.fillText(clip(ctx, showTok(toks[i]), COLW - 12), x, self.yq(i));
    }
  }
  col(c.tq, "q", x0 - 8, "right"); col(c.tk, "k", x1 + 8, "left");
  var what = this.head === "all" ? "all " + c.layers[this.layer] + " heads" : "head " + this.head;
  this.status.textContent = "layer " + this.layer + ", " + what + " \u00b7 " + c.nq + " queries (left) \u2192 " + c.nk +
    " keys (right) \u00b7 line opacity = attention weight (lines under 0.01 hidden) \u00b7 hover a token to isolate it";
};
View.prototype.partners = function () {
  var f = this.focusOn, c = this.cfg, self = this, out = [];
  if (!f) return out;
  this.shown().forEach(function (h) {
    var n = f.side === "q" ? c.nk : c.nq;
    for (var j = 0; j < n; j++) {
      var w = f.side === "q" ? self.w(h, f.i, j) : self.w(h, j, f.i);
      if (w > 0) out.push({ h: h, j: j, w: w });
    }
  });
  out.sort(function (a, b) { return b.w - a.w; });
  return out.slice(0, 6);
};
View.prototype.showTip = function () {
  var f = this.focusOn, c = this.cfg, t = this.tip;
  while (t.firstChild) t.removeChild(t.firstChild);
  if (!f) { t.style.display = "none"; return; }
  t.style.display = "block";
  var me = f.side === "q" ? c.tq[f.i] : c.tk[f.i];
  el("div", "al-tip-head", t, (f.side === "q" ? "query " : "key ") + f.i + (f.side === "q" ? " attends to" : " is attended by"));
  el("div", "al-tip-tok", t, showTok(me));
  this.partners().forEach(function (p) {
    var r = el("div", "al-tip-row", t);
    el("span", "al-tip-k", r, (f.side === "q" ? "key " : "query ") + p.j + (c.layers.length && p.h !== undefined ? " h" + p.h : ""));
    el("span", null, r, showTok(f.side === "q" ? c.tk[p.j] : c.tq[p.j]));
    el("span", "al-tip-w", r, p.w.toFixed(3));
  });
};
View.prototype.state = function () {
  return { layer: this.layer, head: this.head, focus: this.focusOn, lines: this.lines, tip: this.tip.textContent };
};
View.prototype.tokenCenter = function (side, i) {
  var r = this.canvas.getBoundingClientRect();
  return { x: r.left + (side === "q" ? COLW / 2 : COLW + GAP + COLW / 2), y: r.top + this.yq(i) };
};

function init() {
  document.querySelectorAll("figure.al-tv").forEach(function (f) {
    try { new View(f); } catch (e) { f.dataset.ready = "error"; throw e; }
  });
}
if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init); else init();
})();
"""
