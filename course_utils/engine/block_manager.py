"""Chapter 04 -- the paged KV cache's allocator: fixed-size blocks, a free list, reference counts.

The pool of key/value memory is cut into ``num_blocks`` blocks of ``block_size`` token
positions. A sequence owns a *block table*, the list of block ids that hold its
positions in order, so its cache can be scattered in memory while staying logically
contiguous (PagedAttention, Kwon et al. 2023).

Prefix sharing: a *full* block is identified by a hash of its tokens chained with the
hash of the block before it, so equal hashes mean equal prefixes. A new sequence whose
leading blocks match reuses them (the reference count goes up) instead of recomputing
them. A block whose count falls to zero goes back to the free list but keeps its hash and
contents until it is handed out again, so a later request with the same prefix can still
revive it.

A block is registered (given its hash) by the step that fills its last position, and is
filled during that very step: the model runner writes every new key/value of a layer before
any sequence reads that layer. With chunked prefill a prompt is given blocks chunk by chunk
(``num_tokens`` of :meth:`BlockManager.allocate` and :meth:`BlockManager.may_append`), and a
block its chunk fills only in part stays unregistered until a later chunk completes it.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from ..validation import check_positive_int
from .sequence import Sequence


def block_hash(prefix_hash: int | None, token_ids: list[int]) -> int:
    """64-bit content hash of a full block, chained with the hash of the block before it."""
    h = hashlib.blake2b(digest_size=8)
    if prefix_hash is not None:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True)
class PrefixMatch:
    """A sequence's chained block hashes and the ids of the leading blocks that already hold its tokens."""

    hashes: list[int]
    hits: list[int]


class Block:
    """One block of the pool: how many sequences use it, and what it holds (if full)."""

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out blocks to sequences: ``match_prefix``, then ``can_allocate / allocate / can_append / may_append /
    deallocate``."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True):
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.cached: dict[int, int] = {}   # content hash -> id of a block holding that content

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free)

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Hash the sequence's full blocks and find the leading ones the pool already holds.

        Computed once per admission: the scheduler passes it to :meth:`can_allocate` and
        :meth:`allocate`. A hash is only a name: a hit also needs the block's tokens to be equal.
        """
        hashes, h = [], None
        for i in range(len(seq) // self.block_size):
            h = block_hash(h, seq.block_tokens(i))
            hashes.append(h)
        hits = []
        for i, h in enumerate(hashes if self.prefix_caching else []):
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(seq.block_tokens(i)):
                break
            hits.append(bid)
        return PrefixMatch(hashes, hits)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, match: PrefixMatch | None = None, num_tokens: int | None = None) -> bool:
        """Enough free blocks to give the sequence its first ``num_tokens`` positions (default: all its tokens),
        counting shared blocks already in use as free of charge."""
        match = self.match_prefix(seq) if match is None else match
        num_tokens = len(seq) if num_tokens is None else num_tokens
        in_use = sum(1 for bid in match.hits if self.blocks[bid].ref_count > 0)
        return self.num_free_blocks >= self._blocks_for(num_tokens) - in_use

    def room(self, seq: Sequence, match: PrefixMatch | None = None) -> int:
        """How many leading positions the sequence could hold if it took every free block: those of the blocks it
        holds, or, while it holds none, of its cached prefix blocks already in use (``match``)."""
        if seq.block_table:
            held = len(seq.block_table)
        else:
            match = self.match_prefix(seq) if match is None else match
            held = sum(1 for bid in match.hits if self.blocks[bid].ref_count > 0)
        return (held + self.num_free_blocks) * self.block_size

    def _take_free(self) -> Block:
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None and self.cached.get(block.hash) == bid:
            del self.cached[block.hash]        # its old contents are about to be overwritten
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block

    def _register(self, block: Block, h: int, token_ids: list[int]) -> None:
        if self.prefix_caching:
            block.hash, block.token_ids = h, tuple(token_ids)
            self.cached[h] = block.block_id

    def allocate(self, seq: Sequence, match: PrefixMatch | None = None, num_tokens: int | None = None) -> None:
        """Give a waiting sequence blocks for its first ``num_tokens`` positions (default: all its tokens), reusing
        the cached prefix blocks of ``match``, and register the full blocks among them."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks {seq.block_table}")
        match = self.match_prefix(seq) if match is None else match
        num_tokens = len(seq) if num_tokens is None else num_tokens
        for i in range(self._blocks_for(num_tokens)):
            if i < len(match.hits):
                block = self.blocks[match.hits[i]]
                if block.ref_count == 0:
                    del self.free[block.block_id]     # revive a freed block that still holds the prefix
                block.ref_count += 1
            else:
                block = self._take_free()
                if i < min(len(match.hashes), num_tokens // self.block_size):   # full once this step has run
                    self._register(block, match.hashes[i], seq.block_tokens(i))
            seq.block_table.append(block.block_id)
        seq.num_cached_tokens = len(match.hits) * self.block_size

    def can_append(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Enough free blocks for the sequence to hold ``num_tokens`` positions (default ``len(seq)``: the next
        decode step writes position ``len(seq) - 1``, a new block if it starts one)?"""
        num_tokens = len(seq) if num_tokens is None else num_tokens
        return self.num_free_blocks >= self._blocks_for(num_tokens) - len(seq.block_table)

    def may_append(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Before a step that computes the sequence's positions ``seq.num_computed_tokens ... num_tokens - 1``
        (default ``len(seq)``: a decode step): add the blocks they start; register each block they fill."""
        num_tokens = len(seq) if num_tokens is None else num_tokens
        while len(seq.block_table) < self._blocks_for(num_tokens):
            seq.block_table.append(self._take_free().block_id)
        for i in range(seq.num_computed_tokens // self.block_size, num_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            prev = self.blocks[seq.block_table[i - 1]].hash if i else None
            if block.hash is None and (i == 0 or prev is not None):
                self._register(block, block_hash(prev, seq.block_tokens(i)), seq.block_tokens(i))

    def deallocate(self, seq: Sequence, *, forget_contents: bool = False) -> None:
        """Drop the sequence's references; blocks nobody uses go back to the free list.

        ``forget_contents``: those blocks also lose their hash, so no later prompt reuses them (after a failed
        step, whose keys and values may never have been written)."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {bid} reference count went negative")
            if block.ref_count == 0:
                self.free[bid] = None
                if forget_contents and block.hash is not None:
                    if self.cached.get(block.hash) == bid:
                        del self.cached[block.hash]
                    block.hash, block.token_ids = None, ()
        seq.block_table.clear()

    def check_invariants(self, live: list[Sequence]) -> None:
        """Raise ``RuntimeError`` unless reference counts match the live block tables and the free list."""
        counts = [0] * len(self.blocks)
        for seq in live:
            for bid in seq.block_table:
                counts[bid] += 1
        for block, expected in zip(self.blocks, counts):
            if block.ref_count != expected or block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id}: ref_count {block.ref_count}, "
                                   f"but {expected} live block tables name it")
            if (block.ref_count == 0) != (block.block_id in self.free):
                raise RuntimeError(f"block {block.block_id}: ref_count {block.ref_count} but "
                                   f"{'in' if block.block_id in self.free else 'not in'} the free list")
        for h, bid in self.cached.items():
            if self.blocks[bid].hash != h:
                raise RuntimeError(f"hash table points at block {bid}, which holds other content")
