"""Reward channels, open-r1 style: pure functions `(completions, **columns) -> list[float]`.

Each channel is made by a small factory from an environment and looked up in
`REWARDS` by the name used in the config. TRL's GRPOTrainer calls them with the
dataset's columns (`answer`, ...) as keyword arguments and logs each one's mean as
`rewards/<name>/mean`.
"""

from __future__ import annotations

from typing import Callable

from posttrain.envs.base import Environment

RewardFn = Callable[..., list[float]]


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


REWARDS: dict[str, Callable[[Environment], RewardFn]] = {
    "correctness": correctness,
    "parseable": parseable,
}


def build_rewards(env: Environment, names: list[str]) -> list[RewardFn]:
    """The reward functions named in the config, in config order."""
    return [REWARDS[name](env) for name in names]
