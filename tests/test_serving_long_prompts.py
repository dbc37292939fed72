"""Chapter 11's long-prompt trace (where chunked prefill acts): its shape, its seeding, its refusals; the split of a
run's records into short and long prompts, and the figure of the short answers' gaps."""
from __future__ import annotations

import numpy as np
import pytest

from course_utils.prompts import book_token_ids
from course_utils.serving import (
    ReplayResult, RequestRecord, long_prompt_lengths, long_prompt_positions, long_prompt_trace, make_trace,
    split_by_prompt, stall_figure, stalls,
)


@pytest.mark.parametrize("n_long, n_short", [(1, 1), (2, 6), (3, 3), (5, 2), (6, 12), (4, 1)])
def test_long_requests_are_spread_after_a_short_one_and_inside_the_trace(n_long, n_short):
    pos = long_prompt_positions(n_long, n_short)
    assert len(pos) == n_long and len(set(pos)) == n_long and pos == sorted(pos)
    assert pos[0] >= 1 and pos[-1] <= n_long + n_short - 1


def test_long_positions_of_the_chapters_default():
    assert long_prompt_positions(2, 6) == [3, 5]          # S S S L S L S S
    assert long_prompt_positions(1, 1) == [1]


def test_lengths_are_exact_in_range_and_seeded():
    kw = dict(long_tokens=(512, 2048), short_tokens=(16, 64))
    lengths = long_prompt_lengths(4, 8, seed=3, **kw)
    where = long_prompt_positions(4, 8)
    assert len(lengths) == 12
    assert all(512 <= lengths[i] <= 2048 for i in where)
    assert all(16 <= n <= 64 for i, n in enumerate(lengths) if i not in where)
    assert lengths == long_prompt_lengths(4, 8, seed=3, **kw)
    assert lengths != long_prompt_lengths(4, 8, seed=4, **kw)
    same = long_prompt_lengths(2, 3, long_tokens=(700, 700), short_tokens=(9, 9))
    assert same == [700 if i in long_prompt_positions(2, 3) else 9 for i in range(5)]


@pytest.mark.parametrize("kw, match", [
    (dict(n_long=0), "n_long must be a positive integer"),
    (dict(n_short=-1), "n_short must be a positive integer"),
    (dict(long_tokens=(64, 512), short_tokens=(16, 64)), "short prompts must be shorter than the long ones"),
    (dict(long_tokens=(1024, 512)), "long_tokens must be .shortest, longest. with longest >= shortest"),
    (dict(short_tokens=(0, 8)), "the shortest of short_tokens must be a positive integer"),
    (dict(long_tokens=512), "long_tokens must be .shortest, longest."),
    (dict(short_tokens=(4, 8, 12)), "short_tokens must be .shortest, longest."),
])
def test_bad_lengths_are_refused_with_a_clear_message(kw, match):
    args = dict(n_long=2, n_short=3) | kw
    with pytest.raises(ValueError, match=match):
        long_prompt_lengths(args.pop("n_long"), args.pop("n_short"), **args)


def test_the_trace_has_exact_lengths_fixed_outputs_and_book_prompts(embedded):
    _, tok = embedded
    tr = long_prompt_trace(tok, 3, 5, long_tokens=(512, 1024), short_tokens=(16, 48), long_output=6,
                           short_output=20, rate_per_s=4.0, seed=1)
    lengths = long_prompt_lengths(3, 5, long_tokens=(512, 1024), short_tokens=(16, 48), seed=1)
    assert [r.prompt_tokens for r in tr.requests] == lengths
    assert all(len(r.prompt) == r.prompt_tokens for r in tr.requests)
    assert [r.output_tokens for r in tr.requests] == [6 if n >= 512 else 20 for n in lengths]
    assert [r.arrival_s for r in tr.requests] == pytest.approx([0.25 * (i + 1) for i in range(8)])
    book = book_token_ids(tok, sum(lengths))[0].tolist()
    assert [t for r in tr.requests for t in r.prompt] == book          # consecutive pieces of the book
    again = long_prompt_trace(tok, 3, 5, long_tokens=(512, 1024), short_tokens=(16, 48), long_output=6,
                              short_output=20, rate_per_s=4.0, seed=1)
    assert again == tr


def test_the_trace_refuses_bad_output_lengths(embedded):
    _, tok = embedded
    with pytest.raises(ValueError, match="long_output must be a positive integer"):
        long_prompt_trace(tok, long_output=0)
    with pytest.raises(ValueError, match="short_output must be a positive integer"):
        long_prompt_trace(tok, short_output=2.5)


def _result():
    recs = [RequestRecord(0, 20, 4, 0.0, [0.1, 0.2, 0.9, 1.0], [1] * 4, 4),
            RequestRecord(1, 800, 2, 0.3, [0.6, 0.7], [1] * 2, 2),
            RequestRecord(2, 30, 3, 0.4, [0.1, 0.5, 0.6], [1] * 3, 3)]
    trace = make_trace([[1] * 20, [1] * 800, [1] * 30], [4, 2, 3], rate_per_s=10.0)
    return ReplayResult(recs, 1.5, "http://x", "m", trace)


def test_records_split_at_the_long_prompt_length():
    res = _result()
    short, long_ = split_by_prompt(res.records, 512)
    assert [r.index for r in short] == [0, 2] and [r.index for r in long_] == [1]
    assert split_by_prompt(res.records, 20) == ([], res.records)
    with pytest.raises(ValueError, match="min_long_tokens must be a positive integer"):
        split_by_prompt(res.records, 0)


def test_the_stall_figure_shows_the_short_answers_gaps_and_the_long_prompts():
    fig = stall_figure({"a": _result(), "b": _result()}, 512)
    gaps = fig.data[0]
    assert list(gaps.y) == pytest.approx([100.0, 700.0, 100.0, 400.0, 100.0])        # the short requests' gaps, ms
    assert list(gaps.x) == pytest.approx([0.2, 0.9, 1.0, 0.9, 1.0])                  # when each gap ended, s
    assert {round(s.x0, 6) for s in fig.layout.shapes} == {0.3, 0.9}                 # the long one sent, first token
    assert "a 700 ms" in fig.layout.title.text and "b 700 ms" in fig.layout.title.text
    assert np.isclose(max(gaps.y), 700.0)


def test_the_stall_figure_can_use_a_log_axis_and_name_its_runs():
    fig = stall_figure({"a": _result()}, 512, log_y=True, runs="first run")
    assert fig.layout.yaxis.type == "log" and "log scale" in fig.layout.yaxis.title.text
    assert fig.layout.title.text.startswith("The short answers' longest gap (first run): a 700 ms")
    assert stall_figure({"a": _result()}, 512).layout.yaxis.type != "log"


def _stalled_records():
    """Three answers, decode gaps of 0.1 s; two wait together 1.0 s (ending at 1.5 s), one waits 0.6 s alone (2.2 s),
    two wait 0.8 s together (3.0 s)."""
    def rec(i, start, ends):
        return RequestRecord(i, 20, len(ends), start, [t - start for t in ends], [1] * len(ends), len(ends))
    r0 = rec(0, 0.0, [0.1, 0.2, 0.3, 0.4, 0.5, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.1, 2.2, 3.0, 3.1])
    r1 = rec(1, 0.25, [0.35, 0.45, 1.5005, 1.6, 1.7])
    r2 = rec(2, 1.0, [1.2, 1.5002, 1.6, 2.2, 3.0002, 3.1])
    failed = RequestRecord(3, 20, 4, 0.0, [], [], 0, error="HTTP 500")
    return [r0, r1, r2, failed]


def test_long_gaps_are_counted_summed_and_grouped_by_the_step_they_ended_with():
    st = stalls(_stalled_records())
    assert st.median_gap_s == pytest.approx(0.1, abs=1e-6) and st.threshold_s == pytest.approx(0.5, abs=1e-5)
    assert st.count == 5 and st.total_s == pytest.approx(1.0 + 1.0505 + 0.6 + 0.8 + 0.8002)
    assert [len(s) for s in st.steps] == [2, 1, 2]
    assert st.step_s == pytest.approx((1.0505, 0.6, 0.8002))
    assert st.waiting_in_longest == 2 and st.longest_step == 0
    assert [round(t, 4) for t, _ in st.gaps] == [1.5, 1.5005, 2.2, 3.0, 3.0002]
    assert st.excess_s == pytest.approx(st.total_s - 5 * 0.1, abs=1e-5)     # beyond one decode gap each
    assert [x for w in st.windows for x in w] == pytest.approx([0.45, 1.5005, 1.6, 2.2, 2.2, 3.0002])
    assert st.step_of(1.5005 + 0.2) == 0 and st.step_of(3.0002 + 0.26) is None     # within half the threshold
    assert (st.step_of(1.0), st.step_of(2.0), st.step_of(2.9), st.step_of(0.2), st.step_of(0.44)) == (0, 1, 2, None,
                                                                                                       None)
    none = stalls(_stalled_records(), factor=20)
    assert (none.count, none.total_s, none.steps, none.waiting_in_longest, none.longest_step) == (0, 0.0, (), 0, None)
    assert stalls([]).count == 0


@pytest.mark.parametrize("bad, match", [(0.5, "factor must be >= 1.0"), ("5", "factor must be a finite number")])
def test_the_stall_factor_is_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        stalls(_stalled_records(), factor=bad)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "512"])
def test_vllms_step_budget_must_be_a_positive_integer(bad):
    from course_utils import vllm_env
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer"):
        vllm_env.start_vllm_server("no-such-folder", max_num_batched_tokens=bad)
