"""The main job: execute every chapter with papermill and write a summary.

    python -m course_utils.run_all [--only 01 03] [-p MODEL Qwen/Qwen2.5-0.5B-Instruct] [--out build]

Executed notebooks go to ``OUT/notebooks/``; the summary table (notebook, status, seconds,
kernel peak RSS) is printed and written to ``OUT/summary.md`` and ``OUT/summary.json``.
The kernel's peak RSS is sampled from outside (the kernel process and its children)
while each notebook runs. Exits non-zero if any notebook fails.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from .peak_rss import PeakSampler, TreeRss

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
RSS_LIMIT_BYTES = int(1.8e9)


@dataclass
class Result:
    notebook: str
    status: str
    seconds: float
    peak_rss_bytes: int
    error: str = ""
    note: str = ""


def chapter_notebooks(only: list[str] | None = None) -> list[Path]:
    """The chapters in order; ``only`` keeps those whose name starts with one of the prefixes."""
    found = sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if only:
        found = [p for p in found if any(p.name.startswith(prefix) for prefix in only)]
    return found


def _parse_value(text: str):
    """``-p NAME VALUE``: numbers and booleans become Python values, the rest stays a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def execute(path: Path, out_dir: Path, parameters: dict, *, timeout_s: int) -> Result:
    import papermill as pm

    # the RSS of this process's children (the Jupyter kernel and its own), except the servers a chapter starts
    # (chapter 11), which it reports itself
    sampler = PeakSampler(TreeRss(), interval_s=0.05)
    sampler.start()
    t0 = time.perf_counter()
    status, error = "ok", ""
    try:
        pm.execute_notebook(str(path), str(out_dir / path.name), parameters=parameters, cwd=str(path.parent),
                            progress_bar=True, execution_timeout=timeout_s, kernel_name="python3",
                            request_save_on_cell_execute=False)
    except Exception as exc:
        status, error = "FAILED", f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    if status == "ok" and peak > RSS_LIMIT_BYTES:
        status = "over memory"
    return Result(path.stem, status, seconds, peak, error, summary_notes(out_dir / path.name))


def summary_notes(executed: Path) -> str:
    """The notes a chapter left for the summary (:func:`course_utils.notebook.summary_note`), one per line."""
    import nbformat

    from .notebook import SUMMARY_NOTE_KEY
    try:
        nb = nbformat.read(executed, as_version=4)
    except (OSError, ValueError):
        return ""
    return " ".join(o.get("metadata", {}).get(SUMMARY_NOTE_KEY, "") for c in nb.cells if c.cell_type == "code"
                    for o in c.get("outputs", []) if SUMMARY_NOTE_KEY in o.get("metadata", {}))


def summary_markdown(results: list[Result], machine: str) -> str:
    lines = [f"Executed on {machine}, {time.strftime('%Y-%m-%d')}.", "",
             "| notebook | status | seconds | kernel peak RSS (MB) |", "|---|---|---:|---:|"]
    for r in results:
        lines.append(f"| {r.notebook} | {r.status} | {r.seconds:,.0f} | {r.peak_rss_bytes / 1e6:,.0f} |")
    failed = [r for r in results if r.error]
    for r in failed:
        lines.append(f"\n{r.notebook}: {r.error}")
    for r in results:
        if r.note:
            lines.append(f"\n{r.notebook}: {r.note}")
    return "\n".join(lines)


def machine_description() -> str:
    return f"{platform.system()} {platform.machine()}, {psutil.cpu_count()} CPU threads, " \
           f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="chapter prefixes to run, e.g. 01 04 (default: all)")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="override a notebook parameter, e.g. -p MODEL Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "build", help="output folder (default: build/)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per cell")
    parser.add_argument("--no-site", action="store_true", help="skip building the HTML site")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    notebooks = chapter_notebooks(args.only)
    if not notebooks:
        parser.error(f"no notebook matches {args.only} in {NOTEBOOKS}")
    parameters = {name: _parse_value(value) for name, value in args.parameter}
    out_nb = args.out / "notebooks"
    out_nb.mkdir(parents=True, exist_ok=True)
    from tqdm.auto import tqdm

    results = []
    bar = tqdm(notebooks, desc="chapters", unit="notebook", position=0)
    for path in bar:
        bar.set_postfix_str(path.stem)
        result = execute(path, out_nb, parameters, timeout_s=args.timeout)
        results.append(result)
        tqdm.write(f"{result.notebook}: {result.status} in {result.seconds:,.0f} s, "
                   f"kernel peak RSS {result.peak_rss_bytes / 1e6:,.0f} MB {result.error}")
    machine = machine_description()
    table = summary_markdown(results, machine)
    print("\n" + table)
    (args.out / "summary.md").write_text(table + "\n")
    (args.out / "summary.json").write_text(json.dumps(
        {"machine": machine, "date": time.strftime("%Y-%m-%d %H:%M"), "parameters": parameters,
         "results": [asdict(r) for r in results]}, indent=2))
    print(f"\nexecuted notebooks: {out_nb}\nsummary: {args.out / 'summary.md'}")
    if not args.no_site:
        from .site import build_site
        index = build_site(out_nb, args.out / "site", results=[asdict(r) for r in results], machine=machine,
                           date=time.strftime("%Y-%m-%d"))
        print(f"HTML site: {index}")
    return 0 if all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
