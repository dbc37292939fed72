"""Chapter 01: the cached loop is exact, the head step is exact, the MAC formulas match the FLOP counter."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from course_utils.kv_cache import (attention_macs, cache_nbytes, counted_macs, decode_one_token, generation_macs,
                                   greedy_cached, greedy_recompute, head_step_cached, head_step_recompute,
                                   macs_bytes_figure, macs_bytes_table, prefill, score_bytes,
                                   step_macs, step_seconds, weight_macs_per_token)
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
