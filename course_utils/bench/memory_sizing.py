"""Chapter 03 rows: the cache-size formula against the bytes the cache tensors hold."""
from __future__ import annotations

from ..memory_sizing import kv_cache_bytes, measured_cache_bytes
from . import Row

_SECTION = "03 KV-cache memory"


def rows(ctx):
    """The formula against the bytes the cache tensors hold, in float32 and bfloat16."""
    batch, n_tokens = 2, ctx.sizes(295, 37)
    for dtype in ("float32", "bfloat16"):
        model, _ = ctx.model(dtype)
        measured = measured_cache_bytes(model, batch, n_tokens)
        formula = kv_cache_bytes(model.config, n_tokens, model.dtype, users=batch)
        yield Row(_SECTION, f"KV cache bytes/token, measured ({dtype})", measured / (batch * n_tokens), "B",
                  "= formula", measured == formula, note=f"{measured:,} B held for {batch} x {n_tokens} tokens; "
                                                        f"formula {formula:,} B")
