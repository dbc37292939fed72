"""Chapter 02 rows: prefill cost per token, the decode step against the cache length and its floor."""
from __future__ import annotations

from ..prefill_decode import decode_floor_s, decode_step_bytes, decode_sweep, prefill_sweep
from ..prompts import book_token_ids
from . import Row

_SECTION = "02 prefill vs decode"


def rows(ctx):
    """Prefill cost per token, decode step vs cache length, bandwidth and the decode floor."""
    model, tok = ctx.model()
    lengths = list(ctx.sizes((16, 256, 1024), (8, 32)))
    ids = book_token_ids(tok, lengths[-1] + 1, device=model.device)
    for point in prefill_sweep(model, ids, lengths, repeats=3, token_budget=2048, device=ctx.device, progress=False):
        yield Row(_SECTION, f"prefill per token, P = {point.n_tokens}", point.per_token_s * 1e3, "ms",
                  note=f"{point.median_s * 1e3:,.0f} ms for the whole prompt, {len(point.timing.samples_s)} runs")
    steps = decode_sweep(model, ids, lengths, repeats=5, device=ctx.device, progress=False)
    for point in steps:
        yield Row(_SECTION, f"decode step, C = {point.n_tokens} cached tokens", point.median_s * 1e3, "ms",
                  note=f"spread ±{point.timing.spread_s * 1e3:.1f} ms")
    yield Row(_SECTION, "memory read bandwidth", ctx.bandwidth_Bps() / 1e9, "GB/s")
    step_bytes = decode_step_bytes(model, steps[0].n_tokens)
    floor_s = decode_floor_s(step_bytes, ctx.bandwidth_Bps())
    yield Row(_SECTION, f"decode step (C = {steps[0].n_tokens}) / (bytes read / bandwidth)", steps[0].median_s / floor_s,
              "x", note=f"floor {floor_s * 1e3:.1f} ms for {step_bytes / 1e6:,.0f} MB read per step")
