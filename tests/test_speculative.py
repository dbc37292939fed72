"""Chapter 08: speculative decoding is exact (greedy: the target's own tokens; sampling: the target's
distribution, tested on the real loop), and wrong loops and rules, applied to the real code, fail those tests."""
from __future__ import annotations

import math

import pytest
import torch

from course_utils import speculative as S
from course_utils.reference import compare_tokens, reference_generate
from course_utils.sampling import total_variation

SIGNIFICANCE = 1e-3        # a correct loop fails a distribution test with at most this probability (seeds are fixed)


# --- the formulas --------------------------------------------------------------------------------------

def test_formulas_reproduce_the_reference_cases():
    assert S.predicted_speedup(0.9, 8, 0.1) == pytest.approx(3.40, abs=0.005)
    assert S.predicted_speedup(0.3, 8, 0.1) == pytest.approx(0.79, abs=0.005)
    assert S.expected_tokens_per_pass(1.0, 4) == 5.0                           # the alpha -> 1 limit
    assert S.expected_tokens_per_pass(1 - 1e-9, 4) == pytest.approx(5.0, rel=1e-6)
    assert S.expected_tokens_per_pass(0.0, 4) == 1.0
    assert S.predicted_speedup(0.8, 4, 0.0, v=2.0) == pytest.approx(S.expected_tokens_per_pass(0.8, 4) / 2)
    assert S.position_acceptance_constant_alpha(0.5, 3) == [0.5, 0.25, 0.125]


@pytest.mark.parametrize("call, match", [
    (lambda: S.expected_tokens_per_pass(1.2, 4), "probability"),
    (lambda: S.expected_tokens_per_pass(0.5, 0), "gamma"),
    (lambda: S.predicted_speedup(0.5, 4, -0.1), "c must be"),
    (lambda: S.predicted_speedup(0.5, 4, 0.1, v=0), "v must be"),
])
def test_formulas_reject_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- greedy: the target's own tokens ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def target():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _proposers(target):
    return {"early exit": S.DraftModel(S.early_exit_draft(target, 1), target), "n-gram": S.NgramLookup(),
            "random": S.RandomGuess(128), "the target itself": S.DraftModel(target, target)}


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_speculative_decoding_gives_the_targets_own_tokens(target, gamma):
    prompt = [5, 9, 2, 44, 7, 1, 5, 9]
    ref, gaps = reference_generate(target, prompt, 24)
    for name, proposer in _proposers(target).items():
        result = S.speculative_generate(target, proposer, prompt, 24, gamma)
        agreement = compare_tokens(result.tokens, ref, gaps)
        assert agreement.ok, f"{name}, gamma {gamma}: {agreement}"
        assert result.stats.new_tokens == 23 and len(result.tokens) == 24


def test_acceptance_is_one_for_the_target_and_near_zero_for_random_guesses(target):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    own = S.speculative_generate(target, S.DraftModel(target, target), prompt, 30, 4).stats
    assert own.acceptance == 1.0 and own.tokens_per_pass > 4
    rand = S.speculative_generate(target, S.RandomGuess(128, seed=1), prompt, 30, 4).stats
    assert rand.acceptance < 0.1 and rand.tokens_per_pass < 1.5


def test_stops_at_eos_and_keeps_it(target):
    prompt = [5, 9, 2, 44]
    free, _ = reference_generate(target, prompt, 16)
    stop = free[5]
    ref, _ = reference_generate(target, prompt, 16, eos_token_ids={stop})
    got = S.speculative_generate(target, S.DraftModel(target, target), prompt, 16, 4, eos_token_ids={stop})
    assert got.tokens == ref and got.tokens[-1] == stop


def test_early_exit_draft_shares_weights_and_computes_the_first_layers(target):
    draft = S.early_exit_draft(target, 2)
    assert len(draft.model.layers) == 2
    assert draft.model.layers[1].mlp.up_proj.weight.data_ptr() == target.model.layers[1].mlp.up_proj.weight.data_ptr()
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        h = target(ids, output_hidden_states=True).hidden_states[2]          # after two layers, before the norm
        expected = target.lm_head(target.model.norm(h))
        assert torch.allclose(draft(ids).logits, expected, atol=1e-5)
    with pytest.raises(ValueError, match="below"):
        S.early_exit_draft(target, 3)


def test_ngram_lookup_and_copy_fraction():
    history = [1, 2, 3, 4, 9, 1, 2]
    assert S.ngram_continuation(history, 3) == [3, 4, 9]          # "1 2" seen before, followed by 3 4 9
    assert S.ngram_continuation([7, 8, 9], 2) == []               # nothing repeats
    assert S.ngram_continuation([5, 6, 5], 2, max_ngram=2) == [6, 5]   # falls back to the 1-gram "5"
    assert S.copy_fraction([1, 2, 3, 1, 2], [3, 7]) == 0.5       # 3 was copyable, 7 was not
    with pytest.raises(ValueError, match="empty"):
        S.copy_fraction([1], [])


def test_next_next_head_learns_a_copyable_pattern():
    """On data where the token two ahead is a fixed function of the hidden state, the head learns it."""
    torch.manual_seed(0)
    vocab, d = 16, 8
    lm = torch.randn(vocab, d)
    hidden = torch.randn(2000, d)
    labels = torch.tensor([(int(t) + 3) % vocab for t in (hidden @ lm.T).argmax(-1)])
    head, losses, curve = S.train_next_next_head(hidden, labels, lm, steps=300, batch_size=128, lr=1e-2,
                                                 heldout=(hidden[:64], labels[:64]), eval_every=100)
    assert losses[-1] < 0.5 * losses[0]
    assert [step for step, _, _ in curve] == [0, 100, 200, 300]                  # before, every 100 steps, after
    assert curve[-1][1] < 0.5 * curve[0][1] and curve[-1][2] > curve[0][2]        # held-out loss down, accuracy up
    assert S.head_loss_and_accuracy(head, hidden[:64], labels[:64]) == pytest.approx(curve[-1][1:])
    untrained = S.NextNextHead(lm)
    assert torch.equal(untrained(hidden).argmax(-1), (hidden @ lm.T).argmax(-1))   # starts as the LM head itself


def test_next_next_data_pairs_each_final_hidden_state_with_the_token_two_ahead(target):
    """The pairs come from the model's own final hidden states (its LM head runs on one position only, which
    must not change them) and the token two positions later; each chunk loses its last two positions."""
    ids = torch.arange(1, 23)[None] % 128
    hidden, labels = S.next_next_data(target, ids, chunk_tokens=10)
    full = torch.cat([target(ids[:, s:s + 10], output_hidden_states=True, use_cache=False).hidden_states[-1][0][:-2]
                      for s in (0, 10, 20)])
    assert torch.equal(hidden, full)
    assert torch.equal(labels, torch.cat([ids[0, s + 2:s + 10] for s in (0, 10, 20)]))


def test_head_guess_runs_as_a_proposer(target):
    head = S.NextNextHead(target.lm_head.weight)
    prompt = [5, 9, 2, 44, 7]
    ref, gaps = reference_generate(target, prompt, 12)
    result = S.speculative_generate(target, S.HeadGuess(head), prompt, 12, 1)
    assert compare_tokens(result.tokens, ref, gaps).ok and result.stats.passes >= 6


def test_verification_cost_and_draft_cost_are_measured(target):
    v = S.verification_cost(target, list(range(1, 20)), [1, 4], repeats=2)
    assert set(v) == {1, 4} and all(x > 0 for x in v.values())
    c = S.draft_cost_ratio(S.early_exit_draft(target, 1), target, list(range(1, 20)), repeats=2)
    assert 0 < c


def test_bad_input(target):
    with pytest.raises(ValueError, match="gamma"):
        S.speculative_generate(target, S.NgramLookup(), [1, 2], 4, 0)
    with pytest.raises(ValueError, match="empty"):
        S.speculative_generate(target, S.NgramLookup(), [], 4, 2)
    from transformers import LlamaConfig, LlamaForCausalLM
    other = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    with pytest.raises(ValueError, match="vocabulary"):
        S.DraftModel(other, target)
    with pytest.raises(ValueError, match="vocabulary"):
        S.speculative_sample(target, other, [1, 2], 4, 2)
    with pytest.raises(ValueError, match="temperature"):
        S.speculative_sample(target, target, [1, 2], 4, 2, temperature=-1.0)


# --- sampling: the real loop keeps the target's distribution, and wrong loops and rules are caught -----------
#
# What is tested: `speculative_sample` itself -- two real models, their KV caches and rollbacks -- at T = 1 and at
# T = 0.7 with top-k = 4, with a draft that agrees often (a close copy of the target: most passes keep every guess,
# so the bonus token is drawn often) and one that disagrees often (an unrelated model: many rejections and
# replacements), at γ = 2 and, once, γ = 3 (a draft cache cut back in the middle of a pass). Ten runs of 250 tokens
# (2,500 tokens) per case; every token is ranked in the target's own sampling distribution given everything before
# it, and the ranks of each group of tokens (the j-th token of a pass; the bonus token; SpecStats.token_roles) are
# tested with `rank_fit`: a chi-square statistic on rank counts, chi-square distributed asymptotically (a
# martingale central limit theorem: each token follows its distribution given its past). The case's p-value is
# the smallest group's times the number of groups tested (Bonferroni), compared with SIGNIFICANCE: a correct loop
# fails a case with probability about 1e-3 at most (the seeds are fixed, so a result is repeatable).
# Power: each wrong loop and wrong rule in MUTANTS, applied to the real generator by a monkeypatch, must make the
# same test fail. Checked beyond the fixed seeds: with five other sets of seeds, each mutant was caught in 5 of 5,
# the least-caught with Bonferroni p-values of at most 2e-11 ("q at another temperature"), 3e-15 ("resample from
# p") and 5e-88 ("bonus from the draft's q"); the right loop's smallest over twenty cases was 5e-3. Where a
# mutant's distribution is close to the target's the test has little power: a bonus drawn from the *close*
# draft's q (T = 1) gave 6e-4 to 6e-2 over six sets of seeds, so that mutant is run with the far draft.
# "target's p without top-k" is caught by tokens of probability zero (`impossible`), before any chi-square.

SAMPLING_VOCAB = 8
SPEC_RUNS, SPEC_TOKENS, SPEC_GAMMA = 10, 250, 2


@pytest.fixture(scope="module")
def sampling_models():
    """A target with 8 tokens and peaked distributions (large random weights), a close copy of it and an unrelated
    model, each one small llama layer."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    def make(seed):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=SAMPLING_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                          initializer_range=0.3)
        return LlamaForCausalLM(cfg).eval()
    target = make(0)
    close = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in close.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return {"target": target, "close": close, "far": make(7)}


def _sampled_runs(models, draft, temperature, top_k, seed, gamma=SPEC_GAMMA):
    runs = []
    for s in range(seed * SPEC_RUNS, (seed + 1) * SPEC_RUNS):
        prompt = [s % SAMPLING_VOCAB, (3 * s + 1) % SAMPLING_VOCAB]
        runs.append((prompt, S.speculative_sample(models["target"], models[draft], prompt, SPEC_TOKENS, gamma,
                                                  temperature=temperature, top_k=top_k, seed=s)))
    return runs


def _bonferroni(fit) -> float:
    tested = [g["p_value"] for g in fit.values() if not math.isnan(g["p_value"])]
    return min(1.0, min(tested) * len(tested))


CASES = {"T=1, close draft": (1.0, 0, "close"), "T=1, far draft": (1.0, 0, "far"),
         "T=0.7 top-k 4, close draft": (0.7, 4, "close"), "T=0.7 top-k 4, far draft": (0.7, 4, "far")}


@pytest.mark.parametrize("case, seed, gamma", [(c, 0, SPEC_GAMMA) for c in CASES] + [
    ("T=1, close draft", 1, SPEC_GAMMA), ("T=0.7 top-k 4, far draft", 2, SPEC_GAMMA), ("T=1, close draft", 3, 3)])
def test_speculative_sample_follows_the_targets_distribution(sampling_models, case, seed, gamma):
    temperature, top_k, draft = CASES[case]
    runs = _sampled_runs(sampling_models, draft, temperature, top_k, seed, gamma)
    fit = S.sampling_fit(sampling_models["target"], runs, temperature, top_k)
    assert fit["bonus"]["n"] >= 40 and fit["position 1"]["n"] >= 400   # the bonus token and the rule both ran
    assert sum(r.stats.passes - r.stats.full_passes for _, r in runs) >= 100   # ... and rejections happened
    assert all(g["impossible"] == 0 for g in fit.values()), "a token outside the target's top-k came out"
    assert _bonferroni(fit) > SIGNIFICANCE, {k: (g["n"], g["p_value"]) for k, g in fit.items()}


_STEP, _PROBS, _DRAFT = S.speculative_sample_step, S.sampling_probs, S.draft_guesses


def _draft_one_step_further(draft, cache, history, k, temperature, top_k, generator):
    """The draft's part as the loop runs it, one step further: k guesses, and q at every position up to the bonus's."""
    guesses, qs = _DRAFT(draft, cache, history, k + 1, temperature, top_k, generator)
    return guesses[:k], qs


def _one_hot_argmax(p):
    return torch.nn.functional.one_hot(p.argmax(), p.shape[0]).to(p.dtype)


def _at_other_temperature(q, factor=2.0):
    """The draft's distribution at `factor` times the temperature its guess was drawn at (q ∝ exp(l / T))."""
    x = q.double() ** (1 / factor)
    return (x / x.sum()).to(q.dtype)


# name: (the case that must catch it, {attribute of course_utils.speculative: its wrong replacement})
MUTANTS = {
    # the verification pass's logits are (guesses + 1, vocab); the draft's one row: only the target loses top-k
    "target's p without top-k": ("T=0.7 top-k 4, close draft", {
        "sampling_probs": lambda logits, t=1.0, k=0: _PROBS(logits, t, 0 if logits.dim() == 2 else k)}),
    "rule given q at another temperature": ("T=1, close draft", {
        "speculative_sample_step": lambda ps, qs, g, gen: _STEP(ps, [_at_other_temperature(q) for q in qs], g, gen)}),
    "bonus token drawn from the draft's q": ("T=1, far draft", {
        "draft_guesses": _draft_one_step_further,     # the draft's q after the last guess, where the bonus goes
        "speculative_sample_step": lambda ps, qs, g, gen: _STEP(ps[:-1] + [qs[len(g)]], qs[:len(g)], g, gen)}),
    "bonus token the argmax of p": ("T=1, close draft", {
        "speculative_sample_step": lambda ps, qs, g, gen: _STEP(ps[:-1] + [_one_hot_argmax(ps[-1])], qs, g, gen)}),
    "rule: always accept": ("T=1, far draft", {
        "acceptance_probability": lambda p, q, g: torch.ones(len(g), dtype=torch.float64)}),
    "rule: on rejection resample from p": ("T=1, far draft", {
        "residual_distribution": lambda p, q: p.double()}),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_each_wrong_loop_and_rule_fails_the_distribution_test(sampling_models, monkeypatch, mutant):
    case, patch = MUTANTS[mutant]
    temperature, top_k, draft = CASES[case]
    with monkeypatch.context() as m:                  # the real generator, with one part replaced by a wrong one
        for name, wrong in patch.items():
            m.setattr(S, name, wrong)
        runs = _sampled_runs(sampling_models, draft, temperature, top_k, 0)
    fit = S.sampling_fit(sampling_models["target"], runs, temperature, top_k)   # checked with the right parts
    assert _bonferroni(fit) < SIGNIFICANCE, f"{mutant} passed: {({k: g['p_value'] for k, g in fit.items()})}"


def test_the_rule_has_one_implementation(monkeypatch):
    """A wrong acceptance probability reaches the one-guess rule, the vectorised draws and the model loop's step."""
    p, q = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 0.5, 0.5])
    gen = torch.Generator().manual_seed(0)
    assert S.modified_rejection(p, q, 1, gen) == (False, 0)            # p(1) = 0: always rejected, replaced by 0
    monkeypatch.setattr(S, "acceptance_probability", lambda p, q, g: torch.ones(len(g), dtype=torch.float64))
    assert S.modified_rejection(p, q, 1, gen) == (True, 1)
    tokens, accepted = S.modified_rejection_draws(p, q, 50, gen)
    assert bool(accepted.all()) and set(tokens.tolist()) <= {1, 2}
    assert S.speculative_sample_step([p, p, p], [q, q], [1, 2], gen)[:2] == [1, 2]


def test_one_step_acceptance_is_one_minus_total_variation():
    gen = torch.Generator().manual_seed(3)
    p, q = (torch.softmax(torch.randn(6, generator=gen) * 1.5, -1) for _ in range(2))
    accepted = sum(S.modified_rejection(p, q, S.sample_token(q, gen), gen)[0] for _ in range(20000)) / 20000
    assert accepted == pytest.approx(1 - total_variation(p, q), abs=0.015)


def test_speculative_sampling_at_temperature_zero_is_greedy_and_reaches_the_bonus(sampling_models):
    target = sampling_models["target"]
    for prompt in ([0, 1], [3, 5, 2], [7]):
        ref, gaps = reference_generate(target, prompt, 40)
        got = S.speculative_sample(target, sampling_models["close"], prompt, 40, 3, temperature=0.0)
        assert compare_tokens(got.tokens, ref, gaps).ok
        assert got.stats.full_passes > 0 and got.stats.full_passes < got.stats.passes   # bonus and rejections ran


def test_speculative_sampling_runs_with_top_k(target):
    got = S.speculative_sample(target, S.early_exit_draft(target, 1), [5, 9, 2], 10, 3, temperature=0.8, top_k=5,
                               seed=1)
    again = S.speculative_sample(target, S.early_exit_draft(target, 1), [5, 9, 2], 10, 3, temperature=0.8, top_k=5,
                                 seed=1)
    assert len(got.tokens) == 10 and got.tokens == again.tokens and 0 <= got.stats.acceptance <= 1
    assert not math.isnan(got.stats.tokens_per_pass)
    assert [n for _, _, n in got.stats.per_pass] and sum(n for _, _, n in got.stats.per_pass) == 9


def test_vectorised_draws_follow_p_and_accept_one_minus_tv():
    gen = torch.Generator().manual_seed(4)
    p, q = (torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64) * 1.5, -1) for _ in range(2))
    tokens, accepted = S.modified_rejection_draws(p, q, 40000, gen)
    fit = S.rank_fit(p, tokens)
    assert fit["p_value"] > SIGNIFICANCE and fit["df"] == 5
    assert float(accepted.double().mean()) == pytest.approx(1 - total_variation(p, q), abs=0.01)
    wrong = torch.multinomial(q, 40000, replacement=True, generator=gen)
    assert S.rank_fit(p, wrong)["p_value"] < SIGNIFICANCE     # the draft's own draws told apart


def test_rank_fit_flags_impossible_tokens_and_bad_shapes():
    p = torch.tensor([[0.5, 0.5, 0.0]]).expand(100, -1)
    assert S.rank_fit(p, torch.tensor([0, 1] * 49 + [2, 2]))["impossible"] == 2
    assert S.rank_fit(p, torch.tensor([0, 1] * 49 + [2, 2]))["p_value"] == 0.0
    with pytest.raises(ValueError, match="one distribution per token"):
        S.rank_fit(p, torch.tensor([0, 1]))
    shared = S.rank_fit(p[0], torch.tensor([0, 1] * 50))           # one distribution for all: the same test
    assert shared["p_value"] == pytest.approx(S.rank_fit(p, torch.tensor([0, 1] * 50))["p_value"])
    assert shared["observed"] == [50.0, 50.0] and shared["p_value"] == pytest.approx(1.0)


def test_token_roles_mark_each_pass_and_its_bonus():
    stats = S.SpecStats(2)
    stats.record(2, 2, 3)          # both guesses kept, then the bonus
    stats.record(2, 0, 1)          # the first guess rejected: its replacement
    stats.record(0, 0, 1)          # no guess at all (the run's last token)
    assert stats.token_roles() == ["prefill", "position 1", "position 2", "bonus", "position 1", "no guess"]
    assert stats.full_passes == 1
    assert stats.reached == [2, 1] and stats.accepted == [1, 1]      # guess 2 is checked only after guess 1 is kept
    assert stats.acceptance_checked == pytest.approx(2 / 3) and stats.acceptance == pytest.approx(2 / 4)
    assert stats.conditional_acceptance == [0.5, 1.0]


def test_lookup_prompt_ids_follow_each_prompts_kind(embedded):
    _, tok = embedded
    from course_utils.prompts import chat_prompt_ids, token_ids
    items = {i["kind"]: i for i in S.lookup_prompts()}
    assert S.lookup_prompt_ids(tok, items["chat"]) == chat_prompt_ids(tok, items["chat"]["text"])
    assert S.lookup_prompt_ids(tok, items["raw"]) == token_ids(tok, items["raw"]["text"])[0].tolist()
    with pytest.raises(ValueError, match="kind"):
        S.lookup_prompt_ids(tok, dict(items["raw"], kind="other"))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_draft_shares_all_but_its_packed_matrices_and_stays_close(target, kind):
    draft = S.quantized_draft(target, kind)
    assert draft.model.embed_tokens.weight is target.model.embed_tokens.weight          # shared, not copied
    assert not any(isinstance(m, torch.nn.Linear) for m in draft.modules())            # every matrix is packed
    ids = torch.tensor([[5, 9, 2, 44, 7, 1]])
    with torch.no_grad():
        ref, got = target(ids).logits, draft(ids).logits
    rel = float((got - ref).norm() / ref.norm())
    assert 0 < rel < (0.05 if kind == "int8" else 0.3), rel                            # lossy, but close
    prompt = [5, 9, 2, 44, 7, 1, 5, 9]
    ref_tokens, gaps = reference_generate(target, prompt, 16)
    got = S.speculative_generate(target, S.DraftModel(draft, target), prompt, 16, 3)
    assert compare_tokens(got.tokens, ref_tokens, gaps).ok                              # still the target's tokens
    with pytest.raises(ValueError, match="kind must be one of"):
        S.quantized_draft(target, "int3")
