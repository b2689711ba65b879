"""The run's check of its config, on the flows' side: asked of the run's stage host when
one answers (TRL and torch are imported there once, for the checks and the stages), else
done in this process. The library's config is data (posttrain.config); what it takes to
run is posttrain.preflight's, and where that check runs is the caller's business.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.runtime import stagehost
from posttrain.errors import UserError


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
    from posttrain.layout import PARAMS_FILE
    from posttrain.plugins import workspace

    path = Path(workdir) / PARAMS_FILE if path is None else path
    fits = checked_in_host(path, cwd=workdir)
    if fits is not None:
        return fits
    with workspace(workdir):
        return cli.full_check(str(path), here=True)
