"""The stage gate: accept a model only if held-out truth did not get worse.

Pure functions over evaluation results `{"greedy_accuracy": a, "pass_at_k": {k: p}}`.
"""

from __future__ import annotations

from typing import NamedTuple


class Decision(NamedTuple):
    accepted: bool
    reason: str


def decide(previous: dict, candidate: dict, *, k: int, tolerance: float) -> Decision:
    """Accept unless greedy accuracy or pass@k fell by more than `tolerance` (absolute)."""
    checks = [("greedy accuracy", previous["greedy_accuracy"], candidate["greedy_accuracy"]),
              (f"pass@{k}", previous["pass_at_k"][str(k)], candidate["pass_at_k"][str(k)])]
    drops = [f"{name} fell {before:.3f} -> {after:.3f} (more than the tolerance {tolerance:.3f})"
             for name, before, after in checks if after < before - tolerance]
    if drops:
        return Decision(False, "; ".join(drops))
    summary = ", ".join(f"{name} {before:.3f} -> {after:.3f}" for name, before, after in checks)
    return Decision(True, f"no drop beyond {tolerance:.3f}: {summary}")
