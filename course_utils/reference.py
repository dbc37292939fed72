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


def _requests(prompts, outputs, max_new_tokens) -> list[tuple]:
    """``(prompt, output, limit)`` per request; ``max_new_tokens`` one limit for all or one per request."""
    limits = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
    if not (len(prompts) == len(outputs) == len(limits)):
        raise ValueError("prompts, outputs and max_new_tokens must have one entry per request")
    return list(zip(prompts, outputs, limits))


def check_against_generate(model, prompts: list[list[int]], outputs: list[list[int]], max_new_tokens, *,
                           eos_token_ids=(), tie_tol: float = TIE_TOL, progress: bool = False) -> list[Agreement]:
    """One :class:`Agreement` per request: ``outputs[i]`` vs ``generate`` on ``prompts[i]`` alone."""
    items = progress_bar(_requests(prompts, outputs, max_new_tokens), "generate, one prompt at a time",
                         enabled=progress, unit="request")
    results = []
    for prompt, got, limit in items:
        ref, gaps = reference_generate(model, prompt, limit, eos_token_ids=eos_token_ids)
        results.append(compare_tokens(got, ref, gaps, tie_tol=tie_tol))
    return results


# --- the same claim, checked in one forward pass per request ---------------------------------------------------

@dataclass(frozen=True)
class GreedyCheck:
    """How one request's tokens compare with the model's own greedy choices, position by position.

    ``off_argmax``: ``(index, gap)`` for every token that is not the largest logit where it was chosen, ``gap``
    being the largest logit minus that token's; ``ending``: what is wrong with where the answer stops (``""``: nothing).
    """

    n_tokens: int
    off_argmax: tuple[tuple[int, float], ...]
    ending: str = ""
    tie_tol: float = TIE_TOL

    @property
    def exact(self) -> bool:
        return not self.off_argmax and not self.ending

    @property
    def near_tie(self) -> bool:
        return bool(self.off_argmax) and not self.ending and all(g < self.tie_tol for _, g in self.off_argmax)

    @property
    def ok(self) -> bool:
        return self.exact or self.near_tie

    def __str__(self) -> str:
        if self.ending:
            return f"MISMATCH: {self.ending}"
        if self.exact:
            return f"greedy at every token ({self.n_tokens} tokens)"
        what = "near-tie" if self.near_tie else "MISMATCH"
        i, gap = next((i, g) for i, g in self.off_argmax if self.near_tie or g >= self.tie_tol)   # the first that fails
        return (f"{what} at token {i} (the largest logit {gap:.2e} above the one chosen"
                + (f"; {len(self.off_argmax)} such tokens" if len(self.off_argmax) > 1 else "") + ")")


def greedy_check_from_logits(logits: torch.Tensor, tokens: list[int], max_new_tokens: int, *, eos_token_ids=(),
                             tie_tol: float = TIE_TOL) -> GreedyCheck:
    """:class:`GreedyCheck` of ``tokens`` from ``logits`` (one row per token: the logits it was chosen from).

    Greedy decoding picks the largest logit at every step, so ``tokens`` are the greedy answer exactly when each is
    its row's largest logit (or within ``tie_tol`` of it: a near-tie, which rounding may decide either way), the
    answer stops at the first end-of-text token, and it stops early only there."""
    tokens = [int(t) for t in tokens]
    if logits.ndim != 2 or logits.shape[0] != len(tokens):
        raise ValueError(f"need one row of logits per token: got {tuple(logits.shape)} for {len(tokens)} tokens")
    eos = set(eos_token_ids)
    ending = ""
    if len(tokens) > max_new_tokens:
        ending = f"{len(tokens)} tokens, more than the {max_new_tokens} asked for"
    elif any(t in eos for t in tokens[:-1]):
        ending = f"went on after an end-of-text token (at token {next(i for i, t in enumerate(tokens) if t in eos)})"
    elif len(tokens) < max_new_tokens and not (tokens and tokens[-1] in eos):
        ending = f"stopped after {len(tokens)} of {max_new_tokens} tokens without an end-of-text token"
    if not tokens:
        return GreedyCheck(0, (), ending, tie_tol)
    rows = logits.float()
    top = rows.max(-1).values
    chosen = rows.gather(-1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0]
    gaps = (top - chosen).tolist()
    off = tuple((i, float(g)) for i, g in enumerate(gaps) if g > 0)
    return GreedyCheck(len(tokens), off, ending, tie_tol)


@torch.no_grad()
def check_greedy(model, prompts: list[list[int]], outputs: list[list[int]], max_new_tokens, *, eos_token_ids=(),
                 tie_tol: float = TIE_TOL, progress: bool = False, memo: dict | None = None) -> list[GreedyCheck]:
    """One :class:`GreedyCheck` per request: is ``outputs[i]`` the model's greedy answer to ``prompts[i]`` alone?

    The question :func:`check_against_generate` answers, in one forward pass per request instead of one per token:
    the prompt and the answer go through the model together, with no cache (teacher forcing), and each answer token
    must be the largest logit at the position before it (:func:`greedy_check_from_logits`). Where that holds at every
    token, ``generate`` would write the same answer, since it too takes the largest logit after the same tokens. A
    near-tie is allowed at any token, not only at the first difference; the logits come from other shapes than
    ``generate``'s one-token steps, so they differ from its logits in the last bits, as any batch's do. A request
    that repeats an earlier one (the same prompt, answer, limit and rule) is checked once: within this call, and
    across calls that pass the same ``memo`` dict (another run of the same requests, say)."""
    memo = {} if memo is None else memo
    eos, results = frozenset(int(t) for t in eos_token_ids), []
    for prompt, got, limit in progress_bar(_requests(prompts, outputs, max_new_tokens),
                                           "the model's own choices, one pass per request", enabled=progress,
                                           unit="request"):
        got = [int(t) for t in got]
        key = (tuple(prompt), tuple(got), int(limit), eos, tie_tol)
        if key not in memo:
            if not prompt:
                raise ValueError("a prompt is empty: give at least one token")
            check_positive_int("max_new_tokens", int(limit))
            if got:
                ids = torch.tensor([list(prompt) + got[:-1]], device=model.device)   # the last token is predicted
                logits = model(ids, attention_mask=torch.ones_like(ids), use_cache=False,
                               logits_to_keep=len(got)).logits[0]
            else:
                logits = torch.empty(0, 1)
            memo[key] = greedy_check_from_logits(logits, got, int(limit), eos_token_ids=eos, tie_tol=tie_tol)
        results.append(memo[key])
    return results
