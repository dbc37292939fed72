"""Small statistics for comparisons over a few repeated runs (chapter 09 and after).

A difference measured on n seeds (or runs) is judged by Student's t on n − 1 degrees of freedom, not by "two
standard errors": with three seeds the 97.5 % quantile of t is 4.30, not 1.96. :func:`t_p_value` is the exact
two-sided tail for a whole number of degrees of freedom (Abramowitz and Stegun 26.7.3 and 26.7.4: a finite sum in
θ = arctan(t / √ν)), so no statistics library is needed; :func:`t_quantile` inverts it; :func:`paired_t_test` tests
the mean of paired differences and gives its confidence interval. :func:`binomial_p_value` is the exact
two-sided binomial test (chapter 08: kept guesses against their expected rate).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence


def _check_df(df) -> int:
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be a whole number >= 1, got {df!r}")
    return df


def t_p_value(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom (two-sided), exact for whole ``df``."""
    _check_df(df)
    t = float(t)
    if math.isnan(t):
        raise ValueError("t is NaN")
    if math.isinf(t):
        return 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:                                   # odd: (2/π)(θ + sin θ cos θ (1 + 2/3 cos²θ + 2·4/(3·5) cos⁴θ + …))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= (2 * k) / (2 * k + 1) * c2
            total += term
        inside = 2 / math.pi * (theta + s * math.cos(theta) * total)
    else:                                        # even: sin θ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + …)
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= (2 * k - 1) / (2 * k) * c2
            total += term
        inside = s * total
    return min(1.0, max(0.0, 1.0 - inside))


def t_quantile(df: int, two_sided_level: float = 0.05) -> float:
    """The t with P(|T| >= t) = ``two_sided_level`` (4.30 for df = 2 at 0.05; 1.96 as df grows)."""
    _check_df(df)
    if not 0.0 < two_sided_level < 1.0:
        raise ValueError(f"the level is a probability in (0, 1), got {two_sided_level!r}")
    lo, hi = 0.0, 1.0
    while t_p_value(hi, df) > two_sided_level:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_p_value(mid, df) > two_sided_level:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class PairedTest:
    """A paired t-test of ``a − b`` over n pairs: mean difference, its standard error, t on n − 1 degrees of
    freedom, the two-sided p-value and the (1 − level) confidence interval of the mean difference."""

    n: int
    mean: float
    se: float
    t: float
    df: int
    p_value: float
    low: float
    high: float
    level: float

    def verdict(self, a: str, b: str, lower_is_better: bool = True) -> str:
        """"``a`` better", "``b`` better" or "within noise", at the test's level (two-sided)."""
        if not self.p_value < self.level:
            return "within noise"
        a_lower = self.mean < 0
        return f"{a} better" if a_lower == lower_is_better else f"{b} better"


def paired_t_test(a: Sequence[float], b: Sequence[float], *, level: float = 0.05) -> PairedTest:
    """Student's paired t-test of the mean of ``a[i] − b[i]`` (each pair one seed, one run, ...)."""
    a, b = [float(x) for x in a], [float(x) for x in b]
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"need two equally long lists of at least 2 paired values, got {len(a)} and {len(b)}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"the level is a probability in (0, 1), got {level!r}")
    d = [x - y for x, y in zip(a, b)]
    n, mean = len(d), statistics.mean(d)
    se = statistics.stdev(d) / math.sqrt(n)
    df = n - 1
    if se == 0.0:
        t = 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
    else:
        t = mean / se
    half = t_quantile(df, level) * se
    return PairedTest(n, mean, se, t, df, t_p_value(t, df) if not (se == 0.0 and mean == 0.0) else 1.0,
                      mean - half, mean + half, level)


def binomial_p_value(k: int, n: int, p: float) -> float:
    """Two-sided exact binomial test: is ``k`` successes in ``n`` trials consistent with success probability ``p``?

    The probability, under Binomial(n, p), of an outcome no more likely than ``k`` (the usual "sum of the smaller
    probabilities" rule). With p = 0 or 1 only one outcome is possible: 1.0 for it, 0.0 for any other.
    """
    if not (isinstance(n, int) and n > 0 and isinstance(k, int) and 0 <= k <= n):
        raise ValueError(f"need whole numbers 0 <= k <= n with n > 0; got k={k!r}, n={n!r}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p is a probability, in [0, 1]; got {p!r}")
    if p in (0.0, 1.0):
        return float(k == round(p * n))

    def log_pmf(i):
        return math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p)

    logs = [log_pmf(i) for i in range(n + 1)]
    cut = logs[k] + 1e-9                                   # ties with k's own probability count as extreme
    top = max(logs)
    return min(1.0, sum(math.exp(v - top) for v in logs if v <= cut) * math.exp(top))


def proportions_apart(k_a: int, n_a: int, k_b: int, n_b: int, *, z: float = 2.0) -> bool:
    """Whether two rates, ``k_a`` successes of ``n_a`` and ``k_b`` of ``n_b``, lie more than ``z`` standard errors
    apart: the two-proportion comparison, its standard error from the pooled rate. It treats every trial as
    independent; where neighbouring trials are not (the guesses of one draft pass), it is optimistic. A group of no
    trials has no rate to compare: never apart."""
    for name, k, n in (("a", k_a, n_a), ("b", k_b, n_b)):
        if not (isinstance(n, int) and isinstance(k, int) and 0 <= k <= n):
            raise ValueError(f"group {name}: need whole numbers 0 <= k <= n, got k={k!r}, n={n!r}")
    if not z > 0:
        raise ValueError(f"z must be positive, got {z!r}")
    if n_a == 0 or n_b == 0:
        return False
    pooled = (k_a + k_b) / (n_a + n_b)
    se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / n_a + 1 / n_b))
    return abs(k_a / n_a - k_b / n_b) > z * se
