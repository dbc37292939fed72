"""Chapter 11 -- serving for real: a request trace, one streaming client, the metrics of ``vllm bench serve``.

* **The trace** (:class:`Trace`): who asks what, and when -- each request's prompt, its exact
  output length and its arrival time. Arrivals follow :func:`arrival_times_s` (a Poisson process
  or a fixed rate, seeded), scheduled the way ``vllm bench serve`` schedules them.
  :func:`skewed_trace` builds the default workload: chapter 04's skewed answer lengths behind
  prompts cut from *Pride and Prejudice*; :func:`long_prompt_trace` a few long prompts among short ones,
  where chunked prefill acts (:func:`split_by_prompt`, :func:`stalls` and :func:`stall_figure` read its runs).
* **The client** (:func:`replay`): sends every request of a trace at its arrival time to an
  OpenAI-compatible ``/v1/completions`` endpoint (streaming, asynchronous, any number in flight)
  and records when each streamed chunk arrives (:class:`RequestRecord`). Output lengths are
  enforced the same way on every server: ``max_tokens`` with ``ignore_eos``, greedy
  (``temperature = 0``). Tokens are counted from the server's ``usage`` field
  (``completion_tokens``); the token ids come from ``return_token_ids`` (a vLLM extension that the
  course engine's server speaks too).
* **The metrics**, defined as ``vllm bench serve`` defines them (its ``calculate_metrics``):

  - TTFT: request sent -> first streamed chunk;
  - TPOT: (E2EL - TTFT) / (output tokens - 1), one value per request with more than one token;
  - ITL: every gap between two consecutive streamed chunks, pooled over all requests (a chunk may
    hold several tokens, so ITL and TPOT differ when servers batch their output);
  - E2EL: request sent -> last streamed chunk;
  - request and token throughput: completed requests (tokens) / the run's duration;
  - goodput: requests per second that met every SLO (e.g. TTFT <= 500 ms and TPOT <= 100 ms).

  The per-request quantities reuse chapter 02's :func:`~course_utils.token_times.ttft_s`,
  :func:`~course_utils.token_times.tpot_s` and :func:`~course_utils.token_times.inter_token_gaps_s`.
  Aggregates use numpy exactly as vLLM does (mean, median, population std, linear percentiles),
  so the same records give the same figures to the last bit (checked in chapter 11 and in the tests).
* **Load** (:mod:`.load`): rates set from a server's measured capacity, repeated runs, queueing read
  from the time to first token across a run (relative to the same trace at the lowest rate), the knee.
* **The live check** (:mod:`.live`): the course client and ``vllm bench serve`` on the same requests,
  compared request by request, with a tolerance set by the smallest timing error that matters.
* **Server processes** (:class:`ServerProcess`): a server started on loopback as its own process
  group and stopped with everything it started -- by ``stop()``, at the end of a ``with`` block,
  at interpreter exit, and (on Linux) when the process that started it dies.

Modules, one idea each: ``trace`` (the trace), ``metrics`` (records and the metrics of a run), ``client`` (the
replay), ``load`` (the rate sweep and its knee), ``live`` (the per-request comparison with ``vllm bench serve``),
``processes`` (servers as child processes), ``figures`` (charts of finished runs), ``probe`` (the same malformed
requests to any server, and both servers' answers side by side: ``python -m course_utils.serving.probe``).
"""
from __future__ import annotations

from .trace import (
    ARRIVAL_PROCESSES, Trace, TraceRequest, arrival_times_s, long_prompt_lengths, long_prompt_positions,
    long_prompt_trace, make_trace, skewed_trace,
)
from .metrics import (
    MS_PER_S, PERCENTILES, Distribution, RequestMetrics, RequestRecord, SLO, ServingSummary, distribution,
    Stalls, goodput, meets_slo, request_metrics, split_by_prompt, stalls, summarize,
)
from .client import (
    ReplayError, ReplayResult, ServerUnreachable, check_server, completion_payload, replay, replay_async,
    replay_in_process, run_sync,
)
from .load import (
    GROWTH_LIMIT, Knee, Queueing, RatePoint, Spread, baseline_growth, by_rate, capacity_per_s, served_knee,
    goodput_figure, queueing, slo_from_solo, spread, rate_sweep_figure, sweep_queueing, sweep_rates, SweepRates,
    ttft_by_index_figure, SHARED_RATE_MERGE,
    ttft_growth,
)
from .live import (ClientAgreement, RequestTimes, agreement, in_turns, machine_busy, times_from_bench,
                   times_from_records)
from .processes import ServerProcess, die_with_parent, free_port, stop_all_servers
from .figures import latency_cdf_figure, stall_figure, timeline_figure

__all__ = [
    'ARRIVAL_PROCESSES', 'ClientAgreement', 'Distribution', 'GROWTH_LIMIT', 'Knee', 'MS_PER_S', 'PERCENTILES',
    'Queueing', 'RatePoint', 'ReplayError', 'ReplayResult', 'RequestMetrics', 'RequestRecord', 'RequestTimes',
    'SLO', 'ServerProcess', 'Stalls', 'ServerUnreachable', 'ServingSummary', 'Spread', 'Trace', 'TraceRequest',
    'agreement', 'arrival_times_s', 'baseline_growth', 'by_rate', 'capacity_per_s', 'check_server', 'completion_payload',
    'die_with_parent', 'distribution', 'served_knee', 'free_port', 'goodput', 'goodput_figure', 'in_turns',
    'latency_cdf_figure', 'long_prompt_lengths', 'long_prompt_positions', 'long_prompt_trace', 'machine_busy',
    'make_trace', 'meets_slo', 'queueing', 'replay', 'replay_async', 'replay_in_process', 'request_metrics',
    'run_sync', 'skewed_trace', 'slo_from_solo', 'split_by_prompt', 'spread', 'sweep_rates', 'SweepRates', 'SHARED_RATE_MERGE', 'stall_figure', 'stalls', 'stop_all_servers',
    'summarize', 'rate_sweep_figure',
    'sweep_queueing', 'timeline_figure', 'ttft_by_index_figure', 'ttft_growth', 'times_from_bench', 'times_from_records',
]
