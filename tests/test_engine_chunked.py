"""Chunked prefill in the chapter 04 engine: a step holds every running sequence's decode token plus prompt chunks,
within a budget of real tokens. Exactness against generate for several budgets, with prefix sharing and with
preemption in the middle of a prompt; no decode step skipped while a long prompt is prefilled; cancellation and a
failing step part-way through a prompt; the fast paths; bad input."""
from __future__ import annotations

import random

import pytest
import torch

from course_utils.engine import BlockManager, LLMEngine, RunnerWeights, Scheduler, Sequence, StepFailed
from course_utils.reference import check_against_generate
from test_engine import _mimic_of_packing, _random_prompts, _report


def _record_steps(engine):
    """Wrap the runner: per step, the runs it fed ``{seq_id: (start, stop, in_prefill)}`` and the ids of the running
    sequences past their prompt at that moment."""
    log, run = [], engine.runner.run

    def recorded(seqs):
        runs = {}
        for s in seqs:
            assert s.seq_id not in runs, "a sequence fed twice in one step"
            r = s.positions_to_run()[0]
            runs[s.seq_id] = (r.start, r.stop, s.in_prefill)
        log.append((runs, {s.seq_id for s in engine.scheduler.running if not s.in_prefill}))
        return run(seqs)
    engine.runner.run = recorded
    return log


def _check_steps(log, budget: int) -> None:
    """No step over the budget; every running sequence past its prompt decodes in every step."""
    for i, (runs, decoding) in enumerate(log):
        assert sum(stop - start for start, stop, _ in runs.values()) <= budget, f"step {i} over the budget"
        assert decoding <= set(runs), f"step {i} left out decoding sequences {decoding - set(runs)}"
        for sid in decoding:
            start, stop, in_prefill = runs[sid]
            assert stop - start == 1 and not in_prefill


def _check_tokens(model, engine, prompts, outs, max_tokens, label, *, eos=None):
    agreements = check_against_generate(model, prompts, [o.output_ids for o in outs], max_tokens,
                                        eos_token_ids=engine.eos_token_ids if eos is None else eos)
    _report(agreements, label)


# ---- exactness --------------------------------------------------------------------------------------------------

# (max_num_seqs, budget): one token a step; as many tokens as slots (no prompt progress while every slot decodes);
# a budget that does not divide the block size (4), so chunks end mid-block; one larger than every prompt
BUDGETS = [(1, 1), (3, 3), (3, 7), (4, 200)]


@pytest.mark.parametrize("slots, budget", BUDGETS)
def test_chunked_prefill_matches_generate(tiny_model, slots, budget):
    prompts = _random_prompts(tiny_model.config.vocab_size, 10, seed=11)       # 1 to 40 tokens, shared prefixes
    engine = LLMEngine(tiny_model, num_blocks=128, block_size=4, max_num_seqs=slots, max_num_batched_tokens=budget,
                       chunked_prefill=True)
    log = _record_steps(engine)
    outs = engine.generate(prompts, 10)
    _check_tokens(tiny_model, engine, prompts, outs, 10, f"{tiny_model.config.model_type} budget {budget}")
    _check_steps(log, budget)
    assert all(st.num_tokens == st.num_prefill_tokens + st.num_decode_tokens for st in engine.steps)
    assert sum(st.num_prefill_tokens for st in engine.steps) == sum(len(p) - o.num_cached_tokens + (
        o.num_cached_tokens == len(p)) for p, o in zip(prompts, outs))   # every uncached position once
    if budget < max(map(len, prompts)):                                   # some prompt took several steps
        assert any(sum(1 for runs, _ in log if o.seq_id in runs and runs[o.seq_id][2]) > 1 for o in outs)
    if slots > 1 and budget < 200:                                        # some step mixed decodes and a chunk
        assert any(st.num_prefill_tokens and st.num_decode_tokens for st in engine.steps)
    assert outs[-1].num_cached_tokens == 20                               # the repeated prompt: all its blocks
    assert engine.block_manager.num_free_blocks == 128


def test_chunked_and_whole_prefill_give_the_same_tokens_and_the_default_is_unchanged(tiny_llama):
    prompts = _random_prompts(tiny_llama.config.vocab_size, 8, seed=5)
    whole = LLMEngine(tiny_llama, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    chunked = LLMEngine(tiny_llama, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=6,
                        chunked_prefill=True)
    a = whole.generate(prompts, 8, ignore_eos=True)
    b = chunked.generate(prompts, 8, ignore_eos=True)
    assert [s.output_ids for s in a] == [s.output_ids for s in b]
    # without chunking every step is a prefill step or a decode step, never both
    assert all(bool(st.num_prefill_tokens) != bool(st.num_decode_tokens) for st in whole.steps)
    assert all(st.is_prefill == bool(st.num_prefill_tokens) for st in whole.steps + chunked.steps)
    assert len(chunked.steps) > len(whole.steps) and max(st.num_tokens for st in chunked.steps) <= 6


def test_a_block_is_cached_only_once_a_chunk_fills_it():
    """Blocks are given chunk by chunk; one is registered in the prefix cache by the step that fills its last
    position, never before (a sequence matching a half-written block would read positions never computed)."""
    bm = BlockManager(8, 4)
    a, b = Sequence(0, list(range(10)), 4, block_size=4), Sequence(1, list(range(8)) + [50], 4, block_size=4)
    bm.allocate(a, num_tokens=6)                      # first chunk: positions 0-5, the second block half filled
    assert len(a.block_table) == 2 and bm.num_free_blocks == 6
    assert len(bm.match_prefix(b).hits) == 1         # only the full block is cached
    a.schedule_run(0, 6)
    a.num_computed_tokens = 6
    assert not bm.can_append(a, 6 + 8 * 4) and bm.can_append(a, 10)
    bm.may_append(a, 10)                              # second chunk: positions 6-9, fills the second block
    assert len(a.block_table) == 3 and len(bm.match_prefix(b).hits) == 2
    assert bm.room(a) == (3 + 5) * 4
    bm.check_invariants([a])


def test_a_prompt_reuses_blocks_another_prompt_fills_in_the_same_step(tiny_llama):
    """A (30 tokens) is prefilled in chunks of 8; B, sharing A's first 7 blocks, arrives meanwhile and is admitted in
    the step of A's last chunk: it skips 28 positions, 4 of them written by A in that very step (every layer stores
    its new keys and values before any sequence reads them), and computes the rest of its prompt in chunks."""
    g = random.Random(3)
    vocab = tiny_llama.config.vocab_size
    a_prompt = [g.randrange(vocab) for _ in range(30)]
    b_prompt = a_prompt[:28] + [g.randrange(vocab) for _ in range(10)]
    engine = LLMEngine(tiny_llama, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                       chunked_prefill=True)
    log = _record_steps(engine)
    a = engine.sequences[engine.add_request(a_prompt, 6, ignore_eos=True)]
    engine.step()
    b = engine.sequences[engine.add_request(b_prompt, 6, ignore_eos=True)]
    engine.step()
    engine.step()
    assert a.num_computed_tokens == 24 and a.in_prefill and b.status.value == "waiting"
    engine.step()                                     # A's last chunk, 24-29, and B admitted with 2 tokens left
    assert log[-1][0] == {a.seq_id: (24, 30, True), b.seq_id: (28, 30, True)}
    assert b.num_cached_tokens == 28 and a.num_output_tokens == 1 and b.num_output_tokens == 0
    while engine.has_unfinished():
        engine.step()
    assert [len(runs) for runs, _ in log[4:6]] == [2, 2]   # then A decodes beside B's chunks
    _check_tokens(tiny_llama, engine, [a_prompt, b_prompt], [a, b], 6, "shared prefix", eos=())
    _check_steps(log, 8)
    assert engine.block_manager.num_free_blocks == 64


def test_preemption_in_the_middle_of_a_prompt_recomputes_it(tiny_llama):
    """Three sequences decode while a 40-token prompt is prefilled in chunks; the pool (16 blocks of 4) runs out,
    the newest sequence -- the prompt, part-way -- gives its blocks back and is prefilled again later."""
    g = random.Random(8)
    vocab = tiny_llama.config.vocab_size
    prompts = [[g.randrange(vocab) for _ in range(n)] for n in (6, 7, 5, 40)]
    engine = LLMEngine(tiny_llama, num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                       chunked_prefill=True)
    log = _record_steps(engine)
    preempted = []
    preempt = engine.scheduler.preempt

    def recording_preempt(seq):
        preempted.append((seq.seq_id, seq.in_prefill, seq.num_computed_tokens, len(seq)))
        preempt(seq)
    engine.scheduler.preempt = recording_preempt
    ids = [engine.add_request(p, n, ignore_eos=True) for p, n in zip(prompts[:3], (20, 20, 20))]
    engine.step()
    engine.step()                                      # the three are decoding
    ids.append(engine.add_request(prompts[3], 4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    assert any(in_prefill and 0 < done < n for _, in_prefill, done, n in preempted), preempted
    outs = [engine.sequences[i] for i in ids]
    assert outs[3].num_preemptions >= 1
    _check_tokens(tiny_llama, engine, prompts, outs, [20, 20, 20, 4], "preempted mid-prompt", eos=())
    _check_steps(log, 8)
    assert engine.block_manager.num_free_blocks == 16


def test_random_load_matches_generate_and_frees_every_block(tiny_llama):
    """240 requests arriving over time (random lengths, some sharing a prefix), a small pool and budget."""
    rng = random.Random(17)
    vocab = tiny_llama.config.vocab_size
    budget = 10
    engine = LLMEngine(tiny_llama, num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=budget,
                       chunked_prefill=True)
    log = _record_steps(engine)
    prefixes = [[rng.randrange(vocab) for _ in range(rng.choice((8, 10)))] for _ in range(3)]
    n_requests = 240
    arrivals = sorted(rng.randrange(3 * n_requests) for _ in range(n_requests))
    requests, step, i = {}, 0, 0
    while i < len(arrivals) or engine.has_unfinished():
        while i < len(arrivals) and arrivals[i] <= step:
            body = [rng.randrange(vocab) for _ in range(rng.randint(1, 26))]
            prompt = (rng.choice(prefixes) + body) if rng.random() < 0.4 else body
            n = rng.randint(1, 12)
            requests[engine.add_request(prompt, n, ignore_eos=True)] = (prompt, n)
            i += 1
        engine.step()
        engine.check_invariants()                       # reference counts, free list, slots
        step += 1
    seqs = engine.sequences
    assert len(seqs) == n_requests and all(s.is_finished for s in seqs.values())
    assert all(s.num_output_tokens == requests[k][1] for k, s in seqs.items())
    assert engine.block_manager.num_free_blocks == 24 and all(b.ref_count == 0 for b in engine.block_manager.blocks)
    assert engine.scheduler.num_preemptions > 0 and any(s.num_cached_tokens for s in seqs.values())
    assert any(st.num_prefill_tokens and st.num_decode_tokens for st in engine.steps)
    _check_steps(log, budget)
    keys = sorted(requests)
    _check_tokens(tiny_llama, engine, [requests[k][0] for k in keys], [seqs[k] for k in keys],
                  [requests[k][1] for k in keys], "random load", eos=())


# ---- no stall ---------------------------------------------------------------------------------------------------

def _long_prompt_while_three_decode(model, chunked: bool):
    g = random.Random(4)
    vocab = model.config.vocab_size
    short = [[g.randrange(vocab) for _ in range(5)] for _ in range(3)]
    long = [g.randrange(vocab) for _ in range(120)]
    kwargs = dict(max_num_batched_tokens=8, chunked_prefill=True) if chunked else {}
    engine = LLMEngine(model, num_blocks=64, block_size=4, max_num_seqs=4, **kwargs)
    log = _record_steps(engine)
    ids = [engine.add_request(p, 40, ignore_eos=True) for p in short]
    engine.step()
    engine.step()
    lid = engine.add_request(long, 3, ignore_eos=True)
    while engine.has_unfinished():
        engine.step()
    outs = [engine.sequences[i] for i in ids + [lid]]
    _check_tokens(model, engine, short + [long], outs, [40, 40, 40, 3], f"chunked={chunked}", eos=())
    return engine, log, lid


def test_a_long_prompt_does_not_stall_the_running_sequences(tiny_llama):
    engine, log, lid = _long_prompt_while_three_decode(tiny_llama, chunked=True)
    prefilling = [(runs, decoding) for runs, decoding in log if lid in runs and runs[lid][2]]
    assert len(prefilling) >= 120 // 5                  # 8 tokens a step, 3 of them decode tokens
    for runs, decoding in prefilling:
        assert len(decoding) == 3 and decoding <= set(runs)
    _check_steps(log, 8)
    # the same arrival without chunking: the long prompt's prefill is a step of its own, the three wait
    whole, whole_log, lid = _long_prompt_while_three_decode(tiny_llama, chunked=False)
    [(runs, decoding)] = [(runs, decoding) for runs, decoding in whole_log if lid in runs and runs[lid][2]]
    assert len(decoding) == 3 and not decoding & set(runs)



def test_a_step_of_several_chunks_and_decode_tokens_matches_generate(tiny_model):
    """Three sequences decode while three prompts (9, 14 and 25 tokens) arrive at once: one step holds the three
    decode tokens, two whole prompts and a chunk of the third (runs of 1, 1, 1, 9, 14 and 4 tokens)."""
    g = random.Random(12)
    vocab = tiny_model.config.vocab_size
    prompts = [[g.randrange(vocab) for _ in range(n)] for n in (3, 6, 5, 9, 14, 25)]
    engine = LLMEngine(tiny_model, num_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=30,
                       chunked_prefill=True)
    log = _record_steps(engine)
    ids = [engine.add_request(p, 12, ignore_eos=True) for p in prompts[:3]]
    engine.step()
    engine.step()
    ids += [engine.add_request(p, 6, ignore_eos=True) for p in prompts[3:]]
    while engine.has_unfinished():
        engine.step()
    mixed = sorted(stop - start for start, stop, _ in log[2][0].values())
    assert mixed == [1, 1, 1, 4, 9, 14]
    _check_steps(log, 30)
    _check_tokens(tiny_model, engine, prompts, [engine.sequences[i] for i in ids], [12] * 3 + [6] * 3,
                  "several chunks beside decode tokens", eos=())


def test_decode_tokens_attend_apart_from_the_prompt_runs_of_their_step(tiny_llama):
    """A step of a chunk, a decode token, a whole prompt and a decode token (in that order): the decode tokens
    attend in one call of one query each over their own contexts, the two runs in another, padded to the longer
    run; each sequence's logits are those of its own prefill of the same positions."""
    g = random.Random(4)
    vocab = tiny_llama.config.vocab_size
    ids = [[g.randrange(vocab) for _ in range(n)] for n in (10, 8, 13, 4)]
    runner = LLMEngine(tiny_llama, num_blocks=32, block_size=4, max_num_seqs=4).runner
    seqs, first_block = [], 0
    for i, (tokens, done) in enumerate(zip(ids, (6, 7, 0, 3))):      # positions already in the pool
        seq = Sequence(i, tokens, 1, block_size=4)
        n_blocks = -(-len(tokens) // 4)
        seq.block_table = list(range(first_block, first_block + n_blocks))
        first_block += n_blocks
        if done:
            seq.schedule_run(0, done)
            runner.forward(runner.prepare([seq]))
        seq.schedule_run(done, len(tokens))
        seqs.append(seq)
    inp = runner.prepare(seqs)
    decode, runs = inp.batches
    g_heads = tiny_llama.config.num_attention_heads // tiny_llama.config.num_key_value_heads
    assert decode.pad_index is None and decode.attn_bias.shape == (2, 1, g_heads, 8)      # contexts of 8 and 4
    assert tuple(runs.attn_bias.shape) == (2, 1, 13 * g_heads, 16)                          # runs of 4 and 13
    assert inp.input_ids.tolist() == [ids[1][7], ids[3][3]] + ids[0][6:] + ids[2]
    logits = runner.forward(inp)
    alone = LLMEngine(tiny_llama, num_blocks=32, block_size=4, max_num_seqs=1).runner
    for seq_logits, tokens in zip(logits, ids):
        want = alone.sequence_logits(tokens)[-1]
        torch.testing.assert_close(seq_logits.float(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())

# ---- cancellation, a failing step, the server --------------------------------------------------------------------

def _decoding_and_half_prefilled(model):
    """An engine where ``a`` decodes while ``b`` (40 tokens, sharing a's first 2 blocks) is part-way through its
    prefill."""
    g = random.Random(6)
    vocab = model.config.vocab_size
    a_prompt = [g.randrange(vocab) for _ in range(9)]
    b_prompt = a_prompt[:8] + [g.randrange(vocab) for _ in range(32)]
    engine = LLMEngine(model, num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=6,
                       chunked_prefill=True)
    a = engine.add_request(a_prompt, 12, ignore_eos=True)
    engine.step()
    engine.step()
    b = engine.add_request(b_prompt, 4, ignore_eos=True)
    engine.step()
    engine.step()
    assert engine.sequences[b].in_prefill and 8 < engine.sequences[b].num_computed_tokens < 40
    assert engine.sequences[b].num_cached_tokens == 8
    return engine, a, b, a_prompt, b_prompt


def test_abort_in_the_middle_of_a_prompt_frees_its_blocks_and_keeps_the_shared_ones(tiny_llama):
    engine, a, b, a_prompt, b_prompt = _decoding_and_half_prefilled(tiny_llama)
    shared = engine.sequences[a].block_table[:2]
    assert engine.sequences[b].block_table[:2] == shared
    held = len(engine.sequences[b].block_table)
    free = engine.block_manager.num_free_blocks
    assert engine.abort_request(b)
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == free + held - 2
    assert [engine.block_manager.blocks[i].ref_count for i in shared] == [1, 1]
    again = engine.add_request(b_prompt, 4, ignore_eos=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.sequences[b].num_output_tokens == 0 and engine.sequences[again].num_cached_tokens >= 8
    _check_tokens(tiny_llama, engine, [a_prompt, b_prompt], [engine.sequences[a], engine.sequences[again]],
                  [12, 4], "abort mid-prompt", eos=())
    assert engine.block_manager.num_free_blocks == 32


def test_a_failing_mixed_step_fails_its_sequences_and_the_engine_goes_on(tiny_llama):
    engine, a, b, a_prompt, b_prompt = _decoding_and_half_prefilled(tiny_llama)
    run, left = engine.runner.run, [1]

    def failing(seqs):
        if left[0]:
            left[0] -= 1
            raise MemoryError("injected")
        return run(seqs)
    engine.runner.run = failing
    with pytest.raises(StepFailed, match="MemoryError") as info:
        engine.step()                                     # a's decode token and b's next chunk
    assert {s.seq_id for s in info.value.seqs} == {a, b}
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == 32
    again = engine.add_request(b_prompt, 4, ignore_eos=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.sequences[again].num_cached_tokens == 0    # what the failed step's sequences held is forgotten
    _check_tokens(tiny_llama, engine, [b_prompt], [engine.sequences[again]], 4, "after a failed step", eos=())


def test_the_server_builds_a_chunked_engine(tiny_gguf):
    from course_utils.engine_server import build_engine
    engine, _ = build_engine(str(tiny_gguf), max_num_seqs=2, num_blocks=16, block_size=4, chunked_prefill=True,
                             max_num_batched_tokens=5)
    assert engine.scheduler.chunked_prefill and engine.scheduler.max_num_batched_tokens == 5
    outs = engine.generate([list(range(1, 30)), [3, 4]], 3, ignore_eos=True)
    assert [o.num_output_tokens for o in outs] == [3, 3]
    plain, _ = build_engine(str(tiny_gguf), max_num_seqs=2, num_blocks=16, block_size=4)
    assert not plain.scheduler.chunked_prefill
    assert [o.output_ids for o in plain.generate([list(range(1, 30)), [3, 4]], 3, ignore_eos=True)] == \
        [o.output_ids for o in outs]


# ---- fast paths ---------------------------------------------------------------------------------------------------

def _chunked_prefill_logits(runner, ids, chunk):
    """The logits after the last position of ``ids``, prefilled ``chunk`` tokens a step through the runner."""
    seq = runner._sequence_at_pool_start(ids, ids, 1)
    for start in range(0, len(ids), chunk):
        seq.schedule_run(start, min(start + chunk, len(ids)))
        logits = runner.forward(runner.prepare([seq]))
    return logits[-1].float()


@pytest.mark.parametrize("pack, dtype", [("none", "float32"), ("int8", "float32"), ("int4", "float32"),
                                         ("onednn", "bfloat16"), ("upcast", "bfloat16")])
def test_every_fast_path_prefills_in_chunks_as_in_one_step(tiny_llama, pack, dtype):
    try:
        weights = RunnerWeights.from_model(tiny_llama, dtype, pack=pack)
    except ValueError as exc:
        pytest.skip(f"{pack} is not available here: {exc}")
    runner = LLMEngine(tiny_llama, num_blocks=16, block_size=4, max_num_seqs=1, weights=weights).runner
    ids = list(range(3, 40))
    whole = runner.sequence_logits(ids)[-1]
    for chunk in (1, 5, 16):
        got = _chunked_prefill_logits(runner, ids, chunk)
        tol = 1e-4 if dtype == "float32" else 0.02
        assert (got - whole).abs().max() <= tol * whole.abs().max(), (pack, chunk)


@pytest.mark.parametrize("pack", ["int8", "int4"])
def test_the_low_bit_paths_with_chunked_prefill_give_their_dequantized_tokens(tiny_llama, pack):
    weights = RunnerWeights.from_model(tiny_llama, "float32", pack=pack)
    engine = LLMEngine(tiny_llama, num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=7,
                       weights=weights, chunked_prefill=True)
    prompts = _random_prompts(tiny_llama.config.vocab_size, 6, seed=2)
    outs = engine.generate(prompts, 8)
    _check_tokens(_mimic_of_packing(tiny_llama, pack), engine, prompts, outs, 8, f"chunked {pack}")


def test_only_decode_shaped_steps_reach_the_compiled_step(tiny_llama):
    """``pack="compiled"`` runs a step compiled only when every sequence feeds one token; a step holding a longer
    prompt chunk runs eagerly. (A stand-in records what the compiled step is handed and computes it eagerly.)"""
    engine = LLMEngine(tiny_llama, num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=7,
                       chunked_prefill=True)
    runner, handed = engine.runner, []

    def compiled(inp):
        handed.append(inp)
        runner.compiled = None
        try:
            logits = runner.forward(inp)
        finally:
            runner.compiled = compiled
        return logits, logits.argmax(dim=-1)
    runner.compiled = compiled
    prepared, prepare = [], runner.prepare
    runner.prepare = lambda seqs: prepared.append((prepare(seqs), [s.positions_to_run() for s in seqs])) or \
        prepared[-1][0]
    prompts = _random_prompts(tiny_llama.config.vocab_size, 6, seed=9)
    outs = engine.generate(prompts, 8)
    _check_tokens(tiny_llama, engine, prompts, outs, 8, "compiled routing")
    one_token_each = [inp for inp, runs in prepared if all(len(r) == 1 and first <= r.start for r, first in runs)]
    assert 0 < len(handed) == len(one_token_each) < len(prepared)
    assert all(a is b for a, b in zip(handed, one_token_each))
    mixed = [runs for _, runs in prepared if len(runs) > 1 and any(len(r) > 1 for r, _ in runs)]
    assert mixed and len(handed) + len(mixed) <= len(prepared)


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_bad_chunked_prefill_settings_are_refused(tiny_llama):
    bm = BlockManager(8, 4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=0, chunked_prefill=True)
    with pytest.raises(ValueError, match="at least max_num_seqs"):
        Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=3, chunked_prefill=True)
    with pytest.raises(ValueError, match="policy='continuous'"):
        Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=8, chunked_prefill=True, policy="static")
    with pytest.raises(ValueError, match="True or False"):
        Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=8, chunked_prefill="yes")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLMEngine(tiny_llama, num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=0,
                  chunked_prefill=True)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLMEngine(tiny_llama, num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=-5)
    seq = Sequence(0, [1, 2, 3], 4, block_size=4)
    for start, stop in ((0, 0), (2, 1), (-1, 2), (0, 4)):
        with pytest.raises(ValueError, match="start < stop"):
            seq.schedule_run(start, stop)
    engine = LLMEngine(tiny_llama, num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=2,
                       chunked_prefill=True)
    with pytest.raises(ValueError, match="whole cache"):
        engine.add_request(list(range(40)), 1)           # a prompt that could never fit, even in chunks
    [out] = engine.generate([list(range(1, 20))], 3, ignore_eos=True)    # a budget of 2: ten steps of prefill
    assert out.num_output_tokens == 3 and len(engine.steps) == 10 + 2
