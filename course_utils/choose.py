"""Putting it together (chapter 10): the one memory sum, and a configuration chooser.

Memory is one sum: weights + KV cache (total resident tokens, over every concurrent request) + the
runtime's overhead. A configuration is chosen in a fixed order: the quality bound first (only
configurations whose measured KL divergence to the reference stays under it), then the memory budget
(the sum must fit), then the speed target (measured decode throughput per user); among what is left, the
one with the highest total throughput. Speculative decoding is judged last, by what it measured on this
machine: accepted tokens per verification pass and wall time, not acceptance alone.

Every figure the chooser uses is measured (chapters 04, 07 and 08, or recomputed cheaply in chapter 10);
nothing here times or measures anything itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    kernel here runs at the speed of the dtype it computes in).
    """
    name: str
    proj_bits: float
    rest_bits: float
    kld: float
    kld_se: float = 0.0
    same_top: float = 1.0
    speed_dtype: str = "float32"

    def nbytes(self, n_proj: int, n_rest: int) -> float:
        return (n_proj * self.proj_bits + n_rest * self.rest_bits) / 8


@dataclass(frozen=True)
class KVOption:
    """A KV-cache format: bits per cached number and its measured quality (as :class:`WeightOption`)."""
    name: str
    bits: float
    kld: float
    kld_se: float = 0.0
    same_top: float = 1.0


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


@dataclass(frozen=True)
class Candidate:
    """One configuration, its figures, and the constraints it fails (in :data:`CONSTRAINTS` order)."""
    weights: WeightOption
    kv: KVOption
    batch: int
    memory: MemoryTerms
    kld: float                      # weights' + KV's measured KL divergence (a first-order estimate of both at once)
    step_s: float
    fails: tuple[str, ...] = field(default=())

    @property
    def tokens_per_s(self) -> float:
        """All users together."""
        return self.batch / self.step_s

    @property
    def user_tokens_per_s(self) -> float:
        return 1.0 / self.step_s

    @property
    def ok(self) -> bool:
        return not self.fails

    @property
    def label(self) -> str:
        return f"{self.weights.name} weights · {self.kv.name} cache · B = {self.batch}"


def _check_speeds(step_s: dict) -> dict[str, dict[int, float]]:
    if not isinstance(step_s, dict) or not step_s:
        raise ValueError("step_s must map a dtype name to {batch size: seconds per decode step}")
    out = {}
    for dtype, table in step_s.items():
        if not isinstance(table, dict) or not table:
            raise ValueError(f"step_s[{dtype!r}] must map batch sizes to seconds per step")
        clean = {}
        for b, s in table.items():
            b = int(b)
            check_positive_int("batch size", b)
            if not s > 0:
                raise ValueError(f"step_s[{dtype!r}][{b}] must be > 0 seconds, got {s}")
            clean[b] = float(s)
        out[str(dtype)] = clean
    return out


def candidates(weights: list[WeightOption], kvs: list[KVOption], step_s: dict, config, *, n_proj: int, n_rest: int,
               context: int, budget_bytes: float, kld_bound: float, min_user_tokens_per_s: float = 0.0,
               overhead_bytes: float = 0.0) -> list[Candidate]:
    """Every (weights, KV, batch) with its figures and failed constraints.

    ``step_s``: measured seconds per decode step, ``{dtype: {batch: s}}``; the batch sizes measured for a
    weight option's ``speed_dtype`` are the ones considered. ``context``: tokens each request holds, so a
    batch of B keeps B · context tokens resident.
    """
    check_positive_int("context", context)
    if not budget_bytes > 0:
        raise ValueError(f"the memory budget must be > 0 bytes, got {budget_bytes}")
    if not kld_bound >= 0:
        raise ValueError(f"the quality bound must be a KL divergence >= 0 nats per token, got {kld_bound}")
    if min_user_tokens_per_s < 0:
        raise ValueError(f"the speed target must be >= 0 tokens/s, got {min_user_tokens_per_s}")
    if not weights or not kvs:
        raise ValueError("give at least one weight option and one KV option")
    speeds = _check_speeds(step_s)
    out = []
    for w in weights:
        if w.speed_dtype not in speeds:
            raise ValueError(f"{w.name}: no measured step times for {w.speed_dtype!r} (have {sorted(speeds)})")
        for kv in kvs:
            for b, s in sorted(speeds[w.speed_dtype].items()):
                mem = memory_terms(w, kv, config, n_proj=n_proj, n_rest=n_rest, resident_tokens=b * context,
                                   overhead_bytes=overhead_bytes)
                kld = w.kld + kv.kld
                fails = tuple(name for name, bad in (("quality", kld > kld_bound), ("memory", mem.total > budget_bytes),
                                                     ("speed", 1.0 / s < min_user_tokens_per_s)) if bad)
                out.append(Candidate(w, kv, b, mem, kld, s, fails))
    return out


def best(cands: list[Candidate]) -> Candidate | None:
    """The configuration meeting every constraint with the highest total throughput (then the least memory,
    then the lowest KL divergence), or None when none meets them all."""
    ok = [c for c in cands if c.ok]
    return max(ok, key=lambda c: (c.tokens_per_s, -c.memory.total, -c.kld)) if ok else None


def first_failures(cands: list[Candidate]) -> dict[str, int]:
    """How many configurations each constraint stopped first (quality, then memory, then speed)."""
    counts = {name: 0 for name in CONSTRAINTS}
    for c in cands:
        if c.fails:
            counts[c.fails[0]] += 1
    return counts


@dataclass(frozen=True)
class SpeculativeVerdict:
    pays: bool
    reason: str


def speculative_verdict(measured: dict[str, dict], batch: int, workload: str) -> SpeculativeVerdict:
    """Whether speculative decoding pays for this ``workload`` (a key of ``measured``, e.g. ``"repetitive"``)
    at this batch size, from measured ``{"speedup": wall-clock ratio, "tokens_per_pass": ...}`` figures
    taken at batch 1. It pays when the measured wall-clock speedup is above 1; at batch > 1 the course did
    not measure it (a verification pass then costs more than one step for every request), so it says so."""
    check_positive_int("batch", batch)
    if workload not in measured:
        raise ValueError(f"workload must be one of {sorted(measured)}, got {workload!r}")
    m = measured[workload]
    speed, per_pass = float(m["speedup"]), float(m["tokens_per_pass"])
    if batch > 1:
        return SpeculativeVerdict(False, f"measured at batch 1 only ({speed:.2f}× there); at B = {batch} every "
                                         "verification pass costs more than one step for every request: not claimed")
    if speed > 1.0:
        return SpeculativeVerdict(True, f"{per_pass:.2f} tokens per verification pass, {speed:.2f}× the plain "
                                        "loop's wall time, same tokens")
    return SpeculativeVerdict(False, f"{per_pass:.2f} tokens per pass did not pay for the passes: {speed:.2f}× "
                                     "the plain loop's wall time")


STATUS_COLOURS = {"meets all": "#2a9d8f", "quality": "#e76f51", "memory": "#f4a261", "speed": "#8d99ae"}


def chooser_figure(cands: list[Candidate], *, budget_bytes: float, title_note: str = ""):
    """Memory against total throughput for every candidate, coloured by the first constraint it fails; the
    budget as a line; the chosen one ringed."""
    from .plots import figure
    pick = best(cands)
    title = (f"Chosen: {pick.label} ({pick.tokens_per_s:,.0f} tok/s, {pick.memory.total / 2**20:,.0f} MiB)"
             if pick else "No configuration meets all three constraints") + title_note
    fig = figure(title, "memory: weights + KV cache + overhead (MiB, log scale)", "decode throughput, all users (tok/s)",
                 log_x=True, height=460)
    for status, colour in STATUS_COLOURS.items():
        group = [c for c in cands if (c.ok if status == "meets all" else (c.fails[:1] == (status,)))]
        if not group:
            continue
        fig.add_scatter(x=[c.memory.total / 2**20 for c in group], y=[c.tokens_per_s for c in group], mode="markers",
                        name=status if status == "meets all" else f"fails {status} first",
                        marker=dict(color=colour, size=8, opacity=0.8),
                        text=[f"{c.label}<br>KLD ≈ {c.kld:.3g}, {c.user_tokens_per_s:.1f} tok/s per user" for c in group],
                        hovertemplate="%{text}<br>%{x:,.0f} MiB, %{y:,.0f} tok/s<extra></extra>")
    if pick is not None:
        fig.add_scatter(x=[pick.memory.total / 2**20], y=[pick.tokens_per_s], mode="markers", name="chosen",
                        marker=dict(size=18, color="rgba(0,0,0,0)", line=dict(width=2.5, color="black")),
                        hoverinfo="skip")
    fig.add_vline(x=budget_bytes / 2**20, line=dict(dash="dot"), annotation_text="memory budget",
                  annotation_position="top left")
    return fig
