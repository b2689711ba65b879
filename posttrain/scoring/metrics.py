"""Evaluation metrics."""

from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): `1 - C(n-c, k) / C(n, k)`.

    n: samples drawn per prompt; c: how many of them are correct; k: attempts allowed.
    Uses the product form `1 - prod(1 - k / arange(n-c+1, n+1))`, stable for n in the
    thousands, and is exactly 1.0 when fewer than k samples are wrong.
    """
    if not (n >= 1 and 0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(correct_counts: list[int], n: int, k: int) -> float:
    """pass@k averaged over prompts, each with `n` samples of which `correct_counts[i]` passed."""
    return float(np.mean([pass_at_k(n, c, k) for c in correct_counts]))
