"""Scheduled retraining: the `retrain` flow as a Prefect deployment on a cron schedule.

    posttrain serve --workdir . --cron "0 3 * * *"

registers the deployment `retrain/nightly` with the Prefect API (`PREFECT_API_URL`: a
`prefect server start` or Prefect Cloud) and serves it: this process polls for
scheduled and manually triggered runs (`prefect deployment run retrain/nightly`) and
runs each in a subprocess. The deployment's concurrency limit is 1 with the ENQUEUE
strategy, so a run that comes due while another is running waits in the queue
(`AwaitingConcurrencySlot`) instead of writing the same outputs at once.
"""

from __future__ import annotations

from pathlib import Path

from prefect import serve
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.types.entrypoint import EntrypointType

from flows.retrain import retrain

DEPLOYMENT = "nightly"
CRON = "0 3 * * *"  # 03:00 every day, in `timezone`


def nightly(workdir: str = ".", cron: str = CRON, timezone: str = "UTC", name: str = DEPLOYMENT):
    """The `retrain` deployment for `workdir`, one run at a time."""
    from prefect.schedules import Cron

    return retrain.to_deployment(
        name=name,
        schedules=[Cron(cron, timezone=timezone)],
        parameters={"workdir": str(Path(workdir).resolve())},
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
        tags=["posttrain"],
        entrypoint_type=EntrypointType.MODULE_PATH,  # flows/ is installed: runs from any folder
        description=f"Retrain the posttrain workspace {Path(workdir).resolve()} on '{cron}' ({timezone}).",
    )


def serve_nightly(deployment) -> None:
    """Register `deployment` (see `nightly`) and run its runs here until stopped (Ctrl-C)."""
    serve(deployment, limit=1)
