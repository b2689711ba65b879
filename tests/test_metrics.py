"""pass@k against exact binomial arithmetic."""

import math

import pytest

from posttrain.scoring.metrics import mean_pass_at_k, pass_at_k


def exact(n, c, k):
    return 1 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("n,c,k", [
    (1, 0, 1),      # one wrong sample
    (1, 1, 1),      # one right sample
    (10, 3, 1),     # pass@1 is the plain success rate
    (10, 3, 5),     # middle of the range
    (10, 0, 10),    # never solved: 0 whatever k
    (10, 10, 1),    # always solved: 1 whatever k
    (16, 1, 8),     # one success among many
    (64, 7, 64),    # k = n: any success counts
    (64, 60, 8),    # fewer wrong than k: exactly 1
    (200, 13, 50),  # larger n
])
def test_matches_exact_binomial(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(exact(n, c, k), abs=1e-12)


def test_stable_for_thousands_of_samples():
    # math.comb is exact with big integers; the product form must agree without overflow
    assert pass_at_k(5000, 17, 100) == pytest.approx(exact(5000, 17, 100), rel=1e-9)


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_mean_over_prompts():
    assert mean_pass_at_k([0, 4], n=4, k=1) == pytest.approx(0.5)
