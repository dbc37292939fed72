"""Chapter 07 -- evaluating a changed model against its reference: perplexity, KL divergence, agreement, a battery.

Every tool compares a *candidate* (a quantized model, a bf16 copy, a model with a quantized KV
cache, a distilled student, a draft) with a *reference* on the same tokens, and gives each figure
its statistical error. Chapters 08 (acceptance rate = the agreement column), 09 and 10 reuse them.

* **Which predictions are scored** -- :class:`Windows`: the text is read in windows of ``window``
  tokens; in each, the first ``window - stride`` tokens are context only and the predictions at
  the last ``stride`` positions are scored, so every scored prediction sees at least
  ``window - stride + 1`` tokens. Window k starts at ``k * stride``: consecutive windows overlap by
  their context-only part and every target token is scored exactly once. Inside a window the
  tokens go through the model in chunks of ``chunk`` (a KV cache carries the context), which
  bounds the memory of the logits and lets a quantized cache be read (:mod:`course_utils.kv_quant`).
  llama.cpp's ``perplexity`` tool uses non-overlapping windows of 512 tokens and scores the second
  half of each: ``Windows(window=512, stride=256)`` scores the same positions per window, but
  slides by 256 so no token of the text is skipped.
* **Perplexity** -- :func:`perplexity`: exp(mean negative log-likelihood of the scored targets).
* **KL divergence, with llama.cpp's statistics** -- :func:`record_reference` keeps the reference's
  log-probabilities at every scored position (in memory, or in files under ``spill_dir`` as
  llama.cpp's ``--kl-divergence-base`` file does, so a long text costs no RAM);
  :func:`compare_to_reference` runs a candidate over the same tokens, a chunk at a time, and keeps
  only per-position numbers (:func:`token_stats`); :class:`KLDResult` computes every statistic
  ``llama-perplexity --kl-divergence`` prints, under the same names and with the same error formulas.
  Unlike llama.cpp, the course stores the reference in float32 (llama.cpp: 16 bits per entry) and
  sums the KL divergence over the whole vocabulary (llama.cpp skips entries below e^-16).
* **Small statistics** -- :func:`mean_and_se`, :func:`percentile`, :func:`wilson_interval`,
  :func:`mcnemar_exact`, :func:`bootstrap_interval`.
* **Agreement** -- :func:`top1_agreement`: the reference generates greedily; the candidate is
  asked, position by position with the reference's own prefix, for its top-1 token.
* **A battery of questions** -- :func:`load_battery`, :func:`run_battery` (batched greedy decoding
  with and without a repetition penalty, :func:`batched_greedy`), :func:`grade_answer`, and the
  paired comparison of two models on the same questions (:func:`paired_comparison`: flips and
  the exact McNemar test).
* **Figures** -- :func:`kld_distribution_figure` (pure, for the chapter's widget),
  :func:`quality_vs_bits_figure`.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
import time
import unicodedata
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import plotly.graph_objects as go
import torch
from transformers import DynamicCache

from .kv_cache import prefill
from .plots import PALETTE, figure
from .progress import progress_bar
from .prompts import chat_prompt_ids
from .reference import common_prefix_len
from .validation import check_finite, check_positive_int

BATTERY_FILE = Path(__file__).resolve().parent / "data" / "battery.json"
#: Repetition penalty used when the model's generation config sets none: the value Qwen2.5-Instruct ships.
FALLBACK_REPETITION_PENALTY = 1.1
#: The percentiles llama.cpp prints for the KL divergence and for Δp (fractions; max/min are 1 and 0).
KLD_PERCENTILES = (1.0, 0.999, 0.99, 0.95, 0.90, 0.5, 0.10, 0.05, 0.01, 0.001, 0.0)
P_DIFF_PERCENTILES = (1.0, 0.999, 0.99, 0.95, 0.90, 0.75, 0.5, 0.25, 0.10, 0.05, 0.01, 0.001, 0.0)


# --- which predictions are scored ---------------------------------------------------------

@dataclass(frozen=True)
class Windows:
    """How a text is scored: ``n_tokens`` predictions, in windows of ``window`` tokens (chapter 07).

    Each window scores the predictions made at its last ``stride`` positions; the first
    ``window - stride`` positions are context only. Window k reads tokens
    ``[k*stride, k*stride + window)`` (the last one may stop early), so the text needs
    :attr:`tokens_needed` tokens. ``chunk``: tokens per forward pass inside a window.
    """

    n_tokens: int = 2048
    window: int = 1280
    stride: int = 1024
    chunk: int = 256

    def __post_init__(self):
        for name in ("n_tokens", "window", "stride", "chunk"):
            check_positive_int(name, getattr(self, name))
        if self.stride > self.window:
            raise ValueError(f"stride ({self.stride}) cannot exceed the window ({self.window}): "
                             f"a window scores at most its own positions")

    @property
    def context_only(self) -> int:
        """Positions at the start of each window that are read but not scored."""
        return self.window - self.stride

    @property
    def tokens_needed(self) -> int:
        """Tokens of text these windows read, including the last target."""
        return self.context_only + self.n_tokens + 1

    def spans(self) -> list[tuple[int, int]]:
        """``(start, n_scored)`` of every window, in order."""
        return [(start, min(self.stride, self.n_tokens - start)) for start in range(0, self.n_tokens, self.stride)]

    def check_text(self, n_text_tokens: int) -> None:
        """Raise a ``ValueError`` if a text of ``n_text_tokens`` tokens cannot give these windows."""
        if n_text_tokens < self.context_only + 2:
            raise ValueError(f"the text has {n_text_tokens:,} tokens: shorter than one window's "
                             f"{self.context_only:,} context-only tokens plus one scored prediction")
        if n_text_tokens < self.tokens_needed:
            raise ValueError(f"n_tokens={self.n_tokens:,} scored predictions need {self.tokens_needed:,} tokens "
                             f"(window {self.window}, stride {self.stride}); the text has only {n_text_tokens:,}: "
                             f"at most {n_text_tokens - 1 - self.context_only:,} can be scored")


def _as_ids(ids) -> torch.Tensor:
    if isinstance(ids, (list, tuple)):
        ids = torch.tensor([list(ids)])
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() not in (1, 2) or \
            (ids.dim() == 2 and ids.shape[0] != 1):
        raise ValueError(f"token ids must be a (n,) or (1, n) integer tensor or a list, "
                         f"got {getattr(ids, 'shape', type(ids).__name__)}")
    return ids.reshape(1, -1).long()


def _check_model_fits(model, windows: Windows) -> None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and windows.window > limit:
        raise ValueError(f"window={windows.window} is longer than the model's context "
                         f"(max_position_embeddings={limit})")


@torch.no_grad()
def scored_logprobs(model, ids, windows: Windows, *, chunk: int | None = None,
                    cache_factory: Callable[[], object] | None = None,
                    progress: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The model's log-probabilities at every scored position, a chunk at a time, in order.

    ``ids``: the text's token ids, (1, n) or (n,). Yields ``(log_probs, targets)``: float32
    (n_chunk, vocab) on the CPU and the int64 (n_chunk,) tokens they predict. ``chunk``
    overrides ``windows.chunk`` (same positions, other shapes: the numerical noise floor).
    ``cache_factory()`` makes each window's cache (default: transformers' ``DynamicCache``).
    """
    ids = _as_ids(ids)
    windows.check_text(ids.shape[1])
    _check_model_fits(model, windows)
    step = windows.chunk if chunk is None else check_positive_int("chunk", chunk)
    ids = ids.to(model.device)
    spans = windows.spans()
    for start, n_scored in progress_bar(spans, "windows", enabled=progress, total=len(spans)):
        cache = DynamicCache(config=model.config) if cache_factory is None else cache_factory()
        scored_from = start + windows.context_only
        for a in range(start, scored_from, step):
            prefill(model, ids[:, a:min(a + step, scored_from)], cache)
        for a in range(scored_from, scored_from + n_scored, step):
            b = min(a + step, scored_from + n_scored)
            logits = model(ids[:, a:b], cache=cache, use_cache=True).logits[0].float()
            yield _log_softmax_(logits).cpu(), ids[0, a + 1:b + 1].cpu()
        del cache


def _log_softmax_(logits: torch.Tensor, block_rows: int = 16) -> torch.Tensor:
    """log-softmax over the last dimension, in place, ``block_rows`` rows at a time (no full-size temporary).

    16 rows of a 49,152-token vocabulary are 3 MiB: a block's temporaries stay in the cache and on the heap, under
    :func:`~course_utils.measure.steady_allocator`'s 4 MiB threshold (64 rows took twice as long; each row's result is
    the same)."""
    for a in range(0, logits.shape[0], block_rows):
        block = logits[a:a + block_rows]
        block.sub_(block.logsumexp(-1, keepdim=True))
    return logits


def scored_targets(ids, windows: Windows) -> torch.Tensor:
    """The target tokens of every scored prediction, in order, (n_tokens,) int64."""
    ids = _as_ids(ids)
    windows.check_text(ids.shape[1])
    return ids[0, windows.context_only + 1:windows.tokens_needed].clone()


# --- perplexity ----------------------------------------------------------------------------

@dataclass
class Perplexity:
    """Perplexity of one model on the scored targets (chapter 07): ``exp(mean(nll))`` ± its standard error."""

    nll: np.ndarray                        # (n,) negative log-likelihood of each target, nats

    @property
    def value(self) -> float:
        return math.exp(float(np.mean(self.nll)))

    @property
    def uncertainty(self) -> float:
        """llama.cpp's ±: ``ppl * se(nll)`` (first order in the error of the mean)."""
        return self.value * mean_and_se(self.nll)[1]


def perplexity(model, ids, windows: Windows, *, chunk: int | None = None, cache_factory=None,
               progress: bool = False) -> Perplexity:
    """Perplexity of ``model`` on the scored targets of ``ids`` (see :class:`Windows`)."""
    nll = [-lp.gather(1, t[:, None])[:, 0].double() for lp, t in
           scored_logprobs(model, ids, windows, chunk=chunk, cache_factory=cache_factory, progress=progress)]
    return Perplexity(torch.cat(nll).numpy())


# --- the reference's log-probabilities -----------------------------------------------------

@dataclass
class ReferenceRun:
    """The reference's log-probabilities at every scored position, stored chunk by chunk (chapter 07).

    ``chunks`` holds (vocab-wide) float32 tensors, or paths of files holding them when recorded
    with a ``spill_dir``. ``nll`` and ``top1`` (per position) are kept in memory.
    """

    ids: torch.Tensor
    windows: Windows
    targets: torch.Tensor
    nll: np.ndarray
    top1: torch.Tensor
    vocab_size: int
    chunks: list = field(repr=False)
    offsets: list[int] = field(repr=False)
    spill_dir: Path | None = None
    _loaded: tuple = field(default=(None, None), repr=False)

    @property
    def perplexity(self) -> Perplexity:
        return Perplexity(self.nll)

    def rows(self, a: int, b: int) -> torch.Tensor:
        """Log-probabilities at scored positions ``a..b-1``, (b - a, vocab) float32."""
        parts, i = [], max(0, np.searchsorted(self.offsets, a, side="right") - 1)
        while a < b:
            chunk = self._chunk(i)
            lo, hi = a - self.offsets[i], min(b - self.offsets[i], chunk.shape[0])
            parts.append(chunk[lo:hi])
            a += hi - lo
            i += 1
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _chunk(self, i: int) -> torch.Tensor:
        stored = self.chunks[i]
        if isinstance(stored, torch.Tensor):
            return stored
        if self._loaded[0] != i:
            self._loaded = (None, None)                          # free the previous chunk first
            self._loaded = (i, torch.load(stored, weights_only=True, mmap=True))
        return self._loaded[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored log-probabilities (in memory or on disk)."""
        return len(self.targets) * self.vocab_size * 4

    def release(self) -> None:
        """Drop the stored log-probabilities (and delete their files)."""
        self.chunks, self._loaded = [], (None, None)
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir, ignore_errors=True)


def record_reference(model, ids, windows: Windows, *, spill_dir: str | Path | None = None,
                     progress: bool = False) -> ReferenceRun:
    """Run the reference over the scored positions and keep its log-probabilities (chapter 07).

    They take ``n_tokens * vocab * 4`` bytes (2,048 positions x 49,152 tokens: 403 MB). With
    ``spill_dir`` they go to files in a fresh folder inside it, one per chunk, and are read back a
    chunk at a time by :func:`compare_to_reference`; call :meth:`ReferenceRun.release` when done.
    """
    ids = _as_ids(ids).cpu()
    folder = None if spill_dir is None else Path(tempfile.mkdtemp(prefix="reference-", dir=spill_dir))
    chunks, offsets, nll, top1, targets, n = [], [], [], [], [], 0
    for i, (lp, t) in enumerate(scored_logprobs(model, ids, windows, progress=progress)):
        nll.append(-lp.gather(1, t[:, None])[:, 0].double())
        top1.append(lp.argmax(-1))
        targets.append(t)
        offsets.append(n)
        n += len(t)
        if folder is None:
            chunks.append(lp)
        else:
            path = folder / f"chunk{i:05d}.pt"
            torch.save(lp, path)
            chunks.append(path)
    return ReferenceRun(ids, windows, torch.cat(targets), torch.cat(nll).numpy(), torch.cat(top1), lp.shape[-1],
                        chunks, offsets, folder)


# --- per-position statistics and llama.cpp's summary ----------------------------------------

def token_stats(base_logprobs: torch.Tensor, logprobs: torch.Tensor, targets: torch.Tensor, *,
                block_rows: int = 16) -> dict[str, torch.Tensor]:
    """What the statistics need at each position, from two models' log-probabilities there.

    ``base_logprobs`` / ``logprobs``: (n, vocab) log-softmax outputs of the reference P and the
    candidate Q; ``targets``: (n,) the actual next tokens. Returns float64 / bool tensors (n,):
    ``kld`` = Σ_v P(v) (ln P(v) - ln Q(v)) over the whole vocabulary, ``nll`` = -ln Q(target),
    ``nll_base`` = -ln P(target), ``p_diff`` = Q(target) - P(target) (llama.cpp's Δp), and
    ``same_top`` (the two most likely tokens are the same). The products are float32 (a difference of
    two float32 numbers is exact to 6e-8 of itself) and the sums float64, ``block_rows`` rows at a time,
    so no vocabulary-wide copy of the whole input is made (each row's sums do not depend on ``block_rows``; 16 rows
    keep the temporaries in the cache and on the heap: three times faster than 64 on a 2-core CPU).
    """
    if base_logprobs.dim() != 2 or base_logprobs.shape != logprobs.shape:
        raise ValueError(f"the two models' log-probabilities must have the same (positions, vocab) shape; got "
                         f"{tuple(base_logprobs.shape)} and {tuple(logprobs.shape)} (mismatched vocabularies?)")
    if targets.shape != (base_logprobs.shape[0],):
        raise ValueError(f"targets must be ({base_logprobs.shape[0]},), got {tuple(targets.shape)}")
    kld = torch.empty(len(targets), dtype=torch.float64)
    for a in range(0, len(targets), block_rows):
        lp, lq = base_logprobs[a:a + block_rows], logprobs[a:a + block_rows]
        kld[a:a + block_rows] = (lp.exp() * (lp - lq)).sum(-1, dtype=torch.float64)
    t = targets[:, None]
    nll, nll_base = -logprobs.gather(1, t)[:, 0].double(), -base_logprobs.gather(1, t)[:, 0].double()
    return {"kld": kld, "nll": nll, "nll_base": nll_base, "p_diff": torch.exp(-nll) - torch.exp(-nll_base),
            "same_top": logprobs.argmax(-1) == base_logprobs.argmax(-1)}


def mean_and_se(values) -> tuple[float, float]:
    """Mean and its standard error, ``sqrt(population variance / (n - 1))``, as llama.cpp computes them."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        raise ValueError(f"a standard error needs at least 2 values, got {x.size}")
    mean = float(x.mean())
    var = float(np.mean(x * x) - mean * mean)
    return mean, math.sqrt(max(var, 0.0) / (x.size - 1))


def percentile(values, fraction: float) -> float:
    """The ``fraction`` quantile with linear interpolation between order statistics (llama.cpp's rule).

    ``fraction`` 0 is the minimum, 1 the maximum, 0.5 the median (the mean of the two middle
    values for an even count).
    """
    fraction = check_finite("fraction", fraction, minimum=0.0)
    if fraction > 1:
        raise ValueError(f"fraction must be between 0 and 1, got {fraction}")
    x = np.sort(np.asarray(values, dtype=np.float64))
    if x.size == 0:
        raise ValueError("no values to take a percentile of")
    p = fraction * (x.size - 1)
    i = int(p)
    return float(x[i] if i + 1 >= x.size else (1 - (p - i)) * x[i] + (p - i) * x[i + 1])


def _percentile_label(fraction: float) -> str:
    return {1.0: "Maximum", 0.5: "Median", 0.0: "Minimum"}.get(fraction, f"{100 * fraction:.1f}%")


@dataclass
class KLDResult:
    """Per-position comparison of a candidate Q with the reference ("base") on the same targets (chapter 07).

    Arrays are float64 (``same_top``: bool), one entry per scored position. The properties give
    llama.cpp's statistics with its error formulas; :meth:`summary` names them as it prints them.
    """

    kld: np.ndarray
    nll: np.ndarray
    nll_base: np.ndarray
    p_diff: np.ndarray
    same_top: np.ndarray
    seconds: float = 0.0

    @property
    def n(self) -> int:
        return int(self.kld.size)

    def _cov_of_means(self) -> float:
        """Covariance of mean(nll) and mean(nll_base): llama.cpp's ``covariance(...)``."""
        return float(np.mean(self.nll * self.nll_base) - self.nll.mean() * self.nll_base.mean()) / (self.n - 1)

    @property
    def ppl(self) -> tuple[float, float]:
        """Mean PPL(Q) ± its uncertainty."""
        return Perplexity(self.nll).value, Perplexity(self.nll).uncertainty

    @property
    def ppl_base(self) -> tuple[float, float]:
        """Mean PPL(base) ± its uncertainty."""
        return Perplexity(self.nll_base).value, Perplexity(self.nll_base).uncertainty

    @property
    def cor_ln_ppl(self) -> float:
        """Pearson correlation of the per-token log-likelihoods of Q and base."""
        se_q, se_b = mean_and_se(self.nll)[1], mean_and_se(self.nll_base)[1]
        return self._cov_of_means() / (se_q * se_b) if se_q * se_b > 0 else float("nan")

    @property
    def ln_ppl_ratio(self) -> tuple[float, float]:
        """Mean ln(PPL(Q)/PPL(base)) ± its uncertainty (the correlation of the two makes it small)."""
        (mq, se_q), (mb, se_b) = mean_and_se(self.nll), mean_and_se(self.nll_base)
        return mq - mb, math.sqrt(max(se_q ** 2 + se_b ** 2 - 2 * self._cov_of_means(), 0.0))

    @property
    def ppl_ratio(self) -> tuple[float, float]:
        """Mean PPL(Q)/PPL(base) ± its uncertainty."""
        val, unc = self.ln_ppl_ratio
        return math.exp(val), math.exp(val) * unc

    @property
    def ppl_diff(self) -> tuple[float, float]:
        """Mean PPL(Q) - PPL(base) ± its uncertainty."""
        (q, uq), (b, ub) = self.ppl, self.ppl_base
        return q - b, math.sqrt(max(uq ** 2 + ub ** 2 - 2 * q * b * self._cov_of_means(), 0.0))

    @property
    def mean_kld(self) -> tuple[float, float]:
        """Mean KL divergence (nats per token) ± its standard error."""
        return mean_and_se(self.kld)

    @property
    def mean_p_diff(self) -> tuple[float, float]:
        """Mean Δp ± its standard error (a fraction; llama.cpp prints it in %)."""
        return mean_and_se(self.p_diff)

    @property
    def rms_p_diff(self) -> tuple[float, float]:
        """RMS Δp ± its uncertainty (a fraction)."""
        mse, se = mean_and_se(self.p_diff ** 2)
        rms = math.sqrt(mse)
        return rms, (0.5 / rms * se if rms > 0 else 0.0)

    @property
    def same_top_p(self) -> tuple[float, float]:
        """Share of positions where Q's most likely token is base's ± its binomial error."""
        p = float(np.mean(self.same_top))
        return p, math.sqrt(p * (1 - p) / (self.n - 1))

    def head(self, n: int) -> "KLDResult":
        """The same comparison restricted to the first ``n`` scored positions."""
        check_positive_int("n", n)
        if n > self.n:
            raise ValueError(f"only {self.n} positions were scored, asked for {n}")
        return KLDResult(self.kld[:n], self.nll[:n], self.nll_base[:n], self.p_diff[:n], self.same_top[:n])

    def per_unit(self, n_units: int) -> dict[str, float]:
        """Totals spread over another unit than the token (e.g. words of the scored text): nats per unit of
        ``nll`` (Q), ``nll_base`` and ``kld``, and the perplexities per unit ``exp(nll per unit)``."""
        check_positive_int("n_units", n_units)
        out = {k: float(getattr(self, k).sum()) / n_units for k in ("nll", "nll_base", "kld")}
        out.update(ppl=math.exp(out["nll"]), ppl_base=math.exp(out["nll_base"]))
        return out

    def kld_percentiles(self) -> dict[str, float]:
        return {f"{_percentile_label(f)} KLD": percentile(self.kld, f) for f in KLD_PERCENTILES}

    def p_diff_percentiles(self) -> dict[str, float]:
        return {f"{_percentile_label(f)} Δp": percentile(self.p_diff, f) for f in P_DIFF_PERCENTILES}

    def summary(self) -> dict[str, float | tuple[float, float]]:
        """Every statistic llama.cpp's ``--kl-divergence`` prints, by its name (Δp figures as fractions)."""
        out = {"Mean PPL(Q)": self.ppl, "Mean PPL(base)": self.ppl_base,
               "Cor(ln(PPL(Q)), ln(PPL(base)))": self.cor_ln_ppl, "Mean ln(PPL(Q)/PPL(base))": self.ln_ppl_ratio,
               "Mean PPL(Q)/PPL(base)": self.ppl_ratio, "Mean PPL(Q)-PPL(base)": self.ppl_diff,
               "Mean KLD": self.mean_kld, **self.kld_percentiles(), "Mean Δp": self.mean_p_diff,
               **self.p_diff_percentiles(), "RMS Δp": self.rms_p_diff, "Same top p": self.same_top_p}
        return out

    def report(self) -> str:
        """The summary laid out as llama.cpp prints it."""
        def pm(v, scale=1.0, fmt="10.6f", unit=""):
            return f"{scale * v[0]:{fmt}} ± {scale * v[1]:{fmt}}{unit}" if isinstance(v, tuple) else f"{scale * v:{fmt}}{unit}"
        s = self.summary()
        lines = ["====== Perplexity statistics ======"]
        for k in list(s)[:6]:
            lines.append(f"{k:<30}: " + (f"{100 * s[k]:6.2f}%" if k.startswith("Cor") else pm(s[k])))
        lines += ["", "====== KL divergence statistics ======", f"{'Mean    KLD':<11}: {pm(s['Mean KLD'])}"]
        lines += [f"{k:<11}: {v:10.6f}" for k, v in self.kld_percentiles().items()]
        lines += ["", "====== Token probability statistics ======",
                  f"Mean    Δp: {pm(s['Mean Δp'], 100, '6.3f', ' %')}"]
        lines += [f"{k:<10}: {100 * v:6.3f}%" for k, v in self.p_diff_percentiles().items()]
        lines += [f"RMS Δp    : {pm(s['RMS Δp'], 100, '6.3f', ' %')}", f"Same top p: {pm(s['Same top p'], 100, '6.3f', ' %')}"]
        return "\n".join(lines)


def compare_to_reference(model, ref: ReferenceRun, *, n_tokens: int | None = None, chunk: int | None = None,
                         cache_factory=None, progress: bool = False) -> KLDResult:
    """Run ``model`` over the reference's scored positions and compare, position by position (chapter 07).

    Only per-position numbers are kept (:func:`token_stats`); the candidate's log-probabilities live
    one chunk at a time. ``n_tokens``: compare only the first ``n_tokens`` scored positions (the same
    windows, cut short). ``chunk`` and ``cache_factory`` as in :func:`scored_logprobs`.
    """
    if not isinstance(ref, ReferenceRun):
        raise TypeError(f"expected a ReferenceRun from record_reference, got {type(ref).__name__}")
    if not ref.chunks:
        raise ValueError("this ReferenceRun was released; record it again")
    windows = ref.windows
    if n_tokens is not None:
        check_positive_int("n_tokens", n_tokens)
        if n_tokens > windows.n_tokens:
            raise ValueError(f"n_tokens={n_tokens} is more than the {windows.n_tokens} positions the reference scored")
        windows = replace(windows, n_tokens=n_tokens)
    t0, parts, a = time.perf_counter(), [], 0
    for lq, t in scored_logprobs(model, ref.ids, windows, chunk=chunk, cache_factory=cache_factory,
                                 progress=progress):
        if lq.shape[-1] != ref.vocab_size:
            raise ValueError(f"the candidate's vocabulary has {lq.shape[-1]:,} tokens, the reference's "
                             f"{ref.vocab_size:,}: KL divergence needs the same vocabulary")
        parts.append(token_stats(ref.rows(a, a + len(t)), lq, t))
        a += len(t)
    joined = {k: torch.cat([p[k] for p in parts]).numpy() for k in parts[0]}
    return KLDResult(**joined, seconds=time.perf_counter() - t0)


# --- small statistics ------------------------------------------------------------------------

def wilson_interval(k: int, n: int, *, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a proportion ``k / n`` (default 95 %): ``(low, high)``.

    Unlike ``p ± z·sqrt(p(1-p)/n)`` it stays inside [0, 1] and is honest at 0/16 or 16/16.
    """
    check_positive_int("n", n)
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 0 <= k <= n:
        raise ValueError(f"k must be an integer from 0 to n={n}, got {k!r}")
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return (0.0 if k == 0 else centre - half), (1.0 if k == n else centre + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar test: the p-value of ``b`` vs ``c`` discordant pairs.

    ``b``: items only the first model got right, ``c``: only the second. Under "no difference" each
    discordant item is a fair coin: ``p = min(1, 2 · P[Binomial(b + c, ½) <= min(b, c)])``.
    """
    for name, v in (("b", b), ("c", c)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a count (an integer >= 0), got {v!r}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def bootstrap_interval(values, statistic: Callable = np.mean, *, block: int = 1, n_resamples: int = 1000,
                       level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic(values)``, resampling blocks of ``block`` neighbours.

    Neighbouring tokens of a text are not independent; resampling whole blocks keeps that
    dependence, and a wider interval than with ``block=1`` says the naive ± is too optimistic.
    """
    x = np.asarray(values, dtype=np.float64)
    check_positive_int("block", block)
    check_positive_int("n_resamples", n_resamples)
    if not 0 < level < 1:
        raise ValueError(f"level must be between 0 and 1, got {level!r}")
    n_blocks = x.size // block
    if n_blocks < 2:
        raise ValueError(f"need at least 2 blocks of {block} values, got {x.size} values")
    blocks = x[:n_blocks * block].reshape(n_blocks, block)
    rng = np.random.default_rng(seed)
    stats = [statistic(blocks[rng.integers(0, n_blocks, n_blocks)].ravel()) for _ in range(n_resamples)]
    return float(np.quantile(stats, (1 - level) / 2)), float(np.quantile(stats, (1 + level) / 2))


# --- agreement -------------------------------------------------------------------------------

@dataclass
class Top1Agreement:
    """Position by position, did the candidate's top-1 equal the reference's generated token (chapter 07)?"""

    matches: list[bool]

    @property
    def n(self) -> int:
        return len(self.matches)

    @property
    def n_agree(self) -> int:
        return int(sum(self.matches))

    @property
    def rate(self) -> float:
        return self.n_agree / self.n

    @property
    def first_miss(self) -> int | None:
        """Index of the first position where they differ (None if they never do)."""
        return next((i for i, m in enumerate(self.matches) if not m), None)


@torch.no_grad()
def top1_agreement(model, prompt_ids: Sequence[int], reference_ids: Sequence[int]) -> Top1Agreement:
    """Feed ``prompt_ids + reference_ids`` once; at each generated position compare the model's top-1
    with the token the reference generated there (chapter 07; chapter 08's greedy acceptance rate).

    Every position sees the reference's own prefix, so one early difference does not derail the rest.
    """
    prompt, ref = [int(t) for t in prompt_ids], [int(t) for t in reference_ids]
    if not prompt or not ref:
        raise ValueError("prompt_ids and reference_ids must both hold at least one token")
    ids = torch.tensor([prompt + ref[:-1]], device=model.device)
    logits = model(ids, use_cache=False, logits_to_keep=len(ref)).logits[0]
    return Top1Agreement((logits.argmax(-1).cpu() == torch.tensor(ref)).tolist())


# --- a battery of questions ---------------------------------------------------------------------

@dataclass(frozen=True)
class BatteryQuestion:
    """One question with the answers that count as right (any one of them, as a whole word or phrase)."""

    question: str
    accepted: tuple[str, ...]


def load_battery(path: str | Path | None = None) -> list[BatteryQuestion]:
    """The course's 16 questions (``course_utils/data/battery.json``) or another file of the same form:
    ``{"questions": [{"question": ..., "accepted": [...]}, ...]}``."""
    data = json.loads(Path(path or BATTERY_FILE).read_text(encoding="utf-8"))
    items = data.get("questions") if isinstance(data, dict) else None
    if not items:
        raise ValueError(f"{path or BATTERY_FILE} holds no 'questions' list")
    out = []
    for i, item in enumerate(items):
        accepted = item.get("accepted") if isinstance(item, dict) else None
        if not isinstance(item, dict) or not isinstance(item.get("question"), str) or not accepted:
            raise ValueError(f"question {i} needs a 'question' string and a non-empty 'accepted' list")
        out.append(BatteryQuestion(item["question"], tuple(str(a) for a in accepted)))
    return out


def _normalise(text: str) -> str:
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text).split())


def grade_answer(answer: str, accepted: Sequence[str]) -> bool:
    """True when one accepted answer appears in ``answer`` as whole words (case, accents and
    punctuation ignored): "Paris." and "The capital is Paris" match "paris"; "Parisian" does not."""
    text = f" {_normalise(answer)} "
    return any(f" {_normalise(a)} " in text for a in accepted if _normalise(a))


def stock_repetition_penalty(model, fallback: float = FALLBACK_REPETITION_PENALTY) -> tuple[float, str]:
    """The repetition penalty the model ships in its generation config, or ``fallback``; and where it came from."""
    value = getattr(getattr(model, "generation_config", None), "repetition_penalty", None)
    if value is not None and value != 1.0:
        return float(value), "the model's generation_config"
    return float(fallback), "none in the model's generation_config; the value Qwen2.5-Instruct ships"


def _eos_ids(model, tok) -> list[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if getattr(tok, "eos_token_id", None) is not None:
        ids.append(tok.eos_token_id)
    return sorted(set(int(i) for i in ids))


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' repetition penalty: where ``seen`` (rows, vocab) is True, a positive logit is divided
    by the row's ``penalty`` (rows, 1) and a negative one multiplied by it (penalty 1 changes nothing)."""
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def _left_padded(prompts, pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + [int(t) for t in p] for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _prefill_shared(model, prompts, pad_token_id: int):
    """Prefill a batch of prompts, their common prefix (e.g. the chat template's system turn) only once.

    The prefix runs at batch 1 and its cache is repeated; each prompt's rest follows, left-padded
    *after* the prefix (padding masked out, positions counted over real tokens only). Returns the
    last position's logits (batch, vocab), the cache, the attention mask and the token ids.
    """
    dev = model.device
    k = min(min(common_prefix_len(prompts[0], p) for p in prompts), min(len(p) for p in prompts) - 1)
    cache = DynamicCache(config=model.config)
    if k:
        model(torch.tensor([list(prompts[0][:k])], device=dev), cache=cache, use_cache=True, logits_to_keep=1)
        cache.batch_repeat_interleave(len(prompts))
    rest, rest_mask = _left_padded([p[k:] for p in prompts], pad_token_id, dev)
    mask = torch.cat([torch.ones(len(prompts), k, dtype=rest_mask.dtype, device=dev), rest_mask], 1)
    positions = (mask.cumsum(1) - 1).clamp_min(0)[:, k:]
    logits = model(rest, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                   logits_to_keep=1).logits[:, -1].float()
    prefix = torch.tensor([int(t) for t in prompts[0][:k]], dtype=rest.dtype, device=dev)
    ids = torch.cat([prefix.expand(len(prompts), k), rest], 1)
    return logits, cache, mask, ids


@torch.no_grad()
def batched_greedy(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   repetition_penalties: Sequence[float] = (1.0,), eos_token_ids: Sequence[int] = (),
                   pad_token_id: int = 0) -> dict[float, list[list[int]]]:
    """Greedy decoding of every prompt under every repetition penalty, all in one batch (chapter 07).

    The prompts are prefilled once (their common prefix once for all, :func:`_prefill_shared`);
    the cache is then repeated once per penalty, so the ``len(prompts) * len(repetition_penalties)``
    rows decode together. A penalty ``r`` applies to every token already in the row's prompt or
    output (:func:`penalize_repeats`, padding excluded). A row stops at its first EOS (kept out of the
    output) and leaves the batch, so the steps get cheaper as answers finish.
    Returns ``{penalty: [new ids, one list per prompt]}``.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("give at least one prompt, each with at least one token")
    check_positive_int("max_new_tokens", max_new_tokens)
    pens = [check_finite("repetition penalty", r, minimum=0.0, strict=True) for r in repetition_penalties]
    if not pens:
        raise ValueError("repetition_penalties must name at least one value (1.0 = none)")
    dev, n_rows = model.device, len(prompts) * len(pens)
    logits, cache, mask, ids = _prefill_shared(model, prompts, pad_token_id)
    logits = logits.repeat_interleave(len(pens), 0)
    cache.batch_repeat_interleave(len(pens))
    ids, mask = ids.repeat_interleave(len(pens), 0), mask.repeat_interleave(len(pens), 0)
    pen = torch.tensor(pens * len(prompts), device=dev)[:, None]
    seen = torch.zeros(n_rows, logits.shape[-1], dtype=torch.bool, device=dev)
    r_idx, c_idx = mask.nonzero(as_tuple=True)                   # real prompt tokens only, not the padding
    seen[r_idx, ids[r_idx, c_idx]] = True
    pos, alive = mask.sum(1, keepdim=True), torch.arange(n_rows, device=dev)
    eos = torch.tensor(sorted(set(eos_token_ids)) or [-1], device=dev)
    out: list[list[int]] = [[] for _ in range(n_rows)]
    for step in range(max_new_tokens):
        nxt = penalize_repeats(logits, seen, pen).argmax(-1)
        finished = torch.isin(nxt, eos)
        for row, tok, fin in zip(alive.tolist(), nxt.tolist(), finished.tolist()):
            if not fin:
                out[row].append(tok)
        if finished.all() or step == max_new_tokens - 1:
            break
        if finished.any():                                       # drop finished rows from the batch
            keep = (~finished).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            nxt, seen, pen, mask, pos, alive = nxt[keep], seen[keep], pen[keep], mask[keep], pos[keep], alive[keep]
        seen.scatter_(1, nxt[:, None], True)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        logits = model(nxt[:, None], attention_mask=mask, position_ids=pos, cache=cache,
                       use_cache=True).logits[:, -1].float()
        pos = pos + 1
    return {r: out[i::len(pens)] for i, r in enumerate(pens)}


@dataclass
class BatteryResult:
    """Answers and grades of one model on the battery, per repetition penalty (chapter 07)."""

    questions: list[BatteryQuestion]
    answers: dict[float, list[str]]
    correct: dict[float, list[bool]]

    def accuracy(self, penalty: float) -> tuple[int, int, float, float]:
        """``(right, asked, low, high)``: the count and its 95 % Wilson interval."""
        right, n = sum(self.correct[penalty]), len(self.correct[penalty])
        return (right, n, *wilson_interval(right, n))


def run_battery(model, tok, questions: Sequence[BatteryQuestion], *, repetition_penalties: Sequence[float] = (1.0,),
                max_new_tokens: int = 24, system: str | None = None) -> BatteryResult:
    """Ask every question (the model's chat template, greedy, batched) and grade the answers."""
    if not questions or not all(isinstance(q, BatteryQuestion) for q in questions):
        raise ValueError("questions must be a non-empty list of BatteryQuestion (see load_battery)")
    prompts = [chat_prompt_ids(tok, q.question, system) for q in questions]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = batched_greedy(model, prompts, max_new_tokens, repetition_penalties=repetition_penalties,
                         eos_token_ids=_eos_ids(model, tok), pad_token_id=pad)
    answers = {r: [tok.decode(a, skip_special_tokens=True).strip() for a in rows] for r, rows in ids.items()}
    correct = {r: [grade_answer(a, q.accepted) for a, q in zip(rows, questions)] for r, rows in answers.items()}
    return BatteryResult(list(questions), answers, correct)


@dataclass(frozen=True)
class PairedComparison:
    """Two models on the same questions: the four cells of the paired table and McNemar's p-value."""

    both_right: int
    right_to_wrong: int          # right for the first model, wrong for the second
    wrong_to_right: int
    both_wrong: int

    @property
    def p_value(self) -> float:
        return mcnemar_exact(self.right_to_wrong, self.wrong_to_right)

    @property
    def flips(self) -> int:
        return self.right_to_wrong + self.wrong_to_right


def paired_comparison(correct_a: Sequence[bool], correct_b: Sequence[bool]) -> PairedComparison:
    """Compare two models' grades on the same questions, question by question."""
    if len(correct_a) != len(correct_b) or not correct_a:
        raise ValueError(f"need the same, non-empty list of questions for both models "
                         f"(got {len(correct_a)} and {len(correct_b)} grades)")
    pairs = list(zip(map(bool, correct_a), map(bool, correct_b)))
    return PairedComparison(pairs.count((True, True)), pairs.count((True, False)), pairs.count((False, True)),
                            pairs.count((False, False)))


def text_units(tok, targets: torch.Tensor) -> dict[str, int]:
    """Tokens, words (whitespace-separated) and characters of the scored targets' text: to compare
    per-token figures across languages whose words take different numbers of tokens."""
    text = tok.decode(targets.tolist())
    return {"tokens": len(targets), "words": len(text.split()), "chars": len(text)}


@dataclass
class CandidateQuality:
    """Everything :func:`measure_candidate` measured for one candidate (chapter 07; reused by 08-10)."""

    kld: dict[str, KLDResult]
    agreement: Top1Agreement | None = None
    battery: BatteryResult | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def measure_candidate(model, tok, references: dict[str, ReferenceRun], *, prompt_ids=None, reference_ids=None,
                      questions: Sequence[BatteryQuestion] | None = None, repetition_penalties=(1.0,),
                      max_new_tokens: int = 16, cache_factory=None, progress: bool = False) -> CandidateQuality:
    """The chapter's measurements of one candidate: KL divergence on each reference text, agreement with
    the reference's greedy output (``prompt_ids``, ``reference_ids``) and the battery (``questions``);
    each part is skipped when its inputs are not given. ``seconds`` records each part's wall time."""
    seconds, klds = {}, {}
    for name, ref in references.items():
        klds[name] = compare_to_reference(model, ref, cache_factory=cache_factory, progress=progress)
        seconds[f"KL divergence, {name}"] = klds[name].seconds
    out = CandidateQuality(klds, seconds=seconds)
    if reference_ids is not None:
        t0 = time.perf_counter()
        out.agreement = top1_agreement(model, prompt_ids, reference_ids)
        seconds["agreement"] = time.perf_counter() - t0
    if questions is not None:
        t0 = time.perf_counter()
        out.battery = run_battery(model, tok, questions, repetition_penalties=repetition_penalties,
                                  max_new_tokens=max_new_tokens)
        seconds["battery"] = time.perf_counter() - t0
    return out


# --- figures ---------------------------------------------------------------------------------------

KLD_FLOOR = 1e-12   # KL divergences below this (or slightly negative, from rounding) are drawn at it


def kld_distribution_figure(kld_by_name: dict[str, np.ndarray], first: str, second: str, *,
                            flips: dict[str, list[str]] | None = None) -> go.Figure:
    """The per-token KL divergence of two candidates, as the share of tokens above each value (log x).

    A pure function of precomputed arrays (the chapter's widget redraws it). ``flips``, if given,
    maps ``"right → wrong"`` / ``"wrong → right"`` to the battery questions that flipped between
    ``first`` and ``second``; they are listed under the chart.
    """
    for name in (first, second):
        if name not in kld_by_name:
            raise ValueError(f"unknown candidate {name!r}; expected one of {sorted(kld_by_name)}")
    fig = figure("", "KL divergence at a token (nats, log scale)", "share of tokens with at least this KLD",
                 log_x=True, log_y=True, height=460)
    for i, name in enumerate(dict.fromkeys([first, second])):
        x = np.sort(np.clip(kld_by_name[name], KLD_FLOOR, None))
        share = 1.0 - np.arange(x.size) / x.size
        fig.add_scatter(x=x, y=share, name=name, mode="lines", line=dict(color=PALETTE[i], width=2))
    tail = {n: percentile(kld_by_name[n], 0.99) for n in (first, second)}
    fig.update_layout(title=f"99th-percentile KLD: {first} {tail[first]:.3g}, {second} {tail[second]:.3g} nats")
    if flips is not None:
        lines = [f"<b>{k}</b> ({len(v)}): " + ("; ".join(v) if v else "none") for k, v in flips.items()]
        fig.add_annotation(text="<br>".join(lines), xref="paper", yref="paper", x=0, y=-0.32, showarrow=False,
                           align="left", xanchor="left", yanchor="top", font=dict(size=12))
        fig.update_layout(height=560, margin=dict(b=170))
    return fig


def quality_vs_bits_figure(points: dict[str, tuple[float, float, float]], *, title: str) -> go.Figure:
    """Mean KLD (log y, with its ± as error bars) against bits per weight, one marker per scheme.

    ``points``: ``{label: (bits_per_weight, mean_kld, se)}``.
    """
    fig = figure(title, "bits per weight (scales included)", "mean KL divergence from the reference (nats/token)",
                 log_y=True)
    for i, (label, (bits, kld, se)) in enumerate(points.items()):
        fig.add_scatter(x=[bits], y=[max(kld, KLD_FLOOR)], error_y=dict(type="data", array=[se], visible=True),
                        mode="markers+text", text=[label], textposition="top center", name=label,
                        marker=dict(size=11, color=PALETTE[i % len(PALETTE)]), showlegend=False)
    return fig
