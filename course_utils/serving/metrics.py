"""Chapter 11 -- what the client records per request, and the metrics of a run as ``vllm bench serve`` defines them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..token_times import inter_token_gaps_s, tpot_s, ttft_s
from ..validation import check_finite, check_positive_int

#: The percentiles every summary reports (p99 always beside its sample size).
PERCENTILES = (50, 90, 99)
#: How vLLM converts an SLO in milliseconds to seconds (kept identical so goodput agrees to the request).
MS_PER_S = 1000


# --- what the client records --------------------------------------------------------------------------------------

@dataclass
class RequestRecord:
    """One request as the client saw it.

    ``start_s``: when it was sent (s after the run started); ``chunk_s``: when each streamed chunk
    that carried output arrived (s after the request was sent); ``output_tokens``: the server's
    ``usage.completion_tokens`` (or, without it, the token ids counted); ``error``: why it failed
    (None when it succeeded).
    """

    index: int
    prompt_tokens: int
    requested_tokens: int
    start_s: float
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and bool(self.chunk_s)


@dataclass(frozen=True)
class RequestMetrics:
    """One successful request's metrics (seconds). ``tpot_s`` is None for a one-token answer (vLLM leaves it out)."""

    ttft_s: float
    tpot_s: float | None
    e2el_s: float
    itl_s: tuple[float, ...]
    output_tokens: int


def request_metrics(record: RequestRecord) -> RequestMetrics:
    """TTFT, TPOT, ITL and E2EL of one successful request, from its chunk arrival times.

    E2EL is the last chunk's arrival, as in vLLM's client. With one chunk there are no gaps; a
    one-chunk answer of several tokens has TPOT 0.
    """
    if not record.success:
        raise ValueError(f"request {record.index} did not succeed ({record.error or 'no output'}): it has no metrics")
    n = record.output_tokens
    check_positive_int(f"the output tokens of request {record.index}", n)
    t = record.chunk_s
    if len(t) >= 2:
        ttft, itl = ttft_s(t), tuple(inter_token_gaps_s(t))
        tpot = tpot_s(t, n_tokens=n) if n > 1 else None
    else:
        ttft, itl = check_finite(f"the chunk time of request {record.index}", t[0], minimum=0.0), ()
        tpot = 0.0 if n > 1 else None
    return RequestMetrics(ttft, tpot, float(t[-1]), itl, n)


# --- the metrics of a run ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Distribution:
    """Summary of one metric's values (seconds): numpy's mean, median, population std and linear percentiles."""

    n: int
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    def p(self, q: float) -> float:
        return self.percentiles[q]


def distribution(values: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> Distribution:
    """Mean, median, std and percentiles of ``values``, computed as vLLM does (an empty list counts as [0])."""
    data = list(values) or 0
    return Distribution(len(values), float(np.mean(data)), float(np.median(data)), float(np.std(data)),
                        {q: float(np.percentile(data, q)) for q in percentiles})


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds (None: no objective on that metric)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self):
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            v = getattr(self, name)
            if v is not None:
                check_finite(f"SLO {name}", v, minimum=0.0, strict=True)

    def as_dict(self) -> dict[str, float]:
        """The objectives as ``vllm bench serve --goodput`` takes them: ``{"ttft": ms, "tpot": ms, ...}``."""
        return {k.removesuffix("_ms"): v for k, v in vars(self).items() if v is not None}

    def __str__(self) -> str:
        return " and ".join(f"{k.upper()} ≤ {v:g} ms" for k, v in self.as_dict().items()) or "no objective"


def meets_slo(m: RequestMetrics, slo: SLO) -> bool:
    """Whether one request met every objective (a one-token answer counts TPOT as 0, as vLLM does)."""
    values = {"ttft": m.ttft_s, "tpot": m.tpot_s or 0.0, "e2el": m.e2el_s}
    return all(limit / MS_PER_S >= values[k] for k, limit in slo.as_dict().items())


@dataclass(frozen=True)
class ServingSummary:
    """The aggregate metrics of one run, as ``vllm bench serve`` reports them (seconds, tokens, requests/s)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    slo: SLO | None
    good_requests: int
    request_goodput: float


def summarize(records: Sequence[RequestRecord], duration_s: float, *, slo: SLO | None = None,
              percentiles: Sequence[float] = PERCENTILES) -> ServingSummary:
    """Aggregate a run's records (in trace order) over ``duration_s`` (the run's wall-clock time)."""
    check_finite("duration_s", duration_s, minimum=0.0, strict=True)
    ok = [r for r in records if r.success]
    metrics = [request_metrics(r) for r in ok]
    ttfts = [m.ttft_s for m in metrics]
    tpots = [m.tpot_s for m in metrics if m.tpot_s is not None and m.output_tokens > 1]
    itls = [g for m in metrics for g in m.itl_s]
    e2els = [m.e2el_s for m in metrics]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = sum(meets_slo(m, slo) for m in metrics) if slo is not None and slo.as_dict() else 0
    return ServingSummary(
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s, total_input_tokens=total_in,
        total_output_tokens=total_out, request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s, total_token_throughput=(total_in + total_out) / duration_s,
        ttft=distribution(ttfts, percentiles), tpot=distribution(tpots, percentiles),
        itl=distribution(itls, percentiles), e2el=distribution(e2els, percentiles),
        slo=slo, good_requests=good, request_goodput=good / duration_s)


def goodput(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> float:
    """Requests per second that met every objective of ``slo``."""
    return summarize(records, duration_s, slo=slo).request_goodput


def split_by_prompt(records: Sequence[RequestRecord], min_long_tokens: int) -> tuple[list[RequestRecord],
                                                                                       list[RequestRecord]]:
    """``(short, long)``: the records whose prompt has fewer than ``min_long_tokens`` tokens, and the others, each
    in the order given (chapter 11's long-prompt trace: how the long prompts' prefill touches the short answers)."""
    check_positive_int("min_long_tokens", min_long_tokens)
    short = [r for r in records if r.prompt_tokens < min_long_tokens]
    return short, [r for r in records if r.prompt_tokens >= min_long_tokens]


@dataclass(frozen=True)
class Stalls:
    """The long gaps of some answers: the gaps longer than ``factor`` times their median gap (``threshold_s``), as
    ``(ended_s, gap_s)`` in the order they ended (s after the run started), grouped by step: gaps that ended within
    half the threshold of each other ended with the same step (every answer in flight waits for it)."""

    median_gap_s: float
    threshold_s: float
    gaps: tuple[tuple[float, float], ...]
    steps: tuple[tuple[float, ...], ...]

    @property
    def count(self) -> int:
        return len(self.gaps)

    @property
    def total_s(self) -> float:
        """The time the answers spent in long gaps, summed over the answers."""
        return float(sum(g for _, g in self.gaps))

    @property
    def step_s(self) -> tuple[float, ...]:
        """Each stalled step's length: the longest gap that ended with it."""
        return tuple(max(s) for s in self.steps)

    @property
    def longest_step(self) -> int | None:
        """The index of the stalled step with the longest gap (None without long gaps)."""
        return max(range(len(self.steps)), key=lambda k: max(self.steps[k]), default=None)

    @property
    def waiting_in_longest(self) -> int:
        """How many answers waited in the step with the longest gap (0 without long gaps)."""
        return 0 if self.longest_step is None else len(self.steps[self.longest_step])

    @property
    def excess_s(self) -> float:
        """The time the answers spent in long gaps beyond a median gap each (a long gap holds a decode step too)."""
        return float(sum(g - self.median_gap_s for _, g in self.gaps))

    @property
    def windows(self) -> tuple[tuple[float, float], ...]:
        """Each stalled step's stall as ``(start_s, end_s)``: ``end_s`` the last end of the gaps that ended with it,
        ``start_s`` that end less the longest of those gaps."""
        out, i = [], 0
        for group in self.steps:
            ends = self.gaps[i:i + len(group)]
            i += len(group)
            out.append((max(e for e, _ in ends) - max(group), max(e for e, _ in ends)))
        return tuple(out)

    def step_of(self, t: float) -> int | None:
        """The index of the stalled step whose stall holds the time ``t`` (s after the run started), or None; a time up
        to half the threshold after a stall's end still belongs to it (the grouping's tolerance: the answers of one
        step see it end a few ms apart)."""
        return next((k for k, (a, b) in enumerate(self.windows) if a <= t <= b + self.threshold_s / 2), None)


def stalls(records: Sequence[RequestRecord], factor: float = 5.0) -> Stalls:
    """The gaps of the successful ``records`` (one server's run) longer than ``factor`` times the median gap, grouped
    by the step they ended with (chapter 11: how a long prefill stalls the answers in flight, whole or in pieces)."""
    check_finite("factor", factor, minimum=1.0)
    ended = [(r.start_s + t, g) for r in records if r.success
             for t, g in zip(r.chunk_s[1:], request_metrics(r).itl_s)]
    if not ended:
        return Stalls(0.0, 0.0, (), ())
    median = float(np.median([g for _, g in ended]))
    threshold = factor * median
    long_ = sorted((t, g) for t, g in ended if g > threshold)
    steps: list[list[float]] = []
    last = None
    for t, g in long_:
        if last is None or t - last > threshold / 2:
            steps.append([])
        steps[-1].append(g)
        last = t
    return Stalls(median, threshold, tuple(long_), tuple(tuple(s) for s in steps))
