"""What a killed run leaves in MLflow: the next run marks the runs it left RUNNING.

A process killed with SIGKILL runs no `finally` and no `atexit`: its MLflow runs keep
the status RUNNING (its child processes end with it: posttrain.runtime.lifetime). The workspace
lock (held by every live retrain run of a workspace, flows.lock) tells the
next run that a RUNNING run of the workspace is dead.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

CRASH_TAG = "posttrain.crashed"  # on a run marked dead: who died, who marked it, when
PID_TAG, HOST_TAG = "posttrain.pid", "posttrain.host"  # on a retrain run: the process running it
STARTED_TAG = "posttrain.process_started"  # ... and when it started (epoch seconds): make bench's wall time


def process_tags() -> dict[str, str]:
    """The process running a retrain run: what the next run names when it finds the run
    dead, and when the process started (its wall time includes what precedes the run)."""
    import psutil

    return {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname(),
            STARTED_TAG: f"{psutil.Process().create_time():.3f}"}


def mark_dead_runs(tracking_uri: str, workspace: str | Path, marked_by: str) -> list[str]:
    """Ids of the RUNNING retrain runs of `workspace` (parent runs and their child runs),
    now marked KILLED with a `posttrain.crashed` tag saying who died and who marked it.

    Call it only while holding the workspace's lock: every live retrain run of the
    workspace holds it, so a RUNNING one is then a dead one. A run recorded by another
    host (`posttrain.host`) is left alone: its lock is not this one.
    """
    from mlflow import MlflowClient

    from posttrain.tracking.mlflow_runs import ready_store

    ready_store(tracking_uri)
    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(experiments, "attributes.status = 'RUNNING'") if experiments else []
    running = {r.info.run_id: r for r in found}
    dead = {}
    for run_id, run in running.items():
        parent = retrain_parent(client, run, running)
        if parent and is_ours(parent.data.tags, workspace):
            dead[run_id] = parent.data.tags
    now = time.strftime("%Y-%m-%d %H:%M:%S %z")
    for run_id, tags in dead.items():
        who = f"process {tags.get(PID_TAG, '(unrecorded)')} on {tags.get(HOST_TAG, socket.gethostname())}"
        client.set_tag(run_id, CRASH_TAG, f"{who} died; marked by {marked_by} at {now}")
        client.set_terminated(run_id, "KILLED")
    return sorted(dead)


def retrain_parent(client, run, running: dict):
    """The retrain (parent) run `run` belongs to: itself, or its `mlflow.parentRunId`."""
    from mlflow.exceptions import MlflowException

    parent_id = run.data.tags.get("mlflow.parentRunId")
    if not parent_id:
        return run
    try:
        return running.get(parent_id) or client.get_run(parent_id)
    except MlflowException:  # the parent was deleted
        return None


def is_ours(tags: dict, workspace: str | Path) -> bool:
    """A retrain run of this workspace on this host (runs from before `posttrain.host` count as this host's)."""
    here = socket.gethostname()
    return (tags.get("posttrain.flow") == "retrain" and tags.get(HOST_TAG, here) == here
            and tags.get("posttrain.workspace") == str(Path(workspace).resolve()))
