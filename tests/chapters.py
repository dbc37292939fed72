"""Running a chapter the second time in a test run: on another architecture, with reduced sizes.

A full test run executes every chapter twice at most: once as stored, under nbval (the
embedded model, the sizes a learner gets), and once here: a tiny random qwen2 model read
from a GGUF file made in the test, with the reduced sizes of :data:`REDUCED` passed through
the chapter's ``parameters`` cell. Chapters 04 and 05 take their second run in JupyterLab
(the browser tests move their sliders) when Chromium is present, and here otherwise.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))

#: Parameters of the second run, per chapter number (MODEL is added by the caller).
REDUCED: dict[str, dict] = {
    "01": dict(N_NEW=8, STEP_CONTEXTS=[8, 16, 32], HEAD_CONTEXTS=[64, 128, 256], MEM_CTX=32, REPEATS=1),
    "02": dict(PROMPT_LENGTHS=[8, 16, 64], CACHE_LENGTHS=[8, 16, 64], REPEATS=1, TOKEN_BUDGET=64, DECODE_REPEATS=2,
               STREAM_NEW_TOKENS=8),
    "03": dict(CHECK_SHAPES=[(1, 1), (2, 17)]),
    "04": dict(BATCH_SIZES=[1, 2, 4, 8], SWEEP_REPEATS=1, NEW_TOKENS=4, DEMO_REQUESTS=8),
    "05": dict(CALIB_TOKENS=64, TIMING_REPEATS=1, ANSWER_TOKENS=4),
    "06": dict(THRESHOLDS=[0.5, 2, 8, 64], ALPHAS=[0.0, 0.5, 1.0]),
}


def reduced_parameters(chapter: Path, model: str) -> dict:
    """``MODEL`` plus the chapter's reduced sizes."""
    return {"MODEL": model, **REDUCED.get(chapter.name[:2], {})}


def parameterized_copy(chapter: Path, target: Path, parameters: dict) -> Path:
    """A copy of ``chapter`` with papermill's injected-parameters cell after its parameters cell
    (what papermill executes), for running it elsewhere, e.g. in JupyterLab."""
    from papermill.parameterize import parameterize_notebook

    nb = nbformat.read(chapter, as_version=4)
    nb = parameterize_notebook(nb, parameters)
    nbformat.write(nb, target)
    return target


def check_second_run(executed: Path) -> None:
    """What every second run must show: each code cell ran, none raised, and the tiny qwen2 model was the one loaded."""
    nb = nbformat.read(executed, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), f"{executed.name}: a code cell did not run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{executed.name}: {errors[0].ename}: {errors[0].evalue}"
    text = "\n".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert "qwen2, 2 layers" in text, f"{executed.name}: the tiny qwen2 model was not the one loaded"


def copy_notebooks(target: Path) -> None:
    for nb in NOTEBOOKS.glob("*.ipynb"):
        shutil.copy(nb, target / nb.name)
