"""Hostile plug-ins and `custom/` folders (issue 25): what a config names by import path,
and what the folder of the user's own code holds, are refused by `posttrain check` and
`posttrain run` in one line (exit 2), before anything is written or any of it runs; a
plug-in that raises, exits or blocks is one line naming it and its own frame, at check
and inside a stage; a plug-in's import has a time limit.

Each case is a project folder (the current folder: import paths resolve from it) holding
`custom/` and a variant of the shipped pipeline.yaml.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, make_workspace
from hardening import assert_nothing_left, assert_refused, cli, cli_process, state
from posttrain import workspace
from posttrain.errors import UserError

# A task of the user's own, good: the hostile cases vary it.
SUMS = '''
import random


class Sums:
    name = "sums"

    def __init__(self, **options):
        self.options = options

    def generate(self, seed):
        rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b), "answer": str(a + b)}
                for a in range(30) for b in range(30)]
        random.Random(seed).shuffle(rows)
        return {"train": rows[20:], "heldout": rows[:20]}

    def parse(self, completion):
        return completion.strip() or None

    def verify(self, completion, answer):
        return self.parse(completion) == answer


def make_env(**options):
    return Sums(**options)


def short(completions, **columns):
    return [float(len(c) < 3) for c in completions]
'''

# What a module of the user's may hand over as if it were its own.
EVIL = '''
import functools
import subprocess
from os import system

from posttrain.scoring.rewards import correctness

ev = eval
touch = functools.partial(subprocess.run, ["touch", "pwned"])
'''

# Environments whose code raises: `line` is where, in custom/boom.py.
BOOM = '''
import sys

from custom.sums import Sums
from custom.helpers import lookup


class InGenerate(Sums):
    def generate(self, seed):
        raise ValueError("no rows today")                  # line 10


class InInit(Sums):
    def __init__(self, **options):
        raise RuntimeError("cannot reach the task server")  # line 15


class Exits(Sums):
    def generate(self, seed):
        sys.exit(0)                                         # line 20


class InHelper(Sums):
    def generate(self, seed):
        return lookup(seed)


class Loud(Sums):
    def generate(self, seed):
        raise ValueError("x" * 1_000_000)                  # line 30


class Recurses(Sums):
    def generate(self, seed):
        return self.generate(seed)                          # line 35


class Flaky(Sums):
    """Right the first time (the config check), wrong the second (the stage itself)."""
    calls = 0

    def generate(self, seed):
        Flaky.calls += 1
        if Flaky.calls > 1:
            raise KeyError("split")                         # line 45
        return super().generate(seed)


class FlakyExit(Flaky):
    def generate(self, seed):
        if Flaky.calls:
            sys.exit(3)                                     # line 52
        return super().generate(seed)


def flaky_factory(**options):
    Flaky.calls += 1
    if Flaky.calls > 1:
        raise OSError("the task server went away")          # line 59
    return Sums(**options)


def broken_factory(**options):
    return Sums(size=None + 1)                              # line 64
'''
HELPERS = 'def lookup(seed):\n    return {}["rows"][seed]\n'  # KeyError at custom/helpers.py:2


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder, the current folder, with custom/ holding the modules above;
    `custom` forgotten by Python before and after (each case imports its own)."""
    (tmp_path / "custom").mkdir()
    for name, text in [("sums", SUMS), ("evil", EVIL), ("boom", BOOM), ("helpers", HELPERS)]:
        (tmp_path / "custom" / f"{name}.py").write_text(text)
    forget = lambda: [sys.modules.pop(m) for m in list(sys.modules) if m == "custom" or m.startswith("custom.")]
    forget()
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    forget()


def variant(project: Path, override: dict) -> Path:
    """configs/variant.yaml: the shipped config with `override`; a `rewards`, `guardrails` or
    `audit` entry goes into a GRPO stage of its own."""
    config = {"extends": str(REPO / "configs" / "pipeline.yaml")}
    grpo = {k: override.pop(k) for k in ("rewards", "guardrails", "audit") if k in override}
    if grpo:
        config["grpo"] = {"dense": {"from": "sft", **grpo}}
    path = project / "configs" / "variant.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump({**config, **override}))
    return path


def assert_check_and_run_refuse(project: Path, override: dict, needles: list[str], *, in_config: bool = True) -> None:
    """`posttrain check` and `posttrain run` each refuse in one line naming every needle
    (and the variant file, `in_config`); no file, commit or MLflow run appears, no workspace."""
    path = variant(project, dict(override))
    before = state(project)
    for command in ("check", "run"):
        assert_refused(cli(command, "--config", path, cwd=project), *([str(path)] if in_config else []), *needles)
    assert_nothing_left(project, before)
    assert not (project / "runs").exists()


# --- an import path names a plug-in, not the standard library or posttrain ---------------
CODE_CASES = [
    ({"data": {"env": "os:system", "options": {"command": "touch pwned"}}},
     ["data.env", "'os:system'", "standard library (os)", "custom/mytask.py"]),                # a shell command at check
    ({"data": {"env": "subprocess:run", "options": {"args": ["touch", "pwned"]}}},
     ["data.env", "standard library (subprocess)"]),                                             # the same, by subprocess
    ({"data": {"env": "os.path:join"}}, ["data.env", "standard library (os)"]),                 # a submodule of one
    ({"data": {"env": "__main__:main", "options": {"argv": ["check"]}}}, ["data.env", "(__main__)"]),  # the running program
    ({"rewards": {"os:system": 1.0}}, ["grpo.dense.rewards", "standard library (os)"]),         # a reward that runs commands
    ({"guardrails": ["builtins:eval"]}, ["grpo.dense.guardrails", "standard library (builtins)"]),  # eval as a guardrail
    ({"rewards": {"importlib:import_module": 1.0}}, ["grpo.dense.rewards", "(importlib)"]),    # imports anything
    ({"data": {"env": "custom.evil:system"}}, ["data.env", "system of Python's standard library (posix)"]),  # re-exported
    ({"rewards": {"custom.evil:ev": 1.0}}, ["grpo.dense.rewards", "eval", "(builtins)"]),       # eval under another name
    ({"guardrails": ["custom.evil:touch"]}, ["grpo.dense.guardrails", "run", "(subprocess)"]),  # a partial of subprocess.run
    ({"data": {"env": "posttrain.cli:main", "options": {"argv": ["kv", "x"]}}},
     ["data.env", "posttrain's own internals", "data.env: arithmetic"]),                         # posttrain's CLI as a factory
    ({"rewards": {"custom.evil:correctness": 1.0}}, ["grpo.dense.rewards", "posttrain's own (posttrain.scoring.rewards)"]),  # built-in by path
]


@pytest.mark.parametrize("override, needles", CODE_CASES, ids=[f"code{i}" for i in range(len(CODE_CASES))])
def test_an_import_path_must_name_a_plugin(project, override, needles):
    assert_check_and_run_refuse(project, override, needles)
    assert not (project / "pwned").exists()


@pytest.mark.parametrize("name, value, needles", [
    ("shell", "os:system", ["standard library (os)"]),                    # an installed package registers os:system
    ("sneaky", "evil_env:system", ["system of Python's standard library (posix)"]),  # its module re-exports it
])
def test_an_entry_point_must_name_a_plugin(project, monkeypatch, name, value, needles):
    """A real distribution on sys.path (a dist-info folder with entry_points.txt), as pip
    leaves one, registering a standard-library function as an environment."""
    site = project / "site"
    (site / "evil_env-1.0.dist-info").mkdir(parents=True)
    (site / "evil_env-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: evil-env\nVersion: 1.0\n")
    (site / "evil_env-1.0.dist-info" / "entry_points.txt").write_text(f"[posttrain.envs]\n{name} = {value}\n")
    (site / "evil_env.py").write_text("from os import system\n")
    monkeypatch.syspath_prepend(str(site))
    assert_check_and_run_refuse(project, {"data": {"env": name, "options": {"command": "touch pwned"}}},
                                ["data.env", *needles])
    assert not (project / "pwned").exists()


def test_plugins_of_the_users_own_pass(project):
    """The rule refuses what is not a plug-in, not the user's: a class and functions of
    custom/ (a reward, a guardrail) pass the check (the reward pays short answers, which
    the reward audit would refuse: tests/test_audit.py)."""
    path = variant(project, {"data": {"env": "custom.sums:make_env"}, "rewards": {"custom.sums:short": 0.5},
                             "guardrails": ["custom.sums:short"], "audit": "off"})
    done = cli("check", "--config", path, cwd=project)
    assert done.returncode == 0, done.stderr


# --- a plug-in that exits or raises at import ---------------------------------------------
@pytest.mark.parametrize("module, override, needles", [
    ("import sys\nsys.exit(0)\n", {"data": {"env": "custom.quits:make_env"}},
     ["data.env", "import of 'custom.quits' failed", "SystemExit: sys.exit(0)", "custom/quits.py:2"]),  # exit 0: "passed"
    ("raise SystemExit('bye')\n", {"data": {"env": "custom.quits:make_env"}},
     ["data.env", "sys.exit('bye')", "custom/quits.py:1"]),                                  # SystemExit with a message
    ("import sys\n\n\nsys.exit(3)\n", {"rewards": {"custom.quits:short": 1.0}},
     ["grpo.dense.rewards", "sys.exit(3)", "custom/quits.py:4"]),                            # a reward's module
    ("exit()\n", {"guardrails": ["custom.quits:short"]},
     ["grpo.dense.guardrails", "sys.exit(None)", "custom/quits.py:1"]),                      # the interactive exit()
    ("import custom.helpers\ncustom.helpers.lookup(0)\n", {"data": {"env": "custom.quits:make_env"}},
     ["data.env", "KeyError: 'rows'", "custom/helpers.py:2 in lookup"]),                   # raises in a module it imports
])
def test_a_plugin_that_exits_or_raises_at_import(project, module, override, needles):
    (project / "custom" / "quits.py").write_text(module)
    assert_check_and_run_refuse(project, override, needles)


# --- a plug-in that blocks at import: the import's own time limit ends it --------------------
@pytest.mark.parametrize("module, override, line", [
    ("import time\ntime.sleep(10**6)\n", {"data": {"env": "custom.slow:make_env"}}, 2),          # sleeps at import
    ("import threading\nthreading.Event().wait()\n", {"rewards": {"custom.slow:short": 1.0}}, 2),  # waits for ever
    ("while True:\n    pass\n", {"guardrails": ["custom.slow:short"]}, 1),                         # spins (the GIL by turns)
])
def test_a_plugin_that_blocks_at_import_ends_in_its_time_limit(project, module, override, line):
    """Real `posttrain check` and `run` processes (the import's thread is left behind: only
    the process's end ends it); the limit set small by its variable, the test's timeout a
    hang guard."""
    (project / "custom" / "slow.py").write_text(module)
    path = variant(project, dict(override))
    before = state(project)
    for command in ("check", "run"):
        done = cli_process(command, "--config", path, cwd=project, env={"POSTTRAIN_PLUGIN_IMPORT_SECONDS": "2"},
                           timeout=300)
        assert_refused(done, str(path), "import of 'custom.slow' did not finish in 2 s", f"at custom/slow.py:{line}",
                       "POSTTRAIN_PLUGIN_IMPORT_SECONDS")
    assert_nothing_left(project, before)
    assert not (project / "runs").exists()


@pytest.mark.parametrize("value", ["soon", "0", "-5", "inf", "nan"])  # text, no time, negative, for ever, not a number
def test_the_import_time_limit_must_be_a_number_of_seconds(project, value):
    path = variant(project, {"data": {"env": "custom.sums:make_env"}})
    before = state(project)
    done = cli("check", "--config", path, cwd=project, env={"POSTTRAIN_PLUGIN_IMPORT_SECONDS": value})
    assert_refused(done, "POSTTRAIN_PLUGIN_IMPORT_SECONDS", "number of seconds")
    assert_nothing_left(project, before)


# --- an environment whose code raises: at check, and inside a stage ---------------------------
@pytest.mark.parametrize("factory, needles", [
    ("InGenerate", ["raised ValueError: no rows today at custom/boom.py:10 in generate (custom.boom)"]),  # generate
    ("InInit", ["raised RuntimeError: cannot reach the task server at custom/boom.py:15 in __init__"]),  # the factory
    ("Exits", ["raised SystemExit: sys.exit(0) at custom/boom.py:20 in generate"]),              # exit 0 is no pass
    ("InHelper", ["raised KeyError: 'rows' at custom/helpers.py:2 in lookup (custom.helpers)"]),  # its own helper's frame
    ("Loud", ["raised ValueError: xxxx", "...", "custom/boom.py:30"]),                         # a 1 MB message, cut
    ("Recurses", ["raised RecursionError", "custom/boom.py:35 in generate"]),                   # no end
    ("broken_factory", ["raised TypeError: unsupported operand", "custom/boom.py:64 in broken_factory"]),  # not data.options'
])
def test_an_environment_that_raises_is_one_line_at_check(project, factory, needles):
    name = f"custom.boom:{factory}"
    assert_check_and_run_refuse(project, {"data": {"env": name}}, ["data.env", f"'{name}' raised", *needles])
    assert len(cli("check", "--config", variant(project, {"data": {"env": name}})).stderr) < 800  # no echoed message


@pytest.fixture(scope="module")
def stage_ws(tmp_path_factory):
    """A variant workspace holding custom/ (the modules above) and its MLflow store, made
    once: each case names its environment in the workspace's params file."""
    project, here = tmp_path_factory.mktemp("stage-project"), os.getcwd()
    (project / "custom").mkdir()
    for name, text in [("sums", SUMS), ("boom", BOOM), ("helpers", HELPERS)]:
        (project / "custom" / f"{name}.py").write_text(text)
    os.chdir(project)  # the custom/ a new workspace copies
    try:
        ws = make_workspace(project / "ws", {"data": {"env": "custom.sums:make_env"}})
    finally:
        os.chdir(here)
    from mlflow import MlflowClient

    MlflowClient(f"sqlite:///{ws / 'mlflow.db'}").search_experiments()  # its tables made (MLflow logs that on stderr)
    (ws / "logs").mkdir()
    (ws / "logs" / "prepare.log").write_text("")  # as a run's flow keeps the stage's output
    return ws


@pytest.mark.parametrize("factory, needles", [
    ("Flaky", ["a plug-in raised KeyError: 'split' at custom/boom.py:45 in generate (custom.boom)"]),  # generate, 2nd time
    ("FlakyExit", ["a plug-in raised SystemExit: sys.exit(3) at custom/boom.py:52 in generate"]),        # exits mid-stage
    ("flaky_factory", ["OSError: the task server went away at custom/boom.py:59 in flaky_factory"]),  # the factory
])
def test_an_environment_that_raises_in_a_stage_is_one_line(stage_ws, monkeypatch, factory, needles):
    """`posttrain stage prepare` in a workspace, as DVC runs it: the config check passes
    (the plug-in's first call), then its code raises inside the stage. The line names the
    plug-in's frame and the stage's log, and the stage's MLflow run does not stay RUNNING."""
    params = stage_ws / "configs" / "pipeline.yaml"
    config = yaml.safe_load(params.read_text())
    params.write_text(yaml.safe_dump({**config, "data": {**config["data"], "env": f"custom.boom:{factory}"}}, sort_keys=False))
    for module in [m for m in sys.modules if m == "custom" or m.startswith("custom.")]:
        monkeypatch.delitem(sys.modules, module)  # each case counts its calls from 0
    done = cli("stage", "prepare", "--config", "configs/pipeline.yaml", "--data-dir", "data", "--datasets-dir", "datasets",
               "--model-dir", "artifacts/models/base", "--metrics-path", "metrics/prepare.json", cwd=stage_ws,
               env={"MLFLOW_TRACKING_URI": f"sqlite:///{stage_ws / 'mlflow.db'}"})
    assert_refused(done, "posttrain stage prepare", *needles, "(the stage's output: logs/prepare.log)")
    assert not (stage_ws / "data" / "train.jsonl").exists()
    assert "RUNNING" not in state(stage_ws)["runs"].values()


# --- custom/: no special files, no links out of the project ------------------------------------
def fifo(relative: str):
    def make(project):
        (project / relative).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(project / relative)
    return make


def unix_socket(project):
    with socket.socket(socket.AF_UNIX) as sock:  # the file stays after the socket closes
        sock.bind(str(project / "custom" / "host.sock"))


def link(relative: str, target: str):
    """custom/<relative> -> target (`{outside}`: a folder beside the project, `{name}`: the project's name)."""
    def make(project):
        outside = project.parent / f"{project.name}-outside"
        outside.mkdir(exist_ok=True)
        (outside / "rows.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
        path = project / relative
        if path.is_dir() and not path.is_symlink():
            os.rename(path, project / "custom-before")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target.replace("{outside}", str(outside)).replace("{name}", project.name))
    return make


SPECIAL_CASES = [
    (fifo("custom/pipe"), ["custom/pipe", "a named pipe (FIFO)", "remove it from custom/"]),        # copytree blocks on it
    (fifo("custom/data/deep/pipe"), ["custom/data/deep/pipe", "named pipe"]),                        # nested
    (fifo("custom/pipe.py"), ["custom/pipe.py", "named pipe"]),                                      # named like a module
    (unix_socket, ["custom/host.sock", "a socket"]),                                                # a server's socket
    (link("custom/zero", "/dev/zero"), ["custom/zero", "/dev/zero", "outside"]),                     # a device, by link
]
LINK_CASES = [
    (link("custom/passwd", "/etc/passwd"), ["custom/passwd", "a link to /etc/passwd", "outside", "copy the file"]),
    (link("custom", "{outside}"), ["custom: is a link to", "-outside, outside"]),                    # custom/ itself
    (link("custom/data", "../../{name}-outside"), ["custom/data", "outside"]),                             # relative, leaving
    (link("custom/shared.py", "../../etc/hostname"), ["custom/shared.py", "outside"]),                # up and out
    (link("custom/gone.py", "nowhere.py"), ["custom/gone.py", "a link to nowhere.py, which does not exist"]),  # dangling
    (link("custom/again", "."), ["custom/again", "loop"]),                                           # itself: copy never ends
    (link("custom/up", ".."), ["custom/up", "loop"]),                                                # the project, custom/ in it
    (link("custom/self", "self"), ["custom/self", "cannot be read", "symbolic links"]),               # a link to itself
]


@pytest.mark.parametrize("make, needles", SPECIAL_CASES + LINK_CASES,
                         ids=[f"special{i}" for i in range(len(SPECIAL_CASES))] + [f"link{i}" for i in range(len(LINK_CASES))])
def test_custom_holds_only_files_of_the_project(project, make, needles):
    make(project)
    assert_check_and_run_refuse(project, {"data": {"env": "custom.sums:make_env"}}, needles, in_config=False)


@pytest.mark.parametrize("make, needles", SPECIAL_CASES + LINK_CASES,
                         ids=[f"special{i}" for i in range(len(SPECIAL_CASES))] + [f"link{i}" for i in range(len(LINK_CASES))])
def test_custom_is_checked_before_it_is_copied_into_a_workspace(project, tmp_path_factory, make, needles):
    """What `posttrain run --config` does to an existing variant workspace first (workspace.
    prepare -> copy_custom): the same refusal, the workspace's custom/ untouched."""
    ws = tmp_path_factory.mktemp("ws")
    (ws / "custom").mkdir()
    (ws / "custom" / "mine.py").write_text("X = 1\n")
    make(project)
    with pytest.raises(UserError) as refused:
        workspace.copy_custom(ws)
    assert all(n in str(refused.value) for n in needles), refused.value
    assert [p.name for p in (ws / "custom").iterdir()] == ["mine.py"]


def test_links_within_the_project_are_copied_as_what_they_point_at(project, tmp_path_factory):
    (project / "lib").mkdir()
    (project / "lib" / "tables.py").write_text("TABLE = {1: 2}\n")
    (project / "custom" / "tables.py").symlink_to("../lib/tables.py")
    (project / "custom" / "lib").symlink_to("../lib")
    path = variant(project, {"data": {"env": "custom.sums:make_env"}})
    assert cli("check", "--config", path, cwd=project).returncode == 0
    ws = tmp_path_factory.mktemp("ws")
    workspace.copy_custom(ws)
    assert (ws / "custom" / "tables.py").read_text() == "TABLE = {1: 2}\n" and not (ws / "custom" / "tables.py").is_symlink()
    assert (ws / "custom" / "lib" / "tables.py").is_file()
