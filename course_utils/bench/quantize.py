"""Chapter 05 rows: seconds and bytes per scheme, AWQ vs round-to-nearest, matmul time per precision."""
from __future__ import annotations

from ..hooks import projection_modules
from ..lowbit_kernels import time_matmuls
from ..models import weight_bytes
from ..prompts import book_split
from ..quantize import CHAPTER_SCHEMES, Scheme, awq_layer, matrix_errors
from . import Row

_SECTION = "05 weight quantization"


def _scheme_rows(model):
    """Seconds to quantize every projection matrix under each scheme, and the model's bytes with it."""
    mods = projection_modules(model)
    n_weights = sum(m.weight.numel() for m in mods.values())
    other_bytes = weight_bytes(model) - sum(m.weight.nbytes for m in mods.values())
    for label, scheme in CHAPTER_SCHEMES.items():
        res = matrix_errors(model, scheme)
        yield Row(_SECTION, f"quantize every matrix, {label}", res.seconds, "s",
                  note=f"{len(res.errors)} matrices, mean error {res.mean:.4f}")
        proj_bytes = n_weights * res.bits_per_weight / 8
        yield Row(_SECTION, f"model bytes, {label}", (proj_bytes + other_bytes) / 1e6, "MB",
                  note=f"projections {proj_bytes / 1e6:.1f} MB at {res.bits_per_weight:.3f} bits/weight, the rest as "
                       f"loaded ({other_bytes / 1e6:.0f} MB); all as loaded {weight_bytes(model) / 1e6:.0f} MB")


def _awq_rows(ctx, model, tok):
    scheme = Scheme("absmax", 4, "group", 64, pad=True)
    groups = [g for g in awq_layer(model, tok, book_split(), scheme, n_tokens=ctx.sizes(512, 64)) if g.fit]
    ratios = [g.heldout["awq"] / g.heldout["rtn"] for g in groups]
    mean_ratio = sum(ratios) / len(ratios)
    yield Row(_SECTION, f"AWQ / RTN output error, held-out text, {scheme.name}", mean_ratio, "x", "< 1",
              mean_ratio < 1, note=f"mean over the {len(groups)} shared inputs of layer {groups[0].layer} "
                                   f"({'; '.join(g.label for g in groups)}); range {min(ratios):.2f}-{max(ratios):.2f}")


def _kernel_rows(ctx, model):
    """Each precision's matmul time relative to fp32, over every projection matrix."""
    weights = [m.weight for m in projection_modules(model).values()]
    res = time_matmuls(weights, ctx.device)
    for name, ratio in res.relative_to_fp32().items():
        yield Row(_SECTION, f"matmul time / fp32: {name}", ratio, "x",
                  note=f"{res.median_s[name] * 1e3:.1f} ms for {res.n_matrices} matrices; rel. error "
                       f"{res.errors.get(name, float('nan')):.1e}")
    if res.unavailable:
        yield Row(_SECTION, "matmul kernels not available on this device", len(res.unavailable), "kernels",
                  note="; ".join(f"{k}: {v}" for k, v in res.unavailable.items())[:200])


def rows(ctx):
    """Seconds and bytes per scheme; AWQ's output error vs round-to-nearest; matmul time per precision."""
    model, tok = ctx.model()
    yield from _scheme_rows(model)
    yield from _awq_rows(ctx, model, tok)
    yield from _kernel_rows(ctx, model)
