"""Timing and memory measurement: correct counts, sensible values, clear errors."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from course_utils.measure import (Timing, measure_bandwidth, peak_memory, rss_bytes, time_call,
                                  time_interleaved)


def test_time_call_runs_warmup_plus_repeats_and_keeps_result():
    calls = []
    t = time_call(lambda: calls.append(1) or len(calls), warmup=2, repeats=4)
    assert len(calls) == 6 and len(t.samples_s) == 4 and t.result == 6
    assert t.min_s <= t.median_s <= t.max_s


def test_time_call_measures_a_sleep():
    t = time_call(lambda: time.sleep(0.02), warmup=0, repeats=3)
    assert t.median_s >= 0.02


def test_timing_statistics():
    t = Timing([0.3, 0.1, 0.2])
    assert (t.median_s, t.min_s, t.max_s) == (0.2, 0.1, 0.3)
    assert t.spread_s == pytest.approx(0.1)
    assert "ms median" in str(t)


@pytest.mark.parametrize("kw", [{"warmup": -1}, {"repeats": 0}, {"repeats": 2.5}])
def test_time_call_rejects_bad_counts(kw):
    with pytest.raises(ValueError):
        time_call(lambda: None, **kw)


def test_time_call_rejects_non_callable():
    with pytest.raises(TypeError):
        time_call(42)


def test_time_interleaved_times_each():
    out = time_interleaved({"a": lambda: None, "b": lambda: time.sleep(0.005)}, warmup=0, repeats=3)
    assert set(out) == {"a", "b"} and out["b"].median_s > out["a"].median_s
    with pytest.raises(ValueError):
        time_interleaved({})


def test_peak_memory_sees_a_large_allocation_that_is_freed():
    nbytes = 200 * 2**20

    def allocate_and_free():
        x = torch.ones(nbytes // 4)
        time.sleep(0.05)
        return float(x[0])

    result = peak_memory(allocate_and_free)
    assert result.result == 1.0
    assert 0.9 * nbytes <= result.peak_bytes <= 1.5 * nbytes
    assert rss_bytes() < result.baseline_bytes + 0.5 * nbytes    # it was freed


def test_peak_memory_of_a_later_smaller_call_is_small():
    peak_memory(lambda: torch.ones(100 * 2**20 // 4).sum())
    small = peak_memory(lambda: torch.ones(1000).sum())
    assert small.peak_bytes < 20 * 2**20


def test_bandwidth_is_positive_and_rejects_tiny_buffers():
    bw = measure_bandwidth(nbytes=64 * 2**20, repeats=3)
    assert 1e8 < bw < 1e13
    with pytest.raises(ValueError, match="at least 1 MiB"):
        measure_bandwidth(nbytes=1024)


def test_bandwidth_samples_and_compute_roof_are_positive_rates():
    from course_utils.measure import bandwidth_samples_Bps, measure_matmul_flops
    samples = bandwidth_samples_Bps(nbytes=2**21, repeats=3)
    assert len(samples) == 3 and all(s > 0 for s in samples)
    assert measure_matmul_flops(n=64, repeats=2) > 0
    with pytest.raises(ValueError, match="n must be"):
        measure_matmul_flops(n=0)


#: The allocation pattern of chapter 07, run in a process of its own: in the test runner's process, threads and
#: buffers of earlier tests move its RSS too (one CI run saw it rise by 128 MiB during the loop).
_ALLOCATOR_SCRIPT = """
import random, sys
import torch
from course_utils.measure import rss_bytes, steady_allocator
if not steady_allocator():
    print("skip"); sys.exit()
random.seed(0)
big = torch.ones(40 * 2**18)                   # a large buffer freed first (glibc would raise its threshold)
del big
base, live, worst = rss_bytes(), [], 0
for _ in range(300):                           # temporaries of 1-28 MB, a few alive at a time, freed in any order
    live.append(torch.ones(random.randint(1, 28) * 2**18))
    if len(live) > 4:
        live.pop(random.randrange(len(live)))
    worst = max(worst, rss_bytes() - base - sum(t.numel() * 4 for t in live))
print(worst)
"""


def test_steady_allocator_keeps_rss_close_to_the_memory_in_use():
    from course_utils.measure import steady_allocator
    with pytest.raises(ValueError):
        steady_allocator(0)
    out = subprocess.run([sys.executable, "-c", _ALLOCATOR_SCRIPT], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.split()[-1]
    if out == "skip":
        pytest.skip("not glibc: steady_allocator does nothing here")
    assert int(out) < 50e6                         # glibc's default here: ~190 MB above what is in use


def test_the_wait_policy_is_named_as_set(monkeypatch):
    from course_utils.measure import openmp_wait_policy
    from course_utils.notebook import machine_summary
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert openmp_wait_policy() == "OpenMP's default wait policy"
    assert "OpenMP's default wait policy" in machine_summary("cpu")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert openmp_wait_policy() == "OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=1000"


def test_touching_parameters_reads_every_weight_and_file_backed_bytes_is_a_count_or_unknown(tiny_llama):
    from course_utils.measure import file_backed_bytes, touch_parameters
    touch_parameters(tiny_llama)
    shared = file_backed_bytes()
    assert shared is None or (isinstance(shared, int) and 0 <= shared <= rss_bytes())


def test_compute_roof_is_the_best_round_of_the_same_matmul_measurement(monkeypatch):
    import course_utils.measure as M
    rates = iter([3.0e9, 5.0e9, 4.0e9])
    calls = []

    def fake(**kw):
        calls.append(kw)
        return next(rates)

    monkeypatch.setattr(M, "measure_matmul_flops", fake)
    roof = M.measure_compute_roof(n=256, rounds=3, repeats=4)
    assert roof.samples_flops == (3.0e9, 5.0e9, 4.0e9) and roof.flops == 5.0e9
    assert all(c["n"] == 256 and c["repeats"] == 4 for c in calls)
    with pytest.raises(ValueError, match="rounds must be"):
        M.measure_compute_roof(rounds=0)


def test_compute_roof_flops_is_a_positive_rate():
    from course_utils.measure import compute_roof_flops
    assert compute_roof_flops(n=64, rounds=2, repeats=2) > 0
