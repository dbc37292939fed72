"""The chapter 04 engine: allocator, scheduler, exactness against generate, nothing lost, bad input."""
from __future__ import annotations

import random
import warnings

import pytest
import torch

from course_utils.engine import BlockManager, LLMEngine, Refused, RunnerWeights, Scheduler, Sequence, Status
from course_utils.engine import block_manager as block_manager_module
from course_utils.prompts import chat_prompt_ids
from course_utils.reference import Agreement, check_against_generate


def _seq(i, tokens, block_size=4, max_tokens=10):
    return Sequence(i, tokens, max_tokens, block_size=block_size)


# ---- block manager -------------------------------------------------------------------------------

def test_allocate_shares_full_prefix_blocks_and_counts_references():
    bm = BlockManager(16, 4)
    a, b = _seq(0, list(range(10))), _seq(1, list(range(8)) + [99, 98, 97])
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table[:2] == b.block_table[:2]            # two full blocks of equal prefix are shared
    assert a.block_table[2] != b.block_table[2]              # partial / different blocks are private
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 16 - 4
    bm.check_invariants([a, b])
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.deallocate(b)
    assert bm.num_free_blocks == 16
    bm.check_invariants([])


def test_freed_blocks_keep_their_content_until_reused():
    bm = BlockManager(4, 4)
    a = _seq(0, list(range(8)))
    bm.allocate(a)
    table = list(a.block_table)
    bm.deallocate(a)
    again = _seq(1, list(range(8)))
    assert bm.can_allocate(again)
    bm.allocate(again)
    assert again.block_table == table and again.num_cached_tokens == 8   # revived, fully cached
    bm.deallocate(again)
    other = _seq(2, list(range(100, 116)))                                # needs all 4 blocks: evicts the cache
    bm.allocate(other)
    assert not bm.cached or all(bm.blocks[b].token_ids != tuple(range(4)) for b in bm.cached.values())
    bm.check_invariants([other])


def test_can_allocate_counts_shared_blocks_in_use_as_free_of_charge():
    bm = BlockManager(3, 4)
    a = _seq(0, list(range(8)))
    bm.allocate(a)                                 # 2 blocks used, 1 free
    b = _seq(1, list(range(8)) + [5, 6])           # needs 3 blocks, 2 of them shared
    assert bm.can_allocate(b)
    c = _seq(2, list(range(50, 62)))               # needs 3 fresh blocks
    assert not bm.can_allocate(c)


def test_may_append_adds_a_block_at_the_boundary_and_registers_full_blocks():
    bm = BlockManager(8, 4)
    s = _seq(0, [1, 2, 3])
    bm.allocate(s)
    s.append(4)                                    # length 4: position 3 still fits block 0
    assert bm.can_append(s)
    bm.may_append(s)
    assert len(s.block_table) == 1 and bm.blocks[s.block_table[0]].hash is not None   # block 0 now full
    s.append(5)                                    # position 4 starts block 1
    bm.may_append(s)
    assert len(s.block_table) == 2
    twin = _seq(1, [1, 2, 3, 4, 9])
    bm.allocate(twin)
    assert twin.block_table[0] == s.block_table[0]  # the block filled while decoding is shared too


def test_reference_counts_never_go_negative():
    bm = BlockManager(4, 4)
    s = _seq(0, [1, 2, 3])
    bm.allocate(s)
    table = list(s.block_table)
    bm.deallocate(s)
    s.block_table = table                          # a double free
    with pytest.raises(RuntimeError, match="negative"):
        bm.deallocate(s)


def test_a_hash_collision_never_shares_a_block_of_other_tokens(monkeypatch):
    bm = BlockManager(8, 4)
    monkeypatch.setattr(block_manager_module, "block_hash", lambda prefix, tokens: 42)   # every block "equal"
    a, b = _seq(0, list(range(8))), _seq(1, list(range(100, 108)))
    bm.allocate(a)
    match = bm.match_prefix(b)
    assert match.hashes == [42, 42] and match.hits == []          # same hash, different tokens: no hit
    bm.allocate(b, match)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    bm.check_invariants([a, b])


def test_forced_hash_collisions_leave_the_tokens_exact(tiny_qwen2, monkeypatch):
    """With every block hashing alike, only the token comparison in the lookup keeps prefixes apart."""
    monkeypatch.setattr(block_manager_module, "block_hash", lambda prefix, tokens: 7)
    prompts = _random_prompts(tiny_qwen2.config.vocab_size, 6, seed=5)
    engine = LLMEngine(tiny_qwen2, num_blocks=96, block_size=4, max_num_seqs=3)
    outs = engine.generate(prompts, 8, ignore_eos=True)
    agreements = check_against_generate(tiny_qwen2, prompts, [o.output_ids for o in outs], 8)
    _report(agreements, "forced collisions")
    assert set(engine.block_manager.cached) == {7}               # every full block was registered under one hash


def test_a_prefix_is_hashed_once_per_admission(tiny_llama, monkeypatch):
    calls = []
    real = block_manager_module.block_hash
    monkeypatch.setattr(block_manager_module, "block_hash", lambda p, t: calls.append(1) or real(p, t))
    engine = LLMEngine(tiny_llama, num_blocks=16, block_size=4, max_num_seqs=2)
    engine.add_request(list(range(1, 13)), 1)                    # three full blocks
    engine.step()
    assert len(calls) == 3


def test_block_manager_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


# ---- scheduler -----------------------------------------------------------------------------------

def _finish_all_running(sched):
    for s in list(sched.running):
        sched.finish(s, "length")


def test_continuous_admits_as_soon_as_a_slot_frees():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=1000, policy="continuous")
    seqs = [_seq(i, [i + 1] * 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch, prefill = sched.schedule()
    assert prefill and batch == seqs[:2]
    sched.finish(seqs[0], "eos")
    batch, prefill = sched.schedule()
    assert prefill and batch == [seqs[2]] and seqs[2].slot == 0


def test_static_waits_for_the_whole_batch():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=1000, policy="static")
    seqs = [_seq(i, [i + 1] * 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.schedule()
    sched.finish(seqs[0], "eos")
    batch, prefill = sched.schedule()
    assert not prefill and batch == [seqs[1], seqs[0]]    # seqs[0] is computed as padding; seqs[2] waits
    assert seqs[0].block_table and bm.num_free_blocks == 64 - 2
    sched.finish(seqs[1], "eos")
    assert bm.num_free_blocks == 64 and not sched.padding  # the batch is done: everything released at once
    batch, prefill = sched.schedule()
    assert prefill and batch == [seqs[2]] and seqs[2].batch_id == 1


def test_preempts_the_newest_sequence_when_blocks_run_out():
    bm = BlockManager(2, 2)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=1000)
    a, b = _seq(0, [1, 2], block_size=2), _seq(1, [3, 4], block_size=2)
    sched.add(a)
    sched.add(b)
    assert sched.schedule() == ([a, b], True)
    a.append(7)
    b.append(8)                                     # both need a third... block: only 2 exist
    batch, prefill = sched.schedule()
    assert not prefill and batch == [a] and list(sched.waiting) == [b]
    assert b.status is Status.WAITING and b.num_preemptions == 1 and not b.block_table
    bm.check_invariants(sched.running)


def test_scheduler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        Scheduler(BlockManager(4, 4), max_num_seqs=1, max_num_batched_tokens=8, policy="fifo")
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(BlockManager(4, 4), max_num_seqs=0, max_num_batched_tokens=8)


# ---- exactness -------------------------------------------------------------------------------------

def _report(agreements: list[Agreement], label: str) -> None:
    ties = [f"request {i}: {a}" for i, a in enumerate(agreements) if a.near_tie]
    if ties:
        warnings.warn(f"{label}: near-ties (allowed): " + "; ".join(ties))
    bad = [f"request {i}: {a}" for i, a in enumerate(agreements) if not a.ok]
    assert not bad, f"{label}: " + "; ".join(bad)


def _random_prompts(vocab, n, seed, max_len=40):
    g = random.Random(seed)
    prompts = [[g.randrange(vocab) for _ in range(g.randint(1, max_len) if i else 20)] for i in range(n)]
    prompts.append(prompts[0][:8] + [3, 4, 5])           # shares two 4-token blocks with prompt 0
    prompts.append(list(prompts[0]))                      # the same prompt twice: all its 5 blocks cached
    return prompts


def test_tiny_models_match_generate(tiny_model):
    prompts = _random_prompts(tiny_model.config.vocab_size, 12, seed=1)
    engine = LLMEngine(tiny_model, num_blocks=128, block_size=4, max_num_seqs=4)
    outs = engine.generate(prompts, 12)
    agreements = check_against_generate(tiny_model, prompts, [o.output_ids for o in outs], 12,
                                        eos_token_ids=engine.eos_token_ids)
    _report(agreements, tiny_model.config.model_type)
    assert outs[-2].num_cached_tokens == 8 and outs[-1].num_cached_tokens == 20   # prefix sharing happened


@pytest.fixture(scope="module")
def embedded_run(embedded):
    """24 prompts through the embedded model with a cache small enough to force preemption."""
    model, tok = embedded
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 7 times 8?",
                 "Who wrote Pride and Prejudice?", "Give me a synonym for happy.", "What do bees make?",
                 "How many legs does a spider have?", "What is the boiling point of water?",
                 "Translate 'cat' into French.", "What is the largest planet?"]
    chat = [chat_prompt_ids(tok, q) for q in questions]
    words = tok("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                "must be in want of a wife. However little known the feelings or views of such a man may be "
                "on his first entering a neighbourhood, this truth is so well fixed").input_ids
    plain = [words[:n] for n in (1, 2, 3, 5, 8, 13, 16, 21, 29, 34, 40, 45)]
    prompts = chat + plain                                # 22 prompts, 1 to ~45 tokens; the chat ones share a prefix
    engine = LLMEngine(model, num_blocks=20, block_size=8, max_num_seqs=8)
    first = engine.generate(prompts, 6)
    cached_prompt = words[:32]                            # 4 full blocks, computed in the first run ...
    engine.generate([cached_prompt], 1)
    second = engine.generate([cached_prompt, chat[0]], 6)  # ... so now all its blocks are cached
    return model, engine, prompts + [cached_prompt, chat[0]], first + second


def test_embedded_model_matches_generate_for_every_request(embedded_run):
    model, engine, prompts, outs = embedded_run
    assert len(prompts) >= 20 and all(isinstance(o, Sequence) for o in outs)
    agreements = check_against_generate(model, prompts, [o.output_ids for o in outs], 6,
                                        eos_token_ids=engine.eos_token_ids)
    _report(agreements, "embedded")


def test_embedded_run_shared_prefixes_cached_prompts_and_preempted(embedded_run):
    model, engine, prompts, outs = embedded_run
    assert engine.scheduler.num_preemptions > 0, "the small cache should have forced preemption"
    assert any(o.num_preemptions for o in outs)
    assert all(o.num_cached_tokens >= 16 for o in outs[1:10])     # the chat template's prefix blocks were shared
    fully_cached, chat0 = outs[-2], outs[-1]
    assert fully_cached.num_prompt_tokens == 32 and fully_cached.num_cached_tokens == 32
    last_prefill = [s for s in engine.steps if s.is_prefill][-1]
    # every block of the 32-token prompt was cached: its prefill recomputed only its last token
    assert last_prefill.num_tokens == 1 + chat0.num_prompt_tokens - chat0.num_cached_tokens


def test_static_policy_pads_and_gives_the_same_tokens_as_continuous(tiny_qwen2):
    prompts = _random_prompts(tiny_qwen2.config.vocab_size, 9, seed=3)
    lengths = [1, 9, 3, 12, 5, 2, 7, 4, 11, 6, 8]
    static = LLMEngine(tiny_qwen2, num_blocks=64, block_size=4, max_num_seqs=4, policy="static")
    cont = LLMEngine(tiny_qwen2, num_blocks=64, block_size=4, max_num_seqs=4)
    a = static.generate(prompts, lengths, ignore_eos=True)
    b = cont.generate(prompts, lengths, ignore_eos=True)
    assert [s.output_ids for s in a] == [s.output_ids for s in b]
    assert [s.num_output_tokens for s in a] == lengths
    assert max(s.batch_id for s in a) == 2                        # 11 requests, 4 slots: batches of 4, 4, 3
    decode_widths = [st.num_seqs for st in static.steps if not st.is_prefill]
    assert decode_widths[:11] == [4] * 11                         # the first batch stays 4 wide until its longest ends
    assert static.block_manager.num_free_blocks == 64


# ---- nothing lost ---------------------------------------------------------------------------------

@pytest.mark.parametrize("policy, n_requests", [("continuous", 220), ("static", 60)])
def test_random_workload_completes_every_request_and_frees_every_block(tiny_llama, policy, n_requests):
    rng = random.Random(7)
    engine = LLMEngine(tiny_llama, num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=64,
                       policy=policy)
    prefixes = [[rng.randrange(128) for _ in range(8)] for _ in range(3)]
    arrivals = sorted(rng.randrange(2 * n_requests) for _ in range(n_requests))
    expected, step, i = {}, 0, 0
    while i < len(arrivals) or engine.has_unfinished():
        while i < len(arrivals) and arrivals[i] <= step:
            body = [rng.randrange(128) for _ in range(rng.randint(1, 24))]
            prompt = (rng.choice(prefixes) + body) if rng.random() < 0.4 else body
            n = rng.randint(1, 30)
            expected[engine.add_request(prompt, n, ignore_eos=True)] = n
            i += 1
        engine.step()
        engine.block_manager.check_invariants(engine.scheduler.live())   # counts match block tables, never negative
        step += 1
    seqs = engine.sequences
    assert len(seqs) == n_requests and all(s.is_finished for s in seqs.values())
    assert all(s.num_output_tokens == expected[k] for k, s in seqs.items())
    assert engine.block_manager.num_free_blocks == 24
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
    assert engine.scheduler.num_preemptions > 0
    assert any(s.num_cached_tokens for s in seqs.values())


# ---- bad input --------------------------------------------------------------------------------------

def test_bad_requests_are_refused_and_the_others_still_served(tiny_llama):
    engine = LLMEngine(tiny_llama, num_blocks=8, block_size=4, max_num_seqs=4)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], 4)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([1, 2], 0)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([1, 2], -3)
    with pytest.raises(ValueError, match="whole cache"):
        engine.add_request(list(range(40)), 1)
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        engine.add_request([1, 500], 2)
    with pytest.raises(TypeError, match="list of token ids"):
        engine.add_request("hello", 2)
    good = [[1, 2, 3], [4, 5, 6, 7, 8]]
    outs = engine.generate([good[0], [], good[1], list(range(40)), [1, 2]], [5, 5, 5, 5, 0])
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "error", "error"]
    assert [type(o) for o in outs] == [Sequence, Refused, Sequence, Refused, Refused]
    assert outs[1].prompt_ids == [] and outs[3].prompt_ids == list(range(40))
    assert "empty" in outs[1].error and "whole cache" in outs[3].error and "max_tokens" in outs[4].error
    clean = LLMEngine(tiny_llama, num_blocks=8, block_size=4, max_num_seqs=4).generate(good, 5)
    assert [outs[0].output_ids, outs[2].output_ids] == [c.output_ids for c in clean]
    assert engine.block_manager.num_free_blocks == 8


def test_unsupported_architectures_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=32))
    with pytest.raises(ValueError, match="llama"):
        LLMEngine(gpt2, num_blocks=4, block_size=4)


def _mimic_of_packing(model, pack):
    """A copy of ``model`` whose every projection and LM head holds the matrix the ``pack`` fast path computes
    with (the LM head untied from the embedding, as the engine keeps the embedding dense)."""
    import copy

    from course_utils.engine.packed import dequantized_like_packing
    from course_utils.hooks import projection_modules
    mimic = copy.deepcopy(model)
    with torch.no_grad():
        for lin in projection_modules(mimic).values():
            lin.weight.copy_(dequantized_like_packing(lin.weight, pack))
        head = mimic.get_output_embeddings()
        head.weight = torch.nn.Parameter(dequantized_like_packing(head.weight, pack))
    return mimic


@pytest.mark.parametrize("pack", ["int8", "int4"])
def test_the_low_bit_fast_path_gives_the_tokens_of_its_dequantized_weights(tiny_model, pack):
    """``pack="int8"/"int4"`` is lossy, by exactly the de-quantised matrices: with those in a copy of the model,
    ``generate`` gives the engine's tokens (up to near-ties: the kernels sum in their own order)."""
    from course_utils.engine.packed import PackedLinear
    weights = RunnerWeights.from_model(tiny_model, "float32", pack=pack)
    engine = LLMEngine(tiny_model, num_blocks=128, block_size=4, max_num_seqs=4, weights=weights)
    assert all(isinstance(m, PackedLinear) for m in engine.runner.step_matrices())
    dense = LLMEngine(tiny_model, num_blocks=8, block_size=4, max_num_seqs=1).runner.step_weight_bytes()
    assert engine.runner.step_weight_bytes() < (0.35 if pack == "int8" else 0.2) * dense
    prompts = _random_prompts(tiny_model.config.vocab_size, 6, seed=2)
    outs = engine.generate(prompts, 8)
    agreements = check_against_generate(_mimic_of_packing(tiny_model, pack), prompts, [o.output_ids for o in outs], 8,
                                        eos_token_ids=engine.eos_token_ids)
    _report(agreements, f"{tiny_model.config.model_type} {pack}")


def test_the_fast_path_rejects_an_unknown_packing(tiny_llama):
    with pytest.raises(ValueError, match="pack must be one of"):
        RunnerWeights.from_model(tiny_llama, "float32", pack="int3")
    from course_utils.engine.packed import pack_matrix
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pack_matrix(torch.randn(64, 64), "int8", torch.float16)


def test_sequence_logits_are_the_models_own_at_every_position(tiny_model):
    """The runner's logits at every position of one prefill equal the model's (the fast path's quality is measured
    with them)."""
    ids = list(range(3, 40))
    runner = LLMEngine(tiny_model, num_blocks=16, block_size=4, max_num_seqs=1).runner
    got = runner.sequence_logits(ids)
    want = tiny_model(torch.tensor([ids])).logits[0]
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="tokens"):
        runner.sequence_logits(list(range(100)))


def test_the_onednn_prepacked_path_keeps_the_bf16_weights(tiny_model):
    """``pack="onednn"``: the same bfloat16 matrices in oneDNN's layout: the logits of the dense bfloat16 path, up
    to the order of the sums."""
    from course_utils.engine.packed import PrepackedLinear
    try:
        weights = RunnerWeights.from_model(tiny_model, "bfloat16", pack="onednn")
    except ValueError as exc:
        pytest.skip(f"no oneDNN bfloat16 linear on this machine: {exc}")
    ids = list(range(3, 30))
    fast = LLMEngine(tiny_model, num_blocks=16, block_size=4, max_num_seqs=1, weights=weights).runner
    dense = LLMEngine(tiny_model, num_blocks=16, block_size=4, max_num_seqs=1, dtype="bfloat16").runner
    assert all(isinstance(m, PrepackedLinear) for m in fast.step_matrices())
    assert fast.step_weight_bytes() == dense.step_weight_bytes()
    a, b = fast.sequence_logits(ids), dense.sequence_logits(ids)
    assert (a - b).abs().max() <= 0.02 * b.abs().max()
    with pytest.raises(ValueError, match="bfloat16"):
        RunnerWeights.from_model(tiny_model, "float32", pack="onednn")


def test_the_upcast_product_is_the_bf16_product_summed_in_float32(monkeypatch):
    """``upcast_product``: bfloat16 numbers multiplied and summed in float32, rounded at the end -- what PyTorch's
    bfloat16 product computes -- whatever the slices (here 24 rows at a time, the last slice partial)."""
    from course_utils.engine import packed
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 96, generator=g).to(torch.bfloat16)
    w = torch.randn(200, 96, generator=g).to(torch.bfloat16)
    want = (x.double() @ w.double().t())
    whole = packed.upcast_product(x, w)
    monkeypatch.setattr(packed, "UPCAST_SLICE_BYTES", 24 * 4 * 96)
    sliced = packed.upcast_product(x, w)
    assert sliced.dtype == torch.bfloat16 and sliced.shape == (12, 200)
    ulp = want.abs().clamp_min(1e-3) * 2.0 ** -8                    # one rounding to bfloat16's 8-bit mantissa
    for got in (whole, sliced):
        assert ((got.double() - want).abs() <= ulp).all()
    assert ((torch.nn.functional.linear(x, w).double() - sliced.double()).abs() <= 2 * ulp).all()


def test_bf16_products_in_float32_switches_a_transformers_models_many_row_products_and_back(tiny_qwen2, monkeypatch):
    """``bf16_products_in_float32``: inside the block a bfloat16 model's products of 8 rows or more go through
    ``upcast_product`` (biases added; one-row products do not), the logits are the model's own up to the order of
    the sums, and the layers are their own again after it; on a CPU with bfloat16 kernels it does nothing."""
    import copy

    from course_utils.engine import packed
    model = copy.deepcopy(tiny_qwen2).to(torch.bfloat16).requires_grad_(False)   # qwen2: q, k, v have biases
    ids = torch.arange(3, 30)[None]
    want = model(ids).logits.float()
    calls = []
    real = packed.upcast_product
    monkeypatch.setattr(packed, "upcast_product", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    with packed.bf16_products_in_float32(model, force=True) as on:
        got = model(ids).logits.float()
        assert on and calls and set(calls) == {ids.shape[1]}
        calls.clear()
        model(ids[:, :1])                                          # one row: PyTorch's own product
        assert calls == []
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.equal(model(ids).logits.float(), want) and calls == []     # its own layers again
    with packed.bf16_products_in_float32(model, force=False) as on:
        assert not on
    monkeypatch.setattr(packed, "bf16_products_are_slow", lambda device="cpu": False)
    with packed.bf16_products_in_float32(model) as on:
        assert not on and torch.equal(model(ids).logits.float(), want)
    with packed.bf16_products_in_float32(tiny_qwen2, force=True) as on:     # a float32 model: nothing to switch
        assert not on


def test_the_upcast_path_keeps_the_bf16_weights_and_multiplies_batches_in_float32(tiny_model, monkeypatch):
    """``pack="upcast"``: the same bfloat16 matrices; a prefill's products go through ``upcast_product`` (a
    one-row decode step's do not), and its logits are the dense bfloat16 path's up to the order of the sums."""
    from course_utils.engine import packed
    calls = []
    real = packed.upcast_product
    monkeypatch.setattr(packed, "upcast_product", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    weights = RunnerWeights.from_model(tiny_model, "bfloat16", pack="upcast")
    fast = LLMEngine(tiny_model, num_blocks=16, block_size=4, max_num_seqs=1, weights=weights).runner
    dense = LLMEngine(tiny_model, num_blocks=16, block_size=4, max_num_seqs=1, dtype="bfloat16").runner
    assert all(isinstance(m, packed.UpcastLinear) for m in fast.step_matrices())
    assert fast.step_weight_bytes() == dense.step_weight_bytes()
    ids = list(range(3, 30))
    a, b = fast.sequence_logits(ids), dense.sequence_logits(ids)
    layers = tiny_model.config.num_hidden_layers
    assert calls == [len(ids)] * (4 * layers + 1)                   # every product of the prefill, the head too
    assert (a - b).abs().max() <= 0.02 * b.abs().max()
    calls.clear()
    fast.decode_logits(ids[:3])                                     # prefill of one token, then one-row steps
    assert calls == []
    with pytest.raises(ValueError, match="bfloat16"):
        RunnerWeights.from_model(tiny_model, "float32", pack="upcast")
