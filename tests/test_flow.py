"""The retrain flow on real Prefect (ephemeral API), real MLflow and a real DVC repo
(the `flow_runs` fixture, in conftest.py, runs it three times)."""

import json
import re
from pathlib import Path

import mlflow
import pytest

from conftest import SECRETS, copy_workspace, sh
from posttrain.tracking.mlflow_runs import FINISHED_RECORD

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _workspace_store(flow_runs):
    mlflow.set_tracking_uri(f"sqlite:///{flow_runs[0] / 'mlflow.db'}")


def test_one_parent_and_one_child_per_stage(flow_runs):
    _, _, _, runs, _ = flow_runs
    parents = runs[runs["tags.mlflow.parentRunId"].isna()]
    assert len(parents) == 2
    for parent_id in parents["run_id"]:
        children = runs[runs["tags.mlflow.parentRunId"] == parent_id]
        # stages appear in DVC's order; serving and evaluate both follow grpo
        assert list(children["tags.mlflow.runName"])[:3] == ["prepare", "sft", "grpo@dense"]
        assert set(children["tags.mlflow.runName"]) == {"prepare", "sft", "grpo@dense", "serving", "evaluate"}
        assert set(children["status"]) == {"FINISHED"}


def test_parent_carries_provenance_and_results(flow_runs):
    _, _, _, runs, _ = flow_runs
    parent = runs[runs["tags.mlflow.parentRunId"].isna()].iloc[0]
    for tag in ("git.commit", "dvc.data_md5", "dvc.lock_md5", "seed", "version.trl", "version.torch"):
        assert isinstance(parent[f"tags.{tag}"], str) and parent[f"tags.{tag}"], tag
    assert 0 <= parent["metrics.evaluate.grpo.greedy_accuracy"] <= 1
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(parent["run_id"])}
    assert {"config.resolved.yaml", "dvc.lock"} <= artifacts


def test_child_runs_hold_their_artifacts(flow_runs):
    _, _, _, runs, _ = flow_runs
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


def test_every_training_stage_logs_its_memory_plan(flow_runs):
    """Each training stage's run carries its plan (issue 15): memory.json and the parts as
    metrics; the parent run and reports/memory.json carry every stage's."""
    import json

    ws, _, _, runs, _ = flow_runs
    first_parent = runs[runs["tags.mlflow.parentRunId"].isna()].iloc[0]
    children = runs[runs["tags.mlflow.parentRunId"] == first_parent["run_id"]].set_index("tags.mlflow.runName")
    report = json.loads((ws / "reports" / "memory.json").read_text())
    assert set(report["stages"]) == {"sft", "grpo@dense"}
    assert mlflow.artifacts.load_dict(f"runs:/{first_parent['run_id']}/memory.json")["stages"] == report["stages"]
    for stage in ("sft", "grpo@dense"):
        plan = mlflow.artifacts.load_dict(f"runs:/{children.loc[stage, 'run_id']}/memory.json")
        assert plan == report["stages"][stage]
        assert children.loc[stage, "metrics.memory.total_bytes"] == plan["total_bytes"] > 0
        assert plan["setup"]["mixed_precision"] is False          # fp32 on this CPU: no GPU declared


def test_the_terminal_shows_each_stage_in_numbers_and_its_progress(flow_runs):
    """Issue 17, off a terminal (the output is captured): a start and an end line per stage
    in numbers, plain progress lines (at most one per tenth of a phase), and TRL's log dicts
    in the stage's log (an artifact of its run), not in the output."""
    from posttrain import progress

    _, first, second, runs, _ = flow_runs
    out = first.stdout + first.stderr
    assert "sft: started (its output: logs/sft.log)" in out
    assert re.search(r"prepare: 80 train / 20 held-out rows, base model of [\d,]+ parameters, ", out)
    assert re.search(r"grpo@dense: (accepted|rejected \(the previous model carries on\)), greedy \d\.\d{3} -> "
                     r"\d\.\d{3}, pass@4 \d\.\d{3}, \d+ steps, ", out), out[-3000:]
    train = re.findall(r"^grpo@dense: train (\d+)/(\d+) \(\d+%\)", first.stdout, re.M)
    assert 1 <= len(train) <= 10 and train[-1][0] == train[-1][1], first.stdout[-3000:]
    assert "grpo@dense: filter" in first.stdout and "evaluate: sampling" in first.stdout
    assert "'loss'" not in out and progress.PREFIX not in out
    first_parent = runs[runs["tags.mlflow.parentRunId"].isna()].iloc[0]["run_id"]
    grpo = runs[(runs["tags.mlflow.parentRunId"] == first_parent) & (runs["tags.mlflow.runName"] == "grpo@dense")]
    assert "'loss'" in mlflow.artifacts.load_text(f"runs:/{grpo.iloc[0]['run_id']}/logs/grpo@dense.log")
    assert "sft: up to date (DVC kept its outputs)" in second.stdout + second.stderr


def test_second_run_reruns_only_what_changed(flow_runs):
    _, _, second, runs, _ = flow_runs
    last_parent = runs[runs["tags.mlflow.parentRunId"].isna()].iloc[-1]["run_id"]
    children = runs[runs["tags.mlflow.parentRunId"] == last_parent].set_index("tags.mlflow.runName")
    cached = {stage: tag == "true" for stage, tag in children["tags.posttrain.cached"].items()}
    assert cached == {"prepare": True, "sft": True, "grpo@dense": True, "serving": True, "evaluate": False}
    assert children.loc["evaluate", "metrics.grpo.greedy_accuracy"] >= 0
    assert "| model | greedy accuracy |" in second.stdout and "#/experiments/" in second.stdout
    assert "each figure with its 95% interval" in second.stdout and "Held-out evaluation on 20 prompts" in second.stdout


def test_data_and_models_are_pushed_to_the_local_remote(flow_runs):
    ws = flow_runs[0]
    status = sh("dvc", "status", "--cloud", cwd=ws)
    assert "in sync" in status.stdout


def test_first_run_is_champion_and_an_equal_second_is_challenger(flow_runs):
    ws, first, second, runs, _ = flow_runs
    client = mlflow.MlflowClient()
    parents = runs[runs["tags.mlflow.parentRunId"].isna()]
    assert list(parents["tags.posttrain.tracking.promotion"]) == ["champion", "challenger"]
    assert "no champion yet" in parents["tags.posttrain.promotion_reason"].iloc[0]
    assert "does not beat the champion's" in parents["tags.posttrain.promotion_reason"].iloc[1]
    # require_significance: the same model on the same held-out prompts, tested pair by pair
    assert "exact McNemar p=1.000, 20 prompts" in parents["tags.posttrain.promotion_reason"].iloc[1]
    assert "reports/heldout_outcomes.json" in {f.path for f in client.list_artifacts(parents["run_id"].iloc[1],
                                                                                       "reports")}
    champion = client.get_model_version_by_alias("posttrain", "champion")
    challenger = client.get_model_version_by_alias("posttrain", "challenger")
    assert (str(champion.version), str(challenger.version)) == ("1", "2")
    assert champion.run_id == parents["run_id"].iloc[0]
    model_id = champion.source.removeprefix("models:/")  # the final model, an MLflow logged model
    assert "config.json" in {f.path for f in client.list_logged_model_artifacts(model_id)}
    assert client.get_logged_model(model_id).source_run_id == champion.run_id
    assert "Model registry: posttrain version 2 is the challenger" in second.stdout


def test_unchanged_inputs_mean_nothing_to_do(flow_runs):
    _, _, _, runs, third = flow_runs
    assert "Nothing to do: data and config are unchanged since retrain run" in third.stdout
    # decided before the full check and Prefect's temporary server: the work it does is bounded
    # by what it imports (python -X importtime's lines on stderr), not by seconds
    imported = {line.rsplit("|", 1)[-1].strip() for line in third.stderr.splitlines() if line.startswith("import time:")}
    # the workspace's record of its last finished run answers: not even MLflow is imported
    assert not {"mlflow", "trl", "torch", "transformers", "prefect.server.api.server"} & imported
    assert len(runs[runs["tags.mlflow.parentRunId"].isna()]) == 2      # no run recorded for it
    record = json.loads((flow_runs[0] / FINISHED_RECORD).read_text())
    assert record["run_id"] == runs[runs["tags.mlflow.parentRunId"].isna()].iloc[-1]["run_id"]


def test_replay_reproduces_the_first_run_exactly(flow_runs, tmp_path):
    ws, _, _, runs, _ = flow_runs
    first = runs[runs["tags.mlflow.parentRunId"].isna()].iloc[0]
    done = sh("posttrain", "replay", first["run_id"], "--tracking-uri", f"sqlite:///{ws / 'mlflow.db'}",
              "--scratch", tmp_path / "replay", cwd=ws, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"commit {first['tags.git.commit'][:12]}" in done.stdout
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith(("evaluate.", "sft."))}
    assert lines["evaluate.sft.pass_at_k.4"].endswith("identical")     # sampled at the first run's temperature
    assert lines["sft.train_seconds"].endswith("wall-clock, not compared")
    assert ", 0 DIFFERENT," in done.stdout


def test_replay_refuses_a_run_made_with_uncommitted_custom_code(flow_runs, tmp_path):
    """The workspace's own code (custom/) is code like posttrain/: a run made with it edited
    and not committed cannot be replayed from its commit, and replay says so (it used to
    replay the committed custom/ as if it were what ran)."""
    from mlflow import MlflowClient

    ws = copy_workspace(flow_runs[0], tmp_path / "ws")
    uri = f"sqlite:///{ws / 'mlflow.db'}"
    first = flow_runs[3][flow_runs[3]["tags.mlflow.parentRunId"].isna()].iloc[0]["run_id"]
    MlflowClient(uri).set_tag(first, "git.modified", "custom/rewards.py")  # as the run would have recorded it
    done = sh("posttrain", "replay", first, "--tracking-uri", uri, "--scratch", tmp_path / "replay", cwd=ws, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "uncommitted changes to custom/rewards.py" in done.stderr and not (tmp_path / "replay").exists()


def test_unknown_replay_run_is_one_line_exit_2(flow_runs):
    ws = flow_runs[0]
    done = sh("posttrain", "replay", "f" * 32, "--tracking-uri", f"sqlite:///{ws / 'mlflow.db'}", cwd=ws, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "ffffffff" in done.stderr and "no such run" in done.stderr


def test_dvc_experiment_sweep_and_metrics_diff(flow_runs, tmp_path):
    """The README's example: commit a baseline, sweep one param, diff the metrics."""
    ws = copy_workspace(flow_runs[0], tmp_path / "ws")
    sh("git", "add", "-A", cwd=ws)
    sh("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "baseline", cwd=ws)
    sh("dvc", "exp", "run", "-S", "configs/pipeline.yaml:serving.gpu_memory_utilization=0.5", cwd=ws)
    diff = sh("dvc", "metrics", "diff", "--md", cwd=ws).stdout
    assert re.search(r"\| metrics/serving\.json\s+\| max_concurrency", diff)
    assert "metrics/sft.json" not in diff and "metrics/evaluate.json" not in diff   # only serving reran
    assert "0.5" in sh("dvc", "exp", "show", "--md", "--no-pager", cwd=ws).stdout


def test_exported_secrets_reach_no_file(flow_runs):
    """The first run had credentials in its environment: none is in any file of the
    workspace (MLflow store and artifacts, logs, git objects, DVC cache) or Prefect's database."""
    from prefect.settings import PREFECT_HOME

    ws = flow_runs[0]
    files = [p for p in ws.rglob("*") if p.is_file()] + list(Path(PREFECT_HOME.value()).glob("*.db*"))
    for path in files:
        data = path.read_bytes()
        leaked = [name for name, value in SECRETS.items() if value.encode() in data]
        assert not leaked, f"{leaked} in {path}"


def test_bench_splits_the_last_run_into_compute_and_the_rest(flow_runs):
    """`make bench` on the workspace: the last finished run (the second: evaluate reran,
    the rest was cached), its wall time split into the stages' own compute and the rest."""
    from conftest import BIN

    ws = flow_runs[0]
    done = sh(BIN / "python", Path(__file__).parents[1] / "bench" / "orchestration_overhead.py", ws, cwd=ws)
    lines = done.stdout.splitlines()
    evaluate = next(line for line in lines if line.strip().startswith("evaluate "))
    assert "compute" in evaluate and "sampling" in evaluate and "cached" not in evaluate
    assert "(cached by DVC)" in next(line for line in lines if line.strip().startswith("sft "))
    assert re.search(r"^everything else +[\d.]+ s \([\d.]+% of wall; goal <= 10%: (met|not met)\)$", lines[-1])
