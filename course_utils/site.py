"""A static HTML course from executed notebooks (built by the main job).

    python -m course_utils.site build/notebooks build/site

Each chapter becomes one HTML page with a navigation bar (previous chapter, the course's
contents, next chapter) and a list of the chapter's sections; ``index.html`` lists the chapters
with the question each answers and its runtime in that run. Links between chapters point at
the site's pages (a link to a chapter that was not built is shown as plain text, so no link
leads nowhere).

Charts render without internet. The notebooks embed plotly.js once each (see
:func:`course_utils.plots.setup_notebook`); the site drops those copies and ships the library
once, as ``plotly.min.js`` beside the pages, which every page loads. Widget outputs — whose
JavaScript would come from a CDN — are replaced by the static copy of their chart in its
initial state that :class:`course_utils.widgets.InteractiveFigure` stores beside them. The
formulas are Unicode text, so the pages load no MathJax.
"""
from __future__ import annotations

import argparse
import html
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
PLOTLY_JS = "plotly.min.js"
CHAPTER_FILE = re.compile(r"^(\d\d_[A-Za-z0-9_\-]+)\.ipynb$")

#: An output that carries plotly.js itself (what ``setup_notebook`` embeds once per notebook).
_EMBEDDED_PLOTLYJS = re.compile(r"window\.PlotlyConfig|\* plotly\.js v\d")
#: ``<script src=...>`` tags that fetch MathJax or require.js from a CDN (nbconvert's template, plotly's figures).
_CDN_SCRIPT = re.compile(r'<script[^>]*\ssrc="https?://[^"]*/(?:mathjax|require\.js)/[^"]*"[^>]*>\s*</script>', re.I)
_H2 = re.compile(r'<h2 id="([^"]+)"[^>]*>(.*?)<a class="anchor-link"', re.S)


def static_outputs(nb):
    """Drop widget views that carry a static HTML alternative, and the widget state."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_MIME in data and "text/html" in data:
                del data[WIDGET_MIME]
    nb.metadata.pop("widgets", None)
    return nb


def share_plotlyjs(nb):
    """Remove the notebook's embedded copy of plotly.js (the page loads the site's one) and CDN script tags."""
    for cell in nb.cells:
        outputs = []
        for out in cell.get("outputs", []):
            page = out.get("data", {}).get("text/html")
            if isinstance(page, str) and len(page) > 100_000 and _EMBEDDED_PLOTLYJS.search(page[:2000]):
                continue
            if isinstance(page, str):
                out["data"]["text/html"] = _CDN_SCRIPT.sub("", page)
            outputs.append(out)
        if cell.cell_type == "code":
            cell.outputs = outputs
    return nb


def chapter_title(nb, fallback: str) -> str:
    """The first Markdown heading of the notebook."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = re.search(r"^#\s+(.+)$", cell.source, flags=re.M)
            if m:
                return m.group(1).strip()
    return fallback


def chapter_summary(nb) -> str:
    """The chapter's question, as Markdown: the first paragraph after the title, without its "The question." label."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            paragraphs = [p.strip() for p in cell.source.split("\n\n") if p.strip() and not p.startswith("#")]
            if paragraphs:
                text = " ".join(paragraphs[0].split())
                return re.sub(r"^\*\*The question\.\*\*\s*", "", text)
    return ""


def markdown_html(text: str) -> str:
    """Markdown to HTML (the renderer nbconvert uses for the pages), without the wrapping paragraph."""
    from nbconvert.filters import markdown2html

    out = markdown2html(text).strip()
    return out[3:-4].strip() if out.startswith("<p>") and out.endswith("</p>") and out.count("<p>") == 1 else out


def rewrite_links(page: str, pages: set[str]) -> str:
    """Point links at chapter notebooks (``NN_name.ipynb#anchor``) at the site's pages.

    ``pages``: the stems of the chapters in the site. A link to a chapter outside it becomes
    plain text (its label stays), so every remaining relative link resolves to a file of the site.
    """
    def replace_anchor(m: re.Match) -> str:
        target = m.group(2).split("#", 1)
        name = CHAPTER_FILE.match(target[0].rsplit("/", 1)[-1])
        if not name:
            return m.group(0)
        if name.group(1) in pages:
            fragment = f"#{target[1]}" if len(target) > 1 else ""
            return f'<a{m.group(1)}href="{name.group(1)}.html{fragment}"{m.group(3)}>{m.group(4)}</a>'
        return f'<span class="missing-chapter" title="not built in this run">{m.group(4)}</span>'
    return re.sub(r'<a([^>]*?\s)href="([^"]*\.ipynb(?:#[^"]*)?)"([^>]*)>(.*?)</a>', replace_anchor, page, flags=re.S)


@dataclass(frozen=True)
class Chapter:
    """One page of the site: its file stem and its title."""

    stem: str
    title: str

    @property
    def page(self) -> str:
        return f"{self.stem}.html"


def chapter_sections(page: str) -> list[tuple[str, str]]:
    """(anchor id, heading text) of every second-level heading of an exported chapter page."""
    return [(anchor, re.sub(r"<[^>]+>", "", text).strip()) for anchor, text in _H2.findall(page)]


_NAV_CSS = """<style>
nav.course-nav { font-family: Helvetica, Arial, sans-serif; display: flex; justify-content: space-between;
  gap: 1rem; padding: .6rem 1rem; margin: 0 0 1rem; border-bottom: 1px solid #ddd; background: #fafafa; }
nav.course-nav.bottom { border-top: 1px solid #ddd; border-bottom: 0; margin: 2rem 0 0; }
nav.course-nav a { color: #0072B2; text-decoration: none; } nav.course-nav a:hover { text-decoration: underline; }
nav.course-contents { font-family: Helvetica, Arial, sans-serif; margin: 0 1rem 1.5rem; padding: .5rem 1rem;
  border-left: 3px solid #0072B2; background: #f6f9fc; }
nav.course-contents ul { margin: .3rem 0; padding-left: 1rem; list-style: none; } nav.course-contents li { margin: .15rem 0; }
.missing-chapter { border-bottom: 1px dotted #888; }
</style>"""


def _nav(chapters: list[Chapter], i: int, where: str) -> str:
    prev = (f'<a rel="prev" href="{chapters[i - 1].page}">← {html.escape(chapters[i - 1].title)}</a>'
            if i > 0 else "<span></span>")
    nxt = (f'<a rel="next" href="{chapters[i + 1].page}">{html.escape(chapters[i + 1].title)} →</a>'
           if i + 1 < len(chapters) else "<span></span>")
    return f'<nav class="course-nav {where}">{prev}<a href="index.html">Contents of the course</a>{nxt}</nav>'


def _contents(sections: list[tuple[str, str]]) -> str:
    if not sections:
        return ""
    items = "".join(f'<li><a href="#{anchor}">{html.escape(text)}</a></li>' for anchor, text in sections)
    return f'<nav class="course-contents" aria-label="sections of this chapter"><strong>In this chapter</strong><ul>{items}</ul></nav>'


def decorate_page(page: str, chapters: list[Chapter], i: int) -> str:
    """Load the shared plotly.js, drop CDN scripts, link chapters to pages, add navigation and contents."""
    page = _CDN_SCRIPT.sub("", page)
    page = rewrite_links(page, {c.stem for c in chapters})
    head = f'<script src="{PLOTLY_JS}"></script>\n{_NAV_CSS}\n'
    page = page.replace("</head>", head + "</head>", 1)
    top = _nav(chapters, i, "top") + _contents(chapter_sections(page))
    page = re.sub(r"(<main[^>]*>)", lambda m: m.group(1) + top, page, count=1)
    return page.replace("</main>", _nav(chapters, i, "bottom") + "</main>", 1)


def export_html(nb, title: str = "Notebook") -> str:
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab")
    body, _ = exporter.from_notebook_node(share_plotlyjs(static_outputs(nb)),
                                          resources={"metadata": {"name": title}})
    return body


def write_plotlyjs(out_dir: Path) -> Path:
    """plotly.js, once for the whole site: the version the installed plotly package embeds."""
    from plotly.offline import get_plotlyjs

    path = Path(out_dir) / PLOTLY_JS
    path.write_text(get_plotlyjs(), encoding="utf-8")
    return path


_INDEX = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Cheaper LLM inference, measured</title>
<style>
body {{ font-family: Helvetica, Arial, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }}
table {{ border-collapse: collapse; width: 100%; }} th, td {{ border-bottom: 1px solid #ddd; padding: .5rem; text-align: left; vertical-align: top; }}
td.num {{ text-align: right; white-space: nowrap; }} .failed {{ color: #D55E00; font-weight: bold; }}
a {{ color: #0072B2; }} .missing-chapter {{ border-bottom: 1px dotted #888; }}
</style></head><body>
<h1>Cheaper LLM inference, measured</h1>
<p>Every chapter below was executed on {machine} on {date}; the figures in each page are that run's.</p>
<table><thead><tr><th>chapter</th><th>the question it answers</th><th>status</th><th>runtime</th><th>kernel peak RSS</th></tr></thead>
<tbody>
{rows}
</tbody></table>
</body></html>
"""


def build_site(executed_dir: Path, out_dir: Path, *, results: list[dict] | None = None,
               machine: str = "this machine", date: str = "") -> Path:
    """Write one HTML page per executed notebook, plotly.js once, and an index; returns the index's path."""
    executed_dir, out_dir = Path(executed_dir), Path(out_dir)
    paths = sorted(executed_dir.glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise ValueError(f"no executed chapters (NN_*.ipynb) in {executed_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_plotlyjs(out_dir)
    notebooks = [nbformat.read(path, as_version=4) for path in paths]
    chapters = [Chapter(path.stem, chapter_title(nb, path.stem)) for path, nb in zip(paths, notebooks)]
    pages = {c.stem for c in chapters}
    by_name = {r["notebook"]: r for r in results or []}
    rows = []
    for i, (chapter, nb) in enumerate(zip(chapters, notebooks)):
        summary = chapter_summary(nb)
        page = decorate_page(export_html(nb, chapter.title), chapters, i)
        (out_dir / chapter.page).write_text(page, encoding="utf-8")
        r = by_name.get(chapter.stem, {})
        status = r.get("status", "executed")
        seconds = f'{r["seconds"]:,.0f} s' if "seconds" in r else ""
        rss = f'{r["peak_rss_bytes"] / 1e6:,.0f} MB' if "peak_rss_bytes" in r else ""
        css = "" if status in ("ok", "executed") else "failed"
        rows.append(f'<tr><td><a href="{chapter.page}">{html.escape(chapter.title)}</a></td>'
                    f"<td>{rewrite_links(markdown_html(summary), pages)}</td><td class=\"{css}\">{html.escape(status)}</td>"
                    f'<td class="num">{seconds}</td><td class="num">{rss}</td></tr>')
    index = out_dir / "index.html"
    index.write_text(_INDEX.format(machine=html.escape(machine), date=html.escape(date or "the date of the run"),
                                   rows="\n".join(rows)), encoding="utf-8")
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("executed", type=Path, help="folder of executed notebooks")
    parser.add_argument("out", type=Path, help="folder to write the site to")
    args = parser.parse_args(argv)
    summary = args.executed.parent / "summary.json"
    meta = json.loads(summary.read_text()) if summary.exists() else {}
    index = build_site(args.executed, args.out, results=meta.get("results"), machine=meta.get("machine", "this machine"),
                       date=meta.get("date", ""))
    print(index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
