"""Chapter 11 -- figures of finished runs (pure functions: nothing is measured again)."""
from __future__ import annotations

from typing import Sequence

from .client import ReplayResult
from .metrics import request_metrics


def _ms(values) -> list[float]:
    return [v * 1e3 for v in values]


def _ecdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def latency_cdf_figure(results: dict[str, ReplayResult]):
    """TTFT and TPOT distributions (empirical CDFs, ms) of each server's run of the same trace, side by side (one run
    each: the title gives each one's median TTFT, nothing about repeats)."""
    from plotly.subplots import make_subplots

    from ..plots import PALETTE, TEMPLATE

    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT", "TPOT"), horizontal_spacing=0.1)
    medians = {}
    for (name, res), color in zip(results.items(), PALETTE):
        ok = [request_metrics(r) for r in res.records if r.success]
        for col, values in ((1, [m.ttft_s for m in ok]), (2, [m.tpot_s for m in ok if m.tpot_s is not None])):
            xs, ys = _ecdf(_ms(values))
            fig.add_scatter(x=xs, y=ys, mode="lines+markers", line_shape="hv", name=name, legendgroup=name,
                            showlegend=col == 1, line_color=color, row=1, col=col,
                            hovertemplate="%{x:,.0f} ms: %{y:.0%} of requests<extra>" + name + "</extra>")
        medians[name] = res.summary().ttft.median
    fastest = min(medians, key=medians.get)
    if len(medians) == 1:
        title = f"One run: {fastest}'s median TTFT {medians[fastest] * 1e3:,.0f} ms"
    else:
        slowest = max(medians, key=medians.get)
        title = (f"One run each of the same trace: {fastest}'s median TTFT {medians[fastest] * 1e3:,.0f} ms, "
                 f"{slowest}'s {medians[slowest] * 1e3:,.0f} ms")
    fig.update_layout(template=TEMPLATE, height=440, hovermode="closest", title=title,
                      legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="center", x=0.5))
    fig.update_xaxes(title="time to first token (ms)", row=1, col=1)
    fig.update_xaxes(title="time per output token (ms)", row=1, col=2)
    fig.update_yaxes(title="fraction of requests", range=[0, 1.02], row=1, col=1)
    return fig


def timeline_figure(results: dict[str, ReplayResult], *, max_requests: int = 16):
    """When each token arrived (s after the run started), one row per request, for each server: queueing,
    prefill and the rhythm of decode steps made visible."""
    from plotly.subplots import make_subplots

    from ..plots import PALETTE, TEMPLATE

    fig = make_subplots(rows=len(results), cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=list(results))
    for row, (name, res) in enumerate(results.items(), start=1):
        shown = res.records[:max_requests]
        fig.add_scatter(x=[r.start_s for r in shown], y=[r.index for r in shown], mode="markers", name="sent",
                        marker=dict(symbol="line-ns-open", size=12, color=PALETTE[5]), showlegend=row == 1,
                        legendgroup="sent", row=row, col=1)
        xs, ys = [], []
        for r in shown:
            xs += [r.start_s + t for t in r.chunk_s] + [None]
            ys += [r.index] * len(r.chunk_s) + [None]
        fig.add_scatter(x=xs, y=ys, mode="markers+lines", name="a streamed chunk", line=dict(width=1, color=PALETTE[0]),
                        marker=dict(size=4, color=PALETTE[0]), showlegend=row == 1, legendgroup="chunk", row=row, col=1)
        fig.update_yaxes(title="request", autorange="reversed", row=row, col=1)
    fig.update_xaxes(title="seconds since the run started", row=len(results), col=1)
    fig.update_layout(template=TEMPLATE, height=260 * len(results) + 120, hovermode="closest",
                      title=f"Token arrivals of the first {max_requests} requests: a mark when sent, a dot per chunk")
    return fig


def stall_figure(results: dict[str, ReplayResult], min_long_tokens: int, *, log_y: bool = False, runs: str = ""):
    """Every gap between two streamed chunks of the short requests (ms), at the time it ended (s after the run
    started), one panel per server; dashed lines mark when each long request (a prompt of at least
    ``min_long_tokens`` tokens) was sent, dotted ones its first token. A prefill that every running request waits
    for shows as a tall gap after a dashed line. ``log_y``: a logarithmic gap axis (a decode step's gaps and a
    prefill's side by side); ``runs``: which runs these are, said in the title."""
    from plotly.subplots import make_subplots

    from ..plots import PALETTE, TEMPLATE
    from .metrics import split_by_prompt

    fig = make_subplots(rows=1, cols=len(results), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=list(results))
    longest = {}
    for col, (name, res) in enumerate(results.items(), start=1):
        short, long_ = split_by_prompt([r for r in res.records if r.success], min_long_tokens)
        xs, ys = [], []
        for r in short:
            xs += [r.start_s + t for t in r.chunk_s[1:]]
            ys += _ms(request_metrics(r).itl_s)
        longest[name] = max(ys, default=0.0)
        fig.add_scatter(x=xs, y=ys, mode="markers", marker=dict(size=5, color=PALETTE[0]), name="a short answer's gap",
                        legendgroup="gap", showlegend=col == 1, row=1, col=col,
                        hovertemplate="%{x:.2f} s: %{y:,.0f} ms<extra>" + name + "</extra>")
        for r in long_:
            fig.add_vline(x=r.start_s, line_dash="dash", line_color=PALETTE[1], row=1, col=col)
            fig.add_vline(x=r.start_s + r.chunk_s[0], line_dash="dot", line_color=PALETTE[2], row=1, col=col)
        fig.update_xaxes(title="s since the run started", row=1, col=col)
    for dash, color, label in (("dash", PALETTE[1], "a long prompt sent"), ("dot", PALETTE[2], "its first token")):
        fig.add_scatter(x=[None], y=[None], mode="lines", line=dict(dash=dash, color=color), name=label)
    if log_y:
        fig.update_yaxes(type="log")
    fig.update_yaxes(title="gap between chunks (ms)" + (", log scale" if log_y else ""),
                     **({} if log_y else dict(rangemode="tozero")), row=1, col=1)
    fig.update_layout(template=TEMPLATE, height=440, hovermode="closest",
                      legend=dict(orientation="h", yanchor="top", y=-0.2, xanchor="center", x=0.5),
                      title="The short answers' longest gap" + (f" ({runs})" if runs else "") + ": "
                      + ", ".join(f"{n} {v:,.0f} ms" for n, v in longest.items()))
    return fig
