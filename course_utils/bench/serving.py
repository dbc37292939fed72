"""Chapter 11 rows: the course engine behind its streaming server, measured by the chapter's client.

The first rows run the server in a thread of this process, on the chapter's trace. The long-prompt rows set the
course engine's server (bfloat16, chunked prefill; a child process) against vLLM's (bfloat16, the same step budget)
on the chapter's long-prompt trace, where vLLM's environment exists; in the reduced run (tests) they are left out,
since vLLM's start-up takes minutes. Where the engine misses a target there, rows follow that profile one chunk
step of its prefill (in this process, the served path and thread count) by operator class, with its matrix
products' FLOP floor; the reduced run profiles a tiny chunk step instead, to check those rows.
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
    yield from _long_prompts_vs_vllm(ctx)


#: The long-prompt rows' step budget (tokens): both servers cut every prompt longer than this into pieces.
LONG_BUDGET = 512


def _long_prompts_vs_vllm(ctx):
    """The course engine (bf16, its quickest eager bf16 path, chunked prefill) against vLLM (bf16, the same step
    budget) on chapter 11's long-prompt trace, by the chapter's client: blocks engine, vLLM, vLLM, engine, each of two
    replays, vLLM stopped while the engine is measured (as the engine-speed rows do)."""
    from ..engine.speed import available_paths, fastest_exact_bf16
    from .engine_speed import _served_threads
    if ctx.reduced:           # vLLM's start-up takes minutes: left to the full run; a tiny chunk step profiled
        yield from _prefill_profile(ctx, fastest_exact_bf16(available_paths(ctx.device)), _served_threads())
        return
    import tempfile
    from pathlib import Path

    from .. import vllm_env
    from ..engine_server import start_engine_server
    from ..models import resolve_model_source
    from ..serving import Spread, long_prompt_trace, split_by_prompt, spread, summarize

    support = vllm_env.vllm_available(ctx.device)
    if not support:
        yield Row(_SECTION, "long prompts, vLLM CPU bf16: not measured", float("nan"), "", note=support.reason)
        return
    _, tok = ctx.model()
    long_tokens = (512, 2048)
    trace = long_prompt_trace(tok, 4, 8, long_tokens=long_tokens, short_tokens=(16, 64), long_output=8,
                              short_output=24, rate_per_s=4.0)
    lengths = [r.prompt_tokens for r in trace.requests if r.prompt_tokens >= long_tokens[0]]
    slots, threads, pack = 8, _served_threads(), fastest_exact_bf16(available_paths(ctx.device))
    blocks = sum(-(-(r.prompt_tokens + r.output_tokens) // 16) + 1 for r in trace.requests)
    figures = {"course engine": [], "vLLM": []}

    def block(name, url):
        for _ in range(2):
            res = replay(url, "m", trace, warmup=0, progress=False)
            short, long_ = split_by_prompt(res.records, long_tokens[0])
            a, sh = res.summary(), summarize(short, res.duration_s, percentiles=(100,))
            figures[name].append(dict(ttft=a.ttft.median, tps=a.output_throughput, gap=sh.itl.p(100),
                                      long_ttft=summarize(long_, res.duration_s).ttft.median))

    engine = start_engine_server(ctx.model_name, served_model_name="m", dtype="bfloat16", pack=pack, max_num_seqs=slots,
                                 num_blocks=blocks, prefix_caching=False, threads=threads, chunked_prefill=True,
                                 max_num_batched_tokens=LONG_BUDGET, progress=False)
    try:
        replay(engine.base_url, "m", trace, warmup=1, progress=False)               # every shape once, unclocked
        block("course engine", engine.base_url)
        folder, _ = resolve_model_source(ctx.model_name)
        log = Path(tempfile.gettempdir()) / "course-bench-vllm-long-prompts.log"
        vllm = vllm_env.start_vllm_server(folder, served_model_name="m", dtype="bfloat16", max_num_seqs=slots,
                                          max_num_batched_tokens=LONG_BUDGET, progress=False, log_path=log,
                                          max_model_len=max(1024, *(r.prompt_tokens + r.output_tokens
                                                                    for r in trace.requests)))
        try:
            settings = vllm_env.server_settings(log.read_text(errors="replace"))       # what vLLM says it did
            replay(vllm.base_url, "m", trace, warmup=1, progress=False)
            block("vLLM", vllm.base_url)
            block("vLLM", vllm.base_url)
        finally:
            vllm.stop()
        block("course engine", engine.base_url)
    finally:
        engine.stop()
    spreads = {name: {k: spread([f[k] for f in runs]) for k in runs[0]} for name, runs in figures.items()}
    e, v = ({k: x.median for k, x in spreads[name].items()} for name in ("course engine", "vLLM"))
    where = (f"{len(trace)} requests at 4 req/s, {len(lengths)} long prompts ({', '.join(map(str, lengths))} tokens, "
             f"8 tokens out) among {len(trace) - len(lengths)} short ones (16-64 tokens, 24 out); both servers chunked "
             f"with a {LONG_BUDGET}-token step budget, {slots} slots, {threads} compute thread"
             f"{'s' if threads > 1 else ''}; engine pack {pack}; blocks engine, vLLM, vLLM, engine of 2 runs each, "
             "vLLM stopped during the engine's; medians of 4 runs per server")

    def span(name, k, scale=1e3, spec=",.0f"):
        x = spreads[name][k]
        return Spread(x.median * scale, x.low * scale, x.high * scale).fmt(spec)

    met = e["tps"] / v["tps"] >= 1.0, e["ttft"] / v["ttft"] <= 1.0
    yield Row(_SECTION, "long prompts, bf16, chunked: engine / vLLM output throughput", e["tps"] / v["tps"], "x",
              ">= 1.0x", met[0],
              note=f"engine {span('course engine', 'tps', 1, '.1f')} tok/s, vLLM {span('vLLM', 'tps', 1, '.1f')} "
                   f"tok/s; {where}")
    yield Row(_SECTION, "long prompts, bf16, chunked: engine / vLLM median TTFT", e["ttft"] / v["ttft"], "x",
              "<= 1.0x", met[1],
              note=f"engine {span('course engine', 'ttft')} ms, vLLM {span('vLLM', 'ttft')} ms")
    yield Row(_SECTION, "long prompts, bf16, chunked: engine / vLLM long prompts' median TTFT",
              e["long_ttft"] / v["long_ttft"], "x",
              note=f"engine {span('course engine', 'long_ttft')} ms, vLLM {span('vLLM', 'long_ttft')} ms")
    budget = settings.token_budget
    yield Row(_SECTION, "long prompts, bf16, chunked: engine / vLLM short answers' longest gap", e["gap"] / v["gap"],
              "x", note=f"engine {span('course engine', 'gap')} ms, vLLM {span('vLLM', 'gap')} ms; vLLM's log: step "
                        f"budget {budget if budget else '?'}, chunked prefill "
                        f"{'?' if settings.chunked_prefill is None else settings.chunked_prefill}")
    if not all(met):          # where the engine's step time goes
        yield from _prefill_profile(ctx, pack, threads)


#: The classes of the chunk step's profile rows (the rest summed into one row).
_PREFILL_ROWS = ("matrix products", "attention", "paged cache (write, gather)",
                 "element-wise (norms, rotary, activation, residual)")


def _prefill_profile(ctx, pack, threads):
    """Where one chunk step of the engine's chunked prefill goes, by operator class: a prompt of twice the step
    budget fed alone in budget-sized chunks, on the served path (bf16, ``pack``) and thread count, in this process
    (no server); and its matrix products against their FLOP floor at the bf16 compute roof, on the same threads."""
    import torch

    from ..engine.model_runner import RunnerWeights
    from ..engine.speed import CLASSES, profile_prefill
    from ..measure import compute_roof_flops
    model, _ = ctx.model()
    budget = ctx.sizes(LONG_BUDGET, 16)
    prompt = torch.randint(0, model.config.vocab_size, (2 * budget,), generator=torch.Generator().manual_seed(0))
    before, engine = torch.get_num_threads(), None
    torch.set_num_threads(threads)
    try:
        roof = compute_roof_flops(n=ctx.sizes(1024, 64), dtype=torch.bfloat16, device=ctx.device,
                                  rounds=ctx.sizes(3, 1))
        engine = LLMEngine(model, num_blocks=2 * budget // 16 + 2, block_size=16, max_num_seqs=1,
                           prefix_caching=False, weights=RunnerWeights.from_model(model, "bfloat16", pack=pack),
                           chunked_prefill=True, max_num_batched_tokens=budget)
        p = profile_prefill(engine, [prompt.tolist()], roof_flops=roof)
    finally:
        torch.set_num_threads(before)
        engine = None
    name = (f"long prompts, engine prefill step of {p.prompt_tokens:.0f} prompt tokens (bf16, pack {pack}, "
            f"{threads} thread{'s' if threads > 1 else ''})")
    profiled = p.total_ms
    yield Row(_SECTION, f"{name}: step time", p.step_s * 1e3, "ms",
              note=f"median of the {p.steps} chunk steps of one {2 * budget}-token prompt fed alone; under the "
                   f"profiler {p.profiled_step_s * 1e3:,.0f} ms")
    for cls in _PREFILL_ROWS:
        ms = p.ms_per_step[cls]
        yield Row(_SECTION, f"{name}: {cls}", ms, "ms/step",
                  note=f"{ms / profiled:.0%} of the profiled step; {p.calls_per_step[cls]:.0f} operator calls per step")
    rest = [c for c in CLASSES if c not in _PREFILL_ROWS]
    ms = sum(p.ms_per_step[c] for c in rest)
    yield Row(_SECTION, f"{name}: the rest (bookkeeping, other operators, Python)", ms, "ms/step",
              note=f"{ms / profiled:.0%} of the profiled step: "
                   + "; ".join(f"{c} {p.ms_per_step[c]:,.1f} ms" for c in rest))
    products_ms = p.ms_per_step["matrix products"]
    yield Row(_SECTION, f"{name}: matrix products / their FLOP floor", products_ms / (p.floor_s * 1e3), "x",
              note=f"{p.matrix_flops / 1e9:,.1f} GFLOP per step at the bf16 compute roof {roof / 1e9:,.0f} GFLOP/s "
                   f"(an n x n product, the same threads): {p.floor_s * 1e3:,.1f} ms")
