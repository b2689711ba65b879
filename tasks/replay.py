"""`posttrain replay RUN_ID`: rerun a recorded retrain run and set its metrics beside the record.

A retrain run records the git commit of its workspace, the config file as written
(artifact `params/pipeline.yaml`), the `dvc.lock` and data hashes, the seed and the
package versions (posttrain.tracking.mlflow_runs.provenance). Replay clones the workspace at that
commit into a scratch folder, restores the config, pulls the versioned data
(`datasets/`) from the workspace's DVC remote, reruns every stage there (`dvc repro`,
into a scratch MLflow store, so the recorded runs are not touched) and compares each
metric. Wall-clock metrics (seconds, throughput, latency) are shown but not compared.
It drives DVC's stage graph as the retrain flow's tasks do (tasks/dvc_stages.py), so it
lives beside them; `posttrain replay` (flows/cli.py) calls it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from posttrain.errors import ReplayError, UserError
from posttrain.layout import PARAMS_FILE
from posttrain.plugins import CUSTOM_DIR
from posttrain.tracking.mlflow_runs import run_metrics, package_versions
from posttrain.workspace import run_checked, stage_env, tool_path
from tasks.dvc_stages import stage_metrics, stages

# What a run reads besides the config file: its code (the workspace's own in custom/ too),
# stage graph and versioned data.
PIPELINE_INPUTS = ("dvc.yaml", "posttrain/", f"{CUSTOM_DIR}/", "configs/", "datasets/")
WALL_CLOCK = re.compile(r"(seconds|per_second|latency|throughput|_ms$|_s$|ttft|tpot)")


def recorded_run(client, run_id: str):
    """The retrain parent run `run_id`; UserError when the store holds no such run."""
    from posttrain.tracking.compare import get_run

    where = f"posttrain replay {run_id}"
    run = get_run(client, run_id, where, "pass the 32-hex id of a retrain run (see `mlflow ui`)")
    if run.data.tags.get("posttrain.flow") != "retrain":
        raise UserError(where, "not a retrain run (a stage's child run?)", "pass the parent run's id")
    if run.info.status != "FINISHED":
        raise UserError(where, f"the run did not finish ({run.info.status}): there are no results to compare",
                        "replay a finished run")
    return run


def checkout(client, run, scratch: Path) -> Path:
    """The run's workspace at its commit, with its config and data, in `scratch`."""
    tags, where = run.data.tags, f"posttrain replay {run.info.run_id}"
    source, commit = tags.get("posttrain.workspace", ""), tags.get("git.commit", "")
    if not commit or not Path(source, ".git").exists():
        raise UserError(where, f"its workspace {source or '(unrecorded)'} is not a git checkout here",
                        "replay on the machine that ran it, or from a clone at the same path")
    modified = [f for f in tags.get("git.modified", "").split(",")
                if f.startswith(PIPELINE_INPUTS) and f != PARAMS_FILE]  # the config is restored below
    if modified:
        raise UserError(where, f"it ran with uncommitted changes to {', '.join(modified[:3])}",
                        "commit code and data changes before running, so the commit names them")
    run_checked(["git", "clone", "-q", "--no-checkout", source, str(scratch)], Path.cwd())
    run_checked(["git", "checkout", "-q", commit], scratch)
    params = client.download_artifacts(run.info.run_id, f"params/{Path(PARAMS_FILE).name}", str(scratch / ".replay"))
    shutil.copy(params, scratch / PARAMS_FILE)
    _same_remote(Path(source), scratch)
    data = sorted(str(p.relative_to(scratch)) for p in scratch.glob("datasets/*.dvc"))
    if data:
        run_checked([tool_path("dvc"), "pull", "--quiet", *data], scratch)
    return scratch


def _same_remote(source: Path, scratch: Path) -> None:
    """Point the clone at the workspace's DVC remotes (a relative local path in
    `.dvc/config` would otherwise resolve against the scratch folder)."""
    from dvc.repo import Repo

    local = source / ".dvc" / "config.local"  # credentials set with `dvc remote modify --local`
    if local.is_file():
        shutil.copy(local, scratch / ".dvc" / "config.local")
    with Repo(str(source)) as repo:
        remotes = {name: conf["url"] for name, conf in repo.config.get("remote", {}).items()}
    for name, url in remotes.items():  # DVC has made local paths absolute
        run_checked([tool_path("dvc"), "remote", "modify", "--local", name, "url", url], scratch)


def rerun(scratch: Path) -> dict[str, float]:
    """`dvc repro` of every stage in `scratch`; the metrics under the parent run's names."""
    log = scratch / "replay.log"
    env = stage_env(scratch, MLFLOW_TRACKING_URI=f"sqlite:///{scratch / 'mlflow.db'}")
    for key in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
        env.pop(key, None)
    with open(log, "w") as fh:
        # no run-cache: every stage really runs, even where a shared DVC cache knows its outputs
        done = subprocess.run([tool_path("dvc"), "repro", "--no-run-cache"], cwd=scratch, env=env, stdout=fh,
                              stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text().splitlines()[-15:]
        raise ReplayError(f"the replayed pipeline failed (dvc exit {done.returncode}): "
                          f"{tail[-1] if tail else ''}; its log: {log}")
    return run_metrics({stage["name"]: stage_metrics(scratch, stage) for stage in stages(scratch)})


def table(recorded: dict[str, float], replayed: dict[str, float]) -> tuple[str, int]:
    """The side-by-side text and how many compared metrics differ."""
    width = max(map(len, recorded | replayed), default=10)
    lines = [f"{'metric':<{width}}  {'recorded':>14}  {'replayed':>14}  verdict"]
    counts = {"identical": 0, "DIFFERENT": 0, "wall-clock, not compared": 0}
    for name in sorted(recorded | replayed):
        old, new = recorded.get(name), replayed.get(name)
        verdict = ("wall-clock, not compared" if WALL_CLOCK.search(name)
                   else "identical" if old == new else "DIFFERENT")
        counts[verdict] += 1
        lines.append(f"{name:<{width}}  {_cell(old):>14}  {_cell(new):>14}  {verdict}")
    lines.append(", ".join(f"{n} {v}" for v, n in counts.items()))
    return "\n".join(lines), counts["DIFFERENT"]


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def replay(run_id: str, *, tracking_uri: str, scratch: str | None = None) -> tuple[str, int]:
    """(report, number of metrics that differ) of replaying retrain run `run_id`."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    run = recorded_run(client, run_id)
    folder = Path(scratch) if scratch else Path(tempfile.mkdtemp(prefix=f"posttrain-replay-{run_id[:8]}-"))
    if folder.exists() and any(folder.iterdir()):
        raise UserError(str(folder), "the scratch folder is not empty", "pass a new or empty folder with --scratch")
    tags = run.data.tags
    head = [f"replay of retrain run {run_id}: commit {tags.get('git.commit', '')[:12]}, "
            f"dvc.lock {tags.get('dvc.lock_md5', '-')}, data {tags.get('dvc.data_md5', '-')}, seed {tags.get('seed')}",
            f"scratch checkout: {folder}"]
    head += [f"note: {name} is {now} here, {tags[name]} in the run" for name, now in package_versions().items()
             if tags.get(name) not in (None, now)]
    try:
        rerun_metrics = rerun(checkout(client, run, folder))
    except RuntimeError as err:  # a clone, pull or command that failed: one line, not a traceback
        raise ReplayError(str(err).splitlines()[0]) from None
    text, differ = table(run.data.metrics, rerun_metrics)
    return "\n".join(head + ["", text]), differ

