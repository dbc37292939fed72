"""Running a chapter the second time in a test run: on another architecture, with reduced sizes.

A full test run executes every chapter twice at most: once as stored, under nbval (the
embedded model, the sizes a learner gets), and once here: a tiny random qwen2 model read
from a GGUF file made in the test, with the reduced sizes of :data:`REDUCED` passed through
the chapter's ``parameters`` cell, and with the chapter's exercise solutions appended as
code cells (every fenced ``python`` block of the markdown cell holding ``Solutions``), so
each solution runs as printed after its chapter. Chapters 04 and 05 take their second run
in JupyterLab (the browser tests move their sliders) when Chromium is present, and here otherwise.
"""
from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))

#: Parameters of the second run, per chapter number (MODEL is added by the caller).
REDUCED: dict[str, dict] = {
    "01": dict(N_NEW=8, STEP_CONTEXTS=[8, 16, 32], HEAD_CONTEXTS=[64, 128, 256], MEM_CTX=32, REPEATS=1,
               LOOP_REPEATS=1),
    "02": dict(PROMPT_LENGTHS=[8, 16, 64], CACHE_LENGTHS=[8, 16, 64], REPEATS=1, TOKEN_BUDGET=64, DECODE_REPEATS=2,
               MATMUL_SIZE=128, STREAM_NEW_TOKENS=8),
    "03": dict(CHECK_SHAPES=[[1, 1], [2, 17]],       # lists: papermill passes a tuple as its string
               KV_TEXT_TOKENS=48, KV_WINDOWS=2, KV_PREFIX_TOKENS=32, SCORED_TOKENS=8, KV_GROUP=16),
    "04": dict(BATCH_SIZES=[1, 2, 4, 8], SWEEP_REPEATS=1, NEW_TOKENS=8, DEMO_REQUESTS=8,
               LONG_PROMPT_TOKENS=96, CHUNK_BUDGET=24, CHUNK_BUDGETS=[16, 24, 48], CHUNK_ROUNDS=2),
    "05": dict(CALIB_TOKENS=64, MODEL_AWQ_TOKENS=64, TIMING_REPEATS=1, ANSWER_TOKENS=4),
    "06": dict(THRESHOLDS=[0.5, 2, 6, 64], ALPHAS=[0.0, 0.5, 1.0]),
    "07": dict(N_TOKENS=48, WINDOW=40, STRIDE=24, CHUNK=16, OTHER_TOKENS=24, FLOOR_TOKENS=16, AGREE_TOKENS=8,
               BATTERY_TOKENS=4, AWQ_CALIB_TOKENS=32, AWQ_GRID=2, KV_BITS=[8, 2], KV_GROUP=16, KV_TOKENS=32),
    "08": dict(GAMMAS=[1, 2], DRAFT_LAYERS=[1], N_PROMPTS=1, PROMPT_TOKENS=16, N_NEW=8, REPEATS=1, LOOKUP_REPEATS=1, LOOKUP_GAMMA=4,
               HEAD_TOKENS=256, HEAD_HELDOUT_TOKENS=64, HEAD_STEPS=3, HEAD_SECONDS=5, SAMPLING_PASSES=400, SAMPLING_POSITIONS=1),
    "09": dict(TOP_K=8, STUDENT_LAYERS=1, TRAIN_TOKENS=96, SEQ_LEN=16, STEPS=6, SEEDS=[0, 1], N_CHECKPOINTS=2,
               EVAL_TOKENS=32, EVAL_WINDOW=40, EVAL_STRIDE=32, CHUNK=16, PROMPT_TOKENS=8, NEW_TOKENS=8, GAMMA=2,
               TIMING_REPEATS=1, QAT_TOKENS=32, QAT_STEPS=2),
    # BUILD: a folder of executed chapters 07 and 08 made for the tiny model (published_build), so the second
    # run takes the path the main job takes, reading figures back; the first run (nbval) recomputes them
    "10": dict(BATCH_SIZES=[1, 2], STEP_CONTEXTS=[16, 32], MAX_STEP_TOKENS=64, STEP_REPEATS=1, PICK_STEPS=2,
               SUM_BATCH=2, SUM_TOKENS=64, SUM_CHUNK=16,
               EVAL_TOKENS=24, EVAL_WINDOW=32, EVAL_STRIDE=24, EVAL_CHUNK=8, FALLBACK_SCHEMES=["INT8 per-row"],
               FALLBACK_KV_BITS=[8], KV_GROUP=16, LOOKUP_PROMPTS=["repetitive text"], LOOKUP_REPEATS=1,
               MEMORY_BUDGET_MIB=8192, KLD_BOUND=1.0, MIN_TOKENS_PER_S=0.0, CONTEXT=32),
    # chapter 11's vLLM half needs its own environment and minutes of start-up: the second run serves the
    # tiny model with the course engine only
    "11": dict(RUN_VLLM=False, N_REQUESTS=8, MEDIAN_OUTPUT=3, LONGEST_OUTPUT=10, TOTAL_OUTPUT=40, PROMPT_TOKENS=[4, 12],
               REPEATS=2, BENCH_REQUESTS=2, COMPARE_PROMPTS=2, COMPARE_TOKENS=6, SLOTS=4, FAST_PROMPT_TOKENS=8,
               FAST_TOKENS=3, FAST_ROUNDS=1, FAST_HELDOUT=16, PROFILE_TOKENS=3, MEASURE_COMPILED=True,
               LONG_REQUESTS=1, LONG_PROMPT_TOKENS=[40, 48], LONG_OUTPUT=2, SHORT_REQUESTS=2, SHORT_OUTPUT=4,
               CHUNK_BUDGET=16, LONG_ROUNDS=2),
}


def reduced_parameters(chapter: Path, model: str) -> dict:
    """``MODEL`` plus the chapter's reduced sizes."""
    return {"MODEL": model, **REDUCED.get(chapter.name[:2], {})}


def published_build(folder: Path, model_path: str) -> Path:
    """A main job's output folder as chapter 10 reads it: executed chapters 07 and 08 holding the figures they
    publish (:func:`course_utils.figures.publish`), for the model at ``model_path``. The figures are made up
    (plausible sizes); what is tested is the path that reads them back. They are marked as measured on this
    machine (:func:`course_utils.notebook.machine_summary`, as chapter 08 marks its timings): chapter 10 uses
    timings only from the machine it runs on."""
    import json

    from course_utils.figures import FIGURES_KEY, model_key
    from course_utils.models import load_model
    from course_utils.notebook import machine_summary
    model, _ = load_model(model_path, dtype="float32", device="cpu", verbose=False)
    key = model_key(model)
    del model
    quality = {"model": key, "text": "pride_and_prejudice", "n_tokens": 48, "kv_tokens": 32, "reference_bits": 32.0,
               "weights": {"bf16": dict(proj_bits=16.0, rest_bits=16.0, kld=2e-4, kld_se=1e-5, same_top=0.99, agree=[8, 8]),
                           "INT8 per-row": dict(proj_bits=8.02, rest_bits=32.0, kld=5e-4, kld_se=3e-5, same_top=0.98,
                                                agree=[8, 8]),
                           "INT4 group-64": dict(proj_bits=4.25, rest_bits=32.0, kld=0.05, kld_se=0.004, same_top=0.9,
                                                 agree=[6, 8])},
               "kv": {"KV int8 (K per channel, V per token)": dict(bits=8.5, kld=1e-5, kld_se=1e-6, same_top=1.0,
                                                                   spec=[8, 16, "channel", "token"])},
               "awq": {"base": "INT4 group-128", "calib_tokens": 32, "grid": 2}}
    lookup = {"model": key, "gamma": 4, "prompts": [dict(name="repetitive text", copy_fraction=0.9, speedup=1.8,
                                                         tokens_per_pass=3.1, tokens=8),
                                                    dict(name="novel question", copy_fraction=0.1, speedup=0.9,
                                                         tokens_per_pass=1.1, tokens=8)]}
    out = folder / "notebooks"
    out.mkdir(parents=True, exist_ok=True)
    for name, (fig, data) in {"07_evaluating_quantization": ("quality", quality),
                              "08_speculative_decoding": ("lookup", lookup)}.items():
        nb = nbformat.v4.new_notebook()
        cell = nbformat.v4.new_code_cell("publish(...)")
        cell.outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": "kept"},
                                               metadata={FIGURES_KEY: {"name": fig, "machine": machine_summary("cpu"), "data": data}})]
        nb.cells = [cell]
        nb.metadata["papermill"] = {"end_time": "2026-12-01T00:00:00", "exception": None}
        (out / f"{name}.ipynb").write_text(json.dumps(nb))
    return folder


SOLUTION_BLOCK = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```", re.M | re.S)


def solution_code(nb) -> list[str]:
    """The fenced ``python`` blocks of the chapter's solutions, in order, dedented."""
    blocks = []
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "<summary>Solutions</summary>" in cell.source:
            blocks += [textwrap.dedent(m.group(2)) for m in SOLUTION_BLOCK.finditer(cell.source)]
    return blocks


def second_run_copy(chapter: Path, target: Path, parameters: dict) -> Path:
    """``chapter`` as its second run executes it: papermill's injected-parameters cell after the
    parameters cell, and the solutions appended as code cells tagged ``solution``."""
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = load_notebook_node(str(chapter))           # as papermill reads it (every cell gets a tags list)
    for code in solution_code(nb):
        cell = nbformat.v4.new_code_cell(code)
        cell.metadata["tags"] = ["solution"]
        nb.cells.append(cell)
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
