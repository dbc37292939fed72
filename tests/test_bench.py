"""Every benchmark section runs and produces its rows, on a tiny model with reduced sizes.

Speed is not asserted here (timings belong in the benchmark's table, not in tests): only that
each section yields rows, none of them a failure, every value finite.
"""
from __future__ import annotations

import math

import pytest

from course_utils.bench import SECTIONS, BenchContext, Row, format_table, run


@pytest.fixture(scope="module")
def bench_rows(tiny_gguf, tmp_path_factory):
    import io
    ctx = BenchContext(model_name=str(tiny_gguf), reduced=True)
    return run(SECTIONS, ctx, stream=io.StringIO())


@pytest.mark.parametrize("section", [name for name, _ in SECTIONS])
def test_section_yields_finite_rows(bench_rows, section):
    rows = [r for r in bench_rows if r.section == section]
    assert rows, f"{section} produced no rows"
    failed = [r.name for r in rows if r.name.startswith("FAILED")]
    assert not failed, failed
    assert all(isinstance(r, Row) and math.isfinite(r.value) for r in rows), [r for r in rows if not math.isfinite(r.value)]


def test_a_failing_section_is_reported_as_a_row_not_raised():
    import io
    rows = run([("99 broken", "course_utils.bench.no_such_module")], BenchContext(reduced=True), stream=io.StringIO())
    assert len(rows) == 1 and rows[0].name.startswith("FAILED") and math.isnan(rows[0].value)
    assert "FAILED" in format_table(rows)


def test_the_serving_section_profiles_a_chunk_step_by_class(bench_rows):
    """The rows that explain a missed long-prompt target (a chunk step by operator class) are built in the reduced run:
    the class rows and the rest add up to the profiled step, and the matrix products sit above their FLOP floor."""
    rows = [r for r in bench_rows if r.section == "11 serving" and "prefill step of" in r.name]
    by_tail = {r.name.rsplit(": ", 1)[1]: r for r in rows}
    assert "step time" in by_tail and "matrix products / their FLOP floor" in by_tail, list(by_tail)
    parts = [r for tail, r in by_tail.items() if r.unit == "ms/step"]
    assert len(parts) == 5 and all(r.value >= 0 for r in parts)
    shares = [float(r.note.split("%")[0]) for r in parts]
    assert 90 <= sum(shares) <= 110, shares          # the classes cover the profiled step (rounded shares)
    assert by_tail["matrix products / their FLOP floor"].value > 0
