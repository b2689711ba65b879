"""Stage smoke tests: the real pipeline (TRL on the tiny model, MLflow, DVC) via `dvc repro`."""

import json

import mlflow
import pytest

from conftest import sh
from posttrain.tracking.lineage import file_md5

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
        # every figure with its 95% interval, on the 20 held-out prompts
        low, high = result["greedy_accuracy_ci95"]
        assert result["n_prompts"] == 20 and low <= result["greedy_accuracy"] <= high and high - low > 0.1
        assert set(result["pass_at_k_ci95"]) == {"1", "4"}
        assert all(lo <= result["pass_at_k"][k] <= hi for k, (lo, hi) in result["pass_at_k_ci95"].items())
    outcomes = json.loads((reproduced / "reports" / "heldout_outcomes.json").read_text())
    assert list(outcomes) == list(report) and len(outcomes["sft"]["prompts"]) == 20 and outcomes["sft"]["n"] == 4
    gate = json.loads((reproduced / "metrics" / "grpo" / "dense.json").read_text())
    assert {"gate_p_greedy_accuracy", "gate_p_pass_at_4", "candidate_greedy_accuracy_ci95"} <= set(gate)
    assert json.loads((reproduced / "metrics" / "serving.json").read_text())["kv_bytes_per_token"] == 2 * 2 * 16 * 2
    # the reward audit before the stage trained: the battery passed, and the reward agreed with the
    # verifier on the filter's samples of the SFT model
    audit = json.loads((reproduced / "reports" / "audit" / "dense.json").read_text())
    assert audit["passed"] and audit["action"] == "refuse" and audit["exploits"] > 300 and audit["breaches"] == []
    agreement = audit["agreement"]
    assert agreement["samples"] == agreement["right"] + agreement["wrong"] > 0
    assert agreement["false_reward"] <= 0.1 and agreement["false_reward_interval"][0] <= agreement["false_reward"]


def test_second_repro_retrains_nothing(reproduced):
    done = sh("dvc", "repro", cwd=reproduced)
    assert "Data and pipelines are up to date" in done.stdout + done.stderr
    assert "Running stage" not in done.stdout + done.stderr  # no stage command ran


def test_each_stage_logs_a_run_with_trl_curves(reproduced):
    mlflow.set_tracking_uri(f"sqlite:///{reproduced / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True)
    by_stage = {row["tags.posttrain.stage"]: row for _, row in runs.iterrows()}
    assert set(by_stage) == {"prepare", "sft", "grpo@dense", "serving", "evaluate"}
    assert "metrics.train_loss" in runs and by_stage["sft"]["metrics.train_loss"] > 0
    grpo = by_stage["grpo@dense"]
    assert grpo["metrics.rewards/digits/mean"] >= 0                         # TRL's own curves, via MLflow
    assert grpo["metrics.guardrails/unparseable/hit_rate"] >= 0            # guardrail hits per step
    assert grpo["metrics.stage.frac_reward_zero_std_mean"] >= 0 and grpo["tags.posttrain.scoring.gate"] == "accepted"
    assert grpo["tags.posttrain.audit"] == "passed" and grpo["metrics.audit.breaches"] == 0   # the reward audit
    assert "audit.json" in {f.path for f in mlflow.MlflowClient().list_artifacts(grpo.run_id)}
    assert by_stage["prepare"]["tags.git.commit"]                          # a stage run alone carries provenance
    # not TRL's per-call timings: a store round trip each, several a step (posttrain.tracking.recorder.Recorder.follow)
    assert not [k for k in runs if k.startswith("metrics.profiling/")] and grpo["metrics.step_time"] > 0
    # each stage's own compute, timed by the stage (make bench holds the wall time against it)
    parts = {stage: {k.split(".", 2)[2] for k, v in row.items() if k.startswith("metrics.compute.") and v == v}
             for stage, row in by_stage.items()}
    assert parts == {"prepare": {"data_seconds", "model_seconds"}, "sft": {"train_seconds", "gate_seconds"},
                     "grpo@dense": {"audit_seconds", "filter_seconds", "train_seconds", "diagnostics_seconds",
                                   "gate_seconds"}, "serving": set(),
                     "evaluate": {"sampling_seconds"}}
    # what each stage read, as MLflow dataset inputs: DVC md5 digests, the DVC path and commit as source
    inputs = mlflow.MlflowClient().get_run(by_stage["sft"].run_id).inputs.dataset_inputs
    contexts = {i.dataset.name: {t.value for t in i.tags if t.key == "mlflow.data.context"} for i in inputs}
    assert contexts == {"data/train.jsonl": {"training"}, "data/heldout.jsonl": {"evaluation"}}
    assert {i.dataset.digest for i in inputs} == {file_md5(reproduced / p) for p in contexts}
    assert {i.dataset.name for i in mlflow.MlflowClient().get_run(by_stage["evaluate"].run_id).inputs.dataset_inputs} \
        == {"data/heldout.jsonl"}
    # the greedy decodes the gates did are not done again (same prompts and max_new_tokens)
    assert by_stage["evaluate"]["params.greedy_from_gates"] == "base,sft,grpo.dense"


def test_dvc_plots_render(reproduced):
    """Every plot dvc.yaml declares renders with data points, and DVC reports no error."""
    shown = json.loads(sh("dvc", "plots", "show", "--json", cwd=reproduced).stdout)
    assert not shown.get("errors"), shown["errors"]
    for plot in ("plots/sft_validation.json", "plots/grpo/dense.json", "accuracy_by_model", "serving_concurrency",
                 "pass_at_k"):
        rendered = shown["data"].get(plot)
        assert rendered and rendered[0]["type"] == "vega", (plot, sorted(shown["data"]))
        assert rendered[0]["content"]["data"]["values"], plot
    assert shown["data"]["plots/pass_at_k.png"][0]["type"] == "image"



def test_sft_measures_its_validation_curve(reproduced):
    """`sft.stop_when` with a target the short warmup never reaches: the whole schedule
    runs (10 steps), measured every 2 steps on 10 rows carved out of the 80 training rows."""
    sft = json.loads((reproduced / "metrics" / "sft.json").read_text())
    assert sft["stopped_at_step"] == sft["steps"] == 10 and sft["stop_target_reached"] == 0.0
    curve = json.loads((reproduced / "plots" / "sft_validation.json").read_text())
    assert [p["step"] for p in curve] == [2, 4, 6, 8, 10]
    assert sft["validation_greedy_accuracy"] == curve[-1]["greedy_accuracy"]
    mlflow.set_tracking_uri(f"sqlite:///{reproduced / 'mlflow.db'}")
    run = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`posttrain.stage` = 'sft'").iloc[0]
    history = mlflow.MlflowClient().get_metric_history(run.run_id, "validation_greedy_accuracy")
    assert sorted(m.step for m in history) == [2, 4, 6, 8, 10]
    assert run["metrics.stage.greedy_accuracy_ci95.high"] >= run["metrics.stage.greedy_accuracy"]
