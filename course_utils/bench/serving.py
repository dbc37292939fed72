"""Chapter 11 rows: the course engine behind its streaming server, measured by the chapter's client.

The server runs in a thread of this process (the chapter runs it as a child process, and vLLM
beside it; vLLM's start-up takes minutes, so it is left to the chapter and its tests).
"""
from __future__ import annotations

from ..batching import pool_blocks
from ..engine import LLMEngine
from ..engine_server import EngineServer
from ..serving import SLO, replay, skewed_trace
from . import Row

_SECTION = "11 serving"


def rows(ctx):
    """TTFT, TPOT, ITL and throughput of the course engine's server on the chapter's trace, at two offered loads."""
    model, tok = ctx.model()
    n = ctx.sizes(32, 8)
    trace = skewed_trace(tok, n, rate_per_s=2.0, median_output=ctx.sizes(12, 3), longest_output=ctx.sizes(48, 10),
                         total_output=ctx.sizes(None, 40), prompt_tokens=ctx.sizes((16, 64), (4, 12)))
    slots = 8
    blocks = pool_blocks([r.prompt_tokens for r in trace.requests], [r.output_tokens for r in trace.requests],
                         block_size=16, slots=slots)
    engine = LLMEngine(model, num_blocks=blocks, block_size=16, max_num_seqs=slots, prefix_caching=False)
    slo = SLO(ttft_ms=1500, tpot_ms=250)
    with EngineServer(engine, tok, model_name="course-engine").start_in_thread() as server:
        for rate in ctx.sizes((1.0, 4.0), (8.0,)):
            s = replay(server.url, "course-engine", trace.at_rate(rate), progress=False).summary(slo)
            where = f"{n} requests at {rate:g} req/s, {slots} slots"
            yield Row(_SECTION, f"engine server: median TTFT, {where}", s.ttft.median * 1e3, "ms",
                      note=f"p90 {s.ttft.p(90) * 1e3:,.0f} ms, p99 {s.ttft.p(99) * 1e3:,.0f} ms (n = {s.ttft.n})")
            yield Row(_SECTION, f"engine server: median TPOT, {where}", s.tpot.median * 1e3, "ms",
                      note=f"p90 {s.tpot.p(90) * 1e3:,.0f} ms (n = {s.tpot.n}); ITL p99 {s.itl.p(99) * 1e3:,.0f} ms "
                           f"(n = {s.itl.n})")
            yield Row(_SECTION, f"engine server: output throughput, {where}", s.output_throughput, "tok/s",
                      note=f"{s.request_throughput:.2f} req/s served; goodput {s.request_goodput:.2f} req/s under {slo}")
