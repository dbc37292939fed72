"""Static vs continuous batching simulated: a workload replayed through slots, each step charged the measured cost."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..engine import POLICIES
from ..validation import check_positive_int
from .sweep import SweepPoint, _check_batch_sizes


@dataclass(frozen=True)
class StepCost:
    """Seconds of one decode step as a function of the batch size, from measured points.

    Linear interpolation between the measured batch sizes, made non-decreasing (a larger
    batch never costs less than a smaller one: the dips are noise); below the smallest
    measured batch it is flat, beyond the largest it continues the last segment's slope.
    """

    batches: tuple[int, ...]
    step_s: tuple[float, ...]

    def __post_init__(self):
        _check_batch_sizes(self.batches)
        if len(self.batches) != len(self.step_s) or any(not s > 0 for s in self.step_s):
            raise ValueError("need one positive step time per batch size")

    @classmethod
    def from_sweep(cls, points: Sequence[SweepPoint]) -> "StepCost":
        return cls(tuple(p.batch for p in points), tuple(p.step_s for p in points))

    def __call__(self, batch: int) -> float:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        s = np.maximum.accumulate(np.asarray(self.step_s, dtype=float))
        b = np.asarray(self.batches, dtype=float)
        if batch <= b[-1] or len(b) == 1:
            return float(np.interp(batch, b, s))
        slope = max(0.0, (s[-1] - s[-2]) / (b[-1] - b[-2]))
        return float(s[-1] + slope * (batch - b[-1]))


@dataclass(frozen=True)
class Span:
    """One request in the simulation: its slot, when it was admitted, its last token, when it was heard (s)."""

    request: int
    slot: int
    start_s: float
    end_s: float
    heard_s: float


@dataclass(frozen=True)
class Schedule:
    """The result of :func:`simulate`; every request arrived at t = 0."""

    policy: str
    slots: int
    spans: tuple[Span, ...]
    tokens: int
    n_steps: int

    @property
    def makespan_s(self) -> float:
        return max(s.heard_s for s in self.spans)

    @property
    def throughput_tok_s(self) -> float:
        return self.tokens / self.makespan_s

    @property
    def latencies_s(self) -> np.ndarray:
        """Seconds from arrival (t = 0) until each request is heard: what a user waits."""
        return np.array([s.heard_s for s in sorted(self.spans, key=lambda s: s.request)])

    @property
    def mean_latency_s(self) -> float:
        return float(self.latencies_s.mean())

    @property
    def p95_latency_s(self) -> float:
        return float(np.percentile(self.latencies_s, 95))

    @property
    def latencies_from_admission_s(self) -> np.ndarray:
        """Seconds from getting a slot (a static batch's start) until each request is heard: the queue left out."""
        return np.array([s.heard_s - s.start_s for s in sorted(self.spans, key=lambda s: s.request)])

    @property
    def mean_latency_from_admission_s(self) -> float:
        return float(self.latencies_from_admission_s.mean())

    @property
    def p95_latency_from_admission_s(self) -> float:
        return float(np.percentile(self.latencies_from_admission_s, 95))

    @property
    def generating_s(self) -> np.ndarray:
        """Seconds from getting a slot until each request's own last token (whether heard then or not)."""
        return np.array([s.end_s - s.start_s for s in sorted(self.spans, key=lambda s: s.request)])

    @property
    def padding_share(self) -> float:
        """Share of the slot time held by requests that were done but not yet heard (static batching's
        padding): sum(heard - end) / sum(heard - start); 0 under continuous batching."""
        held = sum(s.heard_s - s.start_s for s in self.spans)
        return sum(s.heard_s - s.end_s for s in self.spans) / held if held > 0 else 0.0


def _check_workload(lengths, slots: int) -> list[int]:
    lengths = [int(x) for x in lengths]
    if not lengths or min(lengths) < 1:
        raise ValueError("lengths must be a non-empty list of output lengths >= 1")
    check_positive_int("slots", int(slots) if isinstance(slots, np.integer) else slots)
    return lengths


def _simulate_static(lengths: list[int], slots: int, step_cost: Callable[[int], float], padding: bool) -> Schedule:
    spans, t, n_steps = [], 0.0, 0
    for first in range(0, len(lengths), slots):
        batch = lengths[first:first + slots]
        start, ends = t, []
        for step in range(max(batch)):
            active = len(batch) if padding else sum(1 for n in batch if n > step)
            t += step_cost(active)
            ends.append(t)
        n_steps += max(batch)
        spans += [Span(first + j, j, start, ends[n - 1], t) for j, n in enumerate(batch)]
    return Schedule("static", slots, tuple(spans), sum(lengths), n_steps)


def _simulate_continuous(lengths: list[int], slots: int, step_cost: Callable[[int], float]) -> Schedule:
    queue, free, active = list(range(len(lengths))), list(range(slots)), {}
    left, start, spans, t, n_steps = list(lengths), {}, [], 0.0, 0
    while queue or active:
        while queue and free:                                      # a free slot takes the next request at once
            r = queue.pop(0)
            active[r] = free.pop(0)
            start[r] = t
        t += step_cost(len(active))
        n_steps += 1
        for r in list(active):
            left[r] -= 1
            if left[r] == 0:
                spans.append(Span(r, active[r], start[r], t, t))
                free.append(active.pop(r))
        free.sort()
    return Schedule("continuous", slots, tuple(sorted(spans, key=lambda s: s.request)), sum(lengths), n_steps)


def simulate(lengths: Sequence[int], slots: int, policy: str, step_cost: Callable[[int], float], *,
             static_padding: bool = True) -> Schedule:
    """Replay requests (all queued at t = 0, in order) through ``slots`` slots; one token per request per step.

    ``static``: take the next ``slots`` requests, run until the longest is done; a request is
    heard when its whole batch finishes. With ``static_padding`` (what ``generate`` does)
    finished requests keep being computed, so each step costs ``step_cost(batch size)``.
    ``continuous``: a slot that frees up takes the next request in the following step; a
    request is heard when its own last token is produced. Each step costs
    ``step_cost(requests in slots)`` seconds. Prefill is not modelled.
    """
    lengths = _check_workload(lengths, slots)
    if policy == "static":
        return _simulate_static(lengths, slots, step_cost, static_padding)
    if policy == "continuous":
        return _simulate_continuous(lengths, slots, step_cost)
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
