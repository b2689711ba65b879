"""Tasks that drive DVC: the stage order (read from DVC's graph), one stage's run, pushing data to the remote."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import deque
from pathlib import Path

from prefect import task
from prefect.cache_policies import NONE

from posttrain.runtime import lifetime, stagehost
from posttrain.tracking import summary
from posttrain.errors import StageFailed
from posttrain.files import read_json
from posttrain.redact import redact_text
from posttrain import stageid
from posttrain.stageid import kind_of, known
from posttrain.tracking.mlflow_runs import flatten, stage_outputs
from posttrain.workspace import stage_env, tool_path

# DVC is the cache; Prefect must never skip a stage on its own.
TASK_DEFAULTS = {"cache_policy": NONE}


def stages(workdir: str | Path) -> list[dict]:
    """The pipeline's stages in the order `dvc repro` runs them: `{"name", "metrics", "outs"}`,
    the name as `dvc repro` takes it inside `workdir`, its metrics files and other
    outputs relative to it.
    `.dvc` files (versioned data in datasets/) have no command and are left out."""
    import networkx as nx
    from dvc.repo import Repo

    with Repo(str(workdir), _wait_for_lock=True) as repo:  # a user's `dvc repro` there: after it
        # DVC's graph points from a stage to the stages it depends on: a post-order walk
        # visits every dependency first, as `dvc repro` does (networkx, not DVC's planner)
        planned = nx.dfs_postorder_nodes(repo.index.graph)
        return [{"name": address(s, repo.root_dir), "metrics": [o.def_path for o in s.outs if o.metric],
                 "outs": [o.def_path for o in s.outs if not (o.metric or o.plot)]}
                for s in planned if getattr(s, "cmd", None)]


def address(stage, root: str) -> str:
    """The stage's name as `dvc repro` takes it inside `root` (DVC's own `addressing`
    is relative to the process's folder, which differs when the flow runs a workspace
    elsewhere, e.g. `posttrain run --config` from the repository root)."""
    dvcfile = os.path.relpath(stage.path, root)
    return stage.name if dvcfile == "dvc.yaml" else f"{dvcfile}:{stage.name}"


def stage_metrics(workdir: str | Path, stage: dict) -> dict:
    """A stage's metrics files, merged (what the flow logs for it)."""
    metrics = {}
    for path in stage["metrics"]:
        metrics.update(read_json(Path(workdir) / path))
    return metrics


@task(name="stage_order", **TASK_DEFAULTS)
def stage_order(workdir: str) -> list[dict]:
    """Stages in the order `dvc repro` runs them, each with its metrics files."""
    return stages(workdir)


def run_logged(cmd: list[str], *, cwd: str, env: dict, log_path: Path, display) -> tuple[int, str]:
    """Run `cmd`, saving its output to `log_path` line by line (what a killed run leaves is
    the log up to its end); returns (exit code, tail). The terminal (`display`,
    tasks/display.py) gets its progress lines and posttrain's own messages, not the rest
    (TRL's log dicts, warnings: in the log).

    `cmd` dies with this process (kill -9 included), and its children once they next
    write to the closed pipe: a killed run leaves no stage running on.
    """
    from posttrain import progress

    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail: deque[str] = deque(maxlen=20)
    with open(log_path, "w", buffering=1) as log, subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=lifetime.die_with_this_thread()) as proc:
        for line in map(redact_text, proc.stdout):  # libraries print the tracking URI whole (MLflow's "View run")
            event = progress.parse(line)
            if event is not None:
                display.update(event)
                continue
            if line.startswith("posttrain:"):
                display.echo(line)
            log.write(line)
            tail.append(line.rstrip())
    return proc.returncode, "\n".join(tail)


@task(name="stage", task_run_name="{stage[name]}", **TASK_DEFAULTS)
def pipeline_stage(stage: dict, workdir: str, parent_run_id: str, tracking_uri: str, *,
                   allowed_retries: int = 0, before: float | None = None) -> dict:
    """One DVC stage, as one Prefect task run named after it: its MLflow child run,
    `dvc repro --single-item` (Prefect retries it `allowed_retries` times: set with
    `with_options(retries=...)` too), and its record. An attempt that fails and will be
    retried leaves the child run RUNNING for the next; the last one ends it FAILED and
    leaves the stage's last log lines on this task run (a markdown artifact, and the
    exception's message). Its start and end are one line each in the flow's log, the end
    saying what it did in numbers (`before`: the greedy accuracy of the model a GRPO stage
    starts from)."""
    from prefect import get_run_logger
    from prefect.runtime import task_run

    logger, started = get_run_logger(), time.monotonic()
    logger.info(f"{stage['name']}: started (its output: {stage_log(workdir, stage).relative_to(workdir)})")
    run_id = stage_child_run(stage, parent_run_id, tracking_uri)
    try:
        repro_stage(stage, workdir, run_id, tracking_uri)
    except BaseException as err:
        if task_run.run_count > allowed_retries:  # the last attempt
            record_stage(stage, workdir, run_id, tracking_uri, failed=True)
            failure_artifact(stage, err)
        raise
    metrics, cached = record_stage(stage, workdir, run_id, tracking_uri)
    logger.info(summary.stage_line(stage["name"], metrics, seconds=time.monotonic() - started, cached=cached,
                                   before=before))
    return metrics


def stage_child_run(stage: dict, parent_run_id: str, tracking_uri: str) -> str:
    """The stage's child run of `parent_run_id`: the one an earlier attempt left RUNNING,
    else a new one; its id (the stage process logs into it through MLFLOW_RUN_ID)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    parent = client.get_run(parent_run_id)
    earlier = client.search_runs([parent.info.experiment_id], max_results=1, filter_string=(
        f"tags.`mlflow.parentRunId` = '{parent_run_id}' and tags.`posttrain.stage` = '{stage['name']}' "
        "and attributes.status = 'RUNNING'"))
    if earlier:
        return earlier[0].info.run_id
    return client.create_run(parent.info.experiment_id, run_name=stage["name"],
                             tags={"mlflow.parentRunId": parent_run_id, "posttrain.stage": stage["name"]}).info.run_id


def failure_artifact(stage: dict, err: BaseException) -> None:
    """What a failed stage printed last, as a markdown artifact of its task run."""
    from prefect.artifacts import create_markdown_artifact

    text = getattr(err, "tail", "") or str(err)  # a StageFailed's last output lines, not only its one line
    create_markdown_artifact(f"**Stage {stage['name']} failed**\n\n```\n{text[-4000:]}\n```",
                             description=f"the last lines of stage {stage['name']}")


def repro_stage(stage: dict, workdir: str, run_id: str, tracking_uri: str) -> None:
    """`dvc repro --single-item STAGE`, its output in logs/<stage>.log as it goes. DVC
    decides whether the stage is up to date."""
    # unbuffered: the stage's lines reach its log as they are printed
    # the stage ends with this process, however it ends (lifetime.die_with_run)
    env = stage_env(workdir, MLFLOW_RUN_ID=run_id, MLFLOW_TRACKING_URI=tracking_uri, PYTHONUNBUFFERED="1",
                    **{lifetime.RUN_PID_ENV: str(os.getpid())})
    from tasks.display import StageDisplay

    with StageDisplay(stage["name"]) as display:
        code, tail = run_logged([tool_path("dvc"), "--wait-for-lock", "repro", "--single-item", stage["name"]], cwd=workdir, env=env,
                                log_path=stage_log(workdir, stage), display=display)
    if code != 0:
        raise StageFailed(failure_line(stage, code, tail, stage_log(workdir, stage).relative_to(workdir)), tail)


def failure_line(stage: dict, code: int, tail: str, log: Path) -> str:
    """The one line a failed stage ends the run with: its own last word (posttrain's one-line
    refusal when it gave one, else its last line) and where the rest of its output is."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    own = [line for line in lines if line.startswith("posttrain: ")]
    said = (own or lines or ["(no output)"])[-1].removeprefix("posttrain: ").removeprefix("error: ")[:1000]
    return f"{stage['name']} (dvc exit {code}): {said}" + ("" if str(log) in said else f" (its output: {log})")


def stage_host(workdir: str):
    """A warm host for the stage processes of this run (posttrain/runtime/stagehost.py): the
    libraries they import, imported once, while the run checks its data and opens its runs."""
    return stagehost.hosting(workdir, stage_env(workdir, PYTHONUNBUFFERED="1"))


def stage_log(workdir: str, stage: dict) -> Path:
    """Where the flow saves the stage's output (a stage a user added to dvc.yaml: logs/<its name>.log)."""
    own = known(stage["name"])
    return Path(workdir) / (own.log if own else Path("logs") / f"{stage['name']}.log")


def record_stage(stage: dict, workdir: str, run_id: str, tracking_uri: str, *,
                 failed: bool = False) -> tuple[dict, bool]:
    """The stage's log and DVC outputs on its child run; returns its metrics and whether DVC
    skipped it as up to date (its run then gets the metrics DVC had recorded, tagged
    `posttrain.cached`). A failed one ends FAILED."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    if stage_log(workdir, stage).is_file():
        client.log_artifact(run_id, str(stage_log(workdir, stage)), "logs")
    outputs = stage_outputs(workdir, stage["name"])
    if outputs:
        client.log_text(run_id, json.dumps(outputs, indent=2), "dvc_outputs.json")
    if failed:
        client.set_terminated(run_id, "FAILED")
        return {}, False
    metrics = stage_metrics(workdir, stage)
    if client.get_run(run_id).data.tags.get("posttrain.executed") != "true":
        client.set_tag(run_id, "posttrain.cached", "true")
        for name, value in flatten(metrics).items():
            client.log_metric(run_id, name, value)
        client.set_terminated(run_id, "FINISHED")
        return metrics, True
    if is_training(stage) and outputs and not metrics.get("off"):  # `sft: off` outputs no model
        log_checkpoint(client, stage, run_id, outputs, metrics)
    return metrics, False


def is_training(stage: dict) -> bool:
    return getattr(known(stage["name"]), "trains", False)


def own_model_prefix(name: str, metrics: dict) -> str | None:
    """The prefix of a training stage's figures of the model it outputs as its own: "" for
    SFT, "candidate_" for a GRPO stage whose gate accepted it; None for a rejected one (it
    outputs the model before it, scored by its own stage) and for `sft: off` (no model)."""
    kind = kind_of(name)
    if kind == "sft":
        return None if metrics.get("off") else ""
    return "candidate_" if kind == "grpo" and metrics.get("accepted") == 1.0 else None


def log_checkpoint(client, stage: dict, run_id: str, outputs: dict[str, str], metrics: dict) -> None:
    """The model a training stage output, as an MLflow logged model of its child run: the
    bytes stay in DVC (tags `dvc.path`, `dvc.md5`: `dvc pull` restores them), the stage's
    held-out figures of that model are linked to it (a GRPO stage's candidate's when the
    gate accepted it; a rejected stage outputs the model before it, scored by its own stage)."""
    from posttrain.tracking.lineage import log_model

    path = stage["outs"][0]  # the model folder (dvc.yaml: a training stage's one output besides metrics and plots)
    md5 = outputs.get(path, "")
    prefix = own_model_prefix(stage["name"], metrics)
    accepted = prefix is not None
    figures = {f"stage.{k}": v for k, v in flatten(metrics).items()
               if accepted and k.startswith((f"{prefix}greedy_accuracy", f"{prefix}pass_at_"))}
    log_model(client, run_id, stage["name"].replace("@", "-"), metrics=figures,
              tags={"posttrain.stage": stage["name"], "dvc.path": path, "dvc.md5": md5,
                    "posttrain.scoring.gate": "accepted" if accepted else "rejected"})


@task(name="push_data", retries=2, retry_delay_seconds=5, **TASK_DEFAULTS)
def push_data(workdir: str, targets: list[str] | None = None) -> str:
    """`dvc push` to the default remote (data and models, or just `targets`), when one is configured."""
    remote = subprocess.run([tool_path("dvc"), "remote", "default"], cwd=workdir, capture_output=True, text=True)
    if remote.returncode != 0 or not remote.stdout.strip():
        return "no DVC remote configured: nothing pushed"
    done = subprocess.run([tool_path("dvc"), "--wait-for-lock", "push", "--quiet", *(targets or [])], cwd=workdir, env=stage_env(workdir),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"dvc push failed: {done.stderr.strip()[-500:]}")
    return f"pushed to DVC remote {remote.stdout.strip()!r}"


def greedy_so_far(results: dict[str, dict]) -> float | None:
    """The held-out greedy accuracy of the chain's latest model (SFT's, then each accepted
    GRPO candidate's): what the next GRPO stage starts from, for its end-of-stage line."""
    greedy = None
    for name, metrics in results.items():
        prefix = own_model_prefix(name, metrics)
        if prefix is not None:
            greedy = metrics.get(f"{prefix}greedy_accuracy", greedy)
    return greedy


def final_model(config, stages: list[dict], workdir: str) -> str:
    """The pipeline's result: the model folder the last GRPO stage outputs, as dvc.yaml names it."""
    last = stageid.final(config).dvc
    return str(Path(workdir) / next(s["outs"][0] for s in stages if s["name"] == last))
