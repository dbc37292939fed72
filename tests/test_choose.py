"""Chapter 10: the memory sum, the chooser's order of constraints, the speculative verdict, published figures."""
import json

import pytest

from course_utils.choose import (
    CONSTRAINTS, KVOption, WeightOption, best, candidates, chooser_figure, first_failures, memory_terms,
    speculative_verdict,
)
from course_utils.figures import figures_from, publish, read_published
from course_utils.memory_sizing import kv_cache_bytes

CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
          "hidden_size": 576}
FP32 = WeightOption("fp32", 32, 32, 0.0)
INT4 = WeightOption("INT4", 4.5, 32, 0.08)
BF16 = WeightOption("bf16", 16, 16, 0.002, speed_dtype="bfloat16")
KV32, KV4 = KVOption("fp32", 32, 0.0), KVOption("int4", 4.5, 0.05)
SPEEDS = {"float32": {1: 0.05, 4: 0.08, 16: 0.2}, "bfloat16": {1: 0.04, 4: 0.07, 16: 0.15}}
N_PROJ, N_REST = 100_000_000, 30_000_000


def test_the_sum_is_weights_plus_cache_plus_overhead():
    m = memory_terms(INT4, KV4, CONFIG, n_proj=N_PROJ, n_rest=N_REST, resident_tokens=4096, overhead_bytes=1e6)
    assert m.weights == (N_PROJ * 4.5 + N_REST * 32) / 8
    assert m.kv_cache == kv_cache_bytes(CONFIG, 4096, 4.5)
    assert m.total == m.weights + m.kv_cache + 1e6
    # only the resident tokens matter: 4 users x 1024 = 1 user x 4096
    assert memory_terms(INT4, KV4, CONFIG, n_proj=N_PROJ, n_rest=N_REST, resident_tokens=4 * 1024).kv_cache == m.kv_cache


def _cands(**kw):
    args = dict(n_proj=N_PROJ, n_rest=N_REST, context=1024, budget_bytes=2**30, kld_bound=0.1, min_user_tokens_per_s=0.0)
    args.update(kw)
    return candidates([FP32, INT4, BF16], [KV32, KV4], SPEEDS, CONFIG, **args)


def test_every_combination_is_considered_with_its_measured_step():
    cs = _cands()
    assert len(cs) == 3 * 2 * 3
    c = next(c for c in cs if c.weights is BF16 and c.kv is KV4 and c.batch == 16)
    assert c.step_s == 0.15 and c.tokens_per_s == pytest.approx(16 / 0.15) and c.kld == pytest.approx(0.052)
    assert c.memory.kv_cache == kv_cache_bytes(CONFIG, 16 * 1024, 4.5)


def test_quality_comes_first_then_memory_then_speed():
    cs = _cands(kld_bound=0.06, budget_bytes=0.6 * 2**30, min_user_tokens_per_s=10)
    for c in cs:
        expected = []
        if c.kld > 0.06:
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


def test_best_is_the_fastest_that_meets_everything():
    cs = _cands(kld_bound=0.01)                          # only fp32/bf16 weights with an fp32 cache
    pick = best(cs)
    assert pick.kv is KV32 and pick.weights in (FP32, BF16)
    assert pick.tokens_per_s == max(c.tokens_per_s for c in cs if c.ok)
    tight = _cands(kld_bound=0.01, budget_bytes=0.4e9)   # fp32 weights (520 MB) no longer fit; bf16 + one cache do
    assert (best(tight).weights, best(tight).batch) == (BF16, 1)
    assert best(_cands(kld_bound=0.0, budget_bytes=1.0)) is None
    fig = chooser_figure(cs, budget_bytes=2**30)
    assert "Chosen" in fig.layout.title.text
    assert "No configuration" in chooser_figure(_cands(budget_bytes=1.0), budget_bytes=1.0).layout.title.text


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


def test_a_weight_option_without_measured_speeds_is_an_error():
    with pytest.raises(ValueError, match="no measured step times"):
        candidates([WeightOption("x", 8, 32, 0.0, speed_dtype="float16")], [KV32], SPEEDS, CONFIG, n_proj=1, n_rest=1,
                   context=8, budget_bytes=1e9, kld_bound=1.0)
    with pytest.raises(ValueError, match="seconds"):
        candidates([FP32], [KV32], {"float32": {1: 0.0}}, CONFIG, n_proj=1, n_rest=1, context=8, budget_bytes=1e9,
                   kld_bound=1.0)


def test_speculative_decoding_pays_only_where_it_measured_faster():
    measured = {"repetitive": {"speedup": 1.8, "tokens_per_pass": 2.6}, "free text": {"speedup": 0.9, "tokens_per_pass": 1.1}}
    assert speculative_verdict(measured, 1, "repetitive").pays
    assert not speculative_verdict(measured, 1, "free text").pays
    later = speculative_verdict(measured, 4, "repetitive")
    assert not later.pays and "batch 1" in later.reason
    with pytest.raises(ValueError, match="workload"):
        speculative_verdict(measured, 1, "poetry")


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
