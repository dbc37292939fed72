"""Chapter 04's chunked-prefill scenario: a long prompt arriving while streams decode, its record and summaries."""
from __future__ import annotations

import math

import plotly.graph_objects as go
import pytest

import course_utils.batching.chunked as chunked
from course_utils.batching import (LongPromptRun, StepLoad, budget_figure, budget_sweep, change, chunked_timeline_figure,
                                   compare_chunking, long_prompt_arrives, long_ttft_s, longest_gap_s, median_gap_s, prefill_steps,
                                   round_range, scenario_prompts, stream_gaps_s, stream_tokens_needed, summarize_run)
from course_utils.reference import check_against_generate


def _run(**kw) -> LongPromptRun:
    """A hand-made run: two streams, the long prompt arriving at t = 1.0 and fed by the steps from 1.0 to 2.5."""
    base = dict(chunked_prefill=True, budget=8, long_prompt_tokens=10, arrival_s=1.0,
                stream_token_s=((0.5, 1.0, 2.0, 2.5, 3.0), (0.5, 0.8, 1.0, 2.5, 2.6)), long_token_s=(2.5, 3.0),
                stream_ids=((1, 2, 3, 4, 5), (6, 7, 8, 9, 10)), long_ids=(11, 12),
                steps=(StepLoad(0.0, 0.5, 6, 0), StepLoad(0.5, 1.0, 0, 2), StepLoad(1.0, 2.0, 6, 2),
                       StepLoad(2.0, 2.5, 4, 2), StepLoad(2.5, 3.0, 0, 3)))
    base.update(kw)
    return LongPromptRun(**base)


# ---- summaries ------------------------------------------------------------------------------------------------

def test_gaps_are_per_stream_never_across_streams():
    run = _run()
    assert stream_gaps_s(run) == [pytest.approx([0.5, 1.0, 0.5, 0.5]), pytest.approx([0.3, 0.2, 1.5, 0.1])]
    assert longest_gap_s(run) == pytest.approx(1.5)            # stream 1's wait, not the 1.0 of stream 0
    # the merged times of both streams would give a longest gap of 1.0 and a median of 0.25
    assert median_gap_s(run) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        longest_gap_s(_run(stream_token_s=((1.0,), (2.0,))))


def test_time_to_first_token_counts_from_the_arrival_to_the_first_token():
    assert long_ttft_s(_run()) == pytest.approx(1.5)
    assert long_ttft_s(_run(arrival_s=0.25)) == pytest.approx(2.25)
    with pytest.raises(ValueError, match="no token"):
        long_ttft_s(_run(long_token_s=()))


def test_prefill_steps_are_those_that_fed_the_long_prompt():
    run = _run()
    assert prefill_steps(run) == [run.steps[2], run.steps[3]]   # not the streams' own prefill at t = 0
    s = summarize_run(run)
    assert (s.prefill_steps, s.prefill_step_s, s.ttft_s, s.label) == (2, pytest.approx(1.5), pytest.approx(1.5),
                                                                     "chunked, budget 8")
    assert _run(chunked_prefill=False).label == "chunking off"


def test_spread_and_its_overlap():
    s = round_range([3.0, 1.0, 2.0])
    assert (s.median, s.low, s.high) == (2.0, 1.0, 3.0)
    assert s.overlaps(round_range([2.9, 4.0])) and not s.overlaps(round_range([3.1, 4.0]))
    with pytest.raises(ValueError, match="at least one"):
        round_range([])
    assert change(s, round_range([0.5, 0.9])) == "lower" and change(s, round_range([3.5, 4.0])) == "higher"
    assert change(s, round_range([0.5, 1.0])) == "within noise"              # a shared round's value is not a change


def test_stream_tokens_cover_the_chunked_prefill():
    # budget 10 with 4 streams: 6 prompt tokens a step, 100 tokens in 17 steps
    assert stream_tokens_needed(100, n_streams=4, budget=10, tokens_before=3, tokens_after=2) == 3 + 17 + 2
    # prompts of 12 tokens each at budget 10: the streams' prompts take up to 8 steps, so they start that far apart
    assert stream_tokens_needed(100, n_streams=4, budget=10, tokens_before=3, tokens_after=2,
                                stream_prompt_tokens=12) == 3 + 8 + 17 + 2
    with pytest.raises(ValueError, match="exceed n_streams"):
        stream_tokens_needed(100, n_streams=4, budget=4, tokens_before=3, tokens_after=2)


# ---- the scenario through the engine ----------------------------------------------------------------------------

N_STREAMS, LONG, BUDGET = 3, 40, 11


def _scenario(model, **kw):
    prompts = [[(7 * i + j) % 100 + 1 for j in range(6 + i)] for i in range(N_STREAMS)]
    long = [(3 * j) % 97 + 2 for j in range(LONG)]
    tokens = stream_tokens_needed(LONG, n_streams=N_STREAMS, budget=BUDGET, tokens_before=2, tokens_after=2)
    args = dict(stream_tokens=tokens, long_tokens=3, tokens_before=2, block_size=4)
    args.update(kw)
    return prompts, long, args


def test_without_chunking_the_long_prefill_is_one_step_that_stalls_every_stream(tiny_llama):
    prompts, long, args = _scenario(tiny_llama)
    run = long_prompt_arrives(tiny_llama, prompts, long, chunked_prefill=False, **args)
    (step,) = prefill_steps(run)
    assert (step.prefill_tokens, step.decode_tokens) == (LONG, 0)
    assert run.long_token_s[0] == step.end_s and long_ttft_s(run) == pytest.approx(step.end_s - run.arrival_s)
    for times in run.stream_token_s:                        # no stream has a token during the prefill step
        assert not any(step.start_s < t <= step.end_s for t in times)
        assert len(times) == args["stream_tokens"]
    assert run.budget >= LONG and not run.chunked_prefill


def test_with_chunking_every_stream_gets_a_token_in_every_step_of_the_prompt(tiny_llama):
    prompts, long, args = _scenario(tiny_llama)
    run = long_prompt_arrives(tiny_llama, prompts, long, chunked_prefill=True, budget=BUDGET, **args)
    steps = prefill_steps(run)
    assert len(steps) == math.ceil(LONG / (BUDGET - N_STREAMS))
    assert sum(s.prefill_tokens for s in steps) == LONG
    assert all(s.decode_tokens == N_STREAMS and s.prefill_tokens + s.decode_tokens <= BUDGET for s in steps)
    assert run.long_token_s[0] == steps[-1].end_s          # the first token comes with the last chunk, not before
    for times in run.stream_token_s:
        assert all(s.end_s in times for s in steps)
        assert times[-1] > run.long_token_s[0]               # still decoding after the prompt's first token
    assert len(run.long_token_s) == len(run.long_ids) == 3


def test_the_decode_tokens_take_their_share_of_the_budget_first(tiny_llama):
    # a budget as long as the prompt still cuts it in two while streams decode; the prompt plus the streams fits in one
    prompts, long, args = _scenario(tiny_llama)
    for budget, expected in ((LONG, [LONG - N_STREAMS, N_STREAMS]), (LONG + N_STREAMS, [LONG])):
        run = long_prompt_arrives(tiny_llama, prompts, long, chunked_prefill=True, budget=budget, **args)
        assert [s.prefill_tokens for s in prefill_steps(run)] == expected
        assert all(s.decode_tokens == N_STREAMS for s in prefill_steps(run))


def test_streams_started_apart_still_decode_through_the_long_prompt(tiny_llama):
    # prompts longer than the budget start the streams steps apart: every step that feeds the long prompt must
    # still give every stream its token
    prompts = [[(5 * i + j) % 90 + 3 for j in range(12)] for i in range(N_STREAMS)]
    long = [(3 * j) % 97 + 2 for j in range(LONG)]
    tokens = stream_tokens_needed(LONG, n_streams=N_STREAMS, budget=BUDGET - 3, tokens_before=2, tokens_after=1,
                                  stream_prompt_tokens=12)
    run = long_prompt_arrives(tiny_llama, prompts, long, chunked_prefill=True, budget=BUDGET - 3, stream_tokens=tokens,
                              long_tokens=2, tokens_before=2, block_size=4)
    assert run.stream_token_s[0][0] < run.stream_token_s[-1][0]          # they did start apart
    assert all(s.decode_tokens == N_STREAMS for s in prefill_steps(run))


def test_chunking_changes_no_token_and_both_match_generate(tiny_model):
    prompts, long, args = _scenario(tiny_model)
    off = long_prompt_arrives(tiny_model, prompts, long, chunked_prefill=False, **args)
    on = long_prompt_arrives(tiny_model, prompts, long, chunked_prefill=True, budget=BUDGET, **args)
    assert on.output_ids == off.output_ids
    limits = [args["stream_tokens"]] * N_STREAMS + [args["long_tokens"]]
    agreements = check_against_generate(tiny_model, prompts + [long], [list(o) for o in on.output_ids], limits)
    assert all(a.ok for a in agreements), [str(a) for a in agreements]


def test_the_scenario_rejects_bad_input(tiny_llama):
    prompts, long, args = _scenario(tiny_llama)
    with pytest.raises(ValueError, match="exceed tokens_before"):
        long_prompt_arrives(tiny_llama, prompts, long, chunked_prefill=False, **{**args, "stream_tokens": 2})
    with pytest.raises(ValueError, match="at least one stream"):
        long_prompt_arrives(tiny_llama, [], long, chunked_prefill=False, **args)
    with pytest.raises(ValueError, match="give at least one budget"):
        budget_sweep(tiny_llama, prompts, long, budgets=[], **args)


def test_compare_chunking_alternates_and_leaves_out_the_warmup(monkeypatch):
    calls = []

    def fake(model, stream_prompts, long_prompt, *, chunked_prefill, budget=None, **kw):
        calls.append((chunked_prefill, budget))
        return len(calls)
    monkeypatch.setattr(chunked, "long_prompt_arrives", fake)
    runs = compare_chunking(None, [[1]], [2], budget=64, rounds=3, warmup=1)
    assert calls == [(False, None), (True, 64)] * 4
    assert runs == {"off": [3, 5, 7], "on": [4, 6, 8]}
    with pytest.raises(ValueError, match="rounds"):
        compare_chunking(None, [[1]], [2], budget=64, rounds=0)


def test_scenario_prompts_are_consecutive_pieces_of_the_book(embedded):
    from course_utils.prompts import book_token_ids
    _, tok = embedded
    streams, long = scenario_prompts(tok, n_streams=3, stream_prompt_tokens=5, long_prompt_tokens=20)
    assert [len(p) for p in streams] == [5, 5, 5] and len(long) == 20
    assert sum(streams, []) + long == book_token_ids(tok, 35)[0].tolist()


# ---- figures ------------------------------------------------------------------------------------------------------

def test_the_timeline_puts_both_runs_on_the_long_prompts_clock():
    off, on = _run(chunked_prefill=False, budget=1000), _run()
    fig = chunked_timeline_figure(off, on)
    assert isinstance(fig, go.Figure) and len(fig.data) == 2 * 3          # 2 streams + the long request, per run
    assert list(fig.data[0].x) == pytest.approx([-0.5, 0.0, 1.0, 1.5, 2.0])
    assert list(fig.data[2].x) == pytest.approx([1.5, 2.0])               # the long request's tokens
    assert "1.50 s" in fig.layout.title.text and "10-token prompt" in fig.layout.title.text
    # one shaded rectangle per step that fed the long prompt, in each run's panel, and the two arrival lines
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(rects) == len(prefill_steps(off)) + len(prefill_steps(on)) == 4
    assert len(fig.layout.shapes) == len(rects) + 2
    assert sorted(x for r in rects for x in (r.x0, r.x1)) == pytest.approx([0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.5, 1.5])
    assert {r.yref for r in rects} == {"y domain", "y2 domain"}


def test_the_budget_slider_redraws_from_the_precomputed_runs():
    off = _run(chunked_prefill=False, budget=1000, stream_token_s=((0.5, 1.0, 3.0), (0.5, 1.0, 3.0)),
               long_token_s=(3.0,))
    sweep = {8: _run(), 16: _run(budget=16, long_token_s=(2.0, 3.0))}
    fig = budget_figure(off, sweep, 16)
    ttft = next(t for t in fig.data if t.name == "long prompt's first token")
    assert list(ttft.x) == [8, 16] and list(ttft.y) == pytest.approx([1.5, 1.0])
    flat = next(t for t in fig.data if t.name == "long prompt's first token, chunking off")
    assert list(flat.y) == pytest.approx([2.0, 2.0])
    long_tokens = [t for t in fig.data if t.name == "the long request's token"]
    assert list(long_tokens[0].x) == pytest.approx([1.0, 2.0])           # budget 16's run, drawn on the right
    assert "Budget 16" in fig.layout.title.text
    assert budget_figure(off, sweep, 8).data[-1].x != fig.data[-1].x
    rects = [s for s in fig.layout.shapes if s.type == "rect"]          # budget 16's steps that fed the prompt
    assert len(rects) == len(prefill_steps(sweep[16])) == 1 and {r.xref for r in rects} == {"x2"}
    with pytest.raises(ValueError, match="one of the runs' budgets"):
        budget_figure(off, sweep, 32)
