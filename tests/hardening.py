"""One check for every hostile case (issue 12): the CLI refuses in one line, fast, and
leaves nothing behind.

    done = cli("check", "--config", path, cwd=tmp_path)
    assert_refused(done, "field", "fix")          # exit 2, one line, no traceback
    assert_nothing_left(tmp_path, before)          # no new files, commits or RUNNING runs

`cli` runs the `posttrain` command's `main` (flows/cli.py) in this process (a subprocess
costs seconds of imports per case); `cli_process` runs the installed `posttrain` command
for the cases that need a real process (signals, stderr written by libraries, environment variables read at start).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def cli(*args, cwd: Path | str | None = None, env: dict | None = None) -> Done:
    """`posttrain ARGS` in this process, from `cwd`, with `env` added to the environment."""
    from flows.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_cwd, saved_env = os.getcwd(), dict(os.environ)
    started = time.monotonic()
    try:
        os.chdir(cwd or saved_cwd)
        os.environ.update(env or {})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in args])
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return Done(code, out.getvalue(), err.getvalue(), time.monotonic() - started)


def cli_process(*args, cwd: Path | str | None = None, env: dict | None = None, timeout: float = 120) -> Done:
    """`posttrain ARGS` as a user runs it (the venv's command)."""
    started = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).parent / "posttrain"), *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=timeout)
    return Done(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def assert_refused(done: Done, *needles: str, secrets: tuple[str, ...] = ()) -> None:
    """Exit 2, exactly one line on stderr naming every needle, no traceback, and none of
    `secrets` anywhere in the output. No bound in seconds: a loaded machine is slow, and
    a refusal's cost is bounded by what it does (tests count work, not time)."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert all(n in lines[0] for n in needles), lines[0]
    for secret in secrets:
        assert secret not in done.stderr + done.stdout, "a secret reached the output"


def state(folder: Path) -> dict:
    """What a refused command must not change under `folder`: its files, every git
    repository's commits, and the MLflow runs in any `mlflow.db`."""
    folder = Path(folder)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                   if "__pycache__" not in p.parts and ".git" not in p.parts)
    commits = {}
    for git in folder.rglob(".git"):
        log = subprocess.run(["git", "log", "--oneline", "--all"], cwd=git.parent, capture_output=True, text=True)
        commits[str(git.parent)] = log.stdout
    return {"files": files, "commits": commits, "runs": mlflow_runs(folder)}


def mlflow_runs(folder: Path) -> dict[str, str]:
    """run id -> status of every run in every `mlflow.db` under `folder`."""
    import sqlite3

    runs = {}
    for db in Path(folder).rglob("mlflow.db"):
        with contextlib.closing(sqlite3.connect(db)) as conn:
            runs.update(dict(conn.execute("SELECT run_uuid, status FROM runs")))
    return runs


def assert_nothing_left(folder: Path, before: dict) -> None:
    """No file, commit or MLflow run appeared under `folder` since `before` (`state`),
    and no run there is left RUNNING."""
    after = state(folder)
    assert after["files"] == before["files"], sorted(set(after["files"]) ^ set(before["files"]))
    assert after["commits"] == before["commits"], "a commit was made"
    assert after["runs"] == before["runs"], "an MLflow run was created or changed"
    assert "RUNNING" not in after["runs"].values()


def assert_interrupt_leaves_nothing(monkeypatch, module, step: str, write, folder: Path) -> None:
    """The user's Ctrl-C (KeyboardInterrupt) raised from `module.step` while `write()` writes:
    it reaches the caller, and `folder` is left as empty as it was."""
    def stop(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(module, step, stop)
    with pytest.raises(KeyboardInterrupt):
        write()
    assert list(folder.iterdir()) == []
