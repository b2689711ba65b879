"""The stage gate: accept a model only if held-out truth did not get worse.

Pure functions over evaluation results `{"greedy_accuracy": a, "pass_at_k": {k: p}}`.
Each sentinel that fires adds one sentence saying what happened; any sentence rejects.

- regression: held-out greedy accuracy fell by more than the tolerance.
- breadth collapse: pass@k at the gate's (largest) k fell by more than the tolerance,
  the failure greedy accuracy hides (RL sharpens the distribution: greedy can rise
  while the set of problems the model can solve at all shrinks).
- reward hacking: the training reward rose over the stage while held-out verifier
  accuracy fell, or ended below the untrained base model's: the policy learned to
  please the reward, not to solve the task.
"""

from __future__ import annotations

from typing import NamedTuple


class Decision(NamedTuple):
    accepted: bool
    reason: str


def decide(previous: dict, candidate: dict, *, k: int, tolerance: float,
           reward: tuple[float, float] | None = None, base: dict | None = None) -> Decision:
    """Accept unless a sentinel fires.

    previous: the last accepted model's evaluation; candidate: this stage's.
    reward: the stage's training reward (start, end), for the reward-hacking sentinel.
    base: the base model's evaluation; the candidate must not end below it.
    """
    key = str(k)
    acc_before, acc_after = previous["greedy_accuracy"], candidate["greedy_accuracy"]
    pass_before, pass_after = previous["pass_at_k"][key], candidate["pass_at_k"][key]
    fired = []
    if acc_after < acc_before - tolerance:
        fired.append(f"regression: greedy accuracy fell {acc_before:.3f} -> {acc_after:.3f} "
                     f"(more than the tolerance {tolerance:.3f})")
    if pass_after < pass_before - tolerance:
        rose = " while greedy accuracy rose" if acc_after > acc_before else ""
        fired.append(f"breadth collapse: pass@{k} fell {pass_before:.3f} -> {pass_after:.3f}{rose} "
                     f"(more than the tolerance {tolerance:.3f})")
    if reward is not None and reward[1] > reward[0]:
        base_acc = base["greedy_accuracy"] if base else None
        if acc_after < acc_before - tolerance:
            fired.append(f"reward hacking: training reward rose {reward[0]:.3f} -> {reward[1]:.3f} while held-out "
                         f"accuracy fell {acc_before:.3f} -> {acc_after:.3f}")
        elif base_acc is not None and acc_after < base_acc - tolerance:
            fired.append(f"reward hacking: training reward rose {reward[0]:.3f} -> {reward[1]:.3f} while held-out "
                         f"accuracy {acc_after:.3f} is below the base model's {base_acc:.3f}")
    if fired:
        return Decision(False, "; ".join(fired))
    return Decision(True, f"no drop beyond {tolerance:.3f}: greedy accuracy {acc_before:.3f} -> {acc_after:.3f}, "
                          f"pass@{k} {pass_before:.3f} -> {pass_after:.3f}")


def reward_trend(rewards: list[float], window: float = 0.1) -> tuple[float, float] | None:
    """The mean training reward over the first and last `window` share of logged steps
    (at least one each): a noise-tolerant start and end for the reward-hacking sentinel."""
    if len(rewards) < 2:
        return None
    size = max(1, int(len(rewards) * window))
    return sum(rewards[:size]) / size, sum(rewards[-size:]) / size
