"""The engine under a server: cancellation (``abort_request``), a failing step (``StepFailed``), a prefill budget
counted in padded tokens, finished requests forgotten; and the server's request model (what it accepts and refuses).

The server under load and faults, over loopback, is ``test_server_soak.py``.
"""
from __future__ import annotations

import pytest
import torch

from course_utils.engine import LLMEngine, Scheduler, BlockManager, Sequence, StepFailed


def _solo(model, prompt, n):
    engine = LLMEngine(model, num_blocks=32, block_size=4, max_num_seqs=1)
    return engine.generate([prompt], n, ignore_eos=True)[0].output_ids


# ---- cancellation ----------------------------------------------------------------------------------------------------

def test_abort_takes_a_queued_request_out_and_the_others_keep_their_tokens(tiny_llama):
    engine = LLMEngine(tiny_llama, num_blocks=32, block_size=4, max_num_seqs=1)
    a, b, c = (engine.add_request([5 + i, 6, 7], 5, ignore_eos=True) for i in range(3))
    engine.step()                                          # a runs, b and c wait
    free = engine.block_manager.num_free_blocks
    assert engine.abort_request(b) and not engine.abort_request(b)          # a second abort does nothing
    assert engine.sequences[b].finish_reason == "abort" and engine.block_manager.num_free_blocks == free
    while engine.has_unfinished():
        engine.step()
    assert engine.sequences[b].num_output_tokens == 0
    assert engine.sequences[a].output_ids == _solo(tiny_llama, [5, 6, 7], 5)
    assert engine.sequences[c].output_ids == _solo(tiny_llama, [7, 6, 7], 5)
    assert engine.block_manager.num_free_blocks == 32


def test_abort_of_a_running_request_frees_its_blocks_before_the_next_step_and_only_drops_shared_references(tiny_llama):
    engine = LLMEngine(tiny_llama, num_blocks=32, block_size=4, max_num_seqs=4)
    prefix = [9, 8, 7, 6, 5, 4, 3, 2]                      # two full blocks, shared
    keep = engine.add_request(prefix + [11], 8, ignore_eos=True)
    engine.step()
    gone = engine.add_request(prefix + [12, 13], 8, ignore_eos=True)
    engine.step()                                          # prefill of `gone`, sharing the prefix's two blocks
    shared = engine.sequences[gone].block_table[:2]
    assert shared == engine.sequences[keep].block_table[:2]
    assert [engine.block_manager.blocks[b].ref_count for b in shared] == [2, 2]
    own = engine.sequences[gone].block_table[2:]
    engine.step()
    assert engine.abort_request(gone)
    engine.check_invariants()
    assert [engine.block_manager.blocks[b].ref_count for b in shared] == [1, 1]       # still held by `keep`
    assert all(b in engine.block_manager.free for b in own)
    assert not engine.abort_request(gone)                  # never freed twice
    engine.check_invariants()
    n_steps = len(engine.steps)
    engine.step()
    assert engine.steps[n_steps].num_seqs == 1             # the next step no longer runs it
    while engine.has_unfinished():
        engine.step()
    assert engine.sequences[keep].output_ids == _solo(tiny_llama, prefix + [11], 8)
    assert engine.block_manager.num_free_blocks == 32 and engine.scheduler.free_slots == [0, 1, 2, 3]


def test_abort_under_the_static_policy_gives_the_slot_and_blocks_back_at_once(tiny_qwen2):
    engine = LLMEngine(tiny_qwen2, num_blocks=32, block_size=4, max_num_seqs=2, policy="static")
    a = engine.add_request([1, 2, 3], 6, ignore_eos=True)
    b = engine.add_request([4, 5, 6], 6, ignore_eos=True)
    engine.step()
    engine.abort_request(a)
    engine.check_invariants()
    while engine.has_unfinished():
        engine.step()
    assert engine.sequences[b].output_ids == _solo(tiny_qwen2, [4, 5, 6], 6)
    assert engine.block_manager.num_free_blocks == 32


# ---- a step that raises --------------------------------------------------------------------------------------------

def _fail_when(engine, marker: int, times: int = 1):
    """Make the model run raise (as an out-of-memory error would) on a step whose batch holds a prompt starting with
    ``marker``, ``times`` times."""
    run, left = engine.runner.run, [times]

    def failing(seqs):
        if left[0] and any(s.token_ids[0] == marker for s in seqs):
            left[0] -= 1
            raise MemoryError("injected: can't allocate 336000000 bytes")
        return run(seqs)
    engine.runner.run = failing


@pytest.mark.parametrize("in_prefill", [True, False])
def test_a_failing_step_fails_only_its_sequences_and_the_engine_goes_on(tiny_llama, in_prefill):
    engine = LLMEngine(tiny_llama, num_blocks=32, block_size=4, max_num_seqs=4)
    ok = engine.add_request([20, 21, 22, 23, 24], 6, ignore_eos=True)
    engine.step()                                          # `ok` is running alone
    engine.step()
    bad_prompt = [99, 98, 97, 96, 95]
    if not in_prefill:                                     # a decode step holding both fails: both fail
        bad = engine.add_request(bad_prompt, 6, ignore_eos=True)
        engine.step()
        _fail_when(engine, 99)
        with pytest.raises(StepFailed, match="MemoryError") as info:
            engine.step()
        assert {s.seq_id for s in info.value.seqs} == {ok, bad}
        victims = [ok, bad]
    else:                                                  # a prefill of the bad request alone: `ok` is unaffected
        _fail_when(engine, 99)
        bad = engine.add_request(bad_prompt, 6, ignore_eos=True)
        with pytest.raises(StepFailed, match="336000000") as info:
            engine.step()
        assert [s.seq_id for s in info.value.seqs] == [bad]
        victims = [bad]
    for v in victims:
        assert engine.sequences[v].finish_reason == "error" and "MemoryError" in engine.sequences[v].error
        assert engine.sequences[v].block_table == []
    engine.check_invariants()
    while engine.has_unfinished():
        engine.step()
    if in_prefill:
        assert engine.sequences[ok].output_ids == _solo(tiny_llama, [20, 21, 22, 23, 24], 6)
    again = engine.add_request(bad_prompt, 6, ignore_eos=True)        # the same prompt, served this time
    while engine.has_unfinished():
        engine.step()
    assert engine.sequences[again].num_cached_tokens == 0             # the failed step's blocks were not reused
    assert engine.sequences[again].output_ids == _solo(tiny_llama, bad_prompt, 6)
    assert engine.block_manager.num_free_blocks == 32


def test_a_server_engine_forgets_finished_requests_and_keeps_no_step_records(tiny_llama):
    engine = LLMEngine(tiny_llama, num_blocks=32, block_size=4, max_num_seqs=2, keep_history=False)
    ids = [engine.add_request([3, 4, i + 5], 3, ignore_eos=True) for i in range(5)]
    gone = engine.add_request([1, 2], 3, ignore_eos=True)
    engine.abort_request(gone)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert len(set(ids)) == 5 and sorted(s.seq_id for s in done) == ids
    assert engine.sequences == {} and engine.steps == []


# ---- the prefill budget counts padded tokens -------------------------------------------------------------------------

def _queue(lengths, *, budget, slots=8):
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=slots, max_num_batched_tokens=budget)
    for i, n in enumerate(lengths):
        sched.add(Sequence(i, list(range(1, n + 1)), 4, block_size=4))
    return sched


@pytest.mark.parametrize("lengths", [[1, 1, 1, 1, 1, 1, 30], [30, 1, 1, 1, 1, 1, 1]])
def test_a_long_prompt_is_not_batched_with_short_ones_beyond_the_padded_budget(lengths):
    sched = _queue(lengths, budget=32)
    batches = []
    while sched.waiting:
        seqs, is_prefill = sched.schedule()
        assert is_prefill
        batches.append([len(s) for s in seqs])
        assert len(seqs) * max(len(s) for s in seqs) <= 32 or len(seqs) == 1
    assert [30] in batches and sum(map(len, batches)) == 7


def test_the_padded_budget_keeps_the_tokens_exact(tiny_llama):
    prompts = [[3 + i] for i in range(6)] + [list(range(1, 41))]
    engine = LLMEngine(tiny_llama, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=48)
    outs = engine.generate(prompts, 4, ignore_eos=True)
    assert [st.num_seqs for st in engine.steps if st.is_prefill] == [6, 1]
    assert [o.output_ids for o in outs] == [_solo(tiny_llama, p, 4) if len(p) < 30 else
                                            LLMEngine(tiny_llama, num_blocks=64, block_size=4, max_num_seqs=1)
                                            .generate([p], 4, ignore_eos=True)[0].output_ids for p in prompts]


# ---- the request model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, match", [
    ({"prompt": [1], "top_p": 0.9}, "top_p"), ({"prompt": [1], "seed": 1}, "seed"),
    ({"prompt": [1], "stream": "false"}, "stream"), ({"prompt": [1], "max_tokens": 8.0}, "max_tokens"),
    ({"prompt": [1], "max_tokens": "ten"}, "max_tokens"), ({"prompt": [1], "max_tokens": -1}, "max_tokens"),
    ({"prompt": [1], "n": True}, "n"), ({"prompt": [1, True]}, "prompt"), ({"prompt": "\ud800"}, "UTF-8"),
    ({"prompt": [1], "stream_options": {"include_usage": True, "x": 1}}, "x"),
    ({"prompt": [1], "temperature": 0.7}, "greedily"), ({"prompt": {"a": 1}}, "prompt"),
])
def test_the_request_model_refuses_unknown_fields_and_wrong_types_by_name(body, match):
    from course_utils.engine_server import CompletionBody, describe_errors
    from pydantic import ValidationError
    with pytest.raises(ValidationError) as info:
        CompletionBody.model_validate(body)
    assert match in describe_errors(info.value.errors())


def test_the_request_model_accepts_what_the_course_client_and_vllm_bench_send():
    from course_utils.engine_server import CompletionBody
    from course_utils.serving.client import completion_payload
    from course_utils.serving.trace import TraceRequest
    body = completion_payload("m", TraceRequest((1, 2, 3), 3, 4, 0.0))
    assert CompletionBody.model_validate(body).stream
    bench = {"model": "m", "prompt": "Hi", "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None,
             "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}
    assert CompletionBody.model_validate(bench).max_tokens == 4


# ---- the server: a bounded queue, a failing step ------------------------------------------------------------------------

@pytest.fixture
def small_server(tiny_gguf):
    from course_utils.engine_server import EngineServer
    from course_utils.models import load_model
    torch.set_grad_enabled(False)
    model, tok = load_model(str(tiny_gguf), verbose=False)
    engine = LLMEngine(model, num_blocks=32, block_size=8, max_num_seqs=1)
    server = EngineServer(engine, tok, model_name="tiny", max_queued=1).start_in_thread()
    yield server, engine, model
    server.close()


def test_a_full_queue_answers_429_and_a_failing_step_leaves_the_server_serving(small_server):
    import asyncio

    import httpx
    server, engine, model = small_server

    async def main():
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            post = lambda p, n: client.post(server.url + "/v1/completions", json={
                "prompt": p, "max_tokens": n, "ignore_eos": True, "return_token_ids": True})
            first = asyncio.create_task(post([1, 2, 3], 200))     # takes the one slot
            while not server.active:
                await asyncio.sleep(0.01)
            second = asyncio.create_task(post([4, 5, 6], 4))       # the one queued place
            while not server.queued and len(server.engine.scheduler.waiting) == 0:
                await asyncio.sleep(0.001)
            third = await post([7, 8, 9], 4)                       # refused
            return await first, await second, third
    first, second, third = asyncio.run(main())
    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429)
    assert "queue is full" in third.json()["error"]["message"]

    _fail_when(engine, 99)
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": [99, 1], "max_tokens": 3}, timeout=60,
                     trust_env=False)
    assert bad.status_code == 500 and "MemoryError" in bad.json()["error"]["message"]
    assert httpx.get(server.url + "/health", trust_env=False).status_code == 200
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": [99, 1], "max_tokens": 3, "ignore_eos": True,
                                                          "return_token_ids": True}, timeout=60, trust_env=False)
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == _solo(model, [99, 1], 3)
    assert engine.block_manager.num_free_blocks == 32 and engine.sequences == {}


def test_at_its_connection_cap_the_server_answers_a_json_503_and_serves_again_below_it(tiny_gguf):
    import asyncio

    import httpx
    from course_utils.engine_server import EngineServer
    from course_utils.models import load_model
    torch.set_grad_enabled(False)
    model, tok = load_model(str(tiny_gguf), verbose=False)
    engine = LLMEngine(model, num_blocks=32, block_size=8, max_num_seqs=1)
    server = EngineServer(engine, tok, model_name="tiny", max_connections=3).start_in_thread()
    host, port = server.url.removeprefix("http://").split(":")
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}

    async def main():
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(2)]    # connected, sending nothing
        while server.open_connections() < 2:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            refused = await client.post(server.url + "/v1/completions", json=body)    # the third connection
            for _, writer in idle:
                writer.close()
            while server.open_connections() > 1:
                await asyncio.sleep(0.01)
            served = await client.post(server.url + "/v1/completions", json=body)
        return refused, served
    try:
        refused, served = asyncio.run(main())
    finally:
        server.close()
    assert refused.status_code == 503 and refused.headers["connection"] == "close"
    assert refused.headers["content-type"] == "application/json"
    assert refused.json()["error"] == {"message": "the server is at its limit of 3 connections; retry later",
                                       "type": "ServiceUnavailable", "param": None, "code": 503}
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2
    assert engine.block_manager.num_free_blocks == 32


def test_a_large_header_is_431_however_its_bytes_arrive(small_server):
    """A head over MAX_HEAD_BYTES is refused with 431 whether it arrives in one write or in small pieces (h11 alone
    answers 400 once an incomplete head passes its own 16 KiB buffer: the answer would depend on the network)."""
    import asyncio
    from urllib.parse import urlsplit

    from course_utils.serving.probe import parse_raw_answer
    server = small_server[0]
    host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"

    async def exchange(pieces):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            for k in range(0, len(head), len(head) // pieces + 1):
                writer.write(head[k:k + len(head) // pieces + 1])
                await writer.drain()
                await asyncio.sleep(0.005 if pieces > 1 else 0)
            return await asyncio.wait_for(reader.read(65536), 5.0)
        finally:
            writer.close()
    for pieces in (1, 70):
        answer = parse_raw_answer(asyncio.run(exchange(pieces)), False, 5.0)
        assert answer.status == 431 and "headers" in answer.message, (pieces, answer)
