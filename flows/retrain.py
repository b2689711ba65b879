"""The `retrain` flow: one MLflow parent run, the DVC stages in DVC's order, a summary.

Runs on Prefect's ephemeral local API by default, on a Prefect server when
`PREFECT_API_URL` is set (`posttrain serve` runs it there on a schedule: flows/deploy.py).
The flow only chains tasks, each one side effect that Prefect shows (and retries where
it says so): a stage is one task run named after it (its MLflow child run, `dvc repro
--single-item`, retried on failure, and the record of what it did).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from flows.checks import check_workspace
from flows.lock import lock
from posttrain import stageid
from posttrain.tracking import summary
from posttrain.config import load_config
from posttrain.layout import PARAMS_FILE
from posttrain.plugins import workspace
from posttrain.tracking.mlflow_runs import forget_finished, nothing_to_do, record_finished, tracking_uri
from tasks.data import previous_result, version_data
from tasks.dvc_stages import own_model_prefix, pipeline_stage, push_data, stage_host, stage_order
from tasks.dead_runs import mark_dead_runs
from tasks.runs import (close_run, gate_tags, open_parent_run, plan_memory, promote_model, publish_summary,
                        read_outcomes, record_results)


@flow(name="retrain")
def retrain(workdir: str = ".", checked: bool = False) -> dict:
    """Run the pipeline of `workdir`: a git + DVC repo with dvc.yaml and its params file.

    First new data in `incoming/` is validated and versioned; then, if nothing changed
    since the last finished run, the run says so and stops; else every stage runs (or
    is found up to date by DVC) under one MLflow parent run, and the result is promoted.
    One run at a time per workspace: a second waits for the lock. Holding it, the run
    marks what a killed run of the workspace left RUNNING in MLflow as KILLED.
    `checked`: `posttrain run` checked the config whole before the flow started (a
    scheduled run checks it here, by the run's stage host).
    """
    logger = get_run_logger()
    workdir = str(Path(workdir).resolve())
    # what the config names by path or import (custom/) is the workspace's, as in its stages
    with lock(workdir, log=logger.warning), stage_host(workdir), workspace(workdir):
        config = load_config(Path(workdir) / PARAMS_FILE)
        if not checked:
            check_workspace(workdir, Path(workdir) / PARAMS_FILE)
        uri = tracking_uri(config, workdir)
        mark_dead_runs(workdir, uri)
        added = version_data(workdir, config)
        if added:  # pushed now: the batch has left incoming/, the remote must hold it whatever follows
            logger.info(f"versioned new data: {', '.join(added)}; {push_data(workdir, added)}")
        previous = None if added else previous_result(workdir, config, uri)
        if previous:
            run_id, experiment = previous
            record_finished(workdir, run_id, experiment, uri)  # the next no-op run needs no MLflow
            text = nothing_to_do(run_id, experiment, uri)
            results = {"nothing_to_do": True, "previous_run": run_id}
        else:
            results, text = run_pipeline(config, workdir, uri)
    publish_summary(text)
    return results


def run_pipeline(config, workdir: str, uri: str) -> tuple[dict, str]:
    """The DVC stages under a parent run, then their record, the data push and promotion;
    the parent run ends FAILED when any of it fails."""
    forget_finished(workdir)  # until this run finishes, the workspace's state is no finished run's
    run_id, experiment = open_parent_run(config, workdir, uri)
    try:
        plan_memory(config, workdir, run_id, uri)
        stages = stage_order(workdir)
        results: dict[str, dict] = {}
        for stage in stages:
            results[stage["name"]] = stage_results(config, stage, workdir, run_id, uri, before=greedy_so_far(results))
        metrics = record_results(run_id, workdir, uri, results)
        get_run_logger().info(push_data(workdir))
        text = summary.render(results.get("evaluate", {}), results.get("serving", {}), config.serving.gpu,
                              run_id, uri, experiment)
        text += "\n\n" + summary.gates_line(gate_tags(results), results)
        if config.promotion.enabled:
            promotion = promote_model(config, run_id, uri, final_model(config, stages, workdir), metrics,
                                      results.get("serving", {}), read_outcomes(workdir))
            text += (f"\nModel registry: {config.promotion.model_name} version {promotion.version} "
                     f"is the {promotion.reason}")
    except BaseException:
        close_run(run_id, uri, "FAILED")
        raise
    close_run(run_id, uri, "FINISHED")
    record_finished(workdir, run_id, experiment, uri)
    return results, text


def stage_results(config, stage: dict, workdir: str, parent_run_id: str, uri: str, *, before: float | None) -> dict:
    """One DVC stage, one task run named after it: a child run, `dvc repro` (retried), its record."""
    retries = config.orchestration.retries
    task = pipeline_stage.with_options(retries=retries, retry_delay_seconds=config.orchestration.retry_delay_seconds)
    return task(stage, workdir, parent_run_id, uri, allowed_retries=retries, before=before)


def greedy_so_far(results: dict[str, dict]) -> float | None:
    """The held-out greedy accuracy of the chain's latest model (SFT's, then each accepted
    GRPO candidate's): what the next GRPO stage starts from, for its end-of-stage line."""
    greedy = None
    for name, metrics in results.items():
        prefix = own_model_prefix(name, metrics)
        if prefix is not None:
            greedy = metrics.get(f"{prefix}greedy_accuracy", greedy)
    return greedy


def final_model(config, stages: list[dict], workdir: str) -> str:
    """The pipeline's result: the model folder the last GRPO stage outputs, as dvc.yaml names it."""
    last = stageid.final(config).dvc
    return str(Path(workdir) / next(s["outs"][0] for s in stages if s["name"] == last))
