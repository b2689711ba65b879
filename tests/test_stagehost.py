"""The stage host (posttrain/runtime/stagehost.py): a command it runs behaves as the command run
alone (exit code, output, the workspace's code as it is on disk), a command it cannot run
alike runs in its own process, the config check answers as it would here, and a stage
ends with its client. Real processes throughout: a host, its forks, the clients."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import SMALL, make_workspace
from posttrain.runtime import stagehost
from posttrain.workspace import stage_env

pytestmark = pytest.mark.slow  # a host imports torch, transformers and TRL: seconds before it serves


def posttrain(args, cwd, env, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, **kwargs)


def hosted_env(workdir: Path, **extra) -> dict[str, str]:
    env = stage_env(str(workdir), PYTHONUNBUFFERED="1", **extra)
    env.pop("PYTEST_CURRENT_TEST", None)  # pytest's, changed test by test (the flow's stages share one value)
    return env


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A workspace with its own posttrain/ (as variants and replays have) and a host for it."""
    ws = make_workspace(tmp_path_factory.mktemp("host") / "ws", SMALL)
    with stagehost.hosting(str(ws), hosted_env(ws)) as path:
        yield ws, path


def test_a_stage_the_host_runs_ends_as_the_command_alone(workspace):
    ws, path = workspace
    bad = ["stage", "prepare", "--bogus", "x"]
    alone = posttrain(bad, ws, hosted_env(ws))
    hosted = posttrain(bad, ws, hosted_env(ws, **{stagehost.ENV_VAR: path}))
    assert alone.returncode == hosted.returncode == 2
    assert hosted.stderr == alone.stderr and hosted.stderr.count("\n") == 1, hosted.stderr  # not declined
    assert hosted.stdout == alone.stdout == ""
    prompted = hosted_env(ws, **{stagehost.ENV_VAR: path}, PS1="(.venv) $ ")  # `activate`d; DVC's shell drops it
    assert posttrain(bad, ws, prompted).stderr == alone.stderr


def test_the_fork_runs_the_workspace_code_as_it_is_now(workspace):
    """The host imported its posttrain before the edit; the fork imports it again (what DVC hashed)."""
    ws, path = workspace
    entry = ws / "posttrain" / "stage_entry.py"
    before = entry.read_text()
    try:
        entry.write_text(before.replace('problem = f"unknown flag', 'problem = f"edited: unknown flag'))
        hosted = posttrain(["stage", "prepare", "--bogus", "x"], ws, hosted_env(ws, **{stagehost.ENV_VAR: path}))
    finally:
        entry.write_text(before)
    assert hosted.returncode == 2 and "edited: unknown flag --bogus" in hosted.stderr, hosted.stderr


def test_what_the_host_cannot_run_alike_runs_in_its_own_process(workspace):
    ws, path = workspace
    env = hosted_env(ws, **{stagehost.ENV_VAR: path})
    env["OMP_NUM_THREADS"] = "1" if env.get("OMP_NUM_THREADS") != "1" else "2"  # read by torch as it is imported
    done = posttrain(["stage", "prepare", "--bogus", "x"], ws, env)
    first, second = done.stderr.splitlines()
    assert first == ("posttrain: the stage host did not take `posttrain stage` (environment variable "
                     "OMP_NUM_THREADS differs from the host's); running it in this process")
    assert second.startswith("posttrain: error: posttrain stage prepare: unknown flag --bogus") and done.returncode == 2
    gone = posttrain(["stage", "prepare", "--bogus", "x"], ws, hosted_env(ws, **{stagehost.ENV_VAR: str(ws / "none")}))
    assert gone.returncode == 2 and "(no answer); running it in this process" in gone.stderr


CHECK = """import json, sys
from tasks.checks import checked_in_host
from posttrain.errors import UserError
try:
    print(json.dumps({"fits": checked_in_host(sys.argv[1])}))
except UserError as err:
    print(json.dumps({"refused": str(err)}))
"""


def test_the_config_check_the_host_runs_answers_as_the_check_here(workspace):
    ws, path = workspace
    config = yaml.safe_load((ws / "configs" / "pipeline.yaml").read_text())
    config["sft"]["trl"]["lr_scheduler_type"] = "bogus"
    (ws / "configs" / "bad.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    answers = {}
    for name in ("pipeline.yaml", "bad.yaml"):
        done = subprocess.run([sys.executable, "-c", CHECK, f"configs/{name}"], cwd=ws, capture_output=True, text=True,
                              env=hosted_env(ws, **{stagehost.ENV_VAR: path}), timeout=300)
        answers[name] = json.loads(done.stdout)
    here = posttrain(["check", "--config", "configs/bad.yaml"], ws, hosted_env(ws))
    assert answers["pipeline.yaml"] == {"fits": ""}  # the host did it (None: it did not)
    assert here.returncode == 2 and here.stderr == f"posttrain: error: {answers['bad.yaml']['refused']}\n"
    assert "sft.trl: 'bogus' is not a valid lr_scheduler_type; choose one of linear, cosine" in here.stderr


def stage_command(ws: Path, stage: str) -> list[str]:
    return yaml.safe_load((ws / "dvc.yaml").read_text())["stages"][stage]["cmd"].split()[3:]  # after `python -m posttrain`


def test_a_stage_ends_with_its_client(workspace):
    """kill -9 of the command DVC started (as when dvc or the flow dies): its fork ends too;
    a SIGTERM to the client reaches the fork, whose exit code the client passes on."""
    ws, path = workspace
    host = next(p for p in psutil.Process().children() if "posttrain.runtime.stagehost" in " ".join(p.cmdline()))
    env = hosted_env(ws, **{stagehost.ENV_VAR: path})
    prepared = posttrain(stage_command(ws, "prepare"), ws, env)
    assert prepared.returncode == 0 and "did not take" not in prepared.stderr, prepared.stderr
    for kill, code in ((signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 128 + signal.SIGTERM)):
        client = subprocess.Popen([sys.executable, "-m", "posttrain", *stage_command(ws, "sft")], cwd=ws, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not host.children():
                assert client.poll() is None  # the host forks the stage, or the client ends
                time.sleep(0.1)
            fork = host.children()[0]
            time.sleep(0.5)  # loading, training: the SFT stage takes seconds more
            assert fork.is_running() and client.poll() is None
            client.send_signal(kill)
            assert client.wait(timeout=30) == code
            _, alive = psutil.wait_procs([fork], timeout=10)
            assert not alive
        finally:
            with suppress(ProcessLookupError):
                client.kill()
    assert host.is_running() and host.status() != psutil.STATUS_ZOMBIE  # the host serves on
