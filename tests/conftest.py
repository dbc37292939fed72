"""Shared fixtures: the embedded model (loaded once) and tiny random llama / qwen2 models."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads its thread pool

import pytest
import torch


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct in float32 on the CPU."""
    from course_utils.models import load_model
    return load_model("embedded", dtype="float32", device="cpu", verbose=False)


def _tiny(config_cls, model_cls, **overrides):
    torch.manual_seed(0)
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               tie_word_embeddings=False)
    cfg.update(overrides)
    model = model_cls(config_cls(**cfg)).eval()
    return model


@pytest.fixture(scope="session")
def tiny_llama():
    """A randomly initialised 2-layer llama (GQA: 4 query heads, 2 KV heads), no download."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return _tiny(LlamaConfig, LlamaForCausalLM)


@pytest.fixture(scope="session")
def tiny_qwen2():
    """A randomly initialised 2-layer qwen2 (biases on q/k/v, tied embeddings), no download."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _tiny(Qwen2Config, Qwen2ForCausalLM, tie_word_embeddings=True)


@pytest.fixture(params=["tiny_llama", "tiny_qwen2"])
def tiny_model(request):
    """Each tiny architecture in turn."""
    return request.getfixturevalue(request.param)
