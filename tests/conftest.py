"""Shared fixtures: the embedded model (loaded once), tiny random llama / qwen2 models, a tiny qwen2 GGUF file,
and each chapter's second run (other architecture, reduced sizes, its solutions appended), executed at most once
per test run.

Every test that executes a chapter carries the ``notebooks`` marker, and so does the live check that starts vLLM's
server as chapter 11 does, so ``-m "not notebooks"`` is the quick loop.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).endswith(".ipynb"):              # nbval's cells
            item.add_marker(pytest.mark.notebooks)


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


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A tiny random qwen2 model as a GGUF file (2 layers, q/k/v biases, its own LM head)."""
    from tiny_gguf import write_tiny_qwen2_gguf
    return write_tiny_qwen2_gguf(tmp_path_factory.mktemp("qwen2-gguf") / "tiny-qwen2-random.gguf")


@pytest.fixture(scope="session")
def second_run(tmp_path_factory, tiny_gguf):
    """``second_run(chapter) -> executed notebook``: the chapter on the tiny qwen2 GGUF with reduced sizes,
    executed with papermill once per test run (later calls return the same file)."""
    from chapters import published_build, reduced_parameters, second_run_copy

    out_dir = tmp_path_factory.mktemp("second-run")
    done = {}

    def run(chapter):
        if chapter not in done:
            import papermill as pm
            parameters = reduced_parameters(chapter, str(tiny_gguf))
            if chapter.name.startswith("10"):                # chapter 10 reads earlier chapters' figures back
                parameters["BUILD"] = str(published_build(out_dir / "published-build", str(tiny_gguf)))
            source = second_run_copy(chapter, out_dir / f"input-{chapter.name}", parameters)
            target = out_dir / chapter.name
            pm.execute_notebook(str(source), str(target), cwd=str(chapter.parent), kernel_name="python3",
                                progress_bar=False)
            done[chapter] = target
        return done[chapter]
    return run
