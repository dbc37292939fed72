"""The engine's decode step compiled by ``torch.compile`` (a switch, ``pack="compiled"``; chapter 04 shows the eager path).

A decode step of the eager runner is some 40 PyTorch calls per layer around its four matrix products: norms,
rotary embedding, cache writes and reads, attention, activation, residuals -- each a small tensor, each a trip
through Python and PyTorch's dispatcher. Chapter 11's profile shows that remainder costs several milliseconds a
step whatever the weights. Compiling the whole step (every layer and the LM head) with PyTorch's inductor turns
it into one call: the weights are *frozen* (treated as constants and stored in oneDNN's layout when the graph is
compiled, what ``pack="onednn"`` does by hand), and the element-wise work between the products is fused into a few generated
C++ loops.

What it takes, and what this module changes for it:

* **Fixed shapes.** A compiled graph is specialised to its input shapes; a new shape compiles again (tens of
  seconds for this model). The batch is padded up to one of ``batch_sizes`` (a padded row is computed and thrown
  away: some work traded for not compiling every batch size) and each sequence's block table up to a
  power of two of blocks, with the positions past a sequence's own context masked out. Each (batch, blocks) pair
  compiles once, the first time it is met: :attr:`CompiledDecode.compile_s` records how long each took.
* **No writes into the pool inside the graph.** Writing into a slice of a big tensor inside a compiled graph
  makes inductor copy the tensor; so the step inserts each new key and value into its own gathered copy of the
  context for attention, returns them, and the runner stores all layers' new keys and values after the step, in
  one indexed write per pool.
* **Attention as one operator.** Each layer's decode attention -- gather the sequence's blocks, put this step's
  key and value in, ``scaled_dot_product_attention`` -- is a custom operator (:func:`paged_decode_attention`)
  that the graph calls as it is: inductor would otherwise generate its own indexed loops for the gather,
  slower than PyTorch's block copy, the more so the larger the batch. It is where a paged-attention kernel that
  reads the blocks in place would go.
* **torch.compile's cache.** Compiled graphs, each with its frozen copy of the weights, stay in
  ``torch.compile``'s cache after their runner is gone, until :func:`release_compiled` empties it.
* **A C++ compiler.** Inductor generates C++ for the CPU (``g++``, ``clang++``); where none is found the path is
  refused with a clear error (:func:`check_compiler`).

The result is not bit-for-bit the eager bfloat16 path: the fused loops round in different places. Like every
fast path it is lossy by that much, and its quality is measured (the figures of :mod:`.speed` come from this
compiled step's own logits, :meth:`~.model_runner.ModelRunner.decode_logits`). Prefill steps, and decode steps
of a static batch's finished rows, run the eager path.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def check_compiler(device="cpu") -> str:
    """The C++ compiler inductor would use; a ``ValueError`` if there is none (or no inductor), or if ``device`` is
    neither a CPU nor a CUDA GPU (inductor's other back-ends are not what this path was built and tested on)."""
    if torch.device(device).type not in ("cpu", "cuda"):
        raise ValueError(f"pack='compiled' runs on a CPU or a CUDA GPU, not on {device}; use pack='none'")
    try:
        from torch._inductor import cpp_builder
        cxx = cpp_builder.get_cpp_compiler()
    except Exception as exc:                                     # noqa: BLE001 -- any failure means: not here
        raise ValueError(f"pack='compiled' needs torch.compile's inductor and a C++ compiler "
                         f"({type(exc).__name__}: {exc}); use pack='onednn' or 'none'") from None
    return cxx


def release_compiled() -> None:
    """Empty ``torch.compile``'s cache: every compiled step's graphs and frozen weights (each compiled runner compiles
    again on its next decode step)."""
    torch._dynamo.reset()


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                           v_pool: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
                           bias: torch.Tensor) -> torch.Tensor:
    """One layer's decode attention over the paged pool, as one operator the compiled graph calls (its gather is
    PyTorch's block copy, not a generated loop): q (S, n_kv, g, hd), this step's k and v (S, n_kv, hd), the
    layer's pools (slots, n_kv, hd), tables (S, W), ``rows`` (S,) the row of each new token in the gathered
    (S * W * block_size) context, bias (S, 1, 1, W * block_size)."""
    S, W = tables.shape
    n_kv, hd = k.shape[1], k.shape[2]
    C = bias.shape[-1]
    flat = tables.reshape(-1)
    keys = k_pool.view(-1, C // W * n_kv * hd).index_select(0, flat).view(S * C, n_kv, hd).index_copy_(0, rows, k)
    values = v_pool.view(-1, C // W * n_kv * hd).index_select(0, flat).view(S * C, n_kv, hd).index_copy_(0, rows, v)
    return F.scaled_dot_product_attention(q, keys.view(S, C, n_kv, hd).transpose(1, 2),
                                          values.view(S, C, n_kv, hd).transpose(1, 2), attn_mask=bias)


# Registered as a plain operator (a schema and a kernel for every device), which costs less per call than a
# ``torch.library.custom_op`` wrapper; the fake kernel tells the compiler its output's shape.
_LIB = torch.library.Library("course", "DEF")
_LIB.define("paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor k_pool, Tensor v_pool, Tensor tables, "
            "Tensor rows, Tensor bias) -> Tensor")
_LIB.impl("paged_decode_attention", paged_decode_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("course::paged_decode_attention", lib=_LIB)
def _(q, k, v, k_pool, v_pool, tables, rows, bias):
    return torch.empty_like(q)


def _bucket(n: int, sizes) -> int:
    return next((s for s in sorted(sizes) if s >= n), n)


class DecodeStep(torch.nn.Module):
    """One decode step of every layer and the LM head, as plain tensor code for inductor to compile.

    Inputs: ``ids``, ``positions`` (S,), ``tables`` (S, W) block ids, and the pools; returns the logits (S, vocab)
    and the new keys and values of every layer, (layers, S, n_kv_heads, head_dim) each."""

    def __init__(self, runner):
        super().__init__()
        d = runner.dims

        def frozen(t):
            return None if t is None else torch.nn.Parameter(t, requires_grad=False)     # shares the storage
        self.layers = torch.nn.ModuleList()
        for w in runner.layers:
            layer = torch.nn.Module()
            for name, t in w.items():
                setattr(layer, name, frozen(t))
            self.layers.append(layer)
        self.embed, self.final_norm = frozen(runner.embed), frozen(runner.final_norm)
        self.lm_head = self.embed if runner.lm_head is runner.embed else frozen(runner.lm_head)
        self.register_buffer("cos", runner.cos)
        self.register_buffer("sin", runner.sin)
        self.n_heads, self.n_kv, self.head_dim = d.n_heads, d.n_kv_heads, d.head_dim
        self.block_size, self.act, self._rms_norm = runner.block_size, runner.act, runner._rms_norm

    def _norm(self, x, w):
        return self._rms_norm(x, w)                      # the eager runner's own, so both round alike

    def forward(self, ids, positions, tables, k_pool, v_pool):
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        S, W = tables.shape
        C = W * self.block_size
        h = F.embedding(ids, self.embed)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        allowed = torch.arange(C, device=ids.device)[None, :] <= positions[:, None]        # (S, C)
        bias = torch.zeros(S, 1, 1, C, dtype=h.dtype, device=ids.device).masked_fill(
            ~allowed[:, None, None], torch.finfo(h.dtype).min)
        rows = torch.arange(S, device=ids.device) * C + positions           # each new token's row in its context
        n_qk = (H + KV) * hd
        new_k, new_v = [], []
        for i, w in enumerate(self.layers):
            qkv = F.linear(self._norm(h, w.in_norm), w.w_qkv, w.b_qkv)
            qk = qkv[:, :n_qk].view(S, H + KV, hd)
            qk = qk * cos + qk.roll(hd // 2, dims=-1) * sin
            k, v = qk[:, H:], qkv[:, n_qk:].view(S, KV, hd)
            q = qk[:, :H].reshape(S, KV, H // KV, hd)
            attn = torch.ops.course.paged_decode_attention(q, k.contiguous(), v.contiguous(), k_pool[i], v_pool[i],
                                                           tables, rows, bias).reshape(S, H * hd)
            h = h + F.linear(attn, w.w_o, w.b_o)
            gate, up = F.linear(self._norm(h, w.post_norm), w.w_gate_up, w.b_gate_up).chunk(2, dim=-1)
            h = h + F.linear(self.act(gate) * up, w.w_down, w.b_down)
            new_k.append(k)
            new_v.append(v)
        return F.linear(self._norm(h, self.final_norm), self.lm_head), torch.stack(new_k), torch.stack(new_v)


class CompiledDecode:
    """The runner's decode steps through a compiled :class:`DecodeStep` (see the module's docstring)."""

    def __init__(self, runner, batch_sizes=(1, 16)):
        check_compiler(runner.device)
        import torch._inductor.config as inductor_config
        self._inductor_config = inductor_config
        self.runner = runner
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.module = DecodeStep(runner).eval()
        self.step = torch.compile(self.module, dynamic=False, fullgraph=True)
        self.compile_s: dict[tuple[int, int], float] = {}     # (padded batch, blocks) -> seconds its first call took

    def shape_for(self, batch: int, blocks: int) -> tuple[int, int]:
        """The (batch, blocks) a step of ``batch`` sequences with up to ``blocks`` blocks each is padded to."""
        max_blocks = self.runner.num_blocks
        return _bucket(batch, self.batch_sizes), min(max_blocks, 1 << max(2, (blocks - 1).bit_length()))

    @torch.no_grad()
    def __call__(self, inp) -> torch.Tensor:
        r = self.runner
        S, used = inp.block_tables.shape
        Sb, W = self.shape_for(S, used)
        ids = inp.input_ids.new_zeros(Sb)
        ids[:S] = inp.input_ids
        positions = inp.positions.new_zeros(Sb)
        positions[:S] = inp.positions
        tables = inp.block_tables.new_zeros(Sb, W)
        tables[:S, :used] = inp.block_tables
        first = (Sb, W) not in self.compile_s
        t0 = time.perf_counter()
        with self._inductor_config.patch(freezing=True):   # weights as constants, in oneDNN's layout, per graph
            logits, new_k, new_v = self.step(ids, positions, tables, r.k_pool, r.v_pool)
        if first:
            self.compile_s[(Sb, W)] = time.perf_counter() - t0
        r.k_pool.index_copy_(1, inp.write_slots, new_k[:, :S])     # every layer's new keys in one write
        r.v_pool.index_copy_(1, inp.write_slots, new_v[:, :S])
        return logits[:S]
