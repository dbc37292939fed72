"""Chapter 06 -- activation outliers: a few huge values, where they sit, and the fixes people use.

The organising picture is a (tokens x dimensions) matrix of activations per layer, in which
large values come in two shapes:

* **massive activations** (Sun et al. 2024): a few values, on one or two tokens (often the
  first), thousands of times the median, written into the residual stream by one layer and
  carried unchanged through many (:func:`massive_activations`; :func:`residual_updates` shows
  which layer's attention or MLP wrote them; :func:`attention_to_first_token` measures the
  attention that token draws);
* **outlier features** (Dettmers et al. 2022): a few *dimensions* that are large on many tokens
  in the inputs the projections read (:func:`outlier_features`, LLM.int8's criterion).

* :func:`residual_stream` records every decoder layer's output with forward hooks (the
  model is not changed); :func:`dim_max` reduces it to the largest |h| each dimension
  reaches per layer; :func:`outlier_dims` and :func:`outlier_span` find the dimensions
  that stand out and the layers where they do; :func:`token_dim_figure` draws the matrix.
* :func:`int8_codes` with chapter 05's :func:`~course_utils.quantize.count_levels` shows what
  one tensor-wide INT8 scale does to the ordinary dimensions when one value sets it.
* The fixes, each measured as the output error of a real projection fed with the
  activations captured from the model (:func:`capture_projection_inputs`):
  per-token and per-channel scales (:func:`w8a8_output`), LLM.int8's mixed-precision
  decomposition (:func:`llm_int8_output`) and SmoothQuant's migration of the difficulty
  into the weights (:func:`smoothquant_output`, its smoothing factors calibrated on other text
  than the text it is measured on).

All quantization here is symmetric absmax INT8, the convention of chapter 05: the codes
-127..127 of a scale, 255 levels around an exact zero; the 256th code, -128, stays unused.
It is simulated in float32 ("fake quantization").
"""
from __future__ import annotations

import math

import torch

from .hooks import capture_inputs, decoder_layers, projection_modules
from .quantize import qmax


# --- recording the residual stream --------------------------------------------------------------

def _check_one_sequence(input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be (1, n_tokens), got {getattr(input_ids, 'shape', type(input_ids))}")


@torch.no_grad()
def residual_stream(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The residual stream after every decoder layer, (n_layers, n_tokens, d_model), float32 on the CPU.

    Forward hooks on each layer record its output (the hidden state the next layer reads);
    the hooks are removed afterwards, whatever happens.
    """
    _check_one_sequence(input_ids)
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


# --- tokens x dimensions: massive activations and outlier features ------------------------------

@torch.no_grad()
def residual_updates(model, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """What writes the residual stream: the token embeddings and each layer's two additions.

    Returns ``{"embeddings": (n_tokens, d), "attention": (n_layers, n_tokens, d), "mlp": (n_layers,
    n_tokens, d)}``, float32 on the CPU, from forward hooks on each layer's ``self_attn`` and ``mlp``
    (llama / qwen2 names). Layer l's output is ``h[l-1] + attention[l] + mlp[l]``, added in that order.
    """
    _check_one_sequence(input_ids)
    layers = decoder_layers(model)
    if not all(hasattr(b, "self_attn") and hasattr(b, "mlp") for b in layers):
        raise ValueError("residual_updates needs decoder layers with .self_attn and .mlp (llama, qwen2, ...)")
    got: dict[str, list[torch.Tensor]] = {"attention": [], "mlp": []}

    def keep(key):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            got[key].append(out[0].detach().float().cpu())
        return hook

    hooks = [h for b in layers for h in (b.self_attn.register_forward_hook(keep("attention")),
                                          b.mlp.register_forward_hook(keep("mlp")))]
    try:
        ids = input_ids.to(model.device)
        embeddings = model.get_input_embeddings()(ids)[0].float().cpu()
        model(ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {"embeddings": embeddings, "attention": torch.stack(got["attention"]), "mlp": torch.stack(got["mlp"])}


def massive_activations(h: torch.Tensor, *, min_abs: float = 100.0, ratio: float = 1000.0) -> list[dict]:
    """Sun et al. (2024)'s massive activations in a residual stream ``h`` (n_layers, n_tokens, d).

    A value counts if ``|h| > min_abs`` and ``|h| > ratio`` x the median |h| of its layer (their
    criterion: above 100 and about 1,000 times the median). One dict per (token, dimension) that
    has any, largest first: ``token``, ``dim``, ``peak`` (largest |h|), ``peak_layer``, and the
    ``layers`` where it counts.
    """
    if h.dim() != 3:
        raise ValueError(f"expected (n_layers, n_tokens, d_model), got shape {tuple(h.shape)}")
    a = h.abs()
    median = a.flatten(1).median(dim=1).values                   # (n_layers,)
    hit = (a > min_abs) & (a > ratio * median[:, None, None])
    found = []
    for token, dim in hit.any(dim=0).nonzero().tolist():
        col = a[:, token, dim]
        found.append({"token": token, "dim": dim, "peak": col.max().item(), "peak_layer": int(col.argmax()),
                      "layers": hit[:, token, dim].nonzero().flatten().tolist()})
    return sorted(found, key=lambda f: -f["peak"])


def outlier_features(inputs: list[torch.Tensor], *, threshold: float = 6.0, token_share: float = 0.06,
                     layer_share: float = 0.25) -> dict[int, int]:
    """LLM.int8's outlier features (Dettmers et al. 2022) in the inputs of one kind of projection.

    ``inputs``: one (n_tokens, d) tensor per layer (e.g. what every q_proj reads). A dimension is
    an outlier feature if ``|x| >= threshold`` on at least ``token_share`` of the tokens in at least
    ``layer_share`` of the layers (their criterion: 6, 6 % of the sequence, 25 % of the layers).
    Returns ``{dimension: number of layers where it qualifies}``, most layers first.
    """
    if not inputs or any(x.dim() != 2 or x.shape[1] != inputs[0].shape[1] for x in inputs):
        raise ValueError("inputs must be a non-empty list of (n_tokens, d) tensors of one width d")
    per_layer = torch.stack([((x.abs() >= threshold).float().mean(dim=0) >= token_share) for x in inputs])
    layers = per_layer.sum(dim=0)
    keep = (layers >= layer_share * len(inputs)) & (layers > 0)
    dims = sorted(keep.nonzero().flatten().tolist(), key=lambda d: -int(layers[d]))
    return {d: int(layers[d]) for d in dims}


@torch.no_grad()
def attention_to_first_token(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Share of each query's attention that lands on the first token, per layer, (n_layers,).

    Averaged over heads and over the query positions 1..n-1 (position 0 can only attend to itself).
    The attention weights need transformers' eager attention: the model is switched to it for this
    one forward pass and back afterwards.
    """
    _check_one_sequence(input_ids)
    if input_ids.shape[1] < 2:
        raise ValueError("need at least 2 tokens to measure attention to the first one")
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation("eager")
        att = model(input_ids.to(model.device), output_attentions=True, use_cache=False).attentions
    finally:
        model.set_attn_implementation(before)
    return torch.stack([a[0, :, 1:, 0].float().mean() for a in att]).cpu()


def token_dim_figure(x: torch.Tensor, token_labels: list[str], *, title: str, color_title: str = "|value|"):
    """Heatmap of |x| (tokens x dimensions), logarithmic colours; ``x``: (n_tokens, d)."""
    import plotly.graph_objects as go

    from .plots import figure

    if x.dim() != 2 or len(token_labels) != x.shape[0]:
        raise ValueError(f"x must be (n_tokens, d) with one label per token; got {tuple(x.shape)} and "
                         f"{len(token_labels)} labels")
    z = x.abs().float().clamp_min(1e-3).log10()
    top = math.ceil(z.max().item())
    ticks = list(range(math.floor(z.min().item()), top + 1))
    fig = figure(title, "dimension", "token (position: text)", height=520)
    fig.add_trace(go.Heatmap(z=z.tolist(), y=[f"{i}: {t}" for i, t in enumerate(token_labels)], colorscale="Cividis",
                             colorbar=dict(title=color_title, tickvals=ticks, ticktext=[f"{10.0 ** t:g}" for t in ticks]),
                             hovertemplate="dimension %{x}<br>token %{y}<br>log10 |value| %{z:.2f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", showticklabels=x.shape[0] <= 40)
    return fig


# --- one tensor-wide INT8 scale ----------------------------------------------------------------

def int8_scale(x: torch.Tensor, *, exclude_dims=()) -> float:
    """The tensor-wide INT8 scale ``max|x| / 127`` over the last dimension, leaving out ``exclude_dims``."""
    keep = torch.ones(x.shape[-1], dtype=torch.bool)
    keep[list(exclude_dims)] = False
    if not keep.any():
        raise ValueError("exclude_dims leaves no dimension")
    return x[..., keep].abs().max().item() / qmax(8)


#: Levels of symmetric INT8: the codes -127..127 (chapter 05's convention; -128 stays unused).
INT8_LEVELS = 2 * qmax(8) + 1


def int8_codes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """INT8 codes ``round(x / scale)`` clipped to -127..127, the 255 symmetric levels (int16 to keep it simple)."""
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    return (x / scale).round().clamp(-qmax(8), qmax(8)).to(torch.int16)


# --- the fixes, each on a real projection ------------------------------------------------------

def fake_int8(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Symmetric INT8 round trip with one scale per tensor (``dim=None``), per row (``dim=1``:
    per token for activations, per output row for weights) or per column (``dim=0``: per channel)."""
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    q = qmax(8)
    scale = (a / q).clamp_min(torch.finfo(torch.float32).tiny)
    return (t / scale).round().clamp(-q, q) * scale


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


def smoothquant_output(x: torch.Tensor, w: torch.Tensor, alpha: float = 0.5, *, act: str = "tensor",
                       x_calib: torch.Tensor | None = None) -> torch.Tensor:
    """SmoothQuant (Xiao et al. 2023): divide the inputs by ``s`` and multiply the weights by it
    (the product is unchanged), then quantize both to INT8 (activations per ``act``).

    ``s`` comes from ``x_calib`` (other text, as a deployed model's factors are fixed offline and
    folded into the norm before it) when given, else from ``x`` itself.
    """
    _check_xw(x, w)
    if x_calib is not None:
        _check_xw(x_calib, w)
    s = smoothquant_scales(x if x_calib is None else x_calib.float(), w, alpha)
    return w8a8_output(x / s, w * s, act)


def fix_errors(x: torch.Tensor, w: torch.Tensor, *, threshold: float = 6.0, alpha: float = 0.5,
               x_calib: torch.Tensor | None = None, alpha_label: str | None = None) -> dict[str, float]:
    """The chapter's table: :func:`per_token_error` of each way to run ``x W^T`` in INT8.

    Every scale is computed from ``x`` itself (dynamic quantization) except SmoothQuant's
    smoothing factors, which come from ``x_calib`` when given (see :func:`smoothquant_output`).
    ``alpha_label``: the words naming SmoothQuant's α in the method's name (default ``"alpha 0.5"``), so that
    projections run at different calibrated α share one row name.
    """
    _check_xw(x, w)
    if alpha_label is not None and (not isinstance(alpha_label, str) or not alpha_label.strip()):
        raise ValueError(f"alpha_label must be a non-empty string, got {alpha_label!r}")
    a_name = alpha_label if alpha_label is not None else f"alpha {alpha:g}"
    x, w = x.float(), w.float()
    y = x @ w.T
    outputs = {
        "weights INT8 only (activations float)": w8a8_output(x, w, None),
        "activations per-tensor": w8a8_output(x, w, "tensor"),
        "activations per-token": w8a8_output(x, w, "token"),
        "activations per-channel (not an integer matmul)": w8a8_output(x, w, "channel"),
        f"LLM.int8, threshold {threshold:g}": llm_int8_output(x, w, threshold),
        f"SmoothQuant {a_name}, per-tensor": smoothquant_output(x, w, alpha, act="tensor", x_calib=x_calib),
        f"SmoothQuant {a_name}, per-token": smoothquant_output(x, w, alpha, act="token", x_calib=x_calib),
    }
    return {name: per_token_error(y, y_hat) for name, y_hat in outputs.items()}


def fix_errors_by_chunk(x: torch.Tensor, w: torch.Tensor, chunk_tokens: int, *, threshold: float = 6.0,
                        alpha: float = 0.5, x_calib: torch.Tensor | None = None,
                        alpha_label: str | None = None) -> dict[str, list[float]]:
    """:func:`fix_errors` on each chunk of ``chunk_tokens`` consecutive rows of ``x`` (n_tokens, in):
    method -> one error per chunk (chapter 06).

    With the chunks read as independent texts (as :func:`~course_utils.hooks.capture_inputs` runs
    them), the spread of each list is the spread between texts: a difference between two methods
    counts only if it stands out of it (a paired test over the chunks, :func:`course_utils.stats.paired_t_test`).
    ``x`` must hold a whole number of chunks, at least two.
    """
    _check_xw(x, w)
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    n_chunks, rest = divmod(x.shape[0], chunk_tokens)
    if rest or n_chunks < 2:
        raise ValueError(f"x must hold a whole number (at least 2) of chunks of {chunk_tokens} tokens; "
                         f"got {x.shape[0]} tokens")
    per_chunk = [fix_errors(c, w, threshold=threshold, alpha=alpha, x_calib=x_calib, alpha_label=alpha_label)
                 for c in x.split(chunk_tokens)]
    return {method: [e[method] for e in per_chunk] for method in per_chunk[0]}


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


def alpha_sweep(x: torch.Tensor, w: torch.Tensor, alphas, *, x_calib: torch.Tensor | None = None) -> dict[str, list]:
    """SmoothQuant at each alpha: the error on ``x`` with per-tensor and with per-token activation
    scales, the smoothing factors calibrated on ``x_calib`` when given."""
    x, w = x.float(), w.float()
    y = x @ w.T
    run = lambda a, act: per_token_error(y, smoothquant_output(x, w, a, act=act, x_calib=x_calib))
    return {"alpha": list(alphas), "error_tensor": [run(a, "tensor") for a in alphas],
            "error_token": [run(a, "token") for a in alphas]}


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


def token_concentration(x: torch.Tensor) -> float:
    """How much one token stands out in ``x`` (n_tokens, d): the largest token's max|x| over the
    median token's max|x| (a massive activation on one token gives thousands)."""
    rows = x.abs().amax(dim=1)
    return (rows.max() / rows.median().clamp_min(1e-12)).item()


def dimension_concentration(x: torch.Tensor) -> float:
    """How much one dimension stands out on *every* token of ``x`` (n_tokens, d): the largest
    per-dimension median |x| over the tokens, divided by the median |x| of the whole tensor."""
    a = x.abs()
    return (a.median(dim=0).values.max() / a.median().clamp_min(1e-12)).item()


def pick_layers(inputs: dict[str, torch.Tensor]) -> dict[str, str]:
    """Two projections to measure the fixes on, chosen from this run's activations (name -> (n_tokens, in)):

    ``"one token"``: the projection whose input is most dominated by one token
    (:func:`token_concentration`: a massive activation); ``"one dimension"``: the one whose input
    is most dominated by a dimension that is large on every token rather than on one
    (:func:`dimension_concentration` / :func:`token_concentration`: an outlier feature). When both
    pick the same projection, only ``"one token"`` is returned.
    """
    if not inputs:
        raise ValueError("inputs is empty: nothing to choose from")
    tokens = {name: token_concentration(x) for name, x in inputs.items()}
    dims = {name: dimension_concentration(x) / tokens[name] for name, x in inputs.items()}
    picked = {"one token": max(tokens, key=tokens.get)}
    by_dim = max(dims, key=dims.get)
    if by_dim != picked["one token"]:
        picked["one dimension"] = by_dim
    return picked


def default_layer(n_layers: int) -> int:
    """Two thirds of the way up the stack (layer 16 of 24, as in the reference measurement)."""
    return min(n_layers - 1, round(2 * n_layers / 3))


def percentile_dims(maxima_row: torch.Tensor, percentiles=(90, 50, 10)) -> list[int]:
    """Dimensions whose max|h| sits at the given percentiles of one layer's maxima (typical dims)."""
    order = maxima_row.argsort()
    n = order.numel()
    return [int(order[min(n - 1, max(0, math.floor(p / 100 * n)))]) for p in percentiles]
