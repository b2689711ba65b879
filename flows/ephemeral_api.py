"""Prefect's temporary API server, bound to the life of the process that starts it.

Without `PREFECT_API_URL`, Prefect starts a temporary API server on loopback for the
process (`prefect.server.api.server.SubprocessASGIServer`: uvicorn in a child process)
and stops it at exit (atexit). A process killed with SIGKILL runs no atexit, so the
server would listen for good. Here Prefect still starts and stops its server itself
(port, health check, reuse by every client of the process); its child process only
gets the parent-death signal as well, so the kernel ends it with the process.
"""

from __future__ import annotations

import subprocess
import threading
import types

from posttrain.lifetime import die_with_this_thread


class _Popen(subprocess.Popen):
    """`subprocess.Popen` that arms the parent-death signal when called from the main
    thread: the signal follows the thread that starts the child, and only the main thread
    lives as long as the process (Prefect may start the server from a worker thread too;
    such a server is left as Prefect starts it)."""

    def __init__(self, *args, **kwargs):
        if threading.current_thread() is threading.main_thread() and kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = die_with_this_thread()
        super().__init__(*args, **kwargs)


def bind_to_process() -> None:
    """Make the temporary server Prefect starts from this process's main thread die with
    the process. Nothing to do when `PREFECT_API_URL` names a server."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return
    from prefect.server.api import server

    if isinstance(server.subprocess, types.ModuleType):  # the server module's own `import subprocess`
        server.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": _Popen})
