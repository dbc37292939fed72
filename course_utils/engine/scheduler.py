"""Chapter 04 -- the scheduler: who runs this step, and what happens when memory runs out.

Each step is either a *prefill* step (new sequences run their prompts) or a *decode*
step (every running sequence produces one token), as in nano-vllm: ``schedule()``
returns ``(seqs, is_prefill)``; after the model has run, ``postprocess()`` appends each
sequence's new token and finishes the sequences that are done.

* ``policy="continuous"``: a queued request is admitted the step a slot and its blocks
  are free (Orca, Yu et al. 2022).
* ``policy="static"``: a new batch is admitted only when the whole previous batch has
  finished. Until then a finished sequence keeps its slot and its blocks and is still
  computed as padding (its results are discarded), as transformers' ``generate`` does.

A prefill step pads every prompt to the longest one it admits, so its budget,
``max_num_batched_tokens``, counts padded tokens: sequences admitted x the longest of them.
One sequence is always admitted, whatever its length.

When a decode step needs a block and none is free, the newest running sequence is
*preempted*: its blocks are released and it goes back to the front of the queue, to be
re-prefilled later from its prompt and the tokens it has produced (recompute).
"""
from __future__ import annotations

import heapq
from collections import deque

from ..validation import check_positive_int
from .block_manager import BlockManager
from .sequence import Sequence, Status

#: The batching policies, in the order chapter 04 introduces them.
POLICIES = ("static", "continuous")


class Scheduler:
    """Admission, decode batching and preemption over a :class:`BlockManager`."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "continuous"):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        check_positive_int("max_num_seqs", max_num_seqs)
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.padding: list[Sequence] = []             # static policy: finished, still computed until the batch ends
        self.free_slots = list(range(max_num_seqs))   # a heap: the lowest free slot first
        self.num_batches = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences to run this step and whether it is a prefill step."""
        for _ in range(2):          # a second round when every running sequence was just preempted
            admitted = self._admit()
            if admitted:
                return admitted, True
            batch = self._decode_batch()
            if batch:
                return batch + self.padding, False
        return [], False

    def live(self) -> list[Sequence]:
        """The sequences that hold blocks: running ones, and finished ones kept as padding."""
        return self.running + self.padding

    def _admit(self) -> list[Sequence]:
        if self.policy == "static" and self.running:
            return []
        admitted, longest = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            padded = (len(admitted) + 1) * max(longest, len(seq))   # the step pads every prompt to the longest
            if admitted and padded > self.max_num_batched_tokens:    # one sequence always fits
                break
            match = self.block_manager.match_prefix(seq)          # hashed once per admission
            if not self.block_manager.can_allocate(seq, match):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, match)
            longest = max(longest, len(seq))
            seq.status, seq.slot, seq.batch_id = Status.RUNNING, heapq.heappop(self.free_slots), self.num_batches
            self.running.append(seq)
            admitted.append(seq)
        self.num_batches += bool(admitted)
        return admitted

    def _decode_batch(self) -> list[Sequence]:
        batch, i = [], 0
        while i < len(self.running):
            seq = self.running[i]
            while not self.block_manager.can_append(seq) and self.running[-1] is not seq:
                self.preempt(self.running[-1])            # the newest sequence gives its blocks back
            if self.block_manager.can_append(seq):
                self.block_manager.may_append(seq)
                batch.append(seq)
                i += 1
            else:
                self.preempt(seq)
        return batch

    def _release(self, seq: Sequence) -> None:
        """Return the sequence's blocks and its slot."""
        self.block_manager.deallocate(seq)
        heapq.heappush(self.free_slots, seq.slot)

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence's blocks back and queue it first (it will recompute its cache)."""
        self.running.remove(seq)
        self._release(seq)
        seq.status, seq.slot = Status.WAITING, None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._end_batch_if_done()

    def abort(self, seq: Sequence, reason: str = "abort", *, forget_contents: bool = False) -> bool:
        """Take a sequence out of the queue or out of its slot, its blocks back to the pool (a block it shares only
        loses its reference) and mark it finished with ``reason``. False, and nothing done, if it had finished:
        a sequence's blocks are never given back twice. ``forget_contents``: see ``BlockManager.deallocate``."""
        if seq.is_finished:
            return False
        if seq.status is Status.WAITING:          # a queued sequence holds no blocks (preemption gave them back)
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.block_manager.deallocate(seq, forget_contents=forget_contents)
            heapq.heappush(self.free_slots, seq.slot)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self._end_batch_if_done()
        return True

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool, *,
                    start_s: float, end_s: float) -> list[Sequence]:
        """After a step ran from ``start_s`` to ``end_s``: append each sequence's new token, extend its
        time in its slot, and finish those that are done. Returns the sequences that finished."""
        finished = []
        for seq, token in zip(seqs, token_ids):
            if seq.is_finished:                   # static padding: computed, not used
                continue
            if is_prefill:
                seq.spans.append((seq.slot, start_s, end_s))
            else:
                seq.spans[-1] = (seq.spans[-1][0], seq.spans[-1][1], end_s)
            reason = seq.append(token)
            if reason is not None:
                seq.finish_s = end_s
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a sequence done; release its blocks and slot (static policy: when its whole batch is done)."""
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.running.remove(seq)
        if self.policy == "continuous":
            self._release(seq)
        else:
            self.padding.append(seq)
            self._end_batch_if_done()

    def _end_batch_if_done(self) -> None:
        """Static policy: once no member of the batch is running, its padding gives blocks and slots back."""
        if not self.running:
            for done in self.padding:
                self._release(done)
            self.padding.clear()
