"""What a killed run leaves behind: its child processes die with it, and the next run
marks the MLflow runs it left RUNNING.

A process killed with SIGKILL runs no `finally` and no `atexit`: its MLflow runs keep
the status RUNNING and its children (a server, a stage) keep running. Linux's
parent-death signal ends the children with it; the workspace lock (held by every live
retrain run of a workspace, posttrain.workspace.lock) tells the next run that a RUNNING
run of the workspace is dead.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import sys
import time
from pathlib import Path

CRASH_TAG = "posttrain.crashed"  # on a run marked dead: who died, who marked it, when
PID_TAG, HOST_TAG = "posttrain.pid", "posttrain.host"  # on a retrain run: the process running it
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# looked up here, not in a forked child (where the loader's lock may be held by a thread that is not there)
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def process_tags() -> dict[str, str]:
    """The process running a retrain run: what the next run names when it finds the run dead."""
    return {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send this process `sig` when its parent (the thread that started
    it) ends, however it ends: kill -9 included (Linux; nothing elsewhere). `parent`: the
    pid it must still have, else it is gone already and `sig` comes now."""
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, sig)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def die_with_dvc() -> None:
    """A stage command run by `dvc repro` (DVC sets DVC_STAGE) ends when that dvc process
    ends, which ends with the flow that runs it: a killed run leaves no stage training on
    (the stage's lines would otherwise go to a closed pipe for as long as it runs).
    Run by hand, it is left alone (nohup keeps working)."""
    if os.environ.get("DVC_STAGE"):
        die_with_parent()


def die_with_this_thread(sig: int = signal.SIGKILL):
    """A `preexec_fn` for `subprocess.Popen`: the child dies with `sig` when the thread
    that starts it ends (die_with_parent). The signal follows that thread, not the
    process: start a child that must live as long as this process from the main thread."""
    return functools.partial(die_with_parent, sig, os.getpid()) if _PRCTL else None


def mark_dead_runs(tracking_uri: str, workspace: str | Path, marked_by: str) -> list[str]:
    """Ids of the RUNNING retrain runs of `workspace` (parent runs and their child runs),
    now marked KILLED with a `posttrain.crashed` tag saying who died and who marked it.

    Call it only while holding the workspace's lock: every live retrain run of the
    workspace holds it, so a RUNNING one is then a dead one. A run recorded by another
    host (`posttrain.host`) is left alone: its lock is not this one.
    """
    from mlflow import MlflowClient

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
