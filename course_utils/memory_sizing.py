"""Chapter 03 -- how much memory the KV cache needs, and how much context fits on a card.

For every token in context, every layer keeps one key and one value vector per
key-value head::

    kv_bytes_per_token = 2 (K and V) x layers x kv_heads x head_dim x bytes_per_element

:func:`kv_bytes_per_token` reads the shape from any model config (a transformers config or
a plain dict, through :func:`course_utils.models.model_dims`), so nothing here is tied to
one model. :func:`fit` then answers the practical question: on a card with so much memory,
with the weights at some precision and a runtime overhead, how many tokens of cache
remain, in total and per user?

Precisions are named (``"fp32"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"int4"``), given as
a ``torch.dtype``, or given as a number of bits per element. A quantized element also
pays for its share of the scales (:func:`quantized_bits`). The weight and KV-cache tables
differ on purpose: weight rows are long, so an int8 per-row scale is negligible and int4
is counted in groups of 128 with one fp16 scale each (the usual convention); a quantized cache is
charged as :mod:`course_utils.kv_quant` stores it -- groups of 64 with an fp16 step *and* an fp16
minimum each (asymmetric, as KIVI does), whichever axis the groups run along.

Byte counts are computed exactly (with :class:`fractions.Fraction`), so the tables
reproduce the reference figures to the token. Real files store more than 4.125 bits per int4
weight (chapter 05's ``quantize.gguf_mix`` computes a Q4_K_M file's mix); :func:`fit` takes
any number of bits per weight, so the tables can be redone with them.

The cache costs time as well as memory: a decode step reads the weights once and every
resident token's keys and values (:func:`step_read_bytes`). A quantized cache is judged at the bits
it really stores: :func:`cache_quantization_kl` measures what storing a real cache
another way (per token or per channel with :mod:`course_utils.kv_quant`, or FP8 e4m3 with
:func:`fp8_round_trip`) does to the next-token distributions, over several windows of text.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from numbers import Real
from pathlib import Path

import torch

from .models import model_dims
from .validation import check_non_negative_int, check_positive_int

GIB = 2**30
SHAPES_FILE = Path(__file__).resolve().parent / "data" / "model_shapes.json"


def _check_amount(name: str, value, *, allow_zero: bool = False) -> Fraction:
    """A finite real number > 0 (or >= 0) as an exact Fraction."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else 'positive'}, got {value!r}")
    return Fraction(value)


def quantized_bits(bits: int, group_size: int, *, scale_bits: int = 16, zero_point_bits: int = 0) -> float:
    """Bits one quantized element really costs: its own bits plus its share of the group's scale.

    ``quantized_bits(4, 128)`` -> 4.125 (int4, one fp16 scale per 128 weights);
    ``quantized_bits(4, 64)`` -> 4.25; an asymmetric scheme that also stores a 16-bit zero
    point per group adds another ``16 / group_size``.
    """
    for name, value in (("bits", bits), ("group_size", group_size)):
        check_positive_int(name, value)
    check_non_negative_int("scale_bits", scale_bits)
    check_non_negative_int("zero_point_bits", zero_point_bits)
    return bits + (scale_bits + zero_point_bits) / group_size


#: Bits per weight: int8 with per-row scales (neglected), int4 in groups of 128 with fp16 scales.
WEIGHT_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int4": quantized_bits(4, 128)}
#: Elements that share one step and one minimum in a quantized cache (``kv_quant.KVQuantSpec``'s default).
KV_GROUP = 64
#: Bits per cached key/value element: FP8 (e4m3, one scale per tensor, negligible); int8, int4 and int2 as
#: ``kv_quant`` stores them: the codes plus an fp16 step and an fp16 minimum per group of ``KV_GROUP``
#: (8.5, 4.5 and 2.5 bits; tests check that a stored cache holds exactly these).
KV_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8,
           **{f"int{b}": quantized_bits(b, KV_GROUP, zero_point_bits=16) for b in (8, 4, 2)}}
_NAMES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
          "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8"}


def _exact(x: Fraction) -> int | float:
    """An int when the value is whole (byte counts of plain dtypes), else a float."""
    return int(x) if x.denominator == 1 else float(x)


def _bits(precision, table: dict) -> Fraction:
    """Bits per element for a name in ``table``, a floating ``torch.dtype`` or a number of bits."""
    if isinstance(precision, torch.dtype):
        if not precision.is_floating_point:
            raise ValueError(f"a cache or weight dtype must be floating point, got {precision}; "
                             f"for quantized storage name it: {sorted(table)}")
        return Fraction(precision.itemsize * 8)
    if isinstance(precision, str):
        key = precision.lower().removeprefix("torch.")
        key = _NAMES.get(key, key)
        if key not in table:
            raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(table)}, "
                             f"a floating torch.dtype, or a number of bits per element")
        return Fraction(table[key])
    if isinstance(precision, Real) and not isinstance(precision, bool):
        return _check_amount("bits per element", precision)
    raise TypeError(f"precision must be a name such as 'fp16', a torch.dtype or a number of bits, "
                    f"got {type(precision).__name__}")


def kv_bits_per_element(precision) -> float:
    """Bits one cached key/value element costs at ``precision`` (scales included)."""
    return float(_bits(precision, KV_BITS))


def weight_bits_per_element(precision) -> float:
    """Bits one weight costs at ``precision`` (scales included where they matter)."""
    return float(_bits(precision, WEIGHT_BITS))


def _kv_bytes_per_token(config, precision) -> Fraction:
    return model_dims(config).kv_elements_per_token * _bits(precision, KV_BITS) / 8


def kv_bytes_per_token(config, dtype="fp16") -> int | float:
    """Bytes of KV cache per token of context, one sequence, all layers (chapter 03).

    ``config``: a transformers config or a dict with the usual field names. ``dtype``:
    ``"fp32"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"int4"``, a floating ``torch.dtype``
    or bits per element. Whole byte counts come back as ``int``.
    """
    return _exact(_kv_bytes_per_token(config, dtype))


def kv_cache_bytes(config, n_tokens: int, dtype="fp16", *, users: int = 1) -> int | float:
    """Bytes of KV cache for ``users`` sequences of ``n_tokens`` tokens each.

    Only the total number of resident tokens (``users * n_tokens``) matters.
    """
    check_positive_int("n_tokens", n_tokens)
    check_positive_int("users", users)
    return _exact(_kv_bytes_per_token(config, dtype) * n_tokens * users)


def with_kv_heads(config, n_kv_heads: int) -> dict:
    """The same shape as ``config`` as a dict, but with ``n_kv_heads`` key-value heads (MHA/GQA/MQA)."""
    check_positive_int("n_kv_heads", n_kv_heads)
    dims = model_dims(config)
    shape = {"num_hidden_layers": dims.n_layers, "num_attention_heads": dims.n_heads,
             "num_key_value_heads": n_kv_heads, "head_dim": dims.head_dim, "hidden_size": dims.d_model}
    model_dims(shape)  # raises if n_heads is not a multiple of n_kv_heads
    return shape


def attention_variants(config, dtype="fp16") -> dict[str, tuple[int, int | float]]:
    """KV bytes per token for MHA (kv heads = query heads), this model's kv heads, and MQA (1).

    Returns ``{label: (kv_heads, bytes_per_token)}``.
    """
    dims = model_dims(config)
    heads = {"MHA": dims.n_heads, "this model": dims.n_kv_heads, "MQA": 1}
    return {label: (h, kv_bytes_per_token(with_kv_heads(config, h), dtype)) for label, h in heads.items()}


def weight_bytes_at(n_params, precision="fp16") -> int | float:
    """Bytes of ``n_params`` weights stored at ``precision`` (see :data:`WEIGHT_BITS`)."""
    return _exact(_check_amount("n_params", n_params) * _bits(precision, WEIGHT_BITS) / 8)


def _n_params_of(config, n_params):
    if n_params is None:
        n_params = config.get("n_params") if isinstance(config, dict) else getattr(config, "n_params", None)
    if n_params is None:
        raise ValueError("give n_params (the model's parameter count): the config does not hold it; "
                         "n_params_from_config(config) can count it without weights")
    return n_params


@dataclass(frozen=True)
class Fit:
    """What a memory budget leaves for the KV cache (all sizes in bytes)."""

    memory_bytes: int | float
    overhead_bytes: int | float
    weights_bytes: int | float
    kv_bytes_per_token: int | float
    users: int
    free_bytes: int | float       # memory - overhead - weights; negative if the weights do not fit
    tokens_total: int             # floor(free_bytes / kv_bytes_per_token), 0 if nothing is free
    tokens_per_user: int          # tokens_total // users

    @property
    def fits(self) -> bool:
        """True when the weights and the overhead fit in the memory at all."""
        return self.free_bytes >= 0


def fit(memory_gib, config, *, n_params=None, weight_precision="fp16", kv_precision="fp16",
        overhead_gib=1.5, users: int = 1) -> Fit:
    """Tokens of KV cache that fit in ``memory_gib`` GiB next to the weights and a runtime overhead.

    tokens = floor((memory - overhead - n_params x weight_bits / 8) / kv_bytes_per_token),
    computed exactly. ``n_params`` defaults to ``config["n_params"]``. ``users`` share the
    tokens equally.
    """
    memory = _check_amount("memory_gib", memory_gib) * GIB
    overhead = _check_amount("overhead_gib", overhead_gib, allow_zero=True) * GIB
    check_positive_int("users", users)
    weights = _check_amount("n_params", _n_params_of(config, n_params)) * _bits(weight_precision, WEIGHT_BITS) / 8
    per_token = _kv_bytes_per_token(config, kv_precision)
    free = memory - overhead - weights
    tokens = math.floor(free / per_token) if free > 0 else 0
    return Fit(_exact(memory), _exact(overhead), _exact(weights), _exact(per_token), users, _exact(free),
               tokens, tokens // users)


def step_read_bytes(config, context_tokens: int, *, n_params=None, weight_precision="fp16", kv_precision="fp16",
                    users: int = 1) -> int | float:
    """Bytes one decode step reads at least: the weights once, plus the cache of every user (chapter 03).

    ``weights + users x context_tokens x kv_bytes_per_token``: the cache costs time as well as
    memory. Chapter 02's ``decode_step_bytes`` counts the same for a loaded model; chapter 04
    batches users and reads this growth off its measured steps.
    """
    check_non_negative_int("context_tokens", context_tokens)
    check_positive_int("users", users)
    weights = _check_amount("n_params", _n_params_of(config, n_params)) * _bits(weight_precision, WEIGHT_BITS) / 8
    return _exact(weights + users * context_tokens * _kv_bytes_per_token(config, kv_precision))


def crossover_tokens(config, *, n_params=None, weight_precision="fp16", kv_precision="fp16") -> int:
    """The smallest context at which one sequence's cache holds more bytes than the weights."""
    weights = _check_amount("n_params", _n_params_of(config, n_params)) * _bits(weight_precision, WEIGHT_BITS) / 8
    return math.floor(weights / _kv_bytes_per_token(config, kv_precision)) + 1


# --- model shapes -----------------------------------------------------------------------------

#: The three model classes of the chapter's "does it fit?" tables (nominal parameter counts).
#: The MLP width and vocabulary are those of Mistral-7B, Llama-2-13B and Llama-2-70B, the shapes these
#: classes stand for; only a file's mix of block types (chapter 05) needs them.
SYLLABUS_MODELS = {
    "7B (GQA)": {"n_params": 7_000_000_000, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096,
                 "intermediate_size": 14336, "vocab_size": 32000},
    "13B (MHA)": {"n_params": 13_000_000_000, "num_hidden_layers": 40, "num_attention_heads": 40,
                  "num_key_value_heads": 40, "head_dim": 128, "hidden_size": 5120,
                  "intermediate_size": 13824, "vocab_size": 32000},
    "70B (GQA)": {"n_params": 70_000_000_000, "num_hidden_layers": 80, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 8192,
                  "intermediate_size": 28672, "vocab_size": 32000},
}


@lru_cache(maxsize=1)
def _shapes_json() -> str:
    return SHAPES_FILE.read_text(encoding="utf-8")


def model_shapes() -> dict[str, dict]:
    """Shapes of well-known models (``course_utils/data/model_shapes.json``): name -> config dict.

    Each dict has transformers' field names plus ``n_params`` and ``hub_id``, so it can be
    passed straight to :func:`kv_bytes_per_token` and :func:`fit`.
    """
    return json.loads(_shapes_json())["models"]


def n_params_from_config(config) -> int:
    """Count a model's parameters from its config alone: build it on PyTorch's meta device.

    No memory is allocated and nothing is downloaded. ``config`` is a transformers config
    or a dict with ``model_type`` and transformers' field names. Tied embeddings count once.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    if isinstance(config, dict):
        if "model_type" not in config:
            raise ValueError("a config dict needs 'model_type' (e.g. 'llama') to build the architecture")
        fields = {k: v for k, v in config.items() if k not in ("model_type", "hub_id", "n_params")}
        config = AutoConfig.for_model(config["model_type"], **fields)
    elif not isinstance(config, PretrainedConfig):
        raise TypeError(f"expected a transformers config or a dict, got {type(config).__name__}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# --- checking the formula against a real cache --------------------------------------------------

@torch.no_grad()
def measured_cache_bytes(model, batch_size: int, n_tokens: int, *, seed: int = 0) -> int:
    """Bytes held by the cache tensors after a prefill of ``batch_size`` x ``n_tokens`` random tokens."""
    from transformers import DynamicCache

    from .kv_cache import cache_nbytes, prefill

    check_positive_int("batch_size", batch_size)
    check_positive_int("n_tokens", n_tokens)
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, n_tokens), generator=gen).to(model.device)
    cache = DynamicCache(config=model.config)
    prefill(model, ids, cache)
    return cache_nbytes(cache)


# --- quantizing a real cache ---------------------------------------------------------------------

FP8_E4M3_MAX = 448.0            # the largest finite float8_e4m3fn number


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` stored as FP8 e4m3 with one scale per tensor (absmax -> 448) and read back in its own dtype.

    A batch of sequences (the first dimension of a 2-D or larger tensor) gets one scale per sequence,
    so each sequence's numbers are what they would be alone.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor, got {type(x).__name__}")
    dims = tuple(range(1, x.dim())) if x.dim() >= 2 else tuple(range(x.dim()))
    scale = (x.abs().amax(dim=dims, keepdim=True).float() / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def channel_spread(x: torch.Tensor) -> float:
    """How unequal a cache tensor's channels are: the largest channel's max |x| over the median channel's.

    ``x``: (batch, kv_heads, tokens, head_dim); the maximum is over tokens, the median over the
    channels of every head. A few large channels (keys, after the rotary embedding) give a large value.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a (batch, kv_heads, tokens, head_dim) tensor, got {getattr(x, 'shape', x)!r}")
    per_channel = x.abs().float().amax(dim=(0, 2))                   # (kv_heads, head_dim)
    return float(per_channel.amax(-1).div(per_channel.median(-1).values.clamp_min(1e-30)).mean())


@dataclass(frozen=True)
class CacheQuality:
    """What one way of storing the cache did, window by window (:func:`cache_quantization_kl`).

    ``kl``: mean KL divergence (nats) of each window's scored next-token distributions from the exact
    cache's; ``same``: how many of each window's scored positions kept their most likely token;
    ``scored``: positions scored per window.
    """

    kl: tuple[float, ...]
    same: tuple[int, ...]
    scored: int

    @property
    def positions(self) -> int:
        return self.scored * len(self.kl)

    @property
    def same_share(self) -> float:
        """Share of all scored positions (every window) whose most likely token is unchanged."""
        return sum(self.same) / self.positions


@torch.no_grad()
def cache_quantization_kl(model, input_ids: torch.Tensor, schemes: dict, *, scored_tokens: int = 32) -> dict:
    """What storing the cache another way does to the next-token distributions (chapter 03).

    ``input_ids``: (windows, len) token ids, each row a separate piece of text, measured on its own
    (one window at a time, which keeps the memory of one window's cache and logits). The first
    ``len - scored_tokens`` tokens of a row are prefilled into a cache; for each scheme
    ``name -> (keys_fn, values_fn)`` every layer's keys and values are replaced by ``keys_fn(keys)`` /
    ``values_fn(values)`` (tensors (1, kv_heads, tokens, head_dim)) and the row's last ``scored_tokens``
    tokens are run against it. Returns ``name -> CacheQuality``, one KL and one count per window, so
    their spread can be shown.
    """
    from transformers import DynamicCache

    check_positive_int("scored_tokens", scored_tokens)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] <= scored_tokens:
        raise ValueError(f"input_ids must be (windows, > {scored_tokens}) token ids, got "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")
    prefix_len = input_ids.shape[1] - scored_tokens
    kls: dict[str, list[float]] = {name: [] for name in schemes}
    sames: dict[str, list[int]] = {name: [] for name in schemes}
    for row in input_ids:
        ids = row[None]
        cache = DynamicCache(config=model.config)
        model(ids[:, :prefix_len], cache=cache, use_cache=True, logits_to_keep=1)
        exact = [(layer.keys, layer.values) for layer in cache.layers]

        def scored_log_probs(keys_fn, values_fn):
            for layer, (k, v) in zip(cache.layers, exact):
                layer.keys, layer.values = keys_fn(k), values_fn(v)
                if layer.keys.shape != k.shape or layer.values.shape != v.shape:
                    raise ValueError(f"a scheme must return tensors of the shape it was given, {tuple(k.shape)}")
            logits = model(ids[:, prefix_len:], cache=cache, use_cache=True).logits[0].float()
            cache.crop(-scored_tokens)                # back to the prefix (a negative count: tokens to drop)
            return logits.log_softmax(-1)             # (scored, vocab)

        reference = scored_log_probs(lambda k: k, lambda v: v)
        p_ref = reference.exp()
        for name, (keys_fn, values_fn) in schemes.items():
            log_q = scored_log_probs(keys_fn, values_fn)
            kls[name].append(max((p_ref * (reference - log_q)).sum(-1).mean().item(), 0.0))
            sames[name].append(int((log_q.argmax(-1) == reference.argmax(-1)).sum().item()))
            del log_q
        del cache, exact, reference, p_ref
    return {name: CacheQuality(tuple(kls[name]), tuple(sames[name]), scored_tokens) for name in schemes}


# --- widget -----------------------------------------------------------------------------------

def _fmt_gib(n_bytes) -> str:
    return f"{float(n_bytes) / GIB:,.2f} GiB"


def fit_figure(memory_gib, model: str, weight_precision: str, kv_precision: str, users: int, *,
               models: dict, overhead_gib=1.5):
    """Widget figure: where the memory goes (left) and context per user vs users (right).

    Pure: depends only on its arguments. ``models`` maps names to config dicts with
    ``n_params`` (e.g. :data:`SYLLABUS_MODELS` merged with :func:`model_shapes`).
    """
    from plotly.subplots import make_subplots

    from .plots import PALETTE, TEMPLATE

    if model not in models:
        raise ValueError(f"unknown model {model!r}; expected one of {sorted(models)}")
    config = models[model]
    f = fit(memory_gib, config, weight_precision=weight_precision, kv_precision=kv_precision,
            overhead_gib=overhead_gib, users=users)
    used_kv = f.tokens_per_user * users * Fraction(f.kv_bytes_per_token)
    title = (f"{model}, {weight_precision} weights, {kv_precision} cache, {memory_gib} GiB, {users} users: "
             + (f"{f.tokens_per_user:,} tokens of context each" if f.fits else "the weights do not fit"))
    fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55], horizontal_spacing=0.12,
                        subplot_titles=("Where the memory goes", "Context per user vs users"))
    parts = {"runtime overhead": f.overhead_bytes, "weights": f.weights_bytes, "KV cache (all users)": used_kv,
             "left over": max(0, Fraction(f.free_bytes) - used_kv)}
    for (name, n_bytes), color in zip(parts.items(), [PALETTE[7], PALETTE[0], PALETTE[1], "#DDDDDD"]):
        fig.add_bar(x=[float(n_bytes) / GIB], y=["memory"], orientation="h", name=name, marker_color=color,
                    hovertemplate=f"{name}: {_fmt_gib(n_bytes)}<extra></extra>", row=1, col=1)
    counts = [2**k for k in range(0, 11)]
    per_user = [f.tokens_total // u for u in counts]
    fig.add_scatter(x=counts, y=[max(t, 0.5) for t in per_user], mode="lines+markers", name="tokens per user",
                    line_color=PALETTE[2], row=1, col=2)
    fig.add_scatter(x=[users], y=[max(f.tokens_per_user, 0.5)], mode="markers", name="this choice",
                    marker=dict(size=14, color=PALETTE[5], symbol="diamond"), row=1, col=2)
    fig.add_vline(x=float(memory_gib), line_dash="dash", line_color=PALETTE[5], row=1, col=1)
    fig.update_layout(template=TEMPLATE, title=title, barmode="stack", height=420, hovermode="closest")
    fig.update_xaxes(title="memory (GiB)", range=[0, max(float(memory_gib), float(f.overhead_bytes + f.weights_bytes) / GIB) * 1.05],
                     row=1, col=1)
    fig.update_xaxes(title="concurrent users", type="log", row=1, col=2)
    fig.update_yaxes(title="tokens of context per user", type="log", row=1, col=2)
    return fig


def fit_bars_figure(cards: dict, *, title: str):
    """Where each card's memory goes: one stacked bar per (model, precision), weights | runtime | KV cache.

    ``cards`` maps a card's label to ``{row label: Fit}`` (a pure function of them). A bar whose weights
    and runtime overflow the card shows the overflow and no cache; a dashed line marks the card's size.
    """
    from plotly.subplots import make_subplots

    from .plots import PALETTE, TEMPLATE

    labels = list(cards)
    fig = make_subplots(rows=1, cols=len(labels), subplot_titles=labels, shared_yaxes=True,
                        horizontal_spacing=0.04)
    parts = [("weights", PALETTE[0]), ("runtime", PALETTE[7]), ("KV cache", PALETTE[1]), ("over the card", PALETTE[5])]
    for col, label in enumerate(labels, start=1):
        rows = cards[label]
        names = list(rows)
        values = {"weights": [], "runtime": [], "KV cache": [], "over the card": []}
        for f in rows.values():
            weights, runtime = float(f.weights_bytes) / GIB, float(f.overhead_bytes) / GIB
            values["weights"].append(min(weights, float(f.memory_bytes) / GIB))
            values["runtime"].append(max(0.0, min(runtime, float(f.memory_bytes) / GIB - weights)))
            values["KV cache"].append(max(0.0, float(f.free_bytes)) / GIB)
            values["over the card"].append(max(0.0, -float(f.free_bytes)) / GIB)
        for name, color in parts:
            fig.add_bar(x=values[name], y=names, orientation="h", name=name, marker_color=color, legendgroup=name,
                        showlegend=col == 1, row=1, col=col,
                        hovertemplate=f"{name}: %{{x:,.2f}} GiB<extra>%{{y}}</extra>")
        memory = float(next(iter(rows.values())).memory_bytes) / GIB
        fig.add_vline(x=memory, line_dash="dash", line_color=PALETTE[7], row=1, col=col)
        fig.update_xaxes(title="GiB", row=1, col=col)
    fig.update_layout(template=TEMPLATE, title=title, barmode="stack", height=170 + 34 * max(len(r) for r in cards.values()),
                      hovermode="closest", margin=dict(b=110),
                      legend=dict(orientation="h", yanchor="top", y=-0.28, xanchor="left", x=0.0))
    fig.update_yaxes(autorange="reversed")
    return fig
