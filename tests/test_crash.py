"""kill -9 of `posttrain run` mid-GRPO leaves nothing behind: no process of the run
(Prefect's temporary API server, the stage) lives on, the stage log holds what the stage
printed, and the next run marks the dead MLflow runs KILLED and resumes GRPO from its
checkpoint. Which RUNNING runs count as dead: a table on a local store."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from contextlib import suppress

import psutil
import pytest
import yaml
from mlflow import MlflowClient

from conftest import BIN, CHILD_ENV_DROP, copy_workspace, sh
from posttrain.tracking.dead_runs import CRASH_TAG, HOST_TAG, PID_TAG, mark_dead_runs


def start_run(ws, out):
    """`posttrain run` in the background, in a process group of its own (as `sh` runs it)."""
    env = {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROP}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    env["SHELL"] = "/bin/sh"  # DVC runs stage commands with $SHELL -c; dash keeps itself between DVC and the stage
    return subprocess.Popen([str(BIN / "posttrain"), "run", "--workdir", str(ws)], cwd=ws, env=env,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill_mid_grpo(ws, out) -> tuple[int, dict[int, str]]:
    """Start a run, SIGKILL its process alone once GRPO has saved a checkpoint; returns the
    killed pid and what of its process tree outlived it by 15 s (pid: command line)."""
    run = start_run(ws, out)
    try:
        while not list(ws.glob("checkpoints/grpo/dense/*/checkpoint-*/trainer_state.json")):
            assert run.poll() is None, out.name  # the run checkpoints or ends: no clock needed
            time.sleep(0.5)
        tree = psutil.Process(run.pid).children(recursive=True)
        commands = {p.pid: " ".join(p.cmdline()) for p in tree}
        assert any("uvicorn" in c and "prefect" in c for c in commands.values()), commands  # the temporary API
        os.kill(run.pid, signal.SIGKILL)  # not the group: what it started must go by itself
        run.wait()
        _, alive = psutil.wait_procs(tree, timeout=15)
        return run.pid, {p.pid: commands[p.pid] for p in alive if p.status() != psutil.STATUS_ZOMBIE}
    finally:
        with suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)  # whatever the test found alive


def runs(ws) -> dict:
    client = MlflowClient(f"sqlite:///{ws / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    return {r.info.run_id: r for r in client.search_runs(experiments)}


@pytest.mark.slow
def test_kill_9_mid_grpo_leaves_nothing_behind(flow_runs, tmp_path):
    # a copy of the flow tests' workspace, GRPO made longer: prepare and sft stay cached
    ws = copy_workspace(flow_runs[0], tmp_path / "ws")
    params = ws / "configs" / "pipeline.yaml"
    config = yaml.safe_load(params.read_text())
    config["grpo"]["dense"]["trl"].update(max_steps=200, save_steps=2)  # killed after step 2, long before 200
    params.write_text(yaml.safe_dump(config, sort_keys=False))
    with open(tmp_path / "killed.out", "w") as out:
        pid, survivors = kill_mid_grpo(ws, out)
    assert survivors == {}
    log = (ws / "logs" / "grpo@dense.log").read_text()
    assert "Running stage 'grpo@dense'" in log and "'loss'" in log  # written as it went, up to step 2's logs
    left = {i: r for i, r in runs(ws).items() if r.info.status == "RUNNING"}
    parent = next(i for i, r in left.items() if "mlflow.parentRunId" not in r.data.tags)
    assert sorted(r.data.tags.get("mlflow.parentRunId", "") for r in left.values()) == ["", parent]  # and its grpo run

    sh("posttrain", "run", "--workdir", ws, cwd=ws, timeout=600)
    after = runs(ws)
    for run_id in left:
        assert after[run_id].info.status == "KILLED"
        assert after[run_id].data.tags[CRASH_TAG].startswith(f"process {pid} on "), after[run_id].data.tags
        assert " died; marked by process " in after[run_id].data.tags[CRASH_TAG]
    assert not [r for r in after.values() if r.info.status == "RUNNING"]
    assert "posttrain: resuming from" in (ws / "logs" / "grpo@dense.log").read_text()
    assert json.loads((ws / "metrics" / "grpo" / "dense.json").read_text())["resumed_from_step"] >= 2


def test_only_dead_retrain_runs_of_this_workspace_are_marked(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("e", artifact_location=(tmp_path / "a").as_uri())
    ws, here = str(tmp_path / "ws"), socket.gethostname()

    def retrain_run(workspace=ws, host=here, status="RUNNING"):
        tags = {"posttrain.flow": "retrain", "posttrain.workspace": workspace, PID_TAG: "41", HOST_TAG: host}
        run_id = client.create_run(exp, tags=tags).info.run_id
        if status != "RUNNING":
            client.set_terminated(run_id, status)
        return run_id

    dead = retrain_run()
    cases = {
        dead: "KILLED",                                                                  # this workspace's, RUNNING
        client.create_run(exp, tags={"mlflow.parentRunId": dead}).info.run_id: "KILLED",  # its stage run
        retrain_run(workspace=str(tmp_path / "other")): "RUNNING",                      # another workspace's
        retrain_run(host="elsewhere"): "RUNNING",                                       # another host's lock
        retrain_run(status="FINISHED"): "FINISHED",                                     # not left running
        # a stage run of a plain `dvc repro` (no flow: no lock held)
        client.create_run(exp, tags={"posttrain.workspace": ws, "posttrain.stage": "sft"}).info.run_id: "RUNNING",
    }
    marked = mark_dead_runs(client.tracking_uri, ws, "test")
    assert sorted(marked) == sorted(i for i, status in cases.items() if status == "KILLED")
    for run_id, status in cases.items():
        run = client.get_run(run_id)
        assert run.info.status == status
        assert (CRASH_TAG in run.data.tags) == (status == "KILLED")
    assert client.get_run(dead).data.tags[CRASH_TAG].startswith(f"process 41 on {here} died; marked by test at ")


STAGE = """import os, sys, time
from posttrain.runtime.lifetime import die_with_run
die_with_run()
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.parametrize("shell", ["/bin/sh", "/bin/bash"])  # dash stays between DVC and the stage; bash execs it
def test_a_stage_ends_with_the_run_whatever_stands_between(tmp_path, shell):
    """The stage side of the kill -9 test, in a second: run -> $SHELL -c -> stage, the run killed."""
    import sys

    script, pid_file = tmp_path / "stage.py", tmp_path / "stage.pid"
    script.write_text(STAGE)
    stage_cmd = f"{sys.executable} {script} {pid_file}"
    run = subprocess.Popen([sys.executable, "-c", f"""import os, subprocess, time
env = {{**os.environ, "DVC_STAGE": "grpo@dense", "POSTTRAIN_RUN_PID": str(os.getpid())}}
subprocess.Popen([{shell!r}, "-c", {stage_cmd!r}], env=env)
time.sleep(120)"""], start_new_session=True)
    try:
        while not pid_file.is_file() or not pid_file.read_text():
            assert run.poll() is None  # the stage writes its pid, or the run that started it ends
            time.sleep(0.1)
        stage = psutil.Process(int(pid_file.read_text()))
        assert (stage.parent().pid == run.pid) == (shell == "/bin/bash"), stage.parent().cmdline()
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        _, alive = psutil.wait_procs([stage], timeout=10)
        assert not alive
    finally:
        with suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)


def test_a_stage_whose_run_is_gone_stops_at_once(tmp_path):
    """POSTTRAIN_RUN_PID no longer above the stage (the run ended, its pid maybe reused): killed before it starts."""
    import sys

    other = subprocess.Popen(["sleep", "60"])  # alive, but not the stage's ancestor
    try:
        env = {**os.environ, "DVC_STAGE": "grpo@dense", "POSTTRAIN_RUN_PID": str(other.pid)}
        done = subprocess.run([sys.executable, "-c", STAGE, tmp_path / "pid"], env=env, timeout=60)
    finally:
        other.kill()
    assert done.returncode == -signal.SIGKILL and not (tmp_path / "pid").exists()
