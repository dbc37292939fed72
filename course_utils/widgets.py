"""The widget pattern: controls drive a pure function that returns a figure (chapter 01 onwards).

A chapter writes ``make_figure(**values) -> go.Figure`` as a pure function of the control
values (expensive sweeps are computed before, once, and passed in through a closure),
then::

    view = InteractiveFigure(make_figure, n_ctx=int_slider("context length n", 16, 4096, 16, 1024))
    view  # as the cell's last line

Moving a control calls ``make_figure`` with the new values and redraws the
``FigureWidget`` in place. The displayed output also carries a static HTML copy of the
first chart, so exported HTML (where widget JavaScript would need a CDN) still shows it.
"""
from __future__ import annotations

import time
from typing import Callable

import ipywidgets as W
import plotly.graph_objects as go


def int_slider(description: str, min: int, max: int, step: int = 1, value: int | None = None,
               **kw) -> W.IntSlider:
    """An integer slider with a readable, un-truncated label."""
    return W.IntSlider(value=min if value is None else value, min=min, max=max, step=step,
                       description=description, continuous_update=False,
                       style={"description_width": "initial"}, layout=W.Layout(width="480px"), **kw)


def log2_slider(description: str, min_exp: int, max_exp: int, value_exp: int | None = None,
                **kw) -> W.SelectionSlider:
    """A slider over powers of two ``2**min_exp ... 2**max_exp`` (values are ints)."""
    options = [2 ** e for e in range(min_exp, max_exp + 1)]
    value = 2 ** (min_exp if value_exp is None else value_exp)
    return W.SelectionSlider(options=options, value=value, description=description, continuous_update=False,
                             style={"description_width": "initial"}, layout=W.Layout(width="480px"), **kw)


def choice(description: str, options, value=None, **kw) -> W.Dropdown:
    """A drop-down over ``options`` (a list, or a dict label -> value)."""
    opts = list(options.items()) if isinstance(options, dict) else list(options)
    first = opts[0][1] if isinstance(options, dict) else opts[0]
    return W.Dropdown(options=opts, value=first if value is None else value, description=description,
                      style={"description_width": "initial"}, **kw)


def _replace_figure(target: go.FigureWidget, new: go.Figure) -> None:
    """Make ``target`` show ``new``: update traces in place where the count matches."""
    with target.batch_update():
        if len(target.data) == len(new.data) and all(
                a.type == b.type for a, b in zip(target.data, new.data)):
            for old_trace, new_trace in zip(target.data, new.data):
                old_trace.update(new_trace.to_plotly_json(), overwrite=True)
        else:
            target.data = ()
            target.add_traces(list(new.data))
        target.layout = new.layout


class InteractiveFigure:
    """Controls + a ``FigureWidget`` redrawn by a pure ``make_figure(**values)``.

    ``controls`` maps each keyword of ``make_figure`` to an ipywidgets control.
    :meth:`update` redraws for the controls' current values and records how long the
    redraw took (``last_update_s``), so a chapter can check it answers well under a second.
    """

    def __init__(self, make_figure: Callable[..., go.Figure], **controls: W.ValueWidget):
        if not callable(make_figure):
            raise TypeError("make_figure must be a function returning a plotly Figure")
        if not controls:
            raise ValueError("give at least one control, e.g. n=int_slider('n', 1, 10)")
        self.make_figure, self.controls = make_figure, controls
        first = self._call()
        self.static_figure = first
        self.figure = go.FigureWidget(first)
        self.last_update_s = 0.0
        for control in controls.values():
            control.observe(lambda _change: self.update(), names="value")
        self.widget = W.VBox([W.HBox(list(controls.values()), layout=W.Layout(flex_flow="row wrap")),
                              self.figure])

    def values(self) -> dict:
        return {name: c.value for name, c in self.controls.items()}

    def _call(self) -> go.Figure:
        fig = self.make_figure(**self.values())
        if not isinstance(fig, go.Figure):
            raise TypeError(f"make_figure must return a plotly Figure, got {type(fig).__name__}")
        return fig

    def update(self) -> None:
        t0 = time.perf_counter()
        _replace_figure(self.figure, self._call())
        self.last_update_s = time.perf_counter() - t0

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = self.widget._repr_mimebundle_(include=include, exclude=exclude) or {}
        bundle = dict(bundle)
        bundle["text/html"] = self.static_figure.to_html(
            full_html=False, include_plotlyjs=False, include_mathjax=False, default_width="100%")
        return bundle
