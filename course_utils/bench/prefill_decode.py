"""Chapter 02 rows: prefill cost per token, the decode step against the cache length, its floor and the roofline."""
from __future__ import annotations

from ..measure import measure_matmul_flops
from ..prefill_decode import (arithmetic_intensity, decode_floor_s, decode_step_bytes, decode_sweep, forward_flops,
                              prefill_flops,
                              prefill_bytes, prefill_sweep, ridge_intensity)
from ..prompts import book_token_ids
from . import Row

_SECTION = "02 prefill vs decode"


def rows(ctx):
    """Prefill cost per token, decode step vs cache length, the two roofs, the decode floor, both intensities."""
    model, tok = ctx.model()
    lengths = list(ctx.sizes((16, 256, 1024), (8, 32)))
    ids = book_token_ids(tok, lengths[-1] + 1, device=model.device)
    prefills = prefill_sweep(model, ids, lengths, repeats=3, token_budget=3072, device=ctx.device, progress=False)
    for point in prefills:
        yield Row(_SECTION, f"prefill per token, P = {point.n_tokens}", point.per_token_s * 1e3, "ms",
                  note=f"{point.median_s * 1e3:,.0f} ms for the whole prompt, {len(point.timing.samples_s)} runs")
    steps = decode_sweep(model, ids, lengths, repeats=5, device=ctx.device, progress=False)
    for point in steps:
        yield Row(_SECTION, f"decode step, C = {point.n_tokens} cached tokens", point.median_s * 1e3, "ms",
                  note=f"spread ±{point.timing.spread_s * 1e3:.1f} ms")
    bandwidth = ctx.bandwidth_Bps()
    peak = measure_matmul_flops(n=ctx.sizes(1024, 128), dtype=model.dtype, device=ctx.device)
    yield Row(_SECTION, "memory read bandwidth", bandwidth / 1e9, "GB/s")
    yield Row(_SECTION, "compute roof (square matrix product)", peak / 1e9, "GFLOP/s")
    yield Row(_SECTION, "ridge = compute roof / bandwidth", ridge_intensity(peak, bandwidth), "FLOP/B")
    step_bytes = decode_step_bytes(model, steps[0].n_tokens)
    step_flops = forward_flops(model, 1, steps[0].n_tokens)
    yield Row(_SECTION, f"decode arithmetic intensity, C = {steps[0].n_tokens}", arithmetic_intensity(step_flops, step_bytes),
              "FLOP/B")
    floor_s = decode_floor_s(step_bytes, bandwidth)
    yield Row(_SECTION, f"decode step (C = {steps[0].n_tokens}) / (bytes read / bandwidth)", steps[0].median_s / floor_s,
              "x", note=f"floor {floor_s * 1e3:.1f} ms for {step_bytes / 1e6:,.0f} MB read per step")
    top = prefills[-1]
    top_flops = prefill_flops(model, top.n_tokens)          # the pass that is timed: last logits, causal pairs
    yield Row(_SECTION, f"prefill P = {top.n_tokens}: share of the compute roof", 100 * top_flops / top.median_s / peak, "%",
              note=f"intensity {arithmetic_intensity(top_flops, prefill_bytes(model, top.n_tokens)):,.0f} FLOP/B")
