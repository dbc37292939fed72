"""Chapter 04 -- is the engine exact? Its greedy tokens against transformers' ``generate``, request by request.

The engine runs each request inside batches of varying shape, and reuses keys/values
computed in other batches (shared prefixes, recompute after preemption). Floating-point
sums depend on the order of the additions, so logits can differ in the last bits. A
token may therefore differ only where the reference itself hesitated: where its two
largest logits were within ``tie_tol`` of each other (a near-tie). Anywhere else a
different token is a bug. After the first difference the two continuations are
different texts, so the comparison stops there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_TOL = 1e-4


@dataclass(frozen=True)
class Agreement:
    """How one request's engine tokens compare with the reference's.

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


@torch.no_grad()
def reference_generate(model, prompt_ids: list[int], max_new_tokens: int, *,
                       eos_token_ids=()) -> tuple[list[int], list[float]]:
    """Greedy ``generate`` for one prompt alone: its new tokens and the top-2 logit gap at each.

    ``eos_token_ids``: the ids that stop generation (the EOS token is kept); empty = never stop.
    """
    if not prompt_ids or max_new_tokens < 1:
        raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    eos = sorted(eos_token_ids) or None
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, repetition_penalty=1.0, temperature=None, top_p=None, top_k=None,
                         eos_token_id=eos, pad_token_id=eos[0] if eos else 0,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    gaps = []
    for logits in out.logits:
        top2 = logits[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    for i, t in enumerate(tokens):
        if t in (eos or ()):
            return tokens[:i + 1], gaps[:i + 1]
    return tokens, gaps


def compare_tokens(engine_ids: list[int], reference_ids: list[int], reference_gaps: list[float], *,
                   tie_tol: float = TIE_TOL) -> Agreement:
    """Compare up to the first differing token; a difference is allowed only at a near-tie."""
    for i, (a, b) in enumerate(zip(engine_ids, reference_ids)):
        if a != b:
            return Agreement(len(engine_ids), len(reference_ids), i, reference_gaps[i], tie_tol)
    if len(engine_ids) != len(reference_ids):
        i = min(len(engine_ids), len(reference_ids))
        gap = reference_gaps[i] if i < len(reference_gaps) else None
        return Agreement(len(engine_ids), len(reference_ids), i, gap, tie_tol)
    return Agreement(len(engine_ids), len(reference_ids), None, None, tie_tol)


def check_against_generate(model, prompts: list[list[int]], engine_outputs: list[list[int]], max_new_tokens, *,
                           eos_token_ids=(), tie_tol: float = TIE_TOL, progress: bool = False) -> list[Agreement]:
    """One :class:`Agreement` per request: the engine's tokens vs ``generate`` on that prompt alone."""
    limits = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
    if not (len(prompts) == len(engine_outputs) == len(limits)):
        raise ValueError("prompts, engine_outputs and max_new_tokens must have one entry per request")
    items = zip(prompts, engine_outputs, limits)
    if progress:
        from tqdm.auto import tqdm
        items = tqdm(list(items), desc="generate, one prompt at a time", unit="request")
    results = []
    for prompt, got, limit in items:
        ref, gaps = reference_generate(model, prompt, limit, eos_token_ids=eos_token_ids)
        results.append(compare_tokens(got, ref, gaps, tie_tol=tie_tol))
    return results
