"""Chapter 11: the trace, the metrics (on hand-made streams), the streaming client against the course engine's
server, clean shutdown of server processes, and the two checks against vLLM's own benchmark.

The checks against vLLM need its environment (``python tasks.py setup`` creates it where vLLM runs): they are
skipped, with the reason, only where vLLM cannot run; under CI (``CI`` set) on a machine where it can, a
missing environment is a failure.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import textwrap
import time

import httpx
import numpy as np
import psutil
import pytest

from course_utils import vllm_env
from course_utils.engine_server import BadRequest, EngineServer, TextStream, parse_completion_request, \
    start_engine_server
from course_utils.serving import (
    SLO, ReplayError, RequestRecord, ServerUnreachable, Trace, arrival_times_s, distribution, free_port, make_trace,
    replay, request_metrics, skewed_trace, summarize,
)


def _rec(i, chunks, tokens=None, *, start=0.0, prompt=10, error=None, requested=None):
    n = len(chunks) if tokens is None else tokens
    return RequestRecord(i, prompt, requested or n, start, list(chunks), [1] * len(chunks), n, error=error)


# ---- the metrics, on hand-made streams ------------------------------------------------------------------------------

def test_request_metrics_follow_vllm_definitions():
    m = request_metrics(_rec(0, [0.5, 0.6, 0.8, 1.1]))
    assert m.ttft_s == 0.5 and m.e2el_s == 1.1
    assert m.itl_s == pytest.approx((0.1, 0.2, 0.3))
    assert m.tpot_s == pytest.approx((1.1 - 0.5) / 3)


def test_a_chunk_may_hold_several_tokens_so_itl_and_tpot_differ():
    m = request_metrics(_rec(0, [0.5, 1.1], tokens=4))         # two chunks, four tokens
    assert m.itl_s == pytest.approx((0.6,))                     # one gap between chunks
    assert m.tpot_s == pytest.approx(0.6 / 3)                   # but three tokens after the first


def test_chapter_02s_tpot_counts_tokens_not_chunks_when_told():
    from course_utils.prefill_decode import tpot_s
    assert tpot_s([0.5, 1.1]) == pytest.approx(0.6)                     # one token per arrival
    assert tpot_s([0.5, 1.1], n_tokens=4) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="n_tokens"):
        tpot_s([0.5, 0.7, 1.1], n_tokens=2)


def test_one_token_and_one_chunk_answers():
    assert request_metrics(_rec(0, [0.4])).tpot_s is None       # vLLM leaves a one-token answer out of TPOT
    one_chunk = request_metrics(_rec(0, [0.4], tokens=3))
    assert one_chunk.tpot_s == 0.0 and one_chunk.itl_s == () and one_chunk.e2el_s == 0.4


def test_failed_or_empty_requests_have_no_metrics():
    with pytest.raises(ValueError, match="did not succeed"):
        request_metrics(_rec(0, [0.1, 0.2], error="HTTP 500: boom"))
    with pytest.raises(ValueError, match="did not succeed"):
        request_metrics(_rec(0, []))


def test_summary_aggregates_like_vllm():
    recs = [_rec(0, [0.2, 0.3, 0.5], start=0.0), _rec(1, [0.4, 0.45], start=0.5, prompt=20),
            _rec(2, [0.3], start=1.0), _rec(3, [], start=1.5, error="closed early")]
    s = summarize(recs, 2.0, slo=SLO(ttft_ms=300, tpot_ms=100))
    assert (s.completed, s.failed, s.total_input_tokens, s.total_output_tokens) == (3, 1, 40, 6)
    assert s.request_throughput == 1.5 and s.output_throughput == 3.0 and s.total_token_throughput == 23.0
    assert s.ttft.median == 0.3 and s.ttft.mean == pytest.approx(0.3) and s.ttft.n == 3
    assert s.tpot.n == 2 and s.tpot.median == pytest.approx((0.15 + 0.05) / 2)       # the one-token answer is left out
    assert s.itl.n == 3
    assert s.itl.percentiles[50] == pytest.approx(float(np.percentile([0.1, 0.2, 0.05], 50)))
    assert s.e2el.p(99) == pytest.approx(float(np.percentile([0.5, 0.45, 0.3], 99)))
    # goodput: request 0 has TPOT 150 ms > 100; request 1 misses TTFT (400 > 300); request 2 meets both (TPOT as 0)
    assert s.good_requests == 1 and s.request_goodput == 0.5


def test_an_slo_met_exactly_counts_as_good_and_bad_slos_are_refused():
    rec = _rec(0, [0.25, 0.35])
    assert summarize([rec], 1.0, slo=SLO(ttft_ms=250)).good_requests == 1
    for bad in (dict(ttft_ms=0), dict(tpot_ms=-1), dict(e2el_ms=float("nan"))):
        with pytest.raises(ValueError):
            SLO(**bad)
    assert str(SLO(ttft_ms=500, tpot_ms=50)) == "TTFT ≤ 500 ms and TPOT ≤ 50 ms"


def test_distribution_of_nothing_is_zero_as_in_vllm():
    d = distribution([])
    assert d.n == 0 and d.mean == d.median == d.std == 0.0 and d.percentiles == {50: 0.0, 90: 0.0, 99: 0.0}


def test_summary_needs_a_positive_duration():
    with pytest.raises(ValueError, match="duration_s"):
        summarize([_rec(0, [0.1, 0.2])], 0.0)


# ---- the trace --------------------------------------------------------------------------------------------------------

def test_fixed_rate_arrivals_are_evenly_spaced_as_vllm_schedules_them():
    assert arrival_times_s(4, 2.0, process="fixed") == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_poisson_arrivals_are_seeded_sorted_and_end_at_n_over_rate():
    a, b = arrival_times_s(50, 4.0, seed=3), arrival_times_s(50, 4.0, seed=3)
    assert np.array_equal(a, b) and not np.array_equal(a, arrival_times_s(50, 4.0, seed=4))
    assert np.all(np.diff(a) >= 0) and a[0] > 0 and a[-1] == pytest.approx(50 / 4.0)
    assert np.std(np.diff(a)) > 0.05                              # not evenly spaced
    assert np.all(arrival_times_s(5, math.inf) == 0)


@pytest.mark.parametrize("kw", [dict(n=0, rate_per_s=1.0), dict(n=3, rate_per_s=0), dict(n=3, rate_per_s=-2.0),
                                dict(n=3, rate_per_s=1.0, process="bursty"), dict(n=3, rate_per_s=True)])
def test_bad_arrival_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        arrival_times_s(**kw)


@pytest.mark.parametrize("args, match", [
    (([], []), "non-empty"),
    (([[1, 2]], [3, 4]), "2 output lengths for 1 prompts"),
    ((["hello"], [3]), "prompt_tokens"),
    (([[1, 2], []], [3, 4]), "request 1"),
    (([[1, -2]], [3]), "request 0"),
    (([[1, 2]], [0]), "output length of request 0"),
    (("abc", [1, 2, 3]), "non-empty list"),
])
def test_a_malformed_trace_is_refused_with_a_clear_message(args, match):
    with pytest.raises(ValueError, match=match):
        make_trace(*args, rate_per_s=1.0)


def test_trace_at_another_rate_keeps_its_requests():
    tr = make_trace([[1, 2, 3], [4, 5]], [3, 2], rate_per_s=1.0, process="fixed")
    fast = tr.at_rate(4.0)
    assert [r.prompt for r in fast.requests] == [r.prompt for r in tr.requests]
    assert [r.arrival_s for r in fast.requests] == pytest.approx([0.25, 0.5]) and fast.total_output_tokens == 5


def test_skewed_trace_has_the_requested_shape(embedded):
    _, tok = embedded
    tr = skewed_trace(tok, 32, rate_per_s=2.0, median_output=12, longest_output=64, prompt_tokens=(16, 96))
    outs = [r.output_tokens for r in tr.requests]
    assert len(tr) == 32 and np.median(outs) == 12 and max(outs) == 64
    assert tr.total_output_tokens == 32 * (12 + 64) // 4
    assert all(16 <= r.prompt_tokens <= 96 and len(r.prompt) == r.prompt_tokens for r in tr.requests)
    assert tr.requests[-1].arrival_s == pytest.approx(16.0)


# ---- the API of the engine's server ------------------------------------------------------------------------------------

def test_completion_requests_are_parsed_and_bad_ones_refused(embedded):
    _, tok = embedded
    ok = parse_completion_request({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True,
                                   "stream_options": {"include_usage": True}, "ignore_eos": True,
                                   "temperature": 0}, tok, model_name="m")
    assert ok.prompt_ids == (1, 2, 3) and ok.max_tokens == 4 and ok.stream and ok.include_usage and ok.ignore_eos
    assert parse_completion_request({"prompt": "Hello"}, tok, model_name="m").prompt_ids == tuple(tok("Hello").input_ids)
    for bad, match in [({"prompt": [1], "temperature": 0.7}, "greedily"), ({"prompt": []}, "prompt"),
                       ({"prompt": [1], "max_tokens": 0}, "max_tokens"), ({"prompt": [1], "n": 2}, "one choice"),
                       ({"prompt": [1], "model": "other"}, "serves the model"), ({"prompt": [1], "stop": ["\n"]}, "stop"),
                       ([1, 2], "JSON object")]:
        with pytest.raises(BadRequest, match=match):
            parse_completion_request(bad, tok, model_name="m")


def test_streamed_text_deltas_add_up_to_the_decoded_text(embedded):
    _, tok = embedded
    ids = tok("Ça va? Très bien — merci! 東京").input_ids
    stream = TextStream(tok)
    assert "".join(stream.push([t]) for t in ids) == tok.decode(ids, skip_special_tokens=True)


# ---- the client against the course engine's server (in a thread) ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_server(tiny_gguf):
    import torch

    from course_utils.engine_server import build_engine
    torch.set_grad_enabled(False)
    engine, tok = build_engine(str(tiny_gguf), max_num_seqs=4, num_blocks=32, block_size=8)
    server = EngineServer(engine, tok, model_name="tiny").start_in_thread()
    yield server, engine, tok
    server.close()


def _trace(n=5, out=(6, 3, 8, 1, 5), rate=50.0):
    prompts = [[(7 * i + j) % 100 + 3 for j in range(5 + 3 * i)] for i in range(n)]
    return make_trace(prompts, list(out[:n]), rate_per_s=rate, seed=1)


def test_replay_streams_every_token_and_the_tokens_are_greedy_generates(tiny_server, tiny_gguf):
    from course_utils.models import load_model
    from course_utils.reference import compare_tokens, reference_generate
    server, engine, _ = tiny_server
    tr = _trace()
    res = replay(server.url, "tiny", tr, progress=False)
    assert not res.failed and res.duration_s > 0
    model, _ = load_model(str(tiny_gguf), verbose=False)
    for rec, req in zip(res.records, tr.requests):
        assert rec.output_tokens == req.output_tokens == len(rec.token_ids) == len(rec.chunk_s)   # one token per chunk
        assert rec.prompt_tokens == req.prompt_tokens and rec.finish_reason == "length"
        ref, gaps = reference_generate(model, list(req.prompt), req.output_tokens)
        assert compare_tokens(rec.token_ids, ref, gaps).ok, (rec.index, rec.token_ids, ref)
        assert all(b >= a for a, b in zip(rec.chunk_s, rec.chunk_s[1:]))
    s = res.summary()
    assert s.completed == 5 and s.total_output_tokens == tr.total_output_tokens


def test_max_concurrency_keeps_requests_from_overlapping(tiny_server):
    server, _, _ = tiny_server
    res = replay(server.url, "tiny", _trace(rate=math.inf), max_concurrency=1, warmup=0, progress=False)
    spans = sorted((r.start_s, r.start_s + r.chunk_s[-1]) for r in res.records)
    assert all(nxt[0] >= cur[1] - 1e-3 for cur, nxt in zip(spans, spans[1:]))


def test_a_plain_request_gets_one_json_answer_with_usage(tiny_server):
    server, _, _ = tiny_server
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4,
                                                         "ignore_eos": True, "return_token_ids": True},
                   timeout=60, trust_env=False)
    body = r.json()
    assert r.status_code == 200 and body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert len(body["choices"][0]["token_ids"]) == 4
    assert httpx.get(server.url + "/nowhere", trust_env=False).status_code == 404
    assert httpx.get(server.url + "/health", trust_env=False).status_code == 200


def test_a_server_error_fails_that_request_and_the_finished_ones_are_kept(tiny_server):
    server, engine, _ = tiny_server
    too_long = engine.capacity_tokens + 1                        # the engine refuses it: HTTP 400
    tr = make_trace([[3, 4, 5], [6, 7], [8, 9, 10]], [4, too_long, 3], rate_per_s=100.0)
    with pytest.raises(ReplayError, match="1 of 3 requests failed") as info:
        replay(server.url, "tiny", tr, warmup=0, progress=False)
    result = info.value.result
    assert [r.success for r in result.records] == [True, False, True]
    assert "HTTP 400" in result.records[1].error and "cache" in result.records[1].error
    assert result.summary().completed == 2


def test_an_unreachable_server_is_a_clear_error():
    with pytest.raises(ServerUnreachable, match="no server answers"):
        replay(f"http://127.0.0.1:{free_port()}", "m", _trace(), progress=False)


def test_a_stream_closed_early_is_recorded_as_a_failure():
    chunk = json.dumps({"choices": [{"index": 0, "text": "a", "token_ids": [1], "finish_reason": None}]})

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        headers = dict(l.lower().split(":", 1) for l in head.decode().split("\r\n")[1:] if ":" in l)
        await reader.readexactly(int(headers.get("content-length", 0)))
        if head.startswith(b"GET"):
            body = b'{"data": [{"id": "m"}]}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + f"data: {chunk}\n\n".encode())
        await writer.drain()
        writer.close()

    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        from course_utils.serving import replay_async
        async with srv:
            return await replay_async(url, "m", make_trace([[1, 2]], [3], rate_per_s=10.0), warmup=0,
                                      progress=False, strict=False)

    res = asyncio.run(main())
    (rec,) = res.records
    assert not rec.success and "closed the stream after 1 chunk" in rec.error


# ---- server processes: started, stopped, never left behind ----------------------------------------------------------

def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return False


def test_the_engine_server_process_serves_and_stops_with_everything_it_started(tiny_gguf, tmp_path):
    server = start_engine_server(str(tiny_gguf), served_model_name="tiny", max_num_seqs=2, num_blocks=16,
                                 block_size=8, threads=1, log_path=tmp_path / "server.log", progress=False)
    pid = server.proc.pid
    try:
        res = replay(server.base_url, "tiny", _trace(2), progress=False)
        assert not res.failed and server.startup_s > 0
        assert server.peak_rss["course engine server"] > 50e6      # it loaded a model
        assert pid in server.leftover_processes()                  # the check that follows sees a running one
    finally:
        server.stop()
    assert _gone(pid) and not server.running and server.leftover_processes() == []


def test_a_server_dies_with_the_process_that_started_it(tiny_gguf, tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's; elsewhere the server polls its parent's pid")
    script = textwrap.dedent(f"""
        import time
        from course_utils.engine_server import start_engine_server
        s = start_engine_server({str(tiny_gguf)!r}, num_blocks=16, block_size=8, max_num_seqs=2, progress=False)
        print(s.proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(parent.stdout.readline())
        assert psutil.pid_exists(server_pid)
    finally:
        parent.kill()                                   # no atexit, no finally: the kernel dying, say
        parent.wait()
    assert _gone(server_pid), "the server outlived the process that started it"


@pytest.mark.notebooks
def test_no_server_is_left_running_when_a_notebook_cell_fails(tiny_gguf, tmp_path):
    import nbformat
    import papermill as pm
    pid_file = tmp_path / "pid"
    nb = nbformat.v4.new_notebook()
    nb.metadata.update(kernelspec={"name": "python3", "display_name": "Python 3", "language": "python"},
                       language_info={"name": "python"})
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent(f"""
                    from course_utils.engine_server import start_engine_server
                    server = start_engine_server({str(tiny_gguf)!r}, num_blocks=16, block_size=8, progress=False)
                    open({str(pid_file)!r}, "w").write(str(server.proc.pid))""")),
                nbformat.v4.new_code_cell("raise RuntimeError('a cell fails')"),
                nbformat.v4.new_code_cell("server.stop()")]
    src = tmp_path / "fails.ipynb"
    nbformat.write(nb, src)
    with pytest.raises(pm.PapermillExecutionError, match="a cell fails"):
        pm.execute_notebook(str(src), str(tmp_path / "out.ipynb"), kernel_name="python3", progress_bar=False)
    assert _gone(int(pid_file.read_text())), "the notebook's server outlived its kernel"


# ---- checks against vLLM's own benchmark -------------------------------------------------------------------------------

def _need_vllm():
    available = vllm_env.vllm_available()
    if available:
        return
    if vllm_env.vllm_support() and os.environ.get("CI"):
        pytest.fail(f"vLLM can run on this machine but its environment is missing under CI: {available.reason}")
    pytest.skip(f"vLLM cannot run here: {available.reason}")


def _assert_same_figures(ours, theirs: dict, percentiles=(50, 90, 99)):
    """Every figure of ``vllm bench serve``'s BenchmarkMetrics equals the course summary's, exactly."""
    assert (theirs["completed"], theirs["failed"]) == (ours.completed, ours.failed)
    assert (theirs["total_input"], theirs["total_output"]) == (ours.total_input_tokens, ours.total_output_tokens)
    for name in ("request_throughput", "output_throughput", "total_token_throughput", "request_goodput"):
        assert theirs[name] == getattr(ours, name), name
    for metric in ("ttft", "tpot", "itl", "e2el"):
        d = getattr(ours, metric)
        assert theirs[f"mean_{metric}_ms"] == d.mean * 1000, metric
        assert theirs[f"median_{metric}_ms"] == d.median * 1000, metric
        assert theirs[f"std_{metric}_ms"] == d.std * 1000, metric
        assert [tuple(x) for x in theirs[f"percentiles_{metric}_ms"]] == [(p, d.p(p) * 1000) for p in percentiles]


def test_vllm_computes_the_same_figures_from_the_same_records_deterministic_check():
    _need_vllm()
    rng = np.random.default_rng(0)
    recs = []
    for i in range(40):
        n = int(rng.integers(1, 30))
        chunks = np.cumsum(rng.exponential(0.05, n)) + rng.exponential(0.3)
        recs.append(_rec(i, chunks.tolist(), start=float(i * 0.1), prompt=int(rng.integers(5, 90))))
    recs.append(_rec(40, [], start=4.0, error="HTTP 500: boom"))
    recs.append(_rec(41, [0.2, 0.5], tokens=5, start=4.1))            # several tokens per chunk
    slo = SLO(ttft_ms=400, tpot_ms=60)
    with vllm_env.VllmBench(wait=False) as helper:     # started, not waited for: its first call waits until it is ready
        assert helper.proc.poll() is None and not helper._ready
        theirs = helper.calculate_metrics(recs, 7.5, goodput=slo.as_dict())
        assert helper._ready
    _assert_same_figures(summarize(recs, 7.5, slo=slo), theirs)
    assert theirs["request_goodput"] > 0 and theirs["failed"] == 1


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    _need_vllm()
    from course_utils.models import resolve_model_source
    folder, _ = resolve_model_source("embedded")
    server = vllm_env.start_vllm_server(folder, served_model_name="vllm", progress=False, compiled=False,  # a quick start
                                        log_path=tmp_path_factory.mktemp("vllm") / "server.log")
    yield server, folder
    pids = [p.pid for p in server._processes()]
    server.stop()
    assert all(_gone(pid) for pid in pids), "a vLLM process outlived stop()"


@pytest.mark.notebooks          # a minute with vLLM's start: it runs with the chapters, beside chapter 11's own live check
def test_the_client_agrees_with_vllm_bench_serve_live_check(vllm_server, tmp_path):
    """``vllm bench serve`` and the course client on the same requests (a skewed trace's token ids, from a trace
    file, no initial test request), one at a time, in turns (course, vLLM, course, vLLM, as chapter 11), each client in a process
    of its own: request by request,
    the same output tokens and each TTFT within half a decode step (what a token stamped one chunk off would move
    it by; :mod:`course_utils.serving.live`). ``tests/test_serving_load_live.py`` shows the same check failing for
    a client that stamps after the whole body or one chunk late."""
    from course_utils.models import load_model
    from course_utils.serving import (agreement, in_turns, machine_busy, replay_in_process, times_from_bench,
                                      times_from_records)
    server, folder = vllm_server
    _, tok = load_model("embedded", verbose=False)
    base = skewed_trace(tok, 6, median_output=8, longest_output=24, total_output=72, prompt_tokens=(16, 48))
    tr = make_trace([r.prompt for r in base.requests], [r.output_tokens for r in base.requests], rate_per_s=math.inf)
    path = vllm_env.write_trace_file(tr, tmp_path / "trace.jsonl")
    args = vllm_env.bench_trace_args(server.base_url, folder, "vllm", path, num_prompts=len(tr))
    with vllm_env.VllmBench(args, wait=False) as bench:                       # it imports vLLM while ...
        replay(server.base_url, "vllm", tr, max_concurrency=1, progress=False)   # ... this warms up the server
        assert bench.prompts == [list(r.prompt) for r in tr.requests]          # exactly the trace's tokens

        def ours_round():
            return times_from_records(replay_in_process(server.base_url, "vllm", tr, max_concurrency=1, warmup=1,
                                                        progress=False, return_token_ids=False))

        def theirs_round():
            saved = bench.bench()
            assert saved["input_lens"] == [r.prompt_tokens for r in tr.requests]
            return times_from_bench(saved)

        ours, theirs = in_turns(2, ours_round, theirs_round)
    verdict = agreement(ours, theirs)
    busy, load = machine_busy()
    if busy and not verdict.ok:
        pytest.skip(f"this machine is busy ({load}): the clients' figures cannot resolve half a step; {verdict.failures}")
    assert verdict.ok, verdict.failures
    assert [r.output_tokens for r in verdict.rows] == [r.output_tokens for r in tr.requests]


def test_a_chapter_note_reaches_the_main_jobs_summary(tmp_path):
    """Where the vLLM half cannot run, chapter 11 says so in the notebook and in ``build/summary.md``."""
    import nbformat

    from course_utils.notebook import SUMMARY_NOTE_KEY
    from course_utils.run_all import Result, summary_markdown, summary_notes
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("summary_note('...')")
    cell.outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": "vLLM did not run"},
                                           metadata={SUMMARY_NOTE_KEY: "vLLM did not run: run it elsewhere"})]
    nb.cells = [cell, nbformat.v4.new_code_cell("1")]
    nbformat.write(nb, tmp_path / "11_serving.ipynb")
    note = summary_notes(tmp_path / "11_serving.ipynb")
    assert note == "vLLM did not run: run it elsewhere"
    table = summary_markdown([Result("11_serving", "ok", 100.0, int(1e9), note=note)], "this machine")
    assert "11_serving: vLLM did not run: run it elsewhere" in table
    assert summary_notes(tmp_path / "missing.ipynb") == ""


def test_the_main_job_leaves_a_chapters_servers_out_of_the_kernels_memory(tiny_gguf):
    from course_utils.peak_rss import tree_rss_bytes
    server = start_engine_server(str(tiny_gguf), num_blocks=16, block_size=8, max_num_seqs=2, progress=False)
    try:
        me = psutil.Process()
        with_servers = tree_rss_bytes(me, exclude_servers=False)
        assert with_servers >= server.peak_total_rss * 0.5 > 0
        assert tree_rss_bytes(me) < with_servers - 50e6          # the server loaded a model; it is left out
    finally:
        server.stop()


def test_the_main_jobs_memory_reader_lists_processes_every_few_calls_and_leaves_servers_out():
    """run_all's reader re-lists the kernel's descendants only every few calls (a listing scans the whole machine):
    a child started after a listing counts from the next one, and a server child never does."""
    from course_utils.peak_rss import SERVER_ENV, TreeRss, tree_rss_bytes
    # one write of the whole line (os.write): the two children share the pipe, and print() may write "held" and its
    # newline separately (unbuffered output), interleaving the two children's lines
    hold = "import os, time; b = bytearray(b'x' * (150 * 2**20)); os.write(1, b'held\\n'); time.sleep(60)"
    parent = (f"import os, subprocess, sys; sys.stdin.readline(); hold = {hold!r}\n"
              "kids = [subprocess.Popen([sys.executable, '-c', hold], stdout=sys.stdout),\n"
              f"        subprocess.Popen([sys.executable, '-c', hold], stdout=sys.stdout, env=dict(os.environ, {SERVER_ENV}='t'))]\n"
              "[k.wait() for k in kids]")
    root = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        reader = TreeRss(psutil.Process(root.pid), relist_every=3)
        assert reader() == 0                                  # call 0 lists: no child yet
        root.stdin.write("go\n")
        root.stdin.flush()
        assert [root.stdout.readline(), root.stdout.readline()] == ["held\n", "held\n"]   # both hold 150 MiB
        assert reader() == 0 and reader() == 0                # calls 1 and 2 read the old, empty list
        counted = reader()                                    # call 3 lists again: the plain child, not the server
        assert 150 * 2**20 <= counted < 2 * 150 * 2**20
        assert abs(counted - tree_rss_bytes(psutil.Process(root.pid))) < 20 * 2**20
        assert tree_rss_bytes(psutil.Process(root.pid), exclude_servers=False) >= 2 * 150 * 2**20
        assert (reader.calls, reader.listings) == (4, 2)
    finally:
        for p in psutil.Process(root.pid).children(recursive=True):
            p.kill()
        root.kill()
        root.wait()
    with pytest.raises(ValueError, match="relist_every"):
        TreeRss(relist_every=0)


# ---- where vLLM can run, and the set-up step's messages ---------------------------------------------------------------

def test_vllm_support_says_why_not(monkeypatch):
    monkeypatch.setattr(vllm_env.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(vllm_env.platform, "machine", lambda: "arm64")
    s = vllm_env.vllm_support()
    assert not s and "Linux x86-64" in s.reason and "Darwin arm64" in s.reason
    monkeypatch.setattr(vllm_env.platform, "system", lambda: "Linux")
    monkeypatch.setattr(vllm_env.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(vllm_env, "_cpu_flags", lambda: {"avx2", "fma"})
    assert "AVX-512" in vllm_env.vllm_support().reason
    monkeypatch.setattr(vllm_env, "_cpu_flags", lambda: {"avx2", "avx512f"})
    monkeypatch.setattr(vllm_env, "_total_memory_bytes", lambda: 2 * 2**30)
    assert "2.0 GiB" in vllm_env.vllm_support().reason
    monkeypatch.setattr(vllm_env, "_total_memory_bytes", lambda: 24 * 2**30)
    assert vllm_env.vllm_support()


def test_an_environment_made_on_purpose_runs_vllm_on_an_avx2_cpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(vllm_env.platform, "system", lambda: "Linux")
    monkeypatch.setattr(vllm_env.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(vllm_env, "_total_memory_bytes", lambda: 24 * 2**30)
    monkeypatch.setattr(vllm_env, "_cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setenv("COURSE_VLLM_ENV", str(tmp_path / "vllm-env"))
    monkeypatch.delenv("COURSE_VLLM", raising=False)
    refused = vllm_env.vllm_available()
    assert not refused and "AVX-512" in refused.reason and "vllm_env create" in refused.reason
    assert "skipped" in vllm_env.ensure_env()              # the set-up step does not install it on such a CPU
    assert vllm_env.vllm_support(allow_avx2=True)
    monkeypatch.setattr(vllm_env, "env_ready", lambda env=None: True)       # as `vllm_env create` leaves it
    assert vllm_env.vllm_available()
    assert "up to date" in vllm_env.ensure_env()
    monkeypatch.setattr(vllm_env, "_cpu_flags", lambda: {"sse4_2"})          # neither AVX-512 nor AVX2
    assert not vllm_env.vllm_available() and "vllm_env create" not in vllm_env.vllm_available().reason
    assert vllm_env.main(["create"]) == 1 and "cannot run here" in capsys.readouterr().out


def test_the_set_up_step_skips_vllm_with_a_message(monkeypatch, capsys):
    monkeypatch.setenv("COURSE_VLLM", "0")
    assert "skipped (COURSE_VLLM=0)" in vllm_env.ensure_env()
    monkeypatch.delenv("COURSE_VLLM")
    monkeypatch.setattr(vllm_env.platform, "system", lambda: "Windows")
    msg = vllm_env.ensure_env()
    assert "skipped" in msg and "course-engine half" in msg and msg in capsys.readouterr().out


def test_vllm_on_a_gpu_needs_an_environment_of_your_own(monkeypatch):
    monkeypatch.delenv("COURSE_VLLM_ENV", raising=False)
    s = vllm_env.vllm_available("cuda")
    assert not s and "pip install vllm" in s.reason and "COURSE_VLLM_ENV" in s.reason


def test_vllm_compiles_through_torch_compiles_kernel_cache_kept_in_the_course_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    env = vllm_env.env_variables()
    assert env["VLLM_USE_AOT_COMPILE"] == "0"               # vLLM 0.32's own store fails to load on this torch
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "vllm-torchinductor") == str(vllm_env.compile_cache_dir())
    assert vllm_env.compile_cache_files() == 0               # no folder yet
    (tmp_path / "vllm-torchinductor" / "fxgraph" / "ab").mkdir(parents=True)
    for name in ("a", "b"):
        (tmp_path / "vllm-torchinductor" / "fxgraph" / "ab" / name).write_text("x")
    assert vllm_env.compile_cache_files() == 2
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")          # a learner's own choice is kept
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "this-process"))   # as PyTorch sets it in-process
    env = vllm_env.env_variables()
    assert env["VLLM_USE_AOT_COMPILE"] == "1" and env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "vllm-torchinductor")
