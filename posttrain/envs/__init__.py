"""RL environments: a prompt source + an answer parser + a verifier.

An environment is looked up by the name used in the config (`data.env`). Reward
channels (`posttrain.rewards`) are built on an environment's parser and verifier.
"""

from __future__ import annotations

from posttrain.envs.arithmetic import ArithmeticEnv
from posttrain.envs.base import Environment
from posttrain.envs.sql import SQLEnv

ENVIRONMENTS: dict[str, type] = {"arithmetic": ArithmeticEnv, "sql": SQLEnv}


def get_env(name: str, **options) -> Environment:
    """The environment registered as `name`, built with its config options."""
    return ENVIRONMENTS[name](**options)


__all__ = ["ENVIRONMENTS", "Environment", "get_env"]
