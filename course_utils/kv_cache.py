"""Chapter 01 -- the KV cache: the slow loop, the fast loop, one attention head, MAC counts.

Greedy decoding two ways:

* :func:`greedy_recompute` runs the whole sequence through the model at every step;
* :func:`greedy_cached` runs the prompt once (:func:`prefill`), then feeds one token at a
  time against the cache (:func:`decode_one_token`), with transformers' ``DynamicCache``.

Both return the same tokens: the keys and values of earlier positions never change under
a causal mask, so keeping them is not an approximation.

The arithmetic is counted in multiply-accumulates (MACs) by :func:`step_macs` and
:func:`generation_macs`; chapter 01 checks these formulas against
``torch.utils.flop_counter`` on the real model.
"""
from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .measure import synchronize
from .models import ModelDims
from .validation import check_non_negative_int, check_positive_int


def _check_generation_args(input_ids: torch.Tensor, max_new_tokens: int) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be a (1, prompt_len) tensor of token ids, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    check_positive_int("max_new_tokens", max_new_tokens)


def _lap(device, t0: float, step_s: list | None) -> float:
    if step_s is not None:
        synchronize(device)
        now = time.perf_counter()
        step_s.append(now - t0)
        return now
    return t0


@torch.no_grad()
def greedy_recompute(model, input_ids: torch.Tensor, max_new_tokens: int, *,
                     step_s: list | None = None) -> torch.Tensor:
    """The slow loop: every step re-runs the whole sequence. Returns the new ids, (1, max_new_tokens).

    ``step_s``, if a list, receives the seconds each step took.
    """
    _check_generation_args(input_ids, max_new_tokens)
    ids = input_ids
    t0 = time.perf_counter()
    for _ in range(max_new_tokens):
        logits = model(ids, use_cache=False).logits            # (1, len, vocab): all positions, again
        next_id = logits[:, -1].argmax(-1, keepdim=True)       # greedy: the most likely token
        ids = torch.cat([ids, next_id], dim=1)
        t0 = _lap(ids.device, t0, step_s)
    return ids[:, input_ids.shape[1]:]


def _last_logits_kwargs(model) -> dict:
    """Ask for the last position's logits only, where the model supports it."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Run the prompt once, filling ``cache``; returns the last position's logits, (batch, vocab)."""
    return model(input_ids, cache=cache, use_cache=True, **_last_logits_kwargs(model)).logits[:, -1]


@torch.no_grad()
def decode_one_token(model, token_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Feed one token per sequence, (batch, 1), against ``cache``; returns logits (batch, vocab)."""
    return model(token_ids, cache=cache, use_cache=True).logits[:, -1]


@torch.no_grad()
def greedy_cached(model, input_ids: torch.Tensor, max_new_tokens: int, *,
                  step_s: list | None = None, cache: DynamicCache | None = None) -> torch.Tensor:
    """The fast loop: prefill once, then one token per step. Returns the new ids, (1, max_new_tokens).

    ``step_s``, if a list, receives the seconds of each step (the first entry is the prefill).
    ``cache``, if given, is filled in place (so a caller can inspect it afterwards).
    """
    _check_generation_args(input_ids, max_new_tokens)
    cache = DynamicCache(config=model.config) if cache is None else cache
    t0 = time.perf_counter()
    next_id = prefill(model, input_ids, cache).argmax(-1, keepdim=True)
    t0 = _lap(input_ids.device, t0, step_s)
    new = [next_id]
    for _ in range(max_new_tokens - 1):
        next_id = decode_one_token(model, next_id, cache).argmax(-1, keepdim=True)
        new.append(next_id)
        t0 = _lap(input_ids.device, t0, step_s)
    return torch.cat(new, dim=1)


def cache_nbytes(cache: DynamicCache) -> int:
    """Bytes held by the key and value tensors of a transformers cache, all layers."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


def step_seconds(model, token_ids: torch.Tensor, contexts, *, repeats: int = 3, device="cpu") -> dict:
    """Median seconds of one greedy step ending at each context length, both ways.

    ``token_ids`` (1, >= max(contexts)) supplies the text. The cached step runs against a
    cache of ``n - 1`` positions (cropped back after every timed call, so each run sees the
    same length). Returns ``{"recompute": [...], "cached": [...]}`` in the order of ``contexts``.
    """
    from .measure import time_call

    if token_ids.dim() != 2 or token_ids.shape[1] < max(contexts):
        raise ValueError(f"token_ids must be (1, >= {max(contexts)}), got {tuple(token_ids.shape)}")
    out = {"recompute": [], "cached": []}
    with torch.no_grad():
        for n in contexts:
            ids = token_ids[:, :n]
            out["recompute"].append(time_call(lambda: model(ids, use_cache=False), warmup=1, repeats=repeats,
                                              device=device).median_s)
            cache = DynamicCache(config=model.config)
            prefill(model, ids[:, :-1], cache)

            def one_step():
                decode_one_token(model, ids[:, -1:], cache)
                cache.crop(-1)             # back to n - 1 positions
            out["cached"].append(time_call(one_step, warmup=1, repeats=repeats, device=device).median_s)
    return out


def counted_macs(model, fn) -> int:
    """MACs that ``torch.utils.flop_counter`` counts while ``fn()`` runs (FLOPs / 2).

    Attention is switched to the eager implementation for the count, so the two score
    matmuls appear as ordinary matrix products; the previous implementation is restored.
    """
    from torch.utils.flop_counter import FlopCounterMode

    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            fn()
    finally:
        model.set_attn_implementation(previous)
    return counter.get_total_flops() // 2


# --- one attention head --------------------------------------------------------------------

@dataclass
class HeadStep:
    """One generation step of one attention head: its output (head_dim,) and its score row(s)."""

    out: torch.Tensor
    scores: torch.Tensor


def head_step_recompute(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> HeadStep:
    """Recompute everything for ``x`` (n, d_model): Q, K, V of all n positions and the n x n scores."""
    q, k, v = x @ wq, x @ wk, x @ wv                               # (n, d) each
    scores = (q @ k.T) / math.sqrt(q.shape[-1])                     # (n, n)
    n = x.shape[0]
    future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu_(diagonal=1)
    scores.masked_fill_(future, float("-inf"))                      # causal: position i sees 0..i
    return HeadStep(out=(scores.softmax(-1) @ v)[-1], scores=scores)


def head_step_cached(x_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> tuple[HeadStep, torch.Tensor, torch.Tensor]:
    """The newest position only: ``x_new`` (1, d_model) against cached K, V (n-1, d).

    Returns the step and the caches grown by one row each.
    """
    k_cache = torch.cat([k_cache, x_new @ wk])
    v_cache = torch.cat([v_cache, x_new @ wv])
    q = x_new @ wq                                                  # (1, d)
    scores = (q @ k_cache.T) / math.sqrt(q.shape[-1])               # (1, n)
    return HeadStep(out=(scores.softmax(-1) @ v_cache)[0], scores=scores), k_cache, v_cache


# --- counting multiply-accumulates -------------------------------------------------------------

def weight_macs_per_token(model) -> int:
    """MACs of the weight matrices for one token: every 2-D weight except the embedding lookup.

    A tied LM head reuses the embedding matrix for a matmul, so it counts once.
    """
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embed
    total = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    return total if tied else total - embed.numel()


def attention_macs(n_queries: int, n_keys: int, dims: ModelDims) -> int:
    """MACs of QK^T and probs @ V for ``n_queries`` queries against ``n_keys`` keys, all layers and heads.

    Counts the full rectangle, as the kernels do: a causal mask hides the upper triangle
    but eager attention still computes it.
    """
    check_non_negative_int("n_queries", n_queries)
    check_non_negative_int("n_keys", n_keys)
    return 2 * dims.n_layers * dims.n_heads * dims.head_dim * n_queries * n_keys


def step_macs(n_ctx: int, dims: ModelDims, weight_macs: int, *, cached: bool) -> int:
    """MACs of one greedy step that ends with ``n_ctx`` tokens in context.

    cached: one token through the weights, attending to ``n_ctx`` keys  -> linear in n_ctx.
    recompute: ``n_ctx`` tokens through the weights, an n_ctx x n_ctx score matrix -> quadratic.
    """
    check_positive_int("n_ctx", n_ctx)
    check_non_negative_int("weight_macs", weight_macs)
    if cached:
        return weight_macs + attention_macs(1, n_ctx, dims)
    return n_ctx * weight_macs + attention_macs(n_ctx, n_ctx, dims)


def generation_macs(prompt_len: int, new_tokens: int, dims: ModelDims, weight_macs: int, *,
                    cached: bool) -> int:
    """MACs to generate ``new_tokens`` greedily after a ``prompt_len``-token prompt.

    cached: one prefill of the prompt, then ``new_tokens - 1`` one-token steps -> O(T^2).
    recompute: ``new_tokens`` full passes over a growing sequence -> O(T^3).
    """
    check_positive_int("prompt_len", prompt_len)
    check_positive_int("new_tokens", new_tokens)
    if not cached:
        return sum(step_macs(prompt_len + t, dims, weight_macs, cached=False) for t in range(new_tokens))
    total = prompt_len * weight_macs + attention_macs(prompt_len, prompt_len, dims)
    return total + sum(step_macs(prompt_len + t, dims, weight_macs, cached=True) for t in range(1, new_tokens))


def score_bytes(n_ctx: int, *, cached: bool, bytes_per_element: int = 4) -> int:
    """Bytes of one head's attention scores at one step: n x n (recompute) or 1 x n (cached)."""
    check_positive_int("n_ctx", n_ctx)
    check_positive_int("bytes_per_element", bytes_per_element)
    return (1 if cached else n_ctx) * n_ctx * bytes_per_element


def macs_bytes_table(n_ctx: int, dims: ModelDims, weight_macs: int, *, bytes_per_element: int = 4) -> dict:
    """Both ways at context ``n_ctx``: MACs per step, score bytes per head, KV-cache bytes (for the widget)."""
    return {
        "MACs per step": {"recompute": step_macs(n_ctx, dims, weight_macs, cached=False),
                          "KV cache": step_macs(n_ctx, dims, weight_macs, cached=True)},
        "score bytes per head": {"recompute": score_bytes(n_ctx, cached=False, bytes_per_element=bytes_per_element),
                                 "KV cache": score_bytes(n_ctx, cached=True, bytes_per_element=bytes_per_element)},
        "KV cache bytes held": {"recompute": 0, "KV cache": dims.kv_elements_per_token * n_ctx * bytes_per_element},
    }


def macs_bytes_figure(n_ctx: int, dims: ModelDims, weight_macs: int, *, bytes_per_element: int = 4):
    """The chapter 01 widget's chart: both ways at context ``n_ctx``, on a log axis (a pure function)."""
    from .plots import bar_figure

    table = macs_bytes_table(n_ctx, dims, weight_macs, bytes_per_element=bytes_per_element)
    rows = list(table)
    ratio = table["MACs per step"]["recompute"] / table["MACs per step"]["KV cache"]
    # a log axis cannot show zero: the recompute path holds no cache, so that bar is left out
    fig = bar_figure(rows, {way: [table[r][way] or None for r in rows] for way in ("recompute", "KV cache")},
                     title=f"At n = {n_ctx:,} tokens a recomputed step does {ratio:,.0f}x the MACs of a cached step",
                     x_title="quantity (one step, one sequence)", y_title="MACs or bytes (log scale)",
                     log_y=True, text_format=".3s")
    fig.update_traces(textposition="outside", cliponaxis=False)
    return fig
