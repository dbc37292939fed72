"""The quantized KV cache holds its numbers at their bits (chapters 07 and 10)."""
from __future__ import annotations

import pytest
import torch

from course_utils.kv_quant import KVQuantSpec, QuantizedKVCache, StoredKV, fake_quantize_kv, stored_round_trip
from course_utils.memory_sizing import kv_cache_bytes


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_codes_give_back_exactly_the_fake_quantized_numbers(bits, axis, dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, 2, 40, 24) * 3).to(dtype)             # 40 tokens, 24 channels: groups of 16 pad on both axes
    spec = KVQuantSpec(bits, group_size=16)
    stored = StoredKV.store(x, spec, axis)
    assert stored.codes.dtype == torch.uint8 and stored.step.dtype == torch.float16
    back = stored.load(dtype)
    assert back.dtype == dtype and torch.equal(back, fake_quantize_kv(x, spec, axis))
    picked = stored.select(torch.tensor([2, 0]))
    assert torch.equal(picked.load(dtype), back[[2, 0]])


@pytest.mark.parametrize("bits,held", [(2, 2.5), (3, 4.5), (4, 4.5), (8, 8.5)])
def test_held_bits_count_the_code_slot_step_and_minimum(bits, held):
    assert KVQuantSpec(bits, 64).held_bits_per_element == held


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_cache_holds_what_the_formula_counts(tiny_llama, bits):
    spec = KVQuantSpec(bits, group_size=8)
    cache = QuantizedKVCache(tiny_llama.config, spec)
    ids = torch.randint(0, tiny_llama.config.vocab_size, (2, 32))
    with torch.no_grad():
        tiny_llama(ids, cache=cache)
    assert cache.quantized_tokens == 32
    assert cache.stored_bytes() == kv_cache_bytes(tiny_llama.config, 64, spec.held_bits_per_element)
    # a float cache of the same tokens holds several times more: the formula at float32 would not match
    assert kv_cache_bytes(tiny_llama.config, 64, "fp32") > 2.5 * cache.stored_bytes()


def test_a_quantized_cache_can_be_reordered_for_beam_search(tiny_llama):
    cache = QuantizedKVCache(tiny_llama.config, KVQuantSpec(4, group_size=8))
    ids = torch.randint(0, tiny_llama.config.vocab_size, (2, 19))
    with torch.no_grad():
        tiny_llama(ids, cache=cache)
    before = [layer.q_keys.clone() for layer in cache.layers]
    for layer in cache.layers:
        layer.batch_repeat_interleave(2)
    assert all(torch.equal(layer.q_keys, b.repeat_interleave(2, dim=0)) for layer, b in zip(cache.layers, before))
    assert cache.layers[0].keys.shape[0] == 4 and cache.get_seq_length() == 19


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_stored_round_trip_counts_the_bits_it_holds(bits, axis):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 32)                               # groups of 16 tile both axes
    spec = KVQuantSpec(bits, group_size=16)
    back, held = stored_round_trip(x, spec, axis)
    assert torch.equal(back, fake_quantize_kv(x, spec, axis))
    assert held == spec.held_bits_per_element == spec.bits_per_element == bits + 32 / 16
    # a group cut short is padded: the stored form then takes more than the spec's bits per element
    _, short = stored_round_trip(x[..., :40, :24], spec, axis)
    assert short > spec.bits_per_element


def test_stored_round_trip_rejects_bad_input():
    x = torch.randn(1, 2, 16, 16)
    with pytest.raises(ValueError, match="axis"):
        stored_round_trip(x, KVQuantSpec(4, 16), "head")
    with pytest.raises(ValueError):
        stored_round_trip(x[0], KVQuantSpec(4, 16), "token")
    with pytest.raises(ValueError):
        stored_round_trip(x[..., :0, :], KVQuantSpec(4, 16), "token")


@pytest.mark.parametrize("chunk, residual", [(8, 0), (16, 0), (12, 0), (8, 4), (5, 0)])
def test_exact_context_share_counts_what_the_cache_leaves_unquantized(tiny_llama, chunk, residual):
    """The share is checked against the scoring loop itself (`scored_logprobs`, two windows, context chunks that
    do not line up with the scored ones): a cache that records how many tokens it held quantized when each chunk
    arrived gives what each scored position read exact."""
    from course_utils.evaluate import Windows, scored_logprobs
    from course_utils.kv_quant import exact_context_share
    windows = Windows(n_tokens=60, window=50, stride=40, chunk=chunk)     # 10 context-only positions per window
    spec = KVQuantSpec(4, group_size=8)
    arrivals = []                                  # per window: (tokens held, of them quantized, new tokens)

    class Recording(QuantizedKVCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx == 0:
                arrivals[-1].append((self.layers[0].get_seq_length(), self.quantized_tokens, key_states.shape[-2]))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def factory():
        arrivals.append([])
        return Recording(tiny_llama.config, spec, residual=residual)

    ids = torch.randint(0, tiny_llama.config.vocab_size, (1, windows.tokens_needed))
    with torch.no_grad():
        for _ in scored_logprobs(tiny_llama, ids, windows, chunk=chunk, cache_factory=factory):
            pass
    shares, contexts = [], []
    for window in arrivals:
        for held, quantized, new in window:
            for t in range(held, held + new):
                if t >= windows.context_only:       # a scored position
                    shares.append((t + 1 - quantized) / (t + 1))
                    contexts.append(t + 1)
    assert len(shares) == windows.n_tokens
    got = exact_context_share(windows, chunk, 8, residual=residual)
    assert got["mean"] == pytest.approx(sum(shares) / len(shares))
    assert (got["min"], got["max"]) == (pytest.approx(min(shares)), pytest.approx(max(shares)))
    assert got["contexts"] == (min(contexts), max(contexts))
    with pytest.raises(ValueError, match="n_tokens"):
        exact_context_share(windows, chunk, 8, n_tokens=61)
