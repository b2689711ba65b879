"""Real servers on loopback for integration tests: PostgreSQL databases, `mlflow server`,
`prefect server start`, and processes that must be stopped whatever the test does."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from conftest import BIN, CHILD_ENV_DROP
from posttrain.vllm_engine.loadtest import free_port

POSTGRES = "postgres@127.0.0.1:5432"


@contextlib.contextmanager
def postgres_database():
    """A new, empty database on the local PostgreSQL (trust auth), dropped afterwards."""
    import psycopg2

    name = f"posttrain_{uuid.uuid4().hex[:12]}"
    admin = psycopg2.connect(f"postgresql://{POSTGRES}/test")
    admin.autocommit = True
    admin.cursor().execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        admin.cursor().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def process_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROP}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env['PATH']}", **extra}


@contextlib.contextmanager
def running(cmd: list, *, log: Path, env: dict, cwd: Path | None = None, health: str | None = None,
            timeout: float = 180):
    """Run `cmd` in its own process group for the block; wait for `health` to answer 200."""
    with open(log, "w") as out:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
    try:
        if health:
            wait_for(lambda: _ok(health), timeout, f"{cmd[0]} at {health} (log: {log}):\n", proc, log)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(predicate, timeout: float, what: str, proc=None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what} exited ({proc.returncode}):\n{log.read_text()[-3000:] if log else ''}")
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}{log.read_text()[-3000:] if log else ''}")


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def api(base: str, path: str, body: dict | None = None, method: str | None = None, attempts: int = 5):
    """JSON over HTTP to a server's REST API. A 503 is retried, as Prefect's own client
    does: a Prefect server on SQLite answers it while another writer holds the database."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}{path}", data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json"})
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as err:
            if err.code != 503 or attempt == attempts - 1:
                raise
            time.sleep(2 ** attempt)


@contextlib.contextmanager
def mlflow_server(tmp: Path, database: str):
    """`mlflow server` on PostgreSQL with a proxied artifact store (`mlflow-artifacts:`)."""
    port = free_port()
    cmd = [BIN / "mlflow", "server", "--backend-store-uri", f"postgresql+psycopg2://{POSTGRES}/{database}",
           "--artifacts-destination", tmp / "mlflow-artifacts", "--serve-artifacts",
           "--host", "127.0.0.1", "--port", port, "--workers", "1"]
    with running(cmd, log=tmp / "mlflow-server.log", env=process_env(), health=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def prefect_server(tmp: Path, database_url: str):
    """`prefect server start` on loopback with its database at `database_url`."""
    port = free_port()
    env = process_env(PREFECT_HOME=str(tmp / "prefect-home"), PREFECT_API_DATABASE_CONNECTION_URL=database_url,
                      PREFECT_UI_ENABLED="false", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    cmd = [BIN / "prefect", "server", "start", "--host", "127.0.0.1", "--port", port, "--no-ui"]
    with running(cmd, log=tmp / "prefect-server.log", env=env, health=f"http://127.0.0.1:{port}/api/health"):
        yield f"http://127.0.0.1:{port}/api"
