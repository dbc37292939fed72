"""Chapter 07 rows: seconds of each measurement on the reference model, the chapter's total time, and the
KL divergence of INT8 per-row and INT4 group-128 from the reference."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from ..evaluate import Windows, compare_to_reference, load_battery, record_reference, run_battery, top1_agreement
from ..kv_quant import KVQuantSpec, QuantizedKVCache
from ..prompts import book_split, chat_prompt_ids, token_ids
from ..quantize import CHAPTER_SCHEMES, WeightQuantizer, awq_model_scales
from ..reference import reference_generate
from . import Row

_SECTION = "07 evaluating quantization"
SUMMARY = Path(__file__).resolve().parents[2] / "build" / "summary.json"


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _kld_rows(ctx, model, tok):
    n = ctx.sizes(2048, 16)
    windows = Windows(n, ctx.sizes(1152, 24), ctx.sizes(1024, 16), ctx.sizes(256, 8))
    ids = token_ids(tok, book_split().heldout, windows.tokens_needed)
    with tempfile.TemporaryDirectory(prefix="bench07-") as folder:
        ref, s = _timed(lambda: record_reference(model, ids, windows, spill_dir=folder))
        yield Row(_SECTION, "record the reference (log-probabilities to disk)", s, "s", note=f"{n} predictions")
        same = compare_to_reference(model, ref)
        yield Row(_SECTION, "compare a candidate with the reference (KL statistics)", same.seconds, "s",
                  note=f"the reference against itself: largest KLD {abs(same.kld).max():.1e}")
        kv = compare_to_reference(model, ref, cache_factory=lambda: QuantizedKVCache(model.config, KVQuantSpec(4)))
        yield Row(_SECTION, "compare with an int4 KV cache", kv.seconds, "s", note=f"mean KLD {kv.mean_kld[0]:.2e} nats")
        wq = WeightQuantizer(model)
        try:
            for name in ("INT8 per-row", "INT4 group-128"):
                wq.apply(CHAPTER_SCHEMES[name])
                r = compare_to_reference(model, ref)
                yield Row(_SECTION, f"mean KLD vs the reference, {name}", r.mean_kld[0], "nats",
                          note=f"± {r.mean_kld[1]:.1e}; same top p {r.same_top_p[0]:.1%}; PPL ratio {r.ppl_ratio[0]:.3f}")
        finally:
            wq.release()
        ref.release()


def _generation_rows(ctx, model, tok):
    prompt = chat_prompt_ids(tok, "Explain how a lighthouse works and why ships still need them.")
    (tokens, _), s = _timed(lambda: reference_generate(model, prompt, ctx.sizes(144, 8)))
    yield Row(_SECTION, "the reference's greedy output for agreement", s, "s", note=f"{len(tokens)} tokens")
    agree, s = _timed(lambda: top1_agreement(model, prompt, tokens))
    yield Row(_SECTION, "agreement, one candidate (one forward pass)", s, "s", note=f"{agree.n_agree}/{agree.n}")
    questions = load_battery()
    res, s = _timed(lambda: run_battery(model, tok, questions, repetition_penalties=(1.0, 1.1),
                                        max_new_tokens=ctx.sizes(16, 2)))
    yield Row(_SECTION, "battery, 16 questions x 2 repetition penalties", s, "s",
              note=f"{res.accuracy(1.0)[0]}/16 right without penalty")
    _, s = _timed(lambda: awq_model_scales(model, tok, book_split(), CHAPTER_SCHEMES["INT4 group-128"],
                                           n_tokens=ctx.sizes(256, 16), n_grid=ctx.sizes(10, 2)))
    yield Row(_SECTION, "AWQ-style scales for the whole model", s, "s")


def _chapter_row(ctx):
    """The chapter's wall time in the last main job (``build/summary.json``), when it ran chapter 07 on this model."""
    try:
        summary = json.loads(SUMMARY.read_text())
        if summary.get("parameters", {}).get("MODEL", "embedded") != ctx.model_name:
            return
        row = next(e for e in summary["results"] if str(e.get("notebook", "")).startswith("07"))
        seconds = float(row["seconds"])
    except (OSError, ValueError, KeyError, StopIteration, AttributeError, TypeError):
        return
    yield Row(_SECTION, "the chapter, whole (last main job)", seconds, "s", "<= 300", seconds <= 300,
              note=f"{summary.get('date', '')}; {row.get('status', '')}; kernel peak RSS "
                   f"{row.get('peak_rss_bytes', 0) / 1e6:,.0f} MB")


def rows(ctx):
    """Seconds of each measurement; the chapter's time; INT8 per-row and INT4 group-128 KL divergences."""
    model, tok = ctx.model()
    yield from _kld_rows(ctx, model, tok)
    yield from _generation_rows(ctx, model, tok)
    yield from _chapter_row(ctx)
