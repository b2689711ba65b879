"""The format contract: SFT targets must parse and verify before SFT starts."""

import copy

import pytest

from posttrain.envs import get_env
from posttrain.errors import UserError
from posttrain.scoring.evaluation import check_format_contract
from conftest import SMALL, make_workspace, sh


def test_healthy_targets_pass():
    for name in ("arithmetic", "sql"):
        env = get_env(name)
        assert check_format_contract(env, env.generate(0)["train"], where="train.jsonl") == 1.0


def test_a_mismatched_target_format_stops_with_an_example():
    env = get_env("arithmetic", completion_format="= {answer}")   # SFT would teach `= 85`
    with pytest.raises(UserError) as err:
        check_format_contract(env, env.generate(0)["train"], where="data/train.jsonl")
    message = str(err.value)
    rows = len(env.generate(0)["train"])
    assert message.startswith(f"data/train.jsonl: format contract: {rows} of {rows} SFT targets fail the arithmetic "
                              "environment's verifier (only 0.0% verify")
    assert "parses as 'None', expected" in message and "target '= " in message and "fix:" in message


def test_one_bad_target_in_a_hundred_is_tolerated_two_are_not():
    env = get_env("arithmetic")
    rows = env.generate(0)["train"][:200]
    broken = [dict(r, completion="?") for r in rows[:3]]
    assert check_format_contract(env, broken[:2] + rows[2:], where="x") == pytest.approx(0.99)
    with pytest.raises(UserError, match="98.5%"):
        check_format_contract(env, broken + rows[3:], where="x")


@pytest.mark.slow
def test_sft_stage_refuses_before_any_compute(tmp_path):
    """Through the CLI: exit 2, one line on stderr, no model and no MLflow run written."""
    overrides = copy.deepcopy(SMALL)
    overrides["data"]["options"]["completion_format"] = "= {answer}"
    ws = make_workspace(tmp_path / "ws", overrides)
    sh("posttrain", "stage", "prepare", "--config", "configs/pipeline.yaml", "--data-dir", "data", "--datasets-dir", "datasets",
       "--model-dir", "artifacts/models/base", "--metrics-path", "metrics/prepare.json", cwd=ws)
    done = sh("posttrain", "stage", "sft", "--config", "configs/pipeline.yaml", "--data-dir", "data",
              "--base-dir", "artifacts/models/base", "--out-dir", "artifacts/models/sft",
              "--checkpoint-dir", "checkpoints/sft", "--metrics-path", "metrics/sft.json",
              "--curve-path", "plots/sft_validation.json", cwd=ws, check=False)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "format contract" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (ws / "artifacts" / "models" / "sft").exists() and not (ws / "metrics" / "sft.json").exists()
    runs = sh("mlflow", "runs", "list", "--experiment-id", "1", cwd=ws, check=False,
              env={"MLFLOW_TRACKING_URI": f"sqlite:///{ws / 'mlflow.db'}"})
    assert "sft" not in runs.stdout
