"""Variant workspaces (`posttrain run --config`): layout, and DVC stage names from elsewhere."""

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
