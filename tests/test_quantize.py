"""Tests for course_utils.quantize (chapter 05): error bounds, exactness, bits, bad input."""
from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from course_utils import quantize as Q
from course_utils.models import ModelDims
from course_utils.hooks import projection_modules
from course_utils.quantize import Scheme

# bitsandbytes' NF4 table (bitsandbytes/functional.py, get_4bit_type("nf4")), as published
BNB_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
           -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
           0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
           0.7229568362236023, 1.0]

FAST = settings(max_examples=40, deadline=None)

# Weight-like matrices: entries 0 or with |w| in [2^-10, 8]; shapes (rows, groups * group) with small sizes.
_entry = st.one_of(st.just(0.0), st.floats(2.0 ** -10, 8.0, width=32), st.floats(-8.0, -(2.0 ** -10), width=32))


@st.composite
def matrices(draw, group_size: int = 4):
    rows = draw(st.integers(1, 6))
    cols = group_size * draw(st.integers(1, 5))
    values = draw(st.lists(_entry, min_size=rows * cols, max_size=rows * cols))
    return torch.tensor(values, dtype=torch.float32).reshape(rows, cols)


_kinds = st.sampled_from(["absmax", "minmax", "nf4"])
_grans = st.sampled_from(["tensor", "row", "group"])


def _scheme(kind, bits, gran, g=4):
    return Scheme(kind, 4 if kind == "nf4" else bits, gran, g)


# --- properties -------------------------------------------------------------------------------

@FAST
@given(w=matrices(), kind=_kinds, bits=st.integers(2, 8), gran=_grans)
def test_every_error_within_half_a_step(w, kind, bits, gran):
    scheme = _scheme(kind, bits, gran)
    err = (w - Q.fake_quantize(w, scheme)).abs()
    half = Q.level_spacing(w, scheme) / 2
    slack = 4 * torch.finfo(torch.float32).eps * w.abs().max()   # rounding inside de-quantisation
    assert (err <= half + slack).all(), (err - half).max()


@FAST
@given(w=matrices(), bits=st.integers(2, 8))
def test_step_is_ordered_group_row_tensor(w, bits):
    step = {g: Q.level_spacing(w, Scheme("absmax", bits, g, 4)) for g in ("group", "row", "tensor")}
    assert (step["group"] <= step["row"]).all()
    assert (step["row"] <= step["tensor"]).all()


@FAST
@given(w=matrices(), kind=_kinds, bits=st.integers(2, 8), gran=_grans)
def test_requantizing_dequantised_weights_is_exact(w, kind, bits, gran):
    scheme = _scheme(kind, bits, gran)
    once = Q.fake_quantize(w, scheme)
    assert torch.equal(Q.fake_quantize(once, scheme), once)


@pytest.mark.parametrize("w, scheme", [
    (torch.tensor([[0.0] * 7 + [2.0 ** -10]]), Scheme("minmax", 7, "tensor")),   # a step below fp16's normal range
    (torch.tensor([[1.00095, 1.00096, 1.000955, 1.00095]]), Scheme("minmax", 8, "row")),  # narrow, far from zero
    (torch.tensor([[-3.0, 1e-30, 2.5, 0.0]]), Scheme("absmax", 8, "row")),
])
def test_requantizing_edge_cases_is_exact(w, scheme):
    once = Q.fake_quantize(w, scheme)
    assert torch.equal(Q.fake_quantize(once, scheme), once)
    assert ((w - once).abs() <= Q.level_spacing(w, scheme) / 2 + 1e-6).all()


@FAST
@given(w=matrices(group_size=3), kind=_kinds)
def test_padding_is_a_shorter_last_group(w, kind):
    # rows of 3k weights in groups of 2 (pad=True): each row's last group holds one weight
    padded = Scheme(kind, 4, "group", 2, pad=True)
    got = Q.fake_quantize(w, padded)
    if w.shape[1] > 1:
        head = Q.fake_quantize(w[:, : w.shape[1] - w.shape[1] % 2], Scheme(kind, 4, "group", 2))
        assert torch.equal(got[:, : head.shape[1]], head)
    tail = Q.fake_quantize(w[:, -(w.shape[1] % 2 or 2):].contiguous(), Scheme(kind, 4, "row"))
    assert torch.equal(got[:, -tail.shape[1]:], tail)


def test_absmax_matches_the_three_line_version():
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    qmax = 7
    a = Q.fp16_ceil(w.abs().max()).float()
    three_lines = torch.round(w / a * qmax) / qmax * a
    assert torch.equal(Q.fake_quantize(w, Scheme("absmax", 4, "tensor")), three_lines)


def test_levels_used_and_histogram_count_codes():
    w = torch.tensor([[-1.0, -0.5, 0.0, 0.5, 1.0, 1.0, 0.0, 0.0]])
    qt = Q.quantize(w, Scheme("absmax", 2, "row"))           # levels -1, 0, 1
    assert Q.levels_used(qt) == {"overall": 3, "available": 3, "per_block_median": 3.0, "per_block_max": 3}
    assert Q.code_histogram(qt).tolist() == [1, 5, 2, 0]    # -0.5 and 0.5 round to even: 0


def test_nbytes_counts_packed_codes_and_fp16_numbers():
    qt = Q.quantize(torch.randn(8, 64), Scheme("minmax", 4, "group", 32))
    assert qt.nbytes == 8 * 64 // 2 + 2 * 2 * 16
    assert Q.bits_per_weight(qt.scheme, (8, 64)) == qt.nbytes * 8 / (8 * 64)


# --- NF4 ---------------------------------------------------------------------------------------

def _nf4_from_normal_quantiles() -> list[float]:
    """QLoRA's construction, rebuilt here with Python's statistics.NormalDist (no torch)."""
    inv = statistics.NormalDist().inv_cdf
    offset = 0.5 * ((1 - 1 / 30) + (1 - 1 / 32))
    pos = [inv(offset + (0.5 - offset) * i / 8) for i in range(8)]
    neg = [-inv(offset + (0.5 - offset) * i / 7) for i in range(7)]
    levels = sorted(pos + neg + [0.0])
    return [v / max(levels) for v in levels]


def test_nf4_levels_match_bitsandbytes_to_four_decimals():
    derived = _nf4_from_normal_quantiles()
    assert derived == pytest.approx(BNB_NF4, abs=5e-5)
    assert Q.nf4_levels().tolist() == pytest.approx(BNB_NF4, abs=5e-5)
    assert len(set(Q.nf4_levels().tolist())) == 16


def test_nf4_rounds_to_the_nearest_level():
    levels = Q.nf4_levels()
    x = torch.linspace(-1, 1, 1001).reshape(1, -1)
    got = Q.fake_quantize(x, Scheme("nf4", 4, "tensor"))
    nearest = levels[(x.reshape(-1, 1) - levels).abs().argmin(1)].reshape(1, -1)
    assert torch.allclose(got, nearest, atol=1e-6)


# --- GGUF's Q4_1 ---------------------------------------------------------------------------------

def test_q4_1_reapplied_to_a_q4_1_file_is_bit_exact():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 256)) * 0.05).astype(np.float32)
    w = torch.from_numpy(dequantize(quantize(x, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1).copy())
    assert not torch.equal(w, torch.from_numpy(x))                  # the file did lose something
    assert torch.equal(Q.fake_quantize(w, Q.Q4_1), w)               # re-applying it loses nothing more
    # chapter 07's check (every weight back bit for bit) fails for weights that are not on the grid
    assert not torch.equal(Q.fake_quantize(torch.from_numpy(x), Q.Q4_1), torch.from_numpy(x))


def test_q4_1_on_the_embedded_model_is_lossless(embedded):
    model, _ = embedded
    for mod in projection_modules(model).values():
        assert torch.equal(Q.fake_quantize(mod.weight, Q.Q4_1), mod.weight)


# --- bits per weight -------------------------------------------------------------------------------

def test_bits_per_weight_of_the_chapter_schemes():
    assert Q.bits_per_weight(Scheme("absmax", 4, "group", 128), (896, 4864)) == 4.125
    assert Q.bits_per_weight(Scheme("nf4", 4, "group", 64), (896, 4864)) == 4.25
    assert Q.bits_per_weight(Scheme("minmax", 4, "group", 32)) == 5.0
    assert Q.bits_per_weight(Scheme("absmax", 8, "row"), (10, 1024)) == 8 + 16 / 1024
    # pad=True: 576 = 4 x 128 + 64, five started groups per row
    assert Q.bits_per_weight(Scheme("absmax", 4, "group", 128, pad=True), (3, 576)) == 4 + 16 * 5 / 576


def test_gguf_layouts_agree_with_the_gguf_package():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    expected = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5,
                "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625}
    for name, layout in Q.GGUF_FORMATS.items():
        weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        assert (layout.weights, layout.bits) == (weights, 8 * nbytes)
        assert layout.bits_per_weight == expected[name]


def test_k_m_mix_follows_the_layer_rule():
    # 8 layers, rows of 256 everywhere: use_more_bits picks layers 0, 7 and (i - 1) % 3 == 2 -> 3, 6
    dims = ModelDims(n_layers=8, d_model=256, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=512, vocab_size=1000)
    assert [i for i in range(8) if Q._use_more_bits(i, 8)] == [0, 3, 6, 7]
    mix = Q.gguf_mix(dims, "Q4_K_M", tied=True)
    per = mix["weights_per_type"]
    v_down = 4 * (256 * 256 + 256 * 512)                           # attn_v + ffn_down in four layers
    assert per["Q6_K"] == v_down + 1000 * 256                       # plus the tied output/embedding
    assert per["Q4_K"] == mix["n_weights"] - per["Q6_K"]
    assert mix["bits_per_weight"] == pytest.approx((4.5 * per["Q4_K"] + 6.5625 * per["Q6_K"]) / mix["n_weights"])


def test_k_quants_fall_back_when_rows_are_not_multiples_of_256():
    dims = ModelDims(n_layers=2, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536, vocab_size=100)
    per = Q.gguf_mix(dims, "Q5_K_M", tied=True)["weights_per_type"]
    # of 2 layers, use_more_bits picks layer 1 only; only ffn_down's rows (1536 = 6 x 256) allow K-quants
    assert per["Q6_K"] == per["Q5_K"] == 576 * 1536                  # ffn_down of layers 1 and 0
    assert per["Q8_0"] == 100 * 576 + 192 * 576                       # tied output; layer 1's attn_v (Q6_K)
    assert per["Q5_1"] == sum(per.values()) - per["Q6_K"] - per["Q5_K"] - per["Q8_0"]


def test_projection_count_of_the_reference_model():
    qwen = ModelDims(n_layers=24, d_model=896, n_heads=14, n_kv_heads=2, head_dim=64, d_ff=4864, vocab_size=151936)
    n, params = Q.projection_param_count(qwen)
    assert (n, round(params / 1e6, 1)) == (168, 357.8)


# --- whole model -------------------------------------------------------------------------------------

def test_weight_quantizer_applies_and_restores_bit_exactly(tiny_model):
    originals = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    wq = Q.WeightQuantizer(tiny_model)
    scheme = Scheme("absmax", 4, "row")
    wq.apply(scheme)
    for name, mod in wq.modules.items():
        assert torch.equal(mod.weight, Q.fake_quantize(originals[name + ".weight"], scheme))
    wq.apply(Scheme("absmax", 8, "tensor"))                  # from the originals, not from INT4
    name, mod = next(iter(wq.modules.items()))
    assert torch.equal(mod.weight, Q.fake_quantize(originals[name + ".weight"], Scheme("absmax", 8, "tensor")))
    wq.release()
    assert all(torch.equal(v, originals[k]) for k, v in tiny_model.state_dict().items())


def test_weight_quantizer_keeps_compact_originals(tiny_llama):
    wq = Q.WeightQuantizer(tiny_llama)
    name, mod = next(iter(wq.modules.items()))
    before = {n: m.weight.clone() for n, m in wq.modules.items()}
    with torch.no_grad():
        mod.weight.copy_(mod.weight.bfloat16().float())                   # a bf16-exact matrix
    wq.apply(Scheme("absmax", 4, "tensor"))
    assert wq._saved[name].dtype == torch.bfloat16
    wq.release()
    assert torch.equal(mod.weight, before[name].bfloat16().float())
    with torch.no_grad():
        mod.weight.copy_(before[name])


def test_weight_quantizer_stores_the_embedded_model_as_q4_1_codes(embedded):
    model, _ = embedded
    wq = Q.WeightQuantizer(model)
    first = dict(list(wq.modules.items())[:2])
    wq.modules = first                                     # two matrices are enough here
    original = {n: m.weight.clone() for n, m in first.items()}
    wq.apply(Scheme("absmax", 4, "tensor"))
    assert all(isinstance(v, Q.QuantizedTensor) for v in wq._saved.values())
    wq.release()
    assert all(torch.equal(m.weight, original[n]) for n, m in first.items())


def test_matrix_errors_summarise_every_matrix(tiny_llama):
    res = Q.matrix_errors(tiny_llama, Scheme("absmax", 8, "row"))
    assert len(res.errors) == 14 and 0 < res.mean < 0.02
    assert res.worst[1] == max(res.errors.values())


def test_weight_stats_counts_beyond_six_sigma():
    w = torch.zeros(1000)
    w[:500], w[500:], w[0] = 1.0, -1.0, 100.0
    st_ = Q.weight_stats(w)
    assert st_["beyond"] == 1 and st_["max_abs"] == 100.0
    assert st_["max_over_std"] == pytest.approx(100 / w.std().item())


# --- AWQ ---------------------------------------------------------------------------------------------

def _salient_problem():
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    x[:, :4] *= 30                                          # four input channels carry large activations
    w = torch.randn(32, 64) * 0.1
    return x, w


def test_awq_never_worse_than_rtn_on_calibration_and_helps_on_salient_channels():
    x, w = _salient_problem()
    scheme = Scheme("absmax", 3, "group", 16)
    fit = Q.awq_search(x[:128], w, scheme, x_eval=x[128:])
    assert fit.errors[0] == pytest.approx(Q.output_error(x[:128], w, Q.fake_quantize(w, scheme)))
    assert min(fit.errors) <= fit.rtn_error
    best = fit.alphas.index(fit.alpha)
    assert fit.alpha > 0 and fit.eval_errors[best] < fit.eval_errors[0]


def test_awq_search_gives_matrices_that_share_an_input_one_scale():
    x, w = _salient_problem()
    torch.manual_seed(1)
    w2 = torch.randn(16, 64) * 0.1
    scheme = Scheme("absmax", 3, "group", 16)
    fit = Q.awq_search(x[:128], [w, w2], scheme, x_eval=x[128:])
    assert fit.scales.shape == (64,)
    stacked_rtn = torch.cat([Q.fake_quantize(w, scheme), Q.fake_quantize(w2, scheme)])
    assert fit.errors[0] == pytest.approx(Q.output_error(x[:128], torch.cat([w, w2]), stacked_rtn), rel=1e-5)
    best = fit.alphas.index(fit.alpha)
    shared = torch.cat([Q.scaled_fake_quantize(w, fit.scales, scheme), Q.scaled_fake_quantize(w2, fit.scales, scheme)])
    assert fit.errors[best] == pytest.approx(Q.output_error(x[:128], torch.cat([w, w2]), shared), rel=1e-5)
    assert fit.alpha > 0 and fit.eval_errors[best] < fit.eval_errors[0]


def _tiny_mha():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4,
                                        tie_word_embeddings=False)).eval()


def _spread_norms(model):
    """Give the norms and inputs uneven channels, as trained models have (random init leaves them all 1)."""
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(torch.rand_like(p) * 3 + 0.1)


def test_awq_groups_share_inputs_and_skip_o_proj_under_gqa(tiny_llama):
    gqa = Q.awq_groups(tiny_llama)
    assert [g.label for g in gqa[:4]] == ["q_proj, k_proj, v_proj", "o_proj", "gate_proj, up_proj", "down_proj"]
    assert len(gqa) == 8 and [g.layer for g in gqa] == [0] * 4 + [1] * 4
    assert gqa[0].fold_into == "model.layers.0.input_layernorm" and gqa[3].fold_into == "model.layers.0.mlp.up_proj"
    assert gqa[1].skipped == Q.GQA_SKIP and not any(g.skipped for g in gqa if g is not gqa[1] and g is not gqa[5])
    assert not any(g.skipped for g in Q.awq_groups(_tiny_mha(), [1]))


def test_awq_model_fits_every_input_and_measures_held_out_text(tiny_qwen2):
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (1, 48))
    scheme = Scheme("absmax", 3, "group", 16)
    groups = Q.awq_model_fits(tiny_qwen2, ids[:, :24], scheme, heldout_ids=ids[:, 24:], n_grid=4)
    assert len(groups) == 8
    for g in groups:
        assert (g.fit is None) == bool(g.skipped)
        assert g.heldout["rtn"] > 0 and g.heldout["awq"] > 0
        if g.fit is None:
            assert g.heldout["awq"] == g.heldout["rtn"]
        else:
            assert g.fit.alphas == [0, 0.25, 0.5, 0.75, 1.0] and min(g.fit.errors) <= g.fit.rtn_error
    scales = Q.awq_input_scales(groups)
    qkv = groups[0].names
    assert scales[qkv[0]] is scales[qkv[1]] is scales[qkv[2]]       # one vector for the three
    assert "model.layers.0.self_attn.o_proj" not in scales            # GQA: skipped
    assert len(scales) == 12


def test_awq_on_one_layer_matches_the_whole_model_search(tiny_llama):
    class Chars:                                                      # a stand-in tokenizer: one id per character
        def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
            return type("Enc", (), {"input_ids": torch.tensor([[ord(c) % 128 for c in text]])})()
    split = Q.TextSplit("the calibration text " * 20, "some other held-out text " * 20)
    scheme = Scheme("absmax", 4, "row")
    one = Q.awq_layer(tiny_llama, Chars(), split, scheme, layer=1, n_tokens=64, n_grid=5)
    ids = Chars()(split.train).input_ids[:, :64]
    held = Chars()(split.heldout).input_ids[:, :64]
    every = Q.awq_model_fits(tiny_llama, ids, scheme, heldout_ids=held, layers=[1], n_grid=5)
    for a, b in zip(one, every):
        assert a.names == b.names and (a.fit is None) == (b.fit is None)
        assert a.heldout == pytest.approx(b.heldout, rel=1e-4)
        if a.fit is not None:
            assert a.fit.alpha == b.fit.alpha and len(a.fit.eval_errors) == 6
    scales = Q.awq_model_scales(tiny_llama, Chars(), split, scheme, n_tokens=64, n_grid=5)
    assert set(scales) == {n for g in Q.awq_groups(tiny_llama) if not g.skipped for n in g.names}


@pytest.mark.parametrize("make", [_tiny_mha, "tiny_qwen2"])
def test_awq_scales_fold_into_the_norms_and_projections(make, request):
    model = make() if callable(make) else request.getfixturevalue(make)
    _spread_norms(model)
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (1, 32))
    groups = Q.awq_model_fits(model, ids, Scheme("absmax", 4, "row"), n_grid=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = model(ids).logits
    with Q.awq_folded(model, groups):
        changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
        folded = model(ids).logits
    assert any("layernorm" in k for k in changed) and any("up_proj" in k for k in changed)
    assert torch.allclose(folded, ref, atol=1e-4, rtol=1e-4)                # the same function
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())   # put back bit for bit


@pytest.mark.parametrize("scheme", [Scheme("absmax", 4, "row"), Scheme("absmax", 3, "group", 16)])
def test_folded_scales_then_rtn_equal_quantizing_with_input_scales(scheme):
    """Where a file stores the folded weights, plain RTN of them is what ``apply(input_scales=...)`` computes.
    Powers of two make every scaling exact, so the two models agree to float rounding of the matmuls."""
    model = _tiny_mha()
    _spread_norms(model)
    groups = Q.awq_groups(model)
    gen = torch.Generator().manual_seed(3)
    for g in groups:
        n_in = dict(model.named_modules())[g.names[0]].in_features
        s = 2.0 ** torch.randint(-3, 4, (n_in,), generator=gen).float()
        g.fit = Q.AwqFit(0.5, s, [0.0, 0.5], [1.0, 0.5])
    ids = torch.randint(0, 128, (1, 16), generator=gen)
    wq = Q.WeightQuantizer(model)
    wq.apply(scheme, input_scales=Q.awq_input_scales(groups))
    emulated = model(ids).logits
    wq.release()
    with Q.awq_folded(model, groups):
        wq.apply(scheme)
        stored = model(ids).logits
        wq.release()
    assert torch.allclose(stored, emulated, atol=1e-5, rtol=1e-5)
    wq.apply(scheme)
    plain = model(ids).logits
    wq.release()
    assert not torch.allclose(plain, emulated, atol=1e-3)                      # the scales did change the weights


def test_awq_bad_inputs(tiny_llama):
    scheme = Scheme("absmax", 4, "row")
    with pytest.raises(ValueError, match="token ids"):
        Q.awq_model_fits(tiny_llama, torch.randn(1, 8), scheme)
    with pytest.raises(TypeError, match="Scheme"):
        Q.awq_model_fits(tiny_llama, torch.ones(1, 8, dtype=torch.long), "INT4")
    with pytest.raises(ValueError, match="layers must be"):
        Q.awq_groups(tiny_llama, [5])
    with pytest.raises(ValueError, match="same in_features"):
        Q.awq_search(torch.randn(4, 8), [torch.randn(2, 8), torch.randn(2, 6)], scheme)
    with pytest.raises(ValueError, match="n_grid"):
        Q.awq_search(torch.randn(4, 8), torch.randn(2, 8), scheme, n_grid=0)


def test_scaled_fake_quantize_with_unit_scales_is_rtn():
    x, w = _salient_problem()
    scheme = Scheme("absmax", 4, "row")
    assert torch.equal(Q.scaled_fake_quantize(w, torch.ones(64), scheme), Q.fake_quantize(w, scheme))


def test_levels_sweep_and_figure_are_consistent():
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    sweep = Q.levels_sweep(w, bits_range=[2, 4], granularities={"per-row": ("row", None)})
    fig2, fig4 = Q.levels_figure(sweep, 2, "per-row"), Q.levels_figure(sweep, 4, "per-row")
    assert len(fig2.data[0].x) == 3 and len(fig4.data[0].x) == 15
    assert sum(c or 0 for c in fig4.data[0].y) == w.numel()
    used = sweep[(4, "per-row")]["used"]
    assert f"{used['overall']} of 15 levels used" in fig4.layout.title.text


# --- bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 9, 0, 4.0, True])
def test_bits_outside_2_to_8_are_rejected(bits):
    with pytest.raises(ValueError, match="bits must be an integer from 2 to 8"):
        Scheme("absmax", bits, "row")


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="int4"), "kind must be one of"),
    (dict(kind="nf4", bits=3), "NF4 has 16 levels"),
    (dict(granularity="column"), "granularity must be one of"),
    (dict(granularity="group", group_size=0), "positive integer group_size"),
])
def test_bad_scheme_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Scheme(**{"kind": "absmax", "bits": 4, "granularity": "row", **kwargs})


def test_group_size_must_divide_the_row_unless_padding():
    w = torch.randn(4, 576)
    with pytest.raises(ValueError, match="does not divide the row length 576.*pad=True"):
        Q.quantize(w, Scheme("absmax", 4, "group", 128))
    assert Q.fake_quantize(w, Scheme("absmax", 4, "group", 128, pad=True)).shape == w.shape


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_rejected(bad):
    w = torch.randn(4, 8)
    w[1, 2] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        Q.quantize(w, Scheme("absmax", 8, "row"))


def test_weights_beyond_fp16_range_are_rejected():
    with pytest.raises(ValueError, match="65504"):
        Q.quantize(torch.tensor([[1e5, 1.0]]), Scheme("absmax", 8, "row"))


@pytest.mark.parametrize("gran", ["row", "group"])
def test_row_and_group_need_a_matrix(gran):
    with pytest.raises(ValueError, match="needs a 2-D"):
        Q.quantize(torch.randn(2, 4, 8), Scheme("absmax", 4, gran, 4))
    with pytest.raises(ValueError, match="needs a 2-D"):
        Q.quantize(torch.randn(8), Scheme("absmax", 4, gran, 4))


def test_per_tensor_takes_any_shape_and_other_bad_types():
    w = torch.randn(2, 3, 4)
    assert Q.fake_quantize(w, Scheme("absmax", 8, "tensor")).shape == w.shape
    with pytest.raises(TypeError):
        Q.quantize(np.ones((2, 2)), Scheme())
    with pytest.raises(ValueError, match="floating-point"):
        Q.quantize(torch.ones(2, 2, dtype=torch.int32), Scheme("absmax", 4, "row"))
    with pytest.raises(ValueError, match="empty"):
        Q.quantize(torch.ones(0, 4), Scheme("absmax", 4, "row"))


def test_other_bad_inputs():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="shapes differ"):
        Q.relative_error(w, w[:2])
    with pytest.raises(ValueError, match="positive vector"):
        Q.scaled_fake_quantize(w, torch.ones(7), Scheme("absmax", 4, "row"))
    with pytest.raises(ValueError, match="x_calib must be"):
        Q.awq_search(torch.randn(5, 7), w, Scheme("absmax", 4, "row"))
    with pytest.raises(ValueError, match="x must be"):
        Q.output_error(torch.randn(5, 7), w, w)
    with pytest.raises(ValueError, match="ftype"):
        Q.gguf_mix(ModelDims(1, 256, 4, 4, 64, 512, 10), "Q3_K_M")
    with pytest.raises(ValueError, match="no precomputed"):
        Q.levels_figure({}, 4, "per-row")
    with pytest.raises(TypeError):
        Q.WeightQuantizer(torch.nn.Linear(2, 2)).apply("INT4")


def test_projection_bits_weights_each_matrix_by_its_size():
    a, b = torch.nn.Linear(64, 16, bias=False), torch.nn.Linear(128, 48, bias=False)
    row = Scheme("absmax", 4, "row")
    want = (Q.bits_per_weight(row, (16, 64)) * 16 * 64 + Q.bits_per_weight(row, (48, 128)) * 48 * 128) / (16 * 64 + 48 * 128)
    assert Q.projection_bits({"a": a, "b": b}, row) == pytest.approx(want)
    assert Q.projection_bits([a, b], row) > 4.0                      # the scales cost bits
    assert Q.projection_bits({"a": a}, None) == 32.0                 # as stored: float32
    with pytest.raises(ValueError, match="no projection"):
        Q.projection_bits({}, row)
