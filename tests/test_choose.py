"""Chapter 10: the memory sum, the chooser's order of constraints, the speculative verdict, published figures."""
import json

import pytest

import numpy as np

from course_utils.batching import GridPoint
from course_utils.choose import (
    CONSTRAINTS, KVOption, StepTimes, WeightOption, additivity, agrees, best, candidates, chooser_figure,
    first_failures, memory_terms, rivals, smallest_memory, speculative_verdict,
)
from course_utils.figures import figures_from, publish, read_published
from course_utils.memory_sizing import kv_cache_bytes

CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
          "hidden_size": 576}
FP32 = WeightOption("fp32", 32, 32, 0.0)
INT4 = WeightOption("INT4", 4.5, 32, 0.08, held=False)
BF16 = WeightOption("bf16", 16, 16, 0.002, speed_dtype="bfloat16")
KV32 = KVOption("float32", 32, 0.0, dtype="float32")
KV16 = KVOption("bfloat16", 16, 0.0, dtype="bfloat16")
KV4 = KVOption("int4", 4.5, 0.05, timing="int4")
# seconds per step at contexts 256 and 4096, for batches 1, 4, 16 (16 only at 256)
_STEPS = {"float32": {1: (0.05, 0.07), 4: (0.08, 0.14), 16: (0.2, None)},
          "bfloat16": {1: (0.04, 0.05), 4: (0.07, 0.1), 16: (0.15, None)}}
STEPS = StepTimes({dtype: [GridPoint(cache, b, c, s * (1.5 if cache == "int4" else 1.0), 0.001)
                           for cache in ("float", "int4") for b, pair in table.items()
                           for c, s in zip((256, 4096), pair) if s is not None]
                   for dtype, table in _STEPS.items()})
N_PROJ, N_REST = 100_000_000, 30_000_000


def test_the_sum_is_weights_plus_cache_plus_overhead():
    m = memory_terms(INT4, KV4, CONFIG, n_proj=N_PROJ, n_rest=N_REST, resident_tokens=4096, overhead_bytes=1e6)
    assert m.weights == (N_PROJ * 4.5 + N_REST * 32) / 8
    assert m.kv_cache == kv_cache_bytes(CONFIG, 4096, 4.5)
    assert m.total == m.weights + m.kv_cache + 1e6
    # only the resident tokens matter: 4 users x 1024 = 1 user x 4096
    assert memory_terms(INT4, KV4, CONFIG, n_proj=N_PROJ, n_rest=N_REST, resident_tokens=4 * 1024).kv_cache == m.kv_cache


def test_step_times_interpolate_between_timed_contexts_and_claim_nothing_beyond():
    assert STEPS.at("float32", "float", 1, 256) == (0.05, 0.001)
    s, spread = STEPS.at("float32", "float", 1, 2176)                 # halfway from 256 to 4096
    assert s == pytest.approx(0.06) and spread == pytest.approx(0.001)
    assert STEPS.at("float32", "float", 1, 8192) is None and STEPS.at("float32", "float", 1, 128) is None
    assert STEPS.at("float32", "float", 16, 1024) is None               # B = 16 was timed at 256 only
    assert STEPS.batches("bfloat16", "int4") == [1, 4, 16] and STEPS.contexts("float32", "float", 4) == [256, 4096]
    with pytest.raises(ValueError, match="> 0 s"):
        StepTimes({"float32": [GridPoint("float", 1, 256, 0.0, 0.0)]})
    with pytest.raises(ValueError, match="twice"):
        StepTimes({"float32": [GridPoint("float", 1, 256, 0.1, 0.0)] * 2})


def _cands(**kw):
    args = dict(n_proj=N_PROJ, n_rest=N_REST, context=256, budget_bytes=2**30, kld_bound=0.2, min_user_tokens_per_s=0.0)
    args.update(kw)
    return candidates([FP32, INT4, BF16], [KV32, KV16, KV4], STEPS, CONFIG, **args)


def test_every_combination_is_considered_with_its_measured_step():
    cs = _cands()
    # a float cache goes with its own dtype only: fp32 and INT4 (float32 compute) x {float32, int4}, bf16 x {bf16, int4}
    assert len(cs) == 3 * 2 * 3
    assert not any(c.kv is KV16 and c.weights is not BF16 for c in cs)
    c = next(c for c in cs if c.weights is BF16 and c.kv is KV4 and c.batch == 16)
    assert c.step_s == pytest.approx(0.225) and c.tokens_per_s == pytest.approx(16 / 0.225)
    assert c.kld == pytest.approx(0.052) and c.memory.kv_cache == kv_cache_bytes(CONFIG, 16 * 256, 4.5)
    assert not next(c for c in cs if c.weights is INT4).held and c.held


def test_a_context_that_was_not_timed_fails_speed_and_claims_no_throughput():
    cs = _cands(context=2048)
    far = [c for c in cs if c.batch == 16]
    assert far and all(not c.timed and "speed" in c.fails and np.isnan(c.tokens_per_s) for c in far)
    assert all(c.timed for c in cs if c.batch < 16)
    assert "not timed" in chooser_figure(cs, budget_bytes=2**30).layout.title.text


def test_the_quality_bound_applies_to_the_estimate_plus_two_standard_errors():
    close = WeightOption("close", 8, 32, 0.008, kld_se=0.0006)        # 0.008 < 0.01, but 0.008 + 2 x 0.0012 > 0.01
    cs = candidates([close], [KVOption("int8", 8.5, 0.0, kld_se=0.0006, timing="int4")], STEPS, CONFIG,
                    n_proj=N_PROJ, n_rest=N_REST, context=256, budget_bytes=2**40, kld_bound=0.01)
    assert all(c.kld < 0.01 and c.kld_upper == pytest.approx(0.0104) and c.fails == ("quality",) for c in cs)
    loose = candidates([close], [KVOption("int8", 8.5, 0.0, kld_se=0.0, timing="int4")], STEPS, CONFIG,
                       n_proj=N_PROJ, n_rest=N_REST, context=256, budget_bytes=2**40, kld_bound=0.01)
    assert all(c.ok for c in loose)


def test_quality_comes_first_then_memory_then_speed():
    cs = _cands(kld_bound=0.06, budget_bytes=0.6 * 2**30, min_user_tokens_per_s=10)
    for c in cs:
        expected = []
        if c.kld_upper > 0.06:
            expected.append("quality")
        if c.memory.total > 0.6 * 2**30:
            expected.append("memory")
        if 1 / c.step_s < 10:
            expected.append("speed")
        assert list(c.fails) == expected
        assert list(c.fails) == [n for n in CONSTRAINTS if n in c.fails]
    counts = first_failures(cs)
    assert sum(counts.values()) == sum(not c.ok for c in cs)
    assert counts["quality"] == sum(c.kld > 0.06 for c in cs)         # INT4 weights with any cache, bf16 with int4


def test_working_memory_is_charged_per_request():
    one = _cands(overhead_bytes=1e6, working_bytes_per_request=2e6)
    c = next(c for c in one if c.weights is FP32 and c.kv is KV32 and c.batch == 4)
    assert c.memory.overhead == 1e6 + 4 * 2e6
    with pytest.raises(ValueError, match="overheads"):
        _cands(working_bytes_per_request=-1)


def test_best_is_the_fastest_that_meets_everything():
    cs = _cands(kld_bound=0.01)                          # only fp32/bf16 weights with a float cache
    pick = best(cs)
    assert pick.kv in (KV32, KV16) and pick.weights in (FP32, BF16)
    assert pick.tokens_per_s == max(c.tokens_per_s for c in cs if c.ok)
    tight = _cands(kld_bound=0.01, budget_bytes=0.4e9)   # fp32 weights (520 MB) no longer fit; bf16 + a cache do
    assert best(tight).weights is BF16
    assert best(_cands(kld_bound=0.0, budget_bytes=1.0)) is None
    assert smallest_memory(cs) == min(c.memory.total for c in cs)
    fig = chooser_figure(cs, budget_bytes=2**30)
    assert "Chosen" in fig.layout.title.text
    assert "No configuration" in chooser_figure(_cands(budget_bytes=1.0), budget_bytes=1.0).layout.title.text


def test_rivals_are_those_whose_throughput_overlaps_the_pick_within_its_spread():
    steps = StepTimes({"float32": [GridPoint("float", 1, 256, 0.050, 0.004), GridPoint("float", 2, 256, 0.096, 0.004),
                                   GridPoint("float", 4, 256, 0.300, 0.001)]})
    cs = candidates([FP32], [KV32], steps, CONFIG, n_proj=1, n_rest=1, context=256, budget_bytes=2**40, kld_bound=1)
    pick = best(cs)
    assert pick.batch == 2 and [c.batch for c in rivals(cs, pick)] == [1]     # 20.8 vs 20 tok/s: within the spread


def test_a_disturbed_step_gives_a_finite_range_from_its_rounds_and_is_flagged():
    wild = GridPoint("float", 1, 256, 0.050, 0.060, (0.045, 0.050, 0.165))      # one round disturbed
    steps = StepTimes({"float32": [wild, GridPoint("float", 2, 256, 0.080, 0.002, (0.078, 0.080, 0.082))]})
    cs = candidates([FP32], [KV32], steps, CONFIG, n_proj=1, n_rest=1, context=256, budget_bytes=2**40, kld_bound=1)
    one = next(c for c in cs if c.batch == 1)
    assert one.tokens_per_s_range == pytest.approx((1 / 0.165, 1 / 0.045))   # the rounds, not median -/+ spread
    assert one.noisy and not next(c for c in cs if c.batch == 2).noisy
    assert rivals(cs, best(cs)) == []                 # a wide range no longer reaches 10^12 tokens/s
    bare = StepTimes({"float32": [GridPoint("float", 1, 256, 0.050, 0.060)]})   # no rounds kept
    c = candidates([FP32], [KV32], bare, CONFIG, n_proj=1, n_rest=1, context=256, budget_bytes=2**40, kld_bound=1)[0]
    assert c.tokens_per_s_range[1] == float("inf")    # said to be unbounded, not a made-up figure


def test_the_speed_target_applies_to_the_slowest_round():
    steps = StepTimes({"float32": [GridPoint("float", 1, 256, 0.100, 0.020, (0.080, 0.100, 0.120))]})
    kw = dict(n_proj=1, n_rest=1, context=256, budget_bytes=2**40, kld_bound=1)
    assert "speed" not in candidates([FP32], [KV32], steps, CONFIG, min_user_tokens_per_s=8, **kw)[0].fails
    # 10 tok/s at the median, 8.3 at the slowest round: a target of 9 is not met
    assert "speed" in candidates([FP32], [KV32], steps, CONFIG, min_user_tokens_per_s=9, **kw)[0].fails


def test_a_speed_target_above_every_measurement_leaves_nothing():
    cs = _cands(min_user_tokens_per_s=1000)
    assert best(cs) is None and all("speed" in c.fails for c in cs)


@pytest.mark.parametrize("kw, message", [
    (dict(context=0), "context"), (dict(budget_bytes=0), "memory budget"), (dict(kld_bound=-1), "quality bound"),
    (dict(min_user_tokens_per_s=-1), "speed target"),
])
def test_bad_chooser_input_is_a_clear_error(kw, message):
    with pytest.raises(ValueError, match=message):
        _cands(**kw)


def test_a_format_without_measured_speeds_is_an_error():
    with pytest.raises(ValueError, match="no step times"):
        candidates([WeightOption("x", 8, 32, 0.0, speed_dtype="float16")], [KV4], STEPS, CONFIG, n_proj=1, n_rest=1,
                   context=256, budget_bytes=1e9, kld_bound=1.0)
    with pytest.raises(TypeError, match="StepTimes"):
        candidates([FP32], [KV32], {"float32": {1: 0.1}}, CONFIG, n_proj=1, n_rest=1, context=8, budget_bytes=1e9,
                   kld_bound=1.0)


def test_the_held_memory_check_fails_for_a_format_charged_at_bits_it_is_not_held_in():
    n = 134_515_008
    held_fp32 = n * 4 + 30e6                                      # what loading float32 weights adds, a little more
    assert agrees(held_fp32, n * 4, rel_tol=0.15)
    assert not agrees(held_fp32, n * 1, rel_tol=0.15)             # the same weights charged at 8 bits
    assert not agrees(4 * 90 * 2**20, 90 * 2**20 * 4.5 / 32 * 4, rel_tol=0.15)   # a float cache charged as int4
    with pytest.raises(ValueError):
        agrees(1.0, 0.0, rel_tol=0.1)


def test_additivity_measures_the_cross_term_paired_by_position():
    rng = np.random.default_rng(0)
    a, b = rng.exponential(0.01, 500), rng.exponential(0.005, 500)
    mean, se = additivity(a, b, a + b)
    assert mean == pytest.approx(0.0, abs=1e-15) and se == pytest.approx(0.0, abs=1e-15)
    mean, se = additivity(a, b, a + b + 0.002 + rng.normal(0, 0.001, 500))    # a positive cross term
    assert mean > 2 * se and mean == pytest.approx(0.002, abs=3e-4)
    with pytest.raises(ValueError):
        additivity(a, b[:10], a)


def test_speculative_decoding_pays_only_where_it_measured_faster():
    measured = {"repetitive": {"speedup": 1.8, "tokens_per_pass": 2.6}, "free text": {"speedup": 0.9, "tokens_per_pass": 1.1}}
    assert speculative_verdict(measured, 1, "repetitive").pays
    assert not speculative_verdict(measured, 1, "free text").pays
    later = speculative_verdict(measured, 4, "repetitive")
    assert not later.pays and "batch 1" in later.reason and later.status == "not measured"
    assert speculative_verdict(measured, 1, "repetitive").status == "pays"
    assert speculative_verdict(measured, 1, "free text").status == "does not pay"
    with pytest.raises(ValueError, match="workload"):
        speculative_verdict(measured, 1, "poetry")
    noisy = {"w": {"speedup": 1.06, "tokens_per_pass": 2.1, "speedup_range": [0.9, 1.2]}}
    assert not speculative_verdict(noisy, 1, "w").pays and "within noise" in speculative_verdict(noisy, 1, "w").reason
    assert speculative_verdict(noisy, 1, "w").status == "within noise"
    clear = {"w": {"speedup": 1.6, "tokens_per_pass": 2.1, "speedup_range": [1.4, 1.7]}}
    assert speculative_verdict(clear, 1, "w").pays and "1.40–1.70" in speculative_verdict(clear, 1, "w").reason


def _executed(tmp_path, prefix, records, *, exception=False):
    folder = tmp_path / "notebooks"
    folder.mkdir(exist_ok=True)
    outputs = [{"output_type": "display_data", "data": {"text/markdown": "kept"}, "metadata": {"course_utils/figures": r}}
               for r in records]
    nb = {"cells": [{"cell_type": "code", "source": "", "metadata": {}, "outputs": outputs, "execution_count": 1}],
          "metadata": {"papermill": {"end_time": "2026-12-01T10:11:12.5", "exception": exception}},
          "nbformat": 4, "nbformat_minor": 5}
    (folder / f"{prefix}_chapter.ipynb").write_text(json.dumps(nb))


def test_published_figures_are_read_back_from_an_executed_notebook(tmp_path):
    record = publish("quality", {"a": 1.5, "b": [1, float("nan")], "c": {"d": "x"}}, machine="test box")
    assert record["data"] == {"a": 1.5, "b": [1, None], "c": {"d": "x"}}          # NaN is not JSON: kept as None
    _executed(tmp_path, "07", [publish("other", {"z": 0}), record])
    found = read_published("07", "quality", tmp_path)
    assert found.data == record["data"] and found.executed == "2026-12-01 10:11" and found.machine == "test box"
    assert "07_chapter.ipynb" in found.where() and "test box" in found.where()
    assert read_published("07", "missing", tmp_path) is None
    assert read_published("08", "quality", tmp_path) is None                     # no such notebook


def test_figures_fall_back_to_recomputing_where_the_main_job_left_nothing(tmp_path):
    calls = []
    recompute = lambda: calls.append(1) or {"x": 2}  # noqa: E731
    fresh = figures_from("07", "quality", recompute, build_dir=tmp_path)
    assert fresh.data == {"x": 2} and not fresh.from_build and calls == [1]
    _executed(tmp_path, "07", [publish("quality", {"x": 3})])
    kept = figures_from("07", "quality", recompute, build_dir=tmp_path)
    assert kept.data == {"x": 3} and kept.from_build and calls == [1]
    assert not figures_from("07", "quality", recompute, build_dir=tmp_path, use_build=False).from_build


def test_a_failed_run_is_not_read(tmp_path):
    _executed(tmp_path, "07", [publish("quality", {"x": 3})], exception=True)
    assert read_published("07", "quality", tmp_path) is None


def test_publishing_refuses_what_is_not_plain_data():
    with pytest.raises(ValueError, match="only numbers"):
        publish("x", {"a": object()})
    with pytest.raises(ValueError, match="dict"):
        publish("x", [1, 2])


def test_figures_of_another_model_are_not_used(tmp_path):
    _executed(tmp_path, "07", [publish("quality", {"model": "model A", "x": 3})])
    kept = figures_from("07", "quality", lambda: {"x": 2}, build_dir=tmp_path, model="model A")
    assert kept.from_build and kept.data["x"] == 3
    other = figures_from("07", "quality", lambda: {"x": 2}, build_dir=tmp_path, model="model B")
    assert not other.from_build and other.data == {"x": 2} and "model A" in other.source


def test_timings_from_another_machine_are_not_used(tmp_path):
    _executed(tmp_path, "08", [publish("lookup", {"x": 3}, machine="box A")])
    assert figures_from("08", "lookup", lambda: {"x": 2}, build_dir=tmp_path, machine="box A").from_build
    other = figures_from("08", "lookup", lambda: {"x": 2}, build_dir=tmp_path, machine="box B")
    assert not other.from_build and other.data == {"x": 2} and "box A" in other.source
    _executed(tmp_path, "08", [publish("lookup", {"x": 3})])                      # no machine recorded
    assert not figures_from("08", "lookup", lambda: {"x": 2}, build_dir=tmp_path, machine="box A").from_build
