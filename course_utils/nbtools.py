"""Keep the notebooks stored clean: ``python -m course_utils.nbtools clean NB [NB ...] [--expected-from DIR]``.

Notebooks are stored without outputs and execution counts, with one exception: a code cell
whose first line is ``# NBVAL_CHECK_OUTPUT`` prints something deterministic (a formula's
value, a byte count) and keeps that text as its stored output, which nbval compares with a
fresh run. ``--expected-from DIR`` copies those outputs from executed copies of the same
notebooks in ``DIR`` (for example the main job's ``build/notebooks``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

CHECK_MARK = "# NBVAL_CHECK_OUTPUT"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def is_checked(cell) -> bool:
    """True for a code cell whose output nbval compares."""
    return cell.cell_type == "code" and cell.source.lstrip().startswith(CHECK_MARK)


def _text_only(outputs: list) -> list:
    """Keep stream text and the text/plain part of results: what nbval compares."""
    kept = []
    for out in outputs:
        if out.output_type == "stream":
            kept.append(nbformat.v4.new_output("stream", name=out.name, text=out.text))
        elif out.output_type in ("execute_result", "display_data") and "text/plain" in out.get("data", {}):
            new = nbformat.v4.new_output(out.output_type, data={"text/plain": out.data["text/plain"]})
            if out.output_type == "execute_result":
                new.execution_count = None
            kept.append(new)
    return kept


def clean(nb, expected=None):
    """Strip outputs and counts; checked cells take their text outputs from ``expected`` (if given)."""
    expected_by_id = {c.get("id"): c for c in expected.cells} if expected is not None else {}
    for i, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)
        cell.metadata.pop("papermill", None)
        if cell.cell_type != "code":
            continue
        cell.execution_count = None
        if is_checked(cell):
            source = expected_by_id.get(cell.get("id"))
            if source is None and expected is not None and i < len(expected.cells):
                source = expected.cells[i]
            cell.outputs = _text_only(source.outputs) if source is not None else cell.outputs
            if cell.outputs:
                cell.execution_count = 1  # nbval compares only cells that were run (an execution count)
        else:
            cell.outputs = []
    nb.metadata.pop("papermill", None)
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata.setdefault("language_info", {"name": "python"})
    return nb


def problems(nb) -> list[str]:
    """What keeps a stored notebook from being clean (empty list when it is)."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.execution_count is not None and not is_checked(cell):
            found.append(f"cell {i}: has an execution count")
        if cell.outputs and not is_checked(cell):
            found.append(f"cell {i}: has outputs but is not marked {CHECK_MARK}")
        if is_checked(cell) and cell.outputs != _text_only(cell.outputs):
            found.append(f"cell {i}: a checked cell may store text outputs only")
    if not any("parameters" in c.metadata.get("tags", []) for c in nb.cells):
        found.append("no cell tagged 'parameters'")
    if nb.metadata.get("kernelspec", {}).get("name") != KERNELSPEC["name"]:
        found.append("kernelspec metadata missing")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["clean", "check"])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--expected-from", type=Path, help="folder of executed copies to take checked outputs from")
    args = parser.parse_args(argv)
    status = 0
    for path in args.notebooks:
        nb = nbformat.read(path, as_version=4)
        if args.command == "check":
            for p in problems(nb):
                print(f"{path}: {p}")
                status = 1
            continue
        expected = None
        if args.expected_from:
            executed = args.expected_from / path.name
            if not executed.exists():
                print(f"{path}: no executed copy at {executed}", file=sys.stderr)
                return 2
            expected = nbformat.read(executed, as_version=4)
        nbformat.write(clean(nb, expected), path)
        print(f"cleaned {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
