"""Scheduled retraining: the `retrain` flow as a Prefect deployment on a cron schedule,
served in this process or deployed to a work pool.

    posttrain serve --workdir . --cron "0 3 * * *"

registers the deployment `retrain/nightly` with the Prefect API (`PREFECT_API_URL`: a
`prefect server start` or Prefect Cloud) and serves it: this process polls for
scheduled and manually triggered runs (`prefect deployment run retrain/nightly`) and
runs each in a subprocess. The deployment's concurrency limit is 1 with the ENQUEUE
strategy, so a run that comes due while another is running waits in the queue
(`AwaitingConcurrencySlot`) instead of writing the same outputs at once.

    posttrain serve --workdir . --cron "0 3 * * *" --work-pool gpu-pool

registers the same deployment (schedule, parameters, concurrency limit, tags,
description) on the work pool `gpu-pool` instead, and exits: whichever worker polls the
pool (`prefect worker start --pool gpu-pool`) runs the flow. No image is built and no
code is pushed: the entrypoint is the module path `flows.retrain.retrain`, so the worker
needs posttrain installed and the workspace (an absolute path, the `workdir` parameter)
on its file system, as a `process` pool on this machine or a shared disk gives it.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from prefect import serve
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.types.entrypoint import EntrypointType

from flows.retrain import retrain
from posttrain.errors import UserError

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


def deploy_to_pool(deployment, pool: str) -> str:
    """Register `deployment` (see `nightly`) on the work pool `pool`; the line that says so.

    A pool that does not exist is refused, not created: a pool's type and base job
    template (image, resources, environment) are its owner's choice, often a platform
    team's, and one created here with defaults would run the flow somewhere nobody chose.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            raise UserError(f"posttrain serve --work-pool {pool}", "no such work pool on the Prefect server",
                            f"create it (`prefect work-pool create {shlex.quote(pool)} --type process`), "
                            "or name an existing one (`prefect work-pool ls`)") from None
    deployment.apply(work_pool_name=pool)  # what prefect.deploy does after its checks, without its tables
    return (f"Deployed {deployment.full_name} to work pool {pool!r} ({deployment.description.rstrip('.')}); "
            f"start a worker to run its runs: prefect worker start --pool {shlex.quote(pool)}")
