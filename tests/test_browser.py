"""The course as a learner uses it: JupyterLab in headless Chromium, and the static HTML site.

Without Chromium these tests are skipped with a message saying how to install it; under CI
(``CI`` set) a missing Chromium is a failure. Screenshots go to ``build/screenshots/``.
"""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import nbformat
import pytest

from browser import CHROMIUM_ARGS, JupyterLab, chromium_path, plot_data, screenshot
from chapters import NOTEBOOKS, reduced_parameters, second_run_copy

pytestmark = pytest.mark.notebooks
RUN_ALL_TIMEOUT_S = 15 * 60

#: (chapter file, the label of the slider to move): the slider must redraw a chart. These chapters run here
#: on the tiny qwen2 GGUF with reduced sizes: this is their second run of the test run (see chapters.py).
SLIDER_CASES = [
    ("05_weight_quantization.ipynb", "bits"),
    ("04_batching.ipynb", "slots"),
]


@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory, browser, tiny_gguf):
    root = tmp_path_factory.mktemp("lab")
    for name, _ in SLIDER_CASES:
        chapter = NOTEBOOKS / name
        second_run_copy(chapter, root / name, reduced_parameters(chapter, str(tiny_gguf)))
    server = JupyterLab(root, tmp_path_factory.mktemp("lab-settings"))
    yield server
    server.stop()


def _open_notebook(page, url: str) -> None:
    """Open a notebook; accept the kernel dialog if JupyterLab asks which kernel to start."""
    page.goto(url)
    page.locator(".jp-Notebook").wait_for(timeout=120_000)
    dialog = page.locator(".jp-Dialog .jp-mod-accept")
    try:
        dialog.wait_for(timeout=8_000)
        dialog.click()
    except Exception:  # no dialog: the notebook's kernelspec was enough
        pass
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(timeout=120_000)


def _run_all_cells(page, n_code_cells: int) -> None:
    """Run every cell through JupyterLab's Run menu and wait until all have finished."""
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    deadline = time.time() + RUN_ALL_TIMEOUT_S
    while time.time() < deadline:
        prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
        done = [p for p in prompts if p.strip().startswith("[") and p.strip()[1:-2].isdigit()]
        errors = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'
                              ':has-text("Traceback")').count()
        if errors:
            raise AssertionError(page.locator(".jp-OutputArea-output:has-text('Traceback')").first.inner_text()[:3000])
        if len(done) == n_code_cells and not any("*" in p for p in prompts):
            return
        time.sleep(2)
    raise AssertionError(f"the notebook did not finish within {RUN_ALL_TIMEOUT_S} s")


@pytest.mark.parametrize("notebook,label", SLIDER_CASES, ids=[c[0][:2] + "-" + c[1] for c in SLIDER_CASES])
def test_a_slider_redraws_its_chart_in_jupyterlab(lab, browser, notebook, label):
    if not (NOTEBOOKS / notebook).exists():
        pytest.fail(f"{notebook} is missing")
    n_code = sum(c.cell_type == "code" for c in nbformat.read(lab.root / notebook, as_version=4).cells)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        _open_notebook(page, lab.url(notebook))
        _run_all_cells(page, n_code)          # the chapter, its injected parameters and its solutions
        assert page.locator(".jp-OutputArea-output", has_text="qwen2, 2 layers").count() >= 1, \
            "the tiny qwen2 model was not the one loaded"
        output = page.locator(".jp-OutputArea-output").filter(
            has=page.locator(".widget-slider .widget-label", has_text=label)).first
        output.scroll_into_view_if_needed()
        chart = output.locator(".js-plotly-plot").first
        chart.wait_for(timeout=60_000)
        # the chart's element appears first; its traces arrive with the widget's state a moment later
        deadline = time.time() + 60
        before = plot_data(chart)
        while before in ("[]", "") and time.time() < deadline:
            time.sleep(0.25)
            before = plot_data(chart)
        if before in ("[]", ""):
            shot = screenshot(page, f"lab_{Path(notebook).stem}_{label}_empty")
            raise AssertionError(f"the chart has no data 60 s after it appeared (see {shot})")
        slider = output.locator(".widget-slider", has=page.locator(".widget-label", has_text=label)).first
        handle = slider.locator(".noUi-handle").first
        handle.focus()
        handle.press("ArrowRight")
        deadline = time.time() + 30
        after = plot_data(chart)
        while after == before and time.time() < deadline:
            time.sleep(0.25)
            after = plot_data(chart)
        output.scroll_into_view_if_needed()
        shot = screenshot(page, f"lab_{Path(notebook).stem}_{label}")
        assert after != before, f"moving the '{label}' slider did not change the chart's data (see {shot})"
    finally:
        page.close()


SITE_CHAPTERS = ("01", "02", "03")          # first, middle and last page: previous / next links both ways


@pytest.fixture(scope="module")
def site(tmp_path_factory, second_run):
    """The site built from chapters 01-03's second runs (each executed once per test run)."""
    from course_utils.site import build_site

    executed = tmp_path_factory.mktemp("executed")
    chapters = [c for c in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb") if c.name[:2] in SITE_CHAPTERS]
    for chapter in chapters:
        shutil.copy(second_run(chapter), executed / chapter.name)
    return build_site(executed, tmp_path_factory.mktemp("site"),
                      results=[{"notebook": c.stem, "status": "ok", "seconds": 1.0, "peak_rss_bytes": 1e9}
                               for c in chapters])


@pytest.fixture
def offline_page(browser):
    """A page that may load only local files: every http(s) request is refused and recorded."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.requested = []

    def block_network(route):
        page.requested.append(route.request.url)
        route.abort()
    page.route("http*://**", block_network)
    yield page
    page.close()


def test_static_site_renders_charts_offline(site, offline_page):
    """Every chart of a chapter page draws, from the one plotly.js file the site ships, with no network."""
    page = offline_page
    chapter = sorted(p for p in site.parent.glob("[0-9][0-9]_*.html"))[-1]
    page.goto(site.as_uri())
    link = page.locator("table a", has_text=chapter.stem[:2]).first
    assert link.get_attribute("href") == chapter.name
    screenshot(page, "site_index")
    link.click()
    page.wait_for_load_state("load")
    plots = page.locator(".js-plotly-plot")
    plots.first.wait_for(timeout=60_000)
    page.wait_for_timeout(1000)
    n_plots = plots.count()
    rendered = page.locator(".js-plotly-plot .main-svg").count()
    assert n_plots >= 2 and rendered >= n_plots, f"{n_plots} plot divs, {rendered} drawn"
    data = [plot_data(plots.nth(i)) for i in range(n_plots)]
    assert all(d not in ("[]", "") for d in data), "a chart was drawn without data"
    plots.first.scroll_into_view_if_needed()
    screenshot(page, f"site_{chapter.stem}")
    assert page.requested == [], f"the page fetched from the network: {page.requested[:3]}"
    html_files = list(site.parent.glob("*.html"))
    assert [p.name for p in site.parent.glob("*.js")] == ["plotly.min.js"]
    assert all("* plotly.js v" not in p.read_text(encoding="utf-8") for p in html_files), "a page embeds plotly.js"


LINKS_JS = """() => Array.from(document.querySelectorAll('a[href]')).map(a => a.getAttribute('href'))"""
#: The page's text outside code (input cells, <pre>, <code>): where Markdown should have been rendered.
PROSE_JS = """() => { const body = document.body.cloneNode(true);
  body.querySelectorAll('.jp-InputArea, pre, code, script, style').forEach(e => e.remove());
  return body.innerText; }"""
#: As a browser resolves a fragment: the id as written, else percent-decoded (nbconvert writes some ids encoded).
ID_EXISTS_JS = """id => document.getElementById(id) !== null || document.getElementById(decodeURIComponent(id)) !== null"""
RAW_MARKDOWN_LINK = re.compile(r"\[[^\]\n]+\]\([^)\s]+\)")


def test_every_link_of_the_site_resolves_and_no_markdown_shows(site, offline_page):
    """Each link on each page is external, or a file of the site (and its anchor exists); no raw [text](link)."""
    from urllib.parse import urlsplit

    page = offline_page
    root = site.parent
    pages = sorted(root.glob("*.html"))
    assert {p.stem[:2] for p in pages} >= set(SITE_CHAPTERS) | {"in"}
    for path in pages:
        page.goto(path.as_uri())
        page.wait_for_load_state("load")
        prose = page.evaluate(PROSE_JS)
        raw = RAW_MARKDOWN_LINK.findall(prose)
        assert not raw, f"{path.name} shows Markdown link text: {raw[:3]}"
        for href in page.evaluate(LINKS_JS):
            parts = urlsplit(href)
            if parts.scheme in ("http", "https", "mailto"):
                continue
            assert not parts.scheme, f"{path.name}: link {href!r} is neither external nor a file of the site"
            target = (path.parent / parts.path).resolve() if parts.path else path
            assert target.is_file() and root in target.parents, f"{path.name}: link {href!r} leads to no page of the site"
            if parts.fragment and target == path:
                assert page.evaluate(ID_EXISTS_JS, parts.fragment), f"{path.name}: no anchor for {href!r}"
        if path.name != "index.html":
            assert page.locator("nav.course-nav a[href='index.html']").count() == 2, f"{path.name}: no way back to the contents"
            assert page.locator("nav.course-contents li").count() >= 3, f"{path.name}: no list of sections"
    first, last = pages[0], [p for p in pages if p.name != "index.html"][-1]
    page.goto(first.as_uri())
    assert page.locator("a[rel=prev]").count() == 0 and page.locator("a[rel=next]").count() == 2
    page.goto(last.as_uri())
    assert page.locator("a[rel=next]").count() == 0 and page.locator("a[rel=prev]").count() == 2
    assert page.requested == [], f"a page fetched from the network: {page.requested[:3]}"
