"""Chapter 11 -- serving for real: a request trace, one streaming client, the metrics of ``vllm bench serve``.

* **The trace** (:class:`Trace`): who asks what, and when -- each request's prompt, its exact
  output length and its arrival time. Arrivals follow :func:`arrival_times_s` (a Poisson process
  or a fixed rate, seeded), scheduled the way ``vllm bench serve`` schedules them.
  :func:`skewed_trace` builds the default workload: chapter 04's skewed answer lengths behind
  prompts cut from *Pride and Prejudice*.
* **The client** (:func:`replay`): sends every request of a trace at its arrival time to an
  OpenAI-compatible ``/v1/completions`` endpoint (streaming, asynchronous, any number in flight)
  and records when each streamed chunk arrives (:class:`RequestRecord`). Output lengths are
  enforced the same way on every server: ``max_tokens`` with ``ignore_eos``, greedy
  (``temperature = 0``). Tokens are counted from the server's ``usage`` field
  (``completion_tokens``); the token ids come from ``return_token_ids`` (a vLLM extension that the
  course engine's server speaks too).
* **The metrics**, defined as ``vllm bench serve`` defines them (its ``calculate_metrics``):

  - TTFT: request sent -> first streamed chunk;
  - TPOT: (E2EL - TTFT) / (output tokens - 1), one value per request with more than one token;
  - ITL: every gap between two consecutive streamed chunks, pooled over all requests (a chunk may
    hold several tokens, so ITL and TPOT differ when servers batch their output);
  - E2EL: request sent -> last streamed chunk;
  - request and token throughput: completed requests (tokens) / the run's duration;
  - goodput: requests per second that met every SLO (e.g. TTFT <= 500 ms and TPOT <= 100 ms).

  The per-request quantities reuse chapter 02's :func:`~course_utils.prefill_decode.ttft_s`,
  :func:`~course_utils.prefill_decode.tpot_s` and :func:`~course_utils.prefill_decode.inter_token_gaps_s`.
  Aggregates use numpy exactly as vLLM does (mean, median, population std, linear percentiles),
  so the same records give the same figures to the last bit (checked in chapter 11 and in the tests).
* **Server processes** (:class:`ServerProcess`): a server started on loopback as its own process
  group and stopped with everything it started -- by ``stop()``, at the end of a ``with`` block,
  at interpreter exit, and (on Linux) when the process that started it dies.
"""
from __future__ import annotations

import asyncio
import atexit
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from .peak_rss import SERVER_ENV, PeakSampler
from .prefill_decode import inter_token_gaps_s, tpot_s, ttft_s
from .validation import check_finite, check_non_negative_int, check_positive_int

#: The percentiles every summary reports (p99 always beside its sample size).
PERCENTILES = (50, 90, 99)
#: How vLLM converts an SLO in milliseconds to seconds (kept identical so goodput agrees to the request).
MS_PER_S = 1000
ARRIVAL_PROCESSES = ("poisson", "fixed")


# --- the trace ---------------------------------------------------------------------------------------------------

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
    from .batching import syllabus_output_lengths
    from .prompts import book_token_ids

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


# --- the client ----------------------------------------------------------------------------------------------------

class ServerUnreachable(ConnectionError):
    """No server answered at the given address."""


class ReplayError(RuntimeError):
    """Some requests of a replay failed; ``result`` holds every record, the finished ones included."""

    def __init__(self, message: str, result: "ReplayResult"):
        super().__init__(message)
        self.result = result


@dataclass
class ReplayResult:
    """Every request of one replay (in trace order), the run's wall-clock duration, and where it ran."""

    records: list[RequestRecord]
    duration_s: float
    url: str
    model: str
    trace: Trace

    @property
    def failed(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.success]

    def summary(self, slo: SLO | None = None, percentiles: Sequence[float] = PERCENTILES) -> ServingSummary:
        return summarize(self.records, self.duration_s, slo=slo, percentiles=percentiles)


def completion_payload(model: str, request: TraceRequest, *, ignore_eos: bool = True) -> dict:
    """The ``/v1/completions`` body the client sends: streamed, greedy, exactly ``output_tokens`` tokens."""
    return {"model": model, "prompt": request.prompt if isinstance(request.prompt, str) else list(request.prompt),
            "max_tokens": request.output_tokens, "temperature": 0.0, "ignore_eos": ignore_eos,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


def _error_text(status: int, body: bytes) -> str:
    try:
        err = json.loads(body)
        msg = err.get("error", {}).get("message") if isinstance(err.get("error"), dict) else err.get("message")
        msg = msg or err.get("detail") or body.decode(errors="replace")
    except (ValueError, AttributeError):
        msg = body.decode(errors="replace")
    return f"HTTP {status}: {str(msg).strip()[:300]}"


async def _stream_one(client, url: str, model: str, index: int, request: TraceRequest, run_t0: float,
                      *, ignore_eos: bool) -> RequestRecord:
    """Send one request and record every streamed chunk's arrival; a failure is recorded, not raised."""
    import httpx

    t0 = time.perf_counter()
    rec = RequestRecord(index, request.prompt_tokens, request.output_tokens, t0 - run_t0)
    done = False
    try:
        async with client.stream("POST", url, json=completion_payload(model, request, ignore_eos=ignore_eos)) as resp:
            if resp.status_code != 200:
                rec.error = _error_text(resp.status_code, await resp.aread())
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue                                  # blank separators, SSE comments (pings)
                data = line[5:].strip()
                if data == "[DONE]":      # read on to the end of the body: the connection then goes back to the
                    done = True           # pool, as with vLLM's client, instead of a new one for every request
                    continue
                msg = json.loads(data)
                if "error" in msg:
                    rec.error = f"the server reported an error mid-stream: {msg['error']}"
                    return rec
                if msg.get("choices"):
                    now = time.perf_counter()
                    choice = msg["choices"][0]
                    ids = choice.get("token_ids") or []
                    rec.chunk_s.append(now - t0)
                    rec.chunk_tokens.append(len(ids))
                    rec.token_ids += ids
                    rec.text += choice.get("text") or ""
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
                elif msg.get("usage"):
                    usage = msg["usage"]
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_tokens = int(usage["prompt_tokens"])
    except (httpx.HTTPError, OSError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return rec
    if not done:
        rec.error = f"the server closed the stream after {len(rec.chunk_s)} chunk(s), before [DONE]"
    elif not rec.chunk_s:
        rec.error = "the stream carried no output"
    elif rec.output_tokens == 0:
        rec.output_tokens = len(rec.token_ids)            # no usage chunk: count the token ids
        if rec.output_tokens == 0:
            rec.error = "the server reported neither usage nor token ids: cannot count output tokens"
    return rec


async def check_server(base_url: str, *, timeout_s: float = 5.0) -> list[str]:
    """The model names a server offers (``GET /v1/models``); :class:`ServerUnreachable` if nothing answers."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            resp = await client.get(base_url.rstrip("/") + "/v1/models")
    except (httpx.HTTPError, OSError) as exc:
        raise ServerUnreachable(f"no server answers at {base_url} ({type(exc).__name__}: {exc}). Start it first "
                                "(chapter 11 starts its servers with start_engine_server / start_vllm_server).") from None
    if resp.status_code != 200:
        raise ServerUnreachable(f"{base_url} answered {resp.status_code} to GET /v1/models: not an OpenAI-compatible "
                                "server?")
    return [m.get("id") for m in resp.json().get("data", [])]


async def replay_async(base_url: str, model: str, trace: Trace, *, max_concurrency: int | None = None,
                       warmup: int = 1, ignore_eos: bool = True, progress: bool = True,
                       strict: bool = True) -> ReplayResult:
    """Replay ``trace`` against the server at ``base_url``: each request is sent at its arrival time.

    ``max_concurrency``: at most this many requests in flight (a request due while the limit is
    reached waits, as in ``vllm bench serve --max-concurrency``); ``warmup``: requests (copies of
    the first) sent one by one before the clock starts. The run's duration runs from its start
    to the last response. With ``strict`` a run in which a request failed raises
    :class:`ReplayError` after every request has ended; its ``result`` holds every record.
    """
    import httpx

    from .progress import progress_bar

    if not isinstance(trace, Trace) or not len(trace):
        raise ValueError("trace must be a non-empty Trace (make_trace or skewed_trace)")
    if max_concurrency is not None:
        check_positive_int("max_concurrency", max_concurrency)
    check_non_negative_int("warmup", warmup)
    base = base_url.rstrip("/")
    names = await check_server(base)
    if names and model not in names:
        raise ValueError(f"the server at {base} serves {names}, not {model!r}")
    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits, trust_env=False) as client:
        for _ in range(warmup):
            rec = await _stream_one(client, url, model, -1, trace.requests[0], time.perf_counter(),
                                    ignore_eos=ignore_eos)
            if not rec.success:
                raise ReplayError(f"the warm-up request failed: {rec.error}",
                                  ReplayResult([rec], 0.0, base, model, trace))
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = progress_bar(None, f"replay at {trace.rate_per_s:g} req/s", enabled=progress, total=len(trace),
                           unit="request")

        async def one(i: int, req: TraceRequest, run_t0: float) -> RequestRecord:
            if gate is None:
                rec = await _stream_one(client, url, model, i, req, run_t0, ignore_eos=ignore_eos)
            else:
                async with gate:
                    rec = await _stream_one(client, url, model, i, req, run_t0, ignore_eos=ignore_eos)
            bar.update(1)
            return rec

        run_t0 = time.perf_counter()
        tasks = []
        for i, req in enumerate(trace.requests):
            wait = run_t0 + req.arrival_s - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(i, req, run_t0)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - run_t0
        bar.close()
    result = ReplayResult(records, duration, base, model, trace)
    if strict and result.failed:
        first = result.failed[0]
        raise ReplayError(f"{len(result.failed)} of {len(records)} requests failed (first: request {first.index}: "
                          f"{first.error}); {len(records) - len(result.failed)} finished and are kept in "
                          "this error's .result", result)
    return result


def run_sync(coro):
    """Run a coroutine to completion from synchronous code, also inside Jupyter (whose loop is already running)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=target, name="course-replay")
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def replay(base_url: str, model: str, trace: Trace, **kw) -> ReplayResult:
    """:func:`replay_async` from synchronous code (a notebook cell, a script, a test)."""
    return run_sync(replay_async(base_url, model, trace, **kw))


# --- server processes ----------------------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child, before exec (Linux): receive SIGTERM when the process that started it dies."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


_LIVE: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


@atexit.register
def stop_all_servers() -> None:
    """Stop every server this process started and has not stopped yet."""
    for server in list(_LIVE):
        server.stop()


class ServerProcess:
    """A server started as a child process (its own process group) on loopback.

    ``start()`` launches ``command`` and waits until ``GET base_url + ready_path`` answers 200;
    ``stop()`` ends the whole process group (SIGTERM, then SIGKILL after ``grace_s``) and any
    descendant left over. Also stopped at the end of a ``with`` block, at interpreter exit, and
    -- on Linux -- when the process that started it dies. ``peak_rss`` holds the peak resident
    memory of each of its processes (bytes), sampled while it runs; ``startup_s`` the start-up time.
    """

    def __init__(self, command: list[str], *, base_url: str, name: str, env: dict | None = None,
                 log_path: str | Path | None = None, ready_path: str = "/health", timeout_s: float = 600.0,
                 grace_s: float = 15.0, cwd: str | Path | None = None):
        self.command, self.base_url, self.name = list(command), base_url.rstrip("/"), name
        self.env, self.cwd = env, cwd
        self.log_path = Path(log_path) if log_path else None
        self.ready_path, self.timeout_s, self.grace_s = ready_path, timeout_s, grace_s
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._process_peaks: dict[int, tuple[str, int]] = {}
        self.peak_total_rss = 0
        self._tree: list = []
        self._samples = 0
        self._sampler: PeakSampler | None = None
        self._log = None

    # memory ----------------------------------------------------------------------------------------------------
    def _processes(self, *, refresh: bool = True):
        """The server's processes, root first. Listing children scans every process of the machine, so the
        sampler refreshes the list only every few samples (``refresh=False`` reuses the last list)."""
        import psutil
        if not refresh and self._tree:
            return self._tree
        try:
            root = psutil.Process(self.proc.pid)
            self._tree = [root] + root.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            self._tree = []
        return self._tree

    def _read_rss(self) -> int:
        total, self._samples = 0, self._samples + 1
        for i, p in enumerate(self._processes(refresh=self._samples % 5 == 1)):
            try:
                rss, name = p.memory_info().rss, (self.name if i == 0 else p.name())
            except Exception:   # noqa: BLE001 -- gone between listing and reading
                continue
            _, peak = self._process_peaks.get(p.pid, (name, 0))
            self._process_peaks[p.pid] = (name, max(peak, rss))      # its latest name (vLLM renames its workers)
            total += rss
        self.peak_total_rss = max(self.peak_total_rss, total)
        return total

    @property
    def peak_rss(self) -> dict[str, int]:
        """Peak RSS (bytes) of each process the server ran, by process name (the largest where several share one).

        A process forked from a large one counts the pages it shares with it, so these do not add up.
        """
        out: dict[str, int] = {}
        for name, peak in self._process_peaks.values():
            out[name] = max(out.get(name, 0), peak)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    # life cycle ------------------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n_lines: int = 25) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n_lines:])

    def start(self, *, progress: bool = True) -> "ServerProcess":
        if self.proc is not None:
            raise RuntimeError(f"{self.name} was already started")
        env = dict(os.environ if self.env is None else self.env, **{SERVER_ENV: self.name})
        kw: dict = dict(env=env, cwd=self.cwd, stdin=subprocess.DEVNULL)
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "wb")
            kw.update(stdout=self._log, stderr=subprocess.STDOUT)
        else:
            kw.update(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if os.name == "nt":
            kw["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP
        else:
            kw["start_new_session"] = True
            if sys.platform.startswith("linux"):
                kw["preexec_fn"] = die_with_parent
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.command, **kw)
        _LIVE.add(self)
        self._sampler = PeakSampler(self._read_rss, interval_s=0.4)
        self._sampler.start()
        try:
            self._wait_ready(t0, progress)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _wait_ready(self, t0: float, progress: bool) -> None:
        import urllib.error
        import urllib.request

        from .progress import progress_bar

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))      # loopback: never a proxy
        with progress_bar(None, f"starting {self.name}", enabled=progress, total=None, unit="s") as bar:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} while starting. "
                                       f"Last lines of its log ({self.log_path}):\n{self.log_tail()}")
                try:
                    with opener.open(self.base_url + self.ready_path, timeout=2) as resp:
                        if resp.status == 200:
                            return
                except (urllib.error.URLError, OSError, ValueError):
                    pass
                if time.perf_counter() - t0 > self.timeout_s:
                    raise TimeoutError(f"{self.name} did not become ready within {self.timeout_s:.0f} s. "
                                       f"Last lines of its log ({self.log_path}):\n{self.log_tail()}")
                time.sleep(0.5)
                bar.update(0.5)

    def stop(self) -> int | None:
        """End the server and everything it started; returns its exit code (None if it was never started)."""
        if self.proc is None:
            return None
        import psutil

        survivors = self._processes()
        if self.proc.poll() is None:
            try:
                if os.name == "nt":
                    self.proc.send_signal(signal.CTRL_BREAK_EVENT)
                else:
                    os.killpg(self.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError, OSError):
                pass
            try:
                self.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                pass
        _, alive = psutil.wait_procs([p for p in survivors if p.is_running()], timeout=1)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        if os.name != "nt":
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)      # anything still in the group
            except (ProcessLookupError, PermissionError, OSError):
                pass
        code = self.proc.wait()
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        if self._log is not None:
            self._log.close()
            self._log = None
        _LIVE.discard(self)
        return code

    def __enter__(self) -> "ServerProcess":
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else ("stopped" if self.proc else "not started")
        return f"ServerProcess({self.name!r}, {self.base_url}, {state})"


# --- figures (pure functions of finished runs) ---------------------------------------------------------------------

def _ms(values) -> list[float]:
    return [v * 1e3 for v in values]


def _ecdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def latency_cdf_figure(results: dict[str, ReplayResult]):
    """TTFT and TPOT distributions (empirical CDFs, ms) of each server's run of the same trace, side by side."""
    from plotly.subplots import make_subplots

    from .plots import PALETTE, TEMPLATE

    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT", "TPOT"), horizontal_spacing=0.1)
    medians = {}
    for (name, res), color in zip(results.items(), PALETTE):
        ok = [request_metrics(r) for r in res.records if r.success]
        for col, values in ((1, [m.ttft_s for m in ok]), (2, [m.tpot_s for m in ok if m.tpot_s is not None])):
            xs, ys = _ecdf(_ms(values))
            fig.add_scatter(x=xs, y=ys, mode="lines+markers", line_shape="hv", name=name, legendgroup=name,
                            showlegend=col == 1, line_color=color, row=1, col=col,
                            hovertemplate="%{x:,.0f} ms: %{y:.0%} of requests<extra>" + name + "</extra>")
        medians[name] = res.summary().ttft.median
    fastest = min(medians, key=medians.get)
    if len(medians) == 1:
        title = f"{fastest}: median TTFT {medians[fastest] * 1e3:,.0f} ms"
    else:
        slowest = max(medians, key=medians.get)
        title = (f"Same trace: {fastest}'s median TTFT is {medians[fastest] * 1e3:,.0f} ms, {slowest}'s "
                 f"{medians[slowest] * 1e3:,.0f} ms")
    fig.update_layout(template=TEMPLATE, height=440, hovermode="closest", title=title,
                      legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="center", x=0.5))
    fig.update_xaxes(title="time to first token (ms)", row=1, col=1)
    fig.update_xaxes(title="time per output token (ms)", row=1, col=2)
    fig.update_yaxes(title="fraction of requests", range=[0, 1.02], row=1, col=1)
    return fig


def timeline_figure(results: dict[str, ReplayResult], *, max_requests: int = 16):
    """When each token arrived (s after the run started), one row per request, for each server: queueing,
    prefill and the rhythm of decode steps made visible."""
    from plotly.subplots import make_subplots

    from .plots import PALETTE, TEMPLATE

    fig = make_subplots(rows=len(results), cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=list(results))
    for row, (name, res) in enumerate(results.items(), start=1):
        shown = res.records[:max_requests]
        fig.add_scatter(x=[r.start_s for r in shown], y=[r.index for r in shown], mode="markers", name="sent",
                        marker=dict(symbol="line-ns-open", size=12, color=PALETTE[5]), showlegend=row == 1,
                        legendgroup="sent", row=row, col=1)
        xs, ys = [], []
        for r in shown:
            xs += [r.start_s + t for t in r.chunk_s] + [None]
            ys += [r.index] * len(r.chunk_s) + [None]
        fig.add_scatter(x=xs, y=ys, mode="markers+lines", name="a streamed chunk", line=dict(width=1, color=PALETTE[0]),
                        marker=dict(size=4, color=PALETTE[0]), showlegend=row == 1, legendgroup="chunk", row=row, col=1)
        fig.update_yaxes(title="request", autorange="reversed", row=row, col=1)
    fig.update_xaxes(title="seconds since the run started", row=len(results), col=1)
    fig.update_layout(template=TEMPLATE, height=260 * len(results) + 120, hovermode="closest",
                      title=f"Token arrivals of the first {max_requests} requests: a mark when sent, a dot per chunk")
    return fig


@dataclass(frozen=True)
class RatePoint:
    """One run of the rate sweep: the offered load (requests/s) and what the server delivered."""

    rate_per_s: float
    result: ReplayResult

    @property
    def summary(self) -> ServingSummary:
        return self.result.summary()


def rate_sweep_figure(sweeps: dict[str, list[RatePoint]]):
    """Throughput and p90 latency against offered load, one line per server: the served version of chapter 04's knee."""
    from plotly.subplots import make_subplots

    from .plots import PALETTE, TEMPLATE

    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08,
                        subplot_titles=("output throughput", "p90 TTFT", "p90 TPOT"))
    for (name, points), color in zip(sweeps.items(), PALETTE):
        rates = [p.rate_per_s for p in points]
        sums = [p.summary for p in points]
        for col, ys in ((1, [s.output_throughput for s in sums]), (2, [s.ttft.p(90) * 1e3 for s in sums]),
                        (3, [s.tpot.p(90) * 1e3 for s in sums])):
            fig.add_scatter(x=rates, y=ys, mode="lines+markers", name=name, legendgroup=name, showlegend=col == 1,
                            line_color=color, row=1, col=col)
    gains = {name: pts[-1].summary.output_throughput / pts[0].summary.output_throughput for name, pts in sweeps.items()}
    load = sweeps[next(iter(sweeps))][-1].rate_per_s / sweeps[next(iter(sweeps))][0].rate_per_s
    fig.update_layout(template=TEMPLATE, height=440, hovermode="closest",
                      legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="center", x=0.5),
                      title=f"{load:g}× the offered load: throughput " + ", ".join(f"×{g:.2f} ({name})"
                                                                              for name, g in gains.items()))
    fig.update_xaxes(title="offered load (requests/s)")
    fig.update_yaxes(title="tokens/s", row=1, col=1)
    fig.update_yaxes(title="ms", row=1, col=2)
    fig.update_yaxes(title="ms", row=1, col=3)
    return fig


def goodput_figure(sweeps: dict[str, list[RatePoint]], ttft_ms: float, tpot_ms: float):
    """Goodput (requests/s meeting TTFT <= ``ttft_ms`` and TPOT <= ``tpot_ms``) at each offered load, per server.

    Pure: recomputed from the recorded runs, nothing is re-measured.
    """
    from .plots import bar_figure

    slo = SLO(ttft_ms=ttft_ms, tpot_ms=tpot_ms)
    rates = [f"{p.rate_per_s:g} req/s" for p in next(iter(sweeps.values()))]
    series = {name: [goodput(p.result.records, p.result.duration_s, slo) for p in pts] for name, pts in sweeps.items()}
    best = max(((name, rate, g) for name, gs in series.items() for rate, g in zip(rates, gs)), key=lambda x: x[2])
    title = (f"Under {slo}: the best goodput is {best[2]:.2f} requests/s ({best[0]} at {best[1]})" if best[2] > 0
             else f"Under {slo}: no request of any run met the objectives")
    return bar_figure(rates, series, title=title, x_title="offered load", y_title="goodput (requests/s)")
