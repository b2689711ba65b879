"""A git + DVC workspace for any config: how variants (`configs/sql.yaml`, ...) run.

DVC reads params from `configs/pipeline.yaml` itself, so a variant that `extends:`
another cannot be run in place. `create` lays out a new repository with this one's
dvc.yaml and library sources (dvc.yaml lists them as deps), writes the variant's
resolved config as its complete `configs/pipeline.yaml`, and commits it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from posttrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def _git(*args, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)


def create(dest: str | Path, config: dict, *, remote: str | Path | None = None) -> Path:
    """A fresh workspace at `dest` running `config` (a resolved config dict).

    remote: the DVC remote's folder; default `<dest>-remote` beside it.
    """
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise UserError(str(dest), "the workspace folder exists and is not empty", "pick a new folder or remove it")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("dvc.yaml", ".gitignore", ".dvcignore"):
        shutil.copy(REPO / name, dest / name)
    shutil.copytree(REPO / "configs", dest / "configs")
    shutil.copytree(REPO / "posttrain", dest / "posttrain", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "configs" / "pipeline.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    beside = Path(sys.executable).parent / "dvc"  # the venv's dvc, even when the venv is not on PATH
    dvc = [str(beside) if beside.is_file() else "dvc"]
    _git("init", "-q", "-b", "main", cwd=dest)
    for args in (["init", "-q"], ["config", "core.analytics", "false"],
                 ["remote", "add", "-d", "local", str(Path(remote or dest.parent / f"{dest.name}-remote").resolve())]):
        subprocess.run(dvc + args, cwd=dest, check=True, capture_output=True, text=True)
    _git("add", "-A", cwd=dest)
    _git("-c", "user.email=posttrain@localhost", "-c", "user.name=posttrain", "commit", "-qm",
         "posttrain workspace", cwd=dest)
    return dest


def prepare(workdir: str | Path, config: dict) -> Path:
    """`workdir` set up to run `config`: created when missing, else its config replaced
    (DVC then reruns only the stages whose params changed)."""
    workdir = Path(workdir)
    if not (workdir / "dvc.yaml").is_file():
        return create(workdir, config)
    (workdir / "configs" / "pipeline.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return workdir
