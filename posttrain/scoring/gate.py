"""The stage gate: accept a model only if held-out truth did not get worse.

Pure functions over evaluation results `{"greedy_accuracy": a, "pass_at_k": {k: p}}`,
which may carry per-prompt `outcomes` (`posttrain.scoring.evaluation.outcomes`). Each sentinel
that fires adds one sentence saying what happened; any sentence rejects.

A drop counts only when it is both larger than the tolerance (the practical margin)
and not explained by noise: a two-sided test of the two models on the same held-out
prompts (exact McNemar for greedy accuracy, paired bootstrap for pass@k) gives
p < alpha. Without outcomes (an older card) the tolerance alone decides.

- regression: held-out greedy accuracy fell.
- breadth collapse: pass@k at the gate's (largest) k fell, the failure greedy accuracy
  hides (RL sharpens the distribution: greedy can rise while the set of problems the
  model can solve at all shrinks).
- reward hacking: the training reward rose over the stage while held-out verifier
  accuracy fell, or ended below the untrained base model's: the policy learned to
  please the reward, not to solve the task.
"""

from __future__ import annotations

from typing import NamedTuple

from posttrain.scoring import stats


class Decision(NamedTuple):
    accepted: bool
    reason: str
    p_values: dict[str, float] | None = None  # figure -> p of its paired test (None: untested)


class Drop(NamedTuple):
    """One figure, before and after, and whether it fell for real."""
    before: float
    after: float
    test: stats.Test | None
    real: bool

    def note(self) -> str:
        return f"; {self.test.describe()}" if self.test else ""


def measure(before: dict, after: dict, metric: str, *, tolerance: float, alpha: float, resamples: int,
            seed: int) -> Drop:
    """`metric` (`greedy_accuracy` or `pass_at_k.<k>`) of both results, tested when both
    carry outcomes; `real` when it fell by more than `tolerance` and p < `alpha`."""
    def value(result):
        return result["greedy_accuracy"] if metric == "greedy_accuracy" else result["pass_at_k"][metric.split(".")[1]]
    a, b = value(before), value(after)
    test = None
    if before.get("outcomes") and after.get("outcomes"):
        test = stats.compare(before["outcomes"], after["outcomes"], metric, resamples=resamples, seed=seed)
    return Drop(a, b, test, a - b > tolerance and (test is None or test.p_value < alpha))


def decide(previous: dict, candidate: dict, *, k: int, tolerance: float, alpha: float = 0.05,
           resamples: int = 2000, seed: int = 0, reward: tuple[float, float] | None = None,
           base: dict | None = None) -> Decision:
    """Accept unless a sentinel fires.

    previous: the last accepted model's evaluation; candidate: this stage's.
    reward: the stage's training reward (start, end), for the reward-hacking sentinel.
    base: the base model's evaluation; the candidate must not end below it.
    """
    test = dict(tolerance=tolerance, alpha=alpha, resamples=resamples, seed=seed)
    greedy = measure(previous, candidate, "greedy_accuracy", **test)
    breadth = measure(previous, candidate, f"pass_at_k.{k}", **test)
    limit = f"more than the tolerance {tolerance:.3f}"
    fired = []
    if greedy.real:
        fired.append(f"regression: greedy accuracy fell {greedy.before:.3f} -> {greedy.after:.3f} ({limit}{greedy.note()})")
    if breadth.real:
        rose = " while greedy accuracy rose" if greedy.after > greedy.before else ""
        fired.append(f"breadth collapse: pass@{k} fell {breadth.before:.3f} -> {breadth.after:.3f}{rose} "
                     f"({limit}{breadth.note()})")
    if reward is not None and reward[1] > reward[0]:
        rise = f"reward hacking: training reward rose {reward[0]:.3f} -> {reward[1]:.3f} while held-out accuracy"
        below = measure(base, candidate, "greedy_accuracy", **test) if base else None
        if greedy.real:
            fired.append(f"{rise} fell {greedy.before:.3f} -> {greedy.after:.3f}")
        elif below is not None and below.real:
            fired.append(f"{rise} {below.after:.3f} is below the base model's {below.before:.3f}{below.note()}")
    p_values = {name: d.test.p_value for name, d in [("greedy_accuracy", greedy), (f"pass_at_{k}", breadth)] if d.test}
    if fired:
        return Decision(False, "; ".join(fired), p_values)
    return Decision(True, f"no drop beyond {tolerance:.3f} and noise: greedy accuracy {greedy.before:.3f} -> "
                          f"{greedy.after:.3f}{_paren(greedy)}, pass@{k} {breadth.before:.3f} -> "
                          f"{breadth.after:.3f}{_paren(breadth)}", p_values)


def _paren(drop: Drop) -> str:
    return f" ({drop.test.describe()})" if drop.test else ""


def reward_trend(rewards: list[float], window: float = 0.1) -> tuple[float, float] | None:
    """The mean training reward over the first and last `window` share of logged steps
    (at least one each): a noise-tolerant start and end for the reward-hacking sentinel."""
    if len(rewards) < 2:
        return None
    size = max(1, int(len(rewards) * window))
    return sum(rewards[:size]) / size, sum(rewards[-size:]) / size
