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

from flows.lock import lock
from tasks.checks import check_workspace
from tasks.data import previous_result, version_data
from tasks.dvc_stages import final_model, greedy_so_far, pipeline_stage, push_data, stage_host, stage_order
from tasks.dead_runs import mark_dead_runs
from tasks.runs import (close_run, forget_finished, open_parent_run, plan_memory, promote_model, publish_summary,
                        read_outcomes, record_finished, record_results, summary_text, unchanged, workspace_config)


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
    with lock(workdir, log=logger.warning), stage_host(workdir), workspace_config(workdir) as (config, uri):
        if not checked:
            check_workspace(workdir)
        mark_dead_runs(workdir, uri)
        added = version_data(workdir, config)
        if added:  # pushed now: the batch has left incoming/, the remote must hold it whatever follows
            logger.info(f"versioned new data: {', '.join(added)}; {push_data(workdir, added)}")
        previous = None if added else previous_result(workdir, config, uri)
        if previous:
            results, text = unchanged(workdir, previous, uri)
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
        text = summary_text(config, results, run_id, uri, experiment)
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
