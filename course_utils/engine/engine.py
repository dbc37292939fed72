"""Chapter 04 -- the engine: requests in, tokens out, one scheduled step at a time.

``LLMEngine`` ties the pieces together: :class:`~.block_manager.BlockManager` (which
blocks), :class:`~.scheduler.Scheduler` (which sequences, prefill or decode) and
:class:`~.model_runner.ModelRunner` (the model over the paged pool). Decoding is greedy.
A request with bad input is refused with a ``ValueError`` naming the problem; the
requests already accepted are not affected.
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
    """What one engine step did: when (seconds since the engine's clock started), how many sequences and tokens."""

    start_s: float
    end_s: float
    is_prefill: bool
    num_seqs: int
    num_tokens: int
    blocks_used: int


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
    ``weights``: a :class:`RunnerWeights` to share with other engines on the same model.
    """

    def __init__(self, model, *, num_blocks: int = 256, block_size: int = 16, max_num_seqs: int = 8,
                 max_num_batched_tokens: int | None = None, policy: str = "continuous",
                 prefix_caching: bool = True, dtype=None, eos_token_ids=None, weights: RunnerWeights | None = None):
        self.block_manager = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, dtype=dtype, weights=weights,
                                  max_num_seqs=max_num_seqs)
        self.capacity_tokens = min(num_blocks * block_size, self.runner.max_positions)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs, policy=policy,
                                   max_num_batched_tokens=max_num_batched_tokens or self.capacity_tokens)
        self.eos_token_ids = eos_ids_of(model) if eos_token_ids is None else frozenset(eos_token_ids)
        self.vocab_size = self.runner.embed.shape[0]
        self.sequences: dict[int, Sequence] = {}
        self.steps: list[StepRecord] = []
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _validate(self, prompt_ids, max_tokens) -> list[int]:
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
        prompt_ids = self._validate(prompt_ids, max_tokens)
        seq = Sequence(len(self.sequences), prompt_ids, max_tokens, block_size=self.block_manager.block_size,
                       eos_token_ids=self.eos_token_ids, ignore_eos=ignore_eos, arrival_s=self.now())
        self.sequences[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def step(self) -> list[Sequence]:
        """Schedule, run the model once, hand the new tokens to the scheduler; returns the sequences that finished."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            if self.has_unfinished():
                raise RuntimeError("the scheduler could not run any sequence although requests are waiting")
            return []
        num_tokens = sum(len(seq.positions_to_run(is_prefill)[0]) for seq in seqs)
        start_s = self.now()
        token_ids = self.runner.run(seqs, is_prefill)
        end_s = self.now()
        finished = self.scheduler.postprocess(seqs, token_ids, is_prefill, start_s=start_s, end_s=end_s)
        self.steps.append(StepRecord(start_s, end_s, is_prefill, len(seqs), num_tokens,
                                     self.block_manager.num_used_blocks))
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
