"""Your own task (issue 13): an environment, reward channels and guardrails named by
import path (a workspace's `custom/` folder) or registered by an installed package under
the entry-point group `posttrain.envs`; bad names refused in one line before any compute;
through `dvc repro`, the custom code is what runs and editing it reruns the stages."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import REPO, SMALL, sh
from hardening import assert_nothing_left, assert_refused, cli, state
from posttrain.envs import get_env
from posttrain.plugins import PluginError
from posttrain.scoring.rewards import build_rewards

# An environment of its own (not a built-in's subclass): "3 plus 4?" -> "7".
WORDS = '''
import random
import re

from posttrain.envs import EnvOptions


class Options(EnvOptions):
    operand_max: int = 9
    heldout_size: int = 20


class Words:
    name = "words"
    Options = Options

    def __init__(self, operand_max=9, heldout_size=20):
        self.operand_max, self.heldout_size = operand_max, heldout_size

    def generate(self, seed):
        rows = [{"prompt": f"{a} plus {b}?", "completion": str(a + b), "answer": str(a + b)}
                for a in range(self.operand_max + 1) for b in range(self.operand_max + 1)]
        random.Random(seed).shuffle(rows)
        return {"train": rows[self.heldout_size:], "heldout": rows[:self.heldout_size]}

    def parse(self, completion):
        match = re.fullmatch(r"\\s*(\\d+)\\s*", completion)
        return match.group(1) if match else None

    def verify(self, completion, answer):
        return self.parse(completion) == answer


def make_env(**options):
    return Words(**options)


def not_an_env(**options):
    return {"prompt": "?"}


class NoSplits(Words):
    def generate(self, seed):
        return [{"prompt": "1 plus 1?"}]


def validated(level: int = 1):
    from pydantic import BaseModel, PositiveInt
    class Check(BaseModel):
        level: PositiveInt
    Check(level=level)                    # its own pydantic check, no Options schema
    return Words()
'''

REWARDS = '''
def brevity(completions, **columns):
    """1 for at most two characters: the answers of this task are that short."""
    return [float(len(c.strip()) <= 2) for c in completions]


def blank(completions, **columns):
    return [not c.strip() for c in completions]


WEIGHT = 0.5

from posttrain.scoring.rewards import Channel, correctness

strict = Channel(correctness, -1.0, 1.0)   # a channel made from the environment, with its range
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder with `custom/words.py` and `custom/rewards.py`, the current folder (import
    paths resolve from it); `custom` forgotten by Python before and after."""
    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "words.py").write_text(WORDS)
    (tmp_path / "custom" / "rewards.py").write_text(REWARDS)
    forget = lambda: [sys.modules.pop(m) for m in list(sys.modules) if m == "custom" or m.startswith("custom.")]
    forget()
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    forget()


def test_an_environment_by_import_path(project):
    env = get_env("custom.words:make_env", operand_max=4, heldout_size=5)
    splits = env.generate(0)
    assert len(splits["train"]) == 20 and len(splits["heldout"]) == 5
    assert env.verify("7", "7") and not env.verify("seven", "7")
    assert get_env("custom.words:Words").name == "words"   # a class is a factory too


def test_an_environment_an_installed_package_registers(tmp_path, monkeypatch):
    """A real distribution on sys.path (a dist-info folder with entry_points.txt), as pip
    leaves one: `data.env: demo` finds it by name."""
    site = tmp_path / "site"
    (site / "posttrain_demo-1.0.dist-info").mkdir(parents=True)
    (site / "posttrain_demo-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: posttrain-demo\nVersion: 1.0\n")
    (site / "posttrain_demo-1.0.dist-info" / "entry_points.txt").write_text("[posttrain.envs]\ndemo = demo_env:make_env\n")
    (site / "demo_env.py").write_text(WORDS)
    monkeypatch.syspath_prepend(str(site))
    assert get_env("demo", operand_max=2, heldout_size=1).generate(1)["heldout"][0]["prompt"].endswith("?")
    with pytest.raises(PluginError, match="'demo'"):  # the unknown-name error lists what is installed
        get_env("nonesuch")


def test_rewards_and_guardrails_by_import_path(project):
    env = get_env("custom.words:make_env")
    funcs, weights = build_rewards(env, {"correctness": 1.0, "custom.rewards:brevity": 0.2},
                                   guardrails=["custom.rewards:blank"])
    assert [f.__name__ for f in funcs] == ["correctness", "custom.rewards.brevity"]  # MLflow keys take no ':'
    assert weights == [1.0, 0.2]
    completions, answers = ["7", "100", "  "], ["7", "100", "3"]
    assert funcs[1](completions, answer=answers) == [1.0, 0.0, 0.0]  # the blank one pinned to the minimum
    assert funcs[0](completions, answer=answers) == [1.0, 1.0, 0.0]
    (strict,), _ = build_rewards(env, ["custom.rewards:strict"], guardrails=["custom.rewards:blank"])
    assert strict(completions, answer=answers) == [1.0, 1.0, -1.0]   # pinned to the Channel's own minimum


# --- bad names: one line before any compute ---------------------------------------------
@pytest.mark.parametrize("override, needles", [
    ({"data": {"env": "custom.nope:make_env"}}, ["data.env", "import of 'custom.nope' failed"]),
    ({"data": {"env": "custom.words:missing"}}, ["data.env", "has no attribute 'missing'", "make_env"]),
    ({"data": {"env": "custom.words:not_an_env"}}, ["data.env", "returned a dict", "generate"]),
    ({"data": {"env": "custom.rewards:WEIGHT"}}, ["data.env", "not a class or function"]),
    ({"data": {"env": "wordz"}}, ["data.env", "unknown environment 'wordz'", "arithmetic"]),
    ({"data": {"env": "custom.words:NoSplits"}}, ["data.env", "generate(seed) returned a list without 'train'"]),
    ({"data": {"env": "custom.words:validated", "options": {"level": -1}}}, ["data.options.level", "greater than 0"]),
    ({"data": {"env": "custom.words:make_env", "options": {"operand_maximum": 3}}},
     ["data.options", "operand_maximum", "operand_max"]),
    ({"grpo": {"dense": {"rewards": {"custom.rewards:brevty": 1.0}}}}, ["grpo.dense.rewards", "brevity"]),
    ({"grpo": {"dense": {"rewards": {"custom.rewards:WEIGHT": 1.0}}}}, ["grpo.dense.rewards", "not a function"]),
    ({"grpo": {"dense": {"guardrails": ["custom.guards:blank"]}}}, ["grpo.dense.guardrails", "custom.guards"]),
])
def test_a_name_that_does_not_load_is_refused_in_one_line(project, override, needles):
    config = {"extends": str(REPO / "configs" / "pipeline.yaml"), **override}
    if "grpo" in override:
        config["grpo"] = {"dense": {"from": "sft", **override["grpo"]["dense"]}}
    path = project / "configs" / "bad.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(config))
    before = state(project)
    for command in ("check", "run"):
        done = cli(command, "--config", path, *(["--workdir", project / "ws"] if command == "run" else []), cwd=project)
        assert_refused(done, str(path), *needles)
    assert_nothing_left(project, before)


def test_a_workspace_keeps_its_custom_code_when_the_current_folder_has_none(project, tmp_path_factory):
    from posttrain import workspace

    ws = tmp_path_factory.mktemp("ws")
    (ws / "custom").mkdir()
    (ws / "custom" / "mine.py").write_text("X = 1\n")
    elsewhere = tmp_path_factory.mktemp("elsewhere")     # no custom/ here
    import os
    os.chdir(elsewhere)
    workspace.copy_custom(ws)
    assert (ws / "custom" / "mine.py").read_text() == "X = 1\n"
    os.chdir(project)                                     # this one has: it replaces the workspace's
    workspace.copy_custom(ws)
    assert sorted(p.name for p in (ws / "custom").iterdir()) == ["rewards.py", "words.py"]


def test_a_relative_model_path_is_pinned_where_it_was_checked(project):
    from posttrain.workspace import pin_model_path

    assert pin_model_path({"model": {"path": "models/m"}})["model"]["path"] == str(project / "models" / "m")
    assert pin_model_path({"model": {"path": "/abs/m"}})["model"]["path"] == "/abs/m"
    assert pin_model_path({"seed": 1}) == {"seed": 1}


# --- through DVC -------------------------------------------------------------------------
@pytest.mark.slow
def test_custom_code_runs_in_a_run_and_editing_it_reruns_the_stages(project):
    """`posttrain run --config` from the project folder: the variant workspace gets the
    project's custom/, its stages run the custom environment and reward (under DVC and
    Prefect), `posttrain replay` reproduces the run from its commit, and an edit to
    custom/ reaches the workspace and reruns its stages."""
    from posttrain import workspace

    overrides = {**SMALL, "data": {"env": "custom.words:make_env", "options": {"operand_max": 9, "heldout_size": 20}},
                 "grpo": {"dense": {**SMALL["grpo"]["dense"], "rewards": {"correctness": 1.0, "custom.rewards:brevity": 0.5},
                                    "guardrails": ["custom.rewards:blank"]}}}
    path = project / "configs" / "words.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), **overrides}, sort_keys=False))
    ws = project / "runs" / "words"  # the variant's default workspace, a path relative to the caller's folder
    sh("posttrain", "run", "--config", path, cwd=project, timeout=900)
    again = sh("posttrain", "run", "--config", path, cwd=project, timeout=900)  # issue 25: exited 1 (KeyError)
    assert "Nothing to do" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    assert (ws / "custom" / "words.py").read_text() == WORDS
    train = [json.loads(line) for line in (ws / "data" / "train.jsonl").read_text().splitlines()]
    assert all(row["prompt"].endswith("?") for row in train)      # the custom environment's data
    assert json.loads((ws / "metrics" / "grpo" / "dense.json").read_text())["steps"] == 4
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    [grpo] = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`posttrain.stage` = 'grpo@dense'",
                                output_format="list")
    assert "rewards/custom.rewards.brevity/mean" in grpo.data.metrics      # the custom channel's curve
    assert "up to date" in sh("dvc", "status", cwd=ws).stdout
    # replay: a clone of the run's commit (custom/ included) reruns every stage to the same numbers
    [parent] = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`posttrain.flow` = 'retrain'",
                                  output_format="list")
    done = sh("posttrain", "replay", parent.info.run_id, "--tracking-uri", f"sqlite:///{ws / 'mlflow.db'}",
              "--scratch", project / "replay", cwd=ws, check=False, timeout=900)
    assert done.returncode == 0 and ", 0 DIFFERENT," in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]

    rewards = project / "custom" / "rewards.py"                           # edited in the project
    rewards.write_text(rewards.read_text() + "\n\ndef unused(completions, **columns):\n    return [0.0] * len(completions)\n")
    workspace.copy_custom(ws)                                              # what the next `posttrain run` does first
    status = yaml.safe_load(sh("dvc", "status", "--json", cwd=ws).stdout)
    changed = {name for name, changes in status.items()
               if any("custom" in (c.get("changed deps") or {}) for c in changes if isinstance(c, dict))}
    assert changed == {"prepare", "sft", "grpo@dense", "serving", "evaluate"}, status  # serving sizes the episodes
