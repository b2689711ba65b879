"""The retrain flow on real Prefect (ephemeral API), real MLflow and a real DVC repo."""

import mlflow
import pytest

from conftest import SMALL, make_workspace, sh

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def flow_runs(tmp_path_factory):
    """The flow run twice on one workspace: the second finds everything up to date."""
    ws = make_workspace(tmp_path_factory.mktemp("flow") / "ws", SMALL)
    first = sh("posttrain", "run", "--workdir", ws, cwd=ws)
    second = sh("posttrain", "run", "--workdir", ws, cwd=ws)
    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, order_by=["start_time ASC"])
    return ws, first, second, runs


def test_one_parent_and_one_child_per_stage(flow_runs):
    _, _, _, runs = flow_runs
    parents = runs[runs["tags.mlflow.parentRunId"].isna()]
    assert len(parents) == 2
    for parent_id in parents["run_id"]:
        children = runs[runs["tags.mlflow.parentRunId"] == parent_id]
        # stages appear in DVC's order; serving and evaluate both follow grpo
        assert list(children["tags.mlflow.runName"])[:3] == ["prepare", "sft", "grpo@dense"]
        assert set(children["tags.mlflow.runName"]) == {"prepare", "sft", "grpo@dense", "serving", "evaluate"}
        assert set(children["status"]) == {"FINISHED"}


def test_parent_carries_provenance_and_results(flow_runs):
    _, _, _, runs = flow_runs
    parent = runs[runs["tags.mlflow.parentRunId"].isna()].iloc[0]
    for tag in ("git.commit", "dvc.data_md5", "dvc.lock_md5", "seed", "version.trl", "version.torch"):
        assert isinstance(parent[f"tags.{tag}"], str) and parent[f"tags.{tag}"], tag
    assert 0 <= parent["metrics.evaluate.grpo.greedy_accuracy"] <= 1
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(parent["run_id"])}
    assert {"config.resolved.yaml", "dvc.lock"} <= artifacts


def test_child_runs_hold_their_artifacts(flow_runs):
    _, _, _, runs = flow_runs
    first_parent = runs[runs["tags.mlflow.parentRunId"].isna()].iloc[0]["run_id"]
    children = runs[runs["tags.mlflow.parentRunId"] == first_parent].set_index("tags.mlflow.runName")
    client = mlflow.MlflowClient()

    def listed(stage, path=None):
        return {a.path for a in client.list_artifacts(children.loc[stage, "run_id"], path)}
    assert "data_manifest.json" in listed("prepare")
    assert "dvc_outputs.json" in listed("sft")                         # the checkpoint's DVC reference
    assert "serving_report.json" in listed("serving")
    assert {"samples/base.json", "samples/sft.json", "samples/grpo.dense.json"} <= listed("evaluate", "samples")
    outputs = mlflow.artifacts.load_dict(f"runs:/{children.loc['grpo@dense', 'run_id']}/dvc_outputs.json")
    assert outputs["artifacts/models/dense"].endswith(".dir")


def test_second_run_is_cached_with_recorded_metrics(flow_runs):
    _, _, second, runs = flow_runs
    last_parent = runs[runs["tags.mlflow.parentRunId"].isna()].iloc[-1]["run_id"]
    children = runs[runs["tags.mlflow.parentRunId"] == last_parent]
    assert set(children["tags.posttrain.cached"]) == {"true"}
    evaluate = children[children["tags.mlflow.runName"] == "evaluate"].iloc[0]
    assert evaluate["metrics.grpo.greedy_accuracy"] >= 0
    assert "| model | greedy accuracy |" in second.stdout and "mlflow ui --backend-store-uri" in second.stdout


def test_data_and_models_are_pushed_to_the_local_remote(flow_runs):
    ws = flow_runs[0]
    status = sh("dvc", "status", "--cloud", cwd=ws)
    assert "in sync" in status.stdout


def test_first_run_is_champion_and_an_equal_second_is_challenger(flow_runs):
    ws, first, second, runs = flow_runs
    client = mlflow.MlflowClient()
    parents = runs[runs["tags.mlflow.parentRunId"].isna()]
    assert list(parents["tags.posttrain.promotion"]) == ["champion", "challenger"]
    assert "no champion yet" in parents["tags.posttrain.promotion_reason"].iloc[0]
    assert "does not beat the champion's" in parents["tags.posttrain.promotion_reason"].iloc[1]
    champion = client.get_model_version_by_alias("posttrain", "champion")
    challenger = client.get_model_version_by_alias("posttrain", "challenger")
    assert (str(champion.version), str(challenger.version)) == ("1", "2")
    assert champion.run_id == parents["run_id"].iloc[0]
    assert "config.json" in {f.path.split("/")[-1] for f in client.list_artifacts(champion.run_id, "model")}
    assert "Model registry: posttrain version 2 is the challenger" in second.stdout
