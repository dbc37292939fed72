"""Chapter 01 rows: model load times, cached vs recomputed generation, the decode step vs its floor."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch
from transformers import DynamicCache

from ..kv_cache import decode_one_token, greedy_cached, greedy_recompute, prefill
from ..measure import time_call, time_interleaved
from ..models import CACHE_ENV, load_model
from ..prefill_decode import decode_floor_s, decode_step_bytes
from . import Row

_SECTION = "01 KV cache"


def _load_times(ctx):
    """Seconds of a cold load (the GGUF conversion, into an empty cache folder) and of a warm one."""
    tmp, old = tempfile.mkdtemp(prefix="course-cold-"), os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = tmp
    try:
        t0 = time.perf_counter()
        load_model(ctx.model_name, device=ctx.device, verbose=False)
        cold_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_model(ctx.model_name, device=ctx.device, verbose=False)
        return cold_s, time.perf_counter() - t0
    finally:
        if old is None:
            del os.environ[CACHE_ENV]
        else:
            os.environ[CACHE_ENV] = old
        shutil.rmtree(tmp, ignore_errors=True)


def rows(ctx):
    """Load times, cached vs recomputed generation, decode step vs the bandwidth bound."""
    model, tok = ctx.model()
    if model.course_info.get("kind") == "gguf" and not ctx.reduced:   # (the reduced run: a cold conversion and a
        cold_s, warm_s = _load_times(ctx)      # cached reload are tested in tests/test_other_architecture.py)
        yield Row(_SECTION, "model load, cold (GGUF conversion)", cold_s, "s")
        yield Row(_SECTION, "model load, warm (cached conversion)", warm_s, "s", "<= 3 s", warm_s <= 3.0)
    prompt = tok("The history of the printing press begins", return_tensors="pt").input_ids.to(model.device)
    for n_new in ctx.sizes((32, 128), (8, 16)):
        same = torch.equal(greedy_recompute(model, prompt, n_new), greedy_cached(model, prompt, n_new))  # and warm-up
        loops = time_interleaved({"recompute": lambda: greedy_recompute(model, prompt, n_new),
                                  "cached": lambda: greedy_cached(model, prompt, n_new)},
                                 warmup=0, repeats=3, device=ctx.device)
        recompute_s, cached_s = loops["recompute"].median_s, loops["cached"].median_s
        yield Row(_SECTION, f"recompute / cached wall time, {n_new} new tokens", recompute_s / cached_s, "x",
                  note=f"medians of 3 taken in turns: cached {cached_s:.2f} s, recompute {recompute_s:.2f} s, "
                       f"tokens identical: {same}")
    cache = DynamicCache(config=model.config)
    first = prefill(model, prompt, cache).argmax(-1, keepdim=True)
    step = time_call(lambda: decode_one_token(model, first, cache), warmup=2, repeats=10, device=ctx.device)
    # each timed call appends one position; the extra positions do not change the step's cost measurably
    step_bytes = decode_step_bytes(model, prompt.shape[1])
    floor_s = decode_floor_s(step_bytes, ctx.bandwidth_Bps())
    yield Row(_SECTION, "memory read bandwidth", ctx.bandwidth_Bps() / 1e9, "GB/s")
    yield Row(_SECTION, "decode step (batch 1), median", step.median_s * 1e3, "ms")
    yield Row(_SECTION, "decode step / (bytes read / bandwidth)", step.median_s / floor_s, "x",
              note=f"floor {floor_s * 1e3:.1f} ms for {step_bytes / 1e6:.0f} MB")
