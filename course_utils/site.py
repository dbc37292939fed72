"""A static HTML course from executed notebooks (built by the main job).

    python -m course_utils.site build/notebooks build/site

Each chapter becomes one HTML page; ``index.html`` lists the chapters with what each
measures and its runtime in that run. Charts render without internet: the notebooks embed
plotly.js once (see :func:`course_utils.plots.setup_notebook`), and widget outputs — whose
JavaScript would come from a CDN — are replaced by the static copy of their chart in its
initial state that :class:`course_utils.widgets.InteractiveFigure` stores beside them.
"""
from __future__ import annotations

import argparse
import html
import json
import re
import sys
from pathlib import Path

import nbformat

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def static_outputs(nb):
    """Drop widget views that carry a static HTML alternative, and the widget state."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_MIME in data and "text/html" in data:
                del data[WIDGET_MIME]
    nb.metadata.pop("widgets", None)
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
    """The chapter's question: the first paragraph after the title, without Markdown emphasis."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            paragraphs = [p.strip() for p in cell.source.split("\n\n") if p.strip() and not p.startswith("#")]
            if paragraphs:
                text = re.sub(r"[*_`]", "", " ".join(paragraphs[0].split()))
                return text.removeprefix("The question. ")
    return ""


def export_html(nb) -> str:
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab")
    body, _ = exporter.from_notebook_node(static_outputs(nb))
    return body


_INDEX = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Cheaper LLM inference, measured</title>
<style>
body {{ font-family: Helvetica, Arial, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }}
table {{ border-collapse: collapse; width: 100%; }} th, td {{ border-bottom: 1px solid #ddd; padding: .5rem; text-align: left; vertical-align: top; }}
td.num {{ text-align: right; white-space: nowrap; }} .failed {{ color: #D55E00; font-weight: bold; }}
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
    """Write one HTML page per executed notebook and an index; returns the index's path."""
    executed_dir, out_dir = Path(executed_dir), Path(out_dir)
    notebooks = sorted(executed_dir.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise ValueError(f"no executed chapters (NN_*.ipynb) in {executed_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    by_name = {r["notebook"]: r for r in results or []}
    rows = []
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        (out_dir / f"{path.stem}.html").write_text(export_html(nb), encoding="utf-8")
        r = by_name.get(path.stem, {})
        status = r.get("status", "executed")
        seconds = f'{r["seconds"]:,.0f} s' if "seconds" in r else ""
        rss = f'{r["peak_rss_bytes"] / 1e6:,.0f} MB' if "peak_rss_bytes" in r else ""
        css = "" if status in ("ok", "executed") else "failed"
        rows.append(f'<tr><td><a href="{path.stem}.html">{html.escape(chapter_title(nb, path.stem))}</a></td>'
                    f"<td>{html.escape(chapter_summary(nb))}</td><td class=\"{css}\">{html.escape(status)}</td>"
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
