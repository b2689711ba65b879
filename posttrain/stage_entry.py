"""`python -m posttrain stage NAME --config FILE --flag value ...`: what dvc.yaml's commands
run, without the `posttrain` CLI (posttrain/cli.py): a stage reads its flags, loads the config,
checks what its own work touches and runs, so an edit to another command's code reruns no
stage (tests/test_stage_deps.py walks what this module reaches: dvc.yaml's deps).

The flags are the stage's `main` keyword arguments as posttrain.stages.STAGES declares them,
checked before the config is loaded (a wrong flag costs no torch import); the stage's
metrics are printed as JSON. `posttrain stage ...` (the CLI) runs the same `run`.
"""

from __future__ import annotations

import importlib
import json

from posttrain.command import run_command
from posttrain.errors import UserError
from posttrain.stages import STAGES


def main(argv: list[str]) -> int:
    """`argv`: NAME --flag value ...; the exit code (bad input: one line, 2)."""
    return run_command(lambda: run(argv))


def run(argv: list[str]) -> None:
    """Run stage argv[0] with the flags that follow; UserError (one line) on a bad one."""
    from posttrain.runtime.lifetime import die_with_run

    die_with_run()  # under the flow's `dvc repro`: the stage ends with the flow (kill -9 of the run included)
    if not argv or argv[0] not in STAGES:
        given = f"no stage {argv[0]!r}" if argv else "no stage named"
        raise UserError("posttrain stage", given, f"name one of {', '.join(STAGES)}, then its flags (see dvc.yaml)")
    name, flags = argv[0], argv[1:]
    wanted = ["config", *STAGES[name].flags]
    where = f"posttrain stage {name}"
    if len(flags) % 2 or not all(f.startswith("--") for f in flags[::2]):
        raise UserError(where, f"expected --flag value pairs, got {' '.join(flags)[:80]!r}",
                        f"pass {' '.join('--' + w.replace('_', '-') + ' VALUE' for w in wanted)}")
    kwargs = {flag[2:].replace("-", "_"): value for flag, value in zip(flags[::2], flags[1::2])}
    unknown, missing = sorted(set(kwargs) - set(wanted)), [w for w in wanted if w not in kwargs]
    if unknown or missing:
        problem = f"unknown flag --{unknown[0].replace('_', '-')}" if unknown else \
            f"missing --{missing[0].replace('_', '-')}"
        raise UserError(where, problem, f"it takes {', '.join('--' + w.replace('_', '-') for w in wanted)}")
    from posttrain import preflight
    from posttrain.config import load_config

    config_path = kwargs.pop("config")
    config = load_config(config_path)
    preflight.for_stage(name, config_path, config)  # what this stage's own work touches
    stage_main = importlib.import_module(f"posttrain.stages.{name}").main
    if name == "grpo" and kwargs["name"] not in config.grpo:
        raise UserError(f"{where} --name", f"no GRPO stage {kwargs['name']!r} in {config_path}",
                        f"use one of {list(config.grpo)}")
    if name in ("sft", "grpo"):
        kwargs["config_path"] = config_path  # for the memory plan: gpus.yaml beside the config
    for module, attribute in STAGES[name].imports:  # start-up, not the stage's compute (make bench)
        getattr(importlib.import_module(module), attribute)
    from posttrain.plugins import plugin_refusal  # what the user's plug-ins raise: one line naming the plug-in
    from posttrain.stageid import StageId

    stage = StageId(name, kwargs.get("name") if name == "grpo" else None)
    with plugin_refusal(where, log=str(stage.log)):
        print(json.dumps(stage_main(config, **kwargs), indent=2, sort_keys=True))
