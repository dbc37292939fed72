"""Token sampling: temperature, top-k, and drawing a token (chapter 08 onwards).

Greedy decoding takes the most likely token. Sampling draws from the model's distribution
instead, usually reshaped first:

* **temperature** T divides the logits: T < 1 sharpens the distribution, T > 1 flattens it,
  T = 0 is greedy decoding (the limit);
* **top-k** keeps the k most likely tokens and renormalises over them.

:func:`sampling_probs` applies both in that order (as transformers' ``generate`` and vLLM do)
and is the one place the course turns logits into a sampling distribution: chapter 08's
speculative sampling applies it to the target's and the draft's logits alike, so both sides
of the acceptance rule see the same reshaped distributions.
"""
from __future__ import annotations

import math

import torch

from .validation import check_finite, check_non_negative_int


def check_sampling(temperature: float, top_k: int = 0) -> tuple[float, int]:
    """Validate ``temperature`` (>= 0; 0 means greedy) and ``top_k`` (>= 0; 0 means no cut)."""
    temperature = check_finite("temperature", temperature, minimum=0.0)
    check_non_negative_int("top_k", top_k)
    return temperature, top_k


def sampling_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The distribution a sampler draws from: ``softmax(logits / T)`` over the ``top_k`` largest logits.

    ``logits``: (..., vocab). Returns float32 probabilities of the same shape, summing to 1 along
    the last dimension. ``temperature == 0`` gives the one-hot greedy choice (ties to the lowest id).
    """
    temperature, top_k = check_sampling(temperature, top_k)
    logits = logits.float()
    if top_k and top_k > logits.shape[-1]:
        raise ValueError(f"top_k={top_k} is larger than the vocabulary ({logits.shape[-1]} tokens)")
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    return torch.softmax(logits / temperature, dim=-1)


def sample_token(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from ``probs`` (vocab,) with ``generator`` (seeded: reproducible draws)."""
    if probs.dim() != 1:
        raise ValueError(f"probs must be one distribution (vocab,), got shape {tuple(probs.shape)}")
    return int(torch.multinomial(probs, 1, generator=generator))


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    """Total-variation distance ½ Σ |p − q| between two distributions over the same vocabulary.

    Chapter 08: with the modified acceptance rule a draft token is accepted with probability
    1 − TV(p, q) on average.
    """
    if p.shape != q.shape:
        raise ValueError(f"p and q must have one shape (the same vocabulary), got {tuple(p.shape)}, {tuple(q.shape)}")
    return float(0.5 * (p.float() - q.float()).abs().sum())
