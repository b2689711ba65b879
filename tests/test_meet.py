"""Runs that meet (issue 49): `posttrain run`s started at the same instant on a workspace
that does not exist yet, with a Prefect home no run has used (a new user's cron tick and
their own hand): exactly one trains, the others wait for it and say "Nothing to do", no
traceback anywhere, every exit code 0. Before, two temporary Prefect servers migrated the
new database at once (`duplicate column name`, `No such index`) and their runs failed.

And a run started while `dvc repro` runs in the workspace waits for DVC's lock (DVC's own
`--wait-for-lock`) instead of failing part-way."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import yaml

from conftest import BIN, CHILD_ENV_DROP, REPO, SMALL, make_workspace

pytestmark = pytest.mark.slow
RUNS = 4


def env_with(tmp_path) -> dict:
    """The tests' environment with a Prefect home of its own, which no run has migrated yet."""
    env = {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROP}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env['PATH']}", "PREFECT_HOME": str(tmp_path / "prefect-new")}


def started(cmd: list, cwd, env, out) -> subprocess.Popen:
    return subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=open(f"{out}.out", "w"),
                            stderr=open(f"{out}.err", "w"))


def outputs(out) -> str:
    return open(f"{out}.out").read() + open(f"{out}.err").read()


def test_runs_started_together_on_a_new_workspace(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), **SMALL}, sort_keys=False))
    env, ws = env_with(tmp_path), tmp_path / "ws"
    procs = [started(["posttrain", "run", "--config", config, "--workdir", ws], tmp_path, env, tmp_path / f"run{i}")
             for i in range(RUNS)]
    codes = [p.wait(timeout=1800) for p in procs]
    said = [outputs(tmp_path / f"run{i}") for i in range(RUNS)]
    assert codes == [0] * RUNS, said
    assert not [s for s in said if "Traceback" in s], said
    assert sum("Nothing to do" in s for s in said) == RUNS - 1, said
    assert sum("waiting for it to finish" in s for s in said) >= 1, said  # the lock, named
    assert not list(tmp_path.glob(".ws.creating-*"))  # the losers' scratch folders are gone


def test_a_run_started_while_dvc_repro_runs_waits_for_it(tmp_path):
    ws = make_workspace(tmp_path / "ws", SMALL)
    env = env_with(tmp_path)
    repro = started(["dvc", "repro"], ws, env, tmp_path / "repro")
    # the run starts once DVC holds its lock (bounded by the repro: it must not have ended)
    while "Running stage" not in outputs(tmp_path / "repro"):
        assert repro.poll() is None, outputs(tmp_path / "repro")
        time.sleep(0.1)
    run = started(["posttrain", "run", "--workdir", ws], ws, env, tmp_path / "run")
    assert repro.wait(timeout=1800) == 0, outputs(tmp_path / "repro")
    assert run.wait(timeout=1800) == 0, outputs(tmp_path / "run")
    said = outputs(tmp_path / "run")
    assert "Traceback" not in said and "Unable to acquire lock" not in said, said
    assert "a DVC command works in" in said, said  # whom it waited for, named


def test_two_configs_started_together_on_one_new_workspace_run_in_turn(tmp_path):
    """Two schedulers' configs (here: two seeds) aimed at one new workspace: both train, one
    after the other, each on its own config; neither fails nor says "Nothing to do"."""
    configs = []
    for seed in (1, 2):
        configs.append(tmp_path / f"seed{seed}.yaml")
        configs[-1].write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), **SMALL,
                                               "seed": seed}, sort_keys=False))
    env, ws = env_with(tmp_path), tmp_path / "ws"
    procs = [started(["posttrain", "run", "--config", c, "--workdir", ws], tmp_path, env, tmp_path / c.stem)
             for c in configs]
    codes = [p.wait(timeout=1800) for p in procs]
    said = [outputs(tmp_path / c.stem) for c in configs]
    assert codes == [0, 0], said
    assert not [s for s in said if "Traceback" in s or "Nothing to do" in s], said
    assert sum("waiting for it to finish" in s for s in said) == 1, said
