"""The chapter's figures: the sweep with its roofline, the slots' Gantt chart, the map of the paged cache."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import plotly.graph_objects as go

from ..plots import PALETTE, TEMPLATE
from .knee import KneeRange
from .paged import sharing_summary
from .roofline import RooflinePoint
from .simulate import Schedule, simulate
from .sweep import SweepPoint
from .workload import skewed_lengths


def sweep_figure(points: Sequence[SweepPoint], knee: int | KneeRange | None,
                 roofline: Sequence[RooflinePoint] | None = None) -> go.Figure:
    """Throughput and per-request latency against the batch size, the knee marked; with ``roofline``
    (the same batch sizes), the roofline's bound beside each measured curve, dashed.

    The title's ratios (largest batch against the smallest) are the medians of the rounds' ratios where the points
    keep their rounds. ``knee``: one batch size, None (no knee), or a :class:`KneeRange`: the batch sizes the rounds put it at are
    shaded (up to the largest batch when some round finds none) and the title says what the rounds support."""
    from plotly.subplots import make_subplots
    b = [p.batch for p in points]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("throughput", "per-request latency of one step"))
    fig.add_scatter(x=b, y=[p.tokens_per_s for p in points], name="tokens/s, measured", mode="lines+markers",
                    line_color=PALETTE[0], row=1, col=1)
    fig.add_scatter(x=b, y=[p.latency_s * 1e3 for p in points], name="ms per step, measured", mode="lines+markers",
                    line_color=PALETTE[1], row=1, col=2,
                    error_y=dict(type="data", array=[p.spread_s * 1e3 for p in points], visible=True))
    if roofline is not None:
        if [r.batch for r in roofline] != b:
            raise ValueError("the roofline points must have the sweep's batch sizes")
        fig.add_scatter(x=b, y=[r.tokens_per_s for r in roofline], name="tokens/s, roofline bound",
                        mode="lines", line=dict(color=PALETTE[0], dash="dash"), row=1, col=1)
        fig.add_scatter(x=b, y=[r.step_s * 1e3 for r in roofline], name="ms per step, roofline floor",
                        mode="lines", line=dict(color=PALETTE[1], dash="dash"), row=1, col=2)
    if isinstance(knee, KneeRange):
        if knee.found:
            top = knee.high if knee.high is not None else b[-1]
            for col in (1, 2):
                if top == knee.low:
                    fig.add_vline(x=top, line_dash="dot", line_color=PALETTE[5], row=1, col=col)
                else:
                    fig.add_vrect(x0=knee.low, x1=top, fillcolor=PALETTE[5], opacity=0.12, line_width=0, row=1, col=col)
        knee_text = "<br>" + knee.describe()
    elif knee is not None:
        for col in (1, 2):
            fig.add_vline(x=knee, line_dash="dot", line_color=PALETTE[5], row=1, col=col)
        knee_text = f"; knee at B = {knee}"
    else:
        knee_text = "; no knee in this range"
    first, last = points[0], points[-1]
    if first.samples_s and len(first.samples_s) == len(last.samples_s):     # rounds kept: the median of their ratios
        latency = float(np.median([t1 / t0 for t0, t1 in zip(first.samples_s, last.samples_s)]))
        tput = float(np.median([last.batch / first.batch * t0 / t1 for t0, t1 in zip(first.samples_s, last.samples_s)]))
    else:
        latency, tput = last.step_s / first.step_s, last.tokens_per_s / first.tokens_per_s
    which = " (medians of the rounds' ratios)" if first.samples_s and len(first.samples_s) == len(last.samples_s) else ""
    title = (f"{last.batch / first.batch:.0f}x the requests bring {tput:.1f}x "
             f"the throughput and {latency:.1f}x the latency{which}" + knee_text)
    fig.update_layout(template=TEMPLATE, title=title, height=440, hovermode="closest",
                      legend=dict(orientation="h", x=0, xanchor="left", y=-0.22, yanchor="top"), margin=dict(b=110))
    fig.update_xaxes(type="log", title="batch size B (requests)", tickvals=b)
    fig.update_yaxes(title="tokens/s", row=1, col=1)
    fig.update_yaxes(title="ms per step", row=1, col=2)
    return fig


def gantt_figure(static: Schedule, continuous: Schedule, *, which: str = "") -> go.Figure:
    """Slot occupancy over time under both policies; the same traces whatever the inputs (for widgets).
    ``which``: words the title adds to say which run the two schedules come from."""
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=(f"static: done at {static.makespan_s:.1f} s",
                                        f"continuous: done at {continuous.makespan_s:.1f} s"))
    for row, sched in ((1, static), (2, continuous)):
        spans = sched.spans
        colours = [PALETTE[0] if s.request % 2 else PALETTE[4] for s in spans]
        fig.add_bar(y=[s.slot for s in spans], x=[s.end_s - s.start_s for s in spans], base=[s.start_s for s in spans],
                    orientation="h", marker=dict(color=colours, line=dict(color="white", width=0.5)),
                    name="generating", legendgroup="gen", showlegend=row == 1,
                    customdata=[[s.request, s.end_s - s.start_s, s.heard_s] for s in spans],
                    hovertemplate="request %{customdata[0]}<br>generating %{customdata[1]:.2f} s"
                                  "<br>heard at %{customdata[2]:.2f} s<extra></extra>", row=row, col=1)
        fig.add_bar(y=[s.slot for s in spans], x=[s.heard_s - s.end_s for s in spans], base=[s.end_s for s in spans],
                    orientation="h", marker=dict(color=PALETTE[1], opacity=0.55), name="done, waiting for its batch",
                    legendgroup="wait", showlegend=row == 1, hoverinfo="skip", row=row, col=1)
    speedup = continuous.throughput_tok_s / static.throughput_tok_s
    latency = static.mean_latency_s / continuous.mean_latency_s
    fig.update_layout(template=TEMPLATE, barmode="overlay", height=560, hovermode="closest",
                      legend=dict(orientation="h", x=0, xanchor="left", y=-0.16, yanchor="top"),
                      margin=dict(b=110),
                      title=f"{static.slots} slots: continuous batching gives {speedup:.2f}x the throughput "
                            f"and {latency:.1f}x lower mean latency" + (f" ({which})" if which else ""))
    fig.update_yaxes(title="slot", autorange="reversed")
    fig.update_xaxes(title="time since all requests arrived (s)", row=2, col=1)
    return fig


def policy_gantt(lengths: Sequence[int], slots: int, skew: float, step_cost: Callable[[int], float]) -> go.Figure:
    """The widget's pure function: skew the workload, simulate both policies, draw the Gantt chart."""
    work = skewed_lengths(lengths, skew)
    return gantt_figure(simulate(work, slots, "static", step_cost), simulate(work, slots, "continuous", step_cost))


def block_map_figure(block_tables: dict[int, list[int]], num_blocks: int) -> go.Figure:
    """Which pool block each live sequence uses: one row per sequence; a column hit by several rows is shared."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    users: dict[int, int] = {}
    for table in block_tables.values():
        for b in table:
            users[b] = users.get(b, 0) + 1
    xs, ys, colours, text = [], [], [], []
    for seq_id, table in block_tables.items():
        for pos, b in enumerate(table):
            xs.append(b)
            ys.append(f"seq {seq_id}")
            colours.append(PALETTE[5] if users[b] > 1 else PALETTE[0])
            text.append(f"block {b} = block {pos} of seq {seq_id}; used by {users[b]} sequence(s)")
    summary = sharing_summary(block_tables)
    fig = go.Figure(go.Scatter(x=xs, y=ys, mode="markers", marker=dict(symbol="square", size=11, color=colours),
                               text=text, hoverinfo="text", showlegend=False))
    fig.add_scatter(x=[None], y=[None], mode="markers", marker=dict(symbol="square", color=PALETTE[5]),
                    name="shared block")
    fig.add_scatter(x=[None], y=[None], mode="markers", marker=dict(symbol="square", color=PALETTE[0]),
                    name="private block")
    fig.update_layout(template=TEMPLATE, height=120 + 28 * len(block_tables), hovermode="closest",
                      title=f"{len(block_tables)} sequences name {summary.block_references} blocks but hold "
                            f"{summary.distinct_blocks}: sharing saves {summary.blocks_saved}")
    fig.update_xaxes(title="physical block id in the pool", range=[-1, num_blocks])
    fig.update_yaxes(title="sequence", autorange="reversed")
    return fig
