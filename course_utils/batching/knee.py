"""Where growing the batch stops paying: the knee of the measured sweep, and how firmly the rounds place it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .sweep import SweepPoint, _check_batch_sizes


def find_knee(batch_sizes: Sequence[int], tokens_per_s: Sequence[float], *, min_gain: float = 0.25) -> int | None:
    """The batch size after which every further doubling buys less than ``min_gain`` more throughput.

    Scanning from the largest batch down, the knee sits just after the last step up that
    still paid at least ``min_gain`` per doubling (a single noisy dip at small batches does
    not end the search). Gains between batch sizes that are not a doubling apart are scaled
    to one doubling (``ratio ** (1 / log2(B2 / B1))``). Returns None when even the largest
    step up still pays, i.e. there is no knee in the measured range.
    """
    sizes = _check_batch_sizes(batch_sizes)
    if len(sizes) != len(tokens_per_s) or len(sizes) < 2:
        raise ValueError("need one throughput per batch size, and at least two batch sizes")
    if any(not t > 0 for t in tokens_per_s):
        raise ValueError("throughputs must be positive")
    gains = [(t2 / t1) ** (1 / math.log2(b2 / b1)) - 1
             for b1, b2, t1, t2 in zip(sizes, sizes[1:], tokens_per_s, tokens_per_s[1:])]
    if gains[-1] >= min_gain:
        return None
    paid = [i for i, g in enumerate(gains) if g >= min_gain]
    return sizes[paid[-1] + 1] if paid else sizes[0]


@dataclass(frozen=True)
class DoublingGain:
    """Throughput gained from batch ``b1`` to ``b2``, per doubling of the batch: the median over
    the sweep's rounds and the lowest and highest round (0.5 = 50 % more tokens/s per doubling)."""

    b1: int
    b2: int
    median: float
    low: float
    high: float


def _gain_per_doubling(b1: int, b2: int, t1_s: float, t2_s: float) -> float:
    return ((b2 / t2_s) / (b1 / t1_s)) ** (1 / math.log2(b2 / b1)) - 1


def _rounds(points: Sequence[SweepPoint]) -> int:
    n = {len(p.samples_s) for p in points}
    if len(n) != 1 or not min(n):
        raise ValueError("every sweep point needs the same number of per-round samples (decode_step_sweep keeps them)")
    return n.pop()


def doubling_gains(points: Sequence[SweepPoint]) -> list[DoublingGain]:
    """The gain per doubling between consecutive batch sizes, round by round (rounds are interleaved,
    so round r of every batch size ran under the same conditions), summarised as median / low / high."""
    n = _rounds(points)
    out = []
    for p, q in zip(points, points[1:]):
        g = [_gain_per_doubling(p.batch, q.batch, p.samples_s[r], q.samples_s[r]) for r in range(n)]
        out.append(DoublingGain(p.batch, q.batch, float(np.median(g)), min(g), max(g)))
    return out


def knees_per_round(points: Sequence[SweepPoint], *, min_gain: float = 0.25) -> list[int | None]:
    """:func:`find_knee` applied to each timed round alone: how stable the knee is from round to round."""
    n = _rounds(points)
    b = [p.batch for p in points]
    return [find_knee(b, [p.batch / p.samples_s[r] for p in points], min_gain=min_gain) for r in range(n)]


@dataclass(frozen=True)
class KneeRange:
    """Where the rounds of a sweep put the knee: :func:`find_knee` on each timed round alone (``knees[r]``,
    None where that round finds no knee up to ``largest_batch``). A verdict no firmer than the rounds agree."""

    knees: tuple[int | None, ...]
    largest_batch: int

    @property
    def found(self) -> list[int]:
        """The knees of the rounds that found one, smallest first."""
        return sorted(k for k in self.knees if k is not None)

    @property
    def rounds_without(self) -> int:
        return sum(k is None for k in self.knees)

    @property
    def agreed(self) -> bool:
        """Every round puts the knee at the same batch size (or every round finds none)."""
        return len(set(self.knees)) == 1

    @property
    def low(self) -> int | None:
        """The smallest batch size a round puts the knee at (None: no round finds one)."""
        return self.found[0] if self.found else None

    @property
    def high(self) -> int | None:
        """The largest batch size a round puts the knee at; None when some round finds none (the range is open)."""
        return None if self.rounds_without else self.found[-1]

    def contains(self, batch: int | None) -> bool:
        """Whether a knee at ``batch`` (None: no knee in the range) is what at least one round found, or lies
        between the rounds' knees."""
        if batch is None:
            return self.rounds_without > 0
        return self.low is not None and self.low <= batch and (self.high is None or batch <= self.high)

    def describe(self) -> str:
        """The verdict in words: one batch size only when every round agrees."""
        n = len(self.knees)
        if not self.found:
            return f"no knee up to B = {self.largest_batch} in any of the {n} rounds"
        if self.agreed:
            return f"the knee at B = {self.low} in every one of the {n} rounds"
        if self.rounds_without:
            where = (f"at B = {self.low}" if self.low == self.found[-1] else
                     f"between B = {self.low} and B = {self.found[-1]}")
            return (f"no firm knee: {n - self.rounds_without} of {n} rounds put it {where}, {self.rounds_without} "
                    f"find none up to B = {self.largest_batch}")
        return f"the knee somewhere from B = {self.low} to B = {self.high} (the {n} rounds disagree)"


def knee_range(points: Sequence[SweepPoint], *, min_gain: float = 0.25) -> KneeRange:
    """The knee as the rounds support it: :func:`knees_per_round`, summarised as a range of batch sizes."""
    return KneeRange(tuple(knees_per_round(points, min_gain=min_gain)), points[-1].batch)
