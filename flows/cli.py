"""The `posttrain` command: the library's commands (posttrain/cli.py) plus the two that
drive the pipeline's DVC graph, `run`, `serve` and `replay`. It lives on the flows side so that the library never
imports a flow: dependencies point one way, flows -> tasks -> posttrain.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from posttrain import cli
from posttrain.errors import UserError
from posttrain.layout import PARAMS_FILE
from tasks.checks import check_incoming, quick_nothing_to_do, servers_and_config


def add_flow_commands(sub) -> None:
    """`run`, `serve` and `replay`: the commands that drive the pipeline's DVC graph."""
    run = sub.add_parser("run", help="run the retrain flow (Prefect) on a workspace")
    run.add_argument("--workdir", help="git + DVC workspace holding dvc.yaml and " + PARAMS_FILE +
                     " (default: this folder, or runs/<config name> with --config)")
    run.add_argument("--config", help="a variant config (e.g. configs/sql.yaml): run it in its own workspace, "
                     "created on first use")
    serve = sub.add_parser("serve", help="serve the retrain flow as a Prefect deployment on a cron schedule "
                           "(or deploy it to a work pool: --work-pool)")
    serve.add_argument("--workdir", default=".", help="the workspace each scheduled run retrains (default: here)")
    serve.add_argument("--cron", default="0 3 * * *", help="when runs are due (cron syntax; default daily 03:00)")
    serve.add_argument("--timezone", default="UTC")
    serve.add_argument("--name", default="nightly", help="deployment name: runs are `retrain/<name>`; "
                       "one name per workspace (a second serve with the same name takes the deployment over)")
    serve.add_argument("--work-pool", metavar="NAME", help="register the deployment on this existing Prefect work "
                       "pool and exit, instead of serving it here: a worker (`prefect worker start --pool NAME`) "
                       "runs its runs")
    replay = sub.add_parser("replay", help="rerun a recorded retrain run from its git + DVC state, compare metrics")
    replay.add_argument("run_id", metavar="RUN_ID", help="the retrain (parent) run's id")
    replay.add_argument("--scratch", help="empty folder for the checkout (default: a new temporary folder)")
    replay.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here")


def dispatch(args) -> int:
    if args.command == "run":
        run_workspace(args)
        return 0
    if args.command == "serve":
        serve_workspace(args)
        return 0
    if args.command == "replay":
        from tasks.replay import replay

        report, differ = replay(args.run_id, tracking_uri=cli.cli_tracking_uri(args), scratch=args.scratch)
        print(report)
        return 1 if differ else 0
    return cli.dispatch(args)


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, parser=cli.build_parser(add_flow_commands), dispatch=dispatch)


def run_workspace(args) -> None:
    """`posttrain run`: check the inputs, then the flow, holding the workspace's lock
    throughout (a variant's workspace is rewritten first: not under a running flow)."""
    workdir = os.path.abspath(args.workdir or (os.path.join("runs", Path(args.config).stem) if args.config else "."))
    if not args.config and Path(workdir, "dvc.yaml").is_file() and Path(workdir, ".dvc").is_dir():
        from flows.lock import lock  # a variant's workspace is rewritten first: the full path decides for it

        with lock(workdir, log=lambda message: print(message, file=sys.stderr, flush=True)):
            unchanged = quick_nothing_to_do(workdir)
        if unchanged:
            print(unchanged)
            return
    with early_stage_host(workdir):
        run_checked_workspace(args, workdir)


def early_stage_host(workdir: str):
    """The run's stage host, started before the checks when the workspace exists already:
    it imports TRL and torch for the config check (tasks.checks.checked_in_host) and goes
    on with the stages' imports while Prefect starts (the flow starts one otherwise)."""
    import contextlib

    if not Path(workdir, "dvc.yaml").is_file():
        return contextlib.nullcontext()
    from tasks.dvc_stages import stage_host

    return stage_host(workdir)


def run_checked_workspace(args, workdir: str) -> None:
    from flows.lock import lock
    from posttrain import workspace
    from posttrain.config import read_config_dict

    config_path = args.config or os.path.join(workdir, PARAMS_FILE)
    check_incoming(workdir, config_path)  # cheap checks first: bad new rows are refused before TRL is imported
    servers_and_config("run", config_path, temporary_prefect=True, meanwhile=checked_meanwhile)
    if args.config and not Path(workdir, "dvc.yaml").is_file():
        with contextlib.suppress(UserError):  # another run created it meanwhile: both run in it, in turn
            workspace.create(workdir, read_config_dict(Path(args.config)))
    if not (Path(workdir, "dvc.yaml").is_file() and Path(workdir, ".dvc").is_dir()):
        given = (f"--workdir {args.workdir}" if args.workdir else f"--config {args.config}" if args.config
                 else "(in this folder)")
        raise UserError(f"posttrain run {given}", f"{workdir} is not a DVC workspace (no dvc.yaml or .dvc/)",
                        "run in this repository's root, or use --config FILE to create a workspace")
    with lock(workdir, log=lambda message: print(message, file=sys.stderr, flush=True)):
        if args.config:
            workspace.prepare(workdir, read_config_dict(Path(args.config)))
        # bad rows: exit 2 here (the config's trl: blocks were checked above)
        check_incoming(workdir, os.path.join(workdir, PARAMS_FILE))
        from flows import ephemeral_api
        from flows.retrain import retrain
        from tasks.display import quiet_stage_failures

        quiet_stage_failures()  # a failed stage ends the run in one line (cli.main: StageFailed), no tracebacks

        ephemeral_api.bind_to_process()  # Prefect's temporary API server ends with this process, kill -9 included
        ephemeral_api.announce()  # the input is accepted: Prefect's lines about its server are shown
        retrain(workdir=workdir, checked=True)


def checked_meanwhile(config_path: str) -> str | None:
    """The run's check by its stage host (tasks.checks.checked_in_host), while this
    process imports the flow and starts Prefect's temporary server (4 s on 2 cores): the
    host's imports keep one core busy, this process would wait on the other. A refused
    config ends the run before any flow run exists (the server ends with the process)."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.checks import checked_in_host

    with ThreadPoolExecutor(1) as pool:
        checked = pool.submit(checked_in_host, config_path)
        from flows import ephemeral_api

        ephemeral_api.start_now()
        return checked.result()


def serve_workspace(args) -> None:
    """Check the workspace, the servers and the schedule, then serve until stopped, or
    register the deployment on the work pool `--work-pool` and return."""
    if not os.path.isfile(os.path.join(args.workdir, "dvc.yaml")):
        raise UserError(f"posttrain serve --workdir {args.workdir}", "no dvc.yaml there",
                        "pass a posttrain workspace (this repository, or runs/<name>)")
    servers_and_config("serve", os.path.join(args.workdir, PARAMS_FILE), temporary_prefect=False)
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:  # an ephemeral API runs no scheduler: runs would never come due
        raise UserError("posttrain serve", "PREFECT_API_URL is not set",
                        "start a server (`prefect server start`) and export PREFECT_API_URL=http://HOST:4200/api")
    from flows.deploy import deploy_to_pool, nightly, serve_nightly

    import zoneinfo

    try:
        zoneinfo.ZoneInfo(args.timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise UserError(f"posttrain serve --timezone {args.timezone}", "unknown time zone",
                        "give an IANA name such as UTC or Europe/Berlin") from None
    try:
        deployment = nightly(args.workdir, args.cron, args.timezone, args.name)
    except ValueError as err:
        raise UserError(f"posttrain serve --cron {args.cron!r}", str(err).splitlines()[0],
                        "give five cron fields, e.g. '0 3 * * *'") from None
    if args.work_pool is not None:
        if not args.work_pool.strip():
            raise UserError("posttrain serve --work-pool", "the pool name is empty",
                            "name an existing work pool (`prefect work-pool ls`), or leave out --work-pool to serve here")
        print(deploy_to_pool(deployment, args.work_pool))
    else:
        serve_nightly(deployment)


if __name__ == "__main__":
    sys.exit(main())
