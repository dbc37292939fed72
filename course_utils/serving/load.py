"""Chapter 11 -- offered load against latency: rates set from a server's measured capacity, repeated runs,
queueing read from the time to first token across a run, and the knee.

* :func:`capacity_per_s`: an estimate of the request rate a server can sustain, from its decode step with
  ``slots`` answers in flight and the time a prompt's prefill takes: the sweep's rates are multiples of it
  (:func:`sweep_rates`, with a rate every server runs).
* :func:`ttft_growth`: one run's median TTFT of the last third of its requests over that of the first third. A
  server that keeps up answers the last requests about as fast as the first ones; one that does not makes each
  later request wait behind the earlier ones. But the ratio also carries the trace's own shape (a burst of
  arrivals, or long prompts, in one third), at every rate.
* :func:`queueing`: one run's verdict, relative to the same trace at the lowest rate offered: the run queued
  when its growth is at least ``growth_limit`` times the median growth of the lowest rate's repeats (a ratio of
  ratios, in which the trace's shape largely cancels; the repeats' own noise does not). The drain after the last
  arrival is reported beside it.
* :func:`served_knee`: over repeated runs at several rates, the highest rate at which no repeat queued and
  the lowest at which every repeat did; :attr:`Knee.limit_band` the limits that give the same verdicts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..validation import check_finite, check_positive_int
from .client import ReplayResult
from .metrics import SLO, ServingSummary, goodput, request_metrics

#: A run queued when its TTFT growth (last third / first third) is at least this many times that of the same trace at
#: the lowest rate offered. A choice, not a measurement: :attr:`Knee.limit_band` says which limits give the same verdicts.
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


#: A sweep rate this close to the shared rate (relative difference) is not run as well: the shared rate stands for it.
SHARED_RATE_MERGE = 0.2


@dataclass(frozen=True)
class SweepRates:
    """The rates one server's sweep runs (requests/s, rounded to 3 decimals, ascending), and the factor rate the
    shared rate stands for (``replaced``: ``(factor, its rate)``; None when none was left out)."""

    rates: list[float]
    replaced: tuple[float, float] | None = None


def sweep_rates(capacity_per_s: float, factors: Sequence[float], *, shared_per_s: float | None = None,
                merge_within: float = SHARED_RATE_MERGE) -> SweepRates:
    """A server's sweep: ``factors`` x ``capacity_per_s``, plus ``shared_per_s`` (a rate every server runs, so that
    they can be compared at one load). Where the shared rate lies within ``merge_within`` (relative) of one of the
    factor rates, that one (the nearest) is not run: two runs that close offer nearly the same load."""
    check_finite("capacity_per_s", capacity_per_s, minimum=0.0, strict=True)
    if not factors or any(not np.isfinite(f) or f <= 0 for f in factors):
        raise ValueError(f"factors must be a non-empty list of positive numbers, got {list(factors)!r}")
    check_finite("merge_within", merge_within, minimum=0.0)
    own = {float(f): round(float(f) * capacity_per_s, 3) for f in factors}
    if shared_per_s is None:
        return SweepRates(sorted(set(own.values())))
    check_finite("shared_per_s", shared_per_s, minimum=0.0, strict=True)
    shared = round(float(shared_per_s), 3)
    factor, rate = min(own.items(), key=lambda fr: abs(fr[1] / shared - 1))
    replaced = None
    if rate != shared and abs(rate / shared - 1) <= merge_within:
        replaced = (factor, rate)
        own = {f: r for f, r in own.items() if f != factor}
    return SweepRates(sorted(set(own.values()) | {shared}), replaced)


def slo_from_solo(solo_ttft_s: float, solo_tpot_s: float, *, ttft_factor: float, tpot_factor: float) -> SLO:
    """Objectives as multiples of what one request alone gets: TTFT <= ``ttft_factor`` x the single-request TTFT,
    TPOT <= ``tpot_factor`` x the single-request TPOT (ms, rounded to whole milliseconds)."""
    for name, v in (("solo_ttft_s", solo_ttft_s), ("solo_tpot_s", solo_tpot_s), ("ttft_factor", ttft_factor),
                    ("tpot_factor", tpot_factor)):
        check_finite(name, v, minimum=0.0, strict=True)
    return SLO(ttft_ms=float(round(solo_ttft_s * ttft_factor * 1000)), tpot_ms=float(round(solo_tpot_s * tpot_factor * 1000)))


@dataclass(frozen=True)
class Queueing:
    """One run: offered and served requests/s (served: completed over the arrival window plus the drain), the arrival
    window and the drain after it (s), the median TTFT of the first and of the last third of the requests (s), their
    ratio (``growth``), the same trace's growth at the lowest rate (``baseline_growth``), the run's growth over it
    (``relative_growth``), and whether the run queued."""

    offered_per_s: float
    served_per_s: float
    arrival_window_s: float
    drain_s: float
    ttft_first_s: float
    ttft_last_s: float
    growth: float
    baseline_growth: float
    relative_growth: float
    queued: bool


def _thirds(result: ReplayResult) -> tuple[float, float, int]:
    ok = sorted((r for r in result.records if r.success), key=lambda r: r.index)
    if len(ok) < 3:
        raise ValueError(f"a queueing verdict needs at least 3 successful requests, got {len(ok)}")
    ttfts = [request_metrics(r).ttft_s for r in ok]
    third = len(ttfts) // 3
    return float(np.median(ttfts[:third])), float(np.median(ttfts[-third:])), third


def ttft_growth(result: ReplayResult) -> float:
    """The median TTFT of the last third of a run's successful requests (in trace order) over that of the first third.
    Needs 3 successful requests."""
    first, last, _ = _thirds(result)
    return last / first if first > 0 else float("inf")


def queueing(result: ReplayResult, *, baseline_growth: float, growth_limit: float = GROWTH_LIMIT) -> Queueing:
    """Did the server keep up with this run? The run queued when its :func:`ttft_growth` is at least ``growth_limit``
    times ``baseline_growth``, the growth of the same trace at a rate the server keeps up with (:func:`baseline_growth`:
    the lowest rate offered). The trace's own shape -- a burst of arrivals in its first third makes that third wait
    longer at every rate -- is in both and largely cancels. Needs 3 successful requests."""
    check_finite("growth_limit", growth_limit, minimum=1.0, strict=True)
    check_finite("baseline_growth", baseline_growth, minimum=0.0, strict=True)
    first, last, _ = _thirds(result)
    growth = last / first if first > 0 else float("inf")
    relative = growth / baseline_growth
    ok = sum(r.success for r in result.records)
    window = max(r.start_s for r in result.records)
    return Queueing(result.trace.rate_per_s, ok / result.duration_s, window, result.duration_s - window,
                    first, last, growth, baseline_growth, relative, relative >= growth_limit)


def baseline_growth(points: Sequence["RatePoint"]) -> float:
    """The reference of :func:`queueing`: the median :func:`ttft_growth` of the repeats at the lowest rate offered."""
    if not points:
        raise ValueError("baseline_growth needs at least one run")
    lowest = next(iter(by_rate(points).values()))
    return float(np.median([ttft_growth(p.result) for p in lowest]))


def sweep_queueing(points: Sequence["RatePoint"], *, growth_limit: float = GROWTH_LIMIT) -> dict[float, list[Queueing]]:
    """Every run of one server's sweep judged against the same trace at its lowest rate, by rate (increasing)."""
    base = baseline_growth(points)
    return {rate: [queueing(p.result, baseline_growth=base, growth_limit=growth_limit) for p in pts]
            for rate, pts in by_rate(points).items()}


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
    ``verdicts`` each rate's repeats (True: queued); ``relative`` each repeat's TTFT growth over the lowest rate's
    (the figure judged); ``growth_limit`` the limit applied."""

    keeps_up_to: float | None
    queues_from: float | None
    verdicts: dict[float, list[bool]]
    relative: dict[float, list[float]]
    growth_limit: float = GROWTH_LIMIT

    @property
    def limit_band(self) -> tuple[float | None, float | None]:
        """The limits that give every run the same verdict: any limit above the largest relative growth of a run that
        kept up (the first value; None: no run did) and at most the smallest of a run that queued (the second; None:
        none did)."""
        kept = [g for gs in self.relative.values() for g in gs if g < self.growth_limit]
        queued = [g for gs in self.relative.values() for g in gs if g >= self.growth_limit]
        return (max(kept) if kept else None, min(queued) if queued else None)

    def sentence(self) -> str:
        rates = list(self.verdicts)
        n = max((len(v) for v in self.verdicts.values()), default=0)
        every = "in its one run" if n == 1 else "in both repeats" if n == 2 else f"in each of its {n} repeats"
        listed = lambda rs: ", ".join(f"{r:.2f}" for r in rs)                                  # noqa: E731
        mixed = [r for r in rates if any(self.verdicts[r]) and not all(self.verdicts[r])]
        if self.queues_from is None:
            queued = [r for r in rates if any(self.verdicts[r])]
            if not queued:
                return (f"it kept up {every} at every rate up to {rates[-1]:.2f} req/s, the highest offered: this "
                        "trace did not reach its knee")
            return (f"runs queued at {listed(queued)} req/s, but at no rate did every repeat queue with every higher "
                    "rate queued too: this sweep does not bound its knee")
        if self.keeps_up_to is None:
            return (f"it queued {every} at every rate from {self.queues_from:.2f} req/s, the lowest offered: its knee "
                    "lies below that")
        between = [r for r in rates if self.keeps_up_to < r < self.queues_from]
        notes = []
        split = [r for r in between if r in mixed]
        if split:
            notes.append(f"at {listed(split)} req/s the repeats disagreed")
        all_queued = [r for r in between if all(self.verdicts[r])]
        if all_queued:
            notes.append(f"at {listed(all_queued)} req/s every repeat queued, but not at every rate above")
        below = [r for r in rates if r < self.keeps_up_to and any(self.verdicts[r])]
        if below:
            notes.append(f"yet at {listed(below)} req/s, below it, runs queued: the verdicts do not rise with the rate")
        edge = f" ({'; '.join(notes)})" if notes else ""
        return (f"it kept up at {self.keeps_up_to:.2f} req/s and queued at {self.queues_from:.2f} req/s {every}"
                f"{edge}: by the growth test (limit {self.growth_limit:g}×), on this trace its knee lies between "
                "those two rates")


def served_knee(points: Sequence[RatePoint], *, growth_limit: float = GROWTH_LIMIT) -> Knee:
    """The knee of one server's sweep, from the queueing verdict of every repeat at every rate (each judged against
    the same trace at the lowest rate offered, :func:`sweep_queueing`)."""
    if not points:
        raise ValueError("served_knee needs at least one run")
    judged = sweep_queueing(points, growth_limit=growth_limit)
    verdicts = {rate: [q.queued for q in qs] for rate, qs in judged.items()}
    queues_from = next((r for r, v in verdicts.items() if all(v) and all(all(w) for s, w in verdicts.items() if s > r)),
                       None)
    calm = [r for r, v in verdicts.items() if not any(v) and (queues_from is None or r < queues_from)]
    return Knee(max(calm) if calm else None, queues_from, verdicts,
                {rate: [q.relative_growth for q in qs] for rate, qs in judged.items()}, growth_limit)


# --- figures (pure functions of finished runs) ---------------------------------------------------------------------

def rate_sweep_figure(sweeps: dict[str, list[RatePoint]], *, growth_limit: float = GROWTH_LIMIT):
    """The drain after the last arrival (s), p90 TTFT and TTFT growth relative to the lowest rate against offered load,
    per server: each repeat a marker, a line through the medians."""
    from plotly.subplots import make_subplots

    from ..plots import PALETTE, TEMPLATE

    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08,
                        subplot_titles=("drain after the last arrival", "p90 TTFT",
                                        "TTFT growth over the lowest rate's"))
    for (name, points), color in zip(sweeps.items(), PALETTE):
        groups = by_rate(points)
        judged = sweep_queueing(points, growth_limit=growth_limit)
        for col, value in ((1, lambda p, q: q.drain_s), (2, lambda p, q: p.summary.ttft.p(90) * 1e3),
                           (3, lambda p, q: q.relative_growth)):
            pairs = [(p, q) for rate, pts in groups.items() for p, q in zip(pts, judged[rate])]
            fig.add_scatter(x=[p.rate_per_s for p, _ in pairs], y=[value(p, q) for p, q in pairs], mode="markers",
                            marker=dict(color=color, size=8, opacity=0.6), name=name, legendgroup=name,
                            showlegend=False, row=1, col=col,
                            hovertemplate="offered %{x:.2f} req/s: %{y:.2f}<extra>" + name + "</extra>")
            fig.add_scatter(x=list(groups), y=[float(np.median([value(p, q) for p, q in zip(pts, judged[rate])]))
                                               for rate, pts in groups.items()],
                            mode="lines", line_color=color, name=name, legendgroup=name, showlegend=col == 1,
                            row=1, col=col, hoverinfo="skip")
    fig.add_hline(y=growth_limit, line_dash="dash", line_color="grey", row=1, col=3,
                  annotation_text=f"queued (×{growth_limit:g})")
    fig.update_layout(template=TEMPLATE, height=440, hovermode="closest",
                      legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="center", x=0.5),
                      title="Against offered load: the drain after the last arrival, the p90 TTFT, and the TTFT's "
                            "growth across the trace relative to the lowest rate")
    fig.update_xaxes(title="offered load (requests/s)")
    fig.update_yaxes(title="s", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="ms", row=1, col=2)
    fig.update_yaxes(title="ratio", type="log", row=1, col=3)
    return fig


def ttft_by_index_figure(sweeps: dict[str, list[RatePoint]], *, capacity: dict[str, float] | None = None):
    """Each request's TTFT (ms) against its place in the trace, one panel per server, one line per run (a colour per
    offered rate); dotted lines mark the first and the last third, the two that :func:`ttft_growth` compares."""
    from plotly.subplots import make_subplots

    from ..plots import PALETTE, TEMPLATE

    names = list(sweeps)
    fig = make_subplots(rows=1, cols=len(names), shared_yaxes=True, horizontal_spacing=0.05, subplot_titles=names)
    for col, name in enumerate(names, start=1):
        groups = by_rate(sweeps[name])
        for k, (rate, pts) in enumerate(groups.items()):
            color = PALETTE[k % len(PALETTE)]
            label = f"{rate:.2f} req/s" + (f" ({rate / capacity[name]:.2f}×)" if capacity and name in capacity else "")
            for j, p in enumerate(pts):
                ok = sorted((r for r in p.result.records if r.success), key=lambda r: r.index)
                fig.add_scatter(x=[r.index for r in ok], y=[request_metrics(r).ttft_s * 1e3 for r in ok],
                                mode="lines+markers", line=dict(color=color, width=1.5, dash="solid" if j == 0 else "dot"),
                                marker=dict(size=4, color=color), name=f"{name}: {label}", legendgroup=f"{name}{rate}",
                                showlegend=j == 0, row=1, col=col,
                                hovertemplate="request %{x}: TTFT %{y:,.0f} ms<extra>" + f"{name}, {label}, repeat {p.repeat}"
                                              + "</extra>")
        n = max(len(p.result.records) for p in sweeps[name])
        third = n // 3
        for x in (third - 0.5, n - third - 0.5):
            fig.add_vline(x=x, line_dash="dot", line_color="grey", row=1, col=col)
        fig.update_xaxes(title="request (trace order)", row=1, col=col)
    fig.update_yaxes(title="TTFT (ms)", type="log", row=1, col=1)
    fig.update_layout(template=TEMPLATE, height=460, hovermode="closest",
                      legend=dict(orientation="h", yanchor="top", y=-0.2, xanchor="center", x=0.5),
                      title="Each request's TTFT in trace order, one line per run (dotted: later repeats); "
                            "the grey lines bound the first and the last third")
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
