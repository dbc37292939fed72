"""Tests for course_utils.lowbit_kernels (chapter 05): every kernel agrees with its de-quantised weights."""
from __future__ import annotations

import pytest
import torch

from course_utils import lowbit_kernels as K
from course_utils.quantize import Scheme, fake_quantize


def _weights():
    torch.manual_seed(0)
    return [torch.randn(96, 128) * 0.05, torch.randn(128, 96) * 0.05]


def test_int8_pack_reconstructs_per_row_int8():
    w = _weights()[0]
    codes, scales, w_hat = K.int8_pack(w)
    assert codes.dtype == torch.int8 and codes.abs().max() == 127
    assert torch.allclose(w_hat, fake_quantize(w, Scheme("absmax", 8, "row")), atol=1e-6)


def test_int4_codes_are_the_minmax_scheme():
    w = _weights()[0]
    codes, sz, w_hat = K.int4_codes(w, 32)
    assert codes.min() >= 0 and codes.max() <= 15 and sz.shape == (128 // 32, 96, 2)
    assert torch.allclose(w_hat, fake_quantize(w, Scheme("minmax", 4, "group", 32)), atol=1e-6)


def test_int4_group_size_is_the_largest_accepted_divisor():
    assert [K.int4_group_size(n) for n in (4096, 576, 96)] == [128, 64, 32]
    with pytest.raises(ValueError, match="multiple of 32"):
        K.int4_group_size(100)


def test_every_kernel_matches_its_reference():
    forms = K.build_forms(_weights())
    passes = K.matmul_passes(forms)
    errors = K.check_passes(forms, passes)
    assert {"fp32", "bf16", "naive: de-quantise int8, then fp32"} <= set(errors)
    assert any(name.startswith("int8") for name in errors)
    for name, err in errors.items():
        assert err <= K.tolerance(name), (name, err)
    assert errors["fp32"] == 0.0


def test_kernel_outputs_have_the_right_shapes():
    forms = K.build_forms(_weights())
    for name, run in K.matmul_passes(forms).items():
        outs = run()
        assert [tuple(o.shape) for o in outs] == [(1, 96), (1, 128)], name


def test_a_failing_kernel_is_reported_not_raised():
    forms = K.build_forms(_weights())
    passes = K.matmul_passes(forms)

    def broken():
        raise NotImplementedError("no kernel for this device")

    passes["int2 weight-only"] = broken
    errors = K.check_passes(forms, passes)
    assert "int2 weight-only" not in errors and "int2 weight-only" not in passes
    assert "no kernel" in forms.unavailable["int2 weight-only"]


def test_time_matmuls_reports_every_available_precision():
    res = K.time_matmuls(_weights(), repeats=2)
    rel = res.relative_to_fp32()
    assert rel["fp32"] == 1.0 and set(rel) == set(res.errors)
    assert res.bytes_per_form["bf16"] * 2 == res.bytes_per_form["fp32"]
    assert res.bytes_per_form["int8"] < res.bytes_per_form["bf16"]
    if "int4" not in res.unavailable:
        assert res.bytes_per_form["int4"] < res.bytes_per_form["int8"]


def test_bad_weights_are_rejected():
    with pytest.raises(ValueError, match="non-empty list of 2-D"):
        K.build_forms([])
    with pytest.raises(ValueError, match="non-empty list of 2-D"):
        K.build_forms([torch.randn(4)])
    with pytest.raises(ValueError, match="2-D"):
        K.int8_pack(torch.randn(2, 3, 4))
