"""One retrain run at a time per workspace: the run lock.

Two runs on one workspace would write the same outputs; DVC's own lock would fail the
second one part-way, so it queues here instead. Every live retrain run of a workspace
holds it, which is also how the next run knows a RUNNING MLflow run left behind is dead
(posttrain.tracking.dead_runs).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

LOCK = ".dvc/tmp/posttrain-retrain.lock"
RWLOCK = ".dvc/tmp/rwlock"  # DVC's record of the outputs its running commands read and write
_HELD: set[str] = set()


@contextlib.contextmanager
def lock(workdir: str | Path, log=print):
    """Hold the workspace's retrain lock for the block; a second run waits its turn.

    Two runs on one workspace would write the same outputs; DVC's own lock would fail
    the second one part-way, so it queues here instead, saying whom it waits for.
    """
    path = Path(workdir).resolve() / LOCK
    if str(path) in _HELD:  # this process holds it already (the CLI around the flow)
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            log(f"another retrain run holds {path} ({fh.read().strip() or 'unknown'}); waiting for it to finish")
            fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        fh.flush()
        _HELD.add(str(path))
        try:
            wait_for_dvc(workdir, log)
            yield
        finally:
            _HELD.discard(str(path))
            fh.truncate(0)
            fcntl.flock(fh, fcntl.LOCK_UN)


def wait_for_dvc(workdir: str | Path, log=print, poll: float = 1.0) -> None:
    """Wait for the DVC commands at work in the workspace (a user's `dvc repro` there):
    DVC holds its repo lock between a repro's stages and its per-output lock (rwlock)
    while a stage's command runs, and a run that started meanwhile would fail on either
    part-way (`dvc repro --wait-for-lock` waits for the first only). Returns once DVC's
    repo lock is free and no live process holds an output; says once whom it waits for."""
    if not Path(workdir, ".dvc", "config").is_file():  # not a DVC workspace yet: no DVC command works there
        return
    said = False
    while True:
        busy = dvc_commands_at_work(workdir)
        if not busy and not Path(workdir, ".dvc", "tmp", "lock").exists():  # DVC makes it at its first lock
            return
        if not busy:
            from dvc.repo import Repo

            with Repo(str(workdir), _wait_for_lock=True) as repo, repo.lock:  # between stages: after it
                busy = dvc_commands_at_work(workdir)
            if not busy:
                return
        if not said:
            log(f"a DVC command works in {Path(workdir).resolve()} ({busy[0]}); waiting for it to finish")
            said = True
        time.sleep(poll)


def dvc_commands_at_work(workdir: str | Path) -> list[str]:
    """The live processes DVC's rwlock names in the workspace, as `pid N: command`."""
    import json

    import psutil

    try:
        held = json.loads((Path(workdir) / RWLOCK).read_text() or "{}")
    except (FileNotFoundError, json.JSONDecodeError):  # none yet, or DVC writing it this instant
        return []
    infos = [*held.get("write", {}).values(), *(i for readers in held.get("read", {}).values() for i in readers)]
    return sorted({f"pid {i['pid']}: {i['cmd']}" for i in infos
                   if i.get("pid") != os.getpid() and psutil.pid_exists(int(i.get("pid", 0)))})
