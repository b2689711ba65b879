"""Uncertainty: 95% intervals for held-out figures and tests of a difference between models.

Pure functions over per-prompt outcomes, numpy only (the tests check them against
scipy.stats and statsmodels). An *outcomes* record is one model's held-out result per
prompt: `{"prompts": [...], "greedy": [0 or 1 per prompt], "correct": [correct samples
per prompt], "n": samples per prompt}`.

- greedy accuracy: Wilson score interval; two models on the same prompts: exact McNemar.
- pass@k: percentile bootstrap over prompts; two models on the same prompts: paired
  bootstrap of the mean per-prompt difference; on different prompts: unpaired bootstrap.
Bootstraps are seeded, so the same inputs give the same interval and p-value. Two
records are paired only when they hold the same prompts (in any order); records on
different prompt sets (another seed's split) are compared unpaired, each on all of its
own prompts, so the tested difference is the reported one.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import numpy as np

from posttrain.scoring.metrics import pass_at_k

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
# evaluate.<model>.<figure>: the metrics per-prompt outcomes can test (a model name may hold a dot)
_PER_PROMPT_METRIC = re.compile(r"^evaluate\.(?P<model>.+)\.(?P<figure>greedy_accuracy|pass_at_k\.\d+)$")


class Test(NamedTuple):
    """A two-sided test of `b - a`: the difference, its p-value, the test's name, how
    many prompts it used (paired: the shared prompts; unpaired: both sets), and whether
    it was paired."""
    difference: float
    p_value: float
    name: str
    n_prompts: int
    paired: bool = True

    def describe(self) -> str:
        return f"{self.name} {format_p(self.p_value)}, {self.n_prompts} prompts"


def format_p(p: float) -> str:
    """`p<0.001` or `p=0.123`: how every p-value is printed."""
    return "p<0.001" if p < 0.001 else f"p={p:.3f}"


def wilson_interval(successes: int, n: int, z: float = Z95) -> list[float]:
    """Wilson score interval `[low, high]` for `successes` of `n` (Wilson 1927). Unlike the
    normal approximation it stays inside [0, 1] and is honest at 0% and 100%."""
    if n <= 0:
        return [0.0, 1.0]
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return [max(0.0, centre - half), min(1.0, centre + half)]


def per_prompt_pass_at_k(correct: list[int], n: int, k: int) -> np.ndarray:
    """Each prompt's unbiased pass@k estimate (their mean is the reported pass@k)."""
    return np.array([pass_at_k(n, c, k) for c in correct], dtype=float)


def _resampled_means(values: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """Means of `resamples` bootstrap samples (prompts drawn with replacement)."""
    rng = np.random.default_rng(seed)
    return values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)


def bootstrap_interval(values, *, resamples: int, seed: int, confidence: float = 0.95) -> list[float]:
    """Percentile bootstrap interval `[low, high]` of the mean of `values` (one per prompt)."""
    values = np.asarray(values, dtype=float)
    if len(values) == 0:
        return [0.0, 1.0]
    means = _resampled_means(values, resamples, seed)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return [float(low), float(high)]


def mcnemar_exact(a: list[int], b: list[int]) -> float:
    """Two-sided exact McNemar p-value for paired right/wrong outcomes of two models.

    Only discordant prompts count: `b01` right for b only, `b10` right for a only. Under
    no difference each is Binomial(b01 + b10, 1/2): p = min(1, 2 P(X <= min(b01, b10))).
    """
    b01 = sum(1 for x, y in zip(a, b) if not x and y)
    b10 = sum(1 for x, y in zip(a, b) if x and not y)
    discordant = b01 + b10
    if discordant == 0:
        return 1.0
    tail = sum(math.comb(discordant, i) for i in range(min(b01, b10) + 1)) / 2 ** discordant
    return min(1.0, 2 * tail)


def _no_spread_p(differences: np.ndarray) -> float | None:
    """The p-value when the bootstrap has nothing to resample: 1 for no prompts or no
    difference; for `n` prompts that all moved the same way, the exact sign test's
    `2 * 2**-n` (one prompt proves nothing, twenty do)."""
    if len(differences) == 0 or np.allclose(differences, 0.0):
        return 1.0
    if np.allclose(differences, differences[0]):
        return min(1.0, 2.0 * 0.5 ** len(differences))
    return None


def paired_bootstrap_p(a, b, *, resamples: int, seed: int) -> float:
    """Two-sided p-value that the mean of `b - a` (paired, one pair per prompt) is zero.

    The bootstrap distribution of the mean difference, shifted to the null (centred on
    zero), is compared with the observed mean; `(1 + hits) / (1 + resamples)`. Like any
    bootstrap it is honest from a few dozen prompts on.
    """
    d = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    degenerate = _no_spread_p(d)
    if degenerate is not None:
        return degenerate
    observed = d.mean()
    means = _resampled_means(d, resamples, seed)
    hits = np.sum(np.abs(means - observed) >= abs(observed) - 1e-12)
    return float((1 + hits) / (1 + resamples))


def unpaired_bootstrap_p(a, b, *, resamples: int, seed: int) -> float:
    """Two-sided p-value that two means on different prompts are equal: each sample is
    resampled on its own, and the shifted difference compared with the observed one."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 2 or len(b) < 2:
        return 1.0
    observed = b.mean() - a.mean()
    diffs = _resampled_means(b, resamples, seed) - _resampled_means(a, resamples, seed + 1)
    if np.allclose(diffs, diffs[0]):
        return 1.0 if abs(observed) < 1e-12 else 2.0 * 0.5 ** min(len(a), len(b))
    hits = np.sum(np.abs(diffs - observed) >= abs(observed) - 1e-12)
    return float((1 + hits) / (1 + resamples))


def split_metric(metric: str) -> tuple[str, str] | None:
    """`evaluate.grpo.pass_at_k.8` -> `("grpo", "pass_at_k.8")`; None for a metric that no
    per-prompt outcomes stand behind (training time, the serving figures, ...)."""
    match = _PER_PROMPT_METRIC.match(metric)
    return (match["model"], match["figure"]) if match else None


def metric_values(outcomes: dict, metric: str) -> np.ndarray:
    """Per-prompt values whose mean is `metric` (`greedy_accuracy` or `pass_at_k.<k>`)."""
    if metric == "greedy_accuracy":
        return np.asarray(outcomes["greedy"], dtype=float)
    if metric.startswith("pass_at_k."):
        return per_prompt_pass_at_k(outcomes["correct"], outcomes["n"], int(metric.split(".", 1)[1]))
    raise ValueError(f"no per-prompt form for metric {metric!r}: use greedy_accuracy or pass_at_k.<k>")


def compare(a: dict, b: dict, metric: str, *, resamples: int, seed: int) -> Test:
    """Is `b` different from `a` on `metric` beyond noise? Paired when both were evaluated
    on the same prompts (exact McNemar for greedy accuracy, paired bootstrap for pass@k),
    matched by prompt; otherwise an unpaired bootstrap, each on all of its prompts."""
    values_a, values_b = metric_values(a, metric), metric_values(b, metric)
    if sorted(a["prompts"]) != sorted(b["prompts"]):
        p = unpaired_bootstrap_p(values_a, values_b, resamples=resamples, seed=seed)
        return Test(float(values_b.mean() - values_a.mean()), p, "unpaired bootstrap (different prompts)",
                    len(values_a) + len(values_b), paired=False)
    order = {p: i for i, p in enumerate(a["prompts"])}
    pa, pb = values_a[[order[p] for p in b["prompts"]]], values_b
    if metric == "greedy_accuracy":
        p, name = mcnemar_exact(pa.astype(int).tolist(), pb.astype(int).tolist()), "exact McNemar"
    else:
        p, name = paired_bootstrap_p(pa, pb, resamples=resamples, seed=seed), "paired bootstrap"
    return Test(float(pb.mean() - pa.mean()), p, name, len(pb))


def compare_runs(a: dict | None, b: dict | None, metric: str, *, resamples: int, seed: int) -> Test | None:
    """`compare` for a run metric such as `evaluate.grpo.pass_at_k.8`, given each run's
    outcomes by model; None when the metric has no per-prompt form or a run lacks it."""
    split = split_metric(metric)
    if split is None or not a or not b or split[0] not in a or split[0] not in b:
        return None
    return compare(a[split[0]], b[split[0]], split[1], resamples=resamples, seed=seed)


def intervals(outcomes: dict, ks: list[int], *, resamples: int, seed: int) -> dict:
    """The 95% intervals a report carries beside its figures: `n_prompts`,
    `greedy_accuracy_ci95` (Wilson) and `pass_at_k_ci95` (k -> bootstrap interval)."""
    greedy = outcomes["greedy"]
    return {"n_prompts": len(greedy),
            "greedy_accuracy_ci95": wilson_interval(int(sum(greedy)), len(greedy)),
            "pass_at_k_ci95": {str(k): bootstrap_interval(per_prompt_pass_at_k(outcomes["correct"], outcomes["n"], k),
                                                          resamples=resamples, seed=seed) for k in ks}}
