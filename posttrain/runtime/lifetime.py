"""Child processes that end with the process that started them, kill -9 included.

A process killed with SIGKILL runs no `finally` and no `atexit`, so its children (a
server, a stage) would run on. Linux's parent-death signal has the kernel end them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import select
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
RUN_PID_ENV = "POSTTRAIN_RUN_PID"  # set by the flow for the stages it runs: the process they end with
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


def ancestors() -> list[int]:
    """The pids above this process, parent first (Linux: read from /proc)."""
    found, pid = [], os.getppid()
    while pid > 1:
        found.append(pid)
        try:
            with open(f"/proc/{pid}/stat") as stat:  # "pid (comm) state ppid ...": comm may hold spaces
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


def die_with_ancestor(pid: int, sig: int = signal.SIGKILL) -> None:
    """Have this process end with `sig` when process `pid`, one of its ancestors however
    far up, ends: a thread waits on the process's pidfd (Linux >= 5.3; nothing elsewhere).
    The parent-death signal only follows the parent, and a shell may stand between
    (DVC runs a stage's command with `$SHELL -c`; dash does not exec it). `pid` no
    longer above this process: it has ended already, and `sig` comes now."""
    if not hasattr(os, "pidfd_open") or not sys.platform.startswith("linux"):
        return
    try:
        fd = os.pidfd_open(pid)  # close-on-exec: nothing this process starts holds it
    except ProcessLookupError:
        fd = None
    if fd is None or pid not in ancestors():  # checked after opening: the pidfd is that ancestor's
        os.kill(os.getpid(), sig)
        return

    def wait():
        select.select([fd], [], [])  # readable once the process has ended
        os.kill(os.getpid(), sig)

    threading.Thread(target=wait, name="posttrain-die-with-run", daemon=True).start()


def die_with_run() -> None:
    """A stage command run by `dvc repro` (DVC sets DVC_STAGE) ends when that dvc process
    ends, and when the flow that runs it ends (it names itself in POSTTRAIN_RUN_PID):
    a killed run leaves no stage training on (its lines would otherwise go to a closed
    pipe until it next prints, and it would end its MLflow run itself, or not at all).
    Run by hand, it is left alone (nohup keeps working)."""
    if os.environ.get("DVC_STAGE"):
        die_with_parent()
        if os.environ.get(RUN_PID_ENV, "").isdigit():
            die_with_ancestor(int(os.environ[RUN_PID_ENV]))


def die_with_this_thread(sig: int = signal.SIGKILL):
    """A `preexec_fn` for `subprocess.Popen`: the child dies with `sig` when the thread
    that starts it ends (die_with_parent). The signal follows that thread, not the
    process: start a child that must live as long as this process from the main thread."""
    return functools.partial(die_with_parent, sig, os.getpid()) if _PRCTL else None


def exit_now(code: int) -> None:
    """End this process with `code` as the interpreter would, without tearing down its
    modules: a process that imported torch, transformers and TRL spends 1.5-2.7 s freeing
    them after its last line (the stage's time, measured on 2 cores). What runs at a normal
    exit still runs first: other threads are joined, `atexit` handlers run (MLflow ends its
    run there), and stdout and stderr are flushed; as multiprocessing's forked workers
    end. Files a program left open and unflushed would lose their tail: stages close theirs."""
    import atexit

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe the reader has left
            pass
    os._exit(code)
