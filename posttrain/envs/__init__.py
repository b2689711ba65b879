"""RL environments: a prompt source + an answer parser + a verifier.

`data.env` names one of three kinds (posttrain.envs.base documents the protocol):
- a built-in: `arithmetic`, `sql`, `dataset` (your own files and a verifier), and the tool
  environments `calculator`, `sql_tools` and `retrieval` (posttrain.envs.tools) (ENVIRONMENTS);
- an entry point an installed package registers in the group `posttrain.envs`;
- an import path `package.module:factory` (a class or a function), resolved with the
  workspace first on the path: a workspace's own environments live in `custom/`.
Reward channels (`posttrain.scoring.rewards`) are built on an environment's parser and verifier.
"""

from __future__ import annotations

import contextlib
import importlib

from pydantic import BaseModel

from posttrain.envs.base import EnvOptions, Environment, missing_methods
from posttrain.plugins import PluginError, lookup
from posttrain.yamlfile import show

# The built-ins by name, each imported when a config names it: building the arithmetic
# environment imports neither the SQL sandbox nor the retrieval index.
ENVIRONMENTS: dict[str, str] = {
    "arithmetic": "posttrain.envs.arithmetic:ArithmeticEnv", "sql": "posttrain.envs.sql:SQLEnv",
    "dataset": "posttrain.envs.dataset:DatasetEnv", "calculator": "posttrain.envs.calculator:CalculatorEnv",
    "sql_tools": "posttrain.envs.sql_tools:SQLToolsEnv", "retrieval": "posttrain.envs.retrieval:RetrievalEnv"}
ENTRY_POINT_GROUP = "posttrain.envs"
# What each built-in runs beyond what every stage runs (its own module, the ones it imports,
# the SQL sandbox), as paths in the package: a workspace's dvc.yaml lists these for its
# config's environment alone, so an edit to a built-in it does not use reruns no stage
# (posttrain.workspace.dvc_yaml; tests/test_stage_deps.py checks them against the import walk).
MODULES: dict[str, tuple[str, ...]] = {
    "arithmetic": ("envs/arithmetic.py",), "sql": ("envs/sql.py", "sandbox.py"),
    "dataset": ("envs/dataset.py", "envs/mathverify.py", "sandbox.py"), "calculator": ("envs/calculator.py",),
    "sql_tools": ("envs/sql.py", "envs/sql_tools.py", "sandbox.py"),
    "retrieval": ("envs/dataset.py", "envs/mathverify.py", "envs/retrieval.py", "sandbox.py")}


def env_factory(name: str):
    """What `data.env` names: a built-in, an installed entry point, or an import path.
    PluginError (one line, with the fix) when it names nothing that loads."""
    if isinstance(name, str) and name in ENVIRONMENTS:
        module, _, attribute = ENVIRONMENTS[name].partition(":")
        return getattr(importlib.import_module(module), attribute)
    return lookup(name, ENVIRONMENTS, "environment", "package.module:factory (e.g. custom.mytask:make_env)",
                  group=ENTRY_POINT_GROUP)


def options_schema(factory) -> type[BaseModel] | None:
    """The factory's `Options` schema (an EnvOptions subclass), when it declares one."""
    schema = getattr(factory, "Options", None)
    return schema if isinstance(schema, type) and issubclass(schema, BaseModel) else None


def get_env(name: str, **options) -> Environment:
    """The environment `name` names, built with its config options.

    A factory with an `Options` schema gets the options once they pass it (pydantic's
    ValidationError otherwise; the config check turns it into a `UserError` at
    `data.options.<option>`); one without gets them as keyword arguments. What it
    returns must follow the protocol (PluginError naming what it lacks)."""
    factory = env_factory(name)
    if not callable(factory):
        raise PluginError(f"{show(name)} is a {type(factory).__name__}, not a class or function",
                          "name a class or a function that returns the environment")
    schema = options_schema(factory)
    if schema is not None:
        options = schema.model_validate(options).model_dump()
    try:
        env = factory(**options)
    except TypeError as err:
        if schema is not None or not _about_arguments(err):
            raise  # the plug-in's own error (posttrain.plugins.plugin_failures names its frame)
        raise PluginError(f"{show(name)} did not take data.options {sorted(options)}: {err}",
                          "pass only the keyword arguments it accepts, or give it an Options schema") from None
    missing = missing_methods(env)
    if missing:
        raise PluginError(f"{show(name)} returned a {type(env).__name__}, which has no {', '.join(missing)}",
                          "return an environment: generate(seed), parse(completion), verify(completion, answer) "
                          "(posttrain.envs.base.Environment)")
    if not isinstance(getattr(env, "name", None), str):
        with contextlib.suppress(AttributeError):
            env.name = name  # messages name the environment
    return env


def config_env(data) -> Environment:
    """The environment the config's `data` section names, built with its options; with
    `data.episode`, a tool environment whose episodes are that class's (a TRL environment,
    by import path: posttrain.envs.tools). The one way the stages build it."""
    env = get_env(data.env, **data.options)
    if getattr(data, "episode", None):
        env.episode = lookup(data.episode, {}, "episode class", "package.module:Class (e.g. custom.mytools:MyEnv)")
    return env


def _about_arguments(err: TypeError) -> bool:
    """Whether the factory (or what it hands its options to) refused the arguments, as
    opposed to a TypeError of its own code (`None + 1`)."""
    return err.__traceback__.tb_next is None or "argument" in str(err)


__all__ = ["ENTRY_POINT_GROUP", "ENVIRONMENTS", "EnvOptions", "Environment", "config_env", "env_factory", "get_env",
           "options_schema"]
