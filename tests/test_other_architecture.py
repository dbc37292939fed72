"""Every chapter runs unchanged on another architecture: a tiny random qwen2 model from a GGUF file.

Nothing in a chapter may assume the embedded model's shape (30 layers, 9 heads, 3 KV heads,
tied embeddings). This executes each notebook with ``MODEL`` set to a qwen2 GGUF file made
in the test (2 layers, 4 heads, 2 KV heads, q/k/v biases, a separate LM head) and the
reduced sizes of ``chapters.REDUCED``, which also exercises the loader's GGUF conversion for
a second architecture. Its weights are random, so its text is nonsense; the chapters'
exactness asserts must hold all the same. Chapters the browser tests run in JupyterLab
(when Chromium is present) take their second run there instead.
"""
from __future__ import annotations

import pytest

from browser import chromium_available
from chapters import CHAPTERS, check_second_run
from test_browser import SLIDER_CASES


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


IN_THE_BROWSER = {name for name, _ in SLIDER_CASES} if chromium_available() else set()
HERE = [c for c in CHAPTERS if c.name not in IN_THE_BROWSER]


@pytest.mark.notebooks
@pytest.mark.parametrize("chapter", HERE, ids=lambda p: p.stem)
def test_chapter_runs_on_a_qwen2_gguf(chapter, second_run):
    check_second_run(second_run(chapter))


@pytest.mark.notebooks
def test_chapter_10_reads_the_figures_a_main_job_left(second_run):
    """The second run of chapter 10 is given executed chapters 07 and 08 (``published_build``): it must say it read
    their figures, and use them (the made-up INT4 group-64 row appears in its quality table)."""
    import nbformat
    chapter = next(p for p in CHAPTERS if p.name.startswith("10"))
    nb = nbformat.read(second_run(chapter), as_version=4)
    text = "\n".join(o.get("data", {}).get("text/markdown", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.outputs)
    assert "Quality figures: **read from `07_evaluating_quantization.ipynb`" in text
    assert "N-gram lookup figures: **read from `08_speculative_decoding.ipynb`" in text
    assert "| INT4 group-64 | 4.25 |" in text
