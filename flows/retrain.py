"""The `retrain` flow: one MLflow parent run, the DVC stages in DVC's order, a summary.

Runs on Prefect's ephemeral local API by default, on a Prefect server when
`PREFECT_API_URL` is set (`posttrain serve` runs it there on a schedule: flows/deploy.py).
Each stage is a `run_stage` task (retried on failure) that runs `dvc repro --single-item`
under an MLflow child run.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
import yaml
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.lock import lock
from posttrain import crash, registry, summary
from posttrain.config import load_config
from posttrain.io import PARAMS_FILE, final_model_dir, flatten_params, read_json, run_metrics
from posttrain.tracking import OUTCOMES_ARTIFACT, dvc_lock_hashes, experiment_id, provenance, tracking_uri
from tasks.data import previous_result, version_data
from tasks.dvc_stages import push_data, run_stage, stage_order
from tasks.recovery import mark_dead_runs


MODELS = "artifacts/models"  # dvc.yaml's model folders


def read_outcomes(workdir: str) -> dict | None:
    """The evaluate stage's per-prompt outcomes (dvc.yaml's `reports/heldout_outcomes.json`)."""
    path = Path(workdir) / OUTCOMES_ARTIFACT
    return read_json(path) if path.is_file() else None


def gate_tags(results: dict) -> dict[str, str]:
    """`gate.<stage>`: accepted / rejected / skipped, for every GRPO stage."""
    def verdict(m):
        return "skipped" if m.get("skipped") else "accepted" if m.get("accepted") else "rejected"
    return {f"gate.{name.split('@', 1)[1]}": verdict(m) for name, m in results.items() if name.startswith("grpo@")}


@flow(name="retrain")
def retrain(workdir: str = ".") -> dict:
    """Run the pipeline of `workdir`: a git + DVC repo with dvc.yaml and its params file.

    First new data in `incoming/` is validated and versioned; then, if nothing changed
    since the last finished run, the run says so and stops; else every stage runs (or
    is found up to date by DVC) under one MLflow parent run, and the result is promoted.
    One run at a time per workspace: a second waits for the lock. Holding it, the run
    marks what a killed run of the workspace left RUNNING in MLflow as KILLED.
    """
    logger = get_run_logger()
    workdir = str(Path(workdir).resolve())
    with lock(workdir, log=logger.warning):
        config = load_config(Path(workdir) / PARAMS_FILE)
        uri = tracking_uri(config, workdir)
        mark_dead_runs(workdir, uri)
        added = version_data(workdir, config)
        if added:  # pushed now: the batch has left incoming/, the remote must hold it whatever follows
            logger.info(f"versioned new data: {', '.join(added)}; {push_data(workdir, added)}")
        previous = None if added else previous_result(workdir, config, uri)
        if previous:
            run_id, experiment = previous
            text = (f"Nothing to do: data and config are unchanged since retrain run {run_id}, which finished; "
                    f"its results stand.\n\nMLflow run: {run_id}\nOpen it: {summary.run_link(uri, experiment, run_id)}")
            results = {"nothing_to_do": True, "previous_run": run_id}
        else:
            results, text = run_pipeline(config, workdir, uri, logger)
    create_markdown_artifact(text, key="retrain-summary", description="posttrain retrain summary")
    print(text)
    return results


def run_pipeline(config, workdir: str, uri: str, logger) -> tuple[dict, str]:
    """The DVC stages under a parent run, then gates' verdicts, data push and promotion."""
    exp = experiment_id(config, workdir)
    stage_task = run_stage.with_options(retries=config.orchestration.retries,
                                        retry_delay_seconds=config.orchestration.retry_delay_seconds)
    with mlflow.start_run(experiment_id=exp, run_name=f"retrain-{time.strftime('%Y%m%d-%H%M%S')}") as parent:
        mlflow.set_tags({**provenance(config, workdir), **crash.process_tags(), "posttrain.flow": "retrain"})
        mlflow.log_text(yaml.safe_dump(config.model_dump(by_alias=True), sort_keys=False), "config.resolved.yaml")
        mlflow.log_artifact(str(Path(workdir) / PARAMS_FILE), "params")  # as written: what replay restores
        params = flatten_params(config.model_dump(by_alias=True))  # what `posttrain compare` diffs
        mlflow.log_params({**params, "tracking.uri": summary.redact(params["tracking.uri"])})
        results = {}
        for stage in stage_order(workdir):
            results[stage["name"]] = stage_task(stage, workdir, parent.info.run_id, uri)
        gates = gate_tags(results)
        mlflow.set_tags({**dvc_lock_hashes(workdir), **gates})
        metrics = run_metrics(results)
        mlflow.log_metrics(metrics)
        mlflow.log_artifact(str(Path(workdir) / "dvc.lock"))
        outcomes = read_outcomes(workdir)
        if outcomes:  # what paired tests against this run read: promotion now, `posttrain compare` later
            mlflow.log_artifact(str(Path(workdir) / OUTCOMES_ARTIFACT), str(Path(OUTCOMES_ARTIFACT).parent))
        logger.info(push_data(workdir))
        text = summary.render(results.get("evaluate", {}), results.get("serving", {}),
                              config.serving.gpu, parent.info.run_id, uri, exp)
        text += "\n\n" + summary.gates_line(gates, results)
        if config.promotion.enabled:
            promotion = registry.promote(config, parent.info.run_id, final_model_dir(config, Path(workdir) / MODELS),
                                         metrics, results.get("serving", {}), outcomes)
            text += (f"\nModel registry: {config.promotion.model_name} version {promotion.version} "
                     f"is the {promotion.reason}")
    return results, text
