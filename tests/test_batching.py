"""Chapter 04 simulator and helpers: knee, step cost, workload, static vs continuous, figures."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import pytest

from course_utils.batching import (RooflinePoint, StepCost, SweepPoint, cache_step_bytes, decode_intensity, decode_step_sweep,
                                   doubling_gains, find_knee, knees_per_round, paged_kv_bytes, policy_gantt,
                                   reserved_kv_bytes, roofline_crossover_batch, roofline_sweep,
                                   round_preserving_total, simulate, skewed_lengths, sweep_figure,
                                   sweep_step_copies_cache, syllabus_output_lengths, time_block_gather)
from course_utils.models import ModelDims, model_dims

REF_TOK_S = [7.0, 13.0, 25.0, 41.0, 42.0 * 1.0, 45.78, 50.0]   # flattens after 8


def test_find_knee_is_where_doubling_stops_paying_for_good():
    b = [1, 2, 4, 8, 16, 32, 64]
    assert find_knee(b, REF_TOK_S) == 8
    ref_like = [1.0, 1.95, 3.6, 4.7, 6.0, 6.54, 6.8]              # 1 -> 16: x6.0; 16 -> 32: +9 %
    assert find_knee(b, ref_like) == 16
    assert find_knee(b, [2.0 ** i for i in range(7)]) is None     # every doubling doubles throughput
    assert find_knee([1, 4], [1.0, 1.4]) == 1                       # 1.4x over two doublings = 18 % each
    noisy = [1.0, 1.1, 2.2, 4.4, 8.0, 8.5, 8.6]                      # a dip at 1 -> 2 does not end the search
    assert find_knee(b, noisy) == 16


def test_find_knee_rejects_bad_input():
    with pytest.raises(ValueError, match="increasing"):
        find_knee([4, 2], [1.0, 2.0])
    with pytest.raises(ValueError, match="one throughput"):
        find_knee([1, 2, 4], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        find_knee([1, 2], [1.0, 0.0])


def test_step_cost_interpolates_measured_points_and_never_decreases():
    cost = StepCost((1, 2, 4, 8), (0.10, 0.12, 0.11, 0.20))
    assert cost(1) == pytest.approx(0.10)
    assert cost(2) == pytest.approx(0.12)
    assert cost(4) == pytest.approx(0.12)                          # the dip at 4 is treated as noise
    assert cost(6) == pytest.approx(0.16)
    assert cost(16) == pytest.approx(0.20 + 8 * (0.20 - 0.12) / 4)  # the last slope continues
    with pytest.raises(ValueError, match="batch"):
        cost(0)
    with pytest.raises(ValueError, match="positive"):
        StepCost((1, 2), (0.1, 0.0))
    pts = [SweepPoint(1, 0.1, 0.0), SweepPoint(4, 0.2, 0.01)]
    assert StepCost.from_sweep(pts)(4) == pytest.approx(0.2)


def test_syllabus_workload_has_the_stated_statistics():
    lengths = syllabus_output_lengths()
    assert len(lengths) == 64 and np.median(lengths) == 18 and lengths.max() == 231 and lengths.sum() == 1874
    assert lengths.min() >= 1 and (lengths == 231).sum() == 1
    assert np.array_equal(lengths, syllabus_output_lengths())       # fixed seed: the same every time
    other = syllabus_output_lengths(seed=3)
    assert not np.array_equal(lengths, other) and other.sum() == 1874 and np.median(other) == 18
    with pytest.raises(ValueError, match="cannot build"):
        syllabus_output_lengths(total=100)


def test_round_preserving_total():
    out = round_preserving_total([0.4, 0.4, 0.2, 2.0], 3)
    assert out.sum() == 3 and list(out) == [1, 0, 0, 2]
    with pytest.raises(ValueError, match="summing"):
        round_preserving_total([0.5, 0.6], 3)


def test_skew_blends_towards_equal_lengths_and_keeps_the_total():
    base = syllabus_output_lengths()
    assert np.array_equal(skewed_lengths(base, 1.0), base)
    flat = skewed_lengths(base, 0.0)
    assert flat.max() - flat.min() <= 1 and flat.sum() == base.sum()
    for skew in (0.1, 0.35, 0.8):
        mixed = skewed_lengths(base, skew)
        assert mixed.sum() == base.sum() and flat.max() <= mixed.max() <= base.max()
    with pytest.raises(ValueError, match="skew"):
        skewed_lengths(base, 1.5)
    with pytest.raises(ValueError, match="base"):
        skewed_lengths([], 0.5)


def test_simulate_by_hand():
    one = lambda b: 1.0  # noqa: E731  a step costs one second whatever the batch
    static = simulate([1, 3, 2, 2], 2, "static", one)
    assert [s.heard_s for s in static.spans] == [3, 3, 5, 5]
    assert [s.end_s for s in static.spans] == [1, 3, 5, 5]
    cont = simulate([1, 3, 2, 2], 2, "continuous", one)
    assert [(s.slot, s.start_s, s.heard_s) for s in cont.spans] == [(0, 0, 1), (1, 0, 3), (0, 1, 3), (0, 3, 5)]
    assert static.mean_latency_s == 4 and cont.mean_latency_s == 3
    assert static.throughput_tok_s == cont.throughput_tok_s == pytest.approx(8 / 5)
    # the admission clock: static batches start at 0 and 3, continuous requests at 0, 0, 1, 3
    assert list(static.latencies_from_admission_s) == [3, 3, 2, 2] and static.mean_latency_from_admission_s == 2.5
    assert list(cont.latencies_from_admission_s) == [1, 3, 2, 2] and cont.mean_latency_from_admission_s == 2
    assert list(cont.generating_s) == [1, 3, 2, 2]
    # padding: request 0 is done at 1 but heard at 3; requests 2 and 3 end together
    assert static.padding_share == pytest.approx(2 / (3 + 3 + 2 + 2)) and cont.padding_share == 0


def test_equal_lengths_leave_static_batching_nothing_to_pad():
    cost = StepCost((1, 8, 64), (0.1, 0.15, 0.5))
    even = simulate([20] * 16, 8, "static", cost)
    assert even.padding_share == 0
    skewed = simulate(syllabus_output_lengths()[:16], 8, "static", cost)
    assert skewed.padding_share > 0.3


def test_static_padding_costs_more_when_steps_grow_with_the_batch():
    lengths, cost = [1, 10, 1, 10], (lambda b: 1.0 + b)
    padded = simulate(lengths, 2, "static", cost)
    unpadded = simulate(lengths, 2, "static", cost, static_padding=False)
    assert padded.makespan_s == 2 * 10 * 3 and unpadded.makespan_s == 2 * (3 + 9 * 2)


def test_simulations_serve_every_request_once_without_overlaps():
    lengths = syllabus_output_lengths()
    cost = StepCost((1, 8, 64), (0.1, 0.15, 0.5))
    for policy in ("static", "continuous"):
        sched = simulate(lengths, 8, policy, cost)
        assert sorted(s.request for s in sched.spans) == list(range(64)) and sched.tokens == 1874
        assert all(0 <= s.slot < 8 and s.start_s < s.end_s <= s.heard_s for s in sched.spans)
        for slot in range(8):
            spans = sorted((s.start_s, s.end_s) for s in sched.spans if s.slot == slot)
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    static, cont = (simulate(lengths, 8, p, cost) for p in ("static", "continuous"))
    assert cont.throughput_tok_s > static.throughput_tok_s and cont.mean_latency_s < static.mean_latency_s
    assert cont.p95_latency_s < static.p95_latency_s
    with pytest.raises(ValueError, match="policy"):
        simulate(lengths, 8, "fifo", cost)
    with pytest.raises(ValueError, match="slots"):
        simulate(lengths, 0, "static", cost)


def test_the_widget_function_redraws_with_new_data_and_the_same_traces():
    lengths, cost = syllabus_output_lengths(), StepCost((1, 8, 64), (0.1, 0.15, 0.5))
    eight, four = policy_gantt(lengths, 8, 1.0, cost), policy_gantt(lengths, 4, 1.0, cost)
    assert isinstance(eight, go.Figure) and len(eight.data) == len(four.data) == 4
    assert [t.type for t in eight.data] == [t.type for t in four.data]
    assert list(eight.data[2].y) != list(four.data[2].y)        # the slots moved
    assert max(eight.data[0].y) == 7 and max(four.data[0].y) == 3
    flat = policy_gantt(lengths, 8, 0.0, cost)
    assert list(flat.data[0].x) != list(eight.data[0].x)
    assert "continuous batching" in eight.layout.title.text


def test_paged_and_reserved_bytes():
    assert paged_kv_bytes([1, 16, 17], 16, 10) == (1 + 1 + 2) * 16 * 10
    assert reserved_kv_bytes(3, 2048, 10) == 3 * 2048 * 10
    with pytest.raises(ValueError):
        paged_kv_bytes([3], 0, 10)
    with pytest.raises(ValueError):
        reserved_kv_bytes(1, 0, 10)


def test_decode_step_sweep_runs_on_a_tiny_model(tiny_model):
    points = decode_step_sweep(tiny_model, (1, 2, 4), context_len=8, repeats=2, progress=False)
    assert [p.batch for p in points] == [1, 2, 4]
    assert all(p.step_s > 0 and p.spread_s >= 0 and p.tokens_per_s == p.batch / p.step_s for p in points)
    assert all(len(p.samples_s) == 2 and p.step_s == pytest.approx(np.median(p.samples_s)) for p in points)
    fig = sweep_figure(points, find_knee([1, 2, 4], [p.tokens_per_s for p in points]))
    assert len(fig.data) == 2
    roof = roofline_sweep(tiny_model, (1, 2, 4), context_len=8, peak_flops=1e10, bandwidth_Bps=1e10)
    assert len(sweep_figure(points, None, roof).data) == 4
    with pytest.raises(ValueError, match="batch sizes"):
        sweep_figure(points, None, roof[:2])
    with pytest.raises(ValueError, match="increasing"):
        decode_step_sweep(tiny_model, (4, 2), progress=False)
    with pytest.raises(ValueError, match="context_len"):
        decode_step_sweep(tiny_model, (1,), context_len=0, progress=False)


def _points(rounds: list[list[float]], batches=(1, 2, 4, 8)) -> list[SweepPoint]:
    """Sweep points from per-round step times (rounds[r][i]: round r, batch i)."""
    per_batch = list(zip(*rounds))
    return [SweepPoint(b, float(np.median(t)), (max(t) - min(t)) / 2, tuple(t)) for b, t in zip(batches, per_batch)]


def test_doubling_gains_pair_the_rounds_and_report_their_range():
    # round 0: every step costs the same (throughput doubles); round 1: the step doubles from 4 to 8
    pts = _points([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 2.0]])
    gains = doubling_gains(pts)
    assert [(g.b1, g.b2) for g in gains] == [(1, 2), (2, 4), (4, 8)]
    assert gains[0].median == pytest.approx(1.0) and gains[0].low == gains[0].high == pytest.approx(1.0)
    assert gains[2].low == pytest.approx(0.0) and gains[2].high == pytest.approx(1.0)
    assert knees_per_round(pts, min_gain=0.25) == [None, 4]
    with pytest.raises(ValueError, match="per-round samples"):
        doubling_gains([SweepPoint(1, 0.1, 0.0), SweepPoint(2, 0.1, 0.0)])


def test_roofline_sweep_follows_the_larger_of_two_floors(tiny_llama):
    from course_utils.prefill_decode import decode_step_bytes, forward_flops
    peak, bw = 1e9, 1e9
    pts = roofline_sweep(tiny_llama, (1, 2, 4, 64), context_len=8, peak_flops=peak, bandwidth_Bps=bw)
    for p in pts:
        assert p.compute_s == pytest.approx(forward_flops(tiny_llama, 1, 8, batch=p.batch) / peak)
        once = decode_step_bytes(tiny_llama, 8, batch=p.batch)          # weights once and the cache read once
        kv = p.batch * 8 * model_dims(tiny_llama.config).kv_elements_per_token * tiny_llama.get_input_embeddings().weight.element_size()
        # the sweep's cache grows by a copy: read 8 positions, write 9, attention reads the 9 again
        assert p.memory_s == pytest.approx((once + 2 * kv * 9 / 8) / bw)
        assert p.memory_s > once / bw * (1 + 1e-9)
        assert p.step_s == max(p.compute_s, p.memory_s) and p.bound == ("compute" if p.compute_s >= p.memory_s else "memory")
    b = roofline_crossover_batch(tiny_llama, context_len=8, peak_flops=peak, bandwidth_Bps=bw)
    below, at = (roofline_sweep(tiny_llama, [x], context_len=8, peak_flops=peak, bandwidth_Bps=bw)[0] for x in (b - 1, b))
    assert below.bound == "memory" and at.bound == "compute"
    # a machine with a huge compute roof never becomes compute-bound within reach
    assert roofline_crossover_batch(tiny_llama, context_len=8, peak_flops=1e30, bandwidth_Bps=bw, max_batch=1024) is None
    with pytest.raises(ValueError, match="peak_flops"):
        roofline_sweep(tiny_llama, (1,), context_len=8, peak_flops=0, bandwidth_Bps=bw)


def test_cache_passes_charge_the_copy_a_concatenating_cache_makes(tiny_llama):
    from course_utils.prefill_decode import decode_step_bytes
    per_pos = model_dims(tiny_llama.config).kv_elements_per_token * tiny_llama.get_input_embeddings().weight.element_size()
    assert cache_step_bytes(tiny_llama, 8, batch=3, cache_passes=1) == 3 * 8 * per_pos
    assert cache_step_bytes(tiny_llama, 8, batch=3) == 3 * (8 + 9 + 9) * per_pos
    once = roofline_sweep(tiny_llama, (1, 4), context_len=8, peak_flops=1e9, bandwidth_Bps=1e9, cache_passes=1)
    assert [p.memory_s for p in once] == pytest.approx([decode_step_bytes(tiny_llama, 8, batch=b) / 1e9 for b in (1, 4)])
    three = roofline_crossover_batch(tiny_llama, context_len=8, peak_flops=1e9, bandwidth_Bps=1e9)
    one = roofline_crossover_batch(tiny_llama, context_len=8, peak_flops=1e9, bandwidth_Bps=1e9, cache_passes=1)
    assert one is not None and (three is None or three >= one)
    with pytest.raises(ValueError, match="cache_passes"):
        cache_step_bytes(tiny_llama, 8, batch=1, cache_passes=2)


def test_the_sweeps_cache_grows_by_a_copy(tiny_model):
    # transformers' DynamicCache concatenates: the step's cache lives in fresh storage, hence three passes
    assert sweep_step_copies_cache(tiny_model) is True


def test_decode_intensity_is_about_the_batch_for_two_byte_weights():
    dims = ModelDims(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab_size=100)
    assert decode_intensity(dims, 10**6, bytes_per_weight=2, batch=1, context_len=0) == pytest.approx(1.0, rel=1e-3)
    assert decode_intensity(dims, 10**6, bytes_per_weight=4, batch=8, context_len=0) == pytest.approx(4.0, rel=1e-3)
    long = decode_intensity(dims, 10**6, bytes_per_weight=2, batch=32, context_len=4096)
    assert long < 32                                         # the caches' bytes grow with the batch too
    assert decode_intensity(dims, 10**6, bytes_per_weight=2, batch=32, context_len=4096, cache_passes=3) < long
    with pytest.raises(ValueError, match="batch"):
        decode_intensity(dims, 10**6, bytes_per_weight=2, batch=0, context_len=0)


def test_time_block_gather_counts_the_copied_bytes(tiny_model):
    cost = time_block_gather(tiny_model, batch=3, context_len=20, block_size=8, repeats=2)
    dims = tiny_model.config
    per_position = 2 * dims.num_key_value_heads * (dims.hidden_size // dims.num_attention_heads) * 4   # k and v, fp32
    blocks = 3 * 3                                             # 21 positions in blocks of 8, three sequences
    assert cost.copied_bytes == dims.num_hidden_layers * blocks * 8 * per_position
    assert cost.step_s > 0 and cost.gather_s > 0 and 0 < cost.share < 1        # the gathers are part of the step


def test_decode_step_grid_times_every_format_batch_and_context_that_fits(tiny_llama):
    from transformers import DynamicCache

    from course_utils.batching import decode_step_grid
    from course_utils.kv_quant import KVQuantSpec, QuantizedKVCache
    seen = []

    def quantized():
        seen.append(QuantizedKVCache(tiny_llama.config, KVQuantSpec(4, group_size=8)))
        return seen[-1]
    caches = {"float": lambda: DynamicCache(config=tiny_llama.config), "int4": quantized}
    points = decode_step_grid(tiny_llama, (1, 4), (8, 24), caches=caches, max_tokens=40, repeats=2, progress=False)
    assert {(p.cache, p.batch, p.context) for p in points} == {
        (c, b, n) for c in caches for b, n in [(1, 8), (4, 8), (1, 24)]}          # 4 x 24 = 96 > 40: skipped
    assert all(p.step_s > 0 and len(p.samples_s) == 2 for p in points)
    # the stored tokens, then steps_per_fill (2) timed steps on the same fill; a warm-up step before them in round 1
    assert [c.get_seq_length() for c in seen if c.quantized_tokens == 24] == [24 + 1 + 2, 24 + 2]
    seen.clear()
    decode_step_grid(tiny_llama, (1,), (24,), caches=caches, repeats=3, warmup_rounds=0, progress=False)
    assert [c.get_seq_length() for c in seen] == [24 + 2] * 3
    with pytest.raises(ValueError, match="warmup_rounds"):
        decode_step_grid(tiny_llama, (1,), (8,), warmup_rounds=-1, progress=False)
    with pytest.raises(ValueError, match="fits"):
        decode_step_grid(tiny_llama, (4,), (24,), max_tokens=40, progress=False)
    with pytest.raises(ValueError, match="caches"):
        decode_step_grid(tiny_llama, (1,), (8,), caches={"x": 3}, progress=False)
    with pytest.raises(ValueError, match="steps_per_fill"):
        decode_step_grid(tiny_llama, (1,), (8,), steps_per_fill=0, progress=False)


@pytest.mark.parametrize("kind", ["float", "int4 keys per channel", "int2 keys per token"])
def test_copied_requests_hold_what_filling_every_request_holds_bit_for_bit(tiny_llama, kind):
    """The grid fills one request per format and context and copies it to B requests: the same numbers (and, for a
    quantized cache, the same codes, steps and minimums) as filling the B requests, and the one request untouched."""
    import torch
    from transformers import DynamicCache

    from course_utils.batching import copied_requests, fill_cache, prefilled_layers
    from course_utils.kv_quant import KVQuantSpec, QuantizedKVCache
    specs = {"int4 keys per channel": KVQuantSpec(4, 8, "channel", "token"),
             "int2 keys per token": KVQuantSpec(2, 8, "token", "token")}
    empty = (lambda: DynamicCache(config=tiny_llama.config)) if kind == "float" else \
        (lambda: QuantizedKVCache(tiny_llama.config, specs[kind]))
    _, layers = prefilled_layers(tiny_llama, 8)
    one = fill_cache(empty(), layers, 1, 20)                       # 20 tokens: two whole groups of 8 and 4 left over
    before = [(la.keys.clone(), la.values.clone()) for la in one.layers]
    for b in (1, 3):
        got, want = copied_requests(one, b), fill_cache(empty(), layers, b, 20)
        for g, w in zip(got.layers, want.layers):
            assert torch.equal(g.keys, w.keys) and torch.equal(g.values, w.values)
            assert g.keys.stride() == w.keys.stride() and g.values.stride() == w.values.stride()   # the same layout
            for gs, ws in zip(getattr(g, "stored_keys", []) + getattr(g, "stored_values", []),
                              getattr(w, "stored_keys", []) + getattr(w, "stored_values", [])):
                assert all(torch.equal(getattr(gs, f), getattr(ws, f)) and getattr(gs, f).stride() == getattr(ws, f).stride()
                           for f in ("codes", "step", "minimum"))
                assert gs.shape == ws.shape and gs.n_codes == ws.n_codes
        assert got.get_seq_length() == want.get_seq_length() == 20
    assert all(torch.equal(la.keys, k) and torch.equal(la.values, v) for la, (k, v) in zip(one.layers, before))
    with pytest.raises(ValueError, match="one request"):
        copied_requests(fill_cache(empty(), layers, 2, 20), 2)


def test_knee_range_says_what_the_rounds_support_not_the_medians():
    from course_utils.batching import KneeRange, knee_range
    none, four, two = [1, 1, 1, 1], [1, 1, 1, 2], [1, 1, 2, 4]     # step times at B = 1, 2, 4, 8: knees None, 4, 2
    split = _points([none, four, four])
    assert find_knee([1, 2, 4, 8], [p.tokens_per_s for p in split]) == 4    # the medians alone name one knee ...
    kr = knee_range(split)
    assert kr.knees == (None, 4, 4) and not kr.agreed and kr.low == 4 and kr.high is None   # ... one round finds none
    assert "no firm knee: 2 of 3 rounds put it at B = 4, 1 find" in kr.describe() and kr.contains(None) and kr.contains(8) and not kr.contains(2)
    title = sweep_figure(split, kr).layout.title.text
    assert "knee at B = 4" not in title and "no firm knee" in title
    spread = knee_range(_points([two, four, four]))
    assert (spread.low, spread.high) == (2, 4) and "from B = 2 to B = 4" in spread.describe()
    assert spread.contains(4) and not spread.contains(8) and not spread.contains(None)
    same = knee_range(_points([four, four, four]))
    assert same.agreed and "B = 4 in every one of the 3 rounds" in same.describe()
    assert "at B = 4 in every one of the 3 rounds" in sweep_figure(_points([four] * 3), same).layout.title.text
    assert "no knee up to B = 8" in knee_range(_points([none, none])).describe()
    assert KneeRange((None,), 8).low is None


def test_decode_step_sweep_alternates_the_order_of_the_batch_sizes(tiny_model, monkeypatch):
    import course_utils.batching.sweep as S
    seen, build = [], S._replicated_cache

    def recording(model, keys, values, batch):
        seen.append(batch)
        return build(model, keys, values, batch)

    monkeypatch.setattr(S, "_replicated_cache", recording)
    decode_step_sweep(tiny_model, (1, 2, 4), context_len=4, repeats=2, progress=False)
    assert seen == [1, 2, 4, 4, 2, 1, 1, 2, 4]                       # warm-up, then every other round reversed


class _Copy:
    live = peak = 0

    def __init__(self):
        _Copy.live += 1
        _Copy.peak = max(_Copy.peak, _Copy.live)

    def __del__(self):
        _Copy.live -= 1


class _Pool:
    def index_select(self, dim, index):
        return _Copy()


def test_block_gathers_free_each_layers_copies_before_the_next_as_the_step_does():
    from course_utils.batching import block_gathers
    _Copy.live = _Copy.peak = 0
    block_gathers([_Pool()] * 30, [_Pool()] * 30, None)()
    assert _Copy.peak == 2 and _Copy.live == 0           # one layer's keys and values, never 30 layers' at once
    with pytest.raises(ValueError, match="one key pool and one value pool per layer"):
        block_gathers([_Pool()], [], None)


def test_chapters_02_and_04_take_the_compute_roof_from_one_function():
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent / "notebooks"
    for name in ("02_prefill_decode.ipynb", "04_batching.ipynb"):
        code = "".join("".join(c["source"]) for c in json.loads((root / name).read_text())["cells"]
                       if c["cell_type"] == "code")
        assert "compute_roof" in code and "measure_matmul_flops(" not in code, name


def test_the_sweeps_title_gives_the_median_of_the_rounds_ratios():
    pts = _points([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 2.0], [3.0, 1.0, 1.0, 2.0]])   # B = 8 vs B = 1: x8, x4, x12
    assert pts[-1].tokens_per_s / pts[0].tokens_per_s == 4.0                          # the ratio of the medians
    assert "bring 8.0x the throughput and 1.0x the latency" in sweep_figure(pts, None).layout.title.text
