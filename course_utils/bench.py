"""The benchmark table: ``python -m course_utils.bench [--json FILE] [--only SECTION ...]``.

Benchmarks are not tests: speed and memory depend on the machine and on what else runs
on it, so they are measured here, as ratios taken within one run, and printed as a table
(with the target beside each row that has one; a missed target is reported, not hidden).

Each chapter module that has benchmark rows defines ``bench(ctx) -> Iterable[Row]`` and is
listed in :data:`SECTIONS`. ``ctx`` is a :class:`BenchContext` holding the loaded model,
the device and this machine's measured bandwidth, so they are measured once.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import torch

#: (section name, "module:function") in chapter order. Chapters append their own.
SECTIONS: list[tuple[str, str]] = [
    ("01 KV cache", "course_utils.kv_cache:bench"),
    ("02 prefill vs decode", "course_utils.prefill_decode:bench"),
    ("03 KV-cache memory", "course_utils.memory_sizing:bench"),
    ("04 batching", "course_utils.batching:bench"),
    ("05 weight quantization", "course_utils.quantize:bench"),
    ("06 activation outliers", "course_utils.outliers:bench"),
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
    model_name: str = "embedded"
    device: str = "cpu"
    _cache: dict = field(default_factory=dict)

    def get(self, key: str, make: Callable[[], Any]) -> Any:
        """Compute ``make()`` once per run and share it between sections."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def model(self, dtype: str = "float32"):
        from .models import load_model
        return self.get(f"model:{dtype}", lambda: load_model(self.model_name, dtype=dtype, device=self.device,
                                                             verbose=False))

    def bandwidth_Bps(self) -> float:
        from .measure import measure_bandwidth
        return self.get("bandwidth", lambda: measure_bandwidth(device=self.device))


def _load(spec: str) -> Callable[[BenchContext], Iterable[Row]]:
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--model", default="embedded", help="MODEL string (default: embedded)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto (default: cpu)")
    parser.add_argument("--only", nargs="*", help="run only sections whose name starts with these (e.g. 01 04)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    chosen = [s for s in SECTIONS if not args.only or any(s[0].startswith(p) for p in args.only)]
    if not chosen:
        parser.error(f"--only {args.only} matches no section; sections: {[s[0] for s in SECTIONS]}")
    ctx = BenchContext(model_name=args.model, device=args.device)
    rows = run(chosen, ctx)
    print("\n" + format_table(rows))
    if args.json:
        payload = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                               "torch": torch.__version__, "threads": torch.get_num_threads(),
                               "device": args.device, "model": args.model,
                               "date": time.strftime("%Y-%m-%d %H:%M:%S")},
                   "rows": [asdict(r) for r in rows]}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0 if all(r.value == r.value for r in rows) else 1  # NaN marks a failed section


if __name__ == "__main__":
    sys.exit(main())
