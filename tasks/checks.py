"""The run's check of its config, on the flows' side: asked of the run's stage host when
one answers (TRL and torch are imported there once, for the checks and the stages), else
done in this process. The library's config is data (posttrain.config); what it takes to
run is posttrain.preflight's, and where that check runs is the caller's business. Here too
what `posttrain run` and `serve` check before a flow starts: the rows waiting in incoming/,
the servers, and whether the run has anything to do at all.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from posttrain.runtime import stagehost
from posttrain.errors import UserError
from posttrain.layout import PARAMS_FILE


def checked_in_host(path: str | Path, cwd: str | None = None) -> str | None:
    """`posttrain check` of `path` done by the run's stage host in folder `cwd` (default:
    this process's): what `fit.check` said, a `UserError` as the check raised it, or None
    when no host did it (check here)."""
    done = stagehost.run_json(["check", "--config", str(path), "--as-json"], cwd=cwd)
    if done is None or done[0] not in (0, 2):
        return None
    code, answer = done
    if code == 2:
        raise UserError(answer["where"], answer["problem"], answer["fix"])
    return answer["fits"]


def check_workspace(workdir: str, path: str | Path | None = None) -> str:
    """`posttrain check` of workspace `workdir`'s config `path` (default: its params file):
    by the run's stage host when one answers (in the workspace's folder), else here."""
    from posttrain import cli
    from posttrain.plugins import workspace

    path = Path(workdir) / PARAMS_FILE if path is None else path
    fits = checked_in_host(path, cwd=workdir)
    if fits is not None:
        return fits
    with workspace(workdir):
        return cli.full_check(str(path), here=True)


def check_incoming(workdir: str, config_path: str) -> None:
    """The rows waiting in incoming/, judged by the config's environment (checked first):
    UserError on a bad row, and on what the environment's own code raises (one line naming
    it and its frame). Nothing is read when nothing waits."""
    from posttrain import ingest, preflight
    from posttrain.config import load_config
    from posttrain.plugins import plugin_refusal, workspace

    if not ingest.pending(workdir):
        return
    config = load_config(config_path)
    with workspace(workdir):  # the config's paths and imports (custom/) are the workspace's
        env, splits = preflight.environment(Path(config_path), config)  # its data generated once
        with plugin_refusal(f"{config_path}: data.env", config.data.env):
            ingest.validate(workdir, env, ingest.heldout_prompts(splits))


def quick_nothing_to_do(workdir: str) -> str | None:
    """"Nothing to do" when the workspace is exactly a finished retrain run's (no new data,
    DVC finds every stage up to date, a finished run recorded this dvc.lock and params file):
    before the full check (which imports TRL) and before Prefect's temporary server starts,
    the seconds a no-op run would spend. That params file passed the full check when the
    run it matches ran. The workspace's record of its last finished run answers without
    MLflow (posttrain.tracking.mlflow_runs.recorded_finish); without one, the MLflow store
    does (and what a killed run left RUNNING is marked). None, and the full path decides,
    when anything differs or cannot be read here, or the tracking store is a server that
    does not answer at once (MLflow's client would retry for minutes)."""
    from posttrain import ingest
    from posttrain.config import PipelineConfig, read_config_dict
    from posttrain.tracking.mlflow_runs import nothing_to_do, recorded_finish, tracking_uri

    try:
        if not Path(workdir, "dvc.yaml").is_file() or ingest.pending(workdir):
            return None
        config = PipelineConfig.model_validate(read_config_dict(Path(workdir, PARAMS_FILE)))
        uri = tracking_uri(config, workdir)
        found = recorded_finish(workdir, uri) or finished_in_store(workdir, config, uri)
    except Exception:  # noqa: BLE001 - any doubt: the full path checks and reports it
        return None
    return nothing_to_do(*found, uri) if found else None


def finished_in_store(workdir: str, config, uri: str) -> tuple[str, str] | None:
    """The finished run the tracking store holds for this state (a workspace without a
    record of it): marks what a killed run left RUNNING (under the lock, as the flow
    does), and records it for the next run."""
    from posttrain.probe import http_problem
    from posttrain.tracking.mlflow_runs import finished_run, record_finished

    if uri.startswith(("http://", "https://")) and http_problem(uri.rstrip("/") + "/health", 2.0):
        return None
    found = finished_run(workdir, config, uri)
    if found:
        from posttrain.tracking import dead_runs

        dead_runs.mark_dead_runs(uri, os.path.abspath(workdir), f"process {os.getpid()} (posttrain run: nothing to do)")
        record_finished(workdir, *found, uri)
    return found


def servers_and_config(command: str, config_path: str, *, temporary_prefect: bool,
                       meanwhile: Callable[[str], str | None] | None = None):
    """The config, checked whole (`posttrain check`), once the MLflow and Prefect servers the
    command will use have answered: those the environment names first (a dead one costs
    minutes of retries later, after the workspace is written), then those of the config
    and the Prefect profile. `meanwhile(config_path)`, for `run`: the check done elsewhere
    while the caller starts its flow's servers (None: not done, check here)."""
    from posttrain import cli
    from posttrain.config import load_config
    from posttrain.probe import check_prefect, check_tracking, profile_api_url

    env_tracking, env_prefect = os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("PREFECT_API_URL")
    check_tracking(env_tracking, command=command)
    check_prefect(env_prefect, command=command, temporary_ok=temporary_prefect)
    config = load_config(config_path)
    if meanwhile is None or meanwhile(config_path) is None:  # by the run's stage host, else here
        cli.full_check(config_path, here=True)  # every training stage fits training.gpu: before any server or compute
    if not env_tracking:
        check_tracking(config.tracking.uri, command=command, source=f"tracking.uri in {config_path}")
    if not env_prefect:
        check_prefect(profile_api_url(), command=command, temporary_ok=temporary_prefect)
    return config
