"""The main job and the HTML site, on small notebooks made in the test."""
from __future__ import annotations

import json
import re

import nbformat
import pytest

from course_utils import run_all
from course_utils.site import WIDGET_MIME, build_site, chapter_summary, chapter_title, static_outputs


def _notebook(path, code: str, title: str = "# 01 — A tiny chapter"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    params = nbformat.v4.new_code_cell("MODEL = 'embedded'\nDEVICE = 'cpu'\nN = 3")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell(f"{title}\n\n**The question.** Does it *work*?"), params,
                nbformat.v4.new_code_cell(code)]
    nbformat.write(nb, path)


def test_main_job_runs_notebooks_writes_summary_and_fails_on_error(tmp_path, monkeypatch):
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    _notebook(nbdir / "01_ok.ipynb", "import plotly.graph_objects as go\nfrom course_utils.plots import setup_notebook\n"
                                     "setup_notebook()\nprint(N * 2)\ngo.Figure(go.Scatter(y=[1, 2]))")   # as chapters do
    _notebook(nbdir / "02_broken.ipynb", "raise RuntimeError('boom')", title="# 02 — Broken")
    monkeypatch.setattr(run_all, "NOTEBOOKS", nbdir)
    out = tmp_path / "build"
    status = run_all.main(["--out", str(out), "-p", "N", "21"])
    assert status == 1
    summary = json.loads((out / "summary.json").read_text())
    by_name = {r["notebook"]: r for r in summary["results"]}
    assert by_name["01_ok"]["status"] == "ok" and by_name["02_broken"]["status"] == "FAILED"
    assert "boom" in by_name["02_broken"]["error"]
    assert by_name["01_ok"]["peak_rss_bytes"] > 10e6          # the kernel process was sampled
    assert summary["parameters"] == {"N": 21}
    executed = nbformat.read(out / "notebooks" / "01_ok.ipynb", as_version=4)
    assert any("42" in o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    assert "| 01_ok | ok |" in (out / "summary.md").read_text()
    index = (out / "site" / "index.html").read_text()
    assert "01_ok.html" in index and "A tiny chapter" in index
    assert "plotly-graph-div" in (out / "site" / "01_ok.html").read_text()     # the chart reached the page


def test_only_selects_chapters_and_rejects_unknown(tmp_path, monkeypatch):
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    _notebook(nbdir / "01_a.ipynb", "pass")
    _notebook(nbdir / "02_b.ipynb", "pass")
    monkeypatch.setattr(run_all, "NOTEBOOKS", nbdir)
    assert [p.name for p in run_all.chapter_notebooks(["02"])] == ["02_b.ipynb"]
    with pytest.raises(SystemExit):
        run_all.main(["--only", "09", "--out", str(tmp_path / "b")])


@pytest.mark.parametrize("text,value", [("3", 3), ("0.5", 0.5), ("true", True), ("[1, 2]", [1, 2]),
                                        ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"), ("cpu", "cpu")])
def test_parameter_values_are_parsed(text, value):
    assert run_all._parse_value(text) == value


def test_static_outputs_replace_widgets_with_their_static_chart():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("view")
    cell.outputs = [nbformat.v4.new_output("display_data", data={WIDGET_MIME: {"model_id": "x"},
                                                                 "text/html": "<div>chart</div>", "text/plain": "v"}),
                    nbformat.v4.new_output("display_data", data={WIDGET_MIME: {"model_id": "y"}, "text/plain": "w"})]
    nb.cells = [cell]
    nb.metadata["widgets"] = {"state": {}}
    out = static_outputs(nb)
    assert WIDGET_MIME not in out.cells[0].outputs[0].data and "text/html" in out.cells[0].outputs[0].data
    assert WIDGET_MIME in out.cells[0].outputs[1].data          # nothing to fall back to: left alone
    assert "widgets" not in out.metadata


def test_title_and_summary(tmp_path):
    _notebook(tmp_path / "01_x.ipynb", "pass")
    nb = nbformat.read(tmp_path / "01_x.ipynb", as_version=4)
    assert chapter_title(nb, "fallback") == "01 — A tiny chapter"
    assert chapter_summary(nb) == "Does it *work*?"


def test_site_needs_executed_chapters(tmp_path):
    with pytest.raises(ValueError, match="no executed chapters"):
        build_site(tmp_path, tmp_path / "site")


# --- the site: rendered questions, links to pages, navigation, one plotly.js ------------------------------------

def test_summary_is_rendered_markdown_with_links_to_pages():
    from course_utils.site import markdown_html, rewrite_links
    text = "[Chapter 01](01_kv_cache.ipynb) bought *speed*: see [chapter 09](09_distill.ipynb#part-2) and x_y_z"
    page = rewrite_links(markdown_html(text), {"01_kv_cache"})
    assert '<a href="01_kv_cache.html">Chapter 01</a>' in page and "<em>speed</em>" in page and "x_y_z" in page
    assert "09_distill" not in page and '<span class="missing-chapter"' in page and "chapter 09</span>" in page
    assert "](" not in page and not page.startswith("<p>")


def test_rewrite_links_keeps_anchors_and_leaves_other_links_alone():
    from course_utils.site import rewrite_links
    page = ('<a href="02_prefill_decode.ipynb#4.-Two-roofs">roofs</a> <a class="x" href="https://example.org/a.ipynb">ext</a> '
            '<a href="#local">here</a>')
    out = rewrite_links(page, {"02_prefill_decode"})
    assert '<a href="02_prefill_decode.html#4.-Two-roofs">roofs</a>' in out
    assert 'href="https://example.org/a.ipynb"' in out and 'href="#local"' in out


def test_shared_plotlyjs_replaces_the_embedded_copy():
    from course_utils.site import share_plotlyjs
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("setup_notebook()")
    bundle = "<script>window.PlotlyConfig = {};</script><script>/**\n* plotly.js v9.9.9\n*/" + "x" * 200_000 + "</script>"
    chart = ('<div><script src="https://cdnjs.cloudflare.com/ajax/libs/mathjax/3.2.2/es5/tex-svg.min.js"></script>'
             '<div id="a" class="plotly-graph-div"></div><script>Plotly.newPlot("a", [])</script></div>')
    cell.outputs = [nbformat.v4.new_output("display_data", data={"text/html": bundle, "text/plain": ""}),
                    nbformat.v4.new_output("display_data", data={"text/html": chart, "text/plain": "fig"})]
    nb.cells = [cell]
    out = share_plotlyjs(nb)
    assert len(out.cells[0].outputs) == 1
    html = out.cells[0].outputs[0].data["text/html"]
    assert "Plotly.newPlot" in html and "mathjax" not in html


def test_site_pages_link_to_each_other_and_share_one_plotlyjs(tmp_path):
    nbdir = tmp_path / "executed"
    nbdir.mkdir()
    for stem, title, body in [("01_a", "# 01 — First", "**The question.** Does [chapter 02](02_b.ipynb) exist?"),
                              ("02_b", "# 02 — Second", "**The question.** Back to [chapter 01](01_a.ipynb)?"),
                              ("03_c", "# 03 — Third", "**The question.** And [chapter 04](04_d.ipynb)?")]:
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_markdown_cell(f"{title}\n\n{body}"),
                    nbformat.v4.new_markdown_cell("## 1. Part one\n\ntext\n\n## 2. Part two\n\nmore")]
        nbformat.write(nb, nbdir / f"{stem}.ipynb")
    index = build_site(nbdir, tmp_path / "site")
    site = index.parent
    assert sorted(p.name for p in site.iterdir()) == ["01_a.html", "02_b.html", "03_c.html", "index.html", "plotly.min.js"]
    text = index.read_text()
    assert '<a href="02_b.html">chapter 02</a>' in text and "](" not in text and "04_d" not in text
    first, middle, last = ((site / f"{s}.html").read_text() for s in ("01_a", "02_b", "03_c"))
    assert 'rel="next" href="02_b.html"' in first and 'rel="prev"' not in first
    assert 'rel="prev" href="01_a.html"' in middle and 'rel="next" href="03_c.html"' in middle
    assert 'rel="next"' not in last and 'rel="prev" href="02_b.html"' in last
    assert '<script src="plotly.min.js"></script>' in first and not re.search(r'<script[^>]*src="https?:', first)
    assert first.count('href="index.html"') == 2
    assert 'href="#1.-Part-one"' in first and 'href="#2.-Part-two"' in first           # the contents list
    assert '<title>01 — First</title>' in first
    assert 'href="02_b.html">chapter 02</a>' in first and ".ipynb" not in first


def test_no_chapter_keeps_a_markdown_link_inside_its_code():
    """A link written in a code cell (in a string formatted for ``md``) is shown on the site's page as code, raw:
    ``[chapter 03](03_kv_cache_memory.ipynb)``. Links between chapters belong in Markdown cells."""
    from pathlib import Path

    link = re.compile(r"\[[^\]\n]+\]\([^)\s]*\.ipynb[^)\s]*\)")
    found = []
    for path in sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "code":
                found += [f"{path.name} cell {i}: {m.group(0)}" for m in link.finditer(cell.source)]
    assert not found, "Markdown links in code cells show raw on the site: " + "; ".join(found)
