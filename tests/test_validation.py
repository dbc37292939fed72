"""The shared input checks."""
from __future__ import annotations

import math

import pytest

from course_utils.validation import check_finite, check_non_negative_int, check_positive_int, check_positive_ints


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", None])
def test_positive_int_rejects(bad):
    with pytest.raises(ValueError, match="n must be a positive integer"):
        check_positive_int("n", bad)


def test_positive_and_non_negative_ints_accept():
    assert check_positive_int("n", 3) == 3
    assert check_non_negative_int("n", 0) == 0
    with pytest.raises(ValueError, match=">= 0"):
        check_non_negative_int("n", -1)
    assert check_positive_ints("sizes", (1, 2)) == [1, 2]
    with pytest.raises(ValueError, match="at least one"):
        check_positive_ints("sizes", [])
    with pytest.raises(ValueError, match="every entry of sizes"):
        check_positive_ints("sizes", [1, 0])


def test_finite():
    assert check_finite("x", 2) == 2.0
    for bad in (math.nan, math.inf, "1", True):
        with pytest.raises(ValueError, match="finite"):
            check_finite("x", bad)
    with pytest.raises(ValueError, match="> 0"):
        check_finite("x", 0, minimum=0, strict=True)
    with pytest.raises(ValueError, match=">= 1"):
        check_finite("x", 0.5, minimum=1)
