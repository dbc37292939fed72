"""Chapter 04 -- the engine: requests in, tokens out, one scheduled step at a time.

``LLMEngine`` ties the pieces together: :class:`~.block_manager.BlockManager` (which
blocks), :class:`~.scheduler.Scheduler` (which sequences, prefill or decode) and
:class:`~.model_runner.ModelRunner` (the model over the paged pool). Decoding is greedy.
A request with bad input is refused with a ``ValueError`` naming the problem; the
requests already accepted are not affected. A request can be cancelled (``abort_request``);
a step whose model run raises fails only the sequences it ran (:class:`StepFailed`), gives
their blocks back and leaves the engine serving the others.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..progress import progress_bar
from ..validation import check_positive_int
from .block_manager import BlockManager
from .model_runner import ModelRunner, RunnerWeights
from .scheduler import Scheduler
from .sequence import Refused, Sequence


@dataclass(frozen=True)
class StepRecord:
    """What one engine step did: when (seconds since the engine's clock started), how many sequences and tokens.

    ``num_tokens`` = ``num_prefill_tokens`` (positions fed of sequences in prefill: prompts, chunks of prompts,
    and a preempted sequence's recompute) + ``num_decode_tokens`` (one per sequence past its prompt, and one per
    finished sequence a static batch still computes as padding). ``is_prefill``: the step fed prefill tokens
    (without chunked prefill a step is one or the other; with it a step can hold both).
    """

    start_s: float
    end_s: float
    is_prefill: bool
    num_seqs: int
    num_tokens: int
    blocks_used: int
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


class StepFailed(RuntimeError):
    """A step's model run raised: the sequences it ran are finished with ``finish_reason == "error"`` (the
    message in ``seq.error`` and ``error``), their blocks are back in the pool, and the engine goes on."""

    def __init__(self, seqs: list[Sequence], error: str):
        super().__init__(f"a step failed ({error}); its {len(seqs)} sequence(s) were failed and their blocks freed")
        self.seqs, self.error = seqs, error


def eos_ids_of(model) -> frozenset[int]:
    """The token ids that end generation, as ``generate`` reads them from the generation config."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class LLMEngine:
    """A continuous-batching engine on a paged KV cache, small enough to read in one sitting.

    ``num_blocks * block_size`` token positions of cache are allocated up front.
    ``max_num_seqs`` is the number of slots; ``policy`` is ``"continuous"`` or ``"static"``.
    ``chunked_prefill``: build each step from every running sequence's decode token plus prompt chunks, within
    ``max_num_batched_tokens`` real tokens (see :mod:`.scheduler`); off (the default), a step is a prefill step
    whose budget counts padded tokens, or a decode step. ``max_num_batched_tokens`` defaults to the cache's
    capacity in tokens (with chunked prefill, pass a smaller one to cut long prompts into chunks).
    ``weights``: a :class:`RunnerWeights` to share with other engines on the same model.
    ``keep_history``: keep every request in ``sequences`` and every step in ``steps`` (chapter 04 reads
    them back); a server sets it to False, and a request then leaves the engine the step it finishes.
    """

    def __init__(self, model, *, num_blocks: int = 256, block_size: int = 16, max_num_seqs: int = 8,
                 max_num_batched_tokens: int | None = None, policy: str = "continuous",
                 prefix_caching: bool = True, dtype=None, eos_token_ids=None, weights: RunnerWeights | None = None,
                 keep_history: bool = True, chunked_prefill: bool = False):
        self.block_manager = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, dtype=dtype, weights=weights,
                                  max_num_seqs=max_num_seqs)
        self.capacity_tokens = min(num_blocks * block_size, self.runner.max_positions)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = self.capacity_tokens
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs, policy=policy,
                                   max_num_batched_tokens=max_num_batched_tokens, chunked_prefill=chunked_prefill)
        self.eos_token_ids = eos_ids_of(model) if eos_token_ids is None else frozenset(eos_token_ids)
        self.vocab_size = self.runner.embed.shape[0]
        self.sequences: dict[int, Sequence] = {}
        self.steps: list[StepRecord] = []
        self.keep_history = keep_history
        self._next_id = 0
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def check_request(self, prompt_ids, max_tokens) -> list[int]:
        """The prompt as a list of ids if the engine can serve it; else ``ValueError``/``TypeError`` naming why."""
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.flatten().tolist()
        if not isinstance(prompt_ids, (list, tuple)) or not all(isinstance(t, int) for t in prompt_ids):
            raise TypeError(f"prompt_ids must be a list of token ids (ints), got {type(prompt_ids).__name__}")
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if not all(0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        check_positive_int("max_tokens", max_tokens)
        needed = len(prompt_ids) + max_tokens - 1          # the last generated token is never fed back
        if needed > self.capacity_tokens:
            raise ValueError(f"the request needs {needed} cache positions ({len(prompt_ids)} prompt + "
                             f"{max_tokens} new - 1) but the whole cache holds {self.capacity_tokens}")
        return list(prompt_ids)

    def add_request(self, prompt_ids, max_tokens: int, *, ignore_eos: bool = False) -> int:
        """Queue a request; returns its id. Bad input raises ``ValueError``/``TypeError`` and queues nothing.

        ``ignore_eos``: generate exactly ``max_tokens`` tokens, even past an end-of-sequence token.
        """
        prompt_ids = self.check_request(prompt_ids, max_tokens)
        seq = Sequence(self._next_id, prompt_ids, max_tokens, block_size=self.block_manager.block_size,
                       eos_token_ids=self.eos_token_ids, ignore_eos=ignore_eos, arrival_s=self.now())
        self._next_id += 1
        self.sequences[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def abort_request(self, seq_id: int) -> bool:
        """Cancel a request: out of the queue or its slot, its blocks back in the pool before the next step (a
        shared prefix block only loses this reference). False if it had already finished or is unknown."""
        seq = self.sequences.get(seq_id)
        if seq is None or not self.scheduler.abort(seq, "abort"):
            return False
        seq.finish_s = self.now()
        self._forget([seq])
        return True

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` unless block reference counts match the live block tables and free list, and
        every slot is either free or held by exactly one live sequence."""
        live = self.scheduler.live()
        self.block_manager.check_invariants(live)
        slots = sorted(self.scheduler.free_slots + [s.slot for s in live])
        if slots != list(range(self.scheduler.max_num_seqs)):
            raise RuntimeError(f"slots {slots}: each of 0..{self.scheduler.max_num_seqs - 1} should appear once")

    def _forget(self, seqs: list[Sequence]) -> None:
        if not self.keep_history:
            for seq in seqs:
                self.sequences.pop(seq.seq_id, None)

    def _fail(self, seqs: list[Sequence], exc: BaseException) -> StepFailed:
        """The step that ran ``seqs`` raised: fail them, free their blocks (forgetting what they held), check."""
        error = f"{type(exc).__name__}: {exc}"
        failed = [seq for seq in seqs if not seq.is_finished]
        for seq in failed:
            self.scheduler.abort(seq, "error", forget_contents=True)
            seq.error, seq.finish_s = error, self.now()
        self.check_invariants()
        self._forget(failed)
        return StepFailed(failed, error)

    def step(self) -> list[Sequence]:
        """Schedule, run the model once, hand the new tokens to the scheduler; returns the sequences that finished."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            if self.has_unfinished():
                raise RuntimeError("the scheduler could not run any sequence although requests are waiting")
            return []
        runs = [len(seq.positions_to_run()[0]) for seq in seqs]
        prefill_tokens = sum(n for seq, n in zip(seqs, runs) if seq.in_prefill)
        start_s = self.now()
        try:
            token_ids = self.runner.run(seqs)
        except Exception as exc:                  # e.g. out of memory: this step's sequences fail, the others go on
            raise self._fail(seqs, exc) from exc
        end_s = self.now()
        finished = self.scheduler.postprocess(seqs, token_ids, start_s=start_s, end_s=end_s)
        if self.keep_history:
            self.steps.append(StepRecord(start_s, end_s, is_prefill, len(seqs), sum(runs),
                                         self.block_manager.num_used_blocks, num_prefill_tokens=prefill_tokens,
                                         num_decode_tokens=sum(runs) - prefill_tokens))
        self._forget(finished)
        return finished

    def has_unfinished(self) -> bool:
        return not self.scheduler.is_finished()

    def generate(self, prompts: list, max_tokens, *, ignore_eos: bool = False,
                 progress: bool = False) -> list[Sequence]:
        """Run requests to completion; one result per prompt, in order.

        ``max_tokens``: one int for all, or one per prompt. A prompt with bad input comes back
        as a :class:`~.sequence.Refused` (``finish_reason == "error"``, the message in ``error``).
        """
        limits = max_tokens if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
        if len(limits) != len(prompts):
            raise ValueError(f"got {len(limits)} max_tokens values for {len(prompts)} prompts")
        results: list[Sequence | Refused] = []
        for prompt, limit in zip(prompts, limits):
            try:
                results.append(self.sequences[self.add_request(prompt, limit, ignore_eos=ignore_eos)])
            except (TypeError, ValueError) as exc:
                results.append(Refused(prompt, str(exc)))
        accepted = sum(isinstance(r, Sequence) for r in results)
        with progress_bar(None, "engine", enabled=progress, total=accepted, unit="request") as bar:
            while self.has_unfinished():
                bar.update(len(self.step()))
        return results
