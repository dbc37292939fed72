"""Timing, peak memory and memory bandwidth, correct on CPU, CUDA and MPS (chapter 01 onwards).

* :func:`time_call` -- warm-up runs, device synchronisation (CUDA events on a GPU,
  ``time.perf_counter`` elsewhere), several repeats; reports median and spread.
* :func:`peak_memory` -- the device allocator's peak on a GPU; on the CPU the peak
  increase of the process's resident set (RSS) over its value just before the call,
  sampled by a background thread while the call runs (portable: ``psutil``).
* :func:`measure_bandwidth` -- bytes per second of a large read on this machine (the memory
  roof; :func:`bandwidth_samples_Bps` keeps every run, for the spread);
* :func:`measure_matmul_flops` -- FLOP/s of a large matrix product; :func:`measure_compute_roof` /
  :func:`compute_roof_flops` -- the compute roof as chapters 02 and 04 both take it (the best of three
  such measurements);
* :func:`openmp_wait_policy` -- how idle worker threads wait, named beside every speed figure.
"""
from __future__ import annotations

import ctypes
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import psutil
import torch

from .models import resolve_device
from .peak_rss import PeakSampler
from .validation import check_non_negative_int, check_positive_int


@dataclass
class Timing:
    """Seconds per call over ``repeats`` timed runs (after ``warmup`` untimed ones)."""

    samples_s: list[float]
    warmup: int = 0
    device: str = "cpu"
    result: Any = field(default=None, repr=False)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def min_s(self) -> float:
        return min(self.samples_s)

    @property
    def max_s(self) -> float:
        return max(self.samples_s)

    @property
    def spread_s(self) -> float:
        """Half the distance between the fastest and the slowest run (seconds)."""
        return (self.max_s - self.min_s) / 2

    def __str__(self) -> str:
        return (f"{self.median_s * 1e3:,.2f} ms median (min {self.min_s * 1e3:,.2f}, max {self.max_s * 1e3:,.2f}; "
                f"{len(self.samples_s)} runs on {self.device})")


def openmp_wait_policy() -> str:
    """How PyTorch's idle CPU worker threads wait between parallel regions, as this process started them: the
    ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` set in its environment, or the OpenMP runtime's default (spin a while,
    then sleep). It moves speed figures a lot (``course_utils``'s docstring): name it beside them."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    spin = os.environ.get("GOMP_SPINCOUNT")
    parts = ([f"OMP_WAIT_POLICY={policy}"] if policy else []) + ([f"GOMP_SPINCOUNT={spin}"] if spin else [])
    return ", ".join(parts) if parts else "OpenMP's default wait policy"


def cpu_features() -> dict:
    """The CPU's model name and the matrix / vector extensions that decide bfloat16 speed (chapter 10):
    ``{"model": str, "amx": bool | None, "avx512_bf16": bool | None}``. Read from ``/proc/cpuinfo`` where the
    system has one (Linux); elsewhere the flags are None (unknown) and the model is ``platform.processor()``."""
    import platform
    info = {"model": platform.processor() or platform.machine(), "amx": None, "avx512_bf16": None}
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            info["model"] = value.strip()
        if key.strip() == "flags":
            flags = set(value.split())
            info["amx"] = "amx_bf16" in flags and "amx_tile" in flags
            info["avx512_bf16"] = "avx512_bf16" in flags
            break
    return info


def synchronize(device) -> None:
    """Wait until queued work on ``device`` has finished (no-op on the CPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def _check_counts(warmup: int, repeats: int) -> None:
    check_non_negative_int("warmup", warmup)
    check_positive_int("repeats", repeats)


def time_call(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5, device="cpu") -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones.

    On CUDA each run is bracketed by CUDA events; on CPU/MPS by ``perf_counter`` after a
    device synchronisation. ``Timing.result`` holds the last call's return value.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    _check_counts(warmup, repeats)
    dev = resolve_device(device)
    result = None
    for _ in range(warmup):
        result = fn()
    synchronize(dev)
    samples = []
    for _ in range(repeats):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            result = fn()
            synchronize(dev)
            samples.append(time.perf_counter() - t0)
    return Timing(samples, warmup=warmup, device=str(dev), result=result)


def time_interleaved(fns: dict[str, Callable[[], Any]], *, warmup: int = 1, repeats: int = 5,
                     device="cpu") -> dict[str, Timing]:
    """Time several callables in turn (A, B, A, B, ...) so machine noise hits them alike."""
    if not fns:
        raise ValueError("fns must name at least one callable")
    _check_counts(warmup, repeats)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name] += time_call(fn, warmup=0, repeats=1, device=device).samples_s
    return {k: Timing(v, warmup=warmup, device=str(resolve_device(device))) for k, v in samples.items()}


def release_memory() -> None:
    """Return freed memory to the operating system, so RSS reflects what is really in use.

    Runs the garbage collector and, where the C library is glibc (Linux), ``malloc_trim``:
    glibc keeps freed buffers of up to tens of MB for reuse, which would otherwise make a
    process's RSS ratchet up after every large temporary. A no-op elsewhere.
    """
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Hand the C heap's free pages back to the operating system (glibc's ``malloc_trim``; a no-op elsewhere),
    without a garbage collection: cheap enough to call between two timed steps."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


#: glibc's ``mallopt`` parameter numbers (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def steady_allocator(mmap_threshold_bytes: int = 4 << 20, trim_threshold_bytes: int = 16 << 20) -> bool:
    """Make glibc hand every freed buffer of ``mmap_threshold_bytes`` or more straight back to the OS
    (chapter 07, which frees thousands of vocabulary-wide temporaries).

    By default glibc raises its mmap threshold (up to 32 MB) each time a large buffer is freed, so
    later temporaries of a few MB come from the heap, which fragments: in one run the RSS peak can sit
    hundreds of MB above the memory really in use, and differ that much between identical runs.
    Fixing the threshold (``M_MMAP_THRESHOLD``, which also stops the adjustment) and the heap's trim
    threshold keeps it close. Returns True where it applied (Linux with glibc); elsewhere does nothing.
    """
    check_positive_int("mmap_threshold_bytes", mmap_threshold_bytes)
    check_positive_int("trim_threshold_bytes", trim_threshold_bytes)
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes)) and \
            bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes))
    except (OSError, AttributeError):
        return False


def rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    return psutil.Process().memory_info().rss


def file_backed_bytes() -> int | None:
    """The part of this process's RSS backed by files -- memory-mapped weights, the libraries' code -- where the
    system reports it (Linux: psutil's ``shared``); None elsewhere. Chapter 10 splits what a process keeps with it."""
    return getattr(psutil.Process().memory_info(), "shared", None)


def touch_parameters(model) -> None:
    """Read every parameter once, so that weights memory-mapped from a file are resident (and counted in RSS) before
    anything is measured: a forward pass alone reads only the embedding rows of its tokens (chapter 10)."""
    with torch.no_grad():
        for p in {id(p): p for p in model.parameters()}.values():
            p.detach().sum()


@dataclass
class PeakMemory:
    """Peak extra memory of one call: bytes above the level just before it."""

    peak_bytes: int
    baseline_bytes: int
    device: str
    how: str
    result: Any = field(default=None, repr=False)

    def __str__(self) -> str:
        return f"{self.peak_bytes / 2**20:,.1f} MiB peak above baseline ({self.how} on {self.device})"


def peak_memory(fn: Callable[[], Any], *, device="cpu", interval_s: float = 0.001) -> PeakMemory:
    """Peak memory that ``fn()`` adds on ``device``.

    GPU: ``torch.cuda.max_memory_allocated`` after a reset, minus the allocation before.
    CPU (and MPS, whose memory is the process's): RSS sampled every ``interval_s`` seconds
    in a background thread, peak minus the RSS just before the call. Short calls that
    allocate and free between two samples can be under-counted; the final reading after
    the call is always included.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    dev = resolve_device(device)
    if dev.type == "cuda":
        synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        result = fn()
        synchronize(dev)
        return PeakMemory(torch.cuda.max_memory_allocated(dev) - before, before, str(dev),
                          "CUDA allocator peak", result)
    if dev.type == "mps":
        read = lambda: torch.mps.driver_allocated_memory() + rss_bytes()  # noqa: E731
        how = "MPS driver memory + RSS, sampled"
    else:
        read, how = rss_bytes, "process RSS, sampled"
    synchronize(dev)
    release_memory()
    sampler = PeakSampler(read, interval_s)
    before = sampler.peak
    sampler.start()
    try:
        result = fn()
        synchronize(dev)
    finally:
        peak = sampler.stop()
        release_memory()
    return PeakMemory(max(0, peak - before), before, str(dev), how, result)


def bandwidth_samples_Bps(*, nbytes: int = 256 * 2**20, device="cpu", repeats: int = 7) -> list[float]:
    """Read bandwidth in bytes/second of each of ``repeats`` timed sums of a ``nbytes`` float32 tensor.

    256 MiB is far larger than any CPU cache, so the sum streams from main memory. A
    reduction does one add per 4-byte element, so it is bound by memory, not arithmetic.
    The runs differ because other processes share the memory bus and the cores (on a laptop
    or a shared host, a lot): report their spread beside the median.
    """
    if nbytes < 2**20:
        raise ValueError(f"nbytes must be at least 1 MiB to measure memory, not cache; got {nbytes}")
    dev = resolve_device(device)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    t = time_call(lambda: x.sum(), warmup=2, repeats=repeats, device=dev)
    del x
    return [(nbytes // 4) * 4 / s for s in t.samples_s]


def measure_bandwidth(*, nbytes: int = 256 * 2**20, device="cpu", repeats: int = 7) -> float:
    """Read bandwidth in bytes/second: the median of :func:`bandwidth_samples_Bps`."""
    return statistics.median(bandwidth_samples_Bps(nbytes=nbytes, device=device, repeats=repeats))


def measure_matmul_flops(*, n: int = 1024, dtype=torch.float32, device="cpu", repeats: int = 5) -> float:
    """The compute roof: floating-point operations per second of an ``n x n`` by ``n x n`` matrix product.

    2 n³ FLOPs on 3 n² numbers: far more arithmetic than bytes, so it is bound by the cores, not
    by memory. The median of ``repeats`` runs after a warm-up.
    """
    check_positive_int("n", n)
    dev = resolve_device(device)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dev, dtype)
    b = torch.randn(n, n, generator=gen).to(dev, dtype)
    t = time_call(lambda: a @ b, warmup=1, repeats=repeats, device=dev)
    return 2 * n ** 3 / t.median_s


@dataclass(frozen=True)
class ComputeRoof:
    """The compute roof: the FLOP/s of each of ``rounds`` measurements (each the median of its timed runs of an
    ``n x n`` product) and the roof itself, the best of them (a roof is what the machine can do)."""

    samples_flops: tuple[float, ...]
    n: int
    repeats: int

    @property
    def flops(self) -> float:
        return max(self.samples_flops)


def measure_compute_roof(*, n: int = 1024, dtype=torch.float32, device="cpu", rounds: int = 3,
                         repeats: int = 5) -> ComputeRoof:
    """The compute roof as every chapter measures it: ``rounds`` calls of :func:`measure_matmul_flops` (each the
    median of ``repeats`` runs after a warm-up), the best of them the roof, every round kept for the spread."""
    check_positive_int("rounds", rounds)
    check_positive_int("repeats", repeats)
    return ComputeRoof(tuple(measure_matmul_flops(n=n, dtype=dtype, device=device, repeats=repeats)
                             for _ in range(rounds)), n, repeats)


def compute_roof_flops(*, n: int = 1024, dtype=torch.float32, device="cpu", rounds: int = 3,
                       repeats: int = 5) -> float:
    """The compute roof in FLOP/s: :func:`measure_compute_roof`'s best round."""
    return measure_compute_roof(n=n, dtype=dtype, device=device, rounds=rounds, repeats=repeats).flops
