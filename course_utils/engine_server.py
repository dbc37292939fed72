"""Chapter 11 -- the course engine (chapter 04) behind an OpenAI-compatible streaming endpoint.

A server is an engine plus an API and a clock. This one is a single asyncio loop:

* it accepts HTTP/1.1 connections and parses ``POST /v1/completions`` bodies
  (:func:`parse_completion_request`), queueing each request;
* between two engine steps it admits the queued requests (``LLMEngine.add_request``), then
  runs ``LLMEngine.step()`` in a worker thread -- so the loop keeps accepting connections while
  the model computes (PyTorch releases the GIL) -- and, once the step is done, streams every new
  token to its client as a server-sent event (``data: {...}``), chunked, then ``data: [DONE]``;
* ``GET /health`` and ``GET /v1/models`` answer as vLLM's server does.

What it supports, and what it does not: greedy decoding only (``temperature`` absent or 0; any
other value is refused with HTTP 400), one choice per request, a prompt given as text or as
token ids, ``max_tokens``, ``ignore_eos``, ``stream`` with ``stream_options.include_usage``, and
``return_token_ids`` (vLLM's extension). No stop strings, logprobs, sampling or request
cancellation (a client that disconnects leaves its request running to the end).

Run it as ``python -m course_utils.engine_server --model embedded --port 8000`` or from Python
with :func:`start_engine_server` (a child process, see :class:`~course_utils.serving.ServerProcess`)
or :class:`EngineServer` (in a thread of the calling process, as the tests do).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .validation import check_positive_int

MAX_BODY_BYTES = 8 * 2**20


# --- the API: what a request may ask ---------------------------------------------------------------------------------

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


def parse_completion_request(body: dict, tokenizer, *, model_name: str) -> CompletionRequest:
    """Check a completion request against what this server supports; ``BadRequest`` names what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("model") not in (None, model_name):
        raise BadRequest(f"this server serves the model {model_name!r}, not {body.get('model')!r}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                   # a batch of one
    if isinstance(prompt, str) and prompt:
        ids = tuple(int(t) for t in tokenizer(prompt).input_ids)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = tuple(prompt)
    else:
        raise BadRequest("prompt must be a non-empty string or a non-empty list of token ids (one prompt per request)")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    temperature = body.get("temperature")
    if temperature not in (None, 0, 0.0):
        raise BadRequest(f"this server decodes greedily only: temperature must be 0 or absent, got {temperature!r}")
    if body.get("n", 1) != 1 or body.get("best_of", 1) not in (None, 1):
        raise BadRequest("this server returns one choice per request (n = 1)")
    if body.get("repetition_penalty", 1.0) not in (None, 1, 1.0):
        raise BadRequest("repetition_penalty is not supported (greedy decoding only)")
    for unsupported in ("stop", "logprobs", "echo", "suffix", "logit_bias"):
        if body.get(unsupported) not in (None, [], False):
            raise BadRequest(f"{unsupported!r} is not supported by the course engine's server")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object")
    return CompletionRequest(ids, max_tokens, bool(body.get("stream", False)), bool(options.get("include_usage")),
                             bool(body.get("ignore_eos", False)), bool(body.get("return_token_ids", False)))


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


# --- the server ----------------------------------------------------------------------------------------------------

@dataclass
class _Active:
    """A request the engine holds: where its tokens go and how many were sent."""

    request: CompletionRequest
    queue: asyncio.Queue
    sent: int = 0


def _finish_reason(reason: str | None) -> str | None:
    return {"eos": "stop", "length": "length"}.get(reason, reason)


class EngineServer:
    """An OpenAI-compatible HTTP server around one :class:`~course_utils.engine.LLMEngine` (greedy only)."""

    def __init__(self, engine, tokenizer, *, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.pending: list[tuple[CompletionRequest, asyncio.Future]] = []
        self.active: dict[int, _Active] = {}
        self.broken: str | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._wake: asyncio.Event | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.url: str | None = None

    # the engine loop --------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Hand queued requests to the engine (only between steps: the engine is not thread-safe)."""
        for req, admitted in self.pending:
            try:
                seq_id = self.engine.add_request(list(req.prompt_ids), req.max_tokens, ignore_eos=req.ignore_eos)
            except (TypeError, ValueError) as exc:
                admitted.set_result(exc)
                continue
            q: asyncio.Queue = asyncio.Queue()
            self.active[seq_id] = _Active(req, q)
            admitted.set_result(q)
        self.pending.clear()

    def _publish(self) -> None:
        """After a step: every new token goes to its request's queue; finished requests leave."""
        for seq_id in list(self.active):
            act, seq = self.active[seq_id], self.engine.sequences[seq_id]
            new = seq.output_ids[act.sent:]
            if new:
                act.sent += len(new)
                act.queue.put_nowait(("tokens", new, _finish_reason(seq.finish_reason) if seq.is_finished else None))
            if seq.is_finished:
                act.queue.put_nowait(("done", seq.num_prompt_tokens, seq.num_output_tokens))
                del self.active[seq_id]

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.pending and not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
            self._admit()
            if not self.engine.has_unfinished():
                continue
            try:
                await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as exc:  # noqa: BLE001 -- the engine's state is unknown now: fail everyone, refuse new work
                self.broken = f"{type(exc).__name__}: {exc}"
                for act in self.active.values():
                    act.queue.put_nowait(("error", self.broken))
                self.active.clear()
                return
            self._publish()

    # HTTP ---------------------------------------------------------------------------------------------------------
    @staticmethod
    async def _send(writer, status: int, payload, content_type: str = "application/json") -> None:
        body = (json.dumps(payload) if not isinstance(payload, (bytes, str)) else payload)
        body = body.encode() if isinstance(body, str) else body
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 413: "Payload Too Large",
                  500: "Internal Server Error", 503: "Service Unavailable"}.get(status, "")
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()

    async def _error(self, writer, status: int, message: str) -> None:
        await self._send(writer, status, {"error": {"message": message, "type": "BadRequestError" if status == 400
                                                    else "ServerError", "code": status}})

    def _chunk(self, rid: str, created: int, **choice) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [{"index": 0, "logprobs": None, **choice}]}

    async def _complete(self, writer, req: CompletionRequest, rid: str) -> None:
        admitted = asyncio.get_running_loop().create_future()
        self.pending.append((req, admitted))
        self._wake.set()
        q = await admitted
        if isinstance(q, Exception):
            await self._error(writer, 400, str(q))
            return
        created, text = int(time.time()), TextStream(self.tokenizer)
        all_ids, finish, usage = [], None, None
        if req.stream:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
        while True:
            kind, *rest = await q.get()
            if kind == "error":
                if req.stream:
                    await self._event(writer, {"error": {"message": rest[0], "code": 500}})
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
                else:
                    await self._error(writer, 500, rest[0])
                return
            if kind == "done":
                usage = {"prompt_tokens": rest[0], "completion_tokens": rest[1], "total_tokens": rest[0] + rest[1]}
                break
            ids, finish = rest
            all_ids += ids
            delta = text.push(ids)
            if req.stream:
                choice = dict(text=delta, finish_reason=finish)
                if req.return_token_ids:
                    choice["token_ids"] = ids
                await self._event(writer, self._chunk(rid, created, **choice))
        if not req.stream:
            choice = dict(text=text.text, finish_reason=finish)
            if req.return_token_ids:
                choice["token_ids"] = all_ids
            await self._send(writer, 200, {**self._chunk(rid, created, **choice), "usage": usage})
            return
        if req.include_usage:
            await self._event(writer, {"id": rid, "object": "text_completion", "created": created,
                                       "model": self.model_name, "choices": [], "usage": usage})
        await self._event(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    @staticmethod
    async def _event(writer, payload) -> None:
        data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    async def _read_request(self, reader):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
        length = int(headers.get("content-length", 0))
        if length > MAX_BODY_BYTES:
            raise BadRequest(f"the request body is over {MAX_BODY_BYTES} bytes")
        body = await reader.readexactly(length) if length else b""
        return method, path.split("?", 1)[0], headers, body

    async def _handle(self, reader, writer) -> None:
        n = 0
        try:
            while True:
                try:
                    method, path, headers, body = await self._read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except (ValueError, UnicodeDecodeError) as exc:
                    await self._error(writer, 400, f"malformed HTTP request: {exc}")
                    return
                n += 1
                await self._route(writer, method, path, body, f"cmpl-{id(writer):x}-{n}")
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            writer.close()

    async def _route(self, writer, method: str, path: str, body: bytes, rid: str) -> None:
        if method == "GET" and path == "/health":
            await self._send(writer, 200 if self.broken is None else 503, b"", "text/plain")
        elif method == "GET" and path == "/v1/models":
            await self._send(writer, 200, {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                                       "owned_by": "course_utils"}]})
        elif method == "POST" and path == "/v1/completions":
            if self.broken is not None:
                await self._error(writer, 500, f"the engine failed and stopped serving: {self.broken}")
                return
            try:
                req = parse_completion_request(json.loads(body or b"null"), self.tokenizer, model_name=self.model_name)
            except (BadRequest, ValueError) as exc:
                await self._error(writer, 400, str(exc) if isinstance(exc, BadRequest) else f"malformed JSON: {exc}")
                return
            await self._complete(writer, req, rid)
        else:
            await self._error(writer, 404, f"no route {method} {path} (this server has GET /health, GET /v1/models, "
                                           "POST /v1/completions)")

    # running it ---------------------------------------------------------------------------------------------------
    async def serve(self, host: str = "127.0.0.1", port: int = 8000, *, ready: threading.Event | None = None,
                    parent_pid: int | None = None) -> None:
        """Serve until cancelled (or until ``parent_pid`` is gone)."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        self._server = await asyncio.start_server(self._handle, host, port)
        self.url = f"http://{host}:{self._server.sockets[0].getsockname()[1]}"
        engine_task = asyncio.create_task(self._engine_loop())
        if ready is not None:
            ready.set()
        try:
            async with self._server:
                while parent_pid is None or _pid_alive(parent_pid):
                    await asyncio.sleep(1.0)
        finally:
            engine_task.cancel()
            self._executor.shutdown(wait=False, cancel_futures=True)

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0) -> "EngineServer":
        """Serve from a daemon thread of this process (the tests do); ``url`` is set on return; ``close()`` stops it."""
        ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve_until_closed(host, port, ready)),
                                        name="engine-server", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the engine server thread did not start within 30 s")
        return self

    async def _serve_until_closed(self, host, port, ready) -> None:
        self._closing = asyncio.Event()
        task = asyncio.create_task(self.serve(host, port, ready=ready))
        await self._closing.wait()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    def close(self) -> None:
        if self._thread is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._closing.set)
            self._thread.join(10)
            self._thread = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _pid_alive(pid: int) -> bool:
    import psutil
    return psutil.pid_exists(pid)


# --- as a process --------------------------------------------------------------------------------------------------

def build_engine(model_name: str, *, device: str = "cpu", dtype: str = "float32", max_num_seqs: int = 8,
                 num_blocks: int = 256, block_size: int = 16, prefix_caching: bool = True, pack: str = "none"):
    """Load ``model_name`` and build the engine the server runs: ``(engine, tokenizer)``.

    ``dtype``: what the engine computes in; ``pack``: the engine's fast path (``"onednn"``, ``"upcast"``, ``"int8"``,
    ``"int4"``, ``"compiled"``: :mod:`course_utils.engine.packed`, :mod:`course_utils.engine.compiled` -- a compiled step
    compiles each new batch / context shape on its first request), ``"none"`` for the dense path."""
    from .engine import LLMEngine, RunnerWeights
    from .models import load_model

    model, tok = load_model(model_name, dtype=dtype, device=device, verbose=False)
    weights = RunnerWeights.from_model(model, dtype, pack=pack)
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                       prefix_caching=prefix_caching, weights=weights)
    return engine, tok


def start_engine_server(model: str, *, device: str = "cpu", port: int | None = None, served_model_name: str = "course",
                        max_num_seqs: int = 8, num_blocks: int = 256, block_size: int = 16, threads: int | None = None,
                        prefix_caching: bool = True, dtype: str = "float32", pack: str = "none", log_path=None,
                        progress: bool = True, timeout_s: float = 300.0):
    """Start the course engine's server as a child process on 127.0.0.1 and wait until it answers.

    Returns the running :class:`~course_utils.serving.ServerProcess` (``base_url``, ``stop()``,
    ``peak_rss``). ``threads``: PyTorch threads in the server (default: PyTorch's own choice);
    ``prefix_caching``: the engine's sharing of cached prompt blocks (off to replay one trace several
    times, so that no replay is answered from the previous one's cache); ``dtype`` and ``pack`` as in
    :func:`build_engine`. The server also exits by itself when this process dies.
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
                               prefix_caching=not args.no_prefix_caching, pack=args.pack)
    server = EngineServer(engine, tok, model_name=args.served_model_name)
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
