"""report.html: report.md rendered to one self-contained HTML page.

The Markdown is rendered by markdown-it-py (CommonMark plus GFM tables; raw HTML in the text is
escaped, so a client id cannot inject markup), and every image it references is read from the
report's folder and embedded as a base64 ``data:`` URI. The page loads nothing else: no scripts,
no fonts, no network; it can be mailed or attached to a ticket as one file.
"""

from __future__ import annotations

import base64
import html
import mimetypes
from pathlib import Path
from typing import Final

from markdown_it import MarkdownIt
from markdown_it.token import Token

from coordinator.report.common import ReportError

__all__ = ["render_html"]

_STYLE: Final[str] = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2430;
       max-width: 1100px; margin: 2rem auto; padding: 0 1.2rem; line-height: 1.45; }
h1 { border-bottom: 2px solid #3b6fb6; padding-bottom: .3rem; }
h2 { margin-top: 2.2rem; border-bottom: 1px solid #d5dbe5; padding-bottom: .2rem; }
table { border-collapse: collapse; margin: .8rem 0; font-size: .9rem; }
th, td { border: 1px solid #d5dbe5; padding: .3rem .6rem; text-align: left; vertical-align: top; }
th { background: #eef2f8; }
tr:nth-child(even) td { background: #f8fafc; }
strong { color: #a32020; }
img { max-width: 100%; height: auto; display: block; margin: .8rem 0; }
code { background: #f1f3f6; padding: 0 .25rem; border-radius: 3px; }
"""


def _data_uri(folder: Path, src: str) -> str:
    path = folder / src
    if Path(src).name != src or not path.is_file():
        raise ReportError(f"report image {src!r} is not a file in {folder}")
    mime = mimetypes.guess_type(src)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def _embed_images(tokens: list[Token], folder: Path) -> None:
    for token in tokens:
        for child in token.children or []:
            if child.type == "image":
                child.attrSet("src", _data_uri(folder, str(child.attrGet("src"))))


def render_html(markdown: str, folder: Path, title: str) -> str:
    """The page for `markdown`, its images (file names relative to `folder`) embedded."""
    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = md.parse(markdown)
    _embed_images(tokens, folder)
    body = md.renderer.render(tokens, md.options, {})
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<link rel="icon" href="data:,">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n"
        f"<body>\n{body}</body>\n</html>\n"
    )
