"""Finding and watching the parts of a decoder (chapter 05 onwards; the engine of chapter 04 too).

* :func:`decoder_layers` -- the stack of decoder layers of any transformers causal LM;
* :func:`projection_modules` / :func:`layer_projections` -- its projection matrices
  (every ``nn.Linear`` but the output head), all of them or one layer's, by full name;
* :func:`capture_inputs` -- what given modules receive while the model reads a text
  (forward pre-hooks, removed afterwards; the model is not changed).

Chapter 06 records what each decoder layer hands to the next with :func:`decoder_layers`
(``course_utils.outliers.residual_stream``).
"""
from __future__ import annotations

import torch

from .validation import check_positive_int


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's decoder layers: the ``ModuleList`` as long as ``config.num_hidden_layers``."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise ValueError("could not find the decoder layers (a ModuleList of num_hidden_layers modules)")


def projection_modules(model) -> dict[str, torch.nn.Linear]:
    """Every ``nn.Linear`` of the model except the output head: the projection matrices, by full name.

    For a llama/qwen2 decoder these are q, k, v, o, gate, up and down of every layer.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}


def layer_projections(model, layer: int | None = None) -> dict[str, torch.nn.Linear]:
    """The projection matrices of decoder layer ``layer`` (default: the middle one), by full name."""
    layers = decoder_layers(model)
    chosen = len(layers) // 2 if layer is None else layer
    if not isinstance(chosen, int) or not 0 <= chosen < len(layers):
        raise ValueError(f"layer must be one of 0..{len(layers) - 1}, got {layer!r}")
    inside = {id(m) for m in layers[chosen].modules()}
    return {name: m for name, m in projection_modules(model).items() if id(m) in inside}


def _check_ids(input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be (1, n_tokens), got {getattr(input_ids, 'shape', type(input_ids).__name__)}")


@torch.no_grad()
def capture_inputs(model, modules: dict[str, torch.nn.Module], input_ids: torch.Tensor, *,
                   chunk_tokens: int = 256) -> dict[str, torch.Tensor]:
    """The inputs each module in ``modules`` receives while the model reads ``input_ids``.

    ``input_ids``: (1, n_tokens). Runs the text in independent chunks of ``chunk_tokens``
    (forward pre-hooks, no change to the model). Returns name -> (n_tokens, in_features), float32 on the CPU.
    """
    _check_ids(input_ids)
    check_positive_int("chunk_tokens", chunk_tokens)
    got: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
    hooks = [m.register_forward_pre_hook(lambda _m, args, name=name: got[name].append(
        args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu())) for name, m in modules.items()]
    try:
        for start in range(0, input_ids.shape[1], chunk_tokens):
            model(input_ids[:, start:start + chunk_tokens].to(model.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {name: torch.cat(chunks) for name, chunks in got.items()}

