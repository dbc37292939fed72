"""Chapter 02 -- prefill vs decode: two phases of generation with different physics.

* Prefill runs the whole prompt (P tokens) through the model in one pass: big matrix-matrix
  products, so the cost *per token* falls as P grows (:func:`prefill_sweep`).
* Decode feeds one token against a cache of C tokens: a matrix-vector product per weight
  matrix, so every step reads all the weights to produce one vector, and the step barely
  depends on C (:func:`decode_sweep`). Its floor is the bytes it must read over the bandwidth
  (:func:`decode_step_bytes`, :func:`decode_floor_s`).

The roofline puts both phases on one chart: a pass needs ``flops`` operations and moves
``bytes`` through memory, so on a machine with a compute roof (FLOP/s of a large matrix
product) and a memory roof (bytes/s) it takes at least ``max(flops / peak, bytes / bandwidth)``
(:func:`roofline_s`). Which roof binds depends on the arithmetic intensity, FLOP per byte
(:func:`arithmetic_intensity`): below the ridge (:func:`ridge_intensity`) memory sets the
floor, above it compute. :func:`prefill_flops` / :func:`forward_flops` and :func:`prefill_bytes` /
:func:`decode_step_bytes` give a pass's two counts, each for the pass as it is timed (the
prefill keeps the last position's logits only); chapter 04 uses the same functions for a batch
of decode steps.

The serving metrics are computed from the arrival times of a streamed generation, with the
definitions serving benchmarks (vLLM's ``benchmarks/serve.py``) use:

* TTFT -- request sent to first token;
* TPOT -- (end-to-end latency - TTFT) / (tokens - 1);
* ITL -- every gap between two consecutive tokens (a list, not one number).

transformers' own benchmark (``benchmark_v2``) reports ``(t_last - t_first) / (tokens - 1)``
under the name "inter-token latency": that is the TPOT quantity, one number per request.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from .kv_cache import (_last_logits_kwargs, attention_macs, decode_one_token, lm_head_macs, prefill,
                       weight_macs_per_token)
from .measure import Timing, synchronize, time_call
from .models import model_dims
from .progress import progress_bar
from .prompts import chat_prompt_ids
from .token_times import _check_arrivals, inter_token_gaps_s, tpot_s, ttft_s   # noqa: F401 (re-exported)
from .validation import check_finite, check_non_negative_int, check_positive_int


# --- timing the two phases ----------------------------------------------------------------------

@dataclass
class PhasePoint:
    """One timed size: ``n_tokens`` prompt tokens (prefill) or cached tokens (decode)."""

    n_tokens: int
    timing: Timing

    @property
    def median_s(self) -> float:
        return self.timing.median_s

    @property
    def per_token_s(self) -> float:
        """Seconds per prompt token (prefill); for decode, use :attr:`median_s` (one token per step)."""
        return self.timing.median_s / self.n_tokens


def repeats_for(n_tokens: int, *, repeats: int, token_budget: int) -> int:
    """Fewer repeats for long prompts: at most ``token_budget`` tokens timed per size, at least 1 run."""
    check_positive_int("n_tokens", n_tokens)
    check_positive_int("repeats", repeats)
    check_positive_int("token_budget", token_budget)
    return max(1, min(repeats, token_budget // n_tokens))


def time_prefill(model, input_ids: torch.Tensor, *, warmup: int = 1, repeats: int = 3, device="cpu") -> Timing:
    """Seconds to prefill ``input_ids`` (batch, P) into a fresh cache; ``Timing.result`` is the last cache."""
    def run():
        cache = DynamicCache(config=model.config)
        prefill(model, input_ids, cache)
        return cache
    return time_call(run, warmup=warmup, repeats=repeats, device=device)


def time_decode_step(model, cache: DynamicCache, token_ids: torch.Tensor, *, warmup: int = 1, repeats: int = 5,
                     device="cpu") -> Timing:
    """Seconds of one decode step against ``cache``; the cache is cropped back after each step.

    So every timed step sees exactly the same number of cached tokens. ``token_ids``: (batch, 1).
    """
    def step():
        logits = decode_one_token(model, token_ids, cache)
        cache.crop(-1)                       # drop the position this step appended
        return logits
    return time_call(step, warmup=warmup, repeats=repeats, device=device)


def prefill_sweep(model, input_ids: torch.Tensor, lengths, *, repeats: int = 3, token_budget: int = 2048,
                  device="cpu", progress: bool = True) -> list[PhasePoint]:
    """Time the prefill of the first P tokens of ``input_ids`` (1, >= max P) for each P in ``lengths``.

    Each length gets ``repeats`` runs, fewer for long prompts (:func:`repeats_for`); the first
    length also gets one warm-up run.
    """
    lengths = sorted(lengths)
    if not lengths or lengths[-1] > input_ids.shape[1]:
        raise ValueError(f"lengths must be non-empty and at most {input_ids.shape[1]} (the tokens given)")
    points = []
    for i, p in enumerate(progress_bar(lengths, "prefill sweep", enabled=progress)):
        t = time_prefill(model, input_ids[:, :p], warmup=1 if i == 0 else 0,
                         repeats=repeats_for(p, repeats=repeats, token_budget=token_budget), device=device)
        t.result = None                      # do not keep the caches alive
        points.append(PhasePoint(p, t))
    return points


def decode_sweep(model, input_ids: torch.Tensor, lengths, *, repeats: int = 5, device="cpu",
                 progress: bool = True) -> list[PhasePoint]:
    """Time one decode step against caches of C tokens, for each C in ``lengths``.

    The longest cache is prefilled once and cropped down to each shorter length; the first
    length timed also gets one warm-up step.
    """
    lengths = sorted(lengths)
    if not lengths or lengths[-1] >= input_ids.shape[1]:
        raise ValueError(f"lengths must be non-empty and below {input_ids.shape[1]} (the tokens given)")
    cache = DynamicCache(config=model.config)
    prefill(model, input_ids[:, : lengths[-1]], cache)
    points = []
    for i, c in enumerate(progress_bar(lengths[::-1], "decode sweep", enabled=progress)):
        cache.crop(c - cache.get_seq_length())          # a negative count: tokens to drop
        token = input_ids[:, c:c + 1]
        timing = time_decode_step(model, cache, token, warmup=1 if i == 0 else 0, repeats=repeats, device=device)
        points.append(PhasePoint(c, timing))
    return points[::-1]


def step_weight_matrices(model) -> list[torch.Tensor]:
    """The weight matrices a decode step multiplies one vector by: every 2-D parameter, each once,
    except the input embedding table (a lookup reads one row of it), unless it is tied to the LM head."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    seen, out = set(), []
    for p in model.parameters():
        if p.dim() != 2 or p.data_ptr() in seen or (p is embed and not tied):
            continue
        seen.add(p.data_ptr())
        out.append(p)
    return out


def decode_step_bytes(model, context_tokens: int = 0, *, batch: int = 1) -> int:
    """Bytes one decode step must read from memory at least (chapter 02).

    The weight matrices once (:func:`step_weight_matrices`), every norm and bias vector, one
    embedding row per sequence (when the table is not the LM head), and the keys and values of
    ``context_tokens`` cached positions of each of the ``batch`` sequences.
    """
    check_non_negative_int("context_tokens", context_tokens)
    check_positive_int("batch", batch)
    matrices = step_weight_matrices(model)
    embed = model.get_input_embeddings().weight
    vectors = [p for p in model.parameters() if p.dim() == 1]
    rows = 0 if any(m.data_ptr() == embed.data_ptr() for m in matrices) else batch * embed.shape[1] * embed.element_size()
    kv = batch * context_tokens * model_dims(model.config).kv_elements_per_token * embed.element_size()
    return sum(p.nbytes for p in matrices + vectors) + rows + kv


def prefill_bytes(model, prompt_tokens: int, *, batch: int = 1) -> int:
    """Bytes a prefill of ``prompt_tokens`` tokens (per sequence) must move at least (chapter 02).

    The weights once (as for a decode step), one embedding row per prompt token (when the table
    is not the LM head), and the keys and values it writes for every prompt token.
    """
    check_positive_int("prompt_tokens", prompt_tokens)
    check_positive_int("batch", batch)
    element = model.get_input_embeddings().weight.element_size()
    written = batch * prompt_tokens * model_dims(model.config).kv_elements_per_token * element
    return decode_step_bytes(model, 0, batch=batch * prompt_tokens) + written


def forward_flops(model, new_tokens: int, context_tokens: int = 0, *, batch: int = 1,
                  last_logits_only: bool = False, causal: bool = False) -> int:
    """Floating-point operations (2 per multiply-accumulate) of one forward pass (chapter 02).

    ``new_tokens`` tokens per sequence through every weight matrix, each attending to
    ``context_tokens`` cached positions plus the new ones; ``batch`` sequences. By default every
    position gets its logits and attention is the full rectangle (what eager attention computes).
    ``last_logits_only``: the LM head runs for the last position only (``logits_to_keep=1``);
    ``causal``: only the query-key pairs the causal mask keeps. A decode step at context C:
    ``forward_flops(model, 1, C)`` (one position, so both options change nothing). The prefill
    that chapter 02 times: :func:`prefill_flops`. Equals twice chapter 01's ``step_macs``.
    """
    check_positive_int("new_tokens", new_tokens)
    check_non_negative_int("context_tokens", context_tokens)
    check_positive_int("batch", batch)
    dims = model_dims(model.config)
    head = (new_tokens - 1) * lm_head_macs(dims) if last_logits_only else 0
    attention = attention_macs(new_tokens, context_tokens + new_tokens, dims, causal=causal)
    return 2 * batch * (new_tokens * weight_macs_per_token(model) - head + attention)


def prefill_flops(model, prompt_tokens: int, *, batch: int = 1, causal: bool = True) -> int:
    """FLOPs of the prefill that chapter 01's :func:`~course_utils.kv_cache.prefill` runs (chapter 02).

    Every prompt token through the weight matrices, the LM head for the last position only (the
    pass asks for ``logits_to_keep=1`` where the model accepts it), and attention over the
    query-key pairs the causal mask keeps (``causal=True``: what a kernel that skips the masked
    half must compute at least) or over the full P x P rectangle (``causal=False``: what eager
    attention computes, an upper bound for any kernel).
    """
    last_only = bool(_last_logits_kwargs(model))
    return forward_flops(model, prompt_tokens, batch=batch, last_logits_only=last_only, causal=causal)


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOP per byte moved through memory: where a pass sits on the roofline's x axis."""
    check_finite("flops", flops, minimum=0)
    check_finite("bytes_moved", bytes_moved, minimum=0, strict=True)
    return flops / bytes_moved


def ridge_intensity(peak_flops: float, bandwidth_Bps: float) -> float:
    """The intensity (FLOP/byte) where the two roofs meet: below it memory binds, above it compute."""
    check_finite("peak_flops", peak_flops, minimum=0, strict=True)
    check_finite("bandwidth_Bps", bandwidth_Bps, minimum=0, strict=True)
    return peak_flops / bandwidth_Bps


def attainable_flops(intensity: float, *, peak_flops: float, bandwidth_Bps: float) -> float:
    """The roofline: the most FLOP/s a pass of this intensity can reach, min(peak, intensity x bandwidth)."""
    check_finite("intensity", intensity, minimum=0)
    ridge_intensity(peak_flops, bandwidth_Bps)           # validates both roofs
    return min(peak_flops, intensity * bandwidth_Bps)


def roofline_s(flops: float, bytes_moved: float, *, peak_flops: float, bandwidth_Bps: float) -> float:
    """Lower bound of a pass's seconds: max(flops / peak_flops, bytes_moved / bandwidth_Bps).

    The roofline model: the pass can go no faster than its arithmetic at the compute roof,
    nor than its bytes at the memory roof (the two overlap at best).
    """
    check_finite("flops", flops, minimum=0)
    check_finite("bytes_moved", bytes_moved, minimum=0)
    ridge_intensity(peak_flops, bandwidth_Bps)
    return max(flops / peak_flops, bytes_moved / bandwidth_Bps)


def matvec_pass(matrices: list[torch.Tensor]) -> Callable[[], list]:
    """A callable doing ``torch.mv`` with each matrix: what the kernels need just to read these weights once."""
    inputs = [torch.ones(w.shape[1], dtype=w.dtype, device=w.device) for w in matrices]

    @torch.no_grad()
    def run():
        return [torch.mv(w, x) for w, x in zip(matrices, inputs)]
    return run


def weight_matvec_s(model, *, repeats: int = 5, device="cpu") -> Timing:
    """Seconds to multiply one vector by every weight matrix a decode step reads (no attention, no Python layers).

    What the framework's own kernels need just to read the weights once, as a decode step must.
    """
    return time_call(matvec_pass(step_weight_matrices(model)), warmup=1, repeats=repeats, device=device)


def cache_append_pass(cache) -> Callable[[], None]:
    """A callable doing only a decode step's writes to ``cache``: one new position appended to every layer
    (``cache.update``, as the model's attention calls it), then cropped back, so every call sees the same length.

    transformers' ``DynamicCache`` appends with ``torch.cat``: each call allocates a new tensor per layer and copies
    the whole history into it, so its time grows with the cached tokens. A preallocated cache (``StaticCache``, a
    serving engine's blocks) writes one slot instead. The cache must hold at least one position.
    """
    layers = getattr(cache, "layers", None)
    if not layers or cache.get_seq_length() < 1:
        raise ValueError("cache must be a transformers cache holding at least one position (prefill it first)")
    news = [(layer.keys[..., -1:, :].clone(), layer.values[..., -1:, :].clone()) for layer in layers]

    @torch.no_grad()
    def run():
        for i, (k, v) in enumerate(news):
            cache.update(k, v, i)
        cache.crop(-1)                       # drop the position just appended
    return run


def decode_floor_s(bytes_read: int, bandwidth_Bps: float) -> float:
    """Lower bound of a decode step: every byte it must read (:func:`decode_step_bytes`) crosses the memory bus once."""
    if bytes_read <= 0 or not bandwidth_Bps > 0:
        raise ValueError(f"bytes_read and bandwidth_Bps must be positive, got {bytes_read}, {bandwidth_Bps}")
    return bytes_read / bandwidth_Bps


# --- a real streamed generation -----------------------------------------------------------------

class TokenClock(BaseStreamer):
    """A ``generate(streamer=...)`` streamer that records when each new token is handed over.

    ``generate`` first passes the prompt, then each new token (batch 1); times are seconds
    since ``t0`` (``time.perf_counter``). The hand-over follows a device-to-host copy, so
    on a GPU the token really exists when its time is taken. ``cpu_s`` records, at each
    arrival, the CPU seconds this process has used so far (``time.process_time``, all its
    threads): between two tokens, CPU seconds over wall seconds is how many cores it kept busy.
    """

    def __init__(self, t0: float):
        self.t0 = t0
        self.arrival_s: list[float] = []
        self.cpu_s: list[float] = []
        self.token_ids: list[int] = []
        self.end_s: float | None = None
        self._seen_prompt = False

    def put(self, value):
        now, cpu = time.perf_counter() - self.t0, time.process_time()
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        ids = value.reshape(-1).tolist()
        self.token_ids += ids
        self.arrival_s += [now] * len(ids)
        self.cpu_s += [cpu] * len(ids)

    def end(self):
        self.end_s = time.perf_counter() - self.t0


@dataclass
class StreamRecord:
    """A streamed generation: arrival time of every new token (s since the request was sent).

    ``cpu_s``: the process's CPU seconds at each arrival (see :class:`TokenClock`), empty if not recorded.
    """

    prompt_tokens: int
    token_ids: list[int]
    arrival_s: list[float]
    end_s: float
    text: str = ""
    cpu_s: list[float] = field(default_factory=list)


@torch.no_grad()
def stream_generate(model, tokenizer, user_message: str, max_new_tokens: int) -> StreamRecord:
    """Send one chat request to ``model.generate`` (greedy) and time every token as it is produced.

    The clock starts before the prompt is tokenized, as a server's would when the request
    arrives. Exactly ``max_new_tokens`` tokens are generated (end-of-sequence is held off),
    so runs are comparable.
    """
    check_positive_int("max_new_tokens", max_new_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    synchronize(model.device)
    t0 = time.perf_counter()
    ids = torch.tensor([chat_prompt_ids(tokenizer, user_message)], device=model.device)
    clock = TokenClock(t0)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                   min_new_tokens=max_new_tokens, do_sample=False, streamer=clock, pad_token_id=pad_id)
    return StreamRecord(ids.shape[1], clock.token_ids, clock.arrival_s, clock.end_s,
                        tokenizer.decode(clock.token_ids, skip_special_tokens=True), clock.cpu_s)


# --- serving metrics (pure) ---------------------------------------------------------------------

def cores_busy_per_gap(arrival_s, cpu_s) -> list[float]:
    """For each gap between consecutive tokens: the process's CPU seconds over the gap's wall seconds.

    ``cpu_s``: the process's CPU time at each arrival (:attr:`TokenClock.cpu_s`). About the number
    of threads while the process computes throughout a gap; lower when it spent part of the gap
    waiting (descheduled, or blocked), which is time that went to something outside it.
    """
    t = _check_arrivals(arrival_s)
    c = np.asarray(list(cpu_s), dtype=float)
    if c.shape != t.shape or not np.all(np.isfinite(c)) or np.any(np.diff(c) < 0):
        raise ValueError(f"cpu_s must hold one non-decreasing CPU time per arrival ({t.size}), got {c.size} values")
    wall = np.diff(t)
    if np.any(wall <= 0):
        raise ValueError("every gap must last some time to divide by it; two arrivals share a timestamp")
    return (np.diff(c) / wall).tolist()


def hf_inter_token_latency_s(arrival_s) -> float:
    """What transformers' ``benchmark_v2`` calls inter-token latency: (t_last - t_first) / (tokens - 1).

    The TPOT quantity under another name (one number per request, not the list of gaps).
    """
    t = _check_arrivals(arrival_s)
    return float(t[-1] - t[0]) / (t.size - 1)


@dataclass(frozen=True)
class StreamMetrics:
    """Serving metrics of one request (seconds; tokens per second)."""

    n_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    itl_s: tuple[float, ...] = field(repr=False)
    hf_inter_token_latency_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Speed once the answer streams: 1 / TPOT."""
        return 1.0 / self.tpot_s if self.tpot_s > 0 else math.inf

    @property
    def output_tokens_per_s(self) -> float:
        """Tokens over the whole request, prefill included: n / end-to-end latency."""
        return self.n_tokens / self.e2e_s

    @property
    def itl_median_s(self) -> float:
        return float(np.median(self.itl_s))

    @property
    def itl_p99_s(self) -> float:
        return float(np.percentile(self.itl_s, 99))


def stream_metrics(arrival_s, end_s: float | None = None) -> StreamMetrics:
    """All metrics of one streamed request from its token arrival times (s since it was sent)."""
    t = _check_arrivals(arrival_s)
    tpot = tpot_s(t, end_s)
    e2e = float(t[-1] if end_s is None else end_s)
    return StreamMetrics(int(t.size), float(t[0]), tpot, e2e, tuple(np.diff(t).tolist()),
                         hf_inter_token_latency_s(t))


def predicted_latency_s(ttft: float, tpot: float, new_tokens: int) -> float:
    """End-to-end latency of ``new_tokens`` tokens: TTFT + (new_tokens - 1) x TPOT."""
    check_positive_int("new_tokens", new_tokens)
    if not (ttft >= 0 and tpot >= 0 and math.isfinite(ttft) and math.isfinite(tpot)):
        raise ValueError(f"ttft and tpot must be finite and >= 0, got {ttft!r}, {tpot!r}")
    return ttft + (new_tokens - 1) * tpot


# --- widget -------------------------------------------------------------------------------------

def latency_figure(prompt_tokens: int, new_tokens: int, *, prefill_s: dict[int, float], tpot: float):
    """Widget figure: measured prefill time vs prompt length with the chosen P highlighted (left),
    and the predicted end-to-end latency split into prefill and decode (right).

    ``prefill_s``: measured seconds per prompt length (the TTFT of that prompt, near enough);
    ``tpot``: measured seconds per output token. Pure: depends only on its arguments.
    """
    from plotly.subplots import make_subplots

    from .plots import PALETTE, TEMPLATE

    if prompt_tokens not in prefill_s:
        raise ValueError(f"prompt_tokens must be one of the measured lengths {sorted(prefill_s)}, got {prompt_tokens!r}")
    ttft = prefill_s[prompt_tokens]
    total = predicted_latency_s(ttft, tpot, new_tokens)
    decode = total - ttft
    fig = make_subplots(rows=1, cols=2, column_widths=[0.5, 0.5], horizontal_spacing=0.14,
                        subplot_titles=("Measured prefill (≈ TTFT)", "Predicted end-to-end latency"))
    xs = sorted(prefill_s)
    fig.add_scatter(x=xs, y=[prefill_s[p] for p in xs], mode="lines+markers", name="prefill, measured",
                    line_color=PALETTE[0], row=1, col=1)
    fig.add_scatter(x=[prompt_tokens], y=[ttft], mode="markers", name="this prompt",
                    marker=dict(size=14, color=PALETTE[5], symbol="diamond"), row=1, col=1)
    fig.add_bar(x=["latency"], y=[ttft], name="prefill (TTFT)", marker_color=PALETTE[0], row=1, col=2)
    fig.add_bar(x=["latency"], y=[decode], name=f"{new_tokens - 1} more tokens × TPOT", marker_color=PALETTE[1],
                row=1, col=2)
    fig.update_layout(template=TEMPLATE, barmode="stack", height=420, hovermode="closest",
                      title=f"{prompt_tokens:,}-token prompt, {new_tokens:,} new tokens: {total:,.2f} s predicted, "
                            f"{100 * ttft / total:.0f} % of it spent before the first token")
    fig.update_xaxes(title="prompt length P (tokens)", type="log", row=1, col=1)
    fig.update_yaxes(title="prefill time (s)", row=1, col=1)
    fig.update_yaxes(title="seconds", row=1, col=2)
    return fig


def roofline_figure(points: dict, *, peak_flops: float, bandwidth_Bps: float, title: str):
    """The roofline chart (a pure function): attainable FLOP/s against arithmetic intensity, both log axes.

    ``points`` maps a series name to ``(intensity FLOP/byte, measured FLOP/s, label)`` triples;
    the roofs are this machine's measured ``peak_flops`` and ``bandwidth_Bps``.
    """
    from .plots import PALETTE, figure

    ridge = ridge_intensity(peak_flops, bandwidth_Bps)
    xs = [p[0] for series in points.values() for p in series] + [ridge]
    lo, hi = min(xs) / 3, max(xs) * 3
    grid = [lo * (hi / lo) ** (i / 60) for i in range(61)]
    grid = sorted(set(grid + [ridge]))
    fig = figure(title, "arithmetic intensity (FLOP per byte moved, log scale)", "GFLOP/s (log scale)",
                 log_x=True, log_y=True, height=460)
    fig.add_scatter(x=grid, y=[attainable_flops(i, peak_flops=peak_flops, bandwidth_Bps=bandwidth_Bps) / 1e9
                               for i in grid], mode="lines", name="roofline: min(compute roof, intensity × bandwidth)",
                    line=dict(color=PALETTE[7], width=2), hoverinfo="skip")
    for (name, series), color in zip(points.items(), [PALETTE[0], PALETTE[1], PALETTE[2], PALETTE[3]]):
        # the first and last point of a series are labelled on the chart; every point has its label on hover
        shown = [p[2] if i in (0, len(series) - 1) else "" for i, p in enumerate(series)]
        fig.add_scatter(x=[p[0] for p in series], y=[p[1] / 1e9 for p in series], text=shown,
                        customdata=[p[2] for p in series], mode="markers+text", textposition="top center", name=name,
                        marker=dict(size=9, color=color),
                        hovertemplate="%{customdata}: %{x:,.2f} FLOP/byte, %{y:,.2f} GFLOP/s<extra></extra>")
    fig.add_scatter(x=[ridge], y=[peak_flops / 1e9], mode="markers", name=f"ridge: {ridge:,.1f} FLOP/byte",
                    marker=dict(size=12, symbol="diamond", color=PALETTE[5]),
                    hovertemplate="ridge: %{x:,.2f} FLOP/byte<extra></extra>")
    fig.update_layout(hovermode="closest")
    return fig
