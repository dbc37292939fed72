"""Student's t, written out for whole degrees of freedom, and the paired test chapter 09 judges seeds with."""
from __future__ import annotations

import math
import random

import pytest
import torch

from course_utils.stats import paired_t_test, proportions_apart, t_p_value, t_quantile


@pytest.mark.parametrize("df,quantile", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (9, 2.2622),
                                         (30, 2.0423)])
def test_t_quantiles_match_the_tables(df, quantile):
    assert t_quantile(df) == pytest.approx(quantile, abs=1e-4)
    assert t_p_value(quantile, df) == pytest.approx(0.05, abs=1e-5)


def test_t_tails_at_known_points():
    assert t_p_value(0.0, 5) == pytest.approx(1.0)
    assert t_p_value(1.0, 1) == pytest.approx(0.5)                          # Cauchy: P(|T| >= 1) = 1/2
    assert t_p_value(-2.0, 2) == pytest.approx(1 - 2 / math.sqrt(6))         # closed form at df = 2
    assert t_p_value(1.959964, 100_000) == pytest.approx(0.05, abs=1e-4)     # the normal limit
    assert t_p_value(math.inf, 3) == 0.0


def test_paired_t_test_reads_seeds_not_standard_errors():
    # three seeds, differences -0.115, -0.089, -0.020: "two standard errors" would say soft is better; t(2) does not
    soft, hard = [2.0 - 0.115, 2.0 - 0.089, 2.0 - 0.020], [2.0, 2.0, 2.0]
    test = paired_t_test(soft, hard)
    assert test.df == 2 and abs(test.mean) > 2 * test.se
    assert test.p_value == pytest.approx(0.1189, abs=1e-3)
    assert test.low < 0 < test.high and test.verdict("soft", "hard") == "within noise"
    clear = paired_t_test([1.0, 1.1, 0.9, 1.05, 0.95], [2.0, 2.0, 2.0, 2.0, 2.0])
    assert clear.verdict("soft", "hard") == "soft better" and clear.high < 0
    assert clear.verdict("soft", "hard", lower_is_better=False) == "hard better"


def test_paired_t_test_holds_its_level_under_no_difference():
    rng = random.Random(0)
    rejections = sum(paired_t_test([rng.gauss(0, 1) for _ in range(3)], [rng.gauss(0, 1) for _ in range(3)]).p_value
                     < 0.05 for _ in range(4000))
    assert 0.035 < rejections / 4000 < 0.065


@pytest.mark.parametrize("bad", [dict(a=[1.0], b=[2.0]), dict(a=[1.0, 2.0], b=[1.0]), dict(a=[1, 2], b=[1, 2], level=0)])
def test_paired_t_test_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        paired_t_test(**bad)


@pytest.mark.parametrize("df", [0, 1.5, True])
def test_degrees_of_freedom_are_whole_numbers(df):
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_p_value(1.0, df)


def test_binomial_p_value_is_the_exact_two_sided_test():
    from course_utils.stats import binomial_p_value
    assert binomial_p_value(5, 10, 0.5) == pytest.approx(1.0)
    assert binomial_p_value(0, 10, 0.5) == pytest.approx(2 * 0.5 ** 10)            # 0 and 10 are the extremes
    assert binomial_p_value(9, 10, 0.5) == pytest.approx(2 * 11 * 0.5 ** 10)
    assert binomial_p_value(0, 3000, 0.0) == 1.0 and binomial_p_value(1, 3000, 0.0) == 0.0
    assert binomial_p_value(3000, 3000, 1.0) == 1.0
    assert binomial_p_value(300, 3000, 0.5) < 1e-100                              # far off: tiny
    gen = torch.Generator().manual_seed(0)                                        # right p: rarely small
    draws = torch.bernoulli(torch.full((200, 400), 0.3), generator=gen).sum(1)
    small = sum(binomial_p_value(int(k), 400, 0.3) < 0.01 for k in draws)
    assert small <= 8
    for bad in [dict(k=-1, n=3, p=0.5), dict(k=4, n=3, p=0.5), dict(k=1, n=3, p=1.5)]:
        with pytest.raises(ValueError):
            binomial_p_value(**bad)


def test_two_rates_are_apart_beyond_z_pooled_standard_errors():
    # 60 of 100 against 40 of 100: pooled 0.5, standard error sqrt(0.25 * 2 / 100) = 0.0707; 0.2 apart is 2.8 of them
    assert proportions_apart(60, 100, 40, 100) and proportions_apart(40, 100, 60, 100)
    # 55 against 45: 0.1 apart is 1.4 standard errors, apart at z = 1 only
    assert not proportions_apart(55, 100, 45, 100)
    assert proportions_apart(55, 100, 45, 100, z=1.0)
    assert proportions_apart(10, 10, 0, 10) and not proportions_apart(10, 10, 10, 10)
    assert not proportions_apart(0, 0, 0, 0)                  # no trials on either side: nothing to tell apart
    assert not proportions_apart(0, 0, 20, 20) and not proportions_apart(20, 20, 0, 0)   # nor on one side
    for bad in [(5, 4, 1, 2), (-1, 4, 1, 2), (1, 4, 1.0, 2)]:
        with pytest.raises(ValueError, match="0 <= k <= n"):
            proportions_apart(*bad)
    with pytest.raises(ValueError, match="z must be positive"):
        proportions_apart(1, 2, 1, 2, z=0)
