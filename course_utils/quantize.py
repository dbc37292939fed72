"""Chapter 05 -- weight quantization: round-to-nearest schemes, their bits, and a calibrated one.

Every scheme maps each weight to one of a few *levels* of a block of weights and keeps,
per block, the fp16 numbers needed to map back (as GGUF, GPTQ and AWQ files do):

* ``absmax`` (symmetric): levels ``k / qmax * a`` for ``k = -qmax..qmax``, where
  ``qmax = 2**(bits-1) - 1`` and ``a`` is the block's largest ``|w|``;
* ``minmax`` (asymmetric): levels ``lo + k * step`` for ``k = 0..2**bits - 1``: the block's
  minimum and its range in ``2**bits - 1`` steps (the layout of GGUF's Q4_1);
* ``nf4``: sixteen levels at quantiles of a normal distribution (QLoRA), times ``a``.

A block is the whole tensor, one output row, or a group of ``g`` consecutive weights
along a row. The stored fp16 numbers are chosen so that every weight's error is at most
half the distance between the two levels around it (``a`` and ``step`` are rounded up;
``lo`` to the nearest fp16 number, which is within half a step of the minimum), and so
that quantizing de-quantised weights again with the same scheme changes nothing.

Chapter 05 measures these schemes on every projection matrix of a model
(:func:`matrix_errors`), swaps them into a loaded model and back
(:class:`WeightQuantizer`, reused by chapters 07 and 08), counts their bits
(:func:`bits_per_weight`, :data:`GGUF_FORMATS`) and improves on round-to-nearest with
activation-aware scaling calibrated on real text (:func:`awq_search`): one scale vector per
input that several projections read (:data:`AWQ_GROUPS`), folded into the norm or projection
in front of them (:func:`awq_folded`). For a whole model, :func:`awq_model_scales` returns the
``input_scales`` that :meth:`WeightQuantizer.apply` takes (chapter 07 evaluates the result).
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .hooks import capture_inputs, decoder_layers, projection_modules
from .progress import progress_bar
from .prompts import TextSplit, token_ids
from .validation import check_positive_int

KINDS = ("absmax", "minmax", "nf4")
GRANULARITIES = ("tensor", "row", "group")
FP16_MAX = 65504.0
_FP16_TINY = 2.0 ** -24          # the smallest positive fp16 number (a subnormal)
SCALE_BITS = 16                  # every stored scale, minimum or absmax is an fp16 number


# --- schemes -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Scheme:
    """A round-to-nearest quantization scheme (chapter 05).

    ``kind``: ``"absmax"``, ``"minmax"`` or ``"nf4"``; ``bits``: 2..8 (4 for NF4);
    ``granularity``: ``"tensor"``, ``"row"`` or ``"group"``; ``group_size``: weights per
    group along a row (``"group"`` only). The group size must divide the row length unless
    ``pad=True``: then the last group of each row is shorter (implemented by padding the
    row with copies of its last weight, which changes no group's minimum, maximum or
    absmax, so it is exactly a shorter group; its bits are counted per started group).
    """

    kind: str = "absmax"
    bits: int = 4
    granularity: str = "group"
    group_size: int | None = 128
    pad: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be an integer from 2 to 8, got {self.bits!r}")
        if self.kind == "nf4" and self.bits != 4:
            raise ValueError(f"NF4 has 16 levels, i.e. bits=4; got bits={self.bits}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.granularity != "group":
            object.__setattr__(self, "group_size", None)
            object.__setattr__(self, "pad", False)
        elif not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 1:
            raise ValueError(f"granularity='group' needs a positive integer group_size, got {self.group_size!r}")

    @property
    def name(self) -> str:
        """A short label such as ``"INT4 per-row"``, ``"INT4 group-128"``, ``"NF4 block-64"``."""
        base = "NF4" if self.kind == "nf4" else f"INT{self.bits}" + (" asym" if self.kind == "minmax" else "")
        where = {"tensor": "per-tensor", "row": "per-row"}.get(self.granularity)
        if where is None:
            where = f"{'block' if self.kind == 'nf4' else 'group'}-{self.group_size}"
        return f"{base} {where}"

    @property
    def n_levels(self) -> int:
        """How many distinct levels a block can use (absmax leaves one code unused: 2**bits - 1)."""
        return 2 ** self.bits - 1 if self.kind == "absmax" else 2 ** self.bits


def qmax(bits: int) -> int:
    """The largest code of symmetric absmax quantization: 2**(bits-1) - 1 (127 for 8 bits)."""
    return 2 ** (bits - 1) - 1


#: The schemes chapter 05 compares, in the order of its table.
CHAPTER_SCHEMES = {
    "INT8 per-tensor": Scheme("absmax", 8, "tensor"),
    "INT8 per-row": Scheme("absmax", 8, "row"),
    "INT4 per-tensor": Scheme("absmax", 4, "tensor"),
    "INT4 per-row": Scheme("absmax", 4, "row"),
    "INT4 group-128": Scheme("absmax", 4, "group", 128, pad=True),
    "INT4 group-64": Scheme("absmax", 4, "group", 64, pad=True),
    "NF4 block-64": Scheme("nf4", 4, "group", 64, pad=True),
}

#: GGUF's Q4_1 layout: 4-bit codes, blocks of 32, an fp16 step and an fp16 minimum each.
Q4_1 = Scheme("minmax", 4, "group", 32)


# --- NF4 levels ----------------------------------------------------------------------------

def nf4_levels() -> torch.Tensor:
    """The 16 NF4 levels in [-1, 1], built as QLoRA does (Dettmers et al. 2023), float32.

    Eight positive levels are normal quantiles at probabilities spaced evenly from
    ``offset`` down to 1/2, seven negative ones likewise, plus an exact zero; each side
    is divided by the largest so the ends are -1 and 1. ``offset`` is the midpoint of
    1 - 1/(2*15) and 1 - 1/(2*16), which keeps the outermost quantile finite.
    """
    offset = ((1 - 1 / (2 * 15)) + (1 - 1 / (2 * 16))) / 2
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([positive, negative, torch.zeros(1, dtype=torch.float64)]).sort().values
    return (levels / levels.max()).to(torch.float32)


_NF4 = nf4_levels()
_NF4_MIDPOINTS = (_NF4[1:] + _NF4[:-1]) / 2


# --- checks and blocks ---------------------------------------------------------------------

def _check_weights(w, scheme: Scheme) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor of weights, got {type(w).__name__}")
    if not isinstance(scheme, Scheme):
        raise TypeError(f"expected a Scheme, got {type(scheme).__name__}")
    if not w.is_floating_point():
        raise ValueError(f"weights must be a floating-point tensor, got {w.dtype}")
    if w.numel() == 0:
        raise ValueError("weights are empty: nothing to quantize")
    if scheme.granularity != "tensor" and w.dim() != 2:
        raise ValueError(f"{scheme.granularity} granularity needs a 2-D (out_features, in_features) "
                         f"matrix, got shape {tuple(w.shape)}")
    lo, hi = torch.aminmax(w.detach())                      # NaN propagates; no temporary copy
    if not (torch.isfinite(lo) and torch.isfinite(hi)):
        raise ValueError("weights contain NaN or inf; quantization needs finite values")
    if max(-lo.item(), hi.item()) > FP16_MAX:
        raise ValueError(f"weights must satisfy |w| <= {FP16_MAX:g}: scales are stored in fp16")
    if scheme.granularity == "group" and w.shape[1] % scheme.group_size and not scheme.pad:
        raise ValueError(f"group_size {scheme.group_size} does not divide the row length {w.shape[1]}; "
                         f"choose a divisor of {w.shape[1]} or pass pad=True for a shorter last group")


def _blocks(w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """``w`` as (n_blocks, block_len) float32: one block, one per row, or one per group."""
    w = w.detach().float()
    if scheme.granularity == "tensor":
        return w.reshape(1, -1)
    if scheme.granularity == "row":
        return w.reshape(w.shape[0], -1)
    missing = -w.shape[1] % scheme.group_size
    if missing:                                  # pad=True: repeat each row's last weight
        w = torch.cat([w, w[:, -1:].expand(-1, missing)], dim=1)
    return w.reshape(-1, scheme.group_size)


def _unblock(blocks: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of :func:`_blocks` (drops the padding of a shorter last group)."""
    if len(shape) == 2 and blocks.numel() != shape[0] * shape[1]:
        return blocks.reshape(shape[0], -1)[:, :shape[1]]
    return blocks.reshape(shape)


def fp16_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 number >= x (|x| <= 65504), as an fp16 tensor: how a scale is stored."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, math.inf)), h)


def _minmax_params(blocks: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 minimum and step of each block (n_blocks, 1) for levels ``lo + k * step``, k = 0..top.

    ``lo`` is the block minimum rounded to the nearest fp16 number; ``step`` covers the range
    ``(max - lo) / top`` rounded up, and is never finer than the fp16 spacing at ``lo`` (nor
    than 2^-14, fp16's smallest normal number), so the minimum stays within half a step of ``lo``
    and ``lo + k * step`` is computed exactly: re-quantizing de-quantised weights then finds
    the same ``lo`` and ``step`` again. The factor 1 - 2^-22 absorbs float32 rounding in
    ``(max - lo) / top``. For a block stored by GGUF's Q4_1 this gives back its ``m`` and ``d``.
    """
    lo, hi = torch.aminmax(blocks, dim=1, keepdim=True)
    lo = lo.half()
    mag = lo.abs().clamp(max=2.0 ** 15)           # 32768 and 65504 share the fp16 spacing 32
    floor = (torch.nextafter(mag, torch.full_like(mag, math.inf)) - mag).float().clamp_min(2.0 ** -14)
    step = fp16_ceil((hi - lo.float()) / top * (1 - 2.0 ** -22))
    return lo, torch.maximum(step.float(), floor).half()


# --- quantize / de-quantize ------------------------------------------------------------------

@dataclass
class QuantizedTensor:
    """Codes and per-block fp16 numbers of one quantized tensor (chapter 05).

    ``codes``: uint8, (n_blocks, block_len); ``scale``: fp16, (n_blocks, 1) -- the block's
    absmax (absmax, nf4) or its step (minmax); ``offset``: fp16 (n_blocks, 1), the block's
    minimum (minmax only); ``shape``: the original tensor's shape.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    shape: torch.Size
    scheme: Scheme

    @property
    def nbytes(self) -> int:
        """Bytes with codes packed at ``bits`` each and fp16 block numbers (what a file would hold)."""
        n_params = 1 + (self.offset is not None)
        return math.ceil(self.codes.numel() * self.scheme.bits / 8) + n_params * 2 * self.scale.numel()


def quantize(w: torch.Tensor, scheme: Scheme) -> QuantizedTensor:
    """Round every weight of ``w`` to its block's nearest level (chapter 05).

    ``w``: a 2-D (out_features, in_features) matrix (any shape for per-tensor), finite,
    |w| <= 65504. Raises ``ValueError`` for anything else, or for a group size that does
    not divide the row.
    """
    _check_weights(w, scheme)
    blocks = _blocks(w, scheme)
    if scheme.kind == "minmax":
        lo, step = _minmax_params(blocks, 2 ** scheme.bits - 1)
        codes = (blocks - lo.float()).div_(step.float()).round_().clamp_(0, 2 ** scheme.bits - 1)
        return QuantizedTensor(codes.to(torch.uint8), step, lo, w.shape, scheme)
    lo, hi = torch.aminmax(blocks, dim=1, keepdim=True)
    absmax = fp16_ceil(torch.maximum(-lo, hi).clamp_min(_FP16_TINY))
    x = blocks / absmax.float()                                  # every block now lies in [-1, 1]
    if scheme.kind == "nf4":
        codes = torch.bucketize(x, _NF4_MIDPOINTS.to(x.device))  # index of the nearest level
    else:
        q = qmax(scheme.bits)
        codes = x.mul_(q).round_().clamp_(-q, q).add_(q)         # k + qmax in 0..2*qmax
    return QuantizedTensor(codes.to(torch.uint8), absmax, None, w.shape, scheme)


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """The float32 weights a quantized tensor stands for, in its original shape (chapter 05)."""
    scheme = qt.scheme
    if scheme.kind == "minmax":
        blocks = qt.codes.float().mul_(qt.scale.float()).add_(qt.offset.float())  # GGUF Q4_1's order
    elif scheme.kind == "nf4":
        blocks = _NF4.to(qt.codes.device)[qt.codes.int()].mul_(qt.scale.float())
    else:
        q = qmax(scheme.bits)
        blocks = qt.codes.float().sub_(q).div_(q).mul_(qt.scale.float())
    return _unblock(blocks, qt.shape)


def fake_quantize(w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """``dequantize(quantize(w, scheme))``: the weights a quantized model computes with, float32."""
    return dequantize(quantize(w, scheme))


def level_spacing(w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """For each weight, the distance between the two levels around it (same shape as ``w``).

    Uniform schemes: the block's step (absmax: ``a / qmax``; minmax: ``step``). NF4: the
    gap between the two NF4 levels that bracket ``w / a``, times ``a``. Round-to-nearest
    puts every weight within half of this of its de-quantised value.
    """
    qt = quantize(w, scheme)
    blocks = _blocks(w, scheme)
    if scheme.kind == "minmax":
        return _unblock(qt.scale.float().expand_as(blocks), w.shape)
    if scheme.kind == "absmax":
        return _unblock((qt.scale.float() / qmax(scheme.bits)).expand_as(blocks), w.shape)
    levels = _NF4.to(blocks.device)
    upper = torch.bucketize(blocks / qt.scale.float(), levels).clamp(1, len(levels) - 1)
    return _unblock((levels[upper] - levels[upper - 1]) * qt.scale.float(), w.shape)


def relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """``||W - W_hat|| / ||W||`` (Frobenius norms), the error measure of chapter 05."""
    if w.shape != w_hat.shape:
        raise ValueError(f"shapes differ: {tuple(w.shape)} vs {tuple(w_hat.shape)}")
    w = w.detach().float()
    return (torch.linalg.vector_norm(w_hat.float() - w) / torch.linalg.vector_norm(w)).item()


def count_levels(codes: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Distinct codes in ``codes`` (n_blocks, block_len): overall, and in each block, (n_blocks,) int64.

    Chapter 05 counts them per block of weights; chapter 06 per dimension of activations
    (pass the codes transposed, one row per dimension).
    """
    if codes.dim() != 2 or codes.numel() == 0:
        raise ValueError(f"codes must be a non-empty (n_blocks, block_len) tensor, got shape {tuple(codes.shape)}")
    ordered = codes.to(torch.int16).sort(dim=1).values
    per_block = 1 + (ordered.diff(dim=1) != 0).sum(1)
    return int(codes.unique().numel()), per_block


def levels_used(qt: QuantizedTensor) -> dict:
    """How many distinct codes a quantized tensor uses: overall, and per block (median, max)."""
    overall, per_block = count_levels(qt.codes)
    return {"overall": overall, "available": qt.scheme.n_levels,
            "per_block_median": float(per_block.float().median()), "per_block_max": int(per_block.max())}


def code_histogram(qt: QuantizedTensor) -> torch.Tensor:
    """How many weights landed on each code, (2**bits,) int64 (absmax leaves the last code at 0)."""
    return torch.bincount(qt.codes.flatten().long(), minlength=2 ** qt.scheme.bits)


#: The granularities the chapter 05 widget offers: label -> (granularity, group_size).
WIDGET_GRANULARITIES = {"per-tensor": ("tensor", None), "per-row": ("row", None),
                        "group-128": ("group", 128), "group-32": ("group", 32)}


@torch.no_grad()
def levels_sweep(w: torch.Tensor, bits_range=range(2, 9), granularities=None) -> dict:
    """Precompute, for one matrix, every (bits, granularity) the widget can show (absmax schemes).

    Returns ``{(bits, label): {"levels": level values in [-1, 1], "counts": weights per level,
    "error": relative error, "used": levels_used(...)}}``.
    """
    granularities = WIDGET_GRANULARITIES if granularities is None else granularities
    out = {}
    for bits in bits_range:
        for label, (gran, g) in granularities.items():
            scheme = Scheme("absmax", bits, gran, g, pad=True)
            qt = quantize(w, scheme)
            q = qmax(bits)
            counts = code_histogram(qt)[: 2 * q + 1]
            out[(bits, label)] = {"levels": [(k - q) / q for k in range(2 * q + 1)], "counts": counts.tolist(),
                                  "error": relative_error(w, dequantize(qt)), "used": levels_used(qt),
                                  "scheme": scheme}
    return out


def levels_figure(sweep: dict, bits: int, granularity: str):
    """The chapter 05 widget's chart: how many weights land on each level, for one choice.

    A pure function of the precomputed ``sweep`` (:func:`levels_sweep`) and the two controls.
    """
    from .plots import PALETTE, figure

    if (bits, granularity) not in sweep:
        raise ValueError(f"no precomputed result for bits={bits}, granularity={granularity!r}")
    r = sweep[(bits, granularity)]
    used = r["used"]
    title = (f"INT{bits} {granularity}: {used['overall']} of {used['available']} levels used "
             f"(median {used['per_block_median']:.0f} per block); relative error {r['error']:.4f}")
    fig = figure(title, "level (fraction of the block's largest |w|)", "weights on the level (count)", log_y=True)
    fig.add_bar(x=r["levels"], y=[c if c > 0 else None for c in r["counts"]], marker_color=PALETTE[0],
                name="weights per level")
    fig.update_xaxes(range=[-1.08, 1.08])
    return fig


# --- bits per weight -------------------------------------------------------------------------

def block_len(scheme: Scheme, shape) -> float:
    """Weights per block for a matrix of ``shape`` (out_features, in_features); with ``pad=True``
    the average over a row's groups, the last one shorter."""
    shape = tuple(shape)
    if scheme.granularity == "tensor":
        return math.prod(shape)
    if len(shape) != 2:
        raise ValueError(f"{scheme.granularity} granularity needs a 2-D shape, got {shape}")
    if scheme.granularity == "row":
        return shape[1]
    if shape[1] % scheme.group_size and not scheme.pad:
        raise ValueError(f"group_size {scheme.group_size} does not divide the row length {shape[1]}")
    return shape[1] / math.ceil(shape[1] / scheme.group_size)   # average weights per started group


def bits_per_weight(scheme: Scheme, shape=(4096, 4096)) -> float:
    """Storage bits per weight: the code plus each block's fp16 numbers spread over its weights.

    absmax and nf4 keep one fp16 number per block, minmax two (step and minimum):
    ``bits + 16 * n / block_len``. Per-row and per-tensor depend on the matrix ``shape``.
    """
    n_numbers = 2 if scheme.kind == "minmax" else 1
    return scheme.bits + SCALE_BITS * n_numbers / block_len(scheme, shape)


def projection_bits(modules, scheme: Scheme | None) -> float:
    """Bits per weight of the projection matrices ``modules`` (name -> Linear) under ``scheme``, scales
    included, averaged over every matrix by its size (each matrix's shape sets its per-row scale cost).
    ``scheme=None``: the weights as stored (their dtype's bits)."""
    mods = list(modules.values()) if isinstance(modules, dict) else list(modules)
    if not mods:
        raise ValueError("no projection matrices given")
    n = sum(m.weight.numel() for m in mods)
    if scheme is None:
        return sum(m.weight.element_size() * 8 * m.weight.numel() for m in mods) / n
    return sum(bits_per_weight(scheme, tuple(m.weight.shape)) * m.weight.numel() for m in mods) / n


@dataclass(frozen=True)
class BlockLayout:
    """One GGUF block type: how many weights a block holds and the bits of each field."""

    name: str
    weights: int
    fields: tuple[tuple[str, int], ...]
    note: str = ""

    @property
    def bits(self) -> int:
        return sum(bits for _, bits in self.fields)

    @property
    def bits_per_weight(self) -> float:
        return self.bits / self.weights


#: Block layouts of ggml's quantization types (ggml-common.h). K-quants use super-blocks of 256.
GGUF_FORMATS = {b.name: b for b in [
    BlockLayout("Q4_0", 32, (("fp16 scale d", 16), ("32 x 4-bit codes", 128)), "x = d * (q - 8)"),
    BlockLayout("Q4_1", 32, (("fp16 scale d", 16), ("fp16 minimum m", 16), ("32 x 4-bit codes", 128)),
                "x = d * q + m"),
    BlockLayout("Q5_0", 32, (("fp16 scale d", 16), ("32 high bits", 32), ("32 x 4-bit low codes", 128))),
    BlockLayout("Q5_1", 32, (("fp16 scale d", 16), ("fp16 minimum m", 16), ("32 high bits", 32),
                             ("32 x 4-bit low codes", 128))),
    BlockLayout("Q8_0", 32, (("fp16 scale d", 16), ("32 x 8-bit codes", 256)), "x = d * q"),
    BlockLayout("Q4_K", 256, (("fp16 super-scale d", 16), ("fp16 super-min dmin", 16),
                              ("8 x (6-bit scale + 6-bit min)", 96), ("256 x 4-bit codes", 1024)),
                "8 sub-blocks of 32, each with its own 6-bit scale and minimum"),
    BlockLayout("Q5_K", 256, (("fp16 super-scale d", 16), ("fp16 super-min dmin", 16),
                              ("8 x (6-bit scale + 6-bit min)", 96), ("256 high bits", 256),
                              ("256 x 4-bit low codes", 1024))),
    BlockLayout("Q6_K", 256, (("256 x 4-bit low codes", 1024), ("256 x 2-bit high codes", 512),
                              ("16 x 8-bit sub-block scales", 128), ("fp16 super-scale d", 16)),
                "16 sub-blocks of 16, symmetric"),
]}

#: K-quant types need rows (in_features) divisible by 256; llama.cpp falls back to these.
K_QUANT_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits in the _M mixes."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _gguf_tensors(dims, tied: bool) -> list[tuple[str, int, int, int]]:
    """(role, layer, rows, row_len) of every weight matrix of a llama-like decoder."""
    q, kv = dims.n_heads * dims.head_dim, dims.n_kv_heads * dims.head_dim
    per_layer = [("attn_q", q, dims.d_model), ("attn_k", kv, dims.d_model), ("attn_v", kv, dims.d_model),
                 ("attn_output", dims.d_model, q), ("ffn_gate", dims.d_ff, dims.d_model),
                 ("ffn_up", dims.d_ff, dims.d_model), ("ffn_down", dims.d_model, dims.d_ff)]
    mats = [(role, i, rows, cols) for i in range(dims.n_layers) for role, rows, cols in per_layer]
    mats.append(("output", -1, dims.vocab_size, dims.d_model))
    if not tied:
        mats.append(("token_embd", -1, dims.vocab_size, dims.d_model))
    return mats


def _mix_type(ftype: str, role: str, i_layer: int, n_layers: int, row_len: int) -> str:
    base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}[ftype]
    if role == "output":
        kind = "Q6_K" if row_len % 256 == 0 else "Q8_0"
    elif role in ("attn_v", "ffn_down") and _use_more_bits(i_layer, n_layers):
        kind = "Q6_K"
    else:
        kind = base
    return K_QUANT_FALLBACK[kind] if kind in K_QUANT_FALLBACK and row_len % 256 else kind


def gguf_mix(dims, ftype: str = "Q4_K_M", *, tied: bool = False) -> dict:
    """Bits per weight of a ``_K_M`` file for a model of shape ``dims`` (a :class:`ModelDims`).

    Follows llama.cpp's rules (``llama_tensor_get_type``) for a llama-like model: the output
    matrix (or the tied embedding) in Q6_K; ``attn_v`` and ``ffn_down`` of the first and last
    eighth of the layers and of every third layer between them in Q6_K; everything else in
    the base type (Q4_K or Q5_K); a matrix whose rows are not a multiple of 256 falls back to
    Q5_0 / Q5_1 / Q8_0. Norm vectors (float32) are left out. Returns ``bits_per_weight``,
    ``n_weights`` and the weights per type.
    """
    if ftype not in ("Q4_K_M", "Q5_K_M"):
        raise ValueError(f"ftype must be 'Q4_K_M' or 'Q5_K_M', got {ftype!r}")
    if dims.d_ff is None or dims.vocab_size is None:
        raise ValueError("dims needs d_ff and vocab_size (use model_dims(config))")
    per_type: dict[str, int] = {}
    for role, i, rows, cols in _gguf_tensors(dims, tied):
        kind = _mix_type(ftype, role, i, dims.n_layers, cols)
        per_type[kind] = per_type.get(kind, 0) + rows * cols
    n = sum(per_type.values())
    bits = sum(GGUF_FORMATS[k].bits_per_weight * v for k, v in per_type.items())
    return {"ftype": ftype, "bits_per_weight": bits / n, "n_weights": n, "weights_per_type": per_type}


# --- a whole model ---------------------------------------------------------------------------

def projection_param_count(dims) -> tuple[int, int]:
    """(number of projection matrices, their weights) of a llama-like decoder from its dims."""
    mats = [m for m in _gguf_tensors(dims, tied=True) if m[0] not in ("output", "token_embd")]
    return len(mats), sum(rows * cols for _, _, rows, cols in mats)


@dataclass
class SchemeErrors:
    """Relative error of every projection matrix under one scheme (chapter 05)."""

    scheme: Scheme
    errors: dict[str, float]
    n_weights: int
    seconds: float
    bits_per_weight: float

    @property
    def mean(self) -> float:
        return sum(self.errors.values()) / len(self.errors)

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.errors, key=self.errors.get)
        return name, self.errors[name]


@torch.no_grad()
def matrix_errors(model, scheme: Scheme, *, progress: bool = False) -> SchemeErrors:
    """Quantize every projection matrix (one at a time, nothing kept) and record its error.

    ``bits_per_weight`` is the weighted mean over the matrices; ``seconds`` is the wall time
    of the whole pass (quantize + de-quantize + error).
    """
    mods = projection_modules(model)
    errors, n, bits, t0 = {}, 0, 0.0, time.perf_counter()
    for name, mod in progress_bar(mods.items(), scheme.name, enabled=progress, total=len(mods)):
        w = mod.weight
        errors[name] = relative_error(w, fake_quantize(w, scheme))
        n += w.numel()
        bits += bits_per_weight(scheme, w.shape) * w.numel()
    return SchemeErrors(scheme, errors, n, time.perf_counter() - t0, bits / n)


def weight_stats(w: torch.Tensor, *, sigmas: float = 6.0) -> dict:
    """Mean |w|, std, max |w|, max/std and how many weights lie beyond ``sigmas`` standard deviations."""
    w = w.detach().float()
    std = w.std().item()
    beyond = int(((w - w.mean()).abs() > sigmas * std).sum())
    return {"mean_abs": w.abs().mean().item(), "std": std, "max_abs": w.abs().max().item(),
            "max_over_std": w.abs().max().item() / std, "beyond": beyond, "n": w.numel(),
            "share_beyond": beyond / w.numel()}


class WeightQuantizer:
    """Swap every projection matrix of a loaded model for its de-quantised version, and back.

    Chapter 05 introduces it; chapters 07 and 08 compare schemes on one loaded model with it::

        wq = WeightQuantizer(model)
        wq.apply(Scheme("absmax", 4, "row"))   # the model now computes with INT4 per-row weights
        wq.restore()                            # bit-identical original weights again

    The originals are kept once, at the first :meth:`apply`, in the most compact form that
    gives them back bit for bit: 4-bit codes of the GGUF Q4_1 layout when the matrix is
    exactly a Q4_1 de-quantisation (the embedded model), a bf16 copy when every weight is
    a bf16 number, otherwise a copy in the weight's own dtype.
    """

    def __init__(self, model):
        self.model = model
        self.modules = projection_modules(model)
        if not self.modules:
            raise ValueError("the model has no nn.Linear projection matrices to quantize")
        self._saved: dict[str, object] = {}
        self.scheme: Scheme | None = None

    @staticmethod
    def _compact(w: torch.Tensor):
        if w.dim() == 2 and w.shape[1] % Q4_1.group_size == 0 and torch.isfinite(w).all():
            qt = quantize(w, Q4_1)
            if torch.equal(dequantize(qt).to(w.dtype), w):
                return qt
        if w.dtype == torch.float32 and torch.equal(w.bfloat16().float(), w):
            return w.bfloat16()
        return w.clone()

    def _original(self, name: str) -> torch.Tensor:
        saved = self._saved[name]
        w = dequantize(saved) if isinstance(saved, QuantizedTensor) else saved
        return w.to(self.modules[name].weight.dtype)

    def saved_bytes(self) -> int:
        """Bytes held for the originals (codes at one byte each, as stored in memory here)."""
        total = 0
        for s in self._saved.values():
            tensors = [s.codes, s.scale, s.offset] if isinstance(s, QuantizedTensor) else [s]
            total += sum(t.nbytes for t in tensors if t is not None)
        return total

    @torch.no_grad()
    def apply(self, scheme: Scheme, *, input_scales: dict[str, torch.Tensor] | None = None, progress: bool = False):
        """Replace every projection weight ``W`` by ``fake_quantize(W, scheme)``.

        ``input_scales`` (name -> (in_features,) tensor, e.g. from :func:`awq_search`) quantizes
        ``W * s`` instead and divides by ``s`` after, as activation-aware scaling does.
        Returns the seconds the pass took.
        """
        if not isinstance(scheme, Scheme):
            raise TypeError(f"expected a Scheme, got {type(scheme).__name__}")
        t0 = time.perf_counter()
        items = self.modules.items()
        for name, mod in progress_bar(items, scheme.name, enabled=progress, total=len(self.modules)):
            if name not in self._saved:
                self._saved[name] = self._compact(mod.weight.data)
            w = self._original(name)
            s = None if input_scales is None else input_scales.get(name)
            w_hat = fake_quantize(w, scheme) if s is None else scaled_fake_quantize(w, s, scheme)
            mod.weight.data.copy_(w_hat.to(mod.weight.dtype))
        self.scheme = scheme
        return time.perf_counter() - t0

    @torch.no_grad()
    def restore(self) -> None:
        """Put the original weights back (bit-identical); keep the saved copies for the next apply."""
        for name in self._saved:
            self.modules[name].weight.data.copy_(self._original(name))
        self.scheme = None

    def release(self) -> None:
        """Restore the originals and free the saved copies."""
        self.restore()
        self._saved.clear()


# --- activation-aware scaling (AWQ-style) ---------------------------------------------------

def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """``||x W^T - x W_hat^T|| / ||x W^T||`` for inputs ``x`` (n, in_features): a layer's output error.

    For projections that read the same input, pass their matrices stacked along the rows
    (``torch.cat([w_q, w_k, w_v])``): the result is the relative error of all their outputs together.
    """
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be (n_tokens, {w.shape[1]}), got {tuple(x.shape)}")
    x, w = x.float(), w.detach().float()
    y = x @ w.T
    return ((y - x @ w_hat.float().T).norm() / y.norm()).item()


def scaled_fake_quantize(w: torch.Tensor, s: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Quantize ``W diag(s)`` and undo the scaling: ``Q(W * s) / s`` (s: (in_features,), positive).

    In a deployed model ``1/s`` is folded into whatever produces the layer's input (a norm's
    weight, the previous projection's rows: :func:`awq_folded`), so the layer computes
    ``(x / s) Q(W * s)^T``; this function returns the equivalent weight matrix.
    """
    if s.dim() != 1 or s.shape[0] != w.shape[1] or not (s > 0).all():
        raise ValueError(f"s must be a positive vector of length in_features={w.shape[1]}")
    s = s.float().to(w.device)
    return fake_quantize(w.float() * s, scheme) / s


@dataclass
class AwqFit:
    """The result of :func:`awq_search`: the chosen exponent, its scales, the error curves."""

    alpha: float
    scales: torch.Tensor
    alphas: list[float]
    errors: list[float] = field(repr=False)
    eval_errors: list[float] | None = field(default=None, repr=False)

    @property
    def rtn_error(self) -> float:
        """Calibration error at alpha = 0, i.e. plain round-to-nearest."""
        return self.errors[0]


def awq_scales(act_mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """AWQ's per-input-channel scales ``mean|x|^alpha``, divided by sqrt(max * min) to centre them."""
    s = act_mean_abs.clamp_min(1e-8).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def _matrices(w) -> list[torch.Tensor]:
    ws = [w] if isinstance(w, torch.Tensor) else list(w)
    if not ws or not all(isinstance(m, torch.Tensor) and m.dim() == 2 for m in ws):
        raise ValueError("w must be a 2-D weight matrix or a non-empty list of them")
    if len({m.shape[1] for m in ws}) != 1:
        raise ValueError(f"matrices that share an input need the same in_features, got {[tuple(m.shape) for m in ws]}")
    return [m.detach().float().cpu() for m in ws]


def _scaled_stack(ws: list[torch.Tensor], s: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Each matrix quantized on its own with the shared scales ``s``, stacked along the rows."""
    return torch.cat([scaled_fake_quantize(m, s, scheme) for m in ws])


def _stacked_error(x: torch.Tensor, y: torch.Tensor, w_hat: torch.Tensor) -> float:
    return ((y - x @ w_hat.T).norm() / y.norm()).item()


@torch.no_grad()
def awq_search(x_calib: torch.Tensor, w, scheme: Scheme, *, n_grid: int = 20,
               x_eval: torch.Tensor | None = None) -> AwqFit:
    """Activation-aware scaling (Lin et al. 2024, AWQ): the search over one exponent.

    Input channels that carry large activations matter more, so scale their weight columns
    up before rounding (their weights get finer steps, relative to their size) and the
    inputs down by the same factor: ``s = mean|x|^alpha`` (:func:`awq_scales`), alpha on the
    grid 0, 1/n_grid, ..., 1. ``w`` is one matrix (out_features, in_features) or a list of
    matrices that read the same input (q, k and v behind one norm): they get **one** ``s``,
    because one vector ``1/s`` is all the norm in front of them can absorb, and alpha minimises
    their outputs' error together (:func:`output_error` of the stacked matrices) on
    ``x_calib`` (n, in_features). alpha = 0 is round-to-nearest, so calibration can only help on
    the calibration data; ``x_eval`` (other text), if given, is measured at every alpha too.
    """
    ws = _matrices(w)
    check_positive_int("n_grid", n_grid)
    for name, x in (("x_calib", x_calib), ("x_eval", x_eval)):
        if x is not None and (x.dim() != 2 or x.shape[1] != ws[0].shape[1]):
            raise ValueError(f"{name} must be (n_tokens, {ws[0].shape[1]}), got {tuple(x.shape)}")
    stacked = torch.cat(ws)
    x_cal = x_calib.float().cpu()
    y_cal = x_cal @ stacked.T
    x_ev = None if x_eval is None else x_eval.float().cpu()
    y_ev = None if x_ev is None else x_ev @ stacked.T
    act = x_cal.abs().mean(0)
    alphas = [i / n_grid for i in range(n_grid + 1)]
    errors, eval_errors, best = [], [], (math.inf, 0.0, None)
    for alpha in alphas:
        s = awq_scales(act, alpha)
        w_hat = _scaled_stack(ws, s, scheme)
        errors.append(_stacked_error(x_cal, y_cal, w_hat))
        if x_ev is not None:
            eval_errors.append(_stacked_error(x_ev, y_ev, w_hat))
        if errors[-1] < best[0]:
            best = (errors[-1], alpha, s)
    return AwqFit(best[1], best[2], alphas, errors, eval_errors if x_eval is not None else None)


# --- AWQ on a whole model ---------------------------------------------------------------------

#: Where the inputs of a llama / qwen2 decoder layer's projections come from (names inside the layer):
#: (the module whose output is the input, the projections that read it). One scale vector per input:
#: its ``1/s`` folds into that module (a norm's weight vector, or a projection's output rows).
AWQ_GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)

GQA_SKIP = ("grouped-query attention: one value channel feeds several inputs of o_proj (one per query head "
            "sharing it), so a scale per o_proj input cannot fold into v_proj's rows; llm-awq and AutoAWQ "
            "skip o_proj then, and so does this search (round-to-nearest)")


@dataclass
class AwqGroup:
    """The projections of one layer that read one input, and the scale they share (chapter 05).

    ``fold_into``: full name of the module whose output they read; ``1/s`` folds into its weight
    (an RMSNorm's vector, or a projection's output rows and bias). ``names``: the projections, full
    names. ``fit``: the search's result (``None`` when the group is skipped, with the reason in
    ``skipped``). ``heldout``: output errors on held-out text, ``{"rtn": ..., "awq": ...}``.
    """

    layer: int
    fold_into: str
    names: tuple[str, ...]
    fit: AwqFit | None = None
    skipped: str = ""
    heldout: dict | None = None

    @property
    def label(self) -> str:
        """``"q_proj, k_proj, v_proj"``: the projections' short names."""
        return ", ".join(n.rsplit(".", 1)[-1] for n in self.names)


def awq_groups(model, layers=None) -> list[AwqGroup]:
    """The :data:`AWQ_GROUPS` of each decoder layer in ``layers`` (default: all), unfitted.

    o_proj is marked skipped where v_proj's outputs are fewer than o_proj's inputs (GQA:
    :data:`GQA_SKIP`). Raises ``ValueError`` for a model whose layers do not have these modules.
    """
    blocks = decoder_layers(model)
    chosen = range(len(blocks)) if layers is None else list(layers)
    prefix = {id(m): name for name, m in model.named_modules()}
    groups = []
    for i in chosen:
        if not isinstance(i, int) or not 0 <= i < len(blocks):
            raise ValueError(f"layers must be indices 0..{len(blocks) - 1}, got {i!r}")
        block, base = blocks[i], prefix[id(blocks[i])]
        subs = dict(block.named_modules())
        for src, names in AWQ_GROUPS:
            missing = [n for n in (src, *names) if n not in subs]
            if missing:
                raise ValueError(f"AWQ's groups need a llama/qwen2 decoder layer; layer {i} has no {missing}")
            skipped = ""
            if src.endswith("v_proj") and subs[src].out_features != subs[names[0]].in_features:
                skipped = GQA_SKIP
            groups.append(AwqGroup(i, f"{base}.{src}", tuple(f"{base}.{n}" for n in names), skipped=skipped))
    return groups


def _weights(model, group: AwqGroup) -> list[torch.Tensor]:
    mods = dict(model.named_modules())
    return [mods[n].weight.detach().float().cpu() for n in group.names]


@torch.no_grad()
def _each_layer_inputs(model, groups: list[AwqGroup], input_ids: torch.Tensor, fn, *, progress: bool) -> None:
    """One forward pass over ``input_ids``; when a decoder layer finishes, ``fn(layer, {name: x})``
    receives what each group's first projection read in it ((n_tokens, in_features), float32, CPU),
    which is then dropped: only one layer's inputs are held at a time."""
    mods, blocks = dict(model.named_modules()), decoder_layers(model)
    got: dict[str, torch.Tensor] = {}
    layers = sorted({g.layer for g in groups})
    bar = progress_bar(None, "AWQ, layer by layer", enabled=progress, total=len(layers))

    def keep(_m, args, name):
        got[name] = args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu()

    def done(_m, _args, _out, layer):
        fn(layer, got)
        got.clear()
        bar.update(1)

    hooks = [mods[g.names[0]].register_forward_pre_hook(lambda m, a, name=g.names[0]: keep(m, a, name))
             for g in groups]
    hooks += [blocks[i].register_forward_hook(lambda m, a, o, layer=i: done(m, a, o, layer)) for i in layers]
    try:
        model(input_ids.to(model.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        bar.close()


def _check_token_ids(name: str, ids) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.numel() == 0 or ids.is_floating_point():
        raise ValueError(f"{name} must be a (batch, n_tokens) tensor of token ids, "
                         f"got {getattr(ids, 'shape', type(ids).__name__)}")


@torch.no_grad()
def awq_model_fits(model, calib_ids: torch.Tensor, scheme: Scheme, *, heldout_ids: torch.Tensor | None = None,
                   layers=None, n_grid: int = 20, progress: bool = False) -> list[AwqGroup]:
    """AWQ-style scales for every shared input of every decoder layer (or of ``layers``).

    ``calib_ids`` (batch, n_tokens): the calibration text, read in one forward pass of the
    unchanged model; each group's scale comes from :func:`awq_search` on the inputs its
    projections read there. ``heldout_ids``, if given, is read in a second pass to measure
    each group's output error with round-to-nearest and with the chosen scale (``heldout``).
    Skipped groups (o_proj under GQA) keep ``fit=None`` and are measured with RTN only.
    """
    if not isinstance(scheme, Scheme):
        raise TypeError(f"expected a Scheme, got {type(scheme).__name__}")
    _check_token_ids("calib_ids", calib_ids)
    if heldout_ids is not None:
        _check_token_ids("heldout_ids", heldout_ids)
    check_positive_int("n_grid", n_grid)
    groups = awq_groups(model, layers)

    def calibrate(layer, inputs):
        for g in groups:
            if g.layer == layer and not g.skipped:
                g.fit = awq_search(inputs[g.names[0]], _weights(model, g), scheme, n_grid=n_grid)

    def measure(layer, inputs):
        for g in groups:
            if g.layer == layer:
                g.heldout = _heldout_errors(inputs[g.names[0]], _weights(model, g), g, scheme)

    _each_layer_inputs(model, groups, calib_ids, calibrate, progress=progress)
    if heldout_ids is not None:
        _each_layer_inputs(model, groups, heldout_ids, measure, progress=progress)
    return groups


def _heldout_errors(x: torch.Tensor, ws: list[torch.Tensor], group: AwqGroup, scheme: Scheme) -> dict:
    y = x @ torch.cat(ws).T
    rtn = _stacked_error(x, y, torch.cat([fake_quantize(m, scheme) for m in ws]))
    awq = rtn if group.fit is None else _stacked_error(x, y, _scaled_stack(ws, group.fit.scales, scheme))
    return {"rtn": rtn, "awq": awq}


def awq_input_scales(groups: list[AwqGroup]) -> dict[str, torch.Tensor]:
    """``{projection name: s}`` of every fitted group, for ``WeightQuantizer.apply(scheme, input_scales=...)``.

    The projections of one group get the same tensor.
    """
    return {name: g.fit.scales for g in groups if g.fit is not None for name in g.names}


def awq_model_scales(model, tok, split: TextSplit, scheme: Scheme, *, n_tokens: int = 512, n_grid: int = 20,
                     progress: bool = False) -> dict[str, torch.Tensor]:
    """AWQ-style input scales for a whole model, calibrated on ``split.train`` (chapter 05; used by chapter 07).

    ``split``: the course's one split (:func:`course_utils.prompts.book_split`); the first
    ``n_tokens`` tokens of ``split.train`` calibrate, so ``split.heldout`` stays unseen. Returns
    ``{projection name: (in_features,) scales}`` for :meth:`WeightQuantizer.apply`::

        scales = awq_model_scales(model, tok, book_split(), scheme)
        WeightQuantizer(model).apply(scheme, input_scales=scales)

    Projections that read one input share one vector (q/k/v, gate/up), which folds into the norm
    or projection in front of them (:func:`awq_folded`): the stored model has no extra numbers.
    o_proj under grouped-query attention gets none (:data:`GQA_SKIP`).
    """
    check_positive_int("n_tokens", n_tokens)
    ids = token_ids(tok, split.train, n_tokens)
    return awq_input_scales(awq_model_fits(model, ids, scheme, n_grid=n_grid, progress=progress))


@contextmanager
def awq_folded(model, groups: list[AwqGroup]):
    """Inside the ``with``: each fitted group's scales moved into the model's weights, as a file stores them.

    The projections' columns are multiplied by ``s`` and the module in front of them divided by
    ``s`` (an RMSNorm's weight vector; a projection's output rows and bias). The model computes
    the same function (up to float rounding); quantizing its projections with plain round-to-nearest
    then equals ``WeightQuantizer.apply(scheme, input_scales=...)`` for per-row and per-group
    schemes, whose blocks lie within one row (a row scaled by a constant keeps its codes).
    Every touched tensor is put back bit for bit on exit.
    """
    mods = dict(model.named_modules())
    fitted = [g for g in groups if g.fit is not None]
    touched = {id(t): t for g in fitted for n in (g.fold_into, *g.names)
               for t in (getattr(mods[n], "weight", None), getattr(mods[n], "bias", None)) if t is not None}
    saved = {k: t.detach().clone() for k, t in touched.items()}
    try:
        with torch.no_grad():
            for g in fitted:
                src = mods[g.fold_into]
                s = g.fit.scales.to(src.weight.device)
                if src.weight.dim() == 1:                        # a norm: y = weight * x / rms(x)
                    src.weight.div_(s.to(src.weight.dtype))
                else:                                            # a projection: its output rows
                    src.weight.div_(s.to(src.weight.dtype)[:, None])
                    if getattr(src, "bias", None) is not None:
                        src.bias.div_(s.to(src.bias.dtype))
                for n in g.names:
                    mods[n].weight.mul_(s.to(mods[n].weight.dtype))
        yield model
    finally:
        with torch.no_grad():
            for k, t in touched.items():
                t.copy_(saved[k])


@torch.no_grad()
def awq_layer(model, tok, split: TextSplit, scheme: Scheme, *, layer: int | None = None, n_tokens: int = 512,
              n_grid: int = 20, progress: bool = False) -> list[AwqGroup]:
    """AWQ vs round-to-nearest on each shared input of one layer (default: the middle one), with curves.

    Calibrates on the first ``n_tokens`` of ``split.train`` and measures on the first
    ``n_tokens`` of ``split.heldout`` (the course's one split, :func:`course_utils.prompts.book_split`).
    Each fitted group's :class:`AwqFit` carries the held-out error at every alpha (``eval_errors``).
    """
    chosen = len(decoder_layers(model)) // 2 if layer is None else layer
    groups = awq_groups(model, [chosen])
    mods = {n: m for g in groups for n, m in dict(model.named_modules()).items() if n == g.names[0]}
    x_cal = capture_inputs(model, mods, token_ids(tok, split.train, n_tokens))
    x_held = capture_inputs(model, mods, token_ids(tok, split.heldout, n_tokens))
    for g in progress_bar(groups, "AWQ search", enabled=progress):
        ws = _weights(model, g)
        if not g.skipped:
            g.fit = awq_search(x_cal[g.names[0]], ws, scheme, n_grid=n_grid, x_eval=x_held[g.names[0]])
        g.heldout = _heldout_errors(x_held[g.names[0]], ws, g, scheme)
    return groups
