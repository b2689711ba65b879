"""Variant workspaces (`posttrain run --config`): layout, and DVC stage names from elsewhere."""

import os
import subprocess
import sys
import time

import pytest
import yaml

from conftest import SMALL, make_workspace
from posttrain import workspace
from posttrain.errors import UserError
from tasks.dvc_stages import stage_order


def test_stage_names_do_not_depend_on_the_current_folder(tmp_path, monkeypatch):
    ws = make_workspace(tmp_path / "runs" / "ws", SMALL)
    monkeypatch.chdir(tmp_path)   # the flow runs a workspace below the repository root
    names = [s["name"] for s in stage_order.fn(str(ws))]
    assert names == ["prepare", "sft", "grpo@dense", "serving", "evaluate"]


def test_create_refuses_a_non_empty_folder_and_prepare_replaces_the_config(tmp_path):
    ws = make_workspace(tmp_path / "ws", SMALL)
    with pytest.raises(UserError, match="not empty"):
        workspace.create(ws, {})
    config = yaml.safe_load((ws / "configs" / "pipeline.yaml").read_text())
    config["seed"] = 7
    assert workspace.prepare(ws, config) == ws
    assert yaml.safe_load((ws / "configs" / "pipeline.yaml").read_text())["seed"] == 7


def test_a_second_run_waits_for_the_lock_and_says_whom_it_waits_for(tmp_path):
    ws = make_workspace(tmp_path / "ws", SMALL)
    code = ("import sys; from posttrain import workspace\n"
            "with workspace.lock(sys.argv[1], log=lambda m: print(m, flush=True)):\n    print('got the lock', flush=True)\n")
    with workspace.lock(ws, log=print):
        second = subprocess.Popen([sys.executable, "-c", code, str(ws)], stdout=subprocess.PIPE, text=True)
        first_line = second.stdout.readline()
        assert "another retrain run holds" in first_line and f"pid {os.getpid()}" in first_line
        time.sleep(0.5)
        assert second.poll() is None                                   # still queued behind us
    assert second.communicate(timeout=30)[0].strip() == "got the lock" and second.returncode == 0


def test_stages_run_the_workspace_copy_of_the_library(tmp_path):
    ws = make_workspace(tmp_path / "ws", SMALL)
    env = workspace.stage_env(ws)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ws)
    assert workspace.stage_env(tmp_path).get("PYTHONPATH") == os.environ.get("PYTHONPATH")   # no library there
