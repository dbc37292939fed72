"""Chapter 09 -- distillation: a small student learns the teacher's whole next-token distribution.

* **Soft labels** -- :func:`soft_labels`: the teacher's most likely next tokens after a text, at a
  temperature T (through :func:`course_utils.sampling.sampling_probs`, the one place the course turns
  logits into a distribution); :func:`soft_labels_figure` draws them (pure: the chapter's slider redraws it).
  Dividing the logits by T raises every probability ratio to the power 1/T (:func:`tempered_ratio`).
* **The losses** -- :func:`distillation_loss`: T² · KL(p_T ‖ q_T) between the teacher's (p) and the
  student's (q) temperature-softened distributions, averaged over positions (Hinton et al. 2015); the T²
  keeps the gradient's size comparable across temperatures. Forward KL by default; ``reverse=True``
  gives KL(q_T ‖ p_T), the direction MiniLLM trains with (GKD interpolates between the two and trains on
  the student's own samples). :func:`hard_label_loss`: cross-entropy with the text's next token.
* **Top-k targets** -- :func:`top_k_targets` keeps the teacher's k most likely tokens and their
  probabilities (:class:`TopKTargets`) instead of whole distributions; :func:`top_k_distillation_loss` is
  the KL divergence over those k tokens plus one bucket holding the rest of the vocabulary. With k equal
  to the vocabulary it is :func:`distillation_loss`; with fewer it is never larger (merging outcomes
  cannot increase a KL divergence).
* **The student** -- :func:`student_from_teacher`: the teacher with most decoder layers removed (which ones:
  e.g. :func:`evenly_spaced_layers`), the kept
  ones *copied* (its own trainable weights), the token embedding and the LM head *shared* with the teacher
  and frozen (they are most of a small model's parameters, and would be most of its optimizer state).
  :func:`copy_student` copies a student the same way; :func:`parameter_bytes` counts what training holds.
* **Training** -- :func:`distillation_data` runs the teacher once over windows of the training text and
  keeps its top-k targets; :func:`batch_order` is the seeded order of the windows (both losses of a seed see
  the same batches); :func:`train_student` trains with either loss and evaluates at checkpoints along the
  curve (:class:`TrainingRun`); :func:`training_step` is one step, the LM head a slice of positions at a time.
* **Quantization-aware training** -- :class:`SteFakeQuantize`: chapter 05's ``fake_quantize`` in the forward
  pass, the identity in the backward pass (a straight-through estimator); :func:`quantization_aware`
  attaches it to every projection matrix and :func:`bake_quantized` leaves the quantized weights in place.
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import plotly.graph_objects as go
import torch
from torch.nn.utils import parametrize

from .hooks import decoder_layers, projection_modules
from .plots import PALETTE, figure
from .progress import progress_bar
from .quantize import Scheme, fake_quantize
from .sampling import sampling_probs
from .validation import check_finite, check_positive_int

LOSSES = ("soft", "hard")


def _check_temperature(temperature) -> float:
    return check_finite("temperature", temperature, minimum=0.0, strict=True)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / T`` in float32 (no copy at T = 1: a vocabulary-wide tensor per position is large)."""
    logits = logits.float()
    return logits if temperature == 1 else logits / temperature


def _check_same_vocab(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(f"the student's vocabulary has {student_logits.shape[-1]:,} tokens, the teacher's "
                         f"{teacher_logits.shape[-1]:,}: distillation compares distributions over the same vocabulary")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student and teacher logits must have one shape (positions, vocab), got "
                         f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}")


# --- soft labels and temperature --------------------------------------------------------------------


@dataclass
class SoftLabels:
    """The teacher's distribution after one text (chapter 09): its logits (vocab,) and the tokens' text."""

    text: str
    logits: torch.Tensor
    token_text: Callable[[int], str] = field(repr=False)

    def top(self, k: int = 5, temperature: float = 1.0) -> list[tuple[int, str, float]]:
        """The ``k`` most likely next tokens at ``temperature``: ``(id, text, probability)``, most likely first."""
        check_positive_int("k", k)
        if k > self.logits.shape[-1]:
            raise ValueError(f"k={k} is larger than the vocabulary ({self.logits.shape[-1]:,} tokens)")
        probs = sampling_probs(self.logits, _check_temperature(temperature))
        values, ids = probs.topk(k)
        return [(int(i), self.token_text(int(i)), float(v)) for i, v in zip(ids, values)]


@torch.no_grad()
def soft_labels(model, tok, text: str) -> SoftLabels:
    """The model's next-token logits after ``text`` (no special tokens added), kept to redraw at any temperature."""
    if not isinstance(text, str) or not text:
        raise ValueError("text must be a non-empty string")
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids.to(model.device)
    logits = model(ids, use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu()
    return SoftLabels(text, logits, lambda i: tok.decode([i]))


def tempered_ratio(ratio: float, temperature: float) -> float:
    """What a probability ratio p(a)/p(b) at T = 1 becomes at temperature T: ``ratio ** (1 / T)``.

    Softmax of logits / T gives p_T(a) / p_T(b) = exp((z_a − z_b) / T) = (p_1(a) / p_1(b)) ** (1 / T).
    """
    ratio = check_finite("ratio", ratio, minimum=0.0, strict=True)
    return ratio ** (1.0 / _check_temperature(temperature))


def soft_labels_figure(labels: dict[str, SoftLabels] | SoftLabels, temperature: float, k: int = 5) -> go.Figure:
    """Bars of the ``k`` most likely next tokens at ``temperature``, one panel-group per text (pure)."""
    if isinstance(labels, SoftLabels):
        labels = {labels.text: labels}
    if not labels:
        raise ValueError("give at least one SoftLabels")
    fig = figure("", "next token (most likely first)", "probability", height=420)
    shares = []
    for i, (name, lab) in enumerate(labels.items()):
        top = lab.top(k, temperature)
        fig.add_bar(x=[f"{repr(t)[1:-1]}<br><sub>{name[:24]}</sub>" if len(labels) > 1 else repr(t)[1:-1]
                       for _, t, _ in top],
                    y=[p for _, _, p in top], name=name, marker_color=PALETTE[i % len(PALETTE)],
                    texttemplate="%{y:.3f}", textposition="outside")
        shares.append(sum(p for _, _, p in top))
    fig.update_layout(title=f"T = {temperature:g}: the top {k} tokens hold "
                            + ", ".join(f"{s:.0%}" for s in shares) + " of the probability",
                      showlegend=len(labels) > 1, barmode="overlay")   # one bar per category: full width
    fig.update_yaxes(range=[0, min(1.0, 1.15 * max(max(lab.top(k, temperature)[0][2] for lab in labels.values()),
                                                  1e-3))])
    return fig


# --- the losses -------------------------------------------------------------------------------------------


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0, *,
                      reverse: bool = False) -> torch.Tensor:
    """T² · mean over positions of KL(p_T ‖ q_T) (nats), p from the teacher, q from the student (chapter 09).

    ``student_logits`` / ``teacher_logits``: (..., vocab), the same shape; the teacher's side carries no
    gradient. p_T is :func:`~course_utils.sampling.sampling_probs` of the teacher's logits at T; the
    student's side is a log-softmax of its logits / T (log-probabilities, for the gradient).
    ``reverse=True``: KL(q_T ‖ p_T) (both sides as log-softmax: where p underflows to 0 its log must stay finite).
    """
    temperature = _check_temperature(temperature)
    _check_same_vocab(student_logits, teacher_logits)
    log_q = torch.log_softmax(_tempered(student_logits, temperature), dim=-1)
    teacher_logits = teacher_logits.detach()
    if reverse:
        log_p = torch.log_softmax(_tempered(teacher_logits, temperature), dim=-1)
        kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    else:
        p = sampling_probs(teacher_logits, temperature)
        kl = (torch.xlogy(p, p) - p * log_q).sum(-1)
    return kl.mean() * temperature ** 2


def hard_label_loss(student_logits: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the student with the text's actual next tokens, mean over positions (nats).

    ``student_logits``: (..., vocab); ``next_tokens``: integer ids of the same leading shape.
    """
    if next_tokens.shape != student_logits.shape[:-1] or next_tokens.is_floating_point():
        raise ValueError(f"next_tokens must be integer ids of shape {tuple(student_logits.shape[:-1])}, got "
                         f"{next_tokens.dtype} {tuple(next_tokens.shape)}")
    vocab = student_logits.shape[-1]
    if int(next_tokens.max()) >= vocab or int(next_tokens.min()) < 0:
        raise ValueError(f"next_tokens must lie in 0..{vocab - 1} (the student's vocabulary)")
    return torch.nn.functional.cross_entropy(student_logits.float().reshape(-1, vocab), next_tokens.reshape(-1).long())


@dataclass
class TopKTargets:
    """The teacher's k most likely next tokens at every position, and their probabilities at ``temperature``.

    ``indices``: int32 (..., k); ``probs``: float32 (..., k), most likely first, summing to at most 1 (the
    rest of the vocabulary holds ``1 - probs.sum(-1)``). ``vocab_size``: the teacher's vocabulary.
    """

    indices: torch.Tensor
    probs: torch.Tensor
    temperature: float
    vocab_size: int

    @property
    def k(self) -> int:
        return int(self.indices.shape[-1])

    @property
    def nbytes(self) -> int:
        """Bytes held: k ids and k probabilities per position."""
        return self.indices.nbytes + self.probs.nbytes

    def full_nbytes(self) -> int:
        """Bytes whole float32 distributions would take at the same positions."""
        return self.probs[..., 0].numel() * self.vocab_size * 4


def top_k_targets(teacher_logits: torch.Tensor, k: int, temperature: float = 1.0) -> TopKTargets:
    """Keep the k largest probabilities of :func:`~course_utils.sampling.sampling_probs` (teacher_logits, T)."""
    temperature = _check_temperature(temperature)
    check_positive_int("k", k)
    vocab = teacher_logits.shape[-1]
    if k > vocab:
        raise ValueError(f"k={k} is larger than the vocabulary ({vocab:,} tokens)")
    values, ids = sampling_probs(teacher_logits.detach(), temperature).topk(k, dim=-1)
    return TopKTargets(ids.to(torch.int32), values.float(), temperature, vocab)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x <= 0, accurate on both sides of x = −ln 2 (Mächler 2012)."""
    x = x.clamp(max=-1e-30)
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def top_k_distillation_loss(student_logits: torch.Tensor, indices: torch.Tensor, probs: torch.Tensor,
                            temperature: float = 1.0) -> torch.Tensor:
    """T² · mean KL divergence from the teacher's top-k targets to the student, over the k tokens and the rest.

    ``student_logits``: (..., vocab); ``indices`` / ``probs``: (..., k), from :func:`top_k_targets` at the same
    ``temperature``. The vocabulary is split into the k stored tokens and one bucket for all others, whose
    teacher probability is ``1 - probs.sum(-1)`` and whose student probability is the student's remaining mass.
    """
    temperature = _check_temperature(temperature)
    if indices.shape != probs.shape or indices.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(f"indices and probs must be (..., k) over the student's positions "
                         f"{tuple(student_logits.shape[:-1])}; got {tuple(indices.shape)} and {tuple(probs.shape)}")
    if indices.shape[-1] > student_logits.shape[-1] or int(indices.max()) >= student_logits.shape[-1]:
        raise ValueError(f"the targets name tokens beyond the student's vocabulary ({student_logits.shape[-1]:,} "
                         f"tokens): mismatched vocabularies")
    log_q = torch.log_softmax(_tempered(student_logits, temperature), dim=-1)
    log_q_k = log_q.gather(-1, indices.long())
    p = probs.float()
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    log_q_rest = _log1mexp(torch.logsumexp(log_q_k, dim=-1))
    kl = (torch.xlogy(p, p) - p * log_q_k).sum(-1) + torch.xlogy(p_rest, p_rest) - p_rest * log_q_rest
    return kl.mean() * temperature ** 2


# --- the student ------------------------------------------------------------------------------------------


def _layer_key(key: str, prefix: str) -> tuple[int, str] | None:
    if not key.startswith(prefix):
        return None
    index, _, rest = key[len(prefix):].partition(".")
    return int(index), rest


def _frozen_shared(model) -> list[torch.nn.Parameter]:
    """The token embedding and the output head (one tensor when they are tied)."""
    params = [model.get_input_embeddings().weight, model.get_output_embeddings().weight]
    return list({id(p): p for p in params}.values())


def evenly_spaced_layers(n_layers: int, k: int) -> list[int]:
    """``k`` of ``n_layers`` layer indices, evenly spaced from the first to the last (``[0]`` for k = 1).

    Removing a *block* of layers breaks the model for longer than removing every few: the kept layers then
    still span the teacher's whole depth (DistilBERT kept every other layer of BERT).
    """
    check_positive_int("n_layers", n_layers)
    check_positive_int("k", k)
    if k >= n_layers:
        raise ValueError(f"a student keeps fewer layers than the teacher's {n_layers}, got k={k}")
    return [0] if k == 1 else [round(i * (n_layers - 1) / (k - 1)) for i in range(k)]


def student_from_teacher(teacher, layers: Sequence[int]):
    """A student made of the teacher's decoder layers ``layers`` (in that order), the rest removed (chapter 09).

    The kept layers and the final norm are *copies* (the student trains them; the teacher is not changed);
    the token embedding and the LM head are the teacher's own tensors, shared and frozen. The whole teacher
    is frozen too (``requires_grad`` off: it is only ever run for its outputs). Layer ``i`` of the student
    is teacher layer ``layers[i]`` with its position in the KV cache renumbered. With ``layers = range(k)``
    the untrained student computes exactly what chapter 08's ``early_exit_draft(teacher, k)`` computes.
    """
    n_teacher = len(decoder_layers(teacher))
    keep = list(layers)
    if not keep or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_teacher for i in keep):
        raise ValueError(f"layers must name at least one of the teacher's layers 0..{n_teacher - 1}, got {layers!r}")
    if len(set(keep)) != len(keep) or len(keep) >= n_teacher:
        raise ValueError(f"layers must be distinct and fewer than the teacher's {n_teacher} (a student is smaller), "
                         f"got {keep}")
    teacher.requires_grad_(False)
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    with torch.device("meta"):
        student = type(teacher)(config)
    (prefix,) = [f"{name}." for name, module in teacher.named_modules() if module is decoder_layers(teacher)]
    shared = {id(p) for p in _frozen_shared(teacher)}
    state = {}
    for key, value in teacher.state_dict(keep_vars=True).items():
        where = _layer_key(key, prefix)
        if where is not None:
            if where[0] in keep:
                state[f"{prefix}{keep.index(where[0])}.{where[1]}"] = torch.nn.Parameter(value.detach().clone())
        elif id(value) in shared:
            state[key] = value                                    # the teacher's own tensor: shared, not copied
        else:
            state[key] = torch.nn.Parameter(value.detach().clone())
    student.load_state_dict(state, assign=True, strict=True)
    for name, buf in list(student.named_buffers()):              # non-persistent buffers (rotary frequencies)
        if buf.is_meta:
            owner, _, attr = name.rpartition(".")
            student.get_submodule(owner).register_buffer(attr, teacher.get_buffer(name).clone(), persistent=False)
    _freeze_shared(student)
    student.generation_config = copy.deepcopy(teacher.generation_config)
    return student.eval()


def _trainable(model) -> list[torch.nn.Parameter]:
    """Every parameter of a student but the frozen embedding and head (each tensor once)."""
    frozen = {id(p) for p in _frozen_shared(model)}
    return [p for p in {id(p): p for p in model.parameters()}.values() if id(p) not in frozen]


TRAINED_PARTS = ("all", "unquantized")


def _projection_weights(model) -> list[torch.nn.Parameter]:
    """The tensors chapter 05's quantizer rounds: each projection matrix's weight (its latent weight when the
    module is quantization-aware), not its bias."""
    out = []
    for module in projection_modules(model).values():
        if parametrize.is_parametrized(module, "weight"):
            out.append(module.parametrizations.weight.original)
        else:
            out.append(module.weight)
    return out


def _freeze_shared(model, train: str = "all") -> list[torch.nn.Parameter]:
    """Set which tensors of a student get gradients (by their role, whatever flags others have set); return those.

    ``train="all"``: every parameter but the embedding and the head. ``"unquantized"``: only those a weight
    quantizer leaves in floating point -- the norms' gains and any biases -- with the projection weights frozen too.
    """
    if train not in TRAINED_PARTS:
        raise ValueError(f"train must be one of {TRAINED_PARTS}, got {train!r}")
    for p in _frozen_shared(model):
        p.requires_grad_(False)
    params = _trainable(model)
    if train == "unquantized":
        rounded = {id(p) for p in _projection_weights(model)}
        for p in params:
            if id(p) in rounded:
                p.requires_grad_(False)
        params = [p for p in params if id(p) not in rounded]
    for p in params:
        p.requires_grad_(True)
    return params


def copy_student(student):
    """A copy of ``student`` with its own trainable weights, still sharing its frozen tensors (embedding, head)."""
    memo = {id(p): p for p in _frozen_shared(student)}
    return copy.deepcopy(student, memo)


def parameter_bytes(model) -> dict[str, int]:
    """What training a student with Adam holds, in bytes: its trainable parameters (all but the embedding and the
    head), the frozen ones (each tensor once), the gradients of the trainable ones and Adam's two moments for each."""
    trainable = sum(p.numel() * p.element_size() for p in _trainable(model))
    frozen = sum(p.numel() * p.element_size() for p in _frozen_shared(model))
    return {"trainable": trainable, "frozen": frozen, "gradients": trainable, "adam_state": 2 * trainable}


# --- training data ---------------------------------------------------------------------------------------


@dataclass
class DistillData:
    """Training windows and what each loss learns from them (chapter 09).

    ``inputs`` / ``next_tokens``: (n_windows, seq_len) int64 -- the tokens a window reads and the token that
    follows each (the hard labels); ``targets``: the teacher's :class:`TopKTargets` at every input position,
    (n_windows, seq_len, k) -- the soft labels, computed once.
    """

    inputs: torch.Tensor
    next_tokens: torch.Tensor
    targets: TopKTargets
    seconds: float = 0.0

    @property
    def n_windows(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.inputs.shape[1])

    @property
    def n_tokens(self) -> int:
        return self.inputs.numel()


@torch.no_grad()
def distillation_data(teacher, ids: torch.Tensor, seq_len: int, k: int, temperature: float = 1.0, *,
                      progress: bool = False) -> DistillData:
    """Cut ``ids`` (1, n) into windows of ``seq_len`` inputs (each with its next token) and run the teacher
    once over each, keeping its top-``k`` probabilities at ``temperature`` (:func:`top_k_targets`)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.is_floating_point():
        raise ValueError(f"ids must be a (1, n_tokens) tensor of token ids, got {getattr(ids, 'shape', type(ids))}")
    check_positive_int("seq_len", seq_len)
    n_windows = (ids.shape[1] - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"{ids.shape[1]} tokens cannot fill one window of {seq_len} inputs and their next tokens")
    t0 = time.perf_counter()
    flat = ids[0, :n_windows * seq_len + 1].cpu()
    inputs = flat[:-1].reshape(n_windows, seq_len)
    next_tokens = flat[1:].reshape(n_windows, seq_len)
    parts = []
    for w in progress_bar(range(n_windows), "teacher's top-k", enabled=progress):
        logits = teacher(inputs[w:w + 1].to(teacher.device), use_cache=False).logits[0]
        parts.append(top_k_targets(logits, k, temperature))
    targets = TopKTargets(torch.stack([p.indices.cpu() for p in parts]), torch.stack([p.probs.cpu() for p in parts]),
                          parts[0].temperature, parts[0].vocab_size)
    return DistillData(inputs.long(), next_tokens.long(), targets, time.perf_counter() - t0)


def batch_order(n_windows: int, steps: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Which windows each training step reads: a seeded shuffle of all windows, then another, and so on
    (every window once per epoch). The same arguments give the same batches, whatever the loss."""
    for name, v in (("n_windows", n_windows), ("steps", steps), ("batch_size", batch_size)):
        check_positive_int(name, v)
    if batch_size > n_windows:
        raise ValueError(f"batch_size={batch_size} is more than the {n_windows} training windows")
    gen = torch.Generator().manual_seed(int(seed))
    order: list[int] = []
    while len(order) < steps * batch_size:
        order += torch.randperm(n_windows, generator=gen).tolist()
    return [torch.tensor(order[s * batch_size:(s + 1) * batch_size]) for s in range(steps)]


# --- training ----------------------------------------------------------------------------------------------


@dataclass
class TrainingRun:
    """One training run (chapter 09): the loss at every step, and ``evaluate(student)`` at each checkpoint step."""

    loss: str
    seed: int
    losses: list[float]
    checkpoints: dict[int, object]
    tokens_per_step: int
    seconds: float
    eval_seconds: float = 0.0


def _loss_on(logits: torch.Tensor, data: DistillData, batch: torch.Tensor, cols: slice, loss: str) -> torch.Tensor:
    if loss == "hard":
        return hard_label_loss(logits, data.next_tokens[batch][:, cols].to(logits.device))
    t = data.targets
    return top_k_distillation_loss(logits, t.indices[batch][:, cols].to(logits.device),
                                   t.probs[batch][:, cols].to(logits.device), t.temperature)


def _check_head_split(student, data: DistillData) -> None:
    """The chunked loss runs the decoder, then the LM head a slice at a time: that is the model's forward only where
    the logits are the head applied to the last hidden state (no scaling or capping after it)."""
    x = data.inputs[:1, :4].to(student.device)
    with torch.no_grad():
        whole = student(x, use_cache=False).logits
        split = student.get_output_embeddings()(student.get_decoder()(input_ids=x, use_cache=False).last_hidden_state)
    if not torch.allclose(whole, split, rtol=1e-4, atol=1e-5):
        raise ValueError(f"{type(student).__name__} changes its logits after the LM head; train_student's chunked "
                         f"loss supports models whose logits are lm_head(last hidden state) (llama, qwen2, ...)")


def training_step(student, data: DistillData, batch: torch.Tensor, loss: str, loss_chunk: int = 64) -> float:
    """One step's loss (mean over the batch's positions) and its gradients, the LM head ``loss_chunk`` positions
    at a time: only that many positions' vocabulary-wide logits (and their gradients) exist at once."""
    hidden = student.get_decoder()(input_ids=data.inputs[batch].to(student.device), use_cache=False).last_hidden_state
    detached = hidden.detach().requires_grad_(True)
    head, n, total = student.get_output_embeddings(), hidden.shape[1], 0.0
    for a in range(0, n, loss_chunk):
        cols = slice(a, min(a + loss_chunk, n))
        part = _loss_on(head(detached[:, cols]), data, batch, cols, loss) * ((cols.stop - a) / n)
        part.backward()                                  # into detached.grad; the head itself is frozen
        total += float(part.detach())
    hidden.backward(detached.grad)                       # then through the decoder layers
    return total


def train_student(student, data: DistillData, *, loss: str, steps: int, batch_size: int = 1, lr: float = 1e-3,
                  seed: int = 0, checkpoints: Sequence[int] = (), evaluate: Callable | None = None,
                  max_grad_norm: float = 1.0, loss_chunk: int = 64, train: str = "all",
                  progress: bool = False) -> TrainingRun:
    """Train ``student`` in place with the soft-label (``loss="soft"``: :func:`top_k_distillation_loss` on the
    teacher's stored targets) or the hard-label loss (``"hard"``: :func:`hard_label_loss`) (chapter 09).

    Adam (no weight decay) on every parameter but the token embedding and the LM head (frozen), gradient norm clipped to
    ``max_grad_norm``, constant learning rate ``lr``; the batches are :func:`batch_order` (``seed``).
    ``train="unquantized"`` trains only what a weight quantizer leaves in floating point (norm gains, biases),
    the projection weights frozen as they are (the control arm of quantization-aware training).
    ``evaluate(student)`` runs at every step in ``checkpoints`` (0 = before training); its results, by step,
    are :attr:`TrainingRun.checkpoints`. The optimizer's state is freed when the function returns.
    The loss is the mean over every position of the batch, computed (with its gradient) ``loss_chunk`` positions
    at a time: the logits are the largest tensors of a step (positions × vocabulary), and only a slice of them
    exists at once. (64 rather than 32: with chapter 09's 4-layer student of the embedded model, 128-token windows,
    a step took 0.134 s against 0.157 s, medians of three rounds on a 2-core Xeon; 128 was no quicker than 64.)
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if not isinstance(data, DistillData):
        raise TypeError(f"data must be DistillData from distillation_data, got {type(data).__name__}")
    check_positive_int("steps", steps)
    check_positive_int("loss_chunk", loss_chunk)
    lr = check_finite("lr", lr, minimum=0.0, strict=True)
    points = sorted(set(checkpoints))
    if any(not isinstance(c, int) or not 0 <= c <= steps for c in points):
        raise ValueError(f"checkpoints must be steps from 0 to {steps}, got {list(checkpoints)}")
    params = _freeze_shared(student, train)    # the embedding and head get no gradient, whatever their flags say
    if not params:
        raise ValueError("the student has no trainable parameters")
    if data.targets.vocab_size != student.get_output_embeddings().weight.shape[0]:
        raise ValueError(f"the targets cover {data.targets.vocab_size:,} tokens, the student's vocabulary "
                         f"{student.get_output_embeddings().weight.shape[0]:,}: mismatched vocabularies")
    _check_head_split(student, data)
    torch.manual_seed(seed)
    batches = batch_order(data.n_windows, steps, batch_size, seed)
    # one fused kernel per tensor, in place (CPU and CUDA have it): no optimizer-wide temporaries, and a step ~0.02 s
    # quicker than one tensor at a time with separate operations (foreach=False, the fallback elsewhere)
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    opt = torch.optim.Adam(params, lr=lr, fused=True) if fused else torch.optim.Adam(params, lr=lr, foreach=False)
    results, losses, eval_s = {}, [], 0.0
    t0 = time.perf_counter()

    def checkpoint(step):
        nonlocal eval_s
        if evaluate is not None and step in points:
            t1 = time.perf_counter()
            student.eval()
            with torch.no_grad(), parametrize.cached():   # a quantization-aware student rounds its weights once per
                results[step] = evaluate(student)           # evaluation, not once per forward pass (the same values)
            eval_s += time.perf_counter() - t1

    checkpoint(0)
    # a frozen quantization-aware weight (train="unquantized") rounds to the same values at every step: once is enough
    rounding = parametrize.cached() if train == "unquantized" else contextlib.nullcontext()
    with torch.enable_grad(), rounding:
        for step, batch in enumerate(progress_bar(batches, f"{loss}-label training", enabled=progress), start=1):
            student.train()
            value = training_step(student, data, batch, loss, loss_chunk)
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)          # free the gradients before an evaluation needs the memory
            losses.append(value)
            checkpoint(step)
    del opt
    student.eval()
    return TrainingRun(loss, seed, losses, results, batch_size * data.seq_len, time.perf_counter() - t0, eval_s)


# --- quantization-aware training -----------------------------------------------------------------------------


class SteFakeQuantize(torch.nn.Module):
    """A parametrization of a weight W: the forward pass computes with ``fake_quantize(W, scheme)`` (chapter 05's
    round-to-nearest), the backward pass hands the gradient to W unchanged (a straight-through estimator:
    rounding has zero gradient almost everywhere, so the estimator pretends it is the identity)."""

    def __init__(self, scheme: Scheme):
        super().__init__()
        if not isinstance(scheme, Scheme):
            raise TypeError(f"expected a Scheme, got {type(scheme).__name__}")
        self.scheme = scheme

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        w_hat = fake_quantize(w.detach(), self.scheme).to(w.dtype)
        return w + (w_hat - w).detach()                 # value: w_hat; gradient: d/dw of w, the identity


def quantization_aware(model, scheme: Scheme) -> list[str]:
    """Make every projection matrix of ``model`` compute with its ``scheme``-quantized weight, trainable through
    :class:`SteFakeQuantize` (the latent full-precision weights stay the parameters). Returns the names."""
    mods = projection_modules(model)
    if not mods:
        raise ValueError("the model has no nn.Linear projection matrices to quantize")
    for module in mods.values():
        if parametrize.is_parametrized(module, "weight"):
            raise ValueError("this model is already quantization-aware")
        parametrize.register_parametrization(module, "weight", SteFakeQuantize(scheme))
    return list(mods)


def bake_quantized(model) -> None:
    """Replace each :class:`SteFakeQuantize` parametrization by the quantized weight it computes (no latent weight
    left): the model is then an ordinary model whose projection weights are exactly representable in the scheme."""
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


# --- judging against several references at once ------------------------------------------------------------


@torch.no_grad()
def compare_to_references(model, refs: dict) -> dict:
    """``{name: compare_to_reference(model, ref)}`` (chapter 07's comparison) for references recorded on the same
    text and windows, from **one** pass of ``model`` over the scored positions: chapter 09 judges a quantized
    student against the full-precision student and against the teacher, and the model's log-probabilities are
    the same for both. Each result equals what :func:`course_utils.evaluate.compare_to_reference` returns."""
    from .evaluate import KLDResult, ReferenceRun, scored_logprobs, token_stats
    if not isinstance(refs, dict) or not refs:
        raise ValueError("refs must be a non-empty dict {name: ReferenceRun}")
    first = next(iter(refs.values()))
    for name, ref in refs.items():
        if not isinstance(ref, ReferenceRun):
            raise TypeError(f"refs[{name!r}] must be a ReferenceRun from record_reference, got {type(ref).__name__}")
        if not ref.chunks:
            raise ValueError(f"refs[{name!r}] was released; record it again")
        if ref.windows != first.windows or not torch.equal(ref.ids.cpu(), first.ids.cpu()):
            raise ValueError(f"refs[{name!r}] was recorded on other text or windows than the first reference: "
                             "one pass serves only references of the same scored positions")
    t0, parts, a = time.perf_counter(), {name: [] for name in refs}, 0
    for lq, t in scored_logprobs(model, first.ids, first.windows):
        if lq.shape[-1] != first.vocab_size:
            raise ValueError(f"the candidate's vocabulary has {lq.shape[-1]:,} tokens, the references' "
                             f"{first.vocab_size:,}: KL divergence needs the same vocabulary")
        for name, ref in refs.items():
            parts[name].append(token_stats(ref.rows(a, a + len(t)), lq, t))
        a += len(t)
    seconds = time.perf_counter() - t0
    return {name: KLDResult(**{k: torch.cat([p[k] for p in ps]).numpy() for k in ps[0]}, seconds=seconds)
            for name, ps in parts.items()}
