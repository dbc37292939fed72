"""Chapter 11 -- the course engine (chapter 04) behind an OpenAI-compatible streaming endpoint.

A server is an engine plus an API and a clock. This one is FastAPI on uvicorn, as vLLM's is:

* uvicorn speaks HTTP/1.1 (framing, keep-alive, malformed requests); FastAPI routes ``POST /v1/completions``
  and validates its body with a pydantic model (:class:`CompletionBody`: strict types, any field it does not
  implement refused by name); the prompt is tokenized in a worker thread, never on the event loop;
* one task, :meth:`EngineServer._engine_loop`, admits the queued requests between two engine steps
  (``LLMEngine.add_request``), cancels those whose client went away (``LLMEngine.abort_request``), then runs
  ``LLMEngine.step()`` in a worker thread -- so the loop keeps serving connections while the model computes
  (PyTorch releases the GIL) -- and hands each request its new tokens and text (detokenized incrementally,
  in that thread); each request's handler streams them as server-sent events (``data: {...}``), then
  ``data: [DONE]``;
* a step that raises fails only the requests it ran (HTTP 500, or an error event, naming the error); the
  engine frees their blocks and the server goes on;
* ``GET /health`` and ``GET /v1/models`` answer as vLLM's server does.

What it supports, and what it refuses: greedy decoding only (``temperature`` absent or 0), one choice per request,
one prompt given as text or token ids, ``max_tokens``, ``ignore_eos``, ``stream`` with
``stream_options.include_usage``, ``return_token_ids`` (vLLM's extension); ``repetition_penalty`` 1, ``logprobs``
null, ``echo`` false and ``stop`` empty are accepted as the no-ops they are. Any other field is refused by name
(400). An unknown model is 404, a body over 8 MiB 413, a full queue 429, a request beyond the connection cap 503
(each an OpenAI-style JSON error).

Run it as ``python -m course_utils.engine_server --model embedded --port 8000`` or from Python with
:func:`start_engine_server` (a child process, see :class:`~course_utils.serving.ServerProcess`) or
:class:`EngineServer` (in a thread of the calling process, as the tests do).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException

from .validation import check_positive_int

MAX_BODY_BYTES = 8 * 2**20
MAX_HEAD_BYTES = 16 * 2**10
HEAD_BUFFER_BYTES = 2**20     # a head up to this size is read whole, so that one over MAX_HEAD_BYTES gets 431 from
                              # _Limits; h11's own 16 KiB limit would answer 400 or 431 by how the bytes arrived
HEAD_TIMEOUT_S = 10.0        # a connection that has not sent a whole request head by then is closed


# --- the API: what a request may ask ---------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionBody(BaseModel):
    """A ``/v1/completions`` body as this server implements it: strict types; any other field is refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str | list[int] | list[str] | list[list[int]]
    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    repetition_penalty: float | None = None      # accepted at their neutral values, which clients send by default
    logprobs: None = None
    echo: bool = False
    stop: list[str] | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, p):
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]                                       # a batch of one
        if not p or (isinstance(p, list) and not isinstance(p[0], int)):
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids (one prompt)")
        if isinstance(p, str):
            try:
                p.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("the prompt is not valid UTF-8 text (a lone surrogate?)") from None
        return p

    @field_validator("temperature")
    @classmethod
    def _greedy(cls, t):
        if t not in (None, 0):
            raise ValueError(f"this server decodes greedily only: temperature must be 0 or absent, got {t}")
        return t

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n != 1:
            raise ValueError("this server returns one choice per request (n = 1)")
        return n

    @field_validator("repetition_penalty", "echo", "stop")
    @classmethod
    def _neutral(cls, v, info):
        if v not in (None, 1, False, []):
            raise ValueError(f"{info.field_name!r} is not supported by the course engine's server")
        return v


def describe_errors(errors: list[dict]) -> str:
    """pydantic's errors as one line naming each field: ``max_tokens: Input should be a valid integer``."""
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e["loc"] if x != "body") or "body"
        if e["type"] == "extra_forbidden":
            parts.append(f"{loc}: not supported by this server (greedy decoding, one prompt; see its documentation)")
        elif e["type"] == "json_invalid":
            parts.append(f"malformed JSON: {e.get('ctx', {}).get('error', e['msg'])}")
        elif e["type"] in ("model_type", "dict_type", "model_attributes_type"):
            parts.append(f"{loc}: the request body must be a JSON object")
        else:
            parts.append(f"{loc}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated ``/v1/completions`` request (prompt as token ids)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    return_token_ids: bool


class BadRequest(ValueError):
    """A request the API refuses (answered with HTTP 400 and the message)."""


def _request_of(body: CompletionBody, ids) -> CompletionRequest:
    return CompletionRequest(tuple(ids), body.max_tokens, body.stream,
                             bool(body.stream_options and body.stream_options.include_usage), body.ignore_eos,
                             body.return_token_ids)


def _encode(tokenizer, prompt) -> list[int]:
    return [int(t) for t in tokenizer(prompt).input_ids] if isinstance(prompt, str) else list(prompt)


def parse_completion_request(body, tokenizer, *, model_name: str) -> CompletionRequest:
    """Check a parsed JSON body against what this server supports; ``BadRequest`` names what is wrong."""
    try:
        req = CompletionBody.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(describe_errors(exc.errors())) from None
    if req.model not in (None, model_name):
        raise BadRequest(f"this server serves the model {model_name!r}, not {req.model!r}")
    return _request_of(req, _encode(tokenizer, req.prompt))


class TextStream:
    """Token ids in, text deltas out, decoding only a short window (vLLM's incremental detokenizer).

    ``prefix`` .. ``read`` is a few tokens already shown, decoded again for context; a delta is held back while
    it ends in an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read, self.text = tokenizer, [], 0, 0, ""

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        decode = lambda a, b: self.tokenizer.decode(self.ids[a:b], skip_special_tokens=True)
        shown, now = decode(self.prefix, self.read), decode(self.prefix, len(self.ids))
        if len(now) <= len(shown) or now.endswith("\ufffd"):
            return ""
        delta = now[len(shown):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta


# --- the server ----------------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Request:
    """A request between its handler and the engine loop."""

    request: CompletionRequest
    text: TextStream
    events: asyncio.Queue = field(default_factory=asyncio.Queue)   # (token ids, text, finish) | Exception | None
    seq: object = None               # its engine Sequence once admitted
    cancelled: bool = False


def _finish_reason(reason: str | None) -> str | None:
    return {"eos": "stop", "length": "length"}.get(reason, reason)


def _error(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 413: "RequestTooLarge", 431: "HeadersTooLarge",
            429: "TooManyRequests", 503: "ServiceUnavailable"}.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


class EngineServer:
    """An OpenAI-compatible HTTP server around one :class:`~course_utils.engine.LLMEngine` (greedy only).

    ``max_queued``: requests held beyond the engine's slots; one more is answered 429. ``max_connections``: at this
    many open connections (or requests in flight), a new request is answered 503 and its connection closed (default:
    ``max_queued`` + twice the engine's slots + 32)."""

    def __init__(self, engine, tokenizer, *, model_name: str, max_queued: int = 256, max_connections: int | None = None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        engine.keep_history = False                   # a finished request leaves the engine
        self.max_queued = check_positive_int("max_queued", max_queued)
        self.max_connections = (self.max_queued + 2 * engine.scheduler.max_num_seqs + 32 if max_connections is None
                                else check_positive_int("max_connections", max_connections))
        self.queued: list[_Request] = []              # not yet handed to the engine
        self.active: dict[int, _Request] = {}         # in the engine, by sequence id
        self.broken: str | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        longest = max((len(t) for t in tokenizer.get_vocab()), default=64) if hasattr(tokenizer, "get_vocab") else 64
        self.max_prompt_chars = engine.capacity_tokens * max(longest, 1)   # longer text cannot fit: not tokenized
        self._wake: asyncio.Event | None = None
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.url: str | None = None
        self.app = self._make_app()

    # the engine loop --------------------------------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        from .engine import StepFailed
        loop = asyncio.get_running_loop()
        while True:
            if not self.queued and not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
            self._admit()                    # between steps: new requests in, cancelled ones out (blocks freed)
            if not self.engine.has_unfinished():
                continue
            try:
                updates = await loop.run_in_executor(self._executor, self._step)
            except StepFailed as exc:        # that step's requests fail; their blocks are free; the others go on
                for seq in exc.seqs:
                    self.active.pop(seq.seq_id).events.put_nowait(RuntimeError(f"the engine step failed: {exc.error}"))
                continue
            except Exception as exc:  # noqa: BLE001 -- the engine's state is unknown now: fail everyone, refuse new work
                self.broken = f"{type(exc).__name__}: {exc}"
                for r in [*self.active.values(), *self.queued]:
                    r.events.put_nowait(RuntimeError(self.broken))
                self.active.clear(), self.queued.clear()
                return
            for r, ids, text, finish in updates:
                r.events.put_nowait((ids, text, finish))
                if finish is not None:
                    del self.active[r.seq.seq_id]

    def _admit(self) -> None:
        """Hand queued requests to the engine, and abort those whose client went away (the engine is not
        thread-safe: only between steps)."""
        for r in self.queued:
            if not r.cancelled:
                req = r.request
                seq_id = self.engine.add_request(list(req.prompt_ids), req.max_tokens, ignore_eos=req.ignore_eos)
                r.seq, self.active[seq_id] = self.engine.sequences[seq_id], r
        self.queued.clear()
        for seq_id in [i for i, r in self.active.items() if r.cancelled]:
            self.engine.abort_request(seq_id)
            del self.active[seq_id]

    def _step(self) -> list[tuple]:
        """In the worker thread: one engine step, then each request's new token ids, their text and finish reason."""
        self.engine.step()
        updates = []
        for r in self.active.values():
            seq = r.seq
            new = seq.output_ids[len(r.text.ids):]
            if new or seq.is_finished:
                updates.append((r, new, r.text.push(new), _finish_reason(seq.finish_reason)))
        return updates

    def _cancel(self, r: _Request) -> None:
        """The client went away: the engine loop aborts the request before its next step."""
        if not r.cancelled:
            r.cancelled = True
            r.events.put_nowait(None)
            self._wake.set()

    # HTTP ---------------------------------------------------------------------------------------------------------
    def _make_app(self) -> FastAPI:
        app = FastAPI(title="course engine server", openapi_url=None, docs_url=None, redoc_url=None)

        @app.exception_handler(RequestValidationError)
        async def invalid(_, exc):
            return _error(400, describe_errors(exc.errors()))

        @app.exception_handler(HTTPException)
        async def http_error(_, exc):           # 404, 405, 413, and a body that is not JSON (why, from its cause)
            cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
            return _error(exc.status_code, f"{exc.detail}{cause}")

        @app.get("/health")
        async def health():
            return Response(status_code=200 if self.broken is None else 503)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "course_utils"}]}

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, request: Request):
            if body.model not in (None, self.model_name):
                return _error(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}")
            if self.broken is not None:
                return _error(503, f"the engine failed and stopped serving: {self.broken}")
            held = len(self.queued) + len(self.active) - self.engine.scheduler.max_num_seqs
            if held >= self.max_queued:
                return _error(429, f"the server's queue is full ({self.max_queued} requests wait for a slot); "
                                   "retry later")
            if isinstance(body.prompt, str) and len(body.prompt) > self.max_prompt_chars:
                return _error(400, f"the prompt's {len(body.prompt):,} characters cannot fit the cache "
                                   f"({self.engine.capacity_tokens} tokens)")
            ids = await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, _encode, self.tokenizer,
                                                                   body.prompt)
            try:
                self.engine.check_request(ids, body.max_tokens)       # reads fixed sizes only: safe beside a step
            except (TypeError, ValueError) as exc:
                return _error(400, str(exc))
            r = _Request(_request_of(body, ids), TextStream(self.tokenizer))
            self.queued.append(r)
            self._wake.set()
            rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
            if body.stream:          # Starlette cancels the stream when the client disconnects: `finally` aborts
                return StreamingResponse(self._events(r, rid, created), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return await self._whole(r, rid, created, request)

        return app

    def _chunk(self, rid: str, created: int, **choice) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [{"index": 0, "logprobs": None, **choice}]}

    def _usage(self, r: _Request) -> dict:
        n, m = len(r.request.prompt_ids), len(r.text.ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    async def _events(self, r: _Request, rid: str, created: int):
        """The server-sent events of one streamed request: one per step that gave it a token, usage, [DONE]."""
        sse = lambda payload: f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
        try:
            while True:
                event = await r.events.get()
                if event is None:
                    return
                if isinstance(event, Exception):
                    yield sse({"error": {"message": str(event), "type": "InternalServerError", "code": 500}})
                    return
                ids, text, finish = event
                choice = dict(text=text, finish_reason=finish) | ({"token_ids": ids} if r.request.return_token_ids else {})
                yield sse(self._chunk(rid, created, **choice))
                if finish is not None:
                    break
            if r.request.include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                           "choices": [], "usage": self._usage(r)})
            yield sse("[DONE]")
        finally:
            self._cancel(r)               # a no-op once finished

    async def _whole(self, r: _Request, rid: str, created: int, request):
        """A non-streamed request: all its tokens in one JSON answer; cancelled if the connection closes first."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self._cancel(r)
        watcher, finish = asyncio.create_task(watch()), None
        try:
            while finish is None:
                event = await r.events.get()
                if event is None:
                    return _error(499, "the client closed the connection")
                if isinstance(event, Exception):
                    return _error(500, str(event))
                finish = event[2]
        finally:
            watcher.cancel()
        choice = dict(text=r.text.text, finish_reason=finish) | (
            {"token_ids": list(r.text.ids)} if r.request.return_token_ids else {})
        return {**self._chunk(rid, created, **choice), "usage": self._usage(r)}

    # running it ---------------------------------------------------------------------------------------------------
    async def serve(self, host: str = "127.0.0.1", port: int = 8000, *, ready: threading.Event | None = None,
                    parent_pid: int | None = None) -> None:
        """Serve until cancelled (or until ``parent_pid`` is gone)."""
        import uvicorn

        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        app = _Admission(_Limits(self.app, MAX_BODY_BYTES), self.max_connections, self.open_connections)
        config = uvicorn.Config(app, host=host, port=port, http=_Protocol, lifespan="off", log_config=None,
                                access_log=False, timeout_keep_alive=5, timeout_graceful_shutdown=1,
                                h11_max_incomplete_event_size=HEAD_BUFFER_BYTES)
        self._uvicorn = uvicorn.Server(config)
        engine_task = asyncio.create_task(self._engine_loop())
        http_task = asyncio.create_task(self._uvicorn.serve())
        try:
            while not self._uvicorn.started:
                if http_task.done():
                    http_task.result()                       # raises why it could not start (port in use...)
                    raise RuntimeError("the HTTP server stopped before it started")
                await asyncio.sleep(0.01)
            self.url = f"http://{host}:{self._uvicorn.servers[0].sockets[0].getsockname()[1]}"
            if ready is not None:
                ready.set()
            while not http_task.done() and (parent_pid is None or _pid_alive(parent_pid)):
                await asyncio.wait([http_task], timeout=1.0)
        finally:
            self._uvicorn.should_exit = True
            await asyncio.wait([http_task], timeout=5.0)
            engine_task.cancel()
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def open_connections(self) -> int:
        """HTTP connections open now (uvicorn's count; 0 before it started)."""
        return len(self._uvicorn.server_state.connections) if self._uvicorn is not None else 0

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0) -> "EngineServer":
        """Serve from a daemon thread of this process (the tests do); ``url`` is set on return; ``close()`` stops it."""
        ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self.serve(host, port, ready=ready)),
                                        name="engine-server", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the engine server thread did not start within 30 s")
        return self

    def close(self) -> None:
        if self._thread is not None and self._uvicorn is not None:
            self._uvicorn.should_exit = True
            self._thread.join(10)
            self._thread = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _pid_alive(pid: int) -> bool:
    import psutil
    return psutil.pid_exists(pid)


class _Admission:
    """ASGI middleware, outermost: uvicorn's ``limit_concurrency`` rule -- at ``limit`` open connections (this one
    included) or ``limit`` requests in flight, a new request is refused with 503 and its connection closed -- answered
    with an OpenAI-style JSON error, where uvicorn's own check answers a plain-text ``Service Unavailable``."""

    def __init__(self, app, limit: int, open_connections):
        self.app, self.limit, self.open_connections, self.in_flight = app, limit, open_connections, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.open_connections() >= self.limit or self.in_flight >= self.limit:
            refused = _error(503, f"the server is at its limit of {self.limit} connections; retry later")
            refused.headers["connection"] = "close"
            return await refused(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class _Limits:
    """ASGI middleware in front of the app: a head over ``MAX_HEAD_BYTES`` is 431; a request framed by both
    Content-Length and Transfer-Encoding is 400 and its connection closed (two parsers could disagree on where it
    ends: request smuggling); a body over ``limit`` bytes is 413, by its Content-Length or as it arrives."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEAD_BYTES:
            return await _error(431, f"the request's headers are over {MAX_HEAD_BYTES} bytes")(scope, receive, send)
        if b"content-length" in headers and b"transfer-encoding" in headers:
            refused = _error(400, "a request may not carry both Content-Length and Transfer-Encoding")
            refused.headers["connection"] = "close"
            return await refused(scope, receive, send)
        if int(headers.get(b"content-length", b"0") or 0) > self.limit:
            return await _error(413, f"the request body is over {self.limit} bytes")(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, f"the request body is over {self.limit} bytes")
            return message
        await self.app(scope, counted, send)


def _protocol_class():
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        """uvicorn's HTTP/1.1 (h11), closing a connection that sends no complete request head within
        ``HEAD_TIMEOUT_S`` (a slow, never-finished header would hold it open for ever)."""

        def connection_made(self, transport):
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timeout)

        def _head_timeout(self):
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self):
            super().handle_events()
            if self.cycle is not None:
                self._head_timer.cancel()

        def connection_lost(self, exc):
            self._head_timer.cancel()
            super().connection_lost(exc)
    return Protocol


try:
    _Protocol = _protocol_class()
except ImportError:            # uvicorn missing: the parsing helpers above still import
    _Protocol = None

# --- as a process --------------------------------------------------------------------------------------------------

def build_engine(model_name: str, *, device: str = "cpu", dtype: str = "float32", max_num_seqs: int = 8,
                 num_blocks: int = 256, block_size: int = 16, prefix_caching: bool = True, pack: str = "none",
                 max_num_batched_tokens: int | None = None, chunked_prefill: bool = False):
    """Load ``model_name`` and build the engine the server runs: ``(engine, tokenizer)``.

    ``dtype``: what the engine computes in; ``pack``: the engine's fast path (``"onednn"``, ``"upcast"``, ``"int8"``,
    ``"int4"``, ``"compiled"``: :mod:`course_utils.engine.packed`, :mod:`course_utils.engine.compiled` -- a compiled step
    compiles each new batch / context shape on its first request), ``"none"`` for the dense path;
    ``max_num_batched_tokens``: a prefill step's budget of padded tokens, or with ``chunked_prefill`` every step's
    budget of real tokens, decode tokens and prompt chunks together (default: the cache's capacity)."""
    from .engine import LLMEngine, RunnerWeights
    from .models import load_model

    model, tok = load_model(model_name, dtype=dtype, device=device, verbose=False)
    weights = RunnerWeights.from_model(model, dtype, pack=pack)
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                       prefix_caching=prefix_caching, weights=weights, max_num_batched_tokens=max_num_batched_tokens,
                       chunked_prefill=chunked_prefill, keep_history=False)
    return engine, tok


def start_engine_server(model: str, *, device: str = "cpu", port: int | None = None, served_model_name: str = "course",
                        max_num_seqs: int = 8, num_blocks: int = 256, block_size: int = 16, threads: int | None = None,
                        prefix_caching: bool = True, dtype: str = "float32", pack: str = "none", log_path=None,
                        progress: bool = True, timeout_s: float = 300.0, chunked_prefill: bool = False,
                        max_num_batched_tokens: int | None = None):
    """Start the course engine's server as a child process on 127.0.0.1 and wait until it answers.

    Returns the running :class:`~course_utils.serving.ServerProcess` (``base_url``, ``stop()``,
    ``peak_rss``). ``threads``: PyTorch threads in the server (default: PyTorch's own choice);
    ``prefix_caching``: the engine's sharing of cached prompt blocks (off to replay one trace several
    times, so that no replay is answered from the previous one's cache); ``dtype`` and ``pack`` as in
    :func:`build_engine`; ``chunked_prefill`` and ``max_num_batched_tokens`` as in
    :class:`~course_utils.engine.LLMEngine`. The server also exits by itself when this process dies.
    """
    from .serving import ServerProcess, free_port

    for name, value in (("max_num_seqs", max_num_seqs), ("num_blocks", num_blocks), ("block_size", block_size)):
        check_positive_int(name, value)
    port = free_port() if port is None else port
    cmd = [sys.executable, "-m", "course_utils.engine_server", "--model", str(model), "--device", device,
           "--port", str(port), "--served-model-name", served_model_name, "--max-num-seqs", str(max_num_seqs),
           "--num-blocks", str(num_blocks), "--block-size", str(block_size), "--parent-pid", str(os.getpid()),
           "--dtype", dtype, "--pack", pack]
    if threads is not None:
        cmd += ["--threads", str(check_positive_int("threads", threads))]
    if not prefix_caching:
        cmd.append("--no-prefix-caching")
    if chunked_prefill:
        cmd.append("--chunked-prefill")
    if max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(check_positive_int("max_num_batched_tokens", max_num_batched_tokens))]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    server = ServerProcess(cmd, base_url=f"http://127.0.0.1:{port}", name="course engine server", env=env,
                           log_path=log_path, timeout_s=timeout_s)
    return server.start(progress=progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The course engine behind an OpenAI-compatible streaming API.")
    parser.add_argument("--model", default="embedded", help="MODEL string (default: embedded)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="course")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="a prefill step's budget of padded tokens; with --chunked-prefill, every step's budget "
                             "of real tokens (default: the cache's capacity)")
    parser.add_argument("--chunked-prefill", action="store_true",
                        help="steps of decode tokens plus prompt chunks within --max-num-batched-tokens")
    parser.add_argument("--max-queued", type=int, default=256, help="requests waiting for a slot before 429")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="open connections before 503 (default: max-queued + 2 x max-num-seqs + 32)")
    parser.add_argument("--threads", type=int, default=None, help="PyTorch threads (default: PyTorch's choice)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="do not share cached prompt blocks")
    parser.add_argument("--dtype", default="float32", help="what the engine computes in (float32, bfloat16)")
    from .engine.packed import PACKINGS
    parser.add_argument("--pack", default="none", choices=PACKINGS,
                        help="the engine's fast path (default: none, the dense path)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    engine, tok = build_engine(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                               num_blocks=args.num_blocks, block_size=args.block_size,
                               prefix_caching=not args.no_prefix_caching, pack=args.pack,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               chunked_prefill=args.chunked_prefill)
    server = EngineServer(engine, tok, model_name=args.served_model_name, max_queued=args.max_queued,
                          max_connections=args.max_connections)
    print(f"course engine server: {args.model} on {args.device} ({args.dtype}, pack {args.pack}), "
          f"{torch.get_num_threads()} threads, "
          f"http://{args.host}:{args.port}", flush=True)
    try:
        asyncio.run(server.serve(args.host, args.port, parent_pid=args.parent_pid))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
