"""One retrain run at a time per workspace: the run lock.

Two runs on one workspace would write the same outputs; DVC's own lock would fail the
second one part-way, so it queues here instead. Every live retrain run of a workspace
holds it, which is also how the next run knows a RUNNING MLflow run left behind is dead
(posttrain.runtime.dead_runs).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

LOCK = ".dvc/tmp/posttrain-retrain.lock"
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
            yield
        finally:
            _HELD.discard(str(path))
            fh.truncate(0)
            fcntl.flock(fh, fcntl.LOCK_UN)
