"""HTML building blocks: escaping, the tiny inline markup, JSON for script blocks, the page.

Everything that comes from a model or a user (titles, token text, table cells, legend
names) passes through :func:`esc` before it is placed in HTML, and through
:func:`json_for_script` before it is placed inside a ``<script type="application/json">``
data block.  The page carries a Content-Security-Policy that allows only the report's own
inline scripts (by SHA-256 hash), inline styles and ``data:`` images: nothing is fetched,
and a script smuggled into the page would not run even if escaping ever failed.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re

__all__ = ["esc", "inline_markup", "json_for_script", "slug", "page"]

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _clean(s: str) -> str:
    """Replace lone surrogates and C0 control characters (invalid in HTML text) with U+FFFD."""
    s = s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return _CONTROL.sub("\ufffd", s)


def esc(value) -> str:
    """Escape any value as HTML text or a quoted attribute value.

    >>> esc('<script>alert("x")</script> & \\'q\\'')
    '&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#x27;q&#x27;'
    """
    return html.escape(_clean(str(value)), quote=True)


_CODE = re.compile(r"`([^`\n]+)`")
_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*")


def inline_markup(text: str) -> str:
    """Escape ``text``, then turn ```code``` and ``**bold**`` into ``<code>``/``<strong>``.

    Escaping happens first, so markup can never produce a tag the text did not ask for.

    >>> inline_markup("**bold** and `a<b` <i>")
    '<strong>bold</strong> and <code>a&lt;b</code> &lt;i&gt;'
    """
    out = []
    pos = 0
    s = esc(text)
    for m in _CODE.finditer(s):
        out.append(_BOLD.sub(r"<strong>\1</strong>", s[pos : m.start()]))
        out.append(f"<code>{m.group(1)}</code>")
        pos = m.end()
    out.append(_BOLD.sub(r"<strong>\1</strong>", s[pos:]))
    return "".join(out)


def json_for_script(obj) -> str:
    """JSON that is safe inside ``<script type="application/json">``: no ``<``, ``>``, ``&``.

    ``ensure_ascii`` also turns lone surrogates and U+2028/9 into escapes.

    >>> json_for_script(["</script>", "&"])
    '["\\\\u003c/script\\\\u003e", "\\\\u0026"]'
    """
    s = json.dumps(obj, ensure_ascii=True, allow_nan=False)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def slug(text: str, taken: set[str]) -> str:
    """A unique, ASCII-only element id derived from ``text``."""
    base = re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-")[:40] or "s"
    cand, n = base, 2
    while cand in taken:
        cand, n = f"{base}-{n}", n + 1
    taken.add(cand)
    return cand


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode() + "'"


def page(*, title: str, subtitle: str | None, toc: str, body: str, css: str, scripts: list[str], generator: str) -> str:
    """The whole document.  ``scripts`` are inline JavaScript sources (trusted, ours)."""
    script_src = " ".join(_sha256(s) for s in scripts) or "'none'"
    csp = (
        f"default-src 'none'; script-src {script_src}; style-src 'unsafe-inline'; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    )
    sub = f'\n<p class="al-sub">{inline_markup(subtitle)}</p>' if subtitle else ""
    tags = "".join(f"\n<script>{s}</script>" for s in scripts)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{esc(csp)}">\n'
        f'<meta name="generator" content="{esc(generator)}">\n'
        f"<title>{esc(title)}</title>\n"
        '<link rel="icon" href="data:,">\n'
        f"<style>{css}</style>\n</head>\n<body>\n"
        f'<header class="al-header"><h1>{esc(title)}</h1>{sub}</header>\n'
        f"{toc}<main>\n{body}\n</main>\n"
        f'<footer class="al-footer">{esc(generator)} · one self-contained file: no network, no external files.</footer>'
        f"{tags}\n</body>\n</html>\n"
    )
