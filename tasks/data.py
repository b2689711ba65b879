"""Tasks around the workspace's inputs: versioning new data, deciding there is nothing to do."""

from __future__ import annotations

from prefect import task

from posttrain import ingest
from posttrain.tracking import config_md5, dvc_lock_hashes
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
    """(run id, experiment id) of a finished retrain run made from exactly this state, if any.

    The state is the same when DVC finds every stage up to date (code, params, data and
    outputs as `dvc.lock` records them) and a finished run recorded this `dvc.lock` and
    this config file (which also holds what dvc.yaml does not read: promotion, tracking).
    """
    from dvc.repo import Repo
    from mlflow import MlflowClient

    lock = dvc_lock_hashes(workdir).get("dvc.lock_md5")
    if not lock:
        return None
    with Repo(workdir) as repo:
        if repo.status():
            return None
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    if experiment is None:
        return None
    found = client.search_runs(
        [experiment.experiment_id], max_results=1, order_by=["attributes.start_time DESC"],
        filter_string=(f"tags.`posttrain.flow` = 'retrain' and attributes.status = 'FINISHED' and "
                       f"tags.`dvc.lock_md5` = '{lock}' and tags.`posttrain.config_md5` = '{config_md5(workdir)}'"))
    return (found[0].info.run_id, experiment.experiment_id) if found else None
