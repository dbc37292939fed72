"""How fast each of the engine's paths decodes, against its floors, what its speed costs, and where its time goes.

A *path* is one way of running the same model: the dense float32 path chapter 04 shows, dense bfloat16, and the
fast paths of :mod:`.packed` (bfloat16 in oneDNN's layout, or, on a CPU where PyTorch's bfloat16 product is slow,
batch products in float32; weight-only int8 and int4 kernels) and :mod:`.compiled` (the decode step compiled). For each,
:func:`measure_path` times

* the decode step at B = 1, each step followed by one pass of the **matrix-product floor**: the same matrices,
  each multiplied once by a one-row input, back to back, nothing else -- what the step would cost if everything
  between the products were free (both clocks in one run, a step apart: :func:`paired_steps`);
* the decode step at a larger batch (tokens per second);
* its **quality**: the KL divergence of its next-token distributions from the float32 path's on held-out text,
  with the share of positions where the top token is the same (chapter 07's statistics), from the engine's
  own logits (:meth:`~.model_runner.ModelRunner.sequence_logits`).

:func:`profile_decode` answers *where does a step's time go*: PyTorch's profiler over a run of decode steps,
the time of each operator the runner calls summed into a few classes (matrix products, attention, the paged
cache's reads and writes, element-wise arithmetic, tensor bookkeeping, the rest), and the time left between
them (Python). The profiler adds a little time to every
operator it records, most to the cheapest ones; the profile says how much the profiled step took next to the
unprofiled one. :func:`profile_prefill` does the same for the steps that feed prompt tokens (whole prefills or,
with chunked prefill, the prompt's chunks), with the FLOPs of each step's matrix products and, given the
machine's compute roof, the time they would take at it.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from ..evaluate import mean_and_se, token_stats
from ..measure import release_memory
from ..validation import check_finite, check_positive_int
from .engine import LLMEngine
from .model_runner import RunnerWeights
from .packed import UpcastLinear, linear

#: (label, dtype, pack) of the paths the course measures, the readable one first: each row adds one lever.
PATHS = [("float32", "float32", "none"), ("bfloat16", "bfloat16", "none"),
         ("bfloat16, oneDNN-prepacked", "bfloat16", "onednn"),
         ("bfloat16, batch products in float32", "bfloat16", "upcast"),
         ("bfloat16, compiled decode step", "bfloat16", "compiled"),
         ("int8 weights, bf16 activations", "bfloat16", "int8"), ("int4 weights, bf16 activations", "bfloat16", "int4")]

#: The eager bfloat16 paths that keep every weight, the quickest first where a CPU has them (oneDNN's bfloat16
#: kernels and the float32 batch products are for different CPUs: :func:`available_paths` never gives both).
_EAGER_BF16 = ("bfloat16, oneDNN-prepacked", "bfloat16, batch products in float32", "bfloat16")

#: What each path adds to the path it builds on (the ablation's rows): label -> (the labels of the paths it may
#: build on, the first measured one taken; the lever).
LEVERS = {"bfloat16": (("float32",), "bfloat16 weights and activations (half the bytes)"),
          "bfloat16, oneDNN-prepacked": (("bfloat16",), "the same bf16 weights stored once in oneDNN's layout"),
          "bfloat16, batch products in float32": (("bfloat16",),
                                                  "products of a batch or a prefill in float32, the bf16 weights "
                                                  "converted slice by slice (PyTorch's own bf16 product is slow on "
                                                  "this CPU); one-row products unchanged"),
          "bfloat16, compiled decode step": (_EAGER_BF16,
                                             "the whole decode step compiled by torch.compile (one call; element-wise "
                                             "work fused into generated loops; weights frozen as constants)"),
          "int8 weights, bf16 activations": (_EAGER_BF16,
                                             "weight-only int8 kernel (one byte per weight, a scale per row)"),
          "int4 weights, bf16 activations": (("int8 weights, bf16 activations", *_EAGER_BF16),
                                             "weight-only int4 kernel (half a byte per weight, scales per group)")}


def ablation(figures) -> list[tuple["PathFigures", "PathFigures", str]]:
    """(path, the measured path it builds on, the lever) for each of ``figures`` but the first: the first of its
    bases (:data:`LEVERS`) that was measured, else the path measured just before it."""
    by_label = {f.label: f for f in figures}
    out = []
    for i, f in enumerate(figures):
        if f.label not in LEVERS or i == 0:
            continue
        bases, lever = LEVERS[f.label]
        base = next((by_label[b] for b in bases if b in by_label), figures[i - 1])
        out.append((f, base, lever))
    return out


#: Operator classes of a profile, in the order they are shown, each with the operator names it holds.
OP_CLASSES = {
    "matrix products": ("aten::addmm", "aten::mm", "aten::matmul", "aten::linear", "mkldnn::_linear_pointwise",
                        "course::upcast_linear",
                        "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int4pack_mm"),
    "attention": ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_attention_math", "aten::_softmax", "aten::softmax", "aten::bmm",
                  "aten::baddbmm"),
    "paged cache (write, gather)": ("aten::index_copy_", "aten::index_select"),
    "element-wise (norms, rotary, activation, residual)": (
        "aten::mul", "aten::add", "aten::add_", "aten::pow", "aten::mean", "aten::rsqrt", "aten::sum", "aten::div_",
        "aten::silu", "aten::roll", "aten::neg", "aten::rms_norm", "aten::_fused_rms_norm", "aten::copy_",
        "aten::_to_copy", "aten::to", "aten::cat", "aten::fill_", "aten::zero_", "aten::masked_fill_",
        "aten::embedding"),
    "tensor bookkeeping (views, allocation)": (
        "aten::view", "aten::as_strided", "aten::slice", "aten::select", "aten::transpose", "aten::reshape",
        "aten::narrow", "aten::split", "aten::chunk", "aten::unbind", "aten::empty", "aten::empty_strided",
        "aten::empty_like", "aten::t", "aten::permute", "aten::expand", "aten::unsqueeze", "aten::detach",
        "aten::alias", "aten::_reshape_alias", "aten::contiguous", "aten::clone", "aten::resize_", "aten::lift_fresh",
        "aten::index", "aten::zeros", "aten::new_zeros", "aten::new_empty"),
}
COMPILED = "compiled graph's own code (fused loops: attention, norms, rotary, activation; guards, wrapper)"
OTHER = "everything else (argmax, step set-up)"
PYTHON = "Python between operators"
#: Every class a :class:`StepProfile` reports, in order.
CLASSES = [*OP_CLASSES, COMPILED, OTHER, PYTHON]


def available_paths(device="cpu", paths=PATHS) -> list[tuple[str, str, str]]:
    """The ``paths`` this PyTorch build and this machine can run on ``device``: each packing is tried on a small
    matrix (oneDNN's bfloat16 linear, for one, exists only on some CPUs and builds); ``"upcast"`` only where
    PyTorch's own bfloat16 product is slow (elsewhere it would measure nothing new)."""
    from .packed import bf16_products_are_slow, pack_matrix, prepack_matrix
    device = torch.device(device)
    out = []
    for label, dtype, pack in paths:
        try:
            w = torch.randn(64, 128, device=device)
            x = torch.randn(1, 128, device=device, dtype=getattr(torch, dtype))
            if pack == "onednn":
                linear(x, prepack_matrix(w.to(torch.bfloat16)))
            elif pack == "upcast":
                if not bf16_products_are_slow(device):
                    continue                      # PyTorch's own bfloat16 product is the quick one here
            elif pack == "compiled":
                from .compiled import check_compiler
                check_compiler(device)
            elif pack != "none":
                linear(x, pack_matrix(w, pack, getattr(torch, dtype)))
        except (ValueError, RuntimeError, NotImplementedError):
            continue
        out.append((label, dtype, pack))
    return out


def fastest_exact_bf16(paths) -> str:
    """Of ``paths`` (``(label, dtype, pack)`` triples or :class:`PathFigures`, e.g. :func:`available_paths`), the
    packing of the quickest eager one that keeps the bfloat16 weights: ``"onednn"`` where it is among them, else
    ``"upcast"`` where it is, else ``"none"`` (the compiled step keeps them too, but rounds in other places and
    costs a compile: not "eager")."""
    packs = {p.pack if isinstance(p, PathFigures) else p[2] for p in paths}
    return next((p for p in ("onednn", "upcast") if p in packs), "none")


#: The packings that keep every bfloat16 weight (the paths the 1.3x floor target is set for).
BF16_WEIGHT_PACKS = ("none", "onednn", "upcast", "compiled")


def fastest_bf16(figures) -> "PathFigures":
    """Of measured ``figures``, the bfloat16 path that keeps every weight (dense, oneDNN, compiled) with the
    quickest B = 1 step in this run."""
    keep = [f for f in figures if f.dtype == "bfloat16" and f.pack in BF16_WEIGHT_PACKS]
    if not keep:
        raise ValueError("no bfloat16 path with unquantized weights among the figures")
    return min(keep, key=lambda f: f.step_s)


def op_class(name: str) -> str:
    """The class of :data:`OP_CLASSES` a profiled operator's name belongs to (:data:`OTHER` if none)."""
    for cls, names in OP_CLASSES.items():
        if name in names:
            return cls
    return OTHER


def path_engine(model, weights: RunnerWeights, slots: int, prompt_len: int, new_tokens: int) -> LLMEngine:
    """An engine with ``slots`` slots and enough blocks for prompts of ``prompt_len`` and ``new_tokens`` answers
    (:func:`~course_utils.batching.pool_blocks`; prefix caching off: every run computes its prompt)."""
    from ..batching import pool_blocks
    return LLMEngine(model, num_blocks=pool_blocks([prompt_len], [new_tokens], block_size=16, slots=slots),
                     block_size=16, max_num_seqs=slots, prefix_caching=False, weights=weights)


def decode_steps(engine: LLMEngine, prompts: list, new_tokens: int) -> list[float]:
    """Run the requests to the end (``ignore_eos``); the seconds of each decode step (the prefill steps left out)."""
    first = len(engine.steps)
    engine.generate(prompts, new_tokens, ignore_eos=True)
    return [s.end_s - s.start_s for s in engine.steps[first:] if not s.is_prefill]


def paired_steps(engine: LLMEngine, prompt: list, new_tokens: int, floor) -> tuple[list[float], list[float]]:
    """Run one request to the end (``ignore_eos``), timing one call of ``floor`` right after each decode step: the
    seconds of each decode step and of the floor pass beside it (the prefill step left out). Step and floor take
    turns a step apart, so a machine whose speed drifts (another program, a virtual machine's neighbours) slows
    both alike."""
    engine.add_request(prompt, new_tokens, ignore_eos=True)
    steps, floors = [], []
    while engine.has_unfinished():
        engine.step()
        if not engine.steps[-1].is_prefill:
            steps.append(engine.steps[-1].end_s - engine.steps[-1].start_s)
            t0 = time.perf_counter()
            floor()
            floors.append(time.perf_counter() - t0)
    return steps, floors


def matrix_pass(runner):
    """A function that multiplies every matrix of one decode step once by a one-row input, as the step does (a
    compiled step multiplies them in oneDNN's layout, where this build has it: so does its floor)."""
    mats = [m.weight if isinstance(m, UpcastLinear) else m for m in runner.step_matrices()]   # one row: the same
    if runner.compiled is not None and runner.dtype == torch.bfloat16:
        from .packed import prepack_matrix
        try:
            mats = [prepack_matrix(m) for m in mats]
        except ValueError:
            pass
    xs = {}
    for m in mats:
        xs.setdefault(m.shape[1], torch.randn(1, m.shape[1], dtype=runner.dtype, device=runner.device))
    return lambda: [linear(xs[m.shape[1]], m) for m in mats]


#: Decode steps at B = ``batch`` that :func:`measure_path` leaves out of its median: they warm the batch's
#: shapes up (and compile them, on the compiled path) -- instead of a warm-up run, which would prefill every
#: prompt of the batch once more.
BATCH_WARMUP_STEPS = 2


@dataclass
class PathFigures:
    """What :func:`measure_path` measured for one path."""

    label: str
    dtype: str
    pack: str
    step_s: float                 # median decode step at B = 1
    floor_s: float                # median of the matrix-product pass, timed in turns with the steps
    weight_bytes: int             # bytes of weights one step reads
    batch: int
    batch_step_s: float           # median decode step at B = batch
    kld: float | None = None      # mean KL divergence from the reference path (nats/token); None for the reference
    kld_se: float | None = None
    same_top: float | None = None
    positions: int = 0            # held-out positions the quality figures are taken over
    step_samples: list = field(default_factory=list, repr=False)
    profile: "StepProfile | None" = None   # where a B = 1 step's time goes (``profile_tokens`` > 0)
    compile_s: dict = field(default_factory=dict)   # pack "compiled": (batch, blocks) -> seconds its compile took

    @property
    def over_floor(self) -> float:
        """The step's time over its matrix-product floor's (1.0: nothing but the products)."""
        return self.step_s / self.floor_s

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput at B = ``batch``."""
        return self.batch / self.batch_step_s

    def over_bandwidth_floor(self, bandwidth_Bps: float) -> float:
        """The step's time over the time to read its weights once at ``bandwidth_Bps``."""
        return self.step_s / (self.weight_bytes / bandwidth_Bps)


def measure_path(model, label: str, dtype: str, pack: str, *, prompts: list, heldout_ids: list[int],
                 reference_logp: torch.Tensor | None = None, new_tokens: int = 48, rounds: int = 3,
                 batch: int = 16, profile_tokens: int = 0) -> tuple[PathFigures, torch.Tensor]:
    """Measure one path (see the module's docstring); returns its figures and its log-probabilities on
    ``heldout_ids`` (pass the reference path's as ``reference_logp`` to the others).

    ``prompts``: at least ``batch`` prompts (token-id lists); B = 1 runs the first. Each of ``rounds`` rounds
    runs one request of ``new_tokens`` tokens with a matrix-product pass after each decode step
    (:func:`paired_steps`), after a warm-up of both. At B = ``batch``, one run of the prompts to ``new_tokens``
    tokens, its first :data:`BATCH_WARMUP_STEPS` decode steps left out.
    ``profile_tokens`` > 0: :func:`profile_decode` then profiles a B = 1 request of that many tokens on the same
    engine (``figures.profile``)."""
    check_positive_int("rounds", rounds)
    check_positive_int("batch", batch)
    check_positive_int("new_tokens", new_tokens)
    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2 (the first token comes from the prefill step)")
    if len(prompts) < batch:
        raise ValueError(f"need at least batch = {batch} prompts, got {len(prompts)}")
    if len(heldout_ids) < 2:
        raise ValueError("heldout_ids needs at least 2 tokens")
    weights = RunnerWeights.from_model(model, dtype, pack=pack)
    prompt_len = max(len(p) for p in prompts[:batch])
    one = path_engine(model, weights, 1, max(prompt_len, len(heldout_ids)), new_tokens)   # room for sequence_logits
    logits = one.runner.decode_logits if pack == "compiled" else one.runner.sequence_logits   # what its decode runs
    logp = torch.log_softmax(logits(heldout_ids), -1)
    quality = {}
    if reference_logp is not None:
        stats = token_stats(reference_logp[:-1], logp[:-1], torch.tensor(heldout_ids[1:]))
        kld, se = mean_and_se(stats["kld"])
        quality = dict(kld=kld, kld_se=se, same_top=float(stats["same_top"].double().mean()),
                       positions=len(heldout_ids) - 1)
    floor = matrix_pass(one.runner)
    floor()
    paired_steps(one, prompts[0], min(new_tokens, 4), floor)                     # warm-up
    floors, steps = [], []
    for _ in range(rounds):
        st, fl = paired_steps(one, prompts[0], new_tokens, floor)
        steps += st
        floors += fl
    profiled = profile_decode(one, prompts[:1], profile_tokens, label=label) if profile_tokens else None
    many = path_engine(model, weights, batch, prompt_len, new_tokens)
    batch_steps = decode_steps(many, prompts[:batch], new_tokens)
    batch_steps = batch_steps[min(BATCH_WARMUP_STEPS, len(batch_steps) - 1):]    # the first steps warm up: left out
    figures = PathFigures(label, dtype, pack, statistics.median(steps), statistics.median(floors),
                          one.runner.step_weight_bytes(), batch, statistics.median(batch_steps),
                          step_samples=steps, profile=profiled, **quality)
    for e in (one, many):
        if e.runner.compiled is not None:
            figures.compile_s.update(e.runner.compiled.compile_s)
    if pack == "compiled":
        from .compiled import release_compiled
        del one, many
        release_compiled()                    # its graphs hold a frozen copy of the weights each
    return figures, logp


def measure_paths(model, paths=PATHS, **kw) -> list[PathFigures]:
    """:func:`measure_path` for each ``(label, dtype, pack)``, the first (the reference) before the others."""
    out, ref = [], None
    for label, dtype, pack in paths:
        figures, logp = measure_path(model, label, dtype, pack, reference_logp=ref, **kw)
        ref = logp if ref is None else ref
        out.append(figures)
        del logp
        release_memory()                  # one path's weights gone before the next path's are built
    return out


@dataclass
class StepProfile:
    """Where a decode step's (or a prefill step's) time went, by operator class (:data:`OP_CLASSES`)."""

    label: str
    ms_per_step: dict             # class -> milliseconds of operators' own time per step
    calls_per_step: dict          # class -> operator calls per step
    profiled_step_s: float        # the median step while the profiler recorded
    step_s: float                 # the median step without it, just before
    steps: int
    prompt_tokens: float = 0.0    # prompt tokens a profiled step fed, on average (:func:`profile_prefill`)
    matrix_flops: float = 0.0     # FLOPs of a profiled step's matrix products, on average (:func:`profile_prefill`)
    floor_s: float | None = None  # those FLOPs at the compute roof given to :func:`profile_prefill`

    @property
    def total_ms(self) -> float:
        return sum(self.ms_per_step.values())


@contextlib.contextmanager
def _quiet_stderr():
    """Silence the profiler library's own start/stop lines, which it writes straight to file descriptor 2."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def profile_decode(engine: LLMEngine, prompts: list, new_tokens: int, *, label: str = "") -> StepProfile:
    """Profile the decode steps of ``prompts`` run to ``new_tokens`` tokens (keep it small: the profiler holds every
    event, some 60 MB per 8 steps of the embedded model): each operator the runner calls (with
    what it calls in turn) by class, in milliseconds and calls per decode step, and what is left of each step's
    time between those operators (:data:`PYTHON`). Each step is recorded as a range of its own; the prefill
    steps are left out."""
    check_positive_int("new_tokens", new_tokens)
    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2 (the first token comes from the prefill step)")
    plain = statistics.median(decode_steps(engine, prompts, new_tokens))
    steps, profiled_steps, ms, calls = _profiled(engine, "decode step", lambda: decode_steps(engine, prompts,
                                                                                              new_tokens))
    return StepProfile(label, ms, calls, statistics.median(steps), plain, profiled_steps)


def _profiled(engine: LLMEngine, step: str, run):
    """``run()`` under the profiler, each runner step a range of its own (:func:`_recording_steps`): (what ``run``
    returned, the profiled steps named ``step``, ms per step by class with :data:`PYTHON` the time left between
    the operators, calls per step by class)."""
    from torch.profiler import ProfilerActivity, profile
    _recording_steps(engine)
    try:
        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
            out = run()
    finally:
        del engine.runner.run
    profiled_steps, step_ms, ms, calls = _by_class(prof.events(), step)
    del prof
    release_memory()                      # the profiler's records are many small buffers: hand them back
    ms[PYTHON] = max(0.0, step_ms - sum(ms.values()))
    n = max(profiled_steps, 1)
    return out, profiled_steps, {k: v / n for k, v in ms.items()}, {k: v / n for k, v in calls.items()}


def _recording_steps(engine: LLMEngine):
    """Wrap the engine's runner so that each step is a profiler range of its own: ``"prefill step"`` where it feeds
    prompt tokens, else ``"decode step"``; ``del engine.runner.run`` takes the wrapper off."""
    from torch.profiler import record_function
    run = engine.runner.run

    def recorded(seqs):
        with record_function("prefill step" if any(s.in_prefill for s in seqs) else "decode step"):
            return run(seqs)

    engine.runner.run = recorded


def prefill_step_records(engine: LLMEngine, prompts: list) -> list:
    """Run the requests to their first token (the prefill alone); the engine's records of the steps that fed
    prompt tokens (:class:`~.engine.StepRecord`). A prompt the engine refuses raises its ``ValueError``."""
    first = len(engine.steps)
    for r in engine.generate(prompts, 1, ignore_eos=True):
        if r.finish_reason == "error":
            raise ValueError(f"the engine refused a prompt: {r.error}")
    return [s for s in engine.steps[first:] if s.num_prefill_tokens > 0]


def step_matrix_flops(runner, num_tokens: int, num_seqs: int) -> float:
    """FLOPs of one step's matrix products: 2 x tokens x weights of every layer's matrices, and 2 x sequences x
    weights of the LM head (it multiplies each sequence's last new token only)."""
    *layers, head = runner.step_matrices()
    return 2.0 * (num_tokens * sum(m.shape[0] * m.shape[1] for m in layers) + num_seqs * head.shape[0] * head.shape[1])


def profile_prefill(engine: LLMEngine, prompts: list, *, label: str = "",
                    roof_flops: float | None = None) -> StepProfile:
    """Profile the steps that feed ``prompts``' tokens (whole prefills, or with chunked prefill each chunk of a
    prompt) as :func:`profile_decode` profiles decode steps: each operator the runner calls by class, in
    milliseconds and calls per step, averaged over the steps, and the time left between them (:data:`PYTHON`).
    The prompts run three times, each to its first token: once to warm their shapes up, once for the unprofiled
    median step, once under the profiler. The engine needs prefix caching off (else the later runs would find
    the prompts cached) and its step history on. ``roof_flops``: the machine's compute roof (FLOP/s, e.g.
    :func:`~course_utils.measure.compute_roof_flops` in the weights' dtype); given, ``floor_s`` is the time the
    steps' matrix products would take at it."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {prompts!r:.80}")
    if engine.block_manager.prefix_caching:
        raise ValueError("profile_prefill runs the prompts three times: it needs an engine with prefix_caching=False")
    if not engine.keep_history:
        raise ValueError("profile_prefill reads the engine's step records: it needs an engine with keep_history=True")
    if roof_flops is not None:
        check_finite("roof_flops", roof_flops, minimum=0.0, strict=True)
    prefill_step_records(engine, prompts)                          # every shape once, unclocked
    plain = statistics.median(s.end_s - s.start_s for s in prefill_step_records(engine, prompts))
    steps, profiled_steps, ms, calls = _profiled(engine, "prefill step", lambda: prefill_step_records(engine, prompts))
    flops = statistics.mean(step_matrix_flops(engine.runner, s.num_tokens, s.num_seqs) for s in steps)
    return StepProfile(label, ms, calls, statistics.median(s.end_s - s.start_s for s in steps), plain, profiled_steps,
                       prompt_tokens=statistics.mean(s.num_prefill_tokens for s in steps), matrix_flops=flops,
                       floor_s=None if roof_flops is None else flops / roof_flops)


def _is_wrapper(name: str) -> bool:
    """Events of a compiled region that hold the region's operators (its own time: :data:`COMPILED`)."""
    return name.startswith(("Torch-Compiled Region", "## Call CompiledFxGraph", "TorchDynamo Cache Lookup",
                            "AOTDispatcher", "Pregraph bytecode", "CompiledFunction"))


def _by_class(events, step: str) -> tuple[int, float, dict, dict]:
    """(steps, their milliseconds, ms by class, calls by class) of a profile: the operators each range named
    ``step`` (``"decode step"``, ``"prefill step"``) holds directly, each with everything it calls."""
    decode = [e for e in events if e.name == step]
    ms = {cls: 0.0 for cls in CLASSES}
    calls = dict.fromkeys(ms, 0)
    for event in events:
        parent = event.cpu_parent
        while parent is not None and _is_wrapper(parent.name):      # a compiled region's operators count as the step's
            parent = parent.cpu_parent
        if parent is None or parent.name != step:
            continue
        if _is_wrapper(event.name):
            ms[COMPILED] += event.self_cpu_time_total / 1e3
            calls[COMPILED] += event.name.startswith("## Call")
            continue
        cls = op_class(event.name)
        ms[cls] += event.cpu_time_total / 1e3
        calls[cls] += 1
    return len(decode), sum(e.cpu_time_total for e in decode) / 1e3, ms, calls


def profile_figure(profiles: list[StepProfile], *, title: str | None = None):
    """One stacked bar per path: milliseconds of each operator class per decode step, the unprofiled step marked."""
    from ..plots import PALETTE, figure
    fig = figure(title or "Where a decode step's time goes (B = 1), by operator class",
                 "milliseconds per decode step (under the profiler)", "", height=340)
    for i, cls in enumerate(CLASSES):
        fig.add_bar(y=[p.label for p in profiles], x=[p.ms_per_step[cls] for p in profiles], orientation="h",
                    name=cls, marker_color=PALETTE[i % len(PALETTE)],
                    hovertemplate=[f"{cls}: %{{x:.2f}} ms, {p.calls_per_step[cls]:.0f} calls/step<extra></extra>"
                                   for p in profiles])
    fig.add_scatter(y=[p.label for p in profiles], x=[p.step_s * 1e3 for p in profiles], mode="markers",
                    marker=dict(symbol="line-ns-open", size=22, color="black"), name="step without the profiler")
    fig.update_layout(barmode="stack", legend=dict(orientation="h", y=-0.35))
    return fig
