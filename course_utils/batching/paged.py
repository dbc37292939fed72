"""The paged KV cache measured: its bytes against a reservation, the blocks prefix sharing saves, and what the
engine's attention pays to gather every sequence's blocks."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..engine import Sequence as EngineSequence
from ..validation import check_positive_int


def paged_kv_bytes(seq_lens: Sequence[int], block_size: int, kv_bytes_per_token: int) -> int:
    """Bytes of K/V blocks that sequences of these lengths occupy (whole blocks, no sharing)."""
    if block_size < 1 or kv_bytes_per_token < 1 or any(n < 0 for n in seq_lens):
        raise ValueError("need block_size >= 1, kv_bytes_per_token >= 1 and lengths >= 0")
    return sum(math.ceil(n / block_size) for n in seq_lens) * block_size * kv_bytes_per_token


def reserved_kv_bytes(n_seqs: int, max_context: int, kv_bytes_per_token: int) -> int:
    """Bytes a server that reserves ``max_context`` positions per slot sets aside for ``n_seqs`` slots."""
    if n_seqs < 0 or max_context < 1 or kv_bytes_per_token < 1:
        raise ValueError("need n_seqs >= 0, max_context >= 1 and kv_bytes_per_token >= 1")
    return n_seqs * max_context * kv_bytes_per_token


@dataclass(frozen=True)
class GatherCost:
    """One decode step of the engine's runner and, timed interleaved with it, the block gathers alone.

    ``copied_bytes``: what the gathers copy per step (every sequence's keys and values, all
    layers, whole blocks); a paged-attention kernel reads the same bytes in place and copies none.
    """

    batch: int
    context_len: int
    step_s: float
    gather_s: float
    copied_bytes: int

    @property
    def share(self) -> float:
        """The gathers' share of the step. The gathers are part of the step's work, so a share of 100 % or more
        means the two timings measured different work (or noise swamped them)."""
        return self.gather_s / self.step_s


def block_gathers(k_blocks, v_blocks, tables: torch.Tensor):
    """The copies a decode step's attention makes, on their own: for each layer in turn, ``index_select`` of that
    layer's key blocks and value blocks over the block tables, each layer's copies freed before the next layer's
    (as in :meth:`~course_utils.engine.ModelRunner._attention`, whose copies live until its layer's attention
    returns). Keeping every layer's copies alive at once would time another job: a fresh allocation the size of
    the whole cache, page faults included. Returns the function to time."""
    if len(k_blocks) != len(v_blocks) or not len(k_blocks):
        raise ValueError("need one key pool and one value pool per layer, and at least one layer")

    def gathers() -> None:
        for k_pool, v_pool in zip(k_blocks, v_blocks):
            keys = k_pool.index_select(0, tables)
            values = v_pool.index_select(0, tables)
            del keys, values                                      # freed before the next layer, as in the step
    return gathers


@torch.no_grad()
def time_block_gather(model, *, batch: int, context_len: int, block_size: int = 16, weights=None,
                      repeats: int = 5, seed: int = 0) -> GatherCost:
    """Time a decode step of ``batch`` sequences holding ``context_len`` cached positions each, and the
    per-layer gathers of their blocks (``index_select`` of keys and values, every layer) on their own.

    The sequences' blocks are scattered over the pool in a random order, as a busy paged cache leaves
    them; their keys and values are zeros (what is gathered does not change what gathering costs).
    """
    from ..engine import ModelRunner
    from ..measure import time_interleaved
    check_positive_int("batch", batch)
    check_positive_int("context_len", context_len)
    per_seq = math.ceil((context_len + 1) / block_size)
    runner = ModelRunner(model, num_blocks=batch * per_seq, block_size=block_size, weights=weights)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(batch * per_seq, generator=gen).tolist()
    seqs = []
    for i in range(batch):
        ids = torch.randint(0, runner.embed.shape[0], (context_len + 1,), generator=gen).tolist()
        seq = EngineSequence(i, ids, 1, block_size=block_size)
        seq.block_table = order[i * per_seq:(i + 1) * per_seq]
        seq.schedule_run(context_len, context_len + 1)         # a decode step: the newest token
        seqs.append(seq)
    inp = runner.prepare(seqs)
    tables = inp.batches[0].block_tables.view(-1)              # a decode step: one batch

    gathers = block_gathers(runner.k_blocks, runner.v_blocks, tables)
    t = time_interleaved({"step": lambda: runner.forward(inp), "gather": gathers}, warmup=1, repeats=repeats,
                         device=runner.device)
    copied = 2 * len(runner.layers) * tables.numel() * runner.k_blocks[0].shape[1] * runner.k_pool.element_size()
    return GatherCost(batch, context_len, t["step"].median_s, t["gather"].median_s, copied)


@dataclass(frozen=True)
class SharingSummary:
    """Blocks named by live block tables vs blocks actually held: the difference is what sharing saved."""

    block_references: int
    distinct_blocks: int

    @property
    def blocks_saved(self) -> int:
        return self.block_references - self.distinct_blocks


def sharing_summary(block_tables: dict[int, list[int]]) -> SharingSummary:
    """Count references and distinct blocks over ``{sequence id: block table}``."""
    refs = [b for table in block_tables.values() for b in table]
    return SharingSummary(len(refs), len(set(refs)))
