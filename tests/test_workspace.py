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
from flows.lock import lock
from tasks.dvc_stages import stage_order, stages


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
    code = ("import sys; from flows.lock import lock\n"
            "with lock(sys.argv[1], log=lambda m: print(m, flush=True)):\n    print('got the lock', flush=True)\n")
    with lock(ws, log=print):
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


def test_a_wheel_holds_what_a_workspace_needs(tmp_path):
    """Built as a wheel and unpacked away from this checkout, the package still creates a
    workspace: dvc.yaml, configs, GPU profiles and ignore files are package data."""
    import shutil
    import zipfile

    repo = workspace.PACKAGE.parent
    # the template's links to dvc.yaml are package data, not a second pipeline (.dvcignore)
    assert [s["name"] for s in stages(repo)] == ["prepare", "sft", "grpo@dense", "serving", "evaluate"]
    source = tmp_path / "source"   # setuptools builds in the source folder: a copy, not this checkout
    for path in ("pyproject.toml", "README.md", "dvc.yaml", ".gitignore", ".dvcignore", "datasets/README.md",
                 "custom/README.md"):
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(repo / path, source / path)
    for folder in ("posttrain", "flows", "tasks", "configs"):
        shutil.copytree(repo / folder, source / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("posttrain-*.whl")
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = ("import sys, yaml; from posttrain import workspace; "
            "workspace.create(sys.argv[1], yaml.safe_load(open(sys.argv[2]))); print(workspace.PACKAGE)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ws"), str(repo / "configs" / "pipeline.yaml")],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(tmp_path / "site" / "posttrain")    # not this checkout's package
    for path in ("dvc.yaml", ".gitignore", ".dvcignore", "configs/gpus.yaml", "datasets/README.md", "custom/README.md",
                 "posttrain/capacity/gpus.yaml", "posttrain/stages/sft.py"):
        assert (tmp_path / "ws" / path).is_file() and not (tmp_path / "ws" / path).is_symlink(), path
    env = yaml.safe_load((repo / "configs" / "pipeline.yaml").read_text())["data"]["env"]
    assert (tmp_path / "ws" / "dvc.yaml").read_text() == workspace.dvc_yaml(env)   # the template, for its environment
    assert not (tmp_path / "ws" / "posttrain" / "template").exists()
