"""Child processes that end with the process that started them, kill -9 included.

A process killed with SIGKILL runs no `finally` and no `atexit`, so its children (a
server, a stage) would run on. Linux's parent-death signal has the kernel end them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# looked up here, not in a forked child (where the loader's lock may be held by a thread that is not there)
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


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
