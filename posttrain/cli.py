"""The `posttrain` command: parses arguments and calls the library, nothing more.

Bad input of any kind exits 2 with one line on stderr and no traceback; a server a
command needs that does not answer is bad input too. No printed message carries a password.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from posttrain.errors import GateFailure, ReplayError, UserError
from posttrain.io import PARAMS_FILE
from posttrain.profiles import PACKAGED as PACKAGED_PROFILES
from posttrain.redact import redact_text

# Offline by default: real models are local paths; Prefect and DVC send no telemetry.
OFFLINE_DEFAULTS = {
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}


# Path arguments of each stage command; dvc.yaml names the paths, the stage's main takes them.
STAGE_ARGS = {
    "prepare": ["data_dir", "datasets_dir", "model_dir", "metrics_path"],
    "sft": ["data_dir", "base_dir", "out_dir", "checkpoint_dir", "metrics_path", "curve_path"],
    "grpo": ["name", "data_dir", "init_dir", "out_dir", "checkpoint_dir", "metrics_path", "curve_path"],
    "serving": ["data_dir", "models_dir", "gpus_path", "report_path", "metrics_path", "plot_path"],
    "evaluate": ["data_dir", "models_dir", "metrics_path", "outcomes_path", "accuracy_plot", "pass_at_k_plot",
                 "pass_at_k_png"],
}


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too)
        raise UserError(self.prog, message, f"see '{self.prog} --help'")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="posttrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    check = sub.add_parser("check", help="validate a config and exit")
    check.add_argument("--config", required=True)
    stage = sub.add_parser("stage", help="run one pipeline stage (dvc.yaml calls this)")
    stage_sub = stage.add_subparsers(dest="stage", required=True, parser_class=Parser)
    for name, args in STAGE_ARGS.items():
        one = stage_sub.add_parser(name)
        one.add_argument("--config", required=True)
        for arg in args:
            one.add_argument("--" + arg.replace("_", "-"), dest=arg, required=True)
    run = sub.add_parser("run", help="run the retrain flow (Prefect) on a workspace")
    run.add_argument("--workdir", help="git + DVC workspace holding dvc.yaml and " + PARAMS_FILE +
                     " (default: this folder, or runs/<config name> with --config)")
    run.add_argument("--config", help="a variant config (e.g. configs/sql.yaml): run it in its own workspace, "
                     "created on first use")
    serve = sub.add_parser("serve", help="serve the retrain flow as a Prefect deployment on a cron schedule")
    serve.add_argument("--workdir", default=".", help="the workspace each scheduled run retrains (default: here)")
    serve.add_argument("--cron", default="0 3 * * *", help="when runs are due (cron syntax; default daily 03:00)")
    serve.add_argument("--timezone", default="UTC")
    serve.add_argument("--name", default="nightly", help="deployment name: runs are `retrain/<name>`; "
                       "one name per workspace (a second serve with the same name takes the deployment over)")
    replay = sub.add_parser("replay", help="rerun a recorded retrain run from its git + DVC state, compare metrics")
    replay.add_argument("run_id", metavar="RUN_ID", help="the retrain (parent) run's id")
    replay.add_argument("--scratch", help="empty folder for the checkout (default: a new temporary folder)")
    replay.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here")
    add_kv_parser(sub)
    compare = sub.add_parser("compare", help="runs side by side: differing params, metrics with deltas, a plot")
    compare.add_argument("runs", nargs="+", metavar="RUN", help="run ids, or the aliases champion / challenger")
    compare.add_argument("--out", default="compare.png", help="where the overlay plot (PNG) goes")
    compare.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here")
    from posttrain.config import PromotionSection, StatsSection

    compare.add_argument("--model-name", default=PromotionSection().model_name,
                         help="registered model the aliases refer to (promotion.model_name)")
    compare.add_argument("--alpha", type=float, help="a delta is significant when its two-sided p-value is below "
                         f"this (default: the first run's stats.alpha, else {StatsSection().alpha})")
    compare.add_argument("--resamples", type=int, help="bootstrap resamples for the pass@k tests (default: the "
                         f"first run's stats.bootstrap_resamples, else {StatsSection().bootstrap_resamples})")
    return parser


def add_kv_parser(sub) -> None:
    kv = sub.add_parser("kv", help="KV-cache capacity of a model on a GPU, from its config.json")
    kv.add_argument("model", help="model folder or config.json")
    kv.add_argument("--gpu", default="H100-80GB")
    kv.add_argument("--gpus", default=str(PACKAGED_PROFILES), help="GPU profiles file (default: the packaged ones)")
    kv.add_argument("--kv-memory-gib", type=float, help="KV memory per GPU, exactly (vLLM kv_cache_memory_bytes)")
    kv.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    kv.add_argument("--context", type=int, default=8192)
    kv.add_argument("--tp", type=int, default=1)
    kv.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto")
    kv.add_argument("--block-size", type=int, default=16)
    kv.add_argument("--json", action="store_true")


def dispatch(args) -> int:
    from posttrain.config import load_config

    if args.command == "check":
        load_config(args.config)
        print(f"{args.config}: ok")
    elif args.command == "stage":
        config = load_config(args.config, check_trl=False)
        kwargs = {a: getattr(args, a) for a in STAGE_ARGS[args.stage]}
        if args.stage == "grpo" and args.name not in config.grpo:
            raise UserError("posttrain stage grpo --name", f"no GRPO stage {kwargs['name']!r} in {args.config}",
                            f"use one of {list(config.grpo)}")
        import importlib
        metrics = importlib.import_module(f"posttrain.stages.{args.stage}").main(config, **kwargs)
        print(json.dumps(metrics, indent=2, sort_keys=True))
    elif args.command == "run":
        run_workspace(args)
    elif args.command == "compare":
        from posttrain.compare import check_out, compare

        if len(args.runs) < 2:
            raise UserError("posttrain compare", "needs at least two runs", "pass two or more run ids or aliases")
        check_stats_options(args)
        check_out(args.out)
        print(compare(args.runs, out=args.out, tracking_uri=cli_tracking_uri(args), model_name=args.model_name,
                      alpha=args.alpha, resamples=args.resamples))
    elif args.command == "replay":
        from posttrain.replay import replay

        report, differ = replay(args.run_id, tracking_uri=cli_tracking_uri(args), scratch=args.scratch)
        print(report)
        return 1 if differ else 0
    elif args.command == "serve":
        serve_workspace(args)
    elif args.command == "kv":
        from posttrain.kv_cli import run_kv
        return run_kv(args)
    return 0


def run_workspace(args) -> None:
    """`posttrain run`: check the inputs, then the flow, holding the workspace's lock
    throughout (a variant's workspace is rewritten first: not under a running flow)."""
    from pathlib import Path

    from posttrain import workspace
    from posttrain.config import load_config, read_config_dict
    from posttrain.ingest import check_pending

    workdir = args.workdir or (os.path.join("runs", Path(args.config).stem) if args.config else ".")
    servers_and_config("run", args.config or os.path.join(workdir, PARAMS_FILE), temporary_prefect=True)
    if args.config and not Path(workdir, "dvc.yaml").is_file():
        workspace.create(workdir, read_config_dict(Path(args.config)))
    if not (Path(workdir, "dvc.yaml").is_file() and Path(workdir, ".dvc").is_dir()):
        raise UserError(f"posttrain run --workdir {workdir}", "not a DVC workspace (no dvc.yaml or .dvc/)",
                        "run in this repository's root, or use --config FILE to create a workspace")
    with workspace.lock(workdir, log=lambda message: print(message, file=sys.stderr, flush=True)):
        if args.config:
            workspace.prepare(workdir, read_config_dict(Path(args.config)))
        check_pending(workdir, load_config(os.path.join(workdir, PARAMS_FILE)))  # bad rows: exit 2 here
        from flows.retrain import retrain
        retrain(workdir=workdir)


def check_stats_options(args) -> None:
    """`--alpha` / `--resamples` within the bounds `stats:` has in a config."""
    from pydantic import ValidationError

    from posttrain.config import StatsSection

    given = {k: v for k, v in {"alpha": args.alpha, "bootstrap_resamples": args.resamples}.items() if v is not None}
    try:
        StatsSection(**given)
    except ValidationError as err:
        first = err.errors()[0]
        flag = "--alpha" if first["loc"][0] == "alpha" else "--resamples"
        raise UserError(f"posttrain compare {flag}", first["msg"], "see 'posttrain compare --help'") from None


def cli_tracking_uri(args) -> str:
    """--tracking-uri, else MLFLOW_TRACKING_URI, else the embedded default's store here.
    A SQLite store that does not exist is an error (MLflow would create an empty one), and
    so is a server that does not answer."""
    from posttrain.probe import check_tracking

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not os.path.isfile(uri[len("sqlite:///"):]):
        raise UserError(f"posttrain {args.command}", f"no MLflow store at {uri}",
                        "run where `make run` ran, or pass --tracking-uri / set MLFLOW_TRACKING_URI")
    check_tracking(uri, command=args.command,
                   source="--tracking-uri" if args.tracking_uri else "MLFLOW_TRACKING_URI")
    return uri


def servers_and_config(command: str, config_path: str, *, temporary_prefect: bool):
    """The validated config, once the MLflow and Prefect servers the command will use have
    answered: those the environment names first (a dead one costs minutes of retries later,
    after the workspace is written), then those of the config and the Prefect profile."""
    from posttrain.config import load_config
    from posttrain.probe import check_prefect, check_tracking, profile_api_url

    env_tracking, env_prefect = os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("PREFECT_API_URL")
    check_tracking(env_tracking, command=command)
    check_prefect(env_prefect, command=command, temporary_ok=temporary_prefect)
    config = load_config(config_path)
    if not env_tracking:
        check_tracking(config.tracking.uri, command=command, source=f"tracking.uri in {config_path}")
    if not env_prefect:
        check_prefect(profile_api_url(), command=command, temporary_ok=temporary_prefect)
    return config


def serve_workspace(args) -> None:
    """Check the workspace, the servers and the schedule, then serve until stopped."""
    if not os.path.isfile(os.path.join(args.workdir, "dvc.yaml")):
        raise UserError(f"posttrain serve --workdir {args.workdir}", "no dvc.yaml there",
                        "pass a posttrain workspace (this repository, or runs/<name>)")
    servers_and_config("serve", os.path.join(args.workdir, PARAMS_FILE), temporary_prefect=False)
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:  # an ephemeral API runs no scheduler: runs would never come due
        raise UserError("posttrain serve", "PREFECT_API_URL is not set",
                        "start a server (`prefect server start`) and export PREFECT_API_URL=http://HOST:4200/api")
    from flows.deploy import nightly, serve_nightly

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
    serve_nightly(deployment)


def main(argv: list[str] | None = None) -> int:
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        return dispatch(build_parser().parse_args(argv))
    except UserError as err:
        return refuse("error", err, 2)
    except GateFailure as err:
        return refuse("gate failed", err, 3)
    except ReplayError as err:
        return refuse("replay failed", err, 4)


def refuse(kind: str, err: Exception, code: int) -> int:
    """Print the one-line reason, passwords masked (library errors quote URIs whole)."""
    print(redact_text(f"posttrain: {kind}: {err}"), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
