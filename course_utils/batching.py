"""Chapter 04 -- batching: the batch-size sweep, its knee, and static vs continuous batching simulated.

* :func:`decode_step_sweep` measures one decode step for B requests that each hold a
  64-token cache; :func:`find_knee` finds where growing the batch stops paying, and
  :func:`doubling_gains` / :func:`knees_per_round` say how firmly, from the spread between rounds.
* :func:`decode_step_grid` times the same step over batch size, context and cache format (chapter 10).
* :func:`roofline_sweep` and :func:`roofline_crossover_batch` predict the same curve from
  chapter 02's two roofs (the machine's FLOP/s and bytes/s); :func:`decode_intensity` gives a
  step's FLOP per byte from a model's shape alone (for a reference model not loaded here).
* :func:`time_block_gather` measures what the engine's attention pays to copy every
  sequence's blocks into one contiguous tensor per layer.
* :class:`StepCost` turns the sweep into a per-step cost function of the batch size.
* :func:`syllabus_output_lengths` builds the chapter's workload (64 requests, median 18,
  longest 231, 1,874 output tokens); :func:`skewed_lengths` dials its skew.
* :func:`simulate` replays a workload under ``"static"`` or ``"continuous"`` batching and
  returns a :class:`Schedule` (who sat in which slot when, and when each was heard).

The real engine that runs the model this way lives in :mod:`course_utils.engine`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import plotly.graph_objects as go
import torch

from .engine import POLICIES, Sequence
from .progress import progress_bar
from .plots import PALETTE, TEMPLATE
from .validation import check_positive_int, check_positive_ints

# ---- the measured sweep ------------------------------------------------------------------------


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
    warm-up round, so machine noise hits them alike; each point is the median step.
    """
    from .kv_cache import prefill
    from .measure import time_call
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
        for b in sizes:
            cache = _replicated_cache(model, keys, values, b)
            step = lambda: model(first.expand(b)[:, None], cache=cache, use_cache=True)  # noqa: E731
            t = time_call(step, warmup=0, repeats=1, device=device).samples_s[0]
            if r:
                samples[b].append(t)
            del cache
    return [SweepPoint(b, float(np.median(s)), (max(s) - min(s)) / 2, tuple(s)) for b, s in samples.items()]


@dataclass(frozen=True)
class GridPoint:
    """One (cache format, batch size, context) of :func:`decode_step_grid`: the median seconds of one decode
    step, half the range between rounds, and each timed round's seconds."""

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

    from .kv_cache import prefill
    check_positive_int("n_tokens", n_tokens)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, n_tokens), generator=gen).to(model.device)
    base = DynamicCache(config=model.config)
    first = prefill(model, ids, base).argmax(-1)
    return first, [(layer.keys, layer.values) for layer in base.layers]


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
                     repeats: int = 3, device=None, seed: int = 0, progress: bool = True) -> list[GridPoint]:
    """Time one decode step for every cache format, batch size B and context (tokens per request), chapter 10.

    ``caches``: ``{name: factory}``, each factory returning an empty transformers cache (default: one
    ``DynamicCache``, ``"float"``). ``max_tokens``: points whose B x context exceeds it are skipped (their
    cache would not fit). The keys and values of one prefilled sequence of ``min(contexts)`` tokens are
    repeated to each context and copied to every request (:func:`fill_cache`), then handed to a fresh cache
    of each format (so a quantized one stores them at its bits). Every point is visited in turn, ``repeats``
    rounds after a warm-up round.
    """
    from transformers import DynamicCache

    from .measure import time_call
    sizes = _check_batch_sizes(batch_sizes)
    ctxs = _check_batch_sizes(contexts)
    check_positive_int("repeats", repeats)
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
    for r in progress_bar(range(repeats + 1), "decode-step grid (round 0 = warm-up)", enabled=progress, unit="round"):
        for name, b, c in points:
            cache = fill_cache(caches[name](), layers, b, c)
            step = lambda: model(first.expand(b)[:, None], cache=cache, use_cache=True)  # noqa: E731
            t = time_call(step, warmup=0, repeats=1, device=device).samples_s[0]
            if r:
                samples[(name, b, c)].append(t)
            del cache
    return [GridPoint(name, b, c, float(np.median(s)), (max(s) - min(s)) / 2, tuple(s))
            for (name, b, c), s in samples.items()]


def find_knee(batch_sizes: Sequence[int], tokens_per_s: Sequence[float], *, min_gain: float = 0.25) -> int | None:
    """The batch size after which every further doubling buys less than ``min_gain`` more throughput.

    Scanning from the largest batch down, the knee sits just after the last step up that
    still paid at least ``min_gain`` per doubling (a single noisy dip at small batches does
    not end the search). Gains between batch sizes that are not a doubling apart are scaled
    to one doubling (``ratio ** (1 / log2(B2 / B1))``). Returns None when even the largest
    step up still pays, i.e. there is no knee in the measured range.
    """
    sizes = _check_batch_sizes(batch_sizes)
    if len(sizes) != len(tokens_per_s) or len(sizes) < 2:
        raise ValueError("need one throughput per batch size, and at least two batch sizes")
    if any(not t > 0 for t in tokens_per_s):
        raise ValueError("throughputs must be positive")
    gains = [(t2 / t1) ** (1 / math.log2(b2 / b1)) - 1
             for b1, b2, t1, t2 in zip(sizes, sizes[1:], tokens_per_s, tokens_per_s[1:])]
    if gains[-1] >= min_gain:
        return None
    paid = [i for i, g in enumerate(gains) if g >= min_gain]
    return sizes[paid[-1] + 1] if paid else sizes[0]


@dataclass(frozen=True)
class DoublingGain:
    """Throughput gained from batch ``b1`` to ``b2``, per doubling of the batch: the median over
    the sweep's rounds and the lowest and highest round (0.5 = 50 % more tokens/s per doubling)."""

    b1: int
    b2: int
    median: float
    low: float
    high: float


def _gain_per_doubling(b1: int, b2: int, t1_s: float, t2_s: float) -> float:
    return ((b2 / t2_s) / (b1 / t1_s)) ** (1 / math.log2(b2 / b1)) - 1


def _rounds(points: Sequence[SweepPoint]) -> int:
    n = {len(p.samples_s) for p in points}
    if len(n) != 1 or not min(n):
        raise ValueError("every sweep point needs the same number of per-round samples (decode_step_sweep keeps them)")
    return n.pop()


def doubling_gains(points: Sequence[SweepPoint]) -> list[DoublingGain]:
    """The gain per doubling between consecutive batch sizes, round by round (rounds are interleaved,
    so round r of every batch size ran under the same conditions), summarised as median / low / high."""
    n = _rounds(points)
    out = []
    for p, q in zip(points, points[1:]):
        g = [_gain_per_doubling(p.batch, q.batch, p.samples_s[r], q.samples_s[r]) for r in range(n)]
        out.append(DoublingGain(p.batch, q.batch, float(np.median(g)), min(g), max(g)))
    return out


def knees_per_round(points: Sequence[SweepPoint], *, min_gain: float = 0.25) -> list[int | None]:
    """:func:`find_knee` applied to each timed round alone: how stable the knee is from round to round."""
    n = _rounds(points)
    b = [p.batch for p in points]
    return [find_knee(b, [p.batch / p.samples_s[r] for p in points], min_gain=min_gain) for r in range(n)]


# ---- the roofline's prediction ---------------------------------------------------------------------


@dataclass(frozen=True)
class RooflinePoint:
    """The roofline's floor for one decode step of ``batch`` sequences: its arithmetic at the compute
    roof and its bytes at the memory roof (seconds); the step takes at least the larger."""

    batch: int
    compute_s: float
    memory_s: float

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def roofline_sweep(model, batch_sizes, *, context_len: int, peak_flops: float,
                   bandwidth_Bps: float) -> list[RooflinePoint]:
    """The sweep as the roofline predicts it: for each B, :func:`~course_utils.prefill_decode.forward_flops`
    of one new token per sequence over ``context_len`` cached ones, and
    :func:`~course_utils.prefill_decode.decode_step_bytes` (weights once, every sequence's cache),
    against the two measured roofs (chapter 02)."""
    from .prefill_decode import decode_step_bytes, forward_flops, ridge_intensity

    ridge_intensity(peak_flops, bandwidth_Bps)                      # validates both roofs
    check_positive_int("context_len", context_len)
    return [RooflinePoint(b, forward_flops(model, 1, context_len, batch=b) / peak_flops,
                          decode_step_bytes(model, context_len, batch=b) / bandwidth_Bps)
            for b in _check_batch_sizes(batch_sizes)]


def roofline_crossover_batch(model, *, context_len: int, peak_flops: float, bandwidth_Bps: float,
                             max_batch: int = 1 << 16) -> int | None:
    """The smallest batch whose decode step the roofline calls compute-bound (arithmetic time >= memory
    time), or None if none up to ``max_batch`` is (the caches' bytes grow with B as fast as the FLOPs)."""
    def compute_bound(b: int) -> bool:
        p = roofline_sweep(model, [b], context_len=context_len, peak_flops=peak_flops, bandwidth_Bps=bandwidth_Bps)[0]
        return p.compute_s >= p.memory_s

    if not compute_bound(max_batch):
        return None
    lo, hi = 1, max_batch                     # compute time grows faster with B than memory time: bisect
    if compute_bound(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compute_bound(mid) else (mid, hi)
    return hi


def decode_intensity(dims, n_weights: int, *, bytes_per_weight: float, batch: int, context_len: int) -> float:
    """FLOP per byte of one decode step from a model's shape alone (chapter 02's roofline x axis).

    ``n_weights``: the weights the step multiplies (every matrix, the LM head included, once);
    ``dims``: a :class:`~course_utils.models.ModelDims`. FLOPs: 2 per weight per sequence plus the
    attention over ``context_len + 1`` positions; bytes: the weights once plus every sequence's
    keys and values, all at ``bytes_per_weight``. Norms, biases and activations are left out.
    """
    from .kv_cache import attention_macs

    check_positive_int("batch", batch)
    check_positive_int("n_weights", n_weights)
    flops = 2 * batch * (n_weights + attention_macs(1, context_len + 1, dims))
    moved = (n_weights + batch * context_len * dims.kv_elements_per_token) * bytes_per_weight
    return flops / moved


@dataclass(frozen=True)
class StepCost:
    """Seconds of one decode step as a function of the batch size, from measured points.

    Linear interpolation between the measured batch sizes, made non-decreasing (a larger
    batch never costs less than a smaller one: the dips are noise); below the smallest
    measured batch it is flat, beyond the largest it continues the last segment's slope.
    """

    batches: tuple[int, ...]
    step_s: tuple[float, ...]

    def __post_init__(self):
        _check_batch_sizes(self.batches)
        if len(self.batches) != len(self.step_s) or any(not s > 0 for s in self.step_s):
            raise ValueError("need one positive step time per batch size")

    @classmethod
    def from_sweep(cls, points: Sequence[SweepPoint]) -> "StepCost":
        return cls(tuple(p.batch for p in points), tuple(p.step_s for p in points))

    def __call__(self, batch: int) -> float:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        s = np.maximum.accumulate(np.asarray(self.step_s, dtype=float))
        b = np.asarray(self.batches, dtype=float)
        if batch <= b[-1] or len(b) == 1:
            return float(np.interp(batch, b, s))
        slope = max(0.0, (s[-1] - s[-2]) / (b[-1] - b[-2]))
        return float(s[-1] + slope * (batch - b[-1]))


# ---- the workload -------------------------------------------------------------------------------


def round_preserving_total(x: Sequence[float], total: int) -> np.ndarray:
    """Round non-negative reals to integers that sum exactly to ``total`` (largest remainders get +1)."""
    x = np.asarray(x, dtype=float)
    if np.any(x < 0) or not math.isclose(x.sum(), total, rel_tol=1e-9, abs_tol=1e-6):
        raise ValueError(f"need non-negative values summing to {total}, got sum {x.sum():.6g}")
    out = np.floor(x).astype(int)
    short = total - int(out.sum())
    out[np.argsort(-(x - out), kind="stable")[:short]] += 1
    return out


def _upper_tail(u: np.ndarray, median: float, longest: float, target: float) -> np.ndarray:
    """Map ``u`` in (0, 1) to ``median + (longest - median) * u ** q``, with q chosen so they sum to ``target``."""
    lo, hi = 1e-3, 1e3                                          # the shape exponent: larger -> smaller sum
    for _ in range(200):
        q = math.sqrt(lo * hi)
        if (median + (longest - median) * u ** q).sum() > target:
            lo = q
        else:
            hi = q
    return median + (longest - median) * u ** math.sqrt(lo * hi)


def syllabus_output_lengths(n: int = 64, *, median: int = 18, longest: int = 231, total: int = 1874,
                            seed: int = 0, sigma: float = 1.0) -> np.ndarray:
    """Output lengths of ``n`` requests, in queue order: a seeded log-normal draw, adjusted to the targets.

    The draw's order and ranks are kept; the lower half is scaled so its top sits at the
    median, the upper half is bent (a power curve, chosen by bisection) to run from the
    median to ``longest`` and make the total come out exactly. The two middle requests are
    set to ``median``. Raises ``ValueError`` when the targets cannot be met.
    """
    if n < 4 or n % 2 or not 1 <= median < longest or total <= median * n // 2 + longest:
        raise ValueError(f"cannot build {n} lengths with median {median}, longest {longest}, total {total}")
    raw = np.random.default_rng(seed).lognormal(0.0, sigma, n)
    order = np.argsort(raw, kind="stable")
    s = raw[order]
    half, mid = n // 2, (s[n // 2 - 1] + s[n // 2]) / 2
    lower = np.maximum(1.0, median * s[:half - 1] / mid)
    rest = total - lower.round().sum() - 2 * median - longest
    if not median * (half - 1) < rest < longest * (half - 1):
        raise ValueError("the lower half leaves a total the upper half cannot reach")
    upper = _upper_tail((s[half + 1:n - 1] - mid) / (s[-1] - mid), median, longest, rest)
    lengths = np.concatenate([lower.round(), [median, median], round_preserving_total(upper, round(rest)), [longest]])
    lengths = np.clip(lengths, 1, longest).astype(int)
    out = np.empty(n, dtype=int)
    out[order] = lengths
    return out


def skewed_lengths(base: Sequence[int], skew: float) -> np.ndarray:
    """Blend ``base`` with equal lengths: skew 0 -> all (nearly) equal, 1 -> ``base``; the total is kept."""
    base = np.asarray(base)
    if base.ndim != 1 or len(base) == 0 or np.any(base < 1):
        raise ValueError("base must be a non-empty list of lengths >= 1")
    if not 0.0 <= skew <= 1.0:
        raise ValueError(f"skew must lie in [0, 1], got {skew!r}")
    total = int(base.sum())
    mixed = (1 - skew) * total / len(base) + skew * base
    return np.maximum(1, round_preserving_total(mixed, total))


# ---- the simulator ------------------------------------------------------------------------------



@dataclass(frozen=True)
class Span:
    """One request in the simulation: its slot, when it was admitted, its last token, when it was heard (s)."""

    request: int
    slot: int
    start_s: float
    end_s: float
    heard_s: float


@dataclass(frozen=True)
class Schedule:
    """The result of :func:`simulate`; every request arrived at t = 0."""

    policy: str
    slots: int
    spans: tuple[Span, ...]
    tokens: int
    n_steps: int

    @property
    def makespan_s(self) -> float:
        return max(s.heard_s for s in self.spans)

    @property
    def throughput_tok_s(self) -> float:
        return self.tokens / self.makespan_s

    @property
    def latencies_s(self) -> np.ndarray:
        """Seconds from arrival (t = 0) until each request is heard: what a user waits."""
        return np.array([s.heard_s for s in sorted(self.spans, key=lambda s: s.request)])

    @property
    def mean_latency_s(self) -> float:
        return float(self.latencies_s.mean())

    @property
    def p95_latency_s(self) -> float:
        return float(np.percentile(self.latencies_s, 95))

    @property
    def latencies_from_admission_s(self) -> np.ndarray:
        """Seconds from getting a slot (a static batch's start) until each request is heard: the queue left out."""
        return np.array([s.heard_s - s.start_s for s in sorted(self.spans, key=lambda s: s.request)])

    @property
    def mean_latency_from_admission_s(self) -> float:
        return float(self.latencies_from_admission_s.mean())

    @property
    def p95_latency_from_admission_s(self) -> float:
        return float(np.percentile(self.latencies_from_admission_s, 95))

    @property
    def generating_s(self) -> np.ndarray:
        """Seconds from getting a slot until each request's own last token (whether heard then or not)."""
        return np.array([s.end_s - s.start_s for s in sorted(self.spans, key=lambda s: s.request)])

    @property
    def padding_share(self) -> float:
        """Share of the slot time held by requests that were done but not yet heard (static batching's
        padding): sum(heard - end) / sum(heard - start); 0 under continuous batching."""
        held = sum(s.heard_s - s.start_s for s in self.spans)
        return sum(s.heard_s - s.end_s for s in self.spans) / held if held > 0 else 0.0


def _check_workload(lengths, slots: int) -> list[int]:
    lengths = [int(x) for x in lengths]
    if not lengths or min(lengths) < 1:
        raise ValueError("lengths must be a non-empty list of output lengths >= 1")
    check_positive_int("slots", int(slots) if isinstance(slots, np.integer) else slots)
    return lengths


def _simulate_static(lengths: list[int], slots: int, step_cost: Callable[[int], float], padding: bool) -> Schedule:
    spans, t, n_steps = [], 0.0, 0
    for first in range(0, len(lengths), slots):
        batch = lengths[first:first + slots]
        start, ends = t, []
        for step in range(max(batch)):
            active = len(batch) if padding else sum(1 for n in batch if n > step)
            t += step_cost(active)
            ends.append(t)
        n_steps += max(batch)
        spans += [Span(first + j, j, start, ends[n - 1], t) for j, n in enumerate(batch)]
    return Schedule("static", slots, tuple(spans), sum(lengths), n_steps)


def _simulate_continuous(lengths: list[int], slots: int, step_cost: Callable[[int], float]) -> Schedule:
    queue, free, active = list(range(len(lengths))), list(range(slots)), {}
    left, start, spans, t, n_steps = list(lengths), {}, [], 0.0, 0
    while queue or active:
        while queue and free:                                      # a free slot takes the next request at once
            r = queue.pop(0)
            active[r] = free.pop(0)
            start[r] = t
        t += step_cost(len(active))
        n_steps += 1
        for r in list(active):
            left[r] -= 1
            if left[r] == 0:
                spans.append(Span(r, active[r], start[r], t, t))
                free.append(active.pop(r))
        free.sort()
    return Schedule("continuous", slots, tuple(sorted(spans, key=lambda s: s.request)), sum(lengths), n_steps)


def simulate(lengths: Sequence[int], slots: int, policy: str, step_cost: Callable[[int], float], *,
             static_padding: bool = True) -> Schedule:
    """Replay requests (all queued at t = 0, in order) through ``slots`` slots; one token per request per step.

    ``static``: take the next ``slots`` requests, run until the longest is done; a request is
    heard when its whole batch finishes. With ``static_padding`` (what ``generate`` does)
    finished requests keep being computed, so each step costs ``step_cost(batch size)``.
    ``continuous``: a slot that frees up takes the next request in the following step; a
    request is heard when its own last token is produced. Each step costs
    ``step_cost(requests in slots)`` seconds. Prefill is not modelled.
    """
    lengths = _check_workload(lengths, slots)
    if policy == "static":
        return _simulate_static(lengths, slots, step_cost, static_padding)
    if policy == "continuous":
        return _simulate_continuous(lengths, slots, step_cost)
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


# ---- figures --------------------------------------------------------------------------------------


def sweep_figure(points: Sequence[SweepPoint], knee: int | None,
                 roofline: Sequence[RooflinePoint] | None = None) -> go.Figure:
    """Throughput and per-request latency against the batch size, the knee marked; with ``roofline``
    (the same batch sizes), the roofline's bound beside each measured curve, dashed."""
    from plotly.subplots import make_subplots
    b = [p.batch for p in points]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("throughput", "per-request latency of one step"))
    fig.add_scatter(x=b, y=[p.tokens_per_s for p in points], name="tokens/s, measured", mode="lines+markers",
                    line_color=PALETTE[0], row=1, col=1)
    fig.add_scatter(x=b, y=[p.latency_s * 1e3 for p in points], name="ms per step, measured", mode="lines+markers",
                    line_color=PALETTE[1], row=1, col=2,
                    error_y=dict(type="data", array=[p.spread_s * 1e3 for p in points], visible=True))
    if roofline is not None:
        if [r.batch for r in roofline] != b:
            raise ValueError("the roofline points must have the sweep's batch sizes")
        fig.add_scatter(x=b, y=[r.tokens_per_s for r in roofline], name="tokens/s, roofline bound",
                        mode="lines", line=dict(color=PALETTE[0], dash="dash"), row=1, col=1)
        fig.add_scatter(x=b, y=[r.step_s * 1e3 for r in roofline], name="ms per step, roofline floor",
                        mode="lines", line=dict(color=PALETTE[1], dash="dash"), row=1, col=2)
    if knee is not None:
        for col in (1, 2):
            fig.add_vline(x=knee, line_dash="dot", line_color=PALETTE[5], row=1, col=col)
    first, last = points[0], points[-1]
    title = (f"{last.batch / first.batch:.0f}x the requests bring {last.tokens_per_s / first.tokens_per_s:.1f}x "
             f"the throughput and {last.step_s / first.step_s:.1f}x the latency"
             + (f"; knee at B = {knee}" if knee else "; no knee in this range"))
    fig.update_layout(template=TEMPLATE, title=title, height=440, hovermode="closest",
                      legend=dict(orientation="h", x=0, xanchor="left", y=-0.22, yanchor="top"), margin=dict(b=110))
    fig.update_xaxes(type="log", title="batch size B (requests)", tickvals=b)
    fig.update_yaxes(title="tokens/s", row=1, col=1)
    fig.update_yaxes(title="ms per step", row=1, col=2)
    return fig


def gantt_figure(static: Schedule, continuous: Schedule) -> go.Figure:
    """Slot occupancy over time under both policies; the same traces whatever the inputs (for widgets)."""
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=(f"static: done at {static.makespan_s:.1f} s",
                                        f"continuous: done at {continuous.makespan_s:.1f} s"))
    for row, sched in ((1, static), (2, continuous)):
        spans = sched.spans
        colours = [PALETTE[0] if s.request % 2 else PALETTE[4] for s in spans]
        fig.add_bar(y=[s.slot for s in spans], x=[s.end_s - s.start_s for s in spans], base=[s.start_s for s in spans],
                    orientation="h", marker=dict(color=colours, line=dict(color="white", width=0.5)),
                    name="generating", legendgroup="gen", showlegend=row == 1,
                    customdata=[[s.request, s.end_s - s.start_s, s.heard_s] for s in spans],
                    hovertemplate="request %{customdata[0]}<br>generating %{customdata[1]:.2f} s"
                                  "<br>heard at %{customdata[2]:.2f} s<extra></extra>", row=row, col=1)
        fig.add_bar(y=[s.slot for s in spans], x=[s.heard_s - s.end_s for s in spans], base=[s.end_s for s in spans],
                    orientation="h", marker=dict(color=PALETTE[1], opacity=0.55), name="done, waiting for its batch",
                    legendgroup="wait", showlegend=row == 1, hoverinfo="skip", row=row, col=1)
    speedup = continuous.throughput_tok_s / static.throughput_tok_s
    latency = static.mean_latency_s / continuous.mean_latency_s
    fig.update_layout(template=TEMPLATE, barmode="overlay", height=560, hovermode="closest",
                      legend=dict(orientation="h", x=0, xanchor="left", y=-0.16, yanchor="top"),
                      margin=dict(b=110),
                      title=f"{static.slots} slots: continuous batching gives {speedup:.2f}x the throughput "
                            f"and {latency:.1f}x lower mean latency")
    fig.update_yaxes(title="slot", autorange="reversed")
    fig.update_xaxes(title="time since all requests arrived (s)", row=2, col=1)
    return fig


def policy_gantt(lengths: Sequence[int], slots: int, skew: float, step_cost: Callable[[int], float]) -> go.Figure:
    """The widget's pure function: skew the workload, simulate both policies, draw the Gantt chart."""
    work = skewed_lengths(lengths, skew)
    return gantt_figure(simulate(work, slots, "static", step_cost), simulate(work, slots, "continuous", step_cost))


# ---- memory of the paged layout -------------------------------------------------------------------


def paged_kv_bytes(seq_lens: Sequence[int], block_size: int, kv_bytes_per_token: int) -> int:
    """Bytes of K/V blocks that sequences of these lengths occupy (whole blocks, no sharing)."""
    if block_size < 1 or kv_bytes_per_token < 1 or any(n < 0 for n in seq_lens):
        raise ValueError("need block_size >= 1, kv_bytes_per_token >= 1 and lengths >= 0")
    return sum(math.ceil(n / block_size) for n in seq_lens) * block_size * kv_bytes_per_token


def reserved_kv_bytes(n_seqs: int, max_context: int, kv_bytes_per_token: int) -> int:
    """Bytes a server that reserves ``max_context`` positions per slot sets aside for ``n_seqs`` slots."""
    if n_seqs < 0 or max_context < 1 or kv_bytes_per_token < 1:
        raise ValueError("need n_seqs >= 0, max_context >= 1 and kv_bytes_per_token >= 1")
    return n_seqs * max_context * kv_bytes_per_token


# ---- measured with the engine ------------------------------------------------------------------------


def pool_blocks(prompt_lens: Sequence[int], max_tokens: Sequence[int], *, block_size: int, slots: int) -> int:
    """Blocks enough for ``slots`` requests of the longest prompt + output at once (no preemption),
    plus one spare block per slot."""
    if not prompt_lens or len(prompt_lens) != len(max_tokens):
        raise ValueError("need one output length per prompt, and at least one prompt")
    check_positive_int("block_size", block_size)
    check_positive_int("slots", slots)
    longest = max(prompt_lens) + max(int(n) for n in max_tokens)
    return slots * math.ceil(longest / block_size) + slots


def schedule_from_engine(engine, seqs, policy: str) -> Schedule:
    """A :class:`Schedule` of a finished engine run (times from the first arrival): same summaries, same Gantt chart.

    The engine records when each request's last token came out; under ``"static"`` a request
    is heard when the last member of its batch (same ``batch_id``) finishes.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    seqs = [s for s in seqs if isinstance(s, Sequence)]          # leave out refused requests
    if not seqs or any(s.finish_s is None for s in seqs):
        raise ValueError("every sequence must have finished")
    t0 = min(s.arrival_s for s in seqs)
    batch_end: dict[int, float] = {}
    for s in seqs:
        batch_end[s.batch_id] = max(batch_end.get(s.batch_id, 0.0), s.finish_s)
    spans = tuple(Span(i, s.spans[-1][0], s.spans[-1][1] - t0, s.finish_s - t0,
                       (batch_end[s.batch_id] if policy == "static" else s.finish_s) - t0)
                  for i, s in enumerate(seqs))
    decode_steps = sum(1 for st in engine.steps if not st.is_prefill)
    return Schedule(policy, engine.scheduler.max_num_seqs, spans, sum(s.num_output_tokens for s in seqs), decode_steps)


def run_engine_workload(model, prompts: list[list[int]], lengths: Sequence[int], *, policy: str, slots: int,
                        block_size: int = 16, dtype=None, weights=None, progress: bool = True):
    """Run requests (all queued at once) through a fresh engine; ``lengths`` are their exact output lengths.

    EOS is ignored so each request produces exactly its length, as in the simulation;
    prefix caching is off so no request borrows another's work. ``weights``: shared
    :class:`~course_utils.engine.RunnerWeights` (None = fuse a fresh copy). Returns ``(engine, seqs)``.
    """
    from .engine import LLMEngine
    if len(prompts) != len(lengths):
        raise ValueError(f"got {len(prompts)} prompts for {len(lengths)} lengths")
    blocks = pool_blocks([len(p) for p in prompts], lengths, block_size=block_size, slots=slots)
    engine = LLMEngine(model, num_blocks=blocks, block_size=block_size, max_num_seqs=slots, policy=policy,
                       prefix_caching=False, dtype=dtype, weights=weights)
    seqs = engine.generate(prompts, [int(n) for n in lengths], ignore_eos=True, progress=progress)
    return engine, seqs


# ---- what the gather of blocks costs ---------------------------------------------------------------------

@dataclass(frozen=True)
class GatherCost:
    """One decode step of the engine's runner and, timed interleaved with it, the block gathers alone.

    ``copied_bytes``: what the gathers copy per step (every sequence's keys and values, all
    layers, whole blocks); a paged-attention kernel reads the same bytes in place and copies none.
    """

    batch: int
    context_len: int
    step_s: float
    gather_s: float
    copied_bytes: int

    @property
    def share(self) -> float:
        """The gathers' share of the step."""
        return self.gather_s / self.step_s


@torch.no_grad()
def time_block_gather(model, *, batch: int, context_len: int, block_size: int = 16, weights=None,
                      repeats: int = 5, seed: int = 0) -> GatherCost:
    """Time a decode step of ``batch`` sequences holding ``context_len`` cached positions each, and the
    per-layer gathers of their blocks (``index_select`` of keys and values, every layer) on their own.

    The sequences' blocks are scattered over the pool in a random order, as a busy paged cache leaves
    them; their keys and values are zeros (what is gathered does not change what gathering costs).
    """
    from .engine import ModelRunner
    from .measure import time_interleaved
    check_positive_int("batch", batch)
    check_positive_int("context_len", context_len)
    per_seq = math.ceil((context_len + 1) / block_size)
    runner = ModelRunner(model, num_blocks=batch * per_seq, block_size=block_size, weights=weights)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(batch * per_seq, generator=gen).tolist()
    seqs = []
    for i in range(batch):
        ids = torch.randint(0, runner.embed.shape[0], (context_len + 1,), generator=gen).tolist()
        seq = Sequence(i, ids, 1, block_size=block_size)
        seq.block_table = order[i * per_seq:(i + 1) * per_seq]
        seqs.append(seq)
    inp = runner.prepare(seqs, is_prefill=False)
    tables = inp.block_tables.view(-1)

    def gathers():
        return [(runner.k_blocks[i].index_select(0, tables), runner.v_blocks[i].index_select(0, tables))
                for i in range(len(runner.layers))]

    t = time_interleaved({"step": lambda: runner.forward(inp), "gather": gathers}, warmup=1, repeats=repeats,
                         device=runner.device)
    copied = 2 * len(runner.layers) * tables.numel() * runner.k_blocks[0].shape[1] * runner.k_pool.element_size()
    return GatherCost(batch, context_len, t["step"].median_s, t["gather"].median_s, copied)


# ---- looking inside the paged cache ---------------------------------------------------------------------

@dataclass(frozen=True)
class SharingSummary:
    """Blocks named by live block tables vs blocks actually held: the difference is what sharing saved."""

    block_references: int
    distinct_blocks: int

    @property
    def blocks_saved(self) -> int:
        return self.block_references - self.distinct_blocks


def sharing_summary(block_tables: dict[int, list[int]]) -> SharingSummary:
    """Count references and distinct blocks over ``{sequence id: block table}``."""
    refs = [b for table in block_tables.values() for b in table]
    return SharingSummary(len(refs), len(set(refs)))


def block_map_figure(block_tables: dict[int, list[int]], num_blocks: int) -> go.Figure:
    """Which pool block each live sequence uses: one row per sequence; a column hit by several rows is shared."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    users: dict[int, int] = {}
    for table in block_tables.values():
        for b in table:
            users[b] = users.get(b, 0) + 1
    xs, ys, colours, text = [], [], [], []
    for seq_id, table in block_tables.items():
        for pos, b in enumerate(table):
            xs.append(b)
            ys.append(f"seq {seq_id}")
            colours.append(PALETTE[5] if users[b] > 1 else PALETTE[0])
            text.append(f"block {b} = block {pos} of seq {seq_id}; used by {users[b]} sequence(s)")
    summary = sharing_summary(block_tables)
    fig = go.Figure(go.Scatter(x=xs, y=ys, mode="markers", marker=dict(symbol="square", size=11, color=colours),
                               text=text, hoverinfo="text", showlegend=False))
    fig.add_scatter(x=[None], y=[None], mode="markers", marker=dict(symbol="square", color=PALETTE[5]),
                    name="shared block")
    fig.add_scatter(x=[None], y=[None], mode="markers", marker=dict(symbol="square", color=PALETTE[0]),
                    name="private block")
    fig.update_layout(template=TEMPLATE, height=120 + 28 * len(block_tables), hovermode="closest",
                      title=f"{len(block_tables)} sequences name {summary.block_references} blocks but hold "
                            f"{summary.distinct_blocks}: sharing saves {summary.blocks_saved}")
    fig.update_xaxes(title="physical block id in the pool", range=[-1, num_blocks])
    fig.update_yaxes(title="sequence", autorange="reversed")
    return fig
