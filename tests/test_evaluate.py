"""Tests for course_utils.evaluate and course_utils.kv_quant (chapter 07): the measuring tools, on hand-computed
examples and tiny random models."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from course_utils import evaluate as E
from course_utils.evaluate import Windows
from course_utils.kv_quant import KVQuantSpec, QuantizedKVCache, fake_quantize_kv
from course_utils.reference import compare_tokens, reference_generate

IDS = torch.arange(3, 3 + 120).remainder(97).add(3)[None]       # 120 token ids of a tiny vocabulary


# --- which predictions are scored -----------------------------------------------------------------

def test_windows_score_every_target_once_after_their_context():
    w = Windows(n_tokens=50, window=24, stride=16, chunk=5)
    assert w.context_only == 8 and w.tokens_needed == 59
    assert w.spans() == [(0, 16), (16, 16), (32, 16), (48, 2)]
    targets = E.scored_targets(IDS, w)
    assert torch.equal(targets, IDS[0, 9:59])                      # contiguous, each once
    starts = [s + w.context_only for s, _ in w.spans()]            # first scored position of each window
    assert starts == [8, 24, 40, 56] and all(b - a == 16 for a, b in zip(starts, starts[1:]))


@pytest.mark.parametrize("kwargs", [dict(window=0), dict(stride=0), dict(chunk=0), dict(n_tokens=0),
                                    dict(window=8, stride=9), dict(window=-4)])
def test_bad_windows_raise(kwargs):
    with pytest.raises(ValueError):
        Windows(**{**dict(n_tokens=8, window=8, stride=4, chunk=2), **kwargs})


def test_a_text_shorter_than_one_window_or_than_n_raises():
    w = Windows(n_tokens=20, window=16, stride=8, chunk=4)
    with pytest.raises(ValueError, match="shorter than one window"):
        E.scored_targets(IDS[:, :9], w)
    with pytest.raises(ValueError, match="n_tokens=20"):
        E.scored_targets(IDS[:, :20], w)
    with pytest.raises(ValueError):
        E.scored_targets(torch.zeros(1, 40), w)                   # float "ids"


def test_a_window_longer_than_the_model_context_raises(tiny_llama):
    w = Windows(n_tokens=8, window=300, stride=8, chunk=8)        # tiny models: 256 positions
    with pytest.raises(ValueError, match="max_position_embeddings"):
        E.perplexity(tiny_llama, torch.arange(400)[None] % 100, w)


# --- perplexity ---------------------------------------------------------------------------------

def _independent_nll(model, ids, w):
    """NLL of every scored target from one plain forward per window, without cache or chunks."""
    out = []
    with torch.no_grad():
        for start, n in w.spans():
            x = ids[:, start:start + w.context_only + n + 1]
            logits = model(x[:, :-1], use_cache=False).logits[0]
            nll = F.cross_entropy(logits.double(), x[0, 1:], reduction="none")
            out.append(nll[w.context_only:])
    return torch.cat(out)


def test_perplexity_is_exp_of_the_mean_nll_computed_independently(tiny_model):
    w = Windows(n_tokens=45, window=24, stride=16, chunk=5)
    ppl = E.perplexity(tiny_model, IDS, w)
    nll = _independent_nll(tiny_model, IDS, w)
    assert ppl.nll.shape == (45,)
    np.testing.assert_allclose(ppl.nll, nll.numpy(), rtol=1e-4, atol=1e-5)
    assert math.isclose(ppl.value, math.exp(nll.mean().item()), rel_tol=1e-5)
    se = nll.std().item() / math.sqrt(45)
    assert math.isclose(ppl.uncertainty, ppl.value * se, rel_tol=1e-3)


def test_chunk_size_does_not_change_which_positions_are_scored(tiny_llama):
    w = Windows(n_tokens=30, window=20, stride=10, chunk=3)
    a, b = E.perplexity(tiny_llama, IDS, w), E.perplexity(tiny_llama, IDS, w, chunk=7)
    np.testing.assert_allclose(a.nll, b.nll, rtol=1e-5, atol=1e-6)


# --- per-position statistics on hand-computed examples --------------------------------------------

def test_token_stats_on_a_hand_computed_example():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]).log()
    q = torch.tensor([[0.25, 0.5, 0.25], [0.2, 0.3, 0.5]]).log()
    s = E.token_stats(p, q, torch.tensor([1, 2]))
    assert s["kld"][0].item() == pytest.approx(0.5 * math.log(2) + 0.25 * math.log(0.5), abs=1e-7)   # = ln2 / 4
    assert s["kld"][1].item() == 0.0
    assert s["nll"][0].item() == pytest.approx(math.log(2)) and s["nll_base"][0].item() == pytest.approx(math.log(4))
    assert s["p_diff"][0].item() == pytest.approx(0.25) and s["p_diff"][1].item() == 0.0
    assert s["same_top"].tolist() == [False, True]


def test_token_stats_and_log_softmax_do_not_depend_on_their_block_of_rows():
    """Both work a block of rows at a time: a row's figures are the same whatever the block (and a last, partial
    block is handled), and the in-place log-softmax is torch's."""
    g = torch.Generator().manual_seed(0)
    logits_p, logits_q = torch.randn(37, 500, generator=g) * 4, torch.randn(37, 500, generator=g) * 4
    targets = torch.randint(0, 500, (37,), generator=g)
    p = E._log_softmax_(logits_p.clone())
    assert torch.allclose(p, torch.log_softmax(logits_p, -1), atol=1e-6)
    for rows in (1, 5, 64):
        assert torch.equal(E._log_softmax_(logits_p.clone(), block_rows=rows), p)
    q = torch.log_softmax(logits_q, -1)
    want = E.token_stats(p, q, targets, block_rows=37)
    for rows in (1, 16, 64):
        got = E.token_stats(p, q, targets, block_rows=rows)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_token_stats_reject_mismatched_vocabularies():
    with pytest.raises(ValueError, match="vocabular"):
        E.token_stats(torch.zeros(2, 5), torch.zeros(2, 6), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="targets"):
        E.token_stats(torch.zeros(2, 5), torch.zeros(2, 5), torch.tensor([0]))


def test_percentiles_and_standard_error_follow_llama_cpp():
    v = [4.0, 1.0, 3.0, 2.0]
    assert E.percentile(v, 0.0) == 1.0 and E.percentile(v, 1.0) == 4.0 and E.percentile(v, 0.5) == 2.5
    assert E.percentile(v, 0.999) == pytest.approx(3.997)
    assert E.percentile(v, 0.1) == pytest.approx(1.3)
    assert E.percentile(list(range(11)), 0.9) == pytest.approx(9.0)
    mean, se = E.mean_and_se([1, 2, 3, 4, 5])               # population variance 2, n - 1 = 4
    assert mean == 3.0 and se == pytest.approx(math.sqrt(2 / 4))
    with pytest.raises(ValueError):
        E.percentile(v, 1.5)
    with pytest.raises(ValueError):
        E.mean_and_se([1.0])


def test_kld_result_summary_on_a_hand_computed_example():
    r = E.KLDResult(kld=np.array([0.0, 0.1, 0.2, 0.3]), nll=np.array([1.0, 2.0, 3.0, 4.0]),
                    nll_base=np.array([1.0, 1.0, 3.0, 3.0]), p_diff=np.array([0.1, -0.1, 0.2, -0.2]),
                    same_top=np.array([True, True, False, True]))
    s = r.summary()
    assert s["Mean PPL(Q)"][0] == pytest.approx(math.exp(2.5)) and s["Mean PPL(base)"][0] == pytest.approx(math.exp(2.0))
    assert s["Mean ln(PPL(Q)/PPL(base))"][0] == pytest.approx(0.5)
    # the difference nll - nll_base = [0, 1, 0, 1]: its mean's se = sqrt(0.25 / 3)
    assert s["Mean ln(PPL(Q)/PPL(base))"][1] == pytest.approx(math.sqrt(0.25 / 3))
    assert s["Cor(ln(PPL(Q)), ln(PPL(base)))"] == pytest.approx(np.corrcoef(r.nll, r.nll_base)[0, 1])
    assert s["Mean KLD"] == pytest.approx((0.15, math.sqrt(0.0125 / 3)))
    assert s["Maximum KLD"] == 0.3 and s["Minimum KLD"] == 0.0 and s["Median KLD"] == pytest.approx(0.15)
    assert s["RMS Δp"][0] == pytest.approx(math.sqrt(0.025))
    assert s["Same top p"] == pytest.approx((0.75, math.sqrt(0.75 * 0.25 / 3)))
    for name in ("Mean PPL(Q)/PPL(base)", "Mean PPL(Q)-PPL(base)", "99.9% KLD", "0.1% KLD", "75.0% Δp", "Mean Δp"):
        assert name in s
    assert "Same top p" in r.report() and "====== KL divergence statistics ======" in r.report()
    assert r.head(2).n == 2 and r.per_unit(2)["kld"] == pytest.approx(0.3)


# --- the reference against itself, and against others --------------------------------------------

def test_a_model_against_itself_gives_kld_zero_same_top_one(tiny_llama, tmp_path):
    w = Windows(n_tokens=40, window=24, stride=16, chunk=6)
    for spill in (None, tmp_path):
        ref = E.record_reference(tiny_llama, IDS, w, spill_dir=spill)
        r = E.compare_to_reference(tiny_llama, ref)
        assert r.n == 40 and float(np.abs(r.kld).max()) == 0.0 and r.same_top.all()
        assert float(np.abs(r.p_diff).max()) == 0.0 and r.ppl_ratio == (1.0, 0.0)
        assert r.mean_kld == (0.0, 0.0) and r.same_top_p == (1.0, 0.0)
        np.testing.assert_allclose(ref.perplexity.nll, E.perplexity(tiny_llama, IDS, w).nll)
        ref.release()
    assert not any(tmp_path.iterdir())                               # its files are gone


def test_other_chunks_read_the_stored_reference_across_chunk_boundaries(tiny_llama, tmp_path):
    w = Windows(n_tokens=40, window=24, stride=16, chunk=6)
    ref = E.record_reference(tiny_llama, IDS, w, spill_dir=tmp_path)
    r = E.compare_to_reference(tiny_llama, ref, chunk=4)
    assert r.n == 40 and float(np.abs(r.kld).max()) < 1e-6 and r.same_top.all()
    head = E.compare_to_reference(tiny_llama, ref, n_tokens=10)
    assert head.n == 10
    with pytest.raises(ValueError):
        E.compare_to_reference(tiny_llama, ref, n_tokens=41)


def test_a_changed_model_has_positive_kld_and_matches_the_direct_formula(tiny_llama):
    w = Windows(n_tokens=20, window=16, stride=10, chunk=5)
    ref = E.record_reference(tiny_llama, IDS, w)
    lin = tiny_llama.model.layers[0].mlp.down_proj
    saved = lin.weight.detach().clone()
    try:
        with torch.no_grad():
            lin.weight.mul_(1.5)
        r = E.compare_to_reference(tiny_llama, ref)
        direct = [F.kl_div(q, p, log_target=True, reduction="sum").item()
                  for p, q in zip(torch.cat(ref.chunks), torch.cat([lp for lp, _ in E.scored_logprobs(tiny_llama, IDS, w)]))]
    finally:
        with torch.no_grad():
            lin.weight.copy_(saved)
    assert (r.kld > 0).all()
    np.testing.assert_allclose(r.kld, direct, rtol=1e-4, atol=1e-7)


def test_mismatched_vocabularies_raise(tiny_llama):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256)).eval()
    w = Windows(n_tokens=8, window=8, stride=4, chunk=4)
    ref = E.record_reference(tiny_llama, IDS, w)
    with pytest.raises(ValueError, match="vocabulary"):
        E.compare_to_reference(other, ref)
    ref.release()
    with pytest.raises(ValueError, match="released"):
        E.compare_to_reference(tiny_llama, ref)


# --- small statistics -----------------------------------------------------------------------------

def test_mcnemar_on_hand_computed_tables():
    assert E.mcnemar_exact(1, 6) == pytest.approx(2 * 8 / 128)       # P(X <= 1), X ~ Bin(7, 1/2): 8/128
    assert E.mcnemar_exact(6, 1) == E.mcnemar_exact(1, 6)
    assert E.mcnemar_exact(0, 6) == pytest.approx(2 / 64)
    assert E.mcnemar_exact(3, 3) == 1.0 and E.mcnemar_exact(0, 0) == 1.0
    assert E.mcnemar_exact(0, 5) > 0.05 > E.mcnemar_exact(0, 6)
    with pytest.raises(ValueError):
        E.mcnemar_exact(-1, 2)
    with pytest.raises(ValueError):
        E.mcnemar_exact(1.5, 2)


def test_wilson_interval():
    lo, hi = E.wilson_interval(8, 16)
    assert lo == pytest.approx(0.2799, abs=1e-3) and hi == pytest.approx(0.7201, abs=1e-3)
    assert E.wilson_interval(0, 16)[0] == 0.0 and E.wilson_interval(0, 16)[1] == pytest.approx(0.1936, abs=1e-3)
    assert E.wilson_interval(16, 16)[1] == 1.0
    for bad in [(17, 16), (-1, 16), (1, 0)]:
        with pytest.raises(ValueError):
            E.wilson_interval(*bad)


def test_bootstrap_interval():
    x = np.random.default_rng(0).normal(1.0, 1.0, 400)
    lo, hi = E.bootstrap_interval(x, seed=1)
    assert lo < x.mean() < hi and hi - lo == pytest.approx(2 * 1.96 / 20, rel=0.25)
    assert E.bootstrap_interval(x, seed=1) == (lo, hi)
    trend = np.repeat(np.arange(20.0), 20)                          # strongly dependent neighbours
    naive, blocked = E.bootstrap_interval(trend), E.bootstrap_interval(trend, block=20)
    assert blocked[1] - blocked[0] > 2 * (naive[1] - naive[0])
    with pytest.raises(ValueError):
        E.bootstrap_interval(x, block=300)


# --- agreement ----------------------------------------------------------------------------------

def test_a_model_agrees_with_its_own_greedy_output(tiny_model):
    prompt = [5, 9, 2, 44]
    tokens, _ = reference_generate(tiny_model, prompt, 12)
    a = E.top1_agreement(tiny_model, prompt, tokens)
    assert a.n == 12 and a.rate == 1.0 and a.first_miss is None
    wrong = list(tokens)
    wrong[3] = (wrong[3] + 1) % 128
    b = E.top1_agreement(tiny_model, prompt, wrong)
    assert not b.matches[3] and b.first_miss == 3 and b.matches[:3] == [True] * 3
    with pytest.raises(ValueError):
        E.top1_agreement(tiny_model, [], tokens)


# --- the battery ------------------------------------------------------------------------------------

def test_grading():
    assert E.grade_answer("The capital of France is Paris.", ["Paris"])
    assert not E.grade_answer("Parisian cafés", ["Paris"])
    assert E.grade_answer("A spider has 8 legs", ["eight", "8"]) and not E.grade_answer("18 legs", ["8"])
    assert E.grade_answer("It is carbon dioxide (CO2).", ["carbon dioxide"])
    assert E.grade_answer("CAFÉ", ["cafe"]) and not E.grade_answer("", ["x"])


def test_the_shipped_battery(tmp_path):
    qs = E.load_battery()
    assert len(qs) == 16 and len({q.question for q in qs}) == 16 and all(q.accepted for q in qs)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"questions": [{"question": "Why?"}]}))
    with pytest.raises(ValueError, match="accepted"):
        E.load_battery(bad)


def test_paired_comparison():
    pc = E.paired_comparison([True, True, False, False, True], [True, False, True, False, False])
    assert (pc.both_right, pc.right_to_wrong, pc.wrong_to_right, pc.both_wrong) == (1, 2, 1, 1)
    assert pc.flips == 3 and pc.p_value == E.mcnemar_exact(2, 1)
    with pytest.raises(ValueError):
        E.paired_comparison([True], [True, False])


def _generate_with_scores(model, prompt, n, penalty):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, repetition_penalty=penalty,
                         temperature=None, top_p=None, top_k=None, eos_token_id=None, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), gaps


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_batched_greedy_equals_generate_prompt_by_prompt(tiny_model, penalty):
    shared = [7, 8, 9, 10]                                           # a shared prefix, then different lengths
    prompts = [shared + [11, 12, 13], shared + [20], shared + [30, 31, 32, 33, 34, 35]]
    got = E.batched_greedy(tiny_model, prompts, 8, repetition_penalties=(1.0, penalty))
    assert set(got) == {1.0, penalty} and all(len(rows) == 3 for rows in got.values())
    for prompt, tokens in zip(prompts, got[penalty]):
        expected, gaps = _generate_with_scores(tiny_model, prompt, 8, penalty)
        assert compare_tokens(tokens, expected, gaps).ok, (prompt, tokens, expected)


def test_batched_greedy_stops_a_row_at_eos(tiny_llama):
    prompt = [5, 6, 7]
    free = E.batched_greedy(tiny_llama, [prompt], 6)[1.0][0]
    stop = E.batched_greedy(tiny_llama, [prompt, [9, 9]], 6, eos_token_ids=[free[2]])[1.0]
    assert stop[0] == free[:free.index(free[2])]
    with pytest.raises(ValueError):
        E.batched_greedy(tiny_llama, [[]], 4)
    with pytest.raises(ValueError):
        E.batched_greedy(tiny_llama, [prompt], 4, repetition_penalties=(0.0,))


def test_stock_repetition_penalty(tiny_llama):
    saved = tiny_llama.generation_config.repetition_penalty
    try:
        tiny_llama.generation_config.repetition_penalty = 1.0
        value, source = E.stock_repetition_penalty(tiny_llama)
        assert value == E.FALLBACK_REPETITION_PENALTY == 1.1 and "Qwen2.5" in source
        tiny_llama.generation_config.repetition_penalty = 1.05
        assert E.stock_repetition_penalty(tiny_llama) == (1.05, "the model's generation_config")
    finally:
        tiny_llama.generation_config.repetition_penalty = saved


def test_run_battery_and_measure_candidate_on_a_model_with_a_real_tokenizer(tiny_gguf):
    from course_utils.models import load_model
    model, tok = load_model(str(tiny_gguf), verbose=False)
    qs = E.load_battery()[:3]
    res = E.run_battery(model, tok, qs, repetition_penalties=(1.0, 1.1), max_new_tokens=3)
    assert set(res.answers) == {1.0, 1.1} and all(len(a) == 3 for a in res.answers.values())
    right, n, lo, hi = res.accuracy(1.0)
    assert n == 3 and 0 <= lo <= right / n <= hi <= 1
    ids = torch.tensor([tok("It was a bright cold day in April, and the clocks were striking thirteen. " * 6,
                            add_special_tokens=False).input_ids])
    w = Windows(n_tokens=16, window=24, stride=16, chunk=8)
    ref = E.record_reference(model, ids, w)
    prompt = [int(t) for t in ids[0, :5]]
    gen, _ = reference_generate(model, prompt, 6)
    q = E.measure_candidate(model, tok, {"text": ref}, prompt_ids=prompt, reference_ids=gen, questions=qs,
                            max_new_tokens=2)
    assert float(np.abs(q.kld["text"].kld).max()) == 0.0 and q.agreement.rate == 1.0 and q.battery is not None
    assert set(q.seconds) == {"KL divergence, text", "agreement", "battery"}
    units = E.text_units(tok, ref.targets)
    assert units["tokens"] == 16 and 0 < units["words"] <= 16 < units["chars"]


# --- KV-cache quantization ------------------------------------------------------------------------

def test_kv_fake_quantization_groups_along_the_stated_axis():
    torch.manual_seed(0)
    offsets = torch.tensor([0.0, 0.0, 12.0, 0.0, -9.0, 0.0, 0.0, 0.0])   # channels large for every token, as in keys
    x = torch.randn(1, 2, 32, 8) + offsets
    spec = KVQuantSpec(2, group_size=16)
    per_channel = fake_quantize_kv(x, spec, "channel")
    for group in per_channel.split(16, dim=2):                     # each channel: <= 4 levels per 16 tokens
        assert all(group[0, h, :, c].unique().numel() <= 4 for h in range(2) for c in range(8))
    per_token = fake_quantize_kv(x, KVQuantSpec(2, group_size=8), "token")
    assert all(per_token[0, h, t].unique().numel() <= 4 for h in range(2) for t in range(32))
    err = {b: (fake_quantize_kv(x, KVQuantSpec(b, 16), "channel") - x).norm() / x.norm() for b in (2, 4, 8)}
    assert err[8] < err[4] < err[2]
    assert (per_channel - x).norm() < (fake_quantize_kv(x, KVQuantSpec(2, 8), "token") - x).norm()


@pytest.mark.parametrize("kwargs", [dict(bits=1), dict(bits=9), dict(group_size=0), dict(key_axis="row"),
                                    dict(value_axis="head")])
def test_bad_kv_specs_raise(kwargs):
    with pytest.raises(ValueError):
        KVQuantSpec(**kwargs)


def test_kv_bits_per_element_count_step_and_minimum():
    assert KVQuantSpec(4, 64).bits_per_element == 4.5 and KVQuantSpec(8, 64).bits_per_element == 8.5


def test_the_quantized_cache_is_what_the_next_chunk_reads(tiny_model):
    spec = KVQuantSpec(4, group_size=8)
    x1, x2 = IDS[:, :16], IDS[:, 16:24]
    plain, quant = DynamicCache(config=tiny_model.config), QuantizedKVCache(tiny_model.config, spec)
    with torch.no_grad():
        assert torch.equal(tiny_model(x1, cache=plain).logits, tiny_model(x1, cache=quant).logits)
        assert quant.quantized_tokens == 16 and quant.get_seq_length() == 16
        for layer_p, layer_q in zip(plain.layers, quant.layers):
            assert torch.equal(layer_q.q_keys, fake_quantize_kv(layer_p.keys, spec, "channel"))
            assert torch.equal(layer_q.q_values, fake_quantize_kv(layer_p.values, spec, "token"))
        a, b = tiny_model(x2, cache=plain).logits, tiny_model(x2, cache=quant).logits
    assert not torch.equal(a, b)
    manual = DynamicCache(config=tiny_model.config)                 # the same, with the quantized past fed in
    for i, layer in enumerate(quant.layers):
        manual.update(layer.q_keys[..., :16, :], layer.q_values[..., :16, :], i)
    with torch.no_grad():
        assert torch.allclose(tiny_model(x2, cache=manual).logits, b, atol=1e-5)


def test_tokens_short_of_a_group_wait_in_full_precision(tiny_llama):
    cache = QuantizedKVCache(tiny_llama.config, KVQuantSpec(4, group_size=8))
    with torch.no_grad():
        tiny_llama(IDS[:, :3], cache=cache)
        assert cache.quantized_tokens == 0 and cache.get_seq_length() == 3
        tiny_llama(IDS[:, 3:9], cache=cache)
    assert cache.quantized_tokens == 8 and cache.get_seq_length() == 9 and cache.layers[1].keys.shape[-2] == 1


def test_a_residual_keeps_recent_whole_groups_in_full_precision(tiny_llama):
    cache = QuantizedKVCache(tiny_llama.config, KVQuantSpec(4, group_size=4), residual=6)
    with torch.no_grad():
        tiny_llama(IDS[:, :15], cache=cache)
    assert cache.quantized_tokens == 8 and cache.layers[0].keys.shape[-2] == 7 and cache.get_seq_length() == 15


def test_a_2_bit_cache_raises_kld_above_the_8_bit_one(tiny_model):
    w = Windows(n_tokens=48, window=56, stride=24, chunk=8)
    ref = E.record_reference(tiny_model, IDS, w)
    kld = {b: E.compare_to_reference(tiny_model, ref, cache_factory=lambda b=b: QuantizedKVCache(
        tiny_model.config, KVQuantSpec(b, group_size=8))).mean_kld[0] for b in (2, 8)}
    # an 8-bit cache on a tiny random model moves the logits so little that its mean KLD can come out a rounding
    # error below zero (a CI run: -1.0e-08): non-negative within float32 rounding, and well under the 2-bit one
    assert kld[8] > -1e-6 and kld[2] > 0 and kld[8] < kld[2]


def test_the_quantized_cache_refuses_sliding_window_models_and_bad_specs(tiny_llama):
    from transformers import Qwen2Config
    cfg = Qwen2Config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], use_sliding_window=True,
                      sliding_window=8, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="full attention"):
        QuantizedKVCache(cfg, KVQuantSpec())
    with pytest.raises(TypeError):
        QuantizedKVCache(tiny_llama.config, 4)
    with pytest.raises(ValueError):
        fake_quantize_kv(torch.zeros(2, 3), KVQuantSpec(), "channel")


# --- figures ----------------------------------------------------------------------------------------

def test_kld_distribution_figure_is_a_pure_function_of_its_inputs():
    data = {"a": np.array([0.0, 1e-3, 0.5, -1e-9]), "b": np.array([0.1, 0.2, 0.3, 0.4])}
    fig = E.kld_distribution_figure(data, "a", "b", flips={"right → wrong": ["Q1"], "wrong → right": []})
    assert len(fig.data) == 2 and min(fig.data[0].x) == E.KLD_FLOOR and fig.layout.annotations
    again = E.kld_distribution_figure(data, "a", "b", flips={"right → wrong": ["Q1"], "wrong → right": []})
    assert fig.to_json() == again.to_json()
    with pytest.raises(ValueError):
        E.kld_distribution_figure(data, "a", "c")
    assert len(E.quality_vs_bits_figure({"x": (4.0, 0.1, 0.01)}, title="t").data) == 1
