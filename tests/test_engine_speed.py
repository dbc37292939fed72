"""The engine's speed measurements (course_utils.engine.speed): what they report is what they claim to measure.

No timing is asserted (timings are the benchmark's); the quality figures, the profile's bookkeeping and the
errors are."""
from __future__ import annotations

import math

import pytest
import torch

from course_utils.engine import RunnerWeights
from course_utils.engine import speed as S
from course_utils.evaluate import mean_and_se, token_stats


def _prompts(vocab, n, length=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def test_operator_classes_name_each_operator_once():
    names = [n for names in S.OP_CLASSES.values() for n in names]
    assert len(names) == len(set(names))
    assert S.op_class("mkldnn::_linear_pointwise") == "matrix products"
    assert S.op_class("aten::index_select") == "paged cache (write, gather)"
    assert S.op_class("aten::argmax") == S.OTHER


@pytest.mark.parametrize("pack", ["int8", "int4"])
def test_a_fast_paths_reported_kld_is_that_of_its_dequantized_weights(tiny_llama, pack):
    """The KLD measure_path reports for a lossy path equals the KLD of transformers' forward pass with the
    de-quantised matrices in place (float32, so only the quantization differs), from the float32 reference."""
    from test_engine import _mimic_of_packing
    model = tiny_llama
    prompts, held = _prompts(model.config.vocab_size, 2), _prompts(model.config.vocab_size, 1, 40, seed=1)[0]
    ref, ref_logp = S.measure_path(model, "float32", "float32", "none", prompts=prompts, heldout_ids=held,
                                   new_tokens=3, rounds=1, batch=2)
    assert ref.kld is None and ref.positions == 0
    fast, _ = S.measure_path(model, pack, "float32", pack, prompts=prompts, heldout_ids=held, reference_logp=ref_logp,
                             new_tokens=3, rounds=1, batch=2)
    with torch.no_grad():
        ids = torch.tensor([held])
        want_ref = torch.log_softmax(model(ids).logits[0].float(), -1)
        want = torch.log_softmax(_mimic_of_packing(model, pack)(ids).logits[0].float(), -1)
    stats = token_stats(want_ref[:-1], want[:-1], torch.tensor(held[1:]))
    kld, se = mean_and_se(stats["kld"])
    assert kld > 0
    assert fast.kld == pytest.approx(kld, rel=1e-3, abs=1e-7)
    assert fast.kld_se == pytest.approx(se, rel=1e-2, abs=1e-7)
    assert fast.same_top == pytest.approx(float(stats["same_top"].double().mean()), abs=1.5 / len(held))
    assert fast.positions == len(held) - 1
    assert fast.weight_bytes < ref.weight_bytes
    for f in (ref, fast):
        assert all(math.isfinite(x) and x > 0 for x in (f.step_s, f.floor_s, f.batch_step_s, f.tokens_per_s))
        assert len(f.step_samples) == 2                           # 1 round of 3 tokens: 2 decode steps


def test_measure_paths_takes_the_first_path_as_the_reference(tiny_qwen2):
    model = tiny_qwen2
    figs = S.measure_paths(model, [("a", "float32", "none"), ("b", "float32", "none")],
                           prompts=_prompts(model.config.vocab_size, 2), heldout_ids=list(range(20)),
                           new_tokens=2, rounds=1, batch=2)
    assert figs[0].kld is None
    assert figs[1].kld == pytest.approx(0.0, abs=1e-9) and figs[1].same_top == 1.0   # the same path, the same logits


def test_the_profile_counts_every_matrix_product_of_a_step(tiny_model):
    """4 products per layer and the LM head, per decode step; the classes and the time between them add up to
    the profiled steps."""
    model = tiny_model
    engine = S.path_engine(model, RunnerWeights.from_model(model, "float32"), 1, 10, 5)
    p = S.profile_decode(engine, _prompts(model.config.vocab_size, 1), 5, label="tiny")
    assert p.steps == 4
    assert p.calls_per_step["matrix products"] == 4 * model.config.num_hidden_layers + 1
    assert p.calls_per_step["attention"] == model.config.num_hidden_layers
    assert all(v >= 0 for v in p.ms_per_step.values()) and p.ms_per_step["matrix products"] > 0
    assert set(p.ms_per_step) == set(S.CLASSES)
    fig = S.profile_figure([p])
    assert len(fig.data) == len(p.ms_per_step) + 1
    assert "run" not in engine.runner.__dict__


def _chunked_engine(model, budget, prompt_len, *, prefix_caching=False):
    from course_utils.engine import LLMEngine
    return LLMEngine(model, num_blocks=-(-prompt_len // 16) + 2, block_size=16, max_num_seqs=1,
                     prefix_caching=prefix_caching, weights=RunnerWeights.from_model(model, "float32"),
                     chunked_prefill=True, max_num_batched_tokens=budget)


def test_the_prefill_profile_counts_every_chunk_steps_products_and_flops(tiny_model):
    """A 32-token prompt in 16-token chunks: two steps, each with 4 products per layer and the LM head, one
    attention call per layer; the classes add up to the profiled step; the products' FLOPs are 2 x tokens x the
    model's layer weights plus 2 x the LM head's (one row per step)."""
    model = tiny_model
    engine = _chunked_engine(model, 16, 32)
    p = S.profile_prefill(engine, _prompts(model.config.vocab_size, 1, 32), label="tiny", roof_flops=1e9)
    assert p.steps == 2 and p.prompt_tokens == 16
    assert p.calls_per_step["matrix products"] == 4 * model.config.num_hidden_layers + 1
    assert p.calls_per_step["attention"] == model.config.num_hidden_layers
    assert set(p.ms_per_step) == set(S.CLASSES)
    assert all(v >= 0 for v in p.ms_per_step.values()) and p.ms_per_step["matrix products"] > 0
    operators = sum(v for k, v in p.ms_per_step.items() if k != S.PYTHON)
    assert operators <= p.total_ms + 1e-9                       # the operators fit inside the step's range
    step_ms = p.profiled_step_s * 1e3                            # the engine's clock around the same two steps
    assert p.total_ms == pytest.approx(step_ms, rel=0.25, abs=0.5)
    layer_weights = sum(m.weight.numel() for layer in model.model.layers for m in layer.modules()
                        if isinstance(m, torch.nn.Linear))
    flops = 2 * (16 * layer_weights + model.get_output_embeddings().weight.numel())
    assert p.matrix_flops == pytest.approx(flops)
    assert p.floor_s == pytest.approx(flops / 1e9)
    assert p.step_s > 0
    assert "run" not in engine.runner.__dict__
    assert S.profile_prefill(engine, _prompts(model.config.vocab_size, 1, 32)).floor_s is None


def test_the_prefill_profile_refuses_what_it_cannot_measure(tiny_llama):
    vocab = tiny_llama.config.vocab_size
    engine = _chunked_engine(tiny_llama, 16, 32)
    with pytest.raises(ValueError, match="non-empty list"):
        S.profile_prefill(engine, [])
    with pytest.raises(ValueError, match="refused a prompt"):
        S.profile_prefill(engine, [[]])
    with pytest.raises(ValueError, match="roof_flops must be > 0"):
        S.profile_prefill(engine, _prompts(vocab, 1, 32), roof_flops=0.0)
    with pytest.raises(ValueError, match="prefix_caching=False"):
        S.profile_prefill(_chunked_engine(tiny_llama, 16, 32, prefix_caching=True), _prompts(vocab, 1, 32))
    assert "run" not in engine.runner.__dict__


def test_bad_input_is_refused_with_a_clear_error(tiny_llama):
    prompts = _prompts(tiny_llama.config.vocab_size, 2)
    with pytest.raises(ValueError, match="at least batch"):
        S.measure_path(tiny_llama, "x", "float32", "none", prompts=prompts, heldout_ids=[1, 2, 3], batch=4)
    with pytest.raises(ValueError, match="new_tokens must be at least 2"):
        S.measure_path(tiny_llama, "x", "float32", "none", prompts=prompts, heldout_ids=[1, 2, 3], new_tokens=1,
                       batch=2)
    with pytest.raises(ValueError, match="heldout_ids"):
        S.measure_path(tiny_llama, "x", "float32", "none", prompts=prompts, heldout_ids=[1], batch=2)
    with pytest.raises(ValueError, match="pack must be one of"):
        S.measure_path(tiny_llama, "x", "float32", "int3", prompts=prompts, heldout_ids=[1, 2, 3], batch=2)


def test_the_runners_bfloat16_norm_is_transformers_bit_for_bit(tiny_llama):
    """RMSNorm in bfloat16 as transformers computes it (normalised in float32, rounded, then scaled)."""
    from course_utils.engine import ModelRunner
    runner = ModelRunner(tiny_llama, num_blocks=4, block_size=4, dtype="bfloat16")
    norm = tiny_llama.model.layers[0].input_layernorm
    w = (torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(0)) + 1).to(torch.bfloat16)
    ref = type(norm)(norm.weight.shape[0], eps=norm.variance_epsilon).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(w)
        for scale in (1e-2, 1.0, 300.0):
            x = (torch.randn(9, w.shape[0], generator=torch.Generator().manual_seed(1)) * scale).to(torch.bfloat16)
            assert torch.equal(runner._rms_norm(x, w), ref(x))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_packing_a_matrix_slice_by_slice_changes_nothing(monkeypatch, kind):
    """pack_matrix quantizes a slice of rows at a time (bounded temporaries); the result is the whole matrix's."""
    from course_utils.engine import packed
    w = torch.randn(448, 256, generator=torch.Generator().manual_seed(0))
    whole = packed.pack_matrix(w, kind, torch.float32, keep_w_hat=True)
    monkeypatch.setattr(packed, "_CHUNK_ELEMENTS", 64 * 256)            # 64-row slices
    sliced = packed.pack_matrix(w, kind, torch.float32, keep_w_hat=True)
    for a, b in ((whole.codes, sliced.codes), (whole.scales, sliced.scales), (whole.w_hat, sliced.w_hat)):
        assert torch.equal(a, b)
    x = torch.randn(3, 256)
    assert torch.equal(whole(x), sliced(x))


def test_the_exact_bf16_packing_is_read_from_the_paths_given():
    assert S.fastest_exact_bf16(S.PATHS) == "onednn"
    assert S.fastest_exact_bf16([p for p in S.PATHS if p[2] != "onednn"]) == "upcast"
    assert S.fastest_exact_bf16([p for p in S.PATHS if p[2] not in ("onednn", "upcast")]) == "none"


def test_the_upcast_path_is_offered_only_where_pytorchs_bf16_product_is_slow(monkeypatch):
    from course_utils.engine import packed
    upcast = [p for p in S.PATHS if p[2] == "upcast"]
    for slow in (True, False):
        monkeypatch.setattr(packed, "bf16_products_are_slow", lambda device, slow=slow: slow)
        assert S.available_paths("cpu", upcast) == (upcast if slow else [])
    assert not packed.bf16_products_are_slow("meta")                # a GPU's (or any non-CPU) product is its own


def test_each_lever_is_measured_against_the_path_it_builds_on():
    def fig(label):
        return S.PathFigures(label, "bfloat16", "none", 1.0, 1.0, 1, 1, 1.0)
    assert set(S.LEVERS) == {label for label, _, _ in S.PATHS[1:]}
    figs = [fig(label) for label, _, _ in S.PATHS]
    pairs = {f.label: base.label for f, base, _ in S.ablation(figs)}
    assert pairs["int8 weights, bf16 activations"] == "bfloat16, oneDNN-prepacked"     # not the compiled row before it
    assert pairs["bfloat16, compiled decode step"] == "bfloat16, oneDNN-prepacked"
    assert pairs["bfloat16, batch products in float32"] == "bfloat16"
    assert pairs["int4 weights, bf16 activations"] == "int8 weights, bf16 activations"
    avx2 = [f for f in figs if f.label != "bfloat16, oneDNN-prepacked"]        # a CPU without oneDNN's bf16 kernels
    pairs = {f.label: base.label for f, base, _ in S.ablation(avx2)}
    assert pairs["bfloat16, compiled decode step"] == "bfloat16, batch products in float32"
    assert pairs["int8 weights, bf16 activations"] == "bfloat16, batch products in float32"
    avx512 = [f for f in figs if f.label != "bfloat16, batch products in float32"]
    pairs = {f.label: base.label for f, base, _ in S.ablation(avx512)}
    assert pairs["bfloat16, compiled decode step"] == "bfloat16, oneDNN-prepacked"
    neither = [f for f in avx2 if f.label != "bfloat16, batch products in float32"]
    pairs = {f.label: base.label for f, base, _ in S.ablation(neither)}
    assert pairs["int8 weights, bf16 activations"] == "bfloat16"                      # the last candidate
    assert len(S.ablation(figs[:1])) == 0
