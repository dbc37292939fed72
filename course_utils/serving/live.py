"""Chapter 11 -- the live check: the course client and ``vllm bench serve`` on the same requests, request by request.

Both clients send the same requests, one at a time (each meets an idle server), in rounds that alternate
between them. For each request, the two clients must agree on:

* the output tokens, exactly (both read the server's ``usage``);
* the time to first token, each client's fastest round, within half of one decode step of that server. A client
  that stamps a token at the wrong streamed chunk -- the first token at the second chunk, every chunk after the
  whole body has arrived -- moves it by at least one step in every round, its fastest included; a round slowed by
  the machine (a client or the server waiting for a CPU) only ever adds time, and the fastest leaves it out as long
  as one round was not slowed. A client late in only some rounds is not seen.
  Errors smaller than that (where on loopback the send is stamped, a client's own parsing) change it by a few
  milliseconds at most, and are not what this check is for;
* the time from first to last token (E2EL - TTFT), each client's median over its rounds, within half a step
  plus the round-to-round variation for
  that request (server, clients and machine together): the largest difference between two rounds of the same
  client, of either figure. That time spans the whole
  answer, so a busy machine moves it by more than a step between two rounds of one client; a comparison of
  two clients cannot be tighter than that. A client that stamps tokens late as it falls behind reading them
  is off by more.

The step is measured by vLLM's client on the same requests: the median of (E2EL - TTFT) / (tokens - 1).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..validation import check_finite, check_positive_int
from .client import ReplayResult
from .metrics import request_metrics


@dataclass(frozen=True)
class RequestTimes:
    """One request as one client measured it: when it was sent (``time.perf_counter()``, s), its time to first token
    and end-to-end latency (s), and the output tokens the server reported."""

    sent_at: float
    ttft_s: float
    e2el_s: float
    output_tokens: int

    @property
    def decode_s(self) -> float:
        """First token to last (s)."""
        return self.e2el_s - self.ttft_s


def times_from_records(result: ReplayResult) -> list[RequestTimes]:
    """The course client's figures of one replay, request by request (every request must have succeeded)."""
    if result.failed:
        raise ValueError(f"{len(result.failed)} request(s) of this replay failed: no figures to compare")
    out = []
    for r in result.records:
        m = request_metrics(r)
        out.append(RequestTimes(result.started_at + r.start_s, m.ttft_s, m.e2el_s, r.output_tokens))
    return out


def times_from_bench(saved: dict) -> list[RequestTimes]:
    """``vllm bench serve``'s figures of one run, request by request, from its saved detailed result (``--save-result
    --save-detailed``: ``start_times``, ``ttfts``, ``latencies``, ``output_lens``, ``errors``; seconds)."""
    try:
        cols = [saved[k] for k in ("start_times", "ttfts", "latencies", "output_lens")]
    except KeyError as exc:
        raise ValueError(f"not a detailed vllm bench serve result: no {exc.args[0]!r}") from None
    if any(saved.get("errors") or []):
        raise ValueError(f"vllm bench serve reported failed requests: {[e for e in saved['errors'] if e][:3]}")
    return [RequestTimes(float(s), float(t), float(e), int(n)) for s, t, e, n in zip(*cols)]


def in_turns(rounds: int, ours: Callable[[], list[RequestTimes]], theirs: Callable[[], list[RequestTimes]], *,
             progress: bool = False) -> tuple[list[list[RequestTimes]], list[list[RequestTimes]]]:
    """``rounds`` rounds of each client, taking turns: ours, theirs, ours, theirs, ... Two rounds in a row are never
    one client's, so a slow spell of the machine over two rounds in a row slows one round of each. ``ours()`` and
    ``theirs()`` each run one round and return its figures, request by request. Returns both clients' rounds, in
    order, for :func:`agreement`. ``progress``: a progress bar, moved between rounds."""
    from ..progress import progress_bar
    check_positive_int("rounds", rounds)
    done: tuple[list, list] = ([], [])
    with progress_bar(None, "live check", enabled=progress, total=2 * rounds, unit="round") as bar:
        for _ in range(rounds):
            for side, run in zip(done, (ours, theirs)):
                side.append(run())
                bar.update(1)
    return done


@dataclass(frozen=True)
class RequestAgreement:
    """One request: each client's TTFT in its fastest round and median first-to-last-token time over its rounds (s), its
    tokens, and the largest difference between two rounds of the same client, TTFT or first-to-last token (s; how much
    the server itself varied)."""

    index: int
    output_tokens: int
    ttft_ours_s: float
    ttft_theirs_s: float
    decode_ours_s: float
    decode_theirs_s: float
    round_to_round_s: float

    @property
    def ttft_diff_s(self) -> float:
        return self.ttft_ours_s - self.ttft_theirs_s

    @property
    def decode_diff_s(self) -> float:
        return self.decode_ours_s - self.decode_theirs_s


@dataclass(frozen=True)
class ClientAgreement:
    """The live check's verdict: per-request rows, the decode step (s) and the tolerance (s), and what failed."""

    rows: list[RequestAgreement]
    step_s: float
    tolerance_s: float
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures


def _check_rounds(name: str, rounds: Sequence[Sequence[RequestTimes]]) -> int:
    if not rounds or not all(len(r) for r in rounds):
        raise ValueError(f"{name}: at least one round of at least one request is needed")
    n = len(rounds[0])
    if any(len(r) != n for r in rounds):
        raise ValueError(f"{name}: every round must hold the same requests, got {[len(r) for r in rounds]}")
    return n


def agreement(ours: Sequence[Sequence[RequestTimes]], theirs: Sequence[Sequence[RequestTimes]], *,
              fraction_of_step: float = 0.5) -> ClientAgreement:
    """Compare two clients' rounds of the same requests (``ours[k][i]``: round k, request i), request by request.

    Tokens must be equal; each request's TTFT in each client's fastest round (a disturbed round only adds time) must
    agree within ``fraction_of_step`` of the decode step that
    ``theirs`` measured (the median, over requests of more than one token, of their rounds' (E2EL - TTFT) /
    (tokens - 1)), and its median first-to-last-token time within that plus the request's round-to-round range.
    """
    n = _check_rounds("ours", ours)
    if _check_rounds("theirs", theirs) != n:
        raise ValueError(f"the two clients ran different numbers of requests ({n} vs {len(theirs[0])})")
    check_finite("fraction_of_step", fraction_of_step, minimum=0.0, strict=True)
    steps = [t.decode_s / (t.output_tokens - 1) for rnd in theirs for t in rnd if t.output_tokens > 1]
    if not steps:
        raise ValueError("no request of more than one token: the decode step cannot be measured")
    step = float(np.median(steps))
    tol = fraction_of_step * step
    rows, failures = [], []
    for i in range(n):
        mine, yours = [rnd[i] for rnd in ours], [rnd[i] for rnd in theirs]
        tokens = {t.output_tokens for t in mine + yours}
        if len(tokens) > 1:
            failures.append(f"request {i}: output tokens differ between rounds or clients {sorted(tokens)}")
        spread = max(max(v) - min(v) for v in ([t.ttft_s for t in mine], [t.decode_s for t in mine],
                                                [t.ttft_s for t in yours], [t.decode_s for t in yours]))
        row = RequestAgreement(i, mine[0].output_tokens, min(t.ttft_s for t in mine), min(t.ttft_s for t in yours),
                               float(np.median([t.decode_s for t in mine])),
                               float(np.median([t.decode_s for t in yours])), spread)
        rows.append(row)
        if abs(row.ttft_diff_s) > tol:
            failures.append(f"request {i}: TTFT differs by {row.ttft_diff_s * 1e3:+.1f} ms (each client's fastest "
                            f"round), more than half a step ({tol * 1e3:.1f} ms)")
        if abs(row.decode_diff_s) > tol + spread:
            failures.append(f"request {i}: the first-to-last-token time differs by {row.decode_diff_s * 1e3:+.1f} ms, "
                            f"more than half a step plus its round-to-round range ({(tol + spread) * 1e3:.1f} ms)")
    return ClientAgreement(rows, step, tol, failures)


def machine_busy(margin: float = 1.0) -> tuple[bool, str]:
    """Whether work crowds this machine's CPUs now: the one-minute load average above the number of CPUs plus
    ``margin``. The limit is a choice, not a measurement: the average lags (it weighs the last minute or more) and
    counts every process, the servers and clients of the check included. Returns (busy, a description). Where the
    load average is unknown (Windows), the machine counts as not busy. On a busy machine each client's process waits
    its turn for a CPU before it reads a chunk, by tens of milliseconds: the live check cannot resolve half a step."""
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return False, f"load average unknown here ({cpus} CPUs)"
    return load > cpus + margin, f"one-minute load average {load:.1f} on {cpus} CPUs"
