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
    produced (the prefill's first token aside); ``propose_s`` / ``verify_s``: seconds spent in each phase;
    ``per_pass``: (guesses made, guesses kept, tokens kept) of every pass, in order."""

    gamma: int
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    passes: int = 0
    new_tokens: int = 0
    propose_s: float = 0.0
    verify_s: float = 0.0
    per_pass: list[tuple[int, int, int]] = field(default_factory=list)

    def __post_init__(self):
        self.proposed = self.proposed or [0] * self.gamma
        self.accepted = self.accepted or [0] * self.gamma

    def record(self, n_proposed: int, n_accepted: int, n_new: int) -> None:
        for i in range(n_proposed):
            self.proposed[i] += 1
            self.accepted[i] += i < n_accepted
        self.passes += 1
        self.new_tokens += n_new
        self.per_pass.append((n_proposed, n_accepted, n_new))

    @property
    def full_passes(self) -> int:
        """Passes that made at least one guess and kept every guess (so the bonus token was drawn)."""
        return sum(1 for made, kept, _ in self.per_pass if made and kept == made)

    def token_roles(self) -> list[str]:
        """What every token of the run was, the prefill's first included: ``"prefill"``; ``"position j"``, the j-th
        token of a pass that made guesses (a kept guess or the replacement of a rejected one); ``"bonus"``, the token
        after every guess of a pass was kept; ``"no guess"``, the token of a pass that made none (a plain draw).

        A token's role is known *before* it is drawn (how many guesses its pass made, and that the ones before it
        were kept), so grouping tokens by role keeps each token's distribution given its past: what
        :func:`sampling_fit` tests. (Whether a token *was* a kept guess or a replacement is not known beforehand,
        and is not a role.)
        """
        roles = ["prefill"]
        for made, _, n_new in self.per_pass:
            roles += ["no guess" if not made else "bonus" if j == made + 1 else f"position {j}"
                      for j in range(1, n_new + 1)]
        return roles

    @property
    def acceptance(self) -> float:
        """α measured: accepted guesses / guesses made (NaN if none was made)."""
        made = sum(self.proposed)
        return sum(self.accepted) / made if made else math.nan

    @property
    def reached(self) -> list[int]:
        """Per draft position i: passes whose guess i was checked (made, and guesses 0..i−1 all kept)."""
        return [sum(1 for made, kept, _ in self.per_pass if made > i and kept >= i) for i in range(self.gamma)]

    @property
    def conditional_acceptance(self) -> list[float]:
        """Per draft position i: guesses kept at i / guesses checked at i (:attr:`reached`): NaN where none was."""
        return [a / r if r else math.nan for a, r in zip(self.accepted, self.reached)]

    @property
    def acceptance_checked(self) -> float:
        """The formula's α, measured: guesses kept / guesses *checked* (a guess after a rejection is never checked,
        so :attr:`acceptance`, kept / made, falls with γ by construction). NaN if none was checked."""
        checked = sum(self.reached)
        return sum(self.accepted) / checked if checked else math.nan

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
    return model.get_output_embeddings().out_features          # an nn.Linear, or a draft's packed one


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
    a model never taught to stop early (LayerSkip trains the model for it; this does not).
    """
    layers = decoder_layers(model)
    check_positive_int("n_layers", n_layers)
    if n_layers >= len(layers):
        raise ValueError(f"n_layers must be below the model's {len(layers)} layers, got {n_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_layers]
    dropped = tuple(f"{prefix}.{i}." for prefix in _layer_prefixes(model) for i in range(n_layers, len(layers)))
    keep = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.startswith(dropped)}
    return _sharing_copy(model, config, keep)


def _sharing_copy(model, config, keep: dict, fill=None):
    """A ``type(model)`` built from ``config`` on the meta device, holding the tensors of ``keep`` (the model's own:
    shared, not copied) and the model's non-persistent buffers (rotary frequencies). ``fill(draft)`` puts in what
    ``keep`` leaves out; a parameter still left on the meta device is an error."""
    with torch.device("meta"):
        draft = type(model)(config)
    draft.load_state_dict(keep, assign=True, strict=False)
    if fill is not None:
        fill(draft)
    for name, buf in list(draft.named_buffers()):
        if buf.is_meta:
            owner, _, attr = name.rpartition(".")
            module = draft.get_submodule(owner) if owner else draft
            module.register_buffer(attr, model.get_buffer(name), persistent=False)
    missing = [n for n, p in draft.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"could not share these weights with the target: {missing[:3]}")
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.eval()


class _PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight is held in a low-bit kernel's layout
    (:class:`course_utils.engine.packed.PackedLinear`); inputs are cast to the kernel's dtype and back."""

    def __init__(self, packed, bias):
        super().__init__()
        self.packed, self.bias = packed, bias

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.packed(x.reshape(-1, x.shape[-1]).to(self.packed.dtype)).to(x.dtype)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias


def quantized_draft(model, kind: str = "int8", *, compute_dtype: torch.dtype = torch.bfloat16):
    """The model itself with fewer bits: every projection and the LM head run chapter 05's weight-only ``kind``
    kernel (``"int8"``: one scale per row; ``"int4"``: a scale and a zero point per group), everything else
    (embeddings, norms, rotary tables) shared with ``model``, not copied.

    The draft of the reference design: the same model, so it agrees often, and cheaper per step where reading
    fewer bytes makes a step faster. The products compute in ``compute_dtype`` (on the CPU PyTorch's int8 kernel
    is fast with bfloat16 inputs, not with float32 ones). Lossy: measured by agreement like any draft.
    """
    from .engine.packed import LOWBIT, pack_matrix
    if kind not in LOWBIT:
        raise ValueError(f"kind must be one of {LOWBIT}, got {kind!r}")
    if compute_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the low-bit kernels compute in float32 or bfloat16, got {compute_dtype}")
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    keep = {k: v for k, v in model.state_dict(keep_vars=True).items() if k.rpartition(".")[0] not in linears}

    def pack(draft):
        for name in sorted(linears):
            owner, _, attr = name.rpartition(".")
            src = model.get_submodule(name)
            parent = draft.get_submodule(owner) if owner else draft
            setattr(parent, attr, _PackedLinear(pack_matrix(src.weight.detach(), kind, compute_dtype), src.bias))
    return _sharing_copy(model, copy.deepcopy(model.config), keep, pack)


def _layer_prefixes(model) -> list[str]:
    layers = decoder_layers(model)
    return [name for name, module in model.named_modules() if module is layers]


class NgramLookup(Proposer):
    """Prompt lookup: find the latest ``n``-gram of the history earlier in the history, propose what followed it.

    The rule of transformers' ``prompt_lookup_num_tokens`` (``PromptLookupCandidateGenerator``): try n-grams
    from ``max_ngram`` down to 1; take the first (leftmost) earlier occurrence that has a continuation; propose
    up to k tokens of it. No model at all: it can pay where the output copies its input.
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
        # only the last hidden states are kept: the LM head runs on one position (logits_to_keep=1), not on every
        # position of the chunk; the hidden states are the same, bit for bit
        h = model(ids, output_hidden_states=True, use_cache=False, logits_to_keep=1).hidden_states[-1][0]
        hidden.append(h[:-2].float().cpu())
        labels.append(ids[0, 2:].cpu())
    return torch.cat(hidden), torch.cat(labels)


def train_next_next_head(hidden: torch.Tensor, labels: torch.Tensor, lm_head_weight: torch.Tensor, *,
                         steps: int = 200, batch_size: int = 256, lr: float = 1e-3, seed: int = 0,
                         time_budget_s: float | None = None, heldout=None, eval_every: int = 25,
                         progress: bool = False):
    """Train a :class:`NextNextHead` with cross-entropy on (hidden state at t, token at t + 2) pairs.

    Adam on the head's one matrix; the LM head stays frozen. Stops after ``steps`` steps or when
    ``time_budget_s`` seconds have passed. ``heldout``: (hidden, labels) pairs never trained on, scored before the
    first step, every ``eval_every`` steps and after the last. Returns ``(head, losses, curve)``: the training loss
    at every step, and [(steps done, held-out loss, held-out top-1 accuracy)] (empty without ``heldout``).
    """
    from .progress import progress_bar
    check_positive_int("steps", steps)
    check_positive_int("batch_size", batch_size)
    check_positive_int("eval_every", eval_every)
    if hidden.shape[0] != labels.shape[0] or hidden.dim() != 2:
        raise ValueError("need one label per hidden state: hidden (n, d_model), labels (n,)")
    torch.manual_seed(seed)
    head = NextNextHead(lm_head_weight.float().cpu())
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses, curve, t0 = [], [], time.perf_counter()

    def score():
        if heldout is not None:
            curve.append((len(losses), *head_loss_and_accuracy(head, *heldout)))
    score()
    with torch.enable_grad():
        for step in progress_bar(range(steps), "training the head", enabled=progress):
            idx = torch.randint(0, hidden.shape[0], (batch_size,), generator=gen)
            loss = torch.nn.functional.cross_entropy(head(hidden[idx]), labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                break
            if (step + 1) % eval_every == 0:
                with torch.no_grad():
                    score()
    if not curve or curve[-1][0] != len(losses):
        score()
    return head.eval(), losses, curve


@torch.no_grad()
def head_loss_and_accuracy(head: NextNextHead, hidden: torch.Tensor, labels: torch.Tensor,
                           chunk: int = 256) -> tuple[float, float]:
    """Mean cross-entropy (nats) and top-1 accuracy of ``head`` on (hidden state at t, token at t + 2) pairs."""
    if hidden.shape[0] != labels.shape[0] or not hidden.shape[0]:
        raise ValueError("need one label per hidden state, and at least one")
    total, right = 0.0, 0
    for i in range(0, hidden.shape[0], chunk):
        logits = head(hidden[i:i + chunk].float())
        total += float(torch.nn.functional.cross_entropy(logits, labels[i:i + chunk], reduction="sum"))
        right += int((logits.argmax(-1) == labels[i:i + chunk]).sum())
    return total / hidden.shape[0], right / hidden.shape[0]


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


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, guesses: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) for each guess d drawn from ``q``: how likely the target keeps it.

    ``p``, ``q``: (vocab,); ``guesses``: (n,). Returns (n,) float64. A guess drawn from q has q(d) > 0; a zero
    q(d) is read as a sure accept.
    """
    p_d, q_d = p[guesses].double(), q[guesses].double()
    return torch.where(q_d > 0, (p_d / q_d.clamp_min(1e-300)).clamp(max=1.0), torch.ones_like(p_d))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p − q)): where a rejected guess's replacement is drawn from. All zeros where p − q has no
    positive part (p == q up to rounding, where a rejection cannot happen: :func:`modified_rejection_batch` then
    keeps the guess)."""
    residual = (p.double() - q.double()).clamp_min(0)
    total = residual.sum()
    return residual / total if total > 0 else residual


def modified_rejection_batch(p: torch.Tensor, q: torch.Tensor, guesses: torch.Tensor,
                             generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The modified rejection rule (Leviathan et al. 2023; Chen et al. 2023) for ``n`` guesses drawn from ``q``.

    Each guess d is accepted with probability min(1, p(d) / q(d)) (:func:`acceptance_probability`); a rejected
    one is replaced by a draw from normalise(max(0, p − q)) (:func:`residual_distribution`). Whatever q is, the
    token that comes out is distributed exactly as ``p``. ``p``, ``q``: (vocab,); ``guesses``: (n,).
    Returns ``(accepted (n,) bool, tokens (n,) long)``.

    The course's only copy of the rule: :func:`modified_rejection` (one guess, as the model loop
    :func:`speculative_sample` uses it) and :func:`modified_rejection_draws` (many independent guesses) call it.
    """
    guesses = torch.as_tensor(guesses, dtype=torch.long).reshape(-1)
    u = torch.rand(guesses.shape[0], generator=generator, dtype=torch.float64)
    accepted = u < acceptance_probability(p, q, guesses)
    tokens = guesses.clone()
    rejected = ~accepted
    n_rejected = int(rejected.sum())
    if n_rejected:
        residual = residual_distribution(p, q)
        if residual.sum() > 0:
            tokens[rejected] = torch.multinomial(residual, n_rejected, replacement=True, generator=generator)
        else:                                                   # p == q: a rejection cannot happen
            accepted[:] = True
    return accepted, tokens


def modified_rejection(p: torch.Tensor, q: torch.Tensor, guess: int, generator: torch.Generator) -> tuple[bool, int]:
    """The modified rejection rule for one guess drawn from ``q`` (:func:`modified_rejection_batch` with one row):
    accept it with probability min(1, p[guess] / q[guess]); otherwise draw a replacement from the residual
    normalise(max(0, p − q)). The token that comes out is distributed exactly as ``p``. Returns
    ``(accepted, token)``.
    """
    accepted, tokens = modified_rejection_batch(p, q, torch.tensor([int(guess)]), generator)
    return bool(accepted[0]), int(tokens[0])


def modified_rejection_draws(p: torch.Tensor, q: torch.Tensor, n: int, generator: torch.Generator):
    """``n`` independent guesses drawn from ``q``, each put through the rule (:func:`modified_rejection_batch`):
    for checking the rule's distribution with many draws. Returns ``(tokens (n,), accepted (n,) bool)``."""
    check_positive_int("n", n)
    guesses = torch.multinomial(q, n, replacement=True, generator=generator)
    accepted, tokens = modified_rejection_batch(p, q, guesses, generator)
    return tokens, accepted


def speculative_sample_step(ps: list[torch.Tensor], qs: list[torch.Tensor], guesses: list[int],
                            generator: torch.Generator) -> list[int]:
    """One verification pass of speculative sampling, on distributions: the tokens it keeps.

    ``qs[i]``: the draft's distribution the guess ``guesses[i]`` was drawn from; ``ps[i]``: the target's at the
    same position, plus ``ps[len(guesses)]`` after the last guess (for the bonus token). Guesses are checked in
    order with :func:`modified_rejection`; the first rejection ends the pass with its replacement; if every guess
    is kept, a bonus token is drawn from the last ``p``.
    """
    if len(ps) != len(guesses) + 1 or len(qs) != len(guesses):
        raise ValueError("need one q per guess and one p per guess plus one")
    kept = []
    for p, q, g in zip(ps, qs, guesses):
        accepted, token = modified_rejection(p, q, g, generator)
        kept.append(token)
        if not accepted:
            return kept
    kept.append(sample_token(ps[len(guesses)], generator))
    return kept


@torch.no_grad()
def draft_guesses(draft, cache: DynamicCache, history: list[int], k: int, temperature: float, top_k: int,
                  generator: torch.Generator) -> tuple[list[int], list[torch.Tensor]]:
    """The draft's part of a sampling pass: feed it what its ``cache`` has not seen of ``history``, then sample
    ``k`` guesses one after another. Returns the guesses and the distributions q they were drawn from (on the CPU).
    The cache then holds ``history`` and every guess but the last."""
    guesses, qs = [], []
    feed = history[cache.get_seq_length():]
    for _ in range(k):
        logits = draft(torch.tensor([feed], device=draft.device), cache=cache, use_cache=True,
                       logits_to_keep=1).logits[0, -1]
        q = sampling_probs(logits, temperature, top_k).cpu()
        guesses.append(sample_token(q, generator))
        qs.append(q)
        feed = [guesses[-1]]
    return guesses, qs


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
        guesses, qs = draft_guesses(draft, dcache, history, k, temperature, top_k, gen)
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


# --- checking what speculative sampling produced ------------------------------------------------------------


def rank_bins(vocab: int) -> list[int]:
    """Edges of the rank bins :func:`rank_fit` counts in: every rank of a small vocabulary, then widening bins."""
    if vocab <= 16:
        return list(range(vocab + 1))
    edges = [0, 1, 2, 3, 4, 6, 10, 20, 50, 100, 1000]
    return [e for e in edges if e < vocab] + [vocab]


def rank_fit(probs: torch.Tensor, tokens: torch.Tensor, *, min_expected: float = 5.0) -> dict:
    """Do ``tokens`` follow ``probs``, each token its own distribution? A χ² test on the tokens' ranks.

    ``probs``: (n, vocab), the distribution token i should have been drawn from given everything before it, or
    (vocab,), one distribution for all; ``tokens`` (n,). Each token is replaced by its rank in its distribution
    (0 = the most likely), ranks are counted in :func:`rank_bins`, and the counts are compared with their
    expectation Σᵢ pᵢ(rank bin) through C = Σᵢ (diag πᵢ − πᵢπᵢᵀ), πᵢ the rank-bin probabilities of token i:
    X = dᵀ C⁻¹ d over all bins but one, compared with χ² on (bins − 1) degrees of freedom (a bin expected to hold
    fewer than ``min_expected`` tokens is merged into the one before). For independent draws C is their exact
    covariance. For tokens drawn one after another, each from its distribution given its past, the deviations
    form a martingale and C is the sum of their conditional covariances: X is χ² asymptotically (the martingale
    central limit theorem), so the test covers a whole generated sequence, given enough tokens.

    Returns {"n", "bins", "observed", "expected", "stat", "df", "p_value", "impossible"}: ``impossible`` counts
    tokens of probability zero (any makes ``p_value`` 0); with a single bin nothing can be tested (p_value NaN).
    """
    probs = probs.detach().cpu()
    tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).cpu()
    n = tokens.shape[0]
    shared = probs.dim() == 1
    rows = probs[None] if shared else probs
    if rows.dim() != 2 or not (shared or rows.shape[0] == n) or not n:
        raise ValueError(f"need one distribution per token (or one for all): probs (n, vocab) or (vocab,), tokens "
                         f"(n,) with n > 0; got {tuple(probs.shape)} and {tuple(tokens.shape)}")
    vocab = rows.shape[1]
    p_token = probs[tokens] if shared else rows.gather(1, tokens[:, None]).squeeze(1)
    impossible = int((p_token <= 0).sum())
    edges = rank_bins(vocab)
    values, index = rows.topk(edges[-2], dim=-1)               # the ranked head of each distribution
    values = values.double()
    head = [values[:, a:b].sum(1) for a, b in zip(edges[:-2], edges[1:-1])]
    pi = torch.stack(head + [rows.sum(-1, dtype=torch.float64) - values.sum(1)], 1).clamp_min(0)
    hit = index == tokens[:, None]                              # (n, head) for each token's own row (or the shared)
    rank = torch.where(hit.any(1), hit.double().argmax(1), float(edges[-2]))
    which = torch.bucketize(rank, torch.tensor(edges[1:-1], dtype=torch.double), right=True)
    weight = torch.full((1,), float(n)) if shared else torch.ones(n)
    expected_bins = (pi * weight[:, None].double()).sum(0)
    groups, current = [], []                                    # merge rare bins into the one before
    for b in range(pi.shape[1]):
        current.append(b)
        if expected_bins[current].sum() >= min_expected:
            groups.append(current)
            current = []
    if current:
        if groups:
            groups[-1].extend(current)
        else:
            groups.append(current)
    pi = torch.stack([pi[:, g].sum(1) for g in groups], 1)
    lookup = torch.empty(len(edges) - 1, dtype=torch.long)
    for gi, g in enumerate(groups):
        lookup[g] = gi
    observed = torch.bincount(lookup[which], minlength=len(groups)).double()
    expected = (pi * weight[:, None].double()).sum(0)
    out = {"n": n, "bins": [(edges[g[0]], edges[g[-1] + 1]) for g in groups], "observed": observed.tolist(),
           "expected": expected.tolist(), "impossible": impossible, "df": len(groups) - 1}
    if len(groups) < 2:
        return {**out, "stat": math.nan, "p_value": 0.0 if impossible else math.nan}
    d = (observed - expected)[:-1]
    cov = (torch.diag(expected) - (pi * weight[:, None].double()).T @ pi)[:-1, :-1]
    stat = float(d @ torch.linalg.solve(cov, d))
    p_value = float(torch.special.gammaincc(torch.tensor(out["df"] / 2.0, dtype=torch.float64),
                                            torch.tensor(stat / 2.0, dtype=torch.float64)))
    return {**out, "stat": stat, "p_value": 0.0 if impossible else p_value}


@torch.no_grad()
def target_probs_along(target, prompt_ids, tokens: list[int], temperature: float, top_k: int = 0) -> torch.Tensor:
    """The target's sampling distribution (temperature and top-k applied) for each of ``tokens`` given the prompt
    and the tokens before it, from one pass without a cache: (len(tokens), vocab) float32 on the CPU."""
    prompt_ids = _check_run(target, prompt_ids, 1, 1)
    ids = torch.tensor([prompt_ids + list(tokens)], device=target.device)
    logits = target(ids, use_cache=False).logits[0, len(prompt_ids) - 1:-1]
    return sampling_probs(logits, temperature, top_k).cpu()


def sampling_fit(target, runs, temperature: float, top_k: int = 0) -> dict:
    """Does speculative sampling's output follow the target's own sampling distribution?

    ``runs``: (prompt ids, :class:`SpecResult`) pairs from :func:`speculative_sample`. Every token is ranked in
    the target's distribution given its prompt and everything before it (:func:`target_probs_along`), and
    :func:`rank_fit` tests the ranks of each group of tokens (:meth:`SpecStats.token_roles`), pooled over the
    runs. A token's group is known before it is drawn, so each group on its own must follow the target.
    Returns {group: rank_fit's dict}, in pass order.
    """
    probs, tokens, names = [], [], []
    for prompt_ids, result in runs:
        probs.append(target_probs_along(target, prompt_ids, result.tokens, temperature, top_k))
        tokens += result.tokens
        names += result.stats.token_roles()[:len(result.tokens)]
    probs, tokens = torch.cat(probs), torch.tensor(tokens)
    rank = {"prefill": (0, 0), "bonus": (2, 0), "no guess": (3, 0)}
    order = sorted(set(names), key=lambda x: rank.get(x) or (1, int(x.split()[1])))
    return {name: rank_fit(probs[[i for i, x in enumerate(names) if x == name]],
                           tokens[[i for i, x in enumerate(names) if x == name]]) for name in order}


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
