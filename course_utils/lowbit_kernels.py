"""Chapter 05 -- does fewer bits mean faster? The weight-only low-bit matmuls PyTorch has.

A decode step multiplies one activation vector by every weight matrix, ``y = x W^T`` with
``x`` of shape (1, in_features): it reads every weight once and does one multiply-add
with it, so the bytes read should set the time. Fewer bits per weight are faster only if
a kernel reads the packed weights and unpacks them on the fly, in registers, as fast as
the memory delivers them. This module builds every form of the same matrices and times
them in one interleaved run:

* ``fp32`` and ``bf16``: ``torch.nn.functional.linear`` on full-precision copies;
* ``int8 weight-only``: ``torch.ops.aten._weight_int8pack_mm`` (int8 codes, one scale per row);
* ``int4 weight-only``: ``_weight_int4pack_mm_for_cpu`` on the CPU (``_weight_int4pack_mm``
  on CUDA) with weights packed by ``_convert_weight_to_int4pack[_for_cpu]`` (4-bit codes,
  a scale and a zero point per group);
* ``naive``: de-quantise the int8 codes to fp32 at every call, then multiply.

The int kernels take activations and scales of one dtype; each runs with float32 and
with bfloat16 activations. A kernel the device lacks is reported, not fatal. Every
kernel's output is checked against ``x @ W_hat^T`` with ``W_hat`` the de-quantised weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from .measure import time_interleaved
from .progress import progress_bar
from .quantize import Scheme, qmax, quantize, relative_error

INT4_GROUP_SIZES = (128, 64, 32)        # what the int4 kernels accept, largest (cheapest) first


def int8_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT8 per-row codes for ``_weight_int8pack_mm``: (codes int8 (N, K), scales fp32 (N,), W_hat (N, K))."""
    if w.dim() != 2:
        raise ValueError(f"w must be a 2-D (out_features, in_features) matrix, got {tuple(w.shape)}")
    qt = quantize(w, Scheme("absmax", 8, "row"))
    codes = (qt.codes.to(torch.int16) - qmax(8)).to(torch.int8)
    scales = qt.scale.float().squeeze(1) / qmax(8)
    return codes, scales, codes.float() * scales[:, None]


def int4_group_size(in_features: int) -> int:
    """The largest group size the int4 kernels accept that divides ``in_features``."""
    for g in INT4_GROUP_SIZES:
        if in_features % g == 0:
            return g
    raise ValueError(f"in_features={in_features} is not a multiple of 32, which the int4 kernels need")


def int4_codes(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit group codes in the int4 kernels' convention.

    Returns ``(codes int32 (N, K) in 0..15, scales_and_zeros (K/g, N, 2) float32, W_hat (N, K))``
    with ``W_hat = (code - 8) * scale + zero``, ``zero = min + 8 * scale`` -- the same numbers as
    chapter 05's ``minmax`` 4-bit scheme, ``code * step + min``.
    """
    n, k = w.shape
    qt = quantize(w, Scheme("minmax", 4, "group", group_size))
    codes = qt.codes.reshape(n, k).to(torch.int32)
    scale = qt.scale.float().reshape(n, k // group_size)
    zero = qt.offset.float().reshape(n, k // group_size) + 8 * scale
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    w_hat = ((codes.reshape(n, -1, group_size) - 8) * scale[..., None] + zero[..., None]).reshape(n, k)
    return codes, sz, w_hat


def int4_pack(codes: torch.Tensor, device) -> torch.Tensor:
    """Pack (N, K) int32 codes 0..15 into the layout of this device's int4 kernel."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    pairs = codes.to(dev)
    packed = (pairs[:, ::2] << 4 | pairs[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(packed, 8)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    """``x @ W_hat^T`` with the device's int4 weight-only kernel (x and sz of one dtype)."""
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, sz)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, sz)


@dataclass
class MatmulForms:
    """The same weight matrices in every form the timing compares (built by :func:`build_forms`)."""

    device: torch.device
    fp32: list[torch.Tensor]
    w_hat8: list[torch.Tensor] = field(default_factory=list, repr=False)
    bf16: list[torch.Tensor] = field(default_factory=list, repr=False)
    int8: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)
    int4: list[tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=list, repr=False)
    int4_error: float = 0.0
    unavailable: dict[str, str] = field(default_factory=dict)

    def bytes_per_form(self) -> dict[str, int]:
        """Bytes each form reads per pass over all matrices (codes, scales and zero points included)."""
        out = {"fp32": sum(w.nbytes for w in self.fp32), "bf16": sum(w.nbytes for w in self.bf16)}
        out["int8"] = sum(c.nbytes + s.nbytes for c, s in self.int8)
        out["int4"] = sum(p.nbytes + sz.nbytes for p, _, sz in self.int4)
        return out


def _try(name: str, unavailable: dict, fn: Callable):
    try:
        return fn()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
        unavailable[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return None


@torch.no_grad()
def build_forms(weights: list[torch.Tensor], device="cpu", *, progress: bool = False) -> MatmulForms:
    """Make bf16, int8 and int4 forms of ``weights`` (2-D, each (out, in)) on ``device``.

    The fp32 list holds the given tensors (no copy). The int8 de-quantised weights are kept
    only for the first matrix (to check the kernels); ``int4_error`` is the largest relative
    difference between the int4 codes' own reconstruction and chapter 05's ``minmax`` scheme.
    """
    if not weights or any(not isinstance(w, torch.Tensor) or w.dim() != 2 for w in weights):
        raise ValueError("weights must be a non-empty list of 2-D (out_features, in_features) tensors")
    dev = torch.device(device)
    forms = MatmulForms(dev, [w.detach().to(dev, torch.float32) for w in weights])
    for i, w in enumerate(progress_bar(forms.fp32, "packing", enabled=progress)):
        forms.bf16.append(w.bfloat16())
        codes8, scales8, w_hat8 = int8_pack(w)
        forms.int8.append((codes8, scales8))
        if i == 0:
            forms.w_hat8.append(w_hat8)
        if "int4" not in forms.unavailable:
            g = int4_group_size(w.shape[1])
            codes4, sz, _ = int4_codes(w.cpu(), g)
            packed = _try("int4", forms.unavailable, lambda: int4_pack(codes4, dev))
            if packed is not None:
                forms.int4.append((packed, g, sz.to(dev)))
    return forms


def _inputs(forms: MatmulForms, dtype) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ks = {w.shape[1] for w in forms.fp32}
    return {k: torch.randn(1, k, generator=gen).to(forms.device, dtype) for k in sorted(ks)}


def matmul_passes(forms: MatmulForms) -> dict[str, Callable[[], list]]:
    """One zero-argument function per precision; each multiplies one vector by every matrix."""
    x32, x16 = _inputs(forms, torch.float32), _inputs(forms, torch.bfloat16)
    k_of = [w.shape[1] for w in forms.fp32]
    passes = {
        "fp32": lambda: [F.linear(x32[k], w) for k, w in zip(k_of, forms.fp32)],
        "bf16": lambda: [F.linear(x16[k], w) for k, w in zip(k_of, forms.bf16)],
    }
    for act, xs in (("fp32", x32), ("bf16", x16)):
        dt = xs[k_of[0]].dtype
        i8 = [(c, s.to(dt)) for c, s in forms.int8]
        passes[f"int8 weight-only, {act} activations"] = (
            lambda xs=xs, i8=i8: [torch.ops.aten._weight_int8pack_mm(xs[k], c, s) for k, (c, s) in zip(k_of, i8)])
        if forms.int4:
            i4 = [(p, g, sz.to(dt)) for p, g, sz in forms.int4]
            passes[f"int4 weight-only, {act} activations"] = (
                lambda xs=xs, i4=i4: [int4_mm(xs[k], p, g, sz) for k, (p, g, sz) in zip(k_of, i4)])
    passes["naive: de-quantise int8, then fp32"] = lambda: [
        F.linear(x32[k], c.float() * s[:, None]) for k, (c, s) in zip(k_of, forms.int8)]
    return passes


@torch.no_grad()
def check_passes(forms: MatmulForms, passes: dict[str, Callable]) -> dict[str, float]:
    """Relative error of each pass's first output against its exact reference, in float32.

    fp32/bf16: ``x W^T``; int8 and naive: ``x W_hat8^T``; int4: ``x W_hat4^T``. A pass that
    fails to run is moved to ``forms.unavailable`` and left out.
    """
    x32 = _inputs(forms, torch.float32)
    k0 = forms.fp32[0].shape[1]
    ref = {"w": F.linear(x32[k0], forms.fp32[0]), "int8": F.linear(x32[k0], forms.w_hat8[0])}
    if forms.int4:
        p, g, sz = forms.int4[0]
        codes, sz_check, w_hat4 = int4_codes(forms.fp32[0].cpu(), g)
        ref["int4"] = F.linear(x32[k0], w_hat4.to(forms.device))
    errors = {}
    for name in list(passes):
        out = _try(name, forms.unavailable, lambda: passes[name]()[0])
        if out is None:
            passes.pop(name)
            continue
        key = "int4" if name.startswith("int4") else "int8" if name.startswith(("int8", "naive")) else "w"
        errors[name] = relative_error(ref[key], out)
    return errors


def tolerance(name: str) -> float:
    """The relative error a pass may show: float32 rounding, or bfloat16's 8-bit mantissa."""
    return 2e-2 if "bf16" in name else 1e-4


@dataclass
class MatmulTimings:
    """Medians of one interleaved run, with bytes per form and each kernel's check."""

    median_s: dict[str, float]
    spread_s: dict[str, float]
    errors: dict[str, float]
    bytes_per_form: dict[str, int]
    unavailable: dict[str, str]
    n_matrices: int

    def relative_to_fp32(self) -> dict[str, float]:
        return {k: v / self.median_s["fp32"] for k, v in self.median_s.items()}


def time_matmuls(weights: list[torch.Tensor], device="cpu", *, repeats: int = 5,
                 progress: bool = False) -> MatmulTimings:
    """Build every form of ``weights``, check each kernel, and time all of them interleaved."""
    forms = build_forms(weights, device, progress=progress)
    passes = matmul_passes(forms)
    errors = check_passes(forms, passes)
    bad = {k: e for k, e in errors.items() if not e <= tolerance(k)}
    if bad:
        raise RuntimeError(f"kernel results differ from their de-quantised reference: {bad}")
    timings = time_interleaved(passes, warmup=1, repeats=repeats, device=device)
    return MatmulTimings({k: t.median_s for k, t in timings.items()}, {k: t.spread_s for k, t in timings.items()},
                         errors, forms.bytes_per_form(), dict(forms.unavailable), len(weights))
