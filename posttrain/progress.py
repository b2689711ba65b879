"""How far a stage's work has got, as one line per update on stdout.

A stage names the piece of work it is in (`phase`: training, the pass-rate filter, a
gate's evaluation, sampling, the vLLM start; `tracking.compute` names them) and its loops
say how much of it is done (`update`). Each update is one line, `posttrain-progress
{json}`: the flow (tasks/display.py) turns them into its live display and keeps them out
of the stage's log; run by hand (`dvc repro`) they are readable as they are. Lines come
at most every 1% of a phase or every 2 s, whichever is rarer, and always at its end.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

PREFIX = "posttrain-progress "
MIN_SECONDS = 2.0
_state: dict = {"phase": None, "shown": None, "percent": -1, "at": 0.0, "done": 0}  # what was shown last


def emit(event: dict) -> None:
    print(PREFIX + json.dumps(event, sort_keys=True), file=sys.stdout, flush=True)


@contextlib.contextmanager
def phase(name: str):
    """The stage is in `name` for the block: an update without a total (the display shows
    its elapsed time) now, and updates from the loops inside it."""
    before = _state["phase"]
    _state.update(phase=name, shown=name, percent=0, at=time.monotonic(), done=0)
    emit({"phase": name, "done": 0, "total": None})
    try:
        yield
    finally:
        _state["phase"] = before


def update(done: int, total: int | None, **figures: float) -> None:
    """`done` of `total` units of the current phase (steps, prompts), with figures to show
    (loss, reward). Shown at most every 1% or `MIN_SECONDS`, and at the end."""
    name = _state["phase"]
    if name is None:
        return
    percent, now = (100 * done // total if total else 0), time.monotonic()
    if _state["shown"] == name and done < _state["done"]:  # a new loop in the phase (the next model's prompts):
        _state.update(percent=-1, at=float("-inf"))  # shown at once, so the display's clock starts with it
    _state["done"] = done
    final = bool(total) and done >= total
    if _state["shown"] == name and not final and (percent <= _state["percent"] or now - _state["at"] < MIN_SECONDS):
        return
    _state.update(shown=name, percent=percent, at=now)
    emit({"phase": name, "done": done, "total": total,
          **{k: round(float(v), 4) for k, v in figures.items() if v is not None}})


def parse(line: str) -> dict | None:
    """The update a stage's output line carries, or None for any other line."""
    if not line.startswith(PREFIX):
        return None
    try:
        event = json.loads(line[len(PREFIX):])
    except ValueError:
        return None
    return event if isinstance(event, dict) and "phase" in event else None
