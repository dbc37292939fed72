"""The sweep as chapter 02's roofline predicts it from the machine's two roofs, and a step's FLOP per byte from a
model's shape alone."""
from __future__ import annotations

from dataclasses import dataclass

from ..validation import check_positive_int
from .sweep import _check_batch_sizes


@dataclass(frozen=True)
class RooflinePoint:
    """The roofline's floor for one decode step of ``batch`` sequences: its arithmetic at the compute
    roof and its bytes at the memory roof (seconds); the step takes at least the larger."""

    batch: int
    compute_s: float
    memory_s: float

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def _check_cache_passes(cache_passes) -> int:
    if cache_passes not in (1, 3) or isinstance(cache_passes, bool):
        raise ValueError("cache_passes must be 1 (the cache read once, appended in place) or 3 (read, copied "
                         f"whole with the new token, and the copy read again), got {cache_passes!r}")
    return cache_passes


def cache_step_bytes(model, context_len: int, *, batch: int, cache_passes: int = 3) -> int:
    """Bytes of keys and values one decode step of ``batch`` sequences moves, each sequence holding
    ``context_len`` cached positions.

    ``cache_passes=1``: the cache read once by attention (a cache appended in place, as a paged engine's).
    ``cache_passes=3``: a cache that grows by concatenation (transformers' ``DynamicCache``): the step reads
    the ``context_len`` positions, writes a fresh copy of ``context_len + 1``, and attention reads that copy.
    """
    from ..models import model_dims

    check_positive_int("context_len", context_len)
    check_positive_int("batch", batch)
    passes = _check_cache_passes(cache_passes)
    per_position = model_dims(model.config).kv_elements_per_token * model.get_input_embeddings().weight.element_size()
    positions = context_len if passes == 1 else context_len + 2 * (context_len + 1)
    return batch * positions * per_position


def roofline_sweep(model, batch_sizes, *, context_len: int, peak_flops: float,
                   bandwidth_Bps: float, cache_passes: int = 3) -> list[RooflinePoint]:
    """The sweep as the roofline predicts it: for each B, :func:`~course_utils.prefill_decode.forward_flops`
    of one new token per sequence over ``context_len`` cached ones, and the bytes the step moves: the weights once
    (:func:`~course_utils.prefill_decode.decode_step_bytes` with no context) plus every sequence's cache as
    :func:`cache_step_bytes` charges it (by default three passes, as the sweep's ``DynamicCache`` moves it),
    against the two measured roofs (chapter 02)."""
    from ..prefill_decode import decode_step_bytes, forward_flops, ridge_intensity

    ridge_intensity(peak_flops, bandwidth_Bps)                      # validates both roofs
    check_positive_int("context_len", context_len)
    _check_cache_passes(cache_passes)
    return [RooflinePoint(b, forward_flops(model, 1, context_len, batch=b) / peak_flops,
                          (decode_step_bytes(model, 0, batch=b)
                           + cache_step_bytes(model, context_len, batch=b, cache_passes=cache_passes)) / bandwidth_Bps)
            for b in _check_batch_sizes(batch_sizes)]


def roofline_crossover_batch(model, *, context_len: int, peak_flops: float, bandwidth_Bps: float,
                             max_batch: int = 1 << 16, cache_passes: int = 3) -> int | None:
    """The smallest batch whose decode step the roofline calls compute-bound (arithmetic time >= memory
    time), or None if none up to ``max_batch`` is (the caches' bytes grow with B as fast as the FLOPs)."""
    def compute_bound(b: int) -> bool:
        p = roofline_sweep(model, [b], context_len=context_len, peak_flops=peak_flops, bandwidth_Bps=bandwidth_Bps,
                           cache_passes=cache_passes)[0]
        return p.compute_s >= p.memory_s

    if not compute_bound(max_batch):
        return None
    lo, hi = 1, max_batch                     # compute time grows faster with B than memory time: bisect
    if compute_bound(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compute_bound(mid) else (mid, hi)
    return hi


def decode_intensity(dims, n_weights: int, *, bytes_per_weight: float, batch: int, context_len: int,
                     cache_passes: int = 1) -> float:
    """FLOP per byte of one decode step from a model's shape alone (chapter 02's roofline x axis).

    ``n_weights``: the weights the step multiplies (every matrix, the LM head included, once);
    ``dims``: a :class:`~course_utils.models.ModelDims`. FLOPs: 2 per weight per sequence plus the
    attention over ``context_len + 1`` positions; bytes: the weights once plus every sequence's
    keys and values, all at ``bytes_per_weight`` (``cache_passes=3``: read, copied with the new token and
    the copy read again, as :func:`cache_step_bytes` charges a cache that grows by concatenation).
    Norms, biases and activations are left out.
    """
    from ..kv_cache import attention_macs

    check_positive_int("batch", batch)
    check_positive_int("n_weights", n_weights)
    flops = 2 * batch * (n_weights + attention_macs(1, context_len + 1, dims))
    positions = context_len if _check_cache_passes(cache_passes) == 1 else context_len + 2 * (context_len + 1)
    moved = (n_weights + batch * positions * dims.kv_elements_per_token) * bytes_per_weight
    return flops / moved
