"""The greedy reference and the near-tie rule every exactness claim uses."""
from __future__ import annotations

import pytest
import torch

from course_utils.reference import (check_against_generate, check_greedy, common_prefix_len, compare_tokens,
                                    generate_static_batch, greedy_check_from_logits, greedy_settings, reference_generate)


def test_compare_tokens_allows_a_difference_only_at_a_near_tie():
    assert compare_tokens([1, 2, 3], [1, 2, 3], [5.0, 5.0, 5.0]).exact
    tie = compare_tokens([1, 2, 4], [1, 2, 3], [5.0, 5.0, 3e-5])
    assert not tie.exact and tie.near_tie and tie.ok and tie.first_diff == 2
    bad = compare_tokens([1, 9, 3], [1, 2, 3], [5.0, 0.5, 5.0])
    assert not bad.ok and bad.first_diff == 1 and "MISMATCH" in str(bad)
    assert not compare_tokens([1, 2], [1, 2, 3], [5.0, 5.0, 5.0]).ok   # stopped early
    assert not compare_tokens([1, 2, 3, 4], [1, 2, 3], [5.0, 5.0, 5.0]).ok  # ran on


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0 and common_prefix_len([5, 6], [5, 6, 7]) == 2


def test_greedy_settings_switch_off_sampling_and_penalties():
    s = greedy_settings({7, 3})
    assert s["do_sample"] is False and s["repetition_penalty"] == 1.0
    assert s["eos_token_id"] == [3, 7] and s["pad_token_id"] == 3
    assert greedy_settings()["eos_token_id"] is None


def test_reference_matches_a_hand_written_greedy_loop(tiny_model):
    prompt = [5, 9, 2, 44]
    tokens, gaps = reference_generate(tiny_model, prompt, 6)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for expected, gap in zip(tokens, gaps):
            logits = tiny_model(ids).logits[0, -1]
            top2 = logits.topk(2).values
            assert int(logits.argmax()) == expected and gap == pytest.approx(float(top2[0] - top2[1]), abs=1e-5)
            ids = torch.cat([ids, torch.tensor([[expected]])], dim=1)


def test_reference_stops_at_eos_and_keeps_it(tiny_llama):
    free, _ = reference_generate(tiny_llama, [1, 2, 3], 8)
    stop = free[3]
    tokens, gaps = reference_generate(tiny_llama, [1, 2, 3], 8, eos_token_ids={stop})
    assert tokens == free[:free.index(stop) + 1] and len(gaps) == len(tokens)


def test_static_batch_equals_one_prompt_at_a_time(tiny_llama):
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6]]
    batch = generate_static_batch(tiny_llama, prompts, 5)
    assert [r.ok for r in check_against_generate(tiny_llama, prompts, batch, 5)] == [True, True]
    with pytest.raises(ValueError, match="equal lengths"):
        generate_static_batch(tiny_llama, [[1], [1, 2]], 2)


def test_bad_reference_input():
    with pytest.raises(ValueError, match="empty"):
        reference_generate(None, [], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        reference_generate(None, [1], 0)
    with pytest.raises(ValueError, match="one entry per request"):
        check_against_generate(None, [[1]], [[1], [2]], 3)


def test_greedy_check_from_logits_allows_an_off_argmax_token_only_at_a_near_tie():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 2.0 - 3e-5], [0.0, 0.0, 9.0]])
    assert greedy_check_from_logits(logits, [1, 0, 2], 3).exact
    tie = greedy_check_from_logits(logits, [1, 2, 2], 3)            # token 1: 3e-5 below the largest logit
    assert tie.near_tie and tie.ok and not tie.exact and tie.off_argmax[0][0] == 1 and "near-tie at token 1" in str(tie)
    bad = greedy_check_from_logits(logits, [1, 0, 0], 3)
    assert not bad.ok and "MISMATCH at token 2" in str(bad) and bad.off_argmax == ((2, 9.0),)


def test_greedy_check_from_logits_checks_where_the_answer_stops():
    rows = torch.tensor([[0.0, 5.0, 1.0]]).repeat(3, 1)              # token 1 is the largest logit everywhere
    assert greedy_check_from_logits(rows, [1, 1, 1], 3, eos_token_ids={1}).ending   # went on after an end-of-text
    assert greedy_check_from_logits(rows[:1], [1], 3, eos_token_ids={1}).exact      # stopped at it: right
    assert "stopped after 2 of 3" in str(greedy_check_from_logits(rows[:2], [1, 1], 3))
    assert "more than the 2" in str(greedy_check_from_logits(rows, [1, 1, 1], 2))
    with pytest.raises(ValueError, match="one row of logits per token"):
        greedy_check_from_logits(rows, [1, 1], 3)


def test_check_greedy_agrees_with_generate_and_finds_a_changed_token(tiny_model):
    prompts = [[5, 9, 2, 44], [7, 7, 3], [1, 2, 3, 4, 5, 6]]
    answers = [reference_generate(tiny_model, p, 8)[0] for p in prompts]
    assert all(c.exact for c in check_greedy(tiny_model, prompts, answers, 8))
    for k in (0, 3, 7):                                               # one token changed: every position is checked
        changed = [list(a) for a in answers]
        logits = tiny_model(torch.tensor([prompts[1] + changed[1][:k]])).logits[0, -1]
        changed[1][k] = int(logits.argsort()[-2])                     # the runner-up there: a real token, not greedy
        got = check_greedy(tiny_model, prompts, changed, 8)
        assert got[0].exact and got[2].exact and not got[1].ok and got[1].off_argmax[0][0] == k, (k, str(got[1]))
        assert not check_against_generate(tiny_model, prompts[1:2], changed[1:2], 8)[0].ok   # the old check agrees
    short = check_greedy(tiny_model, prompts[:1], [answers[0][:5]], 8)[0]
    assert not short.ok and "stopped after 5 of 8" in str(short)


def test_check_greedy_follows_the_end_of_text_rule(tiny_llama):
    free, _ = reference_generate(tiny_llama, [1, 2, 3], 8)
    stop = free[3]
    stopped, _ = reference_generate(tiny_llama, [1, 2, 3], 8, eos_token_ids={stop})
    assert check_greedy(tiny_llama, [[1, 2, 3]], [stopped], 8, eos_token_ids={stop})[0].exact
    assert not check_greedy(tiny_llama, [[1, 2, 3]], [free], 8, eos_token_ids={stop})[0].ok   # ran past it
    with pytest.raises(ValueError, match="one entry per request"):
        check_greedy(tiny_llama, [[1]], [[1], [2]], 3)
    with pytest.raises(ValueError, match="empty"):
        check_greedy(tiny_llama, [[]], [[1]], 3)


def test_check_greedy_checks_a_repeated_request_once(tiny_model, monkeypatch):
    prompts = [[5, 9, 2, 44], [7, 7, 3]]
    answers = [reference_generate(tiny_model, p, 6)[0] for p in prompts]
    calls = []
    forward = tiny_model.forward
    monkeypatch.setattr(tiny_model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    got = check_greedy(tiny_model, prompts * 3, answers * 3, 6)
    assert len(calls) == 2 and [c.exact for c in got] == [True] * 6
    memo = {}                                                      # shared between calls: another run's answers
    check_greedy(tiny_model, prompts, answers, 6, memo=memo)
    again = check_greedy(tiny_model, prompts[::-1], answers[::-1], 6, memo=memo)
    assert len(calls) == 4 and [c.exact for c in again] == [True, True]
    check_greedy(tiny_model, prompts[:1], answers[:1], 6, memo=memo, eos_token_ids={answers[0][-1]})   # another rule
    assert len(calls) == 5
