"""Chapter 04 -- batching: the batch-size sweep, its knee, and static vs continuous batching simulated.

One module per idea; every name is re-exported here (``from course_utils.batching import X``).

* :mod:`.sweep` -- :func:`decode_step_sweep` measures one decode step for B requests that each hold a
  64-token cache (:func:`sweep_step_copies_cache`: whether its cache grows by a copy); :func:`decode_step_grid` times the same step over batch size, context and cache
  format (chapter 10).
* :mod:`.knee` -- :func:`find_knee` finds where growing the batch stops paying, and
  :func:`doubling_gains` / :func:`knees_per_round` / :func:`knee_range` say how firmly, from the spread between
  rounds (a range of batch sizes, or no knee, as the rounds support).
* :mod:`.roofline` -- :func:`roofline_sweep` and :func:`roofline_crossover_batch` predict the same
  curve from chapter 02's two roofs (the machine's FLOP/s and bytes/s), the cache charged as the step moves it
  (:func:`cache_step_bytes`); :func:`decode_intensity` gives a
  step's FLOP per byte from a model's shape alone (for a reference model not loaded here).
* :mod:`.workload` -- :func:`syllabus_output_lengths` builds the chapter's workload (64 requests,
  median 18, longest 231, 1,874 output tokens); :func:`skewed_lengths` dials its skew.
* :mod:`.simulate` -- :class:`StepCost` turns the sweep into a per-step cost function of the batch
  size; :func:`simulate` replays a workload under ``"static"`` or ``"continuous"`` batching and returns a
  :class:`Schedule` (who sat in which slot when, and when each was heard).
* :mod:`.paged` -- the paged cache's bytes against a reservation, prefix sharing, and
  :func:`time_block_gather`: what the engine's attention pays to copy every sequence's blocks into one
  contiguous tensor per layer.
* :mod:`.engine_runs` -- a workload through the real engine (:func:`run_engine_workload`) and its
  :class:`Schedule` (:func:`schedule_from_engine`).
* :mod:`.chunked` -- chunked prefill measured: :func:`long_prompt_arrives` runs a long prompt arriving while
  streams decode and records every token's time; :func:`compare_chunking` (off vs on, alternating rounds),
  :func:`budget_sweep`; the streams' gaps, the long prompt's time to first token (:func:`summarize_run`), and the
  figures (:func:`chunked_timeline_figure`, :func:`budget_figure` for the slider).
* :mod:`.figures` -- the sweep, the Gantt chart of the slots, the map of the paged cache.

The real engine that runs the model this way lives in :mod:`course_utils.engine`.
"""
from .chunked import (ChunkingSummary, LongPromptRun, RoundRange, StepLoad, budget_figure, budget_sweep, change,
                      chunked_timeline_figure, compare_chunking, long_prompt_arrives, long_ttft_s, longest_gap_s,
                      median_gap_s, prefill_steps, round_range, scenario_prompts, stream_gaps_s, stream_tokens_needed,
                      summarize_run)
from .engine_runs import pool_blocks, run_engine_workload, schedule_from_engine
from .figures import block_map_figure, gantt_figure, policy_gantt, sweep_figure
from .knee import DoublingGain, KneeRange, doubling_gains, find_knee, knee_range, knees_per_round
from .paged import (GatherCost, SharingSummary, block_gathers, paged_kv_bytes, reserved_kv_bytes, sharing_summary,
                    time_block_gather)
from .roofline import RooflinePoint, cache_step_bytes, decode_intensity, roofline_crossover_batch, roofline_sweep
from .simulate import Schedule, Span, StepCost, simulate
from .sweep import (GridPoint, SweepPoint, copied_requests, decode_step_grid, decode_step_sweep, fill_cache, prefilled_layers,
                    sweep_step_copies_cache)
from .workload import round_preserving_total, skewed_lengths, syllabus_output_lengths

__all__ = [
    "ChunkingSummary", "LongPromptRun", "RoundRange", "StepLoad", "budget_figure", "budget_sweep", "change", "chunked_timeline_figure",
    "compare_chunking", "long_prompt_arrives", "long_ttft_s", "longest_gap_s", "median_gap_s", "prefill_steps",
    "round_range", "scenario_prompts", "stream_gaps_s", "stream_tokens_needed", "summarize_run",
    "DoublingGain", "GatherCost", "GridPoint", "KneeRange", "RooflinePoint", "Schedule", "SharingSummary", "Span",
    "StepCost", "SweepPoint", "block_gathers", "block_map_figure", "cache_step_bytes", "decode_intensity", "decode_step_grid", "decode_step_sweep", "doubling_gains",
    "copied_requests", "fill_cache", "find_knee", "gantt_figure", "knee_range", "knees_per_round", "paged_kv_bytes", "policy_gantt", "pool_blocks",
    "prefilled_layers", "reserved_kv_bytes", "roofline_crossover_batch", "roofline_sweep", "round_preserving_total",
    "run_engine_workload", "schedule_from_engine", "sharing_summary", "simulate", "skewed_lengths", "sweep_figure", "sweep_step_copies_cache",
    "syllabus_output_lengths", "time_block_gather",
]
