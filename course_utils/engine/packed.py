"""The engine's fast paths: prepacked bf16 and weight-only int8 / int4 matrices (a switch; chapter 04 shows the dense path).

A decode step reads every weight once (chapter 02), so fewer bytes per weight can mean a faster step --
if a kernel reads the packed codes and unpacks them in registers (chapter 05 timed such kernels). PyTorch
has two on the CPU, and this module puts them behind one call, :func:`linear`, that the model runner
uses for every matrix product:

* ``"int8"``: int8 codes with one scale per output row, ``torch.ops.aten._weight_int8pack_mm``;
* ``"int4"``: 4-bit codes with a scale and a zero point per group of inputs,
  ``_weight_int4pack_mm_for_cpu`` (``_weight_int4pack_mm`` on CUDA), the group the largest of 128 / 64 / 32
  that divides the row.

And one that keeps every bit of the bfloat16 weights but stores them in oneDNN's own blocked layout, once,
so each product skips the re-layout a plain ``F.linear`` call makes (what vLLM's and PyTorch inductor's CPU
paths do):

* ``"onednn"``: ``torch.ops.mkldnn._reorder_linear_weight`` at load, ``_linear_pointwise`` per product
  (bfloat16 only; where this PyTorch build or CPU has no oneDNN bfloat16 linear, a clear error).

And one for CPUs where PyTorch's own bfloat16 product is slow. Where this CPU's oneDNN has no bfloat16
kernels (an x86 CPU without AVX-512, say), PyTorch multiplies bfloat16 matrices of more than one row with a
portable loop, several times slower than the same product in float32 (one row has a fast kernel of its own):

* ``"upcast"``: the same bfloat16 weights; a product of :data:`UPCAST_MIN_ROWS` rows or more converts the
  matrix to float32 one slice at a time, each slice small enough to stay in the cache until its product
  (:func:`upcast_product`), so the weights are still read from memory as bfloat16. It is the arithmetic a
  bfloat16 matrix product does anyway -- bfloat16 numbers multiplied and summed in float32, the result rounded
  to bfloat16 -- in another order of the sums. A prefill and a batch of decode steps gain; one-row products
  keep PyTorch's kernel.

The int paths are *lossy*: the engine then computes with ``W_hat``, the de-quantised matrix, not ``W``
(:meth:`PackedLinear.dequantized` gives it, for measuring the quality the fast path costs). Fusing q/k/v or
gate/up before packing changes nothing: both quantizers work row by row.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: What ``RunnerWeights.from_model(..., pack=...)`` accepts (``"compiled"``: dense weights, the decode step
#: compiled by ``torch.compile``, :mod:`.compiled`).
PACKINGS = ("none", "onednn", "upcast", "int8", "int4", "compiled")
#: The low-bit kernels' packings.
LOWBIT = ("int8", "int4")


@dataclass
class PrepackedLinear:
    """One bfloat16 weight matrix in oneDNN's blocked layout (the same numbers as the dense matrix)."""

    packed: torch.Tensor
    shape: tuple[int, int]
    nbytes: int                     # the dense matrix's bytes: what one product reads
    dtype: torch.dtype = torch.bfloat16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def prepack_matrix(w: torch.Tensor) -> PrepackedLinear:
    """``w`` (N, K), bfloat16, reordered once for oneDNN's linear."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu":
        raise ValueError(f"the oneDNN prepacked path takes bfloat16 weights on the CPU, got {w.dtype} on {w.device}")
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, w.shape[1], dtype=w.dtype), packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as exc:
        raise ValueError(f"this PyTorch build or CPU has no oneDNN bfloat16 linear ({type(exc).__name__}: {exc}); "
                         "use pack='none'") from None
    return PrepackedLinear(packed, tuple(w.shape), w.nbytes)


def bf16_products_are_slow(device="cpu") -> bool:
    """Whether PyTorch's bfloat16 product of more than one row is its slow portable loop on ``device``: on a CPU
    whose oneDNN has no bfloat16 kernels (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is false: on x86, no
    AVX-512 or AMX). False on GPUs, and where the question cannot be asked."""
    if torch.device(device).type != "cpu":
        return False
    try:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


#: Rows from which :class:`UpcastLinear` multiplies in float32. Measured on the 2-core AVX2 development machine
#: (2026-12-04): at 4 rows the float32 product of the 49,152 x 576 LM head took longer on two threads (29 ms
#: against PyTorch's 17 ms in bfloat16), at 8 rows as long (37 against 36 ms), and every matrix of a layer was
#: quicker from 4 rows.
UPCAST_MIN_ROWS = 8
#: Bytes of one float32 slice of a weight matrix in :func:`upcast_product` (kept in the cache between its
#: conversion and its product; 1 to 2.4 MB slices were the quickest there, whole matrices slower on the LM head).
UPCAST_SLICE_BYTES = 2 << 20


def upcast_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w^T`` for bfloat16 ``x`` (T, K) and ``w`` (N, K), multiplied and summed in float32 one slice of
    ``w``'s rows at a time, rounded to ``x``'s dtype at the end (see the module's docstring)."""
    n, k = w.shape
    rows = max(16, UPCAST_SLICE_BYTES // (4 * k))
    xf = x.float()
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    buf = torch.empty(min(rows, n), k, dtype=torch.float32, device=x.device)
    for i in range(0, n, rows):
        r = min(rows, n - i)
        part = buf[:r]
        part.copy_(w[i:i + r])
        torch.mm(xf, part.t(), out=out[:, i:i + r])
    return out.to(x.dtype)


@dataclass
class UpcastLinear:
    """One bfloat16 weight matrix whose products of :data:`UPCAST_MIN_ROWS` rows or more are computed in float32,
    slice by slice (:func:`upcast_product`); the same numbers as the dense matrix."""

    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < UPCAST_MIN_ROWS:
            return F.linear(x, self.weight)
        return upcast_product(x, self.weight)


def upcast_matrix(w: torch.Tensor) -> UpcastLinear:
    """``w`` (N, K), bfloat16, for the ``"upcast"`` path."""
    if w.dtype != torch.bfloat16:
        raise ValueError(f"the upcast path takes bfloat16 weights, got {w.dtype}")
    return UpcastLinear(w)


# The same product as an operator a compiled graph can call (inductor keeps it as one call, its weight a
# constant); the fake kernel tells the compiler its output's shape.
_LIB = torch.library.Library("course", "FRAGMENT")
_LIB.define("upcast_linear(Tensor x, Tensor w) -> Tensor")
_LIB.impl("upcast_linear", upcast_product, "CompositeExplicitAutograd")


@torch.library.register_fake("course::upcast_linear", lib=_LIB)
def _upcast_linear_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


@dataclass
class PackedLinear:
    """One weight matrix (out_features, in_features) in a low-bit kernel's layout."""

    kind: str                       # "int8" or "int4"
    codes: torch.Tensor             # int8 (N, K), or the int4 kernel's packed layout
    scales: torch.Tensor            # int8: (N,) in the activations' dtype; int4: (K / g, N, 2) scale and zero point
    group_size: int                 # int4: inputs per group; int8: K (one scale per row)
    shape: tuple[int, int]
    w_hat: torch.Tensor | None = None   # the de-quantised matrix, kept only when asked for (tests, quality)

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: codes plus scales (and zero points)."""
        return self.codes.nbytes + self.scales.nbytes

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W_hat^T`` for ``x`` of shape (T, in_features) in the scales' dtype."""
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.codes, self.group_size, self.scales)
        return torch.ops.aten._weight_int4pack_mm(x, self.codes, self.group_size, self.scales)

    def dequantized(self) -> torch.Tensor:
        if self.w_hat is None:
            raise ValueError("this matrix was packed without keep_w_hat=True")
        return self.w_hat


def pack_matrix(w: torch.Tensor, kind: str, dtype: torch.dtype, *, keep_w_hat: bool = False) -> PackedLinear:
    """``w`` (N, K) packed for the ``kind`` kernel, computing in ``dtype`` (float32 or bfloat16)."""
    from ..lowbit_kernels import int4_group_size
    if kind not in LOWBIT:
        raise ValueError(f"kind must be one of {LOWBIT}, got {kind!r}")
    if w.dim() != 2:
        raise ValueError(f"w must be a 2-D (out_features, in_features) matrix, got {tuple(w.shape)}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the low-bit kernels compute in float32 or bfloat16, got {dtype}")
    n, k = w.shape
    rows = max(64, _CHUNK_ELEMENTS // k // 64 * 64)        # a slice of rows at a time: the quantizer's temporaries
    if w.device.type != "cpu":
        rows = n                                           # (the CUDA int4 layout is tiled: packed whole)
    parts = [_pack_rows(w[i:i + rows].detach().float(), kind, dtype, keep_w_hat) for i in range(0, n, rows)]
    codes, scales = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts], dim=0 if kind == "int8" else 1)
    w_hat = torch.cat([p[2] for p in parts]) if keep_w_hat else None
    return PackedLinear(kind, codes, scales, k if kind == "int8" else int4_group_size(k), (n, k), w_hat)


#: Weights quantized at once by :func:`pack_matrix` (an LM head's fp32 temporaries would otherwise be ~100s of MB).
_CHUNK_ELEMENTS = 1 << 22


def _pack_rows(w: torch.Tensor, kind: str, dtype: torch.dtype, keep_w_hat: bool):
    """(codes, scales, w_hat or None) of a slice of rows: both quantizers work row by row, so slices concatenate."""
    from ..lowbit_kernels import int4_codes, int4_group_size, int4_pack, int8_pack
    if kind == "int8":
        codes, scales, w_hat = int8_pack(w)
        return codes.to(w.device), scales.to(dtype), w_hat.to(dtype) if keep_w_hat else None
    codes, sz, w_hat = int4_codes(w, int4_group_size(w.shape[1]))
    return int4_pack(codes, w.device), sz.to(dtype).to(w.device), w_hat.to(dtype) if keep_w_hat else None


def dequantized_like_packing(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The matrix the ``kind`` fast path computes with instead of ``w`` (float32), without packing it."""
    from ..lowbit_kernels import int4_codes, int4_group_size, int8_pack
    if kind == "int8":
        return int8_pack(w.detach().float())[2]
    if kind == "int4":
        return int4_codes(w.detach().float(), int4_group_size(w.shape[1]))[2]
    raise ValueError(f"kind must be one of {LOWBIT}, got {kind!r}")


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w^T (+ b)`` for a dense tensor, a :class:`PackedLinear`, :class:`PrepackedLinear` or
    :class:`UpcastLinear`."""
    if isinstance(w, (PackedLinear, PrepackedLinear, UpcastLinear)):
        y = w(x)
        return y if b is None else y + b
    return F.linear(x, w, b)


def add_linear(h: torch.Tensor, x: torch.Tensor, w, b: torch.Tensor | None) -> torch.Tensor:
    """``h + x @ w^T (+ b)``: a residual connection, fused into one matrix product where ``w`` is dense and
    there is no bias."""
    if isinstance(w, (PackedLinear, PrepackedLinear, UpcastLinear)) or b is not None:
        return h + linear(x, w, b)
    return torch.addmm(h, x, w.t())


@contextlib.contextmanager
def bf16_products_in_float32(model, *, force: bool | None = None):
    """Within the block, the ``nn.Linear`` layers of a transformers ``model`` held in bfloat16 compute their
    products of :data:`UPCAST_MIN_ROWS` rows or more as the ``"upcast"`` path does (:func:`upcast_product`) --
    only where :func:`bf16_products_are_slow` on the model's device (``force``: True or False to decide here).

    For *quality* measurements of a bfloat16 model (a prefill over a text, a batch of answers): on a CPU without
    bfloat16 kernels PyTorch's own product of many rows is a portable loop several times slower, and the upcast
    product is the same arithmetic (bfloat16 numbers, sums in float32, the result rounded to bfloat16) in
    another order of the sums. Not for timing a bfloat16 model: that would time another kernel. A product that
    needs gradients keeps PyTorch's. Yields whether the products were switched."""
    switch = bf16_products_are_slow(model.device) if force is None else bool(force)
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.bfloat16]
    if not switch or not layers:
        yield False
        return

    def forward(layer, x):
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] < UPCAST_MIN_ROWS or x.dtype != torch.bfloat16 or (
                torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad)):
            return F.linear(x, layer.weight, layer.bias)          # (the upcast product keeps no gradients)
        y = upcast_product(rows, layer.weight)
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    for layer in layers:
        layer.forward = forward.__get__(layer)
    try:
        yield True
    finally:
        for layer in layers:
            del layer.forward
