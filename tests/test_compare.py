"""`posttrain compare` against a real MLflow store (SQLite) holding two pipeline-shaped runs."""

import sys

import mlflow
import pytest
from mlflow import MlflowClient

from conftest import sh


def pipeline_run(lr: str, greedy: float, passes: dict[int, float], rewards: list[float]) -> str:
    """A parent run as the retrain flow leaves it, with one grpo@dense child run."""
    with mlflow.start_run(run_name="retrain") as parent:
        mlflow.log_params({"grpo.dense.trl.learning_rate": lr, "seed": "0"})
        mlflow.log_metrics({"evaluate.grpo.greedy_accuracy": greedy,
                            **{f"evaluate.grpo.pass_at_k.{k}": v for k, v in passes.items()}})
        with mlflow.start_run(run_name="grpo@dense", nested=True):
            for step, value in enumerate(rewards):
                mlflow.log_metric("reward", value, step=step * 10)
    return parent.info.run_id


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("posttrain")
    a = pipeline_run("0.0001", 0.74, {1: 0.47, 8: 0.93}, [0.70, 0.80, 0.90])
    b = pipeline_run("0.0003", 0.60, {1: 0.52, 8: 0.74}, [0.60, 0.90, 1.00])
    mlflow.end_run()
    return uri, a, b, tmp_path


def compare(uri, *refs, cwd):
    return sh(sys.executable, "-m", "posttrain", "compare", *refs, "--tracking-uri", uri,
              "--out", "out/compare.png", cwd=cwd, check=False)


def test_prints_differences_and_deltas_and_records_the_plot(store):
    uri, a, b, tmp = store
    done = compare(uri, a, b, cwd=tmp)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    differing = next(line for line in lines if "grpo.dense.trl.learning_rate" in line)
    assert "0.0001" in differing and "0.0003" in differing
    assert not any(line.strip().startswith("seed") for line in lines)     # identical params are not listed
    row = next(line for line in lines if "evaluate.grpo.pass_at_k.8" in line)
    assert "0.9300" in row and "0.7400" in row and "-0.1900" in row
    assert (tmp / "out" / "compare.png").stat().st_size > 10_000
    client = MlflowClient(uri)
    [recorded] = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id],
                                    "tags.mlflow.runName = 'compare'")
    assert recorded.data.tags["posttrain.tracking.compare"] == f"{a},{b}"
    assert {f.path for f in client.list_artifacts(recorded.info.run_id)} == {"compare.png", "compare.txt"}


def test_aliases_name_registered_versions(store):
    uri, a, b, tmp = store
    client = MlflowClient(uri)
    client.create_registered_model("posttrain")
    version = client.create_model_version("posttrain", f"runs:/{a}/model", run_id=a)
    client.set_registered_model_alias("posttrain", "champion", version.version)
    done = compare(uri, "champion", b, cwd=tmp)
    assert done.returncode == 0, done.stderr
    assert f"champion ({a[:8]})" in done.stdout


@pytest.mark.parametrize("ref,needle", [
    ("0123456789abcdef0123456789abcdef", "no such run"),
    ("challenger", "alias 'challenger'"),
    ("not-a-run", "not a run id or an alias"),
])
def test_unknown_references_exit_2_with_one_line(store, ref, needle):
    uri, a, _, tmp = store
    done = compare(uri, a, ref, cwd=tmp)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and needle in done.stderr and ref in done.stderr


def test_needs_two_runs(store):
    uri, a, _, tmp = store
    done = compare(uri, a, cwd=tmp)
    assert done.returncode == 2 and "at least two runs" in done.stderr


def run_with_outcomes(greedy: list[int], correct: list[int], n: int = 16) -> str:
    """A parent run as the flow leaves it: evaluate figures, their intervals, and the
    per-prompt outcomes artifact the paired tests read."""
    from posttrain.tracking.mlflow_runs import flatten
    from posttrain.scoring.stats import intervals
    from posttrain.tracking.mlflow_runs import OUTCOMES_ARTIFACT

    record = {"prompts": [f"{i // 50}+{i % 50}=" for i in range(len(greedy))], "greedy": greedy,
              "correct": correct, "n": n}
    from posttrain.scoring.metrics import mean_pass_at_k

    report = {"greedy_accuracy": sum(greedy) / len(greedy), "pass_at_k": {"8": mean_pass_at_k(correct, n, 8)},
              **intervals(record, [8], resamples=500, seed=0)}
    with mlflow.start_run(run_name="retrain") as run:
        mlflow.log_metrics(flatten({"evaluate": {"grpo": report}}))
        mlflow.log_dict({"grpo": record}, OUTCOMES_ARTIFACT)
    return run.info.run_id


def test_marks_each_delta_within_noise_or_significant(tmp_path):
    import numpy as np

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("posttrain")
    rng = np.random.default_rng(0)
    greedy = (rng.uniform(size=500) < 0.7).astype(int)
    correct = rng.binomial(16, 0.5, size=500)
    worse = greedy.copy()
    worse[np.flatnonzero(greedy)[:50]] = 0                          # 10 points worse on the same 500 prompts
    a = run_with_outcomes(greedy.tolist(), correct.tolist())
    same = run_with_outcomes(greedy.tolist(), correct.tolist())
    b = run_with_outcomes(worse.tolist(), np.maximum(correct - 4, 0).tolist())
    mlflow.end_run()
    done = compare(uri, a, same, b, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if "evaluate.grpo.greedy_accuracy" in line)
    # the first run's figure with its Wilson interval, then a delta per other run with its verdict
    assert f"{greedy.mean():.4f} [" in row
    assert "+0.0000  within noise (paired, p=1.000, 500 prompts)" in row
    assert "-0.1000  significant (paired, p<0.001, 500 prompts)" in row
    row = next(line for line in done.stdout.splitlines() if "evaluate.grpo.pass_at_k.8" in line)
    assert "within noise (paired" in row and "significant (paired, p<0.001, 500 prompts)" in row
    assert not any("_ci95" in line for line in done.stdout.splitlines())   # intervals sit beside their figure


@pytest.mark.parametrize("metric,key", [
    ("evaluate.grpo.greedy_accuracy", "evaluate.grpo.greedy_accuracy_ci95"),
    ("evaluate.grpo.dense.pass_at_k.8", "evaluate.grpo.dense.pass_at_k_ci95.8"),   # a stage's model
    ("sft.pass_at_8", "sft.pass_at_8_ci95"),                                      # a gate figure
    ("grpo.dense.candidate_greedy_accuracy", "grpo.dense.candidate_greedy_accuracy_ci95"),
])
def test_interval_key(metric, key):
    from posttrain.tracking.compare import interval_key

    assert interval_key(metric) == key
