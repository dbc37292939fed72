"""Chapter 11 -- the streaming client: replays a trace against an OpenAI-compatible ``/v1/completions`` endpoint."""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from ..validation import check_non_negative_int, check_positive_int
from .metrics import PERCENTILES, RequestRecord, SLO, ServingSummary, summarize
from .trace import Trace, TraceRequest


class ServerUnreachable(ConnectionError):
    """No server answered at the given address."""


class ReplayError(RuntimeError):
    """Some requests of a replay failed; ``result`` holds every record, the finished ones included."""

    def __init__(self, message: str, result: "ReplayResult"):
        super().__init__(message)
        self.result = result

    def __reduce__(self):                 # pickled whole (replay_in_process hands it from one process to another)
        return type(self), (str(self), self.result)


@dataclass
class ReplayResult:
    """Every request of one replay (in trace order), the run's wall-clock duration, and where it ran.
    ``started_at``: ``time.perf_counter()`` when the run started (each record's ``start_s`` counts from it; on one
    machine it is comparable with another process's ``perf_counter``, as vLLM's benchmark records send times)."""

    records: list[RequestRecord]
    duration_s: float
    url: str
    model: str
    trace: Trace
    started_at: float = 0.0

    @property
    def failed(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.success]

    def summary(self, slo: SLO | None = None, percentiles: Sequence[float] = PERCENTILES) -> ServingSummary:
        return summarize(self.records, self.duration_s, slo=slo, percentiles=percentiles)


def completion_payload(model: str, request: TraceRequest, *, ignore_eos: bool = True,
                       return_token_ids: bool = True) -> dict:
    """The ``/v1/completions`` body the client sends: streamed, greedy, exactly ``output_tokens`` tokens; with
    ``return_token_ids`` the server is asked for each chunk's token ids (a vLLM extension the course engine's server
    speaks too). Without it the body holds what ``vllm bench serve`` sends, but for its ``repetition_penalty`` of 1
    and ``logprobs`` of null (neither changes what the server does)."""
    body = {"model": model, "prompt": request.prompt if isinstance(request.prompt, str) else list(request.prompt),
            "max_tokens": request.output_tokens, "temperature": 0.0, "ignore_eos": ignore_eos,
            "stream": True, "stream_options": {"include_usage": True}}
    if return_token_ids:
        body["return_token_ids"] = True
    return body


def _error_text(status: int, body: bytes) -> str:
    try:
        err = json.loads(body)
        msg = err.get("error", {}).get("message") if isinstance(err.get("error"), dict) else err.get("message")
        msg = msg or err.get("detail") or body.decode(errors="replace")
    except (ValueError, AttributeError):
        msg = body.decode(errors="replace")
    return f"HTTP {status}: {str(msg).strip()[:300]}"


async def _stream_one(client, url: str, model: str, index: int, request: TraceRequest, run_t0: float,
                      *, ignore_eos: bool, return_token_ids: bool = True) -> RequestRecord:
    """Send one request and record every streamed chunk's arrival; a failure is recorded, not raised."""
    import httpx

    t0 = time.perf_counter()
    rec = RequestRecord(index, request.prompt_tokens, request.output_tokens, t0 - run_t0)
    done = False
    try:
        async with client.stream("POST", url, json=completion_payload(model, request, ignore_eos=ignore_eos,
                                                                          return_token_ids=return_token_ids)) as resp:
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
                       strict: bool = True, return_token_ids: bool = True) -> ReplayResult:
    """Replay ``trace`` against the server at ``base_url``: each request is sent at its arrival time.

    ``max_concurrency``: at most this many requests in flight (a request due while the limit is
    reached waits, as in ``vllm bench serve --max-concurrency``); ``warmup``: requests (copies of
    the first) sent one by one before the clock starts; ``return_token_ids``: ask for each chunk's token ids
    (False: the body ``vllm bench serve`` sends, :func:`completion_payload`). The run's duration runs from its start
    to the last response. With ``strict`` a run in which a request failed raises
    :class:`ReplayError` after every request has ended; its ``result`` holds every record.
    """
    import httpx

    from ..progress import progress_bar

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
                                    ignore_eos=ignore_eos, return_token_ids=return_token_ids)
            if not rec.success:
                raise ReplayError(f"the warm-up request failed: {rec.error}",
                                  ReplayResult([rec], 0.0, base, model, trace))
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = progress_bar(None, f"replay at {trace.rate_per_s:g} req/s", enabled=progress, total=len(trace),
                           unit="request")

        async def one(i: int, req: TraceRequest, run_t0: float) -> RequestRecord:
            if gate is None:
                rec = await _stream_one(client, url, model, i, req, run_t0, ignore_eos=ignore_eos,
                                        return_token_ids=return_token_ids)
            else:
                async with gate:
                    rec = await _stream_one(client, url, model, i, req, run_t0, ignore_eos=ignore_eos,
                                        return_token_ids=return_token_ids)
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
    result = ReplayResult(records, duration, base, model, trace, run_t0)
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


def replay_in_process(base_url: str, model: str, trace: Trace, *, timeout_s: float = 600.0, **kw) -> ReplayResult:
    """:func:`replay` in a Python process of its own, as ``vllm bench serve`` runs its client: no other thread of
    the calling process (a notebook's, its memory samplers') shares Python's lock with the client while it reads
    the stream, so on a busy machine its times carry only its own delays. Same arguments and result as
    :func:`replay` (``strict`` failures are raised here); ``timeout_s`` bounds the whole run."""
    import os
    import pickle
    import subprocess
    import tempfile
    from pathlib import Path

    package_root = str(Path(__file__).resolve().parents[2])          # where course_utils can be imported from
    env = dict(os.environ, PYTHONPATH=package_root + (os.pathsep + os.environ["PYTHONPATH"]
                                                       if os.environ.get("PYTHONPATH") else ""))
    with tempfile.TemporaryDirectory(prefix="course-replay-") as tmp:
        src, dst = Path(tmp) / "in.pkl", Path(tmp) / "out.pkl"
        src.write_bytes(pickle.dumps((base_url, model, trace, kw)))
        done = subprocess.run([sys.executable, "-m", "course_utils.serving.client", str(src), str(dst)],
                              capture_output=True, text=True, timeout=timeout_s, env=env)
        if done.returncode != 0 or not dst.exists():
            raise RuntimeError(f"the replay process failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        outcome = pickle.loads(dst.read_bytes())
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def main(argv: list[str] | None = None) -> int:
    """``python -m course_utils.serving.client IN OUT``: the replay of :func:`replay_in_process`, from a pickled
    ``(base_url, model, trace, kwargs)``; the result (or the error) is pickled to OUT."""
    import pickle
    from pathlib import Path

    from course_utils.serving import client    # the package's classes, not this file's copy run as __main__

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m course_utils.serving.client IN.pkl OUT.pkl")
        return 2
    base_url, model, trace, kw = pickle.loads(Path(argv[0]).read_bytes())
    try:
        outcome = client.replay(base_url, model, trace, **kw)
    except (client.ReplayError, client.ServerUnreachable, ValueError) as exc:
        outcome = exc
    Path(argv[1]).write_bytes(pickle.dumps(outcome))
    return 0


if __name__ == "__main__":
    sys.exit(main())
