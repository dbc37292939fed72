"""The compiled decode step (course_utils.engine.compiled, ``pack="compiled"``): the same computation as the eager
runner, padded batch and all, and the quality the speed measurement reports comes from the compiled step itself.

Compiling takes seconds even for the tiny models, so these tests compile few shapes; no timing is asserted."""
from __future__ import annotations

import pytest
import torch

from course_utils.engine import LLMEngine, RunnerWeights
from course_utils.engine import compiled as C
from course_utils.engine import speed as S

pytestmark = pytest.mark.skipif(not S.available_paths("cpu", [("c", "float32", "compiled")]),
                                reason="torch.compile's inductor needs a C++ compiler")


def _prompts(vocab, n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(autouse=True)
def _empty_the_cache():
    yield
    C.release_compiled()


def test_compiled_decode_is_the_eager_computation_with_a_padded_batch(tiny_qwen2):
    """float32, 3 sequences of different lengths padded to a batch of 4: the same tokens as the eager engine, and
    every layer's keys and values written to the same slots (the step returns them; the runner stores them)."""
    model = tiny_qwen2
    prompts = [p[:n] for p, n in zip(_prompts(model.config.vocab_size, 3, 12), (5, 12, 9))]
    runs = {}
    for pack in ("none", "compiled"):
        engine = LLMEngine(model, num_blocks=16, block_size=4, max_num_seqs=4, prefix_caching=False,
                           weights=RunnerWeights.from_model(model, "float32", pack=pack))
        out = engine.generate(prompts, 6, ignore_eos=True)
        runs[pack] = ([s.output_ids for s in out], engine.runner)
    assert runs["compiled"][0] == runs["none"][0]
    eager, comp = runs["none"][1], runs["compiled"][1]
    assert comp.compiled.compile_s and all(b == 4 for b, _ in comp.compiled.compile_s)   # 3 rows padded to 4
    torch.testing.assert_close(comp.k_pool, eager.k_pool, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(comp.v_pool, eager.v_pool, rtol=1e-4, atol=1e-5)


def test_decode_logits_are_the_prefills_on_the_eager_path_and_close_on_the_compiled(tiny_llama):
    """decode_logits runs one decode step per position; on the eager path it computes what a prefill does."""
    model = tiny_llama
    ids = _prompts(model.config.vocab_size, 1, 14, seed=3)[0]
    logits = {}
    for pack in ("none", "compiled"):
        engine = LLMEngine(model, num_blocks=8, block_size=4, max_num_seqs=1,
                           weights=RunnerWeights.from_model(model, "float32", pack=pack))
        logits[pack] = engine.runner.decode_logits(ids)
        if pack == "none":
            torch.testing.assert_close(logits[pack], engine.runner.sequence_logits(ids), rtol=1e-4, atol=1e-5)
    assert logits["none"].shape == (len(ids), model.config.vocab_size)
    torch.testing.assert_close(logits["compiled"], logits["none"], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="need 1 to"):
        engine.runner.decode_logits([])


def test_the_compiled_paths_quality_is_measured_on_the_compiled_step(tiny_llama, monkeypatch):
    """measure_path reads a compiled path's logits from decode_logits (its own decode steps), not from a prefill."""
    from course_utils.engine.model_runner import ModelRunner
    model = tiny_llama
    prompts, held = _prompts(model.config.vocab_size, 2, 8), _prompts(model.config.vocab_size, 1, 12, seed=1)[0]
    _, ref = S.measure_path(model, "fp32", "float32", "none", prompts=prompts, heldout_ids=held, new_tokens=3,
                            rounds=1, batch=2)
    called = []
    real = ModelRunner.decode_logits
    monkeypatch.setattr(ModelRunner, "decode_logits", lambda self, ids: called.append(1) or real(self, ids))
    f, _ = S.measure_path(model, "bf16 compiled", "bfloat16", "compiled", prompts=prompts, heldout_ids=held,
                          reference_logp=ref, new_tokens=3, rounds=1, batch=2)
    assert called == [1]
    assert 0 < f.kld < 0.05 and f.positions == len(held) - 1
    assert f.compile_s and all(t > 0 for t in f.compile_s.values())


def test_the_shapes_a_step_is_padded_to():
    class R:
        num_blocks = 40
    c = C.CompiledDecode.__new__(C.CompiledDecode)
    c.runner, c.batch_sizes = R(), (1, 8)
    assert c.shape_for(1, 1) == (1, 4)
    assert c.shape_for(2, 5) == (8, 8)
    assert c.shape_for(8, 17) == (8, 32)
    assert c.shape_for(8, 39) == (8, 40)          # never more blocks than the pool has
    assert c.shape_for(9, 3) == (9, 4)            # more rows than the largest size: its own shape


def test_other_devices_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="CPU or a CUDA GPU"):
        C.check_compiler("mps")
    assert S.available_paths("meta", [("c", "float32", "compiled")]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_is_attention_over_each_sequences_blocks(dtype):
    """The compiled step's attention, run eagerly: the same as scaled_dot_product_attention over each sequence's
    context gathered in block order with this step's key and value put in, positions past it masked."""
    g = torch.Generator().manual_seed(0)
    S, W, bs, n_kv, grp, hd, slots = 3, 4, 4, 2, 2, 8, 64
    k_pool, v_pool = (torch.randn(slots, n_kv, hd, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(S, n_kv, grp, hd, generator=g).to(dtype)
    k, v = (torch.randn(S, n_kv, hd, generator=g).to(dtype) for _ in range(2))
    tables = torch.stack([torch.randperm(slots // bs, generator=g)[:W] for _ in range(S)])
    positions = torch.tensor([0, 6, 15])
    C_ = W * bs
    bias = torch.zeros(S, C_, dtype=dtype).masked_fill(torch.arange(C_)[None] > positions[:, None],
                                                       torch.finfo(dtype).min)
    out = C.paged_decode_attention(q, k, v, k_pool, v_pool, tables, positions, bias)
    for s in range(S):
        slot_ids = (tables[s][:, None] * bs + torch.arange(bs)).reshape(-1)
        keys, values = k_pool[slot_ids].clone(), v_pool[slot_ids].clone()
        keys[positions[s]], values[positions[s]] = k[s], v[s]
        n = int(positions[s]) + 1                                      # only the context up to this token
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[s].float(), keys[:n].float().transpose(0, 1), values[:n].float().transpose(0, 1))
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out[s].float(), ref.reshape(-1), **tol)


def test_batches_of_a_compiled_step_multiply_like_the_upcast_path_where_bf16_products_are_slow(tiny_llama,
                                                                                               monkeypatch):
    """On a CPU where PyTorch's bfloat16 product is slow, ``pack="compiled"`` holds ``"upcast"``'s matrices and its
    batch graphs multiply through ``course::upcast_linear``: the logits of a batch of 4 are the eager upcast
    path's, up to rounding (forced here on any CPU, with 2 rows as the threshold)."""
    from course_utils.engine import model_runner, packed
    monkeypatch.setattr(model_runner, "bf16_products_are_slow", lambda device: True)
    monkeypatch.setattr(C, "UPCAST_MIN_ROWS", 2)
    monkeypatch.setattr(packed, "UPCAST_MIN_ROWS", 2)
    model = tiny_llama
    prompts = [p[:n] for p, n in zip(_prompts(model.config.vocab_size, 4, 10), (4, 10, 7, 9))]
    runs = {}
    for pack in ("upcast", "compiled"):
        engine = LLMEngine(model, num_blocks=16, block_size=4, max_num_seqs=4, prefix_caching=False,
                           weights=RunnerWeights.from_model(model, "bfloat16", pack=pack))
        assert all(isinstance(m, packed.UpcastLinear) for m in engine.runner.step_matrices())
        for p in prompts:
            engine.add_request(p, 4, ignore_eos=True)
        engine.step()                                          # prefill of all four (eager on both paths)
        seqs, is_prefill = engine.scheduler.schedule()          # the decode step of all four, blocks appended
        assert len(seqs) == 4 and not is_prefill
        inp = engine.runner.prepare(seqs)
        runs[pack] = engine.runner.forward(inp).float()
        if pack == "compiled":
            assert engine.runner.compiled.module.upcast
            assert list(engine.runner.compiled.compile_s) == [(4, 4)]
    torch.testing.assert_close(runs["compiled"], runs["upcast"], rtol=0.05, atol=0.05 * runs["upcast"].abs().max())
