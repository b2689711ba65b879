"""Tasks that write the retrain run's MLflow records: open the parent run with what it
ran, record the results, promote the model, close the run; and publish the summary."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import yaml
from prefect import task

from posttrain.tracking import dead_runs
from posttrain.files import read_json
from posttrain.stageid import known
from posttrain.layout import PARAMS_FILE
from posttrain.tracking.lineage import log_datasets, workspace_datasets
from posttrain.redact import redact_uri
from posttrain.tracking import summary
from posttrain.tracking.mlflow_runs import (OUTCOMES_ARTIFACT, dvc_lock_hashes, experiment_id, flatten_params,
                                            nothing_to_do, provenance, record_finished, run_metrics, run_url,
                                            tracking_uri)
from posttrain.tracking.mlflow_runs import forget_finished  # noqa: F401  (the flow's: a run no longer finished)
from tasks.dvc_stages import TASK_DEFAULTS


@contextlib.contextmanager
def workspace_config(workdir: str):
    """The workspace's config and its tracking URI, for the block, with what the config names
    by path or import (custom/) resolved in the workspace, as in its stages."""
    from posttrain.config import load_config
    from posttrain.plugins import workspace

    with workspace(workdir):
        config = load_config(Path(workdir) / PARAMS_FILE)
        yield config, tracking_uri(config, workdir)


def unchanged(workdir: str, previous: tuple[str, str], uri: str) -> tuple[dict, str]:
    """Nothing changed since run `previous` (id, experiment) finished: the run's results and
    the line that says so; recorded in the workspace, so the next no-op run needs no MLflow."""
    run_id, experiment = previous
    record_finished(workdir, run_id, experiment, uri)
    return {"nothing_to_do": True, "previous_run": run_id}, nothing_to_do(run_id, experiment, uri)


def summary_text(config, results: dict, run_id: str, uri: str, experiment: str) -> str:
    """The run's summary (posttrain.tracking.summary): figures, serving capacity, the gates."""
    text = summary.render(results.get("evaluate", {}), results.get("serving", {}), config.serving.gpu,
                          run_id, uri, experiment)
    return text + "\n\n" + summary.gates_line(gate_tags(results), results)


def client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(uri)


@task(name="open_parent_run", **TASK_DEFAULTS)
def open_parent_run(config, workdir: str, uri: str) -> tuple[str, str]:
    """A new retrain (parent) run carrying what it runs: provenance tags, the config as
    resolved and as written (what replay restores), and every config leaf as a param
    (what `posttrain compare` diffs). Returns (run id, experiment id)."""
    from mlflow.entities import Param

    mlflow = client(uri)
    tags = {**provenance(config, workdir), **dead_runs.process_tags(), "posttrain.flow": "retrain"}
    experiment = experiment_id(config, workdir)
    run_id = mlflow.create_run(experiment, run_name=f"retrain-{time.strftime('%Y%m%d-%H%M%S')}", tags=tags).info.run_id
    mlflow.log_text(run_id, yaml.safe_dump(config.model_dump(by_alias=True), sort_keys=False), "config.resolved.yaml")
    mlflow.log_artifact(run_id, str(Path(workdir) / PARAMS_FILE), "params")
    params = flatten_params(config.model_dump(by_alias=True))
    params["tracking.uri"] = redact_uri(params["tracking.uri"])
    items = [Param(k, v) for k, v in params.items()]
    mlflow.log_batch(run_id, params=items)  # the client splits it into requests within MLflow's limits
    link_artifact(uri, experiment, run_id)
    return run_id, experiment


def link_artifact(uri: str, experiment: str, run_id: str) -> None:
    """A link from the Prefect flow run to its MLflow parent run (artifact `mlflow-run`)."""
    from prefect.artifacts import create_link_artifact

    create_link_artifact(run_url(uri, experiment, run_id), link_text=f"MLflow run {run_id}", key="mlflow-run",
                         description="this retrain run's MLflow parent run: stages, metrics, models")


def gate_tags(results: dict) -> dict[str, str]:
    """`gate.<stage>`: accepted / rejected / skipped, for every GRPO stage."""
    def verdict(m):
        return "skipped" if m.get("skipped") else "accepted" if m.get("accepted") else "rejected"
    stages = {name: known(name) for name in results}
    return {f"gate.{stage.name}": verdict(results[name]) for name, stage in stages.items() if stage and stage.kind == "grpo"}


def read_outcomes(workdir: str) -> dict | None:
    """The evaluate stage's per-prompt outcomes (dvc.yaml's `reports/heldout_outcomes.json`)."""
    path = Path(workdir) / OUTCOMES_ARTIFACT
    return read_json(path) if path.is_file() else None


@task(name="plan_memory", **TASK_DEFAULTS)
def plan_memory(config, workdir: str, run_id: str, uri: str) -> dict:
    """Every training stage's memory plan per GPU (posttrain.capacity.fit), as the run will train
    it: reports/memory.json in the workspace and `memory.json` on the parent run (each
    stage's own run carries its part)."""
    from posttrain.runtime import stagehost
    from posttrain.files import write_json
    from posttrain.capacity.fit import longest_prompt, pipeline_plan

    path = Path(workdir) / PARAMS_FILE
    done = stagehost.run_json(["memory", "--config", str(path), "--json"], cwd=workdir)  # the run's stage host has TRL imported
    plan = done[1] if done and done[0] == 0 else pipeline_plan(config, config_path=path,
                                                               prompt_chars=longest_prompt(config))
    write_json(Path(workdir) / MEMORY_REPORT, plan)
    client(uri).log_dict(run_id, plan, "memory.json")
    return plan


MEMORY_REPORT = "reports/memory.json"


@task(name="record_results", **TASK_DEFAULTS)
def record_results(run_id: str, workdir: str, uri: str, results: dict) -> dict[str, float]:
    """The stages' results on the parent run: every metric, the gates' verdicts and
    dvc.lock's hashes as tags, dvc.lock itself, and the per-prompt outcomes that paired
    tests against this run read (promotion now, `posttrain compare` later)."""
    from mlflow.entities import Metric, RunTag

    mlflow = client(uri)
    metrics = run_metrics(results)
    now = int(time.time() * 1000)
    tags = {**dvc_lock_hashes(workdir), **gate_tags(results)}
    mlflow.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
                     tags=[RunTag(k, v) for k, v in tags.items()])
    mlflow.log_artifact(run_id, str(Path(workdir) / "dvc.lock"))
    log_datasets(workspace_datasets(workdir), workdir, run_id, mlflow)  # the UI's Datasets panel
    if (Path(workdir) / OUTCOMES_ARTIFACT).is_file():
        mlflow.log_artifact(run_id, str(Path(workdir) / OUTCOMES_ARTIFACT), str(Path(OUTCOMES_ARTIFACT).parent))
    return metrics


@task(name="promote_model", **TASK_DEFAULTS)
def promote_model(config, run_id: str, uri: str, model_dir: str, metrics: dict, serving: dict, outcomes):
    """Register the final model as champion or challenger (posttrain.tracking.promotion)."""
    from posttrain.tracking.promotion import promote

    return promote(config, run_id, model_dir, metrics, serving, outcomes, tracking_uri=uri)


@task(name="close_run", **TASK_DEFAULTS)
def close_run(run_id: str, uri: str, status: str) -> None:
    """End the parent run: FINISHED, or FAILED when a stage or task failed."""
    client(uri).set_terminated(run_id, status)


@task(name="publish_summary", **TASK_DEFAULTS)
def publish_summary(text: str) -> None:
    """The run's summary as the Prefect markdown artifact `retrain-summary`, and on stdout."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(text, key="retrain-summary", description="posttrain retrain summary")
    print(text)
