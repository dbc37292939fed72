"""Chapter 04 -- one request as the engine sees it: its tokens, its block table, its state.

A :class:`Sequence` holds the prompt and the tokens generated so far in one list,
``token_ids``. The engine never keeps a per-request tensor: the keys and values of a
sequence live in the shared paged pool, and ``block_table[i]`` names the physical block
that holds positions ``i * block_size ... (i + 1) * block_size - 1``.

What a step feeds of a sequence is its state, set by the scheduler: ``num_computed_tokens``
leading positions already have their keys and values in the pool (found in the prefix
cache, or computed by earlier steps), and the step feeds the next ``num_scheduled_tokens``
(:meth:`Sequence.positions_to_run`). A decode step feeds one token; a prefill feeds the
whole uncached prompt, or, with chunked prefill, the next chunk of it.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Status(enum.Enum):
    """Where a sequence is: queued, holding a slot and blocks, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request: prompt + generated tokens, its block table and its timeline (seconds).

    Generation stops after ``max_tokens`` new tokens, or at a token of ``eos_token_ids``
    unless ``ignore_eos``. ``num_cached_tokens`` counts the leading prompt tokens whose keys
    and values were found in shared blocks when the sequence was last given blocks (prefix
    caching). ``spans`` lists ``(slot, start_s, end_s)`` for each stay in a slot (a
    preempted sequence has more than one).

    ``num_computed_tokens``: the leading positions whose keys and values are in the pool (0 while
    queued). ``num_scheduled_tokens``: how many positions the current step feeds, from
    ``num_computed_tokens`` on. ``in_prefill``: True from the step it is given a slot until the step
    that computes its last position (the one that produces its next token); a prompt prefilled in
    chunks stays in prefill for several steps and produces no token before its last chunk.
    """

    def __init__(self, seq_id: int, prompt_ids: list[int], max_tokens: int, *, block_size: int,
                 eos_token_ids: frozenset[int] = frozenset(), ignore_eos: bool = False, arrival_s: float = 0.0):
        self.seq_id = seq_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.ignore_eos = ignore_eos
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.in_prefill = False
        self.slot: int | None = None
        self.batch_id: int | None = None
        self.num_preemptions = 0
        self.arrival_s = arrival_s
        self.finish_s: float | None = None
        self.spans: list[tuple[int, float, float]] = []
        self.finish_reason: str | None = None   # "eos" or "length"; "abort" (cancelled), "error" (its step failed)
        self.error: str | None = None           # why its step failed (finish_reason "error")

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.value}, {self.num_prompt_tokens} prompt + "
                f"{self.num_output_tokens} new tokens, blocks={self.block_table})")

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold the keys and values of all ``len(self)`` tokens."""
        return math.ceil(len(self) / self.block_size)

    def block_tokens(self, i: int) -> list[int]:
        """The token ids that block ``i`` of this sequence holds (the last one may be partial)."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def positions_to_run(self) -> tuple[range, int]:
        """The positions this step feeds, and the first of them whose keys/values it stores.

        The step feeds ``num_scheduled_tokens`` positions from ``num_computed_tokens`` on, and stores
        each one not found in the prefix cache: a fully cached prompt still runs its last token (to get
        the logits of the next one) but stores nothing. A finished sequence still computed as padding
        (static batching) reruns its last fed token and stores nothing.
        """
        if self.is_finished:
            last = len(self) - 2
            return range(last, last + 1), last + 1
        start = self.num_computed_tokens
        return range(start, start + self.num_scheduled_tokens), max(start, self.num_cached_tokens)

    def schedule_run(self, start: int, stop: int) -> None:
        """Make the next step feed positions ``start ... stop - 1`` (the ones before ``start`` are in the pool)."""
        if not 0 <= start < stop <= len(self):
            raise ValueError(f"a run must satisfy 0 <= start < stop <= {len(self)}, got ({start}, {stop})")
        self.num_computed_tokens, self.num_scheduled_tokens = start, stop - start

    def append(self, token_id: int) -> str | None:
        """Add a generated token; return why the sequence stops now (``"eos"``/``"length"``) or None."""
        self.token_ids.append(token_id)
        if not self.ignore_eos and token_id in self.eos_token_ids:
            return "eos"
        if self.num_output_tokens >= self.max_tokens:
            return "length"
        return None

    @property
    def latency_s(self) -> float | None:
        """Seconds from arrival to the last token (None until finished)."""
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass(frozen=True)
class Refused:
    """A request the engine did not accept: its prompt as given and why (``engine.generate`` returns it in place)."""

    prompt_ids: object
    error: str
    finish_reason: str = "error"
