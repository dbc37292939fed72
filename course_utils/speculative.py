"""Chapter 08 -- speculative decoding: a cheap proposer guesses, the target checks all guesses in one pass.

A decode step of the target reads all its weights to produce one token (chapter 02); a
forward pass over a few tokens costs little more. So let something cheap *propose* γ
tokens, and let the target *verify* them in one pass over ``[current token, d1 ... dγ]``:
its logits at every position say what it would have produced there. The phases, named as
gpt-fast names them:

* :func:`course_utils.kv_cache.prefill` -- the prompt into the target's cache;
* ``proposer.propose(tokens, k)`` -- up to k guesses (:class:`DraftModel`, e.g. an :func:`early_exit_draft`;
  :class:`NgramLookup`; :class:`RandomGuess`; :class:`HeadGuess` with a trained :class:`NextNextHead`);
* :func:`verify` -- one target pass over the current token and the guesses;
* acceptance -- greedy: keep the guesses up to the first one the target disagrees with, then
  the target's own token there (:func:`accepted_prefix`); sampling: the modified rejection
  rule (:func:`modified_rejection`), which keeps the target's distribution exactly;
* :func:`truncate_cache` -- roll the caches back to what was accepted.

Greedy speculative decoding returns the target's own greedy tokens: every token that is
kept is one the target chose. :func:`speculative_generate` does the greedy loop and
:func:`speculative_sample` the sampling one; both record :class:`SpecStats` (acceptance per
draft position, tokens per verification pass). :func:`expected_tokens_per_pass` and
:func:`predicted_speedup` are the textbook formulas, with the verification cost ``v(γ)`` the
textbook sets to 1 as a parameter (it is measured by :func:`verification_cost`).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache

from .hooks import decoder_layers
from .kv_cache import prefill
from .measure import time_interleaved
from .prompts import chat_prompt_ids, token_ids
from .sampling import check_sampling, sample_token, sampling_probs
from .validation import check_finite, check_positive_int

# --- the formulas ---------------------------------------------------------------------------------


def _check_alpha_gamma(alpha: float, gamma: int) -> None:
    check_finite("alpha", alpha, minimum=0.0)
    if alpha > 1:
        raise ValueError(f"alpha is a probability: it must lie in [0, 1], got {alpha!r}")
    check_positive_int("gamma", gamma)


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    """E = (1 − α^(γ+1)) / (1 − α): tokens one verification pass yields when each guess is accepted with
    probability α independently (Leviathan et al. 2023). The α → 1 limit is γ + 1 (every guess and the bonus)."""
    _check_alpha_gamma(alpha, gamma)
    if alpha == 1:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, gamma: int, c: float, v: float = 1.0) -> float:
    """Tokens per unit of target time: E / (γ·c + v).

    ``c``: one proposal's cost as a fraction of a target decode step; ``v``: a verification pass over
    γ + 1 tokens in target decode steps. The textbook takes v = 1; on a CPU it is measured
    (:func:`verification_cost`).
    """
    check_finite("c", c, minimum=0.0)
    check_finite("v", v, minimum=0.0, strict=True)
    return expected_tokens_per_pass(alpha, gamma) / (gamma * c + v)


def position_acceptance_constant_alpha(alpha: float, gamma: int) -> list[float]:
    """Under the textbook's constant α: the share of passes whose i-th guess is accepted, α^i, i = 1..γ."""
    _check_alpha_gamma(alpha, gamma)
    return [alpha ** i for i in range(1, gamma + 1)]


# --- statistics -------------------------------------------------------------------------------------


@dataclass
class SpecStats:
    """What a speculative run did. ``proposed[i]`` / ``accepted[i]``: passes in which a guess at draft
    position i (0-based) was made / kept. ``passes``: verification passes; ``new_tokens``: tokens those passes
    produced (the prefill's first token aside); ``propose_s`` / ``verify_s``: seconds spent in each phase."""

    gamma: int
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    passes: int = 0
    new_tokens: int = 0
    propose_s: float = 0.0
    verify_s: float = 0.0

    def __post_init__(self):
        self.proposed = self.proposed or [0] * self.gamma
        self.accepted = self.accepted or [0] * self.gamma

    def record(self, n_proposed: int, n_accepted: int, n_new: int) -> None:
        for i in range(n_proposed):
            self.proposed[i] += 1
            self.accepted[i] += i < n_accepted
        self.passes += 1
        self.new_tokens += n_new

    @property
    def acceptance(self) -> float:
        """α measured: accepted guesses / guesses made (NaN if none was made)."""
        made = sum(self.proposed)
        return sum(self.accepted) / made if made else math.nan

    @property
    def conditional_acceptance(self) -> list[float]:
        """Per draft position i: accepted at i / proposed at i, among passes that reached position i
        (a guess at i is only checked when guesses 0..i−1 were accepted)."""
        reached = [self.proposed[0]] + self.accepted[:-1]
        return [a / r if r else math.nan for a, r in zip(self.accepted, reached)]

    @property
    def position_acceptance(self) -> list[float]:
        """Per draft position i: the share of passes (with a guess there) whose guess i was kept."""
        return [a / p if p else math.nan for a, p in zip(self.accepted, self.proposed)]

    @property
    def tokens_per_pass(self) -> float:
        """Tokens one verification pass yielded on average: accepted guesses plus the target's own token."""
        return self.new_tokens / self.passes if self.passes else math.nan


@dataclass
class SpecResult:
    """New token ids (prompt excluded), the run's statistics and its wall time (seconds)."""

    tokens: list[int]
    stats: SpecStats
    seconds: float


# --- proposers ----------------------------------------------------------------------------------------


class Proposer:
    """Something that guesses the next tokens. ``propose(tokens, k)`` returns at most ``k`` guesses to follow
    ``tokens`` (the prompt and everything produced so far); ``rollback(n)`` says that from now on only the first
    ``n`` tokens of that history are valid (the rest were rejected). ``needs_hidden``: the proposer reads the
    target's last hidden state, handed over with :meth:`observe_hidden` after every target pass."""

    name = "proposer"
    needs_hidden = False

    def propose(self, tokens: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def rollback(self, n_tokens: int) -> None:
        """Forget everything after the first ``n_tokens`` tokens (nothing to forget by default)."""

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        """The target's final hidden state (d_model,) at the position whose next token was just decided."""

    def reset(self) -> None:
        """Forget the previous request."""


def truncate_cache(cache: DynamicCache, n_tokens: int) -> None:
    """Keep the first ``n_tokens`` positions of a transformers cache (roll back rejected guesses)."""
    extra = cache.get_seq_length() - n_tokens
    if extra < 0:
        raise ValueError(f"the cache holds {cache.get_seq_length()} positions; cannot keep {n_tokens}")
    cache.crop(-extra)


def _vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


class DraftModel(Proposer):
    """A smaller causal LM with the target's vocabulary proposes greedily, with its own KV cache.

    It feeds what it has not seen yet (the accepted tokens of the last pass), then one guess at a time;
    :meth:`rollback` crops its cache back to the accepted history.
    """

    def __init__(self, draft, target=None, *, name: str = "draft model"):
        if target is not None and _vocab_size(draft) != _vocab_size(target):
            raise ValueError(f"the draft's vocabulary ({_vocab_size(draft)} tokens) differs from the target's "
                             f"({_vocab_size(target)}): its guesses would name other tokens")
        self.model, self.name = draft, name
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)

    @torch.no_grad()
    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k < 1:
            return []
        seen = self.cache.get_seq_length()
        feed = torch.tensor([tokens[seen:]], device=self.model.device)
        guesses = []
        for i in range(k):
            logits = self.model(feed, cache=self.cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            guesses.append(int(logits.argmax()))
            if i + 1 < k:
                feed = torch.tensor([[guesses[-1]]], device=self.model.device)
        return guesses

    def rollback(self, n_tokens: int) -> None:
        truncate_cache(self.cache, min(n_tokens, self.cache.get_seq_length()))


def early_exit_draft(model, n_layers: int):
    """The target's first ``n_layers`` decoder layers, then its final norm and its own LM head: a draft that
    shares every weight with the target (no copy) and costs about ``n_layers / L`` of its layers.

    Untrained: the LM head was only ever trained to read the *last* layer's output, so its guesses are those of
    a model never taught to stop early (LayerSkip and self-speculative decoding train for it; this does not).
    """
    layers = decoder_layers(model)
    check_positive_int("n_layers", n_layers)
    if n_layers >= len(layers):
        raise ValueError(f"n_layers must be below the model's {len(layers)} layers, got {n_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_layers]
    with torch.device("meta"):
        draft = type(model)(config)
    dropped = tuple(f"{prefix}.{i}." for prefix in _layer_prefixes(model) for i in range(n_layers, len(layers)))
    keep = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.startswith(dropped)}
    draft.load_state_dict(keep, assign=True, strict=False)      # the target's own tensors: shared, not copied
    missing = [n for n, p in draft.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"could not share these weights with the target: {missing[:3]}")
    for name, buf in list(draft.named_buffers()):               # non-persistent buffers (rotary frequencies)
        if buf.is_meta:
            owner, _, attr = name.rpartition(".")
            module = draft.get_submodule(owner) if owner else draft
            module.register_buffer(attr, model.get_buffer(name), persistent=False)
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.eval()


def _layer_prefixes(model) -> list[str]:
    layers = decoder_layers(model)
    return [name for name, module in model.named_modules() if module is layers]


class NgramLookup(Proposer):
    """Prompt lookup: find the latest ``n``-gram of the history earlier in the history, propose what followed it.

    The rule of transformers' ``prompt_lookup_num_tokens`` (``PromptLookupCandidateGenerator``): try n-grams
    from ``max_ngram`` down to 1; take the first (leftmost) earlier occurrence that has a continuation; propose
    up to k tokens of it. No model at all: it pays wherever the output copies its input.
    """

    def __init__(self, max_ngram: int = 2, *, name: str = "n-gram lookup"):
        self.max_ngram = check_positive_int("max_ngram", max_ngram)
        self.name = name

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return ngram_continuation(tokens, k, self.max_ngram)


def ngram_continuation(tokens: list[int], k: int, max_ngram: int = 2) -> list[int]:
    """What :class:`NgramLookup` proposes after ``tokens``: up to ``k`` tokens, possibly none."""
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(0, n_tokens - n):
            if tokens[start:start + n] == tail:
                follow = tokens[start + n:min(start + n + k, n_tokens)]
                if follow:
                    return follow
    return []


def lookup_prompts() -> list[dict]:
    """Chapter 08's shipped n-gram-lookup prompts (``course_utils/data/lookup_prompts.json``): name, kind
    (``"chat"``: through the chat template; ``"raw"``: plain text to continue), text, max_new_tokens."""
    import json

    from .data import DATA_DIR
    return json.loads((DATA_DIR / "lookup_prompts.json").read_text(encoding="utf-8"))["prompts"]


def lookup_prompt_ids(tok, item: dict) -> list[int]:
    """The token ids of one of :func:`lookup_prompts`: through the chat template for ``"chat"`` prompts, the plain
    text for ``"raw"`` ones."""
    if item.get("kind") not in ("chat", "raw"):
        raise ValueError(f"a lookup prompt's kind is 'chat' or 'raw', got {item.get('kind')!r}")
    return chat_prompt_ids(tok, item["text"]) if item["kind"] == "chat" else token_ids(tok, item["text"])[0].tolist()


def copy_fraction(prompt: list[int], output: list[int], max_ngram: int = 2) -> float:
    """The share of ``output`` tokens that n-gram lookup would have guessed right as its first guess, given
    everything before them: the part of the answer that copies what came before it."""
    if not output:
        raise ValueError("the output is empty")
    history, hits = list(prompt), 0
    for token in output:
        hits += ngram_continuation(history, 1, max_ngram) == [token]
        history.append(token)
    return hits / len(output)


class RandomGuess(Proposer):
    """Uniformly random tokens: a proposer that is almost never right (α ≈ 1 / vocabulary)."""

    def __init__(self, vocab_size: int, seed: int = 0, *, name: str = "random tokens"):
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        self.seed, self.name = seed, name
        self.reset()

    def reset(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return torch.randint(0, self.vocab_size, (max(k, 0),), generator=self.generator).tolist()


# --- a trained extra-token head (Medusa-style) ------------------------------------------------------------


class NextNextHead(torch.nn.Module):
    """A Medusa-style head (Cai et al. 2024): from the target's final hidden state at position t, the token at t + 2.

    One residual block, ``h + SiLU(W h)``, then the target's own LM head, frozen and shared (not copied):
    only ``W`` (d_model²) is trained. ``W`` starts at zero, so the untrained head repeats the target's own
    next-token guess. DeepSeek-V3's MTP modules differ: they combine the hidden state at t with the
    *embedding of token t + 1* and pass both through a whole transformer block, so they know which token
    came next; this head must guess t + 2 without knowing t + 1.
    """

    def __init__(self, lm_head_weight: torch.Tensor):
        super().__init__()
        d = lm_head_weight.shape[1]
        self.proj = torch.nn.Linear(d, d, bias=False)
        torch.nn.init.zeros_(self.proj.weight)
        self.lm_head_weight = lm_head_weight.detach()          # frozen: a plain tensor, not a parameter

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` (..., d_model) -> logits (..., vocab) for the token two positions ahead."""
        h = hidden + torch.nn.functional.silu(self.proj(hidden))
        return h @ self.lm_head_weight.T


@torch.no_grad()
def next_next_data(model, token_ids: torch.Tensor, *, chunk_tokens: int = 256, progress: bool = False):
    """Training pairs for :class:`NextNextHead`, computed once with the frozen model: the final hidden state at
    every position t of ``token_ids`` (1, n) and the token at t + 2. Chunks are independent (no cache between
    them), so each chunk loses its last two positions. Returns ``(hidden (m, d_model) float32, labels (m,))``."""
    from .progress import progress_bar
    if token_ids.dim() != 2 or token_ids.shape[0] != 1:
        raise ValueError(f"token_ids must be (1, n_tokens), got {tuple(token_ids.shape)}")
    check_positive_int("chunk_tokens", chunk_tokens)
    if chunk_tokens < 3:
        raise ValueError("chunk_tokens must be at least 3 (a position and the token two ahead)")
    hidden, labels = [], []
    starts = range(0, token_ids.shape[1] - 2, chunk_tokens)
    for s in progress_bar(starts, "hidden states", enabled=progress):
        ids = token_ids[:, s:s + chunk_tokens].to(model.device)
        if ids.shape[1] < 3:
            continue
        h = model(ids, output_hidden_states=True, use_cache=False).hidden_states[-1][0]
        hidden.append(h[:-2].float().cpu())
        labels.append(ids[0, 2:].cpu())
    return torch.cat(hidden), torch.cat(labels)


def train_next_next_head(hidden: torch.Tensor, labels: torch.Tensor, lm_head_weight: torch.Tensor, *,
                         steps: int = 200, batch_size: int = 256, lr: float = 1e-3, seed: int = 0,
                         time_budget_s: float | None = None, progress: bool = False):
    """Train a :class:`NextNextHead` with cross-entropy on (hidden state at t, token at t + 2) pairs.

    Adam on the head's one matrix; the LM head stays frozen. Stops after ``steps`` steps or when
    ``time_budget_s`` seconds have passed. Returns ``(head, losses)``: the training loss at every step.
    """
    from .progress import progress_bar
    check_positive_int("steps", steps)
    check_positive_int("batch_size", batch_size)
    if hidden.shape[0] != labels.shape[0] or hidden.dim() != 2:
        raise ValueError("need one label per hidden state: hidden (n, d_model), labels (n,)")
    torch.manual_seed(seed)
    head = NextNextHead(lm_head_weight.float().cpu())
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses, t0 = [], time.perf_counter()
    with torch.enable_grad():
        for _ in progress_bar(range(steps), "training the head", enabled=progress):
            idx = torch.randint(0, hidden.shape[0], (batch_size,), generator=gen)
            loss = torch.nn.functional.cross_entropy(head(hidden[idx]), labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                break
    return head.eval(), losses


class HeadGuess(Proposer):
    """Proposes one token with a :class:`NextNextHead` from the target's last hidden state (no draft model)."""

    needs_hidden = True

    def __init__(self, head: NextNextHead, *, name: str = "next-next head"):
        self.head, self.name = head, name
        self.hidden = None

    def reset(self) -> None:
        self.hidden = None

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden

    @torch.no_grad()
    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k < 1 or self.hidden is None:
            return []
        return [int(self.head(self.hidden.float().cpu()).argmax())]


# --- verification -------------------------------------------------------------------------------------


@torch.no_grad()
def verify(target, cache: DynamicCache, tokens: list[int], *, hidden: bool = False):
    """One target pass over ``tokens`` (the current token, then the guesses) against ``cache``.

    Returns the logits at every position, (len(tokens), vocab) float32, and the final hidden states
    (len(tokens), d_model) when ``hidden`` (else None). The cache grows by ``len(tokens)`` positions.
    """
    ids = torch.tensor([tokens], device=target.device)
    out = target(ids, cache=cache, use_cache=True, output_hidden_states=hidden)
    return out.logits[0].float(), (out.hidden_states[-1][0] if hidden else None)


def accepted_prefix(guesses: list[int], target_tokens: list[int]) -> int:
    """Greedy acceptance: how many leading guesses equal the target's own choice at their position.

    ``target_tokens[i]`` is the target's greedy token after the current token and guesses 0..i−1
    (``len(guesses) + 1`` of them: one more than there are guesses).
    """
    if len(target_tokens) != len(guesses) + 1:
        raise ValueError(f"need one target token per guess plus one, got {len(target_tokens)} for {len(guesses)}")
    n = 0
    while n < len(guesses) and guesses[n] == target_tokens[n]:
        n += 1
    return n


def _check_run(target, prompt_ids, max_new_tokens: int, gamma: int) -> list[int]:
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.flatten().tolist()
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    check_positive_int("max_new_tokens", max_new_tokens)
    check_positive_int("gamma", gamma)
    return list(prompt_ids)


def _stop_at_eos(new: list[int], eos_token_ids) -> tuple[list[int], bool]:
    for i, t in enumerate(new):
        if t in eos_token_ids:
            return new[:i + 1], True
    return new, False


@torch.no_grad()
def speculative_generate(target, proposer: Proposer, prompt_ids, max_new_tokens: int, gamma: int, *,
                         eos_token_ids=()) -> SpecResult:
    """Greedy speculative decoding: the target's own greedy tokens, produced by verifying γ guesses per pass.

    Stops after ``max_new_tokens`` tokens or at a token of ``eos_token_ids`` (kept, as ``generate`` keeps it).
    """
    tokens = _check_run(target, prompt_ids, max_new_tokens, gamma)
    proposer.reset()
    stats, t0 = SpecStats(gamma), time.perf_counter()
    cache = DynamicCache(config=target.config)
    need_h = proposer.needs_hidden
    out = target(torch.tensor([tokens], device=target.device), cache=cache, use_cache=True, logits_to_keep=1,
                 output_hidden_states=need_h)
    if need_h:
        proposer.observe_hidden(out.hidden_states[-1][0, -1])
    new = [int(out.logits[0, -1].argmax())]
    done = new[0] in eos_token_ids
    while len(new) < max_new_tokens and not done:
        history = tokens + new                                  # the last token is not in the target's cache yet
        t1 = time.perf_counter()
        guesses = proposer.propose(history, min(gamma, max_new_tokens - len(new) - 1))
        t2 = time.perf_counter()
        logits, hidden = verify(target, cache, [new[-1]] + guesses, hidden=need_h)
        stats.verify_s += time.perf_counter() - t2
        stats.propose_s += t2 - t1
        target_tokens = logits.argmax(-1).tolist()
        n_ok = accepted_prefix(guesses, target_tokens)
        kept, done = _stop_at_eos(guesses[:n_ok] + [target_tokens[n_ok]], eos_token_ids)
        truncate_cache(cache, len(history) + n_ok)             # the current token and the accepted guesses
        proposer.rollback(len(history) + n_ok)
        if need_h:
            proposer.observe_hidden(hidden[n_ok])
        stats.record(len(guesses), n_ok, len(kept))
        new += kept
    return SpecResult(new[:max_new_tokens], stats, time.perf_counter() - t0)


# --- speculative sampling ------------------------------------------------------------------------------


def modified_rejection(p: torch.Tensor, q: torch.Tensor, guess: int, generator: torch.Generator) -> tuple[bool, int]:
    """The modified rejection rule (Leviathan et al. 2023; Chen et al. 2023) for one guess drawn from ``q``.

    Accept it with probability min(1, p[guess] / q[guess]); otherwise draw a replacement from the residual
    normalise(max(0, p − q)). The token that comes out is distributed exactly as ``p``. Returns
    ``(accepted, token)``.
    """
    u = torch.rand((), generator=generator).item()
    if u * q[guess] < p[guess]:                       # u < p/q without dividing by a zero q
        return True, guess
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    if not total > 0:                                 # p == q: a rejection cannot happen; guard rounding
        return True, guess
    return False, sample_token(residual / total, generator)


def modified_rejection_draws(p: torch.Tensor, q: torch.Tensor, n: int, generator: torch.Generator):
    """``n`` independent runs of :func:`modified_rejection` at once, each with its own guess drawn from ``q``:
    the same rule, vectorised (for checking its distribution with many draws). Returns ``(tokens (n,),
    accepted (n,) bool)``."""
    check_positive_int("n", n)
    guesses = torch.multinomial(q, n, replacement=True, generator=generator)
    u = torch.rand(n, generator=generator, dtype=p.dtype)
    accepted = u * q[guesses] < p[guesses]
    tokens = guesses.clone()
    residual = (p - q).clamp_min(0)
    rejected = int((~accepted).sum())
    if rejected and residual.sum() > 0:
        tokens[~accepted] = torch.multinomial(residual / residual.sum(), rejected, replacement=True,
                                              generator=generator)
    return tokens, accepted


def speculative_sample_step(ps: list[torch.Tensor], qs: list[torch.Tensor], guesses: list[int],
                            generator: torch.Generator, rule: Callable = modified_rejection) -> list[int]:
    """One verification pass of speculative sampling, on distributions: the tokens it keeps.

    ``qs[i]``: the draft's distribution the guess ``guesses[i]`` was drawn from; ``ps[i]``: the target's at the
    same position, plus ``ps[len(guesses)]`` after the last guess (for the bonus token). Guesses are checked in
    order with ``rule``; the first rejection ends the pass with its replacement; if every guess is kept, a bonus
    token is drawn from the last ``p``. ``rule`` is a parameter so the tests can show that wrong rules are caught.
    """
    if len(ps) != len(guesses) + 1 or len(qs) != len(guesses):
        raise ValueError("need one q per guess and one p per guess plus one")
    kept = []
    for p, q, g in zip(ps, qs, guesses):
        accepted, token = rule(p, q, g, generator)
        kept.append(token)
        if not accepted:
            return kept
    kept.append(sample_token(ps[len(guesses)], generator))
    return kept


@torch.no_grad()
def speculative_sample(target, draft, prompt_ids, max_new_tokens: int, gamma: int, *, temperature: float = 1.0,
                       top_k: int = 0, seed: int = 0, eos_token_ids=()) -> SpecResult:
    """Speculative sampling with a draft model: the draft samples γ guesses from q, the target verifies them
    with :func:`modified_rejection`; the output is distributed as the target's own samples would be.

    ``temperature`` and ``top_k`` reshape p and q alike (:func:`course_utils.sampling.sampling_probs`).
    """
    tokens = _check_run(target, prompt_ids, max_new_tokens, gamma)
    check_sampling(temperature, top_k)
    if _vocab_size(draft) != _vocab_size(target):
        raise ValueError(f"the draft's vocabulary ({_vocab_size(draft)} tokens) differs from the target's "
                         f"({_vocab_size(target)})")
    gen = torch.Generator().manual_seed(seed)
    stats, t0 = SpecStats(gamma), time.perf_counter()
    cache, dcache = DynamicCache(config=target.config), DynamicCache(config=draft.config)
    p0 = sampling_probs(prefill(target, torch.tensor([tokens], device=target.device), cache)[0], temperature, top_k)
    new = [sample_token(p0.cpu(), gen)]
    done = new[0] in eos_token_ids
    while len(new) < max_new_tokens and not done:
        history = tokens + new
        k = min(gamma, max_new_tokens - len(new) - 1)
        t1 = time.perf_counter()
        guesses, qs = [], []
        feed = history[dcache.get_seq_length():]
        for _ in range(k):
            logits = draft(torch.tensor([feed], device=draft.device), cache=dcache, use_cache=True,
                           logits_to_keep=1).logits[0, -1]
            q = sampling_probs(logits, temperature, top_k).cpu()
            guesses.append(sample_token(q, gen))
            qs.append(q)
            feed = [guesses[-1]]
        t2 = time.perf_counter()
        logits, _ = verify(target, cache, [new[-1]] + guesses)
        ps = list(sampling_probs(logits, temperature, top_k).cpu())
        stats.verify_s += time.perf_counter() - t2
        stats.propose_s += t2 - t1
        kept = speculative_sample_step(ps, qs, guesses, gen)
        n_ok = len(kept) - 1
        kept, done = _stop_at_eos(kept, eos_token_ids)
        truncate_cache(cache, len(history) + n_ok)
        truncate_cache(dcache, min(len(history) + n_ok, dcache.get_seq_length()))
        stats.record(len(guesses), n_ok, len(kept))
        new += kept
    return SpecResult(new[:max_new_tokens], stats, time.perf_counter() - t0)


# --- what a verification pass costs ---------------------------------------------------------------------


@torch.no_grad()
def verification_cost(target, context_ids: list[int], gammas, *, repeats: int = 5, device="cpu") -> dict[int, float]:
    """v(γ): seconds of a target pass over γ + 1 new tokens against a cache of the context, in units of a
    one-token decode step (γ = 0) timed in the same interleaved run. Returns {γ: v}."""
    gammas = sorted({0, *[check_positive_int("gamma", g) for g in gammas]})
    cache = DynamicCache(config=target.config)
    prefill(target, torch.tensor([context_ids], device=target.device), cache)
    n = cache.get_seq_length()

    def step(g):
        def run():
            target(torch.tensor([context_ids[-1:] * (g + 1)], device=target.device), cache=cache, use_cache=True)
            truncate_cache(cache, n)
        return run
    t = time_interleaved({g: step(g) for g in gammas}, warmup=1, repeats=repeats, device=device)
    return {g: t[g].median_s / t[0].median_s for g in gammas if g}


def draft_cost_ratio(draft, target, context_ids: list[int], *, repeats: int = 5, device="cpu") -> float:
    """c: seconds of one draft decode step over one target decode step, interleaved, same context length."""
    caches = {}
    for name, m in (("draft", draft), ("target", target)):
        caches[name] = DynamicCache(config=m.config)
        prefill(m, torch.tensor([context_ids], device=m.device), caches[name])
    n = len(context_ids)

    def step(m, cache):
        def run():
            with torch.no_grad():
                m(torch.tensor([context_ids[-1:]], device=m.device), cache=cache, use_cache=True, logits_to_keep=1)
            truncate_cache(cache, n)
        return run
    t = time_interleaved({"draft": step(draft, caches["draft"]), "target": step(target, caches["target"])},
                         warmup=1, repeats=repeats, device=device)
    return t["draft"].median_s / t["target"].median_s
