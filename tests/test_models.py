"""The model loader: sources, the GGUF conversion cache, clear errors for bad input."""
from __future__ import annotations

import json

import pytest
import torch

from course_utils import models
from course_utils.models import (ModelDims, load_model, model_dims, resolve_device, resolve_dtype,
                                 resolve_model_source, weight_bytes)


def test_embedded_model_loads_offline_and_answers(embedded):
    model, tok = embedded
    assert model.course_info["kind"] == "gguf"
    assert model.course_info["gguf_file_type"] == "Q4_1"
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_gguf_file_type_reads_the_declared_type_and_nothing_else(tiny_gguf, tmp_path):
    from course_utils.models import embedded_gguf_path, gguf_file_type
    assert gguf_file_type(embedded_gguf_path()) == "Q4_1"
    assert gguf_file_type(tiny_gguf) == "ALL_F32"                     # as tests/tiny_gguf.py declares it
    (tmp_path / "not.gguf").write_bytes(b"not a gguf file at all")
    (tmp_path / "cut.gguf").write_bytes(tiny_gguf.read_bytes()[:60])   # the metadata ends before the key
    assert gguf_file_type(tmp_path / "not.gguf") is None and gguf_file_type(tmp_path / "cut.gguf") is None


def test_weight_bytes_counts_tied_embedding_once(embedded):
    model, _ = embedded
    assert weight_bytes(model) == 134_515_008 * 4


def test_gguf_cache_is_keyed_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    a.write_bytes(b"GGUF one")
    b.write_bytes(b"GGUF two")
    c.write_bytes(b"GGUF one")
    folder_a = models._gguf_cache_folder(a)
    assert folder_a != models._gguf_cache_folder(b)        # different content, different folder
    assert folder_a.name.split("-")[-1] == models._gguf_cache_folder(c).name.split("-")[-1]
    assert folder_a.parent == tmp_path / "cache"


def test_a_changed_file_is_converted_again_not_reused(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"first version")
    stale = models._gguf_cache_folder(f)
    stale.mkdir(parents=True)
    (stale / "source.json").write_text(json.dumps({"gguf_file": f.name}))
    f.write_bytes(b"second version, not a real GGUF")
    with pytest.raises(ValueError, match="could not be read as a causal language model GGUF"):
        models.convert_gguf(f, verbose=False)


def test_cache_dir_honours_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv(models.CACHE_ENV)
    assert models.cache_dir().name == "llm-inference-course"


@pytest.mark.parametrize("bad", ["", "   ", None, 3])
def test_empty_or_non_string_model_is_rejected(bad):
    with pytest.raises(ValueError, match="MODEL must be a non-empty string"):
        resolve_model_source(bad)


def test_missing_path_says_what_was_tried(tmp_path):
    with pytest.raises(ValueError, match=r"no model file or folder at .*nothing\.gguf.*embedded"):
        load_model(str(tmp_path / "nothing.gguf"))


def test_file_that_is_not_gguf_is_rejected(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="not a .gguf model file"):
        load_model(str(f))


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="without config.json"):
        load_model(str(tmp_path))


def test_uncached_hub_id_offline_gives_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"offline.*embedded"):
        load_model("some-org/no-such-model-here")


def test_a_model_that_is_not_a_causal_lm_is_rejected(tmp_path):
    from transformers import ViTConfig
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a causal language model"):
        load_model(str(tmp_path))


def test_a_transformers_folder_of_another_architecture_loads(tmp_path, tiny_qwen2, embedded):
    tiny_qwen2.save_pretrained(tmp_path)
    embedded[1].save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path), dtype="bfloat16", verbose=False)
    assert model.config.model_type == "qwen2" and model.dtype == torch.bfloat16
    assert model.course_info["kind"] == "folder"
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(model(ids).logits.float(), tiny_qwen2.to(torch.bfloat16)(ids).logits.float())
    tiny_qwen2.to(torch.float32)


@pytest.mark.parametrize("name,expected", [("float32", torch.float32), ("bf16", torch.bfloat16),
                                           ("torch.float16", torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_resolve_dtype(name, expected):
    assert resolve_dtype(name) == expected


@pytest.mark.parametrize("bad", ["float8", "int4", torch.int8])
def test_resolve_dtype_rejects_unknown(bad):
    with pytest.raises(ValueError):
        resolve_dtype(bad)


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda", "mps")
    with pytest.raises(ValueError, match="unknown device|unsupported device"):
        resolve_device("tpu-please")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_model_dims_follow_transformers_defaults():
    qwen = model_dims({"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896})
    assert qwen == ModelDims(n_layers=24, d_model=896, n_heads=14, n_kv_heads=2, head_dim=64)
    mha = model_dims({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096})
    assert mha.n_kv_heads == 32 and mha.head_dim == 128


def test_model_dims_of_real_configs(embedded, tiny_qwen2):
    d = model_dims(embedded[0].config)
    assert (d.n_layers, d.n_heads, d.n_kv_heads, d.head_dim, d.d_model) == (30, 9, 3, 64, 576)
    q = model_dims(tiny_qwen2.config)
    assert (q.n_layers, q.n_heads, q.n_kv_heads, q.head_dim) == (2, 4, 2, 16)


@pytest.mark.parametrize("config,field", [
    ({"num_attention_heads": 8, "hidden_size": 512}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "hidden_size": 512}, "num_attention_heads"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8}, "head_dim"),
    ({"num_hidden_layers": -2, "num_attention_heads": 8, "hidden_size": 64}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 3, "hidden_size": 64}, "multiple"),
])
def test_model_dims_name_the_missing_or_bad_field(config, field):
    with pytest.raises(ValueError, match=field):
        model_dims(config)


def test_model_dims_rejects_other_types():
    with pytest.raises(TypeError):
        model_dims(["not", "a", "config"])
