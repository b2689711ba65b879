"""The run's checks of its config, on the flows side: asked of the run's stage host when
one answers (TRL and torch are imported there once, for the checks and the stages), else
done in this process. The library's config is data (posttrain.config); what it takes to
run is posttrain.preflight's, and where that check runs is the caller's business.
"""

from __future__ import annotations

from pathlib import Path

from posttrain import stagehost
from posttrain.errors import UserError


def checked_in_host(path: str | Path) -> str | None:
    """`posttrain check` of `path` done by the run's stage host: what `fit.check` said, a
    `UserError` as the check raised it, or None when no host did it (check here)."""
    done = stagehost.run_json(["check", "--config", str(path), "--as-json"])
    if done is None or done[0] not in (0, 2):
        return None
    code, answer = done
    if code == 2:
        raise UserError(answer["where"], answer["problem"], answer["fix"])
    return answer["fits"]


def checked_here(path: str | Path, config) -> str:
    """`posttrain check` of `path` in this process: every preflight check against this
    machine, then whether each training stage fits `training.gpu` (posttrain.fit)."""
    from posttrain import fit, preflight

    chars = preflight.everything(path, config, here=True)
    return fit.check(path, config, prompt_chars=chars)


def full_check(path: str | Path, config) -> str:
    """`posttrain check` of `path`: by the run's stage host when one answers, else here."""
    fits = checked_in_host(path)
    return checked_here(path, config) if fits is None else fits
