"""``python -m course_utils.bench [--json FILE] [--only _SECTION ...] [--model M] [--device D]``: the benchmark table."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict

import torch

from ..measure import openmp_wait_policy
from . import SECTIONS, BenchContext, format_table, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--model", default="embedded", help="MODEL string (default: embedded)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto (default: cpu)")
    parser.add_argument("--only", nargs="*", help="run only sections whose name starts with these (e.g. 01 04)")
    parser.add_argument("--reduced", action="store_true", help="tiny sizes: checks that every row is produced "
                                                               "(the figures then mean nothing)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    chosen = [s for s in SECTIONS if not args.only or any(s[0].startswith(p) for p in args.only)]
    if not chosen:
        parser.error(f"--only {args.only} matches no section; sections: {[s[0] for s in SECTIONS]}")
    ctx = BenchContext(model_name=args.model, device=args.device, reduced=args.reduced)
    rows = run(chosen, ctx)
    print("\n" + format_table(rows))
    if args.json:
        payload = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                               "torch": torch.__version__, "threads": torch.get_num_threads(),
                               "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                               "openmp_wait_policy": openmp_wait_policy(),
                               "device": args.device, "model": args.model,
                               "date": time.strftime("%Y-%m-%d %H:%M:%S")},
                   "rows": [asdict(r) for r in rows]}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0 if all(r.value == r.value for r in rows) else 1  # NaN marks a failed section


if __name__ == "__main__":
    sys.exit(main())
