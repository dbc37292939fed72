"""The course engine's server under load and faults, over loopback, on the tiny qwen2 model (bounded: < 1 min).

Many concurrent streaming clients, a share of them disconnecting at random points; malformed requests between
them (``course_utils.serving.probe``'s battery: bad JSON, wrong types, huge and negative ``max_tokens``,
out-of-vocabulary ids, an over-long prompt, an oversized body, a request-smuggling attempt, a request head never
finished, a lone surrogate, JSON nested 100,000 deep, a 70 KB header), an HTTP/1.0 request; one step made to fail. Afterwards every well-formed request that stayed connected
got exactly its greedy tokens, every malformed one a 4xx naming the problem, the failed step cost only its own
requests, the pool's blocks are all free and its invariants hold, ``/health`` answers, and the server's memory
stayed within a bound.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import psutil
import pytest
import torch

from course_utils import engine_server
from course_utils.engine import LLMEngine
from course_utils.engine_server import EngineServer
from course_utils.serving.probe import ServerLimits, malformed_requests, raw_exchange, send

MARK = 4242                  # a prompt starting with this token is in the step made to fail
RSS_GROWTH_BOUND = 64 << 20  # the soak round may add at most this to the process's RSS after a warm-up round


@pytest.fixture(scope="module")
def served(tiny_gguf):
    from course_utils.models import load_model
    torch.set_grad_enabled(False)
    model, tok = load_model(str(tiny_gguf), verbose=False)
    engine = LLMEngine(model, num_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=128)
    failed_batches = []
    run = engine.runner.run

    def run_or_fail(seqs):           # one step fails, as an out-of-memory error would
        if not failed_batches and any(s.token_ids[0] == MARK for s in seqs):
            failed_batches.append([tuple(s.prompt_ids) for s in seqs])
            raise MemoryError("injected: can't allocate 336000000 bytes")
        return run(seqs)
    engine.runner.run = run_or_fail
    old = engine_server.HEAD_TIMEOUT_S
    engine_server.HEAD_TIMEOUT_S = 2.0
    server = EngineServer(engine, tok, model_name="tiny", max_queued=64).start_in_thread()
    reference = LLMEngine(model, num_blocks=64, block_size=8, max_num_seqs=1)
    yield server, engine, tok, reference, failed_batches
    server.close()
    engine_server.HEAD_TIMEOUT_S = old


def _solo(reference, prompt, n):
    return reference.generate([list(prompt)], n, ignore_eos=True)[0].output_ids


async def _stream(client, url, prompt, n, *, drop_after=None):
    """Stream one request; ``drop_after``: close the connection after that many chunks. Returns (status, ids, error)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    ids, chunks = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code, ids, (await resp.aread()).decode()
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return 200, ids, None
            msg = json.loads(data)
            if "error" in msg:
                return 500, ids, msg["error"]["message"]
            if msg["choices"]:
                ids += msg["choices"][0]["token_ids"]
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    return "dropped", ids, None
    return "closed", ids, None


def _battery(engine):
    """The malformed and hostile requests of ``course_utils.serving.probe``, for this server."""
    return malformed_requests(ServerLimits("tiny", engine.vocab_size, engine.capacity_tokens,
                                           engine_server.MAX_BODY_BYTES, engine_server.HEAD_TIMEOUT_S))


def _rss():
    return psutil.Process().memory_info().rss


async def _round(server, engine, n, rng, *, faults):
    url = server.url
    host, port = url.removeprefix("http://").split(":")
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, trust_env=False, limits=limits) as client:
        jobs, kinds = [], []
        for i in range(n):
            prompt = [rng.randrange(10, 3000) for _ in range(rng.randint(2, 30))]
            if faults and i == n // 2:
                prompt[0] = MARK
            out = rng.randint(1, 20)
            drop = rng.randint(1, 3) if faults and rng.random() < 0.3 and out > 3 else None
            jobs.append(_stream(client, url, prompt, out, drop_after=drop))
            kinds.append((prompt, out, drop))
        bad = _battery(engine) if faults else []
        bad_jobs = [send(client, url, probe) for probe in bad]
        raw_jobs = [raw_exchange(host, int(port), b"GET /health HTTP/1.0\r\n\r\n")] if faults else []   # HTTP/1.0
        t0 = time.perf_counter()
        results = await asyncio.gather(*jobs, *bad_jobs, *raw_jobs)
        elapsed = time.perf_counter() - t0
    return kinds, results[:n], list(zip(bad, results[n:n + len(bad)])), results[n + len(bad):], elapsed


async def _idle(server, engine, timeout_s=10.0):
    t0 = time.perf_counter()
    while server.queued or server.active or engine.has_unfinished():
        assert time.perf_counter() - t0 < timeout_s, "the server did not become idle"
        await asyncio.sleep(0.05)


def test_soak_with_disconnects_malformed_requests_and_a_failing_step(served):
    server, engine, tok, reference, failed_batches = served
    rng = random.Random(11)
    t0 = time.perf_counter()
    asyncio.run(_round(server, engine, 12, rng, faults=False))               # warm-up: allocator, tokenizer
    asyncio.run(_idle(server, engine))
    rss0 = _rss()
    kinds, results, bad, raw, elapsed = asyncio.run(_round(server, engine, 48, rng, faults=True))
    asyncio.run(_idle(server, engine))
    rss1 = _rss()

    # the failed step cost exactly the requests it ran, and each got a 500 naming the error
    assert len(failed_batches) == 1
    failed = set(failed_batches[0])
    assert any(p[0] == MARK for p in failed)
    for (prompt, out, drop), (status, ids, error) in zip(kinds, results):
        if tuple(prompt) in failed:
            assert status == 500 and "MemoryError" in error, (prompt, status, error)
        elif drop is None:
            assert status == 200 and ids == _solo(reference, prompt, out), (prompt, status, error)
        else:
            assert status == "dropped" and ids == _solo(reference, prompt, out)[:len(ids)]
    assert sum(d is not None for _, _, d in kinds) >= 5                     # a share of clients went away

    # each malformed request got the course server's documented answer: its status, a word naming the problem; the
    # smuggling attempt one 400 and its connection closed; a head never finished closed unanswered after the head
    # timeout; a body shorter than its Content-Length waited for, nothing run
    assert len(bad) >= 20
    for probe, answer in bad:
        assert probe.mismatch(answer) is None, (probe.name, probe.mismatch(answer), answer)

    [(http10, http10_closed)] = raw
    assert http10.startswith(b"HTTP/1.1 200") and b"chunked" not in http10.lower() and http10_closed

    # the engine is whole, empty and still serving
    assert engine.block_manager.num_free_blocks == 64
    engine.check_invariants()
    assert engine.sequences == {} and engine.steps == []
    assert httpx.get(server.url + "/health", trust_env=False).status_code == 200
    after = asyncio.run(_round(server, engine, 4, rng, faults=False))
    assert all(r[0] == 200 and r[1] == _solo(reference, k[0], k[1]) for k, r in zip(after[0], after[1]))
    assert rss1 - rss0 < RSS_GROWTH_BOUND, f"RSS grew {(rss1 - rss0) / 2**20:.1f} MiB during the soak"
    print(f"soak: {len(kinds)} streams + {len(bad) + len(raw)} malformed in {elapsed:.1f} s; "
          f"RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB; total {time.perf_counter() - t0:.1f} s")
    assert time.perf_counter() - t0 < 60


def test_a_disconnected_clients_blocks_are_back_within_one_step(served):
    server, engine, tok, reference, _ = served
    starts, prompts = [], {}                       # at each step's start: when, and which sequences it may run
    step = engine.step

    def recorded():
        live = engine.scheduler.running + list(engine.scheduler.waiting)
        prompts.update((s.seq_id, s.prompt_ids) for s in live)
        starts.append((time.perf_counter(), {s.seq_id for s in live}))
        return step()
    engine.step = recorded
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
                keep = asyncio.create_task(_stream(client, server.url, [7, 8, 9], 60))
                await asyncio.sleep(0.05)
                status, ids, _ = await _stream(client, server.url, [11, 12, 13, 14], 200, drop_after=2)
                dropped_at = time.perf_counter()
                return status, dropped_at, await keep
        status, dropped_at, (keep_status, keep_ids, _) = asyncio.run(main())
    finally:
        engine.step = step
    gone = {i for i, p in prompts.items() if p == [11, 12, 13, 14]}
    assert len(gone) == 1
    assert status == "dropped" and keep_status == 200 and keep_ids == _solo(reference, [7, 8, 9], 60)
    after = [ids for t, ids in starts if t > dropped_at]
    late = sum(bool(ids & gone) for ids in after)
    print(f"disconnect: {late} step(s) started after the client left still held the request ({len(after)} after)")
    assert len(after) > 3 and late <= 1, "it kept computing after its client left"
    assert engine.block_manager.num_free_blocks == 64
