"""Chapter 01: the cached loop is exact, the head step is exact, the MAC formulas match the FLOP counter."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from course_utils.kv_cache import (attention_crossover_tokens, attention_macs, cache_nbytes, counted_macs,
                                   decode_one_token, generation_macs, greedy_cached, greedy_recompute,
                                   head_step_cached, head_step_recompute, lm_head_macs, local_slopes, logits_bytes,
                                   macs_bytes_figure, macs_bytes_table, power_law_slope, prefill, scaling_figure,
                                   score_bytes, step_macs, step_seconds, weight_macs_per_token)
from course_utils.models import model_dims


def _prompt(tok, text="The capital of France is"):
    return tok(text, return_tensors="pt").input_ids


def test_cached_and_recomputed_greedy_tokens_are_identical_on_the_embedded_model(embedded):
    model, tok = embedded
    ids = _prompt(tok, "Once upon a time, in a small village by the sea,")
    slow = greedy_recompute(model, ids, 24)
    fast = greedy_cached(model, ids, 24)
    assert slow.shape == (1, 24)
    assert torch.equal(slow, fast)
    reference = model.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[:, ids.shape[1]:]
    assert torch.equal(fast, reference)


def test_cached_and_recomputed_agree_on_other_architectures(tiny_model):
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    assert torch.equal(greedy_recompute(tiny_model, ids, 20), greedy_cached(tiny_model, ids, 20))


def test_step_times_are_recorded(tiny_llama):
    ids = torch.tensor([[1, 2, 3]])
    slow, fast = [], []
    greedy_recompute(tiny_llama, ids, 5, step_s=slow)
    greedy_cached(tiny_llama, ids, 5, step_s=fast)
    assert len(slow) == 5 and len(fast) == 5 and all(s > 0 for s in slow + fast)


@pytest.mark.parametrize("ids,n,match", [
    (torch.tensor([1, 2, 3]), 4, "input_ids must be"),
    (torch.ones(2, 3, dtype=torch.long), 4, "input_ids must be"),
    (torch.ones(1, 0, dtype=torch.long), 4, "prompt is empty"),
    (torch.ones(1, 3, dtype=torch.long), 0, "max_new_tokens"),
    (torch.ones(1, 3, dtype=torch.long), -2, "max_new_tokens"),
])
def test_generation_rejects_bad_input(tiny_llama, ids, n, match):
    for fn in (greedy_recompute, greedy_cached):
        with pytest.raises(ValueError, match=match):
            fn(tiny_llama, ids, n)


def test_cache_bytes_equal_the_formula(tiny_model):
    dims = model_dims(tiny_model.config)
    cache = DynamicCache(config=tiny_model.config)
    prefill(tiny_model, torch.arange(11).unsqueeze(0), cache)
    assert cache_nbytes(cache) == dims.kv_elements_per_token * 11 * 4
    decode_one_token(tiny_model, torch.tensor([[3]]), cache)
    assert cache_nbytes(cache) == dims.kv_elements_per_token * 12 * 4


@pytest.mark.parametrize("n", [1, 2, 17, 300])
def test_head_step_cached_equals_last_row_of_recompute(n):
    g = torch.Generator().manual_seed(n)
    d = 64
    wq, wk, wv = (torch.randn(d, d, generator=g) / d ** 0.5 for _ in range(3))
    x = torch.randn(n, d, generator=g)
    full = head_step_recompute(x, wq, wk, wv)
    step, k, v = head_step_cached(x[-1:], x[:-1] @ wk, x[:-1] @ wv, wq, wk, wv)
    torch.testing.assert_close(step.out, full.out, rtol=1e-5, atol=1e-5)
    assert full.scores.shape == (n, n) and step.scores.shape == (1, n)
    assert full.scores.nbytes == score_bytes(n, cached=False) and step.scores.nbytes == score_bytes(n, cached=True)
    assert k.shape == (n, d) and v.shape == (n, d)


def test_score_bytes_of_the_reference_example():
    assert score_bytes(4096, cached=False) == 67_108_864     # "67 MB"
    assert score_bytes(4096, cached=True) == 16_384          # "16 KB" = 16 KiB


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2", "embedded"])
def test_mac_formulas_match_torch_flop_counter(request, model_fixture):
    model = request.getfixturevalue(model_fixture)
    model = model[0] if isinstance(model, tuple) else model
    dims, w = model_dims(model.config), weight_macs_per_token(model)
    n = 9
    ids = torch.arange(1, n + 1).unsqueeze(0)
    assert counted_macs(model, lambda: model(ids, use_cache=False)) == step_macs(n, dims, w, cached=False)
    assert counted_macs(model, lambda: model(ids, use_cache=False, logits_to_keep=1)) == \
        step_macs(n, dims, w, cached=False, last_logits_only=True)
    cache = DynamicCache(config=model.config)
    prefill(model, ids[:, :-1], cache)
    assert counted_macs(model, lambda: decode_one_token(model, ids[:, -1:], cache)) == step_macs(n, dims, w, cached=True)
    assert model.config._attn_implementation != "eager" or model_fixture != "embedded"


def test_weight_macs_count_a_tied_head_once(embedded, tiny_llama):
    assert weight_macs_per_token(embedded[0]) == 134_479_872
    untied = sum(p.numel() for p in tiny_llama.parameters() if p.dim() == 2) - tiny_llama.get_input_embeddings().weight.numel()
    assert weight_macs_per_token(tiny_llama) == untied


def test_step_and_generation_growth():
    dims = model_dims({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    w = 10_000
    assert step_macs(10, dims, w, cached=True) == w + attention_macs(1, 10, dims)
    assert step_macs(10, dims, w, cached=False) == 10 * w + attention_macs(10, 10, dims)
    ratios = [generation_macs(8, t, dims, w, cached=False) / generation_macs(8, t, dims, w, cached=True)
              for t in (4, 16, 64, 256)]
    assert ratios == sorted(ratios) and ratios[-1] > 10 * ratios[0]
    # one new token: both ways are one pass over the prompt
    assert generation_macs(8, 1, dims, w, cached=True) == generation_macs(8, 1, dims, w, cached=False)


@pytest.mark.parametrize("call", [
    lambda d: step_macs(0, d, 10, cached=True),
    lambda d: step_macs(-3, d, 10, cached=False),
    lambda d: generation_macs(0, 5, d, 10, cached=True),
    lambda d: score_bytes(-1, cached=True),
    lambda d: score_bytes(4.5, cached=False),
    lambda d: attention_macs(-1, 4, d),
])
def test_counting_rejects_bad_sizes(call):
    dims = model_dims({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    with pytest.raises(ValueError):
        call(dims)


def test_widget_figure_is_a_pure_function_of_n():
    dims = model_dims({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576})
    a, b = macs_bytes_figure(64, dims, 1000), macs_bytes_figure(2048, dims, 1000)
    table = macs_bytes_table(2048, dims, 1000)
    assert list(b.data[0].y) == [table[k]["recompute"] or None for k in table]
    assert list(b.data[1].y) == [table[k]["KV cache"] for k in table]
    assert a.data[0].y != b.data[0].y and a.layout.title.text != b.layout.title.text
    assert macs_bytes_figure(64, dims, 1000).to_dict() == a.to_dict()


def test_step_seconds_shapes_and_errors(tiny_llama):
    out = step_seconds(tiny_llama, torch.arange(40).unsqueeze(0) % 100, [4, 8], repeats=1)
    assert len(out["recompute"]) == 2 and len(out["cached"]) == 2
    with pytest.raises(ValueError):
        step_seconds(tiny_llama, torch.arange(5).unsqueeze(0), [8])


SMOL = model_dims({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
                   "vocab_size": 49152})


def test_causal_attention_counts_the_pairs_the_mask_keeps():
    dims = model_dims({"num_hidden_layers": 1, "num_attention_heads": 1, "hidden_size": 4})   # 2·L·h·d = 8
    assert attention_macs(3, 3, dims) == 8 * 9
    assert attention_macs(3, 3, dims, causal=True) == 8 * (1 + 2 + 3)
    assert attention_macs(1, 10, dims, causal=True) == attention_macs(1, 10, dims) == 8 * 10
    assert attention_macs(2, 5, dims, causal=True) == 8 * (4 + 5)
    with pytest.raises(ValueError, match="n_queries <= n_keys"):
        attention_macs(4, 3, dims, causal=True)


def test_last_logits_only_takes_the_head_out_of_all_but_one_position():
    w = 134_479_872
    head = lm_head_macs(SMOL)
    assert head == 49152 * 576
    for n in (1, 7, 256):
        assert step_macs(n, SMOL, w, cached=False) - step_macs(n, SMOL, w, cached=False, last_logits_only=True) == \
            (n - 1) * head
    with pytest.raises(ValueError, match="vocab_size"):
        lm_head_macs(model_dims({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}))


@pytest.mark.parametrize("last_logits_only", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_crossover_is_the_first_length_where_attention_outweighs_the_weights(last_logits_only, causal):
    w = 134_479_872
    n = attention_crossover_tokens(SMOL, w, last_logits_only=last_logits_only, causal=causal)

    def terms(m):
        attention = attention_macs(m, m, SMOL, causal=causal)
        return attention, step_macs(m, SMOL, w, cached=False, last_logits_only=last_logits_only, causal=causal) - attention
    attention, weights = terms(n)
    assert attention >= weights
    attention, weights = terms(n - 1)
    assert attention < weights


def test_crossover_of_the_embedded_model_by_the_closed_form():
    w = 134_479_872
    per_pair = 2 * 30 * 9 * 64
    assert attention_crossover_tokens(SMOL, w) == -(-w // per_pair)              # n = W / (2 L h d), rounded up
    assert attention_crossover_tokens(SMOL, w, last_logits_only=True) < attention_crossover_tokens(SMOL, w)
    assert attention_crossover_tokens(SMOL, w, last_logits_only=True, causal=True) > \
        attention_crossover_tokens(SMOL, w, last_logits_only=True)
    assert attention_crossover_tokens(SMOL, 1) == 1
    with pytest.raises(ValueError):
        attention_crossover_tokens(SMOL, 0)


def test_generation_macs_with_last_logits_only():
    w = 134_479_872
    full = generation_macs(10, 5, SMOL, w, cached=False)
    last = generation_macs(10, 5, SMOL, w, cached=False, last_logits_only=True)
    assert full - last == sum(10 + t - 1 for t in range(5)) * lm_head_macs(SMOL)
    assert generation_macs(10, 5, SMOL, w, cached=True) - generation_macs(10, 5, SMOL, w, cached=True,
                                                                          last_logits_only=True) == 9 * lm_head_macs(SMOL)


def test_logits_bytes():
    assert logits_bytes(256, SMOL) == 256 * 49152 * 4
    qwen = model_dims({"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896,
                       "vocab_size": 151936})
    assert logits_bytes(256, qwen, bytes_per_element=2) == 77_791_232                 # the "~78 MB" of the source's model
    with pytest.raises(ValueError):
        logits_bytes(0, SMOL)


def test_power_law_slopes():
    x = [16, 32, 64, 128]
    assert power_law_slope(x, [3 * v for v in x]) == pytest.approx(1.0)
    assert power_law_slope(x, [0.5 * v * v for v in x]) == pytest.approx(2.0)
    assert local_slopes(x, [1, 2, 8, 16]) == pytest.approx([1.0, 2.0, 1.0])
    for x_bad, y_bad in (([1], [1]), ([1, 2], [0, 2]), ([1, 2], [-1.0, 2.0]), ([1, 2], [1])):
        with pytest.raises(ValueError):
            power_law_slope(x_bad, y_bad)
    with pytest.raises(ValueError, match="increasing"):
        local_slopes([2, 1], [1, 2])
    with pytest.raises(ValueError, match="two different"):
        power_law_slope([2, 2], [1, 2])


def test_growth_reading_tells_half_from_one_from_two():
    from course_utils.kv_cache import growth_reading
    assert growth_reading(0.51) == "more slowly than n"          # a step paid for by reading the weights, not "like n"
    assert growth_reading(1.0) == "about like n"
    assert growth_reading(1.5) == "between n and n²"
    assert growth_reading(1.97) == growth_reading(2.0) == "about like n²"
    assert growth_reading(2.6) == "faster than n²"
    # the step times of a recomputed step that grew 4.1x over 16x the context (MACs about 17x) read as sublinear
    contexts, step_ms = [16, 32, 64, 128, 256], [54.6, 63.0, 85.0, 130.0, 225.7]
    assert growth_reading(power_law_slope(contexts, step_ms)) == "more slowly than n"
    for bad in (float("nan"), float("inf"), "1", None, True):
        with pytest.raises(ValueError, match="finite number"):
            growth_reading(bad)


def test_scaling_figure_labels_fitted_slopes_and_draws_guides():
    x = [1, 2, 4]
    fig = scaling_figure(x, {"a": [1, 4, 16], "b": [2, 4, 8]}, title="t", x_title="n", y_title="ms")
    names = [t.name for t in fig.data]
    assert names[:2] == ["a (fitted slope 2.00)", "b (fitted slope 1.00)"]
    assert list(fig.data[2].y) == [1, 2, 4] and list(fig.data[3].y) == [1, 4, 16]      # ∝ n and ∝ n² through (1, 1)
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
