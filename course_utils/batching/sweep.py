"""The measured decode step: one step of B requests timed for each B (chapter 04), and over batch size, context
and cache format (chapter 10)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..progress import progress_bar
from ..validation import check_non_negative_int, check_positive_int, check_positive_ints


@dataclass(frozen=True)
class SweepPoint:
    """One batch size of the sweep: the median seconds of one decode step, their spread, and
    the seconds of each timed round (``samples_s[r]``: round r, the same round for every batch size)."""

    batch: int
    step_s: float
    spread_s: float
    samples_s: tuple[float, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        """Throughput: every request gets one token per step."""
        return self.batch / self.step_s

    @property
    def latency_s(self) -> float:
        """Per-request latency of one token: each request waits for the whole step."""
        return self.step_s


def _check_batch_sizes(batch_sizes) -> list[int]:
    sizes = check_positive_ints("batch sizes", batch_sizes)
    if sizes != sorted(set(sizes)):
        raise ValueError(f"batch sizes must be strictly increasing, got {sizes}")
    return sizes


def _replicated_cache(model, keys, values, batch: int):
    """A transformers cache holding ``batch`` copies of one sequence's keys and values."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1), i)
    return cache


@torch.no_grad()
def decode_step_sweep(model, batch_sizes=(1, 2, 4, 8, 16, 32, 64), *, context_len: int = 64, repeats: int = 3,
                      device=None, seed: int = 0, progress: bool = True) -> list[SweepPoint]:
    """Time one decode step of B requests, each with a ``context_len``-token cache, for each B.

    Every request holds the same cache (prefilled once and copied B times; the content does
    not change the cost). The batch sizes are visited in turn, ``repeats`` rounds after one
    warm-up round, so machine noise hits them alike; every other round visits them from the largest down,
    so no batch size always runs right after the same neighbour. Each point is the median step.
    """
    from ..kv_cache import prefill
    from ..measure import time_call
    sizes = _check_batch_sizes(batch_sizes)
    check_positive_int("context_len", context_len)
    device = model.device if device is None else torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, context_len), generator=gen).to(model.device)
    from transformers import DynamicCache
    base = DynamicCache(config=model.config)
    first = prefill(model, ids, base).argmax(-1)                   # (1,)
    keys = [layer.keys for layer in base.layers]
    values = [layer.values for layer in base.layers]
    samples: dict[int, list[float]] = {b: [] for b in sizes}
    for r in progress_bar(range(repeats + 1), "batch sweep (round 0 = warm-up)", enabled=progress, unit="round"):
        for b in (sizes if r % 2 == 0 else sizes[::-1]):
            cache = _replicated_cache(model, keys, values, b)
            step = lambda: model(first.expand(b)[:, None], cache=cache, use_cache=True)  # noqa: E731
            t = time_call(step, warmup=0, repeats=1, device=device).samples_s[0]
            if r:
                samples[b].append(t)
            del cache
    return [SweepPoint(b, float(np.median(s)), (max(s) - min(s)) / 2, tuple(s)) for b, s in samples.items()]


@torch.no_grad()
def sweep_step_copies_cache(model, *, context_len: int = 4, batch: int = 2) -> bool:
    """Whether one decode step as :func:`decode_step_sweep` times it leaves every layer's keys and values in
    fresh storage, i.e. the cache grew by copying the cached positions with the new one (a read, a write and
    attention's read of the copy) rather than by appending in place."""
    from ..kv_cache import prefill
    check_positive_int("context_len", context_len)
    check_positive_int("batch", batch)
    from transformers import DynamicCache
    ids = torch.zeros((1, context_len), dtype=torch.long, device=model.device)
    base = DynamicCache(config=model.config)
    first = prefill(model, ids, base).argmax(-1)
    cache = _replicated_cache(model, [la.keys for la in base.layers], [la.values for la in base.layers], batch)
    before = [(la.keys.data_ptr(), la.values.data_ptr()) for la in cache.layers]
    old = [la.keys.clone() for la in cache.layers]
    model(first.expand(batch)[:, None], cache=cache, use_cache=True)
    grew = all(la.keys.shape[2] == context_len + 1 for la in cache.layers)
    kept = all(torch.equal(la.keys[:, :, :context_len], o) for la, o in zip(cache.layers, old))
    if not (grew and kept):
        raise RuntimeError("the decode step did not append one position to the cache")
    return all(la.keys.data_ptr() != k and la.values.data_ptr() != v for la, (k, v) in zip(cache.layers, before))


@dataclass(frozen=True)
class GridPoint:
    """One (cache format, batch size, context) of :func:`decode_step_grid`: the median seconds of one decode
    step over the rounds, half the range between rounds, and each round's seconds."""

    cache: str
    batch: int
    context: int
    step_s: float
    spread_s: float
    samples_s: tuple[float, ...] = ()


def _tiled(t: torch.Tensor, context: int) -> torch.Tensor:
    """(1, heads, n, head_dim) keys or values repeated along the tokens to ``context`` tokens."""
    reps = -(-context // t.shape[2])
    return t.repeat(1, 1, reps, 1)[:, :, :context]


@torch.no_grad()
def prefilled_layers(model, n_tokens: int, *, seed: int = 0):
    """Prefill one random sequence of ``n_tokens``; returns (its next token (1,), [(keys, values) per layer],
    each (1, kv_heads, n_tokens, head_dim)) for :func:`fill_cache`."""
    from transformers import DynamicCache

    from ..kv_cache import prefill
    check_positive_int("n_tokens", n_tokens)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, n_tokens), generator=gen).to(model.device)
    base = DynamicCache(config=model.config)
    first = prefill(model, ids, base).argmax(-1)
    return first, [(layer.keys, layer.values) for layer in base.layers]


def copied_requests(cache, batch: int):
    """A new cache of the same kind holding ``batch`` copies of ``cache``'s one request (``cache`` is left as it was):
    its stored numbers copied, nothing computed again. For a quantized cache, the same codes as filling ``batch``
    requests of those numbers (each request's groups are quantized on their own), without quantizing them again."""
    import copy
    check_positive_int("batch", batch)
    if any(layer.keys.shape[0] != 1 for layer in cache.layers if getattr(layer, "keys", None) is not None):
        raise ValueError("copied_requests needs a cache of one request")
    out = copy.deepcopy(cache)
    if batch > 1:
        out.batch_repeat_interleave(batch)
    return out


def fill_cache(cache, layers, batch: int, context: int):
    """Hand ``cache`` (empty, any format) ``batch`` requests of ``context`` tokens: the keys and values of
    ``layers`` repeated along the tokens and copied to every request. A step's cost and a cache's size do not
    depend on what the numbers are. Returns the cache."""
    check_positive_int("batch", batch)
    check_positive_int("context", context)
    for i, (k, v) in enumerate(layers):
        cache.update(_tiled(k, context).expand(batch, -1, -1, -1), _tiled(v, context).expand(batch, -1, -1, -1), i)
    return cache


@torch.no_grad()
def decode_step_grid(model, batch_sizes, contexts, *, caches: dict | None = None, max_tokens: int | None = None,
                     repeats: int = 3, steps_per_fill: int = 2, warmup_rounds: int = 1, device=None, seed: int = 0,
                     progress: bool = True) -> list[GridPoint]:
    """Time one decode step for every cache format, batch size B and context (tokens per request), chapter 10.

    ``caches``: ``{name: factory}``, each factory returning an empty transformers cache (default: one
    ``DynamicCache``, ``"float"``). ``max_tokens``: points whose B x context exceeds it are skipped (their
    cache would not fit). The keys and values of one prefilled sequence of ``min(contexts)`` tokens are
    repeated to each context (:func:`fill_cache`) and handed to a fresh cache of each format (so a quantized one stores
    them at its bits), once per format and context in a round, for one request; each batch size's cache is a fresh
    copy of it for every request (:func:`copied_requests`: the same numbers and codes as filling B requests, none
    quantized again). Every point is visited in turn, ``repeats`` rounds; in each, the freshly filled cache takes
    ``steps_per_fill`` timed steps, whose median is that round's sample. In the first ``warmup_rounds`` rounds a
    warm-up step comes before them (each shape's first step in the process); later rounds time a fill's first step
    straight away: with the embedded model on a 2-core Xeon, such a step, timed, was no slower than the next ones
    (over chapter 10's grid, the first step over the median of the next two in the second and third rounds: medians
    of 0.98-1.03 for each of its 8 weight and cache formats, 12 timings each, single ratios 0.79-1.18, as far apart
    as two timed steps of one fill), while a warm-up step in every round took a third of the grid's step time.
    A point's figure is the median of its rounds, its spread half their range, and its samples the rounds' medians.
    """
    from transformers import DynamicCache

    from ..measure import time_call, trim_heap
    sizes = _check_batch_sizes(batch_sizes)
    ctxs = _check_batch_sizes(contexts)
    check_positive_int("repeats", repeats)
    check_positive_int("steps_per_fill", steps_per_fill)
    check_non_negative_int("warmup_rounds", warmup_rounds)
    if max_tokens is not None:
        check_positive_int("max_tokens", max_tokens)
    caches = {"float": lambda: DynamicCache(config=model.config)} if caches is None else caches
    if not caches or not all(callable(f) for f in caches.values()):
        raise ValueError("caches must map a name to a function returning an empty cache")
    device = model.device if device is None else torch.device(device)
    first, layers = prefilled_layers(model, ctxs[0], seed=seed)
    points = [(name, b, c) for name in caches for c in ctxs for b in sizes if max_tokens is None or b * c <= max_tokens]
    if not points:
        raise ValueError(f"no batch size x context fits in max_tokens={max_tokens}")
    samples: dict[tuple, list[float]] = {p: [] for p in points}
    last_b = {(name, c): b for name, b, c in points}          # points come grouped by (format, context), B ascending
    for rnd in progress_bar(range(repeats), "decode-step grid", enabled=progress, unit="round"):
        warm = int(rnd < warmup_rounds)                        # a warm-up step first, in the first rounds only
        one = None                                             # this (format, context)'s one request, filled once
        for name, b, c in points:
            if one is None:
                one = fill_cache(caches[name](), layers, 1, c)
            if b == 1 and b == last_b[name, c]:
                cache = one                                    # its only point: the filled cache itself
            else:
                cache = copied_requests(one, b)                # B copies: a quantized cache's codes are not made again
            if b == last_b[name, c]:
                one = None
            step = lambda: model(first.expand(b)[:, None], cache=cache, use_cache=True)  # noqa: E731
            timed = []
            for k in range(warm + steps_per_fill):
                timed.append(time_call(step, warmup=0, repeats=1, device=device).samples_s[0])
                # each step copies the whole cache to append one token and frees the old copy; glibc keeps such
                # freed buffers, so without this the copies pile up (hundreds of MB at 8,192 tokens)
                trim_heap()
            samples[(name, b, c)].append(float(np.median(timed[warm:])))
            del cache
            trim_heap()                                         # before the next fill: the peak is at a fill
    return [GridPoint(name, b, c, float(np.median(s)), (max(s) - min(s)) / 2, tuple(s))
            for (name, b, c), s in samples.items()]
