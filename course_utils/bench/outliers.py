"""Chapter 06 rows: recording the residual stream, how far its top dimension stands out, the fixes' errors."""
from __future__ import annotations

import time

from ..outliers import capture_projection_inputs, dim_max, fix_errors, outlier_dims, pick_layers, residual_stream, \
    short_name
from . import Row

_SECTION = "06 activation outliers"
_PROMPT = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin of oil "
          "and a cloth for the lens. He had done this for thirty-one years, through winter storms that shook "
          "the tower and calm summer nights when the sea lay flat as glass.")


def rows(ctx):
    """Recording time, how far the top residual dimension stands out, and the fixes' errors."""
    model, tok = ctx.model()
    ids = tok(_PROMPT, return_tensors="pt").input_ids
    t0 = time.perf_counter()
    h = residual_stream(model, ids)
    yield Row(_SECTION, "record the residual stream (hooks, one forward)", time.perf_counter() - t0, "s",
              note=f"{h.shape[0]} layers x {h.shape[1]} tokens x {h.shape[2]} dims")
    maxima = dim_max(h)
    top = outlier_dims(maxima, 1)[0]
    yield Row(_SECTION, "top residual dimension's max / median dimension's max", (maxima[:, top].max() /
              maxima.median(dim=1).values.max()).item(), "x", note=f"dimension {top}")
    inputs = capture_projection_inputs(model, ids)
    for role, name in pick_layers(inputs).items():
        w = dict(model.named_modules())[name].weight.detach().float().cpu()
        errs = fix_errors(inputs[name], w)
        yield Row(_SECTION, f"per-tensor / per-token INT8 error, {role}", errs["activations per-tensor"] /
                  errs["activations per-token"], "x", note=f"{short_name(name)}: " + ", ".join(
                      f"{k.split(',')[0]} {v:.4f}" for k, v in errs.items())[:160])
