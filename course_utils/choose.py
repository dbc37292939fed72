"""Putting it together (chapter 10): the one memory sum, and a configuration chooser.

Memory is one sum: weights + KV cache (total resident tokens, over every concurrent request) + the
runtime's overhead. A configuration is chosen in a fixed order: the quality bound first (a configuration
passes only when its KL divergence to the reference *plus two standard errors* stays under it), then the
memory budget (the sum must fit), then the speed target (the decode step measured for its weights' dtype,
its cache format, its batch size and its context); among what is left, the one with the highest total
throughput. Speculative decoding is judged last, by what it measured on this machine: accepted tokens per
verification pass and wall time, not acceptance alone.

Every figure the chooser uses is measured (chapters 04, 07 and 08, or recomputed cheaply in chapter 10):
step times come from :func:`course_utils.batching.decode_step_grid` and are interpolated between the
contexts it timed, never beyond them (:class:`StepTimes`). A format this process does not hold at its
bits (weights fake-quantized in float, chapter 05) is marked ``held=False``: its memory is what the format
*would* take, its speed that of the dtype it computes in here. Nothing here times anything itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .memory_sizing import kv_cache_bytes
from .validation import check_positive_int

#: The order in which a configuration's constraints are checked (and its first failure reported).
CONSTRAINTS = ("quality", "memory", "speed")


@dataclass(frozen=True)
class WeightOption:
    """A weight format with its measured quality.

    ``proj_bits``: bits per projection weight (scales included); ``rest_bits``: bits of every other
    parameter (embeddings, norms, the LM head) as measured; ``kld``/``kld_se``: mean KL divergence to
    the reference (nats per token) ± its standard error; ``same_top``: share of positions with the
    reference's top token; ``speed_dtype``: whose measured step times apply (a format without a faster
    kernel here runs at the speed of the dtype it computes in); ``held``: whether this process holds the
    weights at these bits (False for a format simulated in float: its size is what the format would take).
    """
    name: str
    proj_bits: float
    rest_bits: float
    kld: float
    kld_se: float = 0.0
    same_top: float = 1.0
    speed_dtype: str = "float32"
    held: bool = True

    def nbytes(self, n_proj: int, n_rest: int) -> float:
        return (n_proj * self.proj_bits + n_rest * self.rest_bits) / 8


@dataclass(frozen=True)
class KVOption:
    """A KV-cache format: bits per cached number as held, and its measured quality (as :class:`WeightOption`).

    ``timing``: the name its decode steps were timed under (a cache name of :class:`StepTimes`); ``dtype``:
    for a plain float cache, the weights' dtype it goes with (a model keeps its cache in its own dtype), None
    for a format that goes with any; ``held``: as for :class:`WeightOption`.
    """
    name: str
    bits: float
    kld: float
    kld_se: float = 0.0
    same_top: float = 1.0
    timing: str = "float"
    dtype: str | None = None
    held: bool = True


@dataclass(frozen=True)
class MemoryTerms:
    """The one sum, in bytes."""
    weights: float
    kv_cache: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.overhead


def memory_terms(weights: WeightOption, kv: KVOption, config, *, n_proj: int, n_rest: int, resident_tokens: int,
                 overhead_bytes: float = 0.0) -> MemoryTerms:
    """Weights + KV cache of ``resident_tokens`` (all requests together) + ``overhead_bytes``."""
    check_positive_int("resident_tokens", resident_tokens)
    if overhead_bytes < 0:
        raise ValueError(f"overhead_bytes must be >= 0, got {overhead_bytes}")
    return MemoryTerms(weights.nbytes(n_proj, n_rest), float(kv_cache_bytes(config, resident_tokens, kv.bits)),
                       float(overhead_bytes))


def agrees(measured: float, expected: float, *, rel_tol: float) -> bool:
    """Whether a measured byte count is within ``rel_tol`` (a fraction) of the one a formula expects."""
    if not expected > 0 or not 0 < rel_tol < 1:
        raise ValueError(f"need expected > 0 and 0 < rel_tol < 1, got {expected} and {rel_tol}")
    return abs(measured - expected) <= rel_tol * expected


class StepTimes:
    """Measured seconds per decode step, ``{dtype: [GridPoint, ...]}`` (:func:`course_utils.batching.decode_step_grid`),
    looked up by (dtype, cache format, batch size, context).

    Between two timed contexts of the same (dtype, format, batch) the step time, its spread and its range
    (fastest and slowest round, :meth:`range_at`) are interpolated linearly (a step reads every resident token
    once, so its cost is close to linear in the context); outside the timed range nothing is claimed
    (:meth:`at` returns None).
    """

    def __init__(self, points: dict):
        if not isinstance(points, dict) or not points:
            raise ValueError("points must map a dtype name to the GridPoints timed for it")
        # (dtype, cache, batch) -> [(context, step, spread, fastest round, slowest round)], by context
        self.table: dict[tuple[str, str, int], list[tuple[int, float, float, float, float]]] = {}
        for dtype, pts in points.items():
            if not pts:
                raise ValueError(f"no timed points for {dtype!r}")
            for p in pts:
                if not (p.step_s > 0 and p.spread_s >= 0):
                    raise ValueError(f"{dtype} {p.cache} B={p.batch} context={p.context}: a step must take > 0 s "
                                     f"with a spread >= 0, got {p.step_s} ± {p.spread_s}")
                # the rounds' fastest and slowest where they were kept, else median -/+ spread (never below 0)
                low, high = ((min(p.samples_s), max(p.samples_s)) if p.samples_s else
                             (p.step_s - p.spread_s if p.step_s > p.spread_s else 0.0, p.step_s + p.spread_s))
                self.table.setdefault((str(dtype), p.cache, p.batch), []).append(
                    (p.context, p.step_s, p.spread_s, low, high))
        for rows in self.table.values():
            rows.sort()
            if len({row[0] for row in rows}) != len(rows):
                raise ValueError("a (dtype, cache, batch, context) was timed twice")

    def batches(self, dtype: str, cache: str) -> list[int]:
        return sorted(b for d, c, b in self.table if d == dtype and c == cache)

    def contexts(self, dtype: str, cache: str, batch: int) -> list[int]:
        return [row[0] for row in self.table.get((dtype, cache, batch), [])]

    def _interp(self, key: tuple[str, str, int], context: int, columns: tuple[int, int]) -> tuple[float, float] | None:
        """Two columns of ``key``'s rows interpolated at ``context``, or None outside the contexts timed."""
        rows = self.table.get(key)
        if not rows or not rows[0][0] <= context <= rows[-1][0]:
            return None
        ctx = [row[0] for row in rows]
        a, b = columns
        return (float(np.interp(context, ctx, [row[a] for row in rows])),
                float(np.interp(context, ctx, [row[b] for row in rows])))

    def at(self, dtype: str, cache: str, batch: int, context: int) -> tuple[float, float] | None:
        """(seconds per step, spread) at ``context`` tokens per request, or None where it was not timed."""
        return self._interp((dtype, cache, batch), context, (1, 2))

    def range_at(self, dtype: str, cache: str, batch: int, context: int) -> tuple[float, float] | None:
        """(fastest, slowest) seconds per step over the timed rounds at ``context``, or None where not timed."""
        return self._interp((dtype, cache, batch), context, (3, 4))


def disturbed(step_s: float, spread_s: float) -> bool:
    """Whether a timed step's rounds spread by more than a quarter of the step either way (half their range
    ``spread_s`` > 0.25 x ``step_s``): a disturbed measurement, not a property of what was timed."""
    return spread_s > 0.25 * step_s


@dataclass(frozen=True)
class Candidate:
    """One configuration, its figures, and the constraints it fails (in :data:`CONSTRAINTS` order).

    ``step_s`` / ``step_spread_s`` are None when its decode step was not timed at its context; ``step_range_s``
    is the (fastest, slowest) round there."""
    weights: WeightOption
    kv: KVOption
    batch: int
    memory: MemoryTerms
    kld: float                      # weights' + KV's measured KL divergence (the estimate of both at once)
    kld_se: float                   # weights' se + KV's se (an upper bound, whatever their correlation)
    step_s: float | None
    step_spread_s: float | None = None
    fails: tuple[str, ...] = field(default=())
    step_range_s: tuple[float, float] | None = None

    @property
    def kld_upper(self) -> float:
        """The estimate plus two standard errors: what the quality bound is applied to."""
        return self.kld + 2 * self.kld_se

    @property
    def timed(self) -> bool:
        return self.step_s is not None

    @property
    def held(self) -> bool:
        """Whether this process holds both its weights and its cache at the bits its memory counts."""
        return self.weights.held and self.kv.held

    @property
    def tokens_per_s(self) -> float:
        """All users together (nan where the step was not timed)."""
        return self.batch / self.step_s if self.timed else math.nan

    @property
    def tokens_per_s_range(self) -> tuple[float, float]:
        """Total throughput at the slowest and at the fastest timed round (median -/+ spread where the rounds were
        not kept; a spread as large as the step leaves the fast end unbounded: inf)."""
        if not self.timed:
            return math.nan, math.nan
        if self.step_range_s is not None:
            fast, slow = self.step_range_s
        else:
            fast, slow = self.step_s - self.step_spread_s, self.step_s + self.step_spread_s
        return self.batch / slow, (self.batch / fast if fast > 0 else math.inf)

    @property
    def noisy(self) -> bool:
        """Whether its step's timing is :func:`disturbed`: rerun it, rather than read it as a property of the
        configuration."""
        return self.timed and disturbed(self.step_s, self.step_spread_s or 0.0)

    @property
    def user_tokens_per_s(self) -> float:
        return 1.0 / self.step_s if self.timed else math.nan

    @property
    def ok(self) -> bool:
        return not self.fails

    @property
    def label(self) -> str:
        return f"{self.weights.name} weights · {self.kv.name} cache · B = {self.batch}"


def candidates(weights: list[WeightOption], kvs: list[KVOption], steps: StepTimes, config, *, n_proj: int,
               n_rest: int, context: int, budget_bytes: float, kld_bound: float, min_user_tokens_per_s: float = 0.0,
               overhead_bytes: float = 0.0, working_bytes_per_request: float = 0.0) -> list[Candidate]:
    """Every (weights, KV, batch) with its figures and failed constraints.

    ``steps``: the measured step times; the batch sizes timed for a weight option's ``speed_dtype`` and a
    cache's ``timing`` are the ones considered, and a configuration whose context lies outside the contexts
    timed for it fails ``"speed"`` (nothing is claimed there). ``context``: tokens each request holds, so a
    batch of B keeps B · context tokens resident. The memory's overhead is ``overhead_bytes`` +
    B · ``working_bytes_per_request`` (the runtime, and working memory that grows with the batch).
    Quality fails when the estimate + 2 se exceeds ``kld_bound``; speed fails when the slowest timed round
    (:meth:`StepTimes.range_at`) gives each user fewer than ``min_user_tokens_per_s`` tokens/s — both
    constraints are applied to the unfavourable end of what was measured.
    """
    check_positive_int("context", context)
    if not budget_bytes > 0:
        raise ValueError(f"the memory budget must be > 0 bytes, got {budget_bytes}")
    if not kld_bound >= 0:
        raise ValueError(f"the quality bound must be a KL divergence >= 0 nats per token, got {kld_bound}")
    if min_user_tokens_per_s < 0:
        raise ValueError(f"the speed target must be >= 0 tokens/s, got {min_user_tokens_per_s}")
    if overhead_bytes < 0 or working_bytes_per_request < 0:
        raise ValueError(f"overheads must be >= 0 bytes, got {overhead_bytes} and {working_bytes_per_request}")
    if not weights or not kvs:
        raise ValueError("give at least one weight option and one KV option")
    if not isinstance(steps, StepTimes):
        raise TypeError(f"steps must be a StepTimes, got {type(steps).__name__}")
    out = []
    for w in weights:
        for kv in kvs:
            if kv.dtype is not None and kv.dtype != w.speed_dtype:
                continue                                    # a float cache is kept in the model's own dtype
            batches = steps.batches(w.speed_dtype, kv.timing)
            if not batches:
                raise ValueError(f"{w.name} with {kv.name}: no step times for ({w.speed_dtype!r}, {kv.timing!r})")
            for b in batches:
                mem = memory_terms(w, kv, config, n_proj=n_proj, n_rest=n_rest, resident_tokens=b * context,
                                   overhead_bytes=overhead_bytes + b * working_bytes_per_request)
                timed = steps.at(w.speed_dtype, kv.timing, b, context)
                s, spread = timed if timed else (None, None)
                rng = steps.range_at(w.speed_dtype, kv.timing, b, context) if timed else None
                kld, se = w.kld + kv.kld, w.kld_se + kv.kld_se
                fails = tuple(name for name, bad in (
                    ("quality", kld + 2 * se > kld_bound), ("memory", mem.total > budget_bytes),
                    ("speed", s is None or 1.0 / rng[1] < min_user_tokens_per_s)) if bad)
                out.append(Candidate(w, kv, b, mem, kld, se, s, spread, fails, rng))
    return out


def best(cands: list[Candidate]) -> Candidate | None:
    """The configuration meeting every constraint with the highest total throughput (then the least memory,
    then the lowest KL divergence), or None when none meets them all."""
    ok = [c for c in cands if c.ok]
    return max(ok, key=lambda c: (c.tokens_per_s, -c.memory.total, -c.kld)) if ok else None


def rivals(cands: list[Candidate], pick: Candidate) -> list[Candidate]:
    """The other configurations meeting every constraint whose throughput range (from their step's spread)
    overlaps the pick's: among them, the timing does not decide."""
    lo, _ = pick.tokens_per_s_range
    return [c for c in cands if c.ok and c is not pick and c.tokens_per_s_range[1] >= lo]


def smallest_memory(cands: list[Candidate]) -> float:
    """The least memory any configuration needs (bytes): below it, no budget can pass anything."""
    if not cands:
        raise ValueError("no configurations")
    return min(c.memory.total for c in cands)


def first_failures(cands: list[Candidate]) -> dict[str, int]:
    """How many configurations each constraint stopped first (quality, then memory, then speed)."""
    counts = {name: 0 for name in CONSTRAINTS}
    for c in cands:
        if c.fails:
            counts[c.fails[0]] += 1
    return counts


def additivity(kld_weights, kld_cache, kld_both) -> tuple[float, float]:
    """Mean and standard error of ``KL(both) - KL(weights) - KL(cache)`` per position, paired (the three
    measured on the same positions, chapter 10). KL divergence is second order in a small change of the
    logits, so two changes add only when their cross term averages out: this is that cross term."""
    from .evaluate import mean_and_se
    a, b, c = (np.asarray(x, dtype=np.float64) for x in (kld_weights, kld_cache, kld_both))
    if not a.shape == b.shape == c.shape or a.ndim != 1:
        raise ValueError(f"need three per-position arrays of one length, got {a.shape}, {b.shape}, {c.shape}")
    return mean_and_se(c - a - b)


@dataclass(frozen=True)
class SpeculativeVerdict:
    """``status``: ``"pays"``, ``"does not pay"``, ``"within noise"`` or ``"not measured"`` (at a batch size
    it was not timed at); ``pays`` is True only for ``"pays"``."""
    pays: bool
    reason: str
    status: str = ""


def speculative_verdict(measured: dict[str, dict], batch: int, workload: str) -> SpeculativeVerdict:
    """Whether speculative decoding pays for this ``workload`` (a key of ``measured``, e.g. ``"repetitive"``)
    at this batch size, from measured ``{"speedup": wall-clock ratio, "tokens_per_pass": ...}`` figures
    taken at batch 1, with ``"speedup_range": [lowest, highest]`` over the timed repeats where it was kept.
    It pays when the measured wall-clock speedup is above 1 (the whole range, where there is one: a range
    that holds 1 is within noise); at batch > 1 the course did not measure it (a verification pass then costs
    more than one step for every request), so it says so."""
    check_positive_int("batch", batch)
    if workload not in measured:
        raise ValueError(f"workload must be one of {sorted(measured)}, got {workload!r}")
    m = measured[workload]
    speed, per_pass = float(m["speedup"]), float(m["tokens_per_pass"])
    lo, hi = (float(x) for x in m["speedup_range"]) if m.get("speedup_range") else (speed, speed)
    spread = f" (repeats {lo:.2f}–{hi:.2f}×)" if m.get("speedup_range") else " (no spread kept with it)"
    if batch > 1:
        return SpeculativeVerdict(False, f"measured at batch 1 only ({speed:.2f}× there); at B = {batch} a verification "
                                         f"pass checks γ + 1 tokens for each of {batch} requests, and what that costs "
                                         "against a step was not timed: not claimed", "not measured")
    if lo <= 1.0 <= hi:
        return SpeculativeVerdict(False, f"{per_pass:.2f} tokens per verification pass, {speed:.2f}× the plain loop's "
                                         f"wall time{spread}: within noise, not claimed", "within noise")
    if speed > 1.0:
        return SpeculativeVerdict(True, f"{per_pass:.2f} tokens per verification pass, {speed:.2f}× the plain "
                                        f"loop's wall time{spread}, same tokens", "pays")
    return SpeculativeVerdict(False, f"{per_pass:.2f} tokens per pass did not pay for the passes: {speed:.2f}× "
                                     f"the plain loop's wall time{spread}", "does not pay")


STATUS_COLOURS = {"meets all": "#2a9d8f", "quality": "#e76f51", "memory": "#f4a261", "speed": "#8d99ae"}


def chooser_figure(cands: list[Candidate], *, budget_bytes: float, title_note: str = ""):
    """Memory against total throughput for every timed candidate, coloured by the first constraint it fails
    (open markers: a format this process does not hold at its bits); the budget as a line; the chosen one ringed."""
    from .plots import figure
    pick = best(cands)
    untimed = sum(not c.timed for c in cands)
    title = (f"Chosen: {pick.label} ({pick.tokens_per_s:,.0f} tok/s, {pick.memory.total / 2**20:,.0f} MiB)"
             if pick else "No configuration meets all three constraints") + (
        f"<br><sup>{untimed} of {len(cands)} not timed at this context (not shown)</sup>" if untimed else "") + title_note
    fig = figure(title, "memory: weights + KV cache + overhead (MiB, log scale)", "decode throughput, all users (tok/s)",
                 log_x=True, height=480)
    for status, colour in STATUS_COLOURS.items():
        for held in (True, False):
            group = [c for c in cands if c.timed and c.held == held
                     and (c.ok if status == "meets all" else (c.fails[:1] == (status,)))]
            if not group:
                continue
            name = status if status == "meets all" else f"fails {status} first"
            fig.add_scatter(x=[c.memory.total / 2**20 for c in group], y=[c.tokens_per_s for c in group],
                            mode="markers", name=name + ("" if held else " (size the format would take)"),
                            marker=dict(color=colour, size=8, opacity=0.8,
                                        symbol="circle" if held else "circle-open", line=dict(width=1.5, color=colour)),
                            text=[f"{c.label}<br>KLD ≈ {c.kld:.3g} (+2se {c.kld_upper:.3g}), "
                                  f"{c.user_tokens_per_s:.1f} tok/s per user" for c in group],
                            hovertemplate="%{text}<br>%{x:,.0f} MiB, %{y:,.0f} tok/s<extra></extra>")
    if pick is not None:
        fig.add_scatter(x=[pick.memory.total / 2**20], y=[pick.tokens_per_s], mode="markers", name="chosen",
                        marker=dict(size=18, color="rgba(0,0,0,0)", line=dict(width=2.5, color="black")),
                        hoverinfo="skip")
    fig.add_vline(x=budget_bytes / 2**20, line=dict(dash="dot"), annotation_text="memory budget",
                  annotation_position="top left")
    return fig
