"""The greedy reference every exactness claim is checked against, and the rule for comparing tokens.

Chapter 04's engine, chapter 08's speculative decoding and chapter 11's servers all claim to
produce the tokens transformers' ``generate`` produces greedily for each prompt alone.
Floating-point sums depend on the order of the additions, so logits computed inside
batches of another shape (or by other kernels) can differ in the last bits. A token may
therefore differ only where the reference itself hesitated: where its two largest logits
were within ``tie_tol`` of each other (a near-tie). Anywhere else a different token is a
bug. After the first difference the two continuations are different texts, so the
comparison stops there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .progress import progress_bar
from .validation import check_positive_int

TIE_TOL = 1e-4


def greedy_settings(eos_token_ids=()) -> dict:
    """Keyword arguments that make ``generate`` plain greedy decoding, whatever the model's generation config says.

    No sampling, no repetition penalty; ``eos_token_ids`` stop generation (empty: never stop).
    """
    eos = sorted(eos_token_ids) or None
    return dict(do_sample=False, repetition_penalty=1.0, temperature=None, top_p=None, top_k=None,
                eos_token_id=eos, pad_token_id=eos[0] if eos else 0)


@torch.no_grad()
def reference_generate(model, prompt_ids: list[int], max_new_tokens: int, *,
                       eos_token_ids=()) -> tuple[list[int], list[float]]:
    """Greedy ``generate`` for one prompt alone: its new tokens and the top-2 logit gap at each.

    ``eos_token_ids``: the ids that stop generation (the EOS token is kept); empty = never stop.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    check_positive_int("max_new_tokens", max_new_tokens)
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         output_logits=True, return_dict_in_generate=True, **greedy_settings(eos_token_ids))
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    gaps = []
    for logits in out.logits:
        top2 = logits[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    for i, t in enumerate(tokens):
        if t in eos_token_ids:
            return tokens[:i + 1], gaps[:i + 1]
    return tokens, gaps


@torch.no_grad()
def generate_static_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' ``generate`` on one batch of equal-length prompts, greedy, EOS ignored: the new tokens."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("the prompts must have equal lengths (no padding)")
    check_positive_int("max_new_tokens", max_new_tokens)
    ids = torch.tensor(prompts, device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=None, **greedy_settings())
    return out[:, ids.shape[1]:].tolist()


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Agreement:
    """How one request's tokens compare with the reference's.

    ``first_diff``: index of the first differing token (None if all equal, lengths too);
    ``top2_gap``: the reference's top-1 minus top-2 logit at that index.
    """

    engine_len: int
    reference_len: int
    first_diff: int | None
    top2_gap: float | None
    tie_tol: float = TIE_TOL

    @property
    def exact(self) -> bool:
        return self.first_diff is None

    @property
    def near_tie(self) -> bool:
        return self.first_diff is not None and self.top2_gap is not None and self.top2_gap < self.tie_tol

    @property
    def ok(self) -> bool:
        return self.exact or self.near_tie

    def __str__(self) -> str:
        if self.exact:
            return f"identical ({self.engine_len} tokens)"
        what = "near-tie" if self.near_tie else "MISMATCH"
        gap = "n/a" if self.top2_gap is None else f"{self.top2_gap:.2e}"
        return f"{what} at token {self.first_diff} (reference top-2 logit gap {gap})"


def compare_tokens(got_ids: list[int], reference_ids: list[int], reference_gaps: list[float], *,
                   tie_tol: float = TIE_TOL) -> Agreement:
    """Compare up to the first differing token; a difference is allowed only at a near-tie."""
    i = common_prefix_len(got_ids, reference_ids)
    if i < min(len(got_ids), len(reference_ids)) or len(got_ids) != len(reference_ids):
        gap = reference_gaps[i] if i < len(reference_gaps) else None
        return Agreement(len(got_ids), len(reference_ids), i, gap, tie_tol)
    return Agreement(len(got_ids), len(reference_ids), None, None, tie_tol)


def check_against_generate(model, prompts: list[list[int]], outputs: list[list[int]], max_new_tokens, *,
                           eos_token_ids=(), tie_tol: float = TIE_TOL, progress: bool = False) -> list[Agreement]:
    """One :class:`Agreement` per request: ``outputs[i]`` vs ``generate`` on ``prompts[i]`` alone."""
    limits = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
    if not (len(prompts) == len(outputs) == len(limits)):
        raise ValueError("prompts, outputs and max_new_tokens must have one entry per request")
    items = progress_bar(list(zip(prompts, outputs, limits)), "generate, one prompt at a time", enabled=progress,
                         unit="request")
    results = []
    for prompt, got, limit in items:
        ref, gaps = reference_generate(model, prompt, limit, eos_token_ids=eos_token_ids)
        results.append(compare_tokens(got, ref, gaps, tie_tol=tie_tol))
    return results
