"""The chapter's workload: 64 answer lengths (median 18, longest 231, 1,874 in total) and a dial for their skew."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def round_preserving_total(x: Sequence[float], total: int) -> np.ndarray:
    """Round non-negative reals to integers that sum exactly to ``total`` (largest remainders get +1)."""
    x = np.asarray(x, dtype=float)
    if np.any(x < 0) or not math.isclose(x.sum(), total, rel_tol=1e-9, abs_tol=1e-6):
        raise ValueError(f"need non-negative values summing to {total}, got sum {x.sum():.6g}")
    out = np.floor(x).astype(int)
    short = total - int(out.sum())
    out[np.argsort(-(x - out), kind="stable")[:short]] += 1
    return out


def _upper_tail(u: np.ndarray, median: float, longest: float, target: float) -> np.ndarray:
    """Map ``u`` in (0, 1) to ``median + (longest - median) * u ** q``, with q chosen so they sum to ``target``."""
    lo, hi = 1e-3, 1e3                                          # the shape exponent: larger -> smaller sum
    for _ in range(200):
        q = math.sqrt(lo * hi)
        if (median + (longest - median) * u ** q).sum() > target:
            lo = q
        else:
            hi = q
    return median + (longest - median) * u ** math.sqrt(lo * hi)


def syllabus_output_lengths(n: int = 64, *, median: int = 18, longest: int = 231, total: int = 1874,
                            seed: int = 0, sigma: float = 1.0) -> np.ndarray:
    """Output lengths of ``n`` requests, in queue order: a seeded log-normal draw, adjusted to the targets.

    The draw's order and ranks are kept; the lower half is scaled so its top sits at the
    median, the upper half is bent (a power curve, chosen by bisection) to run from the
    median to ``longest`` and make the total come out exactly. The two middle requests are
    set to ``median``. Raises ``ValueError`` when the targets cannot be met.
    """
    if n < 4 or n % 2 or not 1 <= median < longest or total <= median * n // 2 + longest:
        raise ValueError(f"cannot build {n} lengths with median {median}, longest {longest}, total {total}")
    raw = np.random.default_rng(seed).lognormal(0.0, sigma, n)
    order = np.argsort(raw, kind="stable")
    s = raw[order]
    half, mid = n // 2, (s[n // 2 - 1] + s[n // 2]) / 2
    lower = np.maximum(1.0, median * s[:half - 1] / mid)
    rest = total - lower.round().sum() - 2 * median - longest
    if not median * (half - 1) < rest < longest * (half - 1):
        raise ValueError("the lower half leaves a total the upper half cannot reach")
    upper = _upper_tail((s[half + 1:n - 1] - mid) / (s[-1] - mid), median, longest, rest)
    lengths = np.concatenate([lower.round(), [median, median], round_preserving_total(upper, round(rest)), [longest]])
    lengths = np.clip(lengths, 1, longest).astype(int)
    out = np.empty(n, dtype=int)
    out[order] = lengths
    return out


def skewed_lengths(base: Sequence[int], skew: float) -> np.ndarray:
    """Blend ``base`` with equal lengths: skew 0 -> all (nearly) equal, 1 -> ``base``; the total is kept."""
    base = np.asarray(base)
    if base.ndim != 1 or len(base) == 0 or np.any(base < 1):
        raise ValueError("base must be a non-empty list of lengths >= 1")
    if not 0.0 <= skew <= 1.0:
        raise ValueError(f"skew must lie in [0, 1], got {skew!r}")
    total = int(base.sum())
    mixed = (1 - skew) * total / len(base) + skew * base
    return np.maximum(1, round_preserving_total(mixed, total))
