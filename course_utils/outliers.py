"""Chapter 06 -- activation outliers: a few huge dimensions, and the fixes people use.

* :func:`residual_stream` records every decoder layer's output with forward hooks (the
  model is not changed); :func:`dim_max` reduces it to the largest |h| each dimension
  reaches per layer; :func:`outlier_dims` and :func:`outlier_span` find the dimensions
  that stand out and the layers where they do.
* :func:`int8_codes` with chapter 05's :func:`~course_utils.quantize.count_levels` shows what
  one tensor-wide INT8 scale does to the ordinary dimensions when one dimension sets it.
* The fixes, each measured as the output error of a real projection fed with the
  activations captured from the model (:func:`capture_projection_inputs`):
  per-token and per-channel scales (:func:`w8a8_output`), LLM.int8's mixed-precision
  decomposition (:func:`llm_int8_output`) and SmoothQuant's migration of the difficulty
  into the weights (:func:`smoothquant_output`).

All quantization here is symmetric absmax INT8 (levels -127..127 of a scale; the 256th
code, -128, stays unused), simulated in float32 ("fake quantization").
"""
from __future__ import annotations

import math

import torch

from .hooks import capture_inputs, decoder_layers, projection_modules


# --- recording the residual stream --------------------------------------------------------------

@torch.no_grad()
def residual_stream(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The residual stream after every decoder layer, (n_layers, n_tokens, d_model), float32 on the CPU.

    Forward hooks on each layer record its output (the hidden state the next layer reads);
    the hooks are removed afterwards, whatever happens.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be (1, n_tokens), got {getattr(input_ids, 'shape', type(input_ids))}")
    states: list[torch.Tensor] = []

    def keep(_module, _args, output):
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        states.append(hidden[0].detach().float().cpu())

    hooks = [layer.register_forward_hook(keep) for layer in decoder_layers(model)]
    try:
        model(input_ids.to(model.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(states)


def dim_max(h: torch.Tensor) -> torch.Tensor:
    """Largest |h| each dimension reaches over the tokens: (n_layers, n_tokens, d) -> (n_layers, d)."""
    if h.dim() != 3:
        raise ValueError(f"expected (n_layers, n_tokens, d_model), got shape {tuple(h.shape)}")
    return h.abs().amax(dim=1)


def outlier_dims(maxima: torch.Tensor, k: int = 4) -> list[int]:
    """The ``k`` dimensions that are large in most layers, largest first. maxima: (n_layers, d).

    Ranked by the median over layers of each dimension's maximum, so a dimension that is huge
    in one layer only does not count as a persistent outlier (with one layer: its maximum).
    """
    if not 1 <= k <= maxima.shape[-1]:
        raise ValueError(f"k must be between 1 and {maxima.shape[-1]}, got {k}")
    return maxima.median(dim=0).values.topk(k).indices.tolist()


def outlier_span(maxima: torch.Tensor, dim: int, *, factor: float = 10.0) -> tuple[int, int] | None:
    """First and last layer where ``dim``'s maximum exceeds ``factor`` x that layer's median dimension."""
    above = maxima[:, dim] > factor * maxima.median(dim=1).values
    layers = above.nonzero().flatten().tolist()
    return (layers[0], layers[-1]) if layers else None


def log2_histogram(values: torch.Tensor) -> tuple[list[float], list[int]]:
    """Counts of ``values`` (> 0) in bins [2^k, 2^(k+1)); returns (left edges, counts), empty bins kept."""
    v = values.flatten().float()
    v = v[v > 0]
    if v.numel() == 0:
        raise ValueError("no positive values to histogram")
    exps = torch.floor(torch.log2(v)).long()
    lo, hi = int(exps.min()), int(exps.max())
    counts = torch.bincount(exps - lo, minlength=hi - lo + 1)
    return [2.0 ** e for e in range(lo, hi + 1)], counts.tolist()


# --- one tensor-wide INT8 scale ----------------------------------------------------------------

def int8_scale(x: torch.Tensor, *, exclude_dims=()) -> float:
    """The tensor-wide INT8 scale ``max|x| / 127`` over the last dimension, leaving out ``exclude_dims``."""
    keep = torch.ones(x.shape[-1], dtype=torch.bool)
    keep[list(exclude_dims)] = False
    if not keep.any():
        raise ValueError("exclude_dims leaves no dimension")
    return x[..., keep].abs().max().item() / 127


def int8_codes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """INT8 codes ``round(x / scale)`` clipped to -128..127 (int16 to keep it simple)."""
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    return (x / scale).round().clamp(-128, 127).to(torch.int16)


# --- the fixes, each on a real projection ------------------------------------------------------

def fake_int8(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Symmetric INT8 round trip with one scale per tensor (``dim=None``), per row (``dim=1``:
    per token for activations, per output row for weights) or per column (``dim=0``: per channel)."""
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (a / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return (t / scale).round().clamp(-127, 127) * scale


def per_token_error(y: torch.Tensor, y_hat: torch.Tensor) -> float:
    """Mean over tokens of ``||y_t - y_hat_t|| / ||y_t||``: every token counts the same,
    however large its output (one token with a huge activation would dominate a norm over all)."""
    if y.shape != y_hat.shape or y.dim() != 2:
        raise ValueError(f"expected two (n_tokens, out) tensors of one shape, got {tuple(y.shape)}, {tuple(y_hat.shape)}")
    return ((y - y_hat).norm(dim=1) / y.norm(dim=1).clamp_min(1e-12)).mean().item()


def _check_xw(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be (n_tokens, in) and w (out, in) with the same in; got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")


def w8a8_output(x: torch.Tensor, w: torch.Tensor, act: str | None = "tensor") -> torch.Tensor:
    """``x W^T`` with INT8 per-row weights and INT8 activations scaled per ``act``:
    ``"tensor"``, ``"token"``, ``"channel"`` or ``None`` (activations left in float: weights only).

    Per-channel activation scales sit on the summed dimension, so an integer matmul cannot
    apply them after the sum; they are shown as a bound on what scales alone could do.
    """
    _check_xw(x, w)
    dims = {"tensor": None, "token": 1, "channel": 0}
    if act is not None and act not in dims:
        raise ValueError(f"act must be one of {list(dims)} or None, got {act!r}")
    x_hat = x if act is None else fake_int8(x, dims[act])
    return x_hat @ fake_int8(w, 1).T


def outlier_mask(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Input dimensions where some token's |x| exceeds ``threshold`` (LLM.int8 uses 6.0), (in,) bool."""
    return x.abs().amax(dim=0) > threshold


def llm_int8_output(x: torch.Tensor, w: torch.Tensor, threshold: float = 6.0, *, act: str = "token") -> torch.Tensor:
    """LLM.int8 (Dettmers et al. 2022): outlier dimensions in float, the rest in INT8.

    The columns of ``x`` (and of ``W``) where any |x| > ``threshold`` are multiplied in
    full precision; the others with INT8 activations (per token, as LLM.int8 does, or
    ``act="tensor"``) and INT8 per-row weights. The two partial products are added.
    """
    _check_xw(x, w)
    keep = outlier_mask(x, threshold)
    dims = {"tensor": None, "token": 1}
    if act not in dims:
        raise ValueError(f"act must be 'token' or 'tensor', got {act!r}")
    rest = ~keep
    y = x.new_zeros(x.shape[0], w.shape[0])
    if rest.any():
        y = y + fake_int8(x[:, rest], dims[act]) @ fake_int8(w[:, rest], 1).T
    if keep.any():
        y = y + x[:, keep] @ w[:, keep].T
    return y


def smoothquant_scales(x: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors ``max|x_j|^alpha / max|W_:,j|^(1 - alpha)``, (in,)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    eps = 1e-5
    return x.abs().amax(dim=0).clamp_min(eps).pow(alpha) / w.abs().amax(dim=0).clamp_min(eps).pow(1 - alpha)


def smoothquant_output(x: torch.Tensor, w: torch.Tensor, alpha: float = 0.5, *, act: str = "tensor") -> torch.Tensor:
    """SmoothQuant (Xiao et al. 2023): divide the inputs by ``s`` and multiply the weights by it
    (the product is unchanged), then quantize both to INT8 (activations per ``act``)."""
    _check_xw(x, w)
    s = smoothquant_scales(x, w, alpha)
    return w8a8_output(x / s, w * s, act)


def fix_errors(x: torch.Tensor, w: torch.Tensor, *, threshold: float = 6.0, alpha: float = 0.5) -> dict[str, float]:
    """The chapter's table: :func:`per_token_error` of each way to run ``x W^T`` in INT8."""
    _check_xw(x, w)
    x, w = x.float(), w.float()
    y = x @ w.T
    outputs = {
        "weights INT8 only (activations float)": w8a8_output(x, w, None),
        "activations per-tensor": w8a8_output(x, w, "tensor"),
        "activations per-token": w8a8_output(x, w, "token"),
        "activations per-channel (not an integer matmul)": w8a8_output(x, w, "channel"),
        f"LLM.int8, threshold {threshold:g}": llm_int8_output(x, w, threshold),
        f"SmoothQuant alpha {alpha:g}, per-tensor": smoothquant_output(x, w, alpha, act="tensor"),
        f"SmoothQuant alpha {alpha:g}, per-token": smoothquant_output(x, w, alpha, act="token"),
    }
    return {name: per_token_error(y, y_hat) for name, y_hat in outputs.items()}


def threshold_sweep(x: torch.Tensor, w: torch.Tensor, thresholds) -> dict[str, list]:
    """LLM.int8 at each threshold: error (per-token and per-tensor inner INT8) and dimensions kept."""
    x, w = x.float(), w.float()
    y = x @ w.T
    out = {"threshold": list(thresholds), "kept": [], "error_token": [], "error_tensor": []}
    for t in thresholds:
        out["kept"].append(int(outlier_mask(x, t).sum()))
        out["error_token"].append(per_token_error(y, llm_int8_output(x, w, t, act="token")))
        out["error_tensor"].append(per_token_error(y, llm_int8_output(x, w, t, act="tensor")))
    return out


def alpha_sweep(x: torch.Tensor, w: torch.Tensor, alphas) -> dict[str, list]:
    """SmoothQuant at each alpha: the error with per-tensor and with per-token activation scales."""
    x, w = x.float(), w.float()
    y = x @ w.T
    return {"alpha": list(alphas),
            "error_tensor": [per_token_error(y, smoothquant_output(x, w, a, act="tensor")) for a in alphas],
            "error_token": [per_token_error(y, smoothquant_output(x, w, a, act="token")) for a in alphas]}


def threshold_figure(sweeps: dict[str, dict], threshold: float):
    """The chapter 06 widget's chart: LLM.int8 error vs threshold for each layer, the chosen
    threshold marked. A pure function of precomputed sweeps (name -> :func:`threshold_sweep`)."""
    from .plots import PALETTE, figure

    parts = []
    fig = figure("", "outlier threshold (|x| above it stays in float)", "mean per-token output error",
                 log_x=True, log_y=True)
    for i, (name, sw) in enumerate(sweeps.items()):
        if threshold not in sw["threshold"]:
            raise ValueError(f"threshold {threshold} is not among the precomputed {sw['threshold']}")
        j = sw["threshold"].index(threshold)
        fig.add_scatter(x=sw["threshold"], y=sw["error_token"], name=name, mode="lines",
                        line=dict(color=PALETTE[i % len(PALETTE)]))
        fig.add_scatter(x=[threshold], y=[sw["error_token"][j]], mode="markers", showlegend=False,
                        marker=dict(size=12, color=PALETTE[i % len(PALETTE)]),
                        name=f"{name}: {sw['kept'][j]} dims in float")
        parts.append(f"{short_name(name)}: {sw['kept'][j]} dims kept, error {sw['error_token'][j]:.4f}")
    fig.update_layout(title=f"Threshold {threshold:g} -- " + "; ".join(parts))
    return fig


def short_name(module_name: str) -> str:
    """``model.layers.11.mlp.down_proj`` -> ``layers.11.mlp.down_proj``."""
    return module_name.removeprefix("model.")


# --- choosing the layers to measure ---------------------------------------------------------

@torch.no_grad()
def capture_projection_inputs(model, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every projection's input for one prompt, name -> (n_tokens, in_features), float32 (hooks only)."""
    return capture_inputs(model, projection_modules(model), input_ids.to(model.device), chunk_tokens=input_ids.shape[1])


def outlier_ratio(x: torch.Tensor) -> float:
    """How far the largest dimension stands out: max over dims of max|x| / the median dimension's max|x|."""
    m = x.abs().amax(dim=0)
    return (m.max() / m.median().clamp_min(1e-12)).item()


def pick_layers(inputs: dict[str, torch.Tensor]) -> dict[str, str]:
    """Two projections to measure the fixes on, chosen from this run's activations:

    ``"reads the residual stream"``: the query projection whose input stands out most
    (its input is the normalised residual stream); ``"most extreme input"``: the projection
    of any kind whose input stands out most. Either may be missing (no ``q_proj``).
    """
    ratios = {name: outlier_ratio(x) for name, x in inputs.items()}
    picked = {}
    queries = [n for n in ratios if n.endswith("q_proj")]
    if queries:
        picked["reads the residual stream"] = max(queries, key=ratios.get)
    extreme = max(ratios, key=ratios.get)
    if extreme not in picked.values():
        picked["most extreme input"] = extreme
    return picked


def default_layer(n_layers: int) -> int:
    """Two thirds of the way up the stack (layer 16 of 24, as in the reference measurement)."""
    return min(n_layers - 1, round(2 * n_layers / 3))


def percentile_dims(maxima_row: torch.Tensor, percentiles=(90, 50, 10)) -> list[int]:
    """Dimensions whose max|h| sits at the given percentiles of one layer's maxima (typical dims)."""
    order = maxima_row.argsort()
    n = order.numel()
    return [int(order[min(n - 1, max(0, math.floor(p / 100 * n)))]) for p in percentiles]
