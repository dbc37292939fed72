"""Chapter 04 -- a continuous-batching engine on a paged KV cache, in plain PyTorch.

Read it in this order: ``sequence.py`` (a request), ``block_manager.py`` (the paged
cache's allocator), ``scheduler.py`` (who runs each step, and what happens to its
results), ``model_runner.py`` (the model over the paged pool), ``engine.py`` (the glue).
``packed.py`` holds the fast paths, a switch (``RunnerWeights.from_model(..., pack="int8")``), and
``compiled.py`` the decode step compiled by ``torch.compile`` (``pack="compiled"``);
``speed.py`` measures every path against its floors, with its quality, and profiles a step by operator class.
Its exactness is checked against transformers' ``generate`` with
:mod:`course_utils.reference`.
"""
from .block_manager import Block, BlockManager, PrefixMatch, block_hash
from .engine import LLMEngine, StepFailed, StepRecord, eos_ids_of
from .model_runner import ModelRunner, RunnerWeights, StepInput
from .scheduler import POLICIES, Scheduler
from .sequence import Refused, Sequence, Status

__all__ = ["Block", "BlockManager", "LLMEngine", "ModelRunner", "POLICIES", "PrefixMatch", "Refused", "RunnerWeights",
           "Scheduler", "Sequence", "Status", "StepFailed", "StepInput", "StepRecord", "block_hash", "eos_ids_of"]
