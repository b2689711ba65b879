"""The task that clears up after a killed retrain run: its MLflow runs left RUNNING."""

from __future__ import annotations

import os
import socket

from prefect import get_run_logger, task

from posttrain.tracking import dead_runs
from tasks.dvc_stages import TASK_DEFAULTS


@task(name="mark_dead_runs", **TASK_DEFAULTS)
def mark_dead_runs(workdir: str, uri: str) -> list[str]:
    """The workspace's retrain runs a killed run left RUNNING, marked KILLED (posttrain.tracking.dead_runs).

    Runs under the workspace lock, which every live retrain run of the workspace holds:
    whatever is still RUNNING then is dead, not running beside this one.
    """
    from prefect.runtime import flow_run

    marked_by = (f"process {os.getpid()} on {socket.gethostname()} "
                 f"(retrain flow run {flow_run.name!r}, {flow_run.id})")
    dead = dead_runs.mark_dead_runs(uri, workdir, marked_by)
    if dead:
        get_run_logger().warning(f"marked {len(dead)} MLflow run(s) a killed retrain run left RUNNING as KILLED "
                                 f"(tag {dead_runs.CRASH_TAG}): {', '.join(dead)}")
    return dead
