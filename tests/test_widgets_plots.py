"""The widget pattern and the shared plot look."""
from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from course_utils.plots import PALETTE, TEMPLATE, bar_figure, line_figure, setup_notebook
from course_utils.widgets import InteractiveFigure, choice, int_slider, log2_slider


def _make(n, kind="line"):
    if kind == "bar":
        return bar_figure(["a", "b"], {"s": [n, 2 * n]}, title=f"n={n}", x_title="x (unit)", y_title="y (unit)")
    return line_figure([1, 2, 3], {"s": [n, n * n, n ** 3]}, title=f"n={n}", x_title="x (unit)", y_title="y (unit)")


def test_moving_a_control_redraws_the_figure():
    view = InteractiveFigure(_make, n=int_slider("n", 1, 10, value=2))
    assert view.figure.data[0].y == (2, 4, 8)
    view.controls["n"].value = 3
    assert view.figure.data[0].y == (3, 9, 27)
    assert view.figure.layout.title.text == "n=3"
    assert view.last_update_s > 0          # the redraw is timed (how fast it must be is a browser matter)


def test_changing_trace_types_replaces_traces():
    view = InteractiveFigure(_make, n=int_slider("n", 1, 10, value=2), kind=choice("kind", ["line", "bar"]))
    view.controls["kind"].value = "bar"
    assert view.figure.data[0].type == "bar" and view.figure.data[0].y == (2, 4)


def test_output_carries_widget_and_static_html():
    view = InteractiveFigure(_make, n=log2_slider("n", 0, 4, value_exp=2))
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "Plotly.newPlot" in bundle["text/html"] and "<script src=" not in bundle["text/html"]
    assert view.controls["n"].options == (1, 2, 4, 8, 16)


def test_bad_widget_arguments():
    with pytest.raises(TypeError):
        InteractiveFigure("not callable", n=int_slider("n", 1, 3))
    with pytest.raises(ValueError):
        InteractiveFigure(_make)
    with pytest.raises(TypeError, match="plotly Figure"):
        InteractiveFigure(lambda n: 42, n=int_slider("n", 1, 3))


def test_course_template_uses_the_colour_blind_safe_palette():
    setup_notebook()
    assert pio.templates.default == TEMPLATE
    assert list(pio.templates[TEMPLATE].layout.colorway) == PALETTE
    fig = line_figure([1, 2], {"a": [1, 2]}, title="t", x_title="x (s)", y_title="y (B)", log_y=True)
    assert isinstance(fig, go.Figure) and fig.layout.yaxis.type == "log" and fig.layout.xaxis.title.text == "x (s)"
