"""A workload through the real engine: its pool sized, its run turned into a :class:`Schedule` like the simulator's."""
from __future__ import annotations

import math
from typing import Sequence

from ..engine import POLICIES
from ..engine import Sequence as EngineSequence
from ..validation import check_positive_int
from .simulate import Schedule, Span


def pool_blocks(prompt_lens: Sequence[int], max_tokens: Sequence[int], *, block_size: int, slots: int) -> int:
    """Blocks enough for ``slots`` requests of the longest prompt + output at once (no preemption),
    plus one spare block per slot."""
    if not prompt_lens or len(prompt_lens) != len(max_tokens):
        raise ValueError("need one output length per prompt, and at least one prompt")
    check_positive_int("block_size", block_size)
    check_positive_int("slots", slots)
    longest = max(prompt_lens) + max(int(n) for n in max_tokens)
    return slots * math.ceil(longest / block_size) + slots


def schedule_from_engine(engine, seqs, policy: str) -> Schedule:
    """A :class:`Schedule` of a finished engine run (times from the first arrival): same summaries, same Gantt chart.

    The engine records when each request's last token came out; under ``"static"`` a request
    is heard when the last member of its batch (same ``batch_id``) finishes.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    seqs = [s for s in seqs if isinstance(s, EngineSequence)]          # leave out refused requests
    if not seqs or any(s.finish_s is None for s in seqs):
        raise ValueError("every sequence must have finished")
    t0 = min(s.arrival_s for s in seqs)
    batch_end: dict[int, float] = {}
    for s in seqs:
        batch_end[s.batch_id] = max(batch_end.get(s.batch_id, 0.0), s.finish_s)
    spans = tuple(Span(i, s.spans[-1][0], s.spans[-1][1] - t0, s.finish_s - t0,
                       (batch_end[s.batch_id] if policy == "static" else s.finish_s) - t0)
                  for i, s in enumerate(seqs))
    decode_steps = sum(1 for st in engine.steps if not st.is_prefill)
    return Schedule(policy, engine.scheduler.max_num_seqs, spans, sum(s.num_output_tokens for s in seqs), decode_steps)


def run_engine_workload(model, prompts: list[list[int]], lengths: Sequence[int], *, policy: str, slots: int,
                        block_size: int = 16, dtype=None, weights=None, progress: bool = True):
    """Run requests (all queued at once) through a fresh engine; ``lengths`` are their exact output lengths.

    EOS is ignored so each request produces exactly its length, as in the simulation;
    prefix caching is off so no request borrows another's work. ``weights``: shared
    :class:`~course_utils.engine.RunnerWeights` (None = fuse a fresh copy). Returns ``(engine, seqs)``.
    """
    from ..engine import LLMEngine
    if len(prompts) != len(lengths):
        raise ValueError(f"got {len(prompts)} prompts for {len(lengths)} lengths")
    blocks = pool_blocks([len(p) for p in prompts], lengths, block_size=block_size, slots=slots)
    engine = LLMEngine(model, num_blocks=blocks, block_size=block_size, max_num_seqs=slots, policy=policy,
                       prefix_caching=False, dtype=dtype, weights=weights)
    seqs = engine.generate(prompts, [int(n) for n in lengths], ignore_eos=True, progress=progress)
    return engine, seqs
