"""Chapter 04 -- a continuous-batching engine on a paged KV cache, in plain PyTorch.

Read it in this order: ``sequence.py`` (a request), ``block_manager.py`` (the paged
cache's allocator), ``scheduler.py`` (who runs each step), ``model_runner.py`` (the
model over the paged pool), ``engine.py`` (the loop), ``check.py`` (exactness against
transformers' ``generate``).
"""
from .block_manager import Block, BlockManager, block_hash
from .check import Agreement, check_against_generate, compare_tokens, reference_generate
from .engine import LLMEngine, StepRecord, eos_ids_of
from .model_runner import ModelRunner, RunnerWeights, StepInput
from .scheduler import Scheduler
from .sequence import Sequence, Status

__all__ = ["Agreement", "Block", "BlockManager", "LLMEngine", "ModelRunner", "RunnerWeights", "Scheduler", "Sequence",
           "Status", "StepInput", "StepRecord", "block_hash", "check_against_generate", "compare_tokens",
           "eos_ids_of", "reference_generate"]
