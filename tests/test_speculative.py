"""Chapter 08: speculative decoding is exact (greedy: the target's own tokens; sampling: the target's
distribution), and the tests can catch wrong acceptance rules."""
from __future__ import annotations

import math

import pytest
import torch

from course_utils import speculative as S
from course_utils.reference import compare_tokens, reference_generate
from course_utils.sampling import total_variation

SIGNIFICANCE = 1e-3        # a correct rule fails the distribution test with this probability (seeds are fixed)


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
    head, losses = S.train_next_next_head(hidden, labels, lm, steps=300, batch_size=128, lr=1e-2)
    assert losses[-1] < 0.5 * losses[0]
    untrained = S.NextNextHead(lm)
    assert torch.equal(untrained(hidden).argmax(-1), (hidden @ lm.T).argmax(-1))   # starts as the LM head itself


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


# --- sampling: the target's distribution, and wrong rules caught -------------------------------------------

def _always_accept(p, q, guess, generator):
    return True, guess


def _resample_from_p(p, q, guess, generator):
    """Accept with min(1, p/q), but on rejection draw from p itself instead of the residual max(0, p - q)."""
    u = torch.rand((), generator=generator).item()
    if u * q[guess] < p[guess]:
        return True, guess
    return False, S.sample_token(p, generator)


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi² >= observed) for counts against expected probabilities (cells with zero probability must be empty)."""
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of zero probability came out"
    expected = n * probs[keep]
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def _toy_tables(vocab=6, seed=0):
    """Context-dependent target and draft distributions: row = previous token."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(vocab, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(vocab, vocab, generator=g) * 1.5, -1)
    return p, q


def _first_two_tokens(rule, n_samples, gamma=2, seed=0):
    """Run speculative sampling on the toy tables from token 0 until two tokens exist; count the pairs."""
    p, q = _toy_tables()
    vocab = p.shape[0]
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for _ in range(n_samples):
        out, prev = [], 0
        while len(out) < 2:
            guesses, qs, ps, last = [], [], [p[prev]], prev
            for _ in range(gamma):
                qs.append(q[last])
                guesses.append(S.sample_token(q[last], gen))
                last = guesses[-1]
                ps.append(p[last])
            kept = S.speculative_sample_step(ps, qs, guesses, gen, rule=rule)
            out += kept
            prev = out[-1]
        counts[out[0] * vocab + out[1]] += 1
    joint = (p[0][:, None] * p).flatten()              # P(a | 0) P(b | a)
    return counts, joint


def test_speculative_sampling_keeps_the_targets_distribution():
    counts, joint = _first_two_tokens(S.modified_rejection, 12000)
    assert _chi_square_p_value(counts, joint) > SIGNIFICANCE


@pytest.mark.parametrize("rule", [_always_accept, _resample_from_p], ids=["always accept", "resample from p"])
def test_the_distribution_test_catches_wrong_rules(rule):
    counts, joint = _first_two_tokens(rule, 12000)
    assert _chi_square_p_value(counts, joint) < SIGNIFICANCE, "the test could not tell this rule from the right one"


def test_one_step_acceptance_is_one_minus_total_variation():
    p, q = _toy_tables()
    p, q = p[0], q[0]
    gen = torch.Generator().manual_seed(3)
    accepted = sum(S.modified_rejection(p, q, S.sample_token(q, gen), gen)[0] for _ in range(20000)) / 20000
    assert accepted == pytest.approx(1 - total_variation(p, q), abs=0.015)


def test_speculative_sampling_at_temperature_zero_is_greedy(target):
    prompt = [5, 9, 2, 44, 7]
    ref, gaps = reference_generate(target, prompt, 16)
    got = S.speculative_sample(target, S.early_exit_draft(target, 1), prompt, 16, 3, temperature=0.0)
    assert compare_tokens(got.tokens, ref, gaps).ok


def test_speculative_sampling_runs_with_top_k(target):
    got = S.speculative_sample(target, S.early_exit_draft(target, 1), [5, 9, 2], 10, 3, temperature=0.8, top_k=5,
                               seed=1)
    again = S.speculative_sample(target, S.early_exit_draft(target, 1), [5, 9, 2], 10, 3, temperature=0.8, top_k=5,
                                 seed=1)
    assert len(got.tokens) == 10 and got.tokens == again.tokens and 0 <= got.stats.acceptance <= 1
    assert not math.isnan(got.stats.tokens_per_pass)


def test_vectorised_draws_follow_p_and_accept_one_minus_tv():
    p, q = _toy_tables()
    p, q = p[2].double(), q[2].double()
    gen = torch.Generator().manual_seed(4)
    tokens, accepted = S.modified_rejection_draws(p, q, 40000, gen)
    counts = torch.bincount(tokens, minlength=p.shape[0]).double()
    assert _chi_square_p_value(counts, p) > SIGNIFICANCE
    assert float(accepted.double().mean()) == pytest.approx(1 - total_variation(p, q), abs=0.01)
    wrong = torch.bincount(torch.multinomial(q, 40000, replacement=True, generator=gen), minlength=p.shape[0])
    assert _chi_square_p_value(wrong.double(), p) < SIGNIFICANCE            # the draft's own draws are told apart


def test_lookup_prompt_ids_follow_each_prompts_kind(embedded):
    _, tok = embedded
    from course_utils.prompts import chat_prompt_ids, token_ids
    items = {i["kind"]: i for i in S.lookup_prompts()}
    assert S.lookup_prompt_ids(tok, items["chat"]) == chat_prompt_ids(tok, items["chat"]["text"])
    assert S.lookup_prompt_ids(tok, items["raw"]) == token_ids(tok, items["raw"]["text"])[0].tolist()
    with pytest.raises(ValueError, match="kind"):
        S.lookup_prompt_ids(tok, dict(items["raw"], kind="other"))
