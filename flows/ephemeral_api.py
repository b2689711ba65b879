"""Prefect's temporary API server, bound to the life of the process that starts it.

Without `PREFECT_API_URL`, Prefect starts a temporary API server on loopback for the
process (`prefect.server.api.server.SubprocessASGIServer`: uvicorn in a child process)
and stops it at exit (atexit). A process killed with SIGKILL runs no atexit, so the
server would listen for good. Here Prefect still starts and stops its server itself
(port, health check, reuse by every client of the process); its child process only
gets the parent-death signal as well, so the kernel ends it with the process.

The server listens on a loopback port, which every local user can reach: without a
password, another user could read the run's flow runs and mark them cancelled. It gets
Prefect's own basic-auth setting, a random string made per process for the server
(`PREFECT_SERVER_API_AUTH_STRING`) and this process's client (`PREFECT_API_AUTH_STRING`);
other processes of this user started from it inherit it, others get 401 (its health
check stays open, as Prefect has it). A flow run cancelled from elsewhere is not watched
for: only this user, through this process's server, could cancel it, and Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import subprocess
import threading
import types
from pathlib import Path

from posttrain.runtime.lifetime import die_with_this_thread


class _Popen(subprocess.Popen):
    """`subprocess.Popen` that arms the parent-death signal when called from the main
    thread: the signal follows the thread that starts the child, and only the main thread
    lives as long as the process (Prefect may start the server from a worker thread too;
    such a server is left as Prefect starts it)."""

    def __init__(self, *args, **kwargs):
        if threading.current_thread() is threading.main_thread() and kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = die_with_this_thread()
        super().__init__(*args, **kwargs)


AUTH_STRING = secrets.token_urlsafe(32)  # one per process: the temporary server is one per process


def bind_to_process() -> None:
    """Make the temporary server Prefect starts from this process's main thread die with
    the process, and answer only clients that hold this process's auth string. Nothing to
    do when `PREFECT_API_URL` names a server."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return
    protect()
    from prefect.server.api import server

    if isinstance(server.subprocess, types.ModuleType):  # the server module's own `import subprocess`
        server.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": _Popen})


def protect() -> None:
    """Set Prefect's auth string for the temporary server and this process's client (a
    string the user set for the server is kept), before the server starts: Prefect reads
    its settings once, and again when `refresh_global_settings_context` says so."""
    from prefect.context import refresh_global_settings_context

    server_string = os.environ.setdefault("PREFECT_SERVER_API_AUTH_STRING", AUTH_STRING)
    if os.environ.get("PREFECT_API_AUTH_STRING") != server_string:
        os.environ["PREFECT_API_AUTH_STRING"] = server_string
        refresh_global_settings_context()


class _Quiet(logging.Filter):
    """Prefect's lines about its temporary server, held back while `posttrain run` checks
    its input: a refused run prints one line (posttrain.cli), the server ends unseen."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Starting temporary server", "Stopping temporary server"))


_QUIET = _Quiet()


def start_now() -> None:
    """Start the temporary server now, bound to this process (call it from the main
    thread), rather than at the flow's first API call: `posttrain run` starts it while its
    stage host checks the config; `announce` once the input is accepted. Prefect's client
    finds it running (one per process, as `prefect.client.orchestration.get_client` starts
    it). Nothing when `PREFECT_API_URL` names a server or ephemeral mode is off."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return
    bind_to_process()
    from prefect.server.api import server

    server.subprocess_server_logger.addFilter(_QUIET)
    with one_start_at_a_time():
        server.SubprocessASGIServer().start()


START_LOCK = "posttrain-server-start.lock"


@contextlib.contextmanager
def one_start_at_a_time():
    """Hold a lock in PREFECT_HOME while a temporary server starts: each new server migrates
    Prefect's database at start-up, and two migrating a new database at once fail (runs
    started together by a user's first cron tick and a hand: `duplicate column name`,
    `No such index`). The next start waits a few seconds and finds the database migrated."""
    from prefect.settings import PREFECT_HOME

    home = Path(PREFECT_HOME.value()).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / START_LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def announce() -> None:
    """The input is accepted: Prefect's lines about its server are shown again, starting
    with where the server `start_now` started listens."""
    from prefect.server.api import server

    if _QUIET not in server.subprocess_server_logger.filters:
        return
    server.subprocess_server_logger.removeFilter(_QUIET)
    started = server.SubprocessASGIServer()
    if started.running:
        server.subprocess_server_logger.info(f"Temporary server on {started.address}")
