"""Chapter 01 -- the KV cache: the slow loop, the fast loop, one attention head, MAC counts.

Greedy decoding two ways:

* :func:`greedy_recompute` runs the whole sequence through the model at every step;
* :func:`greedy_cached` runs the prompt once (:func:`prefill`), then feeds one token at a
  time against the cache (:func:`decode_one_token`), with transformers' ``DynamicCache``.

Both return the same tokens: the keys and values of earlier positions never change under
a causal mask, so keeping them is not an approximation.

The arithmetic is counted in multiply-accumulates (MACs) by :func:`step_macs` and
:func:`generation_macs`; chapter 01 checks these formulas against
``torch.utils.flop_counter`` on the real model. A recomputed step costs ``n * W`` MACs in the
weights and a multiple of ``n**2`` in attention: :func:`attention_crossover_tokens` says from
which context length the quadratic term is the larger, and :func:`power_law_slope` /
:func:`local_slopes` read the growth off measured times instead of assuming it.
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


def _last_logits_kwargs(model) -> dict:
    """Ask for the last position's logits only, where the model supports it."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


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
        # every position through every layer, again; the LM head only for the last one (all the loop reads)
        logits = model(ids, use_cache=False, **_last_logits_kwargs(model)).logits
        next_id = logits[:, -1].argmax(-1, keepdim=True)       # greedy: the most likely token
        ids = torch.cat([ids, next_id], dim=1)
        t0 = _lap(ids.device, t0, step_s)
    return ids[:, input_ids.shape[1]:]


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

    Both compute the last position's logits only (what a greedy step reads). ``token_ids``
    (1, >= max(contexts)) supplies the text. The cached step runs against a
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
            out["recompute"].append(time_call(lambda: model(ids, use_cache=False, **_last_logits_kwargs(model)),
                                              warmup=1, repeats=repeats, device=device).median_s)
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


def lm_head_macs(dims: ModelDims) -> int:
    """MACs of the LM head for one position: vocabulary x hidden size."""
    if dims.vocab_size is None:
        raise ValueError("dims needs vocab_size (use model_dims(config))")
    return dims.vocab_size * dims.d_model


def attention_macs(n_queries: int, n_keys: int, dims: ModelDims, *, causal: bool = False) -> int:
    """MACs of QK^T and probs @ V for ``n_queries`` queries against ``n_keys`` keys, all layers and heads.

    By default the full rectangle, as the kernels do: a causal mask hides the upper triangle
    but eager attention still computes it. ``causal=True`` counts only the pairs the mask
    keeps (the queries being the last ``n_queries`` positions), what a kernel that skips
    masked blocks computes.
    """
    check_non_negative_int("n_queries", n_queries)
    check_non_negative_int("n_keys", n_keys)
    if n_queries > n_keys and causal:
        raise ValueError(f"causal attention needs n_queries <= n_keys, got {n_queries} > {n_keys}")
    pairs = n_queries * (n_keys - n_queries) + n_queries * (n_queries + 1) // 2 if causal else n_queries * n_keys
    return 2 * dims.n_layers * dims.n_heads * dims.head_dim * pairs


def step_macs(n_ctx: int, dims: ModelDims, weight_macs: int, *, cached: bool, last_logits_only: bool = False,
              causal: bool = False) -> int:
    """MACs of one greedy step that ends with ``n_ctx`` tokens in context.

    cached: one token through the weights, attending to ``n_ctx`` keys  -> linear in n_ctx.
    recompute: ``n_ctx`` tokens through the weights (``n_ctx * W``, linear) and an
    n_ctx x n_ctx score matrix (quadratic). ``last_logits_only``: the LM head runs for the last
    position only (``logits_to_keep=1``); ``causal``: attention counts only unmasked pairs.
    """
    check_positive_int("n_ctx", n_ctx)
    check_non_negative_int("weight_macs", weight_macs)
    if cached:
        return weight_macs + attention_macs(1, n_ctx, dims, causal=causal)
    linear = n_ctx * weight_macs - ((n_ctx - 1) * lm_head_macs(dims) if last_logits_only else 0)
    return linear + attention_macs(n_ctx, n_ctx, dims, causal=causal)


def attention_crossover_tokens(dims: ModelDims, weight_macs: int, *, last_logits_only: bool = False,
                               causal: bool = False) -> int:
    """The shortest context at which a recomputed step spends more MACs in attention than in the weights.

    Below it the step is dominated by the linear ``n * W`` term, so its cost grows about like n;
    the n^2 attention term takes over beyond it. Same options as :func:`step_macs`.
    """
    check_positive_int("weight_macs", weight_macs)

    def attention_wins(n: int) -> bool:
        attention = attention_macs(n, n, dims, causal=causal)
        return attention >= step_macs(n, dims, weight_macs, cached=False, last_logits_only=last_logits_only,
                                      causal=causal) - attention
    hi = 1
    while not attention_wins(hi):         # attention - weights is a parabola, negative up to its one root
        hi *= 2
    lo = hi // 2                           # attention_wins(lo) is False (or lo == 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if attention_wins(mid) else (mid, hi)
    return hi


def generation_macs(prompt_len: int, new_tokens: int, dims: ModelDims, weight_macs: int, *,
                    cached: bool, last_logits_only: bool = False) -> int:
    """MACs to generate ``new_tokens`` greedily after a ``prompt_len``-token prompt.

    cached: one prefill of the prompt, then ``new_tokens - 1`` one-token steps;
    recompute: ``new_tokens`` full passes over a growing sequence. The weights' term grows like
    T (cached) against T^2 (recompute), the attention term like T^2 against T^3.
    ``last_logits_only``: every pass (the prefill included) runs the LM head for its last position only.
    """
    check_positive_int("prompt_len", prompt_len)
    check_positive_int("new_tokens", new_tokens)
    if not cached:
        return sum(step_macs(prompt_len + t, dims, weight_macs, cached=False, last_logits_only=last_logits_only)
                   for t in range(new_tokens))
    total = step_macs(prompt_len, dims, weight_macs, cached=False, last_logits_only=last_logits_only)
    return total + sum(step_macs(prompt_len + t, dims, weight_macs, cached=True) for t in range(1, new_tokens))


def logits_bytes(n_positions: int, dims: ModelDims, *, bytes_per_element: int = 4) -> int:
    """Bytes of the logits of ``n_positions`` positions: one score per vocabulary entry each."""
    check_positive_int("n_positions", n_positions)
    check_positive_int("bytes_per_element", bytes_per_element)
    if dims.vocab_size is None:
        raise ValueError("dims needs vocab_size (use model_dims(config))")
    return n_positions * dims.vocab_size * bytes_per_element


def score_bytes(n_ctx: int, *, cached: bool, bytes_per_element: int = 4) -> int:
    """Bytes of one head's attention scores at one step: n x n (recompute) or 1 x n (cached)."""
    check_positive_int("n_ctx", n_ctx)
    check_positive_int("bytes_per_element", bytes_per_element)
    return (1 if cached else n_ctx) * n_ctx * bytes_per_element


def macs_bytes_table(n_ctx: int, dims: ModelDims, weight_macs: int, *, bytes_per_element: int = 4,
                     last_logits_only: bool = False) -> dict:
    """Both ways at context ``n_ctx``: MACs per step, score bytes per head, KV-cache bytes (for the widget)."""
    return {
        "MACs per step": {"recompute": step_macs(n_ctx, dims, weight_macs, cached=False,
                                                 last_logits_only=last_logits_only),
                          "KV cache": step_macs(n_ctx, dims, weight_macs, cached=True)},
        "score bytes per head": {"recompute": score_bytes(n_ctx, cached=False, bytes_per_element=bytes_per_element),
                                 "KV cache": score_bytes(n_ctx, cached=True, bytes_per_element=bytes_per_element)},
        "KV cache bytes held": {"recompute": 0, "KV cache": dims.kv_elements_per_token * n_ctx * bytes_per_element},
    }


def macs_bytes_figure(n_ctx: int, dims: ModelDims, weight_macs: int, *, bytes_per_element: int = 4,
                      last_logits_only: bool = False):
    """The chapter 01 widget's chart: both ways at context ``n_ctx``, on a log axis (a pure function)."""
    from .plots import bar_figure

    table = macs_bytes_table(n_ctx, dims, weight_macs, bytes_per_element=bytes_per_element,
                             last_logits_only=last_logits_only)
    rows = list(table)
    ratio = table["MACs per step"]["recompute"] / table["MACs per step"]["KV cache"]
    # a log axis cannot show zero: the recompute path holds no cache, so that bar is left out
    fig = bar_figure(rows, {way: [table[r][way] or None for r in rows] for way in ("recompute", "KV cache")},
                     title=f"At n = {n_ctx:,} tokens a recomputed step does {ratio:,.0f}x the MACs of a cached step",
                     x_title="quantity (one step, one sequence)", y_title="MACs or bytes (log scale)",
                     log_y=True, text_format=".3s")
    fig.update_traces(textposition="outside", cliponaxis=False)
    return fig


# --- reading growth off measurements -----------------------------------------------------------

def _log_points(x, y) -> tuple[list[float], list[float]]:
    x, y = list(x), list(y)
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need at least two (x, y) points of equal count, got {len(x)} x and {len(y)} y")
    if any(not (v > 0 and math.isfinite(v)) for v in x + y):
        raise ValueError("a power law is read on log axes: every x and y must be a positive finite number")
    return [math.log(v) for v in x], [math.log(v) for v in y]


def power_law_slope(x, y) -> float:
    """The exponent k of the least-squares fit y ~ c * x**k (a straight line on log-log axes).

    1 means y grows like x, 2 like x squared; measured times usually lie between the two.
    """
    lx, ly = _log_points(x, y)
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((a - mx) ** 2 for a in lx)
    if sxx == 0:
        raise ValueError("x must take at least two different values")
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sxx


#: How a fitted exponent reads, as (upper bound, reading): 0.5 is not 1, and 1 is not 2.
GROWTH_READINGS = ((0.8, "more slowly than n"), (1.25, "about like n"), (1.75, "between n and n²"),
                   (2.25, "about like n²"), (math.inf, "faster than n²"))


def growth_reading(slope: float) -> str:
    """Words for a fitted exponent k of y ~ x**k (chapter 01): below 0.8 "more slowly than n",
    up to 1.25 "about like n", up to 1.75 "between n and n²", up to 2.25 "about like n²", beyond "faster than n²"."""
    if isinstance(slope, bool) or not isinstance(slope, (int, float)) or not math.isfinite(slope):
        raise ValueError(f"slope must be a finite number (a fitted exponent), got {slope!r}")
    return next(reading for upper, reading in GROWTH_READINGS if slope < upper)


def local_slopes(x, y) -> list[float]:
    """The exponent between each pair of neighbouring points: log(y1 / y0) / log(x1 / x0), len(x) - 1 values.

    A value well above the overall fit marks a cliff: a step where the cost jumped by more than the
    arithmetic grew (a buffer outgrowing a cache, memory coming fresh from the operating system).
    """
    lx, ly = _log_points(x, y)
    if any(b <= a for a, b in zip(lx, lx[1:])):
        raise ValueError("x must be strictly increasing")
    return [(y1 - y0) / (x1 - x0) for x0, x1, y0, y1 in zip(lx, lx[1:], ly, ly[1:])]


def scaling_figure(x, series: dict, *, title: str, x_title: str, y_title: str):
    """Log-log lines of measured ``series`` (name -> y values over ``x``), each labelled with its fitted
    exponent, and dashed guides through the first series' first point that grow like n and like n²."""
    from .plots import PALETTE, line_figure

    x = list(x)
    fig = line_figure(x, {f"{name} (fitted slope {power_law_slope(x, y):.2f})": y for name, y in series.items()},
                      title=title, x_title=x_title, y_title=y_title, log_x=True, log_y=True)
    x0, y0 = x[0], list(next(iter(series.values())))[0]
    for power, dash in ((1, "dot"), (2, "dash")):
        fig.add_scatter(x=x, y=[y0 * (v / x0) ** power for v in x], mode="lines", name=f"guide ∝ n{'²' if power == 2 else ''}",
                        line=dict(color=PALETTE[7], dash=dash, width=1), hoverinfo="skip")
    return fig
