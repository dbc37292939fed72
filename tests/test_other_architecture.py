"""Every chapter runs unchanged on another architecture: a tiny random qwen2 model from a GGUF file.

Nothing in a chapter may assume the embedded model's shape (30 layers, 9 heads, 3 KV heads,
tied embeddings). This executes each notebook with ``MODEL`` set to a qwen2 GGUF file made
in the test (2 layers, 4 heads, 2 KV heads, q/k/v biases, a separate LM head), which also
exercises the loader's GGUF conversion for a second architecture. Its weights are random,
so its text is nonsense; the chapters' exactness asserts must hold all the same.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiny_gguf import write_tiny_qwen2_gguf

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-gguf")
    return write_tiny_qwen2_gguf(folder / "tiny-qwen2-random.gguf")


def test_the_loader_converts_a_qwen2_gguf(tiny_gguf, tmp_path, monkeypatch):
    from course_utils.models import load_model, model_dims
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path / "cache"))
    model, tok = load_model(str(tiny_gguf), verbose=False)
    assert model.config.model_type == "qwen2" and model.course_info["kind"] == "gguf"
    dims = model_dims(model.config)
    assert (dims.n_layers, dims.n_heads, dims.n_kv_heads, dims.head_dim) == (2, 4, 2, 16)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert tok.decode(tok("hello world").input_ids) == "hello world"
    again, _ = load_model(str(tiny_gguf), verbose=False)           # from the cache, same weights
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_runs_on_a_qwen2_gguf(chapter, tiny_gguf, tmp_path):
    import papermill as pm
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pm.execute_notebook(str(chapter), str(tmp_path / chapter.name), parameters={"MODEL": str(tiny_gguf)},
                        cwd=str(chapter.parent), kernel_name="python3", progress_bar=False)
