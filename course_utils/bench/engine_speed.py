"""The course engine's speed against its floors and against vLLM's CPU build, one path per row.

Paths: the dense float32 path chapter 04 shows, the dense bfloat16 path, and the low-bit fast paths
(weight-only int8 and int4 kernels, bfloat16 activations; :mod:`course_utils.engine.packed`). For each:
the decode step at B = 1 (ms per token) against the same matrices' product floor and the bandwidth floor,
the decode throughput at B = 16, and the quality it costs (KL divergence of the engine's own logits from
the float32 engine's, on held-out text: chapter 07's statistic). vLLM, when its environment exists
(chapter 11), is measured on the same prompts and lengths through its server, by the chapter's client,
in blocks that alternate with the course engine's server: engine, vLLM, vLLM, engine, with vLLM stopped
while the engine is measured (idle, its server still keeps about half a core busy: reported).
"""
from __future__ import annotations

import statistics
import time

import torch

from ..engine import LLMEngine, RunnerWeights
from ..engine.packed import linear
from ..evaluate import mean_and_se, token_stats
from ..measure import time_interleaved
from ..prefill_decode import decode_floor_s
from ..prompts import book_prompts, book_split, token_ids
from . import Row

_SECTION = "04 engine speed"

#: (label, dtype, pack) of every path measured, the readable one first.
PATHS = [("float32", "float32", "none"), ("bfloat16", "bfloat16", "none"),
         ("bfloat16, oneDNN-prepacked", "bfloat16", "onednn"),
         ("int8 weights, bf16 activations", "bfloat16", "int8"), ("int4 weights, bf16 activations", "bfloat16", "int4")]

#: llama.cpp on the embedded Q4_1 file, decode at B = 1, recorded on another (AVX2-only) development
#: machine on 2026-11-29; printed, labelled as recorded, where llama-cpp-python is not installed.
LLAMA_CPP_RECORDED_MS = 20.6


def _cpu_features() -> str:
    caps = torch.backends.cpu.get_cpu_capability()
    try:
        flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
        extra = [f for f in ("avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni", "avx_vnni") if f in flags]
    except (OSError, IndexError):
        extra = []
    return f"PyTorch CPU capability {caps}" + (f"; {', '.join(extra)}" if extra else "")


def _matmul_floor(runner):
    """One pass over the step's matrices with a one-row input, as the step multiplies them."""
    mats = runner.step_matrices()
    xs = {}
    for m in mats:
        k = m.shape[1]
        xs.setdefault(k, torch.randn(1, k, dtype=runner.dtype, device=runner.device))
    return lambda: [linear(xs[m.shape[1]], m) for m in mats]


def _decode_steps(engine, prompts, new_tokens):
    """Run the requests to the end; the decode steps' seconds (the prefill steps left out)."""
    first = len(engine.steps)
    engine.generate(prompts, new_tokens, ignore_eos=True)
    return [s.end_s - s.start_s for s in engine.steps[first:] if not s.is_prefill]


def _engine(model, weights, slots, prompt_len, new_tokens):
    blocks = slots * (-(-(prompt_len + new_tokens) // 16)) + 2
    return LLMEngine(model, num_blocks=max(blocks, 24), block_size=16, max_num_seqs=slots, prefix_caching=False,
                     weights=weights)


def rows(ctx):
    model, tok = ctx.model()
    prompt_len, new_tokens = ctx.sizes(64, 8), ctx.sizes(48, 6)
    big = ctx.sizes(16, 2)
    prompts = book_prompts(tok, big, prompt_len)
    held = token_ids(tok, book_split().heldout, ctx.sizes(256, 24))[0].tolist()
    features = _cpu_features()
    ref_logp = None
    results = {}
    for label, dtype, pack in PATHS:
        weights = RunnerWeights.from_model(model, dtype, pack=pack)
        one = _engine(model, weights, 1, prompt_len, new_tokens)
        if ref_logp is None:
            ref_logp = torch.log_softmax(one.runner.sequence_logits(held), -1)
            stats = None
        else:
            stats = token_stats(ref_logp[:-1], torch.log_softmax(one.runner.sequence_logits(held), -1)[:-1],
                                torch.tensor(held[1:]))
        _decode_steps(one, prompts[:1], ctx.sizes(4, 2))                          # warm-up
        floor = _matmul_floor(one.runner)
        t_floor = time_interleaved({"floor": floor}, warmup=1, repeats=ctx.sizes(15, 2), device=ctx.device)["floor"]
        steps1 = [s for _ in range(ctx.sizes(3, 1)) for s in _decode_steps(one, prompts[:1], new_tokens)]
        many = _engine(model, weights, big, prompt_len, new_tokens)
        _decode_steps(many, prompts, ctx.sizes(2, 1))                              # warm-up
        steps16 = _decode_steps(many, prompts, new_tokens)
        step1, step16 = statistics.median(steps1), statistics.median(steps16)
        bw_floor = decode_floor_s(one.runner.step_weight_bytes(), ctx.bandwidth_Bps())
        results[label] = (step1, big / step16)
        mb = one.runner.step_weight_bytes() / 1e6
        q = "the reference path" if stats is None else (
            f"KLD {mean_and_se(stats['kld'])[0]:.2e} ± {mean_and_se(stats['kld'])[1]:.0e} nats/token vs float32, same top "
            f"token {float(stats['same_top'].double().mean()):.1%} ({len(held) - 1} held-out positions)")
        yield Row(_SECTION, f"engine decode, B = 1, {label}", step1 * 1e3, "ms/token",
                  note=f"{mb:,.0f} MB of weights per step; {q}; {features}")
        target = "<= 1.3x" if pack in ("none", "onednn") and dtype == "bfloat16" else None
        ratio = step1 / t_floor.median_s
        yield Row(_SECTION, f"engine step / matrix-product floor, B = 1, {label}", ratio, "x", target,
                  None if target is None else ratio <= 1.3,
                  note=f"the same matrices, one row each: {t_floor.median_s * 1e3:.1f} ms; "
                       f"{(step1 - t_floor.median_s) * 1e3:.1f} ms of the step is everything else")
        yield Row(_SECTION, f"engine step / bandwidth floor, B = 1, {label}", step1 / bw_floor, "x",
                  note=f"{mb:,.0f} MB at {ctx.bandwidth_Bps() / 1e9:.1f} GB/s = {bw_floor * 1e3:.1f} ms")
        yield Row(_SECTION, f"engine decode throughput, B = {big}, {label}", big / step16, "tok/s",
                  note=f"median step {step16 * 1e3:.1f} ms over {len(steps16)} steps, {prompt_len}-token prompts")
        del one, many, weights
    base1, base16 = results["float32"]
    prev = None
    for label, (s1, tps) in results.items():
        if prev is not None:
            yield Row(_SECTION, f"ablation: {label} vs {prev[0]}", prev[1][0] / s1, "x faster at B = 1",
                      note=f"B = {big}: {tps / prev[1][1]:.2f}x the throughput; vs float32: {base1 / s1:.2f}x at B = 1, "
                           f"{tps / base16:.2f}x at B = {big}")
        prev = (label, (s1, tps))
    yield from _vs_vllm(ctx, tok, prompts, prompt_len, new_tokens, big, results)
    yield from _llama_cpp(ctx, features)


def _fastest_exact_bf16() -> str:
    """The engine's quickest path that keeps the bfloat16 weights: oneDNN-prepacked where this machine has it."""
    from ..engine.packed import prepack_matrix
    try:
        prepack_matrix(torch.zeros(32, 32, dtype=torch.bfloat16))
        return "onednn"
    except ValueError:
        return "none"


def _vs_vllm(ctx, tok, prompts, prompt_len, new_tokens, big, results):
    """Both servers in bf16, the same trace, the chapter-11 client; blocks alternate, vLLM stopped during the engine's."""
    if ctx.reduced:
        return
    from .. import vllm_env
    from ..engine_server import start_engine_server
    from ..models import resolve_model_source
    from ..serving import make_trace, replay
    support = vllm_env.vllm_available(ctx.device)
    if not support:
        yield Row(_SECTION, "vLLM CPU, bf16: not measured", float("nan"), "", note=support.reason)
        return
    import psutil
    folder, _ = resolve_model_source(ctx.model_name)
    seq_trace = make_trace(prompts[:4], [new_tokens] * 4, rate_per_s=1000.0, process="fixed")
    par_trace = make_trace(prompts, [new_tokens] * big, rate_per_s=1000.0, process="fixed")
    figures = {name: {"tpot": [], "tps": []} for name in ("course engine", "vLLM")}

    def block(name, url):
        one = replay(url, "m", seq_trace, max_concurrency=1, warmup=0, progress=False).summary()
        par = replay(url, "m", par_trace, max_concurrency=big, warmup=0, progress=False).summary()
        figures[name]["tpot"].append(one.tpot.median)
        figures[name]["tps"].append(par.output_throughput)

    def idle_cpu(server) -> float:
        procs = [psutil.Process(p.pid) for p in server._processes()]
        for p in procs:
            p.cpu_percent(None)
        time.sleep(2.0)
        return sum(p.cpu_percent(None) for p in procs)

    idle = {}
    engine = start_engine_server(ctx.model_name, served_model_name="m", dtype="bfloat16", max_num_seqs=big,
                                 prefix_caching=False, pack=_fastest_exact_bf16(), progress=False)
    try:
        replay(engine.base_url, "m", seq_trace, max_concurrency=1, warmup=1, progress=False)
        block("course engine", engine.base_url)
        idle["course engine"] = idle_cpu(engine)
        vllm = vllm_env.start_vllm_server(folder, served_model_name="m", dtype="bfloat16", max_num_seqs=big,
                                          progress=False)
        try:
            replay(vllm.base_url, "m", seq_trace, max_concurrency=1, warmup=1, progress=False)
            block("vLLM", vllm.base_url)
            block("vLLM", vllm.base_url)
            idle["vLLM"] = idle_cpu(vllm)
        finally:
            vllm.stop()
        block("course engine", engine.base_url)
    finally:
        engine.stop()
    e, v = figures["course engine"], figures["vLLM"]
    e1, v1 = statistics.median(e["tpot"]), statistics.median(v["tpot"])
    e16, v16 = statistics.median(e["tps"]), statistics.median(v["tps"])
    note = (f"blocks engine, vLLM, vLLM, engine, vLLM stopped during the engine's (idle CPU: engine server "
            f"{idle['course engine']:.0f} %, vLLM {idle['vLLM']:.0f} %); "
            f"{prompt_len}-token prompts, {new_tokens} tokens out, ignore_eos")
    yield Row(_SECTION, f"served, bf16 (engine: pack {_fastest_exact_bf16()}), B = 1: engine TPOT / vLLM TPOT", e1 / v1,
              "x", "<= 1.0x", e1 / v1 <= 1.0,
              note=f"engine {e1 * 1e3:.1f} ms, vLLM {v1 * 1e3:.1f} ms per token; {note}")
    yield Row(_SECTION, f"served, bf16, B = {big}: engine / vLLM output throughput", e16 / v16, "x", ">= 1.0x",
              e16 / v16 >= 1.0, note=f"engine {e16:,.0f} tok/s, vLLM {v16:,.0f} tok/s")


def _llama_cpp(ctx, features):
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        yield Row(_SECTION, "llama.cpp, Q4_1 file, decode B = 1 (recorded, not this run)", LLAMA_CPP_RECORDED_MS,
                  "ms/token", note="measured 2026-11-29 on another, AVX2-only machine; install llama-cpp-python "
                                   "(it compiles for ~15 minutes) to measure it here")
        return
    if ctx.reduced:
        return
    from ..models import embedded_gguf_path
    llm = llama_cpp.Llama(str(embedded_gguf_path()), n_ctx=512, n_threads=torch.get_num_threads(), verbose=False)
    prompt = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    llm(prompt, max_tokens=4)
    t0 = time.perf_counter()
    out = llm(prompt, max_tokens=64, temperature=0.0)
    n = out["usage"]["completion_tokens"]
    yield Row(_SECTION, "llama.cpp, Q4_1 file, decode B = 1 (this run)", (time.perf_counter() - t0) / max(n, 1) * 1e3,
              "ms/token", note=f"{n} tokens, prefill included; {features}")
