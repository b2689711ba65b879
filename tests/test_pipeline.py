"""Stage smoke tests: the real pipeline (TRL on the tiny model, MLflow, DVC) via `dvc repro`."""

import json
import time

import mlflow
import pytest

from conftest import sh

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reproduced(tmp_path_factory):
    from conftest import SMALL, make_workspace

    ws = make_workspace(tmp_path_factory.mktemp("repro") / "ws", SMALL)
    sh("dvc", "repro", cwd=ws)
    return ws


def test_every_stage_writes_its_metrics(reproduced):
    for stage in ("prepare", "sft", "grpo/dense", "serving", "evaluate"):
        assert (reproduced / "metrics" / f"{stage}.json").is_file(), stage
    report = json.loads((reproduced / "metrics" / "evaluate.json").read_text())
    assert list(report) == ["base", "sft", "grpo.dense", "grpo"]
    for result in report.values():
        assert 0 <= result["greedy_accuracy"] <= 1 and set(result["pass_at_k"]) == {"1", "4"}
        assert result["pass_at_k"]["1"] <= result["pass_at_k"]["4"]
    assert json.loads((reproduced / "metrics" / "serving.json").read_text())["kv_bytes_per_token"] == 2 * 2 * 16 * 2


def test_second_repro_retrains_nothing(reproduced):
    start = time.perf_counter()
    done = sh("dvc", "repro", cwd=reproduced)
    assert "Data and pipelines are up to date" in done.stdout + done.stderr
    assert time.perf_counter() - start < 30


def test_each_stage_logs_a_run_with_trl_curves(reproduced):
    mlflow.set_tracking_uri(f"sqlite:///{reproduced / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True)
    by_stage = {row["tags.posttrain.stage"]: row for _, row in runs.iterrows()}
    assert set(by_stage) == {"prepare", "sft", "grpo@dense", "serving", "evaluate"}
    assert "metrics.train_loss" in runs and by_stage["sft"]["metrics.train_loss"] > 0
    grpo = by_stage["grpo@dense"]
    assert grpo["metrics.rewards/digits/mean"] >= 0                         # TRL's own curves, via MLflow
    assert grpo["metrics.guardrails/unparseable/hit_rate"] >= 0            # guardrail hits per step
    assert grpo["metrics.stage.frac_reward_zero_std_mean"] >= 0 and grpo["tags.posttrain.gate"] == "accepted"
    assert by_stage["prepare"]["tags.git.commit"]                          # a stage run alone carries provenance


def test_dvc_plots_render(reproduced):
    sh("dvc", "plots", "show", "--json", cwd=reproduced)

