"""Chapter 11: the load sweep's verdicts (capacity, queueing, the knee, the SLO from one request alone), the live
check's per-request comparison -- which passes for the course client and fails for a client that stamps its times
at the wrong chunk -- and what is read from vLLM's start-up log."""
from __future__ import annotations

import asyncio
import json
import math
import pickle
import threading

import httpx
import pytest

from course_utils import vllm_env
from course_utils.serving import (
    GROWTH_LIMIT, RatePoint, ReplayResult, RequestRecord, RequestTimes, agreement, baseline_growth, capacity_per_s,
    in_turns, served_knee, make_trace, queueing, rate_sweep_figure, replay, slo_from_solo, spread, sweep_queueing,
    times_from_bench, times_from_records, ttft_by_index_figure, ttft_growth,
)


# ---- load ------------------------------------------------------------------------------------------------------------

def _run(ttfts, rate=2.0, tokens=5, duration=None):
    n = len(ttfts)
    trace = make_trace([[1, 2, 3]] * n, [tokens] * n, rate_per_s=rate, process="fixed")
    recs = [RequestRecord(i, 3, tokens, r.arrival_s, [t + 0.05 * k for k in range(tokens)], [1] * tokens, tokens)
            for i, (r, t) in enumerate(zip(trace.requests, ttfts))]
    end = max(r.start_s + r.chunk_s[-1] for r in recs)
    return ReplayResult(recs, duration or end, "http://x", "m", trace)


def test_a_run_whose_later_requests_wait_longer_queued():
    flat = queueing(_run([0.1, 0.12, 0.09, 0.11, 0.1, 0.1, 0.13, 0.1, 0.11]), baseline_growth=1.0)
    growing = queueing(_run([0.1, 0.12, 0.1, 0.4, 0.6, 0.8, 1.0, 1.3, 1.6]), baseline_growth=1.0)
    assert not flat.queued and flat.growth == pytest.approx(0.11 / 0.1)
    assert growing.queued and growing.growth == pytest.approx(1.3 / 0.1) == growing.relative_growth
    assert growing.drain_s == pytest.approx(9 / growing.served_per_s - growing.arrival_window_s)
    # the same growth, judged against a trace whose own shape already grows 10x, is no queue
    assert not queueing(_run([0.1, 0.12, 0.1, 0.4, 0.6, 0.8, 1.0, 1.3, 1.6]), baseline_growth=10.0).queued
    with pytest.raises(ValueError, match="at least 3"):
        queueing(_run([0.1, 0.2]), baseline_growth=1.0)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="baseline_growth"):
            queueing(_run([0.1] * 9), baseline_growth=bad)


# A trace of 9 requests whose first third arrives in a burst: at every rate those three wait for each other's prefills.
EARLY_BURST_CALM = [0.3, 0.35, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]            # growth 1/3 from the shape alone
EARLY_BURST_QUEUED = [0.3, 0.35, 0.3, 0.3, 0.32, 0.34, 0.36, 0.38, 0.4]       # growth 1.27: a queue builds after the burst
# ... and one whose last third arrives in a burst.
LATE_BURST_CALM = [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.25, 0.3, 0.25]            # growth 2.5 from the shape alone
LATE_BURST_QUEUED = [0.1, 0.1, 0.1, 0.2, 0.3, 0.4, 0.55, 0.6, 0.65]           # growth 6


def test_a_burst_in_the_first_third_does_not_hide_a_queue():
    """On the raw ratio the queued run (1.27) sits under the limit only because the trace's first third waits for its
    own burst; against the same trace at the lowest rate (1/3) it grew 3.8x."""
    pts = [RatePoint(r, _run(EARLY_BURST_CALM, rate=r), k) for r in (1.0, 1.5) for k in (0, 1)]
    pts += [RatePoint(2.0, _run(EARLY_BURST_QUEUED, rate=2.0), k) for k in (0, 1)]
    assert ttft_growth(pts[-1].result) < GROWTH_LIMIT                           # the raw ratio would call it calm
    assert baseline_growth(pts) == pytest.approx(0.1 / 0.3)
    judged = sweep_queueing(pts)
    assert [q.queued for q in judged[2.0]] == [True, True] and not any(q.queued for q in judged[1.5])
    knee = served_knee(pts)
    assert (knee.keeps_up_to, knee.queues_from) == (1.5, 2.0)


def test_a_burst_in_the_last_third_does_not_read_as_a_queue_at_a_low_rate():
    """The raw ratio (2.5) is over the limit at every rate that keeps up; against the lowest rate's it is 1."""
    pts = [RatePoint(r, _run(LATE_BURST_CALM, rate=r), k) for r in (1.0, 1.5) for k in (0, 1)]
    pts += [RatePoint(2.0, _run(LATE_BURST_QUEUED, rate=2.0), k) for k in (0, 1)]
    assert ttft_growth(pts[2].result) >= GROWTH_LIMIT                           # the raw ratio would call it queued
    judged = sweep_queueing(pts)
    assert not any(q.queued for q in judged[1.5]) and all(q.queued for q in judged[2.0])
    knee = served_knee(pts)
    assert (knee.keeps_up_to, knee.queues_from) == (1.5, 2.0)
    low, high = knee.limit_band                    # the limits that give the same verdicts: (1, 6 / 2.5]
    assert low == pytest.approx(1.0) and high == pytest.approx(6 / 2.5)
    assert low < knee.growth_limit <= high
    assert served_knee(pts, growth_limit=2.5).queues_from is None     # a limit above the band changes the verdict


def test_the_knee_lies_between_the_last_calm_rate_and_the_first_that_queued_in_every_repeat():
    calm, busy = [0.1] * 9, [0.1, 0.1, 0.1, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5]
    pts = [RatePoint(1.0, _run(calm), 0), RatePoint(1.0, _run(calm), 1), RatePoint(2.0, _run(calm), 0),
           RatePoint(2.0, _run(busy), 1), RatePoint(3.0, _run(busy), 0), RatePoint(3.0, _run(busy), 1)]
    knee = served_knee(pts)
    assert (knee.keeps_up_to, knee.queues_from) == (1.0, 3.0)
    assert "between" in knee.sentence() and "2.00 req/s the repeats disagreed" in knee.sentence()
    assert knee.limit_band == (pytest.approx(1.0), pytest.approx(13.0))
    never = served_knee([RatePoint(r, _run(calm), k) for r in (1.0, 2.0) for k in (0, 1)])
    assert never.queues_from is None and "did not reach its knee" in never.sentence()
    assert never.limit_band[1] is None
    # the sentence says only what the verdicts support
    unbounded = served_knee([RatePoint(1.0, _run(calm), k) for k in (0, 1)] + [RatePoint(2.0, _run(calm), 0),
                                                                            RatePoint(2.0, _run(busy), 1)])
    assert unbounded.queues_from is None and "does not bound its knee" in unbounded.sentence()
    assert "kept up" not in unbounded.sentence()
    odd = served_knee([RatePoint(r, _run(run), k) for r, run in ((1.0, calm), (2.0, busy), (3.0, calm), (4.0, busy))
                       for k in (0, 1)])
    assert (odd.keeps_up_to, odd.queues_from) == (3.0, 4.0)
    assert "at 2.00 req/s, below it, runs queued" in odd.sentence() and "disagreed" not in odd.sentence()
    assert "in both repeats" in odd.sentence() and "limit 1.5×" in odd.sentence()
    # judged against itself, the lowest rate keeps up; every higher rate that grows past it queues
    ramp = served_knee([RatePoint(1.0, _run(calm), k) for k in (0, 1)] + [RatePoint(2.0, _run(busy), k) for k in (0, 1)])
    assert ramp.keeps_up_to == 1.0 and ramp.queues_from == 2.0
    with pytest.raises(ValueError):
        served_knee([])


def test_the_sweep_figures_show_every_run():
    pts = [RatePoint(r, _run(LATE_BURST_CALM, rate=r), k) for r in (1.0, 1.5) for k in (0, 1)]
    sweeps = {"a": pts, "b": pts[:2]}
    fig = ttft_by_index_figure(sweeps, capacity={"a": 2.0, "b": 2.0})
    assert len(fig.data) == 6 and fig.data[0].name == "a: 1.00 req/s (0.50×)"
    assert list(fig.data[0].x) == list(range(9)) and fig.data[0].y[-1] == pytest.approx(250.0)
    fig = rate_sweep_figure(sweeps)
    drains = [d for d in fig.data if d.xaxis == "x" and d.mode == "markers"][0].y
    assert all(d > 0 for d in drains)


def test_capacity_slo_and_spread_and_their_bad_input():
    assert capacity_per_s(0.1, 8, 16.0) == pytest.approx(5.0)          # 80 tok/s over 16-token answers
    assert capacity_per_s(0.1, 8, 16.0, prefill_s=0.2) == pytest.approx(1 / 0.4)   # 0.2 s of decode + 0.2 s prefill
    slo = slo_from_solo(0.08, 0.05, ttft_factor=4, tpot_factor=2)
    assert (slo.ttft_ms, slo.tpot_ms) == (320.0, 100.0)
    s = spread([3.0, 1.0, 2.0])
    assert (s.median, s.low, s.high) == (2.0, 1.0, 3.0) and s.fmt(".1f", " ms") == "2.0 ms (1.0–3.0)"
    for bad in (lambda: capacity_per_s(0.0, 8, 16), lambda: capacity_per_s(0.1, 0, 16), lambda: capacity_per_s(0.1, 8, 16, -1.0),
                lambda: slo_from_solo(-1, 0.05, ttft_factor=4, tpot_factor=2), lambda: spread([])):
        with pytest.raises(ValueError):
            bad()


def test_sweep_rates_run_the_shared_rate_in_place_of_a_factor_rate_close_to_it():
    from course_utils.serving import sweep_rates
    factors = [0.5, 0.75, 1.0, 1.25]
    alone = sweep_rates(6.24, factors)
    assert alone.rates == [3.12, 4.68, 6.24, 7.8] and alone.replaced is None
    # the course engine's capacity is its own 1.0x rate: nothing to add, nothing left out
    assert sweep_rates(3.59, factors, shared_per_s=3.59) == sweep_rates(3.59, factors)
    # vLLM, faster: the shared 3.59 req/s (0.58x) is 15 % above its 0.5x rate, which it replaces
    got = sweep_rates(6.24, factors, shared_per_s=3.59)
    assert got.rates == [3.59, 4.68, 6.24, 7.8] and got.replaced == (0.5, 3.12)
    # no factor rate within the limit: the shared rate is added to the four
    far = sweep_rates(6.24, factors, shared_per_s=2.0)
    assert far.rates == [2.0, 3.12, 4.68, 6.24, 7.8] and far.replaced is None
    assert sweep_rates(6.24, factors, shared_per_s=3.59, merge_within=0.1).replaced is None
    # only the nearest factor rate goes, even when two are within the limit
    assert sweep_rates(10.0, [0.9, 1.0, 1.1], shared_per_s=10.4, merge_within=0.5) == \
        type(got)([9.0, 10.4, 11.0], (1.0, 10.0))
    for bad in (lambda: sweep_rates(0.0, factors), lambda: sweep_rates(5.0, []), lambda: sweep_rates(5.0, [0.5, -1]),
                lambda: sweep_rates(5.0, factors, shared_per_s=0.0), lambda: sweep_rates(5.0, factors, merge_within=-0.1)):
        with pytest.raises(ValueError):
            bad()


# ---- the live check: passes for the course client, fails for a wrongly stamped one -----------------------------------

FIRST_S, STEP_S = 0.06, 0.04


def _fake_server():
    """A streaming /v1/completions server with a known clock: the first token FIRST_S after the request, then one
    every STEP_S; ``max_tokens`` tokens, then usage and [DONE]. Returns (url, stop)."""
    async def handle(reader, writer):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            headers = dict(l.lower().split(":", 1) for l in head.decode().split("\r\n")[1:] if ":" in l)
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            if head.startswith(b"GET"):
                out = b'{"data": [{"id": "m"}]}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(out) + out)
                await writer.drain()
                continue
            n = json.loads(body)["max_tokens"]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")

            async def send(payload: str):
                data = f"data: {payload}\n\n".encode()
                writer.write(b"%x\r\n" % len(data) + data + b"\r\n")
                await writer.drain()

            for k in range(n):
                await asyncio.sleep(FIRST_S if k == 0 else STEP_S)
                await send(json.dumps({"choices": [{"index": 0, "text": "a", "token_ids": [1],
                                                    "finish_reason": "length" if k == n - 1 else None}]}))
            await send(json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}))
            await send("[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box = {}

    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        box["url"], box["srv"] = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", srv
        ready.set()
        box["stopped"] = asyncio.Event()
        async with srv:
            await box["stopped"].wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    ready.wait(10)

    def stop():
        loop.call_soon_threadsafe(box["stopped"].set)
        thread.join(10)
    return box["url"], stop


def _schedule(trace) -> list[RequestTimes]:
    """What an exact client measures on the fake server: the server's own clock."""
    return [RequestTimes(0.0, FIRST_S, FIRST_S + (r.output_tokens - 1) * STEP_S, r.output_tokens) for r in trace.requests]


@pytest.fixture(scope="module")
def fake():
    url, stop = _fake_server()
    yield url
    stop()


def _rounds(url, trace, n=2):
    return [times_from_records(replay(url, "m", trace, max_concurrency=1, warmup=0, progress=False)) for _ in range(n)]


TRACE = make_trace([[1, 2, 3]] * 4, [6, 3, 9, 5], rate_per_s=math.inf)


def test_the_course_client_agrees_with_an_exact_clock_request_by_request(fake):
    verdict = agreement(_rounds(fake, TRACE), [_schedule(TRACE)] * 2)
    assert verdict.ok, verdict.failures
    assert verdict.step_s == pytest.approx(STEP_S) and verdict.tolerance_s == pytest.approx(STEP_S / 2)


def test_a_replay_in_a_process_of_its_own_measures_the_same(fake):
    from course_utils.serving import ReplayError, replay_in_process
    res = replay_in_process(fake, "m", TRACE, max_concurrency=1, warmup=0, progress=False)
    assert [r.output_tokens for r in res.records] == [6, 3, 9, 5] and res.started_at > 0
    assert agreement([times_from_records(res)], [_schedule(TRACE)]).ok
    with pytest.raises(ValueError, match="serves"):                         # its errors reach the caller
        replay_in_process(fake, "other", TRACE, progress=False)
    bad = make_trace([[1, 2, 3]], [0 + 2], rate_per_s=math.inf)
    assert isinstance(pickle.loads(pickle.dumps(ReplayError("x", replay(fake, "m", bad, progress=False)))), ReplayError)


def test_the_replay_process_imports_neither_torch_nor_transformers():
    """A replay in a process of its own starts in a fraction of a second: the client, its records and their metrics
    need numpy and httpx only (chapter 11 starts one per round of its live check)."""
    import subprocess
    import sys
    code = ("import sys, course_utils.serving.client, course_utils.serving.metrics; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def _buffered_lines(lag_lines: int | None):
    """A mutant of the client's reading: each line handed over only ``lag_lines`` lines later (None: after the
    whole body), so that the client stamps each chunk when a later one has arrived."""
    original = httpx.Response.aiter_lines

    async def aiter_lines(self):
        held = []
        async for line in original(self):
            held.append(line)
            if lag_lines is not None and len(held) > lag_lines:
                yield held.pop(0)
        for line in held:
            yield line
    return aiter_lines


@pytest.mark.parametrize("lag, why", [(None, "after the whole body"), (2, "at the next chunk")])
def test_a_client_that_stamps_tokens_at_the_wrong_chunk_fails_the_live_check(fake, monkeypatch, lag, why):
    monkeypatch.setattr(httpx.Response, "aiter_lines", _buffered_lines(lag))   # SSE: a data line, then a blank one
    verdict = agreement(_rounds(fake, TRACE), [_schedule(TRACE)] * 2)
    assert not verdict.ok, why
    assert any("TTFT differs" in f for f in verdict.failures), verdict.failures


def test_a_round_slowed_by_the_machine_does_not_fail_the_live_check_but_a_late_client_does():
    """TTFT is compared on each client's fastest round: a round where a client waited for a CPU adds time to that
    round only, while a client that stamps late does so in every round."""
    exact = _schedule(TRACE)

    def shifted(times, by_s, only=None):
        return [RequestTimes(t.sent_at, t.ttft_s + by_s * (only in (None, i)), t.e2el_s + by_s * (only in (None, i)),
                             t.output_tokens) for i, t in enumerate(times)]
    disturbed = agreement([exact, shifted(exact, 4 * STEP_S, only=1)], [exact, exact])
    assert disturbed.ok, disturbed.failures                   # a median of the two rounds would be 2 steps off
    assert disturbed.rows[1].ttft_ours_s == exact[1].ttft_s and disturbed.rows[1].round_to_round_s > STEP_S
    late = agreement([shifted(exact, STEP_S), shifted(shifted(exact, STEP_S), 4 * STEP_S, only=1)], [exact, exact])
    assert not late.ok and len([f for f in late.failures if "TTFT differs" in f]) == len(exact)


def test_a_miscounted_answer_fails_the_live_check():
    exact = _schedule(TRACE)
    wrong = [RequestTimes(t.sent_at, t.ttft_s, t.e2el_s, t.output_tokens + (i == 1)) for i, t in enumerate(exact)]
    verdict = agreement([wrong, wrong], [exact, exact])
    assert not verdict.ok and "request 1: output tokens differ" in verdict.failures[0]


def test_the_live_check_refuses_mismatched_rounds_and_reads_vllms_saved_result():
    exact = _schedule(TRACE)
    with pytest.raises(ValueError, match="same requests"):
        agreement([exact, exact[:2]], [exact])
    with pytest.raises(ValueError, match="different numbers"):
        agreement([exact[:2]], [exact])
    saved = {"start_times": [1.0, 2.0], "ttfts": [0.1, 0.2], "latencies": [0.5, 0.6], "output_lens": [5, 6],
             "errors": ["", ""]}
    assert times_from_bench(saved)[1] == RequestTimes(2.0, 0.2, 0.6, 6)
    with pytest.raises(ValueError, match="failed"):
        times_from_bench({**saved, "errors": ["", "HTTP 500"]})
    with pytest.raises(ValueError, match="start_times"):
        times_from_bench({"ttfts": []})


def test_the_two_clients_take_turns_round_by_round():
    """Never two rounds of one client in a row: a slow spell over two rounds in a row slows one round of each."""
    calls = []

    def client(name):
        def one_round():
            calls.append(name)
            return [RequestTimes(len(calls), 0.1, 0.5, 5)]
        return one_round

    ours, theirs = in_turns(3, client("ours"), client("theirs"))
    assert calls == ["ours", "theirs"] * 3
    assert [r[0].sent_at for r in ours] == [1, 3, 5] and [r[0].sent_at for r in theirs] == [2, 4, 6]
    with pytest.raises(ValueError, match="rounds"):
        in_turns(0, client("ours"), client("theirs"))


# ---- vLLM's start-up log and the trace file for its benchmark ---------------------------------------------------------

LOG = """(APIServer pid=1) INFO [api_utils.py:286] non-default args: {'dtype': 'float32', 'max_num_seqs': 8, 'enable_prefix_caching': False}
(EngineCore pid=2) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/m', dtype=torch.float32, max_seq_len=1024, enforce_eager=False, enable_prefix_caching=False, enable_chunked_prefill=True, compilation_config={'mode': <CompilationMode.DYNAMO_TRACE_ONCE: 2>, 'backend': 'inductor', 'compile_ranges_endpoints': [2048], 'cudagraph_mode': <CUDAGraphMode.NONE: 0>}
(EngineCore pid=2) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]
(EngineCore pid=2) INFO [ompmultiprocessing.py:185] \treserved_cpus=[1]
(EngineCore pid=2) INFO [torch_utils.py:295] Reducing Torch threads from 2 to 1 for serving.
"""


def test_what_vllm_did_is_read_from_its_log():
    s = vllm_env.server_settings(LOG)
    assert (s.version, s.dtype, s.bound_cpus, s.reserved_cpus, s.torch_threads) == ("0.32.0", "float32", "[0]", "[1]", 1)
    assert (s.max_num_seqs, s.token_budget, s.prefix_caching, s.chunked_prefill) == (8, 2048, False, True)
    assert s.max_model_len == 1024
    assert (s.compile_mode, s.compile_backend, s.enforce_eager) == ("DYNAMO_TRACE_ONCE", "inductor", False)
    empty = vllm_env.server_settings("nothing here")
    assert empty.token_budget is None and empty.chunked_prefill is None and empty.version is None


def test_vllms_step_budget_is_read_from_its_scheduler_line_first():
    line = ("(APIServer pid=1) INFO 12-06 11:31:32 [scheduler.py:307] Chunked prefill is enabled with "
            "max_num_batched_tokens=512.\n")
    assert vllm_env.server_settings(line + LOG).token_budget == 512        # the scheduler's word over the graph's range
    assert vllm_env.server_settings(line).token_budget == 512               # no compile-range line
    assert vllm_env.server_settings(LOG).token_budget == 2048               # the compile range, as a fallback


def test_the_trace_file_carries_the_trace_for_vllms_benchmark(tmp_path):
    path = vllm_env.write_trace_file(TRACE, tmp_path / "t.jsonl")
    rows = [json.loads(l) for l in path.read_text().splitlines()]
    assert [r["prompt_token_ids"] for r in rows] == [[1, 2, 3]] * 4 and [r["output_length"] for r in rows] == [6, 3, 9, 5]
    assert {r["timestamp"] for r in rows} == {0.0}
    args = vllm_env.bench_trace_args("http://h:1/", "/m", "vllm", path, num_prompts=4)
    assert args[args.index("--ready-check-timeout-sec") + 1] == "0" and args[args.index("--num-warmups") + 1] == "1"
    assert args[args.index("--dataset-name") + 1] == "timed_trace" and "--ignore-eos" in args
    with pytest.raises(ValueError, match="text prompt"):
        vllm_env.write_trace_file(make_trace(["hi"], [2], rate_per_s=1.0, prompt_tokens=[1]), tmp_path / "x.jsonl")


def test_a_crowded_machine_is_named(monkeypatch):
    from course_utils.serving import machine_busy
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (5.0, 4.0, 3.0), raising=False)
    assert machine_busy() == (True, "one-minute load average 5.0 on 2 CPUs")
    monkeypatch.setattr("os.getloadavg", lambda: (1.5, 1.0, 1.0), raising=False)
    assert machine_busy()[0] is False
    monkeypatch.delattr("os.getloadavg", raising=False)
    assert machine_busy() == (False, "load average unknown here (2 CPUs)")


def test_the_live_checks_body_is_the_one_vllm_bench_serve_sends():
    """Without token ids the course client's body holds vLLM's benchmark's keys, but for its two no-op fields."""
    from course_utils.serving import completion_payload
    from course_utils.serving.trace import TraceRequest
    req = TraceRequest((1, 2, 3), 3, 4, 0.0)
    ours = completion_payload("m", req, return_token_ids=False)
    theirs = {"model": "m", "prompt": [1, 2, 3], "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None,
              "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
    assert ours == {k: v for k, v in theirs.items() if k not in ("repetition_penalty", "logprobs")}
    assert completion_payload("m", req)["return_token_ids"] is True


def test_a_python_helper_process_is_named_by_what_it_runs():
    from course_utils.serving.processes import process_label

    class Proc:
        def __init__(self, name, cmdline):
            self._name, self._cmdline = name, cmdline

        def name(self):
            return self._name

        def cmdline(self):
            return self._cmdline

    assert process_label(Proc("VLLM::Worker", ["x"])) == "VLLM::Worker"
    assert process_label(Proc("python3", ["/v/bin/python3", "/t/torch/_inductor/compile_worker/__main__.py",
                                          "--workers=2"])) == "python3: compile_worker"
    assert process_label(Proc("python3", ["python3", "-c", "from multiprocessing.resource_tracker import main;main(5)"])
                         ) == "python3: multiprocessing.resource_tracker"
    assert process_label(Proc("python", ["python", "-u", "-m", "vllm.entrypoints.openai.api_server"])
                         ) == "python: vllm.entrypoints.openai.api_server"
    assert process_label(Proc("python", [])) == "python"
