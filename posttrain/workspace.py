"""A git + DVC workspace for any config: how variants (`configs/sql.yaml`, ...) run.

DVC reads params from `configs/pipeline.yaml` itself, so a variant that `extends:`
another cannot be run in place. `create` lays out a new repository with this one's
dvc.yaml and library sources (dvc.yaml lists them as deps), writes the variant's
resolved config as its complete `configs/pipeline.yaml`, and commits it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from posttrain.errors import UserError

# What a new workspace starts from ships inside the package (posttrain/template: links to
# this checkout's dvc.yaml, configs/, .gitignore ... that a wheel holds as files), so a
# wheel install creates workspaces as a checkout does.
PACKAGE = Path(__file__).resolve().parent
TEMPLATE = PACKAGE / "template"


def tool_path(name: str) -> str:
    """An executable next to this interpreter (the project venv), else from PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def stage_env(workdir: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a stage process: ours, the venv first on PATH, plus `extra`.

    A workspace that holds its own `posttrain/` (a variant's, a replay's checkout) runs
    that code, not the installed package: it goes first on PYTHONPATH.
    """
    env = {**os.environ, **extra}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if workdir and (Path(workdir) / "posttrain" / "__init__.py").is_file():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(workdir).resolve()), env.get("PYTHONPATH")]))
    return env


def run_checked(cmd: list[str], cwd: Path) -> None:
    """Run a git or dvc command; RuntimeError with its own message when it fails."""
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:3]))} failed: {(done.stderr or done.stdout).strip()[-500:]}")


def _git(*args, cwd: Path) -> None:
    run_checked(["git", *args], cwd)


def commit(cwd: Path, message: str, paths: list[str] | None = None) -> None:
    """`git commit` of what is staged (only `paths` when given), as the configured user,
    else as `posttrain` (a scheduled worker may have no git identity)."""
    configured = subprocess.run(["git", "config", "user.email"], cwd=cwd, capture_output=True, text=True)
    identity = [] if configured.stdout.strip() else ["-c", "user.name=posttrain", "-c", "user.email=posttrain@localhost"]
    run_checked(["git", *identity, "commit", "-q", "-m", message, *(["--", *paths] if paths else [])], cwd)


def create(dest: str | Path, config: dict, *, remote: str | Path | None = None) -> Path:
    """A fresh workspace at `dest` running `config` (a resolved config dict).

    remote: the DVC remote's folder; default `<dest>-remote` beside it.
    """
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise UserError(str(dest), "the workspace folder exists and is not empty", "pick a new folder or remove it")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("gitignore", "dvcignore"):
        shutil.copy(TEMPLATE / name, dest / f".{name}")
    shutil.copytree(TEMPLATE / "configs", dest / "configs")
    copy_code(dest)
    (dest / "datasets").mkdir()
    shutil.copy(TEMPLATE / "datasets_README.md", dest / "datasets" / "README.md")  # batches are its own
    (dest / "configs" / "pipeline.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    dvc = [tool_path("dvc")]  # the venv's dvc, even when the venv is not on PATH
    _git("init", "-q", "-b", "main", cwd=dest)
    for args in (["init", "-q"], ["config", "core.analytics", "false"],
                 ["remote", "add", "-d", "local", str(Path(remote or dest.parent / f"{dest.name}-remote").resolve())]):
        subprocess.run(dvc + args, cwd=dest, check=True, capture_output=True, text=True)
    _git("add", "-A", cwd=dest)
    commit(dest, "posttrain workspace")
    return dest


def copy_code(dest: Path) -> None:
    """This package's dvc.yaml and library into `dest`: the stages run the workspace's
    copy (`stage_env`), so what DVC hashes as a dep is what runs. Nothing to do in the
    checkout the package is installed from."""
    if (dest / "posttrain").resolve() == PACKAGE:
        return
    shutil.copy(TEMPLATE / "dvc.yaml", dest / "dvc.yaml")
    shutil.rmtree(dest / "posttrain", ignore_errors=True)
    shutil.copytree(PACKAGE, dest / "posttrain", ignore=shutil.ignore_patterns("__pycache__", "template"))


def prepare(workdir: str | Path, config: dict) -> Path:
    """`workdir` set up to run `config`: created when missing, else its config and code
    replaced by this checkout's (DVC then reruns only the stages whose inputs changed)."""
    workdir = Path(workdir)
    if not (workdir / "dvc.yaml").is_file():
        return create(workdir, config)
    copy_code(workdir)
    (workdir / "datasets").mkdir(exist_ok=True)  # workspaces from before new data was versioned
    shutil.copy(TEMPLATE / "datasets_README.md", workdir / "datasets" / "README.md")
    (workdir / "configs" / "pipeline.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    # commit what changed, so the run's git commit names its code and config (replay)
    _git("add", "dvc.yaml", "posttrain", "configs", "datasets/README.md", cwd=workdir)
    staged = subprocess.run(["git", "diff", "--cached", "--quiet"], cwd=workdir)
    if staged.returncode:
        commit(workdir, "posttrain workspace: code and config updated")
    return workdir


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


def stages(workdir: str | Path) -> list[dict]:
    """The pipeline's stages in the order `dvc repro` runs them: `{"name", "metrics"}`,
    the name as `dvc repro` takes it inside `workdir`, the metrics files relative to it.
    `.dvc` files (versioned data in datasets/) have no command and are left out."""
    from dvc.repo import Repo
    from dvc.repo.reproduce import get_active_graph, plan_repro

    with Repo(str(workdir)) as repo:
        planned = plan_repro(get_active_graph(repo.index.graph))
        return [{"name": address(s, repo.root_dir), "metrics": [o.def_path for o in s.outs if o.metric]}
                for s in planned if getattr(s, "cmd", None)]


def address(stage, root: str) -> str:
    """The stage's name as `dvc repro` takes it inside `root` (DVC's own `addressing`
    is relative to the process's folder, which differs when the flow runs a workspace
    elsewhere, e.g. `posttrain run --config` from the repository root)."""
    dvcfile = os.path.relpath(stage.path, root)
    return stage.name if dvcfile == "dvc.yaml" else f"{dvcfile}:{stage.name}"


def stage_metrics(workdir: str | Path, stage: dict) -> dict:
    """A stage's metrics files, merged (what the flow logs for it)."""
    from posttrain.io import read_json

    metrics = {}
    for path in stage["metrics"]:
        metrics.update(read_json(Path(workdir) / path))
    return metrics
