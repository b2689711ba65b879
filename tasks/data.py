"""Tasks around the workspace's inputs: versioning new data, deciding there is nothing to do."""

from __future__ import annotations

from prefect import task

from posttrain import ingest
from posttrain.tracking.mlflow_runs import finished_run
from tasks.dvc_stages import TASK_DEFAULTS, tool_path


@task(name="version_data", **TASK_DEFAULTS)
def version_data(workdir: str, config) -> list[str]:
    """Validate `incoming/` and version it as new `datasets/` files (posttrain.ingest).

    Not retried: a bad row is the user's to fix, and the error names it.
    """
    if not ingest.pending(workdir):
        return []
    return ingest.version_incoming(workdir, *ingest.env_and_heldout(config), dvc=tool_path("dvc"))


@task(name="previous_result", **TASK_DEFAULTS)
def previous_result(workdir: str, config, uri: str) -> tuple[str, str] | None:
    """(run id, experiment id) of a finished retrain run made from exactly this state, if
    any (posttrain.tracking.mlflow_runs.finished_run)."""
    return finished_run(workdir, config, uri)
