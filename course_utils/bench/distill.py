"""Chapter 09 rows: what a distillation step costs (soft vs hard labels, the chunked LM head's memory saving,
quantization-aware training's overhead) and what the teacher's top-k labels cost to make."""
from __future__ import annotations

import statistics
import time

import torch

from ..distill import (distillation_data, evenly_spaced_layers, parameter_bytes, quantization_aware, student_from_teacher,
                       train_student, training_step)
from ..hooks import decoder_layers
from ..measure import peak_memory, release_memory
from ..prompts import book_split, token_ids
from ..quantize import CHAPTER_SCHEMES
from . import Row

_SECTION = "09 distillation"


def rows(ctx):
    model, tok = ctx.model()
    seq_len, steps = ctx.sizes(128, 16), ctx.sizes(8, 2)
    ids = token_ids(tok, book_split().train, seq_len * ctx.sizes(8, 2) + 1)
    t0 = time.perf_counter()
    data = distillation_data(model, ids, seq_len, ctx.sizes(64, 8))
    label_s = time.perf_counter() - t0
    yield Row(_SECTION, "teacher's top-k labels: time per training token", label_s / data.n_tokens * 1e3, "ms",
              note=f"{data.n_tokens} tokens in windows of {seq_len}; {data.targets.nbytes:,} B kept, "
                   f"{data.targets.full_nbytes():,} B as whole distributions")
    keep = evenly_spaced_layers(len(decoder_layers(model)), min(4, len(decoder_layers(model)) - 1))
    plain, qat = student_from_teacher(model, keep), student_from_teacher(model, keep)
    quantization_aware(qat, CHAPTER_SCHEMES["INT4 per-row"])
    cases = {"soft": (plain, "soft"), "hard": (plain, "hard"), "qat": (qat, "soft")}
    times = {k: [] for k in cases}
    with torch.enable_grad():
        for step in range(ctx.sizes(12, 2)):                            # soft, hard, QAT, soft, hard, QAT, ...
            batch = torch.tensor([step % data.n_windows])
            for name, (student, loss) in cases.items():
                t0 = time.perf_counter()
                training_step(student, data, batch, loss)
                times[name].append(time.perf_counter() - t0)
                student.zero_grad(set_to_none=True)
    del plain, qat
    release_memory()
    med = {k: statistics.median(v) for k, v in times.items()}
    yield Row(_SECTION, f"soft-label step ({seq_len} tokens, {len(keep)}-layer student)", med["soft"], "s",
              note=f"hard-label step {med['hard']:.3f} s; forward and backward, median of {len(times['soft'])} "
                   f"interleaved steps (Adam's update excluded)")
    yield Row(_SECTION, "soft-label step / hard-label step", med["soft"] / med["hard"], "x", "<= 1.2",
              med["soft"] / med["hard"] <= 1.2, note="the top-k targets add a gather and a bucket per position")
    yield Row(_SECTION, "quantization-aware step / plain soft-label step", med["qat"] / med["soft"], "x",
              note="INT4 per-row fake quantization of every projection in each forward pass")
    peaks, sliced = {}, ctx.sizes(32, 4)
    for chunk in (sliced, seq_len):                                        # the LM head in slices vs all at once
        student = student_from_teacher(model, keep)
        peaks[chunk] = peak_memory(lambda: train_student(student, data, loss="soft", steps=steps, loss_chunk=chunk),
                                   device=ctx.device).peak_bytes
        del student
        release_memory()
    held = sum(parameter_bytes(student_from_teacher(model, keep))[k] for k in ("gradients", "adam_state"))
    yield Row(_SECTION, f"training peak memory, head in slices of {sliced} / all {seq_len} positions at once",
              peaks[sliced] / max(peaks[seq_len], 1), "x", "< 1.0", peaks[sliced] < peaks[seq_len],
              note=f"{peaks[sliced] / 2**20:.0f} vs {peaks[seq_len] / 2**20:.0f} MiB above the baseline; gradients and Adam "
                   f"state alone: {held / 2**20:.0f} MiB")
