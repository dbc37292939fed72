"""The per-request serving times of a token stream: TTFT, TPOT and the gaps between tokens.

Pure functions of the tokens' arrival times (numpy only, no torch), so that a client process that only measures
a server imports nothing heavy. Chapter 02 defines them (:mod:`course_utils.prefill_decode` re-exports them);
chapter 11's metrics (:mod:`course_utils.serving.metrics`) reuse them.
"""
from __future__ import annotations

import math

import numpy as np

from .validation import check_positive_int


def _check_arrivals(arrival_s) -> np.ndarray:
    t = np.asarray(list(arrival_s), dtype=float)
    if t.ndim != 1 or t.size < 2:
        raise ValueError(f"need the arrival times of at least 2 tokens, got {t.size}")
    if not np.all(np.isfinite(t)):
        raise ValueError("arrival times must be finite numbers (seconds since the request was sent)")
    if t[0] < 0:
        raise ValueError(f"arrival times are seconds since the request was sent, so >= 0; got {t[0]}")
    if np.any(np.diff(t) < 0):
        raise ValueError("arrival times must be sorted (non-decreasing): token i+1 cannot arrive before token i")
    return t


def ttft_s(arrival_s) -> float:
    """Time to first token: request sent (t = 0) to the first token's arrival."""
    return float(_check_arrivals(arrival_s)[0])


def inter_token_gaps_s(arrival_s) -> list[float]:
    """ITL: every gap between consecutive tokens (n - 1 values)."""
    return np.diff(_check_arrivals(arrival_s)).tolist()


def tpot_s(arrival_s, end_s: float | None = None, *, n_tokens: int | None = None) -> float:
    """Time per output token after the first: (end-to-end latency - TTFT) / (tokens - 1).

    ``end_s`` (when the response completed) defaults to the last token's arrival.
    ``n_tokens``: how many tokens the stream delivered, when a streamed chunk may hold several
    (chapter 11's servers); default one token per arrival.
    """
    t = _check_arrivals(arrival_s)
    end = float(t[-1]) if end_s is None else float(end_s)
    if not math.isfinite(end) or end < t[-1]:
        raise ValueError(f"end_s must be a number >= the last arrival ({t[-1]}), got {end_s!r}")
    if n_tokens is None:
        return float(end - t[0]) / (t.size - 1)
    check_positive_int("n_tokens", n_tokens)
    if n_tokens < t.size:
        raise ValueError(f"n_tokens ({n_tokens}) cannot be fewer than the {t.size} arrivals that carried tokens")
    return float(end - t[0]) / (n_tokens - 1)
