"""The benchmark table: ``python -m course_utils.bench [--json FILE] [--only _SECTION ...]``.

Benchmarks are not tests: speed and memory depend on the machine and on what else runs
on it, so they are measured here, as ratios taken within one run, and printed as a table
(with the target beside each row that has one; a missed target is reported, not hidden).

One module of this package per chapter (``course_utils.bench.kv_cache`` for chapter 01, ...)
defines ``rows(ctx) -> Iterable[Row]`` and is listed in :data:`SECTIONS`; chapter modules
never import the benchmark. ``ctx`` is a :class:`BenchContext` holding the loaded model,
the device and this machine's measured bandwidth, so they are measured once. The command
line is in ``__main__.py``.
"""
from __future__ import annotations

import importlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

#: (section name, module defining ``rows(ctx)``) in chapter order.
SECTIONS: list[tuple[str, str]] = [
    ("01 KV cache", "course_utils.bench.kv_cache"),
    ("02 prefill vs decode", "course_utils.bench.prefill_decode"),
    ("03 KV-cache memory", "course_utils.bench.memory_sizing"),
    ("04 batching", "course_utils.bench.batching"),
    ("04 engine speed", "course_utils.bench.engine_speed"),
    ("05 weight quantization", "course_utils.bench.quantize"),
    ("06 activation outliers", "course_utils.bench.outliers"),
    ("07 evaluating quantization", "course_utils.bench.evaluate"),
    ("08 speculative decoding", "course_utils.bench.speculative"),
    ("09 distillation", "course_utils.bench.distill"),
    ("11 serving", "course_utils.bench.serving"),
]


@dataclass
class Row:
    """One benchmark figure. ``target`` is a human-readable goal such as ``">= 1.5x"``;
    ``met`` says whether this run reached it (None where there is no target)."""

    section: str
    name: str
    value: float
    unit: str
    target: str | None = None
    met: bool | None = None
    note: str = ""


@dataclass
class BenchContext:
    """What the sections share: the model (loaded once per dtype), the device, the bandwidth.

    ``reduced``: tiny sizes everywhere (:meth:`sizes`), to check that every section runs and
    produces its rows (the tests do this on a tiny model); the figures then mean nothing.
    """

    model_name: str = "embedded"
    device: str = "cpu"
    reduced: bool = False
    _cache: dict = field(default_factory=dict)

    def sizes(self, full, reduced):
        """``full`` for a real run, ``reduced`` under ``reduced=True``."""
        return reduced if self.reduced else full

    def get(self, key: str, make: Callable[[], Any]) -> Any:
        """Compute ``make()`` once per run and share it between sections."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def model(self, dtype: str = "float32"):
        from ..models import load_model
        return self.get(f"model:{dtype}", lambda: load_model(self.model_name, dtype=dtype, device=self.device,
                                                             verbose=False))

    def bandwidth_Bps(self) -> float:
        from ..measure import measure_bandwidth
        return self.get("bandwidth", lambda: measure_bandwidth(device=self.device))


def _load(module: str) -> Callable[[BenchContext], Iterable[Row]]:
    return importlib.import_module(module).rows


def format_table(rows: list[Row]) -> str:
    """A plain-text table, one line per row, grouped by section."""
    head = f"{'section':<22} {'figure':<58} {'value':>14} {'unit':<10} {'target':<12} {'met':<5} note"
    lines = [head, "-" * len(head)]
    for r in rows:
        met = "" if r.met is None else ("yes" if r.met else "NO")
        lines.append(f"{r.section:<22} {r.name:<58} {r.value:>14,.4g} {r.unit:<10} {r.target or '':<12} "
                     f"{met:<5} {r.note}")
    return "\n".join(lines)


def run(sections: list[tuple[str, str]], ctx: BenchContext, *, stream=sys.stdout) -> list[Row]:
    rows: list[Row] = []
    for name, spec in sections:
        t0 = time.perf_counter()
        print(f"[bench] {name} ...", file=stream, flush=True)
        try:
            new = list(_load(spec)(ctx))
        except Exception as exc:  # report the failure as a row and carry on with the others
            new = [Row(name, f"FAILED: {type(exc).__name__}: {exc}"[:120], float("nan"), "")]
        rows += new
        print(format_table(new).split("\n", 2)[-1], file=stream)
        print(f"[bench] {name} took {time.perf_counter() - t0:.0f} s", file=stream, flush=True)
    return rows
