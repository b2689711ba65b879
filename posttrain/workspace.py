"""A git + DVC workspace for any config: how variants (`configs/sql.yaml`, ...) run.

DVC reads params from `configs/pipeline.yaml` itself, so a variant that `extends:`
another cannot be run in place. `create` lays out a new repository with this one's
dvc.yaml and library sources (dvc.yaml lists them as deps), writes the variant's
resolved config as its complete `configs/pipeline.yaml`, and commits it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from posttrain.errors import UserError
from posttrain.plugins import CUSTOM_DIR, check_custom

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
    dest = Path(dest).absolute()
    if dest.exists() and any(dest.iterdir()):
        raise UserError(str(dest), "the workspace folder exists and is not empty", "pick a new folder or remove it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # laid out beside it and renamed into place: a failed creation leaves nothing, and of two
    # runs creating it at once, one wins and the other runs in the winner's workspace
    scratch = tempfile.mkdtemp(prefix=f".{dest.name}.creating-", dir=dest.parent)
    try:
        _lay_out(Path(scratch), config, Path(remote or dest.parent / f"{dest.name}-remote").resolve())
        os.rename(scratch, dest)  # over an empty folder, or none
    except OSError:
        if not (dest / "dvc.yaml").is_file():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # gone already once renamed
    return dest


def _lay_out(dest: Path, config: dict, remote: Path) -> None:
    """A new workspace's files, git repository and DVC set-up in the folder `dest`."""
    for name in ("gitignore", "dvcignore"):
        shutil.copy(TEMPLATE / name, dest / f".{name}")
    shutil.copytree(TEMPLATE / "configs", dest / "configs")
    copy_code(dest, config)
    (dest / "datasets").mkdir()
    shutil.copy(TEMPLATE / "datasets_README.md", dest / "datasets" / "README.md")  # batches are its own
    (dest / "configs" / "pipeline.yaml").write_text(yaml.safe_dump(workspace_params(config), sort_keys=False))
    dvc = [tool_path("dvc")]  # the venv's dvc, even when the venv is not on PATH
    _git("init", "-q", "-b", "main", cwd=dest)
    for args in (["init", "-q"], ["config", "core.analytics", "false"],
                 ["remote", "add", "-d", "local", str(remote)]):
        subprocess.run(dvc + args, cwd=dest, check=True, capture_output=True, text=True)
    _git("add", "-A", cwd=dest)
    commit(dest, "posttrain workspace")


def copy_code(dest: Path, config: dict) -> None:
    """This package's dvc.yaml (for `config`'s environment: dvc_yaml) and library into `dest`,
    and the user's own code (`custom/` of the current folder, where `posttrain check` imported
    it from): the stages run the workspace's copy (`stage_env`), so what DVC hashes as a dep
    is what runs. Nothing to do in the checkout the package is installed from."""
    copy_custom(dest)
    if (dest / "posttrain").resolve() == PACKAGE:
        return
    (dest / "dvc.yaml").write_text(dvc_yaml((config.get("data") or {}).get("env")))
    shutil.rmtree(dest / "posttrain", ignore_errors=True)
    shutil.copytree(PACKAGE, dest / "posttrain", ignore=shutil.ignore_patterns("__pycache__", "template"))


def dvc_yaml(env) -> str:
    """The template's dvc.yaml for a config whose `data.env` is `env`: for a built-in, its
    stages depend on that environment's modules and not on the other built-ins' (an edit to
    the SQL environment reruns nothing of an arithmetic pipeline); for your own environment
    (`custom/`, an entry point, an import path) on all of them, as it may import any."""
    from posttrain.envs import MODULES

    text = (TEMPLATE / "dvc.yaml").read_text()
    if not isinstance(env, str) or env not in MODULES:
        return text
    unused = {f"posttrain/{path}" for paths in MODULES.values() for path in paths} - \
        {f"posttrain/{path}" for path in MODULES[env]}
    return "".join(line for line in text.splitlines(keepends=True)
                   if line.strip().removeprefix("- ").strip() not in unused)


def copy_custom(dest: Path) -> None:
    """`custom/` of the current folder replaces `dest`'s (a DVC dependency of the stages:
    it must exist). Without one here, `dest`'s is left as it is, or made holding only its
    README."""
    source, target = Path.cwd() / CUSTOM_DIR, dest / CUSTOM_DIR
    if source.resolve() == target.resolve():
        return
    check_custom(Path.cwd())  # before the copy: links are copied as what they point at
    if source.is_dir():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    elif not target.is_dir():
        target.mkdir()
        (target / "README.md").write_text((TEMPLATE / "custom_README.md").read_text())


def pin_model_path(config: dict) -> dict:
    """The config with a relative `model.path` made absolute from the current folder,
    where `posttrain check` found it: the workspace's stages run elsewhere."""
    path = (config.get("model") or {}).get("path")
    return {**config, "model": {**config["model"], "path": _absolute(path)}} if _relative(path) else config


def workspace_params(config: dict) -> dict:
    """The config as a workspace's params file: whole, every field with its value (a
    default written out: dvc.yaml's stages track keys such as `stats.bootstrap_resamples`
    that a variant may leave out, and DVC refuses a params key that is missing), and
    relative paths (`model.path`, each `launcher.accelerate_config`) made absolute from
    the current folder, where `posttrain check` found them."""
    from posttrain.config import PipelineConfig

    config = PipelineConfig.model_validate(config).model_dump(mode="json", by_alias=True)
    config = pin_model_path(config)
    config = {**config, "launcher": _pin_launcher(config["launcher"])}
    if isinstance(config.get("sft"), dict) and config["sft"].get("launcher"):
        config["sft"] = {**config["sft"], "launcher": _pin_launcher(config["sft"]["launcher"])}
    if isinstance(config.get("grpo"), dict):
        config["grpo"] = {name: {**stage, "launcher": _pin_launcher(stage["launcher"])}
                          if isinstance(stage, dict) and stage.get("launcher") else stage
                          for name, stage in config["grpo"].items()}
    return config


def _pin_launcher(launcher):
    file = launcher.get("accelerate_config") if isinstance(launcher, dict) else None
    return {**launcher, "accelerate_config": _absolute(file)} if _relative(file) else launcher


def _relative(path) -> bool:
    return isinstance(path, str) and bool(path) and not Path(path).is_absolute()


def _absolute(path: str) -> str:
    return str(Path(path).resolve())


def prepare(workdir: str | Path, config: dict) -> Path:
    """`workdir` set up to run `config`: created when missing, else its config and code
    replaced by this checkout's (DVC then reruns only the stages whose inputs changed)."""
    workdir = Path(workdir)
    if not (workdir / "dvc.yaml").is_file():
        return create(workdir, config)
    copy_code(workdir, config)
    (workdir / "datasets").mkdir(exist_ok=True)  # workspaces from before new data was versioned
    shutil.copy(TEMPLATE / "datasets_README.md", workdir / "datasets" / "README.md")
    (workdir / "configs" / "pipeline.yaml").write_text(yaml.safe_dump(workspace_params(config), sort_keys=False))
    # commit what changed, so the run's git commit names its code and config (replay)
    _git("add", "dvc.yaml", "posttrain", CUSTOM_DIR, "configs", "datasets/README.md", cwd=workdir)
    staged = subprocess.run(["git", "diff", "--cached", "--quiet"], cwd=workdir)
    if staged.returncode:
        commit(workdir, "posttrain workspace: code and config updated")
    return workdir
