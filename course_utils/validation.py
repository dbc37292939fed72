"""Checks of user input shared by every module: a clear ``ValueError`` instead of a failure deep in torch.

Each check returns the value it accepted, so a caller can write ``n = check_positive_int("n", n)``.
"""
from __future__ import annotations

import math
from numbers import Real


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(name: str, value) -> int:
    """``value`` must be an integer >= 1 (a bool is not an integer here)."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_non_negative_int(name: str, value) -> int:
    """``value`` must be an integer >= 0."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def check_positive_ints(name: str, values) -> list[int]:
    """A non-empty list of integers >= 1, e.g. batch sizes or context lengths."""
    values = list(values)
    if not values:
        raise ValueError(f"{name} must name at least one value")
    for v in values:
        check_positive_int(f"every entry of {name}", v)
    return values


def check_finite(name: str, value, *, minimum: float | None = None, strict: bool = False) -> float:
    """A finite real number, optionally ``>= minimum`` (``> minimum`` with ``strict``)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and (value < minimum or (strict and value == minimum)):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}, got {value!r}")
    return float(value)
