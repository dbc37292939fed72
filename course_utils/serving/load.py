"""Chapter 11 -- offered load against latency: rates set from a server's measured capacity, repeated runs,
queueing read from the time to first token across a run, and the knee.

* :func:`capacity_per_s`: an estimate of the request rate a server can sustain, from its decode step with
  ``slots`` answers in flight and the time a prompt's prefill takes: the sweep's rates are multiples of it.
* :func:`queueing`: one run's verdict. A server that keeps up answers the last requests of a trace about
  as fast as the first ones; one that does not makes each later request wait behind the earlier ones, so
  the time to first token grows with the request's index. The ratio of the median TTFT of the last third
  of the requests to that of the first third is the test (``growth_limit``); served requests per second
  over the arrival window plus the drain, and the drain itself, are reported beside it.
* :func:`served_knee`: over repeated runs at several rates, the highest rate at which no repeat queued and
  the lowest at which every repeat did.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..validation import check_finite, check_positive_int
from .client import ReplayResult
from .metrics import SLO, ServingSummary, goodput, request_metrics

#: A run queued when the last third of its requests waited this many times longer for a first token than the first third
#: (runs that kept up sit well below 1 on this chapter's trace).
GROWTH_LIMIT = 1.5


@dataclass(frozen=True)
class RatePoint:
    """One run of the rate sweep: the offered load (requests/s), which repeat it was, and what the server delivered."""

    rate_per_s: float
    result: ReplayResult
    repeat: int = 0

    @property
    def summary(self) -> ServingSummary:
        return self.result.summary()


def capacity_per_s(batch_tpot_s: float, slots: int, mean_output_tokens: float, prefill_s: float = 0.0) -> float:
    """Requests/s a server can sustain, estimated from its decode step: ``slots`` answers advance one token per step
    of ``batch_tpot_s`` seconds (the per-request time per token with ``slots`` requests at once), so an answer of
    ``mean_output_tokens`` tokens costs ``mean_output_tokens * batch_tpot_s / slots`` seconds of the server's time,
    plus ``prefill_s`` for its prompt (a step that prefills holds up the others). An estimate to set rates from:
    the sweep then finds where the server really stops keeping up."""
    check_finite("batch_tpot_s", batch_tpot_s, minimum=0.0, strict=True)
    check_positive_int("slots", slots)
    check_finite("mean_output_tokens", mean_output_tokens, minimum=0.0, strict=True)
    check_finite("prefill_s", prefill_s, minimum=0.0)
    return 1.0 / (prefill_s + mean_output_tokens * batch_tpot_s / slots)


def slo_from_solo(solo_ttft_s: float, solo_tpot_s: float, *, ttft_factor: float, tpot_factor: float) -> SLO:
    """Objectives as multiples of what one request alone gets: TTFT <= ``ttft_factor`` x the single-request TTFT,
    TPOT <= ``tpot_factor`` x the single-request TPOT (ms, rounded to whole milliseconds)."""
    for name, v in (("solo_ttft_s", solo_ttft_s), ("solo_tpot_s", solo_tpot_s), ("ttft_factor", ttft_factor),
                    ("tpot_factor", tpot_factor)):
        check_finite(name, v, minimum=0.0, strict=True)
    return SLO(ttft_ms=float(round(solo_ttft_s * ttft_factor * 1000)), tpot_ms=float(round(solo_tpot_s * tpot_factor * 1000)))


@dataclass(frozen=True)
class Queueing:
    """One run: offered and served requests/s, the arrival window and the drain after it (s), the median TTFT of
    the first and of the last third of the requests (s), their ratio, and whether the run queued."""

    offered_per_s: float
    served_per_s: float
    arrival_window_s: float
    drain_s: float
    ttft_first_s: float
    ttft_last_s: float
    growth: float
    queued: bool


def queueing(result: ReplayResult, *, growth_limit: float = GROWTH_LIMIT) -> Queueing:
    """Did the server keep up with this run? Its requests in trace order, split in thirds: the run queued when the
    last third's median TTFT is at least ``growth_limit`` times the first third's. Needs 3 successful requests."""
    check_finite("growth_limit", growth_limit, minimum=1.0, strict=True)
    ok = sorted((r for r in result.records if r.success), key=lambda r: r.index)
    if len(ok) < 3:
        raise ValueError(f"a queueing verdict needs at least 3 successful requests, got {len(ok)}")
    ttfts = [request_metrics(r).ttft_s for r in ok]
    third = len(ttfts) // 3
    first, last = float(np.median(ttfts[:third])), float(np.median(ttfts[-third:]))
    growth = last / first if first > 0 else float("inf")
    window = max(r.start_s for r in result.records)
    return Queueing(result.trace.rate_per_s, len(ok) / result.duration_s, window, result.duration_s - window,
                    first, last, growth, growth >= growth_limit)


@dataclass(frozen=True)
class Spread:
    """The median of repeated values and their range."""

    median: float
    low: float
    high: float

    def fmt(self, spec: str = ".2f", unit: str = "") -> str:
        return f"{self.median:{spec}}{unit} ({self.low:{spec}}–{self.high:{spec}})"


def spread(values: Sequence[float]) -> Spread:
    """Median, minimum and maximum of ``values`` (at least one)."""
    if not len(values):
        raise ValueError("spread of no values")
    return Spread(float(np.median(values)), float(min(values)), float(max(values)))


def by_rate(points: Sequence[RatePoint]) -> dict[float, list[RatePoint]]:
    """The sweep's runs grouped by offered rate, in increasing rate."""
    out: dict[float, list[RatePoint]] = {}
    for p in sorted(points, key=lambda p: (p.rate_per_s, p.repeat)):
        out.setdefault(p.rate_per_s, []).append(p)
    return out


@dataclass(frozen=True)
class Knee:
    """Where a server stopped keeping up: ``keeps_up_to`` the highest rate at which no repeat queued (None: it
    queued at every rate), ``queues_from`` the lowest rate at which every repeat did (None: no rate did);
    ``verdicts`` each rate's repeats (True: queued)."""

    keeps_up_to: float | None
    queues_from: float | None
    verdicts: dict[float, list[bool]]

    def sentence(self) -> str:
        rates = list(self.verdicts)
        if self.queues_from is None:
            return (f"it kept up in every repeat up to {rates[-1]:.2f} req/s, the highest rate offered: this trace did "
                    "not reach its knee")
        if self.keeps_up_to is None:
            return (f"it queued in every repeat from {self.queues_from:.2f} req/s, the lowest rate offered: its knee "
                    "lies below that")
        between = [r for r in rates if self.keeps_up_to < r < self.queues_from]
        edge = f" (at {', '.join(f'{r:.2f}' for r in between)} req/s the repeats disagreed)" if between else ""
        return (f"it kept up at {self.keeps_up_to:.2f} req/s and queued at {self.queues_from:.2f} req/s in every "
                f"repeat{edge}: its knee lies between")


def served_knee(points: Sequence[RatePoint], *, growth_limit: float = GROWTH_LIMIT) -> Knee:
    """The knee of one server's sweep, from the queueing verdict of every repeat at every rate."""
    if not points:
        raise ValueError("served_knee needs at least one run")
    verdicts = {rate: [queueing(p.result, growth_limit=growth_limit).queued for p in pts]
                for rate, pts in by_rate(points).items()}
    queues_from = next((r for r, v in verdicts.items() if all(v) and all(all(w) for s, w in verdicts.items() if s > r)),
                       None)
    calm = [r for r, v in verdicts.items() if not any(v) and (queues_from is None or r < queues_from)]
    return Knee(max(calm) if calm else None, queues_from, verdicts)


# --- figures (pure functions of finished runs) ---------------------------------------------------------------------

def rate_sweep_figure(sweeps: dict[str, list[RatePoint]], *, growth_limit: float = GROWTH_LIMIT):
    """Served requests/s, p90 TTFT and TTFT growth (last third / first third) against offered load, per server:
    each repeat a marker, a line through the medians."""
    from plotly.subplots import make_subplots

    from ..plots import PALETTE, TEMPLATE

    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08,
                        subplot_titles=("served vs offered", "p90 TTFT", "TTFT, last third / first third"))
    top = 0.0
    for (name, points), color in zip(sweeps.items(), PALETTE):
        groups = by_rate(points)
        for col, value in ((1, lambda p: p.summary.request_throughput), (2, lambda p: p.summary.ttft.p(90) * 1e3),
                           (3, lambda p: queueing(p.result, growth_limit=growth_limit).growth)):
            xs = [p.rate_per_s for pts in groups.values() for p in pts]
            ys = [value(p) for pts in groups.values() for p in pts]
            fig.add_scatter(x=xs, y=ys, mode="markers", marker=dict(color=color, size=8, opacity=0.6),
                            name=name, legendgroup=name, showlegend=False, row=1, col=col,
                            hovertemplate="offered %{x:.2f} req/s: %{y:.2f}<extra>" + name + "</extra>")
            fig.add_scatter(x=list(groups), y=[float(np.median([value(p) for p in pts])) for pts in groups.values()],
                            mode="lines", line_color=color, name=name, legendgroup=name, showlegend=col == 1,
                            row=1, col=col, hoverinfo="skip")
        top = max(top, max(groups))
    fig.add_scatter(x=[0, top], y=[0, top], mode="lines", line=dict(dash="dot", color="grey"), name="served = offered",
                    row=1, col=1)
    fig.add_hline(y=growth_limit, line_dash="dash", line_color="grey", row=1, col=3,
                  annotation_text=f"queued (×{growth_limit:g})")
    fig.update_layout(template=TEMPLATE, height=440, hovermode="closest",
                      legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="center", x=0.5),
                      title="Past its capacity a server serves less than it is offered, and later requests wait longer")
    fig.update_xaxes(title="offered load (requests/s)")
    fig.update_yaxes(title="requests/s", row=1, col=1)
    fig.update_yaxes(title="ms", row=1, col=2)
    fig.update_yaxes(title="ratio", type="log", row=1, col=3)
    return fig


def goodput_figure(sweeps: dict[str, list[RatePoint]], ttft_ms: float, tpot_ms: float):
    """Goodput (requests/s meeting TTFT <= ``ttft_ms`` and TPOT <= ``tpot_ms``) against offered load, per server:
    the median of the repeats and their range. Pure: recomputed from the recorded runs, nothing is re-measured."""
    from ..plots import PALETTE, figure

    slo = SLO(ttft_ms=ttft_ms, tpot_ms=tpot_ms)
    fig = figure("", "offered load (requests/s)", "goodput (requests/s)", height=420)
    best = (None, 0.0, 0.0)
    for (name, points), color in zip(sweeps.items(), PALETTE):
        groups = by_rate(points)
        s = [spread([goodput(p.result.records, p.result.duration_s, slo) for p in pts]) for pts in groups.values()]
        fig.add_scatter(x=list(groups), y=[x.median for x in s], mode="lines+markers", name=name, line_color=color,
                        error_y=dict(type="data", symmetric=False, array=[x.high - x.median for x in s],
                                     arrayminus=[x.median - x.low for x in s]))
        for rate, x in zip(groups, s):
            if x.median > best[2]:
                best = (name, rate, x.median)
    fig.update_layout(title=f"Under {slo}: the best goodput is {best[2]:.2f} requests/s ({best[0]} offered "
                            f"{best[1]:.2f} req/s)" if best[0] else f"Under {slo}: no request of any run met the objectives")
    return fig
