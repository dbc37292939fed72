"""Tests for course_utils.outliers (chapter 06): hooks, outlier statistics, INT8 levels and the fixes."""
from __future__ import annotations

import math

import pytest
import torch

from course_utils import outliers as O
from course_utils.hooks import decoder_layers
from course_utils.quantize import Scheme, count_levels


def test_hooks_record_the_same_states_as_output_hidden_states(tiny_model):
    ids = torch.randint(0, 128, (1, 12))
    hooks_before = [len(layer._forward_hooks) for layer in decoder_layers(tiny_model)]
    h = O.residual_stream(tiny_model, ids)
    assert [len(layer._forward_hooks) for layer in decoder_layers(tiny_model)] == hooks_before
    n = tiny_model.config.num_hidden_layers
    with torch.no_grad():
        ref = tiny_model(ids, output_hidden_states=True).hidden_states
    assert h.shape == (n, 12, tiny_model.config.hidden_size)
    for i in range(n - 1):                      # the last entry of hidden_states has the final norm applied
        assert torch.equal(h[i], ref[i + 1][0])


def _stream_with_outlier():
    torch.manual_seed(0)
    h = torch.randn(6, 20, 32)
    h[1:6, :, 7] *= 1000                        # dimension 7 huge in layers 1..5
    h[0, 0, 20] = 1e5                           # dimension 20 huge in layer 0 only: not persistent
    h[:, 3, 11] = 50                            # dimension 11 large on one token, every layer
    return h


def test_outlier_statistics_find_the_planted_dimensions():
    h = _stream_with_outlier()
    m = O.dim_max(h)
    assert m.shape == (6, 32)
    assert O.outlier_dims(m, 2) == [7, 11]
    assert O.outlier_span(m, 7) == (1, 5)
    assert O.outlier_span(m, 20) == (0, 0)
    assert O.outlier_span(m, 3) is None


def test_log2_histogram_uses_power_of_two_bins():
    edges, counts = O.log2_histogram(torch.tensor([0.3, 0.5, 1.0, 1.5, 3.0, 3.9, 100.0, 0.0]))
    assert edges[0] == 0.25 and edges[-1] == 64.0
    assert counts == [1, 1, 2, 2, 0, 0, 0, 0, 1] and sum(counts) == 7


def test_one_huge_dimension_leaves_ordinary_dimensions_one_level():
    torch.manual_seed(0)
    x = torch.randn(84, 16) * 0.3
    x[5, 0] = 1500.0
    scale = O.int8_scale(x)
    assert scale == pytest.approx(1500 / 127)
    overall, per_dim = count_levels(O.int8_codes(x, scale).T)
    assert per_dim[0] == 2 and (per_dim[1:] == 1).all() and overall == 2
    small = O.int8_scale(x, exclude_dims=[0])
    assert small == pytest.approx(x[:, 1:].abs().max().item() / 127)
    assert (count_levels(O.int8_codes(x, small).T)[1][1:] > 20).all()


def test_int8_codes_use_the_255_symmetric_levels():
    x = torch.tensor([[-10.0, -1.0, 0.0, 1.0, 10.0]])
    codes = O.int8_codes(x, 10 / 127)
    assert codes.min() == -127 and codes.max() == 127            # -128 stays unused, as in chapter 05
    assert O.int8_codes(x * 2, 10 / 127).min() == -127          # values beyond the scale clip to -127
    assert O.INT8_LEVELS == 255 == Scheme("absmax", 8, "tensor").n_levels


def test_residual_updates_add_up_to_the_stream_bit_for_bit(tiny_model):
    ids = torch.randint(0, 128, (1, 10))
    h = O.residual_stream(tiny_model, ids)
    parts = O.residual_updates(tiny_model, ids)
    assert parts["attention"].shape == parts["mlp"].shape == h.shape
    x = parts["embeddings"]
    for layer in range(h.shape[0]):
        x = x + parts["attention"][layer]
        x = x + parts["mlp"][layer]
        assert torch.equal(x, h[layer])


def test_massive_activations_find_one_token_and_not_a_dimension():
    h = _stream_with_outlier()
    found = O.massive_activations(h, min_abs=100, ratio=1000)
    assert [(f["token"], f["dim"]) for f in found][:1] == [(0, 20)]        # the one huge value
    assert found[0]["layers"] == [0] and found[0]["peak_layer"] == 0
    assert all(f["dim"] != 11 for f in found)                          # 50 on one token: not massive
    assert not O.massive_activations(torch.randn(3, 8, 16))


def test_outlier_features_follow_llm_int8s_criterion():
    torch.manual_seed(0)
    layers = [torch.randn(50, 16) for _ in range(8)]
    for x in layers[:3]:
        x[:10, 5] = 8.0                                                   # dim 5: >= 6 on 20 % of tokens, 3 of 8 layers
    for x in layers[:1]:
        x[:10, 9] = 8.0                                                   # dim 9: one layer only (< 25 %)
    layers[4][:2, 7] = 8.0                                                # dim 7: 4 % of the tokens only
    assert O.outlier_features(layers) == {5: 3}
    assert O.outlier_features(layers, layer_share=0.1) == {5: 3, 9: 1}
    with pytest.raises(ValueError, match="one width"):
        O.outlier_features([torch.randn(3, 4), torch.randn(3, 5)])


def test_attention_to_the_first_token_is_a_share_and_restores_the_attention(tiny_model):
    ids = torch.randint(0, 128, (1, 12))
    before = tiny_model.config._attn_implementation
    share = O.attention_to_first_token(tiny_model, ids)
    assert share.shape == (tiny_model.config.num_hidden_layers,)
    assert ((share > 0) & (share < 1)).all()
    assert tiny_model.config._attn_implementation == before
    with pytest.raises(ValueError, match="at least 2"):
        O.attention_to_first_token(tiny_model, ids[:, :1])


def test_token_dim_figure_draws_every_cell():
    x = torch.randn(5, 7)
    fig = O.token_dim_figure(x, list("abcde"), title="t")
    assert len(fig.data[0].z) == 5 and len(fig.data[0].z[0]) == 7
    with pytest.raises(ValueError, match="one label per token"):
        O.token_dim_figure(x, ["a"], title="t")


def test_fake_int8_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(30, 40) * 3
    for dim in (None, 0, 1):
        a = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
        err = (O.fake_int8(x, dim) - x).abs()
        assert (err <= a / 127 / 2 + 1e-6).all()


def test_llm_int8_limits_are_exact_and_per_token():
    torch.manual_seed(0)
    x, w = torch.randn(20, 24), torch.randn(10, 24)
    exact = x @ w.T
    assert torch.allclose(O.llm_int8_output(x, w, threshold=0.0), exact, atol=1e-5)   # everything in float
    assert torch.equal(O.llm_int8_output(x, w, threshold=math.inf), O.w8a8_output(x, w, "token"))


def test_smoothing_keeps_the_product_and_helps_an_outlier_channel():
    torch.manual_seed(0)
    x, w = torch.randn(64, 32), torch.randn(16, 32) * 0.1
    x[:, 3] *= 200
    s = O.smoothquant_scales(x, w, 0.5)
    assert torch.allclose((x / s) @ (w * s).T, x @ w.T, rtol=1e-4, atol=1e-3)
    y = x @ w.T
    plain = O.per_token_error(y, O.w8a8_output(x, w, "tensor"))
    smooth = O.per_token_error(y, O.smoothquant_output(x, w, 0.5, act="tensor"))
    assert smooth < plain / 3
    x_other = torch.randn(64, 32)                                         # other text, same outlier channel
    x_other[:, 3] *= 200
    calibrated = O.smoothquant_output(x_other, w, 0.5, act="tensor", x_calib=x)
    assert not torch.equal(calibrated, O.smoothquant_output(x_other, w, 0.5, act="tensor"))
    assert O.per_token_error(x_other @ w.T, calibrated) < O.per_token_error(x_other @ w.T,
                                                                            O.w8a8_output(x_other, w, "tensor")) / 3


def test_fix_errors_and_sweeps():
    torch.manual_seed(0)
    x, w = torch.randn(40, 32), torch.randn(16, 32)
    x[:, 0] *= 100
    errs = O.fix_errors(x, w, threshold=6.0, alpha=0.5)
    assert errs["activations per-tensor"] > errs["activations per-channel (not an integer matmul)"]
    assert errs["LLM.int8, threshold 6"] < errs["activations per-tensor"]
    sw = O.threshold_sweep(x, w, [0.5, 6.0, 1e6])
    assert sw["kept"][0] == 32 and sw["kept"][-1] == 0
    assert sw["kept"] == sorted(sw["kept"], reverse=True)
    al = O.alpha_sweep(x, w, [0.0, 0.5, 1.0])
    assert len(al["error_tensor"]) == 3
    blind = O.alpha_sweep(x, w, [0.0, 0.5, 1.0], x_calib=torch.randn(40, 32))    # text without the outlier channel
    assert blind["error_tensor"][0] == pytest.approx(al["error_tensor"][0])       # alpha 0 ignores the activations
    assert blind["error_tensor"][1] > 2 * al["error_tensor"][1]                   # the smoothing missed channel 0
    assert O.fix_errors(x, w, x_calib=x)["SmoothQuant alpha 0.5, per-tensor"] == errs["SmoothQuant alpha 0.5, per-tensor"]


def test_fix_errors_runs_smoothquant_at_the_alpha_given():
    torch.manual_seed(1)
    x, w = torch.randn(40, 16), torch.randn(8, 16)
    x[:, 3] *= 30                                           # an outlier column: alpha matters
    at = O.fix_errors_by_chunk(x, w, 20, alpha=0.8, x_calib=x, alpha_label="calibrated alpha")
    for i, chunk in enumerate(x.split(20)):
        ref = O.fix_errors(chunk, w, alpha=0.8, x_calib=x)
        assert at["SmoothQuant calibrated alpha, per-tensor"][i] == ref["SmoothQuant alpha 0.8, per-tensor"]
        assert at["SmoothQuant calibrated alpha, per-token"][i] == ref["SmoothQuant alpha 0.8, per-token"]
    half = O.fix_errors(x[:20], w, alpha=0.5, x_calib=x)["SmoothQuant alpha 0.5, per-tensor"]
    assert at["SmoothQuant calibrated alpha, per-tensor"][0] != half       # not the default alpha under a new name
    with pytest.raises(ValueError, match="alpha_label"):
        O.fix_errors(x, w, alpha_label="")


def test_fix_errors_by_chunk_is_fix_errors_on_each_chunk():
    torch.manual_seed(0)
    x, w = torch.randn(60, 32), torch.randn(16, 32)
    x[:20, 0] *= 100                            # only the first chunk has the outlier channel
    by_chunk = O.fix_errors_by_chunk(x, w, 20)
    for i in range(3):
        one = O.fix_errors(x[20 * i: 20 * (i + 1)], w)
        assert all(by_chunk[m][i] == e for m, e in one.items())
    per_tensor = by_chunk["activations per-tensor"]
    assert per_tensor[0] > 2 * max(per_tensor[1:])   # the chunks differ: a chunk is not the whole text
    with pytest.raises(ValueError, match="whole number"):
        O.fix_errors_by_chunk(x, w, 25)
    with pytest.raises(ValueError, match="at least 2"):
        O.fix_errors_by_chunk(x, w, 60)
    with pytest.raises(ValueError, match="positive integer"):
        O.fix_errors_by_chunk(x, w, 0)


def test_threshold_figure_is_pure_and_redraws():
    torch.manual_seed(0)
    x, w = torch.randn(40, 32), torch.randn(16, 32)
    x[:, 0] *= 100
    sweeps = {"model.layers.0.q_proj": O.threshold_sweep(x, w, [1.0, 6.0, 100.0])}
    a, b = O.threshold_figure(sweeps, 1.0), O.threshold_figure(sweeps, 100.0)
    assert a.data[1].x != b.data[1].x and a.layout.title.text != b.layout.title.text
    assert O.threshold_figure(sweeps, 1.0).to_plotly_json() == a.to_plotly_json()
    with pytest.raises(ValueError, match="precomputed"):
        O.threshold_figure(sweeps, 2.0)


def test_pick_layers_tells_one_token_from_one_dimension():
    torch.manual_seed(0)
    quiet, token, column = torch.randn(20, 8), torch.randn(20, 8), torch.randn(20, 8)
    token[0, 3] = 1000                                     # one value on one token
    column[:, 5] = 50 + torch.rand(20)                      # one dimension large on every token
    assert O.token_concentration(token) > 100 and O.token_concentration(column) < 2
    assert O.dimension_concentration(column) > 20 and O.dimension_concentration(token) < 5
    picked = O.pick_layers({"m.layers.0.self_attn.q_proj": quiet, "m.layers.1.mlp.down_proj": token,
                            "m.layers.1.self_attn.q_proj": column})
    assert picked == {"one token": "m.layers.1.mlp.down_proj", "one dimension": "m.layers.1.self_attn.q_proj"}
    assert O.pick_layers({"only": token}) == {"one token": "only"}
    with pytest.raises(ValueError, match="empty"):
        O.pick_layers({})
    assert O.default_layer(24) == 16 and O.default_layer(2) == 1


def test_capture_projection_inputs_covers_every_projection(tiny_llama):
    got = O.capture_projection_inputs(tiny_llama, torch.randint(0, 128, (1, 9)))
    assert len(got) == 14 and all(v.shape[0] == 9 for v in got.values())


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="n_layers, n_tokens"):
        O.dim_max(torch.randn(3, 4))
    with pytest.raises(ValueError, match="k must be"):
        O.outlier_dims(torch.randn(2, 4), 5)
    with pytest.raises(ValueError, match="no positive"):
        O.log2_histogram(torch.zeros(3))
    with pytest.raises(ValueError, match="leaves no dimension"):
        O.int8_scale(torch.randn(3, 2), exclude_dims=[0, 1])
    with pytest.raises(ValueError, match="scale must be positive"):
        O.int8_codes(torch.randn(3), 0.0)
    with pytest.raises(ValueError, match="same in"):
        O.w8a8_output(torch.randn(3, 4), torch.randn(2, 5))
    with pytest.raises(ValueError, match="act must be"):
        O.w8a8_output(torch.randn(3, 4), torch.randn(2, 4), "row")
    with pytest.raises(ValueError, match="alpha must be"):
        O.smoothquant_scales(torch.randn(3, 4), torch.randn(2, 4), 1.5)
    with pytest.raises(ValueError, match="one shape"):
        O.per_token_error(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="input_ids must be"):
        O.residual_stream(None, torch.ones(5, dtype=torch.long))
