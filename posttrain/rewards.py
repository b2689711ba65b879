"""Reward channels and guardrails, open-r1 style: pure functions of the completions.

A channel is `(completions, **columns) -> list[float]`, made by a small factory from an
environment and looked up in `REWARDS` by the name the config uses. Each declares its
range, so a guardrail can pin a completion to the stage's minimum. TRL's GRPOTrainer
calls channels with the dataset's columns (`answer`, ...) as keyword arguments, and
logs each one's mean as `rewards/<name>/mean`.

A guardrail is `(completions, **columns) -> list[bool]` (True = broken). Guardrails are
rules, not weights: a completion that breaks one gets every channel's minimum, so its
reward is the stage's minimum under both TRL aggregations (summing weighted channels,
or normalising each channel within its group first, GDPO). The hit rate is logged per
step as `guardrails/<name>/hit_rate` through TRL's `log_metric` hook.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from posttrain.envs.base import Environment

RewardFn = Callable[..., list[float]]
GuardFn = Callable[..., list[bool]]


class Channel(NamedTuple):
    make: Callable[[Environment], RewardFn]
    low: float   # the channel's minimum: what a guardrail violation scores
    high: float


def correctness(env: Environment) -> RewardFn:
    """1.0 when the verifier accepts the completion, else 0.0."""
    def correctness(completions, answer, **_):
        return [float(env.verify(c, a)) for c, a in zip(completions, answer)]
    return correctness


def parseable(env: Environment) -> RewardFn:
    """1.0 when the environment's parser can read an answer from the completion."""
    def parseable(completions, **_):
        return [float(env.parse(c) is not None) for c in completions]
    return parseable


def digit_overlap(predicted: str | None, answer: str) -> float:
    """Share of digit positions right, aligned from the units digit, over the longer length.

    A dense signal for numeric answers: `84` for `85` scores 0.5, `185` for `85` 0.67.
    """
    if predicted is None:
        return 0.0
    width = max(len(predicted), len(answer))
    matches = sum(p == a for p, a in zip(reversed(predicted), reversed(answer)))
    return matches / width


def digits(env: Environment) -> RewardFn:
    """Partial credit per correct digit of the parsed answer (0..1)."""
    def digits(completions, answer, **_):
        return [digit_overlap(env.parse(c), a) for c, a in zip(completions, answer)]
    return digits


def similarity(env: Environment) -> RewardFn:
    """String similarity (difflib ratio, 0..1) of the completion to the reference answer.

    A cheap proxy that looks reasonable and is hackable: `age>35` and `age<35` are 83%
    alike and return opposite rows. It is here to show what the reward-hacking sentinel
    catches; train on `correctness` (execution) instead.
    """
    from difflib import SequenceMatcher

    def similarity(completions, answer, **_):
        return [SequenceMatcher(None, c.strip(), a).ratio() for c, a in zip(completions, answer)]
    return similarity


REWARDS: dict[str, Channel] = {
    "correctness": Channel(correctness, 0.0, 1.0),
    "parseable": Channel(parseable, 0.0, 1.0),
    "digits": Channel(digits, 0.0, 1.0),
    "similarity": Channel(similarity, 0.0, 1.0),
}


def unparseable(env: Environment) -> GuardFn:
    """Broken when the environment's parser finds no answer (a format contract)."""
    def unparseable(completions, **_):
        return [env.parse(c) is None for c in completions]
    return unparseable


def overlong(env: Environment, max_chars: int = 8) -> GuardFn:
    """Broken when the completion is longer than `max_chars` characters."""
    def overlong(completions, **_):
        return [len(c) > max_chars for c in completions]
    return overlong


GUARDRAILS: dict[str, Callable[[Environment], GuardFn]] = {"unparseable": unparseable, "overlong": overlong}


def guarded(name: str, channel: Channel, env: Environment, guards: dict[str, GuardFn], log: bool) -> RewardFn:
    """The channel, with every completion that breaks a guardrail pinned to its minimum.

    `log`: whether this wrapper reports the guardrails' hit rates (one channel does).
    """
    score = channel.make(env)

    def reward(completions, **columns):
        values = score(completions, **columns)
        broken = [False] * len(completions)
        for guard_name, guard in guards.items():
            hits = guard(completions, **columns)
            broken = [b or h for b, h in zip(broken, hits)]
            if log and "log_metric" in columns:
                columns["log_metric"](f"guardrails/{guard_name}/hit_rate", sum(hits) / max(1, len(hits)))
        return [channel.low if b else v for b, v in zip(broken, values)]

    reward.__name__ = name  # TRL names the logged curve after the function
    return reward


def build_rewards(env: Environment, channels: dict[str, float] | list[str],
                  guardrails: list[str] = ()) -> tuple[list[RewardFn], list[float]]:
    """The stage's reward functions and weights, in config order, guardrails applied."""
    weights = channels if isinstance(channels, dict) else {name: 1.0 for name in channels}
    guards = {name: GUARDRAILS[name](env) for name in guardrails}
    funcs = [guarded(name, REWARDS[name], env, guards, log=(i == 0)) for i, name in enumerate(weights)]
    return funcs, [float(w) for w in weights.values()]
