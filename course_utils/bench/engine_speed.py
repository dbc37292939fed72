"""The course engine's speed against its floors and against vLLM's CPU build, one path per row.

Paths (:data:`course_utils.engine.speed.PATHS`): the dense float32 path chapter 04 shows, dense bfloat16, and
the fast paths (bf16 in oneDNN's layout, or batch products in float32 where PyTorch's bf16 product is slow;
the compiled decode step; weight-only int8 and int4 kernels, bfloat16 activations; :mod:`course_utils.engine.packed`). For each, measured by :func:`course_utils.engine.speed.measure_path`: the
decode step at B = 1 (ms per token) against the same matrices' product floor (timed in turns with it) and the
bandwidth floor, the decode throughput at B = 16, and the quality it costs (KL divergence of the engine's own
logits from the float32 engine's, on held-out text: chapter 07's statistic); an ablation, one row per lever; and
a profile of the B = 1 step by operator class for the readable path and the quickest exact bf16 one. vLLM, when its environment exists
(chapter 11), is measured on the same prompts and lengths through its server, by the chapter's client, each
server with the same compute threads (vLLM's "auto" binding keeps one core for its API server; the engine gets as
many threads as vLLM's workers, as in chapter 11), in blocks that alternate with the course engine's server: engine, vLLM, vLLM, engine, with vLLM stopped
while the engine is measured (idle, its server still keeps about half a core busy: reported). The throughput at
B = 16 is split into what it is made of (each server's median time to first token, the prompts' prefill, and time
per output token), and the served path's B = 16 decode step is profiled by operator class on the servers' thread
count, in this process.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from ..engine.speed import BF16_WEIGHT_PACKS, CLASSES, PYTHON, ablation, available_paths, fastest_bf16, fastest_exact_bf16, measure_path
from ..measure import openmp_wait_policy
from ..prompts import book_prompts, book_split, token_ids
from . import Row

_SECTION = "04 engine speed"

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
    return f"PyTorch CPU capability {caps}" + (f"; {', '.join(extra)}" if extra else "") + f"; {openmp_wait_policy()}"


def rows(ctx):
    model, tok = ctx.model()
    prompt_len, new_tokens = ctx.sizes(64, 8), ctx.sizes(48, 6)
    big = ctx.sizes(16, 2)
    prompts = book_prompts(tok, big, prompt_len)
    held = token_ids(tok, book_split().heldout, ctx.sizes(256, 24))[0].tolist()
    features = _cpu_features()
    ref_logp, results = None, {}
    paths = available_paths(ctx.device)
    if ctx.reduced:           # compiling the tiny model's shapes took most of the reduced run: the compiled step
        paths = [p for p in paths if p[2] != "compiled"]      # is tested in tests/test_engine_compiled.py
    for label, dtype, pack in paths:
        f, logp = measure_path(model, label, dtype, pack, prompts=prompts, heldout_ids=held, reference_logp=ref_logp,
                               new_tokens=new_tokens, rounds=ctx.sizes(5, 1), batch=big, profile_tokens=ctx.sizes(9, 3))
        ref_logp = logp if ref_logp is None else ref_logp
        results[label] = f
        mb = f.weight_bytes / 1e6
        q = "the reference path" if f.kld is None else (
            f"KLD {f.kld:.2e} ± {f.kld_se:.0e} nats/token vs float32, same top token {f.same_top:.1%} "
            f"({f.positions} held-out positions)")
        yield Row(_SECTION, f"engine decode, B = 1, {label}", f.step_s * 1e3, "ms/token",
                  note=f"{mb:,.0f} MB of weights per step; {q}; {features}")
        target = "<= 1.3x" if pack in BF16_WEIGHT_PACKS and dtype == "bfloat16" else None
        yield Row(_SECTION, f"engine step / matrix-product floor, B = 1, {label}", f.over_floor, "x", target,
                  None if target is None else f.over_floor <= 1.3,
                  note=f"the same matrices, one row each, timed in turns with the steps: {f.floor_s * 1e3:.1f} ms; "
                       f"{(f.step_s - f.floor_s) * 1e3:.1f} ms of the step is everything else")
        bw = ctx.bandwidth_Bps()
        yield Row(_SECTION, f"engine step / bandwidth floor, B = 1, {label}", f.over_bandwidth_floor(bw), "x",
                  note=f"{mb:,.0f} MB at {bw / 1e9:.1f} GB/s = {f.weight_bytes / bw * 1e3:.1f} ms")
        yield Row(_SECTION, f"engine decode throughput, B = {big}, {label}", f.tokens_per_s, "tok/s",
                  note=f"median step {f.batch_step_s * 1e3:.1f} ms, {prompt_len}-token prompts")
        if f.compile_s:
            shapes = ", ".join(f"B {b} x {w} blocks {t:.0f} s" for (b, w), t in sorted(f.compile_s.items()))
            yield Row(_SECTION, f"compile time, {label}", sum(f.compile_s.values()), "s",
                      note=f"once per (padded batch, blocks) shape, on its first step: {shapes}; the steps above "
                           "were timed after")
    base = results["float32"]
    for f, prev, lever in ablation(list(results.values())):
        control = (" (at B = 1 the same computation as its base: the ratio is this run's drift)"
                   if f.pack == "upcast" and (prev.dtype, prev.pack) == ("bfloat16", "none") else "")
        yield Row(_SECTION, f"ablation: {f.label} vs {prev.label}", prev.step_s / f.step_s, "x faster at B = 1",
                  note=f"{lever}{control}; B = {big}: {f.tokens_per_s / prev.tokens_per_s:.2f}x the throughput; "
                       f"vs float32: {base.step_s / f.step_s:.2f}x at B = 1, "
                       f"{f.tokens_per_s / base.tokens_per_s:.2f}x at B = {big}")
    exact_bf16 = fastest_exact_bf16(results.values())
    yield from _profiles(results, exact_bf16)
    served = fastest_bf16(results.values()).pack
    yield from _vs_vllm(ctx, tok, prompts, prompt_len, new_tokens, big, served)
    yield from _served_profile(ctx, prompts, prompt_len, new_tokens, big, served, _served_threads())
    yield from _llama_cpp(ctx, features)


def _profiles(results, exact_bf16):
    """Where a B = 1 decode step's time goes, by operator class: the readable path, the quickest eager bf16 one and
    the compiled one."""
    for f in results.values():
        if (f.dtype, f.pack) not in (("float32", "none"), ("bfloat16", exact_bf16), ("bfloat16", "compiled")):
            continue
        yield from _profile_rows(f.profile, f"profile {f.profile.label}")


def _profile_rows(p, name):
    """One row per operator class of the :class:`~course_utils.engine.speed.StepProfile` ``p``, each named
    ``name: class``."""
    for cls in CLASSES:
        yield Row(_SECTION, f"{name}: {cls}", p.ms_per_step[cls], "ms/step",
                  note=f"{p.calls_per_step[cls]:.0f} calls per step" if cls != PYTHON else
                  f"profiled step {p.profiled_step_s * 1e3:.1f} ms, unprofiled {p.step_s * 1e3:.1f} ms, "
                  f"{p.steps} steps")


def _vs_vllm(ctx, tok, prompts, prompt_len, new_tokens, big, pack):
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
    figures = {name: {"tpot": [], "tps": [], "ttft_big": [], "tpot_big": []} for name in ("course engine", "vLLM")}

    def block(name, url):
        one = replay(url, "m", seq_trace, max_concurrency=1, warmup=0, progress=False).summary()
        par = replay(url, "m", par_trace, max_concurrency=big, warmup=0, progress=False).summary()
        figures[name]["tpot"].append(one.tpot.median)
        figures[name]["tps"].append(par.output_throughput)
        figures[name]["ttft_big"].append(par.ttft.median)
        figures[name]["tpot_big"].append(par.tpot.median)

    def idle_cpu(server) -> float:
        procs = [psutil.Process(p.pid) for p in server._processes()]
        for p in procs:
            p.cpu_percent(None)
        time.sleep(2.0)
        return sum(p.cpu_percent(None) for p in procs)

    idle = {}
    threads = _served_threads()
    engine = start_engine_server(ctx.model_name, served_model_name="m", dtype="bfloat16", max_num_seqs=big,
                                 prefix_caching=False, pack=pack, threads=threads, progress=False)
    try:
        replay(engine.base_url, "m", seq_trace, max_concurrency=1, warmup=1, progress=False)
        if pack == "compiled":        # its B = 1 and B = 16 shapes compile on their first steps: before the clock
            replay(engine.base_url, "m", par_trace, max_concurrency=big, warmup=0, progress=False)
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
    note = (f"{threads} compute thread{'s' if threads > 1 else ''} each (the other core for each server's API); "
            f"blocks engine, vLLM, vLLM, engine, vLLM stopped during the engine's (idle CPU: engine server "
            f"{idle['course engine']:.0f} %, vLLM {idle['vLLM']:.0f} %); "
            f"{prompt_len}-token prompts, {new_tokens} tokens out, ignore_eos")
    yield Row(_SECTION, f"served, bf16 (engine: pack {pack}, its quickest bf16 path above), B = 1: engine TPOT / vLLM TPOT", e1 / v1,
              "x", "<= 1.0x", e1 / v1 <= 1.0,
              note=f"engine {e1 * 1e3:.1f} ms, vLLM {v1 * 1e3:.1f} ms per token; {note}")
    yield Row(_SECTION, f"served, bf16, B = {big}: engine / vLLM output throughput", e16 / v16, "x", ">= 1.0x",
              e16 / v16 >= 1.0, note=f"engine {e16:,.0f} tok/s, vLLM {v16:,.0f} tok/s")
    # What the throughput is made of: the prompts' prefill (time to first token) and the decode steps after it.
    for key, what in (("ttft_big", "median time to first token"), ("tpot_big", "median time per output token")):
        et, vt = statistics.median(e[key]), statistics.median(v[key])
        yield Row(_SECTION, f"served, bf16, B = {big}: {what}, engine / vLLM", et / vt, "x",
                  note=f"engine {et * 1e3:,.1f} ms, vLLM {vt * 1e3:,.1f} ms")


def _served_threads() -> int:
    """The compute threads of each server: vLLM's "auto" binding puts its compute threads on all cores but one."""
    return max(1, (os.cpu_count() or 2) - 1)


def _served_profile(ctx, prompts, prompt_len, new_tokens, big, pack, threads):
    """Where a B = ``big`` decode step of the served path goes, by operator class, on the served thread count
    (in this process, no server: the step the served engine runs)."""
    from ..engine.model_runner import RunnerWeights
    from ..engine.speed import path_engine, profile_decode
    model, _ = ctx.model()
    before, engine = torch.get_num_threads(), None
    torch.set_num_threads(threads)
    try:
        engine = path_engine(model, RunnerWeights.from_model(model, "bfloat16", pack=pack), big, prompt_len,
                             new_tokens)
        engine.generate(prompts[:big], 4, ignore_eos=True)          # a compiled path compiles its shapes here
        p = profile_decode(engine, prompts[:big], ctx.sizes(6, 3), label=f"bfloat16, {pack}, B = {big}")
    finally:
        torch.set_num_threads(before)
        engine = None
        if pack == "compiled":
            from ..engine.compiled import release_compiled
            release_compiled()
    plural = "s" if threads > 1 else ""
    yield from _profile_rows(p, f"profile served path ({pack}), B = {big}, {threads} thread{plural}")


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
