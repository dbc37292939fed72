"""Chapter 09: the temperature property, the distillation losses against direct computations, a student that
is an exact copy of the teacher's layers (and trains without touching the teacher), the seeded batches, and
quantization-aware training with a straight-through estimator."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from course_utils import distill as D
from course_utils.quantize import Scheme, fake_quantize
from course_utils.sampling import sampling_probs
from course_utils.speculative import early_exit_draft


def _logits(*shape, seed=0, scale=3.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# --- temperature -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 4.0])
def test_a_probability_ratio_at_temperature_t_is_the_t1_ratio_to_the_power_1_over_t(temperature):
    z = _logits(1000, scale=4.0).double()
    p1, pt = sampling_probs(z, 1.0).double(), sampling_probs(z, temperature).double()
    a, b, c = z.topk(3).indices.tolist()
    for x, y in ((a, c), (a, b), (b, c)):
        assert pt[x] / pt[y] == pytest.approx(D.tempered_ratio(float(p1[x] / p1[y]), temperature), rel=1e-4)
    assert D.tempered_ratio(2.24, 2.0) == pytest.approx(1.50, abs=0.005)      # the reference's figures
    if temperature != 1.0:                                                      # the check can fail: not 1/T²
        wrong = float(p1[a] / p1[c]) ** (1 / temperature ** 2)
        assert abs(float(pt[a] / pt[c]) - wrong) > 1e-3 * wrong


# --- the losses -------------------------------------------------------------------------------------------

def _direct_kl(p_logits, q_logits, temperature, reverse=False):
    """KL(p_T || q_T) (or the reverse) position by position with plain Python floats, times T², averaged."""
    total = 0.0
    for zp, zq in zip(p_logits.double().tolist(), q_logits.double().tolist()):
        def softmax(z):
            m = max(z)
            e = [math.exp((v - m) / temperature) for v in z]
            s = sum(e)
            return [v / s for v in e]
        p, q = softmax(zp), softmax(zq)
        if reverse:
            p, q = q, p
        total += sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q) if a > 0)
    return total / len(p_logits) * temperature ** 2


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("reverse", [False, True])
def test_distillation_loss_equals_a_direct_computation(temperature, reverse):
    teacher, student = _logits(6, 50, seed=1), _logits(6, 50, seed=2)
    got = D.distillation_loss(student, teacher, temperature, reverse=reverse)
    assert float(got) == pytest.approx(_direct_kl(teacher, student, temperature, reverse), rel=1e-5)
    assert float(D.distillation_loss(teacher, teacher, temperature, reverse=reverse)) == pytest.approx(0.0, abs=1e-6)


def test_forward_and_reverse_kl_differ():
    teacher, student = _logits(4, 30, seed=3), _logits(4, 30, seed=4, scale=1.0)
    assert abs(float(D.distillation_loss(student, teacher)) - float(D.distillation_loss(student, teacher, reverse=True))) > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_the_gradient_of_the_scaled_loss_is_t_times_q_minus_p(temperature):
    teacher, student = _logits(5, 40, seed=5), _logits(5, 40, seed=6).requires_grad_(True)
    D.distillation_loss(student, teacher, temperature).backward()
    expected = temperature * (torch.softmax(student.detach() / temperature, -1) - torch.softmax(teacher / temperature, -1)) / 5
    torch.testing.assert_close(student.grad, expected, rtol=1e-4, atol=1e-6)


def test_hard_label_loss_is_the_cross_entropy_of_the_next_token():
    logits, tokens = _logits(2, 7, 20, seed=7), torch.randint(0, 20, (2, 7), generator=torch.Generator().manual_seed(0))
    direct = -sum(torch.log_softmax(logits[b, i].double(), -1)[tokens[b, i]] for b in range(2) for i in range(7)) / 14
    assert float(D.hard_label_loss(logits, tokens)) == pytest.approx(float(direct), rel=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_top_k_loss_is_the_full_loss_at_k_equal_vocab_and_never_above_it(temperature):
    teacher, student = _logits(3, 8, 64, seed=8), _logits(3, 8, 64, seed=9)
    full = float(D.distillation_loss(student, teacher, temperature))
    whole = D.top_k_targets(teacher, 64, temperature)
    assert float(D.top_k_distillation_loss(student, whole.indices, whole.probs, temperature)) == pytest.approx(full, rel=1e-4)
    previous = 0.0
    for k in (1, 4, 16, 63):
        t = D.top_k_targets(teacher, k, temperature)
        assert t.indices.shape == (3, 8, k) and t.nbytes == 3 * 8 * k * 8 and t.full_nbytes() == 3 * 8 * 64 * 4
        loss = float(D.top_k_distillation_loss(student, t.indices, t.probs, temperature))
        assert 0.0 <= loss <= full + 1e-5
        assert loss >= previous - 1e-5                 # splitting the rest bucket further can only add divergence
        previous = loss
    assert float(D.top_k_distillation_loss(teacher, *_ip(D.top_k_targets(teacher, 5, temperature)), temperature)) \
        == pytest.approx(0.0, abs=1e-5)


def _ip(t):
    return t.indices, t.probs


def test_top_k_targets_use_the_sampling_distribution():
    z = _logits(4, 30, seed=10)
    t = D.top_k_targets(z, 3, 2.0)
    values, ids = sampling_probs(z, 2.0).topk(3, -1)
    assert torch.equal(t.indices.long(), ids) and torch.equal(t.probs, values) and t.k == 3


@pytest.mark.parametrize("call, match", [
    (lambda: D.distillation_loss(torch.zeros(2, 5), torch.zeros(2, 5), 0.0), "temperature"),
    (lambda: D.distillation_loss(torch.zeros(2, 5), torch.zeros(2, 5), -1.0), "temperature"),
    (lambda: D.distillation_loss(torch.zeros(2, 5), torch.zeros(2, 6)), "vocabulary"),
    (lambda: D.top_k_targets(torch.zeros(2, 5), 6), "larger than the vocabulary"),
    (lambda: D.top_k_targets(torch.zeros(2, 5), 0), "positive integer"),
    (lambda: D.top_k_targets(torch.zeros(2, 5), 2, float("nan")), "temperature"),
    (lambda: D.top_k_distillation_loss(torch.zeros(2, 5), torch.full((2, 3), 7, dtype=torch.int32), torch.zeros(2, 3)),
     "vocabulary"),
    (lambda: D.top_k_distillation_loss(torch.zeros(2, 5), torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 2)),
     "indices and probs"),
    (lambda: D.hard_label_loss(torch.zeros(2, 5), torch.tensor([1, 5])), "vocabulary"),
    (lambda: D.hard_label_loss(torch.zeros(2, 5), torch.tensor([1.0, 2.0])), "integer ids"),
    (lambda: D.tempered_ratio(2.0, 0), "temperature"),
    (lambda: D.batch_order(4, 2, 5, 0), "batch_size"),
])
def test_bad_input_is_refused_clearly(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- the student -------------------------------------------------------------------------------------------

@pytest.fixture
def teacher():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


IDS = torch.tensor([[3, 17, 5, 60, 2, 9, 41, 8, 77, 1, 30, 12]])


def test_a_student_of_the_first_layers_computes_what_the_early_exit_draft_computes(teacher):
    student = D.student_from_teacher(teacher, range(2))
    with torch.no_grad():
        assert torch.equal(student(IDS).logits, early_exit_draft(teacher, 2)(IDS).logits)


def test_the_student_copies_its_layers_and_shares_the_frozen_embedding_and_head(tiny_model):
    teacher = copy.deepcopy(tiny_model)                    # building a student freezes its teacher
    student = D.student_from_teacher(teacher, [1])
    assert student.get_input_embeddings().weight is teacher.get_input_embeddings().weight
    assert student.get_output_embeddings().weight is teacher.get_output_embeddings().weight
    assert not student.get_input_embeddings().weight.requires_grad
    assert not student.get_output_embeddings().weight.requires_grad
    s_layer, t_layer = student.model.layers[0], teacher.model.layers[1]
    for (name, a), b in zip(s_layer.named_parameters(), t_layer.parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr() and a.requires_grad, name
    sizes = D.parameter_bytes(student)
    layer_bytes = sum(p.numel() * 4 for p in s_layer.parameters()) + student.model.norm.weight.numel() * 4
    assert sizes["trainable"] == layer_bytes and sizes["adam_state"] == 2 * layer_bytes
    frozen = {id(p): p for p in (student.get_input_embeddings().weight, student.get_output_embeddings().weight)}
    assert sizes["frozen"] == sum(p.numel() * 4 for p in frozen.values())


def test_a_student_of_layers_out_of_order_runs_with_a_kv_cache(teacher):
    """Kept layers are renumbered for the cache: cached decoding gives the logits of a full pass."""
    from transformers import DynamicCache
    student = D.student_from_teacher(teacher, [3, 0])
    with torch.no_grad():
        full = student(IDS).logits[0]
        cache = DynamicCache(config=student.config)
        first = student(IDS[:, :8], cache=cache, use_cache=True).logits[0]
        rest = [student(IDS[:, i:i + 1], cache=cache, use_cache=True).logits[0, -1] for i in range(8, IDS.shape[1])]
    torch.testing.assert_close(torch.cat([first, torch.stack(rest)]), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layers, match", [([], "at least one"), ([0, 0], "distinct"), ([0, 1, 2, 3], "fewer"),
                                           ([4], "0..3"), ([True], "0..3")])
def test_bad_layer_choices_are_refused(teacher, layers, match):
    with pytest.raises(ValueError, match=match):
        D.student_from_teacher(teacher, layers)


def test_evenly_spaced_layers_span_the_teacher():
    assert D.evenly_spaced_layers(30, 4) == [0, 10, 19, 29]
    assert D.evenly_spaced_layers(2, 1) == [0] and D.evenly_spaced_layers(5, 2) == [0, 4]
    with pytest.raises(ValueError, match="fewer layers"):
        D.evenly_spaced_layers(4, 4)


def test_copy_student_shares_only_the_frozen_tensors(teacher):
    student = D.student_from_teacher(teacher, [0])
    twin = D.copy_student(student)
    assert twin.get_input_embeddings().weight is student.get_input_embeddings().weight
    a, b = twin.model.layers[0].mlp.up_proj.weight, student.model.layers[0].mlp.up_proj.weight
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


# --- data and training ------------------------------------------------------------------------------------

def test_batch_order_is_seeded_and_visits_every_window_once_per_epoch():
    a, b, c = D.batch_order(6, 5, 2, seed=1), D.batch_order(6, 5, 2, seed=1), D.batch_order(6, 5, 2, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not all(torch.equal(x, y) for x, y in zip(a, c))
    first_epoch = torch.cat(a[:3]).tolist()
    assert sorted(first_epoch) == list(range(6))


def _text(n=161, seed=0):
    return torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def test_distillation_data_holds_the_teachers_top_k_at_each_input(teacher):
    data = D.distillation_data(teacher, _text(), 16, 5)
    assert (data.n_windows, data.seq_len, data.targets.k) == (10, 16, 5)
    assert torch.equal(data.inputs.flatten()[1:], data.next_tokens.flatten()[:-1])
    with torch.no_grad():
        logits = teacher(data.inputs[3:4]).logits[0]
    expected = D.top_k_targets(logits, 5)
    assert torch.equal(data.targets.indices[3], expected.indices) and torch.equal(data.targets.probs[3], expected.probs)
    with pytest.raises(ValueError, match="window"):
        D.distillation_data(teacher, _text(10), 16, 5)


@pytest.mark.parametrize("loss", ["soft", "hard"])
def test_training_lowers_the_loss_and_leaves_the_teacher_unchanged(teacher, loss):
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    data = D.distillation_data(teacher, _text(), 16, 8)
    student = D.student_from_teacher(teacher, [0])

    def soft_loss_to_teacher(model):
        return float(D.top_k_distillation_loss(model(data.inputs).logits, data.targets.indices, data.targets.probs))

    run = D.train_student(student, data, loss=loss, steps=30, batch_size=2, lr=3e-3, seed=0,
                          checkpoints=[0, 15, 30], evaluate=soft_loss_to_teacher)
    assert len(run.losses) == 30 and sorted(run.checkpoints) == [0, 15, 30] and run.tokens_per_step == 32
    assert sum(run.losses[-5:]) < sum(run.losses[:5])
    if loss == "soft":
        assert run.checkpoints[30] < run.checkpoints[0]
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())
    assert all(p.grad is None for p in student.parameters())


def test_the_same_seed_gives_the_same_run(teacher):
    data = D.distillation_data(teacher, _text(), 16, 4)
    runs = [D.train_student(D.student_from_teacher(teacher, [0]), data, loss="soft", steps=4, seed=3) for _ in range(2)]
    assert runs[0].losses == runs[1].losses


@pytest.mark.parametrize("kw, match", [(dict(loss="kd"), "loss must be"), (dict(checkpoints=[5]), "checkpoints"),
                                       (dict(lr=0.0), "lr"), (dict(steps=0), "steps")])
def test_training_refuses_bad_settings(teacher, kw, match):
    data = D.distillation_data(teacher, _text(), 16, 4)
    args = dict(loss="soft", steps=2) | kw
    with pytest.raises(ValueError, match=match):
        D.train_student(D.student_from_teacher(teacher, [0]), data, **args)


def test_training_refuses_targets_over_another_vocabulary(teacher, tiny_llama):
    data = D.distillation_data(tiny_llama, torch.randint(0, 128, (1, 40)), 8, 4)        # vocabulary of 128, not 96
    with pytest.raises(ValueError, match="vocabular"):
        D.train_student(D.student_from_teacher(teacher, [0]), data, loss="soft", steps=1)


# --- quantization-aware training -------------------------------------------------------------------------------

SCHEME = Scheme("absmax", 4, "row")


def test_the_straight_through_estimator_computes_quantized_and_passes_the_gradient_through():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8, bias=False)
    w0 = lin.weight.detach().clone()
    x = torch.randn(5, 16)
    D.quantization_aware(torch.nn.Sequential(lin), SCHEME)
    assert torch.equal(lin.weight, fake_quantize(w0, SCHEME))
    lin(x).pow(2).sum().backward()
    w_hat = fake_quantize(w0, SCHEME).requires_grad_(True)
    (x @ w_hat.T).pow(2).sum().backward()
    latent = lin.parametrizations.weight.original
    torch.testing.assert_close(latent.grad, w_hat.grad)          # the gradient at the quantized weight, unchanged


def test_bake_leaves_weights_exactly_representable_and_refuses_twice(teacher):
    student = D.student_from_teacher(teacher, [0])
    D.quantization_aware(student, SCHEME)
    with pytest.raises(ValueError, match="already"):
        D.quantization_aware(student, SCHEME)
    D.bake_quantized(student)
    w = student.model.layers[0].self_attn.q_proj.weight
    assert isinstance(w, torch.nn.Parameter) and torch.equal(fake_quantize(w.detach(), SCHEME), w.detach())
    with pytest.raises(TypeError, match="Scheme"):
        D.SteFakeQuantize("INT4")


def test_quantization_aware_training_lowers_the_loss_to_the_full_precision_model(teacher):
    student = D.student_from_teacher(teacher, [0, 1])
    data = D.distillation_data(student, _text(), 16, 8)            # the full-precision student is the target
    qat = D.copy_student(student)
    D.quantization_aware(qat, Scheme("absmax", 2, "row"))

    def loss(model):
        return float(D.top_k_distillation_loss(model(data.inputs).logits, data.targets.indices, data.targets.probs))

    run = D.train_student(qat, data, loss="soft", steps=30, batch_size=2, lr=2e-3, checkpoints=[0, 30], evaluate=loss)
    assert run.checkpoints[30] < run.checkpoints[0]
    D.bake_quantized(qat)
    w = qat.model.layers[1].mlp.down_proj.weight.detach()
    assert torch.equal(fake_quantize(w, Scheme("absmax", 2, "row")), w)


def test_training_only_the_unquantized_parameters_leaves_the_rounded_weights_as_they_are(teacher):
    """The control arm of QAT: round-to-nearest weights, and only the norms' gains (and biases) trained."""
    student = D.student_from_teacher(teacher, [0, 1])
    data = D.distillation_data(student, _text(), 16, 8)
    arm = D.copy_student(student)
    D.quantization_aware(arm, Scheme("absmax", 2, "row"))
    before = {n: p.detach().clone() for n, p in arm.named_parameters()}
    D.train_student(arm, data, loss="soft", steps=5, batch_size=2, lr=1e-2, train="unquantized")
    changed = {n for n, p in arm.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("norm" in n for n in changed), changed                 # the gains moved, nothing else
    assert not any("original" in n or "proj" in n for n in changed)
    full = D.copy_student(student)                                               # "all": the projections move too
    D.quantization_aware(full, Scheme("absmax", 2, "row"))
    D.train_student(full, data, loss="soft", steps=5, batch_size=2, lr=1e-2, train="all")
    moved = {n for n, p in full.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert any("original" in n for n in moved)
    with pytest.raises(ValueError, match="train must be one of"):
        D.train_student(arm, data, loss="soft", steps=1, train="norms")


def test_the_control_arm_rounds_its_frozen_weights_once_and_trains_to_the_same_numbers(teacher, monkeypatch):
    """train="unquantized" keeps the rounded projections for the whole run (parametrize.cached): the losses and the
    trained parameters are those of rounding them again at every step, bit for bit."""
    import contextlib

    student = D.student_from_teacher(teacher, [0, 1])
    data = D.distillation_data(student, _text(), 16, 8)
    arms, roundings = [], []
    for cache in (True, False):
        arm = D.copy_student(student)
        D.quantization_aware(arm, Scheme("absmax", 4, "row"))
        calls = []
        with monkeypatch.context() as m:
            m.setattr(D, "fake_quantize", lambda w, s, f=D.fake_quantize: calls.append(1) or f(w, s))
            if not cache:
                m.setattr(D.parametrize, "cached", contextlib.nullcontext)
            run = D.train_student(arm, data, loss="soft", steps=4, batch_size=2, lr=1e-2, train="unquantized")
        arms.append((run.losses, {n: p.detach().clone() for n, p in arm.named_parameters()}))
        roundings.append(len(calls))
    n = len(D.projection_modules(arm))                 # two forward passes check the head's split first, uncached
    assert roundings == [2 * n + n, 2 * n + 4 * n], roundings         # then once per matrix, against once per step
    assert arms[0][0] == arms[1][0]
    assert all(torch.equal(p, arms[1][1][n]) for n, p in arms[0][1].items())


# --- soft labels -------------------------------------------------------------------------------------------------

class _Tok:
    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        class Out:
            input_ids = torch.tensor([[ord(c) % 96 for c in text]])
        return Out()

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def test_soft_labels_give_the_top_tokens_at_any_temperature(teacher):
    labels = D.soft_labels(teacher, _Tok(), "She poured the milk into the")
    top1, top2 = labels.top(5, 1.0), labels.top(5, 2.0)
    assert [i for i, _, _ in top1] == [i for i, _, _ in top2]                   # the order never changes
    assert all(a[2] >= b[2] for a, b in zip(top1, top1[1:])) and sum(p for *_, p in top1) <= 1 + 1e-6
    assert top2[0][2] / top2[2][2] == pytest.approx(D.tempered_ratio(top1[0][2] / top1[2][2], 2.0), rel=1e-4)
    fig = D.soft_labels_figure(labels, 2.0, k=4)
    assert len(fig.data) == 1 and len(fig.data[0].y) == 4
    with pytest.raises(ValueError, match="vocabulary"):
        labels.top(97)
    with pytest.raises(ValueError, match="temperature"):
        labels.top(3, 0.0)
    with pytest.raises(ValueError, match="non-empty"):
        D.soft_labels(teacher, _Tok(), "")


def test_the_embedding_and_head_stay_frozen_whatever_their_flags(teacher):
    """Another function may switch requires_grad back on for shared tensors (assign=True loading does): training
    decides by role, so the embedding and head still get no gradient and do not change."""
    data = D.distillation_data(teacher, _text(), 16, 4)
    student = D.student_from_teacher(teacher, [0])
    emb = student.get_input_embeddings().weight
    before = emb.detach().clone()
    emb.requires_grad_(True)
    D.train_student(student, data, loss="hard", steps=3, lr=1e-2)
    assert torch.equal(emb, before) and emb.grad is None and not emb.requires_grad
    assert D.parameter_bytes(student)["frozen"] == emb.numel() * 4


@pytest.mark.parametrize("loss", ["soft", "hard"])
def test_the_chunked_step_gives_the_gradients_of_the_whole_loss(tiny_model, loss):
    teacher = copy.deepcopy(tiny_model)
    data = D.distillation_data(teacher, torch.randint(0, 128, (1, 49), generator=torch.Generator().manual_seed(1)), 12, 6)
    student = D.student_from_teacher(teacher, [1])
    batch = torch.tensor([0, 2])
    with torch.enable_grad():
        value = D.training_step(student, data, batch, loss, loss_chunk=5)            # 12 positions in slices of 5
        chunked = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
        student.zero_grad(set_to_none=True)
        whole = D._loss_on(student(data.inputs[batch]).logits, data, batch, slice(0, 12), loss)
        whole.backward()
    assert value == pytest.approx(float(whole.detach()), rel=1e-5)
    assert chunked and set(chunked) == {n for n, p in student.named_parameters() if p.grad is not None}
    for n, p in student.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(chunked[n], p.grad, rtol=1e-4, atol=1e-6)


def test_a_model_that_rescales_its_logits_is_refused(teacher):
    data = D.distillation_data(teacher, _text(), 16, 4)
    student = D.student_from_teacher(teacher, [0])
    forward = student.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out
    student.forward = scaled
    with pytest.raises(ValueError, match="after the LM head"):
        D.train_student(student, data, loss="soft", steps=1)


# --- one pass judged against several references -------------------------------------------------------------

def test_one_pass_against_two_references_equals_two_separate_comparisons(teacher, tmp_path):
    import numpy as np

    from course_utils.evaluate import Windows, compare_to_reference, record_reference
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    windows = Windows(n_tokens=24, window=20, stride=12, chunk=4)
    other = D.student_from_teacher(teacher, [0, 3])
    refs = {"teacher": record_reference(teacher, ids[:, :windows.tokens_needed], windows),
            "other": record_reference(other, ids[:, :windows.tokens_needed], windows, spill_dir=str(tmp_path))}
    candidate = D.student_from_teacher(teacher, [1])
    both = D.compare_to_references(candidate, refs)
    for name, ref in refs.items():
        alone = compare_to_reference(candidate, ref)
        for field in ("kld", "nll", "nll_base", "p_diff", "same_top"):
            assert np.array_equal(getattr(both[name], field), getattr(alone, field)), (name, field)
    assert not np.array_equal(both["teacher"].kld, both["other"].kld)       # each against its own reference
    shifted = record_reference(teacher, ids[:, 1:windows.tokens_needed + 1], windows)
    with pytest.raises(ValueError, match="other text or windows"):
        D.compare_to_references(candidate, {"teacher": refs["teacher"], "shifted": shifted})
    with pytest.raises(ValueError, match="non-empty"):
        D.compare_to_references(candidate, {})
