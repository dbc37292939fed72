"""Chapter 02: serving metrics from arrival times, the timing helpers, the streamed generation."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import DynamicCache

from course_utils import prefill_decode as pd
from course_utils.kv_cache import decode_one_token, greedy_cached, prefill
from course_utils.models import model_dims
from course_utils.prompts import chat_prompt_ids

# --- metrics on hand-made arrival times -----------------------------------------------------------------

ARRIVALS = [0.5, 0.6, 0.8, 1.1]          # seconds since the request was sent


def test_metrics_on_hand_made_times():
    assert pd.ttft_s(ARRIVALS) == 0.5
    assert pd.inter_token_gaps_s(ARRIVALS) == pytest.approx([0.1, 0.2, 0.3])
    assert pd.tpot_s(ARRIVALS) == pytest.approx((1.1 - 0.5) / 3)
    assert pd.tpot_s(ARRIVALS, end_s=1.4) == pytest.approx((1.4 - 0.5) / 3)
    assert pd.hf_inter_token_latency_s(ARRIVALS) == pytest.approx(0.2)
    m = pd.stream_metrics(ARRIVALS)
    assert (m.n_tokens, m.ttft_s, m.e2e_s) == (4, 0.5, 1.1)
    assert m.tpot_s == pytest.approx(0.2) and m.hf_inter_token_latency_s == pytest.approx(m.tpot_s)
    assert m.decode_tokens_per_s == pytest.approx(5.0)
    assert m.output_tokens_per_s == pytest.approx(4 / 1.1)
    assert m.itl_median_s == pytest.approx(0.2)
    assert m.itl_p99_s == pytest.approx(0.2 + 0.98 * 0.1)           # linear interpolation, as numpy does
    assert isinstance(m.tpot_s, float) and isinstance(m.ttft_s, float)


def test_end_after_last_token_changes_tpot_not_hf_itl():
    m = pd.stream_metrics(ARRIVALS, end_s=1.4)
    assert m.e2e_s == 1.4 and m.tpot_s == pytest.approx(0.3) and m.hf_inter_token_latency_s == pytest.approx(0.2)


def test_tokens_in_one_chunk_have_zero_gaps():
    assert pd.inter_token_gaps_s([0.2, 0.2, 0.5]) == pytest.approx([0.0, 0.3])


@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=2, max_size=50))
def test_tpot_is_the_mean_gap_when_the_response_ends_with_its_last_token(times):
    times = sorted(times)
    gaps = pd.inter_token_gaps_s(times)
    assert pd.tpot_s(times) == pytest.approx(sum(gaps) / len(gaps), abs=1e-12)
    assert pd.tpot_s(times) == pytest.approx(pd.hf_inter_token_latency_s(times), abs=1e-12)


@pytest.mark.parametrize("bad", [[], [0.3], [0.5, 0.4], [0.1, 0.3, 0.2], [-0.1, 0.2], [0.1, float("nan")],
                                 [0.1, float("inf")]])
@pytest.mark.parametrize("fn", [pd.ttft_s, pd.tpot_s, pd.inter_token_gaps_s, pd.hf_inter_token_latency_s,
                                pd.stream_metrics])
def test_bad_arrival_times_are_rejected(fn, bad):
    with pytest.raises(ValueError):
        fn(bad)


def test_end_before_last_token_is_rejected():
    with pytest.raises(ValueError, match="end_s"):
        pd.tpot_s(ARRIVALS, end_s=1.0)


def test_predicted_latency():
    assert pd.predicted_latency_s(0.5, 0.2, 10) == pytest.approx(0.5 + 9 * 0.2)
    assert pd.predicted_latency_s(0.5, 0.2, 1) == 0.5
    for bad in [(0.5, 0.2, 0), (-1.0, 0.2, 3), (0.5, float("nan"), 3), (0.5, 0.2, 2.5)]:
        with pytest.raises(ValueError):
            pd.predicted_latency_s(*bad)


def test_repeats_for_and_floor():
    assert pd.repeats_for(16, repeats=3, token_budget=2048) == 3
    assert pd.repeats_for(1024, repeats=3, token_budget=2048) == 2
    assert pd.repeats_for(4096, repeats=3, token_budget=2048) == 1
    with pytest.raises(ValueError):
        pd.repeats_for(0, repeats=3, token_budget=2048)
    assert pd.decode_floor_s(500, 1000.0) == 0.5
    with pytest.raises(ValueError):
        pd.decode_floor_s(500, 0.0)


# --- the timing helpers keep the cache exact ------------------------------------------------------------

def test_timed_decode_step_sees_exactly_c_cached_tokens(tiny_model):
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (1, 40))
    cache = DynamicCache(config=tiny_model.config)
    prefill(tiny_model, ids[:, :32], cache)
    timing = pd.time_decode_step(tiny_model, cache, ids[:, 32:33], warmup=1, repeats=3)
    assert cache.get_seq_length() == 32
    fresh = DynamicCache(config=tiny_model.config)
    prefill(tiny_model, ids[:, :32], fresh)
    expected = decode_one_token(tiny_model, ids[:, 32:33], fresh)
    torch.testing.assert_close(timing.result, expected)


def test_sweeps_return_every_length_in_order(tiny_model):
    ids = torch.randint(0, 128, (1, 70))
    points = pd.prefill_sweep(tiny_model, ids, [64, 16, 32], repeats=2, token_budget=40)
    assert [p.n_tokens for p in points] == [16, 32, 64]
    assert [len(p.timing.samples_s) for p in points] == [2, 1, 1]
    assert all(p.per_token_s == p.median_s / p.n_tokens and p.timing.result is None for p in points)
    steps = pd.decode_sweep(tiny_model, ids, [64, 8, 16], repeats=2)
    assert [p.n_tokens for p in steps] == [8, 16, 64]
    with pytest.raises(ValueError):
        pd.decode_sweep(tiny_model, ids, [70])
    with pytest.raises(ValueError):
        pd.prefill_sweep(tiny_model, ids, [])


def test_weight_matvec_reads_every_matrix_a_step_multiplies(tiny_model):
    timing = pd.weight_matvec_s(tiny_model, repeats=1)
    matrices = pd.step_weight_matrices(tiny_model)
    assert len(timing.result) == len(matrices)
    embed = tiny_model.get_input_embeddings().weight
    tied = tiny_model.config.tie_word_embeddings
    # untied: the embedding table is only looked up (one row), so it is not among the matrices; tied: it is the LM head
    assert any(m is embed for m in matrices) == tied
    assert len(matrices) == len({m.data_ptr() for m in matrices})


def test_decode_step_bytes_counts_weights_once_one_embedding_row_and_the_cache(tiny_model):
    dims = model_dims(tiny_model.config)
    embed = tiny_model.get_input_embeddings().weight
    weights = sum(p.nbytes for p in {p.data_ptr(): p for p in tiny_model.parameters()}.values())
    expected = weights if tiny_model.config.tie_word_embeddings else weights - embed.nbytes + 2 * embed[0].nbytes
    assert pd.decode_step_bytes(tiny_model, 0, batch=2) == expected
    assert pd.decode_step_bytes(tiny_model, 10, batch=2) - pd.decode_step_bytes(tiny_model, 0, batch=2) == \
        2 * 10 * dims.kv_elements_per_token * 4
    with pytest.raises(ValueError, match="context_tokens"):
        pd.decode_step_bytes(tiny_model, -1)


# --- a real streamed generation ----------------------------------------------------------------------------

def test_token_clock_skips_the_prompt():
    clock = pd.TokenClock(t0=0.0)
    clock.put(torch.tensor([[5, 6, 7]]))         # the prompt
    clock.put(torch.tensor([8]))
    clock.put(torch.tensor([9]))
    clock.end()
    assert clock.token_ids == [8, 9] and len(clock.arrival_s) == 2
    assert clock.arrival_s[0] <= clock.arrival_s[1] <= clock.end_s
    assert len(clock.cpu_s) == 2 and clock.cpu_s[0] <= clock.cpu_s[1]


def test_cores_busy_per_gap_is_cpu_seconds_over_wall_seconds():
    arrivals, cpu = [0.5, 0.6, 0.9], [1.0, 1.2, 1.35]        # 2 cores busy, then 0.15 CPU s over 0.3 s
    assert pd.cores_busy_per_gap(arrivals, cpu) == pytest.approx([2.0, 0.5])
    with pytest.raises(ValueError, match="one non-decreasing CPU time per arrival"):
        pd.cores_busy_per_gap(arrivals, cpu[:2])
    with pytest.raises(ValueError, match="non-decreasing"):
        pd.cores_busy_per_gap(arrivals, [1.0, 0.9, 1.0])
    with pytest.raises(ValueError, match="share a timestamp"):
        pd.cores_busy_per_gap([0.5, 0.5, 0.9], cpu)


def test_stream_generate_times_the_greedy_tokens(embedded):
    model, tok = embedded
    record = pd.stream_generate(model, tok, "What is the capital of France?", 5)
    ids = torch.tensor([chat_prompt_ids(tok, "What is the capital of France?")])
    assert record.prompt_tokens == ids.shape[1]
    assert record.token_ids == greedy_cached(model, ids, 5)[0].tolist()
    assert len(record.arrival_s) == 5 and record.arrival_s == sorted(record.arrival_s)
    assert record.arrival_s[-1] <= record.end_s
    assert len(record.cpu_s) == 5 and record.cpu_s == sorted(record.cpu_s)
    m = pd.stream_metrics(record.arrival_s, record.end_s)
    assert m.n_tokens == 5 and 0 < m.ttft_s <= m.e2e_s


# --- widget ---------------------------------------------------------------------------------------------------

def test_latency_figure_predicts_from_measurements():
    prefill_s = {16: 0.1, 64: 0.2, 256: 0.5}
    fig = pd.latency_figure(64, 11, prefill_s=prefill_s, tpot=0.1)
    bars = [t for t in fig.data if t.type == "bar"]
    assert sum(b.y[0] for b in bars) == pytest.approx(0.2 + 10 * 0.1)
    assert "1.20 s predicted" in fig.layout.title.text
    with pytest.raises(ValueError, match="measured lengths"):
        pd.latency_figure(100, 11, prefill_s=prefill_s, tpot=0.1)
    assert math.isclose(fig.data[1].y[0], 0.2)


# --- the roofline ----------------------------------------------------------------------------------------------

def test_forward_flops_are_twice_the_mac_formula_and_the_flop_counter(tiny_model):
    from course_utils.kv_cache import counted_macs, step_macs, weight_macs_per_token
    dims, w = model_dims(tiny_model.config), weight_macs_per_token(tiny_model)
    assert pd.forward_flops(tiny_model, 9) == 2 * step_macs(9, dims, w, cached=False)
    assert pd.forward_flops(tiny_model, 1, 8) == 2 * step_macs(9, dims, w, cached=True)
    assert pd.forward_flops(tiny_model, 1, 8, batch=3) == 3 * pd.forward_flops(tiny_model, 1, 8)
    ids = torch.arange(1, 10).unsqueeze(0)
    assert 2 * counted_macs(tiny_model, lambda: tiny_model(ids, use_cache=False)) == pd.forward_flops(tiny_model, 9)
    for bad in [(0, 0), (1, -1)]:
        with pytest.raises(ValueError):
            pd.forward_flops(tiny_model, *bad)


def test_prefill_flops_count_the_pass_that_is_timed(tiny_model):
    """The prefill timed in chapter 02 keeps the last position's logits: its count must match that pass, not
    a forward pass that computes every position's logits."""
    from transformers import DynamicCache

    from course_utils.kv_cache import attention_macs, counted_macs, lm_head_macs, prefill
    dims, p = model_dims(tiny_model.config), 9
    ids = torch.arange(1, p + 1).unsqueeze(0)
    counted = 2 * counted_macs(tiny_model, lambda: prefill(tiny_model, ids, DynamicCache(config=tiny_model.config)))
    assert counted == pd.prefill_flops(tiny_model, p, causal=False)       # eager attention: the full rectangle
    assert pd.forward_flops(tiny_model, p) - counted == 2 * (p - 1) * lm_head_macs(dims)   # all logits: not what is timed
    masked_pairs = p * (p - 1) // 2
    assert pd.prefill_flops(tiny_model, p, causal=False) - pd.prefill_flops(tiny_model, p) == \
        2 * attention_macs(1, 1, dims) * masked_pairs
    assert pd.prefill_flops(tiny_model, p, batch=2) == 2 * pd.prefill_flops(tiny_model, p)
    assert pd.forward_flops(tiny_model, 1, 8, last_logits_only=True, causal=True) == pd.forward_flops(tiny_model, 1, 8)
    with pytest.raises(ValueError):
        pd.prefill_flops(tiny_model, 0)


def test_the_timed_prefill_asks_sdpa_for_a_causal_kernel(tiny_model, monkeypatch):
    """Counting only the unmasked pairs assumes the kernel is told the mask is causal (it can then skip blocks)."""
    from transformers import DynamicCache

    from course_utils.kv_cache import prefill
    if tiny_model.config._attn_implementation != "sdpa":
        pytest.skip("the model does not use scaled_dot_product_attention")
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("is_causal"), kwargs.get("attn_mask")))
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    prefill(tiny_model, torch.arange(1, 10).unsqueeze(0), DynamicCache(config=tiny_model.config))
    assert seen and all(causal is True and mask is None for causal, mask in seen)


def test_prefill_bytes_are_weights_once_rows_and_the_keys_values_written(tiny_model):
    dims = model_dims(tiny_model.config)
    embed = tiny_model.get_input_embeddings().weight
    tied = tiny_model.config.tie_word_embeddings
    one = pd.prefill_bytes(tiny_model, 1)
    assert pd.prefill_bytes(tiny_model, 11) - one == 10 * (dims.kv_elements_per_token * 4 + (0 if tied else embed[0].nbytes))
    assert one == pd.decode_step_bytes(tiny_model, 0) + dims.kv_elements_per_token * 4


def test_roofline_takes_the_binding_roof():
    peak, bw = 100e9, 10e9                              # ridge at 10 FLOP/byte
    assert pd.ridge_intensity(peak, bw) == 10
    assert pd.arithmetic_intensity(50, 100) == 0.5
    assert pd.roofline_s(1e9, 1e9, peak_flops=peak, bandwidth_Bps=bw) == pytest.approx(0.1)    # memory-bound
    assert pd.roofline_s(1e12, 1e9, peak_flops=peak, bandwidth_Bps=bw) == pytest.approx(10.0)  # compute-bound
    assert pd.attainable_flops(1, peak_flops=peak, bandwidth_Bps=bw) == 10e9
    assert pd.attainable_flops(1000, peak_flops=peak, bandwidth_Bps=bw) == peak
    with pytest.raises(ValueError):
        pd.roofline_s(1e9, 1e9, peak_flops=0, bandwidth_Bps=bw)
    with pytest.raises(ValueError):
        pd.arithmetic_intensity(1.0, 0)
    with pytest.raises(ValueError):
        pd.attainable_flops(float("nan"), peak_flops=peak, bandwidth_Bps=bw)


def test_roofline_figure_draws_both_roofs_and_every_point():
    peak, bw = 100e9, 10e9
    points = {"prefill": [(50.0, 60e9, "P=64")], "decode": [(0.5, 2e9, "C=16"), (0.6, 2.1e9, "C=64")]}
    fig = pd.roofline_figure(points, peak_flops=peak, bandwidth_Bps=bw, title="t")
    roof, prefill_trace, decode_trace, ridge = fig.data
    assert max(roof.y) == pytest.approx(100.0) and min(roof.y) == pytest.approx(min(roof.x) * 10)   # GFLOP/s
    assert 10.0 in list(roof.x)                                                     # the ridge is on the line
    assert list(decode_trace.x) == [0.5, 0.6] and list(decode_trace.y) == pytest.approx([2.0, 2.1])
    assert list(prefill_trace.text) == ["P=64"] and list(decode_trace.customdata) == ["C=16", "C=64"]
    assert list(ridge.x) == [10.0] and list(ridge.y) == [100.0]
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    with pytest.raises(ValueError):
        pd.roofline_figure(points, peak_flops=0, bandwidth_Bps=bw, title="t")


def test_cache_append_pass_copies_the_whole_history_and_keeps_the_length(tiny_model):
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (1, 20))
    cache = DynamicCache(config=tiny_model.config)
    prefill(tiny_model, ids, cache)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    ptrs = [layer.keys.data_ptr() for layer in cache.layers]
    pd.cache_append_pass(cache)()
    assert cache.get_seq_length() == 20
    for layer, (k, v) in zip(cache.layers, before):
        torch.testing.assert_close(layer.keys, k)
        torch.testing.assert_close(layer.values, v)
    # DynamicCache appends by concatenation: every layer's history now lives in new storage (it was copied)
    assert all(layer.keys.data_ptr() != p for layer, p in zip(cache.layers, ptrs))
    with pytest.raises(ValueError, match="at least one position"):
        pd.cache_append_pass(DynamicCache(config=tiny_model.config))
