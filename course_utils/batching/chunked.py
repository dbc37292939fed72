"""Chunked prefill measured (chapter 04): a long prompt arrives while several streams decode.

:func:`long_prompt_arrives` runs the scenario through a fresh :class:`~course_utils.engine.LLMEngine` and records,
step by step, when every token came out (the end of the step that produced it, on the engine's clock).
:func:`compare_chunking` runs it with chunked prefill off and on in alternating rounds; :func:`budget_sweep` once per
token budget. The summaries (:func:`stream_gaps_s`, :func:`longest_gap_s`, :func:`median_gap_s`, :func:`long_ttft_s`,
:func:`summarize_run`, :func:`round_range`, :func:`change`) and the figures (:func:`chunked_timeline_figure`, and
:func:`budget_figure`, the slider's function) are pure functions of the recorded runs.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

import plotly.graph_objects as go

from ..plots import PALETTE, TEMPLATE
from ..progress import progress_bar
from ..validation import check_non_negative_int, check_positive_int


@dataclass(frozen=True)
class StepLoad:
    """One engine step: when it ran (seconds, engine clock) and the prompt and decode tokens it fed."""

    start_s: float
    end_s: float
    prefill_tokens: int
    decode_tokens: int

    @property
    def step_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class LongPromptRun:
    """One run of the scenario. Times are seconds on the engine's clock; a token's time is the end of its step.

    ``stream_token_s[i]``: stream i's token times, one per generated token; ``long_token_s``: the long request's.
    ``long_prompt_tokens``: the long prompt's length; ``arrival_s``: when it was queued. ``budget``: the engine's
    ``max_num_batched_tokens`` (with chunking off, the whole cache: a prompt is never cut). ``steps``: every step, in order.
    """

    chunked_prefill: bool
    budget: int
    long_prompt_tokens: int
    arrival_s: float
    stream_token_s: tuple[tuple[float, ...], ...]
    long_token_s: tuple[float, ...]
    stream_ids: tuple[tuple[int, ...], ...]
    long_ids: tuple[int, ...]
    steps: tuple[StepLoad, ...]

    @property
    def label(self) -> str:
        return f"chunked, budget {self.budget}" if self.chunked_prefill else "chunking off"

    @property
    def output_ids(self) -> list[tuple[int, ...]]:
        """Every request's generated tokens: the streams in order, then the long request."""
        return [*self.stream_ids, self.long_ids]


def scenario_prompts(tok, *, n_streams: int, stream_prompt_tokens: int,
                     long_prompt_tokens: int) -> tuple[list[list[int]], list[int]]:
    """The streams' prompts and the long prompt: consecutive, non-overlapping pieces of *Pride and Prejudice*
    (real tokens, no shared prefix), ``stream_prompt_tokens`` each and ``long_prompt_tokens``."""
    from ..prompts import book_token_ids
    for name, value in (("n_streams", n_streams), ("stream_prompt_tokens", stream_prompt_tokens),
                        ("long_prompt_tokens", long_prompt_tokens)):
        check_positive_int(name, value)
    ids = book_token_ids(tok, n_streams * stream_prompt_tokens + long_prompt_tokens)[0].tolist()
    streams = [ids[i * stream_prompt_tokens:(i + 1) * stream_prompt_tokens] for i in range(n_streams)]
    return streams, ids[n_streams * stream_prompt_tokens:]


def stream_tokens_needed(long_prompt_tokens: int, *, n_streams: int, budget: int, tokens_before: int,
                         tokens_after: int, stream_prompt_tokens: int = 0) -> int:
    """Tokens per stream so that every stream is still decoding when the long prompt gets its first token at
    ``budget`` (each step gives ``n_streams`` tokens to decodes, the rest to the prompt), and ``tokens_after`` more.

    ``stream_prompt_tokens``: each stream's prompt length. When the streams' own prompts take several steps at
    ``budget``, the first stream starts decoding before the last (the long prompt arrives once the last has
    ``tokens_before`` tokens): the streams get one token more per step those prompts can take."""
    check_positive_int("long_prompt_tokens", long_prompt_tokens)
    check_non_negative_int("tokens_after", tokens_after)
    check_positive_int("tokens_before", tokens_before)
    check_non_negative_int("stream_prompt_tokens", stream_prompt_tokens)
    if budget <= n_streams:
        raise ValueError(f"the budget must exceed n_streams ({n_streams}) to leave room for a prompt chunk, "
                         f"got {budget}")
    stagger = math.ceil(n_streams * stream_prompt_tokens / (budget - n_streams)) if stream_prompt_tokens else 0
    return tokens_before + stagger + math.ceil(long_prompt_tokens / (budget - n_streams)) + tokens_after


def long_prompt_arrives(model, stream_prompts: Sequence[Sequence[int]], long_prompt: Sequence[int], *,
                        stream_tokens: int, long_tokens: int, tokens_before: int, chunked_prefill: bool,
                        budget: int | None = None, block_size: int = 16, weights=None, dtype=None) -> LongPromptRun:
    """Streams decode; once each has ``tokens_before`` tokens, ``long_prompt`` is queued; run until all are done.

    A fresh engine with a slot per request and blocks for all of them (no preemption), prefix caching off, greedy,
    end-of-sequence ignored (each stream makes ``stream_tokens`` tokens, the long request ``long_tokens``).
    ``chunked_prefill``/``budget``: the engine's ``chunked_prefill`` and ``max_num_batched_tokens`` (None: the whole
    cache). ``weights``: shared :class:`~course_utils.engine.RunnerWeights`.
    """
    from ..engine import LLMEngine
    if not stream_prompts or not long_prompt:
        raise ValueError("need at least one stream prompt and a non-empty long prompt")
    check_positive_int("stream_tokens", stream_tokens)
    check_positive_int("long_tokens", long_tokens)
    check_positive_int("tokens_before", tokens_before)
    if stream_tokens <= tokens_before:
        raise ValueError(f"stream_tokens ({stream_tokens}) must exceed tokens_before ({tokens_before}): "
                         "the streams must still be decoding when the long prompt arrives")
    needs = [len(p) + stream_tokens for p in stream_prompts] + [len(long_prompt) + long_tokens]
    blocks = sum(math.ceil(n / block_size) for n in needs) + len(needs)
    engine = LLMEngine(model, num_blocks=blocks, block_size=block_size, max_num_seqs=len(needs),
                       max_num_batched_tokens=budget, chunked_prefill=chunked_prefill, prefix_caching=False,
                       weights=weights, dtype=dtype)
    ids = [engine.add_request(list(p), stream_tokens, ignore_eos=True) for p in stream_prompts]
    times: dict[int, list[float]] = {}

    def step() -> None:
        before = {i: s.num_output_tokens for i, s in engine.sequences.items()}
        engine.step()
        for i, s in engine.sequences.items():
            times.setdefault(i, []).extend([engine.steps[-1].end_s] * (s.num_output_tokens - before[i]))

    while min(engine.sequences[i].num_output_tokens for i in ids) < tokens_before:
        step()
    long_id = engine.add_request(list(long_prompt), long_tokens, ignore_eos=True)
    while engine.has_unfinished():
        step()
    seqs = engine.sequences
    return LongPromptRun(chunked_prefill, engine.scheduler.max_num_batched_tokens, len(long_prompt),
                         seqs[long_id].arrival_s, tuple(tuple(times[i]) for i in ids), tuple(times[long_id]),
                         tuple(tuple(seqs[i].output_ids) for i in ids), tuple(seqs[long_id].output_ids),
                         tuple(StepLoad(s.start_s, s.end_s, s.num_prefill_tokens, s.num_decode_tokens)
                               for s in engine.steps))


def compare_chunking(model, stream_prompts, long_prompt, *, budget: int, rounds: int = 3, warmup: int = 1,
                     progress: bool = True, **scenario) -> dict[str, list[LongPromptRun]]:
    """``{"off": runs, "on": runs}``: ``warmup`` untimed pairs, then ``rounds`` runs of each, taking turns (off, on,
    off, on, ...) so machine noise hits both alike, with a progress bar between runs (``progress``). ``scenario``: the
    other arguments of :func:`long_prompt_arrives`."""
    check_positive_int("rounds", rounds)
    check_non_negative_int("warmup", warmup)
    configs = {"off": dict(chunked_prefill=False), "on": dict(chunked_prefill=True, budget=budget)}
    runs: dict[str, list[LongPromptRun]] = {k: [] for k in configs}
    with progress_bar(None, "chunking off / on", enabled=progress, total=(warmup + rounds) * len(configs),
                      unit="run") as bar:
        for r in range(warmup + rounds):
            for key, cfg in configs.items():
                run = long_prompt_arrives(model, stream_prompts, long_prompt, **cfg, **scenario)
                if r >= warmup:
                    runs[key].append(run)
                bar.update(1)
    return runs


def budget_sweep(model, stream_prompts, long_prompt, *, budgets: Sequence[int], progress: bool = True,
                 **scenario) -> dict[int, LongPromptRun]:
    """One run with chunked prefill per token budget (single runs: no spread), ``{budget: run}``."""
    if not budgets:
        raise ValueError("give at least one budget")
    return {int(b): long_prompt_arrives(model, stream_prompts, long_prompt, chunked_prefill=True, budget=int(b),
                                        **scenario)
            for b in progress_bar(list(budgets), "token budgets", enabled=progress, unit="budget")}


# ---- summaries: pure functions of a run ---------------------------------------------------------------------------

def stream_gaps_s(run: LongPromptRun) -> list[list[float]]:
    """Per stream, the seconds between each of its tokens and the next: chapter 02's inter-token latency (ITL),
    stream by stream (a stream's first token is not a gap). Every stream must have at least two tokens."""
    from ..prefill_decode import inter_token_gaps_s
    return [inter_token_gaps_s(t) for t in run.stream_token_s]


def longest_gap_s(run: LongPromptRun) -> float:
    """The longest wait of any stream between two of its own tokens (seconds)."""
    gaps = [g for per_stream in stream_gaps_s(run) for g in per_stream]
    return max(gaps)


def median_gap_s(run: LongPromptRun) -> float:
    """The median gap between consecutive tokens of a stream, over all streams (seconds)."""
    gaps = [g for per_stream in stream_gaps_s(run) for g in per_stream]
    return statistics.median(gaps)


def long_ttft_s(run: LongPromptRun) -> float:
    """Seconds from the long prompt's arrival to its first token."""
    if not run.long_token_s:
        raise ValueError("the long request produced no token")
    return run.long_token_s[0] - run.arrival_s


def prefill_steps(run: LongPromptRun) -> list[StepLoad]:
    """The steps that fed the long prompt: from its arrival to its first token, those carrying prompt tokens."""
    first = run.arrival_s + long_ttft_s(run)
    return [s for s in run.steps if s.start_s >= run.arrival_s and s.end_s <= first and s.prefill_tokens]


@dataclass(frozen=True)
class ChunkingSummary:
    """What one run shows: the streams' longest and median gap, the long prompt's time to first token (seconds),
    and the steps that fed its prompt (how many, and their time)."""

    label: str
    longest_gap_s: float
    median_gap_s: float
    ttft_s: float
    prefill_steps: int
    prefill_step_s: float


def summarize_run(run: LongPromptRun) -> ChunkingSummary:
    steps = prefill_steps(run)
    return ChunkingSummary(run.label, longest_gap_s(run), median_gap_s(run), long_ttft_s(run), len(steps),
                           sum(s.step_s for s in steps))


@dataclass(frozen=True)
class RoundRange:
    """The median of several rounds and their lowest and highest value."""

    median: float
    low: float
    high: float

    def overlaps(self, other: "RoundRange") -> bool:
        """Whether the two ranges of rounds overlap (then a difference is within noise)."""
        return self.low <= other.high and other.low <= self.high


def change(before: RoundRange, after: RoundRange) -> str:
    """``"lower"`` or ``"higher"`` when every round of ``after`` lies below or above every round of ``before``,
    else ``"within noise"`` (the ranges overlap)."""
    if after.high < before.low:
        return "lower"
    if after.low > before.high:
        return "higher"
    return "within noise"


def round_range(values: Sequence[float]) -> RoundRange:
    """Median, lowest and highest of ``values`` (one per round)."""
    if not values:
        raise ValueError("need at least one value")
    return RoundRange(statistics.median(values), min(values), max(values))


# ---- figures ------------------------------------------------------------------------------------------------------

def _timeline_traces(fig: go.Figure, run: LongPromptRun, row: int, col: int, *, legend: bool) -> None:
    """The streams' tokens (one marker row per stream), the long request's, and the steps that fed its prompt."""
    t0 = run.arrival_s
    for i, times in enumerate(run.stream_token_s):
        fig.add_scatter(x=[t - t0 for t in times], y=[f"stream {i}"] * len(times), mode="markers",
                        marker=dict(color=PALETTE[0], size=7, symbol="line-ns-open", line_width=2),
                        name="a stream's token", legendgroup="stream", showlegend=legend and i == 0,
                        hovertemplate="%{y}: token at %{x:.2f} s<extra></extra>", row=row, col=col)
    fig.add_scatter(x=[t - t0 for t in run.long_token_s], y=["long prompt"] * len(run.long_token_s), mode="markers",
                    marker=dict(color=PALETTE[5], size=9, symbol="diamond"), name="the long request's token",
                    legendgroup="long", showlegend=legend,
                    hovertemplate="long request: token at %{x:.2f} s<extra></extra>", row=row, col=col)
    # shapes after the traces: plotly drops a shape meant for a subplot that has no data yet
    for s in prefill_steps(run):
        fig.add_vrect(x0=s.start_s - t0, x1=s.end_s - t0, fillcolor=PALETTE[1], opacity=0.18, line_width=0,
                      layer="below", row=row, col=col)
    fig.add_vline(x=0, line_dash="dot", line_color=PALETTE[7], row=row, col=col)


def chunked_timeline_figure(off: LongPromptRun, on: LongPromptRun, *, which: str = "") -> go.Figure:
    """Every stream's tokens over time without and with chunked prefill, on one time axis (0 = the long prompt's
    arrival, dotted); the steps that fed the long prompt are shaded. ``which``: words naming the runs drawn."""
    from plotly.subplots import make_subplots
    a, b = summarize_run(off), summarize_run(on)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.14, subplot_titles=(
        f"{off.label}: longest gap {a.longest_gap_s:.2f} s, first token of the long prompt after {a.ttft_s:.2f} s",
        f"{on.label}: longest gap {b.longest_gap_s:.2f} s, first token of the long prompt after {b.ttft_s:.2f} s"))
    _timeline_traces(fig, off, 1, 1, legend=True)
    _timeline_traces(fig, on, 2, 1, legend=False)
    fig.update_layout(template=TEMPLATE, height=520, hovermode="closest",
                      legend=dict(orientation="h", x=0, xanchor="left", y=-0.14, yanchor="top"), margin=dict(b=100),
                      title=f"A {on.long_prompt_tokens:,}-token prompt arrives: the streams' longest gap "
                            f"{a.longest_gap_s:.2f} s → {b.longest_gap_s:.2f} s with chunking" + (f" ({which})" if which else ""))
    fig.update_xaxes(title="seconds since the long prompt arrived (shaded: steps that fed it)", row=2, col=1)
    fig.update_yaxes(autorange="reversed")
    return fig


def budget_figure(off: LongPromptRun, sweep: Mapping[int, LongPromptRun], budget: int) -> go.Figure:
    """The slider's pure function. Left: the streams' longest gap and the long prompt's time to first token
    against the token budget (chunking off drawn as flat dashed lines), the chosen budget marked. Right: the
    chosen budget's timeline, the steps that fed the long prompt shaded."""
    from plotly.subplots import make_subplots
    if budget not in sweep:
        raise ValueError(f"budget must be one of the runs' budgets {sorted(sweep)}, got {budget!r}")
    budgets = sorted(sweep)
    rows = {b: summarize_run(sweep[b]) for b in budgets}
    base, chosen = summarize_run(off), rows[budget]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.42, 0.58], horizontal_spacing=0.1,
                        subplot_titles=("what the budget trades (one run per budget)", f"budget {budget}: the tokens"))
    for key, name, colour in (("longest_gap_s", "streams' longest gap", PALETTE[0]),
                              ("ttft_s", "long prompt's first token", PALETTE[5])):
        fig.add_scatter(x=budgets, y=[getattr(rows[b], key) for b in budgets], mode="lines+markers", name=name,
                        line_color=colour, row=1, col=1)
        fig.add_scatter(x=budgets, y=[getattr(base, key)] * len(budgets), mode="lines", name=f"{name}, chunking off",
                        line=dict(color=colour, dash="dash"), row=1, col=1)
    fig.add_vline(x=budget, line_dash="dot", line_color=PALETTE[7], row=1, col=1)
    _timeline_traces(fig, sweep[budget], 1, 2, legend=True)
    fig.update_layout(template=TEMPLATE, height=460, hovermode="closest",
                      legend=dict(orientation="h", x=0, xanchor="left", y=-0.2, yanchor="top"), margin=dict(b=120),
                      title=f"Budget {budget}: longest gap {chosen.longest_gap_s:.2f} s "
                            f"(off: {base.longest_gap_s:.2f} s), first token after {chosen.ttft_s:.2f} s (off: {base.ttft_s:.2f} s)")
    fig.update_xaxes(type="log", tickvals=budgets, title="token budget per step (max_num_batched_tokens)", row=1, col=1)
    fig.update_yaxes(title="seconds", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title="seconds since the long prompt arrived (shaded: steps that fed it)", row=1, col=2)
    fig.update_yaxes(autorange="reversed", row=1, col=2)
    return fig
