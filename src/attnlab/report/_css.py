"""The report's stylesheet (light theme), inlined into every page."""

CSS = r"""
:root { --fg: #1f2937; --muted: #6b7280; --line: #e5e7eb; --panel: #f8fafc; --accent: #0072B2; }
* { box-sizing: border-box; }
html { background: #f3f4f6; }
body { margin: 0; color: var(--fg); font: 15px/1.6 system-ui, -apple-system, "Segoe UI", Roboto, "Noto Sans",
       "Helvetica Neue", Arial, sans-serif; -webkit-font-smoothing: antialiased; }
.al-header, main, .al-toc, .al-footer { max-width: 1120px; margin: 0 auto; padding: 0 28px; }
.al-header { padding-top: 36px; padding-bottom: 6px; }
h1 { font-size: 30px; line-height: 1.25; margin: 0 0 6px; letter-spacing: -0.01em; }
.al-sub { color: var(--muted); margin: 0; font-size: 16px; }
.al-toc { margin-top: 14px; font-size: 14px; }
.al-toc ol { margin: 0; padding: 0; list-style: none; display: flex; flex-wrap: wrap; gap: 6px 8px; }
.al-toc a { display: inline-block; padding: 3px 12px; border: 1px solid var(--line); border-radius: 999px;
            background: #fff; color: var(--fg); text-decoration: none; }
.al-toc a:hover { border-color: var(--accent); color: var(--accent); }
.al-section { background: #fff; border: 1px solid var(--line); border-radius: 12px; margin: 22px 0;
              padding: 6px 32px 26px; box-shadow: 0 1px 2px rgba(0,0,0,0.04); }
h2 { font-size: 22px; line-height: 1.3; margin: 20px 0 10px; padding-bottom: 8px; border-bottom: 1px solid var(--line); }
p { margin: 10px 0; max-width: 80ch; }
code { font: 0.9em ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace; background: #f1f5f9;
       padding: 1px 5px; border-radius: 4px; }
.al-fig { margin: 26px 0 10px; }
.al-fig > figcaption { font-weight: 600; font-size: 16px; margin: 0 0 10px; }
.al-table-wrap { overflow-x: auto; margin: 14px 0; }
.al-table { border-collapse: collapse; font-size: 14px; font-variant-numeric: tabular-nums; }
.al-table caption { caption-side: top; text-align: left; font-weight: 600; font-size: 15px; padding: 0 0 8px; }
.al-table th, .al-table td { padding: 6px 14px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
.al-table thead th { background: var(--panel); border-bottom: 2px solid #cbd5e1; font-weight: 600; white-space: nowrap; }
.al-table tbody tr:nth-child(even) td:not([style]) { background: #fafbfc; }
.al-table .al-num { text-align: right; white-space: nowrap; }
.al-empty { background: transparent; }
.al-grid { border-collapse: separate; border-spacing: 2px; font-variant-numeric: tabular-nums; }
.al-grid td { min-width: 3.4em; padding: 5px 6px; text-align: center; font-size: 12.5px; border-radius: 3px; }
.al-grid th { font-weight: 500; color: var(--muted); font-size: 12px; padding: 2px 8px; white-space: nowrap; }
.al-grid thead th { text-align: center; }
.al-grid tbody th { text-align: right; }
.al-nan { background: #f3f4f6; color: var(--muted); }
.al-legend-bar { display: flex; align-items: center; gap: 8px; font-size: 12px; color: var(--muted); margin-top: 6px; }
.al-bar { display: inline-block; width: 220px; height: 10px; border-radius: 2px; border: 1px solid #d1d5db; }
.al-plot { display: block; width: 100%; max-width: 760px; height: auto; overflow: visible; }
.al-plot text { font: 12px system-ui, -apple-system, "Segoe UI", Roboto, "Noto Sans", Arial, sans-serif; fill: #374151; }
.al-plot .al-axis-label { font-size: 13px; font-weight: 600; fill: #1f2937; }
.al-plot .al-value { font-size: 11px; fill: #1f2937; }
.al-grid-lines line { stroke: #e5e7eb; stroke-width: 1; }
.al-grid-lines .al-minor { stroke: #f3f4f6; }
.al-axis { stroke: #6b7280; stroke-width: 1; fill: none; }
.al-zero { stroke: #374151; stroke-width: 1; }
.al-line { fill: none; stroke-width: 2; stroke-linejoin: round; stroke-linecap: round; }
.al-heat-app { position: relative; }
.al-controls { display: flex; flex-wrap: wrap; gap: 8px 18px; align-items: center; font-size: 14px; margin: 0 0 10px; }
.al-controls label { color: var(--muted); }
.al-controls select, .al-controls button { font: inherit; font-size: 14px; color: var(--fg); padding: 3px 8px;
       border: 1px solid #cbd5e1; border-radius: 6px; background: #fff; }
.al-controls button { cursor: pointer; }
.al-controls button:hover, .al-controls select:hover { border-color: var(--accent); }
.al-canvas-wrap { position: relative; display: inline-block; max-width: 100%; }
.al-canvas { display: block; outline: none; border-radius: 4px; }
.al-canvas:focus-visible { box-shadow: 0 0 0 2px var(--accent); }
.al-overlay { position: absolute; left: 0; top: 0; cursor: crosshair; }
.al-tip { position: absolute; z-index: 2; pointer-events: none; background: #fff; border: 1px solid #cbd5e1;
          border-radius: 8px; box-shadow: 0 4px 14px rgba(0,0,0,0.12); padding: 8px 10px; font-size: 13px;
          line-height: 1.45; max-width: 360px; }
.al-tip-head { color: var(--muted); font-size: 12px; }
.al-tip-tile { color: var(--muted); font-size: 12px; }
.al-tip-row { display: flex; gap: 8px; align-items: baseline; }
.al-tip-k { color: var(--muted); min-width: 5.5em; font-variant-numeric: tabular-nums; }
.al-tok { background: #eef2ff; border-radius: 3px; padding: 0 4px; white-space: pre-wrap; word-break: break-all; }
.al-tip-w { font-weight: 600; margin-top: 2px; }
.al-cbar { display: block; margin: 8px 0 0 104px; }
.al-status { font-size: 13px; color: #374151; margin: 4px 0 0; max-width: none; font-variant-numeric: tabular-nums; }
.al-hint, .al-note { font-size: 12.5px; color: var(--muted); margin: 2px 0 0; max-width: none; }
.al-thumbs { display: grid; grid-template-columns: repeat(var(--cols, 12), max-content); gap: 6px; margin-top: 14px;
             overflow-x: auto; padding-bottom: 4px; }
.al-thumb { border: 1px solid var(--line); background: #fff; border-radius: 6px; padding: 3px; cursor: pointer;
            display: flex; flex-direction: column; align-items: center; gap: 2px; font: 11px system-ui, sans-serif;
            color: var(--muted); }
.al-thumb canvas { display: block; image-rendering: pixelated; }
.al-thumb:hover { border-color: var(--accent); }
.al-thumb.al-on { border-color: #D55E00; box-shadow: 0 0 0 1px #D55E00; color: var(--fg); }
.al-fallback { display: block; width: min(100%, 512px); image-rendering: pixelated; border: 1px solid var(--line); }
.al-tv-wrap { position: relative; overflow-x: auto; margin-top: 6px; }
.al-tv-canvas { display: block; }
.al-tv-legend { display: flex; flex-wrap: wrap; gap: 4px 12px; margin-top: 6px; font-size: 12.5px; color: var(--muted); }
.al-tv-key { border-left: 12px solid #999; padding-left: 4px; }
.al-tip-tok { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: pre; }
.al-footer { color: var(--muted); font-size: 12.5px; padding-top: 8px; padding-bottom: 40px; }
@media print { html { background: #fff; } .al-section { box-shadow: none; break-inside: avoid-page; } }
"""
