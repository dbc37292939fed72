"""Chapter 08 rows: n-gram lookup per shipped prompt (ours and transformers'), a draft model's measured speedup
against its prediction, and the trained next-next head's acceptance."""
from __future__ import annotations

import statistics
import time

import torch

from ..evaluate import top1_agreement
from ..hooks import decoder_layers
from ..kv_cache import greedy_cached
from ..prompts import book_split, chat_prompt_ids, token_ids
from ..reference import greedy_settings
from ..speculative import (DraftModel, HeadGuess, NgramLookup, copy_fraction, draft_cost_ratio, early_exit_draft,
                           lookup_prompts, next_next_data, predicted_speedup, speculative_generate,
                           train_next_next_head, verification_cost)
from . import Row

_SECTION = "08 speculative decoding"


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _hf(model, prompt, n, **kw):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         **greedy_settings(), **kw)
    return out[0, ids.shape[1]:].tolist()


def _plain(model, prompt, n):
    return greedy_cached(model, torch.tensor([prompt], device=model.device), n)[0].tolist()


def _lookup_rows(ctx, model, tok, gamma=8):
    """Each shipped prompt: ours vs our plain loop, and ours vs transformers' prompt lookup, interleaved."""
    repeats = ctx.sizes(3, 1)
    for item in lookup_prompts():
        p = chat_prompt_ids(tok, item["text"]) if item["kind"] == "chat" else token_ids(tok, item["text"])[0].tolist()
        n = ctx.sizes(item["max_new_tokens"], 8)
        times = {k: [] for k in ("plain", "ours", "hf")}
        for _ in range(repeats):                                        # A, B, C, A, B, C, ...
            plain, s = _timed(lambda: _plain(model, p, n))
            times["plain"].append(s)
            ours, s = _timed(lambda: speculative_generate(model, NgramLookup(), p, n, gamma))
            times["ours"].append(s)
            hf, s = _timed(lambda: _hf(model, p, n, prompt_lookup_num_tokens=gamma))
            times["hf"].append(s)
        med = {k: statistics.median(v) for k, v in times.items()}
        same = ours.tokens == plain == hf
        frac = copy_fraction(p, plain)
        target = ">= 2.5x" if item["name"] == "repetitive text" else None
        speed = med["plain"] / med["ours"]
        yield Row(_SECTION, f"n-gram lookup / plain loop, {item['name']}", speed, "x", target,
                  None if target is None else speed >= 2.5,
                  note=f"copy fraction {frac:.0%}, {ours.stats.tokens_per_pass:.2f} tokens per pass, gamma {gamma}, "
                       f"{n} tokens; identical tokens: {same}")
        yield Row(_SECTION, f"transformers' prompt lookup time / ours, {item['name']}", med["hf"] / med["ours"], "x",
                  ">= 1.0", med["hf"] / med["ours"] >= 1.0, note=f"median of {repeats} interleaved runs each")


def _draft_rows(ctx, model, tok):
    """An early-exit draft: α from calibration prompts, its speedup predicted, then measured on held-out prompts."""
    split = book_split()
    n_new, n_prompts = ctx.sizes(48, 6), ctx.sizes(2, 1)
    calib = [token_ids(tok, split.train[i * 4000:(i + 1) * 4000], 48)[0].tolist() for i in range(n_prompts)]
    held = [token_ids(tok, split.heldout[i * 4000:(i + 1) * 4000], 48)[0].tolist() for i in range(n_prompts)]
    k = max(1, len(decoder_layers(model)) // 4)
    draft = early_exit_draft(model, k)
    agree = [top1_agreement(draft, p, _plain(model, p, n_new)) for p in calib]
    alpha = sum(a.n_agree for a in agree) / sum(a.n for a in agree)
    c = draft_cost_ratio(draft, model, calib[0], repeats=ctx.sizes(5, 1), device=ctx.device)
    v = verification_cost(model, calib[0], [1, 2, 4, 8], repeats=ctx.sizes(5, 1), device=ctx.device)
    gamma = max(v, key=lambda g: predicted_speedup(alpha, g, c, v[g]))
    predicted = predicted_speedup(alpha, gamma, c, v[gamma])
    plain_s = spec_s = 0.0
    for p in held:
        plain_s += _timed(lambda: _plain(model, p, n_new))[1]
        spec_s += speculative_generate(model, DraftModel(draft, model), p, n_new, gamma).seconds
    measured = plain_s / spec_s
    off = abs(measured / predicted - 1)
    yield Row(_SECTION, f"draft (first {k} layers) speedup, held-out prompts", measured, "x",
              note=f"predicted {predicted:.2f}x from calibration: alpha {alpha:.3f}, c {c:.2f}, gamma {gamma}, "
                   f"v({gamma}) {v[gamma]:.2f}")
    yield Row(_SECTION, "draft speedup: measured / predicted", measured / predicted, "x", "within 25 %", off <= 0.25)
    for g in (1, 8):
        yield Row(_SECTION, f"verification pass over {g + 1} tokens / one decode step", v[g], "steps")


def _head_rows(ctx, model, tok):
    split = book_split()
    ids = token_ids(tok, split.train, ctx.sizes(4096, 64))
    t0 = time.perf_counter()
    hidden, labels = next_next_data(model, ids)
    head, losses, _ = train_next_next_head(hidden, labels, model.get_output_embeddings().weight,
                                           steps=ctx.sizes(300, 3), time_budget_s=60)
    train_s = time.perf_counter() - t0
    accepted = proposed = 0
    for i in range(ctx.sizes(2, 1)):
        p = token_ids(tok, split.heldout[i * 4000:(i + 1) * 4000], 48)[0].tolist()
        r = speculative_generate(model, HeadGuess(head), p, ctx.sizes(48, 6), 1)
        accepted, proposed = accepted + sum(r.stats.accepted), proposed + sum(r.stats.proposed)
    yield Row(_SECTION, "next-next head: acceptance of its guess, held-out", accepted / max(proposed, 1), "",
              note=f"{ids.shape[1]:,} training tokens, {len(losses)} steps, {train_s:.0f} s for data and training; "
                   f"loss {losses[0]:.2f} -> {losses[-1]:.2f}")


def rows(ctx):
    model, tok = ctx.model()
    yield from _lookup_rows(ctx, model, tok)
    yield from _draft_rows(ctx, model, tok)
    yield from _head_rows(ctx, model, tok)
