"""The greedy reference and the near-tie rule every exactness claim uses."""
from __future__ import annotations

import pytest
import torch

from course_utils.reference import (check_against_generate, common_prefix_len, compare_tokens, generate_static_batch,
                                    greedy_settings, reference_generate)


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
