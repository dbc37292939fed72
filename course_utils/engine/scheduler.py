"""Chapter 04 -- the scheduler: who runs this step, and what happens when memory runs out.

By default each step is either a *prefill* step (new sequences run their prompts) or a
*decode* step (every running sequence produces one token), as in nano-vllm: ``schedule()``
returns ``(seqs, is_prefill)``; after the model has run, ``postprocess()`` appends each
sequence's new token and finishes the sequences that are done. What the step feeds of each
sequence is set on it (``num_computed_tokens``, ``num_scheduled_tokens``: see :mod:`.sequence`).

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

``chunked_prefill=True`` (continuous policy only; Sarathi-Serve, Agrawal et al. 2024, and vLLM's
scheduler): there are no separate prefill and decode steps. Each step is built against a budget of
``max_num_batched_tokens`` *real* tokens (nothing is padded in the count). First every running
sequence past its prompt gets its decode token (preempting the newest sequence when blocks run
out, as above); then the rest of the budget goes to prompts, first come first served: the next
chunk of each sequence still in prefill (oldest first), then new prompts from the queue while a
slot is free. A prompt can thus span several steps; ``seq.num_computed_tokens`` says how far it
has got. Its blocks are given as its chunks arrive (positions found in the prefix cache when it is
admitted are not computed again), and it produces its first token only in the step that computes
its last prompt position. A chunk whose blocks are short is cut to the blocks there are (decode
tokens come first, and their blocks too); when decodes run out of blocks, the newest sequence --
often the prompt part-way through its prefill -- is preempted and will be prefilled again. No new
prompt is admitted in a step that preempted or cut a chunk (unless the step would otherwise be
empty). Since a queued prompt is admitted only with the budget the older ones leave, at most one
prompt is part-way through its prefill between steps. The budget must hold a decode token for
every slot (``max_num_batched_tokens >= max_num_seqs``), so a running sequence never waits a step
because a long prompt arrived; and a step with no decode work gives the prompt in prefill all the
blocks there are (a request that fits the whole cache fits them), so nothing starves.
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
                 policy: str = "continuous", chunked_prefill: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        check_positive_int("max_num_seqs", max_num_seqs)
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if not isinstance(chunked_prefill, bool):
            raise ValueError(f"chunked_prefill must be True or False, got {chunked_prefill!r}")
        if chunked_prefill and policy != "continuous":
            raise ValueError(f"chunked_prefill needs policy='continuous', got {policy!r}")
        if chunked_prefill and max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"with chunked_prefill, max_num_batched_tokens must be at least max_num_seqs "
                             f"({max_num_seqs}: one decode token per slot), got {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.chunked_prefill = chunked_prefill
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
        """The sequences to run this step and whether it is a prefill step (chunked prefill: whether it feeds any
        prompt tokens). Each sequence's ``num_scheduled_tokens`` says how many positions it feeds."""
        if self.chunked_prefill:
            return self._schedule_chunked()
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
            self.block_manager.allocate(seq, match)
            longest = max(longest, len(seq))
            self._start(seq, len(seq))                           # its whole uncached prompt runs this step
            admitted.append(seq)
        self.num_batches += bool(admitted)
        return admitted

    def _start(self, seq: Sequence, stop: int) -> None:
        """Give the queue's first sequence (its blocks just allocated) a slot; its first run ends at ``stop``."""
        self.waiting.popleft()
        start = min(seq.num_cached_tokens, len(seq) - 1)     # a fully cached prompt still runs its last token
        seq.schedule_run(start, stop)
        seq.status, seq.slot, seq.batch_id = Status.RUNNING, heapq.heappop(self.free_slots), self.num_batches
        seq.in_prefill = True
        self.running.append(seq)

    def _decode_batch(self) -> list[Sequence]:
        """Every running sequence past its prompt, each to feed its newest token (chunked prefill: sequences still in
        prefill are skipped, their next chunk comes afterwards)."""
        batch, i = [], 0
        while i < len(self.running):
            seq = self.running[i]
            if self.chunked_prefill and seq.in_prefill:
                i += 1
                continue
            while not self.block_manager.can_append(seq) and self.running[-1] is not seq:
                self.preempt(self.running[-1])            # the newest sequence gives its blocks back
            if self.block_manager.can_append(seq):
                self.block_manager.may_append(seq)
                seq.schedule_run(len(seq) - 1, len(seq))
                seq.in_prefill = False
                batch.append(seq)
                i += 1
            else:
                self.preempt(seq)
        return batch

    def _schedule_chunked(self) -> tuple[list[Sequence], bool]:
        """Chunked prefill: decode tokens first, then prompt chunks in the budget left (see the module's docstring)."""
        bm, preempted = self.block_manager, self.num_preemptions
        batch = self._decode_batch()
        budget = self.max_num_batched_tokens - len(batch)          # >= 0: the budget holds every slot's decode
        cut = False
        for seq in [s for s in self.running if s.in_prefill]:       # admission order: the oldest prompt first
            if budget == 0:
                break
            start = seq.num_computed_tokens
            stop = min(len(seq), start + budget)
            if bm.room(seq) < stop:
                cut, stop = True, bm.room(seq)                     # the blocks there are (decodes keep theirs)
            if stop <= start:
                continue
            bm.may_append(seq, stop)
            seq.schedule_run(start, stop)
            batch.append(seq)
            budget -= stop - start
        may_admit, admitted = (not cut and self.num_preemptions == preempted) or not batch, False
        while may_admit and budget and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            match = bm.match_prefix(seq)
            start = min(len(match.hits) * bm.block_size, len(seq) - 1)
            stop = min(len(seq), start + budget, bm.room(seq, match))
            if stop <= start:
                break                                              # first come, first served: no overtaking
            bm.allocate(seq, match, stop)
            self._start(seq, stop)
            batch.append(seq)
            budget -= stop - start
            admitted = True
        self.num_batches += admitted
        return batch, any(seq.in_prefill for seq in batch)

    def _release(self, seq: Sequence) -> None:
        """Return the sequence's blocks and its slot."""
        self.block_manager.deallocate(seq)
        heapq.heappush(self.free_slots, seq.slot)

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence's blocks back and queue it first (it will recompute its cache)."""
        self.running.remove(seq)
        self._release(seq)
        seq.status, seq.slot, seq.in_prefill = Status.WAITING, None, False
        seq.num_computed_tokens = seq.num_scheduled_tokens = 0
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

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], *, start_s: float,
                    end_s: float) -> list[Sequence]:
        """After a step ran from ``start_s`` to ``end_s``: count each sequence's computed positions, extend its
        time in its slot, append its new token if the step computed its last position (a prompt's earlier
        chunks produce none), and finish those that are done. Returns the sequences that finished."""
        finished = []
        for seq, token in zip(seqs, token_ids):
            if seq.is_finished:                   # static padding: computed, not used
                continue
            if len(seq.spans) <= seq.num_preemptions:       # the first step of this stay in a slot
                seq.spans.append((seq.slot, start_s, end_s))
            else:
                seq.spans[-1] = (seq.spans[-1][0], seq.spans[-1][1], end_s)
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if seq.num_computed_tokens < len(seq):           # a prompt chunk that is not its last
                continue
            seq.in_prefill = False
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
