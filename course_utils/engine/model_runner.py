"""Chapter 04 -- run a llama / qwen2 model's own weights with a hand-written forward over a paged K/V pool.

The pool holds keys and values for every layer as ``(num_blocks * block_size, n_kv_heads,
head_dim)`` tensors, allocated once. A step runs the new tokens of all scheduled sequences
(each sequence's run of positions, :meth:`~.sequence.Sequence.positions_to_run`: a whole
prompt, a chunk of one, or one decode token; a step may mix them) as one flat batch through
the linear layers; in each layer it first writes their keys and values into the slots their
block tables name, then gathers each sequence's whole context block by block (one indexed
read per group of sequences) and attends to it, causally: each new token sees the sequence's earlier
positions (its earlier blocks, and the tokens before it in its run) and itself. Attention pads
every run of a call to the call's longest and every context to its longest, so a step attends in
two groups: the one-token runs (decode tokens) together, the longer runs (prompts, chunks of
prompts) together -- a decode token beside a 256-token chunk does not pay for 256 queries. The gather is a
contiguous copy of every sequence's keys and values, per layer and per step, where a
paged-attention kernel (vLLM's, FlashInfer's) reads the blocks in place; plain PyTorch has
no such kernel. Chapter 04 measures what the copy costs (``batching.time_block_gather``).

At construction the runner fuses the query/key/value projections into one matrix and
the gate/up projections into another, so a layer runs four matrix products. It supports
the llama and qwen2 architectures (qwen2 adds biases to q/k/v and ties its embeddings).
:class:`RunnerWeights` holds the fused weights, so several engines can share one copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..hooks import decoder_layers
from ..models import model_dims, resolve_dtype
from .packed import (PACKINGS, PackedLinear, PrepackedLinear, UpcastLinear, add_linear, bf16_products_are_slow, linear,
                     pack_matrix, prepack_matrix, upcast_matrix)
from .sequence import Sequence

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass
class AttentionBatch:
    """Sequences whose new tokens attend in one call, their runs padded to the longest, Q, and their contexts to
    the longest, C (positions); g = query heads per key/value head."""

    rows: slice                  # their new tokens' rows in the step (next to each other)
    block_tables: torch.Tensor   # (S, C / block_size) block ids, padded with 0
    attn_bias: torch.Tensor      # (S, 1, Q * g, C) 0 where a query may attend to a key position, dtype min elsewhere
    pad_index: torch.Tensor | None  # (rows,) row of each token in the padded (S * Q) layout; None when Q = 1


@dataclass
class StepInput:
    """The tensors one step needs, built once and shared by every layer.

    T new tokens of S sequences, the one-token runs (decode tokens) first, then the longer runs (prompts,
    chunks of prompts); each group attends in one call (``batches``).
    """

    input_ids: torch.Tensor      # (T,) token ids of the new tokens, run after run
    positions: torch.Tensor      # (T,) their positions
    write_rows: torch.Tensor | None  # (W,) rows of the new tokens whose keys/values are stored; None = all
    write_slots: torch.Tensor    # (W,) pool slots they are stored in
    batches: list[AttentionBatch]  # the one-token runs' batch, then the longer runs' (either may be absent)
    last_rows: torch.Tensor      # (S,) row of each sequence's last new token, in the order the sequences came

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds one token."""
        return len(self.batches) == 1 and self.batches[0].pad_index is None


def _check_supported(model) -> None:
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"the engine runs {SUPPORTED_MODEL_TYPES} models; this one is {cfg.model_type!r}")
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        raise ValueError("sliding-window attention layers are not supported by the course engine")
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope type {rope_type!r} changes with the sequence length; not supported")


def _cat_bias(linears, dtype) -> torch.Tensor | None:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                      for m in linears]).to(dtype)


@dataclass
class RunnerWeights:
    """The model's weights as the runner multiplies them: q/k/v and gate/up fused per layer.

    Fusing copies those matrices once; build this once and hand it to every engine on the
    same model (``LLMEngine(..., weights=w)``) so they share one copy. The other tensors
    are the model's own (no copy when the dtype is unchanged).

    ``pack="int8"`` or ``"int4"``: the fast path of :mod:`.packed` -- every matrix (the four per layer and
    the LM head) becomes a :class:`~.packed.PackedLinear` for a weight-only low-bit kernel computing in
    ``dtype``; lossy. ``pack="onednn"`` (bfloat16): the same bfloat16 matrices in oneDNN's layout
    (:class:`~.packed.PrepackedLinear`). ``pack="upcast"`` (bfloat16): the same matrices, their products of a
    batch or a prefill computed in float32 slice by slice (:class:`~.packed.UpcastLinear`), for CPUs where
    PyTorch's own bfloat16 product is slow. ``pack="compiled"``: the dense matrices, and the runner's decode steps
    compiled by ``torch.compile`` (:mod:`.compiled`); in bfloat16 on a CPU where PyTorch's bfloat16 product is
    slow, its matrices are ``"upcast"``'s. ``"none"`` (the default) is the path chapter 04 shows.
    """

    dtype: torch.dtype
    layers: list[dict]
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor | PackedLinear | PrepackedLinear | UpcastLinear
    pack: str = "none"

    @classmethod
    @torch.no_grad()
    def from_model(cls, model, dtype=None, *, pack: str = "none") -> "RunnerWeights":
        _check_supported(model)
        if pack not in PACKINGS:
            raise ValueError(f"pack must be one of {PACKINGS}, got {pack!r}")
        dt = resolve_dtype(dtype) if dtype is not None else model.dtype
        layers = []
        for layer in decoder_layers(model):
            att, mlp = layer.self_attn, layer.mlp
            layers.append(dict(
                in_norm=layer.input_layernorm.weight.detach().to(dt),
                w_qkv=torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).to(dt),
                b_qkv=_cat_bias([att.q_proj, att.k_proj, att.v_proj], dt),
                w_o=att.o_proj.weight.detach().to(dt), b_o=_cat_bias([att.o_proj], dt),
                post_norm=layer.post_attention_layernorm.weight.detach().to(dt),
                w_gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).to(dt),
                b_gate_up=_cat_bias([mlp.gate_proj, mlp.up_proj], dt),
                w_down=mlp.down_proj.weight.detach().to(dt), b_down=_cat_bias([mlp.down_proj], dt)))
        lm_head = model.get_output_embeddings().weight.detach()
        if pack in ("onednn", "upcast") and dt != torch.bfloat16:
            raise ValueError(f"pack={pack!r} computes in bfloat16; got dtype {dt}")
        upcast = pack == "upcast" or (pack == "compiled" and dt == torch.bfloat16 and bf16_products_are_slow(model.device))
        dense = upcast_matrix if upcast else (lambda w: w)
        make = {"none": dense, "compiled": dense, "upcast": dense, "onednn": prepack_matrix,
                "int8": lambda w: pack_matrix(w, "int8", dt), "int4": lambda w: pack_matrix(w, "int4", dt)}[pack]
        for layer in layers:
            for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
                layer[name] = make(layer[name])
        embed = model.get_input_embeddings().weight.detach()
        tied = lm_head.data_ptr() == embed.data_ptr()
        embed = embed.to(dt)
        if pack in ("none", "compiled", "upcast"):
            lm_head = dense(embed if tied else lm_head.to(dt))   # a tied head stays one tensor in the new dtype too
        else:
            lm_head = make(lm_head.to(dt) if pack == "onednn" else lm_head)
        return cls(dt, layers, embed, model.model.norm.weight.detach().to(dt), lm_head, pack)


class ModelRunner:
    """Greedy next tokens for a batch of sequences, reading K/V through their block tables."""

    def __init__(self, model, *, num_blocks: int, block_size: int, dtype=None, weights: RunnerWeights | None = None,
                 max_num_seqs: int = 16):
        _check_supported(model)
        if weights is None:
            weights = RunnerWeights.from_model(model, dtype)
        elif dtype is not None and resolve_dtype(dtype) != weights.dtype:
            raise ValueError(f"dtype {dtype} differs from the given weights' {weights.dtype}")
        self.dims = dims = model_dims(model.config)
        self.dtype, self.device = weights.dtype, model.device
        self.num_blocks, self.block_size = num_blocks, block_size
        self.eps = model.config.rms_norm_eps
        act = decoder_layers(model)[0].mlp.act_fn
        self.act = act.forward if isinstance(act, torch.nn.Module) else act      # (no module call per layer)
        self.layers, self.embed = weights.layers, weights.embed
        self.final_norm, self.lm_head = weights.final_norm, weights.lm_head
        pool_shape = (dims.n_layers, num_blocks * block_size, dims.n_kv_heads, dims.head_dim)
        self.k_pool = torch.zeros(pool_shape, dtype=self.dtype, device=self.device)
        self.v_pool = torch.zeros(pool_shape, dtype=self.dtype, device=self.device)
        self.k_slots, self.v_slots = list(self.k_pool.unbind(0)), list(self.v_pool.unbind(0))   # per layer, by slot
        self.k_blocks = [p.view(num_blocks, -1) for p in self.k_slots]                         # per layer, by block
        self.v_blocks = [p.view(num_blocks, -1) for p in self.v_slots]
        self.max_positions = min(num_blocks * block_size, model.config.max_position_embeddings)
        rot = model.model.rotary_emb
        freqs = torch.arange(self.max_positions, device=self.device).float()[:, None] * rot.inv_freq.float()[None]
        emb = torch.cat((freqs, freqs), dim=-1)                  # (positions, head_dim), as transformers does
        self.cos = (emb.cos() * rot.attention_scaling).to(self.dtype)
        sin = (emb.sin() * rot.attention_scaling).to(self.dtype)
        half = dims.head_dim // 2          # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated)
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.compiled = None                 # pack="compiled": decode steps through a compiled step (batch padded)
        if weights.pack == "compiled":
            from .compiled import CompiledDecode
            self.compiled = CompiledDecode(self, batch_sizes=(1, max_num_seqs))

    def step_matrices(self) -> list:
        """The weight matrices one decode step multiplies, in order (the LM head last): tensors, or
        :class:`~.packed.PackedLinear` on the low-bit fast path."""
        names = ("w_qkv", "w_o", "w_gate_up", "w_down")
        return [layer[n] for layer in self.layers for n in names] + [self.lm_head]

    def step_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every matrix, norm and bias (embedding rows aside)."""
        vectors = [t for layer in self.layers for k, t in layer.items() if t is not None and not k.startswith("w_")]
        return sum(t.nbytes for t in self.step_matrices() + vectors + [self.final_norm])

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token position takes in the pool, all layers."""
        return self.dims.kv_elements_per_token * self.k_pool.element_size()

    def prepare(self, seqs: list[Sequence]) -> StepInput:
        """Flatten the sequences' new tokens (each one's run: ``positions_to_run()``), the one-token runs first;
        build the slot tensors and, for each group, its block-table and attention-bias tensors."""
        bs = self.block_size
        runs = [seq.positions_to_run() for seq in seqs]
        groups = [[j for j, (r, _) in enumerate(runs) if len(r) == 1],    # decode tokens: one query each
                  [j for j, (r, _) in enumerate(runs) if len(r) > 1]]     # prompts, chunks: padded among themselves
        ids, pos, rows, slots, last_rows, batches = [], [], [], [], [0] * len(seqs), []
        for group in groups:
            start = len(ids)
            for j in group:
                seq, (positions, first_write) = seqs[j], runs[j]
                for p in positions:
                    if p >= first_write:                  # cached positions are not written again
                        rows.append(len(ids))
                        slots.append(seq.block_table[p // bs] * bs + p % bs)
                    ids.append(seq.token_ids[p])
                    pos.append(p)
                last_rows[j] = len(ids) - 1
            if group:
                batches.append(self._attention_batch([seqs[j] for j in group], [runs[j][0] for j in group],
                                                     slice(start, len(ids))))
        dev, lt = self.device, torch.long
        return StepInput(
            input_ids=torch.tensor(ids, dtype=lt, device=dev), positions=torch.tensor(pos, dtype=lt, device=dev),
            write_rows=None if len(rows) == len(ids) else torch.tensor(rows, dtype=lt, device=dev),
            write_slots=torch.tensor(slots, dtype=lt, device=dev), batches=batches,
            last_rows=torch.tensor(last_rows, dtype=lt, device=dev))

    def _attention_batch(self, seqs: list[Sequence], runs: list[range], rows: slice) -> AttentionBatch:
        """The block tables and the causal bias of sequences attending in one call, each run padded to the
        longest (Q) and each context to the longest (C)."""
        bs = self.block_size
        S, Q = len(seqs), max(len(r) for r in runs)
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
        qpos = torch.zeros(S, Q, dtype=torch.long)
        pad_index = []
        for i, r in enumerate(runs):
            qpos[i, :len(r)] = torch.arange(r.start, r.stop)
            pad_index += range(i * Q, i * Q + len(r))
        allowed = torch.arange(max_blocks * bs)[None, None, :] <= qpos[:, :, None]   # causal, and inside the context
        g = self.dims.n_heads // self.dims.n_kv_heads
        allowed = allowed.repeat_interleave(g, dim=1)[:, None]        # one row per (new token, query head of a group)
        bias = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, torch.finfo(self.dtype).min)
        dev, lt = self.device, torch.long
        return AttentionBatch(rows, torch.tensor(tables, dtype=lt, device=dev), bias.to(dev),
                              None if Q == 1 else torch.tensor(pad_index, dtype=lt, device=dev))

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm in transformers' order of operations (normalised in float32, then scaled by the weight)."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, w.shape, w, self.eps)
        return w * F.rms_norm(x.float(), w.shape, None, self.eps).to(x.dtype)     # rounded, then scaled

    def _attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inp: StepInput) -> torch.Tensor:
        """Store this layer's new keys/values, then attend over each sequence's paged context.

        One call per batch of ``inp.batches``: the decode tokens together, the prompt runs together. A call pads
        every run to its longest and every context to its longest: in a single call, a decode token beside a
        256-token prompt chunk would be computed as 256 queries over the longest context.
        Returns (T, n_heads * head_dim), rows in the step's order."""
        d = self.dims
        if inp.write_rows is not None:                           # skip tokens whose keys/values are cached already
            k, v = k.index_select(0, inp.write_rows), v.index_select(0, inp.write_rows)
        self.k_slots[i].index_copy_(0, inp.write_slots, k)
        self.v_slots[i].index_copy_(0, inp.write_slots, v)
        g = d.n_heads // d.n_kv_heads                            # query heads per key/value head
        outs = []
        for b in inp.batches:
            S, Q, C = b.attn_bias.shape[0], b.attn_bias.shape[2] // g, b.attn_bias.shape[3]
            tables = b.block_tables.view(-1)        # gather whole blocks: (S * blocks, block_size * n_kv * head_dim)
            keys = self.k_blocks[i].index_select(0, tables).view(S, C, d.n_kv_heads, d.head_dim).transpose(1, 2)
            values = self.v_blocks[i].index_select(0, tables).view(S, C, d.n_kv_heads, d.head_dim).transpose(1, 2)
            if b.pad_index is None:                               # decode: one query per sequence
                qb = q[b.rows].reshape(S, d.n_kv_heads, g, d.head_dim)
                out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=b.attn_bias).view(S, -1)
            else:                                                 # pad each run to Q rows, attend, drop the padding
                qb = q.new_zeros(S * Q, d.n_heads, d.head_dim).index_copy_(0, b.pad_index, q[b.rows])
                qb = qb.view(S, Q, d.n_kv_heads, g, -1).permute(0, 2, 1, 3, 4).reshape(S, d.n_kv_heads, Q * g, -1)
                out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=b.attn_bias)  # (S, n_kv, Q*g, hd)
                out = out.view(S, d.n_kv_heads, Q, g, d.head_dim).permute(0, 2, 1, 3, 4).reshape(S * Q, -1)
                out = out.index_select(0, b.pad_index)
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs)    # the batches' rows follow each other

    def _layer(self, i: int, h: torch.Tensor, inp: StepInput, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        w, d = self.layers[i], self.dims
        qkv = linear(self._rms_norm(h, w["in_norm"]), w["w_qkv"], w["b_qkv"])
        n_qk = (d.n_heads + d.n_kv_heads) * d.head_dim
        qk = qkv[:, :n_qk].view(-1, d.n_heads + d.n_kv_heads, d.head_dim)
        qk = qk * cos + qk.roll(d.head_dim // 2, dims=-1) * sin    # rotary embedding of q and k at once
        v = qkv[:, n_qk:].view(-1, d.n_kv_heads, d.head_dim)
        attn = self._attention(i, qk[:, :d.n_heads], qk[:, d.n_heads:], v, inp)
        h = add_linear(h, attn, w["w_o"], w["b_o"])
        gate, up = linear(self._rms_norm(h, w["post_norm"]), w["w_gate_up"], w["b_gate_up"]).chunk(2, dim=-1)
        return add_linear(h, self.act(gate) * up, w["w_down"], w["b_down"])

    @torch.no_grad()
    def forward(self, inp: StepInput) -> torch.Tensor:
        """Logits of each sequence's last new token, (S, vocab)."""
        if self._runs_compiled(inp):
            return self.compiled(inp)[0]
        h = F.embedding(inp.input_ids, self.embed)
        cos, sin = self.cos[inp.positions][:, None], self.sin[inp.positions][:, None]
        for i in range(len(self.layers)):
            h = self._layer(i, h, inp, cos, sin)
        h = self._rms_norm(h.index_select(0, inp.last_rows), self.final_norm)
        return linear(h, self.lm_head)

    @torch.no_grad()
    def sequence_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence, (len, vocab) in float32, from one prefill through the pool:
        what the engine computes there, for measuring a fast path's quality (chapter 07's KL divergence).
        It writes the pool's first blocks: call it on a runner that holds no live sequence."""
        seq = self._sequence_at_pool_start(token_ids, token_ids, 1)
        seq.schedule_run(0, len(token_ids))
        inp = self.prepare([seq])
        inp.last_rows = torch.arange(len(token_ids), device=self.device)
        return self.forward(inp).float()

    @torch.no_grad()
    def decode_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence, (len, vocab) in float32, the first from a prefill of one
        token and each next one from a decode step fed the sequence's next token: what the engine's decode steps
        compute (on ``pack="compiled"`` a different computation from :meth:`sequence_logits`' prefill). Writes the
        pool's first blocks, like :meth:`sequence_logits`."""
        seq = self._sequence_at_pool_start(token_ids, token_ids[:1], len(token_ids))
        seq.schedule_run(0, 1)
        out = [self.forward(self.prepare([seq])).float()]
        for t in token_ids[1:]:
            seq.append(t)
            seq.schedule_run(len(seq) - 1, len(seq))
            out.append(self.forward(self.prepare([seq])).float())
        return torch.cat(out)

    def _sequence_at_pool_start(self, token_ids: list[int], prompt: list[int], max_tokens: int) -> Sequence:
        """A sequence holding ``prompt`` whose block table is the pool's first blocks, room for all of ``token_ids``."""
        n_blocks = -(-len(token_ids) // self.block_size)
        if not token_ids or n_blocks > self.num_blocks or len(token_ids) > self.max_positions:
            raise ValueError(f"need 1 to {min(self.num_blocks * self.block_size, self.max_positions)} tokens, "
                             f"got {len(token_ids)}")
        seq = Sequence(0, list(prompt), max_tokens, block_size=self.block_size, ignore_eos=True)
        seq.block_table = list(range(n_blocks))
        return seq

    def _runs_compiled(self, inp: StepInput) -> bool:
        """Whether this step goes through the compiled step (pack="compiled"): a decode-shaped step, one new token
        per sequence, each one stored. A step with a longer run (a prompt, or a chunk of one, mixed with decode
        tokens or not) runs eagerly."""
        return self.compiled is not None and inp.is_decode and inp.write_rows is None

    def run(self, seqs: list[Sequence]) -> list[int]:
        """One step: the greedy next token of every sequence, from its run's last position (a prompt chunk that
        is not the prompt's last gets one too; the scheduler does not use it)."""
        inp = self.prepare(seqs)
        if self._runs_compiled(inp):
            return self.compiled(inp)[1].tolist()            # its argmax is part of the compiled graph
        return self.forward(inp).argmax(dim=-1).tolist()
