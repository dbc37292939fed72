"""Chapter 07 -- a quantized KV cache that later tokens really read.

Keys and values are quantized differently, as KIVI does (Liu et al. 2024):

* **keys per channel**: in each head, every channel (one of the ``head_dim`` numbers of a key)
  gets its own scale and minimum per group of ``group_size`` consecutive tokens. Keys have a
  few channels that are large for every token, so a per-token scale would be set by those
  channels and flatten the rest;
* **values per token**: each token's value vector gets its own scale and minimum per group of
  ``group_size`` channels. KIVI found values' channels far more even than keys' (chapter 03
  measures both on this model), and the attention output mixes values token by token.

Both use the asymmetric min/max rounding of chapter 05 (:func:`course_utils.quantize.fake_quantize`
with ``Scheme("minmax", bits, "group", group_size)``): ``bits``-bit codes plus an fp16 step and an
fp16 minimum per group.

:class:`QuantizedKVCache` is a transformers cache that *holds* what it has been given in that form:
bit-packed codes (two 4-bit codes per byte, four 2-bit ones, one 8-bit one) and an fp16 step and minimum
per group (:class:`StoredKV`), so the memory is really saved (:meth:`QuantizedKVCache.stored_bytes`
counts it; :attr:`KVQuantSpec.held_bits_per_element` is what one number costs). Attention reads the
numbers de-quantised again, in the keys' dtype, every time: exactly the values :func:`fake_quantize_kv`
gives (asserted in the tests), at the cost of de-quantising the whole cache at every step -- a fused
kernel would read the codes directly.
A forward pass reads the cache's stored
(quantized) keys and values of every earlier token, plus its own tokens and the most recent
``residual`` tokens in full precision. So to measure a quantized cache, the text must be fed in
pieces: a chunk's own tokens attend to each other in full precision, and only later chunks read
them quantized (``course_utils.evaluate`` scores text exactly that way). Fed as one forward pass,
a text would never read its cache at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .memory_sizing import quantized_bits
from .quantize import QuantizedTensor, Scheme, dequantize, fake_quantize, quantize
from .validation import check_non_negative_int, check_positive_int

AXES = ("channel", "token")


@dataclass(frozen=True)
class KVQuantSpec:
    """How a KV cache is quantized (chapter 07).

    ``bits``: 2..8; ``group_size``: elements sharing one fp16 step and one fp16 minimum;
    ``key_axis`` / ``value_axis``: ``"channel"`` (a scale per channel, over ``group_size``
    consecutive tokens) or ``"token"`` (a scale per token, over ``group_size`` consecutive
    channels of one head). KIVI's choice, the default: keys per channel, values per token.
    """

    bits: int = 4
    group_size: int = 64
    key_axis: str = "channel"
    value_axis: str = "token"

    def __post_init__(self):
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be an integer from 2 to 8, got {self.bits!r}")
        check_positive_int("group_size", self.group_size)
        for name in ("key_axis", "value_axis"):
            if getattr(self, name) not in AXES:
                raise ValueError(f"{name} must be one of {AXES}, got {getattr(self, name)!r}")

    @property
    def name(self) -> str:
        """A short label such as ``"KV int4 (K per channel, V per token)"``."""
        return f"KV int{self.bits} (K per {self.key_axis}, V per {self.value_axis})"

    @property
    def bits_per_element(self) -> float:
        """Bits one cached number costs: its code plus its share of a 16-bit step and a 16-bit minimum."""
        return quantized_bits(self.bits, self.group_size, zero_point_bits=16)

    @property
    def held_bits_per_element(self) -> float:
        """Bits one cached number takes as :class:`QuantizedKVCache` holds it: its code in a slot of
        ``8 / (8 // bits)`` bits (3-bit codes take 4) plus its share of the fp16 step and minimum."""
        return quantized_bits(8 // _codes_per_byte(self.bits), self.group_size, zero_point_bits=16)

    @property
    def scheme(self) -> Scheme:
        return Scheme("minmax", self.bits, "group", self.group_size, pad=True)


def _check_states(x) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"keys/values must be a float (batch, heads, tokens, head_dim) tensor, "
                         f"got {getattr(x, 'shape', type(x).__name__)}")


def fake_quantize_kv(x: torch.Tensor, spec: KVQuantSpec, axis: str) -> torch.Tensor:
    """Keys or values (batch, heads, tokens, head_dim) after quantization along ``axis``, in x's dtype.

    ``axis="channel"``: each channel of each head has a scale per ``group_size`` tokens;
    ``axis="token"``: each token of each head has a scale per ``group_size`` channels.
    A group cut short by the end of the tensor is simply shorter.
    """
    _check_states(x)
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    if x.shape[2] == 0:
        return x
    b, h, t, d = x.shape
    if axis == "token":
        rows = x.reshape(b * h * t, d)
        return fake_quantize(rows, spec.scheme).reshape(b, h, t, d).to(x.dtype)
    rows = x.transpose(2, 3).reshape(b * h * d, t)          # one row per channel, tokens along it
    return fake_quantize(rows, spec.scheme).reshape(b, h, d, t).transpose(2, 3).contiguous().to(x.dtype)


def _codes_per_byte(bits: int) -> int:
    return 8 // bits if bits <= 4 else 1


def _rows(x: torch.Tensor, axis: str) -> torch.Tensor:
    """(batch, heads, tokens, head_dim) as the rows that are quantized, request by request (batch-major)."""
    b, h, t, d = x.shape
    return x.reshape(b * h * t, d) if axis == "token" else x.transpose(2, 3).reshape(b * h * d, t)


@dataclass
class StoredKV:
    """Keys or values of some tokens as a quantized cache holds them (chapter 10 measures it).

    ``codes``: uint8 (batch, bytes per request), ``8 // bits`` codes per byte (one for 5..8 bits);
    ``step`` / ``minimum``: fp16 (batch, groups per request); ``shape``: the float tensor's
    (batch, heads, tokens, head_dim); ``axis``: ``"channel"`` or ``"token"`` (see :func:`fake_quantize_kv`).
    """

    codes: torch.Tensor
    step: torch.Tensor
    minimum: torch.Tensor
    shape: tuple
    axis: str
    spec: "KVQuantSpec"
    n_codes: int            # codes per request, a group's padding included

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.step, self.minimum))

    @classmethod
    def store(cls, x: torch.Tensor, spec: "KVQuantSpec", axis: str) -> "StoredKV":
        """Quantize ``x`` (batch, heads, tokens, head_dim) along ``axis`` and pack its codes."""
        _check_states(x)
        b = x.shape[0]
        qt = quantize(_rows(x, axis), spec.scheme)
        codes = qt.codes.reshape(b, -1)
        n_codes, per = codes.shape[1], _codes_per_byte(spec.bits)
        codes = torch.nn.functional.pad(codes, (0, -n_codes % per)).reshape(b, -1, per)
        packed = codes[..., 0].clone()
        for i in range(1, per):
            packed |= codes[..., i] << (i * (8 // per))
        return cls(packed, qt.scale.reshape(b, -1), qt.offset.reshape(b, -1), tuple(x.shape), axis, spec, n_codes)

    def load(self, dtype=torch.float32) -> torch.Tensor:
        """The de-quantised (batch, heads, tokens, head_dim) tensor in ``dtype``: equal to
        ``fake_quantize_kv`` of what was stored."""
        b, h, t, d = self.shape
        per = _codes_per_byte(self.spec.bits)
        width = 8 // per
        mask = (1 << width) - 1
        codes = torch.stack([(self.codes >> (i * width)) & mask for i in range(per)], dim=-1).reshape(b, -1)
        rows_shape = (b * h * t, d) if self.axis == "token" else (b * h * d, t)
        block_len = self.n_codes // self.step.shape[1]
        qt = QuantizedTensor(codes[:, :self.n_codes].reshape(-1, block_len), self.step.reshape(-1, 1),
                             self.minimum.reshape(-1, 1), torch.Size(rows_shape), self.spec.scheme)
        rows = dequantize(qt)
        out = rows.reshape(b, h, t, d) if self.axis == "token" else rows.reshape(b, h, d, t).transpose(2, 3)
        return out.contiguous().to(dtype)

    def select(self, index) -> "StoredKV":
        """The same storage for the requests ``index`` picks (a tensor of batch indices)."""
        codes, step, minimum = self.codes[index], self.step[index], self.minimum[index]
        return StoredKV(codes, step, minimum, (codes.shape[0], *self.shape[1:]), self.axis, self.spec, self.n_codes)


def stored_round_trip(x: torch.Tensor, spec: KVQuantSpec, axis: str) -> tuple[torch.Tensor, float]:
    """``x`` (batch, heads, tokens, head_dim) stored as :class:`QuantizedKVCache` would hold it, and read back.

    Returns the de-quantised tensor (in x's dtype; equal to ``fake_quantize_kv(x, spec, axis)``) and the
    bits per element the stored form really took: packed codes, fp16 steps and minimums, over ``x.numel()``.
    That is ``spec.held_bits_per_element`` when the groups tile the axis; a group cut short by the end of
    the axis is padded, and costs more (chapter 03 checks the bits it charges against this count).
    """
    _check_states(x)
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    if x.numel() == 0:
        raise ValueError(f"x must hold at least one element, got shape {tuple(x.shape)}")
    stored = StoredKV.store(x, spec, axis)
    return stored.load(x.dtype).to(x.device), stored.nbytes * 8 / x.numel()


class QuantizedKVLayer(DynamicLayer):
    """One layer's cache: quantized keys and values for older tokens, full precision for the recent ones.

    ``update`` returns, for attention, the stored (quantized) part, the full-precision part and the
    new tokens, in order. Then the new tokens join the full-precision part, and whole groups of
    ``group_size`` tokens move from it into the quantized part as long as at least ``residual``
    tokens stay behind. With ``residual=0`` and passes whose lengths are multiples of ``group_size``,
    every token older than the current pass is read quantized; otherwise the last, incomplete group
    waits in full precision until it is complete (a per-channel scale needs its whole group of tokens,
    which is why KIVI keeps such a residual).
    """

    def __init__(self, spec: KVQuantSpec, residual: int = 0):
        super().__init__()
        self.spec, self.residual = spec, check_non_negative_int("residual", residual)
        self.quantized_tokens = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]   # empty (batch, heads, 0, head_dim)
        self.stored_keys: list[StoredKV] = []       # one entry per flush, oldest first
        self.stored_values: list[StoredKV] = []

    def _read(self, stored: list[StoredKV], like: torch.Tensor) -> list[torch.Tensor]:
        return [s.load(like.dtype).to(like.device) for s in stored]

    @property
    def q_keys(self) -> torch.Tensor:
        """The stored keys as attention reads them (de-quantised), (batch, heads, quantized tokens, head_dim)."""
        return torch.cat([*self._read(self.stored_keys, self.keys), self.keys[..., :0, :]], dim=-2)

    @property
    def q_values(self) -> torch.Tensor:
        return torch.cat([*self._read(self.stored_values, self.values), self.values[..., :0, :]], dim=-2)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = torch.cat([*self._read(self.stored_keys, key_states), self.keys, key_states], dim=-2)
        values = torch.cat([*self._read(self.stored_values, value_states), self.values, value_states], dim=-2)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self._flush()
        return keys, values

    def _flush(self) -> None:
        n = self.keys.shape[-2]
        g = self.spec.group_size
        movable = (n - self.residual) // g * g                        # whole groups of tokens only
        if movable <= 0:
            return
        old_k, old_v = self.keys[..., :movable, :], self.values[..., :movable, :]
        self.stored_keys.append(StoredKV.store(old_k, self.spec, self.spec.key_axis))
        self.stored_values.append(StoredKV.store(old_v, self.spec, self.spec.value_axis))
        self.keys, self.values = self.keys[..., movable:, :].clone(), self.values[..., movable:, :].clone()
        self.quantized_tokens += movable

    @property
    def stored_bytes(self) -> int:
        """Bytes this layer holds: the packed codes with their steps and minimums, plus the full-precision tokens."""
        if not self.is_initialized:
            return 0
        return (sum(s.nbytes for s in self.stored_keys + self.stored_values)
                + self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size())

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.quantized_tokens + self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def reset(self) -> None:
        super().reset()
        self.stored_keys, self.stored_values = [], []
        self.quantized_tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a quantized cache cannot be cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            index = torch.arange(self.keys.shape[0]).repeat_interleave(repeats)
            self.batch_select_indices(index)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self.stored_keys = [s.select(indices) for s in self.stored_keys]
            self.stored_values = [s.select(indices) for s in self.stored_values]
            self.keys, self.values = self.keys[indices, ...], self.values[indices, ...]


class QuantizedKVCache(Cache):
    """A transformers cache whose every layer is a :class:`QuantizedKVLayer` (chapter 07)::

        cache = QuantizedKVCache(model.config, KVQuantSpec(bits=4))
        model(first_chunk, cache=cache, use_cache=True)        # its keys/values are now stored quantized
        model(next_chunk, cache=cache, use_cache=True)         # ... and read quantized here

    Only models whose every layer attends to the whole context (no sliding window) are accepted.
    """

    def __init__(self, config, spec: KVQuantSpec, *, residual: int = 0):
        if not isinstance(spec, KVQuantSpec):
            raise TypeError(f"expected a KVQuantSpec, got {type(spec).__name__}")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        if set(types) != {"full_attention"}:
            raise ValueError(f"QuantizedKVCache needs full attention in every layer; this model has {sorted(set(types))}")
        self.spec = spec
        super().__init__(layers=[QuantizedKVLayer(spec, residual) for _ in range(text.num_hidden_layers)])

    @property
    def quantized_tokens(self) -> int:
        """Tokens whose keys and values are stored quantized (layer 0's count; all layers agree)."""
        return self.layers[0].quantized_tokens if self.layers else 0

    def stored_bytes(self) -> int:
        """Bytes the cache holds over all layers: packed codes, fp16 steps and minimums, and the tokens
        still in full precision (chapter 10 checks it against the formula and against the process's RSS)."""
        return sum(layer.stored_bytes for layer in self.layers)


def exact_context_share(windows, chunk: int, group_size: int, *, n_tokens: int | None = None,
                        residual: int = 0) -> dict:
    """How much of what each scored prediction reads a :class:`QuantizedKVCache` leaves in full precision, when the
    text goes through the model ``chunk`` tokens at a time inside chapter 07's windows (``windows``: an
    :class:`~course_utils.evaluate.Windows`; its first ``n_tokens`` scored predictions, default all).

    The chunks are those of :func:`~course_utils.evaluate.scored_logprobs`: the context-only part of a window in
    chunks of ``chunk``, then the scored part in chunks of ``chunk`` from its first position. The prediction at
    position t of a window reads t + 1 positions: those cached before its chunk, of which the cache has moved whole
    groups of ``group_size`` (keeping ``residual`` back) into its quantized part, and its own chunk's, all exact.
    Returns ``{"mean", "min", "max"}``: the share of the positions read exact, and ``"contexts": (fewest, most)``
    positions read."""
    check_positive_int("chunk", chunk)
    check_positive_int("group_size", group_size)
    check_non_negative_int("residual", residual)
    n = windows.n_tokens if n_tokens is None else n_tokens
    check_positive_int("n_tokens", n)
    if n > windows.n_tokens:
        raise ValueError(f"n_tokens={n} is more than the {windows.n_tokens} predictions the windows score")
    shares, contexts = [], []
    for i in range(n):
        j = i % windows.stride                               # the j-th scored position of its window
        t = windows.context_only + j                         # its position in the window
        before = windows.context_only + j // chunk * chunk   # positions cached before its chunk
        quantized = max(before - residual, 0) // group_size * group_size
        shares.append((t + 1 - quantized) / (t + 1))
        contexts.append(t + 1)
    return {"mean": sum(shares) / n, "min": min(shares), "max": max(shares), "contexts": (min(contexts), max(contexts))}
