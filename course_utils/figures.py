"""Figures one chapter measured and a later chapter reads back (chapter 10).

A chapter *publishes* a small dict of plain numbers (:func:`publish`): it is shown in the notebook as one
line and kept in that cell's output metadata, so the executed notebook the main job writes to
``build/notebooks/`` carries it. Chapter 10 *reads* it back from there (:func:`read_published`) and says
where each figure came from: that notebook, when it was executed, on which machine. Where the main job has
not run (a fresh clone, the tests), there is nothing to read, and chapter 10 recomputes a cheaper version
itself (:class:`Sourced` records which it was).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

#: Where :func:`publish` keeps its figures in a cell's output metadata.
FIGURES_KEY = "course_utils/figures"
#: The main job's output folder, beside ``course_utils`` in a checkout (``python tasks.py run`` writes it).
DEFAULT_BUILD = Path(__file__).resolve().parent.parent / "build"


def _plain(value, where: str = "data"):
    """``value`` as JSON-safe plain numbers, strings, lists and dicts (numpy and torch scalars converted)."""
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, str, int)):
        return value
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: only numbers, strings, lists and dicts can be published, "
                         f"got {type(value).__name__}") from None
    if not math.isfinite(x):
        return None
    return x


def publish(name: str, data: dict, *, machine: str = "") -> dict:
    """Keep ``data`` (plain numbers, strings, lists, dicts) under ``name`` in this cell's output for chapter 10,
    with a one-line note in the notebook. Returns the record kept. Outside a notebook it only returns it."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if not isinstance(data, dict):
        raise ValueError(f"data must be a dict, got {type(data).__name__}")
    record = {"name": name, "machine": machine, "data": _plain(data)}
    json.dumps(record)                                          # what the metadata will hold
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(f"*Kept for chapter 10: `{name}` (its {', '.join(f'`{k}`' for k in data)}).*"),
                    metadata={FIGURES_KEY: record})
    except ImportError:
        pass
    return record


@dataclass(frozen=True)
class Published:
    """Figures read back from an executed notebook."""
    name: str
    data: dict
    notebook: Path
    executed: str          # when papermill finished that notebook ("" if it did not say)
    machine: str

    def where(self) -> str:
        when = f", executed {self.executed}" if self.executed else ""
        on = f" on {self.machine}" if self.machine else ""
        return f"read from `{self.notebook.name}`{when}{on}"


def executed_notebook(prefix: str, build_dir: str | Path | None = None) -> Path | None:
    """The executed notebook of chapter ``prefix`` (e.g. ``"07"``) in ``build_dir/notebooks``, or None."""
    folder = Path(DEFAULT_BUILD if build_dir is None else build_dir) / "notebooks"
    found = sorted(folder.glob(f"{prefix}_*.ipynb")) if folder.is_dir() else []
    return found[0] if found else None


def read_published(prefix: str, name: str, build_dir: str | Path | None = None) -> Published | None:
    """Figures ``name`` that chapter ``prefix`` published in its executed notebook, or None when there is
    no executed notebook, it failed, or it holds no such figures (an older run)."""
    path = executed_notebook(prefix, build_dir)
    if path is None:
        return None
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    papermill = nb.get("metadata", {}).get("papermill", {})
    if papermill.get("exception"):
        return None
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            record = out.get("metadata", {}).get(FIGURES_KEY)
            if isinstance(record, dict) and record.get("name") == name and isinstance(record.get("data"), dict):
                return Published(name, record["data"], path, str(papermill.get("end_time") or "")[:16].replace("T", " "),
                                 str(record.get("machine", "")))
    return None


@dataclass(frozen=True)
class Sourced:
    """A set of figures and where it came from: an earlier chapter's run, or recomputed here."""
    data: dict
    source: str            # a sentence fragment: "read from `07_...ipynb`, executed ..." or "recomputed here ..."
    from_build: bool


def figures_from(prefix: str, name: str, recompute, *, build_dir: str | Path | None = None,
                 use_build: bool = True, recompute_note: str = "recomputed here", model: str | None = None,
                 machine: str | None = None) -> Sourced:
    """Chapter ``prefix``'s published figures ``name`` where the main job left them, else ``recompute()``
    (a function returning the same dict, cheaper). ``use_build=False`` always recomputes. ``model``: a
    :func:`model_key`; figures published for another model are not used (the note says whose they were).
    ``machine``: for figures that depend on the clock (timings), this run's
    :func:`course_utils.notebook.machine_summary`; figures published on another machine, or without one, are
    not used."""
    found = read_published(prefix, name, build_dir) if use_build else None
    if found is not None and model is not None and found.data.get("model") != model:
        recompute_note = f"{recompute_note} (build/ holds chapter {prefix}'s figures for {found.data.get('model')})"
        found = None
    if found is not None and machine is not None and found.machine != machine:
        recompute_note = (f"{recompute_note} (build/ holds chapter {prefix}'s timings from "
                          f"{found.machine or 'an unrecorded machine'})")
        found = None
    if found is not None:
        return Sourced(found.data, found.where(), True)
    return Sourced(_plain(recompute()), recompute_note, False)

def model_key(model) -> str:
    """Which model a set of figures belongs to: its file or Hub name, its architecture and parameter count
    (figures from one model never stand in for another's)."""
    from pathlib import PurePath
    cfg = model.config
    name = PurePath(str(getattr(cfg, "name_or_path", "") or "")).name or "model"
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return f"{name} ({cfg.model_type}, {n:,} parameters)"
