"""nbtools: stored notebooks keep only the text outputs of checked cells, with the count nbval needs."""
from __future__ import annotations

import nbformat

from course_utils.nbtools import clean, problems


def _notebook():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("X = 1", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(2 + 2)"),
                nbformat.v4.new_code_cell("print('timing')")]
    for i, cell in enumerate(nb.cells):
        cell.execution_count = i + 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"out {i}\n")]
    return nb


def test_clean_keeps_checked_text_with_an_execution_count():
    nb = clean(_notebook(), expected=_notebook())
    params, checked, timing = nb.cells
    assert params.outputs == [] and params.execution_count is None
    assert timing.outputs == [] and timing.execution_count is None
    assert checked.outputs[0].text == "out 1\n" and checked.execution_count == 1   # nbval skips cells without one
    assert problems(nb) == []


def test_problems_flags_outputs_and_counts_of_unchecked_cells():
    found = problems(_notebook())
    assert any("cell 2: has an execution count" in p for p in found)
    assert any("cell 2: has outputs" in p for p in found)
    assert not any(p.startswith("cell 1: has an execution count") for p in found)
