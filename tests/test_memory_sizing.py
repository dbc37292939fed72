"""Chapter 03: the KV-cache formula, checked against real cache tensors, and the sizing tables."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from course_utils import memory_sizing as ms
from course_utils.kv_quant import KVQuantSpec, fake_quantize_kv, stored_round_trip
from course_utils.memory_sizing import GIB, SYLLABUS_MODELS, fit, kv_bytes_per_token, kv_cache_bytes

#: Qwen2.5-0.5B, the reference model (hidden_size only, head_dim derived, as in its config).
REF = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896}


# --- the formula ----------------------------------------------------------------------------------

def test_reference_model_figures():
    assert kv_bytes_per_token(REF, "fp16") == 2 * 24 * 2 * 64 * 2 == 12_288
    assert kv_cache_bytes(REF, 295, "fp16") == 3_624_960
    for users, tokens in ((32, 2048), (64, 1024), (128, 512)):
        assert kv_cache_bytes(REF, tokens, "fp16", users=users) == 768 * 2**20


def test_mha_gqa_mqa():
    variants = ms.attention_variants(REF, "fp16")
    assert variants == {"MHA": (14, 86_016), "this model": (2, 12_288), "MQA": (1, 6_144)}
    assert variants["MHA"][1] == 7 * variants["this model"][1]


def test_seven_b_class_example():
    seven = SYLLABUS_MODELS["7B (GQA)"]
    assert kv_bytes_per_token(seven, "fp16") == 128 * 1024
    weights = ms.weight_bytes_at(7e9, "fp16")
    assert weights == 14_000_000_000 and round(weights / GIB, 1) == 13.0
    assert kv_cache_bytes(seven, 128_000, "fp16") > weights
    crossover = ms.crossover_tokens(seven)
    assert kv_cache_bytes(seven, crossover) > weights >= kv_cache_bytes(seven, crossover - 1)


def test_config_object_and_dict_agree(tiny_llama):
    cfg = tiny_llama.config
    as_dict = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    assert kv_bytes_per_token(cfg, "fp32") == kv_bytes_per_token(as_dict, torch.float32) == 2 * 2 * 2 * 16 * 4


def test_transformers_defaults_for_missing_fields():
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}      # no kv heads, no head_dim
    assert kv_bytes_per_token(mha, "fp16") == 2 * 2 * 4 * 16 * 2
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_bytes_per_token({"num_attention_heads": 4, "hidden_size": 64})
    with pytest.raises(ValueError, match="head_dim"):
        kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4})


def test_precisions_and_their_scales():
    assert ms.quantized_bits(4, 128) == 4.125
    assert ms.quantized_bits(4, 64) == 4.25
    assert ms.quantized_bits(4, 64, zero_point_bits=16) == 4.5
    assert ms.weight_bits_per_element("int4") == 4.125 and ms.weight_bits_per_element("int8") == 8
    assert ms.kv_bits_per_element("int4") == 4.5 and ms.kv_bits_per_element("int8") == 8.5
    assert ms.kv_bits_per_element("int2") == 2.5
    assert ms.kv_bits_per_element("bfloat16") == ms.kv_bits_per_element(torch.bfloat16) == 16
    assert kv_bytes_per_token(REF, "int4") == 6144 * 4.5 / 8
    assert kv_bytes_per_token(REF, 3) == 6144 * 3 / 8          # a number is bits per element
    assert kv_bytes_per_token(REF, "fp8") == kv_bytes_per_token(REF, "fp8_e4m3") == 6144
    assert kv_bytes_per_token(REF, torch.float8_e4m3fn) == 6144


@pytest.mark.parametrize("bad", ["fp6", "int3", torch.int8, torch.bool, -4, 0, float("nan")])
def test_unknown_or_bad_precision_is_rejected(bad):
    with pytest.raises(ValueError):
        kv_bytes_per_token(REF, bad)


def test_precision_of_wrong_type_is_rejected():
    for bad in (None, True, [16]):
        with pytest.raises(TypeError):
            kv_bytes_per_token(REF, bad)


@pytest.mark.parametrize("kwargs", [dict(n_tokens=0), dict(n_tokens=-5), dict(n_tokens=2.5), dict(users=0)])
def test_bad_cache_sizes_are_rejected(kwargs):
    args = dict(n_tokens=10, users=1) | kwargs
    with pytest.raises(ValueError):
        kv_cache_bytes(REF, args["n_tokens"], "fp16", users=args["users"])


def test_bad_kv_heads_are_rejected():
    with pytest.raises(ValueError, match="multiple"):
        ms.with_kv_heads(REF, 3)
    with pytest.raises(ValueError):
        ms.with_kv_heads(REF, 0)


# --- the formula against real cache tensors --------------------------------------------------------

SHAPES = [(1, 1), (1, 37), (2, 64), (3, 5)]


def _check_measured(model, dtype, shapes=SHAPES):
    for batch, n_tokens in shapes:
        measured = ms.measured_cache_bytes(model, batch, n_tokens)
        assert measured == kv_cache_bytes(model.config, n_tokens, dtype, users=batch), (batch, n_tokens, dtype)
        assert measured == kv_bytes_per_token(model.config, model.dtype) * batch * n_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_formula_matches_tiny_caches_to_the_byte(tiny_model, dtype):
    model = copy.deepcopy(tiny_model).to(dtype)
    _check_measured(model, dtype)


def test_formula_matches_embedded_cache_to_the_byte(embedded):
    model, _ = embedded
    _check_measured(model, torch.float32, [(1, 1), (2, 9), (1, 23)])
    assert kv_bytes_per_token(model.config, "fp32") == 46_080


def test_formula_matches_embedded_bf16_cache_to_the_byte():
    from course_utils.models import load_model
    model, _ = load_model("embedded", dtype="bfloat16", device="cpu", verbose=False)
    _check_measured(model, torch.bfloat16, [(1, 1), (2, 9), (1, 23)])
    assert kv_bytes_per_token(model.config, torch.bfloat16) == 23_040


def test_measured_cache_bytes_rejects_bad_sizes(tiny_llama):
    with pytest.raises(ValueError):
        ms.measured_cache_bytes(tiny_llama, 0, 4)
    with pytest.raises(ValueError):
        ms.measured_cache_bytes(tiny_llama, 1, -1)


# --- does it fit? ------------------------------------------------------------------------------------

def test_fit_reproduces_the_reference_tables():
    assert fit(8, SYLLABUS_MODELS["13B (MHA)"], weight_precision="int4").tokens_total == 337
    assert fit(16, SYLLABUS_MODELS["7B (GQA)"], weight_precision="int8").tokens_total == 65_378
    assert fit(16, SYLLABUS_MODELS["13B (MHA)"], weight_precision="int8").tokens_total == 3_136


def test_fit_is_the_floor_of_free_bytes_over_bytes_per_token():
    f = fit(8, SYLLABUS_MODELS["13B (MHA)"], weight_precision="int4")
    assert f.weights_bytes == 6_703_125_000
    assert f.free_bytes == 8 * GIB - 1.5 * GIB - 6_703_125_000
    assert f.kv_bytes_per_token == 819_200
    assert f.tokens_total == math.floor(f.free_bytes / f.kv_bytes_per_token)
    assert f.tokens_total * f.kv_bytes_per_token <= f.free_bytes < (f.tokens_total + 1) * f.kv_bytes_per_token


def test_fit_when_weights_do_not_fit():
    f = fit(24, SYLLABUS_MODELS["70B (GQA)"], weight_precision="fp16")
    assert not f.fits and f.tokens_total == 0 and f.tokens_per_user == 0 and f.free_bytes < 0


def test_fit_users_kv_precision_and_overhead():
    seven = SYLLABUS_MODELS["7B (GQA)"]
    base = fit(16, seven, weight_precision="int8")
    assert fit(16, seven, weight_precision="int8", users=8).tokens_per_user == base.tokens_total // 8
    int4_cache = fit(16, seven, weight_precision="int8", kv_precision="int4")
    assert int4_cache.tokens_total == math.floor(base.free_bytes / (131_072 * 4.5 / 16))
    assert fit(16, seven, weight_precision="int8", overhead_gib=0).tokens_total > base.tokens_total
    assert fit(16, seven, n_params=6e9).tokens_total > fit(16, seven).tokens_total


@pytest.mark.parametrize("kwargs", [dict(memory_gib=0), dict(memory_gib=-8), dict(memory_gib=float("inf")),
                                    dict(overhead_gib=-1), dict(users=0), dict(n_params=0), dict(n_params=-7e9),
                                    dict(weight_precision="int2"), dict(kv_precision="fp12")])
def test_fit_rejects_bad_input(kwargs):
    args = dict(memory_gib=16, weight_precision="fp16", kv_precision="fp16", overhead_gib=1.5, users=1) | kwargs
    memory = args.pop("memory_gib")
    with pytest.raises(ValueError):
        fit(memory, SYLLABUS_MODELS["7B (GQA)"], **args)


def test_fit_needs_a_parameter_count():
    with pytest.raises(ValueError, match="n_params"):
        fit(16, REF)
    assert fit(16, REF, n_params=494_032_768).fits


def test_weight_bytes_at_rejects_bad_input():
    with pytest.raises(ValueError):
        ms.weight_bytes_at(0)
    with pytest.raises(ValueError):
        ms.weight_bytes_at(7e9, "int5")
    assert ms.weight_bytes_at(13e9, "int4") == 6_703_125_000


# --- shipped model shapes -------------------------------------------------------------------------------

def test_shipped_shapes_are_consistent_and_counted():
    shapes = ms.model_shapes()
    assert {"SmolLM2-135M", "Qwen2.5-0.5B", "Llama-2-7B", "Llama-2-13B", "Llama-3-8B", "Llama-3-70B",
            "Mistral-7B"} <= set(shapes)
    for name, shape in shapes.items():
        dims = ms.model_dims(shape)
        assert dims.n_heads * dims.head_dim == dims.d_model, name
        assert ms.n_params_from_config(shape) == shape["n_params"], name


def test_shipped_embedded_shape_matches_the_model(embedded):
    model, _ = embedded
    shape = ms.model_shapes()["SmolLM2-135M"]
    assert kv_bytes_per_token(shape, "fp32") == kv_bytes_per_token(model.config, "fp32")
    assert shape["n_params"] == sum(p.numel() for p in model.parameters())


def test_n_params_from_config(tiny_model):
    assert ms.n_params_from_config(tiny_model.config) == sum(p.numel() for p in tiny_model.parameters())
    with pytest.raises(ValueError, match="model_type"):
        ms.n_params_from_config(REF)
    with pytest.raises(TypeError):
        ms.n_params_from_config(42)


# --- widget ---------------------------------------------------------------------------------------------

def test_fit_figure_shows_the_fit():
    models = SYLLABUS_MODELS | ms.model_shapes()
    fig = ms.fit_figure(16, "7B (GQA)", "int8", "fp16", 4, models=models)
    expected = fit(16, SYLLABUS_MODELS["7B (GQA)"], weight_precision="int8", users=4)
    assert f"{expected.tokens_per_user:,} tokens of context each" in fig.layout.title.text
    parts = {t.name: t.x[0] for t in fig.data if t.type == "bar"}
    assert math.isclose(sum(parts.values()), 16, rel_tol=1e-9)          # every byte accounted for
    assert "do not fit" in ms.fit_figure(8, "70B (GQA)", "fp16", "fp16", 1, models=models).layout.title.text
    with pytest.raises(ValueError, match="unknown model"):
        ms.fit_figure(16, "GPT-5", "int8", "fp16", 1, models=models)


# --- real files, the time a cache costs, quantizing a real cache ------------------------------------------

def test_thirteen_b_in_a_real_q4_k_m_file_no_longer_fits_8_gib():
    from course_utils.models import model_dims
    from course_utils.quantize import GGUF_FORMATS, gguf_mix
    thirteen = SYLLABUS_MODELS["13B (MHA)"]
    bits = gguf_mix(model_dims(thirteen), "Q4_K_M")["bits_per_weight"]
    assert 4.5 < bits < 5.5
    assert fit(8, thirteen, weight_precision="int4").fits
    assert not fit(8, thirteen, weight_precision=bits).fits
    assert fit(8, SYLLABUS_MODELS["7B (GQA)"], weight_precision=GGUF_FORMATS["Q8_0"].bits_per_weight).tokens_total == 0


def test_step_read_bytes_are_weights_plus_every_users_cache():
    seven = SYLLABUS_MODELS["7B (GQA)"]
    assert ms.step_read_bytes(seven, 0) == ms.weight_bytes_at(7e9, "fp16")
    assert ms.step_read_bytes(seven, 1000, users=4) - ms.step_read_bytes(seven, 0) == 4 * 1000 * 131_072
    assert ms.step_read_bytes(seven, 10, kv_precision="int4", weight_precision="int4") == \
        ms.weight_bytes_at(7e9, "int4") + 10 * kv_bytes_per_token(seven, "int4")
    with pytest.raises(ValueError):
        ms.step_read_bytes(seven, -1)
    with pytest.raises(ValueError):
        ms.step_read_bytes(seven, 10, users=0)


def _cache_like(seed=0, outlier_channel=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 50, 16, generator=g)
    x[..., outlier_channel] *= 30                                  # one large channel, as keys have
    return x


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_kv_bits_charged_are_the_bits_the_quantized_cache_holds(bits, axis):
    # the tables charge int8/int4/int2 caches with KV_BITS; the quantized cache that chapters 03, 07 and
    # 10 measure stores codes plus an fp16 step and minimum per group: both counts must agree
    x = _cache_like()[..., :48, :]                                     # 48 tokens, 16 channels
    group = 16
    spec = KVQuantSpec(bits, group)
    _, held = stored_round_trip(x, spec, axis)
    assert held == ms.quantized_bits(bits, group, zero_point_bits=16)
    # ... and at the table's own group size, KV_BITS is that count
    big = torch.randn(1, 2, 2 * ms.KV_GROUP, ms.KV_GROUP)
    _, held_64 = stored_round_trip(big, KVQuantSpec(bits, ms.KV_GROUP), axis)
    assert ms.kv_bits_per_element(f"int{bits}") == held_64 == KVQuantSpec(bits).bits_per_element


def test_fp8_round_trip_is_e4m3_with_one_scale():
    x = _cache_like()
    y = ms.fp8_round_trip(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y.abs().max().item() == pytest.approx(x.abs().max().item(), rel=1e-6)     # absmax maps to 448 exactly
    # one scale per sequence: a sequence's numbers do not depend on the other sequences of the batch
    assert torch.equal(ms.fp8_round_trip(torch.cat([x[:1], 100 * x[1:]]))[0], y[0])
    for row in range(x.shape[0]):
        assert y[row].abs().max().item() == pytest.approx(x[row].abs().max().item(), rel=1e-6)
    assert _rel(y, x) < 0.05                                                          # 3 mantissa bits: ~2-3 %
    assert all(len((y[r] / (x[r].abs().max() / 448)).float().unique()) <= 256 for r in range(x.shape[0]))
    with pytest.raises(ValueError):
        ms.fp8_round_trip(torch.ones(3, dtype=torch.int32))


def test_channel_spread_sees_one_large_channel():
    assert ms.channel_spread(_cache_like()) > 10
    flat = torch.ones(1, 2, 5, 8)
    assert ms.channel_spread(flat) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        ms.channel_spread(torch.ones(3, 4))


def test_cache_quantization_kl(tiny_model):
    ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(0))     # 3 windows of 40 tokens
    same = (lambda k: k, lambda v: v)

    def one_bit(x):
        return fake_quantize_kv(x, KVQuantSpec(2, 8), "token") * 0 + x.mean()          # every number the same

    out = ms.cache_quantization_kl(tiny_model, ids, {"exact": same, "fp8": (ms.fp8_round_trip, ms.fp8_round_trip),
                                                     "flat": (one_bit, one_bit)}, scored_tokens=8)
    assert out["exact"].kl == (0.0, 0.0, 0.0) and out["exact"].same == (8, 8, 8) and out["exact"].same_share == 1
    assert len(out["fp8"].kl) == 3 and out["fp8"].positions == 24
    assert 0 <= max(out["fp8"].kl) < min(out["flat"].kl)
    assert all(0 <= n <= 8 for q in out.values() for n in q.same)
    # the windows are independent: the second window alone gives the same numbers as inside the batch
    alone = ms.cache_quantization_kl(tiny_model, ids[1:2], {"fp8": (ms.fp8_round_trip, ms.fp8_round_trip)},
                                     scored_tokens=8)
    assert alone["fp8"].kl[0] == pytest.approx(out["fp8"].kl[1], rel=1e-3, abs=1e-9)
    with pytest.raises(ValueError):
        ms.cache_quantization_kl(tiny_model, ids, {}, scored_tokens=40)
    with pytest.raises(ValueError):
        ms.cache_quantization_kl(tiny_model, ids[0], {}, scored_tokens=8)


def test_fit_bars_figure_accounts_for_every_gib():
    seven, thirteen = SYLLABUS_MODELS["7B (GQA)"], SYLLABUS_MODELS["13B (MHA)"]
    cards = {"8 GiB": {"7B int4": fit(8, seven, weight_precision="int4"), "13B fp16": fit(8, thirteen)},
             "16 GiB": {"7B int4": fit(16, seven, weight_precision="int4"), "13B fp16": fit(16, thirteen)}}
    fig = ms.fit_bars_figure(cards, title="t")
    bars = [t for t in fig.data if t.type == "bar"]
    assert len(bars) == 4 * 2
    by_card = {}
    for b in bars:
        by_card.setdefault(b.xaxis, []).append(b)
    for axis, card in zip(sorted(by_card), cards):
        totals = [sum(b.x[i] for b in by_card[axis] if b.name != "over the card") for i in range(2)]
        memory = float(next(iter(cards[card].values())).memory_bytes) / GIB
        assert totals[0] == pytest.approx(memory)                    # 7B int4 fits: weights + runtime + cache = card
        over = [b for b in by_card[axis] if b.name == "over the card"][0].x[1]
        assert over == pytest.approx(-float(cards[card]["13B fp16"].free_bytes) / GIB)
