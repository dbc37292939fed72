"""Token sampling: temperature, top-k, draws, total variation."""
from __future__ import annotations

import pytest
import torch

from course_utils.sampling import sample_token, sampling_probs, total_variation


def test_temperature_flattens_and_sharpens_and_zero_is_greedy():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p1, p2, p05 = (sampling_probs(logits, t) for t in (1.0, 2.0, 0.5))
    assert torch.allclose(p1, torch.softmax(logits, -1))
    assert p2.max() < p1.max() < p05.max()
    # the ratio of two tokens' probabilities at temperature T is the T = 1 ratio to the power 1/T
    assert float(p2[0] / p2[2]) == pytest.approx(float(p1[0] / p1[2]) ** 0.5, rel=1e-5)
    assert sampling_probs(logits, 0).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_top_k_keeps_the_k_largest():
    p = sampling_probs(torch.tensor([0.0, 3.0, 1.0, 2.0]), 1.0, top_k=2)
    assert p[0] == 0 and p[2] == 0 and p.sum().item() == pytest.approx(1.0)
    assert float(p[1] / p[3]) == pytest.approx(torch.e, rel=1e-5)


def test_draws_follow_the_distribution_and_are_reproducible():
    probs = torch.tensor([0.1, 0.6, 0.3])
    g = torch.Generator().manual_seed(0)
    draws = [sample_token(probs, g) for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / 3000
    assert (freq - probs).abs().max() < 0.03
    again = torch.Generator().manual_seed(0)
    assert [sample_token(probs, again) for _ in range(50)] == draws[:50]


def test_total_variation():
    p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.25, 0.25, 0.5])
    assert total_variation(p, q) == pytest.approx(0.5) and total_variation(p, p) == 0


def test_bad_sampling_input():
    with pytest.raises(ValueError, match="temperature"):
        sampling_probs(torch.zeros(3), -0.5)
    with pytest.raises(ValueError, match="top_k"):
        sampling_probs(torch.zeros(3), 1.0, top_k=5)
    with pytest.raises(ValueError, match="top_k"):
        sampling_probs(torch.zeros(3), 1.0, top_k=-1)
    with pytest.raises(ValueError, match="one distribution"):
        sample_token(torch.ones(2, 2) / 2)
    with pytest.raises(ValueError, match="same vocabulary"):
        total_variation(torch.ones(2) / 2, torch.ones(3) / 3)
