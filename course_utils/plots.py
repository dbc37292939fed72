"""The plotly look shared by every chapter, and small figure helpers (chapter 01 onwards).

Call :func:`setup_notebook` once at the top of a chapter. It registers the ``"course"``
template (the Okabe-Ito palette, which stays distinguishable under the common forms of
colour blindness), and makes every figure carry two renderings: plotly's own mime type,
which JupyterLab draws, and HTML backed by a copy of plotly.js embedded once in the
notebook, which papermill output and exported HTML draw without internet.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import plotly.graph_objects as go
import plotly.io as pio

#: Okabe & Ito (2008), "Color Universal Design": safe for deuteranopia, protanopia, tritanopia.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
TEMPLATE = "course"
RENDERER = "plotly_mimetype+notebook"


def _register_template() -> None:
    tpl = go.layout.Template(pio.templates["plotly_white"])
    tpl.layout.colorway = PALETTE
    tpl.layout.font = dict(family="Inter, Helvetica, Arial, sans-serif", size=13)
    tpl.layout.title = dict(font=dict(size=16), x=0.0, xanchor="left")
    tpl.layout.margin = dict(l=70, r=30, t=70, b=60)
    tpl.layout.hovermode = "x unified"
    tpl.layout.legend = dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0)
    pio.templates[TEMPLATE] = tpl


_register_template()


def setup_notebook(*, embed_plotlyjs: bool = True) -> None:
    """Use the course template and offline-capable renderers; embed plotly.js once, now.

    Embedding now (rather than at the first ``fig.show()``) lets widget cells, which
    carry a static HTML copy of their first chart, rely on ``window.Plotly`` too.
    """
    pio.templates.default = TEMPLATE
    pio.renderers.default = RENDERER if embed_plotlyjs else "plotly_mimetype"
    activate = getattr(pio.renderers, "_activate_pending_renderers", None)
    if activate is not None:
        try:
            from IPython import get_ipython
            if get_ipython() is not None:
                activate()
        except ImportError:  # plain Python: nothing to embed into
            pass


def figure(title: str, x_title: str, y_title: str, *, log_x: bool = False, log_y: bool = False,
           height: int = 420) -> go.Figure:
    """An empty figure in the course look; every axis title should carry its unit."""
    fig = go.Figure(layout=dict(template=TEMPLATE, title=title, height=height))
    fig.update_xaxes(title=x_title, type="log" if log_x else None)
    fig.update_yaxes(title=y_title, type="log" if log_y else None)
    return fig


def line_figure(x: Sequence, series: dict[str, Sequence], *, title: str, x_title: str, y_title: str,
                log_x: bool = False, log_y: bool = False, markers: bool = True, height: int = 420) -> go.Figure:
    """One line per entry of ``series`` (name -> y values), all over the same ``x``."""
    fig = figure(title, x_title, y_title, log_x=log_x, log_y=log_y, height=height)
    for name, y in series.items():
        fig.add_scatter(x=list(x), y=list(y), name=name, mode="lines+markers" if markers else "lines")
    return fig


def bar_figure(categories: Iterable, series: dict[str, Sequence], *, title: str, x_title: str, y_title: str,
               log_y: bool = False, height: int = 420, text_format: str | None = None) -> go.Figure:
    """Grouped bars: one bar per category for each entry of ``series``.

    ``text_format`` is a d3 number format (``",.0f"``, ``".3s"`` for SI prefixes, ...) for the
    value printed on each bar. A ``None`` value draws no bar (a log axis cannot show zero).
    """
    fig = figure(title, x_title, y_title, log_y=log_y, height=height)
    cats = list(categories)
    for name, y in series.items():
        y = list(y)
        fig.add_bar(x=cats, y=y, name=name, texttemplate=f"%{{y:{text_format}}}" if text_format else None)
    fig.update_layout(barmode="group")
    return fig
