"""Chapter 04 rows: the engine's decode step, engine vs ``generate`` / ``generate_batch``, static vs continuous."""
from __future__ import annotations

import copy
import math

from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.utils import logging as hf_logging

from ..batching import pool_blocks, reserved_kv_bytes, run_engine_workload, schedule_from_engine, \
    syllabus_output_lengths, time_block_gather
from ..engine import LLMEngine, RunnerWeights
from ..measure import time_call, time_interleaved
from ..prefill_decode import decode_floor_s, matvec_pass
from ..prompts import book_prompts
from ..reference import common_prefix_len, generate_static_batch, reference_generate
from . import Row

_SECTION = "04 batching"

def _shared_weights(ctx, model, dtype: str):
    """One fused copy of the weights per dtype for all the engines of a benchmark run."""
    return ctx.get(f"04:engine-weights:{dtype}", lambda: RunnerWeights.from_model(model, dtype))


def _per_call_cost_s(model, device) -> float:
    """Seconds of one engine decode step (B = 1) for a model with this one's layers and heads but tiny matrices.

    The arithmetic and the bytes vanish; what is left is what every PyTorch call costs,
    whatever its size: the floor of a Python forward pass that makes the same calls.
    """

    cfg = copy.deepcopy(model.config)
    cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size = 8 * cfg.num_attention_heads, 8, 64, 256
    cfg.pad_token_id = cfg.bos_token_id = cfg.eos_token_id = None
    tiny = type(model)(cfg).eval().to(model.device)
    engine = LLMEngine(tiny, num_blocks=8, block_size=16, max_num_seqs=1, eos_token_ids=())
    engine.add_request(list(range(64)), 40)
    engine.step()
    return time_call(engine.step, warmup=3, repeats=25, device=device).median_s


def _bench_decode_step(ctx, model, tok):
    """The engine's decode step at B = 1 against the matrix-vector floor and the bandwidth floor, fp32 and bf16."""
    prompt = book_prompts(tok, 1, 64)[0]
    outputs, steps = {}, {}
    for dtype in ("float32", "bfloat16"):
        weights = _shared_weights(ctx, model, dtype) if dtype == "float32" else None   # bf16: a copy, dropped below
        engine = LLMEngine(model, num_blocks=8, block_size=16, max_num_seqs=1, prefix_caching=False,
                           weights=weights, dtype=dtype)
        engine.add_request(prompt, ctx.sizes(40, 6), ignore_eos=True)
        engine.step()                                                 # the prefill
        floor = matvec_pass(engine.runner.step_matrices())
        t = time_interleaved({"step": engine.step, "mv": floor}, warmup=2, repeats=ctx.sizes(15, 2), device=ctx.device)
        while engine.has_unfinished():
            engine.step()
        outputs[dtype] = engine.sequences[0].output_ids
        step_s, mv_s = t["step"].median_s, t["mv"].median_s
        phys_s = decode_floor_s(engine.runner.step_weight_bytes(), ctx.bandwidth_Bps())
        steps[dtype] = step_s
        mb = engine.runner.step_weight_bytes() / 1e6
        yield Row(_SECTION, f"engine decode step, B = 1, {dtype}", step_s * 1e3, "ms",
                  note=f"spread ±{t['step'].spread_s * 1e3:.1f} ms; torch.mv over the same {mb:,.0f} MB of "
                       f"weights {mv_s * 1e3:.1f} ms ({engine.runner.step_weight_bytes() / mv_s / 1e9:.1f} GB/s)")
        if dtype == "float32":
            calls_s = _per_call_cost_s(model, ctx.device)
            yield Row(_SECTION, "engine step / torch.mv floor, B = 1, float32", step_s / mv_s, "x", "<= 1.15x",
                      step_s / mv_s <= 1.15,
                      note=f"{(step_s - mv_s) * 1e3:.1f} ms above the floor; the same step with 8-wide heads and "
                           f"tiny matrices (per-call cost alone) takes {calls_s * 1e3:.1f} ms")
        else:
            yield Row(_SECTION, "engine step / torch.mv floor, B = 1, bfloat16", step_s / mv_s, "x")
        yield Row(_SECTION, f"engine step / (weight bytes / bandwidth), {dtype}", step_s / phys_s, "x",
                  note=f"physical floor {phys_s * 1e3:.1f} ms at {ctx.bandwidth_Bps() / 1e9:.1f} GB/s")
        del engine
    n = len(outputs["float32"])
    hf16, _ = reference_generate(ctx.model("bfloat16")[0], prompt, n)     # EOS ignored, as in the engine runs
    same, hf_same = common_prefix_len(outputs["float32"], outputs["bfloat16"]), common_prefix_len(outputs["float32"], hf16)
    yield Row(_SECTION, "bf16 step speed-up over fp32, B = 1", steps["float32"] / steps["bfloat16"], "x",
              note=f"greedy bf16 tokens equal fp32's for the first {same} of {n}; with transformers' own bf16 "
                   f"generate, the first {hf_same} of {n}")


def _bench_vs_generate(ctx, model, tok, prompt_len: int = 32):
    """Engine vs ``generate`` with the same static batch: end-to-end and decode-only tokens/s."""
    new_tokens = ctx.sizes(32, 4)
    batches = ctx.sizes((8, 16), (2,))
    for batch in batches:
        prompts = book_prompts(tok, batch, prompt_len)
        engine = LLMEngine(model, num_blocks=pool_blocks([prompt_len] * batch, [new_tokens] * batch, block_size=16,
                                                         slots=batch), block_size=16,
                           max_num_seqs=batch, policy="static", prefix_caching=False,
                           weights=_shared_weights(ctx, model, "float32"))
        fns = {("generate", 1): lambda: generate_static_batch(model, prompts, 1),
               ("engine", 1): lambda: [s.output_ids for s in engine.generate(prompts, 1, ignore_eos=True)],
               ("generate", new_tokens): lambda: generate_static_batch(model, prompts, new_tokens),
               ("engine", new_tokens): lambda: [s.output_ids for s in engine.generate(prompts, new_tokens,
                                                                                       ignore_eos=True)]}
        fns[("generate", 1)](), fns[("engine", 1)]()                          # warm-up
        times = {k: [] for k in fns}
        results = {}
        for _ in range(2):                                                   # interleaved, best of 2
            for k, fn in fns.items():
                t = time_call(fn, warmup=0, repeats=1, device=ctx.device)
                times[k].append(t.min_s)
                results[k] = t.result
        best = {k: min(v) for k, v in times.items()}
        same = sum(a == b for a, b in zip(results[("generate", new_tokens)], results[("engine", new_tokens)]))
        rates = {}
        for who in ("generate", "engine"):
            rates[who] = (batch * new_tokens / best[(who, new_tokens)],
                          batch * (new_tokens - 1) / max(1e-9, best[(who, new_tokens)] - best[(who, 1)]))
        for i, what in enumerate(("end-to-end", "decode-only")):
            ratio = rates["engine"][i] / rates["generate"][i]
            yield Row(_SECTION, f"engine / generate {what} tokens/s, static batch B = {batch}", ratio, "x", ">= 1.5x",
                      ratio >= 1.5, note=f"engine {rates['engine'][i]:.1f} vs generate {rates['generate'][i]:.1f} "
                                         f"tok/s; {prompt_len}-token prompts, {new_tokens} new tokens; "
                                         f"{same}/{batch} requests with identical tokens")
        if batch == batches[-1]:
            yield from _bench_vs_generate_batch(ctx, model, prompts, new_tokens)
        del engine


def _bench_vs_generate_batch(ctx, model, prompts, new_tokens):
    """Engine (continuous) vs transformers' own continuous batching on the same requests."""
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    positions = len(prompts) * (max(len(p) for p in prompts) + new_tokens)
    # its KV cache sized for these requests (left alone, it sizes the cache from the free memory)
    cb_config = ContinuousBatchingConfig(num_blocks=positions // 256 + len(prompts), max_batch_tokens=positions)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        hf = time_call(lambda: model.generate_batch([list(p) for p in prompts], generation_config=config,
                                                    continuous_batching_config=cb_config),
                       warmup=0, repeats=1, device=ctx.device)
    except Exception as exc:   # noqa: BLE001 -- report, do not hide
        yield Row(_SECTION, f"generate_batch FAILED: {type(exc).__name__}: {exc}"[:100], float("nan"), "")
        return
    finally:
        hf_logging.set_verbosity(verbosity)
    hf_tokens = [list(r.generated_tokens) for r in hf.result.values()]
    engine = LLMEngine(model, num_blocks=pool_blocks([len(p) for p in prompts], [new_tokens] * len(prompts),
                                                     block_size=16, slots=len(prompts)), block_size=16,
                       max_num_seqs=len(prompts),
                       prefix_caching=False, weights=_shared_weights(ctx, model, "float32"))
    ours = time_call(lambda: engine.generate(prompts, new_tokens, ignore_eos=True), warmup=0, repeats=1,
                     device=ctx.device)
    n_tokens = len(prompts) * new_tokens
    same = sum(a == s.output_ids for a, s in zip(hf_tokens, ours.result))
    yield Row(_SECTION, f"engine / generate_batch tokens/s, same {len(prompts)} requests", hf.median_s / ours.median_s, "x",
              note=f"engine {n_tokens / ours.median_s:.1f} vs transformers' continuous batching "
                   f"{n_tokens / hf.median_s:.1f} tok/s (one call each, set-up included); {same}/{len(prompts)} identical")


def _bench_workload(ctx, model, tok, prompt_len: int = 8):
    """The syllabus workload through the engine under both policies, and the KV memory it needed."""
    lengths = ctx.sizes(syllabus_output_lengths(), syllabus_output_lengths(8, median=3, longest=10, total=40))
    prompts = book_prompts(tok, len(lengths), prompt_len)
    scheds, engines = {}, {}
    for policy in ("continuous", "static"):
        engines[policy], seqs = run_engine_workload(model, prompts, lengths, policy=policy, slots=8, progress=False,
                                                    weights=_shared_weights(ctx, model, "float32"))
        scheds[policy] = schedule_from_engine(engines[policy], seqs, policy)
    cont, stat = scheds["continuous"], scheds["static"]
    ratio = cont.throughput_tok_s / stat.throughput_tok_s
    common = (f"64 requests, {prompt_len}-token prompts (scaled down from the source's), 8 slots, "
              f"{sum(lengths):,} tokens")
    yield Row(_SECTION, "continuous / static throughput, syllabus workload, engine", ratio, "x", ">= 1.5x", ratio >= 1.5,
              note=f"{cont.throughput_tok_s:.1f} vs {stat.throughput_tok_s:.1f} tok/s; {common}")
    lat = stat.mean_latency_s / cont.mean_latency_s
    admitted = stat.mean_latency_from_admission_s / cont.mean_latency_from_admission_s
    yield Row(_SECTION, "static / continuous mean latency, syllabus workload, engine", lat, "x", ">= 5x", lat >= 5,
              note=f"{stat.mean_latency_s:.0f} s vs {cont.mean_latency_s:.0f} s from arrival "
                   f"(p95 {stat.p95_latency_s:.0f} vs {cont.p95_latency_s:.0f} s); both from admission: {admitted:.1f}x")
    engine = engines["continuous"]
    per_token = engine.runner.kv_bytes_per_token
    paged = max(st.blocks_used for st in engine.steps) * engine.block_manager.block_size * per_token
    reserved = reserved_kv_bytes(8, prompt_len + int(max(lengths)), per_token)
    yield Row(_SECTION, "peak KV bytes, paged, continuous run", paged / 2**20, "MiB",
              note=f"{per_token:,} B per token position")
    yield Row(_SECTION, "KV bytes: max-context reservation / paged peak", reserved / paged, "x",
              note=f"reserving {prompt_len + int(max(lengths))} positions for each of 8 slots: "
                   f"{reserved / 2**20:.1f} MiB")


def _bench_gather(ctx, model):
    """What the runner's per-layer copy of every sequence's blocks costs, as a share of a decode step."""
    batch, context = ctx.sizes(8, 2), ctx.sizes(256, 16)
    cost = time_block_gather(model, batch=batch, context_len=context, weights=_shared_weights(ctx, model, "float32"),
                             repeats=ctx.sizes(7, 2))
    yield Row(_SECTION, f"block gathers / decode step, {batch} sequences x {context} cached tokens", cost.share * 100, "%",
              note=f"step {cost.step_s * 1e3:.1f} ms, gathers {cost.gather_s * 1e3:.1f} ms copying "
                   f"{cost.copied_bytes / 1e6:.1f} MB ({cost.copied_bytes / cost.gather_s / 1e9:.1f} GB/s)")


def rows(ctx):
    """Chapter 04 rows: the engine's decode step, engine vs generate / generate_batch, static vs continuous."""
    model, tok = ctx.model()
    yield from _bench_decode_step(ctx, model, tok)
    yield from _bench_gather(ctx, model)
    yield from _bench_vs_generate(ctx, model, tok)
    yield from _bench_workload(ctx, model, tok)
