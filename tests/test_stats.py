"""Intervals and tests (posttrain.scoring.stats) against scipy.stats and statsmodels, case by case."""

import numpy as np
import pytest
from scipy import stats as sps
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.proportion import proportion_confint

from posttrain.scoring import stats
from posttrain.scoring.metrics import pass_at_k


@pytest.mark.parametrize("successes,n", [
    (0, 10),      # never right: the interval still has width
    (10, 10),     # always right
    (1, 2),       # tiny sample
    (209, 500),   # the default warmup's held-out accuracy
    (370, 500),   # the default GRPO stage's
    (3, 1000),    # rare success
])
def test_wilson_matches_statsmodels(successes, n):
    low, high = proportion_confint(successes, n, alpha=0.05, method="wilson")
    assert stats.wilson_interval(successes, n) == pytest.approx([low, high], abs=1e-12)


def pairs(b01, b10, agree_right=30, agree_wrong=20):
    """Paired verdicts with b01 prompts right only for b and b10 right only for a."""
    a = [1] * agree_right + [0] * agree_wrong + [0] * b01 + [1] * b10
    b = [1] * agree_right + [0] * agree_wrong + [1] * b01 + [0] * b10
    return a, b


@pytest.mark.parametrize("b01,b10", [
    (0, 0),       # identical verdicts: p = 1
    (5, 5),       # symmetric disagreement
    (12, 3),      # b better
    (3, 12),      # a better: the same p (two-sided)
    (0, 9),       # one-way disagreement
    (60, 25),     # many discordant prompts
])
def test_mcnemar_exact_matches_statsmodels_and_binomtest(b01, b10):
    a, b = pairs(b01, b10)
    table = [[30, b10], [b01, 20]]
    expected = mcnemar(table, exact=True).pvalue
    assert stats.mcnemar_exact(a, b) == pytest.approx(expected, abs=1e-12)
    if b01 + b10:
        assert stats.mcnemar_exact(a, b) == pytest.approx(sps.binomtest(b01, b01 + b10, 0.5).pvalue, abs=1e-12)


def per_prompt(seed, size, n=16, quality=0.4):
    rng = np.random.default_rng(seed)
    return rng.binomial(n, rng.beta(quality * 4, (1 - quality) * 4, size=size)).tolist()


@pytest.mark.parametrize("seed,k", [(0, 1), (1, 8), (2, 16)])
def test_bootstrap_interval_agrees_with_scipy(seed, k):
    values = stats.per_prompt_pass_at_k(per_prompt(seed, 500), 16, k)
    ours = stats.bootstrap_interval(values, resamples=20_000, seed=seed)
    reference = sps.bootstrap((values,), np.mean, n_resamples=20_000, method="percentile",
                              random_state=np.random.default_rng(seed + 100)).confidence_interval
    # two independent Monte Carlo runs of the same percentile interval
    assert ours == pytest.approx([reference.low, reference.high], abs=0.004)
    assert ours[0] < values.mean() < ours[1]


def test_per_prompt_pass_at_k_averages_to_the_reported_figure():
    counts = per_prompt(3, 200)
    values = stats.per_prompt_pass_at_k(counts, 16, 8)
    assert values.mean() == pytest.approx(np.mean([pass_at_k(16, c, 8) for c in counts]))


@pytest.mark.parametrize("shift", [0.0, 0.02, 0.05, 0.1])
def test_paired_bootstrap_p_agrees_with_the_paired_t_test(shift):
    # 500 prompts: the bootstrap of a mean difference is close to the t-test's normal theory
    rng = np.random.default_rng(7)
    a = rng.uniform(0, 1, 500)
    b = np.clip(a + shift + rng.normal(0, 0.25, 500), 0, 1)
    ours = stats.paired_bootstrap_p(a, b, resamples=20_000, seed=0)
    assert ours == pytest.approx(sps.ttest_rel(a, b).pvalue, abs=0.02)


def test_unpaired_bootstrap_p_agrees_with_welch():
    rng = np.random.default_rng(8)
    a, b = rng.uniform(0, 1, 400), rng.uniform(0.05, 1, 500)
    ours = stats.unpaired_bootstrap_p(a, b, resamples=20_000, seed=0)
    assert ours == pytest.approx(sps.ttest_ind(a, b, equal_var=False).pvalue, abs=0.02)


def outcomes(greedy, correct, prompts=None, n=16):
    return {"prompts": prompts or [f"{i}+0=" for i in range(len(greedy))], "greedy": greedy, "correct": correct, "n": n}


def test_identical_models_read_within_noise():
    same = outcomes([1, 0] * 250, per_prompt(4, 500))
    for metric in ("greedy_accuracy", "pass_at_k.8"):
        test = stats.compare(same, same, metric, resamples=2000, seed=0)
        assert test.p_value == 1.0 and test.difference == 0.0 and test.n_prompts == 500


def test_ten_points_worse_on_500_prompts_reads_significant():
    rng = np.random.default_rng(5)
    good = (rng.uniform(size=500) < 0.7).astype(int)
    worse = good.copy()
    worse[np.flatnonzero(good)[:50]] = 0                      # 50 of 500 prompts lost: 10 points
    counts = np.array(per_prompt(6, 500, quality=0.6))
    a = outcomes(good.tolist(), counts.tolist())
    b = outcomes(worse.tolist(), np.maximum(counts - 3, 0).tolist())
    greedy = stats.compare(a, b, "greedy_accuracy", resamples=2000, seed=0)
    assert greedy.difference == pytest.approx(-0.1) and greedy.p_value < 1e-10 and greedy.name == "exact McNemar"
    breadth = stats.compare(a, b, "pass_at_k.8", resamples=2000, seed=0)
    assert breadth.difference < -0.05 and breadth.p_value < 0.001 and breadth.name == "paired bootstrap"


def test_pairs_by_prompt_and_falls_back_to_unpaired():
    a = outcomes([1, 1, 0, 0], [16, 12, 0, 2], prompts=["1+1=", "2+2=", "3+3=", "4+4="])
    shuffled = outcomes([0, 0, 1, 1], [2, 0, 12, 16], prompts=["4+4=", "3+3=", "2+2=", "1+1="])
    test = stats.compare(a, shuffled, "greedy_accuracy", resamples=500, seed=0)
    assert test.p_value == 1.0 and test.n_prompts == 4                      # same answers, other order
    other = outcomes([1, 0], [16, 0], prompts=["7+7=", "8+8="])
    assert stats.compare(a, other, "pass_at_k.8", resamples=500, seed=0).name.startswith("unpaired")
    # a partial overlap (another seed's split) is not paired: the test covers each run's own figure
    overlap = outcomes([1, 1, 0, 1], [16, 12, 0, 9], prompts=["1+1=", "2+2=", "5+5=", "6+6="])
    test = stats.compare(a, overlap, "greedy_accuracy", resamples=500, seed=0)
    assert not test.paired and test.n_prompts == 8 and test.difference == pytest.approx(0.25)


@pytest.mark.parametrize("a,b,p", [
    ([], [], 1.0),                          # nothing to test
    ([0.2], [0.9], 1.0),                    # one prompt proves nothing
    ([0.0] * 3, [0.5] * 3, 0.25),           # three prompts, all the same way: the sign test's 2 * 2**-3
    ([0.1] * 20, [0.1] * 20, 1.0),          # no difference at all
])
def test_paired_bootstrap_without_spread_falls_back_to_the_sign_test(a, b, p):
    assert stats.paired_bootstrap_p(a, b, resamples=500, seed=0) == pytest.approx(p)


def test_intervals_are_seeded_and_hold_the_figure():
    record = outcomes([1] * 209 + [0] * 291, per_prompt(9, 500))
    first = stats.intervals(record, [1, 8], resamples=1000, seed=0)
    assert first == stats.intervals(record, [1, 8], resamples=1000, seed=0)
    assert first["n_prompts"] == 500
    low, high = first["greedy_accuracy_ci95"]
    assert low < 0.418 < high and high - low == pytest.approx(0.086, abs=0.002)


@pytest.mark.parametrize("metric,split", [
    ("evaluate.grpo.greedy_accuracy", ("grpo", "greedy_accuracy")),
    ("evaluate.grpo.dense.pass_at_k.8", ("grpo.dense", "pass_at_k.8")),   # a stage's model, with a dot
    ("grpo.dense.train_seconds", None),                                   # no per-prompt outcomes behind it
    ("serving.max_concurrency", None),
])
def test_split_metric(metric, split):
    assert stats.split_metric(metric) == split
