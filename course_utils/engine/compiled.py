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
  makes inductor copy the tensor; so attention reads each new key and value from the step itself (put in at
  its position while the context is read), the step returns them, and the runner stores all layers' new keys
  and values after the step, in one indexed write per pool.
* **Attention written as products and sums.** Each layer's decode attention is plain tensor code
  (:func:`paged_decode_attention`): the sequence's blocks looked up through its block table, this step's key and
  value put in at its position, scores as element-wise products summed over the head dimension, a masked
  softmax, the values' weighted sum. Inductor fuses that into a few loops that read the blocks of the pool where
  they lie, so no copy of each sequence's context is made for attention. Calling ``scaled_dot_product_attention``
  from the graph instead (after a gather) was slower at this size: in one A/B run at B = 1 here, 1.26x the
  matrix-product floor against 1.11x.
* **Fewer guards.** Before each call ``torch.compile`` checks that what the graph was compiled for still holds
  (its *guards*): the inputs' shapes and dtypes, and the identity of every weight the module holds. The layers'
  weights are frozen into the graph and a :class:`DecodeStep` never changes them, so their guards are left out
  (:func:`_guard_filter`); the input and global-state guards stay, and so does the identity of the module's
  embedding and norm weights, which tells one runner's compiled step from another's.
* **torch.compile's cache.** Compiled graphs, each with its frozen copy of the weights, stay in
  ``torch.compile``'s cache after their runner is gone, until :func:`release_compiled` empties it.
* **Batch products where PyTorch's bfloat16 product is slow.** On such a CPU (no oneDNN bfloat16 kernels:
  :func:`~.packed.bf16_products_are_slow`) the runner's matrices are ``pack="upcast"``'s, and the graphs of
  batches multiply them through the same float32 slice-by-slice product, as one operator
  (``course::upcast_linear``) the graph calls; a batch of one keeps the compiler's own product.
* **A C++ compiler.** Inductor generates C++ for the CPU (``g++``, ``clang++``); where none is found the path is
  refused with a clear error (:func:`check_compiler`).

The result is not bit-for-bit the eager bfloat16 path: the fused loops round in different places. Like every
fast path it is lossy by that much, and its quality is measured (the figures of :mod:`.speed` come from this
compiled step's own logits, :meth:`~.model_runner.ModelRunner.decode_logits`). Prefill steps, chunked-prefill steps
holding a chunk of more than one token, and decode steps of a static batch's finished rows, run the eager path.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .packed import UPCAST_MIN_ROWS, UpcastLinear


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
                           v_pool: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                           bias: torch.Tensor) -> torch.Tensor:
    """One layer's decode attention over the paged pool, in float32, written for inductor to fuse (see the module's
    docstring): q (S, n_kv, g, hd), this step's k and v (S, n_kv, hd), the layer's pools (slots, n_kv, hd),
    tables (S, W) block ids, positions (S,) each new token's position, bias (S, C) 0 where a position may be
    attended to, the dtype's minimum where not, C = W * block_size. Returns (S, n_kv * g * hd) in q's dtype."""
    S, W = tables.shape
    n_kv, g, hd = q.shape[1], q.shape[2], q.shape[3]
    C = bias.shape[-1]
    is_new = (torch.arange(C, device=q.device)[None, :] == positions[:, None])[:, :, None, None]      # (S, C, 1, 1)

    def context(pool, new):                             # (S, C, n_kv, hd): the blocks in order, this step's row put in
        blocks = pool.view(-1, C // W, n_kv, hd)[tables.reshape(-1)].view(S, C, n_kv, hd)
        return torch.where(is_new, new[:, None], blocks).float()
    scores = (q.float().view(S, 1, n_kv, g, hd) * context(k_pool, k).view(S, C, n_kv, 1, hd)).sum(-1)
    p = (scores * hd ** -0.5 + bias.float().view(S, C, 1, 1)).softmax(dim=1)                  # (S, C, n_kv, g)
    out = (p[..., None] * context(v_pool, v).view(S, C, n_kv, 1, hd)).sum(1)                  # (S, n_kv, g, hd)
    return out.to(q.dtype).reshape(S, n_kv * g * hd)


def _guard_filter(entries) -> list[bool]:
    """Keep every guard but those on the layers' weights (see the module's docstring)."""
    return [not e.name.startswith("self._modules['layers']") for e in entries]


def _bucket(n: int, sizes) -> int:
    return next((s for s in sorted(sizes) if s >= n), n)


class DecodeStep(torch.nn.Module):
    """One decode step of every layer and the LM head, as plain tensor code for inductor to compile.

    Inputs: ``ids``, ``positions`` (S,), ``tables`` (S, W) block ids, and the pools; returns the logits (S, vocab),
    their greedy tokens (S,) (the argmax fused into the graph: on the logits' 49k entries PyTorch's own bfloat16
    argmax alone took ~0.2 ms here) and the new keys and values of every layer, (layers, S, n_kv_heads, head_dim)
    each."""

    def __init__(self, runner):
        super().__init__()
        d = runner.dims

        def frozen(t):
            if isinstance(t, UpcastLinear):
                self.upcast = True                       # batches multiply through course::upcast_linear
                t = t.weight
            return None if t is None else torch.nn.Parameter(t, requires_grad=False)     # shares the storage
        self.upcast = False
        self.layers = torch.nn.ModuleList()
        for w in runner.layers:
            layer = torch.nn.Module()
            for name, t in w.items():
                setattr(layer, name, frozen(t))
            self.layers.append(layer)
        self.embed, self.final_norm = frozen(runner.embed), frozen(runner.final_norm)
        head = runner.lm_head.weight if isinstance(runner.lm_head, UpcastLinear) else runner.lm_head
        self.lm_head = self.embed if head is runner.embed else frozen(runner.lm_head)
        self.register_buffer("cos", runner.cos)
        self.register_buffer("sin", runner.sin)
        self.n_heads, self.n_kv, self.head_dim = d.n_heads, d.n_kv_heads, d.head_dim
        self.block_size, self.act, self._rms_norm = runner.block_size, runner.act, runner._rms_norm

    def _norm(self, x, w):
        return self._rms_norm(x, w)                      # the eager runner's own, so both round alike

    def _linear(self, x, w, b=None):
        if self.upcast and x.shape[0] >= UPCAST_MIN_ROWS:  # (the batch is fixed per graph: decided when it compiles)
            y = torch.ops.course.upcast_linear(x, w)
            return y if b is None else y + b
        return F.linear(x, w, b)

    def forward(self, ids, positions, tables, k_pool, v_pool):
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        S, W = tables.shape
        C = W * self.block_size
        h = F.embedding(ids, self.embed)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        allowed = torch.arange(C, device=ids.device)[None, :] <= positions[:, None]        # (S, C)
        bias = torch.zeros(S, C, dtype=h.dtype, device=ids.device).masked_fill(~allowed, torch.finfo(h.dtype).min)
        n_qk = (H + KV) * hd
        new_k, new_v = [], []
        for i, w in enumerate(self.layers):
            qkv = self._linear(self._norm(h, w.in_norm), w.w_qkv, w.b_qkv)
            qk = qkv[:, :n_qk].view(S, H + KV, hd)
            qk = qk * cos + qk.roll(hd // 2, dims=-1) * sin
            k, v = qk[:, H:], qkv[:, n_qk:].view(S, KV, hd)
            q = qk[:, :H].reshape(S, KV, H // KV, hd)
            attn = paged_decode_attention(q, k, v, k_pool[i], v_pool[i], tables, positions, bias)
            h = h + self._linear(attn, w.w_o, w.b_o)
            gate, up = self._linear(self._norm(h, w.post_norm), w.w_gate_up, w.b_gate_up).chunk(2, dim=-1)
            h = h + self._linear(self.act(gate) * up, w.w_down, w.b_down)
            new_k.append(k)
            new_v.append(v)
        logits = self._linear(self._norm(h, self.final_norm), self.lm_head)
        return logits, logits.argmax(dim=-1), torch.stack(new_k), torch.stack(new_v)


class CompiledDecode:
    """The runner's decode steps through a compiled :class:`DecodeStep` (see the module's docstring)."""

    def __init__(self, runner, batch_sizes=(1, 16)):
        check_compiler(runner.device)
        import torch._inductor.config as inductor_config
        self._inductor_config = inductor_config
        self.runner = runner
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.module = DecodeStep(runner).eval()
        self.step = torch.compile(self.module, dynamic=False, fullgraph=True,
                                  options={"guard_filter_fn": _guard_filter})
        self.compile_s: dict[tuple[int, int], float] = {}     # (padded batch, blocks) -> seconds its first call took

    def shape_for(self, batch: int, blocks: int) -> tuple[int, int]:
        """The (batch, blocks) a step of ``batch`` sequences with up to ``blocks`` blocks each is padded to."""
        max_blocks = self.runner.num_blocks
        return _bucket(batch, self.batch_sizes), min(max_blocks, 1 << max(2, (blocks - 1).bit_length()))

    @torch.no_grad()
    def __call__(self, inp) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of ``inp``'s sequences: their logits (S, vocab) and greedy next tokens (S,)."""
        r = self.runner
        step_tables = inp.batches[0].block_tables                # a decode step: one batch, one query per sequence
        S, used = step_tables.shape
        Sb, W = self.shape_for(S, used)
        ids = inp.input_ids.new_zeros(Sb)
        ids[:S] = inp.input_ids
        positions = inp.positions.new_zeros(Sb)
        positions[:S] = inp.positions
        tables = step_tables.new_zeros(Sb, W)
        tables[:S, :used] = step_tables
        first = (Sb, W) not in self.compile_s
        t0 = time.perf_counter()
        # Weights as constants, in oneDNN's layout, per graph. A batch of one: the generated loops run on one thread
        # (their work is a few thousand numbers; an OpenMP region per loop cost more than it saved: 1.09x vs 1.26x
        # the product floor in one A/B run here); the products keep all threads.
        single = {"cpp.threads": 1} if Sb == 1 else {}
        with self._inductor_config.patch(freezing=True, **single):
            logits, tokens, new_k, new_v = self.step(ids, positions, tables, r.k_pool, r.v_pool)
        if first:
            self.compile_s[(Sb, W)] = time.perf_counter() - t0
        r.k_pool.index_copy_(1, inp.write_slots, new_k[:, :S])     # every layer's new keys in one write
        r.v_pool.index_copy_(1, inp.write_slots, new_v[:, :S])
        return logits[:S], tokens[:S]
