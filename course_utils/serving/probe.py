"""Chapter 11 -- the same malformed and hostile requests sent to any OpenAI-compatible server, and what each answered.

* :func:`malformed_requests` builds the battery for a server described by :class:`ServerLimits` (its model name,
  vocabulary, context in tokens, body limit, head timeout): bad JSON, wrong types, ``max_tokens`` huge or negative,
  ids beyond the vocabulary, a prompt longer than the context, ``"stream": "false"``, sampling fields, an unknown
  model, a lone surrogate, JSON nested 100,000 deep, an oversized body, a long text prompt, and, on raw sockets, a
  request framed by both Content-Length and Transfer-Encoding (request smuggling), a body shorter than its
  Content-Length, a request head never finished and a 70 KB header. Each :class:`Probe` also says what the course
  engine's server answers (status, a word of its error message), which ``tests/test_server_soak.py`` asserts.
* :func:`send` (asynchronous, one probe) and :func:`probe_server` (the whole battery, one request at a time) return
  an :class:`Answer` per probe: status, error message, whether the server closed the connection. Every wait is
  bounded.
* ``python -m course_utils.serving.probe`` (or ``python tasks.py probe``): starts the course engine's server and,
  where vLLM's environment exists, vLLM's server on the same model and context, one after the other, sends each the
  battery and prints a Markdown table of both servers' answers side by side.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..validation import check_positive_int

MESSAGE_CHARS = 100          # the table shows this much of each error message
JSON_TIMEOUT_S = 60.0        # the longest wait for an answer to a well-framed request


@dataclass(frozen=True)
class ServerLimits:
    """What the battery needs to know about a server: the model name it serves, the model's vocabulary size, the
    longest sequence it holds (tokens: the course engine's cache capacity, vLLM's ``max_model_len``), the largest
    body it accepts (bytes) and how long it waits for a request head before closing the connection (s)."""

    model: str
    vocab_size: int
    context_tokens: int
    max_body_bytes: int
    head_timeout_s: float = 10.0


@dataclass(frozen=True)
class Probe:
    """One malformed request and what the course engine's server answers to it.

    Either ``request`` (the keyword arguments of an ``httpx`` ``POST /v1/completions``) or ``raw`` (bytes written to
    a fresh connection as they are). ``wait_s``: how long to wait for an answer. ``status``: the course server's
    status (None: it does not answer); ``word``: a word its error message contains; ``closed``: whether it closes the
    connection (None: not checked)."""

    name: str
    status: int | None
    word: str
    request: dict | None = None
    raw: bytes | None = None
    wait_s: float = JSON_TIMEOUT_S
    closed: bool | None = None

    def mismatch(self, answer: "Answer") -> str | None:
        """How ``answer`` differs from the course server's expected answer, or None when it does not."""
        if answer.status != self.status:
            return f"status {answer.status}, expected {self.status}"
        if self.word not in answer.message:
            return f"the message {answer.message[:200]!r} lacks {self.word!r}"
        if self.closed is not None and answer.closed != self.closed:
            return f"the connection was {'' if answer.closed else 'not '}closed"
        if self.status is None and answer.raw_bytes:
            return f"the server wrote {answer.raw_bytes} bytes that are no HTTP response"
        if answer.responses > 1:
            return f"{answer.responses} responses on one connection (a smuggled request was answered)"
        return None


@dataclass(frozen=True)
class Answer:
    """What a server answered to one probe: its (first) HTTP status (None: none), the OpenAI-style
    ``error.message`` (for a completion, its length; else the start of the body, or why nothing came), whether the
    server closed the connection (a raw probe: within the probe's wait; else: its answer said ``Connection: close``),
    and how many HTTP responses came on the connection (raw probes)."""

    status: int | None
    message: str
    closed: bool
    responses: int = 1
    raw_bytes: int = 0          # bytes received on a raw connection

    def cell(self, chars: int = MESSAGE_CHARS) -> str:
        """The answer as one Markdown table cell: ``**400**: message...`` (the message cut to ``chars``)."""
        text = " ".join(self.message.split())
        text = text if len(text) <= chars else text[:chars - 1] + "…"
        text = text.replace("|", "\\|").replace("`", "'")
        if self.status is None:
            return text
        head = f"**{self.status}**" + (" (connection closed)" if self.closed else "")
        return f"{head}: {text}" if text else head


def _http_post(body: bytes, extra_headers: str = "") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra_headers}\r\n").encode() + body


def malformed_requests(limits: ServerLimits) -> list[Probe]:
    """The battery of malformed and hostile requests for a server with these ``limits`` (see the module's
    docstring), each with the course engine's server's answer."""
    if not isinstance(limits, ServerLimits):
        raise ValueError(f"limits must be a ServerLimits, got {type(limits).__name__}")
    if not isinstance(limits.model, str) or not limits.model:
        raise ValueError(f"limits.model must be a non-empty string, got {limits.model!r}")
    vocab = check_positive_int("limits.vocab_size", limits.vocab_size)
    context = check_positive_int("limits.context_tokens", limits.context_tokens)
    body_limit = check_positive_int("limits.max_body_bytes", limits.max_body_bytes)
    if not limits.head_timeout_s > 0:
        raise ValueError(f"limits.head_timeout_s must be > 0, got {limits.head_timeout_s!r}")
    other_model = "other" if limits.model != "other" else "another"
    ok = lambda **kw: dict(json={"model": limits.model, "prompt": [1, 2, 3], **kw})
    raw = lambda b: dict(content=b, headers={"Content-Type": "application/json"})
    nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    text_prompt = "word " * 200_000
    probes = [
        Probe("bad JSON", 400, "malformed JSON", raw(b'{"prompt": [1, 2')),
        Probe("max_tokens as a string", 400, "max_tokens", ok(max_tokens="ten")),
        Probe("max_tokens as a float (8.0)", 400, "max_tokens", ok(max_tokens=8.0)),
        Probe("negative max_tokens", 400, "max_tokens", ok(max_tokens=-1)),
        Probe("huge max_tokens (10^9)", 400, "cache", ok(max_tokens=10**9)),
        Probe("id beyond the vocabulary", 400, "prompt token ids", dict(json={"prompt": [vocab]})),
        Probe("negative id", 400, "prompt token ids", dict(json={"prompt": [-1]})),
        Probe(f"prompt of {context + 1} tokens (context + 1)", 400, "cache", dict(json={"prompt": [5] * (context + 1)})),
        Probe('"stream": "false"', 400, "stream", ok(stream="false")),
        Probe("a sampling field (top_p 0.9)", 400, "top_p", ok(top_p=0.9)),
        Probe("sampling (temperature 0.7)", 400, "greedily", ok(temperature=0.7)),
        Probe("unknown model", 404, "does not exist", dict(json={"model": other_model, "prompt": [1]})),
        Probe("lone surrogate (\\ud800)", 400, "UTF-8", raw(b'{"prompt": "\\ud800"}')),
        Probe("JSON nested 100,000 deep", 400, "Recursion", raw(nested)),
        Probe(f"body of {body_limit + 1:,} bytes (limit + 1)", 413, "over", raw(b" " * (body_limit + 1))),
        Probe(f"text prompt of {len(text_prompt):,} characters", 400, "cannot fit", dict(json={"prompt": text_prompt})),
        # raw sockets: what the HTTP layer does with bad framing
        # (waits under uvicorn's 5 s keep-alive timeout, so that a closed connection is the server's answer)
        Probe("Content-Length and Transfer-Encoding (smuggling)", 400, "Transfer-Encoding", closed=True, wait_s=3.0,
              raw=_http_post(b"0\r\n\r\n" + _http_post(b'{"prompt": [9, 9], "max_tokens": 50}'),
                             "Transfer-Encoding: chunked\r\n")),
        Probe("body shorter than its Content-Length", None, "", closed=False, wait_s=2.0,
              raw=_http_post(b'{"prompt": [1]}')[:-5]),
        Probe("request head never finished", None, "", closed=True, wait_s=limits.head_timeout_s + 2.0,
              raw=b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"),
        Probe("a 70 KB header", 431, "headers", wait_s=2.0,
              raw=b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"),
    ]
    largest = max(len(nested), len(json.dumps({"prompt": text_prompt})))
    if body_limit <= largest:
        raise ValueError(f"limits.max_body_bytes must exceed {largest:,} bytes (the largest probe that is meant to be "
                         f"refused for another reason than its size), got {body_limit:,}")
    return probes


# --- sending -------------------------------------------------------------------------------------------------------

def _message(body: bytes) -> str:
    """The OpenAI-style ``error.message`` (vLLM's older ``message`` at the top level too), else the body's text."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body[:500].decode("utf-8", "replace")
    if isinstance(data, dict):
        if isinstance(data.get("choices"), list):                  # answered: say what, not the whole completion
            tokens = (data.get("usage") or {}).get("completion_tokens")
            return "a completion" + (f" of {tokens} tokens" if tokens is not None else "")
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:500]
        if isinstance(data.get("message"), str):
            return data["message"][:500]
        if "detail" in data:
            return str(data["detail"])[:500]
    return body[:500].decode("utf-8", "replace")


def _dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        try:
            n = int(size.split(b";")[0], 16)
        except ValueError:
            return out + body
        if n == 0:
            break
        out, body = out + rest[:n], rest[n + 2:]
    return out


def parse_raw_answer(data: bytes, closed: bool, wait_s: float) -> Answer:
    """An :class:`Answer` from the bytes a server wrote on a raw connection (within ``wait_s``)."""
    statuses = re.findall(rb"HTTP/1\.[01] (\d{3}) ", data) if data.startswith(b"HTTP/1.") else []
    if not statuses:
        why = ("no answer; the server closed the connection" if closed else
               f"no answer in {wait_s:g} s; the connection stayed open")
        return Answer(None, why + (f" (it wrote {data[:60]!r})" if data else ""), closed, 0, len(data))
    head, _, body = data.partition(b"\r\n\r\n")
    body = re.split(rb"HTTP/1\.[01] \d{3} ", body)[0]
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return Answer(int(statuses[0]), _message(body), closed, len(statuses), len(data))


async def raw_exchange(host: str, port: int, data: bytes, *, wait_s: float = 5.0) -> tuple[bytes, bool]:
    """Write ``data`` on a fresh connection; return everything the server wrote until it closed the connection or
    ``wait_s`` passed (in all), and whether it closed it."""
    reader, writer = await asyncio.open_connection(host, port)
    out, closed = b"", True
    try:
        writer.write(data)
        await writer.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while chunk := await asyncio.wait_for(reader.read(65536), max(deadline - loop.time(), 0.0)):
            out += chunk
    except asyncio.TimeoutError:
        closed = False
    except ConnectionError:
        pass
    finally:
        writer.close()
    return out, closed


async def send(client, base_url: str, probe: Probe) -> Answer:
    """Send one probe to the server at ``base_url`` (``client``: an ``httpx.AsyncClient``, for the JSON probes)."""
    import httpx

    if probe.raw is not None:
        url = urlsplit(base_url)
        try:
            data, closed = await raw_exchange(url.hostname, url.port or 80, probe.raw, wait_s=probe.wait_s)
        except OSError as exc:
            return Answer(None, f"no answer: could not connect ({exc})", True, 0)
        return parse_raw_answer(data, closed, probe.wait_s)
    try:
        resp = await client.post(base_url.rstrip("/") + "/v1/completions", timeout=probe.wait_s, **probe.request)
    except httpx.ConnectError as exc:
        return Answer(None, f"no answer: could not connect ({exc})", True, 0)
    except httpx.TimeoutException:
        return Answer(None, f"no answer in {probe.wait_s:g} s", False, 0)
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        return Answer(None, f"no answer; the server closed the connection ({type(exc).__name__})", True, 0)
    return Answer(resp.status_code, _message(resp.content), resp.headers.get("connection", "").lower() == "close")


def probe_server(base_url: str, probes: list[Probe]) -> list[Answer]:
    """Send every probe to the server at ``base_url``, one at a time, each on a fresh connection."""
    import httpx

    async def main():
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(trust_env=False, limits=limits) as client:
            return [await send(client, base_url, p) for p in probes]
    return asyncio.run(main())


def answers_table(probes: list[Probe], answers: dict[str, list[Answer]]) -> str:
    """A Markdown table: one row per probe, one column per server (``answers``: server name -> its answers)."""
    for name, got in answers.items():
        if len(got) != len(probes):
            raise ValueError(f"{name}: {len(got)} answers for {len(probes)} probes")
    lines = ["| request | " + " | ".join(answers) + " |", "|---|" + "---|" * len(answers)]
    for i, p in enumerate(probes):
        lines.append(f"| {p.name} | " + " | ".join(got[i].cell() for got in answers.values()) + " |")
    return "\n".join(lines)


# --- the command ---------------------------------------------------------------------------------------------------

def _model_facts(model: str) -> tuple[str, int]:
    """The transformers folder both servers load, and the model's vocabulary size (its embedding rows)."""
    from transformers import AutoConfig

    from ..models import resolve_model_source
    folder, _ = resolve_model_source(model)
    config = AutoConfig.from_pretrained(folder)
    return folder, int(getattr(config, "get_text_config", lambda: config)().vocab_size)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import datetime
    import os
    import platform
    import tempfile
    from pathlib import Path

    from .. import engine_server, vllm_env

    parser = argparse.ArgumentParser(description="Send the same malformed requests to the course engine's server and "
                                                 "to vLLM's, and print their answers side by side.")
    parser.add_argument("--model", default="embedded", help="MODEL string (default: embedded)")
    parser.add_argument("--context", type=int, default=1024,
                        help="tokens: the course engine's cache capacity and vLLM's --max-model-len (a multiple of 16)")
    parser.add_argument("--no-vllm", action="store_true", help="the course engine's server only")
    parser.add_argument("--out", default=None, help="also write the table (Markdown) to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_positive_int("--context", args.context)
    if args.context % 16:
        raise SystemExit(f"--context must be a multiple of 16 (the cache's block size), got {args.context}")
    folder, vocab = _model_facts(args.model)
    name = "probe-model"                      # both servers serve the model under this name
    limits = ServerLimits(name, vocab, args.context, engine_server.MAX_BODY_BYTES, engine_server.HEAD_TIMEOUT_S)
    probes = malformed_requests(limits)
    logs = Path(tempfile.gettempdir())
    answers: dict[str, list[Answer]] = {}
    notes = [f"{len(probes)} requests, one at a time, to each server on {args.model} ({Path(folder).name}, vocabulary "
             f"{vocab:,}, context {args.context} tokens); {datetime.date.today().isoformat()}, "
             f"{platform.machine()}, {os.cpu_count()} CPUs."]

    srv = engine_server.start_engine_server(args.model, served_model_name=name, num_blocks=args.context // 16,
                                            block_size=16, max_num_seqs=2, log_path=logs / "course-probe-engine.log")
    try:
        answers["course engine's server"] = probe_server(srv.base_url, probes)
    finally:
        srv.stop()
    wrong = [(p.name, why) for p, a in zip(probes, answers["course engine's server"]) if (why := p.mismatch(a))]
    for probe_name, why in wrong:
        print(f"course engine's server: {probe_name!r} was not answered as documented: {why}", flush=True)

    if args.no_vllm:
        notes.append("vLLM: not run (--no-vllm).")
    elif not (support := vllm_env.vllm_available()):
        notes.append(f"vLLM: not run: {support.reason}")
    else:
        log = logs / "course-probe-vllm.log"
        vsrv = vllm_env.start_vllm_server(folder, served_model_name=name, max_model_len=args.context, max_num_seqs=2,
                                          compiled=False, log_path=log)
        try:
            answers["vLLM's server"] = probe_server(vsrv.base_url, probes)
        finally:
            vsrv.stop()
        version = vllm_env.server_settings(log.read_text(errors="replace")).version
        notes.append(f"vLLM {version or '(version not in its log)'}, eager (--enforce-eager), "
                     f"--max-model-len {args.context}; its log: {log}.")
    table = answers_table(probes, answers)
    text = "\n\n".join([" ".join(notes), table]) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 1 if wrong else 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
