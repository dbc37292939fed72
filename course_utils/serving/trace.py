"""Chapter 11 -- the trace: who asks what, and when (prompts, exact output lengths, arrival times)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ..validation import check_finite, check_positive_int

ARRIVAL_PROCESSES = ("poisson", "fixed")


def arrival_times_s(n: int, rate_per_s: float, *, process: str = "poisson", seed: int = 0) -> np.ndarray:
    """When each of ``n`` requests is sent (s after the run starts), as ``vllm bench serve`` schedules them.

    The gap before each request, the first one included, is drawn from an exponential distribution
    of mean 1 / rate (``"poisson"``) or is exactly 1 / rate (``"fixed"``); the cumulative times are
    then rescaled so that the last request goes out at n / rate, as vLLM does to steady its
    throughput across seeds. ``rate_per_s = inf`` sends every request at t = 0.
    """
    check_positive_int("n", n)
    if process not in ARRIVAL_PROCESSES:
        raise ValueError(f"process must be one of {ARRIVAL_PROCESSES}, got {process!r}")
    if isinstance(rate_per_s, bool) or not isinstance(rate_per_s, (int, float)) or not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be a positive number of requests per second (or inf), got {rate_per_s!r}")
    if math.isinf(rate_per_s):
        return np.zeros(n)
    gaps = (np.full(n, 1.0 / rate_per_s) if process == "fixed"
            else np.random.default_rng(seed).exponential(1.0 / rate_per_s, n))
    times = np.cumsum(gaps)
    return times * ((n / rate_per_s) / times[-1])


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: its prompt (text, or token ids), its prompt length and exact output length
    (tokens), and when it is sent (s after the run starts)."""

    prompt: str | tuple[int, ...]
    prompt_tokens: int
    output_tokens: int
    arrival_s: float


@dataclass(frozen=True)
class Trace:
    """A request trace: requests in arrival order, and how their arrival times were drawn."""

    requests: tuple[TraceRequest, ...]
    rate_per_s: float
    process: str = "poisson"
    seed: int = 0

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    def shifted(self, seconds: float) -> "Trace":
        """The same trace, every request sent ``seconds`` later."""
        check_finite("seconds", seconds, minimum=0.0)
        return Trace(tuple(replace(r, arrival_s=r.arrival_s + seconds) for r in self.requests), self.rate_per_s,
                     self.process, self.seed)

    def at_rate(self, rate_per_s: float, *, process: str | None = None, seed: int | None = None) -> "Trace":
        """The same requests (prompts and lengths) arriving at another rate."""
        process = self.process if process is None else process
        seed = self.seed if seed is None else seed
        times = arrival_times_s(len(self), rate_per_s, process=process, seed=seed)
        return Trace(tuple(replace(r, arrival_s=float(t)) for r, t in zip(self.requests, times)),
                     rate_per_s, process, seed)


def _check_prompt(i: int, prompt) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"request {i}: the prompt is empty")
        return prompt
    if isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return tuple(int(t) for t in prompt)
    raise ValueError(f"request {i}: a prompt must be a non-empty string or a non-empty list of token ids (ints >= 0), "
                     f"got {type(prompt).__name__}")


def make_trace(prompts: Sequence, output_tokens: Sequence[int], *, rate_per_s: float, process: str = "poisson",
               seed: int = 0, prompt_tokens: Sequence[int] | None = None) -> Trace:
    """A trace from prompts (strings or token-id lists) and their exact output lengths.

    ``prompt_tokens``: the prompts' lengths in tokens (default: the length of each token-id list;
    required for text prompts). Bad input raises ``ValueError`` naming the request.
    """
    if isinstance(prompts, (str, bytes)) or not len(prompts):
        raise ValueError("prompts must be a non-empty list of prompts (strings or token-id lists)")
    if len(output_tokens) != len(prompts):
        raise ValueError(f"got {len(output_tokens)} output lengths for {len(prompts)} prompts")
    checked = [_check_prompt(i, p) for i, p in enumerate(prompts)]
    if prompt_tokens is None:
        if any(isinstance(p, str) for p in checked):
            raise ValueError("text prompts need their lengths in tokens: pass prompt_tokens")
        prompt_tokens = [len(p) for p in checked]
    if len(prompt_tokens) != len(prompts):
        raise ValueError(f"got {len(prompt_tokens)} prompt lengths for {len(prompts)} prompts")
    for i, (p, n) in enumerate(zip(prompt_tokens, output_tokens)):
        check_positive_int(f"the prompt length of request {i}", int(p) if isinstance(p, np.integer) else p)
        check_positive_int(f"the output length of request {i}", int(n) if isinstance(n, np.integer) else n)
    times = arrival_times_s(len(checked), rate_per_s, process=process, seed=seed)
    return Trace(tuple(TraceRequest(p, int(pt), int(n), float(t))
                       for p, pt, n, t in zip(checked, prompt_tokens, output_tokens, times)),
                 rate_per_s, process, seed)


def skewed_trace(tok, n: int = 32, *, rate_per_s: float = 2.0, process: str = "poisson", seed: int = 0,
                 median_output: int = 12, longest_output: int = 64, total_output: int | None = None,
                 prompt_tokens: tuple[int, int] = (16, 96)) -> Trace:
    """The chapter's default workload: chapter 04's skewed answer lengths behind book prompts of varied length.

    Output lengths: :func:`~course_utils.batching.syllabus_output_lengths` (a seeded log-normal draw
    adjusted to ``median_output``, ``longest_output`` and ``total_output``; default total
    ``n * (median + longest) // 4``, which keeps chapter 04's ratio of mean to median). Prompt
    lengths: seeded, log-uniform in ``prompt_tokens`` (inclusive); the prompts are consecutive
    pieces of *Pride and Prejudice*, as token ids.
    """
    from ..batching import syllabus_output_lengths
    from ..prompts import book_token_ids

    check_positive_int("n", n)
    if not isinstance(prompt_tokens, (tuple, list)) or len(prompt_tokens) != 2:
        raise ValueError(f"prompt_tokens must be (shortest, longest), got {prompt_tokens!r}")
    lo, hi = prompt_tokens
    check_positive_int("the shortest prompt", lo)
    if not isinstance(hi, int) or hi < lo:
        raise ValueError(f"prompt_tokens must be (shortest, longest) with longest >= shortest, got {prompt_tokens!r}")
    total = n * (median_output + longest_output) // 4 if total_output is None else total_output
    lengths = syllabus_output_lengths(n, median=median_output, longest=longest_output, total=total, seed=seed)
    rng = np.random.default_rng(seed + 1)
    p_lens = np.round(np.exp(rng.uniform(np.log(lo), np.log(hi), n))).astype(int).clip(lo, hi)
    ids = book_token_ids(tok, int(p_lens.sum()))[0].tolist()
    starts = np.concatenate([[0], np.cumsum(p_lens)[:-1]])
    prompts = [ids[s:s + k] for s, k in zip(starts, p_lens)]
    return make_trace(prompts, [int(x) for x in lengths], rate_per_s=rate_per_s, process=process, seed=seed)


def long_prompt_positions(n_long: int, n_short: int) -> list[int]:
    """Where the long requests sit among ``n_long + n_short`` requests (0-based, increasing): spread evenly, each
    after at least one short one, so that short answers are being decoded when a long prompt arrives."""
    check_positive_int("n_long", n_long)
    check_positive_int("n_short", n_short)
    step = (n_long + n_short) / (n_long + 1)               # >= 1: the positions are distinct and inside the trace
    return [math.floor(k * step + 0.5) for k in range(1, n_long + 1)]


def _check_range(name: str, bounds) -> tuple[int, int]:
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise ValueError(f"{name} must be (shortest, longest) in tokens, got {bounds!r}")
    lo, hi = bounds
    check_positive_int(f"the shortest of {name}", lo)
    if not isinstance(hi, int) or isinstance(hi, bool) or hi < lo:
        raise ValueError(f"{name} must be (shortest, longest) with longest >= shortest, got {bounds!r}")
    return lo, hi


def long_prompt_lengths(n_long: int, n_short: int, *, long_tokens: tuple[int, int] = (768, 1024),
                        short_tokens: tuple[int, int] = (16, 64), seed: int = 0) -> list[int]:
    """The prompt lengths (tokens, in arrival order) of :func:`long_prompt_trace`: ``n_long`` long prompts, seeded
    uniform in ``long_tokens`` (inclusive), at :func:`long_prompt_positions`; ``n_short`` short ones, seeded
    log-uniform in ``short_tokens``, everywhere else. Every short prompt must be shorter than every long one."""
    check_positive_int("n_long", n_long)
    check_positive_int("n_short", n_short)
    long_lo, long_hi = _check_range("long_tokens", long_tokens)
    short_lo, short_hi = _check_range("short_tokens", short_tokens)
    if short_hi >= long_lo:
        raise ValueError(f"the short prompts must be shorter than the long ones: short_tokens {tuple(short_tokens)} "
                         f"reaches long_tokens {tuple(long_tokens)}")
    rng = np.random.default_rng(seed)
    longs = rng.integers(long_lo, long_hi + 1, n_long).tolist()
    shorts = np.round(np.exp(rng.uniform(np.log(short_lo), np.log(short_hi), n_short))).astype(int)
    shorts = shorts.clip(short_lo, short_hi).tolist()
    where = set(long_prompt_positions(n_long, n_short))
    return [int(longs.pop(0) if i in where else shorts.pop(0)) for i in range(n_long + n_short)]


def long_prompt_trace(tok, n_long: int = 2, n_short: int = 6, *, long_tokens: tuple[int, int] = (768, 1024),
                      short_tokens: tuple[int, int] = (16, 64), long_output: int = 8, short_output: int = 32,
                      rate_per_s: float = 4.0, process: str = "fixed", seed: int = 0) -> Trace:
    """Chapter 11's long-prompt trace, where chunked prefill acts: a few long prompts among short ones.

    Prompt lengths: :func:`long_prompt_lengths` (the long requests spread evenly among the short ones, after at
    least one); output lengths fixed: ``long_output`` tokens for a long prompt, ``short_output`` for a short one;
    arrivals: :func:`arrival_times_s` (default: one request every 1 / ``rate_per_s`` s). The prompts are
    consecutive pieces of *Pride and Prejudice*, as token ids. A request is long when its prompt has at least
    ``long_tokens[0]`` tokens.
    """
    from ..prompts import book_token_ids

    check_positive_int("long_output", long_output)
    check_positive_int("short_output", short_output)
    lengths = long_prompt_lengths(n_long, n_short, long_tokens=long_tokens, short_tokens=short_tokens, seed=seed)
    ids = book_token_ids(tok, sum(lengths))[0].tolist()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    prompts = [ids[s:s + k] for s, k in zip(starts, lengths)]
    outputs = [long_output if k >= long_tokens[0] else short_output for k in lengths]
    return make_trace(prompts, outputs, rate_per_s=rate_per_s, process=process, seed=seed)
