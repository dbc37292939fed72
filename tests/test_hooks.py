"""Finding the decoder layers and projections of any supported model, and watching their inputs."""
from __future__ import annotations

import pytest
import torch

from course_utils.hooks import capture_inputs, decoder_layers, layer_projections, projection_modules


def test_decoder_layers_are_the_model_stack(tiny_model):
    layers = decoder_layers(tiny_model)
    assert layers is tiny_model.model.layers and len(layers) == tiny_model.config.num_hidden_layers


def test_projection_modules_skip_the_head(tiny_model):
    mods = projection_modules(tiny_model)
    assert len(mods) == 7 * tiny_model.config.num_hidden_layers
    assert tiny_model.get_output_embeddings() not in mods.values()


def test_layer_projections_pick_one_layer(tiny_model):
    one = layer_projections(tiny_model, 1)
    assert len(one) == 7 and all(name.startswith("model.layers.1.") for name in one)
    assert layer_projections(tiny_model) == layer_projections(tiny_model, 1)     # the middle of 2 layers
    with pytest.raises(ValueError, match="layer must be"):
        layer_projections(tiny_model, 2)


def test_capture_inputs_sees_what_the_layer_sees(tiny_llama):
    layer = tiny_llama.model.layers[0]
    ids = torch.randint(0, 128, (1, 10))
    got = capture_inputs(tiny_llama, {"q": layer.self_attn.q_proj}, ids, chunk_tokens=4)["q"]
    with torch.no_grad():
        expected = layer.input_layernorm(tiny_llama.model.embed_tokens(ids))[0]
    assert got.shape == (10, 64)
    assert torch.allclose(got, expected, atol=1e-6)
    assert not layer.self_attn.q_proj._forward_pre_hooks          # removed afterwards


def test_bad_capture_input(tiny_llama):
    with pytest.raises(ValueError, match="input_ids"):
        capture_inputs(tiny_llama, {}, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_tokens"):
        capture_inputs(tiny_llama, {}, torch.zeros(1, 3, dtype=torch.long), chunk_tokens=0)
