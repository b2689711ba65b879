"""RL environments: a prompt source + an answer parser + a verifier.

An environment is looked up by the name used in the config (`data.env`). Reward
channels (`posttrain.rewards`) are built on an environment's parser and verifier.
"""

from __future__ import annotations

from posttrain.envs.arithmetic import ArithmeticEnv
from posttrain.envs.base import EnvOptions, Environment
from posttrain.envs.sql import SQLEnv

ENVIRONMENTS: dict[str, type] = {"arithmetic": ArithmeticEnv, "sql": SQLEnv}


def get_env(name: str, **options) -> Environment:
    """The environment registered as `name`, built with its config options once they
    pass its `Options` schema (pydantic's ValidationError otherwise; the config check
    turns it into a `UserError` at `data.options.<option>`)."""
    cls = ENVIRONMENTS[name]
    return cls(**cls.Options.model_validate(options).model_dump())


__all__ = ["ENVIRONMENTS", "EnvOptions", "Environment", "get_env"]
